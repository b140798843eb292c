//! `cairn bench`: durable turns per second and turn latency, embedded and through servers with
//! worker processes, over a new embedded store or a PostgreSQL database (the harness is
//! `cairn_devtools::bench`).

use crate::cli::database::redact;
use crate::cli::out::outln;
use anyhow::{bail, Context};
use cairn_devtools::bench::{self, BenchConfig, BenchResult, Deployment, ServerStore};
use cairn_devtools::machine::Machine;
use cairn_runtime::store::embedded::StorageEngine;
use std::path::Path;
use std::process::ExitCode;

pub mod goals;
mod parked;
pub mod stages;

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
    /// The engines of the embedded stores, each measured in turn (through a server too,
    /// without `store`).
    pub engines: Vec<StorageEngine>,
    /// Activities each worker process runs at once.
    pub worker_concurrency: usize,
    /// Tool calls the model asks for at once in each turn.
    pub parallel_tools: usize,
    /// Bytes of JSON of further tool specs offered, never called.
    pub tool_spec_bytes: usize,
    /// Turns each client runs on one session before a fresh one.
    pub turns_per_session: usize,
    /// About this many bytes of text in each turn's user message (0: `go`).
    pub message_bytes: usize,
    /// Instead of the throughput rows: park this many sessions per engine and report the RSS.
    pub parked: Option<usize>,
}

/// Runs every measurement asked for and prints a table (Markdown).
pub async fn run(args: BenchArgs, exe: &Path) -> anyhow::Result<ExitCode> {
    if args.engines.is_empty() {
        bail!("no storage engine to measure: give --engine fjall, sled or both");
    }
    if let Some(sessions) = args.parked {
        return parked::run(sessions, &args.engines, exe).await;
    }
    let server_stores: Vec<ServerStore> = match &args.store {
        Some(url) => vec![ServerStore::Postgres {
            server_url: url.clone(),
        }],
        None => {
            if let Some(&servers) = args.servers.iter().find(|&&servers| servers != 1) {
                bail!("{servers} servers need a store they can share: give --store postgres://...");
            }
            args.engines
                .iter()
                .map(|&engine| ServerStore::Embedded(engine))
                .collect()
        }
    };
    let engines = args
        .engines
        .iter()
        .map(|engine| engine.to_string())
        .collect::<Vec<_>>()
        .join(" and ");
    let through = match (&args.store, args.workers.is_empty()) {
        (_, true) => "no measurement through servers (--workers)".to_owned(),
        (Some(url), false) => format!(
            "through servers on a new database on {} each, {} activities at once per worker process",
            redact(url),
            args.worker_concurrency
        ),
        (None, false) => format!(
            "through a server on a new store each (created and closed first, so that the server opens it again, as after a restart), {} activities at once per worker process",
            args.worker_concurrency
        ),
    };
    let runtime_workers = tokio::runtime::Handle::current().metrics().num_workers();
    outln!(
        "durable turns ({}, model → {} parallel tool{} → model{}{}), closed loop, {} s each after {} s of warm-up, model latency {} ms; embedded on a new {engines} store, closed and opened again as a restarted server finds it, with the default worker pool, in this process on {} tokio worker thread{} (TOKIO_WORKER_THREADS sets them; with one, every write goes through the store's writer thread); {through}. CPU per turn: user and system CPU time of the serving processes (this one embedded; the servers and workers through servers) in the row's measured time, per completed turn; p50 fdatasync: 8 KiB overwrites on the store's filesystem for 0.5 s just before and 0.5 s just after each row, the median of both; p50 store sync: the store's own syncs (flush and fdatasync of its journal; fjall writes a lone append's journal record out, and starts the disk's write of it, at its commit, before the sync is timed) in the row; through servers, the highest of the servers' medians over their lives as /v1/health reports them (on PostgreSQL, a commit's round trip); durable commits: the store's (through servers, as their /v1/health counts them, summed; on PostgreSQL, the write transactions they committed), per completed turn (in series at 1 session); the last column: turns/s over N × those of 1 worker process with the same servers",
        if args.turns_per_session == 1 {
            "fresh session".to_owned()
        } else {
            format!("a session of {} turns", args.turns_per_session)
        },
        args.parallel_tools,
        if args.parallel_tools == 1 { "" } else { "s" },
        if args.tool_spec_bytes == 0 {
            String::new()
        } else {
            let specs = bench::bench_tools(args.tool_spec_bytes);
            let bytes = serde_json::to_vec(&specs).map_or(0, |json| json.len());
            format!(", {} tools offered in {bytes} bytes of specs", specs.len())
        },
        if args.message_bytes == 0 {
            String::new()
        } else {
            format!(", user messages of {} bytes", args.message_bytes)
        },
        args.seconds,
        args.seconds / 10.0,
        args.model_latency_ms,
        runtime_workers,
        if runtime_workers == 1 { "" } else { "s" }
    )?;
    outln!("{}", Machine::of_bench_stores())?;
    outln!("{}", BenchResult::header())?;
    for &sessions in &args.sessions {
        let config = BenchConfig {
            sessions,
            seconds: args.seconds,
            model_latency_ms: args.model_latency_ms,
            worker_concurrency: args.worker_concurrency,
            parallel_tools: args.parallel_tools,
            tool_spec_bytes: args.tool_spec_bytes,
            turns_per_session: args.turns_per_session,
            message_bytes: args.message_bytes,
            stages: false,
        };
        if !args.no_embedded {
            for &engine in &args.engines {
                let result = bench::embedded(&config, engine)
                    .await
                    .with_context(|| format!("embedded bench on {engine}"))?;
                outln!("{}", result.row(None))?;
            }
        }
        for (&servers, server_store) in args
            .servers
            .iter()
            .flat_map(|servers| server_stores.iter().map(move |store| (servers, store)))
        {
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
