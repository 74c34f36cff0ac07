//! Reading observed decisions: telling a JSONL stream from an exported envelope, and judging a
//! stream in parallel ranges with reused blocks (bounded memory, true line numbers).

use super::*;
use crate::records::DecisionRecord;
use serde::Deserialize;

pub(super) enum Format {
    /// A JSONL stream whose first decision carries the flowhost chain fields.
    Records,
    /// Any other JSONL decision stream.
    Stream,
    Envelope,
}

/// Read sizes of the stream reader (tests shrink them to exercise every path).
#[derive(Debug, Clone, Copy)]
pub(super) struct Tuning {
    pub(super) block: usize,
    pub(super) parallel_min: u64,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            block: BLOCK_BYTES,
            parallel_min: PARALLEL_MIN_BYTES,
        }
    }
}

/// How much of a file is read to tell a stream from an envelope.
pub(super) const PROBE_BYTES: u64 = 64 * 1024;
/// The read block of the stream reader (reused, so memory stays bounded).
pub(super) const BLOCK_BYTES: usize = 8 * 1024 * 1024;
/// Inputs smaller than this are read by one thread.
pub(super) const PARALLEL_MIN_BYTES: u64 = 4 * 1024 * 1024;

pub(super) fn read_at(
    file: &Path,
    f: &File,
    buf: &mut [u8],
    offset: u64,
) -> Result<usize, DiffError> {
    f.read_at(buf, offset)
        .map_err(|e| DiffError::Store(StoreError::io("read", file)(e)))
}

/// Tells the format of `file` from its first line, read through `f` (the caller's handle, so
/// what is read next is the same file).
pub(super) fn detect(file: &Path, f: &File) -> Result<Format, DiffError> {
    let mut prefix = vec![0u8; PROBE_BYTES as usize];
    let mut n = 0;
    while n < prefix.len() {
        match read_at(file, f, &mut prefix[n..], n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    prefix.truncate(n);
    let at_eof = n < PROBE_BYTES as usize;
    let mut lines = prefix.split(|&b| b == b'\n');
    let first = lines.find(|l| !l.iter().all(u8::is_ascii_whitespace));
    let Some(first) = first else {
        return Ok(Format::Stream);
    };
    // The first line is complete if a newline follows it within the prefix, or the file ends.
    let complete = lines.next().is_some() || at_eof;
    match serde_json::from_slice::<Probe>(first) {
        Ok(p) if p.observed_tool_decisions.is_some() => Ok(Format::Envelope),
        Ok(p) if p.chained() => Ok(Format::Records),
        Ok(_) => Ok(Format::Stream),
        // Not one object per line: a pretty-printed or very long envelope, or garbage.
        Err(line_error) => {
            let bytes = read_all(file, f)?;
            match serde_json::from_slice::<Probe>(&bytes) {
                Ok(p) if p.observed_tool_decisions.is_some() => Ok(Format::Envelope),
                _ => Err(DiffError::BadInput {
                    file: file.to_path_buf(),
                    problem: format!(
                        "neither a JSONL decision stream (line 1: {}) nor an {DECISION_SURFACE_SCHEMA} envelope",
                        if complete {
                            line_error.to_string()
                        } else {
                            "longer than 64 KiB and not JSON".to_string()
                        }
                    ),
                }),
            }
        }
    }
}

/// The longest line of a decision stream judged: far past any one decision.
const LONGEST_STREAM_LINE: usize = 64 * 1024 * 1024;

/// The largest envelope read: it is parsed whole, and a larger file would be held in
/// memory several times over.
pub(super) const MAX_ENVELOPE_BYTES: u64 = 1024 * 1024 * 1024;

/// The whole of `file`, read through `f` from its start, when it is at most
/// [`MAX_ENVELOPE_BYTES`] long.
fn read_all(file: &Path, f: &File) -> Result<Vec<u8>, DiffError> {
    let mut bytes = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        match read_at(file, f, &mut chunk, bytes.len() as u64)? {
            0 => return Ok(bytes),
            n => bytes.extend_from_slice(&chunk[..n]),
        }
        if bytes.len() as u64 > MAX_ENVELOPE_BYTES {
            return Err(too_large(file));
        }
    }
}

/// A file past [`MAX_ENVELOPE_BYTES`] that is not a decision stream.
pub(super) fn too_large(file: &Path) -> DiffError {
    DiffError::BadInput {
        file: file.to_path_buf(),
        problem: format!(
            "not a JSONL decision stream, and over {MAX_ENVELOPE_BYTES} bytes, more than an \
             envelope is read; judge the record directory it came from"
        ),
    }
}

/// The offset of the first line that starts at or after `offset`.
pub(super) fn next_line_start(
    file: &Path,
    f: &File,
    offset: u64,
    len: u64,
) -> Result<u64, DiffError> {
    if offset == 0 {
        return Ok(0);
    }
    let mut buf = vec![0u8; 64 * 1024];
    let mut pos = offset - 1;
    while pos < len {
        let n = read_at(file, f, &mut buf, pos)?;
        if n == 0 {
            break;
        }
        if let Some(i) = memchr::memchr(b'\n', &buf[..n]) {
            return Ok(pos + i as u64 + 1);
        }
        pos += n as u64;
    }
    Ok(len)
}

/// Judges a JSONL stream read through `f`: the file is cut at line starts into one range per
/// core, each range read in reused blocks and judged on its own thread; the partial results
/// are merged in stream order with true line numbers.
pub(super) fn judge_stream(
    matcher: &Matcher<'_>,
    file: &Path,
    f: &File,
    tuning: Tuning,
) -> Result<Acc, DiffError> {
    let len = f.metadata().map_err(StoreError::io("stat", file))?.len();
    if len == 0 {
        // A file that says it is empty but holds lines (procfs, some FUSE mounts) would be
        // judged as no decisions at all.
        let mut one = [0u8; 1];
        let held = std::os::unix::fs::FileExt::read_at(f, &mut one, 0)
            .map_err(StoreError::io("read", file))?;
        if held > 0 {
            return Err(DiffError::BadInput {
                file: file.to_path_buf(),
                problem: "its size reads 0, yet it holds data (a file system that does not \
                          report sizes): judge a copy of it"
                    .into(),
            });
        }
    }
    let threads = if len < tuning.parallel_min {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, 8)
    };
    let mut bounds = vec![0u64];
    for i in 1..threads as u64 {
        let b = next_line_start(file, f, len * i / threads as u64, len)?;
        if b > *bounds.last().unwrap_or(&0) && b < len {
            bounds.push(b);
        }
    }
    bounds.push(len);
    let ranges: Vec<(u64, u64)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = ranges
            .iter()
            .map(|&(start, end)| {
                s.spawn(move || judge_range(matcher, file, f, (start, end), tuning.block))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(DiffError::BadInput {
                        file: file.to_path_buf(),
                        problem: "a diff worker thread panicked".into(),
                    })
                })
            })
            .collect::<Vec<_>>()
    });
    let mut acc = Acc::default();
    let mut line_offset = 0;
    for r in results {
        let part = r.map_err(|e| match e {
            DiffError::BadLine {
                file,
                line,
                problem,
            } => DiffError::BadLine {
                file,
                line: line + line_offset,
                problem,
            },
            other => other,
        })?;
        let mut judged = part.acc;
        judged.shift_lines(line_offset);
        line_offset += part.lines;
        acc.merge(judged);
        if part.torn {
            return Err(DiffError::BadLine {
                file: file.to_path_buf(),
                line: line_offset + 1,
                problem: "the last line has no newline (a torn write or a cut file); run `flowhost records verify`".into(),
            });
        }
    }
    Ok(acc)
}

pub(super) struct RangeResult {
    pub(super) acc: Acc,
    pub(super) lines: u64,
    pub(super) torn: bool,
}

/// Judges the lines starting in `[start, end)`, reading in reused blocks.
pub(super) fn judge_range(
    matcher: &Matcher<'_>,
    file: &Path,
    f: &File,
    (start, end): (u64, u64),
    block: usize,
) -> Result<RangeResult, DiffError> {
    let mut acc = Acc::default();
    let mut line = 0u64;
    let mut buf = vec![0u8; block.clamp(1, (end - start) as usize + 1)];
    // buf[..kept] holds the unjudged start of a line carried over from the previous block.
    let mut kept = 0usize;
    let mut pos = start;
    while pos < end {
        if kept == buf.len() {
            // One line longer than the buffer: grow it, up to a bound no decision comes
            // near (a file of one endless line is refused, not read into memory).
            if kept >= LONGEST_STREAM_LINE {
                return Err(DiffError::BadLine {
                    file: file.to_path_buf(),
                    line: line + 1,
                    problem: format!(
                        "over {LONGEST_STREAM_LINE} bytes without a newline: not one decision"
                    ),
                });
            }
            buf.resize(buf.len() * 2, 0);
        }
        let want = (buf.len() - kept).min((end - pos) as usize);
        let n = read_at(file, f, &mut buf[kept..kept + want], pos)?;
        if n == 0 {
            // The file was cut while being judged: what was past the cut went unjudged.
            return Err(DiffError::BadInput {
                file: file.to_path_buf(),
                problem: format!(
                    "the file ended at byte {pos} while being read, short of the {end} bytes it held: another process truncated it; judge a copy that is not being written"
                ),
            });
        }
        pos += n as u64;
        let filled = kept + n;
        let mut from = 0;
        for nl in memchr::memchr_iter(b'\n', &buf[..filled]) {
            line += 1;
            judge_line(matcher, file, &mut acc, &buf[from..nl], line)?;
            from = nl + 1;
        }
        buf.copy_within(from..filled, 0);
        kept = filled - from;
    }
    Ok(RangeResult {
        acc,
        lines: line,
        torn: kept > 0,
    })
}

pub(super) fn judge_line(
    matcher: &Matcher<'_>,
    file: &Path,
    acc: &mut Acc,
    text: &[u8],
    line: u64,
) -> Result<(), DiffError> {
    let bad = |problem: String| DiffError::BadLine {
        file: file.to_path_buf(),
        line,
        problem,
    };
    let d: ObsDecision<'_> = serde_json::from_slice(text).map_err(|e| bad(e.to_string()))?;
    let seq = d.flowhost.as_ref().and_then(|x| x.seq);
    let at = || ObservedRef {
        file: file.to_path_buf(),
        line: Some(line),
        index: None,
        seq,
    };
    acc.judge(matcher, &d, at).map_err(bad)
}

/// Judges flowhost records as the chain verifier decodes them, so a stream is read and
/// decoded once; what the judge makes of them is kept only if the stream verifies.
pub(super) struct Judging<'m, 'd> {
    pub(super) matcher: &'m Matcher<'d>,
    /// Whether to keep each record's chain link (a fleet's diff, which looks for one chain
    /// given as two hosts'; a single host's keeps nothing per record).
    pub(super) links: bool,
}

/// What [`Judging`] made of a run of records: the judged decisions, or the first line the
/// judge refused.
pub(super) struct JudgedRun {
    pub(super) acc: Acc,
    pub(super) error: Option<DiffError>,
    /// Each record's link to the record before it, when kept (see [`chain_link`]).
    pub(super) links: Vec<ChainLink>,
}

impl Gather for Judging<'_, '_> {
    type Part = JudgedRun;

    fn part(&self) -> JudgedRun {
        JudgedRun {
            acc: Acc::default(),
            error: None,
            links: Vec::new(),
        }
    }

    fn record(&self, part: &mut JudgedRun, record: &DecisionRecord, file: &Path, line: u64) {
        if part.error.is_some() {
            return;
        }
        if self.links {
            part.links.extend(chain_link(&record.flowhost.prev_hash));
        }
        let seq = Some(record.flowhost.seq);
        let at = || ObservedRef {
            file: file.to_path_buf(),
            line: Some(line),
            index: None,
            seq,
        };
        let d = ObsDecision::of_record(record);
        if let Err(problem) = part.acc.judge(self.matcher, &d, at) {
            part.error = Some(DiffError::BadLine {
                file: file.to_path_buf(),
                line,
                problem,
            });
        }
    }

    fn append(&self, into: &mut JudgedRun, mut next: JudgedRun, lines_before: u64) {
        if into.error.is_some() {
            return;
        }
        if let Some(DiffError::BadLine { line, .. }) = next.error.as_mut() {
            *line += lines_before;
        }
        next.acc.shift_lines(lines_before);
        into.acc.merge(next.acc);
        into.error = next.error;
        into.links.append(&mut next.links);
    }
}

/// Judges the decisions of an envelope already parsed strictly (see `read_envelope`).
pub(super) fn judge_envelope(
    matcher: &Matcher<'_>,
    file: &Path,
    envelope: &serde_json::Value,
) -> Result<Acc, DiffError> {
    let bad = |problem: String| DiffError::BadInput {
        file: file.to_path_buf(),
        problem,
    };
    let env = ObsEnvelope::deserialize(envelope).map_err(|e| {
        bad(format!(
            "not a valid {DECISION_SURFACE_SCHEMA} envelope: {e}"
        ))
    })?;
    if env.schema.0 != DECISION_SURFACE_SCHEMA {
        return Err(bad(format!(
            "schema is {:?}, expected {DECISION_SURFACE_SCHEMA:?}",
            env.schema.0
        )));
    }
    let mut acc = Acc::default();
    for (i, d) in env.observed_tool_decisions.iter().enumerate() {
        let seq = d.flowhost.as_ref().and_then(|x| x.seq);
        let at = || ObservedRef {
            file: file.to_path_buf(),
            line: None,
            index: Some(i as u64),
            seq,
        };
        acc.judge(matcher, d, at)
            .map_err(|p| bad(format!("observed_tool_decisions[{i}]: {p}")))?;
    }
    Ok(acc)
}
