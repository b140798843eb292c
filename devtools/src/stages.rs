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
//! thread, or the trip to the store's writer thread).

use crate::bench::{self, BenchConfig, BenchResult};
use cairn_runtime::store::embedded::StorageEngine;

/// Measures one session's turns on a new `engine` store for `seconds`, recording the marks.
pub async fn measure(seconds: f64, engine: StorageEngine) -> anyhow::Result<BenchResult> {
    let config = BenchConfig {
        sessions: 1,
        seconds,
        model_latency_ms: 0,
        worker_concurrency: 16,
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
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::ProbedFdatasync;
    use cairn_runtime::stages::Step;

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
}
