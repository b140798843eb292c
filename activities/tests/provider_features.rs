//! Issue 14 §2 provider features against the fake server and the pure renderers: blocks the
//! ledger does not model (server tool calls and results, citations, new block and item types)
//! kept as opaque parts and sent back byte-exact to their family only; server tool
//! declarations; `tool_choice` per provider; Anthropic's prompt-cache breakpoints.

mod support;

use cairn_activities::providers::alias::IdAliases;
use cairn_activities::providers::http::HttpSettings;
use cairn_activities::providers::{anthropic, bedrock, openai_responses, render_request};
use cairn_activities::providers::{RequestFormat, RequestFormat::*};
use cairn_activities::NoDeltas;
use cairn_activities::{ActivityContext, CallContext, ErrorKind, ModelProvider, ModelRequest};
use cairn_ledger::{
    CallOptions, Delta, JsonText, ModelResponse, ModelSpec, Part, ProviderJson, ServerTool,
    ServerToolKind, StopReason, ToolChoice, ToolSpec, Transcript,
};
use serde_json::{json, Value};
use std::sync::Mutex;
use support::{Canned, FakeServer};

fn frame(event: &str, data: &str) -> String {
    format!("event: {event}\ndata: {data}\n\n")
}

fn calc() -> ToolSpec {
    ToolSpec {
        name: "calc".into(),
        description: "Adds".into(),
        input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
    }
}

fn request(
    provider: &str,
    model: &str,
    transcript: Transcript,
    options: CallOptions,
) -> ModelRequest {
    ModelRequest {
        context: CallContext::default(),
        model: ModelSpec::new(provider, model),
        transcript: transcript.into(),
        tools: vec![calc()].into(),
        options,
    }
}

fn server_tools(kinds: &[(ServerToolKind, Option<u32>)]) -> CallOptions {
    CallOptions {
        server_tools: kinds
            .iter()
            .map(|(kind, max_uses)| ServerTool {
                kind: *kind,
                max_uses: *max_uses,
            })
            .collect(),
        ..CallOptions::default()
    }
}

// ---- Anthropic ------------------------------------------------------------------------------

/// The raw `content_block`s of the recorded-shape web search stream, exactly as they are sent.
const SEARCH_RESULT: &str = r#"{"type":"web_search_tool_result","tool_use_id":"srvtoolu_01","content":[{"type":"web_search_result","title":"Rust 1.90","url":"https://blog.example/rust","encrypted_content":"EqgfCioIARgBIiQ3YTAwMjY1Mi1mZjM5","page_age":"September 18, 2025"}]}"#;
const CITATION: &str = r#"{"type":"web_search_result_location","url":"https://blog.example/rust","title":"Rust 1.90","encrypted_index":"Eo8BCioIAhgBIiQyYjQ0","cited_text":"Rust 1.90 is out."}"#;
const NEW_BLOCK: &str = r#"{"type":"brand_new_block","payload":{"n":9007199254740993}}"#;

fn anthropic_search_stream() -> String {
    let mut out = String::new();
    let mut push = |event: &str, data: String| out.push_str(&frame(event, &data));
    push("message_start", r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"usage":{"input_tokens":2100,"cache_creation_input_tokens":1800,"cache_read_input_tokens":0,"output_tokens":3}}}"#.into());
    push(
        "content_block_start",
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#
            .into(),
    );
    push("content_block_delta", r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Let me search."}}"#.into());
    push(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":0}"#.into(),
    );
    // The documented server_tool_use start has no input; it streams as input_json_delta.
    push("content_block_start", r#"{"type":"content_block_start","index":1,"content_block":{"type":"server_tool_use","id":"srvtoolu_01","name":"web_search"}}"#.into());
    push("content_block_delta", r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"query\": \"rust"}}"#.into());
    push("content_block_delta", r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":" 1.90\"}"}}"#.into());
    push(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":1}"#.into(),
    );
    push(
        "content_block_start",
        format!(r#"{{"type":"content_block_start","index":2,"content_block":{SEARCH_RESULT}}}"#),
    );
    push(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":2}"#.into(),
    );
    push("content_block_start", r#"{"type":"content_block_start","index":3,"content_block":{"type":"text","text":"","citations":[]}}"#.into());
    push(
        "content_block_delta",
        format!(
            r#"{{"type":"content_block_delta","index":3,"delta":{{"type":"citations_delta","citation":{CITATION}}}}}"#
        ),
    );
    push("content_block_delta", r#"{"type":"content_block_delta","index":3,"delta":{"type":"text_delta","text":"Rust 1.90 is out."}}"#.into());
    push(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":3}"#.into(),
    );
    push(
        "content_block_start",
        format!(r#"{{"type":"content_block_start","index":4,"content_block":{NEW_BLOCK}}}"#),
    );
    push(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":4}"#.into(),
    );
    push("message_delta", r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":90,"server_tool_use":{"web_search_requests":1}}}"#.into());
    push("message_stop", r#"{"type":"message_stop"}"#.into());
    out
}

fn anthropic(server: &FakeServer) -> anthropic::AnthropicProvider {
    anthropic::AnthropicProvider::new(HttpSettings::new(server.base_url(), Some("k".into())))
}

#[tokio::test]
async fn anthropic_server_tool_blocks_and_citations_are_kept_and_sent_back_verbatim() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&anthropic_search_stream()));
    server.push(Canned::sse(&anthropic_search_stream()));
    let options = CallOptions {
        tool_choice: Some(ToolChoice::Auto),
        ..server_tools(&[
            (ServerToolKind::WebSearch, Some(3)),
            (ServerToolKind::WebFetch, None),
        ])
    };
    let mut transcript = Transcript::new();
    transcript.push_user_text("What is new in Rust?");
    let first = request(
        "anthropic",
        "claude-sonnet-4-5",
        transcript.clone(),
        options.clone(),
    );
    let seen = Mutex::new(String::new());
    let sink = |d: Delta| {
        if let Delta::Text(t) = d {
            seen.lock().unwrap().push_str(&t)
        }
    };
    let response = anthropic(&server)
        .call(&first, &sink, &ActivityContext::detached())
        .await
        .unwrap();
    // The cited text shows as text, live and in the response.
    assert_eq!(*seen.lock().unwrap(), "Let me search.Rust 1.90 is out.");
    assert_eq!(response.text(), "Let me search.Rust 1.90 is out.");
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    assert_eq!(response.usage.cache_write_tokens, 1800);
    let opaque = |json: &str| {
        Part::Opaque(ProviderJson::new(
            "anthropic",
            JsonText::parse(json).unwrap(),
        ))
    };
    assert_eq!(
        response.parts,
        vec![
            Part::text("Let me search."),
            // The streamed input becomes the block's input, exactly as streamed.
            opaque(
                r#"{"type":"server_tool_use","id":"srvtoolu_01","name":"web_search","input":{"query": "rust 1.90"}}"#
            ),
            opaque(SEARCH_RESULT),
            Part::Text {
                text: "Rust 1.90 is out.".into(),
                item_id: None,
                citations: Some(ProviderJson::new(
                    "anthropic",
                    JsonText::parse(format!("[{CITATION}]")).unwrap()
                )),
            },
            opaque(NEW_BLOCK),
        ]
    );

    // The first request declared the server tools as documented, with the web fetch beta.
    let sent = &server.requests()[0];
    assert_eq!(sent.headers["anthropic-beta"], "web-fetch-2025-09-10");
    let body = sent.json();
    assert_eq!(
        body["tools"],
        json!([
            {"name": "calc", "description": "Adds", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
            {"type": "web_fetch_20250910", "name": "web_fetch", "cache_control": {"type": "ephemeral"}}
        ])
    );
    assert_eq!(body["tool_choice"], json!({"type": "auto"}));

    // The next call of the same family gets every block back byte for byte, in position.
    transcript.push_response(&response);
    transcript.push_user_text("And before that?");
    let follow_up = request(
        "anthropic",
        "claude-sonnet-4-5",
        transcript.clone(),
        options,
    );
    anthropic(&server)
        .call(&follow_up, &NoDeltas, &ActivityContext::detached())
        .await
        .unwrap();
    let raw = String::from_utf8(server.requests()[1].body.clone()).unwrap();
    let assistant = format!(
        r#"{{"role":"assistant","content":[{{"type":"text","text":"Let me search."}},{{"type":"server_tool_use","id":"srvtoolu_01","name":"web_search","input":{{"query": "rust 1.90"}}}},{SEARCH_RESULT},{{"type":"text","text":"Rust 1.90 is out.","citations":[{CITATION}]}},{NEW_BLOCK}]}}"#
    );
    assert!(raw.contains(&assistant), "{raw}");

    // Another family gets the text only: no opaque block, no citations.
    for format in [OpenAiResponses, OpenAiChat, Bedrock] {
        let mut other = follow_up.clone();
        other.options = CallOptions::default();
        let body = render_request(format, &other).unwrap().to_string();
        assert!(body.contains("Rust 1.90 is out."), "{format:?}: {body}");
        for gone in [
            "srvtoolu_01",
            "encrypted_index",
            "brand_new_block",
            "citations",
        ] {
            assert!(!body.contains(gone), "{format:?} got {gone}: {body}");
        }
    }
}

#[test]
fn anthropic_tool_choice_caching_and_their_checks() {
    let mut t = Transcript::new();
    t.push_system("Be brief.");
    t.push_user_text("hi");
    let render = |options: CallOptions| {
        render_request(Anthropic, &request("anthropic", "m", t.clone(), options))
    };
    for (choice, wire) in [
        (ToolChoice::Auto, json!({"type": "auto"})),
        (ToolChoice::Any, json!({"type": "any"})),
        (ToolChoice::None, json!({"type": "none"})),
        (
            ToolChoice::Tool("calc".into()),
            json!({"type": "tool", "name": "calc"}),
        ),
    ] {
        let body = render(CallOptions {
            tool_choice: Some(choice),
            ..CallOptions::default()
        })
        .unwrap();
        assert_eq!(body["tool_choice"], wire);
    }
    // Three breakpoints by default (of Anthropic's four); none when turned off.
    let count = |v: &Value| v.to_string().matches("cache_control").count();
    assert_eq!(count(&render(CallOptions::default()).unwrap()), 3);
    let off = render(CallOptions {
        no_prompt_cache: true,
        ..CallOptions::default()
    })
    .unwrap();
    assert_eq!(count(&off), 0);
    // A forced call with extended thinking is refused before the call.
    let mut thinking = request(
        "anthropic",
        "m",
        t.clone(),
        CallOptions {
            tool_choice: Some(ToolChoice::Any),
            ..CallOptions::default()
        },
    );
    thinking.model.max_tokens = Some(8000);
    thinking.model.thinking_budget_tokens = Some(2000);
    let err = render_request(Anthropic, &thinking).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(err.to_string().contains("extended thinking"), "{err}");
    // A named tool that does not exist.
    let err = render(CallOptions {
        tool_choice: Some(ToolChoice::Tool("nope".into())),
        ..CallOptions::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("\"nope\""), "{err}");
}

// ---- OpenAI Responses -----------------------------------------------------------------------

const SEARCH_CALL: &str = r#"{"id":"ws_67c9fa0502748190","type":"web_search_call","status":"completed","action":{"type":"search","query":"rust 1.90"}}"#;
const ANNOTATIONS: &str = r#"[{"type":"url_citation","start_index":0,"end_index":17,"url":"https://blog.example/rust","title":"Rust 1.90"}]"#;
const NEW_ITEM: &str = r#"{"id":"nx_1","type":"brand_new_item","data":{"n":1}}"#;

fn responses_search_stream() -> String {
    let message = format!(
        r#"{{"id":"msg_1","type":"message","status":"completed","role":"assistant","content":[{{"type":"output_text","text":"Rust 1.90 is out.","annotations":{ANNOTATIONS}}}]}}"#
    );
    let mut out = String::new();
    let mut push = |event: &str, data: String| out.push_str(&frame(event, &data));
    push("response.created", r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","model":"gpt-5","output":[]}}"#.into());
    push("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"ws_67c9fa0502748190","type":"web_search_call","status":"in_progress"}}"#.into());
    push("response.web_search_call.searching", r#"{"type":"response.web_search_call.searching","sequence_number":2,"output_index":0,"item_id":"ws_67c9fa0502748190"}"#.into());
    push(
        "response.output_item.done",
        format!(
            r#"{{"type":"response.output_item.done","sequence_number":3,"output_index":0,"item":{SEARCH_CALL}}}"#
        ),
    );
    push("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":4,"output_index":1,"item":{"id":"msg_1","type":"message","status":"in_progress","role":"assistant","content":[]}}"#.into());
    push("response.output_text.delta", r#"{"type":"response.output_text.delta","sequence_number":5,"item_id":"msg_1","output_index":1,"content_index":0,"delta":"Rust 1.90 is out."}"#.into());
    push("response.output_text.annotation.added", r#"{"type":"response.output_text.annotation.added","sequence_number":6,"item_id":"msg_1","output_index":1,"content_index":0,"annotation_index":0,"annotation":{"type":"url_citation"}}"#.into());
    push(
        "response.output_item.done",
        format!(
            r#"{{"type":"response.output_item.done","sequence_number":7,"output_index":1,"item":{message}}}"#
        ),
    );
    push("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":8,"output_index":2,"item":{"id":"nx_1","type":"brand_new_item"}}"#.into());
    push(
        "response.output_item.done",
        format!(
            r#"{{"type":"response.output_item.done","sequence_number":9,"output_index":2,"item":{NEW_ITEM}}}"#
        ),
    );
    push("response.completed", r#"{"type":"response.completed","sequence_number":10,"response":{"id":"resp_1","status":"completed","model":"gpt-5","usage":{"input_tokens":300,"input_tokens_details":{"cached_tokens":100},"output_tokens":40,"output_tokens_details":{"reasoning_tokens":0}}}}"#.into());
    out
}

#[tokio::test]
async fn responses_web_search_calls_annotations_and_new_items_go_back_verbatim() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&responses_search_stream()));
    server.push(Canned::sse(&responses_search_stream()));
    let provider = openai_responses::OpenAiResponsesProvider::new(HttpSettings::new(
        server.base_url(),
        Some("sk".into()),
    ));
    let options = CallOptions {
        tool_choice: Some(ToolChoice::Any),
        ..server_tools(&[(ServerToolKind::WebSearch, None)])
    };
    let mut transcript = Transcript::new();
    transcript.push_user_text("What is new in Rust?");
    let first = request(
        "openai-responses",
        "gpt-5",
        transcript.clone(),
        options.clone(),
    );
    let response = provider
        .call(&first, &NoDeltas, &ActivityContext::detached())
        .await
        .unwrap();
    let family = |json: &str| ProviderJson::new("openai-responses", JsonText::parse(json).unwrap());
    assert_eq!(
        response.parts,
        vec![
            Part::Opaque(family(SEARCH_CALL)),
            Part::Text {
                text: "Rust 1.90 is out.".into(),
                item_id: Some("msg_1".into()),
                citations: Some(family(ANNOTATIONS)),
            },
            Part::Opaque(family(NEW_ITEM)),
        ]
    );
    let body = server.requests()[0].json();
    assert_eq!(
        body["tools"],
        json!([
            {"type": "function", "name": "calc", "description": "Adds", "parameters": {"type": "object"}, "strict": false},
            {"type": "web_search"}
        ])
    );
    assert_eq!(body["tool_choice"], "required");

    transcript.push_response(&response);
    transcript.push_user_text("More?");
    let follow_up = request("openai-responses", "gpt-5", transcript.clone(), options);
    provider
        .call(&follow_up, &NoDeltas, &ActivityContext::detached())
        .await
        .unwrap();
    let raw = String::from_utf8(server.requests()[1].body.clone()).unwrap();
    assert!(raw.contains(SEARCH_CALL), "{raw}");
    assert!(raw.contains(NEW_ITEM), "{raw}");
    let body: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(
        body["input"][2]["content"][0]["annotations"],
        serde_json::from_str::<Value>(ANNOTATIONS).unwrap()
    );
    // Anthropic gets the text alone.
    let mut other = follow_up.clone();
    other.options = CallOptions::default();
    let body = render_request(Anthropic, &other).unwrap().to_string();
    assert!(body.contains("Rust 1.90 is out."), "{body}");
    for gone in ["ws_67c9", "url_citation", "brand_new_item"] {
        assert!(!body.contains(gone), "{gone}: {body}");
    }
}

// ---- Every provider: tool_choice and server tools ------------------------------------------

#[test]
fn tool_choice_renders_per_provider_and_unsupported_options_are_typed_errors() {
    let mut t = Transcript::new();
    t.push_user_text("hi");
    let with = |provider: &str, options: CallOptions| {
        request(provider, "anthropic.claude-sonnet-4-5", t.clone(), options)
    };
    let choice = |c: ToolChoice| CallOptions {
        tool_choice: Some(c),
        ..CallOptions::default()
    };
    let cases: [(RequestFormat, &str, &str, Value, Value); 3] = [
        (
            OpenAiChat,
            "openai",
            "/tool_choice",
            json!("required"),
            json!({"type": "function", "function": {"name": "calc"}}),
        ),
        (
            OpenAiResponses,
            "openai-responses",
            "/tool_choice",
            json!("required"),
            json!({"type": "function", "name": "calc"}),
        ),
        (
            Bedrock,
            "bedrock",
            "/toolConfig/toolChoice",
            json!({"any": {}}),
            json!({"tool": {"name": "calc"}}),
        ),
    ];
    for (format, provider, pointer, any, named) in cases {
        let body = render_request(format, &with(provider, choice(ToolChoice::Any))).unwrap();
        assert_eq!(body.pointer(pointer), Some(&any), "{format:?}");
        let body = render_request(
            format,
            &with(provider, choice(ToolChoice::Tool("calc".into()))),
        )
        .unwrap();
        assert_eq!(body.pointer(pointer), Some(&named), "{format:?}");
        // Unset: nothing sent, the provider's default.
        let body = render_request(format, &with(provider, CallOptions::default())).unwrap();
        assert_eq!(body.pointer(pointer), None, "{format:?}");
    }
    let body = render_request(OpenAiChat, &with("openai", choice(ToolChoice::None))).unwrap();
    assert_eq!(body["tool_choice"], "none");
    // Converse has no "none".
    let err = render_request(Bedrock, &with("bedrock", choice(ToolChoice::None))).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(
        err.to_string()
            .contains("tool_choice none cannot be expressed"),
        "{err}"
    );

    // A server tool the provider does not offer: named, before any call.
    let fetch = server_tools(&[(ServerToolKind::WebFetch, None)]);
    for (format, provider) in [
        (OpenAiChat, "openai"),
        (OpenAiResponses, "openai-responses"),
        (Bedrock, "bedrock"),
    ] {
        let err = render_request(format, &with(provider, fetch.clone())).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        assert!(
            err.to_string().contains(&format!(
                "server tool web_fetch, which {provider} does not offer"
            )),
            "{err}"
        );
    }
    let limited = server_tools(&[(ServerToolKind::WebSearch, Some(2))]);
    let err = render_request(OpenAiResponses, &with("openai-responses", limited)).unwrap_err();
    assert!(err.to_string().contains("no max_uses"), "{err}");
}

// ---- Bedrock: blocks it does not model do not break the turn, and are kept -----------------------------

#[test]
fn bedrock_keeps_blocks_and_citations_it_does_not_model() {
    let mut parser = bedrock::StreamParser::new("m", IdAliases::new());
    let events: [(&str, &str); 9] = [
        ("messageStart", r#"{"role":"assistant"}"#),
        (
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"text":"Rust 1.90 is out."}}"#,
        ),
        // A citation on the text block: kept beside the text.
        (
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"citation":{"location":{"web":{"url":"https://blog.example"}}}}}"#,
        ),
        ("contentBlockStop", r#"{"contentBlockIndex":0}"#),
        // A block started as something other than toolUse (a server tool's result).
        (
            "contentBlockStart",
            r#"{"contentBlockIndex":1,"start":{"toolResult":{"toolUseId":"t1"}}}"#,
        ),
        (
            "contentBlockDelta",
            r#"{"contentBlockIndex":1,"delta":{"toolResult":[{"text":"results"}]}}"#,
        ),
        ("contentBlockStop", r#"{"contentBlockIndex":1}"#),
        ("messageStop", r#"{"stopReason":"end_turn"}"#),
        (
            "metadata",
            r#"{"usage":{"inputTokens":1,"outputTokens":2,"totalTokens":3}}"#,
        ),
    ];
    for (name, payload) in events {
        parser.feed(name, payload.as_bytes(), &NoDeltas).unwrap();
    }
    let response: ModelResponse = parser.finish().unwrap();
    assert_eq!(
        response.parts,
        vec![
            Part::Text {
                text: "Rust 1.90 is out.".into(),
                item_id: None,
                citations: Some(ProviderJson::new(
                    "bedrock",
                    JsonText::parse(r#"[{"location":{"web":{"url":"https://blog.example"}}}]"#)
                        .unwrap()
                )),
            },
            Part::Opaque(ProviderJson::new(
                "bedrock",
                JsonText::parse(
                    r#"{"toolResult":{"toolUseId":"t1","content":[{"text":"results"}]}}"#
                )
                .unwrap()
            )),
        ]
    );
}
