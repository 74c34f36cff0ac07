//! The per-executor supervisor: receives seccomp notifications, turns each into one or more
//! [`EgressAttempt`]s, waits for the host's verdict, and performs the operation itself.
//!
//! The TOCTOU rule: a decision that depended on memory the executor points at is never
//! answered with CONTINUE. The broker copies the address (and for sends the payload and
//! control data) once, with `SECCOMP_IOCTL_NOTIF_ID_VALID` checked before and after the copy,
//! decides on that copy, takes the executor's socket with `pidfd_getfd`, performs the syscall
//! itself with the copy, and returns the result. Later writes by the executor to its own
//! memory change nothing.
//!
//! One notification flows through the submodules in order: [`memory`] copies what the
//! executor points at (each copy bracketed by ID_VALID checks), [`unix_path`] resolves and
//! pins a unix socket path, [`cmsg`] rebuilds control messages with the broker's own
//! descriptors, [`perform`] handles each notified syscall (copy, decide, perform) and
//! [`socket`] carries the operation out on the executor's socket without blocking a thread.
//! This module receives the notifications and answers each exactly once.

mod cmsg;
mod memory;
mod perform;
mod socket;
mod unix_path;

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::unix::AsyncFd;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::attempt::{AttemptInfo, EgressAttempt, Verdict};
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
    /// Unix socket paths absent from the executor's view (the profile's).
    pub absent_unix_sockets: Arc<Vec<std::path::PathBuf>>,
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
                    let revents = sys::poll_in_now(ctx.listener.get_ref().as_fd());
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
async fn reap_after_exit(reap: &Reap) {
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

/// One notification being handled: the executor's thread that waits on it, and the
/// broker-wide permit it holds while copying and deciding.
struct Caller<'a> {
    ctx: &'a Context,
    n: Notification,
    /// The broker-wide permit, held until the operation is performed.
    shared: std::sync::Mutex<Option<OwnedSemaphorePermit>>,
}

impl Caller<'_> {
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
}

fn to_outcome(r: io::Result<i64>) -> Outcome {
    match r {
        Ok(v) => Outcome::Value(v),
        Err(e) => Outcome::Errno(errno_of(&e)),
    }
}
