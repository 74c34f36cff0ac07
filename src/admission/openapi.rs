//! Manifest bodies from OpenAPI 3 documents, and flow declarations written back to them.
//!
//! This file is long on purpose: import and export are one mapping read in two directions
//! (operations, parameters, request bodies, component schemas, the flow extension names), kept
//! side by side so they cannot drift apart.
//!
//! [`manifest_from_openapi`] makes one tool per operation (`get`, `put`, `post`, `delete`,
//! `options`, `head`, `patch`, `trace` under each path, in path order then that method
//! order):
//! * name: the `operationId` (required);
//! * description: the operation's `description`, else its `summary`, else empty;
//! * input schema: with only a JSON request body, the body's schema; otherwise an object
//!   with one property per parameter (path-level parameters included, operation-level ones
//!   overriding them), a `body` property for a JSON request body, `required` from the
//!   parameters' and body's `required` (absent means optional), and no additional
//!   properties. A path parameter is always required: absent `required` means true there,
//!   and `required: false` is refused, since OpenAPI demands true and the URL cannot be
//!   built without it.
//!
//! A field read here that has the wrong JSON type (`"required": "true"`, a numeric
//! `operationId` or `description`) is refused, never taken as absent.
//! * output schema: the JSON schema of the lowest `2xx` response, if any;
//! * annotations: from the method (`get`, `head`, `options`, `trace`: read-only and
//!   idempotent; `put` and `delete`: destructive and idempotent; `post`, `patch`:
//!   destructive), replaced as a whole by an `x-flowhost-annotations` object when the
//!   operation has one. Any other annotations-shaped key (last word `annotation(s)`, or an
//!   object holding an annotation field) on an operation, and any such key including the
//!   accepted one outside operations, is refused, as is an operation key that is neither an
//!   OpenAPI 3 operation field nor an `x-` extension, so annotations written under the wrong
//!   name (and their `requires_approval`) are never replaced by the method's defaults;
//! * flow: the operation's `x-chio-flow` (another name for it that OpenAPI documents use) or `x-flowhost-flow`, decoded as
//!   strictly as in a manifest. Both on one operation must declare the same flow; any other
//!   operation key shaped like a flow extension (`x-*-flow`, any case) is refused, and so is
//!   any flow-shaped key, accepted name or not, at the document root, directly under
//!   `paths` or on a path item (where none is read), so a misspelt, foreign or misplaced
//!   declaration is never signed away as "no flow".
//!
//! Other `x-` keys directly under `paths` are extensions, not path items, and are ignored.
//!
//! A signed schema must be self-contained, so references to `#/components/schemas/...` are
//! copied into the tool schema's `$defs` and rewritten to point there; `$ref`s to parameters,
//! request bodies and responses under `#/components` are followed; any other reference
//! (remote, file, or elsewhere in the document), and a path item's `$ref`, is refused. `$ref` strings inside
//! `example`, `examples`, `default`, `const`, `enum` and `x-` extensions are data and are
//! left alone.
//!
//! [`export_flow_declarations`] writes each signed tool's declaration into the operation
//! whose `operationId` is the tool's name, replacing an existing declaration, and removing
//! it when the tool declares none; a document where two operations share an `operationId`
//! is refused, as on import. It writes under the name(s) the operation already uses;
//! an operation with neither gets the name the rest of the document uses (when it uses
//! exactly one), else `x-chio-flow`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use ed25519_dalek::VerifyingKey;
use serde_json::{Map, Value, json};

use crate::canonical::CanonicalError;
use crate::canonical::{self, JsonError, JsonPath};
use crate::files::{self, FileError};
use crate::keys::public_key_to_hex;
use crate::manifest::{
    MANIFEST_SCHEMA, ManifestBody, ManifestError, ToolDefinition, decode_annotations, decode_flow,
    json_type,
};

/// Largest OpenAPI document read: 16 MiB.
pub const MAX_OPENAPI_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// The operation extensions that carry a flow declaration: `x-chio-flow`, another name in use
/// (the default when writing) and flowhost's own.
pub const FLOW_EXTENSIONS: [&str; 2] = ["x-chio-flow", "x-flowhost-flow"];
/// The operation extension that replaces the method-derived annotations.
pub const ANNOTATIONS_EXTENSION: &str = "x-flowhost-annotations";
/// HTTP methods that name operations, in the order tools are generated.
pub const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];
/// Most `$ref` hops followed for one parameter, request body or response.
const MAX_REF_HOPS: usize = 8;
/// Keywords whose values map names to schemas.
const NAMED_SCHEMA_MAPS: [&str; 5] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];
/// Keywords whose values are instance data, not schemas.
const DATA_KEYWORDS: [&str; 5] = ["example", "examples", "default", "const", "enum"];

/// Why a manifest could not be made from, or written back to, an OpenAPI document.
#[derive(Debug, thiserror::Error)]
pub enum OpenApiError {
    /// The document file could not be read.
    #[error(transparent)]
    File(#[from] FileError),
    /// The document is not strict JSON.
    #[error("{}: {reason}", file.display())]
    Json {
        /// The file.
        file: PathBuf,
        /// The parse problem.
        reason: JsonError,
    },
    /// The document is not OpenAPI 3.
    #[error("{path} is {found}; only OpenAPI 3.x documents are read")]
    NotOpenApi3 {
        /// The `openapi` field.
        path: JsonPath,
        /// What it holds.
        found: String,
    },
    /// A part of the document has the wrong JSON type.
    #[error("{path}: expected {expected}, found {found}")]
    WrongType {
        /// The location.
        path: JsonPath,
        /// What it must be.
        expected: &'static str,
        /// What it is.
        found: &'static str,
    },
    /// The document has no operations.
    #[error("the document has no operations under `paths`; a manifest needs at least one tool")]
    NoOperations,
    /// An operation has no `operationId`, which names its tool.
    #[error("{path}: the operation has no operationId; add one (it becomes the tool name)")]
    MissingOperationId {
        /// The operation.
        path: JsonPath,
    },
    /// Two operations share an `operationId`.
    #[error("{path}: operationId {name:?} is already used by {first}")]
    DuplicateOperationId {
        /// The second operation.
        path: JsonPath,
        /// The repeated id.
        name: String,
        /// The first operation.
        first: JsonPath,
    },
    /// A `$ref` that is not a reference into `#/components` that can be followed.
    #[error(
        "{path}: cannot use $ref {reference:?}: {reason}; a signed schema must be self-contained"
    )]
    UnsupportedRef {
        /// Where the reference is.
        path: JsonPath,
        /// The reference.
        reference: String,
        /// Why it cannot be used.
        reason: &'static str,
    },
    /// A parameter without its `name` or `in` string.
    #[error("{path}: parameter has no {field:?} string")]
    ParameterField {
        /// The parameter.
        path: JsonPath,
        /// The missing field.
        field: &'static str,
    },
    /// A parameter's `in` is not one OpenAPI knows: read as something else, its contract
    /// (a required path parameter) would be lost.
    #[error(
        "{path}: parameter \"in\" is {found:?}, not \"path\", \"query\", \"header\" or \"cookie\""
    )]
    UnknownParameterLocation {
        /// The parameter's `in`.
        path: JsonPath,
        /// What it says.
        found: String,
    },
    /// One list names a parameter twice: the later would replace the earlier and its
    /// constraints with it.
    #[error("{path}: parameter {name:?} in {location:?} is listed twice in one parameters list")]
    DuplicateParameter {
        /// The second listing.
        path: JsonPath,
        /// The parameter's name.
        name: String,
        /// Its `in`.
        location: String,
    },
    /// A path parameter declared optional: OpenAPI requires `required: true` for them.
    #[error(
        "{path}: path parameter {name:?} is declared optional, but a path parameter is always \
         required (OpenAPI: `required` must be true for `in: path`); set it to true"
    )]
    OptionalPathParameter {
        /// The parameter's `required` field.
        path: JsonPath,
        /// The parameter's name.
        name: String,
    },
    /// A parameter without a usable schema.
    #[error("{path}: parameter has neither `schema` nor a JSON `content` schema")]
    ParameterWithoutSchema {
        /// The parameter.
        path: JsonPath,
    },
    /// Two inputs of an operation would get the same property name.
    #[error("{path}: two inputs are named {name:?}; tool argument names must be unique")]
    InputNameConflict {
        /// The operation.
        path: JsonPath,
        /// The shared name.
        name: String,
    },
    /// A request body without a JSON media type.
    #[error(
        "{path}: request body has no JSON media type (found {found}); only JSON bodies become tool input"
    )]
    NonJsonRequestBody {
        /// The request body.
        path: JsonPath,
        /// The media types found.
        found: String,
    },
    /// JSON media types of one `content` map that carry different schemas: which one a
    /// client gets is not known, so neither is signed as the contract.
    #[error(
        "{path}: the JSON media types {first} and {other} carry different schemas; give them one schema, or keep only application/json"
    )]
    AmbiguousJsonContent {
        /// The `content` map.
        path: JsonPath,
        /// The first JSON media type carrying a schema.
        first: String,
        /// One carrying another schema.
        other: String,
    },
    /// A schema that already has `$defs` while component schemas must be copied in.
    #[error(
        "{path}: the schema already has $defs, so referenced component schemas cannot be copied into it"
    )]
    DefsConflict {
        /// The schema.
        path: JsonPath,
    },
    /// The generated tool or manifest breaks a manifest rule (the path names the operation).
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// An operation carries a key shaped like a flow extension that is not one of
    /// [`FLOW_EXTENSIONS`].
    #[error(
        "{path}: {key:?} looks like a flow extension but is not one flowhost reads; rename it to \
         \"x-chio-flow\" or \"x-flowhost-flow\" on the operation (or remove it)"
    )]
    UnknownFlowExtension {
        /// The key's location (path, method, key).
        path: JsonPath,
        /// The key.
        key: String,
    },
    /// A key shaped like a flow extension (an accepted name or not) outside any operation:
    /// at the document root, directly under `paths`, or on a path item. Flowhost reads
    /// declarations only from operations, so it would otherwise be signed away as "no flow".
    #[error(
        "{path}: {key:?} declares a flow outside any operation, where flowhost does not read it; \
         move the declaration onto each operation it applies to, as \"x-chio-flow\" or \
         \"x-flowhost-flow\" (or remove it)"
    )]
    MisplacedFlowExtension {
        /// The key's location.
        path: JsonPath,
        /// The key.
        key: String,
    },
    /// An operation carries a key shaped like the annotations extension that is not
    /// [`ANNOTATIONS_EXTENSION`].
    #[error(
        "{path}: {key:?} looks like tool annotations but is not the extension flowhost reads; \
         rename it to \"x-flowhost-annotations\" (or remove it), or the method's defaults \
         would be signed in its place"
    )]
    UnknownAnnotationsExtension {
        /// The key's location (path, method, key).
        path: JsonPath,
        /// The key.
        key: String,
    },
    /// Annotations (the accepted name or a look-alike) outside any operation, where none is
    /// read: the document root, directly under `paths`, or a path item.
    #[error(
        "{path}: {key:?} declares tool annotations outside any operation, where flowhost does \
         not read them; move them onto each operation they apply to, as \
         \"x-flowhost-annotations\" (or remove them)"
    )]
    MisplacedAnnotationsExtension {
        /// The key's location.
        path: JsonPath,
        /// The key.
        key: String,
    },
    /// An operation holds a key that is neither a field OpenAPI 3 defines for an operation
    /// nor an extension (`x-...`, case-sensitive): whatever it meant would be dropped.
    #[error(
        "{path}: {key:?} is not a field of an OpenAPI 3 operation, and extensions start with \
         \"x-\" (lower case); rename or remove it"
    )]
    UnknownOperationField {
        /// The key's location.
        path: JsonPath,
        /// The key.
        key: String,
    },
    /// A path item holds a key that is neither a field OpenAPI 3 defines for a path item (a
    /// method in lower case among them) nor an extension: an operation under it would be
    /// skipped.
    #[error(
        "{path}: {key:?} is not a field of an OpenAPI 3 path item (methods are lower case), \
         and extensions start with \"x-\"; rename or remove it"
    )]
    UnknownPathItemField {
        /// The key's location.
        path: JsonPath,
        /// The key.
        key: String,
    },
    /// An operation carries both flow extensions with different declarations.
    #[error(
        "{path}: \"x-chio-flow\" and \"x-flowhost-flow\" declare different flows; keep one, or make them equal"
    )]
    ConflictingFlowExtensions {
        /// The operation.
        path: JsonPath,
    },
    /// A signed tool has no operation with its name as `operationId`.
    #[error("tool {tool:?} has no operation with operationId {tool:?} in the document")]
    ToolWithoutOperation {
        /// The tool.
        tool: String,
    },
}

type Result<T> = std::result::Result<T, OpenApiError>;

/// The manifest fields that do not come from the OpenAPI document.
#[derive(Debug, Clone)]
pub struct ManifestIdentity {
    /// The server id.
    pub server_id: String,
    /// The server name.
    pub name: String,
    /// An optional server description.
    pub description: Option<String>,
    /// The version.
    pub version: String,
    /// The publisher's public key (the key that will sign the body).
    pub public_key: VerifyingKey,
}

/// Reads an OpenAPI document (JSON, at most 16 MiB, no symlink, duplicate keys refused).
pub fn load_openapi_file(path: &Path) -> Result<Value> {
    let text = files::read_text(path, MAX_OPENAPI_FILE_BYTES)?;
    canonical::parse_strict(&text).map_err(|reason| OpenApiError::Json {
        file: path.to_owned(),
        reason,
    })
}

/// One operation found in the document.
struct Operation<'a> {
    path: JsonPath,
    route: &'a str,
    method: &'static str,
    value: &'a Map<String, Value>,
    path_item: &'a Map<String, Value>,
}

fn object<'a>(value: &'a Value, path: &JsonPath) -> Result<&'a Map<String, Value>> {
    value.as_object().ok_or_else(|| OpenApiError::WrongType {
        path: path.clone(),
        expected: "an object",
        found: json_type(value),
    })
}

fn operations(doc: &Value) -> Result<Vec<Operation<'_>>> {
    let root = object(doc, &JsonPath::root())?;
    let version_path = JsonPath::field("openapi");
    match root.get("openapi").and_then(Value::as_str) {
        Some(v) if v.starts_with("3.") => {}
        other => {
            return Err(OpenApiError::NotOpenApi3 {
                path: version_path,
                found: other.map_or_else(|| "missing".to_owned(), |v| format!("{v:?}")),
            });
        }
    }
    refuse_flow_keys_outside_operations(root, &JsonPath::root())?;
    let paths_path = JsonPath::field("paths");
    let Some(paths) = root.get("paths") else {
        return Err(OpenApiError::NoOperations);
    };
    let paths = object(paths, &paths_path)?;
    refuse_flow_keys_outside_operations(paths, &paths_path)?;
    let mut found = Vec::new();
    for (route, item) in paths {
        // OpenAPI allows extensions beside the paths; they are not path items (the flow
        // extensions among them were refused above).
        if route.starts_with("x-") {
            continue;
        }
        let item_path = paths_path.key(route);
        let item = object(item, &item_path)?;
        refuse_flow_keys_outside_operations(item, &item_path)?;
        if let Some(key) = item.keys().find(|key| {
            !key.starts_with("x-")
                && !METHODS.contains(&key.as_str())
                && !PATH_ITEM_FIELDS.contains(&key.as_str())
        }) {
            return Err(OpenApiError::UnknownPathItemField {
                path: item_path.key(key),
                key: key.clone(),
            });
        }
        // A referenced path item's operations are elsewhere: skipping them would drop
        // tools (and their declarations) without a word, so the reference is refused.
        if let Some(reference) = item.get("$ref") {
            return Err(OpenApiError::UnsupportedRef {
                path: item_path.key("$ref"),
                reference: reference
                    .as_str()
                    .map_or_else(|| reference.to_string(), str::to_owned),
                reason: "path item references are not followed; write the path item in place",
            });
        }
        for method in METHODS {
            if let Some(op) = item.get(method) {
                let path = item_path.key(method);
                found.push(Operation {
                    value: object(op, &path)?,
                    path,
                    route,
                    method,
                    path_item: item,
                });
            }
        }
    }
    if found.is_empty() {
        return Err(OpenApiError::NoOperations);
    }
    Ok(found)
}

/// The string at `map[key]`, if there is one; a value of another type is refused rather
/// than taken as absent (absence has a meaning of its own here).
fn optional_str<'a>(
    map: &'a Map<String, Value>,
    key: &str,
    at: &JsonPath,
) -> Result<Option<&'a str>> {
    match map.get(key) {
        None => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(other) => Err(OpenApiError::WrongType {
            path: at.key(key),
            expected: "a string",
            found: json_type(other),
        }),
    }
}

/// The boolean at `map[key]`, if there is one; a value of another type (such as the string
/// `"true"`) is refused rather than taken as absent.
fn optional_bool(map: &Map<String, Value>, key: &str, at: &JsonPath) -> Result<Option<bool>> {
    match map.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(OpenApiError::WrongType {
            path: at.key(key),
            expected: "a boolean",
            found: json_type(other),
        }),
    }
}

fn operation_id<'a>(op: &Operation<'a>) -> Result<&'a str> {
    optional_str(op.value, "operationId", &op.path)?.ok_or_else(|| {
        OpenApiError::MissingOperationId {
            path: op.path.clone(),
        }
    })
}

/// Builds a manifest body (as JSON, ready to sign) from an OpenAPI 3 document, checked as
/// strictly as any manifest (see the module docs for the mapping).
pub fn manifest_from_openapi(doc: &Value, identity: &ManifestIdentity) -> Result<Value> {
    // Where an API key goes is read from these: one that cannot be read would let its key
    // become an argument unsaid. So `components`, the schemes, each scheme (where its
    // reference leads) and an `apiKey` scheme's `in` and `name` are read strictly.
    let components = match doc.get("components") {
        Some(c) => Some(object(c, &JsonPath::field("components"))?),
        None => None,
    };
    if let Some(schemes) = components.and_then(|c| c.get("securitySchemes")) {
        let at = JsonPath::field("components").key("securitySchemes");
        for (name, scheme) in object(schemes, &at)? {
            let path = at.key(name);
            let scheme = object(resolve(doc, scheme, &path, "securitySchemes")?, &path)?;
            // A type OpenAPI does not name (`ApiKey`, none) would read as no key's place.
            let kind = optional_str(scheme, "type", &path)?;
            if !matches!(
                kind,
                Some("apiKey" | "http" | "mutualTLS" | "oauth2" | "openIdConnect")
            ) {
                return Err(OpenApiError::WrongType {
                    path: path.key("type"),
                    expected: "apiKey, http, mutualTLS, oauth2 or openIdConnect",
                    found: if kind.is_some() {
                        "another string"
                    } else {
                        "nothing"
                    },
                });
            }
            if kind == Some("apiKey") {
                // Both given, and a place OpenAPI names: a key whose place cannot be told
                // would become an argument unsaid.
                let refused = |field: &str, expected, found| OpenApiError::WrongType {
                    path: path.key(field),
                    expected,
                    found,
                };
                let place = "header, query or cookie";
                match optional_str(scheme, "in", &path)? {
                    Some("header" | "query" | "cookie") => {}
                    Some(_) => return Err(refused("in", place, "another string")),
                    None => return Err(refused("in", place, "nothing")),
                }
                if optional_str(scheme, "name", &path)?.is_none() {
                    return Err(refused("name", "a string", "nothing"));
                }
            }
        }
    }
    let mut tools = Vec::new();
    let mut seen: BTreeMap<&str, JsonPath> = BTreeMap::new();
    for op in operations(doc)? {
        let name = operation_id(&op)?;
        if let Some(first) = seen.insert(name, op.path.clone()) {
            return Err(OpenApiError::DuplicateOperationId {
                path: op.path,
                name: name.to_owned(),
                first,
            });
        }
        let tool = tool_from_operation(doc, &op, name)?;
        // Checked here so that an error names the operation rather than a tool index.
        ToolDefinition::from_json_value(&tool, &op.path)?;
        tools.push(tool);
    }
    let mut body = json!({
        "schema": MANIFEST_SCHEMA,
        "server_id": identity.server_id,
        "name": identity.name,
        "version": identity.version,
        "public_key": public_key_to_hex(&identity.public_key),
        "tools": tools,
    });
    if let Some(description) = &identity.description {
        body["description"] = json!(description);
    }
    ManifestBody::from_json_value(&body, &JsonPath::root())?;
    Ok(body)
}

/// One contract of an OpenAPI document that its manifest does not carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotCarried {
    /// Its JSON path in the document.
    pub at: String,
    /// Why no manifest carries it.
    pub why: &'static str,
}

/// Why a manifest names no `servers` or `security`.
const NO_HOSTS_NO_AUTH: &str = "a manifest names no hosts and no authentication; where the \
    tools may go is the operator's destination rules";
/// Why a manifest carries no `callbacks` or `webhooks`.
const NO_CALLBACKS: &str = "requests the remote API makes to addresses a caller gives are \
    not the tool's, and nothing the host governs";
/// Why a header parameter OpenAPI says is ignored becomes no tool argument.
const IGNORED_HEADER: &str = "OpenAPI ignores a header parameter named Accept, Content-Type \
    or Authorization, so it is no argument of the tool (a credential is never one)";

/// Why a parameter an API key's scheme places becomes no tool argument.
const API_KEY: &str = "the document's securitySchemes place an API key there, and a \
    credential is never an argument of the tool";

/// The header parameters OpenAPI says are ignored (compared without case).
const IGNORED_HEADERS: [&str; 3] = ["accept", "content-type", "authorization"];

/// The contracts of `doc` a manifest does not carry, each with its JSON path and why: a
/// non-empty `servers` or `security` (of the document, a path item or an operation; a
/// manifest names no hosts, the operator's destination rules decide where a tool may go,
/// and no authentication), an operation's `callbacks` or the document's `webhooks` (what
/// the remote API sends elsewhere), and a header parameter OpenAPI ignores. Said to whoever
/// imports the document, so that none of them is believed kept.
pub fn contracts_not_carried(doc: &Value) -> Vec<NotCarried> {
    let mut found = Vec::new();
    let contracts = [
        ("servers", NO_HOSTS_NO_AUTH),
        ("security", NO_HOSTS_NO_AUTH),
    ];
    look(doc, &JsonPath::root(), &contracts, &mut found);
    look(
        doc,
        &JsonPath::root(),
        &[("webhooks", NO_CALLBACKS)],
        &mut found,
    );
    let paths_path = JsonPath::field("paths");
    let Some(paths) = doc.get("paths").and_then(Value::as_object) else {
        return found;
    };
    for (route, item) in paths.iter().filter(|(r, _)| !r.starts_with("x-")) {
        let item_path = paths_path.key(route);
        look(item, &item_path, &contracts, &mut found);
        let Some(methods) = item.as_object() else {
            continue;
        };
        not_arguments(doc, item, &item_path, &mut found);
        for (method, op) in methods {
            if METHODS.contains(&method.as_str()) {
                let op_path = item_path.key(method);
                look(op, &op_path, &contracts, &mut found);
                look(op, &op_path, &[("callbacks", NO_CALLBACKS)], &mut found);
                not_arguments(doc, op, &op_path, &mut found);
            }
        }
    }
    found
}

/// Adds each of `keys` that `object` (at `at`) holds a non-empty value of to `found`, with
/// its reason.
fn look(object: &Value, at: &JsonPath, keys: &[(&str, &'static str)], found: &mut Vec<NotCarried>) {
    for &(key, why) in keys {
        let held = match object.get(key) {
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
            Some(Value::Null) | None => false,
            Some(_) => true,
        };
        if held {
            found.push(NotCarried {
                at: at.key(key).to_string(),
                why,
            });
        }
    }
}

/// Adds each parameter of `holder` (a path item or an operation) that is no argument
/// ([`not_an_argument`]) to `found`.
fn not_arguments(doc: &Value, holder: &Value, at: &JsonPath, found: &mut Vec<NotCarried>) {
    let list = at.key("parameters");
    let Some(params) = holder.get("parameters").and_then(Value::as_array) else {
        return;
    };
    for (i, raw) in params.iter().enumerate() {
        let path = list.index(i);
        let param = resolve(doc, raw, &path, "parameters").ok();
        if let Some(why) = param
            .and_then(Value::as_object)
            .and_then(|p| not_an_argument(doc, p))
        {
            found.push(NotCarried {
                at: path.to_string(),
                why,
            });
        }
    }
}

/// Why `param` becomes no argument of the tool, if it does not: a header OpenAPI says is
/// ignored, or the place of an API key the document's `securitySchemes` define (a
/// credential is never passed through the model).
fn not_an_argument(doc: &Value, param: &Map<String, Value>) -> Option<&'static str> {
    if is_ignored_header(param) {
        return Some(IGNORED_HEADER);
    }
    let location = param.get("in").and_then(Value::as_str)?;
    let name = param.get("name").and_then(Value::as_str)?;
    let schemes = doc
        .pointer("/components/securitySchemes")
        .and_then(Value::as_object)?;
    // A scheme given by a reference is read where it leads (`manifest_from_openapi` refused
    // one that cannot be followed).
    let at = JsonPath::field("components").key("securitySchemes");
    schemes
        .iter()
        .filter_map(|(n, s)| resolve(doc, s, &at.key(n), "securitySchemes").ok())
        .filter(|s| s.get("type").and_then(Value::as_str) == Some("apiKey"))
        .any(|s| {
            s.get("in").and_then(Value::as_str) == Some(location)
                && s.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| same_key(n, location) == same_key(name, location))
        })
        .then_some(API_KEY)
}

/// How a parameter's name is told apart from the others of its place: a header's without
/// case.
fn same_key(name: &str, location: &str) -> String {
    if location == "header" {
        name.to_ascii_lowercase()
    } else {
        name.to_owned()
    }
}

/// Whether `param` is a header parameter OpenAPI says is ignored.
fn is_ignored_header(param: &Map<String, Value>) -> bool {
    param.get("in").and_then(Value::as_str) == Some("header")
        && param
            .get("name")
            .and_then(Value::as_str)
            .is_some_and(|n| IGNORED_HEADERS.contains(&n.to_ascii_lowercase().as_str()))
}

fn tool_from_operation(doc: &Value, op: &Operation<'_>, name: &str) -> Result<Value> {
    check_operation_keys(op)?;
    // Both read before choosing, so a summary of the wrong type is refused even when a
    // description makes it unused.
    let description = optional_str(op.value, "description", &op.path)?;
    let summary = optional_str(op.value, "summary", &op.path)?;
    let description = description.or(summary).unwrap_or("");
    let mut tool = Map::new();
    tool.insert("name".into(), json!(name));
    tool.insert("description".into(), json!(description));
    tool.insert("input_schema".into(), Value::Object(input_schema(doc, op)?));
    if let Some(output) = output_schema(doc, op)? {
        tool.insert("output_schema".into(), Value::Object(output));
    }
    let annotations = match op.value.get(ANNOTATIONS_EXTENSION) {
        Some(value) => {
            let annotations = decode_annotations(value, &op.path.key(ANNOTATIONS_EXTENSION))?;
            to_value(&annotations)?
        }
        None => method_annotations(op.method),
    };
    tool.insert("annotations".into(), annotations);
    let mut declared = None;
    for key in flow_keys(op)? {
        let raw = &op.value[key];
        // Decoded strictly now, so a bad declaration is reported against the operation;
        // the body carries it exactly as written.
        let flow = decode_flow(raw, op.path.key(key))?;
        match &declared {
            None => declared = Some((flow, raw)),
            Some((first, _)) if *first == flow => {}
            Some(_) => {
                return Err(OpenApiError::ConflictingFlowExtensions {
                    path: op.path.clone(),
                });
            }
        }
    }
    if let Some((_, raw)) = declared {
        tool.insert("flow".into(), raw.clone());
    }
    Ok(Value::Object(tool))
}

/// The fields of a flow declaration: an extension whose value is an object holding one of
/// them is a flow declaration, whatever its name.
const FLOW_FIELDS: [&str; 4] = [
    "egress",
    "output_label",
    "input_clearance",
    "declassification_purposes",
];

/// Whether the extension `key`, holding `value`, is shaped like a flow declaration: its
/// last word is `flow` or `flows` in any case, words being split at any character that is
/// no letter or digit and where a capital follows a small letter (`x-chio-flow`,
/// `x-chioFlow`, `x-flowhost_flow`, `x-chio-flows`, `x-chio-flow ` with a space at the end;
/// not `x-workflow`), or it holds an object with a field a flow declaration has
/// (`x-chio-flow-v1`). So a declaration under a misspelt name is refused rather than
/// dropped, and its tool never signed without it.
fn looks_like_flow_extension(key: &str, value: &Value) -> bool {
    extension_shaped(key, value, &["flow", "flows"], &FLOW_FIELDS)
}

/// Whether `key` is an extension (`x-` in any case) whose last word is one of `last_words`,
/// or whose value is an object holding one of `fields`.
fn extension_shaped(key: &str, value: &Value, last_words: &[&str], fields: &[&str]) -> bool {
    if !key.to_ascii_lowercase().starts_with("x-") {
        return false;
    }
    let mut words: Vec<String> = vec![String::new()];
    let mut previous_small = false;
    for c in key.chars() {
        if !c.is_alphanumeric() {
            words.push(String::new());
            previous_small = false;
            continue;
        }
        if c.is_uppercase() && previous_small {
            words.push(String::new());
        }
        previous_small = c.is_lowercase();
        if let Some(word) = words.last_mut() {
            word.extend(c.to_lowercase());
        }
    }
    let named = words
        .iter()
        .rev()
        .find(|w| !w.is_empty())
        .is_some_and(|w| last_words.contains(&w.as_str()));
    named
        || value
            .as_object()
            .is_some_and(|o| fields.iter().any(|f| o.contains_key(*f)))
}

/// Refuses any flow-shaped key (accepted name or not) of `map`, an object that is not an
/// operation: declarations are read only from operations, so one anywhere else would be
/// dropped and its tools signed with no flow.
fn refuse_flow_keys_outside_operations(map: &Map<String, Value>, path: &JsonPath) -> Result<()> {
    for (key, value) in map {
        if looks_like_flow_extension(key, value) {
            return Err(OpenApiError::MisplacedFlowExtension {
                path: path.key(key),
                key: key.clone(),
            });
        }
        if looks_like_annotations_extension(key, value) {
            return Err(OpenApiError::MisplacedAnnotationsExtension {
                path: path.key(key),
                key: key.clone(),
            });
        }
    }
    Ok(())
}

/// The fields OpenAPI 3 defines for a path item besides its methods.
const PATH_ITEM_FIELDS: [&str; 5] = ["$ref", "summary", "description", "servers", "parameters"];

/// The fields OpenAPI 3 defines for an operation object; any other key of an operation
/// must be an extension.
const OPERATION_FIELDS: [&str; 12] = [
    "tags",
    "summary",
    "description",
    "externalDocs",
    "operationId",
    "parameters",
    "requestBody",
    "responses",
    "callbacks",
    "deprecated",
    "security",
    "servers",
];

/// The fields of tool annotations: an extension whose value is an object holding one of
/// them is an annotations block, whatever its name.
const ANNOTATION_FIELDS: [&str; 5] = [
    "read_only",
    "destructive",
    "idempotent",
    "requires_approval",
    "open_world",
];

/// Whether the extension `key`, holding `value`, is shaped like an annotations block: its
/// last word is `annotation` or `annotations`, or it holds an object with an annotation
/// field (words as in [`looks_like_flow_extension`]).
fn looks_like_annotations_extension(key: &str, value: &Value) -> bool {
    extension_shaped(
        key,
        value,
        &["annotation", "annotations"],
        &ANNOTATION_FIELDS,
    )
}

/// Refuses, on an operation, any key that is neither an operation field nor an extension,
/// and any annotations-shaped extension under another name than [`ANNOTATIONS_EXTENSION`]:
/// either would leave the method's defaults signed in place of what the publisher wrote.
fn check_operation_keys(op: &Operation<'_>) -> Result<()> {
    for (key, value) in op.value {
        // Flow-shaped keys are judged, with their own message, by `flow_keys`.
        if looks_like_flow_extension(key, value) {
            continue;
        }
        if !key.starts_with("x-") && !OPERATION_FIELDS.contains(&key.as_str()) {
            return Err(OpenApiError::UnknownOperationField {
                path: op.path.key(key),
                key: key.clone(),
            });
        }
        if key != ANNOTATIONS_EXTENSION && looks_like_annotations_extension(key, value) {
            return Err(OpenApiError::UnknownAnnotationsExtension {
                path: op.path.key(key),
                key: key.clone(),
            });
        }
    }
    Ok(())
}

/// The accepted flow extensions an operation carries, in [`FLOW_EXTENSIONS`] order; any
/// other flow-shaped key on the operation is an error. (Flow-shaped keys outside
/// operations were refused by [`operations`].)
fn flow_keys(op: &Operation<'_>) -> Result<Vec<&'static str>> {
    if let Some((key, _)) = op
        .value
        .iter()
        .filter(|(key, _)| !FLOW_EXTENSIONS.contains(&key.as_str()))
        .find(|(key, value)| looks_like_flow_extension(key, value))
    {
        return Err(OpenApiError::UnknownFlowExtension {
            path: op.path.key(key),
            key: key.clone(),
        });
    }
    Ok(FLOW_EXTENSIONS
        .into_iter()
        .filter(|key| op.value.contains_key(*key))
        .collect())
}

fn to_value<T: serde::Serialize>(value: &T) -> Result<Value> {
    serde_json::to_value(value)
        .map_err(|e| OpenApiError::Manifest(ManifestError::Canonical(CanonicalError::from(e))))
}

fn method_annotations(method: &str) -> Value {
    let (read_only, destructive, idempotent) = match method {
        "get" | "head" | "options" | "trace" => (true, false, true),
        // A method that writes may destroy or overwrite data unless the publisher says
        // otherwise (as MCP assumes of a tool that is not read-only).
        "put" | "delete" => (false, true, true),
        _ => (false, true, false),
    };
    json!({"read_only": read_only, "destructive": destructive, "idempotent": idempotent,
           "requires_approval": false})
}

/// Follows `$ref` chains to `#/components/<kind>/...`.
fn resolve<'a>(doc: &'a Value, value: &'a Value, path: &JsonPath, kind: &str) -> Result<&'a Value> {
    let mut current = value;
    for _ in 0..MAX_REF_HOPS {
        let reference = match current.get("$ref") {
            None => return Ok(current),
            Some(Value::String(reference)) => reference,
            Some(other) => {
                return Err(OpenApiError::WrongType {
                    path: path.key("$ref"),
                    expected: "a string",
                    found: json_type(other),
                });
            }
        };
        let unsupported = |reason| OpenApiError::UnsupportedRef {
            path: path.clone(),
            reference: reference.to_owned(),
            reason,
        };
        let prefix = format!("#/components/{kind}/");
        if !reference.starts_with(&prefix) {
            return Err(unsupported(
                "only references into #/components are followed",
            ));
        }
        current = doc
            .pointer(&reference[1..])
            .ok_or_else(|| unsupported("nothing at that location"))?;
    }
    Err(OpenApiError::UnsupportedRef {
        path: path.clone(),
        reference: String::new(),
        reason: "too many references in a row",
    })
}

/// Copies referenced component schemas into one `$defs` map, rewriting references.
struct Inliner<'a> {
    doc: &'a Value,
    defs: Map<String, Value>,
    pending: Vec<String>,
    queued: BTreeSet<String>,
}

const SCHEMA_PREFIX: &str = "#/components/schemas/";

impl<'a> Inliner<'a> {
    fn new(doc: &'a Value) -> Self {
        Inliner {
            doc,
            defs: Map::new(),
            pending: Vec::new(),
            queued: BTreeSet::new(),
        }
    }

    fn rewrite(&mut self, schema: &Value, path: &JsonPath) -> Result<Value> {
        Ok(match schema {
            Value::Object(map) => {
                let mut out = Map::new();
                for (key, value) in map {
                    let rewritten = match value {
                        Value::String(reference) if key == "$ref" => {
                            Value::String(self.reference(reference, path)?)
                        }
                        // Keys of these maps are property or definition names, so a
                        // property called "example" is still a schema.
                        Value::Object(named) if NAMED_SCHEMA_MAPS.contains(&key.as_str()) => {
                            let at = path.key(key);
                            let mut out = Map::new();
                            for (name, sub) in named {
                                out.insert(name.clone(), self.rewrite(sub, &at.key(name))?);
                            }
                            Value::Object(out)
                        }
                        _ if DATA_KEYWORDS.contains(&key.as_str()) || key.starts_with("x-") => {
                            value.clone()
                        }
                        _ => self.rewrite(value, &path.key(key))?,
                    };
                    out.insert(key.clone(), rewritten);
                }
                Value::Object(out)
            }
            Value::Array(items) => Value::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| self.rewrite(item, &path.index(i)))
                    .collect::<Result<_>>()?,
            ),
            other => other.clone(),
        })
    }

    fn reference(&mut self, reference: &str, path: &JsonPath) -> Result<String> {
        let unsupported = |reason| OpenApiError::UnsupportedRef {
            path: path.clone(),
            reference: reference.to_owned(),
            reason,
        };
        let Some(name) = reference.strip_prefix(SCHEMA_PREFIX) else {
            return Err(unsupported(
                "only references to #/components/schemas/<name> are copied in",
            ));
        };
        if name.is_empty() || name.contains('/') {
            return Err(unsupported(
                "only whole component schemas can be referenced",
            ));
        }
        if self.doc.pointer(&reference[1..]).is_none() {
            return Err(unsupported("no such component schema"));
        }
        if self.queued.insert(name.to_owned()) {
            self.pending.push(name.to_owned());
        }
        Ok(format!("#/$defs/{name}"))
    }

    /// Rewrites every queued component schema (and those they reference) into `$defs`.
    fn finish(mut self) -> Result<Map<String, Value>> {
        while let Some(name) = self.pending.pop() {
            let pointer = format!("{}{name}", &SCHEMA_PREFIX[1..]);
            let path = JsonPath::field("components")
                .key("schemas")
                .key(&decode_pointer(&name));
            let source =
                self.doc
                    .pointer(&pointer)
                    .ok_or_else(|| OpenApiError::UnsupportedRef {
                        path: path.clone(),
                        reference: format!("#{pointer}"),
                        reason: "no such component schema",
                    })?;
            let rewritten = self.rewrite(source, &path)?;
            self.defs.insert(decode_pointer(&name), rewritten);
        }
        Ok(self.defs)
    }
}

/// A JSON pointer segment as the key it names (`~1` is `/`, `~0` is `~`).
fn decode_pointer(segment: &str) -> String {
    segment.replace("~1", "/").replace("~0", "~")
}

/// Attaches `$defs` to a root schema.
fn with_defs(
    mut root: Map<String, Value>,
    defs: Map<String, Value>,
    path: &JsonPath,
) -> Result<Map<String, Value>> {
    if !defs.is_empty() {
        if root.contains_key("$defs") {
            return Err(OpenApiError::DefsConflict { path: path.clone() });
        }
        root.insert("$defs".into(), Value::Object(defs));
    }
    Ok(root)
}

/// The JSON media type of `content` (at `path`) whose schema is the contract, with that
/// schema: `application/json` (its type told apart without case, its parameters ignored)
/// if it carries one, else another JSON type (`+json`) that does, whichever sorts first.
/// `None` when no JSON media type carries a schema. Refused: a JSON media type that is not
/// an object (it would be read as no schema), and JSON media types carrying different
/// schemas.
fn json_content<'a>(
    content: &'a Map<String, Value>,
    path: &JsonPath,
) -> Result<Option<(&'a str, &'a Value)>> {
    let mut carried: Vec<(&str, &Value, bool)> = Vec::new();
    for (media, value) in content {
        let essence = media.split(';').next().unwrap_or("").trim();
        let plain = essence.eq_ignore_ascii_case("application/json");
        let json = plain
            || essence
                .get(essence.len().saturating_sub(5)..)
                .is_some_and(|end| end.eq_ignore_ascii_case("+json"));
        if !json {
            continue;
        }
        if let Some(schema) = object(value, &path.key(media))?.get("schema") {
            carried.push((media, schema, plain));
        }
    }
    if let Some(&(first, schema, _)) = carried.first()
        && let Some(&(other, _, _)) = carried.iter().find(|(_, s, _)| *s != schema)
    {
        return Err(OpenApiError::AmbiguousJsonContent {
            path: path.clone(),
            first: first.to_owned(),
            other: other.to_owned(),
        });
    }
    Ok(carried
        .iter()
        .find(|(_, _, plain)| *plain)
        .or(carried.first())
        .map(|&(media, schema, _)| (media, schema)))
}

fn input_schema(doc: &Value, op: &Operation<'_>) -> Result<Map<String, Value>> {
    let mut inliner = Inliner::new(doc);
    // Path-level parameters first; an operation-level one with the same name and location
    // replaces it (OpenAPI 3 §4.8.9).
    let mut params: Vec<(String, String, bool, Value)> = Vec::new();
    let sources = [
        (
            op.path_item.get("parameters"),
            JsonPath::field("paths").key(op.route).key("parameters"),
        ),
        (op.value.get("parameters"), op.path.key("parameters")),
    ];
    for (list, list_path) in sources {
        let Some(list) = list else { continue };
        let items = list.as_array().ok_or_else(|| OpenApiError::WrongType {
            path: list_path.clone(),
            expected: "an array of parameters",
            found: json_type(list),
        })?;
        let mut listed = std::collections::HashSet::new();
        for (i, raw) in items.iter().enumerate() {
            let path = list_path.index(i);
            let param = object(resolve(doc, raw, &path, "parameters")?, &path)?;
            let field = |field: &'static str| {
                param.get(field).and_then(Value::as_str).ok_or_else(|| {
                    OpenApiError::ParameterField {
                        path: path.clone(),
                        field,
                    }
                })
            };
            let (name, location) = (field("name")?, field("in")?);
            if !matches!(location, "path" | "query" | "header" | "cookie") {
                return Err(OpenApiError::UnknownParameterLocation {
                    path: path.key("in"),
                    found: location.to_owned(),
                });
            }
            // An ignored header (OpenAPI: such a definition "SHALL be ignored") or an API
            // key's place: as an argument it would invite a caller to pass a credential
            // through the model (named by `contracts_not_carried`).
            if not_an_argument(doc, param).is_some() {
                continue;
            }
            // An operation's list overrides its path item's (OpenAPI's rule), but within one
            // list a name and place are given once.
            // A header's name is compared without case, as HTTP compares it.
            let same = |n: &str, l: &str| {
                l == location
                    && if location == "header" {
                        n.eq_ignore_ascii_case(name)
                    } else {
                        n == name
                    }
            };
            if !listed.insert((same_key(name, location), location)) {
                return Err(OpenApiError::DuplicateParameter {
                    path: path.clone(),
                    name: name.to_owned(),
                    location: location.to_owned(),
                });
            }
            let required = match (location, optional_bool(param, "required", &path)?) {
                // A path parameter is part of the URL, so there is no call without it
                // (OpenAPI 3: `required` must be true). An explicit `false` says the author
                // thinks otherwise: refused rather than guessed at; absent means required.
                ("path", Some(false)) => {
                    return Err(OpenApiError::OptionalPathParameter {
                        path: path.key("required"),
                        name: name.to_owned(),
                    });
                }
                ("path", _) => true,
                (_, required) => required.unwrap_or(false),
            };
            let schema = match param.get("schema") {
                Some(schema) => schema,
                None => {
                    let content = match param.get("content") {
                        Some(c) => {
                            json_content(object(c, &path.key("content"))?, &path.key("content"))?
                        }
                        None => None,
                    };
                    content.map(|(_, schema)| schema).ok_or_else(|| {
                        OpenApiError::ParameterWithoutSchema { path: path.clone() }
                    })?
                }
            };
            let schema = inliner.rewrite(schema, &path.key("schema"))?;
            params.retain(|(n, l, _, _)| !same(n, l));
            params.push((name.to_owned(), location.to_owned(), required, schema));
        }
    }
    let body = match op.value.get("requestBody") {
        Some(raw) => {
            let path = op.path.key("requestBody");
            let body = object(resolve(doc, raw, &path, "requestBodies")?, &path)?;
            let required = optional_bool(body, "required", &path)?.unwrap_or(false);
            let content = body.get("content").and_then(Value::as_object);
            let carried = match content {
                Some(c) => json_content(c, &path.key("content"))?,
                None => None,
            };
            let (media, schema) = carried.ok_or_else(|| OpenApiError::NonJsonRequestBody {
                path: path.clone(),
                found: content
                    .map(|c| c.keys().cloned().collect::<Vec<_>>().join(", "))
                    .unwrap_or_else(|| "none".into()),
            })?;
            let schema_path = path.key("content").key(media).key("schema");
            Some((
                required,
                inliner.rewrite(schema, &schema_path)?,
                schema_path,
            ))
        }
        None => None,
    };
    let root = match (params.is_empty(), body) {
        // Only a body: its schema is the tool's input.
        (true, Some((_, Value::Object(schema), _))) => schema,
        (true, Some((_, other, path))) => {
            return Err(OpenApiError::WrongType {
                path,
                expected: "a schema object",
                found: json_type(&other),
            });
        }
        (_, body) => {
            let mut properties = Map::new();
            let mut required = Vec::new();
            let inputs = params
                .into_iter()
                .map(|(name, _, req, schema)| (name, req, schema))
                .chain(body.map(|(req, schema, _)| ("body".to_owned(), req, schema)));
            for (name, req, schema) in inputs {
                if properties.insert(name.clone(), schema).is_some() {
                    return Err(OpenApiError::InputNameConflict {
                        path: op.path.clone(),
                        name,
                    });
                }
                if req {
                    required.push(Value::String(name));
                }
            }
            let mut root = Map::new();
            root.insert("type".into(), json!("object"));
            root.insert("properties".into(), Value::Object(properties));
            if !required.is_empty() {
                root.insert("required".into(), Value::Array(required));
            }
            root.insert("additionalProperties".into(), json!(false));
            root
        }
    };
    with_defs(root, inliner.finish()?, &op.path)
}

fn output_schema(doc: &Value, op: &Operation<'_>) -> Result<Option<Map<String, Value>>> {
    // Present, `responses` and a response's `content` must be objects: of another type,
    // they would be read as no output schema at all.
    let responses = match op.value.get("responses") {
        None => return Ok(None),
        Some(r) => object(r, &op.path.key("responses"))?,
    };
    let Some((status, raw)) = responses
        .iter()
        .filter(|(status, _)| status.starts_with('2'))
        .min_by(|a, b| a.0.cmp(b.0))
    else {
        return Ok(None);
    };
    let path = op.path.key("responses").key(status);
    let response = object(resolve(doc, raw, &path, "responses")?, &path)?;
    let content = match response.get("content") {
        None => return Ok(None),
        Some(c) => object(c, &path.key("content"))?,
    };
    let Some((media, schema)) = json_content(content, &path.key("content"))? else {
        return Ok(None);
    };
    let schema_path = path.key("content").key(media).key("schema");
    let mut inliner = Inliner::new(doc);
    let Value::Object(root) = inliner.rewrite(schema, &schema_path)? else {
        return Err(OpenApiError::WrongType {
            path: schema_path,
            expected: "a schema object",
            found: json_type(schema),
        });
    };
    Ok(Some(with_defs(root, inliner.finish()?, &schema_path)?))
}

/// What [`export_flow_declarations`] did to one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportAction {
    /// The operation had no declaration; the tool's was added.
    Added,
    /// The operation's declaration was replaced by the tool's (different) one.
    Replaced,
    /// The operation already carried exactly the tool's declaration.
    Unchanged,
    /// The tool declares none, so the operation's declaration was removed.
    Removed,
    /// Neither declares one.
    Absent,
}

/// Writes each tool's signed flow declaration into the operation whose `operationId` is
/// the tool's name; returns what was done per tool, in manifest order. Every tool must have
/// an operation, and no two operations may share an `operationId`; operations without a
/// tool are left as they are.
pub fn export_flow_declarations(
    doc: &mut Value,
    body: &ManifestBody,
) -> Result<Vec<(String, ExportAction)>> {
    type Location = (JsonPath, String, &'static str, Vec<&'static str>);
    let mut locations: BTreeMap<String, Location> = BTreeMap::new();
    let mut used: BTreeSet<&'static str> = BTreeSet::new();
    for op in operations(doc)? {
        let keys = flow_keys(&op)?;
        used.extend(keys.iter().copied());
        let name = operation_id(&op)?;
        // A tool is found by operationId, so with two operations of one id the declaration
        // would land on whichever came last, and the other would be silently forgotten.
        if let Some((first, ..)) = locations.get(name) {
            return Err(OpenApiError::DuplicateOperationId {
                path: op.path,
                name: name.to_owned(),
                first: first.clone(),
            });
        }
        locations.insert(
            name.to_owned(),
            (op.path.clone(), op.route.to_owned(), op.method, keys),
        );
    }
    // An operation without a declaration gets the name the document already uses.
    let document_name = match used.len() {
        1 => used.into_iter().next().unwrap_or(FLOW_EXTENSIONS[0]),
        _ => FLOW_EXTENSIONS[0],
    };
    let mut done = Vec::new();
    for tool in body.tools() {
        let (_, route, method, keys) = locations.get(tool.name()).cloned().ok_or_else(|| {
            OpenApiError::ToolWithoutOperation {
                tool: tool.name().to_owned(),
            }
        })?;
        let operation = doc
            .get_mut("paths")
            .and_then(|p| p.get_mut(&route))
            .and_then(|item| item.get_mut(method))
            .and_then(Value::as_object_mut)
            .ok_or_else(|| OpenApiError::ToolWithoutOperation {
                tool: tool.name().to_owned(),
            })?;
        let existing: Vec<_> = keys
            .iter()
            .map(|key| decode_flow(&operation[*key], JsonPath::root()).ok())
            .collect();
        let action = match tool.flow() {
            Some(flow) => {
                let value = to_value(flow)?;
                let action = if existing.is_empty() {
                    ExportAction::Added
                } else if existing.iter().all(|e| e.as_ref() == Some(flow)) {
                    ExportAction::Unchanged
                } else {
                    ExportAction::Replaced
                };
                let names = if keys.is_empty() {
                    vec![document_name]
                } else {
                    keys
                };
                for name in names {
                    operation.insert(name.into(), value.clone());
                }
                action
            }
            None if keys.is_empty() => ExportAction::Absent,
            None => {
                for key in keys {
                    operation.remove(key);
                }
                ExportAction::Removed
            }
        };
        done.push((tool.name().to_owned(), action));
    }
    Ok(done)
}

#[cfg(test)]
mod tests;
