//! The running host: its current generation, broker, resolver, records and counters; reload,
//! health and shutdown.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use flowhost_broker::Broker;

use super::*;
use crate::config::{BrokerMode, HostConfig, HttpConfig};
use crate::records::health::{HealthError, HealthProducer, RecordsHealth};
use crate::records::{RecordWriter, ToolObservationHealth};
use crate::resolver::FlowResolver;

/// Counters for `tool_observation_health`.
#[derive(Debug, Default)]
pub struct HostCounters {
    /// `tool_call` records committed by this run.
    pub tool_calls: AtomicU64,
    /// Calls to tools without a record mapping (`observed_unknown_tool`).
    pub unknown_tools: AtomicU64,
    /// Egress attempts the signed declaration does not admit, per `server/tool`.
    pub declaration_mismatches: Mutex<BTreeMap<String, u64>>,
    /// `tools/call` requests being run.
    pub calls_in_flight: super::CallsInFlight,
}

/// The running host.
pub struct Host {
    pub(super) generation: RwLock<Arc<Generation>>,
    pub(super) next_generation: AtomicU64,
    /// The broker (always present: there is no unmediated execution path).
    pub broker: Broker,
    /// The flow resolver (and its durable state).
    pub resolver: Arc<FlowResolver>,
    /// The record writer.
    pub records: RecordWriter,
    /// Health counters.
    pub counters: Arc<HostCounters>,
    /// What the health carried over from the previous run.
    pub(super) coverage: Coverage,
    /// Repeated refusals, folded (see [`refusals`]).
    pub(crate) refusals: Arc<refusals::RefusalFolder>,
    /// Health warns below this much free space on the records filesystem.
    pub(super) records_min_free_bytes: u64,
    /// Becomes true when the host is stopping (a watch: nobody can miss the change).
    pub(super) shutdown: tokio::sync::watch::Sender<bool>,
    pub(super) config_path: PathBuf,
    pub(super) health_file: PathBuf,
    /// Which connections are served (see [`session_share`](super::session_share)).
    pub(super) admission: Arc<admission::Admission>,
    /// The HTTP listener bound at start, until [`run`] serves it.
    pub(super) http: Mutex<Option<http::HttpListener>>,
    /// Who authenticates HTTP callers (while there is a listener): each reload gives it the
    /// issuer's key set as the file says then.
    pub(super) http_auth: Option<Arc<http::auth::Authenticator>>,
    /// The certificates the HTTP listener presents (while it speaks TLS): each reload gives
    /// it the pair its files hold then.
    pub(super) http_tls: Option<Arc<http::Certificates>>,
    /// Set when the host must serve what it started with to the end (see
    /// [`Host::serve_what_it_started_with`]): SIGHUP then reloads nothing.
    pub(super) no_reloads: std::sync::atomic::AtomicBool,
    /// The per-origin rules of the generations replaced so far, while a judge of theirs
    /// lives (a call may still run on them): every later reload narrows them too.
    pub(super) retired_origins: Mutex<Vec<std::sync::Weak<egress::Origins>>>,
    /// The executors each principal's sessions hold (see [`super::budget`]).
    pub(super) executors: Arc<super::budget::ExecutorBudget>,
    /// While a reload builds its generation: the servers its configuration names, which a
    /// withdrawal ahead of it may have taken out of service meanwhile (see
    /// [`Host::reload_names`]).
    pub(super) reloading: Mutex<BTreeSet<String>>,
}

/// Clears [`Host::reloading`] when a reload ends, however it ends.
struct Reloading<'h>(&'h Host);

impl Drop for Reloading<'_> {
    fn drop(&mut self) {
        // A poisoned lock still holds a whole set (it is only ever replaced whole).
        self.0
            .reloading
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

impl Host {
    /// The address the HTTP listener is bound to (before [`run`] takes it), if any.
    pub fn http_addr(&self) -> Option<std::net::SocketAddr> {
        self.http
            .lock()
            .ok()
            .and_then(|l| l.as_ref().and_then(http::HttpListener::local_addr))
    }

    /// The generation new calls use.
    pub fn current(&self) -> Arc<Generation> {
        match self.generation.read() {
            Ok(g) => g.clone(),
            // A poisoned lock still holds a complete generation (the swap is one assignment).
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Narrows the per-origin rules of every replaced generation still in use, and of
    /// `retiring` (which joins them), to what `principals` still give.
    fn narrow_retired(
        &self,
        principals: &[crate::config::PrincipalConfig],
        retiring: Option<&Arc<egress::Origins>>,
    ) {
        let mut retired = match self.retired_origins.lock() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        };
        retired.retain(|o| o.strong_count() > 0);
        if let Some(origins) = retiring {
            retired.push(Arc::downgrade(origins));
        }
        for origins in retired.iter().filter_map(std::sync::Weak::upgrade) {
            origins.narrow_by(principals);
        }
    }

    /// Re-reads the configuration and re-verifies every manifest; on success the new
    /// generation replaces the old one atomically; on failure the old one stays and the
    /// error is returned.
    pub async fn reload(&self) -> Result<u64, StartupError> {
        // Read first (its file is named by the `[http]` table, fixed at start), put to use
        // only with the new generation: an operator who took a key out of the file
        // (revoked it) and reloaded is told when it cannot be read, and otherwise has it
        // refused from this reload on, whatever else the reload refuses.
        // Likewise a bearer token, JWT subject or loopback principal taken out of `[http]`,
        // although the rest of that table waits for a restart; whatever else this reload
        // refuses (a configuration that cannot be read at all revokes nothing: which
        // credentials it keeps is unknown, and the error says so).
        // Read leniently first: a declassification authority whose key file was removed
        // (revoked) makes the file invalid, but must not keep that file from revoking it,
        // nor anything else taken out with it.
        // A file that does not load tells its ids and credentials by its TOML alone (see
        // `HostConfig::ids_in`; nothing when it is no TOML at all), from the same read.
        let (config, ids) = HostConfig::load_for_reload(&self.config_path);
        if let Some(auth) = &self.http_auth {
            match (&config, &ids) {
                (Ok(config), _) => auth.revoke_credentials_absent_from(
                    config.http.as_ref().map(HttpConfig::credentials).as_ref(),
                ),
                (Err(_), Some(ids)) => auth.revoke_credentials_absent_from(ids.http.as_ref()),
                (Err(_), None) => {}
            }
        }
        // Likewise a server taken out, or whose key was replaced or removed, an authority,
        // and a principal taken out or narrowed: found now, withdrawn below before the new
        // generation is built (starting its executors can take a call timeout per server),
        // and kept out whether the reload then succeeds or is refused.
        let (untrusted, untrusted_authorities, narrowed) = match &config {
            Ok(config) => (
                self.current().no_longer_vouched_for(config),
                self.current().authorities_no_longer_vouched_for(config),
                self.current().principals_still_vouched_for(config),
            ),
            // A file that does not load still withdraws what it no longer holds, as far as
            // its TOML tells (nothing when it is no TOML at all), a server whose registered
            // key can no longer be read or vouch for its manifest, and an authority whose key
            // file can no longer be read or holds another key.
            // The key files the running configuration names are read again either way: a
            // file that is no TOML at all (a slip made in the same edit) must not keep a key
            // file's removal from revoking it.
            Err(_) => {
                let current = self.current();
                let (mut servers, mut authorities, principals) = match &ids {
                    Some(ids) => current.taken_out_of(ids),
                    None => Default::default(),
                };
                for (server, why) in current.no_longer_vouched_for(&current.config) {
                    servers.entry(server).or_insert(why);
                }
                for (authority, why) in current.authorities_whose_keys_changed() {
                    authorities.entry(authority).or_insert(why);
                }
                (servers, authorities, principals)
            }
        };
        // Until this reload ends, the servers its file names are ones it may serve again
        // (a server whose key was replaced is withdrawn below, and served anew if the
        // reload succeeds): what a session watches of them is kept meanwhile.
        let _reloading = Reloading(self);
        if let Ok(config) = &config {
            *self.reloading.lock().unwrap_or_else(|p| p.into_inner()) =
                config.servers.iter().map(|s| s.id.clone()).collect();
        }
        let withdrawing = !untrusted.is_empty()
            || !untrusted_authorities.is_empty()
            || !narrowed.withdrawn.is_empty();
        let withdrawn_principals = narrowed.withdrawn.clone();
        if withdrawing {
            let narrowed = (!withdrawn_principals.is_empty()).then_some(narrowed);
            self.withdraw(&untrusted, &untrusted_authorities, narrowed);
        }
        let config = config.and_then(HostConfig::with_every_authority);
        // A key set that cannot be read revokes every key: which ones the operator still
        // trusts is then unknown.
        let key_set = match &self.http_auth {
            Some(auth) => auth.read_key_set().map_err(|e| {
                auth.revoke_all_keys();
                tracing::error!(
                    "the JWT key set cannot be read ({e}): no JWT is accepted until a reload reads it"
                );
                StartupError::Http(super::http::HttpError::Auth(e))
            }),
            None => Ok(None),
        };
        // A key taken out of the file is revoked now, as the rest is withdrawn: it must not
        // go on authenticating while the new generation is built, nor after, whatever
        // else the reload refuses.
        if let (Ok(Some(keys)), Some(auth)) = (&key_set, &self.http_auth) {
            auth.revoke_keys_absent_from(keys);
        }
        // The refusal of a key set that cannot be read comes after the withdrawals above.
        let (key_set, built) = match key_set {
            Ok(keys) => {
                let built: Result<_, StartupError> = async {
                    let config = config?;
                    refuse_restart_only_changes(&self.current().config, &config)?;
                    self.build_reloaded(config).await
                }
                .await;
                (keys, built)
            }
            Err(e) => (None, Err(e)),
        };
        let (generation, certificate) = match built {
            Ok(built) => built,
            Err(refused) if withdrawing => {
                for (server, why) in &untrusted {
                    tracing::error!(
                        "server {server:?} withdrawn from service although the reload is refused: {why}"
                    );
                }
                for (authority, why) in &untrusted_authorities {
                    tracing::error!(
                        "declassification authority {authority:?} no longer trusted although the reload is refused: {why}"
                    );
                }
                for (principal, why) in &withdrawn_principals {
                    tracing::error!(
                        "principal {principal:?} withdrawn although the reload is refused: {why}"
                    );
                }
                return Err(StartupError::RefusedButWithdrew {
                    refused: Box::new(refused),
                    withdrawn: untrusted,
                    authorities: untrusted_authorities,
                    principals: withdrawn_principals,
                });
            }
            Err(refused) => return Err(refused),
        };
        let id = generation.id;
        let old = {
            let mut g = match self.generation.write() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            // Under the generation's lock: no call sees the new generation while the
            // resolver still trusts an authority it dropped.
            self.resolver
                .trust_authorities(&generation.config.authorities);
            // The calls still running on the generation this replaces, or on one it
            // replaced, are judged by their per-origin rules as far as the new file still
            // gives them: narrowed as a refused reload narrows them, never widened.
            self.narrow_retired(&generation.config.principals, Some(&g.origins));
            std::mem::replace(&mut *g, Arc::new(generation))
        };
        if let (Some(auth), Some(keys)) = (&self.http_auth, key_set) {
            auth.use_key_set(keys);
        }
        if let (Some(certificates), Some(pair)) = (&self.http_tls, certificate) {
            certificates.present(pair);
        }
        // Stopping the old warm executors can take a moment each; it happens in the
        // background so accepting and the watchdog do not wait for it.
        tokio::spawn(async move {
            for pool in old.pools.values() {
                pool.drain().await;
            }
        });
        Ok(id)
    }

    /// Stops serving the servers `untrusted` names and trusting the declassification
    /// authorities `authorities` names (each with why), and serves the principals `narrowed`
    /// leaves in place of the current ones when given, keeping everything else of the
    /// current generation: a new generation without them replaces it, and the servers'
    /// warm executors are stopped. Calls already dispatched to them finish on the
    /// generation they started with; a session's next request is judged under the
    /// principals served now.
    fn withdraw(
        &self,
        untrusted: &BTreeMap<String, String>,
        authorities: &BTreeMap<String, String>,
        narrowed: Option<super::generation::Narrowed>,
    ) {
        let withdrawn: BTreeSet<String> = untrusted.keys().cloned().collect();
        let distrusted: BTreeSet<String> = authorities.keys().cloned().collect();
        let id = self.next_generation.fetch_add(1, Ordering::SeqCst);
        let old = {
            let mut g = match self.generation.write() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            let reduced = Arc::new(g.without(id, &withdrawn, &distrusted, narrowed.clone()));
            if let Some(narrowed) = &narrowed {
                // The judges are shared with the generation this replaces: narrowed in
                // place, they decide running executors' next attempts by what is left, as
                // those of the generations replaced before it do.
                reduced.origins.narrow_by(&narrowed.principals);
                self.narrow_retired(&narrowed.principals, None);
            }
            // Calls already running or waiting under a grant of a distrusted authority
            // stop being judged under it at their next attempt.
            self.resolver.trust_authorities(&reduced.config.authorities);
            std::mem::replace(&mut *g, reduced)
        };
        for (server, why) in untrusted {
            tracing::warn!(
                "server {server:?} withdrawn at once, before the rest of the reload: {why}"
            );
        }
        for (authority, why) in authorities {
            tracing::warn!(
                "declassification authority {authority:?} withdrawn at once, before the rest of the reload: {why}"
            );
        }
        for (principal, why) in narrowed.iter().flat_map(|n| &n.withdrawn) {
            tracing::warn!(
                "principal {principal:?} withdrawn at once, before the rest of the reload: {why}"
            );
        }
        tokio::spawn(async move {
            for server in &withdrawn {
                if let Some(pool) = old.pools.get(server) {
                    pool.drain().await;
                }
            }
        });
    }

    /// The generation a reload to `config` would serve, its pools primed and the retained
    /// signed set written, with the TLS pair its files hold now; nothing the host serves
    /// has changed yet.
    async fn build_reloaded(
        &self,
        config: HostConfig,
    ) -> Result<(Generation, Option<Arc<rustls::sign::CertifiedKey>>), StartupError> {
        // Likewise the TLS certificate: a renewed one is served from the reload on.
        let certificate = match &self.http_tls {
            Some(certificates) => Some(certificates.read().map_err(StartupError::Http)?),
            None => None,
        };
        let (registry, profiles) = verify_registry(&config)?;
        if registry.requires_flow_runtime() && config.broker == BrokerMode::Disabled {
            return Err(StartupError::NoBroker(
                "the new configuration disables the broker while its registry requires flow mediation".into(),
            ));
        }
        check_profiles(&self.broker, &profiles)?;
        super::startup::check_commands(&config, &profiles)?;
        let retained = super::startup::check_no_rollback(&registry, &config.state_dir)?;
        let id = self.next_generation.fetch_add(1, Ordering::SeqCst);
        let generation = build_generation(
            id,
            config,
            registry,
            &profiles,
            &self.broker,
            (&self.resolver, &self.records, &self.counters),
            &self.refusals,
        );
        prime_pools(&generation).await?;
        // Only a generation that will serve replaces the retained signed set.
        generation.registry.write_retained_set(
            &generation
                .config
                .state_dir
                .join(crate::registry::RETAINED_SET_FILE),
            &retained,
        )?;
        Ok((generation, certificate))
    }

    /// The servers a reload in progress names: one not served now may be served again when
    /// it ends (see [`Host::reload`]). Read before the serving generation, since a reload
    /// clears it only after its swap.
    pub(super) fn reload_names(&self) -> BTreeSet<String> {
        self.reloading
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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

    /// From now on SIGHUP reloads nothing: a host whose configuration was derived from the
    /// manifests it started with (`sandbox mcp`) must not read them again, since a manifest
    /// replaced meanwhile would be served under a policy derived from another one.
    pub fn serve_what_it_started_with(&self) {
        self.no_reloads
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether SIGHUP reloads (see [`Host::serve_what_it_started_with`]).
    pub fn reloads(&self) -> bool {
        !self.no_reloads.load(std::sync::atomic::Ordering::SeqCst)
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
        // The run goes on; only the health written as it ends says otherwise.
        h.run_ended = Some(false);
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
        // Labels read back since, the store serves again; but every call carrying a grant
        // is refused until a restart, which the operator must know of.
        if let Some(why) = self.resolver.state().grants_refused() {
            h.warnings
                .push(format!("declassification grants refused: {why}"));
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
        let recorder = pipeline::Recorder {
            records: &self.records,
            counters: &self.counters,
            refusals: &self.refusals,
        };
        for record in self.refusals.take_due(force) {
            // A failure is logged by the recorder and fails the writer closed for every call.
            let _ = recorder.commit(record).await;
        }
    }

    /// Waits until every record written so far is durable, so that a health computed next
    /// vouches for every line in the record files (outcome records are written without
    /// waiting for their sync). A writer that fails here is reported by the health itself.
    pub async fn settle_records(&self) {
        if let Err(e) = self.records.flush().await {
            tracing::error!(error = %e, "the decision records could not be made durable");
        }
    }

    /// Writes the health file on demand: the run goes on, so it vouches for nothing after it
    /// (`run_ended` false).
    pub fn write_health(&self) -> Result<ToolObservationHealth, HealthError> {
        let h = self.health();
        h.write_to(&self.health_file)?;
        Ok(h)
    }

    /// Writes the health file as the run ends, once the records are closed (`run_ended`
    /// true): the only carrier the diff binds to the records as the whole run.
    /// `cut_short` says why the records do not hold the whole run, if they do not.
    fn write_final_health(
        &self,
        cut_short: Option<String>,
    ) -> Result<ToolObservationHealth, HealthError> {
        let mut h = ToolObservationHealth {
            run_ended: Some(true),
            ..self.health()
        };
        if let Some(why) = cut_short {
            h.records.records_complete = Some(false);
            h.records.problems.push(why);
        }
        h.write_to(&self.health_file)?;
        Ok(h)
    }

    /// Checks the flow state against the records written since it was last bound, and binds
    /// it to the last of them (see [`crate::continuity::check_through`]); the serve loop runs
    /// this every `state_check_interval`. So a stop, and a start after a crash, read only the
    /// records of the last interval, and a state that does not hold what the records prove,
    /// is bound to another record stream or was replaced under the running host (a restored
    /// `state.db`) is found within one interval: the store then refuses every later use, so
    /// every call that needs a label is refused, and the health says why, until the host is
    /// restarted (whose start check names what to do). A shared database that reads lower
    /// than this host has seen a principal refuses that principal's calls until it reads
    /// back, as it does for any read; the check then still compares the grants the records
    /// show spent (a lost one fails the store as above). A record line or a database row
    /// that does not decode fails the store too; a check that cannot read the records or
    /// the state for now is logged and tried again at the next interval.
    pub async fn check_state_while_serving(&self) {
        let Some(through) = super::startup::writer_head(&self.records.status()) else {
            return;
        };
        use crate::continuity::ContinuityError;
        use crate::state::{StateError, postgres::PgError};
        let through = (through.0, through.1.as_str());
        let Err(e) = self.bind_state_to_records(Some(through)).await else {
            return;
        };
        // Found lower than the records prove, bound to another stream, records missing after
        // the checkpoint (a gap does not heal), or a file replaced under the store: no label
        // it gives can be trusted. A shared database that reads
        // lower than this host has seen a principal refuses that principal's calls by
        // itself, until the label reads back (a standby catching up): that stays so. Anything
        // else (the records or the database unreachable for now) is tried again, and each
        // call meanwhile meets the same fault on its own.
        match e {
            ContinuityError::Behind(_)
            | ContinuityError::OtherStream(_)
            | ContinuityError::Gap { .. }
            | ContinuityError::MissingStart { .. }
            | ContinuityError::State(StateError::Replaced { .. }) => {
                self.resolver.state().fail(e.to_string());
                tracing::error!(error = %e, "the flow state does not hold what the decision records prove; refusing every call that needs it until the host is restarted");
            }
            // A record line that does not read as a record (damaged on disk, edited) or a
            // database row that does not decode: neither heals by waiting, and while either
            // stands no check can finish, so a state rolled back meanwhile would never be
            // found. Before, these were retried at every interval while health said fine.
            ContinuityError::Malformed { .. }
            | ContinuityError::BadPrincipal { .. }
            | ContinuityError::Unrecoverable { .. }
            | ContinuityError::State(StateError::Postgres(PgError::Corrupt { .. })) => {
                self.resolver.state().fail(e.to_string());
                tracing::error!(error = %e, "the decision records or the flow state cannot be read as they must be to check one against the other; refusing every call that needs the state until the host is restarted");
            }
            // Failed already (by an earlier check, or a write that failed): said then.
            ContinuityError::State(StateError::Failed(_)) => {}
            ContinuityError::State(StateError::Postgres(PgError::Lower { .. })) => {
                tracing::error!(error = %e, "the flow-state database holds a lower label than this host has seen; that principal's calls are refused until it reads back");
            }
            e => {
                tracing::error!(error = %e, "checking the flow state against the decision records failed; trying again at the next interval");
            }
        }
    }

    /// Binds the flow state to the records' head (or to record `through`: its sequence number
    /// and line hash), as a clean stop does, once it is checked against the records (as at
    /// start): a shared database may have been changed by another host, a failover or a
    /// restore, and a state file may have been replaced or rolled back under the running host
    /// (a backup restored into it). Bound without the check, the next start would take the
    /// lower labels for current. A state that fails the check stays bound where it was, so
    /// the next start finds the same fault.
    async fn bind_state_to_records(
        &self,
        through: Option<(u64, &str)>,
    ) -> Result<(), crate::continuity::ContinuityError> {
        let generation = self.current();
        let config = &generation.config;
        let (db, host_id) = match &config.state {
            crate::config::StateConfig::Postgres(pg) => {
                (pg.url_file.clone(), Some(pg.host_id.as_str()))
            }
            crate::config::StateConfig::Sqlite => (config.state_dir.join(super::STATE_FILE), None),
        };
        crate::continuity::check_through(
            self.resolver.state(),
            &crate::continuity::Places {
                db: &db,
                state_dir: &config.state_dir,
                records: &config.records_dir,
                host_id,
            },
            through,
        )
        .await
    }

    /// Stops every pool, closes the record writer and writes the final health. Returns
    /// whether all of that succeeded; each failure is logged as it happens. `abandoned`
    /// says that sessions still had requests in flight (the stop stopped waiting for them):
    /// their outcomes will never be recorded, so the final health calls the records
    /// incomplete.
    pub async fn finish(&self, abandoned: bool) -> bool {
        self.finish_saying(abandoned.then(|| {
            "the host stopped while sessions still had requests in flight (it waits call_timeout + 2 s): what they decided after that, their outcomes among it, is not recorded".to_string()
        }))
        .await
    }

    /// [`Host::finish`] for a run that served nothing it was meant to: the final health says
    /// `why` and is never complete, so the records never read as a run that ended well.
    pub async fn finish_refused(&self, why: &str) -> bool {
        self.finish_saying(Some(why.to_string())).await
    }

    async fn finish_saying(&self, cut_short: Option<String>) -> bool {
        for pool in self.current().pools.values() {
            pool.drain().await;
        }
        self.flush_refusals(true).await;
        let mut clean = true;
        if let Err(e) = self.records.close().await {
            tracing::error!(error = %e, "closing the decision records failed");
            clean = false;
        } else if let Err(e) = self.bind_state_to_records(None).await {
            tracing::error!(error = %e, "binding the flow state to the records failed; it stays bound where it was, so the next start checks it against every record since");
            clean = false;
        }
        if let Err(e) = self.write_final_health(cut_short) {
            tracing::error!(error = %e, "writing the health file failed");
            clean = false;
        }
        clean
    }
}
