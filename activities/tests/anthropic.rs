//! The Anthropic Messages provider against the fake server: documented stream shapes into the
//! canonical response, the follow-up request sent byte-exact, classified HTTP and in-stream
//! errors, and malformed streams as typed errors.

mod support;

use cairn_activities::providers::alias::IdAliases;
use cairn_activities::providers::anthropic::{
    AnthropicProvider, StreamParser, API_VERSION, INTERLEAVED_THINKING_BETA, PROVIDER,
};
use cairn_activities::providers::http::HttpSettings;
use cairn_activities::{
    ActivityContext, CallContext, Error, ErrorKind, ModelProvider, ModelRequest, NoDeltas,
};
use cairn_ledger::{
    Delta, JsonText, ModelResponse, ModelSpec, Part, StopReason, ToolResult, ToolResultContent,
    ToolSpec, ToolUse, Transcript, Usage,
};
use serde_json::{json, Value};
use std::sync::Mutex;
use std::time::Duration;
use support::{Canned, FakeServer, Recorded};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "claude-sonnet-4-5";
const KEY: &str = "test-key";
/// A number a `f64` cannot hold: it must reach the wire as this exact text.
const BIG: &str = "9007199254740993";

/// An SSE body in the documented framing: `event: <type>` and `data: <json>` per event.
fn sse(events: &[Value]) -> String {
    let mut out = String::new();
    for event in events {
        let name = event["type"].as_str().unwrap();
        out.push_str(&format!("event: {name}\ndata: {event}\n\n"));
    }
    out
}

fn message_start(usage: Value) -> Value {
    json!({"type": "message_start", "message": {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message", "role": "assistant",
        "content": [], "model": MODEL, "stop_reason": null, "stop_sequence": null,
        "usage": usage}})
}

fn start(index: u32, block: Value) -> Value {
    json!({"type": "content_block_start", "index": index, "content_block": block})
}

fn delta(index: u32, delta: Value) -> Value {
    json!({"type": "content_block_delta", "index": index, "delta": delta})
}

fn text_delta(index: u32, text: &str) -> Value {
    delta(index, json!({"type": "text_delta", "text": text}))
}

fn thinking_delta(index: u32, text: &str) -> Value {
    delta(index, json!({"type": "thinking_delta", "thinking": text}))
}

fn signature_delta(index: u32, signature: &str) -> Value {
    delta(
        index,
        json!({"type": "signature_delta", "signature": signature}),
    )
}

fn json_delta(index: u32, partial: &str) -> Value {
    delta(
        index,
        json!({"type": "input_json_delta", "partial_json": partial}),
    )
}

fn stop(index: u32) -> Value {
    json!({"type": "content_block_stop", "index": index})
}

fn message_delta(stop_reason: &str, output_tokens: u64) -> Value {
    json!({"type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": null},
        "usage": {"output_tokens": output_tokens}})
}

fn message_stop() -> Value {
    json!({"type": "message_stop"})
}

fn thinking_start() -> Value {
    json!({"type": "thinking", "thinking": ""})
}

fn text_start() -> Value {
    json!({"type": "text", "text": ""})
}

fn tool_start(id: &str) -> Value {
    json!({"type": "tool_use", "id": id, "name": "calc", "input": {}})
}

fn calc() -> ToolSpec {
    ToolSpec {
        name: "calc".into(),
        description: "Adds two numbers".into(),
        input_schema: JsonText::parse(
            r#"{"type":"object","properties":{"a":{"type":"number"},"b":{"type":"number"}}}"#,
        )
        .unwrap(),
    }
}

fn request(transcript: Transcript, thinking: Option<u32>) -> ModelRequest {
    ModelRequest {
        options: Default::default(),
        context: CallContext::default(),
        model: ModelSpec {
            provider: PROVIDER.into(),
            model: MODEL.into(),
            max_tokens: Some(16000),
            thinking_budget_tokens: thinking,
        },
        transcript: transcript.into(),
        tools: vec![calc()].into(),
    }
}

fn first_request() -> ModelRequest {
    let mut t = Transcript::new();
    t.push_system("Be brief.");
    t.push_user_text("Add the numbers.");
    request(t, Some(4000))
}

fn provider(server: &FakeServer) -> AnthropicProvider {
    AnthropicProvider::new(HttpSettings::new(server.base_url(), Some(KEY.into())))
}

async fn call(server: &FakeServer, request: &ModelRequest) -> Result<ModelResponse, Error> {
    provider(server)
        .call(request, &NoDeltas, &ActivityContext::detached())
        .await
}

/// Stream (1): thinking with its signature, text, two parallel tool calls, usage.
fn parallel_stream() -> String {
    sse(&[
        message_start(
            json!({"input_tokens": 472, "cache_creation_input_tokens": 7,
            "cache_read_input_tokens": 11, "output_tokens": 2}),
        ),
        start(0, thinking_start()),
        thinking_delta(0, "Two calls,"),
        thinking_delta(0, " in parallel."),
        signature_delta(0, "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds=="),
        stop(0),
        json!({"type": "ping"}),
        start(1, text_start()),
        text_delta(1, "Let me"),
        text_delta(1, " compute."),
        stop(1),
        start(2, tool_start("toolu_01A")),
        json_delta(2, ""),
        json_delta(2, &format!("{{\"a\": {BIG},")),
        json_delta(2, " \"b\": 1.50}"),
        stop(2),
        start(3, tool_start("toolu_01B")),
        json_delta(3, r#"{"z": 1, "a": 2}"#),
        stop(3),
        message_delta("tool_use", 89),
        message_stop(),
    ])
}

fn parallel_parts() -> Vec<Part> {
    vec![
        Part::Thinking {
            text: "Two calls, in parallel.".into(),
            signature: "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds==".into(),
        },
        Part::text("Let me compute."),
        Part::ToolUse(ToolUse {
            id: "toolu_01A".into(),
            name: "calc".into(),
            arguments: format!("{{\"a\": {BIG}, \"b\": 1.50}}"),
            signature: None,
        }),
        Part::ToolUse(ToolUse {
            id: "toolu_01B".into(),
            name: "calc".into(),
            arguments: r#"{"z": 1, "a": 2}"#.into(),
            signature: None,
        }),
    ]
}

#[tokio::test]
async fn thinking_text_and_parallel_tool_calls_stream_into_the_canonical_response() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&parallel_stream()));
    let seen = Mutex::new(Vec::new());
    let sink = |d: Delta| seen.lock().unwrap().push(d);
    let response = provider(&server)
        .call(&first_request(), &sink, &ActivityContext::detached())
        .await
        .unwrap();
    assert_eq!(
        response,
        ModelResponse {
            provider: "anthropic".into(),
            model: MODEL.into(),
            parts: parallel_parts(),
            stop_reason_raw: "tool_use".into(),
            stop_reason: StopReason::ToolUse,
            usage: Usage {
                input_tokens: 472,
                output_tokens: 89,
                cache_read_tokens: 11,
                cache_write_tokens: 7,
                reasoning_tokens: 0,
            },
        }
    );
    let args = |id: &str, fragment: &str| Delta::ToolArguments {
        tool_use_id: id.into(),
        fragment: fragment.into(),
    };
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            Delta::Thinking("Two calls,".into()),
            Delta::Thinking(" in parallel.".into()),
            Delta::Text("Let me".into()),
            Delta::Text(" compute.".into()),
            args("toolu_01A", &format!("{{\"a\": {BIG},")),
            args("toolu_01A", " \"b\": 1.50}"),
            args("toolu_01B", r#"{"z": 1, "a": 2}"#),
        ]
    );
    // The first request: headers, path and body.
    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    let sent = &requests[0];
    assert_eq!(sent.path, "/v1/messages");
    assert_eq!(sent.headers["x-api-key"], KEY);
    assert_eq!(sent.headers["anthropic-version"], API_VERSION);
    assert_eq!(sent.headers["anthropic-beta"], INTERLEAVED_THINKING_BETA);
    assert_eq!(
        sent.json(),
        json!({
            "model": MODEL, "max_tokens": 16000, "stream": true,
            // Prompt-cache breakpoints: the system prompt, the tools, the last message.
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Add the numbers.",
                "cache_control": {"type": "ephemeral"}}]}],
            "tools": [{"name": "calc", "description": "Adds two numbers", "input_schema":
                {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
                "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "enabled", "budget_tokens": 4000}
        })
    );
}

#[tokio::test]
async fn redacted_thinking_is_kept_in_position() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        message_start(json!({"input_tokens": 10, "output_tokens": 1})),
        start(
            0,
            json!({"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}),
        ),
        stop(0),
        start(
            1,
            json!({"type": "thinking", "thinking": "", "signature": ""}),
        ),
        thinking_delta(1, "Visible part."),
        signature_delta(1, "c2lnLTE="),
        stop(1),
        start(2, text_start()),
        text_delta(2, "Done."),
        stop(2),
        message_delta("end_turn", 30),
        message_stop(),
    ])));
    let response = call(&server, &first_request()).await.unwrap();
    assert_eq!(
        response.parts,
        vec![
            Part::RedactedThinking {
                data: "EmwKAhgBEgy3va3pzix/LafPsn4a".into()
            },
            Part::Thinking {
                text: "Visible part.".into(),
                signature: "c2lnLTE=".into()
            },
            Part::text("Done."),
        ]
    );
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    assert_eq!(response.usage.output_tokens, 30);
}

#[tokio::test]
async fn interleaved_thinking_between_tool_uses_keeps_its_order() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        message_start(json!({"input_tokens": 10, "output_tokens": 1})),
        start(0, thinking_start()),
        thinking_delta(0, "First A."),
        signature_delta(0, "c2lnLUE="),
        stop(0),
        start(1, tool_start("toolu_A")),
        json_delta(1, r#"{"a":1}"#),
        stop(1),
        start(2, thinking_start()),
        thinking_delta(2, "Then B."),
        signature_delta(2, "c2lnLUI="),
        stop(2),
        start(3, tool_start("toolu_B")),
        stop(3),
        message_delta("tool_use", 40),
        message_stop(),
    ])));
    let response = call(&server, &first_request()).await.unwrap();
    let kinds: Vec<&str> = response.parts.iter().map(Part::kind).collect();
    assert_eq!(kinds, ["thinking", "tool_use", "thinking", "tool_use"]);
    assert_eq!(
        response.parts[2],
        Part::Thinking {
            text: "Then B.".into(),
            signature: "c2lnLUI=".into()
        }
    );
    // No input_json_delta at all: the input is `{}`.
    let Part::ToolUse(b) = &response.parts[3] else {
        panic!("{:?}", response.parts[3])
    };
    assert_eq!((b.id.as_str(), b.arguments.as_str()), ("toolu_B", "{}"));
}

fn follow_up_transcript(first: &ModelResponse) -> Transcript {
    let mut t = Transcript::new();
    t.push_system("Be brief.");
    t.push_user_text("Add the numbers.");
    t.push_response(first);
    t.push_tool_results([
        ToolResult {
            tool_use_id: "toolu_01A".into(),
            content: ToolResultContent::Json(
                JsonText::parse(format!(r#"{{"sum": {BIG}, "unit": null}}"#)).unwrap(),
            ),
            is_error: false,
        },
        ToolResult {
            tool_use_id: "toolu_01B".into(),
            content: ToolResultContent::Text("division by zero".into()),
            is_error: true,
        },
    ]);
    t
}

#[tokio::test]
async fn the_follow_up_request_echoes_thinking_and_arguments_byte_for_byte() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&parallel_stream()));
    server.push(Canned::sse(&sse(&[
        message_start(json!({"input_tokens": 600, "output_tokens": 1})),
        start(0, text_start()),
        text_delta(0, "The sum is 9007199254740994."),
        stop(0),
        message_delta("end_turn", 12),
        message_stop(),
    ])));
    let first = call(&server, &first_request()).await.unwrap();
    let second = call(&server, &request(follow_up_transcript(&first), Some(4000)))
        .await
        .unwrap();
    assert_eq!(second.text(), "The sum is 9007199254740994.");

    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    let sent = &requests[1];
    assert_eq!(sent.headers["x-api-key"], KEY);
    assert_eq!(sent.headers["anthropic-version"], "2023-06-01");
    let raw = std::str::from_utf8(&sent.body).unwrap();
    // Exact text on the wire: the signature, the arguments with their big number, spacing and
    // key order, and the JSON tool result.
    assert!(
        raw.contains(
            r#"{"type":"thinking","thinking":"Two calls, in parallel.","signature":"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds=="}"#
        ),
        "{raw}"
    );
    assert!(
        raw.contains(&format!(
            r#"{{"type":"tool_use","id":"toolu_01A","name":"calc","input":{{"a": {BIG}, "b": 1.50}}}}"#
        )),
        "{raw}"
    );
    assert!(
        raw.contains(
            r#"{"type":"tool_use","id":"toolu_01B","name":"calc","input":{"z": 1, "a": 2}}"#
        ),
        "{raw}"
    );
    let body = sent.json();
    let messages = body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(messages[1]["role"], "assistant");
    let kinds: Vec<&str> = messages[1]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["thinking", "text", "tool_use", "tool_use"]);
    assert_eq!(
        messages[2],
        json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A",
             "content": [{"type": "text", "text": format!(r#"{{"sum": {BIG}, "unit": null}}"#)}],
             "is_error": false},
            {"type": "tool_result", "tool_use_id": "toolu_01B",
             "content": "division by zero", "is_error": true,
             // The caching rule's breakpoint on the last block of the last message.
             "cache_control": {"type": "ephemeral"}}
        ]})
    );
    // And on the system prompt and the tools.
    assert_eq!(
        body["system"],
        json!([{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
    );
    assert_eq!(
        body["tools"][0]["cache_control"],
        json!({"type": "ephemeral"})
    );
    // The ids the results answer are the ids of the tool_uses, in declaration order.
    assert_eq!(
        messages[1]["content"][2]["id"],
        messages[2]["content"][0]["tool_use_id"]
    );
    assert_eq!(
        messages[1]["content"][3]["id"],
        messages[2]["content"][1]["tool_use_id"]
    );
}

/// Answers like Anthropic when the loop's assistant turn does not open with thinking or a
/// thinking signature is not one the fake server issued.
fn strict_judge(recorded: &Recorded) -> Option<Canned> {
    let body: Value = serde_json::from_slice(&recorded.body).ok()?;
    let bad = |message: &str| {
        Some(Canned::error(
            400,
            &json!({"type": "error", "error": {"type": "invalid_request_error", "message": message},
                "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy"})
            .to_string(),
        ))
    };
    let messages = body["messages"].as_array()?;
    for (mi, message) in messages.iter().enumerate() {
        for (bi, block) in message["content"].as_array()?.iter().enumerate() {
            if block["type"] == "thinking" && block["signature"] != "c2lnLU9L" {
                return bad(&format!(
                    "messages.{mi}.content.{bi}: Invalid `signature` in `thinking` block"
                ));
            }
        }
    }
    let assistant = messages.iter().rposition(|m| m["role"] == "assistant")?;
    if body.get("thinking").is_some() && messages[assistant]["content"][0]["type"] != "thinking" {
        return bad("messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `tool_use`. When `thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). We recommend you include thinking blocks from previous turns. To avoid this requirement, disable `thinking`. Please consult our documentation at https://docs.claude.com/en/docs/build-with-claude/extended-thinking");
    }
    None
}

fn loop_with(parts: Vec<Part>) -> Transcript {
    let mut t = Transcript::new();
    t.push_user_text("Add.");
    let response = ModelResponse {
        provider: PROVIDER.into(),
        model: MODEL.into(),
        parts,
        stop_reason_raw: "tool_use".into(),
        stop_reason: StopReason::ToolUse,
        usage: Usage::default(),
    };
    t.push_response(&response);
    t.push_tool_results(response.tool_uses().map(|u| ToolResult {
        tool_use_id: u.id.clone(),
        content: ToolResultContent::Text("3".into()),
        is_error: false,
    }));
    t
}

fn call_part(id: &str) -> Part {
    Part::ToolUse(ToolUse {
        id: id.into(),
        name: "calc".into(),
        arguments: r#"{"a":1,"b":2}"#.into(),
        signature: None,
    })
}

#[tokio::test]
async fn a_rejected_request_is_a_non_retryable_invalid_request_with_the_providers_message() {
    let server = FakeServer::start().await;
    server.judge(strict_judge);
    // A thinking block whose signature the provider does not accept: the provider's 400.
    let t = loop_with(vec![
        Part::Thinking {
            text: "t".into(),
            signature: "tampered".into(),
        },
        call_part("toolu_1"),
    ]);
    let err = call(&server, &request(t, Some(2000))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(!err.is_retryable_by_default());
    assert!(
        matches!(
            err,
            Error::Http {
                status: Some(400),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("messages.1.content.0: Invalid `signature` in `thinking` block"),
        "{err}"
    );
    assert_eq!(server.requests().len(), 1);

    // A thinking-enabled loop whose assistant turn does not open with thinking is refused
    // before sending, naming the message and part (the judge would have refused it too).
    let t = loop_with(vec![call_part("toolu_2")]);
    let err = call(&server, &request(t, Some(2000))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(matches!(err, Error::Provider { .. }), "{err:?}");
    assert!(err.to_string().contains("message 1 part 0"), "{err}");
    assert_eq!(server.requests().len(), 1, "nothing more was sent");

    // The same loop with a signature the provider issued passes.
    server.push(Canned::sse(&sse(&[
        message_start(json!({"input_tokens": 1})),
        start(0, text_start()),
        text_delta(0, "3"),
        stop(0),
        message_delta("end_turn", 1),
        message_stop(),
    ])));
    let t = loop_with(vec![
        Part::Thinking {
            text: "t".into(),
            signature: "c2lnLU9L".into(),
        },
        call_part("toolu_3"),
    ]);
    let ok = call(&server, &request(t, Some(2000))).await.unwrap();
    assert_eq!(ok.text(), "3");
}

#[tokio::test]
async fn rate_limits_overload_and_server_errors_are_retryable() {
    let server = FakeServer::start().await;
    let mut limited = Canned::error(
        429,
        r#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"}}"#,
    );
    limited.headers.push(("retry-after".into(), "7".into()));
    server.push(limited);
    server.push(Canned::error(
        529,
        r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
    ));
    server.push(Canned::error(
        500,
        r#"{"type":"error","error":{"type":"api_error","message":"Internal server error"}}"#,
    ));
    let err = call(&server, &first_request()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    assert_eq!(err.retry_after_ms(), Some(7000));
    assert!(err.to_string().contains("per-minute rate limit"), "{err}");
    let err = call(&server, &first_request()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Overloaded);
    assert!(err.to_string().contains("Overloaded"), "{err}");
    let err = call(&server, &first_request()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient);
    for kind in [
        ErrorKind::RateLimited,
        ErrorKind::Overloaded,
        ErrorKind::Transient,
    ] {
        assert!(kind.is_retryable_by_default());
    }
}

/// Feeds `events` through the provider and returns the error it must fail with.
async fn stream_fails(events: &[Value]) -> Error {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(events)));
    call(&server, &first_request()).await.unwrap_err()
}

fn assert_stream(err: &Error, kind: ErrorKind, needle: &str) {
    assert!(
        matches!(err, Error::Stream { provider, .. } if provider == "anthropic"),
        "{err:?}"
    );
    assert_eq!(err.kind(), kind, "{err}");
    assert!(err.to_string().contains(needle), "{err}");
}

#[tokio::test]
async fn malformed_streams_are_typed_errors() {
    let head = || message_start(json!({"input_tokens": 5}));

    // Truncated: no message_stop. Retryable.
    let err = stream_fails(&[head(), start(0, text_start()), text_delta(0, "Hel")]).await;
    assert_stream(&err, ErrorKind::Transient, "ended before message_stop");
    assert!(err.is_retryable_by_default());

    // A delta before its block starts.
    let err = stream_fails(&[head(), text_delta(0, "x")]).await;
    assert_stream(
        &err,
        ErrorKind::InvalidResponse,
        "block 0, which was never started",
    );

    // A delta for another index than the open block.
    let err = stream_fails(&[head(), start(0, text_start()), text_delta(1, "x")]).await;
    assert_stream(
        &err,
        ErrorKind::InvalidResponse,
        "block 1, which was never started",
    );

    // Invalid JSON arguments at block stop.
    let err = stream_fails(&[
        head(),
        start(0, tool_start("toolu_X")),
        json_delta(0, r#"{"a": 1,"#),
        stop(0),
    ])
    .await;
    assert_stream(
        &err,
        ErrorKind::InvalidResponse,
        "not a JSON object at content_block_stop",
    );

    // No stop reason.
    let err = stream_fails(&[
        head(),
        start(0, text_start()),
        text_delta(0, "x"),
        stop(0),
        json!({"type": "message_delta", "delta": {"stop_reason": null}, "usage": {"output_tokens": 1}}),
        message_stop(),
    ])
    .await;
    assert_stream(&err, ErrorKind::InvalidResponse, "without a stop reason");

    // Thinking that never got its signature.
    let err = stream_fails(&[
        head(),
        start(0, thinking_start()),
        thinking_delta(0, "secret"),
        stop(0),
    ])
    .await;
    assert_stream(&err, ErrorKind::InvalidResponse, "without a signature");

    // max_tokens inside a tool_use: never executable.
    let err = stream_fails(&[
        head(),
        start(0, tool_start("toolu_M")),
        json_delta(0, r#"{"a": 12"#),
        message_delta("max_tokens", 16000),
        message_stop(),
    ])
    .await;
    assert_stream(
        &err,
        ErrorKind::InvalidResponse,
        "max_tokens inside tool_use block 0",
    );

    // A block still open at message_stop.
    let err = stream_fails(&[
        head(),
        start(0, text_start()),
        message_delta("end_turn", 1),
        message_stop(),
    ])
    .await;
    assert_stream(&err, ErrorKind::InvalidResponse, "still open");

    // An in-stream error event.
    let err = stream_fails(&[
        head(),
        start(0, text_start()),
        text_delta(0, "x"),
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    ])
    .await;
    assert_stream(&err, ErrorKind::Overloaded, "overloaded_error: Overloaded");
    let err = stream_fails(&[
        head(),
        json!({"type": "error", "error": {"type": "api_error", "message": "Internal server error"}}),
    ])
    .await;
    assert_stream(&err, ErrorKind::Transient, "api_error");

    // A block without a type: nothing to keep it as.
    let err = stream_fails(&[head(), start(0, json!({"text": "x"}))]).await;
    assert_stream(&err, ErrorKind::InvalidResponse, "block 0 has no type");

    // A kept (opaque) block takes only input fragments: another delta would change it in a
    // way cairn cannot follow.
    let err = stream_fails(&[
        head(),
        start(
            0,
            json!({"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}),
        ),
        text_delta(0, "x"),
    ])
    .await;
    assert_stream(
        &err,
        ErrorKind::InvalidResponse,
        "a \"text_delta\" delta cannot apply to block 0, a server_tool_use block kept as received",
    );
}

#[tokio::test]
async fn unknown_event_types_and_pings_are_ignored() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        json!({"type": "ping"}),
        message_start(json!({"input_tokens": 3, "output_tokens": 1})),
        json!({"type": "message_annotation", "something": [1, 2]}),
        start(0, text_start()),
        json!({"type": "ping"}),
        text_delta(0, "Hi."),
        stop(0),
        message_delta("end_turn", 2),
        message_stop(),
    ])));
    let response = call(&server, &first_request()).await.unwrap();
    assert_eq!(response.text(), "Hi.");
    assert_eq!(response.usage.input_tokens, 3);
}

#[tokio::test]
async fn cancellation_stops_a_streaming_call() {
    let server = FakeServer::start().await;
    let head = sse(&[
        message_start(json!({"input_tokens": 3})),
        start(0, text_start()),
        text_delta(0, "Hel"),
    ]);
    let tail = sse(&[
        text_delta(0, "lo"),
        stop(0),
        message_delta("end_turn", 2),
        message_stop(),
    ]);
    let mut canned = Canned::sse(&head);
    canned
        .chunks
        .push((Duration::from_secs(30), tail.into_bytes()));
    server.push(canned);
    let token = CancellationToken::new();
    let context = ActivityContext::new(1, None, token.clone(), |_| {});
    // Cancel as soon as the first fragment shows: the call must not wait for the rest.
    let sink = move |_: Delta| token.cancel();
    let err = provider(&server)
        .call(&first_request(), &sink, &context)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
}

#[tokio::test]
async fn a_missing_key_is_an_auth_error() {
    let server = FakeServer::start().await;
    let provider = AnthropicProvider::new(HttpSettings::new(server.base_url(), None));
    let err = provider
        .call(&first_request(), &NoDeltas, &ActivityContext::detached())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Auth);
    assert!(server.requests().is_empty());
}

#[test]
fn the_parser_maps_aliased_ids_back() {
    let mut aliases = IdAliases::new();
    let wire = aliases.wire_id("call.1", |id| !id.contains('.'), "cairn_alias_");
    let mut parser = StreamParser::new(MODEL, aliases);
    for event in [
        message_start(json!({"input_tokens": 1})),
        start(0, tool_start(&wire)),
        json_delta(0, "{}"),
        stop(0),
        message_delta("tool_use", 3),
        message_stop(),
    ] {
        let name = event["type"].as_str().unwrap().to_owned();
        parser.feed(&name, &event.to_string(), &NoDeltas).unwrap();
    }
    assert!(parser.is_done());
    let response = parser.finish().unwrap();
    let ids: Vec<&str> = response.tool_uses().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["call.1"]);
}

#[tokio::test]
async fn a_stream_that_breaks_after_message_start_still_reports_its_usage() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        message_start(json!({"input_tokens": 25, "output_tokens": 1})),
        start(0, text_start()),
        text_delta(0, "partial"),
    ])));
    let context = ActivityContext::detached();
    let err = provider(&server)
        .call(&first_request(), &NoDeltas, &context)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    let usage = context
        .reported_usage()
        .expect("usage reported before the break");
    assert_eq!(usage.input_tokens, 25);
}

#[tokio::test]
async fn a_stream_cut_after_message_delta_reports_the_final_output_tokens() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        message_start(json!({"input_tokens": 25, "output_tokens": 1})),
        start(0, text_start()),
        text_delta(0, "whole"),
        stop(0),
        message_delta("end_turn", 9),
    ])));
    let context = ActivityContext::detached();
    let err = provider(&server)
        .call(&first_request(), &NoDeltas, &context)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    let usage = context.reported_usage().expect("usage reported mid-stream");
    assert_eq!((usage.input_tokens, usage.output_tokens), (25, 9));
}
