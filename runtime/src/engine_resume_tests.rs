//! Resume on a store where one running session's history does not fold: that session is
//! reported and left as it is, and every other running session is resumed; and the timers,
//! which try its overdue task every round, say so once.

use crate::client::{Client, SessionOptions};
use crate::engine::{ActivityReport, UnresumableSession};
use crate::error::{Error, Result};
use crate::event::{Event, EventEnvelope};
use crate::store::{AppendRequest, SessionStatus, Store, TaskFilter};
use crate::workflow::TurnOutcome;
use crate::{Engine, MemoryStore, SystemClock};
use cairn_ledger::{ModelResponse, ModelSpec, Part, StopReason, Usage};
use std::sync::Arc;

fn options(id: &str) -> SessionOptions {
    let mut options = SessionOptions::new(ModelSpec::new("scripted", "resume"), Vec::new());
    options.session_id = Some(id.to_owned());
    options
}

/// Appends `events` (none for a change of tasks only) after the session's last event.
async fn append_raw(
    store: &Arc<dyn Store>,
    session_id: &str,
    events: Vec<Event>,
    cancel: Vec<crate::store::TaskId>,
) -> Result<()> {
    let next_seq = store.read_history(session_id, 1, None).await?.len() as u64 + 1;
    let events = events
        .into_iter()
        .enumerate()
        .map(|(n, event)| EventEnvelope::new(session_id, next_seq + n as u64, 1, event))
        .collect();
    store
        .append(AppendRequest {
            cancel,
            ..AppendRequest::new(session_id, next_seq, events, SessionStatus::Running, 1)
        })
        .await
}

/// Records the end of turn 1 while its model call is outstanding, which no workflow does:
/// the session's history no longer folds.
async fn end_turn_under_its_model_call(store: &Arc<dyn Store>, session_id: &str) -> Result<()> {
    let turn_end = Event::TurnCompleted {
        turn: 1,
        usage: Usage::default(),
    };
    append_raw(store, session_id, vec![turn_end], Vec::new()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_that_does_not_fold_is_reported_and_the_other_sessions_resume() -> Result<()> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    {
        let first = Engine::new(store.clone(), Arc::new(SystemClock));
        let client = Client::new(first.clone());
        for id in ["broken", "good"] {
            client.start_session(options(id)).await?;
            assert_eq!(client.send(id, "hello").await?, 1);
        }
    }
    // The good session lost its queued model call (resume queues it again); the broken one
    // records its turn's end while its model call is still outstanding, which no workflow
    // does: its history does not fold.
    let good_task = store
        .list_tasks()
        .await?
        .into_iter()
        .find(|t| t.id.session_id == "good")
        .expect("good's model call is queued")
        .id;
    append_raw(&store, "good", Vec::new(), vec![good_task.clone()]).await?;
    end_turn_under_its_model_call(&store, "broken").await?;
    let broken_history = store.read_history("broken", 1, None).await?;
    let folded = crate::replay("broken", &broken_history).unwrap_err();
    assert!(folded.is_history_fault(), "{folded}");

    let second = Engine::new(store.clone(), Arc::new(SystemClock));
    let report = second.resume(true).await?;
    assert_eq!(report.running_sessions, ["good"]);
    assert_eq!(
        report.unresumable,
        [UnresumableSession {
            session_id: "broken".into(),
            error: folded.to_string(),
        }]
    );
    assert_eq!((report.outstanding_tasks, report.requeued_tasks), (1, 1));
    let queued: Vec<_> = store
        .list_tasks()
        .await?
        .into_iter()
        .map(|t| t.id)
        .collect();
    assert_eq!(
        queued.iter().filter(|id| **id == good_task).count(),
        1,
        "good's model call is queued again: {queued:?}"
    );
    assert_eq!(
        store.read_history("broken", 1, None).await?,
        broken_history,
        "the broken session is left as it is"
    );
    // Asked for alone, the broken session is the call's own typed error.
    let alone = second.resume_session("broken", false).await.unwrap_err();
    assert!(
        matches!(&alone, Error::InvalidEvent { session_id, .. } | Error::Nondeterminism { session_id, .. } if session_id == "broken"),
        "{alone}"
    );

    // The good session's turn ends, live and on replay alike.
    let leased = second
        .lease_tasks(
            &TaskFilter {
                sessions: Some(["good".to_owned()].into()),
                ..TaskFilter::any()
            },
            1,
            60_000,
        )
        .await?;
    assert_eq!(leased.len(), 1);
    second
        .report(
            &leased[0].lease,
            ActivityReport::ModelCompleted(ModelResponse {
                provider: "scripted".into(),
                model: "resume".into(),
                parts: vec![Part::text("resumed")],
                stop_reason_raw: "end_turn".into(),
                stop_reason: StopReason::EndTurn,
                usage: Usage::default(),
            }),
        )
        .await?;
    let outcome = second.wait_turn("good", 1).await?;
    assert!(
        matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "resumed"),
        "{outcome:?}"
    );
    let history = store.read_history("good", 1, None).await?;
    let replayed = crate::replay("good", &history)?;
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        second.state("good").await?.transcript.canonical_json()
    );
    Ok(())
}

/// A stored event the workflow refuses (here a second message while turn 1 runs, which a
/// client is refused live) is the history's fault, not a request's: an engine that folds the
/// history anew, and one that catches its cached state up with it, both answer
/// `HistoryUnreadable` naming the event, not the `InvalidEvent` a refused request gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_event_the_workflow_refuses_reads_as_an_unreadable_history() -> Result<()> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let cached = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(cached.clone());
    client.start_session(options("broken")).await?;
    assert_eq!(client.send("broken", "hello").await?, 1);
    let refused = client.send("broken", "again").await.unwrap_err();
    assert!(
        matches!(&refused, Error::InvalidEvent { reason, .. } if reason == "a turn is already running"),
        "{refused}"
    );
    let seq = store.read_history("broken", 1, None).await?.len() as u64 + 1;
    let second_message = Event::UserMessage {
        turn: 2,
        text: "again".into(),
        model: None,
        media: Vec::new(),
        tool_choice: None,
        idempotency_key: None,
    };
    append_raw(&store, "broken", vec![second_message], Vec::new()).await?;

    let expected = format!("stored event {seq} does not fold: a turn is already running");
    let fresh = Engine::new(store.clone(), Arc::new(SystemClock));
    for (engine, how) in [(&fresh, "folded anew"), (&cached, "caught up")] {
        match engine.state("broken").await {
            Err(Error::HistoryUnreadable { session_id, reason }) => {
                assert_eq!(
                    (session_id.as_str(), &reason),
                    ("broken", &expected),
                    "{how}"
                )
            }
            other => panic!("{how}: {:?}", other.map(|s| s.next_seq)),
        }
    }
    assert!(cached.state("broken").await.unwrap_err().is_history_fault());
    Ok(())
}

/// What a test's log lines say, kept in memory.
#[derive(Clone, Default)]
struct LogLines(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogLines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogLines {
    type Writer = LogLines;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

// One thread: the log subscriber is this thread's.
#[tokio::test(flavor = "current_thread")]
async fn an_overdue_task_of_a_session_that_does_not_fold_is_warned_of_once() -> Result<()> {
    let logs = LogLines::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    let _logging = tracing::subscriber::set_default(subscriber);
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let clock = Arc::new(crate::ManualClock::new(1_000));
    let engine = Engine::new(store.clone(), clock.clone());
    let client = Client::new(engine.clone());
    client.start_session(options("broken")).await?;
    client.send("broken", "hello").await?;
    let leased = engine.lease_tasks(&TaskFilter::any(), 1, 100).await?;
    assert_eq!(leased.len(), 1);
    end_turn_under_its_model_call(&store, "broken").await?;
    // A new engine: the broken state is not cached. The lease lapses, and every round of
    // timers finds the task overdue and cannot record it.
    let engine = Engine::new(store.clone(), clock.clone());
    clock.advance(1_000);
    for _ in 0..3 {
        assert_eq!(engine.fire_timers().await?, 0);
    }
    let said =
        String::from_utf8_lossy(&logs.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    assert_eq!(
        said.matches("cannot record an overdue task").count(),
        1,
        "{said}"
    );
    assert!(said.contains("nondeterminism in session"), "{said}");
    assert_eq!(
        store.list_tasks().await?.len(),
        1,
        "the task stays, overdue, for a build that folds its history"
    );
    Ok(())
}
