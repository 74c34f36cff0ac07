//! The host configuration file (TOML). Every key is documented in the README ("Host
//! configuration"); `fixtures/pricing-lab/host.toml` is an annotated example.
//!
//! This file is long on purpose: it is the one strict decoder of the host file, every key with
//! its check and its error naming file and key, in the order the README documents them.
//!
//! Loading guarantees: unknown keys are errors; every error names the file and the key;
//! relative paths are resolved against the file's directory; `${config_dir}` in executor
//! arguments is replaced by that directory; a server's runtime topology is derived from its
//! execution profile (an empty network namespace is `local`, the host network is
//! `brokered`), and a `topology` that disagrees with the profile is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::destination::DestinationRules;
use crate::ident::PrincipalId;
use crate::label::InformationLabel;
use crate::registry::{RuntimeTopology, ToolPolicy};

mod http;
pub use http::{
    BearerToken, DEFAULT_MAX_CONNECTIONS_PER_SOURCE, HttpConfig, HttpCredentials, JwtConfig,
    MAX_CONNECTIONS, TlsFiles,
};

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read the configuration: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not one flowhost trusts (others may change it, it is no regular file,
    /// too large, not text).
    #[error("{file}: cannot use the configuration: {reason}")]
    Untrusted {
        /// The file.
        file: PathBuf,
        /// Why.
        reason: String,
    },
    /// Not valid TOML for a host configuration (syntax, unknown key, wrong type).
    #[error("{file}: {message}")]
    Syntax {
        /// The file.
        file: PathBuf,
        /// The parser's message (it names the line and the key).
        message: String,
    },
    /// A key has a value the host cannot use.
    #[error("{file}: `{key}`: {message}")]
    Invalid {
        /// The file.
        file: PathBuf,
        /// The key, e.g. `server[1].command`.
        key: String,
        /// What is wrong.
        message: String,
    },
}

/// Whether the native broker runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum BrokerMode {
    /// The native seccomp-notify broker mediates every executor (required for any
    /// flow-required registry).
    #[default]
    Native,
    /// No broker: only a registry that requires no flow mediation may be served.
    Disabled,
}

/// Where a classifier rule looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClassifierScope {
    /// Call arguments (before dispatch).
    Arguments,
    /// Tool outputs (after the call).
    Outputs,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    host: RawHost,
    #[serde(default)]
    classifier: Vec<RawClassifier>,
    #[serde(default)]
    principal: Vec<RawPrincipal>,
    #[serde(default)]
    server: Vec<RawServer>,
    #[serde(default)]
    declassification_authority: Vec<RawAuthority>,
    #[serde(default)]
    http: Option<http::RawHttp>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuthority {
    id: String,
    key: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    socket: PathBuf,
    state_dir: PathBuf,
    records_dir: PathBuf,
    #[serde(default)]
    health_file: Option<PathBuf>,
    #[serde(default)]
    profiles_dir: Vec<PathBuf>,
    #[serde(default)]
    broker: BrokerMode,
    #[serde(default)]
    executor_uid: Option<u32>,
    #[serde(default)]
    executor_gid: Option<u32>,
    #[serde(default)]
    executor_uid_range: Option<String>,
    #[serde(default = "default_max_message")]
    max_message_bytes: usize,
    #[serde(default = "default_call_timeout")]
    call_timeout_ms: u64,
    #[serde(default = "default_idle_timeout")]
    idle_timeout_ms: u64,
    #[serde(default = "default_initialize_timeout")]
    initialize_timeout_ms: u64,
    #[serde(default = "default_session_idle_timeout")]
    session_idle_timeout_ms: u64,
    #[serde(default = "default_state_check_interval")]
    state_check_interval_ms: u64,
    #[serde(default = "default_rotate")]
    records_rotate_bytes: u64,
    #[serde(default = "default_classifier_version")]
    classifier_version: String,
    #[serde(default)]
    operator_input_floor: Option<InformationLabel>,
    #[serde(default)]
    socket_mode: Option<String>,
    #[serde(default = "default_fold_interval")]
    refusal_fold_interval_ms: u64,
    #[serde(default = "default_refusal_budget")]
    refusal_records_per_interval: usize,
    #[serde(default = "default_max_executors")]
    max_executors: usize,
    #[serde(default = "default_min_free")]
    records_min_free_mib: u64,
    #[serde(default)]
    state: Option<RawState>,
    #[serde(default)]
    dns_upstream: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(tag = "backend", rename_all = "lowercase", deny_unknown_fields)]
enum RawState {
    // A struct variant: serde reads a unit variant of an internally tagged enum by skipping
    // every other key, so `deny_unknown_fields` would not refuse a misplaced `url_file`.
    Sqlite {},
    Postgres {
        url_file: PathBuf,
        host_id: String,
        #[serde(default)]
        password_file: Option<PathBuf>,
        #[serde(default)]
        ca_file: Option<PathBuf>,
        #[serde(default)]
        server_user: Option<String>,
        #[serde(default)]
        schema: Option<String>,
        #[serde(default = "default_state_timeout")]
        timeout_ms: u64,
        #[serde(default = "default_state_connections")]
        connections: usize,
    },
}

fn default_state_timeout() -> u64 {
    5_000
}
fn default_state_connections() -> usize {
    4
}

fn default_fold_interval() -> u64 {
    10_000
}
fn default_refusal_budget() -> usize {
    100
}
fn default_max_executors() -> usize {
    1024
}
/// Most executors `max_executors` may allow.
const MOST_EXECUTORS: usize = 4096;
fn default_min_free() -> u64 {
    256
}
fn default_max_message() -> usize {
    1024 * 1024
}
fn default_state_check_interval() -> u64 {
    10_000
}
fn default_call_timeout() -> u64 {
    30_000
}
fn default_idle_timeout() -> u64 {
    300_000
}
fn default_initialize_timeout() -> u64 {
    5_000
}
fn default_session_idle_timeout() -> u64 {
    3_600_000
}
/// The longest interval over which identical refusals are folded into one record.
const MAX_FOLD_INTERVAL_MS: u64 = 3_600_000;
/// The most `max_message_bytes` may be (64 MiB): past it, no host takes a message
/// (`flowhost connect` reads a request's id up to it).
pub const MOST_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// The smallest record file size before rotation.
const MIN_ROTATE_BYTES: u64 = 1024 * 1024;

fn default_rotate() -> u64 {
    64 * 1024 * 1024
}
fn default_classifier_version() -> String {
    "unversioned".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClassifier {
    pattern: String,
    label: InformationLabel,
    #[serde(default = "both_scopes")]
    applies_to: Vec<ClassifierScope>,
}

fn both_scopes() -> Vec<ClassifierScope> {
    vec![ClassifierScope::Arguments, ClassifierScope::Outputs]
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrincipal {
    id: PrincipalId,
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    gids: Vec<u32>,
    tools: Vec<String>,
    #[serde(default)]
    destinations: Option<crate::destination::OriginRules>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    id: String,
    manifest: PathBuf,
    key: String,
    command: Vec<String>,
    profile: String,
    #[serde(default)]
    topology: Option<RuntimeTopology>,
    #[serde(default)]
    read_paths: Vec<PathBuf>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default = "default_pool")]
    pool_size: usize,
    #[serde(default)]
    unqualified_names: bool,
    #[serde(default)]
    destinations: DestinationRules,
    #[serde(default)]
    private_answers: Vec<String>,
    #[serde(default)]
    content_floor: Option<InformationLabel>,
    tools: BTreeMap<String, RawTool>,
}

fn default_pool() -> usize {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    policy: ToolPolicy,
    #[serde(default)]
    record: Option<crate::records::ToolMapping>,
}

/// An upstream resolver: `IP` (port 53), `IP:PORT` or `[IPv6]:PORT`.
pub(crate) fn parse_resolver(s: &str) -> Option<std::net::SocketAddr> {
    s.parse()
        .ok()
        .or_else(|| Some(std::net::SocketAddr::new(s.parse().ok()?, 53)))
}

/// Longest accepted timeout (a week), so a deadline computed from it cannot overflow.
const MAX_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;

/// A validated host configuration.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// The file it was loaded from.
    pub file: PathBuf,
    /// The MCP socket path.
    pub socket: PathBuf,
    /// Permission bits for the socket (default 0660).
    pub socket_mode: u32,
    /// Directory for `signed-manifests.json`, `state.db` and the health file.
    pub state_dir: PathBuf,
    /// Directory of the decision records.
    pub records_dir: PathBuf,
    /// Where the flow state lives (default: `state_dir/state.db`).
    pub state: StateConfig,
    /// Where `tool_observation_health` is written on shutdown and on demand.
    pub health_file: PathBuf,
    /// Directories searched for execution profiles (then the built-in ones).
    pub profiles_dir: Vec<PathBuf>,
    /// Whether the native broker runs.
    pub broker: BrokerMode,
    /// One uid/gid every executor shares when the host is root (only when configured).
    pub executor_identity: Option<(u32, u32)>,
    /// The range each live executor's own uid (and gid) comes from, when no shared identity
    /// is configured (default [`flowhost_broker::UidRange::DEFAULT`]).
    pub executor_uids: flowhost_broker::UidRange,
    /// Largest accepted message, in bytes.
    pub max_message_bytes: usize,
    /// Per-call timeout.
    pub call_timeout: Duration,
    /// How long a session's executor may sit idle before it is stopped.
    pub idle_timeout: Duration,
    /// How long a connection may stay open without completing `initialize`.
    pub initialize_timeout: Duration,
    /// How long an initialized session may go without a request before it is closed.
    pub session_idle_timeout: Duration,
    /// How often the running host checks the flow state against the records written since
    /// the last check, and binds it to them (see `Host::check_state_while_serving`).
    pub state_check_interval: Duration,
    /// Record file rotation size.
    pub records_rotate_bytes: u64,
    /// Identical refusals (same principal or peer, reason and tool) within this interval
    /// fold into one record with a count.
    pub refusal_fold_interval: Duration,
    /// Most refusal records one principal (or unmapped peer) gets per fold interval; the rest
    /// fold into one record.
    pub refusal_records_per_interval: usize,
    /// Most executors sessions hold at once, host-wide; each principal may hold an equal
    /// share ([`crate::daemon::executor_share`]).
    pub max_executors: usize,
    /// Health warns when the records filesystem has less free space than this, in bytes.
    pub records_min_free_bytes: u64,
    /// Where executors' allowed lookups are asked (`IP` or `IP:PORT`, port 53 by default);
    /// `None`: the `nameserver` lines of the host's `/etc/resolv.conf`.
    pub dns_upstream: Option<Vec<std::net::SocketAddr>>,
    /// Version string of the classifier rules, reported in health.
    pub classifier_version: String,
    /// Label joined into every call's source.
    pub operator_input_floor: InformationLabel,
    /// Classifier rules, in order.
    pub classifiers: Vec<ClassifierRule>,
    /// Principals by Unix identity.
    pub principals: Vec<PrincipalConfig>,
    /// Servers in file order.
    pub servers: Vec<ServerConfig>,
    /// Trusted declassification authorities: id to public key.
    pub authorities: crate::grant::Authorities,
    /// Authorities whose key could not be read: id to the configuration key naming it
    /// (`declassification_authority[N].key`) and why. Only [`HostConfig::load_lenient`]
    /// yields a configuration with any: it trusts none of them, so a reload refused for
    /// them still withdraws them (see `Host::reload`).
    pub unreadable_authorities: BTreeMap<String, (String, String)>,
    /// Each authority's `key` as the file gives it (a path made absolute, or the key's
    /// text), readable or not: a reload whose file does not load reads them again, so that
    /// an authority whose key file was removed or replaced is withdrawn all the same.
    pub authority_keys: BTreeMap<String, String>,
    /// What a strict read refuses but [`HostConfig::load_lenient`] leaves out, so that a
    /// reload refused for it still withdraws what the file takes out: a reference to a
    /// server or principal no longer configured (the tool pattern is dropped), a principal
    /// left with no uid or gid. Each with its configuration key and why.
    pub dangling: Vec<(String, String)>,
    /// Uids and gids taken from a principal by a refused reload (see `Host::reload`): such
    /// a peer maps to no principal until a reload succeeds, rather than falling through to
    /// another principal by its gid, which neither configuration gave it. Empty in every
    /// configuration read from a file.
    pub withdrawn_peers: (BTreeSet<u32>, BTreeSet<u32>),
    /// MCP over Streamable HTTP, when configured (`[http]`).
    pub http: Option<HttpConfig>,
}

/// Where the host keeps its flow state (`[host] state = { backend = ... }`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateConfig {
    /// The embedded SQLite file `state_dir/state.db`, private to this host.
    Sqlite,
    /// A PostgreSQL database shared by every host of a fleet.
    Postgres(PostgresStateConfig),
}

/// The shared PostgreSQL flow state. Secrets come from files only, never from the
/// configuration text or a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresStateConfig {
    /// A file holding the connection URL or key=value string (it may omit the password).
    pub url_file: PathBuf,
    /// This host's stable name in the shared database: its records checkpoint is kept under
    /// it, so each host's state stays bound to its own records.
    pub host_id: String,
    /// A file holding the password (overrides any in the URL).
    pub password_file: Option<PathBuf>,
    /// PEM roots that authenticate the server; when set, TLS is required.
    pub ca_file: Option<PathBuf>,
    /// Without `ca_file`: the user (a name or a uid) whose server on this machine is the
    /// database; unset, `postgres`. A socket another user serves is refused.
    pub server_user: Option<String>,
    /// The schema holding flowhost's tables, the only one searched; unset, the tables are
    /// `public`'s, and a role that searches another schema first is refused.
    pub schema: Option<String>,
    /// How long one state operation (connecting included) may take before the call is
    /// refused.
    pub timeout: Duration,
    /// Connections the host keeps to the database.
    pub connections: usize,
}

/// The longest accepted `host_id`.
const MAX_HOST_ID: usize = 128;

/// A classifier rule: text matching `pattern` carries `label`.
#[derive(Debug, Clone)]
pub struct ClassifierRule {
    /// The regular expression.
    pub pattern: regex::Regex,
    /// The label it attaches.
    pub label: InformationLabel,
    /// Arguments, outputs or both.
    pub scopes: BTreeSet<ClassifierScope>,
}

/// The ids a configuration file holds (see [`HostConfig::ids_in`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct ConfigIds {
    /// `[[server]]` ids.
    pub servers: BTreeSet<String>,
    /// `[[principal]]` ids.
    pub principals: BTreeSet<String>,
    /// `[[declassification_authority]]` ids.
    pub authorities: BTreeSet<String>,
    /// The credentials `[http]` maps (`None`: no `[http]`).
    pub http: Option<HttpCredentials>,
}

/// What a TOML error says of `text`: the line and column and the parser's message, never
/// the parser's own text, which quotes the offending line. That line can hold a secret: a
/// private key's text pasted as a key (unquoted, or next to a typo) or a bearer token's
/// digest, and the message reaches the terminal, the journal, the unit's status text and
/// the reload verdict.
fn syntax_message(text: &str, e: &toml::de::Error) -> String {
    let at = e.span().and_then(|span| {
        let before = text.get(..span.start)?;
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
        Some(format!("line {line}, column {column}: "))
    });
    // serde's words quote a value given where another type was wanted (`invalid type:
    // string "...", expected ...`): a token written in the wrong place would be shown.
    let message = without_quoted_strings(e.message().trim_end());
    let disclosed = if crate::keys::holds_private_key_text(text) {
        " (the file holds a private key's text: treat that key as disclosed to whoever can \
         read this file)"
    } else {
        ""
    };
    format!("{}{message}{disclosed}", at.unwrap_or_default())
}

/// `message` with each double-quoted part (a value the parser quotes) replaced by `"…"`; a
/// quote without its pair (the parser naming the character it wanted) stays.
fn without_quoted_strings(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(open) = rest.find('"') {
        let Some(close) = rest[open + 1..].find('"') else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str("\"…\"");
        rest = &rest[open + 1 + close + 1..];
    }
    out.push_str(rest);
    out
}

/// A principal and what it may call.
#[derive(Debug, Clone)]
pub struct PrincipalConfig {
    /// The principal id used in labels and records.
    pub id: PrincipalId,
    /// Unix uids that authenticate as this principal (from SO_PEERCRED).
    pub uids: Vec<u32>,
    /// Unix gids that authenticate as this principal.
    pub gids: Vec<u32>,
    /// Tool patterns: `server/tool`, `server/*` or `*`.
    pub tools: Vec<String>,
    /// Per-origin destination rules for this principal's calls, on top of each server's.
    pub destinations: Option<crate::destination::OriginRules>,
}

impl PrincipalConfig {
    /// Whether this principal may call `server/tool`.
    pub fn may_call(&self, server: &str, tool: &str) -> bool {
        self.tools.iter().any(|p| {
            p == "*"
                || p.split_once('/')
                    .is_some_and(|(s, t)| s == server && (t == "*" || t == tool))
        })
    }
}

/// One server: its signed manifest, key, executor and policies.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Server id (must equal the manifest's `server_id`).
    pub id: String,
    /// Signed manifest envelope.
    pub manifest: PathBuf,
    /// The operator-registered public key (hex).
    pub key: String,
    /// Executor argv (argv[0] absolute).
    pub command: Vec<String>,
    /// Execution profile name.
    pub profile: String,
    /// Topology stated in the file, checked against the profile at startup.
    pub topology: Option<RuntimeTopology>,
    /// Extra paths the executor may read beneath.
    pub read_paths: Vec<PathBuf>,
    /// Environment for the executor.
    pub env: BTreeMap<String, String>,
    /// Warm executors kept ready.
    pub pool_size: usize,
    /// Whether this server's tools are offered under their bare names (no `server/`
    /// prefix), for clients that expect a single server's names. At most one server.
    pub unqualified_names: bool,
    /// Destination rules for this server's egress.
    pub destinations: DestinationRules,
    /// The names whose lookups' answers may bind private addresses (loopback, link-local,
    /// RFC 1918, ...) to the name, so host-name rules for it reach them; by default none may
    /// (see [`crate::dns::scope_on`]).
    pub private_answers: Vec<crate::destination::NamePattern>,
    /// Per-tool operator policy.
    pub policies: BTreeMap<String, ToolPolicy>,
    /// Per-tool record mapping (target projection).
    pub record_mappings: BTreeMap<String, crate::records::ToolMapping>,
    /// The least label of everything the server's resources and prompts return (required
    /// when its manifest declares any; never `Top`).
    pub content_floor: Option<InformationLabel>,
}

/// Largest configuration file read.
const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

impl HostConfig {
    /// Loads and validates `file`, which must be one only root or the host's user may
    /// change (after any symbolic link): it names the keys, tokens, key sets and policies
    /// everything else is judged by, so whoever could edit it would not need to get past
    /// any other check.
    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        Self::load_lenient(file)?.with_every_authority()
    }

    /// [`HostConfig::load`], except that an authority whose key cannot be read is left out
    /// of [`HostConfig::authorities`] and named in [`HostConfig::unreadable_authorities`]
    /// rather than refusing the file: what a reload withdraws when it is refused.
    pub(crate) fn load_lenient(file: &Path) -> Result<Self, ConfigError> {
        Self::parse_lenient(file, &Self::read_text(file)?)
    }

    /// What a reload reads, from one read of `file`: [`HostConfig::load_lenient`], and, when
    /// that fails, [`HostConfig::ids_in`] of the same text (never of another version of the
    /// file, written between two reads).
    pub(crate) fn load_for_reload(file: &Path) -> (Result<Self, ConfigError>, Option<ConfigIds>) {
        let text = match Self::read_text(file) {
            Ok(text) => text,
            Err(e) => return (Err(e), None),
        };
        match Self::parse_lenient(file, &text) {
            Ok(config) => (Ok(config), None),
            Err(e) => (Err(e), Self::ids_in(&text)),
        }
    }

    /// The configuration file's text, read where no one but root or this user could have
    /// changed it.
    fn read_text(file: &Path) -> Result<String, ConfigError> {
        let bytes = crate::files::trusted_target(file)
            .and_then(|target| crate::files::read_trusted(&target, MAX_CONFIG_BYTES, false))
            .map_err(|e| ConfigError::Untrusted {
                file: file.to_path_buf(),
                reason: e.to_string(),
            })?;
        String::from_utf8(bytes).map_err(|_| ConfigError::Untrusted {
            file: file.to_path_buf(),
            reason: "not UTF-8 text".into(),
        })
    }

    /// The ids of the servers, principals and declassification authorities a configuration
    /// `text` still holds, and the HTTP credentials it maps, read from its TOML alone, for a
    /// file that does not load (an unknown key or a value out of range elsewhere): taking one out is
    /// how an operator withdraws trust, and must not wait for the rest of the file to be
    /// right. `None` when the text is no TOML, or its top level is not as a
    /// configuration's (an unknown table, a `[[server]]`, `[[principal]]` or
    /// `[[declassification_authority]]` entry without a string `id`, one of them not an
    /// array of tables): what it holds is then unknown, and a mistyped header must not read
    /// as everything taken out.
    pub(crate) fn ids_in(text: &str) -> Option<ConfigIds> {
        let table: toml::Table = text.parse().ok()?;
        const LISTS: [&str; 3] = ["server", "principal", "declassification_authority"];
        if table.keys().any(|k| {
            !LISTS.contains(&k.as_str()) && !["host", "classifier", "http"].contains(&k.as_str())
        }) {
            return None;
        }
        let ids = |key: &str| -> Option<BTreeSet<String>> {
            match table.get(key) {
                None => Some(BTreeSet::new()),
                Some(list) => (list.as_array()?.iter())
                    .map(|entry| Some(entry.as_table()?.get("id")?.as_str()?.to_string()))
                    .collect(),
            }
        };
        let http = match table.get("http") {
            None => None,
            Some(http) => Some(HttpCredentials::in_toml(http.as_table()?)),
        };
        Some(ConfigIds {
            servers: ids("server")?,
            principals: ids("principal")?,
            authorities: ids("declassification_authority")?,
            http,
        })
    }

    /// This configuration, refused when an authority's key could not be read or a lenient
    /// read left anything out ([`HostConfig::dangling`]).
    pub(crate) fn with_every_authority(self) -> Result<Self, ConfigError> {
        if let Some((key, message)) = self.dangling.first() {
            return Err(ConfigError::Invalid {
                file: self.file.clone(),
                key: key.clone(),
                message: message.clone(),
            });
        }
        match self.unreadable_authorities.first_key_value() {
            None => Ok(self),
            Some((_, (key, message))) => Err(ConfigError::Invalid {
                file: self.file.clone(),
                key: key.clone(),
                message: message.clone(),
            }),
        }
    }

    /// Parses configuration text; `file` names it in errors and anchors relative paths.
    pub fn parse(file: &Path, text: &str) -> Result<Self, ConfigError> {
        Self::parse_lenient(file, text)?.with_every_authority()
    }

    /// [`HostConfig::parse`], lenient as [`HostConfig::load_lenient`] is.
    fn parse_lenient(file: &Path, text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            file: file.to_path_buf(),
            message: syntax_message(text, &e),
        })?;
        let dir = file
            .parent()
            .map(|p| {
                if p.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    p
                }
            })
            .unwrap_or(Path::new("."));
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let resolve = |p: &Path| {
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                dir.join(p)
            }
        };
        let invalid = |key: String, message: String| ConfigError::Invalid {
            file: file.to_path_buf(),
            key,
            message,
        };
        // A registered key: hex stays hex; anything else names a key file, relative to this
        // file. A private key file's text pasted in is kept as it is: taken for a file name,
        // it would be printed by every error naming the path; kept, it is a key that cannot
        // be read (refused unechoed), so the start is refused and a reload withdraws what it
        // vouched for, as for any key that cannot be read.
        let key_arg = |text: &str| {
            if crate::keys::is_private_key_text(text)
                || text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
            {
                text.to_string()
            } else {
                resolve(Path::new(text)).display().to_string()
            }
        };

        let h = raw.host;
        if h.max_message_bytes < 1024 || h.max_message_bytes > MOST_MESSAGE_BYTES {
            return Err(invalid(
                "host.max_message_bytes".into(),
                format!(
                    "{} is out of range; use 1024 to {MOST_MESSAGE_BYTES} (bytes)",
                    h.max_message_bytes
                ),
            ));
        }
        for (key, n) in [
            ("refusal_fold_interval_ms", h.refusal_fold_interval_ms),
            (
                "refusal_records_per_interval",
                h.refusal_records_per_interval as u64,
            ),
        ] {
            if n == 0 {
                return Err(invalid(
                    format!("host.{key}"),
                    "is 0; it must be positive".into(),
                ));
            }
        }
        if h.max_executors == 0 || h.max_executors > MOST_EXECUTORS {
            return Err(invalid(
                "host.max_executors".into(),
                format!(
                    "{} is out of range; use 1 to {MOST_EXECUTORS}",
                    h.max_executors
                ),
            ));
        }
        // Folded refusals are written when their interval ends: a longer one would keep them
        // only in memory, lost with a crash, for that long.
        if h.refusal_fold_interval_ms > MAX_FOLD_INTERVAL_MS {
            return Err(invalid(
                "host.refusal_fold_interval_ms".into(),
                format!(
                    "{} is out of range; use 1 to {MAX_FOLD_INTERVAL_MS} (milliseconds: an hour)",
                    h.refusal_fold_interval_ms
                ),
            ));
        }
        if h.records_rotate_bytes < MIN_ROTATE_BYTES {
            return Err(invalid(
                "host.records_rotate_bytes".into(),
                format!(
                    "{} is below {MIN_ROTATE_BYTES} (1 MiB): a record file of a handful of records \
                     each would multiply the files every reader and the diff must open",
                    h.records_rotate_bytes
                ),
            ));
        }
        for (key, ms) in [
            ("call_timeout_ms", h.call_timeout_ms),
            ("idle_timeout_ms", h.idle_timeout_ms),
            ("initialize_timeout_ms", h.initialize_timeout_ms),
            ("session_idle_timeout_ms", h.session_idle_timeout_ms),
            ("state_check_interval_ms", h.state_check_interval_ms),
        ] {
            if ms == 0 || ms > MAX_TIMEOUT_MS {
                return Err(invalid(
                    format!("host.{key}"),
                    format!("{ms} is out of range; use 1 to {MAX_TIMEOUT_MS} (milliseconds)"),
                ));
            }
        }
        // 4294967295 is "no change" to setresuid/setresgid: the executor would keep the
        // broker's identity (root's, on a root host).
        let usable = |id: u32| id != 0 && id != u32::MAX;
        let executor_identity = match (h.executor_uid, h.executor_gid) {
            (Some(u), Some(g)) if usable(u) && usable(g) => Some((u, g)),
            (None, None) => None,
            (uid, gid) => {
                let (key, value) = match (uid, gid) {
                    (Some(u), _) if !usable(u) => ("executor_uid", Some(u)),
                    (_, Some(g)) if !usable(g) => ("executor_gid", Some(g)),
                    (None, _) => ("executor_uid", None),
                    _ => ("executor_gid", None),
                };
                let given = match value {
                    Some(v) => format!("is {v}; "),
                    None => "is not set; ".into(),
                };
                return Err(invalid(
                    format!("host.{key}"),
                    format!(
                        "{given}set both executor_uid and executor_gid, neither of them 0 nor 4294967295"
                    ),
                ));
            }
        };
        let executor_uids = match &h.executor_uid_range {
            None => flowhost_broker::UidRange::DEFAULT,
            Some(_) if executor_identity.is_some() => {
                return Err(invalid(
                    "host.executor_uid_range".into(),
                    "set either executor_uid_range (a uid per executor) or executor_uid and \
                     executor_gid (one shared identity), not both"
                        .into(),
                ));
            }
            Some(text) => parse_uid_range(text).ok_or_else(|| {
                invalid(
                    "host.executor_uid_range".into(),
                    format!(
                        "{text:?} is not a range like \"1879048192-1879113727\" (FIRST-LAST, \
                         1 <= FIRST <= LAST < 4294967295)"
                    ),
                )
            })?,
        };
        let socket_mode = match &h.socket_mode {
            None => 0o660,
            Some(m) => u32::from_str_radix(m, 8)
                .ok()
                .filter(|m| *m <= 0o777)
                .ok_or_else(|| {
                    invalid(
                        "host.socket_mode".into(),
                        format!("{m:?} is not an octal mode like \"660\""),
                    )
                })?,
        };
        let floor = h
            .operator_input_floor
            .unwrap_or_else(InformationLabel::bottom);
        if floor.is_top() {
            return Err(invalid(
                "host.operator_input_floor".into(),
                "cannot be top (nothing could ever egress)".into(),
            ));
        }

        let mut classifiers = Vec::new();
        for (i, c) in raw.classifier.into_iter().enumerate() {
            // The classifier reads a message's strings one per line: `^` and `$` match at
            // each line's ends, so a pattern anchored to a whole value still finds it.
            let pattern = regex::RegexBuilder::new(&c.pattern)
                .multi_line(true)
                .size_limit(1 << 20)
                .build()
                .map_err(|e| invalid(format!("classifier[{i}].pattern"), e.to_string()))?;
            if c.label.is_top() {
                return Err(invalid(
                    format!("classifier[{i}].label"),
                    "cannot be top".into(),
                ));
            }
            if c.applies_to.is_empty() {
                return Err(invalid(
                    format!("classifier[{i}].applies_to"),
                    "lists nothing".into(),
                ));
            }
            classifiers.push(ClassifierRule {
                pattern,
                label: c.label,
                scopes: c.applies_to.into_iter().collect(),
            });
        }

        let mut servers = Vec::new();
        let mut ids = BTreeSet::new();
        for (i, s) in raw.server.into_iter().enumerate() {
            let key = |k: &str| format!("server[{i}].{k}");
            crate::ident::validate_identifier("server id", &s.id)
                .map_err(|e| invalid(key("id"), e.to_string()))?;
            if s.id.contains('/') {
                return Err(invalid(
                    key("id"),
                    format!(
                        "{:?} contains '/', which separates the server from the tool in the names clients call",
                        s.id
                    ),
                ));
            }
            if !ids.insert(s.id.clone()) {
                return Err(invalid(
                    key("id"),
                    format!("server {:?} is configured twice", s.id),
                ));
            }
            if let Some(name) = s.env.keys().find(|n| flowhost_broker::env_forbidden(n)) {
                return Err(invalid(
                    key("env"),
                    format!(
                        "names {name:?}, which executors never receive (it changes how a \
                         loader, interpreter or the C library behaves before the tool's own \
                         code runs), so every spawn would fail"
                    ),
                ));
            }
            let Some(program) = s.command.first() else {
                return Err(invalid(key("command"), "is empty".into()));
            };
            let program = resolve(Path::new(program));
            let mut command = vec![program.display().to_string()];
            let dir_text = dir.display().to_string();
            command.extend(
                s.command[1..]
                    .iter()
                    .map(|a| a.replace("${config_dir}", &dir_text)),
            );
            if s.pool_size > 64 {
                return Err(invalid(
                    key("pool_size"),
                    format!("{} is out of range; use 0 to 64", s.pool_size),
                ));
            }
            if s.content_floor
                .as_ref()
                .is_some_and(InformationLabel::is_top)
            {
                return Err(invalid(
                    key("content_floor"),
                    "is top; name the owners and compartments the server's resources and prompts carry".into(),
                ));
            }
            let private_answers = s
                .private_answers
                .iter()
                .enumerate()
                .map(|(j, p)| {
                    p.parse()
                        .map_err(|e| invalid(key(&format!("private_answers[{j}]")), e))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut policies = BTreeMap::new();
            let mut record_mappings = BTreeMap::new();
            for (tool, t) in s.tools {
                policies.insert(tool.clone(), t.policy);
                if let Some(m) = t.record {
                    record_mappings.insert(tool, m);
                }
            }
            servers.push(ServerConfig {
                id: s.id,
                manifest: resolve(&s.manifest),
                key: key_arg(&s.key),
                command,
                profile: s.profile,
                topology: s.topology,
                read_paths: s.read_paths.iter().map(|p| resolve(p)).collect(),
                env: s.env,
                pool_size: s.pool_size,
                unqualified_names: s.unqualified_names,
                destinations: s.destinations,
                private_answers,
                policies,
                record_mappings,
                content_floor: s.content_floor,
            });
        }

        if let Some(second) = servers.iter().filter(|s| s.unqualified_names).nth(1) {
            return Err(invalid(
                format!("server {:?}.unqualified_names", second.id),
                "only one server may offer its tools under bare names".into(),
            ));
        }
        let mut dangling = Vec::new();
        let http = match raw.http {
            None => None,
            Some(h) => {
                Some(http::validate(h, resolve, &mut dangling).map_err(|(k, m)| invalid(k, m))?)
            }
        };
        let named_by_http = |id: &PrincipalId| {
            http.as_ref()
                .is_some_and(|h| h.named_principals().any(|(_, p)| p == id))
        };
        let mut principals: Vec<PrincipalConfig> = Vec::new();
        let mut seen_uids = BTreeMap::new();
        let mut seen_gids = BTreeMap::new();
        for (i, p) in raw.principal.into_iter().enumerate() {
            // Rules, tools and HTTP identities are looked up by id: a second entry of one id
            // would silently take the place of the first in some of them.
            if principals.iter().any(|q| q.id == p.id) {
                return Err(invalid(
                    format!("principal[{i}].id"),
                    format!("principal {} is configured twice", p.id),
                ));
            }
            if p.uids.is_empty() && p.gids.is_empty() && !named_by_http(&p.id) {
                dangling.push((
                    format!("principal[{i}].uids"),
                    "name at least one uid or gid (or name the principal in [http])".into(),
                ));
            }
            for uid in &p.uids {
                if let Some(other) = seen_uids.insert(*uid, p.id.clone()) {
                    return Err(invalid(
                        format!("principal[{i}].uids"),
                        format!("uid {uid} is already principal {other}"),
                    ));
                }
            }
            // A peer is mapped by its uid first, then by its gid: a gid of two principals
            // would map every member to whichever is listed first.
            for gid in &p.gids {
                if let Some(other) = seen_gids.insert(*gid, p.id.clone()) {
                    return Err(invalid(
                        format!("principal[{i}].gids"),
                        format!("gid {gid} is already principal {other}"),
                    ));
                }
            }
            let mut tools = p.tools;
            tools.retain(|pattern| {
                let known = pattern == "*"
                    || pattern
                        .split_once('/')
                        .is_some_and(|(s, _)| servers.iter().any(|c| c.id == s));
                if !known {
                    dangling.push((
                        format!("principal[{i}].tools"),
                        format!(
                            "{pattern:?} names no configured server (use server/tool, server/* or *)"
                        ),
                    ));
                }
                known
            });
            principals.push(PrincipalConfig {
                id: p.id,
                uids: p.uids,
                gids: p.gids,
                tools,
                destinations: p.destinations,
            });
        }

        // An executor running as a principal's uid or gid could connect to the socket and be
        // taken for that principal.
        for (i, p) in principals.iter().enumerate() {
            let overlap = p.uids.iter().find(|&&u| match executor_identity {
                Some((eu, _)) => u == eu,
                None => executor_uids.contains(u),
            });
            if let Some(uid) = overlap {
                return Err(invalid(
                    format!("principal[{i}].uids"),
                    format!(
                        "uid {uid} is also one executors run as ({}): a principal's uid must be \
                         none of theirs",
                        match executor_identity {
                            Some((u, g)) => format!("executor_uid {u}, executor_gid {g}"),
                            None => format!("executor_uid_range {executor_uids}"),
                        }
                    ),
                ));
            }
            let gid_overlap = p.gids.iter().find(|&&g| match executor_identity {
                Some((_, eg)) => g == eg,
                None => executor_uids.contains(g),
            });
            if let Some(gid) = gid_overlap {
                return Err(invalid(
                    format!("principal[{i}].gids"),
                    format!(
                        "gid {gid} is also one executors run as: a principal's gid must be none of theirs"
                    ),
                ));
            }
        }

        if let Some(h) = &http {
            for (key, id) in h.named_principals() {
                if !principals.iter().any(|p: &PrincipalConfig| p.id == *id) {
                    dangling.push((
                        key,
                        format!("{id} is not a configured principal ([[principal]] id)"),
                    ));
                }
            }
        }

        let mut authorities = crate::grant::Authorities::new();
        let mut unreadable_authorities = BTreeMap::new();
        let mut authority_keys = BTreeMap::new();
        for (i, a) in raw.declassification_authority.iter().enumerate() {
            let at = format!("declassification_authority[{i}]");
            if a.id.is_empty() || a.id.len() > 256 || a.id.chars().any(char::is_control) {
                return Err(invalid(
                    format!("{at}.id"),
                    "must be 1 to 256 bytes without control characters".into(),
                ));
            }
            let arg = key_arg(&a.key);
            if authorities.contains_key(&a.id) || unreadable_authorities.contains_key(&a.id) {
                return Err(invalid(
                    format!("{at}.id"),
                    format!("authority {:?} is configured twice", a.id),
                ));
            }
            authority_keys.insert(a.id.clone(), arg.clone());
            match crate::keys::verifying_key_from_arg(&arg) {
                Ok(key) => {
                    authorities.insert(a.id.clone(), key);
                }
                Err(e) => {
                    unreadable_authorities.insert(
                        a.id.clone(),
                        (
                            format!("{at}.key"),
                            crate::causes::WithCauses(&e).to_string(),
                        ),
                    );
                }
            }
        }

        let state = match &h.state {
            None | Some(RawState::Sqlite {}) => StateConfig::Sqlite,
            Some(RawState::Postgres {
                url_file,
                host_id,
                password_file,
                ca_file,
                server_user,
                schema,
                timeout_ms,
                connections,
            }) => {
                if server_user.as_deref().is_some_and(|u| {
                    u.is_empty() || u.len() > 64 || u.chars().any(|c| c.is_control() || c == ':')
                }) {
                    return Err(invalid(
                        "host.state.server_user".into(),
                        format!("{server_user:?} is not a user name or uid"),
                    ));
                }
                if host_id.is_empty()
                    || host_id.len() > MAX_HOST_ID
                    || !host_id
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                {
                    return Err(invalid(
                        "host.state.host_id".into(),
                        format!(
                            "{host_id:?} is not 1 to {MAX_HOST_ID} characters of A-Z a-z 0-9 . _ -"
                        ),
                    ));
                }
                // Lower case only: PostgreSQL folds unquoted names, and `Fleet` and `fleet`
                // would otherwise be two schemas one operator reads as one.
                if let Some(schema) = schema
                    && (schema.is_empty()
                        || schema.len() > 63
                        || schema.starts_with(|c: char| c.is_ascii_digit())
                        || schema.starts_with("pg_")
                        || !schema
                            .bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'))
                {
                    return Err(invalid(
                        "host.state.schema".into(),
                        format!(
                            "{schema:?} is not 1 to 63 characters of a-z 0-9 _ not starting with \
                             a digit or pg_"
                        ),
                    ));
                }
                if *timeout_ms == 0 || *timeout_ms > MAX_TIMEOUT_MS {
                    return Err(invalid(
                        "host.state.timeout_ms".into(),
                        format!("{timeout_ms} is not between 1 and {MAX_TIMEOUT_MS}"),
                    ));
                }
                if !(1..=64).contains(connections) {
                    return Err(invalid(
                        "host.state.connections".into(),
                        format!("{connections} is not between 1 and 64"),
                    ));
                }
                StateConfig::Postgres(PostgresStateConfig {
                    url_file: resolve(url_file),
                    host_id: host_id.clone(),
                    password_file: password_file.as_deref().map(resolve),
                    ca_file: ca_file.as_deref().map(resolve),
                    server_user: server_user.clone(),
                    schema: schema.clone(),
                    timeout: Duration::from_millis(*timeout_ms),
                    connections: *connections,
                })
            }
        };
        let dns_upstream = match &h.dns_upstream {
            None => None,
            // No resolver to ask: every lookup an executor's rules allow would be recorded
            // as allowed and then fail. Names are refused by the destination rules.
            Some(list) if list.is_empty() => {
                return Err(invalid(
                    "host.dns_upstream".into(),
                    "is empty, so no lookup could be answered; leave it out to ask the \
                     host's /etc/resolv.conf resolvers, or refuse names with destination rules"
                        .into(),
                ));
            }
            Some(list) => Some(
                list.iter()
                    .enumerate()
                    .map(|(i, a)| {
                        parse_resolver(a).ok_or_else(|| {
                            invalid(
                                format!("host.dns_upstream[{i}]"),
                                format!("{a:?} is not IP, IP:PORT or [IPv6]:PORT"),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let state_dir = resolve(&h.state_dir);
        Ok(HostConfig {
            dns_upstream,
            state,
            file: file.to_path_buf(),
            socket: resolve(&h.socket),
            socket_mode,
            health_file: h
                .health_file
                .as_deref()
                .map(resolve)
                .unwrap_or_else(|| state_dir.join("health.json")),
            state_dir,
            records_dir: resolve(&h.records_dir),
            profiles_dir: h.profiles_dir.iter().map(|p| resolve(p)).collect(),
            broker: h.broker,
            executor_identity,
            executor_uids,
            max_message_bytes: h.max_message_bytes,
            call_timeout: Duration::from_millis(h.call_timeout_ms),
            idle_timeout: Duration::from_millis(h.idle_timeout_ms),
            initialize_timeout: Duration::from_millis(h.initialize_timeout_ms),
            session_idle_timeout: Duration::from_millis(h.session_idle_timeout_ms),
            state_check_interval: Duration::from_millis(h.state_check_interval_ms),
            records_rotate_bytes: h.records_rotate_bytes,
            refusal_fold_interval: Duration::from_millis(h.refusal_fold_interval_ms),
            refusal_records_per_interval: h.refusal_records_per_interval,
            max_executors: h.max_executors,
            records_min_free_bytes: h.records_min_free_mib.saturating_mul(1024 * 1024),
            classifier_version: h.classifier_version,
            operator_input_floor: floor,
            classifiers,
            principals,
            servers,
            authorities,
            unreadable_authorities,
            authority_keys,
            dangling,
            withdrawn_peers: Default::default(),
            http,
        })
    }

    /// The server and tool a client's tool name designates: `server/tool`, or a bare name
    /// of the server that offers its tools unqualified.
    pub fn tool_name<'n>(&'n self, name: &'n str) -> (&'n str, &'n str) {
        match name.split_once('/') {
            Some(parts) => parts,
            None => (
                self.servers
                    .iter()
                    .find(|s| s.unqualified_names)
                    .map_or("", |s| s.id.as_str()),
                name,
            ),
        }
    }

    /// The name clients see for `tool` of `server` (see [`HostConfig::tool_name`]).
    pub fn public_tool_name(&self, server: &str, tool: &str) -> String {
        if self
            .servers
            .iter()
            .any(|s| s.id == server && s.unqualified_names)
        {
            tool.to_string()
        } else {
            format!("{server}/{tool}")
        }
    }

    /// The uid and gid executors run as, or (with a range) the first of the range: what the
    /// checks of server programs (`host::runtime`) judge file permissions for.
    pub fn executor_identity_hint(&self) -> (u32, u32) {
        let first = self.executor_uids.first;
        self.executor_identity.unwrap_or((first, first))
    }

    /// The principal a connecting peer authenticates as: by uid first, then by gid; none
    /// for a uid or gid a refused reload withdrew ([`HostConfig::withdrawn_peers`]).
    pub fn principal_for(&self, uid: u32, gid: u32) -> Option<&PrincipalConfig> {
        let (uids, gids) = &self.withdrawn_peers;
        if uids.contains(&uid) {
            return None;
        }
        self.principals
            .iter()
            .find(|p| p.uids.contains(&uid))
            .or_else(|| {
                (!gids.contains(&gid))
                    .then(|| self.principals.iter().find(|p| p.gids.contains(&gid)))
                    .flatten()
            })
    }
}

/// Parses `FIRST-LAST` (inclusive; never uid 0 or the invalid uid 4294967295).
fn parse_uid_range(text: &str) -> Option<flowhost_broker::UidRange> {
    let (first, last) = text.split_once('-')?;
    let (first, last): (u32, u32) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first >= 1 && first <= last && last < u32::MAX).then(|| flowhost_broker::UidRange {
        first,
        count: last - first + 1,
    })
}

/// The topology a profile implies: no network path is `local`, the host network `brokered`.
pub fn topology_of(profile: &flowhost_broker::Profile) -> RuntimeTopology {
    match profile.network {
        flowhost_broker::NetworkPath::None => RuntimeTopology::Local,
        flowhost_broker::NetworkPath::Host => RuntimeTopology::Brokered,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A valid configuration with one principal and one server, paths relative to
    /// `/etc/flowhost`.
    pub(crate) const MINIMAL: &str = r#"
[host]
socket = "s.sock"
state_dir = "state"
records_dir = "records"

[[principal]]
id = "alice"
uids = [1000]
tools = ["srv/*"]

[[server]]
id = "srv"
manifest = "srv.signed.json"
key = "keys/srv.pub"
command = ["bin/tool", "--data", "${config_dir}/data"]
profile = "isolated"

[server.tools.t]
policy = { input_clearances = [], output_floor = { kind = "known", owners = {}, compartments = [] } }
"#;

    fn parse(text: &str) -> Result<HostConfig, ConfigError> {
        HostConfig::parse(Path::new("/etc/flowhost/host.toml"), text)
    }

    fn error(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    /// What a file that does not load still holds is read from its TOML (one read with the
    /// load), and only from a top level that is a configuration's.
    #[test]
    fn a_file_that_does_not_load_tells_its_ids() {
        let ids = HostConfig::ids_in(&MINIMAL.replacen("[host]\n", "[host]\nno_such_key = 1\n", 1))
            .unwrap();
        assert_eq!(ids.servers, BTreeSet::from(["srv".to_string()]));
        assert_eq!(ids.principals, BTreeSet::from(["alice".to_string()]));
        assert!(ids.authorities.is_empty() && ids.http.is_none());
        for unknown in [
            MINIMAL.replacen("[[principal]]", "[[principals]]", 1),
            MINIMAL.replacen("id = \"alice\"", "ident = \"alice\"", 1),
            "not toml [".to_string(),
        ] {
            assert!(HostConfig::ids_in(&unknown).is_none(), "{unknown}");
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("host.toml");
        std::fs::write(
            &file,
            MINIMAL.replacen("[host]\n", "[host]\nno_such_key = 1\n", 1),
        )
        .unwrap();
        let (config, ids) = HostConfig::load_for_reload(&file);
        assert!(config.is_err() && ids.is_some_and(|i| i.servers.contains("srv")));
    }

    /// The running host's check of its flow state against the records: 10 s unless set,
    /// and never 0 (a check that never comes would be no check).
    #[test]
    fn the_state_check_interval_has_a_default_and_a_range() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.state_check_interval, Duration::from_secs(10));
        let set = |v: &str| {
            MINIMAL.replacen(
                "[host]\n",
                &format!("[host]\nstate_check_interval_ms = {v}\n"),
                1,
            )
        };
        assert_eq!(
            parse(&set("250")).unwrap().state_check_interval,
            Duration::from_millis(250)
        );
        let err = error(&set("0"));
        assert!(err.contains("host.state_check_interval_ms"), "{err}");
    }

    #[test]
    fn resolves_paths_and_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.socket, Path::new("/etc/flowhost/s.sock"));
        assert_eq!(c.health_file, Path::new("/etc/flowhost/state/health.json"));
        assert_eq!(
            c.servers[0].command,
            vec!["/etc/flowhost/bin/tool", "--data", "/etc/flowhost/data"]
        );
        assert_eq!(c.servers[0].key, "/etc/flowhost/keys/srv.pub");
        assert_eq!(c.socket_mode, 0o660);
        assert_eq!(c.broker, BrokerMode::Native);
        assert_eq!(c.max_message_bytes, 1 << 20);
        assert!(c.principals[0].may_call("srv", "t"));
        assert!(!c.principals[0].may_call("other", "t"));
        assert_eq!(c.principal_for(1000, 5).unwrap().id.as_str(), "alice");
        assert!(c.principal_for(1001, 5).is_none());
    }

    #[test]
    fn private_answers_are_host_name_patterns_checked_strictly() {
        let with = |list: &str| {
            MINIMAL.replace(
                "profile = \"isolated\"",
                &format!("profile = \"isolated\"\nprivate_answers = {list}"),
            )
        };
        assert!(
            parse(MINIMAL).unwrap().servers[0]
                .private_answers
                .is_empty()
        );
        let c = parse(&with(r#"["fetch.test", "*.corp.internal"]"#)).unwrap();
        let shown: Vec<String> = c.servers[0]
            .private_answers
            .iter()
            .map(|p| p.to_string())
            .collect();
        assert_eq!(shown, ["fetch.test", "*.corp.internal"]);
        for bad in [
            r#"["fetch.test:80"]"#,
            r#"["127.0.0.1"]"#,
            r#"["*"]"#,
            r#"["a.*.test"]"#,
            r#"[""]"#,
        ] {
            let e = error(&with(&format!(r#"["ok.test", {}"#, &bad[1..])));
            assert!(e.contains("`server[0].private_answers[1]`"), "{bad}: {e}");
        }
        let e = error(&with(r#""fetch.test""#));
        assert!(e.contains("host.toml"), "{e}");
    }

    /// A private key file's text given as a registered key was taken for a file name, and
    /// every error naming that path printed the seed (at start, in the reload verdict). It
    /// is a key that cannot be read, refused without being shown: the server's key is kept
    /// as the text (the start refuses it, a reload withdraws the server), the authority is
    /// one whose key cannot be read (withdrawn, even by a reload refused for another reason).
    #[test]
    fn a_private_keys_text_as_a_registered_key_is_unreadable_and_unechoed() {
        let seed = "ab".repeat(32);
        let secret = format!("flowhost-ed25519-private-key {seed}");
        let c = parse(&MINIMAL.replace("key = \"keys/srv.pub\"", &format!("key = \"{secret}\"")))
            .unwrap();
        assert_eq!(c.servers[0].key, secret);
        let e = crate::keys::verifying_key_from_arg(&c.servers[0].key)
            .unwrap_err()
            .to_string();
        assert!(e.contains("private key") && !e.contains(&seed), "{e}");
        let text = format!(
            "{MINIMAL}\n[[declassification_authority]]\nid = \"ops\"\nkey = \" {secret}\"\n"
        );
        let e = error(&text);
        assert!(
            e.contains("`declassification_authority[0].key`") && !e.contains(&seed),
            "{e}"
        );
        let c = HostConfig::parse_lenient(Path::new("/etc/flowhost/host.toml"), &text).unwrap();
        let (field, why) = &c.unreadable_authorities["ops"];
        assert_eq!(field, "declassification_authority[0].key");
        assert!(why.contains("private key") && !why.contains(&seed), "{why}");
        assert!(!c.authorities.contains_key("ops"));
    }

    /// A private key pasted unquoted (or beside a typo) made the parser's error quote the
    /// line, seed and all, into the terminal, the journal and the reload verdict.
    #[test]
    fn a_syntax_error_in_a_file_holding_a_private_key_does_not_quote_it() {
        let seed = "cd".repeat(32);
        let e = error(&MINIMAL.replace(
            "key = \"keys/srv.pub\"",
            &format!("key = flowhost-ed25519-private-key {seed}"),
        ));
        assert!(!e.contains(&seed), "{e}");
        assert!(
            e.contains("line 15, column 7: ") && e.contains("treat that key as disclosed"),
            "{e}"
        );
        // No line is quoted elsewhere either: a bearer token's digest on a line with a typo
        // would reach the journal and `systemctl status`.
        let digest = "ab".repeat(32);
        let e = error(&format!(
            "{MINIMAL}\n[[http.token]]\nprincipal = \"alice\"\nsha256 = \"{digest}\n"
        ));
        assert!(
            !e.contains(&digest) && e.contains("line 24, column 75"),
            "{e}"
        );
        // Columns count characters, not bytes.
        let e = error("# é\n[host]\nsocket = \"é\" x\n");
        assert!(e.contains("line 3, column 14: "), "{e}");
        // A value given where another type was wanted is not quoted back.
        let e = error(&format!("{MINIMAL}\n[http]\ntoken = \"s3cr3t-bearer\"\n"));
        assert!(!e.contains("s3cr3t") && e.contains("invalid type"), "{e}");
        assert_eq!(without_quoted_strings("a \"b\" c \"d"), "a \"…\" c \"d");
        assert_eq!(
            without_quoted_strings("invalid basic string, expected `\"`"),
            "invalid basic string, expected `\"`"
        );
    }

    #[test]
    fn errors_name_the_file_and_the_key() {
        let e = error(&MINIMAL.replace("[host]", "[host]\nbogus = 1"));
        assert!(
            e.starts_with("/etc/flowhost/host.toml:") && e.contains("unknown field `bogus`"),
            "{e}"
        );
        let e = error(&MINIMAL.replace(
            "socket = \"s.sock\"",
            "socket = \"s.sock\"\nsocket_mode = \"999\"",
        ));
        assert!(e.contains("`host.socket_mode`"), "{e}");
        let e = error(&MINIMAL.replace("tools = [\"srv/*\"]", "tools = [\"nosuch/*\"]"));
        assert!(
            e.contains("`principal[0].tools`") && e.contains("nosuch"),
            "{e}"
        );
        let e = error(&MINIMAL.replace(
            "command = [\"bin/tool\", \"--data\", \"${config_dir}/data\"]",
            "command = []",
        ));
        assert!(e.contains("`server[0].command`"), "{e}");
        let e = error(&format!(
            "{MINIMAL}\n[[classifier]]\npattern = \"(unclosed\"\nlabel = {{ kind = \"known\", owners = {{}}, compartments = [] }}\n"
        ));
        assert!(e.contains("`classifier[0].pattern`"), "{e}");
        // A pattern anchored to a whole value finds it among the others the classifier
        // reads (one per line): before, `^` and `$` matched only the ends of all of them.
        let anchored = parse(&format!(
            "{MINIMAL}\n[[classifier]]\npattern = '^\\d{{16}}$'\nlabel = {{ kind = \"known\", owners = {{}}, compartments = [\"cards\"] }}\n"
        ))
        .unwrap();
        assert!(
            anchored.classifiers[0]
                .pattern
                .is_match("card\n4111111111111111\nname")
        );
        let e = error(&MINIMAL.replace("uids = [1000]", "uids = []"));
        assert!(e.contains("`principal[0].uids`"), "{e}");
        let e = error(&MINIMAL.replace(
            "output_floor = {",
            "output_floor = { kind = \"top\" }, x = {",
        ));
        assert!(e.contains("host.toml"), "{e}");
        let e = error(&MINIMAL.replace(
            "profile = \"isolated\"",
            "profile = \"isolated\"\ncontent_floor = { kind = \"top\" }",
        ));
        assert!(
            e.contains("`server[0].content_floor`") && e.contains("top"),
            "{e}"
        );
        let ok = parse(&MINIMAL.replace(
            "profile = \"isolated\"",
            "profile = \"isolated\"\ncontent_floor = { kind = \"known\", owners = {}, compartments = [\"c\"] }",
        ))
        .unwrap();
        assert!(ok.servers[0].content_floor.is_some());
        // The key named is the one that is wrong (or missing), with the value given.
        let e = error(&MINIMAL.replace("[host]", "[host]\nexecutor_uid = 5"));
        assert!(
            e.contains("`host.executor_gid`") && e.contains("is not set"),
            "{e}"
        );
        // An executor must never be taken for a principal.
        let e =
            error(&MINIMAL.replace("[host]", "[host]\nexecutor_uid = 1000\nexecutor_gid = 5000"));
        assert!(
            e.contains("`principal[0].uids`")
                && e.contains("uid 1000 is also one executors run as"),
            "{e}"
        );
        let e = error(&MINIMAL.replace("[host]", "[host]\nexecutor_uid_range = \"900-1100\""));
        assert!(e.contains("`principal[0].uids`"), "{e}");
        let e = error(
            &MINIMAL
                .replace("uids = [1000]", "uids = [1000]\ngids = [70]")
                .replace("[host]", "[host]\nexecutor_uid = 5000\nexecutor_gid = 70"),
        );
        assert!(e.contains("`principal[0].gids`"), "{e}");
        // Records and refusal folding within sane bounds.
        let e = error(&MINIMAL.replace("[host]", "[host]\nrecords_rotate_bytes = 0"));
        assert!(e.contains("`host.records_rotate_bytes`"), "{e}");
        let e = error(&MINIMAL.replace(
            "[host]",
            "[host]\nrefusal_fold_interval_ms = 18446744073709551615",
        ));
        assert!(e.contains("`host.refusal_fold_interval_ms`"), "{e}");
        // setresuid(-1) changes nothing: the executor would keep the broker's uid.
        for (uid, gid, key, value) in [
            (4294967295u32, 5000u32, "uid", 4294967295u32),
            (5000, 4294967295, "gid", 4294967295),
            (0, 5000, "uid", 0),
        ] {
            let e = error(&MINIMAL.replace(
                "[host]",
                &format!("[host]\nexecutor_uid = {uid}\nexecutor_gid = {gid}"),
            ));
            assert!(
                e.contains(&format!("`host.executor_{key}`"))
                    && e.contains(&format!("is {value};")),
                "{uid}/{gid}: {e}"
            );
        }
        let e = error(&MINIMAL.replace("[host]", "[host]\nrefusal_records_per_interval = 0"));
        assert!(e.contains("`host.refusal_records_per_interval`"), "{e}");
        let e = error(&MINIMAL.replace("[host]", "[host]\nmax_message_bytes = 12"));
        assert!(
            e.contains("`host.max_message_bytes`") && e.contains("12 is out of range"),
            "{e}"
        );
        for bad in ["0-10", "10-5", "x-5", "5", "1-4294967295"] {
            let e = error(
                &MINIMAL.replace("[host]", &format!("[host]\nexecutor_uid_range = \"{bad}\"")),
            );
            assert!(e.contains("`host.executor_uid_range`"), "{bad}: {e}");
        }
        let e = error(&MINIMAL.replace(
            "[host]",
            "[host]\nexecutor_uid_range = \"100-200\"\nexecutor_uid = 5\nexecutor_gid = 5",
        ));
        assert!(e.contains("not both"), "{e}");
        for key in ["initialize_timeout_ms", "session_idle_timeout_ms"] {
            let e = error(&MINIMAL.replace("[host]", &format!("[host]\n{key} = 0")));
            assert!(e.contains(&format!("`host.{key}`")), "{e}");
        }
    }

    /// An empty resolver list is refused, naming the key: every lookup would be recorded
    /// as allowed and then fail. Before, it was taken.
    #[test]
    fn an_empty_dns_upstream_is_refused() {
        let e = error(&MINIMAL.replace("[host]", "[host]\ndns_upstream = []"));
        assert!(
            e.contains("host.dns_upstream") && e.contains("is empty"),
            "{e}"
        );
        let c = parse(&MINIMAL.replace("[host]", "[host]\ndns_upstream = [\"127.0.0.1:5335\"]"))
            .unwrap();
        assert_eq!(c.dns_upstream.unwrap().len(), 1);
    }

    #[test]
    fn executor_uids_come_from_a_range_unless_one_identity_is_set() {
        let c = HostConfig::parse(Path::new("/etc/flowhost/host.toml"), MINIMAL).unwrap();
        assert_eq!(c.executor_uids, flowhost_broker::UidRange::DEFAULT);
        assert_eq!(c.executor_identity, None);
        let c = HostConfig::parse(
            Path::new("/etc/flowhost/host.toml"),
            &MINIMAL.replace("[host]", "[host]\nexecutor_uid_range = \"100-199\""),
        )
        .unwrap();
        assert_eq!(
            c.executor_uids,
            flowhost_broker::UidRange {
                first: 100,
                count: 100
            }
        );
    }

    #[test]
    fn duplicate_servers_and_uids_are_refused() {
        let twice = MINIMAL.replace(
            "[[principal]]",
            "[[principal]]\nid = \"bob\"\nuids = [1000]\ntools = []\n\n[[principal]]",
        );
        assert!(error(&twice).contains("uid 1000 is already principal"));
        let same_id = MINIMAL.replace(
            "[[principal]]",
            "[[principal]]\nid = \"alice\"\nuids = [1001]\ntools = []\n\n[[principal]]",
        );
        let e = error(&same_id);
        assert!(
            e.contains("`principal[1].id`") && e.contains("configured twice"),
            "{e}"
        );
        let shared_gid = MINIMAL.replace(
            "[[principal]]",
            "[[principal]]\nid = \"ops\"\ngids = [100]\ntools = []\n\n[[principal]]\nid = \"guests\"\ngids = [100]\ntools = []\n\n[[principal]]",
        );
        assert!(
            error(&shared_gid).contains("gid 100 is already principal ops"),
            "{}",
            error(&shared_gid)
        );
        let server = &MINIMAL[MINIMAL.find("[[server]]").unwrap()..];
        let e = error(&format!("{MINIMAL}\n{server}"));
        assert!(
            e.contains("`server[1].id`") && e.contains("configured twice"),
            "{e}"
        );
        // A variable executors never receive is refused at load, naming the server, rather
        // than at each spawn.
        let e = error(&MINIMAL.replace(
            "profile = \"isolated\"\n",
            "profile = \"isolated\"\nenv = { PYTHONWARNINGS = \"ignore\" }\n",
        ));
        assert!(
            e.contains("`server[0].env`") && e.contains("PYTHONWARNINGS"),
            "{e}"
        );
        // A server id with '/' made `a/b/c` name both server `a`'s tool `b/c` and server
        // `a/b`'s tool `c`; one that breaks the identifier rule was not checked at all.
        for (id, says) in [
            ("srv/x", "contains '/'"),
            (" srv", "whitespace"),
            ("", "empty"),
        ] {
            let e = error(&MINIMAL.replace("id = \"srv\"", &format!("id = {id:?}")));
            assert!(
                e.contains("`server[0].id`") && e.contains(says),
                "{id:?}: {e}"
            );
        }
    }

    /// The configuration names every key, token and policy the host judges by: before, any
    /// file at the path was read, so one a deploy user or others could change decided what
    /// the host trusts. A symbolic link to a trusted file is followed.
    #[test]
    fn a_configuration_others_may_change_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("flowhost.toml");
        std::fs::write(&file, MINIMAL).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let linked = dir.path().join("linked.toml");
        std::os::unix::fs::symlink(&file, &linked).unwrap();
        for ok in [&file, &linked] {
            let e = HostConfig::load(ok).err().map(|e| e.to_string());
            assert!(
                !e.as_deref().is_some_and(|e| e.contains("cannot use")),
                "{e:?}"
            );
        }
        // A link in a directory others may write could be pointed anywhere.
        let open_dir = dir.path().join("shared");
        std::fs::create_dir(&open_dir).unwrap();
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let planted = open_dir.join("flowhost.toml");
        std::os::unix::fs::symlink(&file, &planted).unwrap();
        let e = HostConfig::load(&planted).unwrap_err().to_string();
        assert!(
            e.contains(&open_dir.display().to_string()) && e.contains("go-w"),
            "{e}"
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        for bad in [&file, &linked] {
            let e = HostConfig::load(bad).unwrap_err().to_string();
            assert!(
                e.contains(&bad.display().to_string()) && e.contains("go-w"),
                "{e}"
            );
        }
    }

    #[test]
    fn one_server_may_offer_bare_tool_names() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.tool_name("srv/t"), ("srv", "t"));
        assert_eq!(c.tool_name("t"), ("", "t"), "no server offers bare names");
        assert_eq!(c.public_tool_name("srv", "t"), "srv/t");
        let bare = MINIMAL.replace(
            "profile = \"isolated\"\n",
            "profile = \"isolated\"\nunqualified_names = true\n",
        );
        let c = parse(&bare).unwrap();
        assert_eq!(c.tool_name("t"), ("srv", "t"));
        assert_eq!(c.tool_name("srv/t"), ("srv", "t"));
        assert_eq!(c.public_tool_name("srv", "t"), "t");
        let server = &bare[bare.find("[[server]]").unwrap()..];
        let e = error(&format!(
            "{bare}\n{}",
            server.replace("id = \"srv\"", "id = \"srv2\"")
        ));
        assert!(
            e.contains("unqualified_names") && e.contains("only one server"),
            "{e}"
        );
    }

    #[test]
    fn the_state_backend_defaults_to_sqlite_and_postgres_is_validated() {
        let file = Path::new("/etc/flowhost/host.toml");
        assert_eq!(
            HostConfig::parse(file, MINIMAL).unwrap().state,
            StateConfig::Sqlite
        );
        let pg = MINIMAL.replace(
            "[host]",
            "[host]\nstate = { backend = \"postgres\", url_file = \"pg/url\", \
             password_file = \"/run/secrets/pg\", host_id = \"web-1\" }",
        );
        let StateConfig::Postgres(p) = HostConfig::parse(file, &pg).unwrap().state else {
            panic!("not postgres");
        };
        assert_eq!(p.url_file, Path::new("/etc/flowhost/pg/url"));
        assert_eq!(
            p.password_file.as_deref(),
            Some(Path::new("/run/secrets/pg"))
        );
        assert_eq!((p.host_id.as_str(), p.connections), ("web-1", 4));
        assert_eq!(p.timeout, Duration::from_secs(5));
        let e = error(&pg.replace("web-1", "web 1"));
        assert!(e.contains("`host.state.host_id`"), "{e}");
        // A password is never configuration text: only a file may hold it.
        let e = error(&pg.replace("host_id =", "password = \"x\", host_id ="));
        assert!(e.contains("password"), "{e}");
        let e = error(&pg.replace(", host_id = \"web-1\"", ""));
        assert!(e.contains("host_id"), "{e}");
        // SQLite takes no settings: PostgreSQL's beside it are a mistake, not ignored.
        // Before, serde skipped every other key of a unit variant.
        let sqlite = |extra: &str| {
            MINIMAL.replace(
                "[host]",
                &format!("[host]\nstate = {{ backend = \"sqlite\"{extra} }}"),
            )
        };
        assert_eq!(
            HostConfig::parse(file, &sqlite("")).unwrap().state,
            StateConfig::Sqlite
        );
        let e = error(&sqlite(", url_file = \"pg.url\", host_id = \"web-1\""));
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn topology_follows_the_profile() {
        let isolated = flowhost_broker::Profile::find("isolated", &[]).unwrap();
        let brokered = flowhost_broker::Profile::find("brokered", &[]).unwrap();
        assert_eq!(topology_of(&isolated), RuntimeTopology::Local);
        assert_eq!(topology_of(&brokered), RuntimeTopology::Brokered);
    }
}
