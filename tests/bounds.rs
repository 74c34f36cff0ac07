//! Whole-executor bounds on real processes: memory, tasks and uid are per executor, so one
//! executor's children share its bounds, one executor's fork bomb does not stop another, and
//! unrelated processes of some uid do not count against a sandbox.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{broker, probe_argv};
use flowhost_broker::cgroup::BoundHit;
use flowhost_broker::{Broker, Executor, Profile, SpawnSpec, StdioMode};
use tokio::io::{AsyncBufReadExt, BufReader};

/// The built-in `isolated` profile with its bounds changed by `edit`.
fn profile(edit: impl Fn(&mut flowhost_broker::Limits)) -> Arc<Profile> {
    let mut p = Profile::find("isolated", &[]).unwrap();
    edit(&mut p.limits);
    Arc::new(p)
}

/// Whether this host can enforce the bounds for real (v1 or v2 memory and pids).
fn enforced(b: &Broker, p: &Profile) -> bool {
    let report = b.bounds(p);
    let missing: Vec<_> = report
        .not_in_force()
        .filter(|b| b.field != "limits.cpu_percent")
        .collect();
    if missing.is_empty() {
        return true;
    }
    // Only the memory bound may be missing for that reason: any other still fails below.
    if missing.iter().all(|b| b.field == "limits.memory_mib") && common::swap_uncapped(&report) {
        return false;
    }
    // Root on a host with the v1 controllers mounted (this machine, CI) must enforce them:
    // only a host without them may skip.
    let v1 = ["memory", "pids"]
        .iter()
        .all(|c| std::path::Path::new("/sys/fs/cgroup").join(c).is_dir());
    assert!(
        !(common::is_root() && v1),
        "root with cgroup v1 memory and pids mounted cannot enforce the bounds:\n{report}"
    );
    eprintln!("SKIP: this host cannot enforce whole-executor bounds:\n{report}");
    false
}

async fn spawn(b: &Broker, profile: Arc<Profile>, args: &[&str]) -> Executor {
    let mut spec = SpawnSpec::new(probe_argv(args), profile);
    spec.stdin = StdioMode::Null;
    spec.stderr = StdioMode::Null;
    spec.wall_clock = Some(Duration::from_secs(60));
    b.spawn(spec).await.expect("spawn")
}

/// The first JSON line the executor prints.
async fn first_line(exec: &mut Executor) -> serde_json::Value {
    let out = exec.take_stdout().unwrap();
    let mut lines = BufReader::new(out).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("a result line in time")
        .unwrap()
        .expect("a result line");
    serde_json::from_str(&line).unwrap()
}

fn uid_of(pid: i32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// The executor's cgroup directories (those of flowhost's), read while it runs.
fn cgroups_of(pid: i32) -> Vec<std::path::PathBuf> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("/flowhost-exec-"))
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctl, path) = (parts.next()?, parts.next()?, parts.next()?);
            let unified = std::path::Path::new("/sys/fs/cgroup/unified");
            let mount = match ctl {
                "" if unified.is_dir() => unified.to_path_buf(),
                "" => std::path::PathBuf::from("/sys/fs/cgroup"),
                ctl => std::path::Path::new("/sys/fs/cgroup").join(ctl),
            };
            Some(mount.join(path.trim_start_matches('/')))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_children_cannot_exceed_their_executors_memory_bound() {
    let Some(b) = broker() else { return };
    let p = profile(|l| l.memory = Some(256 << 20));
    if !enforced(&b, &p) {
        return;
    }
    let mut exec = spawn(&b, p, &["hogs", "6", "100"]).await;
    let cgroups = cgroups_of(exec.pid());
    assert!(
        !cgroups.is_empty(),
        "the executor is in no cgroup of its own"
    );
    let r = first_line(&mut exec).await;
    let status = exec.wait().await.unwrap();
    let (held, killed) = (r["held"].as_u64().unwrap(), r["killed"].as_u64().unwrap());
    eprintln!("6 children of 100 MiB under a 256 MiB bound: {held} held at once, {killed} killed");
    assert!(
        held * 100 <= 256,
        "{held} children held 100 MiB each at the same time under a 256 MiB bound: {r}"
    );
    assert_eq!(held + killed, 6, "{r}");
    assert_eq!(status.bound, Some(BoundHit::Memory { limit: 256 << 20 }));
    let said = status.bound_description().unwrap();
    assert!(said.contains("memory bound (256 MiB"), "{said}");
    // The cgroup goes with the executor.
    for _ in 0..200 {
        if cgroups.iter().all(|d| !d.exists()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("executor cgroups outlived it: {cgroups:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_in_one_executor_does_not_stop_another_from_forking() {
    let Some(b) = broker() else { return };
    let p = profile(|l| l.tasks = Some(64));
    if !enforced(&b, &p) {
        return;
    }
    let mut bomb = spawn(&b, p.clone(), &["fork-bomb"]).await;
    let r = first_line(&mut bomb).await;
    let forked = r["forked"].as_u64().unwrap();
    assert!(
        forked < 64,
        "the bomb forked {forked} under a bound of 64 tasks"
    );
    // The other executor stays alive after forking, so its uid can be read.
    let mut other = spawn(&b, p, &["fork", "16", "10000"]).await;
    assert_ne!(
        uid_of(bomb.pid()),
        uid_of(other.pid()),
        "two live executors share a uid"
    );
    let r = first_line(&mut other).await;
    assert_eq!(r["forked"], 16, "the other executor could not fork: {r}");
    other.kill_and_wait(Duration::from_secs(10)).await.unwrap();
    let status = bomb.kill_and_wait(Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        status.and_then(|s| s.bound),
        Some(BoundHit::Tasks { limit: 64 })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrelated_processes_of_some_uid_do_not_count_against_a_sandbox() {
    let Some(b) = broker() else { return };
    let p = profile(|l| l.processes = 8);
    // Unrelated processes of nobody (the executors' shared uid before each got its own),
    // as many as the sandbox's per-uid limit.
    let mut unrelated: Vec<std::process::Child> = (0..8)
        .map(|_| {
            use std::os::unix::process::CommandExt;
            std::process::Command::new("/bin/sleep")
                .arg("30")
                .uid(65534)
                .gid(65534)
                .spawn()
                .unwrap()
        })
        .collect();
    let mut exec = spawn(&b, p, &["fork", "4"]).await;
    let r = first_line(&mut exec).await;
    exec.wait().await.unwrap();
    for c in &mut unrelated {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert_eq!(
        r["forked"], 4,
        "processes of another program counted against the sandbox: {r}"
    );
}

/// A command that uses its whole CPU time is killed by the kernel with SIGKILL (the
/// rlimit's soft and hard limits are one, and a pid namespace's init ignores SIGXCPU
/// anyway): its end is named as that limit's. Before, it read as an unexplained SIGKILL,
/// and a `sandbox run` cut short by it vouched for a complete run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_killed_at_its_cpu_time_limit_is_named() {
    let Some(b) = broker() else { return };
    let p = profile(|l| l.cpu_seconds = 1);
    let mut exec = spawn(&b, p, &["spin", "5000"]).await;
    let status = exec.wait().await.unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    assert_eq!(status.bound, Some(BoundHit::CpuTime { seconds: 1 }));
    let said = status.bound_description().unwrap();
    assert!(said.contains("limits.cpu_seconds"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executors_cpu_bandwidth_is_bounded() {
    let Some(b) = broker() else { return };
    let p = profile(|l| l.cpu_percent = Some(10));
    if b.bounds(&p)
        .not_in_force()
        .any(|x| x.field == "limits.cpu_percent")
    {
        eprintln!("SKIP: no cpu controller here:\n{}", b.bounds(&p));
        return;
    }
    let mut exec = spawn(&b, p, &["spin", "1500"]).await;
    let r = first_line(&mut exec).await;
    exec.wait().await.unwrap();
    let cpu_ms = r["cpu_ms"].as_u64().unwrap();
    eprintln!("1.5 s of spinning under a 10% CPU bound got {cpu_ms} ms of CPU");
    assert!(cpu_ms < 600, "{r}");
}

/// A lab (not started) and a profile directory in it holding the built-in `isolated`
/// profile with a 48 MiB memory bound; `None` (having said why) where bounds cannot be
/// enforced.
fn lab_with_a_48_mib_isolated_profile() -> Option<(common::lab::Lab, std::path::PathBuf)> {
    let lab = common::lab::Lab::prepare()?;
    let b = broker().unwrap();
    if !enforced(&b, &Profile::find("isolated", &[]).unwrap()) {
        return None;
    }
    let profiles = lab.dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/profiles/isolated.toml"
    ))
    .unwrap();
    assert!(text.contains("memory_mib = 4096"));
    std::fs::write(
        profiles.join("isolated.toml"),
        text.replace("memory_mib = 4096", "memory_mib = 48"),
    )
    .unwrap();
    Some((lab, profiles))
}

#[test]
fn a_daemon_executor_killed_by_its_memory_bound_is_named_with_server_and_tool() {
    // The workspace server's profile, overridden with a 48 MiB memory bound, and a
    // document larger than that for read_terms to read into memory.
    let Some((mut lab, profiles)) = lab_with_a_48_mib_isolated_profile() else {
        return;
    };
    let big = lab.paths.documents.join("big.md");
    std::fs::write(&big, vec![b'a'; 100 << 20]).unwrap();
    let config = std::fs::read_to_string(&lab.config).unwrap().replacen(
        "[host]\n",
        &format!(
            "[host]\nprofiles_dir = [{:?}]\n",
            profiles.display().to_string()
        ),
        1,
    );
    lab.write_config(&config);
    lab.spawn();
    let mut client = lab.client();
    client.initialize();
    let r = client.call(
        "workspace/read_terms",
        serde_json::json!({"document": "big.md"}),
    );
    let _ = std::fs::remove_file(&big);
    let text = r["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    eprintln!("tool error: {text}");
    assert_eq!(r["result"]["isError"], true, "{r}");
    assert!(
        text.contains("server \"workspace\"")
            && text.contains("tool \"read_terms\"")
            && text.contains("memory bound (48 MiB"),
        "{text}"
    );
    let log = lab.log();
    assert!(
        log.lines().any(
            |l| l.contains("executor died from the memory bound (48 MiB")
                && l.contains("workspace")
                && l.contains("read_terms")
        ),
        "{log}"
    );
    // The daemon says at start which bounds its servers' executors run under.
    assert!(
        log.contains("limits.memory_mib: 48 MiB per executor (by cgroup"),
        "{log}"
    );
}

/// A bound that kills an executor during a content request (a resource read that takes
/// memory past its bound) is recorded `bound_reached`, as for a tool call, so a test run
/// counts it cut short. Before, the read's failure was recorded as the tool's own error
/// (`tool_error`), and a `sandbox mcp` run whose surface allowed errors passed.
#[test]
fn a_resource_read_killed_by_the_memory_bound_is_recorded_as_a_bound_reached() {
    use flowhost::lab::{conformance_server, host_config};
    let Some((mut lab, profiles)) = lab_with_a_48_mib_isolated_profile() else {
        return;
    };
    let server = conformance_server(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")),
        &common::shared_copy("flowhost-tool-conformance")
            .display()
            .to_string(),
    );
    const AGENT: u32 = 65531;
    lab.write_config(&format!(
        "{}{server}\n[[principal]]\nid = \"agent\"\nuids = [{AGENT}]\ntools = [\"conformance/*\"]\n",
        host_config(&lab.paths).replacen(
            "[host]\n",
            &format!("[host]\nprofiles_dir = [{:?}]\n", profiles.display().to_string()),
            1
        )
    ));
    lab.spawn();
    let mut c = lab.client_as(AGENT);
    c.initialize();
    let r = c.request(
        "resources/read",
        serde_json::json!({"uri": flowhost_example_tools::conformance::EXHAUSTING_URI}),
    );
    let message = r["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("memory bound (48 MiB") && message.contains("resources/read"),
        "{r}"
    );
    let outcomes: Vec<_> = lab
        .records()
        .into_iter()
        .filter(|r| r["flowhost"]["event"] == "content_outcome")
        .collect();
    assert_eq!(outcomes.len(), 1, "{outcomes:#?}");
    assert!(
        outcomes[0].to_string().contains("bound_reached"),
        "{:#}",
        outcomes[0]
    );
}

/// An executor that only sleeps (a single task), quiet.
async fn sleeper(b: &Broker, profile: Arc<Profile>) -> Executor {
    let mut spec = SpawnSpec::new(["/bin/sleep", "30"], profile);
    spec.stdin = StdioMode::Null;
    spec.stdout = StdioMode::Null;
    spec.stderr = StdioMode::Null;
    b.spawn(spec).await.expect("spawn /bin/sleep")
}

/// Thread ids of this (host) process.
fn own_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_is_born_in_its_cgroups_and_the_host_never_stays_in_them() {
    let Some(b) = broker() else { return };
    let p = profile(|l| l.memory = Some(256 << 20));
    if !enforced(&b, &p) {
        return;
    }
    let mut exec = sleeper(&b, p).await;
    let cgroups = cgroups_of(exec.pid());
    // Memory, tasks and CPU: one cgroup each on v1, one on v2.
    assert!(
        !cgroups.is_empty(),
        "the executor is in no cgroup of its own"
    );
    let mine = own_threads();
    for dir in &cgroups {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
        assert_eq!(
            procs.split_whitespace().collect::<Vec<_>>(),
            vec![exec.pid().to_string()],
            "{}: only the executor belongs here",
            dir.display()
        );
        if let Ok(tasks) = std::fs::read_to_string(dir.join("tasks")) {
            assert!(
                tasks
                    .split_whitespace()
                    .all(|t| !mine.iter().any(|m| m == t)),
                "{}: a thread of the host stayed in an executor's cgroup",
                dir.display()
            );
        }
    }
    for t in &mine {
        let cg = std::fs::read_to_string(format!("/proc/self/task/{t}/cgroup")).unwrap_or_default();
        assert!(
            !cg.contains("/flowhost-exec-"),
            "host thread {t} is in an executor cgroup:\n{cg}"
        );
    }
    exec.kill_and_wait(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_bounded_to_one_task_still_starts_and_is_bounded() {
    let Some(b) = broker() else { return };
    let p = profile(|l| l.tasks = Some(1));
    if !enforced(&b, &p) {
        return;
    }
    let mut exec = sleeper(&b, p).await;
    let pids = cgroups_of(exec.pid())
        .into_iter()
        .find(|d| d.join("pids.max").exists())
        .expect("the executor's pids cgroup");
    assert_eq!(
        std::fs::read_to_string(pids.join("pids.max"))
            .unwrap()
            .trim(),
        "1"
    );
    assert_eq!(
        std::fs::read_to_string(pids.join("pids.current"))
            .unwrap()
            .trim(),
        "1"
    );
    exec.kill_and_wait(Duration::from_secs(10)).await.unwrap();
}
