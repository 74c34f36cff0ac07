//! A third-party Python MCP server that makes real HTTP requests (`mcp-server-fetch` from
//! PyPI, installed by `.ci/install-interop`), governed by the real daemon: once with
//! `egress: false` (its lookup and its connect are refused, recorded, and the local HTTP
//! server receives nothing), once with a clearance and a host-name rule (the name resolves
//! through the host's mediation to a DNS server this test runs on loopback, the fetch
//! succeeds, and the egress record carries the name).

mod common;

use std::path::Path;

use common::lab::Client;
use common::named::{BODY, Daemon, Served, TestDns, TestHttp, tool};
use serde_json::{Value, json};

const FETCH: &str = "/opt/flowhost-interop/venv/bin/mcp-server-fetch";

/// The fetch server governed with `egress` as its manifest declares: without egress it runs
/// with no network path (an empty network namespace), where every attempt is still stopped
/// at the syscall, judged and recorded; with egress, on the host network with a clearance
/// and the rule `fetch.test:PORT`.
fn fetch_daemon(egress: bool, dns: &TestDns, http: &TestHttp) -> Daemon {
    let tools = json!([tool(
        "fetch",
        json!({
            "type": "object",
            "properties": {
                "url": {"type": "string", "minLength": 1, "maxLength": 2000},
                "raw": {"type": "boolean"}
            },
            "required": ["url"],
            "additionalProperties": false
        }),
        egress
    )]);
    Daemon::start(
        dns,
        Served {
            id: "fetch",
            tool: "fetch",
            tools,
            command: vec![FETCH.into(), "--ignore-robots-txt".into()],
            profile: if egress { "brokered" } else { "isolated" },
            read_path: "/opt/flowhost-interop".into(),
            allow: format!("fetch.test:{}", http.port),
            cleared: egress,
            // TestDns answers fetch.test with 127.0.0.1.
            private_answers: vec!["fetch.test".into()],
        },
    )
}

fn flowhost_ext(r: &Value) -> &Value {
    &r["flowhost"]
}

fn skip() -> bool {
    if !common::is_root() {
        eprintln!("SKIP: the daemon tests need root for the broker (CI runs them as root)");
        return true;
    }
    if !common::third_party(Path::new(FETCH)) {
        return true;
    }
    false
}

fn fetch(client: &mut Client, url: &str) -> Value {
    client.call("fetch/fetch", json!({"url": url, "raw": true}))
}

#[test]
fn fetch_server_with_egress_false_is_refused_at_the_syscall() {
    if skip() {
        return;
    }
    let (dns, http) = (TestDns::start(), TestHttp::start());
    let daemon = fetch_daemon(false, &dns, &http);
    let mut client = daemon.client();

    let by_name = fetch(&mut client, &format!("http://fetch.test:{}/", http.port));
    assert!(
        !by_name.to_string().contains(BODY),
        "{by_name}\n{}",
        daemon.log()
    );
    let by_address = fetch(&mut client, &format!("http://127.0.0.1:{}/", http.port));
    assert!(!by_address.to_string().contains(BODY), "{by_address}");
    assert_eq!(http.connections(), 0, "the HTTP server received nothing");
    assert!(!daemon.egress_records().is_empty());
    assert_eq!(
        dns.asked("fetch.test."),
        0,
        "a refused lookup never leaves the host"
    );

    let records = daemon.egress_records();
    let text = serde_json::to_string_pretty(&records).unwrap();
    // The lookup: its query to the host's resolver refused at the syscall, recorded.
    assert!(
        records
            .iter()
            .any(|r| flowhost_ext(r)["broker"]["destination"]["port"] == 53),
        "{text}\n{}",
        daemon.log()
    );
    // The connect to the literal address: refused at the syscall, recorded.
    assert!(
        records.iter().any(|r| {
            let b = &flowhost_ext(r)["broker"];
            b["syscall"] == "connect"
                && b["destination"]["address"] == "127.0.0.1"
                && b["destination"]["port"] == http.port
        }),
        "{text}"
    );
    assert!(
        records.iter().all(|r| r["decision"]["effect"] == "deny"),
        "{text}"
    );
    assert!(
        records
            .iter()
            .all(|r| flowhost_ext(r)["denial_kind"] == "missing_clearance"),
        "{text}"
    );
}

#[test]
fn fetch_server_reaches_a_named_destination_through_the_hosts_resolver() {
    if skip() {
        return;
    }
    let (dns, http) = (TestDns::start(), TestHttp::start());
    let daemon = fetch_daemon(true, &dns, &http);
    let mut client = daemon.client();

    // An address of the allowed name, hard-coded (no lookup): address rules alone judge it.
    let literal = fetch(&mut client, &format!("http://127.0.0.1:{}/", http.port));
    assert!(!literal.to_string().contains(BODY), "{literal}");
    assert_eq!(http.connections(), 0);

    // A name no rule allows does not resolve, and never reaches the upstream resolver.
    let other = fetch(&mut client, &format!("http://other.test:{}/", http.port));
    assert!(!other.to_string().contains(BODY), "{other}");
    assert_eq!(dns.asked("other.test."), 0);

    // The allowed name resolves through the host and the fetch succeeds.
    let ok = fetch(&mut client, &format!("http://fetch.test:{}/", http.port));
    assert!(ok.to_string().contains(BODY), "{ok}\n{}", daemon.log());
    assert_eq!(http.connections(), 1);
    assert!(dns.asked("fetch.test.") >= 1);

    let records = daemon.egress_records();
    let text = serde_json::to_string_pretty(&records).unwrap();
    let broker = |r: &Value| flowhost_ext(r)["broker"].clone();
    let connects: Vec<Value> = records
        .iter()
        .filter(|r| broker(r)["syscall"] == "connect")
        .cloned()
        .collect();
    assert_eq!(connects.len(), 2, "{text}");
    assert!(
        !text.contains("nscd"),
        "glibc's nscd connects are not egress records: {text}"
    );
    assert!(
        broker(&connects[0])["destination"]
            .get("host_name")
            .is_none(),
        "{text}"
    );
    assert_eq!(
        flowhost_ext(&connects[0])["denial_kind"],
        "destination_blocked",
        "{text}"
    );
    assert_eq!(
        broker(&connects[1])["destination"]["host_name"],
        "fetch.test",
        "{text}"
    );
    assert_eq!(broker(&connects[1])["destination"]["address"], "127.0.0.1");
    assert_eq!(connects[1]["decision"]["effect"], "allow", "{text}");
    assert!(
        records.iter().any(|r| broker(r)["syscall"] == "dns_query"
            && broker(r)["destination"]["host_name"] == "other.test"
            && flowhost_ext(r)["denial_kind"] == "name_not_allowed"),
        "{text}"
    );
    assert!(
        records.iter().any(|r| broker(r)["syscall"] == "dns_query"
            && broker(r)["destination"]["host_name"] == "fetch.test"
            && r["decision"]["effect"] == "allow"),
        "the answered lookup is recorded: {text}"
    );
    // No other egress was recorded: the sends to the host's resolver are not egress
    // records (the lookups are).
    let lookups = records
        .iter()
        .filter(|r| broker(r)["syscall"] == "dns_query")
        .count();
    assert_eq!(records.len(), connects.len() + lookups, "{text}");
}
