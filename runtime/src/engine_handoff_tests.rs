//! An append that queues a task no worker asked for (a client's message) hands it to a lease
//! of a worker of this process that waits for it, leased with the append: the lease does not
//! ask the store again; a lease with a receiver (a worker pool's) is not even woken: the
//! receiver gets the task. A store that hands no task with an append wakes the lease instead.

use crate::client::{Client, SessionOptions};
use crate::engine::{ActivityInput, ActivityReport, LeasedTask};
use crate::engine_test_support::{session_options, text_answer};
use crate::error::{Error, Result};
use crate::store::faulty::{FaultyStore, LEASE_ERROR};
use crate::store::fjall::FjallStore;
use crate::store::sled::SledStore;
use crate::store::{LeaseHolder, Store, TaskFilter};
use crate::workflow::TurnOutcome;
use crate::{Engine, SystemClock, TaskReceiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn options(id: &str) -> SessionOptions {
    session_options("handoff", id)
}

fn answer(text: &str) -> ActivityReport {
    text_answer("handoff", text)
}

/// A new session `id` on a fjall store whose own leases can be made to fail, with its
/// engine and client; the directory lives as long as the first of them.
async fn started_on_faulty_fjall(
    id: &str,
) -> Result<(
    tempfile::TempDir,
    Arc<FaultyStore<FjallStore>>,
    Engine,
    Client,
)> {
    let root = tempfile::tempdir().expect("temp dir");
    let store = Arc::new(FaultyStore::new(FjallStore::open(root.path())?));
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    client.start_session(options(id)).await?;
    Ok((root, store, engine, client))
}

/// A lease of a worker of this process, waiting up to 30 s, in a task of its own; returns
/// once it waits idle (its look at the store found nothing).
async fn waiting_lease(engine: &Engine) -> tokio::task::JoinHandle<Result<Vec<LeasedTask>>> {
    waiting_lease_receiving(engine, None).await
}

/// [`waiting_lease`], giving what appends hand it to `receiver` when there is one.
async fn waiting_lease_receiving(
    engine: &Engine,
    receiver: Option<Arc<dyn TaskReceiver>>,
) -> tokio::task::JoinHandle<Result<Vec<LeasedTask>>> {
    waiting_lease_for(engine, LeaseHolder::InProcess, receiver).await
}

/// A lease for `holder`, as [`waiting_lease_receiving`] (a receiver is for a worker of this
/// process only).
#[allow(clippy::disallowed_methods)] // a long poll's deadline is real time
async fn waiting_lease_for(
    engine: &Engine,
    holder: LeaseHolder,
    receiver: Option<Arc<dyn TaskReceiver>>,
) -> tokio::task::JoinHandle<Result<Vec<LeasedTask>>> {
    let lease = {
        let engine = engine.clone();
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let filter = TaskFilter::any();
            match receiver {
                Some(receiver) => {
                    engine
                        .lease_tasks_waiting_receiving(&filter, 4, 60_000, deadline, receiver)
                        .await
                }
                None => {
                    engine
                        .lease_tasks_waiting(
                            &filter,
                            4,
                            60_000,
                            deadline,
                            std::future::pending(),
                            holder,
                        )
                        .await
                }
            }
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
    let (_root, store, engine, client) = started_on_faulty_fjall("h").await?;
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

/// A remote worker's waiting lease (a server's long poll) is handed the model call a client's
/// message queues, leased durably in the message's own write: one commit where there were
/// two (the append's, then the woken lease's), and the lease survives the store's reopen, as
/// a remote worker's must. The worker's report ends the turn on the reopened store, and the
/// history replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_message_hands_its_task_to_a_remote_workers_lease_in_its_own_commit() -> Result<()>
{
    let root = tempfile::tempdir().expect("temp dir");
    let store = Arc::new(FjallStore::open(root.path())?);
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    client.start_session(options("d")).await?;
    let lease = waiting_lease_for(&engine, LeaseHolder::Remote, None).await;
    let commits = || store.sync_times().expect("fjall counts its syncs").count();
    let before = commits();
    assert_eq!(client.send("d", "hello").await?, 1);
    let leased = lease.await.expect("the lease panicked")?;
    assert_eq!(
        commits() - before,
        1,
        "the message and its lease: one commit"
    );
    assert_eq!(leased.len(), 1, "the model call, handed");
    assert_first_model_call(&leased[0], "d/3");
    assert_eq!(
        engine.idle_leases(),
        0,
        "the handed lease left the registry"
    );
    drop((client, engine, store));

    // A remote worker outlives this process: its lease is on disk.
    let store = Arc::new(FjallStore::open(root.path())?);
    let tasks = store.list_tasks().await?;
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    assert_eq!(tasks[0].id.to_string(), "d/3");
    assert!(tasks[0].held, "leased durably: {tasks:?}");
    assert_eq!(tasks[0].lease_attempt, 1);
    assert_eq!(tasks[0].visible_at_ms, leased[0].lease.expires_at_ms);
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    engine.report(&leased[0].lease, answer("hi")).await?;
    assert!(matches!(
        engine.wait_turn("d", 1).await?,
        TurnOutcome::Completed { turn: 1, answer, .. } if answer == "hi"
    ));
    assert_eq!(store.list_tasks().await?, vec![]);
    assert_replays(&client, store.as_ref(), "d").await
}

/// A store that hands no task with an append (sled) wakes the claimed lease instead, which
/// leases the task itself; so it does with a receiver, which the task never reaches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_hands_nothing_wakes_the_waiting_lease_to_lease_itself() -> Result<()> {
    let root = tempfile::tempdir().expect("temp dir");
    let store = Arc::new(SledStore::open(root.path())?);
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    client.start_session(options("m")).await?;
    let receiver = Keeping::with_room(1);
    let lease = waiting_lease_receiving(&engine, Some(receiver.clone())).await;
    assert_eq!(client.send("m", "hello").await?, 1);
    let leased = lease.await.expect("the lease panicked")?;
    assert!(receiver.kept().is_empty(), "nothing to give it");
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

/// A receiver with room for `room` tasks, which it keeps for the test.
struct Keeping {
    room: usize,
    kept: Mutex<Vec<LeasedTask>>,
}

impl Keeping {
    fn with_room(room: usize) -> Arc<Keeping> {
        Arc::new(Keeping {
            room,
            kept: Mutex::new(Vec::new()),
        })
    }

    fn kept(&self) -> Vec<LeasedTask> {
        self.kept.lock().unwrap().clone()
    }
}

impl TaskReceiver for Keeping {
    fn receive(&self, tasks: Vec<LeasedTask>) -> Vec<LeasedTask> {
        let mut kept = self.kept.lock().unwrap();
        let mut left = Vec::new();
        for task in tasks {
            if kept.len() < self.room {
                kept.push(task);
            } else {
                left.push(task);
            }
        }
        left
    }
}

/// Checks that `task` is turn 1's model call, task `id`, on its first lease.
fn assert_first_model_call(task: &LeasedTask, id: &str) {
    assert_eq!(task.lease.id.to_string(), id);
    assert_eq!(task.lease.lease_attempt, 1);
    assert!(
        matches!(&task.input, ActivityInput::Model { origin, .. } if origin.turn == 1),
        "{:?}",
        task.input
    );
}

/// Checks that session `id`'s history, replayed with the current code, folds to the
/// engine's ledger, byte for byte.
async fn assert_replays(client: &Client, store: &dyn Store, id: &str) -> Result<()> {
    let history = store.read_history(id, 1, None).await?;
    let replayed = crate::replay(id, &history)?;
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        client.transcript(id).await?.canonical_json(),
        "the replay of {id} gives other ledger bytes"
    );
    Ok(())
}

/// A lease with a receiver (a worker pool's) is not woken for the task a client's message
/// queues: the receiver gets it at once, leased with the append (the store's own leases
/// fail from then on), with what it runs; the lease waits on, idle, and the next message's
/// task goes to the receiver too. Reports end both turns, and the history replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_message_gives_its_task_to_the_waiting_leases_receiver() -> Result<()> {
    let (_root, store, engine, client) = started_on_faulty_fjall("r").await?;
    let receiver = Keeping::with_room(2);
    let lease = waiting_lease_receiving(&engine, Some(receiver.clone())).await;
    store.fail_leases();
    assert_eq!(client.send("r", "hello").await?, 1);
    let kept = receiver.kept();
    assert_eq!(kept.len(), 1, "the model call, given to the receiver");
    assert_first_model_call(&kept[0], "r/3");
    assert_eq!(
        engine.leases_held_here(),
        vec![(kept[0].lease.id.clone(), 1)],
        "a lease handed out here"
    );
    assert_eq!(engine.idle_leases(), 1, "the lease waits on, never woken");
    assert!(!lease.is_finished());
    engine.report(&kept[0].lease, answer("hi")).await?;
    assert!(matches!(
        engine.wait_turn("r", 1).await?,
        TurnOutcome::Completed { turn: 1, answer, .. } if answer == "hi"
    ));
    assert_eq!(client.send("r", "again").await?, 2);
    let kept = receiver.kept();
    assert_eq!(
        kept.len(),
        2,
        "claimed again, the receiver gets the next one"
    );
    engine.report(&kept[1].lease, answer("bye")).await?;
    assert!(matches!(
        engine.wait_turn("r", 2).await?,
        TurnOutcome::Completed { turn: 2, .. }
    ));
    assert!(!lease.is_finished(), "still waiting");
    lease.abort();
    assert_eq!(store.list_tasks().await?, vec![]);
    assert_replays(&client, store.as_ref(), "r").await
}

/// A receiver with no room gives the task back: the lease is handed it as without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_the_receiver_has_no_room_for_is_handed_to_the_lease() -> Result<()> {
    let (_root, store, engine, client) = started_on_faulty_fjall("n").await?;
    let receiver = Keeping::with_room(0);
    let lease = waiting_lease_receiving(&engine, Some(receiver.clone())).await;
    store.fail_leases();
    assert_eq!(client.send("n", "hello").await?, 1);
    let leased = lease.await.expect("the lease panicked")?;
    assert!(receiver.kept().is_empty());
    assert_eq!(leased.len(), 1, "the model call, handed to the lease");
    assert_eq!(leased[0].lease.id.to_string(), "n/3");
    assert_eq!(leased[0].lease.lease_attempt, 1);
    engine.report(&leased[0].lease, answer("ok")).await?;
    assert!(matches!(
        engine.wait_turn("n", 1).await?,
        TurnOutcome::Completed { turn: 1, .. }
    ));
    assert_replays(&client, store.as_ref(), "n").await
}
