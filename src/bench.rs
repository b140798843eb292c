//! `cairn bench`: durable turns per second and turn latency, embedded and through servers with
//! worker processes, over a new embedded store or a PostgreSQL database (the harness is
//! `cairn_devtools::bench`).

use crate::cli::database::redact;
use crate::cli::out::outln;
use anyhow::{bail, Context};
use cairn_devtools::bench::{self, BenchConfig, BenchResult, Deployment, ServerStore};
use cairn_runtime::store::embedded::StorageEngine;
use std::path::Path;
use std::process::ExitCode;

/// What `cairn bench` was asked for.
pub struct BenchArgs {
    /// Sessions in flight, one measurement each.
    pub sessions: Vec<usize>,
    /// Worker process counts to measure through servers.
    pub workers: Vec<usize>,
    /// Server process counts to measure (more than one needs `store`).
    pub servers: Vec<usize>,
    /// A PostgreSQL server on which each measurement through servers gets a new database;
    /// `None`: a new embedded store per measurement.
    pub store: Option<String>,
    /// The scripted model's latency.
    pub model_latency_ms: u64,
    /// Seconds per measurement.
    pub seconds: f64,
    /// Skip the embedded measurement.
    pub no_embedded: bool,
    /// The engine of the embedded stores.
    pub engine: StorageEngine,
    /// Activities each worker process runs at once.
    pub worker_concurrency: usize,
}

/// Runs every measurement asked for and prints a table (Markdown).
pub async fn run(args: BenchArgs, exe: &Path) -> anyhow::Result<ExitCode> {
    let server_store = match &args.store {
        Some(url) => ServerStore::Postgres {
            server_url: url.clone(),
        },
        None => {
            if let Some(&servers) = args.servers.iter().find(|&&servers| servers != 1) {
                bail!("{servers} servers need a store they can share: give --store postgres://...");
            }
            ServerStore::Embedded(args.engine)
        }
    };
    let through = match &args.store {
        Some(url) => format!("servers on a new database on {} each", redact(url)),
        None => format!("a server on a new {} store each", args.engine),
    };
    outln!(
        "durable turns (fresh session, model → 2 parallel tools → model), {} s each, model latency {} ms; embedded on a new {} store, through {through}; {} activities at once per worker process; the last column is turns/s over N × those of 1 worker process with the same servers",
        args.seconds, args.model_latency_ms, args.engine, args.worker_concurrency
    )?;
    outln!("{}", BenchResult::header())?;
    for &sessions in &args.sessions {
        let config = BenchConfig {
            sessions,
            seconds: args.seconds,
            model_latency_ms: args.model_latency_ms,
            worker_concurrency: args.worker_concurrency,
        };
        if !args.no_embedded {
            let result = bench::embedded(&config, args.engine)
                .await
                .context("embedded bench")?;
            outln!("{}", result.row(None))?;
        }
        for &servers in &args.servers {
            let mut one_worker: Option<BenchResult> = None;
            for &workers in &args.workers {
                let deployment = Deployment {
                    store: server_store.clone(),
                    servers,
                    workers,
                };
                let result = bench::through_servers(exe, &deployment, &config, |url| {
                    Ok(cairn_remote::connect(url, None)?)
                })
                .await
                .with_context(|| format!("bench through {}", deployment.label()))?;
                if workers == 1 {
                    one_worker = Some(result.clone());
                }
                let scaling = one_worker.as_ref().and_then(|one| result.scaling(one));
                outln!("{}", result.row(scaling))?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
