//! What an executor sends its client during a call (log notifications, sampling and
//! elicitation requests), relayed over the Unix socket by the real daemon from the real
//! sandboxed conformance executor: governed as the call's output (the label raise durable
//! before the client sees anything), forwarded only to a client that declared the
//! capability, and the client's answer checked against the tool's clearances before the
//! tool sees it.

mod common;

use common::lab::{Client, Lab};
use common::shared_copy;
use flowhost::lab::{CONFORMANCE_LABEL, conformance_server, host_config};
use serde_json::{Value, json};

/// The agent's uid on the socket.
const AGENT_UID: u32 = 65531;

/// A label above the conformance tools' output floor.
const SECRET_LABEL: &str =
    r#"{ kind = "known", owners = {}, compartments = ["conformance-data", "secret"] }"#;

/// The lab governing the conformance executor for principal `agent` (uid [`AGENT_UID`]),
/// with each `(tool, policy)` replacing that tool's operator policy.
fn start(policies: &[(&str, String)]) -> Option<Lab> {
    start_with("", policies)
}

/// [`start`] with `host` (lines) added to the `[host]` table.
fn start_with(host: &str, policies: &[(&str, String)]) -> Option<Lab> {
    let mut lab = Lab::prepare()?;
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut server = conformance_server(
        repo,
        &shared_copy("flowhost-tool-conformance")
            .display()
            .to_string(),
    );
    let default =
        format!("policy = {{ input_clearances = [], output_floor = {CONFORMANCE_LABEL} }}");
    for (tool, policy) in policies {
        let table = format!("[server.tools.{tool}]\n");
        let at = server.find(&table).expect("a conformance tool") + table.len();
        server.replace_range(at..at + default.len(), policy);
    }
    lab.write_config(&format!(
        "{}{server}\n[[principal]]\nid = \"agent\"\nuids = [{AGENT_UID}]\ntools = [\"conformance/*\"]\n",
        host_config(&lab.paths).replacen("[host]\n", &format!("[host]\n{host}\n"), 1)
    ));
    lab.spawn();
    Some(lab)
}

/// [`start`], restarted with a classifier rule first: `pattern` (a TOML basic string's
/// content) labels what it matches in `scope` with the terms label.
fn start_with_classifier(pattern: &str, scope: &str) -> Option<Lab> {
    let mut lab = start(&[])?;
    lab.stop();
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let with_rule = text.replacen(
        "[[classifier]]\n",
        &format!(
            "[[classifier]]\npattern = \"{pattern}\"\nlabel = {}\napplies_to = [\"{scope}\"]\n\n[[classifier]]\n",
            flowhost::lab::TERMS_LABEL
        ),
        1,
    );
    assert_ne!(with_rule, text);
    lab.write_config(&with_rule);
    lab.spawn();
    Some(lab)
}

/// A session of the agent whose client declares `capabilities`.
fn session(lab: &Lab, capabilities: Value) -> Client {
    let mut c = lab.client_as(AGENT_UID);
    let r = c.request(
        "initialize",
        json!({"protocolVersion": "2025-06-18", "capabilities": capabilities, "clientInfo": {"name": "relay-test", "version": "0"}}),
    );
    assert!(r.get("result").is_some(), "{r}");
    c
}

/// Sends `tools/call` of `tool` as request `id`.
fn call(c: &mut Client, id: u64, tool: &str, arguments: Value) {
    c.send(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": arguments}}));
}

/// Reads messages until the answer to `id`; returns it and what came before it.
fn until_answer(c: &mut Client, id: u64) -> (Value, Vec<Value>) {
    let mut before = Vec::new();
    loop {
        let m = c.read();
        if m.get("method").is_none() && m["id"] == json!(id) {
            return (m, before);
        }
        before.push(m);
    }
}

/// The session's label compartments, asked on the same connection as request `id`.
fn compartments(c: &mut Client, id: u64) -> Value {
    c.send(&json!({"jsonrpc": "2.0", "id": id, "method": "flowhost/session", "params": {}}));
    let (r, _) = until_answer(c, id);
    r["result"]["label"]["compartments"].clone()
}

/// The relay records of `tool` (what went which way, with what verdict).
fn relays(lab: &Lab, tool: &str) -> Vec<Value> {
    lab.records()
        .into_iter()
        .filter(|r| r["flowhost"]["event"] == "relay" && r["tool"]["name"] == tool)
        .collect()
}

fn result_text(r: &Value) -> String {
    r["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn log_notifications_of_a_call_reach_the_client_before_its_result() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let mut c = session(&lab, json!({}));
    call(&mut c, 2, "test_tool_with_logging", json!({}));
    let (r, before) = until_answer(&mut c, 2);
    assert_eq!(
        result_text(&r),
        "Tool with logging executed successfully",
        "{r}"
    );
    let logs: Vec<&Value> = before
        .iter()
        .filter(|m| m["method"] == "notifications/message")
        .map(|m| &m["params"]["data"])
        .collect();
    assert_eq!(
        logs,
        [
            "Tool execution started",
            "Tool processing data",
            "Tool execution completed"
        ],
        "{before:#?}"
    );
    // Its line after the result belongs to no call: it is not passed on with the next.
    std::thread::sleep(std::time::Duration::from_millis(200));
    call(&mut c, 3, "test_simple_text", json!({}));
    let (r, before) = until_answer(&mut c, 3);
    assert!(r.get("result").is_some(), "{r}");
    assert!(before.is_empty(), "{before:#?}");
    lab.stop();
    assert!(
        lab.log()
            .contains("a log notification of an executor serving no call is not forwarded"),
        "{}",
        lab.log()
    );
}

/// A log line whose text raises the session's label is recorded (`relay`, method `log`,
/// with the labels it left) before the client sees it: the records then prove that label
/// even if the call's outcome is never recorded (the host killed mid-call), so an older copy
/// of the flow state cannot take it back. Lines that change nothing are not recorded.
/// Before, no record carried it until the outcome.
#[test]
fn a_log_line_that_raises_the_label_is_recorded_before_the_client_sees_it() {
    let Some(mut lab) = start_with_classifier("processing", "outputs") else {
        return;
    };
    let mut c = session(&lab, json!({}));
    call(&mut c, 2, "test_tool_with_logging", json!({}));
    let (r, before) = until_answer(&mut c, 2);
    assert!(r.get("result").is_some(), "{r}");
    assert_eq!(
        before
            .iter()
            .filter(|m| m["method"] == "notifications/message")
            .count(),
        3,
        "{before:#?}"
    );
    lab.stop();
    let logged: Vec<Value> = relays(&lab, "test_tool_with_logging")
        .into_iter()
        .filter(|r| r["flowhost"]["relay"]["method"] == "log")
        .collect();
    // The first line raised the tool's output floor, the second what the classifier found;
    // the third changed nothing.
    assert_eq!(logged.len(), 2, "{logged:#?}");
    let raised = &logged[1];
    assert_eq!(
        raised["flowhost"]["relay"]["direction"], "to_client",
        "{raised}"
    );
    assert_eq!(raised["decision"]["effect"], "allow", "{raised}");
    assert!(
        raised["flowhost"]["labels_after"]["session"]["compartments"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c == "harbor-goods-terms")),
        "{raised}"
    );
    // Recorded before the outcome, which carries the same labels.
    let records = lab.records();
    let at = |p: &dyn Fn(&Value) -> bool| records.iter().position(p).unwrap();
    let relay_at = at(&|r| r["flowhost"]["relay"]["method"] == "log");
    let outcome_at = at(&|r| {
        r["flowhost"]["event"] == "tool_outcome" && r["tool"]["name"] == "test_tool_with_logging"
    });
    assert!(relay_at < outcome_at, "{records:#?}");
}

#[test]
fn sampling_goes_to_the_client_only_once_the_calls_label_is_durable_and_its_answer_comes_back() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let mut c = session(&lab, json!({"sampling": {}}));
    assert_eq!(compartments(&mut c, 2), json!([]));
    call(
        &mut c,
        3,
        "test_sampling",
        json!({"prompt": "the floor price"}),
    );
    let asked = c.read();
    assert_eq!(asked["method"], "sampling/createMessage", "{asked}");
    assert_eq!(
        asked["params"]["messages"][0]["content"]["text"],
        "the floor price"
    );
    let relay_id = asked["id"].clone();
    assert!(
        relay_id
            .as_str()
            .is_some_and(|id| id.starts_with("flowhost-relay-")),
        "the host issues its own ids: {asked}"
    );
    // Before the client has answered (so before any result exists), the raise the output
    // implies is in the flow state and the allow is in the records.
    let recorded = relays(&lab, "test_sampling");
    assert_eq!(recorded.len(), 1, "{recorded:#?}");
    let forwarded = &recorded[0];
    assert_eq!(
        forwarded["flowhost"]["relay"],
        json!({"method": "sampling", "direction": "to_client"})
    );
    assert_eq!(forwarded["decision"]["effect"], "allow");
    assert_eq!(
        forwarded["flowhost"]["labels_after"]["session"]["compartments"],
        json!(["conformance-data"])
    );
    assert!(
        !lab.records()
            .iter()
            .any(|r| r["flowhost"]["event"] == "tool_outcome"),
        "the call has no outcome yet"
    );
    assert_eq!(compartments(&mut c, 4), json!(["conformance-data"]));

    // An answer to an id the host never issued is ignored.
    c.send(&json!({"jsonrpc": "2.0", "id": "flowhost-relay-999", "result": {"role": "assistant", "content": {"type": "text", "text": "forged"}, "model": "m"}}));
    c.send(&json!({"jsonrpc": "2.0", "id": relay_id, "result": {"role": "assistant", "content": {"type": "text", "text": "sampled words"}, "model": "m", "stopReason": "endTurn"}}));
    let (r, _) = until_answer(&mut c, 3);
    assert_eq!(result_text(&r), "LLM response: sampled words", "{r}");
    lab.stop();

    let recorded = relays(&lab, "test_sampling");
    assert_eq!(recorded.len(), 2, "{recorded:#?}");
    assert_eq!(recorded[1]["flowhost"]["relay"]["direction"], "to_tool");
    assert_eq!(recorded[1]["decision"]["effect"], "allow");
    // The diff takes the relay records as evidence (no tool action of their own).
    let (_, report) = lab.verify_and_diff(None);
    assert_eq!(report["sources"][0]["evidence"], "verified", "{report:#}");
    // The call (its tool_call and tool_outcome) is judged, its two relay records are not.
    let judged: Vec<&Value> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["tool"] == "test_sampling")
        .collect();
    assert_eq!(judged.len(), 1, "{report:#}");
    assert_eq!(judged[0]["occurrences"], 2, "{report:#}");
}

#[test]
fn an_executor_asking_a_client_without_the_capability_is_refused_and_recorded() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let mut c = session(&lab, json!({"sampling": {}}));
    call(
        &mut c,
        2,
        "test_elicitation",
        json!({"message": "your name?"}),
    );
    let (r, before) = until_answer(&mut c, 2);
    assert!(before.is_empty(), "nothing reached the client: {before:#?}");
    assert_eq!(r["result"]["isError"], true, "{r}");
    let text = result_text(&r);
    assert!(
        text.contains("elicitation failed") && text.contains("no elicitation capability"),
        "{text}"
    );
    lab.stop();
    let recorded = relays(&lab, "test_elicitation");
    assert_eq!(recorded.len(), 1, "{recorded:#?}");
    assert_eq!(recorded[0]["decision"]["effect"], "deny");
    assert_eq!(
        recorded[0]["flowhost"]["denial_kind"],
        "client_capability_missing"
    );
    assert_eq!(
        recorded[0]["flowhost"]["relay"],
        json!({"method": "elicitation", "direction": "to_client"})
    );
}

#[test]
fn the_clients_answer_reaches_the_tool_only_while_the_session_flows_to_its_clearance() {
    // test_sampling's signed input clearance is its own output label (conformance-data);
    // test_simple_text's output is raised above it here.
    let Some(mut lab) = start(&[(
        "test_simple_text",
        format!("policy = {{ input_clearances = [], output_floor = {SECRET_LABEL} }}"),
    )]) else {
        return;
    };
    let mut c = session(&lab, json!({"sampling": {}}));
    let answer = |id: &Value| json!({"jsonrpc": "2.0", "id": id, "result": {"role": "assistant", "content": {"type": "text", "text": "fine"}, "model": "m"}});

    // The session's label flows to the clearance: the answer goes through.
    call(&mut c, 2, "test_sampling", json!({"prompt": "one"}));
    let asked = c.read();
    c.send(&answer(&asked["id"]));
    let (r, _) = until_answer(&mut c, 2);
    assert_eq!(result_text(&r), "LLM response: fine", "{r}");

    // Another request of the session raises it above the clearance while the client
    // thinks: its answer no longer reaches the tool.
    call(&mut c, 3, "test_sampling", json!({"prompt": "two"}));
    let asked = c.read();
    assert_eq!(asked["method"], "sampling/createMessage", "{asked}");
    call(&mut c, 4, "test_simple_text", json!({}));
    let (raised, _) = until_answer(&mut c, 4);
    assert!(raised.get("result").is_some(), "{raised}");
    assert_eq!(
        compartments(&mut c, 5),
        json!(["conformance-data", "secret"])
    );
    c.send(&answer(&asked["id"]));
    let (r, _) = until_answer(&mut c, 3);
    assert_eq!(r["result"]["isError"], true, "{r}");
    assert!(result_text(&r).contains("sampling failed"), "{r}");
    lab.stop();

    let to_tool: Vec<Value> = relays(&lab, "test_sampling")
        .into_iter()
        .filter(|r| r["flowhost"]["relay"]["direction"] == "to_tool")
        .collect();
    assert_eq!(to_tool.len(), 2, "{to_tool:#?}");
    assert_eq!(to_tool[0]["decision"]["effect"], "allow");
    assert_eq!(to_tool[1]["decision"]["effect"], "deny");
    assert_eq!(to_tool[1]["flowhost"]["denial_kind"], "flow_violation");
    assert_eq!(
        to_tool[1]["flowhost"]["source_label"]["compartments"],
        json!(["conformance-data", "secret"])
    );
}

/// A session whose call (request 2) of `test_elicitation` has asked the client, and what
/// it asked.
fn elicitation_asked(lab: &Lab) -> (Client, Value) {
    let mut c = session(lab, json!({"elicitation": {}}));
    call(&mut c, 2, "test_elicitation", json!({"message": "wait"}));
    let asked = c.read();
    assert_eq!(asked["method"], "elicitation/create", "{asked}");
    (c, asked)
}

#[test]
fn a_call_that_ends_abandons_what_it_relayed() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let (mut c, asked) = elicitation_asked(&lab);
    c.send(&json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 2, "reason": "changed my mind"}}));
    let told = c.read();
    assert_eq!(told["method"], "notifications/cancelled", "{told}");
    assert_eq!(told["params"]["requestId"], asked["id"]);
    // The late answer is ignored; the session goes on.
    c.send(&json!({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "accept", "content": {}}}));
    c.send(&json!({"jsonrpc": "2.0", "id": 3, "method": "ping"}));
    let (pong, _) = until_answer(&mut c, 3);
    assert_eq!(pong["result"], json!({}), "{pong}");
    lab.stop();
    assert!(
        relays(&lab, "test_elicitation")
            .iter()
            .all(|r| r["flowhost"]["relay"]["direction"] == "to_client"),
        "nothing went to the tool"
    );
}

/// A client that hangs up while a relayed request awaits its answer ends the call: the
/// relay's allow is followed by the call's outcome, cancelled, so the records never show a
/// request as relayed by a call that seems still open.
#[test]
fn a_request_whose_client_hangs_up_ends_its_call_in_the_records() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let (c, _) = elicitation_asked(&lab);
    drop(c);
    let of_the_call = |lab: &Lab| -> Vec<(String, String, String)> {
        let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
        lab.records()
            .iter()
            .filter(|r| r["tool"]["name"] == "test_elicitation")
            .map(|r| {
                (
                    s(&r["flowhost"]["event"]),
                    s(&r["decision"]["effect"]),
                    s(&r["response"]["status"]),
                )
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while of_the_call(&lab).len() < 3 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    lab.stop();
    let want = |e: &str, d: &str, s: &str| (e.to_string(), d.to_string(), s.to_string());
    // The relay may be told first that no answer will come (the client's input ended), and
    // says so in its own record, before the call is cancelled (its output closed).
    let mut recorded = of_the_call(&lab);
    let unreachable = want("relay", "error", "client_unreachable");
    assert!(
        recorded.iter().filter(|r| **r == unreachable).count() <= 1,
        "{recorded:?}"
    );
    recorded.retain(|r| *r != unreachable);
    assert_eq!(
        recorded,
        [
            want("tool_call", "allow", "authorized"),
            want("relay", "allow", "authorized"),
            want("tool_outcome", "error", "cancelled"),
        ]
    );
}

/// The `notifications/resources/updated` of `uri` that arrive while the client pings the
/// host `rounds` times (request ids from `first_id`), with what else came.
fn updates_while_pinging(c: &mut Client, first_id: u64, rounds: u64, uri: &str) -> usize {
    let mut seen = 0;
    for id in first_id..first_id + rounds {
        c.send(&json!({"jsonrpc": "2.0", "id": id, "method": "ping"}));
        let (_, before) = until_answer(c, id);
        seen += before
            .iter()
            .filter(|m| {
                m["method"] == "notifications/resources/updated" && m["params"]["uri"] == uri
            })
            .count();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    seen
}

/// Sends `method` of `uri` as request `id`; returns the answer and counts the updates of
/// `uri` that came before it.
fn on_resource(c: &mut Client, id: u64, method: &str, uri: &str) -> (Value, usize) {
    c.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": {"uri": uri}}));
    let (answer, before) = until_answer(c, id);
    let updates = before
        .iter()
        .filter(|m| m["method"] == "notifications/resources/updated" && m["params"]["uri"] == uri)
        .count();
    (answer, updates)
}

/// A resource update an executor sends while it serves a call reaches the client only once
/// the call's label is stored: which URI changes, and when, is a signal the executor
/// chooses. Before, the update went out at once, while the session's label still lacked
/// what the call read, so the client (or a parallel call) saw it at the lower label.
#[test]
fn an_update_sent_during_a_call_waits_for_the_calls_label() {
    let Some(mut lab) = start(&[(
        "test_tool_with_progress",
        format!("policy = {{ input_clearances = [], output_floor = {SECRET_LABEL} }}"),
    )]) else {
        return;
    };
    const URI: &str = "test://watched-resource";
    let mut c = session(&lab, json!({}));
    let (r, _) = on_resource(&mut c, 2, "resources/subscribe", URI);
    assert_eq!(r["result"], json!({}), "{r}");
    // The subscription's own update, and nothing else pending.
    updates_while_pinging(&mut c, 100, 3, URI);
    assert!(!compartments(&mut c, 3).to_string().contains("secret"));

    c.send(
        &json!({"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {
        "name": "test_tool_with_progress", "arguments": {}, "_meta": {"progressToken": "p"}}}),
    );
    let (answer, before) = until_answer(&mut c, 4);
    assert!(answer.get("result").is_some(), "{answer}");
    let kinds: Vec<&str> = before
        .iter()
        .map(|m| m["method"].as_str().unwrap_or("?"))
        .collect();
    let update = kinds
        .iter()
        .position(|k| *k == "notifications/resources/updated")
        .unwrap_or_else(|| panic!("no update before the answer: {kinds:?}"));
    let last_progress = kinds
        .iter()
        .rposition(|k| *k == "notifications/progress")
        .unwrap_or_else(|| panic!("no progress: {kinds:?}"));
    assert!(
        update > last_progress,
        "the update went out while the call ran, before its label was stored: {kinds:?}"
    );
    assert_eq!(
        compartments(&mut c, 5),
        json!(["conformance-data", "secret"])
    );
    lab.stop();
}

/// Progress numbers are read by the classifier like the output they are part of: an
/// executor sending a number a rule matches one notification at a time raises the label as
/// the same number in its result would. Before, a call's progress was labelled once with
/// its floor only, so no rule ever saw the numbers.
#[test]
fn progress_numbers_are_classified_as_output() {
    // The conformance tool reports 0, 50 and 100; neither its result nor its arguments
    // hold 50.
    let Some(mut lab) = start_with_classifier("\\\\b50\\\\b", "outputs") else {
        return;
    };
    let mut c = session(&lab, json!({}));
    c.send(
        &json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "test_tool_with_progress", "arguments": {}, "_meta": {"progressToken": 7}}}),
    );
    let (answer, before) = until_answer(&mut c, 2);
    assert!(answer.get("result").is_some(), "{answer}");
    assert!(
        before.iter().any(|m| m["params"]["progress"] == 50),
        "{before:?}"
    );
    let label = compartments(&mut c, 3);
    assert!(
        label.to_string().contains("harbor-goods-terms"),
        "the number the rule matches did not raise the label: {label}"
    );
    lab.stop();
}

/// Reloads the configuration unchanged but for a comment, and waits for the reload that
/// makes the `configuration`th configuration served (the first is the one started with).
fn reload(lab: &Lab, configuration: usize) {
    let text = std::fs::read_to_string(&lab.config).unwrap();
    lab.write_config(&format!("{text}\n# reload {configuration}\n"));
    lab.signal(libc::SIGHUP);
    reloaded(lab, configuration - 1);
}

/// Waits until `lab` has logged `reloads` successful reloads. Counted by their lines, not
/// by generation: a reload that takes something out withdraws it first, in a generation of
/// its own.
fn reloaded(lab: &Lab, reloads: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while lab.log().matches("reloaded: generation").count() < reloads {
        assert!(std::time::Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A subscription belongs to the session: when the executor that took it is retired (here
/// by a reload, which retires the old generation's executors), the next executor bound for
/// that server is subscribed again, and the client goes on getting updates. Once the client
/// unsubscribes, no executor is subscribed for it again, and updates stop.
#[test]
fn a_subscription_outlives_the_executor_that_took_it() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    const URI: &str = "test://static-text";
    let mut c = session(&lab, json!({}));
    // The conformance executor sends an update of a resource as soon as it is subscribed.
    let (r, mut updates) = on_resource(&mut c, 2, "resources/subscribe", URI);
    assert_eq!(r["result"], json!({}), "{r}");
    updates += updates_while_pinging(&mut c, 100, 5, URI);
    assert_eq!(updates, 1, "the first subscription's update");

    reload(&lab, 2);
    let (r, mut updates) = on_resource(&mut c, 3, "resources/read", URI);
    assert!(r["result"]["contents"].is_array(), "{r}");
    updates += updates_while_pinging(&mut c, 200, 5, URI);
    assert_eq!(
        updates,
        1,
        "the new generation's executor was subscribed again:\n{}",
        lab.log()
    );

    let (r, _) = on_resource(&mut c, 4, "resources/unsubscribe", URI);
    assert_eq!(r["result"], json!({}), "{r}");
    reload(&lab, 3);
    let (r, mut updates) = on_resource(&mut c, 5, "resources/read", URI);
    assert!(r["result"]["contents"].is_array(), "{r}");
    updates += updates_while_pinging(&mut c, 300, 5, URI);
    assert_eq!(updates, 0, "an unsubscribed resource is not watched again");
    lab.stop();
}

/// An executor holding a subscription of the client is not stopped for being idle (that
/// would end the subscription unnoticed); once the client unsubscribes, it is.
#[test]
fn an_idle_executor_holding_a_subscription_is_kept() {
    let Some(mut lab) = start_with("idle_timeout_ms = 100", &[]) else {
        return;
    };
    const URI: &str = "test://static-text";
    // The conformance executor says on stderr (in the host's log) each time it is given
    // a logging level: once per executor the session binds.
    const APPLIED: &str = "conformance: logging level warning";
    let mut c = session(&lab, json!({}));
    let set = c.request("logging/setLevel", json!({"level": "warning"}));
    assert_eq!(set["result"], json!({}), "{set}");
    let (r, _) = on_resource(&mut c, 2, "resources/subscribe", URI);
    assert_eq!(r["result"], json!({}), "{r}");
    // Idle sessions' executors are looked at every 5 s.
    std::thread::sleep(std::time::Duration::from_millis(5500));
    let (r, _) = on_resource(&mut c, 3, "resources/read", URI);
    assert!(r["result"]["contents"].is_array(), "{r}");
    assert_eq!(
        lab.log().matches(APPLIED).count(),
        1,
        "the holder served the read:\n{}",
        lab.log()
    );

    let (r, _) = on_resource(&mut c, 4, "resources/unsubscribe", URI);
    assert_eq!(r["result"], json!({}), "{r}");
    std::thread::sleep(std::time::Duration::from_millis(5500));
    let (r, _) = on_resource(&mut c, 5, "resources/read", URI);
    assert!(r["result"]["contents"].is_array(), "{r}");
    assert_eq!(
        lab.log().matches(APPLIED).count(),
        2,
        "the executor was stopped once idle, and a new one served:\n{}",
        lab.log()
    );
    lab.stop();
}

/// A session holds at most 256 subscriptions (each is renewed on every executor that takes
/// it over): the next is refused and recorded; one ended makes room again.
#[test]
fn a_session_holds_a_bounded_number_of_subscriptions() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let mut c = session(&lab, json!({}));
    let uri = |n: u64| format!("test://template/{n}/data");
    for n in 0..256 {
        let (r, _) = on_resource(&mut c, 1000 + n, "resources/subscribe", &uri(n));
        assert_eq!(r["result"], json!({}), "subscription {n}: {r}");
    }
    // The same one again is no new subscription.
    let (r, _) = on_resource(&mut c, 2000, "resources/subscribe", &uri(0));
    assert_eq!(r["result"], json!({}), "{r}");
    let (r, _) = on_resource(&mut c, 2001, "resources/subscribe", &uri(256));
    assert_eq!(r["error"]["data"]["denial"], "subscription_limit", "{r}");
    let (r, _) = on_resource(&mut c, 2002, "resources/unsubscribe", &uri(0));
    assert_eq!(r["result"], json!({}), "{r}");
    let (r, _) = on_resource(&mut c, 2003, "resources/subscribe", &uri(256));
    assert_eq!(r["result"], json!({}), "{r}");
    lab.stop();
    let refused: Vec<Value> = lab
        .records()
        .into_iter()
        .filter(|r| r["flowhost"]["denial_kind"] == "subscription_limit")
        .collect();
    assert_eq!(refused.len(), 1, "{refused:#?}");
    assert_eq!(refused[0]["server"]["id"], "conformance", "{refused:#?}");
    assert_eq!(
        refused[0]["tool"]["name"], "resources/subscribe test://template/{id}/data",
        "{refused:#?}"
    );
    // The refused one is recorded as refused only, never as authorized first (before, it
    // was both): 256 subscribes, the repeat and the one after the unsubscribe.
    let authorized = lab
        .records()
        .into_iter()
        .filter(|r| {
            r["flowhost"]["event"] == "content_request"
                && r["decision"]["effect"] == "allow"
                && r["tool"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("resources/subscribe "))
        })
        .count();
    assert_eq!(authorized, 258);
}

/// A subscription request reads nothing, so nothing of what the executor says about it is
/// labelled: an executor's error words go to the host's log, never to the client.
#[test]
fn an_executors_refusal_of_a_subscription_reaches_the_client_without_its_words() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let mut c = session(&lab, json!({}));
    let uri = "test://template/unwatchable/data";
    let (r, updates) = on_resource(&mut c, 2, "resources/subscribe", uri);
    let message = r["error"]["message"].as_str().unwrap_or_default();
    assert!(
        !message.contains(flowhost_example_tools::conformance::UNWATCHABLE_DETAIL)
            && !r.to_string().contains("contract draft"),
        "the executor's words reached the client unlabelled: {r}"
    );
    assert!(message.contains("answered with an error"), "{r}");
    assert_eq!(updates, 0);
    lab.stop();
    assert!(
        lab.log()
            .contains(flowhost_example_tools::conformance::UNWATCHABLE_DETAIL),
        "the operator can read them"
    );
    // The records say it did not take effect: an outcome follows the allow. Before, they
    // held only the allow of a subscription the client was told failed.
    let subscribed: Vec<(String, String)> = lab
        .records()
        .into_iter()
        .filter(|r| {
            r["tool"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("resources/subscribe"))
        })
        .map(|r| {
            (
                r["flowhost"]["event"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                r["response"]["status"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(subscribed.len(), 2, "{subscribed:?}");
    assert_eq!(subscribed[0].0, "content_request", "{subscribed:?}");
    assert_eq!(subscribed[1].0, "content_outcome", "{subscribed:?}");
    assert_ne!(subscribed[1].1, "success", "{subscribed:?}");
}

/// An unsubscribe ends the subscription for the client whatever the executor answers: the
/// session stops relaying the resource's updates before it asks, so the client is told it
/// took effect, and the records hold its allow alone. Before, the client was told the
/// unsubscribe failed and the records that it did not take effect, though no update of it
/// reached the client any more.
#[test]
fn an_unsubscribe_the_executor_refuses_still_ends_the_subscription() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let mut c = session(&lab, json!({}));
    let uri = "test://template/sticky/data";
    let (r, _) = on_resource(&mut c, 2, "resources/subscribe", uri);
    assert_eq!(r["result"], json!({}), "{r}");
    let (r, _) = on_resource(&mut c, 3, "resources/unsubscribe", uri);
    assert_eq!(r["result"], json!({}), "{r}");
    lab.stop();
    assert!(
        lab.log()
            .contains("the executor did not take the unsubscribe"),
        "{}",
        lab.log()
    );
    let unsubscribed: Vec<String> = lab
        .records()
        .into_iter()
        .filter(|r| {
            r["tool"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("resources/unsubscribe"))
        })
        .map(|r| {
            r["flowhost"]["event"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(unsubscribed, ["content_request"], "{unsubscribed:?}");
}

/// Replaces the principal's `tools` value `from` by `to`, reloads, and waits for the
/// `generation`th configuration to be served.
fn reload_granting(lab: &Lab, from: &str, to: &str, generation: usize) {
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let granted = text.replacen(&format!("tools = {from}"), &format!("tools = {to}"), 1);
    assert_ne!(granted, text, "the principal's tools line was found");
    std::fs::write(&lab.config, &granted).unwrap();
    reload(lab, generation);
}

/// A reload that takes the resource away from the session's principal ends the client's
/// subscription: the executor bound next is not subscribed for a client that may no longer
/// read the resource, and giving the right back later does not bring the subscription back
/// unasked (the client was never told it ended, but it also never watched meanwhile).
#[test]
fn a_reload_revoking_a_resource_ends_the_subscription_to_it() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    const URI: &str = "test://static-text";
    let mut c = session(&lab, json!({}));
    let (r, updates) = on_resource(&mut c, 2, "resources/subscribe", URI);
    assert_eq!(r["result"], json!({}), "{r}");
    assert!(
        updates + updates_while_pinging(&mut c, 100, 5, URI) == 1,
        "subscribed"
    );

    const ALL: &str = "[\"conformance/*\"]";
    const ONE_TOOL: &str = "[\"conformance/test_simple_text\"]";
    reload_granting(&lab, ALL, ONE_TOOL, 2);
    // A call of a tool still granted binds an executor of the new generation.
    call(&mut c, 3, "test_simple_text", json!({}));
    let (r, _) = until_answer(&mut c, 3);
    assert!(r.get("result").is_some(), "{r}");
    let (r, _) = on_resource(&mut c, 4, "resources/read", URI);
    assert!(r.get("error").is_some(), "the right was taken away: {r}");
    // A subscribe refused now is recorded naming the server and what it signed (before, as
    // a request that named nothing); the client is told neither.
    let (r, _) = on_resource(&mut c, 41, "resources/subscribe", URI);
    assert_eq!(r["error"]["data"]["denial"], "access_denied", "{r}");
    assert!(!r.to_string().contains("conformance"), "{r}");

    reload_granting(&lab, ONE_TOOL, ALL, 3);
    let (r, mut updates) = on_resource(&mut c, 5, "resources/read", URI);
    assert!(r["result"]["contents"].is_array(), "{r}");
    updates += updates_while_pinging(&mut c, 300, 5, URI);
    assert_eq!(
        updates,
        0,
        "the subscription ended with the right:\n{}",
        lab.log()
    );
    assert!(
        lab.log()
            .contains("the client's subscription ended: the principal may no longer read it"),
        "the operator is told:\n{}",
        lab.log()
    );
    lab.stop();
    let refused: Vec<Value> = lab
        .records()
        .into_iter()
        .filter(|r| {
            r["decision"]["effect"] == "deny" && r["flowhost"]["denial_kind"] == "access_denied"
        })
        .collect();
    assert!(
        refused
            .iter()
            .any(|r| r["flowhost"]["event"] == "content_request"
                && r["server"]["id"] == "conformance"
                && r["tool"]["name"] == format!("resources/subscribe {URI}")),
        "{refused:#?}"
    );
}

/// A reload that maps the session's uid to another principal ends its subscriptions too:
/// the session's requests are refused from then on (it belongs to the principal it was
/// pinned to), and so are the updates, though that principal still exists and may read.
#[test]
fn a_reload_remapping_the_peer_ends_its_session_and_subscriptions() {
    let Some(mut lab) = start_with("idle_timeout_ms = 100", &[]) else {
        return;
    };
    const URI: &str = "test://static-text";
    let mut c = session(&lab, json!({}));
    let (r, _) = on_resource(&mut c, 2, "resources/subscribe", URI);
    assert_eq!(r["result"], json!({}), "{r}");
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let remapped = text.replacen(&format!("uids = [{AGENT_UID}]"), "uids = [65001]", 1)
        + &format!(
            "\n[[principal]]\nid = \"other\"\nuids = [{AGENT_UID}]\ntools = [\"conformance/*\"]\n"
        );
    assert_ne!(remapped, text);
    lab.write_config(&remapped);
    reload(&lab, 2);
    // The session belongs to the principal its peer no longer maps to: its request is
    // refused, then the host ends it (and its subscription with it) rather than refusing
    // request after request while it holds a slot of that principal.
    let (r, _) = on_resource(&mut c, 3, "resources/read", URI);
    assert!(r.get("error").is_some(), "the session is refused now: {r}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the session outlived its mapping"
        );
        match c.try_read() {
            Ok(m) => assert!(m.get("result").is_none(), "served after the reload: {m}"),
            Err(_) => break,
        }
    }
    lab.stop();
    assert!(
        lab.log()
            .contains("a reload no longer maps the peer to the session's principal"),
        "{}",
        lab.log()
    );
}

/// A subscription sends the client's URI to the executor, so what a template's variables
/// carry joins the session's label first, as for a read, and the request is recorded
/// (naming the signed template, not the URI) before the executor sees it.
#[test]
fn a_subscription_is_tainted_by_its_uri_and_recorded() {
    let Some(mut lab) = start_with_classifier("HUSH-[0-9]+", "arguments") else {
        return;
    };
    let mut c = session(&lab, json!({}));
    let (r, _) = on_resource(
        &mut c,
        2,
        "resources/subscribe",
        "test://template/HUSH-42/data",
    );
    assert_eq!(r["result"], json!({}), "{r}");
    lab.stop();
    let records = lab.records();
    let subscribed = records
        .iter()
        .find(|r| {
            r["flowhost"]["event"] == "content_request"
                && r["tool"]["name"] == "resources/subscribe test://template/{id}/data"
        })
        .unwrap_or_else(|| panic!("no record of the subscription: {records:#?}"));
    assert_eq!(subscribed["decision"]["effect"], "allow", "{subscribed:#}");
    assert!(
        subscribed["flowhost"]["labels_after"]
            .to_string()
            .contains("harbor-goods-terms"),
        "{subscribed:#}"
    );
    assert!(!records.iter().any(|r| r.to_string().contains("HUSH-42")));
}

/// The pids of `lab`'s daemon's descendants whose command line mentions `name`.
fn descendants_running(lab: &Lab, name: &str) -> Vec<i32> {
    let all = procfs::process::all_processes().expect("/proc");
    let parents: std::collections::HashMap<i32, (i32, String)> = all
        .filter_map(Result::ok)
        .filter_map(|p| {
            let ppid = p.stat().ok()?.ppid;
            Some((p.pid, (ppid, p.cmdline().ok()?.join(" "))))
        })
        .collect();
    let daemon = lab.pid();
    parents
        .iter()
        .filter(|(_, (_, cmdline))| cmdline.contains(name))
        .filter(|&(&pid, _)| {
            let mut at = pid;
            for _ in 0..64 {
                match parents.get(&at) {
                    Some(&(ppid, _)) if ppid == daemon => return true,
                    Some(&(ppid, _)) if ppid > 1 => at = ppid,
                    _ => return false,
                }
            }
            false
        })
        .map(|(&pid, _)| pid)
        .collect()
}

/// An executor kept for holding a subscription is not kept past a reload that removes its
/// server: the next look at idle executors stops it, whatever the client subscribed to.
#[test]
fn a_removed_servers_subscription_holder_is_stopped() {
    let Some(mut lab) = start_with("idle_timeout_ms = 100", &[]) else {
        return;
    };
    const URI: &str = "test://static-text";
    let mut c = session(&lab, json!({}));
    let (r, _) = on_resource(&mut c, 2, "resources/subscribe", URI);
    assert_eq!(r["result"], json!({}), "{r}");
    assert!(
        !descendants_running(&lab, "conformance").is_empty(),
        "the holder runs"
    );

    let text = std::fs::read_to_string(&lab.config).unwrap();
    let server = text
        .find("\n[[server]]\nid = \"conformance\"")
        .expect("the server table");
    let principal = text
        .find("\n[[principal]]\nid = \"agent\"")
        .expect("the principal table");
    lab.write_config(&format!(
        "{}{}",
        &text[..server],
        text[principal..].replacen("tools = [\"conformance/*\"]", "tools = []", 1)
    ));
    lab.signal(libc::SIGHUP);
    reloaded(&lab, 1);
    // Idle sessions' executors are looked at every 5 s.
    std::thread::sleep(std::time::Duration::from_millis(5500));
    let left = descendants_running(&lab, "conformance");
    assert!(
        left.is_empty(),
        "the removed server's executors {left:?} still run:\n{}",
        lab.log()
    );
    // And the subscription ended with it: it neither lingers (counted against the
    // session's limit, beyond the client's unsubscribe) nor comes back if a server of that
    // id is served again.
    assert!(
        lab.log().contains("the client's subscription ended"),
        "{}",
        lab.log()
    );
    let ping = c.request("ping", json!({}));
    assert_eq!(ping["result"], json!({}), "the session goes on: {ping}");
    lab.stop();
}

/// While the host stops, a call waiting for its client's answer to a sampling request gets
/// it, and ends: before, the session stopped reading at the stop, the answer was never
/// read, and the call waited out its deadline (15 s here), holding the stop.
#[test]
fn a_calls_client_is_still_heard_while_the_host_stops() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let mut c = session(&lab, json!({"sampling": {}}));
    call(&mut c, 2, "test_sampling", json!({"prompt": "last words"}));
    let asked = c.read();
    assert_eq!(asked["method"], "sampling/createMessage", "{asked}");
    lab.signal(libc::SIGTERM);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !lab.log().contains("stopping") {
        assert!(std::time::Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let t0 = std::time::Instant::now();
    c.send(&json!({"jsonrpc": "2.0", "id": asked["id"], "result": {"role": "assistant", "content": {"type": "text", "text": "heard"}, "model": "m", "stopReason": "endTurn"}}));
    let (r, _) = until_answer(&mut c, 2);
    assert_eq!(result_text(&r), "LLM response: heard", "{r}");
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(5),
        "the answer took {:?}",
        t0.elapsed()
    );
    lab.stop();
}

/// A client that never stops sending does not hold the stop: the session hears what the
/// client sends while its calls finish, and no longer. Before, it read until its queue was
/// empty, which a client writing without pause kept from happening, and the stop waited
/// out its bound and ended unclean.
#[test]
fn a_client_that_keeps_sending_does_not_hold_the_stop() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let c = session(&lab, json!({}));
    drop(c);
    let stream = agent_stream(&lab);
    use std::io::{BufRead, Write};
    let mut writer = stream.try_clone().unwrap();
    writeln!(writer, "{}", json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "flood", "version": "0"}}})).unwrap();
    let reader = std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stream);
        let mut line = String::new();
        while lines.read_line(&mut line).is_ok_and(|n| n > 0) {
            line.clear();
        }
    });
    let flooding = std::thread::spawn(move || {
        let ping = format!("{}\n", json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}));
        while writer.write_all(ping.as_bytes()).is_ok() {}
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let status = lab.stop_status().unwrap();
    let took = t0.elapsed();
    assert!(status.success(), "{status}:\n{}", lab.log());
    assert!(
        took < std::time::Duration::from_secs(8),
        "the stop took {took:?}"
    );
    flooding.join().unwrap();
    reader.join().unwrap();
}

/// A peer a reload maps to no principal is not heard as the principal its calls ask: its
/// answer to a sampling request is not taken, and the call goes on without it at once
/// rather than waiting out its deadline. Before, an answer sent before the session noticed
/// the reload reached the old principal's call.
#[test]
fn a_remapped_peers_answer_is_not_taken() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let mut c = session(&lab, json!({"sampling": {}}));
    call(
        &mut c,
        2,
        "test_sampling",
        json!({"prompt": "who is asking"}),
    );
    let asked = c.read();
    assert_eq!(asked["method"], "sampling/createMessage", "{asked}");
    let text = std::fs::read_to_string(&lab.config).unwrap();
    let remapped = text.replacen(
        &format!("uids = [{AGENT_UID}]"),
        &format!("uids = [{}]", AGENT_UID + 1),
        1,
    );
    assert_ne!(remapped, text);
    lab.write_config(&remapped);
    lab.signal(libc::SIGHUP);
    reloaded(&lab, 1);
    let t0 = std::time::Instant::now();
    c.send(&json!({"jsonrpc": "2.0", "id": asked["id"], "result": {"role": "assistant", "content": {"type": "text", "text": "not theirs"}, "model": "m", "stopReason": "endTurn"}}));
    let (r, _) = until_answer(&mut c, 2);
    assert!(!r.to_string().contains("not theirs"), "{r}");
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(8),
        "the call waited {:?}",
        t0.elapsed()
    );
    lab.stop();
}

/// A client that ends its input while a call waits for its answer to a sampling request
/// (as a stdio client does at the end of what it had to send) cannot answer any more: the
/// call goes on without the answer at once, and its result still reaches the client.
/// Before, the call waited out its deadline (15 s here).
#[test]
fn a_call_waiting_on_a_client_whose_input_ended_goes_on_at_once() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let stream = agent_stream(&lab);
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    use std::io::{BufRead, Write};
    let mut writer = stream.try_clone().unwrap();
    let mut lines = std::io::BufReader::new(stream);
    let mut read = || {
        let mut line = String::new();
        lines.read_line(&mut line).unwrap();
        serde_json::from_str::<Value>(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    };
    writeln!(writer, "{}", json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {"sampling": {}}, "clientInfo": {"name": "t", "version": "0"}}})).unwrap();
    assert!(read()["result"].is_object());
    writeln!(
        writer,
        "{}",
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"})
    )
    .unwrap();
    writeln!(writer, "{}", json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "test_sampling", "arguments": {"prompt": "anyone?"}}})).unwrap();
    let asked = read();
    assert_eq!(asked["method"], "sampling/createMessage", "{asked}");
    let t0 = std::time::Instant::now();
    writer.shutdown(std::net::Shutdown::Write).unwrap();
    let answer = loop {
        let m = read();
        if m["id"] == json!(2) && m.get("method").is_none() {
            break m;
        }
    };
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(8),
        "the call waited {:?}: {answer}",
        t0.elapsed()
    );
    lab.stop();
}

/// A client that answers a relayed request with a malformed message (no result and no error)
/// is told so, and the call goes on at once without an answer, recorded as undelivered: it
/// does not wait out its deadline to be recorded as a bound reached.
#[test]
fn a_malformed_answer_to_a_relayed_request_ends_the_wait_at_once() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let (asked, before) = answered_at_once(&mut lab, |id| json!({"jsonrpc": "2.0", "id": id}));
    assert!(
        before
            .iter()
            .any(|m| m["id"] == asked["id"] && m["error"]["code"] == json!(-32600)),
        "the client is told its message was invalid: {before:?}"
    );
    let relayed = relays(&lab, "test_elicitation");
    assert!(
        relayed
            .iter()
            .any(|r| r["response"]["status"] == "client_unreachable"),
        "{relayed:#?}"
    );
}

/// An answer to a relayed request over `max_message_bytes` (a long completion) ends the
/// call's wait at once, as a malformed one does: before, the line was discarded, the call
/// waited out its deadline and was recorded as a bound reached, its executor blamed.
#[test]
fn an_oversized_answer_to_a_relayed_request_ends_the_wait_at_once() {
    let Some(mut lab) = start(&[]) else {
        return;
    };
    let (_, before) = answered_at_once(&mut lab, |id| {
        json!({"jsonrpc": "2.0", "id": id,
            "result": {"action": "accept", "content": {"text": "x".repeat(2 << 20)}}})
    });
    assert!(
        before.iter().any(|m| m["error"]["message"]
            .as_str()
            .is_some_and(|t| t.contains("exceeds"))),
        "the client is told its message was too large: {before:?}"
    );
}

/// Answers the elicitation a call of `test_elicitation` asks with `answer` (made from the
/// request's id), checks the call ended at once, not at its deadline as a bound reached,
/// and stops the lab. Returns the request and what the client got before the call's answer.
fn answered_at_once(lab: &mut Lab, answer: impl Fn(&Value) -> Value) -> (Value, Vec<Value>) {
    let (mut c, asked) = elicitation_asked(lab);
    let t0 = std::time::Instant::now();
    c.send(&answer(&asked["id"]));
    let (answer, before) = until_answer(&mut c, 2);
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(8),
        "the call waited {:?}: {answer}",
        t0.elapsed()
    );
    lab.stop();
    let outcome = lab
        .records()
        .into_iter()
        .find(|r| {
            r["tool"]["name"] == "test_elicitation" && r["flowhost"]["event"] == "tool_outcome"
        })
        .expect("the call's outcome");
    assert_ne!(outcome["response"]["status"], "bound_reached", "{outcome}");
    (asked, before)
}

/// A raw connection to the lab's socket as the agent's uid.
fn agent_stream(lab: &Lab) -> std::os::unix::net::UnixStream {
    let socket = lab.paths.socket.clone();
    std::thread::spawn(move || {
        // SAFETY: raw setresuid changes only this thread's credentials (back below).
        unsafe {
            assert_eq!(
                libc::syscall(libc::SYS_setresuid, -1i64, AGENT_UID as i64, -1i64),
                0
            )
        };
        let s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        // SAFETY: as above, back to euid 0.
        unsafe { assert_eq!(libc::syscall(libc::SYS_setresuid, -1i64, 0i64, -1i64), 0) };
        s
    })
    .join()
    .unwrap()
}
