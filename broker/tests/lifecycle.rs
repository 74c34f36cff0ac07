//! Executor lifecycle: reaping, descriptor hygiene, process trees, deadlines, and what
//! happens when supervision itself goes away.

use std::sync::Arc;
use std::time::Duration;

use flowhost_broker::{Broker, BrokerOptions, Profile, SpawnSpec, StdioMode, WaitStatus};

fn broker() -> Option<Broker> {
    match Broker::new(BrokerOptions::default()) {
        Ok(b) => Some(b),
        // SAFETY: geteuid has no preconditions.
        Err(e) if unsafe { libc::geteuid() } != 0 => {
            eprintln!("SKIP: the broker cannot run unprivileged here: {e}");
            None
        }
        Err(e) => panic!("the broker must start as root: {e}"),
    }
}

fn quiet(argv: &[&str], profile: &str) -> SpawnSpec {
    let mut spec = SpawnSpec::new(
        argv.iter().copied(),
        Arc::new(Profile::find(profile, &[]).unwrap()),
    );
    spec.stdin = StdioMode::Null;
    spec.stdout = StdioMode::Null;
    spec.stderr = StdioMode::Null;
    spec
}

fn state_of(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim().chars().next()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_tree_dies_with_the_handle() {
    let Some(b) = broker() else { return };
    let exec = b
        .spawn(quiet(
            &["/bin/sh", "-c", "sleep 600 & sleep 600 & wait"],
            "isolated",
        ))
        .await
        .unwrap();
    let pid = exec.pid();
    let mut descendants = Vec::new();
    for _ in 0..100 {
        descendants = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
            .collect();
        if descendants.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(descendants.len(), 2, "the shell started two sleeps");
    drop(exec);
    for _ in 0..100 {
        if descendants
            .iter()
            .chain([&pid])
            .all(|p| state_of(*p).is_none())
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "processes survived their handle: {:?}",
        descendants
            .iter()
            .map(|p| (p, state_of(*p)))
            .collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wall_clock_limit_kills() {
    let Some(b) = broker() else { return };
    let mut spec = quiet(&["/bin/sleep", "60"], "isolated");
    spec.wall_clock = Some(Duration::from_millis(200));
    let mut exec = b.spawn(spec).await.unwrap();
    let status = exec
        .wait_timeout(Duration::from_secs(10))
        .await
        .unwrap()
        .expect("killed");
    assert_eq!(status.status, WaitStatus::Signaled(libc::SIGKILL));
    assert!(status.timed_out);
    assert_eq!(status.code(), 137);
}

#[test]
fn losing_the_supervisor_kills_the_executor() {
    let Some(b) = broker() else { return };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let exec = runtime
        .block_on(b.spawn(quiet(&["/bin/sleep", "600"], "isolated")))
        .unwrap();
    let pid = exec.pid();
    assert!(
        matches!(state_of(pid), Some('R' | 'S')),
        "running before the runtime goes"
    );
    // Keep the handle from killing it: only the supervisor's loss may.
    std::mem::forget(exec);
    drop(runtime);
    for _ in 0..100 {
        if matches!(state_of(pid), Some('Z') | None) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "executor {pid} kept running without its supervisor: {:?}",
        state_of(pid)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forbidden_environment_and_relative_programs_are_refused() {
    let Some(b) = broker() else { return };
    let mut spec = quiet(&["/bin/true"], "isolated");
    spec.env.push(("LD_PRELOAD".into(), "/tmp/x.so".into()));
    let e = b.spawn(spec).await.unwrap_err().to_string();
    assert!(e.contains("LD_PRELOAD"), "{e}");
    let e = b
        .spawn(quiet(&["true"], "isolated"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("not an absolute path"), "{e}");
    assert_eq!(b.stats().spawned, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_is_scrubbed_to_what_was_asked() {
    let Some(b) = broker() else { return };
    let mut spec = SpawnSpec::new(
        ["/usr/bin/env"],
        Arc::new(Profile::find("isolated", &[]).unwrap()),
    );
    spec.stdin = StdioMode::Null;
    spec.env.push(("TOOL_MODE".into(), "fast".into()));
    let mut exec = b.spawn(spec).await.unwrap();
    let mut out = String::new();
    use tokio::io::AsyncReadExt;
    exec.take_stdout()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    exec.wait().await.unwrap();
    let mut names: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .collect();
    names.sort();
    // HOME and TMPDIR: the executor's private /tmp (runtimes write caches there); no
    // Python user site, whose .pth files would run at start.
    assert_eq!(
        names,
        vec!["HOME", "PATH", "PYTHONNOUSERSITE", "TMPDIR", "TOOL_MODE"],
        "{out}"
    );
    assert!(
        out.contains("HOME=/tmp\n")
            && out.contains("TMPDIR=/tmp\n")
            && out.contains("PYTHONNOUSERSITE=1\n"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exited_executor_is_reaped_even_if_nobody_waits() {
    let Some(b) = broker() else { return };
    let mut exec = b.spawn(quiet(&["/bin/true"], "isolated")).await.unwrap();
    let pid = exec.pid();
    // Nobody calls wait: the supervisor reaps it as soon as it exits.
    for _ in 0..100 {
        if state_of(pid).is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(state_of(pid), None, "left as a zombie");
    for _ in 0..100 {
        if b.stats().exited == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(b.stats().exited, 1, "supervision ended with the executor");
    // The handle still reports how it ended.
    assert_eq!(exec.wait().await.unwrap().status, WaitStatus::Exited(0));
}
