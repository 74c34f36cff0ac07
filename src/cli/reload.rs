//! `flowhost reload`: ask the daemon to reload and wait for its verdict.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::CliResult;
use crate::daemon::reload;

/// Reload a running daemon (SIGHUP) and wait for its verdict. Exit 0 when the new
/// configuration serves, 1 when the daemon refused it (the old one keeps serving; the
/// reason is printed), 2 when there is no verdict (timeout, daemon gone). systemd's
/// `ExecReload=` runs this, so a refused reload fails `systemctl reload`.
#[derive(Debug, clap::Args)]
pub struct ReloadArgs {
    /// The daemon's pid (`$MAINPID` under systemd; 1 in a container where it is init). One
    /// process only: 0 and negative numbers would signal a process group or every process.
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..))]
    pid: i32,
    /// The daemon's state directory (its `state_dir`), where it writes the verdict.
    #[arg(long, default_value = "/var/lib/flowhost")]
    state_dir: PathBuf,
    /// Seconds to wait for the verdict before treating the reload as failed (below the
    /// unit's TimeoutStartSec=60, which bounds ExecReload too, so the reason is printed
    /// before systemd gives up).
    #[arg(long, default_value_t = 45, value_parser = clap::value_parser!(u64).range(1..=3600))]
    timeout: u64,
}

impl ReloadArgs {
    /// Runs the subcommand.
    pub fn run(self) -> CliResult {
        let verdict =
            reload::request(self.pid, &self.state_dir, Duration::from_secs(self.timeout))?;
        // The message can quote what an executor or a file said (a refusal names why a
        // server's executor did not start): escaped, line by line, each line with the
        // journal's priority prefix, so it can neither drive the terminal nor forge a line.
        let lines = verdict.message.lines().map(flowhost_broker::Escaped);
        if verdict.accepted {
            // The status is the verdict (systemd's ExecReload): a message stdout refuses
            // cannot make an accepted reload look like no verdict.
            for line in lines {
                let _ = outln!("{line}");
            }
            Ok(ExitCode::SUCCESS)
        } else {
            let prefix = crate::logging::fatal_line_prefix();
            for (i, line) in lines.enumerate() {
                note!("{prefix}{}{line}", if i == 0 { "flowhost: " } else { "  " });
            }
            Ok(ExitCode::from(1))
        }
    }
}
