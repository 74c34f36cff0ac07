//! The outcome of each reload, kept where `flowhost reload` can wait for it.
//!
//! A reload is requested with SIGHUP, which is asynchronous: the sender learns nothing. So
//! the daemon writes a verdict for every reload (accepted or refused, and why) to
//! [`VERDICT_FILE`] in its state directory, stamped with its pid and the monotonic time the
//! reload began. [`request`] sends SIGHUP and waits for a verdict from that pid that began
//! after the request; systemd's `ExecReload=` runs it, so a refused reload fails
//! `systemctl reload` (on systemd versions without `Type=notify-reload` too).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// The verdict file's name inside `state_dir`.
pub const VERDICT_FILE: &str = "reload-verdict.json";

/// The outcome of one reload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadVerdict {
    /// The daemon that reloaded.
    pub pid: u32,
    /// CLOCK_MONOTONIC, in microseconds, when the daemon began the reload.
    pub started_usec: u64,
    /// Whether the new configuration now serves.
    pub accepted: bool,
    /// The generation now serving (the new one when accepted).
    pub generation: u64,
    /// What happened, in words (the refusal's reason when refused).
    pub message: String,
}

/// Why `flowhost reload` has no verdict to report.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The monotonic clock could not be read.
    #[error("cannot read the monotonic clock")]
    Clock,
    /// Pid 1 is not a flowhost daemon (on a normal host it is init, for which SIGHUP means
    /// reloading its own configuration).
    #[error("pid 1 is {comm:?}, not a flowhost daemon; give the daemon's pid")]
    NotTheDaemon {
        /// What pid 1 runs.
        comm: String,
    },
    /// SIGHUP could not be sent.
    #[error("cannot signal the daemon (pid {pid}): {source}")]
    Signal {
        /// The daemon's pid.
        pid: i32,
        /// The error.
        source: nix::Error,
    },
    /// The daemon exited before answering.
    #[error("the daemon (pid {pid}) exited before reporting the reload's outcome")]
    Gone {
        /// The daemon's pid.
        pid: i32,
    },
    /// No verdict arrived in time; the reload is treated as failed.
    #[error(
        "no verdict from the daemon (pid {pid}) in {path} within {timeout:?}{}; treating the \
         reload as failed, though the daemon may still be starting the new configuration's \
         executors and then apply it (the journal says what the daemon did)",
        unreadable.as_ref().map(|why| format!(" (the file could not be read: {why})")).unwrap_or_default()
    )]
    Timeout {
        /// The daemon's pid.
        pid: i32,
        /// The verdict file waited on.
        path: PathBuf,
        /// How long it waited.
        timeout: Duration,
        /// Why the file, when it was there, could not be read or parsed, last time it was
        /// tried.
        unreadable: Option<String>,
    },
}

/// CLOCK_MONOTONIC in microseconds (the clock systemd's `MONOTONIC_USEC=` uses).
pub fn monotonic_usec() -> Option<u64> {
    match sd_notify::NotifyState::monotonic_usec_now() {
        Ok(sd_notify::NotifyState::MonotonicUsec(usec)) => u64::try_from(usec).ok(),
        _ => None,
    }
}

impl ReloadVerdict {
    /// Writes the verdict into `state_dir` atomically (readers see the old or the new one).
    pub fn write(&self, state_dir: &Path) -> Result<(), crate::files::FileError> {
        // Serialising a struct of numbers, a bool and a string cannot fail.
        let mut text = serde_json::to_string(self).unwrap_or_default();
        text.push('\n');
        crate::files::write_atomic(&state_dir.join(VERDICT_FILE), text.as_bytes(), 0o600)
    }

    /// The verdict in `state_dir`: `None` when there is none yet, an error (in words) when
    /// the file is there but cannot be read or is not a verdict.
    pub fn read(state_dir: &Path) -> Result<Option<ReloadVerdict>, String> {
        let text = match std::fs::read_to_string(state_dir.join(VERDICT_FILE)) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| format!("not a verdict: {e}"))
    }
}

/// Sends SIGHUP to the daemon `pid` and waits (up to `timeout`) for the verdict of a
/// reload it began after the signal was sent.
pub fn request(
    pid: i32,
    state_dir: &Path,
    timeout: Duration,
) -> Result<ReloadVerdict, ReloadError> {
    // Pid 1 is allowed for a daemon that is a container's init, and only then.
    if pid == 1 {
        let comm = procfs::process::Process::new(1)
            .and_then(|p| p.stat())
            .map(|s| s.comm)
            .unwrap_or_default();
        if comm != "flowhost" {
            return Err(ReloadError::NotTheDaemon { comm });
        }
    }
    let since = monotonic_usec().ok_or(ReloadError::Clock)?;
    // Checked before the signal, so a timeout too long to count never leaves a reload
    // begun and unwatched.
    let deadline = Instant::now()
        .checked_add(timeout)
        .ok_or(ReloadError::Clock)?;
    let daemon = Pid::from_raw(pid);
    kill(daemon, Signal::SIGHUP).map_err(|source| ReloadError::Signal { pid, source })?;
    loop {
        let unreadable = match ReloadVerdict::read(state_dir) {
            Ok(Some(v)) if i64::from(v.pid) == i64::from(pid) && v.started_usec >= since => {
                return Ok(v);
            }
            Ok(_) => None,
            Err(why) => Some(why),
        };
        if kill(daemon, None) == Err(nix::Error::ESRCH) {
            return Err(ReloadError::Gone { pid });
        }
        if Instant::now() >= deadline {
            return Err(ReloadError::Timeout {
                pid,
                path: state_dir.join(VERDICT_FILE),
                timeout,
                unreadable,
            });
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_round_trips_and_a_stale_one_is_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(ReloadVerdict::read(dir.path()), Ok(None));
        let me = std::process::id();
        let v = ReloadVerdict {
            pid: me,
            started_usec: 1,
            accepted: false,
            generation: 1,
            message: "refused".into(),
        };
        v.write(dir.path()).unwrap();
        assert_eq!(ReloadVerdict::read(dir.path()), Ok(Some(v)));
        // A verdict from before the request by a process that never reloads (it ignores
        // SIGHUP): the wait does not take the stale verdict and fails closed on its deadline.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "trap '' HUP; sleep 30"])
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        ReloadVerdict {
            pid: child.id(),
            started_usec: 1,
            accepted: true,
            generation: 2,
            message: "old".into(),
        }
        .write(dir.path())
        .unwrap();
        let err = request(child.id() as i32, dir.path(), Duration::from_secs(1)).unwrap_err();
        let _ = child.kill();
        let _ = child.wait();
        assert!(matches!(err, ReloadError::Timeout { .. }), "{err}");
        assert!(!err.to_string().contains("could not be read"), "{err}");

        // A verdict file that is not a verdict: the timeout says so.
        std::fs::write(dir.path().join(VERDICT_FILE), "{\"pid\": 1").unwrap();
        let mut child = std::process::Command::new("sh")
            .args(["-c", "trap '' HUP; sleep 30"])
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let err = request(child.id() as i32, dir.path(), Duration::from_millis(300)).unwrap_err();
        let _ = child.kill();
        let _ = child.wait();
        let text = err.to_string();
        assert!(text.contains("could not be read: not a verdict"), "{text}");
    }
}
