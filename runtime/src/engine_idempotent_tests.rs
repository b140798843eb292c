//! Messages sent under idempotency keys, through the engine: a resend records nothing and
//! gets the first send's turn, another message under a used key is refused, and the keys
//! are folded again on replay.

use crate::client::SessionOptions;
use crate::error::{Error, Result};
use crate::event::{Event, EventEnvelope};
use crate::wire::SendMessage;
use crate::workflow::SessionState;
use crate::{Engine, MemoryStore, SystemClock};
use cairn_ledger::{ModelSpec, ToolChoice};
use std::sync::Arc;

fn engine_on(store: Arc<MemoryStore>) -> Engine {
    Engine::new(store, Arc::new(SystemClock))
}

fn options() -> SessionOptions {
    SessionOptions::new(ModelSpec::new("scripted", "nobody-runs-this"), Vec::new())
}

fn message(text: &str) -> SendMessage {
    SendMessage {
        text: text.to_owned(),
        model: None,
        media: Vec::new(),
        tool_choice: None,
    }
}

async fn history(engine: &Engine, session: &str) -> Result<Vec<EventEnvelope>> {
    engine.store().read_history(session, 1, None).await
}

/// The keys of the history's user messages, by turn.
fn message_keys(events: &[EventEnvelope]) -> Vec<(u32, Option<String>)> {
    events
        .iter()
        .filter_map(|envelope| match &envelope.event {
            Event::UserMessage {
                turn,
                idempotency_key,
                ..
            } => Some((*turn, idempotency_key.clone())),
            _ => None,
        })
        .collect()
}

/// Replay folds the same state as the live one, keys included.
async fn assert_replays(engine: &Engine, session: &str) -> Result<()> {
    let events = history(engine, session).await?;
    let replayed = SessionState::fold(session, &events)?;
    let live = engine.state(session).await?;
    assert_eq!(replayed, live, "replay = live");
    assert_eq!(replayed.approx_bytes(), replayed.bytes_counted_again());
    Ok(())
}

#[tokio::test]
async fn a_resent_message_starts_no_second_turn_and_another_under_its_key_is_refused() -> Result<()>
{
    let engine = engine_on(Arc::new(MemoryStore::new()));
    let session = engine.start_session(None, options().started()).await?;
    assert_eq!(
        engine
            .send_idempotent(&session, "k-1", &message("hello"))
            .await?,
        1
    );
    let recorded = history(&engine, &session).await?;
    // The resend: the same turn, nothing written.
    assert_eq!(
        engine
            .send_idempotent(&session, "k-1", &message("hello"))
            .await?,
        1
    );
    assert_eq!(history(&engine, &session).await?, recorded);
    // Another message under the key, also while no turn runs.
    for text in ["hello!", "hello"] {
        let mut other = message(text);
        other.tool_choice = (text == "hello").then_some(ToolChoice::None);
        match engine.send_idempotent(&session, "k-1", &other).await {
            Err(Error::IdempotencyKeyReused {
                session_id,
                key,
                turn,
            }) => assert_eq!(
                (session_id.as_str(), key.as_str(), turn),
                (session.as_str(), "k-1", 1)
            ),
            other => panic!("expected the key refused as reused, got {other:?}"),
        }
    }
    assert_eq!(history(&engine, &session).await?, recorded);
    engine.cancel_turn(&session, "next").await?;
    // A new key starts the next turn; the first key still answers with turn 1.
    assert_eq!(
        engine
            .send_idempotent(&session, "k-2", &message("again"))
            .await?,
        2
    );
    engine.cancel_turn(&session, "next").await?;
    assert_eq!(
        engine
            .send_idempotent(&session, "k-1", &message("hello"))
            .await?,
        1
    );
    // The client's call is the engine's.
    let client = crate::Client::new(engine.clone());
    assert_eq!(
        client
            .send_idempotent(&session, "k-2", message("again"))
            .await?,
        2
    );
    // A message without a key is not remembered.
    assert_eq!(engine.send_message(&session, "plain", None).await?, 3);
    let events = history(&engine, &session).await?;
    assert_eq!(
        message_keys(&events),
        vec![(1, Some("k-1".into())), (2, Some("k-2".into())), (3, None)]
    );
    let state = engine.state(&session).await?;
    assert_eq!(state.keyed_message("k-2").map(|sent| sent.turn), Some(2));
    assert_eq!(state.keyed_message("plain"), None);
    assert_replays(&engine, &session).await
}

#[tokio::test]
async fn a_key_that_is_none_is_refused_before_anything_is_written() -> Result<()> {
    let engine = engine_on(Arc::new(MemoryStore::new()));
    let session = engine.start_session(None, options().started()).await?;
    let before = history(&engine, &session).await?;
    for key in ["", "a b", "clé", &"k".repeat(256)] {
        match engine.send_idempotent(&session, key, &message("hi")).await {
            Err(Error::InvalidEvent { reason, .. }) => {
                assert!(reason.starts_with("the idempotency key"), "{reason}")
            }
            other => panic!("expected key {key:?} refused, got {other:?}"),
        }
        match engine
            .start_session_idempotent("fresh", options().started(), key, Some(&message("hi")))
            .await
        {
            Err(Error::InvalidEvent { reason, .. }) => {
                assert!(reason.starts_with("the idempotency key"), "{reason}")
            }
            other => panic!("expected key {key:?} refused, got {other:?}"),
        }
    }
    assert_eq!(history(&engine, &session).await?, before);
    assert!(matches!(
        engine.store().read_history("fresh", 1, None).await,
        Err(Error::UnknownSession { .. })
    ));
    Ok(())
}

#[tokio::test]
async fn a_resent_start_is_answered_as_the_first_and_a_different_one_is_refused() -> Result<()> {
    let engine = engine_on(Arc::new(MemoryStore::new()));
    let started = options().started();
    let first = engine
        .start_session_idempotent("s1", started.clone(), "create-1", Some(&message("hi")))
        .await?;
    assert_eq!(first, Some(1));
    let recorded = history(&engine, "s1").await?;
    assert_eq!(message_keys(&recorded), vec![(1, Some("create-1".into()))]);
    assert_eq!(
        engine
            .start_session_idempotent("s1", started.clone(), "create-1", Some(&message("hi")))
            .await?,
        Some(1)
    );
    // Another first message, another key, another start, or no message: the session exists.
    let mut other_start = started.clone();
    other_start.system_prompt = Some("be brief".into());
    let refused = [
        (started.clone(), "create-1", Some(message("hi!"))),
        (started.clone(), "create-2", Some(message("hi"))),
        (other_start, "create-1", Some(message("hi"))),
        (started.clone(), "create-1", None),
    ];
    for (start, key, first_message) in refused {
        match engine
            .start_session_idempotent("s1", start, key, first_message.as_ref())
            .await
        {
            Err(Error::InvalidEvent { reason, .. }) => {
                assert_eq!(reason, "the session already exists")
            }
            other => panic!("expected the start refused, got {other:?}"),
        }
    }
    assert_eq!(history(&engine, "s1").await?, recorded);
    assert_replays(&engine, "s1").await?;
    // Without a message: the same start again is answered as the first.
    assert_eq!(
        engine
            .start_session_idempotent("s2", started.clone(), "create-3", None)
            .await?,
        None
    );
    let recorded = history(&engine, "s2").await?;
    assert_eq!(
        engine
            .start_session_idempotent("s2", started, "create-3", None)
            .await?,
        None
    );
    assert_eq!(history(&engine, "s2").await?, recorded);
    Ok(())
}

#[tokio::test]
async fn two_engines_sending_under_one_key_start_one_turn() -> Result<()> {
    let store = Arc::new(MemoryStore::new());
    let (one, other) = (engine_on(store.clone()), engine_on(store));
    let session = one.start_session(None, options().started()).await?;
    // The other engine folds the session before the first sends, so its append is the one
    // that loses the race and decides again on the first one's message.
    other.state(&session).await?;
    let turn = one
        .send_idempotent(&session, "once", &message("hi"))
        .await?;
    let again = other
        .send_idempotent(&session, "once", &message("hi"))
        .await?;
    assert_eq!((turn, again), (1, 1));
    let events = history(&one, &session).await?;
    assert_eq!(message_keys(&events), vec![(1, Some("once".into()))]);
    assert_replays(&other, &session).await
}

#[tokio::test]
async fn a_history_that_uses_a_key_twice_is_refused_at_that_event() -> Result<()> {
    let engine = engine_on(Arc::new(MemoryStore::new()));
    let session = engine.start_session(None, options().started()).await?;
    engine
        .send_idempotent(&session, "twice", &message("hi"))
        .await?;
    engine.cancel_turn(&session, "next").await?;
    let mut events = history(&engine, &session).await?;
    // What no engine appends: a second message under the key.
    let seq = events.len() as u64 + 1;
    events.push(EventEnvelope::new(
        &session,
        seq,
        0,
        Event::UserMessage {
            turn: 2,
            text: "hi".into(),
            model: None,
            media: Vec::new(),
            tool_choice: None,
            idempotency_key: Some("twice".into()),
        },
    ));
    match SessionState::fold(&session, &events) {
        Err(Error::InvalidEvent {
            seq: refused,
            reason,
            ..
        }) => {
            assert_eq!(refused, seq);
            assert_eq!(reason, "idempotency key \"twice\" was used by turn 1");
        }
        other => panic!("expected the second use refused, got {other:?}"),
    }
    Ok(())
}
