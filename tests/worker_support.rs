//! What the tests of the worker protocol's headers share (`tool_sets.rs`,
//! `transcripts.rs`): a worker's requests by hand against a real server, the reports a model
//! task gets, a test model's turn, and a proxy that records what a worker is sent.

use crate::server::{send, send_with_headers, Answer, Server};
use cairn_activities::{Error as ActivityError, ModelProvider, ToolRegistry};
use cairn_ledger::{ModelResponse, ModelSpec, Part, StopReason, ToolUse, Usage};
use cairn_remote::HttpTaskSource;
use cairn_runtime::{Client, TurnOutcome};
use cairn_workers::{Activities, ModelResolver, WorkerConfig, WorkerPool};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A model task's report: a calculator call, `toolu_1`.
pub(crate) fn tool_use_report() -> Value {
    json!({"model_completed": {
        "provider": "scripted", "model": "by-hand",
        "parts": [{"tool_use": {"id": "toolu_1", "name": "calculator",
                                "arguments": "{\"expression\":\"1+2\"}"}}],
        "stop_reason_raw": "tool_use", "stop_reason": "tool_use",
        "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_tokens": 0,
                  "cache_write_tokens": 0, "reasoning_tokens": 0}
    }})
}

/// A model task's report: the answer "3".
pub(crate) fn answer_report() -> Value {
    json!({"model_completed": {
        "provider": "scripted", "model": "by-hand",
        "parts": [{"text": {"text": "3"}}],
        "stop_reason_raw": "end_turn", "stop_reason": "end_turn",
        "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_tokens": 0,
                  "cache_write_tokens": 0, "reasoning_tokens": 0}
    }})
}

/// A tool task's report: the calculator's result, "3".
pub(crate) fn tool_result_report() -> Value {
    json!({"tool_completed": {"content": {"text": "3"}, "is_error": false}})
}

/// What a worker's report asks to lease with it: one task.
fn next_one() -> Value {
    json!({"max": 1, "lease_ms": 30000})
}

/// Reports `report` for `task`'s lease through `POST /v1/worker/report` with `header`,
/// leasing one task with it: the task it hands.
pub(crate) async fn report_and_take_next(
    http: &reqwest::Client,
    server: &Server,
    header: Option<(&str, &str)>,
    task: &Value,
    report: Value,
) -> Value {
    let body = json!({"lease": task["lease"], "report": report, "next": next_one()});
    let reported = worker_post(http, server, "/v1/worker/report", header, body).await;
    assert_eq!(reported.status, StatusCode::OK, "{}", reported.body);
    reported.body["tasks"][0].clone()
}

/// Reports `report` for `task`'s lease in a batch of one through `POST /v1/worker/reports`
/// with `header`, leasing one task with it: the task its answer hands.
pub(crate) async fn report_in_batch_and_take_next(
    http: &reqwest::Client,
    server: &Server,
    header: Option<(&str, &str)>,
    task: &Value,
    report: Value,
) -> Value {
    let body = json!({"reports": [{"lease": task["lease"], "report": report, "next": next_one()}]});
    let batch = worker_post(http, server, "/v1/worker/reports", header, body).await;
    assert_eq!(batch.status, StatusCode::OK, "{}", batch.body);
    assert_eq!(batch.body["answers"][0]["status"], 200, "{}", batch.body);
    batch.body["answers"][0]["body"]["tasks"][0].clone()
}

/// What `task`'s lease runs, fetched again through `POST /v1/worker/input` (as a worker
/// that let go of what it kept does): the input whole.
pub(crate) async fn input_again(http: &reqwest::Client, server: &Server, task: &Value) -> Value {
    let again = send(
        http,
        Method::POST,
        server.url("/v1/worker/input"),
        None,
        Some(task["lease"].clone()),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    again.body
}

/// Asserts that a lease request with `header` (name, value), a value that does not parse, is
/// refused: 400 `invalid_request`, its message naming the header as `display_name`.
pub(crate) async fn assert_lease_refused(
    http: &reqwest::Client,
    server: &Server,
    header: (&str, &str),
    display_name: &str,
) {
    let body = json!({"max": 8, "wait_ms": 0, "lease_ms": 30000});
    let refused = worker_post(http, server, "/v1/worker/lease", Some(header), body).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.body);
    assert_eq!(refused.code(), "invalid_request", "{}", refused.body);
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!("{display_name}: ")),
        "{message}"
    );
}

/// Runs a turn of session `id` asking `text` and asserts that the calculator's turn answered
/// it: "3".
pub(crate) async fn assert_turn_answers_3(client: &Client, id: &str, text: &str) {
    let outcome = client.run_turn(id, text).await.unwrap();
    assert!(
        matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "3"),
        "{outcome:?}"
    );
}

/// Creates session `id` offering `tools`, its first turn asking `text`.
pub(crate) async fn start_turn(
    http: &reqwest::Client,
    server: &Server,
    id: &str,
    tools: &Value,
    text: &str,
) {
    let model = json!({"provider": "scripted", "model": "unused.json"});
    let created = send(
        http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": id, "model": model, "tools": tools,
                    "message": {"text": text}})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
}

/// `POST path` with `body`, with `header` (name, value) when given.
pub(crate) async fn worker_post(
    http: &reqwest::Client,
    server: &Server,
    path: &str,
    header: Option<(&str, &str)>,
    body: Value,
) -> Answer {
    let headers: Vec<(&str, &str)> = header.into_iter().collect();
    send_with_headers(
        http,
        Method::POST,
        server.url(path),
        None,
        &headers,
        Some(body),
    )
    .await
}

/// The first task a lease request with `header` gets, waiting for it.
pub(crate) async fn lease_one(
    http: &reqwest::Client,
    server: &Server,
    header: Option<(&str, &str)>,
) -> Value {
    let body = json!({"max": 1, "wait_ms": 30000, "lease_ms": 30000});
    let leased = worker_post(http, server, "/v1/worker/lease", header, body).await;
    assert_eq!(leased.status, StatusCode::OK, "{}", leased.body);
    leased.body["tasks"][0].clone()
}

/// What a leased model task runs.
pub(crate) fn model_input(task: &Value) -> &Value {
    let input = &task["input"]["model"];
    assert!(input.is_object(), "a model task: {task}");
    input
}

/// A test model's answer: the calculator called (`1+2`, as `tool_use_id`) until
/// `answered`, then "3".
pub(crate) fn calculator_turn(answered: bool, tool_use_id: String) -> ModelResponse {
    let parts = if answered {
        vec![Part::text("3")]
    } else {
        vec![Part::ToolUse(ToolUse {
            id: tool_use_id,
            name: "calculator".into(),
            arguments: r#"{"expression":"1+2"}"#.into(),
            signature: None,
        })]
    };
    ModelResponse {
        provider: "seen".into(),
        model: "test".into(),
        parts,
        stop_reason_raw: "x".into(),
        stop_reason: if answered {
            StopReason::EndTurn
        } else {
            StopReason::ToolUse
        },
        usage: Usage::default(),
    }
}

/// Resolves every model spec to one model.
pub(crate) struct OneModel(pub(crate) Arc<dyn ModelProvider>);

impl ModelResolver for OneModel {
    fn resolve(&self, _spec: &ModelSpec) -> Result<Arc<dyn ModelProvider>, ActivityError> {
        Ok(self.0.clone())
    }
}

/// A TCP proxy on loopback in front of `target` (`host:port`), keeping every byte the
/// target sent back: what the worker behind it was sent. Its address as a URL.
pub(crate) async fn recording_proxy(target: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let received = Arc::new(Mutex::new(Vec::new()));
    let kept = received.clone();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let outbound = tokio::net::TcpStream::connect(&target).await.unwrap();
            let (mut in_read, mut in_write) = inbound.into_split();
            let (mut out_read, mut out_write) = outbound.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut in_read, &mut out_write).await });
            let kept = kept.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buffer = vec![0; 64 * 1024];
                while let Ok(n) = out_read.read(&mut buffer).await {
                    if n == 0 || in_write.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                    kept.lock().unwrap().extend_from_slice(&buffer[..n]);
                }
            });
        }
    });
    (url, received)
}

/// A server on a new store in `dir`, a remote worker pool in this process that runs `model`
/// and the built-in tools behind a [`recording_proxy`], and a remote client.
pub(crate) struct ProxiedPool {
    /// Kept for its process, which it stops when dropped.
    _server: Server,
    pool: Option<WorkerPool>,
    pub(crate) client: Client,
    /// Every byte the server sent the pool.
    pub(crate) received: Arc<Mutex<Vec<u8>>>,
}

impl ProxiedPool {
    pub(crate) async fn start(dir: &Path, model: Arc<dyn ModelProvider>) -> ProxiedPool {
        let server = Server::start(&dir.join("store"), &[]);
        let base = server.url("");
        let (proxied, received) =
            recording_proxy(base.trim_start_matches("http://").to_owned()).await;
        let source = Arc::new(HttpTaskSource::new(&proxied, None).unwrap());
        let pool = WorkerPool::start_with(
            source,
            Activities {
                models: Arc::new(OneModel(model)),
                tools: Arc::new(ToolRegistry::builtin(dir)),
            },
            WorkerConfig::default(),
        );
        let client = cairn_remote::connect(&base, None).unwrap();
        ProxiedPool {
            _server: server,
            pool: Some(pool),
            client,
            received,
        }
    }

    /// Stops the pool, its workers done.
    pub(crate) async fn stop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.shutdown().await;
        }
    }

    /// What the server sent the pool, as text.
    pub(crate) fn received(&self) -> String {
        String::from_utf8_lossy(&self.received.lock().unwrap()).into_owned()
    }
}
