//! Starting the host: the configuration verified and every manifest admitted, the broker
//! required, profiles checked against the kernel, then (only then) state opened, bound to the
//! records, and the executors proven, before the socket is bound.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};

use flowhost_broker::{Broker, BrokerOptions, Profile};
use tokio::net::UnixListener;

use super::*;
use crate::config::{BrokerMode, HostConfig, StateConfig, topology_of};
use crate::records::health::HealthProducer;
use crate::records::{RecordWriter, ToolObservationHealth, WriterOptions};
use crate::registry::{RETAINED_SET_FILE, RuntimeTopology, VerifiedRegistry};
use crate::resolver::{Classifier, FlowResolver};
use crate::state::FlowStateStore;
use crate::state::postgres::PostgresStore;

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
    /// The server that offers its tools under bare names signs a tool or prompt name with
    /// `/`, which clients would take for another server's `server/tool`.
    #[error(
        "server {server:?} offers its tools and prompts under bare names (unqualified_names), \
         but its manifest signs the {kind} {name:?}, which holds '/': clients would call it as \
         {name:?} and reach server {:?} instead; serve it qualified (drop unqualified_names)",
        name.split('/').next().unwrap_or(name)
    )]
    SeparatorInBareName {
        /// The server.
        server: String,
        /// `tool` or `prompt`.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// The registry refused a manifest.
    #[error("server {server:?} was not admitted: {source}")]
    Admission {
        /// The server.
        server: String,
        /// The admission rule that refused it.
        source: crate::registry::AdmissionError,
    },
    /// The HTTP listener could not start.
    #[error(transparent)]
    Http(#[from] super::http::HttpError),
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
         from a backup, or rebuild it from the records with `flowhost state rebuild --records \
         {records} --state-dir {state_dir}`, or accept the loss by creating {ack} (removed \
         once the host has started)"
    )]
    StateLost {
        /// The missing database.
        db: PathBuf,
        /// Its state directory.
        state_dir: PathBuf,
        /// The record directory that proves earlier runs.
        records: PathBuf,
        /// The file an operator creates to accept the loss.
        ack: PathBuf,
    },
    /// The file accepting a reset of the flow state is there although the state file is
    /// too: left from an earlier reset (or made by mistake), it would silently accept a later
    /// loss of the state file.
    #[error(
        "{ack} accepts starting with fresh flow state, but {db} exists: the acceptance is \
         left from an earlier reset, was made by mistake, or a start that accepted a reset \
         made {db} and then failed; it would silently accept a later loss of {db}. If {db} \
         is the state you mean to keep, remove {ack}; if that reset is still what you mean, \
         remove {db} as well"
    )]
    ResetAcceptanceLeft {
        /// The acceptance file.
        ack: PathBuf,
        /// The state file next to it.
        db: PathBuf,
    },
    /// The record writer could not be opened.
    #[error("cannot open the decision records: {0}")]
    Records(#[from] crate::records::RecordError),
    /// The flow state disagrees with what the decision records prove.
    #[error(transparent)]
    Continuity(#[from] crate::continuity::ContinuityError),
    /// A server's command cannot start as an executor (checked before any is spawned).
    #[error("server {server:?}: its command cannot start as an executor: {source}")]
    Runtime {
        /// The server.
        server: String,
        /// Why.
        source: crate::runtime::RuntimeProblem,
    },
    /// A server's executor could not be started: serving would fail every call to it.
    #[error("server {server:?}: {source}")]
    ExecutorStart {
        /// The server.
        server: String,
        /// Why its executor did not start.
        source: ExecutorError,
    },
    /// The retained set of manifests served before cannot be read.
    #[error("cannot read the manifests this host served before: {0}")]
    RetainedSetUnreadable(#[from] crate::manifest::ManifestFileError),
    /// A server would be served an older manifest than before.
    #[error(transparent)]
    Rollback(#[from] crate::registry::RollbackError),
    /// A reload ended without an outcome (its task panicked): nothing was replaced.
    #[error("the reload ended without an outcome: {0}")]
    ReloadAborted(String),
    /// A reload was refused, but servers, declassification authorities and principals
    /// (or parts of principals) the configuration no longer vouches for were withdrawn
    /// anyway (each with why).
    #[error(
        "{refused}; withdrawn from service although the reload is refused: {}",
        withdrawn.iter().map(|(server, why)| format!("server {server:?} ({why})"))
            .chain(authorities.iter().map(|(a, why)| format!("declassification authority {a:?} ({why})")))
            .chain(principals.iter().map(|(p, why)| format!("principal {p:?} ({why})")))
            .collect::<Vec<_>>().join(", ")
    )]
    RefusedButWithdrew {
        /// Why the reload was refused.
        refused: Box<StartupError>,
        /// The servers withdrawn, each with why.
        withdrawn: BTreeMap<String, String>,
        /// The declassification authorities no longer trusted, each with why.
        authorities: BTreeMap<String, String>,
        /// The principals taken out or narrowed, each with what was withdrawn.
        principals: BTreeMap<String, String>,
    },
}

impl StartupError {
    /// Whether the cause may pass by itself, so that starting again later can succeed: the
    /// flow-state database unreachable, not taking writes (a failover under way), or still
    /// held by a daemon that is stopping.
    /// Everything else is a refusal (the configuration, a manifest, the broker on this host,
    /// an executor that cannot start under it, a database set up so that it cannot be used)
    /// that a retry cannot change.
    pub fn may_pass(&self) -> bool {
        use crate::continuity::ContinuityError;
        use crate::state::StateError;
        use crate::state::postgres::PgError;
        let state_may_pass = |e: &StateError| {
            matches!(
                e,
                StateError::InUse { .. }
                    | StateError::Postgres(
                        PgError::Connect { .. }
                            | PgError::Timeout { .. }
                            | PgError::Cancelled { .. }
                            | PgError::ReadOnly { .. }
                    )
            )
        };
        match self {
            StartupError::State(e) => state_may_pass(e),
            // The start's check of the state against the records talks to the same
            // database: a restart or a slow moment there passes as it does at open.
            StartupError::Continuity(ContinuityError::State(e)) => state_may_pass(e),
            _ => false,
        }
    }
}

/// Refuses `registry` if it would serve a server an older manifest than the set retained in
/// `state_dir` (the newest manifest each server was served with) holds for it, and returns
/// that set for [`VerifiedRegistry::write_retained_set`]. No retained set: nothing served
/// before, nothing to compare.
pub fn check_no_rollback(
    registry: &VerifiedRegistry,
    state_dir: &std::path::Path,
) -> Result<Vec<crate::registry::RetainedManifest>, StartupError> {
    let file = state_dir.join(RETAINED_SET_FILE);
    // Only a set that is not there is no set: one that cannot be looked at (a dangling
    // link, an I/O error), read as absent, would skip the check and then be replaced.
    match std::fs::symlink_metadata(&file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        _ => {}
    }
    let retained = crate::registry::load_retained_set(&file)?;
    registry.check_no_rollback(&retained, &file)?;
    Ok(retained)
}

/// Verifies and registers every configured manifest. Touches no state and spawns nothing.
pub fn verify_registry(
    config: &HostConfig,
) -> Result<(VerifiedRegistry, BTreeMap<String, Arc<Profile>>), StartupError> {
    let mut registry = VerifiedRegistry::new();
    let mut profiles = BTreeMap::new();
    // A profiles directory named but not there (a typo, a mount not up) is refused: its
    // profiles would be silently replaced by the built-in ones of the same names, which an
    // operator's file may have made stricter.
    for dir in &config.profiles_dir {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(StartupError::Io {
                    path: dir.clone(),
                    source: std::io::Error::other(
                        "host.profiles_dir names it, and it is not a directory",
                    ),
                });
            }
            Err(source) => {
                return Err(StartupError::Io {
                    path: dir.clone(),
                    source: std::io::Error::new(
                        source.kind(),
                        format!("host.profiles_dir names it: {source}"),
                    ),
                });
            }
        }
    }
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
        if s.unqualified_names {
            let body = envelope.body();
            let mut names = body
                .tools()
                .iter()
                .map(|t| ("tool", t.name()))
                .chain(body.prompts().iter().map(|p| ("prompt", p.name())));
            if let Some((kind, name)) = names.find(|(_, n)| n.contains('/')) {
                return Err(StartupError::SeparatorInBareName {
                    server: s.id.clone(),
                    kind,
                    name: name.to_string(),
                });
            }
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
            .register_with_content(
                envelope,
                &key,
                &s.policies,
                &topologies,
                s.content_floor.as_ref(),
            )
            .map_err(|source| StartupError::Admission {
                server: s.id.clone(),
                source,
            })?;
        profiles.insert(s.id.clone(), Arc::new(profile));
    }
    Ok((registry, profiles))
}

/// Keeps every executor from the host's own listeners (the socket file `listener` is bound
/// to, and the HTTP listener): the broker connects for them, so a connection that reached
/// the host would arrive with the broker's uid and could be taken for the principal of
/// that uid, or the HTTP listener's unauthenticated loopback principal.
fn keep_executors_from_the_host(
    broker: &Broker,
    listener: &tokio::net::UnixListener,
    http: Option<&super::http::HttpListener>,
) -> Result<(), StartupError> {
    let bound = listener.local_addr().map_err(|source| StartupError::Io {
        path: PathBuf::from("the host's socket"),
        source,
    })?;
    // A socket this process bound, or one `activation::adopt` proved is bound to a file.
    let Some(socket) = bound.as_pathname() else {
        return Err(StartupError::Io {
            path: PathBuf::from("the host's socket"),
            source: std::io::Error::other("it is not bound to a file"),
        });
    };
    let tcp: Vec<_> = http.and_then(|h| h.local_addr()).into_iter().collect();
    broker
        .keep_executors_from(&[socket], &tcp)
        .map_err(|source| StartupError::Io {
            path: socket.to_path_buf(),
            source,
        })
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
    .map_err(|e| broker_unavailable(&e, needs))
}

/// The start's refusal when the broker cannot run: a range of executor uids that holds a
/// local user's or group's id (which the broker checks as it starts) names the setting.
fn broker_unavailable(e: &flowhost_broker::BrokerError, needs: bool) -> StartupError {
    StartupError::NoBroker(match (e, needs) {
        (flowhost_broker::BrokerError::UidRange(_), _) => format!("host.executor_uid_range: {e}"),
        (_, true) => {
            format!(
                "the registry requires flow mediation and the native broker is unavailable: {e}"
            )
        }
        (_, false) => format!("the native broker is unavailable: {e}"),
    })
}

/// Refuses a profile the broker cannot enforce, and logs, per server, which bounds its
/// executors run under and how (a `best_effort` bound the host cannot hold is a warning).
pub(super) fn check_profiles(
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

/// Checks that every server's program can be executed by an executor (its uid, its
/// profile's Landlock paths and the server's read paths), naming the cause where exec would
/// only fail with ENOENT or EACCES.
pub(super) fn check_commands(
    config: &HostConfig,
    profiles: &BTreeMap<String, Arc<Profile>>,
) -> Result<(), StartupError> {
    let id = config.executor_identity_hint();
    for s in &config.servers {
        let (Some((program, args)), Some(profile)) = (s.command.split_first(), profiles.get(&s.id))
        else {
            continue;
        };
        let readable = readable(profile, &s.read_paths);
        let mut reachable = readable.clone();
        reachable.extend(profile.read_write.iter().cloned());
        let path_var = (s.env.get("PATH").map(String::as_str))
            .unwrap_or(flowhost_broker::DEFAULT_EXECUTOR_PATH);
        crate::runtime::check_program(Path::new(program), id, &readable, path_var)
            .and_then(|()| crate::runtime::check_unchangeable(Path::new(program), path_var))
            .and_then(|()| crate::runtime::check_arguments_unchangeable(args))
            .and_then(|()| crate::runtime::check_path_arguments(args, id, &reachable))
            .map_err(|source| StartupError::Runtime {
                server: s.id.clone(),
                source,
            })?;
    }
    Ok(())
}

/// What executors of `profile` with the server's `read_paths` may read and execute.
pub(super) fn readable(profile: &Profile, read_paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut readable = profile.read_only.clone();
    readable.extend(read_paths.iter().cloned());
    readable
}

/// Refuses a reload that changes settings fixed at start (where state lives, how the
/// socket and broker were set up, the resolver's classifiers and input floor): applying the
/// rest while silently keeping the old values would make the file lie about the host.
pub(super) fn refuse_restart_only_changes(
    running: &HostConfig,
    new: &HostConfig,
) -> Result<(), StartupError> {
    type Shown = fn(&HostConfig) -> String;
    let fixed: [(&'static str, Shown); 18] = [
        ("socket", |c| c.socket.display().to_string()),
        ("socket_mode", |c| format!("{:o}", c.socket_mode)),
        ("http", |c| format!("{:?}", c.http)),
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
        ("state", |c| format!("{:?}", c.state)),
        ("refusal_fold_interval_ms", |c| {
            c.refusal_fold_interval.as_millis().to_string()
        }),
        ("refusal_records_per_interval", |c| {
            c.refusal_records_per_interval.to_string()
        }),
        ("records_min_free_mib", |c| {
            (c.records_min_free_bytes / (1024 * 1024)).to_string()
        }),
        ("state_check_interval_ms", |c| {
            c.state_check_interval.as_millis().to_string()
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
pub(super) fn writer_head(status: &crate::records::WriterStatus) -> Option<(u64, String)> {
    status
        .last_seq
        .map(|seq| (seq, status.chain_head.as_str().to_string()))
}

/// What a run's health carries over from the previous run's: the start of the range it
/// vouches for and the counts in it. Carried only when the previous health was complete,
/// written by a daemon, and ends exactly where the records now end (so nothing happened
/// between that health and this run); otherwise the range starts with this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Coverage {
    pub(super) first_seq: u64,
    pub(super) tool_calls: u64,
    pub(super) unknown_tools: u64,
}

impl Coverage {
    pub(super) fn carried_over(
        health_file: &Path,
        status: &crate::records::WriterStatus,
    ) -> Coverage {
        let this_run = Coverage {
            first_seq: status.last_seq.map_or(1, |s| s.saturating_add(1)),
            tool_calls: 0,
            unknown_tools: 0,
        };
        // The counts carried over become what this run's health vouches for, so they are
        // taken only from a file no one but root or the daemon's user could have written
        // (nor pointed the name elsewhere): a health file outside the state directory may
        // sit in a directory others write.
        let read = crate::files::trusted_target(health_file)
            .and_then(|p| crate::files::read_trusted(&p, HEALTH_FILE_LIMIT, false));
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(crate::files::TrustedFileError::File(crate::files::FileError::Open {
                source,
                ..
            })) if source.kind() == std::io::ErrorKind::NotFound => return this_run,
            Err(e) => {
                tracing::warn!(
                    "the previous run's health is not carried over: {e}; this run's health covers only this run"
                );
                return this_run;
            }
        };
        let Ok(previous) = ToolObservationHealth::from_bytes(health_file, &bytes) else {
            return this_run;
        };
        // Only a health written as its run ended vouches for that run's tail: one asked for
        // while it went on (its writer failing, or the host killed, after it) may end where
        // the records do because what came after was refused without a record.
        let ends_here = previous.run_ended == Some(true)
            && previous.records.last_seq == status.last_seq
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

/// Most bytes of a previous run's health file read at start (one is a few hundred).
const HEALTH_FILE_LIMIT: u64 = 1024 * 1024;

/// The flow-state database's file name inside `state_dir`.
pub const STATE_FILE: &str = "state.db";
/// The file an operator creates in `state_dir` to accept starting with fresh flow state
/// after the database was lost.
pub const STATE_RESET_FILE: &str = "state-reset-accepted";

/// Refuses a fresh flow state when the record directory shows earlier runs, unless the
/// operator accepted the reset. Returns whether a reset was accepted.
fn check_state_continuity(state_dir: &Path, records_dir: &Path) -> Result<bool, StartupError> {
    let db = state_dir.join(STATE_FILE);
    let ack = state_dir.join(STATE_RESET_FILE);
    // Whatever the entry is (a link included): the operator made it to accept a reset.
    let accepted = ack.symlink_metadata().is_ok();
    if db.exists() {
        // Kept, an acceptance would wait here for the state file's next loss and accept
        // that silently: it is for one reset, the one it was made for.
        if accepted {
            return Err(StartupError::ResetAcceptanceLeft { ack, db });
        }
        return Ok(false);
    }
    if accepted {
        return Ok(true);
    }
    let io = |source| StartupError::Io {
        path: records_dir.to_path_buf(),
        source,
    };
    let mut ran_before = false;
    for entry in std::fs::read_dir(records_dir).map_err(io)? {
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
            state_dir: state_dir.to_path_buf(),
            records: records_dir.to_path_buf(),
            ack,
        });
    }
    Ok(false)
}

/// Creates the state directory `path` (mode 0700) when missing, and refuses one that anyone
/// but root or this process's user could change (see [`crate::files::OthersMayChange`]): they
/// could put a state file with lower labels in place. For `flowhost state rebuild`, which
/// writes the state the host will trust.
pub fn prepare_state_dir(path: &Path) -> Result<(), StartupError> {
    ensure_dir(path, 0o700)
}

/// Creates the state or record directory `path` if needed, each directory it makes synced
/// into its parent (the record writer's own syncs find them made), and refuses one others
/// may change.
fn ensure_dir(path: &Path, mode: u32) -> Result<(), StartupError> {
    let io = |source| StartupError::Io {
        path: path.to_path_buf(),
        source,
    };
    // Whoever may change a directory above it could put another in its place. Checked
    // again once made (a parent made meanwhile by another, a `..`).
    let place = || {
        crate::files::trusted_place_for_dir(path).map_err(|e| {
            io(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("cannot be trusted: {e}"),
            ))
        })
    };
    place()?;
    crate::files::create_dir_all_synced(path, mode).map_err(|e| StartupError::Io {
        source: std::io::Error::new(e.source.kind(), format!("cannot {}: {}", e.op, e.source)),
        path: e.path,
    })?;
    let meta = std::fs::metadata(path).map_err(io)?;
    if let Some(why) = crate::files::others_may_change_file(&meta) {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{why}; flowhost keeps its state private (chmod 700, owned by its user)"),
        )));
    }
    for (dir, why) in place()? {
        tracing::warn!(
            "{} {why}: its group's members could replace {} below it",
            dir.display(),
            path.display()
        );
    }
    Ok(())
}

/// Refuses a start whose health file could not be written: the health is written on demand
/// and at every stop, and a run whose final health cannot be written cannot be vouched for
/// (the stop exits unclean, each time). Found now rather than at the first stop: a
/// directory that is missing, or one the daemon may not write (a read-only mount under the
/// unit's `ProtectSystem=strict`).
fn check_health_file_place(health_file: &Path) -> Result<(), StartupError> {
    crate::files::can_create_at(health_file).map_err(|source| StartupError::Io {
        path: health_file.to_path_buf(),
        source: std::io::Error::new(
            source.kind(),
            format!("health_file cannot be written there: {source}"),
        ),
    })
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
        check_commands(&config, &profiles)?;

        // Only now is any state touched.
        ensure_dir(&config.state_dir, 0o700)?;
        ensure_dir(&config.records_dir, 0o700)?;
        check_health_file_place(&config.health_file)?;
        // The state first: a state file is held by one process at a time, so a second host
        // on this state directory stops here, before it changes anything the first uses.
        let (state, db, reset_accepted) = match &config.state {
            StateConfig::Sqlite => {
                let reset_accepted =
                    check_state_continuity(&config.state_dir, &config.records_dir)?;
                let db = config.state_dir.join(STATE_FILE);
                (FlowStateStore::open(&db)?, db, reset_accepted)
            }
            // A shared database has no file to lose: a wiped or foreign database shows as
            // labels missing that this host's records prove (the continuity check below).
            StateConfig::Postgres(pg) => (
                FlowStateStore::with_backend(Box::new(PostgresStore::open(pg).await?)),
                pg.url_file.clone(),
                false,
            ),
        };
        tracing::info!(state = %state.describe(), "flow state opened");
        // Executors' resolv.conf files a previous run left behind (each belongs to an
        // executor of that run, all gone now).
        let _ = std::fs::remove_dir_all(config.state_dir.join("resolv"));
        let retained = check_no_rollback(&registry, &config.state_dir)?;
        let state = Arc::new(state);
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
            )
            .await?;
            // Used once: removed, durably, so that it cannot accept a later loss (a start
            // that finds it next to the state file is refused).
            std::fs::remove_file(&ack)
                .and_then(|()| crate::files::sync_dir(&config.state_dir))
                .map_err(|source| StartupError::Io { path: ack, source })?;
        } else {
            crate::continuity::check(
                &state,
                &crate::continuity::Places {
                    db: &db,
                    state_dir: &config.state_dir,
                    records: &config.records_dir,
                    host_id: match &config.state {
                        StateConfig::Postgres(pg) => Some(&pg.host_id),
                        StateConfig::Sqlite => None,
                    },
                },
            )
            .await?;
        }
        let coverage = Coverage::carried_over(&config.health_file, &status);
        let resolver = Arc::new(FlowResolver::new(
            Classifier::new(config.classifiers.clone()),
            config.operator_input_floor.clone(),
            state,
            &config.authorities,
        ));
        let health_file = config.health_file.clone();
        let counters = Arc::new(HostCounters::default());
        let refusals = Arc::new(refusals::RefusalFolder::new(
            config.refusal_fold_interval,
            config.refusal_records_per_interval,
        ));
        let records_min_free_bytes = config.records_min_free_bytes;
        let generation = build_generation(
            1,
            config,
            registry,
            &profiles,
            &broker,
            (&resolver, &records, &counters),
            &refusals,
        );
        // Before binding: a client that can connect finds every server's executors proven.
        prime_pools(&generation).await?;
        let listener = activation::bind(
            &generation.config.socket,
            generation.config.socket_mode,
            passed,
        )?;
        let http = match &generation.config.http {
            Some(c) => Some(super::http::HttpListener::bind(c)?),
            None => None,
        };
        keep_executors_from_the_host(&broker, &listener, http.as_ref())?;
        // Only once the host will serve: a start that fails before (an executor that cannot
        // start, a socket that cannot be bound) must not make what it never served the
        // version a later configuration is held to.
        generation.registry.write_retained_set(
            &generation.config.state_dir.join(RETAINED_SET_FILE),
            &retained,
        )?;
        let host = Arc::new(Host {
            http_auth: http.as_ref().map(super::http::HttpListener::authenticator),
            http_tls: http
                .as_ref()
                .and_then(super::http::HttpListener::certificates),
            http: std::sync::Mutex::new(http),
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
            no_reloads: Default::default(),
            retired_origins: Default::default(),
            executors: Default::default(),
            reloading: Default::default(),
        });
        Ok((host, listener))
    }
}

#[cfg(test)]
mod tests {
    /// The start's check of the state against the records fails as the state's open does
    /// when the database is away or slow: a start that may pass (exit 1, retried), not a
    /// refusal (exit 2, left down). Before, only the open's errors passed.
    #[test]
    fn a_database_away_during_the_continuity_check_may_pass() {
        use crate::continuity::ContinuityError;
        use crate::state::StateError;
        use crate::state::postgres::PgError;
        let away = || {
            StateError::Postgres(PgError::Timeout {
                target: "db".into(),
                after: std::time::Duration::from_secs(5),
            })
        };
        assert!(super::StartupError::State(away()).may_pass());
        assert!(super::StartupError::Continuity(ContinuityError::State(away())).may_pass());
        // Cancelled by the server's own statement_timeout: a slow moment as well.
        let cancelled = StateError::Postgres(PgError::Cancelled {
            target: "db".into(),
            reason: "canceling statement due to statement timeout".into(),
        });
        assert!(super::StartupError::Continuity(ContinuityError::State(cancelled)).may_pass());
        let refused = StateError::Postgres(PgError::Query {
            target: "db".into(),
            reason: "permission denied".into(),
        });
        assert!(!super::StartupError::Continuity(ContinuityError::State(refused)).may_pass());
    }

    /// A retained set that is a dangling link is refused, not read as none: read as none,
    /// the rollback check was skipped and the set then replaced.
    #[test]
    fn a_retained_set_that_is_a_dangling_link_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let registry = super::VerifiedRegistry::new();
        assert!(
            super::check_no_rollback(&registry, dir.path())
                .unwrap()
                .is_empty()
        );
        std::os::unix::fs::symlink(
            dir.path().join("moved-away"),
            dir.path().join(super::RETAINED_SET_FILE),
        )
        .unwrap();
        let e = super::check_no_rollback(&registry, dir.path()).unwrap_err();
        assert!(e.to_string().contains(super::RETAINED_SET_FILE), "{e}");
    }

    /// A profiles directory the configuration names that is not there stops the start,
    /// naming it. Before, it was skipped, and the built-in profiles of the same names ran
    /// in place of the operator's.
    #[test]
    fn a_profiles_dir_that_is_not_there_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("profile");
        let text = format!(
            "[host]\nsocket = \"s\"\nstate_dir = \"st\"\nrecords_dir = \"r\"\nprofiles_dir = [{:?}]\n[[principal]]\nid = \"alice\"\nuids = [4242]\ntools = [\"*\"]\n",
            missing.display().to_string()
        );
        let config = crate::config::HostConfig::parse(&dir.path().join("h.toml"), &text).unwrap();
        let e = super::verify_registry(&config).unwrap_err().to_string();
        assert!(
            e.contains(&missing.display().to_string()) && e.contains("host.profiles_dir"),
            "{e}"
        );
        std::fs::create_dir(&missing).unwrap();
        super::verify_registry(&config).unwrap();
    }

    /// A range of executor uids that holds a local user's uid or a group's gid is refused,
    /// naming it and the setting. Before, it was taken: an executor could run as that user.
    #[test]
    fn an_executor_range_holding_a_users_id_is_refused() {
        let range = |first, count| flowhost_broker::UidRange { first, count };
        // This host's own files: the default range holds no one's id.
        flowhost_broker::UidRange::DEFAULT.held_by_nobody().unwrap();
        let held =
            flowhost_broker::BrokerError::UidRange(range(0, 1).held_by_nobody().unwrap_err());
        let root = super::broker_unavailable(&held, true).to_string();
        assert!(
            root.contains("\"root\"")
                && root.contains("/etc/passwd")
                && root.contains("host.executor_uid_range"),
            "{root}"
        );
    }

    use super::*;

    /// A run's health carries its range and counts over to the next run only when written
    /// as that run ended: one asked for while it went on may end where the records do
    /// because what came after was refused without a record. Before, a complete on-demand
    /// health that ended at the records' head was carried over, and the next run's final
    /// health vouched for the lost tail.
    #[test]
    fn only_a_health_written_as_its_run_ended_carries_over() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("health.json");
        let head = crate::records::chain::ChainHash::parse(&format!("sha256:{}", "ab".repeat(32)))
            .unwrap();
        let status = crate::records::WriterStatus {
            dir: dir.path().to_path_buf(),
            first_seq: Some(1),
            last_seq: Some(7),
            chain_head: head.clone(),
            committed_since_open: 0,
            current_file: dir.path().join("records"),
            failed: None,
            closed: false,
            recovered: Vec::new(),
            rejected: 0,
            last_rejection: None,
        };
        // The committed complete daemon health, moved onto this writer's records.
        let write = |run_ended: Option<bool>| {
            let mut h = ToolObservationHealth::read_from(
                &Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/health/health_complete.json"),
            )
            .unwrap();
            h.run_ended = run_ended;
            h.records.first_seq = Some(2);
            h.records.last_seq = Some(7);
            h.records.chain_head = Some(head.as_str().to_string());
            let h = h.finalize();
            assert!(h.complete, "{:?}", h.incomplete_reasons);
            h.write_to(&file).unwrap();
        };
        for (run_ended, carried) in [(Some(true), true), (Some(false), false), (None, false)] {
            write(run_ended);
            let coverage = Coverage::carried_over(&file, &status);
            assert_eq!(coverage.first_seq == 2, carried, "{run_ended:?}");
            assert_eq!(coverage.tool_calls == 3, carried, "{run_ended:?}");
        }
        // What others could have written is not carried over: a file they may change, or
        // one in a directory they may change (where the name could be pointed elsewhere).
        // Before, the file was read as it was, and the next run's health vouched for a
        // range and counts someone else wrote.
        use std::os::unix::fs::PermissionsExt;
        write(Some(true));
        let carried = |file: &Path| Coverage::carried_over(file, &status).first_seq == 2;
        assert!(carried(&file));
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(!carried(&file));
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let exposed = shared.join("health.json");
        std::fs::copy(&file, &exposed).unwrap();
        assert!(!carried(&exposed));
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(carried(&exposed));
    }

    /// The interval of the state checks is read once, at start: a reload that changes it is
    /// refused, naming it, rather than reported applied while the old interval runs on.
    #[test]
    fn a_reload_cannot_change_the_state_check_interval() {
        let file = Path::new("/etc/flowhost/host.toml");
        let text = crate::config::tests::MINIMAL;
        let running = HostConfig::parse(file, text).unwrap();
        let new = HostConfig::parse(
            file,
            &text.replacen("[host]\n", "[host]\nstate_check_interval_ms = 500\n", 1),
        )
        .unwrap();
        let err = refuse_restart_only_changes(&running, &new).unwrap_err();
        assert!(err.to_string().contains("state_check_interval_ms"), "{err}");
        refuse_restart_only_changes(&running, &running.clone()).unwrap();
    }

    #[test]
    fn a_state_directory_made_at_start_is_synced_into_each_parent_it_was_made_in() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b/records");
        crate::files::SYNCED_DIRS.with(|synced| synced.borrow_mut().clear());
        ensure_dir(&dir, 0o700).unwrap();
        let synced = crate::files::SYNCED_DIRS.with(|synced| synced.take());
        // Unsynced, a power loss could unlink the directory records were made durable in;
        // the record writer's own sync of the ancestors it creates finds them all there.
        for parent in [
            root.path().to_path_buf(),
            root.path().join("a"),
            root.path().join("a/b"),
        ] {
            assert!(
                synced.contains(&parent),
                "{} not synced: {synced:?}",
                parent.display()
            );
        }
        // Made already: nothing to sync.
        ensure_dir(&dir, 0o700).unwrap();
        assert!(
            crate::files::SYNCED_DIRS
                .with(|synced| synced.take())
                .is_empty()
        );
    }

    /// An acceptance left next to a state file (from an earlier reset, or made by mistake)
    /// would silently accept a later loss of that file: the start is refused, naming it.
    #[test]
    fn a_reset_acceptance_next_to_a_state_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (state, records) = (dir.path().join("state"), dir.path().join("records"));
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(&records).unwrap();
        std::fs::write(state.join(STATE_FILE), b"").unwrap();
        let ack = state.join(STATE_RESET_FILE);
        std::fs::write(&ack, b"").unwrap();
        let err = check_state_continuity(&state, &records).unwrap_err();
        assert!(
            matches!(err, StartupError::ResetAcceptanceLeft { .. }),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&ack.display().to_string()) && text.contains("remove"),
            "{text}"
        );
        std::fs::remove_file(&ack).unwrap();
        assert!(!check_state_continuity(&state, &records).unwrap());
    }

    /// A state directory someone else could change (its group or others by its mode, its
    /// owner by being the owner) is refused: they could replace the state file with one
    /// holding lower labels.
    #[test]
    fn a_state_dir_others_could_change_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        ensure_dir(&state, 0o700).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o770)).unwrap();
        let err = ensure_dir(&state, 0o700).unwrap_err().to_string();
        assert!(err.contains("group or others"), "{err}");
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
        ensure_dir(&state, 0o700).unwrap();
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: giving the state directory to another user needs root");
            return;
        }
        std::os::unix::fs::chown(&state, Some(65534), None).unwrap();
        let err = ensure_dir(&state, 0o700).unwrap_err().to_string();
        assert!(
            err.contains(&state.display().to_string()) && err.contains("uid 65534"),
            "{err}"
        );
    }
}
