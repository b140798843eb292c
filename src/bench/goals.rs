//! `cairn bench --goals`: every goal of issue 13 measured in one run on each engine, one row
//! each, beside its target (the harnesses are `cairn_devtools`'s; the targets and the replay
//! measurement are in `cairn_devtools::goals`).
//!
//! Per engine, in this order: the fdatasync probe and turns at 128 and at 1 session
//! (`cairn bench`'s rows), one state transition, the bytes of a long session
//! (`--footprint`), that session's history replayed in memory and cold from a store just
//! opened, and the RSS of parked sessions, in a child process of its own (`--parked`) so that
//! the memory this process freed does not count.

use crate::cli::out::outln;
use anyhow::{bail, Context};
use cairn_devtools::bench::{self, BenchConfig};
use cairn_devtools::goals::{self, thousands, GoalRow};
use cairn_devtools::machine::Machine;
use cairn_devtools::{footprint, parked, transition};
use cairn_runtime::store::embedded::StorageEngine;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

/// What `cairn bench --goals` was asked for.
pub struct GoalsArgs {
    /// Seconds per throughput measurement (and, at most, for the transitions).
    pub seconds: f64,
    /// Turns of the long session measured for bytes and replay.
    pub turns: usize,
    /// Sessions parked for the memory goal.
    pub parked: usize,
    /// The engines, each measured.
    pub engines: Vec<StorageEngine>,
}

/// Measures every goal on each engine and prints one table (Markdown); exits 0 whether or not
/// the goals are met (the table says which).
pub async fn run(args: GoalsArgs, exe: &Path) -> anyhow::Result<ExitCode> {
    if args.turns == 0 || args.parked == 0 {
        bail!("--goals needs at least one turn (--turns) and one parked session (--parked)");
    }
    outln!(
        "issue 13's goals, each measured in this run on a new store of each engine: turns at 128 and 1 session in flight and one state transition on a store closed and opened again, as a restarted server finds it; turns at 128 and 1 session in flight ({} s each, the default worker pool, zero model latency; 1 session's p50 over its durable commits per turn × the p50 fdatasync probed for 0.5 s just before and 0.5 s just after); one state transition (a completion recorded → the next task handed, eager, as a worker of this process runs it; the median over the p50 fdatasync probed the same way); a {}-turn session's bytes and its history replayed (in memory; cold: read, decoded and folded from the store just opened, the median of five opens); {} sessions parked through one turn each, in a child process, RSS settled",
        args.seconds,
        args.turns,
        thousands(args.parked as f64),
    )?;
    outln!("{}", Machine::of_bench_stores())?;
    outln!("{}", GoalRow::header())?;
    for &engine in &args.engines {
        for row in measure(&args, engine, exe)
            .await
            .with_context(|| format!("the goals on {engine}"))?
        {
            outln!("{}", row.row())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Every goal's row on `engine`.
async fn measure(
    args: &GoalsArgs,
    engine: StorageEngine,
    exe: &Path,
) -> anyhow::Result<Vec<GoalRow>> {
    let mut rows = Vec::new();
    let config = |sessions| BenchConfig {
        sessions,
        seconds: args.seconds,
        model_latency_ms: 0,
        worker_concurrency: 16,
        parallel_tools: cairn_devtools::bench::DEFAULT_PARALLEL_TOOLS,
        tool_spec_bytes: 0,
        turns_per_session: 1,
        message_bytes: 0,
        stages: false,
    };

    let many = bench::embedded(&config(128), engine).await?;
    rows.push(GoalRow {
        goal: format!(
            "≥ {} turns/s at 128 sessions, default settings",
            thousands(goals::TURNS_PER_SEC_AT_128)
        ),
        engine,
        measured: format!(
            "{} turns/s (p50 turn {:.2} ms)",
            thousands(many.turns_per_sec),
            many.p50_ms
        ),
        met: many.turns_per_sec >= goals::TURNS_PER_SEC_AT_128,
    });

    let one = bench::embedded(&config(1), engine).await?;
    let commits = one.commits_per_turn.unwrap_or(f64::NAN);
    let ratio = one.over_flushes().unwrap_or(f64::NAN);
    rows.push(GoalRow {
        goal: format!(
            "1 session: p50 turn ≤ {} × commits × p50 fdatasync",
            goals::ONE_SESSION_OVER_SYNCS
        ),
        engine,
        measured: format!(
            "{ratio:.2} (p50 turn {:.2} ms, {commits:.2} commits, fdatasync {})",
            one.p50_ms,
            one.fdatasync.words()
        ),
        met: ratio <= goals::ONE_SESSION_OVER_SYNCS,
    });

    let dir = tempfile::tempdir().context("a temporary directory")?;
    let step = transition::measure(
        dir.path(),
        engine,
        Duration::from_secs_f64(args.seconds.min(3.0)),
    )
    .await?;
    rows.push(GoalRow {
        goal: format!(
            "1 state transition ≤ {} × p50 fdatasync",
            goals::TRANSITION_OVER_FDATASYNC
        ),
        engine,
        measured: format!(
            "{:.2} (p50 {:.3} ms, mean {:.3} ms over {}; fdatasync {})",
            step.over_fdatasync(),
            step.p50_ms,
            step.mean_ms,
            step.transitions,
            step.fdatasync.words()
        ),
        met: step.over_fdatasync() <= goals::TRANSITION_OVER_FDATASYNC,
    });

    let bytes = footprint::measure(args.turns, engine).await?;
    let history_ratio = bytes.history_bytes as f64 / bytes.raw_bytes as f64;
    let disk = [
        ("open", bytes.disk_open.allocated),
        ("closed", bytes.disk_closed.allocated),
        ("reopened", bytes.disk_reopened.allocated),
    ];
    let logical = bytes.live_bytes as f64;
    let (worst_when, worst) = disk
        .iter()
        .map(|&(when, allocated)| (when, allocated as f64 / logical))
        .fold(
            ("open", 0.0),
            |worst, now| if now.1 > worst.1 { now } else { worst },
        );
    rows.push(GoalRow {
        goal: format!("history ≤ {} × raw message bytes", goals::HISTORY_OVER_RAW),
        engine,
        measured: format!(
            "{history_ratio:.2}× ({} turns: {} history bytes, {} raw)",
            args.turns,
            thousands(bytes.history_bytes as f64),
            thousands(bytes.raw_bytes as f64)
        ),
        met: history_ratio <= goals::HISTORY_OVER_RAW,
    });
    rows.push(GoalRow {
        goal: format!(
            "store on disk ≤ {} × logical bytes",
            goals::DISK_OVER_LOGICAL
        ),
        engine,
        measured: format!(
            "{worst:.2}× at worst ({worst_when}; {} logical bytes; open {:.2}×, closed {:.2}×, reopened {:.2}×)",
            thousands(logical),
            disk[0].1 as f64 / logical,
            disk[1].1 as f64 / logical,
            disk[2].1 as f64 / logical,
        ),
        met: worst <= goals::DISK_OVER_LOGICAL,
    });

    let replay =
        goals::replay_speed(dir.path(), engine, &bytes.history, Duration::from_secs(1)).await?;
    rows.push(GoalRow {
        goal: format!(
            "replay ≥ {} events/s folded in memory",
            thousands(goals::FOLD_EVENTS_PER_SEC)
        ),
        engine,
        measured: format!(
            "{} events/s ({} events)",
            thousands(replay.fold_per_sec),
            thousands(replay.events as f64)
        ),
        met: replay.fold_per_sec >= goals::FOLD_EVENTS_PER_SEC,
    });
    rows.push(GoalRow {
        goal: format!(
            "replay ≥ {} events/s cold from the store",
            thousands(goals::COLD_EVENTS_PER_SEC)
        ),
        engine,
        measured: format!(
            "{} events/s ({} with the open)",
            thousands(replay.cold_per_sec),
            thousands(replay.cold_with_open_per_sec)
        ),
        met: replay.cold_per_sec >= goals::COLD_EVENTS_PER_SEC,
    });
    drop(dir);

    let settled_mib = parked_in_child(exe, args.parked, engine).await?;
    let settled_bytes = settled_mib * 1024.0 * 1024.0;
    rows.push(GoalRow {
        goal: format!(
            "{} parked sessions < {} MB RSS",
            thousands(goals::PARKED_SESSIONS as f64),
            goals::PARKED_RSS_BYTES / 1_000_000
        ),
        engine,
        measured: format!(
            "{settled_mib:.1} MiB ({:.1} MB) for {}",
            settled_bytes / 1e6,
            thousands(args.parked as f64)
        ),
        // Fewer sessions than the goal's prove nothing about it.
        met: args.parked >= goals::PARKED_SESSIONS
            && settled_bytes < goals::PARKED_RSS_BYTES as f64,
    });
    Ok(rows)
}

/// Parks `sessions` sessions on `engine` in a child `cairn bench --parked`, and reads the
/// settled RSS (MiB) off its row.
async fn parked_in_child(
    exe: &Path,
    sessions: usize,
    engine: StorageEngine,
) -> anyhow::Result<f64> {
    let row = super::parked::row_in_child(exe, sessions, engine).await?;
    parked::settled_mib_in_row(&row)
        .with_context(|| format!("no settled RSS in the parked bench's row {row:?}"))
}
