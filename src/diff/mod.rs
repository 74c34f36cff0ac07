//! The declared-vs-observed diff and gate (DESIGN.md §7).
//!
//! Every observed decision gets exactly one outcome, by the first rule that applies:
//!
//! | # | when | outcome | severity |
//! |---|---|---|---|
//! | 1 | `classification` is `not_observed` or `redaction_failed` | `inconclusive_observation_gap` | warning |
//! | 2 | unknown tool: `observed_unknown_tool`, no `tool.category`, or `action.class` `unclassified` | `unclassified_tool_action` | warning |
//! | 3 | a declared action matches: provider (= `action.target.provider`), action class (= `tool.category`), a target entry, and the effect | none | |
//! | 4 | `decision.effect` is `deny` | `attempted_privileged_tool_action_denied` | note |
//! | 5 | a declared action has the same provider, class and effect, and the target cannot be decided against it (a constrained field is missing from the observed target, e.g. `classified_incomplete`) | `inconclusive_tool_target` | warning |
//! | 6 | otherwise | `new_privileged_tool_action` | error |
//!
//! An observed `error` effect is matched as `allow` (the effect may have happened before the
//! error). A deny that a declaration lists with `deny` in `allowed_effects` is expected: no
//! finding. Declared-but-unobserved actions are never findings.
//!
//! Observation coverage adds at most one run-level `inconclusive_observation_gap` (warning)
//! when: no health carrier was given; the health is incomplete; the observed flowhost records
//! are not contiguous in `flowhost.seq`; or they do not cover the health's sequence range.
//!
//! Exit codes ([`DiffReport::exit_code`]): 0 no findings and complete observation; 1 at least
//! one finding other than an observation gap; 3 no such finding but observation incomplete;
//! 2 (from the CLI) a usage or input error. Identical findings (same outcome, tool, provider,
//! class, effect and target) are reported once with an occurrence count and up to
//! [`MAX_EXAMPLES`] locations.

mod observed;
pub mod report;

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::records::DECISION_SURFACE_SCHEMA;
use crate::records::health::ToolObservationHealth;
use crate::records::store::{StoreError, record_sources};
use crate::surface::{DeclaredAction, DeclaredSurface, TargetMatch};
use observed::{ObsDecision, ObsEnvelope, Probe};

/// The schema of the JSON report.
pub const DIFF_SCHEMA: &str = "flowhost.diff.v1";
/// How many locations a finding lists.
pub const MAX_EXAMPLES: usize = 5;

/// The outcome kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// An allowed (or errored) privileged action no declaration covers.
    NewPrivilegedToolAction,
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
    pub const ALL: [FindingKind; 5] = [
        FindingKind::NewPrivilegedToolAction,
        FindingKind::InconclusiveToolTarget,
        FindingKind::UnclassifiedToolAction,
        FindingKind::InconclusiveObservationGap,
        FindingKind::AttemptedPrivilegedToolActionDenied,
    ];

    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::NewPrivilegedToolAction => "new_privileged_tool_action",
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
            FindingKind::NewPrivilegedToolAction => Severity::Error,
            FindingKind::InconclusiveToolTarget
            | FindingKind::InconclusiveObservationGap
            | FindingKind::UnclassifiedToolAction => Severity::Warning,
            FindingKind::AttemptedPrivilegedToolActionDenied => Severity::Note,
        }
    }

    /// One sentence on what it means.
    pub fn description(self) -> &'static str {
        match self {
            FindingKind::NewPrivilegedToolAction => {
                "A privileged action was allowed (or errored) that no declared action covers."
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

/// The diff's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiffReport {
    /// Always [`DIFF_SCHEMA`].
    pub schema: &'static str,
    /// How many observed decisions were judged.
    pub observed_decisions: u64,
    /// Whether observation was complete (health complete and records contiguous).
    pub observation_complete: bool,
    /// The findings: by severity, then kind, then first location.
    pub findings: Vec<Finding>,
    /// The gate's exit code (0, 1 or 3; see the module docs).
    pub exit_code: u8,
}

impl DiffReport {
    /// The gate's exit code.
    pub fn exit_code(&self) -> u8 {
        self.exit_code
    }
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
    let matcher = Matcher::new(declared);
    let mut acc = Acc::default();
    for file in record_sources(observed)? {
        match detect(&file)? {
            Format::Stream => acc.merge(judge_stream(&matcher, &file, Tuning::default())?),
            Format::Envelope => {
                let bytes = std::fs::read(&file).map_err(StoreError::io("read", &file))?;
                acc.merge(judge_envelope(&matcher, &file, &bytes)?);
            }
        }
    }
    Ok(acc.finish(health))
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
    acc.judge(matcher, &d, seq, at).map_err(bad)
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
        acc.judge(matcher, d, seq, at)
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
    // An error may have let the effect happen: it needs what an allow needs.
    let match_effect = if effect == crate::records::Effect::Error {
        crate::records::Effect::Allow
    } else {
        effect
    };
    let mut undetermined = false;
    for a in matcher.candidates(provider, &category.0) {
        if !a.allowed_effects.contains(&match_effect) {
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
    tool: String,
    provider: Option<String>,
    category: Option<String>,
    effect: String,
    target: String,
}

/// Sequence continuity of the flowhost records seen, in stream order.
#[derive(Debug, Default)]
struct SeqTrack {
    first: Option<(u64, ObservedRef)>,
    last: Option<u64>,
    breaks: Vec<SeqBreak>,
    without_seq: u64,
}

/// A place where `flowhost.seq` did not continue by one.
#[derive(Debug, Clone)]
struct SeqBreak {
    at: ObservedRef,
    expected: u64,
}

impl fmt::Display for SeqBreak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at {}: expected seq {}", self.at, self.expected)
    }
}

#[derive(Debug, Default)]
struct Acc {
    decisions: u64,
    order: Vec<Key>,
    findings: HashMap<Key, Finding>,
    seq: SeqTrack,
}

impl Acc {
    /// Judges one decision; `at` builds its location (only when one is needed).
    fn judge(
        &mut self,
        matcher: &Matcher<'_>,
        d: &ObsDecision<'_>,
        seq: Option<u64>,
        at: impl Fn() -> ObservedRef,
    ) -> Result<(), String> {
        self.decisions += 1;
        match seq {
            Some(seq) => {
                match self.seq.last {
                    None => self.seq.first = Some((seq, at())),
                    Some(last) if seq != last.saturating_add(1) => {
                        self.seq.breaks.push(SeqBreak {
                            at: at(),
                            expected: last.saturating_add(1),
                        });
                    }
                    Some(_) => {}
                }
                self.seq.last = Some(seq);
            }
            None => self.seq.without_seq += 1,
        }
        let Some((kind, reason)) = judge(matcher, d)? else {
            return Ok(());
        };
        let target = d.action.target.as_ref().map(observed::ObsTarget::to_json);
        let key = Key {
            kind,
            tool: d.tool.name.0.to_string(),
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
        match self.findings.get_mut(&key) {
            Some(f) => {
                f.occurrences += 1;
                if f.examples.len() < MAX_EXAMPLES {
                    f.examples.push(at());
                }
            }
            None => {
                let f = Finding {
                    kind,
                    severity: kind.severity(),
                    message: format!(
                        "{}: {} {} by tool {}: {reason}",
                        kind,
                        match (&key.provider, &key.category) {
                            (Some(p), Some(c)) => format!("{p}/{c}"),
                            (None, Some(c)) => c.clone(),
                            _ => "unclassified action".to_string(),
                        },
                        key.effect,
                        key.tool
                    ),
                    tool: Some(key.tool.clone()),
                    provider: key.provider.clone(),
                    category: key.category.clone(),
                    effect: Some(key.effect.clone()),
                    target,
                    occurrences: 1,
                    examples: vec![at()],
                };
                self.order.push(key.clone());
                self.findings.insert(key, f);
            }
        }
        Ok(())
    }

    fn shift_lines(&mut self, offset: u64) {
        let shift = |r: &mut ObservedRef| {
            if let Some(l) = r.line.as_mut() {
                *l += offset;
            }
        };
        for f in self.findings.values_mut() {
            f.examples.iter_mut().for_each(shift);
        }
        if let Some((_, r)) = self.seq.first.as_mut() {
            shift(r);
        }
        self.seq.breaks.iter_mut().for_each(|b| shift(&mut b.at));
    }

    /// Appends `later` (which comes after `self` in stream order).
    fn merge(&mut self, later: Acc) {
        self.decisions += later.decisions;
        if let (Some(last), Some((first, at))) = (self.seq.last, later.seq.first.as_ref())
            && *first != last.saturating_add(1)
        {
            self.seq.breaks.push(SeqBreak {
                at: at.clone(),
                expected: last.saturating_add(1),
            });
        }
        if self.seq.first.is_none() {
            self.seq.first = later.seq.first;
        }
        if later.seq.last.is_some() {
            self.seq.last = later.seq.last;
        }
        self.seq.breaks.extend(later.seq.breaks);
        self.seq.without_seq += later.seq.without_seq;
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

    fn finish(mut self, health: Option<&ToolObservationHealth>) -> DiffReport {
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
                let observed = (self.seq.first.as_ref().map(|(s, _)| *s), self.seq.last);
                let declared = (h.records.first_seq, h.records.last_seq);
                if self.seq.without_seq == 0 && observed != declared {
                    gaps.push(format!(
                        "the observed records cover seq {} but the health covers {}",
                        range(observed),
                        range(declared)
                    ));
                }
            }
        }
        if !self.seq.breaks.is_empty() {
            gaps.push(format!(
                "the observed records are not contiguous ({}{})",
                self.seq.breaks[..self.seq.breaks.len().min(3)]
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
                if self.seq.breaks.len() > 3 {
                    "; ..."
                } else {
                    ""
                }
            ));
        }
        let observation_complete = gaps.is_empty();
        let mut findings: Vec<Finding> = self
            .order
            .iter()
            .filter_map(|k| self.findings.remove(k))
            .collect();
        if !gaps.is_empty() {
            findings.push(Finding {
                kind: FindingKind::InconclusiveObservationGap,
                severity: Severity::Warning,
                message: format!("inconclusive_observation_gap: {}", gaps.join("; ")),
                tool: None,
                provider: None,
                category: None,
                effect: None,
                target: None,
                occurrences: 1,
                examples: Vec::new(),
            });
        }
        // Stable order: severity, then kind, then first appearance (already the order).
        findings.sort_by_key(|f| (f.severity, f.kind));
        let gating = findings
            .iter()
            .any(|f| f.kind != FindingKind::InconclusiveObservationGap);
        let any_gap = findings
            .iter()
            .any(|f| f.kind == FindingKind::InconclusiveObservationGap);
        let exit_code = if gating {
            1
        } else if any_gap {
            3
        } else {
            0
        };
        DiffReport {
            schema: DIFF_SCHEMA,
            observed_decisions: self.decisions,
            observation_complete: observation_complete && !any_gap,
            findings,
            exit_code,
        }
    }
}

fn range((first, last): (Option<u64>, Option<u64>)) -> String {
    match (first, last) {
        (Some(a), Some(b)) => format!("{a}..={b}"),
        _ => "nothing".to_string(),
    }
}

#[cfg(test)]
mod tests;
