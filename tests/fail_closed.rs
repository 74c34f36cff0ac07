//! Paths that used to say "fine" when they should not: undeclared egress nobody flagged,
//! refusals that left no record, a failed flow-state store reported as healthy, and a state
//! file that could roll labels back. Each runs the real daemon with the real broker.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::lab::{Lab, REVIEWER_UID};
use flowhost::ident::PrincipalId;
use flowhost::state::{SqliteStore, StateSnapshot};
use serde_json::{Value, json};

const TERMS: &str = "harbor-goods-terms.md";
/// A uid no lab principal maps.
const STRANGER_UID: u32 = 64999;

fn denial(r: &Value) -> String {
    r["error"]["data"]["denial"]
        .as_str()
        .unwrap_or_else(|| panic!("expected an error with data.denial: {r}"))
        .to_string()
}

fn events<'a>(records: &'a [Value], event: &str) -> Vec<&'a Value> {
    records
        .iter()
        .filter(|r| r["flowhost"]["event"] == event)
        .collect()
}

fn wait_log(lab: &Lab, needle: &str, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while lab.log().matches(needle).count() < count {
        assert!(
            Instant::now() < deadline,
            "{needle:?} not logged:\n{}",
            lab.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_slow_reload_does_not_stop_the_daemon_accepting_connections() {
    let Some(mut lab) = Lab::start() else { return };
    // A server whose program never answers `initialize`: priming it takes the whole call
    // timeout (4 s here), then the reload is refused.
    let config = std::fs::read_to_string(&lab.config).unwrap().replacen(
        "call_timeout_ms = 15000",
        "call_timeout_ms = 4000",
        1,
    );
    let publisher = config
        .lines()
        .find(|l| l.starts_with("command = ") && l.contains("\"public-inbox\""))
        .unwrap()
        .to_string();
    lab.write_config(&config.replacen(&publisher, "command = [\"/bin/sleep\", \"3600\"]", 1));
    lab.signal(libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(500));
    // Meanwhile a new client is accepted and served at once.
    let asked = Instant::now();
    let mut c = lab.client();
    let r = c.initialize();
    assert!(r.get("protocolVersion").is_some(), "{r}");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "the new session waited {:?} for the reload",
        asked.elapsed()
    );
    assert!(
        !lab.log().contains("reload refused"),
        "the reload was already over: the test proves nothing\n{}",
        lab.log()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !lab.log().contains("reload refused") {
        assert!(Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The previous configuration still serves.
    let listed = c.request("tools/list", json!({}));
    assert!(
        listed.to_string().contains("public-inbox/publish"),
        "{listed}"
    );
    lab.stop();
}

/// A reload that takes a principal out is not held back by the rest of it: while the new
/// configuration's executors are still being started (here one that never answers, so the
/// reload is refused after the call timeout), the principal is already refused. Before,
/// it was served until the priming ended, for as long as that took.
#[test]
fn a_principal_taken_out_is_withdrawn_before_the_reloads_executors_start() {
    let Some(mut lab) = Lab::start() else { return };
    let mut reviewer = lab.client_as(REVIEWER_UID);
    reviewer.initialize();
    let config = std::fs::read_to_string(&lab.config).unwrap().replacen(
        "call_timeout_ms = 15000",
        "call_timeout_ms = 6000",
        1,
    );
    let reviewer_table = format!(
        "[[principal]]\nid = \"oss-reviewer\"\nuids = [{REVIEWER_UID}]\ntools = [\"workspace/list_documents\", \"public-inbox/publish\"]\n"
    );
    assert!(config.contains(&reviewer_table), "{config}");
    let publisher = config
        .lines()
        .find(|l| l.starts_with("command = ") && l.contains("\"public-inbox\""))
        .unwrap()
        .to_string();
    lab.write_config(&config.replacen(&reviewer_table, "", 1).replacen(
        &publisher,
        "command = [\"/bin/sleep\", \"3600\"]",
        1,
    ));
    lab.signal(libc::SIGHUP);
    wait_log(&lab, "withdrawn at once", 1);
    // Sent as the withdrawal is logged, well before the session's own look every 5 s
    // would end it first.
    let r = reviewer.call("workspace/list_documents", json!({}));
    assert!(
        !lab.log().contains("reload refused"),
        "the reload was already over: the test proves nothing\n{}",
        lab.log()
    );
    assert_eq!(denial(&r), "access_denied", "{r}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !lab.log().contains("reload refused") {
        assert!(Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    lab.stop();
}

#[test]
fn flowhost_connect_fails_when_the_daemon_closes_while_the_client_still_sends() {
    let Some(mut lab) = Lab::start() else { return };
    let mut client = std::process::Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["connect", "--socket"])
        .arg(&lab.paths.socket)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The client keeps stdin open, as an MCP client does for its whole session.
    let mut stdin = client.stdin.take().unwrap();
    std::io::Write::write_all(
        &mut stdin,
        b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n",
    )
    .unwrap();
    let mut answer = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(client.stdout.as_mut().unwrap()),
        &mut answer,
    )
    .unwrap();
    assert!(answer.contains("\"id\":1"), "{answer}");
    lab.stop();
    let out = client.wait_with_output().unwrap();
    drop(stdin);
    assert!(
        !out.status.success(),
        "flowhost connect exited {}",
        out.status
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("closed the connection while the client was still sending"),
        "{stderr}"
    );
}

#[test]
fn flowhost_connect_says_so_when_stdin_cannot_be_read() {
    let Some(mut lab) = Lab::start() else { return };
    // A directory as stdin: every read fails (EISDIR). The daemon then closes, because the
    // bridge tells it no more requests come; the failure is the client's input, not the host.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["connect", "--socket"])
        .arg(&lab.paths.socket)
        .stdin(std::fs::File::open("/").unwrap())
        .output()
        .unwrap();
    lab.stop();
    assert!(
        !out.status.success(),
        "flowhost connect exited {}",
        out.status
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("reading stdin"), "{stderr}");
    assert!(!stderr.contains("daemon closed the connection"), "{stderr}");
}

#[test]
fn a_stop_that_cannot_close_its_records_exits_non_zero() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    let r = c.call("workspace/list_documents", json!({}));
    assert!(r.get("result").is_some(), "{r}");
    drop(c);
    // Root writes anywhere a mode forbids: an immutable directory (an ext4 attribute) is
    // one it cannot write, so the writer cannot close the records there.
    let records = lab.paths.records_dir.clone();
    let chattr = |flag: &str| {
        std::process::Command::new("chattr")
            .arg(flag)
            .arg(&records)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !chattr("+i") {
        eprintln!("SKIP: chattr +i is not supported on the file system of {records:?}");
        lab.stop();
        return;
    }
    let status = lab.stop_status().unwrap();
    assert!(chattr("-i"));
    assert!(
        !status.success(),
        "the daemon exited {status}:\n{}",
        lab.log()
    );
    assert_eq!(status.code(), Some(1), "{}", lab.log());
    assert!(
        lab.log().contains("the stop did not complete"),
        "{}",
        lab.log()
    );
}

#[test]
fn a_start_that_may_succeed_later_exits_1_and_a_refusal_exits_2() {
    let Some(lab) = Lab::prepare() else { return };
    // A flow-state database that is not up yet (nothing listens on the port): the cause may
    // pass, so the unit's Restart=on-failure must retry, which it does not for exit 2.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let url = lab.dir.path().join("pg.url");
    std::fs::write(
        &url,
        format!("postgresql://flowhost@127.0.0.1:{port}/flow\n"),
    )
    .unwrap();
    let config = std::fs::read_to_string(&lab.config).unwrap();
    let with_pg = config.replacen(
        "[host]\n",
        &format!(
            "[host]\nstate = {{ backend = \"postgres\", url_file = \"{}\", host_id = \"h\" }}\n",
            url.display()
        ),
        1,
    );
    assert_ne!(with_pg, config);
    let start = |text: &str| {
        lab.write_config(text);
        let out = lab.serve_command().output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = start(&with_pg);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("cannot connect"), "{stderr}");
    // A configuration that cannot work is a refusal, which retrying cannot change.
    let (code, stderr) = start("this is not toml");
    assert_eq!(code, Some(2), "{stderr}");
}

/// The pricing lab's public-inbox manifest as `change` leaves it, signed with the
/// publisher's key (kept 0600, as the publisher keeps it) into `NAME.signed.json` in the
/// lab's directory.
fn signed_public_inbox(lab: &Lab, name: &str, change: impl FnOnce(&mut Value)) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pricing-lab");
    let key = lab.dir.path().join("public-inbox.key");
    std::fs::copy(repo.join("keys/public-inbox.key"), &key).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut body: Value = serde_json::from_str(
        &std::fs::read_to_string(repo.join("public-inbox.manifest.json")).unwrap(),
    )
    .unwrap();
    change(&mut body);
    let unsigned = lab.dir.path().join(format!("{name}.json"));
    std::fs::write(&unsigned, body.to_string()).unwrap();
    let out = lab.dir.path().join(format!("{name}.signed.json"));
    let (code, _, err) = lab.cli(&[
        "manifest",
        "sign",
        "--key",
        &key.display().to_string(),
        "--manifest",
        &unsigned.display().to_string(),
        "--out",
        &out.display().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    out
}

/// The lab's configuration `original` with public-inbox served from `manifest`.
fn serving_public_inbox(original: &str, manifest: &Path) -> String {
    let served = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/pricing-lab/public-inbox.signed.json")
        .display()
        .to_string();
    assert!(original.contains(&served));
    original.replace(&served, &manifest.display().to_string())
}

/// The server that offers its tools under bare names may not sign a name with '/': its
/// `team-inbox/publish` would be called as server team-inbox's `publish`. Before, both were
/// served, and every call of that name went to the team inbox.
#[test]
fn a_bare_name_holding_a_slash_is_refused_at_start() {
    let Some(mut lab) = Lab::start() else { return };
    lab.stop();
    let shadowing = signed_public_inbox(&lab, "public-inbox-shadowing", |body| {
        body["tools"][0]["name"] = json!("team-inbox/publish");
        body["version"] = json!("1.1.0");
    });
    let original = std::fs::read_to_string(&lab.config).unwrap();
    let bare = serving_public_inbox(&original, &shadowing).replacen(
        "id = \"public-inbox\"\n",
        "id = \"public-inbox\"\nunqualified_names = true\n",
        1,
    );
    // Its policy names the signed tool, so rule 3 admits it: only the name's '/' is wrong.
    let at = bare.find("id = \"public-inbox\"").unwrap();
    let bare = format!(
        "{}{}",
        &bare[..at],
        bare[at..].replacen(
            "[server.tools.publish]",
            "[server.tools.\"team-inbox/publish\"]",
            1
        )
    );
    assert!(bare.contains("unqualified_names = true"));
    lab.write_config(&bare);
    let mut serving = lab
        .serve_command()
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while serving.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            serving.kill().unwrap();
            panic!("the host served a bare name holding '/'");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = serving.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("\"team-inbox/publish\"") && stderr.contains("unqualified_names"),
        "{stderr}"
    );
}

#[test]
fn an_older_signed_manifest_is_refused_at_reload_and_at_start() {
    let Some(mut lab) = Lab::start() else { return };
    // The publisher's key signs versions 1.2.0 and 1.1.0 of public-inbox; the lab serves
    // 1.0.0.
    let sign = |version: &str| {
        signed_public_inbox(&lab, &format!("public-inbox-{version}"), |body| {
            body["version"] = json!(version);
        })
    };
    let (newer, older) = (sign("1.2.0"), sign("1.1.0"));
    let original = std::fs::read_to_string(&lab.config).unwrap();
    let serving = |manifest: &Path| serving_public_inbox(&original, manifest);
    lab.write_config(&serving(&newer));
    lab.signal(libc::SIGHUP);
    wait_log(&lab, "reloaded: generation 2", 1);
    // Back to an older one: still validly signed, refused, and 1.2.0 keeps serving.
    lab.write_config(&serving(&older));
    lab.signal(libc::SIGHUP);
    wait_log(&lab, "reload refused", 1);
    assert!(
        lab.log()
            .contains("manifest version 1.1.0 is older than version 1.2.0"),
        "{}",
        lab.log()
    );
    lab.stop();
    // A start on it is refused as well, until the operator deletes the retained set.
    let out = lab.serve_command().output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("signed-manifests.json"), "{stderr}");
    std::fs::remove_file(lab.paths.state_dir.join("signed-manifests.json")).unwrap();
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    lab.stop();
}

/// A start that fails after verifying its manifests (here a server whose executors cannot
/// start) does not retain them: the version it never served cannot make the one served
/// before look like a rollback. Before, the retained set was written before the executors
/// were proven, so going back to the working configuration was refused until the operator
/// deleted the file (and with it the rollback protection of every server).
#[test]
fn a_start_that_fails_retains_nothing_of_its_manifests() {
    let Some(mut lab) = Lab::start() else { return };
    lab.stop();
    let retained = lab.paths.state_dir.join("signed-manifests.json");
    let before = std::fs::read_to_string(&retained).unwrap();
    let newer = signed_public_inbox(&lab, "public-inbox-1.5.0", |body| {
        body["version"] = json!("1.5.0");
    });
    let original = std::fs::read_to_string(&lab.config).unwrap();
    let publisher = common::shared_copy("flowhost-tool-publisher")
        .display()
        .to_string();
    assert!(original.contains(&publisher));
    lab.write_config(&serving_public_inbox(&original, &newer).replace(&publisher, "/bin/false"));
    let out = lab.serve_command().output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        std::fs::read_to_string(&retained).unwrap() == before,
        "the failed start retained its manifests"
    );
    // The working configuration starts.
    lab.write_config(&original);
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    lab.stop();
}

/// A tool whose signed manifest requires a person's approval of each call does not run on a
/// call that brings none (no declassification grant signed for exactly that call): refused
/// before dispatch, recorded, and the sink gets nothing. Before, the annotation was signed
/// and then never read: the call ran.
#[test]
fn a_tool_requiring_approval_does_not_run_without_it() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let signed = signed_public_inbox(&lab, "public-inbox-approval", |body| {
        body["tools"][0]["annotations"]["requires_approval"] = json!(true);
    });
    let original = std::fs::read_to_string(&lab.config).unwrap();
    lab.write_config(&serving_public_inbox(&original, &signed));
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    // The listing says so before any call; other tools say nothing of it.
    let listed = c.request("tools/list", json!({}));
    let tools = listed["result"]["tools"].as_array().unwrap();
    let meta = |name: &str| {
        tools
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("{listed}"))["_meta"]["flowhost/requires_approval"]
            .clone()
    };
    assert_eq!(meta("public-inbox/publish"), json!(true), "{listed}");
    assert_eq!(meta("team-inbox/publish"), Value::Null, "{listed}");
    // A fresh session: nothing it carries keeps it from the public sink but the approval.
    let r = c.call(
        "public-inbox/publish",
        json!({"message": "hello", "sink": lab.public.addr.to_string()}),
    );
    assert_eq!(r["error"]["data"]["denial"], "approval_required", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("requires a person's approval")),
        "{r}"
    );
    assert_eq!(lab.public.connections(), 0);
    drop(c);
    lab.stop();
    let records = lab.records();
    let refused: Vec<&Value> = events(&records, "tool_call")
        .into_iter()
        .filter(|r| r["flowhost"]["denial_kind"] == "approval_required")
        .collect();
    assert_eq!(refused.len(), 1, "{records:#?}");
}

#[test]
fn undeclared_egress_is_recorded_warned_about_and_counted() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    for _ in 0..2 {
        let r = c.call(
            "workspace/summarize_terms",
            json!({"text": "a short text about harbor goods", "max_words": 10}),
        );
        assert!(r.get("result").is_some(), "{r}");
    }
    let health = c.request("flowhost/health", json!({}));
    assert_eq!(
        health["result"]["declaration_mismatches"],
        json!({"workspace/summarize_terms": 2}),
        "{health}"
    );
    lab.stop();
    let records = lab.records();
    let egress = events(&records, "egress_attempt");
    assert_eq!(egress.len(), 2, "{egress:#?}");
    for e in &egress {
        assert_eq!(e["flowhost"]["declaration_mismatch"], "undeclared_egress");
        assert_eq!(e["decision"]["effect"], "deny");
    }
    // One warning per executor, naming server and tool.
    let log = lab.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("declares no egress"))
        .collect();
    let executors: std::collections::BTreeSet<String> = egress
        .iter()
        .map(|e| e["flowhost"]["call_id"].to_string())
        .collect();
    assert!(!warnings.is_empty() && warnings.len() <= executors.len());
    assert!(
        warnings[0].contains("workspace") && warnings[0].contains("summarize_terms"),
        "{}",
        warnings[0]
    );
}

#[test]
fn allowed_calls_record_their_outcome_and_the_labels_they_leave() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    let ok = c.call("workspace/read_terms", json!({"document": TERMS}));
    assert!(ok["result"]["isError"] != json!(true), "{ok}");
    let failed = c.call("workspace/read_terms", json!({"document": "missing.md"}));
    assert_eq!(failed["result"]["isError"], json!(true), "{failed}");
    lab.stop();
    let records = lab.records();
    let calls = events(&records, "tool_call");
    let outcomes = events(&records, "tool_outcome");
    assert_eq!(calls.len(), 2);
    assert_eq!(outcomes.len(), 2, "{outcomes:#?}");
    // The allow before the effect, then the effect's outcome, both with the labels left.
    assert_eq!(calls[0]["response"]["status"], "authorized");
    assert!(calls[0]["flowhost"]["labels_after"].is_object());
    assert_eq!(outcomes[0]["decision"]["effect"], "allow");
    assert_eq!(outcomes[0]["response"]["status"], "success");
    assert_eq!(outcomes[0]["response"]["side_effect_asserted"], true);
    let session = &outcomes[0]["flowhost"]["labels_after"]["session"];
    assert_eq!(
        session["compartments"],
        json!(["harbor-goods-terms"]),
        "{session}"
    );
    // An allowed call whose effect failed is recorded as such, not as a success.
    assert_eq!(outcomes[1]["decision"]["effect"], "error");
    assert_eq!(outcomes[1]["response"]["side_effect_asserted"], false);
    let (code, out, err) = lab.cli(&[
        "records",
        "verify",
        &lab.paths.records_dir.display().to_string(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn every_refusal_of_an_identified_peer_is_recorded_with_its_denial() {
    let Some(mut lab) = Lab::start() else { return };
    // A peer that maps to no principal.
    let mut stranger = lab.client_as(STRANGER_UID);
    let r = stranger.request("initialize", json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}));
    assert_eq!(denial(&r), "access_denied", "{r}");

    let mut c = lab.client();
    let r = c.request("tools/list", json!({}));
    assert_eq!(denial(&r), "not_initialized", "{r}");
    // A method the host does not serve, too: before, it was answered "not served" with
    // no denial and no record, so a peer could probe before initializing unseen.
    let r = c.request("roots/list", json!({}));
    assert_eq!(denial(&r), "not_initialized", "{r}");
    c.initialize();
    let r = c.request("roots/list", json!({}));
    assert_eq!(r["error"]["code"], -32601, "{r}");
    let r = c.request("tools/call", json!({"arguments": {}}));
    assert_eq!(denial(&r), "invalid_params", "{r}");
    let r = c.request("tools/call", json!({"name": 7}));
    assert_eq!(denial(&r), "invalid_params", "{r}");
    let r = c.request(
        "tools/call",
        json!({"name": "workspace/read_terms", "arguments": "not an object"}),
    );
    assert_eq!(denial(&r), "invalid_params", "{r}");
    let r = c.call("nowhere/nothing", json!({}));
    assert_eq!(denial(&r), "unknown_tool", "{r}");
    // An empty name broke the record format: refused as record_failure with no record, and
    // the health still called the records complete.
    let r = c.call("", json!({}));
    assert_eq!(denial(&r), "unknown_tool", "{r}");

    // A reload maps the reviewer's uid to the analyst: the reviewer's open session keeps
    // its principal, its call is refused, recorded under that principal, and the session
    // ends. The uid is withdrawn as the reload starts, so the call is sent then, well
    // before the session's own look every 5 s would end it first.
    let mut reviewer = lab.client_as(REVIEWER_UID);
    reviewer.initialize();
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let remapped = text.replacen(
        &format!("uids = [{REVIEWER_UID}]"),
        &format!("uids = [{}]", REVIEWER_UID + 1),
        1,
    );
    assert_ne!(remapped, text, "the lab config maps the reviewer uid");
    let remapped = remapped.replacen("uids = [0]", &format!("uids = [0, {REVIEWER_UID}]"), 1);
    lab.write_config(&remapped);
    lab.signal(libc::SIGHUP);
    wait_log(&lab, "withdrawn at once", 1);
    let r = reviewer.call("workspace/list_documents", json!({}));
    assert_eq!(denial(&r), "access_denied", "{r}");
    assert!(reviewer.try_read().is_err(), "the remapped session ended");
    wait_log(&lab, "reloaded: generation", 1);

    lab.stop();
    let records = lab.records();
    let session = events(&records, "session");
    let peer = session
        .iter()
        .find(|r| r["tool"]["name"] == "(initialize)")
        .expect("the stranger's initialize is recorded");
    assert_eq!(peer["flowhost"]["peer"]["uid"], STRANGER_UID);
    assert_eq!(peer["flowhost"]["denial_kind"], "access_denied");
    assert!(session.iter().any(|r| r["tool"]["name"] == "(tools/list)"
        && r["flowhost"]["denial_kind"] == "not_initialized"));
    assert!(
        session
            .iter()
            .any(|r| r["tool"]["name"] == "(unserved method)"
                && r["flowhost"]["denial_kind"] == "not_initialized")
    );
    assert!(
        session.iter().any(|r| r["tool"]["name"] == "(tools/call)"
            && r["flowhost"]["denial_kind"] == "invalid_params")
    );
    let calls = events(&records, "tool_call");
    assert!(
        calls
            .iter()
            .any(|r| r["tool"]["name"] == "workspace/read_terms"
                && r["flowhost"]["denial_kind"] == "invalid_params")
    );
    assert!(calls.iter().any(|r| r["tool"]["name"] == "nowhere/nothing"
        && r["flowhost"]["denial_kind"] == "unknown_tool"));
    assert!(
        calls
            .iter()
            .any(|r| r["tool"]["name"] == "\u{FFFD}"
                && r["flowhost"]["denial_kind"] == "unknown_tool")
    );
    let remapped = calls
        .iter()
        .find(|r| r["tool"]["name"] == "workspace/list_documents")
        .expect("the remapped session's call is recorded");
    assert_eq!(remapped["flowhost"]["principal"], "oss-reviewer");
    assert_eq!(remapped["flowhost"]["denial_kind"], "access_denied");
}

fn mount_tmpfs(dir: &Path, size: &str) -> bool {
    std::fs::create_dir_all(dir).unwrap();
    std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size},mode=0700"),
            "tmpfs",
        ])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success())
}

struct Unmount(std::path::PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn a_failed_flow_state_store_makes_health_incomplete_and_health_still_answers() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    // The state directory on a tiny filesystem that the test then fills.
    let state = lab.paths.state_dir.clone();
    if !mount_tmpfs(&state, "2m") {
        panic!("cannot mount a tmpfs for the state directory (root is required here)");
    }
    let _unmount = Unmount(state.clone());
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let filler = state.join("filler");
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=64k"])
        .arg(format!("of={}", filler.display()))
        .stderr(std::process::Stdio::null())
        .status();
    let r = c.call("workspace/read_terms", json!({"document": TERMS}));
    assert_eq!(denial(&r), "state_failure", "{r}");
    let h = c.request("flowhost/health", json!({}));
    let h = &h["result"];
    assert_eq!(h["flow_state_failed"], true, "{h}");
    assert_eq!(h["complete"], false, "{h}");
    assert!(
        h["health_file_error"].as_str().is_some(),
        "the health file cannot be written on a full disk, and health still answers: {h}"
    );
    let _ = std::fs::remove_file(&filler);
    lab.kill9();
}

fn snapshot(db: &Path) -> StateSnapshot {
    SqliteStore::open(db).unwrap().snapshot().unwrap()
}

/// Runs the lab once: the analyst reads the terms in one session, then the daemon stops
/// (cleanly, or by SIGKILL).
fn run_once(lab: &mut Lab, clean: bool) {
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let r = c.call("workspace/read_terms", json!({"document": TERMS}));
    assert!(r.get("result").is_some(), "{r}");
    if clean {
        lab.stop();
    } else {
        lab.kill9();
    }
}

/// Starts the daemon and expects it to refuse, returning its log. A daemon that starts
/// instead is stopped after 60 s and fails the test (rather than hanging it).
fn refused_start(lab: &mut Lab) -> String {
    let err = lab.dir.path().join("refused-start.err");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["serve", "--config"])
        .arg(&lab.config)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!(
                "the host started:\n{}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    assert_eq!(
        status.code(),
        Some(2),
        "the host started: {status}\n{stderr}"
    );
    stderr
}

/// A health file whose directory does not exist (or may not be written) was found only at
/// the first stop: the host served, every on-demand health failed, and every stop exited
/// unclean with no final health. The start now refuses it, naming the file.
#[test]
fn a_health_file_that_cannot_be_written_stops_the_start() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let config = std::fs::read_to_string(&lab.config).unwrap();
    let missing = lab.dir.path().join("no-such-dir/health.json");
    let edited = config.replacen(
        "call_timeout_ms = 15000",
        &format!(
            "call_timeout_ms = 15000\nhealth_file = {:?}",
            missing.to_str().unwrap()
        ),
        1,
    );
    assert_ne!(edited, config);
    lab.write_config(&edited);
    let why = refused_start(&mut lab);
    assert!(
        why.contains("health.json") && why.contains("does not exist"),
        "{why}"
    );
}

fn rebuild(lab: &Lab) {
    let (code, out, err) = lab.cli(&[
        "state",
        "rebuild",
        "--records",
        &lab.paths.records_dir.display().to_string(),
        "--state-dir",
        &lab.paths.state_dir.display().to_string(),
    ]);
    assert_eq!(code, 0, "rebuild: {out}{err}");
}

fn remove_state(state_dir: &Path, suffixes: &[&str]) {
    for s in suffixes {
        let _ = std::fs::remove_file(state_dir.join(format!("state.db{s}")));
    }
}

#[test]
fn a_truncated_state_file_is_refused_and_rebuild_restores_every_label() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    run_once(&mut lab, true);
    let db = lab.paths.state_dir.join("state.db");
    let truth = snapshot(&db);
    let analyst = PrincipalId::new("larkfield-analyst").unwrap();
    assert!(!truth.principals[&analyst].is_bottom());
    remove_state(&lab.paths.state_dir, &["-wal", "-shm"]);
    std::fs::File::create(&db).unwrap();
    let why = refused_start(&mut lab);
    assert!(
        why.contains("older than the decision records") && why.contains("state rebuild"),
        "{why}"
    );
    rebuild(&lab);
    assert_eq!(
        snapshot(&db),
        truth,
        "the rebuilt labels equal the lost ones"
    );
    run_once(&mut lab, true);
}

/// Runs the lab once raising nothing (the document list carries no label), stops it
/// cleanly, and returns a copy of its state file: an older copy for the runs that follow.
fn backup_of_a_run_that_raises_nothing(lab: &mut Lab) -> PathBuf {
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let r = c.call("workspace/list_documents", json!({}));
    assert!(r.get("result").is_some(), "{r}");
    lab.stop();
    let backup = lab.dir.path().join("backup.db");
    std::fs::copy(lab.paths.state_dir.join("state.db"), &backup).unwrap();
    backup
}

#[test]
fn an_older_copy_of_the_state_is_refused() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let backup = backup_of_a_run_that_raises_nothing(&mut lab);
    let state = lab.paths.state_dir.clone();
    // A second run raises the analyst's label.
    run_once(&mut lab, true);
    remove_state(&state, &["-wal", "-shm"]);
    std::fs::copy(&backup, state.join("state.db")).unwrap();
    let why = refused_start(&mut lab);
    assert!(why.contains("older than the decision records"), "{why}");
    assert!(why.contains("principal larkfield-analyst"), "{why}");
}

/// Starts the lab again, in which the analyst reads the terms (raising their label), and
/// returns that session.
fn raise_the_analyst_in_a_second_run(lab: &mut Lab) -> common::lab::Client {
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let r = c.call("workspace/read_terms", json!({"document": TERMS}));
    assert!(r.get("result").is_some(), "{r}");
    c
}

/// Moves the running store's raises from its write-ahead log into `db`, then overwrites the
/// file in place with the older copy `backup` (a restore into a running host).
fn write_over_the_running_state(db: &Path, backup: &Path) {
    rusqlite::Connection::open(db)
        .unwrap()
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
    std::fs::copy(backup, db).unwrap();
}

/// An older `state.db` copied over the live file while the host runs (a restore into the
/// running host) must not be bound to the records at the clean stop: bound, the next start
/// would accept its lower labels.
#[test]
fn an_older_copy_written_over_the_running_state_is_not_bound_at_stop() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let backup = backup_of_a_run_that_raises_nothing(&mut lab);
    let db = lab.paths.state_dir.join("state.db");
    let c = raise_the_analyst_in_a_second_run(&mut lab);
    write_over_the_running_state(&db, &backup);
    drop(c);
    let stopped = lab.stop_status().unwrap();
    assert!(
        !stopped.success(),
        "the stop reported a clean binding of a rolled-back state:\n{}",
        lab.log()
    );
    let why = refused_start(&mut lab);
    assert!(why.contains("older than the decision records"), "{why}");
    assert!(why.contains("principal larkfield-analyst"), "{why}");
}

/// The same restore, found while the host serves rather than at its stop: the check made
/// every `state_check_interval_ms` finds the file no longer holds what the records prove,
/// and from then on the host refuses every call that needs the state, and its health says
/// why. Before, the host went on deciding from that state until it stopped.
#[test]
fn an_older_copy_written_over_the_running_state_is_found_while_serving() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let backup = backup_of_a_run_that_raises_nothing(&mut lab);
    let config = std::fs::read_to_string(&lab.config).unwrap();
    assert!(config.contains("call_timeout_ms = 15000"), "{config}");
    lab.write_config(&config.replacen(
        "call_timeout_ms = 15000",
        "call_timeout_ms = 15000\nstate_check_interval_ms = 200",
        1,
    ));
    let db = lab.paths.state_dir.join("state.db");
    let mut c = raise_the_analyst_in_a_second_run(&mut lab);
    // A check between the raise and the restore binds the state to the raise's records.
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        !lab.log()
            .contains("does not hold what the decision records prove"),
        "a check refused the state before it was restored:\n{}",
        lab.log()
    );
    write_over_the_running_state(&db, &backup);
    wait_log(&lab, "refusing every call that needs it", 1);
    assert!(
        lab.log()
            .contains("lower label for principal larkfield-analyst"),
        "{}",
        lab.log()
    );
    let r = c.call("workspace/list_documents", json!({}));
    assert_eq!(denial(&r), "state_failure", "{r}");
    let h = c.request("flowhost/health", json!({}));
    let h = &h["result"];
    assert_eq!(h["flow_state_failed"], true, "{h}");
    assert!(
        h["flow_state_failure_reason"]
            .as_str()
            .is_some_and(|w| w.contains("larkfield-analyst")),
        "{h}"
    );
    drop(c);
    let stopped = lab.stop_status().unwrap();
    assert!(!stopped.success(), "{}", lab.log());
    let why = refused_start(&mut lab);
    assert!(why.contains("principal larkfield-analyst"), "{why}");
}

/// A record line damaged on disk while the host serves (past the checkpoint, so the next
/// check reads it): no check can finish while it stands, so a state rolled back meanwhile
/// would never be found. Before, the check logged the fault and tried again at every
/// interval while calls went on and health said nothing.
#[test]
fn a_record_line_damaged_while_serving_fails_the_state() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let config = std::fs::read_to_string(&lab.config).unwrap();
    lab.write_config(&config.replacen(
        "call_timeout_ms = 15000",
        "call_timeout_ms = 15000\nstate_check_interval_ms = 1000",
        1,
    ));
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    const FAILED: &str = "cannot be read as they must be";
    // A check may come between a call and the damage of its line (then the line is behind
    // the checkpoint and never read again): damage the next call's line until one is read.
    for attempt in 0.. {
        assert!(attempt < 5, "no check read a damaged line:\n{}", lab.log());
        let r = c.call("workspace/list_documents", json!({}));
        assert!(r.get("result").is_some(), "{r}");
        let file = std::fs::read_dir(&lab.paths.records_dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .max()
            .unwrap();
        let text = std::fs::read(&file).unwrap();
        let last_line = text[..text.len() - 1]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |at| at + 1);
        // Its first byte, `{`, made `#`: the line is no JSON (the writer's chain in memory
        // is unchanged, and appends go on after it).
        let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        std::os::unix::fs::FileExt::write_at(&f, b"#", last_line as u64).unwrap();
        drop(f);
        let deadline = Instant::now() + Duration::from_millis(2500);
        while Instant::now() < deadline && !lab.log().contains(FAILED) {
            std::thread::sleep(Duration::from_millis(50));
        }
        if lab.log().contains(FAILED) {
            break;
        }
    }
    let r = c.call("workspace/list_documents", json!({}));
    assert_eq!(denial(&r), "state_failure", "{r}");
    let h = c.request("flowhost/health", json!({}));
    assert_eq!(h["result"]["flow_state_failed"], true, "{h}");
    drop(c);
    let stopped = lab.stop_status().unwrap();
    assert!(!stopped.success(), "{}", lab.log());
}

/// A run in which only the reviewer calls, killed: its record lies past the checkpoint, so
/// the next start moves the checkpoint, and the move stays in that run's write-ahead log
/// (no raise goes with it) until the file is checkpointed.
fn a_killed_run_the_analyst_sits_out(lab: &mut Lab) {
    lab.spawn();
    let mut reviewer = lab.client_as(REVIEWER_UID);
    reviewer.initialize();
    let r = reviewer.call("workspace/list_documents", json!({}));
    assert!(r.get("result").is_some(), "{r}");
    lab.kill9();
}

/// As above, but the older copy lands while the running store's write-ahead log holds the
/// checkpoint its start wrote (nothing moved it into the file): the store's connection reads
/// that checkpoint from the log, and no record after it proves the analyst's label. The stop
/// must still refuse to bind, and the next start must refuse the file SQLite makes of the
/// copy and the log.
#[test]
fn an_older_copy_written_over_the_running_state_under_a_live_log_is_refused() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let backup = backup_of_a_run_that_raises_nothing(&mut lab);
    let db = lab.paths.state_dir.join("state.db");
    run_once(&mut lab, true);
    a_killed_run_the_analyst_sits_out(&mut lab);
    lab.spawn();
    std::fs::copy(&backup, &db).unwrap();
    let stopped = lab.stop_status().unwrap();
    assert!(
        !stopped.success(),
        "the stop reported a clean binding of a rolled-back state:\n{}",
        lab.log()
    );
    assert!(
        lab.log()
            .contains("lower label for principal larkfield-analyst"),
        "{}",
        lab.log()
    );
    let why = refused_start(&mut lab);
    assert!(
        why.contains("state.db") && why.contains("different times"),
        "{why}"
    );
    rebuild(&lab);
    let analyst = PrincipalId::new("larkfield-analyst").unwrap();
    assert!(!snapshot(&db).principals[&analyst].is_bottom());
    run_once(&mut lab, true);
}

/// A run killed with its write-ahead log holding the checkpoint its start moved; the operator
/// restores `state.db` alone from an older backup. The next start replays the log over the
/// copy: the checkpoint is current, the labels are the backup's, and no record after the
/// checkpoint proves the analyst's label. The start must refuse that file.
#[test]
fn an_older_copy_restored_under_a_later_runs_log_is_refused() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let backup = backup_of_a_run_that_raises_nothing(&mut lab);
    let state = lab.paths.state_dir.clone();
    run_once(&mut lab, true);
    a_killed_run_the_analyst_sits_out(&mut lab);
    lab.spawn();
    lab.kill9();
    assert!(
        state.join("state.db-wal").exists(),
        "the killed run's log is left"
    );
    std::fs::copy(&backup, state.join("state.db")).unwrap();
    let why = refused_start(&mut lab);
    assert!(
        why.contains("state.db") && why.contains("different times"),
        "{why}"
    );
}

#[test]
fn a_state_whose_wal_was_lost_after_sigkill_is_refused() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    run_once(&mut lab, false);
    let state = lab.paths.state_dir.clone();
    assert!(
        state.join("state.db-wal").exists(),
        "the WAL holds the raise"
    );
    remove_state(&state, &["-wal", "-shm"]);
    let why = refused_start(&mut lab);
    assert!(why.contains("older than the decision records"), "{why}");
    rebuild(&lab);
    let analyst = PrincipalId::new("larkfield-analyst").unwrap();
    let rebuilt = snapshot(&state.join("state.db"));
    assert!(
        rebuilt.principals[&analyst]
            .to_canonical_json()
            .contains("harbor-goods-terms")
    );
    run_once(&mut lab, true);
}

#[test]
fn another_hosts_state_file_is_refused() {
    let (Some(mut a), Some(mut b)) = (Lab::prepare(), Lab::prepare()) else {
        return;
    };
    run_once(&mut a, true);
    run_once(&mut b, true);
    for s in ["state.db", "state.db-wal", "state.db-shm"] {
        let _ = std::fs::remove_file(a.paths.state_dir.join(s));
        if b.paths.state_dir.join(s).exists() {
            std::fs::copy(b.paths.state_dir.join(s), a.paths.state_dir.join(s)).unwrap();
        }
    }
    let why = refused_start(&mut a);
    assert!(why.contains("another record stream"), "{why}");
}

#[test]
fn health_is_bound_to_the_records_across_clean_restarts() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    run_once(&mut lab, true);
    run_once(&mut lab, true);
    let health: Value = serde_json::from_str(
        &std::fs::read_to_string(lab.paths.state_dir.join("health.json")).unwrap(),
    )
    .unwrap();
    let records = lab.records();
    let last = records.last().unwrap();
    assert_eq!(health["complete"], true, "{health}");
    assert_eq!(health["records"]["first_seq"], 1, "{health}");
    assert_eq!(health["records"]["last_seq"], last["flowhost"]["seq"]);
    assert_eq!(
        health["tool_calls_observed"],
        events(&records, "tool_call").len(),
        "{health}"
    );
    // After a SIGKILL the previous health no longer ends where the records end: the next
    // run's health vouches only for what that run wrote.
    run_once(&mut lab, false);
    run_once(&mut lab, true);
    let health: Value = serde_json::from_str(
        &std::fs::read_to_string(lab.paths.state_dir.join("health.json")).unwrap(),
    )
    .unwrap();
    assert!(
        health["records"]["first_seq"].as_u64().unwrap() > 1,
        "{health}"
    );
}

#[test]
fn ended_sessions_leave_no_rows_behind() {
    let Some(mut lab) = Lab::start() else { return };
    for _ in 0..20 {
        let mut c = lab.client();
        c.initialize();
        let r = c.call("workspace/read_terms", json!({"document": TERMS}));
        assert!(r.get("result").is_some(), "{r}");
    }
    // Sessions end when their connections close; give the daemon a moment to notice.
    std::thread::sleep(Duration::from_millis(300));
    let db = lab.paths.state_dir.join("state.db");
    let rows: i64 = rusqlite::Connection::open(&db)
        .unwrap()
        .query_row("SELECT count(*) FROM session_labels", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        rows, 0,
        "ended sessions were compacted into their principal"
    );
    lab.stop();
}

fn records_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

#[test]
fn a_refusal_flood_adds_little_to_the_records_and_locks_nobody_out() {
    let Some(mut lab) = Lab::start() else { return };
    let before = records_bytes(&lab.paths.records_dir);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Another principal keeps working while the flood runs.
    let mut reviewer = lab.client_as(REVIEWER_UID);
    reviewer.initialize();
    let worker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut ok = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let r = reviewer.call("workspace/list_documents", json!({}));
                assert!(r.get("result").is_some(), "{r}");
                ok += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            ok
        })
    };
    let mut flood = lab.client();
    flood.initialize();
    let started = Instant::now();
    let mut sent = 0u64;
    while started.elapsed() < Duration::from_secs(10) {
        let name = format!("nowhere/{}{sent}", "x".repeat(900));
        let r = flood.call(&name, json!({}));
        assert_eq!(denial(&r), "unknown_tool");
        sent += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let served = worker.join().unwrap();
    lab.stop();
    let added = records_bytes(&lab.paths.records_dir) - before;
    eprintln!(
        "{sent} refused calls in 10 s added {added} bytes of records; the other principal was served {served} times"
    );
    assert!(
        sent > 1000,
        "the flood was too slow to mean anything: {sent}"
    );
    assert!(
        added < 1024 * 1024,
        "{sent} refusals added {added} bytes of records"
    );
    assert!(
        served >= 20,
        "the other principal was served {served} times"
    );
    // The refusals beyond the budget are accounted for in one folded record.
    let folded: u64 = lab
        .records()
        .iter()
        .filter_map(|r| r["flowhost"]["folded"]["count"].as_u64())
        .sum();
    let recorded = lab
        .records()
        .iter()
        .filter(|r| {
            r["flowhost"]["denial_kind"] == "unknown_tool" && r["flowhost"]["folded"].is_null()
        })
        .count() as u64;
    assert_eq!(folded + recorded, sent, "every refusal is accounted for");
    // The folded records are tool_call records like any other: the health written at the
    // stop counts them, so it still binds to the records.
    let health: Value = serde_json::from_str(
        &std::fs::read_to_string(lab.paths.state_dir.join("health.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        health["tool_calls_observed"],
        events(&lab.records(), "tool_call").len(),
        "{health}"
    );
}

#[test]
fn health_warns_before_the_records_filesystem_is_full() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    // A floor above any real disk: the warning must show.
    let text = std::fs::read_to_string(&lab.config).unwrap();
    lab.write_config(&text.replacen("[host]\n", "[host]\nrecords_min_free_mib = 1000000000\n", 1));
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let h = c.request("flowhost/health", json!({}));
    let warnings = h["result"]["warnings"].to_string();
    assert!(
        warnings.contains("under the floor") && warnings.contains("records_min_free_mib"),
        "{h}"
    );
    // A warning, not a gap: observation is still complete.
    assert_eq!(h["result"]["complete"], true, "{h}");
    lab.stop();
}

#[test]
fn a_refused_stranger_leaves_evidence_but_no_diff_finding() {
    let Some(mut lab) = Lab::start() else { return };
    let mut stranger = lab.client_as(STRANGER_UID);
    let r = stranger.request("initialize", json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}));
    assert_eq!(denial(&r), "access_denied");
    let mut c = lab.client();
    c.initialize();
    drop(c);
    lab.stop();
    // The health the daemon wrote when it stopped.
    let (code, report) = lab.verify_and_diff(Some(&lab.paths.state_dir.join("health.json")));
    assert_eq!(code, 0, "{report}");
}

/// A health the daemon wrote on demand vouches only for the run so far. Left on disk by a
/// daemon that never wrote its last one (killed here; a full disk does the same), and bound
/// to records that end where it does, it must not let the gate pass: after it, calls may
/// have been refused without a record. Before, the diff judged the run clean on it (exit 0).
#[test]
fn a_health_written_while_the_run_went_on_does_not_pass_the_gate() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    let h = c.request("flowhost/health", json!({}))["result"].clone();
    assert_eq!(h["complete"], true, "{h}");
    lab.kill9();
    let health = lab.paths.state_dir.join("health.json");
    let (code, out, err) = lab.cli(&[
        "diff",
        "--declared",
        &lab.declared_surface_file().display().to_string(),
        "--observed",
        &lab.paths.records_dir.display().to_string(),
        "--health",
        &health.display().to_string(),
    ]);
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.contains("run_ended"), "{out}{err}");
}

#[test]
fn a_server_key_file_others_may_write_is_refused_at_start() {
    use std::os::unix::fs::PermissionsExt;
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    // The lab's keys, copied where this test may change their modes.
    let keys = lab.dir.path().join("keys");
    std::fs::create_dir(&keys).unwrap();
    for entry in std::fs::read_dir(&lab.paths.keys_dir).unwrap().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".pub") {
            std::fs::copy(entry.path(), keys.join(entry.file_name())).unwrap();
        }
    }
    let workspace = keys.join("workspace.pub");
    std::fs::set_permissions(&workspace, std::fs::Permissions::from_mode(0o664)).unwrap();
    lab.paths.keys_dir = keys;
    lab.write_config(&flowhost::lab::host_config(&lab.paths));
    // Whoever may write the file could have put their own key there: nothing is started.
    // (Not `refused_start`: a host that wrongly starts must fail this test, not hang it.)
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["serve", "--config"])
        .arg(&lab.config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the host started with a server key file others may write");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let why = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(why.contains(&workspace.display().to_string()), "{why}");
    assert!(why.contains("mode 0664"), "{why}");
    assert!(!lab.paths.state_dir.exists(), "state was touched: {why}");
}
