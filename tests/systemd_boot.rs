//! A real boot: a minimal Debian root filesystem (debootstrap) with flowhost installed by
//! `make install DESTDIR=...`, booted with systemd as PID 1 (`systemd-nspawn -b`), set up by
//! running the README's "Deployment" lines literally inside it, then driven like an operator
//! and a user would: socket activation by a non-root member of group flowhost-clients, the
//! pricing-lab workflow (allow, flow refusal, syscall refusal), records verify, reload
//! accepted and refused (`systemctl reload` failing), a refusal to start that is not
//! retried and reaches `journalctl -p err`, the watchdog restarting a frozen daemon, stop,
//! and a reboot.
//!
//! Needs root, `debootstrap` and `systemd-nspawn` (Debian packages `debootstrap`,
//! `systemd-container`; `.ci/run` installs them); skips with the reason elsewhere. The root
//! filesystem is cached under `target/systemd-boot-rootfs/`, keyed by suite and packages,
//! and copied afresh for every run.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::lab::records_in;
use common::{TcpSink, have, is_root};
use serde_json::{Value, json};

/// What the root filesystem holds beyond debootstrap's minimal base (the cache key).
const PACKAGES: &str = "dbus,systemd,systemd-sysv";
/// nspawn's own seccomp filter blocks these; the broker needs them.
const SYSCALLS: &str =
    "pidfd_getfd landlock_create_ruleset landlock_add_rule landlock_restrict_self";
/// The lab principal larkfield-analyst's uid in the example configuration.
const ANALYST_UID: &str = "1000";
const SOCKET: &str = "/run/flowhost/flowhost.sock";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// The host's Debian suite and the mirror its apt uses (the only registry reachable).
fn suite_and_mirror() -> (String, String) {
    let release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let suite = release
        .lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|s| s.trim_matches('"').to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "bookworm".into());
    let mut sources = std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        for e in dir.flatten() {
            if e.path()
                .extension()
                .is_some_and(|x| x == "sources" || x == "list")
            {
                sources += &std::fs::read_to_string(e.path()).unwrap_or_default();
            }
        }
    }
    let mirror = sources
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("URIs:")
                .map(|u| u.split_whitespace().next().unwrap_or("").to_string())
                .or_else(|| {
                    l.strip_prefix("deb ").map(|r| {
                        r.split_whitespace()
                            .find(|w| w.contains("://"))
                            .unwrap_or("")
                            .to_string()
                    })
                })
        })
        .find(|u| u.ends_with("/debian") || u.ends_with("/debian/"))
        .unwrap_or_else(|| "http://deb.debian.org/debian".into());
    (suite, mirror)
}

/// The cached root filesystem, built by debootstrap on first use (into a temporary
/// directory renamed into place, so an interrupted build is never taken for a cache).
fn cached_rootfs() -> PathBuf {
    let (suite, mirror) = suite_and_mirror();
    let cache = repo().join("target/systemd-boot-rootfs");
    let dir = cache.join(format!("{suite}-minbase-{PACKAGES}"));
    if dir.join("usr/lib/systemd/systemd").exists() {
        return dir;
    }
    std::fs::create_dir_all(&cache).unwrap();
    let tmp = cache.join(format!(".build-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let started = Instant::now();
    let out = Command::new("debootstrap")
        .args([
            "--variant=minbase",
            &format!("--include={PACKAGES}"),
            &suite,
        ])
        .arg(&tmp)
        .arg(&mirror)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "debootstrap {suite} from {mirror} failed:\n{}",
        text(&out)
    );
    eprintln!(
        "built the root filesystem ({suite} from {mirror}) in {:?}",
        started.elapsed()
    );
    std::fs::rename(&tmp, &dir).unwrap();
    dir
}

/// The lines of the README's Deployment block.
fn readme_deployment() -> Vec<String> {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let section = &readme[readme.find("## Deployment").expect("a Deployment section")..];
    let block = &section[section.find("```sh\n").expect("a sh block") + 6..];
    let block = &block[..block.find("```").unwrap()];
    block.lines().map(str::to_string).collect()
}

/// The service's status and recent journal in the container whose init is `pid1`.
fn diagnostics(pid1: i32) -> String {
    Command::new("nsenter")
        .args(["-t", &pid1.to_string(), "-a", "timeout", "20", "sh", "-c"])
        .arg("systemctl status flowhost.socket flowhost.service --no-pager; journalctl -u flowhost --no-pager | tail -40")
        .output()
        .map(|o| text(&o))
        .unwrap_or_else(|e| format!("(no diagnostics: {e})"))
}

/// A per-run copy of the root filesystem, removed when dropped (also when the test fails).
struct Scratch(PathBuf);

impl Scratch {
    /// A fresh copy of `cache` under target/, after removing copies that runs which no
    /// longer exist left behind (a killed test cannot clean up).
    fn copy_of(cache: &Path) -> Scratch {
        let target = repo().join("target");
        for e in std::fs::read_dir(&target).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("systemd-boot-run-")
                && !Path::new("/proc").join(pid).exists()
            {
                drop(Scratch(e.path()));
            }
        }
        let scratch = Scratch(target.join(format!("systemd-boot-run-{}", std::process::id())));
        drop(Scratch(scratch.0.clone()));
        let out = Command::new("cp")
            .args(["-a", "--reflink=auto"])
            .arg(cache)
            .arg(&scratch.0)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        scratch
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // rm is about twice as fast as remove_dir_all on this tree (~250 MB).
        let _ = Command::new("rm").arg("-rf").arg(&self.0).status();
        let _ = std::fs::remove_file(self.0.with_extension("log"));
    }
}

/// A booted container; killed when dropped, also when the test fails (the test drops it
/// before the [`Scratch`] holding its root filesystem).
struct Container {
    root: PathBuf,
    nspawn: Child,
    pid1: i32,
}

impl Container {
    fn boot(root: &Path) -> Container {
        let root = root.to_path_buf();
        let log = std::fs::File::create(root.with_extension("log")).unwrap();
        let nspawn = Command::new("systemd-nspawn")
            .arg("-D")
            .arg(&root)
            .args([
                "-b",
                "--register=no",
                "--keep-unit",
                "--private-network",
                "--console=passive",
                &format!("--system-call-filter={SYSCALLS}"),
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut c = Container {
            root,
            pid1: 0,
            nspawn,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let children = format!("/proc/{0}/task/{0}/children", c.nspawn.id());
        while c.pid1 == 0 {
            assert!(Instant::now() < deadline, "the container did not start");
            let first = std::fs::read_to_string(&children).unwrap_or_default();
            if let Some(pid) = first.split_whitespace().next().and_then(|p| p.parse().ok()) {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"));
                if comm.is_ok_and(|c| c.trim() == "systemd") {
                    c.pid1 = pid;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Until systemd has its private bus socket, systemctl cannot ask it anything.
        loop {
            let state = c.sh("systemctl is-system-running --wait");
            let state = String::from_utf8_lossy(&state.stdout).trim().to_string();
            if state == "running" || state == "degraded" {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "the boot ended {state:?}:\n{}",
                text(&c.sh("systemctl --failed --no-pager; journalctl -b --no-pager | tail -50"))
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `command` prefixed to run inside the container.
    fn inside(&self) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.pid1.to_string(), "-a"]);
        c
    }

    /// Runs `script` with sh inside the container (killed after two minutes: a hung
    /// systemctl fails the test instead of hanging it).
    fn sh(&self, script: &str) -> Output {
        self.inside()
            .args(["timeout", "120", "sh", "-c", script])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Runs `script`, which must succeed; returns its stdout.
    fn ok(&self, script: &str) -> String {
        let out = self.sh(script);
        assert!(out.status.success(), "{script}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A property of flowhost.service.
    fn service(&self, property: &str) -> String {
        self.ok(&format!(
            "systemctl show flowhost.service -p {property} --value"
        ))
        .trim()
        .to_string()
    }

    /// Waits (up to `limit`) until `done` holds.
    fn await_state(&self, limit: Duration, what: &str, mut done: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + limit;
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "{what} did not happen within {limit:?}:\n{}",
                diagnostics(self.pid1)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A TCP sink on 127.0.0.1:`port` in the container's network namespace.
    fn sink(&self, port: u16) -> TcpSink {
        let netns = std::fs::File::open(format!("/proc/{}/ns/net", self.pid1)).unwrap();
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: setns on a namespace descriptor we hold; it moves only this thread,
            // which ends once the listener (bound in the container's namespace) exists.
            let r = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
            TcpSink::start_on(&format!("127.0.0.1:{port}"))
        })
        .join()
        .unwrap()
    }

    /// An MCP session through `flowhost connect`, as the non-root member `user`.
    fn session(&self, user: &str) -> Session {
        let mut child = self
            .inside()
            .args([
                "runuser",
                "-u",
                user,
                "--",
                "/usr/local/bin/flowhost",
                "connect",
            ])
            .args(["--socket", SOCKET])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        // Lines arrive through a channel, so a daemon that never answers fails the test
        // after a deadline instead of hanging it.
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Session {
            pid1: self.pid1,
            stdin: child.stdin.take().unwrap(),
            lines,
            child,
            next_id: 1,
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if self.pid1 > 0 {
            // SAFETY: SIGKILL to the container's init ends its whole pid namespace.
            unsafe { libc::kill(self.pid1, libc::SIGKILL) };
        }
        let _ = self.nspawn.kill();
        let _ = self.nspawn.wait();
    }
}

struct Session {
    pid1: i32,
    stdin: ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
    child: Child,
    next_id: u64,
}

impl Session {
    fn request(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let line = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        writeln!(self.stdin, "{line}").unwrap();
        let answer = self
            .lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| {
                panic!(
                    "{method}: no answer within 60 s ({e}):\n{}",
                    diagnostics(self.pid1)
                )
            });
        let answer: Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("{method}: bad answer {answer:?}: {e}"));
        assert_eq!(answer["id"], id, "{answer}");
        answer
    }

    fn initialize(&mut self) {
        let r = self.request(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "boot-test", "version": "0"}}),
        );
        assert!(r.get("result").is_some(), "{r}");
    }

    fn call(&mut self, tool: &str, arguments: Value) -> Value {
        self.request("tools/call", json!({"name": tool, "arguments": arguments}))
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn result_text(r: &Value) -> String {
    assert!(r.get("result").is_some(), "expected a result: {r}");
    assert_eq!(r["result"]["isError"], false, "{r}");
    r["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_booted_systemd_runs_the_deployment_as_the_readme_says() {
    if !is_root() {
        eprintln!("SKIP: booting a container needs root (CI runs this as root)");
        return;
    }
    for tool in ["debootstrap", "systemd-nspawn", "nsenter", "make"] {
        if !have(tool) {
            eprintln!(
                "SKIP: {tool} is missing (.ci/run installs debootstrap and systemd-container)"
            );
            return;
        }
    }
    let started = Instant::now();
    let cache = cached_rootfs();
    let scratch = Scratch::copy_of(&cache);
    let root = scratch.0.clone();

    // The README's lines: the first is `make install`, run here against the root filesystem
    // (`install` is `build` then `install-files`; the binaries under test are built).
    let steps = readme_deployment();
    assert!(steps[0].starts_with("make install "), "{steps:?}");
    for tool in ["flowhost-tool-workspace", "flowhost-tool-publisher"] {
        common::workspace_binary(tool);
    }
    let build = Path::new(env!("CARGO_BIN_EXE_flowhost")).parent().unwrap();
    let out = Command::new("make")
        .current_dir(repo())
        .arg("install-files")
        .arg(format!("DESTDIR={}", root.display()))
        .arg(format!("BUILD_DIR={}", build.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "make install: {}", text(&out));

    // Declared after `scratch`, so dropped (killed) before its root filesystem is removed.
    let c = Container::boot(&root);
    eprintln!("booted after {:?}", started.elapsed());
    for step in &steps[1..] {
        c.ok(step);
    }

    // Socket activation: the service is not running until a member of group
    // flowhost-clients, not root, connects; /run/flowhost lets group members through.
    c.ok(&format!(
        "useradd -u {ANALYST_UID} -G flowhost-clients -M -s /bin/sh analyst"
    ));
    assert_eq!(c.service("ActiveState"), "inactive");
    assert_eq!(
        c.ok("stat -c %U:%G:%a /run/flowhost").trim(),
        "flowhost:flowhost-clients:750"
    );
    // A client cannot read the configuration (its tokens' digests, its principals):
    // before, clients joined group flowhost, which may.
    let read = c.sh("runuser -u analyst -- cat /etc/flowhost/flowhost.toml");
    assert!(
        !read.status.success()
            && String::from_utf8_lossy(&read.stderr).contains("Permission denied"),
        "{}",
        text(&read)
    );
    let (team, public, exfil) = (c.sink(7401), c.sink(7402), c.sink(7403));
    let mut s = c.session("analyst");
    s.initialize();
    assert_eq!(c.service("ActiveState"), "active");
    assert_eq!(c.service("User"), "flowhost");
    // The executors' bounds are cgroups beneath the service's own: the unit delegates its
    // subtree and leaves cgroupfs writable (file permissions still confine the daemon to
    // that subtree). Inside this container the v1 controller hierarchies are mounted
    // read-only by systemd-nspawn whatever the unit says, so the bounds themselves are
    // proven by the broker's own cgroup tests, not here.
    assert_eq!(c.service("Delegate"), "yes");
    assert_eq!(c.service("ProtectControlGroups"), "no");

    // The pricing-lab workflow, under the unit's sandboxing.
    let listed = s.call("workspace/list_documents", json!({}));
    assert!(
        result_text(&listed).contains("harbor-goods-terms.md"),
        "{listed}"
    );
    let terms = result_text(&s.call(
        "workspace/read_terms",
        json!({"document": "harbor-goods-terms.md"}),
    ));
    assert!(terms.contains("Harbor Goods"), "{terms}");
    let message = "Harbor Goods: floor 4.10 EUR (for the pricing team)";
    let r = s.call(
        "team-inbox/publish",
        json!({"message": message, "sink": "127.0.0.1:7401"}),
    );
    assert!(result_text(&r).starts_with("delivered"), "{r}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while team.bytes() != message.as_bytes() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        team.bytes(),
        message.as_bytes(),
        "the team relay got the message"
    );
    let r = s.call(
        "public-inbox/publish",
        json!({"message": "Pricing update", "sink": "127.0.0.1:7402"}),
    );
    assert_eq!(r["error"]["data"]["denial"], "flow_violation", "{r}");
    let r = s.call(
        "workspace/summarize_terms",
        json!({"text": terms, "max_words": 12}),
    );
    assert!(r.get("result").is_some(), "{r}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(public.connections(), 0);
    assert_eq!(exfil.connections(), 0, "nothing left the sandbox");
    drop(s);
    let all = records_in(&c.root.join("var/log/flowhost/records"));
    assert!(
        all.iter()
            .any(|r| r["flowhost"]["event"] == "egress_attempt"
                && r["server"]["id"] == "workspace"
                && r["decision"]["effect"] == "deny"
                && r["flowhost"]["denial_kind"] == "missing_clearance"),
        "the sneaky connect was refused at the syscall: {all:?}"
    );
    c.ok("flowhost records verify /var/log/flowhost/records");
    c.ok("flowhost profile check /etc/flowhost/profiles/*.toml");

    // Reload: accepted, then refused, and `systemctl reload` says so.
    c.ok("systemctl reload flowhost");
    assert!(c.service("StatusText").contains("reloaded"));
    c.ok("cp /etc/flowhost/flowhost.toml /root/flowhost.toml.good");
    c.ok("echo 'this is not toml' >> /etc/flowhost/flowhost.toml");
    let refused = c.sh("systemctl reload flowhost");
    assert!(
        !refused.status.success(),
        "a refused reload failed systemctl reload"
    );
    assert_eq!(c.service("ActiveState"), "active");
    assert!(
        c.service("StatusText").contains("reload refused"),
        "{}",
        c.service("StatusText")
    );

    // A refusal to start: exit 2, not retried, and journalctl -p err says why.
    let restart = c.sh("systemctl restart flowhost.service");
    assert!(!restart.status.success());
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(c.service("ActiveState"), "failed");
    assert_eq!(c.service("ExecMainStatus"), "2");
    assert_eq!(
        c.service("NRestarts"),
        "0",
        "a refusal to start is not retried"
    );
    let errors = c.ok("journalctl -u flowhost -p err --no-pager -o cat");
    assert!(
        errors.contains("flowhost: error: /etc/flowhost/flowhost.toml"),
        "{errors}"
    );
    // A member whose connection starts the refusing service is answered, not left hanging.
    let answered = c.sh(&format!(
        "echo '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}}' | runuser -u analyst -- flowhost connect --socket {SOCKET}"
    ));
    assert!(
        String::from_utf8_lossy(&answered.stdout).contains("refused to start"),
        "{}",
        text(&answered)
    );
    assert_eq!(c.service("NRestarts"), "0");
    c.ok("cp /root/flowhost.toml.good /etc/flowhost/flowhost.toml");
    c.ok("systemctl reset-failed flowhost.service && systemctl start flowhost.socket flowhost.service");

    // The watchdog: a frozen daemon is killed and restarted (WatchdogSec=30).
    let frozen = c.service("MainPID");
    c.ok("systemctl kill --kill-whom=main -s SIGSTOP flowhost.service");
    c.await_state(Duration::from_secs(60), "a watchdog restart", |c| {
        c.service("ActiveState") == "active" && c.service("MainPID") != frozen
    });
    assert!(
        c.ok("journalctl -u flowhost --no-pager -o cat")
            .contains("Watchdog timeout")
    );
    let mut s = c.session("analyst");
    s.initialize();
    let tools = s.request("tools/list", json!({}));
    assert_eq!(
        tools["result"]["tools"].as_array().map(Vec::len),
        Some(5),
        "{tools}"
    );
    drop(s);

    // Stop: clean, with the final health written.
    c.ok("systemctl stop flowhost.service");
    assert_eq!(c.service("ActiveState"), "inactive");
    assert_eq!(c.service("Result"), "success");
    assert!(c.root.join("var/lib/flowhost/health.json").exists());

    // A reboot: the enabled units come back by themselves, a member connects, and the
    // records written before it still verify.
    drop(c);
    let c = Container::boot(&root);
    assert_eq!(
        c.ok("stat -c %U:%G:%a /run/flowhost").trim(),
        "flowhost:flowhost-clients:750"
    );
    let mut s = c.session("analyst");
    s.initialize();
    let listed = s.call("workspace/list_documents", json!({}));
    assert!(
        result_text(&listed).contains("harbor-goods-terms.md"),
        "{listed}"
    );
    drop(s);
    c.ok("flowhost records verify /var/log/flowhost/records");
    eprintln!("the whole boot test took {:?}", started.elapsed());
}
