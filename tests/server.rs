//! `cairn server` as a real process on loopback: the client routes end to end, the worker
//! protocol driven by hand (lease, report, fencing), in-process workers, tokens and
//! namespaces, malformed requests, the event stream across a reconnect, the drain on SIGTERM,
//! a SIGKILL mid-turn and a restart, schemathesis against the OpenAPI document, and the
//! process's allocator (jemalloc with its purging thread).

use futures_util::StreamExt;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::support::Tmpfs;

/// A `cairn server` child process; killed when dropped.
pub(crate) struct Server {
    child: Child,
    base: String,
}

impl Server {
    /// Starts `cairn server` on a free loopback port and waits for its `listening on` line.
    pub(crate) fn start(data: &Path, extra: &[&str]) -> Server {
        Server::start_on("127.0.0.1:0", data, extra)
    }

    /// Starts `cairn server` listening on `listen` (a restart on the port a killed one had).
    pub(crate) fn start_on(listen: &str, data: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["server", "--data"])
            .arg(data)
            .args(["--listen", listen])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start cairn server");
        let stdout = child.stdout.take().expect("stdout");
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Some(url) = line.strip_prefix("listening on ") {
                    let _ = sender.send(url.to_owned());
                }
            }
        });
        let base = receiver
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| {
                let status = child.try_wait();
                panic!("cairn server did not say where it listens (exit: {status:?})")
            });
        Server { child, base }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid");
        // SAFETY: kill(2) on our own child's pid, which we have not waited for yet.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal})");
    }

    /// Waits for the process to exit.
    async fn exit(&mut self) -> ExitStatus {
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, and wait until it is gone.
    pub(crate) async fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        self.exit().await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One answer: status and JSON body (`Value::Null` when empty).
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) body: Value,
    headers: reqwest::header::HeaderMap,
}

impl Answer {
    /// The error code of an error body, checking its shape.
    pub(crate) fn code(&self) -> &str {
        let message = self.body["error"]["message"].as_str();
        assert!(
            message.is_some_and(|m| !m.is_empty()),
            "not an error body: {}",
            self.body
        );
        self.body["error"]["code"].as_str().unwrap_or_default()
    }
}

pub(crate) async fn send(
    http: &reqwest::Client,
    method: Method,
    url: String,
    token: Option<&str>,
    body: Option<Value>,
) -> Answer {
    send_with_headers(http, method, url, token, &[], body).await
}

/// [`send`] with extra request headers.
pub(crate) async fn send_with_headers(
    http: &reqwest::Client,
    method: Method,
    url: String,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> Answer {
    let mut request = http.request(method, url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("request");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.bytes().await.expect("body");
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&bytes)))
    };
    Answer {
        status,
        body,
        headers,
    }
}

/// A scripted model spec playing `responses` (one text answer each).
pub(crate) fn script(dir: &Path, answers: &[&str]) -> Value {
    let path = dir.join("script.json");
    let responses: Vec<Value> = answers
        .iter()
        .map(|a| json!({"parts": [{"type": "text", "text": a}]}))
        .collect();
    std::fs::write(&path, json!({"responses": responses}).to_string()).expect("script");
    json!({"provider": "scripted", "model": path.display().to_string()})
}

/// What a worker reports for a model task: a final text answer.
fn answer(text: &str) -> Value {
    json!({"model_completed": {
        "provider": "scripted", "model": "by-hand",
        "parts": [{"text": {"text": text}}],
        "stop_reason_raw": "end_turn", "stop_reason": "end_turn",
        "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_tokens": 0,
                  "cache_write_tokens": 0, "reasoning_tokens": 0}
    }})
}

/// Fast retries, so a lapsed lease's attempt is retried at once.
fn fast_retry() -> Value {
    json!({"initial_interval_ms": 0, "backoff_coefficient": 1.0, "maximum_interval_ms": 0,
           "maximum_attempts": 5, "non_retryable": [], "start_to_close_timeout_ms": 60000})
}

/// Long-polls a turn until it ends (the server answers `done: false` every `timeout_ms`).
pub(crate) async fn wait_turn(
    http: &reqwest::Client,
    server: &Server,
    token: Option<&str>,
    id: &str,
    turn: u32,
) -> Value {
    for _ in 0..120 {
        let wait = send(
            http,
            Method::GET,
            server.url(&format!("/v1/sessions/{id}/turns/{turn}?timeout_ms=1000")),
            token,
            None,
        )
        .await;
        assert_eq!(wait.status, StatusCode::OK, "{}", wait.body);
        if wait.body["done"] == true {
            return wait.body["outcome"].clone();
        }
    }
    panic!("turn {turn} of {id} did not end");
}

/// Leases one task, waiting for it.
async fn lease_one(
    http: &reqwest::Client,
    server: &Server,
    token: Option<&str>,
    lease_ms: u64,
) -> Value {
    let leased = send(
        http,
        Method::POST,
        server.url("/v1/worker/lease"),
        token,
        Some(json!({"max": 1, "wait_ms": 30000, "lease_ms": lease_ms})),
    )
    .await;
    assert_eq!(leased.status, StatusCode::OK, "{}", leased.body);
    let tasks = leased.body["tasks"].as_array().expect("tasks");
    assert_eq!(tasks.len(), 1, "{}", leased.body);
    tasks[0].clone()
}

pub(crate) async fn history(
    http: &reqwest::Client,
    server: &Server,
    token: Option<&str>,
    id: &str,
) -> Vec<Value> {
    let page = send(
        http,
        Method::GET,
        server.url(&format!("/v1/sessions/{id}/history")),
        token,
        None,
    )
    .await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    page.body["events"].as_array().expect("events").clone()
}

pub(crate) fn kinds(events: &[Value]) -> Vec<&str> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or("?"))
        .collect()
}

#[tokio::test]
async fn a_session_runs_through_the_client_routes_with_a_worker_driven_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    let model = json!({"provider": "scripted", "model": "unused.json"});

    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "s1", "model": model, "system_prompt": "Be brief."})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert_eq!(created.body["session_id"], "s1");
    let again = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "s1", "model": model})),
    )
    .await;
    assert_eq!(
        (again.status, again.code()),
        (StatusCode::CONFLICT, "conflict")
    );
    let generated = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"model": model})),
    )
    .await;
    assert_eq!(generated.status, StatusCode::CREATED);
    let generated_id = generated.body["session_id"].as_str().unwrap().to_owned();
    for bad in [
        json!({"model": {"provider": "", "model": "m"}}),
        json!({"session_id": "no spaces", "model": model}),
        json!({"session_id": "a:b", "model": model}),
    ] {
        let refused = send(
            &http,
            Method::POST,
            server.url("/v1/sessions"),
            None,
            Some(bad.clone()),
        )
        .await;
        assert_eq!(
            (refused.status, refused.code()),
            (StatusCode::BAD_REQUEST, "invalid_request"),
            "{bad}"
        );
    }

    let listed = send(
        &http,
        Method::GET,
        server.url("/v1/sessions?limit=1"),
        None,
        None,
    )
    .await;
    assert_eq!(listed.status, StatusCode::OK);
    let first = listed.body["sessions"][0]["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let next = listed.body["next_after"]
        .as_str()
        .expect("a second page")
        .to_owned();
    assert_eq!(first, next);
    let rest = send(
        &http,
        Method::GET,
        server.url(&format!("/v1/sessions?after={next}")),
        None,
        None,
    )
    .await;
    let mut ids: Vec<String> = std::iter::once(first)
        .chain(
            rest.body["sessions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["session_id"].as_str().unwrap().to_owned()),
        )
        .collect();
    ids.sort();
    let mut expected = vec!["s1".to_owned(), generated_id];
    expected.sort();
    assert_eq!(ids, expected);
    assert!(rest.body["next_after"].is_null());

    let empty = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/messages"),
        None,
        Some(json!({"text": ""})),
    )
    .await;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
    let started = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/messages"),
        None,
        Some(json!({"text": "What is 6 * 7?"})),
    )
    .await;
    assert_eq!(started.status, StatusCode::ACCEPTED, "{}", started.body);
    assert_eq!(started.body["turn"], 1);
    let busy = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/messages"),
        None,
        Some(json!({"text": "And 7 * 8?"})),
    )
    .await;
    assert_eq!(
        (busy.status, busy.code()),
        (StatusCode::CONFLICT, "conflict")
    );
    let pending = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/s1/turns/1?timeout_ms=10"),
        None,
        None,
    )
    .await;
    assert_eq!(pending.body, json!({"done": false, "outcome": null}));
    let no_turn = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/s1/turns/2?timeout_ms=10"),
        None,
        None,
    )
    .await;
    assert_eq!(no_turn.status, StatusCode::NOT_FOUND);
    let running = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/s1"),
        None,
        None,
    )
    .await;
    assert_eq!(running.body["status"], "running");
    assert_eq!(running.body["running_turn"], 1);
    assert_eq!(running.body["pending_tasks"][0]["activity"], "model:0");

    // The worker's side: what the task runs, then the answer.
    let task = lease_one(&http, &server, None, 30_000).await;
    assert_eq!(task["lease"]["id"]["session_id"], "s1");
    let transcript = &task["input"]["model"]["transcript"]["messages"];
    assert_eq!(
        transcript[1]["parts"][0]["text"]["text"], "What is 6 * 7?",
        "{task}"
    );
    let input = crate::worker_support::input_again(&http, &server, &task).await;
    assert_eq!(input, task["input"]);
    let renewed = send(
        &http,
        Method::POST,
        server.url("/v1/worker/heartbeat"),
        None,
        Some(json!({"lease": task["lease"], "lease_ms": 30000, "details": {"step": 1.0}})),
    )
    .await;
    assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.body);
    assert!(
        renewed.body["expires_at_ms"].as_u64().unwrap()
            >= task["lease"]["expires_at_ms"].as_u64().unwrap()
    );
    let progress = send(
        &http,
        Method::POST,
        server.url("/v1/worker/progress"),
        None,
        Some(json!({"lease": task["lease"], "text_appended": "4", "thinking_appended": ""})),
    )
    .await;
    assert_eq!(progress.status, StatusCode::NO_CONTENT, "{}", progress.body);
    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": task["lease"], "report": answer("42")})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::NO_CONTENT, "{}", reported.body);

    let outcome = wait_turn(&http, &server, None, "s1", 1).await;
    assert_eq!(
        outcome,
        json!({
            "status": "completed", "turn": 1, "answer": "42", "stop_reason": "end_turn",
            // The hand-made answer has usage and no price: its cost is unknown.
            "totals": {
                "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_tokens": 0,
                          "cache_write_tokens": 0, "reasoning_tokens": 0},
                "cost_micros": 0, "unpriced_attempts": 1, "model_calls": 1
            }
        })
    );
    let described = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/s1"),
        None,
        None,
    )
    .await;
    assert_eq!(described.body["status"], "idle");
    assert_eq!(described.body["turns"], 1);
    assert_eq!(described.body["usage"]["input_tokens"], 3);
    assert_eq!(described.body["model"], model);

    let events = history(&http, &server, None, "s1").await;
    assert_eq!(
        kinds(&events),
        [
            "session_started",
            "user_message",
            "model_call_scheduled",
            "model_attempt_progress",
            "model_call_completed",
            "turn_completed"
        ]
    );
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["seq"], i as u64 + 1);
        assert_eq!(event["session_id"], "s1");
    }
    let page = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/s1/history?from_seq=3&limit=2"),
        None,
        None,
    )
    .await;
    assert_eq!(page.body["events"].as_array().unwrap().len(), 2);
    assert_eq!(page.body["events"][0], events[2]);
    assert_eq!(page.body["next_seq"], 5);

    let ledger = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/s1/transcript"),
        None,
        None,
    )
    .await;
    let messages = ledger.body["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 3, "{}", ledger.body);
    assert_eq!(messages[2]["parts"][0]["text"]["text"], "42");
    let anthropic = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/s1/transcript?as=anthropic&model=claude-x"),
        None,
        None,
    )
    .await;
    assert_eq!(anthropic.status, StatusCode::OK, "{}", anthropic.body);
    assert_eq!(anthropic.body["model"], "claude-x");
    assert_eq!(
        anthropic.body["system"][0]["text"], "Be brief.",
        "{}",
        anthropic.body
    );
    let unknown_format = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/s1/transcript?as=gopher"),
        None,
        None,
    )
    .await;
    assert_eq!(unknown_format.status, StatusCode::BAD_REQUEST);

    let nothing_runs = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/cancel"),
        None,
        Some(json!({"turn_only": true})),
    )
    .await;
    assert_eq!(
        (nothing_runs.status, nothing_runs.code()),
        (StatusCode::CONFLICT, "conflict")
    );
    let turn2 = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/messages"),
        None,
        Some(json!({"text": "More?"})),
    )
    .await;
    assert_eq!(turn2.body["turn"], 2);
    let cancelled_turn = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/cancel"),
        None,
        Some(json!({"turn_only": true, "reason": "changed my mind"})),
    )
    .await;
    assert_eq!(cancelled_turn.body, json!({"turn": 2}));
    let outcome = wait_turn(&http, &server, None, "s1", 2).await;
    assert_eq!(
        outcome,
        json!({
            "status": "cancelled", "turn": 2, "reason": "changed my mind",
            // Its model call was scheduled and never answered.
            "totals": {
                "usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_tokens": 0,
                          "cache_write_tokens": 0, "reasoning_tokens": 0},
                "cost_micros": 0, "unpriced_attempts": 0, "model_calls": 1
            }
        })
    );
    let cancelled = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/cancel"),
        None,
        Some(json!({})),
    )
    .await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    let after = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/messages"),
        None,
        Some(json!({"text": "Hello?"})),
    )
    .await;
    assert_eq!(
        (after.status, after.code()),
        (StatusCode::CONFLICT, "conflict")
    );
    let listed = send(
        &http,
        Method::GET,
        server.url("/v1/sessions?status=cancelled"),
        None,
        None,
    )
    .await;
    assert_eq!(listed.body["sessions"].as_array().unwrap().len(), 1);
    assert_eq!(listed.body["sessions"][0]["session_id"], "s1");

    for path in [
        "/v1/sessions/nope",
        "/v1/sessions/nope/history",
        "/v1/sessions/nope/transcript",
        "/v1/sessions/nope/turns/1",
        "/v1/sessions/nope/events",
    ] {
        let missing = send(&http, Method::GET, server.url(path), None, None).await;
        assert_eq!(
            (missing.status, missing.code()),
            (StatusCode::NOT_FOUND, "not_found"),
            "{path}"
        );
    }
}

#[tokio::test]
async fn a_turn_completes_end_to_end_with_in_process_workers() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["The answer is 42."]);
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "2"]);
    let http = reqwest::Client::new();
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"model": model})),
    )
    .await;
    let id = created.body["session_id"].as_str().unwrap().to_owned();
    let started = send(
        &http,
        Method::POST,
        server.url(&format!("/v1/sessions/{id}/messages")),
        None,
        Some(json!({"text": "What is 6 * 7?"})),
    )
    .await;
    assert_eq!(started.status, StatusCode::ACCEPTED);
    let outcome = wait_turn(&http, &server, None, &id, 1).await;
    assert_eq!(
        outcome,
        json!({
            "status": "completed", "turn": 1, "answer": "The answer is 42.",
            "stop_reason": "end_turn",
            "totals": {
                "usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_tokens": 0,
                          "cache_write_tokens": 0, "reasoning_tokens": 0},
                "cost_micros": 0, "unpriced_attempts": 0, "model_calls": 1
            }
        })
    );
    // Tasks of a provider the in-process workers do not host stay queued for a remote worker.
    let elsewhere = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "remote", "model": {"provider": "custom", "model": "m"}})),
    )
    .await;
    assert_eq!(elsewhere.status, StatusCode::CREATED);
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions/remote/messages"),
        None,
        Some(json!({"text": "hi"})),
    )
    .await;
    let task = lease_one(&http, &server, None, 30_000).await;
    assert_eq!(task["lease"]["id"]["session_id"], "remote");
    assert_eq!(task["input"]["model"]["model"]["provider"], "custom");
}

/// `POST /v1/sessions` with a first message starts turn 1 with the session: one request, one
/// durable commit (the store's count in `/v1/health`), the answer naming the turn, and the
/// turn runs on the server's workers. A bad first message is refused like a bad `messages`
/// body, naming its field, and records nothing.
#[tokio::test]
async fn a_session_created_with_its_first_message_starts_turn_one_in_one_commit() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["Hello to you."]);
    // No workers yet: the commit count holds still while it is read.
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "0"]);
    let http = reqwest::Client::new();
    let commits = |body: &Value| body["store_syncs"]["durable_commits"].as_u64().unwrap();
    let before = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "first", "model": model, "message": {"text": "hello"}})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert_eq!(created.body, json!({"session_id": "first", "turn": 1}));
    let after = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
    assert_eq!(
        commits(&after.body),
        commits(&before.body) + 1,
        "{}",
        after.body
    );
    let events = history(&http, &server, None, "first").await;
    assert_eq!(
        kinds(&events),
        ["session_started", "user_message", "model_call_scheduled"]
    );
    assert_eq!(
        events[1]["event"]["user_message"]["text"], "hello",
        "{}",
        events[1]
    );

    // Without a message: no turn in the answer, as before.
    let alone = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "alone", "model": model})),
    )
    .await;
    assert_eq!(alone.body, json!({"session_id": "alone"}));

    for (message, field) in [
        (json!({"text": ""}), "message.text"),
        (
            json!({"text": "hi", "model": {"provider": "", "model": "x"}}),
            "message.model",
        ),
        (
            json!({"text": "hi", "media": [{"kind": "image", "source": {"url": {"url": "ftp://example.com/x.png"}}}]}),
            "message.media[0]",
        ),
    ] {
        let refused = send(
            &http,
            Method::POST,
            server.url("/v1/sessions"),
            None,
            Some(json!({"session_id": "bad", "model": model, "message": message})),
        )
        .await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.body);
        assert_eq!(refused.code(), "invalid_request");
        let said = refused.body["error"]["message"].as_str().unwrap();
        assert!(said.starts_with(field), "{field}: {said}");
    }
    let missing = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/bad"),
        None,
        None,
    )
    .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.body);
    drop(server);

    // With workers, the turn runs to its end.
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "1"]);
    let outcome = wait_turn(&http, &server, None, "first", 1).await;
    assert_eq!(outcome["answer"], "Hello to you.", "{outcome}");
}

/// `wait_ms` on the two routes that start a turn: the answer waits for the turn and carries
/// its outcome (201 for a new session, 200 for a message), the same outcome a long poll then
/// reads; without workers it answers after the wait without one (the turn started, 202 for a
/// message); a new session without a message is answered at once; a bad `wait_ms` is refused
/// naming it, with nothing recorded.
#[tokio::test]
async fn a_request_that_starts_a_turn_can_wait_for_its_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["One.", "Two.", "Three."]);
    let http = reqwest::Client::new();
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "0"]);
    // No worker: the wait runs out and the answer has no outcome.
    let unfinished = send(
        &http,
        Method::POST,
        server.url("/v1/sessions?wait_ms=200"),
        None,
        Some(json!({"session_id": "waits", "model": model, "message": {"text": "one"}})),
    )
    .await;
    assert_eq!(
        unfinished.status,
        StatusCode::CREATED,
        "{}",
        unfinished.body
    );
    assert_eq!(unfinished.body, json!({"session_id": "waits", "turn": 1}));
    for (query, body, said) in [
        (
            "wait_ms=soon",
            json!({"session_id": "bad", "model": model, "message": {"text": "x"}}),
            "wait_ms",
        ),
        (
            "wait=5",
            json!({"session_id": "bad", "model": model, "message": {"text": "x"}}),
            "unknown field `wait`",
        ),
    ] {
        let refused = send(
            &http,
            Method::POST,
            server.url(&format!("/v1/sessions?{query}")),
            None,
            Some(body),
        )
        .await;
        assert_eq!(
            refused.status,
            StatusCode::BAD_REQUEST,
            "{query}: {}",
            refused.body
        );
        assert_eq!(refused.code(), "invalid_request");
        let message = refused.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(said), "{query}: {message}");
    }
    // A new session without a message has no turn to wait for: answered at once.
    let alone = send(
        &http,
        Method::POST,
        server.url("/v1/sessions?wait_ms=30000"),
        None,
        Some(json!({"session_id": "alone", "model": model})),
    )
    .await;
    assert_eq!(alone.status, StatusCode::CREATED, "{}", alone.body);
    assert_eq!(alone.body, json!({"session_id": "alone"}));
    let refused = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/waits/messages?wait_ms=-1"),
        None,
        Some(json!({"text": "two"})),
    )
    .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.body);
    assert!(refused.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("wait_ms"));
    let missing = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/bad"),
        None,
        None,
    )
    .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.body);
    assert_eq!(
        kinds(&history(&http, &server, None, "waits").await).len(),
        3,
        "only turn 1 began"
    );
    drop(server);

    // With a worker: turn 1 ends; then a message with wait_ms gets its turn's outcome.
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "1"]);
    let first = wait_turn(&http, &server, None, "waits", 1).await;
    assert_eq!(first["answer"], "One.", "{first}");
    let second = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/waits/messages?wait_ms=30000"),
        None,
        Some(json!({"text": "two"})),
    )
    .await;
    assert_eq!(second.status, StatusCode::OK, "{}", second.body);
    assert_eq!(second.body["turn"], 2, "{}", second.body);
    assert_eq!(
        second.body["outcome"]["status"], "completed",
        "{}",
        second.body
    );
    assert_eq!(second.body["outcome"]["answer"], "Two.", "{}", second.body);
    assert_eq!(
        wait_turn(&http, &server, None, "waits", 2).await,
        second.body["outcome"]
    );
    // Without wait_ms, as before: 202 and the turn alone.
    let third = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/waits/messages"),
        None,
        Some(json!({"text": "three"})),
    )
    .await;
    assert_eq!(third.status, StatusCode::ACCEPTED, "{}", third.body);
    assert_eq!(third.body, json!({"turn": 3}));
    assert_eq!(
        wait_turn(&http, &server, None, "waits", 3).await["answer"],
        "Three."
    );

    // A new session, its first message and the wait in one request.
    // A script of its own: the worker keeps a script it read.
    let other = dir.path().join("in-one");
    std::fs::create_dir(&other).unwrap();
    let model = script(&other, &["Hello in one."]);
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions?wait_ms=30000"),
        None,
        Some(json!({"session_id": "in-one", "model": model, "message": {"text": "hi"}})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert_eq!(created.body["session_id"], "in-one");
    assert_eq!(created.body["turn"], 1);
    assert_eq!(
        created.body["outcome"]["answer"], "Hello in one.",
        "{}",
        created.body
    );
    assert_eq!(
        wait_turn(&http, &server, None, "in-one", 1).await,
        created.body["outcome"]
    );
    let events = history(&http, &server, None, "in-one").await;
    assert_eq!(kinds(&events).last().copied(), Some("turn_completed"));
}

/// Eager dispatch over HTTP: a report with `next` is answered with the task it queued,
/// leased to the reporting worker (200), and one without `next` keeps its 204. The turn then
/// completes with the history a lease round per task would give. Deltas a report carries
/// reach the session's followers before the report's events.
#[tokio::test]
async fn a_report_with_next_hands_the_worker_the_task_it_queued_again_if_sent_again_and_deltas_precede_it(
) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    let model = json!({"provider": "scripted", "model": "unused.json"});
    let calculator =
        serde_json::to_value(cairn_activities::Tool::spec(&cairn_activities::Calculator)).unwrap();
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "eager", "model": model, "tools": [calculator]})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let sent = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/eager/messages"),
        None,
        Some(json!({"text": "1+2?"})),
    )
    .await;
    assert_eq!(sent.status, StatusCode::ACCEPTED, "{}", sent.body);

    let model_task = lease_one(&http, &server, None, 30_000).await;
    let call = crate::worker_support::tool_use_report();
    let next = json!({"max": 1, "lease_ms": 30000});
    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": model_task["lease"], "report": call, "next": next})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::OK, "{}", reported.body);
    let tasks = reported.body["tasks"].as_array().expect("tasks").clone();
    assert_eq!(tasks.len(), 1, "{}", reported.body);
    let tool_task = &tasks[0];
    assert_eq!(tool_task["lease"]["id"]["session_id"], "eager");
    assert_eq!(tool_task["lease"]["kind"], "tool");
    assert_eq!(tool_task["lease"]["lease_attempt"], 1);
    assert_eq!(
        tool_task["input"]["tool"]["tool_use"]["name"], "calculator",
        "{tool_task}"
    );
    // The same report sent again (its answer lost on the way) is answered as the first
    // was: the same task, under the same lease, with its input fetched again.
    let again = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": model_task["lease"], "report": call, "next": next})),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(again.body["tasks"], json!([tool_task]), "{}", again.body);
    // The task is the worker's: nobody else can lease it.
    let nothing = send(
        &http,
        Method::POST,
        server.url("/v1/worker/lease"),
        None,
        Some(json!({"max": 8, "wait_ms": 0, "lease_ms": 30000})),
    )
    .await;
    assert_eq!(nothing.body["tasks"], json!([]), "{}", nothing.body);

    let result = json!({"tool_completed": {"content": {"text": "3"}, "is_error": false}});
    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": tool_task["lease"], "report": result, "next": next})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::OK, "{}", reported.body);
    let tasks = reported.body["tasks"].as_array().expect("tasks").clone();
    assert_eq!(tasks.len(), 1, "{}", reported.body);
    assert_eq!(tasks[0]["lease"]["kind"], "model");
    let transcript = tasks[0]["input"]["model"]["transcript"].to_string();
    assert!(transcript.contains("toolu_1"), "{transcript}");
    // The worker reported the task handed with the first report, so it had that answer:
    // the first report is forgotten, and a try of it now finds it recorded.
    let late = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": model_task["lease"], "report": call, "next": next})),
    )
    .await;
    assert_eq!(late.status, StatusCode::CONFLICT, "{}", late.body);
    assert_eq!(late.body["error"]["code"], "stale_report", "{}", late.body);

    // The last report carries the answer's streamed text, not sent before: a follower of the
    // session gets it ahead of the report's events.
    let stream = http
        .get(server.url("/v1/sessions/eager/events?after_seq=7"))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), StatusCode::OK);
    let origin = json!({"session_id": "eager", "turn": 1, "activity": "model:6", "attempt": 1});
    let deltas = json!([
        {"origin": origin, "delta": {"text": "the answer "}},
        {"origin": origin, "delta": {"text": "is 3"}}
    ]);
    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": tasks[0]["lease"], "report": answer("3"), "deltas": deltas})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::NO_CONTENT, "{}", reported.body);
    let followed = read_stream(stream, |m| {
        m.event == "event" && m.data["kind"] == "turn_completed"
    })
    .await;
    let order: Vec<String> = followed
        .iter()
        .map(|m| match m.event.as_str() {
            "delta" => format!("delta {}", m.data["delta"]["text"].as_str().unwrap_or("?")),
            _ => m.data["kind"].as_str().unwrap_or("?").to_owned(),
        })
        .collect();
    assert_eq!(
        order,
        [
            "delta the answer ",
            "delta is 3",
            "model_call_completed",
            "turn_completed"
        ],
        "{followed:?}"
    );
    let outcome = wait_turn(&http, &server, None, "eager", 1).await;
    assert_eq!(outcome["status"], "completed", "{outcome}");
    assert_eq!(outcome["answer"], "3", "{outcome}");
    assert_eq!(
        kinds(&history(&http, &server, None, "eager").await),
        [
            "session_started",
            "user_message",
            "model_call_scheduled",
            "model_call_completed",
            "tool_call_scheduled",
            "tool_call_completed",
            "model_call_scheduled",
            "model_call_completed",
            "turn_completed"
        ]
    );
}

/// A session `session_id` whose model asked for two calculator calls, their tasks leased
/// with the model's report (through `POST /v1/worker/report`, by hand).
async fn two_tool_tasks(http: &reqwest::Client, server: &Server, session_id: &str) -> Vec<Value> {
    let model = json!({"provider": "scripted", "model": "unused.json"});
    let calculator =
        serde_json::to_value(cairn_activities::Tool::spec(&cairn_activities::Calculator)).unwrap();
    let created = send(
        http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(
            json!({"session_id": session_id, "model": model, "tools": [calculator],
                    "message": {"text": "1+2 and 3*4?"}}),
        ),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let model_task = lease_one(http, server, None, 30_000).await;
    let usage = json!({"input_tokens": 3, "output_tokens": 2, "cache_read_tokens": 0,
                       "cache_write_tokens": 0, "reasoning_tokens": 0});
    let calls = json!({"model_completed": {
        "provider": "scripted", "model": "by-hand",
        "parts": [{"tool_use": {"id": "toolu_1", "name": "calculator",
                                "arguments": "{\"expression\":\"1+2\"}"}},
                  {"tool_use": {"id": "toolu_2", "name": "calculator",
                                "arguments": "{\"expression\":\"3*4\"}"}}],
        "stop_reason_raw": "tool_use", "stop_reason": "tool_use", "usage": usage
    }});
    let reported = send(
        http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": model_task["lease"], "report": calls,
                    "next": {"max": 2, "lease_ms": 30000}})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::OK, "{}", reported.body);
    let tool_tasks = reported.body["tasks"].as_array().expect("tasks").clone();
    assert_eq!(tool_tasks.len(), 2, "{}", reported.body);
    tool_tasks
}

/// Reports sent together (`POST /v1/worker/reports`) are each recorded as if sent alone and
/// answered in order with what `POST /v1/worker/report` would have answered each: 200 with
/// the tasks leased with it, 204 without `next`, an error for one that is refused, which
/// leaves the others recorded. A batch of none, or of more than the server takes, is refused
/// whole.
#[tokio::test]
async fn reports_sent_together_are_each_recorded_and_answered_as_if_alone() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    let tool_tasks = two_tool_tasks(&http, &server, "batched").await;
    let result =
        |text: &str| json!({"tool_completed": {"content": {"text": text}, "is_error": false}});
    let unknown = json!({"id": {"session_id": "nobody", "scheduled_seq": 3}, "kind": "tool",
                         "lease_attempt": 1, "expires_at_ms": 4_000_000_000_000u64});
    let batch = send(
        &http,
        Method::POST,
        server.url("/v1/worker/reports"),
        None,
        Some(json!({"reports": [
            {"lease": tool_tasks[0]["lease"], "report": result("3"),
             "next": {"max": 1, "lease_ms": 30000}},
            {"lease": unknown, "report": result("lost")},
            {"lease": tool_tasks[1]["lease"], "report": result("12")},
        ]})),
    )
    .await;
    assert_eq!(batch.status, StatusCode::OK, "{}", batch.body);
    let answers = batch.body["answers"].as_array().expect("answers");
    assert_eq!(answers.len(), 3, "{}", batch.body);
    assert_eq!(answers[0]["status"], 200, "{}", batch.body);
    assert_eq!(answers[1]["status"], 404, "{}", batch.body);
    assert_eq!(
        answers[1]["body"]["error"]["code"], "not_found",
        "{}",
        batch.body
    );
    assert_eq!(answers[2]["status"], 204, "{}", batch.body);
    assert!(answers[2].get("body").is_none(), "{}", batch.body);
    // The two results were recorded at once: the one recorded second queued the model's
    // next call, which the first report leased if it was that one.
    let handed = answers[0]["body"]["tasks"]
        .as_array()
        .expect("tasks")
        .clone();
    let next_call = match handed.as_slice() {
        [task] => task.clone(),
        [] => lease_one(&http, &server, None, 30_000).await,
        more => panic!("{more:?}"),
    };
    assert_eq!(next_call["lease"]["kind"], "model", "{next_call}");
    let transcript = next_call["input"]["model"]["transcript"].to_string();
    assert!(
        transcript.contains("toolu_1") && transcript.contains("toolu_2"),
        "{transcript}"
    );
    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": next_call["lease"], "report": answer("3 and 12")})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::NO_CONTENT, "{}", reported.body);
    let outcome = wait_turn(&http, &server, None, "batched", 1).await;
    assert_eq!(outcome["answer"], "3 and 12", "{outcome}");
    assert_eq!(
        kinds(&history(&http, &server, None, "batched").await),
        [
            "session_started",
            "user_message",
            "model_call_scheduled",
            "model_call_completed",
            "tool_call_scheduled",
            "tool_call_scheduled",
            "tool_call_completed",
            "tool_call_completed",
            "model_call_scheduled",
            "model_call_completed",
            "turn_completed"
        ]
    );

    // Refused whole: a batch of none, and one of more than the server takes.
    let one = json!({"lease": unknown, "report": result("x")});
    for count in [0, cairn_runtime::wire::MAX_REPORTS_PER_BATCH + 1] {
        let refused = send(
            &http,
            Method::POST,
            server.url("/v1/worker/reports"),
            None,
            Some(json!({"reports": vec![one.clone(); count]})),
        )
        .await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.body);
        assert_eq!(
            refused.body["error"]["code"], "invalid_request",
            "{}",
            refused.body
        );
    }
    // So is a batch with a report whose media break their rules, naming it, before the
    // other reports are recorded.
    let media = json!({"tool_completed": {"is_error": false, "content": {"blocks": [
        {"media": {"kind": "image", "source": {"url": {"url": "ftp://example.com/a.png"}}}}
    ]}}});
    let refused = send(
        &http,
        Method::POST,
        server.url("/v1/worker/reports"),
        None,
        Some(json!({"reports": [one, {"lease": unknown, "report": media}]})),
    )
    .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.body);
    let message = refused.body["error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.starts_with("reports[1]: media"), "{message}");
}

/// The store's durable commits so far, as `/v1/health` reports them.
async fn durable_commits(http: &reqwest::Client, server: &Server) -> u64 {
    let health = send(http, Method::GET, server.url("/v1/health"), None, None).await;
    health.body["store_syncs"]["durable_commits"]
        .as_u64()
        .unwrap_or_else(|| panic!("no durable commits in {}", health.body))
}

/// Sends `reports` in one `POST /v1/worker/reports`, which must be answered 200; the
/// answers' statuses, and the first answer's body.
async fn reports_at_once(
    http: &reqwest::Client,
    server: &Server,
    reports: Value,
) -> (Vec<u64>, Value) {
    let batch = send(
        http,
        Method::POST,
        server.url("/v1/worker/reports"),
        None,
        Some(json!({ "reports": reports })),
    )
    .await;
    assert_eq!(batch.status, StatusCode::OK, "{}", batch.body);
    let answers = batch.body["answers"].as_array().expect("answers");
    let statuses = answers
        .iter()
        .map(|a| a["status"].as_u64().expect("status"))
        .collect();
    (statuses, answers[0]["body"].clone())
}

/// Reports of one session next to each other in a batch (a model's parallel calls that one
/// worker slot ran in turn) are recorded in one append, which leases the model's next call to
/// the first of them; a report sent twice in one batch is recorded once, and the batch is
/// answered.
#[tokio::test]
async fn reports_of_one_session_next_to_each_other_in_a_batch_share_one_commit() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    let result =
        |text: &str| json!({"tool_completed": {"content": {"text": text}, "is_error": false}});
    // Several sessions: two reports sent at once may also happen to share a commit.
    let mut next_call = Value::Null;
    for session in 0..6 {
        let tool_tasks = two_tool_tasks(&http, &server, &format!("together-{session}")).await;
        let before = durable_commits(&http, &server).await;
        let (statuses, first) = reports_at_once(
            &http,
            &server,
            json!([
                {"lease": tool_tasks[0]["lease"], "report": result("3"),
                 "next": {"max": 1, "lease_ms": 30000}},
                {"lease": tool_tasks[1]["lease"], "report": result("12")},
            ]),
        )
        .await;
        assert_eq!(statuses, [200, 204], "{first}");
        assert_eq!(
            durable_commits(&http, &server).await,
            before + 1,
            "session {session}: both results and the lease of the call they queued in one commit"
        );
        let handed = first["tasks"].as_array().expect("tasks");
        assert_eq!(handed.len(), 1, "the model's next call: {first}");
        next_call = handed[0].clone();
        assert_eq!(next_call["lease"]["kind"], "model", "{next_call}");
        let transcript = next_call["input"]["model"]["transcript"].to_string();
        assert!(
            transcript.contains("toolu_1") && transcript.contains("toolu_2"),
            "{transcript}"
        );
    }
    // The model's answer sent twice in one batch: recorded once; the second is answered as
    // a try sent again (204) or finds it recorded (409), as it would by itself.
    let twice = json!({"lease": next_call["lease"], "report": answer("3 and 12")});
    let (statuses, _) = reports_at_once(&http, &server, json!([twice, twice])).await;
    assert!(
        statuses.contains(&204) && statuses.iter().all(|s| [204, 409].contains(s)),
        "{statuses:?}"
    );
    let outcome = wait_turn(&http, &server, None, "together-5", 1).await;
    assert_eq!(outcome["answer"], "3 and 12", "{outcome}");
    let history = history(&http, &server, None, "together-5").await;
    let kinds = kinds(&history);
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == "model_call_completed")
            .count(),
        2,
        "{kinds:?}"
    );
    assert_eq!(kinds.last().copied(), Some("turn_completed"), "{kinds:?}");
}

/// A lease request sent again under its `Idempotency-Key` (as after an answer lost on the
/// way) is answered with the tasks the first leased, under the same leases, rather than
/// those tasks waiting, leased to nobody, for their leases to lapse; once the worker reports
/// one, the key is forgotten. A worker that hangs up during its long poll (it is stopping)
/// is leased nothing.
#[tokio::test]
async fn a_lease_request_sent_again_under_its_key_gets_what_the_lost_answer_held() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    let lease_under = |key: &'static str, wait_ms: u64| {
        let url = server.url("/v1/worker/lease");
        let http = http.clone();
        async move {
            send_with_headers(
                &http,
                Method::POST,
                url,
                None,
                &[("Idempotency-Key", key)],
                Some(json!({"max": 4, "wait_ms": wait_ms, "lease_ms": 30000})),
            )
            .await
        }
    };
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "lost", "model": {"provider": "scripted", "model": "unused.json"}})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);

    // A worker gives up on its long poll while the queue is empty (it is stopping)...
    let hung_up = http
        .post(server.url("/v1/worker/lease"))
        .header("Idempotency-Key", "gone")
        .json(&json!({"max": 4, "wait_ms": 20000, "lease_ms": 30000}))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(hung_up.is_err(), "the try times out: {hung_up:?}");
    // ...so the task that comes after (a moment later: the server sees the connection close
    // once it happened) is not leased to it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/lost/messages"),
        None,
        Some(json!({"text": "hello"})),
    )
    .await;
    assert_eq!(sent.status, StatusCode::ACCEPTED, "{}", sent.body);
    let first = lease_under("lease-1", 20000).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    let tasks = first.body["tasks"].as_array().expect("tasks").clone();
    assert_eq!(tasks.len(), 1, "{}", first.body);
    // Sent again under its key, the request gets the same task under the same lease.
    let again = lease_under("lease-1", 0).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(again.body["tasks"], json!(tasks), "{}", again.body);
    let task = &tasks[0];
    assert_eq!(task["lease"]["id"]["session_id"], "lost");
    assert_eq!(task["lease"]["kind"], "model");
    assert_eq!(task["lease"]["lease_attempt"], 1, "{task}");
    assert!(
        task["input"]["model"]["transcript"]
            .to_string()
            .contains("hello"),
        "{task}"
    );
    let once_more = lease_under("lease-1", 0).await;
    assert_eq!(once_more.body["tasks"], json!([task]), "{}", once_more.body);
    // The task is that worker's: no other request leases it.
    let unkeyed = send(
        &http,
        Method::POST,
        server.url("/v1/worker/lease"),
        None,
        Some(json!({"max": 4, "wait_ms": 0, "lease_ms": 30000})),
    )
    .await;
    assert_eq!(unkeyed.body["tasks"], json!([]), "{}", unkeyed.body);
    let other_key = lease_under("lease-2", 0).await;
    assert_eq!(other_key.body["tasks"], json!([]), "{}", other_key.body);
    // A key that is not one is refused, saying why.
    let bad = send_with_headers(
        &http,
        Method::POST,
        server.url("/v1/worker/lease"),
        None,
        &[("Idempotency-Key", "")],
        Some(json!({"max": 4, "wait_ms": 0, "lease_ms": 30000})),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.body);
    assert_eq!(bad.code(), "invalid_request");

    // The worker reports the task: it had the answer, and the key is forgotten.
    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": task["lease"], "report": answer("hi")})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::NO_CONTENT, "{}", reported.body);
    let forgotten = lease_under("lease-1", 0).await;
    assert_eq!(forgotten.body["tasks"], json!([]), "{}", forgotten.body);
    let outcome = wait_turn(&http, &server, None, "lost", 1).await;
    assert_eq!(outcome["status"], "completed", "{outcome}");
    assert_eq!(
        kinds(&history(&http, &server, None, "lost").await),
        [
            "session_started",
            "user_message",
            "model_call_scheduled",
            "model_call_completed",
            "turn_completed"
        ]
    );
}

#[tokio::test]
async fn tokens_keep_roles_apart_and_namespaces_from_seeing_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.json");
    std::fs::write(
        &tokens,
        json!({"tokens": [
            {"token": "acme-client", "namespace": "acme", "role": "client"},
            {"token": "acme-worker", "namespace": "acme", "role": "worker"},
            {"token": "beta-client", "namespace": "beta", "role": "client"},
            {"token": "beta-worker", "namespace": "beta", "role": "worker"},
        ]})
        .to_string(),
    )
    .unwrap();
    let server = Server::start(
        &dir.path().join("store"),
        &["--tokens", tokens.to_str().unwrap()],
    );
    let http = reqwest::Client::new();
    let model = json!({"provider": "scripted", "model": "unused.json"});
    let (acme, acme_worker) = (Some("acme-client"), Some("acme-worker"));
    let (beta, beta_worker) = (Some("beta-client"), Some("beta-worker"));

    let anonymous = send(&http, Method::GET, server.url("/v1/sessions"), None, None).await;
    assert_eq!(
        (anonymous.status, anonymous.code()),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    assert_eq!(anonymous.headers["www-authenticate"], "Bearer");
    let unknown = send(
        &http,
        Method::GET,
        server.url("/v1/health"),
        Some("guess"),
        None,
    )
    .await;
    assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    let health = send(
        &http,
        Method::GET,
        server.url("/v1/health"),
        acme_worker,
        None,
    )
    .await;
    assert_eq!(health.body["status"], "ok");
    let wrong_role = send(
        &http,
        Method::GET,
        server.url("/v1/sessions"),
        acme_worker,
        None,
    )
    .await;
    assert_eq!(
        (wrong_role.status, wrong_role.code()),
        (StatusCode::FORBIDDEN, "forbidden")
    );
    let wrong_role = send(
        &http,
        Method::POST,
        server.url("/v1/worker/lease"),
        acme,
        Some(json!({"max": 1, "lease_ms": 1000})),
    )
    .await;
    assert_eq!(wrong_role.status, StatusCode::FORBIDDEN);

    for token in [acme, beta] {
        let created = send(
            &http,
            Method::POST,
            server.url("/v1/sessions"),
            token,
            Some(json!({"session_id": "s1", "model": model})),
        )
        .await;
        assert_eq!(
            created.status,
            StatusCode::CREATED,
            "the same id in two namespaces: {}",
            created.body
        );
    }
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        acme,
        Some(json!({"session_id": "only-acme", "model": model})),
    )
    .await;
    let hidden = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/only-acme"),
        beta,
        None,
    )
    .await;
    assert_eq!(
        (hidden.status, hidden.code()),
        (StatusCode::NOT_FOUND, "not_found")
    );
    let hidden = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/only-acme/messages"),
        beta,
        Some(json!({"text": "hi"})),
    )
    .await;
    assert_eq!(hidden.status, StatusCode::NOT_FOUND);
    let listed = |token| {
        let http = http.clone();
        let url = server.url("/v1/sessions");
        async move {
            let page = send(&http, Method::GET, url, token, None).await;
            page.body["sessions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["session_id"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(listed(acme).await, ["only-acme", "s1"]);
    assert_eq!(listed(beta).await, ["s1"]);

    send(
        &http,
        Method::POST,
        server.url("/v1/sessions/s1/messages"),
        acme,
        Some(json!({"text": "for acme"})),
    )
    .await;
    let nothing = send(
        &http,
        Method::POST,
        server.url("/v1/worker/lease"),
        beta_worker,
        Some(json!({"max": 8, "wait_ms": 0, "lease_ms": 1000})),
    )
    .await;
    assert_eq!(
        nothing.body,
        json!({"tasks": []}),
        "beta's worker never sees acme's task"
    );
    let task = lease_one(&http, &server, acme_worker, 30_000).await;
    // Workers see the stored id, so idempotency keys stay unique across namespaces.
    assert_eq!(task["lease"]["id"]["session_id"], "acme:s1");
    for route in [
        "/v1/worker/report",
        "/v1/worker/heartbeat",
        "/v1/worker/input",
    ] {
        let body = match route {
            "/v1/worker/report" => json!({"lease": task["lease"], "report": answer("stolen")}),
            "/v1/worker/heartbeat" => json!({"lease": task["lease"], "lease_ms": 1000}),
            _ => task["lease"].clone(),
        };
        let foreign = send(
            &http,
            Method::POST,
            server.url(route),
            beta_worker,
            Some(body),
        )
        .await;
        assert_eq!(
            (foreign.status, foreign.code()),
            (StatusCode::NOT_FOUND, "not_found"),
            "{route}"
        );
    }
    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        acme_worker,
        Some(json!({"lease": task["lease"], "report": answer("for acme only")})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::NO_CONTENT, "{}", reported.body);
    let outcome = wait_turn(&http, &server, acme, "s1", 1).await;
    assert_eq!(outcome["answer"], "for acme only");
    let events = history(&http, &server, acme, "s1").await;
    assert!(
        events.iter().all(|e| e["session_id"] == "s1"),
        "clients see their own ids"
    );
    assert_eq!(
        history(&http, &server, beta, "s1").await.len(),
        1,
        "beta's s1 is untouched"
    );
}

/// The binary's allocator is jemalloc with its options compiled in (`src/allocator.rs`): one
/// background thread, which returns freed memory to the OS while the process is quiet. Without
/// the options jemalloc starts no such thread, and with its default maximum it starts one per
/// CPU, so the count says both that the allocator is in and that its options were read.
#[test]
fn the_server_process_allocates_with_jemalloc_and_one_purging_thread() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let threads = std::fs::read_dir(format!("/proc/{}/task", server.child.id()))
        .expect("the server's threads")
        .map(|task| {
            let comm = task.expect("a thread").path().join("comm");
            std::fs::read_to_string(comm).unwrap_or_default()
        })
        .collect::<Vec<_>>();
    let purging = threads
        .iter()
        .filter(|name| name.trim() == "jemalloc_bg_thd")
        .count();
    assert_eq!(purging, 1, "the server's threads: {threads:?}");
}

#[test]
fn a_server_without_tokens_refuses_to_listen_beyond_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["server", "--data"])
        .arg(dir.path().join("store"))
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .expect("run cairn server");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("without a tokens file") && stderr.contains("--tokens"),
        "{stderr}"
    );
    assert!(!dir.path().join("store").exists(), "nothing was created");
}

#[tokio::test]
async fn a_report_from_an_old_lease_is_refused_and_changes_no_byte_of_the_history() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({
            "session_id": "fenced", "model": {"provider": "scripted", "model": "unused.json"},
            "model_retry": fast_retry()
        })),
    )
    .await;
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions/fenced/messages"),
        None,
        Some(json!({"text": "hi"})),
    )
    .await;
    // A short lease that lapses: the timers record the attempt as timed out and the retry is a
    // new task, which the next lease waits for.
    let old = lease_one(&http, &server, None, 200).await;
    let new = lease_one(&http, &server, None, 30_000).await;
    assert_ne!(old["lease"]["id"], new["lease"]["id"], "{old} {new}");
    let history_url = server.url("/v1/sessions/fenced/history");
    let before = http
        .get(&history_url)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();

    let stale = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": old["lease"], "report": answer("late")})),
    )
    .await;
    assert_eq!(stale.status, StatusCode::CONFLICT, "{}", stale.body);
    assert!(
        ["stale_report", "lease_lost"].contains(&stale.code()),
        "{}",
        stale.body
    );
    let mut forged = new["lease"].clone();
    forged["lease_attempt"] = json!(new["lease"]["lease_attempt"].as_u64().unwrap() + 1);
    let lost = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": forged, "report": answer("forged")})),
    )
    .await;
    assert_eq!(
        (lost.status, lost.code()),
        (StatusCode::CONFLICT, "lease_lost")
    );
    let beat = send(
        &http,
        Method::POST,
        server.url("/v1/worker/heartbeat"),
        None,
        Some(json!({"lease": old["lease"], "lease_ms": 1000})),
    )
    .await;
    assert_eq!(
        (beat.status, beat.code()),
        (StatusCode::CONFLICT, "lease_lost")
    );
    let input = send(
        &http,
        Method::POST,
        server.url("/v1/worker/input"),
        None,
        Some(old["lease"].clone()),
    )
    .await;
    assert_eq!(
        (input.status, input.code()),
        (StatusCode::CONFLICT, "lease_lost")
    );
    let after = http
        .get(&history_url)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(before, after, "a refused report changes nothing");

    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": new["lease"], "report": answer("on time")})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::NO_CONTENT, "{}", reported.body);
    assert_eq!(
        wait_turn(&http, &server, None, "fenced", 1).await["answer"],
        "on time"
    );
    let events = history(&http, &server, None, "fenced").await;
    let failed = events
        .iter()
        .find(|e| e["kind"] == "model_call_failed")
        .expect("the lapsed attempt");
    assert_eq!(
        failed["event"]["model_call_failed"]["failure"]["class"],
        "timeout"
    );
}

#[tokio::test]
async fn malformed_requests_get_json_errors_and_the_server_stays_up() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    let raw = |method: Method, path: &str, content_type: Option<&str>, body: Vec<u8>| {
        let mut request = http.request(method, server.url(path)).body(body);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request
    };
    let json_type = Some("application/json");
    let deep = "[".repeat(100_000);
    let huge = format!("{{\"text\": \"{}\"}}", "x".repeat(5 * 1024 * 1024));
    let cases: Vec<(reqwest::RequestBuilder, StatusCode, &str)> = vec![
        (
            raw(Method::POST, "/v1/sessions", json_type, b"{".to_vec()),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::POST,
                "/v1/sessions",
                json_type,
                br#"{"model": 5}"#.to_vec(),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::POST,
                "/v1/sessions",
                json_type,
                br#"{"tools": []}"#.to_vec(),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::POST,
                "/v1/sessions",
                json_type,
                br#"["p", "m"]"#.to_vec(),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::POST,
                "/v1/sessions",
                json_type,
                br#"{"model": {"provider": "p", "model": "m"}, "bogus": 1}"#.to_vec(),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(Method::POST, "/v1/sessions", json_type, deep.into_bytes()),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::POST,
                "/v1/sessions",
                json_type,
                vec![0xff, 0xfe, 0x00],
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::POST,
                "/v1/sessions",
                None,
                br#"{"model": {"provider": "p", "model": "m"}}"#.to_vec(),
            ),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            raw(
                Method::POST,
                "/v1/sessions",
                Some("text/plain"),
                b"{}".to_vec(),
            ),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            raw(
                Method::POST,
                "/v1/sessions/s/messages",
                json_type,
                huge.into_bytes(),
            ),
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
        ),
        (
            raw(
                Method::POST,
                "/v1/worker/report",
                json_type,
                br#"{"lease": {}, "report": {"failed": {}, "x": 1}}"#.to_vec(),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(Method::GET, "/v1/sessions?limit=abc", None, Vec::new()),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(Method::GET, "/v1/sessions?limit=0", None, Vec::new()),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::GET,
                "/v1/sessions?status=sleeping",
                None,
                Vec::new(),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(Method::GET, "/v1/sessions/s/turns/abc", None, Vec::new()),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::GET,
                "/v1/sessions/s/turns/99999999999",
                None,
                Vec::new(),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(Method::GET, "/v1/nowhere", None, Vec::new()),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            raw(Method::DELETE, "/v1/sessions", None, Vec::new()),
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
        (
            raw(Method::GET, "/v1/sessions/s/events", None, Vec::new())
                .header("last-event-id", "yesterday"),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(Method::GET, "/v1/sessions/s/events", None, Vec::new())
                .header("last-event-id", u64::MAX.to_string()),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            raw(
                Method::GET,
                &format!("/v1/sessions/s/events?after_seq={}", u64::MAX),
                None,
                Vec::new(),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
    ];
    // An id no session can have is a bad request on every route that names a session, with
    // a message saying what ids may be.
    let mut cases = cases;
    let first_bad_id = cases.len();
    let bad_id = "bad%20id%21";
    for (method, path) in [
        (Method::GET, format!("/v1/sessions/{bad_id}")),
        (Method::GET, format!("/v1/sessions/{bad_id}/history")),
        (Method::GET, format!("/v1/sessions/{bad_id}/events")),
        (Method::GET, format!("/v1/sessions/{bad_id}/state")),
        (Method::GET, format!("/v1/sessions/{bad_id}/turns/1")),
        (Method::DELETE, format!("/v1/sessions/{bad_id}")),
    ] {
        cases.push((
            raw(method, &path, None, Vec::new()),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ));
    }
    for (i, (request, status, code)) in cases.into_iter().enumerate() {
        let response = request.send().await.expect("send");
        assert_eq!(response.status(), status, "case {i}");
        let allow = response.headers().get("allow").cloned();
        let body: Value = serde_json::from_slice(&response.bytes().await.unwrap())
            .unwrap_or_else(|e| panic!("case {i}: not JSON: {e}"));
        assert_eq!(body["error"]["code"], code, "case {i}: {body}");
        if i >= first_bad_id {
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("invalid session id \"bad id!\"")),
                "case {i}: {body}"
            );
        }
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "case {i}"
        );
        if status == StatusCode::METHOD_NOT_ALLOWED {
            assert!(
                allow.is_some_and(|a| a.to_str().unwrap().contains("POST")),
                "case {i}"
            );
        }
    }
    let health = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
    assert_eq!(health.body["status"], "ok");
    let doc = openapi_document(&http, &server).await;
    assert!(doc["paths"]["/v1/worker/report"]["post"].is_object());
}

/// The server's OpenAPI document, `GET /v1/openapi.json`.
pub(crate) async fn openapi_document(http: &reqwest::Client, server: &Server) -> Value {
    let doc = send(
        http,
        Method::GET,
        server.url("/v1/openapi.json"),
        None,
        None,
    )
    .await;
    assert_eq!(doc.status, StatusCode::OK, "{}", doc.body);
    doc.body
}

/// One message of an event stream.
#[derive(Debug)]
struct Message {
    event: String,
    id: Option<u64>,
    data: Value,
}

/// Reads an event stream until `stop` says so; returns what it read.
async fn read_stream(
    response: reqwest::Response,
    mut stop: impl FnMut(&Message) -> bool,
) -> Vec<Message> {
    let mut bytes = response.bytes_stream();
    let mut buffer = String::new();
    let mut messages = Vec::new();
    while let Some(chunk) = bytes.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk.expect("stream chunk")));
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let (mut event, mut id, mut data) = (String::new(), None, String::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("id:") {
                    id = Some(v.trim().parse().expect("numeric id"));
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            if event.is_empty() {
                continue; // a keep-alive comment
            }
            let message = Message {
                event,
                id,
                data: serde_json::from_str(&data).expect("JSON data"),
            };
            let done = stop(&message);
            messages.push(message);
            if done {
                return messages;
            }
        }
    }
    panic!("the stream ended early after {messages:?}");
}

#[tokio::test]
async fn the_event_stream_resumes_after_last_event_id_with_every_event_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(
        dir.path(),
        &["First answer, streamed in words.", "Second answer."],
    );
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "1"]);
    let http = reqwest::Client::new();
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "sse", "model": model})),
    )
    .await;
    let stream = http
        .get(server.url("/v1/sessions/sse/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), StatusCode::OK);
    assert!(stream.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));

    send(
        &http,
        Method::POST,
        server.url("/v1/sessions/sse/messages"),
        None,
        Some(json!({"text": "one"})),
    )
    .await;
    // Read turn 1 to its end, then hang up.
    let first = read_stream(stream, |m| {
        m.event == "event" && m.data["kind"] == "turn_completed"
    })
    .await;
    let mut seen: Vec<u64> = first.iter().filter_map(|m| m.id).collect();
    assert!(
        first
            .iter()
            .any(|m| m.event == "delta" && m.data["delta"]["text"].is_string()),
        "{first:?}"
    );
    assert!(first
        .iter()
        .all(|m| m.event != "delta" || m.data["origin"]["session_id"] == "sse"));
    let last = *seen.last().unwrap();

    // Turn 2 runs while nobody listens; the reconnect names the last id seen.
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions/sse/messages"),
        None,
        Some(json!({"text": "two"})),
    )
    .await;
    let resumed = http
        .get(server.url("/v1/sessions/sse/events"))
        .header("last-event-id", last.to_string())
        .send()
        .await
        .unwrap();
    let second = read_stream(resumed, |m| {
        m.event == "event"
            && m.data["kind"] == "turn_completed"
            && m.data["event"]["turn_completed"]["turn"] == 2
    })
    .await;
    seen.extend(second.iter().filter_map(|m| m.id));

    let events = history(&http, &server, None, "sse").await;
    let all: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seen, all,
        "every event exactly once, in order, across the reconnect"
    );
    let streamed: Vec<&Value> = first
        .iter()
        .chain(&second)
        .filter(|m| m.event == "event")
        .map(|m| &m.data)
        .collect();
    assert_eq!(
        streamed,
        events.iter().collect::<Vec<_>>(),
        "the same envelopes as the history"
    );

    // `after_seq` is the same for clients that cannot set headers.
    let from_query = http
        .get(server.url(&format!(
            "/v1/sessions/sse/events?after_seq={}",
            all.len() - 1
        )))
        .send()
        .await
        .unwrap();
    let tail = read_stream(from_query, |m| m.event == "event").await;
    assert_eq!(tail.last().unwrap().id, Some(all.len() as u64));
}

#[tokio::test]
async fn sigterm_stops_leasing_takes_the_last_reports_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "d", "model": {"provider": "scripted", "model": "unused.json"}})),
    )
    .await;
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions/d/messages"),
        None,
        Some(json!({"text": "hi"})),
    )
    .await;
    let task = lease_one(&http, &server, None, 60_000).await;
    // A worker waiting for more work when the drain begins is told at once.
    let waiting = {
        let http = http.clone();
        let url = server.url("/v1/worker/lease");
        tokio::spawn(async move {
            send(
                &http,
                Method::POST,
                url,
                None,
                Some(json!({"max": 1, "wait_ms": 60000, "lease_ms": 1000})),
            )
            .await
        })
    };

    server.signal(libc::SIGTERM);
    loop {
        let health = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
        if health.body["status"] == "draining" {
            break;
        }
        assert_eq!(health.body["status"], "ok");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waited = waiting.await.unwrap();
    assert_eq!(
        (waited.status, waited.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
    );
    let refused = send(
        &http,
        Method::POST,
        server.url("/v1/worker/lease"),
        None,
        Some(json!({"max": 1, "lease_ms": 1000})),
    )
    .await;
    assert_eq!(
        (refused.status, refused.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
    );
    // The held lease's report still lands; with no lease held the drain ends.
    let reported = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": task["lease"], "report": answer("just in time")})),
    )
    .await;
    assert_eq!(reported.status, StatusCode::NO_CONTENT, "{}", reported.body);
    let status = server.exit().await;
    assert_eq!(status.code(), Some(0), "{status:?}");

    let restarted = Server::start(&dir.path().join("store"), &[]);
    let outcome = wait_turn(&http, &restarted, None, "d", 1).await;
    assert_eq!(outcome["answer"], "just in time");
}

#[tokio::test]
async fn a_sigkill_mid_turn_loses_nothing_acknowledged_and_the_restarted_server_completes_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["Survived the crash."]);
    let data: PathBuf = dir.path().join("store");
    let mut server = Server::start(&data, &[]);
    let http = reqwest::Client::new();
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "k", "model": model, "model_retry": fast_retry()})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED);
    let started = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/k/messages"),
        None,
        Some(json!({"text": "hi"})),
    )
    .await;
    assert_eq!(started.status, StatusCode::ACCEPTED);
    // A worker holds the model call when the server dies.
    let task = lease_one(&http, &server, None, 1_000).await;
    server.kill().await;

    let server = Server::start(&data, &["--local-workers", "1"]);
    let described = send(&http, Method::GET, server.url("/v1/sessions/k"), None, None).await;
    assert_eq!(
        described.status,
        StatusCode::OK,
        "the acknowledged session is there"
    );
    assert_eq!(
        described.body["turns"], 1,
        "and so is the acknowledged turn"
    );
    let outcome = wait_turn(&http, &server, None, "k", 1).await;
    // How many model calls the crash cost depends on when it struck: not compared.
    assert_eq!(
        json!([
            &outcome["status"],
            &outcome["turn"],
            &outcome["answer"],
            &outcome["stop_reason"]
        ]),
        json!(["completed", 1, "Survived the crash.", "end_turn"])
    );
    // The dead worker's lease lapsed and was recorded; its late report changes nothing.
    let late = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": task["lease"], "report": answer("too late")})),
    )
    .await;
    assert_eq!(late.status, StatusCode::CONFLICT, "{}", late.body);
    let events = history(&http, &server, None, "k").await;
    assert_eq!(
        events
            .iter()
            .filter(|e| e["kind"] == "model_call_completed")
            .count(),
        1
    );
    assert!(
        events.iter().any(|e| e["kind"] == "model_call_failed"),
        "{:?}",
        kinds(&events)
    );
}

#[test]
fn schemathesis_finds_no_failure_against_the_openapi_document() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join("scripts/schemathesis"))
        .env("CAIRN_BIN", env!("CARGO_BIN_EXE_cairn"))
        .output()
        .expect("run scripts/schemathesis (needs bash and python3)");
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "scripts/schemathesis failed:\n{report}"
    );
    assert!(
        report.contains("No issues found") || report.contains("passed"),
        "{report}"
    );
}

/// A scripted model that asks for one shell command, then answers `done`.
fn shell_script(dir: &Path, command: &str) -> Value {
    let path = dir.join("shell-script.json");
    let script = json!({"responses": [
        {"parts": [{"type": "tool_use", "id": "toolu_sh", "name": "shell", "input": {"command": command}}],
         "stop_reason": "tool_use"},
        {"parts": [{"type": "text", "text": "done"}]}
    ]});
    std::fs::write(&path, script.to_string()).expect("script");
    json!({"provider": "scripted", "model": path.display().to_string()})
}

/// A worker process whose result (1 MB, some 15 times the body limit: the server answers
/// 413 before reading it all) reports the attempt failed instead, once: the call's error
/// result says why, the model goes on, and the call does not run again on every lapsed lease.
#[tokio::test]
async fn a_result_larger_than_the_server_takes_is_the_calls_error_and_runs_once() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("big.txt"), "a".repeat(1_000_000)).unwrap();
    let path = dir.path().join("read-script.json");
    let script = json!({"responses": [
        {"parts": [{"type": "tool_use", "id": "toolu_big", "name": "read_file",
                    "input": {"path": "big.txt"}}],
         "stop_reason": "tool_use"},
        {"parts": [{"type": "text", "text": "too big to read"}]}
    ]});
    std::fs::write(&path, script.to_string()).unwrap();
    let model = json!({"provider": "scripted", "model": path.display().to_string()});
    let server = Server::start(&dir.path().join("store"), &["--max-body-bytes", "65536"]);
    let mut worker = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["worker", "--server", &server.url(""), "--workdir"])
        .arg(&work)
        .env_remove("CAIRN_SERVER")
        .env_remove("CAIRN_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start cairn worker");
    let mut ready = BufReader::new(worker.stdout.take().expect("stdout")).lines();
    assert_eq!(ready.next().expect("a line").expect("text"), "worker ready");
    let http = reqwest::Client::new();
    let read_file = serde_json::to_value(cairn_activities::Tool::spec(
        &cairn_activities::ReadFile::new("."),
    ))
    .unwrap();
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(
            json!({"session_id": "big", "model": model, "tools": [read_file],
                    "message": {"text": "read big.txt"}}),
        ),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let outcome = wait_turn(&http, &server, None, "big", 1).await;
    let _ = worker.kill();
    let _ = worker.wait();
    assert_eq!(
        (&outcome["status"], &outcome["answer"]),
        (&json!("completed"), &json!("too big to read")),
        "{outcome}"
    );
    let events = history(&http, &server, None, "big").await;
    let kinds = kinds(&events);
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == "tool_call_scheduled")
            .count(),
        1,
        "{kinds:?}"
    );
    let failed: Vec<_> = events
        .iter()
        .filter(|e| e["kind"] == "tool_call_failed")
        .collect();
    assert_eq!(failed.len(), 1, "{kinds:?}");
    let failure = failed[0].to_string();
    assert!(
        failure.contains("invalid_request")
            && failure.contains("the server refused it as too large"),
        "{failure}"
    );
}

/// Polls the session's description until `ready` holds; returns it.
async fn describe_until(
    http: &reqwest::Client,
    server: &Server,
    id: &str,
    ready: impl Fn(&Value) -> bool,
) -> Value {
    for _ in 0..600 {
        let described = send(
            http,
            Method::GET,
            server.url(&format!("/v1/sessions/{id}")),
            None,
            None,
        )
        .await;
        assert_eq!(described.status, StatusCode::OK, "{}", described.body);
        if ready(&described.body) {
            return described.body;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("session {id} never got there");
}

#[tokio::test]
async fn a_parked_shell_call_is_approved_over_http_and_runs_once() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let model = shell_script(dir.path(), "echo ran >> side.txt");
    let server = Server::start(
        &dir.path().join("store"),
        &["--local-workers", "2", "--workdir", work.to_str().unwrap()],
    );
    let http = reqwest::Client::new();
    let shell = serde_json::to_value(cairn_activities::Tool::spec(&cairn_activities::Shell::new(
        ".",
    )))
    .unwrap();
    // No policy given: a session offering shell asks before each of its calls.
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "ask", "model": model, "tools": [shell]})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let bad_policy = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"model": model, "tools": [shell],
                    "tool_policy": {"rules": [{"tool": "", "decision": "allow"}]}})),
    )
    .await;
    assert_eq!(
        bad_policy.status,
        StatusCode::BAD_REQUEST,
        "{}",
        bad_policy.body
    );
    let started = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/ask/messages"),
        None,
        Some(json!({"text": "record that it ran"})),
    )
    .await;
    assert_eq!(started.status, StatusCode::ACCEPTED);
    let described = describe_until(&http, &server, "ask", |d| {
        d["pending_approvals"] != json!([])
    })
    .await;
    assert_eq!(described["status"], "running");
    assert_eq!(described["pending_approvals"][0]["tool_use_id"], "toolu_sh");
    assert_eq!(described["pending_approvals"][0]["name"], "shell");
    let listed = send(&http, Method::GET, server.url("/v1/sessions"), None, None).await;
    assert_eq!(
        listed.body["sessions"][0]["awaiting_approval"],
        json!(["toolu_sh"])
    );
    assert!(
        !work.join("side.txt").exists(),
        "ran before it was approved"
    );

    let approvals =
        |tool_use_id: &str| server.url(&format!("/v1/sessions/ask/approvals/{tool_use_id}"));
    for (body, status) in [
        (json!({"decision": "maybe"}), StatusCode::BAD_REQUEST),
        (json!({"reason": "x"}), StatusCode::BAD_REQUEST),
        (
            json!({"decision": "approve", "extra": 1}),
            StatusCode::BAD_REQUEST,
        ),
    ] {
        let answer = send(&http, Method::POST, approvals("toolu_sh"), None, Some(body)).await;
        assert_eq!(answer.status, status, "{}", answer.body);
    }
    let unknown = send(
        &http,
        Method::POST,
        approvals("toolu_nope"),
        None,
        Some(json!({"decision": "approve"})),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::CONFLICT, "{}", unknown.body);
    let missing = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/nobody/approvals/toolu_sh"),
        None,
        Some(json!({"decision": "approve"})),
    )
    .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.body);

    let approved = send(
        &http,
        Method::POST,
        approvals("toolu_sh"),
        None,
        Some(json!({"decision": "approve"})),
    )
    .await;
    assert_eq!(approved.status, StatusCode::OK, "{}", approved.body);
    assert_eq!(
        approved.body,
        json!({"tool_use_id": "toolu_sh", "decision": "approve"})
    );
    let again = send(
        &http,
        Method::POST,
        approvals("toolu_sh"),
        None,
        Some(json!({"decision": "deny", "reason": "too late"})),
    )
    .await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);

    let outcome = wait_turn(&http, &server, None, "ask", 1).await;
    assert_eq!(
        outcome,
        json!({
            "status": "completed", "turn": 1, "answer": "done", "stop_reason": "end_turn",
            "totals": {
                "usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_tokens": 0,
                          "cache_write_tokens": 0, "reasoning_tokens": 0},
                "cost_micros": 0, "unpriced_attempts": 0, "model_calls": 2
            }
        })
    );
    assert_eq!(
        std::fs::read_to_string(work.join("side.txt")).unwrap(),
        "ran\n"
    );
    let events = history(&http, &server, None, "ask").await;
    let kinds = kinds(&events);
    for kind in [
        "tool_approval_requested",
        "tool_call_approved",
        "tool_call_completed",
    ] {
        assert_eq!(kinds.iter().filter(|k| **k == kind).count(), 1, "{kinds:?}");
    }
    let policy = &events[0]["event"]["session_started"]["tool_policy"];
    assert_eq!(
        *policy,
        json!({"rules": [{"tool": "shell", "decision": "ask"}]})
    );
}

/// Budgets over HTTP: a session created with a turn budget, its calls priced by the server's
/// `--prices`, a turn that goes over fails with the limit in its outcome, the session's totals
/// in its description and the listing, and the cost and the limit in the SSE events.
#[tokio::test]
async fn a_turn_budget_over_http_fails_the_turn_and_the_costs_stream_with_the_events() {
    let dir = tempfile::tempdir().unwrap();
    let prices = dir.path().join("prices.json");
    std::fs::write(
        &prices,
        r#"{"models": [{"providers": ["scripted"], "model": "budget-model",
            "input": 1, "output": 2, "cache_read": 0, "cache_write": 0}]}"#,
    )
    .unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        r#"{"model": "budget-model", "responses": [{"parts": [{"type": "text", "text": "long"}],
            "usage": {"input_tokens": 1000, "output_tokens": 500}}]}"#,
    )
    .unwrap();
    let server = Server::start(
        &dir.path().join("store"),
        &["--local-workers", "1", "--prices", prices.to_str().unwrap()],
    );
    let http = reqwest::Client::new();
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({
            "session_id": "b",
            "model": {"provider": "scripted", "model": script.display().to_string()},
            "limits": {"max_rounds": 4, "turn_budget": {"max_tokens": 100}}
        })),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let stream = http
        .get(server.url("/v1/sessions/b/events"))
        .send()
        .await
        .unwrap();
    send(
        &http,
        Method::POST,
        server.url("/v1/sessions/b/messages"),
        None,
        Some(json!({"text": "write a lot"})),
    )
    .await;
    let exceeded = json!({"limit": "tokens", "scope": "turn", "limit_value": 100, "used": 1500});
    let totals = json!({
        "usage": {"input_tokens": 1000, "output_tokens": 500, "cache_read_tokens": 0,
                  "cache_write_tokens": 0, "reasoning_tokens": 0},
        "cost_micros": 2000, "unpriced_attempts": 0, "model_calls": 1
    });
    let outcome = wait_turn(&http, &server, None, "b", 1).await;
    assert_eq!(
        outcome,
        json!({
            "status": "failed", "turn": 1,
            "reason": "turn budget exceeded: max_tokens 100 tokens, 1500 used",
            "budget_exceeded": exceeded, "totals": totals
        })
    );
    let described = send(&http, Method::GET, server.url("/v1/sessions/b"), None, None).await;
    assert_eq!(described.body["totals"], totals);
    assert_eq!(described.body["last_outcome"], outcome);
    let listed = send(&http, Method::GET, server.url("/v1/sessions"), None, None).await;
    assert_eq!(listed.body["sessions"][0]["totals"], totals);
    let streamed = read_stream(stream, |m| {
        m.event == "event" && m.data["kind"] == "turn_failed"
    })
    .await;
    let event = |kind: &str| {
        streamed
            .iter()
            .find(|m| m.event == "event" && m.data["kind"] == kind)
            .map(|m| m.data["event"][kind].clone())
            .unwrap_or_else(|| panic!("no {kind} in {streamed:?}"))
    };
    assert_eq!(event("model_call_completed")["cost_micros"], 2000);
    assert_eq!(event("turn_failed")["budget_exceeded"], exceeded);
}

/// Three turns with long answers against a 400-token window (the responses name their turns,
/// so they play right after compaction).
fn windowed_script(dir: &Path) -> Value {
    let path = dir.join("windowed.json");
    let long = "word ".repeat(140);
    let responses: Vec<Value> = (1..=3)
        .map(|turn| {
            json!({"turn": turn, "parts": [
                {"type": "thinking", "text": format!("thinking {turn}"), "signature": format!("sig-{turn}")},
                {"type": "text", "text": format!("answer {turn}: {long}")}
            ]})
        })
        .collect();
    let script = json!({"context_window_tokens": 400, "responses": responses});
    std::fs::write(&path, script.to_string()).expect("script");
    json!({"provider": "scripted", "model": path.display().to_string()})
}

#[tokio::test]
async fn compaction_over_http_is_recorded_streamed_and_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let model = windowed_script(dir.path());
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "1"]);
    let http = reqwest::Client::new();
    let bad = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"model": model, "compaction": {"strategies": []}})),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.body);
    assert!(
        bad.body.to_string().contains("at least one strategy"),
        "{}",
        bad.body
    );
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "cw", "model": model, "compaction": {"keep_last_turns": 1}})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let stream = http
        .get(server.url("/v1/sessions/cw/events"))
        .send()
        .await
        .unwrap();
    for turn in 1..=3 {
        let sent = send(
            &http,
            Method::POST,
            server.url("/v1/sessions/cw/messages"),
            None,
            Some(json!({"text": format!("question {turn}")})),
        )
        .await;
        assert_eq!(sent.status, StatusCode::ACCEPTED, "{}", sent.body);
        let outcome = wait_turn(&http, &server, None, "cw", turn).await;
        assert_eq!(outcome["status"], "completed", "{outcome}");
    }
    // Followers get the compaction like every event, between the failure and the retry.
    let mut completed = 0;
    let messages = read_stream(stream, |m| {
        if m.event == "event" && m.data["kind"] == "turn_completed" {
            completed += 1;
        }
        completed == 3
    })
    .await;
    let kinds: Vec<&str> = messages
        .iter()
        .filter(|m| m.event == "event")
        .filter_map(|m| m.data["kind"].as_str())
        .collect();
    let at = kinds
        .iter()
        .position(|k| *k == "transcript_compacted")
        .unwrap_or_else(|| panic!("{kinds:?}"));
    assert_eq!(kinds[at - 1], "model_call_failed", "{kinds:?}");
    assert_eq!(kinds[at + 1], "model_call_scheduled", "{kinds:?}");
    let events = history(&http, &server, None, "cw").await;
    let compacted = events
        .iter()
        .find(|e| e["kind"] == "transcript_compacted")
        .expect("recorded");
    assert_eq!(
        compacted["event"]["transcript_compacted"]["trigger"],
        "context_too_long"
    );
    assert_eq!(
        events[0]["event"]["session_started"]["compaction"]["keep_last_turns"],
        1
    );
    let transcript = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/cw/transcript"),
        None,
        None,
    )
    .await;
    assert_eq!(
        transcript.body["messages"].as_array().map(Vec::len),
        Some(2),
        "{}",
        transcript.body
    );

    // On request: the last turn counts as current, so nothing is left to compact.
    let asked = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/cw/compact"),
        None,
        None,
    )
    .await;
    assert_eq!(asked.status, StatusCode::OK, "{}", asked.body);
    assert_eq!(asked.body["compacted"], false, "{}", asked.body);
    assert_eq!(asked.body["strategies"], json!([]));
    let missing = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/nobody/compact"),
        None,
        None,
    )
    .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.body);
    let events = history(&http, &server, None, "cw").await;
    assert_eq!(
        events.last().map(|e| e["kind"].clone()),
        Some(json!("compaction_requested"))
    );
}

/// Runs one turn of a new session `id` through the server's in-process workers.
async fn one_turn(http: &reqwest::Client, server: &Server, id: &str, model: &Value) {
    let created = send(
        http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": id, "model": model})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let sent = send(
        http,
        Method::POST,
        server.url(&format!("/v1/sessions/{id}/messages")),
        None,
        Some(json!({"text": "hi"})),
    )
    .await;
    assert_eq!(sent.status, StatusCode::ACCEPTED, "{}", sent.body);
    let outcome = wait_turn(http, server, None, id, 1).await;
    assert_eq!(outcome["answer"], "first", "{outcome}");
}

/// `/v1/health` reports the embedded store's durable commits and how long their syncs took:
/// counts that grow with each turn, and times in order (p50 ≤ p99 ≤ the slowest), every one a
/// real sync's. The OpenAPI document describes them.
#[tokio::test]
async fn health_reports_the_stores_commits_and_sync_times() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["first", "second"]);
    let http = reqwest::Client::new();
    let server = Server::start(&dir.path().join("data"), &["--local-workers", "1"]);
    let syncs = |body: &Value| -> (u64, u64, u64, u64) {
        let s = &body["store_syncs"];
        let field = |name: &str| {
            s[name]
                .as_u64()
                .unwrap_or_else(|| panic!("no {name} in {body}"))
        };
        (
            field("durable_commits"),
            field("sync_p50_us"),
            field("sync_p99_us"),
            field("sync_max_us"),
        )
    };
    one_turn(&http, &server, "s0", &model).await;
    let health = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
    let (commits, p50, p99, max) = syncs(&health.body);
    // A turn here is at least its start, the model's result and the turn's end.
    assert!(commits >= 3, "{}", health.body);
    assert!(0 < p50 && p50 <= p99 && p99 <= max, "{}", health.body);
    assert!(max < 60_000_000, "{}", health.body);
    one_turn(&http, &server, "s1", &model).await;
    let health = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
    let (more, ..) = syncs(&health.body);
    assert!(more >= commits + 3, "{commits} then {}", health.body);
    let doc = openapi_document(&http, &server).await;
    let schema = &doc["components"]["schemas"]["StoreSyncStats"]["properties"];
    for field in [
        "durable_commits",
        "sync_p50_us",
        "sync_p99_us",
        "sync_max_us",
    ] {
        assert!(schema.get(field).is_some(), "{field}: {schema}");
    }
}

/// A server whose disk fills: once a write fails, its store refuses writes and `/v1/health`
/// answers 503 `failed`, saying why, until the server restarts, even after room comes back;
/// restarted, it is `ok`, and every message it acknowledged is in its session's history.
#[tokio::test]
async fn health_fails_while_the_store_refuses_writes_after_the_disk_filled() {
    let root = tempfile::tempdir().unwrap();
    let model = script(root.path(), &["first"]);
    let mnt = Tmpfs::mount(root.path().join("mnt"), "2m");
    let data = mnt.dir.join("store");
    let http = reqwest::Client::new();
    let health = |server: &Server| {
        let url = server.url("/v1/health");
        let http = http.clone();
        async move { send(&http, Method::GET, url, None, None).await }
    };
    let create = |server: &Server, id: &str| {
        let (url, body) = (
            server.url("/v1/sessions"),
            json!({"session_id": id, "model": model}),
        );
        let http = http.clone();
        async move { send(&http, Method::POST, url, None, Some(body)).await }
    };
    let mut server = Server::start(&data, &[]);
    let fine = health(&server).await;
    assert_eq!(fine.status, StatusCode::OK, "{}", fine.body);
    assert_eq!(fine.body["status"], "ok");
    assert!(fine.body.get("reason").is_none(), "{}", fine.body);

    // Sessions with a message of 64 KiB each (incompressible) until the disk is full.
    let mut acknowledged = Vec::new();
    let mut refused = None;
    for n in 0..100u64 {
        let id = format!("s{n}");
        let created = create(&server, &id).await;
        if created.status != StatusCode::CREATED {
            refused = Some(created);
            break;
        }
        let text = crate::support::incompressible_text(n, 64 * 1024);
        let sent = send(
            &http,
            Method::POST,
            server.url(&format!("/v1/sessions/{id}/messages")),
            None,
            Some(json!({ "text": text })),
        )
        .await;
        if sent.status != StatusCode::ACCEPTED {
            refused = Some(sent);
            break;
        }
        acknowledged.push(id);
    }
    let refused = refused.expect("a 2 MiB disk fills within 100 messages of 64 KiB");
    assert!(
        refused.status.is_server_error(),
        "{} {}",
        refused.status,
        refused.body
    );
    assert!(acknowledged.len() >= 5, "only {} fit", acknowledged.len());
    let failed = health(&server).await;
    assert_eq!(
        failed.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        failed.body
    );
    assert_eq!(failed.body["status"], "failed", "{}", failed.body);
    let reason = failed.body["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("refuses writes") && reason.contains("restart the server"),
        "{reason}"
    );
    assert!(
        !reason.contains(&*mnt.dir.to_string_lossy()),
        "no path: {reason}"
    );
    let remote = cairn_remote::HttpTransport::new(&server.url(""), None).unwrap();
    let seen = remote
        .health()
        .await
        .expect("the remote client reads a failed health");
    assert_eq!(
        (seen.status.as_str(), seen.reason.as_deref()),
        ("failed", Some(reason))
    );
    // Room again is not enough: what the store wrote since its last good sync is in doubt.
    mnt.resize("64m");
    let still = create(&server, "after").await;
    assert!(still.status.is_server_error(), "{}", still.body);
    assert_eq!(
        health(&server).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );

    server.kill().await;
    let server = Server::start(&data, &[]);
    let back = health(&server).await;
    assert_eq!(back.status, StatusCode::OK, "{}", back.body);
    assert_eq!(back.body["status"], "ok");
    for (n, id) in acknowledged.iter().enumerate() {
        let events = history(&http, &server, None, id).await;
        let text = crate::support::incompressible_text(n as u64, 64 * 1024);
        assert!(
            events
                .iter()
                .any(|e| e["kind"] == "user_message" && e["event"]["user_message"]["text"] == text),
            "session {id} lost its acknowledged message: {:?}",
            kinds(&events)
        );
    }
    assert_eq!(create(&server, "after").await.status, StatusCode::CREATED);
    drop(server);
    drop(mnt);
}

/// `--cache-sessions` and `--cache-mib` bound the server's cache of session states, and
/// `/v1/health` reports it. With room for two, four finished sessions leave two cached; the
/// first, dropped, takes another turn, its state folded again from its history (the scripted
/// model answers by the transcript's assistant messages, so a state folded wrong would get
/// the first answer again). With the defaults, all four stay.
#[tokio::test]
async fn the_state_cache_is_bounded_by_the_server_flags_and_reported_by_health() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["first", "second"]);
    let http = reqwest::Client::new();

    let small = Server::start(
        &dir.path().join("small"),
        &[
            "--local-workers",
            "1",
            "--cache-sessions",
            "2",
            "--cache-mib",
            "3",
        ],
    );
    for id in ["s0", "s1", "s2", "s3"] {
        one_turn(&http, &small, id, &model).await;
    }
    let health = send(&http, Method::GET, small.url("/v1/health"), None, None).await;
    assert_eq!(health.body["status"], "ok");
    let cache = &health.body["state_cache"];
    assert_eq!(cache["max_sessions"], 2, "{cache}");
    assert_eq!(cache["max_bytes"], 3 << 20, "{cache}");
    let cached = cache["sessions"].as_u64().unwrap();
    assert!((1..=2).contains(&cached), "{cache}");
    assert!(cache["bytes"].as_u64().unwrap() > 0, "{cache}");
    let again = send(
        &http,
        Method::POST,
        small.url("/v1/sessions/s0/messages"),
        None,
        Some(json!({"text": "again"})),
    )
    .await;
    assert_eq!(again.status, StatusCode::ACCEPTED, "{}", again.body);
    let outcome = wait_turn(&http, &small, None, "s0", 2).await;
    assert_eq!(
        (&outcome["status"], &outcome["answer"]),
        (&json!("completed"), &json!("second")),
        "{outcome}"
    );

    let default = Server::start(&dir.path().join("default"), &["--local-workers", "1"]);
    for id in ["s0", "s1", "s2", "s3"] {
        one_turn(&http, &default, id, &model).await;
    }
    let health = send(&http, Method::GET, default.url("/v1/health"), None, None).await;
    let cache = &health.body["state_cache"];
    assert_eq!(
        (
            &cache["sessions"],
            &cache["max_sessions"],
            &cache["max_bytes"]
        ),
        (&json!(4), &json!(512), &json!(64 << 20)),
        "{cache}"
    );
}

#[tokio::test]
async fn a_session_whose_history_does_not_fold_leaves_the_server_starting_and_the_others_running() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["Still here."]);
    let data: PathBuf = dir.path().join("store");
    let mut server = Server::start(&data, &[]);
    let http = reqwest::Client::new();
    for id in ["broken", "refused", "good"] {
        let created = send(
            &http,
            Method::POST,
            server.url("/v1/sessions"),
            None,
            Some(json!({"session_id": id, "model": model, "message": {"text": "hi"}})),
        )
        .await;
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    }
    server.kill().await;
    crate::support::append_a_turn_end_no_workflow_records(&data, "broken").await;
    let refused_seq = crate::support::append_a_message_the_workflow_refuses(&data, "refused").await;

    let server = Server::start(&data, &["--local-workers", "1"]);
    let outcome = wait_turn(&http, &server, None, "good", 1).await;
    assert_eq!(
        json!([&outcome["status"], &outcome["answer"]]),
        json!(["completed", "Still here."])
    );
    let broken = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/broken"),
        None,
        None,
    )
    .await;
    assert_eq!(
        broken.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        broken.body
    );
    assert!(
        broken.body["error"]["message"].as_str().is_some_and(|m| {
            m.starts_with(
            "the history of session \"broken\" cannot be read by this server, and trying again \
             will not change that: replayed with this server's code it diverges at event 4"
        )
        }),
        "{}",
        broken.body
    );
    assert_eq!(broken.body["error"]["code"], "history_unreadable");
    // A stored event the workflow refuses is the history's fault too: not the 409 a request
    // the workflow refuses gets.
    let refused = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/refused"),
        None,
        None,
    )
    .await;
    assert_eq!(
        (refused.status, &refused.body["error"]["code"]),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!("history_unreadable")
        ),
        "{}",
        refused.body
    );
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.ends_with(&format!(
                "trying again will not change that: stored event {refused_seq} does not fold: a \
             turn is already running"
            ))),
        "{}",
        refused.body
    );
    let health = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
    assert_eq!(health.status, StatusCode::OK, "{}", health.body);
    // Through the server, the listing shows the broken session as unreadable, not an error.
    let listed = crate::support::cairn_command()
        .args(["sessions", "--server", &server.url("")])
        .output()
        .expect("cairn sessions");
    let listing = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.status.success(),
        "{listing}\n{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(
        listing.lines().any(|l| l.starts_with("broken ")
            && l.contains("unreadable: session \"broken\": the history of session"))
            && listing
                .lines()
                .any(|l| l.starts_with("good ") && l.contains("idle")),
        "{listing}"
    );
}

#[tokio::test]
async fn event_streams_past_the_cap_are_refused_until_one_closes() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["unused"]);
    let server = Server::start(&dir.path().join("store"), &["--max-streams", "2"]);
    let http = reqwest::Client::new();
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "s", "model": model})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let open = || http.get(server.url("/v1/sessions/s/events")).send();
    let first = open().await.unwrap();
    let second = open().await.unwrap();
    assert_eq!(
        (first.status(), second.status()),
        (StatusCode::OK, StatusCode::OK)
    );
    let refused = open().await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("2 event streams open") && m.contains("--max-streams")),
        "{body}"
    );
    let health = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
    assert_eq!(health.body["event_streams"], json!({"open": 2, "max": 2}));
    // A client that goes away gives its place back.
    drop(first);
    let mut third = None;
    for _ in 0..200 {
        let answer = open().await.unwrap();
        if answer.status() == StatusCode::OK {
            third = Some(answer);
            break;
        }
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(third.is_some(), "no place came free after a stream closed");
    let health = send(&http, Method::GET, server.url("/v1/health"), None, None).await;
    assert_eq!(health.body["event_streams"], json!({"open": 2, "max": 2}));
    drop((second, third));
}
