//! `cairn bench --parked N`: the RSS of N parked sessions per embedded engine (the harness is
//! `cairn_devtools::parked`). With several engines, each is measured in a child process of its
//! own (`cairn bench --parked N --engine E`), so that one engine's freed memory, which the
//! allocator keeps, does not count against the next.

use crate::cli::out::outln;
use anyhow::{bail, Context};
use cairn_devtools::parked::{self, ParkedResult};
use cairn_runtime::store::embedded::StorageEngine;
use std::path::Path;
use std::process::{ExitCode, Stdio};

/// Parks `sessions` sessions on each of `engines` and prints a table (Markdown).
pub async fn run(
    sessions: usize,
    engines: &[StorageEngine],
    exe: &Path,
) -> anyhow::Result<ExitCode> {
    if sessions == 0 {
        bail!("--parked needs at least one session");
    }
    outln!(
        "parked sessions: each through one turn (fresh session, model → 2 parallel tools → model, zero model latency), {} at once, on a new store with the default worker pool, in one process per engine; RSS is VmRSS, settled after {} s idle",
        parked::CONCURRENCY,
        parked::SETTLE.as_secs()
    )?;
    outln!("{}", ParkedResult::header())?;
    if let [engine] = engines {
        let result = parked::parked(sessions, *engine, parked::CONCURRENCY, parked::SETTLE)
            .await
            .with_context(|| format!("parked sessions on {engine}"))?;
        outln!("{}", result.row())?;
        return Ok(ExitCode::SUCCESS);
    }
    for &engine in engines {
        outln!("{}", row_in_child(exe, sessions, engine).await?)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Parks `sessions` sessions on `engine` in a child `cairn bench --parked N --engine E`, a
/// process of its own, and gives back its row.
pub async fn row_in_child(
    exe: &Path,
    sessions: usize,
    engine: StorageEngine,
) -> anyhow::Result<String> {
    let mut child = std::process::Command::new(exe);
    child
        .args(["bench", "--parked", &sessions.to_string(), "--engine"])
        .arg(engine.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    let output = tokio::task::spawn_blocking(move || child.output())
        .await
        .context("the parked bench's child waiter panicked")?
        .with_context(|| format!("starting the parked bench on {engine}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let row = stdout.lines().rev().find(|line| line.starts_with("| "));
    match (output.status.success(), row) {
        (true, Some(row)) => Ok(row.to_owned()),
        _ => bail!(
            "the parked bench on {engine} failed ({}): {}",
            output.status,
            stdout.trim()
        ),
    }
}
