//! A real `flowhost serve` governing servers given by the test: manifests signed at test time
//! with a fresh key, a host configuration with one principal (this process's uid) allowed
//! every tool, and a raw MCP client that sees every message (answers in any order,
//! notifications).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::is_root;

/// One server to govern.
pub struct ServerSpec {
    /// The server id.
    pub id: String,
    /// argv (argv[0] absolute and runnable by executor uids).
    pub command: Vec<String>,
    /// The execution profile.
    pub profile: String,
    /// The manifest's tool declarations.
    pub tools: Vec<Value>,
    /// Extra TOML lines for the `[[server]]` table (env, read_paths, pool_size, ...).
    pub extra: String,
    /// The tools the principal may call (`None`: all of them).
    pub allowed: Option<Vec<String>>,
    /// Every tool's policy output floor (TOML inline table; bottom by default).
    pub output_floor: String,
    /// Every tool's policy input clearances (a TOML array of labels; none by default, so a
    /// tool with effective egress needs some).
    pub input_clearances: String,
}

impl ServerSpec {
    /// A server with `tools`, run by `command` under the `isolated` profile.
    pub fn new(id: &str, command: Vec<String>, tools: Vec<Value>) -> ServerSpec {
        ServerSpec {
            id: id.into(),
            command,
            profile: "isolated".into(),
            tools,
            extra: String::new(),
            allowed: None,
            output_floor: flowhost::lab::BOTTOM_LABEL.into(),
            input_clearances: "[]".into(),
        }
    }
}

/// A manifest tool declaration: `name`, an input schema, no egress.
pub fn tool(name: &str, input_schema: Value) -> Value {
    json!({
        "name": name,
        "description": format!("The {name} tool."),
        "input_schema": input_schema,
        "annotations": {"read_only": true, "destructive": false, "idempotent": true,
                        "requires_approval": false},
    })
}

fn flowhost(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "flowhost {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn toml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

/// A running host governing test-given servers.
pub struct Governed {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub records_dir: PathBuf,
    child: Option<Child>,
}

impl Governed {
    /// Signs a manifest for every server, writes the configuration and starts the daemon
    /// (waiting until it answers), or returns `None` (printing why) without root.
    pub fn start(servers: &[ServerSpec], host_extra: &str) -> Option<Governed> {
        if !is_root() {
            eprintln!("SKIP: the daemon tests need root for the broker (CI runs them as root)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let p = |s: &str| dir.path().join(s);
        let socket = p("flowhost.sock");
        let records_dir = p("records");
        // A test that sets its own deadline sets it in `host_extra`.
        let timeout = match host_extra.contains("call_timeout_ms") {
            true => "",
            false => "call_timeout_ms = 15000\n",
        };
        let mut config = format!(
            "[host]\nsocket = {}\nsocket_mode = \"600\"\nstate_dir = {}\nrecords_dir = {}\n\
             classifier_version = \"test-1\"\n{timeout}{host_extra}\n\n\
             [[principal]]\nid = \"tester\"\nuids = [{}]\ntools = [{}]\n",
            toml_str(socket.to_str().unwrap()),
            toml_str(p("state").to_str().unwrap()),
            toml_str(records_dir.to_str().unwrap()),
            // SAFETY: getuid has no preconditions.
            unsafe { libc::getuid() },
            servers
                .iter()
                .flat_map(|s| match &s.allowed {
                    None => vec![toml_str(&format!("{}/*", s.id))],
                    Some(tools) => tools
                        .iter()
                        .map(|t| toml_str(&format!("{}/{t}", s.id)))
                        .collect(),
                })
                .collect::<Vec<_>>()
                .join(", "),
        );
        for s in servers {
            let keys = p(&format!("keys-{}", s.id));
            let public = flowhost(&[
                "key",
                "generate",
                "--out",
                keys.to_str().unwrap(),
                "--name",
                &s.id,
            ]);
            let body = json!({
                "schema": "flowhost.manifest.v1",
                "server_id": s.id,
                "name": format!("Test server {}", s.id),
                "version": "1.0.0",
                "public_key": public.trim(),
                "tools": s.tools,
            });
            let body_path = p(&format!("{}.manifest.json", s.id));
            std::fs::write(&body_path, body.to_string()).unwrap();
            let signed = p(&format!("{}.signed.json", s.id));
            flowhost(&[
                "manifest",
                "sign",
                "--key",
                keys.join(format!("{}.key", s.id)).to_str().unwrap(),
                "--manifest",
                body_path.to_str().unwrap(),
                "--out",
                signed.to_str().unwrap(),
            ]);
            config.push_str(&format!(
                "\n[[server]]\nid = {}\nmanifest = {}\nkey = {}\ncommand = [{}]\nprofile = {}\n{}\n",
                toml_str(&s.id),
                toml_str(signed.to_str().unwrap()),
                toml_str(keys.join(format!("{}.pub", s.id)).to_str().unwrap()),
                s.command
                    .iter()
                    .map(|a| toml_str(a))
                    .collect::<Vec<_>>()
                    .join(", "),
                toml_str(&s.profile),
                s.extra,
            ));
            for t in &s.tools {
                config.push_str(&format!(
                    "\n[server.tools.{}]\npolicy = {{ input_clearances = {}, output_floor = {} }}\n",
                    toml_str(t["name"].as_str().unwrap()),
                    s.input_clearances,
                    s.output_floor,
                ));
            }
        }
        let config_path = p("host.toml");
        std::fs::write(&config_path, config).unwrap();
        let log = std::fs::File::create(p("daemon.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_flowhost"))
            .args(["serve", "--log-format", "text", "--config"])
            .arg(&config_path)
            .env("FLOWHOST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut host = Governed {
            dir,
            socket,
            records_dir,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if UnixStream::connect(&host.socket).is_ok() {
                return Some(host);
            }
            if let Some(Ok(Some(status))) = host.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "the daemon exited during startup ({status}):\n{}",
                    host.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the daemon did not start listening:\n{}", host.log());
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// Every record so far.
    pub fn records(&self) -> Vec<Value> {
        super::lab::records_in(&self.records_dir)
    }

    /// A raw client, initialized.
    pub fn client(&self) -> RawClient {
        let mut c = RawClient::connect(&self.socket);
        let r = c.request(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "test", "version": "0"}}),
        );
        assert!(r.get("result").is_some(), "initialize: {r}");
        c.notify("notifications/initialized", json!({}));
        c
    }

    /// Sends `signal` to the daemon (SIGHUP: reload its configuration).
    pub fn signal(&self, signal: i32) {
        if let Some(child) = &self.child {
            // SAFETY: signalling our own child, which has not been reaped.
            unsafe { libc::kill(child.id() as i32, signal) };
        }
    }

    /// The public key the configuration registers for server `id`.
    pub fn key_of(&self, id: &str) -> PathBuf {
        self.dir.path().join(format!("keys-{id}/{id}.pub"))
    }

    /// Sends SIGTERM and waits for the daemon to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }
}

impl Drop for Governed {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A client of the daemon's socket that sees every line.
pub struct RawClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    next_id: u64,
}

impl RawClient {
    pub fn connect(socket: &Path) -> RawClient {
        let writer = UnixStream::connect(socket).unwrap();
        writer
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        RawClient {
            reader: BufReader::new(writer.try_clone().unwrap()),
            writer,
            next_id: 1000,
        }
    }

    pub fn send(&mut self, message: &Value) {
        let mut line = message.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).unwrap();
    }

    /// Sends `messages` in one write, so the daemon reads them together.
    pub fn send_together(&mut self, messages: &[Value]) {
        let mut lines = String::new();
        for m in messages {
            lines.push_str(&m.to_string());
            lines.push('\n');
        }
        self.writer.write_all(lines.as_bytes()).unwrap();
    }

    /// The next message from the daemon (any kind).
    pub fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).unwrap();
        assert!(n > 0, "the daemon closed the connection");
        serde_json::from_str(&line).unwrap()
    }

    /// Sends request `id`.
    pub fn send_request(&mut self, id: u64, method: &str, params: Value) {
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
    }

    pub fn notify(&mut self, method: &str, params: Value) {
        self.send(&json!({"jsonrpc": "2.0", "method": method, "params": params}));
    }

    /// Sends a request and returns its answer, failing on any other message in between.
    pub fn request(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        self.send_request(id, method, params);
        let answer = self.recv();
        assert_eq!(answer["id"], json!(id), "unexpected message: {answer}");
        answer
    }
}
