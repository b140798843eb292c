//! `cairn bench`: durable agent turns per second and per-turn latency, embedded and through a
//! server with worker processes, measured on whole processes in a closed loop.
//!
//! The workload is the one the README's figures use: a fresh session per turn, then a model
//! call, two parallel tool calls (`calculator`) and a model call, every step durable. The
//! model is scripted, answering after `model_latency_ms`. `sessions` clients each run turns
//! back to back for `seconds`; the figures are completed turns per second and the p50 and p99
//! of one turn's latency (send → outcome).
//!
//! Through a server, the parent starts `cairn server` on a loopback port with a new store and
//! `workers` `cairn worker` processes, and drives the turns with the remote client; embedded,
//! one process holds the store, the engine and a worker pool, as `cairn run` does.

// A benchmark reads clocks and waits on real time.
#![allow(clippy::disallowed_methods)]

use crate::process::start_and_wait;
use anyhow::{bail, Context};
use cairn_activities::ToolRegistry;
use cairn_ledger::ModelSpec;
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::{Client, Engine, SessionOptions, SystemClock, TurnOutcome};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One measurement's settings.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Clients running turns at once (sessions in flight).
    pub sessions: usize,
    /// How long to run turns, after a warm-up of a tenth of it.
    pub seconds: f64,
    /// The scripted model's latency per call.
    pub model_latency_ms: u64,
    /// The store engine.
    pub engine: StorageEngine,
    /// Activities each worker process runs at once (`cairn worker --concurrency`), so that
    /// more worker processes mean more capacity, as when they run on more machines.
    pub worker_concurrency: usize,
}

/// What one measurement found.
#[derive(Debug, Clone)]
pub struct BenchResult {
    /// Where it ran: `embedded`, or `server, N workers`.
    pub setup: String,
    /// Sessions in flight.
    pub sessions: usize,
    /// The model latency.
    pub model_latency_ms: u64,
    /// Turns completed in the measured time.
    pub turns: usize,
    /// Completed turns per second.
    pub turns_per_sec: f64,
    /// Median latency of a turn, ms.
    pub p50_ms: f64,
    /// 99th percentile latency of a turn, ms.
    pub p99_ms: f64,
}

impl BenchResult {
    /// One row of the report table.
    pub fn row(&self) -> String {
        format!(
            "| {} | {} | {} ms | {:.0} turns/s | {:.2} ms | {:.2} ms |",
            self.setup,
            self.sessions,
            self.model_latency_ms,
            self.turns_per_sec,
            self.p50_ms,
            self.p99_ms
        )
    }

    /// The header of the report table.
    pub fn header() -> &'static str {
        "| setup | sessions in flight | model latency | throughput | p50 turn | p99 turn |\n|---|---|---|---|---|---|"
    }
}

/// The scripted turn: two parallel calculator calls, then an answer.
fn script(latency_ms: u64) -> String {
    format!(
        r#"{{"responses": [
  {{"delay_ms": {latency_ms}, "parts": [
    {{"type": "tool_use", "id": "t1", "name": "calculator", "input": {{"expression": "1+2"}}}},
    {{"type": "tool_use", "id": "t2", "name": "calculator", "input": {{"expression": "3*4"}}}}]}},
  {{"delay_ms": {latency_ms}, "parts": [{{"type": "text", "text": "3 and 12"}}]}}
]}}"#
    )
}

/// Writes the script into `dir` and returns the model spec that reads it.
fn write_script(dir: &Path, latency_ms: u64) -> anyhow::Result<ModelSpec> {
    let path = dir.join("bench-turn.json");
    std::fs::write(&path, script(latency_ms)).context("writing the bench script")?;
    ModelSpec::parse(&format!("scripted:{}", path.display())).context("the bench model spec")
}

/// Runs the closed loop on `client` and measures it.
async fn closed_loop(
    client: Client,
    model: ModelSpec,
    config: &BenchConfig,
    setup: String,
) -> anyhow::Result<BenchResult> {
    let tools = ToolRegistry::builtin(".").specs();
    let warmup = Duration::from_secs_f64(config.seconds / 10.0);
    let measured = Duration::from_secs_f64(config.seconds);
    let started = Instant::now();
    let measure_from = started + warmup;
    let measure_until = measure_from + measured;
    let mut runners = Vec::new();
    for client_no in 0..config.sessions {
        let client = client.clone();
        let model = model.clone();
        let tools = tools.clone();
        runners.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut n = 0u64;
            loop {
                let begin = Instant::now();
                if begin >= measure_until {
                    return Ok::<_, anyhow::Error>(latencies);
                }
                n += 1;
                let mut options = SessionOptions::new(model.clone(), tools.clone());
                options.session_id = Some(format!("bench-{client_no}-{n}"));
                let id = client.start_session(options).await?;
                let outcome = client.run_turn(&id, "go").await?;
                if !matches!(outcome, TurnOutcome::Completed { .. }) {
                    bail!("a bench turn did not complete: {outcome:?}");
                }
                let end = Instant::now();
                if begin >= measure_from && end <= measure_until {
                    latencies.push(end.duration_since(begin));
                }
            }
        }));
    }
    let mut latencies = Vec::new();
    for runner in runners {
        latencies.extend(runner.await.context("a bench client panicked")??);
    }
    latencies.sort();
    let pick = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map(|d| d.as_secs_f64() * 1e3)
            .unwrap_or(f64::NAN)
    };
    Ok(BenchResult {
        setup,
        sessions: config.sessions,
        model_latency_ms: config.model_latency_ms,
        turns: latencies.len(),
        turns_per_sec: latencies.len() as f64 / measured.as_secs_f64(),
        p50_ms: pick(0.5),
        p99_ms: pick(0.99),
    })
}

/// Embedded: the store, the engine and a worker pool in this process.
pub async fn embedded(config: &BenchConfig) -> anyhow::Result<BenchResult> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let model = write_script(dir.path(), config.model_latency_ms)?;
    let opened = embedded::open(
        &dir.path().join("store"),
        OpenMode::Create,
        Some(config.engine),
    )
    .await?;
    let engine = Engine::new(opened.store.clone(), Arc::new(SystemClock));
    let pool = WorkerPool::start(
        engine.clone(),
        Activities {
            models: Arc::new(StandardModels::new()),
            tools: Arc::new(ToolRegistry::builtin(dir.path())),
        },
        WorkerConfig {
            concurrency: (2 * config.sessions).max(64),
            ..WorkerConfig::default()
        },
    );
    let result = closed_loop(Client::new(engine), model, config, "embedded".into()).await;
    pool.shutdown().await;
    result
}

/// Through a server: `cairn server` and `workers` `cairn worker` processes started from `exe`,
/// the turns driven by the client `connect` makes for the server's URL.
pub async fn through_server(
    exe: &Path,
    workers: usize,
    config: &BenchConfig,
    connect: impl Fn(&str) -> anyhow::Result<Client>,
) -> anyhow::Result<BenchResult> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let model = write_script(dir.path(), config.model_latency_ms)?;
    let (_server, url) = start_and_wait(
        exe,
        &[
            "server".into(),
            "--data".into(),
            dir.path().join("store").display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--engine".into(),
            config.engine.to_string(),
        ],
        "listening on",
        // Their notes would break the table; a child that fails says so by exiting early.
        Stdio::null(),
    )?;
    let per_worker = config.worker_concurrency.max(1);
    let mut processes = Vec::new();
    for _ in 0..workers {
        let (worker, _) = start_and_wait(
            exe,
            &[
                "worker".into(),
                "--server".into(),
                url.clone(),
                "--concurrency".into(),
                per_worker.to_string(),
                "--workdir".into(),
                dir.path().display().to_string(),
            ],
            "worker ready",
            Stdio::null(),
        )?;
        processes.push(worker);
    }
    let client = connect(&url)?;
    let setup = format!(
        "server, {workers} worker process{}",
        if workers == 1 { "" } else { "es" }
    );
    closed_loop(client, model, config, setup).await
}
