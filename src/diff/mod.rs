//! The declared-vs-observed diff and gate.
//!
//! **Evidence first.** Each observed source (a record directory, a JSONL file, or an exported
//! `assay.tool_decision_surface.v0` envelope; several may be given) is one of:
//! * *flowhost records*: a directory, or a file or envelope in which any decision carries the
//!   `flowhost` chain fields (`seq`, `prev_hash`). Its hash chain is verified first with
//!   [`crate::records::chain`] (for a directory also its head anchor; an envelope's decisions
//!   are decoded strictly and re-serialised as the writer serialises them). Any break, gap,
//!   reorder, edit, torn line, or line that is not a valid flowhost record *rejects* the
//!   source: it is not judged, and each problem is an `evidence_rejected` finding naming file
//!   and line (or envelope index).
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
//! An observed `error` effect matches only a declaration that lists `error`, never one that
//! lists only `allow`: the effect may have happened, so an errored undeclared call is rule 6.
//! A deny that a declaration lists with `deny` in `allowed_effects` is expected: no finding.
//! Declared-but-unobserved actions are never findings.
//!
//! In addition, every egress attempt (`flowhost.event` `egress_attempt`) whose
//! `flowhost.egress_basis` is `declared: false, observed: true` (allowed or refused) gives an
//! `undeclared_egress` finding (error): the signed declaration said the tool does not egress.
//!
//! Observation coverage adds at most one run-level `inconclusive_observation_gap` (warning)
//! when: no health carrier was given; the health is incomplete; it is not bound to the
//! observed records (above); unchained decisions were not attributed to another observer; a
//! record directory has no head anchor; or several flowhost record streams share one health.
//!
//! Exit codes ([`DiffReport::exit_code`]), by precedence: 2 (from the CLI) a usage or input
//! error; 4 evidence rejected (wins over any finding); 1 at least one finding other than an
//! observation gap; 3 no such finding but observation incomplete or unbound; 0 clean.
//! Identical findings (same outcome, server, tool, provider, class, effect and target) are
//! reported once with an occurrence count and up to [`MAX_EXAMPLES`] locations.

mod observed;
pub mod report;
pub mod surface;

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::records::chain::{Location, Problem, VerifyReport, verify_decisions, verify_records};
use crate::records::health::ToolObservationHealth;
use crate::records::store::{StoreError, record_sources};
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

/// Where an observed decision came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ObservedRef {
    /// The file.
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
    /// The path given.
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
        health,
        DiffOptions::default(),
    )
}

/// Runs the diff of several observed sources judged together (see the module docs for how
/// each is verified and how the health is bound).
pub fn diff_sources(
    declared: &DeclaredSurface,
    observed: &[PathBuf],
    health: Option<&ToolObservationHealth>,
    options: DiffOptions,
) -> Result<DiffReport, DiffError> {
    let matcher = Matcher::new(declared);
    let mut acc = Acc::default();
    let mut evidence = EvidenceSet::default();
    for path in observed {
        let judged = judge_source(&matcher, path)?;
        let (source, problems) = judged.summary(path);
        if judged.unanchored {
            evidence.unanchored.push(path.clone());
        }
        evidence.problems.extend(problems);
        evidence.sources.push(source);
        if let Some(part) = judged.acc {
            acc.merge(part);
        }
    }
    Ok(acc.finish(evidence, health, options))
}

/// What the sources showed about the evidence itself.
#[derive(Debug, Default)]
struct EvidenceSet {
    sources: Vec<ObservedSource>,
    problems: Vec<Problem>,
    unanchored: Vec<PathBuf>,
}

/// One source, judged (or rejected).
struct Judged {
    /// The judged decisions (`None`: rejected).
    acc: Option<Acc>,
    /// The chain verification, for flowhost records.
    report: Option<VerifyReport>,
    /// A record directory with records but no head anchor.
    unanchored: bool,
}

impl Judged {
    /// Flowhost records: judged if `report` verifies, else rejected.
    fn chained(acc: Acc, report: VerifyReport) -> Self {
        Judged {
            acc: report.is_ok().then_some(acc),
            report: Some(report),
            unanchored: false,
        }
    }

    /// Decisions without the flowhost chain: judged, nothing to verify.
    fn unchained(acc: Acc) -> Self {
        Judged {
            acc: Some(acc),
            report: None,
            unanchored: false,
        }
    }

    /// Flowhost records that do not verify: not judged.
    fn rejected(report: VerifyReport) -> Self {
        Judged {
            acc: None,
            report: Some(report),
            unanchored: false,
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
        };
        let problems = match (&self.acc, &self.report) {
            (None, Some(r)) => r.problems.clone(),
            _ => Vec::new(),
        };
        (source, problems)
    }
}

/// Verifies and judges one source (see the module docs).
fn judge_source(matcher: &Matcher<'_>, path: &Path) -> Result<Judged, DiffError> {
    let meta = fs::metadata(path).map_err(StoreError::io("open", path))?;
    if meta.is_dir() {
        let report = verify_records(path, None)?;
        let unanchored = report.head_anchor.is_none() && report.records > 0;
        if !report.is_ok() {
            return Ok(Judged::rejected(report));
        }
        let mut acc = Acc::default();
        for file in record_sources(path)? {
            acc.merge(judge_stream(matcher, &file, Tuning::default())?);
        }
        return Ok(Judged {
            unanchored,
            ..Judged::chained(acc, report)
        });
    }
    match detect(path)? {
        Format::Stream => match judge_stream(matcher, path, Tuning::default()) {
            Ok(acc) if acc.chained == 0 => Ok(Judged::unchained(acc)),
            Ok(acc) => Ok(Judged::chained(acc, verify_records(path, None)?)),
            // A line the diff cannot read: inside flowhost records that is a foreign or torn
            // line (rejected evidence); in anything else, an input error.
            Err(e) => {
                let report = verify_records(path, None)?;
                if report.first_seq.is_some() && !report.is_ok() {
                    Ok(Judged::rejected(report))
                } else {
                    Err(e)
                }
            }
        },
        Format::Envelope => {
            let bytes = fs::read(path).map_err(StoreError::io("read", path))?;
            match judge_envelope(matcher, path, &bytes) {
                Ok(acc) if acc.chained == 0 => Ok(Judged::unchained(acc)),
                Ok(acc) => Ok(Judged::chained(acc, envelope_chain(path, &bytes)?)),
                Err(e) => match envelope_chain(path, &bytes) {
                    Ok(report) if report.first_seq.is_some() && !report.is_ok() => {
                        Ok(Judged::rejected(report))
                    }
                    _ => Err(e),
                },
            }
        }
    }
}

/// The chain verification of an envelope's decisions.
fn envelope_chain(file: &Path, bytes: &[u8]) -> Result<VerifyReport, DiffError> {
    #[derive(serde::Deserialize)]
    struct Decisions {
        observed_tool_decisions: Vec<serde_json::Value>,
    }
    let env: Decisions = serde_json::from_slice(bytes).map_err(|e| DiffError::BadInput {
        file: file.to_path_buf(),
        problem: format!("not a valid {DECISION_SURFACE_SCHEMA} envelope: {e}"),
    })?;
    Ok(verify_decisions(file, &env.observed_tool_decisions))
}

enum Format {
    Stream,
    Envelope,
}

/// Read sizes of the stream reader (tests shrink them to exercise every path).
#[derive(Debug, Clone, Copy)]
struct Tuning {
    block: usize,
    parallel_min: u64,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            block: BLOCK_BYTES,
            parallel_min: PARALLEL_MIN_BYTES,
        }
    }
}

/// How much of a file is read to tell a stream from an envelope.
const PROBE_BYTES: u64 = 64 * 1024;
/// The read block of the stream reader (reused, so memory stays bounded).
const BLOCK_BYTES: usize = 8 * 1024 * 1024;
/// Inputs smaller than this are read by one thread.
const PARALLEL_MIN_BYTES: u64 = 4 * 1024 * 1024;

fn read_at(file: &Path, f: &File, buf: &mut [u8], offset: u64) -> Result<usize, DiffError> {
    f.read_at(buf, offset)
        .map_err(|e| DiffError::Store(StoreError::io("read", file)(e)))
}

fn detect(file: &Path) -> Result<Format, DiffError> {
    let f = File::open(file).map_err(StoreError::io("open", file))?;
    let mut prefix = vec![0u8; PROBE_BYTES as usize];
    let mut n = 0;
    while n < prefix.len() {
        match read_at(file, &f, &mut prefix[n..], n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    prefix.truncate(n);
    let at_eof = n < PROBE_BYTES as usize;
    let mut lines = prefix.split(|&b| b == b'\n');
    let first = lines.find(|l| !l.iter().all(u8::is_ascii_whitespace));
    let Some(first) = first else {
        return Ok(Format::Stream);
    };
    // The first line is complete if a newline follows it within the prefix, or the file ends.
    let complete = lines.next().is_some() || at_eof;
    match serde_json::from_slice::<Probe>(first) {
        Ok(p) if p.observed_tool_decisions.is_some() => Ok(Format::Envelope),
        Ok(_) => Ok(Format::Stream),
        // Not one object per line: a pretty-printed or very long envelope, or garbage.
        Err(line_error) => {
            let bytes = std::fs::read(file).map_err(StoreError::io("read", file))?;
            match serde_json::from_slice::<Probe>(&bytes) {
                Ok(p) if p.observed_tool_decisions.is_some() => Ok(Format::Envelope),
                _ => Err(DiffError::BadInput {
                    file: file.to_path_buf(),
                    problem: format!(
                        "neither a JSONL decision stream (line 1: {}) nor an {DECISION_SURFACE_SCHEMA} envelope",
                        if complete {
                            line_error.to_string()
                        } else {
                            "longer than 64 KiB and not JSON".to_string()
                        }
                    ),
                }),
            }
        }
    }
}

/// The offset of the first line that starts at or after `offset`.
fn next_line_start(file: &Path, f: &File, offset: u64, len: u64) -> Result<u64, DiffError> {
    if offset == 0 {
        return Ok(0);
    }
    let mut buf = vec![0u8; 64 * 1024];
    let mut pos = offset - 1;
    while pos < len {
        let n = read_at(file, f, &mut buf, pos)?;
        if n == 0 {
            break;
        }
        if let Some(i) = memchr::memchr(b'\n', &buf[..n]) {
            return Ok(pos + i as u64 + 1);
        }
        pos += n as u64;
    }
    Ok(len)
}

/// Judges a JSONL stream: the file is cut at line starts into one range per core, each range
/// read in reused blocks and judged on its own thread; the partial results are merged in
/// stream order with true line numbers.
fn judge_stream(matcher: &Matcher<'_>, file: &Path, tuning: Tuning) -> Result<Acc, DiffError> {
    let f = File::open(file).map_err(StoreError::io("open", file))?;
    let len = f.metadata().map_err(StoreError::io("stat", file))?.len();
    let threads = if len < tuning.parallel_min {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, 8)
    };
    let mut bounds = vec![0u64];
    for i in 1..threads as u64 {
        let b = next_line_start(file, &f, len * i / threads as u64, len)?;
        if b > *bounds.last().unwrap_or(&0) && b < len {
            bounds.push(b);
        }
    }
    bounds.push(len);
    let ranges: Vec<(u64, u64)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = ranges
            .iter()
            .map(|&(start, end)| {
                let f = &f;
                s.spawn(move || judge_range(matcher, file, f, (start, end), tuning.block))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(DiffError::BadInput {
                        file: file.to_path_buf(),
                        problem: "a diff worker thread panicked".into(),
                    })
                })
            })
            .collect::<Vec<_>>()
    });
    let mut acc = Acc::default();
    let mut line_offset = 0;
    for r in results {
        let part = r.map_err(|e| match e {
            DiffError::BadLine {
                file,
                line,
                problem,
            } => DiffError::BadLine {
                file,
                line: line + line_offset,
                problem,
            },
            other => other,
        })?;
        let mut judged = part.acc;
        judged.shift_lines(line_offset);
        line_offset += part.lines;
        acc.merge(judged);
        if part.torn {
            return Err(DiffError::BadLine {
                file: file.to_path_buf(),
                line: line_offset + 1,
                problem: "the last line has no newline (a torn write or a cut file); run `flowhost records verify`".into(),
            });
        }
    }
    Ok(acc)
}

struct RangeResult {
    acc: Acc,
    lines: u64,
    torn: bool,
}

/// Judges the lines starting in `[start, end)`, reading in reused blocks.
fn judge_range(
    matcher: &Matcher<'_>,
    file: &Path,
    f: &File,
    (start, end): (u64, u64),
    block: usize,
) -> Result<RangeResult, DiffError> {
    let mut acc = Acc::default();
    let mut line = 0u64;
    let mut buf = vec![0u8; block.clamp(1, (end - start) as usize + 1)];
    // buf[..kept] holds the unjudged start of a line carried over from the previous block.
    let mut kept = 0usize;
    let mut pos = start;
    while pos < end {
        if kept == buf.len() {
            // One line longer than the buffer: grow it.
            buf.resize(buf.len() * 2, 0);
        }
        let want = (buf.len() - kept).min((end - pos) as usize);
        let n = read_at(file, f, &mut buf[kept..kept + want], pos)?;
        if n == 0 {
            break;
        }
        pos += n as u64;
        let filled = kept + n;
        let mut from = 0;
        for nl in memchr::memchr_iter(b'\n', &buf[..filled]) {
            line += 1;
            judge_line(matcher, file, &mut acc, &buf[from..nl], line)?;
            from = nl + 1;
        }
        buf.copy_within(from..filled, 0);
        kept = filled - from;
    }
    Ok(RangeResult {
        acc,
        lines: line,
        torn: kept > 0,
    })
}

fn judge_line(
    matcher: &Matcher<'_>,
    file: &Path,
    acc: &mut Acc,
    text: &[u8],
    line: u64,
) -> Result<(), DiffError> {
    let bad = |problem: String| DiffError::BadLine {
        file: file.to_path_buf(),
        line,
        problem,
    };
    let d: ObsDecision<'_> = serde_json::from_slice(text).map_err(|e| bad(e.to_string()))?;
    let seq = d.flowhost.as_ref().and_then(|x| x.seq);
    let at = || ObservedRef {
        file: file.to_path_buf(),
        line: Some(line),
        index: None,
        seq,
    };
    acc.judge(matcher, &d, at).map_err(bad)
}

fn judge_envelope(matcher: &Matcher<'_>, file: &Path, bytes: &[u8]) -> Result<Acc, DiffError> {
    let bad = |problem: String| DiffError::BadInput {
        file: file.to_path_buf(),
        problem,
    };
    let env: ObsEnvelope<'_> = serde_json::from_slice(bytes).map_err(|e| {
        bad(format!(
            "not a valid {DECISION_SURFACE_SCHEMA} envelope: {e}"
        ))
    })?;
    if env.schema.0 != DECISION_SURFACE_SCHEMA {
        return Err(bad(format!(
            "schema is {:?}, expected {DECISION_SURFACE_SCHEMA:?}",
            env.schema.0
        )));
    }
    let mut acc = Acc::default();
    for (i, d) in env.observed_tool_decisions.iter().enumerate() {
        let seq = d.flowhost.as_ref().and_then(|x| x.seq);
        let at = || ObservedRef {
            file: file.to_path_buf(),
            line: None,
            index: Some(i as u64),
            seq,
        };
        acc.judge(matcher, d, at)
            .map_err(|p| bad(format!("observed_tool_decisions[{i}]: {p}")))?;
    }
    Ok(acc)
}

/// Declared actions indexed by provider, then class.
struct Matcher<'d> {
    by_key: HashMap<&'d str, HashMap<&'d str, Vec<&'d DeclaredAction>>>,
}

impl<'d> Matcher<'d> {
    fn new(declared: &'d DeclaredSurface) -> Self {
        let mut by_key: HashMap<&str, HashMap<&str, Vec<&DeclaredAction>>> = HashMap::new();
        for a in &declared.actions {
            by_key
                .entry(a.provider.as_str())
                .or_default()
                .entry(a.action_class.as_str())
                .or_default()
                .push(a);
        }
        Matcher { by_key }
    }

    fn candidates(&self, provider: &str, class: &str) -> &[&'d DeclaredAction] {
        self.by_key
            .get(provider)
            .and_then(|m| m.get(class))
            .map_or(&[], Vec::as_slice)
    }
}

/// The outcome of one decision (`None`: no finding), with the reason text.
fn judge(
    matcher: &Matcher<'_>,
    d: &ObsDecision<'_>,
) -> Result<Option<(FindingKind, &'static str)>, String> {
    let effect = match d.decision.effect.0.as_ref() {
        "allow" => crate::records::Effect::Allow,
        "deny" => crate::records::Effect::Deny,
        "error" => crate::records::Effect::Error,
        other => {
            return Err(format!(
                "decision.effect {other:?} is not allow, deny or error"
            ));
        }
    };
    match d.classification.0.as_ref() {
        "not_observed" => {
            return Ok(Some((
                FindingKind::InconclusiveObservationGap,
                "the producer marked this action not observed",
            )));
        }
        "redaction_failed" => {
            return Ok(Some((
                FindingKind::InconclusiveObservationGap,
                "the producer could not redact this record faithfully",
            )));
        }
        "observed_unknown_tool" => {
            return Ok(Some((
                FindingKind::UnclassifiedToolAction,
                "no record mapping classifies this tool",
            )));
        }
        "classified" | "classified_incomplete" => {}
        other => {
            return Err(format!(
                "classification {other:?} is not one of classified, classified_incomplete, observed_unknown_tool, redaction_failed, not_observed"
            ));
        }
    }
    let (Some(category), false) = (
        d.tool.category.as_ref(),
        d.action
            .class
            .as_ref()
            .is_some_and(|c| c.0 == "unclassified"),
    ) else {
        return Ok(Some((
            FindingKind::UnclassifiedToolAction,
            "the action has no category or class",
        )));
    };
    let empty = observed::ObsTarget::default();
    let target = d.action.target.as_ref().unwrap_or(&empty);
    let provider = target.provider().unwrap_or("");
    // An error never matches a declared allow: the effect may have happened, and an allow
    // that failed is not the success the declaration describes.
    let mut undetermined = false;
    for a in matcher.candidates(provider, &category.0) {
        if !a.allowed_effects.contains(&effect) {
            continue;
        }
        match a.test_target(|f| target.get(f)) {
            TargetMatch::Match => return Ok(None),
            TargetMatch::Undetermined => undetermined = true,
            TargetMatch::Mismatch => {}
        }
    }
    if effect == crate::records::Effect::Deny {
        return Ok(Some((
            FindingKind::AttemptedPrivilegedToolActionDenied,
            "denied, and no declared action expects this denial",
        )));
    }
    if undetermined {
        return Ok(Some((
            FindingKind::InconclusiveToolTarget,
            "a declared action covers the provider, class and effect, but the observed target lacks a field it constrains",
        )));
    }
    Ok(Some((
        FindingKind::NewPrivilegedToolAction,
        "no declared action covers this provider, class, target and effect",
    )))
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    kind: FindingKind,
    server: Option<String>,
    tool: String,
    provider: Option<String>,
    category: Option<String>,
    effect: String,
    target: String,
}

#[derive(Debug, Default)]
struct Acc {
    decisions: u64,
    /// Decisions carrying the flowhost chain fields.
    chained: u64,
    /// Chained decisions whose `flowhost.event` is `tool_call`.
    tool_calls: u64,
    order: Vec<Key>,
    findings: HashMap<Key, Finding>,
}

impl Acc {
    /// Judges one decision; `at` builds its location (only when one is needed).
    fn judge(
        &mut self,
        matcher: &Matcher<'_>,
        d: &ObsDecision<'_>,
        at: impl Fn() -> ObservedRef,
    ) -> Result<(), String> {
        self.decisions += 1;
        let x = d.flowhost.as_ref();
        if let Some(x) = x.filter(|x| x.chained()) {
            self.chained += 1;
            if x.event_is("tool_call") {
                self.tool_calls += 1;
            }
        }
        let server = d
            .server
            .as_ref()
            .and_then(|s| s.id.as_ref())
            .map(|id| id.0.to_string());
        let tool = d.tool.name.0.to_string();
        // A session-level refusal (a peer refused at initialize, a request that named no
        // tool) is evidence in the chain but no tool action: nothing to compare with a
        // declared surface.
        if x.is_some_and(|x| x.event_is("session")) {
            return Ok(());
        }
        if let Some((kind, reason)) = judge(matcher, d)? {
            let target = d.action.target.as_ref().map(observed::ObsTarget::to_json);
            let key = Key {
                kind,
                server: server.clone(),
                tool: tool.clone(),
                provider: d
                    .action
                    .target
                    .as_ref()
                    .and_then(|t| t.provider())
                    .map(str::to_string),
                category: d.tool.category.as_ref().map(|c| c.0.to_string()),
                effect: d.decision.effect.0.to_string(),
                target: target.as_ref().map(|t| t.to_string()).unwrap_or_default(),
            };
            let message = format!(
                "{kind}: {} {} by tool {}: {reason}",
                match (&key.provider, &key.category) {
                    (Some(p), Some(c)) => format!("{p}/{c}"),
                    (None, Some(c)) => c.clone(),
                    _ => "unclassified action".to_string(),
                },
                key.effect,
                key.tool
            );
            self.add(key, message, target, &at);
        }
        let undeclared = x.is_some_and(|x| {
            x.event_is("egress_attempt")
                && x.egress_basis.is_some_and(|b| b.undeclared_but_observed())
        });
        if undeclared {
            let message = format!(
                "undeclared_egress: tool {tool}{} attempted outbound I/O, but its signed declaration says egress: false (allowed or refused, the declaration is false)",
                server
                    .as_deref()
                    .map(|s| format!(" of server {s}"))
                    .unwrap_or_default()
            );
            let key = Key {
                kind: FindingKind::UndeclaredEgress,
                server,
                tool,
                provider: None,
                category: None,
                effect: String::new(),
                target: String::new(),
            };
            self.add(key, message, None, &at);
        }
        Ok(())
    }

    /// Counts one occurrence of the finding `key`, creating it on first sight.
    fn add(
        &mut self,
        key: Key,
        message: String,
        target: Option<serde_json::Value>,
        at: &impl Fn() -> ObservedRef,
    ) {
        if let Some(f) = self.findings.get_mut(&key) {
            f.occurrences += 1;
            if f.examples.len() < MAX_EXAMPLES {
                f.examples.push(at());
            }
            return;
        }
        let f = Finding {
            kind: key.kind,
            severity: key.kind.severity(),
            message,
            server: key.server.clone(),
            tool: Some(key.tool.clone()),
            provider: key.provider.clone(),
            category: key.category.clone(),
            effect: (!key.effect.is_empty()).then(|| key.effect.clone()),
            target,
            occurrences: 1,
            examples: vec![at()],
        };
        self.order.push(key.clone());
        self.findings.insert(key, f);
    }

    fn shift_lines(&mut self, offset: u64) {
        for f in self.findings.values_mut() {
            for r in &mut f.examples {
                if let Some(l) = r.line.as_mut() {
                    *l += offset;
                }
            }
        }
    }

    /// Appends `later` (which comes after `self` in stream order).
    fn merge(&mut self, later: Acc) {
        self.decisions += later.decisions;
        self.chained += later.chained;
        self.tool_calls += later.tool_calls;
        let mut later_findings = later.findings;
        for key in later.order {
            let Some(f) = later_findings.remove(&key) else {
                continue;
            };
            match self.findings.get_mut(&key) {
                Some(mine) => {
                    mine.occurrences += f.occurrences;
                    let room = MAX_EXAMPLES.saturating_sub(mine.examples.len());
                    mine.examples.extend(f.examples.into_iter().take(room));
                }
                None => {
                    self.order.push(key.clone());
                    self.findings.insert(key, f);
                }
            }
        }
    }

    fn finish(
        mut self,
        evidence: EvidenceSet,
        health: Option<&ToolObservationHealth>,
        options: DiffOptions,
    ) -> DiffReport {
        let mut gaps = Vec::new();
        match health {
            None => gaps.push(
                "no tool_observation_health was given (--health), so completeness is unknown"
                    .to_string(),
            ),
            Some(h) => {
                let reasons = h.assess();
                if !reasons.is_empty() {
                    gaps.push(format!(
                        "observation was incomplete: {}",
                        reasons.join("; ")
                    ));
                }
                gaps.extend(binding_gaps(h, &evidence.sources));
            }
        }
        if !options.unchained_from_other_observer {
            for s in &evidence.sources {
                if s.evidence == Evidence::Unchained && s.decisions > 0 {
                    gaps.push(format!(
                        "{}: {} decisions carry no flowhost chain (flowhost.seq, flowhost.prev_hash), so they cannot be verified or bound to a flowhost health; if another observer produced them, say so with --unchained-from-other-observer",
                        s.path.display(),
                        s.decisions
                    ));
                }
            }
        }
        for dir in &evidence.unanchored {
            gaps.push(format!(
                "{} has records but no head anchor ({}), so whole lines cut from its end cannot be detected",
                dir.display(),
                crate::records::store::HEAD_FILE
            ));
        }
        let mut findings: Vec<Finding> = rejections(&evidence.problems);
        findings.extend(self.order.iter().filter_map(|k| self.findings.remove(k)));
        if !gaps.is_empty() {
            findings.push(run_finding(
                FindingKind::InconclusiveObservationGap,
                format!("inconclusive_observation_gap: {}", gaps.join("; ")),
                1,
                None,
            ));
        }
        // Stable order: severity, then kind, then first appearance (already the order).
        findings.sort_by_key(|f| (f.severity, f.kind));
        let has = |pred: &dyn Fn(FindingKind) -> bool| findings.iter().any(|f| pred(f.kind));
        let verdict = if has(&|k| k == FindingKind::EvidenceRejected) {
            Verdict::EvidenceRejected
        } else if has(&|k| k != FindingKind::InconclusiveObservationGap) {
            Verdict::Findings
        } else if !gaps.is_empty() || has(&|k| k == FindingKind::InconclusiveObservationGap) {
            Verdict::Inconclusive
        } else {
            Verdict::Clean
        };
        let observation_complete = gaps.is_empty()
            && !has(&|k| {
                matches!(
                    k,
                    FindingKind::InconclusiveObservationGap | FindingKind::EvidenceRejected
                )
            });
        DiffReport {
            schema: DIFF_SCHEMA,
            verdict,
            observed_decisions: self.decisions,
            observation_complete,
            sources: evidence.sources,
            findings,
            exit_code: verdict.exit_code(),
        }
    }
}

/// A finding about the run rather than one decision.
fn run_finding(
    kind: FindingKind,
    message: String,
    occurrences: u64,
    at: Option<&Location>,
) -> Finding {
    Finding {
        kind,
        severity: kind.severity(),
        message,
        server: None,
        tool: None,
        provider: None,
        category: None,
        effect: None,
        target: None,
        occurrences,
        examples: at
            .map(|l| ObservedRef {
                file: l.file.clone(),
                line: l.line,
                index: l.index,
                seq: None,
            })
            .into_iter()
            .collect(),
    }
}

/// One `evidence_rejected` finding per verification problem (the first [`MAX_REJECTIONS`];
/// the rest counted in one more).
fn rejections(problems: &[Problem]) -> Vec<Finding> {
    let mut out: Vec<Finding> = problems
        .iter()
        .take(MAX_REJECTIONS)
        .map(|p| {
            run_finding(
                FindingKind::EvidenceRejected,
                format!("evidence_rejected: {p}"),
                1,
                Some(&p.at),
            )
        })
        .collect();
    if problems.len() > MAX_REJECTIONS {
        let rest = problems.len() - MAX_REJECTIONS;
        out.push(run_finding(
            FindingKind::EvidenceRejected,
            format!(
                "evidence_rejected: {rest} more problems; `flowhost records verify` lists them all"
            ),
            rest as u64,
            problems.get(MAX_REJECTIONS).map(|p| &p.at),
        ));
    }
    out
}

/// How `health` fails to describe the verified flowhost records among `sources` (empty:
/// bound). See the module docs for the contract.
fn binding_gaps(h: &ToolObservationHealth, sources: &[ObservedSource]) -> Vec<String> {
    if sources.iter().any(|s| s.evidence == Evidence::Rejected) {
        // Rejected records decide the verdict; binding to what is left would only add noise.
        return Vec::new();
    }
    let verified: Vec<&ObservedSource> = sources
        .iter()
        .filter(|s| s.evidence == Evidence::Verified)
        .collect();
    if verified.len() > 1 {
        return vec![format!(
            "one health carrier binds one record stream, but {} flowhost record sources were given ({})",
            verified.len(),
            verified
                .iter()
                .map(|s| s.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )];
    }
    let (range, head, tool_calls) = match verified.first() {
        Some(s) => (
            (s.first_seq, s.last_seq),
            s.chain_head.clone().unwrap_or_else(|| GENESIS_HASH.into()),
            s.tool_calls,
        ),
        None => ((None, None), GENESIS_HASH.to_string(), 0),
    };
    let mut gaps = Vec::new();
    let vouched = (h.records.first_seq, h.records.last_seq);
    if vouched != range {
        gaps.push(format!(
            "records.first_seq..records.last_seq: the health says {}, the records hold {}",
            show_range(vouched),
            show_range(range)
        ));
    }
    let vouched_head = h.records.chain_head.as_deref().unwrap_or(GENESIS_HASH);
    if vouched_head != head {
        gaps.push(format!(
            "records.chain_head: the health says {vouched_head}, the records end in {head}"
        ));
    }
    if let Some(n) = h.tool_calls_observed
        && n != tool_calls
    {
        gaps.push(format!(
            "tool_calls_observed: the health says {n}, the records hold {tool_calls}"
        ));
    }
    gaps
}

fn show_range((first, last): (Option<u64>, Option<u64>)) -> String {
    match (first, last) {
        (Some(a), Some(b)) => format!("seq {a}..={b}"),
        (Some(a), None) => format!("seq {a}.."),
        (None, Some(b)) => format!("seq ..={b}"),
        (None, None) => "no records".to_string(),
    }
}

#[cfg(test)]
mod tests;
