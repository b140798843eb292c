//! `cairn bench --goals`: each of issue 13's goals as one row, measured in one run, beside the
//! figure it is held to. This module holds the goals' targets, the rows, and the one
//! measurement no other harness makes: how fast a history replays, in memory and cold from a
//! store (the others come from [`crate::bench`], [`crate::transition`], [`crate::footprint`] and
//! [`crate::parked`]).

// A benchmark reads clocks.
#![allow(clippy::disallowed_methods)]

use anyhow::{bail, Context};
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::store::AppendRequest;
use cairn_runtime::{EventEnvelope, SessionState, SessionStatus};
use std::path::Path;
use std::time::{Duration, Instant};

/// Durable turns per second at 128 sessions with default settings, at least.
pub const TURNS_PER_SEC_AT_128: f64 = 3_000.0;
/// One session's p50 turn over (durable commits per turn × p50 fdatasync), at most.
pub const ONE_SESSION_OVER_SYNCS: f64 = 1.5;
/// One state transition over one fdatasync, at most.
pub const TRANSITION_OVER_FDATASYNC: f64 = 1.5;
/// Events folded per second in memory, at least.
pub const FOLD_EVENTS_PER_SEC: f64 = 1_000_000.0;
/// Events read, decoded and folded per second from a store just opened, at least.
pub const COLD_EVENTS_PER_SEC: f64 = 300_000.0;
/// RSS of the parked sessions, bytes, under (100 MB).
pub const PARKED_RSS_BYTES: u64 = 100_000_000;
/// Sessions the parked goal names.
pub const PARKED_SESSIONS: usize = 100_000;
/// History bytes over the raw message bytes, at most.
pub const HISTORY_OVER_RAW: f64 = 1.3;
/// Store bytes on disk over the logical bytes, at most.
pub const DISK_OVER_LOGICAL: f64 = 2.0;

/// One goal measured on one engine.
#[derive(Debug, Clone, PartialEq)]
pub struct GoalRow {
    /// The goal, in words, with its target.
    pub goal: String,
    /// The engine it was measured on.
    pub engine: StorageEngine,
    /// What was measured, in words.
    pub measured: String,
    /// Whether the measurement meets the goal.
    pub met: bool,
}

impl GoalRow {
    /// The header of the report table.
    pub fn header() -> &'static str {
        "| goal (issue 13) | engine | measured | met |\n|---|---|---|---|"
    }

    /// One row of the report table.
    pub fn row(&self) -> String {
        format!(
            "| {} | {} | {} | {} |",
            self.goal,
            self.engine,
            self.measured,
            if self.met { "yes" } else { "no" }
        )
    }
}

/// How fast one history replays.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplaySpeed {
    /// Events in the history.
    pub events: usize,
    /// Events folded per second in memory (already decoded).
    pub fold_per_sec: f64,
    /// Events read, decoded and folded per second from a store just opened (the median of
    /// the reopens; the open itself apart).
    pub cold_per_sec: f64,
    /// The same with the open counted in.
    pub cold_with_open_per_sec: f64,
}

/// Reopens of the store for the cold figures; the median counts.
const COLD_READS: usize = 5;

/// Measures how fast `history` (one session's, from seq 1) replays: folded in memory over and
/// over for about `fold_time`, then written to a new `engine` store in `dir` and read back
/// cold five times, the store closed and opened again before each read, as
/// `cairn replay` opens it. Every read must give back the history written.
pub async fn replay_speed(
    dir: &Path,
    engine: StorageEngine,
    history: &[EventEnvelope],
    fold_time: Duration,
) -> anyhow::Result<ReplaySpeed> {
    let Some(first) = history.first() else {
        bail!("no history to replay");
    };
    let session_id = first.session_id.clone();
    let began = Instant::now();
    let mut folds = 0u32;
    while folds < 3 || began.elapsed() < fold_time {
        SessionState::fold(&session_id, history)?;
        folds += 1;
    }
    let fold_per_sec = history.len() as f64 * f64::from(folds) / began.elapsed().as_secs_f64();

    let store_dir = dir.join("replay-store");
    {
        let opened = embedded::open(&store_dir, OpenMode::Create, Some(engine)).await?;
        for chunk in history.chunks(500) {
            let request = AppendRequest::new(
                session_id.clone(),
                chunk[0].seq,
                chunk.to_vec(),
                SessionStatus::Idle,
                chunk[chunk.len() - 1].recorded_at_ms,
            );
            opened.store.append(request).await?;
        }
    }
    let mut reads = Vec::with_capacity(COLD_READS);
    let mut with_opens = Vec::with_capacity(COLD_READS);
    for _ in 0..COLD_READS {
        let opening = Instant::now();
        let opened = embedded::open(&store_dir, OpenMode::Existing, Some(engine))
            .await
            .context("opening the replay store again")?;
        let reading = Instant::now();
        let read = opened.store.read_history(&session_id, 1, None).await?;
        SessionState::fold(&session_id, &read)?;
        let done = Instant::now();
        if read != history {
            bail!("the replay store gave back another history than the one written");
        }
        reads.push(done - reading);
        with_opens.push(done - opening);
    }
    let per_sec = |mut times: Vec<Duration>| {
        times.sort();
        history.len() as f64 / times[times.len() / 2].as_secs_f64()
    };
    Ok(ReplaySpeed {
        events: history.len(),
        fold_per_sec,
        cold_per_sec: per_sec(reads),
        cold_with_open_per_sec: per_sec(with_opens),
    })
}

/// A count in words with thousands separated (`12,345`).
pub fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_separated() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1_000.0), "1,000");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }

    #[test]
    fn a_row_says_whether_its_goal_is_met() {
        let row = GoalRow {
            goal: "≥ 3,000 turns/s".into(),
            engine: StorageEngine::Fjall,
            measured: "3,513 turns/s".into(),
            met: true,
        };
        assert_eq!(
            row.row(),
            "| ≥ 3,000 turns/s | fjall | 3,513 turns/s | yes |"
        );
    }
}
