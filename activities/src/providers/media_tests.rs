//! The exact request JSON each provider renders for images and documents in a user message and
//! an image in a tool result, and the typed refusals where a provider cannot carry a kind.

use super::{anthropic, bedrock, openai_chat, openai_responses};
use crate::error::{Error, ErrorKind};
use crate::model::{CallContext, ModelRequest};
use cairn_ledger::{
    JsonText, Media, MediaKind, MediaSource, Message, ModelSpec, Part, Role, ToolResult,
    ToolResultBlock, ToolResultContent, ToolSpec, ToolUse, Transcript,
};
use serde_json::{json, Value};

const PNG: &str = "iVBORw0KGgo=";
const PDF: &str = "JVBERi0xLjQ=";
const HELLO: &str = "aGVsbG8=";

fn pdf() -> Media {
    Media {
        kind: MediaKind::Document,
        source: MediaSource::Base64 {
            media_type: "application/pdf".into(),
            data: PDF.into(),
        },
        name: Some("report.pdf".into()),
    }
}

fn text_document() -> Media {
    Media {
        kind: MediaKind::Document,
        source: MediaSource::Base64 {
            media_type: "text/plain".into(),
            data: HELLO.into(),
        },
        name: None,
    }
}

fn image_url() -> Media {
    Media::url(MediaKind::Image, "https://example.com/cat.jpg")
}

fn pdf_url() -> Media {
    Media::url(MediaKind::Document, "https://example.com/a.pdf")
}

/// A user message of `media` and text, a tool call, and its result of text and an image.
fn transcript(media: Vec<Media>) -> Transcript {
    let mut transcript = Transcript::new();
    transcript.push_user("What do these show?", &media);
    transcript.messages.push(Message {
        role: Role::Assistant,
        parts: vec![Part::ToolUse(ToolUse {
            id: "toolu_01".into(),
            name: "screenshot".into(),
            arguments: "{}".into(),
            signature: None,
        })],
        provenance: None,
    });
    transcript.push_tool_results([ToolResult {
        tool_use_id: "toolu_01".into(),
        content: ToolResultContent::Blocks(vec![
            ToolResultBlock::Text {
                text: "the screen".into(),
            },
            ToolResultBlock::Media(Media::image_base64("image/png", PNG)),
        ]),
        is_error: false,
    }]);
    transcript
}

fn request(provider: &str, model: &str, transcript: Transcript) -> ModelRequest {
    ModelRequest {
        context: CallContext::default(),
        model: ModelSpec {
            provider: provider.into(),
            model: model.into(),
            max_tokens: Some(1024),
            thinking_budget_tokens: None,
        },
        transcript: transcript.into(),
        tools: vec![ToolSpec {
            name: "screenshot".into(),
            description: "takes a screenshot".into(),
            input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
        }]
        .into(),
        // Cache breakpoints (on by default for Anthropic) are another test's subject.
        options: cairn_ledger::CallOptions {
            no_prompt_cache: true,
            ..Default::default()
        },
    }
}

fn refused(result: crate::error::Result<Value>, needle: &str) {
    match result {
        Err(Error::Provider {
            kind: ErrorKind::InvalidRequest,
            message,
        }) => assert!(
            message.contains(needle) && message.contains("message 0 part"),
            "{message}"
        ),
        other => panic!("expected an invalid request about {needle:?}, got {other:?}"),
    }
}

fn png_image() -> Media {
    Media::image_base64("image/png", PNG)
}

#[test]
fn anthropic_renders_image_and_document_blocks_and_tool_result_images() {
    let media = vec![png_image(), image_url(), pdf(), text_document(), pdf_url()];
    let body = anthropic::render(&request("anthropic", "claude-test", transcript(media))).unwrap();
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF}, "title": "report.pdf"},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hello"}},
                {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}},
                {"type": "text", "text": "What do these show?"},
            ]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_01", "name": "screenshot", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": [
                    {"type": "text", "text": "the screen"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                ], "is_error": false},
            ]},
        ])
    );
}

#[test]
fn openai_chat_renders_image_urls_pdf_files_and_tool_images_in_a_following_user_message() {
    let media = vec![png_image(), image_url(), pdf(), text_document()];
    let body = openai_chat::render(&request("openai", "gpt-test", transcript(media))).unwrap();
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{PNG}")}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                {"type": "file", "file": {"filename": "report.pdf", "file_data": format!("data:application/pdf;base64,{PDF}")}},
                {"type": "text", "text": "hello"},
                {"type": "text", "text": "What do these show?"},
            ]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "toolu_01", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "toolu_01", "content": "the screen\n[image]"},
            {"role": "user", "content": [
                {"type": "text", "text": "The result of tool call toolu_01 includes:"},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{PNG}")}},
            ]},
        ])
    );
    // Chat Completions takes no file URL.
    refused(
        openai_chat::render(&request("openai", "gpt-test", transcript(vec![pdf_url()]))),
        "no file URLs",
    );
}

#[test]
fn openai_responses_renders_input_images_files_and_function_output_lists() {
    let media = vec![png_image(), image_url(), pdf(), text_document(), pdf_url()];
    let body =
        openai_responses::render(&request("openai-responses", "gpt-test", transcript(media)))
            .unwrap();
    let input = body["input"].as_array().unwrap();
    assert_eq!(
        input[0],
        json!({"role": "user", "content": [
            {"type": "input_image", "image_url": format!("data:image/png;base64,{PNG}"), "detail": "auto"},
            {"type": "input_image", "image_url": "https://example.com/cat.jpg", "detail": "auto"},
            {"type": "input_file", "filename": "report.pdf", "file_data": format!("data:application/pdf;base64,{PDF}")},
            {"type": "input_file", "filename": "document.txt", "file_data": format!("data:text/plain;base64,{HELLO}")},
            {"type": "input_file", "file_url": "https://example.com/a.pdf"},
            {"type": "input_text", "text": "What do these show?"},
        ]})
    );
    assert_eq!(
        input.last().unwrap(),
        &json!({"type": "function_call_output", "call_id": "toolu_01", "output": [
            {"type": "input_text", "text": "the screen"},
            {"type": "input_image", "image_url": format!("data:image/png;base64,{PNG}"), "detail": "auto"},
        ]})
    );
}

#[test]
fn bedrock_renders_image_and_document_bytes_and_refuses_urls() {
    let media = vec![png_image(), pdf(), text_document()];
    let body = bedrock::render(&request(
        "bedrock",
        "anthropic.claude-test",
        transcript(media),
    ))
    .unwrap();
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": [
                {"image": {"format": "png", "source": {"bytes": PNG}}},
                {"document": {"format": "pdf", "name": "report", "source": {"bytes": PDF}}},
                {"document": {"format": "txt", "name": "document", "source": {"bytes": HELLO}}},
                {"text": "What do these show?"},
            ]},
            {"role": "assistant", "content": [
                {"toolUse": {"toolUseId": "toolu_01", "name": "screenshot", "input": {}}},
            ]},
            {"role": "user", "content": [
                {"toolResult": {"toolUseId": "toolu_01", "content": [
                    {"text": "the screen"},
                    {"image": {"format": "png", "source": {"bytes": PNG}}},
                ]}},
            ]},
        ])
    );
    for url in [image_url(), pdf_url()] {
        refused(
            bedrock::render(&request(
                "bedrock",
                "anthropic.claude-test",
                transcript(vec![url]),
            )),
            "not from a URL",
        );
    }
}

#[test]
fn every_provider_refuses_bad_media_before_the_call() {
    let bad = Media::image_base64("image/png", "not base64!");
    for (provider, model) in [
        ("anthropic", "claude-test"),
        ("openai", "gpt-test"),
        ("openai-responses", "gpt-test"),
        ("bedrock", "anthropic.claude-test"),
    ] {
        let req = request(provider, model, transcript(vec![bad.clone()]));
        let result = match provider {
            "anthropic" => anthropic::render(&req),
            "openai" => openai_chat::render(&req),
            "openai-responses" => openai_responses::render(&req),
            _ => bedrock::render(&req),
        };
        match result {
            Err(Error::Provider {
                kind: ErrorKind::InvalidRequest,
                message,
            }) => assert!(
                message.contains("message 0") && message.contains("not valid base64"),
                "{provider}: {message}"
            ),
            other => panic!("{provider}: expected a refusal, got {other:?}"),
        }
    }
}
