//! The flow state on a PostgreSQL database shared by a fleet of hosts.
//!
//! This file is long on purpose: one backend, whose connection handling (TLS, passwords from
//! files, timeouts), versioned schema and every operation of the store interface under the
//! database's own concurrency control belong together.
//!
//! Guarantees, beside those of every [`StateBackend`]: a principal's label is read from the
//! database on every decision (another host may have raised it a moment ago), never from a
//! copy kept here; a raise is a transaction that locks the principal's row (`SELECT ... FOR
//! UPDATE`) and joins under that lock, so concurrent raises from any number of hosts all
//! survive (every connection reads committed data, whatever isolation level the server
//! defaults to, and an operation the server aborts for a concurrent write runs again, a
//! bounded number of times); it is committed (with `synchronous_commit` at least `on`: a lower level, `off`,
//! `local` or `remote_write`, is raised to `on` for the store's sessions) before the future
//! resolves. A session's label is per host and lives in memory: a session never outlives its
//! host process, and every raise of a session also raises its principal in the database.
//! Grants' single use lives in the same database, so a grant used on one host is a replay on
//! every other. Each host keeps its own records checkpoint, keyed by its `host_id`.
//!
//! Only the primary is used: every connection (each reconnect of a pool slot included)
//! demands a server that takes writes, and refuses a standby in recovery or a database whose
//! transactions default to read-only ([`PgError::ReadOnly`]), since either may lag the
//! primary. A label lower than this host has seen is refused ([`PgError::Lower`]); what it has
//! seen starts with every label the database held when the store opened, and grows with
//! every label read or written since (a missing row counts as bottom). The label seen is then
//! written back (labels only rise), so hosts that never saw the lost raise read it again; and
//! since spent grants may have been lost with it, this host takes no grant until it restarts
//! ([`PgError::GrantsUnvouched`]). Hosts that read the database before the write-back served
//! the lowered label: a fleet needs a database that loses no acknowledged commit (synchronous
//! replication to any standby it may fail over to).
//!
//! A database that cannot be reached, or an operation that takes longer than the configured
//! timeout, fails the operation (the caller refuses the call); the next operation reconnects,
//! so service resumes when the database is back. Errors name the database (user, host, port,
//! database name) and never the password.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_postgres::config::{Host, SslMode, TargetSessionAttrs};
use tokio_postgres::{Client, Config, NoTls};

use super::{FlowState, SessionKey, StateBackend, StateError, StateFuture, StateSnapshot};
use crate::config::PostgresStateConfig;
use crate::ident::PrincipalId;
use crate::label::InformationLabel;

/// The schema version this build creates and accepts.
pub const SCHEMA_VERSION: i32 = 1;

/// How many times an operation runs when a concurrent write conflicts with it (see
/// [`PgError::Conflict`]): with every connection reading committed data such conflicts are
/// not expected, so this is a bound, not a policy.
const CONFLICT_ATTEMPTS: usize = 3;

/// Serializes concurrent `flowhost state migrate` runs (a transaction-scoped advisory lock).
const MIGRATE_LOCK: i64 = 0x666c_6f77_686f_7374;

/// Version 1: principals' labels, consumed grants, one records checkpoint per host.
const SCHEMA_V1: &str = "
CREATE TABLE flowhost_schema (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version   integer NOT NULL
);
CREATE TABLE principal_labels (
    principal text PRIMARY KEY,
    label     text NOT NULL
);
CREATE TABLE consumed_grants (
    grant_id    text PRIMARY KEY,
    consumed_at bigint NOT NULL,
    host_id     text NOT NULL
);
CREATE TABLE records_checkpoint (
    host_id text PRIMARY KEY,
    seq     bigint NOT NULL,
    hash    text NOT NULL
);
INSERT INTO flowhost_schema (version) VALUES (1);
";

/// Why the PostgreSQL store failed. `target` names the database without its password.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// A file named in the configuration could not be read (missing, a symbolic link, not
    /// a regular file, too large, not text).
    #[error("cannot read the flow-state database's {what}: {reason}")]
    Read {
        /// The file.
        file: PathBuf,
        /// Which setting (`url_file`, `password_file`, `ca_file`).
        what: &'static str,
        /// Why, naming the file.
        reason: String,
    },
    /// A file named in the configuration could be changed by someone other than root or
    /// this process's user: they would decide which database, and which server, flowhost
    /// trusts with the labels.
    #[error(
        "{file}: the flow-state database's {what} {why}; whoever may change it decides which \
         database flowhost trusts with the labels"
    )]
    Exposed {
        /// The file.
        file: PathBuf,
        /// Which setting (`url_file`, `password_file`, `ca_file`).
        what: &'static str,
        /// Who else may change it, and how.
        why: crate::files::OthersMayChange,
    },
    /// The URL file does not hold a valid connection string, or the TLS settings cannot work.
    #[error("{file}: {reason}")]
    Settings {
        /// The file at fault.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The database was reached but is set up so that flowhost cannot use it (a schema it
    /// lacks, a role that searches another first, a durability level it does not know):
    /// only the operator changes that, never a retry.
    #[error("flow-state database {target}: cannot use it: {reason}")]
    Unsuitable {
        /// The database.
        target: String,
        /// What is wrong with it, and what to change.
        reason: String,
    },
    /// The database could not be reached or refused the connection.
    #[error("flow-state database {target}: cannot connect: {reason}")]
    Connect {
        /// The database.
        target: String,
        /// Why.
        reason: String,
    },
    /// The server cancelled a statement (SQLSTATE 57014: its `statement_timeout`, or an
    /// operator's `pg_cancel_backend`) on a connection that stays: a slow moment, which may
    /// pass as a timeout of this host's own does.
    #[error("flow-state database {target}: the server cancelled the statement: {reason}")]
    Cancelled {
        /// The database.
        target: String,
        /// What the server said.
        reason: String,
    },
    /// A read or write failed.
    #[error("flow-state database {target}: {reason}")]
    Query {
        /// The database.
        target: String,
        /// Why.
        reason: String,
    },
    /// Another transaction's write conflicted with this one (a serialization failure or a
    /// deadlock) on every attempt; nothing of it was committed.
    #[error(
        "flow-state database {target}: a concurrent write conflicted with this one on each of \
         {attempts} attempts: {reason}"
    )]
    Conflict {
        /// The database.
        target: String,
        /// How many times the operation ran.
        attempts: usize,
        /// The server's last error.
        reason: String,
    },
    /// The operation took longer than the configured timeout.
    #[error("flow-state database {target}: no answer within {after:?}")]
    Timeout {
        /// The database.
        target: String,
        /// The timeout.
        after: Duration,
    },
    /// The server does not take writes: a standby in recovery, or a database or role whose
    /// transactions default to read-only. Whatever it holds may lag the primary, so labels
    /// read from it could be lower than they are.
    #[error(
        "flow-state database {target}: {found}; flowhost needs the primary, which takes \
         writes (list every server of the cluster in url_file, or point it at the primary)"
    )]
    ReadOnly {
        /// The database.
        target: String,
        /// What the server reported.
        found: String,
    },
    /// The schema is missing or of a version this build does not know.
    #[error(
        "flow-state database {target}: {found}; this flowhost knows schema version \
         {known} (run `flowhost state migrate --config FILE`)",
        known = SCHEMA_VERSION
    )]
    Schema {
        /// The database.
        target: String,
        /// What was found.
        found: String,
    },
    /// A principal's label is lower than this host has already seen it: the database was
    /// rolled back (a failover to a replica that lagged, a restore), and judging by it would
    /// let out what the higher label refuses.
    #[error(
        "flow-state database {target}: principal {principal}'s label is lower than this host \
         has seen it (a failover to a lagging replica, or a restore); refusing until the \
         database holds it again (restore the newest backup of the database, or point \
         url_file at the server that has the latest writes; `flowhost state rebuild` writes \
         a host's SQLite state.db, never a shared database)"
    )]
    Lower {
        /// The database.
        target: String,
        /// The principal.
        principal: String,
    },
    /// The database was found to have lost a label this host had seen, so it may have lost
    /// spent grants too: a grant is refused rather than spent a second time.
    #[error(
        "flow-state database {target}: {lost}; it may have lost spent grants with it, so no \
         grant is taken on this host until it restarts against a database that holds every \
         write (see the log for the principal)"
    )]
    GrantsUnvouched {
        /// The database.
        target: String,
        /// What was found lost.
        lost: String,
    },
    /// A stored label is not a valid label, or the stored checkpoint no valid checkpoint.
    #[error("flow-state database {target}: stored value for {key} is invalid: {reason}")]
    Corrupt {
        /// The database.
        target: String,
        /// Which principal.
        key: String,
        /// The decoding error.
        reason: String,
    },
}

/// An error with its causes (a `tokio_postgres` error's `Display` alone often says only "db
/// error", a file error's only what was being done).
fn reason(e: &dyn std::error::Error) -> String {
    crate::causes::WithCauses(e).to_string()
}

/// Whether `e` says the connection is gone rather than the statement wrong: the server
/// ended it (a restart or failover, SQLSTATE class 57 operator intervention, but for
/// 57014, a statement cancelled or past its `statement_timeout`, on a connection that
/// stays) or it broke (class 08, or no connection left at all). Such an error may pass
/// with the database.
fn connection_lost(e: &tokio_postgres::Error) -> bool {
    e.is_closed()
        || e.code().is_some_and(|code| {
            let code = code.code();
            code.starts_with("08") || (code.starts_with("57") && code != "57014")
        })
}

/// A statement's failure on `target`: [`PgError::Connect`] when the connection is gone and
/// [`PgError::Cancelled`] when the server cancelled it (both may pass), [`PgError::Query`]
/// otherwise.
fn query_failed(target: &str, e: &tokio_postgres::Error) -> PgError {
    if connection_lost(e) {
        return PgError::Connect {
            target: target.to_string(),
            reason: format!("the connection was lost: {}", reason(e)),
        };
    }
    if e.code().is_some_and(|c| c.code() == "57014") {
        return PgError::Cancelled {
            target: target.to_string(),
            reason: reason(e),
        };
    }
    PgError::Query {
        target: target.to_string(),
        reason: reason(e),
    }
}

/// A lock whose holder panicked: what it guards may be half updated, so the store refuses.
fn poisoned<G>(_: std::sync::PoisonError<G>) -> StateError {
    StateError::Failed("a writer panicked while holding the store".into())
}

/// How the store reaches the server.
#[derive(Clone)]
enum Tls {
    /// Plaintext, to a server on this machine that `server_uid` serves (checked at each
    /// connect: any local user could listen on a free port or socket name first).
    Off {
        server_uid: u32,
    },
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

/// Where the database is and how to log in, read from the configured files.
struct Target {
    config: Config,
    tls: Tls,
    name: String,
    /// The only schema searched, if one is set.
    schema: Option<String>,
}

/// The settings files are small; anything larger is not one.
const MAX_SETTINGS_FILE_BYTES: u64 = 1024 * 1024;

/// Reads settings file `file` (for setting `what`): a regular file that only root or this
/// process's user may change (checked on the file opened, so the file judged is the file
/// read), reached through symbolic links (a secret mounted by Kubernetes is one) only
/// through directories no one else may change ([`crate::files::trusted_target`]); when it
/// holds a `secret`, one that neither others nor this process's own group may read (see
/// [`crate::files::read_trusted`]): whoever reads the password can log in as flowhost and
/// lower the labels every host trusts.
fn read_file(file: &Path, what: &'static str, secret: bool) -> Result<String, PgError> {
    use crate::files::{self, FileError, TrustedFileError};
    let failed = |e: FileError| PgError::Read {
        file: file.to_path_buf(),
        what,
        reason: reason(&e),
    };
    let bytes = files::trusted_target(file)
        .and_then(|target| files::read_trusted(&target, MAX_SETTINGS_FILE_BYTES, secret))
        .map_err(|e| match e {
            TrustedFileError::Exposed { path, why } => PgError::Exposed {
                file: path,
                what,
                why,
            },
            TrustedFileError::File(e) => failed(e),
            other => PgError::Read {
                file: file.to_path_buf(),
                what,
                reason: other.to_string(),
            },
        })?;
    String::from_utf8(bytes).map_err(|e| {
        failed(FileError::NotUtf8 {
            path: file.to_path_buf(),
            offset: e.utf8_error().valid_up_to(),
        })
    })
}

/// The first server `config` reaches over a network rather than on this machine, if any: a
/// numeric `hostaddr` decides where a host is reached, else the host itself (a Unix socket,
/// `localhost`, or a loopback address is on this machine; any other name is not, since
/// what it resolves to is not ours to vouch for).
fn remote_host(config: &Config) -> Option<String> {
    let addrs = config.get_hostaddrs();
    let hosts = config.get_hosts();
    let on_this_machine = |i: usize| match (addrs.get(i), hosts.get(i)) {
        (Some(addr), _) => addr.is_loopback(),
        (None, Some(Host::Unix(_))) => true,
        (None, Some(Host::Tcp(name))) => {
            name.eq_ignore_ascii_case("localhost")
                || name
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        }
        (None, None) => true,
    };
    (0..addrs.len().max(hosts.len()))
        .find(|&i| !on_this_machine(i))
        .map(|i| match (addrs.get(i), hosts.get(i)) {
            (Some(addr), _) => format!("server address {addr}"),
            (None, Some(Host::Tcp(name))) => format!("server {name:?}"),
            _ => "a server".to_string(),
        })
}

/// Names a database for operators: user, hosts, ports and database name, never a password.
fn describe(config: &Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let host = match h {
                Host::Tcp(name) => name.clone(),
                Host::Unix(path) => path.display().to_string(),
            };
            match config.get_ports().get(i).or(config.get_ports().first()) {
                Some(port) => format!("{host}:{port}"),
                None => host,
            }
        })
        .collect();
    format!(
        "postgresql://{}@{}/{}",
        config.get_user().unwrap_or(""),
        hosts.join(","),
        config.get_dbname().unwrap_or("")
    )
}

/// The uid whose server on this machine is the database: `server_user` (a name or a uid),
/// else the user `postgres`.
fn server_uid(settings: &PostgresStateConfig) -> Result<u32, PgError> {
    let named = settings.server_user.as_deref();
    let user = named.unwrap_or("postgres");
    if let Ok(uid) = user.parse::<u32>() {
        return Ok(uid);
    }
    match nix::unistd::User::from_name(user) {
        Ok(Some(u)) => Ok(u.uid.as_raw()),
        found => Err(PgError::Settings {
            file: settings.url_file.clone(),
            reason: format!(
                "the server is reached in plaintext on this machine, so flowhost checks which \
                 user serves it, but {}: set [host] state's server_user to the user the \
                 server runs as (or ca_file, to reach it over TLS)",
                match (found, named) {
                    (Err(e), _) => format!("user {user:?} cannot be looked up ({e})"),
                    (_, Some(_)) => format!("there is no user {user:?}"),
                    (_, None) => "there is no user \"postgres\" (the default)".to_string(),
                }
            ),
        }),
    }
}

/// Where the server at index `i` of `config` listens: a Unix socket's path, or TCP
/// addresses (a name is looked up; [`remote_host`] has kept only names on this machine).
async fn local_endpoints(config: &Config, i: usize) -> Result<Vec<LocalEndpoint>, String> {
    let ports = config.get_ports();
    let port = ports
        .get(i)
        .or((ports.len() == 1).then(|| &ports[0]))
        .copied()
        .unwrap_or(5432);
    if let Some(addr) = config.get_hostaddrs().get(i) {
        return Ok(vec![LocalEndpoint::Tcp(SocketAddr::new(*addr, port))]);
    }
    match config.get_hosts().get(i) {
        Some(Host::Unix(dir)) => Ok(vec![LocalEndpoint::Unix(
            dir.join(format!(".s.PGSQL.{port}")),
        )]),
        Some(Host::Tcp(name)) => {
            let name = name.trim_start_matches('[').trim_end_matches(']');
            let found = tokio::net::lookup_host((name, port))
                .await
                .map_err(|e| format!("cannot look {name:?} up: {e}"))?;
            // Only what the name is on this machine: a name that resolved elsewhere is not
            // one plaintext may reach.
            Ok(found
                .filter(|a| a.ip().is_loopback())
                .map(LocalEndpoint::Tcp)
                .collect())
        }
        None => Ok(vec![LocalEndpoint::Tcp(SocketAddr::new(
            std::net::Ipv4Addr::LOCALHOST.into(),
            port,
        ))]),
    }
}

/// One place a server on this machine may listen.
#[derive(Debug)]
enum LocalEndpoint {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl std::fmt::Display for LocalEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LocalEndpoint::Unix(path) => write!(f, "{}", path.display()),
            LocalEndpoint::Tcp(addr) => write!(f, "{addr}"),
        }
    }
}

/// The uid that owns the server's end of loopback connection `stream`: the socket the
/// server accepted (its owner is the listener's), from the kernel's table of TCP sockets.
fn tcp_server_uid(stream: &tokio::net::TcpStream) -> Result<u32, String> {
    let ours = stream.local_addr().map_err(|e| e.to_string())?;
    let theirs = stream.peer_addr().map_err(|e| e.to_string())?;
    crate::host::socket_owner::tcp(theirs, ours)?
        .ok_or_else(|| format!("no socket of this machine serves {theirs}"))
}

impl Target {
    /// Speaks PostgreSQL over `stream`, reached at `endpoint`, when `served_by` (who serves
    /// its other end) is the server's user; nothing is sent otherwise.
    async fn speak_to<S>(
        &self,
        stream: S,
        served_by: Result<u32, String>,
        endpoint: &LocalEndpoint,
        server_uid: u32,
    ) -> Result<Client, PgError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let refuse = |reason: String| PgError::Connect {
            target: self.name.clone(),
            reason,
        };
        match served_by {
            Ok(uid) if uid == server_uid => self
                .config
                .connect_raw(stream, NoTls)
                .await
                .map(|(client, connection)| {
                    tokio::spawn(connection);
                    client
                })
                .map_err(|e| self.connect_error(&e)),
            Ok(uid) => Err(refuse(format!(
                "{endpoint} is served by uid {uid}, not the server's user (uid {server_uid}): \
                 refused"
            ))),
            Err(why) => Err(refuse(format!(
                "{endpoint}: cannot tell who serves it: {why}"
            ))),
        }
    }

    /// A connection the server refused: [`PgError::Unsuitable`] when only the operator can
    /// change what it refused for (the role's password, 28P01; a database that does not
    /// exist, 3D000; a role without the privilege to connect, 42501), so that the host exits
    /// rather than being restarted again and again; [`PgError::Connect`] otherwise (a server
    /// unreachable or starting, which may pass, and any other refusal of authentication,
    /// 28000, which an LDAP or RADIUS server out of reach also gives).
    fn connect_error(&self, e: &tokio_postgres::Error) -> PgError {
        let permanent = e
            .code()
            .is_some_and(|code| matches!(code.code(), "28P01" | "3D000" | "42501"));
        if permanent {
            PgError::Unsuitable {
                target: self.name.clone(),
                reason: reason(e),
            }
        } else {
            PgError::Connect {
                target: self.name.clone(),
                reason: reason(e),
            }
        }
    }

    /// Connects in plaintext to the first server listed that answers and is served by
    /// `server_uid`; a socket another user serves is refused, naming who serves it.
    async fn connect_local(&self, server_uid: u32) -> Result<Client, PgError> {
        let refuse = |reason: String| PgError::Connect {
            target: self.name.clone(),
            reason,
        };
        let count = self
            .config
            .get_hosts()
            .len()
            .max(self.config.get_hostaddrs().len())
            .max(1);
        let mut last = None;
        for i in 0..count {
            let endpoints = match local_endpoints(&self.config, i).await {
                Ok(e) => e,
                Err(why) => {
                    last = Some(refuse(why));
                    continue;
                }
            };
            for endpoint in endpoints {
                let connected = match &endpoint {
                    LocalEndpoint::Unix(path) => {
                        match tokio::net::UnixStream::connect(path).await {
                            Ok(stream) => {
                                let served_by = stream
                                    .peer_cred()
                                    .map(|peer| peer.uid())
                                    .map_err(|e| e.to_string());
                                self.speak_to(stream, served_by, &endpoint, server_uid)
                                    .await
                            }
                            Err(e) => Err(refuse(format!("{endpoint}: {e}"))),
                        }
                    }
                    LocalEndpoint::Tcp(addr) => match tokio::net::TcpStream::connect(addr).await {
                        Ok(stream) => {
                            let served_by = tcp_server_uid(&stream);
                            self.speak_to(stream, served_by, &endpoint, server_uid)
                                .await
                        }
                        Err(e) => Err(refuse(format!("{endpoint}: {e}"))),
                    },
                };
                let client = match connected {
                    Ok(client) => client,
                    Err(refused) => {
                        // A refusal that may pass, from any server listed, decides: the
                        // primary may be the one restarting while another refuses the role.
                        let may_pass = |e: &PgError| {
                            matches!(e, PgError::Connect { .. } | PgError::ReadOnly { .. })
                        };
                        if last.as_ref().is_none_or(|l| !may_pass(l)) || may_pass(&refused) {
                            last = Some(refused);
                        }
                        continue;
                    }
                };
                // As the driver does for a list of servers it connects to itself: the first
                // that takes writes (`connect` checks it again, for every transport).
                if self.config.get_target_session_attrs() != TargetSessionAttrs::ReadWrite {
                    return Ok(client);
                }
                match client
                    .query_one(
                        "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') <> 'off'",
                        &[],
                    )
                    .await
                    .and_then(|row| row.try_get::<_, bool>(0))
                {
                    Ok(false) => return Ok(client),
                    Ok(true) => last = Some(self.read_only(format!("{endpoint} refuses writes"))),
                    Err(e) => last = Some(refuse(reason(&e))),
                }
            }
        }
        Err(last.unwrap_or_else(|| refuse("no server on this machine is listed".into())))
    }

    fn load(settings: &PostgresStateConfig) -> Result<Self, PgError> {
        let parse = |text: &str| -> Result<Config, PgError> {
            text.trim().parse().map_err(|e| PgError::Settings {
                file: settings.url_file.clone(),
                reason: format!("not a PostgreSQL connection string: {e}"),
            })
        };
        let mut config = parse(&read_file(&settings.url_file, "url_file", false)?)?;
        if config.get_password().is_some() {
            // A connection string with a password in it is a secret too: read again as one,
            // and the text read then is the one used.
            config = parse(&read_file(&settings.url_file, "url_file", true)?)?;
        }
        if let Some(file) = &settings.password_file {
            let password = read_file(file, "password_file", true)?;
            config.password(password.trim_end_matches(['\n', '\r']));
        }
        config.connect_timeout(settings.timeout);
        config.application_name("flowhost");
        // Only a server that takes writes is the primary; any other (a standby after a
        // failover, a restored copy left read-only) may lag it, and its labels could be
        // lower than they are. With several servers listed, the first writable one is used.
        config.target_session_attrs(TargetSessionAttrs::ReadWrite);
        let tls = match &settings.ca_file {
            Some(ca) => {
                config.ssl_mode(SslMode::Require);
                Tls::Rustls(rustls_connector(ca)?)
            }
            None if config.get_ssl_mode() == SslMode::Require => {
                return Err(PgError::Settings {
                    file: settings.url_file.clone(),
                    reason: "sslmode=require, but [host] state has no ca_file to authenticate \
                             the server with"
                        .into(),
                });
            }
            None => {
                // Without roots to check the server against, the labels would cross the
                // network in plaintext and a host in the path could rewrite them (lower a
                // principal's label): only a server on this machine is reached that way.
                if let Some(remote) = remote_host(&config) {
                    return Err(PgError::Settings {
                        file: settings.url_file.clone(),
                        reason: format!(
                            "{remote} is not on this machine, and [host] state has no ca_file: \
                             flow state is only sent in plaintext over loopback or a Unix \
                             socket; set ca_file to reach it over TLS"
                        ),
                    });
                }
                config.ssl_mode(SslMode::Disable);
                Tls::Off {
                    server_uid: server_uid(settings)?,
                }
            }
        };
        Ok(Target {
            name: describe(&config),
            config,
            tls,
            schema: settings.schema.clone(),
        })
    }

    /// Connects to the primary, refusing a server that does not take writes (see
    /// [`PgError::ReadOnly`]), and pins the session's `synchronous_commit`.
    async fn connect(&self) -> Result<Client, PgError> {
        let failed = |e: tokio_postgres::Error| {
            if refused_as_read_only(&e) {
                return self.read_only("every server listed refuses writes".into());
            }
            self.connect_error(&e)
        };
        let client = match &self.tls {
            Tls::Off { server_uid } => self.connect_local(*server_uid).await?,
            Tls::Rustls(tls) => {
                let (client, connection) =
                    self.config.connect(tls.clone()).await.map_err(failed)?;
                tokio::spawn(connection);
                client
            }
        };
        // Checked here as well as by the driver: a server in recovery is refused whatever
        // its read-only default says, and a server demoted after the driver's check (a
        // failover under way) is caught before anything is read from it.
        let row = client
            .query_one(
                "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')",
                &[],
            )
            .await
            .map_err(failed)?;
        let in_recovery: bool = row.try_get(0).map_err(failed)?;
        let read_only: &str = row.try_get(1).map_err(failed)?;
        if in_recovery {
            return Err(self.read_only("it is a standby in recovery".into()));
        }
        if read_only != "off" {
            return Err(self.read_only(format!(
                "its transactions are read-only by default (transaction_read_only = {read_only})"
            )));
        }
        // A commit must be durable before a call's output leaves the host, on the primary
        // and on every synchronous standby the server names (one of which a failover may
        // promote): levels below `on` (`off`, and `local` and `remote_write`, which do not
        // wait for the standbys to flush) become `on`, and `on` or `remote_apply` is kept.
        // The level is pinned for the session, since a session setting outlasts a later
        // reload of the server's configuration (which would otherwise reach this connection
        // too, `off` included).
        let row = client
            .query_one("SHOW synchronous_commit", &[])
            .await
            .map_err(failed)?;
        let level = match row.try_get::<_, &str>(0).map_err(failed)? {
            "off" | "local" | "remote_write" => "on",
            level @ ("on" | "remote_apply") => level,
            other => {
                return Err(PgError::Unsuitable {
                    target: self.name.clone(),
                    reason: format!(
                        "its synchronous_commit is {other:?}, which flowhost does not know \
                         to be durable"
                    ),
                });
            }
        };
        // Every transaction reads committed data, whatever the server or role defaults to: a
        // raise joins under the row's lock and must see the row as the last raise committed
        // it, where `repeatable read` or `serializable` would abort it instead (a concurrent
        // raise refused as a state failure).
        client
            .batch_execute(&format!(
                "SET synchronous_commit TO {level}; \
                 SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
            ))
            .await
            .map_err(failed)?;
        // With a schema set, it is the only one searched (after pg_catalog, always first),
        // whatever the role's own `search_path` holds: every host of a fleet finds the same
        // tables however its role is set up. A schema that is not there is named, rather
        // than the tables it should hold.
        // Without one, the tables are public's: a role that searches a schema of its own
        // first would find (or create) tables of its own, and the hosts of a fleet would
        // each keep labels no other host reads.
        if self.schema.is_none() {
            let first: Option<String> = client
                .query_one("SELECT current_schema()", &[])
                .await
                .and_then(|row| row.try_get(0))
                .map_err(failed)?;
            if first.as_deref() != Some("public") {
                // Where the tables are now, to say which setting keeps them.
                let held_in = schema_holding_the_tables(&client).await;
                return Err(PgError::Unsuitable {
                    target: self.name.clone(),
                    reason: format!(
                        "its role searches {} first (its search_path), not public, and \
                         host.state.schema is not set: set it on every host of the fleet, so \
                         that all use one set of tables{}",
                        match &first {
                            Some(s) => format!("schema {s:?}"),
                            None => "no schema that exists".into(),
                        },
                        match held_in {
                            Some(s) => format!(" (the tables are in schema {s:?}: schema = {s:?})"),
                            None => String::new(),
                        }
                    ),
                });
            }
            // And only public: a role searching public first and another schema after
            // (where a fleet set up before `schema` keeps its tables) would use those
            // tables until public gets its own (a `state migrate` from elsewhere), then
            // switch to them mid-connection.
            client
                .query_one("SELECT set_config('search_path', 'public', false)", &[])
                .await
                .map_err(failed)?;
            // Tables kept in another schema (and none in public) are named: a `state
            // migrate` would make empty ones in public, where every label reads as never
            // raised.
            if let Some(other) = schema_holding_the_tables(&client).await
                && other != "public"
            {
                return Err(PgError::Unsuitable {
                    target: self.name.clone(),
                    reason: format!(
                        "public holds no flowhost tables, and schema {other:?} does: set \
                         host.state.schema = {other:?} on every host of the fleet that uses \
                         them, rather than migrate (or schema = \"public\" for a fleet of \
                         its own in public)"
                    ),
                });
            }
        }
        if let Some(schema) = &self.schema {
            let exists: bool = client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
                    &[schema],
                )
                .await
                .and_then(|row| row.try_get(0))
                .map_err(failed)?;
            if !exists {
                return Err(PgError::Unsuitable {
                    target: self.name.clone(),
                    reason: format!(
                        "it has no schema {schema:?} (host.state.schema): create it \
                         (CREATE SCHEMA {schema}) or name one it has"
                    ),
                });
            }
            let quoted = format!("\"{}\"", schema.replace('"', "\"\""));
            client
                .query_one("SELECT set_config('search_path', $1, false)", &[&quoted])
                .await
                .map_err(failed)?;
        }
        Ok(client)
    }
}

/// The schema the role may use that holds flowhost's tables (the one searched first, then
/// public, then by name), to name the setting that finds them; `None` when none does or it
/// cannot be read.
async fn schema_holding_the_tables(client: &Client) -> Option<String> {
    client
        .query_one(
            "SELECT n.nspname::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.relname = 'flowhost_schema' AND c.relkind = 'r' \
             AND has_schema_privilege(n.oid, 'USAGE') \
             ORDER BY n.nspname = current_schema() DESC, \
             n.nspname = 'public' DESC, n.nspname LIMIT 1",
            &[],
        )
        .await
        .ok()
        .and_then(|row| row.try_get(0).ok())
}

impl Target {
    fn read_only(&self, found: String) -> PgError {
        PgError::ReadOnly {
            target: self.name.clone(),
            found,
        }
    }
}

/// Whether the driver refused every server because none takes writes (its
/// `target_session_attrs=read-write` check): a permission error it makes itself, told apart
/// from a socket's own by its text.
fn refused_as_read_only(e: &tokio_postgres::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|c| c.downcast_ref::<std::io::Error>())
        .is_some_and(|io| {
            io.kind() == std::io::ErrorKind::PermissionDenied
                && io.to_string() == "database does not allow writes"
        })
}

/// A rustls connector trusting only the roots in `ca` (PEM).
fn rustls_connector(ca: &Path) -> Result<tokio_postgres_rustls::MakeRustlsConnect, PgError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let bad = |reason: String| PgError::Settings {
        file: ca.to_path_buf(),
        reason,
    };
    let pem = read_file(ca, "ca_file", false)?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| bad(format!("not a PEM certificate list: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| bad(format!("not a usable CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(format!("no usable TLS versions: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// What `flowhost state migrate` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// The database, without its password.
    pub target: String,
    /// The version found (`None`: no schema yet).
    pub from: Option<i32>,
    /// The version now in place.
    pub to: i32,
}

/// Creates the schema, or checks it is current. A version newer than this build is refused
/// untouched. Safe to run from several hosts at once.
pub async fn migrate(settings: &PostgresStateConfig) -> Result<MigrateReport, StateError> {
    let target = Target::load(settings)?;
    let query = |e: tokio_postgres::Error| query_failed(&target.name, &e);
    let work = async {
        let mut client = target.connect().await?;
        let tx = client.transaction().await.map_err(query)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATE_LOCK])
            .await
            .map_err(query)?;
        let from = schema_version(&tx).await.map_err(query)?;
        match from {
            None => {
                tx.batch_execute(SCHEMA_V1).await.map_err(query)?;
            }
            Some(SCHEMA_VERSION) => {}
            Some(other) => {
                return Err(PgError::Schema {
                    target: target.name.clone(),
                    found: format!("schema version {other} is newer than this build"),
                });
            }
        }
        tx.commit().await.map_err(query)?;
        Ok(MigrateReport {
            target: target.name.clone(),
            from,
            to: SCHEMA_VERSION,
        })
    };
    Ok(tokio::time::timeout(settings.timeout, work)
        .await
        .map_err(|_| PgError::Timeout {
            target: target.name.clone(),
            after: settings.timeout,
        })??)
}

async fn schema_version(
    client: &impl tokio_postgres::GenericClient,
) -> Result<Option<i32>, tokio_postgres::Error> {
    let exists: bool = client
        .query_one("SELECT to_regclass('flowhost_schema') IS NOT NULL", &[])
        .await?
        .try_get(0)?;
    if !exists {
        return Ok(None);
    }
    client
        .query_opt("SELECT version FROM flowhost_schema", &[])
        .await?
        .map(|r| r.try_get(0))
        .transpose()
}

/// The PostgreSQL store of one host.
pub struct PostgresStore {
    target: Target,
    host_id: String,
    timeout: Duration,
    slots: Vec<tokio::sync::Mutex<Option<Client>>>,
    next: AtomicUsize,
    sessions: Mutex<HashMap<SessionKey, InformationLabel>>,
    failure: Mutex<Option<String>>,
    /// The highest label this host has read or written for each principal, starting with
    /// every label the database held at open: labels only rise, so the database returning
    /// one below it was rolled back (see [`PgError::Lower`]).
    seen: Mutex<HashMap<PrincipalId, InformationLabel>>,
    /// The principals whose label was last read lower than seen, with why: each one's calls
    /// are refused until a read finds its label back, so the store reports the failure
    /// (whatever other queries succeed) until then.
    lowered: Mutex<std::collections::BTreeMap<PrincipalId, String>>,
    /// Why this host no longer vouches for grants' single use: the database was found to
    /// have lost a label this host had seen (see [`PgError::GrantsUnvouched`]).
    lost_writes: Mutex<Option<String>>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("target", &self.target.name)
            .field("host_id", &self.host_id)
            .finish()
    }
}

impl PostgresStore {
    /// Connects and checks the schema: a database that cannot be reached, or holds no schema
    /// or one of another version, is refused (the host does not start).
    pub async fn open(settings: &PostgresStateConfig) -> Result<Self, StateError> {
        let target = Target::load(settings)?;
        let name = target.name.clone();
        let first = tokio::time::timeout(settings.timeout, async {
            let client = target.connect().await?;
            let version = schema_version(&client)
                .await
                .map_err(|e| query_failed(&name, &e))?;
            match version {
                Some(SCHEMA_VERSION) => Ok(client),
                None => Err(PgError::Schema {
                    target: name.clone(),
                    found: "holds no flowhost schema".into(),
                }),
                Some(v) => Err(PgError::Schema {
                    target: name.clone(),
                    found: format!("holds schema version {v}, unknown to this build"),
                }),
            }
        })
        .await
        .map_err(|_| PgError::Timeout {
            target: name.clone(),
            after: settings.timeout,
        })??;
        let mut slots: Vec<_> = (0..settings.connections.max(1))
            .map(|_| tokio::sync::Mutex::new(None))
            .collect();
        slots[0] = tokio::sync::Mutex::new(Some(first));
        let store = PostgresStore {
            target,
            host_id: settings.host_id.clone(),
            timeout: settings.timeout,
            slots,
            next: AtomicUsize::new(0),
            sessions: Mutex::new(HashMap::new()),
            failure: Mutex::new(None),
            seen: Mutex::new(HashMap::new()),
            lowered: Mutex::new(std::collections::BTreeMap::new()),
            lost_writes: Mutex::new(None),
        };
        // Every label the database holds now is one this host has seen: a failover or
        // restore that lowers one later is then refused (PgError::Lower), even for a
        // principal this host has not served yet.
        store.snapshot().await?;
        Ok(store)
    }

    /// [`PostgresStore::seen_before`] inside an operation ([`PostgresStore::run`]), once its
    /// connection is ready, just before its query is sent: a raise this host committed
    /// while the operation waited for its connection (or connected again, perhaps to a new
    /// primary that lost it) is then one the answer must hold.
    fn seen_now(&self, principal: &PrincipalId) -> Result<InformationLabel, PgError> {
        self.seen_before(principal).map_err(|e| PgError::Query {
            target: self.target.name.clone(),
            reason: e.to_string(),
        })
    }

    /// The label this host has seen for `principal` so far; taken before a query, so that
    /// a concurrent raise that returns first cannot make this query's (older) answer look
    /// like a rollback.
    fn seen_before(&self, principal: &PrincipalId) -> Result<InformationLabel, StateError> {
        let seen = self
            .seen
            .lock()
            .map_err(|_| StateError::Failed("a writer panicked while holding the store".into()))?;
        Ok(seen
            .get(principal)
            .cloned()
            .unwrap_or_else(InformationLabel::bottom))
    }

    /// Checks `label`, read from the database for `principal` after this host had seen
    /// `before`, and keeps the higher of the two as seen. A lower label is the store's
    /// failure (see [`StateBackend::failure`]) until a read finds the principal's label back.
    fn observed(
        &self,
        principal: &PrincipalId,
        before: &InformationLabel,
        label: &InformationLabel,
    ) -> Result<(), StateError> {
        let mut lowered = self.lowered.lock().map_err(poisoned)?;
        if !before.flows_to(label) {
            tracing::error!(target = %self.target.name, principal = %principal, "the flow-state database holds a principal's label lower than this host has seen it; refusing");
            let err = PgError::Lower {
                target: self.target.name.clone(),
                principal: principal.to_string(),
            };
            lowered.insert(principal.clone(), err.to_string());
            if let Ok(mut lost) = self.lost_writes.lock() {
                lost.get_or_insert_with(|| {
                    format!(
                        "principal {principal}'s label was found lower than this host had seen it"
                    )
                });
            }
            return Err(err.into());
        }
        lowered.remove(principal);
        drop(lowered);
        let mut seen = self
            .seen
            .lock()
            .map_err(|_| StateError::Failed("a writer panicked while holding the store".into()))?;
        let entry = seen
            .entry(principal.clone())
            .or_insert_with(InformationLabel::bottom);
        *entry = entry.join_or_top(label);
        Ok(())
    }

    /// Writes `seen` back as `principal`'s label, which the database was found to hold lower
    /// than this host had seen it. Labels only rise, so the join is always safe; without it,
    /// every other host (and any started later) would read and serve the lowered label,
    /// since none of them may have seen the lost raise. The call that found it is refused
    /// all the same.
    async fn write_back(&self, principal: &PrincipalId, seen: &InformationLabel) {
        match self
            .run(async |c| self.raise_principal(c, principal, seen).await)
            .await
        {
            Ok(_) => {
                tracing::warn!(target = %self.target.name, principal = %principal, "wrote the label this host had seen back to the flow-state database");
            }
            Err(e) => {
                tracing::error!(target = %self.target.name, principal = %principal, "cannot write the label this host had seen back to the flow-state database: {e}");
            }
        }
    }

    /// [`PostgresStore::observed`], writing the label seen back when the database's is lower.
    async fn observed_or_write_back(
        &self,
        principal: &PrincipalId,
        before: &InformationLabel,
        label: &InformationLabel,
    ) -> Result<(), StateError> {
        let checked = self.observed(principal, before, label);
        if checked.is_err() && !before.flows_to(label) {
            self.write_back(principal, before).await;
        }
        checked
    }

    /// A failed query, as [`PgError::Conflict`] when the server aborted it for a concurrent
    /// write (SQLSTATE 40001, 40P01): [`PostgresStore::run`] runs such an operation again.
    fn query_error(&self, e: &tokio_postgres::Error) -> PgError {
        use tokio_postgres::error::SqlState;
        let conflict = e.code().is_some_and(|code| {
            *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED
        });
        if conflict {
            return PgError::Conflict {
                target: self.target.name.clone(),
                attempts: 1,
                reason: reason(e),
            };
        }
        query_failed(&self.target.name, e)
    }

    /// Runs `op` on one of the host's connections (reconnecting a lost one), within the
    /// timeout. An operation a concurrent write aborted ([`PgError::Conflict`]; its
    /// transaction rolled back, nothing committed) runs again, up to [`CONFLICT_ATTEMPTS`]
    /// times in all. A failure drops that connection, so the next operation starts afresh,
    /// and is reported by [`StateBackend::failure`] until an operation succeeds again.
    async fn run<T, F>(&self, op: F) -> Result<T, StateError>
    where
        // Cloned for each attempt (its captures are references): an `AsyncFn` called twice
        // makes a future the compiler cannot show to be `Send`.
        F: AsyncFnOnce(&mut Client) -> Result<T, PgError> + Clone,
    {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let work = async {
            let mut slot = self.slots[i].lock().await;
            if slot.as_ref().is_none_or(Client::is_closed) {
                *slot = Some(self.target.connect().await?);
            }
            let Some(client) = slot.as_mut() else {
                return Err(PgError::Connect {
                    target: self.target.name.clone(),
                    reason: "no connection".into(),
                });
            };
            let mut attempts = 1;
            let mut result = op.clone()(client).await;
            while matches!(result, Err(PgError::Conflict { .. })) && attempts < CONFLICT_ATTEMPTS {
                attempts += 1;
                result = op.clone()(client).await;
            }
            if let Err(PgError::Conflict { attempts: n, .. }) = &mut result {
                *n = attempts;
            }
            if result.is_err() {
                *slot = None;
            }
            result
        };
        let result = tokio::time::timeout(self.timeout, work)
            .await
            .unwrap_or_else(|_| {
                // The operation was abandoned part way (its transaction, if any, is rolled
                // back when its connection goes): drop that connection, unless another
                // operation already took the slot.
                if let Ok(mut slot) = self.slots[i].try_lock() {
                    *slot = None;
                }
                Err(PgError::Timeout {
                    target: self.target.name.clone(),
                    after: self.timeout,
                })
            });
        if let Ok(mut failure) = self.failure.lock() {
            *failure = result.as_ref().err().map(ToString::to_string);
        }
        result.map_err(StateError::from)
    }

    /// Column `i` of `row` (about `key`): a column of another type, or a NULL, is a
    /// database changed by hand, refused as corrupt rather than trusted or panicked on.
    fn column<'r, T: tokio_postgres::types::FromSql<'r>>(
        &self,
        row: &'r tokio_postgres::Row,
        i: usize,
        key: &str,
    ) -> Result<T, PgError> {
        row.try_get(i).map_err(|e| PgError::Corrupt {
            target: self.target.name.clone(),
            key: key.to_string(),
            reason: reason(&e),
        })
    }

    fn decode(&self, key: &str, text: &str) -> Result<InformationLabel, PgError> {
        InformationLabel::from_json(text).map_err(|e| PgError::Corrupt {
            target: self.target.name.clone(),
            key: key.to_string(),
            reason: e.to_string(),
        })
    }

    async fn principal_label(
        &self,
        client: &Client,
        principal: &PrincipalId,
    ) -> Result<InformationLabel, PgError> {
        let row = client
            .query_opt(
                "SELECT label FROM principal_labels WHERE principal = $1",
                &[&principal.as_str()],
            )
            .await
            .map_err(|e| self.query_error(&e))?;
        match row {
            None => Ok(InformationLabel::bottom()),
            Some(row) => self.decode(
                principal.as_str(),
                self.column(&row, 0, principal.as_str())?,
            ),
        }
    }

    /// Joins `label` into the principal's stored label under the row's lock, committed:
    /// the label the database held before (what is checked against what this host has
    /// seen: the join could hide a label rolled back) and the one it holds after.
    async fn raise_principal(
        &self,
        client: &mut Client,
        principal: &PrincipalId,
        label: &InformationLabel,
    ) -> Result<(InformationLabel, InformationLabel), PgError> {
        // Labels only grow: a label that already holds `label` keeps holding it, so the
        // common call that adds nothing needs no lock and no commit.
        let current = self.principal_label(client, principal).await?;
        if current.join_or_top(label) == current {
            return Ok((current.clone(), current));
        }
        let q = |e: tokio_postgres::Error| self.query_error(&e);
        let tx = client.transaction().await.map_err(q)?;
        let inserted = tx
            .execute(
                "INSERT INTO principal_labels (principal, label) VALUES ($1, $2)
                 ON CONFLICT (principal) DO NOTHING",
                &[&principal.as_str(), &label.to_canonical_json()],
            )
            .await
            .map_err(q)?;
        let (held, joined) = if inserted == 1 {
            (InformationLabel::bottom(), label.clone())
        } else {
            let row = tx
                .query_one(
                    "SELECT label FROM principal_labels WHERE principal = $1 FOR UPDATE",
                    &[&principal.as_str()],
                )
                .await
                .map_err(q)?;
            let held = self.decode(
                principal.as_str(),
                self.column(&row, 0, principal.as_str())?,
            )?;
            let joined = held.join_or_top(label);
            if joined != held {
                tx.execute(
                    "UPDATE principal_labels SET label = $2 WHERE principal = $1",
                    &[&principal.as_str(), &joined.to_canonical_json()],
                )
                .await
                .map_err(q)?;
            }
            (held, joined)
        };
        tx.commit().await.map_err(q)?;
        Ok((held, joined))
    }

    fn session_label(&self, key: &SessionKey) -> Result<InformationLabel, StateError> {
        let sessions = self
            .sessions
            .lock()
            .map_err(|_| StateError::Failed("a writer panicked while holding the store".into()))?;
        Ok(sessions
            .get(key)
            .cloned()
            .unwrap_or_else(InformationLabel::bottom))
    }
}

impl StateBackend for PostgresStore {
    fn get<'a>(&'a self, key: &'a SessionKey) -> StateFuture<'a, FlowState> {
        Box::pin(async move {
            let (before, principal) = self
                .run(async |c| {
                    let before = self.seen_now(&key.principal)?;
                    Ok((before, self.principal_label(c, &key.principal).await?))
                })
                .await?;
            self.observed_or_write_back(&key.principal, &before, &principal)
                .await?;
            Ok(FlowState {
                principal,
                session: self.session_label(key)?,
            })
        })
    }

    fn raise<'a>(
        &'a self,
        key: &'a SessionKey,
        principal: &'a InformationLabel,
        session: &'a InformationLabel,
    ) -> StateFuture<'a, FlowState> {
        Box::pin(async move {
            let (before, (held, principal)) = self
                .run(async |c| {
                    let before = self.seen_now(&key.principal)?;
                    Ok((
                        before,
                        self.raise_principal(c, &key.principal, principal).await?,
                    ))
                })
                .await?;
            // What the database held before this raise, not after it: the join would hide a
            // label rolled back below what this host had seen.
            self.observed_or_write_back(&key.principal, &before, &held)
                .await?;
            self.observed(&key.principal, &held, &principal)?;
            // The session's label is this host's alone; the join is commutative, so
            // concurrent raises of one session compose under the lock.
            let mut sessions = self.sessions.lock().map_err(|_| {
                StateError::Failed("a writer panicked while holding the store".into())
            })?;
            let entry = sessions
                .entry(key.clone())
                .or_insert_with(InformationLabel::bottom);
            *entry = entry.join_or_top(session);
            Ok(FlowState {
                principal,
                session: entry.clone(),
            })
        })
    }

    fn forget_session<'a>(&'a self, key: &'a SessionKey) -> StateFuture<'a, ()> {
        Box::pin(async move {
            self.sessions
                .lock()
                .map_err(|_| {
                    StateError::Failed("a writer panicked while holding the store".into())
                })?
                .remove(key);
            Ok(())
        })
    }

    fn consume_grant<'a>(&'a self, id: &'a str, now: u64) -> StateFuture<'a, bool> {
        Box::pin(async move {
            let now = i64::try_from(now).unwrap_or(i64::MAX);
            self.run(async |c| {
                let n = c
                    .execute(
                        "INSERT INTO consumed_grants (grant_id, consumed_at, host_id)
                         VALUES ($1, $2, $3) ON CONFLICT (grant_id) DO NOTHING",
                        &[&id, &now, &self.host_id],
                    )
                    .await
                    .map_err(|e| self.query_error(&e))?;
                Ok(n == 1)
            })
            .await
        })
    }

    fn snapshot(&self) -> StateFuture<'_, StateSnapshot> {
        Box::pin(async move {
            let before = self.seen.lock().map_err(poisoned)?.clone();
            let rows = self
                .run(async |c| {
                    c.query("SELECT principal, label FROM principal_labels", &[])
                        .await
                        .map_err(|e| self.query_error(&e))
                })
                .await?;
            let mut principals = HashMap::new();
            for row in rows {
                let p: &str = self.column(&row, 0, "(a principal's row)")?;
                let principal = PrincipalId::new(p).map_err(|e| PgError::Corrupt {
                    target: self.target.name.clone(),
                    key: p.to_string(),
                    reason: e.to_string(),
                })?;
                principals.insert(principal, self.decode(p, self.column(&row, 1, p)?)?);
            }
            // A principal seen before and missing now reads as bottom, like a missing row
            // read on its own: both are checked against what this host has seen.
            let bottom = InformationLabel::bottom();
            // Every lowered label is written back before the first is reported.
            let mut lowered = None;
            for (principal, seen) in &before {
                let label = principals.get(principal).unwrap_or(&bottom);
                if let Err(e) = self.observed_or_write_back(principal, seen, label).await {
                    lowered.get_or_insert(e);
                }
            }
            if let Some(e) = lowered {
                return Err(e);
            }
            for (principal, label) in &principals {
                if !before.contains_key(principal) {
                    self.observed(principal, &bottom, label)?;
                }
            }
            let sessions = self.sessions.lock().map_err(poisoned)?.clone();
            Ok(StateSnapshot {
                principals,
                sessions,
            })
        })
    }

    fn checkpoint(&self) -> StateFuture<'_, Option<(u64, String)>> {
        Box::pin(async move {
            let row = self
                .run(async |c| {
                    c.query_opt(
                        "SELECT seq, hash FROM records_checkpoint WHERE host_id = $1",
                        &[&self.host_id],
                    )
                    .await
                    .map_err(|e| self.query_error(&e))
                })
                .await?;
            let key = "(this host's records checkpoint)";
            row.map(|r| {
                let seq: i64 = self.column(&r, 0, key)?;
                let seq = u64::try_from(seq).map_err(|_| PgError::Corrupt {
                    target: self.target.name.clone(),
                    key: key.to_string(),
                    reason: format!("a negative sequence number ({seq})"),
                })?;
                Ok((seq, self.column::<String>(&r, 1, key)?))
            })
            .transpose()
        })
    }

    fn set_checkpoint<'a>(&'a self, seq: u64, hash: &'a str) -> StateFuture<'a, ()> {
        Box::pin(async move {
            let seq = i64::try_from(seq).unwrap_or(i64::MAX);
            // Every label this host has seen, which includes every label the check that
            // vouches for this checkpoint read.
            let seen = self.seen.lock().map_err(poisoned)?.clone();
            // The labels found lower, each with what the database held: the checkpoint is
            // then not moved, and each is handled as any read finding it is.
            let lowered = self
                .run(async |c| {
                    let q = |e: tokio_postgres::Error| self.query_error(&e);
                    let tx = c.transaction().await.map_err(q)?;
                    // The database the checkpoint goes to must still hold those labels: one
                    // that lost some after the check read them (a failover to a lagging
                    // replica, a restore) would otherwise be bound to records whose raises it
                    // lacks, and the next start would check only the records after it. The
                    // rows are locked until the checkpoint is written (raises by other hosts
                    // only add).
                    let rows = tx
                        .query(
                            "SELECT principal, label FROM principal_labels FOR SHARE",
                            &[],
                        )
                        .await
                        .map_err(q)?;
                    let mut held = HashMap::new();
                    for row in &rows {
                        let p: &str = self.column(row, 0, "(a principal's row)")?;
                        held.insert(p.to_string(), self.decode(p, self.column(row, 1, p)?)?);
                    }
                    let bottom = InformationLabel::bottom();
                    let lowered: Vec<(&PrincipalId, &InformationLabel, InformationLabel)> = seen
                        .iter()
                        .filter_map(|(principal, label)| {
                            let now = held.get(principal.as_str()).unwrap_or(&bottom);
                            (!label.flows_to(now)).then(|| (principal, label, now.clone()))
                        })
                        .collect();
                    if !lowered.is_empty() {
                        // Dropped, the transaction rolls back: nothing was written.
                        return Ok(lowered);
                    }
                    tx.execute(
                        "INSERT INTO records_checkpoint (host_id, seq, hash) VALUES ($1, $2, $3)
                     ON CONFLICT (host_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash",
                        &[&self.host_id, &seq, &hash],
                    )
                    .await
                    .map_err(q)?;
                    tx.commit().await.map_err(q)?;
                    Ok(Vec::new())
                })
                .await?;
            // As a read that finds a label lower does: the label seen is written back (other
            // hosts would otherwise serve the lowered one), the store reports it, and takes
            // no grant until it restarts. Before, the checkpoint alone was refused.
            let Some((first, _, _)) = lowered.first() else {
                return Ok(());
            };
            tracing::error!(target = %self.target.name, "the checkpoint is not moved: the flow-state database holds labels lower than this host has seen them");
            let refused = PgError::Lower {
                target: self.target.name.clone(),
                principal: first.to_string(),
            };
            for (principal, seen, held) in &lowered {
                // Always an error (each label is lower than seen); the checkpoint's own
                // refusal is returned whatever it says.
                let _ = self.observed_or_write_back(principal, seen, held).await;
            }
            Err(refused.into())
        })
    }

    fn grants_unvouched(&self) -> Option<StateError> {
        let lost = match self.lost_writes.lock() {
            Ok(lost) => lost.clone()?,
            Err(_) => "a writer panicked while holding the store".to_string(),
        };
        Some(
            PgError::GrantsUnvouched {
                target: self.target.name.clone(),
                lost,
            }
            .into(),
        )
    }

    /// The last operation's failure, else a principal's label found lower than seen and
    /// not read back since.
    fn failure(&self) -> Option<String> {
        let panicked = || Some("a writer panicked while holding the store".to_string());
        match (self.failure.lock(), self.lowered.lock()) {
            (Ok(f), Ok(lowered)) => f.clone().or_else(|| lowered.values().next().cloned()),
            _ => panicked(),
        }
    }

    fn describe(&self) -> String {
        format!("{} (host {})", self.target.name, self.host_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dir: &Path, url: &str) -> PostgresStateConfig {
        let url_file = dir.join("url");
        std::fs::write(&url_file, url).unwrap();
        // As a secret is kept: the URL may hold a password.
        std::fs::set_permissions(
            &url_file,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        PostgresStateConfig {
            url_file,
            host_id: "h".into(),
            password_file: None,
            ca_file: None,
            server_user: Some("root".into()),
            schema: None,
            timeout: Duration::from_secs(1),
            connections: 1,
        }
    }

    /// A password others, or the daemon's own group, may read is refused, in `password_file` or in a `url_file`
    /// that holds one: whoever reads it can log in as flowhost and lower labels other
    /// hosts then trust. Before, only who may change these files was checked.
    #[test]
    fn a_password_others_may_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let chmod = |f: &Path, mode| {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings(dir.path(), "postgresql://u@localhost/db");
        chmod(&s.url_file, 0o644);
        let password = dir.path().join("password");
        std::fs::write(&password, "pw\n").unwrap();
        s.password_file = Some(password.clone());
        // (The group this process runs as is refused too, unless it is root's: a test run
        // as root has no other to try.)
        for mode in [0o604, 0o644] {
            chmod(&password, mode);
            let e = load_error(&s);
            assert!(
                e.contains(&password.display().to_string())
                    && e.contains("password_file")
                    && e.contains(&format!("{mode:04o}"))
                    && e.contains("may read"),
                "{e}"
            );
        }
        chmod(&password, 0o600);
        // The URL without a password may be read by anyone; with one, it is a secret.
        Target::load(&s).unwrap();
        s.password_file = None;
        std::fs::write(&s.url_file, "postgresql://u:pw@localhost/db").unwrap();
        let e = load_error(&s);
        assert!(
            e.contains(&s.url_file.display().to_string())
                && e.contains("url_file")
                && e.contains("0644"),
            "{e}"
        );
        chmod(&s.url_file, 0o600);
        Target::load(&s).unwrap();
    }

    fn load_error(s: &PostgresStateConfig) -> String {
        match Target::load(s) {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_database_is_named_without_its_password() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(
            dir.path(),
            "postgresql://fleet:s3cret-pw@db.example:6543/flow\n",
        );
        let target = load_error(&s);
        assert!(target.contains("db.example"), "{target}");
        assert!(!target.contains("s3cret"), "{target}");
        let s = settings(
            dir.path(),
            "postgresql://fleet:s3cret-pw@localhost:6543/flow\n",
        );
        let target = Target::load(&s).unwrap();
        assert_eq!(target.name, "postgresql://fleet@localhost:6543/flow");
        assert!(!target.name.contains("s3cret"));
    }

    #[test]
    fn plaintext_reaches_only_servers_on_this_machine() {
        let dir = tempfile::tempdir().unwrap();
        for local in [
            "postgresql://u@127.0.0.1:5432/db",
            "postgresql://u@[::1]:5432/db",
            "postgresql://u@LOCALHOST/db",
            "host=/run/postgresql user=u dbname=db",
            "host=db.example hostaddr=127.0.0.1 user=u dbname=db",
        ] {
            let s = settings(dir.path(), local);
            assert!(Target::load(&s).is_ok(), "{local}");
        }
        for (remote, named) in [
            ("postgresql://u@db.example/db", "db.example"),
            ("postgresql://u@10.0.0.5:5432/db", "10.0.0.5"),
            ("postgresql://u@127.0.0.1,10.0.0.6/db", "10.0.0.6"),
            (
                "host=localhost hostaddr=10.0.0.7 user=u dbname=db",
                "10.0.0.7",
            ),
            ("postgresql://u@db.example/db?sslmode=disable", "db.example"),
        ] {
            let s = settings(dir.path(), remote);
            let e = load_error(&s);
            assert!(
                e.contains(named) && e.contains("ca_file") && e.contains("url"),
                "{remote}: {e}"
            );
        }
    }

    /// In plaintext on this machine, the server is the one its user serves: whoever else
    /// listens first on its port or socket name (a local user, while the database restarts
    /// or on the address family it does not listen on) is refused before a password or a
    /// query is sent. Before, the first listener was trusted with both.
    #[tokio::test]
    async fn a_local_server_another_user_serves_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::getuid().as_raw();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let unix = tokio::net::UnixListener::bind(dir.path().join(".s.PGSQL.5432")).unwrap();
        let mut s = settings(dir.path(), &format!("postgresql://u@127.0.0.1:{port}/db"));
        s.server_user = Some((me + 1).to_string());
        let target = Target::load(&s).unwrap();
        let e = target.connect().await.unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "127.0.0.1:{port} is served by uid {me}, not the server's user"
            )),
            "{e}"
        );
        let mut s = settings(
            dir.path(),
            &format!("host={} port=5432 user=u dbname=db", dir.path().display()),
        );
        s.server_user = Some((me + 1).to_string());
        let e = Target::load(&s)
            .unwrap()
            .connect()
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(".s.PGSQL.5432 is served by uid"), "{e}");
        // Its own user's server is spoken to (this listener speaks no PostgreSQL: it hangs
        // up).
        tokio::spawn(async move {
            while let Ok((conn, _)) = unix.accept().await {
                drop(conn);
            }
        });
        s.server_user = Some(me.to_string());
        let e = Target::load(&s)
            .unwrap()
            .connect()
            .await
            .unwrap_err()
            .to_string();
        assert!(!e.contains("served by uid"), "{e}");
        drop(listener);
        // A user that does not exist is refused at load, naming the setting.
        s.server_user = Some("no-such-user-here".into());
        let e = load_error(&s);
        assert!(
            e.contains("server_user") && e.contains("no-such-user-here"),
            "{e}"
        );
    }

    #[test]
    fn bad_settings_name_the_file_at_fault() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings(dir.path(), "postgresql://u@h/db");
        s.password_file = Some(dir.path().join("missing-password"));
        let e = load_error(&s);
        assert!(
            e.contains("missing-password") && e.contains("password_file"),
            "{e}"
        );
        let s = settings(dir.path(), "postgresql://u@h:notaport/db");
        let e = load_error(&s);
        assert!(e.contains("not a PostgreSQL connection string"), "{e}");
        // TLS demanded by the URL needs roots to check the server against.
        let s = settings(dir.path(), "postgresql://u@h/db?sslmode=require");
        let e = load_error(&s);
        assert!(e.contains("no ca_file"), "{e}");
        let mut s = settings(dir.path(), "postgresql://u@h/db");
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not a certificate").unwrap();
        s.ca_file = Some(ca);
        let e = load_error(&s);
        assert!(e.contains("ca.pem") && e.contains("no certificate"), "{e}");
    }

    /// The files naming the database, its password and the roots its server is checked
    /// against decide which database holds the labels: one that someone other than root or
    /// this process's user could change is refused, naming it and the setting.
    #[test]
    fn settings_files_others_could_change_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings(dir.path(), "postgresql://u@localhost/db");
        let password = dir.path().join("password");
        std::fs::write(&password, "pw\n").unwrap();
        s.password_file = Some(password.clone());
        let chmod = |f: &Path, mode| {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        chmod(&password, 0o600);
        Target::load(&s).unwrap();
        for (file, what) in [(&s.url_file, "url_file"), (&password, "password_file")] {
            for mode in [0o664, 0o646] {
                chmod(file, mode);
                let e = load_error(&s);
                assert!(
                    e.contains(&file.display().to_string())
                        && e.contains(what)
                        && e.contains(&format!("{mode:04o}")),
                    "{e}"
                );
            }
            chmod(file, 0o600);
        }
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not a certificate").unwrap();
        chmod(&ca, 0o666);
        s.ca_file = Some(ca.clone());
        let e = load_error(&s);
        assert!(
            e.contains("ca.pem") && e.contains("ca_file") && e.contains("0666"),
            "{e}"
        );
        s.ca_file = None;
        Target::load(&s).unwrap();
        // Reached through a link (a Kubernetes secret mount is one): followed, the file it
        // leads to judged; through a directory others may write: refused, naming it.
        let mounted = dir.path().join("mounted");
        std::fs::create_dir(&mounted).unwrap();
        std::os::unix::fs::symlink(&password, mounted.join("password")).unwrap();
        s.password_file = Some(mounted.join("password"));
        Target::load(&s).unwrap();
        chmod(&mounted, 0o777);
        let e = load_error(&s);
        assert!(
            e.contains(&mounted.display().to_string()) && e.contains("password_file"),
            "{e}"
        );
        chmod(&mounted, 0o755);
        s.password_file = Some(password.clone());
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: giving a file to another user needs root");
            return;
        }
        std::os::unix::fs::chown(&password, Some(65534), None).unwrap();
        let e = load_error(&s);
        assert!(
            e.contains("password_file") && e.contains("uid 65534"),
            "{e}"
        );
    }

    /// A fresh lab server holding the schema, or `None` (the reason printed) where no
    /// server can run here.
    async fn lab() -> Option<crate::lab::postgres::Postgres> {
        let pg = crate::lab::postgres::Postgres::start_unless_unavailable().unwrap()?;
        migrate(&pg.settings("h")).await.unwrap();
        Some(pg)
    }

    /// The value of `setting` on one of `store`'s connections.
    async fn show(store: &PostgresStore, setting: &str) -> String {
        let query = format!("SHOW {setting}");
        store
            .run(async |c| Ok(c.query_one(&query, &[]).await.unwrap().get(0)))
            .await
            .unwrap()
    }

    /// A statement the server cancels (its role's `statement_timeout`, here past a lock an
    /// operator holds) is a cancellation, which may pass, not a failed statement. Before,
    /// it stopped a start for good (exit 2) where a timeout of the host's own was retried.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_statement_the_server_cancels_is_a_cancellation() {
        use super::super::tests::{key, owner};
        let Some(pg) = crate::lab::postgres::Postgres::start_unless_unavailable().unwrap() else {
            return;
        };
        let s = pg.settings("h");
        migrate(&s).await.unwrap();
        let mut admin = pg.client().await.unwrap();
        admin
            .batch_execute("ALTER ROLE CURRENT_USER SET statement_timeout = '300ms'")
            .await
            .unwrap();
        let store = PostgresStore::open(&s).await.unwrap();
        let tx = admin.transaction().await.unwrap();
        tx.batch_execute("LOCK TABLE principal_labels IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        let e = store
            .raise(&key("alice", "s"), &owner("larkfield"), &owner("larkfield"))
            .await
            .unwrap_err();
        tx.rollback().await.unwrap();
        assert!(
            matches!(e, StateError::Postgres(PgError::Cancelled { .. })),
            "{e:?}"
        );
    }

    /// With `schema` set, the store keeps its tables there and finds them there whatever
    /// the role's `search_path` says; a schema the database lacks is named.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_configured_schema_is_the_only_one_searched() {
        use super::super::tests::{key, owner};
        let Some(pg) = crate::lab::postgres::Postgres::start_unless_unavailable().unwrap() else {
            return;
        };
        let admin = pg.client().await.unwrap();
        let mut s = pg.settings("h");
        s.schema = Some("fleet".into());
        let e = migrate(&s).await.unwrap_err();
        // What only the operator can change is not a cause that may pass by itself: a host
        // refused for it exits 2, and its unit is not restarted again and again.
        assert!(
            matches!(e, StateError::Postgres(PgError::Unsuitable { .. })),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(
            e.contains("no schema \"fleet\"") && e.contains("host.state.schema"),
            "{e}"
        );
        // The role searches a schema of its own first, where tables would go by default.
        admin
            .batch_execute(
                "CREATE SCHEMA fleet; CREATE SCHEMA own; \
                 ALTER ROLE CURRENT_USER SET search_path TO own, public",
            )
            .await
            .unwrap();
        migrate(&s).await.unwrap();
        let row = admin
            .query_one(
                "SELECT to_regclass('fleet.principal_labels') IS NOT NULL, \
                 to_regclass('own.principal_labels') IS NULL, \
                 to_regclass('public.principal_labels') IS NULL",
                &[],
            )
            .await
            .unwrap();
        assert!(row.get::<_, bool>(0) && row.get::<_, bool>(1) && row.get::<_, bool>(2));
        // Without the setting, a role that searches a schema of its own first is refused,
        // at open and at migrate (it would find or make tables no other host's role sees).
        let e = PostgresStore::open(&pg.settings("h"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"own\"")
                && e.contains("host.state.schema")
                && e.contains("schema = \"fleet\""),
            "{e}"
        );
        let e = migrate(&pg.settings("h")).await.unwrap_err().to_string();
        assert!(e.contains("host.state.schema"), "{e}");
        let store = PostgresStore::open(&s).await.unwrap();
        assert_eq!(show(&store, "search_path").await, "\"fleet\"");
        store
            .raise(&key("alice", "s"), &owner("larkfield"), &owner("larkfield"))
            .await
            .unwrap();
        let n: i64 = admin
            .query_one("SELECT count(*) FROM fleet.principal_labels", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1);
        // A role searching public first, then the schema holding the tables: without the
        // setting, public alone is searched, and the tables elsewhere are named, not used.
        // Before, fleet's were, until public got tables of its own.
        admin
            .batch_execute("ALTER ROLE CURRENT_USER SET search_path TO public, fleet")
            .await
            .unwrap();
        let e = PostgresStore::open(&pg.settings("h"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("public holds no flowhost tables") && e.contains("schema = \"fleet\""),
            "{e}"
        );
        // Nor does migrate make empty ones in public.
        let e = migrate(&pg.settings("h")).await.unwrap_err().to_string();
        assert!(e.contains("schema = \"fleet\""), "{e}");
        let row = admin
            .query_one("SELECT to_regclass('public.principal_labels') IS NULL", &[])
            .await
            .unwrap();
        assert!(row.get::<_, bool>(0));
    }

    /// A refusal only the operator can change (a wrong password, a database that does not
    /// exist) is not a cause that may pass: start-up exits 2 on it rather than having the
    /// unit restarted again and again. Before, it was a connection failure like any other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wrong_password_or_database_is_not_a_cause_that_may_pass() {
        use std::os::unix::fs::PermissionsExt;
        let Some(pg) = lab().await else { return };
        let dir = tempfile::tempdir().unwrap();
        let wrong = dir.path().join("password");
        std::fs::write(&wrong, "not-the-password\n").unwrap();
        std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut s = pg.settings("h");
        s.password_file = Some(wrong);
        let e = PostgresStore::open(&s).await.unwrap_err();
        assert!(
            matches!(e, StateError::Postgres(PgError::Unsuitable { .. })),
            "{e:?}"
        );
        let url = std::fs::read_to_string(&pg.settings("h").url_file).unwrap();
        let other = dir.path().join("url");
        std::fs::write(&other, url.trim().replace("/postgres", "/no_such_database")).unwrap();
        let mut s = pg.settings("h");
        s.url_file = other;
        let e = PostgresStore::open(&s).await.unwrap_err();
        assert!(
            matches!(e, StateError::Postgres(PgError::Unsuitable { .. })),
            "{e:?}"
        );
    }

    /// A server that does not take writes (a standby, or a database made read-only) could
    /// only be one that lags the primary: the store refuses it, naming it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_that_does_not_take_writes_is_refused() {
        let Some(pg) = lab().await else { return };
        pg.client()
            .await
            .unwrap()
            .batch_execute("ALTER DATABASE postgres SET default_transaction_read_only = on")
            .await
            .unwrap();
        let err = PostgresStore::open(&pg.settings("h")).await.unwrap_err();
        assert!(
            matches!(err, StateError::Postgres(PgError::ReadOnly { .. })),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("127.0.0.1:{}/postgres", pg.port)) && text.contains("writes"),
            "{text}"
        );
        // The store's own check after connecting, should the driver's pass such a server.
        let mut target = Target::load(&pg.settings("h")).unwrap();
        target.config.target_session_attrs(TargetSessionAttrs::Any);
        let err = target.connect().await.unwrap_err();
        assert!(
            matches!(&err, PgError::ReadOnly { found, .. } if found.contains("transaction_read_only = on")),
            "{err:?}"
        );
    }

    /// A store opened after a principal was raised (a host restarted, or started later)
    /// knows the label it found at start: a database lowered behind its back (a failover, a
    /// restore) is refused, not read as the principal's label.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_label_lowered_after_a_store_opened_is_refused() {
        use super::super::tests::{key, owner};
        let Some(pg) = lab().await else { return };
        let k = key("alice", "s");
        let first = PostgresStore::open(&pg.settings("a")).await.unwrap();
        first
            .raise(&k, &owner("larkfield"), &owner("larkfield"))
            .await
            .unwrap();
        let second = PostgresStore::open(&pg.settings("b")).await.unwrap();
        let raw = pg.client().await.unwrap();
        raw.execute(
            "UPDATE principal_labels SET label = $1 WHERE principal = 'alice'",
            &[&InformationLabel::bottom().to_canonical_json()],
        )
        .await
        .unwrap();
        let err = second.get(&k).await.unwrap_err();
        assert!(
            matches!(&err, StateError::Postgres(PgError::Lower { principal, .. }) if principal == "alice"),
            "{err:?}"
        );
        // A row gone altogether reads as bottom, and is refused the same way.
        raw.execute(
            "DELETE FROM principal_labels WHERE principal = 'alice'",
            &[],
        )
        .await
        .unwrap();
        let third = PostgresStore::open(&pg.settings("c")).await.unwrap();
        assert!(
            matches!(
                second.get(&k).await,
                Err(StateError::Postgres(PgError::Lower { .. }))
            ),
            "a missing row is not bottom to a store that has seen the label"
        );
        // The store that found it lowered wrote back what it had seen: a host that never
        // saw the lost raise reads it again (before, it served the principal at bottom).
        assert_eq!(third.get(&k).await.unwrap().principal, owner("larkfield"));
        // Spent grants may have been lost with the label: the store that found the loss
        // takes none (before, a grant spent before the loss could be spent again).
        assert!(matches!(
            second.grants_unvouched(),
            Some(StateError::Postgres(PgError::GrantsUnvouched { .. }))
        ));
        assert!(third.grants_unvouched().is_none());
        assert!(third.consume_grant("g-1", 1).await.unwrap());
    }

    /// The checkpoint vouches for the labels the check read: it is not written to a
    /// database that lost one of them since (a failover to a lagging replica, a restore,
    /// while the records were read). Before, it was written whatever the database held, and
    /// the next start, checking only the records after it, accepted the lower labels.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_checkpoint_is_not_moved_onto_a_database_that_lost_labels() {
        use super::super::tests::{key, owner};
        let Some(pg) = lab().await else { return };
        let store = PostgresStore::open(&pg.settings("a")).await.unwrap();
        store
            .raise(&key("alice", "s"), &owner("larkfield"), &owner("larkfield"))
            .await
            .unwrap();
        store.set_checkpoint(1, "sha256:one").await.unwrap();
        pg.client()
            .await
            .unwrap()
            .execute(
                "DELETE FROM principal_labels WHERE principal = 'alice'",
                &[],
            )
            .await
            .unwrap();
        let err = store.set_checkpoint(2, "sha256:two").await.unwrap_err();
        assert!(
            matches!(&err, StateError::Postgres(PgError::Lower { principal, .. }) if principal == "alice"),
            "{err:?}"
        );
        assert_eq!(
            store.checkpoint().await.unwrap(),
            Some((1, "sha256:one".to_string()))
        );
        // Found so, the loss is handled as a read finding it is: the label seen is written
        // back for every host, the store reports it, and takes no grant. Before, only the
        // checkpoint was refused, and other hosts went on reading the lowered label.
        let other = PostgresStore::open(&pg.settings("b")).await.unwrap();
        assert_eq!(
            other.get(&key("alice", "s2")).await.unwrap().principal,
            owner("larkfield")
        );
        assert!(
            store.failure().is_some_and(|f| f.contains("alice")),
            "{:?}",
            store.failure()
        );
        assert!(store.grants_unvouched().is_some());
    }

    /// A label found lower than this host has seen refuses the call of that principal that
    /// found it: the store reports it as its failure (health says the flow state failed)
    /// until a read finds the label back, though the queries themselves succeed, other
    /// principals' too. The store writes what it had seen back at once, so the next read
    /// does (and every other host reads it again).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lowered_label_stays_the_stores_failure_until_it_is_read_back() {
        use super::super::tests::{key, owner};
        let Some(pg) = lab().await else { return };
        let (alice, bob) = (key("alice", "s"), key("bob", "s"));
        let store = PostgresStore::open(&pg.settings("a")).await.unwrap();
        store
            .raise(&alice, &owner("larkfield"), &owner("larkfield"))
            .await
            .unwrap();
        let raw = pg.client().await.unwrap();
        let set = |label: InformationLabel| {
            let raw = &raw;
            async move {
                raw.execute(
                    "UPDATE principal_labels SET label = $1 WHERE principal = 'alice'",
                    &[&label.to_canonical_json()],
                )
                .await
                .unwrap();
            }
        };
        set(InformationLabel::bottom()).await;
        assert!(store.get(&alice).await.is_err());
        let failure = store.failure();
        assert!(
            failure.as_deref().is_some_and(|f| f.contains("alice")
                && f.contains("lower")
                && f.contains("url_file")
                && !f.contains("rebuild the state")),
            "{failure:?}"
        );
        store.get(&bob).await.unwrap();
        assert!(store.failure().is_some(), "bob's read cleared alice's");
        // The refusal wrote back the label the store had seen, so the next read finds it.
        assert_eq!(
            store.get(&alice).await.unwrap().principal,
            owner("larkfield")
        );
        assert_eq!(store.failure(), None);
        // Lowered again, refused again.
        set(InformationLabel::bottom()).await;
        assert!(store.get(&alice).await.is_err());
    }

    /// A server whose transactions default to `serializable` (or `repeatable read`) would
    /// fail one of two concurrent raises of a principal with a serialization failure (the
    /// second finds the row changed since its snapshot), refusing its call: the store's
    /// connections read committed, so every concurrent raise survives.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_raises_all_survive_whatever_isolation_the_server_defaults_to() {
        use super::super::tests::{key, owner};
        let Some(pg) = lab().await else { return };
        let raw = pg.client().await.unwrap();
        for level in ["serializable", "repeatable read"] {
            raw.batch_execute(&format!(
                "ALTER DATABASE postgres SET default_transaction_isolation = '{level}'"
            ))
            .await
            .unwrap();
            let principal = format!("p-{}", level.replace(' ', "-"));
            let stores = [
                std::sync::Arc::new(PostgresStore::open(&pg.settings("a")).await.unwrap()),
                std::sync::Arc::new(PostgresStore::open(&pg.settings("b")).await.unwrap()),
            ];
            let mut tasks = Vec::new();
            for i in 0..16 {
                let store = stores[i % 2].clone();
                let principal = principal.clone();
                tasks.push(tokio::spawn(async move {
                    let k = key(&principal, &format!("s{i}"));
                    let label = owner(&format!("o{i}"));
                    store.raise(&k, &label, &label).await.map(|_| ())
                }));
            }
            for t in tasks {
                let raised = t.await.unwrap();
                assert!(raised.is_ok(), "server default {level}: {raised:?}");
            }
            let mut all = InformationLabel::bottom();
            for i in 0..16 {
                all = all.join_or_top(&owner(&format!("o{i}")));
            }
            let held = stores[1].get(&key(&principal, "new")).await.unwrap();
            assert_eq!(
                held.principal, all,
                "server default {level}: a raise was lost"
            );
            assert_eq!(
                show(&stores[0], "transaction_isolation").await,
                "read committed",
                "server default {level}"
            );
        }
        // Should a conflict happen all the same, the operation runs again, a bounded number
        // of times.
        let store = PostgresStore::open(&pg.settings("c")).await.unwrap();
        let runs = AtomicUsize::new(0);
        let conflict = || PgError::Conflict {
            target: "t".into(),
            attempts: 1,
            reason: "could not serialize access".into(),
        };
        let ran = store
            .run(async |_| match runs.fetch_add(1, Ordering::SeqCst) {
                0 | 1 => Err(conflict()),
                n => Ok(n),
            })
            .await;
        assert_eq!(ran.unwrap(), 2);
        let err = store
            .run(async |_| Err::<(), _>(conflict()))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                StateError::Postgres(PgError::Conflict {
                    attempts: CONFLICT_ATTEMPTS,
                    ..
                })
            ),
            "{err:?}"
        );
    }

    /// A level below `on` (`off`; `local` and `remote_write`, which do not wait for a
    /// synchronous standby to flush the commit) is raised to `on` for the store's
    /// connections; `remote_apply`, stronger than `on`, is kept.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn synchronous_commit_is_at_least_on() {
        let Some(pg) = lab().await else { return };
        let raw = pg.client().await.unwrap();
        for (configured, pinned) in [
            ("off", "on"),
            ("local", "on"),
            ("remote_write", "on"),
            ("on", "on"),
            ("remote_apply", "remote_apply"),
        ] {
            raw.batch_execute(&format!(
                "ALTER ROLE flowhost SET synchronous_commit = {configured}"
            ))
            .await
            .unwrap();
            let store = PostgresStore::open(&pg.settings("h")).await.unwrap();
            assert_eq!(
                show(&store, "synchronous_commit").await,
                pinned,
                "configured {configured}"
            );
        }
    }
}
