//! Tests of the sled store: opening and reopening, damage named or survived, appends sharing
//! flushes, large events in blobs, queue entries, refusals after a failed sync.

use super::*;
use crate::codec;
use crate::store::conformance::{append_request, message};
use crate::store::engine_tests::{self, temp, write_sessions};
use crate::store::keys::seq_key;
use crate::store::{SessionStatus, TaskKind};
use std::sync::Arc;

#[test]
fn open_existing_refuses_places_without_a_store_and_creates_nothing() {
    engine_tests::open_existing_refuses_non_stores::<SledStore>();
}

#[tokio::test]
async fn open_creates_nested_dirs_and_open_existing_then_finds_the_store() {
    engine_tests::open_creates_nested_dirs::<SledStore>().await;
}

#[test]
fn a_second_open_of_an_open_store_is_a_clear_error() {
    engine_tests::a_second_open_is_refused::<SledStore>();
}

#[tokio::test]
async fn an_in_process_lease_takes_no_sync() {
    engine_tests::an_in_process_lease_takes_no_sync::<SledStore>().await;
}

#[tokio::test]
async fn a_remote_eager_lease_shares_the_appends_sync() {
    engine_tests::a_remote_eager_lease_shares_the_appends_sync::<SledStore>().await;
}

#[tokio::test]
async fn an_in_process_lease_behind_an_append_waits_for_its_sync() {
    engine_tests::an_in_process_lease_behind_an_append_waits_for_its_sync::<SledStore>().await;
}

/// Garbage where sled's files are: opening fails or recovers, and never panics.
#[test]
fn opening_garbage_files_never_panics() {
    let garbage: Vec<u8> = (0..200_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    type Files<'a> = Vec<(&'a str, &'a [u8])>;
    let cases: Vec<(&str, Files)> = vec![
        ("garbage db", vec![("db", &garbage)]),
        ("garbage conf", vec![("conf", &garbage[..100])]),
        (
            "garbage db and conf",
            vec![("db", &garbage), ("conf", &garbage[..64])],
        ),
        (
            "garbage snapshot",
            vec![("snap.0000000000000100", &garbage[..5_000])],
        ),
        ("short conf", vec![("conf", b"x")]),
        ("blobs is a file", vec![("blobs", b"x")]),
    ];
    for (what, files) in cases {
        let root = temp();
        for (name, bytes) in files {
            fs::write(root.path().join(name), bytes).expect("write");
        }
        let result = std::panic::catch_unwind(|| SledStore::open(root.path()).map(drop));
        assert!(result.is_ok(), "opening a dir with {what} panicked");
    }
    // A real store whose db file is then overwritten in the middle. (sled 0.34 takes a
    // corrupt log message for a torn write and recovers the log up to it, so this opens,
    // without the data written after the damage.)
    let root = temp();
    {
        let store = SledStore::open(root.path()).expect("open");
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(write_sessions(&store, &["a", "b"], 50));
    }
    let db = root.path().join("db");
    let mut bytes = fs::read(&db).expect("read db");
    let mid = bytes.len() / 3;
    let end = (mid + 4_096).min(bytes.len());
    bytes[mid..end].copy_from_slice(&garbage[..end - mid]);
    fs::write(&db, &bytes).expect("write db");
    let result = std::panic::catch_unwind(|| SledStore::open_existing(root.path()).map(drop));
    assert!(
        result.is_ok(),
        "opening a store with a damaged db file panicked"
    );
}

#[tokio::test]
async fn a_corrupt_record_names_its_session_and_seq_and_spares_other_sessions() {
    let root = temp();
    let store = SledStore::open(root.path()).expect("open");
    write_sessions(&store, &["good", "bad", "gone"], 5).await;
    let h = store.handles().expect("handles");
    let key = seq_key("bad", 3);
    let mut record = h.events.get(&key).expect("get").expect("record").to_vec();
    let last = record.len() - 1;
    record[last] ^= 0x55;
    h.events.insert(key, record).expect("insert");
    h.events.remove(seq_key("gone", 2)).expect("remove");

    match store.read_history("bad", 1, None).await {
        Err(Error::CorruptRecord {
            session_id,
            seq,
            reason,
        }) => {
            assert_eq!((session_id.as_str(), seq), ("bad", 3), "{reason}");
            assert!(reason.contains("checksum"), "{reason}");
        }
        other => panic!("reading a flipped record must be CorruptRecord, got {other:?}"),
    }
    assert_eq!(
        store
            .read_history("bad", 4, None)
            .await
            .expect("records after it read")
            .len(),
        2
    );
    assert_eq!(
        store
            .read_history("bad", 1, Some(2))
            .await
            .expect("records before it read")
            .len(),
        2
    );
    match store.read_history("gone", 1, None).await {
        Err(Error::CorruptRecord {
            session_id, seq, ..
        }) => {
            assert_eq!((session_id.as_str(), seq), ("gone", 2));
        }
        other => panic!("a missing record must be CorruptRecord at its seq, got {other:?}"),
    }
    let good = store
        .read_history("good", 1, None)
        .await
        .expect("other sessions stay readable");
    assert_eq!(
        good.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5]
    );

    // A record of another session stored under this key is corrupt too.
    let foreign = codec::encode(&message("good", 1, "x")).expect("encode");
    h.events
        .insert(seq_key("gone", 2), foreign)
        .expect("insert");
    match store.read_history("gone", 1, None).await {
        Err(Error::CorruptRecord { seq: 2, reason, .. }) => {
            assert!(reason.contains("belongs to"), "{reason}")
        }
        other => panic!("a misplaced record must be CorruptRecord, got {other:?}"),
    }
}

/// Appends committed in one group transaction: each sees the ones before it, and a
/// rejected one writes nothing while the others land.
#[tokio::test]
async fn a_group_of_appends_rejects_some_and_commits_the_others() {
    let root = temp();
    let store = SledStore::open(root.path()).expect("open");
    let t = TaskId {
        session_id: "a".to_owned(),
        scheduled_seq: 1,
    };
    let mut first = append_request("a", 1, vec![message("a", 1, "a1")], 10);
    first.enqueue = vec![crate::store::NewTask::new(t.clone(), TaskKind::Tool, 0)];
    let mut lost = append_request("b", 1, vec![message("b", 1, "lost")], 10);
    lost.complete = vec![(t.clone(), 1)]; // not leased: attempt 0
    lost.enqueue = vec![crate::store::NewTask::new(
        TaskId {
            session_id: "b".to_owned(),
            scheduled_seq: 1,
        },
        TaskKind::Model,
        0,
    )];
    let mut cancel = append_request("a", 2, vec![message("a", 2, "a2")], 20);
    cancel.cancel = vec![t.clone()];
    cancel.status = SessionStatus::Idle;
    let group = [
        first,
        append_request("a", 1, vec![message("a", 1, "dup")], 10),
        lost,
        append_request("c", 1, vec![message("c", 1, "c1")], 10),
        cancel,
    ]
    .map(|r| PreparedAppend::new(r).expect("prepare"));
    let outcomes = append_all(store.handles().expect("handles"), &group).expect("commit");
    let kinds: Vec<&str> = outcomes
        .iter()
        .map(|o| match o {
            Ok(()) => "ok",
            Err(Error::Conflict { .. }) => "conflict",
            Err(Error::LeaseLost { .. }) => "lease lost",
            Err(_) => "other",
        })
        .collect();
    assert_eq!(kinds, ["ok", "conflict", "lease lost", "ok", "ok"]);
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
        "b's enqueue was not written, a's task was cancelled"
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

#[tokio::test]
async fn a_stray_queue_entry_is_dropped_not_fatal() {
    let root = temp();
    let store = SledStore::open(root.path()).expect("open");
    let stray = TaskId {
        session_id: "gone".to_owned(),
        scheduled_seq: 3,
    };
    let h = store.handles().expect("handles");
    h.queue
        .insert(queue_key(5, &stray), &[] as &[u8])
        .expect("insert");
    let mut request = append_request("s", 1, vec![message("s", 1, "a")], 0);
    let real = TaskId {
        session_id: "s".to_owned(),
        scheduled_seq: 1,
    };
    request.enqueue = vec![crate::store::NewTask::new(
        real.clone(),
        TaskKind::Model,
        10,
    )];
    store.append(request).await.expect("append");
    let leases = store
        .lease_tasks(100, 10, 10, &crate::store::TaskFilter::default())
        .await
        .expect("lease");
    assert_eq!(leases.iter().map(|l| &l.id).collect::<Vec<_>>(), [&real]);
    assert_eq!(
        h.queue.len(),
        1,
        "the stray entry is gone, the leased task's is there"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_appends_share_flushes() {
    let root = temp();
    let store = Arc::new(SledStore::open(root.path()).expect("open"));
    let before = store.writes.shared.syncs.load(Ordering::Relaxed);
    const WRITERS: usize = 64;
    let tasks: Vec<_> = (0..WRITERS)
        .map(|i| {
            let store = Arc::clone(&store);
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
    let flushes = store.writes.shared.syncs.load(Ordering::Relaxed) - before;
    assert!(
        flushes < (WRITERS * 4 / 2) as u64,
        "{} appends took {flushes} flushes: group commit should share them",
        WRITERS * 4
    );
}

#[tokio::test]
async fn large_events_go_to_blobs_that_are_synced_and_survive_reopen() {
    let root = temp();
    let store = SledStore::open(root.path()).expect("open");
    let big = message(
        "big",
        1,
        &crate::store::conformance::incompressible_text(1, 400 * 1024),
    );
    store
        .append(append_request("big", 1, vec![big.clone()], 1))
        .await
        .expect("append");
    let blobs = fs::read_dir(root.path().join("blobs"))
        .expect("blobs dir")
        .count();
    assert!(blobs > 0, "a 400 KiB event should be stored as a sled blob");
    drop(store);
    let store = SledStore::open_existing(root.path()).expect("reopen");
    assert_eq!(
        store.read_history("big", 1, None).await.expect("read"),
        vec![big]
    );
}

/// A write whose sync fails is answered with the failure, and the store refuses the
/// writes after it until it is reopened, which finds none of the refused writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_sync_fails_its_batch_and_refuses_the_next() {
    let inline = engine_tests::a_failing_sync_fails_its_write_and_refuses_the_next::<SledStore>(
        "sled flush failed: injected fault",
    )
    .await;
    assert!(!inline, "sled commits every write on its writer thread");
}

/// A queue key too short to hold its visibility time (damage on the disk) fails a release
/// and the timers' scan with an error naming the key, never a panic of the writer thread
/// nor a scan that stops there unsaid; nothing was written, so the store takes other
/// writes as before.
#[tokio::test]
async fn a_short_queue_key_fails_a_release_naming_it() {
    let root = temp();
    let store = SledStore::open(root.path()).expect("open");
    write_sessions(&store, &["s"], 1).await;
    let h = store.handles().expect("handles");
    h.queue.insert(b"abc", &[] as &[u8]).expect("insert");
    for attempt in ["a release", "a release after it"] {
        match store.release_leases(10).await {
            Err(Error::Store { reason }) => assert!(
                reason.contains("queue") && reason.contains("[97, 98, 99]"),
                "{attempt}: the error names the key: {reason}"
            ),
            other => panic!("{attempt} over a short queue key must fail, got {other:?}"),
        }
    }
    match store.overdue_tasks(u64::MAX, 10).await {
        Err(Error::Store { reason }) => assert!(
            reason.contains("[97, 98, 99]"),
            "the timers' scan names the key: {reason}"
        ),
        other => panic!("a scan for overdue tasks over a short key must fail, got {other:?}"),
    }
    assert_eq!(store.write_refusal(), None, "nothing was written");
    store
        .append(append_request("s", 2, vec![message("s", 2, "x")], 20))
        .await
        .expect("the store takes writes");
    assert_eq!(
        store.read_history("s", 1, None).await.expect("read").len(),
        2
    );
}

/// A lease, a lease extension, a release or a delete that sled fails to write (a full
/// disk) leaves sled's state in doubt, as a failed append does: it is answered with the
/// failure, the store says it refuses writes, refuses them, still reads, and a reopen
/// clears the refusal.
#[tokio::test]
async fn a_write_sled_fails_to_make_refuses_the_writes_after_it() {
    use crate::store::{NewTask, TaskFilter};
    let id = TaskId {
        session_id: "s".to_owned(),
        scheduled_seq: 1,
    };
    for kind in ["lease", "extension", "release", "delete"] {
        let root = temp();
        let store = SledStore::open(root.path()).expect("open");
        let mut request = append_request("s", 1, vec![message("s", 1, "go")], 1);
        if kind == "delete" {
            request.status = SessionStatus::Idle; // deletable: no turn, no task
        } else {
            request.enqueue = vec![NewTask::new(id.clone(), TaskKind::Tool, 0)];
        }
        store.append(request).await.expect("append");
        let attempt = if matches!(kind, "extension" | "release") {
            let leases = store
                .lease_tasks(10, 1_000, 1, &TaskFilter::any())
                .await
                .expect("lease");
            leases[0].lease_attempt
        } else {
            0
        };
        store
            .writes
            .shared
            .faults
            .failing_writes
            .store(1, Ordering::Relaxed);
        let failed = match kind {
            "lease" => store
                .lease_tasks(10, 1_000, 1, &TaskFilter::any())
                .await
                .map(drop),
            "extension" => store
                .extend_lease(&id, attempt, 20, 1_000, None)
                .await
                .map(drop),
            "release" => store.release_leases(20).await.map(drop),
            _ => store.delete_session("s", 20).await.map(drop),
        };
        match failed {
            Err(Error::Store { reason }) => {
                assert!(reason.contains("injected fault"), "{kind}: {reason}")
            }
            other => panic!("a {kind} sled fails to write must fail, got {other:?}"),
        }
        let refusal = store
            .write_refusal()
            .unwrap_or_else(|| panic!("after a failed {kind} the store must refuse writes"));
        assert!(
            refusal.contains("injected fault") && refusal.contains("reopen it"),
            "{kind}: {refusal}"
        );
        match store
            .append(append_request("t", 1, vec![message("t", 1, "x")], 30))
            .await
        {
            Err(Error::Store { reason }) => {
                assert!(reason.contains("refuses writes"), "{kind}: {reason}")
            }
            other => panic!("an append after a failed {kind} must be refused, got {other:?}"),
        }
        assert_eq!(
            store.read_history("s", 1, None).await.expect("read").len(),
            1,
            "{kind}: reads go on"
        );
        drop(store);
        let store = SledStore::open_existing(root.path()).expect("reopen");
        assert_eq!(store.write_refusal(), None, "{kind}: a reopen clears it");
        store
            .append(append_request("t", 1, vec![message("t", 1, "x")], 40))
            .await
            .expect("the reopened store takes writes");
    }
}

#[tokio::test]
async fn after_a_failed_sync_the_store_refuses_writes_but_reads() {
    let root = temp();
    let store = SledStore::open(root.path()).expect("open");
    write_sessions(&store, &["s"], 1).await;
    *store.writes.shared.failed() = Some("injected fsync failure".to_owned());
    let mut request = append_request("s", 2, vec![message("s", 2, "x")], 2);
    request.enqueue = vec![crate::store::NewTask::new(
        TaskId {
            session_id: "s".to_owned(),
            scheduled_seq: 2,
        },
        TaskKind::Model,
        0,
    )];
    match store.append(request).await {
        Err(Error::Store { reason }) => assert!(reason.contains("injected"), "{reason}"),
        other => panic!("an append after a failed sync must be a Store error, got {other:?}"),
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
    assert_eq!(
        store.list_sessions().await.expect("list")[0].status,
        SessionStatus::Running
    );
}
