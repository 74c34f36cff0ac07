//! A configuration generation: the verified registry, what the host knows of each server, and
//! each server's warm executors. Immutable; a reload builds a new one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use flowhost_broker::{Broker, Profile};

use super::executor::NamedCall;
use super::*;
use crate::config::HostConfig;
use crate::records::{RecordWriter, ToolMapping};
use crate::registry::VerifiedRegistry;
use crate::resolver::{CallPlan, FlowResolver};

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

impl NamedCall for CallInFlight {
    fn tool_name(&self) -> &str {
        &self.tool
    }
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
    /// The per-origin destination rules its servers' judges decide by.
    pub origins: Arc<super::egress::Origins>,
}

/// The principals a refused reload leaves (see
/// [`Generation::principals_still_vouched_for`]).
#[derive(Debug, Clone, Default)]
pub(super) struct Narrowed {
    /// The principals, narrowed.
    pub principals: Vec<crate::config::PrincipalConfig>,
    /// The uids and gids taken from them: such a peer maps to no principal until a reload
    /// succeeds.
    pub peers: (BTreeSet<u32>, BTreeSet<u32>),
    /// Each principal changed, with what it lost.
    pub withdrawn: BTreeMap<String, String>,
}

impl Generation {
    /// The servers this generation serves that `config` no longer vouches for, each with why:
    /// taken out of the configuration, its registered key unreadable, or its admitted
    /// manifest not signed by the key `config` now names. Those must stop serving even when
    /// the rest of a reload to `config` is refused: taking a server or its key out is how an
    /// operator withdraws trust in it.
    pub(super) fn no_longer_vouched_for(&self, config: &HostConfig) -> BTreeMap<String, String> {
        let mut withdrawn = BTreeMap::new();
        for admitted in self.registry.servers() {
            let id = admitted.server_id();
            let why = match config.servers.iter().find(|s| s.id == id) {
                None => Some("taken out of the configuration".to_string()),
                Some(s) => match crate::keys::verifying_key_from_arg(&s.key) {
                    Err(e) => Some(format!(
                        "its registered key cannot be read: {}",
                        crate::causes::WithCauses(&e)
                    )),
                    Ok(key) => admitted.envelope().verify(&key).err().map(|_| {
                        "its manifest is not signed by the key the configuration now names"
                            .to_string()
                    }),
                },
            };
            if let Some(why) = why {
                withdrawn.insert(id.to_string(), why);
            }
        }
        withdrawn
    }

    /// The declassification authorities this generation trusts that `config` no longer
    /// vouches for, each with why: taken out, its key unreadable, or its key replaced. Like
    /// servers, they stop being trusted even when the rest of a reload to `config` is
    /// refused: a grant signed by a key the operator took out must not be honoured.
    pub(super) fn authorities_no_longer_vouched_for(
        &self,
        config: &HostConfig,
    ) -> BTreeMap<String, String> {
        let mut withdrawn = BTreeMap::new();
        for (id, key) in &self.config.authorities {
            let why = match (
                config.authorities.get(id),
                config.unreadable_authorities.get(id),
            ) {
                (Some(now), _) if now == key => continue,
                (Some(_), _) => "its key was replaced".to_string(),
                (None, Some((field, e))) => format!("its key cannot be read ({field}: {e})"),
                (None, None) => "taken out of the configuration".to_string(),
            };
            withdrawn.insert(id.clone(), why);
        }
        withdrawn
    }

    /// The declassification authorities this generation trusts whose key, read again from
    /// where this generation's file named it, is no longer the key trusted: unreadable (a
    /// key file removed) or another key (one replaced). For a reload whose file does not
    /// load: which authorities it keeps is known only by id, but a key file removed still
    /// revokes its authority.
    pub(super) fn authorities_whose_keys_changed(&self) -> BTreeMap<String, String> {
        let mut withdrawn = BTreeMap::new();
        for (id, key) in &self.config.authorities {
            let Some(arg) = self.config.authority_keys.get(id) else {
                continue;
            };
            match crate::keys::verifying_key_from_arg(arg) {
                Ok(now) if now == *key => {}
                Ok(_) => {
                    withdrawn.insert(id.clone(), "its key was replaced".to_string());
                }
                Err(e) => {
                    let e = crate::causes::WithCauses(&e);
                    withdrawn.insert(id.clone(), format!("its key cannot be read: {e}"));
                }
            }
        }
        withdrawn
    }

    /// This generation's principals as far as `config` still vouches for them, and each
    /// principal that changed with what it lost: one taken out of `config` (by id) is gone,
    /// and one `config` keeps loses the uids, gids and tool patterns `config` no longer
    /// gives it (a pattern is kept only as written in both). Like servers, these are
    /// withdrawn even when the rest of a reload to `config` is refused: taking a user out
    /// of a principal is how an operator ends its access. Its per-origin destinations lose
    /// the `allow` rules `config` no longer gives it (kept only as written in both) and
    /// gain the `block` rules `config` adds; nothing is widened.
    pub(super) fn principals_still_vouched_for(&self, config: &HostConfig) -> Narrowed {
        let mut kept = Vec::new();
        let mut withdrawn = BTreeMap::new();
        let (mut lost_uids, mut lost_gids) = (BTreeSet::new(), BTreeSet::new());
        for p in &self.config.principals {
            let Some(now) = config.principals.iter().find(|n| n.id == p.id) else {
                withdrawn.insert(
                    p.id.to_string(),
                    "taken out of the configuration".to_string(),
                );
                lost_uids.extend(p.uids.iter().copied());
                lost_gids.extend(p.gids.iter().copied());
                continue;
            };
            let lost = |old: &[u32], new: &[u32]| -> Vec<u32> {
                old.iter().filter(|i| !new.contains(i)).copied().collect()
            };
            let (uids, gids) = (lost(&p.uids, &now.uids), lost(&p.gids, &now.gids));
            let tools: Vec<&String> = p.tools.iter().filter(|t| !now.tools.contains(t)).collect();
            let mut what = Vec::new();
            if !uids.is_empty() {
                what.push(format!("uids {uids:?}"));
            }
            if !gids.is_empty() {
                what.push(format!("gids {gids:?}"));
            }
            if !tools.is_empty() {
                what.push(format!("tools {tools:?}"));
            }
            let destinations =
                super::egress::narrowed_origin(p.destinations.as_ref(), now.destinations.as_ref());
            if destinations != p.destinations {
                what.push("per-origin destinations (allows taken out, blocks added)".into());
            }
            if what.is_empty() {
                kept.push(p.clone());
                continue;
            }
            withdrawn.insert(
                p.id.to_string(),
                format!("{} taken from it", what.join(", ")),
            );
            let mut narrowed = p.clone();
            narrowed.uids.retain(|u| !uids.contains(u));
            narrowed.gids.retain(|g| !gids.contains(g));
            narrowed.tools.retain(|t| now.tools.contains(t));
            narrowed.destinations = destinations;
            kept.push(narrowed);
            lost_uids.extend(uids);
            lost_gids.extend(gids);
        }
        Narrowed {
            principals: kept,
            peers: (lost_uids, lost_gids),
            withdrawn,
        }
    }

    /// What a file that does not load still withdraws, from the ids it holds (see
    /// [`crate::config::HostConfig::ids_in`]): the servers, declassification authorities and
    /// principals of this generation it no longer holds, each taken out whole (what the rest
    /// of an entry it keeps says is unknown, and left as it is).
    pub(super) fn taken_out_of(
        &self,
        ids: &crate::config::ConfigIds,
    ) -> (BTreeMap<String, String>, BTreeMap<String, String>, Narrowed) {
        let why =
            || "taken out of the configuration (which is refused for another reason)".to_string();
        let servers = (self.registry.servers())
            .map(|a| a.server_id().to_string())
            .filter(|id| !ids.servers.contains(id))
            .map(|id| (id, why()))
            .collect();
        let authorities = (self.config.authorities.keys())
            .filter(|id| !ids.authorities.contains(*id))
            .map(|id| (id.clone(), why()))
            .collect();
        let mut narrowed = Narrowed::default();
        for p in &self.config.principals {
            if ids.principals.contains(p.id.as_str()) {
                narrowed.principals.push(p.clone());
            } else {
                narrowed.withdrawn.insert(p.id.to_string(), why());
                narrowed.peers.0.extend(p.uids.iter().copied());
                narrowed.peers.1.extend(p.gids.iter().copied());
            }
        }
        (servers, authorities, narrowed)
    }

    /// This generation, numbered `id`, without the servers `withdrawn` names and the
    /// declassification authorities `authorities` names, and with `principals` as its
    /// principals when given: everything else (configuration, admitted manifests, warm
    /// executors, the per-origin rules its judges decide by) is shared as it is.
    pub(super) fn without(
        &self,
        id: u64,
        withdrawn: &BTreeSet<String>,
        authorities: &BTreeSet<String>,
        principals: Option<Narrowed>,
    ) -> Generation {
        let mut config = self.config.clone();
        config.servers.retain(|s| !withdrawn.contains(&s.id));
        config.authorities.retain(|a, _| !authorities.contains(a));
        if let Some(narrowed) = principals {
            config.principals = narrowed.principals;
            config.withdrawn_peers.0.extend(narrowed.peers.0);
            config.withdrawn_peers.1.extend(narrowed.peers.1);
        }
        let keep = |server: &String| !withdrawn.contains(server);
        Generation {
            id,
            config,
            registry: self.registry.without(withdrawn),
            servers: (self.servers.iter())
                .filter(|(s, _)| keep(s))
                .map(|(s, f)| (s.clone(), f.clone()))
                .collect(),
            pools: (self.pools.iter())
                .filter(|(s, _)| keep(s))
                .map(|(s, p)| (s.clone(), p.clone()))
                .collect(),
            origins: self.origins.clone(),
        }
    }
}

/// Starts one executor of every server and waits for it, then fills the pools in the
/// background: a server whose executors cannot start (a broker or sandbox that cannot work
/// under this service's settings) stops the start or the reload, naming the server and why,
/// instead of being reported ready while every call to it would fail.
///
/// Each server's executor may take up to `call_timeout` to answer `initialize`, one after
/// another, which can outlast the unit's start timeout: systemd would then kill the daemon
/// before it could say which server was slow (and restart it, again and again). So the
/// service manager is told, before each, how long that one may take.
pub(super) async fn prime_pools(generation: &Generation) -> Result<(), StartupError> {
    let may_take = priming_allowance(generation.config.call_timeout);
    for (server, pool) in &generation.pools {
        let status = super::service_status(&format!("starting an executor of server {server}"));
        let _ = sd_notify::notify(
            false,
            &[
                sd_notify::NotifyState::ExtendTimeoutUsec(may_take),
                sd_notify::NotifyState::Status(&status),
            ],
        );
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

/// How long, in microseconds, the service manager is asked to wait for one server's first
/// executor: its `initialize` deadline and 10 s to start and stop it around that, at most
/// what `EXTEND_TIMEOUT_USEC` can carry (about 71 minutes).
fn priming_allowance(call_timeout: std::time::Duration) -> u32 {
    let usec = (call_timeout + std::time::Duration::from_secs(10)).as_micros();
    u32::try_from(usec).unwrap_or(u32::MAX)
}

pub(super) fn build_generation(
    id: u64,
    config: HostConfig,
    registry: VerifiedRegistry,
    profiles: &BTreeMap<String, Arc<Profile>>,
    broker: &Broker,
    (resolver, records, counters): (&Arc<FlowResolver>, &RecordWriter, &Arc<HostCounters>),
    refusals: &Arc<super::refusals::RefusalFolder>,
) -> Generation {
    let mut servers = BTreeMap::new();
    let mut pools = BTreeMap::new();
    let origins = Arc::new(super::egress::Origins::of(&config.principals));
    let dns = crate::dns::DnsMediation {
        narrowings: origins.narrowings(),
        upstream: Arc::new(match &config.dns_upstream {
            Some(servers) => crate::dns::Upstream::new(servers.clone()),
            None => {
                crate::dns::Upstream::from_resolv_conf(std::path::Path::new("/etc/resolv.conf"))
            }
        }),
        dir: config.state_dir.join("resolv"),
        private_answers: Arc::from([]),
        host: crate::dns::HostSide::LIVE,
        senders: broker.executor_uids(),
    };
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
            refusals: refusals.clone(),
        });
        let template = ExecutorTemplate {
            server: s.id.clone(),
            argv: s.command.clone(),
            env: s.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            profile: profile.clone(),
            read_paths: s.read_paths.clone(),
            dns: Some(crate::dns::DnsMediation {
                private_answers: s.private_answers.clone().into(),
                ..dns.clone()
            }),
            run_as: config.executor_identity_hint(),
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
        origins,
    }
}

/// A random 128-bit id, as hex (sessions, calls).
pub(crate) fn random_id() -> String {
    use rand_core::RngCore;
    let mut bytes = [0u8; 16];
    rand_core::OsRng.fill_bytes(&mut bytes);
    hex::encode(bytes)
}
