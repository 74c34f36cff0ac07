//! `flowhost diff` through the built binary: exit codes, formats, input errors.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture(rel: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(rel)
        .display()
        .to_string()
}

fn diff(declared: &str, observed: &str, health: Option<&str>, format: &str) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flowhost"));
    c.args([
        "diff",
        "--declared",
        &fixture(declared),
        "--observed",
        observed,
        "--format",
        format,
    ]);
    if let Some(h) = health {
        c.args(["--health", &fixture(h)]);
    }
    c.output().expect("run flowhost")
}

const ALLOWED: &str = "observed/allowed_declared.jsonl";
const COMPLETE: &str = "health/health_complete.json";

#[test]
fn clean_run_exits_0() {
    let o = diff(
        "declared/declared_prod_allowlist.json",
        &fixture(ALLOWED),
        Some(COMPLETE),
        "text",
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("exit 0: clean"));
}

#[test]
fn exported_envelope_is_accepted() {
    let o = diff(
        "declared/declared_prod_allowlist.json",
        &fixture("observed/surface_allowed_declared.json"),
        Some(COMPLETE),
        "json",
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["observed_decisions"], 3);
}

#[test]
fn findings_exit_1_with_sarif() {
    let o = diff(
        "declared/declared_empty.json",
        &fixture(ALLOWED),
        Some(COMPLETE),
        "sarif",
    );
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["version"], "2.1.0");
    let results = v["runs"][0]["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    assert!(
        results
            .iter()
            .all(|r| r["ruleId"] == "new_privileged_tool_action")
    );
}

#[test]
fn incomplete_or_missing_health_exits_3() {
    for health in [Some("health/health_incomplete.json"), None] {
        let o = diff(
            "declared/declared_prod_allowlist.json",
            &fixture(ALLOWED),
            health,
            "json",
        );
        assert_eq!(o.status.code(), Some(3), "{health:?}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["findings"][0]["kind"], "inconclusive_observation_gap");
        assert_eq!(v["observation_complete"], false);
    }
}

#[test]
fn input_errors_exit_2_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("declared.json");
    std::fs::write(
        &bad,
        r#"{"schema":"assay.declared_tool_surface.v0","declared_tool_actions":[
            {"id":"a","provider":"github","action_class":"github_deploy_key",
             "allowed_targets":[{"owner": null}],"allowed_effects":["allow"],"required_decision":"x"}]}"#,
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args([
            "diff",
            "--declared",
            bad.to_str().unwrap(),
            "--observed",
            &fixture(ALLOWED),
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("declared_tool_actions[0] (id a): field allowed_targets[0].owner"),
        "{err}"
    );
    let o = diff(
        "declared/declared_empty.json",
        "/nonexistent/records",
        None,
        "text",
    );
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args([
            "diff",
            "--declared",
            &fixture("declared/declared_empty.json"),
        ])
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "missing --observed is a usage error"
    );
}
