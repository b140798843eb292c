//! Images and documents in a transcript: where they may appear, and each bad one refused with
//! the exact place (message, part, tool-result block) and what is wrong.

use cairn_ledger::{
    estimate_tokens, validate_recorded_response, validate_response, validate_transcript, Error,
    Media, MediaKind, MediaSource, Message, ModelResponse, Part, Role, StopReason, ToolResult,
    ToolResultBlock, ToolResultContent, ToolUse, Transcript, Usage, Violation,
    MEDIA_TOKEN_ESTIMATE,
};

fn message(role: Role, parts: Vec<Part>) -> Message {
    Message {
        role,
        parts,
        provenance: None,
    }
}

fn png() -> Media {
    Media::image_base64("image/png", "iVBORw0KGgo=")
}

fn with_tool_result(content: ToolResultContent) -> Transcript {
    Transcript {
        messages: vec![
            message(Role::User, vec![Part::text("look")]),
            message(
                Role::Assistant,
                vec![Part::ToolUse(ToolUse {
                    id: "t1".into(),
                    name: "shot".into(),
                    arguments: "{}".into(),
                    signature: None,
                })],
            ),
            message(
                Role::User,
                vec![Part::ToolResult(ToolResult {
                    tool_use_id: "t1".into(),
                    content,
                    is_error: false,
                })],
            ),
        ],
    }
}

#[test]
fn media_ride_in_user_messages_and_tool_results_only() {
    let mut t = Transcript::new();
    t.push_user(
        "what is this?",
        &[
            png(),
            Media::url(MediaKind::Document, "https://e.com/a.pdf"),
        ],
    );
    assert_eq!(t.messages[0].parts.len(), 3);
    assert_eq!(t.messages[0].parts[2], Part::text("what is this?"));
    validate_transcript(&t).unwrap();
    // An image alone is a message.
    let mut alone = Transcript::new();
    alone.push_user("", &[png()]);
    assert_eq!(alone.messages[0].parts, vec![Part::Media(png())]);
    validate_transcript(&alone).unwrap();

    let in_assistant = Transcript {
        messages: vec![
            message(Role::User, vec![Part::text("hi")]),
            message(Role::Assistant, vec![Part::Media(png())]),
        ],
    };
    assert_eq!(
        validate_transcript(&in_assistant),
        Err(Error::InvalidTranscript {
            message: 1,
            part: Some(0),
            violation: Violation::PartNotAllowedInRole {
                part_kind: "image",
                role: "assistant"
            }
        })
    );
    validate_transcript(&with_tool_result(ToolResultContent::Blocks(vec![
        ToolResultBlock::Text { text: "x".into() },
        ToolResultBlock::Media(png()),
    ])))
    .unwrap();
}

#[test]
fn a_model_response_with_media_is_refused_but_one_recorded_still_folds() {
    let response = ModelResponse {
        provider: "p".into(),
        model: "m".into(),
        parts: vec![Part::text("here"), Part::Media(png())],
        stop_reason_raw: "end_turn".into(),
        stop_reason: StopReason::EndTurn,
        usage: Usage::default(),
    };
    assert_eq!(
        validate_response(&response),
        Err(Error::InvalidResponse {
            part: Some(1),
            violation: Violation::PartNotAllowedInRole {
                part_kind: "image",
                role: "assistant"
            }
        })
    );
    validate_recorded_response(&response).unwrap();
}

#[test]
fn bad_media_are_refused_naming_message_part_and_block() {
    let bad_pdf = Media {
        kind: MediaKind::Document,
        source: MediaSource::Base64 {
            media_type: "application/msword".into(),
            data: "AA==".into(),
        },
        name: None,
    };
    let mut t = Transcript::new();
    t.push_user("compare", &[png(), bad_pdf]);
    let err = validate_transcript(&t).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid transcript at message 0, part 1: document media type \"application/msword\" \
         is not supported (accepted: application/pdf, text/plain)"
    );

    let err = validate_transcript(&with_tool_result(ToolResultContent::Blocks(vec![
        ToolResultBlock::Text { text: "x".into() },
        ToolResultBlock::Media(Media::image_base64("image/png", "iVBORw0KGgo")),
    ])))
    .unwrap_err();
    let Error::InvalidTranscript {
        message: 2,
        part: Some(0),
        violation:
            Violation::InToolResultBlock {
                block: 1,
                violation,
            },
    } = &err
    else {
        panic!("{err:?}")
    };
    assert!(
        matches!(**violation, Violation::InvalidBase64 { kind: "image", .. }),
        "{violation:?}"
    );
    assert!(err
        .to_string()
        .starts_with("invalid transcript at message 2, part 0: tool_result block 1: image data is not valid base64"));

    assert_eq!(
        validate_transcript(&with_tool_result(ToolResultContent::Blocks(vec![]))),
        Err(Error::InvalidTranscript {
            message: 2,
            part: Some(0),
            violation: Violation::EmptyToolResultBlocks
        })
    );
}

#[test]
fn media_count_a_fixed_token_estimate_not_their_bytes() {
    let mut text_only = Transcript::new();
    text_only.push_user("what is this?", &[]);
    let big = Media::image_bytes("image/png", &vec![0u8; 300_000]);
    let mut with_image = Transcript::new();
    with_image.push_user("what is this?", &[big]);
    let extra = estimate_tokens(&with_image) - estimate_tokens(&text_only);
    assert!(
        (MEDIA_TOKEN_ESTIMATE..MEDIA_TOKEN_ESTIMATE + 40).contains(&extra),
        "{extra}"
    );
}
