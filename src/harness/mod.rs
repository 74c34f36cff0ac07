//! A test harness for tool authors: run a command, or serve an MCP server from its signed
//! manifest, under the real broker with a profile and destination rules; get back the
//! decision records, the egress attempts as typed values and the health; assert on them.
//!
//! The harness drives the `flowhost` binary (`flowhost sandbox run` and `flowhost sandbox
//! mcp`), so what a test observes is exactly what the CLI and a CI gate observe, and the
//! same test runs as root or as an unprivileged user (the broker then uses its
//! user-namespace mode; see the README, "Testing your tool under flowhost").
//!
//! ```no_run
//! use flowhost::harness::Harness;
//!
//! let harness = Harness::new()?.profile("brokered").allow("127.0.0.1:8080");
//! let run = harness.run(["/usr/local/bin/my-tool", "--sync"])?;
//! run.assert_success();
//! run.assert_only_destinations(&["127.0.0.1:8080"]);
//! run.assert_matches_declared(std::path::Path::new("declared.json"));
//! # Ok::<(), flowhost::harness::HarnessError>(())
//! ```
//!
//! `examples/harness_tool/` is a runnable example (`cargo run --example harness_tool`): a
//! small tool with a signed manifest, tested under the harness, with a gate that fails when
//! the tool connects somewhere its declaration does not allow.

mod gate;
mod mcp;
mod observe;

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

pub use gate::{judge, load_surface, passes};
pub use mcp::McpServer;
pub(crate) use observe::calls_cut_short;
pub use observe::{EgressAttempt, Observation, read_records};

/// `text` a run's command or tool wrote (its stderr, a JSON answer), as shown in an error
/// or panic message: each line escaped ([`flowhost_broker::Escaped`]), so it cannot move,
/// recolour or reorder the test author's terminal; the lines stay lines.
fn shown(text: &str) -> String {
    text.lines()
        .map(|l| flowhost_broker::Escaped(l).to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The environment variable naming the `flowhost` binary the harness runs (default: the
/// one on `PATH`).
pub const BINARY_ENV: &str = "FLOWHOST_BIN";

/// Why the harness could not run, or a check that did not hold.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// No `flowhost` binary was found.
    #[error("no flowhost binary: {0} (set {BINARY_ENV} or put flowhost on PATH)")]
    Binary(String),
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The declared surface is not valid.
    #[error("{}: {message}", path.display())]
    Surface {
        /// The surface file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The records could not be read.
    #[error("cannot read the decision records: {0}")]
    Records(#[from] crate::records::store::StoreError),
    /// The records do not verify (a torn or edited line, a gap, a broken hash chain, lines
    /// cut from the end): nothing read from them is evidence of what the run did.
    #[error(
        "the decision records in {} do not verify, so they prove nothing about the run: {}; `flowhost records verify {}` says the same",
        dir.display(),
        problems.join("; "),
        dir.display()
    )]
    Unverified {
        /// The record directory.
        dir: PathBuf,
        /// Each problem, naming its file and line.
        problems: Vec<String>,
    },
    /// The health says observation was incomplete, so the records may miss what the run did.
    #[error(
        "observation was incomplete, as {} says ({}), so the records may miss what the run did; fix what it names and run again",
        health.display(),
        reasons.join("; ")
    )]
    Incomplete {
        /// The health file.
        health: PathBuf,
        /// Its `incomplete_reasons`.
        reasons: Vec<String>,
    },
    /// The diff could not judge the records.
    #[error(transparent)]
    Diff(#[from] crate::diff::DiffError),
    /// The run did not produce what a run produces (records, health, an MCP answer).
    #[error("{0}")]
    Run(String),
    /// A check did not hold.
    #[error("{0}")]
    Check(String),
}

/// A copy of the executable `program` in `dir` (created mode 0755), readable and executable
/// by every user, so that executors (which run as a uid of their own, or in a user
/// namespace, with a private `/tmp`) can run it whatever the permissions of a build tree.
/// `dir` must not be under `/tmp`. Copies are named by size and modification time, so
/// repeated calls reuse one while it still holds the program's bytes and only this user may
/// change it. The copy is made by `cp` in a child process and renamed into
/// place: a descriptor open for writing in this (multithreaded) process could leak into a
/// concurrently spawned executor and make its exec fail with ETXTBSY.
pub fn stage(program: &Path, dir: &Path) -> Result<PathBuf, HarnessError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |what: String| move |source| HarnessError::Io { what, source };
    let meta = std::fs::metadata(program).map_err(io(format!("{}", program.display())))?;
    let stamp = meta
        .modified()
        .ok()
        .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let name = program
        .file_name()
        .ok_or_else(|| HarnessError::Run(format!("{} names no file", program.display())))?;
    let sub = dir.join(format!("{}-{stamp}", meta.len()));
    let dst = sub.join(name);
    for d in [dir, sub.as_path()] {
        use std::os::unix::fs::MetadataExt;
        std::fs::create_dir_all(d).map_err(io(format!("cannot create {}", d.display())))?;
        // A directory the copy is run from must be this user's alone to change (a link, or
        // one another user owns or may write, would let them swap the program before it
        // runs); others may read and search it, to run what is inside.
        let meta = std::fs::symlink_metadata(d).map_err(io(format!("{}", d.display())))?;
        if !meta.is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() {
            return Err(HarnessError::Run(format!(
                "{} is not a directory of this user's (a link, or another user's): a staged \
                 program there could be swapped before it runs",
                d.display()
            )));
        }
        if meta.mode() & 0o777 != 0o755 {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))
                .map_err(io(format!("cannot make {} 0755", d.display())))?;
        }
    }
    // A copy is reused only when it is still the program, byte for byte, and no one else
    // could have changed it: the name says only size and time.
    if same_program(program, &dst) {
        return Ok(dst);
    }
    // Unique per call: threads of one process may stage the same program at once.
    static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = sub.join(format!(
        ".{}.{}.{n}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let status = Command::new("cp")
        .arg("--")
        .arg(program)
        .arg(&tmp)
        .status()
        .map_err(io("cannot run cp".into()))?;
    if !status.success() {
        return Err(HarnessError::Run(format!(
            "cp {} {} failed ({status})",
            program.display(),
            tmp.display()
        )));
    }
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .map_err(io(format!("cannot make {} executable", tmp.display())))?;
    std::fs::rename(&tmp, &dst).map_err(io(format!("cannot move {} into place", dst.display())))?;
    Ok(dst)
}

/// Whether `copy` is a file of this user that group and others may not write, holding
/// exactly the bytes of `program`. Any doubt (unreadable, another owner) says no, and the
/// caller copies again.
fn same_program(program: &Path, copy: &Path) -> bool {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(copy) else {
        return false;
    };
    if !meta.is_file() || meta.uid() != nix::unistd::geteuid().as_raw() || meta.mode() & 0o022 != 0
    {
        return false;
    }
    let (Ok(mut a), Ok(mut b)) = (std::fs::File::open(program), std::fs::File::open(copy)) else {
        return false;
    };
    let (mut x, mut y) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    loop {
        let n = match read_full(&mut a, &mut x) {
            Ok(n) => n,
            Err(_) => return false,
        };
        match read_full(&mut b, &mut y) {
            Ok(m) if m == n && x[..n] == y[..n] => {}
            _ => return false,
        }
        if n == 0 {
            return true;
        }
    }

    /// Fills `buf` as far as the file goes (a short read is not the end of a file).
    fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut at = 0;
        while at < buf.len() {
            match f.read(&mut buf[at..])? {
                0 => break,
                n => at += n,
            }
        }
        Ok(at)
    }
}

/// How to run commands and MCP servers under the broker. Cheap to clone; every run gets a
/// fresh workspace (record directory, health file).
#[derive(Debug, Clone)]
pub struct Harness {
    binary: PathBuf,
    profile: String,
    profiles_dirs: Vec<PathBuf>,
    allow: Vec<String>,
    env: Vec<String>,
    read: Vec<PathBuf>,
    timeout: Option<u64>,
    call_timeout: Option<std::time::Duration>,
    run_as: Option<(u32, u32)>,
    work_dir: Option<PathBuf>,
}

impl Harness {
    /// A harness using the `flowhost` binary named by [`BINARY_ENV`] or found on `PATH`,
    /// with the built-in `brokered` profile and no destination allowed.
    pub fn new() -> Result<Harness, HarnessError> {
        let binary = match std::env::var_os(BINARY_ENV) {
            Some(p) => PathBuf::from(p),
            None => {
                let path = std::env::var_os("PATH").unwrap_or_default();
                std::env::split_paths(&path)
                    .map(|d| d.join("flowhost"))
                    .find(|c| c.is_file())
                    .ok_or_else(|| HarnessError::Binary("flowhost is not on PATH".into()))?
            }
        };
        if !binary.is_file() {
            return Err(HarnessError::Binary(format!(
                "{} is not a file",
                binary.display()
            )));
        }
        Ok(Harness::with_binary(binary))
    }

    /// A harness using the `flowhost` binary at `binary`.
    pub fn with_binary(binary: impl Into<PathBuf>) -> Harness {
        Harness {
            binary: {
                // A bare name is looked up on PATH as a program is; a path is found from here.
                let binary: PathBuf = binary.into();
                if binary.components().count() > 1 {
                    from_here(binary)
                } else {
                    binary
                }
            },
            profile: "brokered".into(),
            profiles_dirs: Vec::new(),
            allow: Vec::new(),
            env: Vec::new(),
            read: Vec::new(),
            timeout: None,
            call_timeout: None,
            run_as: None,
            work_dir: None,
        }
    }

    /// The execution profile (built-in `isolated` or `brokered`, or `NAME.toml` in a
    /// [`Harness::profiles_dir`]).
    pub fn profile(mut self, name: &str) -> Self {
        self.profile = name.to_string();
        self
    }

    /// A directory searched for profiles before the built-in ones.
    pub fn profiles_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.profiles_dirs.push(from_here(dir.into()));
        self
    }

    /// Allows egress to `rule` (`ADDR[:PORT]`, `CIDR[:PORT]`, `*:PORT`, `unix:/path`,
    /// `unix:@name`); without any, every attempt is refused.
    pub fn allow(mut self, rule: &str) -> Self {
        self.allow.push(rule.to_string());
        self
    }

    /// Passes `NAME` from the environment, or sets `NAME=VALUE`, for the command.
    pub fn env(mut self, var: &str) -> Self {
        self.env.push(var.to_string());
        self
    }

    /// A path the command may read beneath.
    pub fn read(mut self, path: impl Into<PathBuf>) -> Self {
        self.read.push(from_here(path.into()));
        self
    }

    /// Wall-clock limit of a [`Harness::run`], in seconds.
    pub fn timeout(mut self, seconds: u64) -> Self {
        self.timeout = Some(seconds);
        self
    }

    /// How long one call of an [`Harness::mcp`] server may take (default 30 s): a call
    /// past it is ended with its executor, and the run is then incomplete.
    pub fn call_timeout(mut self, limit: std::time::Duration) -> Self {
        self.call_timeout = Some(limit);
        self
    }

    /// Runs `flowhost` as `uid`/`gid` (through `setpriv`, with no supplementary groups), so
    /// the broker works in its unprivileged user-namespace mode. The caller must be root;
    /// the binary and the command must be readable by that user.
    pub fn run_as(mut self, uid: u32, gid: u32) -> Self {
        self.run_as = Some((uid, gid));
        self
    }

    /// Where run workspaces are created (default: the system's temporary directory).
    pub fn work_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.work_dir = Some(from_here(dir.into()));
        self
    }

    /// Runs `argv` under `flowhost sandbox run`, waits for it, and returns what it produced.
    /// The command's stdin is empty; its stdout and stderr are captured.
    pub fn run<I, S>(&self, argv: I) -> Result<Observation, HarnessError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let ws = self.workspace()?;
        let (records, health) = (ws.path().join("records"), ws.path().join("health.json"));
        let mut cmd = self.flowhost();
        cmd.args(["sandbox", "run", "--profile", &self.profile]);
        self.common_args(&mut cmd, &records, &health);
        if let Some(t) = self.timeout {
            cmd.args(["--timeout", &t.to_string()]);
        }
        cmd.arg("--");
        cmd.args(argv_from_here(argv));
        cmd.stdin(std::process::Stdio::null());
        let (status, stdout, stderr) = captured(&mut cmd).map_err(|source| HarnessError::Io {
            what: self.launch_failure(),
            source,
        })?;
        Observation::read(status, stdout, stderr, records, health, ws)
    }

    /// Serves the MCP server `argv` from its signed `manifest` (verified with the public
    /// key `key`: hex, or a file of hex) under `flowhost sandbox mcp`, initialized and ready
    /// for calls. Tool calls go through the flow resolver, the broker and the records exactly
    /// as under the daemon; [`McpServer::finish`] stops it and returns what it produced.
    pub fn mcp<I, S>(&self, manifest: &Path, key: &str, argv: I) -> Result<McpServer, HarnessError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.mcp_with(manifest, key, None, argv)
    }

    /// Like [`Harness::mcp`], with record mappings (`--mappings FILE`: a TOML table per
    /// tool, as in a host configuration's `record = {...}`), so tool calls are classified
    /// and a declared surface can match them.
    pub fn mcp_with<I, S>(
        &self,
        manifest: &Path,
        key: &str,
        mappings: Option<&Path>,
        argv: I,
    ) -> Result<McpServer, HarnessError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let ws = self.workspace()?;
        let (records, health) = (ws.path().join("records"), ws.path().join("health.json"));
        let server_id = crate::manifest::load_envelope_file(manifest)
            .map_err(|e| HarnessError::Run(e.to_string()))?
            .body()
            .server_id()
            .to_string();
        let mut cmd = self.flowhost();
        // A key given as a file here is found from here; anything else (hex, or text that
        // is no key, which flowhost refuses without showing it) goes as it is.
        let key_file = Path::new(key);
        cmd.args(["sandbox", "mcp", "--profile", &self.profile, "--manifest"])
            .arg(from_here(manifest.to_path_buf()))
            .arg("--key");
        if key_file.is_relative() && key_file.is_file() {
            cmd.arg(from_here(key_file.to_path_buf()));
        } else {
            cmd.arg(key);
        }
        if let Some(m) = mappings {
            cmd.arg("--mappings").arg(from_here(m.to_path_buf()));
        }
        if let Some(limit) = self.call_timeout {
            cmd.args(["--call-timeout-ms", &limit.as_millis().max(1).to_string()]);
        }
        self.common_args(&mut cmd, &records, &health);
        cmd.arg("--");
        cmd.args(argv_from_here(argv));
        McpServer::start(cmd, self.launch_failure(), server_id, records, health, ws)
    }

    fn flowhost(&self) -> Command {
        match self.run_as {
            None => Command::new(&self.binary),
            Some((uid, gid)) => {
                let mut c = Command::new("setpriv");
                c.args([
                    OsString::from(format!("--reuid={uid}")),
                    OsString::from(format!("--regid={gid}")),
                    OsString::from("--clear-groups"),
                    OsString::from("--"),
                ])
                .arg(&self.binary)
                .current_dir("/");
                c
            }
        }
    }

    /// What failed when `flowhost` could not be started.
    fn launch_failure(&self) -> String {
        match self.run_as {
            None => format!("cannot run {}", self.binary.display()),
            Some((uid, _)) => format!(
                "cannot run {} as uid {uid} through setpriv (is util-linux's setpriv on PATH?)",
                self.binary.display()
            ),
        }
    }

    fn common_args(&self, cmd: &mut Command, records: &Path, health: &Path) {
        for d in &self.profiles_dirs {
            cmd.arg("--profiles-dir").arg(d);
        }
        for r in &self.allow {
            cmd.args(["--allow", r]);
        }
        for e in &self.env {
            cmd.args(["--env", e]);
        }
        for p in &self.read {
            cmd.arg("--read").arg(p);
        }
        cmd.arg("--records").arg(records);
        cmd.arg("--health").arg(health);
    }

    /// A fresh private directory for one run, owned by the user `flowhost` runs as.
    fn workspace(&self) -> Result<tempfile::TempDir, HarnessError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| HarnessError::Io { what, source }
        };
        let mut b = tempfile::Builder::new();
        b.prefix("flowhost-harness-");
        let ws = match &self.work_dir {
            Some(d) => b.tempdir_in(d),
            None => b.tempdir(),
        }
        .map_err(io("cannot create a workspace"))?;
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(ws.path(), Some(uid), Some(gid))
                .map_err(io("cannot hand the workspace to the run's user"))?;
        }
        Ok(ws)
    }
}

/// `path` as found from the test's working directory: `flowhost` run as another user
/// ([`Harness::run_as`]) works from `/`, where a relative path would name something else
/// (`--read data` would let the tool read `/data`, not the test's own).
fn from_here(path: PathBuf) -> PathBuf {
    std::path::absolute(&path).unwrap_or(path)
}

/// `argv` with a relative program path (`./tool`, `bin/tool`) found from here too; a bare
/// name is looked up on `PATH` as it was.
fn argv_from_here<I, S>(argv: I) -> Vec<OsString>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut argv: Vec<OsString> = argv.into_iter().map(|a| a.as_ref().to_owned()).collect();
    if let Some(program) = argv.first_mut()
        && std::os::unix::ffi::OsStrExt::as_bytes(program.as_os_str()).contains(&b'/')
    {
        *program = from_here(PathBuf::from(&*program)).into_os_string();
    }
    argv
}

/// Most bytes of a run's stdout, and of its stderr, kept in its [`Observation`]: a tool that
/// floods its output fails the test's checks rather than exhausting the test's memory.
const MOST_CAPTURED_BYTES: usize = 16 << 20;

/// Runs `cmd` to its end with its stdout and stderr captured, each to
/// [`MOST_CAPTURED_BYTES`] (the rest read and counted, and the count said at its end).
fn captured(
    cmd: &mut std::process::Command,
) -> std::io::Result<(std::process::ExitStatus, String, String)> {
    fn kept(
        stream: Option<impl std::io::Read + Send + 'static>,
    ) -> std::thread::JoinHandle<String> {
        std::thread::spawn(move || {
            let Some(mut stream) = stream else {
                return String::new();
            };
            let (mut kept, mut more) = (Vec::new(), 0u64);
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stream.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let take = n.min(MOST_CAPTURED_BYTES - kept.len());
                        kept.extend_from_slice(&buf[..take]);
                        more += (n - take) as u64;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let mut text = String::from_utf8_lossy(&kept).into_owned();
            if more > 0 {
                text.push_str(&format!(
                    "\n[flowhost harness: {more} more bytes were written here and not kept]"
                ));
            }
            text
        })
    }
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn()?;
    let (out, err) = (kept(child.stdout.take()), kept(child.stderr.take()));
    let status = child.wait()?;
    // A reader that panicked kept nothing: its text is empty.
    Ok((
        status,
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paths a test gives are found from its working directory, as they would be when
    /// `flowhost` runs as the test's user: run as another (from `/`), a relative `--read
    /// data` named `/data`, and a relative program or manifest was not found.
    #[test]
    fn relative_paths_are_found_from_the_tests_directory() {
        let here = std::env::current_dir().unwrap();
        let h = Harness::with_binary("/usr/local/bin/flowhost")
            .read("data")
            .profiles_dir("profiles")
            .work_dir("scratch");
        assert_eq!(h.read, [here.join("data")]);
        assert_eq!(h.profiles_dirs, [here.join("profiles")]);
        assert_eq!(h.work_dir, Some(here.join("scratch")));
        assert_eq!(
            argv_from_here(["bin/tool", "serve"]),
            [here.join("bin/tool").into_os_string(), "serve".into()]
        );
        assert_eq!(argv_from_here(["python3", "x.py"]), ["python3", "x.py"]);
        assert_eq!(
            Harness::with_binary("target/debug/flowhost").binary,
            here.join("target/debug/flowhost")
        );
    }

    /// A run's output is kept to its bound, the rest read to its end and counted. Before,
    /// all of it was held: a tool writing without end exhausted the test's memory.
    #[test]
    fn a_runs_output_is_kept_to_its_bound_and_the_rest_counted() {
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.args([
            "-c",
            "head -c 17000000 /dev/zero | tr '\\0' x; echo said >&2; exit 3",
        ]);
        let (status, stdout, stderr) = captured(&mut cmd).unwrap();
        assert_eq!(status.code(), Some(3));
        assert_eq!(stderr, "said\n");
        let more = 17_000_000 - MOST_CAPTURED_BYTES;
        assert!(
            stdout.starts_with("xxx")
                && stdout.ends_with(&format!(
                    "{more} more bytes were written here and not kept]"
                )),
            "{}",
            &stdout[stdout.len() - 100..]
        );
        assert_eq!(
            stdout.bytes().filter(|b| *b == b'x').count(),
            MOST_CAPTURED_BYTES
        );
    }

    /// What a run wrote is shown line by line, escaped: a bidirectional override or an
    /// escape sequence in a tool's stderr cannot reach the author's terminal raw.
    #[test]
    fn what_a_run_wrote_is_shown_escaped_line_by_line() {
        let said = shown("first\nsecond \u{202e}gnp.evil \u{1b}[2J");
        assert_eq!(said.lines().count(), 2, "{said}");
        assert!(
            !said.contains('\u{202e}') && !said.contains('\u{1b}'),
            "{said}"
        );
    }

    #[test]
    fn staging_one_program_from_many_threads_gives_one_executable_copy() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let program = dir.path().join("tool");
        std::fs::write(&program, b"#!/bin/sh\necho staged\n").unwrap();
        let into = dir.path().join("staged");
        let copies: Vec<PathBuf> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| stage(&program, &into).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(copies.iter().all(|c| *c == copies[0]), "{copies:?}");
        let meta = std::fs::metadata(&copies[0]).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o755);
        assert_eq!(
            std::fs::read(&copies[0]).unwrap(),
            std::fs::read(&program).unwrap()
        );
        // No temporary copy is left behind.
        let left = std::fs::read_dir(copies[0].parent().unwrap())
            .unwrap()
            .count();
        assert_eq!(left, 1);
    }

    /// A staged copy changed since it was made (same size, same name) is not run: staging
    /// copies the program again.
    #[test]
    fn a_staged_copy_that_is_no_longer_the_program_is_replaced() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let program = dir.path().join("tool");
        std::fs::write(&program, b"#!/bin/sh\necho staged\n").unwrap();
        let into = dir.path().join("staged");
        let copy = stage(&program, &into).unwrap();
        std::fs::write(&copy, b"#!/bin/sh\necho evil!\n").unwrap();
        assert_eq!(stage(&program, &into).unwrap(), copy);
        assert_eq!(
            std::fs::read(&copy).unwrap(),
            std::fs::read(&program).unwrap()
        );
        // Nor one others may write, though it holds the program's bytes.
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(!same_program(&program, &copy));
        stage(&program, &into).unwrap();
        assert_eq!(
            std::fs::metadata(&copy).unwrap().permissions().mode() & 0o777,
            0o755
        );
        // A directory others may write is made this user's alone; a link in its place is
        // refused.
        std::fs::set_permissions(&into, std::fs::Permissions::from_mode(0o777)).unwrap();
        stage(&program, &into).unwrap();
        assert_eq!(
            std::fs::metadata(&into).unwrap().permissions().mode() & 0o777,
            0o755
        );
        let linked = dir.path().join("linked");
        std::os::unix::fs::symlink(&into, &linked).unwrap();
        assert!(stage(&program, &linked).is_err());
    }
}
