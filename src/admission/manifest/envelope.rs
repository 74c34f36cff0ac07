//! The signed envelope: signing, verification, digests and manifest files.

use std::fmt;
use std::path::{Path, PathBuf};

use ed25519_dalek::{SIGNATURE_LENGTH, Signature, Signer, SigningKey, VerifyingKey};
use serde_json::{Map, Value};

use super::decode::{Fields, ManifestError};
use super::{ManifestBody, ManifestDigest};
use crate::canonical::{self, JsonPath};
use crate::files::{self, FileError, MAX_MANIFEST_FILE_BYTES};
use crate::keys::{decode_lower_hex, public_key_from_hex, public_key_to_hex};

const ENVELOPE_FIELDS: &[&str] = &["manifest", "signature", "signer_key"];

/// A manifest body with its Ed25519 signature and the signer's public key.
///
/// Wire form: `{"manifest": {...}, "signature": "<128 hex>", "signer_key": "<64 hex>"}`,
/// unknown fields rejected. The signature covers the RFC 8785 canonical bytes of `manifest`
/// exactly as received, so any change to the body (the `flow` block included) invalidates
/// it. A parsed envelope is well-formed but not yet trusted: only
/// [`SignedManifest::verify`] against the key the operator registered makes it so.
#[derive(Clone)]
pub struct SignedManifest {
    body: ManifestBody,
    /// The body as received; re-serialized unchanged so the signature keeps verifying.
    body_json: Value,
    canonical_body: Vec<u8>,
    signature: Signature,
    signer_key: VerifyingKey,
}

/// Why an envelope failed verification.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// The body's `public_key` is not the key that signed it.
    #[error(
        "server {server_id:?}: the manifest's public_key {embedded} differs from the envelope's signer_key {signer}"
    )]
    PublicKeyMismatch {
        /// The manifest's server.
        server_id: String,
        /// The body's `public_key`.
        embedded: String,
        /// The envelope's `signer_key`.
        signer: String,
    },
    /// The envelope was signed by a key other than the one the operator registered.
    #[error(
        "server {server_id:?}: signed by {signer}, but the key registered for it is {registered}"
    )]
    SignerNotRegistered {
        /// The manifest's server.
        server_id: String,
        /// The envelope's `signer_key`.
        signer: String,
        /// The operator's key.
        registered: String,
    },
    /// The signature does not verify over the canonical body bytes.
    #[error(
        "server {server_id:?}: the signature does not verify over the manifest body; the body was changed after signing or the signature is corrupt"
    )]
    BadSignature {
        /// The manifest's server.
        server_id: String,
    },
}

/// Why a body could not be signed.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    /// The body is not a valid manifest.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The body's `public_key` is not the signing key's public key.
    #[error(
        "the manifest's public_key is {embedded} but the signing key's public key is {signer}; set public_key to {signer} or sign with the matching key"
    )]
    PublicKeyNotSigner {
        /// The body's `public_key`.
        embedded: String,
        /// The signing key's public key.
        signer: String,
    },
}

impl SignedManifest {
    /// Signs a body given as parsed JSON: checks it as [`ManifestBody::from_json_value`] does,
    /// checks that its `public_key` belongs to `key`, and signs its canonical bytes.
    pub fn sign(body_json: Value, key: &SigningKey) -> Result<Self, SignError> {
        let body = ManifestBody::from_json_value(&body_json, &JsonPath::root())?;
        let signer_key = key.verifying_key();
        if body.public_key != signer_key {
            return Err(SignError::PublicKeyNotSigner {
                embedded: public_key_to_hex(&body.public_key),
                signer: public_key_to_hex(&signer_key),
            });
        }
        let canonical_body = canonical::canonical_bytes(&body_json).map_err(ManifestError::from)?;
        let signature = key.sign(&canonical_body);
        Ok(SignedManifest {
            body,
            body_json,
            canonical_body,
            signature,
            signer_key,
        })
    }

    /// Parses an envelope from strict JSON text (duplicate keys, unknown fields and every
    /// body rule are checked; the signature is not).
    pub fn parse(text: &str) -> Result<Self, ManifestError> {
        let value = canonical::parse_strict(text)?;
        Self::from_json_value(value, &JsonPath::root())
    }

    /// Decodes an envelope from parsed JSON; `at` locates it in error paths.
    pub fn from_json_value(value: Value, at: &JsonPath) -> Result<Self, ManifestError> {
        let fields = Fields::new(&value, at, ENVELOPE_FIELDS)?;
        let signature_text = fields.required_str("signature")?;
        let signature_bytes = decode_lower_hex::<SIGNATURE_LENGTH>("signature", signature_text)
            .map_err(|reason| ManifestError::InvalidSignatureEncoding {
                path: fields.path("signature"),
                reason,
            })?;
        let signer_key = public_key_from_hex("signer_key", fields.required_str("signer_key")?)
            .map_err(|reason| ManifestError::InvalidPublicKey {
                path: fields.path("signer_key"),
                reason,
            })?;
        fields.required("manifest")?;
        let manifest_path = fields.path("manifest");
        let Value::Object(mut envelope) = value else {
            // Fields::new accepted `value`, so it is an object; kept as an error, not a panic.
            return Err(ManifestError::MissingField {
                path: at.clone(),
                field: "manifest",
            });
        };
        let body_json = envelope.remove("manifest").unwrap_or(Value::Null);
        let body = ManifestBody::from_json_value(&body_json, &manifest_path)?;
        let canonical_body = canonical::canonical_bytes(&body_json)?;
        Ok(SignedManifest {
            body,
            body_json,
            canonical_body,
            signature: Signature::from_bytes(&signature_bytes),
            signer_key,
        })
    }

    /// Checks the envelope against the key the operator registered for this server, in this
    /// order: the body's `public_key` is the `signer_key`; the `signer_key` is the registered
    /// key; the signature verifies (strict Ed25519: no malleable signatures, no weak keys)
    /// over the canonical body bytes with the registered key.
    pub fn verify(&self, registered_key: &VerifyingKey) -> Result<(), VerifyError> {
        let server_id = || self.body.server_id.clone();
        if self.body.public_key != self.signer_key {
            return Err(VerifyError::PublicKeyMismatch {
                server_id: server_id(),
                embedded: public_key_to_hex(&self.body.public_key),
                signer: public_key_to_hex(&self.signer_key),
            });
        }
        if self.signer_key != *registered_key {
            return Err(VerifyError::SignerNotRegistered {
                server_id: server_id(),
                signer: public_key_to_hex(&self.signer_key),
                registered: public_key_to_hex(registered_key),
            });
        }
        registered_key
            .verify_strict(&self.canonical_body, &self.signature)
            .map_err(|_| VerifyError::BadSignature {
                server_id: server_id(),
            })
    }

    /// The decoded body.
    pub fn body(&self) -> &ManifestBody {
        &self.body
    }

    /// The body exactly as signed.
    pub fn body_json(&self) -> &Value {
        &self.body_json
    }

    /// The RFC 8785 canonical bytes of the body: what the signature covers.
    pub fn canonical_body(&self) -> &[u8] {
        &self.canonical_body
    }

    /// The signature.
    pub fn signature(&self) -> &Signature {
        &self.signature
    }

    /// The key the envelope says signed it (trusted only after [`SignedManifest::verify`]).
    pub fn signer_key(&self) -> &VerifyingKey {
        &self.signer_key
    }

    /// `sha256:<hex>` of the canonical body bytes.
    pub fn digest(&self) -> ManifestDigest {
        ManifestDigest::of_canonical_bytes(&self.canonical_body)
    }

    /// The envelope as JSON, with the body exactly as signed.
    pub fn to_json_value(&self) -> Value {
        let mut envelope = Map::new();
        envelope.insert("manifest".into(), self.body_json.clone());
        envelope.insert(
            "signature".into(),
            Value::String(hex::encode(self.signature.to_bytes())),
        );
        envelope.insert(
            "signer_key".into(),
            Value::String(public_key_to_hex(&self.signer_key)),
        );
        Value::Object(envelope)
    }

    /// The envelope as indented JSON text with a final newline (deterministic: the same
    /// envelope always gives the same bytes).
    pub fn to_pretty_json(&self) -> String {
        pretty(&self.to_json_value())
    }
}

/// Indented JSON text of a value with a final newline.
pub(crate) fn pretty(value: &Value) -> String {
    // A serde_json::Value always serializes (string keys, finite numbers).
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    text
}

impl fmt::Debug for SignedManifest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignedManifest")
            .field("server_id", &self.body.server_id)
            .field("digest", &self.digest())
            .field("signer_key", &public_key_to_hex(&self.signer_key))
            .finish_non_exhaustive()
    }
}

/// Why a manifest or envelope file was refused; the message starts with the file name.
#[derive(Debug, thiserror::Error)]
pub enum ManifestFileError {
    /// The file could not be read (missing, a symlink, too large, not UTF-8, ...).
    #[error(transparent)]
    File(#[from] FileError),
    /// The content is not a valid manifest or envelope.
    #[error("{}: {reason}", file.display())]
    Invalid {
        /// The file.
        file: PathBuf,
        /// What is wrong with it.
        reason: ManifestError,
    },
}

impl ManifestFileError {
    /// The content error, when the file was read but its content refused.
    pub fn manifest_error(&self) -> Option<&ManifestError> {
        match self {
            ManifestFileError::Invalid { reason, .. } => Some(reason),
            ManifestFileError::File(_) => None,
        }
    }
}

fn read_manifest_text(path: &Path) -> Result<String, FileError> {
    files::read_text(path, MAX_MANIFEST_FILE_BYTES)
}

/// Loads an envelope file: opened without following a symlink, a regular file of at most
/// 1 MiB of UTF-8, then parsed strictly (the signature is not checked).
pub fn load_envelope_file(path: &Path) -> Result<SignedManifest, ManifestFileError> {
    let text = read_manifest_text(path)?;
    let invalid = |reason| ManifestFileError::Invalid {
        file: path.to_owned(),
        reason,
    };
    let value = canonical::parse_strict(&text).map_err(|e| invalid(e.into()))?;
    if let Some(body) = value.get("manifest") {
        super::decode::check_depth(body, &JsonPath::root().key("manifest")).map_err(invalid)?;
    }
    SignedManifest::from_json_value(value, &JsonPath::root()).map_err(invalid)
}

/// Loads a manifest body file under the same rules; returns the decoded body and the JSON
/// exactly as written (what a signature will cover).
pub fn load_body_file(path: &Path) -> Result<(ManifestBody, Value), ManifestFileError> {
    let text = read_manifest_text(path)?;
    let invalid = |reason| ManifestFileError::Invalid {
        file: path.to_owned(),
        reason,
    };
    let value = canonical::parse_strict(&text).map_err(|e| invalid(e.into()))?;
    super::decode::check_depth(&value, &JsonPath::root()).map_err(invalid)?;
    let body = ManifestBody::from_json_value(&value, &JsonPath::root()).map_err(invalid)?;
    Ok((body, value))
}
