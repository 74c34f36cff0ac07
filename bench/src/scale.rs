//! How the daemon's figures grow with the number of sessions and live executors, and what
//! each costs it in memory.
//!
//! The daemon runs as its own process (`flowhost serve`, release build) so that its resident
//! memory is its own: read from `/proc/<pid>/status` after each step. Sessions are opened
//! and initialized, then left idle; executors are made live by having the first N sessions
//! call once (each session keeps the executor it was given). At each step the median
//! latency of one session's calls (the others idle) and the calls per second of every live
//! session calling at once are measured.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use flowhost::lab::{LabPaths, host_config};
use serde_json::json;

use crate::daemon::{TOOL, connect, ok};
use crate::harness::{Row, Samples, fmt_duration, fmt_rate};
use crate::support::{
    is_root, repo, scratch_dir, shared_copy, shared_documents, target_dir, tcp_sink,
};

/// Session counts measured (cumulative: sessions stay open).
const SESSION_STEPS: [usize; 5] = [1, 16, 64, 128, 256];
/// The host admits at most this many sessions per uid: sessions beyond it are held by a
/// second principal (the lab's reviewer, uid 65533) from a helper process.
const PER_UID: usize = 128;
const SECOND_UID: &str = "65533";
/// Live executor counts measured (cumulative).
const EXECUTOR_STEPS: [usize; 4] = [1, 8, 32, 64];

/// The daemon process, killed when dropped.
struct Daemon {
    child: Child,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Resident memory in KiB.
    fn rss_kib(&self) -> u64 {
        procfs::process::Process::new(self.child.id() as i32)
            .and_then(|p| p.status())
            .ok()
            .and_then(|s| s.vmrss)
            .unwrap_or(0)
    }
}

/// The release `flowhost` binary, rebuilt first when out of date: a binary left over from
/// an older checkout would be measured in place of the code under test.
pub fn flowhost_binary() -> PathBuf {
    crate::support::release_build(&["--bin", "flowhost"], "flowhost");
    target_dir().join("flowhost")
}

fn start_daemon(dir: &Path) -> (Daemon, PathBuf) {
    let lab = repo("fixtures/pricing-lab");
    let paths = LabPaths {
        workspace_command: vec![shared_copy("flowhost-tool-workspace").display().to_string()],
        publisher_command: vec![shared_copy("flowhost-tool-publisher").display().to_string()],
        documents: shared_documents(),
        manifests_dir: lab.clone(),
        keys_dir: lab.join("keys"),
        state_dir: dir.join("state"),
        records_dir: dir.join("records"),
        socket: dir.join("flowhost.sock"),
        team_sink: tcp_sink(),
        public_sink: tcp_sink(),
        exfil_sink: tcp_sink(),
        analyst_uid: 0,
        reviewer_uid: 65533,
        // The second principal's sessions come from another uid.
        socket_mode: "666".into(),
    };
    let config = dir.join("host.toml");
    // The pool refills behind sessions that take an executor; a larger pool only moves
    // spawn time out of the measured calls.
    let mut text = host_config(&paths).replace("pool_size = 2", "pool_size = 8");
    // How often the running daemon checks its flow state against the records (to compare a
    // stop after a long run with and without those checks).
    if let Ok(ms) = std::env::var("FLOWHOST_BENCH_STATE_CHECK_MS") {
        text = text.replacen(
            "call_timeout_ms = ",
            &format!("state_check_interval_ms = {ms}\ncall_timeout_ms = "),
            1,
        );
    }
    std::fs::write(&config, text).expect("write config");
    let mut serve = Command::new(flowhost_binary());
    serve.args(["serve", "--config"]).arg(&config);
    // The runtime's worker threads (`serve --workers`), to compare runtime shapes.
    if let Ok(n) = std::env::var("FLOWHOST_BENCH_WORKERS") {
        serve.args(["--workers", &n]);
    }
    let child = serve
        // The default log level, as an operator runs it: one line per call at `info`.
        .env_remove("FLOWHOST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start flowhost serve");
    let daemon = Daemon { child };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&paths.socket).is_err() {
        assert!(
            Instant::now() < deadline,
            "the daemon did not open its socket"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Let the warm pools fill.
    std::thread::sleep(Duration::from_millis(500));
    (daemon, paths.socket)
}

type Session = crate::daemon::Rpc<
    std::io::BufReader<std::os::unix::net::UnixStream>,
    std::os::unix::net::UnixStream,
>;

/// Starts this binary as uid 65533 holding `n` sessions; returns once they are open.
fn hold_as_second_principal(socket: &Path, n: usize) -> Child {
    let exe = std::env::current_exe().expect("this binary");
    let mut child = Command::new("setpriv")
        .args([
            "--reuid",
            SECOND_UID,
            "--regid",
            SECOND_UID,
            "--clear-groups",
        ])
        .arg(exe)
        .arg("hold-sessions")
        .arg(socket)
        .arg(n.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run setpriv");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("stdout");
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
        .expect("read the holder's answer");
    assert_eq!(line.trim(), "ready", "the session holder failed");
    child
}

/// The helper process: opens `rest[1]` sessions on socket `rest[0]`, says `ready`, and holds
/// them until its input closes.
pub fn hold_sessions(rest: &[String]) {
    let (Some(socket), Some(n)) = (rest.first(), rest.get(1).and_then(|n| n.parse().ok())) else {
        eprintln!("hold-sessions SOCKET N");
        std::process::exit(2);
    };
    let sessions: Vec<Session> = (0..n).map(|_| connect(Path::new(socket))).collect();
    println!("ready");
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
    drop(sessions);
}

/// Median latency of `samples` calls on `session`.
fn call_median(session: &mut Session, samples: usize) -> Duration {
    let params = json!({"name": TOOL, "arguments": {}});
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        let start = Instant::now();
        ok(&session.call("tools/call", params.clone()));
        v.push(start.elapsed());
    }
    Samples(v).median()
}

/// Calls per second with every session in `sessions` calling as fast as it can.
fn rate(sessions: Vec<Session>, window: Duration) -> (f64, Vec<Session>) {
    let stop = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = sessions
        .into_iter()
        .map(|mut s| {
            let (stop, total) = (stop.clone(), total.clone());
            std::thread::spawn(move || {
                let params = json!({"name": TOOL, "arguments": {}});
                while !stop.load(Ordering::Relaxed) {
                    ok(&s.call("tools/call", params.clone()));
                    total.fetch_add(1, Ordering::Relaxed);
                }
                s
            })
        })
        .collect();
    let start = Instant::now();
    std::thread::sleep(window);
    stop.store(true, Ordering::Relaxed);
    let sessions = threads
        .into_iter()
        .map(|t| t.join().expect("caller thread"))
        .collect();
    (
        total.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64(),
        sessions,
    )
}

/// Requests each session keeps in flight in the pipelined throughput run.
const IN_FLIGHT: usize = 4;
/// Sessions in the pipelined throughput run.
const PIPELINED_SESSIONS: usize = 8;

/// Calls per second from `sessions` new sessions, each keeping `depth` calls in flight (a
/// new request as soon as any answer arrives).
fn pipelined_rate(socket: &Path, sessions: usize, depth: usize, window: Duration) -> f64 {
    use std::io::BufRead;
    let stop = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..sessions)
        .map(|_| {
            let session = connect(socket);
            let (stop, total) = (stop.clone(), total.clone());
            std::thread::spawn(move || {
                let (mut reader, mut writer) = (session.reader, session.writer);
                let mut next = 1_000_000u64;
                let mut send = |w: &mut std::os::unix::net::UnixStream| {
                    next += 1;
                    let line = json!({"jsonrpc": "2.0", "id": next, "method": "tools/call",
                        "params": {"name": TOOL, "arguments": {}}});
                    crate::daemon::send_line(w, &line);
                };
                for _ in 0..depth {
                    send(&mut writer);
                }
                let mut outstanding = depth;
                let mut line = String::new();
                while outstanding > 0 {
                    line.clear();
                    reader.read_line(&mut line).expect("read");
                    let v: serde_json::Value = serde_json::from_str(&line).expect("json");
                    if v.get("id").is_none() {
                        continue; // a notification
                    }
                    ok(&v);
                    total.fetch_add(1, Ordering::Relaxed);
                    outstanding -= 1;
                    if !stop.load(Ordering::Relaxed) {
                        send(&mut writer);
                        outstanding += 1;
                    }
                }
            })
        })
        .collect();
    let start = Instant::now();
    std::thread::sleep(window);
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed();
    let done = total.load(Ordering::Relaxed);
    for t in threads {
        t.join().expect("caller thread");
    }
    done as f64 / elapsed.as_secs_f64()
}

/// The profiling driver: starts a daemon process, prints its pid, waits `rest[1]` seconds
/// (default 3, for a profiler to attach), then runs one session's calls one at a time and
/// then 8 sessions x 4 in flight, each for `rest[0]` seconds (default 5), printing calls/s.
pub fn drive(rest: &[String]) {
    let secs = |i: usize, default: u64| {
        Duration::from_secs(rest.get(i).and_then(|s| s.parse().ok()).unwrap_or(default))
    };
    let dir = scratch_dir("drive");
    let (mut daemon, socket) = start_daemon(&dir);
    eprintln!("daemon pid {}", daemon.child.id());
    std::thread::sleep(secs(1, 3));
    let serial = pipelined_rate(&socket, 1, 1, secs(0, 5));
    eprintln!("1 session, serial: {}", fmt_rate(serial));
    let pipelined = pipelined_rate(&socket, PIPELINED_SESSIONS, IN_FLIGHT, secs(0, 5));
    eprintln!(
        "{PIPELINED_SESSIONS} sessions x {IN_FLIGHT} in flight: {}",
        fmt_rate(pipelined)
    );
    // A clean stop checks the flow state against the records written since the last check.
    let stopping = Instant::now();
    // SAFETY: kill(2) on the daemon's pid, which this process spawned and has not reaped.
    if unsafe { libc::kill(daemon.child.id() as i32, libc::SIGTERM) } != 0 {
        eprintln!(
            "clean stop not measured: SIGTERM: {}",
            std::io::Error::last_os_error()
        );
        drop(daemon);
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let status = daemon.child.wait();
    let stopped = stopping.elapsed();
    let records: usize = std::fs::read_dir(dir.join("records"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".jsonl"))
        .filter_map(|e| std::fs::read(e.path()).ok())
        .map(|bytes| bytes.iter().filter(|&&b| b == b'\n').count())
        .sum();
    eprintln!(
        "clean stop after {records} records: {} ({})",
        fmt_duration(stopped),
        status.map_or_else(|e| e.to_string(), |s| s.to_string())
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// Runs the scale measurements.
pub fn run(quick: bool) -> Vec<Row> {
    if !is_root() {
        eprintln!("scale benchmarks skipped: the broker needs root");
        return Vec::new();
    }
    let samples = if quick { 100 } else { 500 };
    let window = if quick {
        Duration::from_millis(700)
    } else {
        Duration::from_secs(2)
    };
    let dir = scratch_dir("scale");
    let (daemon, socket) = start_daemon(&dir);
    let mut rows = Vec::new();

    // Throughput with several requests in flight per session, beside one at a time.
    let serial = pipelined_rate(&socket, PIPELINED_SESSIONS, 1, window);
    let pipelined = pipelined_rate(&socket, PIPELINED_SESSIONS, IN_FLIGHT, window);
    rows.push(Row {
        name: format!(
            "tools/call throughput, {PIPELINED_SESSIONS} sessions x {IN_FLIGHT} requests in flight, 2 cores"
        ),
        flowhost: fmt_rate(pipelined),
        baseline: Some((
            format!("{PIPELINED_SESSIONS} sessions, one request at a time"),
            fmt_rate(serial),
        )),
        comparison: format!("{:.2}x one at a time", pipelined / serial),
        goal: ">= 15,000 calls/s".into(),
        met: pipelined >= 15_000.0,
    });

    // Idle sessions: one caller measured while the rest stay open.
    let rss_empty = daemon.rss_kib();
    let mut sessions: Vec<Session> = Vec::new();
    let mut first: Option<(Duration, u64)> = None;
    let mut before = (0usize, rss_empty);
    let mut held: Option<Child> = None;
    for &n in &SESSION_STEPS {
        while sessions.len() < n.min(PER_UID) {
            sessions.push(connect(&socket));
        }
        if n > PER_UID && held.is_none() {
            held = Some(hold_as_second_principal(&socket, n - PER_UID));
        }
        std::thread::sleep(Duration::from_millis(200));
        let rss = daemon.rss_kib();
        let latency = call_median(&mut sessions[0], samples);
        let per_session =
            rss.saturating_sub(before.1) as f64 * 1024.0 / (n - before.0).max(1) as f64;
        let (base_latency, _) = *first.get_or_insert((latency, rss));
        rows.push(Row {
            name: format!("scale: {n} sessions open (1 calling)"),
            flowhost: format!("{} per call, daemon {}", fmt_duration(latency), mib(rss)),
            baseline: (n > 1).then(|| ("1 session open".into(), fmt_duration(base_latency))),
            comparison: format!(
                "{:.2}x latency; +{:.1} KiB per session opened since the last step",
                latency.as_secs_f64() / base_latency.as_secs_f64(),
                per_session / 1024.0
            ),
            goal: "reported".into(),
            met: true,
        });
        before = (n, rss);
    }

    // Live executors: the first N sessions each hold the executor their calls went to.
    let mut live: Vec<Session> = Vec::new();
    let mut idle = sessions;
    let mut before = (1usize, daemon.rss_kib());
    let mut first_rate: Option<f64> = None;
    for &n in &EXECUTOR_STEPS {
        while live.len() < n {
            let mut s = idle.pop().expect("enough open sessions");
            ok(&s.call("tools/call", json!({"name": TOOL, "arguments": {}})));
            live.push(s);
        }
        std::thread::sleep(Duration::from_millis(300));
        let rss = daemon.rss_kib();
        let per_executor = rss.saturating_sub(before.1) as f64 / (n - before.0).max(1) as f64;
        let (r, back) = rate(live, window);
        live = back;
        let base_rate = *first_rate.get_or_insert(r);
        rows.push(Row {
            name: format!("scale: {n} live executors, {n} sessions calling at once"),
            flowhost: format!("{}, daemon {}", fmt_rate(r), mib(rss)),
            baseline: (n > 1).then(|| ("1 executor".into(), fmt_rate(base_rate))),
            comparison: format!(
                "{:.2}x the rate of one; +{:.0} KiB daemon memory per executor added",
                r / base_rate,
                per_executor
            ),
            goal: "reported".into(),
            met: true,
        });
        before = (n, rss);
    }
    drop(live);
    drop(idle);
    if let Some(mut h) = held {
        let _ = h.kill();
        let _ = h.wait();
    }
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
    rows
}
