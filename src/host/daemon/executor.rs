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

use flowhost_broker::{Broker, EgressAttempt, Executor, Profile, SpawnSpec, StdioMode};
use serde_json::{Value, json};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::unix::pipe;
use tokio::sync::mpsc;

use crate::destination::HostName;
use crate::dns::{DnsMediation, ExecutorDns, Lookup, LookupJudge};
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
    /// It answered the call with a JSON-RPC error.
    #[error("the executor answered with an error: {0}")]
    Rpc(String),
    /// Writing to it failed.
    #[error("cannot write to the executor: {0}")]
    Io(#[from] std::io::Error),
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
        let cause = match crate::runtime::check_program(
            std::path::Path::new(&program),
            self.run_as,
            &readable,
        ) {
            Err(problem) => format!("; cause: {problem}"),
            Ok(()) => String::new(),
        };
        format!("server {:?}, program {program}: {e}{cause}", self.server)
    }
}

/// What an executor's egress attempts are judged against: the call in flight, if any.
pub type CallSlot<C> = Arc<Mutex<Option<Arc<C>>>>;

/// What judging one egress attempt settled, for the executor that made it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Judgment {
    /// The source label the attempt was allowed under (`None`: refused). The executor is
    /// retired before it serves a call under another label.
    pub approved_under: Option<InformationLabel>,
}

/// Receives an executor's egress attempts together with the call they belong to.
pub trait AttemptSink<C>: Send + Sync + 'static {
    /// Judges one attempt (and answers it), returning what it approved. `call` is `None`
    /// when the executor tried to reach out while no call was in flight; `name` is the host
    /// name the executor's lookup got the destination address for, if any.
    fn judge(
        &self,
        call: Option<Arc<C>>,
        attempt: EgressAttempt,
        name: Option<HostName>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Judgment> + Send + '_>>;

    /// Judges one host-name lookup of executor `pid` (recording a refusal), returning what
    /// it approved (`approved_under: None`: the lookup is refused).
    fn judge_lookup(
        &self,
        call: Option<Arc<C>>,
        lookup: Lookup,
        pid: i32,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Judgment> + Send + '_>>;
}

/// A running executor that has completed the MCP handshake.
pub struct McpExecutor<C> {
    exec: Executor,
    stdin: pipe::Sender,
    stdout: BufReader<pipe::Receiver>,
    next_id: u64,
    slot: CallSlot<C>,
    /// Held while an attempt is judged; a call ends only once it holds it (see
    /// [`McpExecutor::call`]).
    judging: Arc<tokio::sync::Mutex<()>>,
    /// The highest source label under which an egress of this executor was approved.
    approved_under: Arc<Mutex<Option<InformationLabel>>>,
    last_used: Instant,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    server: String,
    /// The executor's own resolver (kept alive as long as the executor).
    _dns: Option<Arc<ExecutorDns>>,
}

impl<C> Drop for McpExecutor<C> {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl<C: Send + Sync + 'static> McpExecutor<C> {
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
        let approved_under = Arc::new(Mutex::new(None));
        // The executor's pid is known only once it runs; its lookups come after.
        let pid_cell = Arc::new(std::sync::OnceLock::new());
        let dns = match &template.dns {
            Some(mediation) if mediates_lookups(&template.profile) => {
                let judge = lookup_judge(
                    slot.clone(),
                    judging.clone(),
                    sink.clone(),
                    approved_under.clone(),
                    pid_cell.clone(),
                );
                let refuse =
                    |e: String| ExecutorError::Spawn(format!("server {:?}: {e}", template.server));
                // Where /etc/resolv.conf leads (a link to systemd-resolved's stub file, say):
                // the executor's own file is shown there, and readable there.
                let shown = std::fs::canonicalize("/etc/resolv.conf").map_err(|e| {
                    refuse(format!("DNS mediation shows executors their own /etc/resolv.conf, which must exist on the host (an empty file will do): {e}"))
                })?;
                match ExecutorDns::start(mediation, judge) {
                    Ok(dns) => {
                        spec.bind_files
                            .push((dns.resolv_conf().to_path_buf(), shown.clone()));
                        spec.read_paths.push(shown);
                        Some(Arc::new(dns))
                    }
                    // A daemon without the right to bind port 53 (run unprivileged, in user
                    // namespaces) still mediates every lookup as the send it is: judged by
                    // address rules like any other attempt. Only names are lost.
                    Err(e @ crate::dns::DnsError::Bind(_)) if e.permission_denied() => {
                        if !WARNED_NO_DNS.swap(true, std::sync::atomic::Ordering::Relaxed) {
                            tracing::warn!(server = %template.server, "{e}: executors' lookups are judged as plain egress attempts, and host-name rules match nothing");
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
        if let Some(attempts) = exec.take_attempts() {
            tasks.push(tokio::spawn(route_attempts(
                attempts,
                Routing {
                    slot: slot.clone(),
                    judging: judging.clone(),
                    sink,
                    approved_under: approved_under.clone(),
                    dns: dns.clone(),
                },
            )));
        }
        if let Some(stderr) = exec.take_stderr() {
            let pid = exec.pid();
            tasks.push(tokio::spawn(drain_stderr(stderr, pid)));
        }
        let mut me = McpExecutor {
            exec,
            stdin,
            stdout,
            next_id: 1,
            slot,
            judging,
            approved_under,
            last_used: Instant::now(),
            tasks,
            server: template.server.clone(),
            _dns: dns,
        };
        me.request(
            "initialize",
            json!({
                "protocolVersion": mcp::PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "flowhost", "version": env!("CARGO_PKG_VERSION")}
            }),
            deadline,
            limit,
        )
        .await?;
        me.send(&mcp::notification("notifications/initialized", json!({})))
            .await?;
        Ok(me)
    }

    /// The executor's pid.
    pub fn pid(&self) -> i32 {
        self.exec.pid()
    }

    /// The slot the egress judge reads while a call is in flight.
    pub fn slot(&self) -> &CallSlot<C> {
        &self.slot
    }

    /// Whether the executor may serve a call whose source is `source`: it may not if it
    /// had egress approved under a different (necessarily lower) label.
    pub fn fit_for(&self, source: &InformationLabel) -> bool {
        match self.approved_under.lock().map(|g| g.clone()) {
            Ok(None) => true,
            Ok(Some(approved)) => &approved == source,
            Err(_) => false,
        }
    }

    /// How long since the executor last served a call.
    pub fn idle_for(&self) -> Duration {
        self.last_used.elapsed()
    }

    /// Whether the executor process is still running (an exited one is reaped here).
    pub fn alive(&mut self) -> bool {
        matches!(self.exec.try_wait(), Ok(None))
    }

    async fn send(&mut self, line: &str) -> Result<(), ExecutorError> {
        self.stdin.write_all(line.as_bytes()).await?;
        self.stdin.write_all(b"\n").await?;
        self.stdin.flush().await?;
        Ok(())
    }

    async fn request(
        &mut self,
        method: &str,
        params: Value,
        deadline: Duration,
        limit: usize,
    ) -> Result<Value, ExecutorError> {
        let id = self.next_id;
        self.next_id += 1;
        let line = mcp::request(id, method, params);
        // The write is inside the deadline too: an executor that stops reading its input
        // would otherwise block the call forever once the pipe is full.
        let exchange = async {
            self.send(&line).await?;
            self.read_response(id, limit).await
        };
        match tokio::time::timeout(deadline, exchange).await {
            Ok(r) => r,
            Err(_) => {
                let _ = self.exec.kill();
                Err(ExecutorError::Timeout(deadline))
            }
        }
    }

    async fn read_response(&mut self, id: u64, limit: usize) -> Result<Value, ExecutorError> {
        loop {
            let line = match mcp::read_line(&mut self.stdout, limit).await? {
                Line::Eof => return Err(ExecutorError::Exited),
                Line::TooLarge(n) => {
                    return Err(ExecutorError::Protocol(format!(
                        "a {n}-byte message exceeds the limit"
                    )));
                }
                Line::Message(m) => m,
            };
            match mcp::parse(&line) {
                Ok(Incoming::Response { id: rid, outcome }) if rid == json!(id) => {
                    return outcome.map_err(|e| ExecutorError::Rpc(e.to_string()));
                }
                // Notifications (logging, progress) and stale responses are not ours to act on.
                Ok(Incoming::Notification { .. }) | Ok(Incoming::Response { .. }) => {}
                // The host grants executors no client capabilities (sampling, roots, ...).
                Ok(Incoming::Request { id: rid, .. }) => {
                    let refusal = mcp::RpcError::new(
                        mcp::code::METHOD_NOT_FOUND,
                        "flowhost offers executors no client capabilities",
                    );
                    self.send(&mcp::error_response(&rid, &refusal)).await?;
                }
                Err((_, e)) => return Err(ExecutorError::Protocol(e.message)),
            }
        }
    }

    /// Runs one `tools/call` with `call` in the slot, so egress attempts during it are
    /// judged against it; the slot is cleared afterwards whatever happens.
    ///
    /// The call returns only after any judgment in progress has finished, and clears the slot
    /// under the same lock: an attempt still being judged under this call is settled (and
    /// counted in [`McpExecutor::fit_for`]) before the caller acts on the result, and any
    /// later attempt finds no call in flight and is refused. Without this, an executor could
    /// answer while another of its threads' attempts is still approved under the old label.
    pub async fn call(
        &mut self,
        call: Arc<C>,
        tool: &str,
        arguments: Value,
        deadline: Duration,
        limit: usize,
    ) -> Result<Value, ExecutorError> {
        self.last_used = Instant::now();
        if let Ok(mut slot) = self.slot.lock() {
            *slot = Some(call);
        }
        let result = self
            .request(
                "tools/call",
                json!({"name": tool, "arguments": arguments}),
                deadline,
                limit,
            )
            .await;
        let mut result = result;
        match tokio::time::timeout(deadline, self.judging.clone().lock_owned()).await {
            Ok(_settled) => {
                if let Ok(mut slot) = self.slot.lock() {
                    *slot = None;
                }
            }
            Err(_) => {
                // A judgment is stuck (a record commit that does not finish): the executor
                // is stopped. The broker re-checks that the caller still waits after every
                // verdict, so a verdict landing later is carried out for nobody.
                if let Ok(mut slot) = self.slot.lock() {
                    *slot = None;
                }
                let _ = self.exec.kill();
                result = Err(ExecutorError::Timeout(deadline));
            }
        }
        self.last_used = Instant::now();
        if matches!(result, Err(ExecutorError::Exited | ExecutorError::Io(_)))
            && let Some(bound) = self.died_from_bound().await
        {
            tracing::warn!(server = %self.server, tool, pid = self.pid(), "executor died from {bound}");
            result = Err(ExecutorError::Bound {
                server: self.server.clone(),
                tool: tool.to_string(),
                bound,
            });
        }
        result
    }

    /// Which bound killed the executor, once it is reaped (waiting briefly: its output
    /// closes a moment before it can be reaped).
    async fn died_from_bound(&mut self) -> Option<String> {
        let status = self
            .exec
            .wait_timeout(Duration::from_secs(2))
            .await
            .ok()
            .flatten()?;
        status.bound_description()
    }

    /// Kills the executor and waits briefly for it to be reaped.
    pub async fn stop(mut self) {
        let _ = self.exec.kill_and_wait(Duration::from_secs(2)).await;
    }
}

/// Whether the daemon said once that it cannot mediate lookups (see [`McpExecutor::start`]).
static WARNED_NO_DNS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether executors of `profile` get a resolver of their own: they have the host's network
/// (an empty network namespace reaches no resolver) and a mount namespace to show them
/// their own `/etc/resolv.conf` in.
fn mediates_lookups(profile: &Profile) -> bool {
    profile.network == flowhost_broker::NetworkPath::Host && profile.mount_namespace
}

/// What an executor's attempts and lookups are routed with.
struct Routing<C> {
    slot: CallSlot<C>,
    judging: Arc<tokio::sync::Mutex<()>>,
    sink: Arc<dyn AttemptSink<C>>,
    approved_under: Arc<Mutex<Option<InformationLabel>>>,
    dns: Option<Arc<ExecutorDns>>,
}

/// Keeps the label an egress of the executor was approved under (see
/// [`McpExecutor::fit_for`]).
fn keep_approval(approved_under: &Mutex<Option<InformationLabel>>, judgment: Judgment) {
    if let (Some(label), Ok(mut approved)) = (judgment.approved_under, approved_under.lock()) {
        *approved = Some(label);
    }
}

/// The judge of an executor's lookups: the call in flight is read under the judging lock,
/// as for attempts (see [`route_attempts`]).
fn lookup_judge<C: Send + Sync + 'static>(
    slot: CallSlot<C>,
    judging: Arc<tokio::sync::Mutex<()>>,
    sink: Arc<dyn AttemptSink<C>>,
    approved_under: Arc<Mutex<Option<InformationLabel>>>,
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
            let judgment = sink.judge_lookup(call, lookup, pid).await;
            let allowed = judgment.approved_under.is_some();
            keep_approval(&approved_under, judgment);
            allowed
        })
    })
}

/// Routes an executor's attempts to the judge with the call in flight, and keeps what the
/// judgments approved (the executor's own record of it: see [`McpExecutor::fit_for`]).
/// Sends to the executor's own resolver are the host talking to itself and are allowed
/// unjudged (its lookups are judged by the resolver); a connect or send to an address the
/// resolver handed out is judged with the name it was the answer for.
async fn route_attempts<C: Send + Sync + 'static>(
    mut attempts: mpsc::Receiver<EgressAttempt>,
    r: Routing<C>,
) {
    while let Some(attempt) = attempts.recv().await {
        let info = attempt.info();
        let inet = match &info.destination {
            Some(flowhost_broker::Destination::Inet(addr)) => Some(*addr),
            _ => None,
        };
        // Reaching the resolver, not taking its address (a bind or listen is judged).
        let reaches = !matches!(
            info.syscall,
            flowhost_broker::EgressSyscall::Bind | flowhost_broker::EgressSyscall::Listen
        );
        let name = match (&r.dns, inet) {
            (Some(dns), Some(addr)) if reaches && dns.is_resolver(&addr) => {
                attempt.allow();
                continue;
            }
            (Some(dns), Some(addr)) => dns.name_of(addr.ip()),
            _ => None,
        };
        // The slot is read under the judging lock, so a call that has ended (and cleared the
        // slot under the same lock) is never judged against.
        let _judging = r.judging.lock().await;
        let call = r.slot.lock().ok().and_then(|g| g.clone());
        let judgment = r.sink.judge(call, attempt, name).await;
        keep_approval(&r.approved_under, judgment);
    }
}

/// Longest executor stderr line logged; longer lines are dropped without being buffered.
const STDERR_LINE_LIMIT: usize = 4096;

async fn drain_stderr(stderr: pipe::Receiver, pid: i32) {
    let mut reader = BufReader::new(stderr);
    loop {
        match mcp::read_line(&mut reader, STDERR_LINE_LIMIT).await {
            Ok(Line::Message(line)) => {
                let line = String::from_utf8_lossy(&line);
                tracing::debug!(pid, executor_stderr = %line.chars().take(512).collect::<String>());
            }
            Ok(Line::TooLarge(n)) => {
                tracing::debug!(
                    pid,
                    bytes = n,
                    "executor stderr line over the limit dropped"
                );
            }
            Ok(Line::Eof) | Err(_) => return,
        }
    }
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
    /// Whether the last attempt to start an executor failed.
    failing: std::sync::atomic::AtomicBool,
}

impl<C: Send + Sync + 'static> WarmPool<C> {
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
        })
    }

    /// Starts executors in the background until `size` are ready.
    pub fn refill(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
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
                        if let Ok(mut ready) = pool.ready.lock() {
                            ready.push(e);
                        }
                    }
                    Err(e) => tracing::error!(
                        error = %e,
                        program = %pool.template.argv.first().map(String::as_str).unwrap_or(""),
                        "cannot start a warm executor: {e}"
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
        self.refill();
        if let Some(mut e) = warm
            && e.alive()
        {
            return Ok(e);
        }
        self.start_one().await
    }

    /// Starts one of this server's executors (not added to the pool).
    async fn start_one(&self) -> Result<McpExecutor<C>, ExecutorError> {
        let started = McpExecutor::start(
            &self.broker,
            &self.template,
            self.sink.clone(),
            self.deadline,
            self.limit,
        )
        .await;
        self.failing
            .store(started.is_err(), std::sync::atomic::Ordering::SeqCst);
        started
    }

    /// Whether the last attempt to start one of this server's executors failed (every call
    /// to the server fails while it does).
    pub fn failing(&self) -> bool {
        self.failing.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Stops every warm executor.
    pub async fn drain(&self) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
