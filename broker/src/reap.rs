//! What an executor holds while it lives (its own uid and cgroup) and how it is collected
//! once it has exited: reaped at most once, by whichever of its handle, its supervisor or
//! the broker's reaper thread sees the exit first, with its lease released after.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;

use crate::cgroup::{BoundHit, CgroupSupport, ExecutorCgroup, Placement};
use crate::sys::{self, WaitStatus};
use crate::uids::UidLease;

/// What an executor holds while it lives: its own uid and its cgroup.
#[derive(Debug, Default)]
pub(crate) struct Lease {
    pub(crate) uid: Option<UidLease>,
    pub(crate) cgroup: Option<ExecutorCgroup>,
}

/// Work for the broker's reaper thread.
pub(crate) enum ReaperJob {
    /// Wait for a killed executor whose handle was dropped, so no zombie is left.
    Wait(Arc<Reap>),
    /// Remove an ended executor's cgroup (killing what is left in it), then return its uid.
    Release(Lease),
    /// Remove what brokers that are gone left beneath the cgroup bases.
    Sweep(Arc<CgroupSupport>),
    /// Answer once every job sent before this one is done (a wait for a killed executor
    /// runs on a thread of its own: the release it leads to follows once the executor has
    /// exited, perhaps after this answer).
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// How long the reaper waits for what is left of an executor's cgroup to go.
const CGROUP_REMOVAL: Duration = Duration::from_secs(10);

impl ReaperJob {
    pub(crate) fn run(self) {
        match self {
            ReaperJob::Wait(reap) => {
                // On a thread of its own: a killed executor can take as long as it likes to
                // exit (a process of it in uninterruptible sleep, on a hung mount), and the
                // reaper's other jobs (every other executor's cgroup and uid) must not wait
                // behind it. Done here only if no thread can be had.
                let waiting = reap.clone();
                let spawned = std::thread::Builder::new()
                    .name("flowhost-reap-wait".into())
                    .spawn(move || wait_and_reap(&waiting));
                if spawned.is_err() {
                    wait_and_reap(&reap);
                }
            }
            ReaperJob::Release(lease) => {
                let gone = lease
                    .cgroup
                    .as_ref()
                    .is_none_or(|c| c.remove(CGROUP_REMOVAL));
                if gone {
                    drop(lease.uid);
                } else if let Some(uid) = lease.uid {
                    // Something of the executor may still run as this uid: it is never
                    // handed to another executor while this broker lives.
                    tracing::warn!(
                        uid = uid.uid(),
                        "an executor's cgroup outlived it; its uid stays reserved"
                    );
                    std::mem::forget(uid);
                }
            }
            ReaperJob::Sweep(cgroups) => cgroups.sweep_stale(),
            ReaperJob::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// Waits until the killed executor `reap` has exited (its pidfd readable), then reaps it,
/// which hands its lease back to the reaper.
fn wait_and_reap(reap: &Reap) {
    let mut fd = [nix::poll::PollFd::new(
        reap.pidfd.get_ref().as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    while let Err(nix::errno::Errno::EINTR) = nix::poll::poll(&mut fd, nix::poll::PollTimeout::NONE)
    {
    }
    let _ = reap.try_reap();
}

/// A [`Lease`] that goes to the reaper thread for release when dropped, on every path.
pub(crate) struct LeaseGuard {
    lease: Option<Lease>,
    reaper: std::sync::mpsc::Sender<ReaperJob>,
}

impl LeaseGuard {
    pub(crate) fn new(lease: Lease, reaper: std::sync::mpsc::Sender<ReaperJob>) -> Self {
        LeaseGuard {
            lease: Some(lease),
            reaper,
        }
    }

    /// Adds the executor's cgroups, released with the rest.
    pub(crate) fn hold_cgroup(&mut self, cgroup: ExecutorCgroup) {
        if let Some(lease) = self.lease.as_mut() {
            lease.cgroup = Some(cgroup);
        }
    }

    /// Adds the uid leased for the executor, which may come after its cgroups were made.
    pub(crate) fn hold_uid(&mut self, uid: UidLease) {
        if let Some(lease) = self.lease.as_mut() {
            lease.uid = Some(uid);
        }
    }

    /// The leased uid, if any.
    pub(crate) fn uid(&self) -> Option<u32> {
        self.lease.as_ref()?.uid.as_ref().map(UidLease::uid)
    }

    /// How the executor enters its cgroups before it may exec.
    pub(crate) fn placement(&self) -> Placement {
        self.lease
            .as_ref()
            .and_then(|l| l.cgroup.as_ref())
            .map(ExecutorCgroup::placement)
            .unwrap_or_default()
    }

    fn hit(&self) -> Option<BoundHit> {
        self.lease.as_ref()?.cgroup.as_ref()?.hit()
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            let _ = self.reaper.send(ReaperJob::Release(lease));
        }
    }
}

/// The executor's pidfd and, once reaped, how it ended. Shared by the handle and the
/// supervisor, which reaps the executor as soon as it exits so no zombie outlives it,
/// whether or not anyone waits on the handle.
pub(crate) struct Reap {
    pub(crate) pidfd: Arc<AsyncFd<OwnedFd>>,
    status: std::sync::Mutex<Option<(WaitStatus, Option<BoundHit>)>>,
    lease: std::sync::Mutex<Option<LeaseGuard>>,
    /// The executor's CPU-time limit (`limits.cpu_seconds`).
    cpu_seconds: u64,
}

impl Reap {
    pub(crate) fn new(pidfd: Arc<AsyncFd<OwnedFd>>, lease: LeaseGuard, cpu_seconds: u64) -> Self {
        Reap {
            pidfd,
            status: std::sync::Mutex::new(None),
            lease: std::sync::Mutex::new(Some(lease)),
            cpu_seconds,
        }
    }

    /// Runs `f` while the executor is not reaped, holding off any reaping until it returns:
    /// `None` (and `f` not run) once it has been. Its pid names it for as long as `f` runs
    /// (a zombie keeps its pid), so `f` may act on the number.
    pub(crate) fn while_unreaped<T>(&self, f: impl FnOnce() -> T) -> io::Result<Option<T>> {
        let status = self
            .status
            .lock()
            .map_err(|_| io::Error::other("reap state poisoned"))?;
        Ok(status.is_none().then(f))
    }

    /// Reaps the executor if it has exited (at most once), and returns how it ended and
    /// which whole-executor bound it ran into. Once reaped, its cgroup and uid are released.
    pub(crate) fn try_reap(&self) -> io::Result<Option<(WaitStatus, Option<BoundHit>)>> {
        let mut status = self
            .status
            .lock()
            .map_err(|_| io::Error::other("reap state poisoned"))?;
        if status.is_none()
            && let Some((ended, cpu)) = sys::waitid_pidfd_cpu(self.pidfd.get_ref().as_fd(), false)?
        {
            let lease = self.lease.lock().ok().and_then(|mut l| l.take());
            let hit = lease.as_ref().and_then(LeaseGuard::hit).or_else(|| {
                // The CPU-time rlimit's soft and hard limits are one: the kernel kills with
                // SIGKILL, which says nothing by itself. A SIGKILL no cgroup bound explains,
                // of an executor that used its whole CPU time, is that limit's. The usage
                // waitid reports runs a little below the clock the limit is checked on
                // (992.6 ms for a 1 s limit here), so within 5 % (at least 100 ms) counts.
                let limit = std::time::Duration::from_secs(self.cpu_seconds);
                let slack = (limit / 20).max(std::time::Duration::from_millis(100));
                (ended == WaitStatus::Signaled(libc::SIGKILL) && cpu + slack >= limit).then_some(
                    BoundHit::CpuTime {
                        seconds: self.cpu_seconds,
                    },
                )
            });
            *status = Some((ended, hit));
        }
        Ok(*status)
    }
}
