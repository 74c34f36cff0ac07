//! The flow resolver: decides every call before dispatch and every egress attempt at the
//! syscall (docs/ARCHITECTURE.md, "One `tools/call`" and "One egress attempt").
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

use crate::config::{ClassifierRule, ClassifierScope, PrincipalConfig};
use crate::decision::{Denial, EgressBasis, Failure, Verdict};
use crate::destination::{
    Destination, DestinationRules, HostName, OriginRules, RuleDecision, decide_name_with_origin,
    decide_with_origin,
};
use crate::flow::{EgressDenial, authorize_egress};
use crate::grant::{self, AcceptedGrant, Authorities, CallFacts, GrantDenial, SignedGrant};
use crate::label::InformationLabel;
use crate::registry::{AdmittedTool, AdmittedToolSecurity};
use crate::state::{FlowState, FlowStateStore, SessionKey, StateError};

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

/// What the classifier reads of a JSON value (a call's arguments, a tool's result): every
/// string in it (object keys too) as it is, not JSON-escaped, and every other scalar, one
/// per line, whatever the field. Arguments and outputs are read the same way, so one rule
/// matches both alike, and nothing a client or tool receives goes unread.
pub fn classifiable_text(value: &serde_json::Value) -> String {
    use serde_json::Value;
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::String(s) => out.push(s.clone()),
            Value::Array(items) => items.iter().for_each(|i| walk(i, out)),
            Value::Object(fields) => {
                for (k, v) in fields {
                    out.push(k.clone());
                    walk(v, out);
                }
            }
            Value::Null => {}
            scalar => out.push(scalar.to_string()),
        }
    }
    let mut out = Vec::new();
    walk(value, &mut out);
    out.join("\n")
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
    /// The flow state failed while the call's verified grant was being spent, or after:
    /// the grant may be spent. Refused as [`CallRefusal::State`] is.
    #[error("flow state unavailable while its grant was spent: {0}")]
    StateWhileSpending(String),
    /// The tool's signed manifest requires a person's approval of each call, and none came
    /// with it.
    #[error(
        "{tool} requires a person's approval of each call (its signed manifest says requires_approval), and this host's only form of it is a declassification grant an authority signed for exactly this call: none came with it (a call with nothing to declassify cannot run)"
    )]
    ApprovalRequired {
        /// The tool.
        tool: String,
    },
    /// The call's declassification grant was refused.
    #[error("declassification grant {grant_id:?} refused for {tool}: {denial}")]
    Grant {
        /// The tool.
        tool: String,
        /// The grant's id.
        grant_id: String,
        /// Which rule.
        denial: GrantDenial,
    },
}

impl CallRefusal {
    /// Why, in the decision vocabulary.
    pub fn denial(&self) -> Denial {
        match self {
            CallRefusal::AccessDenied { .. } => Denial::AccessDenied,
            CallRefusal::SchemaInvalid { .. } => Denial::SchemaInvalid,
            CallRefusal::Flow { denial, .. } => Denial::from(*denial),
            CallRefusal::State(_) | CallRefusal::StateWhileSpending(_) => Denial::StateFailure,
            CallRefusal::Grant { denial, .. } => Denial::from(denial),
            CallRefusal::ApprovalRequired { .. } => Denial::ApprovalRequired,
        }
    }

    /// The verdict a record states for this refusal (a state failure is a host failure).
    pub fn verdict(&self) -> Verdict {
        match self {
            CallRefusal::State(_) | CallRefusal::StateWhileSpending(_) => {
                Verdict::Failed(Failure::StateFailure)
            }
            other => Verdict::refused(other.denial()),
        }
    }

    /// Whether the call's grant, if it came with one, was verified and may have been spent
    /// before this refusal: its record then names the grant as spent evidence (see the
    /// continuity check). Any other refusal came before the spend, or before the grant was
    /// verified at all (a state failure reading the labels), where its id is only what the
    /// client claimed.
    pub fn may_have_spent_the_grant(&self) -> bool {
        matches!(self, CallRefusal::StateWhileSpending(_))
    }
}

impl From<StateError> for CallRefusal {
    fn from(e: StateError) -> Self {
        CallRefusal::State(e.to_string())
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
    /// The principal's and session's stored labels once the argument taint was joined in.
    pub state_after_dispatch: FlowState,
    /// The declassification grant the call's egress checks run under, if any: its target
    /// replaces `source` in the clearance checks of this call only (never in stored state).
    pub grant: Option<AcceptedGrant>,
}

/// A declassification grant offered with a call, and what to check it against.
#[derive(Debug, Clone, Copy)]
pub struct GrantOffer<'a> {
    /// The grant as received.
    pub grant: &'a SignedGrant,
    /// Now, in Unix seconds.
    pub now: u64,
    /// The instant that second began on the monotonic clock (see [`grant::clock`]).
    pub second_began: std::time::Instant,
}

/// The judgment of one outbound attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressJudgment {
    /// Allowed (naming the destination rule), or refused (with why, and the rule if a
    /// destination rule refused it).
    pub verdict: Verdict,
    /// The source label the decision used.
    pub source: InformationLabel,
    /// The clearances checked.
    pub clearances: Vec<InformationLabel>,
    /// The call's grant decided it (the clearances were checked against the grant's target,
    /// not `source`): what it allowed is the call's alone.
    pub under_grant: bool,
}

/// Whether a client's answer may reach a tool (see [`FlowResolver::admit_answer`]).
#[derive(Debug, Clone)]
pub struct AnswerJudgment {
    /// What the tool would receive the answer at.
    pub source: InformationLabel,
    /// The clearances it was checked against.
    pub clearances: Vec<InformationLabel>,
    /// The state once the answer's taint was joined, or why the answer is refused.
    pub outcome: Result<FlowState, CallRefusal>,
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

/// The resolver: classifier, input floor, the durable state store, and the
/// declassification authorities the operator trusts now.
#[derive(Debug)]
pub struct FlowResolver {
    classifier: Classifier,
    input_floor: InformationLabel,
    state: std::sync::Arc<FlowStateStore>,
    authorities: std::sync::RwLock<std::sync::Arc<Authorities>>,
}

impl FlowResolver {
    /// A resolver over `state`, trusting `authorities` (see
    /// [`FlowResolver::trust_authorities`]).
    pub fn new(
        classifier: Classifier,
        input_floor: InformationLabel,
        state: std::sync::Arc<FlowStateStore>,
        authorities: &Authorities,
    ) -> Self {
        FlowResolver {
            classifier,
            input_floor,
            state,
            authorities: std::sync::RwLock::new(std::sync::Arc::new(authorities.clone())),
        }
    }

    /// From now on, trusts exactly `authorities`. A grant is checked against this set
    /// before dispatch, and the grant of a call in flight or waiting for its executor
    /// stops applying at its call's next outbound attempt once its authority (with the key
    /// that verified it) leaves the set: withdrawn trust does not wait for calls to end.
    pub fn trust_authorities(&self, authorities: &Authorities) {
        let next = std::sync::Arc::new(authorities.clone());
        match self.authorities.write() {
            Ok(mut a) => *a = next,
            Err(poisoned) => *poisoned.into_inner() = next,
        }
    }

    /// The authorities trusted now.
    fn trusted(&self) -> std::sync::Arc<Authorities> {
        match self.authorities.read() {
            Ok(a) => a.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The call's grant, with why, if it stopped applying since dispatch: it expired (a
    /// grant is valid for its window only, however long the call runs), or its authority is
    /// no longer trusted with the key that verified it. What the call does from then on is
    /// refused for that reason.
    fn grant_ended<'p>(&self, plan: &'p CallPlan) -> Option<(&'p AcceptedGrant, GrantDenial)> {
        let g = plan.grant.as_ref()?;
        if g.expired(grant::now()) {
            Some((g, GrantDenial::Expired))
        } else if self.trusted().get(&g.authority) != Some(&g.authority_key) {
            Some((g, GrantDenial::UntrustedAuthority))
        } else {
            None
        }
    }

    /// The state store.
    pub fn state(&self) -> &FlowStateStore {
        &self.state
    }

    /// Decides a call before dispatch. On success the argument taint has been joined into
    /// the principal's and session's state (durably), because the executor is about to see
    /// the arguments.
    pub async fn pre_dispatch(
        &self,
        principal: &PrincipalConfig,
        key: &SessionKey,
        tool: &AdmittedTool,
        arguments: &serde_json::Value,
        offer: Option<GrantOffer<'_>>,
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
        let argument_taint = self.argument_label(arguments);
        let state = self.state.get(key).await?;
        let session_label = state.combined();
        let source = session_label.join_or_top(&argument_taint);
        let security = tool.security().clone();
        let basis = EgressBasis {
            declared: tool.definition().flow().is_some_and(|f| f.egress()),
            topology: tool.topology().runtime_egress(),
            observed: false,
        };
        let grant = match offer {
            None => None,
            Some(offer) => {
                let refused = |denial| CallRefusal::Grant {
                    tool: tool.name().to_string(),
                    grant_id: offer.grant.body().grant_id.clone(),
                    denial,
                };
                let facts = CallFacts {
                    principal: &key.principal,
                    session: &key.session,
                    server: tool.server_id(),
                    tool: tool.name(),
                    arguments,
                    source: &source,
                    security: &security,
                    now: offer.now,
                    second_began: offer.second_began,
                };
                Some(grant::check(offer.grant, &self.trusted(), &facts).map_err(refused)?)
            }
        };
        // Under a grant the egress check runs against its target, for this call only.
        let checked = grant.as_ref().map_or(&source, |g| &g.target);
        let clearances = if security.effective_egress() {
            check_clearances(checked, &security).map_err(|(denial, _)| CallRefusal::Flow {
                tool: tool.name().to_string(),
                denial,
            })?
        } else {
            Vec::new()
        };
        // A person's approval of each call is an authority's grant signed for exactly this
        // call (its arguments, session and tool), accepted above and spent below; no other
        // way of asking one exists, so without it the call does not run.
        if tool.definition().annotations().requires_approval && grant.is_none() {
            return Err(CallRefusal::ApprovalRequired {
                tool: tool.name().to_string(),
            });
        }
        // The state's read above may have taken up to its timeout: a grant that expired
        // meanwhile is not spent on a call that starts after its window.
        if let Some(g) = &grant
            && g.expired(grant::now())
        {
            return Err(CallRefusal::Grant {
                tool: tool.name().to_string(),
                grant_id: g.id.clone(),
                denial: GrantDenial::Expired,
            });
        }
        // Single use is spent only once everything else passed, durably, before dispatch.
        // From here a state failure may leave the grant spent.
        let spending = |e: StateError| match &grant {
            Some(_) => CallRefusal::StateWhileSpending(e.to_string()),
            None => CallRefusal::State(e.to_string()),
        };
        if let (Some(g), Some(offer)) = (&grant, offer)
            && !self
                .state
                .consume_grant(&g.id, offer.now)
                .await
                .map_err(spending)?
        {
            return Err(CallRefusal::Grant {
                tool: tool.name().to_string(),
                grant_id: g.id.clone(),
                denial: GrantDenial::Replayed,
            });
        }
        let state_after_dispatch = self
            .state
            .join(key, &argument_taint)
            .await
            .map_err(spending)?;
        Ok(CallPlan {
            key: key.clone(),
            argument_taint,
            source,
            basis,
            clearances,
            security,
            state_after_dispatch,
            grant,
        })
    }

    /// Decides one outbound attempt made while `plan`'s call is in flight: egress is now
    /// observed whatever was declared; the clearances are checked against the session's
    /// state at this moment, then the destination rules.
    pub async fn decide_egress(
        &self,
        plan: &CallPlan,
        destination: Option<&Destination>,
        rules: &DestinationRules,
        origin: Option<&OriginRules>,
    ) -> EgressJudgment {
        self.judge_outbound(plan, Denial::DestinationBlocked, || {
            decide_with_origin(
                rules,
                origin.map(|o| (plan.key.principal.as_str(), o)),
                destination,
            )
        })
        .await
    }

    /// Decides a host-name lookup made while `plan`'s call is in flight. The name leaves the
    /// host (to its upstream resolvers), so it is judged as egress: the clearances first, as
    /// for any attempt, then whether a rule names it
    /// ([`crate::destination::decide_name_with_origin`]).
    pub async fn decide_lookup(
        &self,
        plan: &CallPlan,
        name: &HostName,
        rules: &DestinationRules,
        origin: Option<&OriginRules>,
    ) -> EgressJudgment {
        self.judge_outbound(plan, Denial::NameNotAllowed, || {
            decide_name_with_origin(
                rules,
                origin.map(|o| (plan.key.principal.as_str(), o)),
                name,
            )
        })
        .await
    }

    /// The clearance check every outbound attempt passes, then `rules` (refused as `denial`).
    /// Under a grant that stopped applying since dispatch (expired, or its authority no
    /// longer trusted), the attempt is refused for that reason.
    async fn judge_outbound(
        &self,
        plan: &CallPlan,
        denial: Denial,
        rules: impl FnOnce() -> RuleDecision,
    ) -> EgressJudgment {
        let source = match self.state.get(&plan.key).await {
            Ok(state) => state.combined().join_or_top(&plan.argument_taint),
            // State that cannot be read is unknown history: refused as the failure it is,
            // and never judged further (a grant must not apply to a history nobody knows).
            Err(e) => {
                tracing::error!(principal = %plan.key.principal, session = %plan.key.session, error = %e, "the flow state cannot be read; the outbound attempt is refused");
                return EgressJudgment {
                    verdict: Verdict::Failed(Failure::StateFailure),
                    source: InformationLabel::Top,
                    clearances: Vec::new(),
                    under_grant: false,
                };
            }
        };
        if let Some((_, ended)) = self.grant_ended(plan) {
            return EgressJudgment {
                verdict: Verdict::refused(Denial::from(&ended)),
                source,
                clearances: Vec::new(),
                under_grant: false,
            };
        }
        // A grant was issued against the source at dispatch; if anything raised it since (a
        // read in another session of the principal), the grant no longer applies. Nothing
        // declassifies `Top`.
        let (checked, under_grant) = match &plan.grant {
            Some(g) if source == plan.source && !source.is_top() => (g.target.clone(), true),
            _ => (source.clone(), false),
        };
        match check_clearances(&checked, &plan.security) {
            Err((denial, clearances)) => EgressJudgment {
                verdict: Verdict::refused(denial.into()),
                source,
                clearances,
                under_grant,
            },
            Ok(clearances) => {
                let d = rules();
                EgressJudgment {
                    verdict: if d.allowed {
                        Verdict::Authorized { rule: Some(d.rule) }
                    } else {
                        Verdict::Refused {
                            denial,
                            rule: Some(d.rule),
                        }
                    },
                    source,
                    clearances,
                    under_grant,
                }
            }
        }
    }

    /// Decides whether a client's answer to a request the executor sent during `plan`'s
    /// call (sampling, elicitation) may reach the tool, which receives it as input: the
    /// session as it is now (other requests may have raised it since dispatch) `⊔` the
    /// call's argument taint `⊔` `operator input floor ⊔ classifier(answer)` must flow to
    /// every clearance of the tool, and a tool that egresses must have one (as at
    /// dispatch, but never against a grant's target: the grant bound the call's arguments,
    /// not the answer; an expired grant refuses the answer as [`GrantDenial::Expired`]). When
    /// it may, the answer's taint is joined into the state durably before this returns.
    /// The executor may take in only data whose label `held` admits (one holding egress
    /// approved under a label: what it opened then must not carry more); an answer it does
    /// not admit is refused as a flow violation, before anything is joined.
    pub async fn admit_answer(
        &self,
        plan: &CallPlan,
        tool: &str,
        answer_text: &str,
        held: &(dyn Fn(&InformationLabel) -> bool + Sync),
    ) -> AnswerJudgment {
        let taint = self.input_floor.join_or_top(
            &self
                .classifier
                .classify(ClassifierScope::Arguments, answer_text),
        );
        let state = match self.state.get(&plan.key).await {
            Ok(state) => state,
            Err(e) => {
                return AnswerJudgment {
                    source: InformationLabel::Top,
                    clearances: Vec::new(),
                    outcome: Err(e.into()),
                };
            }
        };
        let source = state
            .combined()
            .join_or_top(&plan.argument_taint)
            .join_or_top(&taint);
        if let Some((g, ended)) = self.grant_ended(plan) {
            return AnswerJudgment {
                source,
                clearances: Vec::new(),
                outcome: Err(CallRefusal::Grant {
                    tool: tool.to_string(),
                    grant_id: g.id.clone(),
                    denial: ended,
                }),
            };
        }
        // A grant of the call does not reach its answers: the authority bound the call's
        // arguments, not what the client says while the call runs, so an answer is judged
        // against the session as it is.
        let checked = source.clone();
        let security = &plan.security;
        let checked = if security.effective_egress() {
            check_clearances(&checked, security)
        } else {
            let used: Vec<InformationLabel> = security
                .policy_clearances()
                .iter()
                .chain(security.manifest_clearance())
                .cloned()
                .collect();
            used.iter()
                .try_for_each(|c| authorize_egress(&checked, Some(c)))
                .map(|()| used.clone())
                .map_err(|d| (d, used))
        };
        let (clearances, outcome) = match checked {
            Ok(used) if !held(&taint) => (
                used,
                Err(CallRefusal::Flow {
                    tool: tool.to_string(),
                    denial: EgressDenial::FlowViolation,
                }),
            ),
            Ok(used) => (
                used,
                self.state
                    .join(&plan.key, &taint)
                    .await
                    .map_err(CallRefusal::from),
            ),
            Err((denial, used)) => (
                used,
                Err(CallRefusal::Flow {
                    tool: tool.to_string(),
                    denial,
                }),
            ),
        };
        AnswerJudgment {
            source,
            clearances,
            outcome,
        }
    }

    /// Joins a call's output into state: `effective output floor ⊔ classifier(output)`.
    /// Durable before it returns; the caller returns the output only after this succeeds.
    /// Returns the labels the call leaves behind.
    pub async fn after_call(
        &self,
        plan: &CallPlan,
        output_text: &str,
    ) -> Result<FlowState, StateError> {
        self.after_call_carrying(plan, &InformationLabel::bottom(), output_text)
            .await
    }

    /// [`FlowResolver::after_call`] for an output that carries signed resources whose
    /// labels join to `carried`: `floor ⊔ carried ⊔ classifier(output)`.
    pub async fn after_call_carrying(
        &self,
        plan: &CallPlan,
        carried: &InformationLabel,
        output_text: &str,
    ) -> Result<FlowState, StateError> {
        self.join_output(
            &plan.key,
            &plan.security.effective_output_floor().join_or_top(carried),
            output_text,
        )
        .await
    }

    /// `floor ⊔ classifier(output)` joined into `key`'s state, durably.
    async fn join_output(
        &self,
        key: &SessionKey,
        floor: &InformationLabel,
        output_text: &str,
    ) -> Result<FlowState, StateError> {
        let label = floor.join_or_top(
            &self
                .classifier
                .classify(ClassifierScope::Outputs, output_text),
        );
        self.state.join(key, &label).await
    }

    /// The label `arguments` carry into a call on this host: the operator's input floor
    /// joined with what the classifier finds in them. A call's source is the session's
    /// label joined with it.
    pub fn argument_label(&self, arguments: &serde_json::Value) -> InformationLabel {
        self.input_floor.join_or_top(
            &self
                .classifier
                .classify(ClassifierScope::Arguments, &classifiable_text(arguments)),
        )
    }

    /// Before a content request (a resource read, a prompt, a completion) reaches its
    /// executor: what it carries (`operator input floor ⊔ classifier(request)`) joins the
    /// principal's and session's state durably, since the executor is about to see it.
    /// Returns the source the executor is chosen for and the state after the join.
    pub async fn before_content(
        &self,
        key: &SessionKey,
        request: &serde_json::Value,
    ) -> Result<(InformationLabel, FlowState), StateError> {
        let taint = self.argument_label(request);
        let source = self.state.get(key).await?.combined().join_or_top(&taint);
        let state = self.state.join(key, &taint).await?;
        Ok((source, state))
    }

    /// After a content request: `label ⊔ classifier(content)` joins the principal's and
    /// session's state, durably, before the content may reach the client (`label` is the
    /// route's: content floor ⊔ signed output label).
    pub async fn after_content(
        &self,
        key: &SessionKey,
        label: &InformationLabel,
        content_text: &str,
    ) -> Result<FlowState, StateError> {
        self.join_output(key, label, content_text).await
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn classifiable_text_reads_every_string_as_sent() {
        let result = json!({
            "content": [
                {"type": "text", "text": "visible", "x": "beside \"the\" text"},
                {"type": "resource", "resource": {"uri": "x:1", "text": "in a resource"}},
            ],
            "structuredContent": {"secret": "in structured content"},
            "_meta": {"note": "in meta"},
            "isError": "not a bool",
        });
        let text = crate::resolver::classifiable_text(&result);
        for needle in [
            "visible",
            "beside \"the\" text",
            "in a resource",
            "in structured content",
            "in meta",
            "not a bool",
        ] {
            assert!(
                text.contains(needle),
                "{needle:?} not classified as sent: {text}"
            );
        }
    }

    #[test]
    fn classifiable_text_of_an_odd_shape_is_still_read() {
        assert_eq!(classifiable_text(&json!("bare")), "bare");
        assert!(classifiable_text(&json!({"content": "not a list"})).contains("not a list"));
    }

    use crate::config::{ClassifierRule, ClassifierScope, PrincipalConfig};
    use crate::decision::Denial;
    use crate::ident::PrincipalId;
    use crate::registry::{RuntimeTopology, ToolPolicy, VerifiedRegistry};
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;
    use std::sync::Arc;

    pub(crate) fn terms() -> InformationLabel {
        InformationLabel::from_json(
            r#"{"kind":"known","owners":{"larkfield-pricing":["larkfield-pricing"]},"compartments":["harbor-goods-terms"]}"#,
        )
        .unwrap()
    }

    fn fixture(name: &str) -> crate::manifest::SignedManifest {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pricing-lab");
        crate::manifest::load_envelope_file(&dir.join(format!("{name}.signed.json"))).unwrap()
    }

    fn key(name: &str) -> ed25519_dalek::VerifyingKey {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pricing-lab/keys");
        crate::keys::load_verifying_key(&dir.join(format!("{name}.pub"))).unwrap()
    }

    /// The lab's registry: workspace local, both inboxes brokered; the public inbox allows
    /// the purpose "reviewed-summary", as in the lab's host.toml.
    pub(crate) fn registry() -> VerifiedRegistry {
        let mut r = VerifiedRegistry::new();
        let bottom =
            || ToolPolicy::new(vec![], InformationLabel::bottom(), BTreeSet::new()).unwrap();
        let local = |tools: &[&str]| {
            tools
                .iter()
                .map(|t| (t.to_string(), RuntimeTopology::Local))
                .collect::<BTreeMap<_, _>>()
        };
        let ws = ["list_documents", "read_terms", "summarize_terms"];
        r.register(
            fixture("workspace"),
            &key("workspace"),
            &ws.iter().map(|t| (t.to_string(), bottom())).collect(),
            &local(&ws),
        )
        .unwrap();
        let brokered = BTreeMap::from([("publish".to_string(), RuntimeTopology::Brokered)]);
        let team =
            ToolPolicy::new(vec![terms()], InformationLabel::bottom(), BTreeSet::new()).unwrap();
        r.register(
            fixture("team-inbox"),
            &key("team-inbox"),
            &BTreeMap::from([("publish".into(), team)]),
            &brokered,
        )
        .unwrap();
        let public = ToolPolicy::new(
            vec![InformationLabel::bottom()],
            InformationLabel::bottom(),
            BTreeSet::from([crate::DeclassificationPurpose::new("reviewed-summary").unwrap()]),
        )
        .unwrap();
        r.register(
            fixture("public-inbox"),
            &key("public-inbox"),
            &BTreeMap::from([("publish".into(), public)]),
            &brokered,
        )
        .unwrap();
        r
    }

    fn resolver(dir: &Path) -> FlowResolver {
        let classifier = Classifier::new(vec![ClassifierRule {
            pattern: regex::Regex::new("(?i)harbor goods").unwrap(),
            label: terms(),
            scopes: BTreeSet::from([ClassifierScope::Arguments, ClassifierScope::Outputs]),
        }]);
        let state = Arc::new(FlowStateStore::open(&dir.join("state.db")).unwrap());
        FlowResolver::new(classifier, InformationLabel::bottom(), state, &board())
    }

    /// The lab's declassification authority's key.
    fn board_key() -> ed25519_dalek::SigningKey {
        ed25519_dalek::SigningKey::from_bytes(&[7; 32])
    }

    /// The authorities the test resolvers trust: the board.
    fn board() -> Authorities {
        Authorities::from([("board".to_string(), board_key().verifying_key())])
    }

    fn analyst() -> PrincipalConfig {
        PrincipalConfig {
            id: PrincipalId::new("analyst").unwrap(),
            uids: vec![1],
            gids: vec![],
            tools: vec!["*".into()],
            destinations: None,
        }
    }

    fn key_for(p: &PrincipalConfig, s: &str) -> SessionKey {
        SessionKey {
            principal: p.id.clone(),
            session: s.into(),
        }
    }

    /// A store whose every use fails (a database gone, a file unreadable).
    #[derive(Debug)]
    struct Unreadable;

    impl crate::state::StateBackend for Unreadable {
        fn get<'a>(&'a self, _: &'a SessionKey) -> crate::state::StateFuture<'a, FlowState> {
            Box::pin(async { Err(StateError::Failed("unreadable".into())) })
        }
        fn raise<'a>(
            &'a self,
            _: &'a SessionKey,
            _: &'a InformationLabel,
            _: &'a InformationLabel,
        ) -> crate::state::StateFuture<'a, FlowState> {
            Box::pin(async { Err(StateError::Failed("unreadable".into())) })
        }
        fn forget_session<'a>(&'a self, _: &'a SessionKey) -> crate::state::StateFuture<'a, ()> {
            Box::pin(async { Err(StateError::Failed("unreadable".into())) })
        }
        fn consume_grant<'a>(&'a self, _: &'a str, _: u64) -> crate::state::StateFuture<'a, bool> {
            Box::pin(async { Err(StateError::Failed("unreadable".into())) })
        }
        fn snapshot(&self) -> crate::state::StateFuture<'_, crate::state::StateSnapshot> {
            Box::pin(async { Err(StateError::Failed("unreadable".into())) })
        }
        fn checkpoint(&self) -> crate::state::StateFuture<'_, Option<(u64, String)>> {
            Box::pin(async { Err(StateError::Failed("unreadable".into())) })
        }
        fn set_checkpoint<'a>(&'a self, _: u64, _: &'a str) -> crate::state::StateFuture<'a, ()> {
            Box::pin(async { Err(StateError::Failed("unreadable".into())) })
        }
        fn failure(&self) -> Option<String> {
            Some("unreadable".into())
        }
        fn describe(&self) -> String {
            "an unreadable store".into()
        }
    }

    /// The analyst's call of the team inbox's publish to 127.0.0.1:1, dispatched without a
    /// grant.
    async fn team_publish(res: &FlowResolver) -> CallPlan {
        let (reg, who) = (registry(), analyst());
        let args = serde_json::json!({"message": "m", "sink": "127.0.0.1:1"});
        let team = reg.tool("team-inbox", "publish").unwrap();
        res.pre_dispatch(&who, &key_for(&who, "s1"), team, &args, None)
            .await
            .unwrap()
    }

    /// An accepted grant of the lab's purpose to the bottom label.
    fn lab_grant(expires_at: u64) -> AcceptedGrant {
        AcceptedGrant {
            id: "g-1".into(),
            authority: "board".into(),
            authority_key: board_key().verifying_key(),
            purpose: crate::DeclassificationPurpose::new("reviewed-summary").unwrap(),
            target: InformationLabel::bottom(),
            expires_at,
            expires_by: std::time::Instant::now() + std::time::Duration::from_secs(3600),
        }
    }

    /// A grant that expires while the state is read (which may take up to its timeout) is
    /// neither spent nor applied: the call would start after the grant's window. Before,
    /// validity was judged at the time read before the state, so the grant was spent and
    /// the call dispatched under it.
    #[tokio::test]
    async fn a_grant_that_expires_while_the_state_is_read_is_not_spent() {
        let dir = tempfile::tempdir().unwrap();
        let res = resolver(dir.path());
        let (reg, who) = (registry(), analyst());
        let inbox = reg.tool("public-inbox", "publish").unwrap();
        // The classifier finds the lab's terms in the arguments: the call's source.
        let args = json!({"message": "harbor goods", "sink": "127.0.0.1:1"});
        let now = crate::grant::now();
        let grant = board_grant(&who, inbox, &args, now);
        let offer = |at| GrantOffer {
            grant: &grant,
            now: at,
            second_began: std::time::Instant::now(),
        };
        // Read before the state, the time was inside the window.
        let refused = res
            .pre_dispatch(
                &who,
                &key_for(&who, "s1"),
                inbox,
                &args,
                Some(offer(now - 1)),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                refused,
                CallRefusal::Grant {
                    denial: GrantDenial::Expired,
                    ..
                }
            ),
            "{refused:?}"
        );
        assert!(res.state.consume_grant("g-1", now).await.unwrap(), "spent");
    }

    /// The board's grant `g-1` of `who`'s call of `tool` with `args` in session `s1`, from
    /// the lab's terms to bottom, issued 100 s ago and valid until `expires_at`; and the
    /// authorities that trust the board.
    fn board_grant(
        who: &PrincipalConfig,
        tool: &crate::registry::AdmittedTool,
        args: &serde_json::Value,
        expires_at: u64,
    ) -> SignedGrant {
        use crate::grant::{GRANT_SCHEMA, GrantBody, arguments_hash, label_hash};
        let key = board_key();
        let body = GrantBody {
            schema: GRANT_SCHEMA.into(),
            grant_id: "g-1".into(),
            authority: "board".into(),
            principal: who.id.clone(),
            session: "s1".into(),
            server: tool.server_id().into(),
            tool: tool.name().into(),
            purpose: crate::DeclassificationPurpose::new("reviewed-summary").unwrap(),
            arguments_hash: arguments_hash(args).unwrap(),
            source_label_hash: label_hash(&terms()),
            target_label: InformationLabel::bottom(),
            issued_at: crate::grant::now() - 100,
            expires_at,
        };
        SignedGrant::sign(body, &key).unwrap()
    }

    /// A store whose grant spends fail (a database gone just then); the rest works.
    #[derive(Debug)]
    struct SpendFails(crate::state::SqliteStore);

    impl crate::state::StateBackend for SpendFails {
        fn get<'a>(&'a self, k: &'a SessionKey) -> crate::state::StateFuture<'a, FlowState> {
            crate::state::StateBackend::get(&self.0, k)
        }
        fn raise<'a>(
            &'a self,
            k: &'a SessionKey,
            a: &'a InformationLabel,
            b: &'a InformationLabel,
        ) -> crate::state::StateFuture<'a, FlowState> {
            crate::state::StateBackend::raise(&self.0, k, a, b)
        }
        fn forget_session<'a>(&'a self, k: &'a SessionKey) -> crate::state::StateFuture<'a, ()> {
            crate::state::StateBackend::forget_session(&self.0, k)
        }
        fn consume_grant<'a>(&'a self, _: &'a str, _: u64) -> crate::state::StateFuture<'a, bool> {
            Box::pin(async { Err(StateError::Failed("gone mid-spend".into())) })
        }
        fn snapshot(&self) -> crate::state::StateFuture<'_, crate::state::StateSnapshot> {
            crate::state::StateBackend::snapshot(&self.0)
        }
        fn checkpoint(&self) -> crate::state::StateFuture<'_, Option<(u64, String)>> {
            crate::state::StateBackend::checkpoint(&self.0)
        }
        fn set_checkpoint<'a>(&'a self, q: u64, h: &'a str) -> crate::state::StateFuture<'a, ()> {
            crate::state::StateBackend::set_checkpoint(&self.0, q, h)
        }
        fn failure(&self) -> Option<String> {
            None
        }
        fn describe(&self) -> String {
            "a store whose grant spends fail".into()
        }
    }

    /// A state failure names the call's grant as possibly spent only once it was verified
    /// and being spent: one before (the labels unreadable) came before the grant was even
    /// checked, so its id is only what the client claimed, and a record naming it would
    /// have it marked spent at the next start.
    #[tokio::test]
    async fn a_state_failure_may_have_spent_the_grant_only_once_it_is_being_spent() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, who) = (registry(), analyst());
        let inbox = reg.tool("public-inbox", "publish").unwrap();
        let args = json!({"message": "harbor goods", "sink": "127.0.0.1:1"});
        let now = crate::grant::now();
        let grant = board_grant(&who, inbox, &args, now + 600);
        let offer = GrantOffer {
            grant: &grant,
            now,
            second_began: std::time::Instant::now(),
        };
        let with = |backend: Box<dyn crate::state::StateBackend>| {
            FlowResolver::new(
                Classifier::new(vec![ClassifierRule {
                    pattern: regex::Regex::new("(?i)harbor goods").unwrap(),
                    label: terms(),
                    scopes: BTreeSet::from([ClassifierScope::Arguments]),
                }]),
                InformationLabel::bottom(),
                Arc::new(FlowStateStore::with_backend(backend)),
                &board(),
            )
        };
        let refused = with(Box::new(Unreadable))
            .pre_dispatch(&who, &key_for(&who, "s1"), inbox, &args, Some(offer))
            .await
            .unwrap_err();
        assert!(matches!(refused, CallRefusal::State(_)), "{refused:?}");
        assert!(!refused.may_have_spent_the_grant());
        let store = crate::state::SqliteStore::open(&dir.path().join("state.db")).unwrap();
        let refused = with(Box::new(SpendFails(store)))
            .pre_dispatch(&who, &key_for(&who, "s1"), inbox, &args, Some(offer))
            .await
            .unwrap_err();
        assert!(
            matches!(refused, CallRefusal::StateWhileSpending(_)),
            "{refused:?}"
        );
        assert!(refused.may_have_spent_the_grant());
        assert_eq!(refused.verdict(), Verdict::Failed(Failure::StateFailure));
    }

    /// A state that cannot be read at the syscall refuses the attempt as a state failure,
    /// grant or no grant. Before, it was read as `Top`, and a call whose source was `Top` at
    /// dispatch too kept its grant's target: the attempt went out under the grant.
    #[tokio::test]
    async fn an_unreadable_state_refuses_egress_even_under_a_grant() {
        let dir = tempfile::tempdir().unwrap();
        let res = resolver(dir.path());
        let mut plan = team_publish(&res).await;
        plan.source = InformationLabel::Top;
        plan.grant = Some(lab_grant(u64::MAX));
        let broken = FlowResolver::new(
            Classifier::new(Vec::new()),
            InformationLabel::bottom(),
            Arc::new(FlowStateStore::with_backend(Box::new(Unreadable))),
            &board(),
        );
        let to = crate::destination::Destination::Inet("127.0.0.1:1".parse().unwrap());
        let rules = DestinationRules::allow_only(vec!["127.0.0.1:1".parse().unwrap()]);
        let judged = broken.decide_egress(&plan, Some(&to), &rules, None).await;
        assert_eq!(
            judged.verdict,
            Verdict::Failed(Failure::StateFailure),
            "{judged:?}"
        );
    }

    /// A grant expires while its call runs: the call's later attempts and the answers it
    /// would take in are refused as expired. Before, expiry was checked only at dispatch, and
    /// the grant's target kept serving the call after it expired.
    #[tokio::test]
    async fn a_grant_that_expires_mid_call_refuses_what_comes_after() {
        let dir = tempfile::tempdir().unwrap();
        let res = resolver(dir.path());
        let mut plan = team_publish(&res).await;
        let to = Destination::Inet("127.0.0.1:1".parse().unwrap());
        let rules = DestinationRules::allow_only(vec!["127.0.0.1:1".parse().unwrap()]);
        // Still valid: the grant serves the call.
        plan.grant = Some(lab_grant(crate::grant::now() + 600));
        let v = res.decide_egress(&plan, Some(&to), &rules, None).await;
        assert!(v.verdict.allowed(), "{v:?}");
        assert!(v.under_grant, "{v:?}");
        assert!(
            res.admit_answer(&plan, "publish", "fine", &|_| true)
                .await
                .outcome
                .is_ok()
        );
        // Expired since dispatch: refused as expired.
        plan.grant = Some(lab_grant(crate::grant::now()));
        let v = res.decide_egress(&plan, Some(&to), &rules, None).await;
        assert_eq!(v.verdict.denial(), Some(Denial::GrantExpired), "{v:?}");
        let v = res
            .decide_lookup(&plan, &"inbox.test".parse().unwrap(), &rules, None)
            .await;
        assert_eq!(v.verdict.denial(), Some(Denial::GrantExpired), "{v:?}");
        let answer = res.admit_answer(&plan, "publish", "fine", &|_| true).await;
        assert!(
            matches!(
                answer.outcome,
                Err(CallRefusal::Grant {
                    denial: GrantDenial::Expired,
                    ..
                })
            ),
            "{:?}",
            answer.outcome
        );
    }

    /// A grant stops applying to its call, in flight or waiting for its executor, once the
    /// operator no longer trusts its authority with the key that verified it (taken out,
    /// or re-keyed): the call's later attempts, lookups and answers are refused as
    /// `grant_untrusted_authority`, and a new call's grant is refused before dispatch.
    /// Before, trust was checked once before dispatch, and a call kept declassifying under a
    /// withdrawn authority's grant until it ended.
    #[tokio::test]
    async fn a_withdrawn_authoritys_grant_stops_applying_mid_call() {
        let dir = tempfile::tempdir().unwrap();
        let res = resolver(dir.path());
        let mut plan = team_publish(&res).await;
        plan.grant = Some(lab_grant(crate::grant::now() + 600));
        let to = Destination::Inet("127.0.0.1:1".parse().unwrap());
        let rules = DestinationRules::allow_only(vec!["127.0.0.1:1".parse().unwrap()]);
        let v = res.decide_egress(&plan, Some(&to), &rules, None).await;
        assert!(v.verdict.allowed() && v.under_grant, "{v:?}");
        let other_key = ed25519_dalek::SigningKey::from_bytes(&[8; 32]).verifying_key();
        for trusted in [
            Authorities::new(),
            Authorities::from([("board".to_string(), other_key)]),
        ] {
            res.trust_authorities(&trusted);
            let v = res.decide_egress(&plan, Some(&to), &rules, None).await;
            assert_eq!(
                v.verdict.denial(),
                Some(Denial::GrantUntrustedAuthority),
                "{v:?}"
            );
            assert!(!v.under_grant);
            let v = res
                .decide_lookup(&plan, &"inbox.test".parse().unwrap(), &rules, None)
                .await;
            assert_eq!(
                v.verdict.denial(),
                Some(Denial::GrantUntrustedAuthority),
                "{v:?}"
            );
            let answer = res.admit_answer(&plan, "publish", "fine", &|_| true).await;
            assert!(
                matches!(
                    answer.outcome,
                    Err(CallRefusal::Grant {
                        denial: GrantDenial::UntrustedAuthority,
                        ..
                    })
                ),
                "{:?}",
                answer.outcome
            );
        }
        // A new call's grant is checked against the authorities trusted now.
        let (reg, who) = (registry(), analyst());
        let inbox = reg.tool("public-inbox", "publish").unwrap();
        let args = json!({"message": "harbor goods", "sink": "127.0.0.1:1"});
        let grant = board_grant(&who, inbox, &args, crate::grant::now() + 600);
        let offer = GrantOffer {
            grant: &grant,
            now: crate::grant::now(),
            second_began: std::time::Instant::now(),
        };
        let refused = res
            .pre_dispatch(&who, &key_for(&who, "s1"), inbox, &args, Some(offer))
            .await
            .unwrap_err();
        assert!(
            matches!(
                refused,
                CallRefusal::Grant {
                    denial: GrantDenial::UntrustedAuthority,
                    ..
                }
            ),
            "{refused:?}"
        );
        // Trusted again with its key: the grant serves the call again.
        res.trust_authorities(&board());
        let v = res.decide_egress(&plan, Some(&to), &rules, None).await;
        assert!(v.verdict.allowed() && v.under_grant, "{v:?}");
    }

    /// A call that egresses under a grant takes no client answer above its clearances:
    /// the authority signed the call's arguments, not what the client says during it.
    /// Before, an answer was judged against the grant's target, so session data the
    /// authority never saw reached the tool, and left under the grant.
    #[tokio::test]
    async fn a_grant_does_not_cover_a_clients_answer() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, res) = (registry(), resolver(dir.path()));
        let fresh = PrincipalConfig {
            id: PrincipalId::new("newcomer").unwrap(),
            ..analyst()
        };
        let k = key_for(&fresh, "s1");
        let args = serde_json::json!({"message": "m", "sink": "127.0.0.1:1"});
        let public = reg.tool("public-inbox", "publish").unwrap();
        let mut plan = res
            .pre_dispatch(&fresh, &k, public, &args, None)
            .await
            .unwrap();
        // The session holds the terms, and the call runs under a grant to public.
        res.state().join(&k, &terms()).await.unwrap();
        plan.source = terms();
        plan.grant = Some(lab_grant(u64::MAX));
        let to = Destination::Inet("127.0.0.1:1".parse().unwrap());
        let rules = DestinationRules::allow_only(vec!["127.0.0.1:1".parse().unwrap()]);
        let v = res.decide_egress(&plan, Some(&to), &rules, None).await;
        assert!(
            v.verdict.allowed(),
            "the grant serves the call's egress: {v:?}"
        );
        let answer = res.admit_answer(&plan, "publish", "fine", &|_| true).await;
        assert!(
            matches!(
                answer.outcome,
                Err(CallRefusal::Flow {
                    denial: EgressDenial::FlowViolation,
                    ..
                })
            ),
            "{:?}",
            answer.outcome
        );
    }

    #[tokio::test]
    async fn a_clients_answer_reaches_a_tool_only_within_its_clearances() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, res, who) = (registry(), resolver(dir.path()), analyst());
        let k = key_for(&who, "s1");
        let args = serde_json::json!({"message": "m", "sink": "127.0.0.1:1"});
        // The team inbox is cleared for the terms: an answer carrying them goes through,
        // and its taint is joined before the tool sees it.
        let team = reg.tool("team-inbox", "publish").unwrap();
        let plan = res.pre_dispatch(&who, &k, team, &args, None).await.unwrap();
        let judged = res
            .admit_answer(&plan, "publish", "Harbor Goods says yes", &|_| true)
            .await;
        assert_eq!(judged.source, terms());
        assert!(
            !judged.clearances.is_empty() && judged.clearances.iter().all(|c| *c == terms()),
            "the policy's and the manifest's: {:?}",
            judged.clearances
        );
        assert_eq!(judged.outcome.unwrap().session, terms());
        // The public inbox is cleared for public data only: the same session (now holding
        // the terms) may not hand it any answer, however plain.
        let public = reg.tool("public-inbox", "publish").unwrap();
        let k2 = key_for(&who, "s2");
        let plan = res.pre_dispatch(&who, &k2, public, &args, None).await;
        assert!(
            plan.is_err(),
            "the principal holds the terms: the call itself is refused"
        );
        let fresh = PrincipalConfig {
            id: PrincipalId::new("newcomer").unwrap(),
            ..analyst()
        };
        let k3 = key_for(&fresh, "s3");
        let plan = res
            .pre_dispatch(&fresh, &k3, public, &args, None)
            .await
            .unwrap();
        let plain = res.admit_answer(&plan, "publish", "fine", &|_| true).await;
        assert!(
            plain.outcome.is_ok(),
            "public data flows to a public clearance"
        );
        let refused = res
            .admit_answer(&plan, "publish", "Harbor Goods says yes", &|_| true)
            .await;
        assert!(
            matches!(
                refused.outcome,
                Err(CallRefusal::Flow {
                    denial: EgressDenial::FlowViolation,
                    ..
                })
            ),
            "{:?}",
            refused.outcome
        );
        assert_eq!(
            res.state().get(&k3).await.unwrap().session,
            InformationLabel::bottom(),
            "a refused answer joins nothing"
        );
    }

    #[tokio::test]
    async fn the_lab_decisions() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, res, who) = (registry(), resolver(dir.path()), analyst());
        let k = key_for(&who, "s1");
        let read = reg.tool("workspace", "read_terms").unwrap();
        let plan = res
            .pre_dispatch(
                &who,
                &k,
                read,
                &serde_json::json!({"document": "t.md"}),
                None,
            )
            .await
            .unwrap();
        assert!(
            plan.clearances.is_empty(),
            "a local, non-egress read checks no clearance"
        );
        let label = res
            .after_call(&plan, "Harbor Goods terms")
            .await
            .unwrap()
            .session;
        assert_eq!(label, terms(), "declared output label and classifier agree");

        let team = reg.tool("team-inbox", "publish").unwrap();
        let plan = res
            .pre_dispatch(
                &who,
                &k,
                team,
                &serde_json::json!({"message": "m", "sink": "127.0.0.1:1"}),
                None,
            )
            .await
            .unwrap();
        assert_eq!(plan.source, terms());
        assert!(plan.basis.declared && plan.basis.topology);
        let rules = DestinationRules::allow_only(vec!["127.0.0.1:1".parse().unwrap()]);
        let ok = Destination::Inet("127.0.0.1:1".parse().unwrap());
        let other = Destination::Inet("127.0.0.1:2".parse().unwrap());
        assert!(
            res.decide_egress(&plan, Some(&ok), &rules, None)
                .await
                .verdict
                .allowed()
        );
        let blocked = res.decide_egress(&plan, Some(&other), &rules, None).await;
        assert_eq!(blocked.verdict.denial(), Some(Denial::DestinationBlocked));
        // Lookups: judged as egress (the clearances), then whether a rule names the name.
        let named = DestinationRules::allow_only(vec!["inbox.test:1".parse().unwrap()]);
        let looked = |n: &str| n.parse::<HostName>().unwrap();
        let v = res
            .decide_lookup(&plan, &looked("inbox.test"), &named, None)
            .await;
        assert!(v.verdict.allowed(), "{v:?}");
        let v = res
            .decide_lookup(&plan, &looked("other.test"), &named, None)
            .await;
        assert_eq!(v.verdict.denial(), Some(Denial::NameNotAllowed));

        let public = reg.tool("public-inbox", "publish").unwrap();
        let refusal = res
            .pre_dispatch(
                &who,
                &k,
                public,
                &serde_json::json!({"message": "m", "sink": "127.0.0.1:1"}),
                None,
            )
            .await
            .unwrap_err();
        assert_eq!(refusal.denial(), Denial::FlowViolation);

        // The sneaky tool: no egress predicted, dispatched; its connect is refused.
        let sneaky = reg.tool("workspace", "summarize_terms").unwrap();
        let plan = res
            .pre_dispatch(&who, &k, sneaky, &serde_json::json!({"text": "x"}), None)
            .await
            .unwrap();
        let v = res
            .decide_egress(
                &plan,
                Some(&ok),
                &DestinationRules::allow_only(vec!["127.0.0.1:1".parse().unwrap()]),
                None,
            )
            .await;
        assert!(!v.verdict.allowed());
        assert_eq!(
            v.verdict.denial(),
            Some(Denial::MissingClearance),
            "a destination allow does not help"
        );
        // Nor does a rule naming the name: a tool without clearance looks nothing up.
        let v = res
            .decide_lookup(
                &plan,
                &"inbox.test".parse().unwrap(),
                &DestinationRules::allow_only(vec!["inbox.test:1".parse().unwrap()]),
                None,
            )
            .await;
        assert_eq!(v.verdict.denial(), Some(Denial::MissingClearance));
    }

    #[tokio::test]
    async fn argument_taint_is_joined_before_dispatch() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, res, who) = (registry(), resolver(dir.path()), analyst());
        let k = key_for(&who, "s2");
        let sneaky = reg.tool("workspace", "summarize_terms").unwrap();
        res.pre_dispatch(
            &who,
            &k,
            sneaky,
            &serde_json::json!({"text": "the Harbor Goods rebate"}),
            None,
        )
        .await
        .unwrap();
        assert_eq!(
            res.state().get(&k).await.unwrap().combined(),
            terms(),
            "the executor saw the terms"
        );
        let public = reg.tool("public-inbox", "publish").unwrap();
        let r = res
            .pre_dispatch(
                &who,
                &key_for(&who, "s3"),
                public,
                &serde_json::json!({"message": "m", "sink": "h:1"}),
                None,
            )
            .await;
        assert_eq!(
            r.unwrap_err().denial().as_str(),
            "flow_violation",
            "the principal's taint follows it"
        );
    }

    #[tokio::test]
    async fn access_and_schema_are_checked_first() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, res) = (registry(), resolver(dir.path()));
        let limited = PrincipalConfig {
            tools: vec!["workspace/list_documents".into()],
            ..analyst()
        };
        let read = reg.tool("workspace", "read_terms").unwrap();
        let k = key_for(&limited, "s");
        assert_eq!(
            res.pre_dispatch(
                &limited,
                &k,
                read,
                &serde_json::json!({"document": "x"}),
                None
            )
            .await
            .unwrap_err()
            .denial()
            .as_str(),
            "access_denied"
        );
        let who = analyst();
        assert_eq!(
            res.pre_dispatch(&who, &k, read, &serde_json::json!({}), None)
                .await
                .unwrap_err()
                .denial()
                .as_str(),
            "schema_invalid"
        );
        assert!(
            res.state().get(&k).await.unwrap().combined().is_bottom(),
            "refused calls add no taint"
        );
    }

    #[tokio::test]
    async fn top_state_never_egresses() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, res, who) = (registry(), resolver(dir.path()), analyst());
        let k = key_for(&who, "s");
        res.state().join(&k, &InformationLabel::Top).await.unwrap();
        let team = reg.tool("team-inbox", "publish").unwrap();
        let r = res
            .pre_dispatch(
                &who,
                &k,
                team,
                &serde_json::json!({"message": "m", "sink": "h:1"}),
                None,
            )
            .await;
        assert_eq!(r.unwrap_err().denial().as_str(), "top_source");
    }

    #[test]
    fn check_clearances_order() {
        let reg = registry();
        let sneaky = reg
            .tool("workspace", "summarize_terms")
            .unwrap()
            .security()
            .clone();
        assert_eq!(
            check_clearances(&InformationLabel::Top, &sneaky)
                .unwrap_err()
                .0,
            EgressDenial::TopSource
        );
        assert_eq!(
            check_clearances(&InformationLabel::bottom(), &sneaky)
                .unwrap_err()
                .0,
            EgressDenial::MissingClearance
        );
        let team = reg
            .tool("team-inbox", "publish")
            .unwrap()
            .security()
            .clone();
        assert_eq!(
            check_clearances(&terms(), &team).unwrap(),
            vec![terms(), terms()],
            "policy, then manifest clearance"
        );
    }
}
