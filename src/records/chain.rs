//! The hash chain over record lines, and its verification.
//!
//! This file is long on purpose: the chain and its verifier (parallel, bounded memory, every
//! problem with file and line) are one concept, the definition of an intact record stream.
//!
//! Record `n` carries `seq = n` and `prev_hash` = `sha256:` + hex(SHA-256(line bytes of record
//! `n-1`, without the newline)); record 1 carries [`GENESIS_HASH`]. The chain runs across
//! rotated files. Deleting a line shows as a sequence gap; editing a line breaks the next
//! record's `prev_hash`; editing the last line, or cutting whole lines off the end, shows
//! against the head anchor ([`super::store::HeadAnchor`]); a torn last line shows as a line
//! without its newline.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::ring::Checkpoint;
use super::store::{
    HEAD_FILE, HeadAnchor, StoreError, list_record_files_and_checkpoint, list_torn_sidecars,
    parse_record_file_name,
};
use super::{DecisionRecord, RecordFormatError};

/// The `prev_hash` of the first record.
pub const GENESIS_HASH: &str =
    "sha256:0000000000000000000000000000000000000000000000000000000000000000";

/// A line hash: `sha256:` and 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct ChainHash(String);

impl ChainHash {
    /// Checks the form of `s`.
    pub fn parse(s: &str) -> Option<ChainHash> {
        let hex = s.strip_prefix("sha256:")?;
        (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| ChainHash(s.to_string()))
    }

    /// The genesis hash.
    pub fn genesis() -> ChainHash {
        ChainHash(GENESIS_HASH.to_string())
    }

    /// The text form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ChainHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The hash of one record line (its bytes without the newline).
pub fn line_hash(line: &[u8]) -> ChainHash {
    hash_of_digest(&Sha256::digest(line).into())
}

fn hash_of_digest(digest: &[u8; 32]) -> ChainHash {
    ChainHash(sha256_text(digest))
}

/// `sha256:` and the 64 lowercase hex digits of `digest`, in one allocation (every record
/// line, target hash and chain link is written so).
pub(crate) fn sha256_text(digest: &[u8; 32]) -> String {
    let mut hex = [0u8; 64];
    // Cannot fail: the output is exactly twice the input's length.
    let _ = hex::encode_to_slice(digest, &mut hex);
    let mut text = String::with_capacity(7 + 64);
    text.push_str("sha256:");
    // Hex digits are ASCII.
    text.extend(hex.iter().map(|&b| char::from(b)));
    text
}

/// A record sealed into the chain: its line and its place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    /// The JSON line, newline included.
    pub line: Vec<u8>,
    /// Its sequence number.
    pub seq: u64,
    /// The hash of the line (what the next record's `prev_hash` will be).
    pub hash: ChainHash,
    /// The same SHA-256 as bytes.
    pub digest: [u8; 32],
}

/// The chain's head: the next sequence number and the hash the next record must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chainer {
    next_seq: u64,
    prev_hash: ChainHash,
}

impl Chainer {
    /// An empty chain: the next record is seq 1 with the genesis hash.
    pub fn genesis() -> Self {
        Chainer {
            next_seq: 1,
            prev_hash: ChainHash::genesis(),
        }
    }

    /// A chain whose last record is `last_seq` with line hash `last_hash`; `None` when no
    /// sequence number is left after `last_seq`.
    pub fn resume(last_seq: u64, last_hash: ChainHash) -> Option<Self> {
        Some(Chainer {
            next_seq: last_seq.checked_add(1)?,
            prev_hash: last_hash,
        })
    }

    /// The sequence number the next record gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The hash of the last sealed record (genesis if none).
    pub fn head_hash(&self) -> &ChainHash {
        &self.prev_hash
    }

    /// Assigns the record its `seq` and `prev_hash`, validates it, serialises it as one line
    /// and advances the chain. On error the chain is unchanged.
    pub fn seal(&mut self, record: &mut DecisionRecord) -> Result<Sealed, RecordFormatError> {
        self.seal_into(record, Vec::new())
    }

    /// [`Chainer::seal`], writing the line into `line` (emptied first): a writer hands the
    /// same buffer back record after record instead of allocating one each time.
    pub fn seal_into(
        &mut self,
        record: &mut DecisionRecord,
        mut line: Vec<u8>,
    ) -> Result<Sealed, RecordFormatError> {
        line.clear();
        line.reserve(LINE_CAPACITY);
        // The last sequence number is never used: the chain could not go on after it.
        let next_seq = self
            .next_seq
            .checked_add(1)
            .ok_or_else(|| RecordFormatError {
                field: "flowhost.seq".into(),
                problem: format!(
                    "the chain has used every sequence number up to {}",
                    self.next_seq
                ),
            })?;
        record.flowhost.seq = self.next_seq;
        record.flowhost.prev_hash = self.prev_hash.as_str().to_string();
        record.validate()?;
        serde_json::to_writer(&mut line, record).map_err(|e| RecordFormatError {
            field: "(record)".into(),
            problem: format!("cannot serialise: {e}"),
        })?;
        let digest: [u8; 32] = Sha256::digest(&line).into();
        let hash = hash_of_digest(&digest);
        line.push(b'\n');
        let sealed = Sealed {
            line,
            seq: self.next_seq,
            hash: hash.clone(),
            digest,
        };
        self.next_seq = next_seq;
        self.prev_hash = hash;
        Ok(sealed)
    }
}

/// Room a line buffer has before a record is serialised into it: a tool call's records are
/// 1-2 KB, so serialising one does not grow it again and again (a no-op for a buffer that
/// already held a record).
const LINE_CAPACITY: usize = 2048;

/// Where a problem is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Location {
    /// The record file (or exported envelope).
    pub file: PathBuf,
    /// The 1-based line number, when the problem is on a line.
    pub line: Option<u64>,
    /// The index in an envelope's `observed_tool_decisions`, when the problem is there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u64>,
}

impl Location {
    fn in_file(file: &Path, line: Option<u64>) -> Self {
        Location {
            file: file.to_path_buf(),
            line,
            index: None,
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
        }
        if let Some(i) = self.index {
            write!(f, " observed_tool_decisions[{i}]")?;
        }
        Ok(())
    }
}

/// What is wrong with a record stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ProblemKind {
    /// The line is not a valid record.
    Malformed {
        /// Why.
        error: String,
    },
    /// Records `expected ..= found - 1` are missing (deleted lines or a deleted file).
    Gap {
        /// The sequence number that should have come.
        expected: u64,
        /// The one that came.
        found: u64,
    },
    /// The sequence number went backwards or repeated (reordered or duplicated lines).
    OutOfOrder {
        /// The sequence number that should have come.
        expected: u64,
        /// The one that came.
        found: u64,
    },
    /// This line was changed after it was written: its hash is not the one the chain (the
    /// next record's `prev_hash`, or the head anchor) vouches for.
    Edited {
        /// The edited record's sequence number.
        seq: u64,
        /// What vouches for the original (`next record` or `head anchor`).
        witness: &'static str,
    },
    /// The first record does not start the chain (its `prev_hash` is not the genesis hash).
    BadGenesis,
    /// The stream does not start at seq 1 (earlier records are missing).
    StartsLate {
        /// The first sequence number present.
        first: u64,
    },
    /// The file ends in a line without its newline (a crash mid-write, or a cut file).
    TornLine {
        /// How many bytes the torn line has.
        bytes: usize,
    },
    /// Whole lines are missing at the end: the head anchor names a later record.
    MissingVersusHead {
        /// The anchored sequence number.
        head_seq: u64,
        /// The last sequence number present (0: none).
        last_seq: u64,
    },
    /// Whole lines are missing at the end: the write-ahead ring's checkpoint says a later
    /// record was made durable (it is later than the head anchor, or there is none).
    MissingVersusCheckpoint {
        /// The sequence number the checkpoint names.
        checkpoint_seq: u64,
        /// The last sequence number present (0: none).
        last_seq: u64,
    },
    /// Whole lines are missing at the end of a record file read alone: the record file
    /// after it in its directory starts later than one past this file's last record.
    MissingVersusNextFile {
        /// The first sequence number of the next record file.
        next_seq: u64,
        /// The last sequence number present (0: none).
        last_seq: u64,
    },
    /// A record file read alone goes on past the record the next record file in its
    /// directory follows: records were added after the stream moved on.
    PastNextFile {
        /// The first sequence number of the next record file.
        next_seq: u64,
        /// The last sequence number present.
        last_seq: u64,
    },
    /// The file name claims a different first record than the file holds.
    FileNameMismatch {
        /// The first seq the name claims.
        named: u64,
        /// The first seq the file holds.
        found: u64,
    },
}

impl fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProblemKind::Malformed { error } => write!(f, "malformed record: {error}"),
            ProblemKind::Gap { expected, found } if found - expected == 1 => write!(
                f,
                "gap: record {expected} is missing (a deleted line), found {found}"
            ),
            ProblemKind::Gap { expected, found } => write!(
                f,
                "gap: records {expected}..={} are missing (deleted lines or a deleted file), found {found}",
                found - 1
            ),
            ProblemKind::OutOfOrder { expected, found } => write!(
                f,
                "out of order: expected record {expected}, found {found} (reordered or duplicated lines)"
            ),
            ProblemKind::Edited { seq, witness } => write!(
                f,
                "edited: record {seq} does not hash to what the {witness} vouches for"
            ),
            ProblemKind::BadGenesis => {
                write!(f, "record 1 does not carry the genesis prev_hash")
            }
            ProblemKind::StartsLate { first } => write!(
                f,
                "the stream starts at record {first}: records 1..={} are missing",
                first - 1
            ),
            ProblemKind::TornLine { bytes } => write!(
                f,
                "truncated: the last line ({bytes} bytes) has no newline (torn write or cut file)"
            ),
            ProblemKind::MissingVersusHead { head_seq, last_seq } => write!(
                f,
                "truncated: the head anchor names record {head_seq} but the stream ends at {last_seq} ({} whole lines missing)",
                head_seq - last_seq
            ),
            ProblemKind::MissingVersusNextFile { next_seq, last_seq } => write!(
                f,
                "truncated: the next record file starts at record {next_seq}, but this one ends at {last_seq} ({} whole lines missing)",
                next_seq - 1 - last_seq
            ),
            ProblemKind::PastNextFile { next_seq, last_seq } => write!(
                f,
                "the next record file starts at record {next_seq}, but this one goes on to {last_seq}: records were added past its end"
            ),
            ProblemKind::MissingVersusCheckpoint {
                checkpoint_seq,
                last_seq,
            } => write!(
                f,
                "truncated: the write-ahead ring's checkpoint says record {checkpoint_seq} was durable but the stream ends at {last_seq} ({} whole lines missing)",
                checkpoint_seq - last_seq
            ),
            ProblemKind::FileNameMismatch { named, found } => write!(
                f,
                "file name claims first record {named} but the file starts at {found}"
            ),
        }
    }
}

/// One problem and where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// Where.
    pub at: Location,
    /// What.
    #[serde(flatten)]
    pub kind: ProblemKind,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.at, self.kind)
    }
}

/// The result of verifying a record stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VerifyReport {
    /// The files read, in chain order.
    pub files: Vec<PathBuf>,
    /// How many complete lines were read.
    pub records: u64,
    /// The first sequence number present.
    pub first_seq: Option<u64>,
    /// The last sequence number present.
    pub last_seq: Option<u64>,
    /// The hash of the last complete line (the chain head).
    pub head_hash: Option<ChainHash>,
    /// The head anchor checked against, if any.
    pub head_anchor: Option<HeadAnchor>,
    /// Everything wrong, in stream order.
    pub problems: Vec<Problem>,
    /// Facts worth knowing that are not problems (e.g. preserved torn tails).
    pub notes: Vec<String>,
}

impl VerifyReport {
    /// True when no problem was found.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// True when nothing was verified and nothing found wrong: no record, no head anchor,
    /// no problem (a mistyped path, a state directory, an emptied directory, or one holding
    /// only an empty record file). Such a report is no evidence of anything, and a command
    /// a gate trusts must not exit 0 on it. (A file cut to nothing against its ring's
    /// checkpoint has problems: it is missing records, not empty.)
    pub fn holds_no_evidence(&self) -> bool {
        self.records == 0 && self.head_anchor.is_none() && self.problems.is_empty()
    }
}

/// Why the end of the records at `records` cannot be vouched for, when it cannot: a record
/// directory, or a record file of one named as a writer names them (judged as its
/// directory is, as the diff judges it), that holds records but neither a head anchor nor
/// a write-ahead ring, which every writer keeps (they were removed), so whole lines cut
/// from its end would not show. The host refuses to open such a directory; its readers
/// refuse it as evidence. (A file otherwise named, a copy, is read as far as it goes and
/// says its end is not checked.)
pub fn unvouched_end(records: &Path, report: &VerifyReport) -> Option<String> {
    use super::{ring::RING_FILE, store::HEAD_FILE};
    let dir = if records.is_dir() {
        records.to_path_buf()
    } else {
        let record_file = records
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(super::store::parse_record_file_name)
            .is_some();
        match records.parent() {
            Some(parent) if record_file && !parent.as_os_str().is_empty() => parent.to_path_buf(),
            Some(_) if record_file => PathBuf::from("."),
            _ => return None,
        }
    };
    let unanchored = report.records > 0
        && report.head_anchor.is_none()
        && std::fs::symlink_metadata(dir.join(HEAD_FILE)).is_err()
        && std::fs::symlink_metadata(dir.join(RING_FILE)).is_err();
    unanchored.then(|| {
        format!(
            "{} holds records but neither {HEAD_FILE} nor {RING_FILE}, which every writer keeps: they were removed, and whole lines cut from its end would not show, so its records are no evidence of where the stream ended",
            dir.display()
        )
    })
}

/// Why records in which [`verify_records`] found no problem are still no evidence, as every
/// reader judges them: they hold no record and no head anchor (an empty or wrong directory,
/// or one whose files were all removed), or an end nothing vouches for ([`unvouched_end`]).
pub fn refused_as_evidence(path: &Path, report: &VerifyReport) -> Option<String> {
    if report.holds_no_evidence() {
        return Some(format!(
            "{} holds no record and no head anchor (is it a records directory?)",
            path.display()
        ));
    }
    unvouched_end(path, report)
}

/// Verifies the records at `path`: a record directory (its files in chain order, and its
/// `records.head` unless `head` names another anchor) or a single record file (checked
/// against `head` if given, else against its directory's `records.head` when it is that
/// directory's last record file and the anchor names no other).
///
/// A directory no writer holds is also checked against its write-ahead ring's checkpoint,
/// which names the last record its files had made durable: the stream must reach the later
/// of the anchor's record and the checkpoint's (whole lines cut below either are missing),
/// and each must hash as it says (an edited last line). The anchor alone would miss lines
/// cut or edited after it, and the checkpoint moves more often.
///
/// Problems in the records are reported in the result; only failures to read (or an
/// unusable anchor) are errors.
pub fn verify_records(path: &Path, head: Option<&Path>) -> Result<VerifyReport, StoreError> {
    verify_records_in_blocks(path, head, BLOCK_BYTES, &Nothing).map(|(report, ())| report)
}

/// What a reader of the records gathers from them while they are verified, so a stream is
/// read and decoded once (see [`verify_records_gathering`]). Records are shown to it on the
/// verifier's worker threads, in runs of consecutive lines, and the runs' parts are then
/// appended in stream order.
pub trait Gather: Sync {
    /// What one run of lines yields.
    type Part: Send;
    /// A part holding nothing yet.
    fn part(&self) -> Self::Part;
    /// Takes in the valid record at `line` of `file` (1-based, counted from the run's start).
    fn record(&self, part: &mut Self::Part, record: &DecisionRecord, file: &Path, line: u64);
    /// Appends `next`, the part of the run that follows `lines_before` lines of its file, to
    /// `into`.
    fn append(&self, into: &mut Self::Part, next: Self::Part, lines_before: u64);
}

/// Gathers nothing.
struct Nothing;

impl Gather for Nothing {
    type Part = ();
    fn part(&self) {}
    fn record(&self, _: &mut (), _: &DecisionRecord, _: &Path, _: u64) {}
    fn append(&self, _: &mut (), _: (), _: u64) {}
}

/// [`verify_records`], showing every valid record to `gather` as it is decoded; returns the
/// report and what was gathered, in stream order. What a stream that does not verify yields
/// is no evidence: the caller looks at the report first.
pub fn verify_records_gathering<G: Gather>(
    path: &Path,
    head: Option<&Path>,
    gather: &G,
) -> Result<(VerifyReport, G::Part), StoreError> {
    verify_records_in_blocks(path, head, BLOCK_BYTES, gather)
}

/// [`verify_records_gathering`], reading files in blocks of `block` bytes (tests use small
/// blocks to cross block boundaries cheaply).
fn verify_records_in_blocks<G: Gather>(
    path: &Path,
    head: Option<&Path>,
    block: usize,
    gather: &G,
) -> Result<(VerifyReport, G::Part), StoreError> {
    let meta = fs::metadata(path).map_err(StoreError::io("open", path))?;
    let parent = path.parent().map(|d| {
        if d.as_os_str().is_empty() {
            Path::new(".")
        } else {
            d
        }
    });
    // The anchor before the files: a writer that rotates and refreshes its anchor meanwhile
    // then adds files past the anchor (which verify), never an anchor past the files listed
    // (which would read as records cut). A record file read alone is held to its
    // directory's anchor (read here, before the directory is listed) when it is that
    // directory's last file and the anchor names no other: lines cut from it then show as
    // they would when the directory is read.
    let anchor_at = match (head, meta.is_dir(), parent) {
        (Some(head), _, _) => Some(head.to_path_buf()),
        (None, true, _) => Some(path.join(HEAD_FILE)),
        (None, false, Some(dir))
            if path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(super::store::parse_record_file_name)
                .is_some() =>
        {
            Some(dir.join(HEAD_FILE))
        }
        (None, false, _) => None,
    };
    let head_anchor = match anchor_at {
        // An anchor named on the command line must be there: without it nothing would
        // check the end of the stream, and a mistyped name would pass as "no anchor".
        Some(p) if head.is_some() => Some(HeadAnchor::read_named(&p)?),
        Some(p) => HeadAnchor::read(&p)?,
        None => None,
    };
    // The directory a writer may be appending to the last file read in: the one read, or
    // the directory of a record file read alone when it is that directory's last.
    let appending = if meta.is_dir() {
        Some(path.to_path_buf())
    } else {
        match parent {
            Some(dir)
                if super::store::record_files_on_disk(dir)?
                    .last()
                    .is_some_and(|f| f.path.file_name() == path.file_name()) =>
            {
                Some(dir.to_path_buf())
            }
            _ => None,
        }
    };
    // A record file read alone is held to what its directory's anchor and ring checkpoint
    // say of this very file, whichever file is its directory's last (another record file
    // named after it, even an empty one made to look like a rotation, leaves this one's
    // records where the witness says they are); and, when it is the directory's last, to
    // what they say of a later one: that means records past this file's end that are gone
    // (its later files deleted). One naming an earlier file (a writer rotating meanwhile)
    // vouches for nothing read here.
    let sequence_of = |name: &str| super::store::parse_record_file_name(name);
    let this = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(sequence_of);
    let names_this_or_later =
        |file: &str| this.is_some_and(|this| sequence_of(file).is_some_and(|named| named >= this));
    let names_this = |file: &str| this.is_some_and(|this| sequence_of(file) == Some(this));
    // A later file named that is gone: records past this file's end are missing, whatever
    // other files were made to follow it (a decoy must not excuse the deletion).
    let names_a_later_one_gone = |file: &str| {
        names_this_or_later(file)
            && !names_this(file)
            && parent.is_some_and(|dir| {
                matches!(
                    fs::symlink_metadata(dir.join(file)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound
                )
            })
    };
    let witnessed = |file: Option<&str>| match file {
        Some(file) => {
            names_this(file)
                || appending.is_some() && names_this_or_later(file)
                || names_a_later_one_gone(file)
        }
        None => appending.is_some(),
    };
    let head_anchor = if head.is_none() && !meta.is_dir() {
        head_anchor.filter(|a| witnessed(a.file.as_deref()))
    } else {
        head_anchor
    };
    let (files, checkpoint, notes) = if meta.is_dir() {
        let (files, checkpoint) = list_record_files_and_checkpoint(path)?;
        let files: Vec<PathBuf> = files.into_iter().map(|f| f.path).collect();
        let notes = list_torn_sidecars(path)?
            .into_iter()
            .map(|p| {
                format!(
                    "{} preserves a torn last line cut at a restart (never acknowledged as durable)",
                    p.display()
                )
            })
            .collect();
        (files, checkpoint, notes)
    } else {
        // A record file beside a ring is refused as its directory would be.
        let (files, checkpoint) = super::store::record_sources_and_checkpoint(path)?;
        let checkpoint = checkpoint.filter(|c| witnessed(Some(&c.file)));
        (files, checkpoint, Vec::new())
    };
    let mut witnesses = Witness::of(head_anchor.as_ref(), checkpoint.as_ref());
    let mut notes = notes;
    // A record file read alone that is not its directory's last: the anchor and the
    // checkpoint name a later file and vouch for nothing here, but the file after this one
    // says where this one ends and what its last line hashes to.
    if !meta.is_dir()
        && appending.is_none()
        && let (Some(dir), Some(this)) = (parent, this)
        && let Some(next) = super::store::record_files_on_disk(dir)?
            .into_iter()
            .find(|f| f.first_seq > this)
    {
        match first_record_before(&next.path, next.first_seq) {
            Some(witness) => witnesses.push(witness),
            // Its name still says where this file ends (a rotation names the new file after
            // the last record of the one before, even when it crashed before writing to it).
            None => {
                notes.push(format!(
                    "{} follows this file, but its first record cannot be read as the record \
                     its name says, so this file's last line is not checked against it (where \
                     the file ends is, by its name)",
                    next.path.display()
                ));
                if let Some(seq) = next.first_seq.checked_sub(1).filter(|&s| s > 0) {
                    witnesses.push(Witness {
                        seq,
                        hash: None,
                        by: Voucher::NextFile,
                    });
                }
            }
        }
    }
    let mut v = Verifier::new(files.clone(), head_anchor.clone(), notes, witnesses);
    let mut gathered = gather.part();
    // Asked before reading: a writer that held the directory all along was appending.
    let live = match &appending {
        Some(dir) => super::store::writer_holds(dir)?,
        None => false,
    };
    for (index, file) in files.iter().enumerate() {
        let part = v.file(index, file, block, gather)?;
        gather.append(&mut gathered, part, 0);
    }
    // A writer appends each line with one write, which a reader may see in part: the
    // partial last line of the last file of a directory a writer held throughout is a line
    // being written, not a torn one.
    if let Some(last) = files.last()
        && let Some(dir) = appending.as_deref().filter(|_| live)
        && super::store::writer_holds(dir)?
    {
        let torn = |p: &Problem| {
            matches!(p.kind, ProblemKind::TornLine { .. }) && p.at.file.as_path() == last.as_path()
        };
        if v.report.problems.iter().any(torn) {
            v.report.problems.retain(|p| !torn(p));
            v.report.notes.push(format!(
                "{}: its last line was being written (a writer holds the directory); it was not read",
                last.display()
            ));
        }
    }
    let at = Location::in_file(files.last().map_or(path, PathBuf::as_path), None);
    v.check_witnesses(at);
    Ok((v.finish(), gathered))
}

/// Verifies the chain over the decisions of an exported decision surface envelope
/// (`observed_tool_decisions` of `file`), which carry no head anchor.
///
/// Each decision is decoded strictly as a record and serialised again exactly as the writer
/// serialises it, so its line hash is the one the next record's `prev_hash` vouches for
/// (the export copies lines verbatim; re-serialising also accepts an envelope that was
/// pretty-printed or re-indented). A decision that is not a valid record is a `malformed`
/// problem at its index.
pub fn verify_decisions(file: &Path, decisions: &[serde_json::Value]) -> VerifyReport {
    let mut v = Verifier::new(vec![file.to_path_buf()], None, Vec::new(), Vec::new());
    for (i, decision) in decisions.iter().enumerate() {
        let decoded = DecisionRecord::deserialize(decision).map_err(|e| RecordFormatError {
            field: "(json)".to_string(),
            problem: e.to_string(),
        });
        // A decision that does not decode still occupies its place; its bytes only feed a
        // hash no valid record can match.
        let line = match &decoded {
            Ok(r) => serde_json::to_vec(r),
            Err(_) => serde_json::to_vec(decision),
        }
        .unwrap_or_default();
        let facts = LineFacts {
            digest: Sha256::digest(&line).into(),
            record: decoded
                .and_then(|r| r.validate().map(|()| r))
                .map(Linked::of),
        };
        let at = v.place(Spot::Index(i as u64));
        v.record(at, facts);
    }
    v.finish()
}

/// How much of a record file is read at a time; its complete lines are hashed and decoded
/// together, in parallel, while the next block is read, and then linked in order.
const BLOCK_BYTES: usize = 16 * 1024 * 1024;
/// Fewer bytes than this are not worth a thread.
const MIN_CHUNK_BYTES: usize = 1024 * 1024;

/// What linking needs of a valid record.
struct Linked {
    seq: u64,
    /// The SHA-256 its `prev_hash` names (`None` never links: validation already refused a
    /// `prev_hash` of another form).
    prev: Option<[u8; 32]>,
}

impl Linked {
    fn of(r: DecisionRecord) -> Self {
        Linked {
            seq: r.flowhost.seq,
            prev: digest_of_hash(&r.flowhost.prev_hash),
        }
    }
}

/// The SHA-256 a `sha256:` hash names.
fn digest_of_hash(hash: &str) -> Option<[u8; 32]> {
    let mut digest = [0u8; 32];
    hex::decode_to_slice(hash.strip_prefix("sha256:")?, &mut digest).ok()?;
    Some(digest)
}

/// One line as the chain sees it: its SHA-256, and its chain fields when it is a valid
/// record.
struct LineFacts {
    digest: [u8; 32],
    record: Result<Linked, RecordFormatError>,
}

/// The facts of each complete line of `bytes` (which ends at a newline) of `file`, in order,
/// and what `gather` made of its valid records.
fn facts_of_lines<G: Gather>(bytes: &[u8], file: &Path, gather: &G) -> (Vec<LineFacts>, G::Part) {
    let mut facts = Vec::with_capacity(bytes.len() / 512);
    let mut part = gather.part();
    let mut from = 0;
    for nl in memchr::memchr_iter(b'\n', bytes) {
        let line = &bytes[from..nl];
        let record = DecisionRecord::from_json_line(line);
        if let Ok(r) = &record {
            gather.record(&mut part, r, file, facts.len() as u64 + 1);
        }
        facts.push(LineFacts {
            digest: Sha256::digest(line).into(),
            record: record.map(Linked::of),
        });
        from = nl + 1;
    }
    (facts, part)
}

/// Splits `bytes` (which ends at a newline) into up to `parts` runs of whole lines.
fn whole_line_runs(bytes: &[u8], parts: usize) -> Vec<std::ops::Range<usize>> {
    let parts = parts.clamp(1, bytes.len() / MIN_CHUNK_BYTES + 1);
    let mut runs = Vec::with_capacity(parts);
    let mut start = 0;
    for k in 1..parts {
        let aim = (bytes.len() * k / parts).max(start);
        let Some(nl) = memchr::memchr(b'\n', &bytes[aim..]) else {
            break;
        };
        let end = aim + nl + 1;
        if end < bytes.len() {
            runs.push(start..end);
            start = end;
        }
    }
    runs.push(start..bytes.len());
    runs
}

/// The facts of the complete lines of `block` (its first `cut` bytes), one worker thread per
/// run of lines, in line order. A worker that fails leaves its lines unverified: each is a
/// problem, never skipped, so the chain still counts every line in its place.
struct BlockFacts<'scope, P> {
    block: std::sync::Arc<Vec<u8>>,
    runs: Vec<(std::ops::Range<usize>, Worker<'scope, P>)>,
}

/// The facts of a run of lines, and what was gathered of it.
type RunFacts<P> = (Vec<LineFacts>, P);

/// The thread working out a run's facts.
type Worker<'scope, P> = std::thread::ScopedJoinHandle<'scope, RunFacts<P>>;

impl<'scope, P: Send + 'scope> BlockFacts<'scope, P> {
    fn start<'env, G: Gather<Part = P>>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        block: std::sync::Arc<Vec<u8>>,
        cut: usize,
        threads: usize,
        file: &'env Path,
        gather: &'env G,
    ) -> Self {
        let runs = whole_line_runs(&block[..cut], threads)
            .into_iter()
            .map(|run| {
                let bytes = std::sync::Arc::clone(&block);
                let range = run.clone();
                let worker = scope.spawn(move || facts_of_lines(&bytes[range], file, gather));
                (run, worker)
            })
            .collect();
        BlockFacts { block, runs }
    }

    /// Each run's facts and part, in order, and the block's buffer back for the next read
    /// (once every worker is done with it).
    fn join(self, empty: impl Fn() -> P) -> (Vec<RunFacts<P>>, Option<Vec<u8>>) {
        let block = self.block;
        let runs = self.runs.into_iter().map(|(run, worker)| {
            worker.join().unwrap_or_else(|_| {
                let facts = memchr::memchr_iter(b'\n', &block[run.clone()])
                    .scan(run.start, |from, nl| {
                        let line = &block[*from..run.start + nl];
                        *from = run.start + nl + 1;
                        Some(LineFacts {
                            digest: Sha256::digest(line).into(),
                            record: Err(RecordFormatError {
                                field: "(record)".into(),
                                problem: "could not be checked (the verifier's worker failed)"
                                    .into(),
                            }),
                        })
                    })
                    .collect();
                (facts, empty())
            })
        });
        let runs = runs.collect();
        (runs, std::sync::Arc::try_unwrap(block).ok())
    }
}

/// Reads until `buf` holds `want` more bytes or the file ends (no zero-filling: the buffer's
/// spare capacity is read into); returns how many bytes were read.
fn read_more(f: &mut fs::File, buf: &mut Vec<u8>, want: usize) -> std::io::Result<usize> {
    use std::io::Read;
    let before = buf.len();
    loop {
        match f
            .by_ref()
            .take((want - (buf.len() - before)) as u64)
            .read_to_end(buf)
        {
            Ok(_) => return Ok(buf.len() - before),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Where a line is: which of the verifier's files, and where in it.
#[derive(Debug, Clone, Copy)]
struct Place {
    file: usize,
    spot: Spot,
}

#[derive(Debug, Clone, Copy)]
enum Spot {
    Line(u64),
    Index(u64),
}

struct Prev {
    at: Place,
    seq: Option<u64>,
    digest: [u8; 32],
}

struct Verifier {
    report: VerifyReport,
    /// The file being read, as an index into `report.files`.
    current: usize,
    expected: Option<u64>,
    prev: Option<Prev>,
    /// The records the stream must still hold, and where each was found with its hash.
    witnesses: Vec<(Witness, Option<Found>)>,
}

/// Where a line is, and its SHA-256.
type Found = (Location, [u8; 32]);

/// Who vouches for a record the stream must still hold, unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Voucher {
    HeadAnchor,
    Checkpoint,
    /// The first record of the record file after the one read alone: its seq is one past
    /// this file's last, its `prev_hash` the hash of this file's last line.
    NextFile,
}

impl Voucher {
    fn name(self) -> &'static str {
        match self {
            Voucher::HeadAnchor => "head anchor",
            Voucher::Checkpoint => "write-ahead ring's checkpoint",
            Voucher::NextFile => "next record file's first record",
        }
    }
}

/// A record the stream must still hold: no crash takes away a line once it is durable, so
/// the stream reaches it and holds it unchanged (`hash`: as the voucher says; `None` when
/// it says only where the record is, as a next record file's name does).
#[derive(Debug, Clone)]
struct Witness {
    seq: u64,
    hash: Option<String>,
    by: Voucher,
}

/// What the first record of record file `path` (named as starting at `named`) says of the
/// record before it: its seq and line hash. `None` when the file cannot be read, holds no
/// complete first line, or one that does not read as the record its name says: it vouches
/// for nothing before it (the file read alone is verified without it, as before there was
/// a next file; a verification of the directory reports what is wrong with it).
fn first_record_before(path: &Path, named: u64) -> Option<Witness> {
    use std::io::{BufRead, Read};
    let file = super::store::open_record_file(path).ok()?;
    let mut line = Vec::new();
    std::io::BufReader::new(file)
        .take(super::ring::LONGEST_LINE + 1)
        .read_until(b'\n', &mut line)
        .ok()?;
    if line.pop() != Some(b'\n') {
        return None;
    }
    let first = serde_json::from_slice::<serde_json::Value>(&line).ok()?;
    let seq = first
        .pointer("/flowhost/seq")
        .and_then(serde_json::Value::as_u64);
    let prev = first
        .pointer("/flowhost/prev_hash")
        .and_then(serde_json::Value::as_str);
    match (seq, prev) {
        (Some(seq), Some(prev)) if seq == named && seq > 1 => Some(Witness {
            seq: seq - 1,
            hash: Some(prev.to_string()),
            by: Voucher::NextFile,
        }),
        _ => None,
    }
}

impl Witness {
    /// The records the head anchor and the ring's checkpoint name (the checkpoint is often
    /// the later: it moves as the ring fills, the anchor at most once per `head_interval`).
    /// One that names what the other does adds nothing.
    fn of(anchor: Option<&HeadAnchor>, checkpoint: Option<&Checkpoint>) -> Vec<Witness> {
        let mut witnesses: Vec<Witness> = anchor
            .map(|a| Witness {
                seq: a.seq,
                hash: Some(a.hash.clone()),
                by: Voucher::HeadAnchor,
            })
            .into_iter()
            .collect();
        if let Some(c) = checkpoint
            && !witnesses
                .iter()
                .any(|w| w.seq == c.seq && w.hash.as_deref() == Some(c.hash.as_str()))
        {
            witnesses.push(Witness {
                seq: c.seq,
                hash: Some(c.hash.as_str().to_string()),
                by: Voucher::Checkpoint,
            });
        }
        witnesses
    }
}

impl Verifier {
    fn new(
        files: Vec<PathBuf>,
        head_anchor: Option<HeadAnchor>,
        notes: Vec<String>,
        witnesses: Vec<Witness>,
    ) -> Self {
        Verifier {
            report: VerifyReport {
                files,
                records: 0,
                first_seq: None,
                last_seq: None,
                head_hash: None,
                head_anchor,
                problems: Vec::new(),
                notes,
            },
            current: 0,
            expected: None,
            prev: None,
            witnesses: witnesses.into_iter().map(|w| (w, None)).collect(),
        }
    }

    /// Checks the stream against its witnesses: it must reach the later one's record (the
    /// head anchor's on a tie), and each record they name must hash as they say. `at` is
    /// where a missing end is reported.
    fn check_witnesses(&mut self, at: Location) {
        let last = self.report.last_seq.unwrap_or(0);
        // Those that vouch for a record's hash first: a next file's name alone (which anyone
        // can give a file) says the stream is cut only when nothing surer does.
        let latest = |vouched: bool| {
            self.witnesses
                .iter()
                .map(|(w, _)| w)
                .filter(|w| w.hash.is_some() == vouched && w.seq > last)
                .reduce(|a, b| if b.seq > a.seq { b } else { a })
        };
        if let Some(latest) = latest(true).or_else(|| latest(false)) {
            let kind = match latest.by {
                Voucher::HeadAnchor => ProblemKind::MissingVersusHead {
                    head_seq: latest.seq,
                    last_seq: last,
                },
                Voucher::Checkpoint => ProblemKind::MissingVersusCheckpoint {
                    checkpoint_seq: latest.seq,
                    last_seq: last,
                },
                Voucher::NextFile => ProblemKind::MissingVersusNextFile {
                    next_seq: latest.seq + 1,
                    last_seq: last,
                },
            };
            self.report.problems.push(Problem {
                at: at.clone(),
                kind,
            });
        }
        // The next file's first record also says where this file must end: records past it
        // were added after the stream moved on (chained to one another, they verify).
        if let Some(next) = self
            .witnesses
            .iter()
            .map(|(w, _)| w)
            .find(|w| w.by == Voucher::NextFile && w.seq < last)
        {
            self.report.problems.push(Problem {
                at: at.clone(),
                kind: ProblemKind::PastNextFile {
                    next_seq: next.seq + 1,
                    last_seq: last,
                },
            });
        }
        for (witness, found) in std::mem::take(&mut self.witnesses) {
            if let (Some((loc, digest)), Some(hash)) = (found, &witness.hash)
                && hash_of_digest(&digest).as_str() != hash
            {
                self.report.problems.push(Problem {
                    at: loc,
                    kind: ProblemKind::Edited {
                        seq: witness.seq,
                        witness: witness.by.name(),
                    },
                });
            }
        }
    }

    /// The report, with the chain head's hash.
    fn finish(mut self) -> VerifyReport {
        self.report.head_hash = self.prev.as_ref().map(|p| hash_of_digest(&p.digest));
        self.report
    }

    fn place(&self, spot: Spot) -> Place {
        Place {
            file: self.current,
            spot,
        }
    }

    fn location(&self, at: Place) -> Location {
        let file = self.report.files.get(at.file).cloned().unwrap_or_default();
        match at.spot {
            Spot::Line(line) => Location {
                file,
                line: Some(line),
                index: None,
            },
            Spot::Index(index) => Location {
                file,
                line: None,
                index: Some(index),
            },
        }
    }

    /// Verifies record file `file`, the `index`th of the report's, read in blocks of about `block` bytes (memory stays bounded
    /// whatever the file's size: two blocks at a time); the complete lines of each block are
    /// hashed and decoded in parallel while the next block is read, then linked in order.
    fn file<G: Gather>(
        &mut self,
        index: usize,
        file: &Path,
        block: usize,
        gather: &G,
    ) -> Result<G::Part, StoreError> {
        self.current = index;
        let named = file
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_record_file_name);
        let mut f = super::store::open_record_file(file)?;
        let block = block.max(1);
        let threads = std::thread::available_parallelism().map_or(1, usize::from);
        let mut line_no = 0u64;
        let mut gathered = gather.part();
        let (torn, too_long) = std::thread::scope(|scope| -> Result<(usize, bool), StoreError> {
            // The start of a line carried over from the previous block.
            let mut carried: Vec<u8> = Vec::new();
            let mut too_long = false;
            let mut in_flight: Option<BlockFacts<'_, G::Part>> = None;
            // A buffer a linked block gave back (fresh memory costs a page fault per page).
            let mut spare: Option<Vec<u8>> = None;
            loop {
                // A long start of a line (no newline in a whole block) is read on into, not
                // copied: one copy of it at a time, however long.
                let mut buf = if carried.len() >= block / 2 {
                    std::mem::take(&mut carried)
                } else {
                    let mut b = spare.take().unwrap_or_default();
                    b.clear();
                    b.extend_from_slice(&carried);
                    carried.clear();
                    b
                };
                buf.reserve(block);
                // The carried bytes hold no newline: only what is read now is looked at.
                let scanned = buf.len();
                let n = match read_more(&mut f, &mut buf, block) {
                    Ok(n) => n,
                    Err(e) => {
                        // Joined first: a worker that failed is answered for, not left to
                        // the scope.
                        if let Some(done) = in_flight.take() {
                            drop(done.join(|| gather.part()));
                        }
                        return Err(StoreError::io("read", file)(e));
                    }
                };
                let cut = memchr::memrchr(b'\n', &buf[scanned..]).map_or(0, |i| scanned + i + 1);
                let next = if cut == 0 {
                    carried = buf;
                    // No record is that long: what the file holds past it is not one, and
                    // is not read into memory whatever its size.
                    too_long = carried.len() as u64 > super::ring::LONGEST_LINE;
                    None
                } else {
                    carried.extend_from_slice(&buf[cut..]);
                    Some(BlockFacts::start(
                        scope,
                        std::sync::Arc::new(buf),
                        cut,
                        threads,
                        file,
                        gather,
                    ))
                };
                // The previous block is linked while this one is hashed and decoded.
                if let Some(done) = in_flight.take() {
                    spare = self.link_block(done, &mut line_no, named, gather, &mut gathered);
                }
                in_flight = next;
                if n < block || too_long {
                    break;
                }
            }
            if let Some(done) = in_flight.take() {
                self.link_block(done, &mut line_no, named, gather, &mut gathered);
            }
            Ok((carried.len(), too_long))
        })?;
        if too_long {
            let at = self.place(Spot::Line(line_no + 1));
            self.problem(
                at,
                ProblemKind::Malformed {
                    error: format!(
                        "over {} bytes without a newline, longer than any record: the rest of \
                         the file is not read",
                        super::ring::LONGEST_LINE
                    ),
                },
            );
        } else if torn > 0 {
            let at = self.place(Spot::Line(line_no + 1));
            self.problem(at, ProblemKind::TornLine { bytes: torn });
        }
        Ok(gathered)
    }

    /// Links a block's lines in order, and appends what was gathered of each run; returns
    /// the block's buffer.
    fn link_block<G: Gather>(
        &mut self,
        facts: BlockFacts<'_, G::Part>,
        line_no: &mut u64,
        named: Option<u64>,
        gather: &G,
        gathered: &mut G::Part,
    ) -> Option<Vec<u8>> {
        let (runs, buffer) = facts.join(|| gather.part());
        for (run, part) in runs {
            gather.append(gathered, part, *line_no);
            for facts in run {
                *line_no += 1;
                let at = self.place(Spot::Line(*line_no));
                let seq = self.record(at, facts);
                if *line_no == 1
                    && let (Some(named), Some(found)) = (named, seq)
                    && named != found
                {
                    self.problem(at, ProblemKind::FileNameMismatch { named, found });
                }
            }
        }
        buffer
    }

    /// Takes one line (its hash, and its chain fields when it is a valid record) into the
    /// chain; returns its sequence number when it is a valid record.
    fn record(&mut self, at: Place, facts: LineFacts) -> Option<u64> {
        self.report.records += 1;
        let LineFacts { digest, record } = facts;
        let seq = match &record {
            Ok(r) => Some(r.seq),
            Err(e) => {
                self.problem(
                    at,
                    ProblemKind::Malformed {
                        error: e.to_string(),
                    },
                );
                None
            }
        };
        if let (Ok(r), Some(seq)) = (&record, seq) {
            self.link(at, r, seq);
            if self.witnesses.iter().any(|(w, _)| w.seq == seq) {
                let loc = self.location(at);
                for (_, found) in self.witnesses.iter_mut().filter(|(w, _)| w.seq == seq) {
                    *found = Some((loc.clone(), digest));
                }
            }
            self.report.first_seq.get_or_insert(seq);
            self.report.last_seq = Some(seq);
            self.expected = Some(seq.saturating_add(1));
        } else if let Some(e) = self.expected {
            // A malformed line still occupies its place in the stream.
            self.expected = Some(e.saturating_add(1));
        }
        self.prev = Some(Prev { at, seq, digest });
        seq
    }

    fn link(&mut self, at: Place, r: &Linked, seq: u64) {
        match self.expected {
            None => {
                if seq != 1 {
                    self.problem(at, ProblemKind::StartsLate { first: seq });
                } else if r.prev != Some([0; 32]) {
                    self.problem(at, ProblemKind::BadGenesis);
                }
            }
            Some(expected) if seq > expected => {
                self.problem(
                    at,
                    ProblemKind::Gap {
                        expected,
                        found: seq,
                    },
                );
            }
            Some(expected) if seq < expected => {
                self.problem(
                    at,
                    ProblemKind::OutOfOrder {
                        expected,
                        found: seq,
                    },
                );
            }
            Some(_) => {
                // Contiguous: the previous line must hash to this record's prev_hash. If the
                // previous line was malformed it is already reported.
                if let Some(prev) = &self.prev
                    && let Some(prev_seq) = prev.seq
                    && r.prev != Some(prev.digest)
                {
                    let loc = prev.at;
                    self.problem(
                        loc,
                        ProblemKind::Edited {
                            seq: prev_seq,
                            witness: "next record",
                        },
                    );
                }
            }
        }
    }

    fn problem(&mut self, at: Place, kind: ProblemKind) {
        let at = self.location(at);
        self.report.problems.push(Problem { at, kind });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::tests::sample_tool_call;

    #[test]
    fn seal_assigns_seq_and_links_hashes() {
        let mut c = Chainer::genesis();
        let a = c.seal(&mut sample_tool_call()).unwrap();
        let mut second = sample_tool_call();
        let b = c.seal(&mut second).unwrap();
        assert_eq!((a.seq, b.seq), (1, 2));
        assert_eq!(second.flowhost.prev_hash, a.hash.as_str());
        assert_eq!(a.hash, line_hash(&a.line[..a.line.len() - 1]));
        assert_eq!(c.next_seq(), 3);
        assert_eq!(c.head_hash(), &b.hash);
    }

    #[test]
    fn seal_rejects_an_invalid_record_and_keeps_the_chain() {
        let mut c = Chainer::genesis();
        let mut r = sample_tool_call();
        r.redaction.secret_material_stored = true;
        let e = c.seal(&mut r).unwrap_err();
        assert_eq!(e.field, "redaction.secret_material_stored");
        assert_eq!(c.next_seq(), 1);
    }

    #[test]
    fn the_chain_never_reuses_a_sequence_number() {
        assert_eq!(Chainer::resume(u64::MAX, ChainHash::genesis()), None);
        let mut c = Chainer::resume(u64::MAX - 2, ChainHash::genesis()).unwrap();
        assert_eq!(c.seal(&mut sample_tool_call()).unwrap().seq, u64::MAX - 1);
        let e = c.seal(&mut sample_tool_call()).unwrap_err();
        assert_eq!(e.field, "flowhost.seq");
        assert_eq!(c.next_seq(), u64::MAX, "unchanged");
    }

    #[test]
    fn lines_checked_in_parallel_blocks_keep_their_order() {
        // More lines than one block, so blocks, lines cut by a block end and worker chunks
        // all have boundaries.
        let mut c = Chainer::genesis();
        let line_len = Chainer::genesis()
            .seal(&mut sample_tool_call())
            .unwrap()
            .line
            .len();
        // Enough for several workers per block.
        let per_block = 4 * MIN_CHUNK_BYTES / line_len;
        let n = per_block + 900;
        let mut lines: Vec<Vec<u8>> = (0..n)
            .map(|_| c.seal(&mut sample_tool_call()).unwrap().line)
            .collect();
        let block = lines[0].len() * per_block + 7;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("many.jsonl");
        std::fs::write(&path, lines.concat()).unwrap();
        let report = verify_records_in_blocks(&path, None, block, &Nothing)
            .unwrap()
            .0;
        assert!(report.is_ok(), "{:?}", report.problems);
        assert_eq!(
            (report.records, report.last_seq),
            (n as u64, Some(n as u64))
        );
        // Edit one line just past the first block: reported at that line, and only there.
        let at = per_block + 10;
        let edited = String::from_utf8(lines[at].clone())
            .unwrap()
            .replace("\"allow\"", "\"deny\"");
        lines[at] = edited.into_bytes();
        std::fs::write(&path, lines.concat()).unwrap();
        let report = verify_records_in_blocks(&path, None, block, &Nothing)
            .unwrap()
            .0;
        let lines_reported: Vec<_> = report.problems.iter().map(|p| p.at.line).collect();
        assert_eq!(
            lines_reported,
            [Some(at as u64 + 1)],
            "{:?}",
            report.problems
        );
    }

    /// Gathers each record's (line, seq).
    struct Places;

    impl Gather for Places {
        type Part = Vec<(u64, u64)>;
        fn part(&self) -> Self::Part {
            Vec::new()
        }
        fn record(&self, part: &mut Self::Part, r: &DecisionRecord, _: &Path, line: u64) {
            part.push((line, r.flowhost.seq));
        }
        fn append(&self, into: &mut Self::Part, next: Self::Part, lines_before: u64) {
            into.extend(next.into_iter().map(|(l, seq)| (l + lines_before, seq)));
        }
    }

    #[test]
    fn what_is_gathered_comes_in_stream_order_with_true_line_numbers() {
        let mut c = Chainer::genesis();
        let line_len = c.seal(&mut sample_tool_call()).unwrap().line.len();
        let per_block = 4 * MIN_CHUNK_BYTES / line_len;
        let n = 2 * per_block + 17;
        let mut c = Chainer::genesis();
        let mut lines: Vec<Vec<u8>> = (0..n)
            .map(|_| c.seal(&mut sample_tool_call()).unwrap().line)
            .collect();
        // One line that is no record: it takes its place, and nothing is gathered of it.
        lines[per_block + 3] = b"{}\n".to_vec();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("many.jsonl");
        std::fs::write(&path, lines.concat()).unwrap();
        let block = line_len * per_block + 7;
        let (report, places) = verify_records_in_blocks(&path, None, block, &Places).unwrap();
        assert_eq!(report.records, n as u64);
        let want: Vec<(u64, u64)> = (1..=n as u64)
            .filter(|&l| l != per_block as u64 + 4)
            .map(|l| (l, l))
            .collect();
        assert_eq!(places, want);
    }

    #[test]
    fn lines_longer_than_a_block_are_read_whole() {
        let mut c = Chainer::genesis();
        let lines: Vec<Vec<u8>> = (0..5)
            .map(|_| c.seal(&mut sample_tool_call()).unwrap().line)
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("long.jsonl");
        std::fs::write(&path, lines.concat()).unwrap();
        for block in [1, 64, 700, lines[0].len(), lines[0].len() + 1] {
            let (report, ()) = verify_records_in_blocks(&path, None, block, &Nothing).unwrap();
            assert!(report.is_ok(), "block {block}: {:?}", report.problems);
            assert_eq!(report.records, 5, "block {block}");
        }
        // A torn tail longer than a block is one torn line of its length.
        let tail = &lines[0][..lines[0].len() - 1];
        std::fs::write(&path, [&lines.concat()[..], tail].concat()).unwrap();
        let (report, ()) = verify_records_in_blocks(&path, None, 64, &Nothing).unwrap();
        let kinds: Vec<_> = report.problems.iter().map(|p| &p.kind).collect();
        assert_eq!(
            kinds,
            [&ProblemKind::TornLine { bytes: tail.len() }],
            "{:?}",
            report.problems
        );
        assert_eq!(report.problems[0].at.line, Some(6));
    }

    #[test]
    fn runs_of_whole_lines_cover_the_bytes_once() {
        let line = vec![b'x'; 1000];
        let mut bytes = Vec::new();
        for _ in 0..5000 {
            bytes.extend_from_slice(&line);
            bytes.push(b'\n');
        }
        for parts in [1, 2, 3, 8] {
            let runs = whole_line_runs(&bytes, parts);
            assert!(runs.len() <= parts);
            assert_eq!(runs.first().map(|r| r.start), Some(0));
            assert_eq!(runs.last().map(|r| r.end), Some(bytes.len()));
            for pair in runs.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
                assert_eq!(bytes[pair[0].end - 1], b'\n', "a run ends at a line end");
            }
        }
        // Too little for a second thread; one line longer than a share.
        assert_eq!(whole_line_runs(b"a\nb\n", 2), vec![0..4]);
        let mut long = vec![b'y'; 3 * MIN_CHUNK_BYTES];
        long.push(b'\n');
        assert_eq!(whole_line_runs(&long, 2), vec![0..long.len()]);
    }

    #[test]
    fn an_edited_last_line_of_a_rotated_file_is_reported_in_that_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Chainer::genesis();
        let mut seal = || c.seal(&mut sample_tool_call()).unwrap().line;
        let first: Vec<Vec<u8>> = (0..3).map(|_| seal()).collect();
        let second: Vec<Vec<u8>> = (0..2).map(|_| seal()).collect();
        let edited = String::from_utf8(first[2].clone())
            .unwrap()
            .replace("\"allow\"", "\"deny\"");
        let a = dir.path().join(super::super::store::record_file_name(1));
        let b = dir.path().join(super::super::store::record_file_name(4));
        std::fs::write(&a, [&first[0][..], &first[1], edited.as_bytes()].concat()).unwrap();
        std::fs::write(&b, second.concat()).unwrap();
        let report = verify_records(dir.path(), None).unwrap();
        let at: Vec<_> = report
            .problems
            .iter()
            .map(|p| (p.at.file.clone(), p.at.line))
            .collect();
        assert_eq!(at, [(a, Some(3))], "{:?}", report.problems);
        assert_eq!(
            report.head_hash,
            Some(line_hash(second[1].trim_ascii_end()))
        );
    }

    #[test]
    fn chain_hash_form_is_checked() {
        assert!(ChainHash::parse(GENESIS_HASH).is_some());
        assert!(ChainHash::parse("sha256:ABC").is_none());
        assert!(ChainHash::parse(&GENESIS_HASH.to_uppercase()).is_none());
    }
}
