//! `flowhost diff` through the built binary: exit codes, formats, input errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flowhost::records::chain::verify_records;
use flowhost::records::health::RecordsHealth;
use flowhost::records::{DecisionRecord, RecordWriter, ToolObservationHealth, WriterOptions};
use serde_json::Value;

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

#[test]
fn a_declared_surface_repeating_a_key_is_refused_naming_file_and_key() {
    // With the last value winning, "repo": "*" would silently widen the declaration to
    // every repository of the owner; the operator must say which they meant.
    let dir = tempfile::tempdir().unwrap();
    let declared = dir.path().join("declared.json");
    let text = std::fs::read_to_string(fixture(PROD)).unwrap().replacen(
        "\"repo\": \"prod-repo\"",
        "\"repo\": \"prod-repo\", \"repo\": \"*\"",
        1,
    );
    assert!(text.contains("\"repo\": \"*\""));
    std::fs::write(&declared, text).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["diff", "--declared", declared.to_str().unwrap()])
        .args(["--observed", &fixture("observed/undeclared.jsonl")])
        .args(["--health", &fixture(COMPLETE)])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&declared.display().to_string()), "{err}");
    assert!(
        err.contains("declared_tool_actions[0].allowed_targets[0]"),
        "{err}"
    );
    assert!(err.contains("\"repo\" appears twice"), "{err}");
}

const PROD: &str = "declared/declared_prod_allowlist.json";

/// Runs the diff on several observed sources with extra flags; (exit code, stdout).
fn diff_many(observed: &[&Path], health: Option<&Path>, extra: &[&str]) -> (i32, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flowhost"));
    c.args(["diff", "--declared", &fixture(PROD)]);
    for o in observed {
        c.args(["--observed", o.to_str().unwrap()]);
    }
    if let Some(h) = health {
        c.args(["--health", h.to_str().unwrap()]);
    }
    c.args(extra);
    let o = c.output().expect("run flowhost");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o.status.code().unwrap(), format!("{out}{err}"))
}

/// A real record directory written by the `RecordWriter` with the three declared allows of
/// the fixture, and a complete daemon health bound to it (range, head and tool-call count).
struct Bound {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    health: PathBuf,
    root: PathBuf,
}

impl Bound {
    fn new() -> Bound {
        Bound::of(ALLOWED, 3)
    }

    /// The records of the fixture `observed` (holding `tool_calls` tool calls) written by the
    /// record writer, with a health bound to them.
    fn of(observed: &str, tool_calls: u64) -> Bound {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let dir = root.join("records");
        let w = RecordWriter::open(&dir, WriterOptions::default()).unwrap();
        let src = std::fs::read_to_string(fixture(observed)).unwrap();
        for line in src.lines() {
            let r = DecisionRecord::from_json_line(line.as_bytes()).unwrap();
            w.commit_blocking(r).unwrap();
        }
        w.close_blocking().unwrap();
        let report = verify_records(&dir, None).unwrap();
        assert!(report.is_ok(), "{:?}", report.problems);
        let mut h = ToolObservationHealth::read_from(Path::new(&fixture(COMPLETE))).unwrap();
        h.records = RecordsHealth::from_verify(&report);
        h.tool_calls_observed = Some(tool_calls);
        let health = root.join("health.json");
        h.write_to(&health).unwrap();
        Bound {
            _tmp: tmp,
            dir,
            health,
            root,
        }
    }

    fn file(&self) -> PathBuf {
        flowhost::records::store::list_record_files(&self.dir).unwrap()[0]
            .path
            .clone()
    }

    fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(self.file())
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn write(&self, name: &str, lines: &[String]) -> PathBuf {
        let path = self.root.join(name);
        std::fs::write(
            &path,
            lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
        )
        .unwrap();
        path
    }

    fn set_health(&self, change: impl FnOnce(&mut ToolObservationHealth)) {
        let mut h = ToolObservationHealth::read_from(&self.health).unwrap();
        change(&mut h);
        h.write_to(&self.health).unwrap();
    }
}

/// A record line without its `flowhost` extension (as another producer would write it).
fn stripped(line: &str) -> String {
    let mut v: Value = serde_json::from_str(line).unwrap();
    v.as_object_mut().unwrap().remove("flowhost");
    v.to_string()
}

#[test]
fn bound_records_and_health_are_clean() {
    let b = Bound::new();
    let (code, out) = diff_many(&[&b.dir], Some(&b.health), &[]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = diff_many(&[&b.file()], Some(&b.health), &[]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn edited_records_are_rejected_with_exit_4_naming_file_and_line() {
    let b = Bound::new();
    // Edit a field the diff does not judge in each of the three records.
    let edited: Vec<String> = b
        .lines()
        .iter()
        .map(|l| l.replace("\"alice\"", "\"mallory\""))
        .collect();
    assert_ne!(edited, b.lines());
    std::fs::write(
        b.file(),
        edited.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let verify = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["records", "verify", b.dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(verify.status.code(), Some(1));
    let (code, out) = diff_many(&[&b.dir], Some(&b.health), &[]);
    assert_eq!(code, 4, "{out}");
    let name = b.file().display().to_string();
    for line in 1..=3 {
        assert!(
            out.contains(&format!("{name}:{line}")),
            "line {line}: {out}"
        );
    }
    assert!(out.contains("evidence rejected"), "{out}");
    // The JSON and SARIF reports say so too.
    let (code, out) = diff_many(&[&b.dir], Some(&b.health), &["--format", "json"]);
    assert_eq!(code, 4);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["verdict"], "evidence_rejected");
    assert_eq!(v["exit_code"], 4);
    assert_eq!(v["findings"][0]["kind"], "evidence_rejected");
    assert_eq!(v["findings"][0]["examples"][0]["line"], 1);
    let (code, out) = diff_many(&[&b.dir], Some(&b.health), &["--format", "sarif"]);
    assert_eq!(code, 4);
    let v: Value = serde_json::from_str(&out).unwrap();
    let results = v["runs"][0]["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    assert!(results.iter().all(|r| r["ruleId"] == "evidence_rejected"));
    // The same lines as one JSONL file are rejected too.
    let file = b.write("edited.jsonl", &edited);
    let (code, out) = diff_many(&[&file], Some(&b.health), &[]);
    assert_eq!(code, 4, "{out}");
}

#[test]
fn stripped_records_cannot_be_bound_to_a_complete_health() {
    let b = Bound::new();
    let plain: Vec<String> = b.lines().iter().map(|l| stripped(l)).collect();
    let file = b.write("stripped.jsonl", &plain);
    let (code, out) = diff_many(&[&file], Some(&b.health), &[]);
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("stripped.jsonl"), "{out}");
    assert!(out.contains("no flowhost chain"), "{out}");
}

#[test]
fn a_seq_less_decision_appended_to_records_is_rejected() {
    let b = Bound::new();
    let lines = b.lines();
    // The one record alone: bound range 1..=3 does not match: inconclusive.
    let one = b.write("one.jsonl", &lines[..1]);
    let (code, out) = diff_many(&[&one], Some(&b.health), &[]);
    assert_eq!(code, 3, "{out}");
    // With a seq-less decision appended: a foreign line in flowhost records.
    let mixed = b.write("mixed.jsonl", &[lines[0].clone(), stripped(&lines[1])]);
    let (code, out) = diff_many(&[&mixed], Some(&b.health), &[]);
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("mixed.jsonl:2"), "{out}");
}

#[test]
fn chained_and_unchained_sources_together_need_the_other_observer_flag() {
    let b = Bound::new();
    let other = b.write("other.jsonl", &[stripped(&b.lines()[0])]);
    let (code, out) = diff_many(&[&b.dir, &other], Some(&b.health), &[]);
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("other.jsonl"), "{out}");
    assert!(out.contains("--unchained-from-other-observer"), "{out}");
    let (code, out) = diff_many(
        &[&b.dir, &other],
        Some(&b.health),
        &["--unchained-from-other-observer", "--format", "json"],
    );
    assert_eq!(code, 0, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["observed_decisions"], 4);
}

#[test]
fn health_counting_more_tool_calls_than_the_records_hold_is_inconclusive() {
    let b = Bound::new();
    b.set_health(|h| h.tool_calls_observed = Some(5));
    let (code, out) = diff_many(&[&b.dir], Some(&b.health), &[]);
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("tool_calls_observed: the health says 5, the records hold 3"),
        "{out}"
    );
    // A head that is not the records' last line, or another range, is named too.
    let b = Bound::new();
    b.set_health(|h| h.records.chain_head = Some(flowhost::records::GENESIS_HASH.into()));
    let (code, out) = diff_many(&[&b.dir], Some(&b.health), &[]);
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("records.chain_head: the health says sha256:0000"),
        "{out}"
    );
}

#[test]
fn an_edited_exported_envelope_is_rejected() {
    let b = Bound::new();
    let env = b.root.join("surface.json");
    let o = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["records", "export", "--surface", b.dir.to_str().unwrap()])
        .args(["--out", env.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success());
    let (code, out) = diff_many(&[&env], Some(&b.health), &[]);
    assert_eq!(code, 0, "{out}");
    // Pretty-printing keeps the chain (decisions are checked as records, not as bytes).
    let v: Value = serde_json::from_slice(&std::fs::read(&env).unwrap()).unwrap();
    std::fs::write(&env, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let (code, out) = diff_many(&[&env], Some(&b.health), &[]);
    assert_eq!(code, 0, "{out}");
    let text = std::fs::read_to_string(&env)
        .unwrap()
        .replace("\"alice\"", "\"mallory\"");
    std::fs::write(&env, text).unwrap();
    let (code, out) = diff_many(&[&env], Some(&b.health), &[]);
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("observed_tool_decisions[0]"), "{out}");
}

#[test]
fn an_exported_envelope_repeating_a_target_field_is_refused() {
    // The chain re-serialises a decision keeping the last of two values for a key; a judge
    // keeping the first would judge another record than the one the chain verified.
    let b = Bound::of("observed/undeclared.jsonl", 1);
    let env = b.root.join("surface.json");
    let o = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["records", "export", "--surface", b.dir.to_str().unwrap()])
        .args(["--out", env.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success());
    let (code, out) = diff_many(&[&env], Some(&b.health), &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("new_privileged_tool_action"), "{out}");
    let text = std::fs::read_to_string(&env).unwrap();
    let edited = text.replace(
        "\"repo\":\"other-repo\"",
        "\"repo\":\"prod-repo\",\"repo\":\"other-repo\"",
    );
    assert_ne!(edited, text);
    std::fs::write(&env, edited).unwrap();
    let (code, out) = diff_many(&[&env], Some(&b.health), &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("surface.json"), "{out}");
    assert!(
        out.contains("observed_tool_decisions[0].action.target"),
        "{out}"
    );
    assert!(out.contains("\"repo\" appears twice"), "{out}");
}
