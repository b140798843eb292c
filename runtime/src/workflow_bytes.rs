//! The estimated bytes a session's folded state holds, kept up to date as events are applied:
//! what bounds the engine's state cache by bytes (`state_cache.rs`).
//!
//! The transcript is most of a long session's state, and it grows only by whole messages,
//! except when compacted. So each event adds the estimate of the messages it appended
//! (`Message::heap_bytes`), and a compaction counts the state again. The tool-use ids the
//! state remembers, its messages' idempotency keys, and the session's start (tool specs,
//! system prompt) are counted too; the rest of the state is small and of fixed size. Keeping
//! the count as events are applied makes it free to read, where counting the transcript at
//! each read would cost a walk of it per step. The count depends on the history alone, so a live state and its replay agree on it.

use super::SessionState;
use crate::event::{Event, SessionStarted};
use crate::idempotency::KeyedMessage;
use cairn_ledger::Message;
use std::mem::size_of;

/// A state with no events: its inline size.
pub(super) const EMPTY_STATE_BYTES: usize = size_of::<SessionState>();

/// What one remembered tool-use id costs: the string's inline size, an id of a typical length
/// (providers' ids run from about 24 to 40 bytes) and its share of the set's tree nodes.
const TOOL_USE_ID_BYTES: usize = size_of::<String>() + 40;

/// What one remembered idempotency key costs beyond its own bytes: the string's inline size,
/// the turn and fingerprint it maps to, and its share of the map's tree nodes.
const MESSAGE_KEY_BYTES: usize = size_of::<String>() + size_of::<KeyedMessage>() + 16;

/// The state's counts before an event, which the bytes it added are measured from.
pub(super) struct BytesMark {
    messages: usize,
    tool_use_ids: usize,
    started: bool,
}

impl SessionState {
    /// The estimated bytes the state holds in memory: its transcript's messages
    /// (`Message::heap_bytes`), the session's tool specs and system prompt, the tool-use ids it
    /// remembers, and its own inline size. Kept as events are applied, so reading it costs
    /// nothing.
    pub fn approx_bytes(&self) -> usize {
        self.bytes
    }

    pub(super) fn bytes_mark(&self) -> BytesMark {
        BytesMark {
            messages: self.transcript.messages.len(),
            tool_use_ids: self.tool_use_ids.len(),
            started: self.started.is_some(),
        }
    }

    /// Adds what the event just applied added to the state, or counts the state again when the
    /// event replaced its transcript.
    pub(super) fn count_bytes(&mut self, before: BytesMark, event: &Event) {
        let messages = &self.transcript.messages;
        if matches!(event, Event::TranscriptCompacted { .. }) || messages.len() < before.messages {
            self.bytes = self.bytes_counted_again();
            return;
        }
        let added: usize = messages[before.messages..]
            .iter()
            .map(Message::heap_bytes)
            .sum();
        let ids = self.tool_use_ids.len().saturating_sub(before.tool_use_ids);
        let started = match (&self.started, before.started) {
            (Some(started), false) => started_bytes(started),
            _ => 0,
        };
        let key = match event {
            Event::UserMessage {
                idempotency_key: Some(key),
                ..
            } => MESSAGE_KEY_BYTES + key.len(),
            _ => 0,
        };
        self.bytes += added + ids * TOOL_USE_ID_BYTES + started + key;
    }

    /// The state's estimate counted from scratch.
    pub(crate) fn bytes_counted_again(&self) -> usize {
        EMPTY_STATE_BYTES
            + self
                .transcript
                .messages
                .iter()
                .map(Message::heap_bytes)
                .sum::<usize>()
            + self.tool_use_ids.len() * TOOL_USE_ID_BYTES
            + self
                .message_keys
                .keys()
                .map(|key| MESSAGE_KEY_BYTES + key.len())
                .sum::<usize>()
            + self.started.as_ref().map_or(0, started_bytes)
    }
}

/// The strings of a session's start: its tool specs and system prompt (the rest is small).
fn started_bytes(started: &SessionStarted) -> usize {
    let tools: usize = started
        .tools
        .iter()
        .map(|tool| {
            size_of::<cairn_ledger::ToolSpec>()
                + tool.name.len()
                + tool.description.len()
                + tool.input_schema.as_str().len()
        })
        .sum();
    size_of::<SessionStarted>() + tools + started.system_prompt.as_ref().map_or(0, String::len)
}
