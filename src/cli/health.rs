//! `flowhost health`: the record side of `tool_observation_health`, computed offline.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliResult;
use crate::records::health::offline_health;

/// `flowhost health --records DIR [--out FILE]`
#[derive(Debug, clap::Args)]
pub(crate) struct HealthArgs {
    /// The record directory (or file) to summarise.
    #[arg(long)]
    records: PathBuf,
    /// Write the carrier here (atomically) instead of standard output.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Prints or writes the offline health: sequence range, chain head and verification status,
/// with the daemon-only fields unknown (so it is never complete). Exit 0 when produced (even
/// when incomplete: the carrier says so), 2 on usage or I/O errors.
pub(crate) fn run(args: HealthArgs) -> CliResult {
    let health = offline_health(&args.records)?;
    match args.out {
        Some(path) => health.write_to(&path)?,
        None => println!("{}", health.to_json()),
    }
    Ok(ExitCode::SUCCESS)
}
