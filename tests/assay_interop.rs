//! Interop with assay's shapes on the real daemon: allowed effects recorded as successes with
//! the side effect asserted, health in assay's runner `observation_health` shape, and the
//! diff reading that shape exactly as it reads flowhost's own.

mod common;

use common::lab::Lab;
use serde_json::{Value, json};

#[test]
fn health_in_assays_shape_gates_the_diff_like_flowhosts_own() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    let r = c.call(
        "workspace/read_terms",
        json!({"document": "harbor-goods-terms.md"}),
    );
    assert!(r.get("result").is_some(), "{r}");
    let assay = c.request("flowhost/health", json!({"shape": "assay"}))["result"].clone();
    drop(c);
    lab.stop();
    assert_eq!(assay["schema"], "assay.runner.observation_health.v0");
    assert_eq!(assay["policy_layer"], "present", "{assay}");
    assert_eq!(assay["kernel_layer"], "complete", "{assay}");
    assert_eq!(assay["cgroup_correlation"], "clean", "{assay}");

    // The success of the allowed read is asserted, as assay's side-effect checks expect.
    let records = lab.records();
    let success: Vec<&Value> = records
        .iter()
        .filter(|r| r["response"]["status"] == "success")
        .collect();
    assert_eq!(success.len(), 1);
    assert_eq!(success[0]["response"]["side_effect_asserted"], true);

    // The diff judges the run by the health the daemon wrote as it stopped, in flowhost's
    // shape and, written again by `flowhost health --from`, in assay's.
    let own_file = lab.paths.state_dir.join("health.json");
    let assay_file = lab.dir.path().join("assay.json");
    let (code, out, err) = lab.cli(&[
        "health",
        "--from",
        &own_file.display().to_string(),
        "--shape",
        "assay",
        "--out",
        &assay_file.display().to_string(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(&assay_file).unwrap()).unwrap();
    assert_eq!(written["schema"], "assay.runner.observation_health.v0");
    assert_eq!(written["policy_layer"], "present", "{written}");
    let declared = lab.declared_surface_file().display().to_string();
    let records_dir = lab.paths.records_dir.display().to_string();
    let run = |health: &std::path::Path| {
        lab.cli(&[
            "diff",
            "--declared",
            &declared,
            "--observed",
            &records_dir,
            "--health",
            &health.display().to_string(),
            "--format",
            "json",
        ])
    };
    let (own_code, own_out, own_err) = run(&own_file);
    let (assay_code, assay_out, assay_err) = run(&assay_file);
    assert!(own_code == 0 || own_code == 1, "{own_out}{own_err}");
    assert_eq!(
        own_code, assay_code,
        "{own_out}{own_err}\n{assay_out}{assay_err}"
    );
    let complete =
        |out: &str| serde_json::from_str::<Value>(out).unwrap()["observation_complete"].clone();
    assert_eq!(complete(&own_out), json!(true), "{own_out}");
    assert_eq!(complete(&assay_out), json!(true), "{assay_out}");
}
