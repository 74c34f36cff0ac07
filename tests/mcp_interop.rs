//! MCP software this project did not write, against the real daemon: the official Python
//! MCP SDK as a client through `flowhost connect`, and the MCP project's Node reference
//! server (`@modelcontextprotocol/server-everything`) governed as an executor. Installed,
//! pinned, by `.ci/install-interop`; the tests skip (saying why) where it is missing.

mod common;

use std::path::{Path, PathBuf};

use common::governed::{Governed, ServerSpec, tool};
use common::shared_copy;
use serde_json::{Value, json};

const INTEROP: &str = "/opt/flowhost-interop";

/// `path` under the interop prefix, or `None` (printing why) when it is not installed.
fn installed(rel: &str) -> Option<PathBuf> {
    let path = Path::new(INTEROP).join(rel);
    common::third_party(&path).then_some(path)
}

/// The test executor with a slow tool (progress) and a structured one; the principal may
/// call `sleep` and `structured` but not `chatter`.
fn slow_server() -> ServerSpec {
    let mut structured = tool("structured", json!({"type": "object"}));
    structured["output_schema"] =
        json!({"type": "object", "properties": {"answer": {"type": "integer"}}});
    let mut s = ServerSpec::new(
        "slow",
        vec![shared_copy("flowhost-tool-slow").display().to_string()],
        vec![
            tool(
                "sleep",
                json!({"type": "object", "properties": {"seconds": {"type": "number"},
                       "steps": {"type": "integer"}}, "required": ["seconds"]}),
            ),
            structured,
            tool("chatter", json!({"type": "object"})),
        ],
    );
    s.allowed = Some(vec!["sleep".into(), "structured".into()]);
    s
}

/// The official Python SDK's client session, through `flowhost connect` (started by the SDK
/// as its stdio server), initializes, lists, calls with progress, and meets a refusal.
const PYTHON_CLIENT: &str = r#"
import asyncio, json, sys
from mcp import ClientSession, StdioServerParameters, McpError
from mcp.client.stdio import stdio_client

flowhost, socket = sys.argv[1], sys.argv[2]

async def main():
    out = {}
    params = StdioServerParameters(command=flowhost, args=["connect", "--socket", socket])
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            out["protocol"] = init.protocolVersion
            out["server"] = init.serverInfo.name
            tools = await session.list_tools()
            out["tools"] = sorted(t.name for t in tools.tools)
            out["output_schema"] = [t.outputSchema for t in tools.tools if t.name == "slow/structured"][0]
            progress = []
            async def on_progress(p, total, message):
                progress.append([p, total])
            r = await session.call_tool("slow/sleep", {"seconds": 0.6, "steps": 3},
                                        progress_callback=on_progress)
            out["call"] = {"isError": r.isError, "text": r.content[0].text}
            out["progress"] = progress
            r = await session.call_tool("slow/structured", {})
            out["structured"] = r.structuredContent
            r = await session.call_tool("slow/sleep", {"seconds": "soon"})
            out["schema_error"] = {"isError": r.isError, "text": r.content[0].text}
            for name in ["slow/chatter", "slow/none"]:
                try:
                    await session.call_tool(name, {})
                    out[name] = "answered"
                except McpError as e:
                    out[name] = {"code": e.error.code, "message": e.error.message,
                                 "data": e.error.data}
    print(json.dumps(out))

asyncio.run(main())
"#;

#[test]
fn the_official_python_sdk_drives_the_daemon_through_flowhost_connect() {
    let Some(python) = installed("venv/bin/python") else {
        return;
    };
    let Some(host) = Governed::start(&[slow_server()], "") else {
        return;
    };
    let script = host.dir.path().join("client.py");
    std::fs::write(&script, PYTHON_CLIENT).unwrap();
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_flowhost"))
        .arg(&host.socket)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed:\n{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        host.log()
    );
    let r: Value = serde_json::from_str(stdout.trim()).unwrap();
    // The SDK offers its newest revision; both sides then speak the newest they share.
    assert_eq!(r["protocol"], "2025-06-18", "{r}");
    assert_eq!(r["server"], "flowhost");
    assert_eq!(r["tools"], json!(["slow/sleep", "slow/structured"]), "{r}");
    assert_eq!(
        r["output_schema"]["properties"]["answer"]["type"],
        "integer"
    );
    assert_eq!(r["call"]["isError"], false, "{r}");
    assert_eq!(
        r["progress"],
        json!([[1.0, 3.0], [2.0, 3.0], [3.0, 3.0]]),
        "{r}"
    );
    assert_eq!(r["structured"], json!({"answer": 42}), "{r}");
    assert_eq!(r["schema_error"]["isError"], true, "{r}");
    // The SDK's calls were governed: authorized and recorded before they ran, refusals too.
    let records = host.records();
    let calls = |tool: &str, status: &str| {
        records
            .iter()
            .filter(|r| r["tool"]["name"] == tool && r["response"]["status"] == status)
            .count()
    };
    assert_eq!(calls("slow/sleep", "authorized"), 1, "{records:#?}");
    assert_eq!(calls("slow/chatter", "blocked"), 1, "{records:#?}");
    // Refusals reach the SDK's error with their denial, under codes it does not read as
    // its own (-32001 is its request timeout).
    for (name, denial) in [
        ("slow/chatter", "access_denied"),
        ("slow/none", "unknown_tool"),
    ] {
        let e = &r[name];
        assert_eq!(e["data"]["denial"], denial, "{name}: {r}");
        assert_ne!(e["code"], json!(-32001), "{name}: {r}");
        assert_ne!(e["code"], json!(-32000), "{name}: {r}");
    }
}

#[test]
fn progress_from_the_node_reference_server_reaches_the_client() {
    let Some(entry) =
        installed("node/node_modules/@modelcontextprotocol/server-everything/dist/index.js")
    else {
        return;
    };
    if !common::third_party(Path::new("/usr/bin/node")) {
        return;
    }
    let mut server = ServerSpec::new(
        "everything",
        vec![
            "/usr/bin/node".into(),
            entry.display().to_string(),
            "stdio".into(),
        ],
        vec![tool(
            "trigger-long-running-operation",
            json!({"type": "object", "properties": {"duration": {"type": "number"},
                   "steps": {"type": "number"}}}),
        )],
    );
    server.extra = format!("read_paths = [\"{INTEROP}/node\"]\npool_size = 1");
    let Some(host) = Governed::start(&[server], "") else {
        return;
    };
    let mut c = host.client();
    c.send_request(
        7,
        "tools/call",
        json!({"name": "everything/trigger-long-running-operation",
               "arguments": {"duration": 1, "steps": 5},
               "_meta": {"progressToken": 99}}),
    );
    let mut progress = Vec::new();
    let answer = loop {
        let m = c.recv();
        if m["method"] == "notifications/progress" {
            progress.push(m["params"].clone());
        } else if m["id"] == json!(7) {
            break m;
        }
    };
    assert!(
        answer["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .contains("completed"),
        "{answer}\n{}",
        host.log()
    );
    assert_eq!(progress.len(), 5, "{progress:?}");
    for (i, p) in progress.iter().enumerate() {
        assert_eq!(p["progressToken"], 99);
        assert_eq!(p["progress"], json!(i + 1));
        assert_eq!(p["total"], json!(5));
    }
}
