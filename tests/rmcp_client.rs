//! A real MCP client library not written here (the `rmcp` crate) lists and calls tools
//! through `flowhost connect`, the stdio bridge, against the real daemon.

mod common;

use common::lab::Lab;
use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::TokioChildProcess;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rmcp_lists_and_calls_tools_through_flowhost_connect() {
    let Some(lab) = Lab::start() else { return };
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_flowhost"));
    command
        .arg("connect")
        .arg("--socket")
        .arg(&lab.paths.socket);
    let transport = TokioChildProcess::new(command).expect("spawn flowhost connect");
    let client = ().serve(transport).await.expect("MCP initialize through the bridge");

    let info = client.peer_info().expect("server info");
    assert_eq!(
        info.server_info.as_ref().map(|s| s.name.as_str()),
        Some("flowhost")
    );

    let tools = client.list_all_tools().await.expect("tools/list");
    let mut names: Vec<String> = tools.iter().map(|t| t.name.to_string()).collect();
    names.sort();
    assert_eq!(names.len(), 5, "{names:?}");
    assert!(names.contains(&"workspace/read_terms".to_string()));
    let read_terms = tools
        .iter()
        .find(|t| t.name == "workspace/read_terms")
        .unwrap();
    assert_eq!(
        read_terms.input_schema.get("required"),
        Some(&json!(["document"]))
    );

    let mut call = CallToolRequestParams::new("workspace/read_terms");
    call.arguments = json!({"document": "harbor-goods-terms.md"})
        .as_object()
        .cloned();
    let result = client.call_tool(call).await.expect("tools/call");
    let text = serde_json::to_value(&result.content).unwrap();
    assert!(text.to_string().contains("Harbor Goods"), "{text}");

    // A refusal reaches the client as a JSON-RPC error with flowhost's code and reason.
    let mut publish = CallToolRequestParams::new("public-inbox/publish");
    publish.arguments = json!({"message": "leak", "sink": lab.public.addr.to_string()})
        .as_object()
        .cloned();
    let err = client
        .call_tool(publish)
        .await
        .expect_err("a flow violation is refused");
    assert!(err.to_string().contains("flow"), "{err}");
    assert_eq!(lab.public.connections(), 0);
    client.cancel().await.expect("close");
}
