//! The host daemon with the real broker and real executors: the pricing-lab flow, sessions
//! and principals, restarts, protocol errors, concurrency.

mod common;

use std::time::Duration;

use common::lab::{Client, Lab, REVIEWER_UID, text};
use flowhost::mcp::code;
use serde_json::{Value, json};

const TERMS: &str = "harbor-goods-terms.md";

fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..100 {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    false
}

fn denial(r: &Value) -> (i64, String) {
    let e = r
        .get("error")
        .unwrap_or_else(|| panic!("expected an error: {r}"));
    (
        e["code"].as_i64().unwrap(),
        e["data"]["denial"].as_str().unwrap_or("").to_string(),
    )
}

/// Publishes `message` to the lab's public sink from `c`.
fn publish_publicly(c: &mut Client, lab: &Lab, message: &str) -> Value {
    c.call(
        "public-inbox/publish",
        json!({"message": message, "sink": lab.public.addr.to_string()}),
    )
}

#[test]
fn the_pricing_lab_flow() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();

    let tools = c.request("tools/list", json!({}));
    let names: Vec<&str> = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        vec![
            "public-inbox/publish",
            "team-inbox/publish",
            "workspace/list_documents",
            "workspace/read_terms",
            "workspace/summarize_terms"
        ]
    );

    // 1. Read the terms: the session now carries the contract label.
    let terms = text(&c.call("workspace/read_terms", json!({"document": TERMS})));
    assert!(terms.contains("Harbor Goods"), "{terms}");

    // 2. The pricing team's channel is cleared for the contract label: allowed, bytes arrive.
    let r = c.call(
        "team-inbox/publish",
        json!({"message": "Harbor Goods summary for the team", "sink": lab.team.addr.to_string()}),
    );
    assert_eq!(
        text(&r),
        "delivered 33 bytes to team-inbox",
        "{r}\n{}",
        lab.log()
    );
    assert!(
        wait_for(|| lab.team.bytes() == b"Harbor Goods summary for the team"),
        "{:?}",
        lab.team.bytes()
    );

    // 3. The public pull request is not: refused as a flow violation before dispatch.
    let r = publish_publicly(&mut c, &lab, "a public note");
    assert_eq!(
        denial(&r),
        (code::FLOW_DENIED, "flow_violation".into()),
        "{r}"
    );

    // 4. The summarizer declares no egress but connects out: refused at the syscall.
    let r = c.call(
        "workspace/summarize_terms",
        json!({"text": terms, "max_words": 10}),
    );
    assert!(!text(&r).is_empty(), "the sneaky tool still answers: {r}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        lab.public.connections(),
        0,
        "the public sink received nothing"
    );
    assert_eq!(
        lab.exfil.connections(),
        0,
        "the exfiltration sink received nothing"
    );
    assert_eq!(lab.team.connections(), 1);

    lab.stop();
    let records = lab.records();
    let egress: Vec<&Value> = records
        .iter()
        .filter(|r| r["flowhost"]["event"] == "egress_attempt")
        .collect();
    let sneaky: Vec<&&Value> = egress
        .iter()
        .filter(|r| r["server"]["id"] == "workspace")
        .collect();
    assert_eq!(sneaky.len(), 1, "{egress:#?}");
    // The operator's log has a line for the decision, naming server, tool and verdict.
    let log = lab.log();
    assert!(
        log.lines().any(|l| l.contains("egress decision")
            && l.contains("server=workspace")
            && l.contains("tool=workspace/summarize_terms")
            && l.contains("verdict=\"refused\"")),
        "{log}"
    );
    assert_eq!(sneaky[0]["decision"]["effect"], "deny");
    assert_eq!(sneaky[0]["flowhost"]["denial_kind"], "missing_clearance");
    assert_eq!(
        sneaky[0]["flowhost"]["egress_basis"],
        json!({"declared": false, "topology": false, "observed": true})
    );
    assert_eq!(sneaky[0]["action"]["target"]["port"], lab.exfil.addr.port());
    let team: Vec<&&Value> = egress
        .iter()
        .filter(|r| r["server"]["id"] == "team-inbox")
        .collect();
    assert_eq!(team.len(), 1);
    assert_eq!(team[0]["decision"]["effect"], "allow");

    let health = lab.paths.state_dir.join("health.json");
    let (code, report) = lab.verify_and_diff(Some(&health));
    assert_eq!(code, 1, "findings: {report:#}");
    assert_eq!(report["observation_complete"], true, "{report:#}");
    let mut findings: Vec<(String, String, String)> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap().into(),
                f["tool"].as_str().unwrap().into(),
                f["category"].as_str().unwrap_or("-").into(),
            )
        })
        .collect();
    findings.sort();
    // The declared read, team publish and team egress give nothing; what is left is exactly
    // the refused public publish, the refused hidden egress, the unmapped summarizer, and
    // the summarizer's egress its signed declaration (egress: false) denies.
    assert_eq!(
        findings,
        vec![
            (
                "attempted_privileged_tool_action_denied".into(),
                "public-inbox/publish".into(),
                "message_publish".into()
            ),
            (
                "attempted_privileged_tool_action_denied".into(),
                "workspace/summarize_terms".into(),
                "network_egress".into()
            ),
            (
                "unclassified_tool_action".into(),
                "workspace/summarize_terms".into(),
                "-".into()
            ),
            (
                "undeclared_egress".into(),
                "workspace/summarize_terms".into(),
                "-".into()
            ),
        ],
        "{report:#}"
    );
}

/// Both runtime shapes serve the same calls: one worker (the default on 2 CPUs) runs the host
/// on a current-thread runtime, more on a multi-thread one, and concurrent sessions, label
/// raises, egress through the broker and refusals work on each.
#[test]
fn the_daemon_serves_on_one_worker_and_on_several() {
    for workers in ["1", "2"] {
        let Some(mut lab) = Lab::prepare() else {
            return;
        };
        let mut command = lab.serve_command();
        command.args(["--workers", workers]);
        let socket = lab.paths.socket.clone();
        lab.spawn_with(command, &socket);
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let mut c = lab.client();
                let team = lab.team.addr.to_string();
                std::thread::spawn(move || {
                    c.initialize();
                    let terms = text(&c.call("workspace/read_terms", json!({"document": TERMS})));
                    assert!(terms.contains("Harbor Goods"), "{terms}");
                    let message = format!("note {i}");
                    let r = c.call(
                        "team-inbox/publish",
                        json!({"message": message, "sink": team}),
                    );
                    assert_eq!(
                        text(&r),
                        format!("delivered {} bytes to team-inbox", message.len()),
                        "{r}"
                    );
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a session failed");
        }
        let mut c = lab.client();
        c.initialize();
        text(&c.call("workspace/read_terms", json!({"document": TERMS})));
        let r = publish_publicly(&mut c, &lab, "a public note");
        assert_eq!(
            denial(&r),
            (code::FLOW_DENIED, "flow_violation".into()),
            "{workers} workers: {r}"
        );
        assert!(
            wait_for(|| lab.team.bytes().len() == 4 * "note 0".len()),
            "{workers} workers: {:?}\n{}",
            lab.team.bytes(),
            lab.log()
        );
    }
}

#[test]
fn another_principal_still_publishes_publicly_and_taint_follows_the_principal() {
    let Some(lab) = Lab::start() else { return };
    let mut analyst = lab.client();
    analyst.initialize();
    text(&analyst.call("workspace/read_terms", json!({"document": TERMS})));

    let mut reviewer = lab.client_as(REVIEWER_UID);
    reviewer.initialize();
    let r = publish_publicly(&mut reviewer, &lab, "release notes");
    assert_eq!(text(&r), "delivered 13 bytes to public-inbox", "{r}");
    assert!(wait_for(|| lab.public.bytes() == b"release notes"));
    // The reviewer was never granted the workspace reader.
    let r = reviewer.call("workspace/read_terms", json!({"document": TERMS}));
    assert_eq!(
        denial(&r),
        (code::ACCESS_DENIED, "access_denied".into()),
        "{r}"
    );

    // A brand-new session of the analyst carries the analyst's taint.
    let mut again = lab.client();
    again.initialize();
    let r = publish_publicly(&mut again, &lab, "hello");
    assert_eq!(
        denial(&r),
        (code::FLOW_DENIED, "flow_violation".into()),
        "{r}"
    );
    assert_eq!(lab.public.connections(), 1);
}

#[test]
fn kill_9_and_restart_never_lowers_a_label() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    text(&c.call("workspace/read_terms", json!({"document": TERMS})));
    let public = json!({"message": "hello", "sink": lab.public.addr.to_string()});
    let before = c.call("public-inbox/publish", public.clone());
    assert_eq!(
        denial(&before),
        (code::FLOW_DENIED, "flow_violation".into())
    );
    drop(c);
    lab.kill9();

    let db = lab.paths.state_dir.join("state.db");
    let store = flowhost::state::SqliteStore::open(&db).unwrap();
    let stored = store
        .stored_principal_label(&flowhost::PrincipalId::new("larkfield-analyst").unwrap())
        .unwrap()
        .expect("the analyst's label is on disk");
    assert_eq!(
        stored
            .compartments()
            .unwrap()
            .iter()
            .map(|c| c.as_str())
            .collect::<Vec<_>>(),
        vec!["harbor-goods-terms"]
    );
    drop(store);

    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let after = c.call("public-inbox/publish", public);
    assert_eq!(
        denial(&after),
        denial(&before),
        "the same decision after the restart"
    );
    let r = c.call(
        "team-inbox/publish",
        json!({"message": "still cleared", "sink": lab.team.addr.to_string()}),
    );
    assert_eq!(text(&r), "delivered 13 bytes to team-inbox");
    lab.stop();
    let records_dir = lab.paths.records_dir.display().to_string();
    let (code, out, err) = lab.cli(&["records", "verify", &records_dir]);
    assert_eq!(code, 0, "the chain survives the kill: {out}{err}");
}

#[test]
fn a_lost_flow_state_stops_the_start_until_the_operator_accepts_it() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    text(&c.call("workspace/read_terms", json!({"document": TERMS})));
    drop(c);
    lab.stop();
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(lab.paths.state_dir.join(format!("state.db{suffix}")));
    }
    let out = lab.serve_command().output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with lost state: {stderr}");
    assert!(
        stderr.contains("state.db is missing")
            && stderr.contains("state-reset-accepted")
            && stderr.contains("flowhost state rebuild"),
        "{stderr}"
    );
    assert!(!lab.paths.state_dir.join("state.db").exists());

    let ack = lab.paths.state_dir.join("state-reset-accepted");
    std::fs::write(&ack, b"").unwrap();
    lab.spawn();
    assert!(!ack.exists(), "the acceptance is used once");
    let mut c = lab.client();
    c.initialize();
    let r = publish_publicly(&mut c, &lab, "after reset");
    assert_eq!(text(&r), "delivered 11 bytes to public-inbox");
}

#[test]
fn protocol_errors_are_answered_and_never_crash_the_daemon() {
    let Some(lab) = Lab::start() else { return };
    let mut c = lab.client();
    let r = c.request("tools/list", json!({}));
    assert_eq!(r["error"]["code"], code::NOT_INITIALIZED, "{r}");
    c.initialize();
    assert_eq!(c.raw(b"{not json")["error"]["code"], code::PARSE_ERROR);
    assert_eq!(
        c.raw(br#"{"jsonrpc":"1.0","id":5,"method":"ping"}"#)["error"]["code"],
        code::INVALID_REQUEST
    );
    assert_eq!(
        c.raw(br#"{"jsonrpc":"1.0","id":5,"method":"ping"}"#)["id"],
        5
    );
    assert_eq!(
        c.request("sampling/createMessage", json!({}))["error"]["code"],
        code::METHOD_NOT_FOUND
    );
    let huge = format!(
        r#"{{"jsonrpc":"2.0","id":9,"method":"ping","params":{{"pad":"{}"}}}}"#,
        "x".repeat(2 * 1024 * 1024)
    );
    let r = c.raw(huge.as_bytes());
    assert_eq!(
        r["error"]["code"],
        code::INVALID_REQUEST,
        "{}",
        r.to_string().chars().take(300).collect::<String>()
    );
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exceeds the limit")
    );
    // The connection is still in step after the oversized message.
    assert_eq!(c.request("ping", json!({}))["result"], json!({}));

    // Arguments failing the signed schema are a tool execution error the model can act on
    // (the refusal is recorded with its denial).
    let r = c.call("workspace/read_terms", json!({"document": 42}));
    assert_eq!(r["result"]["isError"], true, "{r}");
    assert!(
        r["result"]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("input schema"),
        "{r}"
    );
    let r = c.call(
        "workspace/read_terms",
        json!({"document": TERMS, "extra": true}),
    );
    assert_eq!(
        r["result"]["isError"], true,
        "additional properties are refused: {r}"
    );
    let r = c.call("workspace/no_such_tool", json!({}));
    assert_eq!(r["error"]["code"], code::INVALID_PARAMS);
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown tool")
    );
    let r = c.call("nonsense", json!({}));
    assert_eq!(r["error"]["code"], code::INVALID_PARAMS);
    let r = c.request(
        "tools/call",
        json!({"name": "workspace/list_documents", "arguments": [1]}),
    );
    assert_eq!(r["error"]["code"], code::INVALID_PARAMS);

    let mut reviewer = lab.client_as(REVIEWER_UID);
    reviewer.initialize();
    let r = reviewer.call(
        "team-inbox/publish",
        json!({"message": "x", "sink": lab.team.addr.to_string()}),
    );
    assert_eq!(denial(&r), (code::ACCESS_DENIED, "access_denied".into()));

    // An unconfigured uid is refused at initialize.
    let mut stranger = lab.client_as(4242);
    let r = stranger.request("initialize", json!({"protocolVersion": "2025-06-18"}));
    assert_eq!(r["error"]["code"], code::ACCESS_DENIED, "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("uid 4242"));

    // Still serving.
    let mut c2 = lab.client();
    c2.initialize();
    assert!(text(&c2.call("workspace/list_documents", json!({}))).contains(TERMS));
}

#[test]
fn two_hundred_concurrent_sessions_do_not_leak_labels() {
    let Some(lab) = Lab::start() else { return };
    let lab = std::sync::Arc::new(lab);
    // 100 analyst sessions read the terms and publish to the team; 100 reviewer sessions,
    // interleaved with them, publish publicly and must never be affected.
    let mut sessions = Vec::new();
    for i in 0..200 {
        let mut c = if i % 2 == 0 {
            lab.client()
        } else {
            lab.client_as(REVIEWER_UID)
        };
        c.initialize();
        sessions.push((i, c));
    }
    let mut threads = Vec::new();
    for chunk in sessions
        .into_iter()
        .collect::<Vec<_>>()
        .chunks_mut(25)
        .map(|c| {
            c.iter_mut()
                .map(|x| std::mem::replace(x, (0, Client::dummy())))
                .collect::<Vec<_>>()
        })
    {
        let lab = lab.clone();
        threads.push(std::thread::spawn(move || {
            let mut chunk = chunk;
            for round in 0..2 {
                for (i, c) in chunk.iter_mut() {
                    if *i % 2 == 0 {
                        if round == 0 {
                            assert!(
                                text(&c.call("workspace/read_terms", json!({"document": TERMS})))
                                    .contains("Harbor Goods")
                            );
                        } else {
                            let r = c.call(
                                "team-inbox/publish",
                                json!({"message": "t", "sink": lab.team.addr.to_string()}),
                            );
                            assert_eq!(text(&r), "delivered 1 bytes to team-inbox", "{r}");
                            let r = publish_publicly(c, &lab, "p");
                            assert_eq!(denial(&r).1, "flow_violation", "{r}");
                        }
                    } else {
                        let r = publish_publicly(c, &lab, "r");
                        assert_eq!(
                            text(&r),
                            "delivered 1 bytes to public-inbox",
                            "session {i} round {round}: {r}"
                        );
                    }
                }
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    assert!(
        wait_for(|| lab.public.connections() == 200),
        "public: {}",
        lab.public.connections()
    );
    assert!(
        wait_for(|| lab.team.connections() == 100),
        "team: {}",
        lab.team.connections()
    );
    assert_eq!(lab.exfil.connections(), 0);
}

#[test]
fn startup_refuses_without_the_broker_before_touching_state() {
    let Some(lab) = Lab::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut paths = lab.paths.clone();
    paths.state_dir = dir.path().join("state");
    paths.records_dir = dir.path().join("records");
    paths.socket = dir.path().join("s.sock");
    let text =
        flowhost::lab::host_config(&paths).replace("[host]\n", "[host]\nbroker = \"disabled\"\n");
    let config = dir.path().join("host.toml");
    std::fs::write(&config, text).unwrap();
    let (code, _, err) = lab.cli(&[
        "serve",
        "--log-format",
        "text",
        "--config",
        config.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("requires flow mediation") && err.contains("disabled"),
        "{err}"
    );
    assert!(!paths.state_dir.exists(), "no state was created");
    assert!(!paths.records_dir.exists(), "no records were created");
    assert!(!paths.socket.exists());

    // A manifest that fails verification stops startup and is named.
    let tampered = dir.path().join("team-inbox.signed.json");
    let original =
        std::fs::read_to_string(lab.paths.manifests_dir.join("team-inbox.signed.json")).unwrap();
    std::fs::write(
        &tampered,
        original.replacen("\"egress\": true", "\"egress\": false", 1),
    )
    .unwrap();
    let text = flowhost::lab::host_config(&paths).replace(
        &lab.paths
            .manifests_dir
            .join("team-inbox.signed.json")
            .display()
            .to_string(),
        &tampered.display().to_string(),
    );
    std::fs::write(&config, text).unwrap();
    let (code, _, err) = lab.cli(&[
        "serve",
        "--log-format",
        "text",
        "--config",
        config.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("team-inbox"), "{err}");
    assert!(!paths.state_dir.exists());
}

#[test]
fn one_principal_cannot_take_every_session() {
    use std::io::{Read, Write};
    let Some(lab) = Lab::start() else { return };
    // Each of these is counted once it has answered a ping. The lab has two principals.
    let mut held: Vec<Client> = (0..flowhost::daemon::session_share(2))
        .map(|_| {
            let mut c = lab.client();
            assert!(c.request("ping", json!({})).get("result").is_some());
            c
        })
        .collect();
    let mut extra = std::os::unix::net::UnixStream::connect(&lab.paths.socket).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let _ = extra.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n");
    let mut buf = [0u8; 64];
    assert_eq!(
        extra.read(&mut buf).unwrap_or(0),
        0,
        "a connection beyond the principal's share was served"
    );
    // A session that ends frees its slot.
    drop(held.pop());
    assert!(wait_for(|| {
        let mut c = std::os::unix::net::UnixStream::connect(&lab.paths.socket).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = c.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n");
        c.read(&mut buf).unwrap_or(0) > 0
    }));
}
