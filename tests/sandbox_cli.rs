//! `flowhost sandbox run` and `flowhost profile check` as an operator uses them.

mod common;

use std::process::Command;

use common::{TcpSink, is_root, open_pty, shared_copy};

fn flowhost() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowhost"))
}

/// Whether the broker can run here; prints why not (never skips as root).
fn can_run() -> bool {
    if is_root() {
        return true;
    }
    eprintln!("SKIP: sandbox CLI tests need root (CI runs them as root)");
    false
}

/// Held by the tests whose commands look names up, and by the one that replaces the host's
/// `/etc/resolv.conf`: the replacement drops the bind mount that shows a running command
/// its own resolver, so a lookup made meanwhile would go past it (and be refused).
static LOOKUPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lookups() -> std::sync::MutexGuard<'static, ()> {
    LOOKUPS.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn refused_by_default_allowed_with_allow_and_recorded() {
    if !can_run() {
        return;
    }
    let sink = TcpSink::start();
    let probe = shared_copy("flowhost-probe");
    let out = flowhost()
        .args(["sandbox", "run", "--profile", "brokered", "--"])
        .arg(&probe)
        .args(["connect", &sink.addr.to_string(), "nope"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("\"errno\":13"), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("connect inet/stream/tcp {} by pid", sink.addr)),
        "{stderr}"
    );
    assert!(stderr.contains("REFUSED (default)"), "{stderr}");
    // Judged and printed on the broker's supervision thread (no records), the line still
    // names the caller's executable.
    assert!(
        stderr.contains(&format!("({}) -> REFUSED (default)", probe.display())),
        "{stderr}"
    );

    // Allowed with --allow, and recorded: read back through the harness as typed attempts.
    let run = flowhost::harness::Harness::with_binary(env!("CARGO_BIN_EXE_flowhost"))
        .allow(&sink.addr.to_string())
        .run([
            probe.display().to_string(),
            "connect".into(),
            sink.addr.to_string(),
            "allowed-bytes".into(),
        ])
        .unwrap();
    run.assert_success();
    assert!(run.stdout.contains("\"result\":\"ok\""), "{}", run.stdout);
    run.assert_complete();
    assert_eq!(run.attempts.len(), 1, "{:?}", run.attempts);
    let attempt = &run.attempts[0];
    assert!(attempt.allowed);
    assert_eq!(attempt.syscall, "connect");
    assert_eq!(attempt.destination_text(), sink.addr.to_string());
    assert_eq!(
        attempt.rule.as_deref(),
        Some(&*format!("allow {}", sink.addr))
    );
    run.assert_only_destinations(&[&sink.addr.to_string()]);
    for _ in 0..50 {
        if sink.bytes() == b"allowed-bytes" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(sink.bytes(), b"allowed-bytes");
    assert_eq!(sink.connections(), 1, "only the allowed run connected");
}

/// stderr closed early (`flowhost sandbox run ... 2>&1 | head -1`) must not change what is
/// decided: Rust ignores SIGPIPE, so printing an attempt panicked after its record was
/// committed and before its verdict was given; the attempt was refused though recorded as
/// allowed, and every later attempt refused with no record at all.
#[test]
fn a_closed_stderr_changes_no_verdict_and_no_record() {
    if !can_run() {
        return;
    }
    let sink = TcpSink::start();
    let probe = shared_copy("flowhost-probe");
    let records = common::shared_dir().join(format!("sandbox-epipe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&records);
    let (read, write) = nix::unistd::pipe().unwrap();
    drop(read);
    let out = flowhost()
        .args(["sandbox", "run", "--profile", "brokered", "--allow"])
        .arg(sink.addr.to_string())
        .arg("--records")
        .arg(&records)
        .arg("--read")
        .arg(&probe)
        .args(["--", "/bin/sh", "-c"])
        .arg("\"$0\" connect \"$1\" one 2>/dev/null; \"$0\" connect \"$1\" two 2>/dev/null")
        .arg(&probe)
        .arg(sink.addr.to_string())
        .stderr(std::process::Stdio::from(write))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout.matches("\"result\":\"ok\"").count(),
        2,
        "both connects went through: {stdout}"
    );
    let effects: Vec<String> = records_in(&records)
        .iter()
        .filter(|r| r["flowhost"]["broker"]["syscall"] == "connect")
        .map(|r| r["decision"]["effect"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(effects, ["allow", "allow"], "{stdout}");
    assert_eq!(sink.connections(), 2);
    std::fs::remove_dir_all(&records).unwrap();
}

#[test]
fn exit_status_is_the_commands_and_128_plus_signal() {
    if !can_run() {
        return;
    }
    let out = flowhost()
        .args([
            "sandbox",
            "run",
            "--profile",
            "isolated",
            "--",
            "/bin/sh",
            "-c",
            "exit 7",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let out = flowhost()
        .args(["sandbox", "run", "--profile", "isolated", "--"])
        .arg(shared_copy("flowhost-probe"))
        .arg("x32-socket")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGSYS),
        "killed by the filter: {out:?}"
    );
}

#[test]
fn a_process_already_under_a_notify_listener_is_refused() {
    if !can_run() {
        return;
    }
    let out = Command::new(shared_copy("flowhost-probe"))
        .arg("under-listener")
        .arg(env!("CARGO_BIN_EXE_flowhost"))
        .args(["sandbox", "run", "--profile", "isolated", "--", "/bin/true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("Device or resource busy"), "{stderr}");
    assert!(
        stderr.contains("already supervised by another seccomp notify listener"),
        "{stderr}"
    );
}

#[test]
fn profile_check_names_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/profiles/isolated.toml"),
        &good,
    )
    .unwrap();
    let out = flowhost()
        .args(["profile", "check"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("is valid"));

    let bad = dir.path().join("bad.toml");
    let text = std::fs::read_to_string(&good)
        .unwrap()
        .replace("path = \"none\"", "path = \"sometimes\"");
    std::fs::write(&bad, text).unwrap();
    let out = flowhost()
        .args(["profile", "check"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.toml") && stderr.contains("path"),
        "{stderr}"
    );
}

/// Sets `dev.tty.legacy_tiocsti` to 1 (TIOCSTI honoured, as on many distributions) for the
/// life of the guard, and restores the previous value after.
struct LegacyTiocsti {
    previous: Option<String>,
}

const LEGACY_TIOCSTI: &str = "/proc/sys/dev/tty/legacy_tiocsti";

impl LegacyTiocsti {
    fn enable() -> Self {
        // Kernels before 6.2 have no switch: TIOCSTI is always honoured there.
        let previous = std::fs::read_to_string(LEGACY_TIOCSTI).ok();
        if previous.as_deref().map(str::trim) == Some("0") {
            std::fs::write(LEGACY_TIOCSTI, "1").unwrap();
        }
        LegacyTiocsti { previous }
    }
}

impl Drop for LegacyTiocsti {
    fn drop(&mut self) {
        if let Some(previous) = &self.previous {
            let _ = std::fs::write(LEGACY_TIOCSTI, previous.trim());
        }
    }
}

/// A command cannot leave a set-user-ID or set-group-ID file where it may write: run by
/// someone who reaches that directory, it would act as the executor's uid and gid, which a
/// later executor is given. Before, `chmod 4755` in a write path succeeded.
#[test]
fn a_command_cannot_make_a_file_set_user_or_group_id() {
    use std::os::unix::fs::PermissionsExt;
    if !can_run() {
        return;
    }
    let dir = common::executor_visible_dir();
    let writable = dir.path().join("w");
    std::fs::create_dir(&writable).unwrap();
    std::fs::set_permissions(&writable, std::fs::Permissions::from_mode(0o777)).unwrap();
    let script = "cp /bin/true \"$1/t\" && echo copied; chmod 4755 \"$1/t\" 2>&1; \
                  chmod g+s \"$1/t\" 2>&1; install -m 6755 /bin/true \"$1/u\" 2>&1; \
                  cp /bin/true \"$1/p\" && chmod 755 \"$1/p\" && echo plain-ok";
    let out = flowhost()
        .args([
            "sandbox",
            "run",
            "--quiet",
            "--profile",
            "isolated",
            "--write",
        ])
        .arg(&writable)
        .args(["--", "/bin/sh", "-c", script, "sh"])
        .arg(&writable)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("copied") && stdout.contains("plain-ok"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in ["t", "u"] {
        if let Ok(meta) = std::fs::metadata(writable.join(name)) {
            assert_eq!(
                meta.permissions().mode() & 0o6000,
                0,
                "{name} is set-user-ID or set-group-ID: {stdout}"
            );
        }
    }
    assert!(
        stdout.matches("Operation not permitted").count() >= 3,
        "{stdout}"
    );
}

/// Everything `master` shows, read on a thread of its own until nothing holds the terminal
/// any more (EIO).
fn collect(master: &std::fs::File) -> std::sync::Arc<std::sync::Mutex<Vec<u8>>> {
    let output = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut reader = master.try_clone().unwrap();
    let sink = output.clone();
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    output
}

/// Waits (at most `within`) until `output` holds `text`; returns all of it.
fn shows(output: &std::sync::Mutex<Vec<u8>>, text: &str, within: std::time::Duration) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        let out = String::from_utf8_lossy(&output.lock().unwrap()).into_owned();
        if out.contains(text) {
            return out;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the terminal never showed {text:?}; it showed:\n{out}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// An interactive bash on a fresh pty, the way an operator's terminal runs it: the shell
/// leads its own session with the pty as controlling terminal; its output is collected.
struct PtyShell(OnTerminal);

impl PtyShell {
    fn start() -> Self {
        let mut cmd = Command::new("/bin/bash");
        cmd.args(["--norc", "--noprofile", "-i"]).env("PS1", "$ ");
        PtyShell(OnTerminal::spawn(cmd, true))
    }

    fn type_line(&mut self, line: &str) {
        self.0.type_bytes(line.as_bytes());
        self.0.type_bytes(b"\n");
    }

    /// Waits until the shell has printed `text`; returns everything printed so far.
    fn wait_for(&self, text: &str) -> String {
        self.0.wait_for(text, std::time::Duration::from_secs(60))
    }
}

#[test]
fn a_sandboxed_command_cannot_push_input_into_the_operators_shell() {
    if !can_run() {
        return;
    }
    let _legacy = LegacyTiocsti::enable();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("injected");
    let mut shell = PtyShell::start();
    // The probe pushes `touch MARKER` and a newline into its stdin's terminal: were it
    // honoured, the operator's root shell would read and run that line once the sandbox
    // exits. The arithmetic keeps the markers apart from the terminal's echo of the input.
    shell.type_line(&format!(
        "{} sandbox run --quiet --profile isolated -- {} tiocsti $'touch {}\\n'; echo SANDBOX-$((40+2))",
        env!("CARGO_BIN_EXE_flowhost"),
        shared_copy("flowhost-probe").display(),
        marker.display()
    ));
    let out = shell.wait_for("SANDBOX-42");
    shell.type_line("echo SHELL-$((40+3))");
    let out = format!("{out}{}", shell.wait_for("SHELL-43"));
    shell.type_line("exit");
    let _ = shell.0.child.wait();
    assert!(
        !marker.exists(),
        "a line pushed from inside the sandbox ran in the operator's shell:\n{out}"
    );
    assert!(
        out.contains("\"mode\":\"tiocsti\",\"result\":\"errno\",\"errno\":1"),
        "TIOCSTI was not refused with EPERM:\n{out}"
    );
}

/// What the command leaves open on the caller's terminal (here the start of a window
/// title, which would swallow what follows) does not swallow flowhost's verdicts: each batch
/// of its messages first ends any open sequence and attribute. Before, the REFUSED line went
/// into the window title, unseen.
#[test]
fn a_commands_open_terminal_sequence_does_not_hide_flowhosts_verdicts() {
    if !can_run() {
        return;
    }
    let mut shell = PtyShell::start();
    shell.type_line(&format!(
        "{} sandbox run --profile brokered -- /bin/bash -c \"printf '\\033]0;'; exec 3<>/dev/tcp/192.0.2.1/80\"; echo SANDBOX-$((40+2))",
        env!("CARGO_BIN_EXE_flowhost"),
    ));
    let out = shell.wait_for("SANDBOX-42");
    shell.type_line("exit");
    let _ = shell.0.child.wait();
    let opened = out
        .find("\x1b]0;")
        .expect("the command's output reached the terminal");
    let refused = out[opened..].find("REFUSED").map(|i| opened + i);
    let reset = out[opened..]
        .find("\x18\x1b\\\x1b[0m\x0f\x1b(B")
        .map(|i| opened + i);
    assert!(
        matches!((reset, refused), (Some(r), Some(v)) if r < v),
        "the verdict was not preceded by a reset of the terminal: {out:?}"
    );
}

/// At its end, a run undoes on the caller's terminal what the command changed there and
/// did not change back (a background colour, mouse reports, the alternate screen), and
/// nothing else. Before, every run from a terminal reset the default colours and the palette
/// (undoing colours the user had set) and left mouse reports and the alternate screen on.
#[test]
fn a_run_undoes_what_the_command_left_on_the_terminal_and_only_that() {
    if !can_run() {
        return;
    }
    let flowhost = env!("CARGO_BIN_EXE_flowhost");
    let mut shell = PtyShell::start();
    shell.type_line(&format!(
        "{flowhost} sandbox run --quiet --profile isolated -- /bin/sh -c 'echo PLAIN-$((1+1))'; \
         echo FIRST-$((40+2))"
    ));
    let first = shell.wait_for("FIRST-42");
    shell.type_line(&format!(
        "{flowhost} sandbox run --quiet --profile isolated -- /bin/sh -c \
         \"printf 'CHANGING\\033]11;#000000\\007\\033[?1000;1006h\\033[?1049h'\"; \
         echo SECOND-$((40+2))"
    ));
    let out = shell.wait_for("SECOND-42");
    shell.type_line("exit");
    let _ = shell.0.child.wait();
    let plain = first.find("PLAIN-2").expect("the first command ran");
    let first = &first[plain..];
    for undone in [
        "\x1b]110",
        "\x1b]111",
        "\x1b]104",
        "\x1b[?1000l",
        "\x1b[?1049l",
    ] {
        assert!(
            !first.contains(undone),
            "a command that changed nothing had {undone:?} undone: {first:?}"
        );
    }
    let changing = out.rfind("CHANGING").expect("the second command ran");
    let second = &out[changing..];
    for undone in [
        "\x1b]111\x1b\\",
        "\x1b[?1000l",
        "\x1b[?1006l",
        "\x1b[?1049l",
    ] {
        assert!(
            second.contains(undone),
            "{undone:?} was not undone after the command: {second:?}"
        );
    }
    assert!(!second.contains("\x1b]110"), "{second:?}");
}

/// flowhost's last words (here the gate's verdict) come after everything the command wrote
/// to its terminal, however far the terminal is behind when the command ends. Before, they
/// were relayed as they came, between two chunks of the command's output still on its
/// terminal, whose rest (cursor movements included) then followed and could write over them.
#[test]
fn the_verdict_comes_after_the_commands_last_output() {
    if !can_run_on_a_terminal() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let declared = common::harness::surface_allowing(dir.path(), "127.0.0.1:9".parse().unwrap());
    let (master, slave) = open_pty();
    let mut cmd = flowhost();
    cmd.args([
        "sandbox",
        "run",
        "--quiet",
        "--profile",
        "brokered",
        "--records",
    ])
    .arg(dir.path().join("records"))
    .arg("--declared")
    .arg(&declared)
    .args([
        "--",
        "/bin/sh",
        "-c",
        "yes 0123456789abcdef | head -c 400000; printf LAST-OUTPUT",
    ])
    .stdin(slave.try_clone().unwrap())
    .stdout(slave.try_clone().unwrap())
    .stderr(slave.try_clone().unwrap());
    // SAFETY: setsid and ioctl are async-signal-safe.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    // Only flowhost holds the terminal now (the command keeps its copies until dropped), so
    // reading it ends (EIO) when flowhost does.
    drop((cmd, slave));
    nix::fcntl::fcntl(
        &master,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .unwrap();
    // A slow terminal: the command's output waits on its own terminal as it ends.
    let mut master = std::fs::File::from(master);
    let mut shown = Vec::new();
    let mut buf = [0u8; 2048];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        match std::io::Read::read(&mut master, &mut buf) {
            Ok(0) => break,
            Ok(n) => shown.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the run did not end: {}",
            String::from_utf8_lossy(&shown[shown.len().saturating_sub(300)..])
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert!(child.wait().unwrap().success());
    let shown = String::from_utf8_lossy(&shown);
    let last = shown
        .rfind("LAST-OUTPUT")
        .expect("the command's last output was shown");
    let verdict = shown.rfind("gate passed").expect("the verdict was shown");
    assert!(
        verdict > last,
        "the verdict came {} bytes before the command's last output",
        last - verdict
    );
}

/// A command run from a terminal cannot attach a line discipline to the pseudo-terminal it
/// is given: attaching one loads that discipline's kernel module on demand, code with a
/// history of privilege escalations. Before, the ioctl went through.
#[test]
fn a_sandboxed_command_cannot_attach_a_line_discipline() {
    if !can_run() {
        return;
    }
    let mut shell = PtyShell::start();
    shell.type_line(&format!(
        "{} sandbox run --quiet --profile isolated -- {} tiocsetd; echo SANDBOX-$((40+2))",
        env!("CARGO_BIN_EXE_flowhost"),
        shared_copy("flowhost-probe").display(),
    ));
    let out = shell.wait_for("SANDBOX-42");
    shell.type_line("exit");
    let _ = shell.0.child.wait();
    assert!(
        out.contains("\"mode\":\"tiocsetd\",\"result\":\"errno\",\"errno\":1"),
        "TIOCSETD was not refused with EPERM:\n{out}"
    );
}

/// A profile directory (new, in the shared test directory, named after `dir` and this
/// process) holding `name.toml`: the built-in `isolated` profile with `from` replaced by
/// `to`.
fn isolated_variant(dir: &str, name: &str, edit: (&str, &str)) -> std::path::PathBuf {
    isolated_variant_of(dir, name, &[edit])
}

/// [`isolated_variant`] with every one of `edits` made.
fn isolated_variant_of(dir: &str, name: &str, edits: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = common::shared_dir().join(format!("{dir}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/profiles/isolated.toml"
    ))
    .unwrap();
    for (from, to) in edits {
        assert!(
            text.contains(from),
            "{from:?} is not in the isolated profile"
        );
        text = text.replace(from, to);
    }
    std::fs::write(dir.join(format!("{name}.toml")), text).unwrap();
    dir
}

#[test]
fn bounds_are_reported_and_a_required_bound_that_cannot_be_held_refuses_the_run() {
    if !can_run() {
        return;
    }
    if let Some(b) = common::broker()
        && common::swap_uncapped(&b.bounds(&common::profile("isolated")))
    {
        return;
    }
    let have_setpriv = Command::new("sh")
        .args(["-c", "command -v setpriv"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_setpriv {
        eprintln!("SKIP: needs setpriv to act as a service user");
        return;
    }
    // A profile demanding its whole-executor bounds, readable by the service user.
    let dir = isolated_variant(
        "required-profile",
        "strict",
        ("cgroup = \"best_effort\"", "cgroup = \"required\""),
    );
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(
        dir.join("strict.toml"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();

    // As root the cgroups are writable: the run goes ahead and says what holds each bound.
    let out = flowhost()
        .args(["sandbox", "run", "--profile", "strict", "--profiles-dir"])
        .arg(&dir)
        .args(["--", "/bin/true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "bounds of profile \"strict\" from {}:",
            dir.join("strict.toml").display()
        )),
        "the report names the file the profile came from: {stderr}"
    );
    assert!(
        stderr.contains("limits.memory_mib: 4096 MiB per executor (by cgroup")
            && stderr.contains("limits.tasks: 1024 tasks per executor (by cgroup")
            && stderr.contains("a uid (and gid) of its own"),
        "{stderr}"
    );

    // A service user holding the broker's capabilities but no write access to any cgroup
    // cannot hold the bounds: the required profile is refused, naming the field and why.
    let bin = common::shared_flowhost();
    let as_service = |profile: &str| {
        common::as_service_user(common::BROKER_CAPS, &bin)
            .args(["sandbox", "run", "--profile", profile, "--profiles-dir"])
            .arg(&dir)
            .args(["--", "/bin/true"])
            .output()
            .unwrap()
    };
    let out = as_service("strict");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("sets limits.memory_mib with limits.cgroup = \"required\"")
            && stderr.contains("cannot create cgroups beneath"),
        "{stderr}"
    );
    // The built-in best-effort profile runs, and says which bounds are not in force.
    let out = as_service("isolated");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("limits.memory_mib: 4096 MiB per executor NOT IN FORCE"),
        "{stderr}"
    );
    // With --quiet too, which silences only what holds: before, nothing was said.
    let out = common::as_service_user(common::BROKER_CAPS, &bin)
        .args(["sandbox", "run", "--quiet", "--profile", "isolated", "--"])
        .arg("/bin/true")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("not in force:")
            && stderr.contains("limits.memory_mib: 4096 MiB per executor NOT IN FORCE")
            && !stderr.contains("(by "),
        "{stderr}"
    );
}

/// Runs `/bin/true` as uid 65534 under profile `name`, an `isolated` variant written into
/// a new directory `dir` (then given `mode`), and expects the run refused with a message
/// saying each of `why` (`DIR` standing for the directory). Skips (saying why) where the
/// unprivileged mode cannot run here.
fn refused_as_nobody(dir: &str, name: &str, edit: (&str, &str), mode: u32, why: &[&str]) {
    refused_as_nobody_with(dir, name, &[edit], mode, why)
}

/// [`refused_as_nobody`] with every one of `edits` made.
fn refused_as_nobody_with(dir: &str, name: &str, edits: &[(&str, &str)], mode: u32, why: &[&str]) {
    use common::harness::{As, can_run as can_run_as, flowhost as flowhost_as};
    use std::os::unix::fs::PermissionsExt;
    let binary = common::harness::flowhost_for(As::Nobody);
    if !can_run_as(As::Nobody, &[&binary]) {
        return;
    }
    let dir = isolated_variant_of(dir, name, edits);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
    let out = flowhost_as(As::Nobody)
        .args([
            "sandbox",
            "run",
            "--quiet",
            "--profile",
            name,
            "--profiles-dir",
        ])
        .arg(&dir)
        .args(["--", "/bin/true"])
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).replace(&dir.display().to_string(), "DIR");
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for part in why {
        assert!(stderr.contains(part), "{part:?} is not said: {stderr}");
    }
}

/// Run unprivileged, the command has its caller's uid, and Landlock does not govern a
/// file's mode, times or extended attributes: it could make the caller's private key
/// world-readable, or back-date a file. The view is read-only but for its write paths, so
/// those changes fail (EROFS) everywhere else, and still work where it may write.
#[test]
fn an_unprivileged_command_cannot_change_the_callers_files_outside_its_write_paths() {
    use common::harness::{As, can_run as can_run_as, flowhost as flowhost_as};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let binary = common::harness::flowhost_for(As::Nobody);
    if !can_run_as(As::Nobody, &[&binary]) {
        return;
    }
    // The caller's files, outside /tmp (the command's /tmp is its own).
    let dir = tempfile::Builder::new()
        .prefix("flowhost-ro-view-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let (private, writable) = (dir.path().join("private"), dir.path().join("writable"));
    std::fs::create_dir(&writable).unwrap();
    let key = private.join("key");
    std::fs::create_dir(&private).unwrap();
    std::fs::write(&key, "secret").unwrap();
    std::fs::write(writable.join("mine"), "x").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    for p in [
        dir.path(),
        &private,
        &key,
        &writable,
        &writable.join("mine"),
    ] {
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    }
    let script = format!(
        "chmod 644 {key} 2>&1; touch -d 2001-01-01 {key} 2>&1; \
         chmod 600 {mine} && echo chmod-ok; echo new > {new} && echo write-ok",
        key = key.display(),
        mine = writable.join("mine").display(),
        new = writable.join("new").display(),
    );
    // The command's stdout, as uid 65534 with `writes` as its write paths.
    let run = |writes: &[&std::path::Path], script: &str| {
        let mut cmd = flowhost_as(As::Nobody);
        cmd.args(["sandbox", "run", "--quiet", "--profile", "isolated"]);
        for w in writes {
            cmd.arg("--write").arg(w);
        }
        let out = cmd.args(["--", "/bin/sh", "-c", script]).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stdout}{stderr}");
        stdout
    };
    let stdout = run(&[&writable], &script);
    let meta = std::fs::metadata(&key).unwrap();
    assert_eq!(
        meta.mode() & 0o777,
        0o600,
        "the key's mode changed: {stdout}"
    );
    assert!(
        meta.mtime() > 1_000_000_000 + 365 * 86400,
        "back-dated: {stdout}"
    );
    assert_eq!(
        stdout.matches("Read-only file system").count(),
        2,
        "{stdout}"
    );
    assert!(
        stdout.contains("chmod-ok") && stdout.contains("write-ok"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::metadata(writable.join("mine")).unwrap().mode() & 0o777,
        0o600
    );

    // A write path with a file system mounted beneath it, and one the host has read-only.
    // Before, the first refused the spawn (a bind without the mounts beneath it cannot be
    // made in the executor's user namespace) and the second too (its read-only flag is
    // locked there): both now run, and each is as writable as the host has it.
    struct Unmount(Vec<std::path::PathBuf>);
    impl Drop for Unmount {
        fn drop(&mut self) {
            for p in self.0.iter().rev() {
                let _ = Command::new("umount").arg(p).status();
            }
        }
    }
    let (beneath, frozen) = (writable.join("beneath"), dir.path().join("frozen"));
    std::fs::create_dir(&beneath).unwrap();
    std::fs::create_dir(&frozen).unwrap();
    let mut mounted = Unmount(Vec::new());
    let mount = |args: &[&str], at: &std::path::Path| {
        let ok = Command::new("mount")
            .args(args)
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mount {args:?} {}", at.display());
    };
    mount(&["-t", "tmpfs", "-o", "mode=0777", "tmpfs"], &beneath);
    mounted.0.push(beneath.clone());
    mount(&["--bind", &frozen.display().to_string()], &frozen);
    mounted.0.push(frozen.clone());
    mount(&["-o", "remount,bind,ro"], &frozen);
    let script = format!(
        "echo in > {b}/file && echo beneath-ok; echo in > {f}/file 2>&1 || echo frozen-refused",
        b = beneath.display(),
        f = frozen.display(),
    );
    let stdout = run(&[&writable, &frozen], &script);
    assert!(
        stdout.contains("beneath-ok") && stdout.contains("frozen-refused"),
        "{stdout}"
    );
    drop(mounted);
}

/// A profile file the user cannot read stops the run, naming the file: it is not replaced
/// by the built-in profile of that name, whose bounds may be looser than the operator's.
/// (`/etc/flowhost/profiles` is 0750 root:flowhost; a user outside the group gets EACCES.)
#[test]
fn an_unreadable_profile_file_refuses_the_run_instead_of_the_builtin() {
    let edit = ("tasks = 1024", "tasks = 64");
    let why = ["DIR/isolated.toml", "Permission denied"];
    refused_as_nobody("unreadable-profile", "isolated", edit, 0o750, &why);
}

/// Without a mount namespace, an unprivileged command (the caller's uid) would see the
/// host's /proc, where the flowhost process that brokers it is readable to it (its
/// environment, memory maps, open descriptors): such a profile is refused, not run with a
/// warning.
#[test]
fn an_unprivileged_run_refuses_a_profile_without_a_mount_namespace() {
    let edits = [
        ("mount = true", "mount = false"),
        ("private_tmp = true", "private_tmp = false"),
    ];
    let why = [
        "namespaces.mount = false",
        "an unprivileged host does not run",
    ];
    refused_as_nobody_with("no-mount-namespace", "isolated", &edits, 0o755, &why);
}

/// Every record in the `.jsonl` files of `dir`.
fn records_in(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `--allow NAME:PORT`: the command's lookups are answered by flowhost (only the allowed name
/// resolves; the other is never asked upstream and its refusal is recorded), the connection
/// to the address handed out is judged and recorded with the name, and a connection to the
/// same address without a lookup is judged by address rules alone (and refused).
#[test]
fn host_name_rules_are_mediated_lookups_recorded_with_the_name() {
    if !can_run() {
        return;
    }
    use common::named::{BODY, TestDns, TestHttp};
    let _lookups = lookups();
    let dns = TestDns::start();
    let http = TestHttp::start();
    let records = common::shared_dir().join(format!("sandbox-names-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&records);
    let allow = format!("fetch.test:{}", http.port);
    let run = |script: String, records: Option<&std::path::Path>| {
        let mut cmd = flowhost();
        // TestDns answers fetch.test with 127.0.0.1: the run opts in for it.
        cmd.args(["sandbox", "run", "--profile", "brokered", "--allow", &allow])
            .args(["--dns-upstream", &dns.addr.to_string()])
            .args(["--private-answers", "fetch.test"]);
        if let Some(dir) = records {
            cmd.arg("--records").arg(dir);
        }
        let out = cmd
            .args(["--", "/bin/bash", "-c", &script])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let (stdout, stderr) = run(
        format!(
            "exec 3<>/dev/tcp/fetch.test/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3; \
             getent hosts other.test || echo other-unresolved",
            port = http.port
        ),
        Some(&records),
    );
    assert!(stdout.contains(BODY), "{stdout}\n{stderr}");
    assert!(stdout.contains("other-unresolved"), "{stdout}");
    assert!(
        stderr.contains(&format!(
            "connect inet/stream/tcp 127.0.0.1:{} (fetch.test) by pid",
            http.port
        )) && stderr.contains(&format!("ALLOWED (allow {allow})")),
        "{stderr}"
    );
    assert!(
        stderr.contains("dns_query A other.test (udp) -> REFUSED (default)"),
        "{stderr}"
    );
    assert!(dns.asked("fetch.test.") >= 1);
    assert_eq!(
        dns.asked("other.test."),
        0,
        "a refused name is never asked upstream"
    );
    assert_eq!(http.connections(), 1);

    let lines = records_in(&records);
    let broker = |r: &serde_json::Value| r["flowhost"]["broker"].clone();
    let connect = lines
        .iter()
        .find(|r| broker(r)["syscall"] == "connect")
        .expect("the connect is recorded");
    assert_eq!(connect["decision"]["effect"], "allow");
    assert_eq!(broker(connect)["destination"]["host_name"], "fetch.test");
    let refused = lines
        .iter()
        .find(|r| broker(r)["destination"]["host_name"] == "other.test")
        .expect("the refused lookup is recorded");
    assert_eq!(broker(refused)["syscall"], "dns_query");
    assert_eq!(refused["flowhost"]["denial_kind"], "name_not_allowed");
    let answered: Vec<_> = lines
        .iter()
        .filter(|r| {
            broker(r)["destination"]["host_name"] == "fetch.test"
                && broker(r)["syscall"] == "dns_query"
        })
        .collect();
    assert!(
        !answered.is_empty() && answered.iter().all(|r| r["decision"]["effect"] == "allow"),
        "answered lookups are recorded, as allowed: {lines:?}"
    );
    let verify = flowhost()
        .args(["records", "verify"])
        .arg(&records)
        .output()
        .unwrap();
    assert!(verify.status.success(), "{verify:?}");
    std::fs::remove_dir_all(&records).unwrap();

    // The same address, hard-coded, with no lookup: only address rules judge it.
    let (stdout, stderr) = run(
        format!(
            "exec 3<>/dev/tcp/127.0.0.1/{} || echo direct-refused",
            http.port
        ),
        None,
    );
    assert!(stdout.contains("direct-refused"), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "connect inet/stream/tcp 127.0.0.1:{} by pid",
            http.port
        )) && stderr.contains("REFUSED (default)"),
        "{stderr}"
    );
    assert_eq!(http.connections(), 1, "the refused connect never arrived");
}

/// A stderr nobody reads (a pipe into a pager left unscrolled) holds up none of the run:
/// its `--timeout` still ends the command while what flowhost says waits. Before, the
/// run's one thread stopped in `write` once the pipe was full, and the command ran on past
/// its timeout until someone read.
#[test]
fn a_stderr_nobody_reads_does_not_hold_up_the_timeout() {
    if !can_run() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let records = common::shared_dir().join(format!("sandbox-unread-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&records);
    let dir = common::executor_visible_dir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let alive = dir.path().join("alive");
    // The command says it is alive, five times a second, until it is ended; meanwhile each
    // refused connect is a line on stderr: far more than a pipe holds.
    let mut child = flowhost()
        .args([
            "sandbox",
            "run",
            "--profile",
            "isolated",
            "--timeout",
            "2",
            "--records",
        ])
        .arg(&records)
        .arg("--write")
        .arg(dir.path())
        .args(["--", "/bin/bash", "-c"])
        .arg(format!(
            "(while :; do echo >> {}; sleep 0.2; done) & \
             for i in $(seq 3000); do {{ : 3<>/dev/tcp/127.0.0.1/9; }} 2>/dev/null; done; \
             wait",
            alive.display()
        ))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let size = || std::fs::metadata(&alive).map(|m| m.len()).unwrap_or(0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    // Ended by its timeout while nobody reads flowhost's stderr: the file stops growing.
    let mut last = (size(), std::time::Instant::now());
    let ended = loop {
        std::thread::sleep(std::time::Duration::from_millis(250));
        let now = size();
        if now != last.0 {
            last = (now, std::time::Instant::now());
        } else if now > 0 && last.1.elapsed() > std::time::Duration::from_secs(2) {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
    };
    // Read now, so that flowhost can end either way.
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&records);
    assert!(
        ended,
        "the command ran on past its 2 s timeout while stderr was not read"
    );
    assert_eq!(
        status.code(),
        Some(137),
        "{}",
        &err[err.len().saturating_sub(2000)..]
    );
    assert!(
        err.contains("127.0.0.1:9"),
        "{}",
        &err[..err.len().min(2000)]
    );
}

/// Once its command has ended, a run whose stderr nobody reads closes its records and
/// writes its health before it waits for the reader, and a `kill` then ends it. Before
/// (in review of the queue above), it waited first, its records open, with SIGTERM caught.
#[test]
fn a_run_closes_its_evidence_before_waiting_for_stderr_and_a_kill_ends_the_wait() {
    if !can_run() {
        return;
    }
    let dir = common::executor_visible_dir();
    let health = dir.path().join("health.json");
    let records = dir.path().join("records");
    let mut child = flowhost()
        .args(["sandbox", "run", "--profile", "isolated", "--records"])
        .arg(&records)
        .arg("--health")
        .arg(&health)
        .args(["--", "/bin/bash", "-c"])
        .arg("for i in $(seq 3000); do { : 3<>/dev/tcp/127.0.0.1/9; } 2>/dev/null; done")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !health.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let written = health.exists();
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let ended = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        child.try_wait().unwrap().is_some()
    });
    if !ended {
        let _ = child.kill();
    }
    let status = child.wait().unwrap();
    assert!(written, "no health while stderr was not read");
    assert!(ended, "a kill did not end the wait for stderr");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM),
        "{status:?}"
    );
    let verified = flowhost()
        .args(["records", "verify"])
        .arg(&records)
        .output()
        .unwrap();
    assert!(verified.status.success(), "{verified:?}");
}

/// A command named by a relative path is run by that path made absolute, not by where its
/// links lead: a venv's `bin/python` (a link) finds its venv, and a multi-call program its
/// name, by the path it was run as. Before, `./named` ran as `/usr/bin/cat`; and one that is
/// not there is said so, not "not found in PATH".
#[test]
fn a_relative_command_keeps_its_name() {
    if !can_run() {
        return;
    }
    let dir = common::executor_visible_dir();
    std::os::unix::fs::symlink("/bin/cat", dir.path().join("named")).unwrap();
    let out = flowhost()
        .current_dir(dir.path())
        .args(["sandbox", "run", "--quiet", "--profile", "isolated"])
        .args(["--", "./named", "/proc/self/cmdline"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.starts_with(&format!("{}/named\0", dir.path().display())),
        "{stdout:?}"
    );
    let out = flowhost()
        .current_dir(dir.path())
        .args(["sandbox", "run", "--quiet", "--profile", "isolated"])
        .args(["--", "./absent"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("absent: No such file"), "{stderr}");
}

/// A `--read` or `--write` path that is not there is refused before anything runs, naming
/// the option and the path; one under the command's own /tmp is its to make. Before, its
/// rule was skipped and the command was denied the path with no word of why.
#[test]
fn a_read_or_write_path_that_is_not_there_is_refused() {
    if !can_run() {
        return;
    }
    for option in ["--read", "--write"] {
        let out = flowhost()
            .args([
                "sandbox",
                "run",
                "--profile",
                "isolated",
                option,
                "/no/such/dir",
            ])
            .args(["--", "/bin/true"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("{option} /no/such/dir")),
            "{stderr}"
        );
        assert!(stderr.contains("nothing was run"), "{stderr}");
    }
    let out = flowhost()
        .args(["sandbox", "run", "--quiet", "--profile", "isolated"])
        .args(["--write", "/tmp/made-by-the-command", "--", "/bin/true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// What the host's own parts log while a command runs reaches stderr: here the command's
/// resolver, whose upstream never answers. Before, nothing was set up to log, and the
/// command only saw its lookup fail.
#[test]
fn a_resolver_whose_upstream_never_answers_says_so() {
    if !can_run() {
        return;
    }
    let _lookups = lookups();
    let out = flowhost()
        .args([
            "sandbox",
            "run",
            "--profile",
            "brokered",
            "--allow",
            "gone.test:443",
        ])
        .args(["--dns-upstream", "127.0.0.1:1"])
        .args(["--", "/bin/bash", "-c", "getent hosts gone.test; echo done"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("done"),
        "{stderr}"
    );
    assert!(
        stderr.contains("no upstream resolver answered") && stderr.contains("127.0.0.1:1"),
        "{stderr}"
    );
}

/// A query the command's resolver does not serve (here two questions in one) is refused
/// and recorded, with why, though no rule is asked: before, it was only logged at debug, so
/// the records did not show it.
#[test]
fn a_query_not_served_is_recorded() {
    if !can_run() {
        return;
    }
    let _lookups = lookups();
    let dns = common::named::TestDns::start();
    let records = common::shared_dir().join(format!("sandbox-unserved-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&records);
    // A standard query (id 0x1234, recursion desired) asking a.test and b.test at once,
    // from a socket kept open as a resolver client keeps it for the answer (the resolver
    // answers only a socket it can see is an executor's).
    let two = r"\x12\x34\x01\x00\x00\x02\x00\x00\x00\x00\x00\x00\x01a\x04test\x00\x00\x01\x00\x01\x01b\x04test\x00\x00\x01\x00\x01";
    let out = flowhost()
        .args(["sandbox", "run", "--profile", "brokered"])
        .args(["--dns-upstream", &dns.addr.to_string()])
        .arg("--records")
        .arg(&records)
        .args(["--", "/bin/bash", "-c"])
        .arg(format!(
            "ns=$(awk '/^nameserver/ {{ print $2; exit }}' /etc/resolv.conf); \
             exec 3<>/dev/udp/$ns/53 && printf '{two}' >&3 && sleep 0.5 && echo sent"
        ))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("sent"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains(
            "dns_query - - (udp) -> REFUSED (query not served: 2 questions in one query)"
        ),
        "{stderr}"
    );
    let lines = records_in(&records);
    let refused: Vec<_> = lines
        .iter()
        .filter(|r| r["flowhost"]["broker"]["syscall"] == "dns_query")
        .collect();
    assert_eq!(refused.len(), 1, "{lines:?}");
    assert_eq!(refused[0]["decision"]["effect"], "deny");
    assert_eq!(refused[0]["flowhost"]["denial_kind"], "query_not_served");
    assert!(
        refused[0]["flowhost"]["broker"]["destination"]["host_name"].is_null(),
        "{:?}",
        refused[0]
    );
    assert_eq!(dns.asked("a.test."), 0, "never asked upstream");
    let verify = flowhost()
        .args(["records", "verify"])
        .arg(&records)
        .output()
        .unwrap();
    assert!(verify.status.success(), "{verify:?}");
    std::fs::remove_dir_all(&records).unwrap();
}

/// A command whose lookups flowhost answers makes none elsewhere: a query to port 53 of any
/// address but its own resolver is refused, whatever the rules allow. Before, such a query
/// went by address rules, so where they allowed it the lookup left unjudged. That is also
/// where a long-running command is left when the host replaces its `/etc/resolv.conf` by a
/// rename (systemd-resolved, NetworkManager): the kernel drops every bind mount on the
/// replaced file, in the command's namespace too, and the command then reads the host's.
#[test]
fn a_lookup_past_the_commands_resolver_is_refused_even_after_the_host_replaces_its_file() {
    if !can_run() {
        return;
    }
    use std::io::{BufRead, Write};
    let _lookups = lookups();
    let dns = common::named::TestDns::start();
    let mut child = flowhost()
        .args(["sandbox", "run", "--profile", "brokered"])
        .args(["--allow", "127.0.0.1:53"])
        .args(["--dns-upstream", &dns.addr.to_string()])
        .args(["--", "/bin/bash", "-c"])
        .arg(
            "send() { (echo x > /dev/udp/127.0.0.1/53) 2>/dev/null && echo \"$1-sent\" || echo \"$1-refused\"; }; \
             grep -c '^nameserver 127\\.53\\.' /etc/resolv.conf; send before; read go; \
             grep -c '^nameserver 127\\.53\\.' /etc/resolv.conf; send after",
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = || {
        let mut l = String::new();
        stdout.read_line(&mut l).unwrap();
        l.trim().to_string()
    };
    assert_eq!(line(), "1", "the command is shown its own resolver");
    assert_eq!(line(), "before-refused");

    // The host replaces its file (same contents) by a rename, as its resolver managers do.
    let replaced = common::ReplacedResolvConf::now();
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let shown_after = line();
    let after = line();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    if replaced.is_some() {
        // The kernel dropped the bind mount: the command now reads the host's file.
        assert_eq!(shown_after, "0", "{stderr}");
    }
    assert_eq!(after, "after-refused", "{stderr}");
    let refusals = stderr
        .matches("connect inet/dgram/udp 127.0.0.1:53 by pid")
        .count();
    assert_eq!(refusals, 2, "{stderr}");
    assert_eq!(
        stderr
            .matches("REFUSED (a lookup past the executor's own resolver (127.0.0.1:53")
            .count(),
        2,
        "{stderr}"
    );
}

/// `--quiet` without `--records`: nothing is printed or recorded, so each verdict is given
/// by the rules as soon as the attempt is known (on the broker's supervision thread). The
/// verdicts are the same: an allowed address and an allowed name connect, a name and an
/// address no rule allows are refused.
#[test]
fn quiet_runs_are_judged_at_once_by_the_same_rules() {
    if !can_run() {
        return;
    }
    use common::named::{BODY, TestDns, TestHttp};
    let _lookups = lookups();
    let dns = TestDns::start();
    let http = TestHttp::start();
    let sink = TcpSink::start();
    let other = TcpSink::start();
    let allow = format!("fetch.test:{}", http.port);
    let run = |script: String| {
        let out = flowhost()
            .args(["sandbox", "run", "--quiet", "--profile", "brokered"])
            .args(["--allow", &allow, "--allow", &sink.addr.to_string()])
            .args(["--dns-upstream", &dns.addr.to_string()])
            .args(["--private-answers", "fetch.test"])
            .args(["--", "/bin/bash", "-c", &script])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !stderr.contains(" by pid "),
            "a quiet run prints no attempts: {stderr}"
        );
        format!("{}\n{stderr}", String::from_utf8_lossy(&out.stdout))
    };
    let sink_port = sink.addr.port();
    let stdout = run(format!(
        "exec 3<>/dev/tcp/fetch.test/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3; \
         getent hosts other.test || echo other-unresolved; \
         (exec 4<>/dev/tcp/127.0.0.1/{sink_port} && printf quiet-bytes >&4) || echo sink-refused; \
         (exec 5<>/dev/tcp/127.0.0.1/{other}) 2>/dev/null || echo other-refused",
        port = http.port,
        other = other.addr.port(),
    ));
    assert!(stdout.contains(BODY), "{stdout}");
    assert!(stdout.contains("other-unresolved"), "{stdout}");
    assert!(!stdout.contains("sink-refused"), "{stdout}");
    assert!(stdout.contains("other-refused"), "{stdout}");
    assert_eq!(other.connections(), 0, "the refused connect never arrived");
    assert_eq!(
        dns.asked("other.test."),
        0,
        "a refused name is never asked upstream"
    );
    assert_eq!(
        http.connections(),
        1,
        "only the lookup-backed connect arrived"
    );
    for _ in 0..50 {
        if sink.bytes() == b"quiet-bytes" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(sink.bytes(), b"quiet-bytes");
}

/// Executor cgroups named after `pid` (`flowhost-exec-PID-START-N`) anywhere beneath
/// /sys/fs/cgroup (the broker puts them beneath its own cgroup of each hierarchy).
fn executor_cgroups_of(pid: u32) -> Vec<std::path::PathBuf> {
    let prefix = format!("flowhost-exec-{pid}-");
    let mut found = Vec::new();
    let mut dirs = vec![(std::path::PathBuf::from("/sys/fs/cgroup"), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                found.push(entry.path());
            } else if depth < 4 {
                dirs.push((entry.path(), depth + 1));
            }
        }
    }
    found
}

/// Processes whose command line is exactly `argv` (zombies have none).
fn processes_running(argv: &[&str]) -> Vec<u32> {
    let want: Vec<u8> = argv
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want))
        .collect()
}

#[test]
fn a_run_ends_with_the_commands_cgroup_and_everything_left_in_it() {
    if !can_run() {
        return;
    }
    // Without a pid namespace a command can leave a process behind when it exits. The run
    // must not end before that process is killed and the command's cgroups are removed:
    // before the fix it returned while its reaper thread was still at it, so the process
    // could outlive the run and the cgroups stayed until another broker swept them.
    let dir = isolated_variant("no-pidns-profile", "nopidns", ("pid = true", "pid = false"));
    let sleeper = ["sleep", "37.125"];
    for _ in 0..3 {
        let mut child = flowhost()
            .args([
                "sandbox",
                "run",
                "--quiet",
                "--profile",
                "nopidns",
                "--profiles-dir",
            ])
            .arg(&dir)
            .args(["--", "/bin/sh", "-c"])
            .arg(format!("{} {} & exit 0", sleeper[0], sleeper[1]))
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(child.wait().unwrap().success());
        let left = executor_cgroups_of(pid);
        let running = processes_running(&sleeper);
        for p in &running {
            // SAFETY: a signal to a process this test's command left behind.
            unsafe { libc::kill(*p as i32, libc::SIGKILL) };
        }
        assert!(left.is_empty(), "cgroups left behind: {left:?}");
        assert!(
            running.is_empty(),
            "processes outlived the run: {running:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Without a pid namespace, only the command's cgroup reaches what it leaves behind when it
/// is killed; an unprivileged broker makes none. Such a profile is refused, saying why,
/// rather than a kill that leaves the command's children running.
#[test]
fn a_profile_without_a_pid_namespace_is_refused_where_no_cgroup_holds_the_tree() {
    let edit = ("pid = true", "pid = false");
    let why = ["\"nopidns\"", "namespaces.pid = false"];
    refused_as_nobody("nopidns-unprivileged", "nopidns", edit, 0o755, &why);
}

/// A terminal the caller owns is not readable from inside the sandbox. Run unprivileged, the
/// command's uid is the caller's, and a login gives its user the terminals it types into: with
/// all of `/dev` readable, `cat /dev/pts/N` would read the keystrokes typed into the caller's
/// other terminals. The devices commands need (`/dev/null`, `/dev/urandom`, ...) still open.
#[test]
fn a_sandboxed_command_cannot_open_the_callers_other_terminals() {
    use common::harness::{As, NOBODY, can_run as can_run_as, flowhost as flowhost_as};
    use std::os::fd::AsRawFd;
    let binary = common::harness::flowhost_for(As::Nobody);
    if !can_run_as(As::Nobody, &[&binary]) {
        return;
    }
    let (_master, slave) = open_pty();
    let terminal = std::fs::read_link(format!("/proc/self/fd/{}", slave.as_raw_fd())).unwrap();
    // What login does for the user it logs in: the terminal is theirs.
    std::os::unix::fs::chown(&terminal, Some(NOBODY.0), Some(NOBODY.1)).unwrap();
    let script = "head -c 0 \"$1\" && echo OPENED-TERMINAL; \
                  head -c 1 /dev/urandom >/dev/null && echo URANDOM; \
                  head -c 1 /dev/zero >/dev/null && echo ZERO; echo x >/dev/null && echo NULL";
    for who in [As::Root, As::Nobody] {
        let out = flowhost_as(who)
            .args(["sandbox", "run", "--quiet", "--profile", "isolated", "--"])
            .args(["/bin/sh", "-c", script, "sh"])
            .arg(&terminal)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stdout.contains("OPENED-TERMINAL"),
            "{who:?}: the sandbox opened {} (owned by uid {}):\n{stdout}{stderr}",
            terminal.display(),
            NOBODY.0
        );
        for device in ["URANDOM", "ZERO", "NULL"] {
            assert!(
                stdout.contains(device),
                "{who:?}: a device commands need did not open ({device}):\n{stdout}{stderr}"
            );
        }
    }
}

/// The command starts with every signal at its default disposition, as a process started
/// from a shell does. flowhost itself ignores SIGPIPE (as every Rust program does); were
/// that inherited, a command writing into a closed pipe would get EPIPE instead of ending.
#[test]
fn the_command_inherits_no_ignored_signal() {
    if !can_run() {
        return;
    }
    let out = with_interrupts(flowhost(), &[])
        .args(["sandbox", "run", "--quiet", "--profile", "isolated", "--"])
        .args(["/bin/grep", "^SigIgn:", "/proc/self/status"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.trim(), "SigIgn:\t0000000000000000");
}

/// A run started with SIGHUP ignored (`nohup`, as a caller that leaves it behind does)
/// keeps ignoring it: flowhost neither ends of it nor passes it on, and the command starts
/// ignoring it too, as it would under `nohup` alone. Before, flowhost caught the hangup and
/// passed it to the command, which ended of it (129), and the command started with SIGHUP at
/// its default action.
#[test]
fn a_hangup_the_caller_ignores_reaches_neither_flowhost_nor_the_command() {
    if !can_run() {
        return;
    }
    let mut nohup = with_interrupts(Command::new("nohup"), &[]);
    nohup.arg(env!("CARGO_BIN_EXE_flowhost"));
    // nohup has become flowhost: same pid.
    let (code, rest, ignored) = signalled_mid_run(nohup, &[nix::sys::signal::Signal::SIGHUP]);
    assert_eq!((code, rest.as_str()), (Some(0), "DONE\n"));
    assert_eq!(ignored.trim(), "SigIgn:\t0000000000000001");
}

/// Runs `cmd` (flowhost, or what becomes it) as `sandbox run` of a command that prints its
/// `SigIgn:` line, then READY, and DONE half a second later; once READY is read, sends
/// `signals` to flowhost. Returns the exit code, what came after READY, and the `SigIgn:`
/// line.
fn signalled_mid_run(
    mut cmd: Command,
    signals: &[nix::sys::signal::Signal],
) -> (Option<i32>, String, String) {
    let script = "grep '^SigIgn:' /proc/self/status; echo READY; sleep 0.5; echo DONE";
    let mut child = cmd
        .args(["sandbox", "run", "--quiet", "--profile", "isolated", "--"])
        .args(["/bin/sh", "-c", script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut ignored = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut ignored).unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "READY\n");
    for &signal in signals {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
    }
    let status = wait_within(&mut child, &format!("{signals:?}"));
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    (status.code(), rest, ignored)
}

/// `cmd` with SIGHUP, SIGINT, SIGQUIT, SIGTERM and SIGTSTP at their default actions but
/// `ignored`, whatever the test runner was started with (`nohup cargo test` ignores SIGHUP).
fn with_interrupts(mut cmd: Command, ignored: &'static [libc::c_int]) -> Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec this only calls signal(2), which is async-signal-safe,
    // with constants.
    unsafe {
        cmd.pre_exec(move || {
            for signal in [
                libc::SIGHUP,
                libc::SIGINT,
                libc::SIGQUIT,
                libc::SIGTERM,
                libc::SIGTSTP,
            ] {
                let action = if ignored.contains(&signal) {
                    libc::SIG_IGN
                } else {
                    libc::SIG_DFL
                };
                if libc::signal(signal, action) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd
}

/// A run started with SIGINT and SIGTSTP ignored (a background job of a shell without job
/// control ignores SIGINT) takes neither: Ctrl-C's signal and Ctrl-Z's sent to flowhost
/// change nothing, and the command starts ignoring both.
#[test]
fn an_interrupt_and_a_stop_the_caller_ignores_change_nothing() {
    if !can_run() {
        return;
    }
    let (code, rest, ignored) = signalled_mid_run(
        with_interrupts(flowhost(), &[libc::SIGINT, libc::SIGTSTP]),
        &[
            nix::sys::signal::Signal::SIGINT,
            nix::sys::signal::Signal::SIGTSTP,
        ],
    );
    assert_eq!((code, rest.as_str()), (Some(0), "DONE\n"));
    // SIGINT is signal 2, SIGTSTP 20.
    assert_eq!(ignored.trim(), "SigIgn:\t0000000000080002");
}

/// Waits (at most 20 s) for `child` to exit.
fn wait_within(child: &mut std::process::Child, what: &str) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what}: flowhost did not end within 20 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Ctrl-C reaches a command that leaves SIGINT to its default action (which a pid
/// namespace's first process would never get from outside), and the run still ends as a run
/// does: the health written, the records closed and verifiable, the shell told 130. Before,
/// SIGINT ended flowhost at once and the command only through its parent-death signal. The
/// health says the run was cut short: what the command would have done after is not
/// observed (before, it said observation was complete, and a gate passed).
#[test]
fn an_interrupt_ends_the_command_and_the_run_still_concludes() {
    if !can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (records, health) = (dir.path().join("records"), dir.path().join("health.json"));
    let sleeper = ["/bin/sleep", "41.0625"];
    let mut child = flowhost()
        .args([
            "sandbox",
            "run",
            "--quiet",
            "--profile",
            "isolated",
            "--records",
        ])
        .arg(&records)
        .arg("--health")
        .arg(&health)
        .arg("--")
        .args(sleeper)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while processes_running(&sleeper).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the command never ran"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = wait_within(&mut child, "SIGINT");
    assert_eq!(status.code(), Some(130), "{status:?}");
    assert!(
        processes_running(&sleeper).is_empty(),
        "the command outlived the run"
    );
    let written = std::fs::read_to_string(&health).expect("the run's health was written");
    let written: serde_json::Value = serde_json::from_str(&written).unwrap();
    assert_eq!(written["broker_active"], true, "{written}");
    assert_eq!(written["complete"], false, "{written}");
    assert!(
        written["cut_short"].to_string().contains("SIGINT"),
        "{written}"
    );
    let verify = flowhost()
        .args(["records", "verify"])
        .arg(&records)
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stderr)
    );
}

/// A `--health` that cannot be written (its directory mistyped) is refused before the
/// command runs: before, the command ran to its end, egress and all, and only then did the
/// run fail (exit 2, which says nothing ran) with its own status lost.
#[test]
fn a_health_path_that_cannot_be_written_is_refused_before_the_command_runs() {
    if !can_run() {
        return;
    }
    // What `sandbox run --health HEALTH -- CMD...` says on stderr, its exit asserted 2.
    let refused = |health: &std::ffi::OsStr, cmd: &[&str]| {
        let out = flowhost()
            .args([
                "sandbox",
                "run",
                "--quiet",
                "--profile",
                "isolated",
                "--health",
            ])
            .arg(health)
            .arg("--")
            .args(cmd)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        stderr
    };
    let dir = tempfile::tempdir().unwrap();
    let health = dir.path().join("no-such-dir").join("health.json");
    let started = std::time::Instant::now();
    let stderr = refused(health.as_os_str(), &["/bin/sleep", "20"]);
    assert!(
        stderr.contains("--health cannot be written there")
            && stderr.contains("does not exist")
            && stderr.contains(&health.display().to_string()),
        "{stderr}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "the command ran: {:?}",
        started.elapsed()
    );
    // Nor a directory (a rename cannot replace it), nor a name that must be one before it
    // exists.
    for name in [
        dir.path().to_path_buf(),
        std::path::PathBuf::from(format!("{}/", dir.path().display())),
        std::path::PathBuf::from(format!("{}/not-yet/", dir.path().display())),
    ] {
        let stderr = refused(name.as_os_str(), &["/bin/true"]);
        assert!(
            stderr.contains("names a directory") || stderr.contains("is a directory"),
            "{}: {stderr}",
            name.display()
        );
    }
}

/// A command that handles SIGTERM gets it, and what it does with it is the run's result.
#[test]
fn a_command_that_handles_an_interrupt_gets_it() {
    if !can_run() {
        return;
    }
    let script = "trap 'echo TRAPPED; exit 7' TERM; echo READY; while :; do sleep 0.05; done";
    let mut child = flowhost()
        .args(["sandbox", "run", "--quiet", "--profile", "isolated", "--"])
        .args(["/bin/sh", "-c", script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "READY\n");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = wait_within(&mut child, "SIGTERM");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert_eq!((status.code(), rest.as_str()), (Some(7), "TRAPPED\n"));
}

/// A command that turns off echo and is then killed (here by its wall clock) leaves the
/// caller's terminal as it found it.
#[test]
fn the_callers_terminal_modes_are_restored_when_the_command_is_killed() {
    if !can_run() {
        return;
    }
    let mut shell = PtyShell::start();
    shell.type_line(&format!(
        "{} sandbox run --quiet --timeout 1 --profile isolated -- /bin/sh -c 'stty -echo; sleep 30'; \
         m=ON; stty -a | grep -q -- ' -echo ' && m=OFF; echo ECHO-$m-$((40+2))",
        env!("CARGO_BIN_EXE_flowhost"),
    ));
    let out = shell.wait_for("-42");
    shell.type_line("exit");
    assert!(out.contains("ECHO-ON-42"), "echo stayed off:\n{out}");
}

/// The state letter of process `pid` (`S`, `R`, `T` for stopped, ...).
fn process_state(pid: u32) -> Option<char> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .and_then(|s| s.trim().chars().next())
}

/// Waits (at most 20 s) until process `pid` is in a state `want` accepts.
fn wait_for_state(pid: u32, want: impl Fn(char) -> bool, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !process_state(pid).is_some_and(&want) {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: the command is in state {:?}",
            process_state(pid)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The pid of a process running `argv`, once there is one (within 30 s; else fails saying
/// `never`).
fn started(argv: &[&str], never: impl Fn() -> String) -> u32 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Some(pid) = processes_running(argv).first() {
            return *pid;
        }
        assert!(std::time::Instant::now() < deadline, "{}", never());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Ctrl-Z stops the command with flowhost (in its own session, the terminal's stop never
/// reaches it, and running on it would read what the operator types to the shell), and
/// `fg` continues both.
#[test]
fn ctrl_z_stops_the_command_and_fg_continues_it() {
    if !can_run() {
        return;
    }
    let mut shell = PtyShell::start();
    let sleeper = ["/bin/sleep", "43.03125"];
    shell.type_line(&format!(
        "{} sandbox run --quiet --profile isolated -- {} {}",
        env!("CARGO_BIN_EXE_flowhost"),
        sleeper[0],
        sleeper[1]
    ));
    let pid = started(&sleeper, || "the command never ran".into());
    shell.0.type_bytes(b"\x1a");
    wait_for_state(pid, |s| s == 'T', "after Ctrl-Z");
    shell.type_line("fg");
    wait_for_state(pid, |s| s != 'T', "after fg");
    shell.0.type_bytes(b"\x03");
    // What is typed while the run lasts is the command's (as over `ssh -t`): the shell's
    // next line waits for the run to end.
    let run = [
        env!("CARGO_BIN_EXE_flowhost"),
        "sandbox",
        "run",
        "--quiet",
        "--profile",
        "isolated",
        "--",
        sleeper[0],
        sleeper[1],
    ];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !processes_running(&run).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "Ctrl-C did not end the run"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    shell.type_line("echo ENDED-$((40+4))");
    shell.wait_for("ENDED-44");
    shell.type_line("exit");
    assert!(
        processes_running(&sleeper).is_empty(),
        "the command outlived the run"
    );
}

/// flowhost started on a terminal the test holds, as a shell starts it: flowhost leads the
/// terminal's session (setsid, TIOCSCTTY), in the foreground, or in the background behind a
/// process of the session that holds the foreground (what a shell does for `CMD &`). That
/// holder dies with the session's hangup when flowhost ends.
struct OnTerminal {
    master: std::fs::File,
    /// The test's own copy of the terminal flowhost runs on.
    slave: std::os::fd::OwnedFd,
    child: std::process::Child,
    output: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

/// Where a command on the test's terminal runs.
#[derive(Clone, Copy)]
enum Place {
    /// It leads the terminal's session, in the foreground.
    Foreground,
    /// It leads the session, in the background behind a holder of the foreground (its
    /// group orphaned: job control's stops do not apply).
    BehindHolder,
    /// A job in the background of a shell that leads the session and holds the foreground
    /// (`CMD &`): its group is not orphaned, so the terminal stops it when it writes or
    /// changes the terminal with `tostop` or in ways that always stop a background job.
    ShellJob,
}

/// Whether a terminal test can run here; prints why not.
fn can_run_on_a_terminal() -> bool {
    if !can_run() {
        return false;
    }
    if !std::path::Path::new("/dev/ptmx").exists() {
        eprintln!("SKIP: terminal tests need /dev/ptmx to open a pseudo-terminal");
        return false;
    }
    true
}

impl OnTerminal {
    /// flowhost with `args`.
    fn start(args: &[&std::ffi::OsStr], foreground: bool) -> Self {
        let mut cmd = flowhost();
        cmd.args(args);
        Self::spawn(cmd, foreground)
    }

    /// `sandbox run --quiet --timeout SECONDS --profile isolated -- COMMAND...`.
    fn quiet(seconds: &str, command: &[&str], foreground: bool) -> Self {
        let mut args = os(&[
            "sandbox",
            "run",
            "--quiet",
            "--timeout",
            seconds,
            "--profile",
            "isolated",
            "--",
        ]);
        args.extend(os(command));
        Self::start(&refs(&args), foreground)
    }

    /// `cmd` on the terminal.
    fn spawn(cmd: Command, foreground: bool) -> Self {
        let place = if foreground {
            Place::Foreground
        } else {
            Place::BehindHolder
        };
        Self::spawn_at(cmd, place)
    }

    /// `cmd` on the terminal, placed as `place` says.
    fn spawn_at(mut cmd: Command, place: Place) -> Self {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let (master, slave) = open_pty();
        // A window size of its own, so that a copied size is told from a default one.
        let size = libc::winsize {
            ws_row: 37,
            ws_col: 101,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads the winsize on this stack.
        let set = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &size) };
        assert_eq!(set, 0);
        let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let (ready_r, ready_w) = (ready_r.as_raw_fd(), ready_w.as_raw_fd());
        cmd.stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave.try_clone().unwrap());
        // SAFETY: between fork and exec only async-signal-safe calls are made (setsid, ioctl,
        // fork, setpgid, sigprocmask, tcsetpgrp, read, write, pause); the pipe descriptors
        // stay open in the test process until the child has been spawned.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                match place {
                    Place::Foreground => return Ok(()),
                    Place::BehindHolder => {}
                    Place::ShellJob => {
                        // The shell: it keeps the foreground, and runs flowhost as a job
                        // of a group of its own in its session (not orphaned, so job
                        // control's stops apply to it). It exits with flowhost's code, or
                        // 200 if flowhost was stopped.
                        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
                        let job = libc::fork();
                        if job == 0 {
                            libc::setpgid(0, 0);
                            return Ok(());
                        }
                        if job < 0 {
                            libc::_exit(201);
                        }
                        let mut set: libc::sigset_t = std::mem::zeroed();
                        libc::sigemptyset(&mut set);
                        libc::sigaddset(&mut set, libc::SIGTTOU);
                        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
                        libc::setpgid(job, job);
                        libc::tcsetpgrp(0, libc::getpid());
                        let mut status = 0;
                        while libc::waitpid(job, &mut status, libc::WUNTRACED) < 0 {}
                        if libc::WIFSTOPPED(status) {
                            libc::kill(job, libc::SIGKILL);
                            libc::_exit(200);
                        }
                        libc::_exit(if libc::WIFEXITED(status) {
                            libc::WEXITSTATUS(status)
                        } else {
                            128 + libc::WTERMSIG(status)
                        });
                    }
                }
                match libc::fork() {
                    -1 => Err(std::io::Error::last_os_error()),
                    0 => {
                        // The holder: a group of its own, given the terminal. A background
                        // process may set the foreground only with SIGTTOU blocked.
                        let mut set: libc::sigset_t = std::mem::zeroed();
                        libc::sigemptyset(&mut set);
                        libc::sigaddset(&mut set, libc::SIGTTOU);
                        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
                        libc::setpgid(0, 0);
                        libc::tcsetpgrp(0, libc::getpid());
                        libc::write(ready_w, b"x".as_ptr().cast(), 1);
                        // Nothing of the spawn stays open here: the test's spawn waits
                        // for its exec-error pipe to close.
                        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
                        loop {
                            libc::pause();
                        }
                    }
                    _ => {
                        let mut byte = 0u8;
                        if libc::read(ready_r, (&mut byte as *mut u8).cast(), 1) != 1 {
                            return Err(std::io::Error::other("the holder did not start"));
                        }
                        Ok(())
                    }
                }
            });
        }
        let child = cmd.spawn().unwrap();
        let master = std::fs::File::from(master);
        let output = collect(&master);
        OnTerminal {
            master,
            slave,
            child,
            output,
        }
    }

    /// What the terminal showed so far.
    fn shown(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    fn type_bytes(&mut self, bytes: &[u8]) {
        std::io::Write::write_all(&mut self.master, bytes).unwrap();
    }

    /// Waits (at most `within`) until the terminal showed `text`.
    fn wait_for(&self, text: &str, within: std::time::Duration) -> String {
        shows(&self.output, text, within)
    }

    /// flowhost's exit status, if it ended within `within`.
    fn ended_within(&mut self, within: std::time::Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// The terminal's VINTR byte (Ctrl-C).
    fn interrupt_byte(&self) -> u8 {
        let modes = nix::sys::termios::tcgetattr(&self.slave).unwrap();
        modes.control_chars[nix::sys::termios::SpecialCharacterIndices::VINTR as usize]
    }
}

impl Drop for OnTerminal {
    fn drop(&mut self) {
        // A test that failed with the terminal stopped must not leave flowhost blocked.
        let _ = nix::sys::termios::tcflow(&self.slave, nix::sys::termios::FlowArg::TCOON);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn os(args: &[&str]) -> Vec<std::ffi::OsString> {
    args.iter().map(std::ffi::OsString::from).collect()
}

fn refs(args: &[std::ffi::OsString]) -> Vec<&std::ffi::OsStr> {
    args.iter().map(|a| a.as_os_str()).collect()
}

/// A sandboxed command run in the background (`flowhost sandbox run ... &`) does not read
/// what is typed to the job in the foreground. It leads a session of its own, so the
/// terminal's job control (SIGTTIN) never stopped it: with the caller's terminal as its
/// stdin it read the keystrokes meant for the shell. It now has a terminal of its own, fed
/// only while flowhost is in the foreground.
#[test]
fn a_background_run_does_not_read_what_is_typed_to_the_foreground() {
    if !can_run_on_a_terminal() {
        return;
    }
    let script = "echo READY; read l; echo \"GOT-$l\" | tr a-z A-Z";
    let mut run = OnTerminal::quiet("2", &["/bin/sh", "-c", script], false);
    run.wait_for("READY", std::time::Duration::from_secs(5));
    run.type_bytes(b"secret\n");
    let status = run.ended_within(std::time::Duration::from_secs(6));
    let shown = run.shown();
    assert!(
        !shown.contains("GOT-SECRET"),
        "the background command read the foreground's input:\n{shown}"
    );
    assert!(
        status.is_some(),
        "the wall clock did not end the run:\n{shown}"
    );
}

/// A run started in the background of a shell (`flowhost sandbox run ... &`) ends by itself:
/// before, the end of every run flushed the terminal's input, which a background job may
/// not do unstopped (the terminal sent SIGTTOU), so the run never ended until brought to
/// the foreground.
#[test]
fn a_run_in_the_background_of_a_shell_is_not_stopped_at_its_end() {
    if !can_run_on_a_terminal() {
        return;
    }
    let mut cmd = flowhost();
    cmd.args([
        "sandbox",
        "run",
        "--quiet",
        "--timeout",
        "5",
        "--profile",
        "isolated",
    ])
    .args(["--", "/bin/echo", "DONE"]);
    let mut run = OnTerminal::spawn_at(cmd, Place::ShellJob);
    let status = run.ended_within(std::time::Duration::from_secs(10));
    let shown = run.shown();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "(200: the run was stopped)\n{shown}"
    );
    assert!(shown.contains("DONE"), "{shown}");
}

/// What reached the caller's terminal's input during a run that did not relay it (stdin not
/// the terminal) goes when the run ends: a command's query (cursor position, attributes)
/// has the terminal answer into that input, which the shell would read as typed. Before,
/// it was flushed only when flowhost relayed the input.
#[test]
fn a_terminals_answers_are_flushed_even_when_its_input_was_not_relayed() {
    if !can_run_on_a_terminal() {
        return;
    }
    let run_line = format!(
        "exec {} sandbox run --quiet --timeout 5 --profile isolated -- \
         /bin/sh -c 'echo READY; sleep 1; echo END' </dev/null",
        env!("CARGO_BIN_EXE_flowhost")
    );
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", &run_line]);
    let mut run = OnTerminal::spawn_at(cmd, Place::Foreground);
    run.wait_for("READY", std::time::Duration::from_secs(5));
    // As a terminal answers a query: bytes in its input that no one reads during the run.
    run.type_bytes(b"\x1b[12;1R\n");
    let status = run.ended_within(std::time::Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", run.shown());
    let mut pending: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int, on this stack.
    let ok = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&run.slave),
            libc::FIONREAD,
            &mut pending,
        )
    };
    assert_eq!(ok, 0);
    assert_eq!(pending, 0, "left for the shell to read:\n{}", run.shown());
}

/// In the foreground, what is typed reaches the command, which runs on a terminal (its
/// controlling terminal, sized like the caller's), and what it writes reaches the caller.
#[test]
fn a_foreground_run_gets_a_terminal_of_its_own_and_the_callers_input() {
    if !can_run_on_a_terminal() {
        return;
    }
    let script = "test -t 0 && test -t 1 && echo IS-A-TERMINAL; \
                  set -- $(cat /proc/$$/stat); [ \"$7\" != 0 ] && echo HAS-A-CONTROLLING-TERMINAL; \
                  echo SIZE-$(stty size | tr ' ' x); \
                  echo READY; read l; echo \"GOT-$l\" | tr a-z A-Z";
    let mut run = OnTerminal::quiet("8", &["/bin/sh", "-c", script], true);
    run.wait_for("READY", std::time::Duration::from_secs(5));
    run.type_bytes(b"hello\n");
    run.wait_for("GOT-HELLO", std::time::Duration::from_secs(5));
    let status = run.ended_within(std::time::Duration::from_secs(5));
    let shown = run.shown();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{shown}");
    for want in ["IS-A-TERMINAL", "HAS-A-CONTROLLING-TERMINAL", "SIZE-37x101"] {
        assert!(shown.contains(want), "{want} missing:\n{shown}");
    }
}

/// Without a pseudo-terminal to give the command (no usable `/dev/ptmx`), a run from a
/// terminal is refused, naming why; the caller's own terminal is never handed over instead.
#[test]
fn without_a_pseudo_terminal_a_run_from_a_terminal_is_refused() {
    if !can_run_on_a_terminal() {
        return;
    }
    if std::process::Command::new("unshare")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIP: needs unshare(1) to hide /dev/ptmx in a mount namespace");
        return;
    }
    // In a mount namespace of its own, /dev/ptmx is /dev/null: opening a pseudo-terminal fails.
    let inner = format!(
        "mount --bind /dev/null /dev/ptmx && exec {} \"$@\"",
        env!("CARGO_BIN_EXE_flowhost")
    );
    let args = os(&[
        "--mount",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        &inner,
        "sh",
        "sandbox",
        "run",
        "--quiet",
        "--profile",
        "isolated",
        "--",
        "/bin/echo",
        "RAN-ON-THE-CALLERS-TERMINAL",
    ]);
    let (master, slave) = open_pty();
    let mut child = std::process::Command::new("unshare")
        .args(&args)
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave)
        .spawn()
        .unwrap();
    let status = wait_within(&mut child, "no pseudo-terminal");
    let mut shown = Vec::new();
    let mut master = std::fs::File::from(master);
    nix::fcntl::fcntl(
        &master,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .unwrap();
    let _ = std::io::Read::read_to_end(&mut master, &mut shown);
    let shown = String::from_utf8_lossy(&shown);
    assert!(
        !shown.contains("RAN-ON-THE-CALLERS-TERMINAL"),
        "the command ran on the caller's terminal:\n{shown}"
    );
    assert_eq!(status.code(), Some(2), "{shown}");
    assert!(shown.contains("terminal"), "{shown}");
}

/// The command cannot stop the caller's terminal. Before, `tcflow(TCOOFF)` on the terminal
/// it inherited (with IXON cleared, so that Ctrl-Q could not undo it) blocked flowhost's own
/// next write to stderr on its one runtime thread: attempts went undecided, the wall clock
/// never fired, and the run outlived `--timeout`. Now it stops only its own terminal. And a
/// terminal stopped by someone else delays flowhost's messages, never the run: `--timeout`
/// still ends the command, and the run concludes (its health written). Its messages wait
/// for the terminal and are all shown once it takes output again; before, they were
/// dropped 2 s after the run ended, and nothing said so.
#[test]
fn a_stopped_terminal_stalls_neither_the_run_nor_its_timeout_and_loses_nothing() {
    if !can_run_on_a_terminal() {
        return;
    }
    let probe = shared_copy("flowhost-probe");
    let dir = tempfile::tempdir().unwrap();
    // `script` run by sh with the probe as $0, keeping records (so that attempts are
    // decided, and printed, on flowhost's runtime) and its health, with a 2 s wall clock.
    let start = |script: &str, records: &str| {
        let mut args = os(&["sandbox", "run", "--timeout", "2", "--profile", "isolated"]);
        args.extend([
            "--records".into(),
            dir.path().join(records).into_os_string(),
            "--health".into(),
            dir.path()
                .join(format!("{records}.health.json"))
                .into_os_string(),
            "--read".into(),
            probe.clone().into_os_string(),
        ]);
        args.extend(os(&["--", "/bin/sh", "-c", script]));
        args.push(probe.clone().into_os_string());
        OnTerminal::start(&refs(&args), true)
    };
    // The command stops its terminal, then makes an attempt flowhost logs, then waits for
    // the wall clock.
    let mut run = start(
        "\"$0\" tcoff >/dev/null; \"$0\" connect 127.0.0.1:9 x >/dev/null 2>&1; \
         exec /bin/sleep 30.0390625",
        "own",
    );
    let status = run.ended_within(std::time::Duration::from_secs(6));
    let shown = run.shown();
    assert!(
        status.is_some(),
        "the run outlived its 2 s wall clock by 4 s:\n{shown}"
    );
    for want in ["connect inet/stream/tcp 127.0.0.1:9", "wall-clock limit"] {
        assert!(
            shown.contains(want),
            "{want} never reached the terminal:\n{shown}"
        );
    }
    drop(run);

    // The terminal stopped by someone else (here the test) once the command runs.
    let sleeper = ["/bin/sleep", "30.04296875"];
    let mut run = start(
        &format!(
            "echo RUNNING; sleep 0.5; \"$0\" connect 127.0.0.1:9 x >/dev/null 2>&1; exec {} {}",
            sleeper[0], sleeper[1]
        ),
        "other",
    );
    run.wait_for("RUNNING", std::time::Duration::from_secs(5));
    nix::sys::termios::tcflow(&run.slave, nix::sys::termios::FlowArg::TCOOFF).unwrap();
    let health = dir.path().join("other.health.json");
    let stopped = std::time::Instant::now();
    while !health.exists() || !processes_running(&sleeper).is_empty() {
        assert!(
            stopped.elapsed() < std::time::Duration::from_secs(10),
            "with the terminal stopped, the run outlived its 2 s wall clock by 8 s:\n{}",
            run.shown()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // flowhost waits for the terminal (before, it gave up 2 s after the run ended).
    waits_for_its_terminal(&run, &health);
    nix::sys::termios::tcflow(&run.slave, nix::sys::termios::FlowArg::TCOON).unwrap();
    let shown = run.wait_for("wall-clock limit", std::time::Duration::from_secs(30));
    assert!(
        shown.contains("connect inet/stream/tcp 127.0.0.1:9"),
        "the attempt's verdict was lost:\n{shown}"
    );
    let status = run.ended_within(std::time::Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.code() != Some(2)),
        "{status:?}:\n{}",
        run.shown()
    );
}

/// flowhost waiting for a stopped terminal to take the end of a run (its messages, the
/// command's last output) is ended by an interrupt as any program would be: the run is over,
/// so the interrupt has its default action again, and no `kill` goes unheeded.
#[test]
fn a_run_waiting_for_a_stopped_terminal_still_ends_on_an_interrupt() {
    if !can_run_on_a_terminal() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut run = waiting_for_its_stopped_terminal(flowhost(), dir.path());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(run.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    ended_by_sigterm(&mut run);
}

/// The same wait, by a run started with SIGHUP ignored: the hangup flowhost never took stays
/// ignored when the other interrupts get their default actions back, so it does not end
/// flowhost while the terminal holds the run's last output; SIGTERM still does.
#[test]
fn a_run_waiting_for_its_terminal_keeps_ignoring_what_the_caller_ignores() {
    if !can_run_on_a_terminal() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("/bin/bash");
    // The shell ignores SIGHUP and becomes flowhost, which inherits that.
    cmd.args(["-c", "trap '' HUP; exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_flowhost"));
    let mut run = waiting_for_its_stopped_terminal(cmd, dir.path());
    let pid = nix::unistd::Pid::from_raw(run.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(
        catches(run.child.id(), libc::SIGHUP),
        Some(false),
        "flowhost ended of the hangup it was started ignoring:\n{}",
        run.shown()
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    ended_by_sigterm(&mut run);
}

/// The caller's terminal goes away mid-run (hung up, as a closed window or a dropped ssh
/// connection does) under a flowhost started ignoring SIGHUP: the command runs on (it has a
/// terminal of its own), what it writes afterwards is refused by the caller's terminal, and
/// the run, which had otherwise succeeded, exits 2 instead of 0. Before, the hangup reached
/// the command (129), and the refusal path had no test.
#[test]
fn output_a_hung_up_terminal_refuses_makes_a_successful_run_exit_2() {
    if !can_run_on_a_terminal() {
        return;
    }
    let mut cmd = Command::new("/bin/bash");
    // The shell ignores SIGHUP and becomes flowhost, which inherits that.
    cmd.args(["-c", "trap '' HUP; exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_flowhost"))
        .args(["sandbox", "run", "--quiet", "--profile", "isolated", "--"])
        .args(["/bin/sh", "-c", "echo RUNNING; sleep 1; echo LATE; exit 0"]);
    let mut run = OnTerminal::spawn(cmd, true);
    run.wait_for("RUNNING", std::time::Duration::from_secs(10));
    use std::os::fd::AsRawFd;
    // SAFETY: TIOCVHANGUP takes no argument; it hangs up the terminal the descriptor names.
    let hung = unsafe { libc::ioctl(run.slave.as_raw_fd(), libc::TIOCVHANGUP, 0) };
    assert_eq!(hung, 0, "{}", std::io::Error::last_os_error());
    let status = run.ended_within(std::time::Duration::from_secs(30));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "{status:?}:\n{}",
        run.shown()
    );
    assert!(!run.shown().contains("LATE"), "{}", run.shown());
}

/// `cmd` (flowhost, or what becomes it) as a `sandbox run` on a terminal whose command reads
/// a line and writes its last one; the terminal is stopped (XOFF) before that last line, so
/// flowhost, its run concluded (its health in `dir`), waits for the terminal to take it.
fn waiting_for_its_stopped_terminal(mut cmd: Command, dir: &std::path::Path) -> OnTerminal {
    let health = dir.join("health.json");
    cmd.args([
        "sandbox",
        "run",
        "--quiet",
        "--profile",
        "isolated",
        "--health",
    ])
    .arg(&health)
    .args([
        "--",
        "/bin/sh",
        "-c",
        "echo RUNNING; read l; echo LAST-$((40+6))",
    ]);
    let mut run = OnTerminal::spawn(cmd, true);
    run.wait_for("RUNNING", std::time::Duration::from_secs(10));
    nix::sys::termios::tcflow(&run.slave, nix::sys::termios::FlowArg::TCOOFF).unwrap();
    // What is typed still reaches the command, which then writes its last line and ends.
    run.type_bytes(b"go\n");
    waits_for_its_terminal(&run, &health);
    assert!(!run.shown().contains("LAST-46"), "{}", run.shown());
    run
}

/// Waits for flowhost on `run` to end, and checks that SIGTERM ended it.
fn ended_by_sigterm(run: &mut OnTerminal) {
    let status = run.ended_within(std::time::Duration::from_secs(30));
    assert_eq!(
        status.and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s)),
        Some(libc::SIGTERM),
        "{status:?}:\n{}",
        run.shown()
    );
}

/// Waits (at most 30 s) until flowhost on `run` has concluded its run (`health` written) and
/// waits for its stopped terminal to take the rest, SIGTERM no longer taken; fails when it
/// ends first, with what it had left unshown.
fn waits_for_its_terminal(run: &OnTerminal, health: &std::path::Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match catches(run.child.id(), libc::SIGTERM) {
            None => panic!(
                "flowhost ended while its terminal was stopped, without showing what it had \
                 left:\n{}",
                run.shown()
            ),
            Some(false) if health.exists() => return,
            Some(_) => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the run never concluded, or flowhost still takes SIGTERM:\n{}",
            run.shown()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether process `pid` has a handler for `signal` (`None`: no such process; a zombie has
/// none).
fn catches(pid: u32, signal: i32) -> Option<bool> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    if status
        .lines()
        .any(|l| l.starts_with("State:") && l.contains('Z'))
    {
        return None;
    }
    let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
    let mask = u64::from_str_radix(mask.trim(), 16).ok()?;
    Some(mask & (1 << (signal - 1)) != 0)
}

/// A background run on a terminal that stops background jobs that write (`stty tostop`)
/// shows everything once it is brought to the foreground: when it has the command's last
/// output and its own messages to write, the kernel stops it (SIGTTOU), and `fg` lets them
/// out. Before, the relay held them back while flowhost was in the background, then dropped
/// them 2 s after the run ended: flowhost exited with none of them shown, and nothing said so.
#[test]
fn a_background_run_on_a_tostop_terminal_is_stopped_and_shows_everything_after_fg() {
    if !can_run_on_a_terminal() {
        return;
    }
    let mut shell = PtyShell::start();
    shell.type_line("stty tostop; echo TOSTOP-$((40+1))");
    shell.wait_for("TOSTOP-41");
    let script = "echo OUT-$((40+2)); exec /bin/sleep 30.05859375";
    let run = [
        env!("CARGO_BIN_EXE_flowhost"),
        "sandbox",
        "run",
        "--quiet",
        "--timeout",
        "4",
        "--profile",
        "isolated",
        "--",
        "/bin/sh",
        "-c",
        script,
    ];
    shell.type_line(&format!("{} '{script}' &", run[..run.len() - 1].join(" ")));
    let pid = started(&run, || format!("flowhost never ran:\n{}", shell.0.shown()));
    // The wall clock ends the command after 4 s; flowhost then has its output to show.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match process_state(pid) {
            Some('T') => break,
            Some('Z') | None => panic!(
                "flowhost ended in the background without being stopped:\n{}",
                shell.0.shown()
            ),
            Some(_) => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "flowhost was never stopped:\n{}",
            shell.0.shown()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        !shell.0.shown().contains("OUT-42"),
        "the background run wrote to a TOSTOP terminal:\n{}",
        shell.0.shown()
    );
    // In POSIX mode, bash names the signal that stopped a job.
    shell.type_line("set -o posix; jobs; echo JOBS-$((40+4))");
    let jobs = shell.wait_for("JOBS-44");
    assert!(
        jobs.contains("SIGTTOU") || jobs.contains("tty output"),
        "flowhost was not stopped for writing to the terminal:\n{jobs}"
    );
    shell.type_line("fg");
    let shown = shell.wait_for("wall-clock limit");
    let (out, said) = (shown.find("OUT-42"), shown.find("wall-clock limit"));
    assert!(
        out.is_some() && out < said,
        "the command's last output did not come before flowhost's messages:\n{shown}"
    );
    shell.type_line("echo DONE-$((40+3))");
    shell.wait_for("DONE-43");
    shell.type_line("exit");
    let _ = shell.0.child.wait();
}

/// Ctrl-C reaches every process of the command's foreground job, as a terminal sends it:
/// `bash -c 'sleep 100; true'` ends at once. Before, only the command's first process got
/// it: bash handles SIGINT while it waits, and sleep went on.
#[test]
fn ctrl_c_reaches_the_commands_whole_foreground_job() {
    if !can_run_on_a_terminal() {
        return;
    }
    let sleeper = ["sleep", "100.0546875"];
    let script = format!("{} {}; true", sleeper[0], sleeper[1]);
    let mut run = OnTerminal::quiet("20", &["/bin/bash", "-c", &script], true);
    let started = std::time::Instant::now();
    while processes_running(&sleeper).is_empty() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "the command never ran:\n{}",
            run.shown()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let ctrl_c = run.interrupt_byte();
    run.type_bytes(&[ctrl_c]);
    let status = run.ended_within(std::time::Duration::from_secs(3));
    assert!(
        status.is_some(),
        "Ctrl-C did not end `bash -c 'sleep 100; true'`:\n{}",
        run.shown()
    );
    assert!(processes_running(&sleeper).is_empty());
}

/// Unmounts on drop, so a failing assertion leaves no mount behind.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A record writer that fails during the run (its disk full) still leaves the run's health,
/// saying the observation is incomplete and why, and the run exits 2. Before, the failed
/// close returned at once: no health was written (a stale `--health` file from an earlier
/// run stayed, vouching for this one), and the gate and the cgroups' release were skipped.
#[test]
fn a_record_writer_that_fails_during_the_run_still_leaves_the_runs_health() {
    if !can_run() {
        return;
    }
    let disk = common::shared_dir().join(format!("sandbox-full-{}", std::process::id()));
    std::fs::create_dir_all(&disk).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs"])
        .arg(&disk)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("SKIP: cannot mount a small tmpfs to fill (needs root and mount(8))");
        return;
    }
    let _unmount = Unmount(disk.clone());
    let fill = disk.join("fill");
    std::fs::create_dir(&fill).unwrap();
    std::fs::set_permissions(&fill, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let health = dir.path().join("health.json");
    std::fs::write(&health, "{\"stale\": \"from an earlier run\"}").unwrap();
    let probe = shared_copy("flowhost-probe");
    // The command fills the disk the records are on (the ring was made when the writer
    // opened), then makes an attempt, whose record cannot be written.
    let out = flowhost()
        .args([
            "sandbox",
            "run",
            "--quiet",
            "--profile",
            "isolated",
            "--records",
        ])
        .arg(disk.join("records"))
        .arg("--health")
        .arg(&health)
        .arg("--write")
        .arg(&fill)
        .arg("--read")
        .arg(&probe)
        .args(["--", "/bin/sh", "-c"])
        .arg("head -c 8M /dev/zero > \"$1/z\" 2>/dev/null; \"$0\" connect 127.0.0.1:9 x")
        .arg(&probe)
        .arg(&fill)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("record writer"), "{stderr}");
    let written = std::fs::read_to_string(&health).unwrap();
    let written: serde_json::Value = serde_json::from_str(&written).unwrap();
    assert_eq!(
        written["producer"], "sandbox",
        "the stale health stayed: {written}"
    );
    assert_eq!(written["complete"], false, "{written}");
    assert_eq!(written["records"]["writer_failed"], true, "{written}");
    assert!(
        written["incomplete_reasons"]
            .to_string()
            .contains("No space left"),
        "{written}"
    );
}
