//! What a real executor answers as a JSON-RPC error reaches the client as that error: its
//! code, message and data, not a flowhost "internal error" or a tool result wrapping the
//! error's JSON. Clients act on the code (invalid params, resource not found); the executor
//! answered, so it keeps serving; the record says the tool failed, not the executor.

mod common;

use common::named::{Daemon, NODE, Served, TestDns, tool};
use serde_json::{Value, json};

/// A stdio MCP server whose tool answers `{"fail": true}` with a JSON-RPC error carrying
/// data, and anything else with its own pid (so a test can tell whether it was replaced).
const SERVER_JS: &str = r#"
const readline = require('readline');
const send = (m) => process.stdout.write(JSON.stringify(m) + '\n');
readline.createInterface({ input: process.stdin }).on('line', (line) => {
  const m = JSON.parse(line);
  if (m.method === 'initialize') {
    send({ jsonrpc: '2.0', id: m.id, result: { protocolVersion: m.params.protocolVersion,
      capabilities: { tools: {} }, serverInfo: { name: 'node-errors', version: '0' } } });
  } else if (m.method === 'tools/list') {
    send({ jsonrpc: '2.0', id: m.id, result: { tools: [] } });
  } else if (m.method === 'tools/call' && m.params.arguments.fail) {
    send({ jsonrpc: '2.0', id: m.id, error: { code: -32602,
      message: 'widget 7 is not a widget this server knows', data: { field: 'widget', known: [1, 2] } } });
  } else if (m.method === 'tools/call') {
    send({ jsonrpc: '2.0', id: m.id, result: { content: [{ type: 'text', text: 'pid ' + process.pid }] } });
  } else if (m.id !== undefined) {
    send({ jsonrpc: '2.0', id: m.id, error: { code: -32601, message: 'no such method' } });
  }
});
"#;

fn node_daemon(dns: &TestDns) -> Option<(Daemon, std::path::PathBuf)> {
    let (dir, script) = common::named::node_script("executor-errors", SERVER_JS)?;
    let tools = json!([tool(
        "check",
        json!({
            "type": "object",
            "properties": {"fail": {"type": "boolean"}},
            "required": ["fail"],
            "additionalProperties": false
        }),
        false
    )]);
    let daemon = Daemon::start(
        dns,
        Served {
            id: "node",
            tool: "check",
            tools,
            command: vec![NODE.into(), script.display().to_string()],
            profile: "isolated",
            read_path: dir.clone(),
            allow: "127.0.0.1:9".into(),
            cleared: true,
            private_answers: Vec::new(),
        },
    );
    Some((daemon, dir))
}

fn pid_of(r: &Value, daemon: &Daemon) -> String {
    r["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}\n{}", daemon.log()))
        .to_string()
}

#[test]
fn a_tools_call_answered_with_a_json_rpc_error_reaches_the_client_as_that_error() {
    let dns = TestDns::start();
    let Some((daemon, dir)) = node_daemon(&dns) else {
        return;
    };
    let mut client = daemon.client();
    let before = pid_of(&client.call("node/check", json!({"fail": false})), &daemon);

    let r = client.call("node/check", json!({"fail": true}));
    // Before: a tool result with isError whose text held the error's JSON, and the
    // executor retired as if it had crashed.
    assert_eq!(r["error"]["code"], -32602, "{r}\n{}", daemon.log());
    assert_eq!(
        r["error"]["message"], "widget 7 is not a widget this server knows",
        "{r}"
    );
    assert_eq!(
        r["error"]["data"],
        json!({"field": "widget", "known": [1, 2]}),
        "{r}"
    );
    assert!(r.get("result").is_none(), "{r}");

    // It answered: the same executor serves the next call.
    let after = pid_of(&client.call("node/check", json!({"fail": false})), &daemon);
    assert_eq!(before, after, "{}", daemon.log());

    let statuses: Vec<String> = daemon
        .records()
        .iter()
        .filter(|r| r["flowhost"]["event"] == "tool_outcome")
        .map(|r| {
            r["response"]["status"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(
        statuses,
        ["success", "tool_error", "success"],
        "{}",
        daemon.log()
    );
    let _ = std::fs::remove_dir_all(dir);
}
