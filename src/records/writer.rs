//! The record writer: group commit, fail closed, size rotation, crash recovery.
//!
//! Guarantees:
//! * [`RecordWriter::commit`] returns `Ok` only once the record is durable: its entry in the
//!   write-ahead ring (`records.wal`, see the `ring` module) is written and `fdatasync`ed
//!   (and, for the first record of a new file, the directory entry is fsynced), so the host
//!   may perform an allowed effect after `commit` returns and never before. Its line is in
//!   its record file from the same moment (readable at once); the record file itself is
//!   synced at the next checkpoint, and a machine crash before that is repaired at the next
//!   open (see Resume).
//! * [`RecordWriter::append`] returns once the record is written (in its place in the chain,
//!   readable); its `fdatasync` is the next one anybody waits for, or happens on its own
//!   within 5 ms. It is for records no effect depends on.
//! * Group commit, pipelined: each caller seals its record into the chain and writes its
//!   entry and line itself (two short writes, in chain order); a sync thread takes every
//!   record written so far, makes them durable with one `fdatasync` of the ring, then
//!   completes them all. While one sync runs, the next records are already being written, so
//!   concurrent callers share each sync and never wait for a sync that started before their
//!   record was written plus one. A caller that knows it is alone
//!   ([`RecordWriter::commit_alone`]) runs the sync on its own thread instead when no sync
//!   runs, nobody else waits and the last sync was quick and served one caller. Syncs never
//!   overlap.
//! * Checkpoints: with each head-anchor refresh (and whenever the ring would otherwise wrap
//!   over entries still needed, and at each rotation) the record file is synced and the ring's
//!   header records how far; only then may the ring's space before that point be reused.
//! * Fail closed: after any write, sync, rotation, checkpoint or anchor error the writer is
//!   failed for good: that commit and every later one return [`RecordError::WriterFailed`]
//!   with the first reason, and [`RecordWriter::status`] reports it. The host must then refuse
//!   calls and egress. Records of a failed group may be on disk; their effects never happen.
//!   A ring that cannot be made or read refuses the open.
//! * Rotation: when the next line would take the current file past `rotate_bytes`, the file is
//!   synced and a new file `records-<first seq>.jsonl` is started; the chain continues across
//!   files.
//! * Blocks are reserved (`fallocate`, size unchanged) up to 1 MiB ahead of the current
//!   file's end, so that a checkpoint's sync writes the lines and the inode but no allocation
//!   metadata. The record files' sizes and contents are only ever whole lines.
//! * Resume: [`RecordWriter::open`] first writes back into the last record file the records
//!   the ring holds past its checkpoint (a machine crash lost them from the file; all of them
//!   are written, also those the file seems to hold, which a failed write-back may have left
//!   in the page cache only) and syncs it before the ring's checkpoint moves, then continues
//!   the sequence and chain of the existing files. Their last line must be the record its
//!   place says (its file is named for its first record) and carry the hash of the line
//!   before it; one that does not is refused ([`RecordError::Corrupt`]) rather than
//!   continued from (a seq taken from it could repeat or overflow). Bytes of that file past the
//!   checkpoint that are not the ring's records, and a torn last line (a crash mid-write:
//!   bytes after the last newline), were never acknowledged, so they are neither kept in the
//!   stream nor thrown away: their bytes are preserved in a sidecar `<file>.torn-<n>`, the
//!   file is cut back, and a warning is logged and reported by [`RecordWriter::recovered`]. A
//!   stream that ends before the head anchor's record, or whose last line differs from the
//!   anchored one, is refused (an operator must look: lines were cut or edited); so is one
//!   that disagrees with the ring's checkpoint, which the anchor may predate: a record file
//!   missing, or shorter than its checkpoint, is not repaired from the ring but refused, and
//!   the line ending where the checkpoint says the durable part ends (at a file's start: the
//!   previous file's last line, or the chain's start) must be the record the checkpoint names,
//!   with its hash ([`RecordError::Corrupt`]). A rotation cut short before its checkpoint
//!   (the old file whole, the new one empty) reopens.
//! * One writer per directory: [`RecordWriter::open`] takes an exclusive `flock` on
//!   `records.lock` (waiting up to 2 s for a writer that is just ending) and refuses with
//!   [`RecordError::InUse`] otherwise.
//! * The head anchor (`records.head`, see [`super::store`]) is replaced by the sync thread
//!   after the first durable group, then at most every `head_interval` while records come (and
//!   once more when they stop), and on close, each time right after a checkpoint. It only ever
//!   names a record its file holds durably.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;

use super::chain::{ChainHash, Chainer, line_hash};
use super::ring;
use super::store;
use super::store::{
    HEAD_FILE, HEAD_SCHEMA, HeadAnchor, RecordFile, StoreError, TORN_INFIX, record_file_name,
    record_files_on_disk, split_lines,
};
use super::{DecisionRecord, RecordFormatError};
use crate::files::{create_dir_all_synced, sync_dir, write_atomic};

/// How the writer behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterOptions {
    /// Start a new file when the next line would take the current one past this many bytes
    /// (a file always takes at least one line). Default 64 MiB.
    pub rotate_bytes: u64,
    /// Refresh the head anchor at most this often while records keep coming (and once idle).
    /// Default 1 s. Each refresh is also a checkpoint of the write-ahead ring.
    pub head_interval: Duration,
    /// The size of the write-ahead ring (`records.wal`) made for a directory that has none.
    /// Default 4 MiB (at least [`MIN_RING_BYTES`]).
    pub ring_bytes: u64,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            rotate_bytes: 64 * 1024 * 1024,
            head_interval: Duration::from_secs(1),
            ring_bytes: 4 * 1024 * 1024,
        }
    }
}

/// A durable record's place in the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    /// Its sequence number.
    pub seq: u64,
    /// The hash of its line.
    pub hash: ChainHash,
}

/// Why a record was not committed, or the writer could not start.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The writer has failed; nothing more will be recorded (fail closed).
    #[error("the record writer has failed and refuses every record (fail closed): {reason}")]
    WriterFailed {
        /// The first failure, naming the file and operation.
        reason: String,
    },
    /// The writer was closed.
    #[error("the record writer is closed")]
    Closed,
    /// This record breaks the format; it was not written (the writer is still usable).
    #[error("record rejected, not written: {0}")]
    Invalid(#[from] RecordFormatError),
    /// The record directory could not be read or prepared.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The existing records cannot be continued.
    #[error("{path}:{line}: cannot continue the record chain: {problem}")]
    Corrupt {
        /// The record file.
        path: PathBuf,
        /// The 1-based line.
        line: u64,
        /// What is wrong.
        problem: String,
    },
    /// The existing records disagree with the head anchor: lines were cut or edited.
    #[error(
        "{dir}: records disagree with {HEAD_FILE}: {problem}; run `flowhost records verify {dir}` and move the directory aside after review"
    )]
    HeadConflict {
        /// The record directory.
        dir: PathBuf,
        /// The disagreement.
        problem: String,
    },
    /// The directory holds records but neither a head anchor nor a write-ahead ring: a
    /// writer keeps both from its first open, so they were removed, and with them what
    /// would show the stream's end was cut. Continuing would anchor whatever is left.
    #[error(
        "{dir}: it holds record files but neither {HEAD_FILE} nor records.wal, which every writer keeps: they were removed, and whether the stream was cut cannot be checked; run `flowhost records verify {dir}`, keep the directory as it is for review, and give the host a new one"
    )]
    Unanchored {
        /// The record directory.
        dir: PathBuf,
    },
    /// Another writer (a running host, or `sandbox run --records`) has the directory open.
    #[error(
        "{dir}: another record writer has this directory open ({LOCK_FILE} is locked): a running host or `sandbox run --records`; stop it first"
    )]
    InUse {
        /// The record directory.
        dir: PathBuf,
    },
    /// The write-ahead ring could not be read, written or synced.
    #[error(transparent)]
    Ring(#[from] ring::RingError),
    /// The writer's sync thread could not be started.
    #[error("cannot start the record writer's sync thread: {0}")]
    Spawn(#[source] io::Error),
}

/// A torn last line found and preserved at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// The record file it was cut from.
    pub file: PathBuf,
    /// The sidecar holding its bytes.
    pub sidecar: PathBuf,
    /// How many bytes.
    pub bytes: usize,
}

/// What the writer knows about its stream; the source of the record side of
/// [`super::ToolObservationHealth`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterStatus {
    /// The record directory.
    pub dir: PathBuf,
    /// The first durable sequence number in the directory.
    pub first_seq: Option<u64>,
    /// The last durable sequence number.
    pub last_seq: Option<u64>,
    /// The hash of the last durable line (genesis if none).
    pub chain_head: ChainHash,
    /// Records committed since open.
    pub committed_since_open: u64,
    /// The file being appended to.
    pub current_file: PathBuf,
    /// The failure reason, once failed.
    pub failed: Option<String>,
    /// Whether the writer was closed.
    pub closed: bool,
    /// Torn last lines preserved at open.
    pub recovered: Vec<TornTail>,
    /// Decisions refused a record because the record broke the format or came after the
    /// writer was closed (and so were refused themselves): the records lack that many.
    pub rejected: u64,
    /// Why the last of them was refused.
    pub last_rejection: Option<String>,
}

enum Reply<T> {
    Async(oneshot::Sender<T>),
    Blocking(SyncSender<T>),
}

impl<T> Reply<T> {
    fn send(self, value: T) {
        // A caller that stopped waiting (a dropped future) no longer needs the answer.
        match self {
            Reply::Async(tx) => {
                let _ = tx.send(value);
            }
            Reply::Blocking(tx) => {
                let _ = tx.send(value);
            }
        }
    }
}

type CommitReply = Reply<Result<Committed, RecordError>>;
type CloseReply = Reply<Result<WriterStatus, RecordError>>;

type FlushReply = Reply<Result<(), RecordError>>;

struct Shared {
    failed: OnceLock<String>,
    status: Mutex<WriterStatus>,
}

impl Shared {
    fn status(&self) -> WriterStatus {
        // A poisoned lock still holds the last status written; reporting it is correct.
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn update(&self, f: impl FnOnce(&mut WriterStatus)) {
        f(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// The error a caller gets once the thread is gone.
    fn gone(&self) -> RecordError {
        match self.failed.get() {
            Some(reason) => RecordError::WriterFailed {
                reason: reason.clone(),
            },
            None => RecordError::Closed,
        }
    }
}

/// A handle on the record writer of one directory. Cheap to clone; usable from any thread or
/// tokio task. The writer's sync thread ends when it is closed or every handle is dropped.
#[derive(Clone)]
pub struct RecordWriter {
    stages: Arc<stages::Stages>,
    shared: Arc<Shared>,
    dir: Arc<Path>,
}

impl std::fmt::Debug for RecordWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordWriter")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl RecordWriter {
    /// Opens (creating if needed) the record directory `dir`, resumes its chain (see the
    /// module docs for torn lines and the head anchor) and starts the sync thread.
    pub fn open(dir: &Path, options: WriterOptions) -> Result<RecordWriter, RecordError> {
        // The directories this creates are synced into their parents: records made durable
        // in a directory a power loss then unlinks would be lost with it.
        create_dir_all_synced(dir, 0o777).map_err(|e| StoreError::io(e.op, &e.path)(e.source))?;
        // Taken before the writer lock and held until the ring has been copied into the
        // files: a reader that finds the directory held waits on it (see `store`).
        let opening = take_for_writing(dir, store::OPENING_LOCK_FILE)?;
        let lock = lock_dir(dir)?;
        let resumed = resume(dir)?;
        let file = store::open_record_file_as(&resumed.file_path, OpenOptions::new().append(true))
            .map_err(StoreError::io("open for append", &resumed.file_path))?;
        // The ring's new checkpoint says the file is durable as it stands: lines a previous
        // process wrote but never synced are synced here first.
        file.sync_data()
            .map_err(StoreError::io("fdatasync", &resumed.file_path))?;
        let (ring, cursor) = ring::Ring::open(
            dir,
            options.ring_bytes,
            &ring::Checkpoint {
                file: file_name_of(&resumed.file_path),
                bytes: resumed.file_bytes,
                lines: resumed.file_lines,
                seq: resumed.chain.next_seq() - 1,
                hash: resumed.chain.head_hash().clone(),
                ring_at: 0,
            },
        )?;
        // From here the ring may hold records durable nowhere else: the anchor says so before
        // any is written, so a removed ring is never taken for a directory from before it.
        mark_ring_kept(dir, &resumed.chain)?;
        // The files now hold every durable record: readers need not wait any longer.
        drop(opening);
        let status = WriterStatus {
            dir: dir.to_path_buf(),
            first_seq: resumed.first_seq,
            last_seq: resumed.chain.next_seq().checked_sub(1).filter(|&s| s > 0),
            chain_head: resumed.chain.head_hash().clone(),
            committed_since_open: 0,
            current_file: resumed.file_path.clone(),
            failed: None,
            closed: false,
            recovered: resumed.recovered,
            rejected: 0,
            last_rejection: None,
        };
        let shared = Arc::new(Shared {
            failed: OnceLock::new(),
            status: Mutex::new(status),
        });
        let stages = stages::start(stages::Start {
            dir: dir.to_path_buf(),
            options,
            file,
            file_path: resumed.file_path,
            file_bytes: resumed.file_bytes,
            file_lines: resumed.file_lines,
            chain: resumed.chain,
            first_seq: resumed.first_seq,
            shared: shared.clone(),
            ring: Arc::new(ring),
            cursor,
            lock,
        })?;
        Ok(RecordWriter {
            stages: Arc::new(stages),
            shared,
            dir: Arc::from(dir),
        })
    }

    /// Commits `record`: assigns its `seq` and `prev_hash`, and returns once it is durable
    /// (its entry in the write-ahead ring written and fdatasynced; its line is in its record
    /// file from the same moment). Errors: [`RecordError::Invalid`] for a record that
    /// breaks the format (nothing written; the writer stays usable),
    /// [`RecordError::WriterFailed`] once the writer has failed, [`RecordError::Closed`] after
    /// close. If the future is dropped before it completes, the record may or may not be
    /// written: the caller must then treat the decision as not durable and skip its effect.
    /// The entry and the line are written on the calling thread (two short writes); the
    /// `fdatasync` runs on the sync thread.
    pub async fn commit(&self, record: DecisionRecord) -> Result<Committed, RecordError> {
        self.commit_durably(record, false).await
    }

    /// Commits `record` like [`RecordWriter::commit`], with one difference: when no sync is
    /// running and nobody else waits, the `fdatasync` runs on the calling thread (which it
    /// blocks for that long) instead of the sync thread, sparing the two hand-offs to and from
    /// it. For a caller that knows nothing else needs its thread meanwhile.
    pub async fn commit_alone(&self, record: DecisionRecord) -> Result<Committed, RecordError> {
        self.commit_durably(record, true).await
    }

    /// Writes `record` and waits until it is durable; `may_lead`: see
    /// [`RecordWriter::commit_alone`].
    async fn commit_durably(
        &self,
        record: DecisionRecord,
        may_lead: bool,
    ) -> Result<Committed, RecordError> {
        self.refuse_if_failed()?;
        let (tx, rx) = oneshot::channel();
        self.stages
            .write(record, Some(Reply::Async(tx)), may_lead)?;
        rx.await.unwrap_or_else(|_| Err(self.shared.gone()))
    }

    /// Appends `record` like [`RecordWriter::commit`] but returns once its line is written
    /// to the file (in its place in the chain, visible to readers, kept if this process
    /// dies), without waiting for the `fdatasync` that follows with its group: a machine
    /// crash can lose it. For records no effect waits on, such as a call's outcome whose
    /// labels are already durable in the flow state. A sync that fails later fails the
    /// writer, so every later commit is refused. Errors: as for `commit`.
    pub async fn append(&self, record: DecisionRecord) -> Result<Committed, RecordError> {
        self.refuse_if_failed()?;
        self.stages.write(record, None, false)
    }

    /// Returns once every record queued before the call (committed or appended) is durable,
    /// so a status read afterwards covers every line in the files: what health needs to
    /// vouch for the records as they stand. Errors: the writer's failure, or closed.
    pub async fn flush(&self) -> Result<(), RecordError> {
        self.refuse_if_failed()?;
        let (tx, rx) = oneshot::channel();
        self.stages.flush(Reply::Async(tx));
        rx.await.unwrap_or_else(|_| Err(self.shared.gone()))
    }

    /// [`RecordWriter::commit`] for threads that are not async tasks (it blocks the thread).
    pub fn commit_blocking(&self, record: DecisionRecord) -> Result<Committed, RecordError> {
        self.refuse_if_failed()?;
        let (tx, rx) = mpsc::sync_channel(1);
        self.stages
            .write(record, Some(Reply::Blocking(tx)), false)?;
        rx.recv().unwrap_or_else(|_| Err(self.shared.gone()))
    }

    /// Flushes what is pending, writes the head anchor and stops the writer; every handle
    /// then gets [`RecordError::Closed`]. Returns the final status.
    pub async fn close(&self) -> Result<WriterStatus, RecordError> {
        let (tx, rx) = oneshot::channel();
        self.stages.close(Reply::Async(tx));
        rx.await.unwrap_or_else(|_| Err(self.shared.gone()))
    }

    /// [`RecordWriter::close`] for threads that are not async tasks.
    pub fn close_blocking(&self) -> Result<WriterStatus, RecordError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.stages.close(Reply::Blocking(tx));
        rx.recv().unwrap_or_else(|_| Err(self.shared.gone()))
    }

    /// Makes the next sync (whoever runs it) `by` slower: a test holds a record written but
    /// not yet durable for that long.
    #[cfg(test)]
    pub(crate) fn slow_next_sync(&self, by: std::time::Duration) {
        self.stages.slow_next_sync(by);
    }

    /// The current status (sequence range, chain head, failure).
    pub fn status(&self) -> WriterStatus {
        self.shared.status()
    }

    /// The failure reason, once the writer has failed.
    pub fn failure(&self) -> Option<String> {
        self.shared.failed.get().cloned()
    }

    /// Torn last lines preserved when the directory was opened.
    pub fn recovered(&self) -> Vec<TornTail> {
        self.shared.status().recovered
    }

    /// The record directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn refuse_if_failed(&self) -> Result<(), RecordError> {
        match self.shared.failed.get() {
            Some(reason) => Err(RecordError::WriterFailed {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }
}

struct Resumed {
    chain: Chainer,
    first_seq: Option<u64>,
    file_path: PathBuf,
    file_bytes: u64,
    file_lines: u64,
    recovered: Vec<TornTail>,
}

/// Finds where the stream in `dir` ends, repairing a torn tail, and checks the head anchor.
fn resume(dir: &Path) -> Result<Resumed, RecordError> {
    let files = record_files_on_disk(dir)?;
    let mut recovered = replay_ring(dir, &files)?;
    let Some(last) = files.last() else {
        let path = dir.join(record_file_name(1));
        create_record_file(dir, &path)?;
        check_anchor(dir, &Chainer::genesis())?;
        return Ok(Resumed {
            chain: Chainer::genesis(),
            first_seq: None,
            file_path: path,
            file_bytes: 0,
            file_lines: 0,
            recovered,
        });
    };
    let mut bytes = store::read_record_file(&last.path)?;
    let (_, torn) = split_lines(&bytes);
    if !torn.is_empty() {
        let tail = preserve_torn_tail(&last.path, torn)?;
        let keep = bytes.len() - torn.len();
        let f = store::open_record_file_as(&last.path, OpenOptions::new().write(true))
            .map_err(StoreError::io("open", &last.path))?;
        f.set_len(keep as u64)
            .and_then(|()| f.sync_all())
            .map_err(StoreError::io("truncate the torn line of", &last.path))?;
        tracing::warn!(
            file = %last.path.display(),
            sidecar = %tail.sidecar.display(),
            bytes = tail.bytes,
            "record file ended in a torn line (a crash mid-write); it was never acknowledged as \
             durable, so it was cut from the stream and its bytes preserved in the sidecar"
        );
        bytes.truncate(keep);
        recovered.push(tail);
    }
    let lines: Vec<&[u8]> = split_lines(&bytes).0.collect();
    let before_last = files.len().checked_sub(2).map(|i| &files[i]);
    let chain = match lines.last() {
        Some(_) => chain_after(last, &lines, before_last)?,
        None => {
            // An empty last file (rotation happened, nothing written yet): the chain ends in
            // the previous file, and this file must be named for the next record.
            let chain = match before_last {
                Some(prev) => {
                    let prev_bytes = store::read_record_file(&prev.path)?;
                    let (prev_lines, prev_torn) = split_lines(&prev_bytes);
                    let prev_lines: Vec<&[u8]> = prev_lines.collect();
                    if !prev_torn.is_empty() {
                        return Err(RecordError::Corrupt {
                            path: prev.path.clone(),
                            line: prev_lines.len() as u64 + 1,
                            problem: "a record file before the last one ends in a torn line".into(),
                        });
                    }
                    match prev_lines.last() {
                        Some(_) => chain_after(
                            prev,
                            &prev_lines,
                            files.len().checked_sub(3).map(|i| &files[i]),
                        )?,
                        None => {
                            return Err(RecordError::Corrupt {
                                path: prev.path.clone(),
                                line: 0,
                                problem: "an earlier record file is empty".into(),
                            });
                        }
                    }
                }
                None => Chainer::genesis(),
            };
            if chain.next_seq() != last.first_seq {
                return Err(RecordError::Corrupt {
                    path: last.path.clone(),
                    line: 0,
                    problem: format!(
                        "the empty file is named for record {} but the chain continues at {}",
                        last.first_seq,
                        chain.next_seq()
                    ),
                });
            }
            chain
        }
    };
    check_anchor(dir, &chain)?;
    let first_seq = first_seq_of(&files[0].path)?;
    Ok(Resumed {
        chain,
        first_seq,
        file_path: last.path.clone(),
        file_bytes: bytes.len() as u64,
        file_lines: lines.len() as u64,
        recovered,
    })
}

/// Writes the records the ring holds past its checkpoint into the record file the
/// checkpoint names, where a crash of the machine lost them (its lines are synced only at
/// checkpoints), each at its place even if the file seems to hold it, and syncs the file. Bytes of that file past the checkpoint that are not the ring's records (a
/// torn or never-synced line) are preserved in a sidecar, as a torn tail is, and cut.
fn replay_ring(dir: &Path, files: &[RecordFile]) -> Result<Vec<TornTail>, RecordError> {
    let Some((checkpoint, entries)) = ring::read_back(dir)? else {
        store::refuse_lost_ring(dir)?;
        // An empty file holds nothing to cut: a first open that stopped before its anchor
        // and ring were made leaves one.
        let holds_records = files
            .iter()
            .any(|f| fs::metadata(&f.path).is_ok_and(|m| m.len() > 0));
        if holds_records && HeadAnchor::read(&dir.join(HEAD_FILE))?.is_none() {
            return Err(RecordError::Unanchored {
                dir: dir.to_path_buf(),
            });
        }
        return Ok(Vec::new());
    };
    let path = dir.join(&checkpoint.file);
    // Gone, it took the records the checkpoint made durable (or, at its start, the file
    // was made durable before the checkpoint named it): no crash does that.
    let Some(position) = files.iter().position(|f| f.path == path) else {
        return Err(RecordError::Corrupt {
            path,
            line: checkpoint.lines,
            problem: format!(
                "the write-ahead ring's checkpoint says this file holds records up to {} durably \
                 (and the ring {} more), but it is missing",
                checkpoint.seq,
                entries.len()
            ),
        });
    };
    let file = store::open_record_file_io(&path).map_err(StoreError::io("open", &path))?;
    let len = file
        .metadata()
        .map_err(StoreError::io("read", &path))?
        .len();
    let start = checkpoint.bytes;
    if len < start {
        // No crash does this: the bytes were synced before the checkpoint was written.
        return Err(RecordError::Corrupt {
            path,
            line: checkpoint.lines,
            problem: format!(
                "the file has {} bytes, fewer than the {} its last checkpoint made durable \
                 (up to record {}): lines were cut after they were synced",
                len, checkpoint.bytes, checkpoint.seq
            ),
        });
    }
    if let Some(problem) = ring::past_checkpoint_problem(len, start) {
        return Err(RecordError::Corrupt {
            path,
            line: checkpoint.lines,
            problem,
        });
    }
    let (have, ends_a_line) =
        ring::read_past_checkpoint(&file, len, start).map_err(StoreError::io("read", &path))?;
    drop(file);
    let later: Vec<PathBuf> = files[position + 1..]
        .iter()
        .map(|f| f.path.clone())
        .collect();
    let later = ring::later_files(&later).map_err(StoreError::io("stat", dir))?;
    // The checkpoint names the last durable record: lines cut or edited below it, the
    // same length or not, must not be continued from.
    if ends_a_line {
        let previous = position.checked_sub(1).map(|i| files[i].path.as_path());
        if let Some(problem) = ring::durable_end_problem(&path, previous, &checkpoint)
            .map_err(StoreError::io("read", &path))?
        {
            return Err(RecordError::Corrupt {
                path,
                line: checkpoint.lines,
                problem,
            });
        }
    }
    // What the file keeps past the checkpoint: all of it (`None`: it holds every entry, and
    // past them perhaps records a rotation synced), or the first `matched` bytes, which hold
    // the first `kept` entries.
    let keep = match ring::replay_plan(&have, ends_a_line, &entries, later) {
        ring::ReplayPlan::Nothing if entries.is_empty() => return Ok(Vec::new()),
        ring::ReplayPlan::Nothing => None,
        ring::ReplayPlan::ChangedBelowCheckpoint => {
            return Err(RecordError::Corrupt {
                path,
                line: checkpoint.lines,
                problem: format!(
                    "the {} bytes its last checkpoint made durable (up to record {}) no longer \
                     end at a line's end: the file was changed after they were synced",
                    checkpoint.bytes, checkpoint.seq
                ),
            });
        }
        ring::ReplayPlan::Rewrite { kept, matched } => Some((kept, matched)),
        ring::ReplayPlan::LaterFilesHoldRecords => {
            return Err(RecordError::Corrupt {
                line: checkpoint.lines,
                problem: ring::later_files_hold_records(&path),
                path,
            });
        }
    };
    let mut recovered = Vec::new();
    let cut = keep.map_or(&[][..], |(_, matched)| &have[matched..]);
    if !cut.is_empty() {
        recovered.push(preserve_torn_tail(&path, cut)?);
    }
    // Every entry is written at its place, those the file seems to hold too: after a failed
    // write-back of the file (Linux reports it once, to the writer whose sync failed), the
    // page cache may still hold lines that never reached the disk, and a sync from this
    // process would succeed without writing them. Written again, they are dirty, and the sync
    // below writes them or fails, before the ring's checkpoint moves past them.
    let mut lines = Vec::new();
    for entry in &entries {
        lines.extend_from_slice(&entry.line);
        lines.push(b'\n');
    }
    let f = store::open_record_file_as(&path, OpenOptions::new().write(true))
        .map_err(StoreError::io("open", &path))?;
    match keep {
        Some((_, matched)) => f.set_len(start + matched as u64),
        None => Ok(()),
    }
    .and_then(|()| {
        use std::os::unix::fs::FileExt;
        f.write_all_at(&lines, start)
    })
    .and_then(|()| f.sync_all())
    .map_err(StoreError::io("replay the write-ahead ring into", &path))?;
    match keep {
        Some((kept, _)) if kept < entries.len() => tracing::warn!(
            file = %path.display(),
            replayed = entries.len() - kept,
            first = checkpoint.seq + 1 + kept as u64,
            cut_bytes = cut.len(),
            "record file lacked durable records (a crash before its checkpoint); they were \
             written back from the write-ahead ring"
        ),
        Some(_) => tracing::warn!(
            file = %path.display(),
            cut_bytes = cut.len(),
            "record file ended in bytes that are no durable record (a crash mid-write; never \
             acknowledged); they were cut from the stream and preserved in a sidecar"
        ),
        None => tracing::debug!(
            file = %path.display(),
            rewritten = entries.len(),
            "record file held the write-ahead ring's records past its checkpoint; they were \
             written again and synced before the checkpoint moved"
        ),
    }
    Ok(recovered)
}

/// Takes the directory's writer lock: two writers would interleave their lines and each
/// would checkpoint the ring for the other. Released once the writer's sync thread ends (on
/// close, or when every handle is gone) or its process does, and never inherited past `exec`
/// (the file is opened close-on-exec).
fn lock_dir(dir: &Path) -> Result<nix::fcntl::Flock<File>, RecordError> {
    take_for_writing(dir, LOCK_FILE)
}

/// Takes `name`'s lock in `dir` exclusively, waiting up to [`LOCK_WAIT`]: a writer just
/// closed or dropped may still be finishing its last checkpoint; one that is running holds
/// the lock for good, and the directory is then in use.
fn take_for_writing(dir: &Path, name: &str) -> Result<nix::fcntl::Flock<File>, RecordError> {
    match store::lock_within(&dir.join(name), true, true, LOCK_WAIT)? {
        store::Locked::Held(held) => Ok(held),
        store::Locked::Busy | store::Locked::Absent => Err(RecordError::InUse {
            dir: dir.to_path_buf(),
        }),
    }
}

/// How long opening waits for another writer's lock before refusing.
const LOCK_WAIT: Duration = Duration::from_secs(2);

fn file_name_of(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The chain continued after `lines`, the whole lines of record `file` (at least one): its
/// last line must be the record its place says (the file is named for its first record) and
/// carry the hash of the line before it (in this file, or the last one of `previous`, the
/// record file before it; record 1 carries the genesis hash). One that does not was not
/// written by the writer: continuing from it would reuse sequence numbers or chain new
/// records to a line no record vouches for.
fn chain_after(
    file: &RecordFile,
    lines: &[&[u8]],
    previous: Option<&RecordFile>,
) -> Result<Chainer, RecordError> {
    let n = lines.len() as u64;
    let corrupt = |problem: String| RecordError::Corrupt {
        path: file.path.clone(),
        line: n,
        problem,
    };
    let Some(&line) = lines.last() else {
        return Err(corrupt("the file holds no record".into()));
    };
    let record = DecisionRecord::from_json_line(line)
        .map_err(|e| corrupt(format!("the last record is not valid ({e})")))?;
    let seq = record.flowhost.seq;
    let place = file.first_seq.checked_add(n - 1);
    if place != Some(seq) {
        return Err(corrupt(format!(
            "the last record says it is record {seq}, but it is line {n} of the file named \
             for record {}",
            file.first_seq
        )));
    }
    let before = match (lines.len().checked_sub(2), previous) {
        (Some(i), _) => Some(line_hash(lines[i])),
        (None, Some(previous)) => {
            let file = store::open_record_file(&previous.path)?;
            let len = file
                .metadata()
                .map_err(StoreError::io("inspect", &previous.path))?
                .len();
            let last = match len {
                0 => None,
                _ => ring::line_ending_at(&file, len)
                    .map_err(StoreError::io("read", &previous.path))?,
            };
            let Some(last) = last else {
                return Err(corrupt(format!(
                    "the record file before it, {}, does not end in a whole line",
                    previous.path.display()
                )));
            };
            Some(line_hash(&last))
        }
        (None, None) if seq == 1 => Some(ChainHash::genesis()),
        // The first file of a stream that starts late: nothing before it to check against.
        (None, None) => None,
    };
    if let Some(before) = before
        && record.flowhost.prev_hash != before.as_str()
    {
        return Err(corrupt(format!(
            "the last record's prev_hash is {}, but the line before it hashes to {before}",
            record.flowhost.prev_hash
        )));
    }
    Chainer::resume(seq, line_hash(line)).ok_or_else(|| {
        corrupt(format!(
            "the last record is {seq}: no sequence number is left for the next"
        ))
    })
}

fn first_seq_of(path: &Path) -> Result<Option<u64>, RecordError> {
    let f = store::open_record_file(path)?;
    let mut line = Vec::new();
    BufReader::new(f)
        .read_until(b'\n', &mut line)
        .map_err(StoreError::io("read", path))?;
    if line.last() != Some(&b'\n') {
        return Ok(None);
    }
    line.pop();
    DecisionRecord::from_json_line(&line)
        .map(|r| Some(r.flowhost.seq))
        .map_err(|e| RecordError::Corrupt {
            path: path.to_path_buf(),
            line: 1,
            problem: format!("the first record is not valid ({e})"),
        })
}

/// Makes the head anchor of `dir` say that a write-ahead ring is kept there (see
/// `HeadAnchor::ring`), keeping what it names; with no anchor yet, one naming the head of
/// `chain` (the stream as the writer resumed it, its file synced) is written, as the
/// syncer's first anchor would name it. Durable before it returns.
fn mark_ring_kept(dir: &Path, chain: &Chainer) -> Result<(), RecordError> {
    let path = dir.join(HEAD_FILE);
    let anchor = match HeadAnchor::read(&path)? {
        Some(anchor) if anchor.ring => return Ok(()),
        Some(anchor) => HeadAnchor {
            ring: true,
            written_at: super::build::now_rfc3339(),
            ..anchor
        },
        None => HeadAnchor {
            schema: HEAD_SCHEMA.to_string(),
            seq: chain.next_seq() - 1,
            hash: chain.head_hash().as_str().to_string(),
            file: None,
            line: None,
            written_at: super::build::now_rfc3339(),
            ring: true,
        },
    };
    anchor.write(&path)?;
    Ok(())
}

fn check_anchor(dir: &Path, chain: &Chainer) -> Result<(), RecordError> {
    let Some(anchor) = HeadAnchor::read(&dir.join(HEAD_FILE))? else {
        return Ok(());
    };
    let last = chain.next_seq() - 1;
    let conflict = |problem: String| {
        Err(RecordError::HeadConflict {
            dir: dir.to_path_buf(),
            problem,
        })
    };
    if anchor.seq > last {
        return conflict(format!(
            "the anchor names record {} but the stream ends at {last}: {} whole lines are missing",
            anchor.seq,
            anchor.seq - last
        ));
    }
    if anchor.seq == last && anchor.hash != chain.head_hash().as_str() {
        return conflict(format!(
            "record {last}, the anchored last record, was edited"
        ));
    }
    Ok(())
}

fn preserve_torn_tail(file: &Path, torn: &[u8]) -> Result<TornTail, RecordError> {
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = crate::files::parent_dir(file);
    let sidecar = (1u32..)
        .map(|n| dir.join(format!("{name}{TORN_INFIX}{n}")))
        .find(|p| !p.exists())
        .unwrap_or_else(|| dir.join(format!("{name}{TORN_INFIX}overflow")));
    write_atomic(&sidecar, torn, 0o600).map_err(|e| RecordError::Store(StoreError::Write(e)))?;
    Ok(TornTail {
        file: file.to_path_buf(),
        sidecar,
        bytes: torn.len(),
    })
}

fn create_record_file(dir: &Path, path: &Path) -> Result<File, RecordError> {
    let f = OpenOptions::new()
        .append(true)
        .create_new(true)
        .open(path)
        .map_err(StoreError::io("create", path))?;
    sync_dir(dir).map_err(StoreError::io("fsync directory", dir))?;
    Ok(f)
}

mod stages;

pub use super::ring::{MIN_RING_BYTES, RING_FILE};
pub use super::store::LOCK_FILE;

#[cfg(test)]
mod tests;
