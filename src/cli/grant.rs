//! `flowhost grant`: declassification grants.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliResult;
use crate::grant::{GRANT_SCHEMA, GrantBody, SignedGrant, arguments_hash};

/// `flowhost grant ...`
#[derive(Debug, clap::Subcommand)]
pub(crate) enum GrantCommand {
    /// Sign a declassification grant for one call (see README, "Declassification grants").
    Sign(SignArgs),
}

/// `flowhost grant sign ...`
#[derive(Debug, clap::Args)]
pub(crate) struct SignArgs {
    /// The authority's private key file (from `flowhost key generate`).
    #[arg(long)]
    key: PathBuf,
    /// The authority id the operator configured for that key.
    #[arg(long)]
    authority: String,
    /// The principal the call comes from.
    #[arg(long)]
    principal: String,
    /// The session the call comes from (`flowhost/session` tells a client its id).
    #[arg(long)]
    session: String,
    /// The server of the call.
    #[arg(long)]
    server: String,
    /// The tool of the call.
    #[arg(long)]
    tool: String,
    /// The declassification purpose.
    #[arg(long)]
    purpose: String,
    /// A file holding the call's arguments (a JSON object), exactly as the call will send
    /// them.
    #[arg(long)]
    arguments: PathBuf,
    /// The `label_hash` of the session's label (`flowhost/session` returns it).
    #[arg(long)]
    source_label_hash: String,
    /// A file holding the target label (JSON).
    #[arg(long)]
    target_label: PathBuf,
    /// How long the grant is valid, in seconds, from now (or from --not-before).
    #[arg(long, default_value_t = 600)]
    valid_for: u64,
    /// When the grant becomes valid (Unix seconds; default now).
    #[arg(long)]
    not_before: Option<u64>,
    /// The grant's id (default: 32 random hex digits).
    #[arg(long)]
    grant_id: Option<String>,
    /// Write the envelope here (atomically) instead of standard output.
    #[arg(long)]
    out: Option<PathBuf>,
}

impl GrantCommand {
    /// Runs the subcommand: exit 0 signed, 2 with the reason otherwise.
    pub(crate) fn run(self) -> CliResult {
        let GrantCommand::Sign(a) = self;
        let read =
            |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
        let arguments = crate::canonical::parse_strict(&read(&a.arguments)?)
            .map_err(|e| format!("{}: {e}", a.arguments.display()))?;
        if !arguments.is_object() {
            return Err(format!(
                "{}: the arguments must be a JSON object",
                a.arguments.display()
            )
            .into());
        }
        let target = crate::label::InformationLabel::from_json(&read(&a.target_label)?)
            .map_err(|e| format!("{}: {e}", a.target_label.display()))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let issued_at = a.not_before.unwrap_or(now);
        let grant_id = a.grant_id.unwrap_or_else(|| {
            use rand_core::RngCore;
            let mut bytes = [0u8; 16];
            rand_core::OsRng.fill_bytes(&mut bytes);
            hex::encode(bytes)
        });
        let body = GrantBody {
            schema: GRANT_SCHEMA.to_string(),
            grant_id,
            authority: a.authority,
            principal: crate::ident::PrincipalId::new(&a.principal)
                .map_err(|e| format!("--principal: {e}"))?,
            session: a.session,
            server: a.server,
            tool: a.tool,
            purpose: crate::ident::DeclassificationPurpose::new(&a.purpose)
                .map_err(|e| format!("--purpose: {e}"))?,
            arguments_hash: arguments_hash(&arguments).ok_or(
                "--arguments: an integer beyond ±2^53 cannot be bound exactly; write it as a string",
            )?,
            source_label_hash: a.source_label_hash,
            target_label: target,
            issued_at,
            expires_at: issued_at.saturating_add(a.valid_for),
        };
        let key = crate::keys::load_signing_key(&a.key)?;
        let signed = SignedGrant::sign(body, &key)?;
        let text = format!("{}\n", serde_json::to_string_pretty(&signed.to_value())?);
        match a.out {
            Some(path) => crate::files::write_atomic(&path, text.as_bytes(), 0o600)?,
            None => print!("{text}"),
        }
        Ok(ExitCode::SUCCESS)
    }
}
