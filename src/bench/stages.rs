//! `cairn bench --stages`: where one session's turn spends its time on each engine, step by
//! step between the marks on its path (the harness is `cairn_devtools::stages`).

use crate::cli::out::outln;
use anyhow::Context;
use cairn_devtools::machine::Machine;
use cairn_devtools::stages;
use cairn_runtime::store::embedded::StorageEngine;
use std::process::ExitCode;

/// Measures one session's turns for `seconds` on each engine in turn and prints each table.
pub async fn run(seconds: f64, engines: &[StorageEngine]) -> anyhow::Result<ExitCode> {
    outln!(
        "where one session's turn goes: a fresh session per turn (model → 2 parallel tools → model, zero model latency), one in flight, {seconds} s after {} s of warm-up, on a new store of each engine, closed and opened again; each row a step between two marks on the turn's path (sync.start → sync.end is the store's write and fdatasync; on fjall a lone append's write is started in write.applied → write.committed, its commit), how many times a turn takes it, its p50, its time per turn, its share of the time the marks cover, and its thread changes per turn",
        seconds / 10.0
    )?;
    outln!("{}", Machine::of_bench_stores())?;
    for &engine in engines {
        let result = stages::measure(seconds, engine)
            .await
            .with_context(|| format!("the stages of a turn on {engine}"))?;
        outln!("\n{}", stages::table(&result).trim_end())?;
    }
    Ok(ExitCode::SUCCESS)
}
