//! Turning a [`SpawnSpec`] into a running, filtered executor: preparation in the host
//! (allocation allowed), `clone` with the profile's namespaces, and the listener handshake.

use std::ffi::{CString, OsString};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use landlock::{
    ABI, Access, AccessFs, AccessNet, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope,
    path_beneath_rules,
};

use crate::child::{self, ChildPlan, MAX_EXTRA_FDS, READY, STARTED, Stage};
use crate::profile::{LandlockMode, NetworkPath, Profile};
use crate::sys;

/// Environment variables an executor never receives, whatever the spec says: they change
/// what code a dynamic loader or interpreter runs before the tool's own `main`.
const FORBIDDEN_ENV_PREFIXES: &[&str] = &["LD_", "DYLD_", "MALLOC_", "GLIBC_"];
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
    "PERL5LIB",
    "PERL5OPT",
    "RUBYLIB",
    "RUBYOPT",
    "NODE_OPTIONS",
    "NODE_PATH",
    "JAVA_TOOL_OPTIONS",
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
    /// Every uid of the executor range is held by a live executor or a running process.
    #[error(
        "no free executor uid in {range}: every one is held by a live executor or a running process"
    )]
    NoFreeUid {
        /// The configured range.
        range: String,
    },
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
            "; check that the program is executable and that the profile's Landlock rules allow it"
        }
        (Stage::Securebits, libc::EPERM) => {
            "; the host's own securebits lock one of them off or it lacks CAP_SETPCAP (under systemd: SecureBits=noroot noroot-locked, or leave SecureBits= unset)"
        }
        (Stage::Mounts, libc::EPERM) => {
            "; the host lacks CAP_SYS_ADMIN for the profile's namespaces"
        }
        _ => "",
    }
}

/// A spec converted into owned, `Send` data; the pointer arrays of [`ChildPlan`] are built
/// from it on the spawner thread just before `clone`.
pub(crate) struct Prepared {
    path: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    cwd: CString,
    stdio_child: [OwnedFd; 3],
    pub(crate) stdio_parent: [Option<OwnedFd>; 3],
    keep_fds: Vec<(OwnedFd, RawFd)>,
    clone_flags: libc::c_ulong,
    user_namespace: bool,
    mount_namespace: bool,
    mount_proc: bool,
    tmpfs_options: Option<CString>,
    hostname: Option<CString>,
    identity: Option<(u32, u32)>,
    rlimits: Vec<(libc::c_int, libc::rlimit)>,
    landlock: Option<OwnedFd>,
    landlock_late: Vec<(CString, u64)>,
    filter: Vec<seccompiler::sock_filter>,
    pub(crate) wall_clock: Option<Duration>,
    /// `cgroup.procs` files the executor is moved into before it may exec.
    pub(crate) cgroup_procs: Vec<PathBuf>,
}

fn cstring(what: &str, bytes: &[u8]) -> Result<CString, SpawnError> {
    CString::new(bytes).map_err(|_| SpawnError::InvalidSpec(format!("{what} contains a NUL byte")))
}

fn pipe() -> Result<(OwnedFd, OwnedFd), SpawnError> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| SpawnError::Host {
        what: "creating a pipe",
        source: e.into(),
    })
}

fn dev_null() -> Result<OwnedFd, SpawnError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map(OwnedFd::from)
        .map_err(|source| SpawnError::Host {
            what: "opening /dev/null",
            source,
        })
}

/// Prepares everything the child needs. `privileged` selects uid switching (the broker holds
/// its capabilities) or a user namespace (unprivileged host); `default_identity` is used when
/// the spec names none.
pub(crate) fn prepare(
    spec: SpawnSpec,
    privileged: bool,
    default_identity: Option<(u32, u32)>,
    landlock_abi: i32,
) -> Result<Prepared, SpawnError> {
    let profile = spec.profile.clone();
    let Some(program) = spec.argv.first() else {
        return Err(SpawnError::InvalidSpec("argv is empty".into()));
    };
    let program = PathBuf::from(program);
    if !program.is_absolute() {
        return Err(SpawnError::InvalidSpec(format!(
            "argv[0] {} is not an absolute path (executors are started without PATH search or a shell)",
            program.display()
        )));
    }
    let path = cstring("argv[0]", program.as_os_str().as_bytes())?;
    let argv = spec
        .argv
        .iter()
        .map(|a| cstring("an argument", a.as_bytes()))
        .collect::<Result<Vec<_>, _>>()?;

    let mut env: Vec<(OsString, OsString)> = Vec::new();
    for name in &spec.inherit_env {
        if env_forbidden(name) {
            return Err(SpawnError::ForbiddenEnvironment(name.clone()));
        }
        if let Some(value) = std::env::var_os(name) {
            env.push((name.into(), value));
        }
    }
    for (k, v) in &spec.env {
        let name = k.to_string_lossy();
        if env_forbidden(&name) {
            return Err(SpawnError::ForbiddenEnvironment(name.into_owned()));
        }
        if name.is_empty() || name.contains('=') {
            return Err(SpawnError::InvalidSpec(format!(
                "environment name {name:?} is not valid"
            )));
        }
        env.retain(|(existing, _)| existing != k);
        env.push((k.clone(), v.clone()));
    }
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
    }
    let env = env
        .iter()
        .map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            cstring("an environment variable", &kv)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cwd = cstring("the working directory", spec.cwd.as_os_str().as_bytes())?;

    if spec.keep_fds.len() > MAX_EXTRA_FDS {
        return Err(SpawnError::InvalidSpec(format!(
            "at most {MAX_EXTRA_FDS} descriptors can be passed"
        )));
    }
    for (_, target) in &spec.keep_fds {
        if *target < 3 || *target >= 512 {
            return Err(SpawnError::InvalidSpec(format!(
                "descriptor target {target} must be between 3 and 511"
            )));
        }
    }

    let mut stdio_child: Vec<OwnedFd> = Vec::with_capacity(3);
    let mut stdio_parent: [Option<OwnedFd>; 3] = [None, None, None];
    for (i, mode) in [spec.stdin, spec.stdout, spec.stderr]
        .into_iter()
        .enumerate()
    {
        match mode {
            StdioMode::Piped => {
                let (r, w) = pipe()?;
                if i == 0 {
                    stdio_child.push(r);
                    stdio_parent[0] = Some(w);
                } else {
                    stdio_child.push(w);
                    stdio_parent[i] = Some(r);
                }
            }
            StdioMode::Null => stdio_child.push(dev_null()?),
            StdioMode::Inherit => {
                // SAFETY: fds 0..2 of the host are open for the life of the process.
                let own = unsafe { std::os::fd::BorrowedFd::borrow_raw(i as RawFd) };
                stdio_child.push(
                    own.try_clone_to_owned()
                        .map_err(|source| SpawnError::Host {
                            what: "duplicating a host standard stream",
                            source,
                        })?,
                );
            }
        }
    }
    let stdio_child: [OwnedFd; 3] = stdio_child
        .try_into()
        .map_err(|_| SpawnError::InvalidSpec("stdio".into()))?;

    let identity = if privileged {
        let id = spec.identity.or(default_identity).ok_or_else(|| {
            SpawnError::InvalidSpec(
                "the broker is privileged but no executor uid/gid is configured".into(),
            )
        })?;
        if id.0 == 0 || id.1 == 0 {
            return Err(SpawnError::InvalidSpec(
                "executors never run as uid or gid 0".into(),
            ));
        }
        Some(id)
    } else {
        None
    };

    let mut flags: libc::c_ulong = 0;
    if !privileged {
        flags |= libc::CLONE_NEWUSER as libc::c_ulong;
    }
    if profile.mount_namespace {
        flags |= libc::CLONE_NEWNS as libc::c_ulong;
    }
    if profile.pid_namespace {
        flags |= libc::CLONE_NEWPID as libc::c_ulong;
    }
    if profile.ipc_namespace {
        flags |= libc::CLONE_NEWIPC as libc::c_ulong;
    }
    if profile.uts_namespace {
        flags |= libc::CLONE_NEWUTS as libc::c_ulong;
    }
    if profile.network == NetworkPath::None {
        flags |= libc::CLONE_NEWNET as libc::c_ulong;
    }

    let l = profile.limits;
    let lim = |v: u64| libc::rlimit {
        rlim_cur: v,
        rlim_max: v,
    };
    let mut rlimits = vec![
        (libc::RLIMIT_NOFILE as libc::c_int, lim(l.open_files)),
        (libc::RLIMIT_NPROC as libc::c_int, lim(l.processes)),
        (libc::RLIMIT_CPU as libc::c_int, lim(l.cpu_seconds)),
        (libc::RLIMIT_FSIZE as libc::c_int, lim(l.file_size)),
        (libc::RLIMIT_CORE as libc::c_int, lim(0)),
    ];
    if let Some(bytes) = l.address_space {
        rlimits.push((libc::RLIMIT_AS as libc::c_int, lim(bytes)));
    }

    let mut read_paths: Vec<PathBuf> = profile.read_only.clone();
    read_paths.extend(spec.read_paths.iter().cloned());
    read_paths.push(program.clone());
    let mut write_paths = profile.read_write.clone();
    write_paths.extend(spec.write_paths.iter().cloned());
    // Paths the child mounts afresh get their rules inside the child, after the mount.
    let remounted = |p: &PathBuf| {
        (profile.mount_namespace && profile.pid_namespace && p.starts_with("/proc"))
            || (profile.private_tmp && p.starts_with("/tmp"))
    };
    let (late_read, read_paths): (Vec<_>, Vec<_>) = read_paths.into_iter().partition(remounted);
    let (late_write, write_paths): (Vec<_>, Vec<_>) = write_paths.into_iter().partition(remounted);
    let abi = landlock_abi_for(landlock_abi);
    let landlock = landlock_ruleset(&profile, &read_paths, &write_paths, landlock_abi)?;
    let mut landlock_late = Vec::new();
    if landlock.is_some() {
        for p in late_read {
            landlock_late.push((
                cstring("a Landlock path", p.as_os_str().as_bytes())?,
                AccessFs::from_read(abi).bits(),
            ));
        }
        for p in late_write {
            landlock_late.push((
                cstring("a Landlock path", p.as_os_str().as_bytes())?,
                AccessFs::from_all(abi).bits(),
            ));
        }
    }

    let filter =
        crate::filter::compile(&profile).map_err(|e| SpawnError::Prepare(e.to_string()))?;

    Ok(Prepared {
        path,
        argv,
        env,
        cwd,
        stdio_child,
        stdio_parent,
        keep_fds: spec.keep_fds,
        clone_flags: flags,
        user_namespace: !privileged,
        mount_namespace: profile.mount_namespace,
        mount_proc: profile.mount_namespace && profile.pid_namespace,
        tmpfs_options: if profile.private_tmp {
            Some(cstring("tmpfs options", b"mode=1777,size=64m")?)
        } else {
            None
        },
        hostname: profile
            .uts_namespace
            .then(|| cstring("hostname", b"flowhost-executor"))
            .transpose()?,
        identity,
        rlimits,
        landlock,
        landlock_late,
        filter,
        wall_clock: spec.wall_clock,
        cgroup_procs: Vec::new(),
    })
}

/// The Landlock ABI to build rules for: the kernel's, capped at the newest this broker uses,
/// so the handled rights and every rule (including those added in the child) agree.
fn landlock_abi_for(kernel_abi: i32) -> ABI {
    ABI::from(kernel_abi.min(6))
}

fn landlock_ruleset(
    profile: &Profile,
    read_only: &[PathBuf],
    read_write: &[PathBuf],
    kernel_abi: i32,
) -> Result<Option<OwnedFd>, SpawnError> {
    if kernel_abi <= 0 {
        return match profile.landlock {
            LandlockMode::Required => Err(SpawnError::Unsupported {
                profile: profile.name.clone(),
                feature: "Landlock",
                observed: sys::landlock_unavailable().unwrap_or_default(),
            }),
            LandlockMode::BestEffort => Ok(None),
        };
    }
    let abi = landlock_abi_for(kernel_abi);
    let prep = |e: landlock::RulesetError| SpawnError::Prepare(format!("Landlock: {e}"));
    let created = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .map_err(prep)?
        // No TCP rules: the executor itself may neither bind nor connect; the broker, which
        // is outside the domain, does both on its behalf after deciding.
        .handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)
        .map_err(prep)?
        .scope(Scope::AbstractUnixSocket | Scope::Signal)
        .map_err(prep)?
        .create()
        .map_err(prep)?
        .add_rules(path_beneath_rules(read_only, AccessFs::from_read(abi)))
        .map_err(prep)?
        .add_rules(path_beneath_rules(read_write, AccessFs::from_all(abi)))
        .map_err(prep)?;
    let fd: Option<OwnedFd> = created.into();
    if fd.is_none() && profile.landlock == LandlockMode::Required {
        return Err(SpawnError::Unsupported {
            profile: profile.name.clone(),
            feature: "Landlock",
            observed: "the landlock crate could not create a ruleset".into(),
        });
    }
    Ok(fd)
}

/// A cloned child whose filter is installed and whose listener the host now holds.
pub(crate) struct Started {
    pub pid: libc::pid_t,
    pub pidfd: OwnedFd,
    pub listener: OwnedFd,
}

fn read_status(fd: &OwnedFd, timeout: Duration) -> Result<Option<(u32, i32)>, SpawnError> {
    let host = |what: &'static str| move |source: std::io::Error| SpawnError::Host { what, source };
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: polls one descriptor we own.
        let r = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(host("waiting for the executor's setup")(e));
        }
        if r == 0 {
            return Err(SpawnError::Host {
                what: "waiting for the executor's setup",
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no answer within the setup deadline",
                ),
            });
        }
        break;
    }
    let mut buf = [0u8; 8];
    let n = nix::unistd::read(fd, &mut buf)
        .map_err(|e| host("reading the executor's status")(e.into()))?;
    match n {
        0 => Ok(None),
        8 => Ok(Some((
            u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]),
            i32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]),
        ))),
        _ => Err(SpawnError::Host {
            what: "reading the executor's status",
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "short status message"),
        }),
    }
}

fn write_byte(fd: &OwnedFd, byte: u8) -> Result<(), SpawnError> {
    nix::unistd::write(fd, &[byte])
        .map(|_| ())
        .map_err(|e| SpawnError::Host {
            what: "releasing the executor",
            source: e.into(),
        })
}

fn write_id_maps(pid: libc::pid_t) -> std::io::Result<()> {
    let uid = nix::unistd::geteuid().as_raw();
    let gid = nix::unistd::getegid().as_raw();
    std::fs::write(format!("/proc/{pid}/setgroups"), "deny")?;
    std::fs::write(format!("/proc/{pid}/uid_map"), format!("0 {uid} 1\n"))?;
    std::fs::write(format!("/proc/{pid}/gid_map"), format!("0 {gid} 1\n"))?;
    Ok(())
}

/// The pid a pidfd refers to, from `/proc/self/fdinfo`.
fn pid_of(pidfd: BorrowedFd<'_>) -> std::io::Result<libc::pid_t> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd()))?;
    info.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "no Pid in fdinfo"))
}

/// How long a child may take between clone and exec before the host gives up on it.
const SETUP_DEADLINE: Duration = Duration::from_secs(10);

/// Stack for the child between clone and exec (it only makes syscalls).
const CHILD_STACK: usize = 256 * 1024;

/// One spawn's half of the handshake, run on the broker's handshake thread while the
/// spawner thread is suspended in `clone(CLONE_VFORK)`.
pub(crate) struct HandshakeJob {
    status_r: OwnedFd,
    go_w: OwnedFd,
    /// Where `CLONE_PIDFD` stores the child's pidfd (before the child first runs).
    pidfd: Arc<AtomicI32>,
    user_namespace: bool,
    cgroup_procs: Vec<PathBuf>,
    reply: std::sync::mpsc::SyncSender<Result<OwnedFd, SpawnError>>,
}

/// The handshake thread: for each spawn, writes the user-namespace maps if needed, takes the
/// seccomp listener from the child with `pidfd_getfd`, releases it, and waits for its exec.
pub(crate) fn run_handshakes(jobs: std::sync::mpsc::Receiver<HandshakeJob>) {
    while let Ok(job) = jobs.recv() {
        let result = handshake(&job);
        if result.is_err() {
            // Never leave a child waiting: a stop byte makes it exit before exec. A child
            // stuck in a syscall during setup (a hung filesystem) never reads it, and the
            // spawner thread stays suspended in clone(CLONE_VFORK) until the child execs or
            // dies, which would stall every later spawn: so it is also killed.
            let _ = write_byte(&job.go_w, STOP);
            let raw = job.pidfd.load(Ordering::SeqCst);
            if raw >= 0 {
                // SAFETY: the kernel installed this pidfd for this spawn; the spawner takes
                // ownership of it (and may close it) only after receiving our reply, which
                // is sent below, so the number still names this child's pidfd here.
                let pidfd = unsafe { BorrowedFd::borrow_raw(raw) };
                let _ = crate::sys::pidfd_send_signal(pidfd, libc::SIGKILL);
            }
        }
        let _ = job.reply.send(result);
    }
}

const GO: u8 = 1;
const STOP: u8 = 0;

fn handshake(job: &HandshakeJob) -> Result<OwnedFd, SpawnError> {
    let child_error = |stage: u32, errno: i32| match Stage::from_u32(stage) {
        Some(stage) => SpawnError::Child { stage, errno },
        None => SpawnError::Prepare(format!("unknown setup stage {stage}")),
    };
    let exited = || SpawnError::Host {
        what: "executor setup",
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the executor exited during setup",
        ),
    };
    let mut message = read_status(&job.status_r, SETUP_DEADLINE)?;
    // The child ran, so clone has stored its pidfd (the kernel writes it before the child
    // first runs).
    let raw = job.pidfd.load(Ordering::SeqCst);
    if raw < 0 {
        return Err(exited());
    }
    let pidfd = || {
        // SAFETY: a descriptor the kernel installed for this spawn; it stays open until the
        // spawner, resumed after exec, takes ownership of it.
        unsafe { BorrowedFd::borrow_raw(raw) }
    };
    if job.user_namespace {
        match message {
            Some((STARTED, _)) => {}
            Some((stage, errno)) => return Err(child_error(stage, errno)),
            None => return Err(exited()),
        }
        let pid = pid_of(pidfd()).map_err(|source| SpawnError::Host {
            what: "finding the executor's pid",
            source,
        })?;
        write_id_maps(pid).map_err(|source| SpawnError::Host {
            what: "writing the executor's user-namespace maps",
            source,
        })?;
        write_byte(&job.go_w, GO)?;
        message = read_status(&job.status_r, SETUP_DEADLINE)?;
    }
    let listener_fd = match message {
        Some((READY, fd)) => fd,
        Some((stage, errno)) => return Err(child_error(stage, errno)),
        None => return Err(exited()),
    };
    let listener = sys::pidfd_getfd(pidfd(), listener_fd).map_err(|source| SpawnError::Host {
        what: "taking the executor's seccomp listener (pidfd_getfd; the host needs ptrace access to its executors, e.g. CAP_SYS_PTRACE)",
        source,
    })?;
    sys::notif_set_sync_wakeup(listener.as_fd());
    if !job.cgroup_procs.is_empty() {
        // Into its cgroup before it runs a single instruction of the program, so nothing
        // it forks escapes the bounds.
        let pid = pid_of(pidfd()).map_err(|source| SpawnError::Host {
            what: "finding the executor's pid",
            source,
        })?;
        for procs in &job.cgroup_procs {
            std::fs::write(procs, pid.to_string()).map_err(|source| SpawnError::Host {
                what: "moving the executor into its cgroup",
                source,
            })?;
        }
    }
    write_byte(&job.go_w, GO)?;
    // End of file: the exec succeeded (the status pipe is close-on-exec, and the spawner
    // closes its copy once clone returns). A message: exec failed.
    match read_status(&job.status_r, SETUP_DEADLINE)? {
        None => Ok(listener),
        Some((stage, errno)) => Err(child_error(stage, errno)),
    }
}

extern "C" fn child_entry(plan: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `plan` points at the spawner's ChildPlan, which stays alive and unchanged while
    // the spawner is suspended (CLONE_VFORK) until this child execs or exits.
    unsafe { child::child_main(&*(plan as *const ChildPlan)) }
}

/// Starts the child with `clone(CLONE_VM | CLONE_VFORK)` on its own stack: no page tables
/// are copied, so spawning costs the same whatever the host's memory, and this (spawner)
/// thread stays suspended until the child has exec'd or exited. The handshake that needs the
/// host meanwhile runs on the broker's handshake thread. Runs on the spawner thread, whose
/// lifetime bounds every executor's (the parent-death signal follows the creating thread).
pub(crate) fn start(
    prepared: &Prepared,
    handshakes: &std::sync::mpsc::Sender<HandshakeJob>,
) -> Result<Started, SpawnError> {
    let (status_r, status_w) = pipe()?;
    let (go_r, go_w) = pipe()?;
    let null_terminated = |v: &[CString]| {
        let mut p: Vec<*const libc::c_char> = v.iter().map(|c| c.as_ptr()).collect();
        p.push(std::ptr::null());
        p
    };
    let plan = ChildPlan {
        path: prepared.path.clone(),
        argv: null_terminated(&prepared.argv),
        envp: null_terminated(&prepared.env),
        cwd: prepared.cwd.clone(),
        stdio: [
            prepared.stdio_child[0].as_raw_fd(),
            prepared.stdio_child[1].as_raw_fd(),
            prepared.stdio_child[2].as_raw_fd(),
        ],
        extra_fds: prepared
            .keep_fds
            .iter()
            .map(|(fd, target)| (fd.as_raw_fd(), *target))
            .collect(),
        status_w: status_w.as_raw_fd(),
        go_r: go_r.as_raw_fd(),
        user_namespace: prepared.user_namespace,
        mount_namespace: prepared.mount_namespace,
        mount_proc: prepared.mount_proc,
        tmpfs_options: prepared.tmpfs_options.clone(),
        hostname: prepared.hostname.clone(),
        identity: prepared.identity,
        rlimits: prepared.rlimits.clone(),
        landlock_fd: prepared.landlock.as_ref().map(|fd| fd.as_raw_fd()),
        landlock_late: prepared.landlock_late.clone(),
        filter: prepared.filter.clone(),
    };
    let mut stack = vec![0u8; CHILD_STACK];
    let pidfd_cell = Arc::new(AtomicI32::new(-1));
    let (reply, handshake) = std::sync::mpsc::sync_channel(1);
    handshakes
        .send(HandshakeJob {
            status_r,
            go_w,
            pidfd: pidfd_cell.clone(),
            user_namespace: prepared.user_namespace,
            cgroup_procs: prepared.cgroup_procs.clone(),
            reply,
        })
        .map_err(|_| SpawnError::BrokerGone)?;

    // Signals stay blocked from here until the child restores its mask right before exec:
    // the child shares this process's memory, so a handler of the host must never run in it.
    let mut all = MaybeUninit::<libc::sigset_t>::uninit();
    let mut old = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigfillset initialises `all`; pthread_sigmask writes the previous mask to `old`.
    unsafe {
        libc::sigfillset(all.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_BLOCK, all.as_ptr(), old.as_mut_ptr());
    }
    let flags = prepared.clone_flags as libc::c_int
        | libc::CLONE_VM
        | libc::CLONE_VFORK
        | libc::CLONE_PIDFD
        | libc::SIGCHLD;
    // The stack grows down; its top must be 16-byte aligned.
    let top = (stack.as_mut_ptr() as usize + CHILD_STACK) & !15;
    // SAFETY: the child runs `child_entry` on its own stack (`stack`, alive until clone
    // returns) and only reads `plan`, which this suspended thread keeps alive and unchanged;
    // CLONE_PIDFD writes the pidfd into the atomic cell.
    let ret = unsafe {
        libc::clone(
            child_entry,
            top as *mut libc::c_void,
            flags,
            &plan as *const ChildPlan as *mut libc::c_void,
            pidfd_cell.as_ptr(),
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    let clone_error = (ret < 0).then(std::io::Error::last_os_error);
    // SAFETY: restores this thread's previous mask, saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old.as_ptr(), std::ptr::null_mut()) };
    // The child has exec'd or exited: the spawner's copies of its pipe ends go, so the
    // handshake thread sees end of file.
    drop(status_w);
    drop(go_r);
    drop(plan);
    drop(stack);
    let outcome = handshake.recv().unwrap_or(Err(SpawnError::BrokerGone));
    if let Some(source) = clone_error {
        return Err(SpawnError::Host {
            what: "clone (creating the executor and its namespaces)",
            source,
        });
    }
    let pid = ret as libc::pid_t;
    // SAFETY: CLONE_PIDFD stored a new descriptor that only this function now owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd_cell.load(Ordering::SeqCst)) };
    match outcome {
        Ok(listener) => Ok(Started {
            pid,
            pidfd,
            listener,
        }),
        Err(e) => {
            let _ = sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
            let _ = sys::waitid_pidfd(pidfd.as_fd(), true);
            Err(e)
        }
    }
}
