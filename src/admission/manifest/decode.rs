//! Strict decoding of manifest bodies from parsed JSON, one error variant per rule.
//!
//! Decoding works on a [`serde_json::Value`] that [`crate::canonical::parse_strict`] has
//! already checked for duplicate keys, and walks it field by field, so that each problem is
//! reported with its own variant and the path of the field at fault.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::content::decode_list;
use super::{
    CurrencyCode, DecimalAmount, LatencyHint, MANIFEST_SCHEMA, MAX_DESCRIPTION_CHARS, ManifestBody,
    Pricing, PromptDefinition, ResourceDefinition, ToolAnnotations, ToolDefinition,
};
use crate::canonical::{CanonicalError, JsonError, JsonPath};
use crate::flow::{FlowDecodeError, ToolFlowDeclaration, ToolFlowError};
use crate::ident::{IdentifierError, validate_identifier};
use crate::keys::{KeyError, public_key_from_hex};

/// Why a manifest body or envelope is refused before any signature is checked.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not strict JSON: a syntax error, a duplicate key or an inexact integer.
    #[error(transparent)]
    Json(#[from] JsonError),
    /// The body nests deeper than a host can read it back (see [`MAX_BODY_DEPTH`]).
    #[error("{path}: nests {depth} levels deep; a manifest may nest at most {limit}")]
    TooDeep {
        /// The body.
        path: JsonPath,
        /// How deep it nests.
        depth: usize,
        /// The most it may.
        limit: usize,
    },
    /// A value of the wrong JSON type.
    #[error("{path}: expected {expected}, found {found}")]
    WrongType {
        /// The field at fault.
        path: JsonPath,
        /// What the field must hold.
        expected: &'static str,
        /// What it holds.
        found: &'static str,
    },
    /// A field this format does not define.
    #[error("{path}: unknown field {field:?}; the fields are {}", allowed.join(", "))]
    UnknownField {
        /// The object holding the field.
        path: JsonPath,
        /// The unknown field.
        field: String,
        /// The fields the object may have.
        allowed: &'static [&'static str],
    },
    /// A required field is absent.
    #[error("{path}: missing field {field:?}")]
    MissingField {
        /// The object missing the field.
        path: JsonPath,
        /// The missing field.
        field: &'static str,
    },
    /// An optional field written as `null`.
    #[error("{path} is null; leave an optional field out instead of writing null")]
    NullField {
        /// The field.
        path: JsonPath,
    },
    /// The `schema` field names another format.
    #[error("{path} is {found:?}; this host reads {MANIFEST_SCHEMA:?} manifests")]
    WrongSchema {
        /// The schema field.
        path: JsonPath,
        /// The schema string found.
        found: String,
    },
    /// The tool list is empty.
    #[error("{path} is empty; a manifest declares at least one tool")]
    EmptyTools {
        /// The tools field.
        path: JsonPath,
    },
    /// A server id, name, version, tool name or pricing unit breaks the identifier rule.
    #[error("{path}: {reason}")]
    InvalidIdentifier {
        /// The field.
        path: JsonPath,
        /// Which rule it breaks.
        reason: IdentifierError,
    },
    /// A server id holds `/`, the separator of the names clients see (`server/tool`): two
    /// tools could otherwise share one.
    #[error(
        "{path}: {kind} {value:?} contains '/', which separates the server from the tool in the \
         names clients call; rename it"
    )]
    SeparatorInName {
        /// The field.
        path: JsonPath,
        /// Which name it is.
        kind: &'static str,
        /// The rejected value.
        value: String,
    },
    /// Two tools share a name.
    #[error("{path}: tool name {name:?} is already used by {first}; tool names are unique")]
    DuplicateToolName {
        /// The second tool's name field.
        path: JsonPath,
        /// The repeated name.
        name: String,
        /// The first tool's name field.
        first: JsonPath,
    },
    /// Two resources with one URI (or template), two prompts or two arguments of a prompt
    /// with one name.
    #[error("{path}: {name:?} is already used by {first}; each must be unique")]
    DuplicateName {
        /// The second entry's field.
        path: JsonPath,
        /// The repeated URI or name.
        name: String,
        /// The first entry's field.
        first: JsonPath,
    },
    /// An empty `resources` or `prompts` list (an absent field says the same, once).
    #[error("{path} is empty; leave the field out instead")]
    EmptyList {
        /// The list field.
        path: JsonPath,
    },
    /// A resource with neither or both of `uri` and `uri_template`.
    #[error(
        "{path}: a resource has exactly one of \"uri\" (one URI) and \"uri_template\" (a template)"
    )]
    ResourceLocatorChoice {
        /// The resource.
        path: JsonPath,
    },
    /// A resource URI or URI template that is not usable.
    #[error("{path}: {reason}")]
    InvalidResourceUri {
        /// The uri or uri_template field.
        path: JsonPath,
        /// What is wrong with it.
        reason: String,
    },
    /// A description longer than the limit.
    #[error("{path} is {chars} characters; the limit is {MAX_DESCRIPTION_CHARS}")]
    DescriptionTooLong {
        /// The description field.
        path: JsonPath,
        /// Its length in characters.
        chars: usize,
    },
    /// An `input_schema` or `output_schema` that is not a JSON object.
    #[error("{path} must be a JSON Schema object, found {found}")]
    SchemaNotObject {
        /// The schema field.
        path: JsonPath,
        /// What it holds.
        found: &'static str,
    },
    /// A `public_key` or `signer_key` that is not a usable Ed25519 key.
    #[error("{path}: {reason}")]
    InvalidPublicKey {
        /// The key field.
        path: JsonPath,
        /// What is wrong with it.
        reason: KeyError,
    },
    /// A `signature` that is not 128 lowercase hex digits.
    #[error("{path}: {reason}")]
    InvalidSignatureEncoding {
        /// The signature field.
        path: JsonPath,
        /// What is wrong with it.
        reason: KeyError,
    },
    /// A pricing `model` other than `free`, `per_call`, `per_unit`.
    #[error("{path} is {found:?}; the pricing models are free, per_call, per_unit")]
    UnknownPricingModel {
        /// The model field.
        path: JsonPath,
        /// The model found.
        found: String,
    },
    /// A pricing field that does not apply to the chosen model.
    #[error("{path}: field {field:?} does not apply to pricing model {model}")]
    PricingFieldNotAllowed {
        /// The pricing object.
        path: JsonPath,
        /// The field.
        field: &'static str,
        /// The model.
        model: &'static str,
    },
    /// A pricing amount that is not a plain decimal string.
    #[error(
        "{path} is {found:?}; an amount is a decimal string such as \"0.002\" (no sign, exponent or leading zeros, at most 40 characters)"
    )]
    InvalidAmount {
        /// The amount field.
        path: JsonPath,
        /// The text found.
        found: String,
    },
    /// A currency that is not three uppercase letters.
    #[error("{path} is {found:?}; a currency is an ISO 4217 code such as \"EUR\"")]
    InvalidCurrency {
        /// The currency field.
        path: JsonPath,
        /// The text found.
        found: String,
    },
    /// A latency hint other than `instant`, `fast`, `moderate`, `slow`.
    #[error("{path} is {found:?}; the latency hints are instant, fast, moderate, slow")]
    InvalidLatencyHint {
        /// The latency_hint field.
        path: JsonPath,
        /// The text found.
        found: String,
    },
    /// A `flow` block that is not a well-formed declaration.
    #[error("{path}: {reason}")]
    MalformedFlow {
        /// The flow field.
        path: JsonPath,
        /// The decoder's description.
        reason: String,
    },
    /// A `flow` block that declares `Top` as output label or input clearance.
    #[error("{path}: {reason}")]
    TopInFlow {
        /// The flow field.
        path: JsonPath,
        /// Which label is `Top`.
        reason: ToolFlowError,
    },
    /// Canonical bytes could not be produced.
    #[error(transparent)]
    Canonical(#[from] CanonicalError),
}

type Result<T> = std::result::Result<T, ManifestError>;

/// The JSON type of `value`, for messages.
pub(crate) fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// An object whose fields have been checked against the allowed set.
pub(crate) struct Fields<'a> {
    map: &'a Map<String, Value>,
    at: &'a JsonPath,
}

impl<'a> Fields<'a> {
    /// `value` must be an object with no field outside `allowed`.
    pub(crate) fn new(
        value: &'a Value,
        at: &'a JsonPath,
        allowed: &'static [&'static str],
    ) -> Result<Self> {
        let map = value.as_object().ok_or_else(|| ManifestError::WrongType {
            path: at.clone(),
            expected: "an object",
            found: json_type(value),
        })?;
        if let Some(field) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(ManifestError::UnknownField {
                path: at.clone(),
                field: field.clone(),
                allowed,
            });
        }
        Ok(Fields { map, at })
    }

    /// The path of `field` in this object.
    pub(crate) fn path(&self, field: &str) -> JsonPath {
        self.at.key(field)
    }

    /// An optional field: absent is `None`, `null` is an error.
    pub(crate) fn optional(&self, field: &str) -> Result<Option<&'a Value>> {
        match self.map.get(field) {
            None => Ok(None),
            Some(Value::Null) => Err(ManifestError::NullField {
                path: self.path(field),
            }),
            Some(value) => Ok(Some(value)),
        }
    }

    /// A required field (a `null` is reported as the wrong type by the caller's check).
    pub(crate) fn required(&self, field: &'static str) -> Result<&'a Value> {
        self.map
            .get(field)
            .ok_or_else(|| ManifestError::MissingField {
                path: self.at.clone(),
                field,
            })
    }

    pub(crate) fn required_str(&self, field: &'static str) -> Result<&'a str> {
        as_str(self.required(field)?, &self.path(field))
    }

    pub(crate) fn optional_str(&self, field: &'static str) -> Result<Option<&'a str>> {
        self.optional(field)?
            .map(|v| as_str(v, &self.path(field)))
            .transpose()
    }

    /// A boolean field (required: see [`Fields::optional`] for the optional form).
    pub(crate) fn required_bool(&self, field: &'static str) -> Result<bool> {
        let value = self.required(field)?;
        value.as_bool().ok_or_else(|| ManifestError::WrongType {
            path: self.path(field),
            expected: "a boolean",
            found: json_type(value),
        })
    }

    /// A required string that follows the identifier rule.
    pub(crate) fn identifier(&self, field: &'static str, kind: &'static str) -> Result<&'a str> {
        let text = self.required_str(field)?;
        validate_identifier(kind, text).map_err(|reason| ManifestError::InvalidIdentifier {
            path: self.path(field),
            reason,
        })?;
        Ok(text)
    }

    /// A required identifier that names a server in the names clients call (`server/tool`,
    /// split at the first `/`), so holds no `/`: without this, server `a` with tool `b/c`
    /// and server `a/b` with tool `c` would both be `a/b/c`.
    pub(crate) fn name_part(&self, field: &'static str, kind: &'static str) -> Result<&'a str> {
        let text = self.identifier(field, kind)?;
        if text.contains('/') {
            return Err(ManifestError::SeparatorInName {
                path: self.path(field),
                kind,
                value: text.to_owned(),
            });
        }
        Ok(text)
    }
}

pub(crate) fn as_str<'a>(value: &'a Value, at: &JsonPath) -> Result<&'a str> {
    value.as_str().ok_or_else(|| ManifestError::WrongType {
        path: at.clone(),
        expected: "a string",
        found: json_type(value),
    })
}

pub(super) fn check_description(text: &str, at: JsonPath) -> Result<String> {
    let chars = text.chars().count();
    if chars > MAX_DESCRIPTION_CHARS {
        return Err(ManifestError::DescriptionTooLong { path: at, chars });
    }
    Ok(text.to_owned())
}

const BODY_FIELDS: &[&str] = &[
    "schema",
    "server_id",
    "name",
    "description",
    "version",
    "public_key",
    "tools",
    "resources",
    "prompts",
];

const TOOL_FIELDS: &[&str] = &[
    "name",
    "title",
    "description",
    "input_schema",
    "output_schema",
    "pricing",
    "annotations",
    "latency_hint",
    "flow",
];

const ANNOTATION_FIELDS: &[&str] = &[
    "read_only",
    "destructive",
    "idempotent",
    "requires_approval",
    "open_world",
];

const PRICING_FIELDS: &[&str] = &["model", "amount", "currency", "unit"];

/// The deepest a body may nest (objects and arrays within one another, the body itself
/// counted): the parser reads 128 levels, and a body is read back inside its envelope (one
/// level more) and inside the host's retained set (two more), so one admitted now must
/// still be readable there at every later start.
pub const MAX_BODY_DEPTH: usize = 120;

/// Refuses a body (at `at`) that nests deeper than [`MAX_BODY_DEPTH`]. Checked where a
/// manifest is admitted or signed, not where the host reads back the set it retained
/// (which may hold one admitted before the bound, and must still read).
pub(crate) fn check_depth(value: &Value, at: &JsonPath) -> Result<()> {
    let nesting = depth(value);
    if nesting > MAX_BODY_DEPTH {
        return Err(ManifestError::TooDeep {
            path: at.clone(),
            depth: nesting,
            limit: MAX_BODY_DEPTH,
        });
    }
    Ok(())
}

/// How deeply `value` nests (a scalar is 0, `[]` and `{}` are 1).
fn depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((v, d)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(items) => Box::new(items.iter()),
            Value::Object(map) => Box::new(map.values()),
            _ => continue,
        };
        deepest = deepest.max(d + 1);
        stack.extend(children.map(|c| (c, d + 1)));
    }
    deepest
}

impl ManifestBody {
    /// Decodes and checks a body; `at` is its location, used in error paths (the root for a
    /// body file, `manifest` inside an envelope).
    pub fn from_json_value(value: &Value, at: &JsonPath) -> Result<Self> {
        // The schema comes first: a document of another format is reported as such rather
        // than as a list of unknown fields.
        if let Some(map) = value.as_object() {
            let path = at.key("schema");
            match map.get("schema") {
                None => {
                    return Err(ManifestError::MissingField {
                        path: at.clone(),
                        field: "schema",
                    });
                }
                Some(schema) => {
                    let schema = as_str(schema, &path)?;
                    if schema != MANIFEST_SCHEMA {
                        return Err(ManifestError::WrongSchema {
                            path,
                            found: schema.to_owned(),
                        });
                    }
                }
            }
        }
        let fields = Fields::new(value, at, BODY_FIELDS)?;
        let server_id = fields.name_part("server_id", "server id")?.to_owned();
        let name = fields.identifier("name", "server name")?.to_owned();
        let description = fields
            .optional_str("description")?
            .map(|d| check_description(d, fields.path("description")))
            .transpose()?;
        let version = fields.identifier("version", "version")?.to_owned();
        let public_key = public_key_from_hex("public_key", fields.required_str("public_key")?)
            .map_err(|reason| ManifestError::InvalidPublicKey {
                path: fields.path("public_key"),
                reason,
            })?;
        let tools_path = fields.path("tools");
        let tools_value = fields.required("tools")?;
        let list = tools_value
            .as_array()
            .ok_or_else(|| ManifestError::WrongType {
                path: tools_path.clone(),
                expected: "an array of tools",
                found: json_type(tools_value),
            })?;
        if list.is_empty() {
            return Err(ManifestError::EmptyTools { path: tools_path });
        }
        let mut tools = Vec::with_capacity(list.len());
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        for (index, tool_value) in list.iter().enumerate() {
            let tool_path = tools_path.index(index);
            let tool = ToolDefinition::from_json_value(tool_value, &tool_path)?;
            if let Some(first) = seen.insert(tool.name.clone(), index) {
                return Err(ManifestError::DuplicateToolName {
                    path: tool_path.key("name"),
                    name: tool.name,
                    first: tools_path.index(first).key("name"),
                });
            }
            tools.push(tool);
        }
        let resources = decode_list(
            &fields,
            "resources",
            ResourceDefinition::from_json_value,
            |r| {
                let field = match r.locator() {
                    super::ResourceLocator::Uri(_) => "uri",
                    super::ResourceLocator::Template(_) => "uri_template",
                };
                (r.locator().as_str().to_owned(), field)
            },
        )?;
        let prompts = decode_list(&fields, "prompts", PromptDefinition::from_json_value, |p| {
            (p.name().to_owned(), "name")
        })?;
        Ok(ManifestBody {
            server_id,
            name,
            description,
            version,
            public_key,
            tools,
            resources,
            prompts,
        })
    }

    /// Parses a body from strict JSON text (see [`ManifestBody::from_json_value`]).
    pub fn parse(text: &str) -> Result<Self> {
        let value = crate::canonical::parse_strict(text)?;
        Self::from_json_value(&value, &JsonPath::root())
    }
}

impl ToolDefinition {
    /// Decodes and checks one tool; `at` is its location (for example `tools[2]`).
    pub fn from_json_value(value: &Value, at: &JsonPath) -> Result<Self> {
        let fields = Fields::new(value, at, TOOL_FIELDS)?;
        let name = fields.identifier("name", "tool name")?.to_owned();
        let title = fields
            .optional_str("title")?
            .map(|t| check_description(t, fields.path("title")))
            .transpose()?;
        let description = check_description(
            fields.required_str("description")?,
            fields.path("description"),
        )?;
        let input_schema = schema_object(
            fields.required("input_schema")?,
            fields.path("input_schema"),
        )?;
        let output_schema = fields
            .optional("output_schema")?
            .map(|v| schema_object(v, fields.path("output_schema")))
            .transpose()?;
        let pricing = fields
            .optional("pricing")?
            .map(|v| decode_pricing(v, &fields.path("pricing")))
            .transpose()?;
        let annotations =
            decode_annotations(fields.required("annotations")?, &fields.path("annotations"))?;
        let latency_hint = fields
            .optional_str("latency_hint")?
            .map(|text| {
                LatencyHint::from_wire(text).ok_or_else(|| ManifestError::InvalidLatencyHint {
                    path: fields.path("latency_hint"),
                    found: text.to_owned(),
                })
            })
            .transpose()?;
        let flow = fields
            .optional("flow")?
            .map(|v| decode_flow(v, fields.path("flow")))
            .transpose()?;
        Ok(ToolDefinition {
            name,
            title,
            description,
            input_schema,
            output_schema,
            pricing,
            annotations,
            latency_hint,
            flow,
        })
    }
}

impl LatencyHint {
    fn from_wire(text: &str) -> Option<Self> {
        [
            LatencyHint::Instant,
            LatencyHint::Fast,
            LatencyHint::Moderate,
            LatencyHint::Slow,
        ]
        .into_iter()
        .find(|hint| hint.as_str() == text)
    }
}

fn schema_object(value: &Value, at: JsonPath) -> Result<Map<String, Value>> {
    match value {
        Value::Object(map) => Ok(map.clone()),
        other => Err(ManifestError::SchemaNotObject {
            path: at,
            found: json_type(other),
        }),
    }
}

/// Decodes a `ToolAnnotations` object (all four flags required).
pub(crate) fn decode_annotations(value: &Value, at: &JsonPath) -> Result<ToolAnnotations> {
    let fields = Fields::new(value, at, ANNOTATION_FIELDS)?;
    Ok(ToolAnnotations {
        read_only: fields.required_bool("read_only")?,
        destructive: fields.required_bool("destructive")?,
        idempotent: fields.required_bool("idempotent")?,
        requires_approval: fields.required_bool("requires_approval")?,
        open_world: fields
            .optional("open_world")?
            .map(|_| fields.required_bool("open_world"))
            .transpose()?,
    })
}

/// Decodes a flow declaration, telling a `Top` label apart from a malformed block.
pub(crate) fn decode_flow(value: &Value, at: JsonPath) -> Result<ToolFlowDeclaration> {
    ToolFlowDeclaration::from_json_value(value).map_err(|error| match error {
        FlowDecodeError::Invalid(reason) => ManifestError::TopInFlow { path: at, reason },
        FlowDecodeError::Malformed(reason) => ManifestError::MalformedFlow {
            path: at,
            reason: reason.to_string(),
        },
    })
}

fn decode_pricing(value: &Value, at: &JsonPath) -> Result<Pricing> {
    let fields = Fields::new(value, at, PRICING_FIELDS)?;
    let model_path = fields.path("model");
    let model = fields.required_str("model")?;
    let (model, needs_amount, needs_unit): (&'static str, bool, bool) = match model {
        "free" => ("free", false, false),
        "per_call" => ("per_call", true, false),
        "per_unit" => ("per_unit", true, true),
        other => {
            return Err(ManifestError::UnknownPricingModel {
                path: model_path,
                found: other.to_owned(),
            });
        }
    };
    let not_allowed = |field| ManifestError::PricingFieldNotAllowed {
        path: at.clone(),
        field,
        model,
    };
    if !needs_amount {
        for field in ["amount", "currency"] {
            if fields.optional(field)?.is_some() {
                return Err(not_allowed(field));
            }
        }
    }
    if !needs_unit && fields.optional("unit")?.is_some() {
        return Err(not_allowed("unit"));
    }
    if !needs_amount {
        return Ok(Pricing::Free);
    }
    let amount_text = fields.required_str("amount")?;
    let amount = DecimalAmount::new(amount_text).ok_or_else(|| ManifestError::InvalidAmount {
        path: fields.path("amount"),
        found: amount_text.to_owned(),
    })?;
    let currency_text = fields.required_str("currency")?;
    let currency =
        CurrencyCode::new(currency_text).ok_or_else(|| ManifestError::InvalidCurrency {
            path: fields.path("currency"),
            found: currency_text.to_owned(),
        })?;
    if needs_unit {
        let unit = fields.identifier("unit", "pricing unit")?.to_owned();
        Ok(Pricing::PerUnit {
            amount,
            currency,
            unit,
        })
    } else {
        Ok(Pricing::PerCall { amount, currency })
    }
}
