//! A semantic diff of two sessions (`cairn diff A B`): where their histories part, how their
//! transcripts differ message by message and part by part, and how their usage differs.
//! Typical use: a fork with another model against its parent.

use crate::error::Result;
use crate::event::{Event, EventEnvelope, SessionStarted};
use crate::replay::replay;
use cairn_ledger::{Message, Part, Usage};
use serde::Serialize;

/// Where two histories part.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Parting {
    /// The first seq at which the events differ (by kind and content; the session id and the
    /// time recorded do not count, nor a fork's origin).
    pub seq: u64,
    /// The event of A there (its kind), if A has one.
    pub a: Option<String>,
    /// The event of B there, if B has one.
    pub b: Option<String>,
}

/// How one message differs.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum MessageDiff {
    /// Only A has it.
    OnlyInA {
        /// Its index.
        index: usize,
        /// Its role and parts, as JSON.
        message: serde_json::Value,
    },
    /// Only B has it.
    OnlyInB {
        /// Its index.
        index: usize,
        /// Its role and parts, as JSON.
        message: serde_json::Value,
    },
    /// Both have one here, and they differ.
    Changed {
        /// Its index.
        index: usize,
        /// The roles, when they differ.
        roles: Option<(String, String)>,
        /// The parts that differ: (part index, A's part, B's part), a missing part as null.
        parts: Vec<(usize, serde_json::Value, serde_json::Value)>,
    },
}

/// The usage of each session and B's minus A's, per kind of token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UsageDiff {
    /// A's usage.
    pub a: Usage,
    /// B's usage.
    pub b: Usage,
    /// B minus A: input, output, cache read, cache write, reasoning tokens.
    pub delta: [i128; 5],
}

/// A semantic diff of two sessions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionDiff {
    /// Session A.
    pub a: String,
    /// Session B.
    pub b: String,
    /// Where the histories part; `None` when they hold the same events.
    pub parting: Option<Parting>,
    /// How the sessions' first events differ in configuration: the names of the
    /// `session_started` fields that differ (`model`, `system_prompt`, `tools`, `limits`,
    /// `tool_policy`, `call_options`, ...), in alphabetical order; a fork's origin does not
    /// count.
    pub config: Vec<String>,
    /// Messages equal from the start before the first difference.
    pub common_messages: usize,
    /// The differing messages, in order.
    pub messages: Vec<MessageDiff>,
    /// Usage.
    pub usage: UsageDiff,
}

/// Diffs two whole histories (each replayed with the current code).
pub fn diff_sessions(
    a_id: &str,
    a: &[EventEnvelope],
    b_id: &str,
    b: &[EventEnvelope],
) -> Result<SessionDiff> {
    let (state_a, state_b) = (replay(a_id, a)?.state, replay(b_id, b)?.state);
    let config = match (&state_a.started, &state_b.started) {
        (Some(sa), Some(sb)) => config_differences(sa, sb),
        _ => Vec::new(),
    };
    let same = |x: &EventEnvelope, y: &EventEnvelope| match (&x.event, &y.event) {
        // The configuration is reported on its own; the start itself is common.
        (Event::SessionStarted(_), Event::SessionStarted(_)) => true,
        (ex, ey) => ex == ey,
    };
    let parting = (0..a.len().max(b.len()))
        .find(|&i| match (a.get(i), b.get(i)) {
            (Some(x), Some(y)) => !same(x, y),
            _ => true,
        })
        .map(|i| Parting {
            seq: i as u64 + 1,
            a: a.get(i).map(|e| e.kind.clone()),
            b: b.get(i).map(|e| e.kind.clone()),
        });
    let (ma, mb) = (&state_a.transcript.messages, &state_b.transcript.messages);
    let common_messages = ma.iter().zip(mb).take_while(|(x, y)| x == y).count();
    let mut messages = Vec::new();
    for index in common_messages..ma.len().max(mb.len()) {
        match (ma.get(index), mb.get(index)) {
            (Some(x), Some(y)) if x == y => {}
            (Some(x), Some(y)) => messages.push(changed(index, x, y)),
            (Some(x), None) => messages.push(MessageDiff::OnlyInA {
                index,
                message: to_json(x),
            }),
            (None, Some(y)) => messages.push(MessageDiff::OnlyInB {
                index,
                message: to_json(y),
            }),
            (None, None) => {}
        }
    }
    let (ua, ub) = (state_a.usage, state_b.usage);
    let fields = |u: &Usage| {
        [
            u.input_tokens,
            u.output_tokens,
            u.cache_read_tokens,
            u.cache_write_tokens,
            u.reasoning_tokens,
        ]
    };
    let (fa, fb) = (fields(&ua), fields(&ub));
    let delta = std::array::from_fn(|i| i128::from(fb[i]) - i128::from(fa[i]));
    Ok(SessionDiff {
        a: a_id.to_owned(),
        b: b_id.to_owned(),
        parting,
        config,
        common_messages,
        messages,
        usage: UsageDiff {
            a: ua,
            b: ub,
            delta,
        },
    })
}

/// The names of the fields in which two sessions' first events differ: every field of the
/// configuration, one added later too, except the fork origin (a fork has one, its parent
/// not). A field left out of one record (its default) and set in the other differs.
fn config_differences(a: &SessionStarted, b: &SessionStarted) -> Vec<String> {
    let fields = |started: &SessionStarted| match serde_json::to_value(started) {
        Ok(serde_json::Value::Object(mut fields)) => {
            fields.remove("forked_from");
            Some(fields)
        }
        _ => None,
    };
    let (Some(fa), Some(fb)) = (fields(a), fields(b)) else {
        // Not representable as JSON fields (never for the records cairn writes): whole.
        let mut a = a.clone();
        a.forked_from.clone_from(&b.forked_from);
        return if a == *b {
            Vec::new()
        } else {
            vec!["session_started".to_owned()]
        };
    };
    let names: std::collections::BTreeSet<&String> = fa.keys().chain(fb.keys()).collect();
    names
        .into_iter()
        .filter(|name| fa.get(*name) != fb.get(*name))
        .cloned()
        .collect()
}

fn changed(index: usize, x: &Message, y: &Message) -> MessageDiff {
    let roles = (x.role != y.role).then(|| (role(x), role(y)));
    let parts = (0..x.parts.len().max(y.parts.len()))
        .filter_map(|i| {
            let (px, py) = (x.parts.get(i), y.parts.get(i));
            (px != py).then(|| (i, part_json(px), part_json(py)))
        })
        .collect();
    MessageDiff::Changed {
        index,
        roles,
        parts,
    }
}

fn role(message: &Message) -> String {
    to_json(&message.role).as_str().unwrap_or("?").to_owned()
}

fn part_json(part: Option<&Part>) -> serde_json::Value {
    part.map_or(serde_json::Value::Null, to_json)
}

fn to_json(value: &impl Serialize) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ForkOrigin;
    use crate::workflow_tests::{started, SID};

    fn history(started: SessionStarted) -> Vec<EventEnvelope> {
        vec![EventEnvelope::new(
            SID,
            1,
            1_000,
            Event::SessionStarted(started),
        )]
    }

    fn diff(a: SessionStarted, b: SessionStarted) -> SessionDiff {
        diff_sessions(SID, &history(a), SID, &history(b)).unwrap()
    }

    /// Any field of the configuration that differs is named, not only the model, prompt,
    /// tools and limits; a fork's origin is not a difference.
    #[test]
    fn every_configuration_field_that_differs_is_named() {
        let a = started(8);
        let mut b = started(8);
        b.forked_from = Some(ForkOrigin {
            session_id: "parent".into(),
            seq: 1,
        });
        let same = diff(a.clone(), b.clone());
        assert_eq!((same.parting, same.config), (None, Vec::<String>::new()));

        b.model_retry.maximum_attempts += 1;
        b.workdir = Some("/elsewhere".into());
        let differs = diff(a, b);
        assert_eq!(differs.config, ["model_retry", "workdir"]);
        assert_eq!(differs.parting, None, "the start itself is common");
    }
}
