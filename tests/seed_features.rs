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
    assert!(
        read["manifest_digest"]
            .as_str()
            .unwrap()
            .starts_with("sha256:")
    );
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

fn wait_log(lab: &Lab, needle: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !lab.log().contains(needle) {
        assert!(
            std::time::Instant::now() < deadline,
            "{needle:?} not logged:\n{}",
            lab.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn per_origin_rules_combine_with_the_servers_and_follow_a_reload() {
    let Some(mut lab) = Lab::start() else { return };
    let team = lab.team.addr.to_string();
    let exfil = lab.exfil.addr.to_string();
    let publish = |c: &mut common::lab::Client, sink: &str| {
        c.call(
            "team-inbox/publish",
            json!({"message": "per-origin check", "sink": sink}),
        )
    };
    let mut c = lab.client();
    c.initialize();
    // The server's rules alone: the team sink yes, another sink no.
    assert!(text(&publish(&mut c, &team)).contains("delivered"));
    assert!(!text(&publish(&mut c, &exfil)).contains("delivered"));

    // The analyst's own rules: the team sink blocked for them, the other sink allowed.
    let config = std::fs::read_to_string(&lab.config).unwrap();
    let with_origin = config.replacen(
        "[[principal]]\nid = \"larkfield-analyst\"\n",
        &format!(
            "[[principal]]\nid = \"larkfield-analyst\"\ndestinations = {{ allow = [\"{exfil}\"], block = [\"{team}\"] }}\n"
        ),
        1,
    );
    assert_ne!(with_origin, config);
    lab.write_config(&with_origin);
    lab.signal(libc::SIGHUP);
    wait_log(&lab, "reloaded: generation 2");
    let mut c = lab.client();
    c.initialize();
    assert!(!text(&publish(&mut c, &team)).contains("delivered"));
    assert!(text(&publish(&mut c, &exfil)).contains("delivered"));
    lab.stop();

    let rules: Vec<(String, String)> = lab
        .records()
        .iter()
        .filter(|r| r["flowhost"]["event"] == "egress_attempt")
        .map(|r| {
            (
                r["decision"]["effect"].as_str().unwrap().to_string(),
                r["decision"]["rule_id"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert_eq!(
        rules,
        vec![
            ("allow".into(), format!("server allow {team}")),
            ("deny".into(), "server default".into()),
            (
                "deny".into(),
                format!("principal larkfield-analyst block {team}")
            ),
            (
                "allow".into(),
                format!("principal larkfield-analyst allow {exfil}")
            ),
        ]
    );
    assert_eq!(
        lab.exfil.connections(),
        1,
        "only the per-origin allow reached it"
    );
}
