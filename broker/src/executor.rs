//! The handle to a running executor: its pid and pidfd, stdio pipes, the stream of egress
//! attempts, and kill/wait with deadlines.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
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
            // The filter kills a process that makes a system call of another architecture
            // (i386 `int 0x80`) or of the x32 ABI: a way around the broker, tried. What it
            // would have done after is not observed either.
            Some(libc::SIGSYS) => Some(
                "the seccomp filter (SIGSYS): it made a system call of another architecture \
                 or of the x32 ABI, which the filter kills"
                    .into(),
            ),
            _ => None,
        }
    }
}

/// A signal a terminal or a service manager sends to make a command stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interrupt {
    /// SIGHUP: the terminal went away.
    Hangup,
    /// SIGINT: Ctrl-C.
    Interrupt,
    /// SIGQUIT: Ctrl-Backslash.
    Quit,
    /// SIGTERM: asked to stop.
    Terminate,
}

impl Interrupt {
    /// Every interrupt, in signal-number order.
    pub const ALL: [Interrupt; 4] = [
        Interrupt::Hangup,
        Interrupt::Interrupt,
        Interrupt::Quit,
        Interrupt::Terminate,
    ];

    /// The signal number.
    pub fn signal(self) -> i32 {
        match self {
            Interrupt::Hangup => libc::SIGHUP,
            Interrupt::Interrupt => libc::SIGINT,
            Interrupt::Quit => libc::SIGQUIT,
            Interrupt::Terminate => libc::SIGTERM,
        }
    }

    /// Whether a terminal's key sends it (Ctrl-C, Ctrl-Backslash) to the terminal's
    /// foreground process group.
    fn sent_by_a_key(self) -> bool {
        matches!(self, Interrupt::Interrupt | Interrupt::Quit)
    }

    /// The signal's name, as `kill -l` spells it with the `SIG` prefix.
    pub fn name(self) -> &'static str {
        match self {
            Interrupt::Hangup => "SIGHUP",
            Interrupt::Interrupt => "SIGINT",
            Interrupt::Quit => "SIGQUIT",
            Interrupt::Terminate => "SIGTERM",
        }
    }
}

/// What a process does with a signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Disposition {
    /// It has a handler.
    Handled,
    /// It ignores it.
    Ignored,
    /// It leaves it to the default action.
    Default,
}

/// Where a key's signal goes when the executor has a terminal of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TerminalDelivery {
    /// To the executor alone, as without a terminal.
    Executor,
    /// The executor is killed with everything it started.
    Kill,
    /// To the terminal's foreground process group.
    Group,
}

/// Where a key's signal goes: `group` is the terminal's foreground process group (0: none),
/// `executor` the executor's disposition when the executor is in that group.
fn on_terminal(group: i32, executor: Option<Disposition>) -> TerminalDelivery {
    match (group, executor) {
        (0, _) => TerminalDelivery::Executor,
        // The kernel would not end a pid namespace's first process: it is ended as the
        // default action would end it, and its namespace with it.
        (_, Some(Disposition::Default)) => TerminalDelivery::Kill,
        _ => TerminalDelivery::Group,
    }
}

/// What an [`Interrupt`] did to the executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// The executor handles the signal: it was sent, and the executor decides what follows.
    Sent,
    /// The executor ignores the signal: nothing was sent.
    Ignored,
    /// The executor leaves the signal to its default action, which ends a process: it was
    /// killed, with everything it started.
    Ended,
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

    /// Takes the stream of egress attempts (once). Attempts must be answered. Until it is
    /// taken, attempts wait in it (the executor's calls with them), so take it as soon as
    /// the executor is spawned; once it is dropped, every attempt is refused.
    pub fn take_attempts(&mut self) -> Option<mpsc::Receiver<EgressAttempt>> {
        self.attempts.take()
    }

    /// Counters of this executor's notifications and verdicts.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Sends SIGKILL to the executor. Its whole tree ends with it: with its pid namespace
    /// (pid 1's death kills every process in it) or, for a profile without one, with its
    /// cgroup, whose processes are killed once the executor is reaped (a profile without a
    /// pid namespace is refused where its executors get no cgroup: see
    /// [`crate::Broker::check_profile`]).
    pub fn kill(&self) -> io::Result<()> {
        sys::pidfd_send_signal(self.pidfd.get_ref().as_fd(), libc::SIGKILL)
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) the executor's process group: job control
    /// for a caller that was suspended. The executor leads a session of its own, so the
    /// caller's terminal's stop never reaches it. A process that made a group of its own is
    /// not reached; on a terminal of its own ([`crate::SpawnSpec::terminal`]) it can read
    /// only what the host relays, which a stopped host does not.
    pub fn job_control(&self, stop: bool) -> io::Result<()> {
        use nix::sys::signal::{Signal, killpg};
        let signal = if stop {
            Signal::SIGSTOP
        } else {
            Signal::SIGCONT
        };
        // The supervisor reaps the executor as soon as it exits: once it has, its pid may
        // name another process's group, so nothing is signalled. Until then the number names
        // this executor, which leads its group.
        self.reap
            .while_unreaped(|| killpg(nix::unistd::Pid::from_raw(self.pid), signal))?
            .unwrap_or(Ok(()))
            .map_err(io::Error::from)
    }

    /// Delivers `interrupt` as the kernel would to a process outside a pid namespace: sent
    /// if the executor handles it, dropped if it ignores it, and otherwise the executor is
    /// killed, since the default action of each interrupt ends a process. The executor is
    /// pid 1 of its own pid namespace under most profiles, and the kernel never delivers a
    /// signal to such a process from outside unless it handles it: sent plainly, a Ctrl-C
    /// would be lost. A signal the executor blocks but does not handle ends it at once.
    pub fn interrupt(&self, interrupt: Interrupt) -> io::Result<Delivery> {
        if self.exit.is_some() {
            return Ok(Delivery::Ignored);
        }
        match self.disposition(interrupt)? {
            Disposition::Handled => {
                sys::pidfd_send_signal(self.pidfd.get_ref().as_fd(), interrupt.signal())?;
                Ok(Delivery::Sent)
            }
            Disposition::Ignored => Ok(Delivery::Ignored),
            Disposition::Default => {
                self.kill()?;
                Ok(Delivery::Ended)
            }
        }
    }

    /// Delivers `interrupt` as the executor's own terminal would: `master` is the master of
    /// the pseudo-terminal that is the executor's controlling terminal
    /// ([`crate::SpawnSpec::terminal`]). SIGINT and SIGQUIT, the signals of the terminal's
    /// keys, go to every process of the terminal's foreground process group (`TIOCSIG`), as
    /// the key would send them; when the executor itself is in that group, the rule of
    /// [`Executor::interrupt`] still applies to it (left to its default action, it is killed
    /// with everything it started, which the kernel would not do for a pid namespace's first
    /// process). SIGHUP and SIGTERM, which no key sends, go to the executor as
    /// [`Executor::interrupt`] sends them.
    pub fn interrupt_on_terminal(
        &self,
        interrupt: Interrupt,
        master: BorrowedFd<'_>,
    ) -> io::Result<Delivery> {
        if self.exit.is_some() {
            return Ok(Delivery::Ignored);
        }
        if !interrupt.sent_by_a_key() {
            return self.interrupt(interrupt);
        }
        // No foreground group (0): the terminal would signal nobody; the executor is still
        // asked, as without a terminal.
        let group = nix::unistd::tcgetpgrp(master)
            .map_err(io::Error::from)?
            .as_raw();
        let disposition = if group == self.pid {
            Some(self.disposition(interrupt)?)
        } else {
            None
        };
        match on_terminal(group, disposition) {
            TerminalDelivery::Executor => self.interrupt(interrupt),
            TerminalDelivery::Kill => {
                self.kill()?;
                Ok(Delivery::Ended)
            }
            TerminalDelivery::Group => {
                sys::terminal_signal(master, interrupt.signal())?;
                Ok(Delivery::Sent)
            }
        }
    }

    /// What the executor does with `interrupt`, read from `/proc/PID/status`.
    fn disposition(&self, interrupt: Interrupt) -> io::Result<Disposition> {
        // Read while the executor is not reaped, so the pid cannot name another process;
        // once it is, it handles nothing.
        let Some(status) = self.reap.while_unreaped(|| {
            procfs::process::Process::new(self.pid)
                .and_then(|p| p.status())
                .map_err(|e| io::Error::other(format!("reading /proc/{}/status: {e}", self.pid)))
        })?
        else {
            return Ok(Disposition::Ignored);
        };
        let status = status?;
        let bit = 1u64 << (interrupt.signal() - 1);
        Ok(if status.sigcgt & bit != 0 {
            Disposition::Handled
        } else if status.sigign & bit != 0 {
            Disposition::Ignored
        } else {
            Disposition::Default
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A key's signal goes to the terminal's foreground job; the executor, when it is in that
    /// job and leaves the signal to its default action, is ended (the kernel would drop it
    /// for a pid namespace's first process); with no foreground job, the executor is asked.
    #[test]
    fn a_keys_signal_goes_to_the_foreground_job_with_the_pid_1_rule() {
        use Disposition::*;
        assert_eq!(on_terminal(0, None), TerminalDelivery::Executor);
        assert_eq!(on_terminal(0, Some(Handled)), TerminalDelivery::Executor);
        assert_eq!(on_terminal(42, Some(Default)), TerminalDelivery::Kill);
        assert_eq!(on_terminal(42, Some(Handled)), TerminalDelivery::Group);
        assert_eq!(on_terminal(42, Some(Ignored)), TerminalDelivery::Group);
        // The executor is not in the foreground job: the job gets it, as from a terminal.
        assert_eq!(on_terminal(43, None), TerminalDelivery::Group);
        assert!(Interrupt::Interrupt.sent_by_a_key() && Interrupt::Quit.sent_by_a_key());
        assert!(!Interrupt::Hangup.sent_by_a_key() && !Interrupt::Terminate.sent_by_a_key());
    }
}
