//! The host daemon: `flowhost serve`.
//!
//! Startup order (each step fails closed, naming what failed): load the configuration;
//! verify and register every signed manifest; if the registry requires flow mediation and the
//! broker is disabled or cannot start, refuse — before opening any state or spawning anything;
//! check every execution profile against the kernel; then open the state directory and the
//! flow-state store, refuse a rollback against the retained signed set and write it, open the
//! record writer, check the store's labels against the records (continuity), warm the
//! executor pools (one executor of every server must start), bind the socket (or take it
//! from systemd), and report ready.
//!
//! A generation (configuration + registry + executor pools) is immutable; SIGHUP builds a new
//! one and swaps it in atomically. Calls in flight finish on the generation they started on;
//! a new configuration that fails verification keeps the old generation and says why.
//!
//! Files: `startup` (the start order above and its refusals), `generation` (a configuration
//! generation and its pools), `host` (the running host: reload, health, shutdown), `serve`
//! (the accept loop and signals), `admission` (connections admitted by peer credentials),
//! `session` (one connection's MCP requests), `pipeline` (one `tools/call`, stage by stage),
//! `egress` (judging the broker's egress attempts), `executor` (executors and warm pools),
//! `relay` (what an executor sends its client during a call: ids, answers, capabilities),
//! `refusals` (folding repeated refusals), `reload` (the reload verdict for `systemctl
//! reload`), `activation` (the socket, or systemd's).

mod activation;
mod admission;
mod budget;
mod egress;
mod executor;
pub mod http;
pub mod pipeline;
pub mod refusals;
mod relay;
pub mod reload;
mod session;

mod generation;
mod host;
mod in_flight;
mod serve;
mod startup;

pub use activation::listener_from_systemd;
pub use admission::{
    MAX_SESSIONS, MAX_STRANGERS, MAX_STRANGERS_PER_UID, SUMMARY_INTERVAL, session_share,
};
pub use budget::{ExecutorBudget, ExecutorPlace, executor_share};
pub use egress::{
    EgressJudge, broker_details, judged_destination, lookup_broker_details, named_broker_details,
    named_rules_destination, rules_destination,
};
#[cfg(test)]
pub(crate) use executor::unix_connect;
pub use executor::{ExecutorError, ExecutorTemplate, McpExecutor, WarmPool};

pub(crate) use generation::random_id;
pub use generation::{CallInFlight, Generation, ServerFacts};
use generation::{build_generation, prime_pools};
pub use host::{Host, HostCounters};
pub use in_flight::{CallsInFlight, InFlight};
pub use serve::{Served, default_workers, run, serve_runtime, service_status};
use startup::{Coverage, check_profiles, refuse_restart_only_changes};
pub use startup::{
    STATE_FILE, STATE_RESET_FILE, StartupError, prepare_state_dir, require_broker, verify_registry,
};
