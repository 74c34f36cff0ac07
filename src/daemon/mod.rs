//! The host daemon: `flowhost serve`.
//!
//! Startup order (each step fails closed, naming what failed): load the configuration;
//! verify and register every signed manifest; if the registry requires flow mediation and the
//! broker is disabled or cannot start, refuse — before opening any state or spawning anything;
//! check every execution profile against the kernel; then open the state directory, write the
//! retained signed set, open the flow-state database and the record writer, warm the executor
//! pools (one executor of every server must start), bind the socket (or take it from
//! systemd), and report ready.
//!
//! A generation (configuration + registry + executor pools) is immutable; SIGHUP builds a new
//! one and swaps it in atomically. Calls in flight finish on the generation they started on;
//! a new configuration that fails verification keeps the old generation and says why.

mod activation;
mod admission;
mod egress;
mod executor;
pub mod pipeline;
pub mod refusals;
pub mod reload;
mod session;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use flowhost_broker::{Broker, BrokerOptions, Profile};
use tokio::net::UnixListener;

use crate::config::{BrokerMode, HostConfig, topology_of};
use crate::records::health::{HealthError, HealthProducer, RecordsHealth};
use crate::records::{RecordWriter, ToolMapping, ToolObservationHealth, WriterOptions};
use crate::registry::{RuntimeTopology, VerifiedRegistry};
use crate::resolver::{CallPlan, Classifier, FlowResolver};
use crate::state::FlowStateStore;

pub use activation::listener_from_systemd;
pub use admission::{
    MAX_SESSIONS, MAX_SESSIONS_PER_UID, MAX_STRANGERS, MAX_STRANGERS_PER_UID, SUMMARY_INTERVAL,
};
pub use egress::{EgressJudge, broker_details, rules_destination};
pub use executor::{ExecutorError, ExecutorTemplate, McpExecutor, WarmPool};

/// Why the host refused to start (or to reload).
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A server's signed manifest could not be loaded.
    #[error("server {server:?}: {source}")]
    Manifest {
        /// The server.
        server: String,
        /// The error (boxed: manifest errors carry whole paths and reasons).
        source: Box<crate::manifest::ManifestFileError>,
    },
    /// A server's registered key could not be read.
    #[error("server {server:?}: registered key: {source}")]
    Key {
        /// The server.
        server: String,
        /// The error.
        source: crate::keys::KeyError,
    },
    /// A server's execution profile could not be loaded.
    #[error("server {server:?}: {source}")]
    Profile {
        /// The server.
        server: String,
        /// The error.
        source: flowhost_broker::ProfileError,
    },
    /// The configured topology contradicts the execution profile.
    #[error(
        "server {server:?}: topology {configured:?} contradicts profile {profile:?}, which implies {derived:?}"
    )]
    TopologyMismatch {
        /// The server.
        server: String,
        /// The configured value.
        configured: RuntimeTopology,
        /// The profile.
        profile: String,
        /// What the profile implies.
        derived: RuntimeTopology,
    },
    /// The manifest's server id differs from the configured id.
    #[error("server {configured:?}: the signed manifest is for server {signed:?}")]
    ServerIdMismatch {
        /// The configured id.
        configured: String,
        /// The id in the signed manifest.
        signed: String,
    },
    /// The registry refused a manifest.
    #[error("server {server:?} was not admitted: {source}")]
    Admission {
        /// The server.
        server: String,
        /// The admission rule that refused it.
        source: crate::registry::AdmissionError,
    },
    /// The registry needs the broker and the broker is disabled or unavailable.
    #[error("refusing to serve: {0}")]
    NoBroker(String),
    /// A profile cannot be enforced on this kernel.
    #[error("server {server:?}: {source}")]
    ProfileUnsupported {
        /// The server.
        server: String,
        /// Why.
        source: flowhost_broker::SpawnError,
    },
    /// A state path could not be prepared.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The retained signed set could not be written.
    #[error("cannot write the retained signed set: {0}")]
    RetainedSet(#[from] crate::files::FileError),
    /// The flow-state database could not be opened.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// A reload changed a setting that only a restart can apply.
    #[error(
        "{key} changed from {before} to {after}; only a restart applies it (restart the host, \
         or change it back to reload the rest)"
    )]
    NeedsRestart {
        /// The configuration key.
        key: &'static str,
        /// The running value.
        before: String,
        /// The value in the reloaded file.
        after: String,
    },
    /// The flow-state database is gone although the host has run before: starting would
    /// reset every label to bottom, which is exactly what flow state exists to prevent.
    #[error(
        "flow state {db} is missing, but {records} holds decision records of earlier runs: \
         starting would reset every principal's and session's label to bottom. Restore {db} \
         from a backup, or accept the loss by creating {ack} (removed once the host has started)"
    )]
    StateLost {
        /// The missing database.
        db: PathBuf,
        /// The record directory that proves earlier runs.
        records: PathBuf,
        /// The file an operator creates to accept the loss.
        ack: PathBuf,
    },
    /// The record writer could not be opened.
    #[error("cannot open the decision records: {0}")]
    Records(#[from] crate::records::RecordError),
    /// The flow state disagrees with what the decision records prove.
    #[error(transparent)]
    Continuity(#[from] crate::continuity::ContinuityError),
    /// A server's executor could not be started: serving would fail every call to it.
    #[error("server {server:?}: {source}")]
    ExecutorStart {
        /// The server.
        server: String,
        /// Why its executor did not start.
        source: ExecutorError,
    },
}

/// What an executor's egress is judged against while it serves a call.
#[derive(Debug)]
pub struct CallInFlight {
    /// The resolver's plan for the call.
    pub plan: CallPlan,
    /// The host's id for the call.
    pub call_id: String,
    /// The tool, as `server/tool`.
    pub tool: String,
    /// The call's trace context.
    pub correlation: crate::records::Correlation,
    /// The executor's pid (for warnings about it).
    pub executor_pid: i32,
}

/// What the host knows of one admitted server in a generation.
#[derive(Debug, Clone)]
pub struct ServerFacts {
    /// The signed manifest's digest.
    pub digest: String,
    /// Record mappings per tool.
    pub mappings: BTreeMap<String, ToolMapping>,
}

/// An immutable configuration + registry + pools.
pub struct Generation {
    /// Increases with every reload.
    pub id: u64,
    /// The configuration.
    pub config: HostConfig,
    /// The verified registry.
    pub registry: VerifiedRegistry,
    /// What the host knows of each server, by id.
    pub servers: BTreeMap<String, ServerFacts>,
    /// Each server's warm executors, by id.
    pub pools: BTreeMap<String, Arc<WarmPool<CallInFlight>>>,
}

/// Counters for `tool_observation_health`.
#[derive(Debug, Default)]
pub struct HostCounters {
    /// `tool_call` records committed by this run.
    pub tool_calls: AtomicU64,
    /// Calls to tools without a record mapping (`observed_unknown_tool`).
    pub unknown_tools: AtomicU64,
    /// Egress attempts the signed declaration does not admit, per `server/tool`.
    pub declaration_mismatches: Mutex<BTreeMap<String, u64>>,
}

/// The running host.
pub struct Host {
    generation: RwLock<Arc<Generation>>,
    next_generation: AtomicU64,
    /// The broker (always present: there is no unmediated execution path).
    pub broker: Broker,
    /// The flow resolver (and its durable state).
    pub resolver: Arc<FlowResolver>,
    /// The record writer.
    pub records: RecordWriter,
    /// Health counters.
    pub counters: Arc<HostCounters>,
    /// What the health carried over from the previous run.
    coverage: Coverage,
    /// Repeated refusals, folded (see [`refusals`]).
    pub(crate) refusals: refusals::RefusalFolder,
    /// Health warns below this much free space on the records filesystem.
    records_min_free_bytes: u64,
    /// Becomes true when the host is stopping (a watch: nobody can miss the change).
    shutdown: tokio::sync::watch::Sender<bool>,
    config_path: PathBuf,
    health_file: PathBuf,
    /// Which connections are served (see [`MAX_SESSIONS_PER_UID`]).
    admission: Arc<admission::Admission>,
}

/// Verifies and registers every configured manifest. Touches no state and spawns nothing.
pub fn verify_registry(
    config: &HostConfig,
) -> Result<(VerifiedRegistry, BTreeMap<String, Arc<Profile>>), StartupError> {
    let mut registry = VerifiedRegistry::new();
    let mut profiles = BTreeMap::new();
    for s in &config.servers {
        let envelope = crate::manifest::load_envelope_file(&s.manifest).map_err(|source| {
            StartupError::Manifest {
                server: s.id.clone(),
                source: Box::new(source),
            }
        })?;
        let signed_id = envelope.body().server_id().to_string();
        if signed_id != s.id {
            return Err(StartupError::ServerIdMismatch {
                configured: s.id.clone(),
                signed: signed_id,
            });
        }
        let key =
            crate::keys::verifying_key_from_arg(&s.key).map_err(|source| StartupError::Key {
                server: s.id.clone(),
                source,
            })?;
        let profile = Profile::find(&s.profile, &config.profiles_dir).map_err(|source| {
            StartupError::Profile {
                server: s.id.clone(),
                source,
            }
        })?;
        let derived = topology_of(&profile);
        if let Some(configured) = s.topology
            && configured != derived
        {
            return Err(StartupError::TopologyMismatch {
                server: s.id.clone(),
                configured,
                profile: profile.name.clone(),
                derived,
            });
        }
        let topologies = envelope
            .body()
            .tools()
            .iter()
            .map(|t| (t.name().to_string(), derived))
            .collect();
        registry
            .register(envelope, &key, &s.policies, &topologies)
            .map_err(|source| StartupError::Admission {
                server: s.id.clone(),
                source,
            })?;
        profiles.insert(s.id.clone(), Arc::new(profile));
    }
    Ok((registry, profiles))
}

/// Refuses a registry that needs the broker when the broker is disabled or cannot start,
/// and returns the broker otherwise.
pub fn require_broker(
    config: &HostConfig,
    registry: &VerifiedRegistry,
) -> Result<Broker, StartupError> {
    let needs = registry.requires_flow_runtime();
    if config.broker == BrokerMode::Disabled {
        return Err(StartupError::NoBroker(if needs {
            "the registry requires flow mediation (a tool declares flow, egresses, or has a clearance, floor or purpose), and the native broker is disabled (host.broker = \"disabled\")".into()
        } else {
            "the native broker is disabled (host.broker = \"disabled\") and flowhost has no unmediated way to run executors".into()
        }));
    }
    Broker::new(BrokerOptions {
        executor_identity: config.executor_identity,
        executor_uids: Some(config.executor_uids),
    })
    .map_err(|e| {
        StartupError::NoBroker(if needs {
            format!(
                "the registry requires flow mediation and the native broker is unavailable: {e}"
            )
        } else {
            format!("the native broker is unavailable: {e}")
        })
    })
}

/// Refuses a profile the broker cannot enforce, and logs, per server, which bounds its
/// executors run under and how (a `best_effort` bound the host cannot hold is a warning).
fn check_profiles(
    broker: &Broker,
    profiles: &BTreeMap<String, Arc<Profile>>,
) -> Result<(), StartupError> {
    for (server, profile) in profiles {
        broker
            .check_profile(profile)
            .map_err(|source| StartupError::ProfileUnsupported {
                server: server.clone(),
                source,
            })?;
        let report = broker.bounds(profile);
        tracing::info!(server = %server, "{report}");
        for b in report.not_in_force() {
            tracing::warn!(server = %server, field = b.field, "{} of profile {:?} is not in force on this host", b.field, profile.name);
        }
    }
    Ok(())
}

/// Refuses a reload that changes settings fixed at start (where state lives, how the
/// socket and broker were set up, the resolver's classifiers and input floor): applying the
/// rest while silently keeping the old values would make the file lie about the host.
fn refuse_restart_only_changes(running: &HostConfig, new: &HostConfig) -> Result<(), StartupError> {
    type Shown = fn(&HostConfig) -> String;
    let fixed: [(&'static str, Shown); 15] = [
        ("socket", |c| c.socket.display().to_string()),
        ("socket_mode", |c| format!("{:o}", c.socket_mode)),
        ("state_dir", |c| c.state_dir.display().to_string()),
        ("records_dir", |c| c.records_dir.display().to_string()),
        ("health_file", |c| c.health_file.display().to_string()),
        ("broker", |c| format!("{:?}", c.broker)),
        ("executor_uid/executor_gid", |c| {
            format!("{:?}", c.executor_identity)
        }),
        ("executor_uid_range", |c| c.executor_uids.to_string()),
        ("records_rotate_bytes", |c| {
            c.records_rotate_bytes.to_string()
        }),
        ("operator_input_floor", |c| {
            c.operator_input_floor.to_string()
        }),
        ("classifier_version", |c| c.classifier_version.clone()),
        ("refusal_fold_interval_ms", |c| {
            c.refusal_fold_interval.as_millis().to_string()
        }),
        ("refusal_records_per_interval", |c| {
            c.refusal_records_per_interval.to_string()
        }),
        ("records_min_free_mib", |c| {
            (c.records_min_free_bytes / (1024 * 1024)).to_string()
        }),
        ("classifier", |c| {
            let rules: Vec<String> = c
                .classifiers
                .iter()
                .map(|r| format!("{} -> {} {:?}", r.pattern.as_str(), r.label, r.scopes))
                .collect();
            format!("{rules:?}")
        }),
    ];
    for (key, shown) in fixed {
        let (before, after) = (shown(running), shown(new));
        if before != after {
            return Err(StartupError::NeedsRestart { key, before, after });
        }
    }
    Ok(())
}

/// The last durable record of a writer: its sequence number and line hash.
fn writer_head(status: &crate::records::WriterStatus) -> Option<(u64, String)> {
    status
        .last_seq
        .map(|seq| (seq, status.chain_head.as_str().to_string()))
}

/// What a run's health carries over from the previous run's: the start of the range it
/// vouches for and the counts in it. Carried only when the previous health was complete,
/// written by a daemon, and ends exactly where the records now end (so nothing happened
/// between that health and this run); otherwise the range starts with this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Coverage {
    first_seq: u64,
    tool_calls: u64,
    unknown_tools: u64,
}

impl Coverage {
    fn carried_over(health_file: &Path, status: &crate::records::WriterStatus) -> Coverage {
        let this_run = Coverage {
            first_seq: status.last_seq.map_or(1, |s| s.saturating_add(1)),
            tool_calls: 0,
            unknown_tools: 0,
        };
        let Ok(previous) = ToolObservationHealth::read_from(health_file) else {
            return this_run;
        };
        let ends_here = previous.records.last_seq == status.last_seq
            && previous.records.chain_head.as_deref() == Some(status.chain_head.as_str());
        match (
            previous.complete,
            previous.producer,
            previous.records.first_seq,
            previous.tool_calls_observed,
            previous.unknown_tool_count,
        ) {
            (
                true,
                HealthProducer::Daemon,
                Some(first_seq),
                Some(tool_calls),
                Some(unknown_tools),
            ) if ends_here => Coverage {
                first_seq,
                tool_calls,
                unknown_tools,
            },
            _ => this_run,
        }
    }
}

/// The flow-state database's file name inside `state_dir`.
pub const STATE_FILE: &str = "state.db";
/// The file an operator creates in `state_dir` to accept starting with fresh flow state
/// after the database was lost.
pub const STATE_RESET_FILE: &str = "state-reset-accepted";

/// Refuses a fresh flow state when the record directory shows earlier runs, unless the
/// operator accepted the reset. Returns whether a reset was accepted.
fn check_state_continuity(config: &HostConfig) -> Result<bool, StartupError> {
    let db = config.state_dir.join(STATE_FILE);
    if db.exists() {
        return Ok(false);
    }
    let ack = config.state_dir.join(STATE_RESET_FILE);
    if ack.exists() {
        return Ok(true);
    }
    let io = |source| StartupError::Io {
        path: config.records_dir.clone(),
        source,
    };
    let mut ran_before = false;
    for entry in std::fs::read_dir(&config.records_dir).map_err(io)? {
        let name = entry.map_err(io)?.file_name();
        if name
            .to_str()
            .and_then(crate::records::store::parse_record_file_name)
            .is_some()
        {
            ran_before = true;
            break;
        }
    }
    if ran_before {
        return Err(StartupError::StateLost {
            db,
            records: config.records_dir.clone(),
            ack,
        });
    }
    Ok(false)
}

fn ensure_dir(path: &Path, mode: u32) -> Result<(), StartupError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let io = |source| StartupError::Io {
        path: path.to_path_buf(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(io)?;
    let meta = std::fs::metadata(path).map_err(io)?;
    if meta.permissions().mode() & 0o022 != 0 {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "is writable by group or others; flowhost keeps its state private (chmod 700)",
        )));
    }
    Ok(())
}

impl Host {
    /// Starts the host from `config_file` (see the module docs for the order), serving on
    /// `passed` (a socket-activated listener) or on the configured socket. Returns the host
    /// and its listener.
    pub async fn start(
        config_file: &Path,
        passed: Option<std::os::unix::net::UnixListener>,
    ) -> Result<(Arc<Host>, UnixListener), StartupError> {
        let config = HostConfig::load(config_file)?;
        let (registry, profiles) = verify_registry(&config)?;
        let broker = require_broker(&config, &registry)?;
        check_profiles(&broker, &profiles)?;

        // Only now is any state touched.
        ensure_dir(&config.state_dir, 0o700)?;
        ensure_dir(&config.records_dir, 0o700)?;
        registry.write_retained_set(&config.state_dir.join("signed-manifests.json"))?;
        let reset_accepted = check_state_continuity(&config)?;
        let db = config.state_dir.join(STATE_FILE);
        let state = Arc::new(FlowStateStore::open(&db)?);
        let records = RecordWriter::open(
            &config.records_dir,
            WriterOptions {
                rotate_bytes: config.records_rotate_bytes,
                ..WriterOptions::default()
            },
        )?;
        let status = records.status();
        if reset_accepted {
            let ack = config.state_dir.join(STATE_RESET_FILE);
            tracing::warn!(path = %ack.display(), "flow state was reset by the operator; labels restart at bottom");
            crate::continuity::rebind(
                &state,
                writer_head(&status).as_ref().map(|(s, h)| (*s, h.as_str())),
            )?;
            std::fs::remove_file(&ack).map_err(|source| StartupError::Io { path: ack, source })?;
        } else {
            crate::continuity::check(
                &state,
                &crate::continuity::Places {
                    db: &db,
                    state_dir: &config.state_dir,
                    records: &config.records_dir,
                },
            )?;
        }
        let coverage = Coverage::carried_over(&config.health_file, &status);
        let resolver = Arc::new(FlowResolver::new(
            Classifier::new(config.classifiers.clone()),
            config.operator_input_floor.clone(),
            state,
        ));
        let health_file = config.health_file.clone();
        let counters = Arc::new(HostCounters::default());
        let refusals = refusals::RefusalFolder::new(
            config.refusal_fold_interval,
            config.refusal_records_per_interval,
        );
        let records_min_free_bytes = config.records_min_free_bytes;
        let generation = build_generation(
            1,
            config,
            registry,
            &profiles,
            &broker,
            (&resolver, &records, &counters),
        );
        // Before binding: a client that can connect finds every server's executors proven.
        prime_pools(&generation).await?;
        let listener = activation::bind(
            &generation.config.socket,
            generation.config.socket_mode,
            passed,
        )?;
        let host = Arc::new(Host {
            generation: RwLock::new(Arc::new(generation)),
            next_generation: AtomicU64::new(2),
            broker,
            resolver,
            records,
            counters,
            coverage,
            refusals,
            records_min_free_bytes,
            shutdown: tokio::sync::watch::channel(false).0,
            config_path: config_file.to_path_buf(),
            health_file,
            admission: Arc::new(admission::Admission::default()),
        });
        Ok((host, listener))
    }

    /// The generation new calls use.
    pub fn current(&self) -> Arc<Generation> {
        match self.generation.read() {
            Ok(g) => g.clone(),
            // A poisoned lock still holds a complete generation (the swap is one assignment).
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Re-reads the configuration and re-verifies every manifest; on success the new
    /// generation replaces the old one atomically; on failure the old one stays and the
    /// error is returned.
    pub async fn reload(&self) -> Result<u64, StartupError> {
        let config = HostConfig::load(&self.config_path)?;
        refuse_restart_only_changes(&self.current().config, &config)?;
        let (registry, profiles) = verify_registry(&config)?;
        if registry.requires_flow_runtime() && config.broker == BrokerMode::Disabled {
            return Err(StartupError::NoBroker(
                "the new configuration disables the broker while its registry requires flow mediation".into(),
            ));
        }
        check_profiles(&self.broker, &profiles)?;
        let id = self.next_generation.fetch_add(1, Ordering::SeqCst);
        let generation = build_generation(
            id,
            config,
            registry,
            &profiles,
            &self.broker,
            (&self.resolver, &self.records, &self.counters),
        );
        prime_pools(&generation).await?;
        // Only a generation that will serve replaces the retained signed set.
        generation
            .registry
            .write_retained_set(&generation.config.state_dir.join("signed-manifests.json"))?;
        let old = {
            let mut g = match self.generation.write() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            std::mem::replace(&mut *g, Arc::new(generation))
        };
        // Stopping the old warm executors can take a moment each; it happens in the
        // background so accepting and the watchdog do not wait for it.
        tokio::spawn(async move {
            for pool in old.pools.values() {
                pool.drain().await;
            }
        });
        Ok(id)
    }

    /// Whether the host is stopping.
    pub fn stopping(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Resolves once the host is stopping (immediately if it already is).
    pub async fn stopped(&self) {
        let mut rx = self.shutdown.subscribe();
        let _ = rx.wait_for(|stopping| *stopping).await;
    }

    /// Begins a graceful stop: [`run`] stops accepting, sessions finish their current
    /// request, then the host closes its records and writes its health.
    pub fn begin_shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// The current `tool_observation_health`, bound to the records it vouches for: its
    /// range starts where the last complete health of an earlier run started (or with this
    /// run), `tool_calls_observed` counts the `tool_call` records in that range, and the
    /// chain head is the last durable record's hash.
    pub fn health(&self) -> ToolObservationHealth {
        let stats = self.broker.stats();
        let status = self.records.status();
        let mut h = ToolObservationHealth::unknown(HealthProducer::Daemon);
        h.proxy_seen = Some(true);
        h.tool_calls_observed =
            Some(self.coverage.tool_calls + self.counters.tool_calls.load(Ordering::SeqCst));
        h.policy_layer_active = Some(true);
        h.classifier_version = Some(self.current().config.classifier_version.clone());
        h.unknown_tool_count =
            Some(self.coverage.unknown_tools + self.counters.unknown_tools.load(Ordering::SeqCst));
        h.redaction_active = Some(true);
        // The broker is not doing its work while a server's executors cannot start.
        h.broker_active = Some(!self.current().pools.values().any(|p| p.failing()));
        h.executors_spawned = Some(stats.spawned);
        // Every executor the broker spawned is either still supervised or has exited under
        // supervision; a supervisor failure is the only way one escapes the count.
        h.executors_supervised = Some(stats.supervised() + stats.exited);
        h.failed_notifications = Some(stats.failed_notifications + stats.supervisor_failures);
        h.records = RecordsHealth::from_writer(&status);
        let covered = status
            .last_seq
            .filter(|last| *last >= self.coverage.first_seq);
        h.records.first_seq = covered.map(|_| self.coverage.first_seq);
        h.records.last_seq = covered;
        if let Ok(m) = self.counters.declaration_mismatches.lock() {
            h.declaration_mismatches = m.clone();
        }
        if let Some(reason) = self.resolver.state().failure() {
            h.flow_state_failed = true;
            h.flow_state_failure_reason = Some(reason);
        }
        if let Some(low) = self.records_space_warning() {
            h.warnings.push(low);
        }
        h.finalize()
    }

    /// A warning when the records filesystem has less free space than the configured floor
    /// (before it is full and the writer has to refuse every call).
    pub fn records_space_warning(&self) -> Option<String> {
        let dir = &self.records.status().dir;
        match nix::sys::statvfs::statvfs(dir.as_path()) {
            Ok(st) => {
                let free = st.blocks_available().saturating_mul(st.fragment_size());
                (free < self.records_min_free_bytes).then(|| {
                    format!(
                        "{}: {} MiB free on the records filesystem, under the floor of {} MiB (records_min_free_mib); when it is full every call is refused",
                        dir.display(),
                        free / (1024 * 1024),
                        self.records_min_free_bytes / (1024 * 1024)
                    )
                })
            }
            Err(e) => Some(format!(
                "{}: cannot read the free space of the records filesystem: {e}",
                dir.display()
            )),
        }
    }

    /// Writes one record per fold whose interval has run out (all of them with `force`).
    pub async fn flush_refusals(&self, force: bool) {
        for record in self.refusals.take_due(force) {
            if let Err(e) = self.records.commit(record).await {
                tracing::error!(error = %e, "a folded refusal record could not be written");
            }
        }
    }

    /// Writes the health file (on demand and on shutdown).
    pub fn write_health(&self) -> Result<ToolObservationHealth, HealthError> {
        let h = self.health();
        h.write_to(&self.health_file)?;
        Ok(h)
    }

    /// Stops every pool, closes the record writer and writes the final health.
    pub async fn finish(&self) {
        for pool in self.current().pools.values() {
            pool.drain().await;
        }
        self.flush_refusals(true).await;
        if let Err(e) = self.records.close().await {
            tracing::error!(error = %e, "closing the decision records failed");
        } else if let Err(e) = crate::continuity::rebind(
            self.resolver.state(),
            writer_head(&self.records.status())
                .as_ref()
                .map(|(s, h)| (*s, h.as_str())),
        ) {
            tracing::error!(error = %e, "binding the flow state to the records failed");
        }
        if let Err(e) = self.write_health() {
            tracing::error!(error = %e, "writing the health file failed");
        }
    }
}

/// Starts one executor of every server and waits for it, then fills the pools in the
/// background: a server whose executors cannot start (a broker or sandbox that cannot work
/// under this service's settings) stops the start or the reload, naming the server and why,
/// instead of being reported ready while every call to it would fail.
async fn prime_pools(generation: &Generation) -> Result<(), StartupError> {
    for (server, pool) in &generation.pools {
        pool.prime()
            .await
            .map_err(|source| StartupError::ExecutorStart {
                server: server.clone(),
                source,
            })?;
    }
    for pool in generation.pools.values() {
        pool.refill();
    }
    Ok(())
}

fn build_generation(
    id: u64,
    config: HostConfig,
    registry: VerifiedRegistry,
    profiles: &BTreeMap<String, Arc<Profile>>,
    broker: &Broker,
    (resolver, records, counters): (&Arc<FlowResolver>, &RecordWriter, &Arc<HostCounters>),
) -> Generation {
    let mut servers = BTreeMap::new();
    let mut pools = BTreeMap::new();
    let origins: Arc<BTreeMap<_, _>> = Arc::new(
        config
            .principals
            .iter()
            .filter_map(|p| Some((p.id.clone(), p.destinations.clone()?)))
            .collect(),
    );
    for s in &config.servers {
        let Some(admitted) = registry.servers().find(|a| a.server_id() == s.id) else {
            continue;
        };
        let Some(profile) = profiles.get(&s.id) else {
            continue;
        };
        let digest = admitted.manifest_digest().to_string();
        let judge = Arc::new(EgressJudge {
            server_id: s.id.clone(),
            digest: digest.clone(),
            resolver: resolver.clone(),
            records: records.clone(),
            destinations: Arc::new(s.destinations.clone()),
            origins: origins.clone(),
            counters: counters.clone(),
            warned: Default::default(),
        });
        let template = ExecutorTemplate {
            server: s.id.clone(),
            argv: s.command.clone(),
            env: s.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            profile: profile.clone(),
            read_paths: s.read_paths.clone(),
        };
        let pool = WarmPool::new(
            broker.clone(),
            template,
            judge,
            s.pool_size,
            config.call_timeout,
            config.max_message_bytes,
        );
        servers.insert(
            s.id.clone(),
            ServerFacts {
                digest,
                mappings: s.record_mappings.clone(),
            },
        );
        pools.insert(s.id.clone(), pool);
    }
    Generation {
        id,
        config,
        registry,
        servers,
        pools,
    }
}

/// A random 128-bit id, as hex (sessions, calls).
pub(crate) fn random_id() -> String {
    use rand_core::RngCore;
    let mut bytes = [0u8; 16];
    rand_core::OsRng.fill_bytes(&mut bytes);
    hex::encode(bytes)
}

impl Host {
    /// Admits or refuses a new connection by its peer's credentials (checked before it
    /// takes any shared slot); a refusal is logged, rate-limited, and the stream closed.
    fn admit(&self, stream: &tokio::net::UnixStream) -> Option<(admission::Slot, u32, u32)> {
        let Ok(cred) = stream.peer_cred() else {
            tracing::warn!("cannot read a peer's credentials; closing the connection");
            return None;
        };
        let (uid, gid) = (cred.uid(), cred.gid());
        let class = if self.current().config.principal_for(uid, gid).is_some() {
            admission::PeerClass::Principal
        } else {
            admission::PeerClass::Stranger
        };
        match self.admission.admit(uid, class) {
            Ok(slot) => Some((slot, uid, gid)),
            Err(refusal) => {
                self.admission.log_refusal(uid, class, refusal);
                None
            }
        }
    }
}

/// Runs the host until SIGTERM/SIGINT: accepts connections, reloads on SIGHUP, keeps the
/// systemd watchdog fed, and on stop lets sessions finish their current request.
pub async fn run(host: Arc<Host>, listener: UnixListener) {
    use tokio::signal::unix::{SignalKind, signal};
    let notify = |states: &[sd_notify::NotifyState]| {
        let _ = sd_notify::notify(false, states);
    };
    let (mut term, mut int, mut hup) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(t), Ok(i), Ok(h)) => (t, i, h),
        _ => {
            tracing::error!("cannot install signal handlers; stopping");
            return;
        }
    };
    let mut watchdog_usec = 0u64;
    let watchdog = sd_notify::watchdog_enabled(false, &mut watchdog_usec);
    let mut tick = tokio::time::interval(if watchdog {
        Duration::from_micros(watchdog_usec / 2).max(Duration::from_millis(100))
    } else {
        Duration::from_secs(3600)
    });
    let mut summaries = tokio::time::interval(SUMMARY_INTERVAL);
    let mut sessions = tokio::task::JoinSet::new();
    let mut housekeeping = tokio::time::interval(
        host.refusals
            .interval()
            .min(Duration::from_secs(30))
            .max(Duration::from_millis(100)),
    );
    let mut last_space_warning: Option<tokio::time::Instant> = None;
    let status = {
        let generation = host.current();
        format!(
            "serving {} tools from {} servers on {}",
            generation.registry.tools().count(),
            generation.servers.len(),
            generation.config.socket.display()
        )
    };
    notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&status),
    ]);
    tracing::info!("{status}");
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // A refused connection is closed at once: the client sees end-of-stream,
                    // not a hang, and the daemon keeps descriptors for the sessions it serves.
                    if let Some((slot, uid, gid)) = host.admit(&stream) {
                        sessions.spawn(session::serve(host.clone(), stream, slot, uid, gid));
                    }
                }
                Err(e) => {
                    // Typically EMFILE/ENFILE: retrying at once would spin; let sessions end.
                    tracing::warn!(error = %e, "accept failed; pausing accepts for 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            // Reap finished sessions so the set does not grow without bound.
            Some(_) = sessions.join_next(), if !sessions.is_empty() => {}
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = host.stopped() => break,
            _ = hup.recv() => {
                let started_usec = reload::monotonic_usec();
                match started_usec {
                    Some(u) => notify(&[sd_notify::NotifyState::Reloading, sd_notify::NotifyState::MonotonicUsec(u.into())]),
                    None => notify(&[sd_notify::NotifyState::Reloading]),
                }
                let outcome = host.reload().await;
                let (accepted, generation, status) = match &outcome {
                    Ok(id) => (true, *id, format!("reloaded: generation {id}")),
                    Err(e) => (false, host.current().id, format!("reload refused, still serving the previous configuration: {e}")),
                };
                if accepted {
                    tracing::info!("{status}");
                } else {
                    tracing::error!("{status}");
                }
                notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)]);
                // `flowhost reload` (ExecReload) waits for this; without it, it fails closed.
                let verdict = reload::ReloadVerdict {
                    pid: std::process::id(),
                    started_usec: started_usec.unwrap_or(0),
                    accepted,
                    generation,
                    message: status,
                };
                if let Err(e) = verdict.write(&host.current().config.state_dir) {
                    tracing::error!("cannot write the reload verdict: {e}");
                }
            }
            _ = summaries.tick() => host.admission.summarize(),
            _ = tick.tick() => {
                if watchdog {
                    notify(&[sd_notify::NotifyState::Watchdog]);
                }
            }
            _ = housekeeping.tick() => {
                host.flush_refusals(false).await;
                if let Some(low) = host.records_space_warning()
                    && last_space_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(300))
                {
                    tracing::warn!("{low}");
                    last_space_warning = Some(tokio::time::Instant::now());
                }
            }
        }
    }
    notify(&[
        sd_notify::NotifyState::Stopping,
        sd_notify::NotifyState::Status("stopping"),
    ]);
    tracing::info!("stopping: finishing calls in flight");
    host.begin_shutdown();
    drop(listener);
    let drain = async { while sessions.join_next().await.is_some() {} };
    if tokio::time::timeout(
        host.current().config.call_timeout + Duration::from_secs(2),
        drain,
    )
    .await
    .is_err()
    {
        tracing::warn!("sessions did not finish in time");
    }
    host.finish().await;
}
