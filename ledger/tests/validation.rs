//! One test per transcript and response rule: each asserts the exact error (message index, part
//! index, violation with its fields), plus the valid shapes that must pass.

use cairn_ledger::{
    validate_response, validate_transcript, validate_transcript_from, Error, JsonText, Message,
    ModelResponse, Part, Provenance, Role, StopReason, ToolResult, ToolResultContent, ToolUse,
    Transcript, Usage, Violation,
};

// ---------------------------------------------------------------------------------------------
// Builders
// ---------------------------------------------------------------------------------------------

fn text(t: &str) -> Part {
    Part::text(t)
}

fn thinking(t: &str, signature: &str) -> Part {
    Part::Thinking {
        text: t.to_owned(),
        signature: signature.to_owned(),
    }
}

fn redacted(data: &str) -> Part {
    Part::RedactedThinking {
        data: data.to_owned(),
    }
}

fn tool_use(id: &str, name: &str) -> Part {
    Part::ToolUse(ToolUse {
        id: id.to_owned(),
        name: name.to_owned(),
        arguments: r#"{"path":"/tmp/x"}"#.to_owned(),
        signature: None,
    })
}

fn result(id: &str) -> Part {
    Part::ToolResult(ToolResult {
        tool_use_id: id.to_owned(),
        content: ToolResultContent::Json(JsonText::parse(r#"{"ok":true}"#).unwrap()),
        is_error: false,
    })
}

fn error_result(id: &str, message: &str) -> Part {
    Part::ToolResult(ToolResult {
        tool_use_id: id.to_owned(),
        content: ToolResultContent::Text(message.to_owned()),
        is_error: true,
    })
}

fn image() -> Part {
    Part::Image {
        media_type: "image/png".to_owned(),
        data_ref: "sha256:abc".to_owned(),
    }
}

fn system(parts: Vec<Part>) -> Message {
    Message {
        role: Role::System,
        parts,
        provenance: None,
    }
}

fn user(parts: Vec<Part>) -> Message {
    Message {
        role: Role::User,
        parts,
        provenance: None,
    }
}

fn assistant(parts: Vec<Part>) -> Message {
    Message {
        role: Role::Assistant,
        parts,
        provenance: Some(Provenance {
            provider: "scripted".to_owned(),
            model: "demo".to_owned(),
        }),
    }
}

fn transcript(messages: Vec<Message>) -> Transcript {
    Transcript { messages }
}

fn response(parts: Vec<Part>, stop_reason: StopReason) -> ModelResponse {
    ModelResponse {
        provider: "scripted".to_owned(),
        model: "demo".to_owned(),
        parts,
        stop_reason_raw: format!("{stop_reason:?}"),
        stop_reason,
        usage: Usage::default(),
    }
}

#[track_caller]
fn assert_valid(messages: Vec<Message>) {
    let t = transcript(messages);
    if let Err(e) = validate_transcript(&t) {
        panic!("expected a valid transcript, got `{e}` for {t:#?}");
    }
}

#[track_caller]
fn assert_invalid(
    messages: Vec<Message>,
    message: usize,
    part: Option<usize>,
    violation: Violation,
) {
    let t = transcript(messages);
    assert_eq!(
        validate_transcript(&t),
        Err(Error::InvalidTranscript {
            message,
            part,
            violation
        }),
        "for {t:#?}"
    );
}

#[track_caller]
fn assert_response_invalid(r: ModelResponse, part: Option<usize>, violation: Violation) {
    assert_eq!(
        validate_response(&r),
        Err(Error::InvalidResponse { part, violation }),
        "for {r:#?}"
    );
}

fn not_allowed(part_kind: &'static str, role: &'static str) -> Violation {
    Violation::PartNotAllowedInRole { part_kind, role }
}

fn missing(id: &str) -> Violation {
    Violation::MissingToolResult {
        tool_use_id: id.to_owned(),
    }
}

fn unexpected(id: &str) -> Violation {
    Violation::UnexpectedToolResult {
        tool_use_id: id.to_owned(),
    }
}

/// system, user, assistant(thinking, text, tool_use a, tool_use b), user(result a, result b, text),
/// assistant(text): the reference valid tool round.
fn full_round() -> Vec<Message> {
    vec![
        system(vec![text("You are terse.")]),
        user(vec![text("List /tmp and /var.")]),
        assistant(vec![
            thinking("I should list both.", "sig-1"),
            text("Listing."),
            tool_use("a", "ls"),
            tool_use("b", "ls"),
        ]),
        user(vec![result("a"), result("b"), text("Also be quick.")]),
        assistant(vec![text("Done.")]),
    ]
}

// ---------------------------------------------------------------------------------------------
// Valid transcripts
// ---------------------------------------------------------------------------------------------

#[test]
fn full_tool_round_is_valid() {
    assert_valid(full_round());
}

#[test]
fn empty_transcript_is_valid() {
    assert_eq!(validate_transcript(&Transcript::new()), Ok(()));
}

#[test]
fn several_leading_system_messages_are_valid() {
    assert_valid(vec![
        system(vec![text("one")]),
        system(vec![text("two")]),
        user(vec![text("hi")]),
    ]);
}

#[test]
fn interleaved_thinking_is_valid() {
    assert_valid(vec![
        user(vec![text("go")]),
        assistant(vec![
            thinking("first", "sig-1"),
            tool_use("a", "ls"),
            thinking("second", "sig-2"),
            tool_use("b", "cat"),
            text("working"),
        ]),
        user(vec![result("a"), result("b")]),
        assistant(vec![text("done")]),
    ]);
}

#[test]
fn thinking_with_empty_text_but_a_signature_is_valid() {
    assert_valid(vec![
        user(vec![text("go")]),
        assistant(vec![thinking("", "sig-omitted"), text("answer")]),
    ]);
}

#[test]
fn redacted_thinking_is_valid() {
    assert_valid(vec![
        user(vec![text("go")]),
        assistant(vec![
            redacted("EncryptedBlob=="),
            thinking("visible", "sig"),
            tool_use("a", "ls"),
        ]),
        user(vec![error_result("a", "permission denied")]),
        assistant(vec![redacted("more=="), text("sorry")]),
    ]);
}

#[test]
fn images_are_valid_in_user_and_assistant_messages() {
    assert_valid(vec![
        user(vec![text("what is this?"), image()]),
        assistant(vec![image(), text("a cat")]),
    ]);
}

#[test]
fn a_transcript_ending_on_a_results_message_is_valid() {
    // The model has not answered yet: the next request is exactly this transcript.
    assert_valid(vec![
        user(vec![text("go")]),
        assistant(vec![tool_use("a", "ls")]),
        user(vec![result("a")]),
    ]);
}

#[test]
fn consecutive_tool_rounds_are_valid() {
    assert_valid(vec![
        user(vec![text("go")]),
        assistant(vec![tool_use("a", "ls")]),
        user(vec![result("a")]),
        assistant(vec![
            thinking("", "s"),
            tool_use("b", "ls"),
            tool_use("c", "ls"),
        ]),
        user(vec![result("b"), error_result("c", "timeout")]),
        assistant(vec![text("done")]),
    ]);
}

#[test]
fn transcript_built_with_the_push_helpers_is_valid() {
    let mut t = Transcript::new();
    t.push_system("sys");
    t.push_user_text("go");
    let r = response(
        vec![
            thinking("plan", "sig"),
            tool_use("a", "ls"),
            tool_use("b", "ls"),
        ],
        StopReason::ToolUse,
    );
    assert_eq!(validate_response(&r), Ok(()));
    t.push_response(&r);
    let trailing: Vec<&str> = t
        .trailing_tool_uses()
        .iter()
        .map(|u| u.id.as_str())
        .collect();
    assert_eq!(trailing, ["a", "b"]);
    // Unanswered for now.
    assert_eq!(
        validate_transcript(&t),
        Err(Error::InvalidTranscript {
            message: 2,
            part: Some(1),
            violation: missing("a"),
        })
    );
    // An empty batch of results pushes nothing.
    t.push_tool_results(Vec::new());
    assert_eq!(t.messages.len(), 3);
    let results = ["a", "b"].map(|id| ToolResult {
        tool_use_id: id.to_owned(),
        content: ToolResultContent::Text(format!("listing of {id}")),
        is_error: false,
    });
    t.push_tool_results(results);
    assert_eq!(t.messages.len(), 4);
    assert!(t.trailing_tool_uses().is_empty());
    assert_eq!(validate_transcript(&t), Ok(()));
    t.push_response(&response(vec![text("done")], StopReason::EndTurn));
    assert_eq!(validate_transcript(&t), Ok(()));
    assert_eq!(t.messages[4].role, Role::Assistant);
    assert_eq!(
        t.messages[4].provenance,
        Some(Provenance {
            provider: "scripted".to_owned(),
            model: "demo".to_owned()
        })
    );
}

// ---------------------------------------------------------------------------------------------
// Message-level rules
// ---------------------------------------------------------------------------------------------

#[test]
fn empty_message_is_rejected() {
    assert_invalid(
        vec![user(vec![text("hi")]), assistant(vec![])],
        1,
        None,
        Violation::EmptyMessage,
    );
}

#[test]
fn empty_system_message_is_rejected() {
    assert_invalid(vec![system(vec![])], 0, None, Violation::EmptyMessage);
}

#[test]
fn empty_text_part_is_rejected() {
    assert_invalid(
        vec![user(vec![text("hi"), text("")])],
        0,
        Some(1),
        Violation::EmptyText,
    );
}

#[test]
fn empty_text_in_an_assistant_message_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![thinking("t", "s"), text("")]),
        ],
        1,
        Some(1),
        Violation::EmptyText,
    );
}

#[test]
fn system_after_user_is_rejected() {
    assert_invalid(
        vec![
            system(vec![text("a")]),
            user(vec![text("hi")]),
            system(vec![text("late")]),
        ],
        2,
        None,
        Violation::SystemNotFirst,
    );
}

#[test]
fn system_after_assistant_is_rejected() {
    assert_invalid(
        vec![assistant(vec![text("hello")]), system(vec![text("late")])],
        1,
        None,
        Violation::SystemNotFirst,
    );
}

// ---------------------------------------------------------------------------------------------
// Part kinds per role
// ---------------------------------------------------------------------------------------------

#[test]
fn thinking_in_a_user_message_is_rejected() {
    assert_invalid(
        vec![user(vec![text("hi"), thinking("mine", "sig")])],
        0,
        Some(1),
        not_allowed("thinking", "user"),
    );
}

#[test]
fn redacted_thinking_in_a_system_message_is_rejected() {
    assert_invalid(
        vec![system(vec![redacted("blob")])],
        0,
        Some(0),
        not_allowed("redacted_thinking", "system"),
    );
}

#[test]
fn tool_result_in_an_assistant_message_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![text("here"), result("a")]),
        ],
        1,
        Some(1),
        not_allowed("tool_result", "assistant"),
    );
}

#[test]
fn tool_result_in_a_system_message_is_rejected() {
    assert_invalid(
        vec![system(vec![result("a")])],
        0,
        Some(0),
        not_allowed("tool_result", "system"),
    );
}

#[test]
fn tool_use_in_a_user_message_is_rejected() {
    assert_invalid(
        vec![user(vec![text("run it"), tool_use("a", "ls")])],
        0,
        Some(1),
        not_allowed("tool_use", "user"),
    );
}

// ---------------------------------------------------------------------------------------------
// Reasoning rules
// ---------------------------------------------------------------------------------------------

#[test]
fn thinking_without_signature_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![thinking("cut before signature_delta", ""), text("x")]),
        ],
        1,
        Some(0),
        Violation::ThinkingWithoutSignature,
    );
}

#[test]
fn redacted_thinking_without_data_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![redacted(""), text("x")]),
        ],
        1,
        Some(0),
        Violation::EmptyRedactedThinking,
    );
}

#[test]
fn assistant_ending_on_thinking_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![text("x"), thinking("afterthought", "sig")]),
        ],
        1,
        Some(1),
        Violation::AssistantEndsOnThinking,
    );
}

#[test]
fn assistant_ending_on_redacted_thinking_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![thinking("t", "s"), text("x"), redacted("blob")]),
        ],
        1,
        Some(2),
        Violation::AssistantEndsOnThinking,
    );
}

#[test]
fn assistant_of_only_thinking_is_rejected() {
    assert_invalid(
        vec![user(vec![text("hi")]), assistant(vec![thinking("", "sig")])],
        1,
        Some(0),
        Violation::AssistantEndsOnThinking,
    );
}

// ---------------------------------------------------------------------------------------------
// tool_use rules
// ---------------------------------------------------------------------------------------------

#[test]
fn empty_tool_use_id_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![text("x"), tool_use("", "ls")]),
        ],
        1,
        Some(1),
        Violation::EmptyToolUseId,
    );
}

#[test]
fn empty_tool_result_id_is_rejected() {
    assert_invalid(
        vec![user(vec![result("")])],
        0,
        Some(0),
        Violation::EmptyToolUseId,
    );
}

#[test]
fn empty_tool_name_is_rejected() {
    assert_invalid(
        vec![user(vec![text("hi")]), assistant(vec![tool_use("a", "")])],
        1,
        Some(0),
        Violation::EmptyToolName,
    );
}

#[test]
fn duplicate_tool_use_ids_across_assistant_messages_are_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            user(vec![result("a")]),
            assistant(vec![text("again"), tool_use("a", "ls")]),
            user(vec![result("a")]),
            assistant(vec![text("done")]),
        ],
        3,
        Some(1),
        Violation::DuplicateToolUseId { id: "a".to_owned() },
    );
}

#[test]
fn duplicate_tool_use_ids_within_one_message_are_rejected() {
    // Reported at the assistant message, before the (otherwise matching) results are looked at.
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls"), tool_use("a", "ls")]),
            user(vec![result("a"), result("a")]),
        ],
        1,
        Some(1),
        Violation::DuplicateToolUseId { id: "a".to_owned() },
    );
}

// ---------------------------------------------------------------------------------------------
// tool_result placement
// ---------------------------------------------------------------------------------------------

#[test]
fn missing_tool_result_in_the_next_message_is_rejected() {
    // The next message answers a but not b: reported on the message as a whole.
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls"), tool_use("b", "ls")]),
            user(vec![result("a")]),
        ],
        2,
        None,
        missing("b"),
    );
}

#[test]
fn next_message_without_any_tool_result_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            user(vec![text("never mind")]),
        ],
        2,
        Some(0),
        missing("a"),
    );
}

#[test]
fn results_out_of_declaration_order_are_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![
                tool_use("a", "ls"),
                tool_use("b", "ls"),
                tool_use("c", "ls"),
            ]),
            user(vec![result("a"), result("c"), result("b")]),
        ],
        2,
        Some(1),
        Violation::ToolResultOutOfOrder {
            expected: "b".to_owned(),
            found: "c".to_owned(),
        },
    );
}

#[test]
fn result_for_an_unknown_id_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            user(vec![result("zzz")]),
        ],
        2,
        Some(0),
        unexpected("zzz"),
    );
}

#[test]
fn result_for_an_id_of_an_earlier_round_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            user(vec![result("a")]),
            assistant(vec![tool_use("b", "ls")]),
            user(vec![result("a"), result("b")]),
        ],
        4,
        Some(0),
        unexpected("a"),
    );
}

#[test]
fn result_without_any_preceding_tool_use_is_rejected() {
    assert_invalid(
        vec![user(vec![text("hi")]), user(vec![result("a")])],
        1,
        Some(0),
        unexpected("a"),
    );
}

#[test]
fn the_same_result_twice_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls"), tool_use("b", "ls")]),
            user(vec![result("a"), result("a"), result("b")]),
        ],
        2,
        Some(1),
        unexpected("a"),
    );
}

#[test]
fn the_same_result_twice_after_all_are_answered_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            user(vec![result("a"), result("a")]),
        ],
        2,
        Some(1),
        unexpected("a"),
    );
}

#[test]
fn text_before_the_tool_results_is_rejected() {
    // Anthropic: "Did not find 1 tool_result block(s) at the beginning of this message": the
    // results must open the message, so the text is where the first result is missing.
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            user(vec![text("here you go"), result("a")]),
        ],
        2,
        Some(0),
        missing("a"),
    );
}

#[test]
fn tool_result_after_text_is_rejected() {
    // All expected results come first; a further result after text is out of place.
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            user(vec![result("a"), text("and"), result("a")]),
        ],
        2,
        Some(2),
        Violation::ToolResultAfterOtherContent,
    );
}

#[test]
fn tool_result_after_text_with_nothing_expected_is_rejected() {
    assert_invalid(
        vec![user(vec![text("hi"), result("a")])],
        0,
        Some(1),
        Violation::ToolResultAfterOtherContent,
    );
}

#[test]
fn assistant_message_right_after_tool_uses_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            assistant(vec![text("I will not wait")]),
        ],
        2,
        None,
        Violation::ToolResultsNotNext,
    );
}

#[test]
fn system_message_right_after_tool_uses_is_rejected_as_misplaced_system() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![tool_use("a", "ls")]),
            system(vec![text("late")]),
        ],
        2,
        None,
        Violation::SystemNotFirst,
    );
}

#[test]
fn ending_on_unanswered_tool_use_is_rejected() {
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![
                thinking("t", "s"),
                text("x"),
                tool_use("a", "ls"),
                tool_use("b", "ls"),
            ]),
        ],
        1,
        Some(2),
        missing("a"),
    );
}

#[test]
fn the_first_broken_rule_is_reported() {
    // Message 1 ends on thinking and message 3 has an empty text: message 1 wins.
    assert_invalid(
        vec![
            user(vec![text("hi")]),
            assistant(vec![text("x"), thinking("t", "s")]),
            user(vec![text("y")]),
            assistant(vec![text("")]),
        ],
        1,
        Some(1),
        Violation::AssistantEndsOnThinking,
    );
    // Within one message, the first bad part wins.
    assert_invalid(
        vec![user(vec![text("hi"), text(""), thinking("t", "")])],
        0,
        Some(1),
        Violation::EmptyText,
    );
}

// ---------------------------------------------------------------------------------------------
// validate_response
// ---------------------------------------------------------------------------------------------

#[test]
fn valid_response_passes() {
    let r = response(
        vec![
            thinking("", "sig-1"),
            text("Let me look."),
            tool_use("a", "ls"),
            redacted("blob"),
            tool_use("b", "cat"),
        ],
        StopReason::ToolUse,
    );
    assert_eq!(validate_response(&r), Ok(()));
    let ids: Vec<&str> = r.tool_uses().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(r.text(), "Let me look.");
}

#[test]
fn response_cut_by_max_tokens_in_text_passes() {
    let r = response(
        vec![tool_use("a", "ls"), text("and then")],
        StopReason::MaxTokens,
    );
    assert_eq!(validate_response(&r), Ok(()));
}

#[test]
fn empty_response_is_rejected() {
    assert_response_invalid(
        response(vec![], StopReason::EndTurn),
        None,
        Violation::EmptyResponse,
    );
}

#[test]
fn tool_result_in_a_response_is_rejected() {
    assert_response_invalid(
        response(vec![text("x"), result("a")], StopReason::EndTurn),
        Some(1),
        not_allowed("tool_result", "assistant"),
    );
}

#[test]
fn duplicate_ids_in_a_response_are_rejected() {
    assert_response_invalid(
        response(
            vec![tool_use("a", "ls"), text("x"), tool_use("a", "cat")],
            StopReason::ToolUse,
        ),
        Some(2),
        Violation::DuplicateToolUseId { id: "a".to_owned() },
    );
}

#[test]
fn response_ending_on_thinking_is_rejected() {
    assert_response_invalid(
        response(vec![text("x"), thinking("t", "s")], StopReason::EndTurn),
        Some(1),
        Violation::AssistantEndsOnThinking,
    );
}

#[test]
fn response_ending_on_redacted_thinking_is_rejected() {
    assert_response_invalid(
        response(vec![redacted("blob")], StopReason::EndTurn),
        Some(0),
        Violation::AssistantEndsOnThinking,
    );
}

#[test]
fn response_cut_by_max_tokens_inside_a_tool_use_is_rejected() {
    assert_response_invalid(
        response(
            vec![text("x"), tool_use("a", "ls"), tool_use("b", "write")],
            StopReason::MaxTokens,
        ),
        Some(2),
        Violation::TruncatedToolUse {
            tool_use_id: "b".to_owned(),
        },
    );
}

#[test]
fn response_with_unsigned_thinking_is_rejected() {
    assert_response_invalid(
        response(
            vec![thinking("partial", ""), text("x")],
            StopReason::EndTurn,
        ),
        Some(0),
        Violation::ThinkingWithoutSignature,
    );
}

#[test]
fn response_with_malformed_parts_is_rejected() {
    assert_response_invalid(
        response(vec![text("")], StopReason::EndTurn),
        Some(0),
        Violation::EmptyText,
    );
    assert_response_invalid(
        response(vec![text("x"), tool_use("", "ls")], StopReason::ToolUse),
        Some(1),
        Violation::EmptyToolUseId,
    );
    assert_response_invalid(
        response(vec![tool_use("a", "")], StopReason::ToolUse),
        Some(0),
        Violation::EmptyToolName,
    );
    assert_response_invalid(
        response(vec![redacted(""), text("x")], StopReason::EndTurn),
        Some(0),
        Violation::EmptyRedactedThinking,
    );
}

// ---------------------------------------------------------------------------------------------
// Display
// ---------------------------------------------------------------------------------------------

#[test]
fn transcript_errors_name_message_and_part() {
    let mut messages = full_round();
    messages[3] = user(vec![result("a"), result("a")]);
    let err = validate_transcript(&transcript(messages)).unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"invalid transcript at message 3, part 1: tool_result "a" answers no open tool_use of the previous assistant message"#
    );
    assert!(err.to_string().contains("message 3, part 1"));
}

#[test]
fn transcript_errors_without_a_part_name_only_the_message() {
    let err = validate_transcript(&transcript(vec![
        user(vec![text("hi")]),
        system(vec![text("late")]),
    ]))
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid transcript at message 1: system message after a non-system message"
    );
}

#[test]
fn response_errors_name_the_part() {
    let err = validate_response(&response(
        vec![text("x"), tool_use("call_7", "write")],
        StopReason::MaxTokens,
    ))
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"invalid model response, part 1: response hit max_tokens inside tool_use "call_7"; the call is incomplete"#
    );
    let err = validate_response(&response(vec![], StopReason::EndTurn)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid model response: response has no parts"
    );
}

// ---------------------------------------------------------------------------------------------
// A check from a point on
// ---------------------------------------------------------------------------------------------

fn invalid_at(message: usize, part: Option<usize>, violation: Violation) -> Result<(), Error> {
    Err(Error::InvalidTranscript {
        message,
        part,
        violation,
    })
}

#[test]
fn a_check_from_a_point_leaves_the_head_unchecked_and_names_tail_messages_by_their_index() {
    let mut messages = full_round();
    messages[1] = user(vec![text("")]); // broken, in the head
    let t = transcript(messages.clone());
    assert_eq!(
        validate_transcript(&t),
        invalid_at(1, Some(0), Violation::EmptyText)
    );
    assert_eq!(validate_transcript_from(&t, 2), Ok(()));
    assert_eq!(validate_transcript_from(&t, 99), Ok(()), "past the end");

    messages[4] = assistant(vec![text("")]); // broken, in the tail
    let t = transcript(messages);
    assert_eq!(
        validate_transcript_from(&t, 2),
        invalid_at(4, Some(0), Violation::EmptyText)
    );
    assert_eq!(
        validate_transcript_from(&t, 4),
        invalid_at(4, Some(0), Violation::EmptyText)
    );
}

#[test]
fn a_check_from_a_point_holds_the_tail_to_the_tool_uses_the_head_leaves_open() {
    let mut messages = full_round();
    messages[3] = user(vec![result("b"), result("a")]);
    let t = transcript(messages.clone());
    let expected = invalid_at(
        3,
        Some(0),
        Violation::ToolResultOutOfOrder {
            expected: "a".to_owned(),
            found: "b".to_owned(),
        },
    );
    assert_eq!(validate_transcript(&t), expected);
    assert_eq!(validate_transcript_from(&t, 3), expected);
    assert_eq!(validate_transcript_from(&t, 4), Ok(()));

    // A transcript whose head ends on open tool_uses, checked from its end: nothing to check.
    messages.truncate(3);
    let t = transcript(messages);
    assert_eq!(
        validate_transcript(&t),
        invalid_at(
            2,
            Some(2),
            Violation::MissingToolResult {
                tool_use_id: "a".to_owned()
            }
        )
    );
    assert_eq!(validate_transcript_from(&t, 3), Ok(()));
}

#[test]
fn a_check_from_a_point_finds_a_late_system_message_and_duplicates_within_the_tail_only() {
    let mut messages = full_round();
    messages.push(system(vec![text("late")]));
    let t = transcript(messages);
    assert_eq!(
        validate_transcript_from(&t, 5),
        invalid_at(5, None, Violation::SystemNotFirst)
    );
    let t = transcript(vec![system(vec![text("a")]), system(vec![text("b")])]);
    assert_eq!(
        validate_transcript_from(&t, 1),
        Ok(()),
        "only system messages before"
    );

    // The tail reuses the head's tool_use id "a": the whole check finds it, the tail's does
    // not (a session's workflow refuses such a response before it joins the transcript).
    let mut messages = full_round();
    messages.push(user(vec![text("again")]));
    messages.push(assistant(vec![tool_use("a", "ls"), tool_use("c", "ls")]));
    messages.push(user(vec![result("a"), result("c")]));
    let t = transcript(messages.clone());
    let duplicate = |id: &str| Violation::DuplicateToolUseId { id: id.to_owned() };
    assert_eq!(
        validate_transcript(&t),
        invalid_at(6, Some(0), duplicate("a"))
    );
    assert_eq!(validate_transcript_from(&t, 5), Ok(()));
    messages.push(assistant(vec![tool_use("c", "ls")]));
    messages.push(user(vec![result("c")]));
    let t = transcript(messages);
    assert_eq!(
        validate_transcript_from(&t, 5),
        invalid_at(8, Some(0), duplicate("c"))
    );
}
