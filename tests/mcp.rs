//! `cairn run --mcp-config` end to end: a scripted model calls tools of a real MCP server
//! (the SDK-built test server of `cairn_mcp`, on streamable HTTP in this process); the
//! session offers them under their prefix, and the history records their text and JSON
//! results, and an image result as an image block.

use crate::support::cairn_command;
use cairn_mcp::test_server::{TestServer, PIXEL_PNG_BASE64};
use serde_json::{json, Value};

/// The SDK-built test server on streamable HTTP in this process, and a config file in `dir`
/// naming it `demo` (calls limited to 5 s).
async fn serve_test_server(
    dir: &std::path::Path,
) -> (
    tokio::task::JoinHandle<std::io::Result<()>>,
    std::path::PathBuf,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(TestServer::new(None).serve_http(listener));
    let config = dir.join("mcp.json");
    std::fs::write(
        &config,
        json!({"mcpServers": {"demo": {"url": format!("http://{addr}/mcp"), "timeout_ms": 5000}}})
            .to_string(),
    )
    .unwrap();
    (server, config)
}

fn tool_use(id: &str, name: &str, input: Value) -> Value {
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cairn_run_hosts_mcp_tools_and_records_their_results() {
    let dir = tempfile::tempdir().unwrap();
    let (server, config) = serve_test_server(dir.path()).await;
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

/// A child process killed when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `command` with stdout piped and waits for a stdout line starting with `prefix`;
/// returns the child and the rest of that line.
fn start_until_line(mut command: std::process::Command, prefix: &str) -> (Child, String) {
    use std::io::{BufRead, BufReader};
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("start cairn");
    let stdout = child.stdout.take().expect("its stdout");
    let (sender, receiver) = std::sync::mpsc::channel();
    let wanted = prefix.to_owned();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if let Some(rest) = line.strip_prefix(&wanted) {
                let _ = sender.send(rest.to_owned());
            }
        }
    });
    let child = Child(child);
    let rest = receiver
        .recv_timeout(std::time::Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("no {prefix:?} line from {command:?}"));
    (child, rest)
}

/// `cairn worker --mcp-config`: a worker process on another "machine" (here a process beside a
/// `cairn server` process) hosts the MCP server's tools; the server, which has no MCP
/// configuration, hands it their calls, and the history records the results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_hosts_mcp_tools_for_a_server() {
    let dir = tempfile::tempdir().unwrap();
    let (mcp, config) = serve_test_server(dir.path()).await;
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        json!({"responses": [
            {"parts": [
                tool_use("w1", "demo__echo", json!({"text": "from the worker"})),
                tool_use("w2", "demo__add", json!({"a": 20, "b": 22}))
            ]},
            {"parts": [{"type": "text", "text": "the worker answered"}]}
        ]})
        .to_string(),
    )
    .unwrap();

    let mut server = cairn_command();
    server
        .args(["server", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path().join("store"));
    let (_server, url) = start_until_line(server, "listening on ");
    let mut worker = cairn_command();
    worker
        .args(["worker", "--server", &url, "--mcp-config"])
        .arg(&config)
        .arg("--workdir")
        .arg(dir.path());
    let (_worker, _) = start_until_line(worker, "worker ready");

    let run = {
        let mut command = cairn_command();
        command
            .args(["run", "--server", &url, "--model"])
            .arg(format!("scripted:{}", script.display()))
            .arg("--mcp-config")
            .arg(&config)
            .args(["--session", "w", "use the tools"]);
        tokio::task::spawn_blocking(move || command.output())
            .await
            .unwrap()
            .unwrap()
    };
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        String::from_utf8_lossy(&run.stdout).contains("the worker answered"),
        "{}",
        String::from_utf8_lossy(&run.stdout)
    );

    let history = cairn_command()
        .args(["history", "w", "--json", "--server", &url])
        .output()
        .unwrap();
    assert!(
        history.status.success(),
        "{}",
        String::from_utf8_lossy(&history.stderr)
    );
    let mut results: Vec<String> = String::from_utf8_lossy(&history.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["kind"] == "tool_call_completed")
        .map(|e| {
            let c = &e["event"]["tool_call_completed"];
            format!("{} {} {}", c["tool_use_id"], c["content"], c["is_error"])
        })
        .collect();
    // The two calls run in parallel: their results may be recorded in either order.
    results.sort();
    assert_eq!(
        results,
        [
            r#""w1" {"text":"from the worker"} false"#,
            r#""w2" {"json":{"sum":42.0,"terms":[20.0,22.0]}} false"#,
        ]
    );
    mcp.abort();
}

/// The library: `CairnBuilder::mcp_config` registers an MCP server's tools once; sessions
/// offer them, the in-process workers run them, and the history replays to the same ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_builder_hosts_mcp_tools_from_a_config_file() -> anyhow::Result<()> {
    use cairn::prelude::*;
    let dir = tempfile::tempdir()?;
    let (mcp, config) = serve_test_server(dir.path()).await;
    let script = json!({"responses": [
        {"parts": [tool_use("b1", "demo__echo", json!({"text": "from the library"}))]},
        {"parts": [{"type": "text", "text": "echoed"}]}
    ]});
    let cairn = Cairn::builder(dir.path().join("store"))
        .mcp_config(&config)
        .script("mcp", script.to_string())
        .start()
        .await?;
    let options = cairn.session(ModelSpec::new("scripted", "mcp"));
    let offered: Vec<&str> = options.tools.iter().map(|t| t.name.as_str()).collect();
    assert!(offered.contains(&"demo__echo"), "{offered:?}");
    let client = cairn.client();
    let session = client.start_session(options).await?;
    let outcome = client.run_turn(&session, "echo it").await?;
    assert!(
        matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "echoed"),
        "{outcome:?}"
    );

    let history = client.history(&session).await?;
    let replayed = cairn::runtime::replay(&session, &history)?;
    let live = client.transcript(&session).await?;
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        live.canonical_json()
    );
    let result = live
        .messages
        .iter()
        .flat_map(|m| m.parts.iter())
        .find_map(|p| match p {
            cairn::ledger::Part::ToolResult(r) if r.tool_use_id == "b1" => Some(r.clone()),
            _ => None,
        })
        .expect("the echo's result in the transcript");
    assert_eq!(
        result.content.canonical_json(),
        r#""from the library""#,
        "{result:?}"
    );
    assert!(!result.is_error);

    // A configured server that cannot be reached fails the start, naming it.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let closed_addr = closed.local_addr()?;
    drop(closed);
    let unreachable = dir.path().join("unreachable.json");
    std::fs::write(
        &unreachable,
        json!({"mcpServers": {"gone": {"url": format!("http://{closed_addr}/mcp")}}}).to_string(),
    )?;
    cairn.shutdown().await;
    let refused = Cairn::builder(dir.path().join("other"))
        .mcp_config(&unreachable)
        .start()
        .await;
    let error = refused
        .err()
        .expect("an unreachable MCP server fails the start");
    assert!(error.to_string().contains("gone"), "{error}");
    mcp.abort();
    Ok(())
}
