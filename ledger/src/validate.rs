//! Transcript and response validation as pure functions: the first broken rule, with its place.

use crate::error::{Error, Result, Violation};
use crate::media::ToolResultBlock;
use crate::response::{ModelResponse, StopReason};
use crate::transcript::{Message, Part, Role, ToolResultContent, Transcript};
use std::collections::{BTreeSet, HashSet};

fn at(message: usize, part: Option<usize>, violation: Violation) -> Error {
    Error::InvalidTranscript {
        message,
        part,
        violation,
    }
}

/// Checks that a transcript can be sent to a provider as it is.
///
/// Rules: system messages only first; no empty messages or text parts; thinking and redacted
/// thinking only in assistant messages, thinking always signed, and an assistant message never
/// ends on reasoning; tool_use ids and names non-empty, ids unique; every tool_use answered by
/// exactly one tool_result in the next message, which is a user message that starts with those
/// results in tool_use declaration order; tool_results appear nowhere else; images and
/// documents only in user messages (and tool results), each with a supported media type and
/// valid base64 data or an http(s) URL.
pub fn validate_transcript(transcript: &Transcript) -> Result<()> {
    validate_transcript_from(transcript, 0)
}

/// Checks the messages of `transcript` from index `from` on by the rules of
/// [`validate_transcript`], in the context of the messages before them: the tool_uses the
/// message before `from` leaves open must be answered first, and a system message after a
/// non-system one is out of place. The messages before `from` are not checked, nor the
/// tail's tool_use ids against theirs. Errors name messages by their index in the whole
/// transcript.
///
/// For a transcript whose head is known good, such as a session's, which its workflow grows
/// one checked input at a time (unique tool_use ids included), the check before a model call
/// then costs the length of the current turn, not of the session.
pub fn validate_transcript_from(transcript: &Transcript, from: usize) -> Result<()> {
    let messages = &transcript.messages;
    let from = from.min(messages.len());
    // Hashed, not ordered: a transcript can hold thousands of ids.
    let mut seen_ids = HashSet::new();
    let mut seen_non_system = messages[..from].iter().any(|m| m.role != Role::System);
    for (mi, message) in messages.iter().enumerate().skip(from) {
        if message.parts.is_empty() {
            return Err(at(mi, None, Violation::EmptyMessage));
        }
        match message.role {
            Role::System if seen_non_system => return Err(at(mi, None, Violation::SystemNotFirst)),
            Role::System => {}
            _ => seen_non_system = true,
        }
        check_parts(mi, message)?;
        // Results at the start of this message answer the previous assistant message's tool_uses.
        let expected: Vec<&str> = match mi.checked_sub(1).map(|p| &messages[p]) {
            Some(prev) if prev.role == Role::Assistant => prev
                .parts
                .iter()
                .filter_map(|p| match p {
                    Part::ToolUse(t) => Some(t.id.as_str()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        if !expected.is_empty() && message.role != Role::User {
            return Err(at(mi, None, Violation::ToolResultsNotNext));
        }
        check_results(mi, message, &expected)?;
        for (pi, part) in message.parts.iter().enumerate() {
            if let Part::ToolUse(t) = part {
                if !seen_ids.insert(t.id.as_str()) {
                    return Err(at(
                        mi,
                        Some(pi),
                        Violation::DuplicateToolUseId { id: t.id.clone() },
                    ));
                }
            }
        }
    }
    // A trailing assistant message with tool_uses has no results yet.
    if let Some(last) = messages.last().filter(|_| messages.len() > from) {
        if last.role == Role::Assistant {
            if let Some((pi, Part::ToolUse(t))) = last
                .parts
                .iter()
                .enumerate()
                .find(|(_, p)| matches!(p, Part::ToolUse(_)))
            {
                return Err(at(
                    messages.len() - 1,
                    Some(pi),
                    Violation::MissingToolResult {
                        tool_use_id: t.id.clone(),
                    },
                ));
            }
        }
    }
    Ok(())
}

fn check_parts(mi: usize, message: &Message) -> Result<()> {
    for (pi, part) in message.parts.iter().enumerate() {
        let allowed = match part {
            Part::Text { .. } | Part::Image { .. } => true,
            Part::Thinking { .. }
            | Part::RedactedThinking { .. }
            | Part::Reasoning { .. }
            | Part::ReasoningItem { .. }
            | Part::Opaque(_)
            | Part::ToolUse(_) => message.role == Role::Assistant,
            Part::ToolResult(_) | Part::Media(_) => message.role == Role::User,
        };
        if !allowed {
            return Err(at(
                mi,
                Some(pi),
                Violation::PartNotAllowedInRole {
                    part_kind: part.kind(),
                    role: message.role.as_str(),
                },
            ));
        }
        check_part(part).map_err(|v| at(mi, Some(pi), v))?;
    }
    if message.role == Role::Assistant {
        if let Some(last) = message.parts.last() {
            if last.is_reasoning() {
                return Err(at(
                    mi,
                    Some(message.parts.len() - 1),
                    Violation::AssistantEndsOnThinking,
                ));
            }
        }
    }
    Ok(())
}

/// Rules that concern one part alone.
fn check_part(part: &Part) -> std::result::Result<(), Violation> {
    match part {
        Part::Text { text, .. } if text.is_empty() => Err(Violation::EmptyText),
        Part::Thinking { signature, .. } if signature.is_empty() => {
            Err(Violation::ThinkingWithoutSignature)
        }
        Part::RedactedThinking { data } if data.is_empty() => Err(Violation::EmptyRedactedThinking),
        Part::ToolUse(t) if t.id.is_empty() => Err(Violation::EmptyToolUseId),
        Part::ToolUse(t) if t.name.is_empty() => Err(Violation::EmptyToolName),
        Part::ToolResult(r) if r.tool_use_id.is_empty() => Err(Violation::EmptyToolUseId),
        Part::ToolResult(r) => check_result_blocks(&r.content),
        Part::Media(media) => media.check(),
        Part::Opaque(p)
        | Part::Text {
            citations: Some(p), ..
        } if p.provider.is_empty() => Err(Violation::ProviderJsonWithoutFamily),
        _ => Ok(()),
    }
}

/// A tool result of blocks: at least one block, each media block well-formed.
fn check_result_blocks(content: &ToolResultContent) -> std::result::Result<(), Violation> {
    let ToolResultContent::Blocks(blocks) = content else {
        return Ok(());
    };
    if blocks.is_empty() {
        return Err(Violation::EmptyToolResultBlocks);
    }
    for (block, b) in blocks.iter().enumerate() {
        if let ToolResultBlock::Media(media) = b {
            media
                .check()
                .map_err(|violation| Violation::InToolResultBlock {
                    block,
                    violation: Box::new(violation),
                })?;
        }
    }
    Ok(())
}

fn check_results(mi: usize, message: &Message, expected: &[&str]) -> Result<()> {
    let mut next = 0;
    let mut other_seen = false;
    for (pi, part) in message.parts.iter().enumerate() {
        let Part::ToolResult(result) = part else {
            if next < expected.len() {
                return Err(at(
                    mi,
                    Some(pi),
                    Violation::MissingToolResult {
                        tool_use_id: expected[next].to_owned(),
                    },
                ));
            }
            other_seen = true;
            continue;
        };
        if other_seen {
            return Err(at(mi, Some(pi), Violation::ToolResultAfterOtherContent));
        }
        let id = result.tool_use_id.as_str();
        match expected.get(next) {
            Some(want) if *want == id => next += 1,
            Some(want) if expected[next..].contains(&id) => {
                return Err(at(
                    mi,
                    Some(pi),
                    Violation::ToolResultOutOfOrder {
                        expected: (*want).to_owned(),
                        found: id.to_owned(),
                    },
                ))
            }
            _ => {
                return Err(at(
                    mi,
                    Some(pi),
                    Violation::UnexpectedToolResult {
                        tool_use_id: id.to_owned(),
                    },
                ))
            }
        }
    }
    if let Some(missing) = expected.get(next) {
        return Err(at(
            mi,
            None,
            Violation::MissingToolResult {
                tool_use_id: (*missing).to_owned(),
            },
        ));
    }
    Ok(())
}

/// Checks a model response before it is committed: not empty, only assistant parts (no tool
/// result, no media: a transcript holds those in user messages only, so an assistant message
/// with one could never be sent to a provider again), every part well-formed, unique tool_use
/// ids, not ending on reasoning, no tool_use cut by `max_tokens`.
pub fn validate_response(response: &ModelResponse) -> Result<()> {
    if let Some((pi, media)) = response
        .parts
        .iter()
        .enumerate()
        .find(|(_, part)| matches!(part, Part::Media(_)))
    {
        return Err(Error::InvalidResponse {
            part: Some(pi),
            violation: Violation::PartNotAllowedInRole {
                part_kind: media.kind(),
                role: "assistant",
            },
        });
    }
    validate_recorded_response(response)
}

/// The rules of [`validate_response`] that every recorded response was checked by, which
/// folding a history applies: media in a response was let through before it was refused, and
/// a history that holds one still folds (it can be read, exported and forked from before it).
pub fn validate_recorded_response(response: &ModelResponse) -> Result<()> {
    let bad = |part, violation| Error::InvalidResponse { part, violation };
    if response.parts.is_empty() {
        return Err(bad(None, Violation::EmptyResponse));
    }
    let mut ids = BTreeSet::new();
    for (pi, part) in response.parts.iter().enumerate() {
        if let Part::ToolResult(_) = part {
            return Err(bad(
                Some(pi),
                Violation::PartNotAllowedInRole {
                    part_kind: "tool_result",
                    role: "assistant",
                },
            ));
        }
        check_part(part).map_err(|v| bad(Some(pi), v))?;
        if let Part::ToolUse(t) = part {
            if !ids.insert(t.id.as_str()) {
                return Err(bad(
                    Some(pi),
                    Violation::DuplicateToolUseId { id: t.id.clone() },
                ));
            }
        }
    }
    let last = response.parts.len() - 1;
    match &response.parts[last] {
        p if p.is_reasoning() => Err(bad(Some(last), Violation::AssistantEndsOnThinking)),
        Part::ToolUse(t) if response.stop_reason == StopReason::MaxTokens => Err(bad(
            Some(last),
            Violation::TruncatedToolUse {
                tool_use_id: t.id.clone(),
            },
        )),
        _ => Ok(()),
    }
}
