//! Reports of one session recorded together: those that come while an append of the session
//! is in flight share the next append, a report holds its session a moment for the reports
//! of the parallel calls still running beside it, reports a worker sends together share one
//! append at once, and one the store refuses does not take the others down with it.

use crate::client::{Client, SessionOptions};
use crate::engine::{ActivityReport, LeasedTask};
use crate::engine_test_store::GatedStore;
use crate::engine_test_support::text_answer;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::store::{Lease, Store, TaskFilter, TaskId};
use crate::workflow::TurnOutcome;
use crate::{Engine, SystemClock};
use cairn_ledger::{
    JsonText, ModelResponse, ModelSpec, Part, StopReason, ToolResultContent, ToolSpec, ToolUse,
    Usage,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

const MODEL: &str = "batch";

/// A session "s" whose first turn's model call asked for `tools` parallel calculator calls,
/// each leased: the tool tasks, in the order of the calls.
async fn fanned_out(tools: usize) -> (Arc<GatedStore>, Engine, Client, Vec<LeasedTask>) {
    let store = Arc::new(GatedStore::default());
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    let schema = JsonText::parse(r#"{"type":"object"}"#).expect("schema");
    let tool = ToolSpec {
        name: "calculator".into(),
        description: "math".into(),
        input_schema: schema,
    };
    let mut options = SessionOptions::new(ModelSpec::new("scripted", MODEL), vec![tool]);
    options.session_id = Some("s".to_owned());
    client.start_session(options).await.expect("start");
    client.send("s", "add up").await.expect("send");
    let model = engine
        .lease_tasks(&TaskFilter::any(), 1, 60_000)
        .await
        .expect("lease the model call");
    let calls = (0..tools)
        .map(|i| {
            Part::ToolUse(ToolUse {
                id: format!("call-{i}"),
                name: "calculator".into(),
                arguments: r#"{"expression":"1+1"}"#.into(),
                signature: None,
            })
        })
        .collect();
    let asked = ActivityReport::ModelCompleted(ModelResponse {
        provider: "scripted".into(),
        model: MODEL.into(),
        parts: calls,
        stop_reason_raw: "tool_use".into(),
        stop_reason: StopReason::ToolUse,
        usage: Usage::default(),
    });
    engine
        .report(&model[0].lease, asked)
        .await
        .expect("record the tool calls");
    let mut leased = engine
        .lease_tasks(&TaskFilter::any(), tools, 60_000)
        .await
        .expect("lease the tools");
    leased.sort_by_key(|task| task.lease.id.scheduled_seq);
    assert_eq!(leased.len(), tools);
    // The log starts with the tools' reports.
    store.completions.lock().expect("log").clear();
    (store, engine, client, leased)
}

fn tool_result(text: &str) -> ActivityReport {
    ActivityReport::ToolCompleted {
        content: ToolResultContent::Text(text.into()),
        is_error: false,
    }
}

/// The task ids of the tool tasks at `of`.
fn task_ids(tools: &[LeasedTask], of: &[usize]) -> Vec<TaskId> {
    of.iter().map(|&i| tools[i].lease.id.clone()).collect()
}

/// Reports `report` for `lease` on a task of its own.
fn spawn_report(
    engine: &Engine,
    lease: &Lease,
    report: ActivityReport,
) -> tokio::task::JoinHandle<Result<()>> {
    let (engine, lease) = (engine.clone(), lease.clone());
    tokio::spawn(async move { engine.report(&lease, report).await })
}

/// Lets the spawned reports run until `count` of them wait for session "s".
async fn until_waiting(engine: &Engine, count: usize) {
    for _ in 0..10_000 {
        if engine.reports_waiting("s") == count {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!(
        "{count} reports never waited for the session ({} do)",
        engine.reports_waiting("s")
    );
}

/// Holds the next append of `store` and spawns `first`'s report, which makes it.
async fn first_held(
    store: &GatedStore,
    engine: &Engine,
    first: &Lease,
) -> tokio::task::JoinHandle<Result<()>> {
    store.hold_next.store(true, Ordering::SeqCst);
    let report = spawn_report(engine, first, tool_result("first"));
    store.entered.notified().await;
    report
}

/// The tool results the history of "s" records, in order.
async fn recorded_results(store: &GatedStore) -> Vec<String> {
    let history = store
        .inner
        .read_history("s", 1, None)
        .await
        .expect("history");
    history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallCompleted { tool_use_id, .. } => Some(tool_use_id.clone()),
            _ => None,
        })
        .collect()
}

/// The rest of the turn, and a full replay of the history matching what the engine answers.
async fn finish_and_replay(store: &GatedStore, engine: &Engine, client: &Client) {
    let model = engine
        .lease_tasks(&TaskFilter::any(), 1, 60_000)
        .await
        .expect("lease the second model call");
    assert_eq!(
        model.len(),
        1,
        "every result is in: the model is asked again"
    );
    answer_and_replay(store, engine, client, &model[0].lease).await;
}

/// Answers the turn's second model call, leased as `model`, and replays the history in full:
/// what it folds to is what the engine answers.
async fn answer_and_replay(store: &GatedStore, engine: &Engine, client: &Client, model: &Lease) {
    engine
        .report(model, text_answer(MODEL, "4"))
        .await
        .expect("answer");
    assert!(matches!(
        engine.wait_turn("s", 1).await.expect("outcome"),
        TurnOutcome::Completed { .. }
    ));
    let history = store
        .inner
        .read_history("s", 1, None)
        .await
        .expect("history");
    let replayed = crate::replay("s", &history).expect("the history replays");
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        client
            .transcript("s")
            .await
            .expect("transcript")
            .canonical_json()
    );
}

/// Three parallel tool calls finishing while the first one's append is in flight cost two
/// appends: the first alone, the other two together, each caller answered.
#[tokio::test]
async fn reports_that_come_while_an_append_is_in_flight_share_the_next_append() {
    let (store, engine, client, tools) = fanned_out(3).await;
    let first = first_held(&store, &engine, &tools[0].lease).await;
    let second = spawn_report(&engine, &tools[1].lease, tool_result("second"));
    let third = spawn_report(&engine, &tools[2].lease, tool_result("third"));
    until_waiting(&engine, 2).await;
    store.release.notify_one();
    for report in [first, second, third] {
        report
            .await
            .expect("joined")
            .expect("every report is recorded");
    }
    let ids = |of: &[usize]| task_ids(&tools, of);
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![(ids(&[0]), true), (ids(&[1, 2]), true)],
        "the two reports that waited were recorded in one append"
    );
    assert_eq!(
        recorded_results(&store).await,
        vec!["call-0", "call-1", "call-2"]
    );
    assert_eq!(engine.reports_waiting("s"), 0);
    finish_and_replay(&store, &engine, &client).await;
}

/// Parallel tool calls that finish together cost one append: the first report holds its
/// session for the others, still running, and records them all at once; each caller is
/// answered, and the history replays.
#[tokio::test]
async fn parallel_calls_that_finish_together_share_one_append() {
    let (store, engine, client, tools) = fanned_out(3).await;
    let reports: Vec<_> = tools
        .iter()
        .map(|tool| spawn_report(&engine, &tool.lease, tool_result("done")))
        .collect();
    for report in reports {
        report
            .await
            .expect("joined")
            .expect("every report is recorded");
    }
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![(task_ids(&tools, &[0, 1, 2]), true)],
        "the three results in one append"
    );
    assert_eq!(
        recorded_results(&store).await,
        vec!["call-0", "call-1", "call-2"]
    );
    finish_and_replay(&store, &engine, &client).await;
}

/// A report holds its session for a sibling still running only so long
/// ([`crate::engine_reports::SIBLING_HOLD`]): the first result is recorded alone while the
/// other call runs on, and the second in an append of its own when it comes.
#[tokio::test]
async fn a_report_holds_its_session_only_a_moment_for_a_sibling_still_running() {
    let (store, engine, client, tools) = fanned_out(2).await;
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        engine.report(&tools[0].lease, tool_result("first")),
    )
    .await
    .expect("the hold ends without the sibling's report")
    .expect("recorded");
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![(task_ids(&tools, &[0]), true)],
        "recorded alone, the other call still running"
    );
    engine
        .report(&tools[1].lease, tool_result("second"))
        .await
        .expect("recorded");
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![
            (task_ids(&tools, &[0]), true),
            (task_ids(&tools, &[1]), true)
        ]
    );
    finish_and_replay(&store, &engine, &client).await;
}

/// A report waits for no sibling that no worker of this engine holds (one still queued, or
/// leased through another server of a shared database): the first report is recorded alone
/// at once.
#[tokio::test(start_paused = true)]
#[allow(clippy::disallowed_methods)] // the paused clock says whether the report waited
async fn a_report_holds_its_session_for_no_sibling_that_is_not_running() {
    let (store, engine, client, tools) = fanned_out(2).await;
    // The second call runs elsewhere, as far as this engine knows.
    engine.forget_lease_held_here(&tools[1].lease);
    let started = tokio::time::Instant::now();
    engine
        .report(&tools[0].lease, tool_result("first"))
        .await
        .expect("recorded");
    assert_eq!(
        started.elapsed(),
        std::time::Duration::ZERO,
        "no hold: the paused clock never moved"
    );
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![(task_ids(&tools, &[0]), true)]
    );
    engine
        .report(&tools[1].lease, tool_result("second"))
        .await
        .expect("recorded");
    finish_and_replay(&store, &engine, &client).await;
}

/// A report the store refuses (a lease attempt that is not current) among waiting ones is
/// refused alone: the others are recorded each in its own append, then.
#[tokio::test]
async fn a_refused_report_among_waiting_ones_is_refused_alone() {
    let (store, engine, client, tools) = fanned_out(3).await;
    let first = first_held(&store, &engine, &tools[0].lease).await;
    let second = spawn_report(&engine, &tools[1].lease, tool_result("second"));
    let mut not_current = tools[2].lease.clone();
    not_current.lease_attempt += 1;
    let refused = spawn_report(&engine, &not_current, tool_result("not current"));
    until_waiting(&engine, 2).await;
    store.release.notify_one();
    first.await.expect("joined").expect("the first is recorded");
    second
        .await
        .expect("joined")
        .expect("the second is recorded");
    match refused.await.expect("joined") {
        Err(Error::LeaseLost { task, .. }) => assert_eq!(task, tools[2].lease.id.to_string()),
        other => panic!("a report of a lease attempt not current must be LeaseLost, got {other:?}"),
    }
    let ids = |of: &[usize]| task_ids(&tools, of);
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![
            (ids(&[0]), true),
            (ids(&[1, 2]), false),
            (ids(&[1]), true),
            (ids(&[2]), false)
        ],
        "refused together, then each alone"
    );
    assert_eq!(recorded_results(&store).await, vec!["call-0", "call-1"]);
    engine
        .report(&tools[2].lease, tool_result("third"))
        .await
        .expect("the current lease's report is recorded");
    assert_eq!(
        recorded_results(&store).await,
        vec!["call-0", "call-1", "call-2"]
    );
    finish_and_replay(&store, &engine, &client).await;
}

/// A report whose caller left while it waited for the session (a server's handler whose
/// client hung up) is taken out of the queue: nothing records it, and its task stays leased
/// for its worker's next report or its lease's lapse.
#[tokio::test]
async fn a_report_whose_caller_left_while_it_waited_is_not_recorded() {
    let (store, engine, client, tools) = fanned_out(2).await;
    let first = first_held(&store, &engine, &tools[0].lease).await;
    let left = spawn_report(&engine, &tools[1].lease, tool_result("never recorded"));
    until_waiting(&engine, 1).await;
    left.abort();
    assert!(left.await.expect_err("aborted").is_cancelled());
    assert_eq!(
        engine.reports_waiting("s"),
        0,
        "the left report is out of the queue"
    );
    store.release.notify_one();
    first.await.expect("joined").expect("the first is recorded");
    assert_eq!(recorded_results(&store).await, vec!["call-0"]);
    let queued = store.inner.list_tasks().await.expect("tasks");
    assert_eq!(
        queued.iter().map(|t| &t.id).collect::<Vec<_>>(),
        vec![&tools[1].lease.id],
        "the left report's task is still queued"
    );
    engine
        .report(&tools[1].lease, tool_result("second"))
        .await
        .expect("reported again, it is recorded");
    assert_eq!(recorded_results(&store).await, vec!["call-0", "call-1"]);
    finish_and_replay(&store, &engine, &client).await;
}

/// Reports recorded together that ask for more tasks (eager dispatch): the task their append
/// queues goes to the first of them that asked, once, and the others get none.
#[tokio::test]
async fn the_task_a_shared_append_queues_goes_to_the_first_report_that_asked() {
    let (store, engine, client, tools) = fanned_out(3).await;
    let first = first_held(&store, &engine, &tools[0].lease).await;
    let next = crate::store::LeaseRequest {
        filter: Arc::new(TaskFilter::any()),
        max: 1,
        lease_ms: 60_000,
        holder: crate::store::LeaseHolder::InProcess,
    };
    let report_and_lease = |lease: &Lease, text: &str| {
        let (engine, lease, next, report) = (
            engine.clone(),
            lease.clone(),
            next.clone(),
            tool_result(text),
        );
        tokio::spawn(async move { engine.report_and_lease(&lease, report, &next).await })
    };
    let second = report_and_lease(&tools[1].lease, "second");
    until_waiting(&engine, 1).await;
    let third = report_and_lease(&tools[2].lease, "third");
    until_waiting(&engine, 2).await;
    store.release.notify_one();
    first.await.expect("joined").expect("the first is recorded");
    let handed = second
        .await
        .expect("joined")
        .expect("the second is recorded");
    let none = third.await.expect("joined").expect("the third is recorded");
    assert_eq!(handed.len(), 1, "the second report gets the model call");
    assert!(matches!(
        handed[0].input,
        crate::engine::ActivityInput::Model { .. }
    ));
    assert!(none.is_empty(), "the third gets nothing");
    assert_eq!(store.completions.lock().expect("log").len(), 2);
    assert!(
        engine
            .lease_tasks(&TaskFilter::any(), 1, 60_000)
            .await
            .expect("lease")
            .is_empty(),
        "the model call is leased once"
    );
    answer_and_replay(&store, &engine, &client, &handed[0].lease).await;
}

/// A request for the next task, as a worker slot of this process asks.
fn next_task() -> crate::store::LeaseRequest {
    crate::store::LeaseRequest {
        filter: Arc::new(TaskFilter::any()),
        max: 1,
        lease_ms: 60_000,
        holder: crate::store::LeaseHolder::InProcess,
    }
}

/// Reports a worker sends together (a slot that ran the parallel calls in turn) are recorded
/// in one append at once, with no hold for one another: the paused clock never moves. The
/// task the append queues goes to the first; each is answered.
#[tokio::test(start_paused = true)]
#[allow(clippy::disallowed_methods)] // the paused clock says whether the reports waited
async fn reports_sent_together_share_one_append_at_once() {
    let (store, engine, client, tools) = fanned_out(3).await;
    let started = tokio::time::Instant::now();
    let reports = tools
        .iter()
        .enumerate()
        .map(|(i, tool)| (tool.lease.clone(), tool_result(&format!("result {i}"))))
        .collect();
    let answers = engine
        .report_all_and_lease(reports, Some(&next_task()))
        .await;
    assert_eq!(started.elapsed(), std::time::Duration::ZERO, "no hold");
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![(task_ids(&tools, &[0, 1, 2]), true)],
        "the three results in one append"
    );
    let handed: Vec<usize> = answers
        .iter()
        .map(|answer| answer.as_ref().expect("recorded").len())
        .collect();
    assert_eq!(handed, [1, 0, 0], "the model call goes to the first report");
    assert_eq!(
        recorded_results(&store).await,
        vec!["call-0", "call-1", "call-2"]
    );
    let model = answers[0].as_ref().expect("recorded")[0].lease.clone();
    answer_and_replay(&store, &engine, &client, &model).await;
}

/// Reports sent together still hold their session for a sibling running on a slot of its
/// own in this process, as a lone report does: all three results share one append.
#[tokio::test(start_paused = true)]
async fn reports_sent_together_hold_for_a_sibling_running_beside_them() {
    let (store, engine, client, tools) = fanned_out(3).await;
    let together = {
        let engine = engine.clone();
        let reports = vec![
            (tools[0].lease.clone(), tool_result("first")),
            (tools[1].lease.clone(), tool_result("second")),
        ];
        tokio::spawn(async move {
            engine
                .report_all_and_lease(reports, Some(&next_task()))
                .await
        })
    };
    let third = spawn_report(&engine, &tools[2].lease, tool_result("third"));
    let answers = together.await.expect("joined");
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    third.await.expect("joined").expect("the third is recorded");
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![(task_ids(&tools, &[0, 1, 2]), true)],
        "the three results in one append"
    );
    let model = answers[0].as_ref().expect("recorded");
    assert_eq!(model.len(), 1, "the first report gets the model call");
    answer_and_replay(&store, &engine, &client, &model[0].lease).await;
}

/// A report the store refuses among those sent together (a lease attempt that is not
/// current) is refused alone, and the others are recorded.
#[tokio::test]
async fn a_refused_report_among_those_sent_together_is_refused_alone() {
    let (store, engine, client, tools) = fanned_out(2).await;
    let mut not_current = tools[1].lease.clone();
    not_current.lease_attempt += 1;
    let answers = engine
        .report_all_and_lease(
            vec![
                (tools[0].lease.clone(), tool_result("first")),
                (not_current, tool_result("not current")),
            ],
            Some(&next_task()),
        )
        .await;
    assert!(answers[0].is_ok(), "{:?}", answers[0]);
    match &answers[1] {
        Err(Error::LeaseLost { task, .. }) => assert_eq!(*task, tools[1].lease.id.to_string()),
        other => panic!("a report of a lease attempt not current must be LeaseLost, got {other:?}"),
    }
    let ids = |of: &[usize]| task_ids(&tools, of);
    assert_eq!(
        *store.completions.lock().expect("log"),
        vec![(ids(&[0, 1]), false), (ids(&[0]), true), (ids(&[1]), false)],
        "refused together, then each alone"
    );
    assert_eq!(recorded_results(&store).await, vec!["call-0"]);
    engine
        .report(&tools[1].lease, tool_result("second"))
        .await
        .expect("the current lease's report is recorded");
    finish_and_replay(&store, &engine, &client).await;
}
