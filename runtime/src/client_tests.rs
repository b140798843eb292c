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
