//! `flowhost manifest`: signing, verifying, digesting and converting tool manifests.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Subcommand;
use serde_json::Value;

use super::{CliResult, report};
use crate::canonical::{self, JsonPath};
use crate::files::{self, MAX_MANIFEST_FILE_BYTES};
use crate::keys;
use crate::manifest::{
    ManifestBody, ManifestDigest, ManifestError, ManifestFileError, SchemaCompileError, SignError,
    SignedManifest, VerifyError, load_body_file, load_envelope_file, pretty,
};
use crate::openapi::{self, ExportAction, ManifestIdentity, OpenApiError};

/// Mode of the files these commands write: signed manifests and bodies are not secret.
const OUTPUT_MODE: u32 = 0o644;

/// Manifest subcommands.
#[derive(Debug, Subcommand)]
pub enum ManifestCommand {
    /// Sign a manifest body with a private key and write the signed envelope (atomically).
    /// Prints the manifest digest.
    Sign(SignArgs),
    /// Verify a signed manifest against the publisher key the operator trusts. Exits 0 when
    /// it verifies, 1 with the reason when it does not.
    Verify(VerifyArgs),
    /// Print the digest (`sha256:<hex>` of the canonical body) of a manifest body or of a
    /// signed manifest.
    Digest(DigestArgs),
    /// Make a manifest body from an OpenAPI 3 document: one tool per operation, named by its
    /// operationId, with its `x-chio-flow` or `x-flowhost-flow` as the tool's flow
    /// declaration (both must agree; any other `x-*-flow` key is refused).
    // `--version` here is the manifest's version, so the global version flag is off.
    #[command(disable_version_flag = true)]
    FromOpenapi(FromOpenapiArgs),
    /// Write each signed tool's flow declaration into its operation, under the extension
    /// name the document already uses (else `x-chio-flow`), replacing an existing one and
    /// removing it where the tool declares none.
    ExportOpenapi(ExportOpenapiArgs),
}

/// Arguments of `flowhost manifest sign`.
#[derive(Debug, clap::Args)]
pub struct SignArgs {
    /// The private key file (mode 0600).
    #[arg(long, value_name = "KEY")]
    key: PathBuf,
    /// The manifest body to sign (JSON).
    #[arg(long, value_name = "BODY.json")]
    manifest: PathBuf,
    /// Where to write the signed envelope (replaced atomically if it exists).
    #[arg(long, value_name = "ENVELOPE.json")]
    out: PathBuf,
}

/// Arguments of `flowhost manifest verify`.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// The publisher's public key: 64 hex digits, or a public key file.
    #[arg(long, value_name = "PUBHEX|FILE")]
    key: String,
    /// The signed envelope.
    #[arg(value_name = "ENVELOPE.json")]
    envelope: PathBuf,
}

/// Arguments of `flowhost manifest digest`.
#[derive(Debug, clap::Args)]
pub struct DigestArgs {
    /// A manifest body or a signed envelope.
    #[arg(value_name = "FILE")]
    file: PathBuf,
}

/// Arguments of `flowhost manifest from-openapi`.
#[derive(Debug, clap::Args)]
pub struct FromOpenapiArgs {
    /// The OpenAPI 3 document (JSON).
    #[arg(value_name = "OPENAPI.json")]
    openapi: PathBuf,
    /// The manifest's server_id.
    #[arg(long)]
    server_id: String,
    /// The manifest's name.
    #[arg(long)]
    name: String,
    /// The manifest's version.
    #[arg(long)]
    version: String,
    /// An optional description of the server.
    #[arg(long)]
    description: Option<String>,
    /// The public key that will sign the body: 64 hex digits, or a public key file.
    #[arg(long, value_name = "PUBHEX|FILE")]
    public_key: String,
    /// Where to write the manifest body (replaced atomically if it exists).
    #[arg(long, value_name = "BODY.json")]
    out: PathBuf,
}

/// Arguments of `flowhost manifest export-openapi`.
#[derive(Debug, clap::Args)]
pub struct ExportOpenapiArgs {
    /// The signed manifest whose declarations are exported.
    #[arg(long, value_name = "SIGNED.json")]
    envelope: PathBuf,
    /// The publisher's public key the envelope must verify against: 64 hex digits, or a
    /// public key file.
    #[arg(long, value_name = "PUBHEX|FILE")]
    key: String,
    /// The OpenAPI 3 document to update (read only; the result goes to --out).
    #[arg(value_name = "OPENAPI.json")]
    openapi: PathBuf,
    /// Where to write the updated document (replaced atomically if it exists).
    #[arg(long, value_name = "OUT.json")]
    out: PathBuf,
}

/// Why a manifest command failed, naming the file involved.
#[derive(Debug, thiserror::Error)]
pub enum ManifestCommandError {
    /// The body could not be signed.
    #[error("{}: {reason}", file.display())]
    Sign {
        /// The body file.
        file: PathBuf,
        /// Why.
        reason: SignError,
    },
    /// A tool's input or output schema does not compile, so no host would admit the
    /// manifest.
    #[error("{}: tool {tool:?}: {reason}", file.display())]
    Schema {
        /// The body file.
        file: PathBuf,
        /// The tool.
        tool: String,
        /// The compiler's description.
        reason: SchemaCompileError,
    },
    /// The envelope did not verify.
    #[error("{}: {reason}", file.display())]
    Verify {
        /// The envelope file.
        file: PathBuf,
        /// Why.
        reason: VerifyError,
    },
    /// The signed envelope, as written, would be larger than any host reads.
    #[error(
        "{}: the signed envelope would be {size} bytes, over the {limit} a host reads; \
         make the manifest smaller (its schemas, descriptions)",
        file.display()
    )]
    TooLarge {
        /// The body file.
        file: PathBuf,
        /// The envelope's size as written.
        size: usize,
        /// The most a host reads.
        limit: u64,
    },
    /// The OpenAPI document could not be converted or updated.
    #[error("{}: {reason}", file.display())]
    OpenApi {
        /// The OpenAPI document.
        file: PathBuf,
        /// Why.
        reason: OpenApiError,
    },
}

impl ManifestCommand {
    /// Runs the subcommand.
    pub fn run(self) -> CliResult {
        match self {
            ManifestCommand::Sign(args) => sign(args),
            ManifestCommand::Verify(args) => verify(args),
            ManifestCommand::Digest(args) => digest(args),
            ManifestCommand::FromOpenapi(args) => from_openapi(args),
            ManifestCommand::ExportOpenapi(args) => export_openapi(args),
        }
    }
}

fn count_tools(n: usize) -> String {
    format!("{n} {}", if n == 1 { "tool" } else { "tools" })
}

fn sign(args: SignArgs) -> CliResult {
    let key = keys::load_signing_key(&args.key)?;
    let (body, body_json) = load_body_file(&args.manifest)?;
    // Refused here rather than at every host that would later refuse to admit it.
    for tool in body.tools() {
        tool.compile_schemas()
            .map_err(|reason| ManifestCommandError::Schema {
                file: args.manifest.clone(),
                tool: tool.name().to_owned(),
                reason,
            })?;
    }
    let signed =
        SignedManifest::sign(body_json, &key).map_err(|reason| ManifestCommandError::Sign {
            file: args.manifest.clone(),
            reason,
        })?;
    let text = signed.to_pretty_json();
    // Indented, a deeply nested body grows well past its own size: refused here rather
    // than by every host that would load it.
    if u64::try_from(text.len()).map_or(true, |n| n > MAX_MANIFEST_FILE_BYTES) {
        return Err(ManifestCommandError::TooLarge {
            file: args.manifest.clone(),
            size: text.len(),
            limit: MAX_MANIFEST_FILE_BYTES,
        }
        .into());
    }
    // What is written is what hosts will read: read back as they read it.
    crate::manifest::SignedManifest::parse(&text).map_err(|reason| {
        format!(
            "{}: the signed envelope would not load back: {reason}",
            args.manifest.display()
        )
    })?;
    files::write_atomic(&args.out, text.as_bytes(), OUTPUT_MODE)?;
    note!(
        "signed {} ({}) into {}",
        signed.body().server_id(),
        count_tools(signed.body().tools().len()),
        args.out.display()
    );
    outln!("{}", signed.digest())?;
    Ok(ExitCode::SUCCESS)
}

/// Loads and verifies an envelope against `key`.
fn verified(path: &Path, key: &ed25519_dalek::VerifyingKey) -> CliResult<SignedManifest> {
    let envelope = load_envelope_file(path)?;
    envelope
        .verify(key)
        .map_err(|reason| ManifestCommandError::Verify {
            file: path.to_owned(),
            reason,
        })?;
    Ok(envelope)
}

fn verify(args: VerifyArgs) -> CliResult {
    // A key that cannot be read is a usage error (exit 2), not a verdict on the envelope.
    let key = keys::verifying_key_from_arg(&args.key)?;
    match verified(&args.envelope, &key) {
        Ok(envelope) => {
            let body = envelope.body();
            outln!(
                "verified: server {} version {}, {}, {}",
                body.server_id(),
                body.version(),
                count_tools(body.tools().len()),
                envelope.digest()
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            report(error.as_ref());
            Ok(ExitCode::from(1))
        }
    }
}

fn digest(args: DigestArgs) -> CliResult {
    let invalid = |reason: ManifestError| ManifestFileError::Invalid {
        file: args.file.clone(),
        reason,
    };
    let text = files::read_text(&args.file, MAX_MANIFEST_FILE_BYTES)?;
    let value = canonical::parse_strict(&text).map_err(|e| invalid(e.into()))?;
    // An envelope has a `manifest` member; a body has a `schema` member instead.
    let digest = if value.get("manifest").is_some() {
        SignedManifest::from_json_value(value, &JsonPath::root())
            .map_err(invalid)?
            .digest()
    } else {
        ManifestBody::from_json_value(&value, &JsonPath::root()).map_err(invalid)?;
        let bytes = canonical::canonical_bytes(&value).map_err(|e| invalid(e.into()))?;
        ManifestDigest::of_canonical_bytes(&bytes)
    };
    outln!("{digest}")?;
    Ok(ExitCode::SUCCESS)
}

fn from_openapi(args: FromOpenapiArgs) -> CliResult {
    let identity = ManifestIdentity {
        server_id: args.server_id,
        name: args.name,
        description: args.description,
        version: args.version,
        public_key: keys::verifying_key_from_arg(&args.public_key)?,
    };
    let doc = openapi::load_openapi_file(&args.openapi)?;
    let body = openapi::manifest_from_openapi(&doc, &identity).map_err(|reason| {
        ManifestCommandError::OpenApi {
            file: args.openapi.clone(),
            reason,
        }
    })?;
    files::write_atomic(&args.out, pretty(&body).as_bytes(), OUTPUT_MODE)?;
    let tools = body["tools"].as_array().map_or(0, Vec::len);
    note!("wrote {} ({})", args.out.display(), count_tools(tools));
    for not in openapi::contracts_not_carried(&doc) {
        note!("not carried into the manifest: {} ({})", not.at, not.why);
    }
    Ok(ExitCode::SUCCESS)
}

fn export_openapi(args: ExportOpenapiArgs) -> CliResult {
    let key = keys::verifying_key_from_arg(&args.key)?;
    let envelope = verified(&args.envelope, &key)?;
    let mut doc: Value = openapi::load_openapi_file(&args.openapi)?;
    let actions =
        openapi::export_flow_declarations(&mut doc, envelope.body()).map_err(|reason| {
            ManifestCommandError::OpenApi {
                file: args.openapi.clone(),
                reason,
            }
        })?;
    files::write_atomic(&args.out, pretty(&doc).as_bytes(), OUTPUT_MODE)?;
    for (tool, action) in actions {
        let what = match action {
            ExportAction::Added => "declaration added",
            ExportAction::Replaced => "declaration replaced",
            ExportAction::Unchanged => "declaration unchanged",
            ExportAction::Removed => "declaration removed (the tool declares none)",
            ExportAction::Absent => "no declaration",
        };
        note!("{tool}: {what}");
    }
    note!("wrote {}", args.out.display());
    Ok(ExitCode::SUCCESS)
}
