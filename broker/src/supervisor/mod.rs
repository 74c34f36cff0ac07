//! The per-executor supervisor: receives seccomp notifications, turns each into one or more
//! [`EgressAttempt`]s, waits for the host's verdict, and performs the operation itself.
//!
//! The TOCTOU rule: a decision that depended on memory the executor points at is never
//! answered with CONTINUE. The broker copies the address (and for sends the payload and
//! control data) once, with `SECCOMP_IOCTL_NOTIF_ID_VALID` checked after the copy,
//! decides on that copy, takes the executor's socket with `pidfd_getfd`, performs the syscall
//! itself with the copy, and returns the result. Later writes by the executor to its own
//! memory change nothing.
//!
//! One notification flows through the submodules in order: [`memory`] copies what the
//! executor points at (each copy followed by an ID_VALID check), [`unix_path`] resolves and
//! pins a unix socket path, [`cmsg`] rebuilds control messages with the broker's own
//! descriptors, [`perform`] handles each notified syscall (copy, decide, perform) and
//! [`socket`] carries the operation out on the executor's socket without blocking a thread.
//! This module receives the notifications and answers each exactly once.
//!
//! An executor the host gave a synchronous [`Judge`] has its notifications received on a
//! thread of the broker's own, blocked in `poll(2)` on the listener, and each is first
//! handled right there: copied, judged (when the judge decides), performed and answered
//! without leaving the thread. Only a handler that has to wait (for the host's attempt
//! stream, a peer's handshake, room to send) continues as a task on the host's runtime.
//! An executor without one ([`supervise_on_runtime`]) is supervised by a task on the
//! runtime, where its attempts' consumer runs too.
//! The thread is what keeps a notification off the idle CPU: with
//! `SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP` the kernel wakes a waiter of the listener's own wait
//! queue (a `poll`) on the trapping thread's CPU, and the answer wakes the caller on the
//! answering thread's CPU; a wake-up through the runtime's `epoll` loses that hint and
//! lands on whichever CPU is idle, which on a VM whose idle vCPUs halt costs about 20 µs
//! each way (BENCHMARKS.md, "Brokered connect and sendto").

mod as_executor;
mod cmsg;
mod memory;
mod perform;
mod pidfds;
mod socket;
mod unix_path;

use std::collections::HashSet;
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc};

use crate::attempt::{AttemptInfo, EgressAttempt, Judge, Verdict};
use crate::reap::Reap;
use crate::sys::{self, Notification};

/// Notifications of one executor handled at once. Further ones wait in the kernel (the
/// calling threads stay blocked in their syscalls, costing the daemon nothing) until a
/// handler finishes. With the per-notification bounds (see `memory`), this bounds what one executor
/// can make the daemon hold: memory (16 x (4 MiB payload + 64 KiB control)) and
/// descriptors (16 x 253). A handler waiting on the network holds its permit for as long
/// as its caller waits, which stalls only that executor.
pub(crate) const EXECUTOR_HANDLERS: usize = 16;
/// Notifications copied and decided at once across every executor of a broker (the phase
/// that takes bounded time; see `Caller::performing`).
pub(crate) const BROKER_HANDLERS: usize = 128;
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
/// The nice value of a supervision thread (see `supervise`). Measured on the sendto loop
/// (`flowhost-bench broker`): from -10 on, the receiver it wakes no longer preempts it;
/// at -5 it still does.
const SUPERVISOR_NICE: i32 = -10;

/// Counters shared between a supervisor and whoever reports health.
#[derive(Debug, Default)]
pub struct Counters {
    /// Notifications received.
    pub notifications: AtomicU64,
    /// Attempts the host allowed: carried out (whatever their result), or answered as the
    /// kernel would have answered the executor itself (EPERM for a netlink operation that
    /// needs privilege, the lookup's error for a unix path that does not resolve).
    pub allowed: AtomicU64,
    /// Attempts refused.
    pub denied: AtomicU64,
    /// Notifications the broker could not handle (answered with an error).
    pub failed: AtomicU64,
}

/// Shared state of one executor's supervision.
pub(crate) struct Context {
    /// The seccomp listener. Never registered with the runtime's `epoll` (see the module
    /// documentation): only the supervision thread waits on it.
    pub listener: OwnedFd,
    /// The runtime handlers that have to wait continue on.
    pub runtime: tokio::runtime::Handle,
    /// The host's synchronous judge, if it gave one.
    pub judge: Option<Judge>,
    /// Pidfds of the executor's threads, kept while each thread lives.
    pub pidfds: pidfds::Pidfds,
    /// The kernel's facts about the executor's sockets, by cookie.
    pub sockets: socket::KnownSockets,
    pub reap: Arc<Reap>,
    pub attempts: mpsc::Sender<EgressAttempt>,
    pub counters: Arc<Counters>,
    pub broker_counters: Arc<Counters>,
    /// Bounds this executor's notifications in flight ([`EXECUTOR_HANDLERS`]).
    pub handlers: Arc<Semaphore>,
    /// Bounds the broker's notifications in flight ([`BROKER_HANDLERS`]).
    pub broker_handlers: Arc<Semaphore>,
    /// Cookies of this executor's sockets the broker bound (see `Caller::listen`).
    pub bound: std::sync::Mutex<HashSet<u64>>,
    /// Per datagram socket (by cookie), the order of its connects and addressed sends (see
    /// `Caller::datagram_order`).
    pub datagram_order: socket::DatagramOrder,
    /// Descriptors held for this executor's sends (see `cmsg::Held`).
    pub held: cmsg::ExecutorHeld,
    /// Unix socket paths absent from the executor's view (the profile's).
    pub absent_unix_sockets: Arc<Vec<std::path::PathBuf>>,
    /// The host's own listeners (see `Broker::keep_executors_from`).
    pub host_endpoints: Arc<crate::host_endpoints::HostEndpoints>,
    /// Where the executor may make files (its Landlock write paths, as it sees them): a unix
    /// socket the broker binds for it is made only beneath one of these.
    pub bind_roots: Arc<Vec<std::path::PathBuf>>,
    /// The executor's uid and gid when they are not the broker's own (a privileged broker):
    /// operations on its unix sockets are carried out with them (see `as_executor`).
    pub identity: Option<(u32, u32)>,
    /// The broker's O_NONBLOCK toggles on this executor's sockets (see `socket::Toggles`).
    pub toggles: Arc<socket::Toggles>,
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
    /// Whoever started the supervision let go of it (the stop pipe hung up); the caller
    /// kills the executor.
    Stopped,
}

/// How long a supervision thread waits between tries for a handler permit while all of its
/// executor's are taken (its notifications wait in the kernel meanwhile).
const PERMIT_RETRY: Duration = Duration::from_millis(1);

/// Receives notifications until the executor is gone or `stop` hangs up (every copy of its
/// other end closed). Runs on a thread of its own (see the module documentation): each
/// notification is handled on this thread until it completes or has to wait, then finishes
/// as a task on the runtime, so one thread's blocking operation never stalls the others.
pub(crate) fn supervise(ctx: Arc<Context>, stop: OwnedFd) -> End {
    // Handlers create timers and reactor registrations on this thread.
    let _runtime = ctx.runtime.enter();
    // The weight that lets a handler finish what it started: the operation it performs
    // wakes its peer (a datagram's receiver, say), which otherwise preempts this thread
    // before the answer, costing the blocked caller two more switches per notification.
    // Bounded by the caller: the thread only runs while the executor is blocked in a
    // notified syscall. Not permitted (an unprivileged host): the same mediation, slower.
    if let Err(e) = sys::set_thread_nice(SUPERVISOR_NICE) {
        tracing::debug!(error = %e, "supervision thread keeps the default scheduling weight");
    }
    let mut reaped = false;
    loop {
        let listener = ctx.listener.as_fd();
        let mut fds = vec![
            PollFd::new(listener, PollFlags::POLLIN),
            PollFd::new(stop.as_fd(), PollFlags::POLLIN),
        ];
        if !reaped {
            fds.push(PollFd::new(
                ctx.reap.pidfd.get_ref().as_fd(),
                PollFlags::POLLIN,
            ));
        }
        match nix::poll::poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return End::Error(e.into()),
        }
        let revents = |i: usize| {
            fds.get(i)
                .and_then(PollFd::revents)
                .unwrap_or(PollFlags::empty())
        };
        let (on_listener, on_stop, on_exit) = (revents(0), revents(1), revents(2));
        if !on_stop.is_empty() {
            return End::Stopped;
        }
        // The executor exited while descendants (outside a pid namespace) may still use the
        // filter: reap it now, and keep supervising them until the listener hangs up.
        // (Watched once: what a readable pidfd leaves unreaped is retried at hang-up.)
        if !on_exit.is_empty() {
            let _ = ctx.reap.try_reap();
            reaped = true;
        }
        if on_listener.contains(PollFlags::POLLIN) {
            // A permit first: while this executor has none free, its notifications stay
            // queued in the kernel.
            let Some(permit) = executor_permit(&ctx, stop.as_fd()) else {
                return End::Stopped;
            };
            match sys::notif_recv(listener) {
                Ok(n) => {
                    ctx.bump(|c| &c.notifications);
                    run_here_first(&ctx, handle(ctx.clone(), n, permit));
                }
                // The caller died between notification and receipt, or a signal.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINTR)) => {}
                Err(e) => return End::Error(e),
            }
        } else if on_listener
            .intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL)
        {
            // Every task using the filter has exited: reap the executor before supervision
            // ends, so nothing is left as a zombie.
            reap_after_exit(&ctx.reap);
            return End::ExecutorGone;
        }
    }
}

/// One of the executor's handler permits (`None` inside: the semaphore is closed, which
/// never happens while the context lives), waiting for one while all are taken. Returns
/// `None` if `stop` hangs up meanwhile.
fn executor_permit(ctx: &Context, stop: BorrowedFd<'_>) -> Option<Option<OwnedSemaphorePermit>> {
    loop {
        match ctx.handlers.clone().try_acquire_owned() {
            Ok(permit) => return Some(Some(permit)),
            Err(TryAcquireError::Closed) => return Some(None),
            Err(TryAcquireError::NoPermits) => {}
        }
        let mut fd = [PollFd::new(stop, PollFlags::POLLIN)];
        let nap = PollTimeout::try_from(PERMIT_RETRY).unwrap_or(PollTimeout::ZERO);
        if matches!(nix::poll::poll(&mut fd, nap), Ok(n) if n > 0) {
            return None;
        }
    }
}

/// Polls `handler` once on this thread; if it has to wait (the host's attempt stream, the
/// network), it continues as a task on the runtime (tokio's resources take the task's waker
/// at that next poll). A handler that panics is dropped, which refuses its notification
/// (see [`Pending`]). (Measured: polling a waiting handler again here for up to 50 µs
/// before handing it over, to catch a quick verdict from the stream without a second
/// wake-up, made no difference, so it is handed over at once.)
fn run_here_first(ctx: &Context, handler: impl Future<Output = ()> + Send + 'static) {
    let mut handler = Box::pin(handler);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        handler.as_mut().poll(&mut cx)
    }));
    match polled {
        Ok(Poll::Ready(())) => {}
        Ok(Poll::Pending) => drop(ctx.runtime.spawn(handler)),
        Err(_) => tracing::error!("a notification handler panicked; the call was refused"),
    }
}

/// Receives notifications as a task on the runtime until the executor is gone: the shape
/// for an executor without a synchronous judge, whose every attempt goes to its attempt
/// stream. There the handler, the stream's consumer (a task of the same runtime) and the
/// answer stay on one worker; a thread of its own ([`supervise`]) would hand each attempt
/// across threads to the consumer and back, which measured 10-25 µs slower per attempt
/// here (BENCHMARKS.md, "Brokered connect and sendto"). Each notification is handled in
/// its own task, so a blocking operation for one thread never stalls the others.
pub(crate) async fn supervise_on_runtime(ctx: Arc<Context>) -> End {
    let listener = match ctx.listener.try_clone().and_then(sys::async_fd) {
        Ok(l) => l,
        Err(e) => return End::Error(e),
    };
    let mut reaped = false;
    loop {
        tokio::select! {
            ready = listener.readable() => {
                let mut guard = match ready {
                    Ok(g) => g,
                    Err(e) => return End::Error(e),
                };
                loop {
                    let mut fd = [PollFd::new(ctx.listener.as_fd(), PollFlags::POLLIN)];
                    let revents = match nix::poll::poll(&mut fd, PollTimeout::ZERO) {
                        Ok(_) => fd[0].revents().unwrap_or(PollFlags::empty()),
                        Err(nix::errno::Errno::EINTR) => continue,
                        Err(e) => return End::Error(e.into()),
                    };
                    if revents.contains(PollFlags::POLLIN) {
                        // A permit first: while this executor has none free, its
                        // notifications stay queued in the kernel.
                        let permit = ctx.handlers.clone().acquire_owned().await.ok();
                        match sys::notif_recv(ctx.listener.as_fd()) {
                            Ok(n) => {
                                ctx.bump(|c| &c.notifications);
                                tokio::spawn(handle(ctx.clone(), n, permit));
                            }
                            // The caller died between notification and receipt, or a signal.
                            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINTR)) => {}
                            Err(e) => return End::Error(e),
                        }
                    } else if revents
                        .intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL)
                    {
                        // Every task using the filter has exited: reap the executor before
                        // supervision ends, so nothing is left as a zombie.
                        if !reaped {
                            let reap = ctx.reap.clone();
                            let _ = tokio::task::spawn_blocking(move || reap_after_exit(&reap)).await;
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
fn reap_after_exit(reap: &Reap) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if !matches!(reap.try_reap(), Ok(None)) {
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            tracing::warn!("an executor whose tasks all exited could not be reaped within 5 s");
            return;
        }
        let mut fd = [PollFd::new(reap.pidfd.get_ref().as_fd(), PollFlags::POLLIN)];
        let _ = nix::poll::poll(
            &mut fd,
            PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX),
        );
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
        let fd = self.ctx.listener.as_fd();
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
            let _ = sys::notif_send(self.ctx.listener.as_fd(), self.id, 0, -libc::EIO);
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
    // released before the operation is performed (see `Caller::performing`), and while a
    // send waits for its socket's handshake before it is decided (`Caller::unshared`), so
    // executors whose sends wait on silent peers cannot hold it and stall everyone else's
    // egress.
    let shared = ctx.broker_handlers.clone().acquire_owned().await.ok();
    let caller = Caller {
        ctx: &ctx,
        n,
        shared: std::sync::Mutex::new(shared),
        waited: std::sync::atomic::AtomicBool::new(false),
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

/// One notification being handled: the executor's thread that waits on it, and the
/// broker-wide permit it holds while copying and deciding.
struct Caller<'a> {
    ctx: &'a Context,
    n: Notification,
    /// The broker-wide permit, held until the operation is performed, but for a send's wait
    /// for its handshake (`Caller::unshared`).
    shared: std::sync::Mutex<Option<OwnedSemaphorePermit>>,
    /// Whether a verdict was awaited from the host's attempt stream (time passed since the
    /// last validity check; see `Caller::performing`).
    waited: std::sync::atomic::AtomicBool,
}

impl Caller<'_> {
    /// Has the host decide the attempt: its synchronous judge if it has one and that
    /// decides, else its attempt stream, waiting for the verdict. No consumer, or a consumer
    /// that drops the attempt, is a refusal.
    async fn decide(&self, mut info: AttemptInfo) -> Verdict {
        let judged = self.ctx.judge.as_ref().and_then(|judge| judge(&info));
        let v = match judged {
            Some(v) => v,
            None => {
                self.waited.store(true, Ordering::Relaxed);
                // The stream's consumers record it with the attempt, so it is kept only if
                // the caller still waited after it was read: a waiting thread cannot end,
                // so its pid then still named it (not a process that reused the number).
                info.executable =
                    sys::executable_of(self.n.pid).filter(|_| self.still_waiting().is_ok());
                let (attempt, verdict) = EgressAttempt::new(info);
                if self.ctx.attempts.send(attempt).await.is_err() {
                    self.ctx.bump(|c| &c.denied);
                    return Verdict::DENY;
                }
                verdict.await.unwrap_or(Verdict::DENY)
            }
        };
        match v {
            Verdict::Allow => self.ctx.bump(|c| &c.allowed),
            Verdict::Deny { .. } => self.ctx.bump(|c| &c.denied),
        }
        v
    }
}

fn to_outcome(r: io::Result<i64>) -> Outcome {
    match r {
        Ok(v) => Outcome::Value(v),
        Err(e) => Outcome::Errno(errno_of(&e)),
    }
}
