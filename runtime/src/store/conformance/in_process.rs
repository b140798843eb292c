//! The conformance checks of [`Store::lease_tasks_in_process`]: a lease for a worker of this
//! process is a lease like any other (attempts, expiry, fencing, the record it leaves), and
//! the next durable write carries it to the disk, so that a reopen never hands its fencing
//! token out again.

use super::{append_request, lease_states, message, must_append, new_task, task_id};
use crate::error::Error;
use crate::store::{Lease, LeaseHolder, Store, TaskFilter, TaskKind};
use std::sync::Arc;

async fn lease_here(store: &dyn Store, now_ms: u64, lease_ms: u64, max: usize) -> Vec<Lease> {
    store
        .lease_tasks_in_process(now_ms, lease_ms, max, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| {
            panic!("lease_tasks_in_process({now_ms}, {lease_ms}, {max}) must succeed, got {e:?}")
        })
}

/// An in-process lease takes the oldest visible task, bumps its attempt, holds it until now +
/// lease, and fences like a durable lease: a completion with an older attempt or after the
/// expiry is `LeaseLost`, one with the current attempt completes it; a durable lease and an
/// in-process one never hand out the same task.
pub async fn in_process_leases_fence_like_durable_ones(store: &dyn Store) {
    let s = "here";
    let (t1, t2) = (task_id(s, 1), task_id(s, 2));
    let mut request = append_request(s, 1, vec![message(s, 1, "go")], 0);
    request.enqueue = vec![
        new_task(&t1, TaskKind::Model, 100),
        new_task(&t2, TaskKind::Tool, 200),
    ];
    must_append(store, request, "enqueue two tasks").await;
    let first = lease_here(store, 1_000, 500, 1).await;
    assert_eq!(
        first,
        vec![Lease {
            id: t1.clone(),
            kind: TaskKind::Model,
            lease_attempt: 1,
            expires_at_ms: 1_500
        }],
        "an in-process lease takes the oldest visible task, attempt 1, until now + lease"
    );
    let durable = store
        .lease_tasks(1_000, 500, 10, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("lease_tasks must succeed, got {e:?}"));
    assert_eq!(
        durable.iter().map(|l| &l.id).collect::<Vec<_>>(),
        vec![&t2],
        "a durable lease does not take the task leased in process"
    );
    assert_eq!(
        lease_states(store).await,
        vec![(t1.clone(), 1_500, 1, true), (t2.clone(), 1_500, 1, true)],
        "an in-process lease leaves the same record as a durable one"
    );
    let mut stale = append_request(s, 2, vec![message(s, 2, "stale")], 1_100);
    stale.complete = vec![(t1.clone(), 0)];
    assert!(
        matches!(store.append(stale).await, Err(Error::LeaseLost { .. })),
        "a completion with an attempt older than the in-process lease is LeaseLost"
    );
    let mut late = append_request(s, 2, vec![message(s, 2, "late")], 1_500);
    late.complete = vec![(t1.clone(), 1)];
    assert!(
        matches!(store.append(late).await, Err(Error::LeaseLost { .. })),
        "a completion at the in-process lease's expiry is LeaseLost"
    );
    let mut current = append_request(s, 2, vec![message(s, 2, "done")], 1_499);
    current.complete = vec![(t1.clone(), 1)];
    must_append(
        store,
        current,
        "a completion of the current in-process lease",
    )
    .await;
    assert_eq!(
        lease_states(store).await,
        vec![(t2, 1_500, 1, true)],
        "the completion removed the task leased in process"
    );
}

/// The next durable write makes an in-process lease durable: after a reopen its task still
/// has the attempt, so the next lease of it (after the leases are released, as an embedded
/// store does when it opens) has a higher one.
pub async fn an_in_process_lease_is_durable_after_the_next_write<S: Store>(
    store: S,
    reopen: &mut dyn FnMut(S) -> S,
) {
    let s = "here-reopen";
    let t1 = task_id(s, 1);
    let mut request = append_request(s, 1, vec![message(s, 1, "go")], 0);
    request.enqueue = vec![new_task(&t1, TaskKind::Tool, 0)];
    must_append(&store, request, "enqueue a task").await;
    assert_eq!(
        lease_here(&store, 10, 60_000, 1).await.len(),
        1,
        "the task is leased in process"
    );
    let other = "here-other";
    must_append(
        &store,
        append_request(other, 1, vec![message(other, 1, "after")], 20),
        "a durable write after the lease",
    )
    .await;
    let store = reopen(store);
    assert_eq!(
        lease_states(&store).await,
        vec![(t1.clone(), 60_010, 1, true)],
        "the write after the in-process lease made it durable"
    );
    let released = store
        .release_leases(30)
        .await
        .unwrap_or_else(|e| panic!("release_leases must succeed, got {e:?}"));
    assert_eq!(released, 1, "the lease from before the reopen is released");
    let again = lease_here(&store, 40, 60_000, 1).await;
    assert_eq!(
        again
            .iter()
            .map(|l| (&l.id, l.lease_attempt))
            .collect::<Vec<_>>(),
        vec![(&t1, 2)],
        "the lease after the reopen has a higher attempt than the one before it"
    );
}

/// An append with a lease ([`Store::append_and_lease`]) leases, at the append's time and
/// after it, at most `max` tasks the filter accepts, oldest first, the ones it queued among
/// them (a store may lease none: sled does for a worker of this process, where it did not
/// pay); what it does not lease stays queued for any worker. An append that fails leases nothing and changes nothing.
pub async fn append_and_lease_takes_what_the_append_queued(store: &dyn Store) {
    use crate::store::{LeaseRequest, SessionStatus};
    let s = "eager";
    let (t2, t3) = (task_id(s, 2), task_id(s, 3));
    let next = LeaseRequest {
        filter: Arc::new(TaskFilter::any()),
        max: 1,
        lease_ms: 1_000,
        holder: LeaseHolder::InProcess,
    };
    let mut conflict = append_request(s, 2, vec![message(s, 2, "wrong seq")], 100);
    conflict.enqueue = vec![new_task(&t2, TaskKind::Tool, 100)];
    assert!(
        matches!(
            store.append_and_lease(conflict, &next).await,
            Err(Error::Conflict { .. })
        ),
        "an append at the wrong seq fails whole"
    );
    assert_eq!(lease_states(store).await, vec![], "and leases nothing");
    let mut request = append_request(
        s,
        1,
        vec![message(s, 1, "go"), message(s, 2, "x"), message(s, 3, "y")],
        100,
    );
    request.status = SessionStatus::Running;
    request.enqueue = vec![
        new_task(&t2, TaskKind::Tool, 100),
        new_task(&t3, TaskKind::Tool, 100),
    ];
    let leased = store
        .append_and_lease(request, &next)
        .await
        .unwrap_or_else(|e| panic!("append_and_lease must succeed, got {e:?}"));
    let eager = Lease {
        id: t2.clone(),
        kind: TaskKind::Tool,
        lease_attempt: 1,
        expires_at_ms: 1_100,
    };
    let (states, left) = match leased.as_slice() {
        [] => (
            vec![(t2.clone(), 100, 0, false), (t3.clone(), 100, 0, false)],
            vec![&t2, &t3],
        ),
        [one] => {
            assert_eq!(
                one, &eager,
                "the append's oldest queued task is leased with it, until its now + lease"
            );
            (
                vec![(t2.clone(), 1_100, 1, true), (t3.clone(), 100, 0, false)],
                vec![&t3],
            )
        }
        more => panic!("max 1 leases one task at most, got {more:?}"),
    };
    assert_eq!(
        lease_states(store).await,
        states,
        "what the append did not lease stays queued"
    );
    assert_eq!(
        lease_here(store, 100, 1_000, 10)
            .await
            .iter()
            .map(|l| &l.id)
            .collect::<Vec<_>>(),
        left,
        "a lease takes the tasks the append left"
    );
}

/// An append with a lease for a worker elsewhere ([`LeaseHolder::Remote`]) answers only
/// leases that are durable: with no write after it, a reopen still finds each answered lease
/// held at its attempt, so the next lease of the task has a higher one.
pub async fn a_remote_eager_lease_is_durable_when_answered<S: Store>(
    store: S,
    reopen: &mut dyn FnMut(S) -> S,
) {
    use crate::store::{LeaseRequest, SessionStatus};
    let s = "eager-remote";
    let t2 = task_id(s, 2);
    let mut request = append_request(s, 1, vec![message(s, 1, "go"), message(s, 2, "x")], 100);
    request.status = SessionStatus::Running;
    request.enqueue = vec![new_task(&t2, TaskKind::Tool, 100)];
    let next = LeaseRequest {
        filter: Arc::new(TaskFilter::any()),
        max: 1,
        lease_ms: 60_000,
        holder: LeaseHolder::Remote,
    };
    let leased = store
        .append_and_lease(request, &next)
        .await
        .unwrap_or_else(|e| panic!("append_and_lease must succeed, got {e:?}"));
    let store = reopen(store);
    let expected = match leased.as_slice() {
        [] => vec![(t2.clone(), 100, 0, false)],
        [one] => {
            assert_eq!(
                (&one.id, one.lease_attempt, one.expires_at_ms),
                (&t2, 1, 60_100),
                "the append's task is leased with it"
            );
            vec![(t2.clone(), 60_100, 1, true)]
        }
        more => panic!("max 1 leases one task at most, got {more:?}"),
    };
    assert_eq!(
        lease_states(&store).await,
        expected,
        "an answered remote lease is on the disk with no write after it"
    );
}
