//! Helpers shared by the integration tests: locating workspace binaries, loopback sinks,
//! and running a command under the real broker while recording every attempt.

#![allow(dead_code)]

pub mod governed;
pub mod harness;
pub mod http;
pub mod lab;
pub mod named;

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowhost_broker::{
    AttemptInfo, Broker, BrokerOptions, ExitStatus, Judge, Profile, SpawnSpec, StdioMode, Verdict,
};
use tokio::io::AsyncReadExt;

/// A binary built by `cargo test --workspace` into this test's target directory.
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built; run the suite with `cargo test --workspace`",
        path.display()
    );
    path
}

/// The host's `/etc/resolv.conf` replaced by a copy, as a resolver manager replaces it (a
/// rename over it), until dropped: then the original file (its inode, owner and label) is
/// renamed back. Every path step is a rename, so the path never goes missing.
pub struct ReplacedResolvConf {
    host: PathBuf,
    original: PathBuf,
    /// The device and inode of the copy put in its place.
    copy: (u64, u64),
}

impl ReplacedResolvConf {
    /// Replaces the file, or says why it cannot (a read-only `/etc`, a file that is itself
    /// a mount point, as in a container) and returns `None`.
    pub fn now() -> Option<ReplacedResolvConf> {
        let skip = |why: String| {
            eprintln!("SKIP: the host's /etc/resolv.conf cannot be replaced: {why}");
            None
        };
        let host = match std::fs::canonicalize("/etc/resolv.conf") {
            Ok(host) => host,
            Err(e) => return skip(e.to_string()),
        };
        let pid = std::process::id();
        let original = host.with_extension(format!("flowhost-test-original-{pid}"));
        let copy = host.with_extension(format!("flowhost-test-copy-{pid}"));
        if let Err(e) = std::fs::hard_link(&host, &original) {
            return skip(format!("{}: {e}", original.display()));
        }
        let replaced = std::fs::copy(&host, &copy).and_then(|_| std::fs::rename(&copy, &host));
        if let Err(e) = replaced {
            let _ = std::fs::remove_file(&copy);
            let _ = std::fs::remove_file(&original);
            return skip(format!("{}: {e}", host.display()));
        }
        use std::os::unix::fs::MetadataExt;
        let copy = match std::fs::metadata(&host) {
            Ok(m) => (m.dev(), m.ino()),
            Err(e) => return skip(format!("{}: {e}", host.display())),
        };
        Some(ReplacedResolvConf {
            host,
            original,
            copy,
        })
    }
}

impl Drop for ReplacedResolvConf {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        // Replaced again meanwhile (a resolver manager, another test run): that file stays.
        let ours = std::fs::metadata(&self.host).is_ok_and(|m| (m.dev(), m.ino()) == self.copy);
        if !ours {
            let _ = std::fs::remove_file(&self.original);
            return;
        }
        if let Err(e) = std::fs::rename(&self.original, &self.host) {
            eprintln!(
                "could not put back {} from {}: {e}",
                self.host.display(),
                self.original.display()
            );
        }
    }
}

/// A world-readable directory outside /tmp (executors get a private /tmp) where tests put
/// what executors, running as another uid, must read or execute.
pub fn shared_dir() -> PathBuf {
    let dir = PathBuf::from("/var/tmp/flowhost-test");
    std::fs::create_dir_all(&dir).unwrap();
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755));
    dir
}

/// A temporary directory every executor uid can search (in [`shared_dir`], mode 0755). The
/// build's own temporary directories are 0700, and a checkout under /root is not
/// traversable: the broker reaches a unix socket path with the executor's permissions.
#[allow(dead_code)]
pub fn executor_visible_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir_in(shared_dir()).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// A unix listener at `path` that any uid may connect to (mode 0777), as a service meant
/// for executors makes its socket.
#[allow(dead_code)]
pub fn listener_for_executors(path: &Path) -> std::os::unix::net::UnixListener {
    use std::os::unix::fs::PermissionsExt;
    let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
    listener
}

/// A copy of a workspace binary in [`shared_dir`], so executors can run it whatever the
/// permissions of the checkout (a clone under /root is not traversable by their uid).
///
/// The copy is made by `cp` in a child process and renamed into place, once per process:
/// if this (multithreaded) process held the file open for writing, a sandbox child cloned at
/// that moment could inherit the write descriptor and make a concurrent exec fail with
/// ETXTBSY. Copies are content-addressed by size and mtime, so test processes share them.
pub fn shared_copy(name: &str) -> PathBuf {
    use std::collections::HashMap;
    use std::sync::OnceLock;
    static COPIES: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut copies = COPIES
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap();
    if let Some(p) = copies.get(name) {
        return p.clone();
    }
    let src = workspace_binary(name);
    let meta = std::fs::metadata(&src).unwrap();
    let stamp = meta
        .modified()
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = shared_dir().join(format!("bin-{}-{stamp}", meta.len()));
    let dst = dir.join(name);
    if !dst.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        let status = std::process::Command::new("cp")
            .arg("--")
            .arg(&src)
            .arg(&tmp)
            .status()
            .unwrap();
        assert!(status.success(), "cp {} failed", src.display());
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&tmp, &dst).unwrap();
    }
    copies.insert(name.to_string(), dst.clone());
    dst
}

/// The broker's capabilities, as `setpriv` names them.
pub const BROKER_CAPS: &str = "+sys_admin,+sys_ptrace,+setuid,+setgid,+setpcap,+kill";

/// `program` run by `setpriv` as the service user (uid and gid 990, no groups) holding
/// `caps` as ambient capabilities, from `/`.
pub fn as_service_user(caps: &str, program: &std::path::Path) -> std::process::Command {
    let mut c = std::process::Command::new("setpriv");
    c.args([
        "--reuid",
        "990",
        "--regid",
        "990",
        "--clear-groups",
        "--inh-caps",
        caps,
        "--ambient-caps",
        caps,
        "--",
    ])
    .arg(program)
    .current_dir("/");
    c
}

/// A copy of the flowhost binary that other uids can run (the build tree may not be
/// traversable by them); shared by every test process of the same build.
pub fn shared_flowhost() -> PathBuf {
    shared_copy("flowhost")
}

/// Whether `tool` is on PATH.
pub fn have(tool: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Whether third-party software the interop tests run (installed by `.ci/install-interop`)
/// is at `path`; prints why the test skips when not. With `FLOWHOST_TEST_INTEROP=required`
/// (set by `.ci/run`) its absence fails the test instead: a broken install must not turn the
/// interop tests into skips.
pub fn third_party(path: &std::path::Path) -> bool {
    if path.exists() {
        return true;
    }
    let why = format!(
        "{} is not installed (run .ci/install-interop)",
        path.display()
    );
    if std::env::var("FLOWHOST_TEST_INTEROP").as_deref() == Ok("required") {
        panic!("{why}; FLOWHOST_TEST_INTEROP=required");
    }
    eprintln!("SKIP: {why}");
    false
}

/// Whether this host leaves a memory bound's swap uncapped (swap on, no swap accounting),
/// so that the bound is reported not in force and a `required` profile refused; says why
/// a test skips when so.
pub fn swap_uncapped(report: &flowhost_broker::bounds::BoundsReport) -> bool {
    let uncapped = report.not_in_force().any(|b| {
        b.field == "limits.memory_mib"
            && matches!(&b.enforcement, flowhost_broker::bounds::Enforcement::NotInForce(why) if why.contains("of swap"))
    });
    if uncapped {
        eprintln!(
            "SKIP: this host has swap without swap accounting, so memory bounds are not in force:\n{report}"
        );
    }
    uncapped
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The broker, or `None` (with the reason printed) when this host cannot run it. As root
/// (CI) the broker must start: failing to is a test failure, never a skip.
pub fn broker() -> Option<Broker> {
    match Broker::new(BrokerOptions::default()) {
        Ok(b) => Some(b),
        Err(e) if !is_root() => {
            eprintln!("SKIP: the broker cannot run unprivileged here: {e}");
            None
        }
        Err(e) => panic!("the broker must start as root: {e}"),
    }
}

pub fn profile(name: &str) -> Arc<Profile> {
    Arc::new(Profile::find(name, &[]).expect("built-in profile"))
}

/// The library's loopback relay (connections counted, bytes collected), started or the
/// test fails.
pub struct TcpSink(pub flowhost::lab::Relay);

impl std::ops::Deref for TcpSink {
    type Target = flowhost::lab::Relay;
    fn deref(&self) -> &flowhost::lab::Relay {
        &self.0
    }
}

impl TcpSink {
    pub fn start() -> TcpSink {
        TcpSink::start_on("127.0.0.1:0")
    }

    /// A sink listening on `addr` (in the calling thread's network namespace).
    pub fn start_on(addr: &str) -> TcpSink {
        TcpSink(flowhost::lab::Relay::start_on(addr).unwrap())
    }
}

/// A loopback UDP socket that collects datagrams.
pub struct UdpSink {
    pub addr: SocketAddr,
    pub datagrams: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl UdpSink {
    pub fn start() -> UdpSink {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        let datagrams = Arc::new(Mutex::new(Vec::new()));
        let d = datagrams.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while let Ok(n) = socket.recv(&mut buf) {
                d.lock().unwrap().push(buf[..n].to_vec());
            }
        });
        UdpSink { addr, datagrams }
    }

    pub fn count(&self) -> usize {
        self.datagrams.lock().unwrap().len()
    }
}

/// What a run under the broker produced.
#[derive(Debug)]
pub struct Run {
    pub pid: i32,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub attempts: Vec<(AttemptInfo, Verdict)>,
}

impl Run {
    /// The probe's JSON result line.
    pub fn result(&self) -> serde_json::Value {
        let line = self
            .stdout
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| {
                panic!(
                    "no result line; status {:?}\nstdout {}\nstderr {}",
                    self.status, self.stdout, self.stderr
                )
            });
        serde_json::from_str(line).unwrap()
    }

    /// The first attempt the broker reported for `syscall` (the test fails if there is none).
    pub fn first_attempt(&self, syscall: flowhost_broker::EgressSyscall) -> &AttemptInfo {
        self.attempts
            .iter()
            .map(|(a, _)| a)
            .find(|a| a.syscall == syscall)
            .unwrap_or_else(|| panic!("no {syscall:?} attempt reported: {:?}", self.attempts))
    }

    pub fn errno(&self) -> i64 {
        let r = self.result();
        assert_eq!(r["result"], "errno", "expected a failed call: {r}");
        r["errno"].as_i64().unwrap()
    }
}

/// Runs `argv` under `profile`, answering each attempt with `policy` on the executor's
/// attempt stream.
pub async fn run_with(
    broker: &Broker,
    profile_name: &str,
    argv: Vec<String>,
    policy: impl Fn(&AttemptInfo) -> Verdict + Send + 'static,
) -> Run {
    run_judged(broker, profile(profile_name), argv, None, policy, None).await
}

/// [`run_with`], with the spawn naming the uid and gid the executor runs as.
pub async fn run_as(
    broker: &Broker,
    profile_name: &str,
    argv: Vec<String>,
    identity: (u32, u32),
    policy: impl Fn(&AttemptInfo) -> Verdict + Send + 'static,
) -> Run {
    run_judged(
        broker,
        profile(profile_name),
        argv,
        None,
        policy,
        Some(identity),
    )
    .await
}

/// Runs `argv` under `profile` (one a test made), answering every attempt with `policy`.
pub async fn run_under(
    broker: &Broker,
    profile: Arc<Profile>,
    argv: Vec<String>,
    policy: impl Fn(&AttemptInfo) -> Verdict + Send + 'static,
) -> Run {
    run_judged(broker, profile, argv, None, policy, None).await
}

/// Runs `argv` under `profile` with `judge` as the broker's synchronous judge; attempts it
/// leaves undecided are answered with `policy` on the attempt stream. Every verdict is
/// recorded, whichever gave it.
pub async fn run_inline(
    broker: &Broker,
    profile_name: &str,
    argv: Vec<String>,
    judge: impl Fn(&AttemptInfo) -> Option<Verdict> + Send + Sync + 'static,
    policy: impl Fn(&AttemptInfo) -> Verdict + Send + 'static,
) -> Run {
    run_judged(
        broker,
        profile(profile_name),
        argv,
        Some(Box::new(judge)),
        policy,
        None,
    )
    .await
}

type InlinePolicy = Box<dyn Fn(&AttemptInfo) -> Option<Verdict> + Send + Sync>;

async fn run_judged(
    broker: &Broker,
    profile: Arc<Profile>,
    argv: Vec<String>,
    inline: Option<InlinePolicy>,
    policy: impl Fn(&AttemptInfo) -> Verdict + Send + 'static,
    identity: Option<(u32, u32)>,
) -> Run {
    let mut spec = SpawnSpec::new(argv, profile);
    spec.identity = identity;
    spec.stdin = StdioMode::Null;
    spec.wall_clock = Some(Duration::from_secs(30));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let judge: Option<Judge> = inline.map(|inline| {
        let seen = seen.clone();
        Arc::new(move |a: &AttemptInfo| {
            let v = inline(a)?;
            seen.lock().unwrap().push((a.clone(), v));
            Some(v)
        }) as Judge
    });
    let mut exec = broker.spawn_judged(spec, judge).await.expect("spawn");
    let pid = exec.pid();
    let mut attempts_rx = exec.take_attempts().unwrap();
    let seen2 = seen.clone();
    let decider = tokio::spawn(async move {
        while let Some(a) = attempts_rx.recv().await {
            let v = policy(a.info());
            seen2.lock().unwrap().push((a.info().clone(), v));
            a.respond(v);
        }
    });
    let mut out = exec.take_stdout().unwrap();
    let mut err = exec.take_stderr().unwrap();
    let (mut stdout, mut stderr) = (String::new(), String::new());
    let (r1, r2) = tokio::join!(
        out.read_to_string(&mut stdout),
        err.read_to_string(&mut stderr)
    );
    r1.unwrap();
    r2.unwrap();
    let status = exec.wait().await.unwrap();
    drop(exec);
    let _ = tokio::time::timeout(Duration::from_secs(5), decider).await;
    let attempts = seen.lock().unwrap().clone();
    Run {
        pid,
        status,
        stdout,
        stderr,
        attempts,
    }
}

/// Runs the probe with `args`, refusing every attempt.
pub async fn probe(broker: &Broker, profile_name: &str, args: &[&str]) -> Run {
    run_with(broker, profile_name, probe_argv(args), |_| Verdict::DENY).await
}

/// The probe's argv (a shared copy of the binary) with `args`.
pub fn probe_argv(args: &[&str]) -> Vec<String> {
    let mut argv = vec![shared_copy("flowhost-probe").display().to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    argv
}

/// A new pseudo-terminal: its master and its slave.
pub fn open_pty() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
    use std::os::fd::{FromRawFd, OwnedFd};
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes two descriptors into the integers passed; the name, termios and
    // window-size pointers may be NULL.
    let r = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: openpty returned two new descriptors owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) }
}
