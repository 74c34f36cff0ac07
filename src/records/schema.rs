//! The record format: every type a decision record is made of, and how it serialises.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::{TRANSPORT_MCP, sanitize};
use crate::decision::{Denial, EgressBasis};
use crate::label::InformationLabel;

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

impl ActionClass {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ActionClass::PrivilegedAdminAction => "privileged_admin_action",
            ActionClass::NetworkEgress => "network_egress",
            ActionClass::Unclassified => "unclassified",
        }
    }
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

/// A projected target: field name -> scalar, always with a `provider` string. A field named
/// twice is refused when decoding: readers that keep the first and readers that keep the
/// last would judge the same line differently.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[serde(transparent)]
pub struct Target(pub BTreeMap<String, TargetValue>);

impl<'de> Deserialize<'de> for Target {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = Target;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a target object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Target, A::Error> {
                let mut fields = BTreeMap::new();
                while let Some((name, value)) = m.next_entry::<String, TargetValue>()? {
                    match fields.entry(name) {
                        std::collections::btree_map::Entry::Vacant(v) => {
                            v.insert(value);
                        }
                        std::collections::btree_map::Entry::Occupied(o) => {
                            return Err(serde::de::Error::custom(format_args!(
                                "target field {:?} appears twice",
                                o.key()
                            )));
                        }
                    }
                }
                Ok(Target(fields))
            }
        }
        d.deserialize_map(Fields)
    }
}

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
    /// A request an executor sent its client during a call (sampling, elicitation) or the
    /// client's answer handed back into the tool, as `flowhost.relay` says: `allow` once
    /// the label the call's output implies is durable (towards the client) or the answer
    /// flows to the tool's clearances (towards the tool); `deny` when refused.
    Relay,
    /// A `resources/read`, `prompts/get` or `completion/complete` decision (allowed before
    /// the executor sees it, or refused): `tool.name` says which request and what it named.
    ContentRequest,
    /// What an allowed content request returned: `allow` with status `success`, or `error`;
    /// it carries the labels the content left behind (joined before it reached the client).
    ContentOutcome,
}

impl EventKind {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::ToolCall => "tool_call",
            EventKind::EgressAttempt => "egress_attempt",
            EventKind::ToolOutcome => "tool_outcome",
            EventKind::Session => "session",
            EventKind::Relay => "relay",
            EventKind::ContentRequest => "content_request",
            EventKind::ContentOutcome => "content_outcome",
        }
    }
}

/// `flowhost.relay`: which request (or labelled notification) an executor sent its client,
/// and which way it went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayFacts {
    /// The request.
    pub method: RelayMethod,
    /// Which way.
    pub direction: RelayDirection,
}

/// What an executor may send its client during a call, which the host relays: a request,
/// or a notification whose forwarding raised the session's label (recorded only then).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RelayMethod {
    /// `sampling/createMessage`.
    Sampling,
    /// `elicitation/create`.
    Elicitation,
    /// `notifications/message` (a log line).
    Log,
    /// `notifications/progress`.
    Progress,
}

impl RelayMethod {
    /// The relayed request named `method`, if the host relays it (notifications are not
    /// requests: `None`).
    pub fn from_method(method: &str) -> Option<Self> {
        match method {
            "sampling/createMessage" => Some(RelayMethod::Sampling),
            "elicitation/create" => Some(RelayMethod::Elicitation),
            _ => None,
        }
    }

    /// The MCP method.
    pub fn method(self) -> &'static str {
        match self {
            RelayMethod::Sampling => "sampling/createMessage",
            RelayMethod::Elicitation => "elicitation/create",
            RelayMethod::Log => "notifications/message",
            RelayMethod::Progress => "notifications/progress",
        }
    }

    /// The client capability (in `initialize`) the method needs (`None`: a notification,
    /// which any client takes).
    pub fn capability(self) -> Option<&'static str> {
        match self {
            RelayMethod::Sampling => Some("sampling"),
            RelayMethod::Elicitation => Some("elicitation"),
            RelayMethod::Log | RelayMethod::Progress => None,
        }
    }
}

/// Which way a relayed message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RelayDirection {
    /// The executor's request or notification, towards the client.
    ToClient,
    /// The client's answer, into the tool.
    ToTool,
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
    /// The host name the executor looked up and the host answered with this address (its
    /// DNS mediation), when there was one; absent for an address the executor did not get
    /// from a lookup the host answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_name: Option<String>,
    /// The other host names the host handed this address out for to the executor's lookups
    /// (still remembered when the attempt was judged): host-name rules were judged against
    /// `host_name` and every one of these, and a block rule naming any refused it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_host_names: Vec<String>,
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
    /// The record type a lookup (`syscall` = [`DNS_QUERY_SYSCALL`]) asked for (`A`, `AAAA`, `TXT`,
    /// `TYPE65280`, ...); absent for anything else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_query_type: Option<String>,
}

/// The `syscall` of a name lookup the executor's own resolver took: its destination is the
/// resolver's address, and its `host_name` the name asked, by which the host decided it.
pub const DNS_QUERY_SYSCALL: &str = "dns_query";

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
    /// For a `relay` record: what was relayed, which way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<RelayFacts>,
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
