//! `flowhost sandbox run`: run any command under the broker, like `bwrap` or `sandlock run`.
//! Every egress attempt and its verdict goes to stderr and, with `--records`, as one JSON line
//! to a file (written and synced before the verdict takes effect). With no `--allow`, every
//! attempt is refused. The exit status is the command's (128 + signal when killed).

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flowhost_broker::{AttemptInfo, Broker, BrokerOptions, Profile, SpawnSpec, StdioMode, Verdict};

use super::CliResult;
use crate::destination::{DestinationRule, DestinationRules};

/// Default directory searched for profiles before the built-in ones.
pub const DEFAULT_PROFILE_DIR: &str = "/etc/flowhost/profiles";

/// Run commands under the broker.
#[derive(Debug, clap::Args)]
pub struct SandboxArgs {
    #[command(subcommand)]
    command: SandboxCommand,
}

#[derive(Debug, clap::Subcommand)]
enum SandboxCommand {
    /// Run a command under a profile with every outbound attempt mediated.
    Run(RunArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Execution profile name (looked up in --profiles-dir, then among the built-in ones).
    #[arg(long)]
    profile: String,
    /// Directory holding profile files (NAME.toml); may be repeated.
    #[arg(long = "profiles-dir", default_value = DEFAULT_PROFILE_DIR)]
    profiles_dir: Vec<PathBuf>,
    /// Allow egress to ADDR[:PORT], a CIDR[:PORT], *:PORT, unix:/path or unix:@name; may be
    /// repeated. Without any, every attempt is refused.
    #[arg(long = "allow", value_name = "RULE")]
    allow: Vec<DestinationRule>,
    /// Append one JSON line per attempt to this file.
    #[arg(long)]
    records: Option<PathBuf>,
    /// Wall-clock limit in seconds (default: the profile's).
    #[arg(long)]
    timeout: Option<u64>,
    /// Pass NAME from the host environment, or set NAME=VALUE; may be repeated.
    #[arg(long = "env", value_name = "NAME[=VALUE]")]
    env: Vec<String>,
    /// Working directory inside the sandbox (default /tmp, private per run).
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Extra path the command may read beneath; may be repeated.
    #[arg(long = "read", value_name = "PATH")]
    read: Vec<PathBuf>,
    /// Extra path the command may write beneath; may be repeated.
    #[arg(long = "write", value_name = "PATH")]
    write: Vec<PathBuf>,
    /// Do not log attempts to stderr.
    #[arg(long)]
    quiet: bool,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// Why a sandbox run could not start.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The command could not be found.
    #[error("command {0:?} not found in PATH (give an absolute path)")]
    NotFound(String),
    /// The records file could not be opened.
    #[error("{path}: cannot open the records file: {source}")]
    Records {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The async runtime could not start.
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
}

fn resolve_program(name: &OsString) -> Result<PathBuf, SandboxError> {
    let p = Path::new(name);
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    if p.components().count() > 1 {
        return std::fs::canonicalize(p)
            .map_err(|_| SandboxError::NotFound(p.display().to_string()));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(p))
        .find(|c| c.is_file())
        .ok_or_else(|| SandboxError::NotFound(p.display().to_string()))
}

/// One line of `--records`.
fn record_line(info: &AttemptInfo, verdict: Verdict, rule: &str) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let (decision, errno) = match verdict {
        Verdict::Allow => ("allow", None),
        Verdict::Deny { errno } => ("deny", Some(errno)),
    };
    serde_json::json!({
        "unix_time_ms": now.as_millis() as u64,
        "syscall": info.syscall.as_str(),
        "pid": info.pid,
        "executable": info.executable.as_ref().map(|p| p.display().to_string()),
        "family": info.socket.family_name(),
        "socket_type": info.socket.type_name(),
        "protocol": info.socket.protocol_name(),
        "destination": info.destination.as_ref().map(|d| d.to_string()),
        "connected": info.connected,
        "bytes": info.bytes,
        "message_index": info.message_index,
        "decision": decision,
        "errno": errno,
        "rule": rule,
    })
    .to_string()
}

impl SandboxArgs {
    /// Runs the subcommand.
    pub fn run(self) -> CliResult {
        let SandboxCommand::Run(args) = self.command;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(SandboxError::Runtime)?;
        runtime.block_on(run(args))
    }
}

async fn run(args: RunArgs) -> CliResult {
    let profile = Arc::new(Profile::find(&args.profile, &args.profiles_dir)?);
    let broker = Broker::new(BrokerOptions::default())?;
    broker.check_profile(&profile)?;
    if !args.quiet {
        eprintln!("flowhost sandbox: {}", broker.bounds(&profile));
    }
    let rules = DestinationRules::allow_only(args.allow.clone());
    let mut records = match &args.records {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| SandboxError::Records {
                    path: path.clone(),
                    source,
                })?,
        ),
        None => None,
    };

    let mut argv = args.command.clone();
    argv[0] = resolve_program(&argv[0])?.into_os_string();
    let mut spec = SpawnSpec::new(argv, profile);
    spec.stdin = StdioMode::Inherit;
    spec.stdout = StdioMode::Inherit;
    spec.stderr = StdioMode::Inherit;
    spec.inherit_env = vec!["PATH".into(), "LANG".into(), "TERM".into()];
    for e in &args.env {
        match e.split_once('=') {
            Some((k, v)) => spec.env.push((k.into(), v.into())),
            None => spec.inherit_env.push(e.clone()),
        }
    }
    if let Some(cwd) = &args.cwd {
        spec.cwd = cwd.clone();
    }
    spec.read_paths = args.read.clone();
    spec.write_paths = args.write.clone();
    if let Some(seconds) = args.timeout {
        spec.wall_clock = Some(Duration::from_secs(seconds));
    }

    let mut exec = broker.spawn(spec).await?;
    let mut attempts = exec.take_attempts().ok_or("attempt stream already taken")?;
    let quiet = args.quiet;
    let decider = tokio::spawn(async move {
        while let Some(attempt) = attempts.recv().await {
            let info = attempt.info().clone();
            let decision = rules.decide(
                info.destination
                    .as_ref()
                    .map(crate::daemon::rules_destination)
                    .as_ref(),
            );
            let mut verdict = if decision.allowed {
                Verdict::Allow
            } else {
                Verdict::DENY
            };
            if let Some(file) = records.as_mut() {
                let line = record_line(&info, verdict, &decision.rule);
                if let Err(e) = write_synced(file, &line) {
                    // Fail closed: an attempt that cannot be recorded is refused.
                    eprintln!(
                        "flowhost sandbox: cannot write the records file ({e}); refusing egress"
                    );
                    verdict = Verdict::DENY;
                }
            }
            if !quiet {
                eprintln!(
                    "flowhost sandbox: {} {}/{}/{} {} by pid {} ({}) -> {} ({})",
                    info.syscall.as_str(),
                    info.socket.family_name(),
                    info.socket.type_name(),
                    info.socket.protocol_name(),
                    info.destination
                        .as_ref()
                        .map(|d| d.to_string())
                        .unwrap_or_else(|| "(none)".into()),
                    info.pid,
                    info.executable
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| "?".into()),
                    if verdict == Verdict::Allow {
                        "ALLOWED"
                    } else {
                        "REFUSED"
                    },
                    decision.rule
                );
            }
            attempt.respond(verdict);
        }
    });
    let status = exec.wait().await?;
    drop(exec);
    let _ = tokio::time::timeout(Duration::from_secs(2), decider).await;
    if let Some(bound) = status.bound_description() {
        eprintln!("flowhost sandbox: the command ran into {bound}");
    }
    Ok(ExitCode::from(status.code().clamp(0, 255) as u8))
}

fn write_synced(file: &mut File, line: &str) -> std::io::Result<()> {
    file.write_all(line.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_data()
}
