//! The transport and the task source against routers on TCP and on unix sockets: a whole turn
//! through a remote worker pool and a remote client (over the test server of
//! `fake_server.rs`), event streams that are cut, resend or leave out events, reports that
//! meet a failing or restarting server, and every error answer mapped back.

use crate::fake_server::{serve_tcp, serve_unix, serve_unix_at, FakeServer, Faults, Served};
use crate::{connect, HttpTaskSource, HttpTransport};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use cairn_activities::ToolRegistry;
use cairn_ledger::{Delta, ModelSpec};
use cairn_runtime::wire::StreamEvent;
use cairn_runtime::{
    ActivityFailure, ActivityRef, ActivityReport, Client, DeltaEvent, Error, ErrorClass, Event,
    EventStream, Lease, SessionOptions, SessionQuery, SessionStatus, TaskFilter, TaskId, TaskKind,
    TurnOutcome,
};
use cairn_workers::{Activities, StandardModels, TaskSource, WorkerConfig, WorkerPool};
use std::collections::BTreeSet;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A guard against a hang, not a timing assertion: what it waits for happens in well under
/// a second when things work.
const HANG_GUARD: Duration = Duration::from_secs(60);

async fn guarded<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(HANG_GUARD, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what} did not happen within {HANG_GUARD:?}"),
    }
}

fn demo_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../activities/scripts/demo.json")
}

fn demo_model() -> ModelSpec {
    ModelSpec::parse(&format!("scripted:{}", demo_script().display())).unwrap()
}

/// A worker pool of this process over the server at `url`, as `cairn worker` runs one.
fn remote_pool(
    url: &str,
    token: Option<&str>,
    workdir: &std::path::Path,
) -> (WorkerPool, Arc<HttpTaskSource>) {
    let source = Arc::new(HttpTaskSource::new(url, token.map(str::to_owned)).unwrap());
    let activities = Activities {
        models: Arc::new(StandardModels::new()),
        tools: Arc::new(ToolRegistry::builtin(workdir)),
    };
    let config = WorkerConfig {
        poll_interval_ms: 1_000,
        renew_interval_ms: Some(1_000),
        queues: Some(BTreeSet::from(["default".to_owned()])),
        ..WorkerConfig::default()
    };
    let pool = WorkerPool::start_with(source.clone(), activities, config);
    (pool, source)
}

/// Reads `stream` until `done` says so.
async fn read_until(
    stream: &mut EventStream,
    mut done: impl FnMut(&StreamEvent) -> bool,
) -> Vec<StreamEvent> {
    let mut seen = Vec::new();
    guarded("the awaited stream event", async {
        loop {
            let event = stream
                .next()
                .await
                .expect("the stream went on")
                .expect("no stream error");
            let stop = done(&event);
            seen.push(event);
            if stop {
                return;
            }
        }
    })
    .await;
    seen
}

fn seqs(events: &[StreamEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::Event(e) => Some(e.seq),
            StreamEvent::Delta(_) => None,
        })
        .collect()
}

#[tokio::test]
async fn a_turn_runs_on_a_remote_worker_pool_and_streams_to_a_remote_client() {
    // Over TCP and a unix socket; then with every event stream cut after 4 events and a
    // reconnect sent the last 2 again: the client must still see each event once (deltas
    // sent while it reconnects are missed: they are presentation only).
    for (unix, cut) in [(false, false), (true, false), (true, true)] {
        let faults = Faults {
            events_per_connection: cut.then_some(4),
            resend_on_reconnect: if cut { 2 } else { 0 },
            page_limit: 3,
            ..Faults::default()
        };
        let server = FakeServer::new(Some("s3cret"), faults);
        let served = if unix {
            serve_unix(server.router()).await.unwrap()
        } else {
            serve_tcp(server.router()).await.unwrap()
        };
        let workdir = tempfile::tempdir().unwrap();
        std::fs::write(
            workdir.path().join("notes.txt"),
            "The launch is on Tuesday.\n",
        )
        .unwrap();
        let (pool, source) = remote_pool(&served.url, Some("s3cret"), workdir.path());
        let client = connect(&served.url, Some("s3cret".to_owned())).unwrap();

        let tools = ToolRegistry::builtin(workdir.path()).specs();
        let mut options = SessionOptions::new(demo_model(), tools);
        options.session_id = Some("remote-1".to_owned());
        let session = client.start_session(options).await.unwrap();
        assert_eq!(session, "remote-1");
        let mut stream = client.subscribe(&session, 0).await.unwrap();
        let turn = client
            .send(&session, "What is (17 + 25) * 3?")
            .await
            .unwrap();
        guarded("the pool's first lease", source.reached())
            .await
            .unwrap();

        let seen = read_until(&mut stream, |e| {
            matches!(e, StreamEvent::Event(e) if matches!(e.event, Event::TurnCompleted { .. }))
        })
        .await;
        let outcome = client.wait_turn(&session, turn).await.unwrap();
        let TurnOutcome::Completed { answer, .. } = &outcome else {
            panic!("{outcome:?}");
        };
        // Every delta of the answering model call arrives before the turn's end: the worker
        // sends them before its report, and followers pass deltas on first.
        let answer_text = |seen: &[StreamEvent]| -> String {
            seen.iter()
                .filter_map(|e| match e {
                    StreamEvent::Delta(DeltaEvent {
                        origin,
                        delta: Delta::Text(text),
                    }) if origin.activity == "model:1" => Some(text.as_str()),
                    _ => None,
                })
                .collect()
        };
        if !cut {
            assert_eq!(
                answer_text(&seen),
                *answer,
                "unix {unix}: the text came before the end"
            );
        }

        // Each history event exactly once, in order, although the stream was cut 3 times and
        // events were resent.
        let history = client.history(&session).await.unwrap();
        let last = history.last().unwrap().seq;
        assert_eq!(
            seqs(&seen),
            (1..=last).collect::<Vec<_>>(),
            "unix {unix}, cut {cut}"
        );
        let streamed: Vec<_> = seen
            .iter()
            .filter_map(|e| match e {
                StreamEvent::Event(e) => Some(e.clone()),
                StreamEvent::Delta(_) => None,
            })
            .collect();
        assert_eq!(
            streamed, history,
            "the stream and the (paged) history agree"
        );
        let reconnects: Vec<u64> = server
            .seen()
            .iter()
            .filter(|s| s.uri.contains("/events"))
            .filter_map(|s| s.last_event_id.as_ref()?.parse().ok())
            .collect();
        if cut {
            assert!(reconnects.len() >= 3, "{reconnects:?}");
            assert!(reconnects.windows(2).all(|w| w[0] < w[1]), "{reconnects:?}");
        } else {
            assert!(
                reconnects.is_empty(),
                "the stream was never cut: {reconnects:?}"
            );
        }

        // Reads agree with the engine's own.
        let local = Client::new(server.engine.clone());
        assert_eq!(
            client.transcript(&session).await.unwrap(),
            local.transcript(&session).await.unwrap()
        );
        let description = client.describe(&session).await.unwrap();
        assert_eq!(description, local.describe(&session).await.unwrap());
        assert_eq!(description.status, SessionStatus::Idle);
        assert_eq!(description.last_outcome, Some(outcome.clone()));
        assert_eq!(
            client.sessions().await.unwrap(),
            local.sessions().await.unwrap()
        );
        pool.shutdown().await;
    }
}

#[tokio::test]
async fn an_event_left_out_of_the_stream_is_read_from_the_history() {
    let server = FakeServer::new(
        None,
        Faults {
            withhold_seq: Some(2),
            bare_stream: true,
            ..Faults::default()
        },
    );
    let served = serve_unix(server.router()).await.unwrap();
    let client = connect(&served.url, None).unwrap();
    let session = client
        .start_session(SessionOptions::new(demo_model(), Vec::new()))
        .await
        .unwrap();
    let mut stream = client.subscribe(&session, 0).await.unwrap();
    let turn = client.send(&session, "hello").await.unwrap();
    let seen = read_until(
        &mut stream,
        |e| matches!(e, StreamEvent::Event(e) if e.seq == 3),
    )
    .await;
    assert_eq!(seqs(&seen), [1, 2, 3]);
    // No worker runs: the turn does not end, and a bounded wait says so.
    assert_eq!(
        client
            .wait_turn_for(&session, turn, Duration::from_millis(200))
            .await
            .unwrap(),
        None
    );
    let polls: Vec<_> = server
        .seen()
        .into_iter()
        .filter(|s| s.uri.contains("/turns/1?timeout_ms="))
        .collect();
    assert!(!polls.is_empty());
    // Queries carry their parameters.
    let page = client
        .list_sessions(&SessionQuery {
            status: Some(SessionStatus::Running),
            after: Some("a b".to_owned()),
            limit: Some(5),
        })
        .await
        .unwrap();
    assert_eq!(page.sessions.len(), 1);
    assert!(
        server
            .seen()
            .iter()
            .any(|s| s.uri == "/v1/sessions?status=running&after=a%20b&limit=5"),
        "{:?}",
        server.seen()
    );
    // A turn-only cancel answers with the turn.
    assert_eq!(client.cancel_turn(&session, "enough").await.unwrap(), turn);
}

fn lease_of(session: &str, seq: u64) -> Lease {
    Lease {
        id: TaskId {
            session_id: session.to_owned(),
            scheduled_seq: seq,
        },
        kind: TaskKind::Model,
        lease_attempt: 2,
        // Far ahead: retries are not cut short by the lease in these tests.
        expires_at_ms: u64::MAX / 2,
    }
}

fn failure() -> ActivityReport {
    ActivityReport::Failed(ActivityFailure::new(ErrorClass::Transient, "test"))
}

fn error_body(status: u16, code: &str, message: &str) -> axum::response::Response {
    (
        StatusCode::from_u16(status).unwrap(),
        [("content-type", "application/json")],
        serde_json::json!({"error": {"code": code, "message": message}}).to_string(),
    )
        .into_response()
}

/// A stream the server ends with an `error` message it does not call passing (a record it
/// cannot read) ends for the consumer with that error, after one connection; one it calls
/// passing (`unavailable`) is reconnected past. (Before, the message was skipped as of an
/// unknown kind and the stream reconnected forever, the consumer never told.)
#[tokio::test]
async fn a_stream_the_server_ends_with_an_error_ends_with_it() {
    let hits = Arc::new(AtomicU32::new(0));
    let router = Router::new()
        .route(
            "/v1/sessions/{id}/events",
            get({
                let hits = hits.clone();
                move || {
                    let hits = hits.clone();
                    async move {
                        // The first connection ends on a passing error, the later ones on a
                        // lasting one.
                        let code = if hits.fetch_add(1, Ordering::SeqCst) == 0 {
                            "unavailable"
                        } else {
                            "internal"
                        };
                        let body = serde_json::json!({"error": {"code": code, "message": "corrupt record at seq 5"}});
                        (
                            [("content-type", "text/event-stream")],
                            format!("event: error\ndata: {body}\n\n"),
                        )
                    }
                }
            }),
        );
    let served = serve_tcp(router).await.unwrap();
    let client = Client::with_transport(Arc::new(HttpTransport::new(&served.url, None).unwrap()));
    let mut stream = client.subscribe("s1", 0).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("the stream ends, not reconnects forever");
    match ended {
        Some(Err(e)) => assert!(e.to_string().contains("corrupt record at seq 5"), "{e}"),
        other => panic!("the server's error, got {other:?}"),
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        2,
        "reconnected once past the passing error, then ended"
    );
}

/// A router answering each route with a fixed error.
fn failing_router() -> Router {
    Router::new()
        .route(
            "/v1/sessions/{id}",
            get(|| async { error_body(404, "not_found", "unknown session \"nope\"") }),
        )
        .route(
            "/v1/sessions/{id}/messages",
            post(|| async {
                error_body(
                    409,
                    "conflict",
                    "session \"s1\" seq 7: event rejected: turn 2 is running",
                )
            }),
        )
        .route(
            "/v1/sessions/{id}/cancel",
            post(|| async { error_body(409, "conflict", "nothing to cancel") }),
        )
        .route(
            "/v1/sessions",
            get(|| async { error_body(500, "internal", "store error: disk full") }),
        )
        .route(
            "/v1/sessions/{id}/history",
            get(|| async {
                (
                    StatusCode::BAD_GATEWAY,
                    [("content-type", "text/html")],
                    "<html>bad gateway</html>",
                )
            }),
        )
        .route("/v1/sessions/{id}/transcript", get(|| async { "not json" }))
        .route(
            "/v1/sessions/{id}/events",
            get(|| async { error_body(403, "forbidden", "a worker token") }),
        )
        .route(
            "/v1/worker/report",
            post(|| async { error_body(409, "stale_report", "the workflow waits for attempt 3") }),
        )
        .route(
            "/v1/worker/heartbeat",
            post(|| async { error_body(409, "lease_lost", "lease attempt 3 is current") }),
        )
        .route(
            "/v1/worker/progress",
            post(|| async { error_body(418, "teapot", "short and stout") }),
        )
        .route(
            "/v1/worker/lease",
            post(|| async { error_body(401, "unauthorized", "unknown token") }),
        )
}

#[tokio::test]
async fn error_answers_map_back_to_runtime_errors() {
    for served in [
        serve_unix(failing_router()).await.unwrap(),
        serve_tcp(failing_router()).await.unwrap(),
    ] {
        let url = served.url.clone();
        let client = connect(&url, Some("t".to_owned())).unwrap();
        let err = client.describe("nope").await.unwrap_err();
        assert!(
            matches!(&err, Error::UnknownSession { session_id } if session_id == "nope"),
            "{err:?}"
        );
        let err = client.send("s1", "hi").await.unwrap_err();
        assert!(
            matches!(&err, Error::InvalidEvent { session_id, seq: 7, reason } if session_id == "s1" && reason == "turn 2 is running"),
            "{err:?}"
        );
        let err = client.cancel("s1", "why").await.unwrap_err();
        assert!(
            matches!(&err, Error::InvalidEvent { seq: 0, reason, .. } if reason == "nothing to cancel"),
            "{err:?}"
        );
        let err = client.sessions().await.unwrap_err();
        assert!(
            matches!(&err, Error::Remote { status: 500, code, message, url: u } if code == "internal" && message == "store error: disk full" && *u == url),
            "{err:?}"
        );
        let err = client.history("s1").await.unwrap_err();
        assert!(
            matches!(&err, Error::Remote { status: 502, code, message, .. } if code == "http_502" && message == "<html>bad gateway</html>"),
            "{err:?}"
        );
        let err = client.transcript("s1").await.unwrap_err();
        assert!(
            matches!(&err, Error::BadAnswer { reason, .. } if reason.contains("does not decode")),
            "{err:?}"
        );
        let err = client.subscribe("s1", 0).await.err().expect("refused");
        assert!(
            matches!(&err, Error::Remote { status: 403, code, .. } if code == "forbidden"),
            "{err:?}"
        );

        let source = HttpTaskSource::new(&url, None).unwrap();
        let lease = lease_of("s1", 3);
        let err = source.report(&lease, failure()).await.unwrap_err();
        assert!(
            matches!(&err, Error::StaleReport { session_id, seq: 3, reason } if session_id == "s1" && reason.contains("attempt 3")),
            "{err:?}"
        );
        assert!(err.is_stale_report());
        let err = source.heartbeat(&lease, 1_000, None).await.unwrap_err();
        assert!(
            matches!(&err, Error::LeaseLost { task, .. } if task == "s1/3"),
            "{err:?}"
        );
        let err = source
            .record_progress(&lease, "a".into(), String::new())
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Remote { status: 418, code, message, .. } if code == "teapot" && message == "short and stout"),
            "{err:?}"
        );
        // A refused lease ends the wait for the server with the reason.
        let leased = source
            .lease(&TaskFilter::default(), 1, 1_000, Duration::ZERO)
            .await;
        assert!(
            matches!(leased, Err(Error::Remote { status: 401, .. })),
            "{leased:?}"
        );
        let err = source.reached().await.unwrap_err();
        assert!(
            matches!(&err, Error::Remote { status: 401, code, .. } if code == "unauthorized"),
            "{err:?}"
        );
        // What HTTP cannot carry is refused before anything is sent.
        let only = TaskFilter {
            sessions: Some(BTreeSet::from(["s1".to_owned()])),
            ..TaskFilter::default()
        };
        let err = source
            .lease(&only, 1, 1_000, Duration::ZERO)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
    }
}

#[tokio::test]
async fn an_unreachable_server_is_named_with_the_cause() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let err = connect(&url, None).unwrap().sessions().await.unwrap_err();
    let Error::Unreachable { url: u, reason } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(*u, url);
    assert!(
        reason.to_lowercase().contains("connection refused"),
        "{reason}"
    );
    assert!(err
        .to_string()
        .starts_with(&format!("cannot reach the cairn server at {url}: ")));

    let dir = tempfile::tempdir().unwrap();
    let url = format!("unix:{}", dir.path().join("cairn.sock").display());
    let err = connect(&url, None).unwrap().sessions().await.unwrap_err();
    assert!(
        matches!(&err, Error::Unreachable { reason, .. } if reason.contains("No such file")),
        "{err:?}"
    );
    assert!(matches!(
        HttpTransport::new("localhost:7070", None).err(),
        Some(Error::Unreachable { .. })
    ));
}

/// A session with a model task queued, on `server`; returns its lease through `source`.
/// A fake server with `faults`, served on TCP, and a task source over it (the served
/// server lives while the returned `Served` does).
async fn served_with(faults: Faults) -> (std::sync::Arc<FakeServer>, Served, HttpTaskSource) {
    let server = FakeServer::new(None, faults);
    let served = serve_tcp(server.router()).await.unwrap();
    let source = HttpTaskSource::new(&served.url, None).unwrap();
    (server, served, source)
}

async fn leased_model_task(server: &FakeServer, source: &HttpTaskSource) -> Lease {
    let local = Client::new(server.engine.clone());
    let session = local
        .start_session(SessionOptions::new(demo_model(), Vec::new()))
        .await
        .unwrap();
    local.send(&session, "hello").await.unwrap();
    let tasks = source
        .lease(&TaskFilter::default(), 1, 30_000, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(tasks.len(), 1);
    tasks[0].lease.clone()
}

/// A report the engine records (a failure the retry policy does not retry).
/// The failed model calls `session`'s history records.
async fn failed_model_calls(server: &FakeServer, session: &str) -> usize {
    let history = Client::new(server.engine.clone())
        .history(session)
        .await
        .unwrap();
    history
        .iter()
        .filter(|e| matches!(e.event, Event::ModelCallFailed { .. }))
        .count()
}

fn completion() -> ActivityReport {
    ActivityReport::Failed(ActivityFailure::new(
        ErrorClass::InvalidRequest,
        "refused by the test",
    ))
}

#[tokio::test]
async fn a_report_is_tried_again_while_the_server_fails() {
    let (server, _served, source) = served_with(Faults {
        fail_reports: 3.into(),
        ..Faults::default()
    })
    .await;
    let lease = leased_model_task(&server, &source).await;
    source.report(&lease, completion()).await.unwrap();
    assert_eq!(server.reports.load(Ordering::Relaxed), 4);
    let history = Client::new(server.engine.clone())
        .history(&lease.id.session_id)
        .await
        .unwrap();
    assert!(
        history
            .iter()
            .any(|e| matches!(e.event, Event::ModelCallFailed { .. })),
        "the report was recorded once it got through"
    );
}

/// A server from before eager dispatch refuses a report's `next` (400): the report goes
/// again without it, is recorded once, and later reports do not ask again.
#[tokio::test]
async fn a_server_that_refuses_next_gets_the_report_alone() {
    let (server, _served, source) = served_with(Faults {
        refuse_next: true,
        ..Faults::default()
    })
    .await;
    let next = cairn_runtime::LeaseRequest {
        filter: Arc::new(TaskFilter::default()),
        max: 1,
        lease_ms: 60_000,
        holder: cairn_runtime::LeaseHolder::InProcess,
    };
    let lease = leased_model_task(&server, &source).await;
    let tasks = source
        .report_and_lease(&lease, completion(), &next)
        .await
        .unwrap();
    assert!(tasks.is_empty(), "{tasks:?}");
    assert_eq!(
        server.reports.load(Ordering::Relaxed),
        2,
        "refused with `next`, then taken without it"
    );
    assert_eq!(
        failed_model_calls(&server, &lease.id.session_id).await,
        1,
        "the report was recorded once"
    );
    let lease = leased_model_task(&server, &source).await;
    source
        .report_and_lease(&lease, completion(), &next)
        .await
        .unwrap();
    assert_eq!(
        server.reports.load(Ordering::Relaxed),
        3,
        "the next report goes without `next` at once"
    );
}

#[tokio::test]
async fn a_report_survives_a_server_restart() {
    let server = FakeServer::new(None, Faults::default());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cairn.sock");
    let served = serve_unix_at(&path, server.router()).unwrap();
    let source = Arc::new(HttpTaskSource::new(&served.url, None).unwrap());
    let lease = leased_model_task(&server, &source).await;
    // The server goes away; in its place, a socket that hangs up on every connection.
    drop(served);
    std::fs::remove_file(&path).unwrap();
    let hang_up = tokio::net::UnixListener::bind(&path).unwrap();
    let reporting = tokio::spawn({
        let source = source.clone();
        let lease = lease.clone();
        async move { source.report(&lease, completion()).await }
    });
    // Once a try has failed on the dead socket, the server comes back.
    let refused = Arc::new(AtomicUsize::new(0));
    guarded("a failed try", async {
        let (connection, _) = hang_up.accept().await.unwrap();
        drop(connection);
        refused.fetch_add(1, Ordering::Relaxed);
    })
    .await;
    drop(hang_up);
    std::fs::remove_file(&path).unwrap();
    let _back = serve_unix_at(&path, server.router()).unwrap();
    guarded("the report", reporting).await.unwrap().unwrap();
    assert_eq!(refused.load(Ordering::Relaxed), 1);
    assert_eq!(
        server.reports.load(Ordering::Relaxed),
        1,
        "the restarted server got it"
    );
}

/// Published deltas go in batches of at most 256, in order, and the report takes the ones not
/// sent yet with it: every delta reaches the server, in order, before the report's outcome.
#[tokio::test]
async fn deltas_are_batched_in_order_and_the_rest_go_with_the_report() {
    let server = FakeServer::new(None, Faults::default());
    let served = serve_tcp(server.router()).await.unwrap();
    let source = HttpTaskSource::new(&served.url, None).unwrap();
    let mut deltas = server.engine.subscribe_deltas();
    let origin = ActivityRef {
        session_id: "s1".to_owned(),
        turn: 1,
        activity: "model:0".to_owned(),
        attempt: 1,
    };
    for n in 0..1000 {
        source.publish_delta(DeltaEvent {
            origin: origin.clone(),
            delta: Delta::Text(format!("{n} ")),
        });
    }
    // A report for a lease the server does not know: refused, but only after the deltas.
    let err = source
        .report(&lease_of("s1", 3), failure())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::UnknownSession { .. }), "{err:?}");
    let mut received = Vec::new();
    while let Ok(delta) = deltas.try_recv() {
        received.push(delta);
    }
    let expected: Vec<DeltaEvent> = (0..1000)
        .map(|n| DeltaEvent {
            origin: origin.clone(),
            delta: Delta::Text(format!("{n} ")),
        })
        .collect();
    assert_eq!(received, expected);
    let batches = server.delta_batches.lock().unwrap().clone();
    let reported = server.reported_deltas.lock().unwrap().clone();
    assert!(
        batches.iter().all(|&b| (1..=256).contains(&b)),
        "{batches:?}"
    );
    // All were queued before the report: it waits for the batches ahead of its own.
    assert!(batches.len() >= 3, "{batches:?}");
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!((1..=256).contains(&reported[0]), "{reported:?}");
    assert_eq!(batches.iter().sum::<usize>() + reported[0], 1000);

    // With nothing published since, a report carries none and nothing is sent beside it.
    let _ = source.report(&lease_of("s1", 4), failure()).await;
    assert_eq!(*server.delta_batches.lock().unwrap(), batches);
    assert_eq!(server.reported_deltas.lock().unwrap()[1..], [0]);
}

/// A report the server refuses as too large (413) while it carries deltas goes again without
/// them, and is recorded once: the deltas, presentation only, are dropped rather than the
/// result.
#[tokio::test]
async fn a_report_too_large_with_its_deltas_goes_again_without_them() {
    let (server, _served, source) = served_with(Faults {
        too_large_with_deltas: true,
        ..Faults::default()
    })
    .await;
    let lease = leased_model_task(&server, &source).await;
    let origin = ActivityRef {
        session_id: lease.id.session_id.clone(),
        turn: 1,
        activity: "model:3".to_owned(),
        attempt: 1,
    };
    for text in ["first ", "answer"] {
        source.publish_delta(DeltaEvent {
            origin: origin.clone(),
            delta: Delta::Text(text.to_owned()),
        });
    }
    source.report(&lease, completion()).await.unwrap();
    assert_eq!(
        server.reports.load(Ordering::Relaxed),
        2,
        "refused with the deltas, then taken without them"
    );
    assert_eq!(*server.reported_deltas.lock().unwrap(), [0]);
    assert_eq!(
        failed_model_calls(&server, &lease.id.session_id).await,
        1,
        "the report was recorded once"
    );
}

/// A result the server refuses as too large (413), without deltas, would be refused again
/// however often the activity ran: the attempt is reported failed instead, once, as an
/// `invalid_request` that says why.
#[tokio::test]
async fn a_result_too_large_is_reported_as_the_attempts_failure() {
    let (server, _served, source) = served_with(Faults {
        too_large_results: true,
        ..Faults::default()
    })
    .await;
    let lease = leased_model_task(&server, &source).await;
    let answer = ActivityReport::ModelCompleted(cairn_ledger::ModelResponse {
        provider: "scripted".into(),
        model: "big".into(),
        parts: vec![cairn_ledger::Part::text("a long answer")],
        stop_reason_raw: "end_turn".into(),
        stop_reason: cairn_ledger::StopReason::EndTurn,
        usage: cairn_ledger::Usage::default(),
    });
    source.report(&lease, answer).await.unwrap();
    assert_eq!(server.reports.load(Ordering::Relaxed), 2);
    let history = Client::new(server.engine.clone())
        .history(&lease.id.session_id)
        .await
        .unwrap();
    let failures: Vec<&ActivityFailure> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelCallFailed { failure, .. } => Some(failure),
            _ => None,
        })
        .collect();
    assert_eq!(failures.len(), 1, "recorded once");
    assert_eq!(failures[0].class, ErrorClass::InvalidRequest);
    assert!(
        failures[0]
            .message
            .starts_with("the result was not recorded: the server refused it as too large"),
        "{}",
        failures[0].message
    );
}

/// A server from before reports carried deltas refuses one that does (400): the deltas go by
/// themselves, then the report alone, recorded once; later reports send their deltas ahead of
/// them as before, without asking again.
#[tokio::test]
async fn a_server_that_refuses_deltas_in_a_report_gets_them_by_themselves_first() {
    let (server, _served, source) = served_with(Faults {
        refuse_deltas: true,
        ..Faults::default()
    })
    .await;
    let mut deltas = server.engine.subscribe_deltas();
    let lease = leased_model_task(&server, &source).await;
    let origin = ActivityRef {
        session_id: lease.id.session_id.clone(),
        turn: 1,
        activity: "model:3".to_owned(),
        attempt: 1,
    };
    let publish = |text: &str| {
        source.publish_delta(DeltaEvent {
            origin: origin.clone(),
            delta: Delta::Text(text.to_owned()),
        })
    };
    publish("first ");
    publish("answer");
    source.report(&lease, completion()).await.unwrap();
    assert_eq!(
        server.reports.load(Ordering::Relaxed),
        2,
        "refused with the deltas, then taken without them"
    );
    assert_eq!(*server.delta_batches.lock().unwrap(), [2]);
    assert_eq!(*server.reported_deltas.lock().unwrap(), [0]);
    assert_eq!(
        failed_model_calls(&server, &lease.id.session_id).await,
        1,
        "the report was recorded once"
    );

    let lease = leased_model_task(&server, &source).await;
    publish("second");
    source.report(&lease, completion()).await.unwrap();
    assert_eq!(
        server.reports.load(Ordering::Relaxed),
        3,
        "the next report goes without deltas at once"
    );
    assert_eq!(*server.delta_batches.lock().unwrap(), [2, 1]);
    let mut received = Vec::new();
    while let Ok(delta) = deltas.try_recv() {
        received.push(delta.delta);
    }
    assert_eq!(
        received,
        ["first ", "answer", "second"].map(|t| Delta::Text(t.to_owned()))
    );
}

/// A report whose answer is lost after the server took it goes again without its deltas:
/// the session's followers see each delta once, and the report is recorded once.
/// (Before, the second try passed them on again: the test fails with every try carrying
/// them.)
#[tokio::test]
async fn a_report_sent_again_after_a_lost_answer_passes_no_delta_on_twice() {
    let (server, _served, source) = served_with(Faults {
        lose_report_answers: 1.into(),
        ..Faults::default()
    })
    .await;
    let mut deltas = server.engine.subscribe_deltas();
    let lease = leased_model_task(&server, &source).await;
    for text in ["first ", "answer"] {
        source.publish_delta(DeltaEvent {
            origin: ActivityRef {
                session_id: lease.id.session_id.clone(),
                turn: 1,
                activity: "model:0".to_owned(),
                attempt: 1,
            },
            delta: Delta::Text(text.to_owned()),
        });
    }
    // The second try finds the report recorded by the first: stale, which a pool drops.
    let err = source.report(&lease, completion()).await.unwrap_err();
    assert!(matches!(err, Error::StaleReport { .. }), "{err:?}");
    assert_eq!(
        server.reports.load(Ordering::Relaxed),
        2,
        "taken with its answer lost, then sent again"
    );
    assert_eq!(
        *server.reported_deltas.lock().unwrap(),
        [2, 0],
        "only the first try carried the deltas"
    );
    let mut received = Vec::new();
    while let Ok(delta) = deltas.try_recv() {
        received.push(delta.delta);
    }
    assert_eq!(
        received,
        ["first ", "answer"].map(|t| Delta::Text(t.to_owned()))
    );
    assert_eq!(
        failed_model_calls(&server, &lease.id.session_id).await,
        1,
        "the report was recorded once"
    );
}

/// A report carries its own session's unsent deltas only: another session's go by the
/// deltas route, in order with the ones that session publishes later. (Before, the report
/// took every unsent delta, so another session's could reach its followers after its later
/// ones, or be lost with a report that got nowhere.)
#[tokio::test]
async fn a_report_carries_its_own_sessions_deltas_only() {
    let server = FakeServer::new(None, Faults::default());
    let served = serve_tcp(server.router()).await.unwrap();
    let source = HttpTaskSource::new(&served.url, None).unwrap();
    let mut deltas = server.engine.subscribe_deltas();
    let lease = leased_model_task(&server, &source).await;
    let delta = |session: &str, text: &str| DeltaEvent {
        origin: ActivityRef {
            session_id: session.to_owned(),
            turn: 1,
            activity: "model:0".to_owned(),
            attempt: 1,
        },
        delta: Delta::Text(text.to_owned()),
    };
    let own = lease.id.session_id.clone();
    source.publish_delta(delta(&own, "mine"));
    source.publish_delta(delta("other", "theirs 1"));
    let err = source.report(&lease, completion()).await;
    assert!(err.is_ok(), "{err:?}");
    source.publish_delta(delta("other", "theirs 2"));
    source.flush_deltas().await;
    assert_eq!(
        *server.reported_deltas.lock().unwrap(),
        [1],
        "the report carried its session's delta only"
    );
    let mut received = Vec::new();
    while let Ok(delta) = deltas.try_recv() {
        received.push((delta.origin.session_id, delta.delta));
    }
    let others: Vec<_> = received
        .iter()
        .filter(|(session, _)| session == "other")
        .map(|(_, delta)| delta.clone())
        .collect();
    assert_eq!(
        others,
        ["theirs 1", "theirs 2"].map(|t| Delta::Text(t.to_owned()))
    );
    assert!(received.contains(&(own, Delta::Text("mine".to_owned()))));
}

/// A lease whose heartbeat finds it lost (its session cancelled) is forgotten: the attempt
/// ends without a report, and a long-lived worker must not keep one entry per such lease.
#[tokio::test]
async fn a_lease_found_lost_by_a_heartbeat_is_forgotten() {
    let server = FakeServer::new(None, Faults::default());
    let served = serve_tcp(server.router()).await.unwrap();
    let source = HttpTaskSource::new(&served.url, None).unwrap();
    let lease = leased_model_task(&server, &source).await;
    assert_eq!(source.leases_known(), 1);
    Client::new(server.engine.clone())
        .cancel(&lease.id.session_id, "done with it")
        .await
        .unwrap();
    let err = source.heartbeat(&lease, 30_000, None).await.unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
    assert_eq!(source.leases_known(), 0);
}

/// A heartbeat stuck on a connection that never answers is given up while its lease still
/// has time, and tried again on a new one: the lease is renewed, not lost. (Before, each try
/// waited the whole request timeout, 60 s, past the lease's 4 s.)
#[tokio::test]
async fn a_heartbeat_that_gets_no_answer_is_tried_again_before_its_lease_lapses() {
    let (server, _served, source) = served_with(Faults {
        hang_heartbeats: 1.into(),
        ..Faults::default()
    })
    .await;
    let local = Client::new(server.engine.clone());
    let session = local
        .start_session(SessionOptions::new(demo_model(), Vec::new()))
        .await
        .unwrap();
    local.send(&session, "hello").await.unwrap();
    let tasks = source
        .lease(&TaskFilter::default(), 1, 4_000, Duration::from_secs(5))
        .await
        .unwrap();
    let lease = tasks[0].lease.clone();
    let renewed = tokio::time::timeout(
        Duration::from_secs(4),
        source.heartbeat(&lease, 4_000, None),
    )
    .await
    .expect("the stuck try is given up within the lease")
    .expect("the second try renews the lease");
    assert!(
        renewed > lease.expires_at_ms,
        "renewed to {renewed}, leased until {}",
        lease.expires_at_ms
    );
    assert_eq!(server.faults.hang_heartbeats.load(Ordering::Relaxed), 0);
}

/// The requests to the session routes `server` has seen since `from`, without their session
/// ids.
fn session_requests(server: &FakeServer, from: usize) -> Vec<String> {
    server.seen()[from..]
        .iter()
        .filter(|seen| seen.uri.starts_with("/v1/sessions"))
        .map(|seen| without_session_id(&seen.uri))
        .collect()
}

/// A session route's URI with its session id as `ID`.
fn without_session_id(uri: &str) -> String {
    match uri.strip_prefix("/v1/sessions/") {
        Some(rest) => format!(
            "/v1/sessions/ID{}",
            rest.find('/').map_or("", |at| &rest[at..])
        ),
        None => uri.to_owned(),
    }
}

/// The events of `session` as the server stored them.
async fn stored_kinds(server: &FakeServer, session: &str) -> Vec<String> {
    Client::new(server.engine.clone())
        .history(session)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect()
}

/// A session and its first message go in one request, and the server records them in one
/// append: the session's first two events, turn 1 named in the answer.
#[tokio::test]
async fn a_session_and_its_first_message_go_in_one_request() {
    let server = FakeServer::new(None, Faults::default());
    let served = serve_tcp(server.router()).await.unwrap();
    let client = connect(&served.url, None).unwrap();
    let mut options = SessionOptions::new(demo_model(), Vec::new());
    options.session_id = Some("together".to_owned());
    let (session, turn) = client
        .start_session_and_send(options, "hello")
        .await
        .unwrap();
    assert_eq!((session.as_str(), turn), ("together", 1));
    assert_eq!(session_requests(&server, 0), ["/v1/sessions"]);
    let history = Client::new(server.engine.clone())
        .history("together")
        .await
        .unwrap();
    let kinds: Vec<_> = history.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds[..2], ["session_started", "user_message"]);
    assert!(
        matches!(&history[1].event, Event::UserMessage { turn: 1, text, .. } if text == "hello"),
        "{:?}",
        history[1].event
    );
}

/// A server from before a session's first message could come with it refuses the field
/// (400) and records nothing: the client then creates the session and sends the message by
/// themselves, and from then on does so without asking again.
#[tokio::test]
async fn a_server_that_refuses_a_first_message_gets_the_session_then_the_message() {
    let server = FakeServer::new(
        None,
        Faults {
            refuse_first_message: true,
            ..Faults::default()
        },
    );
    let served = serve_tcp(server.router()).await.unwrap();
    let client = connect(&served.url, None).unwrap();
    for (n, asked) in [(1, true), (2, false)] {
        let mut options = SessionOptions::new(demo_model(), Vec::new());
        let id = format!("apart-{n}");
        options.session_id = Some(id.clone());
        let from = server.seen().len();
        let (session, turn) = client
            .start_session_and_send(options, "hello")
            .await
            .unwrap();
        assert_eq!((session.as_str(), turn), (id.as_str(), 1));
        let mut expected = vec!["/v1/sessions", "/v1/sessions/ID/messages"];
        if asked {
            expected.insert(0, "/v1/sessions");
        }
        assert_eq!(session_requests(&server, from), expected, "session {n}");
        assert_eq!(
            stored_kinds(&server, &id).await[..2],
            ["session_started", "user_message"]
        );
    }
}

/// A client over the test server at `url`, waiting its first slice of `first_wait` as the
/// default client waits its stall warning's.
fn remote_client(url: &str, first_wait: Duration) -> Client {
    connect(url, None).unwrap().with_stall_warning(first_wait)
}

/// The test server with `faults` on TCP, and a remote worker pool over it whose tools work
/// in a directory with the demo's `notes.txt`.
async fn served_with_a_pool(
    faults: Faults,
) -> (Arc<FakeServer>, Served, WorkerPool, tempfile::TempDir) {
    let server = FakeServer::new(None, faults);
    let served = serve_tcp(server.router()).await.unwrap();
    let workdir = tempfile::tempdir().unwrap();
    std::fs::write(workdir.path().join("notes.txt"), "Tuesday.\n").unwrap();
    let (pool, _) = remote_pool(&served.url, None, workdir.path());
    (server, served, pool, workdir)
}

/// The outcome the engine recorded for `session`'s last turn.
async fn recorded_outcome(server: &FakeServer, session: &str) -> Option<TurnOutcome> {
    Client::new(server.engine.clone())
        .describe(session)
        .await
        .unwrap()
        .last_outcome
}

/// Runs one turn of a new session `id` through a test server with `faults` and a remote pool,
/// with the remote client's start-and-run; checks it completed as recorded and gives back the
/// server (to inspect its requests) and the pool (to shut down).
async fn one_turn_through(faults: Faults, id: &str) -> (Arc<FakeServer>, WorkerPool) {
    let (server, served, pool, workdir) = served_with_a_pool(faults).await;
    let client = remote_client(&served.url, Duration::from_secs(30));
    let mut options =
        SessionOptions::new(demo_model(), ToolRegistry::builtin(workdir.path()).specs());
    options.session_id = Some(id.to_owned());
    let (session, outcome) = guarded(
        "a turn through the test server",
        client.start_session_and_run(options, "What is (17 + 25) * 3?"),
    )
    .await
    .unwrap();
    assert!(
        matches!(&outcome, TurnOutcome::Completed { turn: 1, .. }),
        "{outcome:?}"
    );
    assert_eq!(recorded_outcome(&server, &session).await, Some(outcome));
    (server, pool)
}

/// A session, its first message and the wait for that turn go in one request, and so do a
/// later message and the wait for its turn: no long poll follows, and the outcome is the one
/// the server recorded.
#[tokio::test]
async fn a_turn_is_started_and_waited_for_in_one_request() {
    let (server, served, pool, workdir) = served_with_a_pool(Faults::default()).await;
    let client = remote_client(&served.url, Duration::from_secs(30));
    let tools = ToolRegistry::builtin(workdir.path()).specs();

    let mut options = SessionOptions::new(demo_model(), tools.clone());
    options.session_id = Some("one-request".to_owned());
    let (session, outcome) = guarded(
        "a turn through the test server",
        client.start_session_and_run(options, "What is (17 + 25) * 3?"),
    )
    .await
    .unwrap();
    assert_eq!(session, "one-request");
    assert!(
        matches!(&outcome, TurnOutcome::Completed { turn: 1, answer, .. } if answer.contains("126")),
        "{outcome:?}"
    );
    assert_eq!(recorded_outcome(&server, &session).await, Some(outcome));
    assert_eq!(session_requests(&server, 0), ["/v1/sessions?wait_ms=30000"]);

    let mut options = SessionOptions::new(demo_model(), tools);
    options.session_id = Some("then-a-message".to_owned());
    let session = client.start_session(options).await.unwrap();
    let from = server.seen().len();
    let outcome = guarded(
        "a turn through the test server",
        client.run_turn(&session, "What is (17 + 25) * 3?"),
    )
    .await
    .unwrap();
    assert!(
        matches!(&outcome, TurnOutcome::Completed { turn: 1, .. }),
        "{outcome:?}"
    );
    assert_eq!(recorded_outcome(&server, &session).await, Some(outcome));
    assert_eq!(
        session_requests(&server, from),
        ["/v1/sessions/ID/messages?wait_ms=30000"]
    );
    pool.shutdown().await;
}

/// A server from before `wait_ms` ignores it and answers at once without the outcome: the
/// client then long-polls for it, as it did before.
#[tokio::test]
async fn a_server_that_ignores_wait_ms_is_long_polled_for_the_outcome() {
    let (server, pool) = one_turn_through(
        Faults {
            ignore_wait: true,
            ..Faults::default()
        },
        "old-server",
    )
    .await;
    let requests = session_requests(&server, 0);
    assert_eq!(requests[0], "/v1/sessions?wait_ms=30000");
    assert!(
        requests.len() >= 2
            && requests[1..]
                .iter()
                .all(|r| r.starts_with("/v1/sessions/ID/turns/1?timeout_ms=")),
        "{requests:?}"
    );
    pool.shutdown().await;
}

/// A wait for a turn that fails on the way (503: the server restarting, its store briefly
/// unavailable) is asked again: the turn goes on, and its outcome still reaches the client.
/// (Before, the first failed poll ended `run_turn` with the error.)
#[tokio::test]
async fn a_turn_wait_that_fails_on_the_way_is_asked_again() {
    let (server, pool) = one_turn_through(
        Faults {
            ignore_wait: true,
            fail_turn_waits: 2.into(),
            ..Faults::default()
        },
        "flaky-waits",
    )
    .await;
    assert_eq!(server.faults.fail_turn_waits.load(Ordering::Relaxed), 0);
    let polls = session_requests(&server, 0)
        .iter()
        .filter(|r| r.starts_with("/v1/sessions/ID/turns/1?timeout_ms="))
        .count();
    assert!(polls >= 3, "two failed polls, then one answered: {polls}");
    pool.shutdown().await;
}

/// A turn that outlasts the wait of the request that started it is waited for with long
/// polls, and the client's deadline counts from the start, not from the first answer.
#[tokio::test]
async fn a_turn_longer_than_the_first_wait_meets_the_deadline_counted_from_its_start() {
    let server = FakeServer::new(None, Faults::default());
    let served = serve_tcp(server.router()).await.unwrap();
    // No worker: the turn never ends.
    let client = remote_client(&served.url, Duration::from_millis(100))
        .with_turn_deadline(Duration::from_millis(400));
    let mut options = SessionOptions::new(demo_model(), Vec::new());
    options.session_id = Some("no-worker".to_owned());
    match guarded(
        "the client's deadline",
        client.start_session_and_run(options, "hello"),
    )
    .await
    {
        Err(Error::TurnDeadline {
            session_id,
            turn,
            deadline_ms,
            ..
        }) => assert_eq!(
            (session_id.as_str(), turn, deadline_ms),
            ("no-worker", 1, 400)
        ),
        other => panic!("expected a turn deadline, got {other:?}"),
    }
    let requests = session_requests(&server, 0);
    assert_eq!(requests[0], "/v1/sessions?wait_ms=100", "{requests:?}");
    // Long polls for the rest of the deadline (300 ms), and a description naming the
    // pending task; never more than the deadline in all.
    let polled: u128 = requests[1..]
        .iter()
        .filter_map(|r| r.strip_prefix("/v1/sessions/ID/turns/1?timeout_ms="))
        .map(|ms| ms.parse::<u128>().unwrap())
        .sum();
    assert!((1..=300).contains(&polled), "{requests:?}");
    assert_eq!(
        Client::new(server.engine.clone())
            .describe("no-worker")
            .await
            .unwrap()
            .running_turn,
        Some(1),
        "the turn goes on"
    );
}

#[tokio::test]
async fn health_and_the_transport_address() {
    let server = FakeServer::new(None, Faults::default());
    let served: Served = serve_unix(server.router()).await.unwrap();
    let transport = HttpTransport::new(&served.url, None).unwrap();
    assert_eq!(transport.url(), served.url);
    assert_eq!(transport.health().await.unwrap().status, "ok");
}

#[tokio::test]
async fn a_follower_passes_on_waiting_deltas_before_a_later_event() {
    // What the server's event stream relies on for an answer's text to precede its end.
    let server = FakeServer::new(None, Faults::default());
    let local = Client::new(server.engine.clone());
    let session = local
        .start_session(SessionOptions::new(demo_model(), Vec::new()))
        .await
        .unwrap();
    let mut follower = cairn_runtime::client::follow(server.engine.clone(), session.clone(), 1);
    // Deltas of a call other than the one the later event schedules: a call's deltas come
    // after its scheduling event, which a follower sends first.
    let deltas: Vec<DeltaEvent> = (0..8)
        .map(|n| DeltaEvent {
            origin: ActivityRef {
                session_id: session.clone(),
                turn: 1,
                activity: "model:7".to_owned(),
                attempt: 1,
            },
            delta: Delta::Text(format!("{n}")),
        })
        .collect();
    for delta in &deltas {
        server.engine.publish_delta(delta.clone());
    }
    // Appended after the deltas were published, before the follower looks.
    local.send(&session, "hello").await.unwrap();
    let mut backlog = std::collections::VecDeque::new();
    while backlog.len() < deltas.len() {
        follower.next(&mut backlog).await.unwrap().unwrap();
    }
    let first: Vec<StreamEvent> = backlog.drain(..deltas.len()).collect();
    let expected: Vec<StreamEvent> = deltas.into_iter().map(StreamEvent::Delta).collect();
    assert_eq!(first, expected);
}

/// A lease request whose answer is lost goes again under the same key, so that a server
/// that leased under it answers with those tasks; one asking for fewer tasks than the lost
/// one did goes under a key of its own (the answer could hold more than the pool takes), and
/// so does each request after an answer.
#[tokio::test]
async fn a_lease_request_whose_answer_is_lost_is_sent_again_under_its_key() {
    let (server, _served, source) = served_with(Faults {
        lose_lease_answers: AtomicU32::new(1),
        ..Faults::default()
    })
    .await;
    let filter = TaskFilter::default();
    let lease = |max: usize| source.lease(&filter, max, 1_000, Duration::ZERO);
    let lost = lease(2).await;
    assert!(
        matches!(lost, Err(Error::Remote { status: 503, .. })),
        "{lost:?}"
    );
    lease(2).await.expect("answered");
    lease(2).await.expect("answered");
    server.faults.lose_lease_answers.store(1, Ordering::Relaxed);
    assert!(lease(2).await.is_err());
    lease(1).await.expect("answered");
    let keys: Vec<String> = server
        .seen()
        .iter()
        .filter(|seen| seen.uri == "/v1/worker/lease")
        .map(|seen| {
            seen.idempotency_key
                .clone()
                .expect("every lease request has a key")
        })
        .collect();
    assert_eq!(keys.len(), 5, "{keys:?}");
    assert!(keys.iter().all(|key| key.len() == 32), "{keys:?}");
    assert_eq!(keys[0], keys[1], "sent again under its key");
    assert_ne!(keys[1], keys[2], "a new request after an answer");
    assert_ne!(keys[2], keys[3]);
    assert_ne!(
        keys[3], keys[4],
        "fewer tasks than the lost request asked for"
    );
}

/// The keys and paths of the requests that started turns, from the `from`th request on.
fn keyed_requests(server: &FakeServer, from: usize) -> Vec<(String, Option<String>)> {
    server.seen()[from..]
        .iter()
        .filter(|seen| seen.uri.starts_with("/v1/sessions") && !seen.uri.contains("/turns/"))
        .map(|seen| (without_session_id(&seen.uri), seen.idempotency_key.clone()))
        .collect()
}

/// A request that starts a turn whose answer is lost (a 503 after the server carried it
/// out) is sent again under the same idempotency key: the turn starts once, and the client
/// gets its outcome. Each request gets a key of its own.
#[tokio::test]
async fn a_request_whose_answer_is_lost_is_sent_again_under_its_key_and_starts_one_turn() {
    let (server, served, pool, workdir) = served_with_a_pool(Faults {
        lose_answers: std::sync::atomic::AtomicU32::new(1),
        ..Faults::default()
    })
    .await;
    let client = remote_client(&served.url, Duration::from_secs(30));
    // No id: the client names the session, so that the resend finds it.
    let options = SessionOptions::new(demo_model(), ToolRegistry::builtin(workdir.path()).specs());
    let (session, outcome) = guarded(
        "a turn through the test server",
        client.start_session_and_run(options, "What is (17 + 25) * 3?"),
    )
    .await
    .unwrap();
    assert!(session.starts_with('s'), "{session}");
    assert!(
        matches!(&outcome, TurnOutcome::Completed { turn: 1, .. }),
        "{outcome:?}"
    );
    let sent = keyed_requests(&server, 0);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent
        .iter()
        .all(|(path, _)| path == "/v1/sessions?wait_ms=30000"));
    let first_key = sent[0].1.clone().expect("a key");
    assert_eq!(first_key.len(), 32, "{first_key}");
    assert_eq!(
        sent[1].1.as_deref(),
        Some(first_key.as_str()),
        "the same key"
    );

    server.faults.lose_answers.store(1, Ordering::Relaxed);
    let from = server.seen().len();
    let outcome = guarded(
        "a turn through the test server",
        client.run_turn(&session, "And what is 2 + 2?"),
    )
    .await
    .unwrap();
    // The demo's script has answers for one turn: the second fails, and that is its outcome.
    assert!(
        matches!(&outcome, TurnOutcome::Failed { turn: 2, reason, .. } if reason.contains("exhausted")),
        "{outcome:?}"
    );
    let sent = keyed_requests(&server, from);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(sent[0].1, sent[1].1, "the same key");
    assert_ne!(sent[0].1.as_deref(), Some(first_key.as_str()), "a new key");
    // One message per turn in the history.
    let history = server
        .engine
        .store()
        .read_history(&session, 1, None)
        .await
        .unwrap();
    let messages: Vec<u32> = history
        .iter()
        .filter_map(|envelope| match &envelope.event {
            cairn_runtime::Event::UserMessage { turn, .. } => Some(*turn),
            _ => None,
        })
        .collect();
    assert_eq!(messages, [1, 2]);

    // A key of the caller's: sent twice, one turn; another message under it, refused.
    let mine = || cairn_runtime::wire::SendMessage {
        text: "And 3 + 3?".into(),
        model: None,
        media: Vec::new(),
        tool_choice: None,
    };
    let turn = client
        .send_idempotent(&session, "mine", mine())
        .await
        .unwrap();
    assert_eq!(turn, 3);
    client.wait_turn(&session, turn).await.unwrap();
    assert_eq!(
        client
            .send_idempotent(&session, "mine", mine())
            .await
            .unwrap(),
        3
    );
    let mut other = mine();
    other.text = "And 4 + 4?".into();
    // The same typed error as in process: the server's 422 `idempotency_key_reused`.
    match client.send_idempotent(&session, "mine", other).await {
        Err(Error::IdempotencyKeyReused {
            session_id,
            key,
            turn,
        }) => assert_eq!(
            (session_id, key.as_str(), turn),
            (session.clone(), "mine", 3)
        ),
        other => panic!("expected the key refused as reused, got {other:?}"),
    }
    let last = server.seen().last().unwrap().idempotency_key.clone();
    assert_eq!(last.as_deref(), Some("mine"));
    pool.shutdown().await;
}

/// With a resend window of zero, a request that starts a turn is sent once: a lost answer
/// is the caller's error (the 503 as the server gave it), and the message was recorded.
#[tokio::test]
async fn a_resend_window_of_zero_sends_a_request_once() {
    let server = FakeServer::new(None, Faults::default());
    let served = serve_tcp(server.router()).await.unwrap();
    let transport = HttpTransport::new(&served.url, None)
        .unwrap()
        .with_resend_window(Duration::ZERO);
    let client = Client::with_transport(Arc::new(transport));
    let mut options = SessionOptions::new(demo_model(), Vec::new());
    options.session_id = Some("once".into());
    let session = client.start_session(options).await.unwrap();
    server.faults.lose_answers.store(1, Ordering::Relaxed);
    match client.send(&session, "hello").await {
        Err(Error::Remote { status, .. }) => assert_eq!(status, 503),
        other => panic!("expected the lost answer's 503, got {other:?}"),
    }
    let sent = keyed_requests(&server, 0);
    assert_eq!(sent.len(), 2, "the create and one message: {sent:?}");
    let described = Client::new(server.engine.clone())
        .describe(&session)
        .await
        .unwrap();
    assert_eq!(described.turns, 1, "the message landed");
}
