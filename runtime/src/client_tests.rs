//! The client's turn deadline and stall warning, against an engine no worker serves.

use crate::client::{Client, SessionOptions};
use crate::error::{Error, Result};
use crate::workflow::TurnOutcome;
use crate::{Engine, MemoryStore, SystemClock};
use cairn_ledger::ModelSpec;
use std::sync::Arc;
use std::time::Duration;

fn engine() -> Engine {
    Engine::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock))
}

fn options() -> SessionOptions {
    SessionOptions::new(ModelSpec::new("scripted", "nobody-runs-this"), Vec::new())
}

#[tokio::test]
async fn a_turn_no_worker_takes_fails_at_the_deadline_naming_its_task() -> Result<()> {
    let client = Client::new(engine())
        .with_stall_warning(Duration::from_millis(50))
        .with_turn_deadline(Duration::from_millis(300));
    let session = client.start_session(options()).await?;
    match client.run_turn(&session, "hello").await {
        Err(Error::TurnDeadline {
            session_id,
            turn,
            deadline_ms,
            pending,
        }) => {
            assert_eq!(
                (session_id.as_str(), turn, deadline_ms),
                (session.as_str(), 1, 300)
            );
            assert!(
                pending.contains(&format!("task {session}/"))
                    && pending
                        .contains("on queue \"default\" (needs a worker hosting \"scripted\")"),
                "{pending}"
            );
        }
        other => panic!("expected a turn deadline, got {other:?}"),
    }
    // The turn goes on.
    assert_eq!(client.describe(&session).await?.running_turn, Some(1));
    Ok(())
}

#[tokio::test]
#[allow(clippy::disallowed_methods)] // the turn is cancelled a little later, in real time
async fn a_turn_that_ends_before_the_deadline_gives_its_outcome() -> Result<()> {
    let client = Client::new(engine())
        .with_stall_warning(Duration::from_millis(20))
        .with_turn_deadline(Duration::from_secs(5));
    let session = client.start_session(options()).await?;
    let turn = client.send(&session, "hello").await?;
    let canceller = client.clone();
    let cancelled_session = session.clone();
    let cancel = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        canceller.cancel_turn(&cancelled_session, "enough").await
    });
    let outcome = client.wait_turn(&session, turn).await?;
    assert_eq!(cancel.await.expect("the canceller ran")?, 1);
    assert_eq!(
        outcome,
        TurnOutcome::Cancelled {
            turn: 1,
            reason: "enough".into(),
            // The model call that never answered was scheduled.
            totals: crate::budget::UsageTotals {
                model_calls: 1,
                ..Default::default()
            }
        }
    );
    Ok(())
}

/// A session started with its first message and waited for at once: the outcome when the
/// turn ends (here cancelled while it waits), and the deadline counted from the start when it
/// does not.
#[tokio::test]
#[allow(clippy::disallowed_methods)] // the turn is cancelled a little later, in real time
async fn a_session_started_and_run_gives_its_first_turns_outcome_or_meets_the_deadline(
) -> Result<()> {
    let client = Client::new(engine())
        .with_stall_warning(Duration::from_millis(20))
        .with_turn_deadline(Duration::from_secs(5));
    let mut first = options();
    first.session_id = Some("run-at-once".to_owned());
    let canceller = client.clone();
    let cancel = tokio::spawn(async move {
        // Once the turn has begun, which the session's existence shows.
        while canceller.describe("run-at-once").await.is_err() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        canceller.cancel_turn("run-at-once", "enough").await
    });
    let (id, outcome) = client.start_session_and_run(first, "hello").await?;
    assert_eq!(cancel.await.expect("the canceller ran")?, 1);
    assert_eq!(id, "run-at-once");
    assert!(
        matches!(&outcome, TurnOutcome::Cancelled { turn: 1, reason, .. } if reason == "enough"),
        "{outcome:?}"
    );
    assert_eq!(client.describe(&id).await?.last_outcome, Some(outcome));

    let client = client.with_turn_deadline(Duration::from_millis(200));
    let mut second = options();
    second.session_id = Some("no-worker".to_owned());
    match client.start_session_and_run(second, "hello").await {
        Err(Error::TurnDeadline {
            session_id,
            turn,
            deadline_ms,
            ..
        }) => assert_eq!(
            (session_id.as_str(), turn, deadline_ms),
            ("no-worker", 1, 200)
        ),
        other => panic!("expected a turn deadline, got {other:?}"),
    }
    assert_eq!(client.describe("no-worker").await?.running_turn, Some(1));
    Ok(())
}

/// A session's start and its first message are one durable append: the same events, in the
/// same order, that a start then a send record, and a history that folds (replays) to the
/// state the engine holds live.
#[tokio::test]
async fn a_start_with_its_first_message_is_one_durable_commit() -> Result<()> {
    use crate::clock::ManualClock;
    use crate::store::fjall::FjallStore;
    use crate::store::Store;
    use crate::workflow::SessionState;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(FjallStore::open(dir.path())?);
    let engine = Engine::new(store.clone(), Arc::new(ManualClock::new(1_000)));
    let client = Client::new(engine.clone());
    let commits = || store.durable_commits().expect("fjall counts its commits");

    let before = commits();
    let mut together = options();
    together.session_id = Some("together".to_owned());
    let (id, turn) = client.start_session_and_send(together, "hello").await?;
    assert_eq!((id.as_str(), turn), ("together", 1));
    assert_eq!(
        commits() - before,
        1,
        "the start and the message share one commit"
    );

    let before = commits();
    let mut apart = options();
    apart.session_id = Some("apart".to_owned());
    let apart = client.start_session(apart).await?;
    assert_eq!(client.send(&apart, "hello").await?, 1);
    assert_eq!(commits() - before, 2, "a start then a send are two commits");

    let together = store.read_history("together", 1, None).await?;
    let apart = store.read_history("apart", 1, None).await?;
    let kinds: Vec<_> = together.iter().map(|e| (e.seq, e.event.kind())).collect();
    assert_eq!(
        kinds,
        [
            (1, "session_started"),
            (2, "user_message"),
            (3, "model_call_scheduled")
        ]
    );
    assert_eq!(
        together
            .iter()
            .map(|e| (e.seq, e.recorded_at_ms, &e.event))
            .collect::<Vec<_>>(),
        apart
            .iter()
            .map(|e| (e.seq, e.recorded_at_ms, &e.event))
            .collect::<Vec<_>>(),
        "the same events as a start then a send"
    );
    let replayed = SessionState::fold("together", &together)?;
    assert_eq!(replayed, engine.state("together").await?, "replay = live");
    let queued: Vec<_> = store
        .list_tasks()
        .await?
        .into_iter()
        .filter(|t| t.id.session_id == "together")
        .map(|t| t.id.scheduled_seq)
        .collect();
    assert_eq!(queued, [3], "the model call is queued with the append");
    Ok(())
}

/// A follower of a session this engine deletes ends, saying so, rather than wait forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_ends_when_its_session_is_deleted() -> Result<()> {
    let engine = Engine::new(Arc::new(crate::MemoryStore::new()), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    let mut options = SessionOptions::new(ModelSpec::new("scripted", "gone"), Vec::new());
    options.session_id = Some("gone".into());
    client.start_session(options).await?;
    client.send("gone", "hello").await?;
    let leased = engine
        .lease_tasks(&crate::store::TaskFilter::any(), 1, 60_000)
        .await?;
    engine
        .report(
            &leased[0].lease,
            crate::engine::ActivityReport::ModelCompleted(cairn_ledger::ModelResponse {
                provider: "scripted".into(),
                model: "gone".into(),
                parts: vec![cairn_ledger::Part::text("bye")],
                stop_reason_raw: "end_turn".into(),
                stop_reason: cairn_ledger::StopReason::EndTurn,
                usage: cairn_ledger::Usage::default(),
            }),
        )
        .await?;
    let history = client.history("gone").await?;
    let replayed = crate::replay("gone", &history)?;
    assert_eq!(replayed.state, engine.state("gone").await?, "replay = live");
    let last = history.last().map_or(0, |e| e.seq);
    let mut follower = crate::client::follow(engine.clone(), "gone".into(), last);
    let next = tokio::spawn(async move {
        let mut backlog = std::collections::VecDeque::new();
        follower.next(&mut backlog).await
    });
    // Let the follower wait before the delete (it is subscribed from `follow` on anyway).
    tokio::task::yield_now().await;
    engine.delete_session("gone").await?;
    let ended = tokio::time::timeout(std::time::Duration::from_secs(10), next)
        .await
        .expect("the follower ends")
        .expect("join");
    assert!(
        matches!(&ended, Some(Err(Error::SessionDeleted { session_id })) if session_id == "gone"),
        "{ended:?}"
    );
    Ok(())
}
