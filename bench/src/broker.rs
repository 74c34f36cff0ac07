//! Broker benchmarks, each side by side with its peer in the same run:
//! (a) spawn-to-exit of `/bin/true` under `isolated` and `brokered` vs bubblewrap;
//! (b) loopback TCP connect+close, brokered vs no broker;
//! (c) unconnected UDP sendto, brokered vs no broker;
//! each beside sandlock (see [`crate::broker_peer`]) when it is installed, and the
//! per-notification parts of (b) and (c) (see [`crate::broker_parts`]); and (d) `flowhost
//! sandbox run -- /bin/true` as a whole process beside bwrap and the floor (see [`Floor`]).
//!
//! The connect and sendto loops run in a child process (this binary, in `loop-*` mode) that
//! times each operation itself and prints its median, so process start-up is not counted.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flowhost_broker::{
    AttemptInfo, Broker, BrokerOptions, Judge, NetworkPath, Profile, SpawnSpec, StdioMode, Verdict,
};
use tokio::io::AsyncReadExt;

use crate::broker_peer::Sandlock;
use crate::harness::{Row, Samples, fmt_duration};

const BWRAP_ARGS: &[&str] = &[
    "--unshare-all",
    "--die-with-parent",
    "--ro-bind",
    "/",
    "/",
    "/bin/true",
];

/// The floor of a whole-process sandbox run: util-linux `unshare` creating the namespaces
/// the `isolated` profile gives an executor (the same set, read from the profile), then
/// exec'ing `/bin/true` in them. A small C program and no confinement beyond the namespaces:
/// no process that creates these namespaces afresh and runs a command can do less.
struct Floor {
    args: Vec<&'static str>,
}

impl Floor {
    /// The floor's command for the `isolated` profile, if `unshare` runs here (else says
    /// why there is no floor row).
    fn find() -> Option<Floor> {
        let isolated = profile("isolated");
        let mut args = Vec::new();
        for (on, flag) in [
            (isolated.mount_namespace, "--mount"),
            (isolated.uts_namespace, "--uts"),
            (isolated.ipc_namespace, "--ipc"),
            (isolated.network == NetworkPath::None, "--net"),
            (isolated.pid_namespace, "--pid"),
        ] {
            if on {
                args.push(flag);
            }
        }
        if isolated.pid_namespace {
            // The command is the new pid namespace's first process, as an executor is.
            args.push("--fork");
        }
        args.push("/bin/true");
        let floor = Floor { args };
        match floor.once() {
            Some(_) => Some(floor),
            None => {
                eprintln!(
                    "`unshare {}` does not run here (util-linux; needs root): no floor row",
                    floor.args.join(" ")
                );
                None
            }
        }
    }

    /// The command line, for the table.
    fn describe(&self) -> String {
        format!("unshare {}", self.args.join(" "))
    }

    /// One whole-process run.
    fn once(&self) -> Option<Duration> {
        time_whole("unshare", &self.args)
    }
}

/// One run of `program args` as a whole process, stdio to /dev/null: how long until it
/// exited, if it succeeded.
fn time_whole(program: &str, args: &[&str]) -> Option<Duration> {
    let start = Instant::now();
    let status = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    status.success().then(|| start.elapsed())
}

fn profile(name: &str) -> Arc<Profile> {
    Arc::new(Profile::find(name, &[]).expect("built-in profile"))
}

fn quiet(argv: Vec<String>, profile_name: &str) -> SpawnSpec {
    let mut spec = SpawnSpec::new(argv, profile(profile_name));
    spec.stdin = StdioMode::Null;
    spec.stdout = StdioMode::Null;
    spec.stderr = StdioMode::Null;
    spec
}

async fn spawn_once(broker: &Broker, profile_name: &str) -> Duration {
    let start = Instant::now();
    let mut exec = broker
        .spawn(quiet(vec!["/bin/true".into()], profile_name))
        .await
        .expect("spawn /bin/true");
    let status = exec.wait().await.expect("wait");
    let elapsed = start.elapsed();
    assert!(status.success());
    elapsed
}

fn bwrap_once() -> Option<Duration> {
    time_whole("bwrap", BWRAP_ARGS)
}

/// The runtime and broker the broker suite runs on; `None` (with the reason printed) when
/// the broker cannot run here.
fn setup() -> Option<(tokio::runtime::Runtime, Broker)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match Broker::new(BrokerOptions::default()) {
        Ok(b) => Some((runtime, b)),
        Err(e) => {
            eprintln!("broker benchmarks skipped: {e}");
            None
        }
    }
}

/// Runs every broker benchmark.
pub fn run(quick: bool) -> Vec<Row> {
    let Some((runtime, broker)) = setup() else {
        return Vec::new();
    };
    let sandlock = Sandlock::find();
    let mut rows = spawn_rows(
        &runtime,
        &broker,
        if quick { 20 } else { 300 },
        sandlock.as_ref(),
    );
    rows.extend(loops_and_parts(&runtime, &broker, quick, sandlock.as_ref()));
    rows
}

/// Only the connect and sendto loops and their per-notification parts (the hidden
/// `broker-loops` suite, for work on the notification path).
pub fn run_loops(quick: bool) -> Vec<Row> {
    let Some((runtime, broker)) = setup() else {
        return Vec::new();
    };
    loops_and_parts(&runtime, &broker, quick, Sandlock::find().as_ref())
}

fn loops_and_parts(
    runtime: &tokio::runtime::Runtime,
    broker: &Broker,
    quick: bool,
    sandlock: Option<&Sandlock>,
) -> Vec<Row> {
    let iterations = if quick { 300 } else { 3000 };
    let rounds = if quick { 3 } else { 7 };
    let mut rows = Vec::new();
    let mut added = Vec::new();
    for kind in ["connect", "sendto", "unix-connect", "unix-sendto"] {
        let (loop_rows, by_broker) = loop_rows(runtime, broker, kind, iterations, rounds, sandlock);
        rows.extend(loop_rows);
        // The per-notification parts are the IP loops'.
        if !kind.starts_with("unix-") {
            added.push((kind, by_broker));
        }
    }
    rows.extend(crate::broker_parts::run(
        runtime,
        if quick { 2_000 } else { 20_000 },
        &added,
    ));
    rows
}

fn spawn_rows(
    runtime: &tokio::runtime::Runtime,
    broker: &Broker,
    samples: usize,
    sandlock: Option<&Sandlock>,
) -> Vec<Row> {
    let bwrap_ok = bwrap_once().is_some();
    if !bwrap_ok {
        eprintln!(
            "bubblewrap is not installed (apt-get install bubblewrap): spawn has no peer figure"
        );
    }
    // Warm up both paths (page cache, first netns).
    for _ in 0..5 {
        runtime.block_on(spawn_once(broker, "isolated"));
        runtime.block_on(spawn_once(broker, "brokered"));
        if bwrap_ok {
            bwrap_once();
        }
    }
    let (mut iso, mut brk, mut bw) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        iso.push(runtime.block_on(spawn_once(broker, "isolated")));
        brk.push(runtime.block_on(spawn_once(broker, "brokered")));
        if bwrap_ok && let Some(d) = bwrap_once() {
            bw.push(d);
        }
    }
    // Spawning must not slow down as the host grows: repeat with 512 MiB of touched heap
    // (a fork-style clone would copy its page tables on every spawn).
    let ballast = vec![1u8; 512 << 20];
    std::hint::black_box(&ballast);
    let mut heavy = Vec::new();
    for _ in 0..samples.min(100) {
        heavy.push(runtime.block_on(spawn_once(broker, "isolated")));
    }
    drop(ballast);
    let (iso, brk, bw, heavy) = (Samples(iso), Samples(brk), Samples(bw), Samples(heavy));
    let row = |name: &str, s: &Samples| {
        let ratio = if bwrap_ok {
            s.median().as_secs_f64() / bw.median().as_secs_f64()
        } else {
            f64::NAN
        };
        Row {
            name: format!("spawn-to-exit /bin/true, {name} (median of {samples})"),
            flowhost: fmt_duration(s.median()),
            baseline: bwrap_ok.then(|| {
                (
                    "bwrap --unshare-all --die-with-parent --ro-bind / /".into(),
                    fmt_duration(bw.median()),
                )
            }),
            comparison: format!("{ratio:.2}x bwrap"),
            goal: "ratio <= 1.0".into(),
            met: bwrap_ok && ratio <= 1.0,
        }
    };
    let mut rows = vec![
        row("isolated", &iso),
        row("brokered", &brk),
        row("isolated, host holding 512 MiB", &heavy),
    ];
    if bwrap_ok {
        rows.extend(cli_rows(samples, sandlock));
    }
    rows
}

/// `flowhost sandbox run` as a whole process (the user's view: the binary starting, the
/// profile loaded, the spawn, the exit), interleaved with the same for bwrap, the floor
/// ([`Floor`]) and sandlock when installed.
fn cli_rows(samples: usize, sandlock: Option<&Sandlock>) -> Vec<Row> {
    let flowhost = crate::scale::flowhost_binary();
    let floor = Floor::find();
    let cli_once = || {
        let start = Instant::now();
        let status = Command::new(&flowhost)
            .args([
                "sandbox",
                "run",
                "--quiet",
                "--profile",
                "isolated",
                "--",
                "/bin/true",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run flowhost sandbox run");
        assert!(status.success(), "flowhost sandbox run /bin/true failed");
        start.elapsed()
    };
    // Back to back (what a script running many commands sees), then one-off: each run 200
    // ms after the last, so that nothing the kernel keeps warm for a short while after a
    // run (an RCU grace period already passed, caches) helps the next one.
    let mut rows = Vec::new();
    for (mode, gap, n) in [
        ("back to back", Duration::ZERO, samples),
        (
            "one-off, 200 ms apart",
            Duration::from_millis(200),
            samples.min(30),
        ),
    ] {
        let (mut cli, mut bw, mut sl, mut fl) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..n {
            std::thread::sleep(gap);
            cli.push(cli_once());
            std::thread::sleep(gap);
            if let Some(d) = bwrap_once() {
                bw.push(d);
            }
            if let Some(f) = &floor {
                std::thread::sleep(gap);
                fl.extend(f.once());
            }
            if let Some(s) = sandlock {
                std::thread::sleep(gap);
                sl.push(s.true_once());
            }
        }
        let (cli, bw) = (Samples(cli), Samples(bw));
        if let Some(f) = &floor {
            rows.push(floor_row(mode, n, f, &cli, &bw, &Samples(fl)));
        }
        rows.extend(cli_mode_rows(mode, n, (cli, bw, Samples(sl)), sandlock));
    }
    rows
}

/// The floor row of one mode of [`cli_rows`]: flowhost against the floor, and where the
/// goal (0.5x bwrap) lies against it.
fn floor_row(
    mode: &str,
    samples: usize,
    floor: &Floor,
    cli: &Samples,
    bw: &Samples,
    fl: &Samples,
) -> Row {
    let (cli, bw, fl) = (
        cli.median().as_secs_f64(),
        bw.median().as_secs_f64(),
        fl.median().as_secs_f64(),
    );
    let goal = 0.5 * bw;
    Row {
        name: format!(
            "floor: `{}` (the isolated profile's namespaces, then exec), whole process, {mode} (median of {samples})",
            floor.describe()
        ),
        flowhost: format!("{} flowhost", fmt_duration(Duration::from_secs_f64(cli))),
        baseline: Some((
            format!(
                "the floor; bwrap {}",
                fmt_duration(Duration::from_secs_f64(bw))
            ),
            fmt_duration(Duration::from_secs_f64(fl)),
        )),
        comparison: format!(
            "flowhost {:.2}x the floor (+{}); the floor is {:.2}x bwrap, so 0.5x bwrap ({}) is {} the floor",
            cli / fl,
            fmt_duration(Duration::from_secs_f64((cli - fl).max(0.0))),
            fl / bw,
            fmt_duration(Duration::from_secs_f64(goal)),
            if goal < fl { "below" } else { "above" }
        ),
        goal: "reported".into(),
        met: true,
    }
}

/// The rows of one mode of [`cli_rows`]: flowhost against bwrap, and sandlock beside them.
fn cli_mode_rows(
    mode: &str,
    samples: usize,
    (cli, bw, sl): (Samples, Samples, Samples),
    sandlock: Option<&Sandlock>,
) -> Vec<Row> {
    let bwrap_name = "bwrap --unshare-all --die-with-parent --ro-bind / / /bin/true, whole process";
    let ratio = cli.median().as_secs_f64() / bw.median().as_secs_f64();
    let mut rows = vec![Row {
        name: format!(
            "`flowhost sandbox run --profile isolated -- /bin/true`, whole process, {mode} (median of {samples})"
        ),
        flowhost: fmt_duration(cli.median()),
        baseline: Some((bwrap_name.into(), fmt_duration(bw.median()))),
        comparison: format!("{ratio:.2}x bwrap"),
        goal: "ratio <= 0.5".into(),
        met: ratio <= 0.5,
    }];
    if let Some(s) = sandlock {
        let peer = sl.median().as_secs_f64() / bw.median().as_secs_f64();
        rows.push(Row {
            name: format!(
                "peer: `sandlock run -r / -- /bin/true` ({}), whole process, {mode} (median of {samples})",
                s.version
            ),
            flowhost: format!("{} flowhost", fmt_duration(cli.median())),
            baseline: Some((
                format!("{}; bwrap {}", s.version, fmt_duration(bw.median())),
                fmt_duration(sl.median()),
            )),
            comparison: format!(
                "flowhost {:.2}x sandlock; sandlock {peer:.2}x bwrap",
                cli.median().as_secs_f64() / sl.median().as_secs_f64()
            ),
            goal: "reported".into(),
            met: true,
        });
    }
    rows
}

/// The child side: `loop-connect ADDR N` / `loop-sendto ADDR N` (and `loop-unix-connect
/// PATH N` / `loop-unix-sendto PATH N`) time each operation and print the median in
/// nanoseconds.
pub fn child_loop(kind: &str, target: &str, iterations: usize) {
    if let Some(kind) = kind.strip_prefix("unix-") {
        return child_unix_loop(kind, target, iterations);
    }
    let addr: SocketAddr = target.parse().expect("address");
    let mut times = Vec::with_capacity(iterations);
    let udp = UdpSocket::bind("127.0.0.1:0").expect("udp socket");
    for _ in 0..iterations {
        let start = Instant::now();
        match kind {
            "connect" => drop(std::net::TcpStream::connect(addr).expect("connect")),
            _ => {
                udp.send_to(b"x", addr).expect("sendto");
            }
        }
        times.push(start.elapsed());
    }
    println!("{}", Samples(times).median().as_nanos());
}

/// [`child_loop`] on a pathname unix socket: a stream connect and close, or a datagram.
fn child_unix_loop(kind: &str, path: &str, iterations: usize) {
    use std::os::unix::net::{UnixDatagram, UnixStream};
    let mut times = Vec::with_capacity(iterations);
    let datagram = UnixDatagram::unbound().expect("unix datagram socket");
    for _ in 0..iterations {
        let start = Instant::now();
        match kind {
            "connect" => drop(UnixStream::connect(path).expect("unix connect")),
            _ => {
                datagram.send_to(b"x", path).expect("unix sendto");
            }
        }
        times.push(start.elapsed());
    }
    println!("{}", Samples(times).median().as_nanos());
}

fn parse_median(out: &str) -> Duration {
    Duration::from_nanos(out.trim().parse().expect("child printed a median"))
}

/// How the host decides the loop's attempts (every one is allowed either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Judging {
    /// A synchronous judge on the supervision thread ([`Broker::spawn_judged`]).
    Inline,
    /// A task reading the executor's attempt stream, as the daemon judges.
    Stream,
}

/// One round of the timed loop under the broker (`brokered`, every attempt allowed).
fn brokered_round(
    runtime: &tokio::runtime::Runtime,
    broker: &Broker,
    args: &[String],
    judging: Judging,
) -> Duration {
    runtime.block_on(async {
        let mut spec = quiet(args.to_vec(), "brokered");
        spec.stdout = StdioMode::Piped;
        let judge: Option<Judge> = match judging {
            Judging::Inline => Some(Arc::new(|_: &AttemptInfo| Some(Verdict::Allow))),
            Judging::Stream => None,
        };
        let mut exec = broker.spawn_judged(spec, judge).await.expect("spawn loop");
        let mut attempts = exec.take_attempts().expect("attempts");
        tokio::spawn(async move {
            while let Some(a) = attempts.recv().await {
                a.respond(Verdict::Allow);
            }
        });
        let mut out = String::new();
        exec.take_stdout()
            .expect("stdout")
            .read_to_string(&mut out)
            .await
            .expect("read");
        let status = exec.wait().await.expect("wait");
        assert!(status.success(), "brokered loop failed: {status:?}");
        parse_median(&out)
    })
}

/// The target of a loop: a loopback TCP listener that accepts and closes, or a UDP sink; for
/// the unix kinds, the same at a socket path every uid may use (the executor's uid reaches it
/// with its own permissions).
fn loop_target(kind: &str) -> String {
    if let Some(unix) = kind.strip_prefix("unix-") {
        use std::os::unix::fs::PermissionsExt;
        let dir = crate::support::shared_dir().join(format!("unix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the socket directory");
        let path = dir.join(format!("{unix}.sock"));
        let _ = std::fs::remove_file(&path);
        if unix == "connect" {
            let listener = std::os::unix::net::UnixListener::bind(&path).expect("unix listener");
            std::thread::spawn(move || {
                for s in listener.incoming() {
                    drop(s);
                }
            });
        } else {
            let sink = std::os::unix::net::UnixDatagram::bind(&path).expect("unix sink");
            std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while sink.recv(&mut buf).is_ok() {}
            });
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777))
            .expect("open the socket to every uid");
        return path.display().to_string();
    }
    inet_loop_target(kind).to_string()
}

fn inet_loop_target(kind: &str) -> SocketAddr {
    if kind == "connect" {
        let listener = TcpListener::bind("127.0.0.1:0").expect("listener");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            for s in listener.incoming() {
                drop(s);
            }
        });
        addr
    } else {
        let sink = UdpSocket::bind("127.0.0.1:0").expect("udp sink");
        let addr = sink.local_addr().expect("addr");
        std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while sink.recv(&mut buf).is_ok() {}
        });
        addr
    }
}

fn loop_rows(
    runtime: &tokio::runtime::Runtime,
    broker: &Broker,
    kind: &str,
    iterations: usize,
    rounds: usize,
    sandlock: Option<&Sandlock>,
) -> (Vec<Row>, Duration) {
    let target = loop_target(kind);
    let unix = kind.starts_with("unix-");
    // The loop runs inside the sandbox as the executor uid: run a copy it can reach.
    let me = crate::support::shared_self().display().to_string();
    let args = vec![
        me.clone(),
        format!("loop-{kind}"),
        target.to_string(),
        iterations.to_string(),
    ];
    let (mut direct, mut brokered, mut streamed, mut peer) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let out = Command::new(&me)
            .args(&args[1..])
            .output()
            .expect("direct loop");
        direct.push(parse_median(&String::from_utf8_lossy(&out.stdout)));
        brokered.push(brokered_round(runtime, broker, &args, Judging::Inline));
        streamed.push(brokered_round(runtime, broker, &args, Judging::Stream));
        if let Some(s) = sandlock.filter(|_| !unix) {
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = s
                .command(&Sandlock::allow(kind, &target.to_string()), &argv)
                .stdout(Stdio::piped())
                .output()
                .expect("sandlock loop");
            assert!(
                out.status.success(),
                "the loop under sandlock failed: {}",
                out.status
            );
            peer.push(parse_median(&String::from_utf8_lossy(&out.stdout)));
        }
    }
    let (d, b) = (Samples(direct).median(), Samples(brokered).median());
    let added = b.saturating_sub(d);
    let (name, limit) = match kind {
        "connect" => ("loopback TCP connect+close", Duration::from_micros(20)),
        "sendto" => ("unconnected UDP sendto", Duration::from_micros(15)),
        "unix-connect" => ("unix stream connect+close", Duration::ZERO),
        _ => ("unix datagram sendto", Duration::ZERO),
    };
    // No goal for the unix loops: a privileged broker makes each of their operations, and
    // the lookup of the path, with the executor's identity (reported).
    let goal = if unix {
        "reported".to_string()
    } else {
        format!("<= {} added", fmt_duration(limit))
    };
    let versus_direct = |judged: &str, b: Duration, goal: &str| {
        let added = b.saturating_sub(d);
        Row {
            name: format!("{name}, brokered, {judged} (median of {rounds} x {iterations})"),
            flowhost: fmt_duration(b),
            baseline: Some(("no broker".into(), fmt_duration(d))),
            comparison: format!(
                "+{} per op ({:.1}x)",
                fmt_duration(added),
                b.as_secs_f64() / d.as_secs_f64()
            ),
            goal: goal.into(),
            met: goal == "reported" || added <= limit,
        }
    };
    let mut rows = vec![
        versus_direct("the host judging inline (a synchronous judge)", b, &goal),
        versus_direct(
            "the host judging on its attempt stream (a task, as the daemon)",
            Samples(streamed).median(),
            "reported",
        ),
    ];
    // sandlock does not mediate unix sockets: no row for them (its loop is not run).
    if let Some(s) = sandlock.filter(|_| !unix) {
        let p = Samples(peer).median();
        let peer_added = p.saturating_sub(d);
        rows.push(Row {
            name: format!("peer: {name} under sandlock, same loop and rounds"),
            flowhost: format!("+{} added by flowhost", fmt_duration(added)),
            baseline: Some((
                format!("{}, --net-allow the target only", s.version),
                format!("{} (+{} added)", fmt_duration(p), fmt_duration(peer_added)),
            )),
            comparison: format!(
                "flowhost adds {:.2}x what sandlock adds",
                added.as_secs_f64() / peer_added.as_secs_f64().max(1e-9)
            ),
            goal: "reported".into(),
            met: true,
        });
    }
    (rows, added)
}
