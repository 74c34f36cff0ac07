//! `flowhost sandbox run` and `flowhost sandbox mcp`: one command, or one MCP server from its
//! signed manifest, under the broker, without a host configuration.
//!
//! `run`: every egress attempt and its verdict goes to stderr and, with `--records DIR`, into
//! a record directory in the daemon's schema (hash-chained, each record durable before its
//! verdict takes effect). With no `--allow`, every attempt is refused. The exit status is the
//! command's (128 + signal when killed); with `--declared SURFACE` the diff judges the run
//! when it ends, and a failed gate exits with `--gate-status` (1 to 255, never 0; default
//! [`GATE_FAILED`]). A record writer that failed during the run makes it exit 2, once its
//! health (incomplete, naming the failure) is written and its gate judged.
//!
//! `mcp`: see [`mcp`].

mod mcp;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use flowhost_broker::{
    AttemptInfo, Broker, BrokerOptions, Delivery, Escaped, Interrupt, Judge, Profile, SpawnSpec,
    StdioMode, Verdict as BrokerVerdict,
};

use super::CliResult;
use crate::destination::{DestinationRule, DestinationRules, HostName, NameBlocks, RuleDecision};
use crate::diff::surface::DeclaredSurface;
use crate::dns::{
    AttemptView, DnsMediation, ExecutorDns, ExecutorId, Lookup, LookupJudge, LookupVerdict,
    Upstream, attempt_view,
};
use crate::records::health::{HealthProducer, RecordsHealth};
use crate::records::{
    BrokerDetails, Correlation, DecisionRecord, Denial, EgressFacts, FlowContext, RecordWriter,
    ServerInfo, ToolObservationHealth, Verdict, WriterOptions,
};

/// Default directory searched for profiles before the built-in ones.
pub const DEFAULT_PROFILE_DIR: &str = "/etc/flowhost/profiles";

/// The exit status of a run whose gate failed (`--declared`), unless `--gate-status` names
/// another.
pub const GATE_FAILED: u8 = 90;

/// Writes `text` to stderr in one write (stderr is unbuffered: a formatted print writes
/// piece by piece, and other output would land between the pieces), and goes on when it
/// cannot be written. Rust ignores SIGPIPE, so with stderr closed early (`2>&1 | head -1`)
/// `eprintln!` panics: in the middle of deciding an attempt, that refused it after its
/// record said it was allowed, and ended the task that decides every later one.
fn to_stderr(text: &str) {
    // While the command's terminal is relayed and stderr is the caller's terminal, the relay
    // writes it: a terminal that takes no output then holds up no thread of the run.
    if terminal::relayed_message(text) {
        return;
    }
    // Otherwise, while the command runs, a thread of its own writes it.
    if queued_stderr::queued(text) {
        return;
    }
    // Nobody reads it any more; the run and its records go on.
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), text.as_bytes());
}

/// What the host's own parts log while a command runs (the broker, the command's resolver):
/// warnings and errors by default (`FLOWHOST_LOG` to change it), on stderr through
/// [`to_stderr`]. Without it they went nowhere: a supervisor that failed and killed the
/// command, or an upstream resolver that never answered, left no word of why.
fn log_problems_to_stderr() {
    use tracing_subscriber::prelude::*;
    /// Each event is formatted whole and written once.
    struct Said;
    impl std::io::Write for Said {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            to_stderr(&String::from_utf8_lossy(buf));
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("FLOWHOST_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_target(false)
        .without_time()
        .with_writer(|| Said);
    // A subscriber already installed (tests) is fine.
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(layer)
        .try_init();
}

/// `eprintln!` through [`to_stderr`]: one line, never a panic.
macro_rules! say {
    ($($arg:tt)*) => {
        to_stderr(&format!("{}\n", format_args!($($arg)*)))
    };
}

mod queued_stderr;
mod terminal;

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
    /// Serve one MCP server on stdio from its signed manifest, governed as the daemon
    /// governs it (verified manifest, flow resolver, broker, records), with no host
    /// configuration.
    Mcp(mcp::McpArgs),
}

impl CommonArgs {
    /// The directories searched for profiles: each `--profiles-dir` given, which must be a
    /// directory (one mistyped would let the built-in profile of the same name run in
    /// place of the operator's), else the default one if it is there.
    fn profile_dirs(&self) -> Result<Vec<PathBuf>, String> {
        let judge = |dir: &Path| match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => Ok(true),
            Ok(_) => Err(format!("{}: not a directory", dir.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            // There but not to be looked at (its directory is the flowhost group's): its
            // profiles must not be replaced by the built-in ones without a word.
            Err(e) => Err(format!("{}: {e}", dir.display())),
        };
        if self.profiles_dir.is_empty() {
            let default = PathBuf::from(DEFAULT_PROFILE_DIR);
            return Ok(if judge(&default)? {
                vec![default]
            } else {
                Vec::new()
            });
        }
        for dir in &self.profiles_dir {
            if !judge(dir).map_err(|e| format!("--profiles-dir {e}"))? {
                return Err(format!("--profiles-dir {}: not there", dir.display()));
            }
        }
        Ok(self.profiles_dir.clone())
    }
}

/// What both subcommands take about the sandbox, the evidence and the gate.
#[derive(Debug, clap::Args)]
struct CommonArgs {
    /// Directory holding profile files (NAME.toml); may be repeated. Default:
    /// /etc/flowhost/profiles when it exists.
    #[arg(long = "profiles-dir")]
    profiles_dir: Vec<PathBuf>,
    /// Allow egress to ADDR[:PORT], a CIDR[:PORT], *:PORT, NAME:PORT, *.NAME:PORT,
    /// unix:/path or unix:@name; may be repeated. Without any, every attempt is refused.
    /// A host-name rule also lets the command look the name up (under a profile with the
    /// host's network, lookups are answered by flowhost and only allowed names resolve).
    #[arg(long = "allow", value_name = "RULE")]
    allow: Vec<DestinationRule>,
    /// Write the decision records into this directory (the daemon's layout, verifiable with
    /// `flowhost records verify`); it must be new or empty.
    #[arg(long, value_name = "DIR")]
    records: Option<PathBuf>,
    /// Write the run's tool_observation_health here when it ends.
    #[arg(long, value_name = "FILE")]
    health: Option<PathBuf>,
    /// Judge the run against this declared surface (assay.declared_tool_surface.v0) when it
    /// ends, as `flowhost diff` would; anything but a clean verdict fails the gate.
    #[arg(long, value_name = "SURFACE")]
    declared: Option<PathBuf>,
    /// Exit status when the gate fails (1 to 255, default 90). A passing gate keeps the
    /// command's own status.
    // 0 is refused: a failed gate that exits 0 would pass the CI step it is meant to fail.
    #[arg(
        long,
        value_name = "N",
        default_value_t = GATE_FAILED,
        value_parser = clap::value_parser!(u8).range(1..),
        requires = "declared"
    )]
    gate_status: u8,
    /// Pass NAME from the host environment, or set NAME=VALUE; may be repeated.
    #[arg(long = "env", value_name = "NAME[=VALUE]")]
    env: Vec<String>,
    /// Extra path the command may read beneath; may be repeated.
    #[arg(long = "read", value_name = "PATH")]
    read: Vec<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Execution profile name (looked up in --profiles-dir, then among the built-in ones).
    #[arg(long)]
    profile: String,
    #[command(flatten)]
    common: CommonArgs,
    /// Server id the records give the command (declared surfaces may name it).
    #[arg(long, default_value = "sandbox")]
    server_id: String,
    /// Tool name the records give the command.
    #[arg(long, default_value = "run")]
    tool: String,
    /// Wall-clock limit in seconds (default: the profile's).
    #[arg(long)]
    timeout: Option<u64>,
    /// Working directory inside the sandbox (default /tmp, private per run).
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Extra path the command may write beneath; may be repeated.
    #[arg(long = "write", value_name = "PATH")]
    write: Vec<PathBuf>,
    /// Where allowed lookups are asked (`IP` or `IP:PORT`, port 53 by default); may be
    /// repeated. Default: the `nameserver` lines of the host's `/etc/resolv.conf`.
    #[arg(long = "dns-upstream", value_name = "ADDR", value_parser = parse_upstream)]
    dns_upstream: Vec<std::net::SocketAddr>,
    /// A name (`NAME` or `*.NAME`) whose answers may bind private addresses (loopback,
    /// link-local, RFC 1918, ...) to it, so its host-name rules reach them; may be repeated.
    /// Without it such an address is judged by address rules alone.
    #[arg(long = "private-answers", value_name = "PATTERN")]
    private_answers: Vec<crate::destination::NamePattern>,
    /// Do not log attempts to stderr.
    #[arg(long)]
    quiet: bool,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// Why a sandbox run could not start or finish.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The command could not be found.
    #[error("command {0:?} not found in PATH (give an absolute path)")]
    NotFound(String),
    /// The command, named by a path, cannot be looked at.
    #[error("command {}: {reason}", path.display())]
    Program {
        /// The path, made absolute.
        path: PathBuf,
        /// What the system said.
        reason: String,
    },
    /// A `--read` or `--write` path that cannot be looked at: a rule for it would be
    /// skipped, and the command denied what it was meant to get with no word of why.
    #[error("{option} {}: {reason}; nothing was run", path.display())]
    AccessPath {
        /// `--read` or `--write`.
        option: &'static str,
        /// The path as given.
        path: PathBuf,
        /// What the system said.
        reason: String,
    },
    /// The records directory cannot take this run's records.
    #[error("{path}: {reason}")]
    RecordsDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The record writer failed.
    #[error("decision records: {0}")]
    Records(#[from] crate::records::RecordError),
    /// The record writer failed during the run (or could not close): the run ended as a
    /// run does, its health saying its observation is incomplete and why, and fails.
    #[error(
        "decision records: the record writer failed during the run, so its records are \
         incomplete (the run's health says so): {0}"
    )]
    RecordsFailed(crate::records::RecordError),
    /// The health could not be written.
    #[error("health: {0}")]
    Health(#[from] crate::records::health::HealthError),
    /// The health could not be written where `--health` says, as found before the run.
    #[error("{}: --health cannot be written there: {reason}; nothing was run", path.display())]
    HealthPlace {
        /// The `--health` path.
        path: PathBuf,
        /// Why.
        reason: std::io::Error,
    },
    /// The declared surface or the gate failed before judging.
    #[error(transparent)]
    Gate(#[from] crate::harness::HarnessError),
    /// The run's resolver could not be set up.
    #[error("DNS mediation: {0}")]
    Dns(String),
    /// The async runtime could not start.
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
    /// The command's own terminal could not be made or relayed (the caller's terminal is
    /// never passed to the command instead).
    #[error("{0}; refusing to run the command on the caller's terminal")]
    Terminal(#[from] terminal::RelayError),
    /// The command ran, but some of its output or of flowhost's messages could not be
    /// written to the caller's terminal.
    #[error("the command ran, but {0}")]
    NotShown(terminal::NotShown),
    /// An interrupt could not be taken from its default action, so it could not reach the
    /// command.
    #[error("cannot take {signal} to pass it to the command: {source}")]
    Signals {
        /// The signal's name.
        signal: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

fn parse_upstream(s: &str) -> Result<std::net::SocketAddr, String> {
    crate::config::parse_resolver(s)
        .ok_or_else(|| format!("{s:?} is not IP, IP:PORT or [IPv6]:PORT"))
}

fn resolve_program(name: &OsString) -> Result<PathBuf, SandboxError> {
    let p = Path::new(name);
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    if p.components().count() > 1 {
        // Made absolute, not resolved: a venv's `bin/python` is a link to the interpreter
        // that made it, which finds the venv by the name it was run as, and a multi-call
        // binary (busybox) by its argv[0].
        let absolute = std::path::absolute(p).map_err(|e| SandboxError::Program {
            path: p.to_path_buf(),
            reason: e.to_string(),
        })?;
        return match std::fs::metadata(&absolute) {
            Ok(_) => Ok(absolute),
            Err(e) => Err(SandboxError::Program {
                path: absolute,
                reason: e.to_string(),
            }),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(p))
        .find(|c| c.is_file())
        .ok_or_else(|| SandboxError::NotFound(p.display().to_string()))
}

/// Refuses a records directory that held records when its writer opened it (`status`, read
/// once the writer holds the directory's lock): another run wrote there between this run's
/// check that it was empty and its open, and this run's health would vouch for that run's
/// records as its own.
pub(crate) fn records_of_this_run_alone(
    dir: &Path,
    status: &crate::records::WriterStatus,
) -> Result<(), SandboxError> {
    if status.last_seq.unwrap_or(0) > status.committed_since_open {
        return Err(SandboxError::RecordsDir {
            path: dir.to_path_buf(),
            reason: "held another run's records by the time this run opened it; each run \
                     writes its records into a new or empty directory"
                .into(),
        });
    }
    Ok(())
}

/// Creates `path` (mode 0700) or checks that it is an empty directory: one run's records
/// are one stream, and the health binds to exactly that stream.
fn prepare_records_dir(path: &Path) -> Result<(), SandboxError> {
    let bad = |reason: String| SandboxError::RecordsDir {
        path: path.to_path_buf(),
        reason,
    };
    // Whoever may change a directory above it could rename it away (or the name's link)
    // and put their own in its place, before the run or during it: the records are written
    // by path. Checked again once made (a parent made meanwhile by another, a `..`).
    let place = || {
        crate::files::trusted_place_for_dir(path)
            .map_err(|e| bad(format!("cannot be trusted: {e}")))
    };
    let group_writable = place()?;
    let made = prepare_records_dir_at(path, &bad)?;
    let group_writable = if made {
        // As found, once made: another user may have made it first (a directory that
        // exists is no error to a recursive creation), and it is then theirs.
        prepare_records_dir_at(path, &bad)?;
        place()?
    } else {
        group_writable
    };
    for (dir, why) in group_writable {
        say!(
            "flowhost sandbox: note: {} {why}: its group's members could replace the records directory {} below it",
            Escaped(&dir.display().to_string()),
            Escaped(&path.display().to_string())
        );
    }
    Ok(())
}

/// [`prepare_records_dir`]'s check of `path` itself, making it when it does not exist;
/// whether it made it.
fn prepare_records_dir_at(
    path: &Path,
    bad: &impl Fn(String) -> SandboxError,
) -> Result<bool, SandboxError> {
    match std::fs::read_dir(path) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(bad(
                    "is not empty; each run writes its records into a new or empty directory"
                        .into(),
                ));
            }
            // One others may write could be given their records before this run's, or
            // have this run's taken away: as the daemon's records directory, it must be
            // one only root or this user may change.
            let meta = std::fs::metadata(path)
                .map_err(|e| bad(format!("cannot read the records directory: {e}")))?;
            if let Some(why) = crate::files::others_may_change_file(&meta) {
                return Err(bad(format!("{why}")));
            }
            Ok(false)
        }
        // Synced into its parent (and each directory made on the way into its own): records
        // made durable in a directory a power loss then unlinks would be lost with it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            crate::files::create_dir_all_synced(path, 0o700)
                .map_err(|e| bad(format!("cannot create the records directory: {e}")))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => Err(bad(
            "is a file; --records takes a directory (the daemon's layout)".into(),
        )),
        Err(e) => Err(bad(format!("cannot read the records directory: {e}"))),
    }
}

/// Where a run's evidence goes: the record directory (the one given, or a private one when
/// only the gate needs it) and the surface.
struct Evidence {
    records: Option<PathBuf>,
    /// The run's private directory (removed when the run ends), made only when something
    /// needs it: a plain run creates nothing on disk.
    private: std::sync::OnceLock<tempfile::TempDir>,
    surface: Option<DeclaredSurface>,
}

impl Evidence {
    /// The run's private directory, created on first use.
    fn private(&self) -> Result<&Path, SandboxError> {
        if let Some(dir) = self.private.get() {
            return Ok(dir.path());
        }
        let dir = tempfile::Builder::new()
            .prefix("flowhost-sandbox-")
            .tempdir()
            .map_err(|e| SandboxError::RecordsDir {
                path: std::env::temp_dir(),
                reason: format!("cannot create the run's private directory: {e}"),
            })?;
        Ok(self.private.get_or_init(|| dir).path())
    }
}

impl CommonArgs {
    /// Reads the surface, prepares the record directory and checks the health can be
    /// written, before anything runs: a run whose evidence cannot be kept is not run.
    fn evidence(&self) -> Result<Evidence, SandboxError> {
        if let Some(path) = &self.health {
            crate::files::can_create_at(path).map_err(|reason| SandboxError::HealthPlace {
                path: path.clone(),
                reason,
            })?;
        }
        let surface = self
            .declared
            .as_deref()
            .map(crate::harness::load_surface)
            .transpose()?;
        let mut evidence = Evidence {
            records: None,
            private: std::sync::OnceLock::new(),
            surface,
        };
        evidence.records = match (&self.records, &evidence.surface) {
            (Some(dir), _) => Some(dir.clone()),
            (None, Some(_)) => Some(evidence.private()?.join("records")),
            (None, None) => None,
        };
        if let Some(dir) = &evidence.records {
            prepare_records_dir(dir)?;
        }
        Ok(evidence)
    }

    /// Writes the health if asked, runs the gate if asked, and chooses the exit status:
    /// the command's own, unless the gate failed. `records_failed`: the record writer
    /// failed during the run, which makes the exit 2 whatever this chooses (so the gate's
    /// line says so).
    fn conclude(
        &self,
        evidence: &Evidence,
        health: &ToolObservationHealth,
        status: u8,
        records_failed: bool,
    ) -> CliResult {
        if let Some(path) = &self.health {
            health.write_to(path).map_err(SandboxError::Health)?;
        }
        let (Some(surface), Some(records)) = (&evidence.surface, &evidence.records) else {
            return Ok(ExitCode::from(status));
        };
        let report = crate::harness::judge(surface, records, health)?;
        let text = crate::diff::report::to_text(&report);
        if crate::harness::passes(&report) {
            to_stderr(&format!("flowhost sandbox: gate passed: {text}"));
            Ok(ExitCode::from(status))
        } else {
            to_stderr(&text);
            let exit = match records_failed {
                true => "exit 2: the record writer failed".to_string(),
                false => format!("exit {}", self.gate_status),
            };
            say!(
                "flowhost sandbox: GATE FAILED against {} ({exit}; the command exited {status})",
                self.declared
                    .as_deref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
            );
            Ok(ExitCode::from(self.gate_status))
        }
    }

    fn env_into(&self, spec: &mut SpawnSpec) {
        for e in &self.env {
            match e.split_once('=') {
                Some((k, v)) => spec.env.push((k.into(), v.into())),
                None => spec.inherit_env.push(e.clone()),
            }
        }
        spec.read_paths.extend(self.read.iter().cloned());
    }
}

impl SandboxArgs {
    /// Runs the subcommand.
    pub fn run(self) -> CliResult {
        // `run` supervises one command: its notifications, their verdicts and its exit fit
        // one thread, and a whole run is short enough that starting worker threads is a
        // visible part of it. `mcp` serves a client and its server's output concurrently.
        let mut runtime = match self.command {
            SandboxCommand::Run(_) => {
                log_problems_to_stderr();
                tokio::runtime::Builder::new_current_thread()
            }
            SandboxCommand::Mcp(_) => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(2);
                b
            }
        };
        let runtime = runtime
            .enable_all()
            .build()
            .map_err(SandboxError::Runtime)?;
        let done = match self.command {
            SandboxCommand::Run(args) => {
                let done = runtime.block_on(run(args));
                // A run that ended before its command did (a refusal to start it) leaves
                // nothing queued unwritten.
                if queued_stderr::waiting() {
                    queued_stderr::finish(
                        flowhost_broker::terminal::interrupts_take_their_default_action(),
                        &mut Vec::new,
                    );
                }
                done
            }
            SandboxCommand::Mcp(args) => runtime.block_on(mcp::serve(args)),
        };
        // A stdin read may still be blocked on a thread of the runtime (`sandbox mcp` after
        // the host stopped on a signal): nothing waits for it.
        runtime.shutdown_background();
        done
    }
}

/// The record of one attempt (or lookup) the sandbox decided.
fn attempt_record(args: &RunArgs, broker: BrokerDetails, verdict: Verdict) -> DecisionRecord {
    DecisionRecord::egress_attempt(EgressFacts {
        server: ServerInfo::mcp(&args.server_id, None),
        tool_name: args.tool.clone(),
        broker,
        verdict,
        credential_alias: None,
        correlation: Correlation::none(),
        context: FlowContext::default(),
    })
}

/// The verdict of a rule decision, `denial` naming why a refusal refused.
fn verdict_of(allowed: bool, rule: String, denial: Denial) -> Verdict {
    if allowed {
        Verdict::Authorized { rule: Some(rule) }
    } else {
        Verdict::Refused {
            denial,
            rule: Some(rule),
        }
    }
}

/// Records `record` if the run keeps records; `false` when it could not be written (the
/// attempt it decides is then refused: fail closed).
async fn record(writer: Option<&RecordWriter>, record: DecisionRecord) -> bool {
    let Some(w) = writer else {
        return true;
    };
    match w.commit(record).await {
        Ok(_) => true,
        Err(e) => {
            say!("flowhost sandbox: cannot write the decision record ({e}); refusing");
            false
        }
    }
}

/// Starts the run's own resolver when the profile shares the host's network: the command's
/// lookups are answered only for names an allow rule names; every lookup is recorded. `None`
/// when the profile needs none, or when this user may not bind port 53 (then every send to
/// port 53, or to an upstream resolver, is refused and host-name rules match nothing; said on
/// stderr).
fn start_dns(
    args: &Arc<RunArgs>,
    rules: &Arc<DestinationRules>,
    writer: Option<&Arc<RecordWriter>>,
    (upstream, dir): (Arc<Upstream>, PathBuf),
    pid: Arc<std::sync::OnceLock<i32>>,
    senders: flowhost_broker::UidRange,
) -> Result<Option<ExecutorDns>, SandboxError> {
    let mediation = DnsMediation {
        upstream,
        dir,
        private_answers: args.private_answers.clone().into(),
        host: crate::dns::HostSide::LIVE,
        senders,
        // A run's rules are fixed for its life: never narrowed.
        narrowings: Default::default(),
    };
    let owner = ExecutorId {
        server: "sandbox".into(),
        pid: pid.clone(),
    };
    let (args, rules, writer) = (args.clone(), rules.clone(), writer.cloned());
    let judge: LookupJudge = Arc::new(move |lookup: Lookup| {
        let (args, rules, writer, pid) = (args.clone(), rules.clone(), writer.clone(), pid.clone());
        Box::pin(async move {
            // A type not served is refused whatever the rules say; as the daemon records it,
            // a name the rules refuse keeps that refusal.
            let refused = |(denial, rule): (Denial, String)| {
                (
                    RuleDecision {
                        allowed: false,
                        rule,
                    },
                    denial,
                )
            };
            let (decision, denial) = match lookup.name() {
                // A query not served: refused before any rule.
                None => refused(
                    lookup
                        .refused_anyway()
                        .unwrap_or((Denial::QueryNotServed, "query not served".into())),
                ),
                Some(name) => {
                    let decided = rules.decide_name(name);
                    match lookup.refused_anyway() {
                        Some(anyway) if decided.allowed => refused(anyway),
                        _ => (decided, Denial::NameNotAllowed),
                    }
                }
            };
            // As the daemon: every lookup is recorded, an answered one before its name
            // leaves the host (and refused if that fails).
            let pid = pid.get().copied().unwrap_or(0);
            let r = attempt_record(
                &args,
                crate::daemon::lookup_broker_details(&lookup, pid),
                verdict_of(decision.allowed, decision.rule.clone(), denial),
            );
            let allowed = record(writer.as_deref(), r).await && decision.allowed;
            if !args.quiet {
                let (record_type, name) = match (lookup.record_type(), lookup.name()) {
                    (Some(t), Some(n)) => (t.to_string(), n.to_string()),
                    _ => ("-".into(), "-".into()),
                };
                say!(
                    "flowhost sandbox: dns_query {} {} ({}) -> {} ({})",
                    record_type,
                    name,
                    lookup.transport,
                    if allowed { "ANSWERED" } else { "REFUSED" },
                    decision.rule
                );
            }
            if allowed {
                LookupVerdict::Answered(NameBlocks::of(&rules, None))
            } else {
                LookupVerdict::Refused
            }
        })
    });
    match mediation
        .check_senders()
        .and_then(|()| ExecutorDns::start(&mediation, owner, judge))
    {
        Ok(dns) => Ok(Some(dns)),
        Err(e) if e.not_mediated_here() => {
            say!(
                "flowhost sandbox: {e}: lookups (any send to port 53) are refused, and host-name rules match nothing"
            );
            Ok(None)
        }
        Err(e) => Err(SandboxError::Dns(e.to_string())),
    }
}

/// The health of one sandbox run: the broker's supervision and the writer's stream. There
/// is no MCP endpoint: no tool calls, and the broker is the command's only way out.
/// `settled`: every attempt was decided (and recorded) before the records were closed;
/// `close_failed`: why the writer could not close, if it could not.
fn sandbox_health(
    broker: &Broker,
    writer: Option<&RecordWriter>,
    settled: bool,
    close_failed: Option<&crate::records::RecordError>,
) -> ToolObservationHealth {
    let stats = broker.stats();
    let mut h = ToolObservationHealth::unknown(HealthProducer::Sandbox);
    h.proxy_seen = Some(true);
    h.tool_calls_observed = Some(0);
    h.policy_layer_active = Some(true);
    h.classifier_version = Some("flowhost-sandbox-run".into());
    h.unknown_tool_count = Some(0);
    h.redaction_active = Some(true);
    h.broker_active = Some(true);
    h.executors_spawned = Some(stats.spawned);
    h.executors_supervised = Some(stats.supervised() + stats.exited);
    h.failed_notifications = Some(stats.failed_notifications + stats.supervisor_failures);
    // Built once, when the command and its broker have ended.
    h.run_ended = Some(true);
    if let Some(w) = writer {
        h.records = RecordsHealth::from_writer(&w.status());
        // A writer that failed says why itself; one that failed only to close, here.
        if let Some(e) = close_failed
            && !h.records.writer_failed
        {
            h.records.records_complete = Some(false);
            h.records.writer_failed = true;
            h.records.writer_failure_reason = Some(format!("closing the records: {e}"));
        }
    } else {
        h.records.records_complete = Some(false);
        h.records
            .problems
            .push("no records were written (no --records)".into());
    }
    if !settled {
        h.records.records_complete = Some(false);
        h.records
            .problems
            .push("attempts were still being decided when the command ended".into());
    }
    h.finalize()
}

async fn run(args: RunArgs) -> CliResult {
    // Before anything is printed: from here on the caller's terminal is looked after.
    let mut terminal = terminal::CommandTerminal::open()?;
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        queued_stderr::start();
    }
    // Under /tmp (the command's own, empty) or /proc (its own), a path is the command's
    // to make or find; any other must be there now, or its rule would be skipped.
    let named = (args.common.read.iter().map(|p| ("--read", p)))
        .chain(args.write.iter().map(|p| ("--write", p)));
    for (option, path) in named {
        if path.starts_with("/tmp") || path.starts_with("/proc") {
            continue;
        }
        if let Err(e) = std::fs::metadata(path) {
            return Err(SandboxError::AccessPath {
                option,
                path: path.clone(),
                reason: e.to_string(),
            }
            .into());
        }
    }
    let profile = Arc::new(Profile::find(&args.profile, &args.common.profile_dirs()?)?);
    let evidence = args.common.evidence()?;
    let broker = Broker::new(BrokerOptions::default())?;
    broker.check_profile(&profile)?;
    // One write: the report's lines stay together, whatever else writes to the terminal.
    // `--quiet` silences what holds, never what does not (said once the command started:
    // its cgroups are then made, which settles whether they can be, with no probe).
    if !args.quiet {
        say!("flowhost sandbox: {}", broker.bounds(&profile));
    }
    let rules = Arc::new(DestinationRules::allow_only(args.common.allow.clone()));
    let writer = match &evidence.records {
        Some(dir) => {
            let w = RecordWriter::open(dir, WriterOptions::default())?;
            records_of_this_run_alone(dir, &w.status())?;
            Some(Arc::new(w))
        }
        None => None,
    };
    let args = Arc::new(args);
    // The command's pid is known only once it runs; its lookups come after.
    let pid = Arc::new(std::sync::OnceLock::new());
    let upstream = Arc::new(if args.dns_upstream.is_empty() {
        Upstream::from_resolv_conf(Path::new("/etc/resolv.conf"))
    } else {
        Upstream::new(args.dns_upstream.clone())
    });
    let dns = if crate::dns::mediates_lookups(&profile) {
        start_dns(
            &args,
            &rules,
            writer.as_ref(),
            (upstream.clone(), evidence.private()?.join("resolv")),
            pid.clone(),
            broker.executor_uids(),
        )?
        .map(Arc::new)
    } else {
        None
    };

    let mut argv = args.command.clone();
    argv[0] = resolve_program(&argv[0])?.into_os_string();
    let mut spec = SpawnSpec::new(argv, profile.clone());
    spec.stdin = StdioMode::Inherit;
    spec.stdout = StdioMode::Inherit;
    spec.stderr = StdioMode::Inherit;
    // Streams that are terminals become the command's own terminal instead.
    if let Some(terminal) = terminal.as_mut() {
        terminal.give_to(&mut spec);
    }
    spec.inherit_env = vec!["PATH".into(), "LANG".into(), "TERM".into()];
    // What the caller ignores (`nohup`, a background job) stays ignored by flowhost and by
    // the command, as it would by the command started directly. Asked before flowhost
    // takes any signal.
    let ignored = ignored_by_caller()?;
    spec.ignored_signals = ignored.clone();
    args.common.env_into(&mut spec);
    if let Some(cwd) = &args.cwd {
        spec.cwd = cwd.clone();
    }
    spec.write_paths = args.write.clone();
    if let Some(seconds) = args.timeout {
        spec.wall_clock = Some(Duration::from_secs(seconds));
    }
    if let Some(dns) = &dns {
        dns.show_to(&mut spec).map_err(SandboxError::Dns)?;
    }

    // With nothing to record (no `--records`), a verdict needs only the rules and the names
    // the command's resolver handed out: it is given on the broker's supervision thread, as
    // soon as the attempt is known, and printed there (unless `--quiet`). With records, every
    // attempt goes to the task below, which records it first.
    let judge: Option<Judge> = writer.is_none().then(|| {
        let (rules, dns, quiet) = (rules.clone(), dns.clone(), args.quiet);
        let upstream = upstream.clone();
        Arc::new(move |info: &AttemptInfo| {
            let Some((name, decision)) = rule_on(&rules, (dns.as_deref(), &upstream), info) else {
                return Some(BrokerVerdict::Allow);
            };
            if !quiet {
                log_attempt(info, &name, decision.allowed, &decision.rule);
            }
            Some(if decision.allowed {
                BrokerVerdict::Allow
            } else {
                BrokerVerdict::DENY
            })
        }) as Judge
    });
    // From here an interrupt reaches the command (below), and the run still ends as a run
    // does, with its records closed, its health written, its gate judged and the caller's
    // terminal as it was. Before, nothing has started that an interrupt would leave behind.
    let mut interrupts = Interrupts::listen(&ignored)?;
    let mut suspends = (!ignored.contains(&libc::SIGTSTP))
        .then(|| {
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::from_raw(libc::SIGTSTP))
        })
        .transpose()
        .map_err(|source| SandboxError::Signals {
            signal: "SIGTSTP",
            source,
        })?;
    let mut resizes = terminal
        .as_ref()
        .map(|_| tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change()))
        .transpose()
        .map_err(|source| SandboxError::Signals {
            signal: "SIGWINCH",
            source,
        })?;
    // The relay starts before the command does: a relay that cannot start refuses a run in
    // which nothing ran, and none can fail once the command runs.
    if let Some(terminal) = terminal.as_mut() {
        terminal.relay()?;
    }
    let mut exec = broker.spawn_judged(spec, judge).await?;
    if args.quiet
        && let Some(shortfalls) = broker.bounds(&profile).shortfalls()
    {
        say!("flowhost sandbox: {shortfalls}");
    }
    let _ = pid.set(exec.pid());
    let mut attempts = exec.take_attempts().ok_or("attempt stream already taken")?;
    let decider = {
        let (args, writer, dns) = (args.clone(), writer.clone(), dns.clone());
        tokio::spawn(async move {
            while let Some(attempt) = attempts.recv().await {
                let info = attempt.info().clone();
                let Some((name, decision)) = rule_on(&rules, (dns.as_deref(), &upstream), &info)
                else {
                    attempt.respond(BrokerVerdict::Allow);
                    continue;
                };
                let r = attempt_record(
                    &args,
                    crate::daemon::named_broker_details(&info, &name),
                    verdict_of(
                        decision.allowed,
                        decision.rule.clone(),
                        Denial::DestinationBlocked,
                    ),
                );
                // Fail closed: an attempt that cannot be recorded is refused.
                let allowed = record(writer.as_deref(), r).await && decision.allowed;
                // Answered as recorded before anything is printed: what the command gets
                // never depends on whether stderr can still be written.
                attempt.respond(if allowed {
                    BrokerVerdict::Allow
                } else {
                    BrokerVerdict::DENY
                });
                if !args.quiet {
                    log_attempt(&info, &name, allowed, &decision.rule);
                }
            }
        })
    };
    let mut ended_by = None;
    // The first interrupt passed to the command (one it ignores is not): whatever it then
    // did, what it would have done without it is not observed.
    let mut interrupted = None;
    let status = loop {
        tokio::select! {
            status = exec.wait() => {
                // What the run says from now on (its verdicts) is never dropped.
                queued_stderr::command_ended();
                break status?;
            }
            // Ctrl-Z: the command stops with flowhost, and continues with it (`fg`, `bg`).
            // Stopped or not, it gets nothing typed while flowhost is stopped or in the
            // background.
            Some(_) = async {
                match suspends.as_mut() {
                    Some(suspends) => suspends.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Err(e) = exec.job_control(true) {
                    say!("flowhost sandbox: SIGTSTP: cannot stop the command ({e})");
                }
                if let Some(terminal) = &terminal {
                    terminal.suspend();
                }
                // Stops this whole process until the shell continues it.
                let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
                if let Err(e) = exec.job_control(false) {
                    say!("flowhost sandbox: SIGCONT: cannot continue the command ({e})");
                }
                if let Some(terminal) = &terminal {
                    terminal.resume();
                }
            }
            Some(_) = async {
                match resizes.as_mut() {
                    Some(resizes) => resizes.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Some(terminal) = &terminal {
                    terminal.resized();
                }
            }
            // As the command's terminal would: a key's signal to its foreground job.
            interrupt = interrupts.next() => {
                let delivered = match &terminal {
                    Some(terminal) => exec.interrupt_on_terminal(interrupt, terminal.master()),
                    None => exec.interrupt(interrupt),
                };
                if !matches!(delivered, Ok(Delivery::Ignored)) {
                    interrupted.get_or_insert(interrupt);
                }
                match delivered {
                    Ok(Delivery::Ended) => {
                        ended_by.get_or_insert(interrupt);
                    }
                    Ok(Delivery::Sent | Delivery::Ignored) => {}
                    // Whether it handles the signal cannot be told, or the signal not sent:
                    // it is ended, as the signal's default action would, so the run
                    // concludes.
                    Err(e) => {
                        say!(
                            "flowhost sandbox: {}: cannot pass it to the command ({e}); ending it",
                            interrupt.name()
                        );
                        if exec.kill().is_ok() {
                            ended_by.get_or_insert(interrupt);
                        }
                    }
                }
            }
        }
    };
    drop(exec);
    // What flowhost says from here comes after the command's last output.
    if let Some(terminal) = &terminal {
        terminal.hold();
    }
    // Every attempt must be decided (and recorded) before the records are closed; one
    // that is not makes the run's observation incomplete.
    let settled = matches!(
        tokio::time::timeout(Duration::from_secs(2), decider).await,
        Ok(Ok(()))
    );
    let cut_short = status.bound_description();
    if let Some(bound) = &cut_short {
        say!("flowhost sandbox: the command ran into {bound}");
    }
    // A writer that failed during the run (or cannot close) does not cut the end short: the
    // run's health is still written, saying its observation is incomplete and why, the gate
    // judges and the cgroups go; then the run fails.
    let records_failed = match &writer {
        Some(w) => w.close().await.err(),
        None => None,
    };
    let mut health = sandbox_health(&broker, writer.as_deref(), settled, records_failed.as_ref());
    if let Some(bound) = cut_short {
        health
            .cut_short
            .push(format!("the command ran into {bound}"));
    }
    if let Some(interrupt) = interrupted {
        health.cut_short.push(format!(
            "{} was passed on to the command before it ended (flowhost sandbox received it)",
            interrupt.name()
        ));
    }
    let health = health.finalize();
    // The executor's cgroups go before this process does (else they stay until another
    // broker sweeps them); removal started when it was reaped, so this rarely waits.
    if !broker.released(Duration::from_secs(2)).await {
        say!("flowhost sandbox: the command's cgroups were not removed within 2 s");
    }
    // Killed because it left the interrupt to its default action: it ends as that action
    // would have ended it, and the shell sees 128 + that signal.
    let code = match ended_by {
        Some(interrupt) if status.signal() == Some(libc::SIGKILL) => {
            if !args.quiet {
                say!(
                    "flowhost sandbox: {}: the command does not handle it and was ended",
                    interrupt.name()
                );
            }
            128 + interrupt.signal()
        }
        _ => status.code(),
    };
    let concluded = args.common.conclude(
        &evidence,
        &health,
        code.clamp(0, 255) as u8,
        records_failed.is_some(),
    );
    // What the run held goes before the wait below, which a kill may end (or SIGTTOU stop
    // until the user logs out): the run's scratch directory (its resolver file, its records
    // when they were kept only for the gate), the resolver, the broker.
    drop((dns, writer, broker, evidence));
    // On a stderr that is no terminal, what waits for the reader is written now; an
    // interrupt taken since the command ended, which nobody acted on, takes its default
    // action first, as it would have at once.
    if terminal.is_none() && queued_stderr::waiting() {
        let defaults = flowhost_broker::terminal::interrupts_take_their_default_action();
        // One turn of the runtime, so that an interrupt its handler noted meanwhile (while
        // the records closed, the gate judged) reaches the stream `taken` reads.
        tokio::task::yield_now().await;
        queued_stderr::finish(defaults, &mut || interrupts.taken());
    }
    // The run is over: what is left for the caller's terminal (the command's last output,
    // the messages above) reaches it now, however long the terminal takes.
    let shown = terminal.as_mut().map_or(Ok(()), |t| {
        t.finish(&mut || {
            let mut taken = interrupts.taken();
            // A Ctrl-Z taken since the command ended stops flowhost then, after the
            // interrupts (which end it).
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if suspends
                .as_mut()
                .is_some_and(|s| s.poll_recv(&mut cx).is_ready())
            {
                taken.push(libc::SIGTSTP);
            }
            taken
        })
    });
    let concluded = match (records_failed, concluded) {
        (Some(e), Ok(_)) => Err(SandboxError::RecordsFailed(e).into()),
        // The conclusion's own failure (a health that could not be written) is the error;
        // the writer's is said too.
        (Some(e), Err(other)) => {
            say!(
                "flowhost sandbox: the record writer had failed too: {}",
                flowhost_broker::Escaped(&e)
            );
            Err(other)
        }
        (None, concluded) => concluded,
    };
    match (concluded, shown) {
        (concluded, Ok(())) => concluded,
        // Output that was never shown is not vouched for by a status that says all went well.
        (Ok(code), Err(lost)) if code == ExitCode::SUCCESS => {
            Err(SandboxError::NotShown(lost).into())
        }
        // A failing status (the command's, or a failed gate's) stays what the run says, the
        // one verdict that cannot be lost with the terminal's output; the loss is said too.
        (Ok(code), Err(lost)) => {
            say!("flowhost sandbox: the command ran, but {lost}");
            Ok(code)
        }
        (Err(e), Err(lost)) => {
            say!("flowhost sandbox: {lost}");
            Err(e)
        }
    }
}

/// The interrupts a terminal or a service manager sends, taken from their default action
/// (which would end flowhost at once, and the command only through its parent-death signal,
/// leaving the run's health, gate and the caller's terminal behind).
struct Interrupts {
    streams: Vec<(Interrupt, tokio::signal::unix::Signal)>,
}

/// The interrupts (and SIGTSTP) the caller left ignored, by signal number.
fn ignored_by_caller() -> Result<Vec<libc::c_int>, SandboxError> {
    let signals = Interrupt::ALL
        .into_iter()
        .map(|i| (i.name(), i.signal()))
        .chain([("SIGTSTP", libc::SIGTSTP)]);
    let mut ignored = Vec::new();
    for (name, signal) in signals {
        match flowhost_broker::terminal::is_ignored(signal) {
            Ok(true) => ignored.push(signal),
            Ok(false) => {}
            Err(source) => {
                return Err(SandboxError::Signals {
                    signal: name,
                    source,
                });
            }
        }
    }
    Ok(ignored)
}

impl Interrupts {
    /// Takes every interrupt but the `ignored` ones, which flowhost never takes: they reach
    /// neither flowhost nor, through it, the command.
    fn listen(ignored: &[libc::c_int]) -> Result<Self, SandboxError> {
        let streams = Interrupt::ALL
            .into_iter()
            .filter(|i| !ignored.contains(&i.signal()))
            .map(|i| {
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::from_raw(i.signal()))
                    .map(|s| (i, s))
                    .map_err(|source| SandboxError::Signals {
                        signal: i.name(),
                        source,
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Interrupts { streams })
    }

    /// The signals of the interrupts received and not yet taken by [`Interrupts::next`].
    fn taken(&mut self) -> Vec<libc::c_int> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut taken = Vec::new();
        for (interrupt, stream) in &mut self.streams {
            if stream.poll_recv(&mut cx).is_ready() {
                taken.push(interrupt.signal());
            }
        }
        taken
    }

    /// The next interrupt received.
    async fn next(&mut self) -> Interrupt {
        std::future::poll_fn(|cx| {
            for (interrupt, stream) in &mut self.streams {
                if stream.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*interrupt);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}

/// What the rules say about an attempt, with the names its destination was handed out for
/// by the command's resolver (the last one first; empty: none); `None` for a lookup sent to
/// that resolver (allowed unjudged: the resolver judges the lookup itself). `upstream`: the
/// resolvers the command's own one asks (past which no lookup goes unjudged).
fn rule_on(
    rules: &DestinationRules,
    (dns, upstream): (Option<&ExecutorDns>, &Upstream),
    info: &AttemptInfo,
) -> Option<(Vec<HostName>, RuleDecision)> {
    let naming = match attempt_view(dns, Some(upstream), info) {
        AttemptView::ToResolver => return None,
        AttemptView::Egress(naming) => naming,
    };
    let decision = rules.decide(
        info.destination
            .as_ref()
            // A run's rules are never narrowed.
            .map(|d| crate::daemon::judged_destination(d, &naming, 0))
            .as_ref(),
    );
    Some((naming.names().to_vec(), decision))
}

/// Prints one attempt and its verdict (see [`attempt_line`]).
fn log_attempt(info: &AttemptInfo, names: &[HostName], allowed: bool, rule: &str) {
    say!("{}", attempt_line(info, names, allowed, rule));
}

/// One attempt and its verdict as printed, naming the caller's executable (read now if the
/// broker did not: an attempt judged at once comes without it).
fn attempt_line(info: &AttemptInfo, names: &[HostName], allowed: bool, rule: &str) -> String {
    format!(
        "flowhost sandbox: {} {}/{}/{} {}{} by pid {} ({}) -> {} ({})",
        info.syscall.as_str(),
        info.socket.family_name(),
        info.socket.type_name(),
        info.socket.protocol_name(),
        info.destination
            .as_ref()
            .map(|d| d.to_string())
            .unwrap_or_else(|| "(none)".into()),
        crate::dns::shown_names(names),
        info.pid,
        // The command chose its executable's path, as it chose its destination (whose
        // display escapes it): neither may rewrite the operator's terminal.
        info.executable_now()
            .map(|p| Escaped(p.display()).to_string())
            .unwrap_or_else(|| "?".into()),
        if allowed { "ALLOWED" } else { "REFUSED" },
        rule
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An interrupt flowhost's handlers took and nobody acted on is handed back (to take its
    /// default action before flowhost waits on its terminal), once; none is made up.
    #[tokio::test]
    async fn interrupts_taken_and_not_acted_on_are_handed_back() {
        let mut interrupts = Interrupts::listen(&[]).unwrap();
        assert!(interrupts.taken().is_empty());
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGQUIT).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let taken = loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let taken = interrupts.taken();
            if !taken.is_empty() || std::time::Instant::now() > deadline {
                break taken;
            }
        };
        assert_eq!(taken, [libc::SIGQUIT]);
        assert!(interrupts.taken().is_empty());
    }

    /// The command names its sockets and its executables: printed to the operator's
    /// terminal, their control bytes must not retitle, erase or rewrite it.
    #[test]
    fn a_printed_attempt_carries_no_control_characters() {
        let info = crate::daemon::unix_connect(
            flowhost_broker::Destination::UnixAbstract(b"\x1b]0;pwned\x07\x1b[2J".to_vec()),
            Some("/tmp/\x1b]0;exe\x07\r\x0e".into()),
        );
        let line = attempt_line(&info, &[], false, "default");
        assert!(line.contains("pwned") && line.contains("exe"), "{line}");
        assert!(!line.chars().any(char::is_control), "{line:?}");
    }

    #[test]
    fn records_go_into_a_new_or_empty_directory_only() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("a/b");
        prepare_records_dir(&fresh).unwrap();
        assert!(fresh.is_dir());
        // Empty: accepted again.
        prepare_records_dir(&fresh).unwrap();
        std::fs::write(fresh.join("records-00000000000000000001.jsonl"), b"").unwrap();
        let e = prepare_records_dir(&fresh).unwrap_err().to_string();
        assert!(e.contains("is not empty") && e.contains("a/b"), "{e}");
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = prepare_records_dir(&file).unwrap_err().to_string();
        assert!(e.contains("is a file"), "{e}");
        // An empty directory others may write is refused too, as the daemon's would be.
        // Before, it was taken: another user could put records there first, or take this
        // run's away.
        use std::os::unix::fs::PermissionsExt;
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare_records_dir(&shared).unwrap_err().to_string();
        assert!(e.contains("0777") && e.contains("shared"), "{e}");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o700)).unwrap();
        prepare_records_dir(&shared).unwrap();
        // Nor one in a directory others may write, made or found there, or reached through
        // a link in one: they could rename it away and put their own in its place. Before,
        // only the directory itself was looked at.
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::create_dir(open.join("empty")).unwrap();
        std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), open.join("link")).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        for inside in ["new/run", "empty", "link"] {
            let e = prepare_records_dir(&open.join(inside))
                .unwrap_err()
                .to_string();
            assert!(e.contains("0777") && e.contains("open"), "{inside}: {e}");
        }
        assert!(!open.join("new").exists());
        // Nor one reached through `..` from a directory made on the way: only the check
        // once it is made sees where it went.
        std::fs::create_dir(dir.path().join("c")).unwrap();
        let around = dir.path().join("c/made/../../open/x");
        let e = prepare_records_dir(&around).unwrap_err().to_string();
        assert!(e.contains("0777") && e.contains("open"), "{e}");
        // A sticky directory of root's is one others may write, and not rename in.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        if nix::unistd::geteuid().is_root() {
            prepare_records_dir(&open.join("new/run")).unwrap();
        } else {
            eprintln!("SKIP: a sticky directory of root's needs root to make");
        }
        // One only its group may write besides its owner (Ubuntu's /var/log, a directory
        // made under umask 002) is taken, with a note: refusing it refused the shipped
        // layout.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o775)).unwrap();
        prepare_records_dir(&open.join("grouped/run")).unwrap();
        let group_writable =
            crate::files::trusted_place_for_dir(&open.join("grouped/run")).unwrap();
        assert_eq!(group_writable.len(), 1, "{group_writable:?}");
        assert_eq!(group_writable[0].0, open);
    }

    /// A records directory made for a run is synced into its parent, each directory made on
    /// the way into its own; and one that held another run's records by the time the
    /// run's writer opened it (that run wrote between this run's check and its open) is
    /// refused. Before, the directory was made without a sync, and a run that lost that race
    /// went on in the other run's stream, its health vouching for the other run's records.
    #[test]
    fn a_runs_records_directory_is_durable_and_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("a/b");
        crate::files::SYNCED_DIRS.with(|synced| synced.borrow_mut().clear());
        prepare_records_dir(&fresh).unwrap();
        let synced = crate::files::SYNCED_DIRS.with(|synced| synced.take());
        for parent in [dir.path().to_path_buf(), dir.path().join("a")] {
            assert!(synced.contains(&parent), "{parent:?} not in {synced:?}");
        }
        let w = RecordWriter::open(&fresh, WriterOptions::default()).unwrap();
        records_of_this_run_alone(&fresh, &w.status()).unwrap();
        w.commit_blocking(crate::records::tests::sample_tool_call())
            .unwrap();
        records_of_this_run_alone(&fresh, &w.status()).unwrap();
        w.close_blocking().unwrap();
        let late = RecordWriter::open(&fresh, WriterOptions::default()).unwrap();
        let e = records_of_this_run_alone(&fresh, &late.status())
            .unwrap_err()
            .to_string();
        assert!(e.contains("another run's records"), "{e}");
    }
}
