//! The Rust test API (`flowhost::harness`), as root and as an unprivileged user: commands
//! and MCP servers under the broker, their egress as typed values, and the checks a tool
//! author asserts with. The gate passes a well-behaved tool and fails one that egresses
//! undeclared.

mod common;

use common::TcpSink;
use common::harness::{
    As, can_run, example_files, example_tool, flowhost_for, harness, surface_allowing, work_dir,
};
use serde_json::json;
use std::time::Duration;

fn command_under_harness(who: As) {
    let probe = common::shared_copy("flowhost-probe");
    if !can_run(who, &[&flowhost_for(who), &probe]) {
        return;
    }
    let sink = TcpSink::start();
    let elsewhere = TcpSink::start_on("127.0.0.2:0");
    let dir = work_dir(who);
    let declared = surface_allowing(dir.path(), sink.addr);
    let probe_to = |addr: std::net::SocketAddr| {
        vec![
            probe.display().to_string(),
            "connect".into(),
            addr.to_string(),
            "payload".into(),
        ]
    };

    // Nothing allowed and nothing tried: no egress, and the empty run matches any surface.
    let quiet = harness(who)
        .run([probe.display().to_string(), "list-fds".into()])
        .unwrap();
    quiet.assert_success();
    quiet.assert_complete();
    quiet.assert_no_egress();
    quiet.assert_matches_declared(&declared);

    // Cut short by its wall-clock limit before it tried anything: no check of what the
    // command does holds (before, it passed as a command that never reaches anywhere). Its
    // own unfinished line on stderr does not hide that (before, flowhost's line was looked
    // for at the start of a line, and a command could glue it onto its own).
    let cut = harness(who)
        .timeout(1)
        .run([
            "/bin/sh".to_string(),
            "-c".into(),
            "printf waiting >&2; sleep 5".into(),
        ])
        .unwrap();
    let e = cut.check_no_egress().unwrap_err().to_string();
    assert!(e.contains("cut short") && e.contains("wall-clock"), "{e}");

    // Well-behaved: one allowed connect, to the declared destination.
    let good = harness(who)
        .allow(&sink.addr.to_string())
        .run(probe_to(sink.addr))
        .unwrap();
    good.assert_success();
    good.assert_complete();
    assert_eq!(good.attempts.len(), 1, "{:?}", good.attempts);
    assert!(good.attempts[0].allowed && !good.attempts[0].undeclared);
    assert_eq!(good.attempts[0].protocol.as_deref(), Some("tcp"));
    good.assert_only_destinations(&[&sink.addr.to_string()]);
    good.assert_matches_declared(&declared);
    assert!(good.check_no_egress().is_err(), "it did egress");
    assert_eq!(sink.await_bytes(7), b"payload");

    // Undeclared egress: refused by the broker (no rule allows it), recorded, and the gate
    // fails, naming the destination.
    let bad = harness(who)
        .allow(&sink.addr.to_string())
        .run(probe_to(elsewhere.addr))
        .unwrap();
    bad.assert_success();
    assert_eq!(bad.attempts.len(), 1, "{:?}", bad.attempts);
    assert!(!bad.attempts[0].allowed);
    assert_eq!(
        bad.attempts[0].destination_text(),
        elsewhere.addr.to_string()
    );
    assert_eq!(elsewhere.connections(), 0);
    let stray = bad
        .check_only_destinations(&["127.0.0.1"])
        .unwrap_err()
        .to_string();
    assert!(stray.contains(&elsewhere.addr.to_string()), "{stray}");
    let report = bad.diff_declared(&declared).unwrap();
    assert!(!flowhost::harness::passes(&report));
    assert_eq!(report.exit_code(), 1);
    let failed = bad
        .check_matches_declared(&declared)
        .unwrap_err()
        .to_string();
    assert!(
        failed.contains(&format!("\"port\":{}", elsewhere.addr.port())),
        "{failed}"
    );
}

#[test]
fn a_command_under_the_harness_as_root() {
    command_under_harness(As::Root);
}

#[test]
fn a_command_under_the_harness_unprivileged() {
    command_under_harness(As::Nobody);
}

fn mcp_server_under_harness(who: As) {
    let tool = example_tool();
    let files = example_files();
    if !can_run(who, &[&flowhost_for(who), &tool, &files.manifest]) {
        return;
    }
    let service = TcpSink::start();
    let elsewhere = TcpSink::start_on("127.0.0.2:0");
    let serve = |extra: &[String]| {
        let mut argv = vec![tool.display().to_string(), "serve".into()];
        argv.extend(extra.iter().cloned());
        let mut server = harness(who)
            .allow(&service.addr.to_string())
            .mcp_with(
                &files.manifest,
                &files.key.display().to_string(),
                Some(&files.mappings),
                argv,
            )
            .unwrap();
        let names: Vec<String> = server
            .list_tools()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["status-probe/check", "status-probe/version"]);
        let checked = server
            .call("check", json!({"target": service.addr.to_string()}))
            .unwrap();
        assert_eq!(checked["result"]["isError"], false, "{checked}");
        let version = server.call("version", json!({})).unwrap();
        assert_eq!(version["result"]["isError"], false, "{version}");
        // The signed schema is enforced before the tool sees anything: a tool execution
        // error the model can act on (recorded as schema_invalid).
        let refused = server
            .call("check", json!({"target": "not an address"}))
            .unwrap();
        assert_eq!(refused["result"]["isError"], true, "{refused}");
        assert!(refused.to_string().contains("input schema"), "{refused}");
        server.finish().unwrap()
    };

    let good = serve(&[]);
    good.assert_success();
    good.assert_complete();
    good.assert_only_destinations(&[&service.addr.to_string()]);
    // The schema refusal has no declared deny: the declaration covers the calls it expects.
    let report = good.diff_declared(&files.declared).unwrap();
    assert!(
        report
            .findings
            .iter()
            .all(|f| f.tool.as_deref() == Some("status-probe/check")
                && f.effect.as_deref() == Some("deny")),
        "{}",
        flowhost::diff::report::to_text(&report)
    );

    let bad = serve(&["--phone-home".into(), elsewhere.addr.to_string()]);
    bad.assert_success();
    bad.assert_complete();
    assert_eq!(
        elsewhere.connections(),
        0,
        "the broker refused every phone-home attempt"
    );
    let home: Vec<_> = bad
        .attempts
        .iter()
        .filter(|a| a.destination_text() == elsewhere.addr.to_string())
        .collect();
    assert_eq!(home.len(), 2, "{:?}", bad.attempts);
    assert!(home.iter().all(|a| !a.allowed));
    // `version` declares no egress in its signed manifest: its attempt is undeclared.
    assert!(
        home.iter()
            .any(|a| a.tool == "status-probe/version" && a.undeclared)
    );
    assert!(
        home.iter()
            .any(|a| a.tool == "status-probe/check" && !a.undeclared)
    );
    // A call its deadline ended, with its executor: what the tool would have done after
    // is not observed, so no check of what it did holds (before, the run passed as one
    // that reached nowhere).
    let mut stalled = harness(who)
        .call_timeout(Duration::from_millis(500))
        .mcp(
            &files.manifest,
            &files.key.display().to_string(),
            [
                tool.display().to_string(),
                "serve".into(),
                "--stall-ms".into(),
                "20000".into(),
            ],
        )
        .unwrap();
    let ended = stalled.call("version", json!({})).unwrap();
    assert_eq!(ended["result"]["isError"], true, "{ended}");
    let stalled = stalled.finish().unwrap();
    let e = stalled.check_no_egress().unwrap_err().to_string();
    assert!(
        e.contains("cut short") && e.contains("status-probe/version"),
        "{e}"
    );

    let report = bad.diff_declared(&files.declared).unwrap();
    assert!(!flowhost::harness::passes(&report));
    assert!(
        report
            .findings
            .iter()
            .any(|f| f.kind == flowhost::diff::FindingKind::UndeclaredEgress),
        "{}",
        flowhost::diff::report::to_text(&report)
    );
}

/// An `McpServer` dropped without `finish` (a test that fails half way) stops its host as
/// a finished one does: the host's private directory, which holds the configuration with
/// the `--env` values given (often tokens), is removed. Before, the host was SIGKILLed and
/// the directory stayed in the temporary directory.
#[test]
fn a_dropped_mcp_server_leaves_nothing_behind() {
    let who = As::Root;
    let tool = example_tool();
    let files = example_files();
    if !can_run(who, &[&flowhost_for(who), &tool, &files.manifest]) {
        return;
    }
    let mark = format!("dropped-{}-{}", std::process::id(), rand_suffix());
    let server = harness(who)
        .env(&format!("FLOWHOST_TEST_MARK={mark}"))
        .mcp(
            &files.manifest,
            &files.key.display().to_string(),
            [tool.display().to_string(), "serve".into()],
        )
        .unwrap();
    let holding_mark = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("flowhost-sandbox-"))
            })
            .filter(|p| {
                std::fs::read_to_string(p.join("host.toml")).is_ok_and(|t| t.contains(&mark))
            })
            .collect()
    };
    assert_eq!(
        holding_mark().len(),
        1,
        "the host's private directory is where it was looked for"
    );
    drop(server);
    assert_eq!(holding_mark(), Vec::<std::path::PathBuf>::new());
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

#[test]
fn an_mcp_server_under_the_harness_as_root() {
    mcp_server_under_harness(As::Root);
}

#[test]
fn an_mcp_server_under_the_harness_unprivileged() {
    mcp_server_under_harness(As::Nobody);
}

#[test]
fn the_example_runs_and_its_gate_catches_the_tool_phoning_home() {
    if !can_run(As::Root, &[]) {
        return;
    }
    let example = common::workspace_binary("examples/harness_tool");
    let out = std::process::Command::new(example)
        .env("FLOWHOST_BIN", env!("CARGO_BIN_EXE_flowhost"))
        .output()
        .unwrap();
    let stdout = common::harness::succeeded(&out);
    assert!(
        stdout.contains("PASS  well-behaved") && stdout.contains("the gate fails"),
        "{stdout}"
    );
}

/// A tool that logs before its result: the log lines come first, as notifications, and the
/// harness reads on to the answer. Before, it took the first line for the answer and failed
/// ("not for request N"), and every later request read a reply meant for an earlier one.
#[test]
fn a_tool_that_logs_before_its_result_is_answered() {
    let conformance = common::shared_copy("flowhost-tool-conformance");
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/conformance");
    let manifest = repo.join("conformance.signed.json");
    if !can_run(
        As::Root,
        &[&flowhost_for(As::Root), &conformance, &manifest],
    ) {
        return;
    }
    let mut server = harness(As::Root)
        .mcp(
            &manifest,
            &repo.join("keys/conformance.pub").display().to_string(),
            [conformance.display().to_string()],
        )
        .unwrap();
    let logged = server.call("test_tool_with_logging", json!({})).unwrap();
    assert!(
        logged.to_string().contains("executed successfully"),
        "{logged}"
    );
    let lines = server
        .notifications()
        .iter()
        .filter(|n| n["method"] == "notifications/message")
        .count();
    assert_eq!(lines, 3, "{:?}", server.notifications());
    // The next request gets its own answer.
    let simple = server.call("test_simple_text", json!({})).unwrap();
    assert!(
        simple.to_string().contains("simple text response"),
        "{simple}"
    );
    server.finish().unwrap().assert_success();
}
