//! `tool_observation_health`: whether observation was complete, so that "no observed calls"
//! can be read as "no calls".
//!
//! Schema `flowhost.tool_observation_health.v0`; every daemon-side field is nullable, and
//! `null` means *unknown*, which always counts as incomplete:
//!
//! | field | complete when |
//! |---|---|
//! | `proxy_seen` | true: the host's MCP endpoint handled the traffic |
//! | `tool_calls_observed` | known (a count of tools/call decisions) |
//! | `policy_layer_active` | true: every call was decided by policy |
//! | `classifier_version` | known (the record mapping / classifier in force) |
//! | `unknown_tool_count` | known (calls to unmapped tools) |
//! | `redaction_active` | true |
//! | `broker_active` | true: the egress broker was attached |
//! | `executors_spawned`, `executors_supervised` | known and equal: the broker supervised every executor it spawned |
//! | `failed_notifications` | 0: no seccomp notification was lost or failed |
//! | `records.records_complete` | true: the sequence is contiguous and the chain intact |
//! | `records.writer_failed` | false |
//!
//! `run_ended` says whether the producer wrote the carrier when its run ended, after
//! closing the records (`false`: asked for while the run went on, so it says nothing of what
//! came after it; `null`: unknown, as from `flowhost health --records`). It does not make
//! observation incomplete, since a live health may well be complete so far, but the diff
//! binds no daemon or sandbox carrier to records unless it is true.
//!
//! `records` also carries the sequence range (`first_seq`, `last_seq`) and `chain_head`, which
//! bind the health to one record stream (a carrier read whose `chain_head` is not a chain
//! hash is refused, naming the file and the field). `complete` and `incomplete_reasons` are
//! derived from the other fields when written, and derived again when read (a stored
//! `complete` is never trusted).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::chain::{ChainHash, VerifyReport, verify_records};
use super::now_rfc3339;
use super::store::StoreError;
use super::writer::WriterStatus;
use crate::files::{FileError, write_atomic};

/// The health carrier's schema string.
pub const HEALTH_SCHEMA: &str = "flowhost.tool_observation_health.v0";
/// The schema of assay's runner health carrier, which flowhost also writes and reads.
pub const ASSAY_HEALTH_SCHEMA: &str = "assay.runner.observation_health.v0";
/// The prefix of the note that carries the whole flowhost carrier inside an assay one.
pub const ASSAY_EMBED_NOTE: &str = "flowhost.tool_observation_health=";

/// Who produced a health carrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthProducer {
    /// The running host (on shutdown or on demand): every field can be known.
    Daemon,
    /// `flowhost health --records`: only the record side is known.
    Offline,
    /// `flowhost sandbox run`: one command under the broker with no MCP endpoint; it has no
    /// tool calls, and the broker is its only way out.
    Sandbox,
}

/// The record side of the health.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordsHealth {
    /// The first sequence number present.
    pub first_seq: Option<u64>,
    /// The last durable sequence number.
    pub last_seq: Option<u64>,
    /// The hash of the last durable line.
    pub chain_head: Option<String>,
    /// Whether the sequence is contiguous and the chain intact (null: unknown).
    pub records_complete: Option<bool>,
    /// Whether the writer failed (the host then refused further calls).
    pub writer_failed: bool,
    /// Why it failed.
    pub writer_failure_reason: Option<String>,
    /// Verification problems, one per line, when the records were verified.
    #[serde(default)]
    pub problems: Vec<String>,
}

impl RecordsHealth {
    /// The record side as verification found it: range, head, and complete exactly when no
    /// problem was found.
    pub fn from_verify(report: &VerifyReport) -> Self {
        RecordsHealth {
            first_seq: report.first_seq,
            last_seq: report.last_seq,
            chain_head: report.head_hash.as_ref().map(|h| h.as_str().to_string()),
            records_complete: Some(report.is_ok()),
            writer_failed: false,
            writer_failure_reason: None,
            problems: report.problems.iter().map(ToString::to_string).collect(),
        }
    }

    /// The record side as the running writer sees it: its range and head, complete unless it
    /// failed or refused a decision's record.
    pub fn from_writer(status: &WriterStatus) -> Self {
        let problems = status
            .last_rejection
            .iter()
            .map(|last| {
                format!(
                    "{} decision(s) were refused their record (and so refused), so the records lack them; the last: {last}",
                    status.rejected
                )
            })
            .collect();
        RecordsHealth {
            first_seq: status.first_seq,
            last_seq: status.last_seq,
            chain_head: Some(status.chain_head.as_str().to_string()),
            records_complete: Some(status.failed.is_none() && status.rejected == 0),
            writer_failed: status.failed.is_some(),
            writer_failure_reason: status.failed.clone(),
            problems,
        }
    }
}

/// The `tool_observation_health` carrier (see the module docs for the fields and the
/// completeness rule). The daemon fills the fields it knows and calls
/// [`ToolObservationHealth::write_to`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolObservationHealth {
    /// Always [`HEALTH_SCHEMA`].
    pub schema: String,
    /// When it was produced (RFC 3339, UTC).
    pub generated_at: String,
    /// Who produced it.
    pub producer: HealthProducer,
    /// The host's MCP endpoint handled the traffic.
    pub proxy_seen: Option<bool>,
    /// How many tools/call decisions were observed.
    pub tool_calls_observed: Option<u64>,
    /// Every call was decided by policy.
    pub policy_layer_active: Option<bool>,
    /// The classifier (record mapping) version in force.
    pub classifier_version: Option<String>,
    /// How many calls were to unmapped tools.
    pub unknown_tool_count: Option<u64>,
    /// Records were redacted (arguments never stored).
    pub redaction_active: Option<bool>,
    /// The egress broker was attached.
    pub broker_active: Option<bool>,
    /// Executors the host spawned.
    pub executors_spawned: Option<u64>,
    /// Executors the broker supervised.
    pub executors_supervised: Option<u64>,
    /// seccomp notifications that failed or were lost.
    pub failed_notifications: Option<u64>,
    /// Whether its producer wrote it when its run ended, after closing the records (false:
    /// on demand, while the run went on; null: unknown). See the module docs.
    #[serde(default)]
    pub run_ended: Option<bool>,
    /// The record side.
    pub records: RecordsHealth,
    /// Egress attempts the signed declarations do not admit, per `server/tool` (findings
    /// for the diff; they do not make observation incomplete).
    #[serde(default)]
    pub declaration_mismatches: std::collections::BTreeMap<String, u64>,
    /// Whether the flow-state store failed (the host then refuses every call).
    #[serde(default)]
    pub flow_state_failed: bool,
    /// Why it failed.
    #[serde(default)]
    pub flow_state_failure_reason: Option<String>,
    /// Conditions an operator should act on that do not make observation incomplete (e.g.
    /// little free space left for the records).
    #[serde(default)]
    pub warnings: Vec<String>,
    /// What a bound cut short, one entry each (a run's wall-clock limit, a call's memory
    /// bound or deadline): observed whole up to there, but what would have come after is
    /// not observed, so nothing that run did vouches for the tool. Set by `sandbox run` and
    /// `sandbox mcp`, whose runs are the tool's test. Left out when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cut_short: Vec<String>,
    /// Derived: whether observation was complete.
    pub complete: bool,
    /// Derived: why not, one reason per entry.
    pub incomplete_reasons: Vec<String>,
}

/// A health file that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// Not readable.
    #[error("cannot read health file {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Not a valid carrier.
    #[error("health file {path} is not a {HEALTH_SCHEMA} carrier: {problem}")]
    Invalid {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong (with the JSON line and column when it is a syntax problem).
        problem: String,
    },
    /// A field holds a value it may not (the carrier may have been crafted).
    #[error("health file {path}: {field} {problem}")]
    Field {
        /// The file.
        path: std::path::PathBuf,
        /// The field, by its path in the carrier.
        field: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// Could not be written.
    #[error(transparent)]
    Write(#[from] FileError),
}

impl ToolObservationHealth {
    /// A carrier with every daemon field unknown (and so incomplete).
    pub fn unknown(producer: HealthProducer) -> Self {
        ToolObservationHealth {
            schema: HEALTH_SCHEMA.to_string(),
            generated_at: now_rfc3339(),
            producer,
            proxy_seen: None,
            tool_calls_observed: None,
            policy_layer_active: None,
            classifier_version: None,
            unknown_tool_count: None,
            redaction_active: None,
            broker_active: None,
            executors_spawned: None,
            executors_supervised: None,
            failed_notifications: None,
            run_ended: None,
            records: RecordsHealth::default(),
            declaration_mismatches: Default::default(),
            flow_state_failed: false,
            flow_state_failure_reason: None,
            warnings: Vec::new(),
            cut_short: Vec::new(),
            complete: false,
            incomplete_reasons: Vec::new(),
        }
    }

    /// Why observation was incomplete (empty: complete).
    pub fn assess(&self) -> Vec<String> {
        let mut why = Vec::new();
        let mut need_true = |name: &str, v: Option<bool>| match v {
            Some(true) => {}
            Some(false) => why.push(format!("{name} is false")),
            None => why.push(format!("{name} is unknown")),
        };
        need_true("proxy_seen", self.proxy_seen);
        need_true("policy_layer_active", self.policy_layer_active);
        need_true("redaction_active", self.redaction_active);
        need_true("broker_active", self.broker_active);
        need_true("records.records_complete", self.records.records_complete);
        if self.tool_calls_observed.is_none() {
            why.push("tool_calls_observed is unknown".into());
        }
        if self.unknown_tool_count.is_none() {
            why.push("unknown_tool_count is unknown".into());
        }
        match &self.classifier_version {
            Some(v) if !v.trim().is_empty() => {}
            _ => why.push("classifier_version is unknown".into()),
        }
        match (self.executors_spawned, self.executors_supervised) {
            (Some(s), Some(v)) if s == v => {}
            (Some(s), Some(v)) => why.push(format!(
                "the broker supervised {v} of {s} spawned executors"
            )),
            _ => why.push("executor supervision is unknown".into()),
        }
        match self.failed_notifications {
            Some(0) => {}
            Some(n) => why.push(format!("{n} seccomp notifications failed")),
            None => why.push("failed_notifications is unknown".into()),
        }
        for cut in &self.cut_short {
            why.push(format!(
                "cut short: {cut}; what would have come after is not observed"
            ));
        }
        if self.flow_state_failed {
            why.push(format!(
                "the flow-state store failed: {}",
                self.flow_state_failure_reason
                    .as_deref()
                    .unwrap_or("no reason given")
            ));
        }
        if self.records.writer_failed {
            why.push(format!(
                "the record writer failed: {}",
                self.records
                    .writer_failure_reason
                    .as_deref()
                    .unwrap_or("no reason given")
            ));
        }
        why
    }

    /// Sets `complete` and `incomplete_reasons` from the other fields.
    pub fn finalize(mut self) -> Self {
        self.incomplete_reasons = self.assess();
        self.complete = self.incomplete_reasons.is_empty();
        self
    }

    /// Serialises the finalized carrier as pretty JSON.
    pub fn to_json(&self) -> String {
        // Serialising plain structs of strings, numbers and booleans cannot fail.
        serde_json::to_string_pretty(&self.clone().finalize()).unwrap_or_default()
    }

    /// Writes the finalized carrier to `path` atomically (temporary file, fsync, rename).
    pub fn write_to(&self, path: &Path) -> Result<(), HealthError> {
        let mut text = self.to_json();
        text.push('\n');
        write_atomic(path, text.as_bytes(), 0o644)?;
        Ok(())
    }

    /// The carrier in assay's runner shape (`assay.runner.observation_health.v0`), where
    /// `policy_layer` expresses the gap: `present` only when the policy side of observation
    /// is complete (proxy seen, policy layer active, classifier known, records complete,
    /// writer and flow state healthy, nothing cut short). The broker is the kernel layer (`complete` when it
    /// supervised every executor and lost no notification; lost notifications count as
    /// `ringbuf_drops`). Every incomplete reason is a note, and the whole flowhost carrier
    /// rides along as one note (prefix [`ASSAY_EMBED_NOTE`]) so that flowhost can bind it to
    /// the records when it reads the carrier back.
    pub fn to_assay(&self) -> serde_json::Value {
        let h = self.clone().finalize();
        let reasons = h.assess();
        let policy_ok = h.proxy_seen == Some(true)
            && h.policy_layer_active == Some(true)
            && h.redaction_active == Some(true)
            && h.classifier_version
                .as_deref()
                .is_some_and(|v| !v.trim().is_empty())
            && h.tool_calls_observed.is_some()
            && h.unknown_tool_count.is_some()
            && h.records.records_complete == Some(true)
            && !h.records.writer_failed
            && !h.flow_state_failed
            && h.cut_short.is_empty();
        let drops = h.failed_notifications.unwrap_or(0);
        let kernel_layer = match (h.broker_active, h.failed_notifications) {
            (Some(true), Some(0)) => "complete",
            (Some(true), Some(_)) => "partial_ringbuf_drops",
            _ => "absent",
        };
        let supervised = matches!(
            (h.executors_spawned, h.executors_supervised),
            (Some(s), Some(v)) if s == v
        );
        let broker = h.broker_active == Some(true);
        let mut notes: Vec<String> = reasons;
        notes.push(format!(
            "{ASSAY_EMBED_NOTE}{}",
            serde_json::to_string(&h).unwrap_or_default()
        ));
        serde_json::json!({
            "schema": ASSAY_HEALTH_SCHEMA,
            "run_id": format!(
                "flowhost-{}",
                h.records
                    .chain_head
                    .as_deref()
                    .and_then(|c| c.strip_prefix("sha256:"))
                    // A carrier read back holds a checked hash; one built otherwise may not.
                    .map_or("none", |c| c.get(..16).unwrap_or(c))
            ),
            "platform": "linux",
            "kernel_layer": kernel_layer,
            "ringbuf_drops": drops,
            "policy_layer": if policy_ok { "present" } else { "absent" },
            "sdk_layer": "absent",
            "cgroup_correlation": if supervised { "clean" } else { "failed" },
            "network_protocol_coverage": if broker { "connect_and_datagram_peer_observed" } else { "absent" },
            "network_endpoint_claim_scope": if broker { "peer_set" } else { "not_applicable" },
            "notes": notes,
        })
    }

    /// Reads a carrier in assay's runner shape: the flowhost carrier embedded in its notes,
    /// checked against the assay fields (which must be exactly what that carrier gives). A
    /// carrier from another producer, with no flowhost carrier inside, binds to no flowhost
    /// records and is read as unknown (incomplete).
    fn from_assay(value: &serde_json::Value) -> Result<Self, AssayProblem> {
        let mut embedded = value
            .get("notes")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(serde_json::Value::as_str)
            .filter_map(|n| n.strip_prefix(ASSAY_EMBED_NOTE));
        let first = embedded.next();
        if embedded.next().is_some() {
            return Err(AssayProblem::Invalid(
                "its notes embed more than one flowhost carrier".into(),
            ));
        }
        let Some(embedded) = first else {
            let mut h = ToolObservationHealth::unknown(HealthProducer::Offline);
            h.records.problems.push(
                "an assay observation_health without a flowhost carrier binds to no flowhost records"
                    .into(),
            );
            return Ok(h.finalize());
        };
        let h = crate::canonical::parse_unique_keys(embedded)
            .map_err(|e| e.to_string())
            .and_then(|v| {
                serde_json::from_value::<ToolObservationHealth>(v).map_err(|e| e.to_string())
            })
            .map_err(|e| AssayProblem::Invalid(format!("the embedded flowhost carrier: {e}")))?;
        if h.schema != HEALTH_SCHEMA {
            return Err(AssayProblem::Invalid(format!(
                "the embedded carrier's schema is {:?}",
                h.schema
            )));
        }
        h.check_fields()
            .map_err(|(field, problem)| AssayProblem::Field(field, problem))?;
        let h = h.finalize();
        let expected = h.to_assay();
        for field in [
            "kernel_layer",
            "ringbuf_drops",
            "policy_layer",
            "cgroup_correlation",
            "network_protocol_coverage",
            "network_endpoint_claim_scope",
        ] {
            if value.get(field) != expected.get(field) {
                return Err(AssayProblem::Invalid(format!(
                    "{field} is {} but the embedded flowhost carrier gives {}",
                    value.get(field).unwrap_or(&serde_json::Value::Null),
                    expected.get(field).unwrap_or(&serde_json::Value::Null)
                )));
            }
        }
        Ok(h)
    }

    /// Checks the fields whose form the types do not fix: `records.chain_head` must be a
    /// chain hash (`sha256:` and 64 lowercase hex digits). On failure, the field and what is
    /// wrong with it.
    fn check_fields(&self) -> Result<(), (&'static str, String)> {
        if let Some(head) = &self.records.chain_head
            && ChainHash::parse(head).is_none()
        {
            return Err((
                "records.chain_head",
                format!("is {head:?}, not a chain hash (\"sha256:\" and 64 lowercase hex digits)"),
            ));
        }
        Ok(())
    }

    /// Reads a carrier strictly (flowhost's shape, or assay's runner shape with a flowhost
    /// carrier inside) and derives `complete` again from its fields.
    pub fn read_from(path: &Path) -> Result<Self, HealthError> {
        let bytes = std::fs::read(path).map_err(|source| HealthError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(path, &bytes)
    }

    /// [`ToolObservationHealth::read_from`], of `bytes` already read from `path`.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, HealthError> {
        let invalid = |problem: String| HealthError::Invalid {
            path: path.to_path_buf(),
            problem,
        };
        let bad_field = |(field, problem)| HealthError::Field {
            path: path.to_path_buf(),
            field,
            problem,
        };
        // A key given twice is read one way here and maybe the other way by another reader
        // (assay's, a person's): evidence that says two things is refused.
        let text = std::str::from_utf8(bytes).map_err(|e| invalid(format!("not UTF-8: {e}")))?;
        let value =
            crate::canonical::parse_unique_keys(text).map_err(|e| invalid(e.to_string()))?;
        if value.get("schema").and_then(serde_json::Value::as_str) == Some(ASSAY_HEALTH_SCHEMA) {
            return Self::from_assay(&value).map_err(|e| match e {
                AssayProblem::Invalid(problem) => invalid(problem),
                AssayProblem::Field(field, problem) => bad_field((field, problem)),
            });
        }
        let h: ToolObservationHealth =
            serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))?;
        if h.schema != HEALTH_SCHEMA {
            return Err(invalid(format!(
                "schema is {:?}, expected {HEALTH_SCHEMA:?}",
                h.schema
            )));
        }
        h.check_fields().map_err(bad_field)?;
        Ok(h.finalize())
    }
}

/// Why an assay-shaped carrier was refused.
enum AssayProblem {
    /// Not a valid carrier.
    Invalid(String),
    /// The flowhost carrier inside has a field it may not (field, what is wrong).
    Field(&'static str, String),
}

/// The record-side health of the records at `path` (a directory or file), computed offline:
/// sequence range, chain head and verification status; the daemon-only fields stay unknown,
/// so the result is always incomplete. (The daemon's on-demand mode fills those fields.)
pub fn offline_health(path: &Path) -> Result<ToolObservationHealth, StoreError> {
    let report = verify_records(path, None)?;
    let mut h = ToolObservationHealth::unknown(HealthProducer::Offline);
    h.records = RecordsHealth::from_verify(&report);
    // What the readers refuse as evidence is no complete record side either.
    if let Some(why) = super::chain::refused_as_evidence(path, &report) {
        h.records.records_complete = Some(false);
        h.records.problems.push(why);
    }
    Ok(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn complete_health() -> ToolObservationHealth {
        ToolObservationHealth {
            proxy_seen: Some(true),
            tool_calls_observed: Some(3),
            policy_layer_active: Some(true),
            classifier_version: Some("mapping-2026-11".into()),
            unknown_tool_count: Some(0),
            redaction_active: Some(true),
            broker_active: Some(true),
            executors_spawned: Some(2),
            executors_supervised: Some(2),
            failed_notifications: Some(0),
            records: RecordsHealth {
                first_seq: Some(1),
                last_seq: Some(3),
                chain_head: Some(crate::records::GENESIS_HASH.into()),
                records_complete: Some(true),
                ..RecordsHealth::default()
            },
            ..ToolObservationHealth::unknown(HealthProducer::Daemon)
        }
        .finalize()
    }

    #[test]
    fn complete_only_when_every_constituent_holds() {
        let h = complete_health();
        assert!(h.complete, "{:?}", h.incomplete_reasons);
        let mut partial = h.clone();
        partial.executors_supervised = Some(1);
        let partial = partial.finalize();
        assert!(!partial.complete);
        assert_eq!(
            partial.incomplete_reasons,
            vec!["the broker supervised 1 of 2 spawned executors"]
        );
        let mut failed = h.clone();
        failed.records.writer_failed = true;
        failed.records.writer_failure_reason = Some("disk full".into());
        assert!(!failed.finalize().complete);
        assert!(
            !ToolObservationHealth::unknown(HealthProducer::Offline)
                .finalize()
                .complete
        );
    }

    #[test]
    fn stored_complete_flag_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("health.json");
        let mut h = complete_health();
        h.broker_active = Some(false);
        let mut v = serde_json::to_value(h).unwrap();
        v["complete"] = serde_json::json!(true);
        v["incomplete_reasons"] = serde_json::json!([]);
        std::fs::write(&path, v.to_string()).unwrap();
        let read = ToolObservationHealth::read_from(&path).unwrap();
        assert!(!read.complete);
        assert_eq!(read.incomplete_reasons, vec!["broker_active is false"]);
    }

    #[test]
    fn the_assay_shape_round_trips_and_expresses_the_gap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("observation_health.json");
        let h = complete_health();
        let a = h.to_assay();
        assert_eq!(a["schema"], ASSAY_HEALTH_SCHEMA);
        assert_eq!(a["policy_layer"], "present");
        assert_eq!(a["kernel_layer"], "complete");
        std::fs::write(&path, a.to_string()).unwrap();
        assert_eq!(ToolObservationHealth::read_from(&path).unwrap(), h);

        // The gap shows in policy_layer, and its reason in the notes.
        let mut failed = h.clone();
        failed.records.writer_failed = true;
        let a = failed.finalize().to_assay();
        assert_eq!(a["policy_layer"], "absent");
        assert!(
            a["notes"][0]
                .as_str()
                .unwrap()
                .contains("record writer failed")
        );

        // An edited assay field that contradicts the carrier inside is refused.
        let mut edited = h.to_assay();
        edited["policy_layer"] = "present".into();
        edited["kernel_layer"] = "absent".into();
        std::fs::write(&path, edited.to_string()).unwrap();
        let err = ToolObservationHealth::read_from(&path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("kernel_layer"), "{err}");

        // assay's own carrier (no flowhost inside) binds to nothing: incomplete.
        std::fs::write(&path, r#"{"schema":"assay.runner.observation_health.v0","run_id":"run_001","platform":"linux","kernel_layer":"absent","ringbuf_drops":0,"policy_layer":"present","sdk_layer":"absent","cgroup_correlation":"partial","network_protocol_coverage":"absent","network_endpoint_claim_scope":"not_applicable","notes":[]}"#).unwrap();
        assert!(!ToolObservationHealth::read_from(&path).unwrap().complete);
    }

    /// A carrier that says two things (a key given twice, read last-wins here and maybe
    /// first-wins by assay; or two flowhost carriers in its notes) is refused.
    #[test]
    fn a_carrier_that_says_two_things_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("observation_health.json");
        let h = complete_health();
        let a = h.to_assay().to_string();
        let twice = a.replacen(
            "\"kernel_layer\":\"complete\"",
            "\"kernel_layer\":\"complete\",\"kernel_layer\":\"complete\"",
            1,
        );
        assert_ne!(twice, a);
        let mut failed = h.clone();
        failed.records.writer_failed = true;
        let mut two_notes = h.to_assay();
        let other = format!(
            "{ASSAY_EMBED_NOTE}{}",
            serde_json::to_string(&failed.finalize()).unwrap()
        );
        two_notes["notes"]
            .as_array_mut()
            .unwrap()
            .push(other.into());
        let own = serde_json::to_string(&h).unwrap();
        let own_twice = own.replacen("{", "{\"complete\":false,", 1);
        for text in [twice, two_notes.to_string(), own_twice] {
            std::fs::write(&path, &text).unwrap();
            let err = ToolObservationHealth::read_from(&path);
            assert!(err.is_err(), "{text}: {err:?}");
        }
    }

    /// A crafted carrier's `records.chain_head` is refused by name, whatever shape it comes
    /// in. Before, it was read unchecked, and cutting the run id from a head with a
    /// multi-byte character panicked (exit 101, no file named).
    #[test]
    fn a_chain_head_that_is_no_chain_hash_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("health.json");
        let mut h = complete_health();
        h.records.chain_head = Some(format!("sha256:a{}", "é".repeat(40)));
        // The assay shape, its carrier inside.
        let mut a = complete_health().to_assay();
        let embedded = format!("{ASSAY_EMBED_NOTE}{}", serde_json::to_string(&h).unwrap());
        a["notes"] = serde_json::json!([embedded]);
        // Then flowhost's own shape.
        for text in [a.to_string(), serde_json::to_string(&h).unwrap()] {
            std::fs::write(&path, text).unwrap();
            let err = ToolObservationHealth::read_from(&path)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&path.display().to_string()) && err.contains("records.chain_head"),
                "{err}"
            );
        }
        // A carrier built in memory never panics either.
        assert_eq!(h.to_assay()["schema"], ASSAY_HEALTH_SCHEMA);
    }

    #[test]
    fn write_then_read_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("health.json");
        let h = complete_health();
        h.write_to(&path).unwrap();
        assert_eq!(ToolObservationHealth::read_from(&path).unwrap(), h);
        std::fs::write(&path, "{\"schema\": \"other\"}").unwrap();
        assert!(ToolObservationHealth::read_from(&path).is_err());
    }
}
