//! Transcript compaction as pure functions: each strategy, the size estimate, and [`compact`],
//! which the workflow runs both when it decides a compaction and when it folds the recorded
//! `transcript_compacted` event, so the compacted transcript is a function of the history.
//!
//! Every strategy touches only *completed* turns — the messages before the user message that
//! starts the last turn ([`current_turn_start`]) — so the current tool loop (its thinking
//! blocks, its tool_use/tool_result pairs) always goes out unmodified. On a valid transcript
//! each strategy yields a valid transcript: reasoning parts are dropped whole or kept
//! byte-identical, a failed tool result keeps its pair (only its content is replaced by a
//! note), and a cut falls only on a user text message that starts a turn, which never sits
//! between a tool_use and its result.

use crate::media::Media;
use crate::transcript::{Message, Part, Role, ToolResultContent, Transcript};
use serde::{Deserialize, Serialize};

/// The text a failed tool result of a completed turn is replaced by.
pub const FAILED_RESULT_NOTE: &str = "[failed tool result removed by compaction]";

/// The heading of the summary text put in front of the first kept user message.
pub const SUMMARY_HEADING: &str = "[Summary of the earlier conversation]";

/// One way of shrinking a transcript, applied to completed turns only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompactionStrategy {
    /// Drop every reasoning part (thinking, redacted thinking, reasoning text and items) of
    /// completed turns. Providers allow it: thinking of earlier turns may be omitted.
    DropReasoning,
    /// Replace the content of every `is_error` tool result of completed turns by
    /// [`FAILED_RESULT_NOTE`]; the result stays, so its tool_use keeps its answer.
    DropFailedToolResults,
    /// Keep only the last `keep_last_turns` turns (the current one counts), cutting at the
    /// user message that starts a turn; system messages stay. With a summary, the summary
    /// goes in front of the first kept user message.
    KeepLastTurns,
}

impl CompactionStrategy {
    /// The snake_case name, as recorded and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            CompactionStrategy::DropReasoning => "drop_reasoning",
            CompactionStrategy::DropFailedToolResults => "drop_failed_tool_results",
            CompactionStrategy::KeepLastTurns => "keep_last_turns",
        }
    }
}

/// Estimated tokens of a transcript: its canonical JSON bytes divided by four, rounded up.
///
/// A deliberately provider-free rule of thumb (English text runs at about four bytes per
/// token, JSON structure a little more), so the estimate is a pure function of the transcript
/// and the same on every replay. Thresholds should leave headroom for the tool definitions
/// and the system prompt rendering, which the provider adds. Base64 media data is not text a
/// model reads: each image or document counts [`MEDIA_TOKEN_ESTIMATE`] tokens instead of its
/// bytes.
pub fn estimate_tokens(transcript: &Transcript) -> u64 {
    let mut media_bytes = 0usize;
    let mut media_count = 0u64;
    for message in &transcript.messages {
        for part in &message.parts {
            let media: Vec<&Media> = match part {
                Part::Media(m) => vec![m],
                Part::ToolResult(r) => r.content.media(),
                _ => Vec::new(),
            };
            for m in media {
                media_bytes += m.data_len();
                media_count += 1;
            }
        }
    }
    let text_bytes = transcript
        .canonical_json()
        .len()
        .saturating_sub(media_bytes);
    (text_bytes as u64).div_ceil(4) + media_count * MEDIA_TOKEN_ESTIMATE
}

/// Tokens one image or document counts for in [`estimate_tokens`]: Anthropic's documented
/// cost of an image at its largest unscaled size (about 1,600 tokens).
pub const MEDIA_TOKEN_ESTIMATE: u64 = 1600;

/// Whether a message starts a turn: a user message that carries no tool result (the person's
/// text, as opposed to the results of a tool round).
pub fn starts_turn(message: &Message) -> bool {
    message.role == Role::User
        && !message
            .parts
            .iter()
            .any(|p| matches!(p, Part::ToolResult(_)))
}

/// The indices of the messages that start a turn, oldest first.
pub fn turn_starts(transcript: &Transcript) -> Vec<usize> {
    transcript
        .messages
        .iter()
        .enumerate()
        .filter(|(_, m)| starts_turn(m))
        .map(|(i, _)| i)
        .collect()
}

/// The index of the message that starts the last (current) turn; messages before it belong
/// to completed turns. `None` when no turn started yet (nothing is completed either).
pub fn current_turn_start(transcript: &Transcript) -> Option<usize> {
    // From the end: a worker asks this before every model call of a long session.
    transcript.messages.iter().rposition(starts_turn)
}

/// Which rules [`compact`]'s strategies follow. A history is folded by the rules it was
/// recorded by, so a rule, once used, stays; the workflow picks them by the session's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompactionRules {
    /// The first rules.
    #[default]
    First,
    /// [`CompactionStrategy::DropReasoning`] keeps the reasoning of the transcript's last
    /// assistant message when it holds tool calls: a turn that ended on its tool results (cut
    /// by its round limit, a budget, a failure, a cancellation) leaves that call set the last
    /// one, and Anthropic, with thinking on, refuses a request whose final assistant message
    /// before the last tool_use and tool_result blocks does not start with its thinking.
    KeepLastCallsReasoning,
}

/// Drops the reasoning parts of completed turns' assistant messages. A message that would be
/// left empty keeps its parts (a valid transcript never has one: an assistant message never
/// ends on reasoning).
pub fn drop_reasoning(transcript: &Transcript) -> Transcript {
    drop_reasoning_by(transcript, CompactionRules::First)
}

/// [`drop_reasoning`] by `rules` (see [`CompactionRules`]).
pub fn drop_reasoning_by(transcript: &Transcript, rules: CompactionRules) -> Transcript {
    let kept_whole = match rules {
        CompactionRules::First => None,
        CompactionRules::KeepLastCallsReasoning => transcript
            .messages
            .iter()
            .rposition(|m| m.role == Role::Assistant)
            .filter(|&at| {
                transcript.messages[at]
                    .parts
                    .iter()
                    .any(|p| matches!(p, Part::ToolUse(_)))
            }),
    };
    map_completed_at(transcript, |at, message| {
        if message.role != Role::Assistant
            || Some(at) == kept_whole
            || !message.parts.iter().any(Part::is_reasoning)
        {
            return message.clone();
        }
        let kept: Vec<Part> = message
            .parts
            .iter()
            .filter(|p| !p.is_reasoning())
            .cloned()
            .collect();
        if kept.is_empty() {
            return message.clone();
        }
        Message {
            parts: kept,
            ..message.clone()
        }
    })
}

/// Replaces the content of completed turns' failed (`is_error`) tool results by
/// [`FAILED_RESULT_NOTE`] (those longer than the note), keeping each result in place so every tool_use stays answered.
pub fn drop_failed_tool_results(transcript: &Transcript) -> Transcript {
    let note_len = ToolResultContent::Text(FAILED_RESULT_NOTE.to_owned())
        .canonical_json()
        .len();
    map_completed(transcript, |message| Message {
        parts: message
            .parts
            .iter()
            .map(|part| match part {
                // Only when the note is shorter: a short error text stays as it is.
                Part::ToolResult(r)
                    if r.is_error && r.content.canonical_json().len() > note_len =>
                {
                    let mut r = r.clone();
                    r.content = ToolResultContent::Text(FAILED_RESULT_NOTE.to_owned());
                    Part::ToolResult(r)
                }
                other => other.clone(),
            })
            .collect(),
        ..message.clone()
    })
}

/// Where [`keep_last_turns`] cuts: the index of the first kept message (a turn's start), or
/// `None` when the transcript has at most `keep` turns. `keep` below 1 counts as 1: the
/// current turn is always kept.
pub fn cut_for_last_turns(transcript: &Transcript, keep: u32) -> Option<usize> {
    let starts = turn_starts(transcript);
    let keep = keep.max(1) as usize;
    (starts.len() > keep).then(|| starts[starts.len() - keep])
}

/// Keeps the leading system messages and the last `keep` turns; with a summary, it becomes a
/// text part in front of the first kept user message (the roles keep alternating and the
/// first message after the system prompt stays a user message). Returns the transcript and
/// the cut ([`cut_for_last_turns`]).
pub fn keep_last_turns(
    transcript: &Transcript,
    keep: u32,
    summary: Option<&str>,
) -> (Transcript, Option<usize>) {
    let Some(cut) = cut_for_last_turns(transcript, keep) else {
        return (transcript.clone(), None);
    };
    let mut messages: Vec<Message> = transcript
        .messages
        .iter()
        .take_while(|m| m.role == Role::System)
        .cloned()
        .collect();
    let mut first = transcript.messages[cut].clone();
    if let Some(summary) = summary.filter(|s| !s.is_empty()) {
        first
            .parts
            .insert(0, Part::text(format!("{SUMMARY_HEADING}\n{summary}")));
    }
    messages.push(first);
    messages.extend(transcript.messages[cut + 1..].iter().cloned());
    (Transcript { messages }, Some(cut))
}

/// The messages a summary replaces: those of the turns [`keep_last_turns`] would drop (from
/// the first message after the system prompt up to the cut). Empty when nothing is cut.
pub fn turns_before_cut(transcript: &Transcript, keep: u32) -> Transcript {
    let Some(cut) = cut_for_last_turns(transcript, keep) else {
        return Transcript::new();
    };
    Transcript {
        messages: transcript.messages[..cut]
            .iter()
            .filter(|m| m.role != Role::System)
            .cloned()
            .collect(),
    }
}

/// The instruction a summary call ends with (see [`summary_request`]).
pub const SUMMARY_PROMPT: &str = "Summarise the conversation above for your own later use: the \
user's goals, the decisions made, the facts learned (names, values, tool results that matter) \
and what is still open. Be concise and write only the summary.";

/// The transcript a summary call sends: the turns [`keep_last_turns`] would drop, their
/// reasoning dropped (it may not be replayable to the summarising model) except that of a call
/// set they end on ([`CompactionRules::KeepLastCallsReasoning`]: without it Anthropic, with
/// thinking on, refuses the request), then a user message of [`SUMMARY_PROMPT`]. Valid
/// whenever the transcript is. Built for each summary call and never recorded, so it follows
/// the latest rules whatever the session's version.
pub fn summary_request(transcript: &Transcript, keep: u32) -> Transcript {
    let mut older = turns_before_cut(transcript, keep);
    older.push_user_text(SUMMARY_PROMPT);
    drop_reasoning_by(&older, CompactionRules::KeepLastCallsReasoning)
}

/// What one compaction does, as recorded: the strategies in the order applied, the number of
/// turns kept and the summary, if any.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CompactionPlan {
    /// Strategies, applied in this order.
    pub strategies: Vec<CompactionStrategy>,
    /// Turns [`CompactionStrategy::KeepLastTurns`] keeps.
    pub keep_last_turns: u32,
    /// The summary of the dropped turns, if one was made.
    pub summary: Option<String>,
    /// The rules the strategies follow: not recorded, but the session's (see
    /// [`CompactionRules`]).
    pub rules: CompactionRules,
}

/// The outcome of [`compact`]: the new transcript and where it was cut, if it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compacted {
    /// The compacted transcript.
    pub transcript: Transcript,
    /// The index (in the transcript before compaction) of the first message kept by
    /// [`CompactionStrategy::KeepLastTurns`], when it cut.
    pub cut: Option<usize>,
}

/// Applies the plan's strategies in order. Pure: the same transcript and plan give the same
/// bytes, which is what lets the fold recompute a recorded compaction.
pub fn compact(transcript: &Transcript, plan: &CompactionPlan) -> Compacted {
    let mut current = transcript.clone();
    let mut cut = None;
    for strategy in &plan.strategies {
        current = match strategy {
            CompactionStrategy::DropReasoning => drop_reasoning_by(&current, plan.rules),
            CompactionStrategy::DropFailedToolResults => drop_failed_tool_results(&current),
            CompactionStrategy::KeepLastTurns => {
                // Strategies before it never add or remove messages, so the cut's index is
                // the same in the original transcript.
                let (kept, at) =
                    keep_last_turns(&current, plan.keep_last_turns, plan.summary.as_deref());
                cut = cut.or(at);
                kept
            }
        };
    }
    Compacted {
        transcript: current,
        cut,
    }
}

/// Applies `f` to every message of completed turns (before [`current_turn_start`]).
fn map_completed(transcript: &Transcript, f: impl Fn(&Message) -> Message) -> Transcript {
    map_completed_at(transcript, |_, message| f(message))
}

/// Applies `f` to every message of completed turns with its index.
fn map_completed_at(transcript: &Transcript, f: impl Fn(usize, &Message) -> Message) -> Transcript {
    let end = current_turn_start(transcript).unwrap_or(0);
    Transcript {
        messages: transcript
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| if i < end { f(i, m) } else { m.clone() })
            .collect(),
    }
}

#[cfg(test)]
#[path = "compaction_tests.rs"]
mod tests;
