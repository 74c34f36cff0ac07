//! One MCP connection = one session: JSON-RPC 2.0 messages in, answers and notifications
//! out. The caller's principal comes from `SO_PEERCRED` (the Unix socket) or from the HTTP
//! transport's authentication, never from the messages.
//!
//! The session does not know its transport: [`run`] takes incoming lines on one channel and
//! sends outgoing lines on another, and [`serve`] is the Unix-socket transport that moves
//! newline-delimited lines between the socket and those channels.
//!
//! Several requests are in flight at once, each in its own task, and answered as they finish
//! (in any order): a ping or a `tools/list` never waits behind a call. Only `initialize` is
//! handled in order, since every other request depends on its outcome. An executor still
//! serves one `tools/call` at a time, which keeps every egress attempt attributable to
//! exactly one call: concurrent calls to one server use more of the session's executors (from
//! the warm pool), up to [`MAX_EXECUTORS_PER_SERVER`], and queue beyond that. No lock is held
//! across a call.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use flowhost_broker::Escaped;
use serde_json::{Value, json};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use super::executor::{CallControl, ExecutorError, ProgressRoute, cancelled};
use super::pipeline::content::ContentMethod;
use super::pipeline::{
    self, BRIDGE_META_KEY, CallEnv, Caller, Dispatch, DispatchError, Recorder, RelayGate, refusal,
};
use super::relay::{CallRelay, ClientCapabilities, PendingRelays};
use super::{CallInFlight, Generation, Host, McpExecutor};
use crate::config::PrincipalConfig;
use crate::decision::Denial;
use crate::ident::PrincipalId;
use crate::mcp::{self, Incoming, Line, RpcError, code};
use crate::records::PeerIdentity;
use crate::state::SessionKey;

/// One message the session sends its client, with the client request it belongs to (a
/// transport with a stream per request carries it on that request's stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// The JSON-RPC message, one line.
    pub line: String,
    /// The id (as JSON text) of the client's request whose serving sent it, if any.
    pub request: Option<String>,
}

/// Where a session's messages go, tagged with the client request being served (if any).
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::Sender<Outgoing>,
    request: Option<String>,
}

impl Outbox {
    /// The outbox of a session's messages that belong to no request, sending on `tx`.
    pub fn new(tx: mpsc::Sender<Outgoing>) -> Outbox {
        Outbox { tx, request: None }
    }

    /// The outbox of the messages sent while serving request `id`.
    fn for_request(&self, id: &Value) -> Outbox {
        Outbox {
            tx: self.tx.clone(),
            request: Some(id.to_string()),
        }
    }

    fn tagged(&self, line: String) -> Outgoing {
        Outgoing {
            line,
            request: self.request.clone(),
        }
    }

    /// Queues `line`, waiting for room; `false` when the client is gone.
    pub async fn send(&self, line: String) -> bool {
        self.tx.send(self.tagged(line)).await.is_ok()
    }

    /// Queues `line` if there is room now; `false` otherwise.
    pub fn try_send(&self, line: String) -> bool {
        self.tx.try_send(self.tagged(line)).is_ok()
    }
}

mod content;
mod subscriptions;
pub use content::LogLevel;
use content::may_watch;
use subscriptions::{IdleExecutor, Subscriptions, idle_to_stop};

/// An executor bound to the session, with the generation it was started in.
struct Bound {
    /// Its place in the principal's share of executors, given back when it is dropped.
    _place: super::budget::ExecutorPlace,
    generation: u64,
    /// The digest of the manifest its server was admitted under when it was started.
    admitted: Option<String>,
    exec: McpExecutor<CallInFlight>,
    /// The `logging/setLevel` level last applied to it (`None`: never set).
    log_level: Option<LogLevel>,
    /// The resources this session subscribed to through it (and has not unsubscribed).
    subscribed: BTreeSet<String>,
}

impl Bound {
    /// Sends `level` to the executor unless it has it already. A server without logging
    /// answers with an error: it sends no logs anyway, so that counts as applied. `Err`: the
    /// executor failed (the caller stops it).
    async fn apply_log_level(
        &mut self,
        level: LogLevel,
        deadline: Duration,
    ) -> Result<(), ExecutorError> {
        if self.log_level == Some(level) {
            return Ok(());
        }
        let params = json!({"level": level.as_str()});
        match self
            .exec
            .forward("logging/setLevel", params, deadline)
            .await
        {
            Ok(_) | Err(ExecutorError::Rpc(_)) => {
                self.log_level = Some(level);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Subscribes the executor to each of `uris` (none of which it holds); returns those it
    /// refused (with an error answer; it keeps serving). `Err`: the executor failed (the
    /// caller stops it).
    async fn subscribe(
        &mut self,
        server: &str,
        uris: BTreeSet<String>,
        deadline: Duration,
    ) -> Result<Vec<String>, ExecutorError> {
        let mut refused = Vec::new();
        for uri in uris {
            let params = json!({ "uri": uri });
            match self
                .exec
                .forward("resources/subscribe", params, deadline)
                .await
            {
                Ok(_) => {
                    tracing::info!(server = %server, pid = self.exec.pid(), uri = %Escaped(&uri), "subscribed a new executor to a resource the session's client watches");
                    self.subscribed.insert(uri);
                }
                Err(ExecutorError::Rpc(e)) => {
                    tracing::warn!(server = %server, uri = %Escaped(&uri), error = %Escaped(&e.message), "the executor refused to renew the session's subscription");
                    refused.push(uri);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(refused)
    }
}

/// Most executors of one server a session runs at once; further calls to that server wait
/// for one of them (calls to other servers, pings and lists do not).
pub const MAX_EXECUTORS_PER_SERVER: usize = 8;

/// Most requests of one session in flight at once; a further request is refused (a client
/// cannot make the host hold unbounded work), while answers and notifications, such as a
/// cancellation, are still read.
pub const MAX_REQUESTS_IN_FLIGHT: usize = 64;

/// How a refusal's record names the client's method: as itself when the host serves it,
/// else `(unserved method)`. A client's method is any string it likes (up to the size of a
/// message), and the records keep only what the host knows.
pub(super) fn named_method(method: &str) -> String {
    if matches!(method, "initialize" | "ping") || SERVED_METHODS.contains(&method) {
        format!("({method})")
    } else {
        "(unserved method)".to_string()
    }
}

/// The methods a session serves once initialized (besides `initialize` and `ping`).
const SERVED_METHODS: &[&str] = &[
    "tools/list",
    "tools/call",
    "flowhost/health",
    "flowhost/session",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "resources/subscribe",
    "resources/unsubscribe",
    "prompts/list",
    "prompts/get",
    "completion/complete",
    "logging/setLevel",
];

/// One server's executors in a session: the idle ones, and the permits that bound how many
/// run at once.
struct ServerExecutors {
    idle: Vec<Bound>,
    permits: Arc<Semaphore>,
}

impl Default for ServerExecutors {
    fn default() -> Self {
        ServerExecutors {
            idle: Vec::new(),
            permits: Arc::new(Semaphore::new(MAX_EXECUTORS_PER_SERVER)),
        }
    }
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

/// A session, shared by the tasks of its requests.
struct Session {
    host: Arc<Host>,
    id: String,
    identity: Identity,
    /// The principal the session was mapped to at `initialize`. A reload that maps the same
    /// peer to another principal does not move the session (and its label) over.
    pinned: OnceLock<PrincipalId>,
    /// The session's executors, by server. Held only to take or return an executor.
    executors: Mutex<HashMap<String, ServerExecutors>>,
    /// The calls in flight that a client may cancel, by request id (its JSON text).
    cancels: Mutex<HashMap<String, watch::Sender<Option<String>>>>,
    /// The client's `logging/setLevel`: sent to an executor only as it is taken for a
    /// request (`Executors::take`), after its fitness for the request's label is checked,
    /// never to idle executors when it is set (a log line is what the executor says, and
    /// must not reach the client outside a request whose label covers it).
    log_level: Mutex<Option<LogLevel>>,
    /// Outgoing lines (answers, notifications, requests relayed from executors).
    out: Outbox,
    /// What the client declared it can do at `initialize`.
    capabilities: OnceLock<ClientCapabilities>,
    /// Requests of executors relayed to the client, awaiting its answers.
    relays: PendingRelays,
    /// The resources the client subscribed to.
    subscriptions: Subscriptions,
}

/// How long a reply may take to reach the client; a client that stops reading is
/// disconnected rather than holding the session (and its executors) forever.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a session ended when the host stops (its calls then finish even if the client is
/// gone).
const HOST_STOPPING: &str = "the host is stopping";
/// Why a session whose peer a reload mapped elsewhere ended.
const REMAPPED: &str = "a reload no longer maps the peer to the session's principal";

/// Lines queued between the transport and the session, each way.
const QUEUED_LINES: usize = 64;

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
    let (in_tx, incoming) = mpsc::channel::<Line>(QUEUED_LINES);
    let (out, mut out_rx) = mpsc::channel::<Outgoing>(QUEUED_LINES);
    let (hung_up, mut hangup) = tokio::sync::oneshot::channel::<()>();
    // Reading happens in its own task: a line read is not cancellation-safe.
    let reader = tokio::spawn(async move {
        let mut read = BufReader::new(read);
        mcp::forward_lines(&mut read, limit, in_tx).await;
        if peer_gone(read.get_ref().as_ref()) {
            let _ = hung_up.send(());
        }
    });
    // The writer ends when the session drops its sender (after the last line), the client
    // stops reading, or the client is gone; the session sees the latter two as its outgoing
    // channel closing, and cancels what is in flight.
    let writer = tokio::spawn(async move {
        // Whether the reader has said whether the client is gone (a oneshot is polled once).
        let mut told = false;
        loop {
            let message = tokio::select! {
                // Messages first: while they flow, the hang-up is not even polled.
                biased;
                message = out_rx.recv() => match message {
                    Some(message) => message,
                    None => return,
                },
                gone = &mut hangup, if !told => {
                    if gone.is_ok() {
                        return;
                    }
                    told = true;
                    continue;
                }
            };
            let mut bytes = message.line.into_bytes();
            bytes.push(b'\n');
            match tokio::time::timeout(CLIENT_WRITE_TIMEOUT, write.write_all(&bytes)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::warn!(uid, "the client stopped reading; closing the session");
                    return;
                }
            }
        }
    });
    // A socket carries every message both ways: nothing it is given goes undelivered.
    run(
        host,
        super::random_id(),
        Identity::Peer { uid, gid },
        incoming,
        out,
        None,
    )
    .await;
    reader.abort();
    let _ = writer.await;
}

/// Whether the peer of `socket`, whose input has ended, closed the connection rather than
/// only its sending side. A client that half-closes still reads its answers; one that
/// closed gets none, and its calls are cancelled rather than run to their deadline.
fn peer_gone(socket: &UnixStream) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsFd;
    // A unix socket reports a hang-up once both directions are shut, which the peer's close
    // does at once (its shutdown of writing alone does not).
    let mut fds = [PollFd::new(socket.as_fd(), PollFlags::empty())];
    poll(&mut fds, PollTimeout::ZERO).is_ok()
        && fds[0]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR))
}

/// A request the session sent its client that the transport could not deliver.
pub struct NotDelivered {
    /// The host's id of the request.
    pub id: Value,
    /// Why, in the transport's words.
    pub why: String,
}

/// Runs a session of `identity`, known in its records as `id`, over any transport:
/// `incoming` delivers the client's
/// lines, `out` takes the session's, and `undelivered` (from a transport that cannot carry
/// every message) names the requests to the client it could not deliver, whose callers are
/// then answered at once. Returns when the client is gone (end of input, or `out` closed),
/// the session is idle past the configured windows, is refused at `initialize`, or the host
/// stops; calls still in flight then finish (their outcomes are recorded) first.
pub(super) async fn run(
    host: Arc<Host>,
    id: String,
    identity: Identity,
    mut incoming: mpsc::Receiver<Line>,
    out: mpsc::Sender<Outgoing>,
    mut undelivered: Option<mpsc::UnboundedReceiver<NotDelivered>>,
) {
    let limit = host.current().config.max_message_bytes;
    let session = Arc::new(Session {
        id,
        identity,
        pinned: OnceLock::new(),
        executors: Mutex::new(HashMap::new()),
        cancels: Mutex::new(HashMap::new()),
        log_level: Mutex::new(None),
        out: Outbox::new(out.clone()),
        capabilities: OnceLock::new(),
        relays: PendingRelays::default(),
        subscriptions: Subscriptions::default(),
        host,
    });
    tracing::info!(session = %session.id, identity = %session.identity, "session opened");
    let mut requests = JoinSet::new();
    let mut refused = false;
    let mut idle = tokio::time::interval(Duration::from_secs(5));
    let opened = tokio::time::Instant::now();
    let mut last_activity = opened;
    let mut ended = "the client closed the connection";
    loop {
        if session.host.stopping() {
            ended = HOST_STOPPING;
            break;
        }
        if refused {
            ended = "refused at initialize";
            break;
        }
        // Looked at before each wait: a line that arrived after a reload has been served
        // (refused and recorded, since the session's principal no longer maps), then the
        // session ends.
        // The serving generation is looked at here and let go before the wait: held across
        // it, a generation a reload replaced would live on with its executors.
        let (remapped, deadline) = {
            let current = session.host.current();
            let config = &current.config;
            // Before initialize a connection gets a short window; after it, a session that
            // sends nothing for the configured time (and has nothing in flight) is closed,
            // so idle peers cannot hold slots.
            let deadline = if session.pinned.get().is_some() {
                last_activity + config.session_idle_timeout
            } else {
                opened + config.initialize_timeout
            };
            (session.remapped(config), deadline)
        };
        if remapped {
            ended = REMAPPED;
            break;
        }
        let line = tokio::select! {
            l = incoming.recv() => l.unwrap_or(Line::Eof),
            Some(_) = requests.join_next(), if !requests.is_empty() => {
                // A long call is activity too: the idle window starts after its answer.
                last_activity = tokio::time::Instant::now();
                continue;
            }
            _ = idle.tick() => { session.reap_idle(); continue; }
            n = next_undelivered(&mut undelivered) => { session.undelivered(n); continue; }
            _ = tokio::time::sleep_until(deadline), if requests.is_empty() => {
                ended = "no request within the configured window";
                break;
            }
            _ = session.host.stopped() => { ended = HOST_STOPPING; break; }
            _ = out.closed() => { ended = "the client stopped reading"; break; }
        };
        last_activity = tokio::time::Instant::now();
        let bytes = match line {
            Line::Eof => break,
            Line::TooLarge { bytes, head } => {
                session
                    .send(mcp::error_response(
                        &Value::Null,
                        &mcp::too_large(bytes, limit),
                    ))
                    .await;
                session.oversized(&head, bytes);
                continue;
            }
            Line::Message(bytes) => bytes,
        };
        // Tasks that finished but were not joined yet hold no request: they must not count
        // against the limit.
        if requests.len() >= MAX_REQUESTS_IN_FLIGHT {
            while requests.try_join_next().is_some() {}
        }
        match mcp::parse(&bytes) {
            Err((id, e)) => session.malformed(&id, &e).await,
            // (A peer a reload has mapped elsewhere since the loop last looked: the session
            // ends at the next turn.)
            Ok(Incoming::Response { id, outcome }) => session.take_answer(&id, outcome, false),
            Ok(Incoming::Notification { method, params }) => session.notified(&method, &params),
            // Every id in flight is unique, whatever its method: a cancellation names one
            // request, and an answer goes to one. The refusal carries no id (null) while the
            // id's answer is still to come (the request in flight's), since a client
            // matching answers by id would take the refusal for it; it carries the id once
            // that request was cancelled (whose answer never comes).
            Ok(Incoming::Request { id, method, .. }) if session.in_flight(&id) => {
                session.refuse_id_in_flight(&id, &method).await;
            }
            Ok(Incoming::Request { id, method, params }) if method == "initialize" => {
                let answer = session.initialize(&params).await;
                refused = answer.is_err();
                session.answer(&id, answer).await;
            }
            // Before `initialize` has been answered, every request but a ping is refused
            // here, as it is read: a task would see the session as it is when it runs,
            // after an `initialize` read later (so a call sent ahead of it was served), and
            // holds the request meanwhile.
            Ok(Incoming::Request { id, method, .. }) if session.pinned().is_none() => {
                let answer = match method.as_str() {
                    "ping" => Ok(json!({})),
                    other => Err(session.refuse_uninitialized(other).await),
                };
                session.answer(&id, answer).await;
            }
            Ok(Incoming::Request { id, method, .. })
                if requests.len() >= MAX_REQUESTS_IN_FLIGHT =>
            {
                let e = refusal(
                    code::INVALID_REQUEST,
                    format!(
                        "at most {MAX_REQUESTS_IN_FLIGHT} requests may be in flight in a \
                         session; this one was refused (wait for an answer or cancel a call)"
                    ),
                    Denial::RequestLimit,
                );
                let e = session.refuse_session(&named_method(&method), e).await;
                session.send(mcp::error_response(&id, &e)).await;
            }
            Ok(Incoming::Request { id, method, params }) => {
                let Some(cancel) = session.register_cancel(&id) else {
                    session.refuse_id_in_flight(&id, &method).await;
                    continue;
                };
                requests.spawn(session.clone().request_answered(id, method, params, cancel));
            }
        }
    }
    // When the host stops, or a reload remaps the peer, what the client sends is still
    // read while its calls finish (see `heard_after_the_end`), and no longer: requests read
    // but not begun, and those sent since, are answered and recorded as refused (a client
    // whose input had ended, a stdio bridge, would otherwise take the closed connection for
    // every answer given), and at a stop its answers to the calls' relayed requests and its
    // cancellations reach them (before, a call waiting for a sampling answer waited out its
    // deadline). The lines already queued are heard first, at most a queue's worth: a
    // client that never stops sending must not keep the session, or the stop, waiting.
    let mut hearing = ended == HOST_STOPPING || ended == REMAPPED;
    if !hearing || ended == REMAPPED || session.remapped(&session.host.current().config) {
        // No answer of this client is taken any more (none can come, or the peer is no
        // longer the principal its calls ask): the calls waiting for one go on without it
        // rather than wait out their deadlines.
        session.relays.close(ended);
    }
    if hearing {
        for _ in 0..QUEUED_LINES {
            let Ok(line) = incoming.try_recv() else { break };
            if let Line::Message(bytes) = line {
                session.heard_after_the_end(&bytes, ended).await;
            }
        }
    }
    // Calls still in flight finish, are recorded and answered: a client that closed only
    // its sending side (as a stdio client does at the end of its input) still reads. Once
    // nothing can reach the client any more, they are cancelled (their executors are told,
    // as a client's cancellation would); when the host stops they finish.
    let mut cancelled = ended == HOST_STOPPING;
    loop {
        tokio::select! {
            // First: once no call is left, nothing more is read, however fast the client
            // sends.
            biased;
            done = requests.join_next() => if done.is_none() { break },
            n = next_undelivered(&mut undelivered) => session.undelivered(n),
            _ = out.closed(), if !cancelled => {
                session.cancel_all("the client disconnected");
                cancelled = true;
            }
            line = incoming.recv(), if hearing => match line {
                Some(Line::Message(bytes)) => session.heard_after_the_end(&bytes, ended).await,
                Some(Line::TooLarge { bytes, head }) => session.oversized(&head, bytes),
                Some(Line::Eof) | None => {
                    hearing = false;
                    session.relays.close("the client's input ended");
                }
            },
        }
    }
    let executors: Vec<Bound> = session
        .executors
        .lock()
        .map(|mut all| all.drain().flat_map(|(_, s)| s.idle).collect())
        .unwrap_or_default();
    for b in executors {
        b.exec.stop().await;
    }
    if let Some(principal) = session.pinned.get().cloned() {
        let key = SessionKey {
            principal,
            session: session.id.clone(),
        };
        // Compaction: the ended session's label already lives in its principal's.
        if let Err(e) = session.host.resolver.state().forget_session(&key).await {
            tracing::error!(session = %session.id, error = %e, "cannot drop the ended session's label; the flow state refuses further use");
        }
    }
    tracing::info!(session = %session.id, reason = ended, "session closed");
}

/// The next request the transport could not deliver; never, for a transport that has none
/// to report.
async fn next_undelivered(
    undelivered: &mut Option<mpsc::UnboundedReceiver<NotDelivered>>,
) -> NotDelivered {
    if let Some(rx) = undelivered
        && let Some(n) = rx.recv().await
    {
        return n;
    }
    *undelivered = None;
    std::future::pending().await
}

impl Session {
    /// Answers the call that sent a request its transport could not deliver.
    fn undelivered(&self, n: NotDelivered) {
        if !self.relays.undelivered(&n.id, n.why) {
            tracing::debug!(session = %self.id, id = %n.id, "an undelivered request no call awaits any more");
        }
    }

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
        self.pinned.get()
    }

    /// Whether `config` (the one serving now) maps the session's peer to another principal
    /// or to none than at `initialize`. Such a session ends: its requests would all be
    /// refused, and it holds a slot of its old principal.
    fn remapped(&self, config: &crate::config::HostConfig) -> bool {
        self.pinned().is_some_and(|pinned| {
            self.identity
                .principal(config)
                .is_none_or(|p| p.id != *pinned)
        })
    }

    fn caller(&self, generation: &Generation) -> Caller<'_> {
        Caller {
            session: &self.id,
            peer: self.identity.peer(),
            principal: self.principal(generation),
            pinned: self.pinned(),
        }
    }

    /// Refuses (and records) a request read before `initialize` was answered. Any method
    /// is refused so, served or not: a peer learns nothing of what is served before it is
    /// admitted, and leaves a trace for each probe. A method the host does not serve is
    /// named as such (its name is the peer's choice, anything a JSON string holds).
    async fn refuse_uninitialized(&self, method: &str) -> RpcError {
        let e = refusal(
            code::NOT_INITIALIZED,
            "send initialize before other requests",
            Denial::NotInitialized,
        );
        self.refuse_session(&named_method(method), e).await
    }

    /// Records the refusal `e` of a request that named no tool, and returns it (or the
    /// record failure).
    async fn refuse_session(&self, what: &str, e: RpcError) -> RpcError {
        let generation = self.host.current();
        let denial = e
            .data_denial()
            .and_then(|d| serde_json::from_value::<Denial>(json!(d)).ok())
            .unwrap_or(Denial::AccessDenied);
        // Every refusal tells the client its denial, as the record does.
        let e = match e.data_denial() {
            Some(_) => e,
            None => e.with_data(json!({"denial": denial.as_str()})),
        };
        pipeline::refuse_session(
            &env(&self.host, &generation),
            &self.caller(&generation),
            what,
            e,
            denial,
        )
        .await
    }

    /// `initialize`: maps the peer to its principal (recording a refusal) and agrees on the
    /// protocol revision: the one the client asked for when the host speaks it, else the
    /// newest the host speaks (the client may then disconnect).
    async fn initialize(&self, params: &Value) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let principal = match self.principal(&generation) {
            Ok(p) => p,
            Err(e) => return Err(self.refuse_session("(initialize)", e).await),
        };
        // A repeated initialize cannot move the session: `principal` refuses a mapping
        // that differs from the pinned one; nor can it change what the client declared.
        let _ = self.pinned.set(principal.id.clone());
        let _ = self.capabilities.set(ClientCapabilities::declared(params));
        let requested = params
            .get("protocolVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let revision = mcp::negotiate(requested).unwrap_or(mcp::PROTOCOL_VERSION);
        tracing::info!(session = %self.id, principal = %principal.id, requested, revision, "session initialized");
        Ok(json!({
            "protocolVersion": revision,
            "capabilities": {
                "tools": {"listChanged": false},
                "resources": {"subscribe": true, "listChanged": false},
                "prompts": {"listChanged": false},
                "completions": {},
                "logging": {},
            },
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
                let bridge = generation
                    .registry
                    .bridge_security(t.server_id(), t.name())
                    .and_then(|b| serde_json::to_value(b).ok());
                tool_entry(
                    generation.config.public_tool_name(t.server_id(), t.name()),
                    t.definition(),
                    t.sanitized_description(),
                    bridge,
                )
            })
            .collect();
        Ok(json!({ "tools": tools }))
    }

    /// `flowhost/session`: what a declassification authority binds a grant to (the session
    /// id and the session's current label with its hash); given a call's tool `name` and
    /// `arguments`, also that call's source label (the session's label with the operator's
    /// input floor and what the classifier finds in them) and its hash, which a grant for it
    /// must bind. Only for a tool the principal may call, with arguments its signed schema
    /// takes, as the call itself would be judged: the classifier is not there to be asked
    /// about any text.
    async fn describe(&self, params: &Value) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let principal = self.principal(&generation)?;
        let arguments = match (params.get("name"), params.get("arguments")) {
            (None, None) => None,
            (Some(Value::String(name)), Some(a @ Value::Object(_))) => {
                let (server, tool) = generation.config.tool_name(name);
                let Some(t) = generation.registry.tool(server, tool) else {
                    return Err(refusal(
                        code::INVALID_PARAMS,
                        format!("flowhost/session: unknown tool {name:?}"),
                        Denial::UnknownTool,
                    ));
                };
                if !principal.may_call(server, tool) {
                    return Err(refusal(
                        code::ACCESS_DENIED,
                        format!("flowhost/session: {} may not call {name:?}", principal.id),
                        Denial::AccessDenied,
                    ));
                }
                t.validate_arguments(a).map_err(|e| {
                    refusal(
                        code::INVALID_PARAMS,
                        format!("flowhost/session: arguments for {name:?}: {e}"),
                        Denial::SchemaInvalid,
                    )
                })?;
                Some(a)
            }
            _ => {
                return Err(refusal(
                    code::INVALID_PARAMS,
                    "flowhost/session: give both name (the tool) and arguments (an object), as \
                     tools/call would",
                    Denial::InvalidParams,
                ));
            }
        };
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
        let mut described = json!({
            "principal": principal.id.to_string(),
            "session": self.id,
            "label": serde_json::to_value(&label).unwrap_or(Value::Null),
            "label_hash": crate::grant::label_hash(&label),
        });
        if let Some(arguments) = arguments {
            let source = label.join_or_top(&self.host.resolver.argument_label(arguments));
            described["source_label"] = serde_json::to_value(&source).unwrap_or(Value::Null);
            described["source_label_hash"] = crate::grant::label_hash(&source).into();
        }
        Ok(described)
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
                return Err(refusal(
                    code::INVALID_PARAMS,
                    format!("shape {other:?} is not \"flowhost\" or \"assay\""),
                    Denial::InvalidParams,
                ));
            }
        };
        if let (Some(e), Some(map)) = (write_error, v.as_object_mut()) {
            map.insert("health_file_error".into(), json!(e));
        }
        Ok(v)
    }

    /// `tools/call` (request `id`), through the pipeline, with this session's executors.
    /// `cancel` ends the call when the client cancels it.
    async fn call(
        &self,
        id: &Value,
        params: &Value,
        cancel: watch::Receiver<Option<String>>,
    ) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let outbox = self.out.for_request(id);
        let progress = params
            .get("_meta")
            .and_then(|m| m.get("progressToken"))
            .filter(|t| t.is_string() || t.is_i64() || t.is_u64())
            .map(|token| ProgressRoute::new(token.clone(), outbox.clone()));
        let mut executors = Executors {
            session: self,
            generation: &generation,
            answered: None,
            control: CallControl { cancel, progress },
            outbox,
        };
        pipeline::tools_call(
            &env(&self.host, &generation),
            self.caller(&generation),
            params,
            &mut executors,
        )
        .await
    }

    /// Answers one request (any but `initialize`), in its own task.
    async fn request(
        self: Arc<Self>,
        id: Value,
        method: String,
        params: Value,
        cancel: watch::Receiver<Option<String>>,
    ) {
        let result = match method.as_str() {
            "ping" => Ok(json!({})),
            method if self.pinned().is_none() => Err(self.refuse_uninitialized(method).await),
            "tools/list" => match self.list() {
                Err(e) => Err(self.refuse_session("(tools/list)", e).await),
                ok => ok,
            },
            "tools/call" => self.call(&id, &params, cancel).await,
            "resources/list" | "resources/templates/list" | "prompts/list" => {
                match self.list_content(&method) {
                    Err(e) => Err(self.refuse_session(&format!("({method})"), e).await),
                    ok => ok,
                }
            }
            "resources/subscribe" | "resources/unsubscribe" => {
                self.subscription(&method, &params).await
            }
            "logging/setLevel" => self.set_log_level(&params).await,
            method if ContentMethod::from_method(method).is_some() => {
                self.content(method, &params).await
            }
            "flowhost/session" => match self.describe(&params).await {
                Err(e) => Err(self.refuse_session("(flowhost/session)", e).await),
                ok => ok,
            },
            "flowhost/health" => {
                self.host.settle_records().await;
                match self.health(&params) {
                    Err(e) => Err(self.refuse_session("(flowhost/health)", e).await),
                    ok => ok,
                }
            }
            other => Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                format!("method {other:?} is not served"),
            )),
        };
        // Not held while the answer waits for a client slow to read it (up to the write
        // timeout): its parsed form can be many times its size on the wire.
        drop(params);
        // A cancelled request is not answered (the client has stopped waiting for it); its
        // outcome is recorded all the same.
        let cancelled = self.settle_cancel(&id);
        if !cancelled {
            self.answer(&id, result).await;
        }
    }

    /// Serves one request, answering it as an internal error if serving it panics (a
    /// defect) rather than leaving the client waiting for an answer that never comes.
    async fn request_answered(
        self: Arc<Self>,
        id: Value,
        method: String,
        params: Value,
        cancel: watch::Receiver<Option<String>>,
    ) {
        use std::panic::{AssertUnwindSafe, catch_unwind};
        use std::task::Poll;
        // On the heap: the request's state is large, and the task holding it is moved as it
        // is spawned and when it ends; a box moves as a pointer.
        let mut served = Box::pin(self.clone().request(id.clone(), method, params, cancel));
        // Never polled again once it panicked.
        let panicked = std::future::poll_fn(|cx| {
            match catch_unwind(AssertUnwindSafe(|| served.as_mut().poll(cx))) {
                Ok(Poll::Ready(())) => Poll::Ready(false),
                Ok(Poll::Pending) => Poll::Pending,
                Err(_) => Poll::Ready(true),
            }
        })
        .await;
        if panicked {
            tracing::error!(session = %self.id, request = %id, "serving a request panicked; answering it as an internal error");
            if !self.settle_cancel(&id) {
                let e = RpcError::new(code::INTERNAL_ERROR, "the host failed serving this request");
                self.answer(&id, Err(e)).await;
            }
        }
    }

    async fn answer(&self, id: &Value, result: Result<Value, RpcError>) {
        self.send(match result {
            Ok(v) => mcp::response(id, v),
            Err(e) => mcp::error_response(id, &e),
        })
        .await;
    }

    /// Queues one outgoing line (lost if the client is gone).
    async fn send(&self, line: String) {
        self.out.send(line).await;
    }

    /// A client notification: `notifications/cancelled` ends the named call in flight;
    /// others need nothing.
    fn notified(&self, method: &str, params: &Value) {
        if method != "notifications/cancelled" {
            return;
        }
        let Some(id) = params.get("requestId") else {
            return;
        };
        let reason = params
            .get("reason")
            .and_then(Value::as_str)
            .unwrap_or("cancelled by the client");
        if let Ok(cancels) = self.cancels.lock()
            && let Some(cancel) = cancels.get(&id.to_string())
        {
            tracing::info!(session = %self.id, request = %id, reason, "the client cancelled a call");
            let _ = cancel.send(Some(reason.chars().take(256).collect()));
        }
    }

    /// Hands the client's answer to the relayed request `id` awaits, unless the peer is
    /// `remapped` (known so already) or a reload has mapped it elsewhere since: it is then
    /// no longer the principal its calls ask, nothing of it is taken any more, and the
    /// calls stop waiting for it.
    fn take_answer(&self, id: &Value, outcome: Result<Value, Value>, remapped: bool) {
        if remapped || self.remapped(&self.host.current().config) {
            self.relays.close(REMAPPED);
            tracing::info!(session = %self.id, id = %id, "an answer of a peer no longer mapped to the session's principal is not taken");
        } else if !self.relays.answered(id, outcome) {
            tracing::debug!(session = %self.id, id = %id, "an answer to no request awaiting one is ignored");
        }
    }

    /// A line the client sent once the session has ended (`ended`) while its calls finish:
    /// a cancellation is taken as ever, and so, when the host stops, is an answer to a
    /// call's relayed request (a peer a reload mapped elsewhere is no longer the principal
    /// its calls ask: its answers are not taken); a request is refused and recorded, not
    /// served.
    async fn heard_after_the_end(&self, bytes: &[u8], ended: &str) {
        match mcp::parse(bytes) {
            Ok(Incoming::Response { id, outcome }) => {
                self.take_answer(&id, outcome, ended == REMAPPED)
            }
            Ok(Incoming::Notification { method, params }) => self.notified(&method, &params),
            // A request in flight owns its id until answered, as while the session ran: a
            // refusal under it would be taken for that request's answer.
            Ok(Incoming::Request { id, method, .. }) if self.in_flight(&id) => {
                self.refuse_id_in_flight(&id, &method).await;
            }
            Ok(Incoming::Request { id, method, .. }) => {
                let e = refusal(
                    code::INTERNAL_ERROR,
                    format!("the session is ending ({ended}); this request was not served"),
                    Denial::SessionEnding,
                );
                let e = self.refuse_session(&named_method(&method), e).await;
                self.send(mcp::error_response(&id, &e)).await;
            }
            Err((id, e)) => self.malformed(&id, &e).await,
        }
    }

    /// A line of the client's that is no valid message: answered as invalid. One that
    /// echoes the id of a request relayed to the client is its answer gone wrong (no result
    /// and no error, or both): that request is told no answer will come, so its call goes on
    /// at once rather than wait out its deadline and be recorded as cut short by it.
    async fn malformed(&self, id: &Value, e: &RpcError) {
        self.send(mcp::error_response(id, e)).await;
        if id
            .as_str()
            .is_some_and(|i| i.starts_with(super::relay::RELAY_ID_PREFIX))
        {
            self.relays.undelivered(
                id,
                format!(
                    "the client answered it with an invalid message ({})",
                    e.message
                ),
            );
        }
    }

    /// A line of the client's over the size limit, of which `head` is the start: one that
    /// names a request relayed to the client first is its answer (a long completion), and
    /// that request is told none will come, as for a malformed answer, rather than wait out
    /// its deadline.
    fn oversized(&self, head: &[u8], bytes: usize) {
        if let Some(id) = super::relay::relay_id_in(head) {
            self.relays.undelivered(
                &Value::String(id),
                format!("the client answered it with a {bytes}-byte message, over the limit"),
            );
        }
    }

    /// Whether request `id` is in flight (true if that cannot be told).
    fn in_flight(&self, id: &Value) -> bool {
        self.cancels
            .lock()
            .map_or(true, |c| c.contains_key(&id.to_string()))
    }

    /// Refuses a request whose `id` is in flight, recorded, and answered with a null id,
    /// unless the request in flight was cancelled (see the read loop).
    async fn refuse_id_in_flight(&self, id: &Value, method: &str) {
        let cancelled = self.cancels.lock().is_ok_and(|c| {
            c.get(&id.to_string())
                .is_some_and(|tx| tx.borrow().is_some())
        });
        let e = refusal(
            code::INVALID_REQUEST,
            format!("request id {id} is already in flight in this session"),
            Denial::RequestIdInFlight,
        );
        let e = self.refuse_session(&named_method(method), e).await;
        let answered_as = if cancelled { id } else { &Value::Null };
        self.send(mcp::error_response(answered_as, &e)).await;
    }

    /// Registers a cancellable request `id`; `None` if a request with that id is in flight.
    fn register_cancel(&self, id: &Value) -> Option<watch::Receiver<Option<String>>> {
        let mut cancels = self.cancels.lock().ok()?;
        let key = id.to_string();
        if cancels.contains_key(&key) {
            return None;
        }
        let (tx, rx) = watch::channel(None);
        cancels.insert(key, tx);
        Some(rx)
    }

    /// Forgets request `id`'s cancellation; whether it was cancelled.
    fn settle_cancel(&self, id: &Value) -> bool {
        self.cancels
            .lock()
            .ok()
            .and_then(|mut c| c.remove(&id.to_string()))
            .is_some_and(|tx| tx.borrow().is_some())
    }

    /// Cancels every call in flight (the client is gone).
    fn cancel_all(&self, reason: &str) {
        if let Ok(cancels) = self.cancels.lock() {
            for tx in cancels.values() {
                let _ = tx.send(Some(reason.to_string()));
            }
        }
    }

    /// Ends the client's subscription to `uri` of `server`: the principal may no longer
    /// read it. MCP has no message telling the client so; the operator is told.
    fn end_subscription(&self, server: &str, uri: &str) {
        self.subscriptions.remove_if_settled(server, uri);
        self.log_ended_subscription(server, uri);
    }

    fn log_ended_subscription(&self, server: &str, uri: &str) {
        tracing::warn!(session = %self.id, server = %server, uri = %Escaped(&uri), "the client's subscription ended: the principal may no longer read it (the configuration reloaded)");
    }

    /// Stops the session's executors that have been idle past the configured time, and
    /// those of an earlier generation at once, except those holding a subscription of the
    /// client that no other kept executor holds (stopping the only holder would end it
    /// unnoticed; see `idle_to_stop`). Subscriptions the principal may no longer read end
    /// first, so nothing is kept for them.
    fn reap_idle(&self) {
        // Before the generation: a reload ending in between has swapped it in already.
        let reloading = self.host.reload_names();
        let current = self.host.current();
        let limit = current.config.idle_timeout;
        let subscriptions = &self.subscriptions;
        let pinned = self.pinned();
        // A server not served now but named by a reload in progress (withdrawn ahead of it,
        // its key replaced) keeps the session's subscriptions to it until that reload ends:
        // they are taken over if it serves the server again, judged then, and end at the
        // next look if it does not.
        for (server, uri) in subscriptions.end_unless(|server, uri| {
            (!current.servers.contains_key(server) && reloading.contains(server))
                || may_watch(&current, &self.identity, pinned, server, uri)
        }) {
            self.log_ended_subscription(&server, &uri);
        }
        let idle: Vec<Bound> = match self.executors.lock() {
            Ok(mut all) => all
                .iter_mut()
                .flat_map(|(server, s)| {
                    let seen: Vec<IdleExecutor<'_>> = s
                        .idle
                        .iter_mut()
                        .map(|b| IdleExecutor {
                            past_limit: b.exec.idle_for() > limit,
                            // One started from a manifest the host no longer serves (a
                            // reload replaced its key or version, or took it out) watches
                            // for nobody: the next executor bound takes its subscriptions.
                            live: b.exec.alive()
                                && b.exec.sees_its_resolver()
                                && current.servers.get(server.as_str()).map(|f| &f.digest)
                                    == b.admitted.as_ref(),
                            current: b.generation == current.id,
                            subscribed: &b.subscribed,
                        })
                        .collect();
                    let stop = idle_to_stop(&seen, |u| subscriptions.contains(server, u));
                    let (old, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut s.idle)
                        .into_iter()
                        .zip(stop)
                        .partition(|(_, stop)| *stop);
                    s.idle = keep.into_iter().map(|(b, _)| b).collect();
                    old.into_iter().map(|(b, _)| b)
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        // Stopped in the background: the session goes on reading and answering meanwhile.
        for b in idle {
            tokio::spawn(b.exec.stop());
        }
    }
}

/// A tool as `tools/list` advertises it: its signed description, input and output schemas,
/// title and annotations, with the bridge security metadata in `_meta`.
fn tool_entry(
    name: String,
    definition: &crate::manifest::ToolDefinition,
    description: String,
    bridge: Option<Value>,
) -> Value {
    let a = definition.annotations();
    let mut annotations = json!({
        "readOnlyHint": a.read_only,
        "destructiveHint": a.destructive,
        "idempotentHint": a.idempotent,
    });
    if let Some(open_world) = a.open_world {
        annotations["openWorldHint"] = json!(open_world);
    }
    let mut entry = json!({
        "name": name,
        "description": description,
        "inputSchema": definition.input_schema(),
        "_meta": { BRIDGE_META_KEY: bridge },
        "annotations": annotations,
    });
    if let Some(title) = definition.title().map(crate::manifest::sanitize_for_client) {
        // The tool's title (2025-06-18) and the annotations' (2025-03-26) say the same.
        entry["annotations"]["title"] = json!(title);
        entry["title"] = json!(title);
    }
    if let Some(schema) = definition.output_schema() {
        entry["outputSchema"] = Value::Object(schema.clone());
    }
    // MCP's annotations have no hint for it: a client learns here, before calling, that a
    // call without an authority's grant for exactly it is refused (`approval_required`).
    if a.requires_approval {
        entry["_meta"][REQUIRES_APPROVAL_META_KEY] = json!(true);
    }
    entry
}

/// Where `tools/list` says a tool's signed manifest requires a person's approval of each
/// call: the tool's `_meta`.
pub const REQUIRES_APPROVAL_META_KEY: &str = "flowhost/requires_approval";

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

/// The executors one call may use: the session's, for the call's generation, with the
/// client's control of the call.
struct Executors<'s> {
    session: &'s Session,
    generation: &'s Generation,
    /// The executor of a call that has answered, with the permit it ran under, until the
    /// labels of what it produced are durable ([`Dispatch::settled`]): before that another
    /// call could take it at the lower label, and if the raise fails it must not serve
    /// again. Dropped unsettled, it is stopped.
    answered: Option<(String, Bound, tokio::sync::OwnedSemaphorePermit)>,
    control: CallControl,
    /// The call's messages to the client.
    outbox: Outbox,
}

/// Why no executor took a request: the host's words, and whether it was refused (its
/// principal's access withdrawn while it waited) or met a bound of the host (its deadline
/// ran out, or the principal holds its share of executors) rather than failed.
struct NotReady {
    words: String,
    why: NotReadyWhy,
}

/// Which of [`NotReady`]'s cases it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotReadyWhy {
    /// No executor could be started or made ready.
    Failed,
    /// A reload withdrew the principal's access while the request waited.
    AccessWithdrawn,
    /// A bound of the host: the deadline ran out, or the principal holds its share.
    Bounded,
}

impl NotReady {
    /// As a call's dispatch error: a bound of the host is not a failed executor.
    fn for_call(self) -> DispatchError {
        match self.why {
            NotReadyWhy::AccessWithdrawn => DispatchError::AccessWithdrawn(self.words),
            NotReadyWhy::Bounded => DispatchError::NotTaken(self.words),
            NotReadyWhy::Failed => DispatchError::NotStarted(self.words),
        }
    }

    /// As a forwarded request's error, likewise.
    fn for_forward(self) -> super::pipeline::content::ForwardError {
        use super::pipeline::content::ForwardError;
        match self.why {
            NotReadyWhy::AccessWithdrawn => ForwardError::AccessWithdrawn(self.words),
            NotReadyWhy::Bounded => ForwardError::NotTaken(self.words),
            NotReadyWhy::Failed => ForwardError::NotStarted(self.words),
        }
    }
}

impl Executors<'_> {
    /// An idle executor of the session for `server` that belongs to the current generation,
    /// is alive and is fit for the call's label, or a fresh one from the warm pool. Unfit
    /// ones met on the way are stopped. It has the client's logging level, and holds the
    /// client's subscriptions to the server that no live idle executor of the current
    /// generation holds.
    async fn take(
        &self,
        server: &str,
        name: &str,
        source: &crate::label::InformationLabel,
    ) -> Result<Bound, ExecutorError> {
        let mut retired = Vec::new();
        let mut found = None;
        if let Ok(mut all) = self.session.executors.lock()
            && let Some(s) = all.get_mut(server)
        {
            while let Some(mut b) = s.idle.pop() {
                if b.generation == self.generation.id
                    && b.exec.alive()
                    && b.exec.fit_for(source)
                    && b.exec.sees_its_resolver()
                {
                    found = Some(b);
                    break;
                }
                retired.push(b);
            }
        }
        for b in retired {
            b.exec.stop().await;
        }
        // A request admitted before a reload withdrew its server, or admitted it under
        // another manifest (a key replaced, a new version), or withdrew the session's
        // principal or its access to `name`, and queued behind the server's other calls
        // since, is not served by what it was admitted to: neither an idle executor nor a
        // new one takes it. Asked again once the executor is ready (a cold start and the
        // session's forwards take a while, in which a reload can come).
        if let Err(withdrawn) = self.still_admitted(server, name) {
            if let Some(b) = found {
                self.set_aside(server, b, &withdrawn).await;
            }
            return Err(withdrawn);
        }
        let mut bound = match found {
            Some(b) => b,
            None => {
                let pool = self
                    .generation
                    .pools
                    .get(server)
                    .ok_or(ExecutorError::Exited)?;
                let place = self.executor_place()?;
                let exec = pool.acquire().await?;
                exec.on_resource_updated(self.session.updates_for(server));
                Bound {
                    _place: place,
                    generation: self.generation.id,
                    admitted: self
                        .generation
                        .servers
                        .get(server)
                        .map(|f| f.digest.clone()),
                    exec,
                    log_level: None,
                    subscribed: BTreeSet::new(),
                }
            }
        };
        // Until what it produces for this request is labelled (`give_back`).
        bound.exec.hold_updates();
        // The client's logging level reaches every executor before it serves the session.
        let wanted = self.session.log_level.lock().ok().and_then(|l| *l);
        if let Some(level) = wanted
            && let Err(e) = bound
                .apply_log_level(level, self.generation.config.call_timeout)
                .await
        {
            bound.exec.stop().await;
            return Err(e);
        }
        // The client's settled subscriptions that no live idle executor of the server's
        // current generation holds (their holder was retired or exited) are taken over by
        // this one. An executor serving another call of the session at this moment is not
        // seen: the client may then get an update twice, until reaping stops one of them.
        let mut orphaned = self.session.subscriptions.settled(server);
        // Most often the executor bound is the holder: then nothing more is looked at.
        orphaned.retain(|u| !bound.subscribed.contains(u));
        // Nothing is watched for a client that may no longer read it (a reload took the
        // resource away): that subscription ends here. Judged by the configuration in force
        // now, which may be newer than the one this call started under.
        // Nor is a URI handed to an executor that is to serve a call of a lower source
        // (whose egress is approved under that source) or whose egress was approved under a
        // label below its taint (a connection it may hold open for lower data): either
        // could carry it unjudged. It stays the client's, for the next executor that may
        // take it in.
        orphaned.retain(|u| {
            let taint = self
                .session
                .host
                .resolver
                .argument_label(&json!({ "uri": u }));
            taint.flows_to(source) && bound.exec.takes_in(&taint)
        });
        if !orphaned.is_empty() {
            let now = self.session.host.current();
            orphaned.retain(|u| {
                let allowed = may_watch(
                    &now,
                    &self.session.identity,
                    self.session.pinned(),
                    server,
                    u,
                );
                if !allowed {
                    self.session.end_subscription(server, u);
                }
                allowed
            });
        }
        if !orphaned.is_empty()
            && let Ok(mut all) = self.session.executors.lock()
            && let Some(s) = all.get_mut(server)
        {
            for b in &mut s.idle {
                if b.generation == self.generation.id
                    && b.exec.alive()
                    && b.exec.sees_its_resolver()
                {
                    orphaned.retain(|u| !b.subscribed.contains(u));
                }
            }
        }
        if !orphaned.is_empty() {
            let deadline = self.generation.config.call_timeout;
            match bound.subscribe(server, orphaned, deadline).await {
                Ok(refused) => {
                    // Not tried again at every binding: the subscription ends, and says so.
                    for uri in refused {
                        self.session.subscriptions.remove_if_settled(server, &uri);
                        tracing::warn!(session = %self.session.id, server = %server, uri = %Escaped(&uri), "the client's subscription ended: the executor that replaced its holder refused it");
                    }
                }
                Err(e) => {
                    bound.exec.stop().await;
                    return Err(e);
                }
            }
        }
        if let Err(withdrawn) = self.still_admitted(server, name) {
            self.set_aside(server, bound, &withdrawn).await;
            return Err(withdrawn);
        }
        Ok(bound)
    }

    /// An executor taken for a request that `why` refuses before the executor saw it:
    /// stopped when its server was withdrawn; kept for the session when only the request's
    /// access was, since it may hold the client's subscriptions to what the principal may
    /// still read (stopped, they would go unwatched until the session binds the server
    /// again).
    async fn set_aside(&self, server: &str, b: Bound, why: &ExecutorError) {
        let kept = match why {
            ExecutorError::AccessWithdrawn(_) => self.give_back(server, b),
            _ => Some(b),
        };
        if let Some(b) = kept {
            b.exec.stop().await;
        }
    }

    /// A place for one more executor in the session's principal's share of the host's
    /// `max_executors` (as the configuration serving now divides it).
    fn executor_place(&self) -> Result<super::budget::ExecutorPlace, ExecutorError> {
        let current = self.session.host.current();
        let Some(principal) = self.session.pinned() else {
            // No principal, no executor: the request was refused before it got here.
            return Err(ExecutorError::AccessWithdrawn(String::new()));
        };
        let share = super::budget::executor_share(
            current.config.max_executors,
            current.config.principals.len(),
        );
        self.session
            .host
            .executors
            .take(principal, share)
            .ok_or_else(|| ExecutorError::OverShare {
                principal: principal.to_string(),
                share,
            })
    }

    /// Whether the host still serves `server` under the manifest this call's generation
    /// admitted, and the configuration serving now still maps the session's peer to the
    /// principal it was admitted as, which may still use `name` (a tool, resource or prompt
    /// of `server`).
    fn still_admitted(&self, server: &str, name: &str) -> Result<(), ExecutorError> {
        let current = self.session.host.current();
        // Every reload that changes what is served, and every withdrawal, makes a generation
        // of its own: under the one the request was admitted in, nothing has changed.
        if current.id == self.generation.id {
            return Ok(());
        }
        let admitted_now = current.servers.get(server).map(|f| &f.digest);
        if admitted_now != self.generation.servers.get(server).map(|f| &f.digest) {
            return Err(ExecutorError::Withdrawn(server.to_string()));
        }
        let pinned = self.session.pinned();
        let principal = self.session.identity.principal(&current.config);
        match principal {
            Some(p) if pinned == Some(&p.id) && p.may_call(server, name) => Ok(()),
            _ => Err(ExecutorError::AccessWithdrawn(server.to_string())),
        }
    }

    /// [`Executors::take`], with a failure told in the host's words
    /// ([`ExecutorError::host_words`]): the executor has not been given the request, so
    /// nothing it said is labelled, and what it said goes to the host's log (escaped) only.
    async fn ready(
        &self,
        server: &str,
        name: &str,
        source: &crate::label::InformationLabel,
        deadline: RequestDeadline,
    ) -> Result<Bound, NotReady> {
        // Within the request's deadline: a server slow to start, or to take the session's
        // logging level or its subscriptions, must not hold the call, its permit and the
        // session for longer. An executor dropped half ready is stopped.
        let taken = tokio::time::timeout_at(deadline.at, self.take(server, name, source))
            .await
            .unwrap_or(Err(ExecutorError::Timeout(deadline.whole)));
        taken.map_err(|e| {
            tracing::warn!(session = %self.session.id, server = %server, error = %Escaped(&e), "no executor of server {server:?} could be made ready for a request");
            NotReady {
                why: match e {
                    ExecutorError::AccessWithdrawn(_) => NotReadyWhy::AccessWithdrawn,
                    ExecutorError::Timeout(_) | ExecutorError::OverShare { .. } => {
                        NotReadyWhy::Bounded
                    }
                    _ => NotReadyWhy::Failed,
                },
                words: format!(
                    "server {server:?}: {} (the host's log says more)",
                    e.host_words()
                ),
            }
        })
    }

    /// The permits that bound how many of `server`'s executors the session runs at once.
    fn permits(&self, server: &str) -> Result<Arc<Semaphore>, String> {
        match self.session.executors.lock() {
            Ok(mut all) => Ok(all.entry(server.to_string()).or_default().permits.clone()),
            Err(_) => Err(format!(
                "server {server:?}: the session's executors are unavailable"
            )),
        }
    }

    /// Lets the executor that answered last serve again once the labels of what it produced
    /// are stored (`durable`), or retires it.
    async fn release(&mut self, durable: bool) {
        let Some((server, bound, _permit)) = self.answered.take() else {
            return;
        };
        if bound.exec.killed() {
            // Killed to be retired as its call ended: nothing to give back.
            bound.exec.stop().await;
        } else if !durable {
            tracing::warn!(server = %server, pid = bound.exec.pid(), "not all the executor produced is labelled (a label could not be stored, or its answer was withheld unread); it is retired");
            bound.exec.stop().await;
        } else if bound.exec.egressed_under_a_grant() {
            // Stopped now, not when a later request would find it unfit: idle, it would keep
            // the connection the grant allowed (and send resource updates) meanwhile.
            tracing::info!(server = %server, pid = bound.exec.pid(), "the executor made egress under the call's grant; it is retired");
            bound.exec.stop().await;
        } else if let Some(b) = self.give_back(&server, bound) {
            b.exec.stop().await;
        }
    }

    /// Returns an executor to the session's idle ones (handed back if the lock is poisoned),
    /// passing on the resource updates it sent while taken: whatever it read is labelled by
    /// now.
    fn give_back(&self, server: &str, bound: Bound) -> Option<Bound> {
        bound.exec.release_updates();
        match self.session.executors.lock() {
            Ok(mut all) => {
                all.entry(server.to_string()).or_default().idle.push(bound);
                None
            }
            Err(_) => Some(bound),
        }
    }
}

/// When a request to an executor must be answered: its one deadline, `call_timeout` from when
/// it is dispatched (its admission and the record of its allow come before), covers waiting
/// for one of the session's executors, making it ready (a cold start's `initialize`), and
/// its answer. Each step on its own deadline let a request
/// take several times `call_timeout`, longer than a stop waits for requests in flight.
#[derive(Debug, Clone, Copy)]
pub(super) struct RequestDeadline {
    /// The instant the request is given up.
    at: tokio::time::Instant,
    /// The whole allowance (`call_timeout`), for the words of a timeout.
    whole: std::time::Duration,
}

impl RequestDeadline {
    /// A deadline `call_timeout` from now.
    fn from_now(call_timeout: std::time::Duration) -> Self {
        Self {
            at: tokio::time::Instant::now() + call_timeout,
            whole: call_timeout,
        }
    }

    /// `e`, a timeout told by the whole deadline (`call_timeout_ms`), not by what was
    /// left of it when the executor was asked.
    fn said(&self, e: ExecutorError) -> ExecutorError {
        match e {
            ExecutorError::Timeout(_) => ExecutorError::Timeout(self.whole),
            e => e,
        }
    }

    /// What is left of it (zero once passed).
    fn left(&self) -> std::time::Duration {
        self.at
            .saturating_duration_since(tokio::time::Instant::now())
    }

    /// One of `server`'s permits for the session, or why none came before the deadline.
    async fn permit(
        &self,
        server: &str,
        permits: &Arc<Semaphore>,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, NotReady> {
        match tokio::time::timeout_at(self.at, permits.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(e)) => Err(NotReady {
                words: e.to_string(),
                why: NotReadyWhy::Failed,
            }),
            Err(_) => Err(NotReady {
                words: format!(
                    "server {server:?}: none of the session's executors of it became free within the request's deadline ({:?}, call_timeout_ms)",
                    self.whole
                ),
                why: NotReadyWhy::Bounded,
            }),
        }
    }
}

impl Dispatch for Executors<'_> {
    async fn dispatch(
        &mut self,
        server: &str,
        tool: &str,
        arguments: Value,
        mut call: CallInFlight,
        gate: &RelayGate<'_>,
    ) -> Result<Value, DispatchError> {
        let deadline = RequestDeadline::from_now(self.generation.config.call_timeout);
        let permits = self.permits(server).map_err(DispatchError::NotStarted)?;
        // Waits (cancellably) for one of the server's executors of this session, then for it
        // to be ready, then for its answer, all within the call's one deadline; a
        // cancellation already made wins.
        let permit = tokio::select! {
            biased;
            reason = cancelled(&mut self.control.cancel) => return Err(DispatchError::CancelledBeforeStart(reason)),
            p = deadline.permit(server, &permits) => p.map_err(NotReady::for_call)?,
        };
        let source = call.plan.source.clone();
        let mut cancel = self.control.cancel.clone();
        let mut bound = tokio::select! {
            biased;
            reason = cancelled(&mut cancel) => return Err(DispatchError::CancelledBeforeStart(reason)),
            ready = self.ready(server, tool, &source, deadline) => ready.map_err(NotReady::for_call)?,
        };
        call.executor_pid = bound.exec.pid();
        let name = call.tool.clone();
        let relay = CallRelay {
            gate,
            pending: &self.session.relays,
            capabilities: self.session.capabilities.get().copied().unwrap_or_default(),
            out: &self.outbox,
            in_flight: Default::default(),
        };
        let outcome = bound
            .exec
            .call(
                Arc::new(call),
                tool,
                arguments,
                deadline.left(),
                &mut self.control,
                &relay,
            )
            .await
            .map_err(|e| deadline.said(e));
        // An executor that answered may serve again, once what it produced is settled.
        match outcome {
            Ok(result) => {
                self.answered = Some((server.to_string(), bound, permit));
                Ok(result)
            }
            Err(ExecutorError::CancelledBeforeSent(reason)) => {
                // It never saw the call; it is retired all the same, as after any
                // cancellation, rather than settled as one that answered.
                bound.exec.stop().await;
                drop(permit);
                Err(DispatchError::CancelledBeforeStart(reason))
            }
            Err(ExecutorError::Cancelled {
                reason,
                acknowledged,
            }) => {
                tracing::info!(server = %server, tool = %name, acknowledged, "call cancelled: {}", Escaped(&reason));
                // Retired even when it acknowledged: what it read for the call is in its
                // memory, and what it said of it (its reply) was never classified, so the
                // session's label need not carry it; serving a later call at that label, it
                // could pass it on.
                bound.exec.stop().await;
                drop(permit);
                Err(DispatchError::Cancelled(reason))
            }
            Err(ExecutorError::Rpc(e)) => {
                self.answered = Some((server.to_string(), bound, permit));
                Err(DispatchError::Answered(e))
            }
            Err(e) => {
                tracing::warn!(server = %server, tool = %name, error = %Escaped(&e), "the executor of server {server:?} failed; it is retired");
                bound.exec.stop().await;
                let why = format!("server {server:?}: {e}");
                Err(if e.ran_into_a_bound() {
                    DispatchError::BoundReached(why)
                } else {
                    DispatchError::Failed(why)
                })
            }
        }
    }

    async fn settled(&mut self, durable: bool) {
        self.release(durable).await;
    }
}
