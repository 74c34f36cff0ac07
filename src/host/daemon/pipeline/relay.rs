//! What an executor sends its client while it serves a call (log notifications, sampling
//! and elicitation requests) is the call's output, and the client's answer to a request is
//! new input to the tool. [`RelayGate`] governs both for one call, in the call's records.
//!
//! Towards the client the host commits the raise first, then forwards (rather than holding
//! everything back until the result): a request needs the client's answer before the tool
//! can finish, so it cannot wait for the result's raise. The raise is the one the result
//! gets (the tool's effective output floor, joined with what the classifier finds in the
//! message), durable in the flow state before the message is queued for the client; the
//! result's own raise later joins the same floor again. Log notifications go the same way,
//! so a client sees them before the result, in order; so do progress notifications (numbers
//! the executor chooses): each one's numbers are read by the classifier and raised the same
//! way before it goes out (a raise that changes nothing writes nothing).
//!
//! Towards the tool, the answer must flow to the tool's clearances as the session stands
//! when it arrives (another request of the session may have raised it meanwhile); its
//! taint is joined durably before the executor sees it.
//!
//! Each relayed request is recorded (`relay`, with `flowhost.relay` saying which request
//! and which way) before it takes effect, refusals included, and once more when the
//! session's transport could not carry it to the client (`client_unreachable`). A log or
//! progress notification is recorded (`log`, `progress`) only when its raise changed the
//! labels since the call's last record: the records then prove every label a client has
//! seen output under, even when the call's outcome is never recorded (the host killed), so
//! an older copy of the flow state cannot take it back unnoticed.

use serde_json::Value;

use super::{CallEnv, CallRecord, labels_after, refusal, refusal_error};
use crate::decision::{Denial, Failure, Verdict};
use crate::mcp::{RpcError, code};
use crate::records::{
    EventKind, FlowContext, LabelsAfter, RelayDirection, RelayFacts, RelayMethod,
};
use crate::resolver::{CallPlan, classifiable_text};
use crate::state::FlowState;

/// Most requests of one call relayed to the client at once; an executor asking more before
/// the client answered is refused (`relay_limit`).
pub const MAX_PENDING_RELAYS: usize = 4;

/// The governance of what one call relays (see the module docs).
pub struct RelayGate<'a> {
    pub(super) env: &'a CallEnv<'a>,
    pub(super) rec: &'a CallRecord<'a>,
    pub(super) plan: &'a CallPlan,
    /// The tool as registered (named in a flow refusal).
    pub(super) tool: &'a str,
    /// The labels the call's records last carried (the authorization's at first).
    pub(super) recorded: std::sync::Mutex<LabelsAfter>,
}

impl RelayGate<'_> {
    /// Joins the label the call's output implies, with `message` read by the classifier as
    /// output, into the flow state, durably. Nothing of `message` may reach the client
    /// before this succeeds.
    pub async fn raise(&self, message: &Value) -> Result<FlowState, RpcError> {
        self.env
            .resolver
            .after_call(self.plan, &classifiable_text(message))
            .await
            .map_err(|e| {
                refusal(
                    code::INTERNAL_ERROR,
                    format!("the label of what the tool sent could not be stored, so it is withheld: {e}"),
                    Denial::StateFailure,
                )
            })
    }

    /// Raises the label as for any of the call's output (see [`RelayGate::raise`]) with the
    /// notification `message` (`method`: a log line or progress), recording the raise first
    /// when it changed the labels since the call's last record. Nothing of `message` may
    /// reach the client before this succeeds.
    pub async fn notify(&self, method: RelayMethod, message: &Value) -> Result<(), RpcError> {
        let state = self.raise(message).await?;
        // A call's notifications come one at a time (its executor's output is read in
        // order), so no other raise of the call is recorded between this check and the
        // record.
        let unrecorded = self
            .recorded
            .lock()
            .map(|last| *last != labels_after(&state))
            .unwrap_or(true);
        if unrecorded {
            self.allow(
                method,
                RelayDirection::ToClient,
                &state,
                FlowContext::default(),
            )
            .await?;
        }
        Ok(())
    }

    /// Decides whether the executor's request `method` (with `params`) may reach the
    /// client: refused (and recorded) when the client did not declare the capability
    /// (`capable`) or `pending` requests of the call already wait for it
    /// ([`MAX_PENDING_RELAYS`]); otherwise the raise is committed and the allow recorded
    /// durably, and the request may go out. The error is the executor's answer.
    pub async fn to_client(
        &self,
        method: RelayMethod,
        params: &Value,
        capable: bool,
        pending: usize,
    ) -> Result<(), RpcError> {
        let refused = if !capable {
            Some((
                code::METHOD_NOT_FOUND,
                format!(
                    "the client declared no {} capability, so {} is not relayed",
                    method.capability().unwrap_or(method.method()),
                    method.method()
                ),
                Denial::ClientCapabilityMissing,
            ))
        } else if pending >= MAX_PENDING_RELAYS {
            Some((
                code::INVALID_REQUEST,
                format!(
                    "{pending} requests of this call already wait for the client (at most {MAX_PENDING_RELAYS})"
                ),
                Denial::RelayLimit,
            ))
        } else {
            None
        };
        let direction = RelayDirection::ToClient;
        if let Some((code, message, denial)) = refused {
            // What the executor put in its request is output of the call all the same: its
            // label joins as any output's, whatever the client is told, so a later call of
            // the executor cannot carry it out under a label below it.
            let raised = self.raise(params).await;
            let verdict = match raised {
                Ok(_) => Verdict::refused(denial),
                // The executor is told of the state failure: so is the record.
                Err(_) => Verdict::Failed(Failure::StateFailure),
            };
            self.record(method, direction, verdict, FlowContext::default())
                .await?;
            raised?;
            return Err(refusal(code, message, denial));
        }
        let state = match self.raise(params).await {
            Ok(state) => state,
            Err(e) => {
                let failed = Verdict::Failed(Failure::StateFailure);
                self.record(method, direction, failed, FlowContext::default())
                    .await?;
                return Err(e);
            }
        };
        self.allow(method, direction, &state, FlowContext::default())
            .await
    }

    /// Decides whether the client's `answer` (its result, or its error object) to the
    /// executor's request `method` may reach the tool (see
    /// [`crate::resolver::FlowResolver::admit_answer`]); recorded either way before the
    /// executor sees anything. The error is the executor's answer.
    /// An answer whose own label `held` does not admit (the executor holds egress
    /// approved under a lower label, a connection it may still have open) is refused as a
    /// flow violation: what it opened was judged for other data.
    pub async fn to_tool(
        &self,
        method: RelayMethod,
        answer: &Value,
        held: &(dyn Fn(&crate::label::InformationLabel) -> bool + Sync),
    ) -> Result<(), RpcError> {
        let judgment = self
            .env
            .resolver
            .admit_answer(self.plan, self.tool, &classifiable_text(answer), held)
            .await;
        let checked = FlowContext {
            source_label: Some(judgment.source.clone()),
            clearance_used: Some(judgment.clearances.clone()),
            ..FlowContext::default()
        };
        let direction = RelayDirection::ToTool;
        match judgment.outcome {
            Ok(state) => self.allow(method, direction, &state, checked).await,
            Err(refused) => {
                self.record(method, direction, refused.verdict(), checked)
                    .await?;
                Err(refusal_error(&refused))
            }
        }
    }

    /// Records that a request the client was to get (its raise committed, its allow
    /// recorded) did not reach it: the session's transport could not carry it. The error is
    /// the executor's answer.
    pub async fn undelivered(&self, method: RelayMethod) -> Result<(), RpcError> {
        let failed = Verdict::Failed(Failure::ClientUnreachable);
        self.record(
            method,
            RelayDirection::ToClient,
            failed,
            FlowContext::default(),
        )
        .await
    }

    /// Records the allow of what leaves `state` behind, durably.
    async fn allow(
        &self,
        method: RelayMethod,
        direction: RelayDirection,
        state: &FlowState,
        context: FlowContext,
    ) -> Result<(), RpcError> {
        let now = labels_after(state);
        let context = FlowContext {
            labels_after: Some(now.clone()),
            ..context
        };
        let allowed = Verdict::Authorized { rule: None };
        self.record(method, direction, allowed, context).await?;
        if let Ok(mut last) = self.recorded.lock() {
            *last = now;
        }
        Ok(())
    }

    async fn record(
        &self,
        method: RelayMethod,
        direction: RelayDirection,
        verdict: Verdict,
        context: FlowContext,
    ) -> Result<(), RpcError> {
        let context = FlowContext {
            relay: Some(RelayFacts { method, direction }),
            ..context
        };
        self.env
            .recorder
            .record(EventKind::Relay, self.rec.facts(verdict, context))
            .await
    }
}
