//! Runtimes that start under the broker's built-in profiles: a writable HOME and TMPDIR of
//! the executor's own, no egress attempt for glibc's nscd socket on a name lookup, and a
//! daemon that refuses to start a server whose program an executor cannot run, naming the
//! server, the path and the cause.

mod common;

use std::process::Command;

use flowhost_broker::Verdict;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executors_get_a_writable_home_and_tmpdir_of_their_own() {
    let Some(broker) = common::broker() else {
        return;
    };
    let script =
        r#"echo "home=$HOME tmpdir=$TMPDIR"; touch "$HOME/.written" "$TMPDIR/t" && echo wrote"#;
    for profile in ["isolated", "brokered"] {
        let run = common::run_with(
            &broker,
            profile,
            vec!["/bin/sh".into(), "-c".into(), script.into()],
            |_| Verdict::DENY,
        )
        .await;
        assert!(
            run.stdout.contains("home=/tmp tmpdir=/tmp") && run.stdout.contains("wrote"),
            "{profile}: {run:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libc_lookup_makes_no_nscd_attempt() {
    let Some(broker) = common::broker() else {
        return;
    };
    if !std::path::Path::new("/usr/bin/getent").exists() {
        eprintln!("SKIP: getent (libc-bin) is not installed");
        return;
    }
    // glibc connects to nscd's socket before resolving; every other attempt is refused.
    let run = common::run_with(
        &broker,
        "isolated",
        vec![
            "/usr/bin/getent".into(),
            "hosts".into(),
            "lookup.invalid".into(),
        ],
        |_| Verdict::DENY,
    )
    .await;
    let nscd: Vec<_> = run
        .attempts
        .iter()
        .filter(|(a, _)| {
            a.destination
                .as_ref()
                .is_some_and(|d| d.to_string().contains("nscd"))
        })
        .collect();
    assert!(nscd.is_empty(), "{nscd:?}");
    assert!(
        !run.attempts.is_empty(),
        "the DNS query itself is still an attempt: {run:?}"
    );
}

#[test]
fn the_daemon_names_the_server_path_and_cause_of_a_program_under_tmp() {
    if !common::is_root() {
        eprintln!("SKIP: the daemon tests need root for the broker (CI runs them as root)");
        return;
    }
    let Some(mut lab) = common::lab::Lab::prepare() else {
        return;
    };
    let config = std::fs::read_to_string(&lab.config).unwrap();
    let workspace = lab.paths.workspace_command[0].clone();
    let under_tmp = "/tmp/flowhost-venv/bin/workspace";
    lab.write_config(&config.replacen(&workspace, under_tmp, 1));
    let out = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["serve", "--config"])
        .arg(&lab.config)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("\"workspace\"") && err.contains(under_tmp) && err.contains("private"),
        "{err}"
    );
    lab.kill9();
}
