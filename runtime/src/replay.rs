//! Replay: re-fold a recorded history with the current code, collecting the commands it decides,
//! and report the first divergence as a typed nondeterminism error naming the event.

use crate::client::describe_state;
use crate::engine::status_of;
use crate::error::Result;
use crate::event::EventEnvelope;
use crate::wire::{OpenToolCall, StateAt};
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
    let mut state = SessionState::folding(session_id);
    let mut commands = Vec::new();
    for envelope in events {
        for command in state.apply(envelope)? {
            commands.push((envelope.seq, command));
        }
    }
    state.folded();
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

/// The state of a session right after its event `seq`: the history folded up to it with the
/// current code. A transition may be cut anywhere (an input whose command events come after
/// `seq`), so the end-of-history check of [`replay`] is not made; what the cut input decided
/// shows as the commands the state still expects. `InvalidEvent` when `seq` is not in the
/// history.
pub fn state_at(session_id: &str, events: &[EventEnvelope], seq: u64) -> Result<SessionState> {
    let last = events.last().map_or(0, |e| e.seq);
    if seq == 0 || seq > last {
        return Err(crate::error::Error::InvalidEvent {
            session_id: session_id.to_owned(),
            seq,
            reason: format!("no event {seq}: the history holds seqs 1..={last}"),
        });
    }
    let mut state = SessionState::folding(session_id);
    for envelope in events.iter().take_while(|e| e.seq <= seq) {
        state.apply(envelope)?;
    }
    state.folded();
    Ok(state)
}

/// The state of a session right after its event `seq`, described: what `cairn show --at SEQ
/// --json` prints and `GET /v1/sessions/{id}/state` answers (see [`state_at`] for the errors).
/// Reads nothing and writes nothing: `events` is the whole history.
pub fn describe_at(session_id: &str, events: &[EventEnvelope], seq: u64) -> Result<StateAt> {
    let state = state_at(session_id, events, seq)?;
    let open_tool_calls = open_tool_calls(&state)
        .into_iter()
        .map(|slot| OpenToolCall {
            tool_use_id: slot.tool_use.id.clone(),
            name: slot.tool_use.name.clone(),
            arguments: slot.tool_use.arguments.clone(),
            attempt: match &slot.state {
                crate::workflow::ToolSlotState::Scheduled { attempt, .. } => Some(*attempt),
                _ => None,
            },
        })
        .collect();
    // The canonical transcript is JSON by construction; a failure here would be a bug in it.
    let transcript = serde_json::from_slice(&state.transcript.canonical_json()).map_err(|e| {
        crate::error::Error::InvalidEvent {
            session_id: session_id.to_owned(),
            seq,
            reason: format!("the transcript at this event is not JSON: {e}"),
        }
    })?;
    Ok(StateAt {
        at_seq: seq,
        of_seqs: events.last().map_or(0, |e| e.seq),
        session: describe_state(&state, status_of(&state)),
        open_tool_calls,
        transcript,
    })
}

/// The tool calls of the running turn's current round that have no result yet.
pub fn open_tool_calls(state: &SessionState) -> Vec<&crate::workflow::ToolSlot> {
    match state.active.as_ref().map(|a| &a.phase) {
        Some(crate::workflow::Phase::Tools(slots)) => slots
            .iter()
            .filter(|slot| !matches!(slot.state, crate::workflow::ToolSlotState::Done(_)))
            .collect(),
        _ => Vec::new(),
    }
}

/// One event of a traced replay, with what the current code decided on it.
#[derive(Debug, Clone)]
pub struct TraceStep<'a> {
    /// The event.
    pub event: &'a EventEnvelope,
    /// For an input event, the commands the current code decides on it (recorded by the
    /// events that follow it); empty for a command event, which is checked against them.
    pub decided: Vec<Command>,
}

/// A replay that keeps every step: each event with the commands the current code decides on
/// it, up to the end or to the first divergence, which is returned beside the steps.
pub fn trace<'a>(
    session_id: &str,
    events: &'a [EventEnvelope],
) -> (Vec<TraceStep<'a>>, Option<crate::error::Error>) {
    let mut state = SessionState::new(session_id);
    let mut steps = Vec::with_capacity(events.len());
    for event in events {
        match state.apply(event) {
            Ok(decided) => steps.push(TraceStep { event, decided }),
            Err(e) => return (steps, Some(e)),
        }
    }
    (steps, state.finish_replay().err())
}
