//! The gate: one run's decision records and health judged against a declared surface by the
//! same diff as `flowhost diff`. Clean only when nothing was observed that the surface does
//! not declare, the records verify, and the health says observation was complete and is
//! bound to exactly those records.

use std::path::Path;

use super::HarnessError;
use crate::diff::surface::DeclaredSurface;
use crate::diff::{DiffReport, Verdict, diff};
use crate::records::ToolObservationHealth;

/// Reads and validates the declared surface (`assay.declared_tool_surface.v0`) at `path`.
pub fn load_surface(path: &Path) -> Result<DeclaredSurface, HarnessError> {
    let text = std::fs::read_to_string(path).map_err(|source| HarnessError::Io {
        what: format!("cannot read the declared surface {}", path.display()),
        source,
    })?;
    DeclaredSurface::parse(&text).map_err(|e| HarnessError::Surface {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Judges the records in `records` (a record directory) with `health` against `surface`.
pub fn judge(
    surface: &DeclaredSurface,
    records: &Path,
    health: &ToolObservationHealth,
) -> Result<DiffReport, HarnessError> {
    Ok(diff(surface, records, Some(health))?)
}

/// Whether the gate passes: only a clean verdict does (findings, an incomplete or unbound
/// observation and rejected evidence all fail it).
pub fn passes(report: &DiffReport) -> bool {
    report.verdict == Verdict::Clean
}
