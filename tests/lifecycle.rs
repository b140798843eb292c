//! Activity lifecycle: cancellation reaching running activities, heartbeats and their timeout,
//! schedule-to-start and schedule-to-close limits, and the phases of model call failures.
//! Every scenario is checked by replaying its history.

use crate::support::TestHost;
use async_trait::async_trait;
use cairn_activities::{
    ActivityContext, DeltaSink, Error as ActivityError, ErrorKind, ModelProvider, ModelRequest,
    Tool, ToolCall, ToolOutput, ToolRegistry,
};
use cairn_ledger::*;
use cairn_runtime::*;
use cairn_workers::{Activities, ModelResolver, WorkerConfig, WorkerPool};
use std::result::Result;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A model that answers from a list of closures, one per call (by assistant-message count).
struct FnModel {
    calls: Mutex<Vec<ModelStep>>,
}

type ModelStep = Box<
    dyn Fn(&ModelRequest, &dyn DeltaSink) -> Result<ModelResponse, ActivityError> + Send + Sync,
>;

impl FnModel {
    fn new(steps: Vec<ModelStep>) -> Arc<Self> {
        Arc::new(FnModel {
            calls: Mutex::new(steps),
        })
    }
}

#[async_trait]
impl ModelProvider for FnModel {
    fn provider(&self) -> &str {
        "fn"
    }
    async fn call(
        &self,
        request: &ModelRequest,
        deltas: &dyn DeltaSink,
        _context: &ActivityContext,
    ) -> Result<ModelResponse, ActivityError> {
        let index = request
            .transcript
            .messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        let steps = self.calls.lock().unwrap();
        let step = steps.get(index.min(steps.len() - 1)).unwrap();
        step(request, deltas)
    }
}

struct Fixed(Arc<FnModel>);

impl ModelResolver for Fixed {
    fn resolve(&self, _spec: &ModelSpec) -> Result<Arc<dyn ModelProvider>, ActivityError> {
        Ok(self.0.clone())
    }
}

fn response(parts: Vec<Part>) -> ModelResponse {
    let stop = if parts.iter().any(|p| matches!(p, Part::ToolUse(_))) {
        StopReason::ToolUse
    } else {
        StopReason::EndTurn
    };
    ModelResponse {
        provider: "fn".into(),
        model: "test".into(),
        parts,
        stop_reason_raw: "x".into(),
        stop_reason: stop,
        usage: Usage {
            input_tokens: 3,
            output_tokens: 4,
            ..Usage::default()
        },
    }
}

fn call_tool(id: &str, name: &str) -> ModelStep {
    let (id, name) = (id.to_owned(), name.to_owned());
    Box::new(move |_, _| {
        Ok(response(vec![Part::ToolUse(ToolUse {
            id: id.clone(),
            name: name.clone(),
            arguments: "{}".into(),
            signature: None,
        })]))
    })
}

fn answer(text: &str) -> ModelStep {
    let text = text.to_owned();
    Box::new(move |_, _| Ok(response(vec![Part::text(text.clone())])))
}

/// A tool that waits until cancelled (or 30 s), heartbeating, and says whether it saw the signal.
struct Waiter {
    saw_cancel: Arc<AtomicBool>,
    started: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl Tool for Waiter {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: "wait".into(),
            description: "waits".into(),
            input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
        }
    }
    async fn call(
        &self,
        _call: &ToolCall,
        context: &ActivityContext,
    ) -> cairn_activities::Result<ToolOutput> {
        self.started.notify_one();
        tokio::select! {
            _ = context.cancelled() => {
                self.saw_cancel.store(true, Ordering::SeqCst);
                Err(ActivityError::Cancelled { reason: "stopped".into() })
            }
            _ = tokio::time::sleep(Duration::from_secs(30)) => Ok(ToolOutput::text("done waiting")),
        }
    }
}

/// A tool that heartbeats progress, then hangs on its first attempt; later attempts return
/// the progress they resumed from.
struct Resumable {
    attempts: Arc<AtomicU32>,
}

#[async_trait]
impl Tool for Resumable {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: "resumable".into(),
            description: "long job".into(),
            input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
        }
    }
    async fn call(
        &self,
        _call: &ToolCall,
        context: &ActivityContext,
    ) -> cairn_activities::Result<ToolOutput> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if let Some(previous) = context.previous_heartbeat_details() {
            return Ok(ToolOutput::text(format!("resumed from {previous}")));
        }
        for step in 1..=2 {
            context.heartbeat(Some(
                JsonText::parse(format!(r#"{{"step":{step}}}"#)).unwrap(),
            ));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Stuck: no more heartbeats.
        context.cancelled().await;
        Err(ActivityError::Cancelled {
            reason: "stuck".into(),
        })
    }
}

fn workers() -> WorkerConfig {
    WorkerConfig {
        concurrency: 8,
        lease_ms: 2_000,
        poll_interval_ms: 5,
        ..WorkerConfig::default()
    }
}

fn options(tools: &ToolRegistry, id: &str) -> SessionOptions {
    let mut o = SessionOptions::new(ModelSpec::parse("fn:test").unwrap(), tools.specs());
    o.session_id = Some(id.into());
    for p in [&mut o.model_retry, &mut o.tool_retry] {
        p.initial_interval_ms = 1;
        p.maximum_interval_ms = 5;
    }
    o
}

async fn replays(client: &Client, session: &str) -> Vec<EventEnvelope> {
    let history = client.history(session).await.unwrap();
    let replayed = replay(session, &history).unwrap();
    let live = client.transcript(session).await.unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        live.canonical_json()
    );
    validate_transcript(&live).unwrap();
    history
}

fn host_with(model: Arc<FnModel>, tools: ToolRegistry, clock: Arc<dyn Clock>) -> TestHost {
    TestHost::start_with_activities(
        Arc::new(MemoryStore::new()),
        clock,
        Activities {
            models: Arc::new(Fixed(model)),
            tools: Arc::new(tools),
        },
        workers(),
    )
}

#[tokio::test]
async fn cancelling_a_turn_signals_the_running_tool_and_closes_its_tool_use() {
    let saw_cancel = Arc::new(AtomicBool::new(false));
    let started = Arc::new(tokio::sync::Notify::new());
    let tools = ToolRegistry::new().with(Waiter {
        saw_cancel: saw_cancel.clone(),
        started: started.clone(),
    });
    let model = FnModel::new(vec![call_tool("w1", "wait"), answer("after cancel")]);
    let host = host_with(model, tools, Arc::new(SystemClock));
    let session = host
        .client
        .start_session(options(&host.tools, "cancel-turn"))
        .await
        .unwrap();
    let turn = host.client.send(&session, "wait please").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified())
        .await
        .unwrap();
    let cancelled = host
        .client
        .engine()
        .expect("in-process")
        .cancel_turn(&session, "user pressed stop")
        .await
        .unwrap();
    assert_eq!(cancelled, turn);
    let outcome = host.client.wait_turn(&session, turn).await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Cancelled { ref reason, .. } if reason == "user pressed stop")
    );
    // The running tool got the signal (cooperative cancellation).
    for _ in 0..200 {
        if saw_cancel.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        saw_cancel.load(Ordering::SeqCst),
        "the tool never saw the cancellation"
    );
    // The transcript closes the tool_use, and the session takes another turn.
    let transcript = host.client.transcript(&session).await.unwrap();
    let Part::ToolResult(r) = &transcript.messages.last().unwrap().parts[0] else {
        panic!()
    };
    assert!(r.is_error);
    assert_eq!(
        r.content,
        ToolResultContent::Text("cancelled: user pressed stop".into())
    );
    let next = host.client.run_turn(&session, "again").await.unwrap();
    assert!(
        matches!(next, TurnOutcome::Completed { ref answer, .. } if answer == "after cancel"),
        "{next:?}"
    );
    let history = replays(&host.client, &session).await;
    assert!(history.iter().any(|e| e.kind == "turn_cancelled"));
    // The late report of the cancelled tool changed nothing: one result for w1.
    let results = history
        .iter()
        .filter(|e| matches!(&e.event, Event::ToolCallCompleted { tool_use_id, .. } | Event::ToolCallFailed { tool_use_id, .. } if tool_use_id == "w1"))
        .count();
    assert_eq!(results, 0, "the cancelled call's report must be rejected");
    host.shutdown().await;
}

#[tokio::test]
async fn cancelling_a_session_ends_it() {
    let saw_cancel = Arc::new(AtomicBool::new(false));
    let started = Arc::new(tokio::sync::Notify::new());
    let tools = ToolRegistry::new().with(Waiter {
        saw_cancel: saw_cancel.clone(),
        started: started.clone(),
    });
    let host = host_with(
        FnModel::new(vec![call_tool("w1", "wait")]),
        tools,
        Arc::new(SystemClock),
    );
    let session = host
        .client
        .start_session(options(&host.tools, "cancel-session"))
        .await
        .unwrap();
    let turn = host.client.send(&session, "wait").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified())
        .await
        .unwrap();
    host.client.cancel(&session, "shutting down").await.unwrap();
    assert!(matches!(
        host.client.wait_turn(&session, turn).await.unwrap(),
        TurnOutcome::Cancelled { .. }
    ));
    let err = host.client.send(&session, "more").await.unwrap_err();
    assert!(err.to_string().contains("session is cancelled"), "{err}");
    let sessions = host.client.sessions().await.unwrap();
    assert_eq!(sessions[0].status, SessionStatus::Cancelled);
    replays(&host.client, &session).await;
    host.shutdown().await;
    assert!(saw_cancel.load(Ordering::SeqCst));
}

#[tokio::test]
async fn a_missed_heartbeat_fails_the_attempt_and_the_next_one_gets_the_details() {
    let attempts = Arc::new(AtomicU32::new(0));
    let tools = ToolRegistry::new().with(Resumable {
        attempts: attempts.clone(),
    });
    let model = FnModel::new(vec![call_tool("r1", "resumable"), answer("finished")]);
    let host = host_with(model, tools, Arc::new(SystemClock));
    let mut o = options(&host.tools, "heartbeat");
    o.tool_retry.heartbeat_timeout_ms = Some(150);
    let session = host.client.start_session(o).await.unwrap();
    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        host.client.run_turn(&session, "go"),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    let history = replays(&host.client, &session).await;
    let failure = history
        .iter()
        .find_map(|e| match &e.event {
            Event::ToolCallFailed {
                attempt: 1,
                failure,
                ..
            } => Some(failure.clone()),
            _ => None,
        })
        .expect("attempt 1 failed");
    assert_eq!(failure.class, ErrorClass::Timeout);
    assert!(
        failure.message.contains("heartbeat timeout"),
        "{}",
        failure.message
    );
    assert_eq!(
        failure.heartbeat_details.as_ref().map(|d| d.as_str()),
        Some(r#"{"step":2}"#)
    );
    let transcript = host.client.transcript(&session).await.unwrap();
    let Part::ToolResult(r) = &transcript.messages[2].parts[0] else {
        panic!()
    };
    assert_eq!(
        r.content,
        ToolResultContent::Text(r#"resumed from {"step":2}"#.into())
    );
    host.shutdown().await;
}

/// An attempt no worker started before its schedule-to-start deadline is never handed out;
/// the engine's timers record it as a timeout with no worker around at all, and the retry (with
/// a deadline of its own) runs once a worker comes.
#[tokio::test]
async fn an_attempt_that_waited_too_long_for_a_worker_times_out_and_is_retried() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), clock.clone());
    let client = Client::new(engine.clone());
    let tools = ToolRegistry::new();
    let mut o = options(&tools, "sched-to-start");
    o.model_retry.schedule_to_start_timeout_ms = Some(1_000);
    o.model_retry.initial_interval_ms = 0;
    let session = client.start_session(o).await.unwrap();
    client.send(&session, "hello").await.unwrap();
    let sent = clock.now_ms();
    assert_eq!(
        store.list_tasks().await.unwrap()[0].start_by_ms,
        Some(sent + 1_000)
    );
    // No worker for 5 s. Nothing is due before the deadline.
    clock.advance(999);
    assert_eq!(engine.fire_timers().await.unwrap(), 0);
    clock.advance(4_001);
    assert!(
        engine
            .lease_tasks(&TaskFilter::any(), 10, 1_000)
            .await
            .unwrap()
            .is_empty(),
        "an attempt past its start deadline is not handed out"
    );
    let before = client.history(&session).await.unwrap().len();
    assert_eq!(engine.fire_timers().await.unwrap(), 1);
    let history = client.history(&session).await.unwrap();
    let now = clock.now_ms();
    match &history[before..] {
        [failed, scheduled] => {
            let Event::ModelCallFailed {
                attempt: 1,
                failure,
                ..
            } = &failed.event
            else {
                panic!("{failed:?}")
            };
            assert_eq!(failure.class, ErrorClass::Timeout);
            assert!(
                failure.message.contains("schedule-to-start timeout"),
                "{}",
                failure.message
            );
            assert!(
                matches!(scheduled.event, Event::ModelCallScheduled { attempt: 2, not_before_ms, .. } if not_before_ms == now),
                "{scheduled:?}"
            );
        }
        other => panic!("the timer records the timeout and schedules the retry: {other:?}"),
    }
    let queued = store.list_tasks().await.unwrap();
    assert_eq!(queued.len(), 1);
    assert_eq!(
        queued[0].start_by_ms,
        Some(now + 1_000),
        "the retry's own deadline"
    );
    let pool = cairn_workers::WorkerPool::start(
        engine,
        Activities {
            models: Arc::new(Fixed(FnModel::new(vec![answer("late but fine")]))),
            tools: Arc::new(tools),
        },
        workers(),
    );
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.wait_turn(&session, 1))
        .await
        .unwrap()
        .unwrap();
    pool.shutdown().await;
    assert!(
        matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "late but fine"),
        "{outcome:?}"
    );
    let history = replays(&client, &session).await;
    assert!(history
        .iter()
        .any(|e| matches!(e.event, Event::ModelCallCompleted { attempt: 2, .. })));
}

/// With no worker at all, start deadlines still fire: each attempt times out in turn and the
/// turn fails after the policy's attempts.
#[tokio::test]
async fn with_no_worker_at_all_start_deadlines_fail_the_turn_after_its_attempts() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let engine = Engine::new(Arc::new(MemoryStore::new()), clock.clone());
    let client = Client::new(engine.clone());
    let mut o = options(&ToolRegistry::new(), "nobody");
    o.model_retry.schedule_to_start_timeout_ms = Some(1_000);
    o.model_retry.maximum_attempts = 2;
    let session = client.start_session(o).await.unwrap();
    let turn = client.send(&session, "anyone?").await.unwrap();
    for _ in 0..2 {
        // Past the backoff (at most 5 ms) and the deadline.
        clock.advance(1_010);
        assert_eq!(engine.fire_timers().await.unwrap(), 1);
    }
    let outcome = client.wait_turn(&session, turn).await.unwrap();
    let TurnOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        reason.contains("after 2 attempt(s)") && reason.contains("schedule-to-start timeout"),
        "{reason}"
    );
    assert!(engine.store().list_tasks().await.unwrap().is_empty());
    clock.advance(100_000);
    assert_eq!(
        engine.fire_timers().await.unwrap(),
        0,
        "nothing is left to fire"
    );
    let history = replays(&client, &session).await;
    assert_eq!(
        history
            .iter()
            .filter(|e| matches!(&e.event, Event::ModelCallFailed { failure, .. } if failure.class == ErrorClass::Timeout))
            .count(),
        2
    );
}

/// Each event's record bytes: what "the history did not change" compares.
async fn history_bytes(client: &Client, session: &str) -> Vec<Vec<u8>> {
    client
        .history(session)
        .await
        .unwrap()
        .iter()
        .map(|e| cairn_runtime::codec::encode(e).unwrap())
        .collect()
}

/// A worker leases a tool call, heartbeats its progress and dies. Its lease lapses; the timers
/// record the attempt as failed (timeout, "lease lapsed") with the details it last sent, and
/// the next attempt receives them and resumes from there. The dead worker's report is fenced
/// off before the timers fire (`LeaseLost`) and after (`StaleReport`), changing no byte.
#[tokio::test]
async fn a_worker_that_dies_is_a_lapsed_attempt_and_the_next_one_gets_its_heartbeat_details() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), clock.clone());
    let client = Client::new(engine.clone());
    let attempts = Arc::new(AtomicU32::new(0));
    let tools = ToolRegistry::new().with(Resumable {
        attempts: attempts.clone(),
    });
    let session = client
        .start_session(options(&tools, "dead-worker"))
        .await
        .unwrap();
    let turn = client.send(&session, "go").await.unwrap();
    let any = TaskFilter::any();
    // The model call, by hand: it asks for the tool.
    let leased = engine.lease_tasks(&any, 10, 1_000).await.unwrap();
    assert_eq!(leased.len(), 1);
    let tool_call = response(vec![Part::ToolUse(ToolUse {
        id: "r1".into(),
        name: "resumable".into(),
        arguments: "{}".into(),
        signature: None,
    })]);
    engine
        .report(&leased[0].lease, ActivityReport::ModelCompleted(tool_call))
        .await
        .unwrap();
    // A worker takes the tool call, heartbeats twice, and dies.
    let leased = engine.lease_tasks(&any, 10, 1_000).await.unwrap();
    assert_eq!(leased.len(), 1);
    let dead = leased[0].lease.clone();
    let ActivityInput::Tool {
        origin,
        heartbeat_details,
        ..
    } = &leased[0].input
    else {
        panic!("{:?}", leased[0].input)
    };
    assert_eq!((origin.attempt, heartbeat_details), (1, &None));
    let rows = |n: u32| JsonText::parse(format!(r#"{{"rows":{n}}}"#)).unwrap();
    engine
        .heartbeat(&dead, 1_000, Some(rows(10)))
        .await
        .unwrap();
    clock.advance(500);
    engine.heartbeat(&dead, 1_000, None).await.unwrap();
    clock.advance(400);
    let expiry = engine
        .heartbeat(&dead, 1_000, Some(rows(20)))
        .await
        .unwrap();
    assert_eq!(expiry, clock.now_ms() + 1_000);
    clock.advance(1_000);
    assert!(
        matches!(
            engine.heartbeat(&dead, 1_000, Some(rows(30))).await,
            Err(cairn_runtime::Error::LeaseLost { .. })
        ),
        "a heartbeat at the expiry finds the lease lapsed"
    );
    assert!(engine
        .lease_tasks(&any, 10, 1_000)
        .await
        .unwrap()
        .is_empty());
    let done = ActivityReport::ToolCompleted {
        content: ToolResultContent::Text("late".into()),
        is_error: false,
    };
    let before = history_bytes(&client, &session).await;
    let err = engine.report(&dead, done.clone()).await.unwrap_err();
    assert!(
        matches!(err, cairn_runtime::Error::LeaseLost { .. }),
        "{err}"
    );
    assert_eq!(history_bytes(&client, &session).await, before);

    assert_eq!(engine.fire_timers().await.unwrap(), 1);
    let history = client.history(&session).await.unwrap();
    let failure = history
        .iter()
        .find_map(|e| match &e.event {
            Event::ToolCallFailed {
                tool_use_id,
                attempt: 1,
                failure,
                ..
            } if tool_use_id == "r1" => Some(failure.clone()),
            _ => None,
        })
        .expect("the lapsed attempt is recorded");
    assert_eq!(failure.class, ErrorClass::Timeout);
    assert!(
        failure.message.contains("lease lapsed"),
        "{}",
        failure.message
    );
    assert_eq!(
        failure.heartbeat_details,
        Some(rows(20)),
        "the details the dead attempt last sent"
    );
    let before = history_bytes(&client, &session).await;
    let err = engine.report(&dead, done).await.unwrap_err();
    assert!(
        matches!(err, cairn_runtime::Error::StaleReport { .. }),
        "{err}"
    );
    assert_eq!(history_bytes(&client, &session).await, before);

    // The next attempt's input carries them (looked at without leasing it).
    let queued = store.list_tasks().await.unwrap();
    assert_eq!(queued.len(), 1);
    let next = Lease {
        id: queued[0].id.clone(),
        kind: queued[0].kind,
        lease_attempt: queued[0].lease_attempt,
        expires_at_ms: queued[0].visible_at_ms,
    };
    let Some(ActivityInput::Tool {
        origin,
        heartbeat_details,
        ..
    }) = engine.activity(&next).await.unwrap()
    else {
        panic!("the retry is a tool call")
    };
    assert_eq!((origin.attempt, heartbeat_details), (2, Some(rows(20))));
    // A live worker runs it; the tool resumes from them.
    clock.advance(5);
    let pool = cairn_workers::WorkerPool::start(
        engine.clone(),
        Activities {
            models: Arc::new(Fixed(FnModel::new(vec![answer("finished")]))),
            tools: Arc::new(tools),
        },
        workers(),
    );
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.wait_turn(&session, turn))
        .await
        .unwrap()
        .unwrap();
    pool.shutdown().await;
    assert!(
        matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "finished"),
        "{outcome:?}"
    );
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        1,
        "only the live worker ran the tool"
    );
    let history = replays(&client, &session).await;
    let results: Vec<(u32, ToolResultContent)> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallCompleted {
                attempt, content, ..
            } => Some((*attempt, content.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        [(
            2,
            ToolResultContent::Text(r#"resumed from {"rows":20}"#.into())
        )]
    );
}

/// A task that kills every worker that takes it is not leased again and again forever: each
/// lapsed lease is a failed attempt, and after `maximum_attempts` the turn fails.
#[tokio::test]
async fn a_task_that_kills_its_worker_every_time_fails_the_turn_after_its_attempts() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), clock.clone());
    let client = Client::new(engine.clone());
    let mut o = options(&ToolRegistry::new(), "poison");
    o.model_retry.maximum_attempts = 3;
    let session = client.start_session(o).await.unwrap();
    let turn = client.send(&session, "crash").await.unwrap();
    let any = TaskFilter::any();
    for attempt in 1..=3 {
        // Past the previous attempt's backoff (at most 5 ms).
        clock.advance(5);
        let leased = engine.lease_tasks(&any, 10, 1_000).await.unwrap();
        assert_eq!(leased.len(), 1, "attempt {attempt} is handed out once");
        assert_eq!(
            leased[0].lease.lease_attempt, 1,
            "each attempt is a new task"
        );
        assert!(
            matches!(&leased[0].input, ActivityInput::Model { origin, .. } if origin.attempt == attempt)
        );
        // Its worker dies: no renewal, no report.
        clock.advance(1_000);
        assert!(
            engine
                .lease_tasks(&any, 10, 1_000)
                .await
                .unwrap()
                .is_empty(),
            "attempt {attempt}'s lapsed lease is not handed out again"
        );
        assert_eq!(engine.fire_timers().await.unwrap(), 1);
    }
    let outcome = client.wait_turn(&session, turn).await.unwrap();
    let TurnOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        reason.contains("after 3 attempt(s)") && reason.contains("lease lapsed"),
        "{reason}"
    );
    assert!(store.list_tasks().await.unwrap().is_empty());
    clock.advance(100_000);
    assert!(engine
        .lease_tasks(&any, 10, 1_000)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(engine.fire_timers().await.unwrap(), 0);
    let history = replays(&client, &session).await;
    let failed: Vec<u32> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelCallFailed {
                attempt, failure, ..
            } if failure.class == ErrorClass::Timeout => Some(*attempt),
            _ => None,
        })
        .collect();
    assert_eq!(failed, [1, 2, 3]);
}

/// The engine's timer loop (`run_timers`, as a host or server runs it) notices a dead worker
/// by itself: a live pool then runs the retry, and nobody calls `fire_timers` by hand.
#[tokio::test]
async fn the_timer_loop_retries_a_dead_workers_attempt_by_itself() {
    let engine = Engine::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    let session = client
        .start_session(options(&ToolRegistry::new(), "timer-loop"))
        .await
        .unwrap();
    let turn = client.send(&session, "go").await.unwrap();
    // A worker takes the call for 50 ms and dies.
    let dead = engine
        .lease_tasks(&TaskFilter::any(), 10, 50)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let timers = tokio::spawn({
        let engine = engine.clone();
        async move {
            engine
                .run_timers(Duration::from_millis(10), async {
                    let _ = stopped.await;
                })
                .await
        }
    });
    let pool = cairn_workers::WorkerPool::start(
        engine.clone(),
        Activities {
            models: Arc::new(Fixed(FnModel::new(vec![answer("second try")]))),
            tools: Arc::new(ToolRegistry::new()),
        },
        workers(),
    );
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.wait_turn(&session, turn))
        .await
        .expect("the timers record the lapsed lease and the pool runs the retry")
        .unwrap();
    pool.shutdown().await;
    let _ = stop.send(());
    timers.await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "second try"),
        "{outcome:?}"
    );
    let history = replays(&client, &session).await;
    assert!(history.iter().any(|e| matches!(
        &e.event,
        Event::ModelCallFailed { attempt: 1, failure, .. }
            if failure.class == ErrorClass::Timeout && failure.message.contains("lease lapsed")
    )));
    assert!(history
        .iter()
        .any(|e| matches!(e.event, Event::ModelCallCompleted { attempt: 2, .. })));
}

/// A tool that answers with the name of the pool it runs in.
struct Named {
    name: &'static str,
    pool: &'static str,
}

#[async_trait]
impl Tool for Named {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.name.into(),
            description: "says which pool ran it".into(),
            input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
        }
    }
    async fn call(
        &self,
        _call: &ToolCall,
        _context: &ActivityContext,
    ) -> cairn_activities::Result<ToolOutput> {
        Ok(ToolOutput::text(self.pool))
    }
}

/// A model that asks for `tools` (ids `c0`, `c1`, ...) in its first answer, then answers with
/// the name of the pool it runs in.
fn pool_model(pool: &'static str, tools: &'static [&'static str]) -> Arc<FnModel> {
    let ask: ModelStep = Box::new(move |_, _| {
        Ok(response(
            tools
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    Part::ToolUse(ToolUse {
                        id: format!("c{i}"),
                        name: (*name).into(),
                        arguments: "{}".into(),
                        signature: None,
                    })
                })
                .collect(),
        ))
    });
    FnModel::new(vec![ask, answer(&format!("answered in {pool}"))])
}

fn pool(
    engine: &Engine,
    model: Arc<FnModel>,
    tools: ToolRegistry,
    config: WorkerConfig,
) -> WorkerPool {
    cairn_workers::WorkerPool::start(
        engine.clone(),
        Activities {
            models: Arc::new(Fixed(model)),
            tools: Arc::new(tools),
        },
        config,
    )
}

/// Every tool result of `session`: (tool_use id, attempt, content).
fn tool_results(history: &[EventEnvelope]) -> Vec<(String, u32, ToolResultContent)> {
    history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallCompleted {
                tool_use_id,
                attempt,
                content,
                ..
            } => Some((tool_use_id.clone(), *attempt, content.clone())),
            _ => None,
        })
        .collect()
}

/// Polls `check` every 5 ms until it holds (at most 10 s).
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    tokio::time::timeout(Duration::from_secs(10), async {
        while !check().await {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

/// Two pools on one engine, only one of which hosts the tool `where`: a pool that does not
/// host it never leases its calls (even when it is the only pool, leasing the call scheduled
/// with it), and every call of it runs on the pool that does.
#[tokio::test]
async fn only_a_pool_that_hosts_a_tool_runs_its_calls() {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    let hosting = || {
        ToolRegistry::new()
            .with(Named {
                name: "where",
                pool: "hosting",
            })
            .with(Named {
                name: "common",
                pool: "hosting",
            })
    };
    let session = client
        .start_session(options(&hosting(), "routed-tool"))
        .await
        .unwrap();
    let other = pool(
        &engine,
        pool_model("other", &["where", "common", "where"]),
        ToolRegistry::new().with(Named {
            name: "common",
            pool: "other",
        }),
        workers(),
    );
    let turn = client.send(&session, "go").await.unwrap();
    // The other pool runs the model and `common`, leased with the `where` calls beside it.
    until("the other pool's result for common", || async {
        !tool_results(&client.history(&session).await.unwrap()).is_empty()
    })
    .await;
    let history = client.history(&session).await.unwrap();
    assert_eq!(
        tool_results(&history),
        [("c1".to_owned(), 1, ToolResultContent::Text("other".into()))]
    );
    let waiting: Vec<(String, u32)> = store
        .list_tasks()
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.target, t.lease_attempt))
        .collect();
    assert_eq!(
        waiting,
        [("where".to_owned(), 0), ("where".to_owned(), 0)],
        "the pool that does not host `where` never leased its calls"
    );
    let hosting_pool = pool(&engine, pool_model("hosting", &[]), hosting(), workers());
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.wait_turn(&session, turn))
        .await
        .unwrap()
        .unwrap();
    other.shutdown().await;
    hosting_pool.shutdown().await;
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    let history = replays(&client, &session).await;
    let mut results = tool_results(&history);
    results.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        results,
        [
            (
                "c0".to_owned(),
                1,
                ToolResultContent::Text("hosting".into())
            ),
            ("c1".to_owned(), 1, ToolResultContent::Text("other".into())),
            (
                "c2".to_owned(),
                1,
                ToolResultContent::Text("hosting".into())
            ),
        ],
        "every `where` call ran on the hosting pool, once"
    );
    assert!(!history.iter().any(|e| e.kind == "tool_call_failed"));
}

/// A pool serving only the `gpu` queue gets only the tasks of sessions that route there, and a
/// pool of the default queue never gets those.
#[tokio::test]
async fn a_pool_on_the_gpu_queue_gets_only_the_tasks_routed_there() {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    let whoami = |pool: &'static str| {
        ToolRegistry::new().with(Named {
            name: "whoami",
            pool,
        })
    };
    let queues = |name: &str| Some(std::iter::once(name.to_owned()).collect());
    let default_pool = pool(
        &engine,
        pool_model("default", &["whoami", "whoami"]),
        whoami("default"),
        WorkerConfig {
            queues: queues(DEFAULT_QUEUE),
            ..workers()
        },
    );
    let mut o = options(&whoami("spec"), "route-gpu");
    o.queues.tool = Some("gpu".into());
    let gpu_session = client.start_session(o).await.unwrap();
    let plain_session = client
        .start_session(options(&whoami("spec"), "route-plain"))
        .await
        .unwrap();
    // The gpu session's model call runs on the default queue; its tool calls wait for a gpu
    // worker while the default pool runs two whole turns scheduled after them.
    let gpu_turn = client.send(&gpu_session, "go").await.unwrap();
    until("the gpu session's tool calls", || async {
        client
            .history(&gpu_session)
            .await
            .unwrap()
            .iter()
            .any(|e| e.kind == "tool_call_scheduled")
    })
    .await;
    for text in ["first", "second"] {
        let outcome = tokio::time::timeout(
            Duration::from_secs(10),
            client.run_turn(&plain_session, text),
        )
        .await
        .unwrap()
        .unwrap();
        assert!(
            matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "answered in default"),
            "{outcome:?}"
        );
    }
    let waiting: Vec<(String, String, u32)> = store
        .list_tasks()
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.id.session_id, t.queue, t.lease_attempt))
        .collect();
    assert_eq!(
        waiting,
        [
            ("route-gpu".to_owned(), "gpu".to_owned(), 0),
            ("route-gpu".to_owned(), "gpu".to_owned(), 0)
        ],
        "the default pool never leased the gpu session's tool calls"
    );
    let gpu_pool = pool(
        &engine,
        pool_model("gpu", &["whoami", "whoami"]),
        whoami("gpu"),
        WorkerConfig {
            queues: queues("gpu"),
            ..workers()
        },
    );
    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        client.wait_turn(&gpu_session, gpu_turn),
    )
    .await
    .unwrap()
    .unwrap();
    let outcome_again = tokio::time::timeout(
        Duration::from_secs(10),
        client.run_turn(&plain_session, "third"),
    )
    .await
    .unwrap()
    .unwrap();
    default_pool.shutdown().await;
    gpu_pool.shutdown().await;
    assert!(
        matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "answered in default"),
        "the gpu session's model calls stay on the default queue: {outcome:?}"
    );
    assert!(
        matches!(outcome_again, TurnOutcome::Completed { .. }),
        "{outcome_again:?}"
    );
    let gpu_history = replays(&client, &gpu_session).await;
    let plain_history = replays(&client, &plain_session).await;
    let pools = |history: &[EventEnvelope]| -> Vec<ToolResultContent> {
        tool_results(history).into_iter().map(|r| r.2).collect()
    };
    assert_eq!(
        pools(&gpu_history),
        vec![ToolResultContent::Text("gpu".into()); 2],
        "the gpu session's tools ran on the gpu pool"
    );
    assert_eq!(
        pools(&plain_history),
        vec![ToolResultContent::Text("default".into()); 2],
        "the plain session's tools ran on the default pool"
    );
}

#[tokio::test]
async fn retries_stop_at_the_schedule_to_close_deadline() {
    let always_down: ModelStep = Box::new(|_, _| {
        Err(ActivityError::Provider {
            kind: ErrorKind::Overloaded,
            message: "529 overloaded".into(),
        })
    });
    let host = host_with(
        FnModel::new(vec![always_down]),
        ToolRegistry::new(),
        Arc::new(SystemClock),
    );
    let mut o = options(&host.tools, "deadline");
    o.model_retry.maximum_attempts = 0; // unlimited: only the deadline stops it
    o.model_retry.initial_interval_ms = 20;
    o.model_retry.backoff_coefficient = 1.0;
    o.model_retry.maximum_interval_ms = 20;
    o.model_retry.schedule_to_close_timeout_ms = Some(200);
    let session = host.client.start_session(o).await.unwrap();
    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        host.client.run_turn(&session, "go"),
    )
    .await
    .unwrap()
    .unwrap();
    let TurnOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(reason.contains("schedule-to-close deadline"), "{reason}");
    let history = replays(&host.client, &session).await;
    let attempts = history
        .iter()
        .filter(|e| e.kind == "model_call_failed")
        .count();
    assert!((2..=20).contains(&attempts), "{attempts} attempts");
    host.shutdown().await;
}

#[tokio::test]
async fn model_failures_record_how_far_the_call_got_and_the_usage_of_failed_attempts() {
    let before_stream: ModelStep = Box::new(|_, _| {
        Err(ActivityError::Provider {
            kind: ErrorKind::Transient,
            message: "connection refused".into(),
        })
    });
    let attempts = Arc::new(AtomicU32::new(0));
    let counter = attempts.clone();
    // Attempt 1: nothing streamed. Attempt 2: streams, then breaks. Attempt 3: a complete
    // response that fails validation (ends on thinking). Attempt 4: fine.
    let flaky: ModelStep = Box::new(move |request, deltas| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        assert_eq!(request.context.attempt, n);
        match n {
            1 => before_stream(request, deltas),
            2 => {
                deltas.delta(Delta::Text("partial ".into()));
                Err(ActivityError::Provider {
                    kind: ErrorKind::Transient,
                    message: "stream ended early".into(),
                })
            }
            3 => Ok(response(vec![
                Part::text("x"),
                Part::Thinking {
                    text: "t".into(),
                    signature: "s".into(),
                },
            ])),
            _ => Ok(response(vec![Part::text("finally")])),
        }
    });
    let host = host_with(
        FnModel::new(vec![flaky]),
        ToolRegistry::new(),
        Arc::new(SystemClock),
    );
    let mut o = options(&host.tools, "phases");
    o.model_retry.maximum_attempts = 5;
    let session = host.client.start_session(o).await.unwrap();
    let outcome = host.client.run_turn(&session, "go").await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "finally"),
        "{outcome:?}"
    );
    let history = replays(&host.client, &session).await;
    let failures: Vec<ActivityFailure> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelCallFailed { failure, .. } => Some(failure.clone()),
            _ => None,
        })
        .collect();
    let phases: Vec<_> = failures.iter().map(|f| f.phase).collect();
    assert_eq!(
        phases,
        [
            Some(FailurePhase::BeforeStream),
            Some(FailurePhase::Streaming),
            Some(FailurePhase::Validation)
        ]
    );
    assert_eq!(failures[2].class, ErrorClass::InvalidResponse);
    // Exactly one response committed for the slot; usage counts the invalid attempt too.
    assert_eq!(
        history
            .iter()
            .filter(|e| e.kind == "model_call_completed")
            .count(),
        1
    );
    let Some(Event::TurnCompleted { usage, .. }) = history.last().map(|e| &e.event) else {
        panic!()
    };
    assert_eq!(usage.input_tokens, 6);
    host.shutdown().await;
}

/// Overdue tasks the timers cannot record (here, of a session with no history) stay first in
/// line; they must not keep the timers from the ones behind them.
#[tokio::test]
async fn overdue_tasks_that_cannot_fire_do_not_starve_the_others() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), clock.clone());
    let client = Client::new(engine.clone());
    // 300 tasks of a session that does not exist, overdue since long before the real one.
    let mut orphans = AppendRequest::new("ghost", 1, Vec::new(), SessionStatus::Running, 0);
    for seq in 1..=300 {
        let mut task = NewTask::new(
            TaskId {
                session_id: "ghost".into(),
                scheduled_seq: seq,
            },
            TaskKind::Tool,
            0,
        );
        task.start_by_ms = Some(1);
        orphans.enqueue.push(task);
    }
    store.append(orphans).await.unwrap();
    let mut o = options(&ToolRegistry::new(), "waiting");
    o.model_retry.maximum_attempts = 1;
    o.model_retry.schedule_to_start_timeout_ms = Some(10);
    let session = client.start_session(o).await.unwrap();
    let turn = client.send(&session, "anyone?").await.unwrap();
    clock.advance(100);
    // The first round spends itself on orphans; the next asks past them.
    assert_eq!(engine.fire_timers().await.unwrap(), 0);
    assert_eq!(engine.fire_timers().await.unwrap(), 1);
    let outcome = client.wait_turn(&session, turn).await.unwrap();
    let TurnOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(reason.contains("schedule-to-start"), "{reason}");
    replays(&client, &session).await;
}

/// A tool that heartbeats every 20 ms for 600 ms, recording when it did.
struct Steady {
    beats: Arc<Mutex<Vec<std::time::Instant>>>,
}

#[async_trait]
impl Tool for Steady {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: "steady".into(),
            description: "heartbeats as it works".into(),
            input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
        }
    }
    async fn call(
        &self,
        _call: &ToolCall,
        context: &ActivityContext,
    ) -> cairn_activities::Result<ToolOutput> {
        for _ in 0..30 {
            self.beats.lock().unwrap().push(std::time::Instant::now());
            context.heartbeat(None);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(ToolOutput::text("worked"))
    }
}

/// A task source whose first lease renewal takes `stall` (a server restarting, a connection
/// gone dead), over an engine in this process.
struct SlowFirstRenewal {
    inner: cairn_workers::EngineSource,
    stall: Duration,
    renewals: AtomicU32,
}

#[async_trait]
impl cairn_workers::TaskSource for SlowFirstRenewal {
    async fn lease(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        wait: Duration,
    ) -> Result<Vec<LeasedTask>, cairn_runtime::Error> {
        self.inner.lease(filter, max, lease_ms, wait).await
    }
    async fn heartbeat(
        &self,
        lease: &Lease,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64, cairn_runtime::Error> {
        if self.renewals.fetch_add(1, Ordering::SeqCst) == 0 {
            tokio::time::sleep(self.stall).await;
        }
        self.inner.heartbeat(lease, lease_ms, details).await
    }
    async fn record_progress(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
    ) -> Result<(), cairn_runtime::Error> {
        self.inner
            .record_progress(lease, text_appended, thinking_appended)
            .await
    }
    async fn report(
        &self,
        lease: &Lease,
        report: ActivityReport,
    ) -> Result<(), cairn_runtime::Error> {
        self.inner.report(lease, report).await
    }
    fn publish_delta(&self, delta: DeltaEvent) {
        self.inner.publish_delta(delta)
    }
    fn cancellations(&self) -> Option<tokio::sync::broadcast::Receiver<String>> {
        self.inner.cancellations()
    }
    fn now_ms(&self) -> u64 {
        self.inner.now_ms()
    }
}

/// A lease renewal that takes long does not stop the activity meanwhile: it goes on working
/// and heartbeating, and its heartbeat timeout does not fire. (Before, the pool awaited the
/// renewal in place of the activity, which stood still for the whole stall and could then be
/// failed as a missed heartbeat.)
#[tokio::test]
async fn a_slow_lease_renewal_does_not_pause_the_activity() {
    let beats = Arc::new(Mutex::new(Vec::new()));
    let tools = Arc::new(ToolRegistry::new().with(Steady {
        beats: beats.clone(),
    }));
    let model = FnModel::new(vec![call_tool("s1", "steady"), answer("finished")]);
    let engine = Engine::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock));
    let source = SlowFirstRenewal {
        inner: cairn_workers::EngineSource::new(engine.clone()),
        stall: Duration::from_millis(400),
        renewals: AtomicU32::new(0),
    };
    let pool = WorkerPool::start_with(
        Arc::new(source),
        Activities {
            models: Arc::new(Fixed(model)),
            tools: tools.clone(),
        },
        WorkerConfig {
            renew_interval_ms: Some(50),
            ..workers()
        },
    );
    let client = Client::new(engine);
    let mut o = options(&tools, "slow-renewal");
    o.tool_retry.heartbeat_timeout_ms = Some(200);
    let session = client.start_session(o).await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.run_turn(&session, "go"))
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    let beats = beats.lock().unwrap().clone();
    assert_eq!(
        beats.len(),
        30,
        "one attempt, never failed for a missed heartbeat"
    );
    let longest = beats.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(
        longest < Duration::from_millis(200),
        "the activity stood still for {longest:?} while its lease was being renewed"
    );
    let history = replays(&client, &session).await;
    assert!(!history
        .iter()
        .any(|e| matches!(e.event, Event::ToolCallFailed { .. })));
    pool.shutdown().await;
}

/// On a database that is unavailable for a while (`StoreUnavailable`, as PostgreSQL while it
/// restarts), a lease renewal that fails so is not a lost lease: while the lease holds, the
/// activity goes on and the renewal is tried again, and the turn completes on its first
/// attempt. (Before, the first such failure cancelled a healthy activity, whose result was
/// then never reported and whose task ran again once the lease lapsed.)
#[tokio::test]
async fn a_renewal_the_database_refuses_for_now_does_not_lose_the_lease() {
    let beats = Arc::new(Mutex::new(Vec::new()));
    let tools = Arc::new(ToolRegistry::new().with(Steady {
        beats: beats.clone(),
    }));
    let model = FnModel::new(vec![call_tool("s1", "steady"), answer("finished")]);
    let store = Arc::new(cairn_runtime::store::faulty::FaultyStore::new(
        MemoryStore::new(),
    ));
    store.fail_as_a_database();
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let pool = WorkerPool::start(
        engine.clone(),
        Activities {
            models: Arc::new(Fixed(model)),
            tools: tools.clone(),
        },
        WorkerConfig {
            renew_interval_ms: Some(50),
            lease_ms: 60_000,
            ..workers()
        },
    );
    let client = Client::new(engine);
    let session = client
        .start_session(options(&tools, "unavailable-renewal"))
        .await
        .unwrap();
    let turn = client.send(&session, "go").await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while beats.lock().unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the tool never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    store.fail_leases();
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.heal();
    assert!(
        store.injected_failures() >= 2,
        "lease writes (the pool's leasing and its renewals) were refused: {}",
        store.injected_failures()
    );
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.wait_turn(&session, turn))
        .await
        .expect("the activity went on and reported")
        .unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    assert_eq!(
        beats.lock().unwrap().len(),
        30,
        "one attempt, run to its end"
    );
    let history = replays(&client, &session).await;
    assert!(!history
        .iter()
        .any(|e| matches!(e.event, Event::ToolCallFailed { .. })));
    pool.shutdown().await;
}
