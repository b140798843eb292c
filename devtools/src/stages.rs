//! `cairn bench --stages`: where one session's turn spends its time, step by step between the
//! marks on its path ([`cairn_runtime::stages`]), measured on an embedded store in the bench's
//! closed loop.
//!
//! One session in flight, so that the marks follow one turn at a time and each step is the
//! time from one point of the turn to the next: the sync steps (`sync.start → sync.end`) are
//! the store's fdatasyncs, the others the work in series between them. A table row per step,
//! the most time per turn first (the order of [`stages::steps`](cairn_runtime::stages::steps)),
//! with how often a turn takes it, its p50, its µs per turn, its
//! share of the time the marks cover, and how often it crossed threads (a wake of another
//! thread, or the trip to the store's writer thread). A second table takes the p99 apart:
//! the steps the slowest 1% of the turns spend more time on than the average turn
//! ([`stages::slowest_turns`](cairn_runtime::stages::slowest_turns)).

use crate::bench::{self, BenchConfig, BenchResult};
use cairn_runtime::stages::SlowTurns;
use cairn_runtime::store::embedded::StorageEngine;

/// Measures one session's turns on a new `engine` store for `seconds`, recording the marks.
pub async fn measure(seconds: f64, engine: StorageEngine) -> anyhow::Result<BenchResult> {
    let config = BenchConfig {
        sessions: 1,
        seconds,
        model_latency_ms: 0,
        worker_concurrency: 16,
        parallel_tools: bench::DEFAULT_PARALLEL_TOOLS,
        tool_spec_bytes: 0,
        turns_per_session: 1,
        message_bytes: 0,
        stages: true,
    };
    bench::embedded(&config, engine).await
}

/// The steps of `result` as a Markdown table, in their order (the most time per turn first),
/// after a line that names the row's turn figures. Steps taken less than once in 20 turns are left out (the rare
/// ones: a batch that went to the writer thread, a timer), their share still counted in the
/// total.
pub fn table(result: &BenchResult) -> String {
    let turns = result.turns.max(1) as f64;
    let covered_us: f64 = result.stages.iter().map(|step| step.total_us).sum();
    let mut out = format!(
        "{}: {} turns, p50 turn {:.3} ms, marks covering {:.3} ms per turn; p50 fdatasync {:.3} ms, p50 store sync {}\n",
        result.setup,
        result.turns,
        result.p50_ms,
        covered_us / turns / 1e3,
        result.fdatasync.p50_ms,
        result
            .store_sync_p50_ms
            .map_or_else(|| "–".to_owned(), |ms| format!("{ms:.3} ms")),
    );
    out.push_str(
        "| step (from → to) | per turn | p50 | µs per turn | share | thread changes |\n|---|---|---|---|---|---|\n",
    );
    for step in &result.stages {
        let per_turn = step.count as f64 / turns;
        if per_turn < 0.05 {
            continue;
        }
        let us_per_turn = step.total_us / turns;
        out.push_str(&format!(
            "| {} → {} | {:.2} | {:.1} µs | {:.1} | {:.1}% | {:.2} |\n",
            step.from,
            step.to,
            per_turn,
            step.p50_us,
            us_per_turn,
            100.0 * step.total_us / covered_us.max(f64::MIN_POSITIVE),
            step.thread_changes as f64 / turns,
        ));
    }
    if let Some(slowest) = &result.slow_turns {
        out.push_str(&slow_table(slowest));
    }
    out
}

/// The most rows the slowest turns' table shows.
const SLOW_ROWS: usize = 10;

/// The slowest turns' steps beside every turn's, as a Markdown table after a line that names
/// them: the steps a slow turn spends at least 1 µs more on than the average turn, the most
/// extra first, at most [`SLOW_ROWS`].
fn slow_table(slowest: &SlowTurns) -> String {
    let mut out = format!(
        "\nthe slowest {:.0}% of turns: {} of {} whole turns in the marks, at least {:.3} ms (mean {:.3} ms, against {:.3} ms for all); the steps a slow turn spends more time on, the most extra first\n",
        (1.0 - slowest.quantile) * 100.0,
        slowest.slow,
        slowest.turns,
        slowest.threshold_us / 1e3,
        slowest.slow_mean_us / 1e3,
        slowest.all_mean_us / 1e3,
    );
    out.push_str(
        "| step (from → to) | µs per slow turn | µs per turn, all | extra µs |\n|---|---|---|---|\n",
    );
    for step in slowest
        .steps
        .iter()
        .filter(|step| step.extra_us() >= 1.0)
        .take(SLOW_ROWS)
    {
        out.push_str(&format!(
            "| {} → {} | {:.1} | {:.1} | {:.1} |\n",
            step.from,
            step.to,
            step.slow_us_per_turn,
            step.all_us_per_turn,
            step.extra_us(),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::ProbedFdatasync;
    use cairn_runtime::stages::{SlowStep, Step};

    fn step(from: &'static str, to: &'static str, count: usize, total_us: f64) -> Step {
        Step {
            from,
            to,
            count,
            p50_us: total_us / count as f64,
            total_us,
            thread_changes: 1,
        }
    }

    #[test]
    fn the_table_shows_each_step_per_turn_and_leaves_out_rare_ones() {
        let result = BenchResult {
            setup: "embedded, fjall".into(),
            worker_processes: None,
            sessions: 1,
            model_latency_ms: 0,
            turns: 100,
            turns_per_sec: 100.0,
            p50_ms: 1.0,
            p99_ms: 2.0,
            fdatasync: ProbedFdatasync {
                p50_ms: 0.12,
                before_p50_ms: 0.12,
                after_p50_ms: 0.12,
            },
            commits_per_turn: Some(5.0),
            store_sync_p50_ms: Some(0.14),
            cpu_ms_per_turn: None,
            stages: vec![
                step("sync.start", "sync.end", 500, 70_000.0),
                step("write.submitted", "sync.end", 2, 29_000.0),
                step("sync.end", "append.durable", 500, 1_000.0),
            ],
            slow_turns: None,
        };
        let table = table(&result);
        assert!(
            table.starts_with("embedded, fjall: 100 turns, p50 turn 1.000 ms, marks covering 1.000 ms per turn; p50 fdatasync 0.120 ms, p50 store sync 0.140 ms\n"),
            "{table}"
        );
        assert!(
            table.contains("| sync.start → sync.end | 5.00 | 140.0 µs | 700.0 | 70.0% | 0.01 |"),
            "{table}"
        );
        assert!(
            table.contains("| sync.end → append.durable | 5.00 | 2.0 µs | 10.0 | 1.0% | 0.01 |"),
            "{table}"
        );
        // Twice in 100 turns: left out of the rows, counted in the total.
        assert!(!table.contains("write.submitted"), "{table}");
        assert_eq!(table.lines().count(), 5);
        // In the steps' order, the most time per turn first.
        assert!(table
            .lines()
            .nth(3)
            .unwrap()
            .starts_with("| sync.start → sync.end |"));
    }

    #[test]
    fn the_slowest_turns_table_shows_the_steps_they_spend_more_on() {
        let slow_step = |from, to, slow_us_per_turn, all_us_per_turn| SlowStep {
            from,
            to,
            slow_us_per_turn,
            all_us_per_turn,
        };
        let slowest = SlowTurns {
            quantile: 0.99,
            turns: 1000,
            slow: 10,
            threshold_us: 1_500.0,
            slow_mean_us: 1_800.0,
            all_mean_us: 400.0,
            steps: vec![
                slow_step("sync.start", "sync.end", 1_200.0, 200.0),
                slow_step("append.start", "write.submitted", 40.0, 30.0),
                slow_step("sync.end", "append.durable", 4.5, 4.0),
                slow_step("activity.start", "activity.end", 10.0, 16.0),
            ],
        };
        let table = slow_table(&slowest);
        assert!(
            table.starts_with("\nthe slowest 1% of turns: 10 of 1000 whole turns in the marks, at least 1.500 ms (mean 1.800 ms, against 0.400 ms for all);"),
            "{table}"
        );
        assert!(
            table.contains("| sync.start → sync.end | 1200.0 | 200.0 | 1000.0 |\n| append.start → write.submitted | 40.0 | 30.0 | 10.0 |\n"),
            "{table}"
        );
        // Under 1 µs more, or less: left out.
        assert!(!table.contains("append.durable"), "{table}");
        assert!(!table.contains("activity.end"), "{table}");
        assert_eq!(table.lines().count(), 6);
    }
}
