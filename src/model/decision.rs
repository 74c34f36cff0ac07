//! The one vocabulary every layer decides in: why something was refused ([`Denial`]), what
//! made a call egress ([`EgressBasis`]), and the verdict a record states ([`Verdict`]), whose
//! shape makes a refusal without a reason unrepresentable.
//!
//! Every [`Denial`] is recorded as `flowhost.denial_kind` by some decision, and every client
//! refusal carries one as `error.data.denial`; nothing else is accepted when records are read
//! (except `record_failure`, which reaches only the client: it is what happens when no
//! record can be written).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::flow::EgressDenial;

/// Why an action was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Denial {
    /// The egress source is `Top` (unknown history).
    TopSource,
    /// The tool egresses and has no clearance.
    MissingClearance,
    /// A clearance is `Top`.
    TopClearance,
    /// The source does not flow to a clearance.
    FlowViolation,
    /// The destination rules refused the destination.
    DestinationBlocked,
    /// The executor reached out while it served no call.
    NoCallInFlight,
    /// The executor looked up a host name no destination rule of its server (or of the
    /// call's principal) names; the host answered the lookup with a refusal.
    NameNotAllowed,
    /// The executor asked its resolver for a record type the host does not serve (only A,
    /// AAAA, CNAME, HTTPS and SVCB: what a connection needs); answered REFUSED, never asked
    /// upstream.
    RecordTypeNotServed,
    /// The executor sent its resolver a query the host does not serve (not a standard
    /// query, several questions in one, a class other than IN, a name that is no host
    /// name); answered with a refusal before any rule, never asked upstream.
    QueryNotServed,
    /// The arguments do not satisfy the signed input schema.
    SchemaInvalid,
    /// The principal may not use the tool (or the peer is no principal).
    AccessDenied,
    /// No such tool is registered.
    UnknownTool,
    /// No registered server signed a resource that URI is (or a template it expands from).
    UnknownResource,
    /// No registered server signed a prompt of that name.
    UnknownPrompt,
    /// A malformed request (no string tool name, arguments that are not an object).
    InvalidParams,
    /// A request before `initialize`.
    NotInitialized,
    /// A call's bridge security metadata disagrees with the live registry.
    BridgeMismatch,
    /// A call's declassification grant is not a well-formed grant.
    GrantMalformed,
    /// The grant's authority is not trusted, or its signature does not verify.
    GrantUntrustedAuthority,
    /// A grant on a call with no effective egress.
    GrantWithoutEgress,
    /// A grant bound to another call.
    GrantBindingMismatch,
    /// A grant not valid yet.
    GrantNotYetValid,
    /// An expired grant.
    GrantExpired,
    /// A grant whose target is not strictly lower than the call's source.
    GrantTargetNotLower,
    /// A grant whose purpose the tool and the operator do not both allow.
    GrantPurposeNotAllowed,
    /// A grant used before.
    GrantReplayed,
    /// The tool's signed manifest requires a person's approval of each call, and the call
    /// came without one (an accepted declassification grant for exactly that call).
    ApprovalRequired,
    /// An executor asked its client for something (sampling, elicitation) the client did
    /// not declare at `initialize`.
    ClientCapabilityMissing,
    /// An executor had as many requests to its client pending in one call as the host
    /// relays at once.
    RelayLimit,
    /// A session asked for more resource subscriptions than the host keeps for one.
    SubscriptionLimit,
    /// A session sent a request while as many of its requests were in flight as the host
    /// serves at once.
    RequestLimit,
    /// A session sent a request under the id of one of its requests still in flight.
    RequestIdInFlight,
    /// A request the host had read but not begun when its session ended (the host
    /// stopping, or a reload mapping the session's peer to another principal).
    SessionEnding,
    /// The flow state could not be read or written (fail closed).
    StateFailure,
    /// The decision could not be recorded (fail closed; reaches only the client).
    RecordFailure,
}

impl Denial {
    /// The snake_case code.
    pub fn as_str(self) -> &'static str {
        match self {
            Denial::TopSource => "top_source",
            Denial::MissingClearance => "missing_clearance",
            Denial::TopClearance => "top_clearance",
            Denial::FlowViolation => "flow_violation",
            Denial::DestinationBlocked => "destination_blocked",
            Denial::NoCallInFlight => "no_call_in_flight",
            Denial::NameNotAllowed => "name_not_allowed",
            Denial::RecordTypeNotServed => "record_type_not_served",
            Denial::QueryNotServed => "query_not_served",
            Denial::SchemaInvalid => "schema_invalid",
            Denial::AccessDenied => "access_denied",
            Denial::UnknownTool => "unknown_tool",
            Denial::UnknownResource => "unknown_resource",
            Denial::UnknownPrompt => "unknown_prompt",
            Denial::InvalidParams => "invalid_params",
            Denial::NotInitialized => "not_initialized",
            Denial::BridgeMismatch => "bridge_mismatch",
            Denial::GrantMalformed => "grant_malformed",
            Denial::GrantUntrustedAuthority => "grant_untrusted_authority",
            Denial::GrantWithoutEgress => "grant_without_egress",
            Denial::GrantBindingMismatch => "grant_binding_mismatch",
            Denial::GrantNotYetValid => "grant_not_yet_valid",
            Denial::GrantExpired => "grant_expired",
            Denial::GrantTargetNotLower => "grant_target_not_lower",
            Denial::GrantPurposeNotAllowed => "grant_purpose_not_allowed",
            Denial::GrantReplayed => "grant_replayed",
            Denial::ApprovalRequired => "approval_required",
            Denial::ClientCapabilityMissing => "client_capability_missing",
            Denial::RelayLimit => "relay_limit",
            Denial::SubscriptionLimit => "subscription_limit",
            Denial::RequestLimit => "request_limit",
            Denial::RequestIdInFlight => "request_id_in_flight",
            Denial::SessionEnding => "session_ending",
            Denial::StateFailure => "state_failure",
            Denial::RecordFailure => "record_failure",
        }
    }
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<EgressDenial> for Denial {
    fn from(d: EgressDenial) -> Self {
        match d {
            EgressDenial::TopSource => Denial::TopSource,
            EgressDenial::MissingClearance => Denial::MissingClearance,
            EgressDenial::TopClearance => Denial::TopClearance,
            EgressDenial::FlowViolation => Denial::FlowViolation,
        }
    }
}

impl From<&crate::grant::GrantDenial> for Denial {
    fn from(d: &crate::grant::GrantDenial) -> Self {
        use crate::grant::GrantDenial as G;
        match d {
            G::UntrustedAuthority => Denial::GrantUntrustedAuthority,
            G::NoEffectiveEgress => Denial::GrantWithoutEgress,
            G::BindingMismatch(_) => Denial::GrantBindingMismatch,
            G::NotYetValid => Denial::GrantNotYetValid,
            G::Expired => Denial::GrantExpired,
            G::TargetNotLower => Denial::GrantTargetNotLower,
            G::PurposeNotAllowed => Denial::GrantPurposeNotAllowed,
            G::Replayed => Denial::GrantReplayed,
        }
    }
}

/// Which sources of knowledge made a call egress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressBasis {
    /// The signed declaration says the tool egresses.
    pub declared: bool,
    /// The host's topology gives the executor a network path.
    pub topology: bool,
    /// The broker saw the executor attempt outbound I/O.
    pub observed: bool,
}

impl EgressBasis {
    /// Whether any source makes it egress.
    pub fn any(self) -> bool {
        self.declared || self.topology || self.observed
    }
}

/// Why an allowed action did not end well.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// The tool answered with an error result.
    ToolError,
    /// The executor could not be started, or failed during the call.
    ExecutorFailed,
    /// The executor ran into one of its bounds (memory, CPU time, processes, or the call's
    /// deadline) and was ended during the call: what it would have done after is not
    /// observed.
    BoundReached,
    /// The flow state failed (the action was refused: fail closed).
    StateFailure,
    /// The client cancelled the call while it ran.
    Cancelled,
    /// A request to the client could not reach it: its transport takes no request there.
    ClientUnreachable,
    /// What the executor answered broke what its server signed (a result its tool's output
    /// schema does not allow, a read's answer carrying a resource the principal may not
    /// read), so it was withheld.
    AnswerWithheld,
    /// A reload withdrew the principal's access to what the request names while it waited
    /// for an executor: no executor took it.
    AccessWithdrawn,
}

impl Failure {
    /// The status code a record carries.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::ToolError => "tool_error",
            Failure::ExecutorFailed => "executor_failed",
            Failure::BoundReached => "bound_reached",
            Failure::StateFailure => "state_failure",
            Failure::Cancelled => "cancelled",
            Failure::ClientUnreachable => "client_unreachable",
            Failure::AnswerWithheld => "answer_withheld",
            Failure::AccessWithdrawn => "access_withdrawn",
        }
    }
}

/// A decision's verdict. A refusal always has its [`Denial`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed, recorded before its effect (status `authorized`).
    Authorized {
        /// The operator rule that allowed it, if one did.
        rule: Option<String>,
    },
    /// Allowed, and the effect happened (status `success`, side effect asserted).
    Succeeded {
        /// The operator rule that allowed it, if one did.
        rule: Option<String>,
    },
    /// Refused (status `blocked`).
    Refused {
        /// Why.
        denial: Denial,
        /// The operator rule that refused it, if one did.
        rule: Option<String>,
    },
    /// The host or the tool failed (effect `error`, the failure's code as the status).
    Failed(Failure),
}

impl Verdict {
    /// A refusal for `denial`, decided by no particular rule.
    pub fn refused(denial: Denial) -> Self {
        Verdict::Refused { denial, rule: None }
    }

    /// Whether the action may take (or took) effect.
    pub fn allowed(&self) -> bool {
        matches!(self, Verdict::Authorized { .. } | Verdict::Succeeded { .. })
    }

    /// The refusal's reason (a state failure refuses too).
    pub fn denial(&self) -> Option<Denial> {
        match self {
            Verdict::Refused { denial, .. } => Some(*denial),
            Verdict::Failed(Failure::StateFailure) => Some(Denial::StateFailure),
            Verdict::Failed(Failure::AccessWithdrawn) => Some(Denial::AccessDenied),
            _ => None,
        }
    }

    /// The rule that decided, if one did.
    pub fn rule(&self) -> Option<&str> {
        match self {
            Verdict::Authorized { rule } | Verdict::Succeeded { rule } => rule.as_deref(),
            Verdict::Refused { rule, .. } => rule.as_deref(),
            Verdict::Failed(_) => None,
        }
    }
}
