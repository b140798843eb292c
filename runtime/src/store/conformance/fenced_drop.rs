//! The conformance checks of [`AppendRequest::drop_if_unchanged`]: the drop with which the
//! engine's timers record an overdue attempt. The timers read the overdue tasks first and
//! append later; a worker may lease the task in between (its clock read before the deadline),
//! renew its lease, or have it released, and then the append must change nothing at all.
//!
//! [`AppendRequest::drop_if_unchanged`]: crate::store::AppendRequest::drop_if_unchanged

use super::{
    append_request, history, lease_states, message, must_append, overdue, routed_task, snapshot,
    task_id, tasks,
};
use crate::error::Error;
use crate::store::{
    AppendRequest, Overdue, SessionStatus, Store, Task, TaskFence, TaskFilter, TaskId, TaskKind,
};

/// The overdue task `id` as [`Store::overdue_tasks`] gives it at `now_ms`, overdue for `why`.
async fn read_overdue(store: &dyn Store, id: &TaskId, now_ms: u64, why: Overdue) -> Task {
    let listed = overdue(store, now_ms, 100).await;
    let Some(task) = listed.into_iter().find(|t| t.id == *id) else {
        panic!("task {id} must be overdue at {now_ms}");
    };
    assert_eq!(
        task.overdue(now_ms),
        Some(why),
        "task {id} is overdue at {now_ms} for the reason the check expects"
    );
    task
}

/// The timer's append for `task`: the event recording its failure (here a message at
/// `seq`), dropping the task only if it is still as read.
fn timer_append(task: &Task, seq: u64, now_ms: u64) -> AppendRequest {
    let s = &task.id.session_id;
    let mut request = append_request(s, seq, vec![message(s, seq, "timed out")], now_ms);
    request.drop_if_unchanged = Some(TaskFence::of(task));
    request
}

/// Appends the timer's `request`, which must be refused with `LeaseLost` (a stale report the
/// engine's timers skip) and change nothing the store shows: sessions, histories, tasks.
async fn must_refuse(store: &dyn Store, request: AppendRequest, what: &str) {
    let before = snapshot(store).await;
    match store.append(request).await {
        Err(e @ Error::LeaseLost { .. }) => assert!(e.is_stale_report()),
        other => panic!("{what}: the fenced drop must be refused with LeaseLost, got {other:?}"),
    }
    assert_eq!(
        snapshot(store).await,
        before,
        "{what}: a refused fenced drop changes nothing (no event, no session, no task change)"
    );
}

/// A session `s` with tasks at seqs 1..=`count`, each visible at its seq (so the oldest
/// first is seq order) with a start deadline at 100.
async fn session_with_tasks(store: &dyn Store, s: &str, count: u64) -> Vec<TaskId> {
    let ids: Vec<TaskId> = (1..=count).map(|seq| task_id(s, seq)).collect();
    let events = (1..=count)
        .map(|seq| message(s, seq, "scheduled"))
        .collect();
    let mut request = append_request(s, 1, events, 0);
    request.enqueue = ids
        .iter()
        .map(|id| {
            routed_task(
                id,
                TaskKind::Tool,
                id.scheduled_seq,
                "default",
                "",
                Some(100),
            )
        })
        .collect();
    must_append(store, request, "enqueueing the tasks").await;
    ids
}

/// A fenced drop of a task still as the timer read it — never leased and past its start
/// deadline, or held past its lease's expiry — lands whole: its event is recorded and the
/// task is gone, never leased again.
pub async fn a_fenced_drop_removes_an_unchanged_overdue_task(store: &dyn Store) {
    let s = "fence-unchanged";
    let ids = session_with_tasks(store, s, 2).await;
    let (lapsed, not_started) = (&ids[0], &ids[1]);
    let leases = store
        .lease_tasks(10, 50, 1, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("lease_tasks must succeed, got {e:?}"));
    assert_eq!(
        leases.iter().map(|l| &l.id).collect::<Vec<_>>(),
        vec![lapsed],
        "the oldest task is leased, until 60, and its lease lapses"
    );

    let task = read_overdue(store, not_started, 200, Overdue::NotStarted).await;
    must_append(
        store,
        timer_append(&task, 3, 200),
        "the fenced drop of a task never leased, past its start deadline",
    )
    .await;
    let task = read_overdue(store, lapsed, 200, Overdue::LeaseLapsed).await;
    must_append(
        store,
        timer_append(&task, 4, 200),
        "the fenced drop of a task whose lease lapsed",
    )
    .await;
    assert_eq!(tasks(store).await, vec![], "both fenced tasks are dropped");
    assert_eq!(
        history(store, s).await.len(),
        4,
        "both timers' events are recorded"
    );
    assert_eq!(
        store
            .lease_tasks(10_000, 50, 10, &TaskFilter::any())
            .await
            .unwrap_or_else(|e| panic!("lease_tasks must succeed, got {e:?}")),
        vec![],
        "a dropped task is never leased again"
    );
}

/// A fenced drop of a task a worker leased after the timer read it (a worker whose clock
/// read came before the start deadline; durably or in process) is refused, and the lease
/// stands: its completion lands.
pub async fn a_fenced_drop_of_a_task_leased_since_is_refused(store: &dyn Store) {
    let s = "fence-leased";
    let ids = session_with_tasks(store, s, 2).await;
    let remote = read_overdue(store, &ids[0], 100, Overdue::NotStarted).await;
    let here = read_overdue(store, &ids[1], 100, Overdue::NotStarted).await;
    let leased = store
        .lease_tasks(99, 1_000, 1, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("lease_tasks must succeed, got {e:?}"));
    assert_eq!(
        leased
            .iter()
            .map(|l| (&l.id, l.lease_attempt))
            .collect::<Vec<_>>(),
        vec![(&ids[0], 1)],
        "a lease at 99 takes the first task, before its deadline"
    );
    let leased_here = store
        .lease_tasks_in_process(99, 1_000, 1, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("lease_tasks_in_process must succeed, got {e:?}"));
    assert_eq!(
        leased_here
            .iter()
            .map(|l| (&l.id, l.lease_attempt))
            .collect::<Vec<_>>(),
        vec![(&ids[1], 1)],
        "an in-process lease at 99 takes the second task"
    );
    must_refuse(
        store,
        timer_append(&remote, 3, 100),
        "the fenced drop of a task leased since it was read",
    )
    .await;
    must_refuse(
        store,
        timer_append(&here, 3, 100),
        "the fenced drop of a task leased in process since it was read",
    )
    .await;
    assert_eq!(
        lease_states(store).await,
        vec![
            (ids[0].clone(), 1_099, 1, true),
            (ids[1].clone(), 1_099, 1, true)
        ],
        "both leases stand"
    );
    for (n, id) in ids.iter().enumerate() {
        let seq = 3 + n as u64;
        let mut report = append_request(s, seq, vec![message(s, seq, "done")], 150);
        report.complete = vec![(id.clone(), 1)];
        must_append(
            store,
            report,
            "the completion of a lease a refused fenced drop left",
        )
        .await;
    }
    assert_eq!(tasks(store).await, vec![], "both completions landed");
}

/// A fenced drop of a lapsed lease that its worker renewed after the timer read it (a
/// heartbeat whose clock read came before the expiry) is refused, and the renewed lease
/// stands: its completion lands.
pub async fn a_fenced_drop_of_a_task_renewed_since_is_refused(store: &dyn Store) {
    let s = "fence-renewed";
    let ids = session_with_tasks(store, s, 1).await;
    let t = &ids[0];
    let leased = store
        .lease_tasks(10, 100, 1, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("lease_tasks must succeed, got {e:?}"));
    assert_eq!(leased.len(), 1, "the task is leased until 110");
    let task = read_overdue(store, t, 110, Overdue::LeaseLapsed).await;
    let renewed = store
        .extend_lease(t, 1, 109, 100, None)
        .await
        .unwrap_or_else(|e| panic!("a heartbeat at 109 must renew the lease, got {e:?}"));
    assert_eq!(renewed, 209);
    must_refuse(
        store,
        timer_append(&task, 2, 110),
        "the fenced drop of a lease renewed since it was read",
    )
    .await;
    assert_eq!(
        lease_states(store).await,
        vec![(t.clone(), 209, 1, true)],
        "the renewed lease stands"
    );
    let mut report = append_request(s, 2, vec![message(s, 2, "done")], 150);
    report.complete = vec![(t.clone(), 1)];
    report.status = SessionStatus::Idle;
    must_append(store, report, "the completion of the renewed lease").await;
    assert_eq!(tasks(store).await, vec![]);
}

/// A fenced drop of a lapsed lease released after the timer read it (its expiry and attempt
/// unchanged, only no longer held), then leased again at the next attempt, is refused either
/// way; so is one of a task cancelled since it was read.
pub async fn a_fenced_drop_of_a_task_released_or_gone_since_is_refused(store: &dyn Store) {
    let s = "fence-released";
    let ids = session_with_tasks(store, s, 2).await;
    let (released, cancelled) = (&ids[0], &ids[1]);
    let leased = store
        .lease_tasks(10, 100, 1, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("lease_tasks must succeed, got {e:?}"));
    assert_eq!(leased.len(), 1, "the first task is leased until 110");
    let lapsed = read_overdue(store, released, 200, Overdue::LeaseLapsed).await;
    let not_started = read_overdue(store, cancelled, 200, Overdue::NotStarted).await;

    let count = store
        .release_leases(200)
        .await
        .unwrap_or_else(|e| panic!("release_leases must succeed, got {e:?}"));
    assert_eq!(count, 1, "the lapsed lease is released");
    assert_eq!(
        lease_states(store).await[0],
        (released.clone(), 110, 1, false),
        "a released lapsed lease keeps its expiry and attempt, no longer held"
    );
    must_refuse(
        store,
        timer_append(&lapsed, 3, 200),
        "the fenced drop of a lapsed lease released since it was read",
    )
    .await;
    let again = store
        .lease_tasks(200, 100, 1, &TaskFilter::any())
        .await
        .unwrap_or_else(|e| panic!("lease_tasks must succeed, got {e:?}"));
    assert_eq!(
        again
            .iter()
            .map(|l| (&l.id, l.lease_attempt))
            .collect::<Vec<_>>(),
        vec![(released, 2)],
        "the released task is leased again at the next attempt"
    );
    must_refuse(
        store,
        timer_append(&lapsed, 3, 200),
        "the fenced drop of a lapsed lease leased again since it was read",
    )
    .await;

    let mut cancel = append_request(s, 3, vec![message(s, 3, "cancelled")], 200);
    cancel.cancel = vec![cancelled.clone()];
    must_append(store, cancel, "cancelling the second task").await;
    must_refuse(
        store,
        timer_append(&not_started, 4, 200),
        "the fenced drop of a task cancelled since it was read",
    )
    .await;
    assert_eq!(
        lease_states(store).await,
        vec![(released.clone(), 300, 2, true)],
        "the new lease stands"
    );
}
