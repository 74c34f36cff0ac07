//! The observed fixtures are real flowhost records: this test rebuilds them with the library
//! (mappings from fixtures/declared/mappings.toml, fixed timestamps) and checks the committed
//! files are byte-identical. Run with FLOWHOST_WRITE_FIXTURES=1 to rewrite them after a
//! deliberate format change.

use std::collections::BTreeMap;
use std::path::PathBuf;

use flowhost::InformationLabel;
use flowhost::decision::Denial;
use flowhost::records::chain::verify_records;
use flowhost::records::export::write_surface_envelope;
use flowhost::records::health::{HealthProducer, RecordsHealth, ToolObservationHealth};
use flowhost::records::{
    BrokerDetails, Chainer, Correlation, DecisionRecord, Destination, EgressBasis, EgressFacts,
    FlowContext, InetDestination, ServerInfo, ToolCallFacts, ToolMapping, Verdict,
    correlation_from_params, project_tool_call,
};
use serde_json::{Value, json};

const AT: &str = "2026-11-30T10:00:00.000000Z";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn mappings() -> BTreeMap<String, ToolMapping> {
    let text = std::fs::read_to_string(root().join("declared/mappings.toml")).unwrap();
    toml::from_str(&text).unwrap()
}

fn call(mapping: Option<&str>, tool: &str, args: Value, verdict: Verdict) -> DecisionRecord {
    let maps = mappings();
    let mut r = DecisionRecord::tool_call(ToolCallFacts {
        server: ServerInfo::mcp(tool.split('.').next().unwrap_or(tool), None),
        tool_name: tool.into(),
        projection: project_tool_call(mapping.map(|m| &maps[m]), &args),
        verdict,
        credential_alias: Some("ops-admin".into()),
        correlation: correlation_from_params(&json!({"_meta": {
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}})),
        context: FlowContext {
            principal: Some("alice".into()),
            session: Some("session-1".into()),
            source_label: Some(InformationLabel::bottom()),
            ..FlowContext::default()
        },
    });
    r.flowhost.recorded_at = AT.into();
    r
}

fn egress(address: &str, port: u16, protocol: &str, verdict: Verdict) -> DecisionRecord {
    let mut r = DecisionRecord::egress_attempt(EgressFacts {
        server: ServerInfo::mcp("fetcher", None),
        tool_name: "fetcher.fetch_url".into(),
        broker: BrokerDetails {
            pid: 4242,
            executable: Some("/usr/libexec/flowhost/fetcher".into()),
            syscall: "connect".into(),
            family: "inet".into(),
            socket_type: Some(if protocol == "udp" { "dgram" } else { "stream" }.into()),
            protocol: Some(protocol.into()),
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
            session: Some("session-1".into()),
            // The fetcher's signed declaration says it egresses.
            egress_basis: Some(EgressBasis {
                declared: true,
                topology: true,
                observed: true,
            }),
            ..FlowContext::default()
        },
    });
    r.flowhost.recorded_at = AT.into();
    r
}

/// An egress attempt by a tool whose signed declaration says `egress: false`.
fn undeclared(mut r: DecisionRecord, tool: &str) -> DecisionRecord {
    r.server = ServerInfo::mcp(tool.split('.').next().unwrap_or(tool), None);
    r.tool.name = tool.into();
    r.flowhost.egress_basis = Some(EgressBasis {
        declared: false,
        topology: true,
        observed: true,
    });
    r
}

fn allow() -> Verdict {
    Verdict::Authorized {
        rule: Some("policy.default".into()),
    }
}

fn deny() -> Verdict {
    Verdict::Refused {
        denial: Denial::FlowViolation,
        rule: Some("policy.default".into()),
    }
}

fn deploy_key(owner: &str, repo: Option<&str>, verdict: Verdict) -> DecisionRecord {
    let mut args = json!({"owner": owner, "title": "ci-key", "key": "ssh-ed25519 AAAA-not-stored"});
    if let Some(repo) = repo {
        args["repo"] = json!(repo);
    }
    call(
        Some("github_add_deploy_key"),
        "github.add_deploy_key",
        args,
        verdict,
    )
}

fn stream(records: Vec<DecisionRecord>) -> Vec<u8> {
    let mut chain = Chainer::genesis();
    let mut out = Vec::new();
    for mut r in records {
        out.extend(chain.seal(&mut r).unwrap().line);
    }
    out
}

fn expected() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        (
            "observed/allowed_declared.jsonl",
            stream(vec![
                deploy_key("org", Some("prod-repo"), allow()),
                call(
                    Some("slack_add_member"),
                    "slack.add_member",
                    json!({"workspace_id": "T0123", "channel_id": "C0123", "user_id": "alice@example.com"}),
                    allow(),
                ),
                call(
                    Some("workspace_grant_admin"),
                    "workspace.grant_admin",
                    json!({"workspace_id": "acme", "principal": "bob@example.com", "role": "admin"}),
                    allow(),
                ),
            ]),
        ),
        (
            "observed/undeclared.jsonl",
            stream(vec![deploy_key("org", Some("other-repo"), allow())]),
        ),
        (
            "observed/incomplete_target.jsonl",
            stream(vec![deploy_key("org", None, allow())]),
        ),
        (
            "observed/denied.jsonl",
            stream(vec![
                deploy_key("org", Some("other-repo"), deny()),
                deploy_key("org", Some("prod-repo"), deny()),
            ]),
        ),
        (
            "observed/unknown_tool.jsonl",
            stream(vec![call(
                None,
                "misc.do_thing",
                json!({"x": "y"}),
                allow(),
            )]),
        ),
        (
            "observed/network_egress.jsonl",
            stream(vec![
                egress("10.1.2.3", 443, "tcp", allow()),
                egress("192.0.2.10", 53, "udp", allow()),
                egress("10.1.2.3", 8080, "tcp", allow()),
                egress("203.0.113.9", 25, "tcp", deny()),
            ]),
        ),
        (
            "observed/undeclared_egress.jsonl",
            stream(vec![
                undeclared(
                    egress("10.1.2.3", 443, "tcp", allow()),
                    "summarizer.summarize",
                ),
                egress("10.1.2.3", 443, "tcp", allow()),
                undeclared(
                    egress("203.0.113.9", 25, "tcp", deny()),
                    "summarizer.summarize",
                ),
            ]),
        ),
    ]
}

fn check_or_write(rel: &str, bytes: &[u8]) {
    let path = root().join(rel);
    if std::env::var_os("FLOWHOST_WRITE_FIXTURES").is_some() {
        std::fs::write(&path, bytes).unwrap();
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; regenerate with FLOWHOST_WRITE_FIXTURES=1",
            path.display()
        )
    });
    assert!(
        committed == bytes,
        "{} is stale; regenerate with FLOWHOST_WRITE_FIXTURES=1 cargo test --test fixtures",
        path.display()
    );
}

#[test]
fn observed_fixtures_are_current_flowhost_records() {
    for (rel, bytes) in expected() {
        check_or_write(rel, &bytes);
        // Every line is a strictly valid record.
        for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            DecisionRecord::from_json_line(line).unwrap();
        }
    }
    let allowed = root().join("observed/allowed_declared.jsonl");
    let report = verify_records(&allowed, None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    let complete = ToolObservationHealth {
        generated_at: AT.into(),
        proxy_seen: Some(true),
        tool_calls_observed: Some(3),
        policy_layer_active: Some(true),
        classifier_version: Some("fixtures/declared/mappings.toml".into()),
        unknown_tool_count: Some(0),
        redaction_active: Some(true),
        broker_active: Some(true),
        executors_spawned: Some(3),
        executors_supervised: Some(3),
        failed_notifications: Some(0),
        run_ended: Some(true),
        records: RecordsHealth::from_verify(&report),
        ..ToolObservationHealth::unknown(HealthProducer::Daemon)
    }
    .finalize();
    assert!(complete.complete, "{:?}", complete.incomplete_reasons);
    check_or_write(
        "health/health_complete.json",
        format!("{}\n", complete.to_json()).as_bytes(),
    );
    let incomplete = ToolObservationHealth {
        executors_supervised: Some(2),
        failed_notifications: Some(1),
        ..complete
    }
    .finalize();
    check_or_write(
        "health/health_incomplete.json",
        format!("{}\n", incomplete.to_json()).as_bytes(),
    );

    let mut envelope = Vec::new();
    let verified = flowhost::records::chain::verify_records(
        &root().join("observed/allowed_declared.jsonl"),
        None,
    )
    .unwrap();
    assert!(verified.is_ok());
    write_surface_envelope(&verified, &mut envelope).unwrap();
    check_or_write("observed/surface_allowed_declared.json", &envelope);
}

#[test]
fn fixtures_hold_no_raw_argument() {
    for (rel, bytes) in expected() {
        let text = String::from_utf8(bytes).unwrap();
        for raw in [
            "AAAA-not-stored",
            "alice@example.com",
            "bob@example.com",
            "T0123",
            "\"acme\"",
        ] {
            assert!(!text.contains(raw), "{rel} contains {raw}");
        }
    }
}

#[test]
fn mapping_table_decodes_from_toml() {
    let maps = mappings();
    assert_eq!(maps.len(), 3);
    assert_eq!(maps["slack_add_member"].category(), "slack_add_member");
    let bad = "[x]\nprovider = \"p\"\ncategory = \"c\"\nverb = \"v\"\nresource_type = \"r\"\nrequired_scope = \"s\"\nunknown = 1\n";
    assert!(toml::from_str::<BTreeMap<String, ToolMapping>>(bad).is_err());
}
