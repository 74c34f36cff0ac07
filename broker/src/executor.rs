//! The handle to a running executor: its pid and pidfd, stdio pipes, the stream of egress
//! attempts, and kill/wait with deadlines.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::attempt::EgressAttempt;
use crate::cgroup::BoundHit;
use crate::reap::{Reap, ReaperJob};
use crate::supervisor::Counters;
use crate::sys::{self, WaitStatus};

/// How an executor ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code or terminating signal.
    pub status: WaitStatus,
    /// Whether the broker killed it for exceeding its wall-clock limit.
    pub timed_out: bool,
    /// The whole-executor bound its cgroup recorded it running into, if any.
    pub bound: Option<BoundHit>,
}

impl ExitStatus {
    /// The conventional shell code: the exit code, or 128 + the signal number.
    pub fn code(&self) -> i32 {
        match self.status {
            WaitStatus::Exited(c) => c,
            WaitStatus::Signaled(s) => 128 + s,
        }
    }

    /// Exited with code 0.
    pub fn success(&self) -> bool {
        self.status == WaitStatus::Exited(0)
    }

    /// The terminating signal, if any.
    pub fn signal(&self) -> Option<i32> {
        match self.status {
            WaitStatus::Signaled(s) => Some(s),
            WaitStatus::Exited(_) => None,
        }
    }

    /// Which bound ended (or hampered) the executor, in words an operator can act on:
    /// the wall clock, a whole-executor bound of its cgroup, or a per-process rlimit whose
    /// signal killed it. `None` when no bound is to blame.
    pub fn bound_description(&self) -> Option<String> {
        if self.timed_out {
            return Some("the wall-clock limit: the broker killed it".into());
        }
        if let Some(hit) = self.bound {
            return Some(hit.to_string());
        }
        match self.signal() {
            Some(libc::SIGXCPU) => Some(
                "the CPU-time limit (RLIMIT_CPU, limits.cpu_seconds): the kernel sent SIGXCPU"
                    .into(),
            ),
            Some(libc::SIGXFSZ) => Some(
                "the file-size limit (RLIMIT_FSIZE, limits.file_size_mib): the kernel sent SIGXFSZ"
                    .into(),
            ),
            _ => None,
        }
    }
}

/// A running executor. Dropping the handle kills the executor and its whole process tree
/// (the executor is pid 1 of its own pid namespace when the profile asks for one) and reaps
/// it in the background.
pub struct Executor {
    pub(crate) pid: i32,
    pub(crate) pidfd: Arc<AsyncFd<OwnedFd>>,
    pub(crate) reap: Arc<Reap>,
    pub(crate) stdin: Option<pipe::Sender>,
    pub(crate) stdout: Option<pipe::Receiver>,
    pub(crate) stderr: Option<pipe::Receiver>,
    pub(crate) attempts: Option<mpsc::Receiver<EgressAttempt>>,
    pub(crate) exit: Option<ExitStatus>,
    pub(crate) timed_out: Arc<AtomicBool>,
    pub(crate) watchdog: Option<JoinHandle<()>>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) reaper: std::sync::mpsc::Sender<ReaperJob>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("pid", &self.pid)
            .field("exit", &self.exit)
            .finish()
    }
}

impl Executor {
    /// The executor's pid in the host's pid namespace.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Takes the executor's standard input (once).
    pub fn take_stdin(&mut self) -> Option<pipe::Sender> {
        self.stdin.take()
    }

    /// Takes the executor's standard output (once).
    pub fn take_stdout(&mut self) -> Option<pipe::Receiver> {
        self.stdout.take()
    }

    /// Takes the executor's standard error (once).
    pub fn take_stderr(&mut self) -> Option<pipe::Receiver> {
        self.stderr.take()
    }

    /// Takes the stream of egress attempts (once). Attempts must be answered; while nobody
    /// holds the stream, and after it is dropped, every attempt is refused.
    pub fn take_attempts(&mut self) -> Option<mpsc::Receiver<EgressAttempt>> {
        self.attempts.take()
    }

    /// Counters of this executor's notifications and verdicts.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Sends SIGKILL to the executor (its pid namespace dies with it).
    pub fn kill(&self) -> io::Result<()> {
        sys::pidfd_send_signal(self.pidfd.get_ref().as_fd(), libc::SIGKILL)
    }

    /// Waits for the executor to exit and reaps it.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(s) = self.exit {
            return Ok(s);
        }
        let pidfd = self.pidfd.clone();
        loop {
            let mut guard = pidfd.readable().await?;
            if let Some(exit) = self.try_wait()? {
                return Ok(exit);
            }
            guard.clear_ready();
        }
    }

    /// Waits at most `deadline`; `None` when the executor is still running.
    pub async fn wait_timeout(&mut self, deadline: Duration) -> io::Result<Option<ExitStatus>> {
        match tokio::time::timeout(deadline, self.wait()).await {
            Ok(r) => r.map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Kills the executor and waits (at most `deadline`) for it to be reaped.
    pub async fn kill_and_wait(&mut self, deadline: Duration) -> io::Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            self.kill()?;
        }
        self.wait_timeout(deadline).await
    }

    /// Whether the executor has been reaped.
    pub fn exited(&self) -> Option<ExitStatus> {
        self.exit
    }

    /// Reaps the executor if it has exited, without waiting.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.exit.is_none()
            && let Some((status, bound)) = self.reap.try_reap()?
        {
            self.exit = Some(ExitStatus {
                status,
                timed_out: self.timed_out.load(Ordering::SeqCst),
                bound,
            });
            if let Some(w) = self.watchdog.take() {
                w.abort();
            }
        }
        Ok(self.exit)
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        if let Some(w) = self.watchdog.take() {
            w.abort();
        }
        if self.exit.is_none() {
            let _ = self.kill();
            // Reaped by the broker's reaper thread, so no zombie is left behind.
            let _ = self.reaper.send(ReaperJob::Wait(self.reap.clone()));
        }
    }
}
