//! `flowhost demo`, the README's main command, end to end in a temporary directory.

mod common;

use std::process::Command;

#[test]
fn the_demo_succeeds_and_its_records_verify() {
    if !common::is_root() {
        eprintln!("SKIP: the demo needs the broker (root in CI)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let research = dir.path().join(".research");
    let out = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["demo", "--dir"])
        .arg(&research)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "READ ",
        "ALLOW ",
        "REFUSE   public-inbox/publish: flow violation",
        "GRANT    public-inbox/publish with grant",
        "with the same grant again: a replay",
        "missing clearance",
        "every outcome was the expected one",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    assert!(research.join("state/signed-manifests.json").exists());
    // The README's inspection command, run where the README runs it.
    let jq = Command::new("jq")
        .arg("[.[] | .manifest | {server_id, tools: [.tools[] | {name, flow}]}]")
        .arg(".research/signed-manifests.json")
        .current_dir(dir.path())
        .output()
        .expect("jq is installed (.ci/run installs it)");
    assert!(
        jq.status.success(),
        "{}",
        String::from_utf8_lossy(&jq.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&jq.stdout).unwrap();
    let read_terms = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["server_id"] == "workspace")
        .and_then(|s| {
            s["tools"]
                .as_array()?
                .iter()
                .find(|t| t["name"] == "read_terms")
        })
        .cloned()
        .expect("workspace/read_terms is listed");
    assert_eq!(read_terms["flow"]["egress"], false, "{read_terms}");
    assert_eq!(
        read_terms["flow"]["output_label"]["compartments"],
        serde_json::json!(["harbor-goods-terms"])
    );
    let verify = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["records", "verify"])
        .arg(research.join("records"))
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );

    // Running it again replaces the earlier demo; a directory that is not one is refused.
    let again = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["demo", "--dir"])
        .arg(&research)
        .output()
        .unwrap();
    assert!(again.status.success());
    let other = dir.path().join("not-a-demo");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("precious.txt"), "keep me").unwrap();
    let refused = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["demo", "--dir"])
        .arg(&other)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not a flowhost demo directory"));
    assert!(other.join("precious.txt").exists());
}

/// A user whose umask lets the group write (002, common on desktops) runs the demo too:
/// the directories it makes are not writable by others whatever the umask, so the host's
/// check of its socket directory passes.
#[test]
fn the_demo_runs_under_a_umask_that_lets_the_group_write() {
    if !common::is_root() {
        eprintln!("SKIP: the demo needs the broker (root in CI)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let research = dir.path().join("nested/.research");
    let out = Command::new("sh")
        .args(["-c", "umask 002; exec \"$0\" demo --dir \"$1\""])
        .arg(env!("CARGO_BIN_EXE_flowhost"))
        .arg(&research)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
