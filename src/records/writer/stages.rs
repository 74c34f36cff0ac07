//! Where records are written and made durable. A caller seals its own record and writes it
//! (its ring entry, then its line; under the [`Stages`] lock, so the chain, the ring and the
//! file keep one order), then queues it for the *syncer* thread, which makes everything
//! queued so far durable with one `fdatasync` of the write-ahead ring and completes whoever
//! waits, while the next records are already being written (group commit). Writing on the
//! caller's thread spares the two hand-offs to and from a writer thread. The syncer also
//! syncs written records nobody waits for within [`LAZY_SYNC`], and checkpoints the ring
//! with each refresh of the head anchor.
//!
//! A caller that says it is alone (the daemon: one call in flight) *leads* instead when no
//! sync is running, nobody else waits, the last sync served one caller at most and took less
//! than [`LEAD_MAX_SYNC`]: it makes everything queued so far durable with one `fdatasync` on
//! its own thread, sparing the hand-offs to the syncer and back. Syncs never overlap: one
//! flag (`syncing`) is taken by whoever syncs. Concurrent callers keep the syncer's group
//! commit, and a disk that has turned slow keeps its waits off the caller's thread.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{
    CloseReply, CommitReply, Committed, FlushReply, RecordError, Shared, WriterOptions,
    WriterStatus, create_record_file, file_name_of,
};
use crate::records::DecisionRecord;
use crate::records::chain::{ChainHash, Chainer, Sealed};
use crate::records::now_rfc3339;
use crate::records::ring::{Checkpoint, Cursor, Ring};
use crate::records::store::{HEAD_FILE, HEAD_SCHEMA, HeadAnchor, record_file_name};

/// What the writer starts from.
pub(super) struct Start {
    pub dir: PathBuf,
    pub options: WriterOptions,
    pub file: File,
    pub file_path: PathBuf,
    pub file_bytes: u64,
    pub file_lines: u64,
    pub chain: Chainer,
    pub first_seq: Option<u64>,
    pub shared: Arc<Shared>,
    pub ring: Arc<Ring>,
    pub cursor: Cursor,
    pub lock: nix::fcntl::Flock<File>,
}

/// The longest a written record nobody waits for stays unsynced: it rides on the next sync
/// someone waits for, or is synced on its own after this.
const LAZY_SYNC: Duration = Duration::from_millis(5);

/// A caller leads a sync only if the last one took less than this: on a disk that stalls,
/// the wait is the syncer's, not a runtime worker's.
const LEAD_MAX_SYNC: Duration = Duration::from_millis(2);

/// The appending side, shared by every handle; the syncer thread is told when the last
/// handle is gone.
pub(super) struct Stages {
    file: Mutex<Tail>,
    queue: Arc<Queue>,
    shared: Arc<Shared>,
    ring: Arc<Ring>,
}

/// The end of the stream records are appended to.
struct Tail {
    dir: PathBuf,
    rotate_bytes: u64,
    file: Arc<File>,
    file_path: Arc<Path>,
    file_bytes: u64,
    file_lines: u64,
    chain: Chainer,
    closed: bool,
    /// The file's blocks are reserved up to here (see [`Tail::reserve`]).
    reserved: u64,
    /// Reserving is supported by the file system (cleared at the first refusal).
    reserving: bool,
    ring: Arc<Ring>,
    /// Where the next record's ring entry goes.
    cursor: Cursor,
    /// The last record's line and ring entry buffers, reused for the next record: a record is
    /// 1-2 KB, and allocating that much twice per record was a measurable part of a call.
    spare_line: Vec<u8>,
    spare_entry: Vec<u8>,
}

/// How far ahead of a record file's end its blocks are reserved.
pub(super) const RESERVE_AHEAD: u64 = 1024 * 1024;

/// A record in its file, waiting for its sync.
struct Written {
    place: Place,
    /// Who waits for it to be durable (none for an appended record).
    reply: Option<CommitReply>,
}

/// Where a written record is: once it is durable, what a checkpoint and the head anchor name.
#[derive(Clone)]
struct Place {
    file: Arc<File>,
    file_path: Arc<Path>,
    /// The file's line count once this record is in it.
    file_lines: u64,
    /// The file's length once this record is in it.
    file_bytes: u64,
    /// The ring's cursor after this record.
    cursor: Cursor,
    committed: Committed,
}

impl Place {
    /// A checkpoint right after this record (its file must be synced up to it).
    fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            file: file_name_of(&self.file_path),
            bytes: self.file_bytes,
            lines: self.file_lines,
            seq: self.committed.seq,
            hash: self.committed.hash.clone(),
            ring_at: self.cursor.at,
        }
    }
}

/// What is durable, kept by the syncer (read for the head anchor).
#[derive(Default)]
struct Book {
    first_seq: Option<u64>,
    /// Where the last durable record is.
    durable: Option<Place>,
    anchor_dirty: bool,
    /// When the last sync finished.
    last_sync: Option<Instant>,
    /// How many waiting callers the last sync served: more than one means callers are
    /// concurrent, and their syncs are better grouped by the syncer than led one by one.
    last_waited: usize,
    /// How long the last sync's `fdatasync`s took.
    last_took: Duration,
    /// Syncs led by a caller on its own thread.
    led: u64,
}

/// What the syncer has to do, and when it looks next on its own.
#[derive(Default)]
struct Pending {
    /// A sync (the syncer's or a leading caller's) is running.
    syncing: bool,
    book: Book,
    written: Vec<Written>,
    /// How many of `written` someone waits for.
    waited: usize,
    /// When the oldest unwaited record in `written` was appended.
    lazy_since: Option<Instant>,
    flushes: Vec<FlushReply>,
    close: Option<CloseReply>,
    /// The ring is more than half used since its last checkpoint: the syncer checkpoints it
    /// before an appender would have to, under the file's lock.
    checkpoint_wanted: bool,
    /// Every handle is gone.
    hung_up: bool,
    /// The syncer has ended; nothing queued now would be answered.
    ended: bool,
    /// When the syncer looks again without being woken (`None`: only when woken).
    next_look: Option<Instant>,
    /// A test makes the next sync this much slower.
    #[cfg(test)]
    slow_next_sync: Option<Duration>,
    /// A test makes the next sync panic.
    #[cfg(test)]
    panic_next_sync: bool,
    /// How often the syncer has looked for work.
    #[cfg(test)]
    looks: u64,
}

struct Queue {
    pending: Mutex<Pending>,
    wake: Condvar,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        // The syncer never panics while holding the lock with the queue half-changed: every
        // change under it is a push or a take.
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Starts the syncer thread and returns the appending side.
pub(super) fn start(s: Start) -> Result<Stages, RecordError> {
    let queue = Arc::new(Queue {
        pending: Mutex::new(Pending::default()),
        wake: Condvar::new(),
    });
    queue.lock().book = Book {
        first_seq: s.first_seq,
        durable: None,
        anchor_dirty: true,
        last_sync: None,
        last_waited: 0,
        last_took: Duration::ZERO,
        led: 0,
    };
    let lock = s.lock;
    let (ended_queue, ended_shared) = (queue.clone(), s.shared.clone());
    let syncer = Syncer {
        ring: s.ring.clone(),
        dir: s.dir.clone(),
        head_interval: s.options.head_interval,
        shared: s.shared.clone(),
        queue: queue.clone(),
        last_anchor: None,
        #[cfg(test)]
        pause: PAUSE_FIRST_ANCHOR.with(|p| p.borrow_mut().take()),
    };
    std::thread::Builder::new()
        .name("flowhost-rec-sync".into())
        .spawn(move || {
            // The directory's writer lock is held until the syncer has written its last
            // checkpoint and anchor, and, should it panic, until the writer is failed: no
            // second writer may open the directory while this one could still append.
            let _lock = lock;
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| syncer.run()));
            if run.is_err() {
                fail(
                    &ended_shared,
                    "the record writer's sync thread panicked".to_string(),
                );
                end_queue(&ended_queue, &ended_shared);
            }
        })
        .map_err(RecordError::Spawn)?;
    Ok(Stages {
        file: Mutex::new(Tail {
            dir: s.dir,
            rotate_bytes: s.options.rotate_bytes,
            file: Arc::new(s.file),
            file_path: Arc::from(s.file_path),
            file_bytes: s.file_bytes,
            file_lines: s.file_lines,
            chain: s.chain,
            closed: false,
            reserved: 0,
            reserving: true,
            ring: s.ring.clone(),
            cursor: s.cursor,
            spare_line: Vec::new(),
            spare_entry: Vec::new(),
        }),
        queue,
        shared: s.shared,
        ring: s.ring,
    })
}

impl Drop for Stages {
    fn drop(&mut self) {
        self.queue.lock().hung_up = true;
        self.queue.wake.notify_one();
    }
}

impl Stages {
    /// Seals `record` into the chain and appends its line to the file, then queues it for
    /// the syncer (`reply`, if any, is answered once it is durable). Returns once the line is
    /// written.
    pub(super) fn write(
        &self,
        mut record: DecisionRecord,
        reply: Option<CommitReply>,
        may_lead: bool,
    ) -> Result<Committed, RecordError> {
        let mut tail = self.file.lock().map_err(|_| {
            let reason = "a thread panicked while appending a record".to_string();
            // Failed for good, and said so in the writer's status and health, not only
            // to this caller.
            fail(&self.shared, reason.clone());
            RecordError::WriterFailed { reason }
        })?;
        if tail.closed {
            // A decision made after the stop closed the records: refused, and missing from
            // them, so no health written from now on calls them complete.
            self.shared.update(|s| {
                s.rejected = s.rejected.saturating_add(1);
                s.last_rejection = Some("a decision came after the records were closed".into());
            });
            return Err(RecordError::Closed);
        }
        if let Some(reason) = self.shared.failed.get() {
            return Err(RecordError::WriterFailed {
                reason: reason.clone(),
            });
        }
        let prev = tail.chain.head_hash().clone();
        let spare = std::mem::take(&mut tail.spare_line);
        let sealed = match tail.chain.seal_into(&mut record, spare) {
            Ok(sealed) => sealed,
            Err(e) => {
                // The decision is refused for want of a record, and the records lack it:
                // said in the status, so no health calls them complete.
                self.shared.update(|s| {
                    s.rejected = s.rejected.saturating_add(1);
                    s.last_rejection = Some(e.to_string());
                });
                return Err(e.into());
            }
        };
        let appended = tail.append(&sealed, &prev);
        if let Err(reason) = appended {
            fail(&self.shared, reason.clone());
            return Err(RecordError::WriterFailed { reason });
        }
        tail.keep_spares(sealed.line);
        let committed = Committed {
            seq: sealed.seq,
            hash: sealed.hash,
        };
        let wants_checkpoint = tail.ring.wants_checkpoint(tail.cursor.used);
        // Queued while the file is still held, so the queue keeps the chain's order.
        let lead = self.queue_written(
            Written {
                place: Place {
                    file: tail.file.clone(),
                    file_path: tail.file_path.clone(),
                    file_lines: tail.file_lines,
                    file_bytes: tail.file_bytes,
                    cursor: tail.cursor,
                    committed: committed.clone(),
                },
                reply,
            },
            may_lead,
            wants_checkpoint,
        );
        drop(tail);
        if let Some(written) = lead {
            // Others append meanwhile; their records go to the next sync.
            let led = LedSync {
                queue: &self.queue,
                shared: &self.shared,
            };
            sync_written(&self.queue, &self.shared, &self.ring, written);
            // It ended: the guard has nothing to undo.
            std::mem::forget(led);
            let q = self.queue.lock();
            // Whoever queued a wait while this sync ran needs the syncer; an idle syncer
            // needs to know about the anchor and any appended records.
            let wake = q.waited > 0
                || q.lazy_since.is_some()
                || q.checkpoint_wanted
                || !q.flushes.is_empty()
                || q.close.is_some()
                || q.hung_up
                || q.next_look.is_none();
            drop(q);
            if wake {
                self.queue.wake.notify_one();
            }
        }
        Ok(committed)
    }

    /// Queues a written record for the syncer; returns what to sync if the caller is to lead
    /// the sync instead (only if it `may_lead`, no sync runs and nobody else waits).
    fn queue_written(
        &self,
        w: Written,
        may_lead: bool,
        wants_checkpoint: bool,
    ) -> Option<Vec<Written>> {
        let mut q = self.queue.lock();
        if q.ended {
            drop(q);
            if let Some(reply) = w.reply {
                reply.send(Err(self.shared.gone()));
            }
            return None;
        }
        let checkpoint_news = wants_checkpoint && !q.checkpoint_wanted;
        q.checkpoint_wanted |= wants_checkpoint;
        let wake = if w.reply.is_some() {
            let alone = may_lead
                && q.book.last_waited <= 1
                && q.book.last_took < LEAD_MAX_SYNC
                && !q.syncing
                && q.waited == 0
                && q.flushes.is_empty()
                && q.close.is_none()
                && !q.hung_up;
            if alone {
                q.syncing = true;
                q.book.led += 1;
                q.lazy_since = None;
                let mut written = std::mem::take(&mut q.written);
                written.push(w);
                return Some(written);
            }
            q.waited += 1;
            true
        } else if checkpoint_news {
            true
        } else {
            let since = *q.lazy_since.get_or_insert_with(Instant::now);
            // The syncer needs waking only if it would not look in time on its own.
            q.next_look.is_none_or(|t| t > since + LAZY_SYNC)
        };
        q.written.push(w);
        drop(q);
        if wake {
            self.queue.wake.notify_one();
        }
        None
    }

    /// How many syncs callers have led on their own threads.
    #[cfg(test)]
    pub(super) fn led_syncs(&self) -> u64 {
        self.queue.lock().book.led
    }

    /// Makes the next sync (whoever runs it) `by` slower.
    #[cfg(test)]
    pub(super) fn slow_next_sync(&self, by: Duration) {
        self.queue.lock().slow_next_sync = Some(by);
    }

    /// Makes the next sync (whoever runs it) panic.
    #[cfg(test)]
    pub(super) fn panic_next_sync(&self) {
        self.queue.lock().panic_next_sync = true;
    }

    /// How often the syncer has looked for work.
    #[cfg(test)]
    pub(super) fn syncer_looks(&self) -> u64 {
        self.queue.lock().looks
    }

    /// Whether the last sync was quick enough for a caller to lead the next one.
    #[cfg(test)]
    pub(super) fn last_sync_was_quick(&self) -> bool {
        self.queue.lock().book.last_took < LEAD_MAX_SYNC
    }

    /// Answers `reply` once everything written before this call is durable.
    pub(super) fn flush(&self, reply: FlushReply) {
        let mut q = self.queue.lock();
        if q.ended {
            drop(q);
            reply.send(Err(self.shared.gone()));
            return;
        }
        q.flushes.push(reply);
        drop(q);
        self.queue.wake.notify_one();
    }

    /// Refuses every later record, makes the written ones durable, writes the head anchor
    /// and ends the syncer; `reply` gets the final status.
    pub(super) fn close(&self, reply: CloseReply) {
        match self.file.lock() {
            Ok(mut tail) if !tail.closed => tail.closed = true,
            _ => {
                reply.send(Err(RecordError::Closed));
                return;
            }
        }
        let mut q = self.queue.lock();
        if q.ended {
            drop(q);
            reply.send(Err(self.shared.gone()));
            return;
        }
        q.close = Some(reply);
        drop(q);
        self.queue.wake.notify_one();
    }
}

/// The largest buffer a writer keeps for the next record: an unusually long record's
/// buffers are let go rather than held for the writer's lifetime.
const SPARE_MAX: usize = 64 * 1024;

impl Tail {
    /// Keeps `line` (the last record's, written) and the ring entry's scratch for the next
    /// record, unless they grew past [`SPARE_MAX`].
    fn keep_spares(&mut self, line: Vec<u8>) {
        if line.capacity() <= SPARE_MAX {
            self.spare_line = line;
        }
        if self.spare_entry.capacity() > SPARE_MAX {
            self.spare_entry = Vec::new();
        }
    }

    /// Writes one sealed record: its entry to the ring, then its line to the file, first
    /// starting a new file (record `seq`'s) if the line would take this one past the rotation
    /// size. `prev` is the hash of the record before it.
    fn append(&mut self, sealed: &Sealed, prev: &ChainHash) -> Result<(), String> {
        let line = &sealed.line;
        if self.file_bytes > 0 && self.file_bytes + line.len() as u64 > self.rotate_bytes {
            // The old file is made durable before the stream moves on, so that the checkpoint
            // can name the new one: the ring's entries from here on are all the new file's.
            self.ring.sync_record_file(&self.file, &self.file_path)?;
            let path = self.dir.join(record_file_name(sealed.seq));
            let file =
                create_record_file(&self.dir, &path).map_err(|e| format!("rotation: {e}"))?;
            self.file = Arc::new(file);
            self.file_path = Arc::from(path);
            self.file_bytes = 0;
            self.file_lines = 0;
            self.reserved = 0;
            self.checkpoint(sealed.seq - 1, prev)?;
        }
        // The line without its newline is what the chain hashes.
        let body = &line[..line.len() - 1];
        let mut in_ring = self.ring.can_hold(body.len());
        if in_ring && !self.ring.has_room(self.cursor, body.len()) {
            // The sync thread's checkpoints have not kept up: this caller makes room.
            self.ring.sync_record_file(&self.file, &self.file_path)?;
            self.checkpoint(sealed.seq - 1, prev)?;
            // Even with everything checkpointed, an entry that must wrap does not fit if it is
            // longer than the ring before the cursor: it would overwrite the wrap mark the
            // checkpoint's replay starts from. Such a line is made durable in its file.
            in_ring = self.ring.has_room(self.cursor, body.len());
        }
        if in_ring {
            self.ring
                .append(
                    &mut self.cursor,
                    sealed.seq,
                    &sealed.digest,
                    body,
                    &mut self.spare_entry,
                )
                .map_err(|e| e.to_string())?;
        }
        let end = self.file_bytes + line.len() as u64;
        if self.reserving && end > self.reserved {
            self.reserve(end);
        }
        (&*self.file)
            .write_all(line)
            .map_err(|e| format!("cannot append to {}: {e}", self.file_path.display()))?;
        self.file_bytes += line.len() as u64;
        self.file_lines += 1;
        if !in_ring {
            // A line the ring cannot take is made durable in its file at once.
            self.ring.sync_record_file(&self.file, &self.file_path)?;
            self.checkpoint(sealed.seq, &sealed.hash)?;
        }
        Ok(())
    }

    /// Checkpoints the ring at the file's current end, whose last record is `seq` with line
    /// hash `hash`; the file must be durable up to there.
    fn checkpoint(&self, seq: u64, hash: &ChainHash) -> Result<(), String> {
        let checkpoint = Checkpoint {
            file: file_name_of(&self.file_path),
            bytes: self.file_bytes,
            lines: self.file_lines,
            seq,
            hash: hash.clone(),
            ring_at: self.cursor.at,
        };
        self.ring
            .checkpoint(&checkpoint, self.cursor.used)
            .map_err(|e| e.to_string())
    }

    /// Reserves the file's blocks from its end to [`RESERVE_AHEAD`] past `end` (never
    /// further than the rotation size), without changing its size: readers still see only
    /// whole lines. Why: an append that starts a new block makes the next `fdatasync` write
    /// the file system's allocation metadata too, which on ext4 made the sync of a call's two
    /// records (about 2.6 KB) take 178 µs instead of 140 µs; with the blocks reserved in
    /// advance it writes the data and the inode only. A file system that cannot reserve
    /// (or a full one) changes nothing: appends go on as before. A rotated file keeps its
    /// unused reserve (under [`RESERVE_AHEAD`]) allocated past its end.
    fn reserve(&mut self, end: u64) {
        let to = (end + RESERVE_AHEAD).min(self.rotate_bytes.max(end));
        let (Ok(offset), Ok(len)) = (
            i64::try_from(self.file_bytes),
            i64::try_from(to.saturating_sub(self.file_bytes)),
        ) else {
            return;
        };
        match nix::fcntl::fallocate(
            &*self.file,
            nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Ok(()) => self.reserved = to,
            // A full file system may have room again later; one that cannot reserve never will.
            Err(e) if e != nix::errno::Errno::EOPNOTSUPP => {}
            Err(e) => {
                self.reserving = false;
                tracing::debug!(
                    file = %self.file_path.display(),
                    error = %e,
                    "cannot reserve blocks ahead of the record file's end; appending without"
                );
            }
        }
    }
}

/// A sync a caller leads, until it has ended: should it unwind instead (a panic on the
/// caller's thread), the writer is failed and the sync marked over, so that neither the
/// syncer nor any later caller waits for a sync that will never end; the callers whose
/// records it held are answered by their dropped replies.
struct LedSync<'a> {
    queue: &'a Queue,
    shared: &'a Shared,
}

impl Drop for LedSync<'_> {
    fn drop(&mut self) {
        fail(self.shared, "a sync led by a caller panicked".to_string());
        self.queue.lock().syncing = false;
        self.queue.wake.notify_one();
    }
}

/// The syncer has ended: whatever is still queued is answered, and nothing more is taken.
fn end_queue(queue: &Queue, shared: &Shared) {
    let left = {
        let mut q = queue.lock();
        let left = std::mem::take(&mut *q);
        q.ended = true;
        left
    };
    for w in left.written {
        if let Some(reply) = w.reply {
            reply.send(Err(shared.gone()));
        }
    }
    for reply in left.flushes {
        reply.send(Err(shared.gone()));
    }
    if let Some(reply) = left.close {
        reply.send(Err(RecordError::Closed));
    }
}

fn fail(shared: &Shared, reason: String) {
    tracing::error!(%reason, "record writer failed; refusing every further record (fail closed)");
    let _ = shared.failed.set(reason.clone());
    shared.update(|s| {
        s.failed.get_or_insert(reason);
    });
}

/// One round of the syncer's work, taken from the queue at once.
#[derive(Default)]
struct Batch {
    written: Vec<Written>,
    flushes: Vec<FlushReply>,
    close: Option<CloseReply>,
    hung_up: bool,
    checkpoint: bool,
}

struct Syncer {
    ring: Arc<Ring>,
    dir: PathBuf,
    head_interval: Duration,
    shared: Arc<Shared>,
    queue: Arc<Queue>,
    last_anchor: Option<Instant>,
    /// A test's pause in the first anchor refresh (see [`AnchorPause`]).
    #[cfg(test)]
    pause: Option<AnchorPause>,
}

/// Where a test holds the syncer's first anchor refresh: `read` is told once it has read
/// what the anchor names (or, if `before`, right before it reads), then it waits for `go`,
/// and tells `written` once the anchor is in place.
#[cfg(test)]
pub(super) struct AnchorPause {
    pub before: bool,
    pub read: std::sync::mpsc::Sender<()>,
    pub go: std::sync::mpsc::Receiver<()>,
    pub written: std::sync::mpsc::Sender<()>,
}

#[cfg(test)]
thread_local! {
    /// Set by a test: the next writer opened on this thread pauses its first anchor refresh.
    pub(super) static PAUSE_FIRST_ANCHOR: std::cell::RefCell<Option<AnchorPause>> =
        const { std::cell::RefCell::new(None) };
}

/// How long after a sync the syncer keeps looking every [`LAZY_SYNC`] on its own, so that
/// appended records need not wake it while calls keep coming.
const ACTIVE_WINDOW: Duration = Duration::from_millis(100);

impl Syncer {
    fn run(mut self) {
        loop {
            let Some(batch) = self.next_batch() else {
                self.refresh_anchor();
                continue;
            };
            sync_written(&self.queue, &self.shared, &self.ring, batch.written);
            for reply in batch.flushes {
                reply.send(match self.shared.failed.get() {
                    Some(reason) => Err(RecordError::WriterFailed {
                        reason: reason.clone(),
                    }),
                    None => Ok(()),
                });
            }
            if batch.checkpoint
                && self.shared.failed.get().is_none()
                && let Err(reason) = self.checkpoint()
            {
                fail(&self.shared, reason);
            }
            if batch.close.is_some() || batch.hung_up {
                let status = self.finish();
                self.end();
                // With every handle gone nobody awaits the result, and a failure is already
                // recorded in the shared status.
                if let Some(reply) = batch.close {
                    reply.send(status);
                }
                return;
            }
            let due = self
                .last_anchor
                .is_none_or(|t| t.elapsed() >= self.head_interval);
            if self.queue.lock().book.anchor_dirty && due {
                self.refresh_anchor();
            }
        }
    }

    /// Waits for work: a record someone waits for, a flush, a close, every handle gone, or
    /// appended records older than [`LAZY_SYNC`]. `None`: the head anchor is due instead. While calls keep
    /// coming (a sync within [`ACTIVE_WINDOW`]) it looks every [`LAZY_SYNC`] on its own, so
    /// that appended records need not wake it.
    fn next_batch(&self) -> Option<Batch> {
        let mut q = self.queue.lock();
        loop {
            #[cfg(test)]
            {
                q.looks += 1;
            }
            let now = Instant::now();
            let lazy_due = q.lazy_since.map(|t| t + LAZY_SYNC);
            if !q.syncing
                && (q.waited > 0
                    || !q.flushes.is_empty()
                    || q.close.is_some()
                    || q.hung_up
                    || q.checkpoint_wanted
                    || lazy_due.is_some_and(|t| t <= now))
            {
                q.syncing = true;
                q.waited = 0;
                q.lazy_since = None;
                q.next_look = Some(now);
                return Some(Batch {
                    written: std::mem::take(&mut q.written),
                    flushes: std::mem::take(&mut q.flushes),
                    close: q.close.take(),
                    hung_up: q.hung_up,
                    checkpoint: std::mem::take(&mut q.checkpoint_wanted),
                });
            }
            let linger = q
                .book
                .last_sync
                .is_some_and(|t| now.saturating_duration_since(t) < ACTIVE_WINDOW)
                .then(|| now + LAZY_SYNC);
            let anchor_due =
                (q.book.anchor_dirty && self.shared.failed.get().is_none()).then(|| {
                    self.last_anchor
                        .map_or(now, |t| t + self.head_interval)
                        .max(now + Duration::from_millis(1))
                });
            // While a caller's sync runs, neither appended records come due nor the anchor
            // can be served: the caller wakes this thread when it is done (see `write`),
            // rather than it looking again and again for as long as the disk holds the sync.
            let look = [lazy_due, anchor_due]
                .into_iter()
                .flatten()
                .filter(|_| !q.syncing)
                .chain(linger)
                .min();
            q.next_look = look;
            q = match look {
                None => self
                    .queue
                    .wake
                    .wait(q)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(t) => {
                    self.queue
                        .wake
                        .wait_timeout(q, t.saturating_duration_since(now))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
            if anchor_due.is_some_and(|t| t <= Instant::now()) && q.written.is_empty() && !q.syncing
            {
                return None;
            }
        }
    }

    /// The syncer has ended: whatever is still queued is answered, and nothing more is taken.
    fn end(&self) {
        end_queue(&self.queue, &self.shared);
    }

    /// Checkpoints the ring at the last durable record (its file synced first), then names
    /// that record in the head anchor: the anchor only names a record its file holds durably.
    fn write_anchor(&mut self) -> Result<(), String> {
        self.queue.lock().book.anchor_dirty = false;
        #[cfg(test)]
        self.pause_anchor(true);
        // With nothing synced since open, the anchor names the head the writer opened with,
        // read in the same look: a sync booked after it (a caller may lead one meanwhile)
        // is in the ring only until the next checkpoint syncs its file.
        let (durable, seq, hash) = {
            let q = self.queue.lock();
            match &q.book.durable {
                Some(d) => (Some(d.clone()), d.committed.seq, d.committed.hash.clone()),
                None => {
                    let status = self.shared.status();
                    (None, status.last_seq.unwrap_or(0), status.chain_head)
                }
            }
        };
        #[cfg(test)]
        self.pause_anchor(false);
        if let Some(d) = &durable {
            self.checkpoint_at(d)?;
        }
        let anchor = HeadAnchor {
            schema: HEAD_SCHEMA.to_string(),
            seq,
            hash: hash.as_str().to_string(),
            file: durable.as_ref().and_then(|d| {
                d.file_path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
            }),
            line: durable.as_ref().map(|d| d.file_lines),
            written_at: now_rfc3339(),
            ring: true,
        };
        anchor.write(&self.dir.join(HEAD_FILE)).map_err(|e| {
            // The reason is kept as text (health reports it): with the OS's words in it.
            match std::error::Error::source(&e) {
                Some(cause) => format!("head anchor: {e}: {cause}"),
                None => format!("head anchor: {e}"),
            }
        })?;
        self.last_anchor = Some(Instant::now());
        #[cfg(test)]
        if let Some(p) = self.pause.take() {
            let _ = p.written.send(());
        }
        Ok(())
    }

    /// Syncs the record file up to the last durable record and checkpoints the ring there;
    /// returns that record (`None`: nothing was synced since open).
    fn checkpoint(&self) -> Result<Option<Place>, String> {
        let durable = self.queue.lock().book.durable.clone();
        if let Some(d) = &durable {
            self.checkpoint_at(d)?;
        }
        Ok(durable)
    }

    /// Holds a test's paused anchor refresh at its point (`before` reading or after).
    #[cfg(test)]
    fn pause_anchor(&self, before: bool) {
        if let Some(p) = self.pause.as_ref().filter(|p| p.before == before) {
            let _ = p.read.send(());
            let _ = p.go.recv();
        }
    }

    /// Syncs the record file up to the durable record `d` and checkpoints the ring there.
    fn checkpoint_at(&self, d: &Place) -> Result<(), String> {
        self.ring.sync_record_file(&d.file, &d.file_path)?;
        self.ring
            .checkpoint(&d.checkpoint(), d.cursor.used)
            .map_err(|e| e.to_string())
    }

    fn refresh_anchor(&mut self) {
        if self.shared.failed.get().is_some() {
            return;
        }
        if let Err(reason) = self.write_anchor() {
            fail(&self.shared, reason);
        }
    }

    /// Final anchor on close or when every handle is gone.
    fn finish(&mut self) -> Result<WriterStatus, RecordError> {
        if self.shared.failed.get().is_none()
            && let Err(reason) = self.write_anchor()
        {
            fail(&self.shared, reason);
        }
        self.shared.update(|s| s.closed = true);
        match self.shared.failed.get() {
            Some(reason) => Err(RecordError::WriterFailed {
                reason: reason.clone(),
            }),
            None => Ok(self.shared.status()),
        }
    }
}

/// Makes `written` durable (one `fdatasync` of the ring), books it and completes whoever
/// waits.
fn sync_written(queue: &Queue, shared: &Shared, ring: &Ring, written: Vec<Written>) {
    let mut result = match shared.failed.get() {
        Some(reason) => Err(reason.clone()),
        None => Ok(()),
    };
    let started = Instant::now();
    #[cfg(test)]
    {
        let (slow, panic) = {
            let mut q = queue.lock();
            (
                q.slow_next_sync.take(),
                std::mem::take(&mut q.panic_next_sync),
            )
        };
        if let Some(by) = slow {
            std::thread::sleep(by);
        }
        assert!(!panic, "the test made this sync panic");
    }
    if result.is_ok()
        && !written.is_empty()
        && let Err(e) = ring.sync()
    {
        result = Err(e.to_string());
    }
    {
        let mut q = queue.lock();
        // A failure is recorded before the next sync may start, so that it refuses.
        if let Err(reason) = &result
            && shared.failed.get().is_none()
        {
            fail(shared, reason.clone());
        }
        q.syncing = false;
        if let (Ok(()), Some(last)) = (&result, written.last()) {
            let book = &mut q.book;
            book.first_seq = book
                .first_seq
                .or(written.first().map(|w| w.place.committed.seq));
            book.durable = Some(last.place.clone());
            book.anchor_dirty = true;
            book.last_sync = Some(Instant::now());
            book.last_waited = written.iter().filter(|w| w.reply.is_some()).count();
            book.last_took = started.elapsed();
            let (first_seq, path, head) = (
                book.first_seq,
                last.place.file_path.to_path_buf(),
                last.place.committed.clone(),
            );
            let n = written.len() as u64;
            // Updated under the queue's lock, so the status only ever moves forward.
            shared.update(|s| {
                s.first_seq = first_seq;
                s.last_seq = Some(head.seq);
                s.chain_head = head.hash;
                s.current_file = path;
                s.committed_since_open += n;
            });
        }
    }
    if let Err(reason) = result {
        for w in written {
            if let Some(reply) = w.reply {
                reply.send(Err(RecordError::WriterFailed {
                    reason: reason.clone(),
                }));
            }
        }
        return;
    }
    for w in written {
        if let Some(reply) = w.reply {
            reply.send(Ok(w.place.committed));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{RecordWriter, ring};
    use super::*;
    use crate::records::tests::sample_tool_call;

    /// With no sync thread at all, an appender that fills the ring checkpoints it itself
    /// (syncing the record file first), so a crash copy still replays every record.
    #[test]
    fn an_appender_checkpoints_a_full_ring_itself() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(record_file_name(1));
        let file = create_record_file(dir.path(), &path).unwrap();
        let (ring, cursor) = Ring::open(
            dir.path(),
            ring::MIN_RING_BYTES,
            &Checkpoint {
                file: file_name_of(&path),
                bytes: 0,
                lines: 0,
                seq: 0,
                hash: ChainHash::genesis(),
                ring_at: 0,
            },
        )
        .unwrap();
        let mut tail = Tail {
            dir: dir.path().to_path_buf(),
            rotate_bytes: 64 * 1024 * 1024,
            file: Arc::new(file),
            file_path: Arc::from(path.clone()),
            file_bytes: 0,
            file_lines: 0,
            chain: Chainer::genesis(),
            closed: false,
            reserved: 0,
            reserving: true,
            ring: Arc::new(ring),
            cursor,
            spare_line: Vec::new(),
            spare_entry: Vec::new(),
        };
        for _ in 0..100 {
            let prev = tail.chain.head_hash().clone();
            let sealed = tail.chain.seal(&mut sample_tool_call()).unwrap();
            tail.append(&sealed, &prev).unwrap();
        }
        // Nobody synced the ring: this only makes the test's crash copy deterministic.
        tail.ring.sync().unwrap();
        let (checkpoint, entries) = ring::read_back(dir.path()).unwrap().unwrap();
        assert!(
            checkpoint.seq > 50,
            "the appender checkpointed: {checkpoint:?}"
        );
        assert_eq!(checkpoint.seq + entries.len() as u64, 100);

        let crashed = tempfile::tempdir().unwrap();
        for name in [ring::RING_FILE, &checkpoint.file] {
            std::fs::copy(dir.path().join(name), crashed.path().join(name)).unwrap();
        }
        let copy = crashed.path().join(&checkpoint.file);
        let mut bytes = std::fs::read(&copy).unwrap();
        bytes.truncate(checkpoint.bytes as usize);
        std::fs::write(&copy, bytes).unwrap();
        let reopened = RecordWriter::open(crashed.path(), Default::default()).unwrap();
        assert_eq!(reopened.status().last_seq, Some(100));
        assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(&path).unwrap());
    }
}
