//! Descriptor and process hygiene over many spawns. Alone in its test binary because it
//! counts this process's descriptors and children, which concurrent tests would disturb.

use std::sync::Arc;
use std::time::Duration;

use flowhost_broker::{Broker, BrokerOptions, Profile, SpawnSpec, StdioMode, WaitStatus};

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

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Children of this process that still exist (zombies included), across all threads.
fn children() -> Vec<i32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let list = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        out.extend(
            list.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok()),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_descriptor_leaks_and_no_zombies_over_200_spawns() {
    let b = match Broker::new(BrokerOptions::default()) {
        Ok(b) => b,
        // SAFETY: geteuid has no preconditions.
        Err(e) if unsafe { libc::geteuid() } != 0 => {
            return eprintln!("SKIP: the broker cannot run unprivileged here: {e}");
        }
        Err(e) => panic!("the broker must start as root: {e}"),
    };
    // Warm up: the runtime's and broker's own descriptors exist before counting.
    b.spawn(quiet(&["/bin/true"], "isolated"))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    // Let the warm-up's supervisor task finish and release its descriptors.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = open_fds();
    for i in 0..200 {
        let profile = if i % 2 == 0 { "isolated" } else { "brokered" };
        let mut exec = b.spawn(quiet(&["/bin/true"], profile)).await.unwrap();
        assert_eq!(exec.wait().await.unwrap().status, WaitStatus::Exited(0));
    }
    // Also executors dropped without waiting: the reaper must collect them.
    for _ in 0..20 {
        drop(
            b.spawn(quiet(&["/bin/sleep", "60"], "isolated"))
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(open_fds(), before, "descriptors leaked");
    let left = children();
    assert!(
        left.is_empty(),
        "children left behind (zombies or running): {left:?}"
    );
    let stats = b.stats();
    assert_eq!(stats.spawned, 221);
    assert_eq!(stats.supervisor_failures, 0);
}
