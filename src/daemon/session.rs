//! One MCP connection = one session: newline-delimited JSON-RPC 2.0 on the host's Unix
//! socket. The caller's principal comes from `SO_PEERCRED`, never from the messages.
//!
//! Requests of a session are handled one at a time, in order: an executor serves one call
//! at a time, which makes every egress attempt attributable to exactly one call.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use super::refusals::Admit;
use super::{CallInFlight, Generation, Host, McpExecutor, ServerRuntime};
use crate::config::PrincipalConfig;
use crate::grant::SignedGrant;
use crate::mcp::{self, Incoming, Line, RpcError, code};
use crate::records::GrantFacts;
use crate::records::{
    Classification, DecisionRecord, DenialKind, EgressBasis, EventKind, FlowContext, LabelsAfter,
    PeerIdentity, Projection, ServerInfo, ToolCallFacts, Verdict, correlation_from_params,
    project_tool_call,
};
use crate::resolver::{CallPlan, CallRefusal, GrantOffer};
use crate::state::{FlowState, SessionKey};

struct Bound {
    generation: u64,
    exec: McpExecutor<CallInFlight>,
}

struct Session {
    host: Arc<Host>,
    id: String,
    uid: u32,
    gid: u32,
    initialized: bool,
    /// The peer was refused at `initialize`: the connection closes once that is answered.
    refused: bool,
    /// The principal the connection was mapped to at `initialize`. A reload that maps the
    /// same peer to another principal does not move the session (and its label) over.
    pinned: Option<crate::ident::PrincipalId>,
    bound: HashMap<String, Bound>,
}

/// How long a reply may take to reach the client; a client that stops reading is
/// disconnected rather than holding the session (and its executors) forever.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

fn random_id() -> String {
    use rand_core::RngCore;
    let mut bytes = [0u8; 16];
    rand_core::OsRng.fill_bytes(&mut bytes);
    hex::encode(bytes)
}

/// Serves one admitted connection of peer `uid`/`gid` until it closes, goes idle past the
/// configured windows, is refused at `initialize`, or the host stops. The slot is held (and
/// counted) for as long as the connection is served.
pub(super) async fn serve(
    host: Arc<Host>,
    stream: UnixStream,
    _slot: super::admission::Slot,
    uid: u32,
    gid: u32,
) {
    let limit = host.current().config.max_message_bytes;
    let (read, mut write) = stream.into_split();
    // Reading happens in its own task: a line read is not cancellation-safe, and the session
    // loop must also wake for idle reaping and shutdown.
    let (tx, mut lines) = mpsc::channel::<Line>(16);
    let reader = tokio::spawn(async move {
        let mut reader = BufReader::new(read);
        loop {
            let line = mcp::read_line(&mut reader, limit)
                .await
                .unwrap_or(Line::Eof);
            let eof = line == Line::Eof;
            if tx.send(line).await.is_err() || eof {
                break;
            }
        }
    });
    let mut session = Session {
        id: random_id(),
        uid,
        gid,
        initialized: false,
        refused: false,
        pinned: None,
        bound: HashMap::new(),
        host,
    };
    tracing::debug!(session = %session.id, uid = session.uid, "session opened");
    let mut idle = tokio::time::interval(Duration::from_secs(5));
    let opened = tokio::time::Instant::now();
    let mut last_request = opened;
    loop {
        if session.host.stopping() || session.refused {
            break;
        }
        // Before initialize a connection gets a short window; after it, a session that
        // sends nothing for the configured time is closed, so idle peers cannot hold slots.
        let deadline = {
            let config = &session.host.current().config;
            if session.initialized {
                last_request + config.session_idle_timeout
            } else {
                opened + config.initialize_timeout
            }
        };
        let line = tokio::select! {
            l = lines.recv() => l.unwrap_or(Line::Eof),
            _ = idle.tick() => { session.reap_idle().await; continue; }
            _ = tokio::time::sleep_until(deadline) => {
                tracing::debug!(
                    session = %session.id,
                    initialized = session.initialized,
                    "no request within the configured window; closing the session"
                );
                break;
            }
            _ = session.host.stopped() => break,
        };
        let reply = match line {
            Line::Eof => break,
            Line::TooLarge(n) => Some(mcp::error_response(
                &Value::Null,
                &RpcError::new(
                    code::INVALID_REQUEST,
                    format!("message of {n} bytes exceeds the limit of {limit} bytes"),
                ),
            )),
            Line::Message(bytes) => session.handle(&bytes).await,
        };
        if let Some(reply) = reply {
            let mut out = reply.into_bytes();
            out.push(b'\n');
            match tokio::time::timeout(CLIENT_WRITE_TIMEOUT, write.write_all(&out)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => break,
                Err(_) => {
                    tracing::warn!(session = %session.id, "the client stopped reading; closing the session");
                    break;
                }
            }
        }
        // A long call is activity too: the idle window starts after its reply.
        last_request = tokio::time::Instant::now();
    }
    reader.abort();
    for (_, b) in session.bound.drain() {
        b.exec.stop().await;
    }
    if let Some(principal) = session.pinned.clone() {
        let key = SessionKey {
            principal,
            session: session.id.clone(),
        };
        // Compaction: the ended session's label already lives in its principal's.
        if let Err(e) = session.host.resolver.state().forget_session(&key).await {
            tracing::error!(session = %session.id, error = %e, "cannot drop the ended session's label; the flow state refuses further use");
        }
    }
    tracing::debug!(session = %session.id, "session closed");
}

impl Session {
    fn principal(&self, generation: &Generation) -> Result<PrincipalConfig, RpcError> {
        let principal = generation
            .config
            .principal_for(self.uid, self.gid)
            .cloned()
            .ok_or_else(|| {
                RpcError::new(
                    code::ACCESS_DENIED,
                    format!(
                        "uid {} / gid {} is not a configured principal of this host",
                        self.uid, self.gid
                    ),
                )
                .with_data(json!({"denial": DenialKind::ACCESS_DENIED}))
            })?;
        match &self.pinned {
            Some(pinned) if *pinned != principal.id => Err(RpcError::new(
                code::ACCESS_DENIED,
                format!(
                    "this session belongs to principal {pinned}, but a reload now maps uid {} \
                     to {}; reconnect to act as {}",
                    self.uid, principal.id, principal.id
                ),
            )
            .with_data(json!({"denial": DenialKind::ACCESS_DENIED}))),
            _ => Ok(principal),
        }
    }

    async fn handle(&mut self, bytes: &[u8]) -> Option<String> {
        let (id, method, params) = match mcp::parse(bytes) {
            Err((id, e)) => return Some(mcp::error_response(&id, &e)),
            Ok(Incoming::Notification { .. }) | Ok(Incoming::Response { .. }) => return None,
            Ok(Incoming::Request { id, method, params }) => (id, method, params),
        };
        let result = match method.as_str() {
            "initialize" => match self.initialize() {
                Err(e) => Err(self.refuse_session("(initialize)", e).await),
                ok => ok,
            },
            "ping" => Ok(json!({})),
            "tools/list" | "tools/call" | "flowhost/health" | "flowhost/session"
                if !self.initialized =>
            {
                let e = RpcError::new(
                    code::NOT_INITIALIZED,
                    "send initialize before other requests",
                )
                .with_data(json!({"denial": DenialKind::NOT_INITIALIZED}));
                Err(self.refuse_session(&format!("({method})"), e).await)
            }
            "tools/list" => match self.list() {
                Err(e) => Err(self.refuse_session("(tools/list)", e).await),
                ok => ok,
            },
            "tools/call" => self.call(params).await,
            "flowhost/session" => match self.describe().await {
                Err(e) => Err(self.refuse_session("(flowhost/session)", e).await),
                ok => ok,
            },
            "flowhost/health" => match self.health(&params) {
                Err(e) => Err(self.refuse_session("(flowhost/health)", e).await),
                ok => ok,
            },
            other => Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                format!("method {other:?} is not served"),
            )),
        };
        Some(match result {
            Ok(v) => mcp::response(&id, v),
            Err(e) => mcp::error_response(&id, &e),
        })
    }

    fn initialize(&mut self) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let principal = self
            .principal(&generation)
            .inspect_err(|_| self.refused = true)?;
        self.initialized = true;
        self.pinned = Some(principal.id.clone());
        Ok(json!({
            "protocolVersion": mcp::PROTOCOL_VERSION,
            "capabilities": {"tools": {"listChanged": false}},
            "serverInfo": {"name": "flowhost", "version": env!("CARGO_PKG_VERSION")},
            "instructions": format!("Governed tools for principal {}; every call and egress is decided and recorded.", principal.id),
        }))
    }

    fn list(&self) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let principal = self.principal(&generation)?;
        let tools: Vec<Value> = generation
            .registry
            .tools()
            .filter(|t| principal.may_call(t.server_id(), t.name()))
            .map(|t| {
                let a = t.definition().annotations();
                let bridge = generation
                    .registry
                    .bridge_security(t.server_id(), t.name())
                    .and_then(|b| serde_json::to_value(b).ok());
                json!({
                    "name": format!("{}/{}", t.server_id(), t.name()),
                    "description": t.sanitized_description(),
                    "inputSchema": t.definition().input_schema(),
                    "_meta": { BRIDGE_META_KEY: bridge },
                    "annotations": {
                        "readOnlyHint": a.read_only,
                        "destructiveHint": a.destructive,
                        "idempotentHint": a.idempotent,
                    },
                })
            })
            .collect();
        Ok(json!({ "tools": tools }))
    }

    /// `flowhost/session`: what a declassification authority binds a grant to (the session
    /// id and the session's current label with its hash).
    async fn describe(&self) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let principal = self.principal(&generation)?;
        let key = SessionKey {
            principal: principal.id.clone(),
            session: self.id.clone(),
        };
        let label = self
            .host
            .resolver
            .state()
            .get(&key)
            .await
            .map_err(|e| {
                RpcError::new(code::INTERNAL_ERROR, format!("flow state unavailable: {e}"))
                    .with_data(json!({"denial": DenialKind::STATE_FAILURE}))
            })?
            .combined();
        Ok(json!({
            "principal": principal.id.to_string(),
            "session": self.id,
            "label": serde_json::to_value(&label).unwrap_or(Value::Null),
            "label_hash": crate::grant::label_hash(&label),
        }))
    }

    fn health(&self, params: &Value) -> Result<Value, RpcError> {
        let generation = self.host.current();
        self.principal(&generation)?;
        // The computed health is returned even when the file cannot be written: the caller
        // learns both the state of observation and that the file on disk is stale.
        let (h, write_error) = match self.host.write_health() {
            Ok(h) => (h, None),
            Err(e) => {
                tracing::error!(error = %e, "writing the health file failed");
                (self.host.health(), Some(e.to_string()))
            }
        };
        let mut v = match params.get("shape").and_then(Value::as_str) {
            None | Some("flowhost") => serde_json::to_value(&h)
                .map_err(|e| RpcError::new(code::INTERNAL_ERROR, e.to_string()))?,
            Some("assay") => h.to_assay(),
            Some(other) => {
                return Err(RpcError::new(
                    code::INVALID_PARAMS,
                    format!("shape {other:?} is not \"flowhost\" or \"assay\""),
                ));
            }
        };
        if let (Some(e), Some(map)) = (write_error, v.as_object_mut()) {
            map.insert("health_file_error".into(), json!(e));
        }
        Ok(v)
    }

    /// Records a decision durably (`build` makes the record from the facts: a tool call, its
    /// outcome, or a session-level refusal). An error means the decision must not take effect
    /// (fail closed).
    async fn record(&self, event: EventKind, facts: ToolCallFacts) -> Result<(), RpcError> {
        if facts.verdict.effect == crate::records::Effect::Deny
            && self.host.refusals.admit(event, &facts) == Admit::Folded
        {
            return Ok(());
        }
        let record = DecisionRecord::from_call_facts(facts, event);
        let is_call = event == EventKind::ToolCall;
        self.host.records.commit(record).await.map_err(|e| {
            tracing::error!(error = %e, "decision record not written; refusing");
            RpcError::new(
                code::INTERNAL_ERROR,
                "the decision record could not be written, so the host refuses the call",
            )
            .with_data(json!({"denial": DenialKind::RECORD_FAILURE}))
        })?;
        if is_call {
            self.host.counters.tool_calls.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Records the refusal `error` of a request that named no tool (`what` says which
    /// request), and returns the error for the client (or the record failure).
    async fn refuse_session(&self, what: &str, error: RpcError) -> RpcError {
        let denial = error
            .data_denial()
            .filter(|d| crate::records::is_code(d))
            .unwrap_or(DenialKind::INVALID_REQUEST)
            .to_string();
        let facts = ToolCallFacts {
            server: ServerInfo::mcp("(none)", None),
            tool_name: what.to_string(),
            projection: Projection::unknown_tool(),
            verdict: Verdict::deny(Some(&denial)),
            credential_alias: None,
            correlation: crate::records::Correlation::none(),
            context: FlowContext {
                principal: self.pinned.as_ref().map(ToString::to_string),
                session: Some(self.id.clone()),
                denial_kind: DenialKind::new(&denial).ok(),
                peer: Some(PeerIdentity {
                    uid: self.uid,
                    gid: self.gid,
                }),
                ..FlowContext::default()
            },
        };
        match self.record(EventKind::Session, facts).await {
            Ok(()) => error,
            Err(record_failure) => record_failure,
        }
    }

    async fn call(&mut self, params: Value) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let Some(name) = params
            .get("name")
            .and_then(Value::as_str)
            .map(str::to_string)
        else {
            let e = RpcError::new(code::INVALID_PARAMS, "tools/call needs a string \"name\"")
                .with_data(json!({"denial": DenialKind::INVALID_PARAMS}));
            return Err(self.refuse_session("(tools/call)", e).await);
        };
        let correlation = correlation_from_params(&params);
        let call_id = random_id();
        let (server_id, tool_name) = name.split_once('/').unwrap_or(("", name.as_str()));
        let tool = generation.registry.tool(server_id, tool_name);
        let server = generation.servers.get(server_id);
        let server_info = match (tool, server) {
            (Some(_), Some(server)) => ServerInfo::mcp(server_id, Some(&server.digest)),
            _ => ServerInfo::mcp(
                if server_id.is_empty() {
                    "(none)"
                } else {
                    server_id
                },
                None,
            ),
        };
        let pinned = self.pinned.as_ref().map(ToString::to_string);
        let session_id = self.id.clone();
        let context = |denial: Option<&str>| FlowContext {
            principal: pinned.clone(),
            session: Some(session_id.clone()),
            call_id: Some(call_id.clone()),
            denial_kind: denial.and_then(|d| DenialKind::new(d).ok()),
            ..FlowContext::default()
        };
        let refusal = |e: RpcError| {
            let denial = e
                .data_denial()
                .unwrap_or(DenialKind::INVALID_PARAMS)
                .to_string();
            Box::new((e, denial))
        };
        // Everything that can refuse before the resolver runs, each refusal recorded.
        let checked = (|| {
            let principal = self.principal(&generation).map_err(refusal)?;
            let arguments = match params.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(v @ Value::Object(_)) => v.clone(),
                Some(_) => {
                    return Err(refusal(
                        RpcError::new(code::INVALID_PARAMS, "\"arguments\" must be an object")
                            .with_data(json!({"denial": DenialKind::INVALID_PARAMS})),
                    ));
                }
            };
            let (Some(tool), Some(server)) = (tool, server) else {
                return Err(refusal(
                    RpcError::new(
                        code::INVALID_PARAMS,
                        format!("unknown tool {name:?} (tools are named server/tool)"),
                    )
                    .with_data(json!({"denial": DenialKind::UNKNOWN_TOOL})),
                ));
            };
            check_bridge_metadata(&generation, &params, server_id, tool_name).map_err(refusal)?;
            let grant = read_grant(&params).map_err(refusal)?;
            Ok((principal, arguments, tool, server, grant))
        })();
        let (principal, arguments, tool, server, grant) = match checked {
            Ok(v) => v,
            Err(refused) => {
                let (e, denial) = *refused;
                // A name that names no registered tool is the caller's text: it is kept
                // short in the record (a flood of long names must not fill the disk).
                let recorded_name = if tool.is_some() && server.is_some() {
                    name.clone()
                } else {
                    bounded(&name, MAX_UNKNOWN_NAME_BYTES)
                };
                if denial == DenialKind::UNKNOWN_TOOL {
                    self.host
                        .counters
                        .unknown_tools
                        .fetch_add(1, Ordering::SeqCst);
                }
                self.record(
                    EventKind::ToolCall,
                    ToolCallFacts {
                        server: server_info,
                        tool_name: recorded_name,
                        projection: Projection::unknown_tool(),
                        verdict: Verdict::deny(Some(&denial)),
                        credential_alias: None,
                        correlation,
                        context: context(Some(&denial)),
                    },
                )
                .await?;
                return Err(e);
            }
        };
        let key = SessionKey {
            principal: principal.id.clone(),
            session: self.id.clone(),
        };
        let projection = project_tool_call(server.mappings.get(tool_name), &arguments);
        if projection.classification == Classification::ObservedUnknownTool {
            self.host
                .counters
                .unknown_tools
                .fetch_add(1, Ordering::SeqCst);
        }

        let offer = grant.as_ref().map(|g| GrantOffer {
            grant: g,
            authorities: &generation.config.authorities,
            now: unix_now(),
        });
        let plan = match self
            .host
            .resolver
            .pre_dispatch(&principal, &key, tool, &arguments, offer)
            .await
        {
            Ok(plan) => plan,
            Err(refusal) => {
                let code_str = refusal.denial_code();
                let verdict = match refusal {
                    CallRefusal::State(_) => Verdict::error(code_str),
                    _ => Verdict::deny(Some(code_str)),
                };
                let grant_facts = grant.as_ref().map(|g| GrantFacts {
                    id: g.body().grant_id.clone(),
                    purpose: g.body().purpose.to_string(),
                });
                self.record(
                    EventKind::ToolCall,
                    ToolCallFacts {
                        server: server_info,
                        tool_name: name.clone(),
                        projection,
                        verdict,
                        credential_alias: None,
                        correlation,
                        context: FlowContext {
                            grant: grant_facts,
                            ..context(Some(code_str))
                        },
                    },
                )
                .await?;
                return Err(refusal_error(&refusal));
            }
        };
        let mut ctx = context(None);
        ctx.source_label = Some(plan.source.clone());
        ctx.clearance_used = plan.basis.any().then(|| plan.clearances.clone());
        ctx.egress_basis = plan.basis.any().then_some(EgressBasis {
            declared: plan.basis.declared,
            topology: plan.basis.topology,
            observed: false,
        });
        ctx.labels_after = Some(labels_after(&plan.state_after_dispatch));
        ctx.grant = plan.grant.as_ref().map(|g| GrantFacts {
            id: g.id.clone(),
            purpose: g.purpose.to_string(),
        });
        self.record(
            EventKind::ToolCall,
            ToolCallFacts {
                server: server_info.clone(),
                tool_name: name.clone(),
                projection: projection.clone(),
                verdict: Verdict::allow_before_effect(None),
                credential_alias: None,
                correlation: correlation.clone(),
                context: ctx,
            },
        )
        .await?;

        // From here on the call was allowed: what becomes of it is recorded as its outcome,
        // with the labels it leaves behind, before anything reaches the client.
        let outcome = |verdict: Verdict, state: &FlowState| ToolCallFacts {
            server: server_info.clone(),
            tool_name: name.clone(),
            projection: projection.clone(),
            verdict,
            credential_alias: None,
            correlation: correlation.clone(),
            context: FlowContext {
                labels_after: Some(labels_after(state)),
                ..context(None)
            },
        };
        let config = &generation.config;
        let mut bound = match self.executor_for(&generation, server, &plan).await {
            Ok(b) => b,
            Err(e) => {
                self.record(
                    EventKind::ToolOutcome,
                    outcome(
                        Verdict::error(DenialKind::EXECUTOR_FAILED),
                        &plan.state_after_dispatch,
                    ),
                )
                .await?;
                return Ok(tool_error(&format!(
                    "the executor could not be started: {e}"
                )));
            }
        };
        let call = Arc::new(CallInFlight {
            plan: plan.clone(),
            call_id: call_id.clone(),
            tool: name.clone(),
            correlation: correlation.clone(),
            approved_under: bound.exec.approved_under(),
            executor_pid: bound.exec.pid(),
        });
        let result = bound
            .exec
            .call(
                call,
                tool_name,
                arguments,
                config.call_timeout,
                config.max_message_bytes,
            )
            .await;
        let (result, verdict, text) = match result {
            Ok(result) => {
                let text = crate::resolver::classifiable_text(&result);
                let verdict = if result.get("isError") == Some(&Value::Bool(true)) {
                    Verdict::error("tool_error")
                } else {
                    Verdict::success(None)
                };
                self.bound.insert(server_id.to_string(), bound);
                (result, verdict, text)
            }
            Err(e) => {
                tracing::warn!(session = %self.id, tool = %name, error = %e, "executor failed; it is retired");
                bound.exec.stop().await;
                // The executor ran with the call's inputs, and its error text (a JSON-RPC
                // error message, a protocol complaint quoting its output) can carry what it
                // read: it reaches the client only under the same rule as a result.
                let text = format!("the tool's executor failed: {e}");
                (
                    tool_error(&text),
                    Verdict::error(DenialKind::EXECUTOR_FAILED),
                    text,
                )
            }
        };
        let state = self.host.resolver.after_call(&plan, &text).await;
        let state = match state {
            Ok(state) => state,
            Err(e) => {
                // The output is withheld; that is the call's outcome, and it is recorded
                // with the last labels known to be stored.
                self.record(
                    EventKind::ToolOutcome,
                    outcome(
                        Verdict::error(DenialKind::STATE_FAILURE),
                        &plan.state_after_dispatch,
                    ),
                )
                .await?;
                return Err(RpcError::new(
                    code::INTERNAL_ERROR,
                    format!("the output's label could not be stored, so it is withheld: {e}"),
                )
                .with_data(json!({"denial": DenialKind::STATE_FAILURE})));
            }
        };
        self.record(EventKind::ToolOutcome, outcome(verdict, &state))
            .await?;
        Ok(result)
    }

    /// The executor bound to this session for `server`: the existing one if it belongs to
    /// the current generation, is alive, and is fit for the call's label; otherwise a fresh
    /// one from the warm pool.
    async fn executor_for(
        &mut self,
        generation: &Generation,
        server: &ServerRuntime,
        plan: &CallPlan,
    ) -> Result<Bound, super::ExecutorError> {
        if let Some(mut b) = self.bound.remove(&server.id) {
            if b.generation == generation.id && b.exec.alive() && b.exec.fit_for(&plan.source) {
                return Ok(b);
            }
            b.exec.stop().await;
        }
        Ok(Bound {
            generation: generation.id,
            exec: server.pool.acquire().await?,
        })
    }

    async fn reap_idle(&mut self) {
        let limit = self.host.current().config.idle_timeout;
        let idle: Vec<String> = self
            .bound
            .iter()
            .filter(|(_, b)| b.exec.idle_for() > limit)
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            if let Some(b) = self.bound.remove(&k) {
                b.exec.stop().await;
            }
        }
    }
}

fn refusal_error(refusal: &CallRefusal) -> RpcError {
    let code = match refusal {
        CallRefusal::AccessDenied { .. } => code::ACCESS_DENIED,
        CallRefusal::SchemaInvalid { .. } => code::INVALID_PARAMS,
        CallRefusal::Flow { .. } => code::FLOW_DENIED,
        CallRefusal::State(_) => code::INTERNAL_ERROR,
        CallRefusal::Grant { .. } => code::FLOW_DENIED,
    };
    RpcError::new(code, refusal.to_string()).with_data(json!({"denial": refusal.denial_code()}))
}

/// Where bridge security metadata travels: `_meta` of a tool in `tools/list`, and
/// `params._meta` of a `tools/call`.
pub const BRIDGE_META_KEY: &str = "flowhost/bridge";

/// Checks the bridge security metadata a call carries (if any) against the live registry
/// entry for the tool it calls: a stale digest, another flow, another tool or a malformed
/// value refuses the call.
fn check_bridge_metadata(
    generation: &Generation,
    params: &Value,
    server_id: &str,
    tool_name: &str,
) -> Result<(), RpcError> {
    let Some(carried) = params.get("_meta").and_then(|m| m.get(BRIDGE_META_KEY)) else {
        return Ok(());
    };
    let refuse = |why: String| {
        RpcError::new(
            code::INVALID_PARAMS,
            format!("the call's bridge security metadata is refused: {why}"),
        )
        .with_data(json!({"denial": DenialKind::BRIDGE_MISMATCH}))
    };
    let metadata: crate::registry::BridgeSecurityMetadata =
        serde_json::from_value(carried.clone()).map_err(|e| refuse(e.to_string()))?;
    generation
        .registry
        .validate_bridge_security(server_id, tool_name, &metadata)
        .map_err(|e| refuse(e.to_string()))
}

/// Where a declassification grant travels with a call: `params._meta`.
pub const GRANT_META_KEY: &str = "flowhost/grant";

/// The declassification grant a call carries, if any (a malformed one refuses the call).
fn read_grant(params: &Value) -> Result<Option<SignedGrant>, RpcError> {
    let Some(v) = params.get("_meta").and_then(|m| m.get(GRANT_META_KEY)) else {
        return Ok(None);
    };
    SignedGrant::from_value(v).map(Some).map_err(|e| {
        RpcError::new(
            code::INVALID_PARAMS,
            format!("the call's grant is refused: {e}"),
        )
        .with_data(json!({"denial": DenialKind::GRANT_MALFORMED}))
    })
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Most bytes of an unregistered tool name kept in a record.
const MAX_UNKNOWN_NAME_BYTES: usize = 128;

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
fn labels_after(state: &FlowState) -> LabelsAfter {
    LabelsAfter {
        principal: state.principal.clone(),
        session: state.session.clone(),
    }
}

fn tool_error(text: &str) -> Value {
    json!({"content": [{"type": "text", "text": text}], "isError": true})
}
