//! The per-executor supervisor: receives seccomp notifications, turns each into one or more
//! [`EgressAttempt`]s, waits for the host's verdict, and performs the operation itself.
//!
//! The TOCTOU rule: a decision that depended on memory the executor points at is never
//! answered with CONTINUE. The broker copies the address (and for sends the payload and
//! control data) once, with `SECCOMP_IOCTL_NOTIF_ID_VALID` checked before and after the copy,
//! decides on that copy, takes the executor's socket with `pidfd_getfd`, performs the syscall
//! itself with the copy, and returns the result. Later writes by the executor to its own
//! memory change nothing.

use std::collections::HashSet;
use std::ffi::CString;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::attempt::{AttemptInfo, Destination, EgressAttempt, EgressSyscall, SocketInfo, Verdict};
use crate::sys::{self, Notification, OwnedMessage};

/// Largest address the kernel accepts (`sizeof(struct sockaddr_storage)`).
const MAX_ADDR: usize = 128;
/// Most iovecs per message (`UIO_MAXIOV`).
const MAX_IOV: usize = 1024;
/// Most control bytes copied per message.
const MAX_CONTROL: usize = 64 * 1024;
/// Most payload bytes copied per notification (all messages of a `sendmmsg` together); a
/// larger stream send is sent partially (as the kernel may do), a larger datagram is refused
/// with EMSGSIZE, and a batch is cut short before the message that does not fit (as the
/// kernel reports a batch that failed part-way).
const MAX_PAYLOAD: usize = 4 * 1024 * 1024;
/// Most descriptors held per notification: passed ones (`SCM_MAX_FD`, the kernel's own
/// per-message limit) and pinned unix paths together.
const MAX_PASSED_FDS: usize = 253;
/// Notifications of one executor handled at once. Further ones wait in the kernel (the
/// calling threads stay blocked in their syscalls, costing the daemon nothing) until a
/// handler finishes. With the per-notification bounds above, this bounds what one executor
/// can make the daemon hold: memory (16 x (4 MiB payload + 64 KiB control)) and
/// descriptors (16 x 253). A handler waiting on the network holds its permit for as long
/// as its caller waits, which stalls only that executor.
pub(crate) const EXECUTOR_HANDLERS: usize = 16;
/// Notifications copied and decided at once across every executor of a broker (the phase
/// that takes bounded time; see `Caller::performing`).
pub(crate) const BROKER_HANDLERS: usize = 128;
/// How often a handler waiting on the network (a send to a peer that does not read, a
/// connect that does not complete) checks that its caller is still waiting.
const CALLER_CHECK: Duration = Duration::from_millis(100);
/// `struct msghdr` and `struct mmsghdr` sizes on x86_64.
const MSGHDR_SIZE: usize = 56;
const MMSGHDR_SIZE: usize = 64;
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;

/// Counters shared between a supervisor and whoever reports health.
#[derive(Debug, Default)]
pub struct Counters {
    /// Notifications received.
    pub notifications: AtomicU64,
    /// Attempts allowed and carried out (whatever their result).
    pub allowed: AtomicU64,
    /// Attempts refused.
    pub denied: AtomicU64,
    /// Notifications the broker could not handle (answered with an error).
    pub failed: AtomicU64,
}

/// Shared state of one executor's supervision.
pub(crate) struct Context {
    pub listener: AsyncFd<OwnedFd>,
    pub reap: Arc<crate::executor::Reap>,
    pub attempts: mpsc::Sender<EgressAttempt>,
    pub counters: Arc<Counters>,
    pub broker_counters: Arc<Counters>,
    /// Bounds this executor's notifications in flight ([`EXECUTOR_HANDLERS`]).
    pub handlers: Arc<Semaphore>,
    /// Bounds the broker's notifications in flight ([`BROKER_HANDLERS`]).
    pub broker_handlers: Arc<Semaphore>,
    /// Cookies of this executor's sockets the broker bound (see `Caller::listen`).
    pub bound: std::sync::Mutex<HashSet<u64>>,
    /// Held while the broker toggles O_NONBLOCK on one of this executor's sockets, and
    /// while it reads that flag.
    pub flags: std::sync::Mutex<()>,
}

impl Context {
    fn bump(&self, f: impl Fn(&Counters) -> &AtomicU64) {
        f(&self.counters).fetch_add(1, Ordering::Relaxed);
        f(&self.broker_counters).fetch_add(1, Ordering::Relaxed);
    }
}

/// How the supervision loop ended.
#[derive(Debug)]
pub(crate) enum End {
    /// Every task using the filter has exited.
    ExecutorGone,
    /// The listener failed; the caller kills the executor.
    Error(io::Error),
}

fn poll_now(fd: BorrowedFd<'_>) -> i16 {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: polls one descriptor we own, without blocking.
        let r = unsafe { libc::poll(&mut pfd, 1, 0) };
        if r >= 0 {
            return pfd.revents;
        }
        // A signal handler ran on this thread: ask again. Any other failure of a zero-timeout
        // poll on a descriptor we own is reported as readable, so the receive that follows
        // fails and supervision ends with an error (which kills the executor), instead of
        // being mistaken for the executor's exit.
        if io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return libc::POLLIN;
        }
    }
}

/// Receives notifications until the executor is gone. Each notification is handled in its
/// own task, so a blocking operation for one thread never stalls the others (or other
/// executors). (Measured: spawning beats polling handlers inside this task, since tokio runs
/// a task spawned from a worker next on that worker.)
pub(crate) async fn supervise(ctx: Arc<Context>) -> End {
    let mut reaped = false;
    loop {
        tokio::select! {
            ready = ctx.listener.readable() => {
                let mut guard = match ready {
                    Ok(g) => g,
                    Err(e) => return End::Error(e),
                };
                loop {
                    let revents = poll_now(ctx.listener.get_ref().as_fd());
                    if revents & libc::POLLIN != 0 {
                        // A permit first: while this executor has none free, its
                        // notifications stay queued in the kernel.
                        let permit = ctx.handlers.clone().acquire_owned().await.ok();
                        match sys::notif_recv(ctx.listener.get_ref().as_fd()) {
                            Ok(n) => {
                                ctx.bump(|c| &c.notifications);
                                tokio::spawn(handle(ctx.clone(), n, permit));
                            }
                            // The caller died between notification and receipt, or a signal.
                            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINTR)) => {}
                            Err(e) => return End::Error(e),
                        }
                    } else if revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                        // Every task using the filter has exited: reap the executor before
                        // supervision ends, so nothing is left as a zombie.
                        if !reaped {
                            reap_after_exit(&ctx.reap).await;
                        }
                        return End::ExecutorGone;
                    } else {
                        guard.clear_ready();
                        break;
                    }
                }
            }
            // The executor exited while descendants (outside a pid namespace) may still use
            // the filter: reap it now, and keep supervising them until the listener hangs up.
            exited = ctx.reap.pidfd.readable(), if !reaped => {
                match exited {
                    Ok(mut guard) => match ctx.reap.try_reap() {
                        Ok(Some(_)) | Err(_) => reaped = true,
                        Ok(None) => guard.clear_ready(),
                    },
                    Err(_) => reaped = true,
                }
            }
        }
    }
}

/// Reaps an executor whose tasks have all exited (its pidfd turns readable, at the latest,
/// once a pid-namespace init has collected its namespace).
async fn reap_after_exit(reap: &crate::executor::Reap) {
    let wait = async {
        loop {
            let Ok(mut guard) = reap.pidfd.readable().await else {
                return;
            };
            match reap.try_reap() {
                Ok(None) => guard.clear_ready(),
                _ => return,
            }
        }
    };
    if tokio::time::timeout(std::time::Duration::from_secs(5), wait)
        .await
        .is_err()
    {
        tracing::warn!("an executor whose tasks all exited could not be reaped within 5 s");
    }
}

/// The result of handling one notification.
#[derive(Debug)]
enum Outcome {
    /// Return this value from the syscall.
    Value(i64),
    /// Fail the syscall with this errno.
    Errno(i32),
    /// The caller is gone (the notification id is no longer valid); nothing to answer.
    Abandon,
}

type Step<T> = Result<T, Outcome>;

fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// Answers a notification exactly once; if dropped unanswered (a bug, a panic), it refuses
/// the call with EIO rather than leaving the executor hanging or letting anything through.
struct Pending {
    ctx: Arc<Context>,
    id: u64,
    answered: bool,
}

impl Pending {
    fn answer(mut self, outcome: Outcome) {
        self.answered = true;
        let fd = self.ctx.listener.get_ref().as_fd();
        let result = match outcome {
            Outcome::Value(v) => sys::notif_send(fd, self.id, v, 0),
            Outcome::Errno(e) => sys::notif_send(fd, self.id, 0, -e),
            Outcome::Abandon => return,
        };
        // ENOENT: the caller was killed while we worked; there is nobody to answer.
        if let Err(e) = result
            && e.raw_os_error() != Some(libc::ENOENT)
        {
            self.ctx.bump(|c| &c.failed);
            tracing::warn!(error = %e, "cannot answer a seccomp notification");
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.answered {
            self.ctx.bump(|c| &c.failed);
            let _ = sys::notif_send(self.ctx.listener.get_ref().as_fd(), self.id, 0, -libc::EIO);
        }
    }
}

async fn handle(ctx: Arc<Context>, n: Notification, _permit: Option<OwnedSemaphorePermit>) {
    let pending = Pending {
        ctx: ctx.clone(),
        id: n.id,
        answered: false,
    };
    // The broker-wide permit covers copying and deciding, which take bounded time; it is
    // released before the operation is performed (see `Caller::performing`), so executors
    // whose sends wait on silent peers cannot hold it and stall everyone else's egress.
    let shared = ctx.broker_handlers.clone().acquire_owned().await.ok();
    let caller = Caller {
        ctx: &ctx,
        n,
        shared: std::sync::Mutex::new(shared),
    };
    // The filter kills every other architecture; this is a second line, not the first.
    if n.arch != AUDIT_ARCH_X86_64 {
        pending.answer(Outcome::Errno(libc::ENOSYS));
        return;
    }
    let outcome = match i64::from(n.nr) {
        libc::SYS_connect => caller.connect().await,
        libc::SYS_bind => caller.bind().await,
        libc::SYS_sendto => caller.sendto().await,
        libc::SYS_sendmsg => caller.sendmsg().await,
        libc::SYS_sendmmsg => caller.sendmmsg().await,
        libc::SYS_listen => caller.listen().await,
        _ => Err(Outcome::Errno(libc::ENOSYS)),
    };
    pending.answer(outcome.unwrap_or_else(|o| o));
}

/// A socket taken from the executor, with what the kernel says it is.
struct TakenSocket {
    fd: Arc<OwnedFd>,
    info: SocketInfo,
}

impl TakenSocket {
    fn blocking(&self) -> bool {
        nix::fcntl::fcntl(&*self.fd, nix::fcntl::FcntlArg::F_GETFL)
            .map(|flags| flags & libc::O_NONBLOCK == 0)
            .unwrap_or(false)
    }
}

/// One message of a send, copied out of the executor.
struct CopiedMessage {
    msg: OwnedMessage,
    /// Destination decoded from `msg.name`, or the connected peer.
    destination: Option<Destination>,
    connected: bool,
    /// Descriptors passed with SCM_RIGHTS (kept alive until the send is done).
    _passed: Vec<OwnedFd>,
    passed_count: usize,
    /// Pinned unix socket inode when the destination is a pathname.
    _pin: Option<OwnedFd>,
    /// Why the destination cannot be reached (a unix path that does not resolve), returned
    /// only if the host allows the attempt.
    unreachable: Option<i32>,
}

struct Caller<'a> {
    ctx: &'a Context,
    n: Notification,
    /// The broker-wide permit, held until the operation is performed.
    shared: std::sync::Mutex<Option<OwnedSemaphorePermit>>,
}

impl Caller<'_> {
    fn still_waiting(&self) -> Step<()> {
        if sys::notif_id_valid(self.ctx.listener.get_ref().as_fd(), self.n.id) {
            Ok(())
        } else {
            Err(Outcome::Abandon)
        }
    }

    /// Called between the verdict and the operation: nothing is performed for a caller that
    /// went away while the host decided, and the broker-wide permit is released, since what
    /// follows may wait on the network for as long as the caller does.
    fn performing(&self) -> Step<()> {
        self.still_waiting()?;
        if let Ok(mut shared) = self.shared.lock() {
            shared.take();
        }
        Ok(())
    }

    /// What to answer when the broker's own work for the caller failed: the error, unless
    /// the caller is gone (then there is nobody to answer). Never silence: an unanswered
    /// notification would leave the calling thread blocked forever.
    fn failure(&self, e: &io::Error) -> Outcome {
        match self.still_waiting() {
            Ok(()) => Outcome::Errno(errno_of(e)),
            Err(gone) => gone,
        }
    }

    /// Copies `len` bytes at `addr` from the caller, bracketed by ID_VALID checks so the
    /// bytes are known to come from the thread that is waiting on this notification.
    fn copy(&self, addr: u64, len: usize) -> Step<Vec<u8>> {
        self.still_waiting()?;
        let mut buf = vec![0u8; len];
        sys::read_remote(self.n.pid, addr, &mut buf).map_err(|_| Outcome::Errno(libc::EFAULT))?;
        self.still_waiting()?;
        Ok(buf)
    }

    /// A pidfd for the caller. Callers open it before their first [`Caller::copy`] (or
    /// [`Caller::still_waiting`]): the validity check after that proves the pidfd (and any
    /// descriptor taken with it) belongs to the thread still waiting on this notification,
    /// not to a process that reused its pid. Nothing taken with it is used before that check.
    fn pidfd(&self) -> Step<OwnedFd> {
        sys::pidfd_open_thread(self.n.pid).map_err(|e| self.failure(&e))
    }

    /// The caller's `/proc/<tid>/mem`, open for writing, to report results the kernel would
    /// have written into the caller's memory. Opened before the caller's memory is first
    /// copied, so the validity check after that copy proves it is the waiting thread's.
    fn memory(&self) -> Step<std::fs::File> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{}/mem", self.n.pid))
            .map_err(|e| self.failure(&e))
    }

    fn socket(&self, pidfd: &OwnedFd, fd: u64) -> Step<TakenSocket> {
        let fd = i32::try_from(fd as i64).map_err(|_| Outcome::Errno(libc::EBADF))?;
        let taken =
            sys::pidfd_getfd(pidfd.as_fd(), fd).map_err(|e| Outcome::Errno(errno_of(&e)))?;
        let opt = |name| {
            sys::getsockopt_int(taken.as_fd(), libc::SOL_SOCKET, name)
                .map_err(|e| Outcome::Errno(errno_of(&e)))
        };
        let info = SocketInfo {
            family: opt(libc::SO_DOMAIN)?,
            socket_type: opt(libc::SO_TYPE)?,
            protocol: opt(libc::SO_PROTOCOL)?,
        };
        Ok(TakenSocket {
            fd: Arc::new(taken),
            info,
        })
    }

    fn attempt(&self, syscall: EgressSyscall, sock: &TakenSocket) -> AttemptInfo {
        AttemptInfo {
            syscall,
            pid: self.n.pid,
            executable: sys::executable_of(self.n.pid),
            socket: sock.info,
            destination: None,
            connected: false,
            bytes: None,
            message_index: None,
            passed_fds: 0,
        }
    }

    /// Hands the attempt to the host and waits for its verdict. No consumer, or a consumer
    /// that drops the attempt, is a refusal.
    async fn decide(&self, info: AttemptInfo) -> Verdict {
        let (attempt, verdict) = EgressAttempt::new(info);
        if self.ctx.attempts.send(attempt).await.is_err() {
            self.ctx.bump(|c| &c.denied);
            return Verdict::DENY;
        }
        let v = verdict.await.unwrap_or(Verdict::DENY);
        match v {
            Verdict::Allow => self.ctx.bump(|c| &c.allowed),
            Verdict::Deny { .. } => self.ctx.bump(|c| &c.denied),
        }
        v
    }

    async fn connect(&self) -> Step<Outcome> {
        let [fd, addr, len, ..] = self.n.args;
        let len = addr_len(len)?;
        let pidfd = self.pidfd()?;
        let sock = self.socket(&pidfd, fd)?;
        let raw = self.copy(addr, len)?;
        let mut info = self.attempt(EgressSyscall::Connect, &sock);
        let (destination, target) = self.resolve(&raw, &sock, EgressSyscall::Connect);
        info.destination = Some(destination);
        if let Verdict::Deny { errno } = self.decide(info).await {
            return Ok(Outcome::Errno(errno));
        }
        let target = target?;
        // Nothing is performed for a caller that went away while the host decided.
        self.performing()?;
        let inet = matches!(sock.info.family, libc::AF_INET | libc::AF_INET6);
        let result = if !self.is_blocking(&sock) {
            sys::connect_raw(sock.fd.as_fd(), &target.addr)
        } else if inet {
            self.connect_ip(&sock, &target.addr).await?
        } else {
            self.connect_unix(&sock, &target.addr).await?
        };
        Ok(to_outcome(result.map(|()| 0)))
    }

    async fn bind(&self) -> Step<Outcome> {
        let [fd, addr, len, ..] = self.n.args;
        let len = addr_len(len)?;
        let pidfd = self.pidfd()?;
        let sock = self.socket(&pidfd, fd)?;
        let raw = self.copy(addr, len)?;
        let mut info = self.attempt(EgressSyscall::Bind, &sock);
        let (destination, target) = self.resolve(&raw, &sock, EgressSyscall::Bind);
        info.destination = Some(destination);
        if let Verdict::Deny { errno } = self.decide(info).await {
            return Ok(Outcome::Errno(errno));
        }
        let target = target?;
        self.performing()?;
        if let Err(e) = sys::bind_raw(sock.fd.as_fd(), &target.addr) {
            return Ok(Outcome::Errno(errno_of(&e)));
        }
        self.remember_bound(&sock);
        Ok(Outcome::Value(0))
    }

    /// `listen` on an IP socket the broker bound exposes only the address that (decided)
    /// bind chose, and is carried out. On any other IP socket the kernel may bind it itself,
    /// to an address and ephemeral port no `bind` decided: `getsockname` cannot tell (a
    /// failed or dissolved connect leaves a stale port in it), so that is a `listen` attempt
    /// on the socket family's wildcard address, port 0, carried out only if allowed. Other
    /// families never bind on `listen` (unix refuses an unbound socket). The broker performs
    /// the `listen` on its own copy of the socket, so the descriptor number cannot be swapped
    /// for another socket between check and effect.
    async fn listen(&self) -> Step<Outcome> {
        let [fd, backlog, ..] = self.n.args;
        let pidfd = self.pidfd()?;
        let sock = self.socket(&pidfd, fd)?;
        // Nothing copied: this check is what proves the socket is the waiting thread's.
        self.still_waiting()?;
        let wildcard = match sock.info.family {
            libc::AF_INET => Some(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
            libc::AF_INET6 => Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED)),
            _ => None,
        };
        if let Some(ip) = wildcard
            && !self.was_bound_by_broker(&sock)
        {
            let mut info = self.attempt(EgressSyscall::Listen, &sock);
            info.destination = Some(Destination::Inet(SocketAddr::new(ip, 0)));
            if let Verdict::Deny { errno } = self.decide(info).await {
                return Ok(Outcome::Errno(errno));
            }
            self.performing()?;
        }
        Ok(to_outcome(
            sys::listen_raw(sock.fd.as_fd(), backlog as i32).map(|()| 0),
        ))
    }

    async fn sendto(&self) -> Step<Outcome> {
        let [fd, buf, len, flags, addr, addrlen] = self.n.args;
        let flags = flags as i32;
        let pidfd = self.pidfd()?;
        let sock = self.socket(&pidfd, fd)?;
        let payload = self.payload_len(&sock, len as usize)?;
        let data = self.copy(buf, payload)?;
        let mut message = OwnedMessage {
            data,
            ..OwnedMessage::default()
        };
        let mut info = self.attempt(EgressSyscall::Sendto, &sock);
        info.bytes = Some(message.data.len());
        let mut pin = None;
        if addr == 0 {
            info.connected = true;
            info.destination = peer(&sock);
        } else {
            let raw = self.copy(addr, addr_len(addrlen)?)?;
            let (destination, target) = self.resolve(&raw, &sock, EgressSyscall::Sendto);
            info.destination = Some(destination);
            if let Ok(t) = &target {
                message.name = t.addr.clone();
            }
            pin = Some(target);
        }
        if let Verdict::Deny { errno } = self.decide(info).await {
            return Ok(Outcome::Errno(errno));
        }
        if let Some(target) = pin {
            target?;
        }
        self.performing()?;
        Ok(to_outcome(
            self.send(&sock, message, flags).await?.map(|n| n as i64),
        ))
    }

    async fn sendmsg(&self) -> Step<Outcome> {
        let [fd, msg_ptr, flags, ..] = self.n.args;
        let flags = flags as i32;
        let pidfd = self.pidfd()?;
        let sock = self.socket(&pidfd, fd)?;
        let header = self.copy(msg_ptr, MSGHDR_SIZE)?;
        let mut budget = Budget::default();
        let copied = self.message(&pidfd, &sock, &header, EgressSyscall::Sendmsg, &mut budget)?;
        let mut info = self.attempt(EgressSyscall::Sendmsg, &sock);
        info.bytes = Some(copied.msg.data.len());
        info.destination = copied.destination.clone();
        info.connected = copied.connected;
        info.passed_fds = copied.passed_count;
        if let Verdict::Deny { errno } = self.decide(info).await {
            return Ok(Outcome::Errno(errno));
        }
        if let Some(errno) = copied.unreachable {
            return Ok(Outcome::Errno(errno));
        }
        self.performing()?;
        Ok(to_outcome(
            self.send(&sock, copied.msg.clone(), flags)
                .await?
                .map(|n| n as i64),
        ))
    }

    async fn sendmmsg(&self) -> Step<Outcome> {
        let [fd, vec_ptr, vlen, flags, ..] = self.n.args;
        let flags = flags as i32;
        let vlen = (vlen as u32 as usize).min(MAX_IOV);
        if vlen == 0 {
            return Ok(Outcome::Value(0));
        }
        let pidfd = self.pidfd()?;
        let memory = self.memory()?;
        let sock = self.socket(&pidfd, fd)?;
        let headers = self.copy(vec_ptr, vlen * MMSGHDR_SIZE)?;
        let mut messages = Vec::with_capacity(vlen);
        let mut budget = Budget::default();
        for i in 0..vlen {
            let h = &headers[i * MMSGHDR_SIZE..i * MMSGHDR_SIZE + MSGHDR_SIZE];
            match self.message(&pidfd, &sock, h, EgressSyscall::Sendmmsg, &mut budget) {
                Ok(m) => messages.push(m),
                Err(Outcome::Abandon) => return Err(Outcome::Abandon),
                // Like the kernel, a batch that fails part-way reports the messages before
                // the failure; the failure itself is reported only if it is the first.
                Err(first) if i == 0 => return Err(first),
                Err(_) => break,
            }
        }
        // Every message is reported and decided before any is sent.
        let mut verdicts = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let mut info = self.attempt(EgressSyscall::Sendmmsg, &sock);
            info.bytes = Some(m.msg.data.len());
            info.destination = m.destination.clone();
            info.connected = m.connected;
            info.message_index = Some(i);
            info.passed_fds = m.passed_count;
            verdicts.push(self.decide(info).await);
        }
        self.performing()?;
        let mut sent = 0usize;
        for (i, (m, verdict)) in messages.iter().zip(verdicts).enumerate() {
            let result = match verdict {
                Verdict::Deny { errno } => Err(io::Error::from_raw_os_error(errno)),
                Verdict::Allow => match m.unreachable {
                    Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                    None => self.send(&sock, m.msg.clone(), flags).await?,
                },
            };
            match result {
                Ok(n) => {
                    let at = vec_ptr + (i * MMSGHDR_SIZE + MSGHDR_SIZE) as u64;
                    // The kernel reports each message's length in its msg_len field. Written
                    // through the memory file opened before the first copy, so it reaches
                    // the caller even if its thread id is reused meanwhile, and nothing else.
                    use std::os::unix::fs::FileExt;
                    let _ = memory.write_all_at(&(n as u32).to_ne_bytes(), at);
                    sent += 1;
                    // A message sent only in part ends the batch, as in the kernel: what
                    // follows must not be written after a gap in a stream.
                    if n < m.msg.data.len() {
                        break;
                    }
                }
                Err(e) if sent == 0 => return Ok(Outcome::Errno(errno_of(&e))),
                Err(_) => break,
            }
        }
        Ok(Outcome::Value(sent as i64))
    }

    fn payload_len(&self, sock: &TakenSocket, len: usize) -> Step<usize> {
        if len <= MAX_PAYLOAD {
            Ok(len)
        } else if sock.info.socket_type == libc::SOCK_STREAM {
            Ok(MAX_PAYLOAD)
        } else {
            Err(Outcome::Errno(libc::EMSGSIZE))
        }
    }

    /// Copies one `struct msghdr` worth of message: name, payload and control data, within
    /// what is left of the notification's `budget`. A stream message larger than the budget
    /// is copied partially (and sent partially) only when nothing else of the notification
    /// was copied yet; otherwise it fails, as does a datagram that does not fit.
    fn message(
        &self,
        pidfd: &OwnedFd,
        sock: &TakenSocket,
        header: &[u8],
        syscall: EgressSyscall,
        budget: &mut Budget,
    ) -> Step<CopiedMessage> {
        let u64_at = |o: usize| u64::from_ne_bytes(header[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_ne_bytes(header[o..o + 4].try_into().unwrap_or([0; 4]));
        let (name_ptr, name_len) = (u64_at(0), u32_at(8) as usize);
        let (iov_ptr, iov_len) = (u64_at(16), u64_at(24) as usize);
        let (control_ptr, control_len) = (u64_at(32), u64_at(40) as usize);
        if name_len > MAX_ADDR {
            return Err(Outcome::Errno(libc::EINVAL));
        }
        if iov_len > MAX_IOV {
            return Err(Outcome::Errno(libc::EMSGSIZE));
        }
        if control_len > budget.control {
            return Err(Outcome::Errno(libc::ENOBUFS));
        }
        let iovecs = if iov_len > 0 {
            self.copy(iov_ptr, iov_len * 16)?
        } else {
            Vec::new()
        };
        let field = |i: usize, o: usize| {
            u64::from_ne_bytes(
                iovecs[i * 16 + o..i * 16 + o + 8]
                    .try_into()
                    .unwrap_or([0; 8]),
            )
        };
        let total = (0..iov_len).fold(0usize, |t, i| t.saturating_add(field(i, 8) as usize));
        let partial = sock.info.socket_type == libc::SOCK_STREAM && budget.untouched();
        if total > budget.payload && !partial {
            return Err(Outcome::Errno(libc::EMSGSIZE));
        }
        let mut data = Vec::with_capacity(total.min(budget.payload));
        for i in 0..iov_len {
            let take = (field(i, 8) as usize).min(budget.payload - data.len());
            if take > 0 {
                data.extend(self.copy(field(i, 0), take)?);
            }
        }
        budget.payload -= data.len();
        budget.control -= control_len;
        let mut msg = OwnedMessage {
            data,
            ..OwnedMessage::default()
        };
        let (destination, connected);
        let (mut pin, mut unreachable) = (None, None);
        if name_ptr != 0 && name_len > 0 {
            let raw = self.copy(name_ptr, name_len)?;
            let (dest, target) = self.resolve(&raw, sock, syscall);
            destination = Some(dest);
            connected = false;
            match target {
                Ok(t) => {
                    msg.name = t.addr;
                    pin = t.pin;
                    // A pinned path is a descriptor held until the send: it counts.
                    if pin.is_some() {
                        budget.fds = budget
                            .fds
                            .checked_sub(1)
                            .ok_or(Outcome::Errno(libc::ENOBUFS))?;
                    }
                }
                Err(Outcome::Errno(e)) => unreachable = Some(e),
                Err(other) => return Err(other),
            }
        } else {
            connected = true;
            destination = peer(sock);
        }
        let mut passed = Vec::new();
        if control_ptr != 0 && control_len > 0 {
            let raw = self.copy(control_ptr, control_len)?;
            msg.control = translate_control(&raw, pidfd, &mut passed, budget.fds)?;
            budget.fds -= passed.len();
        }
        let passed_count = passed.len();
        Ok(CopiedMessage {
            msg,
            destination,
            connected,
            _passed: passed,
            passed_count,
            _pin: pin,
            unreachable,
        })
    }

    /// Decodes a copied address as the kernel would read it for this socket and syscall
    /// (see [`Destination::for_socket`]). For pathname unix sockets, resolves `.` and `..`
    /// and the working directory first, then opens the result in the executor's filesystem
    /// view without following symlinks and pins the inode (connect, send) or the parent
    /// directory (bind): what is decided is exactly the path the broker reaches.
    fn resolve(
        &self,
        raw: &[u8],
        sock: &TakenSocket,
        syscall: EgressSyscall,
    ) -> (Destination, Step<Target>) {
        let destination = Destination::for_socket(raw, sock.info.family, syscall);
        let Destination::UnixPath(path) = &destination else {
            return (
                destination,
                Ok(Target {
                    addr: raw.to_vec(),
                    pin: None,
                }),
            );
        };
        let absolute = if path.is_absolute() {
            path.clone()
        } else {
            match std::fs::read_link(format!("/proc/{}/cwd", self.n.pid)) {
                Ok(cwd) => cwd.join(path),
                Err(e) => return (destination, Err(self.failure(&e))),
            }
        };
        // Proves the working directory read above was the waiting thread's.
        if let Err(gone) = self.still_waiting() {
            return (destination, Err(gone));
        }
        let absolute = without_dots(&absolute);
        let usage = if syscall == EgressSyscall::Bind {
            UnixUse::Bind
        } else {
            UnixUse::Connect
        };
        let target = self.pin_unix(&absolute, usage);
        (Destination::UnixPath(absolute), target)
    }

    fn pin_unix(&self, absolute: &Path, usage: UnixUse) -> Step<Target> {
        let root = std::fs::File::open(format!("/proc/{}/root", self.n.pid))
            .map_err(|e| self.failure(&e))?;
        // Proves the root just opened is the waiting thread's, not a reused pid's.
        self.still_waiting()?;
        let root = OwnedFd::from(root);
        let errno = |e: io::Error| Outcome::Errno(errno_of(&e));
        let c = |p: &Path| {
            CString::new(p.as_os_str().as_bytes()).map_err(|_| Outcome::Errno(libc::EINVAL))
        };
        match usage {
            UnixUse::Connect => {
                let pin =
                    sys::open_path_nofollow(root.as_fd(), &c(absolute)?, true).map_err(errno)?;
                let addr = unix_sockaddr(format!("/proc/self/fd/{}", pin.as_raw_fd()).as_bytes())?;
                Ok(Target {
                    addr,
                    pin: Some(pin),
                })
            }
            UnixUse::Bind => {
                let (Some(parent), Some(name)) = (absolute.parent(), absolute.file_name()) else {
                    return Err(Outcome::Errno(libc::EINVAL));
                };
                let dir =
                    sys::open_path_nofollow(root.as_fd(), &c(parent)?, true).map_err(errno)?;
                let mut path = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
                path.extend_from_slice(name.as_bytes());
                Ok(Target {
                    addr: unix_sockaddr(&path)?,
                    pin: Some(dir),
                })
            }
        }
    }
}

/// What one notification may still copy out of the executor and hold while it is handled.
struct Budget {
    payload: usize,
    control: usize,
    fds: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            payload: MAX_PAYLOAD,
            control: MAX_CONTROL,
            fds: MAX_PASSED_FDS,
        }
    }
}

impl Budget {
    fn untouched(&self) -> bool {
        self.payload == MAX_PAYLOAD
    }
}

/// `path` with `.` and `..` resolved lexically. Exact for the broker's lookups, which follow
/// no symlinks: every component is a real directory, so `..` is its parent (and `..` at the
/// root stays there, as under `RESOLVE_IN_ROOT`).
fn without_dots(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// What the broker will pass to the syscall, and any pinned descriptor the address names.
struct Target {
    addr: Vec<u8>,
    pin: Option<OwnedFd>,
}

#[derive(Clone, Copy)]
enum UnixUse {
    Connect,
    Bind,
}

fn unix_sockaddr(path: &[u8]) -> Step<Vec<u8>> {
    if path.len() >= 108 {
        return Err(Outcome::Errno(libc::ENAMETOOLONG));
    }
    let mut v = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
    v.extend_from_slice(path);
    v.push(0);
    Ok(v)
}

fn peer(sock: &TakenSocket) -> Option<Destination> {
    sys::peer_address(sock.fd.as_fd())
        .ok()
        .map(|raw| Destination::from_sockaddr(&raw))
}

fn addr_len(len: u64) -> Step<usize> {
    let len = len as u32 as usize;
    if len > MAX_ADDR {
        Err(Outcome::Errno(libc::EINVAL))
    } else {
        Ok(len)
    }
}

fn to_outcome(r: io::Result<i64>) -> Outcome {
    match r {
        Ok(v) => Outcome::Value(v),
        Err(e) => Outcome::Errno(errno_of(&e)),
    }
}

/// How long the broker waits inline for a connect to complete before awaiting it.
const INLINE_CONNECT_WAIT: std::time::Duration = std::time::Duration::from_micros(250);

/// The outcome of a non-blocking connect whose socket became writable: its final error, or
/// success once it has a peer (`WouldBlock` if neither yet).
fn connect_result(fd: BorrowedFd<'_>) -> io::Result<()> {
    let err = sys::getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_ERROR)?;
    if err != 0 {
        return Err(io::Error::from_raw_os_error(err));
    }
    if sys::peer_address(fd).is_ok() {
        return Ok(());
    }
    Err(io::Error::from(io::ErrorKind::WouldBlock))
}

/// When a wait on behalf of a blocking call gives up: the socket's own send timeout
/// (`SO_SNDTIMEO`), as the kernel's blocking call would; without one, never (the wait still
/// ends when the caller is gone).
fn give_up_at(sock: &TakenSocket) -> Option<Instant> {
    sys::send_timeout(sock.fd.as_fd())
        .ok()
        .flatten()
        .map(|t| Instant::now() + t)
}

fn timed_out(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

impl Caller<'_> {
    /// Whether the executor's socket is in blocking mode (read under the same lock as the
    /// broker's temporary O_NONBLOCK, so a concurrent connect's toggle is never seen).
    fn is_blocking(&self, sock: &TakenSocket) -> bool {
        let _flags = self.ctx.flags.lock();
        sock.blocking()
    }

    /// Runs `op` with the socket's file description non-blocking (the executor's calling
    /// thread is parked in its own syscall meanwhile), restoring its flags afterwards. One
    /// toggle at a time per executor, so two handlers cannot leave the flag set.
    fn nonblocking<T>(
        &self,
        sock: &TakenSocket,
        op: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        use nix::fcntl::{FcntlArg, OFlag, fcntl};
        let _flags = self.ctx.flags.lock();
        let fd = sock.fd.as_fd();
        let flags = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL)?);
        fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
        let result = op();
        fcntl(fd, FcntlArg::F_SETFL(flags))?;
        result
    }

    /// Waits until `watch` may have turned writable, for at most [`CALLER_CHECK`] (or until
    /// `deadline`), then confirms the caller is still waiting. Every network wait of a
    /// handler goes through here or [`Caller::pause`], so a handler whose caller is gone
    /// (killed, retired) ends and frees its permit instead of waiting on a peer forever.
    async fn writable_or_gone(
        &self,
        watch: &AsyncFd<OwnedFd>,
        deadline: Option<Instant>,
    ) -> Step<()> {
        let nap = deadline.map_or(CALLER_CHECK, |d| {
            d.saturating_duration_since(Instant::now())
                .min(CALLER_CHECK)
        });
        tokio::select! {
            ready = watch.writable() => match ready {
                Ok(mut guard) => guard.clear_ready(),
                Err(e) => return Err(Outcome::Errno(errno_of(&e))),
            },
            _ = tokio::time::sleep(nap) => {}
        }
        self.still_waiting()
    }

    /// Sleeps `nap` (no longer than until `deadline`), then confirms the caller waits.
    async fn pause(&self, nap: Duration, deadline: Option<Instant>) -> Step<()> {
        let nap = deadline.map_or(nap, |d| {
            d.saturating_duration_since(Instant::now()).min(nap)
        });
        tokio::time::sleep(nap).await;
        self.still_waiting()
    }

    /// Performs a connect the executor made on a blocking IP socket without blocking a
    /// thread: started non-blocking, then awaited, returning the socket's final error
    /// exactly as a blocking connect would have (EINPROGRESS once `SO_SNDTIMEO` expires).
    async fn connect_ip(&self, sock: &TakenSocket, addr: &[u8]) -> Step<io::Result<()>> {
        let fd = sock.fd.as_fd();
        match self.nonblocking(sock, || sys::connect_raw(fd, addr)) {
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            other => return Ok(other),
        }
        // A nearby peer completes the handshake within microseconds: wait for that inline,
        // for at most INLINE_CONNECT_WAIT, before paying for a reactor registration.
        match sys::wait_writable(fd, INLINE_CONNECT_WAIT) {
            Ok(true) => return Ok(connect_result(fd)),
            Ok(false) => {}
            Err(e) => return Ok(Err(e)),
        }
        let deadline = give_up_at(sock);
        let watch = match fd.try_clone_to_owned().and_then(sys::async_fd_writable) {
            Ok(w) => w,
            Err(e) => return Ok(Err(e)),
        };
        loop {
            self.writable_or_gone(&watch, deadline).await?;
            match connect_result(fd) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                done => return Ok(done),
            }
            if timed_out(deadline) {
                return Ok(Err(io::Error::from_raw_os_error(libc::EINPROGRESS)));
            }
        }
    }

    /// A blocking unix connect: a full backlog makes the non-blocking form fail with EAGAIN
    /// and offers no readiness to await, so it is retried until it succeeds, fails
    /// otherwise, `SO_SNDTIMEO` expires (EAGAIN, as the kernel reports), or the caller is
    /// gone.
    async fn connect_unix(&self, sock: &TakenSocket, addr: &[u8]) -> Step<io::Result<()>> {
        let deadline = give_up_at(sock);
        loop {
            match self.nonblocking(sock, || sys::connect_raw(sock.fd.as_fd(), addr)) {
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
                other => return Ok(other),
            }
            if timed_out(deadline) {
                return Ok(Err(io::Error::from_raw_os_error(libc::EAGAIN)));
            }
            self.pause(UNIX_CONNECT_RETRY, deadline).await?;
        }
    }

    /// Sends a copied message with the semantics of the executor's own call, without ever
    /// blocking a thread: a blocking socket's send waits for room (on a stream socket it
    /// sends everything unless an error or `SO_SNDTIMEO` ends it early, then reports what
    /// was sent); a non-blocking one returns EAGAIN. `MSG_NOSIGNAL` is always set: a broken
    /// pipe must not signal the broker.
    async fn send(
        &self,
        sock: &TakenSocket,
        mut msg: OwnedMessage,
        flags: i32,
    ) -> Step<io::Result<usize>> {
        let flags = flags | libc::MSG_NOSIGNAL;
        let may_block = flags & libc::MSG_DONTWAIT == 0 && self.is_blocking(sock);
        let stream = sock.info.socket_type == libc::SOCK_STREAM;
        let mut sent = 0usize;
        let mut watch = None;
        let mut deadline = None;
        loop {
            match sys::sendmsg_owned(sock.fd.as_fd(), &msg, flags | libc::MSG_DONTWAIT) {
                Ok(n) => {
                    sent += n;
                    if !(may_block && stream && n < msg.data.len()) {
                        return Ok(Ok(sent));
                    }
                    msg.data.drain(..n);
                    // The control data (and any name) went with the first bytes.
                    msg.control.clear();
                    msg.name.clear();
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && may_block => {}
                Err(_) if sent > 0 => return Ok(Ok(sent)),
                Err(e) => return Ok(Err(e)),
            }
            let deadline = *deadline.get_or_insert_with(|| give_up_at(sock));
            if timed_out(deadline) {
                return Ok(if sent > 0 {
                    Ok(sent)
                } else {
                    Err(io::Error::from_raw_os_error(libc::EAGAIN))
                });
            }
            if watch.is_none() {
                match sock.fd.try_clone().and_then(sys::async_fd_writable) {
                    Ok(w) => watch = Some(w),
                    Err(_) if sent > 0 => return Ok(Ok(sent)),
                    Err(e) => return Ok(Err(e)),
                }
            }
            if let Some(w) = &watch {
                match self.writable_or_gone(w, deadline).await {
                    Ok(()) => {}
                    // What was sent is reported, as the kernel reports a send cut short.
                    Err(Outcome::Errno(_)) if sent > 0 => return Ok(Ok(sent)),
                    Err(other) => return Err(other),
                }
            }
        }
    }

    /// Notes that the broker bound this socket (by its cookie, which the kernel never
    /// reuses), so a later `listen` on it is known to expose only the decided address.
    fn remember_bound(&self, sock: &TakenSocket) {
        if let Ok(cookie) = sys::socket_cookie(sock.fd.as_fd())
            && let Ok(mut bound) = self.ctx.bound.lock()
        {
            if bound.len() >= MAX_REMEMBERED_BINDS {
                // Forgetting is safe: a forgotten socket's listen is decided again.
                bound.clear();
            }
            bound.insert(cookie);
        }
    }

    fn was_bound_by_broker(&self, sock: &TakenSocket) -> bool {
        match (sys::socket_cookie(sock.fd.as_fd()), self.ctx.bound.lock()) {
            (Ok(cookie), Ok(bound)) => bound.contains(&cookie),
            _ => false,
        }
    }
}

/// How often a unix connect to a full backlog is retried.
const UNIX_CONNECT_RETRY: Duration = Duration::from_millis(10);
/// Most sockets per executor remembered as bound by the broker.
const MAX_REMEMBERED_BINDS: usize = 4096;

/// Rebuilds a control buffer for the broker's own sendmsg: descriptors passed with
/// SCM_RIGHTS are replaced by the broker's duplicates of them (at most `max_fds` in all, as
/// the kernel refuses more than `SCM_MAX_FD` per message with EINVAL); any other SOL_SOCKET
/// control message is refused (SCM_CREDENTIALS would be checked against the broker's
/// credentials, not the executor's), and so are IP options and IPv6 extension headers;
/// other IP-level control messages (TOS, TTL, PKTINFO, ...) pass unchanged. Lengths come
/// from the executor, so every offset is checked before use.
fn translate_control(
    raw: &[u8],
    pidfd: &OwnedFd,
    passed: &mut Vec<OwnedFd>,
    max_fds: usize,
) -> Step<Vec<u8>> {
    const HDR: usize = 16; // size_t cmsg_len; int cmsg_level; int cmsg_type
    let align = |n: usize| n.checked_add(7).map(|n| n & !7);
    let mut out = Vec::with_capacity(raw.len());
    let mut off = 0usize;
    while raw.len().saturating_sub(off) >= HDR {
        let field = |o: usize, n: usize| &raw[off + o..off + o + n];
        let len = u64::from_ne_bytes(field(0, 8).try_into().unwrap_or([0; 8]));
        let level = i32::from_ne_bytes(field(8, 4).try_into().unwrap_or([0; 4]));
        let kind = i32::from_ne_bytes(field(12, 4).try_into().unwrap_or([0; 4]));
        let len = usize::try_from(len)
            .ok()
            .filter(|len| *len >= HDR && *len <= raw.len() - off)
            .ok_or(Outcome::Errno(libc::EINVAL))?;
        let data = &raw[off + HDR..off + len];
        let start = out.len();
        out.extend_from_slice(&raw[off..off + HDR]);
        match (level, kind) {
            (libc::SOL_SOCKET, libc::SCM_RIGHTS) => {
                if passed.len() + data.len() / 4 > max_fds {
                    return Err(Outcome::Errno(libc::EINVAL));
                }
                for chunk in data.chunks_exact(4) {
                    let theirs = i32::from_ne_bytes(chunk.try_into().unwrap_or([0; 4]));
                    let ours = sys::pidfd_getfd(pidfd.as_fd(), theirs)
                        .map_err(|e| Outcome::Errno(errno_of(&e)))?;
                    out.extend_from_slice(&ours.as_raw_fd().to_ne_bytes());
                    passed.push(ours);
                }
            }
            (libc::SOL_SOCKET, _) => return Err(Outcome::Errno(libc::EPERM)),
            // IP options and IPv6 extension headers (source routes among them) are checked
            // against the broker's capabilities, not the executor's.
            (libc::IPPROTO_IP, libc::IP_OPTIONS | libc::IP_RETOPTS)
            | (
                libc::IPPROTO_IPV6,
                libc::IPV6_RTHDR
                | libc::IPV6_HOPOPTS
                | libc::IPV6_DSTOPTS
                | libc::IPV6_RTHDRDSTOPTS
                | libc::IPV6_2292RTHDR
                | libc::IPV6_2292HOPOPTS
                | libc::IPV6_2292DSTOPTS,
            ) => return Err(Outcome::Errno(libc::EPERM)),
            _ => out.extend_from_slice(data),
        }
        let step = align(len).ok_or(Outcome::Errno(libc::EINVAL))?;
        out.resize(start + step, 0);
        off += step;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_addresses_fit_sun_path() {
        assert!(unix_sockaddr("x".repeat(107).as_bytes()).is_ok());
        assert!(matches!(
            unix_sockaddr("x".repeat(108).as_bytes()),
            Err(Outcome::Errno(libc::ENAMETOOLONG))
        ));
    }

    #[test]
    fn dots_resolve_lexically() {
        for (path, want) in [
            ("/run/app/../docker.sock", "/run/docker.sock"),
            ("/run/app/./x/../s.sock", "/run/app/s.sock"),
            ("/../../etc/x", "/etc/x"),
            ("/run/app/s.sock", "/run/app/s.sock"),
        ] {
            assert_eq!(without_dots(Path::new(path)), Path::new(want), "{path}");
        }
    }

    fn cmsg(len: u64, level: i32, kind: i32, data: &[u8]) -> Vec<u8> {
        let mut raw = Vec::new();
        raw.extend_from_slice(&len.to_ne_bytes());
        raw.extend_from_slice(&level.to_ne_bytes());
        raw.extend_from_slice(&kind.to_ne_bytes());
        raw.extend_from_slice(data);
        raw.resize((raw.len() + 7) & !7, 0);
        raw
    }

    #[test]
    fn control_lengths_from_the_executor_are_checked() {
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        for len in [u64::MAX, u64::MAX - 7, 1 << 40, 64, 8] {
            let raw = cmsg(len, libc::IPPROTO_IP, 1, &[0u8; 8]);
            let mut passed = Vec::new();
            assert!(
                matches!(
                    translate_control(&raw, &me, &mut passed, MAX_PASSED_FDS),
                    Err(Outcome::Errno(libc::EINVAL))
                ),
                "cmsg_len {len} accepted"
            );
        }
    }

    #[test]
    fn control_passes_at_most_the_descriptor_budget() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let fds: Vec<u8> = std::iter::repeat_n(file.as_raw_fd().to_ne_bytes(), 3)
            .flatten()
            .collect();
        let raw = cmsg(16 + 12, libc::SOL_SOCKET, libc::SCM_RIGHTS, &fds);
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        let mut passed = Vec::new();
        assert!(matches!(
            translate_control(&raw, &me, &mut passed, 2),
            Err(Outcome::Errno(libc::EINVAL))
        ));
        assert!(passed.is_empty(), "nothing taken before the refusal");
        translate_control(&raw, &me, &mut passed, 3).unwrap();
        assert_eq!(passed.len(), 3);
    }

    #[test]
    fn control_refuses_source_routes() {
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        for (level, kind) in [
            (libc::IPPROTO_IP, libc::IP_RETOPTS),
            (libc::IPPROTO_IP, libc::IP_OPTIONS),
            (libc::IPPROTO_IPV6, libc::IPV6_RTHDR),
        ] {
            let raw = cmsg(16 + 8, level, kind, &[0u8; 8]);
            assert!(matches!(
                translate_control(&raw, &me, &mut Vec::new(), MAX_PASSED_FDS),
                Err(Outcome::Errno(libc::EPERM))
            ));
        }
        let tos = cmsg(16 + 4, libc::IPPROTO_IP, libc::IP_TOS, &[0u8; 4]);
        assert!(translate_control(&tos, &me, &mut Vec::new(), MAX_PASSED_FDS).is_ok());
    }

    #[test]
    fn control_refuses_credentials() {
        let mut raw = Vec::new();
        raw.extend_from_slice(&(16u64 + 12).to_ne_bytes());
        raw.extend_from_slice(&libc::SOL_SOCKET.to_ne_bytes());
        raw.extend_from_slice(&libc::SCM_CREDENTIALS.to_ne_bytes());
        raw.extend_from_slice(&[0u8; 12]);
        raw.resize(32, 0);
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        let mut passed = Vec::new();
        assert!(matches!(
            translate_control(&raw, &me, &mut passed, MAX_PASSED_FDS),
            Err(Outcome::Errno(libc::EPERM))
        ));
    }

    #[test]
    fn control_translates_passed_descriptors() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let mut raw = Vec::new();
        raw.extend_from_slice(&(16u64 + 4).to_ne_bytes());
        raw.extend_from_slice(&libc::SOL_SOCKET.to_ne_bytes());
        raw.extend_from_slice(&libc::SCM_RIGHTS.to_ne_bytes());
        raw.extend_from_slice(&file.as_raw_fd().to_ne_bytes());
        raw.resize(24, 0);
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        let mut passed = Vec::new();
        let out = translate_control(&raw, &me, &mut passed, MAX_PASSED_FDS).unwrap();
        assert_eq!(passed.len(), 1);
        let ours = i32::from_ne_bytes(out[16..20].try_into().unwrap());
        assert_eq!(ours, passed[0].as_raw_fd());
        assert_ne!(ours, file.as_raw_fd(), "the broker sends its own duplicate");
    }
}
