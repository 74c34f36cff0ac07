//! Target projection: what of a call's arguments a record may hold.
//!
//! The operator maps each tool ([`ToolMapping`]) to a provider, a category (the action
//! class), a verb, a resource type and a required scope, and names the argument fields that go
//! into the target: some plain, some hashed under a domain ([`target_hash`]). Only string
//! arguments named by the mapping are projected; nothing else of the arguments is read into
//! the record. A tool without a mapping is `observed_unknown_tool` with a null target.
//!
//! Broker-observed egress needs no mapping: [`project_egress`] gives provider `network`,
//! category `network_egress` and a target of address, port, protocol and family (or a Unix
//! path).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{
    Action, ActionClass, BrokerDetails, Classification, Destination, MAX_TEXT_BYTES, Target,
    TargetValue, is_code, sanitize,
};

/// The provider of every network egress record.
pub const NETWORK_PROVIDER: &str = "network";
/// The category (action class) of every network egress record.
pub const NETWORK_CATEGORY: &str = "network_egress";
/// The scope a network egress needs.
pub const NETWORK_SCOPE: &str = "network:egress";
/// The reason code of a record whose mapped target lacks a required field.
pub const REASON_MISSING_FIELD: &str = "missing_required_target_field";
/// The reason code of an unmapped tool.
pub const REASON_UNKNOWN_TOOL: &str = "unknown_tool_name";
/// The prefix of the target hash preimage.
pub const TARGET_HASH_PREFIX: &str = "assay.tool_target.v0:";

/// Hashes an identifier that must not be stored raw:
/// `sha256:` + hex(SHA-256(`assay.tool_target.v0:` + domain + `:` + value.trim().to_lowercase())).
///
/// The same function serves the declared side of the diff, so a declared plain value matches
/// the observed hash of the same identifier.
pub fn target_hash(domain: &str, value: &str) -> String {
    let mut h = Sha256::new();
    h.update(TARGET_HASH_PREFIX.as_bytes());
    h.update(domain.as_bytes());
    h.update(b":");
    h.update(value.trim().to_lowercase().as_bytes());
    super::chain::sha256_text(&h.finalize().into())
}

/// A plain argument as its target value: the text itself when a record can hold it as it
/// is; otherwise (longer than [`MAX_TEXT_BYTES`], or holding a control character)
/// `sha256:` + hex(SHA-256(`flowhost.plain_value.v1:` + the exact text)). Cut or with its
/// controls replaced, it could equal a declared value the call did not name (a declared
/// path plus `/../x` past the cut); a digest of the exact text equals no declared plain
/// value, so such a call is judged outside the declared targets, never inside one.
pub fn plain_value(value: &str) -> TargetValue {
    if value.len() <= MAX_TEXT_BYTES && !super::validate::has_control(value) {
        return TargetValue::Text(value.to_owned());
    }
    let mut h = Sha256::new();
    h.update(b"flowhost.plain_value.v1:");
    h.update(value.as_bytes());
    TargetValue::Text(super::chain::sha256_text(&h.finalize().into()))
}

/// One argument projected as a hash: `field` (the argument name) is hashed under `domain` into
/// the target field `output` (e.g. `title` -> `key_title_hash` under `github_key_title`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HashedField {
    /// The argument name.
    pub field: String,
    /// The hash domain (snake_case).
    pub domain: String,
    /// The target field the hash goes into (snake_case).
    pub output: String,
}

/// The operator's record mapping for one tool. Decoding (from the host's TOML or from JSON)
/// rejects unknown fields and checks the mapping: snake_case provider, category, domains and
/// output names; no output named `provider` or used twice; every required field projected;
/// `network` / `network_egress` are reserved for the broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "MappingWire", into = "MappingWire")]
pub struct ToolMapping {
    provider: String,
    category: String,
    verb: String,
    resource_type: String,
    required_scope: String,
    plain: Vec<String>,
    hashed: Vec<HashedField>,
    required: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct MappingWire {
    provider: String,
    category: String,
    verb: String,
    resource_type: String,
    required_scope: String,
    #[serde(default)]
    plain: Vec<String>,
    #[serde(default)]
    hashed: Vec<HashedField>,
    #[serde(default)]
    required: Vec<String>,
}

/// A tool mapping that cannot be used, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("record mapping field {field}: {problem}")]
pub struct MappingError {
    /// The mapping field at fault.
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

impl TryFrom<MappingWire> for ToolMapping {
    type Error = MappingError;
    fn try_from(w: MappingWire) -> Result<Self, MappingError> {
        ToolMapping::new(
            &w.provider,
            &w.category,
            &w.verb,
            &w.resource_type,
            &w.required_scope,
            w.plain,
            w.hashed,
            w.required,
        )
    }
}

impl From<ToolMapping> for MappingWire {
    fn from(m: ToolMapping) -> Self {
        MappingWire {
            provider: m.provider,
            category: m.category,
            verb: m.verb,
            resource_type: m.resource_type,
            required_scope: m.required_scope,
            plain: m.plain,
            hashed: m.hashed,
            required: m.required,
        }
    }
}

impl ToolMapping {
    /// Builds and checks a mapping (see the type docs for the rules).
    #[allow(clippy::too_many_arguments)] // mirrors the eight fields of the config table
    pub fn new(
        provider: &str,
        category: &str,
        verb: &str,
        resource_type: &str,
        required_scope: &str,
        plain: Vec<String>,
        hashed: Vec<HashedField>,
        required: Vec<String>,
    ) -> Result<Self, MappingError> {
        let bad = |field: &str, problem: String| MappingError {
            field: field.to_string(),
            problem,
        };
        let code = |field: &str, v: &str, max: usize| {
            if is_code(v) && v.len() <= max {
                Ok(())
            } else {
                Err(bad(
                    field,
                    format!("{v:?} must be snake_case ([a-z][a-z0-9_]*, at most {max} bytes)"),
                ))
            }
        };
        let text = |field: &str, v: &str| {
            if v.is_empty() || v.len() > 256 || v.chars().any(char::is_control) {
                Err(bad(
                    field,
                    format!("{v:?} must be 1 to 256 bytes without control characters"),
                ))
            } else {
                Ok(())
            }
        };
        code("provider", provider, 64)?;
        // The reason code is "classified_" + category and must stay a valid code.
        code("category", category, 100)?;
        if provider == NETWORK_PROVIDER || category == NETWORK_CATEGORY {
            return Err(bad(
                if provider == NETWORK_PROVIDER {
                    "provider"
                } else {
                    "category"
                },
                "\"network\" / \"network_egress\" are reserved for broker-observed egress".into(),
            ));
        }
        text("verb", verb)?;
        text("resource_type", resource_type)?;
        text("required_scope", required_scope)?;
        let mut outputs = BTreeSet::new();
        let mut projected = BTreeSet::new();
        for (i, f) in plain.iter().enumerate() {
            code(&format!("plain[{i}]"), f, 64)?;
            if f == "provider" || !outputs.insert(f.clone()) {
                return Err(bad(
                    &format!("plain[{i}]"),
                    format!("target field {f:?} is reserved or projected twice"),
                ));
            }
            projected.insert(f.clone());
        }
        for (i, h) in hashed.iter().enumerate() {
            code(&format!("hashed[{i}].field"), &h.field, 64)?;
            code(&format!("hashed[{i}].domain"), &h.domain, 64)?;
            code(&format!("hashed[{i}].output"), &h.output, 64)?;
            if h.output == "provider" || !outputs.insert(h.output.clone()) {
                return Err(bad(
                    &format!("hashed[{i}].output"),
                    format!("target field {:?} is reserved or projected twice", h.output),
                ));
            }
            projected.insert(h.field.clone());
        }
        for (i, r) in required.iter().enumerate() {
            if !projected.contains(r) {
                return Err(bad(
                    &format!("required[{i}]"),
                    format!("{r:?} is not listed in plain or hashed"),
                ));
            }
        }
        Ok(ToolMapping {
            provider: provider.to_string(),
            category: category.to_string(),
            verb: verb.to_string(),
            resource_type: resource_type.to_string(),
            required_scope: required_scope.to_string(),
            plain,
            hashed,
            required,
        })
    }

    /// The provider (e.g. `github`).
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The category, i.e. the action class (e.g. `github_deploy_key`).
    pub fn category(&self) -> &str {
        &self.category
    }
}

/// The classification and action of one decision, ready for a record.
#[derive(Debug, Clone, PartialEq)]
pub struct Projection {
    /// The classification.
    pub classification: Classification,
    /// The reason code.
    pub reason_code: String,
    /// The detail, for an incomplete target.
    pub detail: Option<String>,
    /// The category (`tool.category`).
    pub category: Option<String>,
    /// The action with its target.
    pub action: Action,
}

impl Projection {
    /// An unmapped tool: `observed_unknown_tool`, reason `unknown_tool_name`, null target.
    pub fn unknown_tool() -> Self {
        Projection {
            classification: Classification::ObservedUnknownTool,
            reason_code: REASON_UNKNOWN_TOOL.to_string(),
            detail: None,
            category: None,
            action: Action::unclassified(),
        }
    }
}

/// Projects a call's arguments by the tool's mapping (`None` for an unmapped tool).
///
/// Only string arguments named by the mapping are read; a blank string counts as missing. A
/// missing required field gives `classified_incomplete`, reason
/// `missing_required_target_field`, detail `missing_<fields>`, and a target holding what was
/// present.
pub fn project_tool_call(
    mapping: Option<&ToolMapping>,
    arguments: &serde_json::Value,
) -> Projection {
    let Some(m) = mapping else {
        return Projection::unknown_tool();
    };
    let arg = |name: &str| {
        arguments
            .get(name)
            .and_then(serde_json::Value::as_str)
            .filter(|s| !s.trim().is_empty())
    };
    let mut target = Target::for_provider(&m.provider);
    for f in &m.plain {
        if let Some(v) = arg(f) {
            target.0.insert(f.clone(), plain_value(v));
        }
    }
    for h in &m.hashed {
        if let Some(v) = arg(&h.field) {
            target.0.insert(
                h.output.clone(),
                TargetValue::Text(target_hash(&h.domain, v)),
            );
        }
    }
    let missing: Vec<&str> = m
        .required
        .iter()
        .map(String::as_str)
        .filter(|r| arg(r).is_none())
        .collect();
    let action = Action {
        class: ActionClass::PrivilegedAdminAction,
        verb: Some(sanitize(&m.verb)),
        resource_type: Some(sanitize(&m.resource_type)),
        target: Some(target),
        required_scope: Some(sanitize(&m.required_scope)),
    };
    if missing.is_empty() {
        Projection {
            classification: Classification::Classified,
            reason_code: format!("classified_{}", m.category),
            detail: None,
            category: Some(m.category.clone()),
            action,
        }
    } else {
        Projection {
            classification: Classification::ClassifiedIncomplete,
            reason_code: REASON_MISSING_FIELD.to_string(),
            detail: Some(
                assay_detail(m, &missing).map_or_else(|| missing_detail(&missing), str::to_string),
            ),
            category: Some(m.category.clone()),
            action,
        }
    }
}

/// For assay's own categories, the `detail` code assay's vocabulary has for the first
/// missing field (by what the field is: a plain GitHub owner or repo, or the hash domain of
/// a Slack or workspace identifier); `None` for flowhost's own categories, which use
/// `missing_<fields>`.
fn assay_detail(m: &ToolMapping, missing: &[&str]) -> Option<&'static str> {
    let domain = |field: &str| {
        m.hashed
            .iter()
            .find(|h| h.field == field)
            .map(|h| h.domain.as_str())
    };
    missing
        .iter()
        .find_map(|field| match (m.category.as_str(), domain(field)) {
            ("github_deploy_key", None) if matches!(*field, "owner" | "repo") => {
                Some("missing_github_owner_or_repo")
            }
            ("slack_add_member", Some("slack_principal")) => Some("missing_slack_principal"),
            ("slack_add_member", Some("slack_workspace" | "slack_channel")) => {
                Some("missing_slack_scope")
            }
            ("workspace_admin", Some("workspace")) => Some("missing_workspace_id"),
            ("workspace_admin", Some("workspace_principal")) => Some("missing_workspace_principal"),
            _ => None,
        })
}

fn missing_detail(missing: &[&str]) -> String {
    let d = format!("missing_{}", missing.join("_and_"));
    if is_code(&d) {
        d
    } else {
        "missing_required_fields".to_string()
    }
}

/// Projects a broker observation: provider `network`, category `network_egress`, verb the
/// syscall, target `{provider, address, port, protocol, family}` or `{provider, unix_path,
/// family}`. With no destination (e.g. a send on a socket whose connect was not seen) the
/// target is incomplete (`missing_destination`).
pub fn project_egress(broker: &BrokerDetails) -> Projection {
    let mut target = Target::for_provider(NETWORK_PROVIDER);
    target.insert_text("family", &broker.family);
    if let Some(p) = &broker.protocol {
        target.insert_text("protocol", p);
    }
    let complete = match &broker.destination {
        Some(Destination::Inet(d)) => {
            target.insert_text("address", &d.address.to_string());
            if let Some(name) = &d.host_name {
                target.insert_text("host_name", name);
            }
            target
                .0
                .insert("port".into(), TargetValue::Integer(u64::from(d.port)));
            true
        }
        Some(Destination::Unix(u)) => {
            target.insert_text("unix_path", &u.unix_path);
            true
        }
        Some(Destination::Netlink(n)) => {
            target.0.insert(
                "netlink_port_id".into(),
                TargetValue::Integer(u64::from(n.netlink_port_id)),
            );
            true
        }
        Some(Destination::Undecoded(u)) => {
            target.insert_text("undecoded", &u.undecoded);
            true
        }
        None => false,
    };
    let action = Action {
        class: ActionClass::NetworkEgress,
        verb: Some(sanitize(&broker.syscall)),
        resource_type: Some("network_endpoint".to_string()),
        target: Some(target),
        required_scope: Some(NETWORK_SCOPE.to_string()),
    };
    Projection {
        classification: if complete {
            Classification::Classified
        } else {
            Classification::ClassifiedIncomplete
        },
        reason_code: if complete {
            format!("classified_{NETWORK_CATEGORY}")
        } else {
            REASON_MISSING_FIELD.to_string()
        },
        detail: (!complete).then(|| "missing_destination".to_string()),
        category: Some(NETWORK_CATEGORY.to_string()),
        action,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn target_hash_matches_the_published_vectors() {
        for (domain, input, hex) in [
            (
                "github_key_title",
                "ci-key",
                "a65a94d25524f87fbb5ce6d3fde202c02a5b532f27e1ba3b5708076e1ba75ccf",
            ),
            (
                "slack_workspace",
                "T0123",
                "e4cfe2c3698fd59b58fd5a075e378f38d857421174faffe3317d3f86473f0190",
            ),
            (
                "workspace",
                "acme",
                "2443f42f97a4e38e039eaab087b51040b31f61dfac89d7cf75d397cd2033675b",
            ),
        ] {
            assert_eq!(target_hash(domain, input), format!("sha256:{hex}"));
        }
        // Normalisation: trimming and lowercasing give the same hash.
        assert_eq!(
            target_hash("slack_workspace", "  t0123 "),
            target_hash("slack_workspace", "T0123")
        );
        assert_ne!(
            target_hash("workspace", "acme"),
            target_hash("slack_workspace", "acme")
        );
    }

    pub(crate) fn deploy_key_mapping() -> ToolMapping {
        serde_json::from_value(json!({
            "provider": "github", "category": "github_deploy_key", "verb": "create",
            "resource_type": "github_deploy_key", "required_scope": "repo:deploy_key:write",
            "plain": ["owner", "repo"],
            "hashed": [{"field": "title", "domain": "github_key_title", "output": "key_title_hash"}],
            "required": ["owner", "repo"]
        }))
        .unwrap()
    }

    #[test]
    fn projects_only_mapped_string_fields() {
        let m = deploy_key_mapping();
        let p = project_tool_call(
            Some(&m),
            &json!({"owner": "org", "repo": "prod-repo", "title": "ci-key",
                    "key": "ssh-ed25519 AAAA-secret", "read_only": false, "token": "ghp_x"}),
        );
        assert_eq!(p.classification, Classification::Classified);
        assert_eq!(p.reason_code, "classified_github_deploy_key");
        let t = p.action.target.unwrap();
        assert_eq!(
            serde_json::to_value(&t).unwrap(),
            json!({"provider": "github", "owner": "org", "repo": "prod-repo",
                   "key_title_hash": "sha256:a65a94d25524f87fbb5ce6d3fde202c02a5b532f27e1ba3b5708076e1ba75ccf"})
        );
        let text = serde_json::to_string(&t).unwrap();
        assert!(!text.contains("secret") && !text.contains("ghp_"), "{text}");
    }

    /// A plain value was cut at 1024 bytes and its control characters replaced, so a call
    /// naming a declared value plus `/../x` past the cut was recorded as exactly the
    /// declared value and judged inside the declared targets.
    #[test]
    fn a_plain_value_a_record_cannot_hold_as_it_is_is_recorded_as_its_digest() {
        let m = deploy_key_mapping();
        let declared = "r".repeat(MAX_TEXT_BYTES);
        for repo in [format!("{declared}/../x"), "prod\u{7}repo".to_string()] {
            let p = project_tool_call(Some(&m), &json!({"owner": "org", "repo": repo}));
            assert_eq!(p.classification, Classification::Classified);
            let t = p.action.target.unwrap();
            let Some(TargetValue::Text(recorded)) = t.get("repo") else {
                panic!("{t:?}");
            };
            assert!(recorded.starts_with("sha256:"), "{recorded}");
            assert_ne!(recorded, &declared);
            assert_ne!(recorded, &crate::records::sanitize(&repo));
            assert_eq!(t.get("repo"), Some(&plain_value(&repo)));
        }
        // Different texts, different digests; a value that fits is kept as it is.
        assert_ne!(
            plain_value(&format!("{declared}a")),
            plain_value(&format!("{declared}b"))
        );
        assert_eq!(plain_value(&declared), TargetValue::Text(declared.clone()));
    }

    #[test]
    fn missing_or_non_string_required_field_is_incomplete() {
        let m = deploy_key_mapping();
        let p = project_tool_call(Some(&m), &json!({"owner": "org", "repo": 7}));
        assert_eq!(p.classification, Classification::ClassifiedIncomplete);
        assert_eq!(p.reason_code, REASON_MISSING_FIELD);
        // An assay category gets assay's own detail code.
        assert_eq!(p.detail.as_deref(), Some("missing_github_owner_or_repo"));
        assert_eq!(
            serde_json::to_value(p.action.target.unwrap()).unwrap(),
            json!({"provider": "github", "owner": "org"})
        );
        let p = project_tool_call(Some(&m), &json!("not an object"));
        assert_eq!(p.detail.as_deref(), Some("missing_github_owner_or_repo"));
        // flowhost's own categories name the fields.
        let mut own = deploy_key_mapping();
        own.category = "contract_read".into();
        let p = project_tool_call(Some(&own), &json!("not an object"));
        assert_eq!(p.detail.as_deref(), Some("missing_owner_and_repo"));
    }

    #[test]
    fn assay_categories_use_assay_detail_codes() {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/declared/mappings.toml"),
        )
        .unwrap();
        let table: toml::Table = toml::from_str(&text).unwrap();
        let mapping = |name: &str| -> ToolMapping {
            toml::Value::Table(table[name].as_table().unwrap().clone())
                .try_into()
                .unwrap()
        };
        let detail = |m: &ToolMapping, args: serde_json::Value| {
            project_tool_call(Some(m), &args).detail.unwrap()
        };
        let slack = mapping("slack_add_member");
        assert_eq!(
            detail(&slack, json!({"workspace_id": "T1"})),
            "missing_slack_principal"
        );
        assert_eq!(
            detail(&slack, json!({"user_id": "U1"})),
            "missing_slack_scope"
        );
        let ws = mapping("workspace_grant_admin");
        assert_eq!(
            detail(&ws, json!({"principal": "p"})),
            "missing_workspace_id"
        );
        assert_eq!(
            detail(&ws, json!({"workspace_id": "w"})),
            "missing_workspace_principal"
        );
    }

    #[test]
    fn unmapped_tool_is_unknown_with_null_target() {
        let p = project_tool_call(None, &json!({"owner": "org"}));
        assert_eq!(p.classification, Classification::ObservedUnknownTool);
        assert_eq!(p.reason_code, "unknown_tool_name");
        assert_eq!(p.category, None);
        assert_eq!(p.action, Action::unclassified());
    }

    #[test]
    fn mapping_is_checked_with_the_field_named() {
        let base = json!({
            "provider": "github", "category": "github_deploy_key", "verb": "create",
            "resource_type": "k", "required_scope": "s", "plain": ["owner"], "required": ["repo"]
        });
        let e = serde_json::from_value::<ToolMapping>(base).unwrap_err();
        assert!(e.to_string().contains("required[0]"), "{e}");
        let e = serde_json::from_value::<ToolMapping>(json!({
            "provider": "github", "category": "x", "verb": "v", "resource_type": "r",
            "required_scope": "s", "extra": 1
        }))
        .unwrap_err();
        assert!(e.to_string().contains("extra"), "{e}");
        let e = serde_json::from_value::<ToolMapping>(json!({
            "provider": "network", "category": "x", "verb": "v", "resource_type": "r",
            "required_scope": "s"
        }))
        .unwrap_err();
        assert!(e.to_string().contains("reserved"), "{e}");
        let e = serde_json::from_value::<ToolMapping>(json!({
            "provider": "p", "category": "Bad-Cat", "verb": "v", "resource_type": "r",
            "required_scope": "s"
        }))
        .unwrap_err();
        assert!(e.to_string().contains("category"), "{e}");
    }

    #[test]
    fn egress_projection_carries_the_endpoint() {
        let b = BrokerDetails {
            pid: 42,
            executable: Some("/usr/bin/tool".into()),
            syscall: "connect".into(),
            family: "inet".into(),
            socket_type: Some("stream".into()),
            protocol: Some("tcp".into()),
            destination: Some(Destination::Inet(super::super::InetDestination {
                address: "10.1.2.3".parse().unwrap(),
                port: 443,
                host_name: None,
                other_host_names: Vec::new(),
            })),
            bytes: None,
            dns_query_type: None,
        };
        let p = project_egress(&b);
        assert_eq!(p.category.as_deref(), Some("network_egress"));
        assert_eq!(
            serde_json::to_value(p.action.target.unwrap()).unwrap(),
            json!({"provider": "network", "address": "10.1.2.3", "port": 443,
                   "protocol": "tcp", "family": "inet"})
        );
        let p = project_egress(&BrokerDetails {
            destination: None,
            ..b
        });
        assert_eq!(p.classification, Classification::ClassifiedIncomplete);
        assert_eq!(p.detail.as_deref(), Some("missing_destination"));
    }
}
