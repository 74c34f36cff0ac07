//! MCP over Streamable HTTP (`[http]`): one endpoint taking `POST` (a JSON-RPC message; a
//! request is answered on an SSE stream, or as JSON to a client that accepts only JSON),
//! `GET` (the session's stream for server messages, or the resumption of a stream after
//! `Last-Event-ID`) and `DELETE` (ends the session). `initialize` opens a session whose id
//! travels in `Mcp-Session-Id`; the session is the same session logic the Unix socket
//! drives, acting for the principal the caller authenticated as (see [`auth`]).
//!
//! Before anything else, the `Host` header must name an allowed host and an `Origin`
//! header, if sent, an allowed origin (DNS rebinding); then the caller must authenticate,
//! on every request, as the principal its session belongs to. Authentication refusals are
//! recorded like every other refusal. A header these checks read is refused when it is sent
//! twice or is not visible ASCII, never read as absent.
//!
//! Files: `auth` (credentials to principals), `streams` (a session's SSE streams and their
//! replay), `sources` (the connections open per source address), `tls` (the listener's TLS).

pub mod auth;
mod sources;
mod streams;
mod tls;
mod unproven;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::Host;
use super::pipeline::{self, Caller};
use super::session::{self, Identity};
use crate::config::HttpConfig;
// Past MAX_CONNECTIONS a new connection is closed at once; one source may hold
// `max_connections_per_source` of them.
use crate::config::MAX_CONNECTIONS;
use crate::decision::Denial;
use crate::ident::PrincipalId;
use crate::mcp::{Line, RpcError, code};
use auth::{AuthRefusal, Authenticator, Credential};
use sources::Sources;
use streams::{Events, ReplayBudget, Streams, Target};
pub use tls::Certificates;
use unproven::{Closed, NoEntry, UNPROVEN_GRACE, UNPROVEN_LIMIT, Unproven, UnprovenSlot};

/// The session id header.
const SESSION_HEADER: &str = "mcp-session-id";
/// The negotiated protocol version header.
const VERSION_HEADER: &str = "mcp-protocol-version";
/// Most live HTTP sessions per principal, and in all.
const MAX_SESSIONS_PER_PRINCIPAL: usize = 64;
const MAX_SESSIONS: usize = 1024;
/// How long a new connection waits for the place of the unproven one it closed (its task
/// lets go of it within a scheduling round).
const ROOM_WAIT: Duration = Duration::from_secs(1);
/// How many accepted connections the kernel may queue before the listener takes them. A
/// burst past it has its connection requests dropped, and each client tries again only
/// after a second (then three, then seven): a client arriving amid a flood of connections
/// would wait that long, even though the listener would close the flood's at once. So the
/// queue holds a burst as large as the listener's limit twice over (the kernel caps it at
/// `net.core.somaxconn`).
const LISTEN_BACKLOG: u32 = 2 * MAX_CONNECTIONS as u32;
/// How long a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's head, and how long a kept-alive
/// connection may sit idle before its next request: past it the connection is closed, so
/// a client that connects and sends nothing (or a byte now and then) holds nothing.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an SSE stream may carry nothing before a comment goes out on it, so that a
/// client gone without closing its connection is found out (see [`keep_peers_honest`]).
const SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How long data sent on a connection may stay unacknowledged, and how long an idle
/// connection goes before TCP asks whether its peer is still there: past the first, or
/// with the question unanswered [`KEEPALIVE_INTERVAL`] after the second (the user timeout
/// has passed by then, which ends the connection at its first unanswered probe), the
/// connection is dropped and whatever it held (a GET stream, a slot of its source) freed.
const PEER_SILENCE_LIMIT: Duration = Duration::from_secs(60);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a session must have been idle before a new one of its principal may replace it
/// at the principal's cap.
const EVICTABLE_AFTER: Duration = Duration::from_secs(60);
/// How long a request's body may take to arrive once its head has.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest request id or progress token accepted, as JSON text.
const MAX_ID_BYTES: usize = 256;

type Body = BoxBody<Bytes, Infallible>;
/// A refusal before any session logic runs: its status and why.
type Refused = (StatusCode, String);

/// Why the HTTP listener could not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The address could not be bound.
    #[error("http.listen {addr}: cannot listen: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// The TLS files are unusable.
    #[error("http.tls: {0}")]
    Tls(String),
    /// The authentication setup failed (for example the JWT key set).
    #[error("http.jwt.jwks: {0}")]
    Auth(#[from] auth::AuthSetupError),
}

/// A bound HTTP listener, ready to serve.
pub struct HttpListener {
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    certificates: Option<Arc<Certificates>>,
    config: HttpConfig,
    auth: Arc<Authenticator>,
}

impl HttpListener {
    /// Binds `config.listen` and loads its TLS files and JWT key set.
    pub fn bind(config: &HttpConfig) -> Result<Self, HttpError> {
        let auth = Arc::new(Authenticator::new(config)?);
        let (tls, certificates) = config.tls.as_ref().map(tls::acceptor).transpose()?.unzip();
        let bind = |source| HttpError::Bind {
            addr: config.listen,
            source,
        };
        let socket = match config.listen {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .map_err(bind)?;
        // As std's bind does: a restarted daemon binds while the old connections linger.
        socket.set_reuseaddr(true).map_err(bind)?;
        socket.bind(config.listen).map_err(bind)?;
        let listener = socket.listen(LISTEN_BACKLOG).map_err(bind)?;
        Ok(HttpListener {
            listener,
            tls,
            certificates,
            config: config.clone(),
            auth,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Who authenticates its callers, shared with the host (which gives it the issuer's key
    /// set again at each reload).
    pub fn authenticator(&self) -> Arc<Authenticator> {
        self.auth.clone()
    }

    /// The certificates the listener presents, when it speaks TLS: each reload reads their
    /// files again.
    pub fn certificates(&self) -> Option<Arc<Certificates>> {
        self.certificates.clone()
    }
}

/// One HTTP session: the channel into its session logic and its streams.
struct Remote {
    principal: PrincipalId,
    /// The session's id in its records (not the `Mcp-Session-Id`, which stays out of them).
    record_id: String,
    inbox: mpsc::Sender<Line>,
    streams: Arc<Mutex<Streams>>,
    /// Told when the client ends the session (`DELETE`): the session then stops as for a
    /// client that went away, its calls in flight cancelled and its executors stopped.
    ended: Arc<tokio::sync::Notify>,
    /// When a request last named it.
    last_used: Mutex<std::time::Instant>,
}

impl Remote {
    /// Hands `message` (of `kind`, its text `line`) to the session. A request gets its
    /// stream (`json_only` when its client takes only JSON); anything else gets `None`.
    ///
    /// What the streams record (a request in flight, a cancel) is recorded only together
    /// with the handing over: room in the session's inbox is taken first, and from then on
    /// nothing waits. A client that gives up while the session is busy (hyper then drops
    /// this future) leaves nothing behind: no request in flight forever (its id refused,
    /// its session never idle), no request ended that the session will still answer.
    async fn hand_over(
        &self,
        message: &Value,
        kind: &crate::mcp::Incoming,
        line: Vec<u8>,
        json_only: bool,
    ) -> Result<Option<Events>, Response<Body>> {
        let Ok(room) = self.inbox.reserve().await else {
            return Err(http_error(StatusCode::NOT_FOUND, "the session has ended"));
        };
        let Ok(mut streams) = self.streams.lock() else {
            return Err(http_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "session state lost",
            ));
        };
        let events = match kind {
            // An answer is routed by its id: a second request with the same id would take
            // the first one's answer.
            crate::mcp::Incoming::Request { .. } if streams.in_flight(message) => {
                return Err(json_body(
                    StatusCode::CONFLICT,
                    &json!({"jsonrpc": "2.0", "id": null, "error": {"code": code::INVALID_REQUEST, "message": format!("request id {} is already in flight in this session", message["id"]), "data": {"denial": crate::decision::Denial::RequestIdInFlight.as_str()}}}),
                ));
            }
            crate::mcp::Incoming::Request { .. } => {
                Some(streams.open_for_request(message, json_only))
            }
            crate::mcp::Incoming::Notification { method, params }
                if method == "notifications/cancelled" =>
            {
                if let Some(cancelled) = params.get("requestId") {
                    streams.cancelled(&cancelled.to_string());
                }
                None
            }
            _ => None,
        };
        room.send(Line::Message(line));
        Ok(events)
    }

    /// Hands the session a line that is no valid message (malformed, or too large, of which
    /// it holds the start) but names an id, for it to settle a relayed request that id names
    /// (see the session's handling of such lines).
    async fn hand_over_line(&self, line: Line) {
        if let Ok(room) = self.inbox.reserve().await {
            room.send(line);
        }
    }

    /// How long the session has been idle: nothing in flight, no stream a client reads, and
    /// no request for that long. `None` while it is in use.
    fn idle_for(&self) -> Option<Duration> {
        let in_use = self.streams.lock().map_or(true, |s| s.in_use());
        let last = *self.last_used.lock().ok()?;
        (!in_use).then(|| last.elapsed())
    }
}

/// Why a request body was not taken.
enum BodyError {
    /// Past the limit after `seen` bytes; `head` holds its first bytes (at most
    /// [`crate::mcp::OVERSIZED_HEAD`]), enough to name the id of an answer.
    TooLarge { seen: usize, head: Vec<u8> },
    /// The connection failed while it was read.
    Unreadable(String),
}

/// The body of a request, at most `limit` bytes; read no further once past it.
async fn body_within(mut body: Incoming, limit: usize) -> Result<Vec<u8>, BodyError> {
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyError::Unreadable(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if bytes.len() + data.len() > limit {
            let seen = bytes.len() + data.len();
            let room = crate::mcp::OVERSIZED_HEAD.saturating_sub(bytes.len());
            bytes.truncate(crate::mcp::OVERSIZED_HEAD);
            bytes.extend_from_slice(&data[..data.len().min(room)]);
            return Err(BodyError::TooLarge { seen, head: bytes });
        }
        bytes.extend_from_slice(&data);
    }
    Ok(bytes)
}

/// Which of `held` (each session's id, principal, time since it was last used, and whether
/// it is busy: a request in flight or a stream read) makes room for a new session of
/// `principal` when all sessions are taken: of the principal holding the most, when that
/// one holds at least two more than `principal` does (so that the two never trade a session
/// back and forth), the least recently used of its idle sessions, else of its busy ones.
fn fair_share_eviction<'a>(
    held: impl Iterator<Item = (&'a str, &'a PrincipalId, Duration, bool)>,
    principal: &PrincipalId,
) -> Option<String> {
    let held: Vec<_> = held.collect();
    let mut counts: HashMap<&PrincipalId, usize> = HashMap::new();
    for (_, p, _, _) in &held {
        *counts.entry(*p).or_default() += 1;
    }
    let own = counts.get(principal).copied().unwrap_or(0);
    let (top, most) = counts.iter().max_by_key(|(_, n)| **n)?;
    if *most < own + 2 {
        return None;
    }
    held.iter()
        .filter(|(_, p, _, _)| p == top)
        .max_by_key(|(_, _, since, busy)| (!*busy, *since))
        .map(|(id, _, _, _)| (*id).to_owned())
}

/// The record budget of unauthenticated callers in the current fold interval.
struct Budget {
    started: std::time::Instant,
    recorded: usize,
    folded: u64,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            started: std::time::Instant::now(),
            recorded: 0,
            folded: 0,
        }
    }
}

struct Transport {
    host: Arc<Host>,
    budget: Mutex<Budget>,
    config: HttpConfig,
    auth: Arc<Authenticator>,
    sessions: Mutex<HashMap<String, Arc<Remote>>>,
    scheme: &'static str,
    /// What the sessions keep for replay, together.
    replay: Arc<ReplayBudget>,
}

/// Serves MCP over HTTP on `listener` until the host stops, then waits (bounded) for its
/// sessions to end. Returns whether some had not ended by then (the stop abandons what they
/// still had in flight).
pub async fn serve(host: Arc<Host>, listener: HttpListener) -> bool {
    let HttpListener {
        listener,
        tls,
        config,
        auth,
        ..
    } = listener;
    let transport = Arc::new(Transport {
        scheme: if tls.is_some() { "https" } else { "http" },
        host: host.clone(),
        config,
        auth,
        sessions: Mutex::new(HashMap::new()),
        budget: Mutex::new(Budget::default()),
        replay: Arc::default(),
    });
    let mut fold_tick = tokio::time::interval(
        host.current()
            .config
            .refusal_fold_interval
            .max(Duration::from_millis(100)),
    );
    // The bound address (the configured one may name port 0).
    let bound = listener
        .local_addr()
        .map_or_else(|_| transport.config.listen.to_string(), |a| a.to_string());
    tracing::info!(
        listen = %bound,
        path = %transport.config.path,
        tls = tls.is_some(),
        "serving MCP over Streamable HTTP"
    );
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let sources = Arc::new(Sources::new(transport.config.max_connections_per_source));
    let unproven = Unproven::new(UNPROVEN_LIMIT);
    let mut refused_connections: u64 = 0;
    let mut refused_from_source: u64 = 0;
    let mut made_room: u64 = 0;
    let mut refused_unproven: u64 = 0;
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(error = %e, "http accept failed; pausing accepts for 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = fold_tick.tick() => {
                if let Err(e) = transport.record_refusal(None, false).await {
                    tracing::error!(error = %e.message, "folded authentication refusals not recorded");
                }
                continue;
            }
            _ = host.stopped() => break,
        };
        // The source's own limit first: a host at its limit takes none of the shared ones.
        let Some(source) = sources.take(peer.ip()) else {
            refused_from_source += 1;
            // Said once per 1,000, so a flood does not flood the log too.
            if refused_from_source % 1000 == 1 {
                tracing::warn!(%peer, refused = refused_from_source, "http connection closed at once: {} are open from its source (http.max_connections_per_source)", sources.limit());
            }
            drop(stream);
            continue;
        };
        let (slot, closed) = match unproven
            .enter(sources::source_of(peer.ip()), std::time::Instant::now())
        {
            Ok(entered) => entered,
            Err(NoEntry::Unreadable) => {
                tracing::warn!(%peer, "http connection closed at once: the count of unauthenticated connections cannot be read");
                drop(stream);
                continue;
            }
            Err(NoEntry::Full) => {
                refused_unproven += 1;
                if refused_unproven % 1000 == 1 {
                    tracing::warn!(%peer, refused = refused_unproven, "http connection closed at once: {UNPROVEN_LIMIT} are open without an authenticated request, each within its first {} s and from a source holding no more than this one's", UNPROVEN_GRACE.as_secs());
                }
                drop(stream);
                continue;
            }
        };
        if closed != Closed::Nothing {
            made_room += 1;
            if made_room % 1000 == 1 {
                tracing::warn!(%peer, closed = made_room, "http connection closed to make room: {UNPROVEN_LIMIT} were open without an authenticated request, and the oldest of the source holding the most made way for the newest");
            }
        }
        // At the limit in all, an unproven connection makes room when there is one; its
        // place comes free once its task has let go of it.
        let connection = match connections.clone().try_acquire_owned() {
            Ok(connection) => Some(connection),
            // The one closed to count this one held a place: that one comes free.
            Err(_) if closed == Closed::Placed => None,
            Err(_) if unproven.make_room(&slot, std::time::Instant::now()) => {
                made_room += 1;
                if made_room % 1000 == 1 {
                    tracing::warn!(%peer, closed = made_room, "http connection closed to make room: {MAX_CONNECTIONS} were open, and the oldest unauthenticated one of the source holding the most made way for the newest");
                }
                None
            }
            Err(_) => {
                refused_connections += 1;
                if refused_connections % 1000 == 1 {
                    tracing::warn!(%peer, refused = refused_connections, "http connection closed at once: {MAX_CONNECTIONS} are open");
                }
                drop(stream);
                continue;
            }
        };
        // Responses go out in several writes (head, SSE events): without NODELAY each small
        // write after the first waits for the client's delayed ACK (tens of ms).
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        if let Err(e) = keep_peers_honest(&stream) {
            // Without them a vanished client's connection could be held for good: refused.
            tracing::warn!(%peer, error = %e, "http connection closed at once: cannot set its TCP keepalive and user timeout");
            drop(stream);
            continue;
        }
        let transport = transport.clone();
        let tls = tls.clone();
        let connections = connections.clone();
        tokio::spawn(async move {
            let connection = match connection {
                Some(connection) => connection,
                // Told to close while waiting, it stops waiting: it holds no place to free.
                None => tokio::select! {
                    waited = tokio::time::timeout(ROOM_WAIT, connections.acquire_owned()) => match waited {
                        Ok(Ok(connection)) => connection,
                        _ => {
                            tracing::debug!(%peer, "http connection closed: no room came free");
                            return;
                        }
                    },
                    () = slot.closing() => return,
                },
            };
            slot.holds_place();
            let _connection = (connection, source);
            let slot = Arc::new(slot);
            let closing = slot.clone();
            tokio::select! {
                () = serve_one(transport, tls, stream, peer, slot) => {}
                () = closing.closing() => {
                    tracing::debug!(%peer, "unauthenticated http connection closed: a newer one took its place");
                }
            }
        });
    }

    drop(listener);
    if let Err(e) = transport.record_refusal(None, true).await {
        tracing::error!(error = %e.message, "folded authentication refusals not recorded");
    }
    let deadline = tokio::time::Instant::now() + host.current().config.call_timeout;
    while transport.live_sessions() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    transport.live_sessions() > 0
}

/// Serves one accepted connection until it ends; `slot` counts it as unproven until a
/// request on it is authenticated.
async fn serve_one(
    transport: Arc<Transport>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    slot: Arc<UnprovenSlot>,
) {
    let service = hyper::service::service_fn(move |req| {
        let transport = transport.clone();
        let slot = slot.clone();
        async move { Ok::<_, Infallible>(transport.handle(req, peer.ip(), &slot).await) }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let outcome = match tls {
        None => {
            http.serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
        }
        Some(acceptor) => {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    http.serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await
                }
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => return,
            }
        }
    };
    if let Err(e) = outcome {
        tracing::debug!(%peer, error = %e, "http connection ended with an error");
    }
}

/// Makes TCP find out about a peer that is gone without closing the connection (its host
/// down, the network cut): an idle connection is probed after [`PEER_SILENCE_LIMIT`] and
/// dropped when the probe is unanswered [`KEEPALIVE_INTERVAL`] later, and data left
/// unacknowledged for [`PEER_SILENCE_LIMIT`] ends it. Together with the comments on silent
/// SSE streams, no connection outlives its peer by much more than a minute.
fn keep_peers_honest(stream: &tokio::net::TcpStream) -> nix::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    setsockopt(stream, sockopt::KeepAlive, &true)?;
    setsockopt(
        stream,
        sockopt::TcpKeepIdle,
        &(PEER_SILENCE_LIMIT.as_secs() as u32),
    )?;
    setsockopt(
        stream,
        sockopt::TcpKeepInterval,
        &(KEEPALIVE_INTERVAL.as_secs() as u32),
    )?;
    setsockopt(
        stream,
        sockopt::TcpUserTimeout,
        &(PEER_SILENCE_LIMIT.as_millis() as u32),
    )
}

fn json_body(status: StatusCode, value: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(value.to_string())).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A plain HTTP error with a JSON-RPC error body (`id` null), as clients expect.
fn http_error(status: StatusCode, message: &str) -> Response<Body> {
    json_body(
        status,
        &json!({"jsonrpc": "2.0", "id": null, "error": {"code": code::INVALID_REQUEST, "message": message}}),
    )
}

/// Why a header that was sent cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UnreadableHeader {
    /// It was sent more than once (which value counts would be a guess).
    #[error("is sent more than once")]
    Repeated,
    /// Its value has bytes outside visible ASCII.
    #[error("is not visible ASCII")]
    NotAscii,
}

/// A header's value: `Ok(None)` only when it is not sent at all. One that is sent but
/// unreadable (repeated, or not visible ASCII) is an error, never taken as absent: a check
/// that passes an absent header (`Origin`, `Authorization` with a loopback principal)
/// would otherwise pass whoever garbles it.
fn single_header<'h>(
    headers: &'h HeaderMap,
    name: &str,
) -> Result<Option<&'h str>, UnreadableHeader> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(UnreadableHeader::Repeated);
    }
    value
        .to_str()
        .map(Some)
        .map_err(|_| UnreadableHeader::NotAscii)
}

/// [`single_header`], its error a refusal (`400`) naming the header.
fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, Refused> {
    single_header(headers, name)
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("the {name} header {e}")))
}

/// The request's `Host`, for URLs naming this server (every request's `Host` was found
/// readable and allowed before anything runs).
fn host_header(headers: &HeaderMap) -> &str {
    single_header(headers, header::HOST.as_str())
        .ok()
        .flatten()
        .unwrap_or("localhost")
}

/// Whether the client takes `text/event-stream` (`Accept` is a list, which may come in
/// several headers; a value that is not ASCII names nothing this server sends).
fn accepts_sse(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|a| a.contains("text/event-stream")))
}

/// The answer for a session id that names no session of the caller's.
fn no_such_session() -> Refused {
    (
        StatusCode::NOT_FOUND,
        "no such session; send initialize to open one".into(),
    )
}

/// The host part of a `Host` header or an origin's authority (IPv6 keeps its brackets).
fn host_of(authority: &str) -> String {
    let host = if authority.starts_with('[') {
        authority
            .find(']')
            .map_or(authority, |end| &authority[..=end])
    } else {
        match authority.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => authority,
        }
    };
    host.to_ascii_lowercase()
}

/// DNS rebinding protection: the `Host` header names an allowed host, and an `Origin`
/// header (browsers send it) is an allowed origin or one whose host is allowed. Either
/// header sent twice or unreadable is refused (`400`); one not allowed is forbidden.
fn check_host_and_origin(config: &HttpConfig, headers: &HeaderMap) -> Result<(), Refused> {
    let forbidden = |why: String| (StatusCode::FORBIDDEN, why);
    let host = header_str(headers, header::HOST.as_str())?
        .ok_or_else(|| forbidden("the request has no Host header".into()))?;
    if !config.allowed_hosts.contains(&host_of(host)) {
        return Err(forbidden(format!(
            "Host {host:?} is not a host this server answers to"
        )));
    }
    if let Some(origin) = header_str(headers, header::ORIGIN.as_str())? {
        let allowed = config.allowed_origins.iter().any(|o| o == origin)
            || origin
                .split_once("://")
                .filter(|(scheme, _)| *scheme == "http" || *scheme == "https")
                .is_some_and(|(_, authority)| config.allowed_hosts.contains(&host_of(authority)));
        if !allowed {
            return Err(forbidden(format!("Origin {origin:?} is not allowed")));
        }
    }
    Ok(())
}

impl Transport {
    fn live_sessions(&self) -> usize {
        self.sessions.lock().map_or(0, |s| s.len())
    }

    async fn handle(
        self: &Arc<Self>,
        req: Request<Incoming>,
        peer: std::net::IpAddr,
        slot: &UnprovenSlot,
    ) -> Response<Body> {
        let credential = match self.admit(&req, peer).await {
            // Proven, it no longer counts against connections without credentials.
            Ok(credential) if slot.prove() => credential,
            Ok(_) => {
                let mut closing = http_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "this connection sent no authenticated request before newer ones needed its place; connect again",
                );
                closing
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return closing;
            }
            // The connection goes with the answer: kept open, one request per header
            // timeout would hold the source's and the transport's connection slots for
            // good without ever authenticating.
            Err(mut answered) => {
                answered
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return answered;
            }
        };
        match *req.method() {
            Method::POST => self.post(req, credential).await,
            Method::GET => self.get(req.headers(), &credential).await,
            Method::DELETE => self.delete(req.headers(), &credential.principal).await,
            _ => {
                let mut r = http_error(StatusCode::METHOD_NOT_ALLOWED, "use POST, GET or DELETE");
                r.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, POST, DELETE"));
                r
            }
        }
    }

    /// The credential a request to the MCP endpoint comes with, or the answer for a request
    /// that is not one, or not authenticated (the public metadata included).
    async fn admit(
        &self,
        req: &Request<Incoming>,
        peer: std::net::IpAddr,
    ) -> Result<Credential, Response<Body>> {
        if let Err((status, why)) = check_host_and_origin(&self.config, req.headers()) {
            tracing::debug!("{why}; refused");
            return Err(http_error(status, &why));
        }
        let path = req.uri().path();
        if req.method() == Method::GET && path.starts_with("/.well-known/oauth-protected-resource")
        {
            return Err(self.resource_metadata(req.headers()));
        }
        if path != self.config.path {
            return Err(http_error(StatusCode::NOT_FOUND, "no MCP endpoint here"));
        }
        match header_str(req.headers(), VERSION_HEADER) {
            // Any revision the host speaks: the transport asks a client to name the one its
            // session negotiated, but not the server to refuse another (the MCP conformance
            // suite names 2025-03-26 on sessions that negotiated 2025-06-18).
            Ok(Some(v)) if crate::mcp::negotiate(v).is_none() => {
                return Err(http_error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "MCP-Protocol-Version {v:?} is not supported (this host speaks {})",
                        crate::mcp::SUPPORTED_PROTOCOL_VERSIONS.join(", ")
                    ),
                ));
            }
            Ok(_) => {}
            Err((status, why)) => return Err(http_error(status, &why)),
        }
        match self.auth.authenticate(req.headers(), peer) {
            Ok(p) => Ok(p),
            Err(refusal) => Err(self.unauthorized(req.headers(), refusal).await),
        }
    }

    /// Where the protected resource metadata is served, for this request's host.
    fn metadata_url(&self, headers: &HeaderMap) -> String {
        let base = match &self.config.resource {
            Some(r) => r
                .split_once("://")
                .map(|(s, rest)| format!("{s}://{}", rest.split('/').next().unwrap_or(rest)))
                .unwrap_or_else(|| r.clone()),
            None => format!("{}://{}", self.scheme, host_header(headers)),
        };
        format!(
            "{base}/.well-known/oauth-protected-resource{}",
            self.config.path
        )
    }

    fn resource_metadata(&self, headers: &HeaderMap) -> Response<Body> {
        let Some(jwt) = self.auth.jwt() else {
            return http_error(
                StatusCode::NOT_FOUND,
                "this server takes no OAuth access tokens",
            );
        };
        let resource = self.config.resource.clone().unwrap_or_else(|| {
            format!(
                "{}://{}{}",
                self.scheme,
                host_header(headers),
                self.config.path
            )
        });
        json_body(
            StatusCode::OK,
            &json!({
                "resource": resource,
                "authorization_servers": jwt.authorization_servers,
                "bearer_methods_supported": ["header"],
                "resource_name": "flowhost",
            }),
        )
    }

    /// Records the refusal and answers 401 with `WWW-Authenticate`.
    /// Records an authentication refusal (`what` says why). An unauthenticated caller is no
    /// principal and no peer the refusal folder can charge, so its refusals get the same
    /// budget here: past `refusal_records_per_interval` in one fold interval they are
    /// counted, and the count is recorded as one refusal when the interval closes.
    /// `close` closes the interval now (at shutdown).
    async fn record_refusal(&self, what: Option<String>, close: bool) -> Result<(), RpcError> {
        let config = &self.host.current().config;
        let (record, folded) = {
            let Ok(mut b) = self.budget.lock() else {
                return Err(pipeline::refusal(
                    code::INTERNAL_ERROR,
                    "the refusal budget is lost",
                    Denial::RecordFailure,
                ));
            };
            let folded = if close || b.started.elapsed() >= config.refusal_fold_interval {
                let folded = b.folded;
                *b = Budget::default();
                folded
            } else {
                0
            };
            let record = match what {
                Some(w) if b.recorded < config.refusal_records_per_interval => {
                    b.recorded += 1;
                    Some(w)
                }
                Some(_) => {
                    b.folded += 1;
                    None
                }
                None => None,
            };
            (record, folded)
        };
        if folded > 0 {
            let summary = format!("(http: {folded} further authentication refusals, folded)");
            if let Err(e) = self
                .record_session_refusal(&summary, None, Denial::AccessDenied, None)
                .await
            {
                // Not recorded: the count goes back, for the next summary to carry.
                if let Ok(mut b) = self.budget.lock() {
                    b.folded += folded;
                }
                return Err(e);
            }
        }
        if let Some(what) = record {
            self.record_session_refusal(&what, None, Denial::AccessDenied, None)
                .await?;
        }
        Ok(())
    }

    /// Records a refusal of `what` over HTTP, outside any session, for `principal` when the
    /// caller authenticated as one; an error when it could not be recorded.
    async fn record_session_refusal(
        &self,
        what: &str,
        principal: Option<&PrincipalId>,
        denial: Denial,
        session: Option<&str>,
    ) -> Result<(), RpcError> {
        let generation = self.host.current();
        let e = pipeline::refusal(code::ACCESS_DENIED, what.to_string(), denial);
        let recorded = pipeline::refuse_session(
            &session::env(&self.host, &generation),
            &Caller {
                session: session.unwrap_or("(none)"),
                peer: None,
                principal: Err(e.clone()),
                pinned: principal,
            },
            what,
            e,
            denial,
        )
        .await;
        if recorded.data_denial() == Some(Denial::RecordFailure.as_str()) {
            return Err(recorded);
        }
        Ok(())
    }

    async fn unauthorized(&self, headers: &HeaderMap, refusal: AuthRefusal) -> Response<Body> {
        /// Most characters of a refusal's message repeated in its challenge.
        const MOST_DESCRIPTION_CHARS: usize = 200;
        let message = refusal.to_string();
        if let Err(e) = self
            .record_refusal(Some(format!("(http: {message})")), false)
            .await
        {
            return http_error(StatusCode::SERVICE_UNAVAILABLE, &e.message);
        }
        let mut challenge = String::from("Bearer");
        let mut params = Vec::new();
        if self.auth.jwt().is_some() {
            params.push(format!(
                "resource_metadata=\"{}\"",
                self.metadata_url(headers)
            ));
        }
        if let Some(error) = refusal.oauth_error() {
            params.push(format!("error=\"{error}\""));
            // RFC 6750 allows visible ASCII but `"` and `\` here; the message repeats
            // what the token held (a line break, a non-ASCII letter), which would leave
            // the challenge no header value at all.
            let description: String = message
                .chars()
                .take(MOST_DESCRIPTION_CHARS)
                .map(|c| match c {
                    '"' | '\\' => '\'',
                    ' '..='~' => c,
                    _ => '?',
                })
                .collect();
            params.push(format!("error_description=\"{description}\""));
        }
        if !params.is_empty() {
            challenge.push(' ');
            challenge.push_str(&params.join(", "));
        }
        let mut r = http_error(StatusCode::UNAUTHORIZED, &message);
        if let Ok(v) = HeaderValue::from_str(&challenge) {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, v);
        }
        r
    }

    /// The session a request names, if it belongs to `principal`.
    async fn session_of(
        &self,
        headers: &HeaderMap,
        principal: &PrincipalId,
    ) -> Result<(String, Arc<Remote>), Refused> {
        let Some(id) = header_str(headers, SESSION_HEADER)? else {
            return Err((
                StatusCode::BAD_REQUEST,
                "send Mcp-Session-Id (initialize opens a session)".into(),
            ));
        };
        let remote = self.sessions.lock().ok().and_then(|s| s.get(id).cloned());
        match remote {
            Some(r) if r.principal == *principal => {
                if let Ok(mut last) = r.last_used.lock() {
                    *last = std::time::Instant::now();
                }
                Ok((id.to_string(), r))
            }
            // Another principal's session is as unknown to the caller as a closed one; the
            // attempt is recorded (without the id), so an id in the wrong hands leaves a trace.
            Some(_) => match self
                .record_session_refusal(
                    "(http: a request named another principal's session)",
                    Some(principal),
                    Denial::AccessDenied,
                    None,
                )
                .await
            {
                Ok(()) => Err(no_such_session()),
                Err(e) => Err((StatusCode::SERVICE_UNAVAILABLE, e.message)),
            },
            None => Err(no_such_session()),
        }
    }

    async fn post(
        self: &Arc<Self>,
        req: Request<Incoming>,
        credential: Credential,
    ) -> Response<Body> {
        let principal = credential.principal.clone();
        let accepts_sse = accepts_sse(req.headers());
        let headers = req.headers().clone();
        let limit = self.host.current().config.max_message_bytes;
        let body = body_within(req.into_body(), limit);
        let bytes = match tokio::time::timeout(BODY_READ_TIMEOUT, body).await {
            Ok(Ok(b)) => b,
            Ok(Err(BodyError::TooLarge { seen, head })) => {
                // An answer to a request the session relayed to the client (a long
                // completion): the session is told, so that request stops waiting for it,
                // as on the socket.
                if super::relay::relay_id_in(&head).is_some()
                    && headers.contains_key(SESSION_HEADER)
                    && let Ok((_, remote)) = self.session_of(&headers, &principal).await
                {
                    remote
                        .hand_over_line(Line::TooLarge { bytes: seen, head })
                        .await;
                }
                return http_error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("the body exceeds {limit} bytes"),
                );
            }
            Ok(Err(BodyError::Unreadable(e))) => {
                return http_error(
                    StatusCode::BAD_REQUEST,
                    &format!("the body could not be read: {e}"),
                );
            }
            // A body sent a byte at a time would hold the connection (and its slot) forever.
            Err(_) => {
                return http_error(
                    StatusCode::REQUEST_TIMEOUT,
                    &format!("the body did not arrive within {BODY_READ_TIMEOUT:?}"),
                );
            }
        };
        let message: Value = match serde_json::from_slice(&bytes) {
            Ok(v @ Value::Object(_)) => v,
            Ok(_) => {
                return http_error(
                    StatusCode::BAD_REQUEST,
                    "send one JSON-RPC message (batches are not accepted)",
                );
            }
            Err(e) => {
                return json_body(
                    StatusCode::BAD_REQUEST,
                    &json!({"jsonrpc": "2.0", "id": null, "error": {"code": code::PARSE_ERROR, "message": e.to_string()}}),
                );
            }
        };
        let method = message.get("method").and_then(Value::as_str);
        let id = message.get("id");
        // JSON-RPC ids are strings or integers: another id could never be matched to its
        // answer, so the request is refused here, before any session sees it.
        if let Some(id) = id
            && !(id.is_string() || id.is_i64() || id.is_u64())
        {
            return json_body(
                StatusCode::BAD_REQUEST,
                &json!({"jsonrpc": "2.0", "id": null, "error": {"code": code::INVALID_REQUEST, "message": "the request id must be a string or an integer"}}),
            );
        }
        // Every event of a stream is kept for resumption and each repeats its request's id
        // or progress token: longer ones would let a client make the host keep any amount.
        let too_long = |v: Option<&Value>| v.is_some_and(|v| v.to_string().len() > MAX_ID_BYTES);
        if too_long(id) || too_long(message.pointer("/params/_meta/progressToken")) {
            return json_body(
                StatusCode::BAD_REQUEST,
                &json!({"jsonrpc": "2.0", "id": null, "error": {"code": code::INVALID_REQUEST, "message": format!("a request id or progress token is at most {MAX_ID_BYTES} bytes")}}),
            );
        }
        // What the session would answer as invalid is answered here, to its sender: the
        // session's answer would go to whichever stream is open.
        let kind = match crate::mcp::classify(&message) {
            Ok(kind) => kind,
            Err((id, e)) => {
                // A malformed answer (no method) to a request the session relayed to the
                // client (an id of the host's relays): the session is told, so that request
                // stops waiting for an answer (the session's own refusal of it goes to no
                // stream: no request of the client's has a relay's id).
                if method.is_none()
                    && id
                        .as_str()
                        .is_some_and(|i| i.starts_with(super::relay::RELAY_ID_PREFIX))
                    && headers.contains_key(SESSION_HEADER)
                    && let Ok((_, remote)) = self.session_of(&headers, &principal).await
                {
                    remote.hand_over_line(Line::Message(bytes.to_vec())).await;
                }
                return json_body(
                    StatusCode::BAD_REQUEST,
                    &json!({"jsonrpc": "2.0", "id": id, "error": {"code": e.code, "message": e.message}}),
                );
            }
        };
        // Only an initialize request opens a session (a notification named so does not).
        let (session_id, remote) = if method == Some("initialize")
            && id.is_some()
            && !headers.contains_key(SESSION_HEADER)
        {
            match self.open(&principal) {
                Ok(v) => v,
                Err((status, why)) => return http_error(status, &why),
            }
        } else {
            match self.session_of(&headers, &principal).await {
                Ok(v) => v,
                Err((status, why)) => return http_error(status, &why),
            }
        };
        let events = match remote
            .hand_over(&message, &kind, bytes.to_vec(), !accepts_sse)
            .await
        {
            Ok(Some(events)) => events,
            // A notification or a response: accepted once it is handed over.
            Ok(None) => {
                let mut r = Response::new(Full::new(Bytes::new()).boxed());
                *r.status_mut() = StatusCode::ACCEPTED;
                return r;
            }
            // An id already in flight: refused like any refusal of an identified peer, with
            // a record (its session's, its principal's).
            Err(refused) if refused.status() == StatusCode::CONFLICT => {
                let what = session::named_method(method.unwrap_or("request"));
                return match self
                    .record_session_refusal(
                        &what,
                        Some(&principal),
                        Denial::RequestIdInFlight,
                        Some(&remote.record_id),
                    )
                    .await
                {
                    Ok(()) => refused,
                    Err(e) => http_error(StatusCode::SERVICE_UNAVAILABLE, &e.message),
                };
            }
            Err(refused) => return refused,
        };
        // An answer that comes after the credential stopped authenticating (it expired, or
        // a reload revoked it) does not go to its holder.
        let events = events.while_true(self.validity(credential));
        let mut response = if accepts_sse {
            sse_response(events)
        } else {
            json_answer(events).await
        };
        if let Ok(v) = HeaderValue::from_str(&session_id) {
            response.headers_mut().insert(SESSION_HEADER, v);
        }
        response
    }

    /// Opens a session for `principal`: its session logic, and the task routing what it
    /// sends to the streams.
    fn open(self: &Arc<Self>, principal: &PrincipalId) -> Result<(String, Arc<Remote>), Refused> {
        let mut sessions = self.sessions.lock().map_err(|_| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "session table lost".to_string(),
            )
        })?;
        let of_principal = sessions
            .values()
            .filter(|r| r.principal == *principal)
            .count();
        // At the principal's cap, its longest-idle session makes room (clients that end
        // without DELETE would otherwise lock the principal out for the idle window); its
        // client gets 404 next and opens another, as the transport says a client does.
        if of_principal >= MAX_SESSIONS_PER_PRINCIPAL
            && let Some(id) = sessions
                .iter()
                .filter(|(_, r)| r.principal == *principal)
                .filter_map(|(id, r)| Some((id.clone(), r.idle_for()?)))
                .filter(|(_, idle)| *idle >= EVICTABLE_AFTER)
                .max_by_key(|(_, idle)| *idle)
                .map(|(id, _)| id)
            && let Some(evicted) = sessions.remove(&id)
        {
            tracing::info!(principal = %principal, "a new HTTP session replaces the principal's longest-idle one");
            evicted.ended.notify_one();
        }
        // At the cap of all sessions, a principal holding fewer than another takes that
        // one's least recently used session: principals that keep their sessions busy
        // would otherwise shut every other principal out.
        if sessions.len() >= MAX_SESSIONS
            && let Some(id) = fair_share_eviction(
                sessions.iter().map(|(id, r)| {
                    let since = r.last_used.lock().map_or(Duration::ZERO, |t| t.elapsed());
                    (id.as_str(), &r.principal, since, r.idle_for().is_none())
                }),
                principal,
            )
            && let Some(evicted) = sessions.remove(&id)
        {
            tracing::info!(principal = %principal, holder = %evicted.principal, "at the cap of HTTP sessions, a new one replaces the least recently used of the principal holding the most");
            evicted.ended.notify_one();
        }
        let of_principal = sessions
            .values()
            .filter(|r| r.principal == *principal)
            .count();
        if sessions.len() >= MAX_SESSIONS || of_principal >= MAX_SESSIONS_PER_PRINCIPAL {
            return Err((
                StatusCode::SERVICE_UNAVAILABLE,
                "too many open sessions; end one (DELETE) first".into(),
            ));
        }
        let id = super::random_id();
        let (inbox, lines) = mpsc::channel::<Line>(16);
        // Unbounded: each notice is a request of a call in flight, of which a session has at
        // most 64 with 4 requests each; the router must never wait on the session, which may
        // itself be waiting for room among the replies the router drains.
        let (not_delivered, undelivered) = mpsc::unbounded_channel();
        let (out, mut replies) = mpsc::channel::<session::Outgoing>(64);
        let streams = Arc::new(Mutex::new(Streams::sharing(self.replay.clone())));
        let ended = Arc::new(tokio::sync::Notify::new());
        let record_id = super::random_id();
        let remote = Arc::new(Remote {
            principal: principal.clone(),
            record_id: record_id.clone(),
            inbox,
            streams: streams.clone(),
            ended: ended.clone(),
            last_used: Mutex::new(std::time::Instant::now()),
        });
        sessions.insert(id.clone(), remote.clone());
        drop(sessions);
        let transport = self.clone();
        let session_id = id.clone();
        let identity = Identity::Principal(principal.clone());
        let routed = streams.clone();
        tokio::spawn(async move {
            // Owns the replies' receiver: when it returns (the session ended, or the client
            // ended it), the session sees its client gone.
            let router = async move {
                loop {
                    let message = tokio::select! {
                        m = replies.recv() => match m {
                            Some(m) => m,
                            None => break,
                        },
                        () = ended.notified() => break,
                    };
                    let undelivered = match routed.lock() {
                        Ok(mut s) => s.route(&message.line, message.request.as_deref()),
                        Err(_) => None,
                    };
                    if let Some(n) = undelivered {
                        // The session is over when this fails: nothing awaits the request.
                        let _ = not_delivered.send(n);
                    }
                }
            };
            tokio::join!(
                session::run(
                    transport.host.clone(),
                    record_id,
                    identity,
                    lines,
                    out,
                    Some(undelivered)
                ),
                router
            );
            if let Ok(mut s) = streams.lock() {
                s.close_all();
            }
            if let Ok(mut s) = transport.sessions.lock() {
                s.remove(&session_id);
            }
        });
        Ok((id, remote))
    }

    /// Whether `credential` still authenticates, for what a request made with it opened.
    fn validity(&self, credential: Credential) -> streams::Validity {
        let auth = self.auth.clone();
        Arc::new(move || auth.still_accepts(&credential))
    }

    async fn get(&self, headers: &HeaderMap, credential: &Credential) -> Response<Body> {
        let principal = &credential.principal;
        if !accepts_sse(headers) {
            return http_error(
                StatusCode::NOT_ACCEPTABLE,
                "GET serves text/event-stream only",
            );
        }
        let (_, remote) = match self.session_of(headers, principal).await {
            Ok(v) => v,
            Err((status, why)) => return http_error(status, &why),
        };
        // An unreadable Last-Event-ID is refused: read as absent, it would open the
        // session's GET stream instead of the stream the client asked for.
        let target = match header_str(headers, "last-event-id") {
            Ok(Some(last)) => Target::Resume(last.to_string()),
            Ok(None) => Target::Standalone,
            Err((status, why)) => return http_error(status, &why),
        };
        let resuming = matches!(target, Target::Resume(_));
        let opened = match remote.streams.lock() {
            Ok(mut s) => s.attach(target),
            Err(_) => return http_error(StatusCode::INTERNAL_SERVER_ERROR, "session state lost"),
        };
        match opened {
            // The stream ends once the credential that opened it no longer authenticates.
            Ok(events) => sse_response(events.while_true(self.validity(credential.clone()))),
            Err(streams::AttachError::Busy) => http_error(
                StatusCode::CONFLICT,
                if resuming {
                    "a client already reads the stream Last-Event-ID names"
                } else {
                    "this session already has its GET stream open"
                },
            ),
            Err(streams::AttachError::Unknown) => http_error(
                StatusCode::BAD_REQUEST,
                "Last-Event-ID names no stream of this session that can be replayed",
            ),
            Err(streams::AttachError::TooMany) => http_error(
                StatusCode::TOO_MANY_REQUESTS,
                &format!(
                    "this session has {} GET streams open; close one first",
                    streams::MAX_GETS
                ),
            ),
        }
    }

    async fn delete(&self, headers: &HeaderMap, principal: &PrincipalId) -> Response<Body> {
        let (id, remote) = match self.session_of(headers, principal).await {
            Ok(v) => v,
            Err((status, why)) => return http_error(status, &why),
        };
        // The session stops as for a client that went away: its calls in flight are
        // cancelled and its executors stopped, rather than run on uncounted once it has left
        // the table (whose size is what the session limits count).
        remote.ended.notify_one();
        if let Ok(mut s) = self.sessions.lock() {
            s.remove(&id);
        }
        no_content()
    }
}

/// An empty `204 No Content`.
fn no_content() -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::new()).boxed());
    *r.status_mut() = StatusCode::NO_CONTENT;
    r
}

/// An SSE response carrying a stream's events as they come (the response holds the
/// stream's reader until it is sent or its client is gone).
fn sse_response(events: Events) -> Response<Body> {
    let events = events.keep_alive(SSE_KEEP_ALIVE);
    let body = StreamBody::new(tokio_stream::StreamExt::map(events, |event| {
        Ok::<_, Infallible>(Frame::data(event))
    }));
    let mut r = Response::new(BodyExt::boxed(body));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// The answer to a request as one JSON body, for a client that takes no SSE: the stream's
/// last event (its response). Notifications before it have nowhere to go and are dropped;
/// requests to the client went to the GET stream or were reported to the session as
/// undelivered.
async fn json_answer(mut events: Events) -> Response<Body> {
    let mut last = None;
    let mut cancelled = false;
    while let Some(event) = events.recv().await {
        if streams::is_cancellation(&event) {
            cancelled = true;
            continue;
        }
        last = streams::data_of(&event);
    }
    match last.and_then(|d| serde_json::from_str::<Value>(&d).ok()) {
        Some(v) => json_body(StatusCode::OK, &v),
        // The client cancelled it: no answer (as over SSE), and the session goes on; a 404
        // would tell the client its session had ended.
        None if cancelled => no_content(),
        // The request's credential stopped authenticating (a JWT expired, a token revoked)
        // while it ran: the session goes on, and the client is told to authenticate again,
        // not that its session ended (a 404 would have it open another).
        None if !events.still_valid() => {
            let mut r = http_error(
                StatusCode::UNAUTHORIZED,
                "the request's credential stopped authenticating before its answer could be \
                 given (what it did is in the records); authenticate again",
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer error=\"invalid_token\""),
            );
            r
        }
        // Ended by DELETE, its idle window or the host stopping: the session is gone, and
        // nothing failed in the host.
        None => http_error(StatusCode::NOT_FOUND, "the session ended before answering"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At the cap of all sessions, a principal holding fewer takes the least recently used
    /// session of the one holding the most. Before, principals keeping 64 sessions each
    /// busy shut every other principal out (503) for as long as they liked.
    #[test]
    fn at_the_cap_a_principal_holding_fewer_takes_a_session_of_the_one_holding_most() {
        let (a, b, c) = (
            PrincipalId::new("a").unwrap(),
            PrincipalId::new("b").unwrap(),
            PrincipalId::new("c").unwrap(),
        );
        let secs = Duration::from_secs;
        let ids: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
        let held = [
            (ids[0].as_str(), &a, secs(5), false),
            (ids[1].as_str(), &a, secs(50), false),
            (ids[2].as_str(), &a, secs(1), false),
            (ids[3].as_str(), &b, secs(500), false),
            (ids[4].as_str(), &b, secs(900), false),
        ];
        assert_eq!(
            fair_share_eviction(held.iter().copied(), &c).as_deref(),
            Some("s1")
        );
        // An idle session goes before a busy one (a long call, a stream read), however
        // recently the idle one was used.
        let mut busy = held;
        busy[1].3 = true;
        assert_eq!(
            fair_share_eviction(busy.iter().copied(), &c).as_deref(),
            Some("s0")
        );
        // b holds one fewer than a: taking one of a's leaves them even.
        assert_eq!(
            fair_share_eviction(held.iter().copied(), &b).as_deref(),
            None,
            "a holds 3, b 2: a new one of b's would make it 3 and a 2"
        );
        let even = [
            held[0],
            held[1],
            held[3],
            held[4],
            (ids[5].as_str(), &c, secs(3), false),
        ];
        assert_eq!(fair_share_eviction(even.iter().copied(), &c), None);
        assert_eq!(fair_share_eviction(held.iter().copied(), &a), None);
    }

    /// An accepted connection is set to find out about a peer that vanished: a keepalive
    /// probe after a minute idle, and a minute at most for unacknowledged data.
    #[tokio::test]
    async fn accepted_connections_probe_their_peer() {
        use nix::sys::socket::{getsockopt, sockopt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap());
        let (accepted, _client) = tokio::join!(listener.accept(), client);
        let (stream, _) = accepted.unwrap();
        assert!(!getsockopt(&stream, sockopt::KeepAlive).unwrap());
        keep_peers_honest(&stream).unwrap();
        assert!(getsockopt(&stream, sockopt::KeepAlive).unwrap());
        assert_eq!(getsockopt(&stream, sockopt::TcpKeepIdle).unwrap(), 60);
        assert_eq!(getsockopt(&stream, sockopt::TcpKeepInterval).unwrap(), 10);
        assert_eq!(
            getsockopt(&stream, sockopt::TcpUserTimeout).unwrap(),
            60_000
        );
    }

    fn config() -> HttpConfig {
        let text = "[host]\nsocket = \"s\"\nstate_dir = \"st\"\nrecords_dir = \"r\"\n[[principal]]\nid = \"a\"\ntools = [\"*\"]\n[http]\nallowed_origins = [\"https://app.example\"]\n[[http.token]]\nprincipal = \"a\"\nsha256 = \"2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824\"\n";
        crate::config::HostConfig::parse(std::path::Path::new("/etc/h.toml"), text)
            .unwrap()
            .http
            .unwrap()
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    /// A session whose inbox is full (one line queued, nobody reading), and the inbox's
    /// receiving end, which keeps it open.
    fn busy_remote() -> (Remote, mpsc::Receiver<Line>) {
        let (inbox, lines) = mpsc::channel(1);
        inbox.try_send(Line::Message(b"{}".to_vec())).unwrap();
        let remote = Remote {
            principal: PrincipalId::new("a").unwrap(),
            record_id: "s-1".into(),
            inbox,
            streams: Arc::new(Mutex::new(Streams::default())),
            ended: Arc::new(tokio::sync::Notify::new()),
            last_used: Mutex::new(std::time::Instant::now()),
        };
        (remote, lines)
    }

    /// Hands `message` to `remote`, giving up (as hyper does when the client disconnects)
    /// after a while; whether it was handed over.
    async fn hand_over_or_give_up(remote: &Remote, message: &Value) -> bool {
        let kind = crate::mcp::classify(message).unwrap();
        let line = message.to_string().into_bytes();
        tokio::time::timeout(
            Duration::from_millis(50),
            remote.hand_over(message, &kind, line, false),
        )
        .await
        .is_ok()
    }

    /// A request whose client gives up while the session has no room for it never reached
    /// the session: it is not left in flight (its id refused, its session never idle).
    #[tokio::test]
    async fn a_request_given_up_before_the_session_took_it_is_not_in_flight() {
        let (remote, mut lines) = busy_remote();
        let request = json!({"jsonrpc": "2.0", "id": 7, "method": "ping"});
        assert!(!hand_over_or_give_up(&remote, &request).await);
        {
            let streams = remote.streams.lock().unwrap();
            assert!(!streams.in_flight(&request));
            assert!(!streams.in_use());
        }
        // With room, the request is in flight and with the session.
        lines.try_recv().unwrap();
        assert!(hand_over_or_give_up(&remote, &request).await);
        assert!(remote.streams.lock().unwrap().in_flight(&request));
        assert!(
            matches!(lines.try_recv(), Ok(Line::Message(m)) if m == request.to_string().into_bytes())
        );
    }

    /// A cancel whose client gives up before the session took it was never seen by the
    /// session, which will answer the request: it stays in flight on its stream.
    #[tokio::test]
    async fn a_cancel_given_up_before_the_session_took_it_changes_nothing() {
        let (remote, _lines) = busy_remote();
        let request = json!({"jsonrpc": "2.0", "id": 7, "method": "ping"});
        let _stream = remote
            .streams
            .lock()
            .unwrap()
            .open_for_request(&request, false);
        let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}});
        assert!(!hand_over_or_give_up(&remote, &cancel).await);
        assert!(remote.streams.lock().unwrap().in_flight(&request));
    }

    #[test]
    fn only_loopback_hosts_and_allowed_origins_pass() {
        let c = config();
        for ok in ["localhost:8931", "127.0.0.1", "[::1]:80", "LOCALHOST"] {
            assert!(
                check_host_and_origin(&c, &headers(&[("host", ok)])).is_ok(),
                "{ok}"
            );
        }
        for bad in [
            "evil.example",
            "evil.example:8931",
            "127.0.0.1.evil.example",
            "[::2]:80",
        ] {
            assert!(
                check_host_and_origin(&c, &headers(&[("host", bad)])).is_err(),
                "{bad}"
            );
        }
        assert!(check_host_and_origin(&c, &headers(&[])).is_err());
        let with_origin = |o: &str| headers(&[("host", "localhost:8931"), ("origin", o)]);
        assert!(check_host_and_origin(&c, &with_origin("http://localhost:3000")).is_ok());
        assert!(check_host_and_origin(&c, &with_origin("https://app.example")).is_ok());
        assert!(check_host_and_origin(&c, &with_origin("http://evil.example")).is_err());
        assert!(check_host_and_origin(&c, &with_origin("null")).is_err());
    }

    /// A Host or Origin sent twice or unreadable is refused, never read as absent (which
    /// would skip the Origin check).
    #[test]
    fn a_repeated_or_unreadable_host_or_origin_is_refused() {
        let c = config();
        let with = |pairs: &[(&'static str, &[u8])]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(*k, HeaderValue::from_bytes(v).unwrap());
            }
            check_host_and_origin(&c, &h).map_err(|(status, why)| (status.as_u16(), why))
        };
        let host: (&'static str, &[u8]) = ("host", b"localhost");
        assert!(with(&[host]).is_ok());
        assert_eq!(
            with(&[host, ("origin", b"http://\xe9vil.example")]),
            Err((400, "the origin header is not visible ASCII".into()))
        );
        assert_eq!(
            with(&[
                host,
                ("origin", b"http://localhost"),
                ("origin", b"http://evil.example")
            ]),
            Err((400, "the origin header is sent more than once".into()))
        );
        assert_eq!(with(&[host, host]).unwrap_err().0, 400);
        assert_eq!(with(&[("host", b"l\xffcalhost")]).unwrap_err().0, 400);
    }
}
