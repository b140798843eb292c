//! The engine under races: a call dropped before the store answers its append (a server's
//! handler whose client hung up), a resume while another engine writes the same store, a
//! wait that comes after later turns ended, a listing whose sessions change under it, timers
//! that fire on a task a worker took after they read it. What it caches, queues and answers
//! stays what the store holds.

use crate::client::{Client, SessionOptions};
use crate::engine::{ActivityReport, LeasedTask};
use crate::engine_test_store::GatedStore;
use crate::engine_test_support::{session_options, text_answer};
use crate::event::Event;
use crate::event::{ActivityFailure, ErrorClass};
use crate::store::{Lease, Store, TaskFilter};
use crate::workflow::TurnOutcome;
use crate::{Engine, ManualClock, MemoryStore, SystemClock};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

fn options(id: &str) -> SessionOptions {
    session_options("race", id)
}

fn answer(text: &str) -> ActivityReport {
    text_answer("race", text)
}

/// A send dropped while its append waits for the store leaves no trace in what the engine
/// answers: the state it gives is the store's, and the next send goes on from there.
/// (Before, the cached state kept the dropped send's message and its model call, events the
/// store never held.)
#[tokio::test]
async fn a_send_dropped_before_its_append_is_answered_leaves_the_cache_as_the_store_is() {
    let store = Arc::new(GatedStore::default());
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    client.start_session(options("s")).await.unwrap();
    assert_eq!(client.send("s", "hello").await.unwrap(), 1);
    let leased = engine
        .lease_tasks(&TaskFilter::any(), 1, 60_000)
        .await
        .unwrap();
    engine.report(&leased[0].lease, answer("hi")).await.unwrap();
    let stored = store.inner.read_history("s", 1, None).await.unwrap().len() as u64;

    store.hold_appends.store(true, Ordering::SeqCst);
    let dropped = {
        let client = client.clone();
        tokio::spawn(async move { client.send("s", "never stored").await })
    };
    store.entered.notified().await;
    dropped.abort();
    assert!(dropped.await.unwrap_err().is_cancelled());
    store.hold_appends.store(false, Ordering::SeqCst);

    let state = engine.state("s").await.unwrap();
    assert_eq!(
        state.next_seq,
        stored + 1,
        "the engine's state is the store's, not the dropped send's"
    );
    let transcript = client.transcript("s").await.unwrap();
    assert!(
        !String::from_utf8_lossy(&transcript.canonical_json()).contains("never stored"),
        "the dropped message is in no answer"
    );
    assert_eq!(client.send("s", "again").await.unwrap(), 2);
    let history = store.inner.read_history("s", 1, None).await.unwrap();
    let replayed = crate::replay("s", &history).unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        client.transcript("s").await.unwrap().canonical_json()
    );
}

/// A resume that reads the queue just before another engine on the same store schedules and
/// leases a session's next task queues nothing again: the task's lease stays the one worker's.
/// (Before, the queue was listed before the session's state was read, so the new task looked
/// missing from it and was queued again, its lease reset for a second worker to take.)
#[tokio::test]
async fn a_resume_racing_another_engine_does_not_queue_its_new_task_again() {
    let store = Arc::new(GatedStore::default());
    let serving = Engine::new(store.clone(), Arc::new(SystemClock));
    let resuming = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(serving.clone());
    let mut o = options("s");
    o.model_retry.initial_interval_ms = 0;
    client.start_session(o).await.unwrap();
    client.send("s", "hello").await.unwrap();
    let first = serving
        .lease_tasks(&TaskFilter::any(), 1, 60_000)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);

    // Right after the resuming engine lists the queue, the serving one records the model
    // call's failure, which schedules its retry, and a worker of its leases the retry.
    let retry: Arc<Mutex<Vec<Lease>>> = Arc::default();
    let meanwhile = {
        let (serving, retry) = (serving.clone(), retry.clone());
        let lease = first[0].lease.clone();
        async move {
            let failure = ActivityFailure::new(ErrorClass::Transient, "try again");
            serving
                .report(&lease, ActivityReport::Failed(failure))
                .await
                .unwrap();
            let leased = serving
                .lease_tasks(&TaskFilter::any(), 1, 60_000)
                .await
                .unwrap();
            *retry.lock().unwrap() = leased.into_iter().map(|t| t.lease).collect();
        }
    };
    store.after_listing.set(meanwhile);
    let report = resuming.resume(false).await.unwrap();
    let retry = retry.lock().unwrap().clone();
    assert_eq!(retry.len(), 1, "the retry was leased");
    assert_eq!(report.requeued_tasks, 0, "{report:?}");
    let again = serving
        .lease_tasks(&TaskFilter::any(), 1, 60_000)
        .await
        .unwrap();
    assert!(
        again.is_empty(),
        "the retry, leased at attempt {}, was handed out again: {:?}",
        retry[0].lease_attempt,
        again.iter().map(|t| &t.lease).collect::<Vec<_>>()
    );
}

/// A wait for a turn that comes after the session went on (a resent message's, whose first
/// answer was lost while other messages ran their turns) gets that turn's own outcome, not
/// the last turn's.
#[tokio::test]
async fn a_late_wait_for_a_turn_gets_that_turns_outcome() {
    let engine = Engine::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    client.start_session(options("s")).await.unwrap();
    for (turn, text) in [(1, "first answer"), (2, "second answer")] {
        assert_eq!(client.send("s", "go").await.unwrap(), turn);
        let leased = engine
            .lease_tasks(&TaskFilter::any(), 1, 60_000)
            .await
            .unwrap();
        engine.report(&leased[0].lease, answer(text)).await.unwrap();
    }
    for (turn, text) in [(1, "first answer"), (2, "second answer")] {
        match engine.wait_turn("s", turn).await.unwrap() {
            crate::workflow::TurnOutcome::Completed {
                turn: answered,
                answer,
                ..
            } => assert_eq!((answered, answer.as_str()), (turn, text)),
            other => panic!("turn {turn}: {other:?}"),
        }
    }
}

/// A listing is filled in session by session after the store listed them: one deleted
/// meanwhile leaves the page, and one whose history does not fold is listed without its
/// totals; neither fails the listing. (Before, either made the whole listing an error.)
#[tokio::test]
async fn a_listing_survives_a_session_deleted_under_it_and_one_that_does_not_fold() {
    use crate::store::conformance::{append_request, message};
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(engine.clone());
    for id in ["a", "gone"] {
        client.start_session(options(id)).await.unwrap();
    }
    // A history with no session start: it does not fold.
    store
        .append(append_request(
            "broken",
            1,
            vec![message("broken", 1, "hi")],
            1,
        ))
        .await
        .unwrap();
    let mut page = crate::client::page_sessions(
        store.list_sessions().await.unwrap(),
        |id| Some(id),
        None,
        None,
        10,
    );
    assert_eq!(page.sessions.len(), 3);
    client.delete_session("gone").await.unwrap();
    crate::client::fill_in_summaries(&engine, &mut page, str::to_owned).await;
    let listed: Vec<_> = page
        .sessions
        .iter()
        .map(|s| (s.session_id.as_str(), s.totals.is_some()))
        .collect();
    assert_eq!(listed, [("a", true), ("broken", false)]);
}

/// When the engine clock starts in the timer races below.
const START_MS: u64 = 1_000;

/// A session "s" on a [`GatedStore`] store, its engine on a manual clock at [`START_MS`], with its
/// first turn's model call queued; `schedule_to_start_ms` is the model calls' start deadline.
async fn turn_with_a_model_call(
    schedule_to_start_ms: Option<u64>,
) -> (Arc<GatedStore>, Arc<ManualClock>, Engine, Client) {
    let store = Arc::new(GatedStore::default());
    let clock = Arc::new(ManualClock::new(START_MS));
    let engine = Engine::new(store.clone(), clock.clone());
    let client = Client::new(engine.clone());
    let mut o = options("s");
    o.model_retry.schedule_to_start_timeout_ms = schedule_to_start_ms;
    client.start_session(o).await.unwrap();
    assert_eq!(client.send("s", "hello").await.unwrap(), 1);
    (store, clock, engine, client)
}

/// Runs `meanwhile` right after the next `overdue_tasks` of `store` read the tasks, before
/// the timers act on what they read; gives back what it returned.
fn after_overdue_read<T: Send + 'static>(
    store: &Arc<GatedStore>,
    meanwhile: impl std::future::Future<Output = T> + Send + 'static,
) -> Arc<Mutex<Option<T>>> {
    let out: Arc<Mutex<Option<T>>> = Arc::default();
    let filled = out.clone();
    store.after_overdue.set(async move {
        let result = meanwhile.await;
        *filled.lock().unwrap() = Some(result);
    });
    out
}

/// Fires the timers while the race set up with [`after_overdue_read`] happens: they must
/// record nothing for a task that changed since they read it.
async fn fire_timers_during_the_race(engine: &Engine) {
    assert_eq!(
        engine.fire_timers().await.unwrap(),
        0,
        "the timers record nothing for a task that changed since they read it"
    );
}

/// The one lease the race took.
fn the_lease(leased: &Mutex<Option<Vec<LeasedTask>>>) -> Lease {
    match leased.lock().unwrap().as_deref() {
        Some([task]) => task.lease.clone(),
        other => panic!("the race must lease the one task, got {other:?}"),
    }
}

/// The report of `lease` is accepted and ends the turn with its answer; no attempt was
/// recorded as failed, nothing is left queued or overdue, and a replay of the history gives
/// the live transcript.
async fn the_report_ends_the_turn(
    store: &GatedStore,
    engine: &Engine,
    client: &Client,
    lease: &Lease,
) {
    engine
        .report(lease, answer("in time"))
        .await
        .expect("the worker's report is accepted");
    match engine.wait_turn("s", 1).await.unwrap() {
        TurnOutcome::Completed { answer, .. } => assert_eq!(answer, "in time"),
        other => panic!("the turn must complete with the worker's answer, got {other:?}"),
    }
    let history = store.inner.read_history("s", 1, None).await.unwrap();
    let failed: Vec<u64> = history
        .iter()
        .filter(|e| matches!(e.event, Event::ModelCallFailed { .. }))
        .map(|e| e.seq)
        .collect();
    assert_eq!(
        failed,
        Vec::<u64>::new(),
        "no attempt was recorded as failed"
    );
    assert_eq!(store.inner.list_tasks().await.unwrap(), vec![]);
    assert_eq!(engine.fire_timers().await.unwrap(), 0, "nothing is overdue");
    let replayed = crate::replay("s", &history).unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        client.transcript("s").await.unwrap().canonical_json()
    );
}

/// A task that a worker leases just as its start deadline passes — after the timers read it
/// as never started, before they record that — stays the worker's: the timers record no
/// timeout and drop nothing, and the worker's report ends the turn. (Before, the timers
/// dropped the task under the worker and recorded the attempt as timed out, the report was
/// refused, and the retry ran the activity a second time.)
#[tokio::test]
async fn a_task_leased_as_its_start_deadline_fires_stays_the_workers() {
    let (store, clock, engine, client) = turn_with_a_model_call(Some(500)).await;
    clock.advance(500);
    // The worker's lease read its clock a millisecond before the deadline: a server whose
    // clock is behind on a shared database, or a lease request that read the clock and then
    // waited for the store.
    let worker = Engine::new(store.clone(), Arc::new(ManualClock::new(START_MS + 499)));
    let leased = after_overdue_read(&store, async move {
        worker
            .lease_tasks(&TaskFilter::any(), 1, 60_000)
            .await
            .unwrap()
    });
    fire_timers_during_the_race(&engine).await;
    let lease = the_lease(&leased);
    the_report_ends_the_turn(&store, &engine, &client, &lease).await;
}

/// A lapsed lease that is released and leased again by another worker (attempt 2) after the
/// timers read it as lapsed stays that worker's: the timers record no lapse and drop
/// nothing, and the new worker's report ends the turn. (Before, the timers dropped the task
/// under the new lease and recorded attempt 1 as lapsed; the report was refused.)
#[tokio::test]
async fn a_lapsed_lease_leased_again_as_the_timers_fire_stays_the_new_workers() {
    let (store, clock, engine, client) = turn_with_a_model_call(None).await;
    let first = engine
        .lease_tasks(&TaskFilter::any(), 1, 1_000)
        .await
        .unwrap();
    assert_eq!(first.len(), 1, "the model call is leased for 1 s");
    clock.advance(1_000);
    let leased = after_overdue_read(&store, {
        let (store, engine) = (store.clone(), engine.clone());
        async move {
            // Its worker is gone: a host that lost its workers releases their leases.
            let released = store.inner.release_leases(START_MS + 1_000).await.unwrap();
            assert_eq!(released, 1);
            engine
                .lease_tasks(&TaskFilter::any(), 1, 60_000)
                .await
                .unwrap()
        }
    });
    fire_timers_during_the_race(&engine).await;
    let lease = the_lease(&leased);
    assert_eq!(lease.lease_attempt, 2, "another worker holds attempt 2");
    the_report_ends_the_turn(&store, &engine, &client, &lease).await;
}

/// A lapsed lease whose worker renews it after the timers read it as lapsed (its heartbeat
/// read the clock just before the expiry) stays that worker's: the timers record no lapse,
/// and the worker's report ends the turn.
#[tokio::test]
async fn a_lease_renewed_as_the_timers_fire_stays_the_workers() {
    let (store, clock, engine, client) = turn_with_a_model_call(None).await;
    let leased = engine
        .lease_tasks(&TaskFilter::any(), 1, 1_000)
        .await
        .unwrap();
    let lease = leased[0].lease.clone();
    clock.advance(1_000);
    let worker = Engine::new(store.clone(), Arc::new(ManualClock::new(START_MS + 999)));
    let renewed = after_overdue_read(&store, {
        let lease = lease.clone();
        async move { worker.heartbeat(&lease, 1_000, None).await.unwrap() }
    });
    fire_timers_during_the_race(&engine).await;
    assert_eq!(
        *renewed.lock().unwrap(),
        Some(START_MS + 1_999),
        "the heartbeat renewed the lease"
    );
    the_report_ends_the_turn(&store, &engine, &client, &lease).await;
}
