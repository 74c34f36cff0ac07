//! Binding the flow state to the decision records, so that a state file cannot roll labels
//! back.
//!
//! Every record of a decision that changed the flow state carries `flowhost.labels_after`:
//! the principal's and the session's stored labels once it took effect. Labels only grow,
//! so the records prove a lower bound for every label the state must hold. The state keeps a
//! checkpoint (the sequence number and line hash of the last record it was proven against).
//!
//! * [`check`] runs at every start: the checkpoint record must still be in the records with
//!   the same hash (otherwise the state belongs to another record stream), and every label
//!   the records after it prove must flow to what the state holds. A truncated `state.db`, an
//!   older copy, a lost write-ahead log, or another host's file all fail here, and the host
//!   refuses to start, saying what it found and what to do.
//! * [`check_through`] is the same check over the records up to a given one, made while the
//!   host serves (and so the checkpoint follows the records): a state rolled back under a
//!   running host is found within one interval, and what a stop or a start after a crash
//!   reads is the records since the last such check, not since the start.
//! * [`rebuild`] reconstructs every principal's and session's label from the records alone
//!   (joining into whatever the state already holds, so it never lowers anything).
//!
//! Order of writes that makes this sound: the state is raised (durably) before the record
//! that claims the raise is committed, so after a crash the state is ahead of the records,
//! never behind.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::ident::PrincipalId;
use crate::label::InformationLabel;
use crate::records::chain::{line_hash, verify_records};
use crate::records::store::{StoreError, list_record_files, split_lines};
use crate::records::{Effect, EventKind, LabelsAfter};
use crate::state::postgres::PgError;
use crate::state::{FlowStateStore, SessionKey, SqliteStore, StateError, StateSnapshot};

/// Why the flow state and the records do not agree, or could not be compared.
#[derive(Debug, thiserror::Error)]
pub enum ContinuityError {
    /// The records could not be read.
    #[error(transparent)]
    Records(#[from] StoreError),
    /// The state could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
    /// The record the state was bound to is not in the records (or differs).
    #[error(transparent)]
    OtherStream(Box<OtherStreamError>),
    /// The records prove a label the state does not hold.
    #[error(transparent)]
    Behind(Box<BehindError>),
    /// A record line is not a valid record.
    #[error("{file}:{line}: not a valid decision record ({error}); run `flowhost records verify`")]
    Malformed {
        /// The record file.
        file: PathBuf,
        /// The 1-based line.
        line: u64,
        /// Why.
        error: String,
    },
    /// The records do not verify, so they cannot be rebuilt from.
    #[error(
        "{records}: the records do not verify ({count} problems, first: {first}); a rebuild \
         needs an intact chain (see `flowhost records verify {records}`)"
    )]
    Unverified {
        /// The record directory.
        records: PathBuf,
        /// How many problems.
        count: usize,
        /// The first one.
        first: String,
    },
    /// The records hold nothing to rebuild from (no record and no head anchor: a wrong
    /// directory?), or an end no one vouches for (their anchor and ring were removed).
    #[error("{why}; nothing was rebuilt")]
    NothingToRebuildFrom {
        /// The record directory.
        records: PathBuf,
        /// Why.
        why: String,
    },
    /// A record's sequence number does not follow the one before it: records are missing
    /// (a file or a line lost), repeated or out of order, so what they prove is not all
    /// there to check against.
    #[error(
        "{file}:{line}: record seq {found} follows seq {previous}: records are missing, repeated or out of order, so the flow state cannot be checked against them (see `flowhost records verify`)"
    )]
    Gap {
        /// The record file.
        file: PathBuf,
        /// The 1-based line.
        line: u64,
        /// The sequence number of the record read before it.
        previous: u64,
        /// Its own sequence number.
        found: u64,
    },
    /// The state is bound to no record, so every record is checked, but the records do not
    /// start at seq 1: what the earlier ones raised is not here to check.
    #[error(
        "{file}:{line}: the flow state is bound to no record, so it is checked against every \
         record, but the records start at seq {first}: records 1..{first} are not in the \
         directory (rotated files archived or removed?), and the labels they raised cannot be \
         checked; put them back"
    )]
    MissingStart {
        /// The first record file.
        file: PathBuf,
        /// The 1-based line.
        line: u64,
        /// The sequence number found first.
        first: u64,
    },
    /// An allowed call's record carries no labels (written before records carried them).
    #[error(
        "{file}:{line}: record seq {seq} is an allowed call but carries no labels_after (it \
         predates label-carrying records), so its labels cannot be recovered from the records"
    )]
    Unrecoverable {
        /// The record file.
        file: PathBuf,
        /// The line.
        line: u64,
        /// Its sequence number.
        seq: u64,
    },
    /// The check stopped before it finished (its reading thread panicked or was cancelled).
    #[error("the check of the flow state against {records} stopped before it finished: {reason}")]
    Interrupted {
        /// The record directory.
        records: PathBuf,
        /// Why.
        reason: String,
    },
    /// A record names a principal that is not a valid principal id.
    #[error("{file}:{line}: record seq {seq} names an invalid principal: {reason}")]
    BadPrincipal {
        /// The record file.
        file: PathBuf,
        /// The line.
        line: u64,
        /// Its sequence number.
        seq: u64,
        /// Why.
        reason: String,
    },
}

/// Where the flow state that a [`ContinuityError`] is about lives, and so what an operator
/// can do about it.
#[derive(Debug, Clone)]
enum Home {
    /// The embedded SQLite file `db` in `state_dir`.
    File { db: PathBuf, state_dir: PathBuf },
    /// A shared PostgreSQL database (`name`, as the store describes it, without a password,
    /// named by `url_file`) in which this host keeps its checkpoint as `host_id`. `flowhost
    /// state rebuild` cannot help there: it writes a SQLite file.
    Database {
        name: String,
        url_file: PathBuf,
        host_id: String,
    },
}

/// Says that `state_rebuild` writes a SQLite file alone, for the messages about a database.
const REBUILD_IS_SQLITE_ONLY: &str = "(`flowhost state rebuild` writes a host's SQLite \
                                      state.db, never a shared database)";

/// The state was last proven against a record the records no longer hold as it was.
#[derive(Debug, thiserror::Error)]
pub struct OtherStreamError {
    /// Where the state lives.
    home: Home,
    /// The record directory.
    records: PathBuf,
    /// The checkpoint's sequence number.
    seq: u64,
    /// The checkpoint's line hash.
    hash: String,
    /// What the records hold instead.
    found: String,
}

impl std::fmt::Display for OtherStreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let OtherStreamError {
            records,
            seq,
            hash,
            found,
            ..
        } = self;
        let records = records.display();
        match &self.home {
            Home::File { db, state_dir } => write!(
                f,
                "flow state {} was last proven against record seq {seq} ({hash}), but \
                 {records} {found}: this state belongs to another record stream (another \
                 host's file?) or the records were replaced. Restore the state.db that belongs \
                 to these records, or rebuild it from them with `flowhost state rebuild \
                 --records {records} --state-dir {}` (host stopped)",
                db.display(),
                state_dir.display()
            ),
            Home::Database { name, host_id, .. } => write!(
                f,
                "flow-state database {name} holds a checkpoint for host_id {host_id:?} at \
                 record seq {seq} ({hash}), but {records} {found}: another host uses host_id \
                 {host_id:?} with records of its own, or this host's records were replaced. \
                 Give every host a host_id of its own in [host] state; if these records are \
                 this host's, set a host_id no host has used: the next start then checks \
                 every label these records prove against the database before it binds them \
                 {REBUILD_IS_SQLITE_ONLY}"
            ),
        }
    }
}

/// The records prove a label the state does not hold.
#[derive(Debug, thiserror::Error)]
pub struct BehindError {
    /// Where the state lives.
    home: Home,
    /// The record directory.
    records: PathBuf,
    /// What the records show (`principal alice carrying a label`, `declassification grant
    /// "g-1" spent`).
    holder: String,
    /// The check has marked it spent again (a grant): nothing is left to forget, but what
    /// lost it may have lost more.
    remarked: bool,
    /// The record proving it.
    seq: u64,
    /// Its file.
    file: PathBuf,
    /// Its line.
    line: u64,
}

impl std::fmt::Display for BehindError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let BehindError {
            records,
            holder,
            remarked,
            seq,
            file,
            line,
            ..
        } = self;
        let (records, file) = (records.display(), file.display());
        let lost = if *remarked {
            "It is marked spent again now (with every other grant an allowed call spent \
             since the checkpoint), but whatever lost it may have lost more."
        } else {
            "Starting would forget it."
        };
        match &self.home {
            Home::File { db, state_dir } => write!(
                f,
                "flow state {} is older than the decision records: record seq {seq} \
                 ({file}:{line}) shows {holder}, which the state does not hold (a truncated or \
                 restored state.db, or one whose write-ahead log was lost). {lost} With the \
                 host stopped, rebuild the state from the records with \
                 `flowhost state rebuild --records {records} --state-dir {}`, or restore the \
                 newest state.db",
                db.display(),
                state_dir.display()
            ),
            Home::Database {
                name,
                url_file,
                host_id,
            } => write!(
                f,
                "flow-state database {name} is older than the decision records: record seq \
                 {seq} ({file}:{line}) shows {holder}, which the database does not hold (it \
                 was restored from an older backup, failed over to a standby that lagged, or \
                 emptied). {lost} Bring back the database that holds it: \
                 restore its newest backup, or point {} at the server that has the latest \
                 writes, then start again {REBUILD_IS_SQLITE_ONLY}. If no copy holds it any \
                 more, starting means accepting the loss: move {records} aside (keep it) and \
                 give this host a host_id other than {host_id:?}",
                url_file.display()
            ),
        }
    }
}

/// Where a record is.
#[derive(Debug, Clone, Copy)]
struct At<'a> {
    seq: u64,
    file: &'a Path,
    line: u64,
}

/// What [`scan`] shows its visitor of one record after the checkpoint.
enum Seen<'a> {
    /// The record carries labels: `key`'s principal's and session's labels once it took
    /// effect.
    Labels {
        key: SessionKey,
        labels: LabelsAfter,
        at: At<'a>,
    },
    /// The record names a declassification grant.
    Grant {
        id: &'a str,
        /// What came of its call. `Allow`: the grant was spent, durably, before it. `Error`:
        /// the host failed, perhaps after spending it. `Deny`: refused before any spend (the
        /// grant checked last is its single use), so the id, which may be one a client made
        /// up, was not spent by this record.
        effect: Effect,
        at: At<'a>,
    },
}

/// How reading the records after a checkpoint ended.
struct ScanEnd {
    /// Whether the checkpoint record was found with its hash.
    checkpoint: CheckpointFound,
    /// The last record read: sequence number and line hash.
    head: Option<(u64, String)>,
    /// Records decoded (the checkpoint included, and those before it in its file when they
    /// did not hold consecutive sequence numbers).
    records: u64,
}

enum CheckpointFound {
    /// No checkpoint to look for.
    NotNeeded,
    /// Found with the expected hash.
    Matches,
    /// Found with another hash.
    Differs(String),
    /// Not in the records.
    Missing,
}

/// Reads every record with a sequence number above `after.0` (and at most `through`, when
/// given), checking that record `after.0` has line hash `after.1`, and shows each to `visit`
/// as it is read: nothing of the records is kept here, so what a caller holds is what it
/// folds them into. Stops at the first record past the checkpoint when the checkpoint was not
/// found as it should be (its caller refuses that state whatever follows). `strict` refuses
/// allowed calls without labels.
fn scan(
    dir: &Path,
    after: Option<(u64, &str)>,
    through: Option<u64>,
    strict: bool,
    visit: &mut dyn FnMut(Seen<'_>) -> Result<(), ContinuityError>,
) -> Result<ScanEnd, ContinuityError> {
    let files = list_record_files(dir)?;
    let after_seq = after.map_or(0, |(s, _)| s);
    // Start with the file holding the checkpoint: the last one named at or before it.
    let start = files
        .iter()
        .rposition(|f| f.first_seq <= after_seq.max(1))
        .unwrap_or(0);
    let mut out = ScanEnd {
        checkpoint: if after.is_some() {
            CheckpointFound::Missing
        } else {
            CheckpointFound::NotNeeded
        },
        head: None,
        records: 0,
    };
    let decode = |file: &Path, line: u64, text: &[u8]| {
        serde_json::from_slice::<Judged>(text).map_err(|e| ContinuityError::Malformed {
            file: file.to_path_buf(),
            line,
            error: e.to_string(),
        })
    };
    // The sequence number of the record read last: each must follow it, across files too,
    // or a lost record's raise would go unchecked.
    let mut previous: Option<u64> = None;
    for f in &files[start..] {
        let bytes = std::fs::read(&f.path).map_err(StoreError::io("read", &f.path))?;
        let lines: Vec<&[u8]> = split_lines(&bytes).0.collect();
        // A writer gives a file's lines consecutive sequence numbers from the one its name
        // carries, so the checkpoint is looked for where that puts it and the lines before
        // it are not decoded (a restart or a check while serving would otherwise decode the
        // whole file each time). Anywhere else, the file is read from its first line.
        let skip = after_seq
            .checked_sub(f.first_seq)
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i > 0 && i < lines.len())
            .filter(|&i| {
                decode(&f.path, i as u64 + 1, lines[i]).is_ok_and(|r| r.flowhost.seq == after_seq)
            })
            .unwrap_or(0);
        // The head's hash is taken once per file, of the last line read in it.
        let mut last: Option<(u64, usize)> = None;
        let head_of = |last: Option<(u64, usize)>, out: &mut ScanEnd| {
            if let Some((seq, i)) = last {
                out.head = Some((seq, line_hash(lines[i]).as_str().to_string()));
            }
        };
        for (i, line) in lines.iter().enumerate().skip(skip) {
            let line = *line;
            let at = At {
                seq: 0,
                file: &f.path,
                line: i as u64 + 1,
            };
            let Judged {
                flowhost: x,
                decision,
            } = decode(&f.path, at.line, line)?;
            let at = At { seq: x.seq, ..at };
            if previous.is_none() && after.is_none() && at.seq != 1 {
                return Err(ContinuityError::MissingStart {
                    file: f.path.clone(),
                    line: at.line,
                    first: at.seq,
                });
            }
            if let Some(p) = previous
                && Some(at.seq) != p.checked_add(1)
            {
                return Err(ContinuityError::Gap {
                    file: f.path.clone(),
                    line: at.line,
                    previous: p,
                    found: at.seq,
                });
            }
            previous = Some(at.seq);
            if through.is_some_and(|t| at.seq > t) {
                head_of(last, &mut out);
                return Ok(out);
            }
            out.records += 1;
            if let Some((s, hash)) = after
                && at.seq == s
            {
                let found = line_hash(line);
                out.checkpoint = if found.as_str() == hash {
                    CheckpointFound::Matches
                } else {
                    CheckpointFound::Differs(found.as_str().to_string())
                };
            }
            last = Some((at.seq, i));
            if at.seq <= after_seq {
                continue;
            }
            if matches!(
                out.checkpoint,
                CheckpointFound::Missing | CheckpointFound::Differs(_)
            ) {
                head_of(last, &mut out);
                return Ok(out);
            }
            if let Some(grant) = &x.grant {
                visit(Seen::Grant {
                    id: &grant.id,
                    effect: decision.effect,
                    at,
                })?;
            }
            let must_carry = matches!(x.event, EventKind::ToolOutcome | EventKind::ContentOutcome)
                || (matches!(
                    x.event,
                    EventKind::ToolCall | EventKind::ContentRequest | EventKind::Relay
                ) && decision.effect == Effect::Allow);
            let Some(labels) = x.labels_after else {
                if strict && must_carry {
                    return Err(ContinuityError::Unrecoverable {
                        file: f.path.clone(),
                        line: at.line,
                        seq: at.seq,
                    });
                }
                continue;
            };
            let (Some(principal), Some(session)) = (x.principal, x.session) else {
                continue;
            };
            let principal =
                PrincipalId::new(&principal).map_err(|e| ContinuityError::BadPrincipal {
                    file: f.path.clone(),
                    line: at.line,
                    seq: at.seq,
                    reason: e.to_string(),
                })?;
            visit(Seen::Labels {
                key: SessionKey { principal, session },
                labels,
                at,
            })?;
        }
        head_of(last, &mut out);
    }
    Ok(out)
}

/// What [`scan`] reads of a record: the fields a flow-state check judges by, each decoded as
/// strictly as the record format types it. The rest of the line is skipped unread: checking
/// every field of every record is `flowhost records verify`'s work (and the diff's, which
/// verifies first; a rebuild verifies first too), and decoding and validating them all took
/// most of a check's time.
#[derive(serde::Deserialize)]
struct Judged {
    flowhost: JudgedExtension,
    decision: JudgedDecision,
}

/// The part of `flowhost` a check reads.
#[derive(serde::Deserialize)]
struct JudgedExtension {
    seq: u64,
    event: EventKind,
    #[serde(default)]
    principal: Option<String>,
    #[serde(default)]
    session: Option<String>,
    #[serde(default)]
    labels_after: Option<LabelsAfter>,
    #[serde(default)]
    grant: Option<JudgedGrant>,
}

/// The part of `flowhost.grant` a check reads.
#[derive(serde::Deserialize)]
struct JudgedGrant {
    id: String,
}

/// The part of `decision` a check reads.
#[derive(serde::Deserialize)]
struct JudgedDecision {
    effect: Effect,
}

/// Where the state lives, for messages.
#[derive(Debug, Clone)]
pub struct Places<'a> {
    /// The state database file (for a shared PostgreSQL store, the `url_file` naming the
    /// database).
    pub db: &'a Path,
    /// The state directory.
    pub state_dir: &'a Path,
    /// The record directory.
    pub records: &'a Path,
    /// For a shared PostgreSQL store, this host's `host_id` (the messages then name the
    /// database as the store describes it, and say what can be done there); `None` for the
    /// SQLite file `db`.
    pub host_id: Option<&'a str>,
}

impl Places<'_> {
    /// Where `state`, which these places describe, lives.
    fn home(&self, state: &FlowStateStore) -> Home {
        match self.host_id {
            None => Home::File {
                db: self.db.to_path_buf(),
                state_dir: self.state_dir.to_path_buf(),
            },
            Some(host_id) => Home::Database {
                name: state.describe(),
                url_file: self.db.to_path_buf(),
                host_id: host_id.to_string(),
            },
        }
    }

    /// The state is behind the records: `holder` is what record `at` shows; `remarked`: the
    /// check has put it back itself (a grant marked spent again).
    fn behind(&self, home: &Home, holder: String, at: At<'_>, remarked: bool) -> ContinuityError {
        ContinuityError::Behind(Box::new(BehindError {
            home: home.clone(),
            records: self.records.to_path_buf(),
            holder,
            remarked,
            seq: at.seq,
            file: at.file.to_path_buf(),
            line: at.line,
        }))
    }
}

/// What [`check`] keeps while it reads the records after the checkpoint: each record's
/// labels are compared with the state's as they are read, so of those nothing is kept; of
/// the grants allowed calls named, each one once, with the first record naming it. Bounded
/// by the grants issued, not by the records.
#[derive(Default)]
struct Owed {
    grants: HashMap<String, (u64, PathBuf, u64)>,
    /// Grants named by calls the host failed (the state failing right after the spend, say):
    /// perhaps spent, so marked spent, but a state without them lost nothing it is owed.
    perhaps_spent: HashSet<String>,
    /// The first record whose labels the state does not hold, reported once the scan has
    /// found every grant owed (they are marked spent before any refusal: see
    /// [`check_through`]).
    behind: Option<ContinuityError>,
}

impl Owed {
    /// Takes in one record: the first label the state does not hold is kept for the
    /// refusal; the scan reads on for the grants.
    fn take(
        &mut self,
        seen: Seen<'_>,
        held: Option<&StateSnapshot>,
        places: &Places<'_>,
        home: &Home,
    ) -> Result<(), ContinuityError> {
        match seen {
            // Without the state's labels (see `check_through`) only grants are owed.
            Seen::Labels { .. } if held.is_none() => {}
            Seen::Labels { key, labels, at } => {
                // Sessions do not outlive a run, and each session's label is joined into its
                // principal's, so the principals' labels are what the records must find held.
                let bottom = InformationLabel::bottom();
                let principal = held
                    .and_then(|h| h.principals.get(&key.principal))
                    .unwrap_or(&bottom);
                if self.behind.is_none()
                    && (!labels.principal.flows_to(principal)
                        || !labels.session.flows_to(principal))
                {
                    let holder = format!("principal {} carrying a label", key.principal);
                    self.behind = Some(places.behind(home, holder, at, false));
                }
            }
            Seen::Grant { id, effect, at } => match effect {
                Effect::Allow if !self.grants.contains_key(id) => {
                    self.perhaps_spent.remove(id);
                    self.grants
                        .insert(id.to_string(), (at.seq, at.file.to_path_buf(), at.line));
                }
                Effect::Error if !self.grants.contains_key(id) => {
                    self.perhaps_spent.insert(id.to_string());
                }
                Effect::Allow | Effect::Error | Effect::Deny => {}
            },
        }
        Ok(())
    }

    /// How many things are kept.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.grants.len() + self.perhaps_spent.len()
    }
}

/// Reads the records after `checkpoint` against `held`, the state read before (see
/// [`Owed`]).
fn read_owed(
    places: &Places<'_>,
    home: &Home,
    checkpoint: Option<&(u64, String)>,
    through: Option<u64>,
    held: Option<&StateSnapshot>,
) -> Result<(ScanEnd, Owed), ContinuityError> {
    let mut owed = Owed::default();
    let end = scan(
        places.records,
        checkpoint.map(|(s, h)| (*s, h.as_str())),
        through,
        false,
        &mut |seen| owed.take(seen, held, places, home),
    )?;
    Ok((end, owed))
}

/// [`read_owed`] on a thread of the runtime's blocking pool: reading and decoding the records
/// takes about 3 µs per record, which a check while serving must not take from the
/// runtime's workers. (The state's own reads stay where the store makes them: SQLite's on
/// the calling worker, under the store's lock, for the time it reads the file once.)
async fn read_owed_apart(
    places: &Places<'_>,
    home: &Home,
    checkpoint: Option<(u64, String)>,
    through: Option<u64>,
    held: Option<StateSnapshot>,
) -> Result<(ScanEnd, Owed), ContinuityError> {
    let (db, state_dir, records) = (
        places.db.to_path_buf(),
        places.state_dir.to_path_buf(),
        places.records.to_path_buf(),
    );
    let host_id = places.host_id.map(str::to_string);
    let home = home.clone();
    let reading = tokio::task::spawn_blocking(move || {
        let places = Places {
            db: &db,
            state_dir: &state_dir,
            records: &records,
            host_id: host_id.as_deref(),
        };
        read_owed(&places, &home, checkpoint.as_ref(), through, held.as_ref())
    });
    reading.await.map_err(|e| ContinuityError::Interrupted {
        records: places.records.to_path_buf(),
        reason: e.to_string(),
    })?
}

/// Checks that `state` holds every label the records in `places.records` prove, and
/// re-binds it to the records' head. Refuses (see [`ContinuityError`]) a state that is
/// behind the records or belongs to another record stream.
pub async fn check(state: &FlowStateStore, places: &Places<'_>) -> Result<(), ContinuityError> {
    check_through(state, places, None).await
}

/// [`check`] over the records up to `through` alone (its sequence number and line hash; all
/// of them with `None`), binding the state to the last of them read; sound while the host
/// serves when `through` is the record writer's head as read before this is called. The
/// state is raised before a record that claims the raise is written, and labels only grow,
/// so the state read here, after `through` was, holds whatever the records up to it prove;
/// records written since may claim raises it was read too early to hold, and are left to
/// the next check.
pub async fn check_through(
    state: &FlowStateStore,
    places: &Places<'_>,
    through: Option<(u64, &str)>,
) -> Result<(), ContinuityError> {
    // Read once, before the records, and each record is compared with it as it is read
    // (see above for why that is sound while labels are being raised). Read even when no
    // record is new: reading is what finds a file replaced under the store.
    //
    // A shared database that reads a principal lower than this host has seen gives no
    // labels to compare (each call of that principal is refused meanwhile, until it reads
    // back), but the grants the records show spent, and the checkpoint, are still checked:
    // a restore that lost spent grants would otherwise let them be spent again. The state
    // is then not bound further, and the check fails as the read did.
    let (held, lowered) = match state.snapshot().await {
        Ok(held) => (Some(held), None),
        Err(e @ StateError::Postgres(PgError::Lower { .. })) => (None, Some(e)),
        Err(e) => return Err(e.into()),
    };
    // After the snapshot, which reads the file afresh and so tells a file replaced under
    // the store (the checkpoint's read through the store's own connection would fail as a
    // fault retried at every check).
    let checkpoint = state.checkpoint().await?;
    // Nothing new since the checkpoint. Any other checkpoint at or past `through` is not
    // this stream's (the writer's head never falls back): the scan below reports it.
    if let (Some(through), Some((seq, hash))) = (through, &checkpoint)
        && through == (*seq, hash.as_str())
    {
        return lowered.map_or(Ok(()), |e| Err(e.into()));
    }
    let home = places.home(state);
    let through = through.map(|(seq, _)| seq);
    let (scan, owed) = read_owed_apart(places, &home, checkpoint.clone(), through, held).await?;
    if let Some((seq, hash)) = &checkpoint {
        let found = match &scan.checkpoint {
            CheckpointFound::Matches | CheckpointFound::NotNeeded => None,
            CheckpointFound::Differs(other) => {
                Some(format!("holds record seq {seq} with hash {other}"))
            }
            CheckpointFound::Missing => Some(match (&scan.head, through) {
                (Some((last, _)), _) if last < seq => format!("end at record seq {last}"),
                (Some(_), _) => format!("do not hold record seq {seq}"),
                // Nothing was read: the scan started at the checkpoint's line, which is past
                // the writer's head, where the records end for this check.
                (None, Some(head)) if head < *seq => format!("end at record seq {head}"),
                (None, _) => "hold no records".to_string(),
            }),
        };
        if let Some(found) = found {
            return Err(ContinuityError::OtherStream(Box::new(OtherStreamError {
                home,
                records: places.records.to_path_buf(),
                seq: *seq,
                hash: hash.clone(),
                found,
            })));
        }
    }
    // A grant an allowed call named was spent before the call went ahead: one the state
    // does not hold as spent would be accepted again (a restored or truncated state).
    // Marking it spent here is what a rebuild would do; the start is still refused, as for
    // a label, since whatever lost it may have lost more. A refused call's grant was never
    // spent (the spend is the last check), so it is owed nothing. A call the host failed
    // may have failed after the spend: its grant is marked spent as well, but a state
    // without it may simply never have spent it, so its absence refuses nothing.
    // Every lost one is marked before the first is reported: the refusal that follows
    // stops every later use of this state, so one left unmarked could be spent on another
    // host sharing the database.
    for id in &owed.perhaps_spent {
        state.mark_grant_spent(id, crate::grant::now()).await?;
    }
    let mut grants: Vec<_> = owed.grants.into_iter().collect();
    grants.sort_by_key(|(_, (seq, _, _))| *seq);
    let mut first_lost = None;
    for (id, found) in grants {
        if state.mark_grant_spent(&id, crate::grant::now()).await? && first_lost.is_none() {
            first_lost = Some((id, found));
        }
    }
    // A label found behind is the first refusal (the state lost at least that), once the
    // grants are marked.
    if let Some(behind) = owed.behind {
        return Err(behind);
    }
    if let Some((id, (seq, file, line))) = first_lost {
        let at = At {
            seq,
            file: &file,
            line,
        };
        return Err(places.behind(
            &home,
            format!("declassification grant {id:?} spent"),
            at,
            true,
        ));
    }
    if let Some(e) = lowered {
        return Err(e.into());
    }
    if let Some((seq, hash)) = &scan.head {
        state.set_checkpoint(*seq, hash).await?;
    }
    Ok(())
}

/// Re-binds `state` to the records' current head without comparing labels: only for an
/// operator who accepted a reset (a clean stop checks first, with [`check`]).
pub async fn rebind(
    state: &FlowStateStore,
    head: Option<(u64, &str)>,
) -> Result<(), ContinuityError> {
    if let Some((seq, hash)) = head {
        state.set_checkpoint(seq, hash).await?;
    }
    Ok(())
}

/// What [`rebuild`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildReport {
    /// Records read.
    pub records: u64,
    /// Principals whose label the records prove.
    pub principals: usize,
    /// Sessions the records show (compacted into their principals).
    pub sessions: usize,
    /// Declassification grants the records name, now marked spent.
    pub grants: usize,
    /// The record the state is now bound to.
    pub head_seq: Option<u64>,
}

/// What the records prove, folded as [`rebuild`] reads them: one label per principal (ended
/// sessions are compacted into their principals), the sessions seen (for the report) and
/// every grant named. Bounded by principals, sessions and grants, not by the records.
#[derive(Default)]
struct Proven {
    principals: HashMap<PrincipalId, InformationLabel>,
    sessions: HashSet<SessionKey>,
    grants: HashSet<String>,
}

impl Proven {
    fn take(&mut self, seen: Seen<'_>) {
        match seen {
            Seen::Labels { key, labels, .. } => {
                let label = self
                    .principals
                    .entry(key.principal.clone())
                    .or_insert_with(InformationLabel::bottom);
                *label = label
                    .join_or_top(&labels.principal)
                    .join_or_top(&labels.session);
                self.sessions.insert(key);
            }
            // Every grant an allowed call spent is marked spent, and so is every grant of a
            // call the host failed (it may have failed after the spend). A refused call spent
            // nothing: its id may be one a client made up to spend an authority's real grant
            // ahead of it, and an authority can issue a new grant for a call that was refused.
            Seen::Grant {
                id,
                effect: Effect::Allow | Effect::Error,
                ..
            } => {
                if !self.grants.contains(id) {
                    self.grants.insert(id.to_string());
                }
            }
            Seen::Grant {
                effect: Effect::Deny,
                ..
            } => {}
        }
    }
}

/// Rebuilds the flow state in `state_db` from the records in `records_dir` alone: the chain
/// must verify, every allowed call must carry its labels, and each label is joined into what
/// the state already holds (so a rebuild never lowers anything). The state is then bound to
/// the records' head.
pub fn rebuild(records_dir: &Path, state_db: &Path) -> Result<RebuildReport, ContinuityError> {
    let report = verify_records(records_dir, None)?;
    if let Some(first) = report.problems.first() {
        return Err(ContinuityError::Unverified {
            records: records_dir.to_path_buf(),
            count: report.problems.len(),
            first: first.to_string(),
        });
    }
    // As every reader of records refuses them: a state sealed anew from them would be
    // bound to an end nothing vouches for, or to nothing at all.
    if let Some(why) = crate::records::chain::refused_as_evidence(records_dir, &report) {
        return Err(ContinuityError::NothingToRebuildFrom {
            records: records_dir.to_path_buf(),
            why,
        });
    }
    let mut proven = Proven::default();
    let scan = scan(records_dir, None, None, true, &mut |seen| {
        proven.take(seen);
        Ok(())
    })?;
    let state = SqliteStore::open_to_rebuild(state_db)?;
    for (principal, label) in &proven.principals {
        state.raise_principal(principal, label)?;
    }
    let now = crate::grant::now();
    for id in &proven.grants {
        state.consume_grant(id, now)?;
    }
    if let Some((seq, hash)) = &scan.head {
        state.set_checkpoint(*seq, hash)?;
    }
    Ok(RebuildReport {
        records: report.records,
        principals: proven.principals.len(),
        sessions: proven.sessions.len(),
        grants: proven.grants.len(),
        head_seq: scan.head.map(|(s, _)| s),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{GrantFacts, RecordWriter, WriterOptions};

    /// A record directory holding one allowed call made under grant `g-1`.
    fn records_with_a_spent_grant(dir: &Path) {
        records_with_spent_grants(dir, &["g-1"], &InformationLabel::bottom());
    }

    /// A record directory holding one allowed call of alice per grant in `grants`, each
    /// carrying `label`.
    fn records_with_spent_grants(dir: &Path, grants: &[&str], label: &InformationLabel) {
        let w = RecordWriter::open(dir, WriterOptions::default()).unwrap();
        for id in grants {
            let mut call = crate::records::tests::sample_tool_call();
            call.flowhost.grant = Some(GrantFacts {
                id: id.to_string(),
                purpose: "reviewed-summary".into(),
            });
            call.flowhost.labels_after = Some(LabelsAfter {
                principal: label.clone(),
                session: label.clone(),
            });
            w.commit_blocking(call).unwrap();
        }
        w.close_blocking().unwrap();
    }

    /// A record directory holding `n` allowed calls of alice, each in a session of its own
    /// and carrying the label of data owned by `larkfield`.
    fn records_of_one_principal(dir: &Path, n: usize) {
        let w = RecordWriter::open(dir, WriterOptions::default()).unwrap();
        for i in 0..n {
            let mut call = crate::records::tests::sample_tool_call();
            call.flowhost.session = Some(format!("s-{i}"));
            call.flowhost.labels_after = Some(LabelsAfter {
                principal: crate::state::tests::owner("larkfield"),
                session: crate::state::tests::owner("larkfield"),
            });
            w.commit_blocking(call).unwrap();
        }
        w.close_blocking().unwrap();
    }

    /// A record directory holding one allowed call of alice per label, in order, each in a
    /// session of its own.
    fn records_of_labels(dir: &Path, labels: &[InformationLabel]) {
        let w = RecordWriter::open(dir, WriterOptions::default()).unwrap();
        for (i, label) in labels.iter().enumerate() {
            let mut call = crate::records::tests::sample_tool_call();
            call.flowhost.session = Some(format!("s-{i}"));
            call.flowhost.labels_after = Some(LabelsAfter {
                principal: label.clone(),
                session: label.clone(),
            });
            w.commit_blocking(call).unwrap();
        }
        w.close_blocking().unwrap();
    }

    /// The line hashes of `lines`, in order.
    fn hashes_of(lines: &[Vec<u8>]) -> Vec<String> {
        lines
            .iter()
            .map(|l| line_hash(l).as_str().to_string())
            .collect()
    }

    /// The lines of the one record file in `dir`.
    fn lines_of(dir: &Path) -> Vec<Vec<u8>> {
        let files = list_record_files(dir).unwrap();
        assert_eq!(files.len(), 1);
        let bytes = std::fs::read(&files[0].path).unwrap();
        split_lines(&bytes).0.map(<[u8]>::to_vec).collect()
    }

    /// A check while serving reads the records up to the one the writer had when it began,
    /// and binds the state to it: a later record may claim a raise the state was read too
    /// early to hold, so it is left to the next check, which still finds a state without it.
    #[tokio::test]
    async fn a_check_through_a_record_binds_to_it_and_leaves_the_later_ones() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        let bottom = InformationLabel::bottom();
        records_of_labels(
            &records,
            &[
                bottom.clone(),
                bottom,
                crate::state::tests::owner("larkfield"),
            ],
        );
        let db = dir.path().join("state.db");
        let state = FlowStateStore::open(&db).unwrap();
        let places = file_places(&db, dir.path(), &records);
        let hashes = hashes_of(&lines_of(&records));
        let head = |seq: u64| Some((seq, hashes[seq as usize - 1].as_str()));
        check_through(&state, &places, head(2)).await.unwrap();
        assert_eq!(
            state.checkpoint().await.unwrap(),
            Some((2, hashes[1].clone()))
        );
        // Nothing new since the checkpoint: nothing to read.
        check_through(&state, &places, head(2)).await.unwrap();
        let err = check_through(&state, &places, head(3)).await.unwrap_err();
        assert!(
            err.to_string().contains("record seq 3 ") && err.to_string().contains("alice"),
            "{err}"
        );
        // The refused check left the binding where it was.
        assert_eq!(state.checkpoint().await.unwrap().map(|c| c.0), Some(2));
    }

    /// With no record since the checkpoint, a check still reads the state: a file replaced
    /// under the store is found on a host that is idle. And a checkpoint past the writer's
    /// head, or at its sequence number with another hash, is another stream's, found as such
    /// (before, all three returned at once).
    #[tokio::test]
    async fn a_check_with_nothing_new_still_reads_the_state_and_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        records_of_labels(&records, &[crate::state::tests::owner("larkfield")]);
        let first = line_hash(&lines_of(&records)[0]).as_str().to_string();
        let head = Some((1, first.as_str()));
        let db = dir.path().join("state.db");
        let places = file_places(&db, dir.path(), &records);
        let state = FlowStateStore::open(&db).unwrap();
        let older = dir.path().join("older.db");
        let settle = |db: &Path| {
            rusqlite::Connection::open(db)
                .unwrap()
                .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
                .unwrap();
        };
        settle(&db);
        std::fs::copy(&db, &older).unwrap();
        let alice = crate::state::tests::key("alice", "s-0");
        state
            .join(&alice, &crate::state::tests::owner("larkfield"))
            .await
            .unwrap();
        check_through(&state, &places, head).await.unwrap();
        settle(&db);
        std::fs::copy(&older, &db).unwrap();
        let err = check_through(&state, &places, head).await.unwrap_err();
        assert!(
            matches!(err, ContinuityError::State(StateError::Replaced { .. })),
            "{err}"
        );

        for (n, (seq, hash)) in [(5, "sha256:00"), (1, "sha256:00")].into_iter().enumerate() {
            let other = FlowStateStore::open(&dir.path().join(format!("other-{n}.db"))).unwrap();
            other.set_checkpoint(seq, hash).await.unwrap();
            let err = check_through(&other, &places, head).await.unwrap_err();
            assert!(matches!(err, ContinuityError::OtherStream(_)), "{err}");
        }
    }

    /// A checkpoint inside the records' last file but past the writer's head is reported
    /// with where the records end for the check (before, as holding no records at all).
    #[tokio::test]
    async fn a_checkpoint_past_the_head_says_where_the_records_end() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        let larkfield = crate::state::tests::owner("larkfield");
        records_of_labels(&records, &[larkfield.clone(), larkfield.clone(), larkfield]);
        let lines = lines_of(&records);
        let (first, third) = (line_hash(&lines[0]), line_hash(&lines[2]));
        let db = dir.path().join("state.db");
        let places = file_places(&db, dir.path(), &records);
        let state = FlowStateStore::open(&db).unwrap();
        state.set_checkpoint(3, third.as_str()).await.unwrap();
        let err = check_through(&state, &places, Some((1, first.as_str())))
            .await
            .unwrap_err();
        assert!(matches!(err, ContinuityError::OtherStream(_)), "{err}");
        assert!(err.to_string().contains("end at record seq 1"), "{err}");
    }

    /// A record missing after the checkpoint (a line, or a whole rotated file, lost) is
    /// found: its raise cannot be checked, so the check refuses. Before, the scan read
    /// whatever lines were left, and a state that lacked the lost record's raise passed.
    #[tokio::test]
    async fn a_record_missing_after_the_checkpoint_is_a_gap() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        let bottom = InformationLabel::bottom();
        records_of_labels(
            &records,
            &[
                bottom.clone(),
                crate::state::tests::owner("larkfield"),
                bottom,
            ],
        );
        let lines = lines_of(&records);
        let hashes = hashes_of(&lines);
        let file = list_record_files(&records).unwrap()[0].path.clone();
        let mut without_second = lines[0].clone();
        without_second.push(b'\n');
        without_second.extend_from_slice(&lines[2]);
        without_second.push(b'\n');
        std::fs::write(&file, without_second).unwrap();
        let db = dir.path().join("state.db");
        let state = FlowStateStore::open(&db).unwrap();
        state.set_checkpoint(1, &hashes[0]).await.unwrap();
        let places = file_places(&db, dir.path(), &records);
        let err = check_through(&state, &places, Some((3, hashes[2].as_str())))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ContinuityError::Gap {
                    previous: 1,
                    found: 3,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("follows seq 1"), "{err}");
        assert_eq!(state.checkpoint().await.unwrap().map(|c| c.0), Some(1));
    }

    /// A state bound to no record is checked against every record, so the records must
    /// start at seq 1. Before, the scan began wherever the files did: with the earliest
    /// rotated files archived, a fresh or emptied state passed, and the labels only those
    /// files proved were lost.
    #[tokio::test]
    async fn a_state_bound_to_no_record_needs_the_records_from_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        let bottom = InformationLabel::bottom();
        records_of_labels(
            &records,
            &[
                crate::state::tests::owner("larkfield"),
                bottom.clone(),
                bottom,
            ],
        );
        let lines = lines_of(&records);
        let hashes = hashes_of(&lines);
        let file = list_record_files(&records).unwrap()[0].path.clone();
        let mut without_first = Vec::new();
        for line in &lines[1..] {
            without_first.extend_from_slice(line);
            without_first.push(b'\n');
        }
        std::fs::write(&file, without_first).unwrap();
        let db = dir.path().join("state.db");
        let state = FlowStateStore::open(&db).unwrap();
        let places = file_places(&db, dir.path(), &records);
        let err = check_through(&state, &places, Some((3, hashes[2].as_str())))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ContinuityError::MissingStart { first: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("start at seq 2"), "{err}");
        assert_eq!(state.checkpoint().await.unwrap(), None);
    }

    /// A rebuild from records every reader refuses is refused too, and writes no state: an
    /// empty (or wrong) directory, or records whose anchor and ring were removed. Before, it
    /// sealed a state anew, bound to nothing or to an end no one vouches for, and exit 0
    /// said it was rebuilt.
    #[test]
    fn a_rebuild_from_records_readers_refuse_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let db = dir.path().join("state.db");
        let e = rebuild(&empty, &db).unwrap_err();
        assert!(
            matches!(e, ContinuityError::NothingToRebuildFrom { .. }),
            "{e}"
        );
        assert!(!db.exists());
        let records = dir.path().join("records");
        records_with_a_spent_grant(&records);
        std::fs::remove_file(records.join(crate::records::store::HEAD_FILE)).unwrap();
        std::fs::remove_file(records.join(crate::records::ring::RING_FILE)).unwrap();
        let e = rebuild(&records, &db).unwrap_err();
        assert!(
            matches!(e, ContinuityError::NothingToRebuildFrom { .. })
                && e.to_string().contains("records.head"),
            "{e}"
        );
        assert!(!db.exists());
    }

    /// A rebuild cut short (killed after opening the state, before raising what the records
    /// prove) leaves a state bound to no record. Before, opening for the rebuild sealed what
    /// the file held with its old checkpoint, so a state that had lost labels behind the
    /// store, once refused as unsealed, passed the next start's check.
    #[tokio::test]
    async fn a_rebuild_cut_short_leaves_a_state_checked_against_every_record() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        records_of_labels(&records, &[crate::state::tests::owner("larkfield")]);
        let db = dir.path().join("state.db");
        rebuild(&records, &db).unwrap();
        let hash = line_hash(&lines_of(&records)[0]).as_str().to_string();
        // alice's label is lost behind the store: refused as unsealed.
        rusqlite::Connection::open(&db)
            .unwrap()
            .execute("DELETE FROM principal_labels", [])
            .unwrap();
        assert!(FlowStateStore::open(&db).is_err());
        // The rebuild the error asks for opens the file, then is cut short.
        drop(SqliteStore::open_to_rebuild(&db).unwrap());
        let state = FlowStateStore::open(&db).unwrap();
        assert_eq!(state.checkpoint().await.unwrap(), None);
        let places = file_places(&db, dir.path(), &records);
        let err = check_through(&state, &places, Some((1, hash.as_str())))
            .await
            .unwrap_err();
        assert!(matches!(err, ContinuityError::Behind(_)), "{err}");
        // A rebuild run to its end restores the label and the binding.
        drop(state);
        rebuild(&records, &db).unwrap();
        let state = FlowStateStore::open(&db).unwrap();
        assert_eq!(state.checkpoint().await.unwrap(), Some((1, hash.clone())));
    }

    /// After a checkpoint, the lines before it in its file are not decoded when the file's
    /// name puts the checkpoint's line where it is; a file whose lines are not numbered as
    /// its name says is read from its first line, and the checkpoint still found.
    #[test]
    fn the_lines_before_the_checkpoint_are_skipped_only_where_their_numbers_allow() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        records_of_one_principal(&records, 300);
        let hash = line_hash(&lines_of(&records)[249]).as_str().to_string();
        let end = scan(&records, Some((250, &hash)), None, false, &mut |_| Ok(())).unwrap();
        assert!(matches!(end.checkpoint, CheckpointFound::Matches));
        assert_eq!(
            end.records, 51,
            "the lines before the checkpoint were decoded"
        );
        assert_eq!(end.head.map(|h| h.0), Some(300));
        let file = &list_record_files(&records).unwrap()[0].path;
        std::fs::rename(
            file,
            records.join(crate::records::store::record_file_name(2)),
        )
        .unwrap();
        let end = scan(&records, Some((250, &hash)), None, false, &mut |_| Ok(())).unwrap();
        assert!(matches!(end.checkpoint, CheckpointFound::Matches));
        assert_eq!(end.records, 300);
    }

    /// The records after the checkpoint grow with the run between checks (and without
    /// bound when a state stays behind): what the scan holds while it reads them must not.
    #[test]
    fn what_the_scan_holds_does_not_grow_with_the_records() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        records_of_one_principal(&records, 300);
        let db = dir.path().join("state.db");
        let places = file_places(&db, dir.path(), &records);
        let alice = PrincipalId::new("alice").unwrap();
        let mut held = StateSnapshot::default();
        held.principals
            .insert(alice.clone(), crate::state::tests::owner("larkfield"));
        let home = places.home(&FlowStateStore::open(places.db).unwrap());
        let (end, owed) = read_owed(&places, &home, None, None, Some(&held)).unwrap();
        assert_eq!(end.records, 300);
        assert_eq!(owed.held(), 0, "the check holds something per record");
        // The first record the state does not hold is kept for the refusal, naming it;
        // the later ones add nothing.
        held.principals.insert(alice, InformationLabel::bottom());
        let (_, owed) = read_owed(&places, &home, None, None, Some(&held)).unwrap();
        assert_eq!(owed.held(), 0);
        let err = owed.behind.unwrap().to_string();
        assert!(
            err.contains("record seq 1 ") && err.contains("principal alice"),
            "{err}"
        );
        // A rebuild folds them into one label per principal.
        let mut proven = Proven::default();
        scan(&records, None, None, true, &mut |seen| {
            proven.take(seen);
            Ok(())
        })
        .unwrap();
        assert_eq!(proven.principals.len(), 1);
        assert_eq!(proven.sessions.len(), 300);
    }

    /// Where a SQLite state file `db` lives, beside the records of `records`.
    fn file_places<'a>(db: &'a Path, state_dir: &'a Path, records: &'a Path) -> Places<'a> {
        Places {
            db,
            state_dir,
            records,
            host_id: None,
        }
    }

    /// A lab PostgreSQL server holding host `web-1`'s flow state (its schema made), and an
    /// empty record directory beside it.
    struct SharedLab {
        pg: crate::lab::postgres::Postgres,
        settings: crate::config::PostgresStateConfig,
        state: FlowStateStore,
        dir: tempfile::TempDir,
        records: PathBuf,
    }

    impl SharedLab {
        /// `None` (saying why) where no PostgreSQL server can run here.
        async fn start() -> Option<SharedLab> {
            let pg = crate::lab::postgres::Postgres::start_unless_unavailable().unwrap()?;
            let settings = pg.settings("web-1");
            crate::state::postgres::migrate(&settings).await.unwrap();
            let state = FlowStateStore::with_backend(Box::new(
                crate::state::postgres::PostgresStore::open(&settings)
                    .await
                    .unwrap(),
            ));
            let dir = tempfile::tempdir().unwrap();
            let records = dir.path().join("records");
            Some(SharedLab {
                pg,
                settings,
                state,
                dir,
                records,
            })
        }

        /// Where host `web-1`'s state and records are.
        fn places(&self) -> Places<'_> {
            Places {
                db: &self.settings.url_file,
                state_dir: self.dir.path(),
                records: &self.records,
                host_id: Some("web-1"),
            }
        }
    }

    /// On a shared PostgreSQL store the messages say what works there, naming the database
    /// and this host's `host_id`: `state rebuild` writes a SQLite file the host would not
    /// read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shared_databases_refusals_say_what_works_there() {
        let Some(lab) = SharedLab::start().await else {
            return;
        };
        records_of_one_principal(&lab.records, 2);
        let (state, places) = (&lab.state, lab.places());
        let database = format!("127.0.0.1:{}/postgres", lab.pg.port);
        let behind = check(state, &places).await.unwrap_err().to_string();
        let other = {
            state.set_checkpoint(99, "sha256:00").await.unwrap();
            check(state, &places).await.unwrap_err().to_string()
        };
        for err in [&behind, &other] {
            assert!(
                err.contains(&database) && err.contains("web-1") && !err.contains("--state-dir"),
                "{err}"
            );
        }
        let url_file = lab.settings.url_file.display().to_string();
        assert!(
            behind.contains("restore") && behind.contains(&url_file),
            "{behind}"
        );
        assert!(other.contains("host_id"), "{other}");
    }

    /// A shared database that reads a principal lower than this host has seen gives no
    /// labels to compare, but the grants the records show spent are still checked: one the
    /// database lost with the label (restored from an older backup) is found, not left to be
    /// spent again. Before, the check stopped at the lowered label. The label seen is written
    /// back, so the next check finds the database whole again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_reading_lower_still_has_its_spent_grants_checked() {
        let Some(lab) = SharedLab::start().await else {
            return;
        };
        let larkfield = crate::state::tests::owner("larkfield");
        records_with_spent_grants(&lab.records, &["g-1", "g-2"], &larkfield);
        let (state, places) = (&lab.state, lab.places());
        // As the calls did: the grants spent, and the principal's label raised.
        for g in ["g-1", "g-2"] {
            assert!(state.consume_grant(g, 1).await.unwrap());
        }
        let alice = crate::state::tests::key("alice", "s-9");
        state.join(&alice, &larkfield).await.unwrap();
        // The database restored from before both.
        let raw = lab.pg.client().await.unwrap();
        let bottom = InformationLabel::bottom().to_canonical_json();
        raw.execute(
            "UPDATE principal_labels SET label = $1 WHERE principal = 'alice'",
            &[&bottom],
        )
        .await
        .unwrap();
        raw.execute("DELETE FROM consumed_grants", &[])
            .await
            .unwrap();
        let err = check(state, &places).await.unwrap_err();
        assert!(
            matches!(err, ContinuityError::Behind(_))
                && err.to_string().contains("grant \"g-1\" spent"),
            "{err}"
        );
        // Both lost grants were marked spent again, not only the one reported; and the
        // store that found the database lower takes no grant at all any more.
        let spent: i64 = raw
            .query_one(
                "SELECT count(*) FROM consumed_grants WHERE grant_id IN ('g-1', 'g-2')",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(spent, 2);
        assert!(
            state.consume_grant("g-3", 1).await.is_err(),
            "a grant taken after the loss"
        );
        // The label it had seen was written back: the database holds what the records
        // prove again, so a second check passes and binds the records.
        check(state, &places).await.unwrap();
        assert!(state.checkpoint().await.unwrap().is_some());
    }

    /// A state that lost the grants it spent (restored, truncated, rebuilt) would accept
    /// them again: a rebuild marks every grant the records name as spent, and a start on a
    /// state that lacks one is refused.
    /// A state behind the records on a label (a restored older copy) is refused, but only
    /// once every grant the records show spent is marked spent in it, those after that
    /// record too: the refusal stops this host, not another sharing the database, which
    /// would otherwise accept them again. Before, the label's refusal ended the scan first.
    #[tokio::test]
    async fn a_label_found_behind_still_has_every_spent_grant_marked() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        records_with_spent_grants(
            &records,
            &["g-1", "g-2"],
            &crate::state::tests::owner("larkfield"),
        );
        let db = dir.path().join("state.db");
        let state = FlowStateStore::open(&db).unwrap();
        let places = file_places(&db, dir.path(), &records);
        let err = check(&state, &places).await.unwrap_err();
        assert!(
            err.to_string().contains("carrying a label") && err.to_string().contains("alice"),
            "{err}"
        );
        drop(state);
        let store = SqliteStore::open(&db).unwrap();
        for id in ["g-1", "g-2"] {
            assert!(
                !store.consume_grant(id, 1).unwrap(),
                "grant {id} can be spent again"
            );
        }
    }

    /// A record directory holding one call of alice per `(grant, verdict)`.
    fn records_of_grant_calls(dir: &Path, calls: &[(&str, crate::decision::Verdict)]) {
        let w = RecordWriter::open(dir, WriterOptions::default()).unwrap();
        for (id, verdict) in calls {
            let mut call = crate::records::tests::sample_tool_call_judged(verdict.clone());
            call.flowhost.grant = Some(GrantFacts {
                id: id.to_string(),
                purpose: "reviewed-summary".into(),
            });
            call.flowhost.labels_after = Some(LabelsAfter {
                principal: InformationLabel::bottom(),
                session: InformationLabel::bottom(),
            });
            w.commit_blocking(call).unwrap();
        }
        w.close_blocking().unwrap();
    }

    /// A refused call's grant id may be one a client made up (its envelope failed to
    /// verify): a rebuild that marked it spent would refuse the authority's real grant of
    /// that id. A call the host failed may have spent its grant: that one stays spent.
    #[tokio::test]
    async fn only_grants_a_call_may_have_spent_are_marked_spent() {
        use crate::decision::{Denial, Failure, Verdict};
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        records_of_grant_calls(
            &records,
            &[
                (
                    "ticket-42",
                    Verdict::refused(Denial::GrantUntrustedAuthority),
                ),
                ("ticket-43", Verdict::Failed(Failure::StateFailure)),
            ],
        );

        let rebuilt = dir.path().join("rebuilt.db");
        let report = rebuild(&records, &rebuilt).unwrap();
        assert_eq!(report.grants, 1);
        let state = SqliteStore::open(&rebuilt).unwrap();
        assert!(
            state.consume_grant("ticket-42", 1).unwrap(),
            "a grant no call spent is refused as spent after a rebuild"
        );
        assert!(!state.consume_grant("ticket-43", 1).unwrap());

        // A state that never spent the failed call's grant lost nothing: it starts, with the
        // grant marked spent, as the records leave it possibly spent.
        let fresh = dir.path().join("fresh.db");
        let state = FlowStateStore::open(&fresh).unwrap();
        let places = file_places(&fresh, dir.path(), &records);
        check(&state, &places).await.unwrap();
        drop(state);
        let state = SqliteStore::open(&fresh).unwrap();
        assert!(
            !state.consume_grant("ticket-43", 1).unwrap(),
            "a grant a failed call may have spent is accepted again"
        );
        assert!(state.consume_grant("ticket-42", 1).unwrap());
    }

    #[tokio::test]
    async fn grants_the_records_show_spent_stay_spent() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records");
        records_with_a_spent_grant(&records);

        let rebuilt = dir.path().join("rebuilt.db");
        let report = rebuild(&records, &rebuilt).unwrap();
        assert_eq!(report.grants, 1);
        assert!(
            !SqliteStore::open(&rebuilt)
                .unwrap()
                .consume_grant("g-1", 1)
                .unwrap(),
            "the rebuilt state accepts the spent grant again"
        );

        let fresh = dir.path().join("fresh.db");
        let state = FlowStateStore::open(&fresh).unwrap();
        let places = file_places(&fresh, dir.path(), &records);
        let err = check(&state, &places).await.unwrap_err();
        assert!(
            err.to_string().contains("grant \"g-1\" spent")
                && err.to_string().contains("state rebuild"),
            "{err}"
        );
        // The check put the grant back itself: the refusal says so, not that starting
        // would forget it.
        assert!(
            err.to_string().contains("marked spent again now")
                && !err.to_string().contains("Starting would forget it"),
            "{err}"
        );
    }
}
