//! Where the chaos run's power cuts fall: within a child's start or on its work, learning how
//! many operations a start makes from the cuts that missed the work.

use super::SplitMix64;
use crate::powercut::{Cut, FileFate, NameFate};

/// Where the power cuts aim, in operations on the store directory since the child started: every
/// third cut, from the third on, falls uniformly within the start (opening, recovering, resuming),
/// the rest log-uniformly over the work after it, so that the first appends after a recovery are
/// dense and long runs still occur. The share is fixed, not drawn: a run of a few cuts whose draws
/// all fell within the start would test no append (eight cuts on fjall once aimed only two at the
/// work, and both came before the first acknowledgement). How many operations a start makes depends
/// on the engine (fjall's makes hundreds, sled's tens) and grows with what there is to recover, so
/// the aim learns it from the cuts themselves, as the kills learn the time to ready: a cut aimed
/// past the start that still came before the child was ready raises it.
#[derive(Debug, Clone, Copy)]
pub(super) struct CutAim {
    /// Operations a start is believed to make at least.
    startup_ops: u64,
    /// Cuts aimed so far.
    aimed: u64,
}

impl CutAim {
    /// The first guess of a start's operations.
    const FIRST_STARTUP_OPS: u64 = 60;
    /// The cuts aimed at work fall within this many times the start's operations.
    const WORK_SPAN: u64 = 50;
    /// A start's operations are never believed to exceed this.
    const MAX_STARTUP_OPS: u64 = 1_000_000;

    pub(super) fn new() -> CutAim {
        CutAim {
            startup_ops: Self::FIRST_STARTUP_OPS,
            aimed: 0,
        }
    }

    /// A cut, and whether it was aimed past the start.
    pub(super) fn next(&mut self, rng: &mut SplitMix64) -> (Cut, bool) {
        let at_work = self.aimed % 3 != 2;
        self.aimed += 1;
        let after_ops = if at_work {
            let unit = rng.below(1_000_001) as f64 / 1_000_000.0;
            let lo = self.startup_ops as f64;
            (lo * (Self::WORK_SPAN as f64).powf(unit)).round() as u64
        } else {
            1 + rng.below(self.startup_ops)
        };
        let cut = Cut {
            after_ops,
            files: if rng.below(2) == 0 {
                FileFate::Revert
            } else {
                FileFate::Torn
            },
            names: if rng.below(2) == 0 {
                NameFate::Vanish
            } else {
                NameFate::Keep
            },
            seed: rng.next(),
        };
        (cut, at_work)
    }

    /// Learns from a cut aimed past the start that came before the child was ready: the start
    /// makes more operations than believed, at least as many as the cut's.
    pub(super) fn missed_the_work(&mut self, cut: &Cut) {
        self.startup_ops = (self.startup_ops.saturating_mul(3) / 2)
            .max(cut.after_ops)
            .min(Self::MAX_STARTUP_OPS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_within_the_start_or_over_the_work_after_it() {
        let mut rng = SplitMix64(7);
        let mut aim = CutAim::new();
        let (mut at_start, mut at_work) = (0, 0);
        for n in 0..3_000 {
            let (cut, aimed_at_work) = aim.next(&mut rng);
            // The third, sixth, ... cut falls within the start.
            assert_eq!(aimed_at_work, n % 3 != 2, "cut {n}");
            if aimed_at_work {
                at_work += 1;
                assert!((60..=60 * 50).contains(&cut.after_ops), "{cut:?}");
            } else {
                at_start += 1;
                assert!((1..=60).contains(&cut.after_ops), "{cut:?}");
            }
        }
        // Two in three aim at the work.
        assert_eq!((at_work, at_start), (2_000, 1_000));
    }

    #[test]
    fn a_cut_that_missed_the_work_raises_the_start_past_it() {
        let mut aim = CutAim::new();
        let cut = |after_ops| Cut {
            after_ops,
            files: FileFate::Revert,
            names: NameFate::Keep,
            seed: 1,
        };
        // A miss close to the estimate raises it by half; one far past it, to the miss.
        aim.missed_the_work(&cut(61));
        assert_eq!(aim.startup_ops, 90);
        aim.missed_the_work(&cut(312));
        assert_eq!(aim.startup_ops, 312);
        let mut rng = SplitMix64(1);
        for _ in 0..1_000 {
            let (cut, at_work) = aim.next(&mut rng);
            assert!(!at_work || cut.after_ops >= 312, "{cut:?}");
        }
        aim.missed_the_work(&cut(u64::MAX));
        assert_eq!(aim.startup_ops, CutAim::MAX_STARTUP_OPS);
    }
}
