//! The observed surface flowhost exports: a verified record stream in the
//! `assay.tool_decision_surface.v0` envelope other tools read.

use std::io::{self, Write};
use std::path::Path;

use serde_json::Value;

use super::DECISION_SURFACE_SCHEMA;
use super::store::{StoreError, record_sources, split_lines};

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
    /// The output could not be written.
    #[error("cannot write the surface: {0}")]
    Write(#[source] io::Error),
}

/// Writes the `assay.tool_decision_surface.v0` envelope of the records at `records` (a
/// directory or file): `schema`, `observed_tool_decisions` (each complete record line,
/// verbatim, flowhost extension included; other readers ignore the extension) and
/// [`NON_CLAIMS`]. Call it only on records that verified; a torn last line is not exported.
pub fn write_surface_envelope(records: &Path, out: &mut dyn Write) -> Result<u64, ExportError> {
    let w = |r: io::Result<()>| r.map_err(ExportError::Write);
    w(write!(
        out,
        "{{\"schema\":\"{DECISION_SURFACE_SCHEMA}\",\"observed_tool_decisions\":["
    ))?;
    let mut n = 0u64;
    for file in record_sources(records)? {
        let bytes = std::fs::read(&file).map_err(StoreError::io("read", &file))?;
        for line in split_lines(&bytes).0 {
            if n > 0 {
                w(out.write_all(b","))?;
            }
            w(out.write_all(b"\n"))?;
            w(out.write_all(line))?;
            n += 1;
        }
    }
    let claims = Value::Array(NON_CLAIMS.iter().map(|c| Value::from(*c)).collect());
    w(write!(out, "\n],\"non_claims\":{claims}}}\n"))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn envelope_wraps_record_lines_verbatim() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        std::fs::write(&path, "{\"a\":1}\n{\"b\":2}\n{\"torn\"").unwrap();
        let mut out = Vec::new();
        assert_eq!(write_surface_envelope(&path, &mut out).unwrap(), 2);
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["schema"], DECISION_SURFACE_SCHEMA);
        assert_eq!(v["observed_tool_decisions"], json!([{"a": 1}, {"b": 2}]));
        assert_eq!(v["non_claims"], json!(NON_CLAIMS));
    }
}
