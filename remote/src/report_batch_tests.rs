//! Batched reports against a router that records what reached it: reports finishing while two
//! are on their way go in one batch and each gets its own answer; a server without the batch
//! route gets every report alone, and is not sent a batch again; a batch whose answer is lost
//! sends each report again by itself, as a try sent again (without its deltas).

use crate::fake_server::{serve_tcp, Served};
use crate::HttpTaskSource;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use cairn_ledger::Delta;
use cairn_runtime::wire::{
    ErrorBody, ErrorCode, ErrorDetail, ReportAnswer, ReportBatch, ReportBatchAnswer, ReportRequest,
};
use cairn_runtime::{
    ActivityFailure, ActivityRef, ActivityReport, DeltaEvent, Error, ErrorClass, Lease,
    LeaseHolder, LeaseRequest, TaskFilter, TaskId, TaskKind,
};
use cairn_workers::TaskSource;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long the single route takes to answer: long enough for the reports started after the
/// first two to be queued behind them (they queue within microseconds).
const SINGLE_DELAY: Duration = Duration::from_millis(300);
/// A guard against a hang, not a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq)]
enum BatchRoute {
    Served,
    /// A server from before the route: 404.
    Missing,
    /// Takes the batch and loses its answer: 503.
    Fails,
}

#[derive(Default)]
struct Seen {
    /// Reports that came alone: their session, and whether they carried deltas.
    alone: Vec<(String, bool)>,
    /// Each batch that came (also refused ones): its reports' sessions, and whether each
    /// carried deltas.
    batches: Vec<Vec<(String, bool)>>,
    /// Each batch's reports that asked for tasks with them (`next`), by their place in it.
    asked_for_tasks: Vec<Vec<usize>>,
}

struct Recorder {
    route: BatchRoute,
    seen: Mutex<Seen>,
}

/// Its answer to a report: `stale_report` for a session named so, else 204.
fn answer_to(report: &ReportRequest) -> (StatusCode, Option<ErrorBody>) {
    if report.lease.id.session_id.starts_with("stale") {
        let body = ErrorBody {
            error: ErrorDetail {
                code: ErrorCode::StaleReport,
                message: "recorded before".to_owned(),
            },
        };
        (StatusCode::CONFLICT, Some(body))
    } else {
        (StatusCode::NO_CONTENT, None)
    }
}

async fn report(
    State(recorder): State<Arc<Recorder>>,
    Json(body): Json<ReportRequest>,
) -> Response {
    recorder
        .seen
        .lock()
        .unwrap()
        .alone
        .push((body.lease.id.session_id.clone(), !body.deltas.is_empty()));
    tokio::time::sleep(SINGLE_DELAY).await;
    match answer_to(&body) {
        (status, Some(error)) => (status, Json(error)).into_response(),
        (status, None) => status.into_response(),
    }
}

async fn reports(
    State(recorder): State<Arc<Recorder>>,
    Json(batch): Json<ReportBatch>,
) -> Response {
    {
        let mut seen = recorder.seen.lock().unwrap();
        seen.batches.push(
            batch
                .reports
                .iter()
                .map(|r| (r.lease.id.session_id.clone(), !r.deltas.is_empty()))
                .collect(),
        );
        seen.asked_for_tasks.push(
            (0..batch.reports.len())
                .filter(|&i| batch.reports[i].next.is_some())
                .collect(),
        );
    }
    match recorder.route {
        BatchRoute::Missing => return StatusCode::NOT_FOUND.into_response(),
        BatchRoute::Fails => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
        BatchRoute::Served => {}
    }
    let answers = batch
        .reports
        .iter()
        .map(|report| {
            let (status, error) = answer_to(report);
            ReportAnswer {
                status: status.as_u16(),
                body: error.map(|e| serde_json::value::to_raw_value(&e).unwrap()),
            }
        })
        .collect();
    Json(ReportBatchAnswer { answers }).into_response()
}

async fn recorded(route: BatchRoute) -> (Arc<Recorder>, Served, Arc<HttpTaskSource>) {
    let recorder = Arc::new(Recorder {
        route,
        seen: Mutex::default(),
    });
    let router = Router::new()
        .route("/v1/worker/report", post(report))
        .route("/v1/worker/reports", post(reports))
        .with_state(Arc::clone(&recorder));
    let served = serve_tcp(router).await.unwrap();
    let source = Arc::new(HttpTaskSource::new(&served.url, None).unwrap());
    (recorder, served, source)
}

fn lease_of(session: &str) -> Lease {
    Lease {
        id: TaskId {
            session_id: session.to_owned(),
            scheduled_seq: 3,
        },
        kind: TaskKind::Model,
        lease_attempt: 1,
        // Far ahead: retries are not cut short by the lease.
        expires_at_ms: u64::MAX / 2,
    }
}

fn failure() -> ActivityReport {
    ActivityReport::Failed(ActivityFailure::new(ErrorClass::Transient, "test"))
}

async fn guarded<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(HANG_GUARD, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what} did not happen within {HANG_GUARD:?}"),
    }
}

/// Reports `first` (two sessions) and waits until both reached the server by themselves, then
/// reports `then` while they are still on their way; returns each report's result, by
/// session.
async fn report_in_two_waves(
    recorder: &Recorder,
    source: &Arc<HttpTaskSource>,
    first: [&str; 2],
    then: &[&str],
) -> Vec<(String, cairn_runtime::Result<()>)> {
    let spawn = |session: &str| {
        let source = Arc::clone(source);
        let session = session.to_owned();
        tokio::spawn(async move {
            let result = source.report(&lease_of(&session), failure()).await;
            (session, result)
        })
    };
    let mut running: Vec<_> = first.iter().map(|s| spawn(s)).collect();
    guarded("the first two reports reaching the server", async {
        while recorder.seen.lock().unwrap().alone.len() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    running.extend(then.iter().map(|s| spawn(s)));
    let mut results = Vec::new();
    for report in running {
        results.push(guarded("a report's answer", report).await.unwrap());
    }
    results
}

#[tokio::test]
async fn reports_finishing_together_go_in_one_batch_and_each_gets_its_own_answer() {
    let (recorder, _served, source) = recorded(BatchRoute::Served).await;
    let results =
        report_in_two_waves(&recorder, &source, ["a", "b"], &["c", "stale-d", "e", "f"]).await;
    for (session, result) in &results {
        if session.starts_with("stale") {
            assert!(
                matches!(result, Err(Error::StaleReport { .. })),
                "{session}: {result:?}"
            );
        } else {
            assert!(result.is_ok(), "{session}: {result:?}");
        }
    }
    let seen = recorder.seen.lock().unwrap();
    let alone: Vec<&str> = seen.alone.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(alone, ["a", "b"], "only the first two went by themselves");
    assert_eq!(seen.batches.len(), 1, "the other four went in one batch");
    let mut batched: Vec<&str> = seen.batches[0].iter().map(|(s, _)| s.as_str()).collect();
    batched.sort();
    assert_eq!(batched, ["c", "e", "f", "stale-d"]);
}

#[tokio::test]
async fn a_server_without_the_batch_route_gets_each_report_alone_and_no_batch_again() {
    let (recorder, _served, source) = recorded(BatchRoute::Missing).await;
    let results = report_in_two_waves(&recorder, &source, ["a", "b"], &["c", "d", "e"]).await;
    assert!(results.iter().all(|(_, r)| r.is_ok()), "{results:?}");
    {
        let seen = recorder.seen.lock().unwrap();
        assert_eq!(seen.batches.len(), 1, "one batch was tried");
        let mut alone: Vec<&str> = seen.alone.iter().map(|(s, _)| s.as_str()).collect();
        alone.sort();
        assert_eq!(
            alone,
            ["a", "b", "c", "d", "e"],
            "each recorded by itself, once"
        );
    }
    // Later reports go by themselves from the start, however many are on their way.
    let results = report_in_two_waves(&recorder, &source, ["g", "h"], &["i", "j"]).await;
    assert!(results.iter().all(|(_, r)| r.is_ok()), "{results:?}");
    let seen = recorder.seen.lock().unwrap();
    assert_eq!(seen.batches.len(), 1, "no batch was tried again");
    assert_eq!(seen.alone.len(), 9);
}

#[tokio::test]
async fn a_batch_whose_answer_is_lost_sends_each_report_again_without_its_deltas() {
    let (recorder, _served, source) = recorded(BatchRoute::Fails).await;
    // The deltas of `c`, published just before its report, go with it: the report takes
    // them from the delta queue well before its batching interval sends them by themselves.
    let spawn = |session: &'static str| {
        let source = Arc::clone(&source);
        tokio::spawn(async move { source.report(&lease_of(session), failure()).await })
    };
    let first = [spawn("a"), spawn("b")];
    guarded("the first two reports reaching the server", async {
        while recorder.seen.lock().unwrap().alone.len() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    source.publish_delta(DeltaEvent {
        origin: ActivityRef {
            session_id: "c".to_owned(),
            turn: 1,
            activity: "model:3".to_owned(),
            attempt: 1,
        },
        delta: Delta::Text("the text of c".to_owned()),
    });
    let then = [spawn("c"), spawn("d")];
    for report in first.into_iter().chain(then) {
        let result = guarded("a report's answer", report).await.unwrap();
        assert!(result.is_ok(), "{result:?}");
    }
    let seen = recorder.seen.lock().unwrap();
    assert_eq!(seen.batches.len(), 1);
    let mut batched = seen.batches[0].clone();
    batched.sort();
    assert_eq!(
        batched,
        [("c".to_owned(), true), ("d".to_owned(), false)],
        "the batch carried c's deltas, as its first try"
    );
    let mut alone = seen.alone.clone();
    alone.sort();
    assert_eq!(
        alone,
        [
            ("a".to_owned(), false),
            ("b".to_owned(), false),
            ("c".to_owned(), false),
            ("d".to_owned(), false)
        ],
        "the batch may have passed c's deltas on, so its try sent again did not carry them"
    );
}

/// What a pool asks for with its reports: one task more.
fn one_more() -> LeaseRequest {
    LeaseRequest {
        filter: Arc::new(TaskFilter::default()),
        max: 1,
        lease_ms: 60_000,
        holder: LeaseHolder::Remote,
    }
}

/// Reports `sessions` as calls one slot ran in turn; returns each one's result, in order.
async fn report_together(
    source: &HttpTaskSource,
    sessions: &[&str],
) -> Vec<cairn_runtime::Result<Vec<cairn_runtime::LeasedTask>>> {
    let reports = sessions.iter().map(|s| (lease_of(s), failure())).collect();
    guarded(
        "the answers to reports sent together",
        source.report_all_and_lease(reports, &one_more()),
    )
    .await
}

#[tokio::test]
async fn reports_run_together_go_at_once_in_one_batch_the_first_asking_for_tasks() {
    let (recorder, _served, source) = recorded(BatchRoute::Served).await;
    let results = report_together(&source, &["a", "stale-a", "b"]).await;
    assert!(
        matches!(&results[0], Ok(tasks) if tasks.is_empty()),
        "{results:?}"
    );
    assert!(
        matches!(&results[1], Err(Error::StaleReport { .. })),
        "each gets its own answer: {results:?}"
    );
    assert!(
        matches!(&results[2], Ok(tasks) if tasks.is_empty()),
        "{results:?}"
    );
    let seen = recorder.seen.lock().unwrap();
    assert!(
        seen.alone.is_empty(),
        "none went by itself: {:?}",
        seen.alone
    );
    let batched: Vec<Vec<&str>> = seen
        .batches
        .iter()
        .map(|batch| batch.iter().map(|(s, _)| s.as_str()).collect())
        .collect();
    assert_eq!(batched, [["a", "stale-a", "b"]], "one batch, in order");
    assert_eq!(
        seen.asked_for_tasks,
        [[0]],
        "only the first asked for tasks"
    );
}

#[tokio::test]
async fn reports_run_together_wait_whole_behind_two_on_their_way() {
    let (recorder, _served, source) = recorded(BatchRoute::Served).await;
    let first: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|session| {
            let source = Arc::clone(&source);
            tokio::spawn(async move { source.report(&lease_of(session), failure()).await })
        })
        .collect();
    guarded("the first two reports reaching the server", async {
        while recorder.seen.lock().unwrap().alone.len() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let results = report_together(&source, &["c", "d"]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    for report in first {
        let result = guarded("a report's answer", report).await.unwrap();
        assert!(result.is_ok(), "{result:?}");
    }
    let seen = recorder.seen.lock().unwrap();
    let alone: Vec<&str> = seen.alone.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(alone.len(), 2, "only the first two went alone: {alone:?}");
    assert_eq!(seen.batches.len(), 1, "{:?}", seen.batches);
    let batched: Vec<&str> = seen.batches[0].iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(
        batched,
        ["c", "d"],
        "the two went together once one was answered"
    );
}

#[tokio::test]
async fn reports_run_together_go_alone_to_a_server_without_the_batch_route() {
    let (recorder, _served, source) = recorded(BatchRoute::Missing).await;
    let results = report_together(&source, &["a", "b"]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    {
        let seen = recorder.seen.lock().unwrap();
        assert_eq!(seen.batches.len(), 1, "one batch was tried");
        let mut alone: Vec<&str> = seen.alone.iter().map(|(s, _)| s.as_str()).collect();
        alone.sort();
        assert_eq!(alone, ["a", "b"], "each recorded by itself, once");
    }
    let results = report_together(&source, &["c", "d"]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let seen = recorder.seen.lock().unwrap();
    assert_eq!(seen.batches.len(), 1, "no batch was tried again");
    assert_eq!(seen.alone.len(), 4);
}
