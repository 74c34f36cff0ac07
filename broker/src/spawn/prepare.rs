//! Preparing a spawn in the host, where allocation is allowed: the spec and profile become
//! owned C strings, descriptors, rlimits, a Landlock ruleset and the profile's filter.

use std::ffi::{CString, OsString};
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use landlock::{
    ABI, Access, AccessFs, AccessNet, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope,
    path_beneath_rules,
};

use crate::child::MAX_EXTRA_FDS;
use crate::profile::{LandlockMode, NetworkPath, Profile};
use crate::sys;

use super::{SpawnError, SpawnSpec, StdioMode, env_forbidden};

/// A spec converted into owned, `Send` data; the pointer arrays of [`ChildPlan`] are built
/// from it on the spawner thread just before `clone`.
pub(crate) struct Prepared {
    pub(super) path: CString,
    pub(super) argv: Vec<CString>,
    pub(super) env: Vec<CString>,
    pub(super) cwd: CString,
    pub(super) stdio_child: [OwnedFd; 3],
    /// Which of stdin, stdout and stderr (0 to 2) is the terminal the executor makes its
    /// controlling terminal, if any.
    pub(super) controlling_terminal: Option<libc::c_int>,
    pub(crate) stdio_parent: [Option<OwnedFd>; 3],
    pub(super) keep_fds: Vec<(OwnedFd, RawFd)>,
    pub(super) clone_flags: libc::c_ulong,
    pub(super) user_namespace: bool,
    pub(super) mount_namespace: bool,
    pub(super) mount_proc: bool,
    pub(super) tmpfs_options: Option<CString>,
    pub(super) bind_files: Vec<(CString, CString)>,
    pub(super) read_only_view: Option<crate::child::ReadOnlyView>,
    pub(super) hostname: Option<CString>,
    pub(super) identity: Option<(u32, u32)>,
    pub(super) rlimits: Vec<(libc::c_int, libc::rlimit)>,
    pub(super) landlock: Option<OwnedFd>,
    pub(super) landlock_late: Vec<(CString, u64)>,
    /// The profile's program, compiled once and shared by all its spawns.
    pub(super) filter: Arc<seccompiler::BpfProgram>,
    pub(crate) wall_clock: Option<Duration>,
    /// How the executor enters its cgroups before it may exec.
    pub(crate) cgroup: crate::cgroup::Placement,
    /// The signals it starts ignoring, bit `n - 1` for signal `n`.
    pub(super) ignored_signals: u64,
}

fn cstring(what: &str, bytes: &[u8]) -> Result<CString, SpawnError> {
    CString::new(bytes).map_err(|_| SpawnError::InvalidSpec(format!("{what} contains a NUL byte")))
}

pub(super) fn pipe() -> Result<(OwnedFd, OwnedFd), SpawnError> {
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

/// Whether `path` lies in what the executor's child mounts afresh (its own /proc, its
/// private /tmp): Landlock's rule for such a path is made in the child, after the mount, on
/// the executor's file, not the host's.
pub(crate) fn remounted(profile: &Profile, path: &std::path::Path) -> bool {
    (profile.mount_namespace && profile.pid_namespace && path.starts_with("/proc"))
        || (profile.private_tmp && path.starts_with("/tmp"))
}

/// What the child makes writable again in its read-only view (see
/// [`crate::child::ReadOnlyView`]): each of `write_paths` but devices (written whatever
/// their mount), by its real path, with the mounts the host's mount table has writable at
/// it (the mount it lies on) and beneath it.
fn read_only_view(write_paths: &[PathBuf]) -> Result<crate::child::ReadOnlyView, SpawnError> {
    use std::os::unix::fs::FileTypeExt;
    let table = std::fs::read("/proc/self/mountinfo")
        .map_err(|e| SpawnError::Prepare(format!("reading this process's mount table: {e}")))?;
    let mounts = mount_table(&table);
    let writable_on_host = |m: &HostMount| m.writable;
    let mut view = crate::child::ReadOnlyView::default();
    for p in write_paths {
        let meta = std::fs::metadata(p)
            .map_err(|e| SpawnError::InvalidSpec(format!("write path {}: {e}", p.display())))?;
        if meta.file_type().is_char_device() || meta.file_type().is_block_device() {
            continue;
        }
        let real = std::fs::canonicalize(p)
            .map_err(|e| SpawnError::InvalidSpec(format!("write path {}: {e}", p.display())))?;
        let on = mounts
            .iter()
            .filter(|m| real.starts_with(&m.mount_point))
            .max_by_key(|m| m.mount_point.as_os_str().len());
        if on.is_some_and(writable_on_host) {
            view.writable
                .push(cstring("a write path", real.as_os_str().as_bytes())?);
        }
        for beneath in mounts.iter().filter(|m| {
            m.mount_point != real && m.mount_point.starts_with(&real) && writable_on_host(m)
        }) {
            view.writable.push(cstring(
                "a mount beneath a write path",
                beneath.mount_point.as_os_str().as_bytes(),
            )?);
        }
        view.binds
            .push(cstring("a write path", real.as_os_str().as_bytes())?);
    }
    Ok(view)
}

/// One mount of the host's mount table.
struct HostMount {
    mount_point: PathBuf,
    /// Its own options say `rw`.
    writable: bool,
}

/// The mounts of a `/proc/<pid>/mountinfo` text, read as bytes (a mount point may be any
/// bytes but NUL): the mount point (field 5, with the kernel's `\ooo` escapes of space,
/// tab, newline and backslash decoded) and whether the mount's own options (field 6) say
/// `rw`. A line without both fields is left out.
fn mount_table(text: &[u8]) -> Vec<HostMount> {
    use std::os::unix::ffi::OsStringExt;
    let unescape = |field: &[u8]| {
        let mut out = Vec::with_capacity(field.len());
        let mut i = 0;
        while i < field.len() {
            let octal = field
                .get(i + 1..i + 4)
                .filter(|d| field[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)));
            match octal {
                Some(d) => {
                    out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                    i += 4;
                }
                None => {
                    out.push(field[i]);
                    i += 1;
                }
            }
        }
        out
    };
    text.split(|b| *b == b'\n')
        .filter_map(|line| {
            let mut fields = line.split(|b| *b == b' ');
            let point = fields.nth(4)?;
            let options = fields.next()?;
            Some(HostMount {
                mount_point: PathBuf::from(std::ffi::OsString::from_vec(unescape(point))),
                writable: options.split(|b| *b == b',').any(|o| o == b"rw"),
            })
        })
        .collect()
}

/// The mask of `signals` (bit `n - 1` for signal `n`); SIGKILL, SIGSTOP and numbers the
/// kernel does not have cannot be ignored, and are refused.
fn signal_mask(signals: &[libc::c_int]) -> Result<u64, SpawnError> {
    signals.iter().try_fold(0u64, |mask, &signal| {
        if !(1..=64).contains(&signal) || signal == libc::SIGKILL || signal == libc::SIGSTOP {
            return Err(SpawnError::InvalidSpec(format!(
                "signal {signal} cannot be ignored by an executor"
            )));
        }
        Ok(mask | 1u64 << (signal - 1))
    })
}

/// Prepares everything the child needs. `privileged` selects uid switching (the broker holds
/// its capabilities) or a user namespace (unprivileged host); `default_identity` is used when
/// the spec names none; `filter` is the profile's compiled seccomp program.
pub(crate) fn prepare(
    spec: SpawnSpec,
    privileged: bool,
    default_identity: Option<(u32, u32)>,
    landlock_abi: i32,
    filter: Arc<seccompiler::BpfProgram>,
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
    let ignored_signals = signal_mask(&spec.ignored_signals)?;
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
        env.push(("PATH".into(), crate::spawn::DEFAULT_EXECUTOR_PATH.into()));
    }
    // A home and a temporary directory of the executor's own, writable: runtimes write
    // caches and temporary files there (Python, Node, npm) and look up the home directory
    // when HOME is unset (a passwd lookup for a uid that has no entry). The private /tmp is
    // the executor's alone and dies with it.
    if profile.private_tmp {
        for name in ["HOME", "TMPDIR"] {
            if !env.iter().any(|(k, _)| k == name) {
                env.push((name.into(), "/tmp".into()));
            }
        }
    }
    // Python runs the `.pth` files of the user site under HOME at every start: a HOME the
    // spec sets may be a directory others (another executor) write. Off unless the spec
    // turns it on.
    if !env.iter().any(|(k, _)| k == "PYTHONNOUSERSITE") {
        env.push(("PYTHONNOUSERSITE".into(), "1".into()));
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

    let terminal = spec.terminal;
    let modes = [spec.stdin, spec.stdout, spec.stderr];
    let controlling_terminal = modes
        .iter()
        .position(|m| *m == StdioMode::Terminal)
        .map(|i| i as libc::c_int);
    if terminal.is_some() != controlling_terminal.is_some() {
        return Err(SpawnError::InvalidSpec(
            "a terminal is given exactly when a standard stream is StdioMode::Terminal".into(),
        ));
    }
    let mut stdio_child: Vec<OwnedFd> = Vec::with_capacity(3);
    let mut stdio_parent: [Option<OwnedFd>; 3] = [None, None, None];
    for (i, mode) in modes.into_iter().enumerate() {
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
            StdioMode::Terminal => {
                // Present: checked above.
                let Some(terminal) = &terminal else {
                    return Err(SpawnError::InvalidSpec("no terminal given".into()));
                };
                stdio_child.push(terminal.try_clone().map_err(|source| SpawnError::Host {
                    what: "duplicating the executor's terminal",
                    source,
                })?);
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
        // u32::MAX is "no change" to setresuid/setresgid: the executor would keep the
        // broker's own identity.
        if [id.0, id.1].iter().any(|&n| n == 0 || n == u32::MAX) {
            return Err(SpawnError::InvalidSpec(
                "executors never run as uid or gid 0, nor 4294967295 (which would leave the \
                 broker's own)"
                    .into(),
            ));
        }
        Some(id)
    } else {
        None
    };

    if !spec.bind_files.is_empty() && !profile.mount_namespace {
        return Err(SpawnError::InvalidSpec(format!(
            "files shown in the executor's view need a mount namespace, which profile {:?} does not give",
            profile.name
        )));
    }
    let mut bind_files = Vec::with_capacity(spec.bind_files.len());
    for (source, target) in &spec.bind_files {
        if !target.is_absolute() {
            return Err(SpawnError::InvalidSpec(format!(
                "{} is not an absolute path in the executor's view",
                target.display()
            )));
        }
        bind_files.push((
            cstring("a bound file", source.as_os_str().as_bytes())?,
            cstring("a bound file's target", target.as_os_str().as_bytes())?,
        ));
    }

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
    let remounted = |p: &PathBuf| remounted(&profile, p);
    let (late_read, read_paths): (Vec<_>, Vec<_>) = read_paths.into_iter().partition(remounted);
    let (late_write, write_paths): (Vec<_>, Vec<_>) = write_paths.into_iter().partition(remounted);
    // Run as its caller's uid (no uid of its own), the executor sees the view read-only but
    // for its write paths (see `ChildPlan::read_only_view`). A device needs no writable
    // mount to be written (/dev/null).
    // Without a mount namespace, an executor of an unprivileged host (its uid) would see
    // the host's /proc, where the host's own process is readable to it.
    if !privileged && !profile.mount_namespace {
        return Err(SpawnError::NoMountNamespace {
            profile: profile.name.clone(),
        });
    }
    let read_only_view = if !privileged {
        Some(read_only_view(&write_paths)?)
    } else {
        None
    };
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

    Ok(Prepared {
        path,
        argv,
        env,
        cwd,
        stdio_child,
        controlling_terminal,
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
        bind_files,
        read_only_view,
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
        cgroup: Default::default(),
        ignored_signals,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Mount points are read as the kernel writes them: escapes decoded (a space is
    /// `\040`), any other bytes kept as they are (one that is not UTF-8 no longer fails the
    /// whole table, and with it every unprivileged spawn), and `rw` from the mount's own
    /// options only.
    #[test]
    fn the_mount_table_is_read_as_the_kernel_writes_it() {
        use std::os::unix::ffi::OsStrExt;
        let text = b"22 27 0:21 / /proc rw,relatime - proc proc rw\n\
            40 27 0:40 / /home/u/My\\040Drive ro,nosuid shared:5 - fuse.rclone x rw\n\
            41 27 0:41 / /home/u/\xff\\134x rw - fuse y rw\n\
            short line\n";
        let table = mount_table(text);
        let shown: Vec<(&[u8], bool)> = table
            .iter()
            .map(|m| (m.mount_point.as_os_str().as_bytes(), m.writable))
            .collect();
        assert_eq!(
            shown,
            [
                (&b"/proc"[..], true),
                (&b"/home/u/My Drive"[..], false),
                (&b"/home/u/\xff\\x"[..], true),
            ]
        );
    }

    /// Signals an executor may start ignoring become their bits; those it cannot ignore,
    /// and numbers the kernel does not have, refuse the spawn.
    #[test]
    fn only_ignorable_signals_make_the_mask() {
        assert_eq!(signal_mask(&[]).unwrap(), 0);
        assert_eq!(
            signal_mask(&[libc::SIGHUP, libc::SIGINT, 64]).unwrap(),
            0b11 | 1 << 63
        );
        for bad in [0, -1, 65, libc::SIGKILL, libc::SIGSTOP] {
            let e = signal_mask(&[libc::SIGHUP, bad]).unwrap_err();
            assert!(
                e.to_string()
                    .contains(&format!("signal {bad} cannot be ignored")),
                "{e}"
            );
        }
    }
}
