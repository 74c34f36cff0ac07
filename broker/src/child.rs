//! The executor side of a spawn: everything between `clone(2)` and `execve(2)`.
//!
//! The child shares the host's memory until exec (`clone(CLONE_VM | CLONE_VFORK)`, on its own
//! stack) while the host's other threads keep running, so it may only make raw syscalls: no
//! allocation (the allocator is shared), no glibc credential wrappers (they signal the host's
//! threads), no writes to anything but its own stack. Everything it needs is prepared by the
//! parent in a [`ChildPlan`], which the suspended spawner thread keeps alive and unchanged.
//!
//! Order matters and is fixed: user-namespace maps (when unprivileged), mounts and hostname
//! (need CAP_SYS_ADMIN), file descriptors, a new session (with the executor's own
//! pseudo-terminal as its controlling terminal, when it has one), working directory, rlimits,
//! capability bounding set, ambient set and securebits (need CAP_SETPCAP), groups/gid/uid
//! (drops the remaining capabilities), an explicit empty capset, parent-death signal (after the uid change, which
//! would clear it), no_new_privs, Landlock, and last the seccomp filter, because it denies
//! several of the calls above. The listener fd is then handed to the parent, which takes it
//! with `pidfd_getfd`, and only after the parent says so does the child exec.

use std::ffi::CString;
use std::os::raw::{c_char, c_int};

use seccompiler::sock_filter;

use crate::stage::{READY, STARTED, Stage};

/// SECBIT_NOROOT: uid 0 gains no capabilities on exec.
pub const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
/// SECBIT_NOROOT_LOCKED.
pub const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
/// SECBIT_NO_CAP_AMBIENT_RAISE: no ambient capability can be raised again.
pub const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
/// SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED.
pub const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;
/// The securebits every executor holds, each set and locked.
pub const EXECUTOR_SECUREBITS: libc::c_ulong = SECBIT_NOROOT
    | SECBIT_NOROOT_LOCKED
    | SECBIT_NO_CAP_AMBIENT_RAISE
    | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;

/// The executor securebits that `bits` (the host's own) lock off, by name: those can never
/// be set in an executor, so every spawn would fail.
pub fn securebits_locked_off(bits: libc::c_ulong) -> Vec<&'static str> {
    [
        (SECBIT_NOROOT, SECBIT_NOROOT_LOCKED, "noroot"),
        (
            SECBIT_NO_CAP_AMBIENT_RAISE,
            SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED,
            "no_cap_ambient_raise",
        ),
    ]
    .into_iter()
    .filter(|(bit, lock, _)| bits & lock != 0 && bits & bit == 0)
    .map(|(_, _, name)| name)
    .collect()
}

/// First descriptor number used to park the child's plumbing out of the way of the
/// descriptors it must place at fixed numbers.
const PARK_FD: c_int = 512;

/// Everything the child needs, prepared (and allocated) by the parent before `clone`.
pub struct ChildPlan {
    /// Absolute path of the program.
    pub path: CString,
    /// NULL-terminated argv pointers (into strings the parent keeps alive across clone).
    pub argv: Vec<*const c_char>,
    /// NULL-terminated envp pointers (into strings the parent keeps alive across clone).
    pub envp: Vec<*const c_char>,
    /// Working directory.
    pub cwd: CString,
    /// Descriptors to become 0, 1 and 2.
    pub stdio: [c_int; 3],
    /// Which of 0, 1 and 2 (once placed) is a terminal to make the controlling terminal of
    /// the new session.
    pub controlling_terminal: Option<c_int>,
    /// (source, target) descriptors to keep open across exec at fixed numbers.
    pub extra_fds: Vec<(c_int, c_int)>,
    /// Write end of the status pipe.
    pub status_w: c_int,
    /// Read end of the go pipe.
    pub go_r: c_int,
    /// Whether the child is in a new user namespace (unprivileged host).
    pub user_namespace: bool,
    /// Whether the child is in a new mount namespace.
    pub mount_namespace: bool,
    /// Mount a fresh /proc (new pid namespace).
    pub mount_proc: bool,
    /// Mount a private tmpfs on /tmp with these options.
    pub tmpfs_options: Option<CString>,
    /// (host file, target) pairs bound read-only over files of the executor's view, before
    /// /tmp is replaced (a host file under /tmp stays reachable).
    pub bind_files: Vec<(CString, CString)>,
    /// Make the whole view read-only, then the executor's write paths writable again: an
    /// executor running as its caller's uid (unprivileged host) must not change files it
    /// may not write that the caller owns (their modes, times, extended attributes), which
    /// Landlock does not govern. `None`: the view stays as the host's.
    pub read_only_view: Option<ReadOnlyView>,
    /// Hostname to set in a new UTS namespace.
    pub hostname: Option<CString>,
    /// uid/gid to switch to (root host only).
    pub identity: Option<(libc::uid_t, libc::gid_t)>,
    /// (resource, limit) pairs.
    pub rlimits: Vec<(c_int, libc::rlimit)>,
    /// A Landlock ruleset to restrict to.
    pub landlock_fd: Option<c_int>,
    /// (path, access) rules for paths the child mounts afresh (/proc, a private /tmp): a
    /// rule made by the parent would name the host's inode, not the new mount's.
    pub landlock_late: Vec<(CString, u64)>,
    /// The seccomp program (the profile's, shared by all its spawns).
    pub filter: std::sync::Arc<Vec<sock_filter>>,
    /// Signals to start ignoring, bit `n - 1` for signal `n`; all others start at default.
    pub ignored_signals: u64,
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn report(fd: c_int, tag: u32, value: i32) {
    let mut msg = [0u8; 8];
    msg[..4].copy_from_slice(&tag.to_le_bytes());
    msg[4..].copy_from_slice(&value.to_le_bytes());
    // SAFETY: writing 8 bytes from a stack buffer to a pipe we own.
    unsafe { libc::write(fd, msg.as_ptr().cast(), msg.len()) };
}

fn fail(plan: &ChildPlan, stage: Stage, err: i32) -> ! {
    report(plan.status_w, stage as u32, err);
    // SAFETY: terminates the child immediately without running any host-side destructors.
    unsafe { libc::_exit(126) }
}

fn wait_go(plan: &ChildPlan, stage: Stage) {
    let mut byte = 0u8;
    loop {
        // SAFETY: reads one byte into a stack variable.
        let n = unsafe { libc::read(plan.go_r, (&mut byte as *mut u8).cast(), 1) };
        if n == 1 && byte == 1 {
            return;
        }
        if n == 1 {
            // The host said stop.
            fail(plan, stage, libc::ECANCELED);
        }
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        // EOF: the host went away before letting us run; never run unsupervised.
        fail(plan, stage, if n == 0 { libc::EPIPE } else { errno() });
    }
}

macro_rules! check {
    ($plan:expr, $stage:expr, $call:expr) => {
        if $call < 0 {
            fail($plan, $stage, errno());
        }
    };
}

/// Sets every signal to its default disposition, whether the host catches it or ignores
/// it, except those in `ignored` (bit `n - 1` for signal `n`), which it ignores: the
/// command starts as a process started from a shell does. The child shares the
/// host's memory until exec (CLONE_VM), so a host handler must never run in it; and an
/// ignored disposition survives exec, so the host's ignored SIGPIPE (every Rust program
/// ignores it) would otherwise turn a write into a closed pipe into EPIPE. The raw system
/// call is used because glibc refuses to touch the signals it reserves for its threads
/// (32 and 33), which the host may hold ignored too. Signals stay blocked (the spawner
/// blocked them) until the mask is restored right before exec.
fn reset_signal_handlers(ignored: u64) {
    /// The kernel's `struct sigaction` on x86_64 (`rt_sigaction`'s layout, not glibc's).
    #[repr(C)]
    struct KernelSigaction {
        handler: libc::sighandler_t,
        flags: libc::c_ulong,
        restorer: libc::sighandler_t,
        mask: u64,
    }
    let default = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    let ignore = KernelSigaction {
        handler: libc::SIG_IGN,
        ..default
    };
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        let action = if ignored & (1u64 << (sig - 1)) != 0 {
            &ignore
        } else {
            &default
        };
        // SAFETY: sets one signal's disposition in this child's own handler table (the clone
        // did not share it); `action` points to this stack, the old action is not asked for,
        // and the size is that of the kernel's 64-signal mask.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig as libc::c_long,
                action as *const KernelSigaction,
                std::ptr::null_mut::<KernelSigaction>(),
                std::mem::size_of::<u64>() as libc::c_long,
            );
        }
    }
}

/// The status and go pipes after they were moved out of the way.
struct ParkedPlan {
    status: c_int,
    go: c_int,
    landlock: Option<c_int>,
}

fn fail_parked(p: &ParkedPlan, stage: Stage, err: i32) -> ! {
    report(p.status, stage as u32, err);
    // SAFETY: terminates the child immediately.
    unsafe { libc::_exit(126) }
}

macro_rules! check_parked {
    ($p:expr, $stage:expr, $call:expr) => {
        if $call < 0 {
            fail_parked($p, $stage, errno());
        }
    };
}

/// Runs in the child right after `clone`; never returns.
///
/// # Safety
/// Must only be called in a freshly cloned child whose `plan` pointers are valid (they are:
/// the child's memory is a copy of the parent's at clone time).
pub unsafe fn child_main(plan: &ChildPlan) -> ! {
    reset_signal_handlers(plan.ignored_signals);
    if plan.user_namespace {
        report(plan.status_w, STARTED, 0);
        wait_go(plan, Stage::UserNamespace);
    }
    setup_namespaces(plan);
    let parked = arrange_descriptors(plan);
    continue_after_descriptors(plan, parked)
}

fn setup_namespaces(plan: &ChildPlan) {
    if plan.mount_namespace {
        // SAFETY: (this and the following raw calls) each passes NUL-terminated strings owned
        // by the plan or static literals, and plain integers.
        unsafe {
            check!(
                plan,
                Stage::Mounts,
                libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null()
                )
            );
        }
        if let Some(writable) = &plan.read_only_view {
            read_only_view(plan, writable);
        }
        // SAFETY: as above.
        unsafe {
            for (source, target) in &plan.bind_files {
                check!(
                    plan,
                    Stage::Mounts,
                    libc::mount(
                        source.as_ptr(),
                        target.as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND,
                        std::ptr::null()
                    )
                );
                check!(
                    plan,
                    Stage::Mounts,
                    libc::mount(
                        std::ptr::null(),
                        target.as_ptr(),
                        std::ptr::null(),
                        libc::MS_REMOUNT
                            | libc::MS_BIND
                            | libc::MS_RDONLY
                            | libc::MS_NOSUID
                            | libc::MS_NODEV
                            | libc::MS_NOEXEC,
                        std::ptr::null()
                    )
                );
            }
            if plan.mount_proc {
                check!(
                    plan,
                    Stage::Mounts,
                    libc::mount(
                        c"proc".as_ptr(),
                        c"/proc".as_ptr(),
                        c"proc".as_ptr(),
                        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                        std::ptr::null()
                    )
                );
            }
            if let Some(opts) = &plan.tmpfs_options {
                check!(
                    plan,
                    Stage::Mounts,
                    libc::mount(
                        c"tmpfs".as_ptr(),
                        c"/tmp".as_ptr(),
                        c"tmpfs".as_ptr(),
                        libc::MS_NOSUID | libc::MS_NODEV,
                        opts.as_ptr().cast()
                    )
                );
            }
        }
    }
    if let Some(name) = &plan.hostname {
        // Cosmetic: the executor has its own UTS namespace either way. A host whose own
        // seccomp filter forbids sethostname (systemd's ProtectHostname=) keeps its name.
        // SAFETY: NUL-terminated string owned by the plan, with its length.
        unsafe { libc::sethostname(name.as_ptr(), name.as_bytes().len()) };
    }
}

/// `struct mount_attr` of `mount_setattr(2)` (not in the libc crate).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `MOUNT_ATTR_RDONLY`.
const MOUNT_ATTR_RDONLY: u64 = 0x1;

/// `mount_setattr(2)` of `path` (with `flags`), setting then clearing the given attributes.
fn mount_setattr(path: &std::ffi::CStr, flags: c_int, set: u64, clear: u64) -> libc::c_long {
    let attr = MountAttr {
        attr_set: set,
        attr_clr: clear,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: a NUL-terminated path and a `mount_attr` we own, with its size.
    unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    }
}

/// What [`ChildPlan::read_only_view`] makes writable again, worked out by the parent from
/// the host's mount table (the child copies the parent's mounts).
#[derive(Debug, Clone, Default)]
pub struct ReadOnlyView {
    /// Each write path (its real path), bound over itself with the mounts beneath it.
    pub binds: Vec<CString>,
    /// The mounts of those binds the host has writable (a write path's own, and each one
    /// beneath it), made writable again one by one: one the host has read-only stays so
    /// (its read-only flag is locked in the executor's user namespace).
    pub writable: Vec<CString>,
}

/// Every mount of the view read-only (one call, recursive), then each write path bound over
/// itself (with what is mounted beneath it) and the mounts the host has writable made
/// writable again; only the read-only flag is cleared, so flags the host locked on a mount
/// (nosuid, nodev) stay. A kernel without `mount_setattr` (before 5.12) refuses the spawn
/// rather than leave the view writable.
fn read_only_view(plan: &ChildPlan, view: &ReadOnlyView) {
    check!(
        plan,
        Stage::Mounts,
        mount_setattr(c"/", libc::AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)
    );
    for path in &view.binds {
        // SAFETY: NUL-terminated paths owned by the plan.
        check!(plan, Stage::Mounts, unsafe {
            libc::mount(
                path.as_ptr(),
                path.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            )
        });
    }
    for path in &view.writable {
        check!(
            plan,
            Stage::Mounts,
            mount_setattr(path, 0, 0, MOUNT_ATTR_RDONLY)
        );
    }
}

/// Parks the child's plumbing above [`PARK_FD`], places stdio and the explicit descriptors
/// at their numbers, and closes every other descriptor inherited from the host. Closing (not
/// merely marking close-on-exec) matters: the host may hold thousands of descriptors, and the
/// child must be able to open the few it needs before exec under its own RLIMIT_NOFILE.
fn arrange_descriptors(plan: &ChildPlan) -> ParkedPlan {
    // SAFETY: fcntl/dup2/close_range on descriptor numbers; no memory is passed.
    let park = |fd: c_int| -> c_int { unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, PARK_FD) } };
    let status = park(plan.status_w);
    if status < 0 {
        fail(plan, Stage::Descriptors, errno());
    }
    let mut p = ParkedPlan {
        status,
        go: park(plan.go_r),
        landlock: None,
    };
    if let Some(fd) = plan.landlock_fd {
        let parked = park(fd);
        if parked < 0 {
            fail_parked(&p, Stage::Descriptors, errno());
        }
        p.landlock = Some(parked);
    }
    let stdio = [
        park(plan.stdio[0]),
        park(plan.stdio[1]),
        park(plan.stdio[2]),
    ];
    let mut extra = [0 as c_int; MAX_EXTRA_FDS];
    if p.go < 0 || stdio.iter().any(|fd| *fd < 0) || plan.extra_fds.len() > MAX_EXTRA_FDS {
        fail_parked(&p, Stage::Descriptors, errno());
    }
    for (i, (src, _)) in plan.extra_fds.iter().enumerate() {
        extra[i] = park(*src);
        if extra[i] < 0 {
            fail_parked(&p, Stage::Descriptors, errno());
        }
    }
    // SAFETY: dup2/close_range on descriptor numbers only.
    unsafe {
        for (target, fd) in stdio.iter().enumerate() {
            check_parked!(&p, Stage::Descriptors, libc::dup2(*fd, target as c_int));
        }
        // dup2 leaves the targets without close-on-exec, so they survive exec.
        for (i, (_, target)) in plan.extra_fds.iter().enumerate() {
            check_parked!(&p, Stage::Descriptors, libc::dup2(extra[i], *target));
        }
    }
    // Keep: the explicit targets and the parked status/go/ruleset descriptors. Close every
    // other descriptor from 3 up, in the gaps between the kept ones (sorted on the stack).
    let mut keep = [c_int::MAX; MAX_EXTRA_FDS + 3];
    let mut n = 0;
    for fd in [Some(p.status), Some(p.go), p.landlock]
        .into_iter()
        .flatten()
    {
        keep[n] = fd;
        n += 1;
    }
    for (_, target) in &plan.extra_fds {
        keep[n] = *target;
        n += 1;
    }
    let keep = &mut keep[..n];
    keep.sort_unstable();
    let mut next: c_int = 3;
    for &fd in keep.iter() {
        if fd > next {
            // SAFETY: closes a range of descriptor numbers nobody else in the child uses.
            check_parked!(&p, Stage::Descriptors, unsafe {
                libc::syscall(libc::SYS_close_range, next as u32, (fd - 1) as u32, 0u32)
            });
        }
        next = next.max(fd + 1);
    }
    // SAFETY: as above, for everything above the last kept descriptor.
    check_parked!(&p, Stage::Descriptors, unsafe {
        libc::syscall(libc::SYS_close_range, next as u32, u32::MAX, 0u32)
    });
    p
}

/// Most descriptors a spawn may place at fixed numbers besides stdio.
pub const MAX_EXTRA_FDS: usize = 64;

fn continue_after_descriptors(plan: &ChildPlan, p: ParkedPlan) -> ! {
    // SAFETY: (whole function) raw syscalls with integers, NUL-terminated strings owned by
    // the plan, stack-allocated structs, and the program buffer owned by the plan.
    unsafe {
        // A session of its own: the executor loses the host's controlling terminal, so it can
        // neither push input into it (TIOCSTI needs the tty to be the caller's controlling
        // terminal) nor receive or send the terminal's job-control signals.
        check_parked!(&p, Stage::Session, libc::setsid());
        // A terminal of its own (a pseudo-terminal the host relays) becomes its controlling
        // terminal: job control and the terminal's signals apply to it as to any process
        // started from a shell. Before the filter, which refuses TIOCSCTTY.
        if let Some(fd) = plan.controlling_terminal {
            check_parked!(
                &p,
                Stage::Terminal,
                libc::ioctl(fd, libc::TIOCSCTTY, 0 as libc::c_ulong)
            );
        }
        check_parked!(&p, Stage::WorkingDirectory, libc::chdir(plan.cwd.as_ptr()));
        for (resource, limit) in &plan.rlimits {
            check_parked!(
                &p,
                Stage::Limits,
                libc::syscall(
                    libc::SYS_prlimit64,
                    0,
                    *resource,
                    limit as *const libc::rlimit,
                    std::ptr::null_mut::<libc::rlimit>()
                )
            );
        }

        // Empty the bounding set so no later exec can regain a capability and clear ambient
        // capabilities. Capability numbers past the kernel's last one return EINVAL and are
        // skipped.
        for cap in 0..64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno() != libc::EINVAL {
                fail_parked(&p, Stage::CapabilityBounds, errno());
            }
        }
        check_parked!(
            &p,
            Stage::CapabilityBounds,
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
                0,
                0,
                0
            )
        );
        // Set and lock noroot and no_cap_ambient_raise, so uid 0 (in a user namespace) gains
        // nothing on exec and no ambient capability comes back. Securebits the host already
        // holds (and may have locked, e.g. systemd's SecureBits=) are kept; only missing ones
        // are added. Setting a bit that is already
        // set and locked would still succeed, but skipping the call when nothing is missing
        // also spares a host that lacks CAP_SETPCAP for no reason.
        let current = libc::prctl(libc::PR_GET_SECUREBITS, 0, 0, 0, 0);
        if current < 0 {
            fail_parked(&p, Stage::Securebits, errno());
        }
        let current = current as libc::c_ulong;
        if current & EXECUTOR_SECUREBITS != EXECUTOR_SECUREBITS {
            check_parked!(
                &p,
                Stage::Securebits,
                libc::prctl(
                    libc::PR_SET_SECUREBITS,
                    current | EXECUTOR_SECUREBITS,
                    0,
                    0,
                    0
                )
            );
        }

        if let Some((uid, gid)) = plan.identity {
            check_parked!(
                &p,
                Stage::Identity,
                libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>())
            );
            check_parked!(
                &p,
                Stage::Identity,
                libc::syscall(libc::SYS_setresgid, gid, gid, gid)
            );
            check_parked!(
                &p,
                Stage::Identity,
                libc::syscall(libc::SYS_setresuid, uid, uid, uid)
            );
        }

        // Whatever the uid change left (nothing, normally; everything, in a user namespace).
        use crate::sys::{CapData, CapHeader, LINUX_CAPABILITY_VERSION_3};
        let header = CapHeader {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let data = [CapData {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        }; 2];
        check_parked!(
            &p,
            Stage::Capabilities,
            libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr())
        );

        // After the uid change: changing credentials clears the parent-death signal.
        check_parked!(
            &p,
            Stage::Prctl,
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0
            )
        );
        check_parked!(
            &p,
            Stage::Prctl,
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0)
        );

        if let Some(fd) = p.landlock {
            #[repr(C, packed)]
            struct PathBeneath {
                allowed_access: u64,
                parent_fd: i32,
            }
            const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;
            for (path, access) in &plan.landlock_late {
                let dir = libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
                if dir < 0 {
                    if errno() == libc::ENOENT {
                        continue;
                    }
                    fail_parked(&p, Stage::Landlock, errno());
                }
                let rule = PathBeneath {
                    allowed_access: *access,
                    parent_fd: dir,
                };
                check_parked!(
                    &p,
                    Stage::Landlock,
                    libc::syscall(
                        libc::SYS_landlock_add_rule,
                        fd,
                        LANDLOCK_RULE_PATH_BENEATH,
                        &rule as *const PathBeneath,
                        0u32
                    )
                );
                libc::close(dir);
            }
            check_parked!(
                &p,
                Stage::Landlock,
                libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32)
            );
            libc::close(fd);
        }

        let prog = libc::sock_fprog {
            len: plan.filter.len() as u16,
            filter: plan.filter.as_ptr() as *mut libc::sock_filter,
        };
        let mut listener = libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER | libc::SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV,
            &prog as *const libc::sock_fprog,
        );
        if listener < 0 && errno() == libc::EINVAL {
            // Kernels before 5.19 lack WAIT_KILLABLE_RECV; mediation is the same without it,
            // only a non-fatal signal may interrupt a pending call.
            listener = libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
                &prog as *const libc::sock_fprog,
            );
        }
        if listener < 0 {
            fail_parked(&p, Stage::Seccomp, errno());
        }

        report(p.status, READY, listener as i32);
        let mut byte = 0u8;
        loop {
            let n = libc::read(p.go, (&mut byte as *mut u8).cast(), 1);
            if n == 1 && byte == 1 {
                break;
            }
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            // The host did not take the listener (a stop byte, or it went away): never exec
            // unsupervised.
            libc::_exit(126);
        }
        libc::close(listener as c_int);
        libc::close(p.go);

        // The executor starts with no signal blocked (the spawner blocked them all).
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::execve(plan.path.as_ptr(), plan.argv.as_ptr(), plan.envp.as_ptr());
        report(p.status, Stage::Exec as u32, errno());
        libc::_exit(127)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn securebits_locked_off_names_only_bits_locked_in_the_off_state() {
        // systemd's SecureBits=noroot-locked alone.
        assert_eq!(securebits_locked_off(SECBIT_NOROOT_LOCKED), vec!["noroot"]);
        // SecureBits=noroot noroot-locked, nothing set, and what executors get: all fine.
        assert!(securebits_locked_off(SECBIT_NOROOT | SECBIT_NOROOT_LOCKED).is_empty());
        assert!(securebits_locked_off(0).is_empty());
        assert!(securebits_locked_off(EXECUTOR_SECUREBITS).is_empty());
        assert_eq!(
            securebits_locked_off(SECBIT_NOROOT_LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED),
            vec!["noroot", "no_cap_ambient_raise"]
        );
    }
}
