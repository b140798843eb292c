//! Sessions in one line of words: `cairn history`'s summary of each event, and what became of
//! a turn.

use super::compaction;
use cairn_runtime::{Event, TurnOutcome};

pub(crate) fn describe(outcome: &TurnOutcome) -> String {
    match outcome {
        TurnOutcome::Completed { turn, answer, .. } => {
            format!("turn {turn} completed: {}", one_line(answer, 100))
        }
        TurnOutcome::Failed { turn, reason, .. } => format!("turn {turn} failed: {reason}"),
        TurnOutcome::Cancelled { turn, reason, .. } => {
            format!("turn {turn} cancelled: {reason}")
        }
    }
}

pub(crate) fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        flat
    } else {
        format!("{}…", flat.chars().take(max).collect::<String>())
    }
}

pub(crate) fn summarize(event: &Event) -> String {
    if let Some(line) = compaction::summarize(event) {
        return line;
    }
    match event {
        Event::SessionStarted(s) => format!(
            "model={}:{} tools=[{}] max_rounds={}",
            s.model.provider,
            s.model.model,
            s.tools
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(","),
            s.limits.max_rounds
        ),
        Event::UserMessage {
            turn, text, media, ..
        } if !media.is_empty() => format!(
            "turn={turn} {:?} media=[{}]",
            one_line(text, 60),
            media
                .iter()
                .map(|m| m.media_type().unwrap_or("url"))
                .collect::<Vec<_>>()
                .join(",")
        ),
        Event::UserMessage { turn, text, .. } => format!("turn={turn} {:?}", one_line(text, 60)),
        Event::ModelCallScheduled {
            turn,
            round,
            attempt,
            ..
        } => format!("turn={turn} round={round} attempt={attempt}"),
        Event::ModelCallCompleted {
            turn,
            round,
            attempt,
            response,
            cost_micros,
        } => format!(
            "turn={turn} round={round} attempt={attempt} stop={} parts=[{}] tokens={}/{}{}",
            response.stop_reason_raw,
            response
                .parts
                .iter()
                .map(|p| p.kind())
                .collect::<Vec<_>>()
                .join(","),
            response.usage.input_tokens,
            response.usage.output_tokens,
            cost_micros.map_or(String::new(), |c| format!(
                " cost={}",
                cairn_runtime::pricing::format_usd(c)
            ))
        ),
        Event::ModelCallFailed {
            turn,
            round,
            attempt,
            failure,
            ..
        } => format!(
            "turn={turn} round={round} attempt={attempt} {}: {}",
            failure.class.as_str(),
            one_line(&failure.message, 60)
        ),
        Event::ToolCallScheduled {
            turn,
            tool_use_id,
            name,
            attempt,
            ..
        } => format!("turn={turn} {name} id={tool_use_id} attempt={attempt}"),
        Event::ToolCallCompleted {
            turn,
            tool_use_id,
            attempt,
            content,
            is_error,
        } => format!(
            "turn={turn} id={tool_use_id} attempt={attempt}{} {}",
            if *is_error { " is_error" } else { "" },
            one_line(&content.canonical_json(), 60)
        ),
        Event::ToolCallFailed {
            turn,
            tool_use_id,
            attempt,
            failure,
        } => format!(
            "turn={turn} id={tool_use_id} attempt={attempt} {}: {}",
            failure.class.as_str(),
            one_line(&failure.message, 60)
        ),
        Event::ToolApprovalRequested {
            turn,
            tool_use_id,
            name,
            deadline_ms,
        } => match deadline_ms {
            Some(deadline) => format!("turn={turn} {name} id={tool_use_id} deadline={deadline}"),
            None => format!("turn={turn} {name} id={tool_use_id}"),
        },
        Event::ToolCallApproved { turn, tool_use_id } => {
            format!("turn={turn} id={tool_use_id}")
        }
        Event::ToolCallDenied {
            turn,
            tool_use_id,
            reason,
            by_deadline,
        } => format!(
            "turn={turn} id={tool_use_id}{} {:?}",
            if *by_deadline { " by_deadline" } else { "" },
            one_line(reason, 60)
        ),
        Event::TurnCompleted { turn, usage } => format!(
            "turn={turn} tokens={}/{}",
            usage.input_tokens, usage.output_tokens
        ),
        Event::TurnFailed { turn, reason, .. } => format!("turn={turn} {}", one_line(reason, 80)),
        Event::TurnCancelled { turn, reason } => format!("turn={turn} {}", one_line(reason, 80)),
        Event::SessionCancelled { reason } => one_line(reason, 80),
        Event::ModelAttemptProgress {
            turn,
            round,
            attempt,
            lease_attempt,
            text_appended,
            thinking_appended,
            ..
        } => {
            let mut line =
                format!("turn={turn} round={round} attempt={attempt} lease={lease_attempt}");
            if !thinking_appended.is_empty() {
                line.push_str(&format!(
                    " thinking+{} {:?}",
                    thinking_appended.chars().count(),
                    one_line(thinking_appended, 40)
                ));
            }
            if !text_appended.is_empty() {
                line.push_str(&format!(
                    " text+{} {:?}",
                    text_appended.chars().count(),
                    one_line(text_appended, 60)
                ));
            }
            line
        }
        // Described by `cli::compaction::summarize` above.
        Event::TranscriptCompacted { .. }
        | Event::CompactionRequested {}
        | Event::SummaryCallScheduled { .. }
        | Event::SummaryCallCompleted { .. }
        | Event::SummaryCallFailed { .. } => String::new(),
    }
}
