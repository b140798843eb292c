//! Forking a session (`cairn fork`): a new session whose history is a copy of a parent's
//! prefix, cut where no decision is half recorded, that goes on from there. The prefix's
//! model and tool calls are not run again: their results are in the copy. Its first event
//! records the parent and the seq ([`ForkOrigin`]); a fork may take another default model
//! or system prompt.

use crate::error::{Error, Result};
use crate::event::{Event, EventEnvelope, ForkOrigin};
use crate::export::{write_new_session, ImportReport};
use crate::replay::trace;
use crate::store::Store;
use crate::workflow::{Phase, SessionState};
use cairn_ledger::ModelSpec;

/// What to fork.
#[derive(Debug, Clone, PartialEq)]
pub struct ForkRequest {
    /// The parent session.
    pub parent: String,
    /// The last event of the parent the fork copies.
    pub at_seq: u64,
    /// The fork's id.
    pub session_id: String,
    /// Another default model (the running turn's too, when the fork is cut inside one).
    pub model: Option<ModelSpec>,
    /// Another system prompt.
    pub system_prompt: Option<String>,
}

/// The fork's history and its folded state, from the parent's history: refused with
/// `InvalidEvent` (naming the seq and why) when `at_seq` is not in the history, cuts a
/// transition (an input whose decided commands are recorded after it), or would switch a
/// running tool loop to another provider.
pub fn fork_events(
    parent_events: &[EventEnvelope],
    request: &ForkRequest,
) -> Result<(Vec<EventEnvelope>, SessionState)> {
    let refuse = |reason: String| Error::InvalidEvent {
        session_id: request.parent.clone(),
        seq: request.at_seq,
        reason,
    };
    crate::store::check_session_id(&request.session_id)?;
    let last = parent_events.last().map_or(0, |e| e.seq);
    if request.at_seq == 0 || request.at_seq > last {
        return Err(refuse(format!(
            "no event {}: the history holds seqs 1..={last}",
            request.at_seq
        )));
    }
    // A consistent point ends a transition: every command an input decided is recorded.
    let (steps, _) = trace(&request.parent, parent_events);
    for step in &steps {
        let first = step.event.seq;
        let end = first + step.decided.len() as u64;
        if first <= request.at_seq && request.at_seq < end {
            return Err(refuse(format!(
                "seq {} cuts the transition of seq {first} ({}), whose decisions are recorded up to seq {end}: fork at seq {} or {end}",
                request.at_seq,
                step.event.kind,
                first - 1
            )));
        }
    }
    let mut events: Vec<EventEnvelope> = parent_events
        .iter()
        .take_while(|e| e.seq <= request.at_seq)
        .cloned()
        .collect();
    for event in &mut events {
        event.session_id = request.session_id.clone();
    }
    let Some(Event::SessionStarted(started)) = events.first_mut().map(|e| &mut e.event) else {
        return Err(refuse(
            "the history does not begin with session_started".into(),
        ));
    };
    if let Some(model) = &request.model {
        started.model = model.clone();
    }
    if let Some(system_prompt) = &request.system_prompt {
        started.system_prompt = Some(system_prompt.clone());
    }
    started.forked_from = Some(ForkOrigin {
        session_id: request.parent.clone(),
        seq: request.at_seq,
    });
    let parent_state = crate::replay::state_at(&request.parent, parent_events, request.at_seq)?;
    // A turn running at the cut with a model of its own (its message's) takes the new model
    // too, as the session's default does.
    if let (Some(model), Some(active)) = (&request.model, &parent_state.active) {
        let turn_message = events.iter_mut().rev().find_map(|e| match &mut e.event {
            Event::UserMessage {
                turn, model: own, ..
            } if *turn == active.turn => Some(own),
            _ => None,
        });
        if let Some(own @ Some(_)) = turn_message {
            *own = Some(model.clone());
        }
    }
    let state = SessionState::fold(&request.session_id, &events).map_err(|e| {
        let changed: Vec<&str> = [
            request.model.as_ref().map(|_| "model"),
            request.system_prompt.as_ref().map(|_| "system prompt"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if changed.is_empty() {
            return e;
        }
        // A decision of the copied prefix depended on what changed (a compaction decided
        // by the transcript's estimate, which the system prompt is part of, say).
        refuse(format!(
            "with another {}, the copied history no longer replays: {e}; fork before that \
             event, or keep the {}",
            changed.join(" and "),
            changed.join(" and ")
        ))
    })?;
    if let (Some(before), Some(after)) = (&parent_state.active, &state.active) {
        // A tool loop runs inside one provider's conventions: its tool_use ids, and the
        // signed reasoning it must be handed back unmodified mid-loop. Another provider
        // would get the calls without that reasoning.
        let in_loop = before.round > 0 || matches!(before.phase, Phase::Tools(_));
        if in_loop && before.model.provider != after.model.provider {
            return Err(refuse(format!(
                "the running turn {} is inside a tool loop of provider {:?}; switching it to {:?} mid-loop would drop the loop's signed reasoning: fork before the turn's first model answer, or after the turn ended",
                before.turn, before.model.provider, after.model.provider
            )));
        }
    }
    Ok((events, state))
}

/// A fork's id when none is given: `PARENT-fork-SEQ-TIME` (the time in hex ms), the parent's
/// id shortened as needed to keep within the 128 characters an id may have.
pub fn default_fork_id(parent: &str, at_seq: u64, now_ms: u64) -> String {
    let suffix = format!("-fork-{at_seq}-{now_ms:x}");
    let keep = 128usize.saturating_sub(suffix.len());
    // Ids are ASCII (`check_session_id`); a parent that is not keeps its whole characters.
    let mut end = parent.len().min(keep);
    while !parent.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{suffix}", &parent[..end])
}

/// Forks a stored session (see [`fork_events`]) into a new session of the same store, in
/// one atomic append; a fork cut inside a turn gets the tasks that turn waits for, so it goes
/// on. `InvalidEvent` when the fork's id is taken.
pub async fn fork_session(
    store: &dyn Store,
    request: &ForkRequest,
    now_ms: u64,
) -> Result<ImportReport> {
    let parent_events = store.read_history(&request.parent, 1, None).await?;
    let (events, state) = fork_events(&parent_events, request)?;
    write_new_session(store, events, &state, now_ms).await
}

#[cfg(test)]
mod tests {
    use super::{default_fork_id, fork_events, ForkRequest};
    use crate::event::Event;
    use crate::store::check_session_id;
    use crate::workflow_tests::{started, Live, SID};
    use cairn_ledger::ModelSpec;

    /// A fork with another model, cut inside a turn that runs on a model of its own (its
    /// message's), moves that turn to the new model too, as documented.
    #[test]
    fn another_model_reaches_a_running_turn_with_a_model_of_its_own() {
        let mut live = Live::new(started(8));
        live.input(Event::UserMessage {
            idempotency_key: None,
            tool_choice: None,
            turn: 1,
            text: "hi".into(),
            model: Some(ModelSpec::new("scripted", "the-turn's")),
            media: Vec::new(),
        });
        let forked = ModelSpec::new("scripted", "forked");
        let request = ForkRequest {
            parent: SID.into(),
            at_seq: live.events.last().unwrap().seq,
            session_id: "fork".into(),
            model: Some(forked.clone()),
            system_prompt: None,
        };
        let (events, state) = fork_events(&live.events, &request).unwrap();
        assert_eq!(state.active.as_ref().map(|a| &a.model), Some(&forked));
        assert!(events.iter().any(|e| matches!(
            &e.event,
            Event::UserMessage { model: Some(m), .. } if *m == forked
        )));
        assert_eq!(
            live.state.active.as_ref().map(|a| a.model.model.as_str()),
            Some("the-turn's"),
            "the parent is unchanged"
        );
    }

    /// The default id of a fork is a valid id whatever the parent's length.
    #[test]
    fn a_default_fork_id_is_a_valid_id_for_any_parent() {
        assert_eq!(default_fork_id("s1", 7, 255), "s1-fork-7-ff");
        let long = "p".repeat(128);
        let id = default_fork_id(&long, u64::MAX, u64::MAX);
        assert_eq!(id.len(), 128);
        assert!(id.ends_with(&format!("-fork-{}-{:x}", u64::MAX, u64::MAX)));
        check_session_id(&id).unwrap();
    }
}
