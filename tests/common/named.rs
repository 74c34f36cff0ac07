//! Named destinations end to end: a DNS server and an HTTP server on loopback, a signed
//! manifest made on the fly, and a real daemon governing one server with them.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use serde_json::{Value, json};

use super::lab::{Client, records_in, spawn_daemon};

/// The bottom label, as the host configuration writes it.
pub const BOTTOM: &str = r#"{ kind = "known", owners = {}, compartments = [] }"#;

/// A DNS server on loopback that knows one name, `fetch.test` -> 127.0.0.1, and counts every
/// query it receives by name.
pub struct TestDns {
    pub addr: SocketAddr,
    asked: Arc<std::sync::Mutex<Vec<String>>>,
}

impl TestDns {
    pub fn start() -> TestDns {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = sock.local_addr().unwrap();
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = asked.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok((n, from)) = sock.recv_from(&mut buf) {
                let Ok(q) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let mut r = q.clone().into_response();
                r.metadata.recursion_available = true;
                let Some(query) = q.queries.first() else {
                    continue;
                };
                let name = query.name().to_ascii().to_lowercase();
                log.lock().unwrap().push(name.clone());
                if name == "fetch.test." {
                    if query.query_type() == RecordType::A {
                        r.add_answer(Record::from_rdata(
                            Name::from_str("fetch.test.").unwrap(),
                            60,
                            RData::A(A(Ipv4Addr::LOCALHOST)),
                        ));
                    }
                } else {
                    r.metadata.response_code = ResponseCode::NXDomain;
                }
                let _ = sock.send_to(&r.to_vec().unwrap(), from);
            }
        });
        TestDns { addr, asked }
    }

    pub fn asked(&self, name: &str) -> usize {
        self.asked
            .lock()
            .unwrap()
            .iter()
            .filter(|n| n.as_str() == name)
            .count()
    }
}

/// An HTTP server on loopback answering every request with a fixed text, counting
/// connections.
pub struct TestHttp {
    pub port: u16,
    connections: Arc<AtomicUsize>,
}

pub const BODY: &str = "flowhost fetched this through a host name";

impl TestHttp {
    pub fn start() -> TestHttp {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let count = connections.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { continue };
                count.fetch_add(1, Ordering::SeqCst);
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let mut head = Vec::new();
                let mut b = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut b) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&b[..n]),
                    }
                }
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
                    BODY.len()
                );
            }
        });
        TestHttp { port, connections }
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// A manifest tool object: read-only, bottom output label and clearance, `egress` as
/// declared.
pub fn tool(name: &str, input_schema: Value, egress: bool) -> Value {
    json!({
        "name": name,
        "description": format!("The {name} tool of a governed test server."),
        "input_schema": input_schema,
        "pricing": {"model": "free"},
        "annotations": {"read_only": true, "destructive": false, "idempotent": true, "requires_approval": false},
        "latency_hint": "fast",
        "flow": {
            "output_label": {"kind": "known", "owners": {}, "compartments": []},
            "input_clearance": {"kind": "known", "owners": {}, "compartments": []},
            "egress": egress
        }
    })
}

/// A signed manifest of server `id` with `tools` (manifest tool objects), and its key
/// file: (envelope, public key file).
pub fn signed_manifest(dir: &Path, id: &str, tools: Value) -> (PathBuf, PathBuf) {
    let flowhost = env!("CARGO_BIN_EXE_flowhost");
    let keys = dir.join("keys");
    let out = Command::new(flowhost)
        .args(["key", "generate", "--out"])
        .arg(&keys)
        .args(["--name", id])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let public = std::fs::read_to_string(keys.join(format!("{id}.pub"))).unwrap();
    let body = json!({
        "schema": "flowhost.manifest.v1",
        "server_id": id,
        "name": id,
        "description": "A server governed in a test.",
        "version": "1.0.0",
        "public_key": public.trim(),
        "tools": tools,
    });
    let body_file = dir.join(format!("{id}.manifest.json"));
    std::fs::write(&body_file, serde_json::to_vec_pretty(&body).unwrap()).unwrap();
    let signed = dir.join(format!("{id}.signed.json"));
    let out = Command::new(flowhost)
        .args(["manifest", "sign", "--key"])
        .arg(keys.join(format!("{id}.key")))
        .arg("--manifest")
        .arg(&body_file)
        .arg("--out")
        .arg(&signed)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    (signed, keys.join(format!("{id}.pub")))
}

/// The one server a test daemon governs, with one tool.
pub struct Served<'a> {
    /// Server id.
    pub id: &'a str,
    /// The tool's name.
    pub tool: &'a str,
    /// The manifest's tools (see [`tool`]).
    pub tools: Value,
    /// argv.
    pub command: Vec<String>,
    /// Execution profile.
    pub profile: &'a str,
    /// The one extra Landlock read path.
    pub read_path: PathBuf,
    /// The one allow rule.
    pub allow: String,
    /// Whether the tool's policy has the bottom clearance (else none).
    pub cleared: bool,
    /// The server's `private_answers` (names whose answers may bind private addresses).
    pub private_answers: Vec<String>,
}

/// A running daemon governing one server.
pub struct Daemon {
    dir: tempfile::TempDir,
    child: Child,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Starts a daemon whose upstream resolver is `dns`, serving `server` to principal
    /// uid 0.
    pub fn start(dns: &TestDns, server: Served) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let (manifest, key) = signed_manifest(dir.path(), server.id, server.tools);
        let command: Vec<String> = server.command.iter().map(|a| format!("{a:?}")).collect();
        let config = format!(
            r#"[host]
socket = "{dir}/flowhost.sock"
socket_mode = "600"
state_dir = "{dir}/state"
records_dir = "{dir}/records"
call_timeout_ms = 20000
initialize_timeout_ms = 20000
dns_upstream = ["{dns}"]

[[principal]]
id = "operator"
uids = [0]
tools = ["{id}/*"]

[[server]]
id = "{id}"
manifest = "{manifest}"
key = "{key}"
command = [{command}]
profile = "{profile}"
read_paths = ["{read}"]
{private_answers}

[server.destinations]
allow = ["{allow}"]

[server.tools.{tool}]
policy = {{ input_clearances = [{clearances}], output_floor = {BOTTOM} }}
"#,
            dir = dir.path().display(),
            dns = dns.addr,
            id = server.id,
            manifest = manifest.display(),
            key = key.display(),
            command = command.join(", "),
            profile = server.profile,
            read = server.read_path.display(),
            allow = server.allow,
            tool = server.tool,
            clearances = if server.cleared { BOTTOM } else { "" },
            private_answers = if server.private_answers.is_empty() {
                String::new()
            } else {
                format!("private_answers = {:?}", server.private_answers)
            },
        );
        let config_file = dir.path().join("host.toml");
        std::fs::write(&config_file, config).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_flowhost"));
        command
            .args(["serve", "--log-format", "text", "--config"])
            .arg(&config_file);
        let child = spawn_daemon(
            command,
            &dir.path().join("daemon.log"),
            &dir.path().join("flowhost.sock"),
        );
        Daemon { dir, child }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    pub fn client(&self) -> Client {
        let mut c = Client::connect(&self.dir.path().join("flowhost.sock"));
        c.initialize();
        c
    }

    /// Every record the daemon has written so far.
    pub fn records(&self) -> Vec<Value> {
        records_in(&self.dir.path().join("records"))
    }

    pub fn egress_records(&self) -> Vec<Value> {
        records_in(&self.dir.path().join("records"))
            .into_iter()
            .filter(|r| r["flowhost"]["event"] == "egress_attempt")
            .collect()
    }
}

/// Writes `script` as `server.js` into a fresh directory every executor uid can read (the
/// executor runs as its own uid), or `None` (having said why) when the test cannot run here:
/// the daemon needs root for the broker, and Node.js must be installed.
pub fn node_script(name: &str, script: &str) -> Option<(PathBuf, PathBuf)> {
    if !super::is_root() {
        eprintln!("SKIP: the daemon tests need root for the broker (CI runs them as root)");
        return None;
    }
    if !super::third_party(Path::new(NODE)) {
        return None;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = super::shared_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = dir.join("server.js");
    std::fs::write(&file, script).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    Some((dir, file))
}

/// Where the interop install puts Node.js (Debian's package).
pub const NODE: &str = "/usr/bin/node";
