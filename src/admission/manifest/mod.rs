//! Signed tool manifests (README, "Manifests and keys"; docs/ARCHITECTURE.md, "Data path").
//!
//! A manifest body (`flowhost.manifest.v1`) names a server, its publisher's public key and
//! its tools. The publisher signs the RFC 8785 canonical bytes of the body with Ed25519; the
//! envelope [`SignedManifest`] carries the body as signed, the signature and the signer's key.
//!
//! Every value of the types here is valid: they are built only by strict decoding
//! ([`ManifestBody::from_json_value`], [`SignedManifest::parse`]), which rejects duplicate
//! keys, unknown fields, an explicit `null` for an optional field, and every rule below, each
//! with its own [`ManifestError`] variant naming the field (for example
//! `tools[2].description is 612 characters; the limit is 500`).
//!
//! Body fields: `schema` (exactly `flowhost.manifest.v1`), `server_id`, `name`, `version`
//! (each 1 to 256 bytes, no surrounding whitespace, no control character), optional
//! `description` (at most 500 characters), `public_key` (64 lowercase hex digits; must be the
//! signer's key), `tools` (non-empty, names unique), optional `resources` and `prompts`
//! (see [`ResourceDefinition`] and [`PromptDefinition`]; an empty list is refused, leave
//! the field out). See [`ToolDefinition`] for a tool.

mod content;
mod decode;
mod envelope;
mod sanitize;

use std::fmt;
use std::str::FromStr;

use ed25519_dalek::VerifyingKey;
use serde::ser::{SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::flow::ToolFlowDeclaration;

pub(crate) use content::one_spelling;
pub use content::{
    ContentFlow, MAX_CLIENT_URI_BYTES, MAX_URI_BYTES, PromptArgument, PromptDefinition,
    ResourceDefinition, ResourceLocator, UnroutableUri, UriTemplate,
};
pub use decode::ManifestError;
pub(crate) use decode::{decode_annotations, decode_flow, json_type};
pub(crate) use envelope::pretty;
pub use envelope::{
    ManifestFileError, SignError, SignedManifest, VerifyError, load_body_file, load_envelope_file,
};
pub use sanitize::sanitize_for_client;

/// The schema string of a manifest body this host reads.
pub const MANIFEST_SCHEMA: &str = "flowhost.manifest.v1";
/// Longest tool (or manifest) description accepted, in characters (Unicode scalar values).
pub const MAX_DESCRIPTION_CHARS: usize = 500;

/// A verified-shape manifest body: what the publisher signed, decoded and checked.
#[derive(Clone, PartialEq, Eq)]
pub struct ManifestBody {
    server_id: String,
    name: String,
    description: Option<String>,
    version: String,
    public_key: VerifyingKey,
    tools: Vec<ToolDefinition>,
    resources: Vec<ResourceDefinition>,
    prompts: Vec<PromptDefinition>,
}

impl ManifestBody {
    /// The server this manifest describes; unique within a registry.
    pub fn server_id(&self) -> &str {
        &self.server_id
    }

    /// The human-readable name of the server.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The description as signed (may contain terminal escapes; see
    /// [`ManifestBody::sanitized_description`]).
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// The description with control characters and escape sequences removed, safe to show.
    pub fn sanitized_description(&self) -> Option<String> {
        self.description.as_deref().map(sanitize_for_client)
    }

    /// The publisher's version string.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The public key embedded in the body (equal to the signer's key in a verified envelope).
    pub fn public_key(&self) -> &VerifyingKey {
        &self.public_key
    }

    /// The tools, in the order the publisher listed them (never empty, names unique).
    pub fn tools(&self) -> &[ToolDefinition] {
        &self.tools
    }

    /// The tool named `name`, if the manifest has one.
    pub fn tool(&self, name: &str) -> Option<&ToolDefinition> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// The resources and resource templates, in signed order (URIs and templates unique).
    pub fn resources(&self) -> &[ResourceDefinition] {
        &self.resources
    }

    /// The prompts, in signed order (names unique).
    pub fn prompts(&self) -> &[PromptDefinition] {
        &self.prompts
    }

    /// The prompt named `name`, if the manifest has one.
    pub fn prompt(&self, name: &str) -> Option<&PromptDefinition> {
        self.prompts.iter().find(|p| p.name() == name)
    }

    /// The resource a read of `uri` is served by: a resource with exactly that URI first,
    /// else the one template that expands to it. Refused when `uri` is not in the one
    /// spelling URIs are routed in, and when two templates expand to it.
    pub fn resource_for(&self, uri: &str) -> Result<&ResourceDefinition, UnroutableUri> {
        if let Some(reason) = content::uri_fault(uri) {
            return Err(UnroutableUri::Spelling {
                uri: uri.to_owned(),
                reason,
            });
        }
        if let Some(exact) = self
            .resources
            .iter()
            .find(|r| matches!(r.locator(), ResourceLocator::Uri(u) if u == uri))
        {
            return Ok(exact);
        }
        let mut templates = self.resources.iter().filter(|r| r.locator().matches(uri));
        match (templates.next(), templates.next()) {
            (Some(one), None) => Ok(one),
            (Some(first), Some(second)) => Err(UnroutableUri::Ambiguous {
                uri: uri.to_owned(),
                server_id: self.server_id.clone(),
                first: first.locator().as_str().to_owned(),
                second: second.locator().as_str().to_owned(),
            }),
            (None, _) => Err(UnroutableUri::NotSigned {
                uri: uri.to_owned(),
            }),
        }
    }

    /// Whether any tool carries a flow declaration (even a public one): such a manifest is
    /// only served with flow mediation.
    pub fn requires_flow_runtime(&self) -> bool {
        self.tools.iter().any(|t| t.flow.is_some())
    }
}

impl fmt::Debug for ManifestBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManifestBody")
            .field("server_id", &self.server_id)
            .field("version", &self.version)
            .field("tools", &self.tools.len())
            .finish_non_exhaustive()
    }
}

impl Serialize for ManifestBody {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("ManifestBody", 9)?;
        s.serialize_field("schema", MANIFEST_SCHEMA)?;
        s.serialize_field("server_id", &self.server_id)?;
        s.serialize_field("name", &self.name)?;
        if let Some(description) = &self.description {
            s.serialize_field("description", description)?;
        }
        s.serialize_field("version", &self.version)?;
        s.serialize_field(
            "public_key",
            &crate::keys::public_key_to_hex(&self.public_key),
        )?;
        s.serialize_field("tools", &self.tools)?;
        if !self.resources.is_empty() {
            s.serialize_field("resources", &self.resources)?;
        }
        if !self.prompts.is_empty() {
            s.serialize_field("prompts", &self.prompts)?;
        }
        s.end()
    }
}

/// One tool of a manifest.
///
/// Wire fields: `name` (1 to 256 bytes, no surrounding whitespace, no control character,
/// unique in the manifest), optional `title` (a display name, at most 500 characters),
/// `description` (at most 500 characters), `input_schema` (a JSON
/// Schema object the call arguments are validated against), optional `output_schema`
/// (object), optional `pricing` ([`Pricing`]), `annotations` ([`ToolAnnotations`], four
/// flags required, `open_world` optional), optional `latency_hint` ([`LatencyHint`]), optional `flow`
/// ([`ToolFlowDeclaration`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolDefinition {
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    title: Option<String>,
    description: String,
    input_schema: Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output_schema: Option<Map<String, Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pricing: Option<Pricing>,
    annotations: ToolAnnotations,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_hint: Option<LatencyHint>,
    #[serde(skip_serializing_if = "Option::is_none")]
    flow: Option<ToolFlowDeclaration>,
}

impl ToolDefinition {
    /// The tool's name, unique within its manifest.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The display title as signed, if declared (may contain control characters; see
    /// [`sanitize_for_client`]).
    pub fn title(&self) -> Option<&str> {
        self.title.as_deref()
    }

    /// The description as signed (may contain terminal escapes or control characters).
    pub fn description(&self) -> &str {
        &self.description
    }

    /// The description as a client may see it: escape sequences and control characters
    /// removed (see [`sanitize_for_client`]).
    pub fn sanitized_description(&self) -> String {
        sanitize_for_client(&self.description)
    }

    /// The JSON Schema for the call arguments (always an object).
    pub fn input_schema(&self) -> &Map<String, Value> {
        &self.input_schema
    }

    /// The JSON Schema of the output, if declared.
    pub fn output_schema(&self) -> Option<&Map<String, Value>> {
        self.output_schema.as_ref()
    }

    /// The price, if declared.
    pub fn pricing(&self) -> Option<&Pricing> {
        self.pricing.as_ref()
    }

    /// The behaviour flags.
    pub fn annotations(&self) -> &ToolAnnotations {
        &self.annotations
    }

    /// The expected latency class, if declared.
    pub fn latency_hint(&self) -> Option<LatencyHint> {
        self.latency_hint
    }

    /// The publisher's flow declaration, if any.
    pub fn flow(&self) -> Option<&ToolFlowDeclaration> {
        self.flow.as_ref()
    }

    /// Compiles the input schema, and the output schema if declared, into validators that
    /// check `format` too, strictly (a value a schema calls an `email` or a `date-time` must
    /// be one, the latter with its offset, as RFC 3339 writes it). No remote or file `$ref`
    /// is ever fetched, so a schema that needs one does not compile. A schema whose
    /// subschemas apply to one value in a cycle compiles and validates in bounded depth
    /// (the validator stops at a cycle).
    pub fn compile_schemas(&self) -> Result<CompiledSchemas, SchemaCompileError> {
        Ok(CompiledSchemas {
            input: compile_schema("input_schema", &self.input_schema)?,
            output: match &self.output_schema {
                Some(schema) => Some(compile_schema("output_schema", schema)?),
                None => None,
            },
        })
    }
}

/// A tool's schemas as validators.
pub struct CompiledSchemas {
    /// What the call's arguments must match.
    pub input: jsonschema::Validator,
    /// What a result's `structuredContent` must match, if the tool declares it.
    pub output: Option<jsonschema::Validator>,
}

fn compile_schema(
    field: &'static str,
    schema: &Map<String, Value>,
) -> Result<jsonschema::Validator, SchemaCompileError> {
    jsonschema::options()
        .should_validate_formats(true)
        .build(&Value::Object(schema.clone()))
        .map_err(|e| SchemaCompileError {
            field,
            reason: e.to_string(),
        })
}

/// Why one of a tool's schemas is not a usable JSON Schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} is not a usable JSON Schema: {reason}")]
pub struct SchemaCompileError {
    /// The schema's field in the manifest (`input_schema`, `output_schema`).
    pub field: &'static str,
    /// The compiler's description.
    pub reason: String,
}

/// Behaviour flags a publisher states for a tool. The first four are required on the wire;
/// `open_world` is optional.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub struct ToolAnnotations {
    /// The tool only reads.
    pub read_only: bool,
    /// The tool may destroy or overwrite data.
    pub destructive: bool,
    /// Repeating a call with the same arguments has no further effect.
    pub idempotent: bool,
    /// A person must approve each call.
    pub requires_approval: bool,
    /// The tool reaches an open world of entities (the web, other systems) rather than a
    /// closed one; undeclared when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub open_world: Option<bool>,
}

/// Expected latency class of a call: `instant`, `fast`, `moderate` or `slow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LatencyHint {
    /// Answers without noticeable delay.
    Instant,
    /// Answers within about a second.
    Fast,
    /// Takes seconds.
    Moderate,
    /// Takes long enough that a client should show progress.
    Slow,
}

impl LatencyHint {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            LatencyHint::Instant => "instant",
            LatencyHint::Fast => "fast",
            LatencyHint::Moderate => "moderate",
            LatencyHint::Slow => "slow",
        }
    }
}

/// What a call costs, as the publisher declares it.
///
/// Wire form, an object tagged by `model`:
/// * `{"model": "free"}`;
/// * `{"model": "per_call", "amount": "0.002", "currency": "EUR"}`: every call costs `amount`;
/// * `{"model": "per_unit", "amount": "0.5", "currency": "USD", "unit": "1k tokens"}`:
///   `amount` per `unit` consumed.
///
/// `amount` is a decimal string (digits, optionally a point and more digits, no sign, no
/// exponent, no leading zeros, at most 40 characters) so that no price is ever rounded
/// through a binary float; `currency` is an ISO 4217 alphabetic code (three uppercase ASCII
/// letters; the code list itself is not checked); `unit` follows the identifier rule (1 to
/// 256 bytes, no surrounding whitespace, no control character). A field that does not apply
/// to the model (an `amount` on `free`, a `unit` on `per_call`) is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "model", rename_all = "snake_case")]
pub enum Pricing {
    /// No charge.
    Free,
    /// A fixed amount per call.
    PerCall {
        /// The price of one call.
        amount: DecimalAmount,
        /// Its currency.
        currency: CurrencyCode,
    },
    /// An amount per unit consumed.
    PerUnit {
        /// The price of one unit.
        amount: DecimalAmount,
        /// Its currency.
        currency: CurrencyCode,
        /// What one unit is (for example `1k tokens`).
        unit: String,
    },
}

/// A non-negative decimal amount kept as text (see [`Pricing`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct DecimalAmount(String);

impl DecimalAmount {
    /// Longest amount accepted, in characters.
    pub const MAX_LEN: usize = 40;

    /// Checks the decimal form (see [`Pricing`]).
    pub fn new(text: &str) -> Option<Self> {
        let (whole, fraction) = match text.split_once('.') {
            Some((w, f)) => (w, Some(f)),
            None => (text, None),
        };
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        let ok = text.len() <= Self::MAX_LEN
            && digits(whole)
            && (whole == "0" || !whole.starts_with('0'))
            && fraction.is_none_or(digits);
        ok.then(|| DecimalAmount(text.to_owned()))
    }

    /// The amount as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An ISO 4217 alphabetic currency code: three uppercase ASCII letters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct CurrencyCode(String);

impl CurrencyCode {
    /// Checks the form (three uppercase ASCII letters).
    pub fn new(text: &str) -> Option<Self> {
        (text.len() == 3 && text.bytes().all(|b| b.is_ascii_uppercase()))
            .then(|| CurrencyCode(text.to_owned()))
    }

    /// The code as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `sha256:<64 lowercase hex>` of a manifest body's canonical bytes: names exactly one
/// signed body, whatever its whitespace or key order on disk.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ManifestDigest([u8; 32]);

impl ManifestDigest {
    /// The digest of canonical body bytes.
    pub fn of_canonical_bytes(bytes: &[u8]) -> Self {
        ManifestDigest(Sha256::digest(bytes).into())
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for ManifestDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl fmt::Debug for ManifestDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Why a text is not a manifest digest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("manifest digest {0:?} is not `sha256:` followed by 64 lowercase hex digits")]
pub struct DigestParseError(String);

impl FromStr for ManifestDigest {
    type Err = DigestParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.strip_prefix("sha256:")
            .and_then(|hex| crate::keys::decode_lower_hex::<32>("digest", hex).ok())
            .map(ManifestDigest)
            .ok_or_else(|| DigestParseError(s.to_owned()))
    }
}

impl Serialize for ManifestDigest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ManifestDigest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests;
