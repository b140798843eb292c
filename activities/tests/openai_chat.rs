//! The OpenAI Chat Completions provider against the fake server: documented stream shapes (and
//! the quirks of compatible servers), the follow-up request after a tool round, classified HTTP
//! errors, and malformed streams as typed errors.

mod support;

use cairn_activities::providers::http::HttpSettings;
use cairn_activities::providers::openai_chat::{
    derived_tool_call_id, render, OpenAiChatProvider, RenderOptions, StreamParser, MAX_WIRE_ID_LEN,
    PROVIDER,
};
use cairn_activities::{
    ActivityContext, CallContext, Error, ErrorKind, ModelProvider, ModelRequest, NoDeltas,
};
use cairn_ledger::{
    Delta, JsonText, Message, ModelResponse, ModelSpec, Part, Role, StopReason, ToolResult,
    ToolResultContent, ToolSpec, ToolUse, Transcript, Usage,
};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{Canned, FakeServer, Recorded};
use tokio_util::sync::CancellationToken;

const KEY: &str = "sk-test-key";

fn context(attempt: u32) -> CallContext {
    CallContext {
        session_id: "session-7f3a".into(),
        turn: 2,
        round: 1,
        attempt,
    }
}

fn request(transcript: Transcript) -> ModelRequest {
    ModelRequest {
        options: Default::default(),
        context: context(1),
        model: ModelSpec {
            provider: "openai".into(),
            model: "gpt-test".into(),
            max_tokens: Some(1024),
            thinking_budget_tokens: None,
        },
        transcript: transcript.into(),
        tools: vec![
            ToolSpec {
                name: "get_weather".into(),
                description: "Weather for a city".into(),
                input_schema: JsonText::parse(
                    r#"{"type":"object","properties":{"city":{"type":"string"}}}"#,
                )
                .unwrap(),
            },
            ToolSpec {
                name: "get_time".into(),
                description: "Time in a zone".into(),
                input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
            },
        ]
        .into(),
    }
}

fn user_request(text: &str) -> ModelRequest {
    let mut t = Transcript::new();
    t.push_system("Be brief.");
    t.push_user_text(text);
    request(t)
}

/// SSE body: one `data:` event per payload.
fn sse(events: &[&str]) -> String {
    events.iter().map(|e| format!("data: {e}\n\n")).collect()
}

fn chunk(delta: Value, finish: Value) -> String {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
        "model": "gpt-test-2025", "system_fingerprint": "fp_1",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        "usage": null
    })
    .to_string()
}

fn usage_chunk() -> String {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
        "model": "gpt-test-2025", "choices": [],
        "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70,
                  "prompt_tokens_details": {"cached_tokens": 10, "audio_tokens": 0},
                  "completion_tokens_details": {"reasoning_tokens": 3}}
    })
    .to_string()
}

fn provider(server: &FakeServer) -> OpenAiChatProvider {
    OpenAiChatProvider::new(HttpSettings::new(
        format!("{}/v1", server.base_url()),
        Some(KEY.into()),
    ))
}

struct Collected(Arc<Mutex<Vec<Delta>>>);

impl Collected {
    fn new() -> (Collected, impl Fn(Delta) + Send + Sync) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink_seen = seen.clone();
        (Collected(seen), move |d: Delta| {
            sink_seen.lock().unwrap().push(d)
        })
    }
    fn take(&self) -> Vec<Delta> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

fn tool_use(id: &str, name: &str, arguments: &str) -> Part {
    Part::ToolUse(ToolUse {
        id: id.into(),
        name: name.into(),
        arguments: arguments.into(),
        signature: None,
    })
}

/// Parses a whole SSE body through the pure parser (data payloads only).
fn parse_all(body: &str, ctx: CallContext) -> cairn_activities::Result<ModelResponse> {
    let mut parser = StreamParser::new(ctx, "requested-model");
    for line in body.lines() {
        if let Some(data) = line.strip_prefix("data:") {
            parser.feed(data, &NoDeltas)?;
        }
    }
    parser.finish()
}

async fn call_with(
    server: &FakeServer,
    request: &ModelRequest,
) -> cairn_activities::Result<ModelResponse> {
    provider(server)
        .call(request, &NoDeltas, &ActivityContext::detached())
        .await
}

// ---------------------------------------------------------------------------------------------
// Documented stream shapes
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn text_and_two_parallel_tool_calls_with_fragmented_arguments_and_usage() {
    let server = FakeServer::start().await;
    let body = sse(&[
        &chunk(
            json!({"role": "assistant", "content": "", "refusal": null}),
            Value::Null,
        ),
        &chunk(json!({"content": "Let me "}), Value::Null),
        &chunk(json!({"content": "check."}), Value::Null),
        &chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_A", "type": "function",
                                    "function": {"name": "get_weather", "arguments": ""}}]}),
            Value::Null,
        ),
        &chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}),
            Value::Null,
        ),
        &chunk(
            json!({"tool_calls": [{"index": 1, "id": "call_B", "type": "function",
                                    "function": {"name": "get_time", "arguments": ""}}]}),
            Value::Null,
        ),
        &chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": " \"Paris\"}"}}]}),
            Value::Null,
        ),
        &chunk(
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"tz\":\"CET\"}"}}]}),
            Value::Null,
        ),
        &chunk(json!({}), json!("tool_calls")),
        &usage_chunk(),
        "[DONE]",
    ]);
    server.push(Canned::sse(&body));
    let (collected, sink) = Collected::new();
    let req = user_request("Weather and time in Paris?");
    let response = provider(&server)
        .call(&req, &sink, &ActivityContext::detached())
        .await
        .unwrap();
    assert_eq!(
        response,
        ModelResponse {
            provider: PROVIDER.into(),
            model: "gpt-test-2025".into(),
            parts: vec![
                Part::text("Let me check."),
                tool_use("call_A", "get_weather", "{\"city\": \"Paris\"}"),
                tool_use("call_B", "get_time", "{\"tz\":\"CET\"}"),
            ],
            stop_reason_raw: "tool_calls".into(),
            stop_reason: StopReason::ToolUse,
            usage: Usage {
                input_tokens: 40,
                output_tokens: 20,
                cache_read_tokens: 10,
                cache_write_tokens: 0,
                reasoning_tokens: 3,
            },
        }
    );
    let args = |id: &str, f: &str| Delta::ToolArguments {
        tool_use_id: id.into(),
        fragment: f.into(),
    };
    assert_eq!(
        collected.take(),
        vec![
            Delta::Text("Let me ".into()),
            Delta::Text("check.".into()),
            args("call_A", "{\"city\":"),
            args("call_A", " \"Paris\"}"),
            args("call_B", "{\"tz\":\"CET\"}"),
        ]
    );
    // The request: path, auth, streaming with usage, the compatible-server token field.
    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].method, "POST");
    assert_eq!(requests[0].path, "/v1/chat/completions");
    assert_eq!(
        requests[0].headers["authorization"],
        format!("Bearer {KEY}")
    );
    let body = requests[0].json();
    assert_eq!(body["model"], "gpt-test");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
    assert_eq!(body["max_tokens"], 1024);
    assert!(body.get("max_completion_tokens").is_none());
    assert_eq!(
        body["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather and time in Paris?"},
        ])
    );
    assert_eq!(
        body["tools"],
        json!([
            {"type": "function", "function": {"name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "get_time",
                "description": "Time in a zone", "parameters": {"type": "object"}}},
        ])
    );
}

#[tokio::test]
async fn openai_itself_gets_max_completion_tokens_and_no_key_means_no_auth_header() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        &chunk(json!({"content": "hi"}), json!("stop")),
        "[DONE]",
    ])));
    let keyless = OpenAiChatProvider::new(HttpSettings::new(server.base_url(), None))
        .with_options(RenderOptions::default());
    let req = user_request("hello");
    let response = keyless
        .call(&req, &NoDeltas, &ActivityContext::detached())
        .await
        .unwrap();
    assert_eq!(response.text(), "hi");
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    // A server that sends no usage: zeros, not an error.
    assert_eq!(response.usage, Usage::default());
    let recorded = &server.requests()[0];
    assert_eq!(recorded.path, "/chat/completions");
    assert!(recorded.headers.get("authorization").is_none());
    let body = recorded.json();
    assert_eq!(body["max_completion_tokens"], 1024);
    assert!(body.get("max_tokens").is_none());
    assert_eq!(render(&req).unwrap(), body);
}

#[tokio::test]
async fn a_server_reusing_index_zero_tells_calls_apart_by_id() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        &chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": "{\"city\":"}}]}),
            Value::Null,
        ),
        &chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_1",
                                    "function": {"arguments": "\"Oslo\"}"}}]}),
            Value::Null,
        ),
        &chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_2", "type": "function",
                                    "function": {"name": "get_time", "arguments": "{\"tz\":"}}]}),
            Value::Null,
        ),
        // A continuation without id goes to the latest call at the index.
        &chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"UTC\"}"}}]}),
            Value::Null,
        ),
        &chunk(json!({}), json!("tool_calls")),
        "[DONE]",
    ])));
    let response = call_with(&server, &user_request("two calls"))
        .await
        .unwrap();
    assert_eq!(
        response.parts,
        vec![
            tool_use("call_1", "get_weather", "{\"city\":\"Oslo\"}"),
            tool_use("call_2", "get_time", "{\"tz\":\"UTC\"}"),
        ]
    );
    assert_eq!(response.stop_reason, StopReason::ToolUse);
}

#[tokio::test]
async fn a_server_omitting_ids_gets_deterministic_ids() {
    let body = sse(&[
        &chunk(
            json!({"tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}},
                                  {"index": 1, "function": {"name": "get_time", "arguments": "{}"}}]}),
            Value::Null,
        ),
        // Ollama (older versions) says "stop" after tool calls.
        &chunk(json!({}), json!("stop")),
        "[DONE]",
    ]);
    let server = FakeServer::start().await;
    server.push(Canned::sse(&body));
    server.push(Canned::sse(&body));
    let req = user_request("no ids");
    let first = call_with(&server, &req).await.unwrap();
    let second = call_with(&server, &req).await.unwrap();
    assert_eq!(first, second);
    let ids: Vec<&str> = first.tool_uses().map(|t| t.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            derived_tool_call_id(&context(1), 0),
            derived_tool_call_id(&context(1), 1)
        ]
    );
    assert!(ids.iter().all(|id| id.len() <= MAX_WIRE_ID_LEN));
    assert_eq!(first.stop_reason, StopReason::ToolUse);
    assert_eq!(first.stop_reason_raw, "stop");
    // The pure parser agrees, and another attempt derives other ids.
    assert_eq!(parse_all(&body, context(1)).unwrap().parts, first.parts);
    let retry = parse_all(&body, context(2)).unwrap();
    assert_ne!(retry.tool_uses().next().unwrap().id, ids[0]);
}

#[tokio::test]
async fn reasoning_content_is_captured_as_reasoning() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        &chunk(
            json!({"role": "assistant", "content": null, "reasoning_content": "The user "}),
            Value::Null,
        ),
        &chunk(
            json!({"content": null, "reasoning_content": "wants a number."}),
            Value::Null,
        ),
        &chunk(
            json!({"content": "42", "reasoning_content": null}),
            Value::Null,
        ),
        &chunk(json!({"content": ""}), json!("stop")),
        &usage_chunk(),
        "[DONE]",
    ])));
    let (collected, sink) = Collected::new();
    let response = provider(&server)
        .call(
            &user_request("answer?"),
            &sink,
            &ActivityContext::detached(),
        )
        .await
        .unwrap();
    assert_eq!(
        response.parts,
        vec![
            Part::Reasoning {
                text: "The user wants a number.".into()
            },
            Part::text("42"),
        ]
    );
    assert_eq!(
        collected.take(),
        vec![
            Delta::Thinking("The user ".into()),
            Delta::Thinking("wants a number.".into()),
            Delta::Text("42".into()),
        ]
    );
    // vLLM / OpenRouter spell it `reasoning`.
    let vllm = sse(&[
        &chunk(json!({"reasoning": "hmm"}), Value::Null),
        &chunk(json!({"content": "ok"}), json!("stop")),
        "[DONE]",
    ]);
    assert_eq!(
        parse_all(&vllm, context(1)).unwrap().parts,
        vec![Part::Reasoning { text: "hmm".into() }, Part::text("ok")]
    );
}

// ---------------------------------------------------------------------------------------------
// The follow-up request
// ---------------------------------------------------------------------------------------------

/// OpenAI's documented ordering rules, enforced as the real API does (400 with its message).
fn openai_rules(r: &Recorded) -> Option<Canned> {
    let reject = |message: String| {
        Some(Canned::error(
            400,
            &json!({"error": {"message": message, "type": "invalid_request_error",
                              "param": "messages", "code": null}})
            .to_string(),
        ))
    };
    let body = r.json();
    let messages = body["messages"].as_array()?;
    let mut open: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m["role"] == "tool" {
            let id = m["tool_call_id"].as_str().unwrap_or_default();
            match open.iter().position(|o| o == id) {
                Some(p) => {
                    open.remove(p);
                }
                None => {
                    return reject(format!("Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'. (messages[{i}])"));
                }
            }
            continue;
        }
        if !open.is_empty() {
            return reject(format!("An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}", open.join(", ")));
        }
        if let Some(calls) = m["tool_calls"].as_array() {
            open = calls
                .iter()
                .map(|c| c["id"].as_str().unwrap_or_default().to_owned())
                .collect();
        }
    }
    if let Some(max) = body["max_tokens"].as_u64() {
        if max > 4096 {
            return reject(format!("max_tokens is too large: {max}. This model supports at most 4096 completion tokens, whereas you provided {max}."));
        }
    }
    None
}

#[tokio::test]
async fn follow_up_request_sends_calls_back_exactly_with_one_tool_message_each() {
    let server = FakeServer::start().await;
    server.judge(openai_rules);
    let long_id = "call_".to_owned() + &"x".repeat(60);
    let invalid_json = "{\"tz\": CET"; // what the model produced: not JSON, kept as is
    let mut t = Transcript::new();
    t.push_user_text("Weather and time?");
    t.push_response(&ModelResponse {
        provider: PROVIDER.into(),
        model: "deepseek-reasoner".into(),
        parts: vec![
            Part::Reasoning {
                text: "Two tools.".into(),
            },
            tool_use(
                "call_A",
                "get_weather",
                "{\"city\": \"Paris\",  \"n\": 9007199254740993}",
            ),
            tool_use(&long_id, "get_time", invalid_json),
        ],
        stop_reason_raw: "tool_calls".into(),
        stop_reason: StopReason::ToolUse,
        usage: Usage::default(),
    });
    t.messages.push(Message {
        role: Role::User,
        parts: vec![
            Part::ToolResult(ToolResult {
                tool_use_id: "call_A".into(),
                content: ToolResultContent::Json(JsonText::parse(r#"{"temp":21}"#).unwrap()),
                is_error: false,
            }),
            Part::ToolResult(ToolResult {
                tool_use_id: long_id.clone(),
                content: ToolResultContent::Text("arguments are not valid JSON".into()),
                is_error: true,
            }),
            Part::text("Also, be quick."),
        ],
        provenance: None,
    });
    server.push(Canned::sse(&sse(&[
        &chunk(json!({"content": "21°C."}), json!("stop")),
        "[DONE]",
    ])));
    let response = call_with(&server, &request(t)).await.unwrap();
    assert_eq!(response.text(), "21°C.");
    let recorded = &server.requests()[0];
    assert_eq!(recorded.headers["authorization"], format!("Bearer {KEY}"));
    let body = recorded.json();
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": "Weather and time?"},
            {"role": "assistant", "content": null,
             "tool_calls": [
                {"id": "call_A", "type": "function", "function": {"name": "get_weather",
                    "arguments": "{\"city\": \"Paris\",  \"n\": 9007199254740993}"}},
                {"id": "call_cairn_1", "type": "function", "function": {"name": "get_time",
                    "arguments": invalid_json}},
             ],
             "reasoning_content": "Two tools."},
            {"role": "tool", "tool_call_id": "call_A", "content": "{\"temp\":21}"},
            {"role": "tool", "tool_call_id": "call_cairn_1",
             "content": "Error: arguments are not valid JSON"},
            {"role": "user", "content": "Also, be quick."},
        ])
    );
    // Byte for byte in the raw body too (no re-serialization of the arguments).
    let raw = String::from_utf8(recorded.body.clone()).unwrap();
    assert!(
        raw.contains(r#""arguments":"{\"city\": \"Paris\",  \"n\": 9007199254740993}""#),
        "{raw}"
    );
    assert!(raw.contains(r#""arguments":"{\"tz\": CET""#), "{raw}");
}

#[test]
fn deepseek_dialect_sends_empty_reasoning_content_for_foreign_tool_turns() {
    // A completed Anthropic tool turn: its thinking is dropped, DeepSeek still needs the field.
    let mut t = Transcript::new();
    t.push_user_text("one");
    t.push_response(&ModelResponse {
        provider: "anthropic".into(),
        model: "claude".into(),
        parts: vec![
            Part::Thinking {
                text: "t".into(),
                signature: "sig".into(),
            },
            tool_use("toolu_1", "get_time", "{}"),
        ],
        stop_reason_raw: "tool_use".into(),
        stop_reason: StopReason::ToolUse,
        usage: Usage::default(),
    });
    t.push_tool_results([ToolResult {
        tool_use_id: "toolu_1".into(),
        content: ToolResultContent::Text("noon".into()),
        is_error: false,
    }]);
    t.push_response(&ModelResponse {
        provider: "anthropic".into(),
        model: "claude".into(),
        parts: vec![Part::text("It is noon.")],
        stop_reason_raw: "end_turn".into(),
        stop_reason: StopReason::EndTurn,
        usage: Usage::default(),
    });
    t.push_user_text("two");
    let req = request(t);
    let deepseek = RenderOptions::for_base_url("https://api.deepseek.com/v1");
    let body = cairn_activities::providers::openai_chat::render_with(&req, &deepseek).unwrap();
    assert_eq!(body["messages"][1]["reasoning_content"], "");
    assert_eq!(body["messages"][1]["content"], Value::Null);
    assert_eq!(body["max_tokens"], 1024);
    // api.openai.com does not get the field for a turn without reasoning.
    let openai = render(&req).unwrap();
    assert!(openai["messages"][1].get("reasoning_content").is_none());
    assert!(openai["messages"][3].get("reasoning_content").is_none());
}

#[tokio::test]
async fn a_request_the_server_rejects_is_a_non_retryable_invalid_request() {
    let server = FakeServer::start().await;
    server.judge(openai_rules);
    let mut req = user_request("hello");
    req.model.max_tokens = Some(100_000);
    let err = call_with(&server, &req).await.unwrap_err();
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
        err.to_string().contains("max_tokens is too large: 100000"),
        "{err}"
    );
}

#[tokio::test]
async fn a_tool_result_without_its_call_is_refused_before_sending() {
    let server = FakeServer::start().await;
    let mut t = Transcript::new();
    t.push_user_text("hi");
    t.push_tool_results([ToolResult {
        tool_use_id: "call_nowhere".into(),
        content: ToolResultContent::Text("x".into()),
        is_error: false,
    }]);
    let err = call_with(&server, &request(t)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(err.to_string().contains("call_nowhere"), "{err}");
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn rate_limits_and_server_errors_are_retryable() {
    let server = FakeServer::start().await;
    let mut limited = Canned::error(
        429,
        r#"{"error":{"message":"Rate limit reached for gpt-test","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#,
    );
    limited.headers.push(("retry-after".into(), "3".into()));
    server.push(limited);
    server.push(Canned::error(
        500,
        r#"{"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}}"#,
    ));
    server.push(Canned::error(
        503,
        r#"{"error":{"message":"Service Unavailable","type":"server_error"}}"#,
    ));
    let req = user_request("hello");
    let err = call_with(&server, &req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    assert_eq!(err.retry_after_ms(), Some(3000));
    assert!(err.to_string().contains("Rate limit reached"), "{err}");
    for status in [500, 503] {
        let err = call_with(&server, &req).await.unwrap_err();
        assert!(err.is_retryable_by_default(), "{status}: {err}");
        assert!(
            matches!(err, Error::Http { status: Some(s), .. } if s == status),
            "{err:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed streams
// ---------------------------------------------------------------------------------------------

fn stream_kind(err: &Error) -> ErrorKind {
    match err {
        Error::Stream { provider, kind, .. } => {
            assert_eq!(provider, PROVIDER);
            *kind
        }
        other => panic!("expected a stream error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_stream_cut_before_its_finish_reason_is_a_transient_failure() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[&chunk(
        json!({"content": "Half an ans"}),
        Value::Null,
    )])));
    let err = call_with(&server, &user_request("x")).await.unwrap_err();
    assert_eq!(stream_kind(&err), ErrorKind::Transient);
    assert!(err.to_string().contains("without a finish_reason"), "{err}");
    // [DONE] without a finish reason (a compatible server that omits it): still not complete.
    let no_finish = sse(&[&chunk(json!({"content": "a"}), Value::Null), "[DONE]"]);
    let err = parse_all(&no_finish, context(1)).unwrap_err();
    assert_eq!(stream_kind(&err), ErrorKind::Transient);
    // A finish reason but the connection cut before [DONE] (the usage chunk never came).
    let no_done = sse(&[&chunk(json!({"content": "a"}), json!("stop"))]);
    let err = parse_all(&no_done, context(1)).unwrap_err();
    assert_eq!(stream_kind(&err), ErrorKind::Transient);
    assert!(err.to_string().contains("[DONE]"), "{err}");
}

#[tokio::test]
async fn bad_json_in_a_data_line_is_an_invalid_response() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        &chunk(json!({"content": "ok"}), Value::Null),
        "{\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"br",
        "[DONE]",
    ])));
    let err = call_with(&server, &user_request("x")).await.unwrap_err();
    assert_eq!(stream_kind(&err), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("event 2 is not JSON"), "{err}");
}

#[tokio::test]
async fn length_inside_a_tool_call_is_never_an_executable_call() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        &chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_T", "type": "function",
                                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Par"}}]}),
            Value::Null,
        ),
        &chunk(json!({}), json!("length")),
        &usage_chunk(),
        "[DONE]",
    ])));
    let err = call_with(&server, &user_request("x")).await.unwrap_err();
    assert_eq!(stream_kind(&err), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("call_T"), "{err}");
    // `length` after plain text is a (truncated) completed answer.
    let text = sse(&[&chunk(json!({"content": "abc"}), json!("length")), "[DONE]"]);
    assert_eq!(
        parse_all(&text, context(1)).unwrap().stop_reason,
        StopReason::MaxTokens
    );
}

#[test]
fn a_tool_call_without_a_name_is_an_invalid_response() {
    let body = sse(&[
        &chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_N", "function": {"arguments": "{}"}}]}),
            Value::Null,
        ),
        &chunk(json!({}), json!("tool_calls")),
        "[DONE]",
    ]);
    let err = parse_all(&body, context(1)).unwrap_err();
    assert_eq!(stream_kind(&err), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("no function name"), "{err}");
}

#[tokio::test]
async fn unknown_fields_and_extra_chunks_are_ignored_and_invalid_arguments_kept() {
    let server = FakeServer::start().await;
    let body = format!(
        ": keep-alive comment\n\n{}",
        sse(&[
            r#"{"object":"chat.completion.chunk","choices":[],"usage":null,"x_vendor":{"a":1}}"#,
            r#"{"type":"ping"}"#,
            &chunk(
                json!({"content": "ok", "x_new_field": [1, 2], "audio": null,
                       "tool_calls": [{"index": 0, "id": "call_J", "type": "function",
                                       "function": {"name": "get_time", "arguments": "{not json"}}]}),
                Value::Null,
            ),
            &chunk(json!({}), json!("tool_calls")),
            &usage_chunk(),
            "[DONE]",
        ])
    );
    server.push(Canned::sse(&body));
    let response = call_with(&server, &user_request("x")).await.unwrap();
    assert_eq!(
        response.parts,
        vec![
            Part::text("ok"),
            tool_use("call_J", "get_time", "{not json"),
        ]
    );
}

#[tokio::test]
async fn an_error_event_mid_stream_is_classified() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&sse(&[
        &chunk(json!({"content": "partial"}), Value::Null),
        r#"{"error":{"message":"The server had an error while processing your request. Sorry about that!","type":"server_error","param":null,"code":null}}"#,
    ])));
    let err = call_with(&server, &user_request("x")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient);
    assert!(err.to_string().contains("Sorry about that"), "{err}");
}

#[tokio::test]
async fn cancellation_stops_a_running_stream() {
    let server = FakeServer::start().await;
    server.push(Canned {
        status: 200,
        headers: vec![("content-type".into(), "text/event-stream".into())],
        chunks: vec![
            (
                Duration::ZERO,
                sse(&[&chunk(json!({"content": "a"}), Value::Null)]).into_bytes(),
            ),
            (Duration::from_secs(30), b"data: [DONE]\n\n".to_vec()),
        ],
    });
    let token = CancellationToken::new();
    let ctx = ActivityContext::new(1, None, token.clone(), |_| {});
    let cancel = token.clone();
    let sink = move |d: Delta| {
        if d == Delta::Text("a".into()) {
            cancel.cancel();
        }
    };
    let err = provider(&server)
        .call(&user_request("x"), &sink, &ctx)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled);
}

#[tokio::test]
async fn a_stream_cut_after_the_usage_chunk_still_reports_its_usage() {
    let server = FakeServer::start().await;
    // The usage chunk arrives, then the connection is cut before `data: [DONE]`.
    server.push(Canned::sse(&sse(&[
        &chunk(json!({"role": "assistant", "content": "Hel"}), Value::Null),
        &chunk(json!({}), json!("stop")),
        &usage_chunk(),
    ])));
    let context = ActivityContext::detached();
    let err = provider(&server)
        .call(&user_request("hi"), &NoDeltas, &context)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    let usage = context
        .reported_usage()
        .expect("usage reported before the cut");
    assert_eq!((usage.input_tokens, usage.output_tokens), (40, 20));
    assert_eq!(usage.cache_read_tokens, 10);
}
