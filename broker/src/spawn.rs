//! Turning a [`SpawnSpec`] into a running, filtered executor: preparation in the host
//! (allocation allowed), `clone` with the profile's namespaces, and the listener handshake.
//!
//! This module holds what a caller asks for ([`SpawnSpec`]) and what can go wrong
//! ([`SpawnError`]); `prepare` turns a spec into owned data in the host, `start` clones the
//! child and runs the listener handshake with it.

mod prepare;
mod start;

pub(crate) use prepare::{Prepared, prepare, remounted};
pub(crate) use start::{HandshakeJob, Started, run_handshakes, start};

use std::ffi::OsString;
use std::os::fd::{OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::profile::Profile;
use crate::stage::Stage;
use crate::sys;

/// The `PATH` an executor gets when its spec sets none.
pub const DEFAULT_EXECUTOR_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Environment variables an executor never receives, whatever the spec says: they change
/// what code a dynamic loader or interpreter runs before the tool's own `main`.
const FORBIDDEN_ENV_PREFIXES: &[&str] = &[
    "LD_",
    "DYLD_",
    "MALLOC_",
    "GLIBC_",
    "BASH_FUNC_",
    // .NET's profiler and start-up hooks (`CORECLR_PROFILER_PATH_64`, ...).
    "CORECLR_",
    "COR_",
    "DOTNET_STARTUP_HOOKS",
    // `LUA_INIT_5_4`, `LUA_PATH_5_4`, ...: code run at start, and module search paths.
    "LUA_INIT",
    "LUA_PATH",
    "LUA_CPATH",
];
const FORBIDDEN_ENV: &[&str] = &[
    "BASH_ENV",
    "ENV",
    "IFS",
    "CDPATH",
    "GCONV_PATH",
    "LOCPATH",
    "HOSTALIASES",
    "RES_OPTIONS",
    "LOCALDOMAIN",
    "NLSPATH",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONWARNINGS",
    // Its `.pth` files run at start, and where the standard library is found.
    "PYTHONUSERBASE",
    "PYTHONPLATLIBDIR",
    // bash runs `PS4`'s command substitutions when `SHELLOPTS` (or `BASHOPTS`) turns on
    // xtrace.
    "SHELLOPTS",
    "BASHOPTS",
    "PS4",
    "PERL5LIB",
    "PERLLIB",
    "PERL5OPT",
    "RUBYLIB",
    "RUBYOPT",
    // RubyGems evaluates the file it names as Ruby when it loads.
    "RUBYGEMS_GEMDEPS",
    // Added to `erl`'s command line, where `-eval` runs code.
    "ERL_FLAGS",
    "ERL_AFLAGS",
    "ERL_ZFLAGS",
    "NODE_OPTIONS",
    "NODE_PATH",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "CLASSPATH",
    "PHPRC",
    "PHP_INI_SCAN_DIR",
    "OPENSSL_CONF",
];

/// Whether an environment variable name is refused for executors.
pub fn env_forbidden(name: &str) -> bool {
    FORBIDDEN_ENV.contains(&name) || FORBIDDEN_ENV_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// What becomes of one of the executor's standard streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdioMode {
    /// A pipe to the host (available on the [`crate::Executor`] handle).
    Piped,
    /// `/dev/null`.
    Null,
    /// The host's own stream.
    Inherit,
    /// The slave of the spec's [`SpawnSpec::terminal`], which becomes the executor's
    /// controlling terminal.
    Terminal,
}

/// How the host wants an executor run.
#[derive(Debug)]
pub struct SpawnSpec {
    /// Program and arguments; `argv[0]` must be an absolute path (no `PATH` search, no shell).
    pub argv: Vec<OsString>,
    /// Environment set explicitly (after the forbidden names are refused).
    pub env: Vec<(OsString, OsString)>,
    /// Names copied from the host's environment when present (an allowlist).
    pub inherit_env: Vec<String>,
    /// Working directory, in the executor's view (default `/tmp`, private per executor).
    pub cwd: PathBuf,
    /// The execution profile.
    pub profile: Arc<Profile>,
    /// uid/gid to run as in privileged mode (default: a uid of its own from the broker's
    /// range, or the broker's shared identity when one is configured).
    pub identity: Option<(u32, u32)>,
    /// Wall-clock limit after which the executor and its tree are killed; `None` for none
    /// (long-lived executors, bounded by their host instead). Default: the profile's.
    pub wall_clock: Option<Duration>,
    /// Standard input.
    pub stdin: StdioMode,
    /// Standard output.
    pub stdout: StdioMode,
    /// Standard error.
    pub stderr: StdioMode,
    /// Extra paths the executor may read and execute beneath (Landlock).
    pub read_paths: Vec<PathBuf>,
    /// Extra paths the executor may read and write beneath (Landlock).
    pub write_paths: Vec<PathBuf>,
    /// Descriptors to pass, placed at the given numbers (3 and up); all others are closed.
    pub keep_fds: Vec<(OwnedFd, RawFd)>,
    /// Files of the host shown, read-only, in place of files of the executor's view: (host
    /// file, absolute path it replaces). Needs the profile's mount namespace; the target
    /// must exist.
    pub bind_files: Vec<(PathBuf, PathBuf)>,
    /// A pseudo-terminal's slave ([`crate::terminal::Pty`]) for the streams in
    /// [`StdioMode::Terminal`]. The executor makes it its controlling terminal in its new
    /// session, before its seccomp filter (which refuses `TIOCSCTTY`) is installed, so the
    /// terminal's job control and signals apply to it as to a process started from a shell.
    pub terminal: Option<OwnedFd>,
    /// Signals the executor starts ignoring; every other signal starts at its default
    /// action. For the signals its own caller ignores (see [`crate::terminal::is_ignored`]),
    /// which a command started directly would inherit. Numbers outside 1 to 64, SIGKILL
    /// and SIGSTOP are refused.
    pub ignored_signals: Vec<libc::c_int>,
}

impl SpawnSpec {
    /// A spec running `argv` under `profile`, with piped stdio and no extra environment.
    pub fn new<I, S>(argv: I, profile: Arc<Profile>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        SpawnSpec {
            argv: argv.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            inherit_env: Vec::new(),
            cwd: PathBuf::from("/tmp"),
            wall_clock: profile.limits.wall_clock,
            profile,
            identity: None,
            stdin: StdioMode::Piped,
            stdout: StdioMode::Piped,
            stderr: StdioMode::Piped,
            read_paths: Vec::new(),
            write_paths: Vec::new(),
            keep_fds: Vec::new(),
            bind_files: Vec::new(),
            terminal: None,
            ignored_signals: Vec::new(),
        }
    }
}

/// Why an executor could not be started. The executor never runs in any of these cases.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The spec is unusable.
    #[error("invalid spawn spec: {0}")]
    InvalidSpec(String),
    /// An environment variable that changes what code runs before the tool was requested.
    #[error(
        "environment variable {0:?} is never passed to executors (it changes what code runs before the tool)"
    )]
    ForbiddenEnvironment(String),
    /// The kernel lacks something the profile requires.
    #[error("profile {profile:?} requires {feature}, which is unavailable here: {observed}")]
    Unsupported {
        /// The profile.
        profile: String,
        /// What is missing.
        feature: &'static str,
        /// What was observed (which call failed, and how).
        observed: String,
    },
    /// Building the filter or the Landlock ruleset failed.
    #[error("cannot prepare the sandbox: {0}")]
    Prepare(String),
    /// A host-side syscall failed while spawning.
    #[error("{what}: {source}")]
    Host {
        /// What the host was doing.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The child failed during setup, before exec.
    #[error("executor setup failed while {}: {}{}", stage.describe(), sys::errno_name(*errno), hint(*stage, *errno))]
    Child {
        /// Where it failed.
        stage: Stage,
        /// The errno.
        errno: i32,
    },
    /// The broker is shut down.
    #[error("the broker is shut down")]
    BrokerGone,
    /// The profile requires a whole-executor bound this host cannot enforce.
    #[error(
        "profile {profile:?} sets {field} with limits.cgroup = \"required\", but this host cannot enforce it: {why}"
    )]
    BoundUnenforceable {
        /// The profile.
        profile: String,
        /// The profile field.
        field: &'static str,
        /// Why the host cannot enforce it.
        why: String,
    },
    /// The profile has no pid namespace and its executors would get no cgroup: nothing would
    /// end what an executor started when it is killed.
    #[error(
        "profile {profile:?} sets namespaces.pid = false, so only a cgroup of its own could end \
         what an executor leaves running when it is killed, and it would get none here: {why}; \
         set namespaces.pid = true"
    )]
    TreeUnheld {
        /// The profile.
        profile: String,
        /// Why its executors get no cgroup.
        why: String,
    },
    /// The host is unprivileged and the profile has no mount namespace.
    #[error(
        "profile {profile:?} sets namespaces.mount = false, which an unprivileged host does not run: \
         its executors, with the host's own uid, would see the host's /proc and could read \
         the host's process there (its environment, memory maps and open descriptors), and \
         change the modes of the caller's files; set namespaces.mount = true"
    )]
    NoMountNamespace {
        /// The profile.
        profile: String,
    },
    /// Every uid of the executor range is held by a live executor or a running process.
    #[error(
        "no free executor uid in {range}: every one is held by a live executor or a running process"
    )]
    NoFreeUid {
        /// The configured range.
        range: String,
    },
    /// The host's processes could not be listed, so no executor uid is known to be unused.
    #[error("{0}")]
    UidScan(#[from] crate::uids::UidScanError),
    /// The executor's cgroup could not be set up.
    #[error("cannot set up the executor's cgroup: {0}")]
    Cgroup(String),
}

fn hint(stage: Stage, errno: i32) -> &'static str {
    match (stage, errno) {
        (Stage::Seccomp, libc::EBUSY) => {
            "; this process is already supervised by another seccomp notify listener (a container seccomp agent, another sandbox), and the broker cannot mediate it: refusing to run the executor unsupervised"
        }
        (Stage::Exec, libc::EACCES) => {
            "; the executor's uid may not search a directory on the way or execute the file (file permissions), or the profile's Landlock rules do not allow the program or its interpreter"
        }
        (Stage::Exec, libc::ENOENT) => {
            "; the program, or the interpreter its #! line names, does not exist in the executor's view (executors have a private, empty /tmp)"
        }
        (Stage::Securebits, libc::EPERM) => {
            "; the host's own securebits lock one of them off or it lacks CAP_SETPCAP (under systemd: SecureBits=noroot noroot-locked, or leave SecureBits= unset)"
        }
        (Stage::Mounts, libc::EPERM) => {
            "; the host lacks CAP_SYS_ADMIN for the profile's namespaces, or (an unprivileged host, in a user namespace of its own) a security module restricts what an unprivileged user namespace may do (Ubuntu's kernel.apparmor_restrict_unprivileged_userns = 1: run the host as root, or give it an AppArmor profile that allows userns)"
        }
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each of these runs code of the caller's choosing before the tool's own `main` (a Java
    /// agent, an exported bash function, a module imported for a warning filter, an engine
    /// an OpenSSL configuration loads); before, they were passed on.
    #[test]
    fn interpreter_start_up_variables_are_refused() {
        for name in [
            "_JAVA_OPTIONS",
            "JDK_JAVA_OPTIONS",
            "BASH_FUNC_ls%%",
            "PERLLIB",
            "PYTHONWARNINGS",
            "OPENSSL_CONF",
            "LD_PRELOAD",
            "JAVA_TOOL_OPTIONS",
            "PYTHONUSERBASE",
            "SHELLOPTS",
            "PS4",
            "DOTNET_STARTUP_HOOKS",
            "CORECLR_PROFILER_PATH_64",
            "CORECLR_ENABLE_PROFILING",
            "LUA_INIT_5_4",
            "PHPRC",
            "CLASSPATH",
            "RUBYGEMS_GEMDEPS",
            "ERL_AFLAGS",
        ] {
            assert!(env_forbidden(name), "{name}");
        }
        for name in ["PATH", "HOME", "JAVA_HOME", "LANG", "BASH"] {
            assert!(!env_forbidden(name), "{name}");
        }
    }
}
