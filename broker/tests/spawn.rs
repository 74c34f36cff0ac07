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
