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
    /// The hash of the call's source label (`flowhost/session` given the call's tool name
    /// and arguments returns it as `source_label_hash`).
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
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        let issued_at = issued_at(a.not_before, now)?;
        let grant_id = match a.grant_id {
            Some(id) => id,
            None => random_grant_id(&mut rand_core::OsRng)?,
        };
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
            None => out!("{text}")?,
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// When a grant becomes valid: `--not-before`, else now (whole seconds since 1970).
fn issued_at(
    not_before: Option<u64>,
    now: Result<std::time::Duration, std::time::SystemTimeError>,
) -> Result<u64, SignError> {
    match not_before {
        Some(at) => Ok(at),
        None => now
            .map(|d| d.as_secs())
            .map_err(|_| SignError::ClockBefore1970),
    }
}

/// A grant id of 32 random hex digits drawn from `rng`; a source that fails is an error
/// (`fill_bytes` would panic).
fn random_grant_id(rng: &mut impl rand_core::RngCore) -> Result<String, SignError> {
    let mut bytes = [0u8; 16];
    rng.try_fill_bytes(&mut bytes).map_err(SignError::Random)?;
    Ok(hex::encode(bytes))
}

/// Why this machine could not sign a grant.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SignError {
    /// The clock reads before 1970: "now" cannot be dated.
    #[error(
        "the system clock reads before 1970, so the grant's issued_at cannot be now; set the clock, or give --not-before"
    )]
    ClockBefore1970,
    /// The operating system's random source failed.
    #[error(
        "the operating system's random source failed, so no grant id could be drawn ({0}); give one with --grant-id"
    )]
    Random(rand_core::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    /// A random source that always fails (as the operating system's may).
    struct Broken;

    impl rand_core::RngCore for Broken {
        fn next_u32(&mut self) -> u32 {
            panic!("the random source failed")
        }
        fn next_u64(&mut self) -> u64 {
            panic!("the random source failed")
        }
        fn fill_bytes(&mut self, _: &mut [u8]) {
            panic!("the random source failed")
        }
        fn try_fill_bytes(&mut self, _: &mut [u8]) -> Result<(), rand_core::Error> {
            Err(std::num::NonZeroU32::new(rand_core::Error::CUSTOM_START)
                .expect("nonzero")
                .into())
        }
    }

    #[test]
    fn a_failed_random_source_is_an_error_not_a_panic() {
        let e = random_grant_id(&mut Broken).unwrap_err();
        assert!(e.to_string().contains("--grant-id"), "{e}");
        let id = random_grant_id(&mut rand_core::OsRng).unwrap();
        assert_eq!(id.len(), 32);
    }

    #[test]
    fn a_clock_before_1970_is_an_error_unless_not_before_is_given() {
        let before = UNIX_EPOCH.duration_since(UNIX_EPOCH + Duration::from_secs(5));
        assert!(before.is_err());
        let e = issued_at(None, before.clone()).unwrap_err();
        assert!(e.to_string().contains("before 1970"), "{e}");
        assert_eq!(issued_at(Some(7), before).unwrap(), 7);
        let now = SystemTime::now().duration_since(UNIX_EPOCH);
        assert!(issued_at(None, now).unwrap() > 0);
    }
}
