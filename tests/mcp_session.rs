//! MCP sessions against the real daemon and real sandboxed executors (`flowhost-tool-slow`):
//! requests in flight concurrently and answered in any order, progress and cancellation
//! passed through, tools advertised with their signed output schema and annotations,
//! schema failures as tool errors, error codes clear of the SDKs', protocol negotiation, and
//! the operator's log lines.

mod common;

use std::time::{Duration, Instant};

use common::governed::{Governed, RawClient, ServerSpec, tool};
use common::shared_copy;
use serde_json::{Value, json};

fn slow_tools() -> Vec<Value> {
    let mut structured = tool("structured", json!({"type": "object"}));
    structured["title"] = json!("Structured answer");
    structured["output_schema"] = json!({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]});
    structured["annotations"]["open_world"] = json!(false);
    vec![
        tool(
            "sleep",
            json!({"type": "object", "properties": {"seconds": {"type": "number", "maximum": 60},
                   "steps": {"type": "integer", "minimum": 1}}, "required": ["seconds"],
                   "additionalProperties": false}),
        ),
        structured,
        tool("chatter", json!({"type": "object"})),
        tool("ask_then_answer", json!({"type": "object"})),
    ]
}

fn slow(id: &str, args: &[&str]) -> ServerSpec {
    let mut command = vec![shared_copy("flowhost-tool-slow").display().to_string()];
    command.extend(args.iter().map(|a| a.to_string()));
    let mut s = ServerSpec::new(id, command, slow_tools());
    s.extra = "pool_size = 2".into();
    s
}

/// The daemon serving one slow server `id` (with `args`), one executor kept warm.
fn one_warm(id: &str, args: &[&str]) -> Option<Governed> {
    let mut s = slow(id, args);
    s.extra = "pool_size = 1".into();
    Governed::start(&[s], "")
}

fn start() -> Option<Governed> {
    Governed::start(
        &[slow("slow", &[]), slow("stubborn", &["--ignore-cancel"])],
        "",
    )
}

fn call(c: &mut RawClient, id: u64, tool: &str, arguments: Value) {
    c.send_request(
        id,
        "tools/call",
        json!({"name": tool, "arguments": arguments}),
    );
}

/// Reads messages until the answer to `id` arrives; returns it and what came before.
fn until_answer(c: &mut RawClient, id: u64) -> (Value, Vec<Value>) {
    let mut before = Vec::new();
    loop {
        let m = c.recv();
        if m["id"] == json!(id) && m.get("method").is_none() {
            return (m, before);
        }
        before.push(m);
    }
}

#[test]
fn pings_lists_and_other_calls_do_not_wait_behind_a_call() {
    let Some(host) = start() else { return };
    let mut c = host.client();
    let t0 = Instant::now();
    call(&mut c, 1, "slow/sleep", json!({"seconds": 3}));
    std::thread::sleep(Duration::from_millis(200));
    c.send_request(2, "ping", json!({}));
    c.send_request(3, "tools/list", json!({}));
    call(&mut c, 4, "slow/sleep", json!({"seconds": 0.2}));
    call(&mut c, 5, "stubborn/sleep", json!({"seconds": 0.1}));
    let mut order = Vec::new();
    let mut at = std::collections::HashMap::new();
    for _ in 0..5 {
        let m = c.recv();
        let id = m["id"].as_u64().unwrap();
        assert!(m.get("result").is_some(), "{m}");
        at.insert(id, t0.elapsed());
        order.push(id);
    }
    assert_eq!(
        *order.last().unwrap(),
        1,
        "the long call answers last: {order:?}"
    );
    for id in [2, 3, 4, 5] {
        assert!(
            at[&id] < Duration::from_millis(2000),
            "request {id} waited {:?} behind the long call ({order:?})\n{}",
            at[&id],
            host.log()
        );
    }
}

#[test]
fn concurrent_calls_to_one_server_run_on_separate_executors() {
    let Some(host) = start() else { return };
    let mut c = host.client();
    let t0 = Instant::now();
    for id in 1..=3 {
        call(&mut c, id, "slow/sleep", json!({"seconds": 1.5}));
    }
    for _ in 0..3 {
        let m = c.recv();
        assert!(m.get("result").is_some(), "{m}");
    }
    // One executor (serving one call at a time) would take 4.5 s; three serve the calls
    // side by side.
    assert!(
        t0.elapsed() < Duration::from_millis(3500),
        "{:?}",
        t0.elapsed()
    );
}

/// A call's deadline (`call_timeout_ms`) counts from its dispatch: an executor started for it
/// (no warm one kept) that takes most of the deadline to answer `initialize` leaves the call
/// only the rest. Before, the start and the call had a deadline each, so a call took up to
/// twice `call_timeout_ms` (here it succeeded after 3 s against a 2.5 s deadline), longer
/// than a stop waits for calls in flight.
#[test]
fn a_calls_deadline_covers_the_start_of_its_executor() {
    let mut s = slow("starts_slowly", &["--init-delay-ms", "1500"]);
    s.extra = "pool_size = 0".into();
    let Some(host) = Governed::start(&[s], "call_timeout_ms = 2500") else {
        return;
    };
    let mut c = host.client();
    let t0 = Instant::now();
    // The executor primed at start serves one call; the other has one started for it.
    call(&mut c, 1, "starts_slowly/sleep", json!({"seconds": 1.5}));
    call(&mut c, 2, "starts_slowly/sleep", json!({"seconds": 1.5}));
    let mut answers = Vec::new();
    for _ in 0..2 {
        let m = c.recv();
        answers.push((t0.elapsed(), m));
    }
    let failed = |m: &Value| m.get("error").is_some() || m["result"]["isError"] == json!(true);
    assert!(
        answers.iter().any(|(_, m)| failed(m)),
        "both calls answered, the last after {:?}, past its 2.5 s deadline: {answers:?}\n{}",
        answers[1].0,
        host.log()
    );
    assert!(
        answers[1].0 < Duration::from_millis(3500),
        "a call ended after {:?}: {answers:?}",
        answers[1].0
    );
    // Told by the whole deadline, not by what was left of it when the executor was asked,
    // and as a deadline reached, not as an executor that could not start.
    for (_, m) in answers.iter().filter(|(_, m)| failed(m)) {
        assert!(m.to_string().contains("2.5s"), "{m}");
        assert!(!m.to_string().contains("could not be started"), "{m}");
    }
    let outcomes: Vec<Value> = host
        .records()
        .into_iter()
        .filter(|r| r["response"]["status"] != "authorized")
        .map(|r| r["response"].clone())
        .collect();
    assert!(
        !outcomes
            .iter()
            .any(|r| r.to_string().contains("executor_failed")),
        "{outcomes:?}"
    );
}

/// A principal's sessions hold at most its share of the host's `max_executors`: a call
/// that would need one more is refused in the host's words and recorded as a bound reached,
/// and once an executor stops (here by its session ending) the share has room again.
/// Before, nothing bounded executors across a principal's sessions: its 256 sessions could
/// run 8 of each server's executors apiece, enough to take memory or descriptors from
/// every other principal.
#[test]
fn a_principal_holds_its_share_of_executors_and_no_more() {
    let Some(host) = Governed::start(&[slow("slow", &[])], "max_executors = 2") else {
        return;
    };
    let (mut first, mut second) = (host.client(), host.client());
    // Long enough that the first session holds both places when the second asks, on a
    // loaded machine too.
    call(&mut first, 1, "slow/sleep", json!({"seconds": 3}));
    call(&mut first, 2, "slow/sleep", json!({"seconds": 3}));
    std::thread::sleep(Duration::from_millis(1000));
    call(&mut second, 1, "slow/sleep", json!({"seconds": 0.1}));
    let (refused, _) = until_answer(&mut second, 1);
    assert_eq!(refused["result"]["isError"], json!(true), "{refused}");
    assert!(
        refused.to_string().contains("holds 2 executors"),
        "{refused}"
    );
    // Both answers, in whichever order they come.
    let mut answered = Vec::new();
    while answered.len() < 2 {
        let m = first.recv();
        if m.get("method").is_none() && [json!(1), json!(2)].contains(&m["id"]) {
            assert!(m["result"]["isError"] != json!(true), "{m}");
            answered.push(m["id"].clone());
        }
    }
    // The first session ends: its executors stop, and their places are free again.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut id = 2;
    loop {
        call(&mut second, id, "slow/sleep", json!({"seconds": 0.1}));
        let (m, _) = until_answer(&mut second, id);
        if m["result"]["isError"] != json!(true) {
            break;
        }
        assert!(Instant::now() < deadline, "no place came free: {m}");
        std::thread::sleep(Duration::from_millis(200));
        id += 1;
    }
    assert!(
        host.records()
            .iter()
            .any(|r| r["response"].to_string().contains("bound_reached")),
        "the refusal is recorded as a bound reached"
    );
}

/// Runs call `id` of `slow/sleep` in `steps` steps of 0.2 s with progress `token`; returns
/// the progress notifications that came before its answer (one per step).
fn progress_of_a_call(c: &mut RawClient, id: u64, token: Value, steps: u64) -> Vec<Value> {
    c.send_request(
        id,
        "tools/call",
        json!({"name": "slow/sleep", "arguments": {"seconds": 0.2 * steps as f64, "steps": steps},
               "_meta": {"progressToken": token}}),
    );
    let (answer, before) = until_answer(c, id);
    assert!(answer.get("result").is_some(), "{answer}");
    let progress: Vec<Value> = before
        .into_iter()
        .filter(|m| m["method"] == "notifications/progress")
        .collect();
    assert_eq!(progress.len(), steps as usize, "{progress:?}");
    progress
}

#[test]
fn progress_reaches_the_client_and_cancellation_reaches_the_executor() {
    let Some(host) = start() else { return };
    let mut c = host.client();
    // Progress: every notification, with the client's token, before the answer; numbers only.
    let progress = progress_of_a_call(&mut c, 1, json!("tok-1"), 4);
    for (i, p) in progress.iter().enumerate() {
        assert_eq!(p["params"]["progressToken"], "tok-1");
        assert_eq!(p["params"]["progress"], json!(i + 1));
        assert_eq!(p["params"]["total"], json!(4));
        assert!(p["params"].get("message").is_none(), "{p}");
    }

    // Cancellation: the call is not answered, and its outcome is recorded as cancelled. The
    // executor is retired whether it honours it or not (what it read is in its memory and
    // its reply was never classified); the next call gets a fresh one at once.
    for (server, acknowledged) in [("slow", true), ("stubborn", false)] {
        let t0 = Instant::now();
        call(
            &mut c,
            10,
            &format!("{server}/sleep"),
            json!({"seconds": 20, "steps": 100}),
        );
        std::thread::sleep(Duration::from_millis(400));
        c.notify(
            "notifications/cancelled",
            json!({"requestId": 10, "reason": "user stopped it"}),
        );
        call(
            &mut c,
            11,
            &format!("{server}/sleep"),
            json!({"seconds": 0.1}),
        );
        let (answer, before) = until_answer(&mut c, 11);
        assert!(answer.get("result").is_some(), "{answer}");
        assert!(before.iter().all(|m| m["id"] != json!(10)), "{before:?}");
        assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
        c.send_request(12, "ping", json!({}));
        let (pong, before) = until_answer(&mut c, 12);
        assert!(pong.get("result").is_some());
        assert!(before.iter().all(|m| m["id"] != json!(10)), "{before:?}");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let log = host.log();
            let line = log
                .lines()
                .find(|l| l.contains("call cancelled") && l.contains(&format!("server={server} ")));
            if let Some(line) = line {
                assert!(
                    line.contains(&format!("acknowledged={acknowledged}")),
                    "{line}"
                );
                break;
            }
            assert!(Instant::now() < deadline, "no cancellation line:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        }
        // The outcome record follows the cancellation's log line.
        let cancelled = || {
            host.records()
                .into_iter()
                .filter(|r| {
                    r["flowhost"]["event"] == "tool_outcome"
                        && r["tool"]["name"] == format!("{server}/sleep")
                        && r.to_string().contains("\"cancelled\"")
                })
                .count()
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while cancelled() == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(cancelled(), 1, "{:#?}", host.records());
    }
}

#[test]
fn a_cancelled_call_leaves_its_output_floor_in_the_session_label() {
    // The tool ran until the cancel, and may have read what its floor labels: the floor
    // joins the state as for a call that answered, so the executor (which serves the
    // session again) cannot carry what it read to a later call at a lower label.
    let mut labelled = slow("slow", &[]);
    labelled.output_floor = flowhost::lab::TERMS_LABEL.into();
    let Some(host) = Governed::start(&[labelled], "") else {
        return;
    };
    let mut c = host.client();
    call(
        &mut c,
        10,
        "slow/sleep",
        json!({"seconds": 20, "steps": 100}),
    );
    std::thread::sleep(Duration::from_millis(400));
    c.notify(
        "notifications/cancelled",
        json!({"requestId": 10, "reason": "user stopped it"}),
    );
    c.send_request(11, "ping", json!({}));
    let (pong, _) = until_answer(&mut c, 11);
    assert!(pong.get("result").is_some(), "{pong}");
    let outcome = || {
        host.records().into_iter().find(|r| {
            r["flowhost"]["event"] == "tool_outcome" && r.to_string().contains("\"cancelled\"")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while outcome().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let outcome = outcome().unwrap_or_else(|| panic!("{:#?}", host.records()));
    let after = outcome["flowhost"]["labels_after"].to_string();
    assert!(after.contains("harbor-goods-terms"), "{outcome:#}");
}

#[test]
fn progress_reaches_the_client_only_under_the_calls_output_label() {
    // Progress numbers are the executor's to choose: the first one reaches the client only
    // once the call's output floor is in the session's label.
    let mut labelled = slow("slow", &[]);
    labelled.output_floor = flowhost::lab::TERMS_LABEL.into();
    let Some(host) = Governed::start(&[labelled], "") else {
        return;
    };
    let mut c = host.client();
    c.send_request(
        1,
        "tools/call",
        json!({"name": "slow/sleep", "arguments": {"seconds": 3, "steps": 3},
               "_meta": {"progressToken": "tok"}}),
    );
    let first = c.recv();
    assert_eq!(first["method"], "notifications/progress", "{first}");
    c.send_request(2, "flowhost/session", json!({}));
    let (session, _) = until_answer(&mut c, 2);
    assert!(
        session["result"]["label"]
            .to_string()
            .contains("harbor-goods-terms"),
        "progress went out before the label: {session}"
    );
    let (answer, _) = until_answer(&mut c, 1);
    assert!(answer.get("result").is_some(), "{answer}");
}

#[test]
fn tools_carry_signed_output_schema_and_annotations_and_results_keep_structured_content() {
    let Some(host) = start() else { return };
    let mut c = host.client();
    let list = c.request("tools/list", json!({}));
    let tools = list["result"]["tools"].as_array().unwrap();
    let structured = tools
        .iter()
        .find(|t| t["name"] == "slow/structured")
        .unwrap();
    assert_eq!(structured["outputSchema"]["required"], json!(["answer"]));
    assert_eq!(structured["title"], "Structured answer");
    assert_eq!(structured["annotations"]["title"], "Structured answer");
    assert_eq!(structured["annotations"]["openWorldHint"], false);
    assert_eq!(structured["annotations"]["readOnlyHint"], true);
    let sleep = tools.iter().find(|t| t["name"] == "slow/sleep").unwrap();
    assert!(sleep.get("outputSchema").is_none() && sleep.get("title").is_none());

    let r = c.request(
        "tools/call",
        json!({"name": "slow/structured", "arguments": {}}),
    );
    assert_eq!(
        r["result"]["structuredContent"],
        json!({"answer": 42}),
        "{r}"
    );
}

#[test]
fn input_failing_the_schema_is_a_tool_error_and_refusals_carry_their_denial() {
    let Some(host) = start() else { return };
    let mut c = host.client();
    let r = c.request(
        "tools/call",
        json!({"name": "slow/sleep", "arguments": {"seconds": "soon"}}),
    );
    assert_eq!(r["result"]["isError"], true, "{r}");
    let text = r["result"]["content"][0]["text"].as_str().unwrap();
    assert!(
        text.contains("seconds") && text.contains("inputSchema"),
        "{text}"
    );
    let refused = host
        .records()
        .into_iter()
        .filter(|r| r.to_string().contains("schema_invalid"))
        .count();
    assert_eq!(refused, 1, "{:#?}", host.records());

    // An unknown tool is refused with its denial, under a code the SDKs do not reserve.
    let r = c.request("tools/call", json!({"name": "slow/nope", "arguments": {}}));
    assert_eq!(r["error"]["data"]["denial"], "unknown_tool", "{r}");
    let code = r["error"]["code"].as_i64().unwrap();
    assert!(![-32000, -32001, -32002, -32042].contains(&code), "{r}");

    // Before initialize: refused with its denial, not with the SDKs' timeout code.
    let mut raw = RawClient::connect(&host.socket);
    let r = raw.request("tools/list", json!({}));
    assert_eq!(r["error"]["data"]["denial"], "not_initialized", "{r}");
    let code = r["error"]["code"].as_i64().unwrap();
    assert!(![-32000, -32001, -32002, -32042].contains(&code), "{r}");
}

#[test]
fn the_newest_revision_both_sides_speak_is_negotiated() {
    let Some(host) = start() else { return };
    for (asked, agreed) in [
        ("2025-06-18", "2025-06-18"),
        ("2025-03-26", "2025-03-26"),
        ("2024-11-05", "2024-11-05"),
        ("2099-01-01", "2025-06-18"),
    ] {
        let mut c = RawClient::connect(&host.socket);
        let r = c.request(
            "initialize",
            json!({"protocolVersion": asked, "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}),
        );
        assert_eq!(r["result"]["protocolVersion"], agreed, "{r}");
    }
}

#[test]
fn executors_speak_a_revision_the_host_speaks_or_are_refused_naming_their_server() {
    if !common::is_root() {
        eprintln!("SKIP: the daemon tests need root for the broker");
        return;
    }
    // An executor that answers an older revision the host speaks serves.
    let host = Governed::start(&[slow("older", &["--revision", "2024-11-05"])], "").unwrap();
    let r = host.client().request(
        "tools/call",
        json!({"name": "older/structured", "arguments": {}}),
    );
    assert_eq!(r["result"]["structuredContent"]["answer"], 42, "{r}");
    drop(host);
    let result = std::panic::catch_unwind(|| {
        Governed::start(&[slow("future", &["--revision", "2099-01-01"])], "")
    });
    let message = match result {
        Err(e) => e.downcast_ref::<String>().cloned().unwrap_or_default(),
        Ok(_) => panic!("the daemon started with an executor it cannot speak to"),
    };
    assert!(
        message.contains("\"future\"") && message.contains("2099-01-01"),
        "{message}"
    );
}

#[test]
fn the_log_has_a_line_per_call_and_tagged_executor_stderr_without_colour() {
    let Some(mut host) = start() else { return };
    let mut c = host.client();
    let r = c.request(
        "tools/call",
        json!({"name": "slow/chatter", "arguments": {"lines": 200}}),
    );
    assert!(r.get("result").is_some(), "{r}");
    let r = c.request("tools/call", json!({"name": "slow/nope", "arguments": {}}));
    assert!(r.get("error").is_some(), "{r}");
    drop(c);
    std::thread::sleep(Duration::from_millis(300));
    host.stop();
    let log = host.log();
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log file:\n{log}"
    );
    let call = log
        .lines()
        .find(|l| l.contains("tools/call") && l.contains("slow/chatter"))
        .unwrap_or_else(|| panic!("no call line:\n{log}"));
    for field in ["principal=tester", "verdict=\"succeeded\"", "duration_ms="] {
        assert!(call.contains(field), "{field} missing: {call}");
    }
    assert!(
        log.lines()
            .any(|l| l.contains("slow/nope") && l.contains("reason=\"unknown_tool\"")),
        "{log}"
    );
    let stderr: Vec<&str> = log.lines().filter(|l| l.contains("chatter line")).collect();
    assert!(!stderr.is_empty(), "{log}");
    assert!(
        stderr
            .iter()
            .all(|l| l.contains("server=slow") && l.contains("tool=slow/chatter")),
        "{stderr:?}"
    );
    // Bounded: a chatty executor cannot flood the log.
    assert!(stderr.len() < 100, "{} stderr lines logged", stderr.len());
    assert!(
        log.contains("reached the limit of 64 lines per call"),
        "{log}"
    );
    for line in [
        "ready: serving",
        "session opened",
        "session closed",
        "stopping",
        "stopped",
    ] {
        assert!(log.contains(line), "no {line:?} line:\n{log}");
    }
}

/// Whether the host logs the cancellation of a call to `server` within `within`.
fn cancellation_logged(host: &Governed, server: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if host
            .log()
            .lines()
            .any(|l| l.contains("call cancelled") && l.contains(&format!("server={server} ")))
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A client of `host` with call `id` (20 s of `slow/sleep`) under way.
fn with_a_long_call(host: &Governed, id: u64) -> RawClient {
    let mut c = host.client();
    call(
        &mut c,
        id,
        "slow/sleep",
        json!({"seconds": 20, "steps": 100}),
    );
    std::thread::sleep(Duration::from_millis(400));
    c
}

/// A call the client cancels while its authorization is still being recorded never
/// reaches an executor: the cancellation wins over taking an executor and over sending the
/// request. Before, each of those two steps raced it, so about one such call in four was
/// sent to the tool (which could egress, judged against the call, until it acknowledged).
#[test]
fn a_call_cancelled_before_dispatch_never_reaches_an_executor() {
    let Some(host) = start() else { return };
    let mut c = host.client();
    const CALLS: u64 = 24;
    for id in 1..=CALLS {
        // In one write: the cancellation is read while the call's authorization is still
        // being recorded.
        c.send_together(&[
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                   "params": {"name": "slow/sleep", "arguments": {"seconds": 5}}}),
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": id, "reason": "changed my mind"}}),
        ]);
    }
    let outcomes = || {
        host.records()
            .iter()
            .filter(|r| {
                r["flowhost"]["event"] == "tool_outcome" && r.to_string().contains("\"cancelled\"")
            })
            .count() as u64
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while outcomes() < CALLS {
        assert!(Instant::now() < deadline, "{:#?}", host.records());
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = host
        .log()
        .lines()
        .filter(|l| l.contains("call cancelled") && l.contains("server=slow "))
        .count();
    assert_eq!(
        sent,
        0,
        "cancelled calls reached an executor:\n{}",
        host.log()
    );
}

/// An executor's ping is answered whenever it comes: sent right after `initialize` or
/// between calls too (read when the executor is next taken). Before, only a ping sent
/// during a call was, and the others were refused as requests the host relays to no
/// client, which a server that follows MCP reads as a broken link.
#[test]
fn an_executor_ping_is_answered_when_it_serves_no_call() {
    let Some(host) = one_warm("pinging", &["--ping"]) else {
        return;
    };
    let mut c = host.client();
    // What an executor sends between calls is read when it is next taken.
    for id in [1, 2] {
        call(&mut c, id, "pinging/structured", json!({}));
        let (answer, _) = until_answer(&mut c, id);
        assert!(answer["error"].is_null(), "{answer}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let answered = |ping: &str| {
        host.log().lines().any(|l| {
            l.contains(&format!("executor stderr: request \"{ping}")) && l.contains("answered: {}")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(answered("ping-initialize") && answered("ping-after-")) {
        assert!(Instant::now() < deadline, "{}", host.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!host.log().contains("refused"), "{}", host.log());
}

/// Log lines an executor writes between calls are not the next call's: they are dropped
/// (they would carry no call's label), however many. Before, only those the daemon had
/// already taken when the next call began were; the rest were relayed as that call's.
#[test]
fn log_lines_written_between_calls_are_never_the_next_calls() {
    let Some(host) = one_warm("talkative", &["--log-after-call", "40"]) else {
        return;
    };
    let mut c = host.client();
    call(&mut c, 1, "talkative/structured", json!({}));
    let (answer, _) = until_answer(&mut c, 1);
    assert!(answer["error"].is_null(), "{answer}");
    // The forty lines are written now, while it serves nothing.
    std::thread::sleep(Duration::from_millis(500));
    call(&mut c, 2, "talkative/structured", json!({}));
    let (answer, before) = until_answer(&mut c, 2);
    assert!(answer["error"].is_null(), "{answer}");
    let idle: Vec<_> = before
        .iter()
        .filter(|m| m.to_string().contains("idle line"))
        .collect();
    assert!(
        idle.is_empty(),
        "{} idle lines relayed: {idle:?}",
        idle.len()
    );
}

/// A request read before `initialize` is refused even when `initialize` follows at once:
/// before, the check ran in the request's own task, which often ran after the
/// `initialize` read behind it was answered, and the call was served.
#[test]
fn a_call_sent_ahead_of_initialize_is_refused() {
    let Some(host) = start() else { return };
    let mut c = RawClient::connect(&host.socket);
    c.send_together(&[
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "slow/structured", "arguments": {}}}),
        json!({"jsonrpc": "2.0", "id": 2, "method": "initialize",
               "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                          "clientInfo": {"name": "test", "version": "0"}}}),
    ]);
    let (answer, _) = until_answer(&mut c, 1);
    assert_eq!(
        answer["error"]["data"]["denial"], "not_initialized",
        "{answer}"
    );
    let (answer, _) = until_answer(&mut c, 2);
    assert!(answer.get("result").is_some(), "{answer}");
}

/// An executor that never stops talking is waited on only briefly before the next call
/// goes to it: before, each line it wrote between calls made the call wait for it to go
/// quiet, so a call to it ran into its deadline.
#[test]
fn an_executor_that_never_goes_quiet_still_serves_calls() {
    let Some(host) = one_warm("chatty", &["--log-every-ms", "1"]) else {
        return;
    };
    let mut c = host.client();
    for id in [1, 2] {
        let started = Instant::now();
        call(&mut c, id, "chatty/structured", json!({}));
        let (answer, _) = until_answer(&mut c, id);
        assert!(answer["error"].is_null(), "{answer}");
        assert_eq!(
            answer["result"]["structuredContent"]["answer"], 42,
            "{answer}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "call {id} took {:?}",
            started.elapsed()
        );
    }
}

/// A request the executor made during a call and still awaits when it answers the call is
/// answered then, with an error saying the call ended (the client is told its request is
/// cancelled). Before, the executor got no answer at all and served later calls with the
/// request open for good.
#[test]
fn a_request_left_open_by_the_calls_answer_is_answered_once() {
    let mut s = slow("asking", &[]);
    s.extra = "pool_size = 1".into();
    s.input_clearances = format!("[{}]", flowhost::lab::BOTTOM_LABEL);
    let Some(host) = Governed::start(&[s], "") else {
        return;
    };
    let mut c = RawClient::connect(&host.socket);
    let r = c.request(
        "initialize",
        json!({"protocolVersion": "2025-06-18", "capabilities": {"sampling": {}},
               "clientInfo": {"name": "test", "version": "0"}}),
    );
    assert!(r.get("result").is_some(), "{r}");
    c.notify("notifications/initialized", json!({}));
    call(&mut c, 1, "asking/ask_then_answer", json!({}));
    let (answer, before) = until_answer(&mut c, 1);
    assert!(answer["error"].is_null(), "{answer}");
    // The client saw the request, never answers it, and is told it is cancelled.
    let deadline = Instant::now() + Duration::from_secs(10);
    let refused = || {
        host.log()
            .lines()
            .filter(|l| l.contains("executor stderr: request \"ask-") && l.contains("refused"))
            .count()
    };
    while refused() == 0 {
        assert!(Instant::now() < deadline, "{before:?}\n{}", host.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(refused(), 1, "{}", host.log());
    assert!(host.log().contains("has ended"), "{}", host.log());
}

/// Starts eight calls of 6 s on `host`'s server `slow` and queues three more behind them
/// (eight run at once per server and session), runs `withdraw` (which has the host withdraw
/// something and waits until it has), and checks that the three queued are refused, saying
/// `refused`, while the eight running finish on the generation they started with.
fn queued_calls_are_refused_after(host: &Governed, withdraw: impl FnOnce(), refused: &str) {
    let mut c = host.client();
    const RUNNING: u64 = 8;
    const QUEUED: u64 = 3;
    for id in 1..=RUNNING + QUEUED {
        call(&mut c, id, "slow/sleep", json!({"seconds": 6}));
    }
    // Time for the eight to be given their executors, well within their six seconds.
    std::thread::sleep(Duration::from_millis(2500));
    withdraw();
    let mut answers = std::collections::BTreeMap::new();
    while answers.len() < (RUNNING + QUEUED) as usize {
        let m = c.recv();
        if let Some(id) = m["id"].as_u64() {
            answers.insert(id, m);
        }
    }
    let withdrawn: Vec<u64> = answers
        .iter()
        .filter(|(_, m)| m.to_string().contains(refused))
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(withdrawn.len() as u64, QUEUED, "{answers:#?}");
    let finished = answers
        .values()
        .filter(|m| m["error"].is_null() && m["result"]["isError"] != json!(true))
        .count() as u64;
    assert_eq!(finished, RUNNING, "{answers:#?}");
}

/// Waits until `host`'s log says `said`.
fn logged(host: &Governed, said: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !host.log().contains(said) {
        assert!(Instant::now() < deadline, "no {said:?}:\n{}", host.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A reload that takes out the key vouching for a server withdraws it, also from the
/// requests already admitted and still queued behind its running calls: before, each ran
/// once a running call made room, on an executor the server's drained warm pool started
/// again for it.
#[test]
fn requests_queued_for_a_withdrawn_server_are_not_served() {
    let Some(host) = one_warm("slow", &[]) else {
        return;
    };
    let withdraw = || {
        std::fs::remove_file(host.key_of("slow")).unwrap();
        host.signal(libc::SIGHUP);
        logged(&host, "server \"slow\" withdrawn from service");
    };
    queued_calls_are_refused_after(&host, withdraw, "withdrawn from service");
}

/// A reload that takes a tool from the session's principal, or maps its peer to no
/// principal, withdraws the requests already admitted and still queued: before, only a
/// withdrawn server was checked again, and the queued calls ran once a running call made
/// room.
#[test]
fn requests_queued_for_a_withdrawn_principal_are_not_served() {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    for (from, to) in [
        ("tools = [\"slow/*\"]", "tools = [\"slow/structured\"]"),
        (&*format!("uids = [{uid}]"), "uids = [4242]"),
    ] {
        let Some(host) = one_warm("slow", &[]) else {
            return;
        };
        let withdraw = || {
            let config = host.dir.path().join("host.toml");
            let text = std::fs::read_to_string(&config).unwrap();
            assert!(text.contains(from), "{text}");
            std::fs::write(&config, text.replacen(from, to, 1)).unwrap();
            host.signal(libc::SIGHUP);
            // (What it takes out is withdrawn first, in a generation of its own.)
            logged(&host, "reloaded: generation 3");
        };
        queued_calls_are_refused_after(&host, withdraw, "principal, or its use of this");
        // Recorded as what they are, not as executors that failed to start.
        let refused = host
            .records()
            .iter()
            .filter(|r| {
                r["flowhost"]["event"] == "tool_outcome"
                    && r["response"]["status"] == "access_withdrawn"
                    && r["flowhost"]["denial_kind"] == "access_denied"
            })
            .count();
        assert_eq!(refused, 3, "{:#?}", host.records());
    }
}

/// Once a call is cancelled, its executor's egress is refused (`no_call_in_flight`), even
/// to a destination the call could reach: before, attempts during the grace the executor
/// is given to acknowledge were still judged against the cancelled call, and carried out.
#[test]
fn an_executor_cannot_egress_once_its_call_is_cancelled() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut late = slow("late", &["--ignore-cancel", "--connect-on-cancel", &addr]);
    late.profile = "brokered".into();
    late.input_clearances = format!("[{}]", flowhost::lab::BOTTOM_LABEL);
    late.extra = format!("pool_size = 1\ndestinations = {{ allow = [\"{addr}\"] }}");
    let Some(host) = Governed::start(&[late], "") else {
        return;
    };
    let mut c = host.client();
    call(&mut c, 1, "late/sleep", json!({"seconds": 4}));
    std::thread::sleep(Duration::from_millis(500));
    c.notify(
        "notifications/cancelled",
        json!({"requestId": 1, "reason": "stop"}),
    );
    assert!(
        cancellation_logged(&host, "late", Duration::from_secs(5)),
        "{}",
        host.log()
    );
    assert!(
        host.log().contains("connect on cancel: Err("),
        "the executor's connect after the cancellation was not refused:\n{}",
        host.log()
    );
    assert!(listener.accept().is_err(), "the connection arrived");
    let records = host.records();
    let refused: Vec<&Value> = records
        .iter()
        .filter(|r| r["flowhost"]["denial_kind"] == "no_call_in_flight")
        .collect();
    assert!(!refused.is_empty(), "{records:#?}");
    // No call, so no declaration was consulted: the record claims none (before, it said
    // the declaration was false, and the diff reported undeclared egress).
    assert!(
        refused
            .iter()
            .all(|r| r["flowhost"]["egress_basis"].is_null()),
        "{refused:#?}"
    );
}

/// A client that goes away (closes its socket) has its calls cancelled at once, as its
/// cancellation would: they do not run on, holding executors, until their deadline.
#[test]
fn a_client_that_disconnects_has_its_calls_cancelled() {
    let Some(host) = start() else { return };
    let c = with_a_long_call(&host, 10);
    drop(c);
    assert!(
        cancellation_logged(&host, "slow", Duration::from_secs(5)),
        "the call ran on after its client went away:\n{}",
        host.log()
    );
}

/// A request id in flight is refused for every method, not only for calls: a `ping` that
/// reused a running call's id took its place, and the call could no longer be cancelled.
/// The refusal carries a null id: the id's answer is the call's, still to come (before, the
/// client got two answers for id 10, the refusal first).
#[test]
fn an_id_in_flight_is_refused_for_every_method() {
    let Some(host) = start() else { return };
    let mut c = with_a_long_call(&host, 10);
    c.send_request(10, "ping", json!({}));
    let answer = loop {
        let m = c.recv();
        assert_ne!(m["id"], 10, "an answer for id 10 before the call's: {m}");
        if m["id"].is_null() && m.get("error").is_some() {
            break m;
        }
    };
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("already in flight")),
        "{answer}"
    );
    // Like every refusal: its denial told, and a record of it (before, neither).
    assert_eq!(answer["error"]["data"]["denial"], "request_id_in_flight");
    let recorded = || {
        host.records().into_iter().any(|r| {
            r["tool"]["name"] == "(ping)" && r["flowhost"]["denial_kind"] == "request_id_in_flight"
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !recorded() {
        assert!(
            std::time::Instant::now() < deadline,
            "{:#?}",
            host.records()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    c.notify(
        "notifications/cancelled",
        json!({"requestId": 10, "reason": "user stopped it"}),
    );
    // Cancelled, the call is never answered: a request reusing its id at once is answered
    // under that id (refused while the call winds down, or served), never with a null id
    // that a client waiting on id 10 (over HTTP, its POST) would wait past for good.
    c.send_request(10, "ping", json!({}));
    let answer = loop {
        let m = c.recv();
        assert!(!m["id"].is_null(), "a null-id answer after the cancel: {m}");
        if m["id"] == 10 {
            break m;
        }
    };
    assert!(
        answer.get("result").is_some()
            || answer["error"]["data"]["denial"] == "request_id_in_flight",
        "{answer}"
    );
    assert!(
        cancellation_logged(&host, "slow", Duration::from_secs(5)),
        "the call could not be cancelled any more:\n{}",
        host.log()
    );
}

/// While the session ends (the host stopping), a request reusing the id of a call still in
/// flight is refused with a null id, as while it ran: the id's answer is the call's. Before,
/// the refusal carried the id, and the client got two answers for it, the refusal first.
#[test]
fn an_id_in_flight_is_refused_while_the_session_ends() {
    let Some(mut host) = start() else { return };
    let mut c = host.client();
    call(&mut c, 10, "slow/sleep", json!({"seconds": 3, "steps": 30}));
    std::thread::sleep(Duration::from_millis(400));
    host.signal(libc::SIGTERM);
    // Sent once the stop is under way: before it, the running session refuses the same way.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !host.log().contains("stopping: finishing calls in flight") {
        assert!(std::time::Instant::now() < deadline, "{}", host.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    c.send_request(10, "ping", json!({}));
    let refusal = loop {
        let m = c.recv();
        assert!(
            m["id"] != 10 || m.get("result").is_some_and(|r| r.get("content").is_some()),
            "an answer for id 10 other than the call's: {m}"
        );
        if m["id"].is_null() && m.get("error").is_some() {
            break m;
        }
    };
    assert_eq!(
        refusal["error"]["data"]["denial"], "request_id_in_flight",
        "{refusal}"
    );
    host.stop();
}

/// At the limit of requests in flight the session still reads: a further request is refused
/// at once, and cancellations (and answers to the host's own requests) still arrive. Before,
/// it read nothing more, so a cancellation waited behind the very calls it would end.
#[test]
fn at_the_limit_of_requests_in_flight_the_session_still_reads() {
    let Some(host) = start() else { return };
    let mut c = host.client();
    let limit = 64;
    for id in 100..100 + limit {
        call(
            &mut c,
            id,
            "slow/sleep",
            json!({"seconds": 20, "steps": 100}),
        );
    }
    std::thread::sleep(Duration::from_millis(400));
    let t0 = Instant::now();
    c.send_request(1, "ping", json!({}));
    let (answer, _) = until_answer(&mut c, 1);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("at most 64 requests")),
        "{answer}"
    );
    assert_eq!(answer["error"]["data"]["denial"], "request_limit");
    for id in 100..100 + limit {
        c.notify(
            "notifications/cancelled",
            json!({"requestId": id, "reason": "enough"}),
        );
    }
    assert!(
        cancellation_logged(&host, "slow", Duration::from_secs(5)),
        "no call was cancelled:\n{}",
        host.log()
    );
    assert!(
        host.records()
            .iter()
            .any(|r| r["tool"]["name"] == "(ping)"
                && r["flowhost"]["denial_kind"] == "request_limit"),
        "{:#?}",
        host.records()
    );
}

/// An executor made ready for a call (bound to the session, given the client's logging
/// level) has not run the tool, so nothing it says then is labelled as the call's output:
/// the client is told the host's words only, and the executor's go to the host's log.
/// Before, its error object (here a `logging/setLevel` answer whose `code` is no integer,
/// carrying what it read) reached the client in the call's `isError` text with no label
/// raised.
#[test]
fn an_executor_failing_before_the_call_reaches_it_tells_the_client_nothing_of_its_own() {
    let leaked = "HUSH-4711 the file the executor read";
    let Some(host) = Governed::start(&[slow("leaky", &["--set-level-error", leaked])], "") else {
        return;
    };
    let mut c = host.client();
    // No executor is bound to the session yet: the level is sent to the one the call binds.
    let r = c.request("logging/setLevel", json!({"level": "debug"}));
    assert_eq!(r["result"], json!({}), "{r}");
    let r = c.request(
        "tools/call",
        json!({"name": "leaky/structured", "arguments": {}}),
    );
    assert_eq!(r["result"]["isError"], true, "{r}");
    assert!(!r.to_string().contains("HUSH-4711"), "{r}");
    let text = r["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(
        text.contains("\"leaky\"") && text.contains("host's log"),
        "{text}"
    );
    let log = host.log();
    assert!(
        log.lines()
            .any(|l| l.contains("server=leaky") && l.contains("HUSH-4711")),
        "the operator is not told what the executor said:\n{log}"
    );
}

/// The executor's stderr lines the host has logged so far that contain `needle`.
fn executor_said(host: &Governed, needle: &str) -> Vec<String> {
    host.log()
        .lines()
        .filter(|l| l.contains("executor stderr") && l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// A call's progress token and its cancellation's reason are the client's text, which the
/// host classifies only in `arguments`: the executor gets a progress token the host issued
/// (the client's own comes back on its progress) and the host's reason, never the client's
/// words. Before, both reached the executor as the client sent them, so a token could carry
/// what the classifier would have kept from a low-clearance tool.
#[test]
fn the_executor_sees_neither_the_clients_progress_token_nor_its_cancel_reason() {
    let Some(host) = start() else { return };
    let mut c = host.client();
    for p in progress_of_a_call(&mut c, 1, json!("HUSH-1 token"), 2) {
        assert_eq!(p["params"]["progressToken"], "HUSH-1 token", "{p}");
    }

    call(
        &mut c,
        2,
        "slow/sleep",
        json!({"seconds": 20, "steps": 100}),
    );
    std::thread::sleep(Duration::from_millis(400));
    c.notify(
        "notifications/cancelled",
        json!({"requestId": 2, "reason": "HUSH-2 reason"}),
    );
    assert!(
        cancellation_logged(&host, "slow", Duration::from_secs(5)),
        "{}",
        host.log()
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while (executor_said(&host, "progress token:").is_empty()
        || executor_said(&host, "cancel reason:").is_empty())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let tokens = executor_said(&host, "progress token:");
    let reasons = executor_said(&host, "cancel reason:");
    assert!(!tokens.is_empty() && !reasons.is_empty(), "{}", host.log());
    for line in tokens.iter().chain(&reasons) {
        assert!(
            !line.contains("HUSH-"),
            "the executor saw the client's text: {line}"
        );
    }
}

/// A call running across reloads is judged by its principal's per-origin rules as far as
/// every later configuration still gives them: one reload taking an allow out refuses the
/// call's next connect, and so do two where the first keeps it. Before, only the generation
/// a reload replaced was narrowed, so a call two reloads old kept the allow.
#[test]
fn a_call_running_across_reloads_loses_the_per_origin_allows_taken_out() {
    let relay = flowhost::lab::Relay::start().unwrap();
    let addr = relay.addr.to_string();
    let mut far = slow("far", &["--connect-after-sleep", &addr]);
    far.profile = "brokered".into();
    far.input_clearances = format!("[{}]", flowhost::lab::BOTTOM_LABEL);
    far.extra = "pool_size = 1".into();
    let Some(host) = Governed::start(&[far], "") else {
        return;
    };
    let config_path = host.dir.path().join("host.toml");
    let without = std::fs::read_to_string(&config_path).unwrap();
    let with = without.replacen(
        "[[principal]]\nid = \"tester\"\n",
        &format!("[[principal]]\nid = \"tester\"\ndestinations = {{ allow = [\"{addr}\"] }}\n"),
        1,
    );
    assert_ne!(with, without);
    // Counted by their lines: a reload that takes something out withdraws it first, in a
    // generation of its own.
    let mut reloads = 0;
    let mut reload_to = |text: &str| {
        std::fs::write(&config_path, text).unwrap();
        host.signal(libc::SIGHUP);
        reloads += 1;
        let deadline = Instant::now() + Duration::from_secs(20);
        while host.log().matches("reloaded: generation").count() < reloads {
            assert!(
                Instant::now() < deadline,
                "no reload {reloads}:\n{}",
                host.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut c = host.client();
    let answer_text = |c: &mut RawClient, id: u64| {
        let (m, _) = until_answer(c, id);
        m["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("{m}"))
            .to_string()
    };

    // The allow in force: a call's late connect reaches the relay.
    reload_to(&with);
    call(&mut c, 1, "far/sleep", json!({"seconds": 0.1}));
    let reached = answer_text(&mut c, 1);
    assert!(reached.contains("connect: Ok(())"), "{reached}");

    // Taken out while a call runs: its connect is refused.
    call(&mut c, 2, "far/sleep", json!({"seconds": 3}));
    std::thread::sleep(Duration::from_millis(300));
    reload_to(&without);
    let one = answer_text(&mut c, 2);
    assert!(one.contains("connect: Err("), "one reload: {one}");

    // Kept by a first reload, taken out by a second, while a call runs: refused too.
    reload_to(&with);
    call(&mut c, 3, "far/sleep", json!({"seconds": 5}));
    std::thread::sleep(Duration::from_millis(300));
    reload_to(&format!("{with}\n# the same rules\n"));
    reload_to(&without);
    let two = answer_text(&mut c, 3);
    assert!(two.contains("connect: Err("), "two reloads: {two}");
    assert_eq!(relay.connections(), 1, "{}", host.log());
}

/// A client that sent its requests and ended its input, and a daemon killed while it served
/// them: the bridge saw the daemon close after the client's end, took it for a finished
/// session, and exited 0.
#[test]
fn flowhost_connect_fails_when_the_daemon_closes_with_requests_unanswered() {
    let Some(host) = one_warm("slow", &[]) else {
        return;
    };
    let mut client = std::process::Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["connect", "--socket"])
        .arg(&host.socket)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = client.stdin.take().unwrap();
    let requests = [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}}),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
               "params": {"name": "slow/sleep", "arguments": {"seconds": 30}}}),
        json!({"jsonrpc": "2.0", "id": "three", "method": "tools/call",
               "params": {"name": "slow/sleep", "arguments": {"seconds": 30}}}),
    ];
    for r in &requests {
        std::io::Write::write_all(&mut stdin, format!("{r}\n").as_bytes()).unwrap();
    }
    drop(stdin);
    // Until both calls are running: the daemon has read every byte, so its death is a
    // plain end of the connection, not a reset.
    let deadline = Instant::now() + Duration::from_secs(30);
    while host
        .records()
        .iter()
        .filter(|r| r["tool"]["name"] == "slow/sleep")
        .count()
        < 2
    {
        assert!(Instant::now() < deadline, "{}", host.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    host.signal(libc::SIGKILL);
    let out = client.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "flowhost connect exited {}",
        out.status
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("closed the connection with 2 of the client's requests unanswered")
            && stderr.contains("(id \"three\", 2)"),
        "{stderr}"
    );
    // Answered before the end: only the calls are owed.
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"id\":1"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
