//! The on-disk layout of a record directory.
//!
//! ```text
//! records-00000000000000000001.jsonl   records 1 ..            (one JSON record per line)
//! records-00000000000000052817.jsonl   records 52817 ..        (after a size rotation)
//! records.head                         the head anchor: {seq, hash, file, line} of a
//!                                      durable record, replaced atomically
//! records-...jsonl.torn-<n>            bytes of a torn last line found at open, preserved
//! records.wal                          the write-ahead ring: where a record is first made
//!                                      durable (see the `ring` module)
//! records.lock                         locked by the one writer that has the directory open
//! records.opening                      locked by a writer until its ring is copied into the files
//! ```
//!
//! File names carry the sequence number of their first record, zero-padded to 20 digits, so
//! lexical order, numeric order and chain order agree.
//!
//! The head anchor exists because a hash chain alone cannot show that whole lines were cut
//! from the end, nor that the very last line was edited: nothing after them vouches for them.
//! The writer replaces the anchor after the first durable group, at most every
//! `head_interval` while records keep coming (and once more when they stop), and on close; an
//! anchor never names a record that is not durable, and verification compares the stream
//! against it. Lines cut or edited after the newest anchor cannot be told from a crash.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use super::chain::ChainHash;
use super::ring;
use crate::files::{FileError, write_atomic};

/// The prefix of every record file name.
pub const RECORD_FILE_PREFIX: &str = "records-";
/// The suffix of every record file name.
pub const RECORD_FILE_SUFFIX: &str = ".jsonl";
/// The head anchor's file name inside a record directory.
pub const HEAD_FILE: &str = "records.head";
/// The schema string of the head anchor.
pub const HEAD_SCHEMA: &str = "flowhost.records_head.v1";
/// The infix of the sidecar files that preserve torn last lines.
pub const TORN_INFIX: &str = ".torn-";

/// A problem reading a record directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The operating system refused an operation.
    #[error("cannot {op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The head anchor exists but cannot be used.
    #[error("head anchor {path} is unusable: {problem}")]
    BadHead {
        /// The anchor file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A file (the anchor, a torn-tail sidecar) could not be written.
    #[error(transparent)]
    Write(#[from] FileError),
    /// Records are durable in the directory's write-ahead ring but missing from its record
    /// files, and no writer has it open: reading the files alone would leave them out.
    #[error(
        "{dir}: records {first} to {last} are durable only in its write-ahead ring ({ring}): the \
         writer stopped before they reached the record files (it or the machine crashed) and nothing has \
         opened the directory for writing since, so reading the files alone would leave them \
         out; copy them in with `flowhost records replay {dir}` (starting the host on it, or \
         `flowhost state rebuild`, also does)",
        dir = dir.display(),
        ring = ring::RING_FILE
    )]
    Unreplayed {
        /// The record directory.
        dir: PathBuf,
        /// The first record missing from the files.
        first: u64,
        /// The last record in the ring.
        last: u64,
    },
    /// The last record file ends in bytes past its last durable record, and no writer has
    /// the directory open: a writer's next open cuts them, so a reader must not accept them.
    #[error(
        "{file}: ends in {bytes} bytes of whole lines past its last durable record (the \
         write-ahead ring's): a crash mid-write left them, never acknowledged, or something \
         other than the writer added them; the next writer to open {dir} moves them to a \
         sidecar, so they are not read as records; run `flowhost records replay {dir}` \
         first (starting the host on it also does)",
        file = file.display(),
        dir = dir.display()
    )]
    Uncommitted {
        /// The record directory.
        dir: PathBuf,
        /// The record file.
        file: PathBuf,
        /// How many bytes.
        bytes: u64,
    },
    /// The head anchor says a writer kept a write-ahead ring in the directory, and the ring
    /// is gone: the records durable only in it (those since its last checkpoint, after a
    /// machine crash) would be lost without a trace, so neither a writer nor a reader takes
    /// the record files for the whole stream.
    #[error(
        "{dir}: {ring} is missing, but {head} says a record writer kept it there: records made \
         durable only in it (after its last checkpoint, when the machine crashed) would be \
         lost without a trace; put it back (a copy of the directory must include it), or move \
         the directory aside once its record files are reviewed",
        dir = dir.display(),
        ring = ring::RING_FILE,
        head = HEAD_FILE
    )]
    RingMissing {
        /// The record directory.
        dir: PathBuf,
    },
    /// A writer has been opening the directory (copying its ring into the record files) for
    /// longer than a reader waits: the files are not yet the whole stream.
    #[error(
        "{dir}: a record writer has been opening this directory (copying its write-ahead ring into the record files) for over {waited:?}; try again once it has started",
        dir = dir.display()
    )]
    Opening {
        /// The record directory.
        dir: PathBuf,
        /// How long the reader waited.
        waited: std::time::Duration,
    },
    /// The directory's write-ahead ring cannot be read: records durable only there cannot
    /// be ruled out.
    #[error(transparent)]
    Ring(#[from] ring::RingError),
}

impl StoreError {
    /// Whether this says the records are not what was durably written (cut or changed below
    /// what the write-ahead ring's checkpoint vouches for, the ring itself damaged or gone
    /// where the head anchor says there was one, the anchor unreadable as one): the
    /// evidence is rejected, as when the chain's own checks find it cut, rather than an
    /// input that could not be read or a directory to replay first.
    pub fn rejects_the_evidence(&self) -> bool {
        matches!(
            self,
            StoreError::Ring(ring::RingError::Corrupt { .. })
                | StoreError::RingMissing { .. }
                | StoreError::BadHead { .. }
        )
    }

    pub(crate) fn io(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
        let path = path.to_path_buf();
        move |source| StoreError::Io { op, path, source }
    }
}

/// The file name of the record file whose first record is `first_seq`.
pub fn record_file_name(first_seq: u64) -> String {
    format!("{RECORD_FILE_PREFIX}{first_seq:020}{RECORD_FILE_SUFFIX}")
}

/// The first sequence number a record file name claims, if it is one.
pub fn parse_record_file_name(name: &str) -> Option<u64> {
    let digits = name
        .strip_prefix(RECORD_FILE_PREFIX)?
        .strip_suffix(RECORD_FILE_SUFFIX)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A record file in a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordFile {
    /// Its path.
    pub path: PathBuf,
    /// The first sequence number its name claims.
    pub first_seq: u64,
}

/// The file a writer holds locked (`flock`, exclusive) while it has the directory open.
pub const LOCK_FILE: &str = "records.lock";

/// The file a writer holds locked (`flock`, exclusive) from before it takes [`LOCK_FILE`]
/// until its ring has been copied into the record files, so that a reader finding the
/// directory held can wait for the files to be whole.
pub const OPENING_LOCK_FILE: &str = "records.opening";

/// How long a reader waits for a writer to finish opening a directory.
const OPENING_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// What came of waiting for a lock.
pub(crate) enum Locked {
    /// It is held, until this is dropped.
    Held(Flock<File>),
    /// Someone else held it for the whole wait.
    Busy,
    /// The lock file does not exist (and was not to be made).
    Absent,
}

/// Takes the `flock` on `path` (exclusive, or shared), trying every 10 ms for up to `wait`;
/// `create` makes the file when it is missing.
pub(crate) fn lock_within(
    path: &Path,
    exclusive: bool,
    create: bool,
    wait: std::time::Duration,
) -> Result<Locked, StoreError> {
    // The writer's lock is its own: anyone who could open it could hold it and pass for a
    // live writer, whose partial last line and unreplayed ring readers then let pass. It is
    // never reached through a link (one put in its place would make a root writer change
    // the mode of the file it names), and must be a regular file.
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let opened = if create {
        fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .and_then(|f| {
                if !f.metadata()?.is_file() {
                    return Err(io::Error::other("not a regular file"));
                }
                f.set_permissions(fs::Permissions::from_mode(0o600))?;
                Ok(f)
            })
    } else {
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
    };
    let mut file = match opened {
        Ok(f) => f,
        Err(e) if !create && e.kind() == io::ErrorKind::NotFound => return Ok(Locked::Absent),
        // A reader that may not open it cannot tell whether a writer holds it: it is read
        // as held by none, so every check of a stream at rest applies.
        Err(e) if !create && e.kind() == io::ErrorKind::PermissionDenied => {
            return Ok(Locked::Absent);
        }
        Err(e) => return Err(StoreError::io("open", path)(e)),
    };
    let arg = if exclusive {
        FlockArg::LockExclusiveNonblock
    } else {
        FlockArg::LockSharedNonblock
    };
    let deadline = std::time::Instant::now() + wait;
    loop {
        match Flock::lock(file, arg) {
            Ok(held) => return Ok(Locked::Held(held)),
            Err((f, nix::errno::Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                file = f;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Ok(Locked::Busy),
            Err((_, e)) => return Err(StoreError::io("lock", path)(io::Error::from(e))),
        }
    }
}

/// The record files of `dir`, in chain order, for a reader: refused while records that are
/// durable in the directory's write-ahead ring are missing from them and no writer has the
/// directory open to copy them in (after a machine crash, until the next open), and while
/// its ring cannot be read. Other files are ignored.
pub fn list_record_files(dir: &Path) -> Result<Vec<RecordFile>, StoreError> {
    Ok(list_record_files_and_checkpoint(dir)?.0)
}

/// [`list_record_files`], with the checkpoint of the directory's write-ahead ring when it
/// was read (no writer holds the directory, and it has a ring): the stream must still hold
/// the record it names, unchanged (see `chain::verify_records`).
pub fn list_record_files_and_checkpoint(
    dir: &Path,
) -> Result<(Vec<RecordFile>, Option<ring::Checkpoint>), StoreError> {
    let checkpoint = refuse_unreplayed(dir)?;
    Ok((record_files_on_disk(dir)?, checkpoint))
}

/// Whether a writer has `dir` open at this moment.
pub(crate) fn writer_holds(dir: &Path) -> Result<bool, StoreError> {
    Ok(matches!(
        lock_within(
            &dir.join(LOCK_FILE),
            false,
            false,
            std::time::Duration::ZERO
        )?,
        Locked::Busy
    ))
}

/// Fails if `dir` holds durable records only in its ring (see [`list_record_files`]);
/// returns the ring's checkpoint when it was read.
fn refuse_unreplayed(dir: &Path) -> Result<Option<ring::Checkpoint>, StoreError> {
    refuse_unreplayed_within(dir, OPENING_WAIT)
}

/// [`refuse_unreplayed`], waiting at most `opening_wait` for a writer that is opening `dir`.
pub(crate) fn refuse_unreplayed_within(
    dir: &Path,
    opening_wait: std::time::Duration,
) -> Result<Option<ring::Checkpoint>, StoreError> {
    // Held for the check, so that no writer opens (and replays) the directory meanwhile.
    let _shared = match lock_within(
        &dir.join(LOCK_FILE),
        false,
        false,
        std::time::Duration::ZERO,
    )? {
        Locked::Held(held) => held,
        // No writer ever opened it (or it was copied without the lock).
        Locked::Absent => return unreplayed_in(dir),
        // A writer has the directory open. Once it has copied its ring into the files (it
        // holds the opening lock until then), the files are the stream, still growing: an
        // entry it has just put in the ring reaches its file a moment later.
        Locked::Busy => {
            // Whatever the writer does, its ring is a regular file: anything else in its
            // place (a FIFO, a link) is no ring of its own, live or not.
            let ring = dir.join(ring::RING_FILE);
            if fs::symlink_metadata(&ring).is_ok_and(|m| !m.is_file()) {
                return Err(StoreError::Ring(ring::RingError::Corrupt {
                    path: ring,
                    problem: "it is not a regular file".into(),
                }));
            }
            return match lock_within(&dir.join(OPENING_LOCK_FILE), false, false, opening_wait)? {
                Locked::Held(_) | Locked::Absent => Ok(None),
                Locked::Busy => Err(StoreError::Opening {
                    dir: dir.to_path_buf(),
                    waited: opening_wait,
                }),
            };
        }
    };
    unreplayed_in(dir)
}

fn unreplayed_in(dir: &Path) -> Result<Option<ring::Checkpoint>, StoreError> {
    let files: Vec<PathBuf> = record_files_on_disk(dir)?
        .into_iter()
        .map(|f| f.path)
        .collect();
    let Some((checkpoint, unreplayed)) = ring::unreplayed_and_checkpoint(dir, &files)? else {
        refuse_lost_ring(dir)?;
        return Ok(None);
    };
    match unreplayed {
        None => Ok(Some(checkpoint)),
        Some(ring::Unreplayed::Missing { first, last }) => Err(StoreError::Unreplayed {
            dir: dir.to_path_buf(),
            first,
            last,
        }),
        Some(ring::Unreplayed::Uncommitted { file, bytes }) => Err(StoreError::Uncommitted {
            dir: dir.to_path_buf(),
            file,
            bytes,
        }),
    }
}

/// For a directory without a write-ahead ring: fails if its head anchor says a writer kept
/// one there (see [`StoreError::RingMissing`]). A directory from before the ring, or one no
/// writer has anchored, has nothing to miss.
pub(crate) fn refuse_lost_ring(dir: &Path) -> Result<(), StoreError> {
    match HeadAnchor::read(&dir.join(HEAD_FILE))? {
        Some(anchor) if anchor.ring => Err(StoreError::RingMissing {
            dir: dir.to_path_buf(),
        }),
        _ => Ok(()),
    }
}

/// Opens the record file at `path` for reading, as the file the listing saw: a symbolic link,
/// FIFO or device put in its place since then is refused, never followed or waited on.
pub(crate) fn open_record_file(path: &Path) -> Result<File, StoreError> {
    open_record_file_io(path).map_err(StoreError::io("open", path))
}

/// [`open_record_file`], for readers that report plain I/O errors.
pub(crate) fn open_record_file_io(path: &Path) -> io::Result<File> {
    open_record_file_as(path, fs::OpenOptions::new().read(true))
}

/// Opens the record file at `path` with `options` (to read, write or append), refused as
/// [`open_record_file`] refuses: the writer's replay, repair and append open the file the
/// listing saw, never a link, FIFO or device put in its place.
pub(crate) fn open_record_file_as(path: &Path, options: &mut fs::OpenOptions) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => io::Error::other("a record file that is a symbolic link"),
            _ => e,
        })?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::other("a record file that is not a regular file"));
    }
    Ok(file)
}

/// The whole of the record file at `path`, read as [`open_record_file`] opens it.
pub(crate) fn read_record_file(path: &Path) -> Result<Vec<u8>, StoreError> {
    use std::io::Read;
    let mut file = open_record_file(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(StoreError::io("read", path))?;
    Ok(bytes)
}

/// The record files of `dir`, in chain order, as they are on disk (the writer's view: it
/// replays the ring into them itself). Other files are ignored.
pub(crate) fn record_files_on_disk(dir: &Path) -> Result<Vec<RecordFile>, StoreError> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(StoreError::io("list", dir))? {
        let entry = entry.map_err(StoreError::io("list", dir))?;
        let name = entry.file_name();
        if let Some(first_seq) = name.to_str().and_then(parse_record_file_name) {
            // A link or anything but a regular file in a record's place is no record file:
            // read or truncated through, it would be another file.
            let kind = entry.file_type().map_err(StoreError::io("list", dir))?;
            if !kind.is_file() {
                return Err(StoreError::io("read", &entry.path())(io::Error::other(
                    "a record file that is not a regular file (a symbolic link?)",
                )));
            }
            files.push(RecordFile {
                path: entry.path(),
                first_seq,
            });
        }
    }
    files.sort_by_key(|f| f.first_seq);
    Ok(files)
}

/// The torn-tail sidecar files of `dir` (sorted by name).
pub fn list_torn_sidecars(dir: &Path) -> Result<Vec<PathBuf>, StoreError> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(StoreError::io("list", dir))? {
        let entry = entry.map_err(StoreError::io("list", dir))?;
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(RECORD_FILE_PREFIX) && n.contains(TORN_INFIX))
        {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}

/// The record files named by `path`: every record file of a directory, or the file itself.
/// A record file beside a write-ahead ring is refused as its directory would be (see
/// [`list_record_files`]): it may be the file the ring's records are missing from.
pub fn record_sources(path: &Path) -> Result<Vec<PathBuf>, StoreError> {
    Ok(record_sources_and_checkpoint(path)?.0)
}

/// [`record_sources`], with the checkpoint of the write-ahead ring of the directory read
/// (or of the record file's directory) when it was read.
pub fn record_sources_and_checkpoint(
    path: &Path,
) -> Result<(Vec<PathBuf>, Option<ring::Checkpoint>), StoreError> {
    let meta = fs::metadata(path).map_err(StoreError::io("open", path))?;
    if meta.is_dir() {
        let (files, checkpoint) = list_record_files_and_checkpoint(path)?;
        return Ok((files.into_iter().map(|f| f.path).collect(), checkpoint));
    }
    let is_record_file = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_record_file_name)
        .is_some();
    if let Some(dir) = path.parent().filter(|_| is_record_file) {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let checkpoint = refuse_unreplayed(dir)?;
        return Ok((vec![path.to_path_buf()], checkpoint));
    }
    Ok((vec![path.to_path_buf()], None))
}

/// Splits file content into its complete lines (without their newline) and the bytes after
/// the last newline (a torn line, if non-empty).
pub fn split_lines(bytes: &[u8]) -> (impl Iterator<Item = &[u8]>, &[u8]) {
    // memchr, since every reader of the records splits whole files: a byte at a time, the
    // split took about a third of a flow-state check's time.
    let end = memchr::memrchr(b'\n', bytes).map_or(0, |i| i + 1);
    let (complete, torn) = bytes.split_at(end);
    let mut from = 0;
    let lines = memchr::memchr_iter(b'\n', complete).map(move |newline| {
        let line = &complete[from..newline];
        from = newline + 1;
        line
    });
    (lines, torn)
}

/// Largest head anchor file read (one is a few hundred bytes).
const MAX_HEAD_BYTES: u64 = 64 * 1024;

/// The head anchor: a durable record the stream must still contain, unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeadAnchor {
    /// Always [`HEAD_SCHEMA`].
    pub schema: String,
    /// The sequence number of the anchored record (0: no record yet).
    pub seq: u64,
    /// The hash of its line (the genesis hash for seq 0).
    pub hash: String,
    /// The record file holding it (file name only), if any.
    pub file: Option<String>,
    /// Its 1-based line number in that file, if any.
    pub line: Option<u64>,
    /// When the anchor was written (RFC 3339, UTC).
    pub written_at: String,
    /// The directory had a write-ahead ring when the anchor was written (every writer makes
    /// one as it opens a directory; an anchor from before the ring existed lacks this). A
    /// directory whose anchor says so and whose ring is gone is refused (see
    /// [`StoreError::RingMissing`]).
    #[serde(default)]
    pub ring: bool,
}

impl HeadAnchor {
    /// Reads the anchor at `path`; `Ok(None)` when there is none. A symbolic link, FIFO,
    /// directory or device in its place, or a file larger than any anchor, is a broken
    /// anchor, never followed, waited on or read whole.
    pub fn read(path: &Path) -> Result<Option<HeadAnchor>, StoreError> {
        use std::os::unix::fs::OpenOptionsExt;
        let bad = |problem: String| StoreError::BadHead {
            path: path.to_path_buf(),
            problem,
        };
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path);
        let file = match file {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(bad("it is a symbolic link".into()));
            }
            Err(e) => return Err(StoreError::io("read", path)(e)),
        };
        let meta = file.metadata().map_err(StoreError::io("read", path))?;
        if !meta.is_file() {
            return Err(bad("it is not a regular file".into()));
        }
        if meta.len() > MAX_HEAD_BYTES {
            return Err(bad(format!(
                "{} bytes; an anchor is at most {MAX_HEAD_BYTES}",
                meta.len()
            )));
        }
        Self::parse(path, file).map(Some)
    }

    /// Reads the anchor an operator named (`--head`): a copy kept elsewhere, reached by a
    /// symbolic link or through a pipe (`--head <(ssh host cat records.head)`) as the
    /// operator chose, read up to [`MAX_HEAD_BYTES`]. One that cannot be opened is an input
    /// error naming it, not evidence that fails to verify.
    pub fn read_named(path: &Path) -> Result<HeadAnchor, StoreError> {
        let file = fs::File::open(path).map_err(StoreError::io("read", path))?;
        Self::parse(path, file)
    }

    /// The anchor in `file` (opened from `path`): at most [`MAX_HEAD_BYTES`], strictly
    /// decoded.
    fn parse(path: &Path, file: File) -> Result<HeadAnchor, StoreError> {
        use std::io::Read;
        let bad = |problem: String| StoreError::BadHead {
            path: path.to_path_buf(),
            problem,
        };
        let mut bytes = Vec::new();
        file.take(MAX_HEAD_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(StoreError::io("read", path))?;
        if bytes.len() as u64 > MAX_HEAD_BYTES {
            return Err(bad(format!(
                "more than {MAX_HEAD_BYTES} bytes; an anchor is a few hundred"
            )));
        }
        let head: HeadAnchor = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        if head.schema != HEAD_SCHEMA {
            return Err(bad(format!("schema must be {HEAD_SCHEMA:?}")));
        }
        if ChainHash::parse(&head.hash).is_none() {
            return Err(bad("hash must be \"sha256:\" and 64 lowercase hex".into()));
        }
        Ok(head)
    }

    /// Replaces the anchor at `path` atomically and durably.
    pub fn write(&self, path: &Path) -> Result<(), StoreError> {
        let mut bytes = serde_json::to_vec_pretty(self).map_err(|e| StoreError::BadHead {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?;
        bytes.push(b'\n');
        write_atomic(path, &bytes, 0o644)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_round_trip_and_sort_in_chain_order() {
        assert_eq!(record_file_name(1), "records-00000000000000000001.jsonl");
        assert_eq!(
            parse_record_file_name(&record_file_name(52817)),
            Some(52817)
        );
        assert_eq!(parse_record_file_name("records-1.jsonl"), None);
        assert_eq!(
            parse_record_file_name("records-0000000000000000000x.jsonl"),
            None
        );
        assert!(record_file_name(9) < record_file_name(10));
    }

    #[test]
    fn a_record_file_is_read_as_itself_never_through_what_replaced_it() {
        // What a listing saw can be swapped before the read: a link to a file the reader
        // may read and the directory's owner may not, or a FIFO that would hang the reader.
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        fs::write(&secret, b"not a record\n").unwrap();
        let link = dir.path().join(record_file_name(1));
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let err = read_record_file(&link).unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");

        let fifo = dir.path().join(record_file_name(2));
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let err = open_record_file(&fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");

        // The writer's own opens (append, repair, replay) are refused the same way.
        let err = open_record_file_as(&link, fs::OpenOptions::new().append(true)).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        let err =
            open_record_file_as(&fifo, fs::OpenOptions::new().read(true).write(true)).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        assert_eq!(fs::read(&secret).unwrap(), b"not a record\n");

        let file = dir.path().join(record_file_name(3));
        fs::write(&file, b"{}\n").unwrap();
        assert_eq!(read_record_file(&file).unwrap(), b"{}\n");
        open_record_file_as(&file, fs::OpenOptions::new().append(true)).unwrap();
    }

    #[test]
    fn split_lines_separates_a_torn_tail() {
        let (lines, torn) = split_lines(b"a\nbb\nccc");
        assert_eq!(lines.collect::<Vec<_>>(), vec![&b"a"[..], &b"bb"[..]]);
        assert_eq!(torn, b"ccc");
        let (lines, torn) = split_lines(b"a\n\n");
        assert_eq!(lines.collect::<Vec<_>>(), vec![&b"a"[..], &b""[..]]);
        assert!(torn.is_empty());
        let (lines, torn) = split_lines(b"");
        assert_eq!(lines.count(), 0);
        assert!(torn.is_empty());
    }
}
