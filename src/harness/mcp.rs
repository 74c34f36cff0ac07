//! An MCP server served by `flowhost sandbox mcp`, driven over its stdio one request at a
//! time (newline-delimited JSON-RPC 2.0).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::thread::JoinHandle;

use serde_json::{Value, json};

use super::{HarnessError, Observation};

/// A governed MCP server, initialized. Dropping it without [`McpServer::finish`] (a test
/// that fails half way) ends the session as `finish` does and waits a bounded time for the
/// host to stop (its executors, its private directory); one that does not stop by then is
/// killed.
#[derive(Debug)]
pub struct McpServer {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    stderr: Option<JoinHandle<String>>,
    next_id: u64,
    server_id: String,
    records: PathBuf,
    health: PathBuf,
    workspace: Option<tempfile::TempDir>,
    /// The notifications the host sent (log lines, progress) while requests were answered.
    notifications: Vec<Value>,
    /// How many came after [`MAX_KEPT_NOTIFICATIONS`] (or [`MAX_KEPT_NOTIFICATION_BYTES`])
    /// and were not kept.
    notifications_dropped: u64,
    /// The bytes of the lines of the notifications kept.
    notification_bytes: usize,
}

/// How long a dropped server's host gets to stop once its input is closed, and then once
/// told to stop (SIGTERM), before it is killed.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Notifications kept for [`McpServer::notifications`]; later ones are dropped.
const MAX_KEPT_NOTIFICATIONS: usize = 10_000;
/// Bytes of notifications kept (a host line may be up to `max_message_bytes`, 1 MiB by
/// default): a tool that floods its log fails the test's checks, not its memory.
const MAX_KEPT_NOTIFICATION_BYTES: usize = 64 << 20;

fn io(what: &str) -> impl FnOnce(std::io::Error) -> HarnessError + '_ {
    move |source| HarnessError::Io {
        what: what.to_string(),
        source,
    }
}

impl McpServer {
    pub(super) fn start(
        mut cmd: Command,
        launch_failure: String,
        server_id: String,
        records: PathBuf,
        health: PathBuf,
        workspace: tempfile::TempDir,
    ) -> Result<McpServer, HarnessError> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|source| HarnessError::Io {
            what: launch_failure,
            source,
        })?;
        let (Some(stdin), Some(stdout), Some(mut err)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            return Err(HarnessError::Run(
                "flowhost sandbox mcp has no stdio".into(),
            ));
        };
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        });
        let mut server = McpServer {
            child,
            stdin: Some(stdin),
            stdout: BufReader::new(stdout),
            stderr: Some(stderr),
            next_id: 1,
            server_id,
            records,
            health,
            workspace: Some(workspace),
            notifications: Vec::new(),
            notifications_dropped: 0,
            notification_bytes: 0,
        };
        let init = server.request(
            "initialize",
            json!({
                "protocolVersion": crate::mcp::PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "flowhost-harness", "version": env!("CARGO_PKG_VERSION")},
            }),
        );
        match init {
            Ok(r) if r.get("result").is_some() => Ok(server),
            Ok(r) => Err(HarnessError::Run(format!(
                "initialize was refused: {}",
                super::shown(&r.to_string())
            ))),
            Err(e) => {
                let said = server.stop_and_collect();
                Err(HarnessError::Run(format!(
                    "flowhost sandbox mcp did not start serving ({e}); it said:\n{}",
                    super::shown(&said)
                )))
            }
        }
    }

    /// The server id of the signed manifest (tools are named `server/tool`).
    pub fn server_id(&self) -> &str {
        &self.server_id
    }

    /// Sends one request and returns the whole response (`result` or `error`).
    pub fn request(&mut self, method: &str, params: Value) -> Result<Value, HarnessError> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))?;
        // What the tool sends before its result (log lines, progress) comes first, as
        // notifications; a request of the host's (sampling, elicitation: this client
        // declares neither) is answered that it is not served.
        loop {
            let mut reply = String::new();
            let n = self
                .stdout
                .read_line(&mut reply)
                .map_err(io("cannot read from flowhost sandbox mcp"))?;
            if n == 0 {
                return Err(HarnessError::Run(format!(
                    "flowhost sandbox mcp closed its output before answering {method}"
                )));
            }
            let v: Value = serde_json::from_str(&reply)
                .map_err(|e| HarnessError::Run(format!("not a JSON-RPC line ({e}): {reply:?}")))?;
            match (v.get("method"), v.get("id")) {
                (Some(_), None) => {
                    if self.notifications.len() < MAX_KEPT_NOTIFICATIONS
                        && self.notification_bytes + reply.len() <= MAX_KEPT_NOTIFICATION_BYTES
                    {
                        self.notification_bytes += reply.len();
                        self.notifications.push(v);
                    } else {
                        self.notifications_dropped += 1;
                    }
                }
                (Some(asked), Some(their_id)) => {
                    self.send(&json!({"jsonrpc": "2.0", "id": their_id, "error": {
                        "code": crate::mcp::code::METHOD_NOT_FOUND,
                        "message": format!("the test harness serves no {asked}")}}))?;
                }
                (None, _) if v["id"] == id => return Ok(v),
                (None, _) => {
                    return Err(HarnessError::Run(format!(
                        "the response is not for request {id}: {}",
                        super::shown(&v.to_string())
                    )));
                }
            }
        }
    }

    /// Writes one message to the server, as one line.
    fn send(&mut self, message: &Value) -> Result<(), HarnessError> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| HarnessError::Run("the server's input is closed".into()))?;
        writeln!(stdin, "{message}")
            .and_then(|()| stdin.flush())
            .map_err(io("cannot write to flowhost sandbox mcp"))
    }

    /// The notifications the host sent while requests were answered (the tool's log lines
    /// and progress, each as the whole JSON-RPC message), oldest first: the first 10,000
    /// only, and no more than 64 MiB of them. A test that looks for what must not be in any of them checks
    /// [`McpServer::notifications_dropped`] too.
    pub fn notifications(&self) -> &[Value] {
        &self.notifications
    }

    /// How many notifications came after the first 10,000 (or 64 MiB) and were not kept (so
    /// are not in [`McpServer::notifications`]).
    pub fn notifications_dropped(&self) -> u64 {
        self.notifications_dropped
    }

    /// The tools the server offers (`tools/list`), named `server/tool`.
    pub fn list_tools(&mut self) -> Result<Vec<Value>, HarnessError> {
        let r = self.request("tools/list", json!({}))?;
        r["result"]["tools"].as_array().cloned().ok_or_else(|| {
            HarnessError::Run(format!(
                "tools/list gave no tools: {}",
                super::shown(&r.to_string())
            ))
        })
    }

    /// Calls `tool` (`server/tool`, or the bare tool name of this server) with `arguments`;
    /// returns the whole response: a `result` (with `isError` when the tool failed), or an
    /// `error` when the host refused the call (`error.data.denial` says why).
    pub fn call(&mut self, tool: &str, arguments: Value) -> Result<Value, HarnessError> {
        let name = if tool.contains('/') {
            tool.to_string()
        } else {
            format!("{}/{tool}", self.server_id)
        };
        self.request("tools/call", json!({"name": name, "arguments": arguments}))
    }

    /// Ends the session (closes the server's input), waits for the host to stop its
    /// executors, write its records and health, and returns what the run produced.
    pub fn finish(mut self) -> Result<Observation, HarnessError> {
        self.stdin = None;
        let mut rest = String::new();
        let _ = self.stdout.read_to_string(&mut rest);
        let status = self
            .child
            .wait()
            .map_err(io("cannot wait for flowhost sandbox mcp"))?;
        let stderr = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let workspace = self
            .workspace
            .take()
            .ok_or_else(|| HarnessError::Run("the run's workspace is gone".into()))?;
        Observation::read(
            status,
            rest,
            stderr,
            self.records.clone(),
            self.health.clone(),
            workspace,
        )
        .map(Observation::of_mcp_host)
    }

    /// Stops the host as `finish` would (its input closed), then, if it has not stopped
    /// within [`STOP_GRACE`], with SIGTERM, and last by killing it: a killed host leaves its
    /// private directory (and its executors' cgroups, until another broker sweeps them).
    fn stop_and_collect(&mut self) -> String {
        self.stdin = None;
        // What the host still writes is read and dropped while it stops: unread, a full
        // pipe would hold its relay, and with it the stop, until it is killed.
        let out = self.stdout.get_mut();
        let _ = nix::fcntl::fcntl(
            &*out,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        );
        let stopped_within = |child: &mut Child, out: &mut ChildStdout, limit| {
            let deadline = std::time::Instant::now() + limit;
            let mut scratch = [0u8; 8192];
            loop {
                while matches!(out.read(&mut scratch), Ok(n) if n > 0) {}
                match child.try_wait() {
                    Ok(Some(_)) => return true,
                    Ok(None) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    Ok(None) | Err(_) => return false,
                }
            }
        };
        if !stopped_within(&mut self.child, out, STOP_GRACE) {
            // The child's pid stays its own until it is waited for.
            let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            if !stopped_within(&mut self.child, out, STOP_GRACE) {
                let _ = self.child.kill();
            }
        }
        let _ = self.child.wait();
        self.stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        if self.stderr.is_some() {
            self.stop_and_collect();
        }
    }
}
