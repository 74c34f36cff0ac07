//! What a server offers besides tools: resources (by URI or URI template) and prompts, as
//! the publisher signed them. The host lists and serves only these; the label of what a
//! read or a prompt returns starts from the entry's signed `flow.output_label` (joined with
//! the operator's content floor by the registry).
//!
//! Wire form of a resource: exactly one of `uri` (an absolute URI) and `uri_template` (an
//! RFC 6570 level-1 template: `{name}` expressions separated by literal text), `name`
//! (identifier rule), optional `title`, `description` (at most 500 characters each),
//! `mime_type` (identifier rule) and `flow` (`{"output_label": label}`, not `Top`). A prompt:
//! `name` (identifier rule, unique), optional `title`, `description`, `arguments` (each
//! `name` unique, optional `description` and `required`) and `flow`.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::decode::{Fields, ManifestError, check_description, json_type};
use crate::canonical::JsonPath;
use crate::label::InformationLabel;

/// Longest resource URI or template accepted, in bytes.
pub const MAX_URI_BYTES: usize = 2048;
/// The longest URI a client may name (a template's variables may expand beyond what a
/// manifest may sign): a session keeps the URIs it subscribes to, so each is bounded.
pub const MAX_CLIENT_URI_BYTES: usize = 8192;

/// The signed label of what a resource read or a prompt returns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ContentFlow {
    /// The label the content carries (never `Top`).
    pub output_label: InformationLabel,
}

/// Where a resource lives: one URI, or every URI a template expands to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResourceLocator {
    /// One absolute URI.
    Uri(String),
    /// An RFC 6570 level-1 template.
    Template(UriTemplate),
}

impl ResourceLocator {
    /// Whether `uri` is this resource (or one the template expands to).
    pub fn matches(&self, uri: &str) -> bool {
        match self {
            ResourceLocator::Uri(u) => u == uri,
            ResourceLocator::Template(t) => t.matches(uri),
        }
    }

    /// The URI or template text as signed.
    pub fn as_str(&self) -> &str {
        match self {
            ResourceLocator::Uri(u) => u,
            ResourceLocator::Template(t) => &t.text,
        }
    }

    /// Whether some URI could be both `self` and `other` (conservative: two templates
    /// whose literal beginnings or ends are compatible are taken to overlap).
    pub fn may_overlap(&self, other: &ResourceLocator) -> bool {
        match (self, other) {
            (ResourceLocator::Uri(a), ResourceLocator::Uri(b)) => a == b,
            (ResourceLocator::Uri(u), ResourceLocator::Template(t))
            | (ResourceLocator::Template(t), ResourceLocator::Uri(u)) => t.matches(u),
            (ResourceLocator::Template(a), ResourceLocator::Template(b)) => {
                let (pa, pb) = (a.prefix(), b.prefix());
                let (sa, sb) = (a.suffix(), b.suffix());
                (pa.starts_with(pb) || pb.starts_with(pa)) && (sa.ends_with(sb) || sb.ends_with(sa))
            }
        }
    }
}

/// One piece of a URI template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Literal(String),
    Variable,
}

/// An RFC 6570 level-1 URI template (`test://items/{id}/data`). A variable expands to one
/// or more unreserved or percent-encoded characters (simple expansion encodes the rest), so
/// it never spans a `/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UriTemplate {
    text: String,
    pieces: Vec<Piece>,
}

impl UriTemplate {
    /// Parses a level-1 template; the error says what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match rest.find(['{', '}']) {
                Some(at) if rest.as_bytes()[at] == b'}' => {
                    return Err(format!(
                        "a '}}' at byte {} closes no expression",
                        text.len() - rest.len() + at
                    ));
                }
                Some(at) => {
                    if at > 0 {
                        pieces.push(Piece::Literal(rest[..at].to_owned()));
                    } else if matches!(pieces.last(), Some(Piece::Variable)) {
                        return Err("two expressions must be separated by literal text".into());
                    }
                    let close = rest[at..]
                        .find('}')
                        .ok_or_else(|| "an expression is not closed with '}'".to_string())?;
                    let name = &rest[at + 1..at + close];
                    if name.is_empty()
                        || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                    {
                        return Err(format!(
                            "expression {{{name}}} is not a plain variable name (letters, digits, _); operators are not supported"
                        ));
                    }
                    pieces.push(Piece::Variable);
                    rest = &rest[at + close + 1..];
                }
                None => {
                    pieces.push(Piece::Literal(rest.to_owned()));
                    rest = "";
                }
            }
        }
        for piece in &pieces {
            if let Piece::Literal(literal) = piece
                && let Some(fault) = spelling_fault(literal)
            {
                return Err(format!("literal text {literal:?}: {fault}"));
            }
        }
        if let Some(Piece::Literal(first)) = pieces.first()
            && let Some(fault) = case_fault(first)
        {
            return Err(fault);
        }
        if !pieces.contains(&Piece::Variable) {
            return Err("a template has at least one {variable}; use uri for one URI".into());
        }
        let prefix = match pieces.first() {
            Some(Piece::Literal(l)) => l.as_str(),
            _ => "",
        };
        check_scheme(prefix).map_err(|e| format!("{e} before its first expression"))?;
        Ok(UriTemplate {
            text: text.to_owned(),
            pieces,
        })
    }

    /// Whether `uri` is one this template expands to: literal text matches itself, and each
    /// variable matches one or more of `A-Z a-z 0-9 - . _ ~ %`.
    ///
    /// Takes time proportional to the URI's length times the template's, whatever the URI:
    /// the URI comes from clients, and trying every way of splitting it between variables
    /// (as a backtracking matcher does) is exponential in the number of variables.
    pub fn matches(&self, uri: &str) -> bool {
        let uri = uri.as_bytes();
        // `at[i]`: the pieces matched so far can end at byte `i` (start before byte 0).
        // Each piece turns that set into the next one, so no split is ever tried twice.
        let mut at = vec![false; uri.len() + 1];
        at[0] = true;
        let mut next = vec![false; uri.len() + 1];
        for piece in &self.pieces {
            next.fill(false);
            match piece {
                Piece::Literal(literal) => {
                    let literal = literal.as_bytes();
                    for (start, _) in at.iter().enumerate().filter(|(_, reached)| **reached) {
                        if uri[start..].starts_with(literal) {
                            next[start + literal.len()] = true;
                        }
                    }
                }
                Piece::Variable => {
                    // One sweep: a variable can end after byte `i` when some reachable
                    // start at or before `i` is followed by variable bytes only up to `i`.
                    let mut open = false;
                    for (i, byte) in uri.iter().enumerate() {
                        open |= at[i];
                        if variable_byte(*byte) {
                            next[i + 1] = open;
                        } else {
                            open = false;
                        }
                    }
                }
            }
            std::mem::swap(&mut at, &mut next);
            if !at.contains(&true) {
                return false;
            }
        }
        at[uri.len()]
    }

    fn prefix(&self) -> &str {
        match self.pieces.first() {
            Some(Piece::Literal(l)) => l,
            _ => "",
        }
    }

    fn suffix(&self) -> &str {
        match self.pieces.last() {
            Some(Piece::Literal(l)) => l,
            _ => "",
        }
    }
}

/// Bytes a URI holds as they are (RFC 3986's unreserved characters, gen-delims and
/// sub-delims): each stands for itself and is never escaped.
fn literal_uri_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=".contains(&byte)
}

/// Why `text` is not in the one spelling URIs are routed in, if it is not. Each byte a URI
/// may hold as it is ([`literal_uri_byte`]) is written as it is; every other byte is
/// escaped as `%` and two upper-case hex digits; a backslash is neither (an executor may
/// read it as a `/`). So one URI has one spelling: an executor that decodes escapes reads
/// two different spellings as two different names. Otherwise `file:///docs/a%28b%29`, read
/// as `file:///docs/a(b)` by the executor, would miss the exact URI `file:///docs/a(b)` its
/// server signed (and the label on it) and be routed through a template that matches the
/// escapes instead.
pub(crate) fn spelling_fault(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'%' {
            let digit = |at: usize| {
                bytes.get(at).and_then(|b| {
                    char::from(*b)
                        .to_digit(16)
                        .filter(|_| !b.is_ascii_lowercase())
                })
            };
            let (Some(hi), Some(lo)) = (digit(i + 1), digit(i + 2)) else {
                return Some(format!(
                    "the % at byte {i} does not start an escape of two upper-case hex digits"
                ));
            };
            // Two hex digits: at most 0xff.
            let decoded = (hi * 16 + lo) as u8;
            // A control character (NUL above all, which C file APIs end a name at) stands
            // for nothing a resource is named by.
            if decoded < 0x20 || decoded == 0x7f {
                return Some(format!(
                    "{} at byte {i} escapes a control character",
                    &text[i..i + 3]
                ));
            }
            if literal_uri_byte(decoded) || decoded == b'\\' {
                return Some(format!(
                    "{} at byte {i} escapes {:?}, which a URI holds as it is",
                    &text[i..i + 3],
                    char::from(decoded)
                ));
            }
            i += 3;
        } else if literal_uri_byte(byte) {
            i += 1;
        } else {
            let shown = text[i..]
                .chars()
                .next()
                .unwrap_or(char::REPLACEMENT_CHARACTER);
            return Some(format!(
                "{shown:?} at byte {i} is not held in a URI as it is; escape it (%XX, upper-case)"
            ));
        }
    }
    None
}

/// `uri` rewritten in its one spelling ([`spelling_fault`], [`case_fault`]): an escape of
/// a byte a URI holds as it is decoded, every other escape's hex upper-cased, every byte a
/// URI does not hold as it is escaped, the scheme and authority lower-cased. `None` when no
/// spelling stands for it: an escape that is not one, a control character (raw or
/// escaped), a backslash, or a `.` or `..` path segment. What an executor names a resource
/// by in its answer is judged by this spelling (an honest server's standard expansion of a
/// template escapes what the one spelling holds as it is).
pub(crate) fn one_spelling(uri: &str) -> Option<String> {
    let bytes = uri.as_bytes();
    let mut out = String::with_capacity(uri.len());
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'%' {
            let hex = uri.get(i + 1..i + 3)?;
            let decoded = u8::from_str_radix(hex, 16).ok()?;
            if hex.starts_with(['+', '-']) || decoded < 0x20 || decoded == 0x7f || decoded == b'\\'
            {
                return None;
            }
            if literal_uri_byte(decoded) {
                out.push(char::from(decoded));
            } else {
                out.push_str(&format!("%{decoded:02X}"));
            }
            i += 3;
        } else if literal_uri_byte(byte) {
            out.push(char::from(byte));
            i += 1;
        } else if byte < 0x20 || byte == 0x7f || byte == b'\\' {
            return None;
        } else {
            out.push_str(&format!("%{byte:02X}"));
            i += 1;
        }
    }
    let (scheme, rest) = out.split_once(':')?;
    let mut spelt = scheme.to_ascii_lowercase();
    spelt.push(':');
    match rest.strip_prefix("//") {
        Some(after) => {
            let end = after.find(['/', '?', '#']).unwrap_or(after.len());
            spelt.push_str("//");
            spelt.push_str(&after[..end].to_ascii_lowercase());
            spelt.push_str(&after[end..]);
        }
        None => spelt.push_str(rest),
    }
    let path = spelt.split(['?', '#']).next().unwrap_or(&spelt);
    if path.split('/').any(|s| s == "." || s == "..") {
        return None;
    }
    Some(spelt)
}

/// Why the scheme and authority `text` begins with are not in lower case, if they are not:
/// both are case-insensitive, so an executor may read `DOCS://Secret` as `docs://secret`
/// (Python's `urlparse().hostname` does), while a route would take them as two names.
fn case_fault(text: &str) -> Option<String> {
    let (scheme, rest) = text.split_once(':')?;
    let authority = rest
        .strip_prefix("//")
        .map(|r| r.split(['/', '?', '#']).next().unwrap_or(r))
        .unwrap_or("");
    // The hex digits of an escape are upper case by the spelling rule, not letters of it.
    let upper = |part: &str| {
        let mut skip = 0;
        part.bytes().any(|b| {
            if skip > 0 {
                skip -= 1;
                return false;
            }
            if b == b'%' {
                skip = 2;
            }
            b.is_ascii_uppercase()
        })
    };
    [scheme, authority].iter().any(|part| upper(part)).then(|| {
        "its scheme or authority has upper-case letters; write them in lower case (they \
             are case-insensitive)"
            .to_string()
    })
}

/// Why a client's `uri` is not one that is routed, if it is not: longer than
/// [`MAX_CLIENT_URI_BYTES`], not in the one spelling ([`spelling_fault`], a scheme and
/// authority in lower case), or with a path segment `.` or `..` (an executor resolving
/// dot segments would read another URI).
pub(crate) fn uri_fault(uri: &str) -> Option<String> {
    if uri.len() > MAX_CLIENT_URI_BYTES {
        return Some(format!("longer than {MAX_CLIENT_URI_BYTES} bytes"));
    }
    if let Some(fault) = spelling_fault(uri).or_else(|| case_fault(uri)) {
        return Some(fault);
    }
    let path = uri.split(['?', '#']).next().unwrap_or(uri);
    path.split('/')
        .any(|segment| segment == "." || segment == "..")
        .then(|| "a path segment is . or ..".to_string())
}

/// Why a client's resource URI reaches no signed resource of a server, or not exactly one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnroutableUri {
    /// Not a URI any read is routed by ([`uri_fault`]).
    #[error("resource URI {uri:?} is not spelt as flowhost routes it: {reason}")]
    Spelling {
        /// The URI as the client sent it.
        uri: String,
        /// What is wrong with its spelling.
        reason: String,
    },
    /// No signed URI or template is it.
    #[error("no registered server signed a resource {uri:?}")]
    NotSigned {
        /// The URI as the client sent it.
        uri: String,
    },
    /// Two templates of one server match it: which content (and label) the executor
    /// serves would be its own choice, so the read is served by neither.
    #[error(
        "resource URI {uri:?} matches two templates server {server_id} signed, {first:?} and \
         {second:?}: a read must reach exactly one"
    )]
    Ambiguous {
        /// The URI as the client sent it.
        uri: String,
        /// The server that signed both templates.
        server_id: String,
        /// The first template, as signed.
        first: String,
        /// The second template, as signed.
        second: String,
    },
}

impl UnroutableUri {
    /// This refusal as a client is told it: an ambiguous URI names neither the server nor
    /// its templates, which a principal that may not use them may not list (the host logs
    /// them).
    pub fn client_words(&self) -> String {
        match self {
            UnroutableUri::Ambiguous { .. } => {
                "the resource URI matches two templates one server signed: a read must reach \
                 exactly one (the host's log names them)"
                    .to_string()
            }
            other => other.to_string(),
        }
    }
}

/// Whether a template variable's value may hold `byte`: unreserved characters and `%`
/// (simple expansion percent-encodes everything else).
fn variable_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-._~%".contains(&byte)
}

/// One resource (or resource template) of a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceDefinition {
    locator: ResourceLocator,
    name: String,
    title: Option<String>,
    description: Option<String>,
    mime_type: Option<String>,
    flow: Option<ContentFlow>,
}

impl ResourceDefinition {
    /// Where the resource lives.
    pub fn locator(&self) -> &ResourceLocator {
        &self.locator
    }

    /// The resource's name (what principals' patterns name, `server/name`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The display title as signed, if any.
    pub fn title(&self) -> Option<&str> {
        self.title.as_deref()
    }

    /// The description as signed, if any.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// The MIME type, if declared.
    pub fn mime_type(&self) -> Option<&str> {
        self.mime_type.as_deref()
    }

    /// The signed label of what a read returns, if declared.
    pub fn flow(&self) -> Option<&ContentFlow> {
        self.flow.as_ref()
    }
}

impl Serialize for ResourceDefinition {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = serializer.serialize_map(None)?;
        match &self.locator {
            ResourceLocator::Uri(u) => m.serialize_entry("uri", u)?,
            ResourceLocator::Template(t) => m.serialize_entry("uri_template", &t.text)?,
        }
        m.serialize_entry("name", &self.name)?;
        for (key, value) in [
            ("title", &self.title),
            ("description", &self.description),
            ("mime_type", &self.mime_type),
        ] {
            if let Some(v) = value {
                m.serialize_entry(key, v)?;
            }
        }
        if let Some(flow) = &self.flow {
            m.serialize_entry("flow", flow)?;
        }
        m.end()
    }
}

/// One argument of a prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PromptArgument {
    /// The argument's name (unique in its prompt).
    pub name: String,
    /// What it is for, if said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Whether a `prompts/get` must give it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub required: bool,
}

/// One prompt of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PromptDefinition {
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    title: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    arguments: Vec<PromptArgument>,
    #[serde(skip_serializing_if = "Option::is_none")]
    flow: Option<ContentFlow>,
}

impl PromptDefinition {
    /// The prompt's name, unique within its manifest.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The display title as signed, if any.
    pub fn title(&self) -> Option<&str> {
        self.title.as_deref()
    }

    /// The description as signed, if any.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// The arguments, in signed order.
    pub fn arguments(&self) -> &[PromptArgument] {
        &self.arguments
    }

    /// The signed label of what the prompt returns, if declared.
    pub fn flow(&self) -> Option<&ContentFlow> {
        self.flow.as_ref()
    }

    /// Checks `prompts/get` arguments: an object (or absent) of strings, each declared, every
    /// required one given. The error names argument names only, never values.
    pub fn check_arguments(&self, arguments: Option<&Value>) -> Result<(), String> {
        let empty = serde_json::Map::new();
        let given = match arguments {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(map)) => map,
            Some(other) => {
                return Err(format!(
                    "arguments must be an object, found {}",
                    json_type(other)
                ));
            }
        };
        for (name, value) in given {
            if !self.arguments.iter().any(|a| &a.name == name) {
                return Err(format!("prompt {:?} has no argument {name:?}", self.name));
            }
            if !value.is_string() {
                return Err(format!("argument {name:?} must be a string"));
            }
        }
        match self
            .arguments
            .iter()
            .find(|a| a.required && !given.contains_key(&a.name))
        {
            Some(missing) => Err(format!("missing required argument {:?}", missing.name)),
            None => Ok(()),
        }
    }
}

const RESOURCE_FIELDS: &[&str] = &[
    "uri",
    "uri_template",
    "name",
    "title",
    "description",
    "mime_type",
    "flow",
];
const PROMPT_FIELDS: &[&str] = &["name", "title", "description", "arguments", "flow"];
const ARGUMENT_FIELDS: &[&str] = &["name", "description", "required"];
const FLOW_FIELDS: &[&str] = &["output_label"];

/// `scheme:` at the start of `text` (RFC 3986: a letter, then letters, digits, `+-.`).
fn check_scheme(text: &str) -> Result<(), String> {
    let scheme = text
        .split_once(':')
        .map(|(s, _)| s)
        .ok_or_else(|| "no scheme (such as \"file:\" or \"test:\")".to_string())?;
    let mut chars = scheme.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    if ok {
        Ok(())
    } else {
        Err(format!("scheme {scheme:?} is not a URI scheme"))
    }
}

fn check_uri_text(text: &str) -> Result<(), String> {
    if text.len() > MAX_URI_BYTES {
        return Err(format!(
            "{} bytes; the limit is {MAX_URI_BYTES}",
            text.len()
        ));
    }
    if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("contains whitespace or a control character".into());
    }
    // Listed to clients as signed: one that draws nothing or reorders what follows would
    // show as another URI, as an identifier would. The zero-width joiners identifiers
    // allow for the scripts that spell with them are refused too: a URI carries such text
    // percent-encoded, and they would only make one URI look like another.
    if let Some(c) = text
        .chars()
        .find(|c| crate::ident::is_invisible(*c) || matches!(c, '\u{200c}' | '\u{200d}'))
    {
        return Err(format!(
            "contains U+{:04X}, which draws nothing or reorders what follows",
            u32::from(c)
        ));
    }
    Ok(())
}

fn decode_content_flow(value: &Value, at: &JsonPath) -> Result<ContentFlow, ManifestError> {
    let fields = Fields::new(value, at, FLOW_FIELDS)?;
    let path = fields.path("output_label");
    let output_label: InformationLabel =
        serde_json::from_value(fields.required("output_label")?.clone()).map_err(|e| {
            ManifestError::MalformedFlow {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
    if output_label.is_top() {
        return Err(ManifestError::TopInFlow {
            path,
            reason: crate::flow::ToolFlowError::TopOutputLabel,
        });
    }
    Ok(ContentFlow { output_label })
}

fn optional_text(
    fields: &Fields<'_>,
    field: &'static str,
) -> Result<Option<String>, ManifestError> {
    fields
        .optional_str(field)?
        .map(|t| check_description(t, fields.path(field)))
        .transpose()
}

impl ResourceDefinition {
    /// Decodes and checks one resource; `at` is its location (for example `resources[1]`).
    pub fn from_json_value(value: &Value, at: &JsonPath) -> Result<Self, ManifestError> {
        let fields = Fields::new(value, at, RESOURCE_FIELDS)?;
        let locator = match (
            fields.optional_str("uri")?,
            fields.optional_str("uri_template")?,
        ) {
            (Some(uri), None) => {
                let bad = |reason: String| ManifestError::InvalidResourceUri {
                    path: fields.path("uri"),
                    reason,
                };
                check_uri_text(uri).map_err(bad)?;
                if uri.contains(['{', '}']) {
                    return Err(bad("has braces; a template goes in uri_template".into()));
                }
                check_scheme(uri).map_err(bad)?;
                // A client reaches only a URI in the one spelling: one signed otherwise
                // could never be read as signed, and its label never be the one applied.
                if let Some(fault) = uri_fault(uri) {
                    return Err(bad(fault));
                }
                ResourceLocator::Uri(uri.to_owned())
            }
            (None, Some(template)) => {
                let bad = |reason: String| ManifestError::InvalidResourceUri {
                    path: fields.path("uri_template"),
                    reason,
                };
                check_uri_text(template).map_err(bad)?;
                ResourceLocator::Template(UriTemplate::parse(template).map_err(bad)?)
            }
            _ => {
                return Err(ManifestError::ResourceLocatorChoice { path: at.clone() });
            }
        };
        let name = fields.identifier("name", "resource name")?.to_owned();
        let mime_type = match fields.optional("mime_type")? {
            Some(_) => Some(fields.identifier("mime_type", "MIME type")?.to_owned()),
            None => None,
        };
        Ok(ResourceDefinition {
            locator,
            name,
            title: optional_text(&fields, "title")?,
            description: optional_text(&fields, "description")?,
            mime_type,
            flow: fields
                .optional("flow")?
                .map(|v| decode_content_flow(v, &fields.path("flow")))
                .transpose()?,
        })
    }
}

impl PromptDefinition {
    /// Decodes and checks one prompt; `at` is its location (for example `prompts[0]`).
    pub fn from_json_value(value: &Value, at: &JsonPath) -> Result<Self, ManifestError> {
        let fields = Fields::new(value, at, PROMPT_FIELDS)?;
        let name = fields.identifier("name", "prompt name")?.to_owned();
        let mut arguments = Vec::new();
        if let Some(list) = fields.optional("arguments")? {
            let list_path = fields.path("arguments");
            let items = list.as_array().ok_or_else(|| ManifestError::WrongType {
                path: list_path.clone(),
                expected: "an array of arguments",
                found: json_type(list),
            })?;
            let mut seen: BTreeMap<String, usize> = BTreeMap::new();
            for (index, item) in items.iter().enumerate() {
                let item_path = list_path.index(index);
                let f = Fields::new(item, &item_path, ARGUMENT_FIELDS)?;
                let arg = f.identifier("name", "prompt argument name")?.to_owned();
                if let Some(first) = seen.insert(arg.clone(), index) {
                    return Err(ManifestError::DuplicateName {
                        path: item_path.key("name"),
                        name: arg,
                        first: list_path.index(first).key("name"),
                    });
                }
                arguments.push(PromptArgument {
                    name: arg,
                    description: optional_text(&f, "description")?,
                    required: match f.optional("required")? {
                        Some(_) => f.required_bool("required")?,
                        None => false,
                    },
                });
            }
        }
        Ok(PromptDefinition {
            name,
            title: optional_text(&fields, "title")?,
            description: optional_text(&fields, "description")?,
            arguments,
            flow: fields
                .optional("flow")?
                .map(|v| decode_content_flow(v, &fields.path("flow")))
                .transpose()?,
        })
    }
}

/// Decodes an optional list (`resources` or `prompts`) of a body, refusing an entry whose
/// key (`key` of each decoded entry) repeats an earlier one.
pub(super) fn decode_list<T>(
    fields: &Fields<'_>,
    field: &'static str,
    decode: impl Fn(&Value, &JsonPath) -> Result<T, ManifestError>,
    key: impl Fn(&T) -> (String, &'static str),
) -> Result<Vec<T>, ManifestError> {
    let Some(value) = fields.optional(field)? else {
        return Ok(Vec::new());
    };
    let path = fields.path(field);
    let items = value.as_array().ok_or_else(|| ManifestError::WrongType {
        path: path.clone(),
        expected: "an array",
        found: json_type(value),
    })?;
    if items.is_empty() {
        return Err(ManifestError::EmptyList { path });
    }
    let mut out = Vec::with_capacity(items.len());
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (index, item) in items.iter().enumerate() {
        let entry = decode(item, &path.index(index))?;
        let (k, key_field) = key(&entry);
        if let Some(first) = seen.insert(k.clone(), index) {
            return Err(ManifestError::DuplicateName {
                path: path.index(index).key(key_field),
                name: k,
                first: path.index(first).key(key_field),
            });
        }
        out.push(entry);
    }
    Ok(out)
}
