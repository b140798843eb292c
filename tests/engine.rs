//! The engine with real workers: every scenario runs live, then its recorded history is replayed
//! with the current code and must give the same ledger bytes.

use crate::support::{demo_files, fast_retries, TestHost};
use cairn_ledger::{validate_transcript, Part, ToolResultContent};
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::*;
use cairn_workers::{WorkerConfig, MAX_EXTRA_HANDED};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Replays the session's history and checks it folds to the engine's ledger, byte for byte.
async fn assert_replays(client: &Client, session: &str) -> Vec<EventEnvelope> {
    let history = client.history(session).await.unwrap();
    let replayed = replay(session, &history).unwrap();
    let live = client.transcript(session).await.unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        live.canonical_json(),
        "replay of {session} gives different ledger bytes"
    );
    validate_transcript(&live).unwrap();
    history
}

fn kinds(history: &[EventEnvelope]) -> Vec<&str> {
    history.iter().map(|e| e.kind.as_str()).collect()
}

/// These scenarios pin exact histories, and progress records depend on how fast a stream
/// runs, so they record none; `streamed_output_is_recorded_*` below covers them.
fn fast_workers() -> WorkerConfig {
    WorkerConfig {
        concurrency: 8,
        lease_ms: 2_000,
        poll_interval_ms: 5,
        progress_interval_ms: None,
        ..WorkerConfig::default()
    }
}

#[tokio::test]
async fn the_demo_turn_runs_on_the_memory_store_and_replays() {
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let host = TestHost::start(
        Arc::new(MemoryStore::new()),
        Arc::new(SystemClock),
        &files.workdir,
        fast_workers(),
    );
    let session = host
        .client
        .start_session(host.session_options(&files.script, "demo-mem"))
        .await
        .unwrap();
    let outcome = host.client.run_turn(&session, "go").await.unwrap();
    let TurnOutcome::Completed {
        turn: 1, answer, ..
    } = outcome
    else {
        panic!("{outcome:?}")
    };
    assert!(
        answer.contains("126") && answer.contains("Tuesday"),
        "{answer}"
    );
    let history = assert_replays(&host.client, &session).await;
    let k = kinds(&history);
    assert_eq!(
        &k[..5],
        [
            "session_started",
            "user_message",
            "model_call_scheduled",
            "model_call_completed",
            "tool_call_scheduled"
        ]
    );
    assert_eq!(k.iter().filter(|k| **k == "tool_call_completed").count(), 2);
    assert_eq!(k.last(), Some(&"turn_completed"));
    // The tool results made it into the ledger in declaration order with real values.
    let transcript = host.client.transcript(&session).await.unwrap();
    let results = &transcript.messages[3].parts;
    let Part::ToolResult(calc) = &results[0] else {
        panic!()
    };
    assert_eq!(calc.tool_use_id, "toolu_demo_01");
    assert!(matches!(&calc.content, ToolResultContent::Json(j) if j.as_str().contains("126")));
    let Part::ToolResult(notes) = &results[1] else {
        panic!()
    };
    assert!(matches!(&notes.content, ToolResultContent::Text(t) if t.contains("Tuesday")));
    host.shutdown().await;
}

#[tokio::test]
async fn sessions_on_sled_survive_reopen_and_fold_to_the_same_bytes() {
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let data = files.dir.path().join("store");
    let (session, bytes) = {
        let store = Arc::new(SledStore::open(&data).unwrap());
        let host = TestHost::start(store, Arc::new(SystemClock), &files.workdir, fast_workers());
        let mut ids = Vec::new();
        for i in 0..8 {
            let id = host
                .client
                .start_session(host.session_options(&files.script, &format!("sled-{i}")))
                .await
                .unwrap();
            ids.push(id);
        }
        // Turns of many sessions in parallel.
        let mut turns = Vec::new();
        for id in &ids {
            let client = host.client.clone();
            let id = id.clone();
            turns.push(tokio::spawn(
                async move { client.run_turn(&id, "go").await },
            ));
        }
        for t in turns {
            assert!(matches!(
                t.await.unwrap().unwrap(),
                TurnOutcome::Completed { .. }
            ));
        }
        for id in &ids {
            assert_replays(&host.client, id).await;
        }
        let bytes = host
            .client
            .transcript(&ids[3])
            .await
            .unwrap()
            .canonical_json();
        host.shutdown().await;
        (ids[3].clone(), bytes)
    };
    let store = Arc::new(crate::support::reopen_sled(&data).await);
    let sessions = store.list_sessions().await.unwrap();
    assert_eq!(sessions.len(), 8);
    assert!(sessions
        .iter()
        .all(|s| s.status == SessionStatus::Idle && s.events == 11));
    let engine = Engine::new(store, Arc::new(SystemClock));
    let reopened = engine.state(&session).await.unwrap();
    assert_eq!(reopened.transcript.canonical_json(), bytes);
}

const FLAKY_SCRIPT: &str = r#"{
  "responses": [
    {"parts": [{"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "1/0"}},
               {"type": "tool_use", "id": "t2", "name": "no_such_tool", "input": {}},
               {"type": "tool_use", "id": "t3", "name": "calculator", "arguments": "{\"expression\": 5}"}],
     "fail_attempts": 2},
    {"parts": [{"type": "text", "text": "recovered"}]}
  ]
}"#;

#[tokio::test]
async fn model_retries_and_tool_errors_are_recorded_and_the_model_sees_them() {
    let files = demo_files(FLAKY_SCRIPT);
    let host = TestHost::start(
        Arc::new(MemoryStore::new()),
        Arc::new(SystemClock),
        &files.workdir,
        fast_workers(),
    );
    let mut options = host.session_options(&files.script, "flaky");
    fast_retries(&mut options);
    let session = host.client.start_session(options).await.unwrap();
    let outcome = host.client.run_turn(&session, "go").await.unwrap();
    assert!(
        matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "recovered"),
        "{outcome:?}"
    );
    let history = assert_replays(&host.client, &session).await;
    let failures: Vec<u32> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelCallFailed {
                attempt, failure, ..
            } => {
                assert_eq!(failure.class, ErrorClass::Transient);
                Some(*attempt)
            }
            _ => None,
        })
        .collect();
    assert_eq!(failures, [1, 2]);
    let transcript = host.client.transcript(&session).await.unwrap();
    let results: Vec<_> = transcript.messages[3]
        .parts
        .iter()
        .map(|p| match p {
            Part::ToolResult(r) => (
                r.tool_use_id.clone(),
                r.is_error,
                r.content.canonical_json(),
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(results.len(), 3);
    // Division by zero: the tool's own is_error result.
    assert!(
        results[0].1 && results[0].2.contains("zero"),
        "{:?}",
        results[0]
    );
    // Unknown tool: answered at once, never scheduled.
    assert!(
        results[1].1 && results[1].2.contains("unknown tool"),
        "{:?}",
        results[1]
    );
    // Invalid arguments: non-retryable, one attempt, then an is_error result.
    assert!(
        results[2].1
            && results[2]
                .2
                .contains("tool failed after 1 attempt(s): invalid_request"),
        "{:?}",
        results[2]
    );
    assert!(!history.iter().any(
        |e| matches!(&e.event, Event::ToolCallScheduled { tool_use_id, .. } if tool_use_id == "t2")
    ));
    host.shutdown().await;
}

/// A final text answer, as a scripted model gives it.
fn text_answer(text: &str) -> cairn_ledger::ModelResponse {
    cairn_ledger::ModelResponse {
        provider: "scripted".into(),
        model: "test".into(),
        parts: vec![Part::text(text)],
        stop_reason_raw: "end_turn".into(),
        stop_reason: cairn_ledger::StopReason::EndTurn,
        usage: cairn_ledger::Usage::default(),
    }
}

/// A worker leases the model task and dies. Its lease lapses and the same attempt is never
/// leased again: the engine's timers record it as a failed attempt (timeout) and the retry
/// policy schedules attempt 2, which a live worker runs. The dead worker's late report is
/// fenced off — `LeaseLost` while its attempt is still awaited, `StaleReport` once it was
/// recorded as failed — and changes nothing.
#[tokio::test]
async fn an_expired_lease_runs_again_and_the_stale_completion_is_rejected() {
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), clock.clone());
    let client = Client::new(engine.clone());
    let probe = TestHost {
        client: client.clone(),
        pool: None,
        tools: Arc::new(cairn_activities::ToolRegistry::builtin(&files.workdir)),
    };
    let session = client
        .start_session(probe.session_options(&files.script, "lease"))
        .await
        .unwrap();
    client.send(&session, "go").await.unwrap();
    let any = TaskFilter::any();
    // A worker leases the model task and dies.
    let dead = engine.lease_tasks(&any, 10, 1_000).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].lease.lease_attempt, 1);
    assert!(matches!(
        dead[0].input,
        ActivityInput::Model { ref origin, .. } if origin.attempt == 1
    ));
    let dead = dead[0].lease.clone();
    // Nothing to lease while the lease holds, and nothing once it lapsed.
    assert!(engine
        .lease_tasks(&any, 10, 1_000)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(engine.fire_timers().await.unwrap(), 0, "nothing is due yet");
    clock.advance(1_001);
    assert!(
        engine
            .lease_tasks(&any, 10, 1_000)
            .await
            .unwrap()
            .is_empty(),
        "a lapsed lease is not leased again"
    );
    // The dead worker comes back before the timers fired: its lease lapsed.
    let before = client.history(&session).await.unwrap();
    let err = engine
        .report(&dead, ActivityReport::ModelCompleted(text_answer("late")))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err}");
    assert_eq!(client.history(&session).await.unwrap(), before);

    assert_eq!(engine.fire_timers().await.unwrap(), 1);
    assert_eq!(engine.fire_timers().await.unwrap(), 0, "a timer fires once");
    let history = client.history(&session).await.unwrap();
    let now = clock.now_ms();
    match &history[before.len()..] {
        [failed, scheduled] => {
            let Event::ModelCallFailed {
                turn: 1,
                round: 0,
                attempt: 1,
                failure,
                ..
            } = &failed.event
            else {
                panic!("{failed:?}")
            };
            assert_eq!(failure.class, ErrorClass::Timeout);
            assert!(
                failure.message.contains("lease lapsed"),
                "{}",
                failure.message
            );
            assert_eq!(failure.heartbeat_details, None, "it never heartbeated");
            assert!(
                matches!(
                    scheduled.event,
                    Event::ModelCallScheduled { turn: 1, round: 0, attempt: 2, not_before_ms }
                        if not_before_ms == now + 1_000
                ),
                "{scheduled:?}"
            );
        }
        other => panic!("the timer records the failure and schedules the retry: {other:?}"),
    }
    assert_eq!(
        store.list_tasks().await.unwrap().len(),
        1,
        "the lapsed task is dropped; the retry's is queued"
    );
    clock.advance(1_000);
    let pool = cairn_workers::WorkerPool::start(
        engine.clone(),
        cairn_workers::Activities {
            models: Arc::new(cairn_workers::StandardModels::new()),
            tools: probe.tools.clone(),
        },
        WorkerConfig {
            lease_ms: 60_000,
            ..fast_workers()
        },
    );
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.wait_turn(&session, 1))
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(outcome, TurnOutcome::Completed { .. }));
    pool.shutdown().await;
    let before = client.history(&session).await.unwrap();
    let completions: Vec<u32> = before
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelCallCompleted {
                round: 0, attempt, ..
            } => Some(*attempt),
            _ => None,
        })
        .collect();
    assert_eq!(
        completions,
        [2],
        "the first call is answered once, by attempt 2"
    );
    // The dead worker comes back again: its attempt is over.
    let err = engine
        .report(&dead, ActivityReport::ModelCompleted(text_answer("late")))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::StaleReport { .. }), "{err}");
    assert_eq!(client.history(&session).await.unwrap(), before);
    assert_replays(&client, &session).await;
}

#[tokio::test]
async fn a_new_engine_resumes_an_interrupted_turn_from_the_log() {
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let data = files.dir.path().join("store");
    let gone = {
        // An engine accepts the message, then goes away before any worker ran.
        let store = Arc::new(SledStore::open(&data).unwrap());
        let gone = Arc::downgrade(&store);
        let engine = Engine::new(store, Arc::new(SystemClock));
        let client = Client::new(engine);
        let probe = TestHost {
            client: client.clone(),
            pool: None,
            tools: Arc::new(cairn_activities::ToolRegistry::builtin(&files.workdir)),
        };
        let session = client
            .start_session(probe.session_options(&files.script, "resume-me"))
            .await
            .unwrap();
        client.send(&session, "go").await.unwrap();
        gone
    };
    // Tasks the engine spawned may hold it a moment longer; sled's lock goes with the last one.
    let deadline = Instant::now() + Duration::from_secs(10);
    while gone.upgrade().is_some() {
        assert!(
            Instant::now() < deadline,
            "the first engine's store was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let store = Arc::new(crate::support::reopen_sled(&data).await);
    let host = TestHost::start(store, Arc::new(SystemClock), &files.workdir, fast_workers());
    let report = host
        .client
        .engine()
        .expect("in-process")
        .resume(false)
        .await
        .unwrap();
    assert_eq!(report.running_sessions, ["resume-me"]);
    assert_eq!(report.outstanding_tasks, 1);
    assert_eq!(
        report.requeued_tasks, 0,
        "the task was written with its event"
    );
    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        host.client.wait_turn("resume-me", 1),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(matches!(outcome, TurnOutcome::Completed { .. }));
    assert_replays(&host.client, "resume-me").await;
    host.shutdown().await;
}

const SLOW_SCRIPT: &str = r#"{
  "responses": [
    {"parts": [{"type": "text", "text": "slow answer"}], "delay_ms": 300}
  ]
}"#;

#[tokio::test]
async fn shutdown_drains_running_activities() {
    let files = demo_files(SLOW_SCRIPT);
    let host = TestHost::start(
        Arc::new(MemoryStore::new()),
        Arc::new(SystemClock),
        &files.workdir,
        fast_workers(),
    );
    let session = host
        .client
        .start_session(host.session_options(&files.script, "drain"))
        .await
        .unwrap();
    host.client.send(&session, "go").await.unwrap();
    // Wait until the model task is leased (no longer visible), then shut down mid-call.
    for _ in 0..200 {
        let tasks = host
            .client
            .engine()
            .expect("in-process")
            .store()
            .list_tasks()
            .await
            .unwrap();
        if tasks.iter().any(|t| t.lease_attempt > 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let client = host.client.clone();
    host.shutdown().await;
    let history = client.history(&session).await.unwrap();
    assert_eq!(
        kinds(&history).last(),
        Some(&"turn_completed"),
        "{:?}",
        kinds(&history)
    );
    assert!(client
        .engine()
        .expect("in-process")
        .store()
        .list_tasks()
        .await
        .unwrap()
        .is_empty());
}

/// What a model attempt streamed is recorded as `model_attempt_progress` through the engine:
/// per run (lease) of the attempt, each record carrying only new text. The records change no
/// ledger byte and no decision; output of a stale lease or for a call nobody waits for is
/// rejected and changes nothing.
#[tokio::test]
async fn streamed_output_is_recorded_presentation_only_and_stale_output_is_rejected() {
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let answer = text_answer("Hello, world.");
    // The same turn twice, each on its own store and frozen clock: with progress records, and
    // without.
    let mut sessions = Vec::new();
    for with_progress in [true, false] {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = Arc::new(MemoryStore::new());
        let engine = Engine::new(store.clone(), clock.clone());
        let client = Client::new(engine.clone());
        let probe = TestHost {
            client: client.clone(),
            pool: None,
            tools: Arc::new(cairn_activities::ToolRegistry::builtin(&files.workdir)),
        };
        let id = "greeting";
        let session = client
            .start_session(probe.session_options(&files.script, id))
            .await
            .unwrap();
        client.send(&session, "greet me").await.unwrap();
        let first = store
            .lease_tasks(
                clock.now_ms(),
                1_000,
                1,
                &cairn_runtime::TaskFilter::default(),
            )
            .await
            .unwrap();
        assert_eq!(first.len(), 1);
        if with_progress {
            engine
                .record_progress(&first[0], "Hel".into(), "a greeting".into())
                .await
                .unwrap();
            engine
                .record_progress(&first[0], "lo,".into(), String::new())
                .await
                .unwrap();
        }
        // The first worker dies; its lease lapses, the timers record attempt 1 as failed, and
        // attempt 2 (a new task) streams afresh after its backoff.
        clock.advance(1_001);
        assert_eq!(engine.fire_timers().await.unwrap(), 1);
        if with_progress {
            let state = engine.state(&session).await.unwrap();
            let history = client.history(&session).await.unwrap();
            let cut = interrupted_output(&state, &history).unwrap();
            assert_eq!(
                (cut.attempt, cut.lease_attempt, cut.text.as_str()),
                (1, 1, "Hello,"),
                "what the lapsed attempt showed is what its retry replaces"
            );
        }
        clock.advance(1_000);
        let second = store
            .lease_tasks(
                clock.now_ms(),
                1_000,
                1,
                &cairn_runtime::TaskFilter::default(),
            )
            .await
            .unwrap();
        assert_eq!(second.len(), 1);
        assert_ne!(second[0].id, first[0].id, "the retry is a new task");
        assert_eq!(second[0].lease_attempt, 1);
        if with_progress {
            engine
                .record_progress(&second[0], "Hello".into(), String::new())
                .await
                .unwrap();
            let state = engine.state(&session).await.unwrap();
            let history = client.history(&session).await.unwrap();
            let cut = interrupted_output(&state, &history).unwrap();
            assert_eq!(
                (cut.attempt, cut.lease_attempt, cut.text.as_str()),
                (2, 1, "Hello")
            );
            let runs = streamed_outputs(&history, 1, 0);
            assert_eq!(
                runs.iter()
                    .map(|r| (
                        r.attempt,
                        r.lease_attempt,
                        r.text.as_str(),
                        r.thinking.as_str()
                    ))
                    .collect::<Vec<_>>(),
                [(1, 1, "Hello,", "a greeting"), (2, 1, "Hello", "")]
            );
            // The dead worker's late output: stale, its attempt is over.
            let err = engine
                .record_progress(&first[0], " late".into(), String::new())
                .await
                .unwrap_err();
            assert!(err.is_stale_report(), "{err}");
            assert_eq!(client.history(&session).await.unwrap(), history);
        }
        engine
            .report(&second[0], ActivityReport::ModelCompleted(answer.clone()))
            .await
            .unwrap();
        // Nothing waits for output now.
        let history = client.history(&session).await.unwrap();
        let err = engine
            .record_progress(&second[0], "!".into(), String::new())
            .await
            .unwrap_err();
        assert!(err.is_stale_report(), "{err}");
        assert_eq!(client.history(&session).await.unwrap(), history);
        assert!(interrupted_output(&engine.state(&session).await.unwrap(), &history).is_none());
        let history = assert_replays(&client, &session).await;
        sessions.push((history, client.transcript(&session).await.unwrap()));
    }
    let (noted, noted_ledger) = &sessions[0];
    let (plain, plain_ledger) = &sessions[1];
    assert_eq!(
        noted
            .iter()
            .filter(|e| e.kind == "model_attempt_progress")
            .count(),
        3
    );
    assert_eq!(noted_ledger.canonical_json(), plain_ledger.canonical_json());
    let decided = |history: &[EventEnvelope]| -> Vec<Command> {
        replay(&history[0].session_id, history)
            .unwrap()
            .commands
            .into_iter()
            .map(|(_, c)| c)
            .collect()
    };
    assert_eq!(decided(noted), decided(plain));
    let without: Vec<&Event> = noted
        .iter()
        .filter(|e| e.kind != "model_attempt_progress")
        .map(|e| &e.event)
        .collect();
    assert_eq!(without, plain.iter().map(|e| &e.event).collect::<Vec<_>>());
}

/// Real workers record a streaming attempt's output at most every `progress_interval_ms`;
/// the records hold each streamed byte once, in order, the lease is renewed meanwhile (one
/// run, one lease), and the ledger is what a run without records gives.
#[tokio::test]
async fn streamed_output_is_recorded_by_workers_at_most_every_interval() {
    let words: Vec<String> = (0..30).map(|i| format!("word{i} ")).collect();
    let answer = words.concat().trim_end().to_owned();
    let files = demo_files(&format!(
        r#"{{"chunk_delay_ms": 20, "responses": [{{"parts": [{{"type": "text", "text": "{answer}"}}]}}]}}"#
    ));
    let mut ledgers = Vec::new();
    let mut kinds_seen = Vec::new();
    for progress in [Some(50), None] {
        let host = TestHost::start(
            Arc::new(MemoryStore::new()),
            Arc::new(SystemClock),
            &files.workdir,
            WorkerConfig {
                progress_interval_ms: progress,
                // Renewed every 100 ms: a ~600 ms stream outlives the lease unless renewed.
                lease_ms: 300,
                ..fast_workers()
            },
        );
        let session = host
            .client
            .start_session(host.session_options(&files.script, "streamed"))
            .await
            .unwrap();
        let started = std::time::Instant::now();
        // A lease that is not renewed while the stream runs lapses, and the call runs again
        // and again: a timeout, not a hang.
        let outcome = tokio::time::timeout(
            Duration::from_secs(20),
            host.client.run_turn(&session, "talk"),
        )
        .await
        .expect("the turn completes: the lease is renewed while the stream runs")
        .unwrap();
        let elapsed_ms = started.elapsed().as_millis() as usize;
        assert!(
            matches!(outcome, TurnOutcome::Completed { .. }),
            "{outcome:?}"
        );
        let history = assert_replays(&host.client, &session).await;
        let runs = streamed_outputs(&history, 1, 0);
        match progress {
            Some(every) => {
                assert_eq!(runs.len(), 1, "one run under one lease: {runs:?}");
                assert_eq!(runs[0].lease_attempt, 1);
                // ~600 ms of streaming: several records, never more than one per interval.
                let count = runs[0].records;
                assert!(
                    count >= 2 && count <= elapsed_ms / every as usize + 1,
                    "{count} records in {elapsed_ms} ms"
                );
                // Each byte once, in stream order: a prefix of the answer (the rest is in the
                // committed response, which supersedes the records).
                assert!(
                    answer.starts_with(&runs[0].text) && runs[0].text.len() > 10,
                    "{:?}",
                    runs[0].text
                );
            }
            None => assert!(runs.is_empty()),
        }
        ledgers.push(
            host.client
                .transcript(&session)
                .await
                .unwrap()
                .canonical_json(),
        );
        kinds_seen.push(
            history
                .iter()
                .map(|e| e.kind.clone())
                .filter(|k| k != "model_attempt_progress")
                .collect::<Vec<_>>(),
        );
        host.shutdown().await;
    }
    assert_eq!(ledgers[0], ledgers[1]);
    assert_eq!(kinds_seen[0], kinds_seen[1]);
}

/// Eager dispatch: a report that queues tasks hands one to the worker that reported, with
/// the report's durable append; the other stays queued for any worker. A whole turn runs so
/// (model → two tools → model), and replays to the same ledger bytes.
#[tokio::test]
async fn a_report_hands_the_next_task_to_the_worker_that_reported() {
    use cairn_runtime::store::fjall::FjallStore;
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FjallStore::open(dir.path()).unwrap());
    let engine = Engine::new(store.clone(), Arc::new(ManualClock::new(1_000)));
    let client = Client::new(engine.clone());
    let tools = cairn_activities::ToolRegistry::builtin(".").specs();
    let options = SessionOptions::new(cairn_ledger::ModelSpec::new("scripted", "test"), tools);
    let (session, _) = client.start_session_and_send(options, "go").await.unwrap();
    let next = LeaseRequest {
        filter: Arc::new(TaskFilter::any()),
        max: 1,
        lease_ms: 60_000,
        holder: LeaseHolder::InProcess,
    };
    let mut leased = engine
        .lease_tasks_for(LeaseHolder::InProcess, &TaskFilter::any(), 10, 60_000)
        .await
        .unwrap();
    assert_eq!(leased.len(), 1, "the model call");
    let calls = |ids: [&str; 2]| {
        let mut response = text_answer("");
        response.parts = ids
            .iter()
            .map(|id| {
                Part::ToolUse(cairn_ledger::ToolUse {
                    id: (*id).to_owned(),
                    name: "calculator".to_owned(),
                    arguments: r#"{"expression":"6*7"}"#.to_owned(),
                    signature: None,
                })
            })
            .collect();
        response.stop_reason_raw = "tool_use".into();
        response.stop_reason = cairn_ledger::StopReason::ToolUse;
        response
    };
    let model = leased.remove(0);
    let mut handed = engine
        .report_and_lease(
            &model.lease,
            ActivityReport::ModelCompleted(calls(["t1", "t2"])),
            &next,
        )
        .await
        .unwrap();
    assert_eq!(handed.len(), 1, "one task for the reporting worker");
    let first = handed.remove(0);
    let ActivityInput::Tool { tool_use, .. } = &first.input else {
        panic!("a tool call is handed on, got {:?}", first.input);
    };
    assert_eq!(tool_use.id, "t1");
    let states: Vec<_> = store
        .list_tasks()
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.lease_attempt, t.held))
        .collect();
    assert_eq!(
        states,
        [(1, true), (0, false)],
        "the other tool call stays queued"
    );
    let result = || ActivityReport::ToolCompleted {
        content: ToolResultContent::Text("42".to_owned()),
        is_error: false,
    };
    let mut handed = engine
        .report_and_lease(&first.lease, result(), &next)
        .await
        .unwrap();
    let second = handed.remove(0);
    assert!(
        matches!(&second.input, ActivityInput::Tool { tool_use, .. } if tool_use.id == "t2"),
        "the report hands on the task still queued"
    );
    let mut handed = engine
        .report_and_lease(&second.lease, result(), &next)
        .await
        .unwrap();
    let last = handed.remove(0);
    assert!(
        matches!(last.input, ActivityInput::Model { .. }),
        "the last result hands on the next model call"
    );
    let handed = engine
        .report_and_lease(
            &last.lease,
            ActivityReport::ModelCompleted(text_answer("42, twice")),
            &next,
        )
        .await
        .unwrap();
    assert!(handed.is_empty(), "the turn is over: nothing to hand on");
    assert!(store.list_tasks().await.unwrap().is_empty());
    match client.wait_turn(&session, 1).await.unwrap() {
        TurnOutcome::Completed { answer, .. } => assert_eq!(answer, "42, twice"),
        other => panic!("the turn completes, got {other:?}"),
    }
    assert_replays(&client, &session).await;
}

/// The in-process source, counting what the pool asks of it: the lease requests that
/// brought tasks, and what each report asked for and was handed (eager dispatch).
struct CountingSource {
    inner: cairn_workers::EngineSource,
    /// The `max` of each lease request.
    lease_asks: std::sync::Mutex<Vec<usize>>,
    leases_with_tasks: std::sync::atomic::AtomicUsize,
    /// Per report: the `max` it asked for and the tasks it was handed.
    reports: std::sync::Mutex<Vec<(usize, usize)>>,
    /// Per report of several attempts at once, how many.
    together: std::sync::Mutex<Vec<usize>>,
    /// Tasks appends gave the pool's receiver while its lease waited.
    received: Arc<std::sync::atomic::AtomicUsize>,
}

/// Counts what the pool's receiver takes.
struct CountingReceiver {
    inner: Arc<dyn TaskReceiver>,
    received: Arc<std::sync::atomic::AtomicUsize>,
}

impl TaskReceiver for CountingReceiver {
    fn receive(&self, tasks: Vec<LeasedTask>) -> Vec<LeasedTask> {
        let given = tasks.len();
        let left = self.inner.receive(tasks);
        self.received
            .fetch_add(given - left.len(), std::sync::atomic::Ordering::SeqCst);
        left
    }
}

#[async_trait::async_trait]
impl cairn_workers::TaskSource for CountingSource {
    async fn lease(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        wait: Duration,
    ) -> Result<Vec<LeasedTask>> {
        self.lease_asks.lock().unwrap().push(max);
        let leased = self.inner.lease(filter, max, lease_ms, wait).await?;
        if !leased.is_empty() {
            self.leases_with_tasks
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(leased)
    }

    async fn lease_or_receive(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        wait: Duration,
        receiver: Arc<dyn TaskReceiver>,
    ) -> Result<Vec<LeasedTask>> {
        self.lease_asks.lock().unwrap().push(max);
        let receiver = Arc::new(CountingReceiver {
            inner: receiver,
            received: self.received.clone(),
        });
        let leased = self
            .inner
            .lease_or_receive(filter, max, lease_ms, wait, receiver)
            .await?;
        if !leased.is_empty() {
            self.leases_with_tasks
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(leased)
    }

    async fn heartbeat(
        &self,
        lease: &Lease,
        lease_ms: u64,
        details: Option<cairn_ledger::JsonText>,
    ) -> Result<u64> {
        self.inner.heartbeat(lease, lease_ms, details).await
    }

    async fn record_progress(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
    ) -> Result<()> {
        self.inner
            .record_progress(lease, text_appended, thinking_appended)
            .await
    }

    async fn report(&self, lease: &Lease, report: ActivityReport) -> Result<()> {
        self.inner.report(lease, report).await
    }

    async fn report_and_lease(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: &LeaseRequest,
    ) -> Result<Vec<LeasedTask>> {
        let handed = self.inner.report_and_lease(lease, report, next).await?;
        self.reports.lock().unwrap().push((next.max, handed.len()));
        Ok(handed)
    }

    async fn report_all_and_lease(
        &self,
        reports: Vec<(Lease, ActivityReport)>,
        next: &LeaseRequest,
    ) -> Vec<Result<Vec<LeasedTask>>> {
        self.together.lock().unwrap().push(reports.len());
        let answers = self.inner.report_all_and_lease(reports, next).await;
        let handed = answers
            .first()
            .map_or(0, |a| a.as_ref().map_or(0, Vec::len));
        self.reports.lock().unwrap().push((next.max, handed));
        answers
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

/// A model call, then two calculator calls at once, then the answer.
const TWO_TOOLS_SCRIPT: &str = r#"{
  "responses": [
    {"parts": [{"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "6*7"}},
               {"type": "tool_use", "id": "t2", "name": "calculator", "input": {"expression": "2+2"}}]},
    {"parts": [{"type": "text", "text": "42 and 4"}]}
  ]
}"#;

/// What [`two_tools_turn_on`] saw the pool ask of its source.
struct PoolAsks {
    /// Lease requests that brought tasks.
    leases: usize,
    /// The largest `max` a lease asked for.
    largest_ask: usize,
    /// Per report: the `max` it asked for and the tasks it was handed.
    reports: Vec<(usize, usize)>,
    /// Per report of several attempts at once, how many.
    together: Vec<usize>,
    /// Tasks appends gave the pool's receiver.
    received: usize,
}

/// [`two_tools_turn_on`] on the memory store.
async fn two_tools_turn(concurrency: usize) -> PoolAsks {
    two_tools_turn_on(Arc::new(MemoryStore::new()), concurrency).await
}

/// Runs one turn of [`TWO_TOOLS_SCRIPT`] on `store`, with a pool of `concurrency` slots over
/// a counting source, its message sent once the pool's lease waits idle; checks the turn's
/// answer, its tool results and its replay, and gives back what the pool asked.
async fn two_tools_turn_on(store: Arc<dyn Store>, concurrency: usize) -> PoolAsks {
    let files = demo_files(TWO_TOOLS_SCRIPT);
    let engine = Engine::new(store, Arc::new(SystemClock));
    let source = Arc::new(CountingSource {
        inner: cairn_workers::EngineSource::new(engine.clone()),
        lease_asks: Default::default(),
        leases_with_tasks: Default::default(),
        reports: Default::default(),
        together: Default::default(),
        received: Default::default(),
    });
    let tools = Arc::new(cairn_activities::ToolRegistry::builtin(&files.workdir));
    let pool = cairn_workers::WorkerPool::start_with(
        source.clone(),
        cairn_workers::Activities {
            models: Arc::new(cairn_workers::StandardModels::new()),
            tools: tools.clone(),
        },
        WorkerConfig {
            concurrency,
            // One long poll for the whole turn: with fast_workers' 5 ms one, the lease loop
            // gives its reservation back and leases again every 5 ms, and a report landing
            // in between finds three slots free instead of two (or an append, no lease
            // waiting), so the asks below would depend on timing.
            poll_interval_ms: 60_000,
            ..fast_workers()
        },
    );
    tokio::time::timeout(Duration::from_secs(10), async {
        while engine.idle_leases() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the pool's lease waits");
    let client = Client::new(engine);
    let model =
        cairn_ledger::ModelSpec::parse(&format!("scripted:{}", files.script.display())).unwrap();
    let mut options = SessionOptions::new(model, tools.specs());
    options.session_id = Some(format!("two-tools-{concurrency}"));
    let (session, turn) = client.start_session_and_send(options, "go").await.unwrap();
    let outcome = client.wait_turn(&session, turn).await.unwrap();
    assert!(
        matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "42 and 4"),
        "{outcome:?}"
    );
    pool.shutdown().await;
    let history = assert_replays(&client, &session).await;
    let results: Vec<_> = client
        .transcript(&session)
        .await
        .unwrap()
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .filter_map(|p| match p {
            Part::ToolResult(r) => Some((r.tool_use_id.clone(), format!("{:?}", r.content))),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        [
            (
                "t1".to_owned(),
                r#"Json(JsonText({"expression":"6*7","value":42}))"#.to_owned()
            ),
            (
                "t2".to_owned(),
                r#"Json(JsonText({"expression":"2+2","value":4}))"#.to_owned()
            ),
        ]
    );
    assert_eq!(
        kinds(&history)
            .iter()
            .filter(|k| **k == "tool_call_completed")
            .count(),
        2
    );
    let largest_ask = source.lease_asks.lock().unwrap().iter().copied().max();
    let reports = source.reports.lock().unwrap().clone();
    let together = source.together.lock().unwrap().clone();
    PoolAsks {
        together,
        leases: source
            .leases_with_tasks
            .load(std::sync::atomic::Ordering::SeqCst),
        largest_ask: largest_ask.unwrap_or(0),
        reports,
        received: source.received.load(std::sync::atomic::Ordering::SeqCst),
    }
}

/// What the model call's report asks for in an eight-slot pool, and is handed (both tool
/// calls): its slot's next task, and a task for each slot still free (those the lease loop
/// leaves free while it waits, [`MAX_EXTRA_HANDED`], but the one the model call took), up to
/// `MAX_EXTRA_HANDED`.
fn first_report_of_eight_slots() -> (usize, usize) {
    let held_by_the_lease_loop = (8 - MAX_EXTRA_HANDED).max(1);
    let free = 8 - held_by_the_lease_loop - 1;
    (1 + free.min(MAX_EXTRA_HANDED), 2)
}

/// Eager dispatch of parallel tool calls: the client's message gives the first model call
/// to a free slot of the waiting pool (its receiver), and that call's report, asking for
/// two tools, hands both to the pool, one to the slot that reported and one with a free
/// slot, so the turn has no lease request that returns a task. The calculator answers at
/// once, so the slot that reported runs the second call too, before its own slot would
/// have started it, and reports both results together. The lease loop leaves
/// `MAX_EXTRA_HANDED` slots free for such tasks while it waits, so a task it leases always
/// has a slot. With one slot, none is free: the lease loop is handed the first model call,
/// the report asks for one task, and the second tool call is handed on by the first one's
/// report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_calls_report_hands_both_its_parallel_tool_calls_to_free_slots() {
    let asks = two_tools_turn(8).await;
    assert_eq!(
        asks.received, 1,
        "the first model call, given to a free slot"
    );
    assert_eq!(
        asks.leases, 0,
        "no lease returns a task: {:?}",
        asks.reports
    );
    assert_eq!(
        asks.largest_ask,
        (8 - MAX_EXTRA_HANDED).max(1),
        "the lease loop leaves {MAX_EXTRA_HANDED} of eight slots free"
    );
    assert_eq!(
        asks.reports[0],
        first_report_of_eight_slots(),
        "the model call's report asks for its slot's next task and the slots still free, and is handed both tool calls"
    );
    // The tools' one report hands the next model call on; the model call's report at the
    // end hands nothing.
    assert_eq!(
        asks.together,
        [2],
        "both calls' results in one report: {:?}",
        asks.reports
    );
    assert_eq!(asks.reports.len(), 3, "{:?}", asks.reports);
    assert_eq!(
        asks.reports.iter().map(|(_, handed)| handed).sum::<usize>(),
        3
    );

    let asks = two_tools_turn(1).await;
    assert_eq!(asks.largest_ask, 1);
    assert_eq!(asks.received, 0, "no slot free to start it on");
    assert_eq!(
        asks.leases, 1,
        "the lease loop is handed the first model call"
    );
    assert_eq!(
        asks.reports[0],
        (1, 1),
        "with no slot free the report asks for one task: {:?}",
        asks.reports
    );
    assert!(asks.together.is_empty(), "each result in its own report");
    assert_eq!(
        asks.reports.iter().map(|(_, handed)| handed).sum::<usize>(),
        3
    );
}

/// The same on fjall, whose appends lease in the same write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_pool_starts_a_clients_first_task_given_with_the_append_on_fjall() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(cairn_runtime::store::fjall::FjallStore::open(dir.path()).unwrap());
    let asks = two_tools_turn_on(store, 8).await;
    assert_eq!(
        asks.received, 1,
        "the first model call, given to a free slot"
    );
    assert_eq!(
        asks.leases, 0,
        "no lease returns a task: {:?}",
        asks.reports
    );
    assert_eq!(
        asks.reports[0],
        first_report_of_eight_slots(),
        "both tool calls handed on"
    );
    assert_eq!(asks.together, [2], "both results in one report");
    assert_eq!(asks.reports.len(), 3, "{:?}", asks.reports);
}

/// A tool whose calls wait for one another: each returns only once `barrier`'s count of
/// calls are running at the same time.
struct Rendezvous {
    barrier: Arc<tokio::sync::Barrier>,
}

#[async_trait::async_trait]
impl cairn_activities::Tool for Rendezvous {
    fn spec(&self) -> cairn_ledger::ToolSpec {
        cairn_ledger::ToolSpec {
            name: "rendezvous".into(),
            description: "answers once its sibling calls run too".into(),
            input_schema: cairn_ledger::JsonText::parse(r#"{"type":"object"}"#).unwrap(),
        }
    }

    async fn call(
        &self,
        call: &cairn_activities::ToolCall,
        _context: &cairn_activities::ActivityContext,
    ) -> cairn_activities::Result<cairn_activities::ToolOutput> {
        self.barrier.wait().await;
        Ok(cairn_activities::ToolOutput::text(format!(
            "met {}",
            call.tool_use_id
        )))
    }
}

/// Parallel calls that wait run side by side: a slot runs the calls handed beside its own
/// in turn only while each answers at once, and gives them slots of their own as soon as
/// one waits. Two calls that each wait for the other would never finish in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_calls_that_wait_run_side_by_side() {
    let files = demo_files(
        r#"{
  "responses": [
    {"parts": [{"type": "tool_use", "id": "r1", "name": "rendezvous", "input": {}},
               {"type": "tool_use", "id": "r2", "name": "rendezvous", "input": {}}]},
    {"parts": [{"type": "text", "text": "both met"}]}
  ]
}"#,
    );
    let host = TestHost::start_with_activities(
        Arc::new(MemoryStore::new()),
        Arc::new(SystemClock),
        cairn_workers::Activities {
            models: Arc::new(cairn_workers::StandardModels::new()),
            tools: Arc::new(cairn_activities::ToolRegistry::new().with(Rendezvous {
                barrier: Arc::new(tokio::sync::Barrier::new(2)),
            })),
        },
        WorkerConfig {
            // Longer than the wait below: a call left unrun is not run again after its
            // lease lapses, which would hide that it was never started.
            lease_ms: 120_000,
            ..fast_workers()
        },
    );
    let options = host.session_options(&files.script, "side-by-side");
    let (session, turn) = host
        .client
        .start_session_and_send(options, "go")
        .await
        .unwrap();
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        host.client.wait_turn(&session, turn),
    )
    .await
    .expect("the two calls met: they ran side by side")
    .unwrap();
    assert!(
        matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "both met"),
        "{outcome:?}"
    );
    let history = assert_replays(&host.client, &session).await;
    host.shutdown().await;
    let results: Vec<_> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallCompleted { tool_use_id, .. } => Some(tool_use_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 2, "{:?}", kinds(&history));
    assert!(
        results.contains(&"r1") && results.contains(&"r2"),
        "{results:?}"
    );
}

/// The default pool is not what caps a process's concurrency: 150 sessions whose model call
/// takes five seconds all have theirs running at once (the pool had 64 slots, and held 128
/// sessions with 50 ms model calls to half their rate). Each turn completes and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_pool_runs_the_model_calls_of_150_sessions_at_once() {
    const SESSIONS: usize = 150;
    let files = demo_files(
        r#"{"responses": [{"delay_ms": 5000, "parts": [{"type": "text", "text": "done"}]}]}"#,
    );
    let host = TestHost::start(
        Arc::new(MemoryStore::new()),
        Arc::new(SystemClock),
        &files.workdir,
        WorkerConfig::default(),
    );
    let engine = host
        .client
        .engine()
        .expect("an engine in this process")
        .clone();
    let started = Instant::now();
    let mut turns = Vec::new();
    for i in 0..SESSIONS {
        let options = host.session_options(&files.script, &format!("wide-{i}"));
        turns.push(
            host.client
                .start_session_and_send(options, "go")
                .await
                .unwrap(),
        );
    }
    // Every call is leased long before the first one answers; the most held at once is
    // sampled until then.
    let mut most = 0;
    while most < SESSIONS && started.elapsed() < Duration::from_millis(4_500) {
        most = most.max(engine.leases_held_here().len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        most, SESSIONS,
        "model calls running at once under the default pool"
    );
    for (session, turn) in &turns {
        let outcome = host.client.wait_turn(session, *turn).await.unwrap();
        let TurnOutcome::Completed { answer, .. } = outcome else {
            panic!("{session}: {outcome:?}")
        };
        assert_eq!(answer, "done");
        assert_replays(&host.client, session).await;
    }
    host.shutdown().await;
}
