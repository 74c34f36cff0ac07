//! The writer's two threads: the *writer* seals and appends groups, the *syncer* makes them
//! durable and completes them. Splitting them lets the next group be written while the
//! previous sync runs, so one `fdatasync` covers every group written before it started.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use super::{
    CloseReply, CommitReply, Committed, FlushReply, Msg, RecordError, Reply, Shared, WriterOptions,
    WriterStatus, create_record_file,
};
use crate::records::DecisionRecord;
use crate::records::chain::Chainer;
use crate::records::now_rfc3339;
use crate::records::store::{HEAD_FILE, HEAD_SCHEMA, HeadAnchor, record_file_name};

/// What the writer thread starts from.
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
}

/// Starts both threads; `rx` receives the handles' messages.
pub(super) fn start(s: Start, rx: Receiver<Msg>) -> Result<(), RecordError> {
    let (to_syncer, from_writer) = mpsc::channel();
    let file = Arc::new(s.file);
    let syncer = Syncer {
        dir: s.dir.clone(),
        head_interval: s.options.head_interval,
        shared: s.shared.clone(),
        first_seq: s.first_seq,
        durable: None,
        anchor_dirty: true,
        last_anchor: None,
    };
    let writer = Writer {
        dir: s.dir,
        options: s.options,
        file,
        file_path: s.file_path,
        file_bytes: s.file_bytes,
        file_lines: s.file_lines,
        chain: s.chain,
        shared: s.shared,
        to_syncer,
    };
    std::thread::Builder::new()
        .name("flowhost-rec-sync".into())
        .spawn(move || syncer.run(from_writer))
        .map_err(RecordError::Spawn)?;
    std::thread::Builder::new()
        .name("flowhost-records".into())
        .spawn(move || writer.run(rx))
        .map_err(RecordError::Spawn)?;
    Ok(())
}

/// Records appended to one file, waiting for their sync.
struct Group {
    file: Arc<File>,
    file_path: PathBuf,
    /// The file's line count once this group is in it (for the anchor).
    file_lines: u64,
    /// Each record and who waits for it to be durable (none for records answered once
    /// written).
    done: Vec<(Option<CommitReply>, Committed)>,
}

enum ToSyncer {
    Group(Group),
    Flush(FlushReply),
    Close(CloseReply),
}

struct Writer {
    dir: PathBuf,
    options: WriterOptions,
    file: Arc<File>,
    file_path: PathBuf,
    file_bytes: u64,
    file_lines: u64,
    chain: Chainer,
    shared: Arc<Shared>,
    to_syncer: Sender<ToSyncer>,
}

impl Writer {
    fn run(mut self, rx: Receiver<Msg>) {
        let mut batch = Vec::new();
        // Ends when every handle is gone (the syncer then sees its channel close) or on Close.
        while let Ok(first) = rx.recv() {
            batch.push(first);
            while batch.len() < self.options.max_group {
                match rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            let mut commits = Vec::with_capacity(batch.len());
            let mut close = None;
            let mut flushes = Vec::new();
            for msg in batch.drain(..) {
                match msg {
                    Msg::Commit(r, reply) if close.is_none() => commits.push((r, reply)),
                    Msg::Flush(reply) if close.is_none() => flushes.push(reply),
                    Msg::Commit(_, reply) => reply.send(Err(RecordError::Closed)),
                    Msg::Flush(reply) => reply.send(Err(RecordError::Closed)),
                    Msg::Close(reply) if close.is_none() => close = Some(reply),
                    Msg::Close(reply) => reply.send(Err(RecordError::Closed)),
                }
            }
            self.group(commits);
            // After the batch's groups: a flush covers at least everything queued before it.
            for reply in flushes {
                self.hand_over(ToSyncer::Flush(reply));
            }
            if let Some(reply) = close {
                self.hand_over(ToSyncer::Close(reply));
                // Anything still queued arrived after close.
                while let Ok(msg) = rx.try_recv() {
                    match msg {
                        Msg::Commit(_, reply) => reply.send(Err(RecordError::Closed)),
                        Msg::Flush(reply) => reply.send(Err(RecordError::Closed)),
                        Msg::Close(reply) => reply.send(Err(RecordError::Closed)),
                    }
                }
                return;
            }
        }
    }

    /// Seals and appends one batch, handing the written groups to the syncer.
    fn group(&mut self, commits: Vec<(Box<DecisionRecord>, CommitReply)>) {
        if commits.is_empty() {
            return;
        }
        if let Some(reason) = self.shared.failed.get() {
            let reason = reason.clone();
            for (_, reply) in commits {
                reply.send(Err(RecordError::WriterFailed {
                    reason: reason.clone(),
                }));
            }
            return;
        }
        let mut buf: Vec<u8> = Vec::with_capacity(commits.len() * 1024);
        let mut done: Vec<(CommitReply, Committed)> = Vec::with_capacity(commits.len());
        let mut pending = commits.into_iter();
        let mut failure = None;
        for (mut record, reply) in pending.by_ref() {
            let sealed = match self.chain.seal(&mut record) {
                Ok(s) => s,
                Err(e) => {
                    reply.send(Err(RecordError::Invalid(e)));
                    continue;
                }
            };
            let used = self.file_bytes + buf.len() as u64;
            if used > 0 && used + sealed.line.len() as u64 > self.options.rotate_bytes {
                let written = self
                    .append(&mut buf)
                    .map(|()| self.hand_over_group(std::mem::take(&mut done)))
                    .and_then(|()| self.rotate(sealed.seq));
                if let Err(reason) = written {
                    done.push((reply, committed(&sealed)));
                    failure = Some(reason);
                    break;
                }
            }
            buf.extend_from_slice(&sealed.line);
            self.file_lines += 1;
            done.push((reply, committed(&sealed)));
        }
        if failure.is_none() {
            match self.append(&mut buf) {
                Ok(()) => self.hand_over_group(std::mem::take(&mut done)),
                Err(reason) => failure = Some(reason),
            }
        }
        if let Some(reason) = failure {
            fail(&self.shared, reason.clone());
            let fail_reply = || RecordError::WriterFailed {
                reason: reason.clone(),
            };
            for (reply, _) in done {
                reply.send(Err(fail_reply()));
            }
            for (_, reply) in pending {
                reply.send(Err(fail_reply()));
            }
        }
    }

    fn append(&mut self, buf: &mut Vec<u8>) -> Result<(), String> {
        if buf.is_empty() {
            return Ok(());
        }
        (&*self.file)
            .write_all(buf)
            .map_err(|e| format!("cannot append to {}: {e}", self.file_path.display()))?;
        self.file_bytes += buf.len() as u64;
        buf.clear();
        Ok(())
    }

    fn hand_over_group(&self, done: Vec<(CommitReply, Committed)>) {
        if done.is_empty() {
            return;
        }
        // Records whose callers wait only for the write are answered now; the sync of their
        // group still follows, and a failure there fails the writer for every later commit.
        let done = done
            .into_iter()
            .map(|(reply, c)| match reply {
                Reply::Written(tx) => {
                    let _ = tx.send(Ok(c.clone()));
                    (None, c)
                }
                other => (Some(other), c),
            })
            .collect();
        self.hand_over(ToSyncer::Group(Group {
            file: self.file.clone(),
            file_path: self.file_path.clone(),
            file_lines: self.file_lines,
            done,
        }));
    }

    fn hand_over(&self, msg: ToSyncer) {
        // The syncer outlives the writer (it ends only when this channel closes), so a send
        // cannot fail; if it somehow did, the dropped replies answer their callers with an
        // error, never with success.
        let _ = self.to_syncer.send(msg);
    }

    fn rotate(&mut self, next_seq: u64) -> Result<(), String> {
        let path = self.dir.join(record_file_name(next_seq));
        let file = create_record_file(&self.dir, &path).map_err(|e| format!("rotation: {e}"))?;
        self.file = Arc::new(file);
        self.file_path = path;
        self.file_bytes = 0;
        self.file_lines = 0;
        Ok(())
    }
}

fn committed(sealed: &crate::records::chain::Sealed) -> Committed {
    Committed {
        seq: sealed.seq,
        hash: sealed.hash.clone(),
    }
}

fn fail(shared: &Shared, reason: String) {
    tracing::error!(%reason, "record writer failed; refusing every further record (fail closed)");
    let _ = shared.failed.set(reason.clone());
    shared.update(|s| {
        s.failed.get_or_insert(reason);
    });
}

/// Where the last durable record is, for the anchor (its seq and hash are in the status).
struct Durable {
    file_path: PathBuf,
    file_lines: u64,
}

/// The longest a written record waits for a sync that someone waits on before it is synced
/// on its own.
const LAZY_SYNC: Duration = Duration::from_millis(5);

impl ToSyncer {
    /// A group whose records were all answered once written.
    fn nobody_waits(&self) -> bool {
        matches!(self, ToSyncer::Group(g) if g.done.iter().all(|(r, _)| r.is_none()))
    }
}

struct Syncer {
    dir: PathBuf,
    head_interval: Duration,
    shared: Arc<Shared>,
    first_seq: Option<u64>,
    durable: Option<Durable>,
    anchor_dirty: bool,
    last_anchor: Option<Instant>,
}

impl Syncer {
    fn run(mut self, rx: Receiver<ToSyncer>) {
        let mut msgs = Vec::new();
        loop {
            let first = if self.anchor_dirty && self.shared.failed.get().is_none() {
                let wait = self
                    .last_anchor
                    .map_or(Duration::ZERO, |t| {
                        (t + self.head_interval).saturating_duration_since(Instant::now())
                    })
                    .max(Duration::from_millis(1));
                match rx.recv_timeout(wait) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => {
                        self.refresh_anchor();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        // Every handle is gone: nobody awaits the result, and a failure is
                        // already recorded in the shared status.
                        let _ = self.finish();
                        return;
                    }
                }
            } else {
                match rx.recv() {
                    Ok(m) => m,
                    Err(_) => {
                        let _ = self.finish();
                        return;
                    }
                }
            };
            msgs.push(first);
            while let Ok(m) = rx.try_recv() {
                msgs.push(m);
            }
            // Groups nobody waits on (records answered once written) ride on the next sync
            // someone does wait for, which usually follows within a call's time: one
            // fdatasync then covers both. Left alone, they are synced after LAZY_SYNC.
            let deadline = Instant::now() + LAZY_SYNC;
            while msgs.iter().all(ToSyncer::nobody_waits) {
                match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(m) => msgs.push(m),
                    Err(_) => break,
                }
            }
            let mut groups = Vec::with_capacity(msgs.len());
            let mut close = None;
            let mut flushes = Vec::new();
            for m in msgs.drain(..) {
                match m {
                    ToSyncer::Group(g) => groups.push(g),
                    ToSyncer::Flush(reply) => flushes.push(reply),
                    // The writer sends nothing after Close.
                    ToSyncer::Close(reply) => close = Some(reply),
                }
            }
            self.sync(groups);
            for reply in flushes {
                reply.send(match self.shared.failed.get() {
                    Some(reason) => Err(RecordError::WriterFailed {
                        reason: reason.clone(),
                    }),
                    None => Ok(()),
                });
            }
            if let Some(reply) = close {
                reply.send(self.finish());
                return;
            }
            let due = self
                .last_anchor
                .is_none_or(|t| t.elapsed() >= self.head_interval);
            if self.anchor_dirty && due {
                self.refresh_anchor();
            }
        }
    }

    /// One sync per distinct file for every group written so far, then completion.
    fn sync(&mut self, groups: Vec<Group>) {
        let Some(last_group) = groups.last() else {
            return;
        };
        let mut result = match self.shared.failed.get() {
            Some(reason) => Err(reason.clone()),
            None => Ok(()),
        };
        if result.is_ok() {
            let mut synced: Vec<&Arc<File>> = Vec::new();
            for g in &groups {
                if synced.iter().any(|f| Arc::ptr_eq(f, &g.file)) {
                    continue;
                }
                if let Err(e) = g.file.sync_data() {
                    result = Err(format!("cannot fdatasync {}: {e}", g.file_path.display()));
                    break;
                }
                synced.push(&g.file);
            }
        }
        if let Err(reason) = result {
            if self.shared.failed.get().is_none() {
                fail(&self.shared, reason.clone());
            }
            for g in groups {
                for (reply, _) in g.done {
                    if let Some(reply) = reply {
                        reply.send(Err(RecordError::WriterFailed {
                            reason: reason.clone(),
                        }));
                    }
                }
            }
            return;
        }
        let last = last_group.done.last().map(|(_, c)| c.clone());
        let first = groups
            .first()
            .and_then(|g| g.done.first())
            .map(|(_, c)| c.seq);
        if let Some(last) = last {
            self.first_seq = self.first_seq.or(first);
            self.durable = Some(Durable {
                file_path: last_group.file_path.clone(),
                file_lines: last_group.file_lines,
            });
            self.anchor_dirty = true;
            let (first_seq, path) = (self.first_seq, last_group.file_path.clone());
            let n: u64 = groups.iter().map(|g| g.done.len() as u64).sum();
            self.shared.update(|s| {
                s.first_seq = first_seq;
                s.last_seq = Some(last.seq);
                s.chain_head = last.hash.clone();
                s.current_file = path;
                s.committed_since_open += n;
            });
        }
        for g in groups {
            for (reply, c) in g.done {
                if let Some(reply) = reply {
                    reply.send(Ok(c));
                }
            }
        }
    }

    fn write_anchor(&mut self) -> Result<(), String> {
        let status = self.shared.status();
        let anchor = HeadAnchor {
            schema: HEAD_SCHEMA.to_string(),
            seq: status.last_seq.unwrap_or(0),
            hash: status.chain_head.as_str().to_string(),
            file: self.durable.as_ref().and_then(|d| {
                d.file_path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
            }),
            line: self.durable.as_ref().map(|d| d.file_lines),
            written_at: now_rfc3339(),
        };
        anchor
            .write(&self.dir.join(HEAD_FILE))
            .map_err(|e| format!("head anchor: {e}"))?;
        self.anchor_dirty = false;
        self.last_anchor = Some(Instant::now());
        Ok(())
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
