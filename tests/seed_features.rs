//! What a governed tool's users reach for next, on the real daemon: bridge security metadata
//! on the request path, per-origin egress rules, and declassification grants.

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

/// Waits until `lab` has logged `reloads` successful reloads. Counted by their lines, not by
/// generation: a reload that takes something out withdraws it first, in a generation of
/// its own.
fn wait_reloads(lab: &Lab, reloads: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while lab.log().matches("reloaded: generation").count() < reloads {
        assert!(
            std::time::Instant::now() < deadline,
            "{reloads} reloads not logged:\n{}",
            lab.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
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
    wait_reloads(&lab, 1);
    let mut c = lab.client();
    c.initialize();
    assert!(!text(&publish(&mut c, &team)).contains("delivered"));
    assert!(text(&publish(&mut c, &exfil)).contains("delivered"));

    // The allow taken out by a reload refused for another reason (a setting that takes a
    // restart): withdrawn all the same, from the next attempt of the running executors.
    // Before, a refused reload kept the per-origin allow in force.
    let without_allow = with_origin
        .replacen(&format!("allow = [\"{exfil}\"], "), "allow = [], ", 1)
        .replacen(
            "classifier_version = \"pricing-lab-1\"",
            "classifier_version = \"pricing-lab-2\"",
            1,
        );
    assert!(!without_allow.contains(&format!("allow = [\"{exfil}\"]")));
    lab.write_config(&without_allow);
    lab.signal(libc::SIGHUP);
    wait_log(
        &lab,
        "principal \"larkfield-analyst\" withdrawn although the reload is refused: per-origin destinations",
    );
    assert!(!text(&publish(&mut c, &exfil)).contains("delivered"));
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
            ("deny".into(), "server default".into()),
        ]
    );
    assert_eq!(
        lab.exfil.connections(),
        1,
        "only the per-origin allow reached it"
    );
}

/// The lab with a declassification authority the operator trusts (`review-board`), and a
/// second key it does not.
fn lab_with_authority() -> Option<(Lab, std::path::PathBuf, std::path::PathBuf)> {
    lab_with_authority_and("")
}

/// [`lab_with_authority`], with `more` appended to its configuration.
fn lab_with_authority_and(more: &str) -> Option<(Lab, std::path::PathBuf, std::path::PathBuf)> {
    let mut lab = Lab::prepare()?;
    let keys = lab.dir.path().join("authority-keys");
    for name in ["review-board", "stranger"] {
        let (code, out, err) = lab.cli(&[
            "key",
            "generate",
            "--out",
            &keys.display().to_string(),
            "--name",
            name,
        ]);
        assert_eq!(code, 0, "{out}{err}");
    }
    let config = std::fs::read_to_string(&lab.config).unwrap();
    lab.write_config(&format!(
        "{config}\n[[declassification_authority]]\nid = \"review-board\"\nkey = \"{}\"\n{more}",
        keys.join("review-board.pub").display()
    ));
    lab.spawn();
    Some((
        lab,
        keys.join("review-board.key"),
        keys.join("stranger.key"),
    ))
}

#[derive(Clone, Copy)]
struct GrantSpec<'a> {
    key: &'a std::path::Path,
    server: &'a str,
    tool: &'a str,
    purpose: &'a str,
    arguments: &'a Value,
    target: &'a str,
    extra: &'a [&'a str],
}

impl<'a> GrantSpec<'a> {
    /// A grant of `key`'s for the public inbox's `publish` with `arguments`, purpose
    /// `reviewed-summary`, to bottom.
    fn reviewed_summary(key: &'a std::path::Path, arguments: &'a Value) -> Self {
        GrantSpec {
            key,
            server: "public-inbox",
            tool: "publish",
            purpose: "reviewed-summary",
            arguments,
            target: BOTTOM,
            extra: &[],
        }
    }
}

/// `public-inbox/publish` with `arguments`, under `grant`.
/// A session of the lab's client that read the pricing terms (its label carries them),
/// and what `flowhost/session` says of it.
fn session_that_read_the_terms(lab: &Lab) -> (common::lab::Client, Value) {
    let mut c = lab.client();
    c.initialize();
    let r = c.call(
        "workspace/read_terms",
        json!({"document": "harbor-goods-terms.md"}),
    );
    assert!(text(&r).contains("Harbor Goods"), "{r}");
    let session = c.request("flowhost/session", json!({}))["result"].clone();
    (c, session)
}

fn publish_with_grant(c: &mut common::lab::Client, grant: &Value, arguments: &Value) -> Value {
    c.request(
        "tools/call",
        json!({"name": "public-inbox/publish", "arguments": arguments,
               "_meta": {"flowhost/grant": grant}}),
    )
}

fn sign_grant(lab: &Lab, session: &Value, spec: &GrantSpec<'_>) -> Value {
    let dir = lab.dir.path();
    let args_file = dir.join("grant-arguments.json");
    let target_file = dir.join("grant-target.json");
    std::fs::write(&args_file, spec.arguments.to_string()).unwrap();
    std::fs::write(&target_file, spec.target).unwrap();
    let mut argv = vec![
        "grant".to_string(),
        "sign".into(),
        "--key".into(),
        spec.key.display().to_string(),
        "--authority".into(),
        "review-board".into(),
        "--principal".into(),
        session["principal"].as_str().unwrap().into(),
        "--session".into(),
        session["session"].as_str().unwrap().into(),
        "--server".into(),
        spec.server.into(),
        "--tool".into(),
        spec.tool.into(),
        "--purpose".into(),
        spec.purpose.into(),
        "--arguments".into(),
        args_file.display().to_string(),
        "--source-label-hash".into(),
        session["label_hash"].as_str().unwrap().into(),
        "--target-label".into(),
        target_file.display().to_string(),
    ];
    argv.extend(spec.extra.iter().map(|s| s.to_string()));
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let (code, out, err) = lab.cli(&argv);
    assert_eq!(code, 0, "{out}{err}");
    serde_json::from_str(&out).unwrap()
}

const BOTTOM: &str = r#"{"kind":"known","owners":{},"compartments":[]}"#;
const TERMS_LABEL: &str = r#"{"kind":"known","owners":{"larkfield-pricing":["larkfield-pricing"]},"compartments":["harbor-goods-terms"]}"#;

/// Taking an authority's key out (deleting its key file, as a revocation would) makes the
/// configuration invalid, so the reload is refused, but the authority is no longer trusted
/// from then on: its grants are refused (`grant_untrusted_authority`). Before, the refused
/// reload kept the whole configuration, the revoked authority with it. A reload that
/// succeeds trusts exactly the authorities it names, checked by the flow resolver itself
/// (which also stops a call in flight under a withdrawn authority's grant).
#[test]
fn an_authority_whose_key_is_taken_out_is_distrusted_although_the_reload_is_refused() {
    let Some((lab, authority, _)) = lab_with_authority() else {
        return;
    };
    let (mut c, session) = session_that_read_the_terms(&lab);
    let arguments = json!({"message": "A reviewed summary.", "sink": lab.public.addr.to_string()});
    let grant = sign_grant(
        &lab,
        &session,
        &GrantSpec::reviewed_summary(&authority, &arguments),
    );
    // The public key the configuration names, gone.
    let public = authority.with_extension("pub");
    let kept = std::fs::read(&public).unwrap();
    std::fs::remove_file(&public).unwrap();
    lab.signal(libc::SIGHUP);
    wait_log(
        &lab,
        "declassification authority \"review-board\" no longer trusted although the reload is refused: its key cannot be read",
    );
    let r = publish_with_grant(&mut c, &grant, &arguments);
    assert_eq!(denial(&r), "grant_untrusted_authority", "{r}");
    // The servers serve on.
    let r = c.call(
        "workspace/read_terms",
        json!({"document": "harbor-goods-terms.md"}),
    );
    assert!(text(&r).contains("Harbor Goods"), "{r}");
    // The key back, and a reload that succeeds: trusted again, the grant serves.
    std::fs::write(&public, &kept).unwrap();
    lab.signal(libc::SIGHUP);
    wait_reloads(&lab, 1);
    let r = publish_with_grant(&mut c, &grant, &arguments);
    assert!(text(&r).starts_with("delivered"), "{r}");
    // Taken out of the configuration by a reload that succeeds: distrusted again.
    let grant = sign_grant(
        &lab,
        &session,
        &GrantSpec::reviewed_summary(&authority, &arguments),
    );
    let config = std::fs::read_to_string(&lab.config).unwrap();
    let without = &config[..config.find("[[declassification_authority]]").unwrap()];
    lab.write_config(without);
    lab.signal(libc::SIGHUP);
    wait_reloads(&lab, 2);
    let r = publish_with_grant(&mut c, &grant, &arguments);
    assert_eq!(denial(&r), "grant_untrusted_authority", "{r}");
}

/// An authority's key file removed in the same edit as a mistake elsewhere in the file (a
/// table header left open, so not even TOML): the file does not load at all, yet the
/// authority is distrusted from that reload on, as a server whose key file was removed is.
/// Before, such a reload kept it trusted, knowing it only by id (or, with no TOML, nothing
/// at all), and its grants went on declassifying.
#[test]
fn an_authority_whose_key_file_is_removed_is_distrusted_by_a_file_that_does_not_load() {
    let Some((lab, authority, _)) = lab_with_authority() else {
        return;
    };
    let (mut c, session) = session_that_read_the_terms(&lab);
    let arguments = json!({"message": "A reviewed summary.", "sink": lab.public.addr.to_string()});
    let grant = sign_grant(
        &lab,
        &session,
        &GrantSpec::reviewed_summary(&authority, &arguments),
    );
    std::fs::remove_file(authority.with_extension("pub")).unwrap();
    let config = std::fs::read_to_string(&lab.config).unwrap();
    // Not even TOML: a file that says nothing of what it holds still has the key files the
    // running configuration names read again.
    lab.write_config(&config.replacen("[host]\n", "[host\nno_such_setting = 1\n", 1));
    lab.signal(libc::SIGHUP);
    wait_log(
        &lab,
        "declassification authority \"review-board\" no longer trusted although the reload is refused: its key cannot be read",
    );
    let r = publish_with_grant(&mut c, &grant, &arguments);
    assert_eq!(denial(&r), "grant_untrusted_authority", "{r}");
}

#[test]
fn declassification_grants_allow_once_and_refuse_every_misuse() {
    let Some((mut lab, authority, stranger)) = lab_with_authority() else {
        return;
    };
    let (mut c, session) = session_that_read_the_terms(&lab);
    assert!(
        session["label"].to_string().contains("harbor-goods-terms"),
        "{session}"
    );

    let public = lab.public.addr.to_string();
    let arguments =
        json!({"message": "A reviewed summary: terms were renegotiated.", "sink": public});
    let base = GrantSpec::reviewed_summary(&authority, &arguments);
    let call = publish_with_grant;

    // Without a grant: the flow violation of the pricing lab.
    let r = c.call("public-inbox/publish", arguments.clone());
    assert_eq!(denial(&r), "flow_violation", "{r}");

    // Each misuse refused with its own denial (none of them spends the grant).
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let later = (now + 3600).to_string();
    let long_ago = (now - 7200).to_string();
    let other_args = json!({"message": "something else", "sink": public});
    let not_yet = ["--not-before", later.as_str()];
    let expired = ["--not-before", long_ago.as_str(), "--valid-for", "60"];
    let cases: Vec<(GrantSpec<'_>, &Value, &str)> = vec![
        (
            GrantSpec {
                key: &stranger,
                ..base
            },
            &arguments,
            "grant_untrusted_authority",
        ),
        (
            GrantSpec {
                purpose: "marketing",
                ..base
            },
            &arguments,
            "grant_purpose_not_allowed",
        ),
        (base, &other_args, "grant_binding_mismatch"),
        (
            GrantSpec {
                extra: &not_yet,
                ..base
            },
            &arguments,
            "grant_not_yet_valid",
        ),
        (
            GrantSpec {
                extra: &expired,
                ..base
            },
            &arguments,
            "grant_expired",
        ),
        (
            GrantSpec {
                target: TERMS_LABEL,
                ..base
            },
            &arguments,
            "grant_target_not_lower",
        ),
    ];
    for (spec, args, want) in &cases {
        let grant = sign_grant(&lab, &session, spec);
        let r = call(&mut c, &grant, args);
        assert_eq!(denial(&r), *want, "{r}");
    }
    // A grant on a call with no effective egress.
    let doc = json!({"document": "harbor-goods-terms.md"});
    let grant = sign_grant(
        &lab,
        &session,
        &GrantSpec {
            server: "workspace",
            tool: "read_terms",
            arguments: &doc,
            ..base
        },
    );
    let r = c.request(
        "tools/call",
        json!({"name": "workspace/read_terms", "arguments": doc, "_meta": {"flowhost/grant": grant}}),
    );
    assert_eq!(denial(&r), "grant_without_egress", "{r}");
    let r = call(&mut c, &json!({"grant": {}, "signature": "00"}), &arguments);
    assert_eq!(denial(&r), "grant_malformed", "{r}");

    // The real grant: allowed once, the public relay receives the reviewed summary.
    let grant = sign_grant(&lab, &session, &base);
    let r = call(&mut c, &grant, &arguments);
    assert!(text(&r).contains("delivered"), "{r}\n{}", lab.log());
    // The executor that connected under the grant serves nothing after (its connection is
    // not judged again): it is retired as the call ends, not kept idle.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !lab
        .log()
        .contains("made egress under the call's grant; it is retired")
    {
        assert!(std::time::Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The same grant again: a replay.
    let r = call(&mut c, &grant, &arguments);
    assert_eq!(denial(&r), "grant_replayed", "{r}");
    // The retained label never goes down.
    let after = c.request("flowhost/session", json!({}))["result"].clone();
    assert_eq!(after["label_hash"], session["label_hash"]);
    lab.stop();
    assert_eq!(lab.public.connections(), 1);

    let id = grant["grant"]["grant_id"].as_str().unwrap();
    let records = lab.records();
    let allowed: Vec<&Value> = records
        .iter()
        .filter(|r| r["flowhost"]["grant"]["id"] == id && r["decision"]["effect"] == "allow")
        .collect();
    assert!(
        allowed
            .iter()
            .any(|r| r["flowhost"]["event"] == "tool_call"),
        "{allowed:#?}"
    );
    assert!(
        allowed
            .iter()
            .any(|r| r["flowhost"]["event"] == "egress_attempt"),
        "the egress under the grant is recorded with it: {allowed:#?}"
    );
    assert!(
        allowed
            .iter()
            .all(|r| r["flowhost"]["grant"]["purpose"] == "reviewed-summary")
    );
    for (_, _, want) in &cases {
        assert!(
            records
                .iter()
                .any(|r| r["flowhost"]["denial_kind"] == *want),
            "{want} recorded"
        );
    }
    assert!(
        records
            .iter()
            .any(|r| r["flowhost"]["denial_kind"] == "grant_replayed")
    );
}

/// A grant binds the call's source label, what its arguments carry included (here the
/// classifier finds the terms in them): one signed over the session's label alone, which
/// the authority saw without the terms, does not let them leave.
#[test]
fn a_grant_binds_what_the_calls_arguments_carry() {
    let rule = format!(
        "\n[[classifier]]\npattern = \"EMBARGOED\"\nlabel = {}\napplies_to = [\"arguments\"]\n",
        flowhost::lab::TERMS_LABEL
    );
    let Some((mut lab, authority, _)) = lab_with_authority_and(&rule) else {
        return;
    };
    let mut c = lab.client();
    c.initialize();
    let session = c.request("flowhost/session", json!({}))["result"].clone();
    let bottom: Value = serde_json::from_str(BOTTOM).unwrap();
    assert_eq!(session["label"], bottom, "{session}");
    let public = lab.public.addr.to_string();
    let arguments = json!({"message": "EMBARGOED: harbor goods terms", "sink": public});
    let base = GrantSpec::reviewed_summary(&authority, &arguments);
    let call =
        |c: &mut common::lab::Client, grant: &Value| publish_with_grant(c, grant, &arguments);
    let r = c.call("public-inbox/publish", arguments.clone());
    assert_eq!(denial(&r), "flow_violation", "{r}");
    // Signed over the session's label, which does not hold what the arguments carry.
    let r = call(&mut c, &sign_grant(&lab, &session, &base));
    assert_eq!(denial(&r), "grant_binding_mismatch", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("source label"),
        "{r}"
    );
    // flowhost/session, given the call's arguments, returns the source to bind.
    let described = c.request(
        "flowhost/session",
        json!({"name": "public-inbox/publish", "arguments": arguments}),
    )["result"]
        .clone();
    assert_eq!(
        described["label_hash"], session["label_hash"],
        "{described}"
    );
    assert!(
        described["source_label"]
            .to_string()
            .contains("harbor-goods-terms"),
        "{described}"
    );
    let mut bound = described.clone();
    bound["label_hash"] = described["source_label_hash"].clone();
    let r = call(&mut c, &sign_grant(&lab, &bound, &base));
    assert!(text(&r).contains("delivered"), "{r}\n{}", lab.log());
    // Only for a tool it may call, with arguments its schema takes: the classifier is not
    // there to be asked about any text.
    for (params, denial) in [
        (json!({"arguments": arguments}), "invalid_params"),
        (
            json!({"name": "public-inbox/publish", "arguments": "text"}),
            "invalid_params",
        ),
        (
            json!({"name": "nowhere/nothing", "arguments": {}}),
            "unknown_tool",
        ),
    ] {
        let r = c.request("flowhost/session", params);
        assert_eq!(r["error"]["data"]["denial"], denial, "{r}");
    }
    lab.stop();
    assert_eq!(lab.public.connections(), 1);
}

/// An executor that retries a refused connect in a loop costs a few records, not one
/// durable write per attempt: identical refusals fold into one record with their count.
/// Before, each of the attempts was its own record, and an executor looping long enough
/// filled the records' disk, after which the host refused every principal's calls.
#[test]
fn an_executor_retrying_a_refused_connect_folds_into_one_record() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let config = std::fs::read_to_string(&lab.config).unwrap();
    let retrying = config.replacen(
        "\"--name\", \"team-inbox\"]",
        "\"--name\", \"team-inbox\", \"--attempts\", \"300\"]",
        1,
    );
    assert_ne!(retrying, config);
    lab.write_config(&retrying);
    lab.spawn();
    let exfil = lab.exfil.addr.to_string();
    let mut c = lab.client();
    c.initialize();
    let r = c.call(
        "team-inbox/publish",
        json!({"message": "again and again", "sink": exfil}),
    );
    assert!(text(&r).contains("in 300 attempts"), "{r}");
    lab.stop();
    let attempts: Vec<Value> = lab
        .records()
        .into_iter()
        .filter(|r| {
            r["flowhost"]["event"] == "egress_attempt"
                && r["flowhost"]["broker"]["syscall"] == "connect"
        })
        .collect();
    assert!(attempts.len() <= 3, "{attempts:#?}");
    let stood_for: u64 = attempts
        .iter()
        .map(|r| r["flowhost"]["folded"]["count"].as_u64().unwrap_or(1))
        .sum();
    assert_eq!(stood_for, 300, "{attempts:#?}");
    assert!(
        attempts
            .iter()
            .all(|r| r["decision"]["effect"] == "deny" && r["flowhost"]["call_id"].is_string()),
        "{attempts:#?}"
    );
    assert_eq!(lab.exfil.connections(), 0);
}
