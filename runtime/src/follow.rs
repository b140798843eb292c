//! Following one session live as typed events ([`SessionEvent`]): the history events a program
//! usually reacts to — messages, model answers, tool calls and their results, turn outcomes —
//! and the model's streamed deltas, read from a [`Client::subscribe`](crate::Client::subscribe)
//! stream, so the same API works in process and through a server.
//!
//! # What is guaranteed
//!
//! Every history event of the session after the starting point is delivered exactly once, in
//! seq order, however slowly the caller reads: an in-process stream that falls behind the
//! engine's broadcast reads the missed events back from the store by seq (see
//! [`Follower`](crate::client::Follower)), and a stream through a server reconnects with
//! `Last-Event-ID`. Deltas are presentation only: they are never stored, so a reader that falls
//! behind may miss some; the model's answer in [`SessionEvent::ModelAnswered`] is always whole.

use crate::budget::UsageTotals;
use crate::client::EventStream;
use crate::engine::DeltaEvent;
use crate::error::Result;
use crate::event::{ActivityFailure, Event, EventEnvelope};
use crate::wire::StreamEvent;
use crate::workflow::TurnOutcome;
use cairn_ledger::{ModelResponse, ToolResultContent};
use std::collections::BTreeMap;

/// One thing that happened in a followed session.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum SessionEvent {
    /// A fragment of a model call's streamed output (text, thinking or tool arguments).
    /// Presentation only: a reader that falls behind may miss some.
    Delta(DeltaEvent),
    /// A person's message started turn `turn`.
    UserMessage {
        /// The event's seq.
        seq: u64,
        /// The turn it started.
        turn: u32,
        /// The message.
        text: String,
    },
    /// A model call was scheduled; a worker will run it.
    ModelCallScheduled {
        /// The event's seq.
        seq: u64,
        /// Turn.
        turn: u32,
        /// Model call index within the turn, from 0.
        round: u32,
        /// Attempt, from 1.
        attempt: u32,
    },
    /// The model answered (its whole response: text, thinking and tool calls).
    ModelAnswered {
        /// The event's seq.
        seq: u64,
        /// Turn.
        turn: u32,
        /// Round.
        round: u32,
        /// The response.
        response: ModelResponse,
    },
    /// A model call attempt failed (it may be retried).
    ModelCallFailed {
        /// The event's seq.
        seq: u64,
        /// Turn.
        turn: u32,
        /// Round.
        round: u32,
        /// The failed attempt.
        attempt: u32,
        /// What went wrong.
        failure: ActivityFailure,
    },
    /// A tool call was scheduled; a worker will run it.
    ToolCallScheduled {
        /// The event's seq.
        seq: u64,
        /// Turn.
        turn: u32,
        /// The tool_use it answers.
        tool_use_id: String,
        /// The tool.
        name: String,
        /// Attempt, from 1.
        attempt: u32,
    },
    /// A tool call returned: its result, which the model sees next.
    ToolResult {
        /// The event's seq.
        seq: u64,
        /// Turn.
        turn: u32,
        /// The tool_use answered.
        tool_use_id: String,
        /// The tool, when this stream saw its call scheduled (a call answered at once, such
        /// as one to an unknown tool, has no scheduled event).
        name: Option<String>,
        /// The result.
        content: ToolResultContent,
        /// Whether the result describes a failure.
        is_error: bool,
    },
    /// A tool call attempt failed (it may be retried).
    ToolCallFailed {
        /// The event's seq.
        seq: u64,
        /// Turn.
        turn: u32,
        /// The tool_use concerned.
        tool_use_id: String,
        /// The failed attempt.
        attempt: u32,
        /// What went wrong.
        failure: ActivityFailure,
    },
    /// A turn ended: completed (with the model's final text), failed or cancelled.
    TurnEnded {
        /// The event's seq.
        seq: u64,
        /// How it ended.
        outcome: TurnOutcome,
    },
    /// The session was cancelled; it takes no further turns.
    SessionCancelled {
        /// The event's seq.
        seq: u64,
        /// Why.
        reason: String,
    },
    /// Any other history event (the session's start, streamed-progress records, and kinds
    /// added later), as stored (boxed: an envelope is large).
    Other(Box<EventEnvelope>),
}

impl SessionEvent {
    /// The seq of the history event; `None` for a delta.
    pub fn seq(&self) -> Option<u64> {
        match self {
            SessionEvent::Delta(_) => None,
            SessionEvent::UserMessage { seq, .. }
            | SessionEvent::ModelCallScheduled { seq, .. }
            | SessionEvent::ModelAnswered { seq, .. }
            | SessionEvent::ModelCallFailed { seq, .. }
            | SessionEvent::ToolCallScheduled { seq, .. }
            | SessionEvent::ToolResult { seq, .. }
            | SessionEvent::ToolCallFailed { seq, .. }
            | SessionEvent::TurnEnded { seq, .. }
            | SessionEvent::SessionCancelled { seq, .. } => Some(*seq),
            SessionEvent::Other(envelope) => Some(envelope.seq),
        }
    }
}

/// A session's live [`SessionEvent`]s (from [`Client::follow`](crate::Client::follow)).
pub struct SessionEvents {
    stream: EventStream,
    reader: EventReader,
}

impl SessionEvents {
    /// Typed events of `stream`; `seen` are the session's events up to the stream's start
    /// (they name tools and give answers that later events refer to).
    pub fn new(stream: EventStream, seen: &[EventEnvelope]) -> Self {
        let mut reader = EventReader::default();
        for envelope in seen {
            reader.read(envelope.clone());
        }
        SessionEvents { stream, reader }
    }

    /// The next event; `None` when the stream ended (the engine or connection is gone).
    pub async fn next(&mut self) -> Option<Result<SessionEvent>> {
        Some(self.stream.next().await?.map(|event| match event {
            StreamEvent::Delta(delta) => SessionEvent::Delta(delta),
            StreamEvent::Event(envelope) => self.reader.read(envelope),
        }))
    }
}

/// Turns history events into [`SessionEvent`]s, remembering what later events refer to: the
/// names of scheduled tools and each turn's last model text (a completed turn's answer).
#[derive(Debug, Default)]
struct EventReader {
    tool_names: BTreeMap<String, String>,
    last_text: BTreeMap<u32, String>,
    /// Each running turn's totals and last stop reason, from the events read. Usage that only
    /// a lost run's progress reported is not among them (the session's fold counts it).
    turn_totals: BTreeMap<u32, (UsageTotals, Option<cairn_ledger::StopReason>)>,
}

impl EventReader {
    fn read(&mut self, envelope: EventEnvelope) -> SessionEvent {
        let seq = envelope.seq;
        match envelope.event {
            Event::UserMessage { turn, text, .. } => SessionEvent::UserMessage { seq, turn, text },
            Event::ModelCallScheduled {
                turn,
                round,
                attempt,
                ..
            } => {
                self.turn_totals.entry(turn).or_default().0.model_calls += 1;
                SessionEvent::ModelCallScheduled {
                    seq,
                    turn,
                    round,
                    attempt,
                }
            }
            Event::ModelCallCompleted {
                turn,
                round,
                response,
                cost_micros,
                ..
            } => {
                let totals = self.turn_totals.entry(turn).or_default();
                totals.0.add_attempt(&response.usage, cost_micros);
                totals.1 = Some(response.stop_reason);
                self.last_text.insert(turn, response.text());
                SessionEvent::ModelAnswered {
                    seq,
                    turn,
                    round,
                    response,
                }
            }
            Event::ModelCallFailed {
                turn,
                round,
                attempt,
                failure,
                cost_micros,
            } => {
                if let Some(usage) = &failure.usage {
                    let totals = self.turn_totals.entry(turn).or_default();
                    totals.0.add_attempt(usage, cost_micros);
                }
                SessionEvent::ModelCallFailed {
                    seq,
                    turn,
                    round,
                    attempt,
                    failure,
                }
            }
            Event::ToolCallScheduled {
                turn,
                tool_use_id,
                name,
                attempt,
                ..
            } => {
                self.tool_names.insert(tool_use_id.clone(), name.clone());
                SessionEvent::ToolCallScheduled {
                    seq,
                    turn,
                    tool_use_id,
                    name,
                    attempt,
                }
            }
            Event::ToolCallCompleted {
                turn,
                tool_use_id,
                content,
                is_error,
                ..
            } => SessionEvent::ToolResult {
                seq,
                turn,
                name: self.tool_names.get(&tool_use_id).cloned(),
                tool_use_id,
                content,
                is_error,
            },
            Event::ToolCallFailed {
                turn,
                tool_use_id,
                attempt,
                failure,
            } => SessionEvent::ToolCallFailed {
                seq,
                turn,
                tool_use_id,
                attempt,
                failure,
            },
            Event::TurnCompleted { turn, .. } => {
                let (totals, stop_reason) = self.turn_totals.remove(&turn).unwrap_or_default();
                SessionEvent::TurnEnded {
                    seq,
                    outcome: TurnOutcome::Completed {
                        turn,
                        // The workflow's answer is the last model message's text, as here.
                        answer: self.last_text.remove(&turn).unwrap_or_default(),
                        stop_reason,
                        totals,
                    },
                }
            }
            Event::TurnFailed {
                turn,
                reason,
                budget_exceeded,
            } => SessionEvent::TurnEnded {
                seq,
                outcome: TurnOutcome::Failed {
                    turn,
                    reason,
                    budget_exceeded,
                    totals: self.turn_totals.remove(&turn).unwrap_or_default().0,
                },
            },
            Event::TurnCancelled { turn, reason } => SessionEvent::TurnEnded {
                seq,
                outcome: TurnOutcome::Cancelled {
                    turn,
                    reason,
                    totals: self.turn_totals.remove(&turn).unwrap_or_default().0,
                },
            },
            Event::SessionCancelled { reason } => SessionEvent::SessionCancelled { seq, reason },
            event => SessionEvent::Other(Box::new(EventEnvelope { event, ..envelope })),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::client::{follow, SessionOptions};
    use crate::error::Result;
    use crate::event::Event;
    use crate::wire::StreamEvent;
    use crate::{Engine, MemoryStore, SystemClock};
    use cairn_ledger::ModelSpec;
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::time::Duration;

    /// More appends than the engine's broadcast keeps (4096), so an idle follower lags.
    const OTHER_SESSIONS: usize = 4_200;

    #[tokio::test]
    async fn a_follower_that_fell_behind_gets_every_event_once_in_order() -> Result<()> {
        let engine = Engine::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock));
        let options = SessionOptions::new(ModelSpec::new("scripted", "none"), Vec::new());
        engine
            .start_session(Some("followed".into()), options.started())
            .await?;
        let mut follower = follow(engine.clone(), "followed".into(), 0);
        // Nothing reads the follower while the session's own events and thousands of
        // others' pass through the broadcast: its receiver lags past them.
        engine.send_message("followed", "hello", None).await?;
        for i in 0..OTHER_SESSIONS {
            engine
                .start_session(Some(format!("other-{i}")), options.started())
                .await?;
        }
        engine.cancel("followed", "done").await?;

        let mut backlog = VecDeque::new();
        let mut delivered = Vec::new();
        while !matches!(delivered.last(), Some((_, Event::SessionCancelled { .. }))) {
            let step = tokio::time::timeout(Duration::from_secs(10), follower.next(&mut backlog))
                .await
                .expect("the follower delivers the session's events");
            step.expect("the engine is alive")?;
            while let Some(event) = backlog.pop_front() {
                if let StreamEvent::Event(envelope) = event {
                    delivered.push((envelope.seq, envelope.event));
                }
            }
        }
        let history = engine.store().read_history("followed", 1, None).await?;
        let expected: Vec<(u64, Event)> = history.into_iter().map(|e| (e.seq, e.event)).collect();
        assert!(expected.len() >= 4, "{expected:?}");
        assert_eq!(delivered, expected, "every event once, in order");
        Ok(())
    }
}
