//! The diff on the committed fixtures: every outcome, the precedence and the exit codes.

use std::path::PathBuf;

use super::*;
use crate::records::chain::verify_records;
use crate::records::health::RecordsHealth;
use crate::records::store::record_sources;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(rel)
}

fn declared(name: &str) -> DeclaredSurface {
    let text = std::fs::read_to_string(fixture(&format!("declared/{name}.json"))).unwrap();
    DeclaredSurface::parse(&text).unwrap()
}

/// The complete daemon health fixture, bound to the records at `observed` (range, head, and
/// the count of tool-call records).
fn health_for(observed: &Path) -> ToolObservationHealth {
    let report = verify_records(observed, None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    let mut h = ToolObservationHealth::read_from(&fixture("health/health_complete.json")).unwrap();
    h.records = RecordsHealth::from_verify(&report);
    let tool_calls = record_sources(observed)
        .unwrap()
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.matches("\"event\":\"tool_call\"").count() as u64
        })
        .sum();
    h.tool_calls_observed = Some(tool_calls);
    h.finalize()
}

fn run(declared_name: &str, observed_rel: &str) -> DiffReport {
    let observed = fixture(observed_rel);
    let health = health_for(&observed);
    diff(&declared(declared_name), &observed, Some(&health)).unwrap()
}

/// The first finding's message contains `needle`.
fn assert_first_says(r: &DiffReport, needle: &str) {
    let message = &r.findings[0].message;
    assert!(message.contains(needle), "{needle:?} not in {message}");
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
fn another_producers_envelope_may_hold_integers_of_any_size() {
    // No flowhost chain fields, and an extension with a nanosecond timestamp: judged (and
    // inconclusive without an observer's word), not refused as input.
    let text = std::fs::read_to_string(fixture("observed/surface_allowed_declared.json")).unwrap();
    let mut envelope: serde_json::Value = serde_json::from_str(&text).unwrap();
    for d in envelope["observed_tool_decisions"].as_array_mut().unwrap() {
        d.as_object_mut().unwrap().remove("flowhost");
        d["x_producer"] = serde_json::json!({"ts_ns": 0});
    }
    let text = serde_json::to_string(&envelope)
        .unwrap()
        .replace("\"ts_ns\":0", "\"ts_ns\":17330000000000000123");
    let dir = tempfile::tempdir().unwrap();
    let observed = dir.path().join("other.json");
    std::fs::write(&observed, text).unwrap();
    let r = diff(&declared("declared_prod_allowlist"), &observed, None).unwrap();
    assert_eq!(r.observed_decisions, 3);
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

/// A refusal whose target lacks a field a declared denial constrains (a record of
/// refusals folded without their destinations) is undecided, not an undeclared denial.
/// Before, it read as "denied, and no declared action expects this denial".
#[test]
fn a_denial_whose_target_cannot_be_checked_is_inconclusive() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(fixture("observed/incomplete_target.jsonl")).unwrap();
    let mut r: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    r["decision"]["effect"] = "deny".into();
    r["response"]["status"] = "blocked".into();
    r["flowhost"]["denial_kind"] = "destination_blocked".into();
    let observed = dir.path().join("denied_incomplete.jsonl");
    std::fs::write(&observed, format!("{r}\n")).unwrap();
    let health = health_for(&observed);
    let report = diff(
        &declared("declared_prod_allowlist"),
        &observed,
        Some(&health),
    )
    .unwrap();
    assert_eq!(
        kinds(&report),
        vec![(FindingKind::InconclusiveToolTarget, 1)],
        "{:?}",
        report.findings
    );
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

/// A daemon's health written on demand binds nothing, however well its range, head and
/// count match: the run went on after it. One that does not say (an older carrier) binds
/// nothing either; an offline health is judged by its own gaps.
#[test]
fn a_health_not_written_as_the_run_ended_is_an_observation_gap() {
    let observed = fixture("observed/allowed_declared.jsonl");
    let d = declared("declared_prod_allowlist");
    for (run_ended, says) in [
        (Some(false), "written on demand"),
        (None, "does not say whether"),
    ] {
        let h = ToolObservationHealth {
            run_ended,
            ..health_for(&observed)
        }
        .finalize();
        assert!(h.complete, "complete so far: {:?}", h.incomplete_reasons);
        let r = diff(&d, &observed, Some(&h)).unwrap();
        assert_eq!(
            kinds(&r),
            vec![(FindingKind::InconclusiveObservationGap, 1)]
        );
        assert_first_says(&r, "run_ended");
        assert_first_says(&r, says);
        assert_eq!(r.exit_code(), 3);
    }
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
    assert_first_says(&r, "the health says seq 1..=5, the records hold seq 1..=3");
    assert_eq!(r.exit_code(), 3);
}

#[test]
fn a_deleted_line_is_rejected_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(fixture("observed/allowed_declared.jsonl")).unwrap();
    let lines: Vec<&str> = src.lines().collect();
    let path = dir.path().join("cut.jsonl");
    std::fs::write(&path, format!("{}\n{}\n", lines[0], lines[2])).unwrap();
    let h = health_for(&fixture("observed/allowed_declared.jsonl"));
    let r = diff(&declared("declared_prod_allowlist"), &path, Some(&h)).unwrap();
    assert_eq!(kinds(&r), vec![(FindingKind::EvidenceRejected, 1)]);
    assert_first_says(&r, "cut.jsonl:2: gap: record 2");
    assert_eq!(r.findings[0].examples[0].line, Some(2));
    assert_eq!((r.verdict, r.exit_code()), (Verdict::EvidenceRejected, 4));
    assert_eq!(r.sources[0].evidence, Evidence::Rejected);
    assert_eq!(r.observed_decisions, 0, "rejected records are not judged");
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
    h.records.chain_head = None;
    h.tool_calls_observed = Some(0);
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
    // After a flowhost record, a foreign line rejects the evidence (exit 4) ...
    std::fs::write(&path, format!("{good}{{\"tool\": 1}}\n")).unwrap();
    let r = diff(&declared("declared_empty"), &path, None).unwrap();
    assert_eq!(r.exit_code(), 4);
    assert_first_says(&r, "bad.jsonl:2: malformed record");
    // ... and in another producer's decisions it is an input error (exit 2).
    let mut plain: serde_json::Value = serde_json::from_str(good.trim()).unwrap();
    plain.as_object_mut().unwrap().remove("flowhost");
    std::fs::write(&path, format!("{plain}\n{{\"tool\": 1}}\n")).unwrap();
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
fn a_target_repeating_a_field_is_refused_in_another_producers_stream() {
    // Readers keeping the first and readers keeping the last value would judge the line
    // differently, so the diff judges neither.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.jsonl");
    let good = std::fs::read_to_string(fixture("observed/undeclared.jsonl")).unwrap();
    let mut plain: serde_json::Value = serde_json::from_str(good.trim()).unwrap();
    plain.as_object_mut().unwrap().remove("flowhost");
    let line = plain.to_string().replace(
        "\"repo\":\"other-repo\"",
        "\"repo\":\"prod-repo\",\"repo\":\"other-repo\"",
    );
    std::fs::write(&path, format!("{line}\n")).unwrap();
    let e = diff(&declared("declared_prod_allowlist"), &path, None).unwrap_err();
    let e = e.to_string();
    assert!(e.contains("plain.jsonl:1:"), "{e}");
    assert!(e.contains("\"repo\""), "{e}");
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

/// A source whose path is not UTF-8 is reported in every format, its name shown lossily:
/// before, the JSON report was empty (and the verdict's exit status alone said anything) and
/// the SARIF report panicked.
#[test]
fn a_path_that_is_not_utf8_is_reported_in_every_format() {
    use std::os::unix::ffi::OsStrExt;
    let mut r = run("declared_empty", "observed/allowed_declared.jsonl");
    let odd = PathBuf::from(std::ffi::OsStr::from_bytes(b"/tmp/\xffrun/records.jsonl"));
    for s in &mut r.sources {
        s.path = odd.clone();
    }
    for f in &mut r.findings {
        for e in &mut f.examples {
            e.file = odd.clone();
        }
    }
    assert!(!r.findings.is_empty());
    let json: serde_json::Value = serde_json::from_str(&report::to_json(&r)).unwrap();
    assert_eq!(json["findings"].as_array().unwrap().len(), r.findings.len());
    assert!(
        json.to_string().contains("/tmp/\u{fffd}run/records.jsonl"),
        "{json}"
    );
    let sarif: serde_json::Value = serde_json::from_str(&report::to_sarif(&r)).unwrap();
    assert_eq!(
        sarif["runs"][0]["results"].as_array().unwrap().len(),
        r.findings.len()
    );
}

/// A file whose size reads 0 but which holds data (procfs, some FUSE mounts) is refused,
/// not judged as holding no decisions.
#[test]
fn a_file_that_says_it_is_empty_but_holds_data_is_refused() {
    let d = declared("declared_empty");
    let matcher = Matcher::new(&d);
    let path = PathBuf::from("/proc/self/status");
    let f = std::fs::File::open(&path).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 0);
    let e = judge_stream(&matcher, &path, &f, stream::Tuning::default()).unwrap_err();
    assert!(e.to_string().contains("judge a copy"), "{e}");
}

#[test]
fn an_errored_call_never_matches_a_declared_allow() {
    // The declared deploy key on org/prod-repo, but the call errored: the effect may have
    // happened, and no declaration lists "error".
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("error.jsonl");
    let src = std::fs::read(fixture("observed/allowed_declared.jsonl")).unwrap();
    let first = src.split(|&b| b == b'\n').next().unwrap();
    let mut r0 = crate::records::DecisionRecord::from_json_line(first).unwrap();
    r0.decision.effect = crate::records::Effect::Error;
    r0.response.status = "error".into();
    let mut chain = crate::records::Chainer::genesis();
    std::fs::write(&path, chain.seal(&mut r0).unwrap().line).unwrap();
    let h = health_for(&path);
    let r = diff(&declared("declared_prod_allowlist"), &path, Some(&h)).unwrap();
    assert_eq!(kinds(&r), vec![(FindingKind::NewPrivilegedToolAction, 1)]);
    assert_eq!(r.findings[0].effect.as_deref(), Some("error"));
    assert_eq!(r.exit_code(), 1);
}

#[test]
fn a_failed_outcome_of_a_declared_call_matches_a_declaration_listing_error() {
    // The declared deploy key on org/prod-repo is allowed (tool_call) and then fails in its
    // executor (tool_outcome error): the effect may have happened, so only a declaration
    // that lists "error" expects it.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("failed.jsonl");
    let src = std::fs::read(fixture("observed/allowed_declared.jsonl")).unwrap();
    let first = src.split(|&b| b == b'\n').next().unwrap();
    let mut call = crate::records::DecisionRecord::from_json_line(first).unwrap();
    let mut outcome = call.clone();
    outcome.flowhost.event = crate::records::EventKind::ToolOutcome;
    outcome.decision.effect = crate::records::Effect::Error;
    outcome.response.status = "tool_error".into();
    outcome.response.side_effect_asserted = false;
    let mut chain = crate::records::Chainer::genesis();
    let mut lines = chain.seal(&mut call).unwrap().line;
    lines.extend(chain.seal(&mut outcome).unwrap().line);
    std::fs::write(&path, lines).unwrap();
    let h = health_for(&path);
    let surface = |effects: serde_json::Value| {
        let text = serde_json::json!({
            "schema": "assay.declared_tool_surface.v0",
            "declared_tool_actions": [{
                "id": "github.deploy_key.prod", "provider": "github",
                "action_class": "github_deploy_key",
                "allowed_targets": [{"owner": "org", "repo": "prod-repo"}],
                "allowed_effects": effects, "required_decision": "explicit_policy"
            }]
        });
        DeclaredSurface::parse(&text.to_string()).unwrap()
    };
    let r = diff(&surface(serde_json::json!(["allow"])), &path, Some(&h)).unwrap();
    assert_eq!(kinds(&r), vec![(FindingKind::NewPrivilegedToolAction, 1)]);
    assert_eq!(r.findings[0].effect.as_deref(), Some("error"));
    assert_eq!(r.findings[0].examples[0].line, Some(2));
    let r = diff(
        &surface(serde_json::json!(["allow", "error"])),
        &path,
        Some(&h),
    )
    .unwrap();
    assert_eq!((kinds(&r), r.exit_code()), (vec![], 0));
    // "error" alone does not cover the allow that preceded it.
    let r = diff(&surface(serde_json::json!(["error"])), &path, Some(&h)).unwrap();
    assert_eq!(kinds(&r), vec![(FindingKind::NewPrivilegedToolAction, 1)]);
    assert_eq!(r.findings[0].effect.as_deref(), Some("allow"));
}

#[test]
fn egress_the_declaration_denies_is_undeclared_egress() {
    let r = run("declared_network", "observed/undeclared_egress.jsonl");
    // summarizer.summarize declares egress: false; its allowed and its refused attempt are one
    // finding with two occurrences. The fetcher declares egress: nothing extra.
    let undeclared: Vec<&Finding> = r
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::UndeclaredEgress)
        .collect();
    assert_eq!(undeclared.len(), 1, "{:#?}", r.findings);
    let f = undeclared[0];
    assert_eq!(f.severity, Severity::Error);
    assert_eq!(f.occurrences, 2);
    assert_eq!(f.server.as_deref(), Some("summarizer"));
    assert_eq!(f.tool.as_deref(), Some("summarizer.summarize"));
    let lines: Vec<_> = f.examples.iter().map(|e| e.line.unwrap()).collect();
    assert_eq!(lines, [1, 3]);
    // It is additional: the refused attempt keeps its own outcome.
    assert!(
        r.findings
            .iter()
            .any(|f| f.kind == FindingKind::AttemptedPrivilegedToolActionDenied)
    );
    assert_eq!(r.exit_code(), 1);
    // No egress_basis, or one without observed: true, gives none.
    let r = run("declared_network", "observed/network_egress.jsonl");
    assert!(
        r.findings
            .iter()
            .all(|f| f.kind != FindingKind::UndeclaredEgress)
    );
}

#[test]
fn egress_basis_is_read_leniently() {
    use observed::ObsEgressBasis;
    let read = |v: &str| serde_json::from_str::<ObsEgressBasis>(v).unwrap();
    assert!(
        read(r#"{"declared": false, "topology": true, "observed": true}"#)
            .undeclared_but_observed()
    );
    assert!(
        read(r#"{"declared": false, "observed": true, "extra": [1]}"#).undeclared_but_observed()
    );
    for v in [
        r#"{"declared": true, "observed": true}"#,
        r#"{"declared": false, "observed": false}"#,
        r#"{"observed": true}"#,
        r#"{"declared": "no", "observed": true}"#,
        r#""declared""#,
        "null",
        "[]",
    ] {
        assert!(!read(v).undeclared_but_observed(), "{v}");
    }
    // A field named twice read as its last value, so a line a first-wins reader judges as
    // undeclared egress passed here.
    for v in [
        r#"{"declared": false, "observed": true, "observed": false}"#,
        r#"{"declared": false, "declared": true, "observed": true}"#,
    ] {
        let e = serde_json::from_str::<ObsEgressBasis>(v).unwrap_err();
        assert!(e.to_string().contains("given twice"), "{v}: {e}");
    }
}

#[test]
fn an_envelope_with_a_foreign_decision_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("surface.json");
    let mut env: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixture("observed/surface_allowed_declared.json")).unwrap(),
    )
    .unwrap();
    let decisions = env["observed_tool_decisions"].as_array_mut().unwrap();
    let mut foreign = decisions[0].clone();
    foreign.as_object_mut().unwrap().remove("flowhost");
    decisions.insert(1, foreign);
    std::fs::write(&path, env.to_string()).unwrap();
    let h = health_for(&fixture("observed/allowed_declared.jsonl"));
    let r = diff(&declared("declared_prod_allowlist"), &path, Some(&h)).unwrap();
    assert_eq!(r.exit_code(), 4, "{:#?}", r.findings);
    assert_first_says(
        &r,
        "surface.json observed_tool_decisions[1]: malformed record",
    );
    assert_eq!(r.findings[0].examples[0].index, Some(1));
}

#[test]
fn one_health_cannot_bind_two_record_streams() {
    let allowed = fixture("observed/allowed_declared.jsonl");
    let h = health_for(&allowed);
    let r = diff_sources(
        &declared("declared_prod_allowlist"),
        &[allowed, fixture("observed/denied.jsonl")],
        std::slice::from_ref(&h),
        DiffOptions::default(),
    )
    .unwrap();
    let gap = r
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::InconclusiveObservationGap)
        .expect("a gap");
    assert!(
        gap.message
            .contains("one health carrier binds one record stream, but 2"),
        "{}",
        gap.message
    );
    assert!(!r.observation_complete);
}

#[test]
fn a_directory_without_its_head_anchor_is_inconclusive() {
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records");
    let w = crate::records::RecordWriter::open(&records, Default::default()).unwrap();
    let src = std::fs::read_to_string(fixture("observed/allowed_declared.jsonl")).unwrap();
    for line in src.lines() {
        let r = crate::records::DecisionRecord::from_json_line(line.as_bytes()).unwrap();
        w.commit_blocking(r).unwrap();
    }
    w.close_blocking().unwrap();
    let h = health_for(&records);
    let d = declared("declared_prod_allowlist");
    assert_eq!(diff(&d, &records, Some(&h)).unwrap().exit_code(), 0);
    std::fs::remove_file(records.join(crate::records::store::HEAD_FILE)).unwrap();
    let r = diff(&d, &records, Some(&h)).unwrap();
    assert_eq!(r.exit_code(), 3);
    assert_first_says(&r, "has records but no head anchor");
    // The source's own completeness says so too (it was computed before this gap).
    assert_eq!(r.sources[0].observation_complete, Some(false));
    // Its record file named alone is judged as its directory is. Before, clean (0).
    let files = crate::records::store::record_files_on_disk(&records).unwrap();
    let r = diff(&d, &files[0].path, Some(&h)).unwrap();
    assert_eq!(r.exit_code(), 3);
    assert_first_says(&r, "has records but no head anchor");
    // In a fleet, the host whose directory lost its anchor is the incomplete one.
    let other = fixture("observed/denied.jsonl");
    let r = diff_sources(
        &d,
        &[records.clone(), other.clone()],
        &[h, health_for(&other)],
        DiffOptions::default(),
    )
    .unwrap();
    assert!(!r.observation_complete);
    assert!(gap(&r).is_some_and(|g| g.contains("no head anchor")));
    let complete: Vec<_> = r.sources.iter().map(|s| s.observation_complete).collect();
    assert_eq!(complete, [Some(false), Some(true)]);
}

/// An input error (exit 2) in any source comes before evidence rejected (exit 4) in
/// another, whichever was named first. Before, the first source's error decided.
#[test]
fn an_input_error_comes_before_rejected_evidence_whatever_the_order() {
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records");
    let w = crate::records::RecordWriter::open(&records, Default::default()).unwrap();
    let src = std::fs::read_to_string(fixture("observed/allowed_declared.jsonl")).unwrap();
    for line in src.lines() {
        w.commit_blocking(crate::records::DecisionRecord::from_json_line(line.as_bytes()).unwrap())
            .unwrap();
    }
    w.close_blocking().unwrap();
    std::fs::write(
        records.join(crate::records::store::HEAD_FILE),
        "not an anchor",
    )
    .unwrap();
    let broken = dir.path().join("broken.jsonl");
    std::fs::write(&broken, "{\"decision\": \n").unwrap();
    let d = declared("declared_prod_allowlist");
    let rejected = |e: &DiffError| matches!(e, DiffError::Store(s) if s.rejects_the_evidence());
    let alone = diff_sources(
        &d,
        std::slice::from_ref(&records),
        &[],
        DiffOptions::default(),
    )
    .unwrap_err();
    assert!(rejected(&alone), "{alone}");
    for order in [
        [records.clone(), broken.clone()],
        [broken.clone(), records.clone()],
    ] {
        let e = diff_sources(&d, &order, &[], DiffOptions::default()).unwrap_err();
        assert!(!rejected(&e), "{order:?}: {e}");
    }
}

/// With one source rejected, the health was never bound to the others (the rejection
/// decides the verdict): no verified source is said to be completely observed. Before, the
/// one health's completeness was given to each, even a health of another host.
#[test]
fn no_source_is_complete_when_another_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let records = fixture("observed/allowed_declared.jsonl");
    let text = std::fs::read_to_string(&records).unwrap();
    let edited: Vec<String> = text
        .lines()
        .enumerate()
        .map(|(i, l)| {
            if i == 0 {
                let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["tool"]["name"] = serde_json::json!("edited");
                v.to_string()
            } else {
                l.to_string()
            }
        })
        .collect();
    let tampered = dir.path().join("tampered.jsonl");
    std::fs::write(&tampered, edited.join("\n") + "\n").unwrap();
    let h = health_for(&records);
    let d = declared("declared_prod_allowlist");
    let r = diff_sources(
        &d,
        &[records.clone(), tampered],
        std::slice::from_ref(&h),
        DiffOptions::default(),
    )
    .unwrap();
    assert_eq!(r.exit_code(), 4, "{:?}", r.findings);
    assert_eq!(r.sources[0].observation_complete, None, "{:?}", r.sources);
}

/// Decisions no observer is named for leave the verified sources' observation incomplete
/// too: they may be any host's, stripped of their chain.
#[test]
fn unattributed_unchained_decisions_leave_every_source_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain.jsonl");
    let good = std::fs::read_to_string(fixture("observed/allowed_declared.jsonl")).unwrap();
    let mut first: serde_json::Value = serde_json::from_str(good.lines().next().unwrap()).unwrap();
    first.as_object_mut().unwrap().remove("flowhost");
    std::fs::write(&plain, format!("{first}\n")).unwrap();
    let records = fixture("observed/allowed_declared.jsonl");
    let h = health_for(&records);
    let d = declared("declared_prod_allowlist");
    let run = |options| {
        diff_sources(
            &d,
            &[records.clone(), plain.clone()],
            std::slice::from_ref(&h),
            options,
        )
        .unwrap()
    };
    let r = run(DiffOptions::default());
    assert_eq!(r.exit_code(), 3, "{:?}", r.findings);
    assert_eq!(r.sources[0].observation_complete, Some(false));
    assert_eq!(r.sources[1].observation_complete, None);
    // Said to be another observer's: the host's own observation is complete.
    let r = run(DiffOptions {
        unchained_from_other_observer: true,
    });
    assert_eq!(r.exit_code(), 0, "{:?}", r.findings);
    assert_eq!(r.sources[0].observation_complete, Some(true));
}

/// Another producer's decision that calls itself a relayed request (an event the judge
/// passes over in flowhost's own verified records) is judged like any other. Before, an
/// undeclared privileged allow labelled so was counted and never judged: clean, exit 0.
#[test]
fn an_unchained_decision_calling_itself_a_relay_is_judged() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("other.jsonl");
    let text = std::fs::read_to_string(fixture("observed/undeclared.jsonl")).unwrap();
    let mut first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    first["flowhost"] = serde_json::json!({"event": "relay"});
    std::fs::write(&plain, format!("{first}\n")).unwrap();
    // Beside the host's own verified records and their health, as an observer's would be.
    let records = fixture("observed/allowed_declared.jsonl");
    let r = diff_sources(
        &declared("declared_prod_allowlist"),
        &[records.clone(), plain],
        &[health_for(&records)],
        DiffOptions {
            unchained_from_other_observer: true,
        },
    )
    .unwrap();
    assert_eq!(kinds(&r), vec![(FindingKind::NewPrivilegedToolAction, 1)]);
    assert_eq!(r.exit_code(), 1);
}

/// The healths of two hosts, given in the opposite order to their record streams.
fn fleet(declared_name: &str, healths: &[ToolObservationHealth]) -> DiffReport {
    diff_sources(
        &declared(declared_name),
        &[
            fixture("observed/allowed_declared.jsonl"),
            fixture("observed/denied.jsonl"),
        ],
        healths,
        DiffOptions::default(),
    )
    .unwrap()
}

fn gap(r: &DiffReport) -> Option<&str> {
    r.findings
        .iter()
        .find(|f| f.kind == FindingKind::InconclusiveObservationGap)
        .map(|f| f.message.as_str())
}

#[test]
fn a_fleet_pairs_each_health_with_its_host_by_chain_head() {
    let a = health_for(&fixture("observed/allowed_declared.jsonl"));
    let b = health_for(&fixture("observed/denied.jsonl"));
    // Every host complete and bound, in any order: observation is complete; what remains is
    // judged as usual (the denial is an attempt, a note, so exit 1).
    let r = fleet("declared_prod_allowlist", &[b.clone(), a.clone()]);
    assert_eq!(gap(&r), None, "{:?}", r.findings);
    assert!(r.observation_complete);
    assert!(
        r.sources
            .iter()
            .all(|s| s.observation_complete == Some(true))
    );

    // One host's observation was incomplete: the fleet is not complete, and the gap and the
    // source name that host.
    let mut lossy = b.clone();
    lossy.failed_notifications = Some(1);
    let lossy = lossy.finalize();
    let r = fleet("declared_prod_allowlist", &[a.clone(), lossy]);
    let message = gap(&r).expect("a gap");
    assert!(
        message.contains("denied.jsonl: observation was incomplete"),
        "{message}"
    );
    assert!(!r.observation_complete);
    assert_eq!(r.sources[0].observation_complete, Some(true));
    assert_eq!(r.sources[1].observation_complete, Some(false));

    // A host without a health, and a health for records nobody gave.
    let mut stranger = b.clone();
    stranger.records.chain_head = Some(format!("sha256:{}", "ab".repeat(32)));
    let r = fleet("declared_prod_allowlist", &[a.clone(), stranger]);
    let message = gap(&r).expect("a gap");
    assert!(
        message.contains("denied.jsonl: no --health names chain head"),
        "{message}"
    );
    assert!(
        message.contains("--health #2 (chain head sha256:abab"),
        "{message}"
    );
    assert!(!r.observation_complete);
    assert_eq!(r.exit_code(), 1);
}

/// One host's stream and health given twice, in place of another host's, pair each with
/// each: the fleet is not complete, since a host's records are missing.
#[test]
fn one_stream_given_twice_is_not_a_fleet() {
    let records = fixture("observed/allowed_declared.jsonl");
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.jsonl");
    std::fs::copy(&records, &copy).unwrap();
    let h = health_for(&records);
    let r = diff_sources(
        &declared("declared_prod_allowlist"),
        &[records, copy],
        &[h.clone(), h],
        DiffOptions::default(),
    )
    .unwrap();
    let message = gap(&r).expect("a gap");
    assert!(
        message.contains("hold parts of one record chain"),
        "{message}"
    );
    assert!(!r.observation_complete);
    assert_ne!(r.exit_code(), 0);
}

/// An older copy of one host's records (a prefix of its chain, with the health its run
/// wrote then) given beside the whole stream as a second host: the heads differ, but the two
/// are one host's records, so another host's records are missing.
#[test]
fn parts_of_one_chain_given_as_two_hosts_are_not_a_fleet() {
    let records = fixture("observed/allowed_declared.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(&records)
        .unwrap()
        .lines()
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(lines.len(), 3);
    let dir = tempfile::tempdir().unwrap();
    for (name, part) in [("older.jsonl", &lines[..2]), ("first.jsonl", &lines[..1])] {
        let path = dir.path().join(name);
        std::fs::write(&path, part.concat()).unwrap();
        let r = diff_sources(
            &declared("declared_prod_allowlist"),
            &[records.clone(), path.clone()],
            &[health_for(&records), health_for(&path)],
            DiffOptions::default(),
        )
        .unwrap();
        let message = gap(&r).unwrap_or_else(|| panic!("{name}: no gap: {:#?}", r.sources));
        assert!(
            message.contains("hold parts of one record chain"),
            "{name}: {message}"
        );
        assert!(!r.observation_complete, "{name}");
        assert_ne!(r.exit_code(), 0, "{name}");
    }
    // Two hosts' streams share nothing but the genesis they both start from.
    let other = fixture("observed/denied.jsonl");
    let r = diff_sources(
        &declared("declared_prod_allowlist"),
        &[records.clone(), other.clone()],
        &[health_for(&records), health_for(&other)],
        DiffOptions::default(),
    )
    .unwrap();
    assert!(
        gap(&r).is_none_or(|m| !m.contains("parts of one record chain")),
        "{:?}",
        gap(&r)
    );
}

/// A stream that begins right after another's last record (a later piece of one host's
/// chain, as a rotated file read alone) is part of the same chain; one that shares nothing
/// is not.
#[test]
fn a_stream_beginning_after_anothers_last_record_is_the_same_chain() {
    let hash = |n: u8| format!("sha256:{}", format!("{n:02x}").repeat(32));
    let source = |name: &str, head: u8| ObservedSource {
        path: name.into(),
        evidence: Evidence::Verified,
        decisions: 1,
        first_seq: Some(1),
        last_seq: Some(1),
        chain_head: Some(hash(head)),
        tool_calls: 0,
        observation_complete: None,
    };
    let earlier = source("earlier", 2);
    let later = source("later", 4);
    let other = source("other", 6);
    let keys = |s: &ObservedSource, hashes: &[u8]| {
        chain_keys(
            hashes
                .iter()
                .filter_map(|n| chain_link(&hash(*n)))
                .collect(),
            s.chain_head.as_deref(),
        )
    };
    // earlier: records 1 and 2 (links: genesis, 1); later: 3 and 4 (links: 2, 3).
    let gaps = one_chain_twice(
        &[earlier.clone(), later.clone(), other.clone()],
        &[
            keys(&earlier, &[1]),
            keys(&later, &[2, 3]),
            keys(&other, &[5]),
        ],
    );
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert!(
        gaps[0].starts_with("earlier and later hold parts"),
        "{gaps:?}"
    );
    let apart = [keys(&earlier, &[1]), keys(&other, &[5])];
    assert!(one_chain_twice(&[earlier.clone(), other.clone()], &apart).is_empty());
    assert_eq!(chain_link(GENESIS_HASH), None);
}

/// Judging flowhost records as the verifier decodes them gives what reading their lines
/// leniently gives: the same decisions, counts, findings, occurrences and locations.
#[test]
fn records_judged_while_verified_are_judged_as_their_lines_read() {
    for observed in [
        "allowed_declared",
        "denied",
        "incomplete_target",
        "network_egress",
        "undeclared",
        "undeclared_egress",
        "unknown_tool",
    ] {
        let path = fixture(&format!("observed/{observed}.jsonl"));
        assert!(
            matches!(
                detect(&path, &File::open(&path).unwrap()).unwrap(),
                Format::Records
            ),
            "{observed}"
        );
        for declared_name in [
            "declared_empty",
            "declared_network",
            "declared_prod_allowlist",
        ] {
            let d = declared(declared_name);
            let matcher = Matcher::new(&d);
            let f = File::open(&path).unwrap();
            let lenient = judge_stream(&matcher, &path, &f, Tuning::default()).unwrap();
            let judged = judge_records(&matcher, &path, false).unwrap();
            assert!(judged.report.as_ref().is_some_and(VerifyReport::is_ok));
            let strict = judged.acc.expect("verified");
            let case = format!("{observed} against {declared_name}");
            assert_eq!(
                (strict.decisions, strict.chained, strict.tool_calls),
                (lenient.decisions, lenient.chained, lenient.tool_calls),
                "{case}"
            );
            assert_eq!(strict.order, lenient.order, "{case}");
            assert_eq!(strict.findings, lenient.findings, "{case}");
        }
    }
}

/// A first line whose flowhost extension is no object, before flowhost records: rejected
/// evidence (the line is in the chain's place and is no record), not an unreadable file.
#[test]
fn a_malformed_extension_on_the_first_line_is_rejected_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(fixture("observed/allowed_declared.jsonl")).unwrap();
    let mut first: serde_json::Value = serde_json::from_str(src.lines().next().unwrap()).unwrap();
    first["flowhost"] = serde_json::json!(5);
    let rest: Vec<&str> = src.lines().skip(1).collect();
    let path = dir.path().join("bad-first.jsonl");
    std::fs::write(&path, format!("{first}\n{}\n", rest.join("\n"))).unwrap();
    let r = diff(&declared("declared_prod_allowlist"), &path, None).unwrap();
    assert_eq!((r.verdict, r.exit_code()), (Verdict::EvidenceRejected, 4));
    assert_eq!(r.sources[0].evidence, Evidence::Rejected);
    assert_first_says(&r, "bad-first.jsonl:1: malformed");
}

/// A stream whose first line carries no chain is read leniently first. Its verdict must come
/// from one read of the file: before, the decisions judged from that read were combined with
/// the chain report of a later read, so a file replaced in between (here by real records
/// holding an undeclared action) gave the clean verdict of records that were never verified.
#[test]
fn a_stream_replaced_between_reads_is_judged_from_one_read() {
    let dir = tempfile::tempdir().unwrap();
    // The real records: one undeclared deploy key (a finding), bound to a complete health.
    let real = dir.path().join("real.jsonl");
    std::fs::copy(fixture("observed/undeclared.jsonl"), &real).unwrap();
    let health = health_for(&real);
    // What the lenient read sees: the declared call without its chain, then as a record.
    let src = std::fs::read_to_string(fixture("observed/allowed_declared.jsonl")).unwrap();
    let chained = src.lines().next().unwrap();
    let mut bare: serde_json::Value = serde_json::from_str(chained).unwrap();
    bare.as_object_mut().unwrap().remove("flowhost");
    let observed = dir.path().join("observed.jsonl");
    std::fs::write(&observed, format!("{bare}\n{chained}\n")).unwrap();
    let swap = real.clone();
    AFTER_LENIENT_READ.with(|h| {
        *h.borrow_mut() = Some(Box::new(move |path: &Path| {
            std::fs::rename(&swap, path).unwrap();
        }))
    });
    let r = diff(
        &declared("declared_prod_allowlist"),
        &observed,
        Some(&health),
    );
    AFTER_LENIENT_READ.with(|h| *h.borrow_mut() = None);
    let r = r.unwrap();
    assert_ne!(r.verdict, Verdict::Clean, "{:?}", r.findings);
    // Judged from the records that verified: the undeclared action is found.
    assert_eq!(kinds(&r), vec![(FindingKind::NewPrivilegedToolAction, 1)]);
    assert_eq!(r.exit_code(), 1);
}

/// Names in another producer's decisions reach the text report escaped: a tool name holding
/// a terminal escape (C0, DEL or C1) cannot drive the terminal that shows the report.
#[test]
fn control_characters_in_observed_names_are_escaped_in_the_text_report() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain\u{7}.jsonl");
    let good = std::fs::read_to_string(fixture("observed/undeclared.jsonl")).unwrap();
    let mut plain: serde_json::Value = serde_json::from_str(good.trim()).unwrap();
    plain.as_object_mut().unwrap().remove("flowhost");
    plain["tool"]["name"] = "add\u{1b}]0;owned\u{7}\u{7f}\u{9b}2J".into();
    plain["action"]["target"]["repo"] = "repo\u{9b}2J\u{7f}".into();
    std::fs::write(&path, format!("{plain}\n")).unwrap();
    let r = diff(&declared("declared_empty"), &path, None).unwrap();
    let text = report::to_text(&r);
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "{text:?}"
    );
    assert!(
        text.contains("add\\u{1b}]0;owned\\u{7}\\u{7f}\\u{9b}2J"),
        "{text}"
    );
}

/// A file cut while it is judged is an input error naming it, not a shorter run: before,
/// the lines past the cut went unjudged and nothing said so. The range asked for ends past
/// the file's end, as it does when another process truncates the file after its size was
/// read.
#[test]
fn a_file_cut_while_it_is_judged_is_an_input_error() {
    let path = fixture("observed/allowed_declared.jsonl");
    let f = File::open(&path).unwrap();
    let len = f.metadata().unwrap().len();
    let d = declared("declared_prod_allowlist");
    let matcher = Matcher::new(&d);
    let whole = judge_range(&matcher, &path, &f, (0, len), 64).unwrap();
    assert_eq!(whole.lines, 3);
    let err = judge_range(&matcher, &path, &f, (0, len + 100), 64)
        .err()
        .expect("a short file is refused");
    assert!(
        err.to_string().contains("truncated") && err.to_string().contains("allowed_declared"),
        "{err}"
    );
}

/// An egress attempt of `syscall` to `address`:`port`, looked up as `name`, as the daemon
/// records one (authorized).
fn network_attempt(
    syscall: &str,
    address: &str,
    port: u16,
    name: &str,
) -> crate::records::DecisionRecord {
    let authorized = crate::decision::Verdict::Authorized { rule: None };
    network_attempt_judged((syscall, address, port, name), authorized)
}

/// [`network_attempt`], with `verdict`.
fn network_attempt_judged(
    (syscall, address, port, name): (&str, &str, u16, &str),
    verdict: crate::decision::Verdict,
) -> crate::records::DecisionRecord {
    use crate::records::{
        BrokerDetails, Correlation, DecisionRecord, Destination, EgressFacts, FlowContext,
        InetDestination, ServerInfo,
    };
    DecisionRecord::egress_attempt(EgressFacts {
        server: ServerInfo::mcp("fetcher", None),
        tool_name: "fetch".into(),
        broker: BrokerDetails {
            pid: 4242,
            executable: None,
            syscall: syscall.into(),
            family: "inet".into(),
            socket_type: Some("dgram".into()),
            protocol: Some("udp".into()),
            destination: Some(Destination::Inet(InetDestination {
                address: address.parse().unwrap(),
                port,
                host_name: Some(name.into()),
                other_host_names: Vec::new(),
            })),
            bytes: Some(40),
            dns_query_type: (syscall == "dns_query").then(|| "A".into()),
        },
        verdict,
        credential_alias: None,
        correlation: Correlation::none(),
        context: FlowContext::default(),
    })
}

/// The findings of `records` (written as one run) against a surface declaring one network
/// action, allowed, with the one target `target`.
fn judged_against_one_target(
    records: Vec<crate::records::DecisionRecord>,
    target: serde_json::Value,
) -> Vec<(FindingKind, u64)> {
    judged_against_targets(records, vec![target])
}

/// [`judged_against_one_target`] with `targets` declared (none: any target).
fn judged_against_targets(
    records: Vec<crate::records::DecisionRecord>,
    targets: Vec<serde_json::Value>,
) -> Vec<(FindingKind, u64)> {
    use crate::records::{RecordWriter, WriterOptions};
    let surface = DeclaredSurface::parse(
        &serde_json::json!({
            "schema": crate::diff::surface::DECLARED_SCHEMA,
            "declared_tool_actions": [{
                "id": "network.api", "provider": "network", "action_class": "network_egress",
                "allowed_targets": targets, "allowed_effects": ["allow"],
                "required_decision": "explicit_policy"
            }]
        })
        .to_string(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    for r in records {
        w.commit_blocking(r).unwrap();
    }
    w.close_blocking().unwrap();
    let h = health_for(dir.path());
    kinds(&diff(&surface, dir.path(), Some(&h)).unwrap())
}

/// A name lookup is judged by the name it asked: a declaration of the resolver's address
/// range or of port 53 covers no lookup, and one naming the host covers the lookup of that
/// name whatever port it declares. Before, a lookup's target was matched as the resolver's
/// address and port, so a loopback declaration passed the lookup of any name (a secret
/// spelt as a name reaches the upstream resolvers) and a precise declaration failed the
/// tool's own lookup.
#[test]
fn a_lookup_is_judged_by_the_name_it_asked() {
    let attempt = network_attempt;
    let judged = judged_against_one_target;
    let secret = || attempt("dns_query", "127.53.0.1", 53, "c2vjcmv0.example.com");
    let new = vec![(FindingKind::NewPrivilegedToolAction, 1)];
    for resolver in [
        serde_json::json!({"address": "127.0.0.0/8"}),
        serde_json::json!({"port": 53}),
        serde_json::json!({"address": "127.53.0.1", "port": 53, "protocol": "udp"}),
    ] {
        assert_eq!(judged(vec![secret()], resolver.clone()), new, "{resolver}");
    }
    // Nor does a declaration without targets, which covers any outbound target: before, it
    // passed the lookup of any name, while `0.0.0.0/0` and `::/0` covered none.
    assert_eq!(judged_against_targets(vec![secret()], vec![]), new);
    assert_eq!(
        judged_against_targets(vec![attempt("connect", "192.0.2.1", 443, "")], vec![]),
        vec![]
    );
    let api = serde_json::json!({"host_name": "api.example.com", "port": 443});
    let own = attempt("dns_query", "127.53.0.1", 53, "api.example.com");
    assert_eq!(judged(vec![own], api.clone()), vec![]);
    assert_eq!(judged(vec![secret()], api.clone()), new);
    // A lookup of no name (a query not served) is covered by no name, rather than left
    // undetermined.
    let mut unnamed = attempt("dns_query", "127.53.0.1", 53, "x.example.com");
    let target = unnamed.action.target.as_mut().unwrap();
    target.0.remove("host_name");
    assert_eq!(judged(vec![unnamed], api.clone()), new);
    // Anything but a lookup is judged by its address and port as before.
    let sent = attempt("sendto", "127.53.0.1", 53, "api.example.com");
    assert_eq!(judged(vec![sent], api), new);
    let sent = attempt("sendto", "127.53.0.1", 53, "c2vjcmv0.example.com");
    assert_eq!(
        judged(vec![sent], serde_json::json!({"address": "127.0.0.0/8"})),
        vec![]
    );
}

/// A connection to an address the host handed out for several names is covered by a
/// declaration of any of them, as enforcement judged it: before, only the name the address
/// was last handed out for was read, so a tool that looked up two declared names sharing
/// a CDN address, then connected for the first, failed the gate on a declared connection.
#[test]
fn a_connection_is_covered_by_any_name_its_address_was_handed_out_for() {
    let shared = |names: &[&str]| {
        let mut r = network_attempt("connect", "192.0.2.10", 443, names[0]);
        if let Some(crate::records::Destination::Inet(d)) = r
            .flowhost
            .broker
            .as_mut()
            .and_then(|b| b.destination.as_mut())
        {
            d.other_host_names = names[1..].iter().map(|n| n.to_string()).collect();
        }
        r
    };
    let declared = vec![
        serde_json::json!({"host_name": "api.example.com", "port": 443}),
        serde_json::json!({"host_name": "static.example.com", "port": 80}),
    ];
    let new = vec![(FindingKind::NewPrivilegedToolAction, 1)];
    let last_static = shared(&["static.example.com", "api.example.com"]);
    assert_eq!(
        judged_against_targets(vec![last_static], declared.clone()),
        vec![]
    );
    // No declared name among them, or the port of none: still undeclared.
    let elsewhere = shared(&["static.example.com", "cdn.example.net"]);
    assert_eq!(
        judged_against_targets(vec![elsewhere], declared.clone()),
        new
    );
    let mut on_80 = shared(&["api.example.com", "static.example.com"]);
    on_80
        .action
        .target
        .as_mut()
        .unwrap()
        .0
        .insert("port".into(), crate::records::TargetValue::Integer(8080));
    assert_eq!(judged_against_targets(vec![on_80], declared), new);
}

/// A listener opened, or an address taken for one, is covered only by a declared target
/// naming its verb: before, the verb was not looked at, and a declaration of outbound
/// traffic on a port (or to every address) covered a listener on it.
#[test]
fn a_listener_is_covered_only_by_a_declaration_naming_its_verb() {
    let new = vec![(FindingKind::NewPrivilegedToolAction, 1)];
    let listen = || network_attempt("listen", "0.0.0.0", 0, "");
    let bind = || network_attempt("bind", "0.0.0.0", 8443, "");
    for outbound in [
        serde_json::json!({"port": 8443}),
        serde_json::json!({"address": "0.0.0.0/0"}),
        serde_json::json!({"address": "0.0.0.0/0", "port": 0}),
    ] {
        assert_eq!(
            judged_against_one_target(vec![bind()], outbound.clone()),
            new,
            "{outbound}"
        );
        assert_eq!(
            judged_against_one_target(vec![listen()], outbound.clone()),
            new,
            "{outbound}"
        );
    }
    let listener = serde_json::json!({"verb": "bind", "port": 8443});
    assert_eq!(
        judged_against_one_target(vec![bind()], listener.clone()),
        vec![]
    );
    assert_eq!(
        judged_against_one_target(vec![listen()], listener.clone()),
        new
    );
    // The verb is judged for outbound traffic too: a listener's declaration covers no
    // connection to its port.
    let connect = network_attempt("connect", "10.0.0.1", 8443, "");
    assert_eq!(judged_against_one_target(vec![connect], listener), new);
    let listen_any = serde_json::json!({"verb": "listen"});
    assert_eq!(
        judged_against_one_target(vec![listen()], listen_any),
        vec![]
    );
}

/// A record folding identical refusals counts as each of them: before, a finding of 500
/// folded attempts said one occurrence.
#[test]
fn a_folded_record_counts_every_refusal_it_stands_for() {
    let refused = || {
        network_attempt_judged(
            ("connect", "10.9.9.9", 443, ""),
            crate::decision::Verdict::refused(crate::decision::Denial::DestinationBlocked),
        )
    };
    let mut folded = refused();
    folded.flowhost.folded = Some(crate::records::Folded {
        count: 500,
        first_at: "2026-11-30T10:00:00.000000Z".into(),
        last_at: "2026-11-30T10:00:05.000000Z".into(),
    });
    assert_eq!(
        judged_against_one_target(vec![folded, refused()], serde_json::json!({"port": 8443})),
        vec![(FindingKind::AttemptedPrivilegedToolActionDenied, 501)]
    );
}
