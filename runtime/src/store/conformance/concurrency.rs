//! The conformance checks of concurrency: several handles on one store (two processes on one
//! database; for an embedded store, one store shared in this process) leasing, fencing and
//! appending at once, and two engines deciding on the same sessions.
//!
//! Each check takes two handles, `a` and `b`, on one fresh, empty store; a backend that has
//! no second handle passes the same one twice.

use super::{append_request, history, message, new_task, snapshot, task_id, tasks};
use crate::clock::ManualClock;
use crate::engine::{ActivityInput, ActivityReport, Engine, LeasedTask};
use crate::error::Error;
use crate::event::{Event, Limits, RetryPolicy, SessionStarted};
use crate::replay::replay;
use crate::store::{Store, TaskFilter, TaskKind};
use crate::workflow::TurnOutcome;
use cairn_ledger::{
    JsonText, ModelResponse, ModelSpec, Part, StopReason, ToolResultContent, ToolSpec, ToolUse,
    Usage,
};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// How long a check waits for something another engine does before it fails.
const PATIENCE: Duration = Duration::from_secs(20);

/// Many leasers on two handles take every task exactly once: no task is handed to two of
/// them, and every lease carries attempt 1.
pub async fn concurrent_leases_hand_each_task_once(a: Arc<dyn Store>, b: Arc<dyn Store>) {
    const SESSIONS: u64 = 8;
    const TASKS_PER_SESSION: u64 = 8;
    const LEASERS: usize = 6;
    for s in 0..SESSIONS {
        let s = format!("lease-race-{s}");
        let events = (1..=TASKS_PER_SESSION)
            .map(|seq| message(&s, seq, "x"))
            .collect();
        let mut request = append_request(&s, 1, events, 0);
        request.enqueue = (1..=TASKS_PER_SESSION)
            .map(|seq| new_task(&task_id(&s, seq), TaskKind::Tool, seq))
            .collect();
        if let Err(e) = a.append(request).await {
            panic!("enqueueing the tasks of {s} must succeed, got {e:?}");
        }
    }
    let mut leasers = Vec::new();
    for n in 0..LEASERS {
        let store = if n % 2 == 0 { a.clone() } else { b.clone() };
        leasers.push(tokio::spawn(async move {
            let mut got = Vec::new();
            let mut empty = 0;
            while empty < 3 {
                match store
                    .lease_tasks(1_000, 60_000, 1 + n % 3, &TaskFilter::any())
                    .await
                {
                    Ok(leases) if leases.is_empty() => empty += 1,
                    Ok(leases) => {
                        empty = 0;
                        got.extend(leases.into_iter().map(|l| (l.id, l.lease_attempt)));
                    }
                    Err(e) if e.is_retryable() => {}
                    Err(e) => panic!("leaser {n}: lease_tasks must succeed, got {e:?}"),
                }
                tokio::task::yield_now().await;
            }
            got
        }));
    }
    let mut handed = BTreeMap::new();
    for (n, leaser) in leasers.into_iter().enumerate() {
        let got = leaser
            .await
            .unwrap_or_else(|e| panic!("leaser {n} failed: {e}"));
        for (id, attempt) in got {
            assert_eq!(attempt, 1, "task {id} was leased as attempt {attempt}");
            if let Some(other) = handed.insert(id.clone(), n) {
                panic!("task {id} was handed to leaser {other} and to leaser {n}");
            }
        }
    }
    assert_eq!(
        handed.len() as u64,
        SESSIONS * TASKS_PER_SESSION,
        "every queued task is leased once"
    );
}

/// A report from a lease that lapsed — its completion, with events and task changes, and
/// its heartbeat — is `LeaseLost` on either handle and changes nothing: not a history byte,
/// not a session, not a task.
pub async fn a_lapsed_lease_changes_nothing(a: Arc<dyn Store>, b: Arc<dyn Store>) {
    let s = "lapsed";
    let (t, other) = (task_id(s, 1), task_id(s, 2));
    let mut request = append_request(s, 1, vec![message(s, 1, "a"), message(s, 2, "b")], 0);
    request.enqueue = vec![
        new_task(&t, TaskKind::Tool, 0),
        new_task(&other, TaskKind::Tool, 500),
    ];
    if let Err(e) = a.append(request).await {
        panic!("enqueueing must succeed, got {e:?}");
    }
    let leases = a
        .lease_tasks(10, 100, 1, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("leasing must succeed, got {e:?}"));
    assert_eq!(leases.len(), 1, "one task is due at 10");
    let before = snapshot(&*a).await;
    for store in [&a, &b] {
        let mut late = append_request(s, 3, vec![message(s, 3, "late result")], 200);
        late.complete = vec![(t.clone(), 1)];
        late.cancel = vec![other.clone()];
        late.enqueue = vec![new_task(&task_id(s, 3), TaskKind::Model, 0)];
        match store.append(late).await {
            Err(Error::LeaseLost { .. }) => {}
            other => panic!("a completion after the lease lapsed must be LeaseLost, got {other:?}"),
        }
        match store.extend_lease(&t, 1, 200, 100, None).await {
            Err(Error::LeaseLost { .. }) => {}
            other => panic!("a heartbeat after the lease lapsed must be LeaseLost, got {other:?}"),
        }
    }
    assert_eq!(
        snapshot(&*b).await,
        before,
        "a lapsed lease's report and heartbeat change nothing"
    );
}

/// Two appends racing for the same seq on two handles: exactly one lands, the other is a
/// typed `Conflict` naming the seq it expected, and the history holds the winner.
pub async fn racing_appends_on_two_handles(a: Arc<dyn Store>, b: Arc<dyn Store>) {
    const ROUNDS: u64 = 20;
    let s = "append-race";
    if let Err(e) = a
        .append(append_request(s, 1, vec![message(s, 1, "start")], 0))
        .await
    {
        panic!("creating {s} must succeed, got {e:?}");
    }
    for seq in 2..=ROUNDS + 1 {
        let (left, right) = (message(s, seq, "from a"), message(s, seq, "from b"));
        let (ra, rb) = tokio::join!(
            a.append(append_request(s, seq, vec![left.clone()], 0)),
            b.append(append_request(s, seq, vec![right.clone()], 0)),
        );
        let winner = match (ra, rb) {
            (Ok(()), Err(Error::Conflict { expected, .. }))
            | (Err(Error::Conflict { expected, .. }), Ok(())) => {
                assert_eq!(
                    expected, seq,
                    "the loser's conflict names the seq it expected"
                );
                history(&*a, s).await.pop()
            }
            other => panic!(
                "of two appends at seq {seq}, one must land and one be a Conflict, got {other:?}"
            ),
        };
        assert!(
            winner == Some(left) || winner == Some(right),
            "seq {seq} holds one of the two racing events"
        );
    }
    assert_eq!(history(&*b, s).await.len() as u64, ROUNDS + 1);
    assert_eq!(tasks(&*b).await, vec![], "no task was written");
}

pub(super) fn started() -> SessionStarted {
    let schema = JsonText::parse(r#"{"type":"object"}"#).unwrap_or_else(|e| panic!("{e}"));
    SessionStarted {
        call_options: Default::default(),
        queues: Default::default(),
        forked_from: None,
        workflow_version: crate::workflow::WORKFLOW_VERSION,
        tool_policy: None,
        compaction: None,
        model: ModelSpec::parse("scripted:two-engines.json")
            .unwrap_or_else(|| panic!("scripted:two-engines.json is a model spec")),
        tools: vec![ToolSpec {
            name: "calculator".into(),
            description: "math".into(),
            input_schema: schema,
        }]
        .into(),
        system_prompt: None,
        limits: Limits {
            max_rounds: 8,
            session_budget: Default::default(),
            turn_budget: Default::default(),
        },
        model_retry: RetryPolicy::model_default(),
        tool_retry: RetryPolicy::tool_default(),
        workdir: None,
    }
}

fn answer(parts: Vec<Part>, stop_reason: StopReason) -> ActivityReport {
    ActivityReport::ModelCompleted(ModelResponse {
        provider: "scripted".into(),
        model: "two-engines".into(),
        parts,
        stop_reason_raw: format!("{stop_reason:?}"),
        stop_reason,
        usage: Usage::default(),
    })
}

fn calculator(id: &str) -> Part {
    Part::ToolUse(ToolUse {
        id: id.into(),
        name: "calculator".into(),
        arguments: r#"{"expression":"1+1"}"#.into(),
        signature: None,
    })
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {PATIENCE:?}"))
}

/// Leases on `engine` until `count` tasks are in hand (the other engine's appends queued
/// them, which this engine learns of from the store).
// Each long poll waits 50 ms of real time at most.
#[allow(clippy::disallowed_methods)]
async fn lease_on(engine: &Engine, count: usize) -> Vec<LeasedTask> {
    let mut got = Vec::new();
    within("leasing the tasks another engine queued", async {
        while got.len() < count {
            let deadline = tokio::time::Instant::now() + Duration::from_millis(50);
            match engine
                .lease_tasks_waiting(
                    &TaskFilter::any(),
                    count - got.len(),
                    60_000,
                    deadline,
                    std::future::pending(),
                    crate::store::LeaseHolder::InProcess,
                )
                .await
            {
                Ok(leased) => got.extend(leased),
                Err(e) => panic!("leasing must succeed, got {e:?}"),
            }
        }
    })
    .await;
    got
}

/// Two engines on one store take turns deciding for the same sessions: each reads what the
/// other appended before it decides (a task queued by one is leased and answered through the
/// other), reports racing on one session from both engines all land, a turn waiter on one
/// hears of an outcome the other recorded, and a message raced from both starts one turn.
/// Every history replays with the current code, and both engines fold the same state.
pub async fn two_engines_on_one_store(a: Arc<dyn Store>, b: Arc<dyn Store>) {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let one = Engine::new(a, clock.clone());
    let two = Engine::new(b, clock);
    let (stop, _) = tokio::sync::watch::channel(false);
    let followers = [one.clone(), two.clone()].map(|engine| {
        let mut stop = stop.subscribe();
        tokio::spawn(async move {
            engine
                .follow_store(Duration::from_millis(20), async move {
                    let _ = stop.changed().await;
                })
                .await
        })
    });

    let s = one
        .start_session(Some("two-engines".into()), started())
        .await
        .unwrap_or_else(|e| panic!("starting on engine one must succeed, got {e:?}"));
    let turn = two
        .send_message(&s, "add twice", None)
        .await
        .unwrap_or_else(|e| panic!("engine two must see the session engine one started: {e:?}"));
    assert_eq!(turn, 1);

    // Engine one leases the model call engine two queued and waits for the turn; engine two
    // answers it.
    let waiter = tokio::spawn({
        let one = one.clone();
        let s = s.clone();
        async move { one.wait_turn(&s, 1).await }
    });
    let model = lease_on(&one, 1).await.remove(0);
    assert!(matches!(model.input, ActivityInput::Model { .. }));
    two.report(
        &model.lease,
        answer(
            vec![calculator("call-a"), calculator("call-b")],
            StopReason::ToolUse,
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("engine two must record the model answer, got {e:?}"));

    // The two tool calls: both leased through engine one, reported at once through both.
    let tools = lease_on(&one, 2).await;
    let result = |n: &str| ActivityReport::ToolCompleted {
        content: ToolResultContent::Json(
            JsonText::parse(format!(r#"{{"value":"{n}"}}"#)).unwrap_or_else(|e| panic!("{e}")),
        ),
        is_error: false,
    };
    let (r1, r2) = tokio::join!(
        one.report(&tools[0].lease, result("first")),
        two.report(&tools[1].lease, result("second")),
    );
    r1.unwrap_or_else(|e| panic!("the first tool result must land, got {e:?}"));
    r2.unwrap_or_else(|e| panic!("the second tool result, racing it, must land, got {e:?}"));
    // A duplicate report of a tool already answered changes nothing.
    let duplicate = two.report(&tools[0].lease, result("again")).await;
    assert!(
        matches!(&duplicate, Err(e) if e.is_stale_report()),
        "a second report of an answered tool must be stale, got {duplicate:?}"
    );

    let last = lease_on(&two, 1).await.remove(0);
    one.report(
        &last.lease,
        answer(vec![Part::text("two")], StopReason::EndTurn),
    )
    .await
    .unwrap_or_else(|e| panic!("engine one must record the final answer, got {e:?}"));
    let outcome = within("engine one's waiter hearing of the outcome", waiter)
        .await
        .unwrap_or_else(|e| panic!("the waiter failed: {e}"))
        .unwrap_or_else(|e| panic!("waiting on engine one failed: {e:?}"));
    assert!(
        matches!(outcome, TurnOutcome::Completed { turn: 1, .. }),
        "the turn completed, got {outcome:?}"
    );
    let heard = within("engine two's waiter", two.wait_turn(&s, 1))
        .await
        .unwrap_or_else(|e| panic!("waiting on engine two failed: {e:?}"));
    assert_eq!(heard, outcome, "both engines report the same outcome");

    // A message raced from both engines starts exactly one turn; the other is refused.
    let (m1, m2) = tokio::join!(
        one.send_message(&s, "again from one", None),
        two.send_message(&s, "again from two", None),
    );
    match (&m1, &m2) {
        (Ok(2), Err(Error::InvalidEvent { .. })) | (Err(Error::InvalidEvent { .. }), Ok(2)) => {}
        other => panic!("of two racing messages one starts turn 2, the other is refused (a turn is running): got {other:?}"),
    }

    let events = history(&**one.store(), &s).await;
    let replayed = replay(&s, &events)
        .unwrap_or_else(|e| panic!("the history two engines wrote must replay, got {e:?}"));
    let (state_one, state_two) = (one.state(&s).await, two.state(&s).await);
    let (state_one, state_two) = (
        state_one.unwrap_or_else(|e| panic!("{e:?}")),
        state_two.unwrap_or_else(|e| panic!("{e:?}")),
    );
    assert_eq!(
        state_one, replayed.state,
        "engine one folds the stored history"
    );
    assert_eq!(
        state_two, replayed.state,
        "engine two folds the stored history"
    );
    let results: Vec<&Event> = events
        .iter()
        .map(|e| &e.event)
        .filter(|e| matches!(e, Event::ToolCallCompleted { .. }))
        .collect();
    assert_eq!(results.len(), 2, "one result per tool_use: {results:?}");

    let _ = stop.send(true);
    for follower in followers {
        let _ = within("the store followers stopping", follower).await;
    }
}
