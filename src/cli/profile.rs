//! `flowhost profile check FILE...`: validate execution profiles.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use flowhost_broker::{NetworkPath, Profile, filter};

use super::CliResult;

/// Execution profiles.
#[derive(Debug, clap::Args)]
pub struct ProfileArgs {
    #[command(subcommand)]
    command: ProfileCommand,
}

#[derive(Debug, clap::Subcommand)]
enum ProfileCommand {
    /// Load and validate profile files and compile their seccomp programs; errors name the
    /// file and the field. Every file is checked; exit 2 if any is invalid.
    Check {
        /// The profile files (`NAME.toml`), e.g. `/etc/flowhost/profiles/*.toml`.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

impl ProfileArgs {
    /// Runs the subcommand.
    pub fn run(self) -> CliResult {
        let ProfileCommand::Check { files } = self.command;
        let mut invalid = 0;
        for file in &files {
            if let Err(e) = check(file) {
                // Not the file's fault: stdout took no more, and no later file's could go.
                if e.is::<super::output::OutputError>() {
                    return Err(e);
                }
                super::report(e.as_ref());
                invalid += 1;
            }
        }
        if invalid > 0 {
            note!(
                "flowhost: {invalid} of {} profile files are invalid",
                files.len()
            );
            return Ok(ExitCode::from(2));
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// Checks one profile file and prints what it allows.
fn check(file: &Path) -> CliResult<()> {
    let profile = Profile::load(file)?;
    let program = filter::compile(&profile)?;
    let families: Vec<String> = profile
        .socket_families
        .iter()
        .map(|f| format!("{f:?}").to_lowercase())
        .collect();
    outln!(
        "{}: profile {:?} is valid: network {}, socket families [{}], landlock {:?}, seccomp program of {} instructions",
        file.display(),
        profile.name,
        match profile.network {
            NetworkPath::None => "none (empty network namespace)",
            NetworkPath::Host => "host (every attempt mediated)",
        },
        families.join(", "),
        profile.landlock,
        program.len()
    )?;
    Ok(())
}
