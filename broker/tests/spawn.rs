//! Spawning real executors under the real kernel filter.

use std::sync::Arc;
use std::time::Duration;

use flowhost_broker::{Broker, BrokerOptions, Profile, SpawnSpec, StdioMode, WaitStatus};
use tokio::io::AsyncReadExt;

fn broker() -> Option<Broker> {
    match Broker::new(BrokerOptions::default()) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

fn profile(name: &str) -> Arc<Profile> {
    Arc::new(Profile::find(name, &[]).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn true_exits_zero_under_both_profiles() {
    let Some(broker) = broker() else { return };
    for name in ["isolated", "brokered"] {
        let mut spec = SpawnSpec::new(["/bin/true"], profile(name));
        spec.stdout = StdioMode::Null;
        spec.stderr = StdioMode::Null;
        spec.stdin = StdioMode::Null;
        let mut exec = broker
            .spawn(spec)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let status = exec.wait().await.unwrap();
        assert_eq!(status.status, WaitStatus::Exited(0), "{name}");
    }
}

/// Each profile's seccomp program is compiled once (at its startup check), not on every
/// spawn: spawns of the same profile, even parsed afresh each time, share it, and only a
/// profile whose filter inputs differ gets a program of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiles_program_is_compiled_once_for_all_its_spawns() {
    let Some(broker) = broker() else { return };
    let quiet = |profile: Arc<Profile>| {
        let mut spec = SpawnSpec::new(["/bin/true"], profile);
        spec.stdin = StdioMode::Null;
        spec.stdout = StdioMode::Null;
        spec.stderr = StdioMode::Null;
        spec
    };
    broker.check_profile(&profile("brokered")).unwrap();
    assert_eq!(broker.stats().programs_compiled, 1, "compiled at the check");
    for _ in 0..3 {
        let mut exec = broker.spawn(quiet(profile("brokered"))).await.unwrap();
        assert!(exec.wait().await.unwrap().success());
    }
    assert_eq!(
        broker.stats().programs_compiled,
        1,
        "no spawn recompiled it"
    );

    // A profile changed after its program was compiled gets its own, never the stale one.
    let mut stricter = Profile::find("brokered", &[]).unwrap();
    stricter
        .extra_deny
        .push(("listen".into(), libc::SYS_listen));
    let mut exec = broker.spawn(quiet(Arc::new(stricter))).await.unwrap();
    assert!(exec.wait().await.unwrap().success());
    assert_eq!(broker.stats().programs_compiled, 2);
    let mut exec = broker.spawn(quiet(profile("brokered"))).await.unwrap();
    assert!(exec.wait().await.unwrap().success());
    assert_eq!(broker.stats().programs_compiled, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executor_sees_its_own_namespaces_and_identity() {
    let Some(broker) = broker() else { return };
    let mut spec = SpawnSpec::new(
        [
            "/bin/sh",
            "-c",
            "echo pid=$$ uid=$(id -u) host=$(hostname); grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; ls -A /tmp | wc -l",
        ],
        profile("isolated"),
    );
    spec.stdin = StdioMode::Null;
    let mut exec = broker.spawn(spec).await.unwrap();
    let mut out = String::new();
    exec.take_stdout()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    let mut err = String::new();
    exec.take_stderr()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    let status = exec
        .wait_timeout(Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?} {err}");
    println!("{out}\nstderr: {err}");
    assert!(out.contains("pid=1 "), "pid namespace: {out}");
    assert!(out.contains("host=flowhost-executor"), "{out}");
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");
    assert!(out.contains("CapBnd:\t0000000000000000"), "{out}");
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    assert!(out.contains("Seccomp:\t2"), "{out}");
}
