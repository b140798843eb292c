//! Tests that both embedded engines ([`SledStore`] and [`FjallStore`]) must pass beyond the
//! conformance suite: how they open, create and refuse store directories. Each engine's test
//! module runs them under its own test names.

use super::fjall::FjallStore;
use super::sled::SledStore;
use super::write_queue::{PreparedAppend, ProcessBatch, Shared, Write};
use super::{Lease, NewTask, Store, TaskFilter, TaskId, TaskKind};
use crate::error::{Error, Result};
use crate::store::conformance::{append_request, message};
use std::fs;
use std::path::Path;

/// What these tests need of an embedded store.
pub(super) trait EmbeddedStore: Store + Sized + std::fmt::Debug {
    fn open(dir: &Path) -> Result<Self>;
    fn open_existing(dir: &Path) -> Result<Self>;
    fn path(&self) -> &Path;
    fn size_on_disk(&self) -> Result<u64>;
    /// What the store shares with its writer: counters, injected faults.
    fn writer_shared(&self) -> &Shared;
    /// A writer of the store's database beside its own writer thread, to hand batches to.
    fn writer_beside(&self) -> Box<dyn ProcessBatch>;
}

impl EmbeddedStore for SledStore {
    fn open(dir: &Path) -> Result<Self> {
        SledStore::open(dir)
    }
    fn open_existing(dir: &Path) -> Result<Self> {
        SledStore::open_existing(dir)
    }
    fn path(&self) -> &Path {
        SledStore::path(self)
    }
    fn size_on_disk(&self) -> Result<u64> {
        SledStore::size_on_disk(self)
    }
    fn writer_shared(&self) -> &Shared {
        Self::writer_shared(self)
    }
    fn writer_beside(&self) -> Box<dyn ProcessBatch> {
        Self::writer_beside(self)
    }
}

impl EmbeddedStore for FjallStore {
    fn open(dir: &Path) -> Result<Self> {
        FjallStore::open(dir)
    }
    fn open_existing(dir: &Path) -> Result<Self> {
        FjallStore::open_existing(dir)
    }
    fn path(&self) -> &Path {
        FjallStore::path(self)
    }
    fn size_on_disk(&self) -> Result<u64> {
        FjallStore::size_on_disk(self)
    }
    fn writer_shared(&self) -> &Shared {
        Self::writer_shared(self)
    }
    fn writer_beside(&self) -> Box<dyn ProcessBatch> {
        Self::writer_beside(self)
    }
}

/// A fresh temporary directory.
pub(super) fn temp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// Appends `events` events to each of the sessions `names`, in one append each.
pub(super) async fn write_sessions(store: &impl Store, names: &[&str], events: u64) {
    for s in names {
        let batch = (1..=events)
            .map(|seq| message(s, seq, &format!("{s}-{seq}")))
            .collect();
        store
            .append(append_request(s, 1, batch, 1))
            .await
            .expect("append");
    }
}

/// `open_existing` refuses a missing directory, an empty one and a file with `StoreOpen`
/// ("no store here", naming the path) and creates nothing; `open` on a file is `StoreOpen`.
pub(super) fn open_existing_refuses_non_stores<S: EmbeddedStore>() {
    let root = temp();
    let missing = root.path().join("missing");
    let empty = root.path().join("empty");
    fs::create_dir(&empty).expect("mkdir");
    let file = root.path().join("file");
    fs::write(&file, b"not a store").expect("write");
    for (dir, what) in [
        (&missing, "a missing dir"),
        (&empty, "an empty dir"),
        (&file, "a file"),
    ] {
        match S::open_existing(dir) {
            Err(Error::StoreOpen { path, reason }) => {
                assert_eq!(path, dir.display().to_string(), "the error names the path");
                assert!(
                    reason.contains("no store here"),
                    "{what}: unclear reason {reason:?}"
                );
            }
            other => panic!("open_existing on {what} must fail with StoreOpen, got {other:?}"),
        }
    }
    assert!(
        !missing.exists(),
        "open_existing must not create the directory"
    );
    assert_eq!(
        fs::read_dir(&empty).expect("ls").count(),
        0,
        "nor files in it"
    );
    assert!(
        matches!(S::open(&file), Err(Error::StoreOpen { .. })),
        "open on a file is StoreOpen"
    );
}

/// `open` creates missing parent directories; `open_existing` then finds what it wrote.
pub(super) async fn open_creates_nested_dirs<S: EmbeddedStore>() {
    let root = temp();
    let dir = root.path().join("a").join("b");
    let store = S::open(&dir).expect("open");
    assert_eq!(store.path(), dir.as_path());
    write_sessions(&store, &["s"], 3).await;
    assert!(store.size_on_disk().expect("size") > 0);
    drop(store);
    let store = S::open_existing(&dir).expect("open_existing");
    assert_eq!(
        store.read_history("s", 1, None).await.expect("read").len(),
        3
    );
}

/// Opening a store that is open already is `StoreOpen`, saying it is locked.
pub(super) fn a_second_open_is_refused<S: EmbeddedStore>() {
    let root = temp();
    let _store = S::open(root.path()).expect("open");
    match S::open(root.path()) {
        Err(Error::StoreOpen { reason, .. }) => {
            assert!(
                reason.contains("lock"),
                "the reason should say the store is locked: {reason}"
            )
        }
        other => panic!("opening an open store must be StoreOpen, got {other:?}"),
    }
}

/// An in-process lease is answered without a sync of its own, while a durable lease takes
/// one: the turn's path loses a sync per lease, and a lease for a remote worker keeps it.
pub(super) async fn an_in_process_lease_takes_no_sync<S: EmbeddedStore>() {
    let root = temp();
    let store = S::open(root.path()).expect("open");
    let mut request = append_request("s", 1, vec![message("s", 1, "go")], 1);
    request.enqueue = (1..=2)
        .map(|seq| {
            let id = TaskId {
                session_id: "s".to_owned(),
                scheduled_seq: seq,
            };
            NewTask::new(id, TaskKind::Tool, 0)
        })
        .collect();
    store.append(request).await.expect("enqueue");
    let commits = || {
        store
            .durable_commits()
            .expect("an embedded store counts its syncs")
    };
    let before = commits();
    let here = store
        .lease_tasks_in_process(10, 1_000, 1, &TaskFilter::any())
        .await
        .expect("lease in process");
    assert_eq!(here.len(), 1);
    assert_eq!(commits() - before, 0, "an in-process lease syncs nothing");
    let remote = store
        .lease_tasks(10, 1_000, 1, &TaskFilter::any())
        .await
        .expect("durable lease");
    assert_eq!(remote.len(), 1);
    assert_eq!(commits() - before, 1, "a durable lease is one sync");
}

/// An append that leases for a worker elsewhere (through a server) leases the task it queued
/// with it, in its one sync, where a lease round of its own would cost a second; the
/// remote lease is what a reopen finds.
pub(super) async fn a_remote_eager_lease_shares_the_appends_sync<S: EmbeddedStore>() {
    use crate::store::{LeaseHolder, LeaseRequest};
    let root = temp();
    let store = S::open(root.path()).expect("open");
    let mut request = append_request("s", 1, vec![message("s", 1, "go")], 1);
    request.enqueue = vec![tool_task("s", 1)];
    let next = LeaseRequest {
        filter: std::sync::Arc::new(TaskFilter::any()),
        max: 1,
        lease_ms: 1_000,
        holder: LeaseHolder::Remote,
    };
    let before = store
        .durable_commits()
        .expect("an embedded store counts its syncs");
    let leased = store
        .append_and_lease(request, &next)
        .await
        .expect("append and lease");
    assert_eq!(leased.len(), 1, "the queued task, leased with the append");
    assert_eq!(
        store.durable_commits().expect("counted") - before,
        1,
        "the append and its lease in one sync"
    );
    drop(store);
    let store = S::open(root.path()).expect("reopen");
    let again = store
        .lease_tasks(10, 1_000, 1, &TaskFilter::any())
        .await
        .expect("lease after the reopen");
    assert!(
        again.is_empty(),
        "the task is held by the remote lease: {again:?}"
    );
}

/// A lone write whose sync fails is answered with the failure (its text contains `failure`),
/// and the store refuses the writes after it, uncommitted, until it is reopened. Gives back
/// whether the failed write ran on its caller's thread.
pub(super) async fn a_failing_sync_fails_its_write_and_refuses_the_next<S: EmbeddedStore>(
    failure: &str,
) -> bool {
    use std::sync::atomic::Ordering;
    let root = temp();
    let store = S::open(root.path()).expect("open");
    write_sessions(&store, &["a"], 1).await;
    assert_eq!(store.write_refusal(), None, "a fresh store takes writes");
    let inline_before = store.writer_shared().inline.load(Ordering::Relaxed);
    store
        .writer_shared()
        .faults
        .failing
        .store(1, Ordering::Relaxed);
    match store
        .append(append_request("a", 2, vec![message("a", 2, "a2")], 10))
        .await
    {
        Err(Error::Store { reason }) => assert!(reason.contains(failure), "{reason}"),
        other => panic!("the write whose sync failed must fail, got {other:?}"),
    }
    let inline = store.writer_shared().inline.load(Ordering::Relaxed) - inline_before;
    match store
        .append(append_request("b", 1, vec![message("b", 1, "b1")], 20))
        .await
    {
        Err(Error::Store { reason }) => assert!(
            reason.contains("refuses writes after a failed") && reason.contains("injected fault"),
            "{reason}"
        ),
        other => panic!("an append after a failed sync must be refused, got {other:?}"),
    }
    let refusal = store
        .write_refusal()
        .expect("the store says it refuses writes");
    assert!(
        refusal.contains("refuses writes after a failed")
            && refusal.contains(failure)
            && refusal.contains("reopen it"),
        "{refusal}"
    );
    let unknown = |read: Result<_>| matches!(read, Err(Error::UnknownSession { .. }));
    assert!(unknown(store.read_history("b", 1, None).await));
    drop(store);
    let store = S::open_existing(root.path()).expect("a reopen clears the refusal");
    assert_eq!(store.write_refusal(), None);
    assert!(unknown(store.read_history("b", 1, None).await));
    store
        .append(append_request("b", 1, vec![message("b", 1, "b1")], 30))
        .await
        .expect("the reopened store takes writes");
    inline == 1
}

/// A tool task of session `s` scheduled at `seq`, visible at once.
fn tool_task(s: &str, seq: u64) -> NewTask {
    let id = TaskId {
        session_id: s.to_owned(),
        scheduled_seq: seq,
    };
    NewTask::new(id, TaskKind::Tool, 0)
}

type Answer<T> = tokio::sync::oneshot::Receiver<Result<T>>;

/// An append of one event to `s` at `seq` that queues task `s`/`seq`, as a write for a writer.
fn append_queueing(s: &str, seq: u64) -> (Write, Answer<()>) {
    let mut request = append_request(s, seq, vec![message(s, seq, "go")], 10);
    request.enqueue = vec![tool_task(s, seq)];
    let prepared = PreparedAppend::new(request).expect("prepare");
    let (reply, answer) = tokio::sync::oneshot::channel();
    (Write::Append(prepared, reply), answer)
}

/// An in-process lease of one task at 20 ms, as a write for a writer.
fn in_process_lease() -> (Write, Answer<Vec<Lease>>) {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let write = Write::Lease {
        now_ms: 20,
        lease_ms: 1_000,
        max: 1,
        filter: TaskFilter::any(),
        durable: false,
        reply,
    };
    (write, answer)
}

/// Hands `batch` to a writer beside `store`'s own on a thread of its own, as the writer thread
/// would, and waits until its sync, held, has begun: everything the batch answers before its
/// sync is answered then. The thread ends once the sync is let go and has answered the batch.
fn run_with_the_sync_held<S: EmbeddedStore>(
    store: &S,
    batch: Vec<Write>,
) -> std::thread::JoinHandle<()> {
    let reached = store.writer_shared().faults.hold_next();
    let mut writer = store.writer_beside();
    let thread = std::thread::spawn(move || {
        writer.process_on_writer_thread(batch, &mut Vec::new);
        // Waits for a sync still in flight on another thread (fjall's).
        drop(writer);
    });
    reached
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the batch's sync began (a batch with a write to sync reaches its sync)");
    thread
}

/// The tasks leased, by id.
fn leased(leases: &[Lease]) -> Vec<String> {
    leases.iter().map(|l| l.id.to_string()).collect()
}

/// An in-process lease that joins a batch behind a write waiting for the batch's sync (here an
/// append that queued the very task it leases) is answered with that write, once the sync
/// succeeds, and with the sync's failure when it fails: no task runs before the event that
/// scheduled it is on disk. An in-process lease ahead of every such write is still answered
/// as soon as it is committed, before the sync.
pub(super) async fn an_in_process_lease_behind_an_append_waits_for_its_sync<S: EmbeddedStore>() {
    use std::sync::atomic::Ordering;
    use tokio::sync::oneshot::error::TryRecvError;
    let root = temp();
    let store = S::open(root.path()).expect("open");
    let mut first = append_request("s", 1, vec![message("s", 1, "go")], 1);
    first.enqueue = vec![tool_task("s", 1)];
    store.append(first).await.expect("queue s/1 durably");

    // s/1 is durable; s/2 is queued by an append of the same batch.
    let (ahead, mut ahead_answer) = in_process_lease();
    let (append, mut append_answer) = append_queueing("s", 2);
    let (behind, mut behind_answer) = in_process_lease();
    let batch = run_with_the_sync_held(&store, vec![ahead, append, behind]);
    match ahead_answer.try_recv() {
        Ok(Ok(leases)) => assert_eq!(leased(&leases), ["s/1"]),
        other => panic!("a lease ahead of the append is answered at its commit, got {other:?}"),
    }
    assert!(matches!(append_answer.try_recv(), Err(TryRecvError::Empty)));
    assert!(
        matches!(behind_answer.try_recv(), Err(TryRecvError::Empty)),
        "the lease of s/2 was answered before the append that queued s/2 was durable"
    );
    store.writer_shared().faults.release();
    batch.join().expect("the writer");
    append_answer.await.expect("answered").expect("durable");
    let leases = behind_answer.await.expect("answered").expect("leased");
    assert_eq!(leased(&leases), ["s/2"], "answered with the append");

    // The same batch whose sync fails: the lease is answered with the failure.
    let (append, mut append_answer) = append_queueing("s", 3);
    let (behind, mut behind_answer) = in_process_lease();
    store
        .writer_shared()
        .faults
        .failing
        .store(1, Ordering::Relaxed);
    let batch = run_with_the_sync_held(&store, vec![append, behind]);
    assert!(matches!(append_answer.try_recv(), Err(TryRecvError::Empty)));
    assert!(
        matches!(behind_answer.try_recv(), Err(TryRecvError::Empty)),
        "the lease of s/3 was answered before the append that queued s/3 was durable"
    );
    store.writer_shared().faults.release();
    batch.join().expect("the writer");
    for (what, answer) in [
        (
            "the append",
            append_answer.await.expect("answered").map(|()| Vec::new()),
        ),
        ("the lease", behind_answer.await.expect("answered")),
    ] {
        match answer {
            Err(Error::Store { reason }) => {
                assert!(reason.contains("injected fault"), "{what}: {reason}")
            }
            other => panic!("{what} must fail with its sync, got {other:?}"),
        }
    }
    assert!(store.write_refusal().is_some(), "the store refuses writes");
}
