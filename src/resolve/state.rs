//! Durable information-flow state, keyed by principal and by (principal, session).
//!
//! This file is long on purpose: it defines the store's interface and its embedded SQLite
//! backend, whose every operation keeps the same promises (labels only grow, durable before
//! returning, a failure poisons the store); the PostgreSQL backend is in state/postgres.rs.
//!
//! Guarantees (docs/ARCHITECTURE.md, "Invariants"): labels only ever grow (every write is a
//! join with what is stored), a label is durable (SQLite WAL, `synchronous=FULL`) before the
//! call that raised it returns, a restart never lowers a label, and state that cannot be read
//! is `Top`, never bottom. A principal's label follows it into every new session.
//!
//! [`FlowStateStore`] is the one interface the resolver and the continuity checks use; a
//! [`StateBackend`] keeps the labels. Two backends exist: [`SqliteStore`] (the embedded
//! default, one file per host) and [`postgres::PostgresStore`] (one database shared by a
//! fleet, so a principal's label follows it from host to host). Both keep the same promises:
//! labels never go down, a raise is durable before the call returns, concurrent raises for
//! one principal all survive, and a store that cannot be read or written fails the call.
//!
//! The SQLite store keeps an authoritative in-memory copy and writes to disk only when a join
//! actually changes a label, so the common call that adds nothing costs no fsync. Its file is
//! sealed (see `state/seal.rs`): a file whose labels, spent grants and records checkpoint come
//! from different times is refused at open, and one that holds less than the store wrote to
//! it is refused by [`SqliteStore::snapshot`], which the continuity checks read.

pub mod postgres;
mod seal;

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Mutex;

use rusqlite::{Connection, OptionalExtension, params};

use crate::ident::PrincipalId;
use crate::label::InformationLabel;

/// Why the state store failed. Every caller treats a failure as a refusal.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The database could not be opened or prepared.
    #[error("{path}: cannot open the flow-state database: {source}")]
    Open {
        /// The database file.
        path: PathBuf,
        /// The SQLite error.
        source: rusqlite::Error,
    },
    /// The database file itself could not be opened or inspected.
    #[error("{path}: cannot open the flow-state database file: {source}")]
    File {
        /// The database file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A read or write failed.
    #[error("flow-state database {path}: {source}")]
    Io {
        /// The database file.
        path: PathBuf,
        /// The SQLite error.
        source: rusqlite::Error,
    },
    /// A stored label is not a valid label, or the stored checkpoint no valid checkpoint
    /// (edited by hand, or corrupt).
    #[error("flow-state database {path}: stored value for {key} is invalid: {reason}")]
    Corrupt {
        /// The database file.
        path: PathBuf,
        /// Which principal/session.
        key: String,
        /// The decoding error.
        reason: String,
    },
    /// Another process has the database open (a host on the same state directory, or a
    /// rebuild): two writers would each trust their own copy and overwrite the other's
    /// raises.
    #[error(
        "flow-state database {path} is in use by another process (a host running on this \
         state directory, or a rebuild); one at a time"
    )]
    InUse {
        /// The database file.
        path: PathBuf,
    },
    /// The database path is not a regular file known by that one name (a symbolic link, a
    /// file with other hard links, a directory or device): the one-writer lock is taken on
    /// the name, so a second name would let a second writer overwrite the first's raises.
    #[error(
        "flow-state database {path} {found}; it must be a regular file with no other name \
         (not a link): replace it with the file itself"
    )]
    NotOwnFile {
        /// The database path.
        path: PathBuf,
        /// What it is instead.
        found: String,
    },
    /// The file's labels, spent grants and records checkpoint do not match the seal written
    /// with them: they were read from pages of different times (see [`seal`](self)), so the
    /// checkpoint may vouch for labels the file no longer holds.
    #[error(
        "flow-state database {path} does not match the seal written with its contents: its \
         labels, spent grants and records checkpoint come from different times (an older \
         state.db restored while a later run's {path}-wal was left beside it, or copied over \
         the file of a running host), so its checkpoint may vouch for labels it no longer \
         holds. With the host stopped, rebuild it from the records (`flowhost state rebuild \
         --records RECORDS_DIR --state-dir {state_dir}`, which keeps every label it holds and \
         joins in every label the records prove), or restore a copy together with the -wal \
         file it was taken with, or with none"
    )]
    Unsealed {
        /// The database file.
        path: PathBuf,
        /// Its directory.
        state_dir: PathBuf,
    },
    /// The file holds labels, spent grants or a records checkpoint but no seal: its seal was
    /// removed, or it was written before seals existed.
    #[error(
        "flow-state database {path} holds labels, spent grants or a records checkpoint but no \
         seal: it was removed (and the rows it vouched for may have been changed with it), or \
         the file predates seals. With the host stopped, rebuild it from the records \
         (`flowhost state rebuild --records RECORDS_DIR --state-dir {state_dir}`), which seals \
         what it writes"
    )]
    NoSeal {
        /// The database file.
        path: PathBuf,
        /// Its directory.
        state_dir: PathBuf,
    },
    /// What the file holds differs from what this store wrote to it: it was replaced or
    /// rolled back under the running store (a backup copied over it).
    #[error(
        "flow-state database {path} {found}: the file was replaced or rolled back while this \
         host had it open (a backup copied over it?). It is not bound to the records; with \
         the host stopped, rebuild it from the records (`flowhost state rebuild --records \
         RECORDS_DIR --state-dir {state_dir}`) or restore the newest copy"
    )]
    Replaced {
        /// The database file.
        path: PathBuf,
        /// Its directory.
        state_dir: PathBuf,
        /// What differs (`holds a lower label for principal alice than this host wrote`).
        found: String,
    },
    /// The database's lock file could not be opened or locked.
    #[error("cannot lock the flow-state database: {0}")]
    Lock(crate::records::store::StoreError),
    /// An earlier failure left the store unusable.
    #[error("flow-state store failed earlier and refuses further use: {0}")]
    Failed(String),
    /// The shared PostgreSQL store failed (unreachable, unwritable, wrong schema, bad
    /// settings). Never carries the password.
    #[error(transparent)]
    Postgres(#[from] postgres::PgError),
}

/// A session's identity: the principal and the session id the host assigned.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    /// Who.
    pub principal: PrincipalId,
    /// Which session of theirs.
    pub session: String,
}

/// The labels relevant to one session at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowState {
    /// Everything this principal has ever received.
    pub principal: InformationLabel,
    /// Everything this session has received.
    pub session: InformationLabel,
}

impl FlowState {
    /// The join of both: what an egress from this session may carry.
    pub fn combined(&self) -> InformationLabel {
        self.principal.join_or_top(&self.session)
    }
}

/// Every label a store holds, at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateSnapshot {
    /// Labels by principal.
    pub principals: HashMap<PrincipalId, InformationLabel>,
    /// Labels by session.
    pub sessions: HashMap<SessionKey, InformationLabel>,
}

struct Inner {
    conn: Connection,
    principals: HashMap<PrincipalId, InformationLabel>,
    sessions: HashMap<SessionKey, InformationLabel>,
    /// The seal of what the file holds, as last committed (see [`seal`]).
    seal: seal::Seal,
    failed: Option<String>,
}

/// What a [`StateBackend`] operation returns: a future, so that a networked store never
/// blocks the async worker that awaits it.
pub type StateFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StateError>> + Send + 'a>>;

/// Where the flow state lives. Every implementation guarantees: a label is only ever joined
/// (never lowered), a raise is durable before its future resolves, concurrent raises of one
/// principal's label (from this host or another sharing the store) all survive, and any
/// doubt resolves to an error (which every caller turns into a refusal).
pub trait StateBackend: Send + Sync + std::fmt::Debug {
    /// The current labels of a session (its principal's read from the store itself).
    fn get<'a>(&'a self, key: &'a SessionKey) -> StateFuture<'a, FlowState>;
    /// Joins `principal` into the principal's label and `session` into the session's,
    /// durably, and returns the labels after the join.
    fn raise<'a>(
        &'a self,
        key: &'a SessionKey,
        principal: &'a InformationLabel,
        session: &'a InformationLabel,
    ) -> StateFuture<'a, FlowState>;
    /// Drops an ended session's label (already joined into its principal's).
    fn forget_session<'a>(&'a self, key: &'a SessionKey) -> StateFuture<'a, ()>;
    /// Marks grant `id` used, durably; `false` when it was used before (anywhere the store
    /// is shared).
    fn consume_grant<'a>(&'a self, id: &'a str, now: u64) -> StateFuture<'a, bool>;
    /// Why the store can no longer vouch that a grant was not spent before (it was found to
    /// have lost writes); `None` while it can. Marking a grant spent is still done.
    fn grants_unvouched(&self) -> Option<StateError> {
        None
    }
    /// Every label held: every principal's, and this host's live sessions'.
    fn snapshot(&self) -> StateFuture<'_, StateSnapshot>;
    /// This host's records checkpoint (sequence number and line hash).
    fn checkpoint(&self) -> StateFuture<'_, Option<(u64, String)>>;
    /// Binds this host's state to record `seq` with line hash `hash`, durably.
    fn set_checkpoint<'a>(&'a self, seq: u64, hash: &'a str) -> StateFuture<'a, ()>;
    /// Why the store currently refuses use (`None`: healthy).
    fn failure(&self) -> Option<String>;
    /// Names the store for operators (a file, or a database without its password).
    fn describe(&self) -> String;
}

/// The flow-state store the host uses, over whichever backend is configured.
#[derive(Debug)]
pub struct FlowStateStore {
    backend: Box<dyn StateBackend>,
    /// Set once the store is found not to hold what the records prove (see
    /// [`FlowStateStore::fail`]); never cleared while the host runs.
    failed: std::sync::OnceLock<String>,
    /// The declassification grants this store spent while the host runs: a grant is
    /// refused again from memory before the store is asked, so a file or database that
    /// lost the row (an older copy written over it, a restore, a lagging replica) cannot
    /// accept it a second time before the next check finds the loss. Grows by one id per
    /// grant spent.
    spent: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl FlowStateStore {
    /// Opens the embedded SQLite store at `path` (see [`SqliteStore::open`]).
    pub fn open(path: &Path) -> Result<Self, StateError> {
        Ok(Self::with_backend(Box::new(SqliteStore::open(path)?)))
    }

    /// A store over `backend`.
    pub fn with_backend(backend: Box<dyn StateBackend>) -> Self {
        FlowStateStore {
            backend,
            failed: std::sync::OnceLock::new(),
            spent: std::sync::Mutex::default(),
        }
    }

    /// Refuses every later use of the store, for `reason`: the host found that it does not
    /// hold what the decision records prove (rolled back or replaced under the running host),
    /// so no label read from it can be trusted, and nothing written to it may bind it to the
    /// records. The first reason is kept.
    pub fn fail(&self, reason: String) {
        let _ = self.failed.set(reason);
    }

    fn usable(&self) -> Result<(), StateError> {
        match self.failed.get() {
            Some(why) => Err(StateError::Failed(why.clone())),
            None => Ok(()),
        }
    }

    /// The current labels of a session. A session never seen starts at bottom; its
    /// principal's label applies through [`FlowState::combined`].
    pub async fn get(&self, key: &SessionKey) -> Result<FlowState, StateError> {
        self.usable()?;
        self.backend.get(key).await
    }

    /// Joins `label` into the principal's and the session's labels, durably (see
    /// [`StateBackend::raise`]).
    pub async fn join(
        &self,
        key: &SessionKey,
        label: &InformationLabel,
    ) -> Result<FlowState, StateError> {
        self.usable()?;
        self.backend.raise(key, label, label).await
    }

    /// Joins `principal` and `session` into the two labels, durably.
    pub async fn raise(
        &self,
        key: &SessionKey,
        principal: &InformationLabel,
        session: &InformationLabel,
    ) -> Result<FlowState, StateError> {
        self.usable()?;
        self.backend.raise(key, principal, session).await
    }

    /// Drops an ended session (its label already lives in its principal's).
    pub async fn forget_session(&self, key: &SessionKey) -> Result<(), StateError> {
        self.usable()?;
        self.backend.forget_session(key).await
    }

    /// Marks declassification grant `id` used, durably; `Ok(false)` for a replay.
    pub async fn consume_grant(&self, id: &str, now: u64) -> Result<bool, StateError> {
        self.usable()?;
        // The set only grows, so a panic elsewhere while it was held left nothing half-done.
        let spent_here = || {
            self.spent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if spent_here().contains(id) {
            return Ok(false);
        }
        if let Some(e) = self.backend.grants_unvouched() {
            return Err(e);
        }
        let spent = self.backend.consume_grant(id, now).await?;
        if spent {
            spent_here().insert(id.to_string());
        }
        Ok(spent)
    }

    /// Marks grant `id` spent in the store itself, whatever this run remembers: what the
    /// continuity check does for each grant the records show spent. Whether the store
    /// lacked it (it lost the row: the check reports that).
    pub async fn mark_grant_spent(&self, id: &str, now: u64) -> Result<bool, StateError> {
        self.usable()?;
        let lacked = self.backend.consume_grant(id, now).await?;
        self.spent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.to_string());
        Ok(lacked)
    }

    /// Every label held.
    pub async fn snapshot(&self) -> Result<StateSnapshot, StateError> {
        self.usable()?;
        self.backend.snapshot().await
    }

    /// This host's records checkpoint.
    pub async fn checkpoint(&self) -> Result<Option<(u64, String)>, StateError> {
        self.usable()?;
        self.backend.checkpoint().await
    }

    /// Binds this host's state to record `seq` (line hash `hash`), durably.
    pub async fn set_checkpoint(&self, seq: u64, hash: &str) -> Result<(), StateError> {
        self.usable()?;
        self.backend.set_checkpoint(seq, hash).await
    }

    /// Why the store refuses use at the moment (`None`: healthy).
    pub fn failure(&self) -> Option<String> {
        self.failed
            .get()
            .cloned()
            .or_else(|| self.backend.failure())
    }

    /// Why every grant is refused until the host restarts (the store was found to have
    /// lost writes, so it cannot vouch that a grant was not spent before); `None` while
    /// grants are honoured.
    pub fn grants_refused(&self) -> Option<String> {
        self.backend.grants_unvouched().map(|e| e.to_string())
    }

    /// Names the store for operators.
    pub fn describe(&self) -> String {
        self.backend.describe()
    }
}

impl StateBackend for SqliteStore {
    fn get<'a>(&'a self, key: &'a SessionKey) -> StateFuture<'a, FlowState> {
        Box::pin(std::future::ready(SqliteStore::get(self, key)))
    }
    fn raise<'a>(
        &'a self,
        key: &'a SessionKey,
        principal: &'a InformationLabel,
        session: &'a InformationLabel,
    ) -> StateFuture<'a, FlowState> {
        Box::pin(std::future::ready(SqliteStore::raise(
            self, key, principal, session,
        )))
    }
    fn forget_session<'a>(&'a self, key: &'a SessionKey) -> StateFuture<'a, ()> {
        Box::pin(std::future::ready(SqliteStore::forget_session(self, key)))
    }
    fn consume_grant<'a>(&'a self, id: &'a str, now: u64) -> StateFuture<'a, bool> {
        Box::pin(std::future::ready(SqliteStore::consume_grant(
            self, id, now,
        )))
    }
    fn snapshot(&self) -> StateFuture<'_, StateSnapshot> {
        Box::pin(std::future::ready(SqliteStore::snapshot(self)))
    }
    fn checkpoint(&self) -> StateFuture<'_, Option<(u64, String)>> {
        Box::pin(std::future::ready(SqliteStore::checkpoint(self)))
    }
    fn set_checkpoint<'a>(&'a self, seq: u64, hash: &'a str) -> StateFuture<'a, ()> {
        Box::pin(std::future::ready(SqliteStore::set_checkpoint(
            self, seq, hash,
        )))
    }
    fn failure(&self) -> Option<String> {
        SqliteStore::failure(self)
    }
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// The embedded SQLite store: one file per host. Thread-safe; writes are serialized. Its
/// operations run on the caller's thread (a local fsync, as before the store had backends).
pub struct SqliteStore {
    path: PathBuf,
    inner: Mutex<Inner>,
    /// Held while the store is open: it trusts its in-memory copy of every label, which
    /// only holds while no other process writes the database.
    _lock: nix::fcntl::Flock<std::fs::File>,
    /// The database file as checked at open, held as long as the connection: closing any
    /// descriptor of the file releases every POSIX lock this process holds on it, SQLite's
    /// included, after which another process's SQLite would take itself for the last user
    /// and remove the write-ahead log this connection still writes to.
    _file: std::fs::File,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

fn decode(path: &Path, key: &str, text: &str) -> Result<InformationLabel, StateError> {
    InformationLabel::from_json(text).map_err(|e| StateError::Corrupt {
        path: path.to_path_buf(),
        key: key.to_string(),
        reason: e.to_string(),
    })
}

/// Opens (creating it when missing) the database file at `path` itself and gives it mode
/// 0600, refusing a path that is not a regular file known by that name alone (see
/// [`StateError::NotOwnFile`]): the lock beside it is what keeps a second writer out, and it
/// only can while the file has one name. The final component is never followed
/// (`O_NOFOLLOW`), and a FIFO never blocks the open.
fn open_own_file(path: &Path) -> Result<std::fs::File, StateError> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let not_own = |found: &str| StateError::NotOwnFile {
        path: path.to_path_buf(),
        found: found.to_string(),
    };
    let failed = |source| StateError::File {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => not_own("is a symbolic link"),
            Some(libc::EISDIR) => not_own("is not a regular file (a directory)"),
            _ => failed(e),
        })?;
    let meta = file.metadata().map_err(failed)?;
    if !meta.file_type().is_file() {
        return Err(not_own("is not a regular file"));
    }
    if meta.nlink() != 1 {
        return Err(not_own(&format!(
            "has {} names (hard links), so another name could be opened by another writer",
            meta.nlink()
        )));
    }
    restrict_to_owner(&file, path)?;
    Ok(file)
}

/// Gives `file` (at `path`) mode 0600: the state files hold every principal's label, and are
/// created under the process's umask (the lock file, and SQLite's files too when the
/// database file is not created here), or were left wider by an earlier run.
fn restrict_to_owner(file: &std::fs::File, path: &Path) -> Result<(), StateError> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(|source| StateError::File {
            path: path.to_path_buf(),
            source,
        })
}

/// Gives the write-ahead log and shared-memory files of database `db` mode 0600 where they
/// exist (SQLite creates them with the database file's mode, which is 0600, but an earlier
/// run may have left them wider). Never follows a symbolic link.
fn restrict_wal_files(db: &Path) -> Result<(), StateError> {
    use std::os::unix::fs::OpenOptionsExt;
    for suffix in ["-wal", "-shm"] {
        let mut name = db.as_os_str().to_owned();
        name.push(suffix);
        let path = Path::new(&name);
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)
        {
            Ok(file) => restrict_to_owner(&file, path)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(StateError::File {
                    path: path.to_path_buf(),
                    source,
                });
            }
        }
    }
    Ok(())
}

/// Refuses when `path` no longer names `file` (replaced after it was checked).
fn same_file(path: &Path, file: &std::fs::File) -> Result<(), StateError> {
    let named = crate::files::still_names(path, file).map_err(|source| StateError::File {
        path: path.to_path_buf(),
        source,
    })?;
    if !named {
        return Err(StateError::NotOwnFile {
            path: path.to_path_buf(),
            found: "was replaced while it was being opened".into(),
        });
    }
    Ok(())
}

/// Every principal's label stored in `conn` (the database at `path`); `failed` names a
/// read that fails.
/// Whether reading a state file failed because it holds no flow state at all: not SQLite,
/// or without the store's tables.
/// Whether `e` is a cell of a type or value the store's schema never holds (NULL where it
/// writes text, text where it writes an integer): no passing fault, since this store could
/// not have written it.
fn unfit_cell(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::InvalidColumnType(..)
            | rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::IntegralValueOutOfRange(..)
    )
}

/// Whether SQLite reads the file as damaged: pages that do not fit together, as when
/// another database is copied over the file in place while its write-ahead log lives, or
/// the file is cut short. No passing fault: reading it again reads the same pages.
fn damaged(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DatabaseCorrupt)
}

fn no_state_in(e: &rusqlite::Error) -> bool {
    let missing = |m: &str| m.starts_with("no such table") || m.starts_with("no such column");
    match e {
        rusqlite::Error::SqliteFailure(f, message) => {
            f.code == rusqlite::ErrorCode::NotADatabase || message.as_deref().is_some_and(missing)
        }
        // How a statement naming what the database lacks is reported when it is prepared.
        rusqlite::Error::SqlInputError { msg, .. } => missing(msg),
        _ => false,
    }
}

fn load_principals(
    conn: &Connection,
    path: &Path,
    failed: impl Fn(rusqlite::Error) -> StateError,
) -> Result<HashMap<PrincipalId, InformationLabel>, StateError> {
    let mut principals = HashMap::new();
    let mut stmt = conn
        .prepare("SELECT principal, label FROM principal_labels")
        .map_err(&failed)?;
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .map_err(&failed)?;
    for row in rows {
        let (p, label) = row.map_err(&failed)?;
        let principal = PrincipalId::new(&p).map_err(|e| StateError::Corrupt {
            path: path.to_path_buf(),
            key: p.clone(),
            reason: e.to_string(),
        })?;
        principals.insert(principal, decode(path, &p, &label)?);
    }
    Ok(principals)
}

/// The records checkpoint stored in `conn`.
fn load_checkpoint(conn: &Connection) -> rusqlite::Result<Option<(i64, String)>> {
    conn.query_row(
        "SELECT seq, hash FROM records_checkpoint WHERE id = 1",
        [],
        |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)),
    )
    .optional()
}

/// The seal of what `conn` holds: `principals` (read from it), and its spent grants and
/// records checkpoint.
fn seal_of(
    conn: &Connection,
    principals: &HashMap<PrincipalId, InformationLabel>,
) -> rusqlite::Result<seal::Seal> {
    let mut sealed = seal::Seal::default();
    let bottom = InformationLabel::bottom();
    for (principal, label) in principals {
        sealed.relabel(principal, &bottom, label);
    }
    let mut stmt = conn.prepare("SELECT grant_id FROM consumed_grants")?;
    for id in stmt.query_map([], |r| r.get::<_, String>(0))? {
        sealed.spend(&id?);
    }
    if let Some((seq, hash)) = load_checkpoint(conn)? {
        sealed.rebind(None, (seq, &hash));
    }
    Ok(sealed)
}

/// Writes `sealed` as the seal of what the transaction leaves in the file.
fn store_seal(conn: &Connection, sealed: seal::Seal) -> rusqlite::Result<()> {
    conn.execute(
        "INSERT INTO state_seal (id, digest) VALUES (1, ?1)
         ON CONFLICT(id) DO UPDATE SET digest = excluded.digest",
        params![sealed.to_hex()],
    )?;
    Ok(())
}

/// Whether [`SqliteStore::open`] checks the seal (every open but a rebuild's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SealMode {
    /// Refuse a file whose contents do not match its seal.
    Check,
    /// Seal what the file holds (a rebuild, which joins every recorded label into it).
    Renew,
}

/// Takes the exclusive lock of database `db` (`flock` on `DB.lock` beside it), waiting up
/// to 2 s for a process that is just closing it.
fn lock_exclusively(db: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, StateError> {
    use crate::records::store::{Locked, lock_within};
    let mut name = db.as_os_str().to_owned();
    name.push(".lock");
    match lock_within(
        Path::new(&name),
        true,
        true,
        std::time::Duration::from_secs(2),
    ) {
        Ok(Locked::Held(held)) => {
            restrict_to_owner(&held, Path::new(&name))?;
            Ok(held)
        }
        // Made when missing, so never absent.
        Ok(Locked::Busy | Locked::Absent) => Err(StateError::InUse {
            path: db.to_path_buf(),
        }),
        Err(e) => Err(StateError::Lock(e)),
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` and loads every stored label. A
    /// corrupt label stops the open: the host must not start with state it cannot read. So
    /// does a path that is a symbolic link, a file with other hard links, or no regular file
    /// ([`StateError::NotOwnFile`]): the one-writer lock is kept per name. So does a file
    /// whose labels, spent grants and records checkpoint do not match the seal written with
    /// them ([`StateError::Unsealed`]): read from pages of different times, its checkpoint
    /// could vouch for labels it no longer holds. A file that holds something but no seal is
    /// refused too ([`StateError::NoSeal`]); a new, empty one is sealed.
    pub fn open(path: &Path) -> Result<Self, StateError> {
        Self::open_sealed(path, SealMode::Check)
    }

    /// Opens the database at `path` like [`SqliteStore::open`], but seals what it holds
    /// instead of checking it: for `flowhost state rebuild`, which then joins every label
    /// the records prove into it, whatever times its pages come from.
    pub fn open_to_rebuild(path: &Path) -> Result<Self, StateError> {
        Self::open_sealed(path, SealMode::Renew)
    }

    fn open_sealed(path: &Path, mode: SealMode) -> Result<Self, StateError> {
        let open_err = |source| StateError::Open {
            path: path.to_path_buf(),
            source,
        };
        let lock = lock_exclusively(path)?;
        let file = open_own_file(path)?;
        restrict_wal_files(path)?;
        let conn = Connection::open(path).map_err(open_err)?;
        // SQLite opened the file by its name again: still the file checked, not one put in
        // its place meanwhile.
        same_file(path, &file)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(open_err)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(open_err)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS principal_labels (
                 principal TEXT PRIMARY KEY NOT NULL,
                 label     TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS session_labels (
                 principal TEXT NOT NULL,
                 session   TEXT NOT NULL,
                 label     TEXT NOT NULL,
                 PRIMARY KEY (principal, session)
             );
             CREATE TABLE IF NOT EXISTS consumed_grants (
                 grant_id    TEXT PRIMARY KEY NOT NULL,
                 consumed_at INTEGER NOT NULL
             );
             CREATE TABLE IF NOT EXISTS records_checkpoint (
                 id   INTEGER PRIMARY KEY CHECK (id = 1),
                 seq  INTEGER NOT NULL,
                 hash TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS state_seal (
                 id     INTEGER PRIMARY KEY CHECK (id = 1),
                 digest TEXT NOT NULL
             );",
        )
        .map_err(open_err)?;
        // Sessions are connections: none survives a restart, and every session's label is
        // already joined into its principal's. Their rows are compacted away at open.
        conn.execute("DELETE FROM session_labels", [])
            .map_err(open_err)?;
        let principals = load_principals(&conn, path, open_err)?;
        let mut sealed = seal_of(&conn, &principals).map_err(open_err)?;
        let stored: Option<String> = conn
            .query_row("SELECT digest FROM state_seal WHERE id = 1", [], |r| {
                r.get(0)
            })
            .optional()
            .map_err(open_err)?;
        match (mode, stored) {
            (SealMode::Check, Some(stored)) if stored == sealed.to_hex() => {}
            (SealMode::Check, Some(_)) => {
                return Err(StateError::Unsealed {
                    path: path.to_path_buf(),
                    state_dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
                });
            }
            // A file holding something without a seal: its seal was removed (with rows
            // changed behind it, perhaps), or it predates seals. Only a rebuild seals it.
            (SealMode::Check, None) if sealed != seal::Seal::default() => {
                return Err(StateError::NoSeal {
                    path: path.to_path_buf(),
                    state_dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
                });
            }
            // A new, empty file.
            (SealMode::Check, None) => {
                store_seal(&conn, sealed).map_err(open_err)?;
            }
            // A rebuild seals what the file holds, but binds it to no record: until the
            // rebuild has raised every label the records prove and bound the state to their
            // head, the state vouches for nothing, so a rebuild cut short leaves a state the
            // next start checks against every record rather than one sealed as current.
            (SealMode::Renew, _) => {
                let tx = conn.unchecked_transaction().map_err(open_err)?;
                tx.execute("DELETE FROM records_checkpoint", [])
                    .map_err(open_err)?;
                sealed = seal_of(&tx, &principals).map_err(open_err)?;
                store_seal(&tx, sealed).map_err(open_err)?;
                tx.commit().map_err(open_err)?;
            }
        }
        let mut sessions = HashMap::new();
        {
            let mut stmt = conn
                .prepare("SELECT principal, session, label FROM session_labels")
                .map_err(open_err)?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                    ))
                })
                .map_err(open_err)?;
            for row in rows {
                let (p, s, label) = row.map_err(open_err)?;
                let key = format!("{p}/{s}");
                let principal = PrincipalId::new(&p).map_err(|e| StateError::Corrupt {
                    path: path.to_path_buf(),
                    key: key.clone(),
                    reason: e.to_string(),
                })?;
                sessions.insert(
                    SessionKey {
                        principal,
                        session: s,
                    },
                    decode(path, &key, &label)?,
                );
            }
        }
        Ok(SqliteStore {
            _lock: lock,
            _file: file,
            path: path.to_path_buf(),
            inner: Mutex::new(Inner {
                conn,
                principals,
                sessions,
                seal: sealed,
                failed: None,
            }),
        })
    }

    /// A write failed: the store refuses every later use (fail closed), and the error names
    /// the database.
    fn poison(&self, inner: &mut Inner, source: rusqlite::Error) -> StateError {
        inner.failed = Some(source.to_string());
        StateError::Io {
            path: self.path.clone(),
            source,
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>, StateError> {
        let inner = self
            .inner
            .lock()
            .map_err(|_| StateError::Failed("a writer panicked while holding the store".into()))?;
        if let Some(why) = &inner.failed {
            return Err(StateError::Failed(why.clone()));
        }
        Ok(inner)
    }

    /// The current labels of a session. A session never seen starts at bottom; its
    /// principal's label applies through [`FlowState::combined`].
    pub fn get(&self, key: &SessionKey) -> Result<FlowState, StateError> {
        let inner = self.lock()?;
        Ok(FlowState {
            principal: inner
                .principals
                .get(&key.principal)
                .cloned()
                .unwrap_or_else(InformationLabel::bottom),
            session: inner
                .sessions
                .get(key)
                .cloned()
                .unwrap_or_else(InformationLabel::bottom),
        })
    }

    /// Joins `label` into the principal's and the session's labels (a join that overflows
    /// the label limits becomes `Top`) and makes any change durable before returning the new
    /// state. A write failure poisons the store: every later call fails (fail closed).
    pub fn join(
        &self,
        key: &SessionKey,
        label: &InformationLabel,
    ) -> Result<FlowState, StateError> {
        self.raise(key, label, label)
    }

    /// Joins `principal` into the principal's label and `session` into the session's label,
    /// durably, like [`SqliteStore::join`] (used to rebuild state from records, where
    /// each side's label is known on its own).
    pub fn raise(
        &self,
        key: &SessionKey,
        principal: &InformationLabel,
        session: &InformationLabel,
    ) -> Result<FlowState, StateError> {
        let mut inner = self.lock()?;
        let old_p = inner
            .principals
            .get(&key.principal)
            .cloned()
            .unwrap_or_else(InformationLabel::bottom);
        let old_s = inner
            .sessions
            .get(key)
            .cloned()
            .unwrap_or_else(InformationLabel::bottom);
        let new_p = old_p.join_or_top(principal);
        let new_s = old_s.join_or_top(session);
        if new_p == old_p && new_s == old_s {
            return Ok(FlowState {
                principal: new_p,
                session: new_s,
            });
        }
        let mut sealed = inner.seal;
        let result = (|| -> rusqlite::Result<()> {
            let tx = inner.conn.transaction()?;
            if new_p != old_p {
                tx.execute(
                    "INSERT INTO principal_labels (principal, label) VALUES (?1, ?2)
                     ON CONFLICT(principal) DO UPDATE SET label = excluded.label",
                    params![key.principal.as_str(), new_p.to_canonical_json()],
                )?;
                sealed.relabel(&key.principal, &old_p, &new_p);
                store_seal(&tx, sealed)?;
            }
            if new_s != old_s {
                tx.execute(
                    "INSERT INTO session_labels (principal, session, label) VALUES (?1, ?2, ?3)
                     ON CONFLICT(principal, session) DO UPDATE SET label = excluded.label",
                    params![
                        key.principal.as_str(),
                        key.session,
                        new_s.to_canonical_json()
                    ],
                )?;
            }
            tx.commit()
        })();
        result.map_err(|source| self.poison(&mut inner, source))?;
        inner.seal = sealed;
        inner
            .principals
            .insert(key.principal.clone(), new_p.clone());
        inner.sessions.insert(key.clone(), new_s.clone());
        Ok(FlowState {
            principal: new_p,
            session: new_s,
        })
    }

    /// Joins `label` into a principal's label alone, durably (rebuilding from records).
    pub fn raise_principal(
        &self,
        principal: &PrincipalId,
        label: &InformationLabel,
    ) -> Result<InformationLabel, StateError> {
        let key = SessionKey {
            principal: principal.clone(),
            session: String::new(),
        };
        let state = self.raise(&key, label, &InformationLabel::bottom())?;
        self.forget_session(&key)?;
        Ok(state.principal)
    }

    /// Drops a session that has ended: it can never be resumed, and its label is already
    /// joined into its principal's (every raise goes into both), so nothing is lowered.
    pub fn forget_session(&self, key: &SessionKey) -> Result<(), StateError> {
        let mut inner = self.lock()?;
        if inner.sessions.remove(key).is_none() {
            return Ok(());
        }
        let result = inner.conn.execute(
            "DELETE FROM session_labels WHERE principal = ?1 AND session = ?2",
            params![key.principal.as_str(), key.session],
        );
        result.map_err(|source| self.poison(&mut inner, source))?;
        Ok(())
    }

    /// Marks declassification grant `id` used, durably. `Ok(false)`: it was used before (a
    /// replay). Single use survives restarts because it lives with the flow state.
    pub fn consume_grant(&self, id: &str, now: u64) -> Result<bool, StateError> {
        let mut inner = self.lock()?;
        let now = i64::try_from(now).unwrap_or(i64::MAX);
        let mut sealed = inner.seal;
        let result = (|| -> rusqlite::Result<bool> {
            let tx = inner.conn.transaction()?;
            let spent = tx.execute(
                "INSERT INTO consumed_grants (grant_id, consumed_at) VALUES (?1, ?2)
                 ON CONFLICT(grant_id) DO NOTHING",
                params![id, now],
            )? == 1;
            if spent {
                sealed.spend(id);
                store_seal(&tx, sealed)?;
            }
            tx.commit()?;
            Ok(spent)
        })();
        let spent = result.map_err(|source| self.poison(&mut inner, source))?;
        inner.seal = sealed;
        Ok(spent)
    }

    /// Why the store refuses further use, once a write failed (`None`: healthy).
    pub fn failure(&self) -> Option<String> {
        match self.inner.lock() {
            Ok(inner) => inner.failed.clone(),
            Err(_) => Some("a writer panicked while holding the store".into()),
        }
    }

    /// Every stored label: the principals' as the file holds them now, read afresh (what
    /// the next open would load, which is what the continuity checks judge: a file replaced
    /// or rolled back under the running store shows here, where the store's own copy and
    /// its connection's cache would hide it), and this run's sessions.
    ///
    /// A file that holds anything other than what this store wrote to it (a principal's
    /// label lower than the store holds, or other spent grants or another checkpoint) was
    /// replaced or rolled back under it: that is refused ([`StateError::Replaced`]) and
    /// fails the store, since its checkpoint may vouch for labels the file no longer holds.
    pub fn snapshot(&self) -> Result<StateSnapshot, StateError> {
        let mut inner = self.lock()?;
        let io = |source| StateError::Io {
            path: self.path.clone(),
            source,
        };
        // A file gone, emptied or no longer a flow-state database under the running store
        // is no passing fault to retry: what it held lives on only in this process, and the
        // next start would find nothing to check the records against.
        let gone = match std::fs::symlink_metadata(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Some("is gone (deleted or renamed away)")
            }
            Ok(m) if !m.is_file() => Some("is no longer a regular file"),
            Ok(m) if m.len() == 0 => Some("is empty"),
            _ => None,
        };
        if let Some(found) = gone {
            return Err(self.replaced(&mut inner, found.into()));
        }
        let fresh = Connection::open_with_flags(
            &self.path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(io)?;
        let not_a_state = "is no flow-state database (its tables are gone, or it is not SQLite)";
        let damaged_file = |e: &rusqlite::Error| {
            format!("reads as damaged ({e}): another file copied over it in place, or cut short")
        };
        let principals = match load_principals(&fresh, &self.path, io) {
            Err(StateError::Io { source, .. }) if no_state_in(&source) => {
                return Err(self.replaced(&mut inner, not_a_state.into()));
            }
            Err(StateError::Io { source, .. }) if damaged(&source) => {
                return Err(self.replaced(&mut inner, damaged_file(&source)));
            }
            Err(StateError::Io { source, .. }) if unfit_cell(&source) => {
                return Err(self.replaced(
                    &mut inner,
                    format!("holds a cell this store never writes ({source})"),
                ));
            }
            // A row this host wrote always decodes: one that does not was written by
            // another hand (or another format), and retrying reads it again.
            Err(StateError::Corrupt { key, reason, .. }) => {
                return Err(self.replaced(
                    &mut inner,
                    format!("holds a row that does not decode ({key}: {reason})"),
                ));
            }
            read => read?,
        };
        let seal = match seal_of(&fresh, &principals) {
            Err(e) if no_state_in(&e) => {
                return Err(self.replaced(&mut inner, not_a_state.into()));
            }
            Err(e) if damaged(&e) => {
                return Err(self.replaced(&mut inner, damaged_file(&e)));
            }
            Err(e) if unfit_cell(&e) => {
                return Err(self.replaced(
                    &mut inner,
                    format!("holds a cell this store never writes ({e})"),
                ));
            }
            seal => seal.map_err(io)?,
        };
        let bottom = InformationLabel::bottom();
        let lowered = inner
            .principals
            .iter()
            .filter(|(p, held)| !held.flows_to(principals.get(*p).unwrap_or(&bottom)))
            .map(|(p, _)| p.as_str())
            .min();
        let found = match lowered {
            Some(p) => Some(format!(
                "holds a lower label for principal {p} than this host wrote to it"
            )),
            None if seal != inner.seal => Some(
                "holds other labels, spent grants or records checkpoint than this host wrote to it"
                    .into(),
            ),
            None => None,
        };
        if let Some(found) = found {
            return Err(self.replaced(&mut inner, found));
        }
        Ok(StateSnapshot {
            principals,
            sessions: inner.sessions.clone(),
        })
    }

    /// The file was replaced, rolled back or removed under the store (`found` says how):
    /// the store fails, and stays failed while the host runs.
    fn replaced(&self, inner: &mut Inner, found: String) -> StateError {
        let err = StateError::Replaced {
            path: self.path.clone(),
            state_dir: self.path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            found,
        };
        inner.failed = Some(err.to_string());
        tracing::error!(error = %err, "the flow-state file changed under the running host");
        err
    }

    /// The decision record this state was last proven against: its sequence number and
    /// line hash (`None` for a state never bound to records).
    pub fn checkpoint(&self) -> Result<Option<(u64, String)>, StateError> {
        let inner = self.lock()?;
        load_checkpoint(&inner.conn)
            .map_err(|source| StateError::Io {
                path: self.path.clone(),
                source,
            })
            .and_then(|row| {
                row.map(|(seq, hash)| {
                    // A negative number is no record's: the file was edited or is corrupt.
                    let seq = u64::try_from(seq).map_err(|_| StateError::Corrupt {
                        path: self.path.clone(),
                        key: "(the records checkpoint)".into(),
                        reason: format!("a negative sequence number ({seq})"),
                    })?;
                    Ok((seq, hash))
                })
                .transpose()
            })
    }

    /// Binds the state to record `seq` (line hash `hash`), durably: every label the records
    /// up to it prove is held here.
    pub fn set_checkpoint(&self, seq: u64, hash: &str) -> Result<(), StateError> {
        let mut inner = self.lock()?;
        let seq = i64::try_from(seq).unwrap_or(i64::MAX);
        let mut sealed = inner.seal;
        let result = (|| -> rusqlite::Result<()> {
            let tx = inner.conn.transaction()?;
            let old = load_checkpoint(&tx)?;
            tx.execute(
                "INSERT INTO records_checkpoint (id, seq, hash) VALUES (1, ?1, ?2)
                 ON CONFLICT(id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash",
                params![seq, hash],
            )?;
            sealed.rebind(old.as_ref().map(|(s, h)| (*s, h.as_str())), (seq, hash));
            store_seal(&tx, sealed)?;
            tx.commit()
        })();
        result.map_err(|source| self.poison(&mut inner, source))?;
        inner.seal = sealed;
        Ok(())
    }

    /// The label stored for a principal, read from disk (for tests and audits).
    pub fn stored_principal_label(
        &self,
        principal: &PrincipalId,
    ) -> Result<Option<InformationLabel>, StateError> {
        let inner = self.lock()?;
        let text: Option<String> = inner
            .conn
            .query_row(
                "SELECT label FROM principal_labels WHERE principal = ?1",
                params![principal.as_str()],
                |r| r.get(0),
            )
            .optional()
            .map_err(|source| StateError::Io {
                path: self.path.clone(),
                source,
            })?;
        text.map(|t| decode(&self.path, principal.as_str(), &t))
            .transpose()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    /// SQLite's own lock on the database outlives the open: the descriptor flowhost opened
    /// to check the file is kept, since closing it would release every lock this process
    /// holds on the file.
    #[test]
    fn sqlites_lock_on_the_database_is_held_after_open() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let store = SqliteStore::open(&path).unwrap();
        let inode = std::fs::metadata(&path).unwrap().ino();
        let me = std::process::id().to_string();
        let locks = std::fs::read_to_string("/proc/locks").unwrap();
        let held = locks.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(1) == Some(&"POSIX")
                && f.get(4) == Some(&me.as_str())
                && f.get(5)
                    .and_then(|d| d.rsplit(':').next())
                    .is_some_and(|i| i == inode.to_string())
        });
        assert!(held, "no POSIX lock of pid {me} on inode {inode}:\n{locks}");
        drop(store);
    }

    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// A negative checkpoint sequence number is no record's: the stored checkpoint is
    /// corrupt (before, it was read as record 0, which PostgreSQL's store refuses).
    #[test]
    fn a_negative_checkpoint_is_corrupt_not_record_zero() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let store = SqliteStore::open(&db).unwrap();
        store.set_checkpoint(3, "sha256:x").unwrap();
        let raw = rusqlite::Connection::open(&db).unwrap();
        raw.execute("UPDATE records_checkpoint SET seq = -5", [])
            .unwrap();
        let err = store.checkpoint().unwrap_err();
        assert!(matches!(err, StateError::Corrupt { .. }), "{err:?}");
        assert!(
            err.to_string().contains("negative sequence number (-5)"),
            "{err}"
        );
        drop(raw);
    }

    /// A second process on the same state file would trust its own copy of every label and
    /// overwrite the first's raises: it is refused while the first has the file open.
    #[test]
    fn one_store_at_a_time_has_the_database_open() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let first = SqliteStore::open(&db).unwrap();
        let err = SqliteStore::open(&db).unwrap_err();
        assert!(matches!(err, StateError::InUse { .. }), "{err:?}");
        assert!(
            err.to_string().contains("in use by another process"),
            "{err}"
        );
        drop(first);
        SqliteStore::open(&db).unwrap();
    }

    /// A store found not to hold what the records prove refuses every use from then on, and
    /// says why: a label read from it, or a checkpoint written to it, would vouch for it.
    #[tokio::test]
    async fn a_failed_store_refuses_every_use_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let store = FlowStateStore::open(&dir.path().join("state.db")).unwrap();
        let k = key("alice", "s-1");
        let l = owner("larkfield");
        store.join(&k, &l).await.unwrap();
        assert_eq!(store.failure(), None);
        store.fail("rolled back under the host".into());
        store.fail("a second reason is not kept".into());
        let refused = |r: Result<(), StateError>| match r {
            Err(StateError::Failed(why)) => assert_eq!(why, "rolled back under the host"),
            other => panic!("not refused: {other:?}"),
        };
        refused(store.get(&k).await.map(drop));
        refused(store.join(&k, &l).await.map(drop));
        refused(store.raise(&k, &l, &l).await.map(drop));
        refused(store.forget_session(&k).await);
        refused(store.consume_grant("g-1", 1).await.map(drop));
        refused(store.snapshot().await.map(drop));
        refused(store.checkpoint().await.map(drop));
        refused(store.set_checkpoint(1, "sha256:00").await);
        assert_eq!(
            store.failure().as_deref(),
            Some("rolled back under the host")
        );
    }

    /// The label of data owned by `o`, readable by `o` alone.
    pub(crate) fn owner(o: &str) -> InformationLabel {
        let o = PrincipalId::new(o).unwrap();
        InformationLabel::try_known(
            BTreeMap::from([(o.clone(), BTreeSet::from([o]))]),
            BTreeSet::new(),
        )
        .unwrap()
    }

    pub(crate) fn key(p: &str, s: &str) -> SessionKey {
        SessionKey {
            principal: PrincipalId::new(p).unwrap(),
            session: s.into(),
        }
    }

    #[test]
    fn labels_grow_persist_and_follow_the_principal() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        {
            let store = SqliteStore::open(&db).unwrap();
            assert!(
                store
                    .get(&key("alice", "s1"))
                    .unwrap()
                    .combined()
                    .is_bottom()
            );
            store
                .join(&key("alice", "s1"), &owner("larkfield"))
                .unwrap();
            // Joining bottom never lowers anything.
            let st = store
                .join(&key("alice", "s1"), &InformationLabel::bottom())
                .unwrap();
            assert_eq!(st.session, owner("larkfield"));
            // A new session of the same principal carries the principal's taint.
            assert_eq!(
                store.get(&key("alice", "s2")).unwrap().combined(),
                owner("larkfield")
            );
            // Another principal is untouched.
            assert!(store.get(&key("bob", "s9")).unwrap().combined().is_bottom());
        }
        let store = SqliteStore::open(&db).unwrap();
        // After a restart the session is gone (compacted), its label lives on in alice's.
        assert_eq!(
            store.get(&key("alice", "s1")).unwrap().combined(),
            owner("larkfield")
        );
        assert_eq!(
            store
                .stored_principal_label(&PrincipalId::new("alice").unwrap())
                .unwrap(),
            Some(owner("larkfield"))
        );
    }

    #[test]
    fn ended_sessions_are_compacted_into_their_principal() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let store = SqliteStore::open(&db).unwrap();
        for i in 0..100 {
            store
                .join(&key("alice", &format!("s{i}")), &owner("larkfield"))
                .unwrap();
        }
        // Two sessions still live at a crash: their rows are compacted at the next open.
        for i in 2..100 {
            store
                .forget_session(&key("alice", &format!("s{i}")))
                .unwrap();
        }
        assert_eq!(store.snapshot().unwrap().sessions.len(), 2);
        drop(store);
        let rows = |db: &Path| -> i64 {
            Connection::open(db)
                .unwrap()
                .query_row("SELECT count(*) FROM session_labels", [], |r| r.get(0))
                .unwrap()
        };
        assert_eq!(rows(&db), 2);
        let store = SqliteStore::open(&db).unwrap();
        assert_eq!(rows(&db), 0);
        assert!(store.snapshot().unwrap().sessions.is_empty());
        // Nothing was lowered: every new session of alice carries what the old ones had.
        assert_eq!(
            store.get(&key("alice", "new")).unwrap().combined(),
            owner("larkfield")
        );
    }

    #[test]
    fn a_consumed_grant_stays_consumed_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let store = SqliteStore::open(&db).unwrap();
        assert!(store.consume_grant("g-1", 100).unwrap());
        assert!(!store.consume_grant("g-1", 101).unwrap(), "a replay");
        drop(store);
        let store = SqliteStore::open(&db).unwrap();
        assert!(
            !store.consume_grant("g-1", 102).unwrap(),
            "a replay after a restart"
        );
        assert!(store.consume_grant("g-2", 102).unwrap());
    }

    /// Puts a database made by `statements` in the place of the store's file `db`.
    fn replace_with(db: &Path, statements: &[&str]) {
        let other = db.with_extension("other");
        let c = rusqlite::Connection::open(&other).unwrap();
        for statement in statements {
            c.execute(statement, []).unwrap();
        }
        drop(c);
        for side in ["state.db-wal", "state.db-shm"] {
            let _ = std::fs::remove_file(db.with_file_name(side));
        }
        std::fs::rename(&other, db).unwrap();
    }

    /// A state file deleted, emptied or replaced by a database without the store's tables
    /// while the store runs fails the store, as a rolled-back one does. Before, each was an I/O
    /// error the host logged and tried again at the next check, reporting its state healthy
    /// while it lived only in this process.
    #[test]
    fn a_state_file_gone_under_the_store_fails_it() {
        for (name, undo) in [
            (
                "deleted",
                (|db: &Path| std::fs::remove_file(db).unwrap()) as fn(&Path),
            ),
            ("emptied", |db: &Path| std::fs::write(db, b"").unwrap()),
            // The labels table as it was, the rest of the store's tables gone: before, the
            // seal's read failed as an I/O error, retried at every check.
            ("a database with the labels alone", |db: &Path| {
                let other = db.with_extension("other");
                let c = rusqlite::Connection::open(&other).unwrap();
                c.execute(
                    "CREATE TABLE principal_labels (principal TEXT PRIMARY KEY, label TEXT)",
                    [],
                )
                .unwrap();
                drop(c);
                for side in ["state.db-wal", "state.db-shm"] {
                    let _ = std::fs::remove_file(db.with_file_name(side));
                }
                std::fs::rename(&other, db).unwrap();
            }),
            ("a directory", |db: &Path| {
                std::fs::remove_file(db).unwrap();
                std::fs::create_dir(db).unwrap();
            }),
            // Before, a row that does not decode and a table of other columns were faults
            // retried at every check, the store never failed.
            (
                "a database with a label that does not decode",
                |db: &Path| {
                    replace_with(
                        db,
                        &[
                            "CREATE TABLE principal_labels (principal TEXT PRIMARY KEY, label TEXT)",
                            "INSERT INTO principal_labels VALUES ('alice', 'not a label')",
                        ],
                    )
                },
            ),
            ("a label cell that is NULL", |db: &Path| {
                replace_with(
                    db,
                    &[
                        "CREATE TABLE principal_labels (principal TEXT PRIMARY KEY, label TEXT)",
                        "INSERT INTO principal_labels VALUES ('alice', NULL)",
                    ],
                )
            }),
            ("a labels table of other columns", |db: &Path| {
                replace_with(
                    db,
                    &["CREATE TABLE principal_labels (principal TEXT PRIMARY KEY, other TEXT)"],
                )
            }),
            ("another database", |db: &Path| {
                let other = db.with_extension("other");
                rusqlite::Connection::open(&other)
                    .unwrap()
                    .execute("CREATE TABLE unrelated (x)", [])
                    .unwrap();
                for side in ["state.db-wal", "state.db-shm"] {
                    let _ = std::fs::remove_file(db.with_file_name(side));
                }
                std::fs::rename(&other, db).unwrap();
            }),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let db = dir.path().join("state.db");
            let store = SqliteStore::open(&db).unwrap();
            store.snapshot().unwrap();
            undo(&db);
            let err = store
                .snapshot()
                .err()
                .unwrap_or_else(|| panic!("{name}: read as a state"));
            assert!(matches!(err, StateError::Replaced { .. }), "{name}: {err}");
            assert!(store.failure().is_some(), "{name}: the store failed");
        }
    }

    /// A state file overwritten in place by another SQLite file while its write-ahead log
    /// lives (`cp other.db state.db` keeps the file, and its `-wal` and `-shm` stay) reads
    /// as malformed: that fails the store, as a file replaced by rename does. Before, it was
    /// an I/O error retried at every check, and health said the state was fine.
    #[test]
    fn a_state_file_overwritten_in_place_fails_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let store = SqliteStore::open(&db).unwrap();
        for n in 0..50 {
            store
                .join(&key(&format!("p{n}"), "s1"), &owner("larkfield"))
                .unwrap();
        }
        // Most pages in the file itself, a few in the log: what a running host's file is.
        rusqlite::Connection::open(&db)
            .unwrap()
            .execute_batch("PRAGMA wal_checkpoint(TRUNCATE);")
            .unwrap();
        store
            .join(&key("p7", "s1"), &owner("another-owner"))
            .unwrap();
        store.snapshot().unwrap();
        assert!(db.with_file_name("state.db-wal").exists());
        // Another state file (an older copy, another host's), its pages laid out otherwise.
        let other = dir.path().join("other.db");
        {
            let older = SqliteStore::open(&other).unwrap();
            for n in 0..400 {
                older
                    .join(&key(&format!("another-principal-{n}"), "s9"), &owner("x"))
                    .unwrap();
            }
        }
        std::fs::write(&db, std::fs::read(&other).unwrap()).unwrap();
        let err = store.snapshot().expect_err("read as a state");
        assert!(matches!(err, StateError::Replaced { .. }), "{err}");
        assert!(store.failure().is_some());
    }

    /// A grant this store spent stays spent while the host runs, even if the file loses its
    /// row (an older copy written over it): before, the store accepted it again until the
    /// next check found the loss, and the call's egress had gone by then.
    #[tokio::test]
    async fn a_grant_spent_here_stays_spent_when_the_file_forgets_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let store = FlowStateStore::open(&db).unwrap();
        assert!(store.consume_grant("g-1", 100).await.unwrap());
        rusqlite::Connection::open(&db)
            .unwrap()
            .execute("DELETE FROM consumed_grants", [])
            .unwrap();
        assert!(
            !store.consume_grant("g-1", 101).await.unwrap(),
            "a replay after the file lost the row"
        );
        assert!(store.consume_grant("g-2", 101).await.unwrap());
    }

    /// The continuity checks judge what the file holds: an older copy written over it while
    /// the store is open shows in the snapshot, however current the store's own copy is.
    #[test]
    fn the_snapshot_reads_the_file_not_the_stores_copy() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let older = dir.path().join("older.db");
        let alice = PrincipalId::new("alice").unwrap();
        let store = SqliteStore::open(&db).unwrap();
        store.join(&key("bob", "s"), &owner("x")).unwrap();
        Connection::open(&db)
            .unwrap()
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        std::fs::copy(&db, &older).unwrap();
        store.join(&key("alice", "s"), &owner("x")).unwrap();
        assert_eq!(store.snapshot().unwrap().principals[&alice], owner("x"));
        Connection::open(&db)
            .unwrap()
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        std::fs::copy(&older, &db).unwrap();
        // The file now holds less than the store wrote to it: refused, naming who lost a
        // label, and the store refuses from then on.
        let err = store.snapshot().unwrap_err();
        assert!(matches!(err, StateError::Replaced { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("lower label for principal alice")
                && text.contains(&db.display().to_string())
                && text.contains("state rebuild"),
            "{text}"
        );
        assert!(store.failure().is_some());
        assert!(store.get(&key("bob", "s")).is_err());
    }

    /// The labels, spent grants and records checkpoint are read back at open against the
    /// seal written with them: any of them from another time than the seal (pages of an
    /// older file under a later write-ahead log; here, a row changed behind the store) is
    /// refused, naming the file. A rebuild's open seals what it finds; a file that holds
    /// something but no seal is refused.
    #[test]
    fn a_file_whose_contents_do_not_match_their_seal_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        {
            let store = SqliteStore::open(&db).unwrap();
            store.join(&key("alice", "s"), &owner("x")).unwrap();
            assert!(store.consume_grant("g-1", 1).unwrap());
            store.set_checkpoint(7, "sha256:aa").unwrap();
        }
        SqliteStore::open(&db).unwrap();
        let behind_the_store = |sql: &str| Connection::open(&db).unwrap().execute(sql, []).unwrap();
        let refused = || {
            let err = SqliteStore::open(&db).unwrap_err();
            assert!(matches!(err, StateError::Unsealed { .. }), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains(&db.display().to_string())
                    && text.contains("different times")
                    && text.contains("state rebuild"),
                "{text}"
            );
        };
        behind_the_store("UPDATE records_checkpoint SET seq = 9");
        refused();
        behind_the_store("UPDATE records_checkpoint SET seq = 7");
        SqliteStore::open(&db).unwrap();
        behind_the_store("DELETE FROM consumed_grants");
        refused();
        behind_the_store("INSERT INTO consumed_grants VALUES ('g-1', 1)");
        SqliteStore::open(&db).unwrap();
        behind_the_store("DELETE FROM principal_labels");
        refused();
        // A rebuild opens it, sealing what it holds (alice's row is gone: a rebuild joins
        // the records back in); then it opens again.
        drop(SqliteStore::open_to_rebuild(&db).unwrap());
        let store = SqliteStore::open(&db).unwrap();
        assert!(store.get(&key("alice", "s")).unwrap().principal.is_bottom());
        drop(store);
        // No seal at all on a file that holds something (its seal removed, or a file from
        // before seals): refused too, since anyone could otherwise drop the seal with the
        // rows; a rebuild seals it again.
        behind_the_store("DELETE FROM state_seal");
        let err = SqliteStore::open(&db).unwrap_err();
        assert!(matches!(err, StateError::NoSeal { .. }), "{err:?}");
        assert!(err.to_string().contains("state rebuild"), "{err}");
        drop(SqliteStore::open_to_rebuild(&db).unwrap());
        drop(SqliteStore::open(&db).unwrap());
        // A new, empty file is sealed as it is made.
        let fresh = dir.path().join("fresh.db");
        drop(SqliteStore::open(&fresh).unwrap());
        Connection::open(&fresh)
            .unwrap()
            .execute("DELETE FROM state_seal", [])
            .unwrap();
        drop(SqliteStore::open(&fresh).unwrap());
    }

    /// The one-writer lock is taken on the path: a second name for the same file (a symbolic
    /// or hard link) would let a second store write it at once, each overwriting the other's
    /// raises with its own copy. Such a path is refused, and so is one that is no file.
    #[test]
    fn a_state_file_reached_by_another_name_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (one, two) = (dir.path().join("one"), dir.path().join("two"));
        std::fs::create_dir_all(&one).unwrap();
        std::fs::create_dir_all(&two).unwrap();
        let db = one.join("state.db");
        let first = SqliteStore::open(&db).unwrap();
        let refused = |path: &Path, found: &str| {
            let err = SqliteStore::open(path).unwrap_err();
            assert!(matches!(err, StateError::NotOwnFile { .. }), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains(&path.display().to_string()) && text.contains(found),
                "{text}"
            );
        };
        let linked = two.join("state.db");
        std::os::unix::fs::symlink(&db, &linked).unwrap();
        refused(&linked, "symbolic link");
        std::fs::remove_file(&linked).unwrap();
        std::fs::hard_link(&db, &linked).unwrap();
        refused(&linked, "2 names");
        drop(first);
        refused(&db, "2 names");
        std::fs::remove_file(&linked).unwrap();
        SqliteStore::open(&db).unwrap();
        let not_a_file = two.join("dir.db");
        std::fs::create_dir(&not_a_file).unwrap();
        refused(&not_a_file, "not a regular file");
    }

    /// The state files hold every principal's label: only their owner may read or write
    /// them, whatever the process's umask, and files an earlier run left wider are narrowed.
    #[test]
    fn state_files_are_private_to_their_owner() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        let files = ["state.db", "state.db-wal", "state.db-shm", "state.db.lock"]
            .map(|f| dir.path().join(f));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        {
            let store = SqliteStore::open(&db).unwrap();
            store.join(&key("alice", "s"), &owner("x")).unwrap();
            for f in &files {
                assert_eq!(mode(f), 0o600, "{}", f.display());
            }
        }
        for f in &files {
            if !f.exists() {
                std::fs::write(f, b"").unwrap();
            }
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let store = SqliteStore::open(&db).unwrap();
        store.join(&key("bob", "s"), &owner("x")).unwrap();
        for f in &files {
            assert_eq!(mode(f), 0o600, "{}", f.display());
        }
    }

    #[test]
    fn a_corrupt_label_stops_the_open() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        SqliteStore::open(&db)
            .unwrap()
            .join(&key("alice", "s"), &owner("x"))
            .unwrap();
        let conn = Connection::open(&db).unwrap();
        conn.execute(
            "UPDATE principal_labels SET label = '{\"kind\":\"bottom\"}'",
            [],
        )
        .unwrap();
        drop(conn);
        let err = SqliteStore::open(&db).unwrap_err().to_string();
        assert!(err.contains("stored value for alice is invalid"), "{err}");
    }
}
