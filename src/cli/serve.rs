//! `flowhost serve --config FILE`: the host daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliResult;
use crate::daemon::{Host, Served, default_workers, listener_from_systemd, run, serve_runtime};
use crate::logging::{LogFormat, init};

/// Run the host daemon.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The host configuration file (TOML).
    #[arg(long, default_value = "/etc/flowhost/flowhost.toml")]
    config: PathBuf,
    /// Log destination and format.
    #[arg(long, value_enum, default_value = "auto")]
    log_format: LogFormat,
    /// Worker threads of the async runtime (default: one fewer than the CPUs, at least one;
    /// with one, a current-thread runtime).
    #[arg(long)]
    workers: Option<usize>,
}

impl ServeArgs {
    /// Runs the daemon until SIGTERM.
    pub fn run(self) -> CliResult {
        init(self.log_format);
        raise_open_file_limit();
        // Read before any thread exists: it clears LISTEN_FDS/LISTEN_PID from the environment.
        let passed = listener_from_systemd()?;
        // Kept to answer the connections that activated the service if it refuses to start.
        let activated_by = passed.as_ref().and_then(|l| l.try_clone().ok());
        let runtime = serve_runtime(self.workers.unwrap_or_else(default_workers))?;
        runtime.block_on(async {
            let (host, listener) = match Host::start(&self.config, passed).await {
                Ok(v) => v,
                Err(e) => {
                    let status = crate::daemon::service_status(&format!("refusing to start: {e}"));
                    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Status(&status)]);
                    if let Some(listener) = &activated_by {
                        refuse_pending_connections(listener);
                    }
                    if e.may_pass() {
                        // Exit 1, which the unit retries (exit 2 it does not): the cause
                        // may be gone by the next start.
                        super::report(&e);
                        return Ok(ExitCode::FAILURE);
                    }
                    return Err(e.into());
                }
            };
            Ok(match run(host, listener).await {
                Served::Clean => ExitCode::SUCCESS,
                Served::Unclean | Served::NotStarted => ExitCode::FAILURE,
            })
        })
    }
}

/// Each session's executors hold a few descriptors in the host (pidfd, seccomp listener,
/// stdio pipes), so the soft RLIMIT_NOFILE (often 1024) is raised to the hard limit.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(error = %e, soft, hard, "cannot raise the open-file limit");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-file limit"),
    }
}

/// Answers every connection waiting on a socket-activated listener with a JSON-RPC error
/// and closes it, so clients that started the service learn at once that it refused to
/// start instead of waiting for their own timeout. The reason stays in the operator's log:
/// it may name configuration paths and keys.
fn refuse_pending_connections(listener: &std::os::unix::net::UnixListener) {
    let answer = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {
            "code": crate::mcp::code::INTERNAL_ERROR,
            "message": "the flowhost host refused to start; its operator finds why in its log (journalctl -u flowhost -p err)"
        }
    });
    refuse_pending_within(listener, &answer.to_string(), REFUSING_FOR);
}

/// How long a host that refused to start goes on answering waiting clients: clients
/// trickling bytes or reconnecting must not keep it past its unit's start timeout.
const REFUSING_FOR: std::time::Duration = std::time::Duration::from_secs(2);
/// Most waiting connections answered before the host exits.
const REFUSED_AT_MOST: usize = 64;

fn refuse_pending_within(
    listener: &std::os::unix::net::UnixListener,
    answer: &str,
    within: std::time::Duration,
) {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + within;
    let left = || {
        deadline
            .checked_duration_since(std::time::Instant::now())
            .filter(|d| !d.is_zero())
    };
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    for _ in 0..REFUSED_AT_MOST {
        let Ok((mut stream, _)) = listener.accept() else {
            return;
        };
        let Some(wait) = left() else { return };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(wait.min(std::time::Duration::from_secs(1))));
        let _ = writeln!(stream, "{answer}");
        // Closed with the client's request unread, the socket would report the connection
        // reset to the client, which can then lose the answer: say no more comes, and read
        // what the client sent until it closes (1 MiB at most, within the deadline).
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut buf = [0u8; 8192];
        let mut read = 0usize;
        while read < 1 << 20 {
            let Some(wait) = left() else { return };
            let _ = stream.set_read_timeout(Some(wait.min(std::time::Duration::from_secs(1))));
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
        }
    }
}

#[cfg(test)]
mod refusing_tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_client_trickling_bytes_does_not_keep_a_refusing_host() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut client = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let trickle = std::thread::spawn(move || {
            for _ in 0..40 {
                if client.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        let started = std::time::Instant::now();
        refuse_pending_within(&listener, "{}", std::time::Duration::from_millis(500));
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_millis(1500), "{took:?}");
        drop(listener);
        trickle.join().unwrap();
    }
}
