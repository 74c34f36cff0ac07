//! A third-party Python MCP server that makes real HTTP requests (`mcp-server-fetch` from
//! PyPI, installed by `.ci/install-interop`), governed by the real daemon: once with
//! `egress: false` (its lookup and its connect are refused, recorded, and the local HTTP
//! server receives nothing), once with a clearance and a host-name rule (the name resolves
//! through the host's mediation to a DNS server this test runs on loopback, the fetch
//! succeeds, and the egress record carries the name).

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::lab::{Client, records_in};
use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use serde_json::{Value, json};

const FETCH: &str = "/opt/flowhost-interop/venv/bin/mcp-server-fetch";
const BOTTOM: &str = r#"{ kind = "known", owners = {}, compartments = [] }"#;

/// A DNS server on loopback that knows one name, `fetch.test` -> 127.0.0.1, and counts every
/// query it receives by name.
struct TestDns {
    addr: SocketAddr,
    asked: Arc<std::sync::Mutex<Vec<String>>>,
}

impl TestDns {
    fn start() -> TestDns {
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

    fn asked(&self, name: &str) -> usize {
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
struct TestHttp {
    port: u16,
    connections: Arc<AtomicUsize>,
}

const BODY: &str = "flowhost fetched this through a host name";

impl TestHttp {
    fn start() -> TestHttp {
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

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// The signed manifest of the fetch server's one tool, with `egress` as declared.
fn signed_manifest(dir: &Path, egress: bool) -> (PathBuf, PathBuf) {
    let flowhost = env!("CARGO_BIN_EXE_flowhost");
    let keys = dir.join("keys");
    let out = Command::new(flowhost)
        .args(["key", "generate", "--out"])
        .arg(&keys)
        .args(["--name", "fetch"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let public = std::fs::read_to_string(keys.join("fetch.pub")).unwrap();
    let body = json!({
        "schema": "flowhost.manifest.v1",
        "server_id": "fetch",
        "name": "Fetch (mcp-server-fetch from PyPI)",
        "description": "Fetches a URL and returns its content.",
        "version": "1.0.0",
        "public_key": public.trim(),
        "tools": [{
            "name": "fetch",
            "description": "Fetches a URL from the internet.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "url": {"type": "string", "minLength": 1, "maxLength": 2000},
                    "raw": {"type": "boolean"}
                },
                "required": ["url"],
                "additionalProperties": false
            },
            "pricing": {"model": "free"},
            "annotations": {"read_only": true, "destructive": false, "idempotent": true, "requires_approval": false},
            "latency_hint": "fast",
            "flow": {
                "output_label": {"kind": "known", "owners": {}, "compartments": []},
                "input_clearance": {"kind": "known", "owners": {}, "compartments": []},
                "egress": egress
            }
        }]
    });
    let body_file = dir.join("fetch.manifest.json");
    std::fs::write(&body_file, serde_json::to_vec_pretty(&body).unwrap()).unwrap();
    let signed = dir.join("fetch.signed.json");
    let out = Command::new(flowhost)
        .args(["manifest", "sign", "--key"])
        .arg(keys.join("fetch.key"))
        .arg("--manifest")
        .arg(&body_file)
        .arg("--out")
        .arg(&signed)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    (signed, keys.join("fetch.pub"))
}

/// A running daemon governing the fetch server.
struct Daemon {
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
    fn start(egress: bool, dns: &TestDns, http: &TestHttp) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let (manifest, key) = signed_manifest(dir.path(), egress);
        // Without egress, the server runs with no network path (an empty network namespace):
        // every attempt is still stopped at the syscall, judged and recorded.
        let (clearances, profile) = if egress {
            (BOTTOM, "brokered")
        } else {
            ("", "isolated")
        };
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
tools = ["fetch/*"]

[[server]]
id = "fetch"
manifest = "{manifest}"
key = "{key}"
command = ["{FETCH}", "--ignore-robots-txt"]
profile = "{profile}"
read_paths = ["/opt/flowhost-interop"]

[server.destinations]
allow = ["fetch.test:{port}"]

[server.tools.fetch]
policy = {{ input_clearances = [{clearances}], output_floor = {BOTTOM} }}
"#,
            dir = dir.path().display(),
            dns = dns.addr,
            manifest = manifest.display(),
            key = key.display(),
            port = http.port,
        );
        let config_file = dir.path().join("host.toml");
        std::fs::write(&config_file, config).unwrap();
        let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_flowhost"))
            .args(["serve", "--log-format", "text", "--config"])
            .arg(&config_file)
            .env("FLOWHOST_LOG", "info,flowhost=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut d = Daemon { dir, child };
        let socket = d.dir.path().join("flowhost.sock");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if let Ok(Some(status)) = d.child.try_wait() {
                panic!("the daemon exited ({status}):\n{}", d.log());
            }
            assert!(
                Instant::now() < deadline,
                "the daemon did not start:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    fn client(&self) -> Client {
        let mut c = Client::connect(&self.dir.path().join("flowhost.sock"));
        c.initialize();
        c
    }

    fn egress_records(&self) -> Vec<Value> {
        records_in(&self.dir.path().join("records"))
            .into_iter()
            .filter(|r| r["flowhost"]["event"] == "egress_attempt")
            .collect()
    }
}

fn flowhost_ext(r: &Value) -> &Value {
    &r["flowhost"]
}

fn skip() -> bool {
    if !common::is_root() {
        eprintln!("SKIP: the daemon tests need root for the broker (CI runs them as root)");
        return true;
    }
    if !Path::new(FETCH).exists() {
        eprintln!("SKIP: {FETCH} is missing (installed by .ci/install-interop)");
        return true;
    }
    false
}

fn fetch(client: &mut Client, url: &str) -> Value {
    client.call("fetch/fetch", json!({"url": url, "raw": true}))
}

#[test]
fn fetch_server_with_egress_false_is_refused_at_the_syscall() {
    if skip() {
        return;
    }
    let (dns, http) = (TestDns::start(), TestHttp::start());
    let daemon = Daemon::start(false, &dns, &http);
    let mut client = daemon.client();

    let by_name = fetch(&mut client, &format!("http://fetch.test:{}/", http.port));
    assert!(
        !by_name.to_string().contains(BODY),
        "{by_name}\n{}",
        daemon.log()
    );
    let by_address = fetch(&mut client, &format!("http://127.0.0.1:{}/", http.port));
    assert!(!by_address.to_string().contains(BODY), "{by_address}");
    assert_eq!(http.connections(), 0, "the HTTP server received nothing");
    assert!(!daemon.egress_records().is_empty());
    assert_eq!(
        dns.asked("fetch.test."),
        0,
        "a refused lookup never leaves the host"
    );

    let records = daemon.egress_records();
    let text = serde_json::to_string_pretty(&records).unwrap();
    // The lookup: its query to the host's resolver refused at the syscall, recorded.
    assert!(
        records
            .iter()
            .any(|r| flowhost_ext(r)["broker"]["destination"]["port"] == 53),
        "{text}\n{}",
        daemon.log()
    );
    // The connect to the literal address: refused at the syscall, recorded.
    assert!(
        records.iter().any(|r| {
            let b = &flowhost_ext(r)["broker"];
            b["syscall"] == "connect"
                && b["destination"]["address"] == "127.0.0.1"
                && b["destination"]["port"] == http.port
        }),
        "{text}"
    );
    assert!(
        records.iter().all(|r| r["decision"]["effect"] == "deny"),
        "{text}"
    );
    assert!(
        records
            .iter()
            .all(|r| flowhost_ext(r)["denial_kind"] == "missing_clearance"),
        "{text}"
    );
}

#[test]
fn fetch_server_reaches_a_named_destination_through_the_hosts_resolver() {
    if skip() {
        return;
    }
    let (dns, http) = (TestDns::start(), TestHttp::start());
    let daemon = Daemon::start(true, &dns, &http);
    let mut client = daemon.client();

    // An address of the allowed name, hard-coded (no lookup): address rules alone judge it.
    let literal = fetch(&mut client, &format!("http://127.0.0.1:{}/", http.port));
    assert!(!literal.to_string().contains(BODY), "{literal}");
    assert_eq!(http.connections(), 0);

    // A name no rule allows does not resolve, and never reaches the upstream resolver.
    let other = fetch(&mut client, &format!("http://other.test:{}/", http.port));
    assert!(!other.to_string().contains(BODY), "{other}");
    assert_eq!(dns.asked("other.test."), 0);

    // The allowed name resolves through the host and the fetch succeeds.
    let ok = fetch(&mut client, &format!("http://fetch.test:{}/", http.port));
    assert!(ok.to_string().contains(BODY), "{ok}\n{}", daemon.log());
    assert_eq!(http.connections(), 1);
    assert!(dns.asked("fetch.test.") >= 1);

    let records = daemon.egress_records();
    let text = serde_json::to_string_pretty(&records).unwrap();
    let broker = |r: &Value| flowhost_ext(r)["broker"].clone();
    let connects: Vec<Value> = records
        .iter()
        .filter(|r| broker(r)["syscall"] == "connect")
        .cloned()
        .collect();
    assert_eq!(connects.len(), 2, "{text}");
    assert!(
        !text.contains("nscd"),
        "glibc's nscd connects are not egress records: {text}"
    );
    assert!(
        broker(&connects[0])["destination"]
            .get("host_name")
            .is_none(),
        "{text}"
    );
    assert_eq!(
        flowhost_ext(&connects[0])["denial_kind"],
        "destination_blocked",
        "{text}"
    );
    assert_eq!(
        broker(&connects[1])["destination"]["host_name"],
        "fetch.test",
        "{text}"
    );
    assert_eq!(broker(&connects[1])["destination"]["address"], "127.0.0.1");
    assert_eq!(connects[1]["decision"]["effect"], "allow", "{text}");
    assert!(
        records.iter().any(|r| broker(r)["syscall"] == "dns_query"
            && broker(r)["destination"]["host_name"] == "other.test"
            && flowhost_ext(r)["denial_kind"] == "name_not_allowed"),
        "{text}"
    );
    // No other egress was recorded: lookups of allowed names and the sends to the host's
    // resolver are not egress records.
    let lookups = records
        .iter()
        .filter(|r| broker(r)["syscall"] == "dns_query")
        .count();
    assert_eq!(records.len(), connects.len() + lookups, "{text}");
}
