//! `cairn bench --footprint`: the bytes of one long session on each engine, from the raw
//! messages to the disk (the harness is `cairn_devtools::footprint`).

use crate::cli::out::outln;
use anyhow::Context;
use cairn_devtools::footprint;
use cairn_runtime::store::embedded::StorageEngine;
use std::process::ExitCode;

/// Measures a `turns`-turn session on each engine in turn and prints each report.
pub async fn run(turns: usize, engines: &[StorageEngine]) -> anyhow::Result<ExitCode> {
    for &engine in engines {
        let measured = footprint::measure(turns, engine)
            .await
            .with_context(|| format!("footprint on {engine}"))?;
        outln!("{}", measured.report())?;
    }
    Ok(ExitCode::SUCCESS)
}
