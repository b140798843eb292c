//! `cairn bench`: durable turns per second and turn latency, embedded and through a server
//! with 1, 2 and 4 worker processes (the harness is `cairn_devtools::bench`).

use crate::cli::out::outln;
use anyhow::Context;
use cairn_devtools::bench::{self, BenchConfig, BenchResult};
use cairn_runtime::store::embedded::StorageEngine;
use std::path::Path;
use std::process::ExitCode;

/// What `cairn bench` was asked for.
pub struct BenchArgs {
    /// Sessions in flight, one measurement each.
    pub sessions: Vec<usize>,
    /// Worker process counts to measure through a server.
    pub workers: Vec<usize>,
    /// The scripted model's latency.
    pub model_latency_ms: u64,
    /// Seconds per measurement.
    pub seconds: f64,
    /// Skip the embedded measurement.
    pub no_embedded: bool,
    /// The store engine.
    pub engine: StorageEngine,
    /// Activities each worker process runs at once.
    pub worker_concurrency: usize,
}

/// Runs every measurement asked for and prints a table (Markdown).
pub async fn run(args: BenchArgs, exe: &Path) -> anyhow::Result<ExitCode> {
    outln!(
        "durable turns (fresh session, model → 2 parallel tools → model), {} s each, {} store, model latency {} ms, {} activities at once per worker process",
        args.seconds, args.engine, args.model_latency_ms, args.worker_concurrency
    )?;
    outln!("{}", BenchResult::header())?;
    for &sessions in &args.sessions {
        let config = BenchConfig {
            sessions,
            seconds: args.seconds,
            model_latency_ms: args.model_latency_ms,
            engine: args.engine,
            worker_concurrency: args.worker_concurrency,
        };
        if !args.no_embedded {
            let result = bench::embedded(&config).await.context("embedded bench")?;
            outln!("{}", result.row())?;
        }
        for &workers in &args.workers {
            let result = bench::through_server(exe, workers, &config, |url| {
                Ok(cairn_remote::connect(url, None)?)
            })
            .await
            .with_context(|| format!("bench through a server with {workers} workers"))?;
            outln!("{}", result.row())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
