//! What the engine keeps per session once a session is parked (idle, waiting for its next
//! message): no outcome channel, no watch, no lease, and its cached state only while the
//! cache has room; running sessions keep theirs. And what a model call costs in memory: the
//! transcript shared with it, not copied.

use crate::client::{Client, SessionOptions};
use crate::engine::{ActivityInput, ActivityReport, PerSessionEntries};
use crate::engine_test_support::{session_options, text_answer};
use crate::error::Result;
use crate::store::{Store, TaskFilter};
use crate::workflow::TurnOutcome;
use crate::{Engine, MemoryStore, SystemClock};
use std::sync::Arc;

fn answer(text: &str) -> ActivityReport {
    text_answer("parked", text)
}

/// An engine on a new store in memory.
fn memory_engine() -> Engine {
    Engine::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock))
}

fn options(id: &str) -> SessionOptions {
    session_options("parked", id)
}

/// Runs the session's only task (its model call) to a text answer.
async fn answer_the_model_call(engine: &Engine, text: &str) -> Result<()> {
    let leased = engine.lease_tasks(&TaskFilter::any(), 1, 60_000).await?;
    assert_eq!(leased.len(), 1, "one model call to run");
    engine.report(&leased[0].lease, answer(text)).await
}

/// Starts a session and sends its first message; the model call stays queued.
async fn start_turn(client: &Client, id: &str) -> Result<()> {
    client.start_session(options(id)).await?;
    assert_eq!(client.send(id, "hello").await?, 1);
    Ok(())
}

/// Parks a session: one turn, its outcome awaited by a waiter that subscribed before the
/// model answered (so the outcome reaches it through the channel, not the state).
async fn park(engine: &Engine, client: &Client, id: &str) -> Result<()> {
    start_turn(client, id).await?;
    let waiter = {
        let engine = engine.clone();
        let id = id.to_owned();
        tokio::spawn(async move { engine.wait_turn(&id, 1).await })
    };
    // The waiter's channel appears once it subscribed.
    while engine.per_session_entries().outcomes == 0 {
        tokio::task::yield_now().await;
    }
    answer_the_model_call(engine, &format!("answer of {id}")).await?;
    let outcome = waiter.await.expect("the waiter panicked")?;
    assert!(
        matches!(&outcome, TurnOutcome::Completed { turn: 1, .. }),
        "{outcome:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_sessions_leave_no_channel_watch_or_lease_and_their_states_go() -> Result<()> {
    let engine = memory_engine().with_cache_capacity(4);
    let client = Client::new(engine.clone());
    // A session whose turn runs, started first: the purges must keep its state.
    // Its model call is leased and held, as by a slow worker.
    start_turn(&client, "running").await?;
    let running = engine.lease_tasks(&TaskFilter::any(), 1, 60_000).await?;
    assert_eq!(running[0].lease.id.session_id, "running");
    for n in 0..10 {
        park(&engine, &client, &format!("parked-{n}")).await?;
        let entries = engine.per_session_entries();
        assert_eq!(
            (entries.outcomes, entries.watched, entries.leased_here),
            (0, 0, 1),
            "after parked-{n}: {entries:?}"
        );
        assert!(entries.sessions <= 4, "after parked-{n}: {entries:?}");
    }
    assert!(engine.holds_state("running"));
    assert!(!engine.holds_state("parked-0"));
    // A dropped state folds again from the history, outcome and all.
    let state = engine.state("parked-0").await?;
    assert_eq!(state.turns_started, 1);
    assert!(
        matches!(&state.last_outcome, Some(TurnOutcome::Completed { turn: 1, answer, .. }) if answer == "answer of parked-0"),
        "{:?}",
        state.last_outcome
    );
    // Waiting for a turn that ended answers from the state and leaves no channel.
    let outcome = engine.wait_turn("parked-1", 1).await?;
    assert!(matches!(outcome, TurnOutcome::Completed { turn: 1, .. }));
    assert_eq!(engine.per_session_entries().outcomes, 0);
    // The running session's turn still ends, and its waiter hears it.
    let waiter = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.wait_turn("running", 1).await })
    };
    while engine.per_session_entries().outcomes == 0 {
        tokio::task::yield_now().await;
    }
    engine
        .report(&running[0].lease, answer("late answer"))
        .await?;
    let outcome = waiter.await.expect("the waiter panicked")?;
    assert!(
        matches!(outcome, TurnOutcome::Completed { turn: 1, answer, .. } if answer == "late answer")
    );
    let entries = engine.per_session_entries();
    assert_eq!(
        (entries.outcomes, entries.leased_here),
        (0, 0),
        "{entries:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_engine_keeps_nothing_for_parked_sessions() -> Result<()> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let first = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(first.clone());
    for n in 0..3 {
        park(&first, &client, &format!("parked-{n}")).await?;
    }
    start_turn(&client, "running").await?;
    drop(client);
    drop(first);
    // A new process on the same store: resume loads only the running session.
    let second = Engine::new(store, Arc::new(SystemClock));
    let report = second.resume(true).await?;
    assert_eq!(report.running_sessions, vec!["running".to_owned()]);
    assert_eq!(
        second.per_session_entries(),
        PerSessionEntries {
            sessions: 1,
            ..PerSessionEntries::default()
        }
    );
    assert!(second.holds_state("running") && !second.holds_state("parked-0"));
    // A parked session's finished turn is answered from its history, leaving no channel.
    let outcome = second.wait_turn("parked-2", 1).await?;
    assert!(
        matches!(outcome, TurnOutcome::Completed { turn: 1, answer, .. } if answer == "answer of parked-2")
    );
    let entries = second.per_session_entries();
    assert_eq!((entries.outcomes, entries.watched), (0, 0), "{entries:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cache_keeps_the_parked_state_used_last_and_drops_the_oldest() -> Result<()> {
    let engine = memory_engine().with_cache_capacity(4);
    let client = Client::new(engine.clone());
    for id in ["a", "b", "c", "d"] {
        park(&engine, &client, id).await?;
    }
    // a is read again (a chat's next message would do the same): b is now the oldest.
    assert_eq!(engine.state("a").await?.turns_started, 1);
    park(&engine, &client, "e").await?;
    for (id, kept) in [
        ("a", true),
        ("b", false),
        ("c", true),
        ("d", true),
        ("e", true),
    ] {
        assert_eq!(engine.holds_state(id), kept, "{id}");
    }
    // The dropped state folds again from the history.
    let b = engine.state("b").await?;
    assert!(
        matches!(&b.last_outcome, Some(TurnOutcome::Completed { answer, .. }) if answer == "answer of b"),
        "{:?}",
        b.last_outcome
    );
    Ok(())
}

/// Parks a session whose one answer is about `len` bytes long.
async fn park_long(engine: &Engine, client: &Client, id: &str, len: usize) -> Result<()> {
    start_turn(client, id).await?;
    answer_the_model_call(engine, &format!("{id}: {}", "x".repeat(len))).await?;
    let outcome = engine.wait_turn(id, 1).await?;
    assert!(matches!(outcome, TurnOutcome::Completed { turn: 1, .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_its_byte_budget_the_engine_drops_the_parked_states_used_longest_ago() -> Result<()> {
    // Room for two states of 100 KB, not three; the count (512) is no limit here.
    let engine = memory_engine().with_cache_bytes(250_000);
    let client = Client::new(engine.clone());
    park_long(&engine, &client, "a", 100_000).await?;
    let one = engine.cache_stats().bytes;
    assert!((100_000..110_000).contains(&one), "{one}");
    assert_eq!(one, engine.state("a").await?.approx_bytes() as u64);
    park_long(&engine, &client, "b", 100_000).await?;
    park_long(&engine, &client, "c", 100_000).await?;
    // Over the budget now, but a purge runs only for a new session.
    assert!(engine.cache_stats().bytes > 250_000);
    // a is read again (a chat's next message would do the same): b and c are now the oldest.
    engine.state("a").await?;
    start_turn(&client, "small").await?;
    // Down to three quarters of the budget: b went, then c; a, used last, stayed.
    for (id, kept) in [("a", true), ("b", false), ("c", false), ("small", true)] {
        assert_eq!(engine.holds_state(id), kept, "{id}");
    }
    let small = engine.state("small").await?.approx_bytes() as u64;
    assert_eq!(engine.cache_stats().bytes, one + small);
    // A dropped state folds again from the history, its answer whole.
    let b = engine.state("b").await?;
    assert!(
        matches!(&b.last_outcome, Some(TurnOutcome::Completed { answer, .. }) if answer.len() == 100_003),
        "{:?}",
        b.last_outcome.as_ref().map(|_| "another outcome")
    );
    assert_eq!(b.approx_bytes() as u64, one);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_call_shares_the_transcript_and_the_answer_extends_it_in_place() -> Result<()> {
    let engine = memory_engine();
    let client = Client::new(engine.clone());
    start_turn(&client, "shared").await?;
    let before = Arc::as_ptr(&engine.state("shared").await?.transcript);
    let leased = engine.lease_tasks(&TaskFilter::any(), 1, 60_000).await?;
    let ActivityInput::Model { transcript, .. } = &leased[0].input else {
        panic!("a model call: {:?}", leased[0].input);
    };
    // The call got the state's transcript itself, not a copy.
    assert!(std::ptr::eq(Arc::as_ptr(transcript), before));
    let lease = leased[0].lease.clone();
    drop(leased);
    engine.report(&lease, answer("no copy")).await?;
    // Nobody held the transcript any more, so the answer went onto it where it was: copied,
    // it would be at another address (the old one was still taken while copying).
    let after = engine.state("shared").await?;
    assert_eq!(after.transcript.messages.len(), 2);
    assert!(
        std::ptr::eq(Arc::as_ptr(&after.transcript), before),
        "the transcript was copied"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_event_stream_leaves_no_watch_behind() -> Result<()> {
    let engine = memory_engine();
    let client = Client::new(engine.clone());
    park(&engine, &client, "parked").await?;
    let mut stream = client.subscribe("parked", 0).await?;
    // The stream replays the history from its start.
    let first = stream.next().await.expect("an event")?;
    assert!(
        matches!(&first, crate::wire::StreamEvent::Event(e) if e.seq == 1),
        "{first:?}"
    );
    assert_eq!(engine.per_session_entries().watched, 1);
    drop(stream);
    // The parked session gets no new event, and its follower still ends.
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while engine.per_session_entries().watched != 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the follower of a dropped stream ended and dropped its watch");
    Ok(())
}

/// A lease handed out here that runs out without a report (its worker gone) is forgotten by
/// the timers that record its attempt as failed: a long-lived server keeps no entry per
/// abandoned lease.
#[tokio::test]
async fn a_lease_that_lapses_unreported_is_forgotten() -> Result<()> {
    let clock = Arc::new(crate::ManualClock::new(1_000_000));
    let engine = Engine::new(Arc::new(MemoryStore::new()), clock.clone());
    let client = Client::new(engine.clone());
    start_turn(&client, "abandoned").await?;
    let leased = engine.lease_tasks(&TaskFilter::any(), 1, 1_000).await?;
    assert_eq!(leased.len(), 1);
    assert_eq!(engine.per_session_entries().leased_here, 1);
    clock.advance(1_001);
    assert_eq!(
        engine.fire_timers().await?,
        1,
        "the lapsed attempt is recorded"
    );
    assert_eq!(engine.per_session_entries().leased_here, 0);
    Ok(())
}

/// On a shared store, a poll for other writers' appends reads the histories of the watched
/// sessions that moved, and only those: one read of their records says which, so many idle
/// followed sessions cost a poll one query, not a history read each.
#[tokio::test]
async fn a_poll_of_a_shared_store_reads_only_the_watched_sessions_that_moved() -> Result<()> {
    let store = Arc::new(crate::store::faulty::FaultyStore::new(MemoryStore::new()));
    store.fail_as_a_database();
    let writer = Engine::new(store.clone(), Arc::new(SystemClock));
    let watcher = Engine::new(store.clone(), Arc::new(SystemClock));
    let client = Client::new(writer.clone());
    let ids: Vec<String> = (0..10).map(|i| format!("w{i}")).collect();
    for id in &ids {
        client.start_session(options(id)).await?;
    }
    let _watching: Vec<_> = ids.iter().map(|id| watcher.watch(id)).collect();
    for id in &ids {
        watcher.state(id).await?;
    }
    let before = store.history_reads();
    watcher.refresh_watched().await;
    assert_eq!(
        store.history_reads(),
        before,
        "no watched session moved: no history is read"
    );

    let mut appended = watcher.subscribe_events();
    client.send("w3", "hello").await?;
    let before = store.history_reads();
    watcher.refresh_watched().await;
    assert_eq!(
        store.history_reads() - before,
        1,
        "the one session that moved is read"
    );
    let heard = appended
        .try_recv()
        .expect("the watcher published the foreign append");
    assert_eq!(
        (
            heard.session_id.as_str(),
            heard.events.first().map(|e| e.seq)
        ),
        ("w3", Some(2))
    );
    Ok(())
}
