//! Any MCP client can drive a governed server: the official Python SDK (installed pinned by
//! `.ci/install-interop`) launches `flowhost sandbox mcp` as its stdio server, lists and
//! calls the example tool, and the run's records pass the gate.

mod common;

use std::path::Path;
use std::process::Command;

use common::TcpSink;
use common::harness::{As, can_run, example_files, example_tool, flowhost_for, work_dir};

const PYTHON: &str = "/opt/flowhost-interop/venv/bin/python";

const CLIENT: &str = r#"
import asyncio, json, sys
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

async def main():
    params = StdioServerParameters(command=sys.argv[1], args=json.loads(sys.argv[2]))
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            tools = await session.list_tools()
            names = sorted(t.name for t in tools.tools)
            checked = await session.call_tool("status-probe/check", {"target": sys.argv[3]})
            version = await session.call_tool("status-probe/version", {})
            print(json.dumps({
                "tools": names,
                "check": [c.text for c in checked.content],
                "check_error": checked.isError,
                "version": [c.text for c in version.content],
            }))

asyncio.run(main())
"#;

#[test]
fn the_python_sdk_drives_a_governed_server_through_sandbox_mcp() {
    if !common::third_party(Path::new(PYTHON)) {
        return;
    }
    let who = As::Root;
    if !can_run(who, &[]) {
        return;
    }
    let files = example_files();
    let service = TcpSink::start();
    let dir = work_dir(who);
    let records = dir.path().join("records");
    let health = dir.path().join("health.json");
    let args: Vec<String> = [
        "sandbox",
        "mcp",
        "--manifest",
        files.manifest.to_str().unwrap(),
        "--key",
        files.key.to_str().unwrap(),
        "--mappings",
        files.mappings.to_str().unwrap(),
        "--allow",
        &service.addr.to_string(),
        "--records",
        records.to_str().unwrap(),
        "--health",
        health.to_str().unwrap(),
        "--declared",
        files.declared.to_str().unwrap(),
        "--",
        example_tool().to_str().unwrap(),
        "serve",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = Command::new(PYTHON)
        .args(["-c", CLIENT])
        .arg(flowhost_for(who))
        .arg(serde_json::to_string(&args).unwrap())
        .arg(service.addr.to_string())
        .output()
        .unwrap();
    let stdout = common::harness::succeeded(&out);
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        seen["tools"],
        serde_json::json!(["status-probe/check", "status-probe/version"])
    );
    assert_eq!(seen["check_error"], false, "{seen}");
    assert!(
        seen["check"][0].as_str().unwrap().contains("accepted"),
        "{seen}"
    );
    assert_eq!(service.connections(), 1);
    // The SDK closes the server's stdin and waits: the host wrote its records and health,
    // and they pass the gate.
    let records = flowhost::harness::read_records(&records).unwrap();
    assert!(records.len() >= 5, "{}", records.len());
    let health = flowhost::records::ToolObservationHealth::read_from(&health).unwrap();
    let report = flowhost::harness::judge(
        &flowhost::harness::load_surface(&files.declared).unwrap(),
        &dir.path().join("records"),
        &health,
    )
    .unwrap();
    assert!(
        flowhost::harness::passes(&report),
        "{}",
        flowhost::diff::report::to_text(&report)
    );
}
