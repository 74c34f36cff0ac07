//! The declared-vs-observed diff and gate.
//!
//! **Evidence first.** Each observed source (a record directory, a JSONL file, or an exported
//! `assay.tool_decision_surface.v0` envelope; several may be given) is one of:
//! * *flowhost records*: a directory, or a file or envelope in which any decision carries the
//!   `flowhost` chain fields (`seq`, `prev_hash`). Its hash chain is verified first with
//!   [`crate::records::chain`] (for a directory also its head anchor; an envelope is parsed
//!   with [`crate::canonical::parse_unique_keys`], so no key is repeated anywhere in it, and its
//!   decisions are decoded strictly and re-serialised as the writer serialises them; the judge
//!   reads that same parsed value). Any break, gap, reorder, edit, torn line, or line that is
//!   not a valid flowhost record *rejects* the source: it is not judged, and each problem is
//!   an `evidence_rejected` finding naming file and line (or envelope index). A key repeated
//!   in an envelope, or a target field named twice in any decision, is an input error.
//! * *unchained*: no decision carries the chain fields (another producer's decisions, or
//!   records whose extension was stripped). They are judged, but cannot be bound to a
//!   flowhost health: unless the operator says another observer produced them
//!   ([`DiffOptions::unchained_from_other_observer`]), they make the result inconclusive.
//!
//! **Health binding.** A `tool_observation_health` vouches for one record stream:
//! `records.first_seq..=records.last_seq`, `records.chain_head` (the line hash of record
//! `last_seq`) and `tool_calls_observed` (the records with `flowhost.event` `tool_call` in that
//! range). The verified flowhost records must show exactly that range, end in that head and
//! hold that many tool calls; every mismatch is named in an observation gap. With no flowhost
//! records observed, the health must vouch for none (no range, genesis head, zero calls).
//!
//! **Judging.** Every observed decision gets at most one outcome, by the first rule that
//! applies (a flowhost `session` event, a refusal before any tool was named, is verified
//! with its chain but judged as no tool action):
//!
//! | # | when | outcome | severity |
//! |---|---|---|---|
//! | 1 | `classification` is `not_observed` or `redaction_failed` | `inconclusive_observation_gap` | warning |
//! | 2 | unknown tool: `observed_unknown_tool`, no `tool.category`, or `action.class` `unclassified` | `unclassified_tool_action` | warning |
//! | 3 | a declared action matches: provider (= `action.target.provider`), action class (= `tool.category`), a target entry, and the effect (listed in `allowed_effects`) | none | |
//! | 4 | `decision.effect` is `deny` | `attempted_privileged_tool_action_denied` | note |
//! | 5 | a declared action has the same provider, class and effect, and the target cannot be decided against it (a constrained field is missing from the observed target, e.g. `classified_incomplete`) | `inconclusive_tool_target` | warning |
//! | 6 | otherwise | `new_privileged_tool_action` | error |
//!
//! An observed `error` effect matches only a declaration that lists `error` in
//! `allowed_effects`, never one that lists only `allow`: the effect may have happened, so an
//! errored call not declared with `error` is rule 6. Each decision is judged on its own: an
//! allowed call's `tool_call` and its `tool_outcome` are two decisions (a failed declared
//! call needs `allow` for the one and `error` for the other), and identical findings of the
//! two are merged with two occurrences.
//! A deny that a declaration lists with `deny` in `allowed_effects` is expected: no finding.
//! Declared-but-unobserved actions are never findings.
//!
//! In addition, every egress attempt (`flowhost.event` `egress_attempt`) whose
//! `flowhost.egress_basis` is `declared: false, observed: true` (allowed or refused) gives an
//! `undeclared_egress` finding (error): the signed declaration said the tool does not egress.
//!
//! **A fleet.** Several record streams (one per host) take one health each (`--health` given
//! as many times). Each health pairs with the verified stream whose chain head its
//! `records.chain_head` names, whatever the order given, and is then bound to that stream as
//! above. Every stream's observation must be complete and bound: a stream no health names, a
//! health that names no stream, two streams holding parts of one chain (one host's records
//! given as two hosts'), or any host's gap makes the fleet inconclusive. Each
//! source's `observation_complete` in the report says how its own host fared, once every gap
//! is known (its directory's missing head anchor and unattributed unchained decisions count;
//! with one health, every gap of the run does).
//!
//! Observation coverage adds at most one run-level `inconclusive_observation_gap` (warning)
//! when: no health carrier was given; a health is incomplete; it is not bound to the
//! observed records (above); unchained decisions were not attributed to another observer; a
//! record directory has no head anchor; or several flowhost record streams share one health.
//!
//! Exit codes ([`DiffReport::exit_code`]), by precedence: 2 (from the CLI) a usage or input
//! error; 4 evidence rejected (wins over any finding); 1 at least one finding other than an
//! observation gap; 3 no such finding but observation incomplete or unbound; 0 clean.
//! Identical findings (same outcome, server, tool, provider, class, effect and target) are
//! reported once with an occurrence count and up to [`MAX_EXAMPLES`] locations.

mod coverage;
mod judge;
mod observed;
pub mod report;
mod stream;
pub mod surface;

use coverage::*;
use judge::*;
use stream::*;

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::canonical::JsonError;
use crate::records::chain::{
    Gather, Location, Problem, VerifyReport, verify_decisions, verify_records,
    verify_records_gathering,
};
use crate::records::health::{HealthProducer, ToolObservationHealth};
use crate::records::store::StoreError;
use crate::records::{DECISION_SURFACE_SCHEMA, GENESIS_HASH};
use observed::{ObsDecision, ObsEnvelope, Probe};
use surface::{DeclaredAction, DeclaredSurface, TargetMatch};

/// Most `evidence_rejected` findings listed one by one; the rest are counted in one more.
pub const MAX_REJECTIONS: usize = 20;

/// The schema of the JSON report.
pub const DIFF_SCHEMA: &str = "flowhost.diff.v1";
/// How many locations a finding lists.
pub const MAX_EXAMPLES: usize = 5;

/// The outcome kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// An observed source claims to be flowhost records but does not verify.
    EvidenceRejected,
    /// An allowed (or errored) privileged action no declaration covers.
    NewPrivilegedToolAction,
    /// A tool attempted outbound I/O although its signed declaration says it does not.
    UndeclaredEgress,
    /// The target could not be decided against the declarations.
    InconclusiveToolTarget,
    /// An undeclared privileged action was attempted and denied.
    AttemptedPrivilegedToolActionDenied,
    /// Observation was incomplete, so absence of findings proves nothing.
    InconclusiveObservationGap,
    /// A tool with no record mapping was used.
    UnclassifiedToolAction,
}

/// Finding severities (SARIF levels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Must be reviewed: the run did something undeclared.
    Error,
    /// Cannot be judged clean.
    Warning,
    /// Enforcement held, but the attempt is worth knowing.
    Note,
}

impl FindingKind {
    /// Every kind, in report order.
    pub const ALL: [FindingKind; 7] = [
        FindingKind::EvidenceRejected,
        FindingKind::NewPrivilegedToolAction,
        FindingKind::UndeclaredEgress,
        FindingKind::InconclusiveToolTarget,
        FindingKind::UnclassifiedToolAction,
        FindingKind::InconclusiveObservationGap,
        FindingKind::AttemptedPrivilegedToolActionDenied,
    ];

    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::EvidenceRejected => "evidence_rejected",
            FindingKind::NewPrivilegedToolAction => "new_privileged_tool_action",
            FindingKind::UndeclaredEgress => "undeclared_egress",
            FindingKind::InconclusiveToolTarget => "inconclusive_tool_target",
            FindingKind::AttemptedPrivilegedToolActionDenied => {
                "attempted_privileged_tool_action_denied"
            }
            FindingKind::InconclusiveObservationGap => "inconclusive_observation_gap",
            FindingKind::UnclassifiedToolAction => "unclassified_tool_action",
        }
    }

    /// The severity.
    pub fn severity(self) -> Severity {
        match self {
            FindingKind::EvidenceRejected
            | FindingKind::NewPrivilegedToolAction
            | FindingKind::UndeclaredEgress => Severity::Error,
            FindingKind::InconclusiveToolTarget
            | FindingKind::InconclusiveObservationGap
            | FindingKind::UnclassifiedToolAction => Severity::Warning,
            FindingKind::AttemptedPrivilegedToolActionDenied => Severity::Note,
        }
    }

    /// One sentence on what it means.
    pub fn description(self) -> &'static str {
        match self {
            FindingKind::EvidenceRejected => {
                "An observed source is flowhost records whose hash chain, sequence or head anchor does not verify, or that holds a line that is not a valid record; nothing can be concluded from it."
            }
            FindingKind::NewPrivilegedToolAction => {
                "A privileged action was allowed (or errored) that no declared action covers."
            }
            FindingKind::UndeclaredEgress => {
                "A tool attempted outbound I/O although its signed declaration says egress: false; the declaration is false."
            }
            FindingKind::InconclusiveToolTarget => {
                "The observed target lacks a field the matching declaration constrains, so it cannot be judged."
            }
            FindingKind::AttemptedPrivilegedToolActionDenied => {
                "An undeclared privileged action was attempted and denied; enforcement held."
            }
            FindingKind::InconclusiveObservationGap => {
                "Observation was incomplete or unknown, so the absence of findings is not evidence of no tool use."
            }
            FindingKind::UnclassifiedToolAction => {
                "A tool without a record mapping was used; its action cannot be compared with the declarations."
            }
        }
    }
}

impl fmt::Display for FindingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Note => "note",
        })
    }
}

/// A path as report text: serde refuses a path that is not UTF-8, which would leave a
/// report empty (or panic a `json!` holding one).
fn lossy_path<S: serde::Serializer>(path: &std::path::Path, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&path.to_string_lossy())
}

/// Where an observed decision came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ObservedRef {
    /// The file (in a report, its name as text, with what is not UTF-8 replaced).
    #[serde(serialize_with = "lossy_path")]
    pub file: PathBuf,
    /// The 1-based line (JSONL input).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<u64>,
    /// The index in `observed_tool_decisions` (envelope input).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u64>,
    /// The record's `flowhost.seq`, when present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

impl fmt::Display for ObservedRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
        }
        if let Some(i) = self.index {
            write!(f, " observed_tool_decisions[{i}]")?;
        }
        if let Some(s) = self.seq {
            write!(f, " (seq {s})")?;
        }
        Ok(())
    }
}

/// One finding (identical findings merged).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    /// The outcome.
    pub kind: FindingKind,
    /// Its severity.
    pub severity: Severity,
    /// A one-line explanation.
    pub message: String,
    /// The server id, when the decision names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// The tool name.
    pub tool: Option<String>,
    /// The observed provider.
    pub provider: Option<String>,
    /// The observed category (action class).
    pub category: Option<String>,
    /// The observed effect.
    pub effect: Option<String>,
    /// The observed target.
    pub target: Option<serde_json::Value>,
    /// How many observed decisions gave this finding.
    pub occurrences: u64,
    /// Where (the first [`MAX_EXAMPLES`]).
    pub examples: Vec<ObservedRef>,
}

/// The gate's overall verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// No findings, and observation complete and bound to the records (exit 0).
    Clean,
    /// At least one finding other than an observation gap (exit 1).
    Findings,
    /// No such finding, but observation is incomplete or not bound (exit 3).
    Inconclusive,
    /// An observed source claims to be flowhost records and does not verify (exit 4).
    EvidenceRejected,
}

impl Verdict {
    /// The exit code.
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Clean => 0,
            Verdict::Findings => 1,
            Verdict::Inconclusive => 3,
            Verdict::EvidenceRejected => 4,
        }
    }
}

/// What an observed source turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Evidence {
    /// Flowhost records whose chain verified.
    Verified,
    /// Decisions without the flowhost chain.
    Unchained,
    /// Flowhost records that do not verify: not judged.
    Rejected,
}

/// One observed source and what the diff made of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ObservedSource {
    /// The path given (in a report, as text, with what is not UTF-8 replaced).
    #[serde(serialize_with = "lossy_path")]
    pub path: PathBuf,
    /// Verified, unchained or rejected.
    pub evidence: Evidence,
    /// Decisions judged from it (0 when rejected).
    pub decisions: u64,
    /// Verified records: the first sequence number.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_seq: Option<u64>,
    /// Verified records: the last sequence number.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_seq: Option<u64>,
    /// Verified records: the line hash of the last record.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain_head: Option<String>,
    /// Verified records: how many have `flowhost.event` `tool_call`.
    pub tool_calls: u64,
    /// Verified records: whether a health paired with them (see the module docs) says
    /// observation was complete and is bound to them, with no other gap touching them (a
    /// missing head anchor, unattributed unchained decisions); `None` for other sources, and
    /// when no health was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observation_complete: Option<bool>,
}

/// The diff's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiffReport {
    /// Always [`DIFF_SCHEMA`].
    pub schema: &'static str,
    /// The verdict (see the module docs).
    pub verdict: Verdict,
    /// How many observed decisions were judged.
    pub observed_decisions: u64,
    /// Whether observation was complete and bound to the observed records.
    pub observation_complete: bool,
    /// The observed sources, in the order given.
    pub sources: Vec<ObservedSource>,
    /// The findings: by severity, then kind, then first location.
    pub findings: Vec<Finding>,
    /// The gate's exit code (0, 1, 3 or 4; see the module docs).
    pub exit_code: u8,
}

impl DiffReport {
    /// The gate's exit code.
    pub fn exit_code(&self) -> u8 {
        self.exit_code
    }
}

/// How the diff treats its inputs.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiffOptions {
    /// The operator states that decisions without the flowhost chain were produced by another
    /// observer: they are judged without being bound to the flowhost health.
    pub unchained_from_other_observer: bool,
}

/// Input the diff cannot judge.
#[derive(Debug, thiserror::Error)]
pub enum DiffError {
    /// The observed input could not be read.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A decision is not readable.
    #[error("{file}:{line}: not an observed decision: {problem}")]
    BadLine {
        /// The file.
        file: PathBuf,
        /// The 1-based line.
        line: u64,
        /// What is wrong.
        problem: String,
    },
    /// The file is neither a record stream nor an envelope.
    #[error("{file}: {problem}")]
    BadInput {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        problem: String,
    },
}

/// Runs the diff of the observed decisions at `observed` (a record directory, a JSONL file,
/// or an exported surface envelope) against `declared`, with `health` as the coverage signal.
pub fn diff(
    declared: &DeclaredSurface,
    observed: &Path,
    health: Option<&ToolObservationHealth>,
) -> Result<DiffReport, DiffError> {
    diff_sources(
        declared,
        &[observed.to_path_buf()],
        health.map(std::slice::from_ref).unwrap_or_default(),
        DiffOptions::default(),
    )
}

/// Runs the diff of several observed sources judged together, with one health per host
/// (see the module docs for how each source is verified and how healths are paired with
/// record streams).
pub fn diff_sources(
    declared: &DeclaredSurface,
    observed: &[PathBuf],
    health: &[ToolObservationHealth],
    options: DiffOptions,
) -> Result<DiffReport, DiffError> {
    let matcher = Matcher::new(declared);
    let mut acc = Acc::default();
    let mut evidence = EvidenceSet::default();
    // Evidence rejected outright (exit 4) is returned once every source is read: an input
    // error in any of them (exit 2) comes first, whatever the order they were named in.
    let mut rejected = None;
    // Only a fleet's sources are looked at for one chain given twice.
    let links = health.len() > 1;
    for path in observed {
        let judged = match judge_source(&matcher, path, links) {
            Ok(judged) => judged,
            Err(DiffError::Store(e)) if e.rejects_the_evidence() => {
                rejected.get_or_insert(DiffError::Store(e));
                continue;
            }
            Err(e) => return Err(e),
        };
        let (source, problems) = judged.summary(path);
        if judged.unanchored {
            evidence.unanchored.push(path.clone());
        }
        evidence.problems.extend(problems);
        evidence
            .links
            .push(chain_keys(judged.links, source.chain_head.as_deref()));
        evidence.sources.push(source);
        if let Some(part) = judged.acc {
            acc.merge(part);
        }
    }
    if let Some(rejected) = rejected {
        return Err(rejected);
    }
    Ok(acc.finish(evidence, health, options))
}

/// What the sources showed about the evidence itself.
#[derive(Debug, Default)]
struct EvidenceSet {
    sources: Vec<ObservedSource>,
    problems: Vec<Problem>,
    unanchored: Vec<PathBuf>,
    /// Each source's chain keys (see [`chain_keys`]), in the order of `sources`; empty for
    /// sources that are not verified records, and unless a fleet is judged.
    links: Vec<Vec<ChainLink>>,
}

/// One source, judged (or rejected).
struct Judged {
    /// The judged decisions (`None`: rejected).
    acc: Option<Acc>,
    /// The chain verification, for flowhost records.
    report: Option<VerifyReport>,
    /// A record directory with records but no head anchor.
    unanchored: bool,
    /// Verified records: each one's link to the record before it (see [`chain_link`]).
    links: Vec<ChainLink>,
}

impl Judged {
    /// Flowhost records with `links` (see [`chain_link`]): judged if `report` verifies,
    /// else rejected.
    fn chained(acc: Acc, report: VerifyReport, links: Vec<ChainLink>) -> Self {
        let ok = report.is_ok();
        Judged {
            acc: ok.then_some(acc),
            report: Some(report),
            unanchored: false,
            links: if ok { links } else { Vec::new() },
        }
    }

    /// Decisions without the flowhost chain: judged, nothing to verify.
    fn unchained(acc: Acc) -> Self {
        Judged {
            acc: Some(acc),
            report: None,
            unanchored: false,
            links: Vec::new(),
        }
    }

    /// Flowhost records that do not verify: not judged.
    fn rejected(report: VerifyReport) -> Self {
        Judged {
            acc: None,
            report: Some(report),
            unanchored: false,
            links: Vec::new(),
        }
    }

    /// The source's summary, and its problems when it was rejected.
    fn summary(&self, path: &Path) -> (ObservedSource, Vec<Problem>) {
        let evidence = match (&self.acc, &self.report) {
            (None, _) => Evidence::Rejected,
            (Some(_), Some(_)) => Evidence::Verified,
            (Some(_), None) => Evidence::Unchained,
        };
        let verified = self.report.as_ref().filter(|r| r.is_ok());
        let source = ObservedSource {
            path: path.to_path_buf(),
            evidence,
            decisions: self.acc.as_ref().map_or(0, |a| a.decisions),
            first_seq: verified.and_then(|r| r.first_seq),
            last_seq: verified.and_then(|r| r.last_seq),
            chain_head: verified.map(|r| {
                r.head_hash
                    .as_ref()
                    .map_or(GENESIS_HASH, |h| h.as_str())
                    .to_string()
            }),
            tool_calls: self.acc.as_ref().map_or(0, |a| a.tool_calls),
            observation_complete: None,
        };
        let problems = match (&self.acc, &self.report) {
            (None, Some(r)) => r.problems.clone(),
            _ => Vec::new(),
        };
        (source, problems)
    }
}

/// Verifies and judges one source (see the module docs).
fn judge_source(matcher: &Matcher<'_>, path: &Path, links: bool) -> Result<Judged, DiffError> {
    let meta = fs::metadata(path).map_err(StoreError::io("open", path))?;
    // A directory, or a record file of one (named as a writer names them), with no head
    // anchor holding it: whole lines cut from its end would not show. A record file is
    // judged as its directory is, however it is named on the command line.
    let unanchored_records = |judged: Judged| {
        let unanchored = judged
            .report
            .as_ref()
            .is_some_and(|r| r.head_anchor.is_none() && r.records > 0 && r.is_ok());
        Judged {
            unanchored,
            ..judged
        }
    };
    if meta.is_dir() {
        return judge_records(matcher, path, links).map(unanchored_records);
    }
    let record_file = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(crate::records::store::parse_record_file_name)
        .is_some();
    // One open serves telling the format and the lenient read, so both see the same file.
    let file = File::open(path).map_err(StoreError::io("open", path))?;
    match detect(path, &file)? {
        // Flowhost records (as the first line says): verified and judged in one read.
        Format::Records if record_file => {
            judge_records(matcher, path, links).map(unanchored_records)
        }
        Format::Records => judge_records(matcher, path, links),
        Format::Stream => {
            match judge_stream(matcher, path, &file, Tuning::default()).inspect(|_| {
                #[cfg(test)]
                after_lenient_read(path)
            }) {
                // No chain anywhere: judged from this one read, nothing to verify.
                Ok(acc) if acc.chained == 0 => Ok(Judged::unchained(acc)),
                // A line carries the chain: what the lenient read judged is dropped, and the file
                // is verified and judged in one more read. Judging one read and verifying another
                // would let a file replaced in between pass unverified decisions as verified.
                Ok(_) => judge_records(matcher, path, links),
                // A line the diff cannot read: inside flowhost records that is a foreign or torn
                // line (rejected evidence); in anything else, an input error. Either refuses (exit
                // 4 or 2), whatever a later read finds, so no verdict is drawn from two reads.
                Err(e) => {
                    let report = verify_records(path, None)?;
                    if report.first_seq.is_some() && !report.is_ok() {
                        Ok(Judged::rejected(report))
                    } else {
                        Err(e)
                    }
                }
            }
        }
        Format::Envelope => {
            // One strict parse feeds both the judge and the chain check, so they read the
            // same value for every key.
            let envelope = read_envelope(path)?;
            match judge_envelope(matcher, path, &envelope) {
                Ok(acc) if acc.chained == 0 => Ok(Judged::unchained(acc)),
                Ok(acc) => Ok(Judged::chained(
                    acc,
                    envelope_chain(path, &envelope)?,
                    if links {
                        envelope_links(&envelope)
                    } else {
                        Vec::new()
                    },
                )),
                Err(e) => match envelope_chain(path, &envelope) {
                    Ok(report) if report.first_seq.is_some() && !report.is_ok() => {
                        Ok(Judged::rejected(report))
                    }
                    _ => Err(e),
                },
            }
        }
    }
}

/// What a test runs on a file between reads.
#[cfg(test)]
type ReadHook = Box<dyn FnMut(&Path)>;

#[cfg(test)]
thread_local! {
    /// Run between the lenient read of a JSONL stream and whatever reads the file next
    /// (tests replace the file there).
    static AFTER_LENIENT_READ: std::cell::RefCell<Option<ReadHook>> =
        const { std::cell::RefCell::new(None) };
}

#[cfg(test)]
fn after_lenient_read(path: &Path) {
    AFTER_LENIENT_READ.with(|h| {
        if let Some(hook) = h.borrow_mut().as_mut() {
            hook(path)
        }
    });
}

/// Verifies the flowhost records at `path` (a record directory or file) and judges each
/// valid record as the verifier decodes it: rejected unless the whole stream verifies.
fn judge_records(matcher: &Matcher<'_>, path: &Path, links: bool) -> Result<Judged, DiffError> {
    let (report, part) = verify_records_gathering(path, None, &Judging { matcher, links })?;
    if !report.is_ok() {
        return Ok(Judged::rejected(report));
    }
    match part.error {
        Some(e) => Err(e),
        None => Ok(Judged::chained(part.acc, report, part.links)),
    }
}

/// Reads an exported envelope strictly: a key repeated anywhere (say a target naming `repo`
/// twice) is refused, because serde's `Value` keeps the last value and a streaming reader the
/// first, so the chain would verify one decision while the judge judged another.
fn read_envelope(file: &Path) -> Result<serde_json::Value, DiffError> {
    let bad = |problem: String| DiffError::BadInput {
        file: file.to_path_buf(),
        problem,
    };
    // Read through the bound, not after a size look: a file that grows meanwhile (or a
    // mount that says it is empty and never ends) stops at it too.
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(
            fs::File::open(file).map_err(StoreError::io("open", file))?,
            stream::MAX_ENVELOPE_BYTES + 1,
        ),
        &mut bytes,
    )
    .map_err(StoreError::io("read", file))?;
    if bytes.len() as u64 > stream::MAX_ENVELOPE_BYTES {
        return Err(stream::too_large(file));
    }
    let text = std::str::from_utf8(&bytes).map_err(|e| {
        bad(format!(
            "not a valid {DECISION_SURFACE_SCHEMA} envelope: not UTF-8 ({e})"
        ))
    })?;
    // Keys only: another producer's extensions may hold integers of any size, and a
    // flowhost record holding one fails its own strict decoding (the chain check).
    crate::canonical::parse_unique_keys(text).map_err(|e| {
        bad(match e {
            JsonError::DuplicateKey {
                path,
                key,
                line,
                column,
            } => format!(
                "{path}: the key {key:?} appears twice (line {line}, column {column}); readers keeping the first and the last value would judge different decisions, so the envelope is not judged: export flowhost records again with `flowhost records export --surface` (another producer's envelope must name each key once)"
            ),
            JsonError::InexactInteger { .. } | JsonError::Syntax { .. } => {
                format!("not a valid {DECISION_SURFACE_SCHEMA} envelope: {e}")
            }
        })
    })
}

/// Each decision's link to the one before it (see [`chain_link`]), for an envelope whose
/// chain verified.
fn envelope_links(envelope: &serde_json::Value) -> Vec<ChainLink> {
    envelope
        .get("observed_tool_decisions")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|d| d.pointer("/flowhost/prev_hash")?.as_str())
        .filter_map(chain_link)
        .collect()
}

/// The chain verification of an envelope's decisions.
fn envelope_chain(file: &Path, envelope: &serde_json::Value) -> Result<VerifyReport, DiffError> {
    let decisions = envelope
        .get("observed_tool_decisions")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| DiffError::BadInput {
            file: file.to_path_buf(),
            problem: format!(
                "not a valid {DECISION_SURFACE_SCHEMA} envelope: observed_tool_decisions is not an array"
            ),
        })?;
    Ok(verify_decisions(file, decisions))
}

#[cfg(test)]
mod tests;
