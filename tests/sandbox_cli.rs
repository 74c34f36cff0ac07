//! `flowhost sandbox run` and `flowhost profile check` as an operator uses them.

mod common;

use std::process::Command;

use common::{TcpSink, is_root, shared_copy};

fn flowhost() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowhost"))
}

/// Whether the broker can run here; prints why not (never skips as root).
fn can_run() -> bool {
    if is_root() {
        return true;
    }
    eprintln!("SKIP: sandbox CLI tests need root (CI runs them as root)");
    false
}

#[test]
fn refused_by_default_allowed_with_allow_and_recorded() {
    if !can_run() {
        return;
    }
    let sink = TcpSink::start();
    let probe = shared_copy("flowhost-probe");
    let out = flowhost()
        .args(["sandbox", "run", "--profile", "brokered", "--"])
        .arg(&probe)
        .args(["connect", &sink.addr.to_string(), "nope"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("\"errno\":13"), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("connect inet/stream/tcp {} by pid", sink.addr)),
        "{stderr}"
    );
    assert!(stderr.contains("REFUSED (default)"), "{stderr}");

    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("attempts.jsonl");
    let out = flowhost()
        .args(["sandbox", "run", "--profile", "brokered", "--allow"])
        .arg(sink.addr.to_string())
        .arg("--records")
        .arg(&records)
        .arg("--")
        .arg(&probe)
        .args(["connect", &sink.addr.to_string(), "allowed-bytes"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"result\":\"ok\""));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&records)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["decision"], "allow");
    assert_eq!(lines[0]["destination"], sink.addr.to_string());
    assert_eq!(lines[0]["rule"], format!("allow {}", sink.addr));
    for _ in 0..50 {
        if sink.bytes() == b"allowed-bytes" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(sink.bytes(), b"allowed-bytes");
    assert_eq!(sink.connections(), 1, "only the allowed run connected");
}

#[test]
fn exit_status_is_the_commands_and_128_plus_signal() {
    if !can_run() {
        return;
    }
    let out = flowhost()
        .args([
            "sandbox",
            "run",
            "--profile",
            "isolated",
            "--",
            "/bin/sh",
            "-c",
            "exit 7",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let out = flowhost()
        .args(["sandbox", "run", "--profile", "isolated", "--"])
        .arg(shared_copy("flowhost-probe"))
        .arg("x32-socket")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGSYS),
        "killed by the filter: {out:?}"
    );
}

#[test]
fn a_process_already_under_a_notify_listener_is_refused() {
    if !can_run() {
        return;
    }
    let out = Command::new(shared_copy("flowhost-probe"))
        .arg("under-listener")
        .arg(env!("CARGO_BIN_EXE_flowhost"))
        .args(["sandbox", "run", "--profile", "isolated", "--", "/bin/true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("Device or resource busy"), "{stderr}");
    assert!(
        stderr.contains("already supervised by another seccomp notify listener"),
        "{stderr}"
    );
}

#[test]
fn profile_check_names_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/profiles/isolated.toml"),
        &good,
    )
    .unwrap();
    let out = flowhost()
        .args(["profile", "check"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("is valid"));

    let bad = dir.path().join("bad.toml");
    let text = std::fs::read_to_string(&good)
        .unwrap()
        .replace("path = \"none\"", "path = \"sometimes\"");
    std::fs::write(&bad, text).unwrap();
    let out = flowhost()
        .args(["profile", "check"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.toml") && stderr.contains("path"),
        "{stderr}"
    );
}
