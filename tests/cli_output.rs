//! A command whose result cannot be written (a closed pipe, a terminal that hung up) fails
//! with its own error and exit status 2, never a panic (exit 101). A note on stderr beside a
//! result ("wrote FILE") that cannot be written is lost, and the command's status stays.

use std::process::{Command, Output, Stdio};

fn fixture(rel: &str) -> String {
    format!("{}/fixtures/{rel}", env!("CARGO_MANIFEST_DIR"))
}

/// The write end of a pipe whose read end is already closed: every write fails with EPIPE.
/// (Close-on-exec, so a child the other test spawns meanwhile cannot hold the read end.)
fn closed_pipe() -> Stdio {
    let (read, write) = std::io::pipe().unwrap();
    drop(read);
    Stdio::from(write)
}

/// Runs flowhost with `args`, its stdout (or stderr) a pipe nobody reads.
fn run(args: &[&str], closed_stdout: bool) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flowhost"));
    c.args(args).stdin(Stdio::null());
    if closed_stdout {
        c.stdout(closed_pipe()).stderr(Stdio::piped());
    } else {
        c.stdout(Stdio::piped()).stderr(closed_pipe());
    }
    c.output().expect("run flowhost")
}

fn assert_output_refused(what: &str, out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
    assert!(
        stderr.contains("cannot write the result to standard output"),
        "{what}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
}

#[test]
fn a_result_stdout_refuses_is_an_error_not_a_panic() {
    let keys = tempfile::tempdir().unwrap();
    let keys = keys.path().to_str().unwrap();
    let (declared, observed, profile) = (
        fixture("declared/declared_prod_allowlist.json"),
        fixture("observed/denied.jsonl"),
        fixture("../profiles/brokered.toml"),
    );
    let diff = ["diff", "--declared", &declared, "--observed", &observed];
    let commands: [(&str, Vec<&str>); 3] = [
        ("key generate", vec!["key", "generate", "--out", keys]),
        ("diff", diff.to_vec()),
        ("profile check", vec!["profile", "check", &profile]),
    ];
    for (what, args) in commands {
        let out = run(&args, true);
        assert_output_refused(what, &out);
        // Nothing was wrong with the input: only the output failed.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("invalid"), "{what}: {stderr}");
    }
}

#[test]
fn a_note_stderr_refuses_leaves_the_result_and_the_status() {
    let keys = tempfile::tempdir().unwrap();
    let out = run(
        &["key", "generate", "--out", keys.path().to_str().unwrap()],
        false,
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let public = String::from_utf8(out.stdout).unwrap();
    assert_eq!(public.trim().len(), 64, "{public}");
    assert!(keys.path().join("signing.key").exists());
}

/// `reload --pid` names one process: 0 signalled the caller's own process group, -1 (as
/// root) every process; and a timeout too long to count panicked after the signal was
/// sent. Each is refused before anything is signalled.
#[test]
fn reload_refuses_a_pid_that_is_no_single_daemon_and_a_timeout_it_cannot_count() {
    for args in [
        vec!["--pid", "0"],
        vec!["--pid=-1"],
        vec!["--pid", "2", "--timeout", "18446744073709551615"],
        vec!["--pid", "2", "--timeout", "0"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_flowhost"))
            .arg("reload")
            .args(&args)
            .args(["--state-dir", "/nonexistent"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("invalid value"), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // Pid 1 only when it is a flowhost daemon (a container's init); here it is not, and
    // SIGHUP would have told init to reload its own configuration.
    let out = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["reload", "--pid", "1", "--state-dir", "/nonexistent"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not a flowhost daemon"), "{stderr}");
}
