//! What the conformance suite cannot show: two stores (two pools, as two processes would have)
//! on one database, migrations run again, error classification, pool exhaustion, hints.

use crate::support::{connect, enqueue, fresh_store, raw, task_id};
use cairn_postgres::testing::fresh_database;
use cairn_postgres::{PgOptions, PgStore};
use cairn_runtime::store::conformance::{append_request, message};
use cairn_runtime::store::{Lease, Store, StoreChange, TaskFilter, TaskId};
use cairn_runtime::Error;
use sqlx::{Connection, Executor, Row};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

/// Two stores on one fresh database.
async fn two_stores() -> (Arc<PgStore>, Arc<PgStore>, String) {
    let url = fresh_database().await;
    let a = connect(&url, PgOptions::default()).await;
    let b = connect(&url, PgOptions::default()).await;
    (Arc::new(a), Arc::new(b), url)
}

/// Leases from both stores at once, from `per_store` tokio tasks each, `max` at a time, until
/// nothing is left; returns every lease handed out.
async fn lease_everything(stores: [&Arc<PgStore>; 2], per_store: usize, now_ms: u64) -> Vec<Lease> {
    let start = Arc::new(Barrier::new(2 * per_store));
    let mut leasers = Vec::new();
    for (s, store) in stores.iter().enumerate() {
        for k in 0..per_store {
            let store = Arc::clone(store);
            let start = Arc::clone(&start);
            leasers.push(tokio::spawn(async move {
                start.wait().await;
                let mut mine = Vec::new();
                loop {
                    // Varying batch sizes make the leasers' picks overlap in different ways.
                    let max = 1 + (s * per_store + k + mine.len()) % 5;
                    let leased = store
                        .lease_tasks(now_ms, 60_000, max, &TaskFilter::any())
                        .await
                        .unwrap_or_else(|e| panic!("leasing failed: {e}"));
                    if leased.is_empty() {
                        return mine;
                    }
                    mine.extend(leased);
                }
            }));
        }
    }
    let mut all = Vec::new();
    for leaser in leasers {
        all.extend(
            leaser
                .await
                .unwrap_or_else(|e| panic!("a leaser failed: {e}")),
        );
    }
    all
}

/// Every task once, with `attempt`, and nothing else.
fn assert_each_once(leases: &[Lease], tasks: &[TaskId], attempt: u32) {
    let mut seen: BTreeMap<&TaskId, usize> = BTreeMap::new();
    for lease in leases {
        assert_eq!(
            lease.lease_attempt, attempt,
            "lease attempt of {}",
            lease.id
        );
        *seen.entry(&lease.id).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "tasks handed out more than once: {twice:?}"
    );
    assert_eq!(
        seen.keys().map(|id| (*id).clone()).collect::<Vec<_>>(),
        tasks.to_vec(),
        "every task is handed out exactly once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_lease_each_task_once_per_attempt() {
    let (a, b, _) = two_stores().await;
    let mut tasks = Vec::new();
    for s in 0..6 {
        let session = format!("lease-{s}");
        enqueue(&*a, &session, 40).await;
        tasks.extend((1..=40).map(|seq| task_id(&session, seq)));
    }
    tasks.sort();
    let first = lease_everything([&a, &b], 4, 1_000).await;
    assert_each_once(&first, &tasks, 1);
    assert_eq!(
        a.release_leases(2_000).await.ok(),
        Some(tasks.len()),
        "releasing every lease"
    );
    let second = lease_everything([&b, &a], 4, 3_000).await;
    assert_each_once(&second, &tasks, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_appends_one_wins() {
    let (a, b, _) = two_stores().await;
    for round in 0..20u64 {
        let session = format!("race-{round}");
        // Racing first appends (a new session), then racing appends at seq 2.
        for seq in [1, 2] {
            let start = Arc::new(Barrier::new(2));
            let racers: Vec<_> = [&a, &b]
                .into_iter()
                .enumerate()
                .map(|(who, store)| {
                    let (store, start, session) =
                        (Arc::clone(store), Arc::clone(&start), session.clone());
                    tokio::spawn(async move {
                        let event = message(&session, seq, &format!("store {who}"));
                        start.wait().await;
                        let outcome = store
                            .append(append_request(&session, seq, vec![event.clone()], seq))
                            .await;
                        (outcome, event)
                    })
                })
                .collect();
            let mut won = Vec::new();
            for racer in racers {
                let (outcome, event) = racer
                    .await
                    .unwrap_or_else(|e| panic!("a racer failed: {e}"));
                match outcome {
                    Ok(()) => won.push(event),
                    Err(Error::Conflict {
                        expected, actual, ..
                    }) => assert_eq!(
                        (expected, actual),
                        (seq, seq + 1),
                        "the loser's conflict names the winner's next seq"
                    ),
                    Err(e) => panic!("an append racing on {session} at {seq} failed with {e:?}"),
                }
            }
            assert_eq!(
                won.len(),
                1,
                "exactly one racing append wins, at {session} seq {seq}"
            );
            let history = a
                .read_history(&session, seq, None)
                .await
                .unwrap_or_else(|e| panic!("reading {session}: {e}"));
            assert_eq!(history, won, "the history holds the winner's event");
        }
    }
}

/// A first append that meets an uncommitted insert of its session (another process creating
/// it) waits for it, and gets `Conflict` when that commits: the unique violation path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_append_losing_the_insert_race_is_a_conflict() {
    let (store, url) = fresh_store().await;
    let store = Arc::new(store);
    let mut other = raw(&url).await;
    let mut tx = other.begin().await.unwrap_or_else(|e| panic!("begin: {e}"));
    tx.execute(
        "INSERT INTO cairn_sessions (session_id, status, last_seq, updated_at_ms) \
         VALUES ('contested', 'running', 3, 1)",
    )
    .await
    .unwrap_or_else(|e| panic!("inserting the session: {e}"));
    let appending = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            store
                .append(append_request(
                    "contested",
                    1,
                    vec![message("contested", 1, "mine")],
                    2,
                ))
                .await
        })
    };
    // Wait until the append waits on the uncommitted row (so it really meets the insert).
    let mut watcher = raw(&url).await;
    let mut waited = 0;
    loop {
        let waiting: i64 = sqlx::query(
            "SELECT count(*) AS n FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&mut watcher)
        .await
        .and_then(|row| row.try_get("n"))
        .unwrap_or_else(|e| panic!("watching locks: {e}"));
        if waiting == 1 {
            break;
        }
        waited += 1;
        assert!(
            waited < 500,
            "the append never waited on the uncommitted session row"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.commit().await.unwrap_or_else(|e| panic!("commit: {e}"));
    match appending.await {
        Ok(Err(Error::Conflict {
            expected: 1,
            actual: 4,
            ..
        })) => {}
        other => panic!(
            "the losing first append must be Conflict {{ expected: 1, actual: 4 }}, got {other:?}"
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_again_without_harm() {
    let url = fresh_database().await;
    // Four processes starting on a new database at once, then one more later.
    let racers: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { PgStore::connect(&url, PgOptions::default()).await })
        })
        .collect();
    let mut stores = Vec::new();
    for racer in racers {
        match racer.await {
            Ok(Ok(store)) => stores.push(store),
            other => panic!("connecting to a new database at once failed: {other:?}"),
        }
    }
    enqueue(&stores[0], "kept", 2).await;
    drop(stores);
    let again = connect(&url, PgOptions::default()).await;
    assert_eq!(
        again.list_tasks().await.map(|t| t.len()).ok(),
        Some(2),
        "data survives"
    );
    let mut conn = raw(&url).await;
    let applied: i64 = sqlx::query("SELECT count(*) AS n FROM _sqlx_migrations")
        .fetch_one(&mut conn)
        .await
        .and_then(|row| row.try_get("n"))
        .unwrap_or_else(|e| panic!("counting migrations: {e}"));
    let migrations = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .map(|dir| dir.count())
        .unwrap_or_else(|e| panic!("listing the migrations: {e}"));
    assert_eq!(
        migrations, 2,
        "the tables, and deleted sessions' tombstones"
    );
    assert_eq!(
        applied, migrations as i64,
        "each migration is recorded once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_and_closed_are_retryable() {
    let url = "postgres://cairn:s3cret@127.0.0.1:1/cairn";
    match PgStore::connect(url, PgOptions::default()).await {
        Err(e @ Error::StoreUnavailable { .. }) => {
            assert!(e.is_retryable());
            let shown = e.to_string();
            assert!(
                shown.contains("postgres://cairn:***@127.0.0.1:1/cairn"),
                "the error names the URL: {shown}"
            );
            assert!(
                !shown.contains("s3cret"),
                "the error hides the password: {shown}"
            );
        }
        Err(e) => panic!("an unreachable server must be StoreUnavailable, got {e:?}"),
        Ok(_) => panic!("nothing listens on port 1"),
    }
    match PgStore::connect("mysql://nope", PgOptions::default()).await {
        Err(e @ Error::StoreOpen { .. }) => assert!(!e.is_retryable()),
        Err(e) => panic!("a URL that is not PostgreSQL's must be StoreOpen, got {e:?}"),
        Ok(_) => panic!("a mysql URL connected"),
    }

    let (store, _) = fresh_store().await;
    store.close().await;
    for outcome in [
        store.list_sessions().await.map(|_| ()),
        store
            .append(append_request("s", 1, vec![message("s", 1, "x")], 1))
            .await,
        store
            .lease_tasks(0, 1, 1, &TaskFilter::any())
            .await
            .map(|_| ()),
    ] {
        match outcome {
            Err(e @ Error::StoreUnavailable { .. }) => assert!(e.is_retryable()),
            other => panic!("a closed store must be StoreUnavailable, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn violations_and_bad_data_are_not_retryable() {
    let (store, url) = fresh_store().await;
    enqueue(&store, "bad", 1).await;
    let mut conn = raw(&url).await;
    // The fencing token is a u32: a lease past it violates the column's check.
    conn.execute("UPDATE cairn_tasks SET lease_attempt = 4294967295")
        .await
        .unwrap_or_else(|e| panic!("setting up: {e}"));
    match store.lease_tasks(10, 10, 1, &TaskFilter::any()).await {
        Err(e @ Error::Store { .. }) => {
            assert!(!e.is_retryable());
            assert!(e.to_string().contains("23514"), "names the SQLSTATE: {e}");
        }
        other => panic!("a check violation must be a non-retryable Store error, got {other:?}"),
    }
    // A record that fails its checksum.
    conn.execute("UPDATE cairn_events SET record = '\\x01000000000000'::bytea")
        .await
        .unwrap_or_else(|e| panic!("setting up: {e}"));
    match store.read_history("bad", 1, None).await {
        Err(e @ Error::CorruptRecord { .. }) => assert!(!e.is_retryable()),
        other => panic!("a corrupt record must be CorruptRecord, got {other:?}"),
    }
    // A seq past what BIGINT holds is refused before it reaches the database (a time that
    // far off is taken as the farthest BIGINT time: the conformance suite's far-off check).
    match store
        .append(append_request(
            "big",
            i64::MAX as u64 + 1,
            vec![message("big", i64::MAX as u64 + 1, "x")],
            1,
        ))
        .await
    {
        Err(e @ Error::Store { .. }) => assert!(!e.is_retryable()),
        other => panic!("a seq past i64::MAX must be refused, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_pool_fails_after_the_acquire_timeout() {
    let url = fresh_database().await;
    let options = PgOptions {
        max_connections: 1,
        acquire_timeout: Duration::from_millis(300),
        notify: false,
        ..PgOptions::default()
    };
    let store = Arc::new(connect(&url, options).await);
    store
        .append(append_request("held", 1, vec![message("held", 1, "a")], 1))
        .await
        .unwrap_or_else(|e| panic!("first append: {e}"));
    // Another process locks the session row, so the next append holds the pool's only
    // connection while it waits for the lock.
    let mut other = raw(&url).await;
    let mut tx = other.begin().await.unwrap_or_else(|e| panic!("begin: {e}"));
    tx.execute("SELECT * FROM cairn_sessions WHERE session_id = 'held' FOR UPDATE")
        .await
        .unwrap_or_else(|e| panic!("locking: {e}"));
    let blocked = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            store
                .append(append_request("held", 2, vec![message("held", 2, "b")], 2))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(10), store.list_sessions())
        .await
        .unwrap_or_else(|_| panic!("an operation on an exhausted pool hung"));
    let waited = started.elapsed();
    match outcome {
        Err(e @ Error::StoreUnavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("an exhausted pool must give StoreUnavailable, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(5),
        "the operation fails after about the acquire timeout (300 ms), took {waited:?}"
    );
    tx.rollback()
        .await
        .unwrap_or_else(|e| panic!("rollback: {e}"));
    match blocked.await {
        Ok(Ok(())) => {}
        other => panic!("the append waiting for the lock must land once it is free, got {other:?}"),
    }
    assert_eq!(
        store.list_sessions().await.map(|s| s[0].events).ok(),
        Some(2)
    );
}

/// Appends a message of `text` to `session_id` at `seq` (its clock at `seq` too).
async fn append_one(store: &PgStore, session_id: &str, seq: u64, text: &str) {
    store
        .append(append_request(
            session_id,
            seq,
            vec![message(session_id, seq, text)],
            seq,
        ))
        .await
        .unwrap_or_else(|e| panic!("append {seq} to {session_id}: {e}"));
}

/// Appends one event at a time to `session_id` through `store`, at each of `seqs`, until
/// `heard` says that the append's hint arrived; the seq of the append that was heard, if one
/// was.
async fn append_until_heard(
    store: &PgStore,
    session_id: &str,
    seqs: std::ops::RangeInclusive<u64>,
    mut heard: impl AsyncFnMut(u64) -> bool,
) -> Option<u64> {
    for seq in seqs {
        append_one(store, session_id, seq, "y").await;
        if heard(seq).await {
            return Some(seq);
        }
    }
    None
}

/// Waits up to `within` for a hint about `session_id` at `last_seq`.
async fn hint_arrives(
    hints: &mut tokio::sync::broadcast::Receiver<StoreChange>,
    want: &StoreChange,
    within: Duration,
) -> bool {
    let waiting = async {
        loop {
            match hints.recv().await {
                Ok(change) if change == *want => return true,
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return false,
            }
        }
    };
    tokio::time::timeout(within, waiting).await.unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hints_reach_the_other_store() {
    let (a, b, url) = two_stores().await;
    let mut hints = a
        .subscribe_changes()
        .unwrap_or_else(|| panic!("a PostgreSQL store gives hints"));
    assert!(a.shared(), "a PostgreSQL store is shared");

    // This store's own appends are not hinted to its own subscribers: the engine that made
    // them knows them (their NOTIFY echo is dropped; see below).
    let mut own = append_request("own", 1, vec![message("own", 1, "x")], 1);
    own.enqueue = vec![cairn_runtime::store::NewTask::new(
        task_id("own", 1),
        cairn_runtime::store::TaskKind::Tool,
        0,
    )];
    a.append(own)
        .await
        .unwrap_or_else(|e| panic!("own append: {e}"));

    // Garbage on the channel is ignored and the listener goes on.
    let mut conn = raw(&url).await;
    conn.execute("SELECT pg_notify('cairn_changes', 'not a hint'), pg_notify('cairn_changes', 'v1 1 1 bad id')")
        .await
        .unwrap_or_else(|e| panic!("notifying garbage: {e}"));

    // The listener starts with the first subscription: append through the other store until
    // a hint of it arrives (hints sent before the listener listens are lost, as hints may be).
    let heard = append_until_heard(&b, "elsewhere", 1..=50, async |seq| {
        let want = StoreChange {
            session_id: "elsewhere".to_owned(),
            last_seq: seq,
            enqueued: false,
        };
        hint_arrives(&mut hints, &want, Duration::from_millis(200)).await
    })
    .await;
    let Some(heard) = heard else {
        panic!("no hint of the other store's appends arrived in 10 s");
    };
    let seq = heard + 1;
    // Hints arrive in the order they were sent: an echo of the own append, had it not been
    // dropped, would be here by now. Another own append, then the other store's: only the
    // latter is heard.
    a.append(append_request("own", 2, vec![message("own", 2, "z")], 2))
        .await
        .unwrap_or_else(|e| panic!("own append: {e}"));
    append_one(&b, "elsewhere", seq, "w").await;
    let next = tokio::time::timeout(Duration::from_secs(10), hints.recv())
        .await
        .unwrap_or_else(|_| panic!("no hint of the other store's append in 10 s"))
        .unwrap_or_else(|e| panic!("hints: {e}"));
    assert_eq!(
        next,
        StoreChange {
            session_id: "elsewhere".to_owned(),
            last_seq: seq,
            enqueued: false,
        },
        "a store does not hear its own appends"
    );

    // Without NOTIFY, a store sends and hears nothing.
    let quiet = connect(
        &url,
        PgOptions {
            notify: false,
            ..PgOptions::default()
        },
    )
    .await;
    let mut quiet_hints = quiet
        .subscribe_changes()
        .unwrap_or_else(|| panic!("a receiver without NOTIFY"));
    quiet
        .append(append_request("quiet", 1, vec![], 5))
        .await
        .unwrap_or_else(|e| panic!("an empty append: {e}"));
    b.append(append_request(
        "elsewhere",
        seq + 1,
        vec![message("elsewhere", seq + 1, "v")],
        seq + 1,
    ))
    .await
    .unwrap_or_else(|e| panic!("append through the other store: {e}"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        quiet_hints.try_recv().is_err(),
        "a store without NOTIFY hears no hint"
    );
}

/// Whether `observer` hears a notification within `within`.
async fn notified(observer: &mut sqlx::postgres::PgListener, within: Duration) -> bool {
    matches!(
        tokio::time::timeout(within, observer.recv()).await,
        Ok(Ok(_))
    )
}

/// A store alone on its database sends no hints (only its own listener would hear them, and
/// it drops their echo); once another store handle is connected, it sends them again within
/// the sender's recheck. Heard by a plain LISTEN that is not a cairn connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_store_sends_no_hints_until_another_connects() {
    let url = fresh_database().await;
    let mut observer = sqlx::postgres::PgListener::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("an observer: {e}"));
    observer
        .listen("cairn_changes")
        .await
        .unwrap_or_else(|e| panic!("LISTEN: {e}"));
    let a = connect(&url, PgOptions::default()).await;
    for seq in 1..=3 {
        append_one(&a, "lone", seq, "x").await;
    }
    assert!(
        !notified(&mut observer, Duration::from_millis(700)).await,
        "a store alone on its database sent a hint"
    );
    let _b = connect(&url, PgOptions::default()).await;
    let sent = append_until_heard(&a, "lone", 4..=40, async |_| {
        notified(&mut observer, Duration::from_millis(100)).await
    })
    .await;
    assert!(
        sent.is_some(),
        "no hint in 4 s of appends after another store handle connected"
    );
}

/// A store counts the writes it committed, for `/v1/health` and `cairn bench`: an append, and
/// a lease that leased something, each count once, with a time; a lease that found nothing
/// wrote nothing and does not count; another handle's writes are its own.
#[tokio::test]
async fn a_store_counts_the_writes_it_committed() {
    let (a, b, _url) = two_stores().await;
    assert_eq!(a.durable_commits(), Some(0));
    enqueue(a.as_ref(), "counted", 2).await;
    assert_eq!(a.durable_commits(), Some(1), "the append");
    let nothing = a
        .lease_tasks(
            0,
            1_000,
            1,
            &TaskFilter {
                queues: Some(["elsewhere".to_owned()].into()),
                ..TaskFilter::any()
            },
        )
        .await
        .expect("a lease of no due task");
    assert!(nothing.is_empty(), "{nothing:?}");
    assert_eq!(a.durable_commits(), Some(1), "a lease that leased nothing");
    let leased = a
        .lease_tasks(0, 1_000, 1, &TaskFilter::any())
        .await
        .expect("lease");
    assert_eq!(leased.len(), 1);
    assert_eq!(a.durable_commits(), Some(2), "the lease");
    let times = a.sync_times().expect("times");
    assert_eq!(times.count(), 2);
    assert!(times.quantile_us(1.0).is_some_and(|us| us > 0));
    assert_eq!(
        b.durable_commits(),
        Some(0),
        "the other handle wrote nothing"
    );
}

/// What PostgreSQL's statistics say of `cairn_tasks`.
struct QueueStats {
    /// Manual vacuums so far (autovacuum's are counted apart).
    vacuums: i64,
    autovacuums: i64,
    dead_rows: i64,
    bytes: i64,
}

async fn queue_stats(url: &str) -> QueueStats {
    let mut conn = raw(url).await;
    sqlx::query(
        "SELECT vacuum_count, autovacuum_count, n_dead_tup, pg_relation_size(relid) AS bytes \
         FROM pg_stat_user_tables WHERE relname = 'cairn_tasks'",
    )
    .fetch_one(&mut conn)
    .await
    .and_then(|row| {
        Ok(QueueStats {
            vacuums: row.try_get("vacuum_count")?,
            autovacuums: row.try_get("autovacuum_count")?,
            dead_rows: row.try_get("n_dead_tup")?,
            bytes: row.try_get("bytes")?,
        })
    })
    .unwrap_or_else(|e| panic!("reading the queue's statistics: {e}"))
}

/// Queues `tasks` tasks on a new session, then cancels them all: `tasks` dead rows.
async fn turn_over(store: &dyn Store, session_id: &str, tasks: u64) {
    enqueue(store, session_id, tasks).await;
    let mut request = append_request(session_id, 2, vec![message(session_id, 2, "done")], 0);
    request.cancel = (1..=tasks).map(|seq| task_id(session_id, seq)).collect();
    if let Err(e) = store.append(request).await {
        panic!("cancelling {tasks} tasks on {session_id} failed: {e}");
    }
}

/// A queue leaves a dead row behind each task done, which every lease steps over until
/// VACUUM: a store vacuums the queue itself once its writes have left
/// `QUEUE_VACUUM_AFTER` dead rows, not before, and not on each write.
#[tokio::test]
async fn a_store_vacuums_the_queue_its_tasks_turned_over() {
    use cairn_postgres::testing::QUEUE_VACUUM_AFTER;
    let (store, url) = fresh_store().await;
    let half = QUEUE_VACUUM_AFTER / 2;
    turn_over(&store, "first-half", half).await;
    // VACUUM reports to the statistics as it ends; give a wrongly started one time to.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        queue_stats(&url).await.vacuums,
        0,
        "vacuumed with {half} dead rows, fewer than {QUEUE_VACUUM_AFTER}"
    );
    turn_over(&store, "second-half", QUEUE_VACUUM_AFTER - half).await;
    let mut waited = Duration::ZERO;
    let mut stats = queue_stats(&url).await;
    while stats.vacuums == 0 {
        assert!(
            waited < Duration::from_secs(20),
            "no vacuum of the queue 20 s after {QUEUE_VACUUM_AFTER} dead rows"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
        stats = queue_stats(&url).await;
    }
    assert!(
        stats.dead_rows < QUEUE_VACUUM_AFTER as i64,
        "{} dead rows left after the vacuum",
        stats.dead_rows
    );
    // Every task is gone, so a truncating VACUUM would give every page back, under the
    // table's exclusive lock that appends and leases wait for; the store's keeps them.
    // (Autovacuum truncates, so the pages only say something when it has not run here.)
    if stats.autovacuums == 0 {
        assert!(stats.bytes > 0, "the vacuum truncated the queue");
    }
    store.close().await;
}
