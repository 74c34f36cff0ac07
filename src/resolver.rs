//! The flow resolver: decides every call before dispatch and every egress attempt at the
//! syscall (DESIGN.md §6).
//!
//! * Before dispatch: tool access, arguments against the signed input schema, then — when
//!   the call is predicted to egress (declared or by topology) — the egress source
//!   (`principal ⊔ session ⊔ operator input floor ⊔ classifier(arguments)`) must pass
//!   `authorize_egress` against every policy clearance and the manifest clearance.
//! * At the syscall: any outbound attempt makes the call egress whatever was declared; the
//!   same clearance checks run against the session's state at that moment (a tool with no
//!   clearance is refused with `missing_clearance`), then the server's destination rules.
//! * After the call: `effective output floor ⊔ classifier(output)` joins into the principal's
//!   and the session's state (an overflow becomes `Top`), durably, before the output is
//!   returned.
//!
//! Nothing here knows MCP or the broker's mechanics; it sees labels, tools and destinations.

use flowhost_broker::Destination;

use crate::config::{ClassifierRule, ClassifierScope, PrincipalConfig};
use crate::destination::DestinationRules;
use crate::flow::{EgressDenial, authorize_egress};
use crate::label::InformationLabel;
use crate::registry::{AdmittedTool, AdmittedToolSecurity};
use crate::state::{FlowStateStore, SessionKey, StateError};

/// Regex rules that attach labels to text.
#[derive(Debug, Clone, Default)]
pub struct Classifier {
    rules: Vec<ClassifierRule>,
}

impl Classifier {
    /// A classifier with these rules.
    pub fn new(rules: Vec<ClassifierRule>) -> Self {
        Classifier { rules }
    }

    /// The join of the labels of every rule for `scope` whose pattern matches `text`
    /// (bottom when none does; `Top` if the join overflows the label limits).
    pub fn classify(&self, scope: ClassifierScope, text: &str) -> InformationLabel {
        self.rules
            .iter()
            .filter(|r| r.scopes.contains(&scope) && r.pattern.is_match(text))
            .fold(InformationLabel::bottom(), |acc, r| {
                acc.join_or_top(&r.label)
            })
    }
}

/// Why a call was refused before dispatch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallRefusal {
    /// The principal may not call this tool.
    #[error("principal {principal} may not call {server}/{tool}")]
    AccessDenied {
        /// Who asked.
        principal: String,
        /// The server.
        server: String,
        /// The tool.
        tool: String,
    },
    /// The arguments do not satisfy the signed input schema.
    #[error("arguments do not satisfy the signed input schema of {tool}: {reason}")]
    SchemaInvalid {
        /// The tool.
        tool: String,
        /// Which part failed (locations only, never values).
        reason: String,
    },
    /// The flow check refused the predicted egress.
    #[error("information-flow check refused {tool}: {denial}")]
    Flow {
        /// The tool.
        tool: String,
        /// Which rule.
        denial: EgressDenial,
    },
    /// The flow state could not be read or written; the call is refused (fail closed).
    #[error("flow state unavailable: {0}")]
    State(String),
}

impl CallRefusal {
    /// The record denial code.
    pub fn denial_code(&self) -> &'static str {
        match self {
            CallRefusal::AccessDenied { .. } => "access_denied",
            CallRefusal::SchemaInvalid { .. } => "schema_invalid",
            CallRefusal::Flow { denial, .. } => denial.as_str(),
            CallRefusal::State(_) => "state_failure",
        }
    }
}

impl From<StateError> for CallRefusal {
    fn from(e: StateError) -> Self {
        CallRefusal::State(e.to_string())
    }
}

/// Which sources of knowledge make a call egress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EgressBasis {
    /// The signed declaration says so.
    pub declared: bool,
    /// The host's topology gives the executor a network path.
    pub topology: bool,
    /// The broker saw an outbound attempt.
    pub observed: bool,
}

impl EgressBasis {
    /// Whether any source makes it egress.
    pub fn any(self) -> bool {
        self.declared || self.topology || self.observed
    }
}

/// An admitted call, ready to dispatch.
#[derive(Debug, Clone)]
pub struct CallPlan {
    /// Principal and session.
    pub key: SessionKey,
    /// The taint this call adds to the session before the executor sees it:
    /// `operator input floor ⊔ classifier(arguments)`.
    pub argument_taint: InformationLabel,
    /// The egress source the pre-dispatch check used.
    pub source: InformationLabel,
    /// What predicted egress.
    pub basis: EgressBasis,
    /// The clearances checked (empty when the call was not predicted to egress).
    pub clearances: Vec<InformationLabel>,
    /// The tool's admitted security (cloned from the registry generation of the call).
    pub security: AdmittedToolSecurity,
}

/// The verdict on one outbound attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressVerdict {
    /// Whether the broker may carry it out.
    pub allowed: bool,
    /// The record denial code, for refusals.
    pub denial: Option<String>,
    /// The source label the decision used.
    pub source: InformationLabel,
    /// The clearances checked.
    pub clearances: Vec<InformationLabel>,
    /// The destination rule that decided (after the flow checks passed).
    pub rule: Option<String>,
}

/// Checks `source` against every policy clearance and the manifest clearance, in that
/// order; a tool with no policy clearance is refused with `MissingClearance` (after the
/// `TopSource` check, which comes first).
pub fn check_clearances(
    source: &InformationLabel,
    security: &AdmittedToolSecurity,
) -> Result<Vec<InformationLabel>, (EgressDenial, Vec<InformationLabel>)> {
    let mut used: Vec<InformationLabel> = security.policy_clearances().to_vec();
    if let Some(m) = security.manifest_clearance() {
        used.push(m.clone());
    }
    if security.policy_clearances().is_empty() {
        authorize_egress(source, None).map_err(|d| (d, used.clone()))?;
    }
    for c in &used {
        authorize_egress(source, Some(c)).map_err(|d| (d, used.clone()))?;
    }
    Ok(used)
}

/// The resolver: classifier, input floor and the durable state store.
#[derive(Debug)]
pub struct FlowResolver {
    classifier: Classifier,
    input_floor: InformationLabel,
    state: std::sync::Arc<FlowStateStore>,
}

impl FlowResolver {
    /// A resolver over `state`.
    pub fn new(
        classifier: Classifier,
        input_floor: InformationLabel,
        state: std::sync::Arc<FlowStateStore>,
    ) -> Self {
        FlowResolver {
            classifier,
            input_floor,
            state,
        }
    }

    /// The state store.
    pub fn state(&self) -> &FlowStateStore {
        &self.state
    }

    /// Decides a call before dispatch. On success the argument taint has been joined into
    /// the principal's and session's state (durably), because the executor is about to see
    /// the arguments.
    pub fn pre_dispatch(
        &self,
        principal: &PrincipalConfig,
        key: &SessionKey,
        tool: &AdmittedTool,
        arguments: &serde_json::Value,
    ) -> Result<CallPlan, CallRefusal> {
        if !principal.may_call(tool.server_id(), tool.name()) {
            return Err(CallRefusal::AccessDenied {
                principal: principal.id.to_string(),
                server: tool.server_id().to_string(),
                tool: tool.name().to_string(),
            });
        }
        tool.validate_arguments(arguments)
            .map_err(|e| CallRefusal::SchemaInvalid {
                tool: tool.name().to_string(),
                reason: e.to_string(),
            })?;
        let argument_taint = self.input_floor.join_or_top(
            &self
                .classifier
                .classify(ClassifierScope::Arguments, &arguments.to_string()),
        );
        let state = self.state.get(key)?;
        let source = state.combined().join_or_top(&argument_taint);
        let security = tool.security().clone();
        let basis = EgressBasis {
            declared: tool.definition().flow().is_some_and(|f| f.egress()),
            topology: tool.topology().runtime_egress(),
            observed: false,
        };
        let clearances = if security.effective_egress() {
            check_clearances(&source, &security).map_err(|(denial, _)| CallRefusal::Flow {
                tool: tool.name().to_string(),
                denial,
            })?
        } else {
            Vec::new()
        };
        self.state.join(key, &argument_taint)?;
        Ok(CallPlan {
            key: key.clone(),
            argument_taint,
            source,
            basis,
            clearances,
            security,
        })
    }

    /// Decides one outbound attempt made while `plan`'s call is in flight: egress is now
    /// observed whatever was declared; the clearances are checked against the session's
    /// state at this moment, then the destination rules.
    pub fn decide_egress(
        &self,
        plan: &CallPlan,
        destination: Option<&Destination>,
        rules: &DestinationRules,
    ) -> EgressVerdict {
        let source = match self.state.get(&plan.key) {
            Ok(state) => state.combined().join_or_top(&plan.argument_taint),
            // State that cannot be read is unknown history: Top, which never egresses.
            Err(_) => InformationLabel::Top,
        };
        match check_clearances(&source, &plan.security) {
            Err((denial, clearances)) => EgressVerdict {
                allowed: false,
                denial: Some(denial.as_str().to_string()),
                source,
                clearances,
                rule: None,
            },
            Ok(clearances) => {
                let d = rules.decide(destination);
                EgressVerdict {
                    allowed: d.allowed,
                    denial: (!d.allowed).then(|| "destination_blocked".to_string()),
                    source,
                    clearances,
                    rule: Some(d.rule),
                }
            }
        }
    }

    /// Joins a call's output into state: `effective output floor ⊔ classifier(output)`.
    /// Durable before it returns; the caller returns the output only after this succeeds.
    pub fn after_call(
        &self,
        plan: &CallPlan,
        output_text: &str,
    ) -> Result<InformationLabel, StateError> {
        let label = plan.security.effective_output_floor().join_or_top(
            &self
                .classifier
                .classify(ClassifierScope::Outputs, output_text),
        );
        self.state.join(&plan.key, &label)?;
        Ok(label)
    }
}
