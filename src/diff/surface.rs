//! The declared tool surface an operator writes, which the diff judges observed decisions
//! against.
//!
//! **Declared** (`assay.declared_tool_surface.v0`): the privileged actions expected in a run.
//! [`DeclaredSurface::parse`] validates it strictly (a key named twice anywhere is refused)
//! and names the entry (index and id) and the field of every error. Each declared target field becomes a [`FieldRule`] on one observed
//! target field:
//!
//! | provider | declared field | observed field | compared as |
//! |---|---|---|---|
//! | `github` | `key_title` | `key_title_hash` | hash, domain `github_key_title` |
//! | `slack` | `workspace_id` | `workspace_id_hash` | hash, domain `slack_workspace` |
//! | `slack` | `channel_id` | `channel_id_hash` | hash, domain `slack_channel` |
//! | `slack` | `principal` | `principal_hash` | hash, domain `slack_principal` |
//! | `workspace` | `workspace_id` | `workspace_id_hash` | hash, domain `workspace` |
//! | `workspace` | `principal` | `principal_hash` | hash, domain `workspace_principal` |
//! | `network` | `address` | `address` | IP address or CIDR, containment (IPv4-mapped IPv6 as IPv4) |
//! | `network` | `port` | `port` | port number |
//! | any | `<name>_hash` | `<name>_hash` | a `sha256:` value, exact |
//! | any other | `<name>` | `<name>` | plain, exact (case-sensitive) |
//!
//! A hashed field may be declared by its plain value (hashed here with the domain, after trim
//! and lowercase) or directly as `sha256:<hex>`. For an operator-defined provider, a plain
//! declared `<name>` whose value is `sha256:<hex>` also matches an observed `<name>_hash`
//! (operator domains are not known here, so such fields are declared by hash). `"*"` or an
//! absent field matches anything; an empty `allowed_targets` means no target constraint. A
//! name lookup (verb `dns_query`) is judged by its name: see [`TargetConstraint::test_lookup`].
//! A network target also answers to `verb` (the record's action verb: `connect`, `sendto`,
//! `bind`, `listen`, ...), and a `bind` or `listen` is covered only by a declared target
//! naming its verb: see [`TargetConstraint::test_inbound`].
//! `allowed_effects` lists one or more of `allow`, `deny` and `error`: an observed effect
//! matches only a declaration listing it, so a call that errored (its `tool_outcome`, whose
//! effect may have happened) is expected only where `error` is declared.
//!
//! The observed half (the envelope flowhost exports) is `records::export`.

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value};

use crate::canonical::JsonError;
use crate::records::chain::ChainHash;
use crate::records::projection::{NETWORK_PROVIDER, target_hash};
use crate::records::{Effect, is_code};
use crate::resolve::destination::{canonical_ip, canonical_net};

/// The declared surface's schema string.
pub const DECLARED_SCHEMA: &str = "assay.declared_tool_surface.v0";

/// Declared fields the observed record carries hashed: (provider, declared field, observed
/// field, hash domain).
const HASHED_FIELDS: [(&str, &str, &str, &str); 6] = [
    ("github", "key_title", "key_title_hash", "github_key_title"),
    (
        "slack",
        "workspace_id",
        "workspace_id_hash",
        "slack_workspace",
    ),
    ("slack", "channel_id", "channel_id_hash", "slack_channel"),
    ("slack", "principal", "principal_hash", "slack_principal"),
    (
        "workspace",
        "workspace_id",
        "workspace_id_hash",
        "workspace",
    ),
    (
        "workspace",
        "principal",
        "principal_hash",
        "workspace_principal",
    ),
];

/// A declared surface that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SurfaceError {
    /// The file is not JSON.
    #[error("declared surface is not JSON: {0}")]
    Json(String),
    /// An object names a key twice.
    #[error(
        "declared surface: {path}: the key {key:?} appears twice (line {line}, column {column}); readers keeping the first and the last value would declare different actions, so write it once"
    )]
    RepeatedKey {
        /// The object holding the key (e.g. `declared_tool_actions[0].allowed_targets[0]`).
        path: String,
        /// The key.
        key: String,
        /// 1-based line of its second occurrence.
        line: usize,
        /// 1-based column of its second occurrence.
        column: usize,
    },
    /// A top-level problem.
    #[error("declared surface: field {field}: {problem}")]
    Document {
        /// The top-level field.
        field: String,
        /// What is wrong.
        problem: String,
    },
    /// A problem in one declared action.
    #[error("declared_tool_actions[{index}] (id {id}): field {field}: {problem}")]
    Entry {
        /// The entry's index.
        index: usize,
        /// The entry's id (`?` when it has none).
        id: String,
        /// The field at fault (e.g. `allowed_targets[0].port`).
        field: String,
        /// What is wrong.
        problem: String,
    },
}

/// A scalar of an observed target, as the matcher sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalarView<'a> {
    /// A string.
    Text(&'a str),
    /// A non-negative integer.
    Integer(u64),
    /// A boolean.
    Flag(bool),
    /// Anything else (never matches a constraint).
    Other,
}

/// The outcome of testing one constraint against one observed target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetMatch {
    /// Every constrained field is present and satisfied.
    Match,
    /// A present field contradicts the constraint.
    Mismatch,
    /// No present field contradicts it, but a constrained field is missing from the observed
    /// target, so it cannot be decided.
    Undetermined,
}

/// How one declared field constrains one observed field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldRule {
    /// Exact string equality.
    Text(String),
    /// Exact string equality, or (when the observed field is absent) equality of the
    /// `sha256:` value with the observed `<field>_hash`.
    TextOrHash {
        /// The declared value (a `sha256:` hash).
        value: String,
        /// The observed hash field to try.
        hash_field: String,
    },
    /// Equality with the observed `sha256:` hash.
    Hash(String),
    /// Exact integer equality (ports, numbers).
    Integer(u64),
    /// Exact boolean equality.
    Flag(bool),
    /// The observed address lies in this network (a single address is a /32 or /128). Both
    /// are taken in enforcement's form: an IPv4-mapped IPv6 address or network is the IPv4
    /// one it carries, so `10.0.0.0/8` covers `::ffff:10.0.0.5` and `::/0` covers no IPv4.
    Network(IpNet),
}

/// One declared target field: which observed field it constrains, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldConstraint {
    /// The observed target field.
    pub observed: String,
    /// The rule.
    pub rule: FieldRule,
}

/// One `allowed_targets` entry ("*" fields are dropped: they constrain nothing).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TargetConstraint {
    /// The constrained fields.
    pub fields: Vec<FieldConstraint>,
}

/// The fields of a name lookup's target that describe the resolver asked (its address, port
/// 53, the transport), not what the lookup reaches: the name.
const RESOLVER_FIELDS: [&str; 4] = ["address", "port", "protocol", "family"];

impl TargetConstraint {
    /// Tests the constraint against an observed target, given as a field lookup.
    pub fn test<'a>(&self, get: impl Fn(&str) -> Option<ScalarView<'a>>) -> TargetMatch {
        self.test_fields(get, |_| true)
    }

    /// Tests the constraint against the target of a `bind` or `listen` (a listener, an
    /// address taken for one): only a constraint that names the `verb` can cover one, so a
    /// declaration of outbound traffic (`{"port": 8443}`) never covers a listener opened on
    /// that port, and `{"verb": "listen", "port": 8443}` covers that listener alone.
    pub fn test_inbound<'a>(&self, get: impl Fn(&str) -> Option<ScalarView<'a>>) -> TargetMatch {
        if !self.fields.iter().any(|c| c.observed == "verb") {
            return TargetMatch::Mismatch;
        }
        self.test(get)
    }

    /// Tests the constraint against a name lookup's target (verb `dns_query`): what a lookup
    /// reaches is its name, so only a constraint that names `host_name` can match one, and
    /// its address, port, protocol and family constraints, which would otherwise be judged
    /// against the resolver, are not. A constraint of the resolver's address or port 53 thus
    /// covers no lookup, and `{"host_name": "api.example", "port": 443}` covers both the
    /// connection and the lookup of its name, as the host decides lookups by name.
    pub fn test_lookup<'a>(&self, get: impl Fn(&str) -> Option<ScalarView<'a>>) -> TargetMatch {
        // A lookup recorded with its resolver but no name (a query not served) asked for
        // nothing a name can cover; one recorded without a destination at all (a folded
        // refusal) cannot be told, and is judged undetermined below.
        let unnamed = get("host_name").is_none() && get("address").is_some();
        if unnamed || !self.fields.iter().any(|c| c.observed == "host_name") {
            return TargetMatch::Mismatch;
        }
        self.test_fields(get, |c| !RESOLVER_FIELDS.contains(&c.observed.as_str()))
    }

    fn test_fields<'a>(
        &self,
        get: impl Fn(&str) -> Option<ScalarView<'a>>,
        judged: impl Fn(&FieldConstraint) -> bool,
    ) -> TargetMatch {
        let mut undetermined = false;
        for c in self.fields.iter().filter(|c| judged(c)) {
            let observed = get(&c.observed);
            let ok = match (&c.rule, observed) {
                (FieldRule::TextOrHash { value, hash_field }, None) => match get(hash_field) {
                    Some(ScalarView::Text(h)) => Some(h == value),
                    Some(_) => Some(false),
                    None => None,
                },
                (_, None) => None,
                (FieldRule::Text(v), Some(ScalarView::Text(o)))
                | (FieldRule::TextOrHash { value: v, .. }, Some(ScalarView::Text(o)))
                | (FieldRule::Hash(v), Some(ScalarView::Text(o))) => Some(v == o),
                (FieldRule::Integer(v), Some(ScalarView::Integer(o))) => Some(*v == o),
                // Only the integer's own decimal text: "042" or "+42" may name another
                // thing to the tool that received the string.
                (FieldRule::Integer(v), Some(ScalarView::Text(o))) => Some(o == v.to_string()),
                (FieldRule::Flag(v), Some(ScalarView::Flag(o))) => Some(*v == o),
                // Observed addresses are what the broker saw, possibly IPv4-mapped IPv6;
                // like enforcement, judge them as the IPv4 address they carry.
                (FieldRule::Network(net), Some(ScalarView::Text(o))) => Some(
                    o.parse::<IpAddr>()
                        .is_ok_and(|a| net.contains(&canonical_ip(a))),
                ),
                (_, Some(_)) => Some(false),
            };
            match ok {
                Some(true) => {}
                Some(false) => return TargetMatch::Mismatch,
                None => undetermined = true,
            }
        }
        if undetermined {
            TargetMatch::Undetermined
        } else {
            TargetMatch::Match
        }
    }
}

/// One declared action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclaredAction {
    /// Its position in `declared_tool_actions`.
    pub index: usize,
    /// Its id.
    pub id: String,
    /// The provider (compared with the observed `action.target.provider`).
    pub provider: String,
    /// The action class (compared with the observed `tool.category`).
    pub action_class: String,
    /// The target constraints (empty: any target).
    pub allowed_targets: Vec<TargetConstraint>,
    /// The effects it expects (`allow`, `deny`, `error`); an observed effect matches only
    /// when listed here, so `allow` never covers an `error`.
    pub allowed_effects: BTreeSet<Effect>,
    /// Review metadata, not a match key.
    pub required_decision: String,
}

impl DeclaredAction {
    /// Tests an observed target against the declared targets: `Match` if any entry matches
    /// (or there are none), else `Undetermined` if any entry could not be decided, else
    /// `Mismatch`.
    pub fn test_target<'a>(&self, get: impl Fn(&str) -> Option<ScalarView<'a>>) -> TargetMatch {
        self.test_targets(|t| t.test(&get))
    }

    /// [`DeclaredAction::test_target`] for a name lookup's target (see
    /// [`TargetConstraint::test_lookup`]): a declaration without targets covers none (only a
    /// target naming the host covers a lookup, since a name can spell a secret).
    pub fn test_lookup_target<'a>(
        &self,
        get: impl Fn(&str) -> Option<ScalarView<'a>>,
    ) -> TargetMatch {
        if self.allowed_targets.is_empty() {
            return TargetMatch::Mismatch;
        }
        self.test_targets(|t| t.test_lookup(&get))
    }

    /// [`DeclaredAction::test_target`] for the target of a `bind` or `listen` (see
    /// [`TargetConstraint::test_inbound`]): a declaration without targets covers none.
    pub fn test_inbound_target<'a>(
        &self,
        get: impl Fn(&str) -> Option<ScalarView<'a>>,
    ) -> TargetMatch {
        if self.allowed_targets.is_empty() {
            return TargetMatch::Mismatch;
        }
        self.test_targets(|t| t.test_inbound(&get))
    }

    fn test_targets(&self, test: impl Fn(&TargetConstraint) -> TargetMatch) -> TargetMatch {
        if self.allowed_targets.is_empty() {
            return TargetMatch::Match;
        }
        let mut best = TargetMatch::Mismatch;
        for t in &self.allowed_targets {
            match test(t) {
                TargetMatch::Match => return TargetMatch::Match,
                TargetMatch::Undetermined => best = TargetMatch::Undetermined,
                TargetMatch::Mismatch => {}
            }
        }
        best
    }
}

/// A validated declared surface.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeclaredSurface {
    /// The declared actions, in file order.
    pub actions: Vec<DeclaredAction>,
}

impl DeclaredSurface {
    /// Parses and validates a declared surface (see the module docs for the field rules).
    /// The JSON is parsed strictly: a key named twice anywhere is refused
    /// ([`SurfaceError::RepeatedKey`]), never resolved to one of its values.
    pub fn parse(text: &str) -> Result<Self, SurfaceError> {
        let doc = crate::canonical::parse_strict(text).map_err(|e| match e {
            JsonError::DuplicateKey {
                path,
                key,
                line,
                column,
            } => SurfaceError::RepeatedKey {
                path: path.to_string(),
                key,
                line,
                column,
            },
            other => SurfaceError::Json(other.to_string()),
        })?;
        let top = |field: &str, problem: &str| SurfaceError::Document {
            field: field.to_string(),
            problem: problem.to_string(),
        };
        let obj = doc
            .as_object()
            .ok_or_else(|| top("(document)", "must be a JSON object"))?;
        for key in obj.keys() {
            if !matches!(
                key.as_str(),
                "schema" | "declared_tool_actions" | "non_claims"
            ) {
                return Err(top(key, "unknown field"));
            }
        }
        match obj.get("schema") {
            Some(Value::String(s)) if s == DECLARED_SCHEMA => {}
            _ => return Err(top("schema", &format!("must be {DECLARED_SCHEMA:?}"))),
        }
        let entries = obj
            .get("declared_tool_actions")
            .and_then(Value::as_array)
            .ok_or_else(|| top("declared_tool_actions", "must be an array"))?;
        let mut ids = BTreeSet::new();
        let mut actions = Vec::with_capacity(entries.len());
        for (index, entry) in entries.iter().enumerate() {
            let action = parse_action(index, entry)?;
            if !ids.insert(action.id.clone()) {
                return Err(SurfaceError::Entry {
                    index,
                    id: action.id,
                    field: "id".into(),
                    problem: "duplicate id".into(),
                });
            }
            actions.push(action);
        }
        Ok(DeclaredSurface { actions })
    }
}

fn parse_action(index: usize, entry: &Value) -> Result<DeclaredAction, SurfaceError> {
    let id_hint = entry
        .get("id")
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_string();
    let bad = |field: &str, problem: String| SurfaceError::Entry {
        index,
        id: id_hint.clone(),
        field: field.to_string(),
        problem,
    };
    let obj = entry
        .as_object()
        .ok_or_else(|| bad("(entry)", "must be an object".into()))?;
    for key in obj.keys() {
        if !matches!(
            key.as_str(),
            "id" | "provider"
                | "action_class"
                | "allowed_targets"
                | "allowed_effects"
                | "required_decision"
                | "description"
        ) {
            return Err(bad(key, "unknown field".into()));
        }
    }
    let string = |field: &str| -> Result<String, SurfaceError> {
        match obj.get(field) {
            Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.clone()),
            Some(_) => Err(bad(field, "must be a non-empty string".into())),
            None => Err(bad(field, "is required".into())),
        }
    };
    let id = string("id")?;
    let provider = string("provider")?;
    let action_class = string("action_class")?;
    let required_decision = string("required_decision")?;
    if !is_code(&provider) {
        return Err(bad("provider", format!("{provider:?} must be snake_case")));
    }
    if !is_code(&action_class) {
        return Err(bad(
            "action_class",
            format!("{action_class:?} must be snake_case"),
        ));
    }
    let effects = obj
        .get("allowed_effects")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("allowed_effects", "must be an array".into()))?;
    if effects.is_empty() {
        return Err(bad(
            "allowed_effects",
            "must list at least one of \"allow\", \"deny\", \"error\"".into(),
        ));
    }
    let mut allowed_effects = BTreeSet::new();
    for (i, e) in effects.iter().enumerate() {
        let effect = match e.as_str() {
            Some("allow") => Effect::Allow,
            Some("deny") => Effect::Deny,
            // An errored call (a tool or executor failure after the allow, or a host failure)
            // may have had its effect, so it is expected only where `error` is listed.
            Some("error") => Effect::Error,
            _ => {
                return Err(bad(
                    &format!("allowed_effects[{i}]"),
                    format!("{e} is not \"allow\", \"deny\" or \"error\""),
                ));
            }
        };
        if !allowed_effects.insert(effect) {
            return Err(bad(&format!("allowed_effects[{i}]"), "listed twice".into()));
        }
    }
    let targets = obj
        .get("allowed_targets")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            bad(
                "allowed_targets",
                "must be an array (empty: any target)".into(),
            )
        })?;
    let mut allowed_targets = Vec::with_capacity(targets.len());
    for (t, target) in targets.iter().enumerate() {
        let fields = target.as_object().ok_or_else(|| {
            bad(
                &format!("allowed_targets[{t}]"),
                "must be an object of field constraints".into(),
            )
        })?;
        let mut constraint = TargetConstraint::default();
        for (name, value) in fields {
            let field = format!("allowed_targets[{t}].{name}");
            if let Some(c) =
                field_constraint(&provider, name, value).map_err(|problem| bad(&field, problem))?
            {
                constraint.fields.push(c);
            }
        }
        allowed_targets.push(constraint);
    }
    Ok(DeclaredAction {
        index,
        id,
        provider,
        action_class,
        allowed_targets,
        allowed_effects,
        required_decision,
    })
}

/// The rule for one declared target field; `None` for `"*"`.
fn field_constraint(
    provider: &str,
    name: &str,
    value: &Value,
) -> Result<Option<FieldConstraint>, String> {
    if name == "provider" {
        return Err("the provider is declared at the action level, not in a target".into());
    }
    if !is_code(name) {
        return Err(format!("{name:?} is not a snake_case field name"));
    }
    if value.as_str() == Some("*") {
        return Ok(None);
    }
    let constraint = |observed: &str, rule| {
        Ok(Some(FieldConstraint {
            observed: observed.to_string(),
            rule,
        }))
    };
    let text = || match value {
        Value::String(s) if !s.is_empty() => Ok(s.as_str()),
        _ => Err(format!("{value} must be a non-empty string or \"*\"")),
    };
    if let Some(&(_, _, observed, domain)) = HASHED_FIELDS
        .iter()
        .find(|(p, d, _, _)| *p == provider && *d == name)
    {
        let v = text()?;
        let hash = if v.starts_with("sha256:") {
            ChainHash::parse(v)
                .ok_or_else(|| format!("{v:?} is not sha256: and 64 lowercase hex digits"))?
                .as_str()
                .to_string()
        } else {
            target_hash(domain, v)
        };
        return constraint(observed, FieldRule::Hash(hash));
    }
    if provider == NETWORK_PROVIDER && name == "address" {
        let v = text()?;
        let net = v
            .parse::<IpNet>()
            .or_else(|_| v.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| format!("{v:?} is not an IP address or CIDR"))?;
        // In the form enforcement uses (`destination::canonical_net`), so a declared
        // ::ffff:10.0.0.0/104 means 10.0.0.0/8, as it would in a destination rule.
        return constraint(name, FieldRule::Network(canonical_net(net.trunc())));
    }
    if provider == NETWORK_PROVIDER && name == "port" {
        let port = match value {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.parse::<u64>().ok(),
            _ => None,
        }
        .filter(|p| *p <= u64::from(u16::MAX))
        .ok_or_else(|| format!("{value} is not a port number (0..=65535) or \"*\""))?;
        return constraint(name, FieldRule::Integer(port));
    }
    if name.ends_with("_hash") {
        let v = text()?;
        let hash = ChainHash::parse(v)
            .ok_or_else(|| format!("{v:?} must be sha256: and 64 lowercase hex digits"))?;
        return constraint(name, FieldRule::Hash(hash.as_str().to_string()));
    }
    match value {
        Value::Bool(b) => constraint(name, FieldRule::Flag(*b)),
        Value::Number(n) => n.as_u64().map_or_else(
            || Err(format!("{value} must be a non-negative integer")),
            |n| constraint(name, FieldRule::Integer(n)),
        ),
        _ => {
            let v = text()?;
            if v.starts_with("sha256:") && ChainHash::parse(v).is_some() {
                constraint(
                    name,
                    FieldRule::TextOrHash {
                        value: v.to_string(),
                        hash_field: format!("{name}_hash"),
                    },
                )
            } else {
                constraint(name, FieldRule::Text(v.to_string()))
            }
        }
    }
}

impl fmt::Display for TargetMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TargetMatch::Match => "match",
            TargetMatch::Mismatch => "mismatch",
            TargetMatch::Undetermined => "undetermined",
        })
    }
}

/// Looks a field up in a JSON target object (for callers holding `serde_json` values).
pub fn json_lookup<'m>(
    target: &'m Map<String, Value>,
) -> impl Fn(&str) -> Option<ScalarView<'m>> + 'm {
    move |field| {
        target.get(field).map(|v| match v {
            Value::String(s) => ScalarView::Text(s),
            Value::Bool(b) => ScalarView::Flag(*b),
            Value::Number(n) => n.as_u64().map_or(ScalarView::Other, ScalarView::Integer),
            _ => ScalarView::Other,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn surface(actions: Value) -> Result<DeclaredSurface, SurfaceError> {
        DeclaredSurface::parse(
            &json!({"schema": DECLARED_SCHEMA, "declared_tool_actions": actions}).to_string(),
        )
    }

    fn action(provider: &str, class: &str, targets: Value) -> Value {
        json!({"id": format!("{provider}.x"), "provider": provider, "action_class": class,
               "allowed_targets": targets, "allowed_effects": ["allow"],
               "required_decision": "explicit_policy"})
    }

    fn test(a: &DeclaredAction, target: Value) -> TargetMatch {
        let map = target.as_object().unwrap().clone();
        a.test_target(json_lookup(&map))
    }

    #[test]
    fn errors_name_the_entry_and_field() {
        let mut bad = action("github", "github_deploy_key", json!([]));
        bad["allowed_effects"] = json!(["allow", "maybe"]);
        let e = surface(json!([action("slack", "slack_add_member", json!([])), bad])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "declared_tool_actions[1] (id github.x): field allowed_effects[1]: \"maybe\" is not \"allow\", \"deny\" or \"error\""
        );
        let e = surface(json!([action(
            "network",
            "network_egress",
            json!([{"address": "10.0.0.0/33"}])
        )]))
        .unwrap_err();
        assert!(e.to_string().contains("allowed_targets[0].address"), "{e}");
        let mut missing = action("github", "github_deploy_key", json!([]));
        missing.as_object_mut().unwrap().remove("provider");
        let e = surface(json!([missing])).unwrap_err();
        assert!(e.to_string().contains("field provider: is required"), "{e}");
        let e = surface(json!([
            action("a", "b", json!([])),
            action("a", "b", json!([]))
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("duplicate id"), "{e}");
        let e =
            DeclaredSurface::parse(r#"{"schema":"other","declared_tool_actions":[]}"#).unwrap_err();
        assert!(e.to_string().contains("field schema"), "{e}");
    }

    #[test]
    fn a_key_named_twice_is_refused_wherever_it_is() {
        let e = DeclaredSurface::parse(
            r#"{"schema":"assay.declared_tool_surface.v0","declared_tool_actions":[
                {"id":"a","provider":"github","action_class":"github_deploy_key",
                 "allowed_targets":[{"owner":"org","repo":"prod-repo","repo":"*"}],
                 "allowed_effects":["allow"],"required_decision":"explicit_policy"}]}"#,
        )
        .unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains(
                "declared_tool_actions[0].allowed_targets[0]: the key \"repo\" appears twice"
            ),
            "{e}"
        );
        let e = DeclaredSurface::parse(
            r#"{"schema":"assay.declared_tool_surface.v0","declared_tool_actions":[],
                "declared_tool_actions":[]}"#,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("\"declared_tool_actions\" appears twice"),
            "{e}"
        );
    }

    #[test]
    fn plain_hashed_and_wildcard_fields() {
        let s = surface(json!([action(
            "slack",
            "slack_add_member",
            json!([{"workspace_id": "T0123", "channel_id": "*"}])
        )]))
        .unwrap();
        let a = &s.actions[0];
        let ws = "sha256:e4cfe2c3698fd59b58fd5a075e378f38d857421174faffe3317d3f86473f0190";
        assert_eq!(
            test(a, json!({"provider": "slack", "workspace_id_hash": ws})),
            TargetMatch::Match
        );
        assert_eq!(
            test(
                a,
                json!({"provider": "slack", "workspace_id_hash": target_hash("slack_workspace", "T9")})
            ),
            TargetMatch::Mismatch
        );
        assert_eq!(
            test(a, json!({"provider": "slack"})),
            TargetMatch::Undetermined
        );
        let s = surface(json!([action(
            "slack",
            "slack_add_member",
            json!([{"workspace_id": ws}])
        )]))
        .unwrap();
        assert_eq!(
            test(&s.actions[0], json!({"workspace_id_hash": ws})),
            TargetMatch::Match
        );
        let s = surface(json!([action(
            "github",
            "github_deploy_key",
            json!([{"owner": "org", "repo": "prod-repo"}])
        )]))
        .unwrap();
        assert_eq!(
            test(&s.actions[0], json!({"owner": "org", "repo": "prod-repo"})),
            TargetMatch::Match
        );
        assert_eq!(
            test(&s.actions[0], json!({"owner": "Org", "repo": "prod-repo"})),
            TargetMatch::Mismatch
        );
        assert_eq!(
            test(&s.actions[0], json!({"owner": "org"})),
            TargetMatch::Undetermined
        );
        // A declared integer matches a recorded string only as its own decimal text: "042"
        // and "+42" matched before, though the tool received those strings.
        let s = surface(json!([action(
            "github",
            "github_deploy_key",
            json!([{"team_id": 42}])
        )]))
        .unwrap();
        for (observed, expected) in [
            (json!("42"), TargetMatch::Match),
            (json!(42), TargetMatch::Match),
            (json!("042"), TargetMatch::Mismatch),
            (json!("+42"), TargetMatch::Mismatch),
            (json!(" 42"), TargetMatch::Mismatch),
        ] {
            assert_eq!(
                test(&s.actions[0], json!({"team_id": observed})),
                expected,
                "{observed}"
            );
        }
    }

    #[test]
    fn network_address_cidr_and_port() {
        let s = surface(json!([action(
            "network",
            "network_egress",
            json!([
                {"address": "10.0.0.0/8", "port": 443},
                {"address": "2001:db8::1", "port": "*"}
            ])
        )]))
        .unwrap();
        let a = &s.actions[0];
        assert_eq!(
            test(a, json!({"address": "10.9.8.7", "port": 443})),
            TargetMatch::Match
        );
        assert_eq!(
            test(a, json!({"address": "10.9.8.7", "port": 80})),
            TargetMatch::Mismatch
        );
        assert_eq!(
            test(a, json!({"address": "11.0.0.1", "port": 443})),
            TargetMatch::Mismatch
        );
        assert_eq!(
            test(a, json!({"address": "2001:db8::1", "port": 22})),
            TargetMatch::Match
        );
        assert_eq!(
            test(a, json!({"unix_path": "/run/x.sock"})),
            TargetMatch::Undetermined
        );
    }

    #[test]
    fn ipv4_mapped_addresses_are_matched_as_enforcement_matches_them() {
        // Enforcement judges ::ffff:a.b.c.d as a.b.c.d (destination::canonical_ip), so the
        // diff must too: an IPv4 network declared covers the mapped form, and an IPv6
        // network does not cover IPv4 egress that happens to be written in IPv6 form.
        let declare = |address: &str| {
            surface(json!([action(
                "network",
                "network_egress",
                json!([{ "address": address }])
            )]))
            .unwrap()
            .actions
            .remove(0)
        };
        let (v4, v6, mapped) = (
            &declare("10.0.0.0/8"),
            &declare("::/0"),
            &declare("::ffff:192.0.2.0/120"),
        );
        assert_eq!(
            test(v4, json!({"address": "::ffff:10.0.0.5"})),
            TargetMatch::Match
        );
        assert_eq!(
            test(v6, json!({"address": "::ffff:203.0.113.9"})),
            TargetMatch::Mismatch
        );
        assert_eq!(
            test(v6, json!({"address": "2001:db8::1"})),
            TargetMatch::Match
        );
        assert_eq!(
            test(mapped, json!({"address": "192.0.2.7"})),
            TargetMatch::Match
        );
        assert_eq!(
            test(mapped, json!({"address": "::ffff:192.0.2.7"})),
            TargetMatch::Match
        );
        assert_eq!(
            test(mapped, json!({"address": "192.0.3.7"})),
            TargetMatch::Mismatch
        );
    }

    #[test]
    fn empty_targets_mean_any_target() {
        let s = surface(json!([action("workspace", "workspace_admin", json!([]))])).unwrap();
        assert_eq!(
            test(&s.actions[0], json!({"provider": "workspace"})),
            TargetMatch::Match
        );
    }
}
