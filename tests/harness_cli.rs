//! The CI gate from the command line, as root and as an unprivileged user:
//! `flowhost sandbox run --records DIR --declared SURFACE` and `flowhost sandbox mcp`
//! write records in the daemon's schema that `flowhost records verify` and `flowhost diff`
//! accept, and the gate passes a well-behaved command or tool and fails one that egresses
//! undeclared.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Output, Stdio};

use common::TcpSink;
use common::harness::{
    As, can_run, example_files, example_tool, flowhost, surface_allowing, work_dir,
};

/// The gate's documented exit status.
const GATE_FAILED: i32 = 90;

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `flowhost records verify` and `flowhost diff` on what the run `name` left in `dir`
/// (records in `dir/name`, health in `dir/name.health.json`).
fn verify_and_diff(who: As, dir: &Path, name: &str, declared: &Path) -> Output {
    let records = dir.join(name);
    let health = dir.join(format!("{name}.health.json"));
    let out = flowhost(who)
        .args(["records", "verify"])
        .arg(&records)
        .output()
        .unwrap();
    assert!(out.status.success(), "records verify: {}", text(&out));
    flowhost(who)
        .arg("diff")
        .arg("--declared")
        .arg(declared)
        .arg("--observed")
        .arg(&records)
        .arg("--health")
        .arg(&health)
        .output()
        .unwrap()
}

fn sandbox_run_gate(who: As) {
    let probe = common::shared_copy("flowhost-probe");
    if !can_run(who, &[&common::harness::flowhost_for(who), &probe]) {
        return;
    }
    let sink = TcpSink::start();
    // 127.0.0.2 is loopback too, and no declaration names it.
    let elsewhere = TcpSink::start_on("127.0.0.2:0");
    let dir = work_dir(who);
    let declared = surface_allowing(dir.path(), sink.addr);
    let run = |name: &str, to: std::net::SocketAddr, extra: &[&str]| {
        flowhost(who)
            .args(["sandbox", "run", "--profile", "brokered", "--allow"])
            .arg(sink.addr.to_string())
            .arg("--allow")
            .arg(elsewhere.addr.to_string())
            .arg("--records")
            .arg(dir.path().join(name))
            .arg("--health")
            .arg(dir.path().join(format!("{name}.health.json")))
            .arg("--declared")
            .arg(&declared)
            .args(extra)
            .arg("--")
            .arg(&probe)
            .args(["connect", &to.to_string(), "payload"])
            .output()
            .unwrap()
    };

    // Well-behaved: it connects where the surface says; the command's status is kept.
    let out = run("good", sink.addr, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("gate passed"),
        "{}",
        text(&out)
    );
    assert_eq!(sink.await_bytes(7), b"payload");
    // The broker ran in the mode the caller's privileges give.
    let user_namespace = String::from_utf8_lossy(&out.stderr)
        .contains("executors run in a user namespace of the unprivileged host's uid");
    assert_eq!(user_namespace, who == As::Nobody, "{}", text(&out));
    // The records are the daemon's: verified, and the diff judges them clean (old code wrote
    // its own JSON lines here, which the diff refused as "not an observed decision").
    let diff = verify_and_diff(who, dir.path(), "good", &declared);
    assert_eq!(diff.status.code(), Some(0), "{}", text(&diff));

    // Undeclared egress (allowed by the sandbox, not by the declaration): the gate fails
    // with its own status, and the diff names the destination.
    let out = run("bad", elsewhere.addr, &[]);
    assert_eq!(out.status.code(), Some(GATE_FAILED), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("GATE FAILED") && stderr.contains("new_privileged_tool_action"),
        "{}",
        text(&out)
    );
    assert!(
        stderr.contains(&format!("\"port\":{}", elsewhere.addr.port())),
        "{stderr}"
    );
    let diff = verify_and_diff(who, dir.path(), "bad", &declared);
    assert_eq!(diff.status.code(), Some(1), "{}", text(&diff));

    // The status is the caller's to choose.
    let out = run("bad2", elsewhere.addr, &["--gate-status", "7"]);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));

    // Cut short by its wall-clock limit: what it would have done after is not observed, so
    // the gate cannot pass it (before, a run that had reached nowhere yet passed).
    let out = flowhost(who)
        .args(["sandbox", "run", "--profile", "brokered", "--timeout", "1"])
        .arg("--records")
        .arg(dir.path().join("cut"))
        .arg("--declared")
        .arg(&declared)
        .args(["--", "/bin/sh", "-c", "sleep 5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(GATE_FAILED), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cut short"),
        "{}",
        text(&out)
    );

    // A records directory that is not empty is refused before anything runs.
    let out = run("good", sink.addr, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not empty"),
        "{}",
        text(&out)
    );
}

#[test]
fn sandbox_run_gate_as_root() {
    sandbox_run_gate(As::Root);
}

#[test]
fn sandbox_run_gate_unprivileged() {
    sandbox_run_gate(As::Nobody);
}

/// Drives `flowhost sandbox mcp` serving the example tool (with `tool_args`) through
/// stdin: initialize, then both tools; returns the output once stdin is closed.
fn sandbox_mcp(
    who: As,
    dir: &Path,
    name: &str,
    target: std::net::SocketAddr,
    tool_args: &[&str],
) -> Output {
    let files = example_files();
    let mut child = flowhost(who)
        .args(["sandbox", "mcp", "--manifest"])
        .arg(&files.manifest)
        .arg("--key")
        .arg(&files.key)
        .arg("--mappings")
        .arg(&files.mappings)
        .arg("--allow")
        .arg(target.to_string())
        .arg("--records")
        .arg(dir.join(name))
        .arg("--health")
        .arg(dir.join(format!("{name}.health.json")))
        .arg("--declared")
        .arg(&files.declared)
        .arg("--")
        .arg(example_tool())
        .arg("serve")
        .args(tool_args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let requests = [
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}),
        serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "status-probe/check", "arguments": {"target": target.to_string()}}}),
        serde_json::json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {"name": "status-probe/version", "arguments": {}}}),
    ];
    let mut stdin = child.stdin.take().unwrap();
    for r in requests {
        writeln!(stdin, "{r}").unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Answers come as calls finish, in any order: sorted by id.
    let mut replies: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    replies.sort_by_key(|r| r["id"].as_u64());
    assert_eq!(replies.len(), 3, "{}", text(&out));
    assert_eq!(replies[1]["result"]["isError"], false, "{}", text(&out));
    assert!(
        replies[1]["result"]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("accepted the connection"),
        "{}",
        text(&out)
    );
    out
}

fn sandbox_mcp_gate(who: As) {
    let tool = example_tool();
    let files = example_files();
    if !can_run(
        who,
        &[&common::harness::flowhost_for(who), &tool, &files.manifest],
    ) {
        return;
    }
    let service = TcpSink::start();
    let elsewhere = TcpSink::start_on("127.0.0.2:0");
    let dir = work_dir(who);

    let out = sandbox_mcp(who, dir.path(), "good", service.addr, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let diff = verify_and_diff(who, dir.path(), "good", &files.declared);
    assert_eq!(diff.status.code(), Some(0), "{}", text(&diff));

    let phone_home = elsewhere.addr.to_string();
    let out = sandbox_mcp(
        who,
        dir.path(),
        "bad",
        service.addr,
        &["--phone-home", &phone_home],
    );
    assert_eq!(out.status.code(), Some(GATE_FAILED), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("undeclared_egress") && stderr.contains("status-probe/version"),
        "{}",
        text(&out)
    );
    assert_eq!(
        elsewhere.connections(),
        0,
        "the broker refused the phone-home connections"
    );
    let diff = verify_and_diff(who, dir.path(), "bad", &files.declared);
    assert_eq!(diff.status.code(), Some(1), "{}", text(&diff));
}

#[test]
fn sandbox_mcp_gate_as_root() {
    sandbox_mcp_gate(As::Root);
}

#[test]
fn sandbox_mcp_gate_unprivileged() {
    sandbox_mcp_gate(As::Nobody);
}

#[test]
fn sandbox_mcp_refuses_a_manifest_that_does_not_verify() {
    let who = As::Root;
    if !can_run(who, &[]) {
        return;
    }
    let files = example_files();
    let other_key =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pricing-lab/keys/team-inbox.pub");
    let out = flowhost(who)
        .args(["sandbox", "mcp", "--manifest"])
        .arg(&files.manifest)
        .arg("--key")
        .arg(&other_key)
        .arg("--")
        .arg(example_tool())
        .arg("serve")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("status-probe") && stderr.contains("not admitted"),
        "{}",
        text(&out)
    );
    assert!(out.stdout.is_empty(), "nothing was served: {}", text(&out));
}

#[test]
fn sandbox_mcp_stops_on_sigterm_with_its_records_and_health_written() {
    use std::io::BufRead;
    let who = As::Root;
    if !can_run(who, &[]) {
        return;
    }
    let (files, dir) = (example_files(), work_dir(who));
    let mut child = sandbox_mcp_serving(who, &files, dir.path());
    // The client keeps its end open: only the signal ends the run.
    let mut stdin = child.stdin.take().unwrap();
    writeln!(
        stdin,
        "{}",
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "status-probe/version", "arguments": {}}})
    )
    .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(line.contains("not_initialized"), "{line}");
    // A SIGHUP reloads nothing: the run serves the manifest its policy was derived from.
    // Before, the host read the manifest again, and served a replaced one under it.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = ended_within(
        &mut child,
        20,
        "sandbox mcp did not stop on SIGTERM while its client kept stdin open",
    );
    drop(stdin);
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("SIGHUP ignored"), "{log}");
    assert!(!log.contains("reload"), "{log}");
    let health =
        flowhost::records::ToolObservationHealth::read_from(&dir.path().join("health.json"))
            .unwrap();
    // Stopped before its client was done: what the client would have asked after is not
    // observed (before, the run read as complete, and a gate passed it).
    assert!(!health.complete, "{health:?}");
    assert!(
        health.cut_short.iter().any(|c| c.contains("a signal")),
        "{:?}",
        health.cut_short
    );
    // The refusal before initialize is the one record, and it verifies.
    let records = flowhost::harness::read_records(&dir.path().join("records")).unwrap();
    assert_eq!(records.len(), 1);
    let out = flowhost(who)
        .args(["records", "verify"])
        .arg(dir.path().join("records"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
}

/// `flowhost sandbox mcp` serving the example tool (`files`), as `who`, its records and
/// health in `dir`, with its stdin, stdout and stderr piped.
fn sandbox_mcp_serving(
    who: As,
    files: &common::harness::ExampleFiles,
    dir: &std::path::Path,
) -> std::process::Child {
    flowhost(who)
        .args(["sandbox", "mcp", "--manifest"])
        .arg(&files.manifest)
        .arg("--key")
        .arg(&files.key)
        .arg("--records")
        .arg(dir.join("records"))
        .arg("--health")
        .arg(dir.join("health.json"))
        .arg("--")
        .arg(example_tool())
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// How `child` ended, within `seconds`; killed, and the test failed with `why`, if not.
fn ended_within(
    child: &mut std::process::Child,
    seconds: u64,
    why: &str,
) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{why}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A session that ends other than by the client closing stdin (here the relay fails: the
/// client stopped reading its answers) fails the run, and its health says what was cut
/// short. Before, the health was written complete before the ending was judged, so a later
/// `flowhost diff --health` of the saved files passed a run that exited 2.
#[test]
fn sandbox_mcp_health_says_when_the_session_was_cut_short() {
    let who = As::Root;
    if !can_run(who, &[]) {
        return;
    }
    let (files, dir) = (example_files(), work_dir(who));
    let mut child = sandbox_mcp_serving(who, &files, dir.path());
    // The client stops reading, then asks: its answer cannot be relayed.
    drop(child.stdout.take());
    let mut stdin = child.stdin.take().unwrap();
    for id in 1..=3 {
        let _ = writeln!(
            stdin,
            "{}",
            serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "ping"})
        );
    }
    let status = ended_within(
        &mut child,
        30,
        "sandbox mcp did not end when its client stopped reading",
    );
    drop(stdin);
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
    assert_ne!(status.code(), Some(0), "{log}");
    let health =
        flowhost::records::ToolObservationHealth::read_from(&dir.path().join("health.json"))
            .unwrap();
    assert!(!health.complete, "{health:?}\n{log}");
    assert!(
        health
            .cut_short
            .iter()
            .any(|c| c.contains("relaying the session")),
        "{:?}\n{log}",
        health.cut_short
    );
}

#[test]
fn the_examples_signed_manifest_is_its_manifest_signed_with_its_key() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/harness_tool");
    let out = flowhost(As::Root)
        .args(["manifest", "verify", "--key"])
        .arg(here.join("keys/status-probe.pub"))
        .arg(here.join("manifest.signed.json"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let read = |p: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(here.join(p)).unwrap()).unwrap()
    };
    assert_eq!(
        read("manifest.signed.json")["manifest"],
        read("manifest.json"),
        "manifest.json changed: sign it again with sign.sh"
    );
}

#[test]
fn a_gate_status_of_zero_or_above_255_is_a_usage_error() {
    // A failed gate must never exit 0 (a CI step would pass), and an exit status is 0..=255:
    // both are refused before anything runs.
    let dir = tempfile::tempdir().unwrap();
    let declared = surface_allowing(dir.path(), "127.0.0.1:9".parse().unwrap());
    for status in ["0", "256"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_flowhost"))
            .args(["sandbox", "run", "--profile", "brokered", "--declared"])
            .arg(&declared)
            .args(["--gate-status", status, "--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("--gate-status") && stderr.contains("1..=255"),
            "{}",
            text(&out)
        );
    }
}
