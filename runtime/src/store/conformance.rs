//! The store conformance suite: the behaviour every [`Store`] backend must share with the
//! reference [`MemoryStore`](super::memory::MemoryStore).
//!
//! Each check is a public async function that takes a fresh, empty store and panics, with a
//! message saying what the contract requires, when the store disagrees. [`run_all`] runs them
//! all given a factory of fresh stores and, for durable backends, a function that closes a
//! store and opens it again from its files. The checks pass explicit `now_ms` values, so they
//! never depend on the wall clock. Backends run them in their unit tests; other crates get the
//! module with the `conformance` feature.

use super::TaskKind;
use super::{
    AppendRequest, Lease, NewTask, Overdue, SessionInfo, SessionStatus, Store, Task, TaskFilter,
    TaskId,
};
use crate::error::Error;
use crate::event::{ErrorClass, Event, EventEnvelope};
use cairn_ledger::JsonText;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

mod concurrency;
mod deletion;
mod fenced_drop;
mod in_process;
mod limits;
pub use concurrency::{
    a_lapsed_lease_changes_nothing, concurrent_leases_hand_each_task_once,
    racing_appends_on_two_handles, two_engines_on_one_store,
};
pub use deletion::{
    a_deletion_is_seen_through_another_handle, a_deletion_survives_a_reopen,
    delete_refuses_a_busy_session, delete_removes_a_finished_session,
    deleted_sessions_are_listed_and_recorded, sessions_named_reads_the_records_it_holds,
};
pub use fenced_drop::{
    a_fenced_drop_of_a_task_leased_since_is_refused,
    a_fenced_drop_of_a_task_released_or_gone_since_is_refused,
    a_fenced_drop_of_a_task_renewed_since_is_refused,
    a_fenced_drop_removes_an_unchanged_overdue_task,
};
pub use in_process::{
    a_remote_eager_lease_is_durable_when_answered,
    an_in_process_lease_is_durable_after_the_next_write,
    append_and_lease_takes_what_the_append_queued, in_process_leases_fence_like_durable_ones,
};
pub use limits::{an_append_expecting_seq_0_is_refused, far_off_times_are_taken_and_mean_never};

/// Runs every check, each on a store from `fresh`. With `reopen` (a function that drops a store
/// and opens the same storage again), also checks that everything survives a reopen.
///
/// [`concurrent_appends`] spawns tokio tasks: call this from a multi-threaded runtime to make
/// them really concurrent. The concurrency checks (two handles on one store) run here with
/// one handle passed twice; a backend with a second handle (another connection pool, like
/// another process) runs them with it as well.
pub async fn run_all<S: Store>(
    mut fresh: impl FnMut() -> S,
    reopen: Option<&mut dyn FnMut(S) -> S>,
) {
    append_read_round_trip(&fresh()).await;
    conflict_on_wrong_expected_seq(&fresh()).await;
    batch_with_wrong_seq_is_rejected(&fresh()).await;
    unknown_and_invalid_sessions(&fresh()).await;
    list_sessions_ordered_with_status(&fresh()).await;
    empty_appends(&fresh()).await;
    large_events_round_trip(&fresh()).await;
    enqueue_and_lease(&fresh()).await;
    reenqueue_replaces_task(&fresh()).await;
    duplicate_ids_in_one_enqueue_keep_the_last(&fresh()).await;
    complete_with_current_lease(&fresh()).await;
    complete_with_stale_attempt_writes_nothing(&fresh()).await;
    complete_after_expiry_is_lost(&fresh()).await;
    complete_several_tasks_in_one_append(&fresh()).await;
    cancel_removes_tasks(&fresh()).await;
    a_task_is_looked_up_by_id(&fresh()).await;
    extend_lease(&fresh()).await;
    release_leases_keeps_attempts(&fresh()).await;
    lease_filters_by_queue_target_session_and_namespace(&fresh()).await;
    overdue_tasks_are_listed_and_never_leased(&fresh()).await;
    heartbeat_details_are_kept_until_the_next_lease(&fresh()).await;
    released_tasks_are_leased_again_and_not_overdue(&fresh()).await;
    delete_removes_a_finished_session(&fresh()).await;
    delete_refuses_a_busy_session(&fresh()).await;
    sessions_named_reads_the_records_it_holds(&fresh()).await;
    deleted_sessions_are_listed_and_recorded(&fresh()).await;
    durable_commits_count_what_was_made_durable(&fresh()).await;
    in_process_leases_fence_like_durable_ones(&fresh()).await;
    append_and_lease_takes_what_the_append_queued(&fresh()).await;
    a_fenced_drop_removes_an_unchanged_overdue_task(&fresh()).await;
    a_fenced_drop_of_a_task_leased_since_is_refused(&fresh()).await;
    a_fenced_drop_of_a_task_renewed_since_is_refused(&fresh()).await;
    a_fenced_drop_of_a_task_released_or_gone_since_is_refused(&fresh()).await;
    far_off_times_are_taken_and_mean_never(&fresh()).await;
    an_append_expecting_seq_0_is_refused(&fresh()).await;
    concurrent_appends(Arc::new(fresh())).await;
    let twice = |store: S| {
        let store: Arc<dyn Store> = Arc::new(store);
        (store.clone(), store)
    };
    let (a, b) = twice(fresh());
    concurrent_leases_hand_each_task_once(a, b).await;
    let (a, b) = twice(fresh());
    a_lapsed_lease_changes_nothing(a, b).await;
    let (a, b) = twice(fresh());
    racing_appends_on_two_handles(a, b).await;
    let (a, b) = twice(fresh());
    two_engines_on_one_store(a, b).await;
    let (a, b) = twice(fresh());
    a_deletion_is_seen_through_another_handle(a, b).await;
    if let Some(reopen) = reopen {
        reopen_keeps_everything(fresh(), &mut *reopen).await;
        a_deletion_survives_a_reopen(fresh(), &mut *reopen).await;
        an_in_process_lease_is_durable_after_the_next_write(fresh(), reopen).await;
        a_remote_eager_lease_is_durable_when_answered(fresh(), reopen).await;
    }
}

/// `len` letters picked by a xorshift from `seed`: a text that compression shrinks only to
/// about three quarters (6 bits a letter), for events that must stay large once stored (records
/// are compressed: a repeated letter would make a large event a small record).
pub fn incompressible_text(seed: u64, len: usize) -> String {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/";
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            LETTERS[(state % 64) as usize] as char
        })
        .collect()
}

/// A user message event (the payload is irrelevant to stores, only its round trip matters).
pub fn message(session_id: &str, seq: u64, text: &str) -> EventEnvelope {
    EventEnvelope::new(
        session_id,
        seq,
        1_000 + seq,
        Event::UserMessage {
            idempotency_key: None,
            tool_choice: None,
            turn: 1,
            text: text.to_owned(),
            model: None,
            media: Vec::new(),
        },
    )
}

/// An append of `events` at `expected_next_seq`, status running, no task changes, at `now_ms`.
pub fn append_request(
    session_id: &str,
    expected_next_seq: u64,
    events: Vec<EventEnvelope>,
    now_ms: u64,
) -> AppendRequest {
    AppendRequest::new(
        session_id,
        expected_next_seq,
        events,
        SessionStatus::Running,
        now_ms,
    )
}

fn task_id(session_id: &str, scheduled_seq: u64) -> TaskId {
    TaskId {
        session_id: session_id.to_owned(),
        scheduled_seq,
    }
}

fn new_task(id: &TaskId, kind: TaskKind, visible_at_ms: u64) -> NewTask {
    NewTask::new(id.clone(), kind, visible_at_ms)
}

fn routed_task(
    id: &TaskId,
    kind: TaskKind,
    visible_at_ms: u64,
    queue: &str,
    target: &str,
    start_by_ms: Option<u64>,
) -> NewTask {
    NewTask {
        queue: queue.to_owned(),
        target: target.to_owned(),
        start_by_ms,
        ..NewTask::new(id.clone(), kind, visible_at_ms)
    }
}

/// The fields of a task record that these checks leave at their new-task values.
fn unleased() -> Task {
    Task::queued(&NewTask::new(
        TaskId {
            session_id: String::new(),
            scheduled_seq: 0,
        },
        TaskKind::Model,
        0,
    ))
}

/// Appends and panics with `what` when the store refuses.
async fn must_append(store: &dyn Store, request: AppendRequest, what: &str) {
    if let Err(e) = store.append(request).await {
        panic!("{what}: the append must succeed, got {e:?}");
    }
}

async fn history(store: &dyn Store, session_id: &str) -> Vec<EventEnvelope> {
    match store.read_history(session_id, 1, None).await {
        Ok(events) => events,
        Err(e) => panic!("reading the history of {session_id:?} must succeed, got {e:?}"),
    }
}

async fn sessions(store: &dyn Store) -> Vec<SessionInfo> {
    store
        .list_sessions()
        .await
        .unwrap_or_else(|e| panic!("list_sessions must succeed, got {e:?}"))
}

/// Every queued task, as `list_tasks` lists it; checks on the way that `task` looks up each
/// of them as listed, so that every check's states test the lookup too.
async fn tasks(store: &dyn Store) -> Vec<Task> {
    let listed = store
        .list_tasks()
        .await
        .unwrap_or_else(|e| panic!("list_tasks must succeed, got {e:?}"));
    for task in &listed {
        assert_eq!(
            looked_up(store, &task.id).await.as_ref(),
            Some(task),
            "task({}) must give the task as list_tasks lists it",
            task.id
        );
    }
    listed
}

async fn looked_up(store: &dyn Store, id: &TaskId) -> Option<Task> {
    store
        .task(id)
        .await
        .unwrap_or_else(|e| panic!("task({id}) must succeed, got {e:?}"))
}

async fn lease(store: &dyn Store, now_ms: u64, lease_ms: u64, max: usize) -> Vec<Lease> {
    lease_where(store, now_ms, lease_ms, max, &TaskFilter::any()).await
}

async fn lease_where(
    store: &dyn Store,
    now_ms: u64,
    lease_ms: u64,
    max: usize,
    filter: &TaskFilter,
) -> Vec<Lease> {
    store
        .lease_tasks(now_ms, lease_ms, max, filter)
        .await
        .unwrap_or_else(|e| {
            panic!("lease_tasks({now_ms}, {lease_ms}, {max}, {filter:?}) must succeed, got {e:?}")
        })
}

async fn overdue(store: &dyn Store, now_ms: u64, max: usize) -> Vec<Task> {
    store
        .overdue_tasks(now_ms, max)
        .await
        .unwrap_or_else(|e| panic!("overdue_tasks({now_ms}, {max}) must succeed, got {e:?}"))
}

/// The ids of `tasks` with why each is overdue at `now_ms`.
fn overdue_ids(tasks: &[Task], now_ms: u64) -> Vec<(TaskId, Option<Overdue>)> {
    tasks
        .iter()
        .map(|t| (t.id.clone(), t.overdue(now_ms)))
        .collect()
}

/// `(id, visible_at_ms, lease_attempt, held)` of every queued task, ordered by id.
async fn lease_states(store: &dyn Store) -> Vec<(TaskId, u64, u32, bool)> {
    tasks(store)
        .await
        .into_iter()
        .map(|t| (t.id, t.visible_at_ms, t.lease_attempt, t.held))
        .collect()
}

fn json(text: &str) -> JsonText {
    JsonText::parse(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"))
}

fn lease_ids(leases: &[Lease]) -> Vec<(TaskId, u32, u64)> {
    leases
        .iter()
        .map(|l| (l.id.clone(), l.lease_attempt, l.expires_at_ms))
        .collect()
}

fn session(session_id: &str, status: SessionStatus, events: u64, at: u64) -> SessionInfo {
    SessionInfo {
        session_id: session_id.to_owned(),
        status,
        events,
        updated_at_ms: at,
    }
}

/// Appended envelopes read back equal, in seq order; `from_seq` and `limit` select ranges.
pub async fn append_read_round_trip(store: &dyn Store) {
    let s = "round-trip";
    let first = vec![
        message(s, 1, "hello"),
        EventEnvelope::new(
            s,
            2,
            1_002,
            Event::ModelCallScheduled {
                turn: 1,
                round: 0,
                attempt: 1,
                not_before_ms: 0,
            },
        ),
        EventEnvelope::new(
            s,
            3,
            1_003,
            Event::ModelCallFailed {
                turn: 1,
                round: 0,
                attempt: 1,
                failure: crate::event::ActivityFailure::new(
                    ErrorClass::Transient,
                    "connection reset",
                ),
                cost_micros: None,
            },
        ),
    ];
    must_append(
        store,
        append_request(s, 1, first.clone(), 10),
        "first batch",
    )
    .await;
    let second = vec![
        message(s, 4, "ünïcödé ✓"),
        EventEnvelope::new(
            s,
            5,
            1_005,
            Event::TurnFailed {
                turn: 1,
                reason: "gave up".to_owned(),
                budget_exceeded: None,
            },
        ),
    ];
    let mut request = append_request(s, 4, second.clone(), 20);
    request.status = SessionStatus::Idle;
    must_append(store, request, "second batch").await;

    let all: Vec<EventEnvelope> = first.iter().chain(&second).cloned().collect();
    assert_eq!(
        history(store, s).await,
        all,
        "read_history(from 1) must return exactly the appended envelopes, in seq order"
    );
    let read = |from: u64, limit: Option<usize>| async move {
        store
            .read_history(s, from, limit)
            .await
            .unwrap_or_else(|e| panic!("read_history({from}, {limit:?}) failed: {e:?}"))
    };
    assert_eq!(read(0, None).await, all, "from_seq 0 reads from the start");
    assert_eq!(
        read(3, None).await,
        all[2..].to_vec(),
        "from_seq 3 starts at seq 3"
    );
    assert_eq!(
        read(3, Some(2)).await,
        all[2..4].to_vec(),
        "limit 2 from seq 3 gives seqs 3 and 4"
    );
    assert_eq!(read(1, Some(0)).await, vec![], "limit 0 gives nothing");
    assert_eq!(
        read(5, Some(10)).await,
        all[4..].to_vec(),
        "a limit past the end stops at the end"
    );
    assert_eq!(
        read(6, None).await,
        vec![],
        "from past the end gives nothing (not an error)"
    );
    assert_eq!(
        read(u64::MAX, None).await,
        vec![],
        "from u64::MAX gives nothing"
    );
    assert_eq!(
        sessions(store).await,
        vec![session(s, SessionStatus::Idle, 5, 20)],
        "the session lists with the last append's status, its event count and time"
    );
}

/// A wrong `expected_next_seq` fails with `Conflict` naming both seqs, and writes nothing.
pub async fn conflict_on_wrong_expected_seq(store: &dyn Store) {
    let s = "conflict";
    must_append(
        store,
        append_request(s, 1, vec![message(s, 1, "a"), message(s, 2, "b")], 10),
        "first append",
    )
    .await;
    for (expected, what) in [(2, "stale"), (5, "ahead"), (1, "from the start")] {
        let mut request = append_request(s, expected, vec![message(s, expected, "x")], 99);
        request.status = SessionStatus::Cancelled;
        request.enqueue = vec![new_task(&task_id(s, expected), TaskKind::Tool, 0)];
        match store.append(request).await {
            Err(Error::Conflict {
                session_id,
                expected: e,
                actual: 3,
            }) if session_id == s && e == expected => {}
            other => panic!(
                "an append with a {what} expected_next_seq {expected} (the store is at 3) must \
                 fail with Conflict {{ expected: {expected}, actual: 3 }}, got {other:?}"
            ),
        }
    }
    assert_eq!(
        history(store, s).await.len(),
        2,
        "a conflicting append must write no event"
    );
    assert_eq!(
        sessions(store).await,
        vec![session(s, SessionStatus::Running, 2, 10)],
        "a conflicting append must not change the session's status, count or time"
    );
    assert_eq!(
        tasks(store).await,
        vec![],
        "a conflicting append must enqueue nothing"
    );

    match store
        .append(append_request(
            "fresh",
            2,
            vec![message("fresh", 2, "x")],
            5,
        ))
        .await
    {
        Err(Error::Conflict {
            expected: 2,
            actual: 1,
            ..
        }) => {}
        other => panic!("a new session's first append must expect seq 1, got {other:?}"),
    }
    assert!(
        matches!(
            store.read_history("fresh", 1, None).await,
            Err(Error::UnknownSession { .. })
        ),
        "a rejected first append must not create the session"
    );
}

/// A batch whose events do not carry consecutive seqs of the session is rejected whole.
pub async fn batch_with_wrong_seq_is_rejected(store: &dyn Store) {
    let s = "bad-batch";
    let gap = vec![message(s, 1, "a"), message(s, 2, "b"), message(s, 4, "d")];
    match store.append(append_request(s, 1, gap, 1)).await {
        Err(Error::InvalidEvent { seq: 4, .. }) => {}
        other => panic!(
            "a batch with seq 4 at position 2 must fail with InvalidEvent at seq 4, got {other:?}"
        ),
    }
    let foreign = vec![message(s, 1, "a"), message("other", 2, "b")];
    match store.append(append_request(s, 1, foreign, 1)).await {
        Err(Error::InvalidEvent { .. }) => {}
        other => panic!(
            "a batch holding another session's event must fail with InvalidEvent, got {other:?}"
        ),
    }
    assert!(
        matches!(
            store.read_history(s, 1, None).await,
            Err(Error::UnknownSession { .. })
        ),
        "rejected batches must write nothing"
    );
    assert_eq!(
        sessions(store).await,
        vec![],
        "rejected batches must create no session"
    );
    must_append(
        store,
        append_request(s, 1, vec![message(s, 1, "a")], 2),
        "a valid batch after the rejected ones",
    )
    .await;
    assert_eq!(history(store, s).await.len(), 1);
}

/// Reading a session that has no events is `UnknownSession`; invalid ids cannot be appended.
pub async fn unknown_and_invalid_sessions(store: &dyn Store) {
    match store.read_history("nobody", 1, None).await {
        Err(Error::UnknownSession { session_id }) if session_id == "nobody" => {}
        other => panic!("reading a session never appended must fail with UnknownSession naming it, got {other:?}"),
    }
    assert!(
        store.read_history("bad id\0", 1, None).await.is_err(),
        "reading an invalid session id must fail"
    );
    for bad in [
        "",
        "has space",
        "nul\0byte",
        "slash/",
        "x".repeat(129).as_str(),
    ] {
        match store.append(append_request(bad, 1, vec![], 1)).await {
            Err(Error::InvalidSessionId { .. }) => {}
            other => panic!("appending to the invalid session id {bad:?} must fail with InvalidSessionId, got {other:?}"),
        }
    }
    assert_eq!(sessions(store).await, vec![]);
}

/// `list_sessions` orders by id and reports each session's last status, count and time.
pub async fn list_sessions_ordered_with_status(store: &dyn Store) {
    assert_eq!(
        sessions(store).await,
        vec![],
        "a fresh store lists no session"
    );
    let writes = [
        ("b", SessionStatus::Running, 2, 30),
        ("a", SessionStatus::Idle, 1, 20),
        ("c-2", SessionStatus::Cancelled, 3, 10),
        ("c", SessionStatus::Running, 1, 40),
        ("B", SessionStatus::Idle, 1, 50),
    ];
    for (s, status, n, at) in writes {
        let events = (1..=n).map(|seq| message(s, seq, "m")).collect();
        let mut request = append_request(s, 1, events, at);
        request.status = status;
        must_append(store, request, "listing setup").await;
    }
    let mut request = append_request("b", 3, vec![message("b", 3, "m")], 60);
    request.status = SessionStatus::Idle;
    must_append(store, request, "second append to b").await;
    assert_eq!(
        sessions(store).await,
        vec![
            session("B", SessionStatus::Idle, 1, 50),
            session("a", SessionStatus::Idle, 1, 20),
            session("b", SessionStatus::Idle, 3, 60),
            session("c", SessionStatus::Running, 1, 40),
            session("c-2", SessionStatus::Cancelled, 3, 10),
        ],
        "sessions must list in byte order of their ids, with the last append's status, event \
         count and time"
    );
}

/// Appends without events are allowed: they change tasks and, for an existing session, its
/// status and time; on a session with no events they create no session.
pub async fn empty_appends(store: &dyn Store) {
    let s = "empty";
    let t = task_id(s, 1);
    let mut request = append_request(s, 1, vec![], 5);
    request.enqueue = vec![new_task(&t, TaskKind::Model, 0)];
    must_append(store, request, "an empty append to a new session").await;
    assert_eq!(
        sessions(store).await,
        vec![],
        "an empty append must not create a session"
    );
    assert!(matches!(
        store.read_history(s, 1, None).await,
        Err(Error::UnknownSession { .. })
    ));
    assert_eq!(tasks(store).await.len(), 1, "its task changes still apply");

    must_append(
        store,
        append_request(s, 1, vec![message(s, 1, "a")], 10),
        "first event",
    )
    .await;
    let mut request = append_request(s, 2, vec![], 20);
    request.status = SessionStatus::Idle;
    request.cancel = vec![t];
    must_append(store, request, "an empty append that cancels a task").await;
    assert_eq!(
        sessions(store).await,
        vec![session(s, SessionStatus::Idle, 1, 20)],
        "an empty append updates status and time, not the count"
    );
    assert_eq!(tasks(store).await, vec![]);
    must_append(
        store,
        append_request(s, 2, vec![message(s, 2, "b")], 30),
        "next seq is still 2",
    )
    .await;
}

/// Events of hundreds of kilobytes, alone and in big batches, round-trip.
pub async fn large_events_round_trip(store: &dyn Store) {
    let big = large_events_fixture();
    for (s, events) in &big {
        must_append(
            store,
            append_request(s, 1, events.clone(), 7),
            "large events",
        )
        .await;
    }
    for (s, events) in &big {
        assert_eq!(
            &history(store, s).await,
            events,
            "large events of {s:?} must read back equal"
        );
    }
}

fn large_events_fixture() -> Vec<(String, Vec<EventEnvelope>)> {
    let huge = incompressible_text(1, 600 * 1024);
    let many: Vec<EventEnvelope> = (1..=24)
        .map(|seq| {
            let text = format!("{seq}:{}", incompressible_text(seq + 1, 12 * 1024));
            message("many", seq, &text)
        })
        .collect();
    vec![
        (
            "huge".to_owned(),
            vec![message("huge", 1, &huge), message("huge", 2, "small")],
        ),
        ("many".to_owned(), many),
    ]
}

/// Tasks lease oldest first, not before `visible_at_ms`, at most `max`; a lease bumps the
/// attempt, marks the task held and hides it until it expires. A lease that expires while held
/// has lapsed: the task is never leased again (its worker died; the engine records the attempt
/// as failed), and `overdue_tasks` lists it.
pub async fn enqueue_and_lease(store: &dyn Store) {
    let s = "lease";
    let (t1, t2, t3) = (task_id(s, 1), task_id(s, 2), task_id(s, 3));
    let mut request = append_request(s, 1, vec![message(s, 1, "go")], 0);
    request.enqueue = vec![
        new_task(&t1, TaskKind::Model, 1_000),
        new_task(&t2, TaskKind::Tool, 500),
        new_task(&t3, TaskKind::Tool, 2_000),
    ];
    must_append(store, request, "enqueue three tasks").await;
    assert_eq!(
        tasks(store).await,
        vec![
            Task {
                id: t1.clone(),
                kind: TaskKind::Model,
                visible_at_ms: 1_000,
                lease_attempt: 0,
                ..unleased()
            },
            Task {
                id: t2.clone(),
                kind: TaskKind::Tool,
                visible_at_ms: 500,
                lease_attempt: 0,
                ..unleased()
            },
            Task {
                id: t3.clone(),
                kind: TaskKind::Tool,
                visible_at_ms: 2_000,
                lease_attempt: 0,
                ..unleased()
            },
        ],
        "list_tasks gives every queued task, ordered by id, unleased"
    );
    assert_eq!(
        lease(store, 499, 100, 10).await,
        vec![],
        "nothing is visible before 500"
    );
    assert_eq!(
        lease(store, 1_000, 100, 0).await,
        vec![],
        "max 0 leases nothing"
    );
    let first = lease(store, 1_000, 100, 1).await;
    assert_eq!(
        first,
        vec![Lease { id: t2.clone(), kind: TaskKind::Tool, lease_attempt: 1, expires_at_ms: 1_100 }],
        "max 1 leases only the oldest visible task (t2, visible at 500), attempt 1, until now + lease"
    );
    assert_eq!(
        lease_ids(&lease(store, 1_000, 100, 10).await),
        vec![(t1.clone(), 1, 1_100)],
        "the leased t2 is invisible; t3 is not visible yet"
    );
    assert_eq!(
        lease(store, 1_099, 100, 10).await,
        vec![],
        "leases hide tasks until expiry"
    );
    assert_eq!(
        lease_states(store).await,
        vec![
            (t1.clone(), 1_100, 1, true),
            (t2.clone(), 1_100, 1, true),
            (t3.clone(), 2_000, 0, false)
        ],
        "a leased task is held, its visible_at is its lease expiry; t3 is not leased"
    );
    assert_eq!(
        overdue(store, 1_099, 10).await,
        vec![],
        "nothing is overdue while the leases hold"
    );
    assert_eq!(
        lease(store, 1_100, 50, 10).await,
        vec![],
        "lapsed leases (held past their expiry) are never leased again"
    );
    assert_eq!(
        overdue_ids(&overdue(store, 1_100, 10).await, 1_100),
        vec![
            (t1.clone(), Some(Overdue::LeaseLapsed)),
            (t2.clone(), Some(Overdue::LeaseLapsed))
        ],
        "lapsed leases are overdue at their expiry; equal times order by id"
    );
    assert_eq!(
        lease_ids(&lease(store, 5_000, 10, 10).await),
        vec![(t3.clone(), 1, 5_010)],
        "only t3, never leased, leases once visible; t1 and t2 stay lapsed"
    );
    assert_eq!(
        lease_states(store).await,
        vec![
            (t1.clone(), 1_100, 1, true),
            (t2.clone(), 1_100, 1, true),
            (t3.clone(), 5_010, 1, true)
        ],
        "lapsed tasks keep their lease attempt and expiry until the engine drops them"
    );
    assert_eq!(
        overdue_ids(&overdue(store, 5_000, 10).await, 5_000),
        vec![
            (t1.clone(), Some(Overdue::LeaseLapsed)),
            (t2.clone(), Some(Overdue::LeaseLapsed))
        ],
        "t3's current lease is not overdue"
    );
}

/// Enqueueing a task id that is queued replaces it (no duplicate queue entry).
pub async fn reenqueue_replaces_task(store: &dyn Store) {
    let s = "reenqueue";
    let t = task_id(s, 1);
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![new_task(&t, TaskKind::Model, 100)];
    must_append(store, request, "enqueue").await;
    let mut request = append_request(s, 2, vec![message(s, 2, "b")], 0);
    request.enqueue = vec![new_task(&t, TaskKind::Tool, 50)];
    must_append(store, request, "enqueue again").await;
    assert_eq!(
        tasks(store).await,
        vec![Task {
            id: t.clone(),
            kind: TaskKind::Tool,
            visible_at_ms: 50,
            lease_attempt: 0,
            ..unleased()
        }],
        "a re-enqueued task replaces the queued one"
    );
    assert_eq!(
        lease_ids(&lease(store, 1_000, 10, 10).await),
        vec![(t.clone(), 1, 1_010)],
        "a re-enqueued task leases once, not once per enqueue"
    );

    // A retry: the append that completes the leased task enqueues the same id again, and
    // another cancels and enqueues it in one go. Each leaves one new, never leased task.
    let mut request = append_request(s, 3, vec![message(s, 3, "retry")], 1_005);
    request.complete = vec![(t.clone(), 1)];
    request.enqueue = vec![new_task(&t, TaskKind::Tool, 2_000)];
    must_append(
        store,
        request,
        "completing a task and enqueueing its id again",
    )
    .await;
    assert_eq!(
        tasks(store).await,
        vec![Task {
            id: t.clone(),
            kind: TaskKind::Tool,
            visible_at_ms: 2_000,
            lease_attempt: 0,
            ..unleased()
        }],
        "a task completed and enqueued in one append is queued anew"
    );
    let mut request = append_request(s, 4, vec![message(s, 4, "again")], 1_010);
    request.cancel = vec![t.clone()];
    request.enqueue = vec![new_task(&t, TaskKind::Model, 3_000)];
    must_append(
        store,
        request,
        "cancelling a task and enqueueing its id again",
    )
    .await;
    assert_eq!(
        tasks(store).await,
        vec![Task {
            id: t.clone(),
            kind: TaskKind::Model,
            visible_at_ms: 3_000,
            lease_attempt: 0,
            ..unleased()
        }],
        "a task cancelled and enqueued in one append is queued anew"
    );
    assert_eq!(
        lease_ids(&lease(store, 3_000, 10, 10).await),
        vec![(t, 1, 3_010)]
    );
}

/// One append that enqueues the same task id twice keeps the last: one task, leased once.
pub async fn duplicate_ids_in_one_enqueue_keep_the_last(store: &dyn Store) {
    let s = "duplicates";
    let t = task_id(s, 1);
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![
        new_task(&t, TaskKind::Model, 100),
        new_task(&t, TaskKind::Tool, 50),
    ];
    must_append(store, request, "enqueueing one id twice").await;
    assert_eq!(
        tasks(store).await,
        vec![Task {
            id: t.clone(),
            kind: TaskKind::Tool,
            visible_at_ms: 50,
            ..unleased()
        }],
        "the last of two enqueues of one id in one append stands"
    );
    assert_eq!(
        lease_ids(&lease(store, 1_000, 10, 10).await),
        vec![(t, 1, 1_010)]
    );
}

/// Completing with the current lease succeeds and removes the task, with or without events.
pub async fn complete_with_current_lease(store: &dyn Store) {
    let s = "complete";
    let (t1, t2) = (task_id(s, 1), task_id(s, 2));
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![new_task(&t1, TaskKind::Model, 0)];
    must_append(store, request, "enqueue").await;
    assert_eq!(
        lease_ids(&lease(store, 10, 100, 10).await),
        vec![(t1.clone(), 1, 110)]
    );

    let mut request = append_request(s, 2, vec![message(s, 2, "result")], 50);
    request.complete = vec![(t1.clone(), 1)];
    request.enqueue = vec![new_task(&t2, TaskKind::Tool, 0)];
    must_append(store, request, "completing with the current lease").await;
    assert_eq!(
        tasks(store)
            .await
            .iter()
            .map(|t| t.id.clone())
            .collect::<Vec<_>>(),
        vec![t2.clone()],
        "the completed task is gone, the one enqueued with it is queued"
    );
    assert_eq!(
        lease_ids(&lease(store, 60, 100, 10).await),
        vec![(t2.clone(), 1, 160)]
    );

    let mut request = append_request(s, 3, vec![], 70);
    request.status = SessionStatus::Idle;
    request.complete = vec![(t2, 1)];
    must_append(store, request, "completing with no events").await;
    assert_eq!(tasks(store).await, vec![], "completed tasks are removed");
    assert_eq!(
        lease(store, 10_000, 100, 10).await,
        vec![],
        "completed tasks never lease again"
    );
    assert_eq!(history(store, s).await.len(), 2);
    assert_eq!(
        sessions(store).await,
        vec![session(s, SessionStatus::Idle, 2, 70)]
    );
}

/// `task` looks one task up by id as `list_tasks` lists it, through its lease, heartbeat and
/// release, and answers `None` for a task never queued, one of another session or seq, an id
/// no session can have, and a task once completed or cancelled.
pub async fn a_task_is_looked_up_by_id(store: &dyn Store) {
    let s = "lookup";
    let (t1, t2) = (task_id(s, 1), task_id(s, 2));
    assert_eq!(looked_up(store, &t1).await, None, "nothing queued yet");
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![
        new_task(&t1, TaskKind::Model, 0),
        new_task(&t2, TaskKind::Tool, 5_000),
    ];
    must_append(store, request, "enqueue two tasks").await;
    assert_eq!(
        looked_up(store, &t1).await,
        Some(Task {
            id: t1.clone(),
            kind: TaskKind::Model,
            ..unleased()
        }),
        "a queued task, never leased"
    );
    for absent in [
        task_id(s, 3),
        task_id("lookup-other", 1),
        task_id("not a session id", 1),
        task_id(s, u64::MAX),
    ] {
        assert_eq!(
            looked_up(store, &absent).await,
            None,
            "{absent} was never queued"
        );
    }
    assert_eq!(
        lease_ids(&lease(store, 10, 100, 10).await),
        vec![(t1.clone(), 1, 110)]
    );
    store
        .extend_lease(&t1, 1, 20, 100, Some(json(r#"{"step":1}"#)))
        .await
        .unwrap_or_else(|e| panic!("the heartbeat of a current lease must succeed, got {e:?}"));
    assert_eq!(
        looked_up(store, &t1).await,
        Some(Task {
            id: t1.clone(),
            kind: TaskKind::Model,
            visible_at_ms: 120,
            lease_attempt: 1,
            held: true,
            heartbeat_details: Some(json(r#"{"step":1}"#)),
            ..unleased()
        }),
        "a leased task: its expiry, attempt, holder and heartbeat"
    );
    assert_eq!(store.release_leases(30).await.ok(), Some(1));
    let released = looked_up(store, &t1)
        .await
        .expect("a released task stays queued");
    assert_eq!(
        (
            released.lease_attempt,
            released.held,
            released.visible_at_ms
        ),
        (1, false, 30),
        "released: the attempt kept, no longer held, visible now"
    );
    let leased = lease(store, 40, 100, 1).await;
    assert_eq!(lease_ids(&leased), vec![(t1.clone(), 2, 140)]);
    let mut request = append_request(s, 2, vec![message(s, 2, "result")], 50);
    request.complete = vec![(t1.clone(), 2)];
    request.cancel = vec![t2.clone()];
    must_append(store, request, "complete one task, cancel the other").await;
    assert_eq!(
        looked_up(store, &t1).await,
        None,
        "a completed task is gone"
    );
    assert_eq!(
        looked_up(store, &t2).await,
        None,
        "a cancelled task is gone"
    );
    assert_eq!(tasks(store).await, vec![]);
}

/// Completing with a stale lease attempt (or an unknown task) is `LeaseLost` and writes
/// nothing of the append: no event, no session change, no task change.
pub async fn complete_with_stale_attempt_writes_nothing(store: &dyn Store) {
    let s = "stale";
    let (t, other) = (task_id(s, 1), task_id(s, 9));
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![new_task(&t, TaskKind::Tool, 0)];
    must_append(store, request, "enqueue").await;
    assert_eq!(
        lease_ids(&lease(store, 10, 100, 10).await),
        vec![(t.clone(), 1, 110)]
    );
    assert_eq!(
        store.release_leases(50).await.ok(),
        Some(1),
        "releasing the lease of attempt 1"
    );
    assert_eq!(
        lease_ids(&lease(store, 200, 100, 10).await),
        vec![(t.clone(), 2, 300)],
        "the released task is leased again as attempt 2"
    );

    let mut request = append_request(s, 2, vec![message(s, 2, "late result")], 250);
    request.status = SessionStatus::Idle;
    request.complete = vec![(t.clone(), 1)];
    request.enqueue = vec![new_task(&other, TaskKind::Model, 0)];
    request.cancel = vec![t.clone()];
    match store.append(request).await {
        Err(Error::LeaseLost { task, .. }) if task == t.to_string() => {}
        other => panic!("completing with the stale attempt 1 (current 2) must fail with LeaseLost naming {t}, got {other:?}"),
    }
    assert_eq!(
        history(store, s).await.len(),
        1,
        "a LeaseLost append must write no event"
    );
    assert_eq!(
        sessions(store).await,
        vec![session(s, SessionStatus::Running, 1, 0)],
        "a LeaseLost append must not change the session (seq, status, time)"
    );
    assert_eq!(
        tasks(store).await,
        vec![Task {
            id: t.clone(),
            kind: TaskKind::Tool,
            visible_at_ms: 300,
            lease_attempt: 2,
            held: true,
            ..unleased()
        }],
        "a LeaseLost append must neither enqueue nor cancel"
    );

    let mut request = append_request(s, 2, vec![message(s, 2, "x")], 250);
    request.complete = vec![(task_id(s, 42), 1)];
    assert!(
        matches!(store.append(request).await, Err(Error::LeaseLost { .. })),
        "completing a task that does not exist is LeaseLost"
    );

    let mut request = append_request(s, 2, vec![message(s, 2, "result")], 250);
    request.complete = vec![(t.clone(), 2)];
    must_append(store, request, "completing with the current attempt 2").await;
    assert_eq!(tasks(store).await, vec![]);

    let mut request = append_request(s, 3, vec![message(s, 3, "again")], 260);
    request.complete = vec![(t, 2)];
    assert!(
        matches!(store.append(request).await, Err(Error::LeaseLost { .. })),
        "completing a completed task again is LeaseLost"
    );
    assert_eq!(history(store, s).await.len(), 2);
}

/// A lease is lost at its expiry: completing at `now_ms >= expires_at_ms` is `LeaseLost`.
pub async fn complete_after_expiry_is_lost(store: &dyn Store) {
    let s = "expiry";
    let t = task_id(s, 1);
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![new_task(&t, TaskKind::Model, 0)];
    must_append(store, request, "enqueue").await;
    assert_eq!(
        lease_ids(&lease(store, 10, 100, 10).await),
        vec![(t.clone(), 1, 110)]
    );
    for now in [110, 5_000] {
        let mut request = append_request(s, 2, vec![message(s, 2, "late")], now);
        request.complete = vec![(t.clone(), 1)];
        match store.append(request).await {
            Err(Error::LeaseLost { .. }) => {}
            other => panic!("completing at {now}, at or after the lease's expiry 110, must be LeaseLost, got {other:?}"),
        }
    }
    assert_eq!(
        history(store, s).await.len(),
        1,
        "expired completions write nothing"
    );
    let mut request = append_request(s, 2, vec![message(s, 2, "in time")], 109);
    request.complete = vec![(t, 1)];
    must_append(store, request, "completing just before expiry").await;
    assert_eq!(tasks(store).await, vec![]);
}

/// An append may complete several tasks (an engine recording several workers' reports of one
/// session at once): each lease is checked, and when any is not current the append is refused
/// whole, writing nothing and completing none of them.
pub async fn complete_several_tasks_in_one_append(store: &dyn Store) {
    let s = "several";
    let (t1, t2, t3) = (task_id(s, 1), task_id(s, 2), task_id(s, 3));
    let mut request = append_request(s, 1, vec![message(s, 1, "fan out")], 0);
    request.enqueue = vec![
        new_task(&t1, TaskKind::Tool, 0),
        new_task(&t2, TaskKind::Tool, 0),
        new_task(&t3, TaskKind::Tool, 0),
    ];
    must_append(store, request, "enqueue three tools").await;
    assert_eq!(
        lease_ids(&lease(store, 10, 100, 10).await),
        vec![
            (t1.clone(), 1, 110),
            (t2.clone(), 1, 110),
            (t3.clone(), 1, 110)
        ]
    );
    let held = tasks(store).await;

    // One stale attempt among current ones refuses them all.
    let mut request = append_request(s, 2, vec![message(s, 2, "three")], 20);
    request.complete = vec![(t1.clone(), 1), (t2.clone(), 1), (t3.clone(), 2)];
    match store.append(request).await {
        Err(Error::LeaseLost { task, .. }) => assert_eq!(task, t3.to_string()),
        other => panic!("a stale attempt among three completions must be LeaseLost, got {other:?}"),
    }
    assert_eq!(
        history(store, s).await.len(),
        1,
        "a refused append writes nothing"
    );
    assert_eq!(
        tasks(store).await,
        held,
        "a refused append completes nothing"
    );

    // Current ones are completed together.
    let mut request = append_request(s, 2, vec![message(s, 2, "two")], 20);
    request.complete = vec![(t2.clone(), 1), (t1.clone(), 1)];
    must_append(store, request, "completing two current leases at once").await;
    assert_eq!(
        tasks(store)
            .await
            .into_iter()
            .map(|t| t.id)
            .collect::<Vec<_>>(),
        vec![t3.clone()],
        "both completed tasks are gone, the third is left"
    );

    // A task completed already refuses an append that completes it with another.
    let mut request = append_request(s, 3, vec![message(s, 3, "again")], 30);
    request.complete = vec![(t3.clone(), 1), (t1.clone(), 1)];
    match store.append(request).await {
        Err(Error::LeaseLost { task, .. }) => assert_eq!(task, t1.to_string()),
        other => {
            panic!("completing a completed task with another must be LeaseLost, got {other:?}")
        }
    }
    assert_eq!(history(store, s).await.len(), 2);
    let mut request = append_request(s, 3, vec![message(s, 3, "last")], 30);
    request.complete = vec![(t3, 1)];
    must_append(store, request, "completing the third").await;
    assert_eq!(tasks(store).await, vec![]);
    assert_eq!(history(store, s).await.len(), 3);
}

/// `cancel` drops tasks, leased or not, without a lease check; unknown ids are ignored.
pub async fn cancel_removes_tasks(store: &dyn Store) {
    let s = "cancel";
    let (t1, t2, t3) = (task_id(s, 1), task_id(s, 2), task_id(s, 3));
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![
        new_task(&t1, TaskKind::Model, 0),
        new_task(&t2, TaskKind::Tool, 100),
        new_task(&t3, TaskKind::Tool, 100),
    ];
    must_append(store, request, "enqueue").await;
    assert_eq!(
        lease_ids(&lease(store, 0, 1_000, 1).await),
        vec![(t1.clone(), 1, 1_000)]
    );
    let mut request = append_request(s, 2, vec![message(s, 2, "cancelled")], 10);
    request.status = SessionStatus::Cancelled;
    request.cancel = vec![t1.clone(), t2.clone(), task_id(s, 77)];
    must_append(
        store,
        request,
        "cancel a leased, a queued and an unknown task",
    )
    .await;
    assert_eq!(
        tasks(store)
            .await
            .iter()
            .map(|t| t.id.clone())
            .collect::<Vec<_>>(),
        vec![t3.clone()],
        "cancelled tasks are removed"
    );
    assert_eq!(
        lease_ids(&lease(store, 10_000, 10, 10).await),
        vec![(t3, 1, 10_010)],
        "cancelled tasks never lease again"
    );
    let mut request = append_request(s, 3, vec![], 20);
    request.complete = vec![(t1, 1)];
    assert!(
        matches!(store.append(request).await, Err(Error::LeaseLost { .. })),
        "completing a cancelled task is LeaseLost"
    );
}

/// `extend_lease` moves the expiry of a current lease, and is `LeaseLost` for a stale attempt,
/// an expired lease or a task that is gone. A lease that was not extended in time lapses: it
/// is not leased again but listed by `overdue_tasks`.
pub async fn extend_lease(store: &dyn Store) {
    let s = "extend";
    let t = task_id(s, 1);
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![new_task(&t, TaskKind::Tool, 0)];
    must_append(store, request, "enqueue").await;
    assert_eq!(
        lease_ids(&lease(store, 0, 100, 10).await),
        vec![(t.clone(), 1, 100)]
    );
    let extended = store
        .extend_lease(&t, 1, 50, 100, None)
        .await
        .unwrap_or_else(|e| panic!("extending a current lease must succeed, got {e:?}"));
    assert_eq!(extended, 150, "the new expiry is now + lease_ms");
    assert_eq!(
        tasks(store).await[0].visible_at_ms,
        150,
        "the task is hidden until the new expiry"
    );
    assert_eq!(
        tasks(store).await[0].lease_attempt,
        1,
        "extending keeps the attempt"
    );
    assert_eq!(
        lease(store, 120, 100, 10).await,
        vec![],
        "an extended lease is not leasable at its old expiry"
    );
    assert!(
        matches!(
            store.extend_lease(&t, 2, 60, 100, None).await,
            Err(Error::LeaseLost { .. })
        ),
        "extending with an attempt that is not current is LeaseLost"
    );
    assert!(
        matches!(
            store.extend_lease(&t, 1, 150, 100, None).await,
            Err(Error::LeaseLost { .. })
        ),
        "extending at the expiry is LeaseLost"
    );
    assert_eq!(
        lease_states(store).await,
        vec![(t.clone(), 150, 1, true)],
        "failed extensions change nothing"
    );
    assert_eq!(
        lease(store, 150, 100, 10).await,
        vec![],
        "a lease that lapsed at its extended expiry is not leased again"
    );
    assert_eq!(
        overdue_ids(&overdue(store, 150, 10).await, 150),
        vec![(t.clone(), Some(Overdue::LeaseLapsed))],
        "the lapsed lease is overdue"
    );
    assert_eq!(store.release_leases(150).await.ok(), Some(1));
    assert_eq!(
        lease_ids(&lease(store, 150, 100, 10).await),
        vec![(t.clone(), 2, 250)],
        "once released, the task leases again with attempt 2"
    );
    assert!(
        matches!(
            store.extend_lease(&t, 1, 160, 100, None).await,
            Err(Error::LeaseLost { .. })
        ),
        "extending a lease that was re-leased is LeaseLost"
    );
    let mut request = append_request(s, 2, vec![message(s, 2, "done")], 200);
    request.complete = vec![(t.clone(), 2)];
    must_append(store, request, "complete").await;
    assert!(
        matches!(
            store.extend_lease(&t, 2, 210, 100, None).await,
            Err(Error::LeaseLost { .. })
        ),
        "extending the lease of a completed task is LeaseLost"
    );
    assert!(
        matches!(
            store
                .extend_lease(&task_id("nobody", 1), 1, 0, 1, None)
                .await,
            Err(Error::LeaseLost { .. })
        ),
        "extending an unknown task is LeaseLost"
    );
}

/// `lease_tasks` leases only what the filter accepts — the worker's queues, the tools and model
/// providers it hosts (an empty target is anything), its sessions, its namespace (`Some("")`:
/// ids without a `:`; `Some("acme")`: ids `acme:...`) — and `max` counts only accepted tasks:
/// tasks it refuses neither block the ones behind them nor change.
pub async fn lease_filters_by_queue_target_session_and_namespace(store: &dyn Store) {
    let set = |names: &[&str]| {
        Some(
            names
                .iter()
                .map(|n| (*n).to_owned())
                .collect::<BTreeSet<_>>(),
        )
    };
    // (session, seq, kind, visible at, queue, target)
    let fixture: [(&str, u64, TaskKind, u64, &str, &str); 7] = [
        ("plain", 1, TaskKind::Model, 10, "default", "scripted"),
        ("plain", 2, TaskKind::Tool, 20, "default", "calculator"),
        ("acme:one", 1, TaskKind::Tool, 30, "gpu", "read_file"),
        ("acme:one", 2, TaskKind::Model, 40, "gpu", "anthropic"),
        ("acme:two", 1, TaskKind::Tool, 50, "default", ""),
        ("acmeco:three", 1, TaskKind::Model, 60, "default", ""),
        ("other:four", 1, TaskKind::Tool, 70, "gpu", "calculator"),
    ];
    let ids: Vec<TaskId> = fixture.iter().map(|f| task_id(f.0, f.1)).collect();
    for session in [
        "plain",
        "acme:one",
        "acme:two",
        "acmeco:three",
        "other:four",
    ] {
        let enqueue: Vec<NewTask> = fixture
            .iter()
            .filter(|f| f.0 == session)
            .map(|f| routed_task(&task_id(f.0, f.1), f.2, f.3, f.4, f.5, None))
            .collect();
        let mut request = append_request(
            session,
            1,
            (1..=enqueue.len() as u64)
                .map(|seq| message(session, seq, "x"))
                .collect(),
            1,
        );
        request.enqueue = enqueue;
        must_append(store, request, "enqueueing routed tasks").await;
    }
    let gpu = TaskFilter {
        queues: set(&["gpu"]),
        ..TaskFilter::any()
    };
    assert_eq!(
        lease_ids(&lease_where(store, 100, 100, 1, &gpu).await),
        vec![(ids[2].clone(), 1, 200)],
        "max 1 on the gpu queue leases the oldest gpu task, passing the older default ones"
    );
    assert_eq!(store.release_leases(100).await.ok(), Some(1));
    let mut leased = vec![0u32, 0, 1, 0, 0, 0, 0];
    let cases: Vec<(&str, TaskFilter, Vec<usize>)> = vec![
        ("any", TaskFilter::any(), vec![0, 1, 2, 3, 4, 5, 6]),
        ("gpu queue", gpu.clone(), vec![2, 3, 6]),
        (
            "both queues",
            TaskFilter {
                queues: set(&["default", "gpu"]),
                ..TaskFilter::any()
            },
            vec![0, 1, 2, 3, 4, 5, 6],
        ),
        (
            "no queue",
            TaskFilter {
                queues: set(&[]),
                ..TaskFilter::any()
            },
            vec![],
        ),
        (
            "a queue nobody uses",
            TaskFilter {
                queues: set(&["cpu"]),
                ..TaskFilter::any()
            },
            vec![],
        ),
        (
            "calculator, any provider",
            TaskFilter {
                tools: set(&["calculator"]),
                ..TaskFilter::any()
            },
            vec![0, 1, 3, 4, 5, 6],
        ),
        (
            "no tools, no providers: untargeted tasks only",
            TaskFilter {
                tools: set(&[]),
                providers: set(&[]),
                ..TaskFilter::any()
            },
            vec![4, 5],
        ),
        (
            "scripted, no tools",
            TaskFilter {
                tools: set(&[]),
                providers: set(&["scripted"]),
                ..TaskFilter::any()
            },
            vec![0, 4, 5],
        ),
        (
            "two sessions",
            TaskFilter {
                sessions: set(&["plain", "other:four"]),
                ..TaskFilter::any()
            },
            vec![0, 1, 6],
        ),
        (
            "the default namespace",
            TaskFilter {
                namespace: Some(String::new()),
                ..TaskFilter::any()
            },
            vec![0, 1],
        ),
        (
            "namespace acme (not acmeco)",
            TaskFilter {
                namespace: Some("acme".to_owned()),
                ..TaskFilter::any()
            },
            vec![2, 3, 4],
        ),
        (
            "gpu, anthropic, no tools",
            TaskFilter {
                queues: set(&["gpu"]),
                tools: set(&[]),
                providers: set(&["anthropic"]),
                ..TaskFilter::any()
            },
            vec![3],
        ),
        (
            "namespace other, calculator",
            TaskFilter {
                tools: set(&["calculator"]),
                namespace: Some("other".to_owned()),
                ..TaskFilter::any()
            },
            vec![6],
        ),
    ];
    let mut now = 1_000;
    for (what, filter, accepted) in cases {
        now += 1_000;
        let mut got: Vec<TaskId> = lease_where(store, now, 100, 10, &filter)
            .await
            .into_iter()
            .map(|l| {
                assert_eq!(l.expires_at_ms, now + 100, "{what}: the lease's expiry");
                l.id
            })
            .collect();
        got.sort();
        let mut want: Vec<TaskId> = accepted.iter().map(|i| ids[*i].clone()).collect();
        want.sort();
        assert_eq!(
            got, want,
            "filter {what:?} ({filter:?}) leases exactly these"
        );
        for i in &accepted {
            leased[*i] += 1;
        }
        assert_eq!(
            store.release_leases(now).await.ok(),
            Some(accepted.len()),
            "{what}: releasing what it leased"
        );
        let attempts: Vec<u32> = tasks(store)
            .await
            .into_iter()
            .map(|t| {
                let i = ids.iter().position(|id| *id == t.id).unwrap_or_else(|| {
                    panic!("{what}: an unexpected task {t:?}");
                });
                assert!(!t.held, "{what}: released tasks are not held");
                assert_eq!(
                    (t.queue.as_str(), t.target.as_str()),
                    (fixture[i].4, fixture[i].5),
                    "{what}: leasing keeps the routing of {}",
                    t.id
                );
                (i, t.lease_attempt)
            })
            .collect::<BTreeMap<_, _>>()
            .into_values()
            .collect();
        assert_eq!(
            attempts, leased,
            "{what}: only accepted tasks were leased (lease attempts by fixture index)"
        );
    }
}

/// A task is overdue when its lease lapsed (held past its expiry) or when it was never leased
/// and its schedule-to-start deadline came. `overdue_tasks` lists them oldest first (by
/// visibility time), at most `max`, and changes nothing; `lease_tasks` never hands them out.
/// A task leased before its deadline is not overdue while its lease holds; dropping an overdue
/// task (as the engine does when it records the failed attempt) ends it.
pub async fn overdue_tasks_are_listed_and_never_leased(store: &dyn Store) {
    let s = "overdue";
    let (a, b, c, d) = (task_id(s, 1), task_id(s, 2), task_id(s, 3), task_id(s, 4));
    let mut request = append_request(s, 1, (1..=4).map(|seq| message(s, seq, "x")).collect(), 10);
    request.enqueue = vec![
        routed_task(&a, TaskKind::Tool, 0, "default", "", None),
        routed_task(&b, TaskKind::Model, 0, "slow", "", Some(500)),
        routed_task(&c, TaskKind::Tool, 0, "slow", "", Some(1_000)),
        routed_task(&d, TaskKind::Tool, 2_000, "default", "", Some(2_500)),
    ];
    must_append(store, request, "enqueueing four tasks").await;
    let default_queue = TaskFilter {
        queues: Some(BTreeSet::from([super::DEFAULT_QUEUE.to_owned()])),
        ..TaskFilter::any()
    };
    assert_eq!(
        lease_ids(&lease_where(store, 100, 100, 10, &default_queue).await),
        vec![(a.clone(), 1, 200)]
    );
    assert_eq!(
        overdue(store, 199, 10).await,
        vec![],
        "nothing is overdue before a lease expires or a deadline comes"
    );
    assert_eq!(
        overdue_ids(&overdue(store, 200, 10).await, 200),
        vec![(a.clone(), Some(Overdue::LeaseLapsed))],
        "a's lease lapsed at its expiry"
    );
    assert_eq!(
        lease_where(store, 200, 100, 10, &default_queue).await,
        vec![],
        "a lapsed lease is not leased again"
    );
    let listed = overdue(store, 500, 10).await;
    assert_eq!(
        overdue_ids(&listed, 500),
        vec![
            (b.clone(), Some(Overdue::NotStarted)),
            (a.clone(), Some(Overdue::LeaseLapsed))
        ],
        "b, never leased, is overdue at its start deadline; oldest first (b visible at 0, a at 200)"
    );
    assert_eq!(
        listed[0],
        Task::queued(&routed_task(&b, TaskKind::Model, 0, "slow", "", Some(500))),
        "an overdue task is listed as stored"
    );
    assert_eq!(
        lease_ids(&lease(store, 900, 1_000, 10).await),
        vec![(c.clone(), 1, 1_900)],
        "only c is leased: b is past its deadline, a lapsed, d not visible yet"
    );
    assert_eq!(
        overdue_ids(&overdue(store, 1_500, 10).await, 1_500),
        vec![
            (b.clone(), Some(Overdue::NotStarted)),
            (a.clone(), Some(Overdue::LeaseLapsed))
        ],
        "c, leased before its deadline, is not overdue after it while its lease holds"
    );
    assert_eq!(
        store.extend_lease(&c, 1, 1_500, 1_000, None).await.ok(),
        Some(2_500),
        "a lease taken before the start deadline is renewed after it"
    );
    assert_eq!(
        overdue_ids(&overdue(store, 2_499, 10).await, 2_499),
        vec![
            (b.clone(), Some(Overdue::NotStarted)),
            (a.clone(), Some(Overdue::LeaseLapsed))
        ],
        "d, visible since 2000, is not overdue before its deadline"
    );
    let before = tasks(store).await;
    assert_eq!(
        overdue_ids(&overdue(store, 2_600, 10).await, 2_600),
        vec![
            (b.clone(), Some(Overdue::NotStarted)),
            (a.clone(), Some(Overdue::LeaseLapsed)),
            (d.clone(), Some(Overdue::NotStarted)),
            (c.clone(), Some(Overdue::LeaseLapsed))
        ],
        "d missed its deadline and c's renewed lease lapsed at 2500; ordered by visibility"
    );
    assert_eq!(
        overdue_ids(&overdue(store, 2_600, 2).await, 2_600),
        vec![
            (b.clone(), Some(Overdue::NotStarted)),
            (a.clone(), Some(Overdue::LeaseLapsed))
        ],
        "at most max, oldest first"
    );
    assert_eq!(
        lease(store, 2_600, 100, 10).await,
        vec![],
        "no overdue task is ever leased"
    );
    assert_eq!(
        tasks(store).await,
        before,
        "listing overdue tasks (and refusing to lease them) changes nothing"
    );
    let mut late = append_request(s, 5, vec![message(s, 5, "late")], 2_600);
    late.complete = vec![(c.clone(), 1)];
    match store.append(late).await {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("completing with a lapsed lease must be LeaseLost, got {other:?}"),
    }
    let mut dropped = append_request(s, 5, vec![message(s, 5, "timed out")], 2_600);
    dropped.cancel = vec![a.clone(), b.clone()];
    must_append(store, dropped, "dropping two overdue tasks").await;
    assert_eq!(
        overdue_ids(&overdue(store, 2_600, 10).await, 2_600),
        vec![
            (d.clone(), Some(Overdue::NotStarted)),
            (c.clone(), Some(Overdue::LeaseLapsed))
        ],
        "dropped tasks are no longer overdue"
    );
}

/// `extend_lease` with details stores them in the task record (durably, like the lease);
/// without details it keeps the stored ones; a failed extension changes none; a lapsed task
/// keeps them for the engine to record; a new lease starts without any.
pub async fn heartbeat_details_are_kept_until_the_next_lease(store: &dyn Store) {
    let s = "details";
    let t = task_id(s, 1);
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![new_task(&t, TaskKind::Tool, 0)];
    must_append(store, request, "enqueue").await;
    let stored = |tasks: Vec<Task>| -> Option<JsonText> {
        assert_eq!(tasks.len(), 1, "one task: {tasks:?}");
        tasks[0].heartbeat_details.clone()
    };
    assert_eq!(
        lease_ids(&lease(store, 0, 100, 10).await),
        vec![(t.clone(), 1, 100)]
    );
    assert_eq!(
        stored(tasks(store).await),
        None,
        "a new lease has no details"
    );
    let (one, two) = (json(r#"{"done":1}"#), json(r#"{"done":2,"of":[3,4]}"#));
    assert_eq!(
        store
            .extend_lease(&t, 1, 10, 100, Some(one.clone()))
            .await
            .ok(),
        Some(110)
    );
    assert_eq!(
        stored(tasks(store).await),
        Some(one.clone()),
        "a heartbeat's details are stored"
    );
    assert_eq!(
        store.extend_lease(&t, 1, 20, 100, None).await.ok(),
        Some(120)
    );
    assert_eq!(
        stored(tasks(store).await),
        Some(one.clone()),
        "a heartbeat without details keeps the stored ones"
    );
    assert_eq!(
        store
            .extend_lease(&t, 1, 30, 100, Some(two.clone()))
            .await
            .ok(),
        Some(130)
    );
    assert_eq!(
        stored(tasks(store).await),
        Some(two.clone()),
        "newer details replace older ones"
    );
    assert!(
        matches!(
            store
                .extend_lease(&t, 2, 40, 100, Some(json(r#""stale""#)))
                .await,
            Err(Error::LeaseLost { .. })
        ),
        "a heartbeat with a stale attempt is LeaseLost"
    );
    assert_eq!(
        stored(tasks(store).await),
        Some(two.clone()),
        "a failed heartbeat stores nothing"
    );
    assert_eq!(
        stored(overdue(store, 130, 10).await),
        Some(two),
        "the lapsed task carries its last details"
    );
    assert_eq!(store.release_leases(130).await.ok(), Some(1));
    assert_eq!(
        lease_ids(&lease(store, 140, 100, 10).await),
        vec![(t.clone(), 2, 240)]
    );
    assert_eq!(
        stored(tasks(store).await),
        None,
        "a new lease clears the previous lease's details"
    );
    assert_eq!(
        store
            .extend_lease(&t, 2, 150, 100, Some(one.clone()))
            .await
            .ok(),
        Some(250)
    );
    assert_eq!(stored(tasks(store).await), Some(one));
}

/// A released task is leased again at once, is no longer held and so never reported overdue
/// (not even past its start deadline: it was started once), and its next lease is a normal one
/// that can lapse again.
pub async fn released_tasks_are_leased_again_and_not_overdue(store: &dyn Store) {
    let s = "released";
    let t = task_id(s, 1);
    let mut request = append_request(s, 1, vec![message(s, 1, "a")], 0);
    request.enqueue = vec![routed_task(&t, TaskKind::Tool, 0, "default", "", Some(300))];
    must_append(store, request, "enqueue").await;
    assert_eq!(
        lease_ids(&lease(store, 100, 1_000, 10).await),
        vec![(t.clone(), 1, 1_100)]
    );
    assert_eq!(store.release_leases(200).await.ok(), Some(1));
    assert_eq!(lease_states(store).await, vec![(t.clone(), 200, 1, false)]);
    assert_eq!(
        overdue(store, 5_000, 10).await,
        vec![],
        "a released task is not overdue, even past its start deadline"
    );
    assert_eq!(
        lease_ids(&lease(store, 5_000, 100, 10).await),
        vec![(t.clone(), 2, 5_100)],
        "a released task leases again"
    );
    assert_eq!(lease_states(store).await, vec![(t.clone(), 5_100, 2, true)]);
    assert_eq!(
        overdue_ids(&overdue(store, 5_100, 10).await, 5_100),
        vec![(t, Some(Overdue::LeaseLapsed))],
        "its new lease lapses like any other"
    );
}

/// Many tokio tasks append to many sessions at once, some racing on the same sessions with
/// conflict-and-retry: every successful append lands, each session's seqs are 1..=n.
/// A store that counts its durable commits ([`Store::durable_commits`]) counts one for an
/// append made alone, one for a lease that leased something, and none for a refused append or
/// a lease that found nothing; a store that does not count them says so every time. A store
/// that times its syncs ([`Store::sync_times`]) times each of those commits once; one that
/// does not count them does not time them either.
pub async fn durable_commits_count_what_was_made_durable(store: &dyn Store) {
    let s = "commits";
    let times_at_start = store.sync_times();
    let Some(at_start) = store.durable_commits() else {
        assert!(
            times_at_start.is_none(),
            "a store that times its syncs counts its durable commits"
        );
        must_append(
            store,
            append_request(s, 1, vec![message(s, 1, "a")], 1_000),
            "append",
        )
        .await;
        assert_eq!(
            store.durable_commits(),
            None,
            "a store that does not count durable commits never starts to"
        );
        return;
    };
    let commits = || {
        store
            .durable_commits()
            .expect("a counting store keeps counting")
    };
    must_append(
        store,
        append_request(s, 1, vec![message(s, 1, "a")], 1_000),
        "append",
    )
    .await;
    assert_eq!(
        commits(),
        at_start + 1,
        "one append alone is one durable commit"
    );
    let refused = store
        .append(append_request(s, 1, vec![message(s, 1, "again")], 1_001))
        .await;
    assert!(
        matches!(refused, Err(Error::Conflict { .. })),
        "an append at a taken seq is a conflict, got {refused:?}"
    );
    assert_eq!(commits(), at_start + 1, "a refused append commits nothing");
    assert!(lease(store, 1_002, 1_000, 4).await.is_empty());
    assert_eq!(
        commits(),
        at_start + 1,
        "a lease that finds nothing commits nothing"
    );
    let id = task_id(s, 2);
    let mut request = append_request(s, 2, vec![message(s, 2, "task")], 1_003);
    request.enqueue = vec![new_task(&id, TaskKind::Model, 0)];
    must_append(store, request, "append with a task").await;
    assert_eq!(lease(store, 1_004, 1_000, 4).await.len(), 1);
    assert_eq!(
        commits(),
        at_start + 3,
        "an append and a lease that leased a task are a durable commit each"
    );
    if let Some(times_at_start) = times_at_start {
        let times = store
            .sync_times()
            .expect("a store that times its syncs keeps timing them");
        let window = times.since(&times_at_start).expect("sync times only grow");
        assert_eq!(
            window.count(),
            3,
            "each durable commit's sync is timed once, and nothing else is"
        );
        let slowest = window.quantile_ms(1.0).expect("three syncs were timed");
        assert!(
            slowest > 0.0 && slowest < 60_000.0,
            "a sync's time is what it took, got {slowest} ms"
        );
    }
}

pub async fn concurrent_appends(store: Arc<dyn Store>) {
    const OWN_SESSIONS: usize = 12;
    const OWN_APPENDS: u64 = 8;
    const SHARED_SESSIONS: usize = 3;
    const RACERS: usize = 4;
    const RACER_APPENDS: usize = 4;

    let mut handles = Vec::new();
    for i in 0..OWN_SESSIONS {
        let store = Arc::clone(&store);
        handles.push(tokio::spawn(async move {
            let s = format!("own-{i:02}");
            let mut next = 1;
            let mut landed = Vec::new();
            for n in 0..OWN_APPENDS {
                let size = 1 + (n as usize + i) % 3;
                let events: Vec<EventEnvelope> = (0..size as u64)
                    .map(|k| message(&s, next + k, &format!("{s} append {n} event {k}")))
                    .collect();
                let mut request = append_request(&s, next, events.clone(), n);
                request.enqueue = vec![new_task(&task_id(&s, next), TaskKind::Model, n)];
                if let Err(e) = store.append(request).await {
                    panic!("append {n} to {s} (no contention) must succeed, got {e:?}");
                }
                next += size as u64;
                landed.extend(events.into_iter().map(|e| (e.seq, e)));
            }
            (s, landed)
        }));
    }
    for r in 0..SHARED_SESSIONS * RACERS {
        let store = Arc::clone(&store);
        handles.push(tokio::spawn(async move {
            let s = format!("shared-{}", r % SHARED_SESSIONS);
            let mut landed = Vec::new();
            let mut tries = 0;
            while landed.len() < RACER_APPENDS {
                tries += 1;
                assert!(
                    tries < 10_000,
                    "racer {r} on {s} could not land its appends"
                );
                let next = match store.read_history(&s, 1, None).await {
                    Ok(events) => events.len() as u64 + 1,
                    Err(Error::UnknownSession { .. }) => 1,
                    Err(e) => panic!("reading {s} failed: {e:?}"),
                };
                let event = message(&s, next, &format!("racer {r} append {}", landed.len()));
                match store
                    .append(append_request(&s, next, vec![event.clone()], 1))
                    .await
                {
                    Ok(()) => landed.push((next, event)),
                    Err(Error::Conflict { .. }) => tokio::task::yield_now().await,
                    Err(e) => {
                        panic!("racer {r} on {s}: only Conflict may fail an append, got {e:?}")
                    }
                }
            }
            (s, landed)
        }));
    }
    let mut expected: BTreeMap<String, BTreeMap<u64, EventEnvelope>> = BTreeMap::new();
    for handle in handles {
        let (s, landed) = handle
            .await
            .unwrap_or_else(|e| panic!("a writer task failed: {e}"));
        let session = expected.entry(s.clone()).or_default();
        for (seq, event) in landed {
            if let Some(previous) = session.insert(seq, event) {
                panic!("two appends to {s} both succeeded at seq {seq} (one was {previous:?})");
            }
        }
    }
    let listed = sessions(&*store).await;
    assert_eq!(
        listed.len(),
        OWN_SESSIONS + SHARED_SESSIONS,
        "every written session is listed"
    );
    for info in &listed {
        let want = &expected[&info.session_id];
        let got = history(&*store, &info.session_id).await;
        let seqs: Vec<u64> = got.iter().map(|e| e.seq).collect();
        assert_eq!(
            seqs,
            (1..=want.len() as u64).collect::<Vec<_>>(),
            "session {} must hold seqs 1..=n without gaps",
            info.session_id
        );
        assert_eq!(
            info.events,
            want.len() as u64,
            "the listed count of {} matches",
            info.session_id
        );
        for event in got {
            assert_eq!(
                Some(&event),
                want.get(&event.seq),
                "the event at seq {} of {} is the acknowledged one",
                event.seq,
                info.session_id
            );
        }
    }
    for i in 0..SHARED_SESSIONS {
        assert_eq!(
            expected[&format!("shared-{i}")].len(),
            RACERS * RACER_APPENDS,
            "every racer's appends landed on shared-{i}"
        );
    }
    assert_eq!(
        tasks(&*store).await.len(),
        OWN_SESSIONS * OWN_APPENDS as usize,
        "every enqueued task is queued"
    );
}

/// `release_leases` makes every held lease — current or lapsed — leasable and no longer held,
/// keeps its lease attempt (so the next lease bumps it and the released leases are fenced
/// off), and leaves tasks that are not leased (waiting for a backoff, or due) alone. A current
/// lease becomes visible at `now_ms`; a lapsed one keeps its (earlier) expiry.
pub async fn release_leases_keeps_attempts(store: &dyn Store) {
    let s = "release";
    let (a, b, c, d) = (task_id(s, 1), task_id(s, 2), task_id(s, 3), task_id(s, 4));
    let mut request = append_request(s, 1, (1..=4).map(|seq| message(s, seq, "x")).collect(), 10);
    request.enqueue = vec![
        new_task(&a, TaskKind::Model, 0),
        new_task(&b, TaskKind::Tool, 0),
        new_task(&c, TaskKind::Tool, 5_000),
        new_task(&d, TaskKind::Tool, 0),
    ];
    must_append(store, request, "enqueueing four tasks").await;
    assert_eq!(
        store.release_leases(50).await.ok(),
        Some(0),
        "nothing is leased yet: nothing to release"
    );
    assert_eq!(
        lease_ids(&lease(store, 100, 50, 1).await),
        vec![(a.clone(), 1, 150)],
        "a is leased first and will lapse at 150"
    );
    assert_eq!(
        lease_ids(&lease(store, 200, 1_000, 10).await),
        vec![(b.clone(), 1, 1_200), (d.clone(), 1, 1_200)],
        "after a's lapse, b and d are leased until 1200; a, lapsed, is not"
    );
    match store.release_leases(300).await {
        Ok(3) => {}
        other => {
            panic!("release_leases(300) must release a (lapsed), b and d (current), got {other:?}")
        }
    }
    assert_eq!(
        lease_states(store).await,
        vec![
            (a.clone(), 150, 1, false),
            (b.clone(), 300, 1, false),
            (c.clone(), 5_000, 0, false),
            (d.clone(), 300, 1, false)
        ],
        "released tasks are no longer held, keep their lease attempts and are visible at \
         now (a, lapsed at 150, at its expiry); c, waiting, is untouched"
    );
    assert_eq!(
        overdue(store, 300, 10).await,
        vec![],
        "a released lapsed lease is no longer overdue"
    );
    match store.extend_lease(&a, 1, 300, 1_000, None).await {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("a heartbeat of a released lease must be LeaseLost, got {other:?}"),
    }
    match store.extend_lease(&b, 1, 300, 1_000, None).await {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("a heartbeat of a released lease must be LeaseLost, got {other:?}"),
    }
    assert_eq!(
        lease_ids(&lease(store, 300, 1_000, 10).await),
        vec![
            (a.clone(), 2, 1_300),
            (b.clone(), 2, 1_300),
            (d.clone(), 2, 1_300)
        ],
        "released tasks lease again at once (a first: visible since 150), attempts bumped"
    );
    let mut stale = append_request(s, 5, vec![message(s, 5, "stale")], 400);
    stale.complete = vec![(a.clone(), 1)];
    match store.append(stale).await {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("a completion from a released lease must be LeaseLost, got {other:?}"),
    }
    let mut current = append_request(s, 5, vec![message(s, 5, "current")], 400);
    current.complete = vec![(a.clone(), 2)];
    must_append(store, current, "completing a with its new lease").await;
    assert_eq!(
        overdue_ids(&overdue(store, 2_000, 10).await, 2_000),
        vec![
            (b.clone(), Some(Overdue::LeaseLapsed)),
            (d.clone(), Some(Overdue::LeaseLapsed))
        ],
        "b's and d's leases lapsed at 1300"
    );
    assert_eq!(
        store.release_leases(2_000).await.ok(),
        Some(2),
        "lapsed leases are still held: releasing them releases b and d"
    );
    let released = vec![
        (b.clone(), 1_300, 2, false),
        (c.clone(), 5_000, 0, false),
        (d.clone(), 1_300, 2, false),
    ];
    assert_eq!(lease_states(store).await, released);
    assert_eq!(
        store.release_leases(2_000).await.ok(),
        Some(0),
        "nothing is held any more: nothing to release"
    );
    assert_eq!(
        lease_states(store).await,
        released,
        "releasing nothing changes nothing"
    );
    assert_eq!(
        lease_ids(&lease(store, 2_000, 100, 10).await),
        vec![(b, 3, 2_100), (d, 3, 2_100)],
        "released lapsed leases lease again"
    );
}

/// Everything (histories, sessions, tasks with their routing, deadlines, lease state and
/// heartbeat details) survives closing and reopening the store, and work continues from it:
/// seqs and lease attempts go on, and leases and deadlines that ran out while the store was
/// closed are overdue after it.
pub async fn reopen_keeps_everything<S: Store>(store: S, reopen: &mut dyn FnMut(S) -> S) {
    let a = "keep-a";
    let (t1, t2, t3) = (task_id(a, 1), task_id(a, 2), task_id(a, 3));
    let mut request = append_request(a, 1, vec![message(a, 1, "one"), message(a, 2, "two")], 10);
    request.enqueue = vec![
        routed_task(&t1, TaskKind::Model, 0, "gpu", "scripted", None),
        routed_task(&t2, TaskKind::Tool, 500, "default", "calculator", Some(900)),
        routed_task(&t3, TaskKind::Tool, 0, "default", "read_file", Some(150)),
    ];
    must_append(&store, request, "session a").await;
    let mut request = append_request("keep-b", 1, vec![message("keep-b", 1, "b")], 20);
    request.status = SessionStatus::Cancelled;
    must_append(&store, request, "session b").await;
    for (s, events) in large_events_fixture() {
        must_append(&store, append_request(&s, 1, events, 30), "large events").await;
    }
    let gpu = TaskFilter {
        queues: Some(BTreeSet::from(["gpu".to_owned()])),
        ..TaskFilter::any()
    };
    assert_eq!(
        lease_ids(&lease_where(&store, 100, 100, 10, &gpu).await),
        vec![(t1.clone(), 1, 200)]
    );
    let step = json(r#"{"step":3}"#);
    assert_eq!(
        store
            .extend_lease(&t1, 1, 120, 80, Some(step.clone()))
            .await
            .ok(),
        Some(200),
        "a heartbeat with details"
    );

    let before = snapshot(&store).await;
    let store = reopen(store);
    let after = snapshot(&store).await;
    assert!(
        before == after,
        "after a reopen, sessions, histories and tasks must be unchanged"
    );
    assert_eq!(
        after.2.iter().find(|t| t.id == t1),
        Some(&Task {
            id: t1.clone(),
            kind: TaskKind::Model,
            visible_at_ms: 200,
            lease_attempt: 1,
            queue: "gpu".to_owned(),
            target: "scripted".to_owned(),
            start_by_ms: None,
            held: true,
            heartbeat_details: Some(step.clone()),
        }),
        "t1's routing, lease and heartbeat details survive the reopen"
    );

    assert_eq!(
        lease(&store, 150, 100, 10).await,
        vec![],
        "the lease taken before the reopen still hides t1, and t3 is past its start deadline"
    );
    assert_eq!(
        overdue_ids(&overdue(&store, 150, 10).await, 150),
        vec![(t3.clone(), Some(Overdue::NotStarted))],
        "t3's schedule-to-start deadline survives the reopen"
    );
    let lapsed = overdue(&store, 200, 10).await;
    assert_eq!(
        overdue_ids(&lapsed, 200),
        vec![
            (t3.clone(), Some(Overdue::NotStarted)),
            (t1.clone(), Some(Overdue::LeaseLapsed))
        ],
        "the lease taken before the reopen lapses at its expiry"
    );
    assert_eq!(
        lapsed[1].heartbeat_details,
        Some(step),
        "the lapsed lease's heartbeat details are there for the engine to record"
    );
    assert_eq!(lease(&store, 200, 100, 10).await, vec![]);
    assert_eq!(store.release_leases(200).await.ok(), Some(1));
    assert_eq!(
        lease_ids(&lease_where(&store, 200, 100, 10, &gpu).await),
        vec![(t1.clone(), 2, 300)],
        "released, t1 leases again with attempt 2: attempts survive the reopen"
    );
    let mut request = append_request(a, 3, vec![message(a, 3, "three")], 250);
    request.complete = vec![(t1, 2)];
    request.cancel = vec![t3];
    must_append(&store, request, "continuing a after the reopen at seq 3").await;
    let expected_a = history(&store, a).await;
    let expected_tasks = tasks(&store).await;
    let store = reopen(store);
    assert_eq!(
        history(&store, a).await,
        expected_a,
        "the second reopen keeps the appends made after the first"
    );
    assert_eq!(
        tasks(&store).await,
        expected_tasks,
        "the second reopen keeps the task changes made after the first"
    );
    assert_eq!(
        expected_tasks,
        vec![Task::queued(&routed_task(
            &t2,
            TaskKind::Tool,
            500,
            "default",
            "calculator",
            Some(900)
        ))],
        "t1, completed, and t3, cancelled, after the first reopen stay gone; t2 is as enqueued"
    );
    match store
        .append(append_request(a, 3, vec![message(a, 3, "dup")], 300))
        .await
    {
        Err(Error::Conflict {
            expected: 3,
            actual: 4,
            ..
        }) => {}
        other => panic!("after reopening, the next seq of {a} must be 4, got {other:?}"),
    }
}

/// Everything a store holds, as the `Store` API shows it.
async fn snapshot(store: &dyn Store) -> (Vec<SessionInfo>, Vec<Vec<EventEnvelope>>, Vec<Task>) {
    let listed = sessions(store).await;
    let mut histories = Vec::new();
    for info in &listed {
        histories.push(history(store, &info.session_id).await);
    }
    (listed, histories, tasks(store).await)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fjall::FjallStore;
    use crate::store::memory::MemoryStore;
    use crate::store::sled::SledStore;
    use std::path::Path;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Fresh sled stores in subdirectories of `root`.
    fn sled_factory(root: &Path) -> impl FnMut() -> SledStore + '_ {
        let n = AtomicUsize::new(0);
        move || {
            let dir = root.join(format!("store-{}", n.fetch_add(1, Ordering::Relaxed)));
            SledStore::open(&dir).unwrap_or_else(|e| panic!("opening a sled store failed: {e}"))
        }
    }

    fn sled_reopen(store: SledStore) -> SledStore {
        let dir = store.path().to_path_buf();
        drop(store);
        SledStore::open_existing(&dir)
            .unwrap_or_else(|e| panic!("reopening the sled store failed: {e}"))
    }

    /// Fresh fjall stores in subdirectories of `root`.
    fn fjall_factory(root: &Path) -> impl FnMut() -> FjallStore + '_ {
        let n = AtomicUsize::new(0);
        move || {
            let dir = root.join(format!("store-{}", n.fetch_add(1, Ordering::Relaxed)));
            FjallStore::open(&dir).unwrap_or_else(|e| panic!("opening a fjall store failed: {e}"))
        }
    }

    fn fjall_reopen(store: FjallStore) -> FjallStore {
        let dir = store.path().to_path_buf();
        drop(store);
        FjallStore::open_existing(&dir)
            .unwrap_or_else(|e| panic!("reopening the fjall store failed: {e}"))
    }

    macro_rules! each_check {
        ($($check:ident),* $(,)?) => {
            mod memory {
                use super::*;
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $check() {
                        super::super::$check(&MemoryStore::new()).await;
                    }
                )*
            }
            mod sled {
                use super::*;
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $check() {
                        let root = tempfile::tempdir().expect("tempdir");
                        super::super::$check(&sled_factory(root.path())()).await;
                    }
                )*
            }
            mod fjall {
                use super::*;
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $check() {
                        let root = tempfile::tempdir().expect("tempdir");
                        super::super::$check(&fjall_factory(root.path())()).await;
                    }
                )*
            }
        };
    }

    each_check!(
        append_read_round_trip,
        conflict_on_wrong_expected_seq,
        batch_with_wrong_seq_is_rejected,
        unknown_and_invalid_sessions,
        list_sessions_ordered_with_status,
        empty_appends,
        large_events_round_trip,
        enqueue_and_lease,
        reenqueue_replaces_task,
        duplicate_ids_in_one_enqueue_keep_the_last,
        complete_with_current_lease,
        complete_with_stale_attempt_writes_nothing,
        complete_after_expiry_is_lost,
        complete_several_tasks_in_one_append,
        cancel_removes_tasks,
        a_task_is_looked_up_by_id,
        extend_lease,
        release_leases_keeps_attempts,
        lease_filters_by_queue_target_session_and_namespace,
        overdue_tasks_are_listed_and_never_leased,
        heartbeat_details_are_kept_until_the_next_lease,
        released_tasks_are_leased_again_and_not_overdue,
        delete_removes_a_finished_session,
        delete_refuses_a_busy_session,
        in_process_leases_fence_like_durable_ones,
        append_and_lease_takes_what_the_append_queued,
        far_off_times_are_taken_and_mean_never,
        an_append_expecting_seq_0_is_refused,
        sessions_named_reads_the_records_it_holds,
        deleted_sessions_are_listed_and_recorded,
    );

    macro_rules! each_concurrency_check {
        ($($check:ident),* $(,)?) => {
            mod two_handles {
                use super::*;
                $(
                    mod $check {
                        use super::*;
                        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                        async fn memory() {
                            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
                            super::super::super::$check(store.clone(), store).await;
                        }
                        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                        async fn sled() {
                            let root = tempfile::tempdir().expect("tempdir");
                            let store: Arc<dyn Store> = Arc::new(sled_factory(root.path())());
                            super::super::super::$check(store.clone(), store).await;
                        }
                        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                        async fn fjall() {
                            let root = tempfile::tempdir().expect("tempdir");
                            let store: Arc<dyn Store> = Arc::new(fjall_factory(root.path())());
                            super::super::super::$check(store.clone(), store).await;
                        }
                    }
                )*
            }
        };
    }

    each_concurrency_check!(
        concurrent_leases_hand_each_task_once,
        a_lapsed_lease_changes_nothing,
        racing_appends_on_two_handles,
        two_engines_on_one_store,
        a_deletion_is_seen_through_another_handle,
    );

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sled_a_deletion_survives_a_reopen() {
        let root = tempfile::tempdir().expect("tempdir");
        a_deletion_survives_a_reopen(sled_factory(root.path())(), &mut sled_reopen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fjall_a_deletion_survives_a_reopen() {
        let root = tempfile::tempdir().expect("tempdir");
        a_deletion_survives_a_reopen(fjall_factory(root.path())(), &mut fjall_reopen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sled_an_in_process_lease_is_durable_after_the_next_write() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = sled_factory(root.path())();
        an_in_process_lease_is_durable_after_the_next_write(store, &mut sled_reopen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fjall_an_in_process_lease_is_durable_after_the_next_write() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = fjall_factory(root.path())();
        an_in_process_lease_is_durable_after_the_next_write(store, &mut fjall_reopen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sled_a_remote_eager_lease_is_durable_when_answered() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = sled_factory(root.path())();
        a_remote_eager_lease_is_durable_when_answered(store, &mut sled_reopen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fjall_a_remote_eager_lease_is_durable_when_answered() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = fjall_factory(root.path())();
        a_remote_eager_lease_is_durable_when_answered(store, &mut fjall_reopen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn memory_concurrent_appends() {
        concurrent_appends(Arc::new(MemoryStore::new())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sled_concurrent_appends() {
        let root = tempfile::tempdir().expect("tempdir");
        concurrent_appends(Arc::new(sled_factory(root.path())())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sled_reopen_keeps_everything() {
        let root = tempfile::tempdir().expect("tempdir");
        reopen_keeps_everything(sled_factory(root.path())(), &mut sled_reopen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn memory_run_all() {
        run_all(MemoryStore::new, None).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sled_run_all() {
        let root = tempfile::tempdir().expect("tempdir");
        run_all(sled_factory(root.path()), Some(&mut sled_reopen)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn fjall_concurrent_appends() {
        let root = tempfile::tempdir().expect("tempdir");
        concurrent_appends(Arc::new(fjall_factory(root.path())())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fjall_reopen_keeps_everything() {
        let root = tempfile::tempdir().expect("tempdir");
        reopen_keeps_everything(fjall_factory(root.path())(), &mut fjall_reopen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn fjall_run_all() {
        let root = tempfile::tempdir().expect("tempdir");
        run_all(fjall_factory(root.path()), Some(&mut fjall_reopen)).await;
    }
}
