//! `cairn bench --parked N`: the memory of N parked sessions in one process (issue 13's goal:
//! 100,000 under 100 MB RSS).
//!
//! One process opens a new embedded store as `cairn` does ([`embedded::open`]), builds the
//! engine and the default worker pool as the embedded throughput bench does, and runs N
//! sessions, each through one turn of the bench's scripted zero-latency model (model → two
//! parallel tools → model), at most `concurrency` at once. Every session is then idle: parked,
//! waiting for its next message. The process's resident set (`VmRSS` in `/proc/self/status`,
//! Linux) is read before the store opens, right after the last turn, and after a settle in
//! which the store's background work (flushes, compactions, the high-water marks) runs; the
//! per-session figure is the settled RSS over N. The engine and the pool stay up while it is
//! read, as in a process serving those sessions.

// A benchmark reads clocks and waits on real time.
#![allow(clippy::disallowed_methods)]

use crate::bench::write_script;
use anyhow::{bail, Context};
use cairn_activities::ToolRegistry;
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::{Client, Engine, SessionOptions, SystemClock, TurnOutcome};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sessions run at once while parking them.
pub const CONCURRENCY: usize = 128;
/// How long the process idles after the last turn before the settled RSS is read.
pub const SETTLE: Duration = Duration::from_secs(3);

/// What one parked-sessions measurement found.
#[derive(Debug, Clone, PartialEq)]
pub struct ParkedResult {
    /// The storage engine.
    pub engine: StorageEngine,
    /// Sessions parked.
    pub sessions: usize,
    /// Seconds it took to run every session's turn.
    pub seconds: f64,
    /// RSS before the store was opened, bytes.
    pub rss_before: u64,
    /// RSS right after the last turn, bytes.
    pub rss_after_turns: u64,
    /// RSS after the settle, bytes.
    pub rss_settled: u64,
}

const MIB: f64 = 1024.0 * 1024.0;

impl ParkedResult {
    /// The header of the report table.
    pub fn header() -> &'static str {
        "| engine | parked sessions | time to park | RSS before | RSS after the turns | RSS settled | settled RSS per session |\n|---|---|---|---|---|---|---|"
    }

    /// One row of the report table (MiB; per session in bytes).
    pub fn row(&self) -> String {
        let per_session = self.rss_settled as f64 / self.sessions.max(1) as f64;
        format!(
            "| {} | {} | {:.1} s | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.0} B |",
            self.engine,
            self.sessions,
            self.seconds,
            self.rss_before as f64 / MIB,
            self.rss_after_turns as f64 / MIB,
            self.rss_settled as f64 / MIB,
            per_session,
        )
    }
}

/// The settled RSS a [`ParkedResult::row`] shows, in MiB (as the row rounds it), for a
/// process that reads another's report.
pub fn settled_mib_in_row(row: &str) -> Option<f64> {
    let cells: Vec<&str> = row.trim().trim_matches('|').split('|').collect();
    cells.get(5)?.trim().strip_suffix(" MiB")?.parse().ok()
}

/// The `VmRSS` line of a `/proc/<pid>/status` text, in bytes.
pub fn vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let mut words = line["VmRSS:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next()? == "kB").then_some(kib * 1024)
}

/// This process's resident set, bytes (Linux only).
pub fn rss_now() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("reading /proc/self/status (the parked bench needs Linux)")?;
    vm_rss(&status).context("no VmRSS line in /proc/self/status")
}

/// Parks `sessions` sessions on a new store of `engine` in this process, `concurrency` at a
/// time, and measures the RSS (see the module docs).
pub async fn parked(
    sessions: usize,
    engine: StorageEngine,
    concurrency: usize,
    settle: Duration,
) -> anyhow::Result<ParkedResult> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let model = write_script(dir.path(), 0, crate::bench::DEFAULT_PARALLEL_TOOLS, 1)?;
    let tools = ToolRegistry::builtin(dir.path()).specs();
    let rss_before = rss_now()?;
    let opened = embedded::open(&dir.path().join("store"), OpenMode::Create, Some(engine)).await?;
    let core = Engine::new(opened.store.clone(), Arc::new(SystemClock));
    let pool = WorkerPool::start(
        core.clone(),
        Activities {
            models: Arc::new(StandardModels::new()),
            tools: Arc::new(ToolRegistry::builtin(dir.path())),
        },
        WorkerConfig::default(),
    );
    let client = Client::new(core);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut runners = Vec::new();
    for _ in 0..concurrency.clamp(1, sessions.max(1)) {
        let (client, next, model, tools) = (
            client.clone(),
            Arc::clone(&next),
            model.clone(),
            tools.clone(),
        );
        runners.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= sessions {
                    return Ok::<_, anyhow::Error>(());
                }
                let mut options = SessionOptions::new(model.clone(), tools.clone());
                options.session_id = Some(format!("parked-{n}"));
                let id = client.start_session(options).await?;
                let outcome = client.run_turn(&id, "go").await?;
                if !matches!(outcome, TurnOutcome::Completed { .. }) {
                    bail!("a parked session's turn did not complete: {outcome:?}");
                }
            }
        }));
    }
    let mut failed = None;
    for runner in runners {
        match runner.await.context("a parked-session runner panicked") {
            Ok(Ok(())) => {}
            Ok(Err(e)) | Err(e) => failed = failed.or(Some(e)),
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let measured = match failed {
        Some(e) => Err(e),
        None => {
            async {
                let rss_after_turns = rss_now()?;
                tokio::time::sleep(settle).await;
                Ok((rss_after_turns, rss_now()?))
            }
            .await
        }
    };
    pool.shutdown().await;
    let (rss_after_turns, rss_settled) = measured?;
    Ok(ParkedResult {
        engine,
        sessions,
        seconds,
        rss_before,
        rss_after_turns,
        rss_settled,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settled_rss_is_read_back_from_a_row() {
        let result = ParkedResult {
            engine: StorageEngine::Fjall,
            sessions: 100_000,
            seconds: 41.25,
            rss_before: 10 << 20,
            rss_after_turns: 90 << 20,
            rss_settled: (70 << 20) + (4 << 20) / 10,
        };
        assert_eq!(settled_mib_in_row(&result.row()), Some(70.4));
        assert_eq!(settled_mib_in_row("| fjall | 1 | 1.0 s |"), None);
    }

    #[test]
    fn vm_rss_reads_the_status_line_in_bytes() {
        let status = "Name:\tcairn\nVmPeak:\t  999 kB\nVmRSS:\t   12345 kB\nThreads:\t4\n";
        assert_eq!(vm_rss(status), Some(12345 * 1024));
        assert_eq!(vm_rss("VmRSS:\t12 MB\n"), None);
        assert_eq!(vm_rss("Name:\tx\n"), None);
        assert!(rss_now().unwrap() > 0);
    }

    #[test]
    fn a_row_has_the_header_columns() {
        let result = ParkedResult {
            engine: StorageEngine::Fjall,
            sessions: 1000,
            seconds: 2.0,
            rss_before: 10 << 20,
            rss_after_turns: 30 << 20,
            rss_settled: 20 << 20,
        };
        assert_eq!(
            result.row(),
            "| fjall | 1000 | 2.0 s | 10.0 MiB | 30.0 MiB | 20.0 MiB | 20972 B |"
        );
        let columns = |line: &str| line.matches('|').count();
        let header = ParkedResult::header().lines().next().unwrap();
        assert_eq!(columns(&result.row()), columns(header));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parks_sessions_and_reads_rss() {
        let result = parked(20, StorageEngine::Fjall, 4, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(result.sessions, 20);
        assert!(result.rss_settled > 0 && result.rss_after_turns > 0);
    }
}
