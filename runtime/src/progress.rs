//! Streamed output read back from `model_attempt_progress` records: what a person already saw of
//! a model answer that a crash (or a failed attempt) cut off, so a re-run can say so.
//!
//! Pure: it reads a history and a folded state, nothing else.

use crate::event::{Event, EventEnvelope};
use crate::workflow::{Phase, SessionState};

/// What one run of a model attempt (one task lease of it) streamed, as its records hold it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamedOutput {
    /// Turn.
    pub turn: u32,
    /// Round (model call index within the turn).
    pub round: u32,
    /// The attempt.
    pub attempt: u32,
    /// The task lease that ran it.
    pub lease_attempt: u32,
    /// Visible text, in stream order.
    pub text: String,
    /// Reasoning text, in stream order.
    pub thinking: String,
    /// How many progress records it took.
    pub records: usize,
}

/// Every run's recorded output of model call (turn, round), in the order the runs began.
pub fn streamed_outputs(history: &[EventEnvelope], turn: u32, round: u32) -> Vec<StreamedOutput> {
    let mut runs: Vec<StreamedOutput> = Vec::new();
    for envelope in history {
        let Event::ModelAttemptProgress {
            turn: t,
            round: r,
            attempt,
            lease_attempt,
            text_appended,
            thinking_appended,
            ..
        } = &envelope.event
        else {
            continue;
        };
        if (*t, *r) != (turn, round) {
            continue;
        }
        let index = match runs
            .iter()
            .position(|o| (o.attempt, o.lease_attempt) == (*attempt, *lease_attempt))
        {
            Some(index) => index,
            None => {
                runs.push(StreamedOutput {
                    turn,
                    round,
                    attempt: *attempt,
                    lease_attempt: *lease_attempt,
                    ..StreamedOutput::default()
                });
                runs.len() - 1
            }
        };
        let run = &mut runs[index];
        run.text.push_str(text_appended);
        run.thinking.push_str(thinking_appended);
        run.records += 1;
    }
    runs
}

/// The output that the model call the running turn waits for had streamed when it was cut
/// off: the latest run's, when that call is about to run again (after a crash, or as the retry
/// of a failed attempt). `None` when no turn waits for a model call or nothing was recorded.
pub fn interrupted_output(
    state: &SessionState,
    history: &[EventEnvelope],
) -> Option<StreamedOutput> {
    let active = state.active.as_ref()?;
    if !matches!(active.phase, Phase::Model(_)) {
        return None;
    }
    streamed_outputs(history, active.turn, active.round)
        .into_iter()
        .max_by_key(|o| (o.attempt, o.lease_attempt))
}
