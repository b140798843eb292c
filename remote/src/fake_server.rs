//! A test server (feature `test-server`): the `/v1` routes as `cairn_runtime::wire`
//! describes them, over an in-process engine, with faults to inject (failed reports, event
//! streams cut short, events resent or left out, small history pages), served on TCP or on a
//! unix socket. It stands in for the server crate so the transport, the task source and the
//! CLI can be tested on their own; it is not that server (no namespaces, no roles, one token).

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cairn_runtime::client::follow;
use cairn_runtime::wire::{
    CancelRequest, Cancelled, CreateSession, DeltaBatch, ErrorBody, ErrorCode, ErrorDetail,
    HeartbeatRequest, HeartbeatResponse, HistoryPage, LeaseRequest, LeaseResponse, ProgressRequest,
    ReportRequest, SendMessage, SessionCreated, StreamEvent, TurnStarted, TurnWait,
};
use cairn_runtime::{
    Client, Engine, Error, Limits, MemoryStore, RetryPolicy, SessionOptions, SessionQuery,
    SessionStatus, SystemClock, TaskFilter,
};
use cairn_workers::{EngineSource, TaskSource};
use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Faults the server injects.
#[derive(Default)]
pub struct Faults {
    /// Answer this many reports with 503 before accepting one.
    pub fail_reports: AtomicU32,
    /// Take this many reports (their deltas passed on, the report recorded) and answer each
    /// with 503, as a connection cut after the server took a report loses its answer.
    pub lose_report_answers: AtomicU32,
    /// Answer this many turn waits (`GET /v1/sessions/{id}/turns/{turn}`) with 503, as a
    /// server restarting or a store briefly unavailable does.
    pub fail_turn_waits: AtomicU32,
    /// Never answer this many heartbeats (each waits forever, as a request sent on a
    /// connection that went dead without a reset does).
    pub hang_heartbeats: AtomicU32,
    /// Close each event stream after this many history events.
    pub events_per_connection: Option<usize>,
    /// On a reconnect, send again this many events before `Last-Event-ID`.
    pub resend_on_reconnect: u64,
    /// Never send this seq on an event stream (it is only in the history).
    pub withhold_seq: Option<u64>,
    /// History pages hold at most this many events (0: no cap).
    pub page_limit: usize,
    /// Write stream messages as bare events and deltas rather than tagged `StreamEvent`s.
    pub bare_stream: bool,
    /// Refuse a report that asks for tasks (`next`) as a server from before the field does.
    pub refuse_next: bool,
    /// Refuse a report that carries deltas as a server from before the field does.
    pub refuse_deltas: bool,
    /// Refuse a report that carries deltas as too large (413), as a server does whose body
    /// limit the deltas put the report over.
    pub too_large_with_deltas: bool,
    /// Refuse a report of a result (not a failure) as too large (413), as a server does whose
    /// body limit the result is over.
    pub too_large_results: bool,
    /// Refuse a new session's first message (`message` in `POST /v1/sessions`) as a server
    /// from before the field does.
    pub refuse_first_message: bool,
    /// Ignore `wait_ms` on the routes that start a turn, answering at once without the
    /// outcome, as a server from before the parameter does.
    pub ignore_wait: bool,
    /// Carry out this many requests that start a turn and then answer them 503, as if the
    /// answer were lost on the way (the client cannot tell whether its message landed).
    pub lose_answers: AtomicU32,
    /// Answer this many lease requests 503 without leasing, as a connection cut before the
    /// answer leaves the worker unsure whether the server leased anything.
    pub lose_lease_answers: AtomicU32,
}

/// Counts one off a fault's countdown: whether it was not yet at zero (the fault applies).
fn take_one(countdown: &AtomicU32) -> bool {
    countdown
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

/// One request the server saw.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The path and query.
    pub uri: String,
    /// Its `Last-Event-ID` header.
    pub last_event_id: Option<String>,
    /// Its `Idempotency-Key` header.
    pub idempotency_key: Option<String>,
}

/// The test server's state.
pub struct FakeServer {
    /// The engine it serves.
    pub engine: Engine,
    client: Client,
    token: Option<String>,
    /// The faults it injects.
    pub faults: Faults,
    seen: Mutex<Vec<Seen>>,
    /// Reports received (failed ones included).
    pub reports: AtomicU32,
    /// The size of each delta batch received.
    pub delta_batches: Mutex<Vec<usize>>,
    /// The deltas each accepted report carried.
    pub reported_deltas: Mutex<Vec<usize>>,
}

type Shared = Arc<FakeServer>;

impl FakeServer {
    /// A server over a new in-memory store, asking for `token` when given.
    pub fn new(token: Option<&str>, faults: Faults) -> Shared {
        let engine = Engine::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock));
        Self::with_engine(engine, token, faults)
    }

    /// A server over `engine`.
    pub fn with_engine(engine: Engine, token: Option<&str>, faults: Faults) -> Shared {
        Arc::new(FakeServer {
            client: Client::new(engine.clone()),
            engine,
            token: token.map(str::to_owned),
            faults,
            seen: Mutex::default(),
            reports: AtomicU32::new(0),
            delta_batches: Mutex::default(),
            reported_deltas: Mutex::default(),
        })
    }

    /// The requests seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Its routes.
    pub fn router(self: &Shared) -> Router {
        Router::new()
            .route(
                "/v1/health",
                get(|| async { Json(serde_json::json!({"status": "ok"})) }),
            )
            .route("/v1/sessions", post(create_session).get(list_sessions))
            .route("/v1/sessions/{id}", get(describe))
            .route("/v1/sessions/{id}/messages", post(send_message))
            .route("/v1/sessions/{id}/turns/{turn}", get(wait_turn))
            .route("/v1/sessions/{id}/history", get(history))
            .route("/v1/sessions/{id}/transcript", get(transcript))
            .route("/v1/sessions/{id}/cancel", post(cancel))
            .route("/v1/sessions/{id}/events", get(events))
            .route("/v1/worker/lease", post(lease))
            .route("/v1/worker/heartbeat", post(heartbeat))
            .route("/v1/worker/progress", post(progress))
            .route("/v1/worker/report", post(report))
            .route("/v1/worker/deltas", post(deltas))
            .layer(middleware::from_fn_with_state(self.clone(), check))
            .with_state(self.clone())
    }
}

/// Records the request and checks the token.
async fn check(State(server): State<Shared>, request: Request, next: Next) -> Response {
    server.seen.lock().unwrap().push(Seen {
        uri: request.uri().to_string(),
        last_event_id: header(request.headers(), "last-event-id"),
        idempotency_key: header(request.headers(), "idempotency-key"),
    });
    if let Some(token) = &server.token {
        if header(request.headers(), "authorization") != Some(format!("Bearer {token}")) {
            return error_answer(
                ErrorCode::Unauthorized,
                "no token, or an unknown one".into(),
            );
        }
    }
    next.run(request).await
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name)?.to_str().ok().map(str::to_owned)
}

fn error_answer(code: ErrorCode, message: String) -> Response {
    let status = StatusCode::from_u16(code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(ErrorBody {
            error: ErrorDetail { code, message },
        }),
    )
        .into_response()
}

/// The error answer of a runtime error, as the API's table gives it.
fn failed(e: Error) -> Response {
    let code = match &e {
        Error::UnknownSession { .. } => ErrorCode::NotFound,
        Error::StaleReport { .. } => ErrorCode::StaleReport,
        Error::LeaseLost { .. } => ErrorCode::LeaseLost,
        Error::InvalidEvent { .. } => ErrorCode::Conflict,
        Error::InvalidSessionId { .. } => ErrorCode::InvalidRequest,
        Error::IdempotencyKeyReused { .. } => ErrorCode::IdempotencyKeyReused,
        _ => ErrorCode::Internal,
    };
    error_answer(code, e.to_string())
}

fn answer<T: serde::Serialize>(result: cairn_runtime::Result<T>) -> Response {
    match result {
        Ok(value) => Json(value).into_response(),
        Err(e) => failed(e),
    }
}

/// The answer to a request that started a turn, unless [`Faults::lose_answers`] has it
/// lost.
fn unless_lost(server: &FakeServer, answer: Response) -> Response {
    let lost = take_one(&server.faults.lose_answers);
    if lost {
        return error_answer(
            ErrorCode::Unavailable,
            "the answer was lost on the way".into(),
        );
    }
    answer
}

/// The outcome of `turn` once it ends, waiting up to the query's `wait_ms` (none: no wait).
async fn outcome_within(
    server: &FakeServer,
    query: &BTreeMap<String, u64>,
    id: &str,
    turn: u32,
) -> Option<cairn_runtime::TurnOutcome> {
    let wait = query.get("wait_ms").copied().unwrap_or(0);
    if wait == 0 || server.faults.ignore_wait {
        return None;
    }
    server
        .client
        .wait_turn_for(id, turn, Duration::from_millis(wait))
        .await
        .ok()
        .flatten()
}

async fn create_session(
    State(server): State<Shared>,
    Query(query): Query<BTreeMap<String, u64>>,
    headers: HeaderMap,
    Json(body): Json<CreateSession>,
) -> Response {
    let key = header(&headers, "idempotency-key");
    let options = SessionOptions {
        session_id: body.session_id,
        system_prompt: body.system_prompt,
        limits: body.limits.unwrap_or_else(Limits::default),
        model_retry: body.model_retry.unwrap_or_else(RetryPolicy::model_default),
        tool_retry: body.tool_retry.unwrap_or_else(RetryPolicy::tool_default),
        queues: body.queues.unwrap_or_default(),
        ..SessionOptions::new(body.model, body.tools)
    };
    let created = match body.message {
        Some(_) if server.faults.refuse_first_message => {
            // What a server whose CreateSession has no `message` answers.
            return error_answer(
                ErrorCode::InvalidRequest,
                "unknown field `message`, expected one of `session_id`, `model`, `tools` at line 1 column 9"
                    .to_owned(),
            );
        }
        message if key.is_some() && options.session_id.is_some() => {
            let session_id = options.session_id.clone().unwrap_or_default();
            server
                .engine
                .start_session_idempotent(
                    &session_id,
                    options.started(),
                    key.as_deref().unwrap_or_default(),
                    message.as_ref(),
                )
                .await
                .map(|turn| (session_id, turn))
        }
        Some(message) => server
            .client
            .start_session_and_send(options, &message.text)
            .await
            .map(|(session_id, turn)| (session_id, Some(turn))),
        None => server
            .client
            .start_session(options)
            .await
            .map(|session_id| (session_id, None)),
    };
    match created {
        Ok((session_id, turn)) => {
            let outcome = match turn {
                Some(turn) => outcome_within(&server, &query, &session_id, turn).await,
                None => None,
            };
            let created = (
                StatusCode::CREATED,
                Json(SessionCreated {
                    session_id,
                    turn,
                    outcome,
                }),
            );
            unless_lost(&server, created.into_response())
        }
        Err(e) => failed(e),
    }
}

async fn list_sessions(
    State(server): State<Shared>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let status = match query.get("status").map(String::as_str) {
        None => None,
        Some("idle") => Some(SessionStatus::Idle),
        Some("running") => Some(SessionStatus::Running),
        Some("cancelled") => Some(SessionStatus::Cancelled),
        Some(other) => return error_answer(ErrorCode::InvalidRequest, format!("status {other:?}")),
    };
    let query = SessionQuery {
        status,
        after: query.get("after").cloned(),
        limit: query.get("limit").and_then(|l| l.parse().ok()),
    };
    answer(server.client.list_sessions(&query).await)
}

async fn describe(State(server): State<Shared>, Path(id): Path<String>) -> Response {
    answer(server.client.describe(&id).await)
}

async fn send_message(
    State(server): State<Shared>,
    Path(id): Path<String>,
    Query(query): Query<BTreeMap<String, u64>>,
    headers: HeaderMap,
    Json(body): Json<SendMessage>,
) -> Response {
    let sent = match (header(&headers, "idempotency-key"), body.model.clone()) {
        (Some(key), _) => server.engine.send_idempotent(&id, &key, &body).await,
        (None, Some(model)) => server.client.send_with_model(&id, &body.text, model).await,
        (None, None) => server.client.send(&id, &body.text).await,
    };
    match sent {
        Ok(turn) => {
            let outcome = outcome_within(&server, &query, &id, turn).await;
            let status = match outcome {
                Some(_) => StatusCode::OK,
                None => StatusCode::ACCEPTED,
            };
            unless_lost(
                &server,
                (status, Json(TurnStarted { turn, outcome })).into_response(),
            )
        }
        Err(e) => failed(e),
    }
}

async fn wait_turn(
    State(server): State<Shared>,
    Path((id, turn)): Path<(String, u32)>,
    Query(query): Query<BTreeMap<String, u64>>,
) -> Response {
    let fail = take_one(&server.faults.fail_turn_waits);
    if fail {
        return error_answer(ErrorCode::Unavailable, "restarting".into());
    }
    let timeout = Duration::from_millis(query.get("timeout_ms").copied().unwrap_or(0));
    answer(
        server
            .client
            .wait_turn_for(&id, turn, timeout)
            .await
            .map(|outcome| TurnWait {
                done: outcome.is_some(),
                outcome,
            }),
    )
}

async fn history(
    State(server): State<Shared>,
    Path(id): Path<String>,
    Query(query): Query<BTreeMap<String, u64>>,
) -> Response {
    let from_seq = query.get("from_seq").copied().unwrap_or(1);
    let mut limit = query.get("limit").map(|l| *l as usize);
    if server.faults.page_limit > 0 {
        limit = Some(limit.unwrap_or(usize::MAX).min(server.faults.page_limit));
    }
    answer(
        server
            .client
            .history_from(&id, from_seq, limit)
            .await
            .map(|events| HistoryPage {
                next_seq: events.last().map_or(from_seq, |e| e.seq + 1),
                events,
            }),
    )
}

async fn transcript(State(server): State<Shared>, Path(id): Path<String>) -> Response {
    match server.client.transcript(&id).await {
        Ok(transcript) => (
            [("content-type", "application/json")],
            transcript.canonical_json(),
        )
            .into_response(),
        Err(e) => failed(e),
    }
}

async fn cancel(
    State(server): State<Shared>,
    Path(id): Path<String>,
    Json(body): Json<CancelRequest>,
) -> Response {
    let reason = body.reason.unwrap_or_else(|| "cancelled".to_owned());
    if body.turn_only {
        answer(
            server
                .client
                .cancel_turn(&id, &reason)
                .await
                .map(|turn| Cancelled { turn: Some(turn) }),
        )
    } else {
        answer(
            server
                .client
                .cancel(&id, &reason)
                .await
                .map(|()| Cancelled { turn: None }),
        )
    }
}

/// The SSE stream: from `Last-Event-ID` (or `after_seq`), cut and resent as the faults say.
async fn events(
    State(server): State<Shared>,
    Path(id): Path<String>,
    Query(query): Query<BTreeMap<String, u64>>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = server.client.describe(&id).await {
        return failed(e);
    }
    let last_event_id = header(&headers, "last-event-id").and_then(|v| v.parse::<u64>().ok());
    let mut after = last_event_id
        .or(query.get("after_seq").copied())
        .unwrap_or(0);
    if last_event_id.is_some() {
        after = after.saturating_sub(server.faults.resend_on_reconnect);
    }
    // Subscribed first, then what is stored already: nothing appended in between is missed.
    let mut follower = follow(server.engine.clone(), id, after);
    let mut backlog = VecDeque::new();
    if let Err(e) = follower.catch_up(&mut backlog).await {
        return failed(e);
    }
    let state = (follower, backlog, 0usize, server.clone());
    let stream = futures_util::stream::unfold(
        state,
        |(mut follower, mut backlog, mut sent, server)| async move {
            loop {
                if let Some(limit) = server.faults.events_per_connection {
                    if sent >= limit {
                        return None;
                    }
                }
                if let Some(message) = backlog.pop_front() {
                    if let StreamEvent::Event(e) = &message {
                        if Some(e.seq) == server.faults.withhold_seq {
                            continue;
                        }
                        sent += 1;
                    }
                    let bytes = sse_message(&message, server.faults.bare_stream);
                    return Some((
                        Ok::<_, Infallible>(bytes),
                        (follower, backlog, sent, server),
                    ));
                }
                match follower.next(&mut backlog).await {
                    Some(Ok(())) => {}
                    _ => return None,
                }
            }
        },
    );
    (
        [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

fn sse_message(message: &StreamEvent, bare: bool) -> Bytes {
    let (kind, id, data) = match message {
        StreamEvent::Event(e) => (
            "event",
            format!("id: {}\n", e.seq),
            if bare {
                serde_json::to_string(e)
            } else {
                serde_json::to_string(message)
            },
        ),
        StreamEvent::Delta(d) => (
            "delta",
            String::new(),
            if bare {
                serde_json::to_string(d)
            } else {
                serde_json::to_string(message)
            },
        ),
    };
    let data = data.unwrap_or_default();
    Bytes::from(format!(": keepalive\nevent: {kind}\n{id}data: {data}\n\n"))
}

fn source(server: &FakeServer) -> EngineSource {
    EngineSource::new(server.engine.clone())
}

async fn lease(State(server): State<Shared>, Json(body): Json<LeaseRequest>) -> Response {
    if take_one(&server.faults.lose_lease_answers) {
        return error_answer(
            ErrorCode::Unavailable,
            "the answer was lost on the way".into(),
        );
    }
    let filter = TaskFilter {
        queues: body.queues,
        tools: body.tools,
        providers: body.providers,
        sessions: None,
        namespace: None,
    };
    answer(
        source(&server)
            .lease(
                &filter,
                body.max as usize,
                body.lease_ms,
                Duration::from_millis(body.wait_ms),
            )
            .await
            .map(|tasks| LeaseResponse { tasks }),
    )
}

async fn heartbeat(State(server): State<Shared>, Json(body): Json<HeartbeatRequest>) -> Response {
    let hang = take_one(&server.faults.hang_heartbeats);
    if hang {
        std::future::pending::<()>().await;
    }
    answer(
        source(&server)
            .heartbeat(&body.lease, body.lease_ms, body.details)
            .await
            .map(|expires_at_ms| HeartbeatResponse { expires_at_ms }),
    )
}

async fn progress(State(server): State<Shared>, Json(body): Json<ProgressRequest>) -> Response {
    match source(&server)
        .record_progress_with_usage(
            &body.lease,
            body.text_appended,
            body.thinking_appended,
            body.usage,
        )
        .await
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(e),
    }
}

async fn report(State(server): State<Shared>, Json(body): Json<ReportRequest>) -> Response {
    server.reports.fetch_add(1, Ordering::Relaxed);
    let failing = take_one(&server.faults.fail_reports);
    if failing {
        return error_answer(ErrorCode::Unavailable, "restarting".to_owned());
    }
    if server.faults.refuse_next && body.next.is_some() {
        // What a server whose ReportRequest has no `next` answers (its JSON rejection).
        return error_answer(
            ErrorCode::InvalidRequest,
            "unknown field `next`, expected `lease` or `report` at line 1 column 9".to_owned(),
        );
    }
    if server.faults.refuse_deltas && !body.deltas.is_empty() {
        // What a server whose ReportRequest has no `deltas` answers.
        return error_answer(
            ErrorCode::InvalidRequest,
            "unknown field `deltas`, expected one of `lease`, `report`, `next` at line 1 column 9"
                .to_owned(),
        );
    }
    let a_result = !matches!(body.report, cairn_runtime::ActivityReport::Failed(_));
    if (server.faults.too_large_with_deltas && !body.deltas.is_empty())
        || (server.faults.too_large_results && a_result)
    {
        return error_answer(ErrorCode::TooLarge, "the body is too large".to_owned());
    }
    server
        .reported_deltas
        .lock()
        .unwrap()
        .push(body.deltas.len());
    for delta in body.deltas {
        server.engine.publish_delta(delta);
    }
    let recorded = source(&server).report(&body.lease, body.report).await;
    let lost = take_one(&server.faults.lose_report_answers);
    match recorded {
        Ok(()) if lost => error_answer(
            ErrorCode::Unavailable,
            "the answer was lost on the way".into(),
        ),
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(e),
    }
}

async fn deltas(State(server): State<Shared>, Json(body): Json<DeltaBatch>) -> Response {
    server.delta_batches.lock().unwrap().push(body.deltas.len());
    for delta in body.deltas {
        server.engine.publish_delta(delta);
    }
    StatusCode::NO_CONTENT.into_response()
}

/// A router serving until dropped, and its address.
pub struct Served {
    /// `http://127.0.0.1:PORT` or `unix:PATH`.
    pub url: String,
    task: tokio::task::JoinHandle<()>,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `router` on a free local port.
pub async fn serve_tcp(router: Router) -> std::io::Result<Served> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(Served {
        url,
        task,
        _dir: None,
    })
}

/// Serves `router` on a unix socket in a new temporary directory.
pub async fn serve_unix(router: Router) -> std::io::Result<Served> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("cairn.sock");
    let mut served = serve_unix_at(&path, router)?;
    served._dir = Some(dir);
    Ok(served)
}

/// Serves `router` on a unix socket at `path` (which must not exist).
pub fn serve_unix_at(path: &std::path::Path, router: Router) -> std::io::Result<Served> {
    let listener = tokio::net::UnixListener::bind(path)?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(Served {
        url: format!("unix:{}", path.display()),
        task,
        _dir: None,
    })
}
