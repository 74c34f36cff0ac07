//! Observed decision records (README, "Records and the diff"; docs/ARCHITECTURE.md, "Invariants").
//!
//! Every decision the host takes — each `tools/call` and each broker-observed egress attempt —
//! becomes one [`DecisionRecord`]: one JSON object on one line of a JSONL file. The object is an
//! `assay.tool_decision_surface.v0` decision object plus a `flowhost` extension object
//! ([`FlowhostExtension`]) carrying the flow facts (labels, clearance used, denial kind, egress
//! basis, broker details) and the hash chain (sequence number and previous-record hash).
//!
//! What a record can hold is fixed by its types: there is no field for raw arguments, results
//! or secrets. Targets are projections chosen by the operator's mapping
//! ([`projection::ToolMapping`]), with identifiers hashed where the mapping says so.
//!
//! Records are written by [`writer::RecordWriter`] (group commit, fail closed, rotation),
//! chained and verified by [`chain`], summarised by [`health`].

pub mod chain;
pub mod health;
pub mod projection;
pub mod store;
pub mod trace;
pub mod writer;

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::label::InformationLabel;

pub use crate::decision::{Denial, EgressBasis, Failure, Verdict};

pub use chain::{ChainHash, Chainer, GENESIS_HASH, line_hash};
pub use health::ToolObservationHealth;
pub use projection::{
    HashedField, Projection, ToolMapping, project_egress, project_tool_call, target_hash,
};
pub use trace::correlation_from_params;
pub use writer::{Committed, RecordError, RecordWriter, WriterOptions, WriterStatus};

/// The schema of the decision objects and of the exported envelope.
pub const DECISION_SURFACE_SCHEMA: &str = "assay.tool_decision_surface.v0";
/// The schema string carried in every record's `flowhost.schema`.
pub const RECORD_SCHEMA: &str = "flowhost.decision.v1";
/// The value of `decision.source` in every record flowhost writes.
pub const DECISION_SOURCE: &str = "flowhost";
/// The transport flowhost reports for its servers (MCP over the executor's stdio).
pub const TRANSPORT_MCP: &str = "mcp";
/// Longest free-text field (tool names, ids, plain target values, statuses), in bytes.
pub const MAX_TEXT_BYTES: usize = 1024;
/// Longest snake_case code (categories, reason codes, details, denial kinds), in bytes.
pub const MAX_CODE_BYTES: usize = 128;

/// One observed decision: an `assay.tool_decision_surface.v0` decision object plus the
/// `flowhost` extension. Serialises to exactly the documented JSON; decoding rejects unknown
/// fields, and [`DecisionRecord::validate`] checks the cross-field invariants (the writer and
/// every reader call it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionRecord {
    /// The server (tool publisher) the decision concerns.
    pub server: ServerInfo,
    /// The tool and its category (the operator's action class), if mapped.
    pub tool: ToolInfo,
    /// How well the action was classified.
    pub classification: Classification,
    /// Why it was classified so (snake_case code, e.g. `classified_github_deploy_key`).
    pub reason_code: String,
    /// Extra snake_case detail, present only for `classified_incomplete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The action, with its projected target.
    pub action: Action,
    /// The host's decision.
    pub decision: Decision,
    /// What the host reported back.
    pub response: Response,
    /// The redaction facts (constant: arguments redacted, no secret material stored).
    pub redaction: Redaction,
    /// The trace context basis.
    pub correlation: Correlation,
    /// flowhost's extension: flow facts and the hash chain.
    pub flowhost: FlowhostExtension,
}

/// `server`: which server the decision concerns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerInfo {
    /// The server id from its signed manifest.
    pub id: String,
    /// How the host talks to it (`mcp`).
    pub transport: String,
    /// `sha256:<hex>` of the signed manifest body, when known.
    pub declared_manifest_digest: Option<String>,
}

impl ServerInfo {
    /// An MCP server with its manifest digest (control characters in `id` are replaced).
    pub fn mcp(id: &str, declared_manifest_digest: Option<&str>) -> Self {
        ServerInfo {
            id: sanitize(id),
            transport: TRANSPORT_MCP.to_string(),
            declared_manifest_digest: declared_manifest_digest.map(sanitize),
        }
    }
}

/// `tool`: the tool name and its category.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolInfo {
    /// The full tool name as called.
    pub name: String,
    /// The action class (e.g. `github_deploy_key`, `network_egress`); `null` when unmapped.
    pub category: Option<String>,
}

/// `classification`: how well the action could be classified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Classification {
    /// Mapped, with every required target field.
    Classified,
    /// Mapped, but a required target field was missing: the target is incomplete.
    ClassifiedIncomplete,
    /// No mapping for this tool: target and category are null.
    ObservedUnknownTool,
    /// Reserved: the record could not be redacted faithfully.
    RedactionFailed,
    /// Reserved: the action was not observed.
    NotObserved,
}

impl Classification {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Classification::Classified => "classified",
            Classification::ClassifiedIncomplete => "classified_incomplete",
            Classification::ObservedUnknownTool => "observed_unknown_tool",
            Classification::RedactionFailed => "redaction_failed",
            Classification::NotObserved => "not_observed",
        }
    }
}

/// `action.class`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionClass {
    /// A mapped (operator-classified) tool action.
    PrivilegedAdminAction,
    /// An outbound network or socket operation seen by the broker.
    NetworkEgress,
    /// An unmapped tool.
    Unclassified,
}

/// `action`: what was attempted, on what.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Action {
    /// The action class.
    pub class: ActionClass,
    /// The verb (e.g. `create`, `connect`); null when unmapped.
    pub verb: Option<String>,
    /// The resource type; null when unmapped.
    pub resource_type: Option<String>,
    /// The projected target; null when unmapped.
    pub target: Option<Target>,
    /// The scope the action needs; non-null exactly when the tool has a category.
    pub required_scope: Option<String>,
}

impl Action {
    /// The action of an unmapped tool: everything null.
    pub fn unclassified() -> Self {
        Action {
            class: ActionClass::Unclassified,
            verb: None,
            resource_type: None,
            target: None,
            required_scope: None,
        }
    }
}

/// One value of a projected target: only scalars, never objects or arrays.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetValue {
    /// A string (a plain argument, a `sha256:` hash, an address, ...).
    Text(String),
    /// A non-negative integer (a port).
    Integer(u64),
    /// A boolean.
    Flag(bool),
}

impl TargetValue {
    /// The string, if this is one.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            TargetValue::Text(s) => Some(s),
            _ => None,
        }
    }
}

/// A projected target: field name -> scalar, always with a `provider` string.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Target(pub BTreeMap<String, TargetValue>);

impl Target {
    /// A target holding only its provider.
    pub fn for_provider(provider: &str) -> Self {
        let mut t = Target::default();
        t.insert_text("provider", provider);
        t
    }

    /// The `provider` field.
    pub fn provider(&self) -> Option<&str> {
        self.0.get("provider").and_then(TargetValue::as_text)
    }

    /// A field's value.
    pub fn get(&self, field: &str) -> Option<&TargetValue> {
        self.0.get(field)
    }

    /// Sets a string field (control characters replaced).
    pub fn insert_text(&mut self, field: &str, value: &str) {
        self.0
            .insert(field.to_string(), TargetValue::Text(sanitize(value)));
    }
}

/// `decision.effect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// The action was allowed.
    Allow,
    /// The action was refused.
    Deny,
    /// The host failed while deciding or dispatching; the effect may or may not have happened.
    Error,
}

impl Effect {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Effect::Allow => "allow",
            Effect::Deny => "deny",
            Effect::Error => "error",
        }
    }
}

/// `decision`: the host's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// allow, deny or error.
    pub effect: Effect,
    /// Always `flowhost`.
    pub source: String,
    /// The operator rule that decided, when one did.
    pub rule_id: Option<String>,
    /// Whether the verdict was enforced (flowhost enforces every verdict it records).
    pub enforced: bool,
}

/// `response`: what was reported back to the caller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    /// The status: `authorized` for an allow recorded before its effect, `success` after a
    /// completed effect, `blocked` for a deny, an error code for an error.
    pub status: String,
    /// `effect == allow && status == "success"`; always false for a deny.
    pub side_effect_asserted: bool,
    /// Always false: a record never claims a verified side effect.
    pub side_effect_verified: bool,
}

/// `redaction`: constant facts about what the record does not hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Redaction {
    /// Always true: raw arguments are never stored.
    pub arguments_redacted: bool,
    /// The alias of the credential the call used, never the credential.
    pub credential_alias: Option<String>,
    /// Always false.
    pub secret_material_stored: bool,
}

impl Redaction {
    /// The only redaction flowhost writes, with an optional credential alias.
    pub fn redacted(credential_alias: Option<&str>) -> Self {
        Redaction {
            arguments_redacted: true,
            credential_alias: credential_alias.map(sanitize),
            secret_material_stored: false,
        }
    }
}

/// `correlation.basis`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CorrelationBasis {
    /// A valid `traceparent` was supplied and is kept verbatim.
    PropagatedTraceContext,
    /// A `traceparent` was supplied but invalid; its value was dropped.
    MalformedTraceContext,
    /// No trace context.
    None,
}

/// `correlation`: the caller-supplied trace context, a claim rather than an observed fact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Correlation {
    /// The basis.
    pub basis: CorrelationBasis,
    /// The traceparent, only when propagated.
    pub traceparent: Option<String>,
    /// `propagated` only when propagated.
    pub source_class: Option<String>,
}

impl Correlation {
    /// No trace context.
    pub fn none() -> Self {
        Correlation {
            basis: CorrelationBasis::None,
            traceparent: None,
            source_class: None,
        }
    }
}

/// `flowhost.event`: which kind of decision this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A `tools/call` decision.
    ToolCall,
    /// A broker-observed outbound operation.
    EgressAttempt,
    /// What became of an allowed `tools/call` once its executor answered: `allow` with
    /// status `success` (the side effect is asserted), or `error` when the tool or its
    /// executor failed. It carries the labels the call left behind.
    ToolOutcome,
    /// A refusal before any tool was named: a peer that is not a configured principal, or
    /// a request too malformed to name a tool.
    Session,
}

/// Where an outbound operation was going.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Destination {
    /// An IPv4 or IPv6 socket address.
    Inet(InetDestination),
    /// A Unix socket path (an abstract name is written with a leading `@`).
    Unix(UnixDestination),
    /// A netlink address.
    Netlink(NetlinkDestination),
    /// An address that names no endpoint a rule can check (an unnamed unix address, an
    /// AF_UNSPEC connect, a family the socket does not read as written, a family the broker
    /// does not decode, a malformed address), described in words.
    Undecoded(UndecodedDestination),
}

/// A netlink destination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetlinkDestination {
    /// Destination port id (0: the kernel).
    pub netlink_port_id: u32,
    /// Multicast groups.
    pub netlink_groups: u32,
}

/// An address no rule can check, described.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UndecodedDestination {
    /// What the address was (snake_case code, e.g. `af_unspec`, `foreign_family_1`).
    pub undecoded: String,
}

/// An IP destination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InetDestination {
    /// The address.
    pub address: IpAddr,
    /// The port.
    pub port: u16,
}

/// A Unix socket destination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnixDestination {
    /// The path (abstract names start with `@`).
    pub unix_path: String,
}

/// `flowhost.broker`: what the broker saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerDetails {
    /// The executor process.
    pub pid: u32,
    /// Its executable (from procfs), when it could be read.
    pub executable: Option<String>,
    /// The intercepted syscall (`connect`, `sendto`, `sendmsg`, `sendmmsg`, `bind`, ...).
    pub syscall: String,
    /// The socket family (`inet`, `inet6`, `unix`, ...).
    pub family: String,
    /// The socket type (`stream`, `dgram`, ...), when known.
    pub socket_type: Option<String>,
    /// The protocol (`tcp`, `udp`, ...), when known.
    pub protocol: Option<String>,
    /// The destination, when the operation names or implies one.
    pub destination: Option<Destination>,
    /// The byte count of a send, when there is one.
    pub bytes: Option<u64>,
}

/// The `flowhost` extension object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowhostExtension {
    /// Always [`RECORD_SCHEMA`].
    pub schema: String,
    /// Position in the record stream: 1 for the first record, +1 per record, across rotated
    /// files. Assigned by the writer (a caller's value is overwritten).
    pub seq: u64,
    /// `sha256:<hex>` of the previous record's line bytes (without its newline);
    /// [`GENESIS_HASH`] for seq 1. Assigned by the writer.
    pub prev_hash: String,
    /// When the decision was taken (RFC 3339, UTC).
    pub recorded_at: String,
    /// tool_call or egress_attempt.
    pub event: EventKind,
    /// The calling principal, when known.
    pub principal: Option<String>,
    /// The session, when known.
    pub session: Option<String>,
    /// The host's id for the call, when known.
    pub call_id: Option<String>,
    /// The egress source label the decision was made on, when one was computed.
    pub source_label: Option<InformationLabel>,
    /// The clearances the source was checked against, when egress was checked.
    pub clearance_used: Option<Vec<InformationLabel>>,
    /// Why the action was refused, for denials.
    pub denial_kind: Option<Denial>,
    /// What made the call egress, when egress was considered.
    pub egress_basis: Option<EgressBasis>,
    /// The broker's observation, for egress attempts.
    pub broker: Option<BrokerDetails>,
    /// The principal's and the session's stored labels once this decision took effect on
    /// the flow state (absent when it changed nothing there). The labels only grow, so the
    /// records alone can rebuild the flow state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels_after: Option<LabelsAfter>,
    /// The peer's Unix identity, for refusals of a peer that maps to no principal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<PeerIdentity>,
    /// Where what was observed contradicts the signed declaration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub declaration_mismatch: Option<DeclarationMismatch>,
    /// For a record that stands for several identical refusals: how many, and when the
    /// first and the last happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub folded: Option<Folded>,
    /// The declassification grant the decision was taken under (or refused), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<GrantFacts>,
}

/// `flowhost.grant`: a declassification grant's id and purpose.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantFacts {
    /// The grant's id.
    pub id: String,
    /// Its purpose.
    pub purpose: String,
}

/// `flowhost.folded`: identical refusals folded into one record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Folded {
    /// How many refusals the record stands for.
    pub count: u64,
    /// When the first happened (RFC 3339, UTC).
    pub first_at: String,
    /// When the last happened (RFC 3339, UTC).
    pub last_at: String,
}

/// `flowhost.labels_after`: the flow state a decision left behind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabelsAfter {
    /// The principal's label.
    pub principal: InformationLabel,
    /// The session's label.
    pub session: InformationLabel,
}

/// `flowhost.peer`: a connecting process's Unix identity (from `SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerIdentity {
    /// The peer's uid.
    pub uid: u32,
    /// The peer's gid.
    pub gid: u32,
}

/// `flowhost.declaration_mismatch`: how the observed behaviour contradicts the signed
/// declaration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeclarationMismatch {
    /// The executor attempted outbound I/O although the tool's signed declaration says it
    /// does not egress (or declares no flow at all).
    UndeclaredEgress,
}

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
            destination: broker.destination.map(|d| match d {
                Destination::Unix(u) => Destination::Unix(UnixDestination {
                    unix_path: sanitize(&u.unix_path),
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
            (EventKind::ToolCall | EventKind::ToolOutcome | EventKind::Session, Some(_)) => {
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
        if x.event == EventKind::ToolOutcome && self.decision.effect == Effect::Deny {
            return fail(
                "decision.effect",
                "a tool_outcome is allow (success) or error, never deny".into(),
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
        },
    }
}

/// The current time as RFC 3339 UTC with microseconds (`2026-11-30T10:07:00.123456Z`).
pub fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
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

/// Replaces control characters by U+FFFD and cuts the text to [`MAX_TEXT_BYTES`] (on a
/// character boundary), so text from callers and publishers cannot forge lines or bloat
/// records.
pub fn sanitize(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_TEXT_BYTES));
    for c in text.chars() {
        let c = if c.is_control() { '\u{FFFD}' } else { c };
        if out.len() + c.len_utf8() > MAX_TEXT_BYTES {
            break;
        }
        out.push(c);
    }
    out
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

fn check_text(field: &str, s: &str) -> Result<(), RecordFormatError> {
    let problem = if s.is_empty() {
        "must not be empty"
    } else if s.len() > MAX_TEXT_BYTES {
        "is longer than 1024 bytes"
    } else if s.chars().any(char::is_control) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(RecordFormatError {
        field: field.to_string(),
        problem: problem.to_string(),
    })
}

#[cfg(test)]
pub(crate) mod tests;
