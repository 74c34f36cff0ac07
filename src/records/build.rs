//! Building records from what the host knows of a decision: the facts of a call or of an
//! egress attempt, and the verdict, assembled into a record with its text sanitised.

use super::*;
use crate::label::InformationLabel;

/// The flow facts a decision carries; everything optional (use `..Default::default()`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FlowContext {
    /// The calling principal.
    pub principal: Option<String>,
    /// The session.
    pub session: Option<String>,
    /// The host's call id.
    pub call_id: Option<String>,
    /// The egress source label.
    pub source_label: Option<InformationLabel>,
    /// The clearances checked.
    pub clearance_used: Option<Vec<InformationLabel>>,
    /// What made it egress.
    pub egress_basis: Option<EgressBasis>,
    /// The labels the decision left behind.
    pub labels_after: Option<LabelsAfter>,
    /// The peer, for refusals of an unmapped peer.
    pub peer: Option<PeerIdentity>,
    /// How the observation contradicts the declaration.
    pub declaration_mismatch: Option<DeclarationMismatch>,
    /// The refusals this record stands for, when folded.
    pub folded: Option<Folded>,
    /// The grant the decision was taken under.
    pub grant: Option<GrantFacts>,
    /// What a `relay` record relayed.
    pub relay: Option<RelayFacts>,
}

/// Everything the host knows about a `tools/call` decision (raw arguments are not part of
/// it: they go through [`project_tool_call`] first).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallFacts {
    /// The server.
    pub server: ServerInfo,
    /// The tool name as called.
    pub tool_name: String,
    /// The projection of the arguments by the operator's mapping.
    pub projection: Projection,
    /// The verdict.
    pub verdict: Verdict,
    /// The credential alias the call used.
    pub credential_alias: Option<String>,
    /// The trace context (see [`correlation_from_params`]).
    pub correlation: Correlation,
    /// The flow facts.
    pub context: FlowContext,
}

/// Everything the host knows about a broker-observed outbound operation.
#[derive(Debug, Clone, PartialEq)]
pub struct EgressFacts {
    /// The server whose executor made the attempt.
    pub server: ServerInfo,
    /// The tool whose call the executor was serving.
    pub tool_name: String,
    /// The broker's observation (the target is projected from it).
    pub broker: BrokerDetails,
    /// The verdict.
    pub verdict: Verdict,
    /// The credential alias in use, if any.
    pub credential_alias: Option<String>,
    /// The trace context of the call being served.
    pub correlation: Correlation,
    /// The flow facts.
    pub context: FlowContext,
}

impl DecisionRecord {
    /// The record of a `tools/call` decision. `seq` and `prev_hash` are left for the writer;
    /// `recorded_at` is now. Text is sanitised (control characters replaced by U+FFFD).
    pub fn tool_call(facts: ToolCallFacts) -> Self {
        Self::from_call_facts(facts, EventKind::ToolCall)
    }

    /// The record of what became of an allowed `tools/call` (see [`EventKind::ToolOutcome`]).
    pub fn tool_outcome(facts: ToolCallFacts) -> Self {
        Self::from_call_facts(facts, EventKind::ToolOutcome)
    }

    /// The record of a refusal before any tool was named (see [`EventKind::Session`]).
    pub fn session(facts: ToolCallFacts) -> Self {
        Self::from_call_facts(facts, EventKind::Session)
    }

    /// The record of `event` (anything but an egress attempt) from a call's facts.
    pub fn from_call_facts(facts: ToolCallFacts, event: EventKind) -> Self {
        let ToolCallFacts {
            server,
            tool_name,
            projection,
            verdict,
            credential_alias,
            correlation,
            context,
        } = facts;
        build(
            server,
            &tool_name,
            projection,
            verdict,
            credential_alias.as_deref(),
            correlation,
            context,
            event,
            None,
        )
    }

    /// The record of a broker-observed outbound operation: provider `network`, category
    /// `network_egress`, target projected by [`project_egress`].
    pub fn egress_attempt(facts: EgressFacts) -> Self {
        let EgressFacts {
            server,
            tool_name,
            broker,
            verdict,
            credential_alias,
            correlation,
            context,
        } = facts;
        let projection = project_egress(&broker);
        let broker = BrokerDetails {
            executable: broker.executable.as_deref().map(sanitize),
            syscall: sanitize(&broker.syscall),
            family: sanitize(&broker.family),
            socket_type: broker.socket_type.as_deref().map(sanitize),
            protocol: broker.protocol.as_deref().map(sanitize),
            dns_query_type: broker.dns_query_type.as_deref().map(sanitize),
            destination: broker.destination.map(|d| match d {
                Destination::Unix(u) => Destination::Unix(UnixDestination {
                    unix_path: sanitize(&u.unix_path),
                }),
                Destination::Undecoded(u) => Destination::Undecoded(UndecodedDestination {
                    undecoded: sanitize(&u.undecoded),
                }),
                inet => inet,
            }),
            ..broker
        };
        build(
            server,
            &tool_name,
            projection,
            verdict,
            credential_alias.as_deref(),
            correlation,
            context,
            EventKind::EgressAttempt,
            Some(broker),
        )
    }
}

#[allow(clippy::too_many_arguments)] // one private assembly point for the two public constructors
fn build(
    server: ServerInfo,
    tool_name: &str,
    projection: Projection,
    verdict: Verdict,
    credential_alias: Option<&str>,
    correlation: Correlation,
    context: FlowContext,
    event: EventKind,
    broker: Option<BrokerDetails>,
) -> DecisionRecord {
    let (effect, status) = match &verdict {
        Verdict::Authorized { .. } => (Effect::Allow, "authorized"),
        Verdict::Succeeded { .. } => (Effect::Allow, "success"),
        Verdict::Refused { .. } => (Effect::Deny, "blocked"),
        Verdict::Failed(f) => (Effect::Error, f.as_str()),
    };
    let asserted = matches!(verdict, Verdict::Succeeded { .. });
    DecisionRecord {
        server: ServerInfo {
            id: sanitize(&server.id),
            transport: sanitize(&server.transport),
            declared_manifest_digest: server.declared_manifest_digest.as_deref().map(sanitize),
        },
        tool: ToolInfo {
            name: sanitize(tool_name),
            category: projection.category,
        },
        classification: projection.classification,
        reason_code: projection.reason_code,
        detail: projection.detail,
        action: projection.action,
        decision: Decision {
            effect,
            source: DECISION_SOURCE.to_string(),
            rule_id: verdict.rule().map(sanitize),
            enforced: true,
        },
        response: Response {
            status: status.to_string(),
            side_effect_asserted: asserted,
            side_effect_verified: false,
        },
        redaction: Redaction::redacted(credential_alias),
        correlation,
        flowhost: FlowhostExtension {
            schema: RECORD_SCHEMA.to_string(),
            seq: 0,
            prev_hash: GENESIS_HASH.to_string(),
            recorded_at: now_rfc3339(),
            event,
            principal: context.principal.as_deref().map(sanitize),
            session: context.session.as_deref().map(sanitize),
            call_id: context.call_id.as_deref().map(sanitize),
            source_label: context.source_label,
            clearance_used: context.clearance_used,
            denial_kind: verdict.denial(),
            egress_basis: context.egress_basis,
            broker,
            labels_after: context.labels_after,
            peer: context.peer,
            declaration_mismatch: context.declaration_mismatch,
            folded: context.folded,
            grant: context.grant.map(|g| GrantFacts {
                id: sanitize(&g.id),
                purpose: sanitize(&g.purpose),
            }),
            relay: context.relay,
        },
    }
}

/// The current time as RFC 3339 UTC with microseconds (`2026-11-30T10:07:00.123456Z`).
pub fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// Replaces control characters by U+FFFD and cuts the text to [`MAX_TEXT_BYTES`] (on a
/// character boundary), so text from callers and publishers cannot forge lines or bloat
/// records. Empty text becomes U+FFFD: no record field may be empty, and a decision about
/// an empty name (a client calling tool `""`) must still have its record.
pub fn sanitize(text: &str) -> String {
    // Most text needs neither: copied as it is.
    if !text.is_empty() && text.len() <= MAX_TEXT_BYTES && !super::validate::has_control(text) {
        return text.to_string();
    }
    replace_and_cut(text)
}

/// What [`sanitize`] makes of any text, a character at a time.
pub(super) fn replace_and_cut(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_TEXT_BYTES));
    for c in text.chars() {
        let c = if c.is_control() { '\u{FFFD}' } else { c };
        if out.len() + c.len_utf8() > MAX_TEXT_BYTES {
            break;
        }
        out.push(c);
    }
    if out.is_empty() {
        out.push('\u{FFFD}');
    }
    out
}
