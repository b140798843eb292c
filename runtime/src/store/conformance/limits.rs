//! The conformance checks at the edges of the values a request may carry: times as far off as
//! a `u64` holds (a deadline of now plus a timeout meant as "never") are taken by every store
//! and mean "never", and an append expecting seq 0, which no session can have next, is refused
//! by every store alike.

use super::{append_request, history, message, must_append, overdue, routed_task, task_id, tasks};
use crate::error::Error;
use crate::store::{LeaseHolder, LeaseRequest, SessionStatus, Store, TaskFilter, TaskKind};
use std::sync::Arc;

/// A time past every real one, but far from the end of a `u64`.
const YEAR_30000_MS: u64 = 884_541_340_800_000;

/// A task visible and due only at `u64::MAX` is stored, never leased and never overdue, and an
/// append whose lease would end past `u64::MAX` stores its events (and any lease it answers
/// ends as late as a time can say).
pub async fn far_off_times_are_taken_and_mean_never(store: &dyn Store) {
    let s = "far-off";
    let never = task_id(s, 1);
    let mut request = append_request(s, 1, vec![message(s, 1, "x")], 10);
    request.enqueue = vec![routed_task(
        &never,
        TaskKind::Tool,
        u64::MAX,
        "default",
        "",
        Some(u64::MAX),
    )];
    must_append(store, request, "a task visible and due at u64::MAX").await;
    let listed = tasks(store).await;
    assert!(
        listed.len() == 1
            && listed[0].id == never
            && listed[0].visible_at_ms >= i64::MAX as u64
            && listed[0]
                .start_by_ms
                .is_some_and(|ms| ms >= i64::MAX as u64),
        "the far-off task is stored with its far-off times: {listed:?}"
    );
    let leased = store
        .lease_tasks(YEAR_30000_MS, 100, 10, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("lease_tasks must succeed, got {e:?}"));
    assert_eq!(leased, vec![], "a task visible at u64::MAX is never leased");
    assert_eq!(
        overdue(store, YEAR_30000_MS, 10).await,
        vec![],
        "a task due at u64::MAX is never overdue"
    );

    let due = task_id(s, 2);
    let request = crate::store::AppendRequest {
        enqueue: vec![routed_task(&due, TaskKind::Tool, 0, "default", "", None)],
        ..append_request(s, 2, vec![message(s, 2, "y")], 20)
    };
    let next = LeaseRequest {
        filter: Arc::new(TaskFilter::any()),
        max: 1,
        lease_ms: u64::MAX,
        holder: LeaseHolder::Remote,
    };
    let leases = store
        .append_and_lease(request, &next)
        .await
        .unwrap_or_else(|e| panic!("an append with a lease until past u64::MAX, got {e:?}"));
    // A store may lease nothing with an append (sled does not); one that does leases the
    // task this append queued, for as long as a time can say.
    assert!(
        leases
            .iter()
            .all(|l| l.id == due && l.expires_at_ms >= i64::MAX as u64),
        "{leases:?}"
    );
    assert_eq!(history(store, s).await.len(), 2, "both appends are stored");
}

/// An append expecting seq 0 next is refused with `InvalidEvent` at seq 0, with events or
/// without, and writes nothing: seqs start at 1.
pub async fn an_append_expecting_seq_0_is_refused(store: &dyn Store) {
    let s = "zero";
    for (events, what) in [
        (Vec::new(), "no events"),
        (vec![message(s, 0, "x")], "an event at seq 0"),
    ] {
        let mut request = append_request(s, 0, events, 10);
        request.status = SessionStatus::Idle;
        request.enqueue = vec![routed_task(
            &task_id(s, 1),
            TaskKind::Tool,
            0,
            "default",
            "",
            None,
        )];
        match store.append(request).await {
            Err(Error::InvalidEvent {
                session_id, seq: 0, ..
            }) if session_id == s => {}
            other => panic!("an append expecting seq 0 with {what} must be refused, got {other:?}"),
        }
    }
    assert_eq!(
        tasks(store).await,
        vec![],
        "a refused append queues nothing"
    );
    assert!(
        matches!(
            store.read_history(s, 1, None).await,
            Err(Error::UnknownSession { .. })
        ),
        "a refused append makes no session"
    );
}
