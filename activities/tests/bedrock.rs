//! The Bedrock ConverseStream provider against the fake server: event-stream frames encoded with
//! aws_smithy_eventstream, SigV4-signed requests, the follow-up body of a tool loop, classified
//! HTTP errors, and typed errors for broken streams.

mod support;

use aws_smithy_eventstream::frame::write_message_to;
use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
use aws_smithy_types::str_bytes::StrBytes;
use cairn_activities::providers::alias::IdAliases;
use cairn_activities::providers::bedrock::{
    self, AwsCredentials, BedrockProvider, StreamParser, PROVIDER,
};
use cairn_activities::providers::http::HttpSettings;
use cairn_activities::{ActivityContext, CallContext, ErrorKind, ModelProvider, ModelRequest};
use cairn_ledger::{
    Delta, JsonText, ModelResponse, ModelSpec, Part, ProviderJson, StopReason, ToolResult,
    ToolResultContent, ToolSpec, ToolUse, Transcript, Usage,
};
use std::sync::Mutex;
use std::time::Duration;
use support::{Canned, FakeServer};

const MODEL: &str = "anthropic.claude-sonnet-4-20250514-v1:0";

fn header(name: &'static str, value: &str) -> Header {
    Header::new(name, HeaderValue::String(StrBytes::from(value.to_owned())))
}

fn frame(message_type: &str, type_header: &'static str, name: &str, json: &str) -> Vec<u8> {
    let message = Message::new(json.as_bytes().to_vec())
        .add_header(header(":message-type", message_type))
        .add_header(header(type_header, name))
        .add_header(header(":content-type", "application/json"));
    let mut out = Vec::new();
    write_message_to(&message, &mut out).unwrap();
    out
}

fn event(name: &str, json: &str) -> Vec<u8> {
    frame("event", ":event-type", name, json)
}

fn exception(name: &str, json: &str) -> Vec<u8> {
    frame("exception", ":exception-type", name, json)
}

/// A 200 event-stream response whose bytes arrive in chunks cut at awkward places.
fn stream(frames: &[Vec<u8>]) -> Canned {
    let bytes: Vec<u8> = frames.concat();
    let mut canned = Canned::bytes("application/vnd.amazon.eventstream", Vec::new());
    canned.chunks = bytes
        .chunks(7)
        .map(|c| (Duration::ZERO, c.to_vec()))
        .collect();
    canned
}

fn provider(server: &FakeServer) -> BedrockProvider {
    BedrockProvider::new(
        HttpSettings::new(server.base_url(), None),
        AwsCredentials {
            access_key_id: "AKID".into(),
            secret_access_key: "SECRET".into(),
            session_token: Some("SESSION".into()),
        },
        "us-east-1".into(),
    )
}

fn tools() -> Vec<ToolSpec> {
    vec![ToolSpec {
        name: "calc".into(),
        description: "Adds numbers.".into(),
        input_schema: JsonText::parse(r#"{"type":"object","properties":{"a":{"type":"number"}}}"#)
            .unwrap(),
    }]
}

fn request(model: &str, transcript: Transcript, thinking: bool) -> ModelRequest {
    ModelRequest {
        options: Default::default(),
        context: CallContext::default(),
        model: ModelSpec {
            provider: PROVIDER.into(),
            model: model.into(),
            max_tokens: Some(4096),
            thinking_budget_tokens: thinking.then_some(2048),
        },
        transcript: transcript.into(),
        tools: tools().into(),
    }
}

fn response(provider: &str, parts: Vec<Part>, stop: StopReason) -> ModelResponse {
    ModelResponse {
        provider: provider.into(),
        model: "m".into(),
        parts,
        stop_reason_raw: "x".into(),
        stop_reason: stop,
        usage: Usage::default(),
    }
}

/// An earlier completed turn from another provider, whose call id Bedrock cannot accept.
fn history() -> Transcript {
    let mut t = Transcript::new();
    t.push_system("Be brief.");
    t.push_user_text("first");
    t.push_response(&response(
        "openai",
        vec![Part::ToolUse(ToolUse {
            id: "call.1/x".into(),
            name: "calc".into(),
            arguments: r#"{"a": 1}"#.into(),
            signature: None,
        })],
        StopReason::ToolUse,
    ));
    t.push_tool_results([ToolResult {
        tool_use_id: "call.1/x".into(),
        content: ToolResultContent::Text("1".into()),
        is_error: false,
    }]);
    t.push_response(&response(
        "openai",
        vec![Part::text("done")],
        StopReason::EndTurn,
    ));
    t.push_user_text("second");
    t
}

fn tool_loop_stream() -> Vec<Vec<u8>> {
    vec![
        event("messageStart", r#"{"p":"abcdef","role":"assistant"}"#),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"reasoningContent":{"text":"Let me "}},"p":"ab"}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"reasoningContent":{"text":"think."}}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"reasoningContent":{"signature":"sig-A+/=="}}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":0}"#),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":1,"delta":{"text":"Checking both."}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":1}"#),
        event(
            "contentBlockStart",
            r#"{"contentBlockIndex":2,"start":{"toolUse":{"toolUseId":"tooluse_A1","name":"calc"}}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":2,"delta":{"toolUse":{"input":"{\"a\": "}}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":2,"delta":{"toolUse":{"input":"1.10}"}}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":2}"#),
        event(
            "contentBlockStart",
            r#"{"contentBlockIndex":3,"start":{"toolUse":{"toolUseId":"tooluse_B2","name":"calc"}}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":3,"delta":{"toolUse":{"input":"{\"a\""}}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":3,"delta":{"toolUse":{"input":": 9007199254740993}"}}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":3}"#),
        event("messageStop", r#"{"stopReason":"tool_use"}"#),
        event(
            "metadata",
            r#"{"usage":{"inputTokens":12,"outputTokens":34,"totalTokens":46,"cacheReadInputTokens":5,"cacheWriteInputTokens":6},"metrics":{"latencyMs":100}}"#,
        ),
    ]
}

fn text_stream(text: &str) -> Vec<Vec<u8>> {
    vec![
        event("messageStart", r#"{"role":"assistant"}"#),
        event(
            "contentBlockDelta",
            &format!(
                r#"{{"contentBlockIndex":0,"delta":{{"text":{}}}}}"#,
                serde_json::to_string(text).unwrap()
            ),
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":0}"#),
        event("messageStop", r#"{"stopReason":"end_turn"}"#),
        event(
            "metadata",
            r#"{"usage":{"inputTokens":1,"outputTokens":2,"totalTokens":3}}"#,
        ),
    ]
}

#[tokio::test]
async fn a_tool_loop_streams_parses_and_renders_its_follow_up() {
    let server = FakeServer::start().await;
    server.push(stream(&tool_loop_stream()));
    server.push(stream(&text_stream("Both done.")));
    let provider = provider(&server);
    let ctx = ActivityContext::detached();
    let seen = Mutex::new(Vec::new());
    let sink = |d: Delta| seen.lock().unwrap().push(d);

    let mut transcript = history();
    let first = provider
        .call(&request(MODEL, transcript.clone(), true), &sink, &ctx)
        .await
        .unwrap();
    assert_eq!(
        first,
        ModelResponse {
            provider: "bedrock".into(),
            model: MODEL.into(),
            parts: vec![
                Part::Thinking {
                    text: "Let me think.".into(),
                    signature: "sig-A+/==".into(),
                },
                Part::text("Checking both."),
                Part::ToolUse(ToolUse {
                    id: "tooluse_A1".into(),
                    name: "calc".into(),
                    arguments: r#"{"a": 1.10}"#.into(),
                    signature: None,
                }),
                Part::ToolUse(ToolUse {
                    id: "tooluse_B2".into(),
                    name: "calc".into(),
                    arguments: r#"{"a": 9007199254740993}"#.into(),
                    signature: None,
                }),
            ],
            stop_reason_raw: "tool_use".into(),
            stop_reason: StopReason::ToolUse,
            usage: Usage {
                input_tokens: 12,
                output_tokens: 34,
                cache_read_tokens: 5,
                cache_write_tokens: 6,
                reasoning_tokens: 0,
            },
        }
    );
    let fragment = |id: &str, f: &str| Delta::ToolArguments {
        tool_use_id: id.into(),
        fragment: f.into(),
    };
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            Delta::Thinking("Let me ".into()),
            Delta::Thinking("think.".into()),
            Delta::Text("Checking both.".into()),
            fragment("tooluse_A1", r#"{"a": "#),
            fragment("tooluse_A1", "1.10}"),
            fragment("tooluse_B2", r#"{"a""#),
            fragment("tooluse_B2", ": 9007199254740993}"),
        ]
    );

    // The request: path with the encoded model id, SigV4 headers, the rendered body.
    let requests = server.requests();
    let sent = &requests[0];
    assert_eq!(sent.method, "POST");
    assert_eq!(
        sent.path,
        "/model/anthropic.claude-sonnet-4-20250514-v1%3A0/converse-stream"
    );
    let auth = sent.headers["authorization"].to_str().unwrap();
    assert!(
        auth.starts_with("AWS4-HMAC-SHA256 Credential=AKID/")
            && auth.contains("/us-east-1/bedrock/aws4_request, SignedHeaders=")
            && auth.contains("Signature="),
        "{auth}"
    );
    assert!(sent.headers.contains_key("x-amz-date"));
    assert_eq!(sent.headers["x-amz-security-token"], "SESSION");
    assert_eq!(sent.headers["content-type"], "application/json");
    let body = sent.json();
    assert_eq!(
        body["additionalModelRequestFields"],
        serde_json::json!({"thinking": {"type": "enabled", "budget_tokens": 2048}})
    );
    assert_eq!(body["inferenceConfig"]["maxTokens"], 4096);
    // Claude Sonnet 4 takes cache points: one after the system prompt (and the tools, and the
    // last turn), on by default.
    assert_eq!(
        body["system"],
        serde_json::json!([{"text": "Be brief."}, {"cachePoint": {"type": "default"}}])
    );

    // The follow-up: results in declaration order, one finished out of order is still second.
    transcript.push_response(&first);
    transcript.push_tool_results([
        ToolResult {
            tool_use_id: "tooluse_A1".into(),
            content: ToolResultContent::Json(JsonText::parse(r#"{"sum": 1.10}"#).unwrap()),
            is_error: false,
        },
        ToolResult {
            tool_use_id: "tooluse_B2".into(),
            content: ToolResultContent::Json(
                JsonText::parse(r#"["not", "an", "object"]"#).unwrap(),
            ),
            is_error: true,
        },
    ]);
    let second = provider
        .call(&request(MODEL, transcript, true), &sink, &ctx)
        .await
        .unwrap();
    assert_eq!(second.text(), "Both done.");
    assert_eq!(second.stop_reason, StopReason::EndTurn);

    let follow_up = &server.requests()[1];
    let raw = String::from_utf8(follow_up.body.clone()).unwrap();
    // Reasoning echoed byte for byte, first in its message; tool inputs as the exact text.
    assert!(
        raw.contains(
            r#"{"role":"assistant","content":[{"reasoningContent":{"reasoningText":{"text":"Let me think.","signature":"sig-A+/=="}}},{"text":"Checking both."},{"toolUse":{"toolUseId":"tooluse_A1","name":"calc","input":{"a": 1.10}}},{"toolUse":{"toolUseId":"tooluse_B2","name":"calc","input":{"a": 9007199254740993}}}]}"#
        ),
        "{raw}"
    );
    assert!(
        raw.contains(
            r#"{"role":"user","content":[{"toolResult":{"toolUseId":"tooluse_A1","content":[{"json":{"sum": 1.10}}]}},{"toolResult":{"toolUseId":"tooluse_B2","content":[{"text":"[\"not\", \"an\", \"object\"]"}],"status":"error"}},{"cachePoint":{"type":"default"}}]}"#
        ),
        "{raw}"
    );
    let body = follow_up.json();
    let messages = body["messages"].as_array().unwrap();
    // The foreign turn's id is aliased, the same for the use and its result.
    let alias = messages[1]["content"][0]["toolUse"]["toolUseId"]
        .as_str()
        .unwrap();
    assert_ne!(alias, "call.1/x");
    assert!(alias
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'));
    assert_eq!(messages[2]["content"][0]["toolResult"]["toolUseId"], alias);
    assert_eq!(
        messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect::<Vec<_>>(),
        [
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant",
            "user"
        ]
    );
    assert_eq!(body["toolConfig"]["tools"][0]["toolSpec"]["name"], "calc");
    assert_eq!(
        body["toolConfig"]["tools"][0]["toolSpec"]["inputSchema"]["json"]["type"],
        "object"
    );
}

/// A turn with a block kind cairn does not model (a grounding tool's call and result, streamed
/// as `toolUse` with `type: "server_tool_use"` and `toolResult`, plus a start kind no SDK knows)
/// and text with `citation` deltas.
fn grounded_stream() -> Vec<Vec<u8>> {
    vec![
        start(),
        event(
            "contentBlockStart",
            r#"{"contentBlockIndex":0,"start":{"toolUse":{"toolUseId":"srv_1","name":"nova_grounding","type":"server_tool_use"}}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"toolUse":{"input":"{\"query\": \"tides\", \"n\": 9007199254740993}"}}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":0}"#),
        event(
            "contentBlockStart",
            r#"{"contentBlockIndex":1,"start":{"toolResult":{"toolUseId":"srv_1","status":"success"}}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":1,"delta":{"toolResult":[{"json":{"hits": 1.50}}]}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":1}"#),
        event(
            "contentBlockStart",
            r#"{"contentBlockIndex":2,"start":{"hologram":{"id":"h\u00e9","depth":1e3}}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":2}"#),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":3,"delta":{"text":"High tide "}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":3,"delta":{"citation":{"title":"Tide tables","sourceContent":[{"text":"06:12"}],"location":{"web":{"url":"https://tides.example/today","domain":"tides.example"}}}}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":3,"delta":{"text":"is at 06:12."}}"#,
        ),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":3,"delta":{"citation":{"location":{"documentChar":{"documentIndex":0,"start":3,"end":9}}}}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":3}"#),
        event("messageStop", r#"{"stopReason":"end_turn"}"#),
        event(
            "metadata",
            r#"{"usage":{"inputTokens":1,"outputTokens":2,"totalTokens":3}}"#,
        ),
    ]
}

#[tokio::test]
async fn unmodelled_blocks_and_citations_go_back_to_bedrock_verbatim_in_place() {
    let server = FakeServer::start().await;
    server.push(stream(&grounded_stream()));
    server.push(stream(&text_stream("Noted.")));
    server.push(stream(&text_stream("Noted.")));
    let provider = provider(&server);
    let ctx = ActivityContext::detached();
    let mut transcript = Transcript::new();
    transcript.push_user_text("When is high tide?");
    let first = provider
        .call(
            &request(MODEL, transcript.clone(), false),
            &cairn_activities::NoDeltas,
            &ctx,
        )
        .await
        .unwrap();
    let server_call = r#"{"toolUse":{"toolUseId":"srv_1","name":"nova_grounding","type":"server_tool_use","input":{"query": "tides", "n": 9007199254740993}}}"#;
    let server_result = r#"{"toolResult":{"toolUseId":"srv_1","status":"success","content":[{"json":{"hits": 1.50}}]}}"#;
    let unknown = r#"{"hologram":{"id":"h\u00e9","depth":1e3}}"#;
    let citations = r#"[{"title":"Tide tables","sourceContent":[{"text":"06:12"}],"location":{"web":{"url":"https://tides.example/today","domain":"tides.example"}}},{"location":{"documentChar":{"documentIndex":0,"start":3,"end":9}}}]"#;
    let opaque =
        |json: &str| Part::Opaque(ProviderJson::new(PROVIDER, JsonText::parse(json).unwrap()));
    assert_eq!(
        first.parts,
        vec![
            opaque(server_call),
            opaque(server_result),
            opaque(unknown),
            Part::Text {
                text: "High tide is at 06:12.".into(),
                item_id: None,
                citations: Some(ProviderJson::new(
                    PROVIDER,
                    JsonText::parse(citations).unwrap()
                )),
            },
        ]
    );
    // A server tool's call is not a call for cairn to run.
    assert_eq!(first.stop_reason, StopReason::EndTurn);

    transcript.push_response(&first);
    transcript.push_user_text("Thanks.");
    provider
        .call(
            &request(MODEL, transcript.clone(), false),
            &cairn_activities::NoDeltas,
            &ctx,
        )
        .await
        .unwrap();
    let raw = String::from_utf8(server.requests()[1].body.clone()).unwrap();
    // Every block exactly as it came, in its place; the text with its citations as the
    // citationsContent block Converse takes.
    let assistant = format!(
        r#"{{"role":"assistant","content":[{server_call},{server_result},{unknown},{{"citationsContent":{{"content":[{{"text":"High tide is at 06:12."}}],"citations":{citations}}}}}]}}"#
    );
    assert!(raw.contains(&assistant), "{raw}");

    // Another family's opaque blocks and citations stay behind; the text goes as text.
    let mut foreign = Transcript::new();
    foreign.push_user_text("When is high tide?");
    let mut moved = first.clone();
    moved.provider = "anthropic".into();
    moved.parts = vec![
        Part::Opaque(ProviderJson::new(
            "anthropic",
            JsonText::parse(
                r#"{"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{}}"#,
            )
            .unwrap(),
        )),
        Part::Text {
            text: "High tide is at 06:12.".into(),
            item_id: None,
            citations: Some(ProviderJson::new(
                "anthropic",
                JsonText::parse("[]").unwrap(),
            )),
        },
    ];
    foreign.push_response(&moved);
    foreign.push_user_text("Thanks.");
    provider
        .call(
            &request(MODEL, foreign, false),
            &cairn_activities::NoDeltas,
            &ctx,
        )
        .await
        .unwrap();
    let raw = String::from_utf8(server.requests()[2].body.clone()).unwrap();
    assert!(
        raw.contains(r#"{"role":"assistant","content":[{"text":"High tide is at 06:12."}]}"#),
        "{raw}"
    );
    assert!(
        !raw.contains("srvtoolu_1") && !raw.contains("citations"),
        "{raw}"
    );
}

#[test]
fn aliased_ids_in_a_response_map_back_to_canonical_ids() {
    // A loop whose canonical ids Bedrock cannot take: the model answers with the alias.
    let mut t = Transcript::new();
    t.push_user_text("go");
    let (_, aliases) = bedrock::render_body(&request(MODEL, t.clone(), false)).unwrap();
    assert_eq!(aliases, IdAliases::new());
    t.push_response(&response(
        PROVIDER,
        vec![Part::ToolUse(ToolUse {
            id: "id with spaces".into(),
            name: "calc".into(),
            arguments: "{}".into(),
            signature: None,
        })],
        StopReason::ToolUse,
    ));
    t.push_tool_results([ToolResult {
        tool_use_id: "id with spaces".into(),
        content: ToolResultContent::Text("ok".into()),
        is_error: false,
    }]);
    let (body, aliases) = bedrock::render_body(&request(MODEL, t, false)).unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let wire = body["messages"][1]["content"][0]["toolUse"]["toolUseId"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        body["messages"][2]["content"][0]["toolResult"]["toolUseId"],
        wire.as_str()
    );
    assert_eq!(aliases.canonical_id(&wire), "id with spaces");
    // Redacted reasoning: base64 kept in `data`, echoed as redactedContent.
    let mut parser = StreamParser::new(MODEL, aliases);
    let sink = cairn_activities::NoDeltas;
    parser
        .feed("messageStart", br#"{"role":"assistant"}"#, &sink)
        .unwrap();
    parser
        .feed(
            "contentBlockDelta",
            br#"{"contentBlockIndex":0,"delta":{"reasoningContent":{"redactedContent":"AAEC/w=="}}}"#,
            &sink,
        )
        .unwrap();
    parser
        .feed("contentBlockStop", br#"{"contentBlockIndex":0}"#, &sink)
        .unwrap();
    parser
        .feed(
            "contentBlockStart",
            format!(
                r#"{{"contentBlockIndex":1,"start":{{"toolUse":{{"toolUseId":"{wire}","name":"calc"}}}}}}"#
            )
            .as_bytes(),
            &sink,
        )
        .unwrap();
    parser
        .feed("contentBlockStop", br#"{"contentBlockIndex":1}"#, &sink)
        .unwrap();
    parser
        .feed("messageStop", br#"{"stopReason":"tool_use"}"#, &sink)
        .unwrap();
    let parsed = parser.finish().unwrap();
    assert_eq!(
        parsed.parts,
        vec![
            Part::RedactedThinking {
                data: "AAEC/w==".into()
            },
            Part::ToolUse(ToolUse {
                id: "id with spaces".into(),
                name: "calc".into(),
                arguments: "{}".into(),
                signature: None,
            }),
        ]
    );
    let mut t = Transcript::new();
    t.push_user_text("go");
    t.push_response(&parsed);
    t.push_tool_results([ToolResult {
        tool_use_id: "id with spaces".into(),
        content: ToolResultContent::Text("ok".into()),
        is_error: false,
    }]);
    let body = bedrock::render(&request(MODEL, t, true)).unwrap();
    assert_eq!(
        body["messages"][1]["content"][0],
        serde_json::json!({"reasoningContent": {"redactedContent": "AAEC/w=="}})
    );
}

#[tokio::test]
async fn http_errors_are_classified() {
    let server = FakeServer::start().await;
    server.judge(|r| {
        r.path.contains("bad-model").then(|| {
            let mut c = Canned::error(
                400,
                r#"{"message":"The provided model identifier is invalid."}"#,
            );
            c.headers.push((
                "x-amzn-errortype".into(),
                "ValidationException:http://internal.amazon.com/coral/com.amazon.bedrock/".into(),
            ));
            c
        })
    });
    let provider = provider(&server);
    let ctx = ActivityContext::detached();
    let mut t = Transcript::new();
    t.push_user_text("hi");
    let sink = cairn_activities::NoDeltas;

    let err = provider
        .call(&request("bad-model", t.clone(), false), &sink, &ctx)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(!err.is_retryable_by_default());
    assert_eq!(
        err.to_string(),
        "HTTP 400: The provided model identifier is invalid."
    );

    let mut throttled = Canned::error(
        429,
        r#"{"message":"Too many requests, please wait before trying your request again."}"#,
    );
    throttled.headers.push(("retry-after".into(), "2".into()));
    server.push(throttled);
    server.push(Canned::error(500, r#"{"message":"Internal server error"}"#));
    server.push(Canned::error(
        503,
        r#"{"message":"Bedrock is unable to process your request."}"#,
    ));
    let err = provider
        .call(&request(MODEL, t.clone(), false), &sink, &ctx)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    assert_eq!(err.retry_after_ms(), Some(2000));
    for status in [500, 503] {
        let err = provider
            .call(&request(MODEL, t.clone(), false), &sink, &ctx)
            .await
            .unwrap_err();
        assert!(err.is_retryable_by_default(), "{status}: {err}");
        assert!(
            err.to_string().starts_with(&format!("HTTP {status}")),
            "{err}"
        );
    }

    // Bedrock's toolResult-count rule is checked before sending: nothing reaches the server.
    let before = server.requests().len();
    let mut t = Transcript::new();
    t.push_user_text("go");
    t.push_response(&response(
        PROVIDER,
        vec![Part::ToolUse(ToolUse {
            id: "a".into(),
            name: "calc".into(),
            arguments: "{}".into(),
            signature: None,
        })],
        StopReason::ToolUse,
    ));
    t.push_tool_results(["a", "b"].map(|id| ToolResult {
        tool_use_id: id.into(),
        content: ToolResultContent::Text("r".into()),
        is_error: false,
    }));
    let err = provider
        .call(&request(MODEL, t, false), &sink, &ctx)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(err.to_string().contains("message 2"), "{err}");
    assert_eq!(server.requests().len(), before);
}

async fn call_with(frames: Vec<Vec<u8>>) -> cairn_activities::Error {
    call_in(&frames, &ActivityContext::detached())
        .await
        .unwrap_err()
}

/// Calls the provider with `context` on a server streaming `frames`.
async fn call_in(
    frames: &[Vec<u8>],
    context: &ActivityContext,
) -> cairn_activities::Result<ModelResponse> {
    let server = FakeServer::start().await;
    server.push(stream(frames));
    let mut t = Transcript::new();
    t.push_user_text("hi");
    provider(&server)
        .call(
            &request(MODEL, t, false),
            &cairn_activities::NoDeltas,
            context,
        )
        .await
}

fn start() -> Vec<u8> {
    event("messageStart", r#"{"role":"assistant"}"#)
}

fn tool_start(index: u32) -> Vec<u8> {
    event(
        "contentBlockStart",
        &format!(
            r#"{{"contentBlockIndex":{index},"start":{{"toolUse":{{"toolUseId":"t{index}","name":"calc"}}}}}}"#
        ),
    )
}

fn tool_input(index: u32, fragment: &str) -> Vec<u8> {
    event(
        "contentBlockDelta",
        &format!(
            r#"{{"contentBlockIndex":{index},"delta":{{"toolUse":{{"input":{}}}}}}}"#,
            serde_json::to_string(fragment).unwrap()
        ),
    )
}

#[tokio::test]
async fn broken_streams_are_typed_errors() {
    // Ends before messageStop: transient.
    let mut frames = text_stream("cut");
    frames.truncate(3);
    let err = call_with(frames).await;
    assert_eq!(err.kind(), ErrorKind::Transient);
    assert!(err.to_string().contains("before messageStop"), "{err}");

    // Ends inside a frame: transient.
    let mut frames = text_stream("cut");
    let last = frames.len() - 1;
    frames[last].truncate(10);
    let err = call_with(frames).await;
    assert_eq!(err.kind(), ErrorKind::Transient);
    assert!(
        err.to_string().contains("inside an event-stream frame"),
        "{err}"
    );

    // A corrupted frame (CRC mismatch): invalid response.
    let mut frames = text_stream("crc");
    let bad = &mut frames[1];
    let at = bad.len() - 6;
    bad[at] ^= 0xff;
    let err = call_with(frames).await;
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);

    // Thinking text without a signature.
    let err = call_with(vec![
        start(),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"reasoningContent":{"text":"hmm"}}}"#,
        ),
        event("contentBlockStop", r#"{"contentBlockIndex":0}"#),
        event("messageStop", r#"{"stopReason":"end_turn"}"#),
    ])
    .await;
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("without a signature"), "{err}");

    // Invalid JSON tool input at the block's stop.
    let err = call_with(vec![
        start(),
        tool_start(0),
        tool_input(0, r#"{"a": "#),
        event("contentBlockStop", r#"{"contentBlockIndex":0}"#),
        event("messageStop", r#"{"stopReason":"tool_use"}"#),
    ])
    .await;
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("not valid JSON"), "{err}");

    // max_tokens inside a toolUse.
    let err = call_with(vec![
        start(),
        tool_start(0),
        tool_input(0, r#"{"a": 1"#),
        event("messageStop", r#"{"stopReason":"max_tokens"}"#),
    ])
    .await;
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    assert!(
        err.to_string().contains("max_tokens inside toolUse"),
        "{err}"
    );

    // A delta of another kind at an existing index.
    let err = call_with(vec![
        start(),
        tool_start(0),
        event(
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"text":"x"}}"#,
        ),
    ])
    .await;
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    assert!(
        err.to_string().contains("text delta for a toolUse block"),
        "{err}"
    );

    // An in-stream throttlingException: rate limited, with Bedrock's message.
    let err = call_with(vec![
        start(),
        exception(
            "throttlingException",
            r#"{"message":"Too many tokens, please wait before trying again."}"#,
        ),
    ])
    .await;
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    assert!(err.to_string().contains("Too many tokens"), "{err}");

    // The other in-stream exceptions.
    for (name, kind) in [
        ("modelStreamErrorException", ErrorKind::Transient),
        ("internalServerException", ErrorKind::Transient),
        ("serviceUnavailableException", ErrorKind::Transient),
        ("validationException", ErrorKind::InvalidRequest),
    ] {
        let err = call_with(vec![start(), exception(name, r#"{"message":"m"}"#)]).await;
        assert_eq!(err.kind(), kind, "{name}: {err}");
    }
}

#[test]
fn from_env_without_credentials_is_an_auth_error() {
    // Only this test touches these variables in this binary.
    std::env::remove_var("AWS_ACCESS_KEY_ID");
    let err = BedrockProvider::from_env().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Auth);
    assert!(err.to_string().contains("AWS_ACCESS_KEY_ID"), "{err}");
}

#[tokio::test]
async fn a_frame_over_the_cap_is_refused_with_a_typed_error() {
    let server = FakeServer::start().await;
    let big = "y".repeat(5000);
    server.push(stream(&text_stream(&big)));
    let settings = HttpSettings::new(server.base_url(), None).with_max_event_bytes(4096);
    let provider = BedrockProvider::new(
        settings,
        AwsCredentials {
            access_key_id: "AKID".into(),
            secret_access_key: "SECRET".into(),
            session_token: None,
        },
        "us-east-1".into(),
    );
    let mut t = Transcript::new();
    t.push_user_text("hi");
    let err = provider
        .call(
            &request(MODEL, t, false),
            &cairn_activities::NoDeltas,
            &ActivityContext::detached(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, cairn_activities::Error::EventTooLarge { provider, limit_bytes: 4096, .. } if provider == PROVIDER),
        "{err:?}"
    );
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("event-stream frame"), "{err}");
    // Frames under the cap decode, pushed all at once (many frames in one chunk).
    let mut decoder = bedrock::FrameDecoder::with_max_frame_bytes(4096);
    decoder.push(&text_stream("small").concat());
    let mut events = 0;
    while decoder.next_event().unwrap().is_some() {
        events += 1;
    }
    assert_eq!(events, text_stream("small").len());
    decoder.finish().unwrap();
}

#[tokio::test]
async fn an_error_echoing_the_aws_secrets_is_scrubbed() {
    const SECRET_KEY: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    const TOKEN: &str = "IQoJb3JpZ2luX2VjEXAMPLETOKENvalue0123456789";
    let server = FakeServer::start().await;
    // The secret key JSON-escaped with `\/`, as some encoders write it; the token plain.
    let body = format!(
        r#"{{"message":"The security token {TOKEN} and key {} do not match"}}"#,
        SECRET_KEY.replace('/', "\\/")
    );
    server.push(Canned::error(403, &body));
    let provider = BedrockProvider::new(
        HttpSettings::new(server.base_url(), None),
        AwsCredentials {
            access_key_id: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_access_key: SECRET_KEY.into(),
            session_token: Some(TOKEN.into()),
        },
        "us-east-1".into(),
    );
    let mut t = Transcript::new();
    t.push_user_text("hi");
    let err = provider
        .call(
            &request(MODEL, t, false),
            &cairn_activities::NoDeltas,
            &ActivityContext::detached(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Auth);
    let shown = format!("{err} / {err:?}");
    for secret in [SECRET_KEY, "K7MDENG", TOKEN] {
        assert!(!shown.contains(secret), "{shown}");
    }
    assert!(shown.contains("The security token [redacted]"), "{shown}");
    // The settings the provider holds print no secret either.
    let printed = format!("{provider:?}");
    assert!(
        !printed.contains(SECRET_KEY) && !printed.contains(TOKEN),
        "{printed}"
    );
}

/// A context counting its heartbeats.
fn counting_context() -> (
    ActivityContext,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let beats = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = beats.clone();
    let context = ActivityContext::new(
        1,
        None,
        tokio_util::sync::CancellationToken::new(),
        move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        },
    );
    (context, beats)
}

#[tokio::test]
async fn every_frame_is_a_heartbeat() {
    let frames = text_stream("beat");
    let (context, beats) = counting_context();
    let response = call_in(&frames, &context).await.unwrap();
    assert_eq!(response.text(), "beat");
    // One per frame, the metadata after messageStop included; the chunks (cut every 7 bytes)
    // do not count, frames do.
    assert_eq!(
        beats.load(std::sync::atomic::Ordering::SeqCst),
        frames.len()
    );
}

#[tokio::test]
async fn usage_is_reported_as_soon_as_metadata_arrives() {
    // metadata, then the stream is cut inside a frame before messageStop.
    let mut frames = text_stream("cut");
    let metadata = frames.pop().unwrap();
    let stop = frames.pop().unwrap();
    frames.push(metadata);
    frames.push(stop[..stop.len() / 2].to_vec());
    let context = ActivityContext::detached();
    let err = call_in(&frames, &context).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    let usage = context.reported_usage().expect("usage reported mid-stream");
    assert_eq!((usage.input_tokens, usage.output_tokens), (1, 2));
}
