//! Name lookups the way Node does them, under the real daemon: `dns.lookup` (glibc's
//! getaddrinfo on libuv's thread pool) and `dns.resolve4` (c-ares, which accepts a reply only
//! from the server address it sent the query to) both reach the executor's own resolver and
//! get the allowed name's address; a name no rule allows fails with ENOTFOUND under both;
//! a connect to the address the lookup handed out is recorded with the name, and so is
//! every lookup.

mod common;

use common::named::{BODY, Daemon, NODE, Served, TestDns, TestHttp, tool};
use serde_json::{Value, json};

/// A minimal MCP stdio server (no dependencies): one tool, `probe`, that looks `name` up
/// with `how` (`lookup` or `resolve4`) and, if that worked, fetches `http://name:port/`
/// through the address it got.
const SERVER_JS: &str = r#"
const dns = require('dns');
const net = require('net');
const readline = require('readline');
const send = (m) => process.stdout.write(JSON.stringify(m) + '\n');
async function probe({ name, how, port }) {
  if (how === 'two') {
    // Two questions in one query, sent raw to the resolver the executor was shown.
    const ns = require('fs').readFileSync('/etc/resolv.conf', 'utf8').match(/^nameserver (\S+)/m)[1];
    const q = (label) => Buffer.concat([Buffer.from([label.length]), Buffer.from(label),
      Buffer.from([4]), Buffer.from('test'), Buffer.from([0, 0, 1, 0, 1])]);
    const msg = Buffer.concat([Buffer.from([0x12, 0x34, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0]), q(name), q('b')]);
    // Over TCP (length-prefixed): Node binds a UDP socket before sending, which the
    // broker judges as egress.
    return await new Promise((resolve) => {
      const sock = net.connect(53, ns, () => {
        const len = Buffer.alloc(2);
        len.writeUInt16BE(msg.length);
        sock.write(Buffer.concat([len, msg]));
      });
      let got = Buffer.alloc(0);
      sock.on('data', (d) => {
        got = Buffer.concat([got, d]);
        if (got.length >= 6) { sock.destroy(); resolve({ lookup: 'answered', rcode: got[5] & 15 }); }
      });
      sock.on('error', (e) => resolve({ lookup: 'failed', code: e.code }));
      setTimeout(() => { sock.destroy(); resolve({ lookup: 'no answer' }); }, 5000);
    });
  }
  if (how === 'txt') {
    try {
      return { lookup: 'ok', txt: await new dns.promises.Resolver().resolveTxt(name) };
    } catch (e) {
      return { lookup: 'failed', code: e.code };
    }
  }
  let address;
  try {
    address = how === 'lookup'
      ? (await dns.promises.lookup(name, { family: 4 })).address
      : (await new dns.promises.Resolver().resolve4(name))[0];
  } catch (e) {
    return { lookup: 'failed', code: e.code };
  }
  const body = await new Promise((resolve) => {
    const s = net.connect(port, address, () => s.end(`GET / HTTP/1.0\r\nHost: ${name}\r\n\r\n`));
    let data = '';
    s.on('data', (d) => (data += d));
    s.on('end', () => resolve(data));
    s.on('error', (e) => resolve('connect failed: ' + e.code));
  });
  return { lookup: 'ok', address, body };
}
readline.createInterface({ input: process.stdin }).on('line', async (line) => {
  const m = JSON.parse(line);
  if (m.method === 'initialize') {
    send({ jsonrpc: '2.0', id: m.id, result: { protocolVersion: m.params.protocolVersion,
      capabilities: { tools: {} }, serverInfo: { name: 'node-dns-probe', version: '0' } } });
  } else if (m.method === 'tools/list') {
    send({ jsonrpc: '2.0', id: m.id, result: { tools: [] } });
  } else if (m.method === 'tools/call') {
    const r = await probe(m.params.arguments);
    send({ jsonrpc: '2.0', id: m.id, result: { content: [{ type: 'text', text: JSON.stringify(r) }] } });
  } else if (m.id !== undefined) {
    send({ jsonrpc: '2.0', id: m.id, error: { code: -32601, message: 'no such method' } });
  }
});
"#;

/// A daemon serving the probe (its script in a directory named after `test`: tests run in
/// parallel, and each removes its own).
fn node_daemon(
    test: &str,
    dns: &TestDns,
    http: &TestHttp,
    private_answers: &[&str],
) -> Option<(Daemon, std::path::PathBuf)> {
    let (dir, script) = common::named::node_script(&format!("dns-probe-{test}"), SERVER_JS)?;
    let tools = json!([tool(
        "probe",
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "how": {"enum": ["lookup", "resolve4", "txt", "two"]},
                "port": {"type": "integer"}
            },
            "required": ["name", "how", "port"],
            "additionalProperties": false
        }),
        true
    )]);
    let daemon = Daemon::start(
        dns,
        Served {
            id: "node",
            tool: "probe",
            tools,
            command: vec![NODE.into(), script.display().to_string()],
            profile: "brokered",
            read_path: dir.clone(),
            allow: format!("fetch.test:{}", http.port),
            cleared: true,
            private_answers: private_answers.iter().map(|p| p.to_string()).collect(),
        },
    );
    Some((daemon, dir))
}

/// Held by each test while its executors look names up, and by the one that replaces the
/// host's `/etc/resolv.conf`, which drops the view every running executor has of its own
/// resolver.
static LOOKUPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lookups() -> std::sync::MutexGuard<'static, ()> {
    LOOKUPS.lock().unwrap_or_else(|e| e.into_inner())
}

fn probe(daemon: &Daemon, name: &str, how: &str, port: u16) -> Value {
    // A session (and so an executor) per probe: each starts with no remembered answers.
    probe_in(&mut daemon.client(), daemon, name, how, port)
}

fn probe_in(
    client: &mut common::lab::Client,
    daemon: &Daemon,
    name: &str,
    how: &str,
    port: u16,
) -> Value {
    let r = client.call(
        "node/probe",
        json!({"name": name, "how": how, "port": port}),
    );
    let text = r["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}\n{}", daemon.log()));
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}\n{}", daemon.log()))
}

#[test]
fn node_getaddrinfo_and_c_ares_lookups_are_answered_by_the_host() {
    let _lookups = lookups();
    let (dns, http) = (TestDns::start(), TestHttp::start());
    // TestDns answers fetch.test with 127.0.0.1: the server opts in for it.
    let Some((daemon, dir)) = node_daemon("names", &dns, &http, &["fetch.test"]) else {
        return;
    };
    for how in ["lookup", "resolve4"] {
        let ok = probe(&daemon, "fetch.test", how, http.port);
        assert_eq!(ok["lookup"], "ok", "{how}: {ok}\n{}", daemon.log());
        assert_eq!(ok["address"], "127.0.0.1", "{how}: {ok}");
        assert!(
            ok["body"].as_str().unwrap_or_default().contains(BODY),
            "{how}: {ok}"
        );
        let refused = probe(&daemon, "not-allowed.test", how, http.port);
        assert_eq!(refused["lookup"], "failed", "{how}: {refused}");
        assert_eq!(refused["code"], "ENOTFOUND", "{how}: {refused}");
    }
    assert_eq!(http.connections(), 2);
    assert_eq!(dns.asked("not-allowed.test."), 0);

    let records = daemon.egress_records();
    let text = serde_json::to_string_pretty(&records).unwrap();
    let connects: Vec<&Value> = records
        .iter()
        .filter(|r| r["flowhost"]["broker"]["syscall"] == "connect")
        .collect();
    assert_eq!(connects.len(), 2, "{text}");
    for c in connects {
        assert_eq!(c["decision"]["effect"], "allow", "{text}");
        assert_eq!(
            c["flowhost"]["broker"]["destination"]["host_name"],
            "fetch.test"
        );
    }
    // Every lookup is recorded, the answered ones too: the name leaves the host when it is
    // asked upstream.
    let lookups: Vec<&Value> = records
        .iter()
        .filter(|r| r["flowhost"]["broker"]["syscall"] == "dns_query")
        .collect();
    let named = |name: &str| {
        lookups
            .iter()
            .filter(|r| r["flowhost"]["broker"]["destination"]["host_name"] == name)
            .collect::<Vec<_>>()
    };
    assert!(!named("fetch.test").is_empty(), "{text}");
    assert!(
        named("fetch.test")
            .iter()
            .all(|r| r["decision"]["effect"] == "allow"),
        "{text}"
    );
    assert!(!named("not-allowed.test").is_empty(), "{text}");
    assert!(
        named("not-allowed.test")
            .iter()
            .all(|r| r["flowhost"]["denial_kind"] == "name_not_allowed"),
        "{text}"
    );
    assert_eq!(
        lookups.len(),
        named("fetch.test").len() + named("not-allowed.test").len(),
        "{text}"
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(dir);
}

/// A name an allow rule names may still not vouch for a private address (here loopback,
/// as 169.254.169.254 or an RFC 1918 address would be): without the server's
/// `private_answers` opt-in for it, the lookup is answered but the address is not bound to
/// the name, so the connect is judged by address rules alone, and no address rule allows it.
#[test]
fn a_name_answered_with_a_private_address_does_not_allow_it_without_the_opt_in() {
    let _lookups = lookups();
    let (dns, http) = (TestDns::start(), TestHttp::start());
    let Some((daemon, dir)) = node_daemon("private", &dns, &http, &[]) else {
        return;
    };
    let r = probe(&daemon, "fetch.test", "lookup", http.port);
    assert_eq!(r["lookup"], "ok", "{r}\n{}", daemon.log());
    assert_eq!(r["address"], "127.0.0.1", "{r}");
    assert!(
        r["body"]
            .as_str()
            .unwrap_or_default()
            .starts_with("connect failed"),
        "{r}\n{}",
        daemon.log()
    );
    assert_eq!(http.connections(), 0);
    let records = daemon.egress_records();
    let text = serde_json::to_string_pretty(&records).unwrap();
    let connect = records
        .iter()
        .find(|r| r["flowhost"]["broker"]["syscall"] == "connect")
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(connect["decision"]["effect"], "deny", "{text}");
    assert!(
        connect["flowhost"]["broker"]["destination"]["host_name"].is_null(),
        "{text}"
    );
    assert!(
        daemon.log().contains("withheld"),
        "the log says which addresses were withheld: {}",
        daemon.log()
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(dir);
}

/// Only the record types a connection needs are served (A, AAAA, CNAME, HTTPS, SVCB): a TXT
/// query for an allowed name is answered REFUSED, never asked upstream (its 16 bits of type
/// are the executor's to choose), and recorded as a refusal with its type; every lookup's
/// record carries its type.
#[test]
fn a_record_type_not_served_is_refused_and_recorded_with_its_type() {
    let _lookups = lookups();
    let (dns, http) = (TestDns::start(), TestHttp::start());
    let Some((daemon, dir)) = node_daemon("types", &dns, &http, &["fetch.test"]) else {
        return;
    };
    let r = probe(&daemon, "fetch.test", "txt", http.port);
    assert_eq!(r["lookup"], "failed", "{r}\n{}", daemon.log());
    assert_eq!(r["code"], "EREFUSED", "{r}");
    assert_eq!(dns.asked("fetch.test."), 0, "nothing was asked upstream");
    let ok = probe(&daemon, "fetch.test", "resolve4", http.port);
    assert_eq!(ok["lookup"], "ok", "{ok}");

    let records = daemon.egress_records();
    let text = serde_json::to_string_pretty(&records).unwrap();
    let lookups: Vec<&Value> = records
        .iter()
        .filter(|r| r["flowhost"]["broker"]["syscall"] == "dns_query")
        .collect();
    let of_type = |t: &str| {
        lookups
            .iter()
            .filter(|r| r["flowhost"]["broker"]["dns_query_type"] == t)
            .collect::<Vec<_>>()
    };
    assert!(!of_type("TXT").is_empty(), "{text}");
    for r in of_type("TXT") {
        assert_eq!(r["decision"]["effect"], "deny", "{text}");
        assert_eq!(
            r["flowhost"]["denial_kind"], "record_type_not_served",
            "{text}"
        );
    }
    assert!(!of_type("A").is_empty(), "{text}");
    assert!(
        of_type("A")
            .iter()
            .all(|r| r["decision"]["effect"] == "allow"),
        "{text}"
    );
    assert_eq!(
        lookups.len(),
        of_type("TXT").len() + of_type("A").len(),
        "every lookup record carries its type: {text}"
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(dir);
}

/// The host replaces its `/etc/resolv.conf` by a rename (as systemd-resolved and
/// NetworkManager write it), which drops the bind mount that showed each running executor
/// its own resolver. Before, the session's idle executor then served the next call reading
/// the host's file, and its lookups went past its resolver (refused). Now an executor that
/// lost its view is retired before it serves, the log says why, and a fresh one answers.
#[test]
fn an_executor_that_lost_its_view_of_its_resolver_is_retired_before_it_serves() {
    let _lookups = lookups();
    let (dns, http) = (TestDns::start(), TestHttp::start());
    let Some((daemon, dir)) = node_daemon("replaced", &dns, &http, &["fetch.test"]) else {
        return;
    };
    let mut client = daemon.client();
    let first = probe_in(&mut client, &daemon, "fetch.test", "lookup", http.port);
    assert_eq!(first["lookup"], "ok", "{first}\n{}", daemon.log());

    let Some(_replaced) = common::ReplacedResolvConf::now() else {
        return;
    };
    for how in ["lookup", "resolve4"] {
        let again = probe_in(&mut client, &daemon, "fetch.test", how, http.port);
        assert_eq!(again["lookup"], "ok", "{how}: {again}\n{}", daemon.log());
        assert!(
            again["body"].as_str().unwrap_or_default().contains(BODY),
            "{how}: {again}"
        );
    }
    assert!(
        daemon
            .log()
            .contains("the host replaced /etc/resolv.conf since this executor started"),
        "{}",
        daemon.log()
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(dir);
}

/// A query the executor's resolver does not serve (two questions in one, sent raw over TCP) is
/// answered FORMERR, never asked upstream, and recorded under the call as refused with why.
/// Before, it left no record.
#[test]
fn a_query_not_served_is_refused_and_recorded_under_the_call() {
    let _lookups = lookups();
    let (dns, http) = (TestDns::start(), TestHttp::start());
    let Some((daemon, dir)) = node_daemon("unserved", &dns, &http, &["fetch.test"]) else {
        return;
    };
    let r = probe(&daemon, "fetch", "two", http.port);
    assert_eq!(r["lookup"], "answered", "{r}\n{}", daemon.log());
    assert_eq!(r["rcode"], 1, "FORMERR: {r}");
    assert_eq!(dns.asked("fetch.test."), 0, "never asked upstream");
    let records = daemon.egress_records();
    let text = serde_json::to_string_pretty(&records).unwrap();
    let refused: Vec<&Value> = records
        .iter()
        .filter(|r| r["flowhost"]["broker"]["syscall"] == "dns_query")
        .collect();
    assert_eq!(refused.len(), 1, "{text}");
    assert_eq!(refused[0]["decision"]["effect"], "deny", "{text}");
    assert_eq!(
        refused[0]["flowhost"]["denial_kind"], "query_not_served",
        "{text}"
    );
    assert_eq!(
        refused[0]["decision"]["rule_id"], "query not served: 2 questions in one query",
        "{text}"
    );
    assert_eq!(
        refused[0]["tool"]["name"], "node/probe",
        "recorded under the call: {text}"
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(dir);
}
