//! One MCP connection = one session: newline-delimited JSON-RPC 2.0 on the host's Unix
//! socket, or one Streamable HTTP session. The caller's principal comes from `SO_PEERCRED`
//! or from the HTTP transport's authentication, never from the messages.
//!
//! Requests of a session are handled one at a time, in order: an executor serves one call
//! at a time, which makes every egress attempt attributable to exactly one call.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use super::pipeline::{
    self, BRIDGE_META_KEY, CallEnv, Caller, Dispatch, DispatchError, Recorder, refusal,
};
use super::{CallInFlight, Generation, Host, McpExecutor};
use crate::config::PrincipalConfig;
use crate::decision::Denial;
use crate::ident::PrincipalId;
use crate::mcp::{self, Incoming, Line, RpcError, code};
use crate::records::PeerIdentity;
use crate::state::SessionKey;

struct Bound {
    generation: u64,
    exec: McpExecutor<CallInFlight>,
}

/// Where a session is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
enum SessionState {
    /// Connected; `initialize` not yet answered.
    Opened,
    /// Mapped to this principal at `initialize`. A reload that maps the same peer to another
    /// principal does not move the session (and its label) over.
    Initialized(PrincipalId),
    /// Refused at `initialize`: the connection closes once that is answered.
    Refused,
}

/// Who a session acts for, as its transport authenticated it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A Unix socket peer (`SO_PEERCRED`), mapped to a principal by uid and gid.
    Peer {
        /// The peer's uid.
        uid: u32,
        /// The peer's gid.
        gid: u32,
    },
    /// A remote caller the HTTP transport authenticated as this configured principal.
    Principal(PrincipalId),
}

impl Identity {
    /// The principal this identity maps to in `config`, if any.
    pub fn principal<'c>(
        &self,
        config: &'c crate::config::HostConfig,
    ) -> Option<&'c PrincipalConfig> {
        match self {
            Identity::Peer { uid, gid } => config.principal_for(*uid, *gid),
            Identity::Principal(id) => config.principals.iter().find(|p| p.id == *id),
        }
    }

    fn peer(&self) -> Option<PeerIdentity> {
        match self {
            Identity::Peer { uid, gid } => Some(PeerIdentity {
                uid: *uid,
                gid: *gid,
            }),
            Identity::Principal(_) => None,
        }
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Peer { uid, gid } => write!(f, "uid {uid} / gid {gid}"),
            Identity::Principal(id) => write!(f, "remote principal {id}"),
        }
    }
}

struct Session {
    host: Arc<Host>,
    id: String,
    identity: Identity,
    state: SessionState,
    bound: HashMap<String, Bound>,
}

/// How long a reply may take to reach the client; a client that stops reading is
/// disconnected rather than holding the session (and its executors) forever.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

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
    let (tx, lines) = mpsc::channel::<Line>(16);
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
    let (out, mut replies) = mpsc::channel::<String>(16);
    let writer = async move {
        while let Some(reply) = replies.recv().await {
            let mut bytes = reply.into_bytes();
            bytes.push(b'\n');
            match tokio::time::timeout(CLIENT_WRITE_TIMEOUT, write.write_all(&bytes)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => break,
                Err(_) => {
                    tracing::warn!("the client stopped reading; closing the session");
                    break;
                }
            }
        }
    };
    let id = super::random_id();
    tokio::join!(
        run(host, id, Identity::Peer { uid, gid }, lines, out),
        writer
    );
    reader.abort();
}

/// Serves one session of `identity`, whatever its transport: messages arrive on `lines`,
/// replies leave on `out`, in order. It ends when `lines` ends (or `out` closes), the
/// session goes idle past the configured windows, is refused at `initialize`, or the host
/// stops.
pub(crate) async fn run(
    host: Arc<Host>,
    id: String,
    identity: Identity,
    mut lines: mpsc::Receiver<Line>,
    out: mpsc::Sender<String>,
) {
    let limit = host.current().config.max_message_bytes;
    let mut session = Session {
        id,
        identity,
        state: SessionState::Opened,
        bound: HashMap::new(),
        host,
    };
    tracing::debug!(session = %session.id, identity = %session.identity, "session opened");
    let mut idle = tokio::time::interval(Duration::from_secs(5));
    let opened = tokio::time::Instant::now();
    let mut last_request = opened;
    loop {
        if session.host.stopping() || session.state == SessionState::Refused {
            break;
        }
        // Before initialize a connection gets a short window; after it, a session that
        // sends nothing for the configured time is closed, so idle peers cannot hold slots.
        let deadline = {
            let config = &session.host.current().config;
            if matches!(session.state, SessionState::Initialized(_)) {
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
                    state = ?session.state,
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
        if let Some(reply) = reply
            && out.send(reply).await.is_err()
        {
            break;
        }
        // A long call is activity too: the idle window starts after its reply.
        last_request = tokio::time::Instant::now();
    }
    drop(out);
    for (_, b) in session.bound.drain() {
        b.exec.stop().await;
    }
    if let SessionState::Initialized(principal) = session.state.clone() {
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
        let principal = self
            .identity
            .principal(&generation.config)
            .cloned()
            .ok_or_else(|| {
                RpcError::new(
                    code::ACCESS_DENIED,
                    format!(
                        "{} is not a configured principal of this host",
                        self.identity
                    ),
                )
                .with_data(json!({"denial": Denial::AccessDenied.as_str()}))
            })?;
        match self.pinned() {
            Some(pinned) if *pinned != principal.id => Err(RpcError::new(
                code::ACCESS_DENIED,
                format!(
                    "this session belongs to principal {pinned}, but a reload now maps {} \
                     to {}; reconnect to act as {}",
                    self.identity, principal.id, principal.id
                ),
            )
            .with_data(json!({"denial": Denial::AccessDenied.as_str()}))),
            _ => Ok(principal),
        }
    }

    /// The principal the session was mapped to at `initialize`.
    fn pinned(&self) -> Option<&PrincipalId> {
        pinned(&self.state)
    }

    fn caller(&self, generation: &Generation) -> Caller<'_> {
        Caller {
            session: &self.id,
            peer: self.identity.peer(),
            principal: self.principal(generation),
            pinned: self.pinned(),
        }
    }

    /// Records the refusal `e` of a request that named no tool, and returns it (or the
    /// record failure).
    async fn refuse_session(&self, what: &str, e: RpcError) -> RpcError {
        let generation = self.host.current();
        let denial = e
            .data_denial()
            .and_then(|d| serde_json::from_value::<Denial>(json!(d)).ok())
            .unwrap_or(Denial::AccessDenied);
        pipeline::refuse_session(
            &env(&self.host, &generation),
            &self.caller(&generation),
            what,
            e,
            denial,
        )
        .await
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
                if self.pinned().is_none() =>
            {
                let e = refusal(
                    code::NOT_INITIALIZED,
                    "send initialize before other requests",
                    Denial::NotInitialized,
                );
                Err(self.refuse_session(&format!("({method})"), e).await)
            }
            "tools/list" => match self.list() {
                Err(e) => Err(self.refuse_session("(tools/list)", e).await),
                ok => ok,
            },
            "tools/call" => self.call(&params).await,
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
            .inspect_err(|_| self.state = SessionState::Refused)?;
        self.state = SessionState::Initialized(principal.id.clone());
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
                    "name": generation.config.public_tool_name(t.server_id(), t.name()),
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
                refusal(
                    code::INTERNAL_ERROR,
                    format!("flow state unavailable: {e}"),
                    Denial::StateFailure,
                )
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

    /// `tools/call`, through the pipeline, with this session's executors.
    async fn call(&mut self, params: &Value) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let host = self.host.clone();
        let caller = Caller {
            session: &self.id,
            peer: self.identity.peer(),
            principal: self.principal(&generation),
            pinned: pinned(&self.state),
        };
        let mut executors = Executors {
            generation: &generation,
            bound: &mut self.bound,
        };
        pipeline::tools_call(&env(&host, &generation), caller, params, &mut executors).await
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

fn pinned(state: &SessionState) -> Option<&PrincipalId> {
    match state {
        SessionState::Initialized(p) => Some(p),
        _ => None,
    }
}

/// The call environment of `generation` on `host`.
pub(super) fn env<'g>(host: &'g Host, generation: &'g Generation) -> CallEnv<'g> {
    CallEnv {
        config: &generation.config,
        registry: &generation.registry,
        servers: &generation.servers,
        resolver: &host.resolver,
        recorder: Recorder {
            records: &host.records,
            counters: &host.counters,
            refusals: &host.refusals,
        },
    }
}

/// A session's executors, one per server, as the pipeline dispatches to them.
struct Executors<'s> {
    generation: &'s Generation,
    bound: &'s mut HashMap<String, Bound>,
}

impl Executors<'_> {
    /// The executor bound to this session for `server`: the existing one if it belongs to
    /// the current generation, is alive, and is fit for the call's label; otherwise a fresh
    /// one from the warm pool.
    async fn executor_for(
        &mut self,
        server: &str,
        source: &crate::label::InformationLabel,
    ) -> Result<Bound, super::ExecutorError> {
        if let Some(mut b) = self.bound.remove(server) {
            if b.generation == self.generation.id && b.exec.alive() && b.exec.fit_for(source) {
                return Ok(b);
            }
            b.exec.stop().await;
        }
        let pool = self
            .generation
            .pools
            .get(server)
            .ok_or(super::ExecutorError::Exited)?;
        Ok(Bound {
            generation: self.generation.id,
            exec: pool.acquire().await?,
        })
    }
}

impl Dispatch for Executors<'_> {
    async fn dispatch(
        &mut self,
        server: &str,
        tool: &str,
        arguments: Value,
        mut call: CallInFlight,
    ) -> Result<Value, DispatchError> {
        let mut bound = self
            .executor_for(server, &call.plan.source)
            .await
            .map_err(|e| DispatchError::NotStarted(e.to_string()))?;
        call.executor_pid = bound.exec.pid();
        let name = call.tool.clone();
        let config = &self.generation.config;
        let outcome = bound
            .exec
            .call(
                Arc::new(call),
                tool,
                arguments,
                config.call_timeout,
                config.max_message_bytes,
            )
            .await;
        match outcome {
            Ok(result) => {
                self.bound.insert(server.to_string(), bound);
                Ok(result)
            }
            Err(e) => {
                tracing::warn!(tool = %name, error = %e, "executor failed; it is retired");
                bound.exec.stop().await;
                Err(DispatchError::Failed(e.to_string()))
            }
        }
    }
}
