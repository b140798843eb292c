//! The conformance checks of [`Store::delete_session`]: a finished session's history, record
//! and tasks go at once and for good, a running one is refused, other sessions stay as they
//! were, and the id is never used again, through any handle of the store or any engine on it.

use super::concurrency::started;
use super::{append_request, history, message, new_task, sessions, snapshot, task_id, tasks};
use crate::clock::ManualClock;
use crate::engine::Engine;
use crate::error::Error;
use crate::store::{SessionInfo, SessionStatus, Store, TaskFilter, TaskKind};
use std::sync::Arc;

/// Appends `n` events to a new session, leaving it with `status`.
async fn session_of(store: &dyn Store, session_id: &str, n: u64, status: SessionStatus) {
    let events = (1..=n).map(|seq| message(session_id, seq, "x")).collect();
    let mut request = append_request(session_id, 1, events, 100);
    request.status = status;
    if let Err(e) = store.append(request).await {
        panic!("appending {n} events to {session_id:?} must succeed, got {e:?}");
    }
}

fn is_unknown(result: &Result<SessionInfo, Error>, session_id: &str) -> bool {
    matches!(result, Err(Error::UnknownSession { session_id: s }) if s == session_id)
}

/// Deleting a finished session removes its history and record and answers it as it was;
/// other sessions, their histories and their tasks are untouched; a second delete, an
/// unknown id and an invalid one are "not found"; the id takes no append again (of any seq,
/// events or not), and a cancelled session is finished too.
pub async fn delete_removes_a_finished_session(store: &dyn Store) {
    session_of(store, "del-a", 3, SessionStatus::Idle).await;
    session_of(store, "del-b", 2, SessionStatus::Idle).await;
    let mut request = append_request("del-b", 3, vec![message("del-b", 3, "y")], 200);
    request.enqueue = vec![new_task(&task_id("del-b", 3), TaskKind::Model, 200)];
    if let Err(e) = store.append(request).await {
        panic!("enqueueing a task of del-b must succeed, got {e:?}");
    }
    session_of(store, "del-c", 1, SessionStatus::Cancelled).await;
    let (listed, histories, queued) = snapshot(store).await;

    let info = store
        .delete_session("del-a", 5_000)
        .await
        .unwrap_or_else(|e| panic!("deleting the idle session del-a must succeed, got {e:?}"));
    assert_eq!(
        (info.session_id.as_str(), info.status, info.events),
        ("del-a", SessionStatus::Idle, 3),
        "the delete answers the session as it was listed"
    );
    let read = store.read_history("del-a", 1, None).await;
    assert!(
        matches!(&read, Err(Error::UnknownSession { .. })),
        "a deleted session's history must be gone, got {read:?}"
    );
    let (after, after_histories, after_tasks) = snapshot(store).await;
    assert_eq!(
        after,
        listed[1..].to_vec(),
        "the listing must omit the deleted session and keep the others as they were"
    );
    assert_eq!(
        after_histories,
        histories[1..].to_vec(),
        "other histories untouched"
    );
    assert_eq!(after_tasks, queued, "other sessions' tasks untouched");

    for id in ["del-a", "never-was", "bad id!"] {
        let again = store.delete_session(id, 6_000).await;
        assert!(
            is_unknown(&again, id),
            "deleting {id:?} (deleted, unknown or invalid) must be UnknownSession, got {again:?}"
        );
    }
    for seq in [1, 4] {
        let append = store
            .append(append_request(
                "del-a",
                seq,
                vec![message("del-a", seq, "z")],
                7_000,
            ))
            .await;
        assert!(
            matches!(&append, Err(Error::SessionDeleted { session_id }) if session_id == "del-a"),
            "an append at seq {seq} to a deleted session must be SessionDeleted, got {append:?}"
        );
    }
    let mut tasks_only = append_request("del-a", 1, Vec::new(), 7_000);
    tasks_only.enqueue = vec![new_task(&task_id("del-a", 9), TaskKind::Tool, 7_000)];
    let append = store.append(tasks_only).await;
    assert!(
        matches!(&append, Err(Error::SessionDeleted { .. })),
        "an append of tasks only to a deleted session must be SessionDeleted, got {append:?}"
    );
    assert_eq!(
        tasks(store).await,
        queued,
        "the refused appends queued nothing"
    );
    assert_eq!(
        sessions(store).await,
        listed[1..].to_vec(),
        "nor came the id back"
    );

    let cancelled = store.delete_session("del-c", 8_000).await;
    assert!(
        matches!(&cancelled, Ok(info) if info.status == SessionStatus::Cancelled && info.events == 1),
        "a cancelled session is finished and may be deleted, got {cancelled:?}"
    );
    assert_eq!(
        sessions(store)
            .await
            .iter()
            .map(|i| i.session_id.as_str())
            .collect::<Vec<_>>(),
        vec!["del-b"]
    );
}

/// A session with a turn running, or with a task queued or leased, is refused with
/// `SessionBusy` saying why, and nothing of it changes; once its task is gone and no turn
/// runs, it may be deleted, and its task is not left behind.
pub async fn delete_refuses_a_busy_session(store: &dyn Store) {
    session_of(store, "busy-run", 2, SessionStatus::Running).await;
    let mut request = append_request("busy-task", 1, vec![message("busy-task", 1, "x")], 100);
    request.status = SessionStatus::Idle;
    request.enqueue = vec![new_task(&task_id("busy-task", 1), TaskKind::Tool, 100)];
    if let Err(e) = store.append(request).await {
        panic!("enqueueing a task of busy-task must succeed, got {e:?}");
    }
    let before = snapshot(store).await;

    let running = store.delete_session("busy-run", 1_000).await;
    assert!(
        matches!(&running, Err(Error::SessionBusy { session_id, reason })
            if session_id == "busy-run" && reason.contains("turn is running")),
        "a running session must be refused as busy, got {running:?}"
    );
    let queued = store.delete_session("busy-task", 1_000).await;
    assert!(
        matches!(&queued, Err(Error::SessionBusy { reason, .. })
            if reason.contains("busy-task/1") && reason.contains("queued")),
        "a session with a queued task must be refused as busy, got {queued:?}"
    );
    let leases = store
        .lease_tasks(1_000, 60_000, 1, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("leasing must succeed, got {e:?}"));
    assert_eq!(leases.len(), 1);
    let leased = store.delete_session("busy-task", 2_000).await;
    assert!(
        matches!(&leased, Err(Error::SessionBusy { reason, .. }) if reason.contains("leased")),
        "a session with a leased task must be refused as busy, got {leased:?}"
    );
    let (listed, histories, _) = snapshot(store).await;
    assert_eq!(
        (listed, histories),
        (before.0, before.1),
        "a refused delete changes nothing"
    );

    // Its task answered, the session is finished.
    let mut done = append_request("busy-task", 2, vec![message("busy-task", 2, "y")], 3_000);
    done.status = SessionStatus::Idle;
    done.complete = vec![(leases[0].id.clone(), leases[0].lease_attempt)];
    if let Err(e) = store.append(done).await {
        panic!("completing the task must succeed, got {e:?}");
    }
    let deleted = store.delete_session("busy-task", 4_000).await;
    assert!(
        matches!(&deleted, Ok(info) if info.events == 2),
        "a finished session must be deletable, got {deleted:?}"
    );
    assert!(tasks(store).await.is_empty(), "no task of it is left");
    assert_eq!(history(store, "busy-run").await.len(), 2);
}

/// A delete through one handle is seen through the other at once (a second process on a
/// shared store): its reads find no session and its appends are refused; and an engine on
/// the other handle that had the session cached neither shows it nor records into it, nor
/// can a session be started under its id.
pub async fn a_deletion_is_seen_through_another_handle(a: Arc<dyn Store>, b: Arc<dyn Store>) {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let one = Engine::new(a.clone(), clock.clone());
    let two = Engine::new(b.clone(), clock);
    let s = one
        .start_session(Some("deleted-elsewhere".into()), started())
        .await
        .unwrap_or_else(|e| panic!("starting a session must succeed, got {e:?}"));
    // Engine one caches the folded state.
    let state = one
        .state(&s)
        .await
        .unwrap_or_else(|e| panic!("reading the new session must succeed, got {e:?}"));
    assert_eq!(state.next_seq, 2);

    let info = two
        .delete_session(&s)
        .await
        .unwrap_or_else(|e| panic!("engine two must delete the idle session, got {e:?}"));
    assert_eq!(info.events, 1);

    let read = a.read_history(&s, 1, None).await;
    assert!(
        matches!(&read, Err(Error::UnknownSession { .. })),
        "the other handle must not find the deleted history, got {read:?}"
    );
    assert!(
        sessions(&*a).await.iter().all(|i| i.session_id != s),
        "the other handle must not list it"
    );
    let append = a
        .append(append_request(
            &s,
            2,
            vec![message(&s, 2, "late")],
            2_000_000,
        ))
        .await;
    assert!(
        matches!(&append, Err(Error::SessionDeleted { .. })),
        "an append through the other handle at the next seq must be refused, got {append:?}"
    );
    let cached = one.state(&s).await;
    assert!(
        matches!(&cached, Err(Error::UnknownSession { .. })),
        "engine one must not serve its cached state of a deleted session, got {cached:?}"
    );
    let sent = one.send_message(&s, "hello?", None).await;
    assert!(
        sent.is_err(),
        "engine one must not record a message into a deleted session, got {sent:?}"
    );
    let restarted = one.start_session(Some(s.clone()), started()).await;
    assert!(
        matches!(&restarted, Err(Error::SessionDeleted { .. })),
        "a deleted session's id must not be used again, got {restarted:?}"
    );
    assert!(
        sessions(&*b).await.iter().all(|i| i.session_id != s),
        "no handle lists it again"
    );
}

/// A deletion is durable: after a reopen the session is still gone and its id still refused,
/// and the sessions beside it are intact.
pub async fn a_deletion_survives_a_reopen<S: Store>(store: S, reopen: &mut dyn FnMut(S) -> S) {
    session_of(&store, "gone", 4, SessionStatus::Idle).await;
    session_of(&store, "kept", 2, SessionStatus::Idle).await;
    if let Err(e) = store.delete_session("gone", 1_000).await {
        panic!("deleting must succeed, got {e:?}");
    }
    let store = reopen(store);
    let listed = sessions(&store).await;
    assert_eq!(
        listed
            .iter()
            .map(|i| (i.session_id.as_str(), i.events))
            .collect::<Vec<_>>(),
        vec![("kept", 2)],
        "after a reopen only the kept session is listed"
    );
    assert!(matches!(
        store.read_history("gone", 1, None).await,
        Err(Error::UnknownSession { .. })
    ));
    let append = store
        .append(append_request(
            "gone",
            1,
            vec![message("gone", 1, "x")],
            2_000,
        ))
        .await;
    assert!(
        matches!(&append, Err(Error::SessionDeleted { .. })),
        "the tombstone must survive a reopen, got {append:?}"
    );
}

/// [`Store::sessions_named`] answers the records of the named sessions the store holds, as
/// listed, and none for an unknown or a deleted id (nor for none asked).
pub async fn sessions_named_reads_the_records_it_holds(store: &dyn Store) {
    session_of(store, "named-a", 2, SessionStatus::Idle).await;
    session_of(store, "named-b", 1, SessionStatus::Running).await;
    session_of(store, "named-gone", 1, SessionStatus::Idle).await;
    if let Err(e) = store.delete_session("named-gone", 500).await {
        panic!("deleting the idle session named-gone must succeed, got {e:?}");
    }
    let ids = ["named-b", "named-gone", "named-unknown", "named-a"].map(str::to_owned);
    let mut named = store
        .sessions_named(&ids)
        .await
        .unwrap_or_else(|e| panic!("sessions_named must succeed, got {e:?}"));
    named.sort_by(|x, y| x.session_id.cmp(&y.session_id));
    let listed: Vec<SessionInfo> = sessions(store)
        .await
        .into_iter()
        .filter(|info| info.session_id.starts_with("named-"))
        .collect();
    assert_eq!(
        named, listed,
        "the records of named-a and named-b, as listed"
    );
    assert_eq!(listed.len(), 2);
    let none = store
        .sessions_named(&[])
        .await
        .unwrap_or_else(|e| panic!("sessions_named of no id must succeed, got {e:?}"));
    assert_eq!(none, vec![]);
}

/// [`Store::deleted_sessions`] lists the deleted ids, ordered. [`Store::record_deleted`]
/// records a deletion made elsewhere (the id is then listed, and takes no append), or, on a
/// store that cannot hold a tombstone without a history, changes nothing; it never deletes
/// a session the store holds.
pub async fn deleted_sessions_are_listed_and_recorded(store: &dyn Store) {
    for id in ["tomb-b", "tomb-a", "tomb-live"] {
        session_of(store, id, 1, SessionStatus::Idle).await;
    }
    for id in ["tomb-b", "tomb-a"] {
        if let Err(e) = store.delete_session(id, 20).await {
            panic!("deleting {id} must succeed, got {e:?}");
        }
    }
    assert_eq!(deleted_ids(store).await, ["tomb-a", "tomb-b"]);

    match store.record_deleted("tomb-live", 30).await {
        Err(Error::InvalidEvent { session_id, .. }) if session_id == "tomb-live" => {}
        Ok(false) => {}
        other => panic!("a live session's id must not be recorded as deleted, got {other:?}"),
    }
    assert_eq!(
        history(store, "tomb-live").await.len(),
        1,
        "tomb-live is intact"
    );

    let recorded = store
        .record_deleted("tomb-elsewhere", 30)
        .await
        .unwrap_or_else(|e| panic!("recording a deletion must succeed or decline, got {e:?}"));
    if recorded {
        assert_eq!(
            deleted_ids(store).await,
            ["tomb-a", "tomb-b", "tomb-elsewhere"]
        );
        let reused = store
            .append(append_request(
                "tomb-elsewhere",
                1,
                vec![message("tomb-elsewhere", 1, "x")],
                40,
            ))
            .await;
        assert!(
            matches!(&reused, Err(Error::SessionDeleted { .. })),
            "an id recorded as deleted takes no append, got {reused:?}"
        );
        assert!(matches!(store.record_deleted("tomb-a", 50).await, Ok(true)));
    } else {
        assert_eq!(
            deleted_ids(store).await,
            ["tomb-a", "tomb-b"],
            "nothing recorded"
        );
    }
}

/// The deleted ids of the checks of [`deleted_sessions_are_listed_and_recorded`].
async fn deleted_ids(store: &dyn Store) -> Vec<String> {
    store
        .deleted_sessions()
        .await
        .unwrap_or_else(|e| panic!("deleted_sessions must succeed, got {e:?}"))
        .into_iter()
        .filter(|id| id.starts_with("tomb-"))
        .collect()
}
