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

use super::{CallInFlight, Generation, Host, McpExecutor, ServerRuntime};
use crate::config::PrincipalConfig;
use crate::mcp::{self, Incoming, Line, RpcError, code};
use crate::records::{
    Classification, DecisionRecord, DenialKind, EgressBasis, FlowContext, Projection, ServerInfo,
    ToolCallFacts, Verdict, correlation_from_params, project_tool_call,
};
use crate::resolver::{CallPlan, CallRefusal};
use crate::state::SessionKey;

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
            })?;
        match &self.pinned {
            Some(pinned) if *pinned != principal.id => Err(RpcError::new(
                code::ACCESS_DENIED,
                format!(
                    "this session belongs to principal {pinned}, but a reload now maps uid {} \
                     to {}; reconnect to act as {}",
                    self.uid, principal.id, principal.id
                ),
            )),
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
            "initialize" => self.initialize(),
            "ping" => Ok(json!({})),
            "tools/list" | "tools/call" | "flowhost/health" if !self.initialized => {
                Err(RpcError::new(
                    code::NOT_INITIALIZED,
                    "send initialize before other requests",
                ))
            }
            "tools/list" => self.list(),
            "tools/call" => self.call(params).await,
            "flowhost/health" => self.health(),
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
                json!({
                    "name": format!("{}/{}", t.server_id(), t.name()),
                    "description": t.sanitized_description(),
                    "inputSchema": t.definition().input_schema(),
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

    fn health(&self) -> Result<Value, RpcError> {
        let generation = self.host.current();
        self.principal(&generation)?;
        let h = self.host.write_health().map_err(|e| {
            RpcError::new(
                code::INTERNAL_ERROR,
                format!("cannot write the health file: {e}"),
            )
        })?;
        serde_json::to_value(&h).map_err(|e| RpcError::new(code::INTERNAL_ERROR, e.to_string()))
    }

    /// Records a tools/call decision durably. An error means the decision must not take
    /// effect (fail closed).
    async fn record(
        &self,
        server: ServerInfo,
        tool_name: String,
        projection: Projection,
        verdict: Verdict,
        correlation: crate::records::Correlation,
        context: FlowContext,
    ) -> Result<(), RpcError> {
        let record = DecisionRecord::tool_call(ToolCallFacts {
            server,
            tool_name,
            projection,
            verdict,
            credential_alias: None,
            correlation,
            context,
        });
        self.host
            .records
            .commit(record)
            .await
            .map(drop)
            .map_err(|e| {
                tracing::error!(error = %e, "decision record not written; refusing");
                RpcError::new(
                    code::INTERNAL_ERROR,
                    "the decision record could not be written, so the host refuses the call",
                )
                .with_data(json!({"denial": DenialKind::RECORD_FAILURE}))
            })
    }

    async fn call(&mut self, params: Value) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let principal = self.principal(&generation)?;
        let name = params
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                RpcError::new(code::INVALID_PARAMS, "tools/call needs a string \"name\"")
            })?
            .to_string();
        let arguments = match params.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(RpcError::new(
                    code::INVALID_PARAMS,
                    "\"arguments\" must be an object",
                ));
            }
        };
        let correlation = correlation_from_params(&params);
        let call_id = random_id();
        self.host.counters.tool_calls.fetch_add(1, Ordering::SeqCst);
        let key = SessionKey {
            principal: principal.id.clone(),
            session: self.id.clone(),
        };
        let context = |denial: Option<&str>| FlowContext {
            principal: Some(principal.id.to_string()),
            session: Some(self.id.clone()),
            call_id: Some(call_id.clone()),
            denial_kind: denial.and_then(|d| DenialKind::new(d).ok()),
            ..FlowContext::default()
        };

        let (server_id, tool_name) = name.split_once('/').unwrap_or(("", name.as_str()));
        let tool = generation.registry.tool(server_id, tool_name);
        let (Some(tool), Some(server)) = (tool, generation.servers.get(server_id)) else {
            self.host
                .counters
                .unknown_tools
                .fetch_add(1, Ordering::SeqCst);
            self.record(
                ServerInfo::mcp(
                    if server_id.is_empty() {
                        "(none)"
                    } else {
                        server_id
                    },
                    None,
                ),
                name.clone(),
                Projection::unknown_tool(),
                Verdict::deny(Some(DenialKind::UNKNOWN_TOOL)),
                correlation,
                context(Some(DenialKind::UNKNOWN_TOOL)),
            )
            .await?;
            return Err(RpcError::new(
                code::INVALID_PARAMS,
                format!("unknown tool {name:?} (tools are named server/tool)"),
            ));
        };
        let server_info = ServerInfo::mcp(server_id, Some(&server.digest));
        let projection = project_tool_call(server.mappings.get(tool_name), &arguments);
        if projection.classification == Classification::ObservedUnknownTool {
            self.host
                .counters
                .unknown_tools
                .fetch_add(1, Ordering::SeqCst);
        }

        let plan = match self
            .host
            .resolver
            .pre_dispatch(&principal, &key, tool, &arguments)
        {
            Ok(plan) => plan,
            Err(refusal) => {
                let code_str = refusal.denial_code();
                let verdict = match refusal {
                    CallRefusal::State(_) => Verdict::error(code_str),
                    _ => Verdict::deny(Some(code_str)),
                };
                self.record(
                    server_info,
                    name.clone(),
                    projection,
                    verdict,
                    correlation,
                    context(Some(code_str)),
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
        self.record(
            server_info,
            name.clone(),
            projection,
            Verdict::allow_before_effect(None),
            correlation.clone(),
            ctx,
        )
        .await?;

        let config = &generation.config;
        let mut bound = match self.executor_for(&generation, server, &plan).await {
            Ok(b) => b,
            Err(e) => {
                return Ok(tool_error(&format!(
                    "the executor could not be started: {e}"
                )));
            }
        };
        let call = Arc::new(CallInFlight {
            plan: plan.clone(),
            call_id,
            tool: name.clone(),
            correlation,
            approved_under: bound.exec.approved_under(),
        });
        let outcome = bound
            .exec
            .call(
                call,
                tool_name,
                arguments,
                config.call_timeout,
                config.max_message_bytes,
            )
            .await;
        match outcome {
            Ok(result) => {
                let text = crate::resolver::classifiable_text(&result);
                self.host.resolver.after_call(&plan, &text).map_err(|e| {
                    RpcError::new(
                        code::INTERNAL_ERROR,
                        format!("the output's label could not be stored, so it is withheld: {e}"),
                    )
                })?;
                self.bound.insert(server_id.to_string(), bound);
                Ok(result)
            }
            Err(e) => {
                tracing::warn!(session = %self.id, tool = %name, error = %e, "executor failed; it is retired");
                bound.exec.stop().await;
                // The executor ran with the call's inputs, and its error text (a JSON-RPC
                // error message, a protocol complaint quoting its output) can carry what it
                // read: it reaches the client only under the same rule as a result.
                let text = format!("the tool's executor failed: {e}");
                self.host.resolver.after_call(&plan, &text).map_err(|e| {
                    RpcError::new(
                        code::INTERNAL_ERROR,
                        format!("the executor failed, and the label of what it said could not be stored, so it is withheld: {e}"),
                    )
                })?;
                Ok(tool_error(&text))
            }
        }
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
    };
    RpcError::new(code, refusal.to_string()).with_data(json!({"denial": refusal.denial_code()}))
}

fn tool_error(text: &str) -> Value {
    json!({"content": [{"type": "text", "text": text}], "isError": true})
}
