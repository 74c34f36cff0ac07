//! MCP over Streamable HTTP with the real daemon, broker and conformance executor: every
//! caller maps to a configured principal or is refused (and the refusal recorded), Host
//! and Origin are checked, and a principal's label is the same whichever transport it
//! arrives by.

mod common;

use std::net::{Ipv4Addr, SocketAddr};

use common::http::{McpHttp, connect_from, request, request_over};
use common::lab::Lab;
use common::shared_copy;
use flowhost::lab::{JwtIssuer, conformance_server, host_config, unix_now};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// The remote agent's uid, for its Unix socket sessions.
const AGENT_UID: u32 = 65532;
const TOKEN: &str = "agent-token-1";
const RESOURCE: &str = "https://flowhost.test/mcp";
const ISSUER: &str = "https://as.test";

/// The address the daemon's HTTP listener bound (configured as port 0), from its log.
fn bound_addr(lab: &Lab) -> SocketAddr {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let log = lab.log();
        let found = log
            .lines()
            .filter(|l| l.contains("serving MCP over Streamable HTTP"))
            .find_map(|l| {
                let at = l.find("listen=")? + "listen=".len();
                let rest = l[at..]
                    .trim_start_matches("\u{1b}[0m")
                    .trim_start_matches('=');
                rest.split(|c: char| c.is_whitespace() || c == '\u{1b}')
                    .next()?
                    .parse()
                    .ok()
            });
        if let Some(addr) = found {
            return addr;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no HTTP listener in the log:\n{log}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The lab with the conformance server, a principal for the remote agent, and `[http]`
/// (a bearer token and JWTs of [`ISSUER`], `extra` appended to the table).
pub fn start(extra: &str) -> Option<(Lab, SocketAddr, JwtIssuer)> {
    start_with("", extra)
}

/// [`start`] with `host` (lines) added to the `[host]` table.
pub fn start_with(host: &str, extra: &str) -> Option<(Lab, SocketAddr, JwtIssuer)> {
    let mut lab = Lab::prepare()?;
    let addr = "127.0.0.1:0";
    let issuer = JwtIssuer::new(11);
    let jwks = lab.dir.path().join("jwks.json");
    std::fs::write(&jwks, &issuer.jwks).unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = format!(
        "{lab}{server}\n[[principal]]\nid = \"remote-agent\"\nuids = [{AGENT_UID}]\ntools = [\"conformance/*\"]\n\n[http]\nlisten = \"{addr}\"\nresource = \"{RESOURCE}\"\n{extra}\n[[http.token]]\nprincipal = \"remote-agent\"\nsha256 = \"{hash}\"\n\n[http.jwt]\nissuer = \"{ISSUER}\"\njwks = \"{jwks}\"\nprincipals = {{ \"agent-1\" = \"remote-agent\" }}\n",
        lab = host_config(&lab.paths).replacen("[host]\n", &format!("[host]\n{host}\n"), 1),
        server = conformance_server(
            repo,
            &shared_copy("flowhost-tool-conformance")
                .display()
                .to_string()
        ),
        hash = hex::encode(Sha256::digest(TOKEN.as_bytes())),
        jwks = jwks.display(),
    );
    lab.write_config(&text);
    lab.spawn();
    let addr = bound_addr(&lab);
    Some((lab, addr, issuer))
}

fn jwt(issuer: &JwtIssuer, aud: &str, exp: u64, sub: &str) -> String {
    issuer
        .token(&json!({"iss": ISSUER, "aud": aud, "exp": exp, "sub": sub}))
        .unwrap()
}

#[test]
fn every_http_caller_is_a_configured_principal_or_refused_and_recorded() {
    let Some((mut lab, addr, issuer)) = start("") else {
        return;
    };
    let later = unix_now() + 300;
    let refused = [
        (None, "no credentials"),
        (
            Some("not-a-token".to_string()),
            "not one this server accepts",
        ),
        (
            Some(jwt(&issuer, "https://other.test/mcp", later, "agent-1")),
            "audience",
        ),
        (
            Some(jwt(&issuer, RESOURCE, unix_now() - 600, "agent-1")),
            "expired",
        ),
        (
            Some(jwt(&issuer, RESOURCE, later, "someone-else")),
            "not mapped to a principal",
        ),
        (
            Some(jwt(&JwtIssuer::new(12), RESOURCE, later, "agent-1")),
            "invalid",
        ),
        // A header whose algorithm carries a line break and a non-ASCII letter, which the
        // refusal's message repeats: before, the challenge could not be a header value and
        // the 401 went out without it.
        (
            Some(format!(
                "{}.e30.x",
                base64::Engine::encode(
                    &base64::engine::general_purpose::URL_SAFE_NO_PAD,
                    "{\"alg\":\"\\r\\nX\u{e9}\"}"
                )
            )),
            "invalid",
        ),
    ];
    for (credential, why) in &refused {
        let mut c = McpHttp::new(addr, credential.as_deref());
        let r = c.initialize();
        assert_eq!(r.status, 401, "{why}: {r:?}");
        let challenge = r.header("www-authenticate").unwrap_or_default();
        assert!(
            challenge.starts_with("Bearer ")
                && challenge.contains(
                    "resource_metadata=\"https://flowhost.test/.well-known/oauth-protected-resource/mcp\""
                ),
            "{challenge}"
        );
        assert_eq!(
            challenge.contains("error=\"invalid_token\""),
            credential.is_some(),
            "{challenge}"
        );
        assert!(r.body.contains(why), "{why}: {}", r.body);
    }

    // The protected resource metadata names this resource and its authorization server.
    let meta = request(
        addr,
        "GET",
        "/.well-known/oauth-protected-resource/mcp",
        &[],
        "",
    );
    assert_eq!(meta.status, 200, "{meta:?}");
    let meta: Value = serde_json::from_str(&meta.body).unwrap();
    assert_eq!(meta["resource"], RESOURCE);
    assert_eq!(meta["authorization_servers"], json!([ISSUER]));

    // A good token and a good JWT both act as the remote agent.
    let good = jwt(&issuer, RESOURCE, later, "agent-1");
    for credential in [TOKEN, good.as_str()] {
        let mut c = McpHttp::new(addr, Some(credential));
        let r = c.initialize();
        assert_eq!(r.status, 200, "{r:?}\n{}", lab.log());
        assert!(c.session.is_some(), "{r:?}");
        let listed = c.call("tools/list", json!({})).response();
        assert!(
            listed["result"]["tools"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["name"] == "test_simple_text"),
            "{listed}"
        );
    }

    // Another principal's token cannot use a session it does not own.
    let mut owner = McpHttp::new(addr, Some(TOKEN));
    owner.initialize();
    let mut thief = McpHttp::new(addr, Some(&good));
    thief.session = owner.session.clone();
    assert_eq!(thief.call("ping", json!({})).status, 200, "same principal");
    let mut anonymous = McpHttp::new(addr, None);
    anonymous.session = owner.session.clone();
    assert_eq!(anonymous.call("ping", json!({})).status, 401);
    // DELETE ends the session.
    let session = owner.session.clone().unwrap();
    let del = request(
        addr,
        "DELETE",
        "/mcp",
        &[
            ("Authorization", &format!("Bearer {TOKEN}")),
            ("Mcp-Session-Id", &session),
        ],
        "",
    );
    assert_eq!(del.status, 204, "{del:?}");
    assert_eq!(owner.call("ping", json!({})).status, 404);

    lab.stop();
    let records = lab.records();
    let http_refusals: Vec<&Value> = records
        .iter()
        .filter(|r| {
            r["flowhost"]["event"] == "session"
                && r["tool"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("(http: "))
        })
        .collect();
    for (_, why) in &refused {
        assert!(
            http_refusals
                .iter()
                .any(|r| r["tool"]["name"].as_str().unwrap().contains(why)
                    && r["decision"]["effect"] == "deny"
                    && r["flowhost"]["denial_kind"] == "access_denied"),
            "no refusal record for {why:?}: {http_refusals:#?}"
        );
    }
}

#[test]
fn host_and_origin_are_checked_before_anything_else() {
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}).to_string();
    let auth = format!("Bearer {TOKEN}");
    let post = |extra: &[(&str, &str)]| {
        let mut h = vec![
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
        ];
        h.extend_from_slice(extra);
        request(addr, "POST", "/mcp", &h, &body)
    };
    assert_eq!(post(&[("Host", "evil.test")]).status, 403);
    assert_eq!(post(&[("Host", "evil.test:8931")]).status, 403);
    assert_eq!(post(&[("Origin", "http://evil.test")]).status, 403);
    let ok = post(&[("Host", "localhost"), ("Origin", "http://localhost:3000")]);
    assert_eq!(ok.status, 200, "{ok:?}\n{}", lab.log());
}

#[test]
fn a_principal_has_one_label_whichever_transport_it_arrives_by() {
    let Some((mut lab, addr, _)) = start("") else {
        return;
    };
    let mut remote = McpHttp::new(addr, Some(TOKEN));
    assert_eq!(remote.initialize().status, 200);
    let before = remote.call("flowhost/session", json!({})).response();
    assert_eq!(before["result"]["principal"], "remote-agent", "{before}");
    assert_eq!(
        before["result"]["label"]["compartments"],
        json!([]),
        "{before}"
    );
    let r = remote
        .call(
            "tools/call",
            json!({"name": "test_simple_text", "arguments": {}}),
        )
        .response();
    assert_eq!(
        r["result"]["content"][0]["text"],
        "This is a simple text response for testing.",
        "{r}\n{}",
        lab.log()
    );
    let over_http = remote.call("flowhost/session", json!({})).response();
    assert_eq!(
        over_http["result"]["label"]["compartments"],
        json!(["conformance-data"]),
        "{over_http}"
    );

    // The same principal on the Unix socket carries the label its HTTP session acquired.
    let mut local = lab.client_as(AGENT_UID);
    local.initialize();
    let over_unix = local.request("flowhost/session", json!({}));
    assert_eq!(over_unix["result"]["principal"], "remote-agent");
    assert_eq!(
        over_unix["result"]["label"], over_http["result"]["label"],
        "{over_unix}"
    );
    lab.stop();
    let records = lab.records();
    let calls: Vec<&Value> = records
        .iter()
        .filter(|r| r["tool"]["name"] == "test_simple_text")
        .collect();
    assert!(
        !calls.is_empty()
            && calls
                .iter()
                .all(|r| r["flowhost"]["principal"] == "remote-agent"),
        "{calls:#?}"
    );
}

/// A resource read carries its label into the session like a tool output: the label is
/// joined durably (the records of the read carry it) before the content reaches the client,
/// so a later call that would egress to a public sink is refused by the flow resolver. A
/// read of an undeclared URI is refused and recorded; the records verify and the diff
/// judges them.
#[test]
fn a_resource_read_raises_the_label_and_a_later_egress_is_refused() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = host_config(&lab.paths).replacen(
        "tools = [\"workspace/*\", ",
        "tools = [\"conformance/static-text\", \"conformance/test_simple_prompt\", \"workspace/*\", ",
        1,
    );
    assert!(config.contains("conformance/static-text"), "{config}");
    let text = format!(
        "{config}{}",
        conformance_server(
            repo,
            &shared_copy("flowhost-tool-conformance")
                .display()
                .to_string()
        )
    );
    lab.write_config(&text);
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let label = |c: &mut common::lab::Client| {
        c.request("flowhost/session", json!({}))["result"]["label"]["compartments"].clone()
    };
    assert_eq!(label(&mut c), json!([]));

    // Only what the principal's patterns name is listed.
    let listed = c.request("resources/list", json!({}));
    assert_eq!(
        listed["result"]["resources"],
        json!([{"uri": "test://static-text", "name": "static-text",
                "description": "A static text resource", "mimeType": "text/plain"}]),
        "{listed}"
    );
    let prompts = c.request("prompts/list", json!({}));
    assert_eq!(
        prompts["result"]["prompts"][0]["name"], "test_simple_prompt",
        "{prompts}"
    );
    assert_eq!(
        prompts["result"]["prompts"].as_array().map(Vec::len),
        Some(1)
    );

    // Before the read, a public note goes out.
    let sink = lab.public.addr.to_string();
    let before = c.call(
        "public-inbox/publish",
        json!({"message": "a public note", "sink": sink}),
    );
    assert_eq!(
        before["result"]["isError"],
        json!(false),
        "{before}\n{}",
        lab.log()
    );

    let read = c.request("resources/read", json!({"uri": "test://static-text"}));
    assert_eq!(
        read["result"]["contents"][0]["text"],
        "This is the content of the static text resource.",
        "{read}\n{}",
        lab.log()
    );
    assert_eq!(label(&mut c), json!(["conformance-data"]));

    // The same publish is now refused before dispatch: the session carries the read.
    let after = c.call(
        "public-inbox/publish",
        json!({"message": "a public note", "sink": sink}),
    );
    assert_eq!(after["error"]["code"], -32011, "{after}");
    assert_eq!(
        after["error"]["data"]["denial"], "flow_violation",
        "{after}"
    );

    // Undeclared, or declared but not the principal's: refused, with the denial.
    let unknown = c.request("resources/read", json!({"uri": "test://nothing"}));
    assert_eq!(
        unknown["error"]["data"]["denial"], "unknown_resource",
        "{unknown}"
    );
    let other = c.request("resources/read", json!({"uri": "test://static-binary"}));
    assert_eq!(other["error"]["data"]["denial"], "access_denied", "{other}");
    let prompt = c.request("prompts/get", json!({"name": "test_simple_prompt"}));
    assert_eq!(
        prompt["result"]["messages"][0]["content"]["text"], "This is a simple prompt for testing.",
        "{prompt}"
    );
    let unknown = c.request("prompts/get", json!({"name": "conformance/none"}));
    assert_eq!(
        unknown["error"]["data"]["denial"], "unknown_prompt",
        "{unknown}"
    );

    // The session's logging level is refused unless it is one. It reaches the session's
    // executor (bound and idle now) only when the executor is next taken for a request,
    // after the check that it is fit for that request's label, and then once: an idle
    // executor may have been approved under a lower label than the session's now.
    let bad = c.request("logging/setLevel", json!({"level": "loud"}));
    assert_eq!(bad["error"]["data"]["denial"], "invalid_params", "{bad}");
    let set = c.request("logging/setLevel", json!({"level": "warning"}));
    assert_eq!(set["result"], json!({}), "{set}");
    let applied = "conformance: logging level warning";
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(!lab.log().contains(applied), "{}", lab.log());
    let again = c.request("resources/read", json!({"uri": "test://static-text"}));
    assert!(again["result"]["contents"].is_array(), "{again}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !lab.log().contains(applied) {
        assert!(std::time::Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let again = c.request("resources/read", json!({"uri": "test://static-text"}));
    assert!(again["result"]["contents"].is_array(), "{again}");
    assert_eq!(lab.log().matches(applied).count(), 1, "{}", lab.log());

    // A subscription is forwarded; the executor's update of the subscribed resource reaches
    // the client, its update of a URI nobody signed does not.
    let mut seen = vec![c.raw(
        br#"{"jsonrpc":"2.0","id":"sub","method":"resources/subscribe","params":{"uri":"test://static-text"}}"#,
    )];
    for _ in 0..50 {
        if seen
            .iter()
            .any(|m| m["method"] == "notifications/resources/updated")
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        seen.push(c.raw(br#"{"jsonrpc":"2.0","id":"p","method":"ping"}"#));
    }
    for _ in 0..3 {
        seen.push(c.raw(br#"{"jsonrpc":"2.0","id":"p","method":"ping"}"#));
    }
    assert!(
        seen.iter()
            .any(|m| m["id"] == "sub" && m["result"] == json!({})),
        "{seen:#?}"
    );
    let updates: Vec<&Value> = seen
        .iter()
        .filter(|m| m["method"] == "notifications/resources/updated")
        .collect();
    assert_eq!(updates.len(), 1, "{seen:#?}");
    assert_eq!(updates[0]["params"], json!({"uri": "test://static-text"}));
    drop(c);
    lab.stop();

    let records = lab.records();
    let reads: Vec<&Value> = records
        .iter()
        .filter(|r| r["tool"]["name"] == "resources/read test://static-text")
        .collect();
    let events: Vec<(&str, &str)> = reads
        .iter()
        .map(|r| {
            (
                r["flowhost"]["event"].as_str().unwrap(),
                r["decision"]["effect"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        events,
        [("content_request", "allow"), ("content_outcome", "allow")].repeat(3),
        "three reads: {reads:#?}"
    );
    assert_eq!(reads[0]["server"]["id"], "conformance");
    assert_eq!(
        reads[1]["flowhost"]["labels_after"]["session"]["compartments"],
        json!(["conformance-data"]),
        "{reads:#?}"
    );
    let denials: Vec<&str> = records
        .iter()
        .filter(|r| r["flowhost"]["event"] == "content_request")
        .filter_map(|r| r["flowhost"]["denial_kind"].as_str())
        .collect();
    assert_eq!(
        denials,
        ["unknown_resource", "access_denied", "unknown_prompt"]
    );

    let health = lab.paths.state_dir.join("health.json");
    let (code, report) = lab.verify_and_diff(Some(&health));
    assert_ne!(code, 4, "evidence rejected: {report:#}");
    assert_eq!(report["observation_complete"], true, "{report:#}");
    let judged_content = report["findings"].as_array().unwrap().iter().any(|f| {
        let tool = f["tool"].as_str().unwrap_or_default();
        tool.starts_with("resources/") || tool.starts_with("prompts/")
    });
    assert!(
        !judged_content,
        "content requests are no tool actions: {report:#}"
    );

    // Durable: after a restart the principal still carries what it read, and the public
    // sink is still refused.
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    assert_eq!(label(&mut c), json!(["conformance-data"]));
    let after = c.call(
        "public-inbox/publish",
        json!({"message": "a public note", "sink": sink}),
    );
    assert_eq!(
        after["error"]["data"]["denial"], "flow_violation",
        "{after}"
    );
    drop(c);
    lab.stop();
}

/// The MCP conformance suite (pinned, installed by `.ci/install-interop`).
const CONFORMANCE: &str = "/opt/flowhost-interop/conformance/node_modules/.bin/conformance";

/// Runs the suite's server scenarios against flowhost over HTTP governing the conformance
/// executor. Local callers without a token act as the remote agent (the suite sends no
/// credentials), which only a loopback listener allows.
#[test]
fn the_conformance_suite_passes_through_flowhost() {
    if !common::third_party(std::path::Path::new(CONFORMANCE)) {
        return;
    }
    let Some((mut lab, addr, _)) = start("unauthenticated_loopback_principal = \"remote-agent\"")
    else {
        return;
    };
    let out_dir = lab.dir.path().join("conformance");
    let out = std::process::Command::new(CONFORMANCE)
        .args([
            "server",
            "--url",
            &format!("http://localhost:{}/mcp", addr.port()),
        ])
        .arg("--output-dir")
        .arg(&out_dir)
        .env(
            "PATH",
            format!(
                "/opt/flowhost-interop/conformance/node_modules/.bin:{}",
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    lab.stop();
    // The summary: one line per scenario, `✓ name: N passed, 0 failed` or `✗ name: ...`.
    let summary: Vec<(&str, bool)> = stdout
        .lines()
        .filter_map(|l| {
            let (mark, rest) = l.split_at_checked(l.char_indices().nth(1)?.0)?;
            let name = rest.trim().split(':').next()?;
            match mark {
                "✓" => Some((name, true)),
                "✗" => Some((name, false)),
                _ => None,
            }
        })
        .collect();
    println!(
        "conformance server --url http://localhost:{}/mcp",
        addr.port()
    );
    for (name, passed) in &summary {
        println!("  {} {name}", if *passed { "pass" } else { "FAIL" });
    }
    for name in PASSING {
        assert!(
            summary.contains(&(name, true)),
            "scenario {name} does not pass through flowhost:\n{stdout}\n{}",
            lab.log()
        );
    }
    // The suite accepts any content as the tool's answer; the records show the client's
    // answers to the relayed requests reached the tools.
    let records = lab.records();
    for tool in [
        "test_sampling",
        "test_elicitation",
        "test_elicitation_sep1034_defaults",
        "test_elicitation_sep1330_enums",
    ] {
        assert!(
            records.iter().any(|r| r["tool"]["name"] == tool
                && r["flowhost"]["relay"]["direction"] == "to_tool"
                && r["decision"]["effect"] == "allow"),
            "no answer reached {tool} over HTTP"
        );
    }
}

/// The server scenarios that pass through flowhost today (the README, "Remote agents",
/// lists the others and why).
const PASSING: [&str; 30] = [
    "server-initialize",
    "ping",
    "tools-list",
    "tools-call-simple-text",
    "tools-call-image",
    "tools-call-audio",
    "tools-call-embedded-resource",
    "tools-call-mixed-content",
    "tools-call-error",
    "tools-call-with-logging",
    "tools-call-with-progress",
    "tools-call-sampling",
    "tools-call-elicitation",
    "elicitation-sep1034-defaults",
    "server-sse-multiple-streams",
    "elicitation-sep1330-enums",
    "dns-rebinding-protection",
    "logging-set-level",
    "completion-complete",
    "resources-list",
    "resources-read-text",
    "resources-read-binary",
    "resources-templates-read",
    "resources-subscribe",
    "resources-unsubscribe",
    "prompts-list",
    "prompts-get-simple",
    "prompts-get-with-args",
    "prompts-get-embedded-resource",
    "prompts-get-with-image",
];

/// Makes an Ed25519 leaf certificate for localhost, its own trust anchor, as `<stem>.pem`
/// with its key in `<stem>-key.pem` in `dir`.
fn make_certificate(dir: &std::path::Path, stem: &str) {
    let made = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ed25519", "-nodes", "-days", "1"])
        .args([
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ])
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .arg("-keyout")
        .arg(dir.join(format!("{stem}-key.pem")))
        .arg("-out")
        .arg(dir.join(format!("{stem}.pem")))
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
}

/// A daemon whose listener speaks TLS with the certificate `cert.pem` and key `key.pem`
/// of its directory (copied from `first` made by [`make_certificate`]), or `None` (said
/// why) where it cannot run.
fn start_tls(first: &str) -> Option<(Lab, SocketAddr)> {
    if !common::have("openssl") {
        eprintln!("SKIP: openssl is not installed (it makes the test certificate)");
        return None;
    }
    let mut lab = Lab::prepare()?;
    let dir = lab.dir.path().to_path_buf();
    make_certificate(&dir, first);
    std::fs::copy(dir.join(format!("{first}.pem")), dir.join("cert.pem")).unwrap();
    std::fs::copy(dir.join(format!("{first}-key.pem")), dir.join("key.pem")).unwrap();
    let text = format!(
        "{}\n[http]\nlisten = \"127.0.0.1:0\"\nallowed_hosts = [\"localhost\"]\ntls = {{ cert = \"cert.pem\", key = \"key.pem\" }}\n[[http.token]]\nprincipal = \"larkfield-analyst\"\nsha256 = \"{}\"\n",
        host_config(&lab.paths),
        hex::encode(Sha256::digest(TOKEN.as_bytes())),
    );
    lab.write_config(&text);
    lab.spawn();
    let addr = bound_addr(&lab);
    Some((lab, addr))
}

/// An authenticated `initialize` over TLS to `addr`, trusting only the certificate in
/// `trusted`: its answer, or why the handshake failed.
fn initialize_over_tls(
    addr: SocketAddr,
    trusted: &std::path::Path,
) -> Result<common::http::Reply, String> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_file_iter(trusted).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = std::sync::Arc::new(
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut conn = rustls::ClientConnection::new(config, name).unwrap();
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp).map_err(|e| e.to_string())?;
    }
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}).to_string();
    let auth = format!("Bearer {TOKEN}");
    Ok(common::http::request_over(
        rustls::StreamOwned::new(conn, tcp),
        &format!("localhost:{}", addr.port()),
        "POST",
        "/mcp",
        &[
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
        ],
        &body,
    ))
}

/// With `[http.tls]`, the listener speaks only TLS: a client that trusts the certificate
/// gets MCP, a plain-text request gets nothing.
#[test]
fn tls_when_configured() {
    let Some((mut lab, addr)) = start_tls("first") else {
        return;
    };
    let r = initialize_over_tls(addr, &lab.dir.path().join("first.pem")).unwrap();
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.log());
    assert_eq!(r.response()["result"]["serverInfo"]["name"], "flowhost");

    let auth = format!("Bearer {TOKEN}");
    let plain = request(
        addr,
        "POST",
        "/mcp",
        &[("Authorization", auth.as_str())],
        "{}",
    );
    assert_ne!(plain.status, 200, "{plain:?}");
    lab.stop();
}

/// A reload reads the certificate and key files again: a renewed certificate is presented
/// from the reload on, and a pair that does not belong together refuses the reload, naming
/// the file, while the pair in use stays. Before, the files read at start were served until
/// a restart, so a renewal (or the replacement of a compromised key) needed one.
#[test]
fn a_reload_presents_the_certificate_its_files_hold_then() {
    let Some((lab, addr)) = start_tls("first") else {
        return;
    };
    let dir = lab.dir.path().to_path_buf();
    let (first, renewed) = (dir.join("first.pem"), dir.join("renewed.pem"));
    assert_eq!(initialize_over_tls(addr, &first).unwrap().status, 200);
    make_certificate(&dir, "renewed");
    std::fs::copy(&renewed, dir.join("cert.pem")).unwrap();
    std::fs::copy(dir.join("renewed-key.pem"), dir.join("key.pem")).unwrap();
    reload_and_wait(&lab, 2, "reloaded: generation 2");
    let old = initialize_over_tls(addr, &first).unwrap_err();
    // The same name, another key: the first certificate does not vouch for the renewed one.
    assert!(old.contains("invalid peer certificate"), "{old}");
    assert_eq!(initialize_over_tls(addr, &renewed).unwrap().status, 200);

    // The first certificate with the renewed key: not a pair.
    std::fs::copy(&first, dir.join("cert.pem")).unwrap();
    reload_and_wait(&lab, 3, "reload refused");
    let log = lab.log();
    assert!(
        log.contains("http.tls") && log.contains(&dir.join("key.pem").display().to_string()),
        "{log}"
    );
    assert_eq!(initialize_over_tls(addr, &renewed).unwrap().status, 200);

    // A private key others may read (or a certificate others may change) is not used:
    // before, any file at the path was read and served.
    use std::os::unix::fs::PermissionsExt;
    std::fs::copy(&renewed, dir.join("cert.pem")).unwrap();
    let key = dir.join("key.pem");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    reload_and_wait(&lab, 4, "may read the secret it holds");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(dir.join("cert.pem"), std::fs::Permissions::from_mode(0o666)).unwrap();
    reload_and_wait(&lab, 5, "group or others may write it");
    assert_eq!(initialize_over_tls(addr, &renewed).unwrap().status, 200);

    // As certbot lays them out: the configured names are links into an archive, and the
    // key is shared with a group (0640). Both are served.
    let archive = dir.join("archive");
    std::fs::create_dir(&archive).unwrap();
    std::fs::copy(&renewed, archive.join("fullchain1.pem")).unwrap();
    std::fs::copy(dir.join("renewed-key.pem"), archive.join("privkey1.pem")).unwrap();
    std::fs::set_permissions(
        archive.join("privkey1.pem"),
        std::fs::Permissions::from_mode(0o640),
    )
    .unwrap();
    for (link, to) in [("cert.pem", "fullchain1.pem"), ("key.pem", "privkey1.pem")] {
        std::fs::remove_file(dir.join(link)).unwrap();
        std::os::unix::fs::symlink(archive.join(to), dir.join(link)).unwrap();
    }
    reload_and_wait(&lab, 6, "reloaded: generation 3");
    assert_eq!(initialize_over_tls(addr, &renewed).unwrap().status, 200);
}

/// The tool names of the records of HTTP authentication refusals (`(http: why)`).
fn http_refusal_names(lab: &Lab) -> Vec<String> {
    lab.records()
        .iter()
        .filter_map(|r| r["tool"]["name"].as_str())
        .filter(|n| n.starts_with("(http: "))
        .map(ToString::to_string)
        .collect()
}

/// Unauthenticated callers are no principal and no peer: their refusal records get the
/// folder's budget per interval, and the rest are recorded as one count.
#[test]
fn unauthenticated_refusals_past_the_budget_fold_into_one_record() {
    let Some((mut lab, addr, _)) = start_with(
        "refusal_records_per_interval = 2\nrefusal_fold_interval_ms = 600000",
        "",
    ) else {
        return;
    };
    for _ in 0..5 {
        assert_eq!(McpHttp::new(addr, Some("wrong")).initialize().status, 401);
    }
    lab.stop();
    let names = http_refusal_names(&lab);
    assert_eq!(
        names,
        [
            "(http: the token is not one this server accepts)",
            "(http: the token is not one this server accepts)",
            "(http: 3 further authentication refusals, folded)",
        ],
        "{names:?}"
    );
}

/// A session of the token's principal whose client declares sampling, initialized; the
/// client and the session's id.
fn sampling_session(addr: SocketAddr) -> (McpHttp, String) {
    let mut c = McpHttp::new(addr, Some(TOKEN));
    let init = c.call(
        "initialize",
        json!({"protocolVersion": "2025-06-18", "capabilities": {"sampling": {}}, "clientInfo": {"name": "json-only", "version": "0"}}),
    );
    assert_eq!(init.status, 200, "{init:?}");
    c.session = init.header("mcp-session-id").map(ToString::to_string);
    let session = c.session.clone().unwrap();
    let n = c.post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    assert_eq!(n.status, 202, "{n:?}");
    (c, session)
}

/// Request 7 of `session`, `tools/call` of `test_sampling`, POSTed by a client that accepts
/// only `application/json`: its reply.
fn sampling_call_json_only(addr: SocketAddr, session: &str) -> common::http::Reply {
    request(
        addr,
        "POST",
        "/mcp",
        &[
            ("Content-Type", "application/json"),
            ("Accept", "application/json"),
            ("Authorization", &format!("Bearer {TOKEN}")),
            ("Mcp-Session-Id", session),
        ],
        &json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "test_sampling", "arguments": {"prompt": "p"}}}).to_string(),
    )
}

/// A client whose POST accepts only `application/json` can take one response, not a request
/// from the server. When the tool it called asks for sampling and the session has no GET
/// stream open, the host answers the tool at once that the request cannot reach the client,
/// instead of holding the call until its deadline, and records that it did not.
#[test]
fn a_json_only_caller_gets_its_answer_at_once_when_the_tool_asks_it_for_sampling() {
    // The lab's call deadline (15 s) is beyond what the test waits: only a prompt answer
    // passes.
    let Some((mut lab, addr, _)) = start("") else {
        return;
    };
    let (_client, session) = sampling_session(addr);

    let started = std::time::Instant::now();
    let reply = sampling_call_json_only(addr, &session);
    let waited = started.elapsed();
    lab.stop();
    assert_eq!(reply.status, 200, "{reply:?}\n{}", lab.log());
    assert_eq!(
        reply.header("content-type"),
        Some("application/json"),
        "{reply:?}"
    );
    let answer = reply.response();
    assert_eq!(answer["id"], 7, "{answer}");
    assert_eq!(answer["result"]["isError"], true, "{answer}");
    let text = answer["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(
        text.starts_with("sampling failed") && text.contains("accepts only application/json"),
        "the tool was told why: {answer}"
    );
    assert!(
        waited < std::time::Duration::from_secs(10),
        "the call waited {waited:?} for a client that cannot answer"
    );
    // The records say the request was let out towards the client, then that it did not
    // reach it; nothing came back to judge for the tool.
    let relays: Vec<(String, String, String)> = lab
        .records()
        .into_iter()
        .filter(|r| r["tool"]["name"] == "test_sampling" && r["flowhost"]["event"] == "relay")
        .map(|r| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            (
                s(&r["flowhost"]["relay"]["direction"]),
                s(&r["decision"]["effect"]),
                s(&r["response"]["status"]),
            )
        })
        .collect();
    let want = |d: &str, e: &str, st: &str| (d.to_string(), e.to_string(), st.to_string());
    assert_eq!(
        relays,
        [
            want("to_client", "allow", "authorized"),
            want("to_client", "error", "client_unreachable")
        ],
    );
}

/// A request id that is neither a string nor an integer could never be matched to its
/// answer: it is refused at once, and no session is opened for it.
#[test]
fn a_request_id_of_another_kind_is_refused_at_once() {
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let auth = format!("Bearer {TOKEN}");
    let headers = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
    ];
    for id in ["1.5", "{}", "null", "[1]"] {
        let body = format!(
            r#"{{"jsonrpc": "2.0", "id": {id}, "method": "initialize", "params": {{"protocolVersion": "2025-06-18", "capabilities": {{}}, "clientInfo": {{"name": "t", "version": "0"}}}}}}"#
        );
        let started = std::time::Instant::now();
        let r = request(addr, "POST", "/mcp", &headers, &body);
        assert_eq!(r.status, 400, "id {id}: {r:?}\n{}", lab.log());
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "id {id} answered at once"
        );
        assert!(r.body.contains("must be a string or an integer"), "{r:?}");
    }
    assert!(
        !lab.log().contains("session initialized"),
        "no session was opened:\n{}",
        lab.log()
    );
}

/// Whether `stream`, just connected, is closed by the daemon within 5 s rather than held.
fn closed_at_once(mut stream: std::net::TcpStream) -> bool {
    use std::io::Read;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 1];
    let read = stream.read(&mut buf);
    matches!(read, Ok(0))
        || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
}

/// The status of an authenticated `initialize` sent over `stream` to the daemon at `addr`.
fn initialize_over(stream: std::net::TcpStream, addr: SocketAddr) -> u16 {
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let auth = format!("Bearer {TOKEN}");
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}).to_string();
    request_over(
        stream,
        &addr.to_string(),
        "POST",
        "/mcp",
        &[
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
        ],
        &body,
    )
    .status
}

/// The daemon's limit of connections from one source, unless configured.
const PER_SOURCE: usize = flowhost::config::DEFAULT_MAX_CONNECTIONS_PER_SOURCE;

/// Raises this process's descriptor limit: the test and the daemon it starts each hold one
/// descriptor per connection.
fn room_for_connections() {
    let (soft, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    let want = 4096.min(hard);
    if soft < want {
        nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, want, hard)
            .unwrap();
    }
}

/// The daemon's limit of connections in all (`MAX_CONNECTIONS` in the host's configuration).
const LIMIT: usize = flowhost::config::MAX_CONNECTIONS;

/// A connection from `source` to the daemon at `addr` that has carried one authenticated
/// request (its answer read whole), kept open.
fn proven_from(source: Ipv4Addr, addr: SocketAddr) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let mut stream = connect_from(source, addr);
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    // A DELETE naming no session: refused, but only once the client is known.
    write!(
        stream,
        "DELETE /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "closed after an authenticated request");
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw).to_string();
        let Some(end) = text.find("\r\n\r\n") else {
            continue;
        };
        let length: usize = text[..end]
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse().unwrap())
            })
            .unwrap_or(0);
        if raw.len() >= end + 4 + length {
            assert!(
                !text[..end]
                    .to_ascii_lowercase()
                    .contains("connection: close"),
                "{text}"
            );
            return stream;
        }
    }
}

/// Clients without credentials cannot lock out those with them. Before, 512 connections
/// that sent nothing (from as many sources as the limit per source asks) held the daemon's
/// every connection until its 30 s header timeout, and an authenticated client's connection
/// was closed at once, for as long as the flood reconnected. Now at most half the limit is
/// held by connections that have carried no authenticated request, and a newcomer gets the
/// place of the flood's oldest, also when authenticated clients hold the other half; so a
/// client from another source that sends its request at once is served.
#[test]
fn connections_without_credentials_make_way_for_a_client_with_them() {
    room_for_connections();
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let held: Vec<std::net::TcpStream> = (0..LIMIT / 2)
        .map(|i| proven_from(Ipv4Addr::new(127, 0, 3, (i / PER_SOURCE) as u8 + 1), addr))
        .collect();
    let idle: Vec<std::net::TcpStream> = (0..LIMIT)
        .map(|i| connect_from(Ipv4Addr::new(127, 0, 1, (i / PER_SOURCE) as u8 + 1), addr))
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let client = connect_from(Ipv4Addr::new(127, 0, 1, 200), addr);
    assert_eq!(initialize_over(client, addr), 200, "{}", lab.log());
    assert!(
        lab.log().contains("made way for the newest"),
        "{}",
        lab.log()
    );
    let mut idle = idle.into_iter();
    assert!(
        closed_at_once(idle.next().unwrap()),
        "the oldest connection without a request was held"
    );
    drop(held);
}

/// A flood of connections without credentials, from as many sources as there are places
/// for them, cannot close a client's connection before its first request: a connection
/// keeps its place for its first 2 s against newcomers from sources holding as many, and
/// the flood's newest are closed at once instead. Before, each of the flood's newcomers
/// closed one of the others, picked at random among sources holding as many, so the
/// client's connection went within a few hundred of them, and none was refused.
#[test]
fn a_flood_from_many_sources_leaves_a_client_its_first_seconds() {
    room_for_connections();
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let places = LIMIT / 2;
    let from = |wave: usize, i: usize| {
        Ipv4Addr::new(
            127,
            (wave + i / 62_500) as u8,
            (i / 250 % 250) as u8,
            (i % 250) as u8 + 1,
        )
    };
    let first: Vec<std::net::TcpStream> = (0..places)
        .map(|i| connect_from(from(1, i), addr))
        .collect();
    // The first wave past its grace: the client's connection takes the place of its oldest.
    std::thread::sleep(std::time::Duration::from_millis(2300));
    let client = connect_from(Ipv4Addr::new(127, 9, 9, 1), addr);
    // The client sends its request a second after connecting, whatever the flood, which
    // meanwhile goes on from as many sources again, and more: a new source each.
    let request = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(1000));
        initialize_over(client, addr)
    });
    let mut second: Vec<std::net::TcpStream> = (0..places + places / 4)
        .map(|i| connect_from(from(2, i), addr))
        .collect();
    let status = request.join().unwrap();
    assert_eq!(status, 200, "{}", lab.log());
    assert!(
        closed_at_once(second.pop().unwrap()),
        "the flood's newest was held"
    );
    assert!(
        lab.log().contains("each within its first 2 s"),
        "the flood's newest were not refused: {}",
        lab.log()
    );
    drop((first, second));
}

/// Connections past the daemon's limit are closed at once, so clients cannot take the
/// descriptors the daemon needs; once some close, requests are served again.
#[test]
fn connections_past_the_limit_are_closed_at_once() {
    room_for_connections();
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    // Authenticated clients, from as many sources as the limit per source asks.
    let held: Vec<std::net::TcpStream> = (0..LIMIT)
        .map(|i| proven_from(Ipv4Addr::new(127, 0, 2, (i / PER_SOURCE) as u8 + 1), addr))
        .collect();
    let extra = connect_from(Ipv4Addr::new(127, 0, 2, 200), addr);
    assert!(
        closed_at_once(extra),
        "the connection past the limit was held"
    );
    assert!(
        lab.log().contains("http connection closed at once"),
        "{}",
        lab.log()
    );
    drop(held);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let status = initialize_over(std::net::TcpStream::connect(addr).unwrap(), addr);
    assert_eq!(status, 200);
}

/// One remote host cannot take every connection: past the limit per source address its next
/// connection is closed at once, while another host's is served. Before, one host holding
/// the 512 connections of the daemon's limit locked every other client out.
#[test]
fn one_source_cannot_hold_every_connection() {
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let flooder = Ipv4Addr::new(127, 0, 0, 2);
    let idle: Vec<std::net::TcpStream> = (0..PER_SOURCE)
        .map(|_| connect_from(flooder, addr))
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        closed_at_once(connect_from(flooder, addr)),
        "a connection past the limit of its source was held"
    );
    assert!(
        lab.log().contains("are open from its source"),
        "{}",
        lab.log()
    );
    let other = connect_from(Ipv4Addr::new(127, 0, 0, 3), addr);
    assert_eq!(initialize_over(other, addr), 200);
    drop(idle);
}

/// The limit per source is the operator's: with `max_connections_per_source = 4`, a fifth
/// connection from one address is closed at once, and the log names the setting; another
/// address is served.
#[test]
fn the_limit_per_source_is_configured() {
    let Some((lab, addr, _)) = start("max_connections_per_source = 4") else {
        return;
    };
    let source = Ipv4Addr::new(127, 0, 0, 4);
    let idle: Vec<std::net::TcpStream> = (0..4).map(|_| connect_from(source, addr)).collect();
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        closed_at_once(connect_from(source, addr)),
        "a fifth connection from one source was held"
    );
    assert!(
        lab.log()
            .contains("4 are open from its source (http.max_connections_per_source)"),
        "{}",
        lab.log()
    );
    assert_eq!(
        initialize_over(connect_from(Ipv4Addr::new(127, 0, 0, 5), addr), addr),
        200
    );
    drop(idle);
}

/// A client that sends a request's head a byte now and then (or nothing) is cut off once
/// the head has taken 30 s, so idle connections do not pile up.
#[test]
fn a_slow_request_head_is_cut_off() {
    use std::io::{Read, Write};
    let Some((_lab, addr, _)) = start("") else {
        return;
    };
    let mut slow = std::net::TcpStream::connect(addr).unwrap();
    slow.set_read_timeout(Some(std::time::Duration::from_secs(45)))
        .unwrap();
    let started = std::time::Instant::now();
    slow.write_all(b"GET /mcp HTTP/1.1\r\nHost: 127").unwrap();
    let mut buf = [0u8; 256];
    let read = slow.read(&mut buf);
    let waited = started.elapsed();
    assert!(
        matches!(read, Ok(0))
            || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "closed: {read:?}"
    );
    assert!(
        (std::time::Duration::from_secs(25)..std::time::Duration::from_secs(40)).contains(&waited),
        "cut off after about 30 s, not {waited:?}"
    );
}

/// Sends one keep-alive request over a fresh connection to `addr` and reads what comes
/// back for `wait`: the answer's status, and whether the daemon closed the connection after
/// it (rather than keeping it for a next request).
fn one_request_kept_alive(
    addr: SocketAddr,
    headers: &[(&str, &str)],
    body: &str,
    wait: std::time::Duration,
) -> (u16, bool) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(wait)).unwrap();
    let mut head = String::from("POST /mcp HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = loop {
        match stream.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    let text = String::from_utf8_lossy(&raw);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, closed)
}

/// A connection is kept for a next request only once its client has authenticated. Before,
/// a client with no credentials could keep a connection (and its source's and the
/// transport's connection slots) for good with one refused request per header timeout.
#[test]
fn a_connection_is_kept_only_for_an_authenticated_client() {
    let Some((_lab, addr, _)) = start("") else {
        return;
    };
    let auth = format!("Bearer {TOKEN}");
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}).to_string();
    let accept = ("Accept", "application/json, text/event-stream");
    let json = ("Content-Type", "application/json");
    let refused = [
        ("no credentials", vec![accept, json], 401),
        (
            "a token it does not know",
            vec![accept, json, ("Authorization", "Bearer not-a-token")],
            401,
        ),
        (
            "a Host not allowed",
            vec![
                accept,
                json,
                ("Authorization", auth.as_str()),
                ("Host", "evil.test"),
            ],
            403,
        ),
        (
            "a protocol version it does not speak",
            vec![
                accept,
                json,
                ("Authorization", auth.as_str()),
                ("MCP-Protocol-Version", "1999-01-01"),
            ],
            400,
        ),
    ];
    for (what, headers, want) in refused {
        let (status, closed) = one_request_kept_alive(
            addr,
            &headers,
            &initialize,
            std::time::Duration::from_secs(10),
        );
        assert_eq!(status, want, "{what}");
        assert!(closed, "the connection of a request with {what} was kept");
    }
    let (status, closed) = one_request_kept_alive(
        addr,
        &[accept, json, ("Authorization", auth.as_str())],
        &initialize,
        std::time::Duration::from_secs(2),
    );
    assert_eq!(status, 200);
    assert!(!closed, "an authenticated client's connection was closed");
}

/// `MCP-Protocol-Version` may name a revision the host speaks, or none. Before, a fixed
/// list was served, among them a revision that no `initialize` is ever answered with, while
/// 2024-11-05, which `initialize` grants, was refused on every request of its session.
#[test]
fn a_request_names_a_revision_the_host_speaks() {
    let Some((_lab, addr, _)) = start("") else {
        return;
    };
    let auth = format!("Bearer {TOKEN}");
    let post = |session: Option<&str>, version: Option<&str>, body: &Value| {
        let mut headers = vec![
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
        ];
        if let Some(s) = session {
            headers.push(("Mcp-Session-Id", s));
        }
        if let Some(v) = version {
            headers.push(("MCP-Protocol-Version", v));
        }
        request(addr, "POST", "/mcp", &headers, &body.to_string())
    };
    let initialize = |version: &str| json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}});
    let ping = json!({"jsonrpc": "2.0", "id": 9, "method": "ping"});
    let init = post(None, None, &initialize("2024-11-05"));
    assert_eq!(init.status, 200, "{init:?}");
    assert_eq!(init.response()["result"]["protocolVersion"], "2024-11-05");
    let session = init.header("mcp-session-id").unwrap().to_string();
    for named in [Some("2024-11-05"), None, Some("2025-03-26")] {
        let r = post(Some(&session), named, &ping);
        assert_eq!(r.status, 200, "{named:?}: {r:?}");
    }
    // A revision the host does not speak, on a session or on the initialize that would
    // open one.
    let r = post(Some(&session), Some("2025-11-25"), &ping);
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.body.contains("is not supported"), "{r:?}");
    let r = post(None, Some("2025-11-25"), &initialize("2025-11-25"));
    assert_eq!(r.status, 400, "{r:?}");
}

/// Reloads the daemon's configuration unchanged but for a comment, and waits for the log to
/// say `want`.
fn reload_and_wait(lab: &Lab, generation: u32, want: &str) {
    let text = std::fs::read_to_string(&lab.config).unwrap();
    lab.write_config(&format!("{text}\n# reload {generation}\n"));
    lab.signal(libc::SIGHUP);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !lab.log().contains(want) {
        assert!(std::time::Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Writes `config`, asks for a reload, and waits until the host has refused one more.
fn reload_refused(lab: &Lab, config: &str) {
    let refusals = lab.log().matches("reload refused").count();
    lab.write_config(config);
    lab.signal(libc::SIGHUP);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while lab.log().matches("reload refused").count() == refusals {
        assert!(std::time::Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Takes [`TOKEN`] out of the configuration and reloads (refused: `[http]` changed), which
/// revokes it.
fn revoke_token_by_reload(lab: &Lab) {
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let token_line = format!(
        "sha256 = \"{}\"",
        hex::encode(Sha256::digest(TOKEN.as_bytes()))
    );
    lab.write_config(&text.replacen(&token_line, &format!("sha256 = \"{}\"", "0".repeat(64)), 1));
    reload_and_wait(lab, 2, "reload refused");
}

/// A `[[http.token]]` table giving `principal` the bearer token `token`.
fn token_table(principal: &str, token: &str) -> String {
    format!(
        "[[http.token]]\nprincipal = \"{principal}\"\nsha256 = \"{}\"\n",
        hex::encode(Sha256::digest(token.as_bytes()))
    )
}

/// A reload reads the issuer's key set file again: a key taken out of it (revoked) verifies
/// no token once the reload has succeeded, and a key put in does. A file that cannot be read
/// refuses the reload and revokes every key until a reload reads it. Before, the set read at
/// start was kept until a restart, so a revoked key went on working after the operator's
/// reload.
#[test]
fn a_reload_takes_the_issuers_key_set_as_its_file_says_then() {
    let Some((lab, addr, issuer)) = start("") else {
        return;
    };
    let later = unix_now() + 300;
    let revoked = jwt(&issuer, RESOURCE, later, "agent-1");
    let next = JwtIssuer::new(13);
    let rotated = jwt(&next, RESOURCE, later, "agent-1");
    let status = |token: &str| McpHttp::new(addr, Some(token)).initialize().status;
    assert_eq!(status(&revoked), 200);
    assert_eq!(status(&rotated), 401);
    let jwks = lab.dir.path().join("jwks.json");
    std::fs::write(&jwks, &next.jwks).unwrap();
    reload_and_wait(&lab, 2, "reloaded: generation 2");
    assert_eq!(status(&revoked), 401, "a revoked key still verifies");
    assert_eq!(status(&rotated), 200);
    // A key set that cannot be read revokes every key: the operator who took a key out
    // and wrote the file wrong must not have it go on verifying (before, the previous set
    // stayed in use).
    std::fs::write(&jwks, "not a key set").unwrap();
    reload_and_wait(&lab, 3, "reload refused");
    assert!(lab.log().contains("http.jwt.jwks"), "{}", lab.log());
    assert_eq!(status(&rotated), 401, "an unreadable key set kept its keys");
    assert_eq!(status(&revoked), 401);

    // A key taken out of the file is revoked by a reload that fails for another reason (a
    // manifest that no longer verifies); one put in waits for a reload that succeeds.
    // Before, the whole key set waited, and the revoked key went on verifying.
    let keys = |issuers: &[&JwtIssuer]| {
        let all: Vec<serde_json::Value> = issuers
            .iter()
            .map(|i| serde_json::from_str::<serde_json::Value>(&i.jwks).unwrap()["keys"][0].clone())
            .collect();
        json!({"keys": all}).to_string()
    };
    let third = JwtIssuer::new(17);
    let kept = jwt(&third, RESOURCE, later, "agent-1");
    // With a key published for encryption beside them: not used, and the operator is told
    // at the default level (before, at debug level only).
    let mut with_enc: Value = serde_json::from_str(&keys(&[&next, &third])).unwrap();
    let mut enc: Value =
        serde_json::from_str::<Value>(&JwtIssuer::new(23).jwks).unwrap()["keys"][0].clone();
    enc["use"] = json!("enc");
    enc["kid"] = json!("for-encryption");
    with_enc["keys"].as_array_mut().unwrap().push(enc);
    std::fs::write(&jwks, with_enc.to_string()).unwrap();
    reload_and_wait(&lab, 4, "reloaded: generation 3");
    assert_eq!((status(&rotated), status(&kept)), (200, 200));
    assert!(
        lab.log()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("\"for-encryption\") is not for signatures")),
        "{}",
        lab.log()
    );
    let fourth = JwtIssuer::new(19);
    let added = jwt(&fourth, RESOURCE, later, "agent-1");
    std::fs::write(&jwks, keys(&[&third, &fourth])).unwrap();
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let broken = text.replacen(".signed.json\"", ".missing.json\"", 1);
    assert_ne!(broken, text);
    reload_refused(&lab, &broken);
    assert_eq!(status(&rotated), 401, "a key taken out still verifies");
    assert_eq!(status(&kept), 200);
    assert_eq!(
        status(&added),
        401,
        "a key put in by a refused reload verifies"
    );
    // Nor does a configuration that cannot be read at all keep a removed key.
    std::fs::write(&jwks, keys(&[&fourth])).unwrap();
    reload_refused(&lab, &format!("{broken}\n[[[not toml\n"));
    assert_eq!((status(&kept), status(&added)), (401, 401));
}

/// A key taken out of the issuer's key set is revoked as the reload starts, not once the
/// new configuration's executors are started (here one that never answers, so the reload
/// is refused after the call timeout): before, its tokens went on verifying that long.
#[test]
fn a_key_taken_out_of_the_key_set_is_revoked_before_the_reloads_executors_start() {
    let Some((lab, addr, issuer)) = start_with("", "") else {
        return;
    };
    let later = unix_now() + 300;
    let revoked = jwt(&issuer, RESOURCE, later, "agent-1");
    let status = |token: &str| McpHttp::new(addr, Some(token)).initialize().status;
    assert_eq!(status(&revoked), 200);
    let next = JwtIssuer::new(13);
    std::fs::write(lab.dir.path().join("jwks.json"), &next.jwks).unwrap();
    let text = std::fs::read_to_string(&lab.config).unwrap().replacen(
        "call_timeout_ms = 15000",
        "call_timeout_ms = 6000",
        1,
    );
    let publisher = text
        .lines()
        .find(|l| l.starts_with("command = ") && l.contains("\"public-inbox\""))
        .unwrap()
        .to_string();
    lab.write_config(&text.replacen(&publisher, "command = [\"/bin/sleep\", \"3600\"]", 1));
    lab.signal(libc::SIGHUP);
    // The revocation comes as the reload starts; the priming takes its 6 s at least. (An
    // initialize alone: one answered just before the revocation would have its
    // `initialized` refused.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(4);
    let hello = json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}});
    while McpHttp::new(addr, Some(&revoked))
        .call("initialize", hello.clone())
        .status
        != 401
    {
        assert!(
            std::time::Instant::now() < deadline,
            "a revoked key verified during the reload\n{}",
            lab.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        !lab.log().contains("reload refused"),
        "the reload was already over: the test proves nothing\n{}",
        lab.log()
    );
}

/// A bearer token or JWT subject taken out of `[http]` is refused from the reload on, although
/// the reload itself is refused (`[http]` changes at a restart); one put back waits for the
/// restart. Before, both went on authenticating until the daemon restarted.
#[test]
fn a_credential_taken_out_of_the_configuration_is_revoked_at_the_reload() {
    const OTHER: &str = "reviewer-token";
    let other_line = token_table("remote-agent", OTHER);
    let Some((lab, addr, issuer)) = start(&other_line) else {
        return;
    };
    let subject = jwt(&issuer, RESOURCE, unix_now() + 300, "agent-1");
    let status = |token: &str| McpHttp::new(addr, Some(token)).initialize().status;
    assert_eq!((status(TOKEN), status(&subject)), (200, 200));
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let token_line = format!(
        "sha256 = \"{}\"",
        hex::encode(Sha256::digest(TOKEN.as_bytes()))
    );
    let without_token = text.replacen(&token_line, &format!("sha256 = \"{}\"", "0".repeat(64)), 1);
    assert_ne!(without_token, text);
    lab.write_config(&without_token);
    reload_and_wait(&lab, 2, "reload refused");
    assert_eq!(status(TOKEN), 401, "a token taken out still authenticates");
    assert_eq!(status(&subject), 200);
    let without_subject = without_token.replacen("\"agent-1\" = ", "\"agent-2\" = ", 1);
    assert_ne!(without_subject, without_token);
    reload_refused(&lab, &without_subject);
    assert_eq!(
        status(&subject),
        401,
        "a subject taken out still authenticates"
    );
    let added = jwt(&issuer, RESOURCE, unix_now() + 300, "agent-2");
    assert_eq!(
        status(&added),
        401,
        "a subject put in by a refused reload authenticates"
    );
    // Put back, they wait for the restart.
    lab.write_config(&text);
    reload_and_wait(&lab, 4, "reloaded: generation 2");
    assert_eq!((status(TOKEN), status(&subject)), (401, 401));
    // A token taken out by a reload whose key set cannot be read is revoked too (before,
    // the unreadable key set ended the reload first).
    assert_eq!(status(OTHER), 200);
    std::fs::write(lab.dir.path().join("jwks.json"), "not a key set").unwrap();
    reload_refused(&lab, &text.replacen(&other_line, "", 1));
    assert_eq!(status(OTHER), 401, "a token taken out still authenticates");
}

/// A server whose key is taken out stops serving at the reload even when the JWT key set
/// cannot be read at that reload either (it revokes every key, and the reload is refused):
/// before, the key set's refusal came first and the server went on serving.
#[test]
fn a_server_whose_key_is_taken_out_is_withdrawn_even_when_the_key_set_is_unreadable() {
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let mut c = McpHttp::new(addr, Some(TOKEN));
    assert_eq!(c.initialize().status, 200);
    let tools = |c: &mut McpHttp| {
        c.call("tools/list", json!({})).response()["result"]["tools"]
            .as_array()
            .map_or(0, Vec::len)
    };
    assert!(tools(&mut c) > 0);
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let key = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/conformance/keys/conformance.pub")
        .display()
        .to_string();
    let gone = lab.dir.path().join("no-such-key.pub").display().to_string();
    assert!(text.contains(&key));
    std::fs::write(lab.dir.path().join("jwks.json"), "not a key set").unwrap();
    reload_refused(&lab, &text.replacen(&key, &gone, 1));
    assert!(
        lab.log()
            .contains("server \"conformance\" withdrawn from service"),
        "{}",
        lab.log()
    );
    assert_eq!(tools(&mut c), 0, "the withdrawn server still serves");
}

/// A stream stays open only while the credential that opened it authenticates: a GET stream
/// opened with a JWT ends once the JWT has expired, and one opened with a bearer token once a
/// reload takes the token out. Before, both stayed open for as long as the session lived
/// (kept alive every 15 s), carrying whatever the host sent.
#[test]
fn a_stream_ends_when_its_credential_stops_authenticating() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let Some((lab, addr, issuer)) = start("") else {
        return;
    };
    // A GET stream opened with `token` in a session of its own: how long it stayed open
    // (`None`: still open after 20 s) and what it sent.
    let open_stream = |token: String| {
        let mut client = McpHttp::new(addr, Some(&token));
        assert_eq!(client.initialize().status, 200);
        let session = client.session.clone().unwrap();
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            write!(
                s,
                "GET /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nAccept: text/event-stream\r\nMcp-Session-Id: {session}\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let opened = Instant::now();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while opened.elapsed() < Duration::from_secs(20) {
                match s.read(&mut buf) {
                    Ok(0) => {
                        return (
                            String::from_utf8_lossy(&got).into_owned(),
                            Some(opened.elapsed()),
                        );
                    }
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => {
                        return (
                            String::from_utf8_lossy(&got).into_owned(),
                            Some(opened.elapsed()),
                        );
                    }
                }
            }
            (String::from_utf8_lossy(&got).into_owned(), None)
        })
    };
    // Within the tolerated clock skew for about five more seconds.
    let expiring = jwt(&issuer, RESOURCE, unix_now() - 25, "agent-1");
    let (sent, open) = open_stream(expiring).join().unwrap();
    assert!(sent.starts_with("HTTP/1.1 200"), "{sent}");
    assert!(
        open.is_some_and(|t| t < Duration::from_secs(12)),
        "the stream outlived its JWT: open {open:?}"
    );
    let streaming = open_stream(TOKEN.to_string());
    std::thread::sleep(Duration::from_secs(1));
    revoke_token_by_reload(&lab);
    let (sent, open) = streaming.join().unwrap();
    assert!(sent.starts_with("HTTP/1.1 200"), "{sent}");
    assert!(
        open.is_some_and(|t| t < Duration::from_secs(8)),
        "the stream outlived its revoked token: open {open:?}"
    );
}

/// A POST answered as one JSON body whose credential stops authenticating while the call
/// runs (here a reload revokes its token) is told to authenticate again (401, `invalid_token`),
/// not that its session ended (404), which would have the client drop a session that lives
/// on.
#[test]
fn a_json_answer_whose_credential_is_revoked_meanwhile_is_401() {
    use std::io::Write;
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let (_client, session) = sampling_session(addr);
    // A GET stream takes the tool's sampling request, which nobody answers: the call waits.
    let mut get = std::net::TcpStream::connect(addr).unwrap();
    write!(
        get,
        "GET /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\nAccept: text/event-stream\r\nMcp-Session-Id: {session}\r\n\r\n"
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let call = std::thread::spawn(move || sampling_call_json_only(addr, &session));
    std::thread::sleep(std::time::Duration::from_millis(500));
    revoke_token_by_reload(&lab);
    let reply = call.join().unwrap();
    drop(get);
    assert_eq!(reply.status, 401, "{reply:?}");
    assert_eq!(
        reply.header("www-authenticate"),
        Some("Bearer error=\"invalid_token\""),
        "{reply:?}"
    );
}

/// A principal that names another principal's session is answered as if there were no such
/// session (404), whichever method it uses, and each attempt is recorded with the principal
/// who made it, not with the session's id. Before, nothing was recorded, so a session id in
/// the wrong hands left no trace. The owner's session goes on.
#[test]
fn a_request_naming_another_principals_session_is_refused_and_recorded() {
    const OTHER: &str = "reviewer-token";
    let extra = token_table("oss-reviewer", OTHER);
    let Some((lab, addr, _)) = start(&extra) else {
        return;
    };
    let mut owner = McpHttp::new(addr, Some(TOKEN));
    assert_eq!(owner.initialize().status, 200);
    let session = owner.session.clone().unwrap();
    let mut intruder = McpHttp::new(addr, Some(OTHER));
    intruder.session = Some(session.clone());
    let r = intruder.call("tools/list", json!({}));
    assert_eq!(r.status, 404, "{r:?}");
    let auth = format!("Bearer {OTHER}");
    for method in ["GET", "DELETE"] {
        let r = request(
            addr,
            method,
            "/mcp",
            &[
                ("Authorization", auth.as_str()),
                ("Accept", "text/event-stream"),
                ("Mcp-Session-Id", session.as_str()),
            ],
            "",
        );
        assert_eq!(r.status, 404, "{method}: {r:?}");
    }
    assert_eq!(owner.call("tools/list", json!({})).status, 200);
    let refused = || -> Vec<Value> {
        lab.records()
            .into_iter()
            .filter(|r| r["tool"]["name"] == "(http: a request named another principal's session)")
            .collect()
    };
    // Repeats of one refusal are folded into one record with their count (the host's
    // refusal folder), written once the fold interval (10 s) has passed.
    let attempts = || -> u64 {
        refused()
            .iter()
            .map(|r| r["flowhost"]["folded"]["count"].as_u64().unwrap_or(1))
            .sum()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while attempts() < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}\n{}",
            refused(),
            lab.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(attempts(), 3);
    for r in refused() {
        assert_eq!(r["flowhost"]["principal"], "oss-reviewer", "{r}");
        assert!(!r.to_string().contains(&session), "{r}");
    }
}

/// A session whose client takes sampling, with call 7 (`test_sampling`) in flight on its
/// own connection: the tool's sampling request has reached the client's stream (a `relay`
/// record), and nobody answers it. With `json_only`, the call takes its answer as one JSON
/// body, and the sampling request goes to the session's GET stream, opened first. Returns
/// the client, the session id, the call's thread (which ends with the call's reply) and
/// the GET stream's connection, if any.
fn a_call_waiting_for_sampling(
    lab: &Lab,
    addr: SocketAddr,
    json_only: bool,
) -> (
    McpHttp,
    String,
    std::thread::JoinHandle<common::http::Reply>,
    Option<std::net::TcpStream>,
) {
    let mut c = McpHttp::new(addr, Some(TOKEN));
    let init = c.call(
        "initialize",
        json!({"protocolVersion": "2025-06-18", "capabilities": {"sampling": {}}, "clientInfo": {"name": "sampled", "version": "0"}}),
    );
    assert_eq!(init.status, 200, "{init:?}");
    let session = init.header("mcp-session-id").unwrap().to_string();
    c.session = Some(session.clone());
    let n = c.post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    assert_eq!(n.status, 202, "{n:?}");
    let auth = format!("Bearer {TOKEN}");
    let get = json_only.then(|| {
        use std::io::Write;
        let mut get = std::net::TcpStream::connect(addr).unwrap();
        write!(
            get,
            "GET /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {auth}\r\nAccept: text/event-stream\r\nMcp-Session-Id: {session}\r\n\r\n"
        )
        .unwrap();
        get
    });
    let accept = if json_only {
        "application/json"
    } else {
        "application/json, text/event-stream"
    };
    let call = {
        let (auth, session) = (auth.clone(), session.clone());
        std::thread::spawn(move || {
            request(
                addr,
                "POST",
                "/mcp",
                &[
                    ("Content-Type", "application/json"),
                    ("Accept", accept),
                    ("Authorization", &auth),
                    ("Mcp-Session-Id", &session),
                ],
                &json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "test_sampling", "arguments": {"prompt": "p"}}}).to_string(),
            )
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !lab
        .records()
        .iter()
        .any(|r| r["flowhost"]["event"] == "relay")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no relay record:\n{}",
            lab.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    (c, session, call, get)
}

/// `DELETE` ends the session as a client that went away would: a call in flight (here one
/// waiting for the client's sampling answer, which never comes) is cancelled at once
/// rather than left running, uncounted, until its deadline.
#[test]
fn delete_cancels_the_sessions_calls_in_flight() {
    // The lab's call deadline is 15 s: only a prompt end passes.
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let (_c, session, call, _) = a_call_waiting_for_sampling(&lab, addr, false);
    let auth = format!("Bearer {TOKEN}");
    let deleted = std::time::Instant::now();
    let d = request(
        addr,
        "DELETE",
        "/mcp",
        &[("Authorization", &auth), ("Mcp-Session-Id", &session)],
        "",
    );
    assert_eq!(d.status, 204, "{d:?}");
    let reply = call.join().unwrap();
    let waited = deleted.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(8),
        "the call ran on {waited:?} after DELETE: {reply:?}\n{}",
        lab.log()
    );
}

/// A malformed answer POSTed to a relayed request (no result and no error) is refused with
/// 400, and the session is told: the call goes on at once without an answer, as over the
/// socket, rather than wait out its deadline and be recorded as cut short by it.
#[test]
fn a_malformed_answer_to_a_relayed_request_ends_the_calls_wait() {
    // The lab's call deadline is 15 s: only a prompt end passes.
    let Some((mut lab, addr, _)) = start("") else {
        return;
    };
    let (c, _session, call, _) = a_call_waiting_for_sampling(&lab, addr, false);
    let answered = std::time::Instant::now();
    let r = c.post(&json!({"jsonrpc": "2.0", "id": "flowhost-relay-1"}));
    assert_eq!(r.status, 400, "{r:?}");
    let reply = call.join().unwrap();
    let waited = answered.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(8),
        "the call waited {waited:?} after the malformed answer: {reply:?}\n{}",
        lab.log()
    );
    lab.stop();
    let statuses: Vec<String> = lab
        .records()
        .into_iter()
        .filter(|r| r["tool"]["name"] == "test_sampling")
        .map(|r| {
            r["response"]["status"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert!(
        statuses.iter().any(|s| s == "client_unreachable"),
        "{statuses:?}"
    );
    assert!(
        !statuses.iter().any(|s| s == "bound_reached"),
        "{statuses:?}"
    );
}

/// An answer to a relayed request over `max_message_bytes` ends the call's wait at once, as
/// on the socket: before, the POST got 413 and the call waited out its deadline, recorded as
/// a bound reached.
#[test]
fn an_oversized_answer_to_a_relayed_request_ends_the_calls_wait() {
    let Some((mut lab, addr, _)) = start("") else {
        return;
    };
    let (c, _session, call, _) = a_call_waiting_for_sampling(&lab, addr, false);
    let answered = std::time::Instant::now();
    let r = c.post(
        &json!({"jsonrpc": "2.0", "id": "flowhost-relay-1", "result": {
        "role": "assistant", "content": {"type": "text", "text": "x".repeat(2 << 20)}}}),
    );
    assert_eq!(r.status, 413, "{r:?}");
    let reply = call.join().unwrap();
    let waited = answered.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(8),
        "the call waited {waited:?} after the oversized answer: {reply:?}\n{}",
        lab.log()
    );
    lab.stop();
    assert!(
        !lab.records()
            .into_iter()
            .filter(|r| r["tool"]["name"] == "test_sampling")
            .any(|r| r["response"]["status"] == "bound_reached"),
        "{}",
        lab.log()
    );
}

/// A request the client cancels while it waits for one JSON body (it takes no SSE) is
/// answered `204`, and the session goes on. Before, the POST got `404`, "the session ended
/// before answering", which tells a client to open a new session.
#[test]
fn a_cancelled_json_only_request_is_answered_as_cancelled() {
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let (mut c, _session, call, _get) = a_call_waiting_for_sampling(&lab, addr, true);
    let cancel = c.post(&json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7, "reason": "the user gave up"}}));
    assert_eq!(cancel.status, 202, "{cancel:?}");
    let reply = call.join().unwrap();
    assert_eq!(reply.status, 204, "{reply:?}\n{}", lab.log());
    let ping = c.call("ping", json!({}));
    assert_eq!(ping.status, 200, "the session goes on: {ping:?}");
}

/// A request id already in flight in the session is refused with 409 before anything is
/// routed: its answer would otherwise end the first request's stream, and the first call's
/// result would go to the second. A message that is no valid JSON-RPC message, and an id
/// too long to keep, are refused with 400 at once, as the socket transport answers them.
#[test]
fn an_id_in_flight_or_an_invalid_message_is_refused_before_routing() {
    let Some((lab, addr, _)) = start("") else {
        return;
    };
    let (c, session, first, _) = a_call_waiting_for_sampling(&lab, addr, false);
    let auth = format!("Bearer {TOKEN}");
    let again = c.post(&json!({"jsonrpc": "2.0", "id": 7, "method": "ping"}));
    assert_eq!(again.status, 409, "{again:?}");
    assert!(again.body.contains("already in flight"), "{again:?}");
    assert!(again.body.contains("request_id_in_flight"), "{again:?}");
    for bad in [
        json!({"jsonrpc": "2.0", "id": 9, "method": 5}),
        json!({"jsonrpc": "1.0", "id": 9, "result": {}}),
        json!({"jsonrpc": "2.0", "id": "x".repeat(300), "method": "ping"}),
    ] {
        let r = c.post(&bad);
        assert_eq!(r.status, 400, "{bad}: {r:?}");
    }
    // An initialize sent as a notification opens no session (it would take a slot).
    let opener = McpHttp::new(addr, Some(TOKEN));
    let r = opener.post(&json!({"jsonrpc": "2.0", "method": "initialize"}));
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.header("mcp-session-id").is_none(), "{r:?}");
    let d = request(
        addr,
        "DELETE",
        "/mcp",
        &[("Authorization", &auth), ("Mcp-Session-Id", &session)],
        "",
    );
    assert_eq!(d.status, 204, "{d:?}");
    let first = first.join().unwrap();
    assert!(
        !first.body.contains("already in flight") && !first.body.contains("\"code\":-32"),
        "another request's answer reached the call's stream: {first:?}"
    );
    // Like every refusal of an identified peer, it has a record (before, none), under the
    // session's record id (that of its call), never the Mcp-Session-Id.
    let records = lab.records();
    let refused = records
        .iter()
        .find(|r| {
            r["tool"]["name"] == "(ping)" && r["flowhost"]["denial_kind"] == "request_id_in_flight"
        })
        .unwrap_or_else(|| panic!("{records:#?}"));
    let call = records
        .iter()
        .find(|r| r["flowhost"]["event"] == "tool_call")
        .unwrap_or_else(|| panic!("{records:#?}"));
    assert_eq!(refused["flowhost"]["session"], call["flowhost"]["session"]);
    assert_ne!(refused["flowhost"]["session"], session.as_str());
}

/// A header sent but unreadable (bytes outside visible ASCII) or sent twice is refused, not
/// read as absent: with `unauthenticated_loopback_principal` set, an unreadable or repeated
/// `Authorization` would otherwise make its sender the anonymous principal (answered `401`
/// and recorded like any other bad credential instead), and an unreadable `Origin` would
/// skip the Origin check.
#[test]
fn an_unreadable_or_repeated_header_is_refused_not_read_as_absent() {
    let Some((mut lab, addr, _)) = start("unauthenticated_loopback_principal = \"remote-agent\"")
    else {
        return;
    };
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}).to_string();
    let post = |extra: &[(&str, &str)]| {
        let mut h = vec![
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
        ];
        h.extend_from_slice(extra);
        request(addr, "POST", "/mcp", &h, &body)
    };
    // Without credentials the caller is the loopback principal, as configured.
    let anonymous = post(&[]);
    assert_eq!(anonymous.status, 200, "{anonymous:?}\n{}", lab.log());
    let bearer = format!("Bearer {TOKEN}");
    for (headers, status) in [
        // Bytes >= 0x80 (UTF-8 here) in the credential.
        (vec![("Authorization", "Bearer t\u{e9}l\u{e9}phone")], 401),
        (
            vec![
                ("Authorization", bearer.as_str()),
                ("Authorization", "Bearer x"),
            ],
            401,
        ),
        (
            vec![
                ("Authorization", bearer.as_str()),
                ("Authorization", bearer.as_str()),
            ],
            401,
        ),
        (vec![("Origin", "http://\u{e9}vil.test")], 400),
        (
            vec![
                ("Origin", "http://localhost"),
                ("Origin", "http://evil.test"),
            ],
            400,
        ),
        (vec![("Host", "localhost"), ("Host", "evil.test")], 400),
    ] {
        let r = post(&headers);
        assert_eq!(r.status, status, "{headers:?}: {r:?}");
        assert!(r.header("mcp-session-id").is_none(), "{headers:?}: {r:?}");
    }
    lab.stop();
    let names = http_refusal_names(&lab);
    let unreadable = names
        .iter()
        .filter(|n| n.starts_with("(http: the Authorization header"))
        .count();
    assert_eq!(unreadable, 3, "{names:?}");
}

/// Taking out the last credential of its kind revokes it, although a file left with no
/// subject mapped, or with no credential at all, is refused: before, the lenient read of the
/// reload failed on it, and the credential the operator took out went on authenticating
/// until a restart.
#[test]
fn the_last_credential_taken_out_is_revoked_at_the_reload() {
    let Some((lab, addr, issuer)) = start("") else {
        return;
    };
    let subject = jwt(&issuer, RESOURCE, unix_now() + 300, "agent-1");
    let status = |token: &str| McpHttp::new(addr, Some(token)).initialize().status;
    assert_eq!((status(TOKEN), status(&subject)), (200, 200));
    let text = std::fs::read_to_string(&lab.config).unwrap();
    // The subjects' line taken out altogether (`principals = {}` reads the same): before,
    // the lenient read failed on it, on a missing field or on an empty table.
    let no_subject = text.replacen("principals = { \"agent-1\" = \"remote-agent\" }\n", "", 1);
    assert_ne!(no_subject, text);
    reload_refused(&lab, &no_subject);
    assert!(
        lab.log().contains("map at least one claim value"),
        "{}",
        lab.log()
    );
    assert_eq!(
        status(&subject),
        401,
        "the last subject taken out still authenticates"
    );
    assert_eq!(status(TOKEN), 200);
    let token_table = format!(
        "[[http.token]]\nprincipal = \"remote-agent\"\nsha256 = \"{}\"\n",
        hex::encode(Sha256::digest(TOKEN.as_bytes()))
    );
    let jwt_start = no_subject.find("[http.jwt]").unwrap();
    let nothing = no_subject[..jwt_start].replacen(&token_table, "", 1);
    assert!(!nothing.contains("[[http.token]]") && !nothing.contains("[http.jwt]"));
    reload_refused(&lab, &nothing);
    assert!(
        lab.log()
            .contains("configure at least one way to authenticate"),
        "{}",
        lab.log()
    );
    assert_eq!(
        status(TOKEN),
        401,
        "the last token taken out still authenticates"
    );
}

/// A credential taken out by a file refused for something else altogether (an unknown key)
/// is revoked all the same, as its TOML tells: before, that file's lenient read failed and
/// revoked nothing.
#[test]
fn a_credential_taken_out_of_a_file_refused_for_another_reason_is_revoked() {
    let Some((lab, addr, issuer)) = start("") else {
        return;
    };
    let subject = jwt(&issuer, RESOURCE, unix_now() + 300, "agent-1");
    let status = |token: &str| McpHttp::new(addr, Some(token)).initialize().status;
    assert_eq!((status(TOKEN), status(&subject)), (200, 200));
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let hash = hex::encode(Sha256::digest(TOKEN.as_bytes()));
    let without_token = text
        .replacen(
            &format!("sha256 = \"{hash}\""),
            &format!("sha256 = \"{}\"", "0".repeat(64)),
            1,
        )
        .replacen("[host]\n", "[host]\nno_such_key = 1\n", 1);
    assert!(!without_token.contains(&hash));
    reload_refused(&lab, &without_token);
    assert_eq!(status(TOKEN), 401, "a token taken out still authenticates");
    assert_eq!(status(&subject), 200, "a subject kept was revoked");
}
