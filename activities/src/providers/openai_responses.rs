//! The OpenAI Responses provider (`POST {base}/responses`, streamed as SSE).
//!
//! Requests are stateless (`store: false`) and ask for `reasoning.encrypted_content`, so every
//! `reasoning` output item comes back whole. Such an item is kept raw in the ledger
//! ([`Part::ReasoningItem`], its exact JSON text) and sent back verbatim, in position, right
//! before the item it produced. A `function_call` item's own id (`fc_...`, which the API uses to
//! pair it with the reasoning before it) is kept in [`ToolUse::signature`]; the call id
//! (`call_...`) is the canonical [`ToolUse::id`].
//!
//! [`render`] / [`render_body`] are pure: they check the provider's rules (a reasoning item must
//! be followed by its item; no text after a function call inside one assistant message; no
//! reasoning of other families) and build the exact body. [`StreamParser`] is pure and strict:
//! it is fed one SSE event at a time and either yields one canonical [`ModelResponse`] or a typed
//! error that says what broke and where.

use crate::context::ActivityContext;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{DeltaSink, ModelProvider, ModelRequest};
use crate::providers::drive::{self, WireParser};
use crate::providers::http::HttpSettings;
use crate::providers::prepare_transcript;
use crate::providers::sse::{SseDecoder, SseEvent};
use async_trait::async_trait;
use cairn_ledger::{
    validate_transcript, Delta, JsonText, Message, ModelResponse, Part, ProviderJson, Role,
    ServerToolKind, StopReason, ToolChoice, ToolResultContent, ToolUse, Usage, Violation,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};

/// The provider family's name, recorded as the provenance of its responses.
pub const PROVIDER: &str = "openai-responses";

/// The API base used when `OPENAI_BASE_URL` is not set.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// Calls the OpenAI Responses API (or a server speaking it).
#[derive(Debug, Clone)]
pub struct OpenAiResponsesProvider {
    settings: HttpSettings,
}

impl OpenAiResponsesProvider {
    /// A provider posting to `{settings.base_url}/responses`, with `Authorization: Bearer` when
    /// the settings carry a key.
    pub fn new(settings: HttpSettings) -> Self {
        OpenAiResponsesProvider { settings }
    }

    /// A provider configured from `OPENAI_API_KEY` and `OPENAI_BASE_URL` (default
    /// [`DEFAULT_BASE_URL`]), and the optional `OPENAI_IDLE_TIMEOUT_SECS` and
    /// `OPENAI_MAX_EVENT_BYTES` ([`HttpSettings::with_env`]). The key is required unless a base
    /// URL is set (local servers often need none).
    pub fn from_env() -> Result<Self> {
        let key = std::env::var("OPENAI_API_KEY")
            .ok()
            .filter(|k| !k.is_empty());
        let base = std::env::var("OPENAI_BASE_URL")
            .ok()
            .filter(|b| !b.is_empty());
        Ok(Self::new(settings_from(key, base)?.with_env("OPENAI")?))
    }
}

fn settings_from(key: Option<String>, base: Option<String>) -> Result<HttpSettings> {
    // Same environment as Chat Completions: one OpenAI key and base URL for both APIs.
    super::openai_chat::settings_from(key, base)
}

// ---------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------

fn invalid_request(message: String) -> Error {
    Error::Provider {
        kind: ErrorKind::InvalidRequest,
        message: format!("{PROVIDER} request: {message}"),
    }
}

/// The exact request body for `request`, as a JSON value (see [`render_body`] for the bytes
/// actually sent; this is the same document parsed).
pub fn render(request: &ModelRequest) -> Result<Value> {
    let body = render_body(request)?;
    serde_json::from_slice(&body).map_err(|e| Error::Provider {
        kind: ErrorKind::Internal,
        message: format!("{PROVIDER} request: the rendered body does not parse back: {e}"),
    })
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    stream: bool,
    store: bool,
    include: [&'static str; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    instructions: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<Value>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<Value>,
    input: Vec<Box<RawValue>>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum WireTool<'a> {
    Function(FunctionTool<'a>),
    /// A built-in tool's declaration, e.g. `{"type": "web_search"}`.
    BuiltIn {
        #[serde(rename = "type")]
        kind: &'static str,
    },
}

/// The server tools OpenAI Responses offers, as cairn declares them.
pub const SERVER_TOOLS: [ServerToolKind; 1] = [ServerToolKind::WebSearch];

/// The `tool_choice` value of `choice`: `"auto"`, `"none"`, `"required"` (any), or
/// `{"type": "function", "name": ...}`.
fn wire_tool_choice(choice: &ToolChoice) -> Value {
    match choice {
        ToolChoice::Auto => json!("auto"),
        ToolChoice::Any => json!("required"),
        ToolChoice::None => json!("none"),
        ToolChoice::Tool(name) => json!({"type": "function", "name": name}),
    }
}

/// The call options Responses can carry: its server tools, without a use limit (Responses has
/// no `max_uses`), and a named tool choice only for a function tool.
fn check_options(request: &ModelRequest) -> Result<()> {
    let options = &request.options;
    super::call_options::check_server_tools(PROVIDER, &SERVER_TOOLS, options)?;
    super::call_options::check_tool_choice(PROVIDER, options, &request.tools)?;
    if let Some(tool) = options.server_tools.iter().find(|t| t.max_uses.is_some()) {
        return Err(invalid_request(format!(
            "the server tool {} has a use limit, which OpenAI Responses cannot express (no max_uses)",
            tool.kind.as_str()
        )));
    }
    if let Some(ToolChoice::Tool(name)) = &options.tool_choice {
        if !request.tools.iter().any(|t| &t.name == name) {
            return Err(invalid_request(format!(
                "tool_choice names {name:?}, which is not a function tool; cairn forces only function tools on OpenAI Responses"
            )));
        }
    }
    Ok(())
}

#[derive(Serialize)]
struct FunctionTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    name: &'a str,
    description: &'a str,
    parameters: &'a RawValue,
    /// The Responses API defaults `strict` to true, which rejects ordinary JSON Schemas
    /// (optional properties, no `additionalProperties: false`); tools are checked on our side.
    strict: bool,
}

/// The exact bytes of the request body for `request`.
///
/// Body: `model`, `stream: true`, `store: false`, `include: ["reasoning.encrypted_content"]`,
/// `instructions` (the system messages, joined by blank lines), `max_output_tokens` when set,
/// `reasoning: {effort, summary: "auto"}` when a thinking budget is set (budget ≤ 4096 → low,
/// ≤ 16384 → medium, else high), `tools` (function tools, `strict: false`) and `input`, the
/// transcript as items in order. Raw reasoning items and tool schemas are embedded byte for byte.
pub fn render_body(request: &ModelRequest) -> Result<Vec<u8>> {
    let transcript = prepare_transcript(&request.transcript, PROVIDER)?;
    check_options(request)?;
    let mut instructions: Vec<&str> = Vec::new();
    let mut input: Vec<Box<RawValue>> = Vec::new();
    for (mi, message) in transcript.messages.iter().enumerate() {
        match message.role {
            Role::System => render_system(mi, message, &mut instructions)?,
            Role::User => render_user(mi, message, &mut input)?,
            Role::Assistant => render_assistant(mi, message, &mut input)?,
        }
    }
    validate_transcript(&transcript)
        .map_err(|e| invalid_request(format!("the transcript cannot be sent: {e}")))?;
    let mut tools = Vec::with_capacity(request.tools.len());
    for (ti, tool) in request.tools.iter().enumerate() {
        let parameters: &RawValue =
            serde_json::from_str(tool.input_schema.as_str()).map_err(|e| {
                invalid_request(format!(
                    "tool {ti} ({:?}): input_schema is not JSON: {e}",
                    tool.name
                ))
            })?;
        tools.push(WireTool::Function(FunctionTool {
            kind: "function",
            name: &tool.name,
            description: &tool.description,
            parameters,
            strict: false,
        }));
    }
    for server in &request.options.server_tools {
        tools.push(WireTool::BuiltIn {
            kind: server.kind.as_str(),
        });
    }
    let tool_choice = request
        .options
        .tool_choice
        .as_ref()
        .filter(|_| !tools.is_empty())
        .map(wire_tool_choice);
    let reasoning = request.model.thinking_budget_tokens.map(|budget| {
        let effort = match budget {
            0..=4096 => "low",
            4097..=16384 => "medium",
            _ => "high",
        };
        json!({"effort": effort, "summary": "auto"})
    });
    let body = Body {
        model: &request.model.model,
        stream: true,
        store: false,
        include: ["reasoning.encrypted_content"],
        instructions: (!instructions.is_empty()).then(|| instructions.join("\n\n")),
        max_output_tokens: request.model.max_tokens,
        reasoning,
        tools,
        tool_choice,
        input,
    };
    serde_json::to_vec(&body).map_err(|e| Error::Provider {
        kind: ErrorKind::Internal,
        message: format!("{PROVIDER} request: cannot serialize the body: {e}"),
    })
}

fn raw(value: &Value, mi: usize, pi: usize) -> Result<Box<RawValue>> {
    serde_json::value::to_raw_value(value).map_err(|e| Error::Provider {
        kind: ErrorKind::Internal,
        message: format!("{PROVIDER} request: message {mi} part {pi}: cannot serialize: {e}"),
    })
}

fn not_sendable(mi: usize, pi: usize, part: &Part, role: Role) -> Error {
    let why = match part {
        Part::Thinking { .. } | Part::RedactedThinking { .. } => {
            "signed thinking of another provider family cannot be verified by OpenAI Responses"
        }
        Part::Reasoning { .. } => {
            "unsigned reasoning text of another provider family has no OpenAI Responses form"
        }
        Part::Image { .. } => "images are sent only in user messages, by http(s) or data: URL",
        _ => "this part has no OpenAI Responses form here",
    };
    invalid_request(format!(
        "message {mi} ({}) part {pi} ({}): {why}",
        role.as_str(),
        part.kind()
    ))
}

fn render_system<'t>(mi: usize, message: &'t Message, out: &mut Vec<&'t str>) -> Result<()> {
    out.extend(super::system_texts(PROVIDER, mi, message)?);
    Ok(())
}

fn render_user(mi: usize, message: &Message, input: &mut Vec<Box<RawValue>>) -> Result<()> {
    let mut content: Vec<Value> = Vec::new();
    let flush = |content: &mut Vec<Value>, input: &mut Vec<Box<RawValue>>, pi: usize| {
        if content.is_empty() {
            return Ok(());
        }
        let item = json!({"role": "user", "content": std::mem::take(content)});
        input.push(raw(&item, mi, pi)?);
        Ok::<(), Error>(())
    };
    for (pi, part) in message.parts.iter().enumerate() {
        match part {
            Part::Text { text, .. } => content.push(json!({"type": "input_text", "text": text})),
            Part::Image { data_ref, .. }
                if ["http://", "https://", "data:"]
                    .iter()
                    .any(|p| data_ref.starts_with(p)) =>
            {
                content.push(json!({"type": "input_image", "image_url": data_ref}))
            }
            Part::Media(media) => content.push(
                super::media::responses_item(media)
                    .map_err(|e| invalid_request(format!("message {mi} part {pi}: {e}")))?,
            ),
            Part::ToolResult(result) => {
                flush(&mut content, input, pi)?;
                let output = match &result.content {
                    ToolResultContent::Text(text) => Value::from(text.as_str()),
                    ToolResultContent::Json(json) => Value::from(json.as_str()),
                    ToolResultContent::Blocks(blocks) => {
                        Value::Array(super::media::responses_output(blocks).map_err(|e| {
                            invalid_request(format!(
                                "message {mi} part {pi}: function_call_output {e}"
                            ))
                        })?)
                    }
                };
                let item = json!({
                    "type": "function_call_output",
                    "call_id": result.tool_use_id,
                    "output": output,
                });
                input.push(raw(&item, mi, pi)?);
            }
            other => return Err(not_sendable(mi, pi, other, Role::User)),
        }
    }
    flush(&mut content, input, message.parts.len())
}

fn render_assistant(mi: usize, message: &Message, input: &mut Vec<Box<RawValue>>) -> Result<()> {
    let mut text: Vec<Value> = Vec::new();
    // The `msg_…` id of the output item the pending text came from: a reasoning item is paired
    // with the item that follows it by that id, so it goes back with the text.
    let mut text_id: Option<String> = None;
    // Item ids go back only beside the reasoning items they are paired with. A message whose
    // reasoning was dropped (compaction's drop_reasoning) sends its items without ids, which
    // the API takes as new items; with their ids it would look for the reasoning they followed
    // ("Item 'fc_…' of type 'function_call' was provided without its required 'reasoning'
    // item").
    let paired = message
        .parts
        .iter()
        .any(|part| matches!(part, Part::ReasoningItem { .. }));
    let flush = |text: &mut Vec<Value>,
                 text_id: &mut Option<String>,
                 input: &mut Vec<Box<RawValue>>,
                 pi: usize| {
        if text.is_empty() {
            return Ok(());
        }
        let content = std::mem::take(text);
        let item = match text_id.take() {
            // With its id, the item goes back in the output-message shape it came in.
            Some(id) => json!({
                "type": "message",
                "id": id,
                "role": "assistant",
                "status": "completed",
                "content": content
                    .into_iter()
                    .map(|mut c| {
                        if c.get("annotations").is_none() {
                            c["annotations"] = json!([]);
                        }
                        c
                    })
                    .collect::<Vec<_>>(),
            }),
            None => json!({
                "type": "message",
                "role": "assistant",
                "content": content,
            }),
        };
        input.push(raw(&item, mi, pi)?);
        Ok::<(), Error>(())
    };
    let mut first_call: Option<usize> = None;
    let last = message.parts.len().saturating_sub(1);
    for (pi, part) in message.parts.iter().enumerate() {
        match part {
            Part::Text {
                text: t,
                item_id,
                citations,
            } => {
                if let Some(call) = first_call {
                    return Err(invalid_request(format!(
                        "message {mi} (assistant) part {pi} (text) comes after the function_call at part {call}; \
                         OpenAI Responses cannot carry text after a function call of the same response, \
                         and reordering would change the conversation"
                    )));
                }
                let item_id = item_id.as_ref().filter(|_| paired);
                if item_id != text_id.as_ref() {
                    flush(&mut text, &mut text_id, input, pi)?;
                    text_id = item_id.cloned();
                }
                let mut content = json!({"type": "output_text", "text": t});
                // Annotations this family produced go back with their text.
                if let Some(json) = citations.as_ref().and_then(|c| c.for_family(PROVIDER)) {
                    content["annotations"] = json.to_value().map_err(|e| {
                        invalid_request(format!(
                            "message {mi} (assistant) part {pi}: the text's annotations are not JSON: {e}"
                        ))
                    })?;
                }
                text.push(content);
            }
            Part::Opaque(opaque) => {
                let Some(json) = opaque.for_family(PROVIDER) else {
                    continue;
                };
                flush(&mut text, &mut text_id, input, pi)?;
                let verbatim = RawValue::from_string(json.as_str().to_owned()).map_err(|e| {
                    invalid_request(format!(
                        "message {mi} (assistant) part {pi} (opaque): not JSON: {e}"
                    ))
                })?;
                input.push(verbatim);
            }
            Part::ReasoningItem { item } => {
                flush(&mut text, &mut text_id, input, pi)?;
                let id = reasoning_item_id(mi, pi, item)?;
                if pi == last {
                    return Err(invalid_request(format!(
                        "message {mi} (assistant) part {pi} (reasoning_item): Item '{id}' of type 'reasoning' \
                         was provided without its required following item"
                    )));
                }
                let verbatim = RawValue::from_string(item.as_str().to_owned()).map_err(|e| {
                    invalid_request(format!(
                        "message {mi} (assistant) part {pi} (reasoning_item): not JSON: {e}"
                    ))
                })?;
                input.push(verbatim);
            }
            Part::ToolUse(call) => {
                flush(&mut text, &mut text_id, input, pi)?;
                first_call.get_or_insert(pi);
                input.push(raw(&function_call_item(call, paired), mi, pi)?);
            }
            other => return Err(not_sendable(mi, pi, other, Role::Assistant)),
        }
    }
    flush(&mut text, &mut text_id, input, message.parts.len())
}

/// The id of a raw reasoning item, after checking that it is one.
fn reasoning_item_id(mi: usize, pi: usize, item: &JsonText) -> Result<String> {
    #[derive(Deserialize)]
    struct Head {
        #[serde(rename = "type")]
        kind: String,
        id: Option<String>,
    }
    let head: Head = serde_json::from_str(item.as_str()).map_err(|e| {
        invalid_request(format!(
            "message {mi} (assistant) part {pi} (reasoning_item) is not an item object: {e}"
        ))
    })?;
    if head.kind != "reasoning" {
        return Err(invalid_request(format!(
            "message {mi} (assistant) part {pi} (reasoning_item) has type {:?}, expected \"reasoning\"",
            head.kind
        )));
    }
    Ok(head.id.unwrap_or_default())
}

/// A function call as an input item: with its `fc_…` id (kept as the call's signature) only
/// when `paired`, beside the reasoning item it followed.
fn function_call_item(call: &ToolUse, paired: bool) -> Value {
    let mut item = serde_json::Map::new();
    item.insert("type".into(), json!("function_call"));
    if let Some(id) = call.signature.as_ref().filter(|_| paired) {
        item.insert("id".into(), json!(id));
    }
    item.insert("call_id".into(), json!(call.id));
    item.insert("name".into(), json!(call.name));
    item.insert("arguments".into(), json!(call.arguments));
    Value::Object(item)
}

// ---------------------------------------------------------------------------------------------
// Stream parsing
// ---------------------------------------------------------------------------------------------

fn broken(kind: ErrorKind, message: String) -> Error {
    Error::Stream {
        provider: PROVIDER.into(),
        kind,
        message,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ItemKind {
    Reasoning,
    Message,
    FunctionCall {
        call_id: String,
        name: String,
    },
    /// A server tool's call (`web_search_call`) or an item type cairn does not know: kept raw
    /// and sent back verbatim.
    Opaque,
}

impl ItemKind {
    fn name(&self) -> &'static str {
        match self {
            ItemKind::Reasoning => "reasoning",
            ItemKind::Message => "message",
            ItemKind::FunctionCall { .. } => "function_call",
            ItemKind::Opaque => "opaque",
        }
    }
}

#[derive(Debug)]
struct Item {
    output_index: u64,
    id: String,
    kind: ItemKind,
    /// Text or arguments accumulated from deltas (presentation; `.done` is authoritative).
    streamed: String,
    /// The parts of the finished item, once `.done` arrived.
    parts: Option<Vec<Part>>,
}

#[derive(Debug)]
enum Terminal {
    Completed { status: String },
    Incomplete { reason: Option<String> },
}

/// A strict parser of one OpenAI Responses SSE stream.
///
/// Feed it every event in order, then call [`StreamParser::finish`]. `response.output_item.done`
/// is authoritative for each item; deltas are forwarded to the sink as presentation. Unknown
/// event types are ignored; protocol violations are [`Error::Stream`] (InvalidResponse), a stream
/// that ends before a terminal event is [`Error::Stream`] (Transient), and `response.failed` /
/// `error` events are classified [`Error::Provider`]s.
#[derive(Debug)]
pub struct StreamParser {
    model: String,
    events: usize,
    created: bool,
    last_sequence: Option<u64>,
    items: Vec<Item>,
    refusal: bool,
    /// Set by the terminal event, the only one carrying usage.
    usage: Option<Usage>,
    terminal: Option<Terminal>,
}

#[derive(Deserialize)]
struct ItemEvent<'a> {
    output_index: Option<u64>,
    #[serde(borrow)]
    item: &'a RawValue,
}

#[derive(Deserialize)]
struct DeltaEvent {
    item_id: Option<String>,
    output_index: Option<u64>,
    delta: String,
}

#[derive(Deserialize, Default)]
struct WireUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    input_tokens_details: Option<InputDetails>,
    #[serde(default)]
    output_tokens_details: Option<OutputDetails>,
}

#[derive(Deserialize, Default)]
struct InputDetails {
    #[serde(default)]
    cached_tokens: u64,
}

#[derive(Deserialize, Default)]
struct OutputDetails {
    #[serde(default)]
    reasoning_tokens: u64,
}

#[derive(Deserialize)]
struct WireError {
    code: Option<String>,
    message: Option<String>,
}

impl StreamParser {
    /// A parser for a call to `model` (replaced by the model the stream reports).
    pub fn new(model: impl Into<String>) -> Self {
        StreamParser {
            model: model.into(),
            events: 0,
            created: false,
            last_sequence: None,
            items: Vec::new(),
            refusal: false,
            usage: None,
            terminal: None,
        }
    }

    /// Whether a terminal event (`response.completed` / `response.incomplete`) was seen.
    pub fn is_terminal(&self) -> bool {
        self.terminal.is_some()
    }

    /// Feeds one SSE event: its `event:` name (empty or `message` when the server sent none; the
    /// data's `type` is used then) and its `data:` text.
    pub fn feed(&mut self, event: &str, data: &str, deltas: &dyn DeltaSink) -> Result<()> {
        self.events += 1;
        let n = self.events;
        let unnamed = event.is_empty() || event == "message";
        if unnamed && data.trim() == "[DONE]" {
            return Ok(());
        }
        let value: Value = serde_json::from_str(data).map_err(|e| {
            broken(
                ErrorKind::InvalidResponse,
                format!("event {n} ({event:?}): data is not JSON: {e}"),
            )
        })?;
        let kind = value.get("type").and_then(Value::as_str);
        let name = match (unnamed, kind) {
            (true, Some(k)) => k.to_owned(),
            (true, None) => {
                return Err(broken(
                    ErrorKind::InvalidResponse,
                    format!("event {n}: no event name and no \"type\" in its data"),
                ))
            }
            (false, Some(k)) if k != event => {
                return Err(broken(
                    ErrorKind::InvalidResponse,
                    format!("event {n}: named {event:?} but its data says type {k:?}"),
                ))
            }
            (false, _) => event.to_owned(),
        };
        let at = format!("event {n} ({name})");
        if let Some(seq) = value.get("sequence_number").and_then(Value::as_u64) {
            if let Some(prev) = self.last_sequence {
                if seq <= prev {
                    return Err(broken(
                        ErrorKind::InvalidResponse,
                        format!("{at}: sequence_number {seq} after {prev}"),
                    ));
                }
            }
            self.last_sequence = Some(seq);
        }
        let known = matches!(
            name.as_str(),
            "response.created"
                | "response.output_item.added"
                | "response.output_item.done"
                | "response.output_text.delta"
                | "response.function_call_arguments.delta"
                | "response.reasoning_summary_text.delta"
                | "response.reasoning_text.delta"
                | "response.completed"
                | "response.incomplete"
                | "response.failed"
                | "error"
        );
        if !known {
            return Ok(());
        }
        if name == "error" {
            return Err(stream_error_event(&value));
        }
        if self.terminal.is_some() {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!("{at}: arrived after the terminal event"),
            ));
        }
        if name == "response.created" {
            if self.created {
                return Err(broken(
                    ErrorKind::InvalidResponse,
                    format!("{at}: a second response.created"),
                ));
            }
            self.created = true;
            self.take_model(&value);
            return Ok(());
        }
        if !self.created {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!("{at}: arrived before response.created"),
            ));
        }
        match name.as_str() {
            "response.output_item.added" => self.item_added(&at, data),
            "response.output_item.done" => self.item_done(&at, data),
            "response.output_text.delta" => {
                let (_, text) = self.delta(&at, &value, |k| matches!(k, ItemKind::Message))?;
                deltas.delta(Delta::Text(text));
                Ok(())
            }
            "response.function_call_arguments.delta" => {
                let (call_id, fragment) =
                    self.delta(&at, &value, |k| matches!(k, ItemKind::FunctionCall { .. }))?;
                deltas.delta(Delta::ToolArguments {
                    tool_use_id: call_id,
                    fragment,
                });
                Ok(())
            }
            "response.reasoning_summary_text.delta" | "response.reasoning_text.delta" => {
                let (_, text) = self.delta(&at, &value, |k| matches!(k, ItemKind::Reasoning))?;
                deltas.delta(Delta::Thinking(text));
                Ok(())
            }
            "response.completed" => {
                let status = response_field(&value, "status").unwrap_or("completed");
                if status != "completed" {
                    return Err(broken(
                        ErrorKind::InvalidResponse,
                        format!("{at}: response status is {status:?}, expected \"completed\""),
                    ));
                }
                self.take_model(&value);
                self.take_usage(&at, &value)?;
                self.terminal = Some(Terminal::Completed {
                    status: status.to_owned(),
                });
                Ok(())
            }
            "response.incomplete" => {
                self.take_model(&value);
                self.take_usage(&at, &value)?;
                let reason = value
                    .pointer("/response/incomplete_details/reason")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                self.terminal = Some(Terminal::Incomplete { reason });
                Ok(())
            }
            "response.failed" => Err(failed_event(&value)),
            _ => Ok(()),
        }
    }

    fn take_model(&mut self, value: &Value) {
        if let Some(model) = response_field(value, "model").filter(|m| !m.is_empty()) {
            self.model = model.to_owned();
        }
    }

    fn take_usage(&mut self, at: &str, value: &Value) -> Result<()> {
        let Some(usage) = value.pointer("/response/usage").filter(|u| !u.is_null()) else {
            return Ok(());
        };
        let wire: WireUsage = serde_json::from_value(usage.clone()).map_err(|e| {
            broken(
                ErrorKind::InvalidResponse,
                format!("{at}: response.usage is malformed: {e}"),
            )
        })?;
        let cached = wire.input_tokens_details.unwrap_or_default().cached_tokens;
        self.usage = Some(Usage {
            input_tokens: wire.input_tokens.saturating_sub(cached),
            output_tokens: wire.output_tokens,
            cache_read_tokens: cached,
            cache_write_tokens: 0,
            reasoning_tokens: wire
                .output_tokens_details
                .unwrap_or_default()
                .reasoning_tokens,
        });
        Ok(())
    }

    fn parse_item_event<'d>(at: &str, data: &'d str) -> Result<(u64, &'d RawValue, Value)> {
        let event: ItemEvent<'d> = serde_json::from_str(data).map_err(|e| {
            broken(
                ErrorKind::InvalidResponse,
                format!("{at}: malformed item event: {e}"),
            )
        })?;
        let index = event
            .output_index
            .ok_or_else(|| broken(ErrorKind::InvalidResponse, format!("{at}: no output_index")))?;
        let item: Value = serde_json::from_str(event.item.get()).map_err(|e| {
            broken(
                ErrorKind::InvalidResponse,
                format!("{at}: malformed item: {e}"),
            )
        })?;
        Ok((index, event.item, item))
    }

    fn item_kind(at: &str, index: u64, item: &Value) -> Result<ItemKind> {
        let field = |name: &str| item.get(name).and_then(Value::as_str);
        match field("type") {
            Some("reasoning") => Ok(ItemKind::Reasoning),
            Some("message") => Ok(ItemKind::Message),
            Some("function_call") => {
                let call_id = field("call_id").filter(|c| !c.is_empty()).ok_or_else(|| {
                    broken(
                        ErrorKind::InvalidResponse,
                        format!("{at}: function_call at output_index {index} has no call_id"),
                    )
                })?;
                let name = field("name").filter(|c| !c.is_empty()).ok_or_else(|| {
                    broken(
                        ErrorKind::InvalidResponse,
                        format!("{at}: function_call at output_index {index} has no name"),
                    )
                })?;
                Ok(ItemKind::FunctionCall {
                    call_id: call_id.to_owned(),
                    name: name.to_owned(),
                })
            }
            Some(kind) if !kind.is_empty() => Ok(ItemKind::Opaque),
            _ => Err(broken(
                ErrorKind::InvalidResponse,
                format!("{at}: output item at output_index {index} has no type"),
            )),
        }
    }

    fn item_added(&mut self, at: &str, data: &str) -> Result<()> {
        let (index, _, item) = Self::parse_item_event(at, data)?;
        let kind = Self::item_kind(at, index, &item)?;
        let id = item
            .get("id")
            .and_then(Value::as_str)
            .filter(|i| !i.is_empty())
            .ok_or_else(|| {
                broken(
                    ErrorKind::InvalidResponse,
                    format!("{at}: item at output_index {index} has no id"),
                )
            })?;
        if let Some(dup) = self
            .items
            .iter()
            .find(|i| i.output_index == index || i.id == id)
        {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!(
                    "{at}: item {id:?} at output_index {index} clashes with item {:?} added at output_index {}",
                    dup.id, dup.output_index
                ),
            ));
        }
        self.items.push(Item {
            output_index: index,
            id: id.to_owned(),
            kind,
            streamed: String::new(),
            parts: None,
        });
        Ok(())
    }

    fn item_done(&mut self, at: &str, data: &str) -> Result<()> {
        let (index, raw_item, item) = Self::parse_item_event(at, data)?;
        let kind = Self::item_kind(at, index, &item)?;
        let id = item.get("id").and_then(Value::as_str).unwrap_or_default();
        let Some(slot) = self.items.iter_mut().find(|i| i.output_index == index) else {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!("{at}: item {id:?} at output_index {index} was never added"),
            ));
        };
        if slot.id != id || slot.kind.name() != kind.name() {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!(
                    "{at}: item {id:?} ({}) at output_index {index} differs from the {} item {:?} added there",
                    kind.name(),
                    slot.kind.name(),
                    slot.id
                ),
            ));
        }
        if slot.parts.is_some() {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!("{at}: item {id:?} at output_index {index} finished twice"),
            ));
        }
        let parts = match &kind {
            ItemKind::Reasoning => {
                let text = JsonText::parse(raw_item.get()).map_err(|e| {
                    broken(
                        ErrorKind::InvalidResponse,
                        format!("{at}: reasoning item {id:?}: {e}"),
                    )
                })?;
                vec![Part::ReasoningItem { item: text }]
            }
            ItemKind::Opaque => {
                let text = JsonText::parse(raw_item.get()).map_err(|e| {
                    broken(
                        ErrorKind::InvalidResponse,
                        format!("{at}: item {id:?}: {e}"),
                    )
                })?;
                vec![Part::Opaque(ProviderJson::new(PROVIDER, text))]
            }
            ItemKind::Message => {
                let mut parts = Vec::new();
                let content = item
                    .get("content")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                for (ci, c) in content.iter().enumerate() {
                    let field = |name: &str| c.get(name).and_then(Value::as_str);
                    let text = match field("type") {
                        Some("output_text") => field("text"),
                        Some("refusal") => {
                            self.refusal = true;
                            field("refusal")
                        }
                        other => {
                            return Err(broken(
                                ErrorKind::InvalidResponse,
                                format!(
                                "{at}: message {id:?} content {ci} has unsupported type {other:?}"
                            ),
                            ))
                        }
                    };
                    let text = text.ok_or_else(|| {
                        broken(
                            ErrorKind::InvalidResponse,
                            format!("{at}: message {id:?} content {ci} has no text"),
                        )
                    })?;
                    // Annotations (url citations of web search, file citations) are kept to go
                    // back with the text.
                    let citations = c
                        .get("annotations")
                        .filter(|a| a.as_array().is_some_and(|a| !a.is_empty()))
                        .map(|a| ProviderJson::new(PROVIDER, JsonText::from_value(a)));
                    if !text.is_empty() {
                        parts.push(Part::Text {
                            text: text.to_owned(),
                            item_id: (!id.is_empty()).then(|| id.to_owned()),
                            citations,
                        });
                    }
                }
                parts
            }
            ItemKind::FunctionCall { call_id, name } => {
                if slot.kind != kind {
                    return Err(broken(
                        ErrorKind::InvalidResponse,
                        format!("{at}: function_call {id:?} changed its call_id or name between added and done"),
                    ));
                }
                let arguments = item
                    .get("arguments")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        broken(
                            ErrorKind::InvalidResponse,
                            format!("{at}: function_call {id:?} has no arguments string"),
                        )
                    })?;
                vec![Part::ToolUse(ToolUse {
                    id: call_id.clone(),
                    name: name.clone(),
                    arguments: arguments.to_owned(),
                    signature: Some(id.to_owned()),
                })]
            }
        };
        slot.parts = Some(parts);
        Ok(())
    }

    /// Finds the open item a delta belongs to; returns (its call id or item id, the delta).
    fn delta(
        &mut self,
        at: &str,
        value: &Value,
        expected: impl Fn(&ItemKind) -> bool,
    ) -> Result<(String, String)> {
        let event: DeltaEvent = serde_json::from_value(value.clone()).map_err(|e| {
            broken(
                ErrorKind::InvalidResponse,
                format!("{at}: malformed delta: {e}"),
            )
        })?;
        let slot = self.items.iter_mut().find(|i| match &event.item_id {
            Some(id) => &i.id == id,
            None => Some(i.output_index) == event.output_index,
        });
        let which = || {
            event
                .item_id
                .clone()
                .unwrap_or_else(|| format!("output_index {:?}", event.output_index))
        };
        let Some(slot) = slot else {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!("{at}: delta for unknown item {:?}", which()),
            ));
        };
        if !expected(&slot.kind) {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!("{at}: delta for {} item {:?}", slot.kind.name(), slot.id),
            ));
        }
        if slot.parts.is_some() {
            return Err(broken(
                ErrorKind::InvalidResponse,
                format!("{at}: delta for item {:?} after it finished", slot.id),
            ));
        }
        slot.streamed.push_str(&event.delta);
        let key = match &slot.kind {
            ItemKind::FunctionCall { call_id, .. } => call_id.clone(),
            _ => slot.id.clone(),
        };
        Ok((key, event.delta))
    }

    /// The canonical response, or why the stream did not produce one.
    pub fn finish(mut self) -> Result<ModelResponse> {
        let Some(terminal) = self.terminal.take() else {
            let what = if self.created {
                "response.completed, response.incomplete or response.failed"
            } else {
                "response.created"
            };
            return Err(broken(
                ErrorKind::Transient,
                format!(
                    "the stream ended after {} events without {what}",
                    self.events
                ),
            ));
        };
        self.items.sort_by_key(|i| i.output_index);
        let (stop_reason_raw, stop_reason) = match &terminal {
            Terminal::Completed { status } => {
                if let Some(open) = self.items.iter().find(|i| i.parts.is_none()) {
                    return Err(broken(
                        ErrorKind::InvalidResponse,
                        format!(
                            "response.completed while {} item {:?} (output_index {}) was never finished",
                            open.kind.name(),
                            open.id,
                            open.output_index
                        ),
                    ));
                }
                let calls = self
                    .items
                    .iter()
                    .any(|i| matches!(i.kind, ItemKind::FunctionCall { .. }));
                let reason = if calls {
                    StopReason::ToolUse
                } else if self.refusal {
                    StopReason::Refusal
                } else {
                    StopReason::EndTurn
                };
                (status.clone(), reason)
            }
            Terminal::Incomplete { reason } => {
                let truncated = self.items.iter().enumerate().find(|(n, i)| {
                    matches!(i.kind, ItemKind::FunctionCall { .. })
                        && (i.parts.is_none() || *n + 1 == self.items.len())
                });
                if let Some((_, item)) = truncated {
                    let call_id = match &item.kind {
                        ItemKind::FunctionCall { call_id, .. } => call_id.clone(),
                        _ => item.id.clone(),
                    };
                    return Err(Error::InvalidResponse {
                        provider: PROVIDER.into(),
                        source: cairn_ledger::Error::InvalidResponse {
                            part: None,
                            violation: Violation::TruncatedToolUse {
                                tool_use_id: call_id,
                            },
                        },
                    });
                }
                // Unfinished messages keep what streamed; unfinished reasoning cannot be sent
                // back without its encrypted content and is dropped.
                for item in &mut self.items {
                    if item.parts.is_none() && item.kind == ItemKind::Message {
                        let text = std::mem::take(&mut item.streamed);
                        item.parts = Some(if text.is_empty() {
                            Vec::new()
                        } else {
                            vec![Part::Text {
                                text,
                                item_id: Some(item.id.clone()).filter(|id| !id.is_empty()),
                                citations: None,
                            }]
                        });
                    }
                }
                let stop = match reason.as_deref() {
                    Some("max_output_tokens") => StopReason::MaxTokens,
                    Some("content_filter") => StopReason::ContentFilter,
                    _ => StopReason::Other,
                };
                (reason.clone().unwrap_or_else(|| "incomplete".into()), stop)
            }
        };
        let parts: Vec<Part> = self
            .items
            .into_iter()
            .filter_map(|i| i.parts)
            .flatten()
            .collect();
        let response = ModelResponse {
            provider: PROVIDER.into(),
            model: self.model,
            parts,
            stop_reason_raw,
            stop_reason,
            usage: self.usage.unwrap_or_default(),
        };
        super::checked_response(PROVIDER, response)
    }
}

fn response_field<'v>(value: &'v Value, name: &str) -> Option<&'v str> {
    value
        .get("response")
        .and_then(|r| r.get(name))
        .and_then(Value::as_str)
}

/// The failure class of an error code sent in a stream.
fn classify_code(code: Option<&str>) -> ErrorKind {
    match code.unwrap_or_default() {
        "rate_limit_exceeded" => ErrorKind::RateLimited,
        // A billing matter, sent as a 429 too: no retry succeeds until a person acts.
        "insufficient_quota" => ErrorKind::Auth,
        "server_is_overloaded" | "overloaded" | "slow_down" => ErrorKind::Overloaded,
        "server_error" | "internal_error" | "" => ErrorKind::Transient,
        "vector_store_timeout" => ErrorKind::Timeout,
        "invalid_api_key" => ErrorKind::Auth,
        c if c.contains("context_length") => ErrorKind::ContextTooLong,
        c if c.starts_with("invalid")
            || c.starts_with("image_")
            || c.ends_with("_image_media_type")
            || c == "empty_image_file"
            || c == "failed_to_download_image" =>
        {
            ErrorKind::InvalidRequest
        }
        _ => ErrorKind::Transient,
    }
}

fn failed_event(value: &Value) -> Error {
    let error: Option<WireError> = value
        .pointer("/response/error")
        .and_then(|e| serde_json::from_value(e.clone()).ok());
    let (code, message) = match error {
        Some(e) => (e.code, e.message),
        None => (None, None),
    };
    Error::Provider {
        kind: classify_code(code.as_deref()),
        message: format!(
            "{PROVIDER}: response.failed ({}): {}",
            code.as_deref().unwrap_or("no code"),
            message.as_deref().unwrap_or("no message")
        ),
    }
}

fn stream_error_event(value: &Value) -> Error {
    // Documented: {"type":"error","code","message","param"}; some servers nest under "error".
    let source = value
        .get("error")
        .filter(|e| e.is_object())
        .unwrap_or(value);
    let field = |name: &str| source.get(name).and_then(Value::as_str);
    let code = field("code").or_else(|| field("type").filter(|t| *t != "error"));
    Error::Provider {
        kind: classify_code(code),
        message: format!(
            "{PROVIDER}: error event ({}): {}",
            code.unwrap_or("no code"),
            field("message").unwrap_or("no message")
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// The provider
// ---------------------------------------------------------------------------------------------

#[async_trait]
impl ModelProvider for OpenAiResponsesProvider {
    fn provider(&self) -> &str {
        PROVIDER
    }

    async fn call(
        &self,
        request: &ModelRequest,
        deltas: &dyn DeltaSink,
        context: &ActivityContext,
    ) -> Result<ModelResponse> {
        let body = render_body(request)?;
        let mut headers = vec![("accept", "text/event-stream".to_owned())];
        if let Some(key) = &self.settings.api_key {
            headers.push(("authorization", format!("Bearer {key}")));
        }
        let parser = StreamParser::new(request.model.model.clone());
        drive::call(
            &self.settings,
            "/responses",
            &headers,
            body,
            parser,
            deltas,
            context,
        )
        .await
    }
}

impl WireParser for StreamParser {
    const PROVIDER: &'static str = PROVIDER;
    type Decoder = SseDecoder;

    fn feed_event(&mut self, event: &SseEvent, deltas: &dyn DeltaSink) -> Result<()> {
        self.feed(&event.event, &event.data, deltas)
    }

    fn is_done(&self) -> bool {
        self.is_terminal()
    }

    /// Responses reports usage only with its terminal event.
    fn usage_so_far(&self) -> Option<Usage> {
        self.usage
    }

    fn finish(self) -> Result<ModelResponse> {
        StreamParser::finish(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::NoDeltas;

    #[test]
    fn env_settings_need_a_key_unless_a_base_url_is_set() {
        let err = settings_from(None, None).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Auth);
        assert!(err.to_string().contains("OPENAI_API_KEY"), "{err}");
        let local = settings_from(None, Some("http://localhost:8000/v1/".into())).unwrap();
        assert_eq!(local.base_url, "http://localhost:8000/v1");
        assert_eq!(local.api_key, None);
        let default = settings_from(Some("k".into()), None).unwrap();
        assert_eq!(default.base_url, DEFAULT_BASE_URL);
    }

    #[test]
    fn error_codes_are_classified() {
        assert_eq!(classify_code(Some("server_error")), ErrorKind::Transient);
        assert_eq!(
            classify_code(Some("rate_limit_exceeded")),
            ErrorKind::RateLimited
        );
        assert_eq!(
            classify_code(Some("invalid_prompt")),
            ErrorKind::InvalidRequest
        );
        assert_eq!(
            classify_code(Some("context_length_exceeded")),
            ErrorKind::ContextTooLong
        );
        assert_eq!(classify_code(None), ErrorKind::Transient);
        assert_eq!(classify_code(Some("insufficient_quota")), ErrorKind::Auth);
    }

    #[test]
    fn events_before_created_and_after_the_end_are_refused() {
        let mut p = StreamParser::new("m");
        let err = p
            .feed(
                "response.output_item.added",
                r#"{"type":"response.output_item.added","output_index":0,"item":{"id":"m1","type":"message","content":[]}}"#,
                &NoDeltas,
            )
            .unwrap_err();
        assert!(err.to_string().contains("before response.created"), "{err}");
        let mut p = StreamParser::new("m");
        p.feed(
            "",
            r#"{"type":"response.created","response":{}}"#,
            &NoDeltas,
        )
        .unwrap();
        let err = p
            .feed(
                "response.created",
                r#"{"type":"response.output_item.added"}"#,
                &NoDeltas,
            )
            .unwrap_err();
        assert!(err.to_string().contains("its data says type"), "{err}");
    }
}
