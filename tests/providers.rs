//! The four real model providers end to end: the `cairn` binary talks over 127.0.0.1 to a fake
//! server speaking each provider's documented wire format. The fake judges every request by the
//! provider's rules and answers a broken one with that provider's documented 400, so a turn that
//! completes proves the runtime's requests are accepted. Covered: thinking + text + two parallel
//! calculator calls then a final answer (per provider); a SIGKILL mid-stream and `cairn resume`;
//! HTTP errors classified (429 with retry-after, 400 fails the turn at once).

#[path = "../activities/tests/support/mod.rs"]
mod fake;

use aws_smithy_eventstream::frame::write_message_to;
use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
use aws_smithy_types::str_bytes::StrBytes;
use fake::{Canned, FakeServer, Recorded};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// The script every provider plays: round r = thinking, text, two parallel calculator calls
// ---------------------------------------------------------------------------------------------

/// The two parallel calls of every tool round, and what the calculator answers.
const CALLS: [(&str, &str); 2] = [
    (r#"{"expression":"6*7"}"#, r#""value":42"#),
    (r#"{"expression":"2+2"}"#, r#""value":4"#),
];
const FINAL: &str = "6*7 is 42 and 2+2 is 4.";

/// The thinking of round `r`, streamed in two halves.
fn think(r: u32) -> [String; 2] {
    [
        format!("Round {r}: two independent sums,"),
        " so both at once.".to_owned(),
    ]
}

fn think_text(r: u32) -> String {
    think(r).concat()
}

/// The signature (or encrypted content) of round `r`'s thinking.
fn sig(r: u32) -> String {
    format!("RXFRQkNnSVlBaElNcm91bmQ{r}+/==")
}

/// The round whose thinking this is, if the fake issued it.
fn issued_round(text: &str) -> Option<u32> {
    (0..8).find(|r| think_text(*r) == text)
}

/// How a provider is driven and judged.
struct Wire {
    /// `--model` prefix and the provenance of its responses.
    provider: &'static str,
    /// `transcript --as` format.
    format: &'static str,
    /// Extra `cairn run` arguments (thinking needs a budget for some providers).
    args: &'static [&'static str],
    content_type: &'static str,
    env: fn(&str) -> Vec<(&'static str, String)>,
    /// Tool round `r`, one element per wire event (frame).
    tool_round: fn(u32) -> Vec<Vec<u8>>,
    /// A final answer.
    text: fn(&str) -> Vec<Vec<u8>>,
    /// The rule a request breaks, if any.
    judge: fn(&Recorded) -> Option<String>,
    /// The provider's documented 400 for a request it refuses.
    reject: fn(&str) -> Canned,
    /// The conversation of a request body (messages or input items).
    messages: fn(&Value) -> Vec<Value>,
    /// The tool call ids of round `r`.
    ids: fn(u32) -> [String; 2],
    /// The exact text of round `r`'s thinking echoed in a follow-up body.
    echo: fn(u32) -> String,
    /// Every (id, arguments) tool call of a body, in order.
    calls: fn(&Value) -> Vec<(String, String)>,
    /// Every (id, content) tool result of a body, in order.
    results: fn(&Value) -> Vec<(String, String)>,
}

const KEYS_TO_CLEAR: &[&str] = &[
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "BEDROCK_BASE_URL",
    "RUST_LOG",
];

fn sse_event(name: Option<&str>, data: &Value) -> Vec<u8> {
    match name {
        Some(name) => format!("event: {name}\ndata: {data}\n\n").into_bytes(),
        None => format!("data: {data}\n\n").into_bytes(),
    }
}

fn str_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Anthropic Messages
// ---------------------------------------------------------------------------------------------

mod anthropic {
    use super::*;

    fn ev(v: Value) -> Vec<u8> {
        let name = v["type"].as_str().unwrap().to_owned();
        sse_event(Some(&name), &v)
    }

    fn start(index: u32, block: Value) -> Vec<u8> {
        ev(json!({"type": "content_block_start", "index": index, "content_block": block}))
    }

    fn delta(index: u32, delta: Value) -> Vec<u8> {
        ev(json!({"type": "content_block_delta", "index": index, "delta": delta}))
    }

    fn stop(index: u32) -> Vec<u8> {
        ev(json!({"type": "content_block_stop", "index": index}))
    }

    fn message_start() -> Vec<u8> {
        ev(json!({"type": "message_start", "message": {
            "id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message", "role": "assistant",
            "content": [], "model": "test-model", "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 472, "output_tokens": 2}}}))
    }

    fn end(stop_reason: &str) -> Vec<Vec<u8>> {
        vec![
            ev(json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                "usage": {"output_tokens": 89}})),
            ev(json!({"type": "message_stop"})),
        ]
    }

    pub fn ids(r: u32) -> [String; 2] {
        [format!("toolu_r{r}_01A"), format!("toolu_r{r}_01B")]
    }

    pub fn tool_round(r: u32) -> Vec<Vec<u8>> {
        let [a, b] = ids(r);
        let [t1, t2] = think(r);
        let mut out = vec![
            message_start(),
            start(0, json!({"type": "thinking", "thinking": ""})),
            delta(0, json!({"type": "thinking_delta", "thinking": t1})),
            delta(0, json!({"type": "thinking_delta", "thinking": t2})),
            delta(0, json!({"type": "signature_delta", "signature": sig(r)})),
            stop(0),
            ev(json!({"type": "ping"})),
            start(1, json!({"type": "text", "text": ""})),
            delta(1, json!({"type": "text_delta", "text": "Let me compute "})),
            delta(1, json!({"type": "text_delta", "text": "both."})),
            stop(1),
            start(
                2,
                json!({"type": "tool_use", "id": a, "name": "calculator", "input": {}}),
            ),
            delta(
                2,
                json!({"type": "input_json_delta", "partial_json": "{\"expression\":"}),
            ),
            delta(
                2,
                json!({"type": "input_json_delta", "partial_json": "\"6*7\"}"}),
            ),
            stop(2),
            start(
                3,
                json!({"type": "tool_use", "id": b, "name": "calculator", "input": {}}),
            ),
            delta(
                3,
                json!({"type": "input_json_delta", "partial_json": CALLS[1].0}),
            ),
            stop(3),
        ];
        out.extend(end("tool_use"));
        out
    }

    pub fn text(text: &str) -> Vec<Vec<u8>> {
        let (x, y) = text.split_at(text.len() / 2);
        let mut out = vec![
            message_start(),
            start(0, json!({"type": "text", "text": ""})),
            delta(0, json!({"type": "text_delta", "text": x})),
            delta(0, json!({"type": "text_delta", "text": y})),
            stop(0),
        ];
        out.extend(end("end_turn"));
        out
    }

    /// Anthropic's documented error body.
    pub fn reject(message: &str) -> Canned {
        Canned::error(
            400,
            &json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
                .to_string(),
        )
    }

    /// The Messages API's rules on what the runtime sends.
    pub fn judge(r: &Recorded) -> Option<String> {
        if r.path != "/v1/messages" {
            return Some(format!("unexpected path {}", r.path));
        }
        if r.headers.get("x-api-key").is_none_or(|k| k != "test-key") {
            return Some("invalid x-api-key".into());
        }
        if r.headers.get("anthropic-version").is_none() {
            return Some("anthropic-version: header is required".into());
        }
        let body: Value = serde_json::from_slice(&r.body).ok()?;
        if body["stream"] != true {
            return Some("stream: expected true".into());
        }
        let thinking = body["thinking"]["type"] == "enabled";
        if thinking {
            let budget = body["thinking"]["budget_tokens"].as_u64().unwrap_or(0);
            let max = body["max_tokens"].as_u64().unwrap_or(0);
            if budget < 1024 || budget >= max {
                return Some(format!("`max_tokens` must be greater than `thinking.budget_tokens` (and the budget at least 1024): {max} / {budget}"));
            }
        }
        let messages = body["messages"].as_array()?;
        let has_tools = body["tools"].as_array().is_some_and(|t| !t.is_empty());
        for (i, m) in messages.iter().enumerate() {
            let want = if i % 2 == 0 { "user" } else { "assistant" };
            if m["role"] != want {
                return Some(format!("messages: roles must alternate between \"user\" and \"assistant\", starting with \"user\" (messages.{i})"));
            }
            let content = m["content"].as_array()?;
            for (j, block) in content.iter().enumerate() {
                let kind = block["type"].as_str().unwrap_or_default();
                if (kind == "tool_use" || kind == "tool_result") && !has_tools {
                    return Some(format!(
                        "messages.{i}.content.{j}: tool blocks require `tools` to be defined"
                    ));
                }
                if kind == "thinking" {
                    let text = block["thinking"].as_str().unwrap_or_default();
                    let ok = issued_round(text).is_some_and(|r| block["signature"] == sig(r));
                    if !ok {
                        return Some(format!(
                            "messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
                        ));
                    }
                }
            }
            let uses: Vec<&str> = content
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .filter_map(|b| b["id"].as_str())
                .collect();
            if m["role"] == "assistant" && !uses.is_empty() {
                let Some(next) = messages.get(i + 1) else {
                    continue;
                };
                let next = next["content"].as_array()?;
                let results: Vec<&str> = next
                    .iter()
                    .take_while(|b| b["type"] == "tool_result")
                    .filter_map(|b| b["tool_use_id"].as_str())
                    .collect();
                let missing: Vec<&str> = uses
                    .iter()
                    .filter(|u| !results.contains(u))
                    .copied()
                    .collect();
                if !missing.is_empty() {
                    return Some(format!("messages.{}: `tool_use` ids were found without `tool_result` blocks immediately after: {}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.", i + 1, missing.join(", ")));
                }
            }
            if m["role"] == "user" {
                let previous: Vec<&str> = i
                    .checked_sub(1)
                    .and_then(|p| messages[p]["content"].as_array())
                    .map(|c| {
                        c.iter()
                            .filter(|b| b["type"] == "tool_use")
                            .filter_map(|b| b["id"].as_str())
                            .collect()
                    })
                    .unwrap_or_default();
                for (j, block) in content.iter().enumerate() {
                    if block["type"] == "tool_result" {
                        let id = block["tool_use_id"].as_str().unwrap_or_default();
                        if !previous.contains(&id) {
                            return Some(format!("messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."));
                        }
                    }
                }
            }
        }
        // With thinking on, the assistant message of an unfinished tool loop starts with thinking.
        if thinking {
            let last = messages.last()?;
            let in_loop = last["content"]
                .as_array()?
                .iter()
                .any(|b| b["type"] == "tool_result");
            if in_loop {
                let i = messages.len() - 2;
                let first = &messages[i]["content"][0]["type"];
                if first != "thinking" && first != "redacted_thinking" {
                    return Some(format!("messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found `{}`. When `thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks).", str_of(first)));
                }
            }
        }
        None
    }

    pub fn messages(body: &Value) -> Vec<Value> {
        body["messages"].as_array().cloned().unwrap_or_default()
    }

    pub fn echo(r: u32) -> String {
        format!(
            r#"{{"type":"thinking","thinking":"{}","signature":"{}"}}"#,
            think_text(r),
            sig(r)
        )
    }

    fn blocks(body: &Value) -> Vec<Value> {
        messages(body)
            .iter()
            .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
            .collect()
    }

    pub fn calls(body: &Value) -> Vec<(String, String)> {
        blocks(body)
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .map(|b| (str_of(&b["id"]), b["input"].to_string()))
            .collect()
    }

    pub fn results(body: &Value) -> Vec<(String, String)> {
        blocks(body)
            .iter()
            .filter(|b| b["type"] == "tool_result")
            .map(|b| (str_of(&b["tool_use_id"]), b["content"].to_string()))
            .collect()
    }

    pub fn env(base: &str) -> Vec<(&'static str, String)> {
        vec![
            ("ANTHROPIC_API_KEY", "test-key".into()),
            ("ANTHROPIC_BASE_URL", base.into()),
        ]
    }

    pub const WIRE: Wire = Wire {
        provider: "anthropic",
        format: "anthropic",
        args: &["--max-tokens", "8000", "--thinking-budget", "2048"],
        content_type: "text/event-stream",
        env,
        tool_round,
        text,
        judge,
        reject,
        messages,
        ids,
        echo,
        calls,
        results,
    };
}

// ---------------------------------------------------------------------------------------------
// OpenAI Chat Completions (a compatible server streaming DeepSeek-style reasoning_content)
// ---------------------------------------------------------------------------------------------

mod openai_chat {
    use super::*;

    fn chunk(delta: Value, finish: Value) -> Vec<u8> {
        sse_event(
            None,
            &json!({
                "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
                "model": "test-model", "system_fingerprint": "fp_1",
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                "usage": null
            }),
        )
    }

    fn tail(finish: &str) -> Vec<Vec<u8>> {
        vec![
            chunk(json!({}), json!(finish)),
            sse_event(
                None,
                &json!({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                    "created": 1_700_000_000, "model": "test-model", "choices": [],
                    "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70}}),
            ),
            b"data: [DONE]\n\n".to_vec(),
        ]
    }

    pub fn ids(r: u32) -> [String; 2] {
        [format!("call_r{r}_A"), format!("call_r{r}_B")]
    }

    pub fn tool_round(r: u32) -> Vec<Vec<u8>> {
        let [a, b] = ids(r);
        let [t1, t2] = think(r);
        let mut out = vec![
            chunk(
                json!({"role": "assistant", "content": null, "reasoning_content": t1}),
                Value::Null,
            ),
            chunk(
                json!({"content": null, "reasoning_content": t2}),
                Value::Null,
            ),
            chunk(json!({"content": "Let me compute "}), Value::Null),
            chunk(json!({"content": "both."}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": a, "type": "function",
                    "function": {"name": "calculator", "arguments": ""}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"expression\":"}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 1, "id": b, "type": "function",
                    "function": {"name": "calculator", "arguments": CALLS[1].0}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"6*7\"}"}}]}),
                Value::Null,
            ),
        ];
        out.extend(tail("tool_calls"));
        out
    }

    pub fn text(text: &str) -> Vec<Vec<u8>> {
        let (x, y) = text.split_at(text.len() / 2);
        let mut out = vec![
            chunk(json!({"role": "assistant", "content": x}), Value::Null),
            chunk(json!({"content": y}), Value::Null),
        ];
        out.extend(tail("stop"));
        out
    }

    pub fn reject(message: &str) -> Canned {
        Canned::error(
            400,
            &json!({"error": {"message": message, "type": "invalid_request_error",
                              "param": "messages", "code": null}})
            .to_string(),
        )
    }

    /// OpenAI's ordering rules, and DeepSeek's: the reasoning of a tool-call turn goes back.
    pub fn judge(r: &Recorded) -> Option<String> {
        if r.path != "/v1/chat/completions" {
            return Some(format!("unexpected path {}", r.path));
        }
        if r.headers
            .get("authorization")
            .is_none_or(|a| a != "Bearer sk-test")
        {
            return Some("Incorrect API key provided".into());
        }
        let body: Value = serde_json::from_slice(&r.body).ok()?;
        let messages = body["messages"].as_array()?;
        let mut open: Vec<String> = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m["role"] == "tool" {
                let id = m["tool_call_id"].as_str().unwrap_or_default();
                match open.iter().position(|o| o == id) {
                    Some(p) => {
                        open.remove(p);
                    }
                    None => return Some(format!("Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'. (messages[{i}])")),
                }
                continue;
            }
            if !open.is_empty() {
                return Some(format!("An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}", open.join(", ")));
            }
            if let Some(calls) = m["tool_calls"].as_array() {
                for c in calls {
                    let args = c["function"]["arguments"].as_str().unwrap_or_default();
                    if serde_json::from_str::<Value>(args).is_err() {
                        return Some(format!(
                            "messages[{i}]: function arguments are not valid JSON"
                        ));
                    }
                }
                let reasoning = m["reasoning_content"].as_str().unwrap_or_default();
                if issued_round(reasoning).is_none() {
                    return Some(format!("Missing `reasoning_content` field in the assistant message at message index {i}"));
                }
                open = calls
                    .iter()
                    .map(|c| c["id"].as_str().unwrap_or_default().to_owned())
                    .collect();
            }
        }
        if !open.is_empty() {
            return Some(format!("An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}", open.join(", ")));
        }
        None
    }

    pub fn messages(body: &Value) -> Vec<Value> {
        body["messages"].as_array().cloned().unwrap_or_default()
    }

    pub fn echo(r: u32) -> String {
        format!(r#""reasoning_content":"{}""#, think_text(r))
    }

    pub fn calls(body: &Value) -> Vec<(String, String)> {
        messages(body)
            .iter()
            .flat_map(|m| m["tool_calls"].as_array().cloned().unwrap_or_default())
            .map(|c| (str_of(&c["id"]), str_of(&c["function"]["arguments"])))
            .collect()
    }

    pub fn results(body: &Value) -> Vec<(String, String)> {
        messages(body)
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| (str_of(&m["tool_call_id"]), str_of(&m["content"])))
            .collect()
    }

    pub fn env(base: &str) -> Vec<(&'static str, String)> {
        vec![
            ("OPENAI_API_KEY", "sk-test".into()),
            ("OPENAI_BASE_URL", format!("{base}/v1")),
        ]
    }

    pub const WIRE: Wire = Wire {
        provider: "openai",
        format: "openai-chat",
        args: &[],
        content_type: "text/event-stream",
        env,
        tool_round,
        text,
        judge,
        reject,
        messages,
        ids,
        echo,
        calls,
        results,
    };
}

// ---------------------------------------------------------------------------------------------
// OpenAI Responses
// ---------------------------------------------------------------------------------------------

mod openai_responses {
    use super::*;

    /// Round `r`'s reasoning item exactly as `output_item.done` carries it.
    fn reasoning(r: u32) -> String {
        format!(
            r#"{{"id":"rs_r{r}","type":"reasoning","summary":[{{"type":"summary_text","text":"{}"}}],"encrypted_content":"gAAAAB{}","status":"completed"}}"#,
            think_text(r),
            sig(r)
        )
    }

    fn frame(event: &str, data: String) -> Vec<u8> {
        format!("event: {event}\ndata: {data}\n\n").into_bytes()
    }

    fn completed(seq: u32) -> Vec<u8> {
        frame(
            "response.completed",
            format!(
                r#"{{"type":"response.completed","sequence_number":{seq},"response":{{"id":"resp_1","object":"response","status":"completed","model":"test-model","output":[],"usage":{{"input_tokens":120,"input_tokens_details":{{"cached_tokens":20}},"output_tokens":80,"output_tokens_details":{{"reasoning_tokens":50}},"total_tokens":200}}}}}}"#
            ),
        )
    }

    pub fn ids(r: u32) -> [String; 2] {
        [format!("call_r{r}_A"), format!("call_r{r}_B")]
    }

    fn function_call(r: u32, n: u32, seq: u32, index: u32) -> Vec<Vec<u8>> {
        let call_id = &ids(r)[n as usize];
        let args = CALLS[n as usize].0;
        let item = format!("fc_r{r}_{n}");
        vec![
            frame(
                "response.output_item.added",
                format!(
                    r#"{{"type":"response.output_item.added","sequence_number":{seq},"output_index":{index},"item":{{"id":"{item}","type":"function_call","status":"in_progress","arguments":"","call_id":"{call_id}","name":"calculator"}}}}"#
                ),
            ),
            frame(
                "response.function_call_arguments.delta",
                format!(
                    r#"{{"type":"response.function_call_arguments.delta","sequence_number":{},"item_id":"{item}","output_index":{index},"delta":{}}}"#,
                    seq + 1,
                    json!(args)
                ),
            ),
            frame(
                "response.output_item.done",
                format!(
                    r#"{{"type":"response.output_item.done","sequence_number":{},"output_index":{index},"item":{{"id":"{item}","type":"function_call","status":"completed","arguments":{},"call_id":"{call_id}","name":"calculator"}}}}"#,
                    seq + 2,
                    json!(args)
                ),
            ),
        ]
    }

    pub fn tool_round(r: u32) -> Vec<Vec<u8>> {
        let [t1, t2] = think(r);
        let mut out = vec![
            frame("response.created", r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","model":"test-model","output":[],"usage":null}}"#.into()),
            frame("response.output_item.added", format!(r#"{{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{{"id":"rs_r{r}","type":"reasoning","summary":[]}}}}"#)),
            frame("response.reasoning_summary_text.delta", format!(r#"{{"type":"response.reasoning_summary_text.delta","sequence_number":2,"item_id":"rs_r{r}","output_index":0,"summary_index":0,"delta":{}}}"#, json!(t1))),
            frame("response.reasoning_summary_text.delta", format!(r#"{{"type":"response.reasoning_summary_text.delta","sequence_number":3,"item_id":"rs_r{r}","output_index":0,"summary_index":0,"delta":{}}}"#, json!(t2))),
            frame("response.output_item.done", format!(r#"{{"type":"response.output_item.done","sequence_number":4,"output_index":0,"item":{}}}"#, reasoning(r))),
            frame("response.output_item.added", format!(r#"{{"type":"response.output_item.added","sequence_number":5,"output_index":1,"item":{{"id":"msg_r{r}","type":"message","status":"in_progress","role":"assistant","content":[]}}}}"#)),
            frame("response.output_text.delta", format!(r#"{{"type":"response.output_text.delta","sequence_number":6,"item_id":"msg_r{r}","output_index":1,"content_index":0,"delta":"Let me compute ","logprobs":[]}}"#)),
            frame("response.output_text.delta", format!(r#"{{"type":"response.output_text.delta","sequence_number":7,"item_id":"msg_r{r}","output_index":1,"content_index":0,"delta":"both.","logprobs":[]}}"#)),
            frame("response.output_item.done", format!(r#"{{"type":"response.output_item.done","sequence_number":8,"output_index":1,"item":{{"id":"msg_r{r}","type":"message","status":"completed","role":"assistant","content":[{{"type":"output_text","annotations":[],"logprobs":[],"text":"Let me compute both."}}]}}}}"#)),
        ];
        out.extend(function_call(r, 0, 9, 2));
        out.extend(function_call(r, 1, 12, 3));
        out.push(completed(15));
        out
    }

    pub fn text(text: &str) -> Vec<Vec<u8>> {
        let (x, y) = text.split_at(text.len() / 2);
        vec![
            frame("response.created", r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_2","status":"in_progress","model":"test-model"}}"#.into()),
            frame("response.output_item.added", r#"{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"msg_f","type":"message","status":"in_progress","role":"assistant","content":[]}}"#.into()),
            frame("response.output_text.delta", format!(r#"{{"type":"response.output_text.delta","sequence_number":2,"item_id":"msg_f","output_index":0,"content_index":0,"delta":{},"logprobs":[]}}"#, json!(x))),
            frame("response.output_text.delta", format!(r#"{{"type":"response.output_text.delta","sequence_number":3,"item_id":"msg_f","output_index":0,"content_index":0,"delta":{},"logprobs":[]}}"#, json!(y))),
            frame("response.output_item.done", format!(r#"{{"type":"response.output_item.done","sequence_number":4,"output_index":0,"item":{{"id":"msg_f","type":"message","status":"completed","role":"assistant","content":[{{"type":"output_text","annotations":[],"logprobs":[],"text":{}}}]}}}}"#, json!(text))),
            completed(5),
        ]
    }

    pub fn reject(message: &str) -> Canned {
        Canned::error(
            400,
            &json!({"error": {"message": message, "type": "invalid_request_error",
                              "param": "input", "code": null}})
            .to_string(),
        )
    }

    /// The Responses API's rules for stateless requests carrying reasoning items.
    pub fn judge(r: &Recorded) -> Option<String> {
        if r.path != "/responses" {
            return Some(format!("unexpected path {}", r.path));
        }
        if r.headers
            .get("authorization")
            .is_none_or(|a| a != "Bearer sk-test")
        {
            return Some("Incorrect API key provided".into());
        }
        let body: Value = serde_json::from_slice(&r.body).ok()?;
        if body["store"] != false || body["include"] != json!(["reasoning.encrypted_content"]) {
            return Some(
                "stateless requests need store: false and include reasoning.encrypted_content"
                    .into(),
            );
        }
        let input = body["input"].as_array()?;
        let mut calls: Vec<String> = Vec::new();
        let mut answered: Vec<String> = Vec::new();
        for (i, item) in input.iter().enumerate() {
            match item["type"].as_str() {
                Some("reasoning") => {
                    let id = item["id"].as_str().unwrap_or_default();
                    let text = item["summary"][0]["text"].as_str().unwrap_or_default();
                    let genuine = issued_round(text).is_some_and(|r| {
                        item["encrypted_content"] == format!("gAAAAB{}", sig(r))
                            && id == format!("rs_r{r}")
                    });
                    if !genuine {
                        return Some(format!(
                            "The encrypted content for item {id} could not be verified."
                        ));
                    }
                    let next = input.get(i + 1);
                    let paired = next.is_some_and(|n| {
                        n["type"] == "message"
                            || (n["type"] == "function_call" && n.get("id").is_some())
                    });
                    if !paired {
                        return Some(format!("Item '{id}' of type 'reasoning' was provided without its required following item."));
                    }
                }
                Some("function_call") => {
                    calls.push(str_of(&item["call_id"]));
                }
                Some("function_call_output") => {
                    let id = str_of(&item["call_id"]);
                    if !calls.contains(&id) {
                        return Some(format!(
                            "No tool call found for function call output with call_id {id}."
                        ));
                    }
                    answered.push(id);
                }
                _ => {}
            }
        }
        if let Some(open) = calls.iter().find(|c| !answered.contains(c)) {
            return Some(format!("No tool output found for function call {open}."));
        }
        None
    }

    pub fn messages(body: &Value) -> Vec<Value> {
        body["input"].as_array().cloned().unwrap_or_default()
    }

    pub fn echo(r: u32) -> String {
        reasoning(r)
    }

    pub fn calls(body: &Value) -> Vec<(String, String)> {
        messages(body)
            .iter()
            .filter(|i| i["type"] == "function_call")
            .map(|i| (str_of(&i["call_id"]), str_of(&i["arguments"])))
            .collect()
    }

    pub fn results(body: &Value) -> Vec<(String, String)> {
        messages(body)
            .iter()
            .filter(|i| i["type"] == "function_call_output")
            .map(|i| (str_of(&i["call_id"]), str_of(&i["output"])))
            .collect()
    }

    pub fn env(base: &str) -> Vec<(&'static str, String)> {
        vec![
            ("OPENAI_API_KEY", "sk-test".into()),
            ("OPENAI_BASE_URL", base.into()),
        ]
    }

    pub const WIRE: Wire = Wire {
        provider: "openai-responses",
        format: "openai-responses",
        args: &[],
        content_type: "text/event-stream",
        env,
        tool_round,
        text,
        judge,
        reject,
        messages,
        ids,
        echo,
        calls,
        results,
    };
}

// ---------------------------------------------------------------------------------------------
// Bedrock ConverseStream
// ---------------------------------------------------------------------------------------------

mod bedrock {
    use super::*;

    fn header(name: &'static str, value: &str) -> Header {
        Header::new(name, HeaderValue::String(StrBytes::from(value.to_owned())))
    }

    fn event(name: &str, json: Value) -> Vec<u8> {
        let message = Message::new(json.to_string().into_bytes())
            .add_header(header(":message-type", "event"))
            .add_header(header(":event-type", name))
            .add_header(header(":content-type", "application/json"));
        let mut out = Vec::new();
        write_message_to(&message, &mut out).unwrap();
        out
    }

    fn tail(stop: &str) -> Vec<Vec<u8>> {
        vec![
            event("messageStop", json!({"stopReason": stop})),
            event(
                "metadata",
                json!({"usage": {"inputTokens": 12, "outputTokens": 34, "totalTokens": 46},
                       "metrics": {"latencyMs": 100}}),
            ),
        ]
    }

    pub fn ids(r: u32) -> [String; 2] {
        [format!("tooluse_r{r}_A1"), format!("tooluse_r{r}_B2")]
    }

    fn tool_use(index: u32, id: &str, fragments: &[&str]) -> Vec<Vec<u8>> {
        let mut out = vec![event(
            "contentBlockStart",
            json!({"contentBlockIndex": index, "start": {"toolUse": {"toolUseId": id, "name": "calculator"}}}),
        )];
        for f in fragments {
            out.push(event(
                "contentBlockDelta",
                json!({"contentBlockIndex": index, "delta": {"toolUse": {"input": f}}}),
            ));
        }
        out.push(event(
            "contentBlockStop",
            json!({"contentBlockIndex": index}),
        ));
        out
    }

    pub fn tool_round(r: u32) -> Vec<Vec<u8>> {
        let [a, b] = ids(r);
        let [t1, t2] = think(r);
        let mut out = vec![
            event("messageStart", json!({"role": "assistant"})),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": t1}}}),
            ),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": t2}}}),
            ),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"reasoningContent": {"signature": sig(r)}}}),
            ),
            event("contentBlockStop", json!({"contentBlockIndex": 0})),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 1, "delta": {"text": "Let me compute "}}),
            ),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 1, "delta": {"text": "both."}}),
            ),
            event("contentBlockStop", json!({"contentBlockIndex": 1})),
        ];
        out.extend(tool_use(2, &a, &["{\"expression\":", "\"6*7\"}"]));
        out.extend(tool_use(3, &b, &[CALLS[1].0]));
        out.extend(tail("tool_use"));
        out
    }

    pub fn text(text: &str) -> Vec<Vec<u8>> {
        let (x, y) = text.split_at(text.len() / 2);
        let mut out = vec![
            event("messageStart", json!({"role": "assistant"})),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": x}}),
            ),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": y}}),
            ),
            event("contentBlockStop", json!({"contentBlockIndex": 0})),
        ];
        out.extend(tail("end_turn"));
        out
    }

    /// Bedrock's documented ValidationException.
    pub fn reject(message: &str) -> Canned {
        let mut c = Canned::error(400, &json!({ "message": message }).to_string());
        c.headers.push((
            "x-amzn-errortype".into(),
            "ValidationException:http://internal.amazon.com/coral/com.amazon.bedrock/".into(),
        ));
        c
    }

    /// Converse's rules: alternation, one toolResult per toolUse of the previous turn,
    /// signed reasoning first in the tool loop's assistant message when thinking is on.
    pub fn judge(r: &Recorded) -> Option<String> {
        if r.path != "/model/test-model/converse-stream" {
            return Some(format!("unexpected path {}", r.path));
        }
        let auth = r
            .headers
            .get("authorization")
            .and_then(|a| a.to_str().ok())
            .unwrap_or_default();
        if !auth.starts_with("AWS4-HMAC-SHA256 Credential=AKIDTEST/")
            || !auth.contains("/us-east-1/bedrock/aws4_request")
        {
            return Some("The security token included in the request is invalid.".into());
        }
        let body: Value = serde_json::from_slice(&r.body).ok()?;
        let thinking = body["additionalModelRequestFields"]["thinking"]["type"] == "enabled";
        let messages = body["messages"].as_array()?;
        for (i, m) in messages.iter().enumerate() {
            let want = if i % 2 == 0 { "user" } else { "assistant" };
            if m["role"] != want {
                return Some(format!("A conversation must alternate between user and assistant roles. Make sure the conversation alternates between user and assistant roles and try again. (messages.{i})"));
            }
            let content = m["content"].as_array()?;
            for (j, block) in content.iter().enumerate() {
                if let Some(rt) = block.pointer("/reasoningContent/reasoningText") {
                    let text = rt["text"].as_str().unwrap_or_default();
                    if !issued_round(text).is_some_and(|r| rt["signature"] == sig(r)) {
                        return Some(format!(
                            "messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
                        ));
                    }
                }
            }
            if m["role"] == "user" && i > 0 {
                let uses: Vec<String> = messages[i - 1]["content"]
                    .as_array()?
                    .iter()
                    .filter_map(|b| b.pointer("/toolUse/toolUseId"))
                    .map(str_of)
                    .collect();
                let results: Vec<String> = content
                    .iter()
                    .filter_map(|b| b.pointer("/toolResult/toolUseId"))
                    .map(str_of)
                    .collect();
                if results.len() > uses.len() {
                    return Some(format!("The number of toolResult blocks at messages.{i}.content exceeds the number of toolUse blocks of previous turn."));
                }
                let missing: Vec<&str> = uses
                    .iter()
                    .filter(|u| !results.contains(u))
                    .map(String::as_str)
                    .collect();
                if !missing.is_empty() {
                    return Some(format!("Expected toolResult blocks at messages.{i}.content for the following Ids: {}", missing.join(", ")));
                }
            }
        }
        if thinking && messages.len() >= 2 {
            let last = messages.last()?;
            let in_loop = last["content"]
                .as_array()?
                .iter()
                .any(|b| b.get("toolResult").is_some());
            let i = messages.len() - 2;
            if in_loop && messages[i]["content"][0].get("reasoningContent").is_none() {
                return Some(format!("messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found `text`. When `thinking` is enabled, a final `assistant` message must start with a thinking block."));
            }
        }
        None
    }

    pub fn messages(body: &Value) -> Vec<Value> {
        body["messages"].as_array().cloned().unwrap_or_default()
    }

    pub fn echo(r: u32) -> String {
        format!(
            r#"{{"reasoningContent":{{"reasoningText":{{"text":"{}","signature":"{}"}}}}}}"#,
            think_text(r),
            sig(r)
        )
    }

    fn blocks(body: &Value) -> Vec<Value> {
        messages(body)
            .iter()
            .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
            .collect()
    }

    pub fn calls(body: &Value) -> Vec<(String, String)> {
        blocks(body)
            .iter()
            .filter_map(|b| b.get("toolUse"))
            .map(|u| (str_of(&u["toolUseId"]), u["input"].to_string()))
            .collect()
    }

    pub fn results(body: &Value) -> Vec<(String, String)> {
        blocks(body)
            .iter()
            .filter_map(|b| b.get("toolResult"))
            .map(|t| (str_of(&t["toolUseId"]), t["content"].to_string()))
            .collect()
    }

    pub fn env(base: &str) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", "AKIDTEST".into()),
            ("AWS_SECRET_ACCESS_KEY", "secret".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("BEDROCK_BASE_URL", base.into()),
        ]
    }

    pub const WIRE: Wire = Wire {
        provider: "bedrock",
        format: "bedrock",
        args: &["--max-tokens", "4096", "--thinking-budget", "2048"],
        content_type: "application/vnd.amazon.eventstream",
        env,
        tool_round,
        text,
        judge,
        reject,
        messages,
        ids,
        echo,
        calls,
        results,
    };
}

// ---------------------------------------------------------------------------------------------
// The harness: a runtime for the fake server, a store, and the `cairn` child
// ---------------------------------------------------------------------------------------------

/// Field order matters: the server is dropped before the runtime that runs it.
struct Harness {
    server: FakeServer,
    wire: &'static Wire,
    /// Rules the runtime's requests broke (each answered with the provider's 400).
    rejected: Arc<Mutex<Vec<String>>>,
    dir: tempfile::TempDir,
    _rt: tokio::runtime::Runtime,
}

impl Harness {
    fn new(wire: &'static Wire) -> Harness {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = rt.block_on(FakeServer::start());
        let rejected = Arc::new(Mutex::new(Vec::new()));
        let seen = rejected.clone();
        let judge = wire.judge;
        let reject = wire.reject;
        server.judge(move |r| {
            let broken = judge(r)?;
            seen.lock().unwrap().push(broken.clone());
            Some(reject(&broken))
        });
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("work")).unwrap();
        Harness {
            server,
            wire,
            rejected,
            dir,
            _rt: rt,
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// A 200 streaming answer, one chunk per event, each after `pause`.
    fn push_stream(&self, events: Vec<Vec<u8>>, pause: Duration) {
        self.server.push(Canned {
            status: 200,
            headers: vec![("content-type".into(), self.wire.content_type.into())],
            chunks: events.into_iter().map(|e| (pause, e)).collect(),
        });
    }

    fn push_tool_round(&self, round: u32) {
        self.push_stream((self.wire.tool_round)(round), Duration::ZERO);
    }

    fn push_text(&self, text: &str) {
        self.push_stream((self.wire.text)(text), Duration::ZERO);
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cairn"));
        for key in KEYS_TO_CLEAR {
            cmd.env_remove(key);
        }
        for (key, value) in (self.wire.env)(&self.server.base_url()) {
            cmd.env(key, value);
        }
        cmd.args(args);
        cmd
    }

    fn cairn(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run cairn")
    }

    fn run_args(&self, session: &str) -> Vec<String> {
        let mut args: Vec<String> = [
            "run",
            "--data",
            self.data().to_str().unwrap(),
            "--model",
            &format!("{}:test-model", self.wire.provider),
            "--session",
            session,
            "--workdir",
            self.dir.path().join("work").to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(self.wire.args.iter().map(|s| s.to_string()));
        args.push("Compute 6*7 and 2+2, in parallel.".into());
        args
    }

    fn run(&self, session: &str) -> Output {
        let args = self.run_args(session);
        self.cairn(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    fn history(&self, session: &str) -> Vec<Value> {
        let out = self.cairn(&[
            "history",
            "--data",
            self.data().to_str().unwrap(),
            session,
            "--json",
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn assert_replays(&self, session: &str) {
        let out = self.cairn(&["replay", "--data", self.data().to_str().unwrap(), session]);
        assert!(
            out.status.success() && text(&out.stdout).starts_with("ok: "),
            "replay: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }

    fn assert_all_accepted(&self) {
        let rejected = self.rejected.lock().unwrap();
        assert!(
            rejected.is_empty(),
            "{} requests broke the provider's rules: {rejected:?}",
            self.wire.provider
        );
    }
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

fn kinds<'a>(history: &'a [Value], kind: &str) -> Vec<&'a Value> {
    history.iter().filter(|e| e["kind"] == kind).collect()
}

/// Exactly one completed model response per (turn, round), all from `provider`.
fn assert_one_response_per_round(history: &[Value], provider: &str, rounds: u32) {
    let mut per_round: BTreeMap<(u64, u64), usize> = BTreeMap::new();
    for e in kinds(history, "model_call_completed") {
        let c = &e["event"]["model_call_completed"];
        assert_eq!(c["response"]["provider"], provider, "{c}");
        *per_round
            .entry((c["turn"].as_u64().unwrap(), c["round"].as_u64().unwrap()))
            .or_default() += 1;
    }
    let expected: BTreeMap<(u64, u64), usize> = (0..rounds).map(|r| ((1, r as u64), 1)).collect();
    assert_eq!(per_round, expected);
}

/// The tool calls of round `r` and their results, as a follow-up body carries them.
fn assert_round_echoed(wire: &Wire, body: &Value, raw: &str, r: u32) {
    assert!(
        raw.contains(&(wire.echo)(r)),
        "{}: the thinking of round {r} is not echoed exactly: {raw}",
        wire.provider
    );
    let ids = (wire.ids)(r);
    let calls: Vec<(String, String)> = (wire.calls)(body)
        .into_iter()
        .filter(|(id, _)| ids.contains(id))
        .collect();
    let args: Vec<Value> = calls
        .iter()
        .map(|(_, a)| serde_json::from_str(a).unwrap())
        .collect();
    assert_eq!(
        calls.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>(),
        ids.to_vec(),
        "{}: tool calls of round {r}",
        wire.provider
    );
    assert_eq!(
        args,
        CALLS
            .iter()
            .map(|(a, _)| serde_json::from_str::<Value>(a).unwrap())
            .collect::<Vec<_>>()
    );
    let results: Vec<(String, String)> = (wire.results)(body)
        .into_iter()
        .filter(|(id, _)| ids.contains(id))
        .collect();
    assert_eq!(
        results.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>(),
        ids.to_vec(),
        "{}: tool results of round {r} in declaration order: {results:?}",
        wire.provider
    );
    for ((_, content), (_, value)) in results.iter().zip(CALLS) {
        // The calculator's JSON result, possibly as an escaped string inside the body.
        let unescaped = content.replace('\\', "");
        assert!(
            unescaped.contains(value),
            "{}: result {content} lacks {value}",
            wire.provider
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 1. One tool round with thinking and two parallel calls, then the answer — per provider
// ---------------------------------------------------------------------------------------------

/// `messages` without Anthropic's `cache_control` breakpoints.
fn without_cache_control(messages: Vec<Value>) -> Vec<Value> {
    fn strip(value: &mut Value) {
        match value {
            Value::Object(map) => {
                map.remove("cache_control");
                map.values_mut().for_each(strip);
            }
            Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    messages
        .into_iter()
        .map(|mut m| {
            strip(&mut m);
            m
        })
        .collect()
}

fn tool_round_then_answer(wire: &'static Wire) {
    let h = Harness::new(wire);
    h.push_tool_round(0);
    h.push_text(FINAL);
    let session = format!("e2e-{}", wire.provider);
    let out = h.run(&session);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{}: {stdout}\n{}",
        wire.provider,
        text(&out.stderr)
    );
    assert!(stdout.contains(FINAL), "{}: {stdout}", wire.provider);
    h.assert_all_accepted();

    let requests = h.server.requests();
    assert_eq!(requests.len(), 2, "{}", wire.provider);
    let first = requests[0].json();
    let second = requests[1].json();
    let raw = String::from_utf8(requests[1].body.clone()).unwrap();
    // The follow-up is the first request plus the assistant turn and the tool results (the
    // prompt-cache breakpoint moves to the new last message, so it is left out of this).
    let sent_first = without_cache_control((wire.messages)(&first));
    let sent = without_cache_control((wire.messages)(&second));
    assert_eq!(
        sent[..sent_first.len()],
        sent_first[..],
        "{}",
        wire.provider
    );
    assert_round_echoed(wire, &second, &raw, 0);

    let history = h.history(&session);
    assert_one_response_per_round(&history, wire.provider, 2);
    let completed = kinds(&history, "model_call_completed");
    let parts = &completed[0]["event"]["model_call_completed"]["response"]["parts"];
    assert_eq!(parts.as_array().unwrap().len(), 4, "{parts}");
    assert_eq!(kinds(&history, "tool_call_completed").len(), 2);
    assert_eq!(kinds(&history, "turn_completed").len(), 1);
    assert!(kinds(&history, "model_call_failed").is_empty());
    h.assert_replays(&session);

    // The next request rendered from the ledger: what was sent, plus the final answer.
    let out = h.cairn(&[
        "transcript",
        "--data",
        h.data().to_str().unwrap(),
        &session,
        "--as",
        wire.format,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let next: Value = serde_json::from_slice(&out.stdout).unwrap();
    let next_messages = (wire.messages)(&next);
    assert_eq!(next_messages.len(), sent.len() + 1, "{}", wire.provider);
    assert_eq!(next_messages[..sent.len()], sent[..], "{}", wire.provider);
    assert!(
        next_messages.last().unwrap().to_string().contains(FINAL),
        "{}",
        wire.provider
    );
}

#[test]
fn anthropic_thinking_and_parallel_tools_then_answer() {
    tool_round_then_answer(&anthropic::WIRE);
}

#[test]
fn openai_chat_reasoning_and_parallel_tools_then_answer() {
    tool_round_then_answer(&openai_chat::WIRE);
}

#[test]
fn openai_responses_reasoning_and_parallel_tools_then_answer() {
    tool_round_then_answer(&openai_responses::WIRE);
}

#[test]
fn bedrock_thinking_and_parallel_tools_then_answer() {
    tool_round_then_answer(&bedrock::WIRE);
}

// ---------------------------------------------------------------------------------------------
// 2. Two tool rounds, SIGKILL while the second response streams, `cairn resume`
// ---------------------------------------------------------------------------------------------

fn killed_mid_stream_then_resumed(wire: &'static Wire) {
    let h = Harness::new(wire);
    h.push_tool_round(0);
    // The second response streams slowly; the child is killed while it does.
    h.push_stream((wire.tool_round)(1), Duration::from_millis(300));
    // The re-run attempt of round 1, then round 2.
    h.push_tool_round(1);
    h.push_text(FINAL);
    let session = format!("killed-{}", wire.provider);
    let args = h.run_args(&session);
    let mut child = h
        .command(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while h.server.requests().len() < 2 {
        assert!(Instant::now() < deadline, "the second request never came");
        assert!(child.try_wait().unwrap().is_none(), "the child ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A few events of the second stream have gone out (and were printed as deltas).
    std::thread::sleep(Duration::from_millis(1000));
    assert!(child.try_wait().unwrap().is_none(), "the child ended early");
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(h.server.requests().len(), 2);
    let before = h.history(&session);
    assert_one_response_per_round(&before, wire.provider, 1);

    let out = h.cairn(&[
        "resume",
        "--data",
        h.data().to_str().unwrap(),
        "--workdir",
        h.dir.path().join("work").to_str().unwrap(),
    ]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{}: {stdout}\n{}",
        wire.provider,
        text(&out.stderr)
    );
    assert!(stdout.contains("released 1 lease"), "{stdout}");
    assert!(
        stdout.contains(&format!("{session}: turn 1 completed")) && stdout.contains(FINAL),
        "{stdout}"
    );
    h.assert_all_accepted();

    let requests = h.server.requests();
    assert_eq!(requests.len(), 4, "{}", wire.provider);
    // The re-run asks exactly what the killed attempt asked: the request is rendered from the
    // ledger alone.
    assert_eq!(
        text(&requests[2].body),
        text(&requests[1].body),
        "{}",
        wire.provider
    );
    let last = requests[3].json();
    let raw = text(&requests[3].body);
    assert_round_echoed(wire, &last, &raw, 0);
    assert_round_echoed(wire, &last, &raw, 1);

    let history = h.history(&session);
    assert_eq!(history[..before.len()], before[..]);
    assert_one_response_per_round(&history, wire.provider, 3);
    // The killed attempt's deltas were presentation only: the committed round-1 response is
    // the whole canonical one (full thinking, both calls).
    let round1 = kinds(&history, "model_call_completed")
        .into_iter()
        .map(|e| &e["event"]["model_call_completed"])
        .find(|c| c["round"] == 1)
        .unwrap();
    let parts = round1["response"]["parts"].as_array().unwrap();
    assert_eq!(parts.len(), 4, "{round1}");
    assert!(
        parts[0]
            .to_string()
            .contains(&think_text(1).replace('"', "\\\"")),
        "{round1}"
    );
    let tool_ids: Vec<&str> = kinds(&history, "tool_call_completed")
        .iter()
        .filter_map(|e| e["event"]["tool_call_completed"]["tool_use_id"].as_str())
        .collect();
    let mut expected: Vec<String> = (wire.ids)(0).to_vec();
    expected.extend((wire.ids)(1));
    let mut sorted = tool_ids.clone();
    sorted.sort();
    let mut want = expected.clone();
    want.sort();
    assert_eq!(sorted, want, "each tool call completed exactly once");
    assert_eq!(kinds(&history, "turn_completed").len(), 1);
    h.assert_replays(&session);
}

#[test]
fn anthropic_killed_mid_stream_resumes_and_completes() {
    killed_mid_stream_then_resumed(&anthropic::WIRE);
}

#[test]
fn openai_chat_killed_mid_stream_resumes_and_completes() {
    killed_mid_stream_then_resumed(&openai_chat::WIRE);
}

#[test]
fn openai_responses_killed_mid_stream_resumes_and_completes() {
    killed_mid_stream_then_resumed(&openai_responses::WIRE);
}

#[test]
fn bedrock_killed_mid_stream_resumes_and_completes() {
    killed_mid_stream_then_resumed(&bedrock::WIRE);
}

// ---------------------------------------------------------------------------------------------
// 3. HTTP errors classified end to end
// ---------------------------------------------------------------------------------------------

#[test]
fn rate_limited_then_retried_after_retry_after() {
    let h = Harness::new(&anthropic::WIRE);
    let mut limited = Canned::error(
        429,
        &json!({"type": "error", "error": {"type": "rate_limit_error",
            "message": "Number of request tokens has exceeded your per-minute rate limit"}})
        .to_string(),
    );
    // Above the 1 s initial backoff, so only honouring retry-after explains the wait.
    limited.headers.push(("retry-after".into(), "2".into()));
    h.server.push(limited);
    h.push_text(FINAL);
    let session = "rate-limited";
    let out = h.run(session);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains(FINAL));
    h.assert_all_accepted();
    assert_eq!(h.server.requests().len(), 2);
    assert_eq!(h.server.requests()[0].body, h.server.requests()[1].body);

    let history = h.history(session);
    let failed = kinds(&history, "model_call_failed");
    assert_eq!(failed.len(), 1);
    let failure = &failed[0]["event"]["model_call_failed"]["failure"];
    assert_eq!(failure["class"], "rate_limited", "{failure}");
    assert_eq!(failure["retry_after_ms"], 2000, "{failure}");
    assert!(
        failure["message"]
            .as_str()
            .unwrap()
            .contains("per-minute rate limit"),
        "{failure}"
    );
    let failed_at = failed[0]["recorded_at_ms"].as_u64().unwrap();
    let retry = history
        .iter()
        .find(|e| {
            e["kind"] == "model_call_scheduled"
                && e["event"]["model_call_scheduled"]["attempt"] == 2
        })
        .expect("a second attempt");
    let not_before = retry["event"]["model_call_scheduled"]["not_before_ms"]
        .as_u64()
        .unwrap();
    assert!(
        not_before >= failed_at + 2000,
        "retry scheduled {} ms after the 429",
        not_before as i64 - failed_at as i64
    );
    assert_one_response_per_round(&history, "anthropic", 1);
    assert_eq!(kinds(&history, "turn_completed").len(), 1);
    h.assert_replays(session);
}

#[test]
fn invalid_request_fails_the_turn_at_once() {
    let h = Harness::new(&anthropic::WIRE);
    let message = "max_tokens: 8000 > 4096, which is the maximum allowed number of output tokens for test-model";
    h.server.push(anthropic::reject(message));
    h.push_text("never sent");
    let session = "invalid";
    let out = h.run(session);
    // A failed turn has its own exit status.
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains(message), "{}", text(&out.stderr));
    // No retry.
    assert_eq!(h.server.requests().len(), 1);

    let history = h.history(session);
    let failed = kinds(&history, "model_call_failed");
    assert_eq!(failed.len(), 1);
    assert_eq!(
        failed[0]["event"]["model_call_failed"]["failure"]["class"],
        "invalid_request"
    );
    assert_eq!(kinds(&history, "model_call_scheduled").len(), 1);
    let turn_failed = kinds(&history, "turn_failed");
    assert_eq!(turn_failed.len(), 1);
    let reason = turn_failed[0]["event"]["turn_failed"]["reason"]
        .as_str()
        .unwrap();
    assert!(reason.contains(message), "{reason}");
    assert_eq!(history.last().unwrap()["kind"], "turn_failed");
    h.assert_replays(session);
}

// ---------------------------------------------------------------------------------------------
// 3. What the user saw is recorded: text streams, the stream stalls, SIGKILL, `cairn resume`
// ---------------------------------------------------------------------------------------------

/// A stream sends some text and stalls; the text is printed, a few hundred ms pass, and the
/// process is SIGKILLed before any response is recorded. The history still holds what was
/// streamed (`model_attempt_progress`), and `cairn resume` says that partial answer was cut off
/// and is being generated again, then completes with exactly one response for the round.
#[test]
fn text_streamed_before_a_sigkill_is_in_the_history_and_resume_says_it_is_generated_again() {
    let h = Harness::new(&anthropic::WIRE);
    let partial = "The answer is forty-";
    let again = "Forty-two, computed afresh.";
    // message_start, the text block, two text deltas; then the block's end never comes.
    let mut events = anthropic::text(partial);
    events.truncate(5);
    let stalled = events.pop().unwrap();
    let mut chunks: Vec<(Duration, Vec<u8>)> =
        events.into_iter().map(|e| (Duration::ZERO, e)).collect();
    chunks.push((Duration::from_secs(120), stalled));
    h.server.push(Canned {
        status: 200,
        headers: vec![("content-type".into(), anthropic::WIRE.content_type.into())],
        chunks,
    });
    h.push_text(again);
    let session = "cut-off";
    let args = h.run_args(session);
    let mut child = h
        .command(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let seen = Arc::new(Mutex::new(String::new()));
    let mut stdout = child.stdout.take().unwrap();
    let sink = seen.clone();
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 1024];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !seen.lock().unwrap().contains(partial) {
        assert!(
            Instant::now() < deadline,
            "never printed: {:?}",
            seen.lock()
        );
        assert!(child.try_wait().unwrap().is_none(), "the child ended early");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The user has read it; progress is recorded within a few hundred ms.
    std::thread::sleep(Duration::from_millis(700));
    assert!(child.try_wait().unwrap().is_none(), "the child ended early");
    child.kill().unwrap();
    child.wait().unwrap();

    let before = h.history(session);
    assert!(kinds(&before, "model_call_completed").is_empty());
    let progress = kinds(&before, "model_attempt_progress");
    assert!(!progress.is_empty(), "{before:?}");
    let mut recorded = String::new();
    for e in &progress {
        let p = &e["event"]["model_attempt_progress"];
        assert_eq!(
            (&p["turn"], &p["round"], &p["attempt"], &p["lease_attempt"]),
            (&json!(1), &json!(0), &json!(1), &json!(1)),
            "{p}"
        );
        recorded.push_str(p["text_appended"].as_str().unwrap());
    }
    assert_eq!(recorded, partial);
    let plain = h.cairn(&["history", "--data", h.data().to_str().unwrap(), session]);
    let plain = text(&plain.stdout);
    assert!(
        plain.contains("model_attempt_progress") && plain.contains("text+"),
        "{plain}"
    );

    let out = h.cairn(&[
        "resume",
        "--data",
        h.data().to_str().unwrap(),
        "--workdir",
        h.dir.path().join("work").to_str().unwrap(),
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains(&format!(
            "{session}: [interrupted: turn 1 (model call 0, attempt 1) had streamed {} characters of its answer: {partial:?}",
            partial.len()
        )) && stdout.contains("the answer is being generated again"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("{session}: turn 1 completed: {again}")),
        "{stdout}"
    );
    let history = h.history(session);
    assert_eq!(history[..before.len()], before[..]);
    assert_one_response_per_round(&history, "anthropic", 1);
    h.assert_all_accepted();
    h.assert_replays(session);
}
