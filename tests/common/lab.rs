//! A real `flowhost serve` running the pricing lab, with loopback sinks and an MCP client.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flowhost::lab::{LabPaths, declared_surface, host_config};
use serde_json::{Value, json};

use super::{TcpSink, is_root, shared_copy};

/// The reviewer principal's uid in the lab.
pub const REVIEWER_UID: u32 = 65533;

/// A running lab host.
pub struct Lab {
    pub dir: tempfile::TempDir,
    pub paths: LabPaths,
    pub config: PathBuf,
    pub team: TcpSink,
    pub public: TcpSink,
    pub exfil: TcpSink,
    child: Option<Child>,
}

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Copies the lab's documents somewhere executors (another uid, outside /tmp) can read,
/// once per test process: copied again for each lab, a document another test's tool was
/// reading meanwhile was read truncated (empty), and that test failed.
fn shared_documents() -> PathBuf {
    static DOCUMENTS: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DOCUMENTS
        .get_or_init(|| {
            let src = repo("fixtures/pricing-lab/documents");
            let dir = super::shared_dir().join(format!("documents-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            for e in std::fs::read_dir(&src).unwrap().flatten() {
                std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
            }
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
            dir
        })
        .clone()
}

impl Lab {
    /// Starts the lab host, or returns `None` (printing why) where the broker cannot run.
    pub fn start() -> Option<Lab> {
        Lab::start_inner(true)
    }

    fn start_inner(spawn: bool) -> Option<Lab> {
        if !is_root() {
            eprintln!("SKIP: the daemon tests need root for the broker (CI runs them as root)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let (team, public, exfil) = (TcpSink::start(), TcpSink::start(), TcpSink::start());
        let paths = LabPaths {
            workspace_command: vec![shared_copy("flowhost-tool-workspace").display().to_string()],
            publisher_command: vec![shared_copy("flowhost-tool-publisher").display().to_string()],
            documents: shared_documents(),
            manifests_dir: repo("fixtures/pricing-lab"),
            keys_dir: repo("fixtures/pricing-lab/keys"),
            state_dir: dir.path().join("state"),
            records_dir: dir.path().join("records"),
            socket: dir.path().join("flowhost.sock"),
            team_sink: team.addr,
            public_sink: public.addr,
            exfil_sink: exfil.addr,
            analyst_uid: 0,
            reviewer_uid: REVIEWER_UID,
            socket_mode: "666".into(),
        };
        let config = dir.path().join("host.toml");
        std::fs::write(&config, host_config(&paths)).unwrap();
        let mut lab = Lab {
            dir,
            paths,
            config,
            team,
            public,
            exfil,
            child: None,
        };
        if spawn {
            lab.spawn();
        }
        Some(lab)
    }

    /// Starts (or restarts) the daemon process and waits until it answers.
    pub fn spawn(&mut self) {
        let command = self.serve_command();
        let socket = self.paths.socket.clone();
        self.spawn_with(command, &socket);
    }

    /// `flowhost serve` for this lab, logging to the lab's log file.
    pub fn serve_command(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_flowhost"));
        c.args(["serve", "--log-format", "text", "--config"])
            .arg(&self.config);
        c
    }

    /// Starts `command` (a daemon, possibly wrapped) and waits until `socket` answers.
    pub fn spawn_with(&mut self, command: Command, socket: &Path) {
        self.child = Some(spawn_daemon(
            command,
            &self.dir.path().join("daemon.log"),
            socket,
        ));
    }

    /// Takes ownership of a daemon started by the test itself, so it is stopped with the lab
    /// (also when the test fails).
    pub fn adopt(&mut self, child: Child) {
        self.child = Some(child);
    }

    /// The daemon's pid.
    pub fn pid(&self) -> i32 {
        self.child
            .as_ref()
            .map(|c| c.id() as i32)
            .expect("the daemon is running")
    }

    /// Sends `signal` to the daemon.
    pub fn signal(&self, signal: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid(), signal) };
    }

    /// Starts the lab's configuration and sinks without starting a daemon.
    pub fn prepare() -> Option<Lab> {
        Lab::start_inner(false)
    }

    /// Rewrites the configuration file (for reload tests).
    pub fn write_config(&self, text: &str) {
        std::fs::write(&self.config, text).unwrap();
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// A client connected as this process (the analyst, uid 0).
    pub fn client(&self) -> Client {
        Client::connect(&self.paths.socket)
    }

    /// A client connected with another effective uid (the connecting thread alone switches
    /// its euid around `connect`, which is when the kernel captures SO_PEERCRED).
    pub fn client_as(&self, euid: u32) -> Client {
        let socket = self.paths.socket.clone();
        std::thread::spawn(move || {
            // SAFETY: raw setresuid changes only this thread's credentials; -1 keeps the
            // real and saved uid (0), so the thread can switch back.
            unsafe {
                assert_eq!(
                    libc::syscall(libc::SYS_setresuid, -1i64, euid as i64, -1i64),
                    0
                )
            };
            let client = Client::connect(&socket);
            // SAFETY: as above, back to euid 0.
            unsafe { assert_eq!(libc::syscall(libc::SYS_setresuid, -1i64, 0i64, -1i64), 0) };
            client
        })
        .join()
        .unwrap()
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn stop(&mut self) {
        if let Some(status) = self.stop_status() {
            assert!(status.success(), "daemon exit {status}:\n{}", self.log());
        }
    }

    /// Stops the daemon with SIGTERM and returns how it exited (`None`: none was running).
    pub fn stop_status(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        Some(child.wait().unwrap())
    }

    /// Kills the daemon with SIGKILL.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Runs the real CLI with `args`, returning (exit code, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_flowhost"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The lab's declared surface, written to a file.
    pub fn declared_surface_file(&self) -> PathBuf {
        let path = self.dir.path().join("declared.json");
        std::fs::write(&path, declared_surface(&self.paths)).unwrap();
        path
    }

    /// Checks that the lab's records verify (`flowhost records verify`), then judges them
    /// against the lab's declared surface (`flowhost diff --format json`, with `health`
    /// when given): the diff's exit code and its parsed report.
    pub fn verify_and_diff(&self, health: Option<&Path>) -> (i32, Value) {
        let records = self.paths.records_dir.display().to_string();
        let (code, out, err) = self.cli(&["records", "verify", &records]);
        assert_eq!(code, 0, "records verify: {out}{err}");
        let declared = self.declared_surface_file().display().to_string();
        let health = health.map(|h| h.display().to_string());
        let mut args = vec!["diff", "--declared", &declared, "--observed", &records];
        if let Some(h) = &health {
            args.extend(["--health", h]);
        }
        args.extend(["--format", "json"]);
        let (code, out, err) = self.cli(&args);
        let report = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
        (code, report)
    }

    /// Every record line so far, parsed.
    pub fn records(&self) -> Vec<Value> {
        records_in(&self.paths.records_dir)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Starts `command` (a daemon, possibly wrapped) logging to `log_file`, and waits until
/// `socket` answers; panics with the log if the daemon exits or does not start.
pub fn spawn_daemon(mut command: Command, log_file: &Path, socket: &Path) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_file)
        .unwrap();
    let mut child = command
        .env("FLOWHOST_LOG", "info,flowhost=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let read_log = || std::fs::read_to_string(log_file).unwrap_or_default();
    // Ready means this daemon said so (the log is shared by every run of a lab). A socket
    // that accepts is not enough: after a SIGKILL, a child the old daemon was starting can
    // hold its listener until it execs or dies, so a connection can land in the old
    // daemon's backlog and be reset.
    let readies = |log: &str| log.matches("ready: serving").count();
    let before = readies(&read_log());
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if readies(&read_log()) > before && UnixStream::connect(socket).is_ok() {
            return child;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the daemon exited during startup ({status}):\n{}",
                read_log()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the daemon did not start listening:\n{}", read_log());
}

/// The library's MCP client of the daemon's socket, failing the test on I/O errors.
pub struct Client(flowhost::lab::Client);

impl Client {
    /// A placeholder that was never connected (for moving clients out of collections).
    pub fn dummy() -> Client {
        let (a, _b) = UnixStream::pair().unwrap();
        Client(flowhost::lab::Client::over(a).unwrap())
    }

    pub fn connect(socket: &Path) -> Client {
        Client(flowhost::lab::Client::connect(socket).unwrap())
    }

    /// Sends raw bytes (a line is added) and reads one response line.
    pub fn raw(&mut self, bytes: &[u8]) -> Value {
        self.0.raw(bytes).unwrap()
    }

    /// Sends one message, reading nothing.
    pub fn send(&mut self, message: &Value) {
        self.0.send(message).unwrap()
    }

    /// The next message the host sends (an answer, a notification or a request).
    pub fn read(&mut self) -> Value {
        self.0.read().unwrap()
    }

    /// The next message, or the error reading it (the host closed the connection, say).
    pub fn try_read(&mut self) -> std::io::Result<Value> {
        self.0.read()
    }

    /// Sends a request and returns the whole response object.
    pub fn request(&mut self, method: &str, params: Value) -> Value {
        self.0.request(method, params).unwrap()
    }

    /// `initialize`, asserting success.
    pub fn initialize(&mut self) -> Value {
        let r = self.request("initialize", json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}));
        assert!(r.get("result").is_some(), "initialize failed: {r}");
        r["result"].clone()
    }

    /// `tools/call`; returns the whole response.
    pub fn call(&mut self, tool: &str, arguments: Value) -> Value {
        self.request("tools/call", json!({"name": tool, "arguments": arguments}))
    }
}

/// The text of a successful tool result.
pub fn text(response: &Value) -> String {
    assert!(
        response.get("result").is_some(),
        "expected a result: {response}"
    );
    response["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Every record line in the record directory `dir`, parsed, oldest file first.
pub fn records_in(dir: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    for f in files {
        for line in std::fs::read_to_string(f).unwrap().lines() {
            out.push(serde_json::from_str(line).unwrap());
        }
    }
    out
}
