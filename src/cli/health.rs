//! `flowhost health`: the record side of `tool_observation_health`, computed offline, or a
//! carrier already written, in either shape.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliResult;
use crate::records::health::{ToolObservationHealth, offline_health};

/// `flowhost health --records DIR | --from FILE [--out FILE] [--shape SHAPE]`
#[derive(Debug, clap::Args)]
pub(crate) struct HealthArgs {
    /// The record directory (or file) to summarise.
    #[arg(long, conflicts_with = "from", required_unless_present = "from")]
    records: Option<PathBuf>,
    /// A health carrier already written (either shape; the daemon's `health_file`, say), to
    /// write again in `--shape`: read and checked as any reader does, derived again, and
    /// otherwise unchanged.
    #[arg(long)]
    from: Option<PathBuf>,
    /// Write the carrier here (atomically) instead of standard output.
    #[arg(long)]
    out: Option<PathBuf>,
    /// The carrier's shape: flowhost's `tool_observation_health`, or assay's runner
    /// `observation_health` (with the flowhost carrier inside).
    #[arg(long, value_enum, default_value = "flowhost")]
    shape: Shape,
}

/// Health carrier shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Shape {
    /// `flowhost.tool_observation_health.v0`.
    Flowhost,
    /// `assay.runner.observation_health.v0`.
    Assay,
}

/// Prints or writes the offline health: sequence range, chain head and verification status,
/// with the daemon-only fields unknown (so it is never complete). Exit 0 when produced (even
/// when incomplete: the carrier says so), 2 on usage or I/O errors.
pub(crate) fn run(args: HealthArgs) -> CliResult {
    let health = match (&args.from, &args.records) {
        (Some(from), _) => ToolObservationHealth::read_from(from)?,
        (None, Some(records)) => offline_health(records)?,
        (None, None) => {
            // clap requires one of them: this is only the type's other case.
            return Err("flowhost health needs --records DIR or --from FILE".into());
        }
    };
    let text = super::output::json_for_terminal(&match args.shape {
        Shape::Flowhost => health.to_json(),
        Shape::Assay => serde_json::to_string_pretty(&health.to_assay())?,
    });
    match args.out {
        Some(path) => crate::files::write_atomic(&path, format!("{text}\n").as_bytes(), 0o644)?,
        None => outln!("{text}")?,
    }
    Ok(ExitCode::SUCCESS)
}
