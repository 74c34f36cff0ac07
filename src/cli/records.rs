//! `flowhost records`: export the observed surface, verify the chain, replay the ring.

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Subcommand;

use super::CliResult;
use crate::files::write_atomic_with;
use crate::records::chain::{VerifyReport, verify_records};
use crate::records::export::write_surface_envelope;

/// `flowhost records ...`
#[derive(Debug, Subcommand)]
pub(crate) enum RecordsCommand {
    /// Export verified records as an `assay.tool_decision_surface.v0` envelope (`schema`,
    /// `observed_tool_decisions`, `non_claims`). Exit 0 written; 1 the records do not verify
    /// (nothing written); 2 usage or I/O error.
    Export {
        /// Export the decision surface envelope (the only export format).
        #[arg(long, required = true)]
        surface: bool,
        /// A record directory or a single record file.
        records: PathBuf,
        /// Write here (atomically) instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Verify sequence continuity and the hash chain across rotated files, and the head
    /// anchor. Reports deleted lines (gaps), edited lines, torn or truncated files with file and
    /// line. Exit 0 intact; 1 problems found; 2 usage or I/O error.
    Verify {
        /// A record directory (its `records.head` is used) or a single record file.
        records: PathBuf,
        /// A head anchor to check against instead of the directory's `records.head`.
        #[arg(long)]
        head: Option<PathBuf>,
    },
    /// Copy the records a crash left durable only in a directory's write-ahead ring into its
    /// record files, as the host does when it opens the directory (until then, `verify`,
    /// `export`, `diff` and `health` refuse the directory). Exit 0 done (also when there was
    /// nothing to copy); 2 the directory has no ring, is in use, or cannot be repaired.
    Replay {
        /// A record directory.
        records: PathBuf,
    },
}

pub(crate) fn run(cmd: RecordsCommand) -> CliResult {
    match cmd {
        RecordsCommand::Export {
            surface: _,
            records,
            out,
        } => {
            let report = match verify_records(&records, None) {
                Err(e) if e.rejects_the_evidence() => {
                    note!(
                        "flowhost: {} does not verify; nothing exported: {}",
                        records.display(),
                        flowhost_broker::Escaped(&e)
                    );
                    return Ok(ExitCode::from(1));
                }
                other => other?,
            };
            // An empty surface exported from nothing would pass for a run that decided
            // nothing.
            if report.holds_no_evidence() {
                note!(
                    "flowhost: {} holds no record and no head anchor: nothing exported",
                    flowhost_broker::Escaped(&records.display().to_string())
                );
                return Ok(ExitCode::from(1));
            }
            if !report.is_ok() {
                // On stderr: stdout is where the export goes, and nothing is exported.
                note!(
                    "flowhost: {} does not verify; nothing exported:",
                    records.display()
                );
                for p in &report.problems {
                    note!("{}", flowhost_broker::Escaped(p));
                }
                return Ok(ExitCode::from(1));
            }
            if let Some(why) = crate::records::chain::unvouched_end(&records, &report) {
                note!(
                    "flowhost: {}; nothing exported",
                    flowhost_broker::Escaped(&why)
                );
                return Ok(ExitCode::from(1));
            }
            match out {
                Some(path) => {
                    let mut result = Ok(0);
                    let written = write_atomic_with(&path, 0o644, |w| {
                        result = write_surface_envelope(&report, w);
                        result
                            .as_ref()
                            .map(|_| ())
                            .map_err(|e| std::io::Error::other(e.to_string()))
                    });
                    // The export's own error names the record file; the output file's
                    // error only says the output was left as it was.
                    let n = result?;
                    written?;
                    note!("wrote {n} decisions to {}", path.display());
                }
                None => {
                    // Written whole to a temporary file first: stdout gets the envelope
                    // complete, or nothing.
                    let mut temp = tempfile::tempfile()?;
                    let mut buffered = std::io::BufWriter::new(&mut temp);
                    write_surface_envelope(&report, &mut buffered)?;
                    buffered.flush()?;
                    drop(buffered);
                    temp.seek(std::io::SeekFrom::Start(0))?;
                    let mut lock = std::io::stdout().lock();
                    if std::io::IsTerminal::is_terminal(&lock) {
                        // Shown, not kept: a line holds what executors and files said, so
                        // what a terminal acts on goes escaped (the same JSON values; a
                        // pipe or `--out` keeps the bytes the chain hashes).
                        super::output::copy_json_for_terminal(
                            &mut std::io::BufReader::new(temp),
                            &mut lock,
                        )?;
                        return Ok(ExitCode::SUCCESS);
                    }
                    let mut chunk = vec![0u8; 64 * 1024];
                    loop {
                        // A read error is the temporary file's; only a write is stdout's.
                        let n = match temp.read(&mut chunk) {
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            other => other?,
                        };
                        if n == 0 {
                            break;
                        }
                        lock.write_all(&chunk[..n])
                            .map_err(super::output::OutputError)?;
                    }
                    lock.flush().map_err(super::output::OutputError)?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        RecordsCommand::Replay { records } => replay(&records),
        RecordsCommand::Verify { records, head } => {
            let report = match verify_records(&records, head.as_deref()) {
                // Problems, as those the chain's own checks find (on stderr: the report's
                // lines are not there to hold it).
                Err(e) if e.rejects_the_evidence() => {
                    note!(
                        "flowhost: {} does not verify: {}",
                        records.display(),
                        flowhost_broker::Escaped(&e)
                    );
                    return Ok(ExitCode::from(1));
                }
                other => other?,
            };
            for note in &report.notes {
                outln!("note: {}", flowhost_broker::Escaped(note))?;
            }
            // Nothing verified is no intact record (problems found are reported as such,
            // below).
            if report.holds_no_evidence() {
                note!(
                    "flowhost: {} holds no record and no head anchor: nothing to verify",
                    flowhost_broker::Escaped(&records.display().to_string())
                );
                return Ok(ExitCode::from(1));
            }
            // Problems found come first (which file and line); the end no one vouches for
            // is said of records that otherwise verify.
            if let Some(why) =
                crate::records::chain::unvouched_end(&records, &report).filter(|_| report.is_ok())
            {
                note!("flowhost: {}", flowhost_broker::Escaped(&why));
                return Ok(ExitCode::from(1));
            }
            if report.is_ok() {
                outln!(
                    "ok: {} records in {} files, seq {}, chain head {}{}",
                    report.records,
                    report.files.len(),
                    match (report.first_seq, report.last_seq) {
                        (Some(a), Some(b)) => format!("{a}..={b}"),
                        _ => "(none)".into(),
                    },
                    report.head_hash.as_ref().map_or("(none)", |h| h.as_str()),
                    match &report.head_anchor {
                        Some(a) => format!(", head anchor at seq {} matches", a.seq),
                        None =>
                            ", no head anchor (truncation of whole trailing lines is not checked)"
                                .into(),
                    }
                )?;
                Ok(ExitCode::SUCCESS)
            } else {
                print_problems(&report)?;
                outln!(
                    "{} problems in {} records",
                    report.problems.len(),
                    report.records
                )?;
                Ok(ExitCode::from(1))
            }
        }
    }
}

/// Opens a writer on `dir` (which replays its ring and sets torn tails aside) and prints each
/// tail it set aside, so an offline command never moves bytes without saying where.
pub(super) fn open_writer_saying_what_it_recovered(
    dir: &Path,
) -> CliResult<crate::records::RecordWriter> {
    let writer = crate::records::RecordWriter::open(dir, crate::records::WriterOptions::default())?;
    // On stderr, whatever stdout is: the only notice of bytes already moved, never lost
    // to a stdout that refuses it, and never the reason the writer is not closed.
    for torn in writer.recovered() {
        note!(
            "{}: {} bytes past its last durable record moved to {}",
            torn.file.display(),
            torn.bytes,
            torn.sidecar.display()
        );
    }
    Ok(writer)
}

/// Opens `dir` with a writer (which replays its ring) and closes it, saying what it copied.
fn replay(dir: &Path) -> CliResult {
    if !dir.join(crate::records::RING_FILE).exists() {
        // A ring a writer kept and that is gone is not "nothing to replay".
        crate::records::store::refuse_lost_ring(dir)?;
        return Err(format!(
            "{}: no write-ahead ring ({}) here; nothing to replay",
            dir.display(),
            crate::records::RING_FILE
        )
        .into());
    }
    // Read before the writer opens: its open is what copies them in.
    let files: Vec<std::path::PathBuf> = crate::records::store::record_files_on_disk(dir)?
        .into_iter()
        .map(|f| f.path)
        .collect();
    let missing = crate::records::ring::unreplayed(dir, &files)?;
    let writer = open_writer_saying_what_it_recovered(dir)?;
    let status = writer.close_blocking()?;
    match missing {
        Some(crate::records::ring::Unreplayed::Missing { first, last }) => outln!(
            "{}: records {first} to {last} copied from the write-ahead ring into the record files; the stream ends at record {}",
            dir.display(),
            status.last_seq.unwrap_or(0)
        )?,
        Some(crate::records::ring::Unreplayed::Uncommitted { .. }) | None => outln!(
            "{}: the record files already held every durable record; the stream ends at record {}",
            dir.display(),
            status.last_seq.unwrap_or(0)
        )?,
    }
    Ok(ExitCode::SUCCESS)
}

fn print_problems(report: &VerifyReport) -> Result<(), super::output::OutputError> {
    // What a problem quotes of a hostile file (a decoder's words about a field or value)
    // must not drive the terminal.
    for p in &report.problems {
        outln!("{}", flowhost_broker::Escaped(p))?;
    }
    Ok(())
}
