//! The service end to end: `cairn server` and `cairn worker` as real processes on loopback,
//! driven through the remote client; workers and the server killed with SIGKILL.

use cairn_devtools::process::{start_and_wait, Process};
use cairn_ledger::{validate_transcript, ModelSpec, ToolSpec};
use cairn_runtime::{
    replay, Client, Event, EventEnvelope, Queues, RetryPolicy, SessionOptions, TurnOutcome,
};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Starts `cairn ARGS` and waits for a stdout line starting with `ready`; returns the process
/// and the rest of that line. Its stderr goes to the test's.
pub fn start(args: &[String], ready: &str) -> (Process, String) {
    start_and_wait(
        Path::new(env!("CARGO_BIN_EXE_cairn")),
        args,
        ready,
        Stdio::inherit(),
    )
    .expect("start cairn")
}

/// A loopback address with a free port (bound and released, so a restarted server can take
/// the same one).
pub fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").to_string()
}

/// `cairn server` on `listen` over the store in `data`; returns it and its URL.
pub fn server(data: &Path, listen: &str) -> (Process, String) {
    start(
        &[
            "server".into(),
            "--data".into(),
            data.display().to_string(),
            "--listen".into(),
            listen.into(),
        ],
        "listening on",
    )
}

/// `cairn worker` for the server at `url`, with extra arguments.
pub fn worker(url: &str, extra: &[&str]) -> Process {
    let mut args = vec!["worker".to_owned(), "--server".into(), url.into()];
    args.extend(extra.iter().map(|a| a.to_string()));
    start(&args, "worker ready").0
}

/// A scripted model in `dir`: `responses` as the script's JSON array, `delay_ms` per call.
pub fn scripted(dir: &Path, name: &str, delay_ms: u64, responses: &str) -> ModelSpec {
    let path = dir.join(name);
    let mut responses: Vec<serde_json::Value> = serde_json::from_str(responses).unwrap();
    for response in &mut responses {
        response["delay_ms"] = delay_ms.into();
    }
    let script = serde_json::json!({ "responses": responses });
    std::fs::write(&path, script.to_string()).unwrap();
    ModelSpec::parse(&format!("scripted:{}", path.display())).unwrap()
}

/// Two parallel calculator calls, then an answer.
pub const TOOL_TURN: &str = r#"[
  {"parts": [
    {"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "1+2"}},
    {"type": "tool_use", "id": "t2", "name": "calculator", "input": {"expression": "3*4"}}]},
  {"parts": [{"type": "text", "text": "3 and 12"}]}
]"#;

fn calculator() -> Vec<ToolSpec> {
    cairn_activities::ToolRegistry::builtin(".")
        .specs()
        .into_iter()
        .filter(|s| s.name == "calculator")
        .collect()
}

/// Checks a finished session: it replays with the current code, its ledger validates, and
/// every tool_use has exactly one recorded result. Returns its history.
pub async fn check_session(client: &Client, session: &str) -> Vec<EventEnvelope> {
    let history = client.history(session).await.expect("history");
    let replayed = replay(session, &history).expect("replays with the current code");
    validate_transcript(&replayed.state.transcript).expect("the ledger validates");
    let mut uses = BTreeMap::new();
    let mut results: BTreeMap<String, usize> = BTreeMap::new();
    for e in &history {
        match &e.event {
            Event::ModelCallCompleted { response, .. } => {
                for part in &response.parts {
                    if let cairn_ledger::Part::ToolUse(u) = part {
                        uses.insert(u.id.clone(), ());
                    }
                }
            }
            Event::ToolCallCompleted { tool_use_id, .. } => {
                *results.entry(tool_use_id.clone()).or_default() += 1;
            }
            _ => {}
        }
    }
    for id in uses.keys() {
        assert_eq!(
            results.get(id),
            Some(&1),
            "{session}: tool_use {id} must have exactly one result"
        );
    }
    history
}

/// How many tool results a history records.
pub fn tool_results(history: &[EventEnvelope]) -> usize {
    history
        .iter()
        .filter(|e| matches!(e.event, Event::ToolCallCompleted { .. }))
        .count()
}

/// How many of `sessions` have a turn running, as `client` describes them.
pub async fn running(client: &Client, sessions: &[(String, u32)]) -> usize {
    let mut running = 0;
    for (id, _) in sessions {
        if client.describe(id).await.unwrap().running_turn.is_some() {
            running += 1;
        }
    }
    running
}

/// Starts `count` sessions (`k00`, `k01`, ...) through `client`, each with a turn sent:
/// what the server acknowledged, as (session, turn).
pub async fn acknowledged_turns(
    client: &Client,
    model: &ModelSpec,
    count: usize,
) -> Vec<(String, u32)> {
    let mut acked = Vec::new();
    for i in 0..count {
        let id = client
            .start_session(options(model, &format!("k{i:02}")))
            .await
            .unwrap();
        let turn = client.send(&id, "go").await.unwrap();
        acked.push((id, turn));
    }
    acked
}

fn options(model: &ModelSpec, id: &str) -> SessionOptions {
    let mut o = SessionOptions::new(model.clone(), calculator());
    o.session_id = Some(id.to_owned());
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_sessions_run_through_a_server_and_three_worker_processes() {
    let dir = tempfile::tempdir().unwrap();
    let model = scripted(dir.path(), "turn.json", 0, TOOL_TURN);
    let (_server, url) = server(&dir.path().join("store"), "127.0.0.1:0");
    let _workers: Vec<Process> = (0..3)
        .map(|_| worker(&url, &["--concurrency", "16"]))
        .collect();
    let client = cairn_remote::connect(&url, None).expect("client");
    let runs: Vec<_> = (0..50)
        .map(|i| {
            let client = client.clone();
            let model = model.clone();
            tokio::spawn(async move {
                let id = client
                    .start_session(options(&model, &format!("s{i:02}")))
                    .await?;
                client.run_turn(&id, "what are 1+2 and 3*4?").await
            })
        })
        .collect();
    for run in runs {
        let outcome = run.await.unwrap().expect("turn");
        assert!(
            matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "3 and 12"),
            "{outcome:?}"
        );
    }
    let sessions = client.sessions().await.unwrap();
    assert_eq!(sessions.len(), 50);
    for s in sessions {
        let history = check_session(&client, &s.session_id).await;
        assert_eq!(tool_results(&history), 2, "{}", s.session_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_activity_lapses_and_another_worker_finishes_the_turn() {
    let dir = tempfile::tempdir().unwrap();
    // Every model call takes 3 s, so the first worker is surely inside one when it dies.
    let model = scripted(dir.path(), "slow.json", 3_000, TOOL_TURN);
    let (_server, url) = server(&dir.path().join("store"), "127.0.0.1:0");
    let mut first = worker(&url, &["--lease-ms", "1500"]);
    let client = cairn_remote::connect(&url, None).expect("client");
    let mut o = options(&model, "lapse");
    o.model_retry = RetryPolicy {
        initial_interval_ms: 10,
        ..RetryPolicy::model_default()
    };
    let id = client.start_session(o).await.unwrap();
    let turn = client.send(&id, "go").await.unwrap();
    // Wait until the first worker holds the model call, then kill it.
    wait_for(&client, &id, |h| {
        h.iter()
            .any(|e| matches!(e.event, Event::ModelAttemptProgress { .. }))
            || started_model_call(h)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.kill();
    let _second = worker(&url, &["--lease-ms", "1500"]);
    let outcome = client.wait_turn(&id, turn).await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    let history = check_session(&client, &id).await;
    let lapsed: Vec<_> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelCallFailed { failure, .. } => Some(failure),
            _ => None,
        })
        .collect();
    assert_eq!(lapsed.len(), 1, "one attempt died with its worker");
    assert_eq!(lapsed[0].class, cairn_runtime::ErrorClass::Timeout);
    assert!(lapsed[0].message.contains("lease lapsed"), "{lapsed:?}");
}

fn started_model_call(history: &[EventEnvelope]) -> bool {
    history
        .iter()
        .any(|e| matches!(e.event, Event::ModelCallScheduled { .. }))
}

/// Polls the history until `done` says so (at most a minute).
async fn wait_for(client: &Client, session: &str, done: impl Fn(&[EventEnvelope]) -> bool) {
    for _ in 0..600 {
        if let Ok(history) = client.history(session).await {
            if done(&history) {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{session}: the history never got there");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_turns_restarts_and_every_acknowledged_turn_completes() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    // Each model call takes 600 ms, so every turn is still running when the server dies.
    let model = scripted(dir.path(), "turn.json", 600, TOOL_TURN);
    let listen = free_addr();
    let (mut server_process, url) = server(&data, &listen);
    let _workers: Vec<Process> = (0..2).map(|_| worker(&url, &[])).collect();
    let client = cairn_remote::connect(&url, None).expect("client");
    // Acknowledged: each session created and its turn sent before the kill.
    let acked = acknowledged_turns(&client, &model, 20).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        running(&client, &acked).await > 0,
        "the kill must land in the middle of turns"
    );
    server_process.kill();
    let (_server, url_again) = server(&data, &listen);
    assert_eq!(url, url_again);
    for (id, turn) in &acked {
        let outcome = client.wait_turn(id, *turn).await.unwrap();
        assert!(
            matches!(outcome, TurnOutcome::Completed { .. }),
            "{id}: {outcome:?}"
        );
        check_session(&client, id).await;
    }
    assert_eq!(client.sessions().await.unwrap().len(), acked.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_goes_only_to_the_worker_that_hosts_it_and_a_task_nobody_runs_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let only_b = dir.path().join("b");
    std::fs::create_dir(&only_b).unwrap();
    std::fs::write(only_b.join("where.txt"), "worker B").unwrap();
    let reads = r#"[
      {"parts": [{"type": "tool_use", "id": "r1", "name": "read_file", "input": {"path": "where.txt"}},
                 {"type": "tool_use", "id": "c1", "name": "calculator", "input": {"expression": "2+2"}}]},
      {"parts": [{"type": "text", "text": "done"}]}
    ]"#;
    let model = scripted(dir.path(), "reads.json", 0, reads);
    let (_server, url) = server(&dir.path().join("store"), "127.0.0.1:0");
    // A hosts the calculator only; B hosts read_file only, in a directory only it has.
    let _a = worker(&url, &["--tools", "calculator"]);
    let _b = worker(
        &url,
        &[
            "--tools",
            "read_file",
            "--workdir",
            only_b.to_str().unwrap(),
        ],
    );
    let client = cairn_remote::connect(&url, None).expect("client");
    let tools = cairn_activities::ToolRegistry::builtin(".").specs();
    let mut o = SessionOptions::new(model.clone(), tools.clone());
    o.session_id = Some("routed".into());
    let id = client.start_session(o).await.unwrap();
    let outcome = client.run_turn(&id, "where?").await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    let history = check_session(&client, &id).await;
    let read = history
        .iter()
        .find_map(|e| match &e.event {
            Event::ToolCallCompleted {
                tool_use_id,
                content,
                is_error,
                ..
            } if tool_use_id == "r1" => Some((format!("{content:?}"), *is_error)),
            _ => None,
        })
        .expect("read_file ran");
    assert!(!read.1 && read.0.contains("worker B"), "{read:?}");

    // A session whose tools go to a queue no worker serves: its call's schedule-to-start
    // deadline fires on the server's timer, with no worker involved.
    let mut o = SessionOptions::new(model, tools);
    o.session_id = Some("stranded".into());
    o.queues = Queues {
        model: None,
        tool: Some("nobody".into()),
    };
    o.tool_retry = RetryPolicy {
        maximum_attempts: 1,
        schedule_to_start_timeout_ms: Some(300),
        ..RetryPolicy::tool_default()
    };
    let id = client.start_session(o).await.unwrap();
    let outcome = client.run_turn(&id, "where?").await.unwrap();
    let history = client.history(&id).await.unwrap();
    let timeouts: Vec<_> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallFailed { failure, .. } => Some(failure.message.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(timeouts.len(), 2, "{outcome:?} {timeouts:?}");
    assert!(
        timeouts.iter().all(|m| m.contains("schedule-to-start")),
        "{timeouts:?}"
    );
    replay(&id, &history).expect("replays");
}

/// Runs `cairn ARGS` to completion.
fn cairn(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .output()
        .expect("run cairn")
}

#[test]
fn while_cairn_run_holds_the_store_other_commands_act_through_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    // The model thinks for 20 s: long enough that the turn is surely running when cancelled.
    let model = scripted(dir.path(), "slow.json", 20_000, TOOL_TURN);
    let model = format!("{}:{}", model.provider, model.model);
    let run = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args([
            "run",
            "--data",
            data.to_str().unwrap(),
            "--session",
            "busy",
            "--model",
            &model,
            "what are 1+2 and 3*4?",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start cairn run");
    let mut run = Process { child: run };
    // Wait until the run serves its socket and the session exists.
    let mut listed = String::new();
    for _ in 0..200 {
        let out = cairn(&["sessions", "--data", data.to_str().unwrap()]);
        listed = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && listed.contains("busy") && listed.contains("running") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        listed.contains("busy") && listed.contains("running"),
        "{listed}"
    );
    let history = cairn(&["history", "--data", data.to_str().unwrap(), "busy"]);
    assert!(history.status.success());
    assert!(String::from_utf8_lossy(&history.stdout).contains("model_call_scheduled"));

    let cancel = cairn(&[
        "cancel",
        "--data",
        data.to_str().unwrap(),
        "busy",
        "--turn",
        "--reason",
        "changed my mind",
    ]);
    assert!(
        cancel.status.success(),
        "{}",
        String::from_utf8_lossy(&cancel.stderr)
    );
    assert!(String::from_utf8_lossy(&cancel.stderr).contains("socket"));
    // The run ends with its turn cancelled, long before the model would have answered.
    let status = run.child.wait().expect("wait for cairn run");
    let mut stdout = String::new();
    use std::io::Read as _;
    if let Some(mut out) = run.child.stdout.take() {
        out.read_to_string(&mut stdout).unwrap();
    }
    assert!(
        stdout.contains("changed my mind") || !status.success(),
        "{status:?} {stdout}"
    );
    // The run is gone: its socket with it, and the store opens directly again.
    assert!(!data.join("cairn.sock").exists());
    let history = cairn(&[
        "history",
        "--data",
        data.to_str().unwrap(),
        "busy",
        "--json",
    ]);
    let text = String::from_utf8_lossy(&history.stdout);
    assert!(
        text.contains("turn_cancelled") && text.contains("changed my mind"),
        "{text}"
    );
}

/// A provider that refuses every request and echoes the API key it was sent in its error, as
/// real providers do ("invalid x-api-key: ..."); answers until the test ends.
fn echoing_provider() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            use std::io::{Read as _, Write as _};
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            // Headers are enough: the key is in one of them.
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let text = String::from_utf8_lossy(&request);
            let key = text
                .lines()
                .find_map(|l| l.strip_prefix("x-api-key: "))
                .unwrap_or("none")
                .to_owned();
            let body = format!(
                r#"{{"type":"error","error":{{"type":"authentication_error","message":"invalid x-api-key: {key}"}}}}"#
            );
            let _ = write!(
                stream,
                "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_keys_stay_with_the_worker_process() {
    const KEY: &str = "sk-ant-test-KEEP-THIS-SECRET-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let provider = echoing_provider();
    let data = dir.path().join("store");
    // The server's own log is kept to be searched for the key.
    let server_log = std::fs::File::create(dir.path().join("server.log")).unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args([
            "server",
            "--data",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(server_log)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    let url = loop {
        let line = lines.next().expect("server output").unwrap();
        if let Some(url) = line.strip_prefix("listening on ") {
            break url.trim().to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});
    let _server = Process { child: server };
    let worker = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["worker", "--server", &url])
        .env("ANTHROPIC_API_KEY", KEY)
        .env("ANTHROPIC_BASE_URL", &provider)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut worker = Process { child: worker };
    let mut ready = BufReader::new(worker.child.stdout.take().unwrap()).lines();
    assert_eq!(ready.next().unwrap().unwrap(), "worker ready");

    let client = cairn_remote::connect(&url, None).unwrap();
    let model = ModelSpec::parse("anthropic:claude-test").unwrap();
    let mut o = SessionOptions::new(model, Vec::new());
    o.session_id = Some("keyed".into());
    let id = client.start_session(o).await.unwrap();
    let outcome = client.run_turn(&id, "hello").await.unwrap();
    // The provider refused the key, and said which: the failure is recorded, scrubbed.
    let TurnOutcome::Failed { reason, .. } = outcome else {
        panic!("the provider refuses every key: {outcome:?}");
    };
    assert!(reason.contains("invalid x-api-key"), "{reason}");
    let history = serde_json::to_string(&client.history(&id).await.unwrap()).unwrap();
    assert!(history.contains("[redacted]"), "{history}");
    assert!(!history.contains(KEY), "the key reached the history");
    drop(_server);
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(!log.contains(KEY), "the key reached the server's log");
    // Nor any file of the store.
    for entry in walk(&data) {
        let bytes = std::fs::read(&entry).unwrap_or_default();
        assert!(
            !bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()),
            "the key is in {}",
            entry.display()
        );
    }
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else if path.is_file() {
            out.push(path);
        }
    }
    out
}
