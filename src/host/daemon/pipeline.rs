//! One `tools/call`, as plain stages: **admit** (the request is well-formed, the caller is
//! the session's principal, the tool exists, bridge metadata and any grant are readable) ->
//! **pre-dispatch** (the flow resolver: access, schema, clearances, grant; the argument taint
//! joined durably) -> **authorize** (the allow recorded durably before any effect) ->
//! **dispatch** (an executor, behind [`Dispatch`]) -> **settle** (the output's label joined
//! durably, the outcome written to the records with the labels left behind, then the result
//! returned; the outcome's sync is awaited only when the output raised a label beyond what
//! the authorization record carried, see [`Recorder::record_outcome`]).
//!
//! Every refusal on the way is recorded (through [`Recorder`], which folds repeated
//! refusals) and answered with its [`Denial`] in `error.data.denial`, except arguments
//! failing the signed input schema: MCP makes that a tool execution error (`isError: true`)
//! the model can act on, so it is answered as one (and recorded as `schema_invalid`). A
//! record that cannot be written refuses (`record_failure`); state that cannot be written
//! refuses (`state_failure`). Each call ends with one log line at info (principal, tool,
//! verdict, duration).
//!
//! The pipeline sees the host only through [`CallEnv`] and the executor only through
//! [`Dispatch`]: its decisions are unit-tested without sockets, root or real executors.

pub mod relay;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use serde_json::{Value, json};

use super::refusals::{Admit, RefusalFolder};
use super::{CallInFlight, HostCounters, ServerFacts};
use crate::config::{HostConfig, PrincipalConfig};
use crate::decision::{Denial, EgressBasis, Failure, Verdict};
use crate::grant::SignedGrant;
use crate::ident::PrincipalId;
use crate::mcp::{RpcError, code};
use crate::records::{
    Classification, Correlation, DecisionRecord, EventKind, FlowContext, GrantFacts, LabelsAfter,
    PeerIdentity, Projection, RecordWriter, ServerInfo, ToolCallFacts, correlation_from_params,
    project_tool_call,
};
use crate::registry::{AdmittedTool, VerifiedRegistry};
use crate::resolver::{CallPlan, CallRefusal, FlowResolver, GrantOffer};
use crate::state::{FlowState, SessionKey};
pub use relay::RelayGate;

/// Where bridge security metadata travels: `_meta` of a tool in `tools/list`, and
/// `params._meta` of a `tools/call`.
pub const BRIDGE_META_KEY: &str = "flowhost/bridge";
/// Where a declassification grant travels with a call: `params._meta`.
pub const GRANT_META_KEY: &str = "flowhost/grant";
/// Most bytes of an unregistered tool name kept in a record.
const MAX_UNKNOWN_NAME_BYTES: usize = 128;

/// A client error carrying its denial as `data.denial`.
pub fn refusal(code: i64, message: impl Into<String>, denial: Denial) -> RpcError {
    RpcError::new(code, message).with_data(json!({"denial": denial.as_str()}))
}

/// Commits decision records: folds repeated refusals, counts `tool_call` records for health,
/// and turns a failed commit into a `record_failure` refusal.
pub struct Recorder<'a> {
    /// The record writer.
    pub records: &'a RecordWriter,
    /// Health counters.
    pub counters: &'a HostCounters,
    /// The refusal folder.
    pub refusals: &'a RefusalFolder,
}

impl Recorder<'_> {
    /// Records `facts` as `event`, durably (or folds it, for a repeated refusal). An error
    /// means the decision must not take effect.
    pub async fn record(&self, event: EventKind, facts: ToolCallFacts) -> Result<(), RpcError> {
        if matches!(facts.verdict, Verdict::Refused { .. })
            && self.refusals.admit(event, &facts) == Admit::Folded
        {
            return Ok(());
        }
        self.commit(DecisionRecord::from_call_facts(facts, event))
            .await
    }

    /// Records a call's (or a content request's) outcome; once this returns the record is
    /// in the file for any reader. Its effect was authorized by an earlier durable record,
    /// and any label it claims is already durable in the flow state (raised before the
    /// record that claims it, so after a crash the state is ahead of the records, never
    /// behind). One that `raised` labels beyond what that authorization record carried (a
    /// classifier's finding in the output, a content's floor) is synced before this
    /// returns, so before the answer goes out: the records alone must hold every label a
    /// client was answered under, since a state rebuilt from them (`state.db` lost) must
    /// not come back lower. Any other outcome is written without waiting for its sync (it
    /// follows with the next group).
    pub async fn record_outcome(
        &self,
        event: EventKind,
        facts: ToolCallFacts,
        raised: bool,
    ) -> Result<(), RpcError> {
        let record = DecisionRecord::from_call_facts(facts, event);
        if raised {
            return self.commit(record).await;
        }
        self.records
            .append(record)
            .await
            .map(drop)
            .map_err(record_failure)
    }

    /// Commits a record durably, counting `tool_call` records for health (a folded refusal
    /// too: health's count must equal the `tool_call` records it vouches for).
    pub async fn commit(&self, record: DecisionRecord) -> Result<(), RpcError> {
        let event = record.flowhost.event;
        // A call alone in the daemon syncs its record on its own thread: nothing else needs
        // the runtime's worker for that long, and it spares the hand-offs to the sync thread
        // and back (most of what a call adds beyond its sync, when waking an idle CPU is slow).
        if self.counters.calls_in_flight.alone() {
            self.records.commit_alone(record).await
        } else {
            self.records.commit(record).await
        }
        .map_err(record_failure)?;
        if event == EventKind::ToolCall {
            self.counters.tool_calls.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// The refusal for a decision whose record could not be written.
fn record_failure(e: crate::records::RecordError) -> RpcError {
    tracing::error!(error = %e, "decision record not written; refusing");
    refusal(
        code::INTERNAL_ERROR,
        "the decision record could not be written, so the host refuses the call",
        Denial::RecordFailure,
    )
}

/// What the pipeline reads of the host for one call (one configuration generation).
pub struct CallEnv<'a> {
    /// The configuration.
    pub config: &'a HostConfig,
    /// The verified registry.
    pub registry: &'a VerifiedRegistry,
    /// What the host knows of each server (digest, record mappings).
    pub servers: &'a BTreeMap<String, ServerFacts>,
    /// The flow resolver.
    pub resolver: &'a FlowResolver,
    /// Where decisions go.
    pub recorder: Recorder<'a>,
}

/// Who calls: the session, its peer, and the principal the session was mapped to at
/// `initialize` (`Err`: the refusal the session's principal check gave).
pub struct Caller<'a> {
    /// The session id.
    pub session: &'a str,
    /// The peer's uid and gid (none for a remote caller, whose principal the HTTP transport
    /// authenticated).
    pub peer: Option<PeerIdentity>,
    /// The principal, or why the session may not act.
    pub principal: Result<PrincipalConfig, RpcError>,
    /// The principal the session was mapped to at `initialize` (for records).
    pub pinned: Option<&'a PrincipalId>,
}

/// Why dispatching failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DispatchError {
    /// No executor could be started or made ready (the call never reached one). The text
    /// is the host's words only: it reaches the client unlabelled, so it must hold nothing
    /// an executor said (the dispatcher logs that instead).
    NotStarted(String),
    /// No executor took the call within a bound of the host: its deadline ran out while it
    /// waited for one, or the principal holds its share of the host's executors (the host's
    /// words). The call never reached one.
    NotTaken(String),
    /// A reload withdrew the principal's access to the tool while the call waited, before
    /// an executor took it (the host's words).
    AccessWithdrawn(String),
    /// The executor failed during the call (it is retired).
    Failed(String),
    /// The executor ran into a bound during the call (its memory, CPU or process limit, or
    /// the call's deadline) and was ended (it is retired).
    BoundReached(String),
    /// The executor answered the call with a JSON-RPC error (it may serve again). What it
    /// says is content: it is labelled like a result, then reaches the client as that
    /// error.
    Answered(RpcError),
    /// The client cancelled the call; the executor was told (and retired if it did not
    /// acknowledge).
    Cancelled(String),
    /// The client cancelled the call while it waited for an executor: no tool ran.
    CancelledBeforeStart(String),
}

/// Runs an authorized call on an executor of the session's.
pub trait Dispatch {
    /// Runs `tool` with `arguments` on the session's executor for `server`, with `call` in
    /// flight (the dispatcher sets `call.executor_pid`). What the executor sends its client
    /// meanwhile passes `gate` (see [`relay`]).
    fn dispatch(
        &mut self,
        server: &str,
        tool: &str,
        arguments: Value,
        call: CallInFlight,
        gate: &RelayGate<'_>,
    ) -> impl std::future::Future<Output = Result<Value, DispatchError>> + Send;

    /// Called once the call is settled: `durable` says whether the labels of everything the
    /// executor produced are stored and its outcome recorded. Until then the executor must
    /// serve no other call (it would be taken at the labels before the raise); if not, it
    /// must serve none again.
    fn settled(&mut self, durable: bool) -> impl std::future::Future<Output = ()> + Send {
        let _ = durable;
        async {}
    }
}

/// A call that passed admission.
struct Admitted<'e> {
    principal: PrincipalConfig,
    arguments: Value,
    tool: &'e AdmittedTool,
    server: &'e ServerFacts,
    grant: Option<SignedGrant>,
}

/// What a call's records share.
struct CallRecord<'l> {
    server: ServerInfo,
    name: String,
    projection: Projection,
    correlation: Correlation,
    principal: Option<String>,
    session: String,
    call_id: String,
    /// The verdict of the call's latest record (what its log line reports).
    last: &'l std::sync::Mutex<Option<Verdict>>,
}

impl CallRecord<'_> {
    /// Names the registered tool `server_id`/`tool_name` (of `server`) as its calls are
    /// named: the manifest's digest, and the projection its mapping makes of `arguments`
    /// (an unmapped tool counted among the unknown ones).
    fn name_registered(
        &mut self,
        env: &CallEnv<'_>,
        server_id: &str,
        tool_name: &str,
        server: &ServerFacts,
        arguments: &Value,
    ) {
        self.server = ServerInfo::mcp(server_id, Some(&server.digest));
        self.projection = project_tool_call(server.mappings.get(tool_name), arguments);
        if self.projection.classification == Classification::ObservedUnknownTool {
            env.recorder
                .counters
                .unknown_tools
                .fetch_add(1, Ordering::SeqCst);
        }
    }

    fn facts(&self, verdict: Verdict, context: FlowContext) -> ToolCallFacts {
        if let Ok(mut last) = self.last.lock() {
            *last = Some(verdict.clone());
        }
        ToolCallFacts {
            server: self.server.clone(),
            tool_name: self.name.clone(),
            projection: self.projection.clone(),
            verdict,
            credential_alias: None,
            correlation: self.correlation.clone(),
            context: FlowContext {
                principal: self.principal.clone(),
                session: Some(self.session.clone()),
                call_id: Some(self.call_id.clone()),
                ..context
            },
        }
    }
}

/// Runs one `tools/call` through every stage (see the module docs), and logs one line for
/// it at info: principal, tool, verdict (the status of its last record) and duration.
pub async fn tools_call<D: Dispatch>(
    env: &CallEnv<'_>,
    caller: Caller<'_>,
    params: &Value,
    dispatcher: &mut D,
) -> Result<Value, RpcError> {
    let started = std::time::Instant::now();
    let principal = caller.pinned.map(ToString::to_string);
    let session = caller.session.to_string();
    let last = std::sync::Mutex::new(None);
    let in_flight = env.recorder.counters.calls_in_flight.enter();
    let outcome = run_call(env, caller, params, dispatcher, &last).await;
    drop(in_flight);
    let (verdict, reason) = match last.lock().ok().and_then(|mut l| l.take()) {
        Some(Verdict::Refused { denial, .. }) => ("refused", denial.as_str()),
        Some(Verdict::Failed(f)) => ("failed", f.as_str()),
        Some(Verdict::Succeeded { .. }) => ("succeeded", ""),
        Some(Verdict::Authorized { .. }) | None => match &outcome {
            Err(e) => ("refused", e.data_denial().unwrap_or("")),
            Ok(_) => ("answered", ""),
        },
    };
    let tool = params
        .get("name")
        .and_then(Value::as_str)
        .map(|n| bounded(n, MAX_UNKNOWN_NAME_BYTES))
        .unwrap_or_default();
    tracing::info!(
        principal = %principal.as_deref().unwrap_or("(none)"),
        session = %session,
        tool = %tool,
        verdict,
        reason,
        duration_ms = started.elapsed().as_millis() as u64,
        "tools/call"
    );
    outcome
}

async fn run_call<D: Dispatch>(
    env: &CallEnv<'_>,
    caller: Caller<'_>,
    params: &Value,
    dispatcher: &mut D,
    last: &std::sync::Mutex<Option<Verdict>>,
) -> Result<Value, RpcError> {
    let Some(name) = params.get("name").and_then(Value::as_str) else {
        let e = refusal(
            code::INVALID_PARAMS,
            "tools/call needs a string \"name\"",
            Denial::InvalidParams,
        );
        return Err(refuse_session(env, &caller, "(tools/call)", e, Denial::InvalidParams).await);
    };
    let (server_id, tool_name) = env.config.tool_name(name);
    let mut rec = CallRecord {
        server: ServerInfo::mcp(
            if server_id.is_empty() {
                "(none)"
            } else {
                server_id
            },
            None,
        ),
        name: name.to_string(),
        projection: Projection::unknown_tool(),
        correlation: correlation_from_params(params),
        principal: caller.pinned.map(ToString::to_string),
        session: caller.session.to_string(),
        call_id: super::random_id(),
        last,
    };

    // Admit.
    let admitted = match admit(env, caller, params, server_id, tool_name) {
        Ok(a) => a,
        Err((e, denial)) => {
            // Whatever the refusal (an unknown tool, or arguments that are no object for
            // one), the record names a registered tool as any call of it, and any other
            // name as the caller's text, kept short.
            let registered = env.registry.tool(server_id, tool_name).is_some();
            if let Some(server) = env.servers.get(server_id).filter(|_| registered) {
                // Classified by its mapping (arguments that are no object project as none).
                let arguments = params
                    .get("arguments")
                    .filter(|a| a.is_object())
                    .cloned()
                    .unwrap_or_else(|| json!({}));
                rec.name_registered(env, server_id, tool_name, server, &arguments);
            } else {
                env.recorder
                    .counters
                    .unknown_tools
                    .fetch_add(1, Ordering::SeqCst);
                rec.name = bounded(name, MAX_UNKNOWN_NAME_BYTES);
            }
            env.recorder
                .record(
                    EventKind::ToolCall,
                    rec.facts(Verdict::refused(denial), FlowContext::default()),
                )
                .await?;
            return Err(e);
        }
    };
    rec.name_registered(
        env,
        server_id,
        tool_name,
        admitted.server,
        &admitted.arguments,
    );

    // Pre-dispatch.
    let key = SessionKey {
        principal: admitted.principal.id.clone(),
        session: rec.session.clone(),
    };
    let offer = admitted.grant.as_ref().map(|g| {
        let (now, second_began) = crate::grant::clock();
        GrantOffer {
            grant: g,
            now,
            second_began,
        }
    });
    let plan = match env
        .resolver
        .pre_dispatch(
            &admitted.principal,
            &key,
            admitted.tool,
            &admitted.arguments,
            offer,
        )
        .await
    {
        Ok(plan) => plan,
        Err(refused) => {
            // A host failure's record names the grant only if it may have been spent (the
            // continuity check marks such grants spent); before that, the id is one the
            // client may have made up, and a failure (unlike a refusal) would mark it.
            let named = !matches!(refused.verdict(), Verdict::Failed(_))
                || refused.may_have_spent_the_grant();
            let grant = admitted
                .grant
                .as_ref()
                .filter(|_| named)
                .map(|g| GrantFacts {
                    id: g.body().grant_id.clone(),
                    purpose: g.body().purpose.to_string(),
                });
            env.recorder
                .record(
                    EventKind::ToolCall,
                    rec.facts(
                        refused.verdict(),
                        FlowContext {
                            grant,
                            ..FlowContext::default()
                        },
                    ),
                )
                .await?;
            // Per MCP, arguments that fail the tool's input schema are a tool execution
            // error the model can read and correct, not a protocol error.
            if let CallRefusal::SchemaInvalid { .. } = refused {
                return Ok(tool_error(&format!(
                    "{refused}. Correct the arguments to match the tool's inputSchema and call again."
                )));
            }
            return Err(refusal_error(&refused));
        }
    };

    // Authorize: the allow is durable before the executor sees anything.
    env.recorder
        .record(
            EventKind::ToolCall,
            rec.facts(
                Verdict::Authorized { rule: None },
                FlowContext {
                    source_label: Some(plan.source.clone()),
                    clearance_used: plan.basis.any().then(|| plan.clearances.clone()),
                    egress_basis: plan.basis.any().then_some(EgressBasis {
                        observed: false,
                        ..plan.basis
                    }),
                    labels_after: Some(labels_after(&plan.state_after_dispatch)),
                    grant: plan.grant.as_ref().map(|g| GrantFacts {
                        id: g.id.clone(),
                        purpose: g.purpose.to_string(),
                    }),
                    ..FlowContext::default()
                },
            ),
        )
        .await?;

    // Dispatch.
    let call = CallInFlight {
        plan: plan.clone(),
        call_id: rec.call_id.clone(),
        tool: name.to_string(),
        correlation: rec.correlation.clone(),
        executor_pid: 0,
    };
    let gate = RelayGate {
        env,
        rec: &rec,
        plan: &plan,
        tool: tool_name,
        recorded: std::sync::Mutex::new(labels_after(&plan.state_after_dispatch)),
    };
    let outcome = dispatcher
        .dispatch(server_id, tool_name, admitted.arguments, call, &gate)
        .await;

    // Settle, then let the executor serve again only if its output's labels are stored.
    let mut durable = false;
    let answer = settle(
        env,
        &rec,
        (&plan, &admitted.principal),
        admitted.tool,
        outcome,
        &mut durable,
    )
    .await;
    dispatcher.settled(durable).await;
    answer
}

/// Joins what the call produced into the flow state (durably, before the result is returned)
/// and records its outcome with the labels it leaves (its sync awaited only when the output
/// raised a label; see [`Recorder::record_outcome`]). What an executor said when it
/// failed can carry what it read, so it is settled like a result, and so is a call
/// cancelled after it started (the tool ran, and may have read what its floor labels).
/// A result that breaks the tool's signed output schema is withheld, and the client reads
/// why. `durable` is set once the labels of what the executor produced are stored and the
/// outcome recorded.
async fn settle(
    env: &CallEnv<'_>,
    rec: &CallRecord<'_>,
    (plan, principal): (&CallPlan, &PrincipalConfig),
    tool: &AdmittedTool,
    outcome: Result<Value, DispatchError>,
    durable: &mut bool,
) -> Result<Value, RpcError> {
    // `text`: what the executor said, to be classified and joined into the flow state
    // before anything of it reaches the client; `None` when nothing it produced does (a
    // `NotStarted` reason is the host's words: see `DispatchError::NotStarted`).
    // The join of the labels of signed resources the result carries (see
    // `content::carried_resources`).
    let mut carried = crate::label::InformationLabel::bottom();
    // Whether all the executor produced is labelled (its answer was not withheld).
    let mut labelled_whole = true;
    let (answer, verdict, text) = match outcome {
        Err(DispatchError::NotStarted(why)) => (
            Ok(tool_error(&format!(
                "the executor could not be started: {why}"
            ))),
            Verdict::Failed(Failure::ExecutorFailed),
            None,
        ),
        // A bound of the host, not of an executor: nothing ran, so nothing is labelled.
        Err(DispatchError::NotTaken(why)) => (
            Ok(tool_error(&format!("no executor took the call: {why}"))),
            Verdict::Failed(Failure::BoundReached),
            None,
        ),
        // Nothing the executor produced reaches the client, but the executor ran the tool:
        // its output floor joins
        // the state, as for any call that ran, so the executor cannot carry what it read
        // to a later call at a lower label.
        Err(DispatchError::Cancelled(why)) => (
            Ok(tool_error(&format!("the call was cancelled: {why}"))),
            Verdict::Failed(Failure::Cancelled),
            Some(String::new()),
        ),
        Err(DispatchError::AccessWithdrawn(why)) => (
            Err(refusal(code::ACCESS_DENIED, why, Denial::AccessDenied)),
            Verdict::Failed(Failure::AccessWithdrawn),
            None,
        ),
        Err(DispatchError::CancelledBeforeStart(why)) => (
            Ok(tool_error(&format!("the call was cancelled: {why}"))),
            Verdict::Failed(Failure::Cancelled),
            None,
        ),
        Ok(result) => match tool
            .check_output(&result)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                content::carried_resources(env.registry, principal, tool.server_id(), None, &result)
                    .map_err(|(why, _)| {
                        format!(
                            "server {:?} tool {:?}: {why}",
                            tool.server_id(),
                            tool.name()
                        )
                    })
            }) {
            Ok(label) => {
                carried = label;
                let verdict = if result.get("isError") == Some(&Value::Bool(true)) {
                    Verdict::Failed(Failure::ToolError)
                } else {
                    Verdict::Succeeded { rule: None }
                };
                let text = crate::resolver::classifiable_text(&result);
                (Ok(result), verdict, Some(text))
            }
            // Nothing of the result reaches the client, but the tool ran: what is
            // classified is the host's words the client reads, and the output floor joins
            // as for any call that ran. What the executor produced was never labelled, so
            // it serves no later call, which could carry it out under a lower label.
            Err(broken) => {
                labelled_whole = false;
                let result = tool_error(&format!("the tool's result was withheld: {broken}"));
                let text = crate::resolver::classifiable_text(&result);
                (
                    Ok(result),
                    Verdict::Failed(Failure::AnswerWithheld),
                    Some(text),
                )
            }
        },
        // The tool's own error, passed on as it was given (clients act on its code); its
        // message and data are what it says, so they are classified.
        Err(DispatchError::Answered(e)) => {
            let text = answered_text(&e);
            (Err(e), Verdict::Failed(Failure::ToolError), Some(text))
        }
        Err(DispatchError::Failed(why)) => {
            executor_ended(&format!("failed: {why}"), Failure::ExecutorFailed)
        }
        Err(DispatchError::BoundReached(why)) => {
            executor_ended(&format!("was ended: {why}"), Failure::BoundReached)
        }
    };
    let state = match text {
        None => plan.state_after_dispatch.clone(),
        Some(text) => match env
            .resolver
            .after_call_carrying(plan, &carried, &text)
            .await
        {
            Ok(state) => state,
            Err(e) => {
                // The output is withheld: that is the call's outcome, recorded with the last
                // labels known to be stored, before the refusal goes out.
                record_outcome(
                    env,
                    rec,
                    Verdict::Failed(Failure::StateFailure),
                    &plan.state_after_dispatch,
                    &plan.state_after_dispatch,
                )
                .await?;
                return Err(refusal(
                    code::INTERNAL_ERROR,
                    format!("the output's label could not be stored, so it is withheld: {e}"),
                    Denial::StateFailure,
                ));
            }
        },
    };
    record_outcome(env, rec, verdict, &state, &plan.state_after_dispatch).await?;
    // Labelled and recorded: the executor may serve again, and what it held for the
    // client go out, under a label the records hold.
    *durable = labelled_whole;
    answer
}

/// A call's outcome when its executor failed or was ended (`what` happened to it): a tool
/// error the client reads, its text classified like any output (it names the server).
fn executor_ended(
    what: &str,
    failure: Failure,
) -> (Result<Value, RpcError>, Verdict, Option<String>) {
    let result = tool_error(&format!("the tool's executor {what}"));
    let text = crate::resolver::classifiable_text(&result);
    (Ok(result), Verdict::Failed(failure), Some(text))
}

/// The error codes JSON-RPC defines (parse error, invalid request, method not found,
/// invalid params, internal error) and those MCP and its SDKs give a meaning to (a
/// connection closed, a request timed out, a resource not found, a URL elicitation
/// required).
const PROTOCOL_CODES: [i64; 9] = [
    code::PARSE_ERROR,
    code::INVALID_REQUEST,
    code::METHOD_NOT_FOUND,
    code::INVALID_PARAMS,
    code::INTERNAL_ERROR,
    -32000,
    -32001,
    content::RESOURCE_NOT_FOUND,
    -32042,
];

/// The text of an executor's JSON-RPC error that the classifier reads: its message and its
/// data, which can carry what the executor read as much as a result can. Data is read as a
/// result's text is (strings as sent, not JSON-escaped), so a pattern matches what an error
/// carries exactly as it would match the same words in a result.
pub(super) fn answered_text(e: &RpcError) -> String {
    // The code too (any integer goes to the client as it is), unless it is one of the
    // protocol's own, which says nothing of the tool's: read, it would match rules for
    // short numbers on every ordinary error. Any other, reserved range included (769
    // codes an executor may pick among), is the tool's choice and may spell what it read.
    let code = if PROTOCOL_CODES.contains(&e.code) {
        String::new()
    } else {
        format!("{}\n", e.code)
    };
    match &e.data {
        Some(data) => format!(
            "{code}{}\n{}",
            e.message,
            crate::resolver::classifiable_text(data)
        ),
        None => format!("{code}{}", e.message),
    }
}

/// Records a call's outcome with the labels it leaves behind (already durable in the flow
/// state): see [`Recorder::record_outcome`]; `authorized` is what the call's authorization
/// record carried.
async fn record_outcome(
    env: &CallEnv<'_>,
    rec: &CallRecord<'_>,
    verdict: Verdict,
    state: &FlowState,
    authorized: &FlowState,
) -> Result<(), RpcError> {
    env.recorder
        .record_outcome(
            EventKind::ToolOutcome,
            rec.facts(
                verdict,
                FlowContext {
                    labels_after: Some(labels_after(state)),
                    ..FlowContext::default()
                },
            ),
            state != authorized,
        )
        .await
}

/// The admission stage: everything that can refuse before the resolver runs.
fn admit<'e>(
    env: &'e CallEnv<'_>,
    caller: Caller<'_>,
    params: &Value,
    server_id: &str,
    tool_name: &str,
) -> Result<Admitted<'e>, (RpcError, Denial)> {
    let with_denial = |e: RpcError, fallback: Denial| {
        let denial = e
            .data_denial()
            .and_then(|d| serde_json::from_value(json!(d)).ok())
            .unwrap_or(fallback);
        (e, denial)
    };
    let principal = caller
        .principal
        .map_err(|e| with_denial(e, Denial::AccessDenied))?;
    let arguments = match params.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => {
            return Err((
                refusal(
                    code::INVALID_PARAMS,
                    "\"arguments\" must be an object",
                    Denial::InvalidParams,
                ),
                Denial::InvalidParams,
            ));
        }
    };
    let (Some(tool), Some(server)) = (
        env.registry.tool(server_id, tool_name),
        env.servers.get(server_id),
    ) else {
        let name = params.get("name").and_then(Value::as_str).unwrap_or("");
        return Err((
            refusal(
                code::INVALID_PARAMS,
                format!("unknown tool {name:?} (tools are named server/tool)"),
                Denial::UnknownTool,
            ),
            Denial::UnknownTool,
        ));
    };
    check_bridge_metadata(env.registry, params, server_id, tool_name)
        .map_err(|e| (e, Denial::BridgeMismatch))?;
    let grant = read_grant(params).map_err(|e| (e, Denial::GrantMalformed))?;
    Ok(Admitted {
        principal,
        arguments,
        tool,
        server,
        grant,
    })
}

/// Records the refusal `error` (for `denial`) of a request that named no tool (`what` says
/// which request), and returns the error for the client (or the record failure).
pub async fn refuse_session(
    env: &CallEnv<'_>,
    caller: &Caller<'_>,
    what: &str,
    error: RpcError,
    denial: Denial,
) -> RpcError {
    let facts = ToolCallFacts {
        server: ServerInfo::mcp("(none)", None),
        tool_name: what.to_string(),
        projection: Projection::unknown_tool(),
        verdict: Verdict::refused(denial),
        credential_alias: None,
        correlation: Correlation::none(),
        context: FlowContext {
            principal: caller.pinned.map(ToString::to_string),
            session: Some(caller.session.to_string()),
            peer: caller.peer,
            ..FlowContext::default()
        },
    };
    match env.recorder.record(EventKind::Session, facts).await {
        Ok(()) => error,
        Err(record_failure) => record_failure,
    }
}

fn refusal_error(refused: &CallRefusal) -> RpcError {
    let code = match refused {
        CallRefusal::AccessDenied { .. } | CallRefusal::ApprovalRequired { .. } => {
            code::ACCESS_DENIED
        }
        CallRefusal::SchemaInvalid { .. } => code::INVALID_PARAMS,
        CallRefusal::Flow { .. } | CallRefusal::Grant { .. } => code::FLOW_DENIED,
        CallRefusal::State(_) | CallRefusal::StateWhileSpending(_) => code::INTERNAL_ERROR,
    };
    refusal(code, refused.to_string(), refused.denial())
}

/// Checks the bridge security metadata a call carries (if any) against the live registry
/// entry for the tool it calls: a stale digest, another flow, another tool or a malformed
/// value refuses the call.
fn check_bridge_metadata(
    registry: &VerifiedRegistry,
    params: &Value,
    server_id: &str,
    tool_name: &str,
) -> Result<(), RpcError> {
    let Some(carried) = params.get("_meta").and_then(|m| m.get(BRIDGE_META_KEY)) else {
        return Ok(());
    };
    let refuse = |why: String| {
        refusal(
            code::INVALID_PARAMS,
            format!("the call's bridge security metadata is refused: {why}"),
            Denial::BridgeMismatch,
        )
    };
    let metadata: crate::registry::BridgeSecurityMetadata =
        serde_json::from_value(carried.clone()).map_err(|e| refuse(e.to_string()))?;
    registry
        .validate_bridge_security(server_id, tool_name, &metadata)
        .map_err(|e| refuse(e.to_string()))
}

/// The declassification grant a call carries, if any (a malformed one refuses the call).
fn read_grant(params: &Value) -> Result<Option<SignedGrant>, RpcError> {
    let Some(v) = params.get("_meta").and_then(|m| m.get(GRANT_META_KEY)) else {
        return Ok(None);
    };
    SignedGrant::from_value(v).map(Some).map_err(|e| {
        refusal(
            code::INVALID_PARAMS,
            format!("the call's grant is refused: {e}"),
            Denial::GrantMalformed,
        )
    })
}

/// `text` cut to at most `max` bytes on a character boundary, marked when cut.
fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// The record form of a session's flow state.
pub fn labels_after(state: &FlowState) -> LabelsAfter {
    LabelsAfter {
        principal: state.principal.clone(),
        session: state.session.clone(),
    }
}

fn tool_error(text: &str) -> Value {
    json!({"content": [{"type": "text", "text": text}], "isError": true})
}

pub mod content;

#[cfg(test)]
mod tests;
