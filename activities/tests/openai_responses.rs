//! The OpenAI Responses provider against the fake server: documented stream shapes into exact
//! canonical responses, the follow-up request carrying raw reasoning items back in order,
//! classified HTTP errors, the adapter's refusals, and malformed streams as typed errors.

mod support;

use cairn_activities::providers::http::HttpSettings;
use cairn_activities::providers::openai_responses::{
    render, OpenAiResponsesProvider, StreamParser, PROVIDER,
};
use cairn_activities::{
    ActivityContext, CallContext, Error, ErrorKind, ModelProvider, ModelRequest, NoDeltas,
};
use cairn_ledger::{
    Delta, JsonText, ModelResponse, ModelSpec, Part, StopReason, ToolResult, ToolResultContent,
    ToolSpec, ToolUse, Transcript, Usage,
};
use serde_json::{json, Value};
use std::sync::Mutex;
use support::{Canned, FakeServer};

/// The reasoning item exactly as the stream's `output_item.done` carries it.
const REASONING: &str = r#"{"id":"rs_68af","type":"reasoning","summary":[{"type":"summary_text","text":"Weather in two cities."}],"encrypted_content":"gAAAAABoaXJ3c2Vu+/Y2xvdWR5==","status":"completed"}"#;
const ARGS_1: &str = r#"{"city":"Paris","request_id":9007199254740993}"#;
const ARGS_2: &str = r#"{"city": "Oslo"}"#;

fn frame(event: &str, data: &str) -> String {
    format!("event: {event}\ndata: {data}\n\n")
}

/// A documented stream: reasoning (encrypted), message text, two function calls with argument
/// deltas, unknown/ignored events in between, and usage on `response.completed`.
fn tool_stream() -> String {
    let events = [
        ("response.created", r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","model":"gpt-5-2025-08-07","output":[],"usage":null}}"#.to_owned()),
        ("response.in_progress", r#"{"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_1","status":"in_progress"}}"#.to_owned()),
        ("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"id":"rs_68af","type":"reasoning","summary":[]}}"#.to_owned()),
        ("response.reasoning_summary_part.added", r#"{"type":"response.reasoning_summary_part.added","sequence_number":3,"item_id":"rs_68af","output_index":0,"summary_index":0,"part":{"type":"summary_text","text":""}}"#.to_owned()),
        ("response.reasoning_summary_text.delta", r#"{"type":"response.reasoning_summary_text.delta","sequence_number":4,"item_id":"rs_68af","output_index":0,"summary_index":0,"delta":"Weather in two cities."}"#.to_owned()),
        ("response.output_item.done", format!(r#"{{"type":"response.output_item.done","sequence_number":5,"output_index":0,"item":{REASONING}}}"#)),
        ("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":6,"output_index":1,"item":{"id":"msg_1","type":"message","status":"in_progress","role":"assistant","content":[]}}"#.to_owned()),
        ("response.content_part.added", r#"{"type":"response.content_part.added","sequence_number":7,"item_id":"msg_1","output_index":1,"content_index":0,"part":{"type":"output_text","annotations":[],"text":""}}"#.to_owned()),
        ("response.output_text.delta", r#"{"type":"response.output_text.delta","sequence_number":8,"item_id":"msg_1","output_index":1,"content_index":0,"delta":"Checking ","logprobs":[]}"#.to_owned()),
        ("response.output_text.delta", r#"{"type":"response.output_text.delta","sequence_number":9,"item_id":"msg_1","output_index":1,"content_index":0,"delta":"both.","logprobs":[]}"#.to_owned()),
        ("response.output_text.done", r#"{"type":"response.output_text.done","sequence_number":10,"item_id":"msg_1","output_index":1,"content_index":0,"text":"Checking both.","logprobs":[]}"#.to_owned()),
        ("response.output_item.done", r#"{"type":"response.output_item.done","sequence_number":11,"output_index":1,"item":{"id":"msg_1","type":"message","status":"completed","role":"assistant","content":[{"type":"output_text","annotations":[],"logprobs":[],"text":"Checking both."}]}}"#.to_owned()),
        ("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":12,"output_index":2,"item":{"id":"fc_1","type":"function_call","status":"in_progress","arguments":"","call_id":"call_A","name":"get_weather"}}"#.to_owned()),
        ("response.function_call_arguments.delta", r#"{"type":"response.function_call_arguments.delta","sequence_number":13,"item_id":"fc_1","output_index":2,"delta":"{\"city\":\"Paris\","}"#.to_owned()),
        ("response.function_call_arguments.delta", r#"{"type":"response.function_call_arguments.delta","sequence_number":14,"item_id":"fc_1","output_index":2,"delta":"\"request_id\":9007199254740993}"}"#.to_owned()),
        ("response.function_call_arguments.done", format!(r#"{{"type":"response.function_call_arguments.done","sequence_number":15,"item_id":"fc_1","output_index":2,"arguments":{}}}"#, json!(ARGS_1))),
        ("response.output_item.done", format!(r#"{{"type":"response.output_item.done","sequence_number":16,"output_index":2,"item":{{"id":"fc_1","type":"function_call","status":"completed","arguments":{},"call_id":"call_A","name":"get_weather"}}}}"#, json!(ARGS_1))),
        ("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":17,"output_index":3,"item":{"id":"fc_2","type":"function_call","status":"in_progress","arguments":"","call_id":"call_B","name":"get_weather"}}"#.to_owned()),
        ("response.function_call_arguments.delta", format!(r#"{{"type":"response.function_call_arguments.delta","sequence_number":18,"item_id":"fc_2","output_index":3,"delta":{}}}"#, json!(ARGS_2))),
        ("response.output_item.done", format!(r#"{{"type":"response.output_item.done","sequence_number":19,"output_index":3,"item":{{"id":"fc_2","type":"function_call","status":"completed","arguments":{},"call_id":"call_B","name":"get_weather"}}}}"#, json!(ARGS_2))),
        ("response.completed", r#"{"type":"response.completed","sequence_number":20,"response":{"id":"resp_1","object":"response","status":"completed","model":"gpt-5-2025-08-07","output":[],"usage":{"input_tokens":120,"input_tokens_details":{"cached_tokens":20},"output_tokens":80,"output_tokens_details":{"reasoning_tokens":50},"total_tokens":200}}}"#.to_owned()),
    ];
    events.iter().map(|(e, d)| frame(e, d)).collect()
}

fn expected_response() -> ModelResponse {
    ModelResponse {
        provider: PROVIDER.into(),
        model: "gpt-5-2025-08-07".into(),
        parts: vec![
            Part::ReasoningItem {
                item: JsonText::parse(REASONING).unwrap(),
            },
            Part::Text {
                citations: None,
                text: "Checking both.".into(),
                item_id: Some("msg_1".into()),
            },
            Part::ToolUse(ToolUse {
                id: "call_A".into(),
                name: "get_weather".into(),
                arguments: ARGS_1.into(),
                signature: Some("fc_1".into()),
            }),
            Part::ToolUse(ToolUse {
                id: "call_B".into(),
                name: "get_weather".into(),
                arguments: ARGS_2.into(),
                signature: Some("fc_2".into()),
            }),
        ],
        stop_reason_raw: "completed".into(),
        stop_reason: StopReason::ToolUse,
        usage: Usage {
            input_tokens: 100,
            output_tokens: 80,
            cache_read_tokens: 20,
            cache_write_tokens: 0,
            reasoning_tokens: 50,
        },
    }
}

fn request(transcript: Transcript) -> ModelRequest {
    ModelRequest {
        options: Default::default(),
        context: CallContext::default(),
        model: ModelSpec {
            provider: PROVIDER.into(),
            model: "gpt-5".into(),
            max_tokens: Some(2048),
            thinking_budget_tokens: None,
        },
        transcript: transcript.into(),
        tools: vec![ToolSpec {
            name: "get_weather".into(),
            description: "Current weather for a city".into(),
            input_schema: JsonText::parse(
                r#"{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}"#,
            )
            .unwrap(),
        }]
        .into(),
    }
}

fn first_turn() -> Transcript {
    let mut t = Transcript::new();
    t.push_system("Be brief.");
    t.push_user_text("Weather in Paris and Oslo?");
    t
}

fn provider(server: &FakeServer) -> OpenAiResponsesProvider {
    OpenAiResponsesProvider::new(HttpSettings::new(server.base_url(), Some("sk-test".into())))
}

async fn call(server: &FakeServer, req: &ModelRequest) -> Result<ModelResponse, Error> {
    provider(server)
        .call(req, &NoDeltas, &ActivityContext::detached())
        .await
}

/// Feeds a whole SSE text to a parser (for the pure malformed-stream checks).
fn parse(text: &str) -> Result<ModelResponse, Error> {
    let mut parser = StreamParser::new("gpt-5");
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut event = "";
        let mut data = "";
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event: ") {
                event = v;
            } else if let Some(v) = line.strip_prefix("data: ") {
                data = v;
            }
        }
        parser.feed(event, data, &NoDeltas)?;
    }
    parser.finish()
}

#[tokio::test]
async fn documented_stream_becomes_the_exact_canonical_response_with_deltas() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&tool_stream()));
    let seen = Mutex::new(Vec::new());
    let sink = |d: Delta| seen.lock().unwrap().push(d);
    let response = provider(&server)
        .call(&request(first_turn()), &sink, &ActivityContext::detached())
        .await
        .unwrap();
    assert_eq!(response, expected_response());
    // The reasoning item's text is byte-identical to the one in output_item.done.
    let Part::ReasoningItem { item } = &response.parts[0] else {
        panic!("first part is not a reasoning item");
    };
    assert_eq!(item.as_str(), REASONING);
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            Delta::Thinking("Weather in two cities.".into()),
            Delta::Text("Checking ".into()),
            Delta::Text("both.".into()),
            Delta::ToolArguments {
                tool_use_id: "call_A".into(),
                fragment: "{\"city\":\"Paris\",".into()
            },
            Delta::ToolArguments {
                tool_use_id: "call_A".into(),
                fragment: "\"request_id\":9007199254740993}".into()
            },
            Delta::ToolArguments {
                tool_use_id: "call_B".into(),
                fragment: ARGS_2.into()
            },
        ]
    );
    let sent = &server.requests()[0];
    assert_eq!(sent.path, "/responses");
    assert_eq!(sent.headers["authorization"], "Bearer sk-test");
    let body = sent.json();
    assert_eq!(body, render(&request(first_turn())).unwrap());
    assert_eq!(
        body,
        json!({
            "model": "gpt-5",
            "stream": true,
            "store": false,
            "include": ["reasoning.encrypted_content"],
            "instructions": "Be brief.",
            "max_output_tokens": 2048,
            "tools": [{
                "type": "function",
                "name": "get_weather",
                "description": "Current weather for a city",
                "parameters": {"type":"object","properties":{"city":{"type":"string"}},"required":["city"]},
                "strict": false
            }],
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Oslo?"}]}]
        })
    );
}

#[tokio::test]
async fn follow_up_sends_the_reasoning_item_raw_and_in_order_with_one_output_per_call() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&tool_stream()));
    let mut transcript = first_turn();
    let first = call(&server, &request(transcript.clone())).await.unwrap();
    transcript.push_response(&first);
    transcript.push_tool_results([
        ToolResult {
            tool_use_id: "call_A".into(),
            content: ToolResultContent::Json(
                JsonText::parse(r#"{"temp_c":21,"big":9007199254740993}"#).unwrap(),
            ),
            is_error: false,
        },
        ToolResult {
            tool_use_id: "call_B".into(),
            content: ToolResultContent::Text("city not found".into()),
            is_error: true,
        },
    ]);
    server.push(Canned::sse(
        &[
            frame("response.created", r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_2","status":"in_progress","model":"gpt-5-2025-08-07"}}"#),
            frame("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"msg_2","type":"message","role":"assistant","content":[]}}"#),
            frame("response.output_item.done", r#"{"type":"response.output_item.done","sequence_number":2,"output_index":0,"item":{"id":"msg_2","type":"message","role":"assistant","status":"completed","content":[{"type":"output_text","annotations":[],"text":"Paris 21°C; Oslo unknown."}]}}"#),
            frame("response.completed", r#"{"type":"response.completed","sequence_number":3,"response":{"id":"resp_2","status":"completed","model":"gpt-5-2025-08-07","usage":{"input_tokens":300,"input_tokens_details":{"cached_tokens":0},"output_tokens":9,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":309}}}"#),
        ]
        .concat(),
    ));
    let second = call(&server, &request(transcript.clone())).await.unwrap();
    assert_eq!(second.text(), "Paris 21°C; Oslo unknown.");
    assert_eq!(second.stop_reason, StopReason::EndTurn);
    assert_eq!(second.stop_reason_raw, "completed");

    let sent = &server.requests()[1];
    let bytes = String::from_utf8(sent.body.clone()).unwrap();
    // The reasoning item is embedded byte for byte, never re-serialized.
    assert!(bytes.contains(REASONING), "{bytes}");
    // Arguments go back as the exact strings; the JSON result as its exact text.
    assert!(bytes.contains(&json!(ARGS_1).to_string()), "{bytes}");
    assert!(
        bytes.contains(&json!(r#"{"temp_c":21,"big":9007199254740993}"#).to_string()),
        "{bytes}"
    );
    let body = sent.json();
    assert_eq!(body["store"], json!(false));
    assert_eq!(body["include"], json!(["reasoning.encrypted_content"]));
    let reasoning: Value = serde_json::from_str(REASONING).unwrap();
    assert_eq!(
        body["input"],
        json!([
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Oslo?"}]},
            reasoning,
            // The text goes back with its item id: the reasoning item is paired with it.
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking both.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_A", "name": "get_weather", "arguments": ARGS_1},
            {"type": "function_call", "id": "fc_2", "call_id": "call_B", "name": "get_weather", "arguments": ARGS_2},
            {"type": "function_call_output", "call_id": "call_A", "output": r#"{"temp_c":21,"big":9007199254740993}"#},
            {"type": "function_call_output", "call_id": "call_B", "output": "city not found"},
        ])
    );
}

/// OpenAI's documented 400 body for an orphaned reasoning item.
fn orphan_reasoning_error(id: &str) -> String {
    json!({"error": {
        "message": format!("Item '{id}' of type 'reasoning' was provided without its required following item."),
        "type": "invalid_request_error",
        "param": "input",
        "code": null
    }})
    .to_string()
}

#[tokio::test]
async fn provider_rejections_are_classified_with_its_message_and_retry_after() {
    let server = FakeServer::start().await;
    // The fake judges like the API: a reasoning item must be followed by the item it produced,
    // paired by that item's id.
    server.judge(|r| {
        let body: Value = serde_json::from_slice(&r.body).ok()?;
        let input = body["input"].as_array()?;
        for (i, item) in input.iter().enumerate() {
            if item["type"] == "reasoning" {
                let next = input.get(i + 1);
                let paired =
                    next.is_some_and(|n| n["type"] != "function_call" || n.get("id").is_some());
                if !paired {
                    let id = item["id"].as_str().unwrap_or_default();
                    return Some(Canned::error(400, &orphan_reasoning_error(id)));
                }
            }
        }
        None
    });
    // A function call whose item id was lost (e.g. imported history) cannot be paired.
    let mut transcript = first_turn();
    transcript.push_response(&ModelResponse {
        parts: vec![
            Part::ReasoningItem {
                item: JsonText::parse(REASONING).unwrap(),
            },
            Part::ToolUse(ToolUse {
                id: "call_A".into(),
                name: "get_weather".into(),
                arguments: ARGS_1.into(),
                signature: None,
            }),
        ],
        ..expected_response()
    });
    transcript.push_tool_results([ToolResult {
        tool_use_id: "call_A".into(),
        content: ToolResultContent::Text("21".into()),
        is_error: false,
    }]);
    let err = call(&server, &request(transcript)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(!err.is_retryable_by_default());
    assert_eq!(
        err.to_string(),
        "HTTP 400: Item 'rs_68af' of type 'reasoning' was provided without its required following item."
    );

    let mut limited = Canned::error(
        429,
        r#"{"error":{"message":"Rate limit reached for gpt-5","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#,
    );
    limited.headers.push(("retry-after".into(), "7".into()));
    server.push(limited);
    server.push(Canned::error(
        500,
        r#"{"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}}"#,
    ));
    let err = call(&server, &request(first_turn())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    assert_eq!(err.retry_after_ms(), Some(7000));
    assert!(err.is_retryable_by_default());
    let err = call(&server, &request(first_turn())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient);
    assert!(err.is_retryable_by_default());
    assert!(err.to_string().contains("The server had an error"), "{err}");
}

#[test]
fn render_refuses_text_after_a_function_call_and_a_trailing_reasoning_item() {
    let call_a = Part::ToolUse(ToolUse {
        id: "call_A".into(),
        name: "get_weather".into(),
        arguments: ARGS_1.into(),
        signature: Some("fc_1".into()),
    });
    let mut t = first_turn();
    t.push_response(&ModelResponse {
        parts: vec![call_a.clone(), Part::text("and then")],
        ..expected_response()
    });
    let err = render(&request(t)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    let text = err.to_string();
    assert!(
        text.contains("message 2 (assistant) part 1 (text)")
            && text.contains("function_call at part 0"),
        "{text}"
    );

    let mut t = first_turn();
    t.push_response(&ModelResponse {
        parts: vec![
            Part::text("hi"),
            Part::ReasoningItem {
                item: JsonText::parse(REASONING).unwrap(),
            },
        ],
        ..expected_response()
    });
    t.push_user_text("more");
    let err = render(&request(t)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(
        err.to_string().contains(
            "message 2 (assistant) part 1 (reasoning_item): Item 'rs_68af' of type 'reasoning' was provided without its required following item"
        ),
        "{err}"
    );

    // Signed thinking without provenance (so not dropped as foreign) cannot be sent.
    let mut t = first_turn();
    t.messages.push(cairn_ledger::Message {
        role: cairn_ledger::Role::Assistant,
        parts: vec![
            Part::Thinking {
                text: "t".into(),
                signature: "sig".into(),
            },
            Part::text("a"),
        ],
        provenance: None,
    });
    let err = render(&request(t)).unwrap_err();
    assert!(
        err.to_string()
            .contains("message 2 (assistant) part 0 (thinking)"),
        "{err}"
    );
}

#[test]
fn foreign_reasoning_of_completed_turns_is_dropped() {
    let mut t = first_turn();
    t.push_response(&ModelResponse {
        provider: "anthropic".into(),
        model: "claude".into(),
        parts: vec![
            Part::Thinking {
                text: "t".into(),
                signature: "sig".into(),
            },
            Part::text("a"),
        ],
        stop_reason_raw: "end_turn".into(),
        stop_reason: StopReason::EndTurn,
        usage: Usage::default(),
    });
    t.push_user_text("next");
    let body = render(&request(t)).unwrap();
    assert_eq!(
        body["input"][1],
        json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]})
    );
}

#[test]
fn items_whose_reasoning_compaction_dropped_go_back_without_their_ids() {
    let mut t = first_turn();
    t.push_response(&expected_response());
    t.push_tool_results(["call_A", "call_B"].map(|id| ToolResult {
        tool_use_id: id.into(),
        content: ToolResultContent::Text("sunny".into()),
        is_error: false,
    }));
    t.push_response(&ModelResponse {
        parts: vec![Part::Text {
            text: "Sunny in both.".into(),
            item_id: Some("msg_2".into()),
            citations: None,
        }],
        stop_reason: StopReason::EndTurn,
        ..expected_response()
    });
    t.push_user_text("Thanks. And Rome?");
    // As sent: with its reasoning item, every item keeps its id.
    let body = render(&request(t.clone())).unwrap();
    let input = body["input"].as_array().unwrap();
    let at = |kind: &str| input.iter().position(|item| item["type"] == kind).unwrap();
    assert_eq!(input[at("reasoning") + 1]["id"], "msg_1");
    assert_eq!(input[at("function_call")]["id"], "fc_1");
    // The reasoning dropped: the ids that pointed to it go too, call ids stay.
    let compacted = cairn_ledger::drop_reasoning(&t);
    let body = render(&request(compacted)).unwrap();
    let input = body["input"].as_array().unwrap();
    assert!(
        input.iter().all(|item| item["type"] != "reasoning"),
        "{body}"
    );
    let call = input
        .iter()
        .position(|item| item["type"] == "function_call")
        .unwrap();
    assert_eq!(
        input[call - 1],
        json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking both."}]})
    );
    assert_eq!(
        input[call],
        json!({"type": "function_call", "call_id": "call_A", "name": "get_weather", "arguments": ARGS_1})
    );
    assert!(input.iter().all(|item| item.get("id").is_none()), "{body}");
}

fn created() -> String {
    frame(
        "response.created",
        r#"{"type":"response.created","response":{"id":"r","status":"in_progress","model":"gpt-5"}}"#,
    )
}

fn added_call() -> String {
    frame(
        "response.output_item.added",
        r#"{"type":"response.output_item.added","output_index":0,"item":{"id":"fc_1","type":"function_call","status":"in_progress","arguments":"","call_id":"call_A","name":"get_weather"}}"#,
    )
}

#[tokio::test]
async fn a_stream_that_ends_without_a_terminal_event_is_a_retryable_stream_error() {
    let server = FakeServer::start().await;
    let cut: String = tool_stream()
        .split_inclusive("\n\n")
        .filter(|f| !f.starts_with("event: response.completed"))
        .collect();
    server.push(Canned::sse(&cut));
    let err = call(&server, &request(first_turn())).await.unwrap_err();
    assert!(matches!(err, Error::Stream { .. }), "{err:?}");
    assert_eq!(err.kind(), ErrorKind::Transient);
    assert!(
        err.to_string().contains("without response.completed"),
        "{err}"
    );
}

#[test]
fn malformed_streams_are_typed_errors() {
    // A delta for an item never added.
    let err = parse(&format!(
        "{}{}",
        created(),
        frame(
            "response.output_text.delta",
            r#"{"type":"response.output_text.delta","item_id":"msg_9","output_index":0,"content_index":0,"delta":"x"}"#
        )
    ))
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Stream {
                kind: ErrorKind::InvalidResponse,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("unknown item \"msg_9\""), "{err}");

    // output_item.done for an item never added.
    let err = parse(&format!(
        "{}{}",
        created(),
        frame(
            "response.output_item.done",
            r#"{"type":"response.output_item.done","output_index":0,"item":{"id":"msg_1","type":"message","content":[]}}"#
        )
    ))
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("was never added"), "{err}");

    // A delta of the wrong kind for its item.
    let err = parse(&format!(
        "{}{}{}",
        created(),
        added_call(),
        frame(
            "response.output_text.delta",
            r#"{"type":"response.output_text.delta","item_id":"fc_1","output_index":0,"content_index":0,"delta":"x"}"#
        )
    ))
    .unwrap_err();
    assert!(
        err.to_string().contains("delta for function_call item"),
        "{err}"
    );

    // response.completed with an item still open.
    let err = parse(&format!(
        "{}{}{}",
        created(),
        added_call(),
        frame(
            "response.completed",
            r#"{"type":"response.completed","response":{"status":"completed"}}"#
        )
    ))
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("never finished"), "{err}");

    // response.failed: classified from its error code, with the provider's message.
    let err = parse(&format!(
        "{}{}",
        created(),
        frame(
            "response.failed",
            r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"server_error","message":"The model failed to generate a response."}}}"#
        )
    ))
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient);
    assert!(
        err.to_string().contains("server_error") && err.to_string().contains("failed to generate"),
        "{err}"
    );
    let err = parse(&format!(
        "{}{}",
        created(),
        frame(
            "response.failed",
            r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"invalid_prompt","message":"Invalid prompt."}}}"#
        )
    ))
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);

    // An `error` event mid-stream.
    let err = parse(&format!(
        "{}{}",
        created(),
        frame(
            "error",
            r#"{"type":"error","code":"rate_limit_exceeded","message":"Slow down.","param":null,"sequence_number":1}"#
        )
    ))
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    assert!(err.to_string().contains("Slow down."), "{err}");

    // Out-of-order sequence numbers.
    let err = parse(&format!(
        "{}{}",
        frame(
            "response.created",
            r#"{"type":"response.created","sequence_number":5,"response":{}}"#
        ),
        frame(
            "response.in_progress",
            r#"{"type":"response.in_progress","sequence_number":5,"response":{}}"#
        )
    ))
    .unwrap_err();
    assert!(
        err.to_string().contains("sequence_number 5 after 5"),
        "{err}"
    );
}

#[test]
fn max_output_tokens_inside_a_function_call_is_never_executable() {
    // The call is still open when the response stops.
    let open = format!(
        "{}{}{}{}",
        created(),
        added_call(),
        frame(
            "response.function_call_arguments.delta",
            r#"{"type":"response.function_call_arguments.delta","item_id":"fc_1","output_index":0,"delta":"{\"city\":\"Par"}"#
        ),
        frame(
            "response.incomplete",
            r#"{"type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":10,"output_tokens":64}}}"#
        )
    );
    let err = parse(&open).unwrap_err();
    assert!(matches!(err, Error::InvalidResponse { .. }), "{err:?}");
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    assert!(err.to_string().contains("call_A"), "{err}");

    // The server closed the item, but it is the last one of an incomplete response.
    let closed = format!(
        "{}{}{}{}",
        created(),
        added_call(),
        frame(
            "response.output_item.done",
            r#"{"type":"response.output_item.done","output_index":0,"item":{"id":"fc_1","type":"function_call","status":"incomplete","arguments":"{\"city\":\"Par","call_id":"call_A","name":"get_weather"}}"#
        ),
        frame(
            "response.incomplete",
            r#"{"type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}}"#
        )
    );
    let err = parse(&closed).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);

    // max_output_tokens in text is an ordinary MaxTokens response.
    let text = format!(
        "{}{}{}{}",
        created(),
        frame(
            "response.output_item.added",
            r#"{"type":"response.output_item.added","output_index":0,"item":{"id":"msg_1","type":"message","role":"assistant","content":[]}}"#
        ),
        frame(
            "response.output_text.delta",
            r#"{"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"Partial"}"#
        ),
        frame(
            "response.incomplete",
            r#"{"type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}}"#
        )
    );
    let response = parse(&text).unwrap();
    assert_eq!(response.stop_reason, StopReason::MaxTokens);
    assert_eq!(response.stop_reason_raw, "max_output_tokens");
    assert_eq!(response.text(), "Partial");
}

#[test]
fn max_output_tokens_while_reasoning_is_the_request_s_fault_and_not_retried() {
    let reasoning_added = frame(
        "response.output_item.added",
        r#"{"type":"response.output_item.added","output_index":0,"item":{"id":"rs_68af","type":"reasoning","summary":[]}}"#,
    );
    let incomplete = frame(
        "response.incomplete",
        r#"{"type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":10,"output_tokens":64}}}"#,
    );
    // The reasoning item finished, and nothing came after it.
    let finished = format!(
        "{}{}{}{}",
        created(),
        reasoning_added,
        frame(
            "response.output_item.done",
            &format!(
                r#"{{"type":"response.output_item.done","output_index":0,"item":{REASONING}}}"#
            )
        ),
        incomplete
    );
    // The reasoning item was still open.
    let open = format!("{}{}{}", created(), reasoning_added, incomplete);
    for stream in [finished, open] {
        let err = parse(&stream).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
        assert!(!err.is_retryable_by_default());
        assert!(
            err.to_string()
                .contains("reached its output token limit (max_output_tokens) while the model was still reasoning"),
            "{err}"
        );
    }
}

#[test]
fn unknown_event_types_are_ignored() {
    let text = format!(
        "{}{}{}{}{}{}",
        created(),
        frame(
            "response.some_future_event",
            r#"{"type":"response.some_future_event","whatever":[1,2]}"#
        ),
        frame(
            "response.output_item.added",
            r#"{"type":"response.output_item.added","output_index":0,"item":{"id":"msg_1","type":"message","role":"assistant","content":[]}}"#
        ),
        frame("keepalive", r#"{"type":"keepalive"}"#),
        frame(
            "response.output_item.done",
            r#"{"type":"response.output_item.done","output_index":0,"item":{"id":"msg_1","type":"message","role":"assistant","status":"completed","content":[{"type":"output_text","annotations":[],"text":"Hi."}]}}"#
        ),
        frame(
            "response.completed",
            r#"{"type":"response.completed","response":{"status":"completed","model":"gpt-5","usage":null}}"#
        )
    );
    let response = parse(&text).unwrap();
    assert_eq!(response.text(), "Hi.");
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    assert_eq!(response.usage, Usage::default());
}

#[tokio::test]
async fn the_usage_of_the_terminal_event_is_reported_even_when_the_response_is_refused() {
    // Responses carries usage only on its terminal event; a response refused after it (a call
    // cut by max_output_tokens) still leaves that usage with the failed attempt.
    let server = FakeServer::start().await;
    server.push(Canned::sse(&format!(
        "{}{}{}",
        created(),
        added_call(),
        frame(
            "response.incomplete",
            r#"{"type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":10,"output_tokens":64}}}"#
        )
    )));
    let context = ActivityContext::detached();
    let err = provider(&server)
        .call(&request(first_turn()), &NoDeltas, &context)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidResponse, "{err}");
    let usage = context
        .reported_usage()
        .expect("usage reported before the refusal");
    assert_eq!((usage.input_tokens, usage.output_tokens), (10, 64));
}
