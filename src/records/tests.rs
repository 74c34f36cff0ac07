//! Record format tests and shared sample records.

use super::projection::tests::deploy_key_mapping;
use super::*;
use crate::label::InformationLabel;
use serde_json::json;

/// A valid, mapped tool_call allow (seq not yet assigned).
pub(crate) fn sample_tool_call() -> DecisionRecord {
    sample_tool_call_judged(Verdict::Authorized {
        rule: Some("policy.github".into()),
    })
}

/// [`sample_tool_call`] with `verdict` in place of its allow.
pub(crate) fn sample_tool_call_judged(verdict: Verdict) -> DecisionRecord {
    DecisionRecord::tool_call(ToolCallFacts {
        server: ServerInfo::mcp("github", Some(GENESIS_HASH)),
        tool_name: "github.add_deploy_key".into(),
        projection: project_tool_call(
            Some(&deploy_key_mapping()),
            &json!({"owner": "org", "repo": "prod-repo", "title": "ci-key", "key": "ssh-ed25519 SECRET"}),
        ),
        verdict,
        credential_alias: Some("github-prod-admin".into()),
        correlation: Correlation::none(),
        context: FlowContext {
            principal: Some("alice".into()),
            session: Some("s-1".into()),
            call_id: Some("c-1".into()),
            source_label: Some(InformationLabel::bottom()),
            clearance_used: Some(vec![InformationLabel::bottom()]),
            egress_basis: Some(EgressBasis {
                declared: true,
                topology: true,
                observed: false,
            }),
            ..FlowContext::default()
        },
    })
}

/// A valid broker egress denial (seq not yet assigned).
pub(crate) fn sample_egress(address: &str, port: u16, verdict: Verdict) -> DecisionRecord {
    DecisionRecord::egress_attempt(EgressFacts {
        server: ServerInfo::mcp("fetcher", None),
        tool_name: "fetch".into(),
        broker: BrokerDetails {
            pid: 4242,
            executable: Some("/usr/bin/fetcher".into()),
            syscall: "connect".into(),
            family: "inet".into(),
            socket_type: Some("stream".into()),
            protocol: Some("tcp".into()),
            destination: Some(Destination::Inet(InetDestination {
                address: address.parse().unwrap(),
                port,
                host_name: None,
                other_host_names: Vec::new(),
            })),
            bytes: None,
            dns_query_type: None,
        },
        verdict,
        credential_alias: None,
        correlation: Correlation::none(),
        context: FlowContext {
            egress_basis: Some(EgressBasis {
                declared: false,
                topology: true,
                observed: true,
            }),
            ..FlowContext::default()
        },
    })
}

fn sealed(mut r: DecisionRecord) -> DecisionRecord {
    Chainer::genesis().seal(&mut r).unwrap();
    r
}

#[test]
fn tool_call_record_has_the_documented_shape() {
    let r = sealed(sample_tool_call());
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(
        v["server"],
        json!({"id": "github", "transport": "mcp",
        "declared_manifest_digest": GENESIS_HASH})
    );
    assert_eq!(
        v["tool"],
        json!({"name": "github.add_deploy_key", "category": "github_deploy_key"})
    );
    assert_eq!(v["classification"], "classified");
    assert_eq!(v["reason_code"], "classified_github_deploy_key");
    assert!(v.get("detail").is_none());
    assert_eq!(v["action"]["class"], "privileged_admin_action");
    assert_eq!(v["action"]["required_scope"], "repo:deploy_key:write");
    assert_eq!(
        v["decision"],
        json!({"effect": "allow", "source": "flowhost",
        "rule_id": "policy.github", "enforced": true})
    );
    assert_eq!(
        v["response"],
        json!({"status": "authorized",
        "side_effect_asserted": false, "side_effect_verified": false})
    );
    assert_eq!(
        v["redaction"],
        json!({"arguments_redacted": true,
        "credential_alias": "github-prod-admin", "secret_material_stored": false})
    );
    assert_eq!(
        v["correlation"],
        json!({"basis": "none", "traceparent": null, "source_class": null})
    );
    let x = &v["flowhost"];
    assert_eq!(x["schema"], "flowhost.decision.v1");
    assert_eq!(x["seq"], 1);
    assert_eq!(x["prev_hash"], GENESIS_HASH);
    assert_eq!(x["event"], "tool_call");
    assert_eq!(
        x["source_label"],
        json!({"kind": "known", "owners": {}, "compartments": []})
    );
    assert_eq!(
        x["egress_basis"],
        json!({"declared": true, "topology": true, "observed": false})
    );
    assert_eq!(x["broker"], json!(null));
    assert!(!v.to_string().contains("SECRET"));
    // Strict round trip.
    let line = serde_json::to_vec(&r).unwrap();
    assert_eq!(DecisionRecord::from_json_line(&line).unwrap(), r);
}

#[test]
fn egress_record_carries_broker_details_and_network_target() {
    let r = sealed(sample_egress(
        "10.0.0.7",
        443,
        Verdict::Refused {
            denial: Denial::MissingClearance,
            rule: Some("dest.default".into()),
        },
    ));
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["tool"]["category"], "network_egress");
    assert_eq!(v["action"]["class"], "network_egress");
    assert_eq!(
        v["action"]["target"],
        json!({"provider": "network", "address": "10.0.0.7",
        "port": 443, "protocol": "tcp", "family": "inet"})
    );
    assert_eq!(v["response"]["side_effect_asserted"], false);
    assert_eq!(v["flowhost"]["denial_kind"], "missing_clearance");
    assert_eq!(
        v["flowhost"]["broker"]["destination"],
        json!({"address": "10.0.0.7", "port": 443})
    );
    assert_eq!(v["flowhost"]["event"], "egress_attempt");
    let line = serde_json::to_vec(&r).unwrap();
    assert_eq!(DecisionRecord::from_json_line(&line).unwrap(), r);
}

/// A record decoded from a file holds no control character in the broker's or the grant's
/// words either (a record made elsewhere may hold what the builder would have cleaned), and
/// the builder cleans an undecoded destination's words too. Before, only the action's and
/// tool's texts were checked.
#[test]
fn the_brokers_words_in_a_record_hold_no_control_character() {
    let r = sealed(sample_egress(
        "192.0.2.1",
        443,
        crate::decision::Verdict::Authorized { rule: None },
    ));
    let good = serde_json::to_value(&r).unwrap();
    DecisionRecord::from_json_line(good.to_string().as_bytes()).unwrap();
    for (field, path) in [
        ("flowhost.broker.executable", "/flowhost/broker/executable"),
        ("flowhost.broker.syscall", "/flowhost/broker/syscall"),
        (
            "flowhost.broker.destination",
            "/flowhost/broker/destination/host_name",
        ),
    ] {
        let mut v = good.clone();
        let (parent, key) = path.rsplit_once('/').unwrap();
        v.pointer_mut(parent).unwrap()[key] = json!("a\u{1b}]0;x\u{7}");
        let e = DecisionRecord::from_json_line(v.to_string().as_bytes()).unwrap_err();
        assert!(
            e.to_string().contains(field) && e.to_string().contains("control character"),
            "{field}: {e}"
        );
    }
    let built = DecisionRecord::egress_attempt(EgressFacts {
        server: ServerInfo::mcp("fetcher", None),
        tool_name: "fetch".into(),
        broker: BrokerDetails {
            pid: 1,
            executable: None,
            syscall: "connect".into(),
            family: "unix".into(),
            socket_type: None,
            protocol: None,
            destination: Some(Destination::Undecoded(UndecodedDestination {
                undecoded: "bytes \u{1b}[2J".into(),
            })),
            bytes: None,
            dns_query_type: None,
        },
        verdict: crate::decision::Verdict::refused(crate::decision::Denial::DestinationBlocked),
        credential_alias: None,
        correlation: Correlation::none(),
        context: FlowContext::default(),
    });
    sealed(built).validate().unwrap();
}

#[test]
fn decoding_is_strict_and_invariants_are_checked() {
    let r = sealed(sample_tool_call());
    let good = serde_json::to_value(&r).unwrap();
    let check = |mutate: &dyn Fn(&mut serde_json::Value), needle: &str| {
        let mut v = good.clone();
        mutate(&mut v);
        let e = DecisionRecord::from_json_line(v.to_string().as_bytes()).unwrap_err();
        assert!(e.to_string().contains(needle), "{needle}: {e}");
    };
    check(&|v| v["extra"] = json!(1), "unknown field");
    check(
        &|v| v["flowhost"]["raw_arguments"] = json!({}),
        "unknown field",
    );
    check(
        &|v| v["redaction"]["secret_material_stored"] = json!(true),
        "secret_material_stored",
    );
    check(
        &|v| v["redaction"]["arguments_redacted"] = json!(false),
        "arguments_redacted",
    );
    check(
        &|v| v["response"]["side_effect_verified"] = json!(true),
        "side_effect_verified",
    );
    check(
        &|v| {
            v["decision"]["effect"] = json!("deny");
            v["flowhost"]["denial_kind"] = json!("flow_violation");
            v["response"]["side_effect_asserted"] = json!(true);
        },
        "side_effect_asserted",
    );
    check(
        &|v| v["action"]["required_scope"] = json!(null),
        "required_scope",
    );
    check(
        &|v| v["decision"]["source"] = json!("other"),
        "decision.source",
    );
    check(
        &|v| {
            v["tool"]["category"] = json!(null);
            v["action"]["required_scope"] = json!(null);
        },
        "tool.category",
    );
    check(
        &|v| v["flowhost"]["prev_hash"] = json!("sha256:00"),
        "prev_hash",
    );
    check(&|v| v["flowhost"]["seq"] = json!(0), "seq");
    check(
        &|v| v["flowhost"]["recorded_at"] = json!("yesterday"),
        "recorded_at",
    );
    check(
        &|v| v["tool"]["name"] = json!("a\u{1b}[2Jb"),
        "control character",
    );
    check(
        &|v| v["flowhost"]["denial_kind"] = json!("Not Snake"),
        "unknown variant",
    );
    check(
        &|v| {
            v["correlation"]["traceparent"] =
                json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        },
        "correlation",
    );
    check(
        &|v| {
            v["flowhost"]["broker"] = json!({"pid": 1, "executable": null, "syscall": "connect",
        "family": "inet", "socket_type": null, "protocol": null, "destination": null, "bytes": null})
        },
        "flowhost.broker",
    );
}

#[test]
fn constructor_sanitizes_text() {
    let mut facts_name = sample_tool_call();
    facts_name.tool.name = sanitize("evil\nname\u{7}");
    assert_eq!(facts_name.tool.name, "evil\u{FFFD}name\u{FFFD}");
    assert!(sanitize(&"x".repeat(5000)).len() <= MAX_TEXT_BYTES);
}

#[test]
fn denials_are_a_closed_set_and_a_deny_always_says_why() {
    assert_eq!(Denial::DestinationBlocked.as_str(), "destination_blocked");
    assert_eq!(
        serde_json::to_value(Denial::GrantReplayed).unwrap(),
        "grant_replayed"
    );
    assert!(serde_json::from_value::<Denial>(json!("Flow Violation")).is_err());
    assert!(serde_json::from_value::<Denial>(json!("made_up_code")).is_err());
    assert_eq!(
        Denial::from(crate::EgressDenial::FlowViolation),
        Denial::FlowViolation
    );
    // A deny without a denial code is refused when read.
    let mut r = sealed(sample_egress(
        "10.0.0.7",
        443,
        Verdict::refused(Denial::FlowViolation),
    ));
    r.flowhost.denial_kind = None;
    let line = serde_json::to_vec(&r).unwrap();
    let err = DecisionRecord::from_json_line(&line).unwrap_err();
    assert_eq!(err.field, "flowhost.denial_kind");
}

#[test]
fn wire_names_are_what_serde_writes() {
    use super::schema::{ActionClass, Classification, EventKind};
    let wire = |v: serde_json::Value| v.as_str().unwrap().to_string();
    for c in [
        ActionClass::PrivilegedAdminAction,
        ActionClass::NetworkEgress,
        ActionClass::Unclassified,
    ] {
        assert_eq!(c.as_str(), wire(serde_json::to_value(c).unwrap()));
    }
    for e in [
        EventKind::ToolCall,
        EventKind::EgressAttempt,
        EventKind::ToolOutcome,
        EventKind::Session,
        EventKind::Relay,
        EventKind::ContentRequest,
        EventKind::ContentOutcome,
    ] {
        assert_eq!(e.as_str(), wire(serde_json::to_value(e).unwrap()));
    }
    for c in [
        Classification::Classified,
        Classification::ClassifiedIncomplete,
        Classification::ObservedUnknownTool,
        Classification::RedactionFailed,
        Classification::NotObserved,
    ] {
        assert_eq!(c.as_str(), wire(serde_json::to_value(c).unwrap()));
    }
    for e in [Effect::Allow, Effect::Deny, Effect::Error] {
        assert_eq!(e.as_str(), wire(serde_json::to_value(e).unwrap()));
    }
}

#[test]
fn control_characters_are_found_in_ascii_and_beyond() {
    for c in (0u32..0x300).filter_map(char::from_u32) {
        for s in [
            format!("{c}"),
            format!("a{c}b"),
            format!("é{c}"),
            format!("{c}é"),
        ] {
            assert_eq!(
                super::validate::has_control(&s),
                s.chars().any(char::is_control),
                "{s:?}"
            );
        }
    }
}

#[test]
fn a_target_field_named_twice_is_refused() {
    let mut r = sample_tool_call();
    r.flowhost.seq = 1;
    r.flowhost.prev_hash = GENESIS_HASH.to_string();
    let line = String::from_utf8(serde_json::to_vec(&r).unwrap()).unwrap();
    assert!(DecisionRecord::from_json_line(line.as_bytes()).is_ok());
    let twice = line.replacen(
        "\"provider\":\"github\"",
        "\"provider\":\"github\",\"provider\":\"x\"",
        1,
    );
    assert_ne!(twice, line, "the sample names its provider");
    let e = DecisionRecord::from_json_line(twice.as_bytes()).unwrap_err();
    assert!(e.problem.contains("appears twice"), "{e:?}");
}

#[test]
fn hash_text_and_sanitizing_agree_with_their_plain_forms() {
    let digest: [u8; 32] = std::array::from_fn(|i| (i * 37 + 5) as u8);
    assert_eq!(
        super::chain::sha256_text(&digest),
        format!("sha256:{}", hex::encode(digest))
    );
    let long = "x".repeat(MAX_TEXT_BYTES + 10);
    for text in ["plain", "a\u{7}b", "é\u{85}", "", long.as_str()] {
        assert_eq!(sanitize(text), build::replace_and_cut(text), "{text:?}");
    }
}
