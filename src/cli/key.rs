//! `flowhost key`: manifest signing keys.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use super::CliResult;
use crate::keys;

/// Key subcommands.
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Generate an Ed25519 key pair: DIR/NAME.key (private, mode 0600, never overwritten)
    /// and DIR/NAME.pub (public key as hex). Prints the public key.
    Generate(GenerateArgs),
}

/// Arguments of `flowhost key generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Directory for the key files (created with mode 0700 if missing).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Base name of the key files: letters, digits, '.', '_' and '-', not starting with '.'.
    #[arg(long, default_value = "signing")]
    name: String,
}

/// Why a key command was refused before doing anything.
#[derive(Debug, thiserror::Error)]
pub enum KeyCommandError {
    /// A key name that could escape the output directory or hide the file.
    #[error(
        "key name {0:?} is not allowed; use letters, digits, '.', '_' and '-', not starting with '.'"
    )]
    InvalidName(String),
}

impl KeyCommand {
    /// Runs the subcommand.
    pub fn run(self) -> CliResult {
        match self {
            KeyCommand::Generate(args) => generate(args),
        }
    }
}

fn generate(args: GenerateArgs) -> CliResult {
    let valid = !args.name.is_empty()
        && !args.name.starts_with('.')
        && args
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !valid {
        return Err(KeyCommandError::InvalidName(args.name).into());
    }
    let key = keys::generate(&args.out, &args.name)?;
    note!(
        "wrote {} (private key, mode 0600)",
        key.private_path.display()
    );
    note!("wrote {} (public key)", key.public_path.display());
    outln!("{}", keys::public_key_to_hex(&key.verifying_key))?;
    Ok(ExitCode::SUCCESS)
}
