//! Reading records strictly and checking the invariants the types alone cannot state.

use super::*;

impl DecisionRecord {
    /// Parses one line strictly (unknown fields rejected) and checks the invariants.
    pub fn from_json_line(line: &[u8]) -> Result<Self, RecordFormatError> {
        let record: DecisionRecord =
            serde_json::from_slice(line).map_err(|e| RecordFormatError {
                field: "(json)".to_string(),
                problem: e.to_string(),
            })?;
        record.validate()?;
        Ok(record)
    }

    /// Checks every invariant of the format: the constant fields, the value sets, the
    /// category/scope and effect/side-effect rules, the trace rules, the event/broker
    /// pairing, the hash and time formats, and that no text holds a control character.
    pub fn validate(&self) -> Result<(), RecordFormatError> {
        let fail = |field: &str, problem: String| {
            Err(RecordFormatError {
                field: field.to_string(),
                problem,
            })
        };
        let x = &self.flowhost;
        if x.schema != RECORD_SCHEMA {
            return fail("flowhost.schema", format!("must be {RECORD_SCHEMA:?}"));
        }
        if self.decision.source != DECISION_SOURCE {
            return fail("decision.source", format!("must be {DECISION_SOURCE:?}"));
        }
        if !self.redaction.arguments_redacted {
            return fail("redaction.arguments_redacted", "must be true".into());
        }
        if self.redaction.secret_material_stored {
            return fail("redaction.secret_material_stored", "must be false".into());
        }
        if self.response.side_effect_verified {
            return fail("response.side_effect_verified", "must be false".into());
        }
        if self.decision.effect == Effect::Deny && self.response.side_effect_asserted {
            return fail(
                "response.side_effect_asserted",
                "must be false when decision.effect is deny".into(),
            );
        }
        check_code("reason_code", &self.reason_code)?;
        if let Some(d) = &self.detail {
            check_code("detail", d)?;
        }
        match (&self.tool.category, &self.action.required_scope) {
            (Some(c), Some(s)) => {
                check_code("tool.category", c)?;
                check_text("action.required_scope", s)?;
                if self.action.class == ActionClass::Unclassified {
                    return fail(
                        "action.class",
                        "must not be unclassified when tool.category is set".into(),
                    );
                }
            }
            (Some(_), None) => {
                return fail(
                    "action.required_scope",
                    "must be a non-empty string when tool.category is set".into(),
                );
            }
            (None, Some(_)) => {
                return fail(
                    "action.required_scope",
                    "must be null when tool.category is null".into(),
                );
            }
            (None, None) => {}
        }
        if matches!(
            self.classification,
            Classification::Classified | Classification::ClassifiedIncomplete
        ) && self.tool.category.is_none()
        {
            return fail(
                "tool.category",
                "must be set when the action is classified".into(),
            );
        }
        if self.classification == Classification::ObservedUnknownTool
            && (self.tool.category.is_some()
                || self.action.target.is_some()
                || self.action.class != ActionClass::Unclassified)
        {
            return fail(
                "classification",
                "observed_unknown_tool requires a null category, a null target and class unclassified"
                    .into(),
            );
        }
        if let Some(t) = &self.action.target {
            if t.provider().is_none() {
                return fail("action.target.provider", "must be a string".into());
            }
            for (k, v) in &t.0 {
                check_text("action.target (field name)", k)?;
                if let TargetValue::Text(s) = v {
                    check_text(&format!("action.target.{k}"), s)?;
                }
            }
        }
        match self.correlation.basis {
            CorrelationBasis::PropagatedTraceContext => {
                match &self.correlation.traceparent {
                    Some(tp) if trace::is_valid_traceparent(tp) => {}
                    _ => {
                        return fail(
                            "correlation.traceparent",
                            "must be a valid traceparent when the basis is propagated".into(),
                        );
                    }
                }
                if self.correlation.source_class.as_deref() != Some("propagated") {
                    return fail(
                        "correlation.source_class",
                        "must be \"propagated\" when the basis is propagated".into(),
                    );
                }
            }
            _ => {
                if self.correlation.traceparent.is_some() || self.correlation.source_class.is_some()
                {
                    return fail(
                        "correlation",
                        "traceparent and source_class must be null unless propagated".into(),
                    );
                }
            }
        }
        match (x.event, &x.broker) {
            (
                EventKind::ToolCall
                | EventKind::ToolOutcome
                | EventKind::Session
                | EventKind::Relay
                | EventKind::ContentRequest
                | EventKind::ContentOutcome,
                Some(_),
            ) => {
                return fail(
                    "flowhost.broker",
                    "must be null unless the event is egress_attempt".into(),
                );
            }
            (EventKind::EgressAttempt, None) => {
                return fail(
                    "flowhost.broker",
                    "is required for an egress_attempt".into(),
                );
            }
            _ => {}
        }
        if self.decision.effect == Effect::Deny && x.denial_kind.is_none() {
            return fail(
                "flowhost.denial_kind",
                "a deny must say why (a denial code)".into(),
            );
        }
        if matches!(x.event, EventKind::ToolOutcome | EventKind::ContentOutcome)
            && self.decision.effect == Effect::Deny
        {
            return fail(
                "decision.effect",
                "a tool_outcome or content_outcome is allow (success) or error, never deny".into(),
            );
        }
        // The broker's and the grant's words too: a record is shown on terminals and in
        // reports, and one decoded from a file made elsewhere may hold what the builder
        // would have cleaned.
        if let Some(b) = &x.broker {
            let texts = [
                ("flowhost.broker.executable", b.executable.as_deref()),
                ("flowhost.broker.syscall", Some(b.syscall.as_str())),
                ("flowhost.broker.family", Some(b.family.as_str())),
                ("flowhost.broker.socket_type", b.socket_type.as_deref()),
                ("flowhost.broker.protocol", b.protocol.as_deref()),
                (
                    "flowhost.broker.dns_query_type",
                    b.dns_query_type.as_deref(),
                ),
            ];
            for (field, text) in texts {
                check_no_control(field, text.unwrap_or_default())?;
            }
            let destination: Vec<&str> = match &b.destination {
                Some(crate::records::Destination::Inet(i)) => i
                    .host_name
                    .iter()
                    .chain(&i.other_host_names)
                    .map(String::as_str)
                    .collect(),
                Some(crate::records::Destination::Unix(u)) => vec![u.unix_path.as_str()],
                Some(crate::records::Destination::Undecoded(u)) => vec![u.undecoded.as_str()],
                Some(crate::records::Destination::Netlink(_)) | None => Vec::new(),
            };
            for text in destination {
                check_no_control("flowhost.broker.destination", text)?;
            }
        }
        if let Some(g) = &x.grant {
            check_no_control("flowhost.grant.id", &g.id)?;
            check_no_control("flowhost.grant.purpose", &g.purpose)?;
        }
        if x.relay.is_some() != (x.event == EventKind::Relay) {
            return fail(
                "flowhost.relay",
                "is present exactly on a relay record".into(),
            );
        }
        if x.declaration_mismatch.is_some() && x.event != EventKind::EgressAttempt {
            return fail(
                "flowhost.declaration_mismatch",
                "is only recorded on an egress_attempt".into(),
            );
        }
        if let Some(f) = &x.folded {
            if self.decision.effect != Effect::Deny || f.count < 1 {
                return fail(
                    "flowhost.folded",
                    "only refusals fold, and a fold stands for at least one".into(),
                );
            }
            for (field, t) in [
                ("flowhost.folded.first_at", &f.first_at),
                ("flowhost.folded.last_at", &f.last_at),
            ] {
                if chrono::DateTime::parse_from_rfc3339(t).is_err() {
                    return fail(field, "must be an RFC 3339 time".into());
                }
            }
        }
        if x.seq == 0 {
            return fail("flowhost.seq", "must be at least 1".into());
        }
        if ChainHash::parse(&x.prev_hash).is_none() {
            return fail(
                "flowhost.prev_hash",
                "must be \"sha256:\" and 64 lowercase hex digits".into(),
            );
        }
        if chrono::DateTime::parse_from_rfc3339(&x.recorded_at).is_err() {
            return fail("flowhost.recorded_at", "must be an RFC 3339 time".into());
        }
        for (field, value) in [
            ("server.id", Some(&self.server.id)),
            ("server.transport", Some(&self.server.transport)),
            (
                "server.declared_manifest_digest",
                self.server.declared_manifest_digest.as_ref(),
            ),
            ("tool.name", Some(&self.tool.name)),
            ("action.verb", self.action.verb.as_ref()),
            ("action.resource_type", self.action.resource_type.as_ref()),
            ("decision.rule_id", self.decision.rule_id.as_ref()),
            ("response.status", Some(&self.response.status)),
            (
                "redaction.credential_alias",
                self.redaction.credential_alias.as_ref(),
            ),
            ("flowhost.principal", x.principal.as_ref()),
            ("flowhost.session", x.session.as_ref()),
            ("flowhost.call_id", x.call_id.as_ref()),
        ] {
            if let Some(v) = value {
                check_text(field, v)?;
            }
        }
        Ok(())
    }
}

/// A record field that breaks the format, named by its JSON path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("field {field}: {problem}")]
pub struct RecordFormatError {
    /// The JSON path of the field (e.g. `flowhost.prev_hash`).
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

/// Whether `s` is a snake_case code: `[a-z][a-z0-9_]*`, at most [`MAX_CODE_BYTES`].
pub fn is_code(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z'))
        && s.len() <= MAX_CODE_BYTES
        && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}

fn check_code(field: &str, s: &str) -> Result<(), RecordFormatError> {
    if is_code(s) {
        Ok(())
    } else {
        Err(RecordFormatError {
            field: field.to_string(),
            problem: format!(
                "{s:?} is not a snake_case code ([a-z][a-z0-9_]*, at most {MAX_CODE_BYTES} bytes)"
            ),
        })
    }
}

/// Whether `s` holds a control character (Unicode category Cc: U+0000-U+001F and
/// U+007F-U+009F). Most text is ASCII, checked a byte at a time without decoding.
#[inline]
pub(crate) fn has_control(s: &str) -> bool {
    let bytes = s.as_bytes();
    if bytes.is_ascii() {
        // Without an early exit, so the loop is vectorised: texts are short and clean.
        bytes
            .iter()
            .fold(false, |found, &b| found | (b < 0x20) | (b == 0x7f))
    } else {
        s.chars().any(char::is_control)
    }
}

/// Refuses a control character in `s` (of any length, empty included).
fn check_no_control(field: &str, s: &str) -> Result<(), RecordFormatError> {
    if has_control(s) {
        return Err(RecordFormatError {
            field: field.to_string(),
            problem: "contains a control character".to_string(),
        });
    }
    Ok(())
}

fn check_text(field: &str, s: &str) -> Result<(), RecordFormatError> {
    let problem = if s.is_empty() {
        "must not be empty"
    } else if s.len() > MAX_TEXT_BYTES {
        "is longer than 1024 bytes"
    } else if has_control(s) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(RecordFormatError {
        field: field.to_string(),
        problem: problem.to_string(),
    })
}
