//! An append that queues a task no worker asked for (a client's message) hands it to a lease
//! of a worker of this process that waits for it, leased with the append: the lease does not
//! ask the store again. A store that hands no task with an append wakes the lease instead.

use crate::client::{Client, SessionOptions};
use crate::engine::{ActivityReport, LeasedTask};
use crate::engine_test_support::{session_options, text_answer};
use crate::error::{Error, Result};
use crate::store::faulty::{FaultyStore, LEASE_ERROR};
use crate::store::fjall::FjallStore;
use crate::store::{LeaseHolder, Store, TaskFilter};
use crate::workflow::TurnOutcome;
use crate::{Engine, MemoryStore, SystemClock};
use std::sync::Arc;
use std::time::Duration;

fn options(id: &str) -> SessionOptions {
    session_options("handoff", id)
}

fn answer(text: &str) -> ActivityReport {
    text_answer("handoff", text)
}

/// A lease of a worker of this process, waiting up to 30 s, in a task of its own; returns
/// once it waits idle (its look at the store found nothing).
#[allow(clippy::disallowed_methods)] // a long poll's deadline is real time
async fn waiting_lease(engine: &Engine) -> tokio::task::JoinHandle<Result<Vec<LeasedTask>>> {
    let lease = {
        let engine = engine.clone();
        tokio::spawn(async move {
            engine
                .lease_tasks_waiting(
                    &TaskFilter::any(),
                    4,
                    60_000,
                    tokio::time::Instant::now() + Duration::from_secs(30),
                    std::future::pending(),
                    LeaseHolder::InProcess,
                )
                .await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while engine.idle_leases() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the lease waits");
    lease
}

/// On fjall, which leases with an append, a client's message hands the model call it queues to
/// the waiting lease: with the store's own leases failing from then on, the lease still gets
/// the task (attempt 1), and its report ends the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_message_hands_its_task_to_a_waiting_lease_with_the_append() -> Result<()> {
    let root = tempfile::tempdir().expect("temp dir");
    let store = Arc::new(FaultyStore::new(FjallStore::open(root.path())?));
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    client.start_session(options("h")).await?;
    let lease = waiting_lease(&engine).await;
    // A lease asking the store would fail now; only the append's may lease.
    store.fail_leases();
    assert_eq!(client.send("h", "hello").await?, 1);
    let leased = lease.await.expect("the lease panicked")?;
    assert_eq!(leased.len(), 1, "the model call, handed");
    assert_eq!(leased[0].lease.id.to_string(), "h/3");
    assert_eq!(leased[0].lease.lease_attempt, 1);
    assert_eq!(
        engine.idle_leases(),
        0,
        "the handed lease left the registry"
    );
    engine.report(&leased[0].lease, answer("hi")).await?;
    let outcome = engine.wait_turn("h", 1).await?;
    assert!(
        matches!(&outcome, TurnOutcome::Completed { turn: 1, answer, .. } if answer == "hi"),
        "{outcome:?}"
    );
    // The store's own lease path was off all along: asking it fails.
    assert!(matches!(
        store.lease_tasks_in_process(engine.now_ms(), 1_000, 1, &TaskFilter::any()).await,
        Err(Error::Store { reason }) if reason == LEASE_ERROR
    ));
    // Reported, the task is gone.
    assert_eq!(store.list_tasks().await?, vec![]);
    Ok(())
}

/// A store that hands no task with an append (memory, sled) wakes the claimed lease instead,
/// which leases the task itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_hands_nothing_wakes_the_waiting_lease_to_lease_itself() -> Result<()> {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    client.start_session(options("m")).await?;
    let lease = waiting_lease(&engine).await;
    assert_eq!(client.send("m", "hello").await?, 1);
    let leased = lease.await.expect("the lease panicked")?;
    assert_eq!(leased.len(), 1, "the model call, leased after the wake");
    assert_eq!(leased[0].lease.id.to_string(), "m/3");
    assert_eq!(leased[0].lease.lease_attempt, 1);
    engine.report(&leased[0].lease, answer("ok")).await?;
    assert!(matches!(
        engine.wait_turn("m", 1).await?,
        TurnOutcome::Completed { turn: 1, .. }
    ));
    Ok(())
}
