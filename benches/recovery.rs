//! Recovery benchmark: the time from a restart to every interrupted session re-dispatched, with
//! 1,000 sessions in flight.
//!
//! Setup (once, untimed): a sled store with 1,000 sessions, each with a turn in progress — its
//! model call scheduled and leased by a worker that then died (the store is closed with the
//! leases held). Each iteration copies that directory (untimed), then times: open the store,
//! `Engine::resume(true)` (which releases the dead worker's leases), and lease every task once and resolve
//! its activity, as a worker does before running it.

// Benchmarks time themselves.
#![allow(clippy::disallowed_methods)]

use cairn_devtools::fixtures::bench_session;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::{Engine, Limits, Store, SystemClock};
use criterion::{criterion_group, criterion_main, Criterion};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SESSIONS: usize = 1_000;

/// Writes the store: 1,000 sessions with a queued model call each, all leased.
async fn prepare(dir: &Path) {
    let store = Arc::new(SledStore::open(dir).unwrap());
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    for i in 0..SESSIONS {
        let id = engine
            .start_session(
                Some(format!("s{i:04}")),
                bench_session(Limits::default().max_rounds).unwrap(),
            )
            .await
            .unwrap();
        engine
            .send_message(&id, "What is (17 + 25) * 3?", None)
            .await
            .unwrap();
    }
    let mut leased = 0;
    while leased < SESSIONS {
        let leases = store
            .lease_tasks(
                engine.now_ms(),
                3_600_000,
                256,
                &cairn_runtime::TaskFilter::default(),
            )
            .await
            .unwrap();
        assert!(!leases.is_empty(), "only {leased} tasks to lease");
        leased += leases.len();
    }
    drop(engine);
    // The engine is gone; this is the last handle: dropping it closes sled.
    drop(Arc::try_unwrap(store).expect("the store's last handle"));
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Open, release, resume, and dispatch every task once; returns the engine and store, so that
/// closing them is not timed.
async fn recover(dir: &Path) -> (Engine, Arc<SledStore>) {
    let store = Arc::new(SledStore::open_existing(dir).unwrap());
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let report = engine.resume(true).await.unwrap();
    assert_eq!(report.reclaimed_leases, SESSIONS);
    assert_eq!(report.running_sessions.len(), SESSIONS);
    let mut dispatched = 0;
    while dispatched < SESSIONS {
        let leases = store
            .lease_tasks(
                engine.now_ms(),
                60_000,
                256,
                &cairn_runtime::TaskFilter::default(),
            )
            .await
            .unwrap();
        assert!(!leases.is_empty(), "only {dispatched} tasks dispatched");
        for lease in &leases {
            let input = engine.activity(lease).await.unwrap();
            assert!(input.is_some(), "task {} is not wanted", lease.id);
        }
        dispatched += leases.len();
    }
    (engine, store)
}

fn recovery(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let prepared = tempfile::tempdir().unwrap();
    rt.block_on(prepare(prepared.path()));
    let scratch = tempfile::tempdir().unwrap();
    let mut group = c.benchmark_group("recovery");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.bench_function("restart_to_1000_sessions_redispatched", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let prepared = prepared.path().to_path_buf();
            let scratch = scratch.path().to_path_buf();
            async move {
                let mut total = Duration::ZERO;
                for i in 0..iters {
                    let copy = scratch.join(format!("run-{i}"));
                    copy_dir(&prepared, &copy);
                    let start = Instant::now();
                    let open = recover(&copy).await;
                    total += start.elapsed();
                    drop(open);
                    std::fs::remove_dir_all(&copy).unwrap();
                }
                total
            }
        })
    });
    group.finish();
}

criterion_group!(benches, recovery);
criterion_main!(benches);
