//! One durable state transition on PostgreSQL against one on sled and fjall, measured in the
//! same run, beside the fdatasync that a durable commit rests on.
//!
//! One iteration is the engine step of a worker's report: `Engine::report` of the leased task
//! (the completion, the workflow's command events and the next task, appended durably in one
//! store append that checks the lease) followed by `Engine::lease_tasks` handing the next task
//! out (a lease and the activity's input, read back). Model and tool completions alternate as
//! in a turn: model → one tool call → model → ... Each session takes [`TRANSITIONS_PER_SESSION`]
//! of them, then is cancelled outside the timing, so the queue holds only the measured
//! session's task. The clock is manual (no lease lapses); the stores are the real ones, each
//! durable on every append: sled and fjall fdatasync in this process, PostgreSQL commits with
//! `synchronous_commit = on`, over loopback TCP.
//!
//! Needs a PostgreSQL server: `DATABASE_URL` (a fresh database is created on its server), e.g.
//! `pg_env="$(scripts/postgres start)" && eval "$pg_env"`, then
//! `cargo bench -p cairn-postgres --bench transition`.

// A benchmark times itself.
#![allow(clippy::disallowed_methods)]

use cairn_ledger::{
    JsonText, ModelResponse, ModelSpec, Part, StopReason, ToolResultContent, ToolSpec, ToolUse,
    Usage,
};
use cairn_postgres::{redact_url, testing, PgOptions, PgStore};
use cairn_runtime::store::fjall::FjallStore;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::{
    ActivityInput, ActivityReport, Engine, LeasedTask, Limits, ManualClock, RetryPolicy,
    SessionStarted, Store, TaskFilter,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Transitions timed per session: six model rounds with a tool call and their six tool
/// results, within the session's `max_rounds` of 8.
const TRANSITIONS_PER_SESSION: u64 = 12;

/// The lease every task is handed out with; the manual clock never lets it lapse.
const LEASE_MS: u64 = 60_000;

fn started() -> SessionStarted {
    SessionStarted {
        call_options: Default::default(),
        queues: Default::default(),
        forked_from: None,
        workflow_version: cairn_runtime::WORKFLOW_VERSION,
        tool_policy: None,
        compaction: None,
        model: ModelSpec::parse("scripted:bench.json").expect("model spec"),
        tools: vec![ToolSpec {
            name: "calculator".into(),
            description: "math".into(),
            input_schema: JsonText::parse(r#"{"type":"object"}"#).expect("schema"),
        }]
        .into(),
        system_prompt: Some("bench".into()),
        limits: Limits {
            max_rounds: 8,
            session_budget: Default::default(),
            turn_budget: Default::default(),
        },
        model_retry: RetryPolicy::model_default(),
        tool_retry: RetryPolicy::tool_default(),
        workdir: None,
    }
}

/// A model answer with thinking, text and one tool call, as a typical round has.
fn tool_call_response(round: u32) -> ModelResponse {
    ModelResponse {
        provider: "scripted".into(),
        model: "bench".into(),
        parts: vec![
            Part::Thinking {
                text: "thinking about which tools to call ".repeat(4),
                signature: "c2lnbmF0dXJl".repeat(8),
            },
            Part::text("Let me check."),
            Part::ToolUse(ToolUse {
                id: format!("toolu_{round}"),
                name: "calculator".into(),
                arguments: r#"{"expression":"(17 + 25) * 3"}"#.into(),
                signature: None,
            }),
        ],
        stop_reason_raw: "tool_use".into(),
        stop_reason: StopReason::ToolUse,
        usage: Usage::default(),
    }
}

/// What the worker reports for `leased`.
fn report_for(leased: &LeasedTask, round: u32) -> ActivityReport {
    match leased.input {
        ActivityInput::Model { .. } => ActivityReport::ModelCompleted(tool_call_response(round)),
        ActivityInput::Tool { .. } => ActivityReport::ToolCompleted {
            content: ToolResultContent::Json(JsonText::parse(r#"{"value":126}"#).expect("json")),
            is_error: false,
        },
    }
}

/// Leases the one due task, which must be `session_id`'s.
async fn lease_next(engine: &Engine, session_id: &str) -> LeasedTask {
    let mut leased = engine
        .lease_tasks(&TaskFilter::default(), 1, LEASE_MS)
        .await
        .expect("lease the next task");
    let next = leased.pop().expect("a next task");
    assert_eq!(
        next.lease.id.session_id, session_id,
        "a stray task was leased"
    );
    next
}

/// Runs `iters` transitions on `engine`, a new session every [`TRANSITIONS_PER_SESSION`],
/// and returns the time they took (session starts and cancels not included).
async fn timed_transitions(engine: &Engine, sessions_started: &AtomicU64, iters: u64) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let session_no = sessions_started.fetch_add(1, Ordering::Relaxed);
        let session_id = engine
            .start_session(Some(format!("t{session_no}")), started())
            .await
            .expect("start a session");
        engine
            .send_message(&session_id, "what is (17+25)*3?", None)
            .await
            .expect("send a message");
        let mut leased = lease_next(engine, &session_id).await;
        let batch = (iters - done).min(TRANSITIONS_PER_SESSION);
        let begin = Instant::now();
        for transition in 0..batch {
            let report = report_for(&leased, transition as u32);
            engine
                .report(&leased.lease, report)
                .await
                .expect("report the task");
            leased = lease_next(engine, &session_id).await;
        }
        total += begin.elapsed();
        done += batch;
        // Takes its last task out of the queue, so the next session's lease finds only its own.
        engine
            .cancel(&session_id, "bench session done")
            .await
            .expect("cancel the session");
    }
    total
}

fn transition(c: &mut Criterion) {
    // Checked first: without PostgreSQL the comparison cannot be made at all.
    let server_url = testing::server_url();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let stores: Vec<(&str, Arc<dyn Store>)> = vec![
        (
            "postgres",
            runtime.block_on(async {
                let url = testing::fresh_database().await;
                Arc::new(
                    PgStore::connect(&url, PgOptions::default())
                        .await
                        .unwrap_or_else(|e| {
                            panic!(
                                "cannot use a fresh database on {}: {e}",
                                redact_url(&server_url)
                            )
                        }),
                ) as Arc<dyn Store>
            }),
        ),
        (
            "sled",
            Arc::new(SledStore::open(dir.path().join("sled")).expect("open the sled store")),
        ),
        (
            "fjall",
            Arc::new(FjallStore::open(dir.path().join("fjall")).expect("open the fjall store")),
        ),
    ];
    let mut group = c.benchmark_group("durable_transition");
    group.throughput(Throughput::Elements(1));
    for (name, store) in stores {
        let engine = Engine::new(store, Arc::new(ManualClock::new(1_000)));
        let sessions_started = AtomicU64::new(0);
        group.bench_function(format!("{name}_report_then_lease_next"), |b| {
            b.to_async(&runtime)
                .iter_custom(|iters| timed_transitions(&engine, &sessions_started, iters))
        });
    }
    group.finish();
}

/// The flush a durable commit waits for: an 8 KiB overwrite of a preallocated file (as
/// PostgreSQL writes its WAL) and fdatasync, on the filesystem of the temporary directory.
fn fdatasync(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("fdatasync-probe");
    let mut file = std::fs::File::create(&path).expect("create the probe file");
    let block = vec![0x5au8; 8192];
    file.write_all(&block).expect("preallocate the probe file");
    file.sync_all().expect("sync the probe file");
    let mut group = c.benchmark_group("fdatasync");
    group.throughput(Throughput::Elements(1));
    group.bench_function("8k_overwrite", |b| {
        b.iter(|| {
            file.write_all_at(&block, 0).expect("write the probe block");
            file.sync_data().expect("fdatasync the probe file");
        })
    });
    group.finish();
}

criterion_group!(benches, transition, fdatasync);
criterion_main!(benches);
