//! The syscall boundary: thin, checked wrappers over the Linux primitives the broker uses
//! that neither `std` nor `nix` expose (pidfds, seccomp user notification, cross-process
//! memory access, Landlock self-restriction). Every `unsafe` block of the host side lives here.

use std::ffi::CStr;
use std::io;
use std::mem::{MaybeUninit, size_of};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// `PIDFD_THREAD` (Linux 6.9): a pidfd that refers to one thread rather than its process.
const PIDFD_THREAD: libc::c_uint = libc::O_EXCL as libc::c_uint;

fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Opens a pidfd for `pid` (a process) with `pidfd_open(2)`.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes two integers and returns a new fd or -1; no memory is shared.
    let fd = check(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0 as libc::c_uint) })?;
    // SAFETY: the kernel just returned this fd to us; we are its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Opens a pidfd for the thread `tid`, falling back to its thread group on kernels without
/// `PIDFD_THREAD` (the fd table is the same unless the thread was created without
/// `CLONE_FILES`).
pub fn pidfd_open_thread(tid: libc::pid_t) -> io::Result<OwnedFd> {
    match pidfd_open_tid(tid) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => pidfd_open(thread_group_of(tid)?),
        other => other,
    }
}

/// Opens a pidfd naming the thread `tid` itself (`PIDFD_THREAD`, Linux 6.9): it names that
/// one task, so once the task has exited it fails every use with ESRCH, even after `tid`
/// names another task. Fails with EINVAL on older kernels.
pub fn pidfd_open_tid(tid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: as in `pidfd_open`; PIDFD_THREAD is a plain flag value.
    let ret = check(unsafe { libc::syscall(libc::SYS_pidfd_open, tid, PIDFD_THREAD) })?;
    // SAFETY: fresh fd from the kernel, owned by us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) })
}

/// The thread group (process) id of thread `tid`, read from procfs.
fn thread_group_of(tid: libc::pid_t) -> io::Result<libc::pid_t> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no Tgid in /proc status"))
}

/// Duplicates file descriptor `fd` of the process behind `pidfd` into this process
/// (`pidfd_getfd(2)`); the new fd shares the open file description and is close-on-exec.
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: integer arguments only; the result is a new fd or -1.
    let ret = check(unsafe {
        libc::syscall(
            libc::SYS_pidfd_getfd,
            pidfd.as_raw_fd(),
            fd,
            0 as libc::c_uint,
        )
    })?;
    // SAFETY: fresh fd from the kernel, owned by us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) })
}

/// Kills this process's child `pid` and reaps it, waiting for it to exit. Only for a child
/// nothing else reaps (so its pid cannot have been reused) and whose pidfd is gone.
pub fn kill_and_reap(pid: i32) {
    let pid = nix::unistd::Pid::from_raw(pid);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    while let Err(nix::errno::Errno::EINTR) = nix::sys::wait::waitpid(pid, None) {}
}

/// Sends `signal` to the process behind `pidfd` (`pidfd_send_signal(2)`). Signalling a
/// process that has exited but not been reaped succeeds (ESRCH is reported as success).
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: integer arguments and a null siginfo pointer, which the kernel accepts.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0 as libc::c_uint,
        )
    };
    if ret < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ESRCH) {
            return Ok(());
        }
        return Err(err);
    }
    Ok(())
}

/// How a reaped child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStatus {
    /// Exited with this code.
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
}

/// Reaps the child behind `pidfd` with `waitid(P_PIDFD)`. With `block == false` returns
/// `Ok(None)` when the child is still running.
pub fn waitid_pidfd(pidfd: BorrowedFd<'_>, block: bool) -> io::Result<Option<WaitStatus>> {
    Ok(waitid_pidfd_cpu(pidfd, block)?.map(|(status, _)| status))
}

/// [`waitid_pidfd`], with the CPU time (user and system) the child used, its reaped
/// descendants included.
pub fn waitid_pidfd_cpu(
    pidfd: BorrowedFd<'_>,
    block: bool,
) -> io::Result<Option<(WaitStatus, std::time::Duration)>> {
    let mut info = MaybeUninit::<libc::siginfo_t>::zeroed();
    let mut usage = MaybeUninit::<libc::rusage>::zeroed();
    let flags = libc::WEXITED | if block { 0 } else { libc::WNOHANG };
    loop {
        // SAFETY: `info` and `usage` are valid, zeroed structures the kernel fills in; the
        // raw syscall (glibc's wrapper has no rusage argument) takes exactly these five.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_waitid,
                libc::P_PIDFD,
                pidfd.as_raw_fd() as libc::id_t,
                info.as_mut_ptr(),
                flags,
                usage.as_mut_ptr(),
            )
        };
        if ret < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        break;
    }
    // SAFETY: waitid returned 0, so `info` is initialised (zeroed when WNOHANG found nothing).
    let info = unsafe { info.assume_init() };
    // SAFETY: reading the pid/status union members of a siginfo filled by waitid.
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if pid == 0 {
        return Ok(None);
    }
    // SAFETY: waitid returned 0, so `usage` is initialised (zeroed, or filled for the child).
    let usage = unsafe { usage.assume_init() };
    let time = |t: libc::timeval| {
        std::time::Duration::from_secs(t.tv_sec.max(0) as u64)
            + std::time::Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    let cpu = time(usage.ru_utime) + time(usage.ru_stime);
    let status = match info.si_code {
        libc::CLD_EXITED => WaitStatus::Exited(status),
        _ => WaitStatus::Signaled(status),
    };
    Ok(Some((status, cpu)))
}

/// Copies `buf.len()` bytes from address `addr` of process `pid` (`process_vm_readv(2)`).
/// A short read is an error: the broker decides only on complete copies.
pub fn read_remote(pid: libc::pid_t, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    read_remote_many(pid, &mut [(addr, buf)])
}

/// Copies each `(address, buffer)` part from process `pid` in one `process_vm_readv(2)`
/// call. A short read of any part is an error: the broker decides only on complete copies.
pub fn read_remote_many(pid: libc::pid_t, parts: &mut [(u64, &mut [u8])]) -> io::Result<()> {
    let parts: Vec<&mut (u64, &mut [u8])> =
        parts.iter_mut().filter(|(_, b)| !b.is_empty()).collect();
    if parts.is_empty() {
        return Ok(());
    }
    let mut local = Vec::with_capacity(parts.len());
    let mut remote = Vec::with_capacity(parts.len());
    let mut total = 0usize;
    for (addr, buf) in parts {
        local.push(libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        });
        remote.push(libc::iovec {
            iov_base: *addr as *mut libc::c_void,
            iov_len: buf.len(),
        });
        total += buf.len();
    }
    // SAFETY: each `local` iovec describes a buffer we borrow mutably for its full length,
    // alive for the call; the remote iovecs are only interpreted by the kernel inside the
    // target's address space.
    let n = unsafe {
        libc::process_vm_readv(
            pid,
            local.as_ptr(),
            local.len() as libc::c_ulong,
            remote.as_ptr(),
            remote.len() as libc::c_ulong,
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != total {
        return Err(io::Error::from_raw_os_error(libc::EFAULT));
    }
    Ok(())
}

/// One pending seccomp user notification.
#[derive(Debug, Clone, Copy)]
pub struct Notification {
    /// The kernel's cookie for this notification.
    pub id: u64,
    /// Thread id of the caller, in the broker's pid namespace.
    pub pid: libc::pid_t,
    /// Syscall number.
    pub nr: i32,
    /// AUDIT_ARCH value of the call.
    pub arch: u32,
    /// The six raw syscall arguments (registers: not subject to TOCTOU).
    pub args: [u64; 6],
}

/// Receives one notification from a seccomp listener (`SECCOMP_IOCTL_NOTIF_RECV`). The
/// listener should be readable; `ENOENT` means the caller went away before we received it.
pub fn notif_recv(listener: BorrowedFd<'_>) -> io::Result<Notification> {
    // The kernel refuses a receive buffer that is not zeroed.
    let mut n = MaybeUninit::<libc::seccomp_notif>::zeroed();
    // SAFETY: the ioctl writes a seccomp_notif into the zeroed buffer we pass.
    let ret = unsafe {
        libc::ioctl(
            listener.as_raw_fd(),
            libc::SECCOMP_IOCTL_NOTIF_RECV as _,
            n.as_mut_ptr(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the ioctl succeeded and filled the struct.
    let n = unsafe { n.assume_init() };
    Ok(Notification {
        id: n.id,
        pid: n.pid as libc::pid_t,
        nr: n.data.nr,
        arch: n.data.arch,
        args: n.data.args,
    })
}

/// Answers a notification with a return value (`error == 0`) or a negated errno. Never sets
/// `SECCOMP_USER_NOTIF_FLAG_CONTINUE`: the broker performs the operation itself.
pub fn notif_send(listener: BorrowedFd<'_>, id: u64, val: i64, error: i32) -> io::Result<()> {
    let resp = libc::seccomp_notif_resp {
        id,
        val,
        error,
        flags: 0,
    };
    retry_interrupted(|| {
        // SAFETY: the ioctl reads the response struct we own.
        unsafe {
            libc::ioctl(
                listener.as_raw_fd(),
                libc::SECCOMP_IOCTL_NOTIF_SEND as _,
                &resp as *const libc::seccomp_notif_resp,
            )
        }
    })
    .map(|_| ())
}

/// Runs a seccomp ioctl until no signal interrupts it. The kernel takes the listener's lock
/// interruptibly, so a signal that arrives while another thread holds it fails the call
/// with EINTR: read as "the caller is gone" or "cannot answer", that would leave a waiting
/// thread unanswered for good.
fn retry_interrupted(mut call: impl FnMut() -> libc::c_int) -> io::Result<libc::c_int> {
    loop {
        let ret = call();
        if ret >= 0 {
            return Ok(ret);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Whether the notification `id` is still pending (its caller is still waiting on it). Checked
/// after every read of the caller's memory so a recycled pid cannot fool the broker.
pub fn notif_id_valid(listener: BorrowedFd<'_>, id: u64) -> bool {
    retry_interrupted(|| {
        // SAFETY: the ioctl reads the u64 we own.
        unsafe {
            libc::ioctl(
                listener.as_raw_fd(),
                libc::SECCOMP_IOCTL_NOTIF_ID_VALID as _,
                &id as *const u64,
            )
        }
    })
    .is_ok()
}

/// This thread's securebits (`PR_GET_SECUREBITS`).
pub fn securebits() -> io::Result<libc::c_ulong> {
    // SAFETY: PR_GET_SECUREBITS takes no pointers and only returns a number.
    let ret = unsafe { libc::prctl(libc::PR_GET_SECUREBITS, 0, 0, 0, 0) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ret as libc::c_ulong)
}

/// Why Landlock is unavailable to this process, as observed from
/// `landlock_create_ruleset` (`None` when it is available). Distinguishes a kernel without
/// Landlock from one that has it disabled and from a seccomp filter refusing the call, so
/// the message never blames the kernel for what a filter did.
pub fn landlock_unavailable() -> Option<String> {
    if landlock_abi() > 0 {
        return None;
    }
    let err = io::Error::last_os_error();
    Some(match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) => "landlock_create_ruleset returned EOPNOTSUPP: the kernel has Landlock but it is disabled (add landlock to the lsm= boot parameter)".to_string(),
        Some(libc::ENOSYS) => "landlock_create_ruleset returned ENOSYS: the kernel lacks Landlock (Linux 5.13 or later with CONFIG_SECURITY_LANDLOCK), or a seccomp filter hides the call".to_string(),
        Some(e) => format!(
            "landlock_create_ruleset was refused with {}: a seccomp filter this process runs under denies it (systemd-nspawn's default filter, SystemCallFilter=, a container runtime); allow landlock_create_ruleset, landlock_add_rule and landlock_restrict_self",
            errno_name(e)
        ),
        None => format!("landlock_create_ruleset failed: {err}"),
    })
}

/// What a failed pidfd call (`what`, e.g. "pidfd_getfd") observed: ENOSYS points at the
/// kernel's age, anything else at whatever refused it.
pub fn describe_pidfd_failure(what: &str, since: &str, err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::ENOSYS) => format!(
            "{what} returned ENOSYS: the kernel lacks it (Linux {since} or later is required), or a seccomp filter hides it"
        ),
        Some(e @ (libc::EPERM | libc::EACCES)) => format!(
            "{what} was refused with {}: the kernel has it, but a seccomp filter this process runs under (systemd-nspawn's default filter, SystemCallFilter=, a container runtime) or the ptrace access check denies it; allow {what} and grant CAP_SYS_PTRACE",
            errno_name(e)
        ),
        _ => format!("{what} failed: {err}"),
    }
}

/// The Landlock ABI version the kernel offers (0 when Landlock is unavailable).
pub fn landlock_abi() -> i32 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute and the VERSION flag the call only returns a number.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if ret < 0 { 0 } else { ret as i32 }
}

/// Sets an `int` socket option on `fd`.
pub fn setsockopt_int(fd: BorrowedFd<'_>, level: i32, name: i32, value: i32) -> io::Result<()> {
    let value: libc::c_int = value;
    // SAFETY: the value points at a c_int and the length is its size; the kernel only reads it.
    let ret = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads an `int` socket option from `fd`.
pub fn getsockopt_int(fd: BorrowedFd<'_>, level: i32, name: i32) -> io::Result<i32> {
    getsockopt_plain(fd, level, name, 0 as libc::c_int)
}

/// `getsockopt(2)` of an option whose value is plain data of type `T` (an integer, a
/// `timeval`), starting from `value`.
fn getsockopt_plain<T: Copy>(
    fd: BorrowedFd<'_>,
    level: i32,
    name: i32,
    mut value: T,
) -> io::Result<T> {
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: value/len point at a T and its size; T is plain data the kernel may fill.
    let ret = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&mut value as *mut T).cast(),
            &mut len,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(value)
}

/// The socket's send timeout (`SO_SNDTIMEO`), `None` when it has none (blocks forever).
pub fn send_timeout(fd: BorrowedFd<'_>) -> io::Result<Option<std::time::Duration>> {
    let zero = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let tv = getsockopt_plain(fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, zero)?;
    let micros = (tv.tv_sec.max(0) as u64)
        .saturating_mul(1_000_000)
        .saturating_add(tv.tv_usec.max(0) as u64);
    Ok((micros > 0).then(|| std::time::Duration::from_micros(micros)))
}

/// The socket's cookie (`SO_COOKIE`): a 64-bit id the kernel never reuses, unlike inode
/// numbers.
pub fn socket_cookie(fd: BorrowedFd<'_>) -> io::Result<u64> {
    /// `SO_COOKIE` (asm-generic), not exported by the libc crate.
    const SO_COOKIE: libc::c_int = 57;
    getsockopt_plain(fd, libc::SOL_SOCKET, SO_COOKIE, 0u64)
}

/// Performs `connect(2)` on `fd` with a raw socket address copied from the executor.
pub fn connect_raw(fd: BorrowedFd<'_>, addr: &[u8]) -> io::Result<()> {
    with_address(fd, addr, libc::connect)
}

/// Performs `bind(2)` on `fd` with a raw socket address copied from the executor.
pub fn bind_raw(fd: BorrowedFd<'_>, addr: &[u8]) -> io::Result<()> {
    with_address(fd, addr, libc::bind)
}

type AddressCall =
    unsafe extern "C" fn(libc::c_int, *const libc::sockaddr, libc::socklen_t) -> libc::c_int;

fn with_address(fd: BorrowedFd<'_>, addr: &[u8], call: AddressCall) -> io::Result<()> {
    // SAFETY: `call` is connect(2) or bind(2); `addr` is a buffer we own, its length passed
    // alongside, and the kernel only reads it.
    let ret = unsafe {
        call(
            fd.as_raw_fd(),
            addr.as_ptr().cast(),
            addr.len() as libc::socklen_t,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A message the broker sends on an executor's behalf: copies of everything the executor
/// pointed at, so nothing can change after the decision.
#[derive(Debug, Default, Clone)]
pub struct OwnedMessage {
    /// Destination address bytes (empty for a connected send).
    pub name: Vec<u8>,
    /// Payload, already gathered from the executor's iovecs.
    pub data: Vec<u8>,
    /// Control messages, with any passed descriptors already translated into ours.
    pub control: Vec<u8>,
}

/// Performs `sendmsg(2)` on `fd` with a message the broker owns entirely.
pub fn sendmsg_owned(fd: BorrowedFd<'_>, msg: &OwnedMessage, flags: i32) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: msg.data.as_ptr() as *mut libc::c_void,
        iov_len: msg.data.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty message; we fill the fields below.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    if !msg.name.is_empty() {
        hdr.msg_name = msg.name.as_ptr() as *mut libc::c_void;
        hdr.msg_namelen = msg.name.len() as libc::socklen_t;
    }
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    if !msg.control.is_empty() {
        hdr.msg_control = msg.control.as_ptr() as *mut libc::c_void;
        // `size_t` for glibc, `socklen_t` for musl; the control buffer is far below both.
        #[allow(clippy::unnecessary_cast)]
        {
            hdr.msg_controllen = msg.control.len() as _;
        }
    }
    // SAFETY: every pointer in `hdr` refers to buffers owned by `msg` / `iov`, which outlive
    // the call; the kernel does not write through them for sendmsg.
    let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &hdr, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The path an `execve` resolves to for a running process, from `/proc/<pid>/exe`.
pub fn executable_of(pid: libc::pid_t) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/exe")).ok()
}

/// Whether the calling process can install a seccomp filter that returns
/// `SECCOMP_RET_USER_NOTIF` (checked via `/proc/sys/kernel/seccomp/actions_avail`).
pub fn user_notif_available() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/seccomp/actions_avail")
        .map(|s| s.split_whitespace().any(|a| a == "user_notif"))
        .unwrap_or(false)
}

/// Name of an errno value, for messages.
pub fn errno_name(errno: i32) -> String {
    // SAFETY: strerror returns a pointer to a static (or thread-local) NUL-terminated string.
    let text = unsafe { CStr::from_ptr(libc::strerror(errno)) };
    format!("{} (errno {errno})", text.to_string_lossy())
}

/// Opens `path` as an `O_PATH` descriptor relative to `dir` without following any symlink
/// (`openat2` with `RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`, plus `RESOLVE_IN_ROOT` when
/// `in_root`). Used to pin the inode of a unix socket in the executor's filesystem view.
pub fn open_path_nofollow(dir: BorrowedFd<'_>, path: &CStr, in_root: bool) -> io::Result<OwnedFd> {
    let mut resolve = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    if in_root {
        resolve |= libc::RESOLVE_IN_ROOT;
    }
    // SAFETY: an all-zero open_how is valid; the fields are set below.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
    how.resolve = resolve;
    // SAFETY: `path` is NUL-terminated and `how` is a valid open_how of the size passed.
    let ret = check(unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            size_of::<libc::open_how>(),
        )
    })?;
    // SAFETY: fresh fd from the kernel, owned by us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) })
}

/// The peer address of a connected socket (`getpeername(2)`), as raw sockaddr bytes.
pub fn peer_address(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let mut storage = [0u8; 128];
    let mut len = storage.len() as libc::socklen_t;
    // SAFETY: storage/len describe a buffer we own.
    let ret = unsafe { libc::getpeername(fd.as_raw_fd(), storage.as_mut_ptr().cast(), &mut len) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(storage[..(len as usize).min(storage.len())].to_vec())
}

/// The address a socket is bound to (`getsockname(2)`), as raw sockaddr bytes (only the
/// family for an unbound unix socket).
pub fn local_address(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let mut storage = [0u8; 128];
    let mut len = storage.len() as libc::socklen_t;
    // SAFETY: storage/len describe a buffer we own.
    let ret = unsafe { libc::getsockname(fd.as_raw_fd(), storage.as_mut_ptr().cast(), &mut len) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(storage[..(len as usize).min(storage.len())].to_vec())
}

/// The TCP state `TCP_SYN_SENT` (`include/net/tcp_states.h`): a connect's handshake is
/// under way.
pub const TCP_SYN_SENT: u8 = 2;

/// The TCP state `TCP_SYN_RECV`: the handshake's answer came and its last step is pending.
pub const TCP_SYN_RECV: u8 = 3;

/// The TCP state `TCP_CLOSE`: neither connected nor connecting nor listening.
pub const TCP_CLOSE: u8 = 7;

/// The state of a TCP socket (`tcpi_state`, the first byte of `TCP_INFO`); `None` if it
/// cannot be read.
pub fn tcp_state(fd: BorrowedFd<'_>) -> Option<u8> {
    let mut state = 0u8;
    let mut len: libc::socklen_t = 1;
    // SAFETY: the kernel writes at most `len` (1) bytes of `tcp_info` into `state`, which we
    // own, and the new length into `len`.
    let ret = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut state as *mut u8).cast(),
            &mut len,
        )
    };
    (ret == 0 && len == 1).then_some(state)
}

/// `listen(2)` on a socket the broker holds.
pub fn listen_raw(fd: BorrowedFd<'_>, backlog: i32) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor we hold.
    check(unsafe { libc::listen(fd.as_raw_fd(), backlog) } as libc::c_long).map(|_| ())
}

/// Registers an owned descriptor with the tokio reactor for read readiness.
pub fn async_fd(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    register(fd, tokio::io::Interest::READABLE)
}

/// Registers an owned descriptor with the tokio reactor for write readiness.
pub fn async_fd_writable(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    register(fd, tokio::io::Interest::WRITABLE)
}

fn register(
    fd: OwnedFd,
    interest: tokio::io::Interest,
) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd keeps its descriptor open, and always returns the same number, for
    // as long as the AsyncFd owns it.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, interest) }
        .map_err(io::Error::from)
}

/// Waits up to `timeout` for `fd` to become writable (`ppoll`, microsecond precision).
pub fn wait_writable(fd: BorrowedFd<'_>, timeout: std::time::Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one pollfd we own, a timespec on the stack, no signal mask change.
    let r = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINTR) {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(r > 0 && pfd.revents & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0)
}

/// Sets the calling thread's nice value to `nice` (the thread alone: on Linux a thread id
/// names one thread for `setpriority`). Returns the error when not permitted (raising
/// needs `CAP_SYS_NICE` or `RLIMIT_NICE`); callers treat that as "slower", never as a
/// mediation failure.
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority reads three integers; `tid` is this thread's own id.
    let ret = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One thread's credentials as the kernel checks a file access against them and hands them
/// to a unix socket's peer: real and effective uid and gid, supplementary groups, and
/// capabilities. (Saved ids are never changed by [`assume_identity`].)
#[derive(Debug, Clone)]
pub struct ThreadCredentials {
    uid: (libc::uid_t, libc::uid_t),
    gid: (libc::gid_t, libc::gid_t),
    groups: Vec<libc::gid_t>,
    caps: ThreadCaps,
}

/// One word of a thread's capability sets, as `capget(2)`/`capset(2)` take them (version 3:
/// two words, capabilities 0-31 and 32-63).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub(crate) struct CapData {
    pub(crate) effective: u32,
    pub(crate) permitted: u32,
    pub(crate) inheritable: u32,
}

type ThreadCaps = [CapData; 2];

/// The header `capget(2)`/`capset(2)` read: the ABI version and the thread (0: the caller).
#[repr(C)]
pub(crate) struct CapHeader {
    pub(crate) version: u32,
    pub(crate) pid: libc::c_int,
}

pub(crate) const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// The calling thread's capability sets (one syscall; no allocation, unlike a set of names:
/// this is on the path of every unix socket operation a privileged broker carries out).
fn thread_caps() -> io::Result<ThreadCaps> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = ThreadCaps::default();
    // SAFETY: capget reads the header and writes two CapData words, both ours; pid 0 is the
    // calling thread.
    check(unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut CapHeader,
            data.as_mut_ptr(),
        )
    })?;
    Ok(data)
}

/// Sets the calling thread's capability sets to `data`.
fn set_thread_caps(data: &ThreadCaps) -> io::Result<()> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: capset reads the header and two CapData words, both ours; pid 0 is the
    // calling thread, the only one it changes.
    check(unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    })?;
    Ok(())
}

/// The calling thread's credentials, to give back to [`restore_credentials`].
pub fn thread_credentials() -> io::Result<ThreadCredentials> {
    let (mut ruid, mut euid, mut suid) = (0, 0, 0);
    let (mut rgid, mut egid, mut sgid) = (0, 0, 0);
    // SAFETY: getresuid and getresgid write three ids each into the locals passed.
    let ret = unsafe {
        libc::getresuid(&mut ruid, &mut euid, &mut suid)
            | libc::getresgid(&mut rgid, &mut egid, &mut sgid)
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    // Most threads have few groups: one call with room for 32, counted first only if more.
    let mut groups = vec![0 as libc::gid_t; 32];
    // SAFETY: `groups` holds the count passed; getgroups writes at most that many.
    let n = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    let n = if n >= 0 {
        n
    } else {
        // SAFETY: with a size of 0, getgroups only counts the groups.
        let count = check(unsafe { libc::getgroups(0, std::ptr::null_mut()) }.into())?;
        groups.resize(count as usize, 0);
        // SAFETY: as above; EINVAL if the list grew since.
        unsafe { libc::getgroups(count as libc::c_int, groups.as_mut_ptr()) }
    };
    let n = check(n.into())?;
    groups.truncate(n as usize);
    Ok(ThreadCredentials {
        uid: (ruid, euid),
        gid: (rgid, egid),
        groups,
        caps: thread_caps()?,
    })
}

/// Makes the calling thread act as `uid` and `gid` (effective and filesystem ids; the real
/// ones stay its own), with no supplementary group and no effective capability.
/// `own` is what [`thread_credentials`] read of the thread just before. Only this thread
/// changes: the raw syscalls are used, since glibc's wrappers apply an id change to every
/// thread of the process. Saved ids are kept, so [`restore_credentials`] can go back. Needs
/// `CAP_SETUID` and `CAP_SETGID`; on failure the thread may be part-way, and the caller
/// restores it. Each change costs the kernel a new set of credentials, so none is made that
/// would change nothing.
pub fn assume_identity(
    own: &ThreadCredentials,
    uid: libc::uid_t,
    gid: libc::gid_t,
) -> io::Result<()> {
    const KEEP: libc::c_long = -1;
    if !own.groups.is_empty() {
        // SAFETY: setgroups with a count of 0 reads no memory; the raw syscall changes only
        // this thread's groups.
        check(unsafe {
            libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>())
        })?;
    }
    // SAFETY: integer arguments only; the raw syscall changes only this thread's ids.
    check(unsafe { libc::syscall(libc::SYS_setresgid, KEEP, gid, KEEP) })?;
    // SAFETY: as above.
    check(unsafe { libc::syscall(libc::SYS_setresuid, KEEP, uid, KEEP) })?;
    // Leaving uid 0 drops the effective capabilities; a broker that is not root (or runs
    // with securebits that keep them) still holds them: they go explicitly, so nothing
    // overrides file permissions on the executor's behalf.
    let mut caps = thread_caps()?;
    if caps.iter().any(|c| c.effective != 0) {
        for c in &mut caps {
            c.effective = 0;
        }
        set_thread_caps(&caps)?;
    }
    Ok(())
}

/// Gives the calling thread back what [`thread_credentials`] read. The ids come back
/// without any capability (each is one the thread still holds as its saved id), unless
/// the thread's ids were unusual; then its capabilities are restored first. Returning to
/// uid 0 raises the effective set to the permitted one: it is set back to what it was if
/// that differs. The groups come last, with `CAP_SETGID` back.
pub fn restore_credentials(saved: &ThreadCredentials) -> io::Result<()> {
    const KEEP: libc::c_long = -1;
    let ids = || -> io::Result<()> {
        let (ruid, euid) = saved.uid;
        // SAFETY: integer arguments only; the raw syscall changes only this thread's ids.
        check(unsafe { libc::syscall(libc::SYS_setresuid, ruid, euid, KEEP) })?;
        let (rgid, egid) = saved.gid;
        // SAFETY: as above.
        check(unsafe { libc::syscall(libc::SYS_setresgid, rgid, egid, KEEP) })?;
        Ok(())
    };
    if ids().is_err() {
        // The permitted set was never lowered, so the saved sets can be set again.
        set_thread_caps(&saved.caps)?;
        ids()?;
    }
    if thread_caps()? != saved.caps {
        set_thread_caps(&saved.caps)?;
    }
    if !saved.groups.is_empty() {
        // SAFETY: `groups` holds the count passed; the raw syscall changes only this thread.
        check(unsafe {
            libc::syscall(
                libc::SYS_setgroups,
                saved.groups.len(),
                saved.groups.as_ptr(),
            )
        })?;
    }
    Ok(())
}

/// Asks the kernel to wake the supervisor and the notifying task synchronously, on the same
/// CPU (`SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP`, Linux 6.6). Returns false on older kernels;
/// mediation is the same either way, only slower.
pub fn notif_set_sync_wakeup(listener: BorrowedFd<'_>) -> bool {
    const SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP: u64 = 1;
    // SAFETY: the ioctl reads the u64 flag word we own.
    let ret = unsafe {
        libc::ioctl(
            listener.as_raw_fd(),
            libc::SECCOMP_IOCTL_NOTIF_SET_FLAGS as _,
            SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP,
        )
    };
    ret == 0
}

/// The window size of the terminal `fd` (`TIOCGWINSZ`).
pub fn window_size(fd: BorrowedFd<'_>) -> io::Result<libc::winsize> {
    let mut size = MaybeUninit::<libc::winsize>::zeroed();
    // SAFETY: the ioctl writes one winsize into the buffer we own.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, size.as_mut_ptr()) };
    check(ret as libc::c_long)?;
    // SAFETY: zero-initialised, then filled by the ioctl that succeeded.
    Ok(unsafe { size.assume_init() })
}

/// Sets the window size of the terminal `fd` (`TIOCSWINSZ`); the kernel signals SIGWINCH to
/// the terminal's foreground process group when it changed.
pub fn set_window_size(fd: BorrowedFd<'_>, size: &libc::winsize) -> io::Result<()> {
    // SAFETY: the ioctl reads one winsize we own.
    let ret = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            libc::TIOCSWINSZ,
            size as *const libc::winsize,
        )
    };
    check(ret as libc::c_long).map(|_| ())
}

/// Sends `signal` (SIGINT, SIGQUIT or SIGTSTP) to the foreground process group of the
/// pseudo-terminal whose master is `master` (`TIOCSIG`), as its line discipline would on
/// the matching character: the kernel reads the group when it sends, so no group number can
/// go stale in between.
pub fn terminal_signal(master: BorrowedFd<'_>, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: TIOCSIG takes the signal number by value; no memory is passed.
    let ret = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSIG, signal as libc::c_ulong) };
    check(ret as libc::c_long).map(|_| ())
}

/// Whether `signal` is ignored (`SIG_IGN`) in this process now.
pub fn is_ignored(signal: libc::c_int) -> io::Result<bool> {
    // SAFETY: asks for the current action only (no new one is given); the kernel writes it
    // into `old`, a zeroed sigaction on this stack.
    let (ret, old) = unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        let ret = libc::sigaction(signal, std::ptr::null(), &mut old);
        (ret, old)
    };
    check(ret as libc::c_long)?;
    Ok(old.sa_sigaction == libc::SIG_IGN)
}

/// Gives `signal` its default action again (`SIG_DFL`), whatever handler it had.
pub fn default_action(signal: libc::c_int) -> io::Result<()> {
    set_action(signal, libc::SIG_DFL)
}

/// Sets `handler` (`SIG_DFL`, or a function that touches nothing) for `signal`, with an empty
/// mask and no flags (so no `SA_RESTART`).
fn set_action(signal: libc::c_int, handler: libc::sighandler_t) -> io::Result<()> {
    // SAFETY: a zeroed sigaction is valid; we set its handler (SIG_DFL, or a function of
    // ours that touches nothing) and an empty mask, and the kernel only reads it.
    let ret = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(signal, &action, std::ptr::null_mut())
    };
    check(ret as libc::c_long).map(|_| ())
}

/// The signal that ends a bounded call (see `bound::bounded`): a real-time signal near the top of
/// the range, which glibc leaves to programs, handled by a function that does nothing.
fn bound_signal() -> libc::c_int {
    libc::SIGRTMAX() - 3
}

/// Installs the handler of [`bound_signal`] (the caller installs it once): it does nothing, and it is
/// installed without `SA_RESTART`, so a call the signal interrupts returns EINTR instead of
/// waiting again.
pub fn install_bound_handler() -> io::Result<()> {
    extern "C" fn interrupt(_: libc::c_int) {}
    set_action(
        bound_signal(),
        interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t,
    )
}

/// Blocks (`true`) or unblocks [`bound_signal`] on the calling thread alone. Unblocking
/// delivers one that is pending at once, to its handler, which does nothing: a signal sent
/// for a call that had already returned interrupts nothing.
pub fn block_bound_signal(block: bool) -> io::Result<()> {
    let how = if block {
        libc::SIG_BLOCK
    } else {
        libc::SIG_UNBLOCK
    };
    // SAFETY: the set is ours, initialised by sigemptyset before sigaddset reads it; the
    // kernel only reads it, and the old mask is not asked for.
    let ret = unsafe {
        let mut set = MaybeUninit::<libc::sigset_t>::zeroed();
        libc::sigemptyset(set.as_mut_ptr());
        libc::sigaddset(set.as_mut_ptr(), bound_signal());
        libc::pthread_sigmask(how, set.as_ptr(), std::ptr::null_mut())
    };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(())
}

/// Sends [`bound_signal`] to thread `tid` of this process (`tgkill`): a thread of another
/// process is never reached, whatever `tid` is.
pub fn signal_bound_thread(tid: libc::pid_t) -> io::Result<()> {
    // SAFETY: tgkill takes integers only; it touches no memory of ours.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            tid,
            bound_signal() as libc::c_long,
        )
    };
    check(ret).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nice value lands on the calling thread alone: the process's other threads keep
    /// theirs. Without the right to raise it (not root), the call says so.
    #[test]
    fn a_thread_nice_value_is_the_threads_alone() {
        let nice_of = |tid: i32| {
            procfs::process::Process::myself()
                .and_then(|p| p.task_from_tid(tid))
                .and_then(|t| t.stat())
                .map(|s| s.nice)
                .unwrap()
        };
        let me = nix::unistd::gettid().as_raw();
        let before = nice_of(me);
        let (told, heard) = std::sync::mpsc::channel();
        let (done, finish) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let r = set_thread_nice(-10);
            told.send((r, nix::unistd::gettid().as_raw())).unwrap();
            let _ = finish.recv();
        });
        let (result, tid) = heard.recv().unwrap();
        if nix::unistd::geteuid().is_root() {
            result.unwrap();
            assert_eq!(nice_of(tid), -10);
        } else {
            let e = result.unwrap_err();
            assert!(
                matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)),
                "{e}"
            );
            eprintln!("not root: checked only that raising the weight is refused");
        }
        assert_eq!(
            nice_of(me),
            before,
            "the calling thread's neighbours keep theirs"
        );
        done.send(()).unwrap();
        thread.join().unwrap();
    }
}
