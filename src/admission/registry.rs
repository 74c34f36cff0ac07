//! The verified registry: the only way a tool gets into the host (docs/ARCHITECTURE.md,
//! "Data path").
//!
//! This file is long on purpose: the eight admission rules, the admitted types they produce and
//! the bridge-metadata check read the same private fields, which a split would have to expose.
//!
//! [`VerifiedRegistry::register`] admits one signed manifest under the operator's key, policy
//! and the host's runtime topology, applying the eight admission rules in order:
//!
//! 1. the signature verifies against the key the operator registered (not the embedded one);
//! 2. the `server_id` is not registered yet;
//! 3. every tool has an operator policy and a runtime topology, and no policy or topology
//!    names a tool the manifest does not have;
//! 4. effective egress is `topology.runtime_egress() || flow.egress` (a publisher can add
//!    egress, never remove it);
//! 5. a tool with effective egress needs at least one policy clearance;
//! 6. a manifest input clearance must flow to every policy clearance (publishers only narrow);
//! 7. the effective output floor is `policy.output_floor ⊔ manifest output label`, and is
//!    never `Top`;
//! 8. the declassification purposes are the policy's intersected with the manifest's;
//! 9. a manifest that declares resources or prompts needs the operator's content floor (not
//!    `Top`), and every entry's label (`content floor ⊔ signed output label`) is a label
//!    below `Top`;
//! 10. no resource URI or template of the manifest may match a URI another registered
//!     server's resource does (a read must go to exactly one server).
//!
//! Each tool's input schema is then compiled once (no remote or file `$ref` is fetched); a
//! schema that does not compile refuses the manifest. Nothing is added unless every tool
//! passes. The registered envelopes can be written out as the retained set
//! (`signed-manifests.json`, a JSON array of envelopes).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use ed25519_dalek::VerifyingKey;
use serde::de::Deserializer;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical::{self, JsonPath};
use crate::files::{self, FileError};
use crate::flow::{MAX_PURPOSES, ToolFlowDeclaration};
use crate::ident::DeclassificationPurpose;
use crate::label::{InformationLabel, LabelError, StrictSet};
use crate::manifest::{
    ManifestDigest, ManifestError, ManifestFileError, SignedManifest, ToolDefinition, VerifyError,
};

/// File name of the retained set in the host's state directory.
pub const RETAINED_SET_FILE: &str = "signed-manifests.json";
/// Largest retained set read back: 256 manifests of the 1 MiB maximum.
pub const MAX_RETAINED_SET_BYTES: u64 = 256 * 1024 * 1024;
/// Most validation problems reported for one call's arguments.
const MAX_ARGUMENT_ERRORS: usize = 8;

/// Where a tool runs, as the host knows it from its own configuration and execution
/// profile. Never taken from a publisher or from protocol discovery data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeTopology {
    /// The executor has no network path.
    Local,
    /// The executor has a network path, mediated by the native broker.
    Brokered,
}

impl RuntimeTopology {
    /// Whether the runtime itself gives the tool a way out (true for `brokered`).
    pub fn runtime_egress(self) -> bool {
        matches!(self, RuntimeTopology::Brokered)
    }
}

/// Why an operator policy is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A clearance is `Top`, which is not an operational bound.
    #[error(
        "input_clearances[{index}] is top; a policy clearance must name the most restricted label the tool may receive"
    )]
    TopClearance {
        /// Position of the clearance in the list.
        index: usize,
    },
    /// The output floor is `Top`, which would make every output unusable.
    #[error("output_floor is top; a policy output floor must be a known label")]
    TopOutputFloor,
}

/// The operator's policy for one tool.
///
/// Guarantees: no clearance and no output floor is `Top`. Wire form (JSON or TOML, strict):
/// `input_clearances` (list of labels, required, may be empty), `output_floor` (a label,
/// required), `declassification_purposes` (list, optional, no duplicates); unknown fields and
/// `null` are refused. In TOML a label is an inline table, e.g.
/// `output_floor = { kind = "known", owners = {}, compartments = [] }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ToolPolicyWire")]
pub struct ToolPolicy {
    input_clearances: Vec<InformationLabel>,
    output_floor: InformationLabel,
    declassification_purposes: BTreeSet<DeclassificationPurpose>,
}

impl ToolPolicy {
    /// Builds a policy; a `Top` clearance or output floor is refused.
    pub fn new(
        input_clearances: Vec<InformationLabel>,
        output_floor: InformationLabel,
        declassification_purposes: BTreeSet<DeclassificationPurpose>,
    ) -> Result<Self, PolicyError> {
        if let Some(index) = input_clearances.iter().position(InformationLabel::is_top) {
            return Err(PolicyError::TopClearance { index });
        }
        if output_floor.is_top() {
            return Err(PolicyError::TopOutputFloor);
        }
        Ok(ToolPolicy {
            input_clearances,
            output_floor,
            declassification_purposes,
        })
    }

    /// Public data only: one bottom clearance, a bottom floor, no purposes.
    pub fn public_only() -> Self {
        ToolPolicy {
            input_clearances: vec![InformationLabel::bottom()],
            output_floor: InformationLabel::bottom(),
            declassification_purposes: BTreeSet::new(),
        }
    }

    /// The labels the tool may receive data up to (each checked on egress).
    pub fn input_clearances(&self) -> &[InformationLabel] {
        &self.input_clearances
    }

    /// The least label every output of the tool carries.
    pub fn output_floor(&self) -> &InformationLabel {
        &self.output_floor
    }

    /// Purposes the operator allows declassification for.
    pub fn declassification_purposes(&self) -> &BTreeSet<DeclassificationPurpose> {
        &self.declassification_purposes
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolPolicyWire {
    input_clearances: Vec<InformationLabel>,
    output_floor: InformationLabel,
    #[serde(default, deserialize_with = "strict_purposes")]
    declassification_purposes: BTreeSet<DeclassificationPurpose>,
}

fn strict_purposes<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<BTreeSet<DeclassificationPurpose>, D::Error> {
    Ok(StrictSet::<DeclassificationPurpose, MAX_PURPOSES>::deserialize(d)?.0)
}

impl TryFrom<ToolPolicyWire> for ToolPolicy {
    type Error = PolicyError;
    fn try_from(w: ToolPolicyWire) -> Result<Self, Self::Error> {
        ToolPolicy::new(
            w.input_clearances,
            w.output_floor,
            w.declassification_purposes,
        )
    }
}

/// The security facts the registry derived for one admitted tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmittedToolSecurity {
    effective_egress: bool,
    policy_clearances: Vec<InformationLabel>,
    manifest_clearance: Option<InformationLabel>,
    effective_output_floor: InformationLabel,
    declassification_purposes: BTreeSet<DeclassificationPurpose>,
}

impl AdmittedToolSecurity {
    /// Whether calls count as egress: the runtime gives a network path or the publisher
    /// declares egress (the broker may still observe egress at run time).
    pub fn effective_egress(&self) -> bool {
        self.effective_egress
    }

    /// The operator's clearances; egressing data must flow to every one.
    pub fn policy_clearances(&self) -> &[InformationLabel] {
        &self.policy_clearances
    }

    /// The publisher's input clearance, if declared; egressing data must flow to it too.
    pub fn manifest_clearance(&self) -> Option<&InformationLabel> {
        self.manifest_clearance.as_ref()
    }

    /// `policy.output_floor ⊔ manifest output label`; never `Top`.
    pub fn effective_output_floor(&self) -> &InformationLabel {
        &self.effective_output_floor
    }

    /// Purposes both the operator and the publisher allow.
    pub fn declassification_purposes(&self) -> &BTreeSet<DeclassificationPurpose> {
        &self.declassification_purposes
    }

    /// Whether serving this tool needs flow mediation: effective egress, a manifest
    /// clearance, a non-bottom output floor, purposes, or a non-bottom policy clearance.
    pub fn requires_flow_runtime(&self) -> bool {
        self.effective_egress
            || self.manifest_clearance.is_some()
            || !self.effective_output_floor.is_bottom()
            || !self.declassification_purposes.is_empty()
            || self.policy_clearances.iter().any(|c| !c.is_bottom())
    }
}

/// Why a manifest was not admitted. Every variant names the server and, where it applies,
/// the tool.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// Rule 1: the envelope does not verify against the registered key.
    #[error("rule 1 (signature): {0}")]
    Verification(#[from] VerifyError),
    /// Rule 2: the server is already registered.
    #[error("rule 2: server {server_id:?} is already registered; server ids are unique")]
    DuplicateServer {
        /// The server.
        server_id: String,
    },
    /// Rule 3: a tool without an operator policy.
    #[error("rule 3: server {server_id:?} tool {tool:?} has no operator policy")]
    MissingPolicy {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
    },
    /// Rule 3: a tool without a runtime topology.
    #[error("rule 3: server {server_id:?} tool {tool:?} has no runtime topology")]
    MissingTopology {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
    },
    /// Rule 3: an operator policy for a tool the signed manifest does not have.
    #[error(
        "rule 3: server {server_id:?} has a policy for tool {tool:?}, which its signed manifest does not declare"
    )]
    PolicyForUnknownTool {
        /// The server.
        server_id: String,
        /// The tool named by the policy.
        tool: String,
    },
    /// Rule 3: a topology for a tool the signed manifest does not have.
    #[error(
        "rule 3: server {server_id:?} has a topology for tool {tool:?}, which its signed manifest does not declare"
    )]
    TopologyForUnknownTool {
        /// The server.
        server_id: String,
        /// The tool named by the topology.
        tool: String,
    },
    /// Rule 5: effective egress with no policy clearance.
    #[error(
        "rule 5: server {server_id:?} tool {tool:?} has effective egress but its policy lists no input clearance; add one to input_clearances"
    )]
    MissingPolicyClearance {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
    },
    /// Rule 6: the publisher's clearance is wider than a policy clearance.
    #[error(
        "rule 6: server {server_id:?} tool {tool:?} declares input clearance {manifest_clearance}, which does not flow to policy clearance {policy_clearance}; a publisher may only narrow the operator's clearances"
    )]
    ManifestClearanceWidensPolicy {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
        /// The publisher's clearance.
        manifest_clearance: Box<InformationLabel>,
        /// The policy clearance it does not flow to.
        policy_clearance: Box<InformationLabel>,
    },
    /// Rule 7: the output floor join exceeds the label limits.
    #[error(
        "rule 7: server {server_id:?} tool {tool:?}: the policy output floor joined with the declared output label is not a label: {reason}"
    )]
    OutputFloorJoin {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
        /// Which limit the join exceeds.
        reason: LabelError,
    },
    /// Rule 7: the effective output floor is `Top`.
    #[error("rule 7: server {server_id:?} tool {tool:?}: the effective output floor is top")]
    TopEffectiveOutputFloor {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
    },
    /// Rule 9: resources or prompts without the operator's content floor.
    #[error(
        "rule 9: server {server_id:?} declares resources or prompts but has no content_floor; set content_floor (the least label of what they return) in its [[server]] table"
    )]
    MissingContentFloor {
        /// The server.
        server_id: String,
    },
    /// Rule 9: a resource's or prompt's label is `Top` or not a label.
    #[error(
        "rule 9: server {server_id:?} {entry}: the content floor joined with the signed output label is not a usable label{}",
        reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default()
    )]
    ContentLabel {
        /// The server.
        server_id: String,
        /// The resource or prompt (`resource test://x`, `prompt p`, `content_floor`).
        entry: String,
        /// Which limit the join exceeds (`None`: it is `Top`).
        reason: Option<LabelError>,
    },
    /// Rule 10: a resource another server's resource may also match.
    #[error(
        "rule 10: server {server_id:?} resource {uri:?} may match the same URIs as server {other_server:?} resource {other_uri:?}; a read must route to one server, so change one of them"
    )]
    AmbiguousResource {
        /// The server being registered.
        server_id: String,
        /// Its resource URI or template.
        uri: String,
        /// The registered server it collides with.
        other_server: String,
        /// That server's resource URI or template.
        other_uri: String,
    },
    /// The tool's input schema does not compile (or has a remote or file `$ref`).
    #[error("server {server_id:?} tool {tool:?}: {reason}")]
    InvalidSchema {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
        /// Which schema, and the compiler's description.
        reason: crate::manifest::SchemaCompileError,
    },
}

/// Why call arguments were refused. Messages name schema locations, never argument values
/// (arguments may carry secrets and must not reach logs or records).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgumentError {
    /// The arguments are not a JSON object.
    #[error("server {server_id:?} tool {tool:?}: arguments must be a JSON object, found {found}")]
    NotAnObject {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
        /// The JSON type found.
        found: &'static str,
    },
    /// The arguments break the signed input schema.
    #[error("server {server_id:?} tool {tool:?}: arguments do not match the signed input schema: {}", problems.join("; "))]
    SchemaViolation {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
        /// Up to 8 problems, each `at <argument pointer>: fails <schema pointer>`.
        problems: Vec<String>,
    },
}

/// Why a tool's result was withheld: the tool declares an output schema, and its result
/// does not keep to it. Messages name schema locations, never output values (the result
/// may carry what the executor read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputError {
    /// A result that is not a tool error carries no `structuredContent`, which MCP requires
    /// of a tool with an output schema.
    #[error(
        "server {server_id:?} tool {tool:?}: the result has no structuredContent, which its \
         signed output schema requires"
    )]
    NoStructuredContent {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
    },
    /// The result's `structuredContent` breaks the signed output schema.
    #[error("server {server_id:?} tool {tool:?}: structuredContent does not match the signed output schema: {}", problems.join("; "))]
    SchemaViolation {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
        /// Up to 8 problems, each `fails <schema pointer>` (no place in the result: its
        /// keys are the executor's words).
        problems: Vec<String>,
    },
}

/// A tool admitted by the registry, with everything the host needs to serve it.
pub struct AdmittedTool {
    server_id: String,
    definition: ToolDefinition,
    security: AdmittedToolSecurity,
    topology: RuntimeTopology,
    manifest_digest: ManifestDigest,
    schemas: crate::manifest::CompiledSchemas,
}

impl AdmittedTool {
    /// The server the tool belongs to.
    pub fn server_id(&self) -> &str {
        &self.server_id
    }

    /// The tool's name.
    pub fn name(&self) -> &str {
        self.definition.name()
    }

    /// The signed definition.
    pub fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    /// What the registry derived for the tool's security.
    pub fn security(&self) -> &AdmittedToolSecurity {
        &self.security
    }

    /// The runtime topology the host supplied.
    pub fn topology(&self) -> RuntimeTopology {
        self.topology
    }

    /// The digest of the manifest the tool was admitted from.
    pub fn manifest_digest(&self) -> ManifestDigest {
        self.manifest_digest
    }

    /// The description as a client may see it (escapes and control characters removed).
    pub fn sanitized_description(&self) -> String {
        self.definition.sanitized_description()
    }

    /// Checks call arguments against the signed input schema, compiled at registration.
    pub fn validate_arguments(&self, arguments: &Value) -> Result<(), ArgumentError> {
        if !arguments.is_object() {
            return Err(ArgumentError::NotAnObject {
                server_id: self.server_id.clone(),
                tool: self.name().to_owned(),
                found: crate::manifest::json_type(arguments),
            });
        }
        let problems = schema_problems(&self.schemas.input, arguments, true);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ArgumentError::SchemaViolation {
                server_id: self.server_id.clone(),
                tool: self.name().to_owned(),
                problems,
            })
        }
    }

    /// Checks an executor's `tools/call` result against the signed output schema, if the
    /// tool declares one: a result that is not a tool error (`isError: true`) must carry
    /// `structuredContent` that matches it, and a tool error's, if it carries any, must
    /// match too. A tool without an output schema passes whatever it answers.
    pub fn check_output(&self, result: &Value) -> Result<(), OutputError> {
        let Some(validator) = &self.schemas.output else {
            return Ok(());
        };
        let Some(structured) = result.get("structuredContent") else {
            if result.get("isError") == Some(&Value::Bool(true)) {
                return Ok(());
            }
            return Err(OutputError::NoStructuredContent {
                server_id: self.server_id.clone(),
                tool: self.name().to_owned(),
            });
        };
        let problems = schema_problems(validator, structured, false);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(OutputError::SchemaViolation {
                server_id: self.server_id.clone(),
                tool: self.name().to_owned(),
                problems,
            })
        }
    }
}

/// Up to [`MAX_ARGUMENT_ERRORS`] ways `value` breaks `schema`, each naming which schema
/// keyword, never the value itself; and where in the value, when `at_value` (the caller's
/// own arguments: a path in an executor's result is built of keys the executor chose, and
/// would carry its words into the host's message).
fn schema_problems(schema: &jsonschema::Validator, value: &Value, at_value: bool) -> Vec<String> {
    schema
        .iter_errors(value)
        .take(MAX_ARGUMENT_ERRORS)
        .map(|e| {
            let at = e.instance_path().to_string();
            let at = match (at_value, at.is_empty()) {
                (false, _) => String::new(),
                (true, true) => "at /: ".to_owned(),
                (true, false) => format!("at {at}: "),
            };
            match e.kind() {
                jsonschema::error::ValidationErrorKind::Required { property } => {
                    format!(
                        "{at}missing required property {property} ({})",
                        e.schema_path()
                    )
                }
                _ => format!("{at}fails {}", e.schema_path()),
            }
        })
        .collect()
}

impl fmt::Debug for AdmittedTool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdmittedTool")
            .field("server_id", &self.server_id)
            .field("name", &self.name())
            .field("topology", &self.topology)
            .field("security", &self.security)
            .field("manifest_digest", &self.manifest_digest)
            .finish_non_exhaustive()
    }
}

/// One registered server: its verified envelope and its admitted tools.
#[derive(Debug)]
pub struct AdmittedServer {
    envelope: SignedManifest,
    digest: ManifestDigest,
    tools: BTreeMap<String, AdmittedTool>,
    /// The operator's least label of everything the server's resources and prompts return
    /// (required when it declares any: rule 9).
    content_floor: Option<InformationLabel>,
}

impl AdmittedServer {
    /// The server id.
    pub fn server_id(&self) -> &str {
        self.envelope.body().server_id()
    }

    /// The envelope as registered (verified against the operator's key).
    pub fn envelope(&self) -> &SignedManifest {
        &self.envelope
    }

    /// The manifest digest.
    pub fn manifest_digest(&self) -> ManifestDigest {
        self.digest
    }

    /// The admitted tools, by name.
    pub fn tools(&self) -> impl Iterator<Item = &AdmittedTool> {
        self.tools.values()
    }
}

/// Security metadata a protocol bridge carries for one tool when its dialect cannot carry
/// the manifest fields.
///
/// Wire form: `flow` (a declaration, optional), `effective_egress` (required), optional
/// `manifest_digest`, `server_id`, `tool_name`; unknown fields and `null` are refused. The
/// registry accepts it only when it equals exactly, coordinates included, what it derives
/// itself ([`VerifiedRegistry::bridge_security`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeSecurityMetadata {
    /// The signed flow declaration of the tool, if it has one.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub flow: Option<ToolFlowDeclaration>,
    /// Whether the registry treats calls to the tool as egress.
    pub effective_egress: bool,
    /// The digest of the manifest the tool was admitted from.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub manifest_digest: Option<ManifestDigest>,
    /// The server.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub server_id: Option<String>,
    /// The tool.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub tool_name: Option<String>,
}

/// A field that, when present, must hold a value: `null` is an error, not "absent".
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// Why bridge metadata was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BridgeSecurityError {
    /// The registry has no such tool.
    #[error("bridge metadata names server {server_id:?} tool {tool:?}, which is not registered")]
    UnknownTool {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
    },
    /// The metadata differs from what the registry derives.
    #[error(
        "bridge metadata for server {server_id:?} tool {tool:?} does not match the registry: {field} differs"
    )]
    Mismatch {
        /// The server.
        server_id: String,
        /// The tool.
        tool: String,
        /// The first field that differs.
        field: &'static str,
    },
}

/// The set of admitted servers and tools. Iteration is in server id, then tool name order.
/// Cloning shares the admitted servers (they are immutable once admitted).
#[derive(Debug, Default, Clone)]
pub struct VerifiedRegistry {
    servers: BTreeMap<String, std::sync::Arc<AdmittedServer>>,
}

impl VerifiedRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits `envelope` under the operator's `registered_key`, per-tool `policies` and the
    /// host's per-tool `topologies`, applying the eight rules of the module docs in order.
    /// On any error the registry is unchanged. A manifest that declares resources or prompts
    /// needs [`VerifiedRegistry::register_with_content`].
    pub fn register(
        &mut self,
        envelope: SignedManifest,
        registered_key: &VerifyingKey,
        policies: &BTreeMap<String, ToolPolicy>,
        topologies: &BTreeMap<String, RuntimeTopology>,
    ) -> Result<(), AdmissionError> {
        self.register_with_content(envelope, registered_key, policies, topologies, None)
    }

    /// [`VerifiedRegistry::register`] with the operator's `content_floor` for the server's
    /// resources and prompts, which rules 9 and 10 (module docs) then check too.
    pub fn register_with_content(
        &mut self,
        envelope: SignedManifest,
        registered_key: &VerifyingKey,
        policies: &BTreeMap<String, ToolPolicy>,
        topologies: &BTreeMap<String, RuntimeTopology>,
        content_floor: Option<&InformationLabel>,
    ) -> Result<(), AdmissionError> {
        // Rule 1.
        envelope.verify(registered_key)?;
        let body = envelope.body();
        let server_id = body.server_id().to_owned();
        // Rule 2.
        if self.servers.contains_key(&server_id) {
            return Err(AdmissionError::DuplicateServer { server_id });
        }
        // Rule 3, both directions.
        for tool in body.tools() {
            if !policies.contains_key(tool.name()) {
                return Err(AdmissionError::MissingPolicy {
                    server_id,
                    tool: tool.name().to_owned(),
                });
            }
            if !topologies.contains_key(tool.name()) {
                return Err(AdmissionError::MissingTopology {
                    server_id,
                    tool: tool.name().to_owned(),
                });
            }
        }
        if let Some(tool) = policies.keys().find(|name| body.tool(name).is_none()) {
            return Err(AdmissionError::PolicyForUnknownTool {
                server_id,
                tool: tool.clone(),
            });
        }
        if let Some(tool) = topologies.keys().find(|name| body.tool(name).is_none()) {
            return Err(AdmissionError::TopologyForUnknownTool {
                server_id,
                tool: tool.clone(),
            });
        }
        let digest = envelope.digest();
        let mut tools = BTreeMap::new();
        for definition in body.tools() {
            let name = definition.name();
            let (Some(policy), Some(&topology)) = (policies.get(name), topologies.get(name)) else {
                // Rule 3 above found both for every tool; kept as an error, not a panic.
                return Err(AdmissionError::MissingPolicy {
                    server_id,
                    tool: name.to_owned(),
                });
            };
            let security = admit_tool(&server_id, definition, policy, topology)?;
            let schemas =
                definition
                    .compile_schemas()
                    .map_err(|reason| AdmissionError::InvalidSchema {
                        server_id: server_id.clone(),
                        tool: name.to_owned(),
                        reason,
                    })?;
            tools.insert(
                name.to_owned(),
                AdmittedTool {
                    server_id: server_id.clone(),
                    definition: definition.clone(),
                    security,
                    topology,
                    manifest_digest: digest,
                    schemas,
                },
            );
        }
        // Rules 9 and 10.
        let content_floor = self.admit_content(body, content_floor)?;
        self.servers.insert(
            server_id,
            std::sync::Arc::new(AdmittedServer {
                envelope,
                digest,
                tools,
                content_floor,
            }),
        );
        Ok(())
    }

    /// This registry without the servers `withdrawn` names (ids it does not hold are
    /// ignored): what stays is exactly as it was admitted.
    pub fn without(&self, withdrawn: &BTreeSet<String>) -> VerifiedRegistry {
        VerifiedRegistry {
            servers: self
                .servers
                .iter()
                .filter(|(id, _)| !withdrawn.contains(*id))
                .map(|(id, s)| (id.clone(), s.clone()))
                .collect(),
        }
    }

    /// The tool `tool_name` of server `server_id`, if admitted.
    pub fn tool(&self, server_id: &str, tool_name: &str) -> Option<&AdmittedTool> {
        self.servers.get(server_id)?.tools.get(tool_name)
    }

    /// The registered servers, by server id.
    pub fn servers(&self) -> impl Iterator<Item = &AdmittedServer> {
        self.servers.values().map(|s| &**s)
    }

    /// Every admitted tool, by server id then tool name.
    pub fn tools(&self) -> impl Iterator<Item = &AdmittedTool> {
        self.servers.values().flat_map(|s| s.tools())
    }

    /// The registered envelopes, by server id.
    pub fn envelopes(&self) -> impl Iterator<Item = &SignedManifest> {
        self.servers.values().map(|s| &s.envelope)
    }

    /// Number of registered servers.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    /// Whether no server is registered.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// Whether the registry may only be served with flow mediation (the native broker
    /// active): some tool declares `flow`, or some admitted tool's security requires it
    /// ([`AdmittedToolSecurity::requires_flow_runtime`]).
    pub fn requires_flow_runtime(&self) -> bool {
        self.tools()
            .any(|t| t.definition.flow().is_some() || t.security.requires_flow_runtime())
            || self.servers.values().any(|s| s.content_floor.is_some())
    }

    /// The bridge metadata the registry derives for a tool, bound to its coordinates.
    pub fn bridge_security(
        &self,
        server_id: &str,
        tool_name: &str,
    ) -> Option<BridgeSecurityMetadata> {
        let tool = self.tool(server_id, tool_name)?;
        Some(BridgeSecurityMetadata {
            flow: tool.definition.flow().cloned(),
            effective_egress: tool.security.effective_egress,
            manifest_digest: Some(tool.manifest_digest),
            server_id: Some(tool.server_id.clone()),
            tool_name: Some(tool.name().to_owned()),
        })
    }

    /// Accepts `metadata` only if it equals exactly what [`VerifiedRegistry::bridge_security`]
    /// derives for the tool (unbound metadata, without its coordinates, is refused).
    pub fn validate_bridge_security(
        &self,
        server_id: &str,
        tool_name: &str,
        metadata: &BridgeSecurityMetadata,
    ) -> Result<(), BridgeSecurityError> {
        let derived = self.bridge_security(server_id, tool_name).ok_or_else(|| {
            BridgeSecurityError::UnknownTool {
                server_id: server_id.to_owned(),
                tool: tool_name.to_owned(),
            }
        })?;
        let field = if metadata.flow != derived.flow {
            "flow"
        } else if metadata.effective_egress != derived.effective_egress {
            "effective_egress"
        } else if metadata.manifest_digest != derived.manifest_digest {
            "manifest_digest"
        } else if metadata.server_id != derived.server_id {
            "server_id"
        } else if metadata.tool_name != derived.tool_name {
            "tool_name"
        } else {
            return Ok(());
        };
        Err(BridgeSecurityError::Mismatch {
            server_id: server_id.to_owned(),
            tool: tool_name.to_owned(),
            field,
        })
    }

    /// Writes the retained set to `path` (normally `<state dir>/signed-manifests.json`) as a
    /// JSON array ordered by server id, atomically: readers and crashes see the old set or the
    /// new one, never a mix. It holds the registered envelopes, and for every server of
    /// `earlier` (the set retained before) that is not registered now, its earlier envelope:
    /// a server left out of one configuration keeps its version, so serving it again later
    /// is still checked against the newest manifest it was ever served with.
    pub fn write_retained_set(
        &self,
        path: &Path,
        earlier: &[RetainedManifest],
    ) -> Result<(), FileError> {
        let mut set: BTreeMap<&str, Value> = earlier
            .iter()
            .map(|e| (e.server_id(), e.envelope.clone()))
            .collect();
        set.extend(
            self.envelopes()
                .map(|e| (e.body().server_id(), e.to_json_value())),
        );
        let set = Value::Array(set.into_values().collect());
        // Compact: indented, a deeply nested manifest (a schema 120 levels deep) grows tens of
        // times over, and a few such would take the set past what is read back at start.
        // A serde_json::Value always serializes (string keys, finite numbers).
        let mut text = serde_json::to_string(&set).unwrap_or_default();
        text.push('\n');
        files::write_atomic(path, text.as_bytes(), 0o644)
    }
}

/// Rules 4 to 8 for one tool.
fn admit_tool(
    server_id: &str,
    definition: &ToolDefinition,
    policy: &ToolPolicy,
    topology: RuntimeTopology,
) -> Result<AdmittedToolSecurity, AdmissionError> {
    let tool = || definition.name().to_owned();
    let flow = definition.flow();
    // Rule 4.
    let effective_egress =
        topology.runtime_egress() || flow.is_some_and(ToolFlowDeclaration::egress);
    // Rule 5.
    if effective_egress && policy.input_clearances.is_empty() {
        return Err(AdmissionError::MissingPolicyClearance {
            server_id: server_id.to_owned(),
            tool: tool(),
        });
    }
    // Rule 6.
    let manifest_clearance = flow.and_then(ToolFlowDeclaration::input_clearance).cloned();
    if let Some(clearance) = &manifest_clearance
        && let Some(policy_clearance) = policy
            .input_clearances
            .iter()
            .find(|p| !clearance.flows_to(p))
    {
        return Err(AdmissionError::ManifestClearanceWidensPolicy {
            server_id: server_id.to_owned(),
            tool: tool(),
            manifest_clearance: Box::new(clearance.clone()),
            policy_clearance: Box::new(policy_clearance.clone()),
        });
    }
    // Rule 7.
    let declared_output = flow
        .and_then(ToolFlowDeclaration::output_label)
        .cloned()
        .unwrap_or_else(InformationLabel::bottom);
    let effective_output_floor = policy
        .output_floor
        .join_restrictions(&declared_output)
        .map_err(|reason| AdmissionError::OutputFloorJoin {
            server_id: server_id.to_owned(),
            tool: tool(),
            reason,
        })?;
    if effective_output_floor.is_top() {
        return Err(AdmissionError::TopEffectiveOutputFloor {
            server_id: server_id.to_owned(),
            tool: tool(),
        });
    }
    // Rule 8.
    let declassification_purposes = match flow {
        Some(flow) => policy
            .declassification_purposes
            .intersection(flow.declassification_purposes())
            .cloned()
            .collect(),
        None => BTreeSet::new(),
    };
    Ok(AdmittedToolSecurity {
        effective_egress,
        policy_clearances: policy.input_clearances.clone(),
        manifest_clearance,
        effective_output_floor,
        declassification_purposes,
    })
}

/// A server offered a manifest older than the one it was served with before, another body
/// at the same version, or a version that cannot be ordered against that one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "server {server:?}: manifest version {offered} is {} version {retained}, which \
     this host served before (kept in {}): a rollback to an older signed manifest is refused, \
     and a changed manifest needs a newer version; to serve it on purpose, delete that file, \
     then reload or start again",
    match kind {
        RollbackKind::Older => "older than",
        RollbackKind::SameVersion => "another body at the same precedence as",
        RollbackKind::Unordered => "not a version that can be ordered (semantic, or up to three \
            dot-separated numbers) against",
    },
    file.display()
)]
pub struct RollbackError {
    /// The server.
    pub server: String,
    /// The version offered now.
    pub offered: String,
    /// The version served before.
    pub retained: String,
    /// Why the offered manifest is not newer.
    pub kind: RollbackKind,
    /// The retained set that remembers it.
    pub file: std::path::PathBuf,
}

/// Why an offered manifest was not proven newer than the one served before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RollbackKind {
    /// Its version orders before the one served.
    Older,
    /// Its version has the same precedence (build metadata is ignored, `1` is `1.0.0`) and
    /// its body differs.
    SameVersion,
    /// One of the two versions cannot be ordered, and they differ.
    Unordered,
}

/// A manifest version as a semantic version: one that parses as such, or up to three
/// dot-separated decimal numbers (`1`, `1.2`, `01.2.0`), read as the release they name.
/// Anything else has no order.
fn orderable_version(text: &str) -> Option<semver::Version> {
    if let Ok(v) = semver::Version::parse(text) {
        return Some(v);
    }
    let mut parts = [0u64; 3];
    for (i, part) in text.split('.').enumerate() {
        if i == parts.len() || part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        parts[i] = part.parse().ok()?;
    }
    Some(semver::Version::new(parts[0], parts[1], parts[2]))
}

impl VerifiedRegistry {
    /// Refuses to serve a server a manifest not proven newer than the one `retained` (the
    /// set read back from `file`) holds for it: an older manifest is still validly signed,
    /// so without this whoever can replace a manifest file could bring back a version whose
    /// declarations (an output label, a clearance) the publisher has since tightened.
    /// Versions are ordered by semantic-version precedence (`1.2.0` < `1.10.0`, a
    /// pre-release below its release, build metadata ignored; `1` and `1.2` read as `1.0.0`
    /// and `1.2.0`). Refused: an older version; the same precedence with another body (whoever
    /// holds the publisher's key could otherwise loosen a declaration without the version
    /// saying so, or pass an older body off as current under new build metadata); and a
    /// different version where either cannot be ordered, since it cannot be proven newer.
    pub fn check_no_rollback(
        &self,
        retained: &[RetainedManifest],
        file: &Path,
    ) -> Result<(), RollbackError> {
        for envelope in self.envelopes() {
            let offered = envelope.body();
            let Some(before) = retained
                .iter()
                .find(|e| e.server_id() == offered.server_id())
            else {
                continue;
            };
            let same_body = envelope.digest() == before.digest;
            let kind = match (
                orderable_version(offered.version()),
                orderable_version(before.version()),
            ) {
                (Some(now), Some(then)) => match now.cmp_precedence(&then) {
                    std::cmp::Ordering::Less => Some(RollbackKind::Older),
                    std::cmp::Ordering::Equal if !same_body => Some(RollbackKind::SameVersion),
                    _ => None,
                },
                _ if offered.version() != before.version() => Some(RollbackKind::Unordered),
                _ if !same_body => Some(RollbackKind::SameVersion),
                _ => None,
            };
            if let Some(kind) = kind {
                return Err(RollbackError {
                    server: offered.server_id().to_owned(),
                    offered: offered.version().to_owned(),
                    retained: before.version().to_owned(),
                    kind,
                    file: file.to_owned(),
                });
            }
        }
        Ok(())
    }
}

/// One entry of the retained set as read back: what the rollback check compares (the
/// server, the version, the digest of the body as signed) and the envelope, to be written
/// out again unchanged. Nothing in it is served: a served manifest is verified and
/// admitted from its own file.
#[derive(Debug, Clone)]
pub struct RetainedManifest {
    server_id: String,
    version: String,
    digest: ManifestDigest,
    envelope: Value,
}

impl RetainedManifest {
    /// The server the entry is for.
    pub fn server_id(&self) -> &str {
        &self.server_id
    }

    /// The version the server was last served with.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The digest of the body as signed.
    pub fn digest(&self) -> ManifestDigest {
        self.digest
    }

    /// Reads one entry: an object whose `manifest` is an object with string `server_id`
    /// and `version`. Only these are decoded, so an entry an earlier flowhost admitted
    /// still reads after an upgrade made the manifest rules stricter (before, such an
    /// entry made every start and reload fail, and the only way out, deleting the file,
    /// gave up the rollback check for every server).
    fn from_json_value(value: Value, at: &JsonPath) -> Result<Self, ManifestError> {
        let wrong =
            |path: JsonPath, expected: &'static str, v: Option<&Value>| ManifestError::WrongType {
                path,
                expected,
                found: v.map_or("nothing", crate::manifest::json_type),
            };
        let Value::Object(mut envelope) = value else {
            return Err(wrong(at.clone(), "a signed manifest", Some(&value)));
        };
        let body = match envelope.remove("manifest") {
            Some(Value::Object(body)) => body,
            other => {
                return Err(wrong(at.key("manifest"), "an object", other.as_ref()));
            }
        };
        let text = |field: &str| match body.get(field) {
            Some(Value::String(s)) => Ok(s.clone()),
            other => Err(wrong(at.key("manifest").key(field), "a string", other)),
        };
        let (server_id, version) = (text("server_id")?, text("version")?);
        let body = Value::Object(body);
        let digest = ManifestDigest::of_canonical_bytes(&canonical::canonical_bytes(&body)?);
        envelope.insert("manifest".into(), body);
        Ok(RetainedManifest {
            server_id,
            version,
            digest,
            envelope: Value::Object(envelope),
        })
    }
}

impl From<&SignedManifest> for RetainedManifest {
    fn from(e: &SignedManifest) -> Self {
        RetainedManifest {
            server_id: e.body().server_id().to_owned(),
            version: e.body().version().to_owned(),
            digest: e.digest(),
            envelope: e.to_json_value(),
        }
    }
}

/// Reads a retained set written by [`VerifiedRegistry::write_retained_set`]: for each
/// entry, only what the rollback check needs (see [`RetainedManifest`]); nothing is
/// verified, and nothing read here is served.
pub fn load_retained_set(path: &Path) -> Result<Vec<RetainedManifest>, ManifestFileError> {
    let text = files::read_text(path, MAX_RETAINED_SET_BYTES)?;
    let invalid = |reason: ManifestError| ManifestFileError::Invalid {
        file: path.to_owned(),
        reason,
    };
    let value = canonical::parse_strict(&text).map_err(|e| invalid(e.into()))?;
    let Value::Array(items) = value else {
        return Err(invalid(ManifestError::WrongType {
            path: JsonPath::root(),
            expected: "an array of signed manifests",
            found: crate::manifest::json_type(&value),
        }));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            RetainedManifest::from_json_value(item, &JsonPath::root().index(i)).map_err(invalid)
        })
        .collect()
}

mod content;
pub use content::ContentRoute;

#[cfg(test)]
mod tests;
