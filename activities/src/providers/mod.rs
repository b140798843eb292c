//! HTTP model providers: each renders its request from the ledger alone, checks the provider's
//! rules as pure functions before sending, parses the stream strictly into a canonical
//! response, and classifies errors for the retry policy.
//!
//! Every provider module has the same shape: a pure `render(&ModelRequest) -> Result<Value>`
//! (validation + the exact request body), a pure stream parser fed one wire event at a time
//! ([`drive::WireParser`]), and a `ModelProvider` whose `call` hands both to the one drive loop,
//! [`drive::call`] (deltas, heartbeats, usage so far, cancellation; over [`http::stream_call`]'s
//! idle timeout and secret scrubbing), decoding SSE with [`sse`] or AWS event-stream frames
//! with [`bedrock::FrameDecoder`] (linear, each event capped).

pub mod alias;
pub mod anthropic;
pub mod bedrock;
pub mod call_options;
pub mod drive;
pub mod http;
pub mod media;
#[cfg(test)]
mod media_tests;
pub mod openai_chat;
pub mod openai_responses;
pub mod raw_json;
pub mod secrets;
pub mod sse;

use crate::error::{Error, ErrorKind, Result};
use crate::model::ModelRequest;
use cairn_ledger::{validate_response, Message, ModelResponse, Part, Role, StopReason, Transcript};
use std::borrow::Cow;

/// A provider wire format a request can be rendered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestFormat {
    /// Anthropic Messages.
    Anthropic,
    /// OpenAI Chat Completions (and compatible servers).
    OpenAiChat,
    /// OpenAI Responses.
    OpenAiResponses,
    /// Amazon Bedrock Converse.
    Bedrock,
}

impl RequestFormat {
    /// Parses a format or provider name: `anthropic`, `openai-chat` (or `openai`),
    /// `openai-responses`, `bedrock`.
    pub fn parse(name: &str) -> Result<RequestFormat> {
        match name {
            "anthropic" => Ok(RequestFormat::Anthropic),
            "openai-chat" | "openai" => Ok(RequestFormat::OpenAiChat),
            "openai-responses" => Ok(RequestFormat::OpenAiResponses),
            "bedrock" => Ok(RequestFormat::Bedrock),
            other => Err(Error::Provider {
                kind: ErrorKind::InvalidRequest,
                message: format!(
                    "unknown request format {other:?} (anthropic, openai-chat, openai-responses, bedrock)"
                ),
            }),
        }
    }
}

/// The exact request body `format` would send next for `request` (after its provider's checks).
pub fn render_request(format: RequestFormat, request: &ModelRequest) -> Result<serde_json::Value> {
    match format {
        RequestFormat::Anthropic => anthropic::render(request),
        RequestFormat::OpenAiChat => openai_chat::render(request),
        RequestFormat::OpenAiResponses => openai_responses::render(request),
        RequestFormat::Bedrock => bedrock::render(request),
    }
}

/// The texts of a system message: every provider takes system instructions as text only, so
/// any other part is a typed, non-retryable error naming `provider`, the message and the part.
pub fn system_texts<'m>(
    provider: &str,
    index: usize,
    message: &'m Message,
) -> Result<Vec<&'m str>> {
    message
        .parts
        .iter()
        .enumerate()
        .map(|(pi, part)| match part {
            Part::Text { text, .. } => Ok(text.as_str()),
            other => Err(Error::Provider {
                kind: ErrorKind::InvalidRequest,
                message: format!(
                    "{provider}: message {index} part {pi}: a system message can only hold text, found {}",
                    other.kind()
                ),
            }),
        })
        .collect()
}

/// Index of the first message of the current turn: just after the last user message that
/// carries text (a person's message, not only tool results). Messages from here on form the
/// current tool loop.
pub fn current_turn_start(transcript: &Transcript) -> usize {
    // A transcript that ends on an assistant message without tool calls ends a completed turn:
    // there is no current tool loop.
    if let Some(last) = transcript.messages.last() {
        if last.role == Role::Assistant && !last.parts.iter().any(|p| matches!(p, Part::ToolUse(_)))
        {
            return transcript.messages.len();
        }
    }
    transcript
        .messages
        .iter()
        .rposition(|m| {
            m.role == Role::User && m.parts.iter().any(|p| matches!(p, Part::Text { .. }))
        })
        .map_or(0, |i| i + 1)
}

/// The transcript as `family` may receive it: reasoning and opaque blocks produced by another
/// provider family (and its citations) are dropped from completed turns (it cannot be verified
/// there); inside the current tool loop a message from another family is refused — a switch
/// mid-loop would break the loop's reasoning.
///
/// A transcript that is `family`'s throughout, the common case, is returned as it is, not
/// copied: a long session's transcript is megabytes, and it goes to every model call.
pub fn prepare_transcript<'a>(
    transcript: &'a Transcript,
    family: &str,
) -> Result<Cow<'a, Transcript>> {
    let whole = transcript.messages.iter().all(|message| {
        // The copy below leaves out a message with no parts left, so an empty one is a change.
        message
            .provenance
            .as_ref()
            .is_none_or(|p| p.provider == family)
            && !message.parts.is_empty()
            && message
                .parts
                .iter()
                .all(|part| part.is_whole_for_family(family))
    });
    if whole {
        return Ok(Cow::Borrowed(transcript));
    }
    let start = current_turn_start(transcript);
    let mut out = Transcript::new();
    for (index, message) in transcript.messages.iter().enumerate() {
        let foreign = message
            .provenance
            .as_ref()
            .is_some_and(|p| p.provider != family);
        if !foreign {
            // Opaque parts and citations carry their own family: another family's are dropped
            // even from a message of this one.
            let parts: Vec<Part> = message
                .parts
                .iter()
                .filter_map(|p| p.for_family(family))
                .collect();
            if !parts.is_empty() {
                // Not `..message.clone()`, which would copy every part only to drop them.
                out.messages.push(Message {
                    role: message.role,
                    parts,
                    provenance: message.provenance.clone(),
                });
            }
            continue;
        }
        if index >= start {
            return Err(Error::Provider {
                kind: ErrorKind::InvalidRequest,
                message: format!(
                    "message {index} of the current tool loop came from provider {:?}; switching to {family:?} inside a tool loop is not possible — finish the turn first",
                    message.provenance.as_ref().map_or("", |p| p.provider.as_str())
                ),
            });
        }
        let parts: Vec<Part> = message
            .parts
            .iter()
            .filter(|p| !p.is_provider_bound())
            .filter_map(|p| p.for_family(family))
            .map(with_object_arguments)
            .collect();
        if !parts.is_empty() {
            out.messages.push(Message {
                role: message.role,
                parts,
                provenance: message.provenance.clone(),
            });
        }
    }
    Ok(Cow::Owned(out))
}

/// A parsed response as it may be committed: checked by the ledger's rules
/// ([`validate_response`]), and refused as the request's fault when its token limit cut it
/// while the model was still reasoning, before any answer or tool call (nothing but
/// reasoning, or nothing at all once unfinished reasoning is dropped). Such a response breaks
/// the ledger's rules (it ends on reasoning, or is empty once unfinished reasoning is dropped),
/// but sending the same request again would most likely be cut the same way, so it is
/// `InvalidRequest`, which no default policy retries, not a retryable `InvalidResponse`.
pub(crate) fn checked_response(provider: &str, response: ModelResponse) -> Result<ModelResponse> {
    let cut_in_reasoning = response.stop_reason == StopReason::MaxTokens
        && response.parts.iter().all(Part::is_reasoning);
    if cut_in_reasoning {
        return Err(Error::Provider {
            kind: ErrorKind::InvalidRequest,
            message: format!(
                "{provider}: the response reached its output token limit ({}) while the model \
                 was still reasoning, before any answer or tool call; raise the model's \
                 max_tokens, or lower its thinking budget or reasoning effort",
                response.stop_reason_raw
            ),
        });
    }
    validate_response(&response).map_err(|source| Error::InvalidResponse {
        provider: provider.to_owned(),
        source,
    })?;
    Ok(response)
}

/// A foreign tool call as every family takes it: with arguments that are a JSON object.
/// Chat-completions models may write any text there (the call then failed with a tool error,
/// and its provider takes the text back as it is), but Anthropic and Bedrock take a call's
/// input as a JSON object only, so a switch to them would fail on every later call. The turn
/// is finished, so only what the model reads of it matters: the text it sent, kept whole as a
/// string under `unparsed_arguments`.
fn with_object_arguments(part: Part) -> Part {
    match part {
        Part::ToolUse(mut tool_use)
            if !serde_json::from_str::<&serde_json::value::RawValue>(&tool_use.arguments)
                .is_ok_and(|raw| raw.get().starts_with('{')) =>
        {
            tool_use.arguments =
                serde_json::json!({ "unparsed_arguments": tool_use.arguments }).to_string();
            Part::ToolUse(tool_use)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::{ModelResponse, StopReason, ToolResult, ToolResultContent, ToolUse, Usage};

    fn response(provider: &str, parts: Vec<Part>) -> ModelResponse {
        ModelResponse {
            provider: provider.into(),
            model: "m".into(),
            parts,
            stop_reason_raw: "x".into(),
            stop_reason: StopReason::EndTurn,
            usage: Usage::default(),
        }
    }

    fn thinking() -> Part {
        Part::Thinking {
            text: "t".into(),
            signature: "s".into(),
        }
    }

    #[test]
    fn foreign_reasoning_is_dropped_from_completed_turns_and_refused_in_the_loop() {
        let mut t = Transcript::new();
        t.push_user_text("one");
        t.push_response(&response("anthropic", vec![thinking(), Part::text("a")]));
        t.push_user_text("two");
        let prepared = prepare_transcript(&t, "openai").unwrap();
        assert_eq!(prepared.messages[1].parts, vec![Part::text("a")]);
        // Same family: untouched, and not copied.
        assert!(matches!(
            prepare_transcript(&t, "anthropic").unwrap(),
            Cow::Borrowed(same) if std::ptr::eq(same, &t)
        ));
        // Inside a tool loop of another family: refused.
        t.push_response(&response(
            "anthropic",
            vec![Part::ToolUse(ToolUse {
                id: "x".into(),
                name: "n".into(),
                arguments: "{}".into(),
                signature: None,
            })],
        ));
        t.push_tool_results([ToolResult {
            tool_use_id: "x".into(),
            content: ToolResultContent::Text("r".into()),
            is_error: false,
        }]);
        let err = prepare_transcript(&t, "openai").unwrap_err();
        assert!(err.to_string().contains("inside a tool loop"), "{err}");
        let system = Message {
            role: Role::System,
            parts: vec![Part::text("a"), thinking()],
            provenance: None,
        };
        let err = system_texts("p", 0, &system).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        assert!(
            err.to_string().contains(
                "p: message 0 part 1: a system message can only hold text, found thinking"
            ),
            "{err}"
        );
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        // Once the turn is complete, the switch is fine and the foreign reasoning is dropped.
        t.push_response(&response("anthropic", vec![thinking(), Part::text("done")]));
        let prepared = prepare_transcript(&t, "openai").unwrap();
        assert_eq!(
            prepared.messages.last().unwrap().parts,
            vec![Part::text("done")]
        );
    }

    #[test]
    fn another_family_s_opaque_block_in_a_message_of_this_family_makes_a_copy_without_it() {
        let mut t = Transcript::new();
        t.push_user_text("one");
        let opaque = Part::Opaque(cairn_ledger::ProviderJson::new(
            "openai-responses",
            cairn_ledger::JsonText::parse(r#"{"type":"web_search_call"}"#).unwrap(),
        ));
        t.push_response(&response(
            "anthropic",
            vec![opaque.clone(), Part::text("a")],
        ));
        let prepared = prepare_transcript(&t, "anthropic").unwrap();
        assert!(matches!(prepared, Cow::Owned(_)));
        assert_eq!(prepared.messages[1].parts, vec![Part::text("a")]);
        // The family that made the block gets it: from a completed turn of another family,
        // only reasoning and provider-bound parts go.
        assert!(!opaque.is_whole_for_family("anthropic"));
        assert!(opaque.is_whole_for_family("openai-responses"));
    }

    #[test]
    fn a_finished_foreign_call_whose_arguments_are_not_an_object_goes_to_any_family() {
        let mut t = Transcript::new();
        t.push_user_text("time in Paris?");
        let call = |id: &str, arguments: &str| {
            Part::ToolUse(ToolUse {
                id: id.into(),
                name: "clock".into(),
                arguments: arguments.into(),
                signature: None,
            })
        };
        t.push_response(&response(
            "openai",
            vec![
                call("c1", r#"{"tz": CET"#),
                call("c2", r#"{"tz":"CET"}"#),
                call("c3", "[1]"),
            ],
        ));
        t.push_tool_results(["c1", "c2", "c3"].map(|id| ToolResult {
            tool_use_id: id.into(),
            content: ToolResultContent::Text("arguments: not valid JSON".into()),
            is_error: true,
        }));
        t.push_response(&response("openai", vec![Part::text("sorry")]));
        t.push_user_text("again");
        let prepared = prepare_transcript(&t, "anthropic").unwrap();
        let arguments: Vec<&str> = prepared.messages[1]
            .parts
            .iter()
            .map(|part| match part {
                Part::ToolUse(tool_use) => tool_use.arguments.as_str(),
                other => panic!("not a tool_use: {other:?}"),
            })
            .collect();
        assert_eq!(
            arguments,
            [
                r#"{"unparsed_arguments":"{\"tz\": CET"}"#,
                r#"{"tz":"CET"}"#,
                r#"{"unparsed_arguments":"[1]"}"#
            ]
        );
        // Its own family takes the text back as it was.
        assert!(matches!(
            prepare_transcript(&t, "openai").unwrap(),
            Cow::Borrowed(_)
        ));
        for (format, provider) in [
            (RequestFormat::Anthropic, "anthropic"),
            (RequestFormat::Bedrock, "bedrock"),
        ] {
            let request = crate::ModelRequest {
                context: crate::CallContext::default(),
                model: cairn_ledger::ModelSpec::new(provider, "m"),
                transcript: std::sync::Arc::new(t.clone()),
                tools: vec![cairn_ledger::ToolSpec {
                    name: "clock".into(),
                    description: "The time".into(),
                    input_schema: cairn_ledger::JsonText::parse(r#"{"type":"object"}"#).unwrap(),
                }]
                .into(),
                options: Default::default(),
            };
            let body = render_request(format, &request).unwrap();
            assert!(body.to_string().contains("unparsed_arguments"), "{body}");
        }
    }

    #[test]
    fn a_response_cut_while_reasoning_is_refused_as_the_request_s_fault() {
        let cut = |parts: Vec<Part>, stop_reason| ModelResponse {
            stop_reason,
            stop_reason_raw: "max_tokens".into(),
            ..response("anthropic", parts)
        };
        for parts in [vec![thinking()], Vec::new()] {
            let err = checked_response("anthropic", cut(parts, StopReason::MaxTokens)).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
            assert!(err.to_string().contains("anthropic: the response reached its output token limit (max_tokens) while the model was still reasoning"), "{err}");
        }
        // Not cut by the limit: the ledger's rule, a retryable invalid response.
        let err =
            checked_response("anthropic", cut(vec![thinking()], StopReason::EndTurn)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidResponse, "{err}");
        // Reasoning again after an answer began: the ledger's rule, not the limit's fault.
        let again = cut(
            vec![thinking(), Part::text("par"), thinking()],
            StopReason::MaxTokens,
        );
        let err = checked_response("anthropic", again).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidResponse, "{err}");
        // Cut after an answer began: an ordinary MaxTokens response.
        let answer = cut(vec![thinking(), Part::text("par")], StopReason::MaxTokens);
        assert_eq!(
            checked_response("anthropic", answer.clone()).unwrap(),
            answer
        );
    }
}
