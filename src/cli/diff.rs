//! `flowhost diff`: the declared-vs-observed gate.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::ValueEnum;

use super::CliResult;
use crate::diff::surface::DeclaredSurface;
use crate::diff::{DiffOptions, diff_sources, report};
use crate::records::health::ToolObservationHealth;

/// Report formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    /// One line per finding and a summary.
    Text,
    /// The `flowhost.diff.v1` JSON report.
    Json,
    /// SARIF 2.1.0, one result per finding.
    Sarif,
}

/// `flowhost diff --declared FILE --observed PATH... [--health FILE...] [--format ...]`
#[derive(Debug, clap::Args)]
pub(crate) struct DiffArgs {
    /// The declared surface (`assay.declared_tool_surface.v0`).
    #[arg(long)]
    declared: PathBuf,
    /// The observed decisions: a record directory, a JSONL record file, or an exported
    /// `assay.tool_decision_surface.v0` envelope. Give it several times to judge several
    /// sources together. Flowhost records among them must verify (hash chain, sequence, head
    /// anchor), or the result is "evidence rejected" (exit 4).
    #[arg(long, required = true)]
    observed: Vec<PathBuf>,
    /// The `tool_observation_health` carrier; without it observation counts as incomplete.
    /// For a fleet (one `--observed` record stream per host) give one per host: each pairs
    /// with the stream whose chain head it names, in any order, and the result is clean only
    /// if every host's observation is complete and bound to its records.
    #[arg(long)]
    health: Vec<PathBuf>,
    /// Decisions without the flowhost chain (seq, prev_hash) were produced by another
    /// observer: judge them without binding them to the flowhost health. Without it, such
    /// decisions make the result inconclusive (exit 3).
    #[arg(long)]
    unchained_from_other_observer: bool,
    /// The report format.
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

/// Runs the diff and prints the report. Exit codes by precedence: 2 usage or input error (or
/// the report not written);
/// 4 evidence rejected; 1 findings; 3 no findings but observation incomplete or not bound to
/// the records; 0 clean.
pub(crate) fn run(args: DiffArgs) -> CliResult {
    let text = std::fs::read_to_string(&args.declared)
        .map_err(|e| format!("cannot read {}: {e}", args.declared.display()))?;
    let declared =
        DeclaredSurface::parse(&text).map_err(|e| format!("{}: {e}", args.declared.display()))?;
    let health = args
        .health
        .iter()
        .map(|p| ToolObservationHealth::read_from(p))
        .collect::<Result<Vec<_>, _>>()?;
    let options = DiffOptions {
        unchained_from_other_observer: args.unchained_from_other_observer,
    };
    let result = match diff_sources(&declared, &args.observed, &health, options) {
        Err(crate::diff::DiffError::Store(e)) if e.rejects_the_evidence() => {
            note!(
                "flowhost: the observed records are rejected: {}",
                flowhost_broker::Escaped(&e)
            );
            return Ok(ExitCode::from(4));
        }
        other => other?,
    };
    let out = match args.format {
        Format::Text => report::to_text(&result),
        Format::Json => super::output::json_for_terminal(&report::to_json(&result)),
        Format::Sarif => super::output::json_for_terminal(&report::to_sarif(&result)),
    };
    out!("{out}")?;
    if !out.ends_with('\n') {
        out!("\n")?;
    }
    Ok(ExitCode::from(result.exit_code()))
}
