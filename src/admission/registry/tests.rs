//! Admission rules, one test each, and the registry's derived facts.

use std::collections::{BTreeMap, BTreeSet};

use ed25519_dalek::SigningKey;
use serde_json::{Value, json};

use super::*;
use crate::ident::{Compartment, PrincipalId};
use crate::keys::public_key_to_hex;

fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

fn owner(name: &str) -> InformationLabel {
    let p = PrincipalId::new(name).unwrap();
    InformationLabel::try_known(
        BTreeMap::from([(p.clone(), BTreeSet::from([p]))]),
        BTreeSet::new(),
    )
    .unwrap()
}

fn terms() -> InformationLabel {
    let p = PrincipalId::new("larkfield-pricing").unwrap();
    InformationLabel::try_known(
        BTreeMap::from([(p.clone(), BTreeSet::from([p]))]),
        BTreeSet::from([Compartment::new("harbor-goods-terms").unwrap()]),
    )
    .unwrap()
}

fn label_json(label: &InformationLabel) -> Value {
    serde_json::to_value(label).unwrap()
}

fn purposes(names: &[&str]) -> BTreeSet<DeclassificationPurpose> {
    names
        .iter()
        .map(|n| DeclassificationPurpose::new(n).unwrap())
        .collect()
}

/// A signed manifest for `server` with one tool per `(name, flow)`.
fn signed(server: &str, signer: &SigningKey, tools: &[(&str, Option<Value>)]) -> SignedManifest {
    let tools: Vec<Value> = tools
        .iter()
        .map(|(name, flow)| {
            let mut tool = json!({
                "name": name,
                "description": format!("The {name} tool."),
                "input_schema": {"type": "object", "properties": {"message": {"type": "string"}},
                                 "required": ["message"], "additionalProperties": false},
                "annotations": {"read_only": false, "destructive": false, "idempotent": false,
                                "requires_approval": false}
            });
            if let Some(flow) = flow {
                tool["flow"] = flow.clone();
            }
            tool
        })
        .collect();
    let body = json!({
        "schema": "flowhost.manifest.v1",
        "server_id": server,
        "name": server,
        "version": "1",
        "public_key": public_key_to_hex(&signer.verifying_key()),
        "tools": tools,
    });
    SignedManifest::sign(body, signer).unwrap()
}

fn policies(entries: &[(&str, ToolPolicy)]) -> BTreeMap<String, ToolPolicy> {
    entries
        .iter()
        .map(|(n, p)| ((*n).to_owned(), p.clone()))
        .collect()
}

fn topologies(entries: &[(&str, RuntimeTopology)]) -> BTreeMap<String, RuntimeTopology> {
    entries.iter().map(|(n, t)| ((*n).to_owned(), *t)).collect()
}

/// Registers one single-tool manifest and returns the result and the registry.
fn admit_one(
    flow: Option<Value>,
    policy: ToolPolicy,
    topology: RuntimeTopology,
) -> (Result<(), AdmissionError>, VerifiedRegistry) {
    let k = key(1);
    let mut registry = VerifiedRegistry::new();
    let result = registry.register(
        signed("srv", &k, &[("tool", flow)]),
        &k.verifying_key(),
        &policies(&[("tool", policy)]),
        &topologies(&[("tool", topology)]),
    );
    (result, registry)
}

fn admitted_security(
    flow: Option<Value>,
    policy: ToolPolicy,
    topology: RuntimeTopology,
) -> AdmittedToolSecurity {
    let (result, registry) = admit_one(flow, policy, topology);
    result.unwrap();
    registry.tool("srv", "tool").unwrap().security().clone()
}

fn cleared(clearances: Vec<InformationLabel>) -> ToolPolicy {
    ToolPolicy::new(clearances, InformationLabel::bottom(), BTreeSet::new()).unwrap()
}

// ---------- the eight rules ----------

#[test]
fn rule_1_signature_is_checked_against_the_registered_key() {
    let (publisher, operator) = (key(1), key(2));
    let mut registry = VerifiedRegistry::new();
    let err = registry
        .register(
            signed("srv", &publisher, &[("tool", None)]),
            &operator.verifying_key(),
            &policies(&[("tool", ToolPolicy::public_only())]),
            &topologies(&[("tool", RuntimeTopology::Local)]),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        AdmissionError::Verification(VerifyError::SignerNotRegistered { .. })
    ));
    assert!(registry.is_empty());
    // A body changed after signing is refused even with the right key.
    let mut env = signed("srv", &publisher, &[("tool", None)]).to_json_value();
    env["manifest"]["tools"][0]["description"] = json!("changed");
    let tampered = SignedManifest::from_json_value(env, &JsonPath::root()).unwrap();
    let err = registry
        .register(
            tampered,
            &publisher.verifying_key(),
            &policies(&[("tool", ToolPolicy::public_only())]),
            &topologies(&[("tool", RuntimeTopology::Local)]),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        AdmissionError::Verification(VerifyError::BadSignature { .. })
    ));
}

#[test]
fn rule_2_duplicate_server_is_refused() {
    let k = key(1);
    let mut registry = VerifiedRegistry::new();
    let p = policies(&[("tool", ToolPolicy::public_only())]);
    let t = topologies(&[("tool", RuntimeTopology::Local)]);
    registry
        .register(
            signed("srv", &k, &[("tool", None)]),
            &k.verifying_key(),
            &p,
            &t,
        )
        .unwrap();
    let err = registry
        .register(
            signed("srv", &k, &[("tool", None)]),
            &k.verifying_key(),
            &p,
            &t,
        )
        .unwrap_err();
    assert!(matches!(err, AdmissionError::DuplicateServer { server_id } if server_id == "srv"));
    assert_eq!(registry.len(), 1);
}

#[test]
fn rule_3_every_tool_needs_a_policy_and_a_topology_and_no_extras() {
    let k = key(1);
    let two = || signed("srv", &k, &[("a", None), ("b", None)]);
    let public = ToolPolicy::public_only();
    let local = RuntimeTopology::Local;
    let cases: Vec<(
        BTreeMap<String, ToolPolicy>,
        BTreeMap<String, RuntimeTopology>,
    )> = vec![
        (
            policies(&[("a", public.clone())]),
            topologies(&[("a", local), ("b", local)]),
        ),
        (
            policies(&[("a", public.clone()), ("b", public.clone())]),
            topologies(&[("a", local)]),
        ),
        (
            policies(&[
                ("a", public.clone()),
                ("b", public.clone()),
                ("c", public.clone()),
            ]),
            topologies(&[("a", local), ("b", local)]),
        ),
        (
            policies(&[("a", public.clone()), ("b", public.clone())]),
            topologies(&[("a", local), ("b", local), ("c", local)]),
        ),
    ];
    let mut outcomes = Vec::new();
    for (p, t) in &cases {
        let mut registry = VerifiedRegistry::new();
        outcomes.push(
            registry
                .register(two(), &k.verifying_key(), p, t)
                .unwrap_err(),
        );
        assert!(registry.is_empty());
    }
    assert!(
        matches!(&outcomes[0], AdmissionError::MissingPolicy { server_id, tool } if server_id == "srv" && tool == "b")
    );
    assert!(matches!(&outcomes[1], AdmissionError::MissingTopology { tool, .. } if tool == "b"));
    assert!(
        matches!(&outcomes[2], AdmissionError::PolicyForUnknownTool { tool, .. } if tool == "c")
    );
    assert!(
        matches!(&outcomes[3], AdmissionError::TopologyForUnknownTool { tool, .. } if tool == "c")
    );
    assert!(outcomes[2].to_string().contains("does not declare"));
}

#[test]
fn rule_4_effective_egress_is_topology_or_declaration() {
    let policy = || cleared(vec![InformationLabel::bottom()]);
    let egress = |flow: Option<Value>, topology| {
        admitted_security(flow, policy(), topology).effective_egress()
    };
    use RuntimeTopology::{Brokered, Local};
    assert!(!egress(None, Local));
    assert!(!egress(Some(json!({"egress": false})), Local));
    assert!(egress(Some(json!({"egress": true})), Local));
    // The publisher cannot remove egress the runtime gives.
    assert!(egress(Some(json!({"egress": false})), Brokered));
    assert!(egress(None, Brokered));
    assert!(Brokered.runtime_egress() && !Local.runtime_egress());
}

#[test]
fn rule_5_effective_egress_needs_a_policy_clearance() {
    let none = cleared(vec![]);
    let (result, registry) = admit_one(
        Some(json!({"egress": true})),
        none.clone(),
        RuntimeTopology::Local,
    );
    assert!(matches!(
        result,
        Err(AdmissionError::MissingPolicyClearance { ref server_id, ref tool }) if server_id == "srv" && tool == "tool"
    ));
    assert!(registry.is_empty());
    // Egress from the topology alone, with no declaration at all, is caught the same way.
    let (result, _) = admit_one(None, none.clone(), RuntimeTopology::Brokered);
    assert!(matches!(
        result,
        Err(AdmissionError::MissingPolicyClearance { .. })
    ));
    // Without effective egress, no clearance is needed.
    let (result, _) = admit_one(Some(json!({"egress": false})), none, RuntimeTopology::Local);
    result.unwrap();
}

#[test]
fn rule_6_manifest_clearance_may_only_narrow_every_policy_clearance() {
    let flow = json!({"egress": true, "input_clearance": label_json(&terms())});
    // terms does not flow to the second clearance (a different owner).
    let (result, _) = admit_one(
        Some(flow.clone()),
        cleared(vec![terms(), owner("someone-else")]),
        RuntimeTopology::Local,
    );
    match result {
        Err(AdmissionError::ManifestClearanceWidensPolicy {
            manifest_clearance,
            policy_clearance,
            ..
        }) => {
            assert_eq!(*manifest_clearance, terms());
            assert_eq!(*policy_clearance, owner("someone-else"));
        }
        other => panic!("{other:?}"),
    }
    // A public clearance under a terms policy clearance narrows it: admitted.
    let narrow =
        json!({"egress": true, "input_clearance": label_json(&InformationLabel::bottom())});
    let security = admitted_security(Some(narrow), cleared(vec![terms()]), RuntimeTopology::Local);
    assert_eq!(
        security.manifest_clearance(),
        Some(&InformationLabel::bottom())
    );
    assert_eq!(security.policy_clearances(), &[terms()]);
    // Equal is fine too.
    admitted_security(Some(flow), cleared(vec![terms()]), RuntimeTopology::Local);
}

#[test]
fn rule_7_effective_output_floor_is_the_join_and_overflow_is_refused() {
    let floor = ToolPolicy::new(vec![], owner("operator"), BTreeSet::new()).unwrap();
    let flow = json!({"egress": false, "output_label": label_json(&terms())});
    let security = admitted_security(Some(flow), floor.clone(), RuntimeTopology::Local);
    assert_eq!(
        security.effective_output_floor(),
        &owner("operator").join_restrictions(&terms()).unwrap()
    );
    // No declaration: the policy floor alone.
    let security = admitted_security(None, floor, RuntimeTopology::Local);
    assert_eq!(security.effective_output_floor(), &owner("operator"));
    // 40 + 40 owners exceed the 64-owner limit.
    let many = |prefix: &str| {
        InformationLabel::try_known(
            (0..40)
                .map(|i| {
                    let p = PrincipalId::new(format!("{prefix}{i}")).unwrap();
                    (p.clone(), BTreeSet::from([p]))
                })
                .collect(),
            BTreeSet::new(),
        )
        .unwrap()
    };
    let policy = ToolPolicy::new(vec![], many("a"), BTreeSet::new()).unwrap();
    let flow = json!({"egress": false, "output_label": label_json(&many("b"))});
    let (result, _) = admit_one(Some(flow), policy, RuntimeTopology::Local);
    assert!(matches!(
        result,
        Err(AdmissionError::OutputFloorJoin {
            reason: LabelError::TooManyOwners { count: 80 },
            ..
        })
    ));
}

#[test]
fn rule_8_purposes_are_policy_intersect_manifest() {
    let policy = ToolPolicy::new(
        vec![InformationLabel::bottom()],
        InformationLabel::bottom(),
        purposes(&["audit", "reviewed-summary"]),
    )
    .unwrap();
    let flow =
        json!({"egress": false, "declassification_purposes": ["reviewed-summary", "support"]});
    let security = admitted_security(Some(flow), policy.clone(), RuntimeTopology::Local);
    assert_eq!(
        security.declassification_purposes(),
        &purposes(&["reviewed-summary"])
    );
    // No declaration: nothing the publisher allowed, so no purposes.
    let security = admitted_security(None, policy, RuntimeTopology::Local);
    assert!(security.declassification_purposes().is_empty());
}

/// An input or output schema that does not compile is refused, naming which. Before, an
/// output schema was never compiled, so one no result could be checked against was admitted.
#[test]
fn a_schema_that_does_not_compile_is_refused_at_admission() {
    let k = key(1);
    for (field, schema) in [
        ("input_schema", json!({"type": "no-such-type"})),
        // Remote references are never fetched: the schema must be self-contained.
        (
            "input_schema",
            json!({"$ref": "https://schemas.example/tool.json"}),
        ),
        ("input_schema", json!({"$ref": "file:///etc/passwd"})),
        ("output_schema", json!({"type": "no-such-type"})),
        ("output_schema", json!({"$ref": "file:///etc/passwd"})),
    ] {
        let mut body = signed("srv", &k, &[("tool", None)]).body_json().clone();
        body["tools"][0][field] = schema.clone();
        let envelope = SignedManifest::sign(body, &k).unwrap();
        let mut registry = VerifiedRegistry::new();
        let result = registry.register(
            envelope,
            &k.verifying_key(),
            &policies(&[("tool", ToolPolicy::public_only())]),
            &topologies(&[("tool", RuntimeTopology::Local)]),
        );
        assert!(
            matches!(&result, Err(AdmissionError::InvalidSchema { reason, .. }) if reason.field == field),
            "{schema}: {result:?}"
        );
        assert!(registry.is_empty());
    }
}

// ---------- requires_flow_runtime ----------

fn quiet_security() -> AdmittedToolSecurity {
    AdmittedToolSecurity {
        effective_egress: false,
        policy_clearances: vec![InformationLabel::bottom()],
        manifest_clearance: None,
        effective_output_floor: InformationLabel::bottom(),
        declassification_purposes: BTreeSet::new(),
    }
}

#[test]
fn tool_security_requires_flow_runtime_on_each_trigger() {
    assert!(!quiet_security().requires_flow_runtime());
    type Trigger = fn(&mut AdmittedToolSecurity);
    let triggers: Vec<(&str, Trigger)> = vec![
        ("effective egress", |s| s.effective_egress = true),
        ("manifest clearance", |s| {
            s.manifest_clearance = Some(InformationLabel::bottom())
        }),
        ("non-bottom output floor", |s| {
            s.effective_output_floor = owner("a")
        }),
        ("purposes", |s| {
            s.declassification_purposes = purposes(&["audit"])
        }),
        ("non-bottom policy clearance", |s| {
            s.policy_clearances.push(owner("a"))
        }),
    ];
    for (what, set) in triggers {
        let mut security = quiet_security();
        set(&mut security);
        assert!(security.requires_flow_runtime(), "{what}");
    }
}

#[test]
fn registry_requires_flow_runtime_on_each_trigger() {
    let requires = |flow: Option<Value>, policy: ToolPolicy, topology| {
        let (result, registry) = admit_one(flow, policy, topology);
        result.unwrap();
        registry.requires_flow_runtime()
    };
    use RuntimeTopology::{Brokered, Local};
    let public = ToolPolicy::public_only();
    assert!(!requires(None, public.clone(), Local), "quiet local tool");
    assert!(!VerifiedRegistry::new().requires_flow_runtime());
    // Any declaration, even one that changes nothing else.
    assert!(requires(
        Some(json!({"egress": false})),
        public.clone(),
        Local
    ));
    // Effective egress from the topology alone.
    assert!(requires(None, public.clone(), Brokered));
    // A non-bottom output floor from the policy alone.
    let floor = ToolPolicy::new(vec![], owner("operator"), BTreeSet::new()).unwrap();
    assert!(requires(None, floor, Local));
    // A non-bottom policy clearance alone.
    assert!(requires(None, cleared(vec![terms()]), Local));
    // Purposes only reach a tool through a declaration; its security alone requires it.
    let policy = ToolPolicy::new(vec![], InformationLabel::bottom(), purposes(&["audit"])).unwrap();
    let security = admitted_security(
        Some(json!({"egress": false, "declassification_purposes": ["audit"]})),
        policy,
        Local,
    );
    assert!(security.requires_flow_runtime());
    // A manifest clearance likewise.
    let security = admitted_security(
        Some(json!({"egress": false, "input_clearance": label_json(&InformationLabel::bottom())})),
        cleared(vec![]),
        Local,
    );
    assert!(security.requires_flow_runtime());
}

// ---------- lookups, arguments, bridge metadata ----------

#[test]
fn lookups_are_stable_and_carry_the_definition() {
    let k = key(1);
    let mut registry = VerifiedRegistry::new();
    for server in ["zeta", "alpha"] {
        let envelope = signed(server, &k, &[("b", None), ("a", None)]);
        registry
            .register(
                envelope,
                &k.verifying_key(),
                &policies(&[
                    ("a", ToolPolicy::public_only()),
                    ("b", ToolPolicy::public_only()),
                ]),
                &topologies(&[("a", RuntimeTopology::Local), ("b", RuntimeTopology::Local)]),
            )
            .unwrap();
    }
    let order: Vec<(String, String)> = registry
        .tools()
        .map(|t| (t.server_id().to_owned(), t.name().to_owned()))
        .collect();
    assert_eq!(
        order,
        [("alpha", "a"), ("alpha", "b"), ("zeta", "a"), ("zeta", "b")]
            .map(|(s, t)| (s.to_owned(), t.to_owned()))
    );
    let servers: Vec<&str> = registry.servers().map(AdmittedServer::server_id).collect();
    assert_eq!(servers, ["alpha", "zeta"]);
    let tool = registry.tool("zeta", "a").unwrap();
    assert_eq!(tool.definition().name(), "a");
    assert_eq!(tool.topology(), RuntimeTopology::Local);
    assert_eq!(tool.sanitized_description(), "The a tool.");
    let envelope = registry.envelopes().nth(1).unwrap();
    assert_eq!(tool.manifest_digest(), envelope.digest());
    assert!(registry.tool("zeta", "c").is_none());
    assert!(registry.tool("beta", "a").is_none());
}

#[test]
fn arguments_are_validated_without_echoing_values() {
    let (result, registry) = admit_one(None, ToolPolicy::public_only(), RuntimeTopology::Local);
    result.unwrap();
    let tool = registry.tool("srv", "tool").unwrap();
    tool.validate_arguments(&json!({"message": "hello"}))
        .unwrap();
    match tool.validate_arguments(&json!({"message": 42, "secret": "hunter2"})) {
        Err(ArgumentError::SchemaViolation { problems, .. }) => {
            let all = problems.join("\n");
            assert!(all.contains("/message"), "{all}");
            assert!(!all.contains("hunter2") && !all.contains("42"), "{all}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        tool.validate_arguments(&json!({})),
        Err(ArgumentError::SchemaViolation { .. })
    ));
    assert!(matches!(
        tool.validate_arguments(&json!(["message"])),
        Err(ArgumentError::NotAnObject {
            found: "an array",
            ..
        })
    ));
}

#[test]
fn bridge_metadata_must_match_exactly() {
    let flow = json!({"egress": true, "input_clearance": label_json(&terms()),
                      "output_label": label_json(&InformationLabel::bottom())});
    let (result, registry) = admit_one(Some(flow), cleared(vec![terms()]), RuntimeTopology::Local);
    result.unwrap();
    let derived = registry.bridge_security("srv", "tool").unwrap();
    assert!(derived.effective_egress);
    registry
        .validate_bridge_security("srv", "tool", &derived)
        .unwrap();
    // Through the wire form and back, still equal.
    let wire = serde_json::to_string(&derived).unwrap();
    let back: BridgeSecurityMetadata = serde_json::from_str(&wire).unwrap();
    registry
        .validate_bridge_security("srv", "tool", &back)
        .unwrap();

    let mismatch = |change: fn(&mut BridgeSecurityMetadata)| {
        let mut m = derived.clone();
        change(&mut m);
        match registry.validate_bridge_security("srv", "tool", &m) {
            Err(BridgeSecurityError::Mismatch { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(mismatch(|m| m.flow = None), "flow");
    assert_eq!(
        mismatch(|m| m.flow = Some(ToolFlowDeclaration::public_egress())),
        "flow"
    );
    assert_eq!(mismatch(|m| m.effective_egress = false), "effective_egress");
    assert_eq!(
        mismatch(|m| m.manifest_digest = Some(ManifestDigest::of_canonical_bytes(b"x"))),
        "manifest_digest"
    );
    assert_eq!(mismatch(|m| m.manifest_digest = None), "manifest_digest");
    assert_eq!(
        mismatch(|m| m.server_id = Some("other".into())),
        "server_id"
    );
    assert_eq!(mismatch(|m| m.tool_name = None), "tool_name");
    assert!(matches!(
        registry.validate_bridge_security("srv", "nope", &derived),
        Err(BridgeSecurityError::UnknownTool { .. })
    ));
    // The same metadata presented for another tool of another server is refused.
    assert!(
        registry
            .validate_bridge_security("other", "tool", &derived)
            .is_err()
    );
}

#[test]
fn bridge_metadata_wire_form_is_strict() {
    let ok = r#"{"effective_egress": false}"#;
    let m: BridgeSecurityMetadata = serde_json::from_str(ok).unwrap();
    assert!(m.flow.is_none() && m.server_id.is_none());
    for bad in [
        r#"{"effective_egress": false, "extra": 1}"#,
        r#"{"effective_egress": false, "flow": null}"#,
        r#"{"effective_egress": false, "server_id": null}"#,
        r#"{"effective_egress": false, "manifest_digest": "sha256:00"}"#,
        r#"{"flow": {"egress": true}}"#,
    ] {
        assert!(
            serde_json::from_str::<BridgeSecurityMetadata>(bad).is_err(),
            "{bad}"
        );
    }
}

// ---------- operator policy ----------

#[test]
fn tool_policy_rejects_top() {
    assert_eq!(
        ToolPolicy::new(
            vec![InformationLabel::bottom(), InformationLabel::Top],
            InformationLabel::bottom(),
            BTreeSet::new()
        ),
        Err(PolicyError::TopClearance { index: 1 })
    );
    assert_eq!(
        ToolPolicy::new(vec![], InformationLabel::Top, BTreeSet::new()),
        Err(PolicyError::TopOutputFloor)
    );
    let public = ToolPolicy::public_only();
    assert_eq!(public.input_clearances(), &[InformationLabel::bottom()]);
    assert!(public.output_floor().is_bottom() && public.declassification_purposes().is_empty());
}

#[test]
fn tool_policy_reads_from_toml_inline_tables() {
    #[derive(Deserialize)]
    struct Config {
        policy: BTreeMap<String, ToolPolicy>,
    }
    let text = r#"
        [policy.read_terms]
        input_clearances = [
          { kind = "known", owners = { larkfield-pricing = ["larkfield-pricing"] }, compartments = ["harbor-goods-terms"] },
        ]
        output_floor = { kind = "known", owners = {}, compartments = [] }
        declassification_purposes = ["reviewed-summary"]

        [policy.publish]
        input_clearances = []
        output_floor = { kind = "known", owners = {}, compartments = [] }
    "#;
    let config: Config = toml::from_str(text).unwrap();
    let read = &config.policy["read_terms"];
    assert_eq!(read.input_clearances(), &[terms()]);
    assert_eq!(
        read.declassification_purposes(),
        &purposes(&["reviewed-summary"])
    );
    assert!(config.policy["publish"].input_clearances().is_empty());
    for bad in [
        // Top floor.
        "input_clearances = []\noutput_floor = { kind = \"top\" }",
        // Unknown field.
        "input_clearances = []\noutput_floor = { kind = \"known\", owners = {}, compartments = [] }\nmode = 1",
        // Missing floor.
        "input_clearances = []",
        // Duplicate purposes.
        "input_clearances = []\noutput_floor = { kind = \"known\", owners = {}, compartments = [] }\ndeclassification_purposes = [\"a\", \"a\"]",
    ] {
        assert!(toml::from_str::<ToolPolicy>(bad).is_err(), "{bad}");
    }
    assert!(
        serde_json::from_str::<ToolPolicy>(
            r#"{"input_clearances":[],"output_floor":{"kind":"known","owners":{},"compartments":[]},"declassification_purposes":null}"#
        )
        .is_err()
    );
}

// ---------- retained set ----------

/// A manifest admitted before bodies were bounded in depth (nested 123 levels, which the
/// envelope and the retained set still hold within the parser's 128) is read back from the
/// retained set after an upgrade; only admitting one anew refuses it. Before, the bound was
/// checked on read back too, and every start failed until the set was deleted.
#[test]
fn a_deep_manifest_retained_before_the_bound_still_reads_back() {
    let k = key(1);
    let mut nested = json!(0);
    for _ in 0..118 {
        nested = json!([nested]);
    }
    let mut envelope = signed("deep", &k, &[("tool", None)]).to_json_value();
    envelope["manifest"]["tools"][0]["output_schema"] =
        json!({"type": "object", "examples": [nested]});
    let deep = SignedManifest::sign(envelope["manifest"].clone(), &k).unwrap();
    let mut registry = VerifiedRegistry::new();
    let p = policies(&[("tool", ToolPolicy::public_only())]);
    let t = topologies(&[("tool", RuntimeTopology::Local)]);
    registry
        .register(deep.clone(), &k.verifying_key(), &p, &t)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(RETAINED_SET_FILE);
    registry.write_retained_set(&path, &[]).unwrap();
    assert_eq!(load_retained_set(&path).unwrap()[0].digest(), deep.digest());
    let file = dir.path().join("deep.signed.json");
    std::fs::write(&file, deep.to_pretty_json()).unwrap();
    let e = crate::manifest::load_envelope_file(&file)
        .unwrap_err()
        .to_string();
    assert!(e.contains("nests 123 levels deep"), "{e}");
}

#[test]
fn retained_set_round_trips_and_re_registers() {
    let k = key(1);
    let mut registry = VerifiedRegistry::new();
    let p = policies(&[("tool", ToolPolicy::public_only())]);
    let t = topologies(&[("tool", RuntimeTopology::Local)]);
    for server in ["b-server", "a-server"] {
        registry
            .register(
                signed(server, &k, &[("tool", None)]),
                &k.verifying_key(),
                &p,
                &t,
            )
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(RETAINED_SET_FILE);
    registry.write_retained_set(&path, &[]).unwrap();
    // A JSON array of envelopes, each with the body as signed, written compact (one line):
    // indented, a deeply nested manifest grows tens of times over.
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    let raw: Value = serde_json::from_str(&text).unwrap();
    let bodies: Vec<&str> = raw
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["manifest"]["server_id"].as_str().unwrap())
        .collect();
    assert_eq!(bodies, ["a-server", "b-server"]);
    let loaded = load_retained_set(&path).unwrap();
    let digests: Vec<_> = loaded.iter().map(RetainedManifest::digest).collect();
    let expected: Vec<_> = registry.envelopes().map(SignedManifest::digest).collect();
    assert_eq!(digests, expected);
    // Each entry is the envelope as it was signed: it registers again.
    let raw: Vec<Value> = serde_json::from_str(&text).unwrap();
    let mut again = VerifiedRegistry::new();
    for (i, envelope) in raw.into_iter().enumerate() {
        let envelope =
            SignedManifest::from_json_value(envelope, &JsonPath::root().index(i)).unwrap();
        again
            .register(envelope, &k.verifying_key(), &p, &t)
            .unwrap();
    }
    assert_eq!(again.len(), 2);
    // Rewriting replaces the file in place, leaving no temporary file.
    again.write_retained_set(&path, &[]).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn an_older_manifest_than_the_retained_one_is_a_rollback() {
    let k = key(7);
    let versioned = |server: &str, version: &str| {
        let mut body = signed(server, &k, &[("tool", None)]).body_json().clone();
        body["version"] = json!(version);
        SignedManifest::sign(body, &k).unwrap()
    };
    let registry_of = |envelopes: Vec<SignedManifest>| {
        let mut r = VerifiedRegistry::new();
        for e in envelopes {
            r.register(
                e,
                &k.verifying_key(),
                &policies(&[("tool", ToolPolicy::public_only())]),
                &topologies(&[("tool", RuntimeTopology::Local)]),
            )
            .unwrap();
        }
        r
    };
    let file = Path::new("/state/signed-manifests.json");
    let retained: Vec<RetainedManifest> = [
        versioned("a-server", "1.10.0"),
        versioned("b-server", "2024-r1"),
    ]
    .iter()
    .map(RetainedManifest::from)
    .collect();
    // Newer, equal, another server, the same unorderable version: all served.
    for offered in [
        versioned("a-server", "1.10.0"),
        versioned("a-server", "1.10.1"),
        versioned("a-server", "2.0.0-rc.1"),
        versioned("a-server", "2"),
        versioned("a-server", "1.11"),
        versioned("c-server", "0.1.0"),
    ] {
        let r = registry_of(vec![offered, versioned("b-server", "2024-r1")]);
        assert_eq!(r.check_no_rollback(&retained, file), Ok(()));
    }
    // A version that cannot be ordered cannot be proven newer: before, any such version
    // was served over any other, so `2023-r9` replaced `2024-r1`, and `1.9` or `v1.9.0`
    // (neither a semantic version) replaced `1.10.0`.
    for (server, offered, retained_version) in [
        ("b-server", "2023-r9", "2024-r1"),
        ("b-server", "2025-r1", "2024-r1"),
        ("a-server", "v1.9.0", "1.10.0"),
    ] {
        let e = registry_of(vec![versioned(server, offered)])
            .check_no_rollback(&retained, file)
            .unwrap_err();
        assert_eq!(
            (e.offered.as_str(), e.retained.as_str(), e.kind),
            (offered, retained_version, RollbackKind::Unordered)
        );
        assert!(
            e.to_string().contains("not a version that can be ordered"),
            "{e}"
        );
    }
    // Build metadata has no precedence: an older body under other build metadata was
    // served before, because the versions differ as strings and `c1` sorts after `bc`.
    let built = [RetainedManifest::from(&versioned(
        "a-server",
        "1.2.0+bc17664",
    ))];
    for offered in ["1.2.0+c144a98", "1.2.0", "1.2"] {
        let e = registry_of(vec![versioned("a-server", offered)])
            .check_no_rollback(&built, file)
            .unwrap_err();
        assert_eq!(e.kind, RollbackKind::SameVersion, "{offered}");
    }
    let older = registry_of(vec![versioned("a-server", "1.1")])
        .check_no_rollback(&built, file)
        .unwrap_err();
    assert_eq!(older.kind, RollbackKind::Older);
    // The version served before, with another body: re-signed without a new version.
    let changed = {
        let mut body = versioned("a-server", "1.10.0").body_json().clone();
        body["name"] = json!("a-server, changed");
        SignedManifest::sign(body, &k).unwrap()
    };
    let e = registry_of(vec![changed])
        .check_no_rollback(&retained, file)
        .unwrap_err();
    assert_eq!(
        (e.offered.as_str(), e.retained.as_str()),
        ("1.10.0", "1.10.0")
    );
    assert!(e.to_string().contains("another body"), "{e}");
    for older in ["1.9.0", "1.10.0-rc.1", "0.1.0"] {
        let r = registry_of(vec![versioned("a-server", older)]);
        let e = r.check_no_rollback(&retained, file).unwrap_err();
        assert_eq!(
            (e.server.as_str(), e.offered.as_str(), e.retained.as_str()),
            ("a-server", older, "1.10.0")
        );
        let text = e.to_string();
        assert!(text.contains("/state/signed-manifests.json"), "{text}");
    }

    // A server left out of one configuration keeps its version in the set: served at
    // 1.2.0, dropped, then offered at 1.1.0, it is still a rollback.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(RETAINED_SET_FILE);
    let served = registry_of(vec![versioned("a-server", "1.2.0")]);
    served.write_retained_set(&path, &[]).unwrap();
    let without = registry_of(vec![versioned("b-server", "1.0.0")]);
    let retained = load_retained_set(&path).unwrap();
    without.write_retained_set(&path, &retained).unwrap();
    let retained = load_retained_set(&path).unwrap();
    let servers: Vec<_> = retained.iter().map(RetainedManifest::server_id).collect();
    assert_eq!(servers, ["a-server", "b-server"]);
    let back = registry_of(vec![versioned("a-server", "1.1.0")]);
    let e = back.check_no_rollback(&retained, &path).unwrap_err();
    assert_eq!(
        (e.offered.as_str(), e.retained.as_str()),
        ("1.1.0", "1.2.0")
    );
    // A registered server's entry is replaced by the manifest it is served with now.
    let newer = registry_of(vec![versioned("a-server", "1.3.0")]);
    newer.write_retained_set(&path, &retained).unwrap();
    let versions: Vec<_> = load_retained_set(&path)
        .unwrap()
        .iter()
        .map(|e| e.version().to_owned())
        .collect();
    assert_eq!(versions, ["1.3.0", "1.0.0"]);
}

#[test]
fn retained_set_must_be_an_array_of_envelopes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(RETAINED_SET_FILE);
    std::fs::write(&path, "{}").unwrap();
    assert!(matches!(
        load_retained_set(&path),
        Err(ManifestFileError::Invalid {
            reason: ManifestError::WrongType { .. },
            ..
        })
    ));
    std::fs::write(
        &path,
        r#"[{"manifest": {"server_id": "a"}, "signature": "", "signer_key": ""}]"#,
    )
    .unwrap();
    let err = load_retained_set(&path).unwrap_err();
    assert!(err.to_string().contains("[0].manifest.version"), "{err}");
}

/// An entry an earlier flowhost admitted, which today's manifest rules refuse (here a field
/// they do not know; an upper-case URI scheme or a `/` in a server id were others): before,
/// the set was read with today's rules, so every start and reload failed after the upgrade,
/// and deleting the file gave up the rollback check for every server. It reads, still
/// holds its server to its version, and is written back unchanged.
#[test]
fn a_retained_entry_todays_rules_refuse_still_holds_its_server_to_its_version() {
    let k = key(7);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(RETAINED_SET_FILE);
    let mut old = signed("a-server", &k, &[("tool", None)]).to_json_value();
    old["manifest"]["version"] = json!("1.2.0");
    old["manifest"]["retired_field"] = json!({"kept": true});
    let text = serde_json::to_string(&json!([old])).unwrap();
    std::fs::write(&path, &text).unwrap();
    let retained = load_retained_set(&path).unwrap();
    assert_eq!(
        (retained[0].server_id(), retained[0].version()),
        ("a-server", "1.2.0")
    );
    let registry_at = |version: &str| {
        let mut body = signed("a-server", &k, &[("tool", None)])
            .body_json()
            .clone();
        body["version"] = json!(version);
        let mut r = VerifiedRegistry::new();
        r.register(
            SignedManifest::sign(body, &k).unwrap(),
            &k.verifying_key(),
            &policies(&[("tool", ToolPolicy::public_only())]),
            &topologies(&[("tool", RuntimeTopology::Local)]),
        )
        .unwrap();
        r
    };
    let e = registry_at("1.1.0")
        .check_no_rollback(&retained, &path)
        .unwrap_err();
    assert_eq!(e.kind, RollbackKind::Older);
    // The same version with today's body is another body than the one retained.
    let e = registry_at("1.2.0")
        .check_no_rollback(&retained, &path)
        .unwrap_err();
    assert_eq!(e.kind, RollbackKind::SameVersion);
    // Another server's registry writes the entry back as it was.
    let mut other = VerifiedRegistry::new();
    other
        .register(
            signed("b-server", &k, &[("tool", None)]),
            &k.verifying_key(),
            &policies(&[("tool", ToolPolicy::public_only())]),
            &topologies(&[("tool", RuntimeTopology::Local)]),
        )
        .unwrap();
    other.write_retained_set(&path, &retained).unwrap();
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(written[0], json!(old));
    assert_eq!(written[1]["manifest"]["server_id"], "b-server");
}

#[test]
fn the_registry_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<VerifiedRegistry>();
}

// ---------- rules 9 and 10: resources and prompts ----------

/// A signed manifest for `server` with one tool, `resources` and a prompt `p`.
fn with_content(server: &str, signer: &SigningKey, resources: Value) -> SignedManifest {
    let mut body = signed(server, signer, &[("tool", None)]).to_json_value()["manifest"].clone();
    body["resources"] = resources;
    body["prompts"] = json!([{"name": "p", "flow": {"output_label": label_json(&owner("alice"))}}]);
    SignedManifest::sign(body, signer).unwrap()
}

fn admit_content(
    registry: &mut VerifiedRegistry,
    manifest: SignedManifest,
    floor: Option<&InformationLabel>,
) -> Result<(), AdmissionError> {
    registry.register_with_content(
        manifest,
        &key(1).verifying_key(),
        &policies(&[("tool", ToolPolicy::public_only())]),
        &topologies(&[("tool", RuntimeTopology::Local)]),
        floor,
    )
}

#[test]
fn rule_9_content_needs_the_operators_floor_and_carries_floor_join_signed_label() {
    let k = key(1);
    let resources = json!([{"uri": "test://a", "name": "a"},
                           {"uri_template": "test://t/{id}", "name": "t",
                            "flow": {"output_label": label_json(&terms())}}]);
    let mut registry = VerifiedRegistry::new();
    let e = admit_content(
        &mut registry,
        with_content("srv", &k, resources.clone()),
        None,
    )
    .unwrap_err();
    assert!(
        matches!(e, AdmissionError::MissingContentFloor { .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains("content_floor") && e.to_string().contains("\"srv\""),
        "{e}"
    );
    assert!(registry.is_empty(), "nothing is admitted on error");
    let e = admit_content(
        &mut registry,
        with_content("srv", &k, resources.clone()),
        Some(&InformationLabel::Top),
    )
    .unwrap_err();
    assert!(matches!(e, AdmissionError::ContentLabel { .. }), "{e}");

    let floor = owner("bob");
    admit_content(
        &mut registry,
        with_content("srv", &k, resources),
        Some(&floor),
    )
    .unwrap();
    assert!(registry.requires_flow_runtime());
    let plain = registry.resource_route("test://a").unwrap();
    assert_eq!(
        (plain.server_id.as_str(), plain.name.as_str()),
        ("srv", "a")
    );
    assert_eq!(plain.label, floor);
    let templated = registry.resource_route("test://t/42").unwrap();
    assert_eq!(templated.label, floor.join_or_top(&terms()));
    assert_eq!(
        registry.resource_ref_route("test://t/{id}").unwrap().name,
        "t"
    );
    assert!(registry.resource_ref_route("test://t/42").is_none());
    assert!(registry.resource_route("test://b").is_err());
    assert_eq!(
        registry.prompt_route("srv", "p").unwrap().label,
        floor.join_or_top(&owner("alice"))
    );
    assert!(registry.prompt_route("srv", "q").is_none());
}

#[test]
fn rule_10_a_resource_two_servers_may_serve_is_refused_naming_both() {
    let k = key(1);
    let floor = InformationLabel::bottom();
    let mut registry = VerifiedRegistry::new();
    admit_content(
        &mut registry,
        with_content(
            "one",
            &k,
            json!([{"uri_template": "test://items/{id}", "name": "items"}]),
        ),
        Some(&floor),
    )
    .unwrap();
    let e = admit_content(
        &mut registry,
        with_content(
            "two",
            &k,
            json!([{"uri": "test://items/7", "name": "seven"}]),
        ),
        Some(&floor),
    )
    .unwrap_err();
    assert!(matches!(e, AdmissionError::AmbiguousResource { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("\"one\"") && text.contains("\"two\"") && text.contains("test://items/7"),
        "{text}"
    );
    // A resource elsewhere is fine.
    admit_content(
        &mut registry,
        with_content(
            "two",
            &k,
            json!([{"uri": "test://other/7", "name": "seven"}]),
        ),
        Some(&floor),
    )
    .unwrap();
    assert_eq!(
        registry.resource_route("test://other/7").unwrap().server_id,
        "two"
    );
    assert_eq!(
        registry.resource_route("test://items/7").unwrap().server_id,
        "one"
    );
}

/// A result checked against the signed output schema is refused naming the schema keyword
/// it breaks, never where in the result: the result's keys are the executor's words (here,
/// a secret spelt as a key), and the message goes to the client as the host's.
#[test]
fn an_output_schema_violation_names_no_key_of_the_result() {
    let k = key(1);
    let mut body = signed("srv", &k, &[("tool", None)]).body_json().clone();
    body["tools"][0]["output_schema"] =
        json!({"type": "object", "additionalProperties": {"type": "integer"}});
    let envelope = SignedManifest::sign(body, &k).unwrap();
    let mut registry = VerifiedRegistry::new();
    registry
        .register(
            envelope,
            &k.verifying_key(),
            &policies(&[("tool", ToolPolicy::public_only())]),
            &topologies(&[("tool", RuntimeTopology::Local)]),
        )
        .unwrap();
    let tool = registry.tool("srv", "tool").unwrap();
    tool.check_output(&json!({"content": [], "structuredContent": {"n": 1}}))
        .unwrap();
    let e = tool
        .check_output(&json!({"content": [], "structuredContent": {"harbor-goods-pays-4.10": "x"}}))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("fails /additionalProperties/type") && !e.contains("harbor"),
        "{e}"
    );
    // A tool error need not carry structured content; a result that is not one must.
    tool.check_output(&json!({"content": [], "isError": true}))
        .unwrap();
    assert!(tool.check_output(&json!({"content": []})).is_err());
}
