//! The write-ahead ring (`records.wal`): where a record is first made durable.
//!
//! Why it exists: a record file only grows, so every `fdatasync` after an append must also
//! write the file's new size, and on ext4 that is a third device round trip (data, inode,
//! flush) on every call. The ring is a file of fixed size whose blocks were all written once,
//! with zeros, when it was made: writing a record into it and syncing it changes no metadata,
//! so the sync is the data and the flush only. A record is durable once its entry in the ring
//! is synced. Its line is written to the record file at the same moment (readable at once),
//! and the record file is synced later, at a *checkpoint*, off every caller's path. At open,
//! the entries after the last checkpoint are replayed into the record file, so the record
//! files hold every durable record again before anything reads them. Until then (after a
//! machine crash, before the next open), readers of the directory refuse it rather than read
//! a stream that lacks durable records (see `store::list_record_files`).
//!
//! Guarantees:
//! * An entry is only ever overwritten once the record file holding its line is synced and a
//!   checkpoint saying so is durable in the ring's header.
//! * A checkpoint never moves back: one naming an earlier place than the last one written is
//!   dropped.
//! * Once an `fdatasync` of the ring, or of a record file before a checkpoint, has failed,
//!   every later one fails too: Linux reports a lost write-back only once per open file, so
//!   a later sync that succeeds proves nothing about the pages lost before it.
//! * Reading back returns the entries after the checkpoint that are intact (their SHA-256
//!   matches), consecutive in sequence and chained (each line's `prev_hash` is the hash of the
//!   line before), and stops at the first that is not: a torn or stale entry ends the replay.
//!
//! Layout: two header slots of 512 bytes at offsets 0 and 4096 (a block each), written
//! alternately, each
//! with a counter and its own SHA-256 (the valid one with the higher counter holds the
//! checkpoint); entries from [`DATA_START`] to the end: `FHWE`, the line's length (u32, LE),
//! its seq (u64, LE), the SHA-256 of the line (32 bytes), then the line without its newline.
//! An entry that does not fit before the end goes to [`DATA_START`], after a wrap mark
//! (`FHWW`) where four bytes remain.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use sha2::{Digest, Sha256};

use crate::files::write_atomic_with;
use crate::records::DecisionRecord;
use crate::records::chain::{ChainHash, line_hash};

/// The ring's file name in a record directory.
pub const RING_FILE: &str = "records.wal";

/// Where entries start (the header slots come first).
const DATA_START: u64 = 2 * SLOT_BLOCK;
const SLOT_BYTES: usize = 512;
/// Each header slot has a block of its own, so that one torn block write cannot take both.
const SLOT_BLOCK: u64 = 4096;
const ENTRY_HEAD: u64 = 48;
const ENTRY_MAGIC: &[u8; 4] = b"FHWE";
const WRAP_MAGIC: &[u8; 4] = b"FHWW";
const SLOT_MAGIC: &[u8; 4] = b"FHWC";
const SLOT_VERSION: u32 = 1;
/// The smallest ring that is accepted: room for about twenty records of 1-2 KB.
pub const MIN_RING_BYTES: u64 = DATA_START + 32 * 1024;
/// The largest ring that is accepted (the writer makes 4 MiB by default): readers hold a ring
/// in memory, so a larger one (a sparse file of many gigabytes) is refused rather than
/// read.
pub const MAX_RING_BYTES: u64 = 256 * 1024 * 1024;

/// A place in the stream up to which the record files are durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The record file the stream continues in (file name only).
    pub file: String,
    /// Its durable length: whole lines only.
    pub bytes: u64,
    /// How many lines those bytes hold.
    pub lines: u64,
    /// The last record in the record files (0: none yet).
    pub seq: u64,
    /// Its line hash (genesis if none).
    pub hash: ChainHash,
    /// Where in the ring the entry of record `seq + 1` goes.
    pub ring_at: u64,
}

/// A record read back from the ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingEntry {
    /// Its sequence number.
    pub seq: u64,
    /// Its line, without the newline.
    pub line: Vec<u8>,
}

/// Where the next entry goes; kept by the appender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// The offset in the ring.
    pub at: u64,
    /// Bytes of ring used since the ring was opened, wrap gaps included: only compared with
    /// the checkpoint's, to know how much of the ring is still needed.
    pub used: u64,
}

/// Why the ring cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// Reading, writing or syncing it failed.
    #[error("cannot {op} the write-ahead ring {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The ring file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Its header holds no valid checkpoint, or it is too small.
    #[error(
        "{path}: {problem}; move it aside to start a new one once the record files are reviewed"
    )]
    Corrupt {
        /// The ring file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
}

struct Header {
    counter: u64,
    /// The order key of the last checkpoint written since open (see [`Ring::checkpoint`]).
    last: Option<(u64, String, u64)>,
}

/// An open ring, shared by the appender and the sync thread.
pub struct Ring {
    file: File,
    path: PathBuf,
    size: u64,
    header: Mutex<Header>,
    /// `Cursor::used` at the last durable checkpoint: the ring before it may be overwritten.
    checkpoint_used: AtomicU64,
    /// Every `fdatasync` of the ring runs under this lock, which remembers a failed one: the
    /// kernel reports a lost write-back once per open file, so a sync after a failed one
    /// could succeed over pages that never reached the disk. Once one fails, all do.
    sync_failed: Mutex<Option<String>>,
    /// The same for the record files' syncs, which checkpoints vouch for.
    record_sync_failed: Mutex<Option<String>>,
}

impl Ring {
    /// Opens the ring of `dir`, or makes one of `size` bytes (all written) if there is none,
    /// then writes `checkpoint` as its current one, with its entries starting at the ring's
    /// start (whatever `checkpoint.ring_at` says). A ring it makes holds that checkpoint
    /// before it takes its name, so it is never found without a valid one. Returns the ring and the cursor its next
    /// entry goes to. A ring smaller than any the writer makes is refused.
    pub fn open(
        dir: &Path,
        size: u64,
        checkpoint: &Checkpoint,
    ) -> Result<(Ring, Cursor), RingError> {
        let path = dir.join(RING_FILE);
        let io = |op| {
            let path = path.clone();
            move |source| RingError::Io { op, path, source }
        };
        // Never through a link: a ring put in as one would be another stream's.
        let existing = match fs::symlink_metadata(&path) {
            Ok(m) if !m.is_file() => {
                return Err(io("inspect")(io::Error::other(
                    "not a regular file (a symbolic link?)",
                )));
            }
            Ok(m) if m.len() > MAX_RING_BYTES => return Err(too_large(path, m.len())),
            Ok(m) if m.len() >= MIN_RING_BYTES => Some(m.len()),
            Ok(m) => return Err(too_small(path, m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io("inspect")(e)),
        };
        let cursor = Cursor {
            at: DATA_START,
            used: 0,
        };
        let start = Checkpoint {
            ring_at: cursor.at,
            ..checkpoint.clone()
        };
        let size = match existing {
            Some(len) => len,
            None => {
                let size = size.clamp(MIN_RING_BYTES, MAX_RING_BYTES);
                write_atomic_with(&path, 0o600, |out| {
                    // The first checkpoint is written with the zeros, so the ring is valid
                    // once it has its name: a crash right after the rename must not leave a
                    // ring without a valid header slot, which every later open refuses.
                    let mut header = vec![0u8; DATA_START as usize];
                    let at = slot_offset(FIRST_COUNTER) as usize;
                    header[at..at + SLOT_BYTES]
                        .copy_from_slice(&encode_slot(FIRST_COUNTER, &start));
                    out.write_all(&header)?;
                    let zeros = vec![0u8; 64 * 1024];
                    let mut left = size - DATA_START;
                    while left > 0 {
                        let n = left.min(zeros.len() as u64) as usize;
                        out.write_all(&zeros[..n])?;
                        left -= n as u64;
                    }
                    Ok(())
                })
                .map_err(|e| match e {
                    crate::files::FileError::Write { source, .. } => io("create")(source),
                    other => io("create")(io::Error::other(other.to_string())),
                })?;
                #[cfg(test)]
                if STOP_AFTER_MAKING.with(|stop| stop.replace(false)) {
                    return Err(io("create")(io::Error::other("stopped by the test")));
                }
                size
            }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io("open"))?;
        let (counter, last) = if existing.is_some() {
            let mut slots = vec![0u8; DATA_START as usize];
            file.read_exact_at(&mut slots, 0).map_err(io("read"))?;
            (read_slots(&slots).map_or(0, |(counter, _)| counter), None)
        } else {
            // Made with `start` as its checkpoint, which is durable: the rename was synced.
            (
                FIRST_COUNTER,
                Some((cursor.used, start.file.clone(), start.bytes)),
            )
        };
        let ring = Ring {
            file,
            path,
            size,
            header: Mutex::new(Header { counter, last }),
            checkpoint_used: AtomicU64::new(0),
            sync_failed: Mutex::new(None),
            record_sync_failed: Mutex::new(None),
        };
        ring.checkpoint(&start, cursor.used)?;
        Ok((ring, cursor))
    }

    /// Whether an entry for a line of `len` bytes fits at `cursor` without overwriting one
    /// the last checkpoint still needs.
    pub fn has_room(&self, cursor: Cursor, len: usize) -> bool {
        let (_, used) = self.place(cursor, len);
        used.saturating_sub(self.checkpoint_used.load(Ordering::Acquire)) <= self.size - DATA_START
    }

    /// Whether more than half the ring is used since the last checkpoint (by a cursor's
    /// `used`): time to checkpoint, before an appender has to.
    pub fn wants_checkpoint(&self, used: u64) -> bool {
        used.saturating_sub(self.checkpoint_used.load(Ordering::Acquire))
            > (self.size - DATA_START) / 2
    }

    /// Whether an entry for a line of `len` bytes could ever fit.
    pub fn can_hold(&self, len: usize) -> bool {
        ENTRY_HEAD + len as u64 <= self.size - DATA_START
    }

    /// Where an entry for a line of `len` bytes starts, and the cursor's `used` after it.
    fn place(&self, cursor: Cursor, len: usize) -> (u64, u64) {
        let need = ENTRY_HEAD + len as u64;
        if cursor.at + need > self.size {
            (DATA_START, cursor.used + (self.size - cursor.at) + need)
        } else {
            (cursor.at, cursor.used + need)
        }
    }

    /// Writes the entry of record `seq` (its `line` without the newline, `hash` its
    /// SHA-256) at `cursor` and advances it; the entry is put together in `scratch`, which
    /// the caller may hand back next time. The caller checked [`Ring::has_room`].
    pub fn append(
        &self,
        cursor: &mut Cursor,
        seq: u64,
        hash: &[u8; 32],
        line: &[u8],
        scratch: &mut Vec<u8>,
    ) -> Result<(), RingError> {
        let io = |op| {
            let path = self.path.clone();
            move |source| RingError::Io { op, path, source }
        };
        let (at, used) = self.place(*cursor, line.len());
        if at != cursor.at && self.size - cursor.at >= 4 {
            self.file
                .write_all_at(WRAP_MAGIC, cursor.at)
                .map_err(io("write a wrap mark in"))?;
        }
        let len = u32::try_from(line.len())
            .map_err(|_| io("write")(io::Error::other("line too long")))?;
        let entry = scratch;
        entry.clear();
        entry.extend_from_slice(ENTRY_MAGIC);
        entry.extend_from_slice(&len.to_le_bytes());
        entry.extend_from_slice(&seq.to_le_bytes());
        entry.extend_from_slice(hash);
        entry.extend_from_slice(line);
        self.file
            .write_all_at(entry, at)
            .map_err(io("write an entry to"))?;
        *cursor = Cursor {
            at: at + ENTRY_HEAD + line.len() as u64,
            used,
        };
        Ok(())
    }

    /// Makes every entry written so far durable (`fdatasync`: the blocks were written when
    /// the ring was made, so no metadata goes with them).
    pub fn sync(&self) -> Result<(), RingError> {
        self.sync_as("fdatasync")
    }

    /// Syncs the record file `file` (at `path`) before a checkpoint vouches for it; once one
    /// such sync has failed, every later one fails too (see `sync_failed`). Fails as well
    /// unless `path` still names `file`: one removed, moved away or replaced (`sed -i`) while
    /// the writer runs holds what it acknowledges in an inode no name reaches, lost when the
    /// process ends, so no checkpoint may vouch for it.
    pub fn sync_record_file(&self, file: &File, path: &Path) -> Result<(), String> {
        sync_unless_failed(&self.record_sync_failed, file)
            .map_err(|e| format!("cannot fdatasync {}: {e}", path.display()))?;
        if crate::files::still_names(path, file)
            .map_err(|e| format!("cannot look at {}: {e}", path.display()))?
        {
            return Ok(());
        }
        Err(format!(
            "cannot keep records in {}: it was removed or replaced while the writer ran, so \
             records written to it since are held by no file name and would be lost",
            path.display()
        ))
    }

    /// Fails unless the ring's path still names the file this writer holds: one removed or
    /// renamed away while the writer runs would hold what it makes durable in a file the
    /// directory no longer names (a power loss takes it with it, the next open refuses the
    /// directory), so the writer fails at its next checkpoint (about a second, and its
    /// close) rather than go on acknowledging records until then.
    fn still_named(&self) -> Result<(), RingError> {
        let named =
            crate::files::still_names(&self.path, &self.file).map_err(|source| RingError::Io {
                op: "look at",
                path: self.path.clone(),
                source,
            })?;
        if named {
            return Ok(());
        }
        Err(RingError::Io {
            op: "keep records in",
            path: self.path.clone(),
            source: io::Error::new(
                io::ErrorKind::NotFound,
                "it was removed or replaced while the writer ran, so records made durable in \
                 it since would not survive a power loss; records written before that are in \
                 the record files",
            ),
        })
    }

    fn sync_as(&self, op: &'static str) -> Result<(), RingError> {
        sync_unless_failed(&self.sync_failed, &self.file).map_err(|source| RingError::Io {
            op,
            path: self.path.clone(),
            source,
        })
    }

    /// Writes `checkpoint` (its record file must already be synced up to it) to the header
    /// and syncs it; `used` is the cursor's at the checkpoint's `ring_at`. Checkpoints are
    /// ordered by ring use, then record file (their names sort in chain order), then bytes: one
    /// not after the last one written changes nothing, so that a sync thread's late checkpoint
    /// never undoes one the appender wrote at a rotation.
    pub fn checkpoint(&self, checkpoint: &Checkpoint, used: u64) -> Result<(), RingError> {
        self.still_named()?;
        let mut header = self.header.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (used, checkpoint.file.clone(), checkpoint.bytes);
        if header.last.as_ref().is_some_and(|last| key <= *last) {
            return Ok(());
        }
        let counter = header.counter + 1;
        let slot = encode_slot(counter, checkpoint);
        let offset = slot_offset(counter);
        self.file
            .write_all_at(&slot, offset)
            .map_err(|source| RingError::Io {
                op: "write a checkpoint to",
                path: self.path.clone(),
                source,
            })?;
        self.sync_as("sync a checkpoint of")?;
        *header = Header {
            counter,
            last: Some(key),
        };
        self.checkpoint_used.fetch_max(used, Ordering::AcqRel);
        Ok(())
    }
}

#[cfg(test)]
thread_local! {
    /// Set by a test: the next [`Ring::open`] on this thread that makes a ring stops right
    /// after renaming it into place, as a crash there would.
    pub(crate) static STOP_AFTER_MAKING: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}

fn too_large(path: PathBuf, len: u64) -> RingError {
    RingError::Corrupt {
        path,
        problem: format!(
            "it has {len} bytes, more than any ring the writer makes ({MAX_RING_BYTES})"
        ),
    }
}

fn too_small(path: PathBuf, len: u64) -> RingError {
    RingError::Corrupt {
        path,
        problem: format!(
            "it has {len} bytes, fewer than any ring the writer makes ({MIN_RING_BYTES})"
        ),
    }
}

/// `fdatasync`s `file` under `failed`, which remembers the first failure: after it, every
/// call fails without syncing.
fn sync_unless_failed(failed: &Mutex<Option<String>>, file: &File) -> io::Result<()> {
    let mut failed = failed.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(first) = &*failed {
        return Err(io::Error::other(format!(
            "an earlier fdatasync failed: {first}"
        )));
    }
    file.sync_data()
        .inspect_err(|e| *failed = Some(e.to_string()))
}

/// Reads the ring of `dir`: its checkpoint and the records after it (see the module docs).
/// `None` if the directory has no ring.
pub fn read_back(dir: &Path) -> Result<Option<(Checkpoint, Vec<RingEntry>)>, RingError> {
    let path = dir.join(RING_FILE);
    let io_error = |op: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| RingError::Io { op, path, source }
    };
    let corrupt = |problem: &str| RingError::Corrupt {
        path: path.clone(),
        problem: problem.to_string(),
    };
    // Never followed nor waited on: a FIFO in its place would block the reader.
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(corrupt("it is a symbolic link"));
        }
        Err(source) => return Err(io_error("open", &path)(source)),
    };
    let meta = file.metadata().map_err(io_error("read", &path))?;
    if !meta.is_file() {
        return Err(corrupt("it is not a regular file"));
    }
    let size = meta.len();
    if size < MIN_RING_BYTES {
        // The writer only renames a whole ring into place: a smaller one was cut, and the
        // records it held past its checkpoint with it.
        return Err(too_small(path, size));
    }
    if size > MAX_RING_BYTES {
        return Err(too_large(path, size));
    }
    let mut header = vec![0u8; DATA_START as usize];
    file.read_exact_at(&mut header, 0)
        .map_err(io_error("read", &path))?;
    let Some((_, checkpoint)) = read_slots(&header) else {
        return Err(corrupt("neither header slot holds a valid checkpoint"));
    };
    if checkpoint.ring_at < DATA_START || checkpoint.ring_at > size {
        return Err(corrupt("the checkpoint points outside the ring"));
    }
    // Most reads find nothing after the checkpoint (a writer that closed, or one whose sync
    // thread checkpointed moments ago): the first entry's head says so without reading the
    // whole ring.
    if checkpoint.ring_at + ENTRY_HEAD <= size {
        let mut head = [0u8; ENTRY_HEAD as usize];
        file.read_exact_at(&mut head, checkpoint.ring_at)
            .map_err(io_error("read", &path))?;
        let seq = u64::from_le_bytes(head[8..16].try_into().unwrap_or([0; 8]));
        if &head[..4] != WRAP_MAGIC
            && (&head[..4] != ENTRY_MAGIC || Some(seq) != checkpoint.seq.checked_add(1))
        {
            return Ok(Some((checkpoint, Vec::new())));
        }
    }
    let mut bytes = vec![0u8; size as usize];
    file.read_exact_at(&mut bytes, 0)
        .map_err(io_error("read", &path))?;
    let entries = entries_after(&bytes, &checkpoint);
    Ok(Some((checkpoint, entries)))
}

/// How many of `entries` the bytes `have` (a record file from the checkpoint's offset on)
/// hold, in order and each as a whole line, and how many bytes those lines take.
pub fn held_in_file(have: &[u8], entries: &[RingEntry]) -> (usize, usize) {
    let mut matched = 0usize;
    let mut kept = 0usize;
    for entry in entries {
        let rest = &have[matched..];
        if rest.len() > entry.line.len()
            && rest.starts_with(&entry.line)
            && rest[entry.line.len()] == b'\n'
        {
            matched += entry.line.len() + 1;
            kept += 1;
        } else {
            break;
        }
    }
    (kept, matched)
}

/// What the record files beyond the one a checkpoint names hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaterFiles {
    /// There are none: the checkpoint names the last record file.
    None,
    /// There are, all empty (a rotation stopped before its checkpoint).
    Empty,
    /// At least one holds bytes.
    HoldBytes,
}

/// What opening a record directory after a crash does to make its files hold exactly the
/// durable records. The writer acts on it, and readers refuse whatever it would change, so
/// that what a reader accepts is what the stream keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayPlan {
    /// The files already hold exactly the durable records.
    Nothing,
    /// The checkpoint's file (the last) keeps `matched` bytes past the checkpoint, which
    /// hold the first `kept` entries; what follows them (no durable record: a crash
    /// mid-write, never acknowledged) is cut, and the entries after `kept` are written back.
    Rewrite {
        /// How many of the ring's entries the file holds.
        kept: usize,
        /// The bytes they take past the checkpoint.
        matched: usize,
    },
    /// Later record files hold bytes although the checkpoint names an earlier one: no crash
    /// leaves this, and the writer refuses the directory.
    LaterFilesHoldRecords,
    /// The checkpoint's file no longer ends a line where the checkpoint says its durable
    /// part ends: it was changed below the checkpoint, which no crash does. The writer
    /// refuses it (a rewrite from there would splice two lines); readers report its lines.
    ChangedBelowCheckpoint,
}

/// The plan for a checkpoint's file holding `have` past the checkpoint, given whether the
/// bytes before it end a line (`durable_ends_a_line`, true at the file's start), the ring's
/// `entries` after it and what the record files after it hold.
pub fn replay_plan(
    have: &[u8],
    durable_ends_a_line: bool,
    entries: &[RingEntry],
    later: LaterFiles,
) -> ReplayPlan {
    if !durable_ends_a_line {
        return ReplayPlan::ChangedBelowCheckpoint;
    }
    let (kept, matched) = held_in_file(have, entries);
    match later {
        // A rotation syncs the old file before it creates the next one, so past the ring's
        // entries the old file may hold records whose copies in the ring were not yet
        // synced: durable in the file, and the new file's name says the chain goes on from
        // them (which reopening checks).
        LaterFiles::Empty if kept == entries.len() => ReplayPlan::Nothing,
        LaterFiles::Empty | LaterFiles::HoldBytes => ReplayPlan::LaterFilesHoldRecords,
        LaterFiles::None if kept == entries.len() && matched == have.len() => ReplayPlan::Nothing,
        LaterFiles::None => ReplayPlan::Rewrite { kept, matched },
    }
}

/// What a writer's next open of a record directory would change in its files, as a crash
/// leaves them until a writer opens the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unreplayed {
    /// Records `first` to `last` are durable in the ring but missing from the files.
    Missing {
        /// The first missing record.
        first: u64,
        /// The last record in the ring.
        last: u64,
    },
    /// The last record file ends in whole lines past its last durable record (`bytes` in
    /// all), which the open cuts into a sidecar.
    Uncommitted {
        /// The record file.
        file: PathBuf,
        /// How many bytes.
        bytes: u64,
    },
}

/// What a writer's next open of `dir`, whose record files are `files` (in chain order),
/// would change in them; `None` when nothing, or there is no ring. Only meaningful while no
/// writer has the directory open.
pub fn unreplayed(dir: &Path, files: &[PathBuf]) -> Result<Option<Unreplayed>, RingError> {
    Ok(unreplayed_and_checkpoint(dir, files)?.and_then(|(_, unreplayed)| unreplayed))
}

/// [`unreplayed`], with the ring's checkpoint it was judged by (`None`: there is no ring). A
/// reader checks the stream against it (see `chain::verify_records`): the lines it made
/// durable are the stream's, whatever the head anchor names.
pub fn unreplayed_and_checkpoint(
    dir: &Path,
    files: &[PathBuf],
) -> Result<Option<(Checkpoint, Option<Unreplayed>)>, RingError> {
    let Some((checkpoint, entries)) = read_back(dir)? else {
        return Ok(None);
    };
    let unreplayed = judge_unreplayed(dir, files, &checkpoint, &entries)?;
    Ok(Some((checkpoint, unreplayed)))
}

fn judge_unreplayed(
    dir: &Path,
    files: &[PathBuf],
    checkpoint: &Checkpoint,
    entries: &[RingEntry],
) -> Result<Option<Unreplayed>, RingError> {
    let path = dir.join(&checkpoint.file);
    let read_failed = |source| RingError::Io {
        op: "read the record file named by",
        path: dir.join(RING_FILE),
        source,
    };
    // The checkpoint says this much of the file was durable: a file that is gone or shorter
    // lost records that copying the ring's entries after them cannot restore (a writer
    // refuses to open it too), so no replay is offered.
    let short = |len: Option<u64>| RingError::Corrupt {
        path: dir.join(RING_FILE),
        problem: format!(
            "its checkpoint says {} held {} durable bytes, but it {}",
            path.display(),
            checkpoint.bytes,
            match len {
                Some(len) => format!("holds {len}"),
                None => "is missing".into(),
            }
        ),
    };
    // With nothing past the checkpoint, a file cut below it (or gone) is for the reader's
    // own checks to report, with file and line (they take the checkpoint as a witness of the
    // stream's end, as the head anchor is): no crash does that.
    let Some(position) = files.iter().position(|f| *f == path) else {
        if entries.is_empty() {
            return Ok(None);
        }
        return Err(short(None));
    };
    let (have, ends_a_line) = match super::store::open_record_file_io(&path) {
        Ok(file) => {
            let len = file.metadata().map_err(read_failed)?.len();
            if len < checkpoint.bytes {
                if entries.is_empty() {
                    return Ok(None);
                }
                return Err(short(Some(len)));
            }
            if let Some(problem) = past_checkpoint_problem(len, checkpoint.bytes) {
                return Err(RingError::Corrupt {
                    path: dir.join(RING_FILE),
                    problem: format!("{}: {problem}", path.display()),
                });
            }
            read_past_checkpoint(&file, len, checkpoint.bytes).map_err(read_failed)?
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound && entries.is_empty() => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(short(None)),
        Err(source) => return Err(read_failed(source)),
    };
    // Lines below the checkpoint cut or edited: the same as a file cut short. (One that no
    // longer ends a line there is the plan's `ChangedBelowCheckpoint`.)
    if ends_a_line {
        let previous = position.checked_sub(1).map(|i| files[i].as_path());
        if let Some(problem) =
            durable_end_problem(&path, previous, checkpoint).map_err(read_failed)?
        {
            if entries.is_empty() {
                return Ok(None);
            }
            return Err(RingError::Corrupt {
                path: dir.join(RING_FILE),
                problem,
            });
        }
    }
    let later = later_files(&files[position + 1..]).map_err(|source| RingError::Io {
        op: "stat the record files after the one named by",
        path: dir.join(RING_FILE),
        source,
    })?;
    Ok(match replay_plan(&have, ends_a_line, entries, later) {
        // Readers report the lines of a file changed below its checkpoint themselves (the
        // chain breaks there).
        ReplayPlan::Nothing | ReplayPlan::ChangedBelowCheckpoint => None,
        ReplayPlan::Rewrite { kept, .. } if kept < entries.len() => Some(Unreplayed::Missing {
            first: entries[kept].seq,
            last: entries[entries.len() - 1].seq,
        }),
        // Whole lines that are no durable record would be read as records; a torn last
        // line alone is not, and readers report it themselves.
        ReplayPlan::Rewrite { matched, .. } if have[matched..].contains(&b'\n') => {
            Some(Unreplayed::Uncommitted {
                file: path,
                bytes: (have.len() - matched) as u64,
            })
        }
        ReplayPlan::Rewrite { .. } => None,
        ReplayPlan::LaterFilesHoldRecords => {
            return Err(RingError::Corrupt {
                path: dir.join(RING_FILE),
                problem: later_files_hold_records(&path),
            });
        }
    })
}

/// The most bytes a record file may hold past its checkpoint: the records of a full ring
/// (those written to the file but not yet synced in the ring included, which a rotation
/// leaves) and one torn line. No crash leaves more, and a reader or writer holds what is
/// there in memory.
const MOST_PAST_CHECKPOINT: u64 = MAX_RING_BYTES + LONGEST_LINE;

/// Why a record file of `len` bytes cannot be what a crash left past a checkpoint at `at`
/// bytes, if it cannot: it holds more than [`MOST_PAST_CHECKPOINT`] beyond it.
pub fn past_checkpoint_problem(len: u64, at: u64) -> Option<String> {
    let past = len.saturating_sub(at);
    (past > MOST_PAST_CHECKPOINT).then(|| {
        format!(
            "it holds {past} bytes past the checkpoint at {at}, more than a full write-ahead \
             ring's records and one line ({MOST_PAST_CHECKPOINT}): no crash leaves that"
        )
    })
}

/// The bytes of a record file of `len` bytes (at least `at`) past a checkpoint at `at`, and
/// whether the byte before them ends a line (true at 0): a crash leaves the durable part
/// ending at a line's end. The caller has checked [`past_checkpoint_problem`].
pub fn read_past_checkpoint(file: &File, len: u64, at: u64) -> io::Result<(Vec<u8>, bool)> {
    let from = at.saturating_sub(1);
    let mut have = vec![0; usize::try_from(len - from).unwrap_or(usize::MAX)];
    file.read_exact_at(&mut have, from)?;
    let ends_a_line = at == 0 || have.first() == Some(&b'\n');
    if at > 0 {
        have.remove(0);
    }
    Ok((have, ends_a_line))
}

/// The longest line [`durable_end_problem`] reads back: far beyond any record the writer
/// makes, so that a file without newlines cannot make a reader hold all of it.
pub(crate) const LONGEST_LINE: u64 = 16 * 1024 * 1024;

/// Why the record files do not end their durable part where `checkpoint` says, if they do
/// not: the line ending at its `bytes` in its `file` (at `bytes` 0: the last line of the
/// `previous` record file; with none, the chain's start) must be record `seq` and hash to
/// `hash`. `file` holds at least `bytes` bytes, and the byte before them ends a line (the
/// caller checked both). No crash changes a synced line, so a mismatch means the lines
/// below the checkpoint were cut or edited: a writer must not continue the chain from them,
/// nor a reader take them for the durable stream.
pub fn durable_end_problem(
    file: &Path,
    previous: Option<&Path>,
    checkpoint: &Checkpoint,
) -> io::Result<Option<String>> {
    let (holder, end) = if checkpoint.bytes > 0 {
        (Some(file), checkpoint.bytes)
    } else {
        match previous {
            Some(previous) => (
                Some(previous),
                super::store::open_record_file_io(previous)?
                    .metadata()?
                    .len(),
            ),
            None => (None, 0),
        }
    };
    let said = format!(
        "the write-ahead ring's checkpoint says record {} (hash {}) is the last durable record",
        checkpoint.seq, checkpoint.hash
    );
    let Some(holder) = holder.filter(|_| end > 0) else {
        return Ok(
            (checkpoint.seq != 0 || checkpoint.hash != ChainHash::genesis()).then(|| {
                format!(
                    "{said}, but no record precedes the {} bytes of {} it made durable",
                    checkpoint.bytes,
                    file.display()
                )
            }),
        );
    };
    let line = line_ending_at(&super::store::open_record_file_io(holder)?, end)?;
    let found = line.as_deref().map(|line| {
        (
            DecisionRecord::from_json_line(line).map(|r| r.flowhost.seq),
            line_hash(line),
        )
    });
    Ok(match found {
        Some((Ok(seq), hash)) if seq == checkpoint.seq && hash == checkpoint.hash => None,
        Some((Ok(seq), hash)) => Some(format!(
            "{said}, but the last line of {} up to byte {end} is record {seq} (hash {hash}): \
             lines the checkpoint made durable were cut or edited after they were synced",
            holder.display()
        )),
        Some((Err(e), _)) => Some(format!(
            "{said}, but the last line of {} up to byte {end} is not a valid record ({e}): \
             lines the checkpoint made durable were cut or edited after they were synced",
            holder.display()
        )),
        None => Some(format!(
            "{said}, but {} does not end in a whole line at byte {end}",
            holder.display()
        )),
    })
}

/// The line of `file` that ends at byte `end` (> 0), without its newline; `None` when the
/// byte before `end` is no newline or the line is longer than [`LONGEST_LINE`].
pub(crate) fn line_ending_at(file: &File, end: u64) -> io::Result<Option<Vec<u8>>> {
    const STEP: u64 = 64 * 1024;
    let mut last = [0u8; 1];
    file.read_exact_at(&mut last, end - 1)?;
    if last[0] != b'\n' {
        return Ok(None);
    }
    // Read backwards a block at a time, up to the newline before the line.
    let newline = end - 1;
    let mut from = newline;
    let mut line = Vec::new();
    loop {
        let start = from.saturating_sub(STEP);
        let mut block = vec![0u8; (from - start) as usize];
        file.read_exact_at(&mut block, start)?;
        let before = memchr::memrchr(b'\n', &block);
        block.drain(..before.map_or(0, |i| i + 1));
        block.extend_from_slice(&line);
        line = block;
        if before.is_some() || start == 0 {
            return Ok(Some(line));
        }
        if newline - start > LONGEST_LINE {
            return Ok(None);
        }
        from = start;
    }
}

/// What the record files after a checkpoint's file hold.
pub fn later_files(later: &[PathBuf]) -> io::Result<LaterFiles> {
    if later.is_empty() {
        return Ok(LaterFiles::None);
    }
    for file in later {
        if std::fs::metadata(file)?.len() > 0 {
            return Ok(LaterFiles::HoldBytes);
        }
    }
    Ok(LaterFiles::Empty)
}

/// The problem of [`ReplayPlan::LaterFilesHoldRecords`], naming the checkpoint's file.
pub fn later_files_hold_records(file: &Path) -> String {
    format!(
        "the write-ahead ring's checkpoint names {}, but later record files hold records",
        file.display()
    )
}

/// The intact, consecutive, chained entries after `checkpoint`.
fn entries_after(bytes: &[u8], checkpoint: &Checkpoint) -> Vec<RingEntry> {
    let size = bytes.len() as u64;
    let mut at = checkpoint.ring_at;
    // A checkpoint at the last sequence number has no record after it.
    let Some(mut seq) = checkpoint.seq.checked_add(1) else {
        return Vec::new();
    };
    let mut prev = checkpoint.hash.clone();
    let mut walked = 0u64;
    let mut out = Vec::new();
    while walked <= size - DATA_START {
        let head_fits = at + ENTRY_HEAD <= size;
        if !head_fits || &bytes[at as usize..at as usize + 4] == WRAP_MAGIC {
            walked += size - at;
            at = DATA_START;
            continue;
        }
        let head = &bytes[at as usize..(at + ENTRY_HEAD) as usize];
        let len = u64::from(u32::from_le_bytes([head[4], head[5], head[6], head[7]]));
        let entry_seq = u64::from_le_bytes(head[8..16].try_into().unwrap_or([0; 8]));
        if &head[..4] != ENTRY_MAGIC || entry_seq != seq || at + ENTRY_HEAD + len > size {
            break;
        }
        let line = &bytes[(at + ENTRY_HEAD) as usize..(at + ENTRY_HEAD + len) as usize];
        if Sha256::digest(line).as_slice() != &head[16..48] {
            break;
        }
        let chained = DecisionRecord::from_json_line(line)
            .is_ok_and(|r| r.flowhost.seq == seq && r.flowhost.prev_hash == prev.as_str());
        if !chained {
            break;
        }
        prev = line_hash(line);
        out.push(RingEntry {
            seq,
            line: line.to_vec(),
        });
        let Some(next) = seq.checked_add(1) else {
            break;
        };
        seq = next;
        at += ENTRY_HEAD + len;
        walked += ENTRY_HEAD + len;
    }
    out
}

/// The counter of the checkpoint a new ring is made with.
const FIRST_COUNTER: u64 = 1;

/// Where the header slot of the checkpoint numbered `counter` is: the two slots take turns.
fn slot_offset(counter: u64) -> u64 {
    (counter % 2) * SLOT_BLOCK
}

fn encode_slot(counter: u64, c: &Checkpoint) -> Vec<u8> {
    let mut s = Vec::with_capacity(SLOT_BYTES);
    s.extend_from_slice(SLOT_MAGIC);
    s.extend_from_slice(&SLOT_VERSION.to_le_bytes());
    s.extend_from_slice(&counter.to_le_bytes());
    for v in [c.bytes, c.lines, c.seq, c.ring_at] {
        s.extend_from_slice(&v.to_le_bytes());
    }
    let hash = c.hash.as_str().as_bytes();
    let name = &c.file.as_bytes()[..c.file.len().min(255)];
    s.push(hash.len() as u8);
    s.extend_from_slice(hash);
    s.push(name.len() as u8);
    s.extend_from_slice(name);
    let digest = Sha256::digest(&s);
    s.extend_from_slice(&digest);
    s.resize(SLOT_BYTES, 0);
    s
}

fn decode_slot(s: &[u8]) -> Option<(u64, Checkpoint)> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let field = s.get(at..at.checked_add(n)?)?;
        at += n;
        Some(field)
    };
    let u64_of = |b: &[u8]| b.try_into().ok().map(u64::from_le_bytes);
    if take(4)? != SLOT_MAGIC || take(4)? != SLOT_VERSION.to_le_bytes() {
        return None;
    }
    let counter = u64_of(take(8)?)?;
    let bytes = u64_of(take(8)?)?;
    let lines = u64_of(take(8)?)?;
    let seq = u64_of(take(8)?)?;
    let ring_at = u64_of(take(8)?)?;
    let hash_len = usize::from(*take(1)?.first()?);
    let hash = std::str::from_utf8(take(hash_len)?).ok()?.to_string();
    let name_len = usize::from(*take(1)?.first()?);
    // Only a record file's name: the seal is a plain digest anyone can make, and a name
    // is shown to whoever reads an error about the slot.
    let file = std::str::from_utf8(take(name_len)?)
        .ok()
        .filter(|f| super::store::parse_record_file_name(f).is_some())?
        .to_string();
    let body = &s[..at];
    let digest = s.get(at..at + 32)?;
    if Sha256::digest(body).as_slice() != digest {
        return None;
    }
    Some((
        counter,
        Checkpoint {
            file,
            bytes,
            lines,
            seq,
            hash: ChainHash::parse(&hash)?,
            ring_at,
        },
    ))
}

/// The valid slot with the higher counter.
fn read_slots(slots: &[u8]) -> Option<(u64, Checkpoint)> {
    let second = SLOT_BLOCK as usize;
    let a = decode_slot(&slots[..SLOT_BYTES]);
    let b = decode_slot(&slots[second..second + SLOT_BYTES]);
    match (a, b) {
        (Some(a), Some(b)) => Some(if a.0 >= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::chain::Chainer;
    use crate::records::tests::sample_tool_call;

    fn start() -> Checkpoint {
        Checkpoint {
            file: "records-00000000000000000001.jsonl".into(),
            bytes: 0,
            lines: 0,
            seq: 0,
            hash: ChainHash::genesis(),
            ring_at: DATA_START,
        }
    }

    /// Seals `n` records and writes them to `ring`, returning their lines.
    fn write_records(
        ring: &Ring,
        cursor: &mut Cursor,
        chain: &mut Chainer,
        n: usize,
    ) -> Vec<Vec<u8>> {
        (0..n)
            .map(|_| {
                let sealed = chain.seal(&mut sample_tool_call()).unwrap();
                let line = &sealed.line[..sealed.line.len() - 1];
                let hash: [u8; 32] = Sha256::digest(line).into();
                assert!(ring.has_room(*cursor, line.len()));
                ring.append(cursor, sealed.seq, &hash, line, &mut Vec::new())
                    .unwrap();
                line.to_vec()
            })
            .collect()
    }

    /// Where the entry after `lines` (written from the ring's start) begins.
    fn offset_after(lines: &[Vec<u8>]) -> u64 {
        DATA_START
            + lines
                .iter()
                .map(|l| ENTRY_HEAD + l.len() as u64)
                .sum::<u64>()
    }

    #[test]
    fn entries_after_the_checkpoint_read_back_in_order_and_a_checkpoint_moves_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, mut cursor) = Ring::open(dir.path(), MIN_RING_BYTES, &start()).unwrap();
        let mut chain = Chainer::genesis();
        let lines = write_records(&ring, &mut cursor, &mut chain, 5);
        ring.sync().unwrap();
        let (cp, entries) = read_back(dir.path()).unwrap().unwrap();
        assert_eq!(cp, start());
        assert_eq!(
            entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2, 3, 4, 5]
        );
        assert_eq!(
            entries.iter().map(|e| e.line.clone()).collect::<Vec<_>>(),
            lines
        );

        // A checkpoint after record 3: only 4 and 5 remain to replay.
        let at3 = Checkpoint {
            bytes: 300,
            lines: 3,
            seq: 3,
            hash: line_hash(&lines[2]),
            ring_at: offset_after(&lines[..3]),
            ..start()
        };
        ring.checkpoint(&at3, 1).unwrap();
        let (cp, entries) = read_back(dir.path()).unwrap().unwrap();
        assert_eq!(cp, at3);
        assert_eq!(
            entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![4, 5]
        );
        // An older checkpoint written later changes nothing.
        ring.checkpoint(&start(), 0).unwrap();
        assert_eq!(read_back(dir.path()).unwrap().unwrap().0, at3);
    }

    #[test]
    fn a_torn_or_unchained_entry_ends_the_replay_and_a_torn_header_falls_back() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, mut cursor) = Ring::open(dir.path(), MIN_RING_BYTES, &start()).unwrap();
        let mut chain = Chainer::genesis();
        let lines = write_records(&ring, &mut cursor, &mut chain, 4);
        drop(ring);
        let path = dir.path().join(RING_FILE);
        let mut bytes = fs::read(&path).unwrap();
        // One byte of record 3's line flipped: 1 and 2 remain.
        let third = offset_after(&lines[..2]);
        bytes[(third + ENTRY_HEAD + 10) as usize] ^= 1;
        fs::write(&path, &bytes).unwrap();
        let (_, entries) = read_back(dir.path()).unwrap().unwrap();
        assert_eq!(entries.len(), 2);

        // A second checkpoint goes to the other slot; torn, the first one is used again.
        bytes[(third + ENTRY_HEAD + 10) as usize] ^= 1;
        fs::write(&path, &bytes).unwrap();
        let (ring, _) = Ring::open(dir.path(), MIN_RING_BYTES, &start()).unwrap();
        let later = Checkpoint {
            seq: 2,
            hash: line_hash(&lines[1]),
            ring_at: third,
            bytes: 10,
            lines: 2,
            ..start()
        };
        ring.checkpoint(&later, 1).unwrap();
        drop(ring);
        assert_eq!(read_back(dir.path()).unwrap().unwrap().0, later);
        // The reopen wrote counter 2 to slot 0, `later` counter 3 to slot 1. Slot 1 torn:
        // slot 0's checkpoint is used; both torn: the ring is refused.
        let mut bytes = fs::read(&path).unwrap();
        bytes[SLOT_BLOCK as usize + 20] ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        assert_eq!(read_back(dir.path()).unwrap().unwrap().0, start());
        bytes[20] ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            read_back(dir.path()),
            Err(RingError::Corrupt { .. })
        ));
    }

    #[test]
    fn the_ring_wraps_only_over_checkpointed_entries() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, mut cursor) = Ring::open(dir.path(), MIN_RING_BYTES, &start()).unwrap();
        let mut chain = Chainer::genesis();
        let mut lines = Vec::new();
        while ring.has_room(cursor, 2000) {
            lines.extend(write_records(&ring, &mut cursor, &mut chain, 1));
        }
        let full = lines.len();
        let end = cursor.at;
        assert!(full > 10, "{full}");
        // Checkpoint everything written: the ring takes more, wrapping past its end.
        let cp = Checkpoint {
            bytes: 1,
            lines: full as u64,
            seq: full as u64,
            hash: line_hash(lines.last().unwrap()),
            ring_at: cursor.at,
            ..start()
        };
        ring.checkpoint(&cp, cursor.used).unwrap();
        let more = write_records(&ring, &mut cursor, &mut chain, full / 2);
        assert!(cursor.at < end, "the ring wrapped");
        ring.sync().unwrap();
        let (read_cp, entries) = read_back(dir.path()).unwrap().unwrap();
        assert_eq!(read_cp, cp);
        assert_eq!(entries.len(), more.len());
        assert_eq!(entries.first().map(|e| e.seq), Some(full as u64 + 1));
        assert_eq!(
            entries.iter().map(|e| e.line.clone()).collect::<Vec<_>>(),
            more
        );
    }

    #[test]
    fn an_entry_longer_than_the_ring_before_the_cursor_never_fits_where_it_would_wrap() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, mut cursor) = Ring::open(dir.path(), MIN_RING_BYTES, &start()).unwrap();
        let mut chain = Chainer::genesis();
        write_records(&ring, &mut cursor, &mut chain, 3);
        // Everything checkpointed at the cursor: the ring is empty of needed entries.
        ring.checkpoint(
            &Checkpoint {
                ring_at: cursor.at,
                ..start()
            },
            cursor.used,
        )
        .unwrap();
        let before = (cursor.at - DATA_START) as usize;
        let after = (ring.size - cursor.at) as usize;
        // Too long for the end, so it would wrap to the start and run over the wrap mark at
        // the cursor, where a replay from this checkpoint begins.
        let len = before.max(after) + 1 - ENTRY_HEAD as usize;
        assert!(ring.can_hold(len));
        assert!(!ring.has_room(cursor, len));
        // One that fits before the wrap mark is fine.
        assert!(ring.has_room(cursor, before - ENTRY_HEAD as usize));
    }

    #[test]
    fn the_durable_end_is_the_line_the_checkpoint_names_or_the_previous_files_last() {
        let dir = tempfile::tempdir().unwrap();
        let mut chain = Chainer::genesis();
        let lines: Vec<Vec<u8>> = (0..3)
            .map(|_| chain.seal(&mut sample_tool_call()).unwrap().line)
            .collect();
        let (first, second) = (dir.path().join("first"), dir.path().join("second"));
        fs::write(&first, lines.concat()).unwrap();
        fs::write(&second, b"").unwrap();
        let after = |seq: usize| Checkpoint {
            bytes: lines[..seq].iter().map(|l| l.len() as u64).sum(),
            lines: seq as u64,
            seq: seq as u64,
            hash: line_hash(lines[seq - 1].trim_ascii_end()),
            ..start()
        };
        let problem = |file: &Path, previous: Option<&Path>, c: &Checkpoint| {
            durable_end_problem(file, previous, c).unwrap()
        };
        assert_eq!(problem(&first, None, &after(3)), None);
        assert_eq!(problem(&first, None, &after(2)), None);
        // The file's start: the chain's.
        assert_eq!(problem(&first, None, &start()), None);
        let claims_more = Checkpoint {
            bytes: 0,
            ..after(3)
        };
        assert!(problem(&first, None, &claims_more).is_some());
        // Record 2's place, but record 3's name.
        let moved = Checkpoint {
            bytes: after(2).bytes,
            ..after(3)
        };
        let text = problem(&first, None, &moved).unwrap();
        assert!(text.contains("is record 2"), "{text}");
        // A rotation's checkpoint: the new file's start, after the previous file's last line.
        assert_eq!(problem(&second, Some(&first), &claims_more), None);
        // That line edited, its length kept.
        let last = String::from_utf8(lines[2].clone()).unwrap();
        let edited = last.replacen("prod-repo", "prod-repx", 1);
        assert_eq!(edited.len(), last.len());
        fs::write(
            &first,
            [&lines[0][..], &lines[1], edited.as_bytes()].concat(),
        )
        .unwrap();
        let text = problem(&second, Some(&first), &claims_more).unwrap();
        assert!(text.contains("cut or edited"), "{text}");
        assert!(problem(&first, None, &after(3)).is_some());
        // Torn: no whole line ends there.
        fs::write(&first, &lines.concat()[..after(3).bytes as usize - 1]).unwrap();
        assert!(problem(&second, Some(&first), &claims_more).is_some());
    }

    #[test]
    fn a_checkpoint_at_the_last_sequence_number_has_nothing_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let last = Checkpoint {
            seq: u64::MAX,
            hash: line_hash(b"x"),
            ..start()
        };
        let (ring, mut cursor) = Ring::open(dir.path(), MIN_RING_BYTES, &last).unwrap();
        // An entry where the record after it would go: its seq is never `seq + 1`.
        ring.append(&mut cursor, 0, &[0; 32], b"{}", &mut Vec::new())
            .unwrap();
        drop(ring);
        let (checkpoint, entries) = read_back(dir.path()).unwrap().unwrap();
        assert_eq!(checkpoint, last);
        assert!(entries.is_empty(), "{entries:?}");
    }

    #[test]
    fn a_header_slot_round_trips_and_any_flipped_byte_is_refused() {
        let cp = Checkpoint {
            bytes: 12345,
            lines: 7,
            seq: 99,
            hash: line_hash(b"x"),
            ring_at: 8192,
            ..start()
        };
        let slot = encode_slot(3, &cp);
        assert_eq!(decode_slot(&slot), Some((3, cp.clone())));
        let used = 48 + 1 + cp.hash.as_str().len() + 1 + cp.file.len() + 32;
        for i in 0..used {
            let mut bad = slot.clone();
            bad[i] ^= 0x40;
            assert_eq!(decode_slot(&bad), None, "byte {i}");
        }
    }
}
