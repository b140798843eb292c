//! Durable append throughput of the sled and fjall stores: every iteration, each of N sessions
//! appends one event of about 300 bytes, all N at once, and waits until it is durable (flushed
//! and fsynced). Throughput is in appends; group commit should make it grow with N.
//!
//! Run: `cargo bench -p cairn-runtime --bench store` (add `-- --measurement-time 5` for a
//! quick run; `-- fjall` or `-- sled` for one engine).

use cairn_runtime::store::fjall::FjallStore;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::{AppendRequest, Event, EventEnvelope, SessionStatus, Store};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One ~300-byte event (its encoded record is about 300 bytes).
fn event(session_id: &str, seq: u64) -> EventEnvelope {
    EventEnvelope::new(
        session_id,
        seq,
        1_700_000_000_000 + seq,
        Event::UserMessage {
            idempotency_key: None,
            tool_choice: None,
            turn: 1,
            text: "x".repeat(200),
            model: None,
            media: Vec::new(),
        },
    )
}

fn append(session_id: &str, seq: u64) -> AppendRequest {
    AppendRequest::new(
        session_id,
        seq,
        vec![event(session_id, seq)],
        SessionStatus::Running,
        1_700_000_000_000 + seq,
    )
}

fn durable_appends(c: &mut Criterion) {
    durable_appends_on(c, "sled_durable_append", |dir| {
        Arc::new(SledStore::open(dir).expect("open the sled store"))
    });
    durable_appends_on(c, "fjall_durable_append", |dir| {
        Arc::new(FjallStore::open(dir).expect("open the fjall store"))
    });
}

fn durable_appends_on(
    c: &mut Criterion,
    group_name: &str,
    open: impl Fn(&std::path::Path) -> Arc<dyn Store>,
) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let record_len = cairn_runtime::codec::encode(&event("session-000", 1))
        .expect("encode")
        .len();
    eprintln!("record size: {record_len} bytes");
    let mut group = c.benchmark_group(group_name);
    group.sample_size(20);
    for sessions in [1usize, 16, 256] {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let names: Arc<Vec<String>> =
            Arc::new((0..sessions).map(|i| format!("session-{i:03}")).collect());
        let next: Arc<Vec<AtomicU64>> =
            Arc::new((0..sessions).map(|_| AtomicU64::new(1)).collect());
        group.throughput(Throughput::Elements(sessions as u64));
        group.bench_with_input(BenchmarkId::new("sessions", sessions), &sessions, |b, _| {
            b.to_async(&runtime).iter(|| {
                let (store, names, next) =
                    (Arc::clone(&store), Arc::clone(&names), Arc::clone(&next));
                async move {
                    let mut tasks = tokio::task::JoinSet::new();
                    for i in 0..names.len() {
                        let (store, names, next) =
                            (Arc::clone(&store), Arc::clone(&names), Arc::clone(&next));
                        tasks.spawn(async move {
                            let seq = next[i].fetch_add(1, Ordering::Relaxed);
                            store.append(append(&names[i], seq)).await.expect("append");
                        });
                    }
                    while let Some(done) = tasks.join_next().await {
                        done.expect("append task");
                    }
                }
            });
        });
        drop(store);
    }
    group.finish();
}

criterion_group!(benches, durable_appends);
criterion_main!(benches);
