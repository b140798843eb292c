//! `cairn run --mcp-config` end to end: a scripted model calls tools of a real MCP server
//! (the SDK-built test server of `cairn_mcp`, on streamable HTTP in this process); the
//! session offers them under their prefix, and the history records their text and JSON
//! results, and an image result as an image block.

use crate::support::cairn_command;
use cairn_mcp::test_server::{TestServer, PIXEL_PNG_BASE64};
use serde_json::{json, Value};

fn tool_use(id: &str, name: &str, input: Value) -> Value {
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cairn_run_hosts_mcp_tools_and_records_their_results() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(TestServer::new(None).serve_http(listener));
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("mcp.json");
    std::fs::write(
        &config,
        json!({"mcpServers": {"demo": {"url": format!("http://{addr}/mcp"), "timeout_ms": 5000}}})
            .to_string(),
    )
    .unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        json!({"responses": [
            {"parts": [
                tool_use("m1", "demo__echo", json!({"text": "hello mcp"})),
                tool_use("m2", "demo__add", json!({"a": 1, "b": 2})),
                tool_use("m3", "demo__pixel", json!({})),
                tool_use("m4", "demo__fail", json!({}))
            ]},
            {"parts": [{"type": "text", "text": "done"}]}
        ]})
        .to_string(),
    )
    .unwrap();
    let data = dir.path().join("store");
    let run = {
        let mut command = cairn_command();
        command
            .arg("run")
            .arg("--data")
            .arg(&data)
            .arg("--model")
            .arg(format!("scripted:{}", script.display()))
            .arg("--mcp-config")
            .arg(&config)
            .args(["--session", "s1", "--workdir"])
            .arg(dir.path())
            .arg("use the tools");
        tokio::task::spawn_blocking(move || command.output())
            .await
            .unwrap()
            .unwrap()
    };
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&run.stdout).contains("done"));
    assert!(
        stderr.contains("demo__echo"),
        "the tools are announced: {stderr}"
    );

    let history = cairn_command()
        .args(["history", "s1", "--json", "--data"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(history.status.success());
    let events: Vec<Value> = String::from_utf8_lossy(&history.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The session offered the MCP tools, with the server's schema.
    let started = &events[0]["event"]["session_started"];
    let offered: Vec<&str> = started["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    for name in [
        "demo__echo",
        "demo__add",
        "demo__pixel",
        "demo__fail",
        "read_file",
    ] {
        assert!(offered.contains(&name), "{offered:?}");
    }
    let completed = |id: &str| -> String {
        let event = events
            .iter()
            .find(|e| {
                e["kind"] == "tool_call_completed"
                    && e["event"]["tool_call_completed"]["tool_use_id"] == id
            })
            .unwrap_or_else(|| panic!("no result for {id}"));
        let c = &event["event"]["tool_call_completed"];
        format!("{} {}", c["content"], c["is_error"])
    };
    assert_eq!(completed("m1"), r#"{"text":"hello mcp"} false"#);
    assert_eq!(
        completed("m2"),
        r#"{"json":{"sum":3.0,"terms":[1.0,2.0]}} false"#
    );
    assert_eq!(
        completed("m3"),
        format!(
            r#"{{"blocks":[{{"media":{{"kind":"image","source":{{"base64":{{"media_type":"image/png","data":"{PIXEL_PNG_BASE64}"}}}}}}}}]}} false"#
        )
    );
    assert_eq!(
        completed("m4"),
        r#"{"text":"the tool failed on purpose"} true"#
    );
    // The recorded history replays.
    let replay = cairn_command()
        .args(["replay", "--data"])
        .arg(&data)
        .arg("s1")
        .output()
        .unwrap();
    assert!(
        replay.status.success(),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );

    // MCP tools take policy rules by name: denied, the call never reaches the server.
    let denied = {
        let mut command = cairn_command();
        command
            .arg("run")
            .arg("--data")
            .arg(&data)
            .arg("--model")
            .arg(format!("scripted:{}", script.display()))
            .arg("--mcp-config")
            .arg(&config)
            .args(["--session", "s2", "--deny", "demo__pixel", "--workdir"])
            .arg(dir.path())
            .arg("use the tools");
        tokio::task::spawn_blocking(move || command.output())
            .await
            .unwrap()
            .unwrap()
    };
    assert!(
        denied.status.success(),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );
    let history = cairn_command()
        .args(["history", "s2", "--json", "--data"])
        .arg(&data)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&history.stdout);
    assert!(text.contains(r#""tool_use_id":"m1""#), "{text}");
    assert!(
        !text.contains(r#""tool_use_id":"m3""#),
        "a denied call was scheduled: {text}"
    );
    assert!(!text.contains(PIXEL_PNG_BASE64), "a denied call ran");
    let transcript = cairn_command()
        .args(["transcript", "--data"])
        .arg(&data)
        .arg("s2")
        .output()
        .unwrap();
    let transcript: Value = serde_json::from_slice(&transcript.stdout).unwrap();
    let result = transcript["messages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| m["parts"].as_array().unwrap().iter())
        .find(|p| p["tool_result"]["tool_use_id"] == "m3")
        .unwrap_or_else(|| panic!("no result for m3 in {transcript}"));
    assert_eq!(result["tool_result"]["is_error"], true, "{result}");
    server.abort();
}
