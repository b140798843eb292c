//! How long an embedded store's syncs took: a histogram the store's writer records each sync
//! into, so that `cairn bench` can set the store's own p50 sync beside the fdatasync probe's.
//!
//! The probe times the cheapest durable write there is (an 8 KiB overwrite in place); a
//! store's sync appends to its journal and runs among the rest of the turn's work. Whether a
//! turn's time beyond its syncs goes to the syncs themselves or to the work between them
//! shows only with both figures from the same run.

use hdrhistogram::Histogram;
use std::time::Duration;

/// The longest sync a histogram holds apart: a minute, in microseconds. A longer one counts
/// as a minute.
const LONGEST_US: u64 = 60_000_000;

/// Sync times in microseconds, from 1 µs to a minute, to two significant digits.
#[derive(Clone, Debug)]
pub struct SyncTimes(Histogram<u64>);

impl Default for SyncTimes {
    fn default() -> Self {
        SyncTimes::new()
    }
}

impl SyncTimes {
    /// No syncs yet.
    pub fn new() -> SyncTimes {
        // Constant bounds that hdrhistogram accepts (low ≥ 1, high ≥ 2·low, sigfig ≤ 5).
        let histogram = Histogram::new_with_bounds(1, LONGEST_US, 2)
            .unwrap_or_else(|e| unreachable!("constant histogram bounds: {e}"));
        SyncTimes(histogram)
    }

    /// Counts one sync that took `took`.
    pub fn record(&mut self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.0.saturating_record(us.clamp(1, LONGEST_US));
    }

    /// How many syncs are counted.
    pub fn count(&self) -> u64 {
        self.0.len()
    }

    /// The syncs counted here and not in `earlier`, an earlier reading of the same store;
    /// `None` when `earlier` holds a sync this one does not (not an earlier reading).
    pub fn since(&self, earlier: &SyncTimes) -> Option<SyncTimes> {
        let mut later = self.0.clone();
        later.subtract(&earlier.0).ok()?;
        Some(SyncTimes(later))
    }

    /// The sync time at quantile `q` (0.5 for the median, 1.0 for the slowest), in
    /// microseconds; `None` when no sync is counted.
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        (!self.0.is_empty()).then(|| self.0.value_at_quantile(q))
    }

    /// [`quantile_us`](Self::quantile_us) in milliseconds.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        self.quantile_us(q).map(|us| us as f64 / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within the histogram's two significant digits of `expected` ms.
    fn about(value: Option<f64>, expected: f64) -> bool {
        value.is_some_and(|ms| (ms - expected).abs() <= expected / 100.0)
    }

    #[test]
    fn quantiles_and_differences_come_from_what_was_recorded() {
        let mut times = SyncTimes::new();
        assert_eq!(times.quantile_ms(0.5), None);
        for us in [100, 110, 120, 130, 5_000] {
            times.record(Duration::from_micros(us));
        }
        let earlier = times.clone();
        assert_eq!(times.count(), 5);
        assert!(about(times.quantile_ms(0.5), 0.12));
        assert!(about(times.quantile_ms(1.0), 5.0));
        for _ in 0..3 {
            times.record(Duration::from_micros(2_000));
        }
        let window = times.since(&earlier).expect("an earlier reading");
        assert_eq!(window.count(), 3);
        assert!(about(window.quantile_ms(0.5), 2.0));
        assert!(
            earlier.since(&times).is_none(),
            "a later reading is not an earlier one"
        );
        // Out of range both ways: counted at the bounds, never refused.
        times.record(Duration::ZERO);
        times.record(Duration::from_secs(3_600));
        assert_eq!(times.count(), 10);
        assert!(about(times.quantile_ms(1.0), 60_000.0));
    }
}
