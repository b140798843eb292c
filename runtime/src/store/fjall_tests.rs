//! Tests of the fjall store: opening and reopening, damage named or cut, the writer's batches
//! committed on the caller's thread or its own and sharing persists, refusals after a failed
//! persist.

use super::*;
use crate::store::conformance::{append_request, message};
use crate::store::engine_tests::{self, temp, write_sessions};
use crate::store::keys::seq_key;
use crate::store::{NewTask, SessionStatus, TaskKind};
use tokio::sync::oneshot;

// The conformance suite runs on this store in `conformance`'s tests, beside memory and sled.

#[test]
fn fjall_errors_are_put_in_words_not_in_their_debug_form() {
    let cases = [
        fjall::Error::Io(std::io::Error::from_raw_os_error(11)),
        fjall::Error::Storage(fjall::LsmError::Io(std::io::Error::from_raw_os_error(20))),
        fjall::Error::JournalRecovery(fjall::JournalRecoveryError::ChecksumMismatch),
        fjall::Error::Locked,
        fjall::Error::Poisoned,
    ];
    for e in &cases {
        let text = words(e);
        assert!(
            !text.contains("Os {")
                && !text.contains("kind:")
                && !text.contains("Error(")
                && !text.contains("FjallError"),
            "{text}"
        );
    }
    assert_eq!(
        words(&cases[0]),
        "Resource temporarily unavailable (os error 11)"
    );
    assert_eq!(words(&cases[1]), "Not a directory (os error 20)");
}

fn reopen(store: FjallStore) -> FjallStore {
    let dir = store.path().to_path_buf();
    drop(store);
    FjallStore::open_existing(&dir)
        .unwrap_or_else(|e| panic!("reopening the fjall store failed: {e}"))
}

#[test]
fn open_existing_refuses_places_without_a_store_and_creates_nothing() {
    engine_tests::open_existing_refuses_non_stores::<FjallStore>();
}

#[tokio::test]
async fn open_creates_nested_dirs_and_open_existing_then_finds_the_store() {
    engine_tests::open_creates_nested_dirs::<FjallStore>().await;
}

#[test]
fn a_second_open_of_an_open_store_is_a_clear_error() {
    engine_tests::a_second_open_is_refused::<FjallStore>();
}

#[tokio::test]
async fn an_in_process_lease_takes_no_sync() {
    engine_tests::an_in_process_lease_takes_no_sync::<FjallStore>().await;
}

#[tokio::test]
async fn a_remote_eager_lease_shares_the_appends_sync() {
    engine_tests::a_remote_eager_lease_shares_the_appends_sync::<FjallStore>().await;
}

#[tokio::test]
async fn an_in_process_lease_behind_an_append_waits_for_its_sync() {
    engine_tests::an_in_process_lease_behind_an_append_waits_for_its_sync::<FjallStore>().await;
}

#[tokio::test]
async fn a_sled_store_is_refused_not_shadowed_by_an_empty_one() {
    let root = temp();
    {
        let sled = crate::store::sled::SledStore::open(root.path()).expect("sled");
        sled.append(append_request("s", 1, vec![message("s", 1, "x")], 1))
            .await
            .expect("append");
    }
    match FjallStore::open(root.path()) {
        Err(Error::StoreOpen { reason, .. }) => assert!(reason.contains("sled"), "{reason}"),
        other => panic!("a sled directory must not open as fjall, got {other:?}"),
    }
    assert!(
        !root.path().join(VERSION_FILE).exists(),
        "and nothing was created"
    );
}

/// Everything survives a drop and a reopen, several times over, with writes between.
#[tokio::test]
async fn reopen_after_drop_keeps_everything() {
    let root = temp();
    let dir = root.path().join("s");
    let names: Vec<String> = (0..20).map(|i| format!("s{i:02}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut store = FjallStore::open(&dir).expect("open");
    write_sessions(&store, &names, 5).await;
    for round in 0..3u64 {
        let seq = 6 + round;
        let mut request = append_request("s00", seq, vec![message("s00", seq, "x")], 2);
        request.enqueue = vec![NewTask::new(
            TaskId {
                session_id: "s00".to_owned(),
                scheduled_seq: seq,
            },
            TaskKind::Tool,
            0,
        )];
        store.append(request).await.expect("append");
        let leases = store
            .lease_tasks(10 + round, 100, 1, &crate::store::TaskFilter::default())
            .await
            .expect("lease");
        assert_eq!(leases.len(), 1);

        let sessions = store.list_sessions().await.expect("list");
        let tasks = store.list_tasks().await.expect("tasks");
        let mut histories = Vec::new();
        for name in &names {
            histories.push(store.read_history(name, 1, None).await.expect("read"));
        }
        let queue = read_index(&store.queue_index).clone();
        assert_eq!(queue.len(), round as usize + 1, "one entry per task");
        store = reopen(store);
        assert_eq!(
            *read_index(&store.queue_index),
            queue,
            "the queue is derived again from the task records"
        );
        assert!(
            store
                .handles()
                .expect("handles")
                .queue
                .is_empty()
                .expect("queue"),
            "the queue keyspace is never written"
        );
        assert_eq!(store.list_sessions().await.expect("list"), sessions);
        assert_eq!(store.list_tasks().await.expect("tasks"), tasks);
        for (name, history) in names.iter().zip(&histories) {
            assert_eq!(
                &store.read_history(name, 1, None).await.expect("read"),
                history
            );
        }
    }
    let listed = store.list_sessions().await.expect("list");
    assert_eq!(listed.len(), 20);
    assert_eq!(listed[0].events, 8);
    let tasks = store.list_tasks().await.expect("tasks");
    assert_eq!(
        tasks
            .iter()
            .map(|t| (t.id.scheduled_seq, t.lease_attempt, t.visible_at_ms))
            .collect::<Vec<_>>(),
        [(6, 1, 110), (7, 1, 111), (8, 1, 112)]
    );
    // The derived queue finds the lapsed leases in their expiry order, and not a lease
    // still running.
    let overdue = store.overdue_tasks(111, 5).await.expect("overdue");
    assert_eq!(
        overdue
            .iter()
            .map(|t| (t.id.scheduled_seq, t.lease_attempt))
            .collect::<Vec<_>>(),
        [(6, 1), (7, 1)]
    );
}

/// A store an older version wrote: task and session records as maps of named fields, and
/// a queue keyspace entry beside each task.
#[tokio::test]
async fn a_store_with_named_records_and_a_queue_keyspace_opens_and_leases() {
    let root = temp();
    let dir = root.path().join("s");
    let store = FjallStore::open(&dir).expect("open");
    write_sessions(&store, &["old"], 2).await;
    let h = store.handles().expect("handles").clone();
    let task = Task::queued(&NewTask::new(
        TaskId {
            session_id: "old".to_owned(),
            scheduled_seq: 2,
        },
        TaskKind::Model,
        500,
    ));
    let info = SessionInfo {
        session_id: "old".to_owned(),
        status: SessionStatus::Running,
        events: 2,
        updated_at_ms: 500,
    };
    h.tasks
        .insert(
            seq_key("old", 2),
            rmp_serde::to_vec_named(&task).expect("named"),
        )
        .expect("task record");
    h.queue
        .insert(queue_key(500, &task.id), Vec::new())
        .expect("queue entry");
    h.sessions
        .insert(
            "old".as_bytes(),
            rmp_serde::to_vec_named(&info).expect("named"),
        )
        .expect("session record");
    drop(h);
    let store = reopen(store);
    assert_eq!(store.list_tasks().await.expect("tasks"), vec![task.clone()]);
    let listed = store.list_sessions().await.expect("sessions");
    assert_eq!(listed, vec![info]);
    let leases = store
        .lease_tasks(600, 100, 5, &crate::store::TaskFilter::default())
        .await
        .expect("lease");
    assert_eq!(leases.len(), 1, "the old task is queued: {leases:?}");
    assert_eq!(
        (leases[0].id.clone(), leases[0].lease_attempt),
        (task.id, 1)
    );
    let mut request = append_request("old", 3, vec![message("old", 3, "x")], 600);
    request.complete = vec![(leases[0].id.clone(), 1)];
    store.append(request).await.expect("complete the old task");
    assert_eq!(store.list_tasks().await.expect("tasks"), vec![]);
    assert!(read_index(&store.queue_index).is_empty());
    // The older version's queue entry stays in its keyspace, unread: after another reopen
    // the done task is not queued again.
    let store = reopen(store);
    let h = store.handles().expect("handles");
    assert_eq!(h.queue.len().expect("queue keyspace"), 1);
    assert!(read_index(&store.queue_index).is_empty());
    assert!(store
        .lease_tasks(10_000, 100, 5, &crate::store::TaskFilter::default())
        .await
        .expect("lease")
        .is_empty());
}

#[tokio::test]
async fn a_corrupt_task_record_fails_the_open_naming_the_task() {
    let root = temp();
    let dir = root.path().join("s");
    let store = FjallStore::open(&dir).expect("open");
    write_sessions(&store, &["s"], 2).await;
    let mut request = append_request("s", 3, vec![message("s", 3, "x")], 2);
    request.enqueue = vec![tool_task("s", 3)];
    store.append(request).await.expect("append");
    let h = store.handles().expect("handles").clone();
    h.tasks
        .insert(seq_key("s", 3), b"\x93not a task".to_vec())
        .expect("damage the record");
    drop(h);
    drop(store);
    match FjallStore::open_existing(&dir) {
        Err(Error::StoreOpen { reason, .. }) => assert!(
            reason.starts_with("corrupt record of task s/3 in the tasks keyspace: "),
            "{reason}"
        ),
        Err(other) => panic!("expected a store error naming the task, got {other:?}"),
        Ok(_) => panic!("a store whose task record does not decode opened"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_appends_share_persists() {
    let root = temp();
    let store = Arc::new(FjallStore::open(root.path()).expect("open"));
    appends_of_64_writers_share_persists(&store).await;
    // One at a time, each append is its own batch and persist.
    let before = store.persists();
    for seq in 1..=3 {
        store
            .append(append_request(
                "serial",
                seq,
                vec![message("serial", seq, "x")],
                1,
            ))
            .await
            .expect("append");
    }
    assert_eq!(store.persists() - before, 3);
}

/// On a multi-thread runtime with a single worker (tokio's default with one CPU), a
/// commit on the caller's thread would stall every other task: writes go to the writer
/// thread, so lone ones are not committed inline and concurrent ones still share persists.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn on_a_runtime_with_one_worker_writes_go_to_the_writer_thread_and_share_persists() {
    let root = temp();
    let store = Arc::new(FjallStore::open(root.path()).expect("open"));
    serial_appends(&store, "queued").await;
    assert_eq!(inline_commits(&store), 0);
    assert_eq!(events_of(&store, "queued").await, 3);
    appends_of_64_writers_share_persists(&store).await;
    assert_eq!(inline_commits(&store), 0);
}

/// 64 tasks each append four events to a session of their own: fewer than half as many
/// persists as appends.
async fn appends_of_64_writers_share_persists(store: &Arc<FjallStore>) {
    let before = store.persists();
    const WRITERS: usize = 64;
    let tasks: Vec<_> = (0..WRITERS)
        .map(|i| {
            let store = Arc::clone(store);
            tokio::spawn(async move {
                let s = format!("w{i}");
                for seq in 1..=4 {
                    store
                        .append(append_request(&s, seq, vec![message(&s, seq, "x")], 1))
                        .await
                        .expect("append");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("writer");
    }
    let persists = store.persists() - before;
    assert!(
        persists < (WRITERS * 4 / 2) as u64,
        "{} appends took {persists} persists: group commit should share them",
        WRITERS * 4
    );
}

async fn serial_appends(store: &FjallStore, session: &str) {
    for seq in 1..=3 {
        store
            .append(append_request(
                session,
                seq,
                vec![message(session, seq, "x")],
                1,
            ))
            .await
            .expect("append");
    }
}

async fn events_of(store: &FjallStore, session: &str) -> usize {
    let history = store.read_history(session, 1, None).await.expect("read");
    history.len()
}

fn inline_commits(store: &FjallStore) -> u64 {
    store.writes.shared.inline.load(Ordering::Relaxed)
}

/// A write that finds the writer idle runs on its caller's thread: each of three appends
/// in series is committed and persisted there, once each, and reads see them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_writes_commit_on_the_callers_thread() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    let persists = store.persists();
    serial_appends(&store, "lone").await;
    assert_eq!(inline_commits(&store), 3);
    assert_eq!(store.persists() - persists, 3);
    assert_eq!(events_of(&store, "lone").await, 3);
    drop(store);
    let store = FjallStore::open(root.path()).expect("reopen");
    assert_eq!(events_of(&store, "lone").await, 3);
}

/// On a current-thread runtime a sync on the caller's thread would stall every other task,
/// so every write goes to the writer thread there.
#[tokio::test(flavor = "current_thread")]
async fn on_a_current_thread_runtime_every_write_goes_to_the_writer_thread() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    serial_appends(&store, "queued").await;
    assert_eq!(inline_commits(&store), 0);
    assert_eq!(events_of(&store, "queued").await, 3);
}

fn tool_task(session: &str, seq: u64) -> NewTask {
    NewTask::new(
        TaskId {
            session_id: session.to_owned(),
            scheduled_seq: seq,
        },
        TaskKind::Tool,
        0,
    )
}

/// An append for a writer, and where its answer comes.
fn append(r: AppendRequest) -> (Write, oneshot::Receiver<Result<()>>) {
    let (reply, answer) = oneshot::channel();
    (
        Write::Append(PreparedAppend::new(r).expect("prepare"), reply),
        answer,
    )
}

/// A writer of `store`'s database beside its own writer thread, to hand batches to.
pub(super) fn writer_beside(store: &FjallStore) -> Writer {
    let handles = store.handles().expect("handles").clone();
    let (live_tasks, _) = tasks_at_open(&store.path, &handles.tasks).expect("tasks");
    Writer {
        path: store.path.clone(),
        handles,
        shared: Arc::clone(&store.writes.shared),
        overlay: Overlay::default(),
        queue_index: Arc::clone(&store.queue_index),
        live_tasks,
        recent_sessions: RecentSessionRecords::default(),
        syncer: None,
    }
}

type Answer = oneshot::Receiver<Result<()>>;

/// Hands `writer` two batches on the writer thread: "a" 1, then "a" 2 with "b" 1 queued
/// while the first one syncs; then drops it, which waits for the sync in flight and stops
/// the sync thread. Gives back the three answers.
fn two_batches_with_a_write_queued_during_the_sync(mut writer: Writer) -> [Answer; 3] {
    let (first, first_answer) = append(append_request("a", 1, vec![message("a", 1, "a1")], 10));
    writer.process_on_writer_thread(vec![first], &mut Vec::new);
    assert!(writer.syncer.is_some(), "the sync thread is started");
    let (second, second_answer) = append(append_request("a", 2, vec![message("a", 2, "a2")], 20));
    let (queued, queued_answer) = append(append_request("b", 1, vec![message("b", 1, "b1")], 20));
    let mut during_the_sync = Some(vec![queued]);
    writer.process_on_writer_thread(vec![second], &mut || {
        during_the_sync.take().unwrap_or_default()
    });
    drop(writer);
    // A write not taken would be dropped unanswered with it.
    assert!(
        during_the_sync.is_none(),
        "the write queued during the sync was taken"
    );
    [first_answer, second_answer, queued_answer]
}

/// On the writer thread a batch is persisted and answered by the sync thread, and the
/// writes that came while it synced join the next batch: three appends in two batches
/// are two persists, each answered, each landed in order.
#[tokio::test]
async fn on_the_writer_thread_writes_that_come_during_a_sync_join_the_next_batch() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    let before = store.persists();
    for answer in two_batches_with_a_write_queued_during_the_sync(writer_beside(&store)) {
        answer.await.expect("answered").expect("durable");
    }
    assert_eq!(store.persists() - before, 2, "one persist per batch");
    assert_eq!(seqs(&store, "a").await, Some(vec![1, 2]));
    assert_eq!(seqs(&store, "b").await, Some(vec![1]));
}

/// The seqs of `session`'s history, or `None` when the store has no such session.
async fn seqs(store: &FjallStore, session: &str) -> Option<Vec<u64>> {
    match store.read_history(session, 1, None).await {
        Ok(events) => Some(events.iter().map(|e| e.seq).collect()),
        Err(Error::UnknownSession { .. }) => None,
        Err(e) => panic!("reading {session}: {e}"),
    }
}

/// Asserts that `answer` is a refusal of the store's writes after a failed persist.
fn assert_refused<T: std::fmt::Debug>(answer: Result<T>, what: &str) {
    match answer {
        Err(Error::Store { reason }) => assert!(
            reason.contains("refuses writes after a failed persist")
                && reason.contains("injected fault"),
            "{what}: {reason}"
        ),
        other => panic!("{what} must be refused after a failed persist, got {other:?}"),
    }
}

/// A persist that fails on the sync thread answers its batch with the failure, refuses
/// the batch the writer thread applied meanwhile (and the write that joined it during
/// the sync) without committing it, and refuses every write after; a reopen clears the
/// refusal and finds none of the refused writes.
#[tokio::test]
async fn a_persist_failing_on_the_sync_thread_refuses_the_batch_applied_behind_it() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    let before = store.persists();
    // The first batch's persist fails, and only once the writer thread has applied the
    // next batch and waits for it.
    let faults = &store.writer_shared().faults;
    faults.failing.store(1, Ordering::Relaxed);
    faults.hold_next();
    let [first, second, queued] =
        two_batches_with_a_write_queued_during_the_sync(writer_beside(&store));
    match first.await.expect("answered") {
        Err(Error::Store { reason }) => assert!(
            reason.contains("fjall persist (fdatasync of the journal) failed: injected fault"),
            "{reason}"
        ),
        other => panic!("the batch whose persist failed must fail, got {other:?}"),
    }
    assert_refused(
        second.await.expect("answered"),
        "the batch applied behind it",
    );
    assert_refused(
        queued.await.expect("answered"),
        "the write queued during the sync",
    );
    assert_eq!(
        store.persists() - before,
        1,
        "the refused batch was not persisted"
    );
    assert_refused(
        store
            .append(append_request("c", 1, vec![message("c", 1, "c1")], 30))
            .await,
        "a later append",
    );
    // The failed batch is in doubt (committed, not known durable); the refused ones were
    // never committed, so no read finds them.
    assert!(!seqs(&store, "a").await.unwrap_or_default().contains(&2));
    assert_eq!(seqs(&store, "b").await, None);
    assert_eq!(seqs(&store, "c").await, None);

    drop(store);
    let store = FjallStore::open_existing(root.path()).expect("a reopen clears the refusal");
    let a = seqs(&store, "a").await;
    assert!(a.is_none() || a == Some(vec![1]), "a holds {a:?}");
    assert_eq!(seqs(&store, "b").await, None);
    store
        .append(append_request("b", 1, vec![message("b", 1, "b1")], 40))
        .await
        .expect("the reopened store takes writes");
    assert_eq!(seqs(&store, "b").await, Some(vec![1]));
}

/// A lone write that fails its persist on its caller's thread is answered with the
/// failure there, and the store refuses the writes after it until it is reopened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persist_failing_on_the_callers_thread_fails_that_write_and_refuses_the_next() {
    let inline = engine_tests::a_failing_sync_fails_its_write_and_refuses_the_next::<FjallStore>(
        "fjall persist (fdatasync of the journal) failed: injected fault",
    )
    .await;
    assert!(inline, "the lone write ran on its caller's thread");
}

/// Writes applied as one batch: each sees the ones before it, a rejected one writes
/// nothing while the others land, and the whole batch costs one persist.
#[tokio::test]
async fn a_batch_rejects_some_writes_and_commits_the_others_in_order() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    let t = tool_task("a", 1).id;
    let mut first = append_request("a", 1, vec![message("a", 1, "a1")], 10);
    first.enqueue = vec![tool_task("a", 1)];
    let mut lost = append_request("b", 1, vec![message("b", 1, "lost")], 10);
    lost.complete = vec![(t.clone(), 1)]; // not leased yet: attempt 0
    lost.enqueue = vec![tool_task("b", 1)];
    let mut complete = append_request("a", 2, vec![message("a", 2, "a2")], 20);
    complete.complete = vec![(t.clone(), 1)]; // leased by the lease before it
    complete.status = SessionStatus::Idle;
    let mut writes = Vec::new();
    let mut answers = Vec::new();
    for r in [
        first,
        append_request("a", 1, vec![message("a", 1, "dup")], 10),
        lost,
        append_request("c", 1, vec![message("c", 1, "c1")], 10),
    ] {
        let (write, answer) = append(r);
        writes.push(write);
        answers.push(answer);
    }
    let (lease_reply, lease_answer) = oneshot::channel();
    writes.push(Write::Lease {
        now_ms: 15,
        lease_ms: 100,
        max: 10,
        filter: crate::store::TaskFilter::default(),
        durable: true,
        reply: lease_reply,
    });
    let (write, answer) = append(complete);
    writes.push(write);
    answers.push(answer);

    let mut writer = writer_beside(&store);
    let before = store.persists();
    writer.process(writes);
    assert_eq!(store.persists() - before, 1, "one persist for the batch");
    let mut kinds = Vec::new();
    for answer in answers {
        kinds.push(match answer.await.expect("answered") {
            Ok(()) => "ok",
            Err(Error::Conflict { .. }) => "conflict",
            Err(Error::LeaseLost { .. }) => "lease lost",
            Err(_) => "other",
        });
    }
    assert_eq!(kinds, ["ok", "conflict", "lease lost", "ok", "ok"]);
    let leases = lease_answer.await.expect("answered").expect("lease");
    assert_eq!(
        leases
            .iter()
            .map(|l| (&l.id, l.lease_attempt))
            .collect::<Vec<_>>(),
        [(&t, 1)],
        "the lease saw the task enqueued earlier in the batch"
    );
    let a = store.read_history("a", 1, None).await.expect("a");
    assert_eq!(
        a.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 2],
        "the second append to a saw the first"
    );
    assert!(matches!(
        store.read_history("b", 1, None).await,
        Err(Error::UnknownSession { .. })
    ));
    assert_eq!(
        store.list_tasks().await.expect("tasks"),
        vec![],
        "b's enqueue was not written, a's task was completed"
    );
    assert!(
        read_index(&store.queue_index).is_empty(),
        "the queue entries of the leased, then completed task are gone"
    );
    let listed = store.list_sessions().await.expect("list");
    assert_eq!(
        listed
            .iter()
            .map(|i| (i.session_id.as_str(), i.events, i.status))
            .collect::<Vec<_>>(),
        [
            ("a", 2, SessionStatus::Idle),
            ("c", 1, SessionStatus::Running)
        ]
    );
}

/// The writer's recent session records follow every committed change of the sessions
/// keyspace and stay bounded: past the bound the writer reads the keyspace again, an
/// append checks its seq against the record as last committed (a conflict names it), and a
/// deleted session's appends are refused.
#[tokio::test]
async fn recent_session_records_follow_every_commit_and_stay_bounded() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    let mut writer = writer_beside(&store);
    let sessions = RECENT_SESSION_RECORDS + 10;
    for i in 0..sessions {
        let id = format!("s{i}");
        let (write, answer) = append(append_request(&id, 1, vec![message(&id, 1, "a")], 1));
        writer.process(vec![write]);
        answer.await.expect("answered").expect("first append");
        assert!(writer.recent_sessions.len() <= RECENT_SESSION_RECORDS);
    }
    assert_eq!(writer.recent_sessions.len(), 10, "started again once full");
    assert!(!writer.recent_sessions.contains_key(b"s0".as_slice()));
    // s0 is read from the keyspace, the last session from the records kept.
    for id in ["s0", &format!("s{}", sessions - 1)] {
        let (stale, stale_answer) = append(append_request(id, 1, vec![message(id, 1, "again")], 2));
        let mut idle = append_request(id, 2, vec![message(id, 2, "b")], 2);
        idle.status = SessionStatus::Idle;
        let (next, next_answer) = append(idle);
        writer.process(vec![stale, next]);
        match stale_answer.await.expect("answered") {
            Err(Error::Conflict {
                expected, actual, ..
            }) => assert_eq!((expected, actual), (1, 2), "{id}"),
            other => panic!("{id}: a stale append must conflict, got {other:?}"),
        }
        next_answer.await.expect("answered").expect("second append");
        assert!(writer.recent_sessions.contains_key(id.as_bytes()));
    }
    // A deletion is kept too: the record gone, the tombstone there.
    let (reply, deleted) = oneshot::channel();
    writer.process(vec![Write::Delete {
        session_id: "s0".into(),
        now_ms: 3,
        reply,
    }]);
    assert_eq!(deleted.await.expect("answered").expect("deleted").events, 2);
    assert_eq!(writer.recent_sessions.get(b"s0".as_slice()), Some(&None));
    let (write, answer) = append(append_request("s0", 1, vec![message("s0", 1, "c")], 4));
    writer.process(vec![write]);
    assert!(
        matches!(
            answer.await.expect("answered"),
            Err(Error::SessionDeleted { .. })
        ),
        "an append to a deleted session is refused"
    );
    drop(writer);
    assert_eq!(seqs(&store, "s0").await, None);
    assert_eq!(seqs(&store, "s1").await, Some(vec![1]));
}

/// In one batch a fenced drop reads the task as the writes before it leave it: an
/// in-process lease earlier in the batch (in the overlay, not yet committed) makes the
/// drop of that task refused whole, while the drop of a task nothing changed lands, and a
/// lease after it in the batch no longer finds the dropped task.
#[tokio::test]
async fn in_a_batch_a_fenced_drop_sees_the_lease_before_it_and_a_lease_the_drop() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    let tasks = [tool_task("a", 1), tool_task("a", 2)].map(|task| NewTask {
        start_by_ms: Some(100),
        ..task
    });
    let [t1, t2] = [tasks[0].id.clone(), tasks[1].id.clone()];
    let mut queue = append_request("a", 1, vec![message("a", 1, "a1")], 0);
    queue.enqueue = tasks.to_vec();
    store.append(queue).await.expect("queue two tasks");
    let overdue = store.overdue_tasks(100, 10).await.expect("overdue");
    assert_eq!(
        overdue.iter().map(|t| &t.id).collect::<Vec<_>>(),
        [&t1, &t2],
        "both tasks are past their start deadline"
    );
    let fenced_drop = |task: &Task| {
        let mut r = append_request("a", 2, vec![message("a", 2, "timed out")], 100);
        r.drop_if_unchanged = Some(TaskFence::of(task));
        append(r)
    };
    let lease = |durable| {
        let (reply, answer) = oneshot::channel();
        let write = Write::Lease {
            now_ms: 99,
            lease_ms: 1_000,
            max: 1,
            filter: crate::store::TaskFilter::any(),
            durable,
            reply,
        };
        (write, answer)
    };
    let (first_lease, first_leased) = lease(false);
    let (drop_leased, drop_leased_answer) = fenced_drop(&overdue[0]);
    let (drop_unchanged, drop_unchanged_answer) = fenced_drop(&overdue[1]);
    let (second_lease, second_leased) = lease(true);
    writer_beside(&store).process(vec![first_lease, drop_leased, drop_unchanged, second_lease]);

    let first = first_leased.await.expect("answered").expect("lease");
    assert_eq!(
        first
            .iter()
            .map(|l| (&l.id, l.lease_attempt))
            .collect::<Vec<_>>(),
        [(&t1, 1)],
        "the in-process lease takes the first task"
    );
    assert!(
        matches!(
            drop_leased_answer.await.expect("answered"),
            Err(Error::LeaseLost { .. })
        ),
        "the fenced drop of the task leased before it in the batch is refused"
    );
    drop_unchanged_answer
        .await
        .expect("answered")
        .expect("the fenced drop of the unchanged task lands");
    let second = second_leased.await.expect("answered").expect("lease");
    assert_eq!(
        second,
        vec![],
        "the dropped task is not leased after its drop"
    );
    let listed = store.list_tasks().await.expect("tasks");
    assert_eq!(
        listed
            .iter()
            .map(|t| (&t.id, t.lease_attempt, t.held))
            .collect::<Vec<_>>(),
        [(&t1, 1, true)],
        "the lease stands and the unchanged task is gone"
    );
    assert_eq!(seqs(&store, "a").await, Some(vec![1, 2]));
}

#[tokio::test]
async fn after_a_failed_persist_the_store_refuses_writes_but_reads() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    write_sessions(&store, &["s"], 1).await;
    *store.writes.shared.failed() = Some("injected fsync failure".to_owned());
    let mut request = append_request("s", 2, vec![message("s", 2, "x")], 2);
    request.enqueue = vec![tool_task("s", 2)];
    match store.append(request).await {
        Err(Error::Store { reason }) => assert!(reason.contains("injected"), "{reason}"),
        other => {
            panic!("an append after a failed persist must be a Store error, got {other:?}")
        }
    }
    assert!(matches!(
        store
            .lease_tasks(0, 1, 1, &crate::store::TaskFilter::default())
            .await,
        Err(Error::Store { .. })
    ));
    assert_eq!(
        store.read_history("s", 1, None).await.expect("read").len(),
        1
    );
    drop(store);
    let store = FjallStore::open_existing(root.path()).expect("a reopen clears the refusal");
    write_sessions(&store, &["t"], 1).await;
}

#[tokio::test]
async fn a_corrupt_record_names_its_session_and_seq_and_spares_other_sessions() {
    let root = temp();
    let store = FjallStore::open(root.path()).expect("open");
    write_sessions(&store, &["good", "bad", "gone"], 5).await;
    let h = store.handles().expect("handles").clone();
    let key = seq_key("bad", 3);
    let mut record = h.events.get(&key).expect("get").expect("record").to_vec();
    let last = record.len() - 1;
    record[last] ^= 0x55;
    h.events.insert(key, record).expect("insert");
    h.events.remove(seq_key("gone", 2)).expect("remove");

    match store.read_history("bad", 1, None).await {
        Err(Error::CorruptRecord {
            session_id, seq, ..
        }) => assert_eq!((session_id.as_str(), seq), ("bad", 3)),
        other => panic!("reading a flipped record must be CorruptRecord, got {other:?}"),
    }
    assert_eq!(
        store
            .read_history("bad", 4, None)
            .await
            .expect("after it")
            .len(),
        2
    );
    match store.read_history("gone", 1, None).await {
        Err(Error::CorruptRecord {
            session_id, seq, ..
        }) => assert_eq!((session_id.as_str(), seq), ("gone", 2)),
        other => panic!("a missing record must be CorruptRecord at its seq, got {other:?}"),
    }
    assert_eq!(
        store
            .read_history("good", 1, None)
            .await
            .expect("good")
            .len(),
        5
    );
}

/// The active journal of a closed store (fjall keeps unflushed writes only there).
fn journal_of(dir: &Path) -> PathBuf {
    let mut journals: Vec<PathBuf> = fs::read_dir(dir)
        .expect("ls")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "jnl"))
        .collect();
    journals.sort();
    journals.pop().expect("a journal")
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The record of the marked event `s`/`seq` as the journal holds it (records are
/// compressed, so the marker text itself is not there as it is).
fn marked_record(s: &str, seq: u64) -> Vec<u8> {
    crate::codec::encode(&message(s, seq, &format!("MARK-{s}-{seq}-"))).expect("encode")
}

/// Appends events 1..=`events` of session `s`, one per append, each carrying the text
/// `MARK-<s>-<seq>-` ([`marked_record`] finds them in the journal).
async fn append_marked(store: &FjallStore, s: &str, events: u64) {
    for seq in 1..=events {
        let text = format!("MARK-{s}-{seq}-");
        store
            .append(append_request(s, seq, vec![message(s, seq, &text)], 1))
            .await
            .expect("append");
    }
}

/// Opens the store and counts its events.
async fn reopen_count(dir: &Path) -> Result<u64> {
    let store = FjallStore::open_existing(dir)?;
    let listed = store.list_sessions().await?;
    Ok(listed.iter().map(|i| i.events).sum())
}

/// What fjall's recovery does with a damaged journal, pinned down (see the module docs):
/// a flipped byte inside a record fails the open (checksum); a torn tail is cut off; a
/// flipped batch marker cuts off everything after it, silently, and the cut is written to
/// the file.
#[tokio::test]
async fn journal_damage_fails_the_open_or_cuts_the_journal() {
    let written = |dir: &Path| {
        let dir = dir.to_path_buf();
        async move {
            let store = FjallStore::open(&dir).expect("open");
            for s in ["a", "b", "c"] {
                append_marked(&store, s, 10).await;
            }
        }
    };

    // A flipped byte in an event's payload: the batch checksum fails, the open fails.
    let root = temp();
    written(root.path()).await;
    let journal = journal_of(root.path());
    let mut bytes = fs::read(&journal).expect("read");
    let at = find(&bytes, &marked_record("b", 5)).expect("the record is in the journal");
    bytes[at + 5] ^= 0x01;
    fs::write(&journal, &bytes).expect("write");
    match reopen_count(root.path()).await {
        Err(Error::StoreOpen { reason, .. }) => {
            assert!(reason.to_lowercase().contains("checksum"), "{reason}")
        }
        other => panic!("a flipped payload byte must fail the open, got {other:?}"),
    }

    // A torn tail: the last batch loses its end. It is cut off; the rest opens.
    let root = temp();
    written(root.path()).await;
    let journal = journal_of(root.path());
    let bytes = fs::read(&journal).expect("read");
    let at = find(&bytes, &marked_record("c", 10)).expect("the last record");
    let mut torn = bytes[..at + 4].to_vec();
    torn.resize(bytes.len(), 0); // the preallocated zeros after a torn write
    fs::write(&journal, &torn).expect("write");
    assert_eq!(reopen_count(root.path()).await.expect("opens"), 29);

    // A flipped batch-start marker (tag 1) in the middle: everything from there on is
    // dropped without an error, and the journal file is truncated on disk.
    let root = temp();
    written(root.path()).await;
    let journal = journal_of(root.path());
    let mut bytes = fs::read(&journal).expect("read");
    let at = find(&bytes, &marked_record("b", 5)).expect("the record");
    // The batch's start entry is the last `1` tag before the first item (`2` tag) of it.
    let start = bytes[..at]
        .windows(14)
        .rposition(|w| w[0] == 1 && w[13] == 2)
        .expect("a start entry before the item");
    bytes[start] = 0x7f;
    fs::write(&journal, &bytes).expect("write");
    let recovered = reopen_count(root.path())
        .await
        .expect("opens without an error");
    assert!(
        recovered < 30,
        "events after the damage are gone: {recovered}"
    );
    assert_eq!(recovered, 14, "a, then b up to seq 4");
    let after = fs::read(&journal).expect("read");
    assert_eq!(
        after.len(),
        bytes.len(),
        "the journal keeps its preallocated length"
    );
    assert!(
        after[start..].iter().all(|&b| b == 0),
        "opening cut the journal file at the damage (what follows reads as zeros)"
    );
}

/// fjall opens a recovered journal for appending, cut at its last whole batch, so every
/// write after a reopen grew the file, and every fdatasync wrote the inode's size too
/// (about half again as long on ext4). cairn's patched fjall (`vendor/README.md`) writes on
/// inside the preallocated file instead, as into a new journal: the journal keeps its
/// preallocated length, each reopen's writes follow the last ones, and all read back; a
/// torn write there is cut off at the next open as in a new journal, and writing goes on.
#[tokio::test]
async fn a_reopened_journal_is_written_on_inside_its_preallocated_file() {
    const PREALLOCATED: usize = 64 * 1024 * 1024;
    let root = temp();
    let dir = root.path().join("s");
    let mut store = FjallStore::open(&dir).expect("open");
    let mut previous_last = 0;
    for s in ["a", "b", "c", "d"] {
        append_marked(&store, s, 5).await;
        let journal = journal_of(&dir);
        let bytes = fs::read(&journal).expect("read");
        assert_eq!(
            bytes.len(),
            PREALLOCATED,
            "session {s}: the journal was written inside its preallocated length"
        );
        let first = find(&bytes, &marked_record(s, 1)).expect("the first record");
        let last = find(&bytes, &marked_record(s, 5)).expect("the last record");
        assert!(
            previous_last < first && first < last && last < 64 * 1024,
            "session {s}'s records follow the ones before the reopen: \
             {previous_last} < {first} < {last}"
        );
        previous_last = last;
        drop(store);
        if s == "d" {
            // A torn last write: d's last batch loses its end, the preallocated zeros
            // after it as they were.
            let mut torn = bytes[..last + 4].to_vec();
            torn.resize(PREALLOCATED, 0);
            fs::write(&journal, &torn).expect("write");
        }
        store = FjallStore::open_existing(&dir).expect("reopen");
    }
    async fn events(store: &FjallStore) -> u64 {
        let listed = store.list_sessions().await.expect("list");
        listed.iter().map(|i| i.events).sum()
    }
    assert_eq!(events(&store).await, 19, "all but d's torn last event");
    store
        .append(append_request("d", 5, vec![message("d", 5, "again")], 1))
        .await
        .expect("append after the cut");
    drop(store);
    let store = FjallStore::open_existing(&dir).expect("reopen");
    assert_eq!(events(&store).await, 20);
    for s in ["a", "b", "c", "d"] {
        let history = store.read_history(s, 1, None).await.expect("read");
        assert_eq!(history.len(), 5, "session {s}");
    }
}

/// Where the first hole of `file` starts (its length when it has none).
#[cfg(target_os = "linux")]
fn first_hole(file: &Path) -> u64 {
    use std::os::fd::AsRawFd;
    let file = File::open(file).expect("open");
    // SAFETY: lseek on a descriptor this File owns; no memory is passed.
    let hole = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_HOLE) };
    assert!(hole >= 0, "SEEK_HOLE: {}", std::io::Error::last_os_error());
    hole as u64
}

/// The journal's file holds written blocks (zeros) at least 32 KiB past its last record,
/// on a new store and on one opened again (vendor/README.md, the second patch), so a
/// sync does not also write the block map of blocks its own write allocated. fjall as
/// released leaves a hole from the block after the last record on.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_journal_is_written_with_zeros_ahead_of_its_last_record() {
    let root = temp();
    let dir = root.path().join("s");
    let mut store = FjallStore::open(&dir).expect("open");
    for s in ["a", "b", "c"] {
        append_marked(&store, s, 20).await;
        let journal = journal_of(&dir);
        let bytes = fs::read(&journal).expect("read");
        let last = find(&bytes, &marked_record(s, 20)).expect("the last record");
        let end = bytes.iter().rposition(|b| *b != 0).expect("records") + 1;
        assert!(
            end > last,
            "session {s}: the journal ends after its last record"
        );
        let hole = first_hole(&journal);
        assert!(
            hole >= end as u64 + 32 * 1024,
            "session {s}: the journal's records end at {end}, its first hole starts at {hole}"
        );
        assert!(
            hole <= end as u64 + 64 * 1024 + 4096,
            "session {s}: zeros go at most 64 KiB ahead: records end at {end}, hole at {hole}"
        );
        drop(store);
        store = FjallStore::open_existing(&dir).expect("reopen");
    }
    for s in ["a", "b", "c"] {
        let history = store.read_history(s, 1, None).await.expect("read");
        assert_eq!(history.len(), 20, "session {s}");
    }
}

/// A lone append, committed and persisted on its caller's thread, writes its journal record
/// out at its commit and starts the device's write of it there (patch 4 in
/// `vendor/README.md`): when its persist begins, the record is in the journal file already,
/// not in fjall's buffer. (That the device's write has begun is not observable here; the
/// `sync_file_range` that starts it is a hint.)
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_append_is_in_the_journal_file_when_its_sync_begins() {
    let root = temp();
    let dir = root.path().join("s");
    let store = Arc::new(FjallStore::open(&dir).expect("open"));
    let sync_waits = store.writer_shared().faults.hold_next();
    let appending = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            store
                .append(append_request(
                    "a",
                    1,
                    vec![message("a", 1, "MARK-a-1-")],
                    1,
                ))
                .await
        })
    };
    tokio::task::spawn_blocking(move || {
        sync_waits.recv_timeout(std::time::Duration::from_secs(30))
    })
    .await
    .expect("join")
    .expect("the append's sync begins, and waits");
    let in_the_file = find(
        &fs::read(journal_of(&dir)).expect("read"),
        &marked_record("a", 1),
    );
    store.writer_shared().faults.release();
    appending.await.expect("join").expect("append");
    assert!(
        in_the_file.is_some(),
        "the append's record must be in the journal file when its sync begins"
    );
    let history = store.read_history("a", 1, None).await.expect("read");
    assert_eq!(history.len(), 1);
}

/// A creation killed before fjall wrote `version` leaves `0.jnl`, on which fjall's next
/// create fails for good; the store clears exactly that and opens. A store with data whose
/// `version` went missing is not touched.
#[tokio::test]
async fn an_interrupted_creation_is_finished_by_the_next_open() {
    let root = temp();
    let dir = root.path().join("s");
    fs::create_dir_all(dir.join("keyspaces")).expect("mkdir");
    fs::write(dir.join("lock"), b"").expect("lock");
    let journal = File::create(dir.join("0.jnl")).expect("journal");
    journal.set_len(64 * 1024 * 1024).expect("preallocate");
    drop(journal);
    let store = FjallStore::open(&dir).expect("opens after an interrupted creation");
    write_sessions(&store, &["s"], 2).await;
    drop(store);

    fs::remove_file(dir.join(VERSION_FILE)).expect("rm version");
    let journal = journal_of(&dir);
    let before = fs::read(&journal).expect("read");
    assert!(
        matches!(FjallStore::open(&dir), Err(Error::StoreOpen { .. })),
        "a store with data and no version file must not open as a new one"
    );
    assert_eq!(
        fs::read(&journal).expect("read"),
        before,
        "its journal is untouched"
    );
}
