//! Executors as MCP stdio servers spawned through the broker: a warm pool of unbound
//! executors per server, binding to one session, calls with a deadline, and retirement.
//!
//! An executor is bound to one session for its life and never serves another, so it cannot
//! carry one session's data into another. It is also retired when the session's label rises
//! above the label under which any of its egress was approved: a connection opened for
//! lower data must not carry higher data later (connected sends are not re-mediated).

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowhost_broker::{Broker, EgressAttempt, Escaped, Executor, Profile, SpawnSpec, StdioMode};
use serde_json::{Value, json};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch};

use super::session::Outbox;
use crate::destination::HostName;
use crate::dns::{DnsMediation, ExecutorDns, Lookup, LookupJudge, LookupVerdict};
use crate::label::InformationLabel;
use crate::mcp::{self, Incoming, Line};

/// Why an executor call failed. The call's result is an error, and the executor is retired.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// The broker refused or failed to start it.
    #[error("cannot start the executor: {0}")]
    Spawn(String),
    /// It did not answer within the deadline (it was killed).
    #[error("the executor did not answer within {0:?} and was stopped")]
    Timeout(Duration),
    /// It exited or closed its output.
    #[error("the executor exited during the call")]
    Exited,
    /// It died from one of its profile's bounds during a call.
    #[error("the executor of server {server:?} died during tool {tool:?} from {bound}")]
    Bound {
        /// The server.
        server: String,
        /// The tool being called.
        tool: String,
        /// Which bound, with its value and profile field.
        bound: String,
    },
    /// It sent something that is not MCP, or a message over the size limit.
    #[error("the executor broke the protocol: {0}")]
    Protocol(String),
    /// It answered the call with a JSON-RPC error (it may serve again).
    #[error("the executor answered with {0}")]
    Rpc(mcp::RpcError),
    /// The client cancelled the call; the cancellation was forwarded to the executor (with
    /// [`CANCEL_REASON`]), which either answered within the grace period (`acknowledged`: it
    /// may serve again) or was stopped.
    #[error("the call was cancelled ({reason}); the executor {}", if *acknowledged { "acknowledged it" } else { "did not acknowledge it and was stopped" })]
    Cancelled {
        /// Why, as the client said (for the host's log; the executor is not told).
        reason: String,
        /// Whether the executor answered the cancelled request within the grace period.
        acknowledged: bool,
    },
    /// The client cancelled the request before any of it was written to the executor: the
    /// executor never saw it.
    #[error("the call was cancelled ({0}) before the executor was given it")]
    CancelledBeforeSent(String),
    /// It answered `initialize` with a protocol revision the host does not speak.
    #[error("the executor speaks MCP revision {0:?}; flowhost speaks {revisions}", revisions = mcp::SUPPORTED_PROTOCOL_VERSIONS.join(", "))]
    Revision(String),
    /// Writing to it failed.
    #[error("cannot write to the executor: {0}")]
    Io(#[from] std::io::Error),
    /// The server was withdrawn from service (a reload took out the key that vouched for
    /// it, or the server), or admitted under another manifest, after the request was
    /// admitted and before an executor took it: none is started for it.
    #[error(
        "server {0:?} was withdrawn from service, or admitted again under another manifest, before an executor took the request; none is started for it"
    )]
    Withdrawn(String),
    /// A reload took the session's principal out, mapped its peer elsewhere, or took from
    /// the principal the use of what the request names on this server, after the request
    /// was admitted and before an executor took it: none is started for it.
    #[error(
        "the session's principal, or its use of this on server {0:?}, was withdrawn before an executor took the request; none is started for it"
    )]
    AccessWithdrawn(String),
    /// The session's principal holds as many executors as its share of the host's
    /// `max_executors` allows: none is started for the request until one of them stops.
    #[error(
        "principal {principal} holds {share} executors, its share of the host's max_executors; none is started for this request (an idle one stops after idle_timeout_ms)"
    )]
    OverShare {
        /// The principal.
        principal: String,
        /// Its share.
        share: usize,
    },
}

impl ExecutorError {
    /// Whether the host ended the executor at one of its bounds (memory, CPU, processes, or
    /// the request's deadline): what it would have done after is not observed, which a test
    /// run counts as cut short (`bound_reached`).
    pub fn ran_into_a_bound(&self) -> bool {
        matches!(
            self,
            ExecutorError::Bound { .. } | ExecutorError::Timeout(_)
        )
    }

    /// This error in the host's words only, for a client whose request it ended before the
    /// executor was given the request (starting it, or making it ready for the session). What
    /// an executor chose (an error answer, its protocol revision, the line with which it broke
    /// the protocol) is named, never quoted: nothing of the request ran, so no label covers
    /// it, and it stays in the host's log. The other variants are the host's own text.
    pub fn host_words(&self) -> String {
        match self {
            ExecutorError::Rpc(_) => "the executor answered with an error".into(),
            ExecutorError::Protocol(_) => "the executor broke the protocol".into(),
            ExecutorError::Revision(_) => {
                "the executor speaks an MCP revision flowhost does not".into()
            }
            ExecutorError::Cancelled { .. } | ExecutorError::CancelledBeforeSent(_) => {
                "the request was cancelled".into()
            }
            ExecutorError::Spawn(_)
            | ExecutorError::Timeout(_)
            | ExecutorError::Exited
            | ExecutorError::Bound { .. }
            | ExecutorError::Io(_)
            | ExecutorError::Withdrawn(_)
            | ExecutorError::AccessWithdrawn(_)
            | ExecutorError::OverShare { .. } => self.to_string(),
        }
    }
}

/// How to start one server's executors.
#[derive(Debug, Clone)]
pub struct ExecutorTemplate {
    /// The server id (named when an executor dies from a bound).
    pub server: String,
    /// argv (argv[0] absolute).
    pub argv: Vec<String>,
    /// Environment.
    pub env: Vec<(String, String)>,
    /// The execution profile.
    pub profile: Arc<Profile>,
    /// Extra Landlock read paths.
    pub read_paths: Vec<PathBuf>,
    /// DNS mediation for executors with a network path (`None`: their lookups are egress
    /// attempts like any other).
    pub dns: Option<DnsMediation>,
    /// The uid and gid whose file permissions explain a failed start (see
    /// [`crate::runtime::check_program`]).
    pub run_as: (u32, u32),
}

impl ExecutorTemplate {
    /// A spawn error with the server, the program and, where the program check finds one,
    /// the real cause (the kernel's errno alone does not say which path or why).
    fn explain(&self, e: &flowhost_broker::SpawnError) -> String {
        let program = self.argv.first().cloned().unwrap_or_default();
        let readable = super::startup::readable(&self.profile, &self.read_paths);
        let path_var = (self.env.iter())
            .find(|(k, _)| k == "PATH")
            .map_or(flowhost_broker::DEFAULT_EXECUTOR_PATH, |(_, v)| v.as_str());
        let cause = match crate::runtime::check_program(
            std::path::Path::new(&program),
            self.run_as,
            &readable,
            path_var,
        ) {
            Err(problem) => format!("; cause: {problem}"),
            Ok(()) => String::new(),
        };
        format!("server {:?}, program {program}: {e}{cause}", self.server)
    }
}

/// What an executor's egress attempts are judged against: the call in flight, if any.
pub type CallSlot<C> = Arc<Mutex<Option<Arc<C>>>>;

/// A call in flight as the executor layer sees it: what to name it by in logs.
pub trait NamedCall: Send + Sync + 'static {
    /// The tool, as `server/tool`.
    fn tool_name(&self) -> &str;
}

/// The reason an executor is given when a request it serves is cancelled, whatever the
/// client said: the client's reason is its own text, which no classifier reads, so it goes
/// to the host's log only.
pub const CANCEL_REASON: &str = "the client cancelled the request";

/// How long an executor has to answer a cancelled request before it is stopped: one that
/// does not answer may still be working, and its later egress must not be attributed to
/// the next call.
pub const CANCEL_GRACE: Duration = Duration::from_millis(1500);

/// Most executor stderr lines logged per call (and while idle between calls); the rest are
/// counted and reported in one line, so a chatty server cannot flood the host's log.
const STDERR_LINES_PER_CALL: usize = 64;

/// What a client controls of one call while it runs: cancellation and progress.
pub struct CallControl {
    /// Becomes `Some(reason)` when the client cancels the call.
    pub cancel: watch::Receiver<Option<String>>,
    /// Where the call's progress notifications go, if the client asked for them.
    pub progress: Option<ProgressRoute>,
}

impl CallControl {
    /// A call that is never cancelled and reports no progress.
    pub fn none() -> Self {
        let (_, cancel) = watch::channel(None);
        CallControl {
            cancel,
            progress: None,
        }
    }
}

/// Where an executor's `notifications/progress` for one call are sent: the client's
/// progress token, the token the executor is given in its place, and the call's outgoing
/// messages.
///
/// The client's token is its own text, which no classifier reads (only a call's `arguments`
/// are classified before dispatch): passed through, it could carry to a low-clearance tool
/// what the classifier keeps from it. So the executor gets a token the host issued, and the
/// client's comes back on the progress forwarded to it.
pub struct ProgressRoute {
    /// The client's `progressToken`.
    token: Value,
    /// The token the executor is given (the host's, unique to the call).
    issued: Value,
    /// The call's outgoing lines.
    out: Outbox,
}

impl ProgressRoute {
    /// The route of a call whose client asked for progress with `token`, sending on `out`.
    pub fn new(token: Value, out: Outbox) -> Self {
        ProgressRoute {
            token,
            issued: Value::String(format!("flowhost-progress-{}", super::random_id())),
            out,
        }
    }

    /// The numbers of one progress notification of the executor, when it carries the token
    /// issued for this call: only they travel (a free-text `message` is dropped), and only
    /// once their label is stored (see [`ClientRelay::labelled`]).
    fn numbers(&self, params: &Value) -> Option<Value> {
        if params.get("progressToken") != Some(&self.issued) {
            return None;
        }
        let progress = params.get("progress").filter(|p| p.is_number())?;
        let mut numbers = json!({"progress": progress});
        if let Some(total) = params.get("total").filter(|t| t.is_number()) {
            numbers["total"] = total.clone();
        }
        Some(numbers)
    }

    /// Sends `numbers` (from [`ProgressRoute::numbers`], labelled) to the client under its
    /// token.
    async fn forward(&self, mut numbers: Value) {
        numbers["progressToken"] = self.token.clone();
        // A client that went away loses its progress; the call itself goes on.
        self.out
            .send(mcp::notification("notifications/progress", numbers))
            .await;
    }
}

/// Waits until the call is cancelled (forever if it cannot be any more).
pub async fn cancelled(cancel: &mut watch::Receiver<Option<String>>) -> String {
    let reason = cancel
        .wait_for(Option::is_some)
        .await
        .ok()
        .map(|r| r.clone().unwrap_or_default());
    match reason {
        Some(reason) => reason,
        None => std::future::pending().await,
    }
}

/// What the host answers a request an executor sent its client: the client's answer, or
/// why there is none.
pub type RelayAnswer = Result<Value, mcp::RpcError>;

/// A future borrowing what it relays through.
pub type RelayFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Where what an executor sends its client while it serves a call goes: its log
/// notifications, and its requests (sampling, elicitation), whose answers go back to it.
/// What the executor sends is the call's output, so the relay governs it as such.
pub trait ClientRelay: Send + Sync {
    /// Forwards one `notifications/message` of the call (or drops it, saying why).
    fn log(&self, params: Value) -> RelayFuture<'_, ()>;

    /// Relays one request of the executor; resolves to what the executor is answered. An
    /// answer whose label the executor is not fit for (see [`ExecutorFit`]) is refused.
    fn request(
        &self,
        method: String,
        params: Value,
        fit: ExecutorFit,
    ) -> RelayFuture<'_, RelayAnswer>;

    /// Joins the call's output label, with `numbers` (a progress notification's numbers)
    /// read by the classifier as output, into the flow state, durably, before they reach
    /// the client; resolves to whether it is stored (if not, nothing may go out).
    fn labelled<'a>(&'a self, numbers: &'a Value) -> RelayFuture<'a, bool>;
}

/// Whether an executor may take in data of a label mid-call: one whose egress was
/// approved under a label, a connection it may still hold open, must not be handed data
/// above that label, which it could send there unjudged.
#[derive(Clone)]
pub struct ExecutorFit {
    approved: Arc<Mutex<Approval>>,
    judging: Arc<tokio::sync::Mutex<()>>,
}

impl ExecutorFit {
    /// Holds off the executor's egress judgments until the guard drops: an approval
    /// landing between the check of an answer and its delivery would not be seen.
    pub async fn judging(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.judging.clone().lock_owned().await
    }

    /// Whether the executor may take in data labelled `label`: anything when it had no
    /// egress approved, data that flows to the earliest label its egress was approved
    /// under, and only unlabelled data after egress under a grant (approved below the
    /// call's own label, at a target it does not know).
    pub fn fits(&self, label: &InformationLabel) -> bool {
        self.approved
            .lock()
            .is_ok_and(|approved| approved.takes_in(label))
    }
}

/// The executor's requests being relayed while it serves a call: its request id and the
/// answer to come.
type Relaying<'a> = Vec<(Value, RelayFuture<'a, RelayAnswer>)>;

/// The next relayed request to be answered, with the executor's id for it (pending while
/// none is; the caller polls only when some are in flight).
async fn next_answer(relaying: &mut Relaying<'_>) -> (Value, RelayAnswer) {
    std::future::poll_fn(|cx| {
        for i in 0..relaying.len() {
            if let std::task::Poll::Ready(answer) = relaying[i].1.as_mut().poll(cx) {
                let (rid, _) = relaying.swap_remove(i);
                return std::task::Poll::Ready((rid, answer));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// What the host answers an executor's request to its client when no call is in flight
/// (or the call is being cancelled): nothing is relayed then.
fn no_relay() -> mcp::RpcError {
    mcp::RpcError::new(
        mcp::code::METHOD_NOT_FOUND,
        "flowhost relays requests to the client only while the executor serves a call",
    )
}

/// The answer to the executor's request `id` for `method` while it serves no call: a ping
/// is answered (the host is the executor's peer, and MCP asks every ping an answer), any
/// other request refused.
fn unrelayed_answer(id: &Value, method: &str) -> String {
    match method {
        "ping" => mcp::response(id, serde_json::json!({})),
        _ => mcp::error_response(id, &no_relay()),
    }
}

/// The line answering the executor's request `id` with `answer`.
fn answer_line(id: &Value, answer: RelayAnswer) -> String {
    match answer {
        Ok(result) => mcp::response(id, result),
        Err(e) => mcp::error_response(id, &e),
    }
}

/// What judging one egress attempt settled, for the executor that made it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Judgment {
    /// The source label the attempt was allowed under (`None`: refused). The executor is
    /// retired before it serves a call under another label.
    pub approved_under: Option<InformationLabel>,
    /// It was allowed under the call's declassification grant: the executor is retired
    /// after the call, whatever comes next (a connection it opened is not judged again, and
    /// the grant was the call's alone).
    pub under_grant: bool,
}

/// Receives an executor's egress attempts together with the call they belong to.
pub trait AttemptSink<C>: Send + Sync + 'static {
    /// Judges one attempt (and answers it), returning what it approved. `call` is `None`
    /// when the executor tried to reach out while no call was in flight; `naming` is what
    /// the executor's lookups say of the destination (the host names they got its address
    /// for, the last one first, or a lookup past its resolver).
    /// `executor` is the pid of the executor the attempt came from (the attempt's own pid
    /// is the calling thread's, one of as many as the executor starts).
    fn judge(
        &self,
        call: Option<Arc<C>>,
        attempt: EgressAttempt,
        naming: crate::dns::Naming,
        executor: i32,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Judgment> + Send + '_>>;

    /// Judges one host-name lookup of executor `pid` (recording it either way), returning what
    /// it approved (`approved_under: None`: the lookup is refused) and the block rules the
    /// names its answer leads through are judged by.
    fn judge_lookup(
        &self,
        call: Option<Arc<C>>,
        lookup: Lookup,
        pid: i32,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = (Judgment, crate::destination::NameBlocks)>
                + Send
                + '_,
        >,
    >;
}

/// A running executor that has completed the MCP handshake.
pub struct McpExecutor<C> {
    exec: Executor,
    stdin: pipe::Sender,
    /// The executor's output, read line by line by its own task (so a request abandoned
    /// at cancellation never loses half a line), within its budget (see [`read_output`]).
    stdout: mpsc::Receiver<Output>,
    /// The MCP revision the executor agreed to at `initialize`.
    revision: String,
    /// Stderr lines the current call may still log.
    stderr_budget: Arc<std::sync::atomic::AtomicUsize>,
    /// The tool of the call in flight or, between calls, of the last one (what stderr lines
    /// are tagged with: a tool's last lines often arrive just after its answer).
    last_tool: Arc<Mutex<String>>,
    /// The ids of the host's requests to the executor (see [`RequestIds`]).
    ids: RequestIds,
    slot: CallSlot<C>,
    /// Held while an attempt is judged; a call ends only once it holds it (see
    /// [`McpExecutor::call`]).
    judging: Arc<tokio::sync::Mutex<()>>,
    /// What the egress of this executor was approved under.
    approved_under: Arc<Mutex<Approval>>,
    last_used: Instant,
    /// Log notifications the executor sent while it served no call (not forwarded: their
    /// data has no call whose label it would carry).
    idle_logs: u64,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    server: String,
    /// Where the executor's `notifications/resources/updated` go (set once it is bound), or
    /// held while it serves a request.
    updates: Arc<Mutex<UpdateRoute>>,
    /// The executor's own resolver (kept alive as long as the executor).
    dns: Option<Arc<ExecutorDns>>,
    /// Whether the log has said that the executor lost its view of its resolver (it says
    /// so once).
    view_loss_told: std::sync::atomic::AtomicBool,
    /// Killed while its call still returned (see [`McpExecutor::answer_abandoned`]): it
    /// serves nothing more, though the kernel may not report it gone at once (the first
    /// process of a pid namespace is reaped only after the others).
    killed: bool,
}

/// Receives the `params` of each `notifications/resources/updated` an executor sends (the
/// session decides what reaches its client).
pub type UpdateSink = Arc<dyn Fn(&Value) + Send + Sync>;

/// Where an executor's resource updates go: to its session's sink, or, while it serves a
/// request whose labels are not yet durable, held until they are ([`McpExecutor::hold_updates`]).
#[derive(Default)]
struct UpdateRoute {
    sink: Option<UpdateSink>,
    /// The URIs of the updates held, in the order they first came.
    held: Option<Vec<String>>,
}

/// Distinct URIs held for one request; more are dropped (an update says only that its URI
/// changed, so one per URI is all a client needs, and the session passes on only the URI).
const MAX_HELD_UPDATES: usize = 256;

impl UpdateRoute {
    /// The sink to give `params` to now, or `None` once it is held (or dropped).
    fn pass(&mut self, params: &Value) -> Option<UpdateSink> {
        match &mut self.held {
            None => self.sink.clone(),
            Some(held) => {
                if let Some(uri) = params.get("uri").and_then(Value::as_str)
                    && held.len() < MAX_HELD_UPDATES
                    && !held.iter().any(|u| u == uri)
                {
                    held.push(uri.to_owned());
                }
                None
            }
        }
    }
}

/// The method of a resource update notification.
const RESOURCE_UPDATED: &str = "notifications/resources/updated";

/// Longest line read as a possible resource update (one carries a URI and little else):
/// longer lines pass on unparsed, so a large result is not parsed twice.
const MAX_UPDATE_LINE: usize = 8192;

/// Bytes of output an executor's reader may hold beyond one message of the size limit:
/// room to read small lines (progress, logs) ahead of whoever takes them.
const READ_AHEAD: usize = 64 * 1024;

/// Lines of output an executor's reader may hold (whatever their size: see [`read_output`]).
const READ_AHEAD_LINES: usize = 16;

/// One line of an executor's output, holding its share of the output budget (see
/// [`read_output`]) until it is taken.
#[derive(Debug)]
struct Output {
    line: Line,
    /// When the reader took it from the executor's output: a line taken before a request
    /// was written is no part of its answer, however late it is handled.
    read_at: Instant,
    _held: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Reads an executor's output line by line and passes the lines on to whoever reads its
/// answers, except resource updates, which go to its sink as they arrive (held while it
/// serves a request, dropped while it has none).
///
/// What an executor makes the daemon hold of its output, whether or not anyone takes it (an
/// idle executor's lines wait until the next call), is bounded in bytes: the lines read and
/// not yet taken, the one being read included, hold at most `limit` + [`READ_AHEAD`] bytes
/// (and at most [`READ_AHEAD_LINES`] + 1 lines), plus the reader's own buffer (8 KiB). A
/// line is read only once there is room for one of the largest size; read, it keeps the
/// room of its own size until it is taken.
async fn read_output<R: tokio::io::AsyncBufRead + Unpin>(
    mut reader: R,
    limit: usize,
    lines: mpsc::Sender<Output>,
    route: Arc<Mutex<UpdateRoute>>,
) {
    let needle = RESOURCE_UPDATED.as_bytes();
    // The configuration bounds the limit far below 4 GiB; beyond it, a line larger than a
    // `u32` of room would be read with less room than its size (still bounded by it).
    let room = u32::try_from(limit).unwrap_or(u32::MAX);
    let budget = Arc::new(tokio::sync::Semaphore::new(room as usize + READ_AHEAD));
    loop {
        // The semaphore is never closed, so this waits until room is made.
        let Ok(mut reserved) = budget.clone().acquire_many_owned(room).await else {
            return;
        };
        let mut line = mcp::read_line(&mut reader, limit)
            .await
            .unwrap_or(Line::Eof);
        // A line keeps room for its own bytes, its buffer cut to them; the rest is free.
        let size = match &mut line {
            Line::Message(m) => {
                m.shrink_to_fit();
                m.len()
            }
            Line::TooLarge { .. } | Line::Eof => 0,
        };
        let held = reserved.split(size);
        drop(reserved);
        if let Line::Message(m) = &line
            && m.len() <= MAX_UPDATE_LINE
            && m.windows(needle.len()).any(|w| w == needle)
            && let Ok(Incoming::Notification { method, params }) = mcp::parse(m)
            && method == RESOURCE_UPDATED
        {
            let to = route.lock().ok().and_then(|mut r| r.pass(&params));
            if let Some(to) = to {
                to(&params);
            }
            continue;
        }
        let eof = line == Line::Eof;
        let output = Output {
            line,
            read_at: Instant::now(),
            _held: held,
        };
        if lines.send(output).await.is_err() || eof {
            return;
        }
    }
}

impl<C> Drop for McpExecutor<C> {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl<C: NamedCall> McpExecutor<C> {
    /// Spawns an executor through the broker and runs the MCP `initialize` handshake.
    pub async fn start(
        broker: &Broker,
        template: &ExecutorTemplate,
        sink: Arc<dyn AttemptSink<C>>,
        deadline: Duration,
        limit: usize,
    ) -> Result<Self, ExecutorError> {
        let mut spec = SpawnSpec::new(
            template.argv.iter().map(OsString::from),
            template.profile.clone(),
        );
        spec.env = template
            .env
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)))
            .collect();
        spec.read_paths = template.read_paths.clone();
        let slot: CallSlot<C> = Arc::new(Mutex::new(None));
        let judging = Arc::new(tokio::sync::Mutex::new(()));
        let approved_under = Arc::new(Mutex::new(Approval::Nothing));
        // The executor's pid is known only once it runs; its lookups come after.
        let pid_cell = Arc::new(std::sync::OnceLock::new());
        let dns = match &template.dns {
            Some(mediation) if crate::dns::mediates_lookups(&template.profile) => {
                let judge = lookup_judge(
                    slot.clone(),
                    judging.clone(),
                    sink.clone(),
                    approved_under.clone(),
                    pid_cell.clone(),
                );
                let refuse =
                    |e: String| ExecutorError::Spawn(format!("server {:?}: {e}", template.server));
                let owner = crate::dns::ExecutorId {
                    server: template.server.clone(),
                    pid: pid_cell.clone(),
                };
                match mediation
                    .check_senders()
                    .and_then(|()| ExecutorDns::start(mediation, owner, judge))
                {
                    Ok(dns) => {
                        dns.show_to(&mut spec).map_err(refuse)?;
                        Some(Arc::new(dns))
                    }
                    // A daemon run unprivileged (in user namespaces) cannot mediate lookups:
                    // without the right to bind port 53, or with executors of its own uid,
                    // which any process of that user could pass for. Every send to port 53
                    // is then refused as a lookup past the executor's resolver, and host-name
                    // rules match nothing.
                    Err(e) if e.not_mediated_here() => {
                        if !WARNED_NO_DNS.swap(true, std::sync::atomic::Ordering::Relaxed) {
                            tracing::warn!(server = %template.server, "{e}: executors' lookups (any send to port 53) are refused, and host-name rules match nothing; run the host privileged (executors then get uids of their own, and it may bind port 53) to have lookups mediated");
                        }
                        None
                    }
                    Err(e) => return Err(refuse(e.to_string())),
                }
            }
            _ => None,
        };
        // Executors are long-lived MCP servers: each call has its own deadline, idle ones are
        // stopped by the session, and all die with the host. A lifetime limit from the
        // profile would kill warm executors waiting in the pool.
        spec.wall_clock = None;
        spec.stdin = StdioMode::Piped;
        spec.stdout = StdioMode::Piped;
        spec.stderr = StdioMode::Piped;
        let mut exec = broker
            .spawn(spec)
            .await
            .map_err(|e| ExecutorError::Spawn(template.explain(&e)))?;
        let stdin = exec.take_stdin().ok_or(ExecutorError::Exited)?;
        let stdout = BufReader::new(exec.take_stdout().ok_or(ExecutorError::Exited)?);
        let _ = pid_cell.set(exec.pid());
        let mut tasks = Vec::new();
        let (lines_tx, lines) = mpsc::channel(READ_AHEAD_LINES);
        // Its own task: a request abandoned at cancellation must not lose half a line. It
        // also hands resource updates to the session as they come, between requests too.
        let updates: Arc<Mutex<UpdateRoute>> = Arc::default();
        tasks.push(tokio::spawn(read_output(
            stdout,
            limit,
            lines_tx,
            updates.clone(),
        )));
        if let Some(attempts) = exec.take_attempts() {
            tasks.push(tokio::spawn(route_attempts(
                attempts,
                Routing {
                    slot: slot.clone(),
                    judging: judging.clone(),
                    sink,
                    approved_under: approved_under.clone(),
                    dns: dns.clone(),
                    upstream: template.dns.as_ref().map(|d| d.upstream.clone()),
                    server: template.server.clone(),
                    executor_pid: exec.pid(),
                },
            )));
        }
        let stderr_budget = Arc::new(std::sync::atomic::AtomicUsize::new(STDERR_LINES_PER_CALL));
        let last_tool = Arc::new(Mutex::new(String::from("(no call yet)")));
        if let Some(stderr) = exec.take_stderr() {
            let tag = StderrTag {
                server: template.server.clone(),
                pid: exec.pid(),
                tool: last_tool.clone(),
                budget: stderr_budget.clone(),
            };
            tasks.push(tokio::spawn(drain_stderr(stderr, tag)));
        }
        let mut me = McpExecutor {
            exec,
            stdin,
            stdout: lines,
            revision: String::new(),
            stderr_budget,
            last_tool,
            ids: RequestIds::new(),
            slot,
            judging,
            approved_under,
            last_used: Instant::now(),
            idle_logs: 0,
            tasks,
            server: template.server.clone(),
            updates,
            dns,
            view_loss_told: Default::default(),
            killed: false,
        };
        let answer = me
            .request(
                "initialize",
                json!({
                    "protocolVersion": mcp::PROTOCOL_VERSION,
                    // What the host can relay during a call. An executor is started before
                    // any session binds it, so this is the host's offer; a session whose
                    // client lacks one refuses that request (see `ClientRelay`).
                    "capabilities": {"sampling": {}, "elicitation": {}},
                    "clientInfo": {"name": "flowhost", "version": env!("CARGO_PKG_VERSION")}
                }),
                deadline,
                &mut CallControl::none(),
                None,
            )
            .await?;
        // The server answers with the revision it will speak: one the host does not speak
        // is refused rather than half-understood.
        let revision = answer
            .get("protocolVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        match mcp::negotiate(revision) {
            Some(agreed) if agreed == revision => me.revision = agreed.to_string(),
            _ => {
                let _ = me.exec.kill();
                return Err(ExecutorError::Revision(revision.to_string()));
            }
        }
        me.send(&mcp::notification("notifications/initialized", json!({})))
            .await?;
        Ok(me)
    }

    /// The MCP revision the executor agreed to at `initialize`.
    pub fn revision(&self) -> &str {
        &self.revision
    }

    /// The server this executor runs.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The executor's pid.
    pub fn pid(&self) -> i32 {
        self.exec.pid()
    }

    /// The slot the egress judge reads while a call is in flight.
    pub fn slot(&self) -> &CallSlot<C> {
        &self.slot
    }

    /// Whether an egress of the executor was approved under a call's grant: it serves
    /// nothing after that call (see [`McpExecutor::fit_for`]).
    pub fn egressed_under_a_grant(&self) -> bool {
        self.approved_under
            .lock()
            .map_or(true, |approved| *approved == Approval::Grant)
    }

    /// Whether data labelled `label` may be handed to the executor outside what a call's
    /// source covers (a client's subscription it takes over): as [`ExecutorFit::fits`].
    pub fn takes_in(&self, label: &InformationLabel) -> bool {
        self.approved_under
            .lock()
            .is_ok_and(|approved| approved.takes_in(label))
    }

    /// Whether the executor may serve a call whose source is `source`: it may not if it
    /// had egress approved under a different (necessarily lower) label, or under a call's
    /// grant (which was that call's alone).
    pub fn fit_for(&self, source: &InformationLabel) -> bool {
        self.approved_under
            .lock()
            .is_ok_and(|approved| approved.fits(source))
    }

    /// Whether the executor still sees its own resolver where its lookups go
    /// ([`ExecutorDns::still_shown`]): one that does not is to be retired (its lookups would
    /// all be refused), and the log says why, once. True for an executor whose lookups are
    /// not mediated.
    pub fn sees_its_resolver(&self) -> bool {
        let sees = self.dns.as_ref().is_none_or(|d| d.still_shown());
        if !sees
            && !self
                .view_loss_told
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                server = %self.server,
                pid = self.pid(),
                "the host replaced /etc/resolv.conf since this executor started, which dropped its view of its own resolver: it is retired and a fresh one serves the next call"
            );
        }
        sees
    }

    /// How long since the executor last served a call.
    pub fn idle_for(&self) -> Duration {
        self.last_used.elapsed()
    }

    /// Whether the executor was killed to be retired while its call still returned (see
    /// [`McpExecutor::answer_abandoned`]).
    pub fn killed(&self) -> bool {
        self.killed
    }

    /// Whether the executor process is still running (an exited one is reaped here) and was
    /// not killed to be retired.
    pub fn alive(&mut self) -> bool {
        !self.killed && matches!(self.exec.try_wait(), Ok(None))
    }

    async fn send(&mut self, line: &str) -> Result<(), ExecutorError> {
        // One write per message: a line written in two parts can wake the executor twice.
        let mut message = Vec::with_capacity(line.len() + 1);
        message.extend_from_slice(line.as_bytes());
        message.push(b'\n');
        self.stdin.write_all(&message).await?;
        self.stdin.flush().await?;
        Ok(())
    }

    /// Sends a request and waits for its answer under `deadline` (the executor is killed
    /// when it passes), forwarding progress for `control`, relaying what the executor sends
    /// its client through `relay`, and honouring its cancellation. Requests still being
    /// relayed when the answer comes (or the deadline passes, or the call is cancelled)
    /// are abandoned: the client's late answers to them are ignored, and when the answer
    /// came, the executor is answered an error for each.
    async fn request(
        &mut self,
        method: &str,
        params: Value,
        deadline: Duration,
        control: &mut CallControl,
        relay: Option<&dyn ClientRelay>,
    ) -> Result<Value, ExecutorError> {
        let id = self.ids.next();
        let line = mcp::request(id, method, params);
        let CallControl { cancel, progress } = control;
        let progress = progress.as_ref();
        // Whether any of the request may have reached the executor.
        let mut sent = false;
        // The write is inside the deadline too: an executor that stops reading its input
        // would otherwise block the call forever once the pipe is full.
        let outcome = {
            let exchange = async {
                sent = true;
                let sent_at = Instant::now();
                self.send(&line).await?;
                self.read_response(id, progress, relay, Some(sent_at)).await
            };
            // A cancellation already made wins: the request is then never sent.
            tokio::select! {
                biased;
                reason = cancelled(cancel) => Err(reason),
                r = tokio::time::timeout(deadline, exchange) => Ok(r),
            }
        };
        match outcome {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => {
                let _ = self.exec.kill();
                Err(ExecutorError::Timeout(deadline))
            }
            Err(reason) if !sent => Err(ExecutorError::CancelledBeforeSent(reason)),
            Err(reason) => {
                // From the cancellation on, nothing the executor attempts is judged against
                // the call: it would be carried out for a client that no longer wants it.
                if !self.end_call(CANCEL_GRACE).await {
                    let _ = self.exec.kill();
                }
                Err(self.cancel(id, reason, progress).await)
            }
        }
    }

    /// Takes the call out of the slot once any judgment in progress has finished (within
    /// `within`), so every later egress attempt is refused (`no_call_in_flight`); `false`
    /// when a judgment did not finish in time (the slot is cleared all the same, and the
    /// caller stops the executor: a verdict landing later is carried out for nobody, since
    /// the broker checks that the caller still waits after every verdict).
    async fn end_call(&self, within: Duration) -> bool {
        // Held while the slot is cleared: a judgment begun after it finds the slot empty.
        let judging = tokio::time::timeout(within, self.judging.clone().lock_owned()).await;
        if let Ok(mut slot) = self.slot.lock() {
            *slot = None;
        }
        judging.is_ok()
    }

    /// Forwards the client's cancellation of request `id` (with [`CANCEL_REASON`], not the
    /// client's `reason`) and gives the executor [`CANCEL_GRACE`] to answer it; one that does
    /// not is killed.
    async fn cancel(
        &mut self,
        id: u64,
        reason: String,
        progress: Option<&ProgressRoute>,
    ) -> ExecutorError {
        let notice = mcp::notification(
            "notifications/cancelled",
            json!({"requestId": id, "reason": CANCEL_REASON}),
        );
        let answered = async {
            self.send(&notice).await?;
            self.read_response(id, progress, None, None).await
        };
        let acknowledged = matches!(
            tokio::time::timeout(CANCEL_GRACE, answered).await,
            Ok(Ok(_) | Err(ExecutorError::Rpc(_)))
        );
        if !acknowledged {
            let _ = self.exec.kill();
        }
        ExecutorError::Cancelled {
            reason,
            acknowledged,
        }
    }

    /// Reads the answer to request `id`. A line the reader took before `sent_at` (when the
    /// request was written) was said while the executor served nothing, and is handled as
    /// such ([`McpExecutor::settle_idle`]), never as this request's output.
    async fn read_response(
        &mut self,
        id: u64,
        progress: Option<&ProgressRoute>,
        relay: Option<&dyn ClientRelay>,
        sent_at: Option<Instant>,
    ) -> Result<Value, ExecutorError> {
        // The executor goes on talking (progress, logs, more requests) while the client
        // answers what it asked.
        let mut relaying: Relaying<'_> = Vec::new();
        let mut idle_requests = 0;
        loop {
            let (line, read_at) = tokio::select! {
                output = self.stdout.recv() => output.map_or((Line::Eof, None), |o| (o.line, Some(o.read_at))),
                (rid, answer) = next_answer(&mut relaying), if !relaying.is_empty() => {
                    self.send(&answer_line(&rid, answer)).await?;
                    continue;
                }
            };
            if let (Line::Message(bytes), Some(read_at), Some(sent_at)) = (&line, read_at, sent_at)
                && read_at < sent_at
            {
                self.idle_message(bytes, &mut idle_requests).await?;
                continue;
            }
            let line = match line {
                Line::Eof => return Err(ExecutorError::Exited),
                Line::TooLarge { bytes, .. } => {
                    return Err(ExecutorError::Protocol(format!(
                        "a {bytes}-byte message exceeds the limit"
                    )));
                }
                Line::Message(m) => m,
            };
            match mcp::parse(&line) {
                Ok(Incoming::Response { id: rid, outcome }) if rid == json!(id) => {
                    // What the executor asked during the call and is still waiting on is
                    // answered now, once: the call ended, so the client's answer will not
                    // reach it (the client is told its request is cancelled).
                    let unanswered: Vec<Value> = relaying.drain(..).map(|(rid, _)| rid).collect();
                    self.answer_abandoned(&unanswered).await;
                    return outcome.map_err(|e| match mcp::RpcError::from_answer(&e) {
                        Some(e) => ExecutorError::Rpc(e),
                        None => ExecutorError::Protocol(format!(
                            "an error answer without an integer code and a string message: {e}"
                        )),
                    });
                }
                // Progress numbers are the executor's choice, so they can carry what it
                // read: they go out only under the call's output label (and not at all
                // once the call is being cancelled, when no relay is given).
                Ok(Incoming::Notification { method, params })
                    if method == "notifications/progress" =>
                {
                    if let (Some(route), Some(relay)) = (progress, relay)
                        && let Some(numbers) = route.numbers(&params)
                        && relay.labelled(&numbers).await
                    {
                        route.forward(numbers).await;
                    }
                }
                // Forwarded before the answer is read on: a log line reaches the client
                // before the result it precedes.
                Ok(Incoming::Notification { method, params })
                    if method == "notifications/message" =>
                {
                    match relay {
                        Some(relay) => relay.log(params).await,
                        None => self.idle_log(),
                    }
                }
                // Other notifications (list changes) and stale responses are not ours to
                // act on.
                Ok(Incoming::Notification { .. }) | Ok(Incoming::Response { .. }) => {}
                Ok(Incoming::Request {
                    id: rid,
                    method,
                    params,
                }) => match relay {
                    Some(relay) => {
                        let fit = ExecutorFit {
                            approved: self.approved_under.clone(),
                            judging: self.judging.clone(),
                        };
                        relaying.push((rid, relay.request(method, params, fit)))
                    }
                    None => self.send(&unrelayed_answer(&rid, &method)).await?,
                },
                Err((_, e)) => return Err(ExecutorError::Protocol(e.message)),
            }
        }
    }

    /// Answers the executor's requests `ids`, which the call they belonged to left waiting,
    /// with an error saying so. Within [`IDLE_ANSWER_WRITE`]: an executor that does not read
    /// its input is not waited on (the call's own answer is already in), but it is killed,
    /// so it serves no later call: part of the answers may sit in its input, and the next
    /// request would be appended to that part, unreadable, and wait out its deadline.
    async fn answer_abandoned(&mut self, ids: &[Value]) {
        if ids.is_empty() {
            return;
        }
        let ended = mcp::RpcError::new(
            mcp::code::INTERNAL_ERROR,
            "the tool call this request was made during has ended; the client's answer will not be relayed",
        );
        // One write for all (`send` ends the last line).
        let lines = (ids.iter())
            .map(|rid| mcp::error_response(rid, &ended))
            .collect::<Vec<_>>()
            .join("\n");
        if !matches!(
            tokio::time::timeout(IDLE_ANSWER_WRITE, self.send(&lines)).await,
            Ok(Ok(()))
        ) {
            tracing::warn!(server = %self.server, pid = self.pid(), "the executor did not read the answers to requests its call left waiting; it is retired");
            self.killed = true;
            let _ = self.exec.kill();
        }
    }

    /// Counts (and logs at debug) a log notification sent while no call was in flight.
    fn idle_log(&mut self) {
        self.idle_logs += 1;
        tracing::debug!(server = %self.server, pid = self.pid(), count = self.idle_logs, "a log notification of an executor serving no call is not forwarded (its data would carry no call's label)");
    }

    /// Handles what the executor sent while it served no call, before the next call
    /// starts: log notifications are counted and dropped, requests refused, stale answers
    /// ignored. Nothing it said between calls is taken as the next call's output.
    async fn settle_idle(&mut self) -> Result<(), ExecutorError> {
        // What the reader has taken so far; a line it takes later but read before the
        // request was written is handled the same way by `read_response`. Requests, each
        // answered with a write, are counted.
        let mut answered = 0;
        let mut said_something = false;
        let settling = Instant::now();
        loop {
            // One that never goes quiet is not waited on past `IDLE_SETTLE`, even with lines
            // waiting: what the reader took before the request was written is still handled
            // as idle (see `read_response`); what was still in its pipe then may be taken as
            // the call's output, under the call's labels (a known limit, in the README).
            if said_something && settling.elapsed() >= IDLE_SETTLE {
                break;
            }
            let output = match self.stdout.try_recv() {
                Ok(output) => output,
                // Nothing waiting. An executor that said nothing between calls (the usual
                // case) is not waited on. One that did may have more in its output pipe
                // than the reader could take while nobody drained it: the reader is given
                // until it has been quiet for `IDLE_QUIET`, so that none of it is read as
                // the call's.
                Err(_) if !said_something => break,
                Err(_) => match tokio::time::timeout(IDLE_QUIET, self.stdout.recv()).await {
                    Ok(Some(output)) => output,
                    Ok(None) => return Err(ExecutorError::Exited),
                    Err(_) => break,
                },
            };
            said_something = true;
            let bytes = match output.line {
                Line::Message(bytes) => bytes,
                // It exited between calls.
                Line::Eof => return Err(ExecutorError::Exited),
                Line::TooLarge { bytes: n, .. } => {
                    return Err(ExecutorError::Protocol(format!(
                        "a {n}-byte message (sent between calls) exceeds the limit"
                    )));
                }
            };
            self.idle_message(&bytes, &mut answered).await?;
        }
        Ok(())
    }

    /// Handles one message the executor sent while it served no call: a log notification
    /// is counted and dropped, a request answered (`answered` counts them, up to
    /// [`MAX_IDLE_REQUESTS`]), anything else ignored.
    async fn idle_message(
        &mut self,
        bytes: &[u8],
        answered: &mut usize,
    ) -> Result<(), ExecutorError> {
        match mcp::parse(bytes) {
            Ok(Incoming::Notification { method, .. }) if method == "notifications/message" => {
                self.idle_log();
            }
            Ok(Incoming::Request { id, method, .. }) => {
                *answered += 1;
                if *answered > MAX_IDLE_REQUESTS {
                    return Err(ExecutorError::Protocol(format!(
                        "more than {MAX_IDLE_REQUESTS} requests sent between calls"
                    )));
                }
                let answer = unrelayed_answer(&id, &method);
                match tokio::time::timeout(IDLE_ANSWER_WRITE, self.send(&answer)).await {
                    Ok(sent) => sent?,
                    Err(_) => {
                        return Err(ExecutorError::Protocol(format!(
                            "it stopped reading its input for {IDLE_ANSWER_WRITE:?} after \
                             sending {answered} requests between calls"
                        )));
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Runs one `tools/call` with `call` in the slot, so egress attempts during it are
    /// judged against it; the slot is cleared afterwards whatever happens.
    ///
    /// The call returns only after any judgment in progress has finished, and clears the slot
    /// under the same lock: an attempt still being judged under this call is settled (and
    /// counted in [`McpExecutor::fit_for`]) before the caller acts on the result, and any
    /// later attempt finds no call in flight and is refused. Without this, an executor could
    /// answer while another of its threads' attempts is still approved under the old label.
    ///
    /// If the client asked for progress, the executor gets a token the host issued and its
    /// progress notifications reach the client with the client's token (see
    /// [`ProgressRoute`]); a cancellation is forwarded too, in the host's words (see
    /// [`ExecutorError::Cancelled`], [`CANCEL_REASON`]). Log notifications and requests the
    /// executor sends its client during the call go through `relay` (see [`ClientRelay`]);
    /// what it sent while idle before the call is not relayed.
    pub async fn call(
        &mut self,
        call: Arc<C>,
        tool: &str,
        arguments: Value,
        deadline: Duration,
        control: &mut CallControl,
        relay: &dyn ClientRelay,
    ) -> Result<Value, ExecutorError> {
        self.last_used = Instant::now();
        self.stderr_budget
            .store(STDERR_LINES_PER_CALL, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut last) = self.last_tool.lock() {
            *last = call.tool_name().to_string();
        }
        if let Ok(mut slot) = self.slot.lock() {
            *slot = Some(call);
        }
        let mut params = json!({"name": tool, "arguments": arguments});
        if let Some(route) = &control.progress {
            params["_meta"] = json!({"progressToken": route.issued});
        }
        // Answering what it asked while idle writes to it: an executor that stops reading
        // its input would block that write, so it is bounded by the call's deadline too.
        let started = Instant::now();
        let mut result = match tokio::time::timeout(deadline, self.settle_idle()).await {
            // One deadline for both: the call takes at most `deadline` in all.
            Ok(Ok(())) => {
                let left = deadline.saturating_sub(started.elapsed());
                self.request("tools/call", params, left, control, Some(relay))
                    .await
            }
            Ok(Err(e)) => Err(e),
            Err(_) => {
                let _ = self.exec.kill();
                Err(ExecutorError::Timeout(deadline))
            }
        };
        if !self.end_call(deadline).await {
            // A judgment is stuck (a record commit that does not finish): the executor is
            // stopped.
            let _ = self.exec.kill();
            result = Err(ExecutorError::Timeout(deadline));
        }
        self.last_used = Instant::now();
        self.blame_bound(result, tool).await
    }

    /// `result`, or [`ExecutorError::Bound`] when it failed because one of the executor's
    /// bounds killed it (for `tool`, or a request's method in parentheses): its output then
    /// ended, or ended mid-message (a line cut short breaks the protocol), and the exit
    /// status says which bound. What it would have done after is not observed, which a test
    /// run counts as cut short.
    async fn blame_bound<T>(
        &mut self,
        result: Result<T, ExecutorError>,
        tool: &str,
    ) -> Result<T, ExecutorError> {
        // Its output closes a moment before it can be reaped. A message that breaks the
        // protocol is waited on briefly only: an executor still alive is no bound's doing.
        let wait = match &result {
            Err(ExecutorError::Exited | ExecutorError::Io(_)) => Duration::from_secs(2),
            Err(ExecutorError::Protocol(_)) => Duration::from_millis(250),
            _ => return result,
        };
        match self.died_from_bound(wait).await {
            Some(bound) => {
                tracing::warn!(server = %self.server, tool, pid = self.pid(), "executor died from {bound}");
                Err(ExecutorError::Bound {
                    server: self.server.clone(),
                    tool: tool.to_string(),
                    bound,
                })
            }
            None => result,
        }
    }

    /// Sends the executor's resource updates to `sink` from now on.
    pub fn on_resource_updated(&self, sink: UpdateSink) {
        if let Ok(mut r) = self.updates.lock() {
            r.sink = Some(sink);
        }
    }

    /// Holds the executor's resource updates from now on, until
    /// [`McpExecutor::release_updates`]: while it serves a request, an update could say
    /// something of what it read before the session's label carries what it read (which
    /// URI changes, and when, is a signal the executor chooses).
    pub fn hold_updates(&self) {
        if let Ok(mut r) = self.updates.lock() {
            r.held.get_or_insert_with(Vec::new);
        }
    }

    /// Passes on the updates held since [`McpExecutor::hold_updates`], and those that come
    /// from now on. Called once the labels of what the executor produced are durable.
    pub fn release_updates(&self) {
        let (held, sink) = match self.updates.lock() {
            Ok(mut r) => (r.held.take().unwrap_or_default(), r.sink.clone()),
            Err(_) => return,
        };
        if let Some(sink) = sink {
            for uri in held {
                sink(&json!({ "uri": uri }));
            }
        }
    }

    /// Sends one request that is no tool call (a resource read, a prompt, a completion,
    /// `logging/setLevel`) and waits for its answer under `deadline`. No call is in the
    /// slot meanwhile, so any egress the executor attempts is refused (`no_call_in_flight`).
    pub async fn forward(
        &mut self,
        method: &str,
        params: Value,
        deadline: Duration,
    ) -> Result<Value, ExecutorError> {
        self.last_used = Instant::now();
        self.stderr_budget
            .store(STDERR_LINES_PER_CALL, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut last) = self.last_tool.lock() {
            *last = format!("({method})");
        }
        let result = self
            .request(method, params, deadline, &mut CallControl::none(), None)
            .await;
        self.last_used = Instant::now();
        self.blame_bound(result, &format!("({method})")).await
    }

    /// Which bound killed the executor, once it is reaped (waiting up to `wait`).
    async fn died_from_bound(&mut self, wait: Duration) -> Option<String> {
        let status = self.exec.wait_timeout(wait).await.ok().flatten()?;
        status.bound_description()
    }

    /// Kills the executor and waits briefly for it to be reaped.
    pub async fn stop(mut self) {
        let _ = self.exec.kill_and_wait(Duration::from_secs(2)).await;
    }
}

/// Whether the daemon said once that it cannot mediate lookups (see [`McpExecutor::start`]).
static WARNED_NO_DNS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What an executor's attempts and lookups are routed with.
struct Routing<C> {
    slot: CallSlot<C>,
    judging: Arc<tokio::sync::Mutex<()>>,
    sink: Arc<dyn AttemptSink<C>>,
    approved_under: Arc<Mutex<Approval>>,
    dns: Option<Arc<ExecutorDns>>,
    /// The host's upstream resolvers, which an executor without a resolver of its own
    /// reaches only past the host's mediation.
    upstream: Option<Arc<crate::dns::Upstream>>,
    /// The server (named in the egress decision log line).
    server: String,
    /// The executor's pid: whose attempts these are, whichever of its threads made them.
    executor_pid: i32,
}

/// What an executor's egress was approved under so far (see [`McpExecutor::fit_for`]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Approval {
    /// Nothing was approved.
    Nothing,
    /// Approved under a source label: `last` the latest, `first` the earliest, the lowest
    /// (labels only rise while an executor serves), which a connection it may still hold
    /// was approved under. A later call must have exactly the one label every approval
    /// was under: both are then that label.
    Under {
        first: InformationLabel,
        last: InformationLabel,
    },
    /// Something was approved under a call's grant: the executor serves nothing after.
    Grant,
}

impl Approval {
    /// Whether an executor whose egress was approved so may serve a call whose source is
    /// `source` (see [`McpExecutor::fit_for`]).
    fn fits(&self, source: &InformationLabel) -> bool {
        match self {
            Approval::Nothing => true,
            // A connection approved under `first` may still be open: a call whose source is
            // above it must not get to write to it (connected sends are not judged again),
            // whatever a later approval was under. One below `last` gets a fresh executor
            // too, which keeps the label each executor serves under one.
            Approval::Under { first, last } => last == source && first == source,
            Approval::Grant => false,
        }
    }

    /// Whether data labelled `label` may be taken in mid-call or outside one (see
    /// [`ExecutorFit::fits`]).
    fn takes_in(&self, label: &InformationLabel) -> bool {
        match self {
            Approval::Nothing => true,
            Approval::Under { first, .. } => label.flows_to(first),
            Approval::Grant => label.flows_to(&InformationLabel::bottom()),
        }
    }
}

/// Keeps what an egress of the executor was approved under (see [`McpExecutor::fit_for`]).
fn keep_approval(approved_under: &Mutex<Approval>, judgment: Judgment) {
    let Ok(mut approved) = approved_under.lock() else {
        return;
    };
    match judgment.approved_under {
        Some(_) if judgment.under_grant => *approved = Approval::Grant,
        Some(label) => match &*approved {
            Approval::Grant => {}
            Approval::Nothing => {
                *approved = Approval::Under {
                    first: label.clone(),
                    last: label,
                }
            }
            Approval::Under { first, .. } => {
                *approved = Approval::Under {
                    first: first.clone(),
                    last: label,
                }
            }
        },
        None => {}
    }
}

/// The judge of an executor's lookups: the call in flight is read under the judging lock,
/// as for attempts (see [`route_attempts`]).
fn lookup_judge<C: Send + Sync + 'static>(
    slot: CallSlot<C>,
    judging: Arc<tokio::sync::Mutex<()>>,
    sink: Arc<dyn AttemptSink<C>>,
    approved_under: Arc<Mutex<Approval>>,
    pid: Arc<std::sync::OnceLock<i32>>,
) -> LookupJudge {
    Arc::new(move |lookup: Lookup| {
        let (slot, judging, sink, approved_under, pid) = (
            slot.clone(),
            judging.clone(),
            sink.clone(),
            approved_under.clone(),
            pid.clone(),
        );
        Box::pin(async move {
            let _judging = judging.lock().await;
            let call = slot.lock().ok().and_then(|g| g.clone());
            let pid = pid.get().copied().unwrap_or(0);
            let (judgment, blocks) = sink.judge_lookup(call, lookup, pid).await;
            let allowed = judgment.approved_under.is_some();
            keep_approval(&approved_under, judgment);
            if allowed {
                LookupVerdict::Answered(blocks)
            } else {
                LookupVerdict::Refused
            }
        })
    })
}

/// The ids of the host's requests to one executor: distinct and not to be guessed from
/// those before (keyed SipHash of a counter), so an answer the executor wrote before it was
/// asked (between calls, for the id it expects next) is never taken for the next call's.
/// Integers within ±2^53, so every JSON reader keeps them exact.
struct RequestIds {
    key: std::hash::RandomState,
    counter: u64,
}

impl RequestIds {
    fn new() -> Self {
        RequestIds {
            key: std::hash::RandomState::new(),
            counter: 0,
        }
    }

    fn next(&mut self) -> u64 {
        use std::hash::BuildHasher;
        self.counter += 1;
        self.key.hash_one(self.counter) & ((1 << 53) - 1)
    }
}

/// Routes an executor's attempts to the judge with the call in flight, and keeps what the
/// judgments approved (the executor's own record of it: see [`McpExecutor::fit_for`]).
/// Sends to the executor's own resolver are the host talking to itself and are allowed
/// unjudged (its lookups are judged by the resolver); a connect or send to an address the
/// resolver handed out is judged with every name it still remembers the address under
/// ([`crate::dns::ExecutorDns::names_of`]).
async fn route_attempts<C: NamedCall>(mut attempts: mpsc::Receiver<EgressAttempt>, r: Routing<C>) {
    while let Some(attempt) = attempts.recv().await {
        let naming =
            match crate::dns::attempt_view(r.dns.as_deref(), r.upstream.as_deref(), attempt.info())
            {
                crate::dns::AttemptView::ToResolver => {
                    attempt.allow();
                    continue;
                }
                crate::dns::AttemptView::Egress(naming) => naming,
            };
        // The slot is read under the judging lock, so a call that has ended (and cleared the
        // slot under the same lock) is never judged against.
        let _judging = r.judging.lock().await;
        let call = r.slot.lock().ok().and_then(|g| g.clone());
        let info = attempt.info().clone();
        let tool = call.as_ref().map(|c| c.tool_name().to_string());
        let shown = naming.names().to_vec();
        let judgment = r.sink.judge(call, attempt, naming, r.executor_pid).await;
        log_egress_decision(
            &r.server,
            tool.as_deref(),
            &info,
            &shown,
            judgment.approved_under.is_some(),
        );
        keep_approval(&r.approved_under, judgment);
    }
}

/// Logs the verdict on one attempt of an executor of `server` (`names`: the host names its
/// destination was the answer for).
fn log_egress_decision(
    server: &str,
    tool: Option<&str>,
    info: &flowhost_broker::AttemptInfo,
    names: &[HostName],
    allowed: bool,
) {
    // A destination shows escaped what the executor chose of it (see `Escaped`); a host
    // name is checked DNS syntax.
    let shown = match &info.destination {
        Some(d) => format!("{d}{}", crate::dns::shown_names(names)),
        None => "(none)".into(),
    };
    tracing::info!(
        server = %server,
        tool = %tool.unwrap_or("(no call in flight)"),
        pid = info.pid,
        syscall = %info.syscall.as_str(),
        destination = %shown,
        verdict = if allowed { "allowed" } else { "refused" },
        "egress decision"
    );
}

/// Most requests an executor may send between calls (each is refused with a write); past
/// it the executor is retired.
const MAX_IDLE_REQUESTS: usize = 256;

/// Longest wait to refuse one request an executor sent between calls: one that does not
/// read its input meanwhile is retired rather than holding the next call.
const IDLE_ANSWER_WRITE: Duration = Duration::from_secs(1);

/// How long an executor that talked between calls must be quiet before the next request
/// goes to it (see `McpExecutor::settle_idle`).
const IDLE_QUIET: Duration = Duration::from_millis(5);

/// The longest the next request waits for an executor that talked between calls to go
/// quiet (see `McpExecutor::settle_idle`).
const IDLE_SETTLE: Duration = Duration::from_millis(100);

/// Longest executor stderr line read; longer lines are dropped without being buffered.
const STDERR_LINE_LIMIT: usize = 4096;

/// Longest part of an executor stderr line that is logged.
const STDERR_LOGGED_CHARS: usize = 512;

/// What an executor's stderr lines are logged with.
struct StderrTag {
    server: String,
    pid: i32,
    tool: Arc<Mutex<String>>,
    budget: Arc<std::sync::atomic::AtomicUsize>,
}

impl StderrTag {
    /// The tool of the call in flight, or of the last one.
    fn tool(&self) -> String {
        self.tool.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Says how many lines were not logged, if any.
    fn report_suppressed(&self, lines: usize) {
        if lines > 0 {
            tracing::info!(server = %self.server, pid = self.pid, lines, "executor stderr lines over the limit per call were not logged");
        }
    }

    /// Whether one more line may be logged now (the budget resets at every call).
    fn take(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Logs an executor's stderr at info, tagged with its server and the tool in flight, bounded
/// in line length and in lines per call.
async fn drain_stderr(stderr: pipe::Receiver, tag: StderrTag) {
    let mut reader = BufReader::new(stderr);
    let mut suppressed = 0usize;
    loop {
        let line = match mcp::read_line(&mut reader, STDERR_LINE_LIMIT).await {
            Ok(Line::Message(line)) => Some(line),
            Ok(Line::TooLarge { .. }) => None,
            Ok(Line::Eof) | Err(_) => break,
        };
        if !tag.take() {
            if suppressed == 0 {
                tracing::info!(server = %tag.server, tool = %tag.tool(), pid = tag.pid, "executor stderr reached the limit of {STDERR_LINES_PER_CALL} lines per call; further lines are counted, not logged");
            }
            suppressed += 1;
            continue;
        }
        tag.report_suppressed(std::mem::take(&mut suppressed));
        let text: String = match &line {
            Some(l) => String::from_utf8_lossy(l)
                .chars()
                .take(STDERR_LOGGED_CHARS)
                .collect(),
            None => format!("(a line over {STDERR_LINE_LIMIT} bytes, dropped)"),
        };
        // The executor wrote it: escaped, it cannot rewrite the operator's terminal or log.
        tracing::info!(server = %tag.server, tool = %tag.tool(), pid = tag.pid, "executor stderr: {}", Escaped(text));
    }
    tag.report_suppressed(suppressed);
}

/// A server's pool of warm, unbound executors.
pub struct WarmPool<C> {
    broker: Broker,
    template: ExecutorTemplate,
    sink: Arc<dyn AttemptSink<C>>,
    size: usize,
    deadline: Duration,
    limit: usize,
    ready: Mutex<Vec<McpExecutor<C>>>,
    filling: std::sync::atomic::AtomicUsize,
    /// Whether the newest attempt to start an executor failed.
    failing: std::sync::atomic::AtomicBool,
    /// Attempts begun so far, and the newest one whose outcome `failing` holds.
    attempts: std::sync::atomic::AtomicU64,
    reported: Mutex<u64>,
    /// Set when the pool's generation is replaced: nothing is started to keep it warm.
    closed: std::sync::atomic::AtomicBool,
}

impl<C: NamedCall> WarmPool<C> {
    /// A pool that keeps `size` executors ready.
    pub fn new(
        broker: Broker,
        template: ExecutorTemplate,
        sink: Arc<dyn AttemptSink<C>>,
        size: usize,
        deadline: Duration,
        limit: usize,
    ) -> Arc<Self> {
        Arc::new(WarmPool {
            broker,
            template,
            sink,
            size,
            deadline,
            limit,
            ready: Mutex::new(Vec::new()),
            filling: std::sync::atomic::AtomicUsize::new(0),
            failing: std::sync::atomic::AtomicBool::new(false),
            attempts: std::sync::atomic::AtomicU64::new(0),
            reported: Mutex::new(0),
            closed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Starts executors in the background until `size` are ready.
    pub fn refill(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.closed.load(Ordering::SeqCst) {
            return;
        }
        let have = self.ready.lock().map(|r| r.len()).unwrap_or(self.size);
        let in_flight = self.filling.load(Ordering::SeqCst);
        for _ in (have + in_flight)..self.size {
            self.filling.fetch_add(1, Ordering::SeqCst);
            let pool = self.clone();
            tokio::spawn(async move {
                let started = pool.start_one().await;
                pool.filling.fetch_sub(1, Ordering::SeqCst);
                match started {
                    Ok(e) => {
                        // A pool closed while this one started keeps nothing warm. The
                        // flag is read under the lock `drain` empties the pool under.
                        let surplus = match pool.ready.lock() {
                            Ok(mut ready) if !pool.closed.load(Ordering::SeqCst) => {
                                ready.push(e);
                                None
                            }
                            _ => Some(e),
                        };
                        if let Some(e) = surplus {
                            e.stop().await;
                        }
                    }
                    // What the executor said (its revision, an error answer) is escaped.
                    Err(e) => tracing::error!(
                        server = %pool.template.server,
                        error = %Escaped(&e),
                        program = %pool.template.argv.first().map(String::as_str).unwrap_or(""),
                        "cannot start a warm executor of server {:?}", pool.template.server
                    ),
                }
            });
        }
    }

    /// Starts one executor now and waits until it has answered `initialize`; it joins the
    /// pool (or is stopped when the pool keeps none). Proves the server's executors can run.
    pub async fn prime(self: &Arc<Self>) -> Result<(), ExecutorError> {
        let executor = self.start_one().await?;
        let surplus = match self.ready.lock() {
            Ok(mut ready) if ready.len() < self.size => {
                ready.push(executor);
                None
            }
            _ => Some(executor),
        };
        if let Some(executor) = surplus {
            executor.stop().await;
        }
        Ok(())
    }

    /// A ready executor (warm if one is available, else started now). The pool refills.
    pub async fn acquire(self: &Arc<Self>) -> Result<McpExecutor<C>, ExecutorError> {
        let warm = self.ready.lock().ok().and_then(|mut r| r.pop());
        if let Some(mut e) = warm
            && e.alive()
        {
            if e.sees_its_resolver() {
                self.refill();
                return Ok(e);
            }
            // The host replaced its resolv.conf: the other warm executors started before
            // lost their view too. They are stopped in the background and replaced.
            let mut stale = vec![e];
            if let Ok(mut ready) = self.ready.lock() {
                stale.extend(ready.extract_if(.., |e| !e.sees_its_resolver()));
            }
            tokio::spawn(async move {
                for e in stale {
                    e.stop().await;
                }
            });
        }
        self.refill();
        self.start_one().await
    }

    /// Starts one of this server's executors (not added to the pool).
    async fn start_one(&self) -> Result<McpExecutor<C>, ExecutorError> {
        let attempt = self
            .attempts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let started = McpExecutor::start(
            &self.broker,
            &self.template,
            self.sink.clone(),
            self.deadline,
            self.limit,
        )
        .await;
        // The newest attempt speaks for the server: one begun before its program was removed
        // can finish after a later one has failed, and must not hide that failure.
        if let Ok(mut reported) = self.reported.lock()
            && attempt >= *reported
        {
            *reported = attempt;
            self.failing
                .store(started.is_err(), std::sync::atomic::Ordering::SeqCst);
        }
        started
    }

    /// Whether the newest attempt to start one of this server's executors failed (every
    /// call to the server fails while it does).
    pub fn failing(&self) -> bool {
        self.failing.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Stops every warm executor and closes the pool: from then on it starts executors only
    /// for a request that asks ([`WarmPool::acquire`]), none to keep warm.
    pub async fn drain(&self) {
        // Before the lock: a start finishing meanwhile sees it under the lock and keeps
        // nothing, and one that finished before is drained below.
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        let all: Vec<_> = self
            .ready
            .lock()
            .map(|mut r| r.drain(..).collect())
            .unwrap_or_default();
        for e in all {
            e.stop().await;
        }
    }
}

/// A connect of pid 7 on a unix stream socket to `destination` (tests of what is shown of
/// an attempt).
#[cfg(test)]
pub(crate) fn unix_connect(
    destination: flowhost_broker::Destination,
    executable: Option<PathBuf>,
) -> flowhost_broker::AttemptInfo {
    flowhost_broker::AttemptInfo {
        syscall: flowhost_broker::EgressSyscall::Connect,
        pid: 7,
        executable,
        socket: flowhost_broker::SocketInfo {
            family: libc::AF_UNIX,
            socket_type: libc::SOCK_STREAM,
            protocol: 0,
        },
        destination: Some(destination),
        connected: false,
        bytes: None,
        message_index: None,
        passed_fds: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ids of the host's requests cannot be told in advance from those seen before:
    /// before, they counted up from 1, so an executor could write the answer to the next
    /// call before being asked it, between calls, and have it taken as that call's.
    #[test]
    fn request_ids_are_distinct_and_not_the_last_plus_one() {
        let mut ids = RequestIds::new();
        let seen: Vec<u64> = (0..1000).map(|_| ids.next()).collect();
        assert!(seen.iter().all(|id| *id < 1 << 53));
        assert!(seen.windows(2).all(|w| w[1] != w[0] + 1), "{seen:?}");
        let distinct: std::collections::BTreeSet<_> = seen.iter().collect();
        assert_eq!(distinct.len(), seen.len());
        // Another executor's ids are others.
        assert_ne!(RequestIds::new().next(), RequestIds::new().next());
    }

    /// An executor that made egress under a call's grant serves nothing after that call,
    /// whatever the next request's source: a connection it opened is not judged again, and
    /// the grant was that call's alone. Before, it was kept fit for any request at the
    /// call's source label (a completion, a prompt, the next call), which reached it with
    /// its connection open.
    /// Mid-call, an executor holding egress approved under a label takes in only data that
    /// flows to it (a client's answer of a higher label could go out on what it opened,
    /// unjudged); its own raises (its output floor) do not count, since the answer's own
    /// label is what is compared.
    #[test]
    fn an_executor_holding_egress_takes_in_only_what_flows_to_its_label() {
        let terms = crate::state::tests::owner("larkfield");
        let bottom = InformationLabel::bottom();
        let fit = |approval| ExecutorFit {
            approved: Arc::new(Mutex::new(approval)),
            judging: Default::default(),
        };
        let under = |first: &InformationLabel, last: &InformationLabel| Approval::Under {
            first: first.clone(),
            last: last.clone(),
        };
        assert!(fit(Approval::Nothing).fits(&terms));
        assert!(fit(under(&bottom, &bottom)).fits(&bottom));
        assert!(!fit(under(&bottom, &bottom)).fits(&terms));
        assert!(fit(under(&terms, &terms)).fits(&bottom));
        assert!(fit(under(&terms, &terms)).fits(&terms));
        // A connection approved at bottom may still be open after a later approval at a
        // higher label: the earliest counts.
        assert!(!fit(under(&bottom, &terms)).fits(&terms));
        assert!(fit(Approval::Grant).fits(&bottom));
        assert!(!fit(Approval::Grant).fits(&terms));
    }

    #[test]
    fn an_executor_that_egressed_under_a_grant_serves_nothing_after() {
        let source = InformationLabel::bottom();
        let judged = |approved: &Mutex<Approval>, allowed: bool, under_grant: bool| {
            keep_approval(
                approved,
                Judgment {
                    approved_under: allowed.then(|| source.clone()),
                    under_grant,
                },
            );
            approved.lock().unwrap().fits(&source)
        };
        let approved = Mutex::new(Approval::Nothing);
        assert!(approved.lock().unwrap().fits(&source));
        assert!(judged(&approved, true, false));
        assert!(!judged(&approved, true, true));
        // Later approvals without the grant do not make it fit again.
        assert!(!judged(&approved, true, false));
        // A refusal under a grant changes nothing.
        assert!(judged(&Mutex::new(Approval::Nothing), false, true));
    }

    /// An executor whose egress was approved under a label and, later in the same call
    /// (the session's label rose meanwhile), under a higher one, may hold a connection
    /// opened for the lower: it serves no later call, of either label. Before, a call of
    /// the higher label (the latest approval's) was served by it.
    #[test]
    fn an_executor_approved_under_two_labels_serves_no_later_call() {
        let terms = crate::state::tests::owner("larkfield");
        let bottom = InformationLabel::bottom();
        let approved = Mutex::new(Approval::Nothing);
        for label in [&bottom, &terms] {
            keep_approval(
                &approved,
                Judgment {
                    approved_under: Some(label.clone()),
                    under_grant: false,
                },
            );
        }
        let approval = approved.lock().unwrap().clone();
        assert!(
            !approval.fits(&terms) && !approval.fits(&bottom),
            "{approval:?}"
        );
        // Approved under one label only: a call of exactly that label is served.
        let once = Approval::Under {
            first: terms.clone(),
            last: terms.clone(),
        };
        assert!(once.fits(&terms) && !once.fits(&bottom));
    }

    /// What a `tracing` text layer writes, as the daemon's text log does (without colour).
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl tracing_subscriber::fmt::MakeWriter<'_> for Captured {
        type Writer = Captured;

        fn make_writer(&self) -> Captured {
            self.clone()
        }
    }

    /// An executor's output as it comes, counting the bytes read from it.
    struct Counted {
        output: std::io::Cursor<Vec<u8>>,
        read: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl tokio::io::AsyncRead for Counted {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let before = buf.filled().len();
            let polled = std::pin::Pin::new(&mut self.output).poll_read(cx, buf);
            let n = buf.filled().len() - before;
            self.read.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            polled
        }
    }

    /// An idle executor writing message after message of the largest size nobody reads:
    /// what the daemon reads of it and holds must stay within a small bound, not grow with
    /// the queue of lines (16 lines of the limit, each with a buffer up to twice its size).
    #[tokio::test(flavor = "current_thread")]
    async fn an_idle_executors_output_is_held_within_its_budget() {
        let limit = 256 * 1024;
        let mut line =
            br#"{"jsonrpc":"2.0","method":"notifications/message","params":{"data":""#.to_vec();
        line.resize(limit - 4, b'a');
        line.extend_from_slice(b"\"}}\n");
        let read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let output = Counted {
            output: std::io::Cursor::new(line.repeat(20)),
            read: read.clone(),
        };
        let (lines, mut taken) = mpsc::channel(16);
        let reader = tokio::spawn(read_output(
            BufReader::new(output),
            limit,
            lines,
            Arc::default(),
        ));
        // The reader runs until it must wait for room.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let held = read.load(std::sync::atomic::Ordering::Relaxed);
        let reader_buffer = 8 * 1024;
        assert!(
            held <= limit + READ_AHEAD + reader_buffer,
            "{held} bytes of output held ({} lines of {limit})",
            held / limit
        );
        // Room is made as lines are taken: none is lost.
        for _ in 0..20 {
            match taken.recv().await.map(|o| o.line) {
                Some(Line::Message(m)) => assert_eq!(m.len(), limit - 1),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(taken.recv().await.map(|o| o.line), Some(Line::Eof));
        reader.await.unwrap();
    }

    /// An executor chooses its socket names and its stderr: logged, their control bytes
    /// (ESC, BEL, CR, ENQ, SO, SI) must not reach the operator's terminal or log raw.
    #[tokio::test(flavor = "current_thread")]
    async fn executor_chosen_text_is_logged_without_control_characters() {
        let log = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(log.clone())
            .finish();
        let _logging = tracing::subscriber::set_default(subscriber);

        let info = unix_connect(
            flowhost_broker::Destination::UnixAbstract(b"\x1b]0;pwned\x07\x1b[2J".to_vec()),
            None,
        );
        log_egress_decision("srv", Some("srv/tool"), &info, &[], false);

        let (mut to, stderr) = pipe::pipe().unwrap();
        to.write_all(b"50%\r\x1b[2Kdone \x05\x0e\x0f\x1b]0;pwned-too\x07\n")
            .await
            .unwrap();
        drop(to);
        let tag = StderrTag {
            server: "srv".into(),
            pid: 7,
            tool: Arc::new(Mutex::new("srv/tool".into())),
            budget: Arc::new(std::sync::atomic::AtomicUsize::new(STDERR_LINES_PER_CALL)),
        };
        drain_stderr(stderr, tag).await;

        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        assert!(
            text.contains("egress decision")
                && text.contains("pwned")
                && text.contains("executor stderr")
                && text.contains("pwned-too"),
            "{text}"
        );
        let raw: Vec<_> = text
            .chars()
            .filter(|c| c.is_control() && *c != '\n')
            .collect();
        assert!(raw.is_empty(), "raw control characters {raw:?} in {text:?}");
    }

    /// What an executor chose never reaches a client through an error that ended its
    /// request before the executor was given it; the host's own text does.
    #[test]
    fn host_words_name_what_the_executor_said_without_quoting_it() {
        let said = "HUSH-1 what the executor read";
        for e in [
            ExecutorError::Rpc(mcp::RpcError::new(-32603, said)),
            ExecutorError::Protocol(format!("an error answer ...: {said}")),
            ExecutorError::Revision(said.into()),
        ] {
            let words = e.host_words();
            assert!(!words.contains("HUSH"), "{words}");
            assert!(words.starts_with("the executor"), "{words}");
        }
        let timeout = ExecutorError::Timeout(Duration::from_secs(3));
        assert_eq!(timeout.host_words(), timeout.to_string());
    }

    #[test]
    fn a_spawn_error_names_the_server_the_program_and_the_cause() {
        let template = ExecutorTemplate {
            server: "fetch".into(),
            argv: vec!["/tmp/venv/bin/mcp-server-fetch".into()],
            env: Vec::new(),
            profile: Arc::new(Profile::find("brokered", &[]).unwrap()),
            read_paths: Vec::new(),
            dns: None,
            run_as: (61_000, 61_000),
        };
        let e = flowhost_broker::SpawnError::Child {
            stage: flowhost_broker::Stage::Exec,
            errno: libc::ENOENT,
        };
        let text = template.explain(&e);
        assert!(
            text.contains("\"fetch\"")
                && text.contains("/tmp/venv/bin/mcp-server-fetch")
                && text.contains("private empty tmpfs"),
            "{text}"
        );
    }
}
