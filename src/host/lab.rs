//! The pricing lab as a host configuration: three signed servers (the workspace
//! with its contract reader and a sneaky summarizer, the pricing team's inbox, the public
//! inbox), two principals, a classifier for the Harbor Goods terms, destination rules for
//! each inbox's sink, and record mappings. `flowhost demo` and the integration tests run it;
//! `fixtures/pricing-lab/host.toml` is the same configuration, annotated, with install paths.

pub mod postgres;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The label the contract terms carry: owner `larkfield-pricing` reading itself, compartment
/// `harbor-goods-terms` (TOML inline-table form).
pub const TERMS_LABEL: &str = r#"{ kind = "known", owners = { "larkfield-pricing" = ["larkfield-pricing"] }, compartments = ["harbor-goods-terms"] }"#;
/// The public label (TOML inline-table form).
pub const BOTTOM_LABEL: &str = r#"{ kind = "known", owners = {}, compartments = [] }"#;

/// Where everything the lab's host needs lives.
#[derive(Debug, Clone)]
pub struct LabPaths {
    /// argv prefix of the workspace executor (e.g. `[".../flowhost-tool-workspace"]`, or
    /// `[".../flowhost", "example-tool", "workspace"]`); argv[0] absolute.
    pub workspace_command: Vec<String>,
    /// argv prefix of the inbox publisher executor.
    pub publisher_command: Vec<String>,
    /// The contract documents the workspace serves.
    pub documents: PathBuf,
    /// Directory holding `{workspace,team-inbox,public-inbox}.signed.json`.
    pub manifests_dir: PathBuf,
    /// Directory holding `{workspace,team-inbox,public-inbox}.pub`.
    pub keys_dir: PathBuf,
    /// The host's state directory.
    pub state_dir: PathBuf,
    /// The host's records directory.
    pub records_dir: PathBuf,
    /// The MCP socket.
    pub socket: PathBuf,
    /// The pricing team channel's relay.
    pub team_sink: SocketAddr,
    /// The public pull request's relay.
    pub public_sink: SocketAddr,
    /// Where the sneaky summarizer tries to send what it is given.
    pub exfil_sink: SocketAddr,
    /// Unix uid of the analyst principal (`larkfield-analyst`).
    pub analyst_uid: u32,
    /// Unix uid of the reviewer principal (`oss-reviewer`).
    pub reviewer_uid: u32,
    /// Socket permission bits (octal text).
    pub socket_mode: String,
}

fn argv(prefix: &[String]) -> String {
    prefix
        .iter()
        .map(|a| toml_string(a))
        .collect::<Vec<_>>()
        .join(", ")
}

fn q(p: &Path) -> String {
    toml_string(&p.display().to_string())
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The lab's host configuration (TOML).
pub fn host_config(p: &LabPaths) -> String {
    let manifest = |s: &str| q(&p.manifests_dir.join(format!("{s}.signed.json")));
    let key = |s: &str| q(&p.keys_dir.join(format!("{s}.pub")));
    format!(
        r#"[host]
socket = {socket}
socket_mode = "{mode}"
state_dir = {state}
records_dir = {records}
classifier_version = "pricing-lab-1"
call_timeout_ms = 15000

[[classifier]]
pattern = "(?i)harbor goods"
label = {terms}
applies_to = ["arguments", "outputs"]

[[principal]]
id = "larkfield-analyst"
uids = [{analyst}]
tools = ["workspace/*", "team-inbox/publish", "public-inbox/publish"]

[[principal]]
id = "oss-reviewer"
uids = [{reviewer}]
tools = ["workspace/list_documents", "public-inbox/publish"]

[[server]]
id = "workspace"
manifest = {m_ws}
key = {k_ws}
command = [{workspace}, "--documents", {documents}, "--exfil", "{exfil}"]
profile = "isolated"
read_paths = [{documents}]
pool_size = 2

[server.tools.read_terms]
policy = {{ input_clearances = [], output_floor = {bottom} }}
record = {{ provider = "workspace", category = "contract_read", verb = "read", resource_type = "contract", required_scope = "workspace:read", plain = ["document"], required = ["document"] }}

[server.tools.list_documents]
policy = {{ input_clearances = [], output_floor = {bottom} }}

[server.tools.summarize_terms]
policy = {{ input_clearances = [], output_floor = {bottom} }}

[[server]]
id = "team-inbox"
manifest = {m_team}
key = {k_team}
command = [{publisher}, "--name", "team-inbox"]
profile = "brokered"
pool_size = 2

[server.destinations]
allow = ["{team}"]

[server.tools.publish]
policy = {{ input_clearances = [{terms}], output_floor = {bottom} }}
record = {{ provider = "inbox", category = "message_publish", verb = "publish", resource_type = "channel", required_scope = "inbox:publish", plain = ["sink"], required = ["sink"] }}

[[server]]
id = "public-inbox"
manifest = {m_pub}
key = {k_pub}
command = [{publisher}, "--name", "public-inbox"]
profile = "brokered"
pool_size = 2

[server.destinations]
allow = ["{public}"]

[server.tools.publish]
policy = {{ input_clearances = [{bottom}], output_floor = {bottom}, declassification_purposes = ["reviewed-summary"] }}
record = {{ provider = "inbox", category = "message_publish", verb = "publish", resource_type = "channel", required_scope = "inbox:publish", plain = ["sink"], required = ["sink"] }}
"#,
        socket = q(&p.socket),
        mode = p.socket_mode,
        state = q(&p.state_dir),
        records = q(&p.records_dir),
        terms = TERMS_LABEL,
        bottom = BOTTOM_LABEL,
        analyst = p.analyst_uid,
        reviewer = p.reviewer_uid,
        m_ws = manifest("workspace"),
        k_ws = key("workspace"),
        m_team = manifest("team-inbox"),
        k_team = key("team-inbox"),
        m_pub = manifest("public-inbox"),
        k_pub = key("public-inbox"),
        workspace = argv(&p.workspace_command),
        publisher = argv(&p.publisher_command),
        documents = q(&p.documents),
        exfil = p.exfil_sink,
        team = p.team_sink,
        public = p.public_sink,
    )
}

/// The declared tool surface the lab's operator expects: the team channel publishes and
/// its network egress are declared (allow), reads of the terms are declared; nothing public.
pub fn declared_surface(p: &LabPaths) -> String {
    serde_json::json!({
        "schema": "assay.declared_tool_surface.v0",
        "declared_tool_actions": [
            {
                "id": "workspace.contract_read",
                "provider": "workspace",
                "action_class": "contract_read",
                "allowed_targets": [{"document": "harbor-goods-terms.md"}],
                "allowed_effects": ["allow"],
                "required_decision": "explicit_policy"
            },
            {
                "id": "inbox.publish.team",
                "provider": "inbox",
                "action_class": "message_publish",
                "allowed_targets": [{"sink": p.team_sink.to_string()}],
                "allowed_effects": ["allow"],
                "required_decision": "explicit_policy"
            },
            {
                "id": "network.team_relay",
                "provider": "network",
                "action_class": "network_egress",
                "allowed_targets": [{"address": p.team_sink.ip().to_string(), "port": p.team_sink.port()}],
                "allowed_effects": ["allow"],
                "required_decision": "explicit_policy"
            },
            {
                "id": "inbox.publish.public_reviewed",
                "provider": "inbox",
                "action_class": "message_publish",
                "allowed_targets": [{"sink": p.public_sink.to_string()}],
                "allowed_effects": ["allow"],
                "required_decision": "declassification_grant"
            },
            {
                "id": "network.public_relay",
                "provider": "network",
                "action_class": "network_egress",
                "allowed_targets": [{"address": p.public_sink.ip().to_string(), "port": p.public_sink.port()}],
                "allowed_effects": ["allow"],
                "required_decision": "declassification_grant"
            }
        ]
    })
    .to_string()
}

/// A loopback TCP relay that keeps what it receives: the lab's team, public and "elsewhere"
/// sinks, for the demo and the tests alike.
pub struct Relay {
    /// Where it listens.
    pub addr: SocketAddr,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    received: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Relay {
    /// A relay on an ephemeral loopback port.
    pub fn start() -> std::io::Result<Relay> {
        Relay::start_on("127.0.0.1:0")
    }

    /// A relay listening on `addr` (in the calling thread's network namespace).
    pub fn start_on(addr: &str) -> std::io::Result<Relay> {
        use std::io::Read;
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (c, r) = (connections.clone(), received.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                c.fetch_add(1, Ordering::SeqCst);
                let r = r.clone();
                std::thread::spawn(move || {
                    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(5)));
                    let mut buf = Vec::new();
                    let _ = stream.read_to_end(&mut buf);
                    if let Ok(mut all) = r.lock() {
                        all.extend(buf);
                    }
                });
            }
        });
        Ok(Relay {
            addr,
            connections,
            received,
        })
    }

    /// How many connections it accepted.
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Everything received so far.
    pub fn bytes(&self) -> Vec<u8> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Waits up to two seconds for at least `n` bytes (deliveries are asynchronous).
    pub fn await_bytes(&self, n: usize) -> Vec<u8> {
        for _ in 0..100 {
            let b = self.bytes();
            if b.len() >= n {
                return b;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        self.bytes()
    }
}

/// A line-oriented MCP client of the host's socket, one request at a time.
pub struct Client {
    reader: std::io::BufReader<std::os::unix::net::UnixStream>,
    writer: std::os::unix::net::UnixStream,
    next_id: u64,
}

impl Client {
    /// Connects to `socket` (replies are awaited for at most 30 s).
    pub fn connect(socket: &Path) -> std::io::Result<Client> {
        Client::over(std::os::unix::net::UnixStream::connect(socket)?)
    }

    /// A client over an already connected stream.
    pub fn over(stream: std::os::unix::net::UnixStream) -> std::io::Result<Client> {
        stream.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
        Ok(Client {
            reader: std::io::BufReader::new(stream.try_clone()?),
            writer: stream,
            next_id: 1,
        })
    }

    /// Sends `bytes` as one line and reads one response line.
    pub fn raw(&mut self, bytes: &[u8]) -> std::io::Result<serde_json::Value> {
        self.send_line(bytes)?;
        self.read()
    }

    /// Sends one message (a line), reading nothing.
    pub fn send(&mut self, message: &serde_json::Value) -> std::io::Result<()> {
        self.send_line(message.to_string().as_bytes())
    }

    fn send_line(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        self.writer.write_all(bytes)?;
        self.writer.write_all(b"\n")
    }

    /// Reads the next message the host sends (an answer, a notification or a request).
    pub fn read(&mut self) -> std::io::Result<serde_json::Value> {
        use std::io::BufRead;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        serde_json::from_str(&line).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("not a JSON-RPC response line ({e}): {line:?}"),
            )
        })
    }

    /// Sends a request with the next id and returns the whole response.
    pub fn request(
        &mut self,
        method: &str,
        params: serde_json::Value,
    ) -> std::io::Result<serde_json::Value> {
        let id = self.next_id;
        self.next_id += 1;
        let line =
            serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let response = self.raw(line.to_string().as_bytes())?;
        if response["id"] != id {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the response is not for request {id}: {response}"),
            ));
        }
        Ok(response)
    }

    /// `tools/call` of `tool` with `arguments`.
    pub fn call(
        &mut self,
        tool: &str,
        arguments: serde_json::Value,
    ) -> std::io::Result<serde_json::Value> {
        self.request(
            "tools/call",
            serde_json::json!({"name": tool, "arguments": arguments}),
        )
    }
}

/// An Ed25519 JWT issuer for tests and the lab: its JSON Web Key Set and a way to mint
/// access tokens (key id `k1`). The key comes from `seed`, so two issuers with different
/// seeds stand for a trusted issuer and a forger.
pub struct JwtIssuer {
    der: Vec<u8>,
    /// The issuer's key set (JWKS text) with its public key.
    pub jwks: String,
}

impl JwtIssuer {
    /// The issuer whose Ed25519 key is `[seed; 32]`.
    pub fn new(seed: u8) -> JwtIssuer {
        use base64::Engine;
        let signing = ed25519_dalek::SigningKey::from_bytes(&[seed; 32]);
        // PKCS#8 v1 for Ed25519: a fixed prefix, then the 32-byte seed (RFC 8410).
        let mut der = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(&[seed; 32]);
        let x = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(signing.verifying_key().as_bytes());
        let jwks = serde_json::json!({"keys": [{"kty": "OKP", "crv": "Ed25519", "x": x, "kid": "k1", "alg": "EdDSA"}]}).to_string();
        JwtIssuer { der, jwks }
    }

    /// A token carrying `claims`, signed by this issuer (`None` if signing fails).
    pub fn token(&self, claims: &serde_json::Value) -> Option<String> {
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA);
        header.kid = Some("k1".into());
        jsonwebtoken::encode(
            &header,
            claims,
            &jsonwebtoken::EncodingKey::from_ed_der(&self.der),
        )
        .ok()
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The label of what the conformance executor returns: its own compartment, so a call
/// visibly taints the caller's principal and session.
pub const CONFORMANCE_LABEL: &str =
    r#"{ kind = "known", owners = {}, compartments = ["conformance-data"] }"#;

/// A `[[server]]` block (TOML) that governs the conformance executor (`command`, its
/// argv) with the signed manifest and key in `fixtures/conformance` under `repo`: every
/// tool's output, resource read and prompt carries [`CONFORMANCE_LABEL`], and the tools and
/// prompts go by their bare names (as the conformance suite calls them).
pub fn conformance_server(repo: &Path, command: &str) -> String {
    let dir = repo.join("fixtures/conformance");
    let mut s = format!(
        "\n[[server]]\nid = \"conformance\"\nmanifest = {}\nkey = {}\ncommand = [{}]\nprofile = \"isolated\"\npool_size = 1\nunqualified_names = true\ncontent_floor = {CONFORMANCE_LABEL}\n",
        q(&dir.join("conformance.signed.json")),
        q(&dir.join("keys/conformance.pub")),
        toml_string(command),
    );
    for tool in flowhost_example_tools::conformance::TOOLS {
        s.push_str(&format!(
            "\n[server.tools.{tool}]\npolicy = {{ input_clearances = [], output_floor = {CONFORMANCE_LABEL} }}\n"
        ));
    }
    s
}
