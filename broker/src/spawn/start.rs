//! Starting a prepared child: `clone` with the profile's namespaces on the spawner thread,
//! and the handshake that takes its seccomp listener and lets it exec.

use std::ffi::CString;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use crate::cgroup;
use crate::child::{self, ChildPlan};
use crate::stage::{READY, STARTED, Stage};
use crate::sys;

use super::prepare::pipe;
use super::{Prepared, SpawnError};

/// A cloned child whose filter is installed and whose listener the host now holds. Dropped
/// before [`Started::supervise`] took it (its caller gave up between the spawn and reading
/// its answer), it kills the child and reaps it: an executor nobody supervises must not run
/// on, nor its uid be handed out again while it does.
pub(crate) struct Started {
    pid: libc::pid_t,
    /// `None` once taken by [`Started::supervise`].
    owned: Option<(OwnedFd, OwnedFd)>,
    /// The executor's uid and cgroups (see [`Started::holding`]): released only once it
    /// is reaped.
    lease: Option<crate::reap::LeaseGuard>,
}

impl Started {
    /// This child, holding `lease` (its uid and cgroups): if nobody supervises it, the
    /// lease goes back only after the child is killed and reaped, never while it may run.
    pub(crate) fn holding(mut self, lease: crate::reap::LeaseGuard) -> Self {
        self.lease = Some(lease);
        self
    }

    /// The child's pid, its pidfd, its notification listener and the lease it holds, for
    /// the caller to supervise: from here on, killing it on failure (and releasing the
    /// lease only after) is the caller's duty.
    pub(crate) fn supervise(
        mut self,
    ) -> (
        libc::pid_t,
        OwnedFd,
        OwnedFd,
        Option<crate::reap::LeaseGuard>,
    ) {
        match self.owned.take() {
            Some((pidfd, listener)) => (self.pid, pidfd, listener, self.lease.take()),
            // Only `supervise` (which consumes `self`) takes them.
            None => unreachable!("a Started is supervised once"),
        }
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if let Some((pidfd, _listener)) = self.owned.take() {
            let _ = sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
            // Reaped on a thread of its own: this may run on an async worker, and a pid
            // namespace's first process is reaped only once every process in it has died
            // (one in an uninterruptible wait takes its time). Killed, none runs on; its
            // uid and cgroups go back after.
            let lease = self.lease.take();
            let reap = move || {
                let _ = sys::waitid_pidfd(pidfd.as_fd(), true);
                drop(lease);
            };
            if let Err(e) = std::thread::Builder::new()
                .name("flowhost-reap-unsupervised".into())
                .spawn(reap)
            {
                tracing::warn!(
                    pid = self.pid,
                    "an executor nobody supervises was killed but cannot be reaped: {e}"
                );
            }
        }
    }
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

/// The executor cgroups the spawner thread is inside while it clones; it leaves them when
/// dropped if [`Inside::leave`] was not called (an early return).
#[derive(Default)]
struct Inside {
    dirs: Vec<PathBuf>,
}

impl Inside {
    /// Moves this thread back to each cgroup's parent, the broker's own cgroup of that
    /// hierarchy.
    fn leave(&mut self) -> Result<(), SpawnError> {
        let mut failed = None;
        for dir in self.dirs.drain(..).rev() {
            let back = dir.parent().unwrap_or(&dir);
            if let Err(e) = cgroup::move_this_thread(back) {
                failed.get_or_insert(format!(
                    "the spawner thread cannot return to {} from the executor's cgroup: {e}",
                    back.display()
                ));
            }
        }
        failed.map_or(Ok(()), |why| Err(SpawnError::Cgroup(why)))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let _ = self.leave();
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
        controlling_terminal: prepared.controlling_terminal,
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
        bind_files: prepared.bind_files.clone(),
        read_only_view: prepared.read_only_view.clone(),
        hostname: prepared.hostname.clone(),
        identity: prepared.identity,
        rlimits: prepared.rlimits.clone(),
        landlock_fd: prepared.landlock.as_ref().map(|fd| fd.as_raw_fd()),
        landlock_late: prepared.landlock_late.clone(),
        filter: prepared.filter.clone(),
        ignored_signals: prepared.ignored_signals,
    };
    let mut stack = vec![0u8; CHILD_STACK];
    let pidfd_cell = Arc::new(AtomicI32::new(-1));
    let (reply, handshake) = std::sync::mpsc::sync_channel(1);
    // The child is born in the executor's v1 cgroups (see `Placement`); a cgroup this
    // thread cannot enter takes the child's pid before it may exec instead.
    let mut inside = Inside::default();
    let mut cgroup_procs = prepared.cgroup.procs.clone();
    for dir in &prepared.cgroup.born_in {
        match cgroup::move_this_thread(dir) {
            Ok(()) => inside.dirs.push(dir.clone()),
            Err(_) => cgroup_procs.push(dir.join("cgroup.procs")),
        }
    }
    handshakes
        .send(HandshakeJob {
            status_r,
            go_w,
            pidfd: pidfd_cell.clone(),
            user_namespace: prepared.user_namespace,
            cgroup_procs,
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
    // Back to the broker's own cgroups before anything else: this thread must not count
    // against, or hold open, an executor's cgroup.
    let outcome = inside.leave().and(outcome);
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
            owned: Some((pidfd, listener)),
            lease: None,
        }),
        Err(e) => {
            let _ = sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
            let _ = sys::waitid_pidfd(pidfd.as_fd(), true);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child whose answer its caller never took is killed and reaped when the answer is
    /// dropped: before, a caller that gave up after the answer was sent (a call cancelled
    /// while its executor started) left it running, unsupervised, its uid free again.
    #[test]
    fn a_started_child_nobody_supervises_is_killed_and_reaped() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as libc::pid_t;
        let pidfd = sys::pidfd_open(pid).unwrap();
        let listener = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let (reaper, released) = std::sync::mpsc::channel();
        let lease = crate::reap::LeaseGuard::new(crate::reap::Lease::default(), reaper);
        drop(
            Started {
                pid,
                owned: Some((pidfd, listener)),
                lease: None,
            }
            .holding(lease),
        );
        // Its lease (uid, cgroups) goes back only once it is reaped: before, a caller that
        // gave up while it started released the lease at once, and another executor could
        // be given its uid while it still ran.
        let job = released.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(matches!(job, crate::reap::ReaperJob::Release(_)));
        // SAFETY: signal 0 only checks that the pid exists.
        let exists = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!exists, "the lease went back before the child was reaped");
        assert!(child.try_wait().is_err(), "the child was not reaped");
    }
}
