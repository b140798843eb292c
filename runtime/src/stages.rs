//! Where a turn's time goes: named points on the path of a turn (the engine, the store's
//! writer, a worker's slot), timed while a recording is on, for `cairn bench --stages`.
//!
//! The path of one session's turn is a chain of steps in series (the workflow's step, the
//! records' encoding, the store writer's checks and commit, the fdatasync, handing the next
//! task, the activity, the report), each of a few µs beside syncs of 0.1 ms, and spread over
//! three crates. Finding which one grew took temporary timers more than once, so the points
//! stay in the code: [`mark`] costs one relaxed atomic load while no recording is on, and
//! [`Recording::start`] turns them on for the whole process. [`steps`] then pairs each mark
//! with the next one, in the order they were taken: at one session in flight that order is
//! the turn's own, step by step. With several sessions in flight their marks interleave and
//! the pairs mean little, so the bench records one session only. [`slowest_turns`] cuts the
//! marks into turns and sets the steps of the slowest ones beside those of all: what a p99
//! turn spends its extra time on, where [`steps`] shows the median one.
//!
//! # The marks, in a turn's order at one session
//!
//! - `turn.sent`: a message reached the engine (`Engine::start_session_and_send_turn`,
//!   `Engine::send_turn`); `turn.outcome`: a waiter got the turn's outcome.
//! - `append.start`: the workflow stepped, its events go to the store; `write.submitted`: the
//!   records are encoded (msgpack, zstd, CRC), the write goes to the writer; fjall's
//!   `write.applied` (checked and staged) and `write.committed` (in its memtables and
//!   journal buffer); `sync.start` and `sync.end`: the store's write and fdatasync;
//!   `append.durable`: the append answered; `append.published`: its tasks handed or woken for,
//!   its waiters told.
//! - `activity.start` and `activity.end`: a worker slot ran a task; `report.start`: its report
//!   reached the engine; `report.handed`: the next tasks leased with it are ready to run;
//!   `activity.reported`: the slot has the report's answer.
//!
//! The recording is one per process (a static): two engines in one process would mix their
//! marks. It holds at most [`MAX_MARKS`] marks and drops the rest, so a recording left on
//! cannot grow without bound.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The most marks one recording keeps (about 20 MB of them); later ones are dropped.
pub const MAX_MARKS: usize = 1 << 20;

/// Whether marks are recorded now.
static RECORDING: AtomicBool = AtomicBool::new(false);
/// The marks taken since the recording started.
static MARKS: Mutex<Vec<Mark>> = Mutex::new(Vec::new());
/// Numbers threads in the order they first took a mark.
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's number in the marks.
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

/// One point reached on a turn's path.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    /// The point: a `&'static` name such as `"sync.start"`.
    pub stage: &'static str,
    /// When it was reached.
    pub at: Instant,
    /// The thread that reached it, numbered in the order threads first took a mark.
    pub thread: u64,
}

/// Records that `stage` was reached now, if a recording is on; else does nothing.
#[inline]
pub fn mark(stage: &'static str) {
    if RECORDING.load(Ordering::Relaxed) {
        record(stage);
    }
}

#[cold]
fn record(stage: &'static str) {
    #[allow(clippy::disallowed_methods)] // timing for a benchmark; never recorded in a history
    let at = Instant::now();
    let thread = THREAD.with(|thread| *thread);
    let mut marks = MARKS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if marks.len() < MAX_MARKS {
        marks.push(Mark { stage, at, thread });
    }
}

/// A recording of marks, on from [`Recording::start`] until [`Recording::finish`] or its drop.
#[derive(Debug)]
pub struct Recording(());

impl Recording {
    /// Starts recording the marks of every thread of this process, dropping any left from
    /// before.
    pub fn start() -> Recording {
        MARKS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
        RECORDING.store(true, Ordering::Relaxed);
        Recording(())
    }

    /// Stops recording; returns the marks taken, in the order they were taken.
    pub fn finish(self) -> Vec<Mark> {
        RECORDING.store(false, Ordering::Relaxed);
        std::mem::take(
            &mut *MARKS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        RECORDING.store(false, Ordering::Relaxed);
    }
}

/// A step between two marks, over all the times it was taken.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The mark it starts at.
    pub from: &'static str,
    /// The mark it ends at (the next one taken).
    pub to: &'static str,
    /// How many times it was taken.
    pub count: usize,
    /// Its median duration, µs.
    pub p50_us: f64,
    /// All its durations added up, µs.
    pub total_us: f64,
    /// How many times its two marks were taken on different threads.
    pub thread_changes: usize,
}

/// The steps between consecutive marks, the most time in all first.
pub fn steps(marks: &[Mark]) -> Vec<Step> {
    let mut by_pair: BTreeMap<(&'static str, &'static str), (Vec<f64>, usize)> = BTreeMap::new();
    for pair in marks.windows(2) {
        let [from, to] = pair else { continue };
        let (durations, changes) = by_pair.entry((from.stage, to.stage)).or_default();
        durations.push(to.at.saturating_duration_since(from.at).as_secs_f64() * 1e6);
        if from.thread != to.thread {
            *changes += 1;
        }
    }
    let mut steps: Vec<Step> = by_pair
        .into_iter()
        .map(|((from, to), (mut durations, thread_changes))| {
            durations.sort_by(f64::total_cmp);
            Step {
                from,
                to,
                count: durations.len(),
                p50_us: durations[durations.len() / 2],
                total_us: durations.iter().sum(),
                thread_changes,
            }
        })
        .collect();
    steps.sort_by(|a, b| b.total_us.total_cmp(&a.total_us));
    steps
}

/// The mark a turn starts at, at one session in flight.
pub const TURN_START: &str = "turn.sent";
/// The mark a turn ends at: its waiter has its outcome.
pub const TURN_END: &str = "turn.outcome";

/// A step's time per turn over the slowest turns, beside its time per turn over all of them.
#[derive(Debug, Clone, PartialEq)]
pub struct SlowStep {
    /// The mark it starts at.
    pub from: &'static str,
    /// The mark it ends at (the next one taken).
    pub to: &'static str,
    /// Its µs per turn over the slowest turns.
    pub slow_us_per_turn: f64,
    /// Its µs per turn over every turn.
    pub all_us_per_turn: f64,
}

impl SlowStep {
    /// What a slow turn spends on it beyond what a turn spends on average, µs.
    pub fn extra_us(&self) -> f64 {
        self.slow_us_per_turn - self.all_us_per_turn
    }
}

/// Where the slowest turns of a recording went, beside all of its turns: a p99 turn's time
/// taken apart, as [`steps`] takes apart the median one.
#[derive(Debug, Clone, PartialEq)]
pub struct SlowTurns {
    /// The quantile of the turns' durations the slow ones reach (0.99: the slowest 1%).
    pub quantile: f64,
    /// The turns the recording holds whole, from [`TURN_START`] to [`TURN_END`].
    pub turns: usize,
    /// How many of them are at or above `threshold_us`.
    pub slow: usize,
    /// That quantile of the turns' durations, µs.
    pub threshold_us: f64,
    /// The slow turns' mean duration, µs.
    pub slow_mean_us: f64,
    /// Every turn's mean duration, µs.
    pub all_mean_us: f64,
    /// The steps the turns took, the most extra time per slow turn first.
    pub steps: Vec<SlowStep>,
}

/// The turns of `marks` (each from a [`TURN_START`] to the next [`TURN_END`]; a turn cut
/// off by the recording's ends is left out) whose duration reaches the `quantile` of all
/// of theirs (0.99: the slowest 1%), and their steps beside every turn's. `None` when the
/// marks hold no whole turn. Meant for one session in flight, as [`steps`] is: with more,
/// other turns' marks fall inside a turn's.
pub fn slowest_turns(marks: &[Mark], quantile: f64) -> Option<SlowTurns> {
    let mut turns: Vec<&[Mark]> = Vec::new();
    let mut start = None;
    for (i, mark) in marks.iter().enumerate() {
        if mark.stage == TURN_START {
            start = Some(i);
        } else if mark.stage == TURN_END {
            if let Some(first) = start.take() {
                turns.push(&marks[first..=i]);
            }
        }
    }
    let duration_us = |turn: &[Mark]| match (turn.first(), turn.last()) {
        (Some(first), Some(last)) => {
            last.at.saturating_duration_since(first.at).as_secs_f64() * 1e6
        }
        _ => 0.0,
    };
    let mut durations: Vec<f64> = turns.iter().map(|turn| duration_us(turn)).collect();
    durations.sort_by(f64::total_cmp);
    let last = durations.len().checked_sub(1)?;
    let threshold_us = durations[((durations.len() as f64 * quantile) as usize).min(last)];
    let mut by_pair: BTreeMap<(&'static str, &'static str), (f64, f64)> = BTreeMap::new();
    let (mut slow, mut slow_total_us) = (0usize, 0.0);
    for turn in &turns {
        let turn_us = duration_us(turn);
        let is_slow = turn_us >= threshold_us;
        if is_slow {
            slow += 1;
            slow_total_us += turn_us;
        }
        for pair in turn.windows(2) {
            let [from, to] = pair else { continue };
            let us = to.at.saturating_duration_since(from.at).as_secs_f64() * 1e6;
            let (slow_us, all_us) = by_pair.entry((from.stage, to.stage)).or_default();
            *all_us += us;
            if is_slow {
                *slow_us += us;
            }
        }
    }
    let all = turns.len() as f64;
    let mut steps: Vec<SlowStep> = by_pair
        .into_iter()
        .map(|((from, to), (slow_us, all_us))| SlowStep {
            from,
            to,
            slow_us_per_turn: slow_us / slow.max(1) as f64,
            all_us_per_turn: all_us / all,
        })
        .collect();
    steps.sort_by(|a, b| b.extra_us().total_cmp(&a.extra_us()));
    Some(SlowTurns {
        quantile,
        turns: turns.len(),
        slow,
        threshold_us,
        slow_mean_us: slow_total_us / slow.max(1) as f64,
        all_mean_us: durations.iter().sum::<f64>() / all,
        steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(base: Instant, us: u64, stage: &'static str, thread: u64) -> Mark {
        Mark {
            stage,
            at: base + Duration::from_micros(us),
            thread,
        }
    }

    #[test]
    #[allow(clippy::disallowed_methods)] // a base instant for made-up marks
    fn steps_pair_each_mark_with_the_next_and_count_thread_changes() {
        let t = Instant::now();
        let marks = [
            at(t, 0, "a", 1),
            at(t, 10, "b", 1),
            at(t, 40, "a", 2),
            at(t, 60, "b", 1),
            at(t, 65, "a", 1),
            at(t, 95, "b", 1),
        ];
        let steps = steps(&marks);
        assert_eq!(steps.len(), 2);
        assert_eq!((steps[0].from, steps[0].to, steps[0].count), ("a", "b", 3));
        // 10, 20 and 30 µs: the median is the middle one, the total all three.
        assert!((steps[0].p50_us - 20.0).abs() < 1e-6, "{:?}", steps[0]);
        assert!((steps[0].total_us - 60.0).abs() < 1e-6, "{:?}", steps[0]);
        assert_eq!(steps[0].thread_changes, 1);
        assert_eq!((steps[1].from, steps[1].to, steps[1].count), ("b", "a", 2));
        assert!((steps[1].total_us - 35.0).abs() < 1e-6, "{:?}", steps[1]);
        assert_eq!(steps[1].thread_changes, 1);
        assert!(super::steps(&marks[..1]).is_empty());
    }

    #[test]
    #[allow(clippy::disallowed_methods)] // a base instant for made-up marks
    fn the_slowest_turns_show_which_step_made_them_slow() {
        let t = Instant::now();
        // Four turns of 100 µs (sync 60, the rest 40) and one of 400 µs whose sync took
        // 300 and whose work took 100; a turn cut off by the recording's end is left out.
        let mut marks = Vec::new();
        let mut now = 0;
        for sync_us in [60, 60, 300, 60, 60] {
            let work_us = if sync_us == 300 { 100 } else { 40 };
            marks.push(at(t, now, TURN_START, 1));
            marks.push(at(t, now + work_us, "sync.start", 1));
            marks.push(at(t, now + work_us + sync_us, TURN_END, 1));
            now += work_us + sync_us + 10;
        }
        marks.push(at(t, now, TURN_START, 1));
        marks.push(at(t, now + 5, "sync.start", 1));
        let slowest = slowest_turns(&marks, 0.99).expect("whole turns");
        assert_eq!((slowest.turns, slowest.slow), (5, 1));
        assert!((slowest.quantile - 0.99).abs() < 1e-12, "{slowest:?}");
        assert!((slowest.threshold_us - 400.0).abs() < 1e-6, "{slowest:?}");
        assert!((slowest.slow_mean_us - 400.0).abs() < 1e-6, "{slowest:?}");
        assert!((slowest.all_mean_us - 160.0).abs() < 1e-6, "{slowest:?}");
        // The sync: 300 µs in the slow turn, (4 × 60 + 300) / 5 = 108 in all; the work 100
        // against (4 × 40 + 100) / 5 = 52. The most extra first.
        assert_eq!(slowest.steps.len(), 2);
        let sync = &slowest.steps[0];
        assert_eq!((sync.from, sync.to), ("sync.start", TURN_END));
        assert!((sync.slow_us_per_turn - 300.0).abs() < 1e-6, "{sync:?}");
        assert!((sync.all_us_per_turn - 108.0).abs() < 1e-6, "{sync:?}");
        assert!((sync.extra_us() - 192.0).abs() < 1e-6, "{sync:?}");
        let work = &slowest.steps[1];
        assert_eq!((work.from, work.to), (TURN_START, "sync.start"));
        assert!((work.extra_us() - 48.0).abs() < 1e-6, "{work:?}");
        // Every turn reaches the median's 100 µs, so at 0.5 all five count as slow.
        assert_eq!(slowest_turns(&marks, 0.5).expect("whole turns").slow, 5);
        assert_eq!(slowest_turns(&marks[..2], 0.99), None);
    }

    #[test]
    fn marks_are_kept_only_while_a_recording_is_on() {
        // The recording is the process's: this is the only test of this crate that starts one.
        mark("before");
        let recording = Recording::start();
        mark("one");
        std::thread::spawn(|| mark("two")).join().expect("thread");
        let marks = recording.finish();
        mark("after");
        // Only this test's own marks: other tests on other threads may take theirs meanwhile.
        let marks: Vec<_> = marks
            .into_iter()
            .filter(|m| ["before", "one", "two", "after"].contains(&m.stage))
            .collect();
        let stages: Vec<_> = marks.iter().map(|m| m.stage).collect();
        assert_eq!(stages, ["one", "two"]);
        assert_ne!(marks[0].thread, marks[1].thread);
        assert!(marks[1].at >= marks[0].at);
        let later = Recording::start().finish();
        assert!(later.iter().all(|m| m.stage != "one" && m.stage != "two"));
    }
}
