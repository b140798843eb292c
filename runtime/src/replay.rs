//! Replay: re-fold a recorded history with the current code, collecting the commands it decides,
//! and report the first divergence as a typed nondeterminism error naming the event.

use crate::error::Result;
use crate::event::EventEnvelope;
use crate::workflow::{Command, SessionState};

/// The result of a replay.
#[derive(Debug, Clone)]
pub struct Replay {
    /// The folded state (its transcript is the ledger).
    pub state: SessionState,
    /// Every command the workflow decided, with the seq of the input that caused it.
    pub commands: Vec<(u64, Command)>,
}

/// Replays a whole history. Fails with `Nondeterminism` at the first recorded decision that the
/// current code does not make, and with `InvalidEvent` (or `StaleReport`, for a report it no
/// longer waits for) at an event it cannot accept.
pub fn replay(session_id: &str, events: &[EventEnvelope]) -> Result<Replay> {
    let mut state = SessionState::new(session_id);
    let mut commands = Vec::new();
    for envelope in events {
        for command in state.apply(envelope)? {
            commands.push((envelope.seq, command));
        }
    }
    state.finish_replay()?;
    Ok(Replay { state, commands })
}

/// Replays events one by one, for step-through debugging: yields the state after each event.
pub fn step_through<'a>(
    session_id: &str,
    events: &'a [EventEnvelope],
) -> impl Iterator<Item = Result<(&'a EventEnvelope, SessionState)>> + 'a {
    let mut state = SessionState::new(session_id);
    let mut failed = false;
    events.iter().filter_map(move |envelope| {
        if failed {
            return None;
        }
        match state.apply(envelope) {
            Ok(_) => Some(Ok((envelope, state.clone()))),
            Err(e) => {
                failed = true;
                Some(Err(e))
            }
        }
    })
}
