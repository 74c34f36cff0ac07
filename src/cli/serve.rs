//! `flowhost serve --config FILE`: the host daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliResult;
use crate::daemon::{Host, Served, default_workers, listener_from_systemd, run};
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
    /// Worker threads of the async runtime (default: one fewer than the CPUs, at least one).
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
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.enable_all();
        builder.worker_threads(self.workers.unwrap_or_else(default_workers).max(1));
        let runtime = builder.build()?;
        runtime.block_on(async {
            let (host, listener) = match Host::start(&self.config, passed).await {
                Ok(v) => v,
                Err(e) => {
                    let status = format!("refusing to start: {e}");
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
    use std::io::Write;
    let answer = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {
            "code": crate::mcp::code::INTERNAL_ERROR,
            "message": "the flowhost host refused to start; its operator finds why in its log (journalctl -u flowhost -p err)"
        }
    });
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    while let Ok((mut stream, _)) = listener.accept() {
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(std::time::Duration::from_secs(1)));
        let _ = writeln!(stream, "{answer}");
        // Closed with the client's request unread, the socket would report the connection
        // reset to the client, which can then lose the answer: say no more comes, and read
        // what the client sent until it closes (a second without data, 1 MiB at most).
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(1)));
        let _ = std::io::copy(
            &mut std::io::Read::take(&mut stream, 1 << 20),
            &mut std::io::sink(),
        );
    }
}
