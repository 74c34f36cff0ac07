//! The observed surface flowhost exports: a verified record stream in the
//! `assay.tool_decision_surface.v0` envelope other tools read.

use std::io::{self, Write};
use std::path::PathBuf;

use serde_json::Value;

use super::DECISION_SURFACE_SCHEMA;
use super::chain::{ChainHash, VerifyReport, line_hash};
use super::store::{StoreError, split_lines};

/// The non-claims every exported surface carries.
pub const NON_CLAIMS: [&str; 3] = [
    "does not prove SaaS-side persistence without external audit evidence",
    "does not infer tool actions outside observed MCP proxy traffic",
    "does not expose raw secrets or tokens",
];

/// A problem exporting records.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The records could not be read.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The records read now are not the records verified: a line was changed, removed or
    /// added in between.
    #[error(
        "{}: line {line} is not the record verified before the export (the records changed \
         since); nothing is exported",
        file.display()
    )]
    Changed {
        /// The record file.
        file: PathBuf,
        /// The line (1-based) where the difference shows.
        line: u64,
    },
    /// The output could not be written.
    #[error("cannot write the surface: {0}")]
    Write(#[source] io::Error),
}

/// What links a line to the one before it.
#[derive(serde::Deserialize)]
struct Linked {
    flowhost: Link,
}

#[derive(serde::Deserialize)]
struct Link {
    prev_hash: String,
}

/// Writes the `assay.tool_decision_surface.v0` envelope of the records `verified` found
/// valid: `schema`, `observed_tool_decisions` (each complete record line, verbatim, flowhost
/// extension included; other readers ignore the extension) and [`NON_CLAIMS`]. Exactly the
/// lines verified are written, from the files verified: the files are read again, and every
/// line must link to the one before it and the last must hash to the verified chain head,
/// so a line changed, removed or added since the verification fails the export
/// ([`ExportError::Changed`]) instead of being exported as verified. A caller that must
/// not emit half an envelope writes to a temporary file first.
pub fn write_surface_envelope(
    verified: &VerifyReport,
    out: &mut dyn Write,
) -> Result<u64, ExportError> {
    let w = |r: io::Result<()>| r.map_err(ExportError::Write);
    w(write!(
        out,
        "{{\"schema\":\"{DECISION_SURFACE_SCHEMA}\",\"observed_tool_decisions\":["
    ))?;
    let mut n = 0u64;
    let mut prev: Option<ChainHash> = None;
    let mut last_at: Option<(PathBuf, u64)> = None;
    'files: for file in &verified.files {
        let bytes = crate::records::store::read_record_file(file)?;
        for (i, line) in split_lines(&bytes).0.enumerate() {
            if n == verified.records {
                break 'files;
            }
            let at = i as u64 + 1;
            let changed = || ExportError::Changed {
                file: file.clone(),
                line: at,
            };
            if let Some(prev) = &prev {
                let link: Linked = serde_json::from_slice(line).map_err(|_| changed())?;
                if link.flowhost.prev_hash != prev.as_str() {
                    return Err(changed());
                }
            }
            prev = Some(line_hash(line));
            last_at = Some((file.clone(), at));
            if n > 0 {
                w(out.write_all(b","))?;
            }
            w(out.write_all(b"\n"))?;
            w(out.write_all(line))?;
            n += 1;
        }
    }
    if n != verified.records || prev.as_ref() != verified.head_hash.as_ref() {
        let (file, line) =
            last_at.unwrap_or_else(|| (verified.files.first().cloned().unwrap_or_default(), 0));
        return Err(ExportError::Changed { file, line });
    }
    let claims = Value::Array(NON_CLAIMS.iter().map(|c| Value::from(*c)).collect());
    w(write!(out, "\n],\"non_claims\":{claims}}}\n"))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::chain::verify_records;
    use crate::records::{RecordWriter, WriterOptions};
    use serde_json::json;

    /// A record directory holding `n` records (the writer closed).
    fn records(n: usize) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let writer = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
        for _ in 0..n {
            writer
                .commit_blocking(crate::records::tests::sample_tool_call())
                .unwrap();
        }
        writer.close_blocking().unwrap();
        dir
    }

    fn export(verified: &VerifyReport) -> Result<Value, ExportError> {
        let mut out = Vec::new();
        write_surface_envelope(verified, &mut out)?;
        Ok(serde_json::from_slice(&out).unwrap())
    }

    #[test]
    fn envelope_wraps_the_verified_lines_verbatim() {
        let dir = records(3);
        let verified = verify_records(dir.path(), None).unwrap();
        assert!(verified.is_ok());
        let v = export(&verified).unwrap();
        assert_eq!(v["schema"], DECISION_SURFACE_SCHEMA);
        let lines: Vec<Value> = std::fs::read_to_string(&verified.files[0])
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(v["observed_tool_decisions"], json!(lines));
        assert_eq!(v["non_claims"], json!(NON_CLAIMS));
    }

    #[test]
    fn records_changed_after_their_verification_are_not_exported() {
        let dir = records(3);
        let verified = verify_records(dir.path(), None).unwrap();
        let file = verified.files[0].clone();
        let text = std::fs::read_to_string(&file).unwrap();
        // An edited line, a line appended, a line removed: each is refused.
        let edited = text.replacen("\"seq\":2", "\"seq\":2 ", 1);
        assert_ne!(edited, text);
        let mut appended = text.clone();
        appended.push_str(text.lines().last().unwrap());
        appended.push('\n');
        let removed: String = text.lines().take(2).map(|l| format!("{l}\n")).collect();
        for (what, changed) in [("edited", &edited), ("removed", &removed)] {
            std::fs::write(&file, changed).unwrap();
            let e = export(&verified).unwrap_err();
            assert!(matches!(e, ExportError::Changed { .. }), "{what}: {e}");
        }
        // Lines added after the verification are simply not part of the export.
        std::fs::write(&file, &appended).unwrap();
        let v = export(&verified).unwrap();
        assert_eq!(v["observed_tool_decisions"].as_array().unwrap().len(), 3);
    }
}
