//! What the seeds' users reach for next, on the real daemon: bridge security metadata on the
//! request path, per-origin egress rules, and declassification grants.

mod common;

use common::lab::{Lab, text};
use serde_json::{Value, json};

fn denial(r: &Value) -> String {
    r["error"]["data"]["denial"]
        .as_str()
        .unwrap_or_else(|| panic!("expected a refusal with data.denial: {r}"))
        .to_string()
}

fn bridge_of(tools: &Value, name: &str) -> Value {
    tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("{name} is listed"))["_meta"]["flowhost/bridge"]
        .clone()
}

#[test]
fn bridge_metadata_is_listed_and_checked_against_the_live_registry() {
    let Some(mut lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    let tools = c.request("tools/list", json!({}));
    let read = bridge_of(&tools, "workspace/read_terms");
    assert_eq!(read["server_id"], "workspace");
    assert_eq!(read["tool_name"], "read_terms");
    assert_eq!(read["effective_egress"], false);
    assert!(read["manifest_digest"].as_str().unwrap().starts_with("sha256:"));
    assert!(read["flow"]["output_label"].is_object());

    let call = |c: &mut common::lab::Client, meta: Value| {
        c.request(
            "tools/call",
            json!({"name": "workspace/read_terms", "arguments": {"document": "harbor-goods-terms.md"},
                   "_meta": {"flowhost/bridge": meta}}),
        )
    };
    // The live entry's own metadata passes.
    let r = call(&mut c, read.clone());
    assert!(text(&r).contains("Harbor Goods"), "{r}");
    // A stale digest, another flow, another tool, or junk: refused.
    let mut stale = read.clone();
    stale["manifest_digest"] = json!(format!("sha256:{}", "0".repeat(64)));
    let mut other_flow = read.clone();
    other_flow["flow"]["egress"] = json!(true);
    let other_tool = bridge_of(&tools, "workspace/list_documents");
    for (meta, what) in [
        (stale, "manifest_digest"),
        (other_flow, "flow"),
        (other_tool, "flow"),
        (json!({"effective_egress": "no"}), "invalid type"),
    ] {
        let r = call(&mut c, meta);
        assert_eq!(denial(&r), "bridge_mismatch", "{r}");
        assert!(
            r["error"]["message"].as_str().unwrap().contains(what),
            "{what}: {r}"
        );
    }
    lab.stop();
    // Every refusal is recorded (identical ones folded into one record with their count).
    let refused: u64 = lab
        .records()
        .into_iter()
        .filter(|r| r["flowhost"]["denial_kind"] == "bridge_mismatch")
        .map(|r| r["flowhost"]["folded"]["count"].as_u64().unwrap_or(1))
        .sum();
    assert_eq!(refused, 4);
}
