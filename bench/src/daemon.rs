//! tools/call through the daemon (warm executors, durable record, flow state) side by side
//! with a direct MCP stdio call to the same executor binary, and calls per second with 8
//! concurrent sessions; then the same with the flow state on a PostgreSQL server started
//! here on loopback (a fleet's shared state), beside the SQLite figures of the same run.
//!
//! The daemon runs in this process (the real host: registry, broker, resolver, record
//! writer, executor pools); clients talk to it over its Unix socket like any MCP client.
//! Records and state go to a directory on the real disk (under `target/`), not a tmpfs.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use flowhost::daemon::{Host, run as run_host};
use flowhost::lab::{LabPaths, host_config};
use serde_json::{Value, json};

use crate::harness::{Row, Samples, fmt_duration, fmt_rate};
use crate::support::{is_root, repo, scratch_dir, shared_copy, tcp_sink};

/// A line-oriented JSON-RPC client over any reader/writer pair.
pub(crate) struct Rpc<R, W> {
    pub(crate) reader: R,
    pub(crate) writer: W,
    next: u64,
    line: String,
}

impl<R: BufRead, W: Write> Rpc<R, W> {
    pub(crate) fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next;
        self.next += 1;
        send_line(
            &mut self.writer,
            &json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
        );
        loop {
            self.line.clear();
            self.reader.read_line(&mut self.line).expect("read");
            let v: Value = serde_json::from_str(&self.line).expect("json");
            if v.get("id") == Some(&json!(id)) {
                return v;
            }
        }
    }

    fn initialize(&mut self) {
        let r = self.call("initialize", json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}}));
        assert!(r.get("result").is_some(), "initialize: {r}");
        let notification = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        send_line(&mut self.writer, &notification);
    }
}

/// Sends `message` as one line in one write, as MCP clients do. (Formatting a `Value`
/// straight into an unbuffered stream issues one `write` per JSON token, which would make
/// every reader, the daemon or the executor called directly, wake once per fragment.)
pub(crate) fn send_line(writer: &mut impl Write, message: &Value) {
    let mut line = serde_json::to_vec(message).expect("serialize");
    line.push(b'\n');
    writer.write_all(&line).expect("write");
    writer.flush().expect("flush");
}

pub(crate) fn connect(socket: &Path) -> Rpc<BufReader<UnixStream>, UnixStream> {
    let s = UnixStream::connect(socket).expect("connect to the daemon");
    let mut rpc = Rpc {
        reader: BufReader::new(s.try_clone().expect("clone")),
        writer: s,
        next: 1,
        line: String::new(),
    };
    rpc.initialize();
    rpc
}

pub(crate) const TOOL: &str = "workspace/list_documents";

pub(crate) fn ok(r: &Value) {
    assert!(
        r.get("result").is_some() && r["result"]["isError"] != true,
        "call failed: {r}"
    );
}

/// What one daemon configuration measured.
struct Measured {
    /// Median tools/call through the daemon.
    through: Duration,
    /// Median tools/call through the daemon over Streamable HTTP (loopback, keep-alive).
    over_http: Duration,
    /// Median direct call to the same executor.
    direct: Duration,
    /// Median append + `fdatasync` of one record-sized line on the records' disk.
    fdatasync: Duration,
    /// Median overwrite of one record-sized line in a file written in full before, +
    /// `fdatasync`, on the same disk: the write-ahead ring's own I/O, the floor below the
    /// append.
    overwrite: Duration,
    /// Calls per second with concurrent sessions.
    rate: f64,
}

/// Concurrent sessions in the throughput run.
const SESSIONS: usize = 8;
/// About the size of a call's authorization record.
const RECORD_LINE_BYTES: usize = 1100;

/// Runs the daemon benchmarks: with the embedded SQLite flow state, then (where a
/// PostgreSQL server can be started here) with the flow state on PostgreSQL, same workload.
pub fn run(quick: bool) -> Vec<Row> {
    if !is_root() {
        eprintln!("daemon benchmarks skipped: the broker needs root");
        return Vec::new();
    }
    let samples = if quick { 300 } else { 3000 };
    let sqlite = measure(quick, samples, "daemon", None);
    let mut rows = vec![
        Row {
            name: format!(
                "tools/call, warm executor, durable record and state (median of {samples})"
            ),
            flowhost: fmt_duration(sqlite.through),
            baseline: Some((
                "direct MCP stdio call, same executor".into(),
                fmt_duration(sqlite.direct),
            )),
            comparison: format!("+{} per call", fmt_duration(sqlite.added())),
            goal: "<= 0.5 ms added".into(),
            met: sqlite.added() <= Duration::from_micros(500),
        },
        Row {
            name: "tools/call added latency against one durable write (interleaved)".into(),
            flowhost: format!("+{}", fmt_duration(sqlite.added())),
            baseline: Some((
                format!("append {RECORD_LINE_BYTES} B + fdatasync, same disk"),
                fmt_duration(sqlite.fdatasync),
            )),
            comparison: format!("{:.2}x one fdatasync", sqlite.floor_ratio()),
            goal: "<= 1.7x".into(),
            met: sqlite.floor_ratio() <= 1.7,
        },
        Row {
            name: "tools/call added latency against the ring's own write (interleaved)".into(),
            flowhost: format!("+{}", fmt_duration(sqlite.added())),
            baseline: Some((
                format!("overwrite {RECORD_LINE_BYTES} B of a written file + fdatasync, same disk"),
                fmt_duration(sqlite.overwrite),
            )),
            comparison: format!(
                "{:.2}x that write",
                sqlite.added().as_secs_f64() / sqlite.overwrite.as_secs_f64().max(1e-9)
            ),
            goal: "reported".into(),
            met: true,
        },
        Row {
            name: format!(
                "tools/call over Streamable HTTP (loopback, bearer token, keep-alive; median of {samples})"
            ),
            flowhost: fmt_duration(sqlite.over_http),
            baseline: Some((
                "the same call on the Unix socket, interleaved".into(),
                fmt_duration(sqlite.through),
            )),
            comparison: format!(
                "+{} per call over the socket",
                fmt_duration(sqlite.over_http.saturating_sub(sqlite.through))
            ),
            goal: "<= 0.5 ms added".into(),
            met: sqlite.over_http.saturating_sub(sqlite.through) <= Duration::from_micros(500),
        },
        Row {
            name: format!("tools/call throughput, {SESSIONS} concurrent sessions, 2 cores"),
            flowhost: fmt_rate(sqlite.rate),
            baseline: None,
            comparison: format!("{:.1}x the goal", sqlite.rate / 2000.0),
            goal: ">= 2,000 calls/s".into(),
            met: sqlite.rate >= 2000.0,
        },
    ];
    // What the call's one sync costs the disk, beside the baseline above.
    rows.extend(crate::records::reserved_blocks(if quick {
        500
    } else {
        3000
    }));
    let pg = match flowhost::lab::postgres::Postgres::start() {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("PostgreSQL flow-state benchmarks skipped: {e}");
            return rows;
        }
    };
    let pg_config = pg.settings("bench");
    let migrated = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(flowhost::state::postgres::migrate(&pg_config));
    if let Err(e) = migrated {
        panic!("migrating the benchmark database: {e}");
    }
    let shared = measure(
        quick,
        samples,
        "daemon-pg",
        Some(&pg.state_setting("bench")),
    );
    rows.push(Row {
        name: format!(
            "tools/call, flow state on PostgreSQL (loopback), durable record (median of {samples})"
        ),
        flowhost: fmt_duration(shared.through),
        baseline: Some((
            "the same call, flow state on SQLite".into(),
            fmt_duration(sqlite.through),
        )),
        comparison: format!(
            "+{} per call over the direct call (SQLite: +{})",
            fmt_duration(shared.added()),
            fmt_duration(sqlite.added())
        ),
        goal: "<= 2 ms added".into(),
        met: shared.added() <= Duration::from_millis(2),
    });
    rows.push(Row {
        name: format!(
            "tools/call throughput, flow state on PostgreSQL, {SESSIONS} concurrent sessions"
        ),
        flowhost: fmt_rate(shared.rate),
        baseline: Some((
            "the same, flow state on SQLite".into(),
            fmt_rate(sqlite.rate),
        )),
        comparison: format!("{:.2}x SQLite", shared.rate / sqlite.rate),
        goal: ">= 1,000 calls/s".into(),
        met: shared.rate >= 1000.0,
    });
    rows
}

impl Measured {
    fn added(&self) -> Duration {
        self.through.saturating_sub(self.direct)
    }

    /// Added latency in units of one durable write.
    fn floor_ratio(&self) -> f64 {
        self.added().as_secs_f64() / self.fdatasync.as_secs_f64().max(1e-9)
    }
}

/// One daemon in this process, `state` (a `[host] state` setting) or the default SQLite
/// state, measured against the direct call and under concurrent sessions.
fn measure(quick: bool, samples: usize, name: &str, state: Option<&str>) -> Measured {
    let dir = scratch_dir(name);
    let workspace_tool = shared_copy("flowhost-tool-workspace");
    let documents = crate::support::shared_documents();
    let (team, public, exfil) = (tcp_sink(), tcp_sink(), tcp_sink());
    let lab = repo("fixtures/pricing-lab");
    let paths = LabPaths {
        workspace_command: vec![workspace_tool.display().to_string()],
        publisher_command: vec![shared_copy("flowhost-tool-publisher").display().to_string()],
        documents: documents.clone(),
        manifests_dir: lab.clone(),
        keys_dir: lab.join("keys"),
        state_dir: dir.join("state"),
        records_dir: dir.join("records"),
        socket: dir.join("flowhost.sock"),
        team_sink: team,
        public_sink: public,
        exfil_sink: exfil,
        analyst_uid: 0,
        reviewer_uid: 65533,
        socket_mode: "600".into(),
    };
    // Enough warm executors that 8 new sessions never wait for a spawn.
    let mut config_text = host_config(&paths).replace("pool_size = 2", "pool_size = 10");
    let http_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port");
    config_text.push_str(&crate::http::http_table(http_addr, "larkfield-analyst"));
    if let Some(state) = state {
        config_text = flowhost::lab::postgres::with_host_setting(&config_text, state);
    }
    let config = dir.join("host.toml");
    std::fs::write(&config, config_text).expect("write config");

    // The runtime `flowhost serve` builds (FLOWHOST_BENCH_WORKERS: another worker count).
    let workers = std::env::var("FLOWHOST_BENCH_WORKERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(flowhost::daemon::default_workers);
    let runtime = flowhost::daemon::serve_runtime(workers).expect("runtime");
    let (host, listener) = runtime
        .block_on(Host::start(&config, None))
        .unwrap_or_else(|e| panic!("the daemon did not start: {e}"));
    // A thread drives the runtime, as `flowhost serve`'s main thread does (a current-thread
    // runtime runs its tasks only while it is driven), until the host has stopped or 10 s
    // after it was told to stop; the runtime is then shut down, waiting at most 5 s more.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let driver = {
        let host = host.clone();
        std::thread::spawn(move || {
            runtime.block_on(async {
                tokio::select! {
                    _ = run_host(host, listener) => {}
                    _ = async {
                        let _ = stop_rx.await;
                        tokio::time::sleep(Duration::from_secs(10)).await;
                    } => {}
                }
            });
            // A plain drop would wait for blocking work without bound.
            runtime.shutdown_timeout(Duration::from_secs(5));
        })
    };
    std::thread::sleep(Duration::from_millis(500)); // let the warm pools fill

    // Direct: the same executor binary as a plain child process, MCP over its stdio.
    let mut child = Command::new(&workspace_tool)
        .args(["--documents", &documents.display().to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the executor directly");
    let mut direct = Rpc {
        reader: BufReader::new(child.stdout.take().expect("stdout")),
        writer: child.stdin.take().expect("stdin"),
        next: 1,
        line: String::new(),
    };
    direct.initialize();
    let mut through = connect(&paths.socket);
    let mut over_http = crate::http::HttpRpc::connect(http_addr);
    let params = json!({"name": "list_documents", "arguments": {}});
    let daemon_params = json!({"name": TOOL, "arguments": {}});
    for _ in 0..200 {
        ok(&direct.call("tools/call", params.clone()));
        ok(&through.call("tools/call", daemon_params.clone()));
        ok(&over_http.call("tools/call", daemon_params.clone()));
    }
    // The floor of a durable call: one append of a record-sized line and its fdatasync, on
    // the disk the records go to, interleaved with the calls so both see the same machine.
    let mut floor_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("fdatasync-baseline.jsonl"))
        .expect("open the fdatasync baseline file");
    let record_line = vec![b'x'; RECORD_LINE_BYTES];
    // The ring's floor: a file written in full first, then overwritten line by line.
    const PREWRITTEN: usize = 1 << 20;
    let prewritten_path = dir.join("overwrite-baseline.bin");
    std::fs::write(&prewritten_path, vec![0u8; PREWRITTEN]).expect("write the overwrite baseline");
    let prewritten = std::fs::OpenOptions::new()
        .write(true)
        .open(&prewritten_path)
        .expect("open the overwrite baseline");
    prewritten.sync_all().expect("sync the overwrite baseline");
    let (mut d, mut t, mut f, mut h, mut o) = (
        Vec::with_capacity(samples),
        Vec::with_capacity(samples),
        Vec::with_capacity(samples),
        Vec::with_capacity(samples),
        Vec::with_capacity(samples),
    );
    for _ in 0..samples {
        let start = Instant::now();
        ok(&direct.call("tools/call", params.clone()));
        d.push(start.elapsed());
        let start = Instant::now();
        ok(&through.call("tools/call", daemon_params.clone()));
        t.push(start.elapsed());
        let start = Instant::now();
        ok(&over_http.call("tools/call", daemon_params.clone()));
        h.push(start.elapsed());
        let start = Instant::now();
        floor_file.write_all(&record_line).expect("append");
        floor_file.sync_data().expect("fdatasync");
        f.push(start.elapsed());
        let at = (o.len() * RECORD_LINE_BYTES) % (PREWRITTEN - RECORD_LINE_BYTES);
        let start = Instant::now();
        std::os::unix::fs::FileExt::write_all_at(&prewritten, &record_line, at as u64)
            .expect("overwrite");
        prewritten.sync_data().expect("fdatasync");
        o.push(start.elapsed());
    }
    let (d, t, f, h, o) = (
        Samples(d).median(),
        Samples(t).median(),
        Samples(f).median(),
        Samples(h).median(),
        Samples(o).median(),
    );
    drop(over_http);
    drop(direct);
    let _ = child.kill();
    let _ = child.wait();

    // Throughput: sessions calling as fast as they can for a fixed time.
    let duration = if quick {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(6)
    };
    let stop = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for _ in 0..SESSIONS {
        let (socket, stop, total, params) = (
            paths.socket.clone(),
            stop.clone(),
            total.clone(),
            daemon_params.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let mut c = connect(&socket);
            ok(&c.call("tools/call", params.clone()));
            while !stop.load(Ordering::Relaxed) {
                ok(&c.call("tools/call", params.clone()));
                total.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let start = Instant::now();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    for th in threads {
        th.join().expect("session thread");
    }
    let rate = total.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();

    host.begin_shutdown();
    let _ = stop_tx.send(());
    // Joined before the scratch directory goes: the runtime's tasks are done with it.
    let _ = driver.join();
    drop(through);
    // The records and state of every run would otherwise pile up under target/.
    let _ = std::fs::remove_dir_all(&dir);
    Measured {
        through: t,
        over_http: h,
        direct: d,
        fdatasync: f,
        overwrite: o,
        rate,
    }
}
