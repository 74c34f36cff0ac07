//! `flowhost serve --config FILE`: the host daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliResult;
use crate::daemon::{Host, listener_from_systemd, run};
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
    /// Worker threads of the async runtime (default: one per CPU).
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
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.enable_all();
        if let Some(n) = self.workers {
            builder.worker_threads(n.max(1));
        }
        let runtime = builder.build()?;
        runtime.block_on(async {
            let (host, listener) = match Host::start(&self.config, passed).await {
                Ok(v) => v,
                Err(e) => {
                    let status = format!("refusing to start: {e}");
                    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Status(&status)]);
                    return Err(e);
                }
            };
            run(host, listener).await;
            Ok(())
        })?;
        Ok(ExitCode::SUCCESS)
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
