//! `flowhost state`: the flow state's relation to the decision records.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliResult;

/// `flowhost state ...`
#[derive(Debug, clap::Subcommand)]
pub(crate) enum StateCommand {
    /// Rebuild every principal's and session's label from the decision records alone (stop
    /// the host first). Labels are joined into what `STATE_DIR/state.db` already holds, so a
    /// rebuild never lowers anything; the state is then bound to the records' head.
    Rebuild(RebuildArgs),
    /// Create or migrate the schema of the shared PostgreSQL flow state named by the host
    /// configuration's `[host] state` (run once per fleet before starting the hosts; safe to
    /// run again or from several hosts). A schema newer than this build is left untouched
    /// and reported (exit 2).
    Migrate(MigrateArgs),
}

/// `flowhost state migrate --config FILE`
#[derive(Debug, clap::Args)]
pub(crate) struct MigrateArgs {
    /// The host configuration (its `[host] state` names the database and the files holding
    /// its URL and password).
    #[arg(long)]
    config: PathBuf,
}

/// `flowhost state rebuild --records DIR --state-dir DIR`
#[derive(Debug, clap::Args)]
pub(crate) struct RebuildArgs {
    /// The record directory (its hash chain must verify).
    #[arg(long)]
    records: PathBuf,
    /// The host's state directory (`state.db` is created or raised there).
    #[arg(long)]
    state_dir: PathBuf,
}

impl StateCommand {
    /// Runs the subcommand: exit 0 rebuilt, 2 with the reason otherwise.
    pub(crate) fn run(self) -> CliResult {
        match self {
            StateCommand::Migrate(args) => {
                let config = crate::config::HostConfig::load(&args.config)?;
                let crate::config::StateConfig::Postgres(pg) = &config.state else {
                    outln!(
                        "{}: the flow state is the embedded SQLite file {}; it needs no migration",
                        args.config.display(),
                        config.state_dir.join(crate::daemon::STATE_FILE).display()
                    )?;
                    return Ok(ExitCode::SUCCESS);
                };
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                let report = runtime.block_on(crate::state::postgres::migrate(pg))?;
                match report.from {
                    None => outln!(
                        "{}: created flowhost schema version {}",
                        report.target,
                        report.to
                    )?,
                    Some(v) => outln!("{}: flowhost schema version {v} is current", report.target)?,
                }
                Ok(ExitCode::SUCCESS)
            }
            StateCommand::Rebuild(args) => {
                // Checked as the host checks it at start, an existing directory included.
                crate::daemon::prepare_state_dir(&args.state_dir)?;
                let db = args.state_dir.join(crate::daemon::STATE_FILE);
                // Records durable only in the write-ahead ring (a machine crash before their
                // file's checkpoint) are written back first, as the host does at start: a
                // rebuild that missed them could lower the labels they raised. The writer is
                // held open (its lock taken) while the records are read, so no host starts
                // writing to them meanwhile.
                let writer = if args.records.join(crate::records::RING_FILE).exists() {
                    Some(super::records::open_writer_saying_what_it_recovered(
                        &args.records,
                    )?)
                } else {
                    None
                };
                let report = crate::continuity::rebuild(&args.records, &db)?;
                if let Some(writer) = writer {
                    writer.close_blocking()?;
                }
                outln!(
                    "rebuilt {} from {} records in {}: {} principals, {} sessions, {} declassification grants marked spent; bound to record seq {}",
                    db.display(),
                    report.records,
                    args.records.display(),
                    report.principals,
                    report.sessions,
                    report.grants,
                    report
                        .head_seq
                        .map_or_else(|| "none".to_string(), |s| s.to_string())
                )?;
                Ok(ExitCode::SUCCESS)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rebuild writes the state the host will trust: into an existing directory that
    /// someone else could change it is refused, as the host refuses to start on one.
    #[test]
    fn rebuild_refuses_a_state_dir_others_could_change() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (records, state_dir) = (dir.path().join("records"), dir.path().join("state"));
        // A host's records directory, as a writer leaves it (its anchor, no record yet): one
        // with neither is refused before the state directory is looked at.
        crate::records::RecordWriter::open(&records, crate::records::WriterOptions::default())
            .unwrap()
            .close_blocking()
            .unwrap();
        std::fs::create_dir(&state_dir).unwrap();
        std::fs::set_permissions(&state_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let rebuild = || {
            StateCommand::Rebuild(RebuildArgs {
                records: records.clone(),
                state_dir: state_dir.clone(),
            })
            .run()
        };
        let err = rebuild().unwrap_err().to_string();
        assert!(
            err.contains(&state_dir.display().to_string()) && err.contains("group or others"),
            "{err}"
        );
        assert!(!state_dir.join(crate::daemon::STATE_FILE).exists());
        std::fs::set_permissions(&state_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        rebuild().unwrap();
    }
}
