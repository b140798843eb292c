//! MCP tools against a real MCP server (the SDK-built `cairn-mcp-test-server`), over stdio
//! (a child process) and over streamable HTTP (bound on 127.0.0.1:0): discovery under the
//! prefix, text, JSON, image and resource-link results, `isError`, the idempotency key in
//! `_meta`, the per-call timeout and cancellation.

// Tests wait on real time (a slow tool, a cancellation); the clock ban is for pure code.
#![allow(clippy::disallowed_methods)]

use cairn_activities::{ActivityContext, Error, Tool, ToolCall, ToolOutput};
use cairn_ledger::{JsonText, Media, ToolResultBlock, ToolResultContent};
use cairn_mcp::test_server::{TestServer, PIXEL_PNG_BASE64};
use cairn_mcp::{McpConfig, McpServers, McpTool};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

fn stdio_config(cancel_log: &Path, timeout_ms: u64) -> String {
    serde_json::json!({"mcpServers": {"test": {
        "command": env!("CARGO_BIN_EXE_cairn-mcp-test-server"),
        "args": ["--cancel-log", cancel_log],
        "prefix": "t",
        "timeout_ms": timeout_ms,
    }}})
    .to_string()
}

async fn connect(config: &str) -> McpServers {
    let servers = McpConfig::parse(config, Path::new("mcp.json")).unwrap();
    McpServers::connect(&servers).await.unwrap()
}

fn tool<'a>(servers: &'a McpServers, name: &str) -> &'a McpTool {
    servers
        .tools()
        .iter()
        .find(|t| t.spec().name == name)
        .unwrap_or_else(|| panic!("no tool {name}"))
}

fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        tool_use_id: "toolu_1".into(),
        name: name.into(),
        arguments: arguments.into(),
        idempotency_key: "session-1/toolu_1".into(),
    }
}

fn json(text: &str) -> ToolResultContent {
    ToolResultContent::Json(JsonText::parse(text).unwrap())
}

/// The results every transport must give.
async fn check_results(servers: &McpServers) {
    let names: Vec<String> = servers.tools().iter().map(|t| t.spec().name).collect();
    assert_eq!(
        names,
        [
            "t__echo",
            "t__add",
            "t__pixel",
            "t__link",
            "t__fail",
            "t__slow",
            "t__meta",
            "t__dotted_name"
        ]
    );
    let echo = tool(servers, "t__echo").spec();
    assert_eq!(echo.description, "Returns its text.");
    assert_eq!(
        echo.input_schema.as_str(),
        r#"{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}"#
    );
    let detached = ActivityContext::detached();
    let run = |name: &'static str, arguments: &'static str| {
        let detached = detached.clone();
        async move {
            tool(servers, name)
                .call(&call(name, arguments), &detached)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        run("t__echo", r#"{"text":"hi there"}"#).await,
        ToolOutput::text("hi there")
    );
    assert_eq!(
        run("t__add", r#"{"a":2,"b":3.5}"#).await,
        ToolOutput::json(JsonText::parse(r#"{"sum":5.5,"terms":[2.0,3.5]}"#).unwrap())
    );
    assert_eq!(
        run("t__pixel", "{}").await.content,
        ToolResultContent::Blocks(vec![ToolResultBlock::Media(Media::image_base64(
            "image/png",
            PIXEL_PNG_BASE64
        ))])
    );
    assert_eq!(
        run("t__link", "{}").await.content,
        json(
            r#"{"content":[{"type":"resource_link","uri":"file:///notes/today.md","name":"today"}]}"#
        )
    );
    assert_eq!(
        run("t__fail", "{}").await,
        ToolOutput::error("the tool failed on purpose")
    );
    assert_eq!(
        run("t__dotted_name", "{}").await,
        ToolOutput::text("dotted")
    );
    // The idempotency key reaches the server in the request's _meta.
    let meta = run("t__meta", "{}").await;
    let ToolResultContent::Text(meta) = &meta.content else {
        panic!("{meta:?}")
    };
    assert!(
        meta.contains(r#""cairn/idempotency_key":"session-1/toolu_1""#),
        "{meta}"
    );
    // A request the server refuses is an error result naming the server.
    let refused = run("t__echo", r#"{"text":7}"#).await;
    assert!(refused.is_error, "{refused:?}");
    assert!(
        matches!(&refused.content, ToolResultContent::Text(t) if t.contains("MCP server \"test\" refused the call") && t.contains("text must be a string")),
        "{refused:?}"
    );
    // Arguments that are not an object never reach the server.
    let err = tool(servers, "t__echo")
        .call(&call("t__echo", "[1]"), &detached)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArguments { ref tool, .. } if tool == "t__echo"),
        "{err:?}"
    );
}

#[tokio::test]
async fn stdio_server_tools_are_discovered_prefixed_and_called() {
    let dir = tempfile::tempdir().unwrap();
    let servers = connect(&stdio_config(&dir.path().join("cancel.log"), 10_000)).await;
    check_results(&servers).await;
}

#[tokio::test]
async fn http_server_tools_are_discovered_prefixed_and_called() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(TestServer::new(None).serve_http(listener));
    let config = serde_json::json!({"mcpServers": {"test": {
        "type": "http",
        "url": format!("http://{addr}/mcp"),
        "headers": {"X-Test": "1"},
        "prefix": "t",
    }}})
    .to_string();
    let servers = connect(&config).await;
    check_results(&servers).await;
    server.abort();
}

#[tokio::test]
async fn a_call_past_its_timeout_fails_as_a_timeout_and_the_server_is_told() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("cancel.log");
    let servers = connect(&stdio_config(&log, 300)).await;
    let slow = tool(&servers, "t__slow");
    let started = Instant::now();
    let err = slow
        .call(
            &call("t__slow", r#"{"ms":30000}"#),
            &ActivityContext::detached(),
        )
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(
        matches!(err, Error::ToolTimeout { ref tool, timeout_ms: 300 } if tool == "t__slow"),
        "{err:?}"
    );
    assert_eq!(err.kind(), cairn_activities::ErrorKind::Timeout);
    wait_for_line(&log, "cancelled").await;
    // The connection stays usable.
    let out = slow
        .call(
            &call("t__slow", r#"{"ms":1}"#),
            &ActivityContext::detached(),
        )
        .await
        .unwrap();
    assert_eq!(out, ToolOutput::text("slept 1 ms"));
}

#[tokio::test]
async fn a_cancelled_activity_stops_the_call_and_the_server_is_told() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("cancel.log");
    let servers = connect(&stdio_config(&log, 60_000)).await;
    let token = CancellationToken::new();
    let context = ActivityContext::new(1, None, token.clone(), |_| {});
    let cancel = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        token.cancel();
    });
    let started = Instant::now();
    let err = tool(&servers, "t__slow")
        .call(&call("t__slow", r#"{"ms":30000}"#), &context)
        .await
        .unwrap_err();
    cancel.await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(matches!(err, Error::Cancelled { .. }), "{err:?}");
    wait_for_line(&log, "cancelled").await;
}

#[tokio::test]
async fn an_unreachable_server_is_a_connect_error_naming_it() {
    let config = serde_json::json!({"mcpServers": {"gone": {
        "command": "/nonexistent/mcp-server",
    }}})
    .to_string();
    let servers = McpConfig::parse(&config, Path::new("mcp.json")).unwrap();
    let Err(err) = McpServers::connect(&servers).await else {
        panic!("connected to nothing")
    };
    assert!(
        err.to_string()
            .starts_with("MCP server \"gone\": cannot connect"),
        "{err}"
    );
}

async fn wait_for_line(path: &Path, line: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if std::fs::read_to_string(path).is_ok_and(|t| t.lines().any(|l| l == line)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the server never noted {line:?} in {}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
