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
use cairn_workers::{Activities, ModelResolver, WorkerConfig};
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
    // No worker for 5 s.
    clock.advance(5_000);
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
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    let history = replays(&client, &session).await;
    let failed = history.iter().find_map(|e| match &e.event {
        Event::ModelCallFailed {
            attempt: 1,
            failure,
            ..
        } => Some(failure.clone()),
        _ => None,
    });
    let failed = failed.expect("attempt 1 timed out");
    assert_eq!(failed.class, ErrorClass::Timeout);
    assert!(
        failed.message.contains("schedule-to-start"),
        "{}",
        failed.message
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
