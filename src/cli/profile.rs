//! `flowhost profile check FILE`: validate an execution profile.

use std::path::PathBuf;
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
    /// Load and validate a profile file and compile its seccomp program; errors name the
    /// file and the field.
    Check {
        /// The profile file (`NAME.toml`).
        file: PathBuf,
    },
}

impl ProfileArgs {
    /// Runs the subcommand.
    pub fn run(self) -> CliResult {
        let ProfileCommand::Check { file } = self.command;
        let profile = Profile::load(&file)?;
        let program = filter::compile(&profile)?;
        let families: Vec<String> = profile
            .socket_families
            .iter()
            .map(|f| format!("{f:?}").to_lowercase())
            .collect();
        println!(
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
        );
        Ok(ExitCode::SUCCESS)
    }
}
