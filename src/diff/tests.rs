//! The diff on the committed fixtures: every outcome, the precedence and the exit codes.

use std::path::PathBuf;

use super::*;
use crate::records::chain::verify_records;
use crate::records::health::RecordsHealth;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(rel)
}

fn declared(name: &str) -> DeclaredSurface {
    let text = std::fs::read_to_string(fixture(&format!("declared/{name}.json"))).unwrap();
    DeclaredSurface::parse(&text).unwrap()
}

/// The complete daemon health fixture, bound to the records at `observed`.
fn health_for(observed: &Path) -> ToolObservationHealth {
    let report = verify_records(observed, None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    let mut h = ToolObservationHealth::read_from(&fixture("health/health_complete.json")).unwrap();
    h.records = RecordsHealth::from_verify(&report);
    h.finalize()
}

fn run(declared_name: &str, observed_rel: &str) -> DiffReport {
    let observed = fixture(observed_rel);
    let health = health_for(&observed);
    diff(&declared(declared_name), &observed, Some(&health)).unwrap()
}

fn kinds(r: &DiffReport) -> Vec<(FindingKind, u64)> {
    r.findings.iter().map(|f| (f.kind, f.occurrences)).collect()
}

#[test]
fn declared_match_gives_no_finding_and_exit_0() {
    let r = run("declared_prod_allowlist", "observed/allowed_declared.jsonl");
    assert_eq!(kinds(&r), vec![]);
    assert_eq!(r.observed_decisions, 3);
    assert!(r.observation_complete);
    assert_eq!(r.exit_code(), 0);
}

#[test]
fn envelope_input_judges_like_the_stream() {
    let observed = fixture("observed/surface_allowed_declared.json");
    let health = health_for(&fixture("observed/allowed_declared.jsonl"));
    let r = diff(
        &declared("declared_prod_allowlist"),
        &observed,
        Some(&health),
    )
    .unwrap();
    assert_eq!((kinds(&r), r.exit_code()), (vec![], 0));
    let r = diff(&declared("declared_empty"), &observed, Some(&health)).unwrap();
    assert_eq!(r.findings.len(), 3);
    assert_eq!(r.findings[0].examples[0].index, Some(0));
}

#[test]
fn empty_declaration_makes_every_privileged_action_new() {
    let r = run("declared_empty", "observed/allowed_declared.jsonl");
    assert_eq!(
        kinds(&r),
        vec![(FindingKind::NewPrivilegedToolAction, 1); 3]
    );
    let categories: Vec<_> = r
        .findings
        .iter()
        .map(|f| f.category.clone().unwrap())
        .collect();
    assert_eq!(
        categories,
        ["github_deploy_key", "slack_add_member", "workspace_admin"]
    );
    assert_eq!(r.exit_code(), 1);
}

#[test]
fn undeclared_target_is_new_privileged_action() {
    let r = run("declared_prod_allowlist", "observed/undeclared.jsonl");
    assert_eq!(kinds(&r), vec![(FindingKind::NewPrivilegedToolAction, 1)]);
    let f = &r.findings[0];
    assert_eq!(f.severity, Severity::Error);
    assert_eq!(f.target.as_ref().unwrap()["repo"], "other-repo");
    assert_eq!(f.examples[0].line, Some(1));
    assert_eq!(f.examples[0].seq, Some(1));
}

#[test]
fn incomplete_target_is_inconclusive() {
    let r = run(
        "declared_prod_allowlist",
        "observed/incomplete_target.jsonl",
    );
    assert_eq!(kinds(&r), vec![(FindingKind::InconclusiveToolTarget, 1)]);
    assert_eq!(r.exit_code(), 1);
    // With nothing declared for the class, the target does not matter: it is new.
    let r = run("declared_empty", "observed/incomplete_target.jsonl");
    assert_eq!(kinds(&r), vec![(FindingKind::NewPrivilegedToolAction, 1)]);
}

#[test]
fn undeclared_denial_is_an_attempt_and_declared_denial_is_expected() {
    let r = run("declared_prod_allowlist", "observed/denied.jsonl");
    // Line 1 denies an undeclared repo; line 2 denies the declared one, whose declaration
    // lists "deny": expected, no finding.
    assert_eq!(
        kinds(&r),
        vec![(FindingKind::AttemptedPrivilegedToolActionDenied, 1)]
    );
    assert_eq!(r.findings[0].severity, Severity::Note);
    assert_eq!(r.findings[0].examples[0].line, Some(1));
    assert_eq!(r.exit_code(), 1);
}

#[test]
fn unknown_tool_is_unclassified() {
    let r = run("declared_prod_allowlist", "observed/unknown_tool.jsonl");
    assert_eq!(kinds(&r), vec![(FindingKind::UnclassifiedToolAction, 1)]);
    assert_eq!(r.findings[0].tool.as_deref(), Some("misc.do_thing"));
}

#[test]
fn missing_or_incomplete_health_is_an_observation_gap() {
    let observed = fixture("observed/allowed_declared.jsonl");
    let d = declared("declared_prod_allowlist");
    let r = diff(&d, &observed, None).unwrap();
    assert_eq!(
        kinds(&r),
        vec![(FindingKind::InconclusiveObservationGap, 1)]
    );
    assert!(r.findings[0].message.contains("--health"));
    assert_eq!(r.exit_code(), 3);
    let mut h = health_for(&observed);
    h.broker_active = Some(false);
    let r = diff(&d, &observed, Some(&h)).unwrap();
    assert_eq!(
        kinds(&r),
        vec![(FindingKind::InconclusiveObservationGap, 1)]
    );
    assert!(r.findings[0].message.contains("broker_active is false"));
    assert_eq!(r.exit_code(), 3);
    // Findings dominate the exit code.
    let r = diff(&declared("declared_empty"), &observed, None).unwrap();
    assert_eq!(r.exit_code(), 1);
}

#[test]
fn health_range_must_cover_the_observed_records() {
    let observed = fixture("observed/allowed_declared.jsonl");
    let mut h = health_for(&observed);
    h.records.last_seq = Some(5);
    let r = diff(&declared("declared_prod_allowlist"), &observed, Some(&h)).unwrap();
    assert_eq!(
        kinds(&r),
        vec![(FindingKind::InconclusiveObservationGap, 1)]
    );
    assert!(
        r.findings[0].message.contains("cover seq 1..=3"),
        "{}",
        r.findings[0].message
    );
}

#[test]
fn a_deleted_line_is_an_observation_gap() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(fixture("observed/allowed_declared.jsonl")).unwrap();
    let lines: Vec<&str> = src.lines().collect();
    let path = dir.path().join("cut.jsonl");
    std::fs::write(&path, format!("{}\n{}\n", lines[0], lines[2])).unwrap();
    let mut h = health_for(&fixture("observed/allowed_declared.jsonl"));
    h.records.last_seq = Some(3);
    let r = diff(&declared("declared_prod_allowlist"), &path, Some(&h)).unwrap();
    assert_eq!(
        kinds(&r),
        vec![(FindingKind::InconclusiveObservationGap, 1)]
    );
    assert!(
        r.findings[0].message.contains("expected seq 2"),
        "{}",
        r.findings[0].message
    );
}

#[test]
fn declared_but_unobserved_is_nothing() {
    // The prod allowlist declares three actions; an empty observed stream with complete
    // health is clean.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("none.jsonl");
    std::fs::write(&path, "").unwrap();
    let mut h = health_for(&fixture("observed/allowed_declared.jsonl"));
    h.records.first_seq = None;
    h.records.last_seq = None;
    let r = diff(&declared("declared_prod_allowlist"), &path, Some(&h)).unwrap();
    assert_eq!((kinds(&r), r.exit_code()), (vec![], 0));
    // And observing one of the three declared actions leaves the other two silent.
    let r = run("declared_prod_allowlist", "observed/undeclared.jsonl");
    assert_eq!(r.findings.len(), 1);
}

#[test]
fn network_egress_by_cidr_address_and_port() {
    let r = run("declared_network", "observed/network_egress.jsonl");
    // 10.1.2.3:443/tcp is in 10.0.0.0/8 port 443: declared. 192.0.2.10:53 is declared by
    // address. 10.1.2.3:8080 is not (port). The denied 203.0.113.9:25 is an attempt.
    assert_eq!(
        kinds(&r),
        vec![
            (FindingKind::NewPrivilegedToolAction, 1),
            (FindingKind::AttemptedPrivilegedToolActionDenied, 1),
        ]
    );
    assert_eq!(r.findings[0].target.as_ref().unwrap()["port"], 8080);
    assert_eq!(
        r.findings[1].target.as_ref().unwrap()["address"],
        "203.0.113.9"
    );
}

#[test]
fn identical_findings_are_merged_across_threads_with_true_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.jsonl");
    // 2,000 copies of an unknown-tool line, re-sequenced: one finding, 2,000 occurrences,
    // examples at lines 1..=5 whatever the chunking (default, and tiny blocks on many
    // threads, where every line crosses a block boundary).
    let src = std::fs::read(fixture("observed/unknown_tool.jsonl")).unwrap();
    let mut r0 = crate::records::DecisionRecord::from_json_line(&src[..src.len() - 1]).unwrap();
    let mut chain = crate::records::Chainer::genesis();
    let mut out = Vec::new();
    for _ in 0..2000 {
        out.extend(chain.seal(&mut r0).unwrap().line);
    }
    std::fs::write(&path, out).unwrap();
    let h = health_for(&path);
    let r = diff(&declared("declared_empty"), &path, Some(&h)).unwrap();
    assert_eq!(kinds(&r), vec![(FindingKind::UnclassifiedToolAction, 2000)]);
    let lines: Vec<_> = r.findings[0]
        .examples
        .iter()
        .map(|e| e.line.unwrap())
        .collect();
    assert_eq!(lines, vec![1, 2, 3, 4, 5]);
    assert!(r.observation_complete);
}

#[test]
fn malformed_input_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    let good = std::fs::read_to_string(fixture("observed/undeclared.jsonl")).unwrap();
    std::fs::write(&path, format!("{good}{{\"tool\": 1}}\n")).unwrap();
    let e = diff(&declared("declared_empty"), &path, None).unwrap_err();
    assert!(e.to_string().contains("bad.jsonl:2:"), "{e}");
    std::fs::write(&path, "not json at all\n").unwrap();
    let e = diff(&declared("declared_empty"), &path, None).unwrap_err();
    assert!(
        e.to_string().contains("neither a JSONL decision stream"),
        "{e}"
    );
}

#[test]
fn sarif_has_one_result_per_finding() {
    let r = run("declared_empty", "observed/allowed_declared.jsonl");
    let sarif: serde_json::Value = serde_json::from_str(&report::to_sarif(&r)).unwrap();
    assert_eq!(sarif["version"], "2.1.0");
    let results = sarif["runs"][0]["results"].as_array().unwrap();
    assert_eq!(results.len(), r.findings.len());
    assert_eq!(results[0]["ruleId"], "new_privileged_tool_action");
    assert_eq!(results[0]["level"], "error");
    assert_eq!(
        results[0]["locations"][0]["physicalLocation"]["region"]["startLine"],
        1
    );
    let rules = sarif["runs"][0]["tool"]["driver"]["rules"]
        .as_array()
        .unwrap();
    let idx = results[0]["ruleIndex"].as_u64().unwrap() as usize;
    assert_eq!(rules[idx]["id"], "new_privileged_tool_action");
}
