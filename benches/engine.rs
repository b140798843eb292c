//! Engine benchmarks: folding a 10,000-event history (in memory, and cold from each embedded
//! store, apart from the store's open), the record codec per record, and one state transition
//! (an activity completion recorded → the next task leased) on the memory store and on durable
//! sled and fjall, with the next task leased in a round of its own or with the report (eager
//! dispatch).

#[path = "../src/allocator.rs"]
mod allocator;

// The allocator the `cairn` binary runs with, so these figures are the binary's.
#[global_allocator]
static ALLOCATOR: allocator::Allocator = allocator::Allocator {};

use cairn_devtools::fixtures::{bench_session, response, tool_call_response};
use cairn_ledger::*;
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::store::fjall::FjallStore;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::*;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::sync::Arc;

/// A history of complete turns (model → two parallel tools → model), about `events` long.
fn history(events: usize) -> Vec<EventEnvelope> {
    let sid = "bench";
    let mut state = SessionState::new(sid);
    let mut out = Vec::new();
    let push = |state: &mut SessionState, out: &mut Vec<EventEnvelope>, event: Event| {
        let input = EventEnvelope::new(sid, state.next_seq, 1_000, event);
        out.extend(state.step(input).unwrap().events);
    };
    push(
        &mut state,
        &mut out,
        Event::SessionStarted(bench_session(8).unwrap()),
    );
    let mut turn = 0;
    while out.len() < events {
        turn += 1;
        push(
            &mut state,
            &mut out,
            Event::UserMessage {
                idempotency_key: None,
                tool_choice: None,
                turn,
                text: "what is (17+25)*3?".into(),
                model: None,
                media: Vec::new(),
            },
        );
        push(
            &mut state,
            &mut out,
            Event::ModelCallCompleted {
                turn,
                round: 0,
                attempt: 1,
                response: tool_call_response(turn, 2),
                cost_micros: None,
            },
        );
        for i in 0..2 {
            push(
                &mut state,
                &mut out,
                Event::ToolCallCompleted {
                    turn,
                    tool_use_id: format!("toolu_{turn}_{i}"),
                    attempt: 1,
                    content: ToolResultContent::Json(JsonText::parse(r#"{"value":126}"#).unwrap()),
                    is_error: false,
                },
            );
        }
        push(
            &mut state,
            &mut out,
            Event::ModelCallCompleted {
                turn,
                round: 1,
                attempt: 1,
                response: response(vec![Part::text("It is 126.")]),
                cost_micros: None,
            },
        );
    }
    out
}

fn fold(c: &mut Criterion) {
    let events = history(10_000);
    let records: Vec<Vec<u8>> = events.iter().map(|e| codec::encode(e).unwrap()).collect();
    let mut group = c.benchmark_group("fold");
    group.throughput(Throughput::Elements(events.len() as u64));
    group.bench_function("10k_events", |b| {
        b.iter(|| SessionState::fold("bench", &events).unwrap())
    });
    group.bench_function("10k_records_decode_and_fold", |b| {
        b.iter(|| {
            let decoded: Vec<EventEnvelope> = records
                .iter()
                .enumerate()
                .map(|(i, r)| codec::decode("bench", i as u64 + 1, r).unwrap())
                .collect();
            SessionState::fold("bench", &decoded).unwrap()
        })
    });
    group.finish();
    codec_per_record(c, &events, &records);
    cold(c, &events);
}

/// The record codec alone, per record: encoding the 10k-event history's envelopes, and
/// decoding its records (checksum, decompression, msgpack), without the fold.
fn codec_per_record(c: &mut Criterion, events: &[EventEnvelope], records: &[Vec<u8>]) {
    let mut group = c.benchmark_group("codec");
    group.throughput(Throughput::Elements(events.len() as u64));
    group.bench_function("encode_10k_records", |b| {
        b.iter(|| {
            events
                .iter()
                .map(|e| codec::encode(e).unwrap().len())
                .sum::<usize>()
        })
    });
    group.bench_function("decode_10k_records", |b| {
        b.iter(|| {
            records
                .iter()
                .enumerate()
                .map(|(i, r)| codec::decode("bench", i as u64 + 1, r).unwrap().seq)
                .sum::<u64>()
        })
    });
    group.finish();
}

/// A store of `kind` in a new directory holding `events` (one session), appended 500 at a time.
fn filled_store(
    rt: &tokio::runtime::Runtime,
    kind: StorageEngine,
    events: &[EventEnvelope],
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    rt.block_on(async {
        let store = open_store(kind, dir.path());
        for chunk in events.chunks(500) {
            let request = AppendRequest::new(
                "bench",
                chunk[0].seq,
                chunk.to_vec(),
                SessionStatus::Idle,
                1,
            );
            store.append(request).await.unwrap();
        }
    });
    dir
}

/// Reading a history cold from each embedded store (the OS page cache is warm; the store's own
/// caches are not, as after a process start). Three figures per engine, so that the open and the
/// read are not confused:
/// - `open_{kind}_store_of_10k_events`: the open alone (fjall replays its journal, sled recovers),
///   per open;
/// - `10k_events_cold_from_{kind}_store`: read, decode and fold a 10k-event history on a store
///   opened in the (untimed) setup, per event;
/// - `100k_events_cold_from_{kind}_store_with_open`: open, read, decode and fold a 100k-event
///   history, per event, as `cairn replay` of a long session does (the open amortised).
fn cold(c: &mut Criterion, events: &[EventEnvelope]) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let long = history(100_000);
    let mut group = c.benchmark_group("cold");
    for kind in [StorageEngine::Fjall, StorageEngine::Sled] {
        let dir = filled_store(&rt, kind, events);
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("open_{kind}_store_of_10k_events"), |b| {
            b.iter(|| drop(open_store(kind, dir.path())))
        });
        group.throughput(Throughput::Elements(events.len() as u64));
        group.bench_function(format!("10k_events_cold_from_{kind}_store"), |b| {
            b.iter_batched_ref(
                || open_store(kind, dir.path()),
                |store| {
                    rt.block_on(async {
                        let history = store.read_history("bench", 1, None).await.unwrap();
                        SessionState::fold("bench", &history).unwrap()
                    })
                },
                BatchSize::PerIteration,
            )
        });
        let dir = filled_store(&rt, kind, &long);
        group.throughput(Throughput::Elements(long.len() as u64));
        group.sample_size(10);
        group.bench_function(
            format!("100k_events_cold_from_{kind}_store_with_open"),
            |b| {
                b.iter(|| {
                    rt.block_on(async {
                        let store = open_store(kind, dir.path());
                        let history = store.read_history("bench", 1, None).await.unwrap();
                        SessionState::fold("bench", &history).unwrap()
                    })
                })
            },
        );
        group.sample_size(100);
    }
    group.finish();
}

/// A store of `kind` in `dir`, created or opened.
fn open_store(kind: StorageEngine, dir: &std::path::Path) -> Arc<dyn Store> {
    match kind {
        StorageEngine::Sled => Arc::new(SledStore::open(dir).unwrap()),
        StorageEngine::Fjall => Arc::new(FjallStore::open(dir).unwrap()),
    }
}

/// Two transitions per iteration: model completion → tool task; tool completion → model task.
/// Each task is leased as a worker of this process leases it.
async fn two_transitions(engine: &Engine, turn_round: &mut u32) {
    let lease = lease_one(engine).await;
    *turn_round += 1;
    let id = *turn_round;
    let mut r = tool_call_response(id, 1);
    if let Part::ToolUse(t) = &mut r.parts[2] {
        t.id = format!("toolu_{id}");
    }
    engine
        .report(&lease, ActivityReport::ModelCompleted(r))
        .await
        .unwrap();
    let lease = lease_one(engine).await;
    engine
        .report(
            &lease,
            ActivityReport::ToolCompleted {
                content: ToolResultContent::Json(JsonText::parse(r#"{"value":126}"#).unwrap()),
                is_error: false,
            },
        )
        .await
        .unwrap();
}

/// The same two transitions as a worker slot of this process runs them: each report leases
/// the session's next task with its own append (eager dispatch), so a transition is one
/// append. `lease` is the task in hand, and becomes the next one.
async fn two_eager_transitions(engine: &Engine, lease: &mut Lease, turn_round: &mut u32) {
    let next = LeaseRequest {
        filter: Arc::new(cairn_runtime::TaskFilter::default()),
        max: 1,
        lease_ms: 60_000,
        holder: LeaseHolder::InProcess,
    };
    *turn_round += 1;
    let id = *turn_round;
    let mut r = tool_call_response(id, 1);
    if let Part::ToolUse(t) = &mut r.parts[2] {
        t.id = format!("toolu_{id}");
    }
    let tool = engine
        .report_and_lease(lease, ActivityReport::ModelCompleted(r), &next)
        .await
        .unwrap();
    let tool = handed_or_leased(engine, tool).await;
    let model = engine
        .report_and_lease(
            &tool,
            ActivityReport::ToolCompleted {
                content: ToolResultContent::Json(JsonText::parse(r#"{"value":126}"#).unwrap()),
                is_error: false,
            },
            &next,
        )
        .await
        .unwrap();
    *lease = handed_or_leased(engine, model).await;
}

/// One due task, leased as a worker of this process leases it.
async fn lease_one(engine: &Engine) -> Lease {
    engine
        .store()
        .lease_tasks_in_process(
            engine.now_ms(),
            60_000,
            1,
            &cairn_runtime::TaskFilter::default(),
        )
        .await
        .unwrap()
        .remove(0)
}

/// The lease a report handed out, or, from a store that hands none with an append (memory,
/// sled), one leased in a round of its own, as a worker slot falls back to.
async fn handed_or_leased(engine: &Engine, handed: Vec<cairn_runtime::LeasedTask>) -> Lease {
    match handed.into_iter().next() {
        Some(task) => task.lease,
        None => lease_one(engine).await,
    }
}

fn transition(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut group = c.benchmark_group("state_transition");
    group.throughput(Throughput::Elements(2));
    // Round counts grow within a session; start a fresh session per sample so max_rounds and
    // transcript size stay bounded.
    // The disk's own cost in the same run: the goal is a transition within 1.5× of this.
    group.bench_function("fdatasync_8k_overwrite", |b| {
        use std::io::{Seek, Write};
        let dir = tempfile::tempdir().unwrap();
        let mut file = std::fs::File::create(dir.path().join("probe")).unwrap();
        let page = vec![7u8; 8192];
        file.write_all(&page).unwrap();
        file.sync_all().unwrap();
        b.iter(|| {
            file.seek(std::io::SeekFrom::Start(0)).unwrap();
            file.write_all(&page).unwrap();
            file.sync_data().unwrap();
            // Two per iteration, as the transitions count two.
            file.seek(std::io::SeekFrom::Start(0)).unwrap();
            file.write_all(&page).unwrap();
            file.sync_data().unwrap();
        })
    });
    for (name, kind, eager) in [
        ("memory", None, false),
        ("sled_durable", Some(StorageEngine::Sled), false),
        ("fjall_durable", Some(StorageEngine::Fjall), false),
        ("memory_eager", None, true),
        ("sled_durable_eager", Some(StorageEngine::Sled), true),
        ("fjall_durable_eager", Some(StorageEngine::Fjall), true),
    ] {
        group.bench_function(format!("{name}_completion_to_next_task"), |b| {
            b.to_async(&rt).iter_custom(|iters| async move {
                let mut total = std::time::Duration::ZERO;
                let mut done = 0;
                let mut session = 0;
                while done < iters {
                    session += 1;
                    // A store per session: each leaves a model task queued, which the next
                    // session's leases must not pick up.
                    let dir = tempfile::tempdir().unwrap();
                    let store: Arc<dyn Store> = match kind {
                        Some(kind) => open_store(kind, dir.path()),
                        None => Arc::new(MemoryStore::new()),
                    };
                    let engine = Engine::new(store.clone(), Arc::new(ManualClock::new(1_000)));
                    let sid = engine
                        .start_session(Some(format!("t{session}")), bench_session(8).unwrap())
                        .await
                        .unwrap();
                    engine.send_message(&sid, "go", None).await.unwrap();
                    let mut n = 0;
                    // max_rounds 8: at most 7 tool rounds per turn.
                    let batch = (iters - done).min(6);
                    // Eager: the first task is leased before the clock starts, the rest come
                    // with the reports.
                    let mut lease = match eager {
                        true => Some(lease_one(&engine).await),
                        false => None,
                    };
                    #[allow(clippy::disallowed_methods)] // benchmarks time themselves
                    let start = std::time::Instant::now();
                    for _ in 0..batch {
                        match &mut lease {
                            Some(lease) => two_eager_transitions(&engine, lease, &mut n).await,
                            None => two_transitions(&engine, &mut n).await,
                        }
                    }
                    total += start.elapsed();
                    done += batch;
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, fold, transition, turns);
criterion_main!(benches);

const TURN_SCRIPT: &str = r#"{"responses": [
  {"parts": [
    {"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "1+2"}},
    {"type": "tool_use", "id": "t2", "name": "calculator", "input": {"expression": "3*4"}}]},
  {"parts": [{"type": "text", "text": "3 and 12"}]}
]}"#;

/// Durable agent turns on sled and on fjall: model call → two parallel tool calls → model call,
/// every step recorded durably, `n` sessions at once, with an in-process worker pool.
fn turns(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut group = c.benchmark_group("durable_turns");
    group.sample_size(10);
    for (engine, sessions) in ["sled", "fjall"]
        .into_iter()
        .flat_map(|engine| [1usize, 64, 256].map(|sessions| (engine, sessions)))
    {
        group.throughput(Throughput::Elements(sessions as u64));
        group.bench_function(format!("{engine}_{sessions}_sessions"), |b| {
            b.to_async(&rt).iter_custom(|iters| async move {
                let dir = tempfile::tempdir().unwrap();
                let script = dir.path().join("turn.json");
                std::fs::write(&script, TURN_SCRIPT).unwrap();
                // Through the integrity layer, as the CLI and a host open stores (high-water
                // marks included).
                let engine = StorageEngine::parse(engine).unwrap();
                let opened =
                    embedded::open(&dir.path().join("store"), OpenMode::Create, Some(engine))
                        .await
                        .unwrap();
                let engine = Engine::new(opened.store.clone(), Arc::new(SystemClock));
                let tools = cairn_activities::ToolRegistry::builtin(dir.path());
                let pool = cairn_workers::WorkerPool::start(
                    engine.clone(),
                    cairn_workers::Activities {
                        models: Arc::new(cairn_workers::StandardModels::new()),
                        tools: Arc::new(tools.clone()),
                    },
                    cairn_workers::WorkerConfig {
                        concurrency: 512,
                        ..Default::default()
                    },
                );
                let client = Client::new(engine);
                let model = ModelSpec::parse(&format!("scripted:{}", script.display())).unwrap();
                let mut total = std::time::Duration::ZERO;
                for i in 0..iters {
                    let mut ids = Vec::new();
                    for s in 0..sessions {
                        let mut o = SessionOptions::new(model.clone(), tools.specs());
                        o.session_id = Some(format!("b{i}-{s}"));
                        ids.push(client.start_session(o).await.unwrap());
                    }
                    #[allow(clippy::disallowed_methods)] // benchmarks time themselves
                    let start = std::time::Instant::now();
                    let runs: Vec<_> = ids
                        .iter()
                        .map(|id| {
                            let client = client.clone();
                            let id = id.clone();
                            tokio::spawn(async move { client.run_turn(&id, "go").await })
                        })
                        .collect();
                    for r in runs {
                        assert!(matches!(
                            r.await.unwrap().unwrap(),
                            TurnOutcome::Completed { .. }
                        ));
                    }
                    total += start.elapsed();
                }
                pool.shutdown().await;
                total
            })
        });
    }
    group.finish();
}
