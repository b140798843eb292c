//! OpenAI Chat Completions (`POST {base}/chat/completions`, streamed over SSE), which is also the
//! dialect of compatible servers: Ollama `/v1`, vLLM, llama.cpp server, OpenRouter, DeepSeek.
//!
//! Three parts, as every provider module: [`render`] (pure: the provider's rules checked on the
//! transcript, then the exact request body), [`StreamParser`] (pure and strict: one SSE `data:`
//! payload at a time into one canonical [`ModelResponse`]), and [`OpenAiChatProvider`] gluing them
//! to HTTP through [`super::http`].
//!
//! Wire facts this module relies on (OpenAI API reference, DeepSeek thinking-mode guide):
//! - `tool_calls[].function.arguments` is a JSON *string* and may be invalid JSON: it is recorded
//!   and sent back byte for byte, never re-serialized.
//! - Each tool call is answered by one `{role: "tool", tool_call_id, content}` message right after
//!   the assistant message; the API has no error flag on a result (we say it in the content).
//! - Tool-call ids are at most 40 characters on api.openai.com; longer or empty ids are aliased
//!   per request ([`IdAliases`]), the canonical id stays in the log.
//! - DeepSeek-style servers stream unsigned reasoning as `delta.reasoning_content` (vLLM and
//!   OpenRouter: `delta.reasoning`); it becomes [`Part::Reasoning`], is never merged into
//!   `content`, and goes back as `reasoning_content` on assistant messages that made tool calls.
//! - With `stream_options.include_usage` a last chunk with an empty `choices` array carries the
//!   usage, then `data: [DONE]`. Streamed tool calls arrive as fragments
//!   `{index, id?, type?, function: {name?, arguments?}}`, the first of a call with id and name.
//! - `max_tokens` is deprecated on api.openai.com in favour of `max_completion_tokens` (which
//!   o-series and newer models require), while Ollama, DeepSeek and others document only
//!   `max_tokens`: see [`MaxTokensField`].

use super::alias::IdAliases;
use super::drive::{self, WireParser};
use super::http::HttpSettings;
use super::prepare_transcript;
use super::sse::{SseDecoder, SseEvent};
use crate::context::ActivityContext;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{CallContext, DeltaSink, ModelProvider, ModelRequest};
use async_trait::async_trait;
use cairn_ledger::{
    Delta, Message, ModelResponse, Part, Role, StopReason, ToolChoice, ToolResultContent, ToolUse,
    Usage,
};
use serde_json::{json, Map, Value};

/// The provider family name, recorded as the responses' provenance.
pub const PROVIDER: &str = "openai";

/// The base URL used when `OPENAI_BASE_URL` is not set.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// The longest tool-call id api.openai.com accepts in a request; longer ids are aliased.
pub const MAX_WIRE_ID_LEN: usize = 40;

/// Which request field carries the output token limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MaxTokensField {
    /// `max_completion_tokens`: OpenAI's current field (visible output plus reasoning tokens);
    /// `max_tokens` is deprecated there and rejected by o-series and newer models.
    #[default]
    MaxCompletionTokens,
    /// `max_tokens`: the field Ollama, DeepSeek, llama.cpp and OpenRouter document.
    MaxTokens,
}

impl MaxTokensField {
    /// The field's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            MaxTokensField::MaxCompletionTokens => "max_completion_tokens",
            MaxTokensField::MaxTokens => "max_tokens",
        }
    }
}

/// Server-dialect choices of the request body. [`render`] uses the default (api.openai.com).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RenderOptions {
    /// Which field carries `ModelSpec::max_tokens`.
    pub max_tokens_field: MaxTokensField,
    /// Send `reasoning_content` (empty when there is no reasoning) on *every* assistant message
    /// that made tool calls. DeepSeek in thinking mode rejects a request without it ("Missing
    /// `reasoning_content` field in the assistant message at message index N"), also for turns
    /// produced by another provider. Off by default: api.openai.com does not know the field.
    /// Assistant messages that carry a [`Part::Reasoning`] send it regardless.
    pub always_send_reasoning_content: bool,
}

impl RenderOptions {
    /// The dialect a base URL most likely speaks: api.openai.com gets the defaults, DeepSeek
    /// gets `max_tokens` and `reasoning_content` on every tool-call turn, other compatible
    /// servers get `max_tokens`.
    pub fn for_base_url(base_url: &str) -> RenderOptions {
        let host = host_of(base_url);
        if host == "api.openai.com" {
            RenderOptions::default()
        } else {
            RenderOptions {
                max_tokens_field: MaxTokensField::MaxTokens,
                always_send_reasoning_content: host.contains("deepseek"),
            }
        }
    }
}

fn host_of(base_url: &str) -> String {
    let rest = base_url
        .split_once("://")
        .map_or(base_url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = authority.rsplit('@').next().unwrap_or(authority);
    host.split(':').next().unwrap_or(host).to_ascii_lowercase()
}

/// The OpenAI Chat Completions provider (and compatible servers).
#[derive(Debug, Clone)]
pub struct OpenAiChatProvider {
    settings: HttpSettings,
    options: RenderOptions,
}

impl OpenAiChatProvider {
    /// A provider for `settings`; the request dialect follows the base URL
    /// ([`RenderOptions::for_base_url`]). The base URL includes the version path, e.g.
    /// `https://api.openai.com/v1` or `http://localhost:11434/v1`.
    pub fn new(settings: HttpSettings) -> Self {
        let options = RenderOptions::for_base_url(&settings.base_url);
        OpenAiChatProvider { settings, options }
    }

    /// The same provider with an explicit request dialect.
    pub fn with_options(mut self, options: RenderOptions) -> Self {
        self.options = options;
        self
    }

    /// The request dialect in use.
    pub fn options(&self) -> RenderOptions {
        self.options
    }

    /// From the environment: `OPENAI_API_KEY` (optional when `OPENAI_BASE_URL` points at a
    /// local compatible server: then no Authorization header is sent), `OPENAI_BASE_URL`
    /// (default [`DEFAULT_BASE_URL`]), and the optional `OPENAI_IDLE_TIMEOUT_SECS` and
    /// `OPENAI_MAX_EVENT_BYTES` ([`HttpSettings::with_env`]). Neither key nor base URL set is
    /// an [`ErrorKind::Auth`] error.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let settings = settings_from(var("OPENAI_API_KEY"), var("OPENAI_BASE_URL"))?;
        Ok(Self::new(settings.with_env("OPENAI")?))
    }
}

/// OpenAI settings from a key and a base URL (shared by Chat and Responses): the key may only be
/// omitted for a base URL of a compatible server that needs none.
pub(crate) fn settings_from(
    api_key: Option<String>,
    base_url: Option<String>,
) -> Result<HttpSettings> {
    match (api_key, base_url) {
        (None, None) => Err(Error::Provider {
            kind: ErrorKind::Auth,
            message: "OPENAI_API_KEY is not set: api.openai.com needs a key (for a local \
                      compatible server without a key, set OPENAI_BASE_URL, e.g. \
                      http://localhost:11434/v1)"
                .into(),
        }),
        (key, base) => Ok(HttpSettings::new(
            base.unwrap_or_else(|| DEFAULT_BASE_URL.to_owned()),
            key,
        )),
    }
}

#[async_trait]
impl ModelProvider for OpenAiChatProvider {
    fn provider(&self) -> &str {
        PROVIDER
    }

    async fn call(
        &self,
        request: &ModelRequest,
        deltas: &dyn DeltaSink,
        context: &ActivityContext,
    ) -> Result<ModelResponse> {
        let body = render_with(request, &self.options)?;
        let body = serde_json::to_vec(&body).map_err(|e| Error::Provider {
            kind: ErrorKind::Internal,
            message: format!("could not serialize the openai request body: {e}"),
        })?;
        let mut headers = vec![("accept", "text/event-stream".to_owned())];
        if let Some(key) = &self.settings.api_key {
            headers.push(("authorization", format!("Bearer {key}")));
        }
        let parser = StreamParser::new(request.context.clone(), request.model.model.clone());
        drive::call(
            &self.settings,
            "/chat/completions",
            &headers,
            body,
            parser,
            deltas,
            context,
        )
        .await
    }
}

// ---------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------

fn invalid(message: String) -> Error {
    Error::Provider {
        kind: ErrorKind::InvalidRequest,
        message,
    }
}

fn wire_id_ok(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_WIRE_ID_LEN
}

/// The request body for api.openai.com ([`RenderOptions::default`]); see [`render_with`].
pub fn render(request: &ModelRequest) -> Result<Value> {
    render_with(request, &RenderOptions::default())
}

/// The exact request body for `request` in the dialect `options`.
///
/// Pure. The transcript is first prepared for this family ([`prepare_transcript`]: foreign
/// reasoning of completed turns dropped, a switch inside a tool loop refused) and checked
/// ([`cairn_ledger::validate_transcript`]: every tool call answered right after it, in
/// declaration order). Errors are [`ErrorKind::InvalidRequest`] and name the message and part.
pub fn render_with(request: &ModelRequest, options: &RenderOptions) -> Result<Value> {
    if request.model.model.is_empty() {
        return Err(invalid("the model name is empty".into()));
    }
    let transcript = prepare_transcript(&request.transcript, PROVIDER)?;
    // Chat Completions has no server tools of its own.
    super::call_options::check_server_tools(PROVIDER, &[], &request.options)?;
    super::call_options::check_tool_choice(PROVIDER, &request.options, &request.tools)?;
    cairn_ledger::validate_transcript(&transcript).map_err(|e| {
        invalid(format!(
            "the transcript cannot be sent to OpenAI Chat Completions: {e}"
        ))
    })?;
    let mut aliases = IdAliases::new();
    let mut messages = Vec::new();
    for (index, message) in transcript.messages.iter().enumerate() {
        match message.role {
            Role::System => messages.push(render_system(index, message)?),
            Role::User => render_user(index, message, &mut aliases, &mut messages)?,
            Role::Assistant => {
                messages.push(render_assistant(index, message, &mut aliases, options)?)
            }
        }
    }
    let mut body = Map::new();
    body.insert("model".into(), Value::from(request.model.model.as_str()));
    body.insert("messages".into(), Value::Array(messages));
    if !request.tools.is_empty() {
        let mut tools = Vec::with_capacity(request.tools.len());
        for tool in request.tools.iter() {
            let parameters = tool.input_schema.to_value().map_err(|e| {
                invalid(format!(
                    "tool {:?}: the input schema is not JSON: {e}",
                    tool.name
                ))
            })?;
            tools.push(json!({
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": parameters,
                },
            }));
        }
        body.insert("tools".into(), Value::Array(tools));
        if let Some(choice) = &request.options.tool_choice {
            body.insert("tool_choice".into(), wire_tool_choice(choice));
        }
    }
    if let Some(max) = request.model.max_tokens {
        body.insert(options.max_tokens_field.as_str().into(), Value::from(max));
    }
    body.insert("stream".into(), Value::Bool(true));
    body.insert("stream_options".into(), json!({ "include_usage": true }));
    Ok(Value::Object(body))
}

/// The `tool_choice` value of `choice`: `"auto"`, `"none"`, `"required"` (any), or
/// `{"type": "function", "function": {"name": ...}}`.
fn wire_tool_choice(choice: &ToolChoice) -> Value {
    match choice {
        ToolChoice::Auto => json!("auto"),
        ToolChoice::Any => json!("required"),
        ToolChoice::None => json!("none"),
        ToolChoice::Tool(name) => json!({"type": "function", "function": {"name": name}}),
    }
}

fn render_system(index: usize, message: &Message) -> Result<Value> {
    let texts = super::system_texts(PROVIDER, index, message)?;
    let content = match texts.as_slice() {
        [one] => Value::from(*one),
        many => Value::Array(
            many.iter()
                .map(|t| json!({ "type": "text", "text": t }))
                .collect(),
        ),
    };
    Ok(json!({ "role": "system", "content": content }))
}

fn render_user(
    index: usize,
    message: &Message,
    aliases: &mut IdAliases,
    out: &mut Vec<Value>,
) -> Result<()> {
    let mut content = Vec::new();
    let mut only_text = true;
    // Tool messages take text only: media a tool returned go in the user message after the
    // tool messages, each set introduced by a text part naming its call.
    let mut tool_media = Vec::new();
    for (pi, part) in message.parts.iter().enumerate() {
        match part {
            Part::ToolResult(result) => {
                let text = match &result.content {
                    ToolResultContent::Json(json) => json.as_str().to_owned(),
                    ToolResultContent::Text(text) => text.clone(),
                    ToolResultContent::Blocks(_) => result.content.text_view(),
                };
                let text = if result.is_error {
                    format!("Error: {text}")
                } else {
                    text
                };
                let id = aliases.wire_id(&result.tool_use_id, wire_id_ok, "call_cairn_");
                let media = result.content.media();
                if !media.is_empty() {
                    tool_media.push(json!({
                        "type": "text",
                        "text": format!("The result of tool call {id} includes:"),
                    }));
                    for (mi, m) in media.into_iter().enumerate() {
                        tool_media.push(super::media::chat_part(m).map_err(|e| {
                            invalid(format!(
                                "message {index} part {pi}: tool_result media {mi}: {e}"
                            ))
                        })?);
                    }
                }
                out.push(json!({ "role": "tool", "tool_call_id": id, "content": text }));
            }
            Part::Media(media) => {
                only_text = false;
                content.push(
                    super::media::chat_part(media)
                        .map_err(|e| invalid(format!("message {index} part {pi}: {e}")))?,
                );
            }
            Part::Text { text, .. } => content.push(json!({ "type": "text", "text": text })),
            Part::Image {
                media_type,
                data_ref,
            } => {
                let is_url = ["https://", "http://", "data:"]
                    .iter()
                    .any(|p| data_ref.starts_with(p));
                if !is_url {
                    return Err(invalid(format!(
                        "message {index} part {pi}: image ({media_type}) refers to {data_ref:?}, \
                         but OpenAI Chat Completions needs an http(s) URL or a data: URI"
                    )));
                }
                only_text = false;
                content.push(json!({ "type": "image_url", "image_url": { "url": data_ref } }));
            }
            other => {
                return Err(invalid(format!(
                    "message {index} part {pi}: a user message cannot carry {}",
                    other.kind()
                )))
            }
        }
    }
    if !tool_media.is_empty() {
        only_text = false;
        content.splice(0..0, tool_media);
    }
    if content.is_empty() {
        return Ok(());
    }
    let content = if only_text && content.len() == 1 {
        content
            .pop()
            .and_then(|c| c.get("text").cloned())
            .unwrap_or(Value::Null)
    } else {
        Value::Array(content)
    };
    out.push(json!({ "role": "user", "content": content }));
    Ok(())
}

fn render_assistant(
    index: usize,
    message: &Message,
    aliases: &mut IdAliases,
    options: &RenderOptions,
) -> Result<Value> {
    let mut text = String::new();
    let mut reasoning: Option<String> = None;
    let mut calls = Vec::new();
    for (pi, part) in message.parts.iter().enumerate() {
        match part {
            Part::Text { text: t, .. } => text.push_str(t),
            Part::Reasoning { text: r } => reasoning.get_or_insert_with(String::new).push_str(r),
            Part::ToolUse(call) => {
                let id = aliases.wire_id(&call.id, wire_id_ok, "call_cairn_");
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": { "name": call.name, "arguments": call.arguments },
                }));
            }
            other => {
                return Err(invalid(format!(
                    "message {index} part {pi}: {} cannot be sent to OpenAI Chat Completions \
                     (it comes from another provider family and is only droppable from completed \
                     turns)",
                    other.kind()
                )))
            }
        }
    }
    if text.is_empty() && calls.is_empty() {
        return Err(invalid(format!(
            "message {index}: the assistant message has neither text nor tool calls"
        )));
    }
    let mut out = Map::new();
    out.insert("role".into(), Value::from("assistant"));
    out.insert(
        "content".into(),
        if text.is_empty() {
            Value::Null
        } else {
            Value::from(text)
        },
    );
    if !calls.is_empty() {
        out.insert("tool_calls".into(), Value::Array(calls));
        let reasoning = match reasoning {
            Some(r) => Some(r),
            None if options.always_send_reasoning_content => Some(String::new()),
            None => None,
        };
        if let Some(r) = reasoning {
            out.insert("reasoning_content".into(), Value::from(r));
        }
    }
    Ok(Value::Object(out))
}

// ---------------------------------------------------------------------------------------------
// Stream parsing
// ---------------------------------------------------------------------------------------------

fn stream_error(kind: ErrorKind, message: String) -> Error {
    Error::Stream {
        provider: PROVIDER.into(),
        kind,
        message,
    }
}

/// A deterministic id for a tool call the server streamed without one: derived from where the
/// call sits (session, turn, round, attempt) and its position among the response's tool calls.
/// It is recorded in the response, so replay never derives it again. The session id enters as
/// its FNV-1a hash, which keeps the id within [`MAX_WIRE_ID_LEN`] and to `[a-z0-9_]`.
pub fn derived_tool_call_id(context: &CallContext, position: usize) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in context.session_id.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!(
        "call_{hash:016x}_{}_{}_{}_{position}",
        context.turn, context.round, context.attempt
    )
}

#[derive(Debug)]
struct OpenCall {
    index: u64,
    id: Option<String>,
    name: String,
    arguments: String,
}

/// A strict parser of one Chat Completions stream, fed the payload of each SSE `data:` event.
#[derive(Debug)]
pub struct StreamParser {
    context: CallContext,
    request_model: String,
    model: Option<String>,
    text: String,
    reasoning: Option<String>,
    calls: Vec<OpenCall>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    done: bool,
    chunks: usize,
}

impl StreamParser {
    /// A parser for a call at `context` to `request_model` (used as the response's model when
    /// the chunks name none).
    pub fn new(context: CallContext, request_model: impl Into<String>) -> Self {
        StreamParser {
            context,
            request_model: request_model.into(),
            model: None,
            text: String::new(),
            reasoning: None,
            calls: Vec::new(),
            finish_reason: None,
            usage: None,
            done: false,
            chunks: 0,
        }
    }

    /// Whether `data: [DONE]` was seen.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Feeds the payload of one SSE `data:` event (a JSON chunk, or `[DONE]`), emitting the
    /// text, reasoning and argument fragments it carries.
    pub fn feed(&mut self, data: &str, deltas: &dyn DeltaSink) -> Result<()> {
        let data = data.trim();
        if data.is_empty() {
            return Ok(());
        }
        self.chunks += 1;
        let at = self.chunks;
        if self.done {
            return Err(stream_error(
                ErrorKind::InvalidResponse,
                format!("event {at} arrived after data: [DONE]"),
            ));
        }
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| {
            stream_error(
                ErrorKind::InvalidResponse,
                format!(
                    "event {at} is not JSON ({e}): {}",
                    data.chars().take(200).collect::<String>()
                ),
            )
        })?;
        let Some(chunk) = chunk.as_object() else {
            return Err(stream_error(
                ErrorKind::InvalidResponse,
                format!("event {at} is not a JSON object"),
            ));
        };
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            return Err(classify_stream_error(error, at));
        }
        if self.model.is_none() {
            if let Some(model) = chunk.get("model").and_then(Value::as_str) {
                if !model.is_empty() {
                    self.model = Some(model.to_owned());
                }
            }
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            if !usage.is_object() {
                return Err(stream_error(
                    ErrorKind::InvalidResponse,
                    format!("event {at}: usage is not an object"),
                ));
            }
            self.usage = Some(parse_usage(usage));
        }
        let choices = match chunk.get("choices") {
            None | Some(Value::Null) => return Ok(()),
            Some(Value::Array(choices)) => choices,
            Some(_) => {
                return Err(stream_error(
                    ErrorKind::InvalidResponse,
                    format!("event {at}: choices is not an array"),
                ))
            }
        };
        for (position, choice) in choices.iter().enumerate() {
            // Only the first choice is asked for (no `n`); a server sending more is ignored.
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            if index != 0 {
                continue;
            }
            self.choice(choice, at, position, deltas)?;
        }
        Ok(())
    }

    fn choice(
        &mut self,
        choice: &Value,
        at: usize,
        position: usize,
        deltas: &dyn DeltaSink,
    ) -> Result<()> {
        let bad = |what: &str| {
            stream_error(
                ErrorKind::InvalidResponse,
                format!("event {at}, choices[{position}]: {what}"),
            )
        };
        if let Some(delta) = choice.get("delta").filter(|d| !d.is_null()) {
            if !delta.is_object() {
                return Err(bad("delta is not an object"));
            }
            let reasoning = match delta.get("reasoning_content") {
                Some(Value::Null) | None => delta.get("reasoning"),
                some => some,
            };
            match reasoning {
                None | Some(Value::Null) => {}
                Some(Value::String(r)) => {
                    self.reasoning.get_or_insert_with(String::new).push_str(r);
                    if !r.is_empty() {
                        deltas.delta(Delta::Thinking(r.clone()));
                    }
                }
                Some(_) => return Err(bad("reasoning_content is not a string")),
            }
            for key in ["content", "refusal"] {
                match delta.get(key) {
                    None | Some(Value::Null) => {}
                    Some(Value::String(t)) => {
                        self.text.push_str(t);
                        if !t.is_empty() {
                            deltas.delta(Delta::Text(t.clone()));
                        }
                    }
                    Some(_) => return Err(bad(&format!("delta.{key} is not a string"))),
                }
            }
            match delta.get("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(fragments)) => {
                    for (fi, fragment) in fragments.iter().enumerate() {
                        self.tool_fragment(fragment, fi, deltas)
                            .map_err(|what| bad(&format!("tool_calls[{fi}]: {what}")))?;
                    }
                }
                Some(_) => return Err(bad("delta.tool_calls is not an array")),
            }
        }
        match choice.get("finish_reason") {
            None | Some(Value::Null) => {}
            Some(Value::String(reason)) => {
                if self.finish_reason.is_none() {
                    self.finish_reason = Some(reason.clone());
                }
            }
            Some(_) => return Err(bad("finish_reason is not a string")),
        }
        Ok(())
    }

    fn tool_fragment(
        &mut self,
        fragment: &Value,
        position: usize,
        deltas: &dyn DeltaSink,
    ) -> std::result::Result<(), String> {
        if !fragment.is_object() {
            return Err("the fragment is not an object".into());
        }
        let index = match fragment.get("index") {
            None | Some(Value::Null) => position as u64,
            Some(i) => i.as_u64().ok_or("index is not a non-negative integer")?,
        };
        let id = match fragment.get("id") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) if id.is_empty() => None,
            Some(Value::String(id)) => Some(id.as_str()),
            Some(_) => return Err("id is not a string".into()),
        };
        let function = match fragment.get("function") {
            None | Some(Value::Null) => None,
            Some(f) if f.is_object() => Some(f),
            Some(_) => return Err("function is not an object".into()),
        };
        let field = |name: &str| -> std::result::Result<Option<&str>, String> {
            match function.and_then(|f| f.get(name)) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.as_str())),
                Some(_) => Err(format!("function.{name} is not a string")),
            }
        };
        let name = field("name")?;
        let arguments = field("arguments")?;
        // The call this fragment continues: the one at this index with the same id; with no id,
        // the latest call at this index. A new id at an index whose call has another id starts a
        // new call (servers that reuse index 0 for parallel calls tell them apart by id).
        let existing = match id {
            Some(id) => self
                .calls
                .iter()
                .rposition(|c| c.index == index && c.id.as_deref().is_none_or(|own| own == id)),
            None => self.calls.iter().rposition(|c| c.index == index),
        };
        let slot = match existing {
            Some(slot) => slot,
            None => {
                self.calls.push(OpenCall {
                    index,
                    id: None,
                    name: String::new(),
                    arguments: String::new(),
                });
                self.calls.len() - 1
            }
        };
        let call = &mut self.calls[slot];
        if call.id.is_none() {
            call.id = id.map(str::to_owned);
        }
        if let Some(name) = name {
            // Most servers send the name once; some repeat it in every fragment.
            if call.name.is_empty() {
                call.name = name.to_owned();
            } else if call.name != name {
                call.name.push_str(name);
            }
        }
        if let Some(arguments) = arguments {
            call.arguments.push_str(arguments);
            if !arguments.is_empty() {
                let tool_use_id = call
                    .id
                    .clone()
                    .unwrap_or_else(|| derived_tool_call_id(&self.context, slot));
                deltas.delta(Delta::ToolArguments {
                    tool_use_id,
                    fragment: arguments.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// The error an SSE event named `error` stands for (its data is the provider's error JSON).
    pub fn error_event(&self, data: &str) -> Error {
        let at = self.chunks + 1;
        match serde_json::from_str::<Value>(data) {
            Ok(value) => {
                let error = value.get("error").cloned().unwrap_or(value);
                classify_stream_error(&error, at)
            }
            Err(_) => Error::Provider {
                kind: ErrorKind::Transient,
                message: format!(
                    "openai stream error event at event {at}: {}",
                    data.chars().take(500).collect::<String>()
                ),
            },
        }
    }

    /// The canonical response: reasoning, text, tool calls in declaration order. A stream without
    /// a finish reason or without `[DONE]` is a failed, retryable call (Transient); `length`
    /// with a tool call open, a tool call without a name, or a response breaking
    /// [`cairn_ledger::validate_response`] is an invalid response.
    pub fn finish(self) -> Result<ModelResponse> {
        let Some(raw) = self.finish_reason else {
            return Err(stream_error(
                ErrorKind::Transient,
                format!(
                    "the stream ended after {} event(s){} without a finish_reason: the response is \
                     incomplete",
                    self.chunks,
                    if self.done { " and [DONE]" } else { "" }
                ),
            ));
        };
        if !self.done {
            return Err(stream_error(
                ErrorKind::Transient,
                format!(
                    "the stream ended after {} event(s) without data: [DONE] (finish_reason {raw:?} \
                     was seen): the connection was cut",
                    self.chunks
                ),
            ));
        }
        if raw == "length" {
            if let Some(call) = self.calls.last() {
                return Err(stream_error(
                    ErrorKind::InvalidResponse,
                    format!(
                        "the output limit (finish_reason \"length\") cut tool call {:?} ({}): its \
                         arguments are incomplete and it must not be executed",
                        call.name,
                        call.id.as_deref().unwrap_or("no id"),
                    ),
                ));
            }
        }
        let mut tool_uses = Vec::with_capacity(self.calls.len());
        for (position, call) in self.calls.into_iter().enumerate() {
            let id = match call.id {
                Some(id) => id,
                None => derived_tool_call_id(&self.context, position),
            };
            if call.name.is_empty() {
                return Err(stream_error(
                    ErrorKind::InvalidResponse,
                    format!(
                        "tool call {position} (index {}, id {id:?}) has no function name",
                        call.index
                    ),
                ));
            }
            tool_uses.push(ToolUse {
                id,
                name: call.name,
                arguments: call.arguments,
                signature: None,
            });
        }
        if raw == "tool_calls" && tool_uses.is_empty() {
            return Err(stream_error(
                ErrorKind::InvalidResponse,
                "finish_reason is \"tool_calls\" but no tool call was streamed".into(),
            ));
        }
        let stop_reason = match raw.as_str() {
            // Some compatible servers (older Ollama) say "stop" after tool calls.
            _ if !tool_uses.is_empty() => StopReason::ToolUse,
            "stop" => StopReason::EndTurn,
            "length" => StopReason::MaxTokens,
            "tool_calls" | "function_call" => StopReason::ToolUse,
            "content_filter" => StopReason::ContentFilter,
            _ => StopReason::Other,
        };
        let mut parts = Vec::new();
        if let Some(text) = self.reasoning {
            // Kept even when empty if the server sent the field and the response has more: a
            // DeepSeek tool-call turn must send `reasoning_content` back.
            if !text.is_empty() || !self.text.is_empty() || !tool_uses.is_empty() {
                parts.push(Part::Reasoning { text });
            }
        }
        if !self.text.is_empty() {
            parts.push(Part::text(self.text));
        }
        parts.extend(tool_uses.into_iter().map(Part::ToolUse));
        let response = ModelResponse {
            provider: PROVIDER.into(),
            model: self.model.unwrap_or(self.request_model),
            parts,
            stop_reason_raw: raw,
            stop_reason,
            usage: self.usage.unwrap_or_default(),
        };
        super::checked_response(PROVIDER, response)
    }
}

impl WireParser for StreamParser {
    const PROVIDER: &'static str = PROVIDER;
    type Decoder = SseDecoder;

    fn feed_event(&mut self, event: &SseEvent, deltas: &dyn DeltaSink) -> Result<()> {
        // Some compatible servers name their error events instead of sending an error chunk.
        if event.event == "error" {
            return Err(self.error_event(&event.data));
        }
        self.feed(&event.data, deltas)
    }

    fn is_done(&self) -> bool {
        self.done
    }

    /// The usage chunk (`stream_options.include_usage`) comes last, just before `[DONE]`.
    fn usage_so_far(&self) -> Option<Usage> {
        self.usage
    }

    fn finish(self) -> Result<ModelResponse> {
        StreamParser::finish(self)
    }
}

fn parse_usage(usage: &Value) -> Usage {
    let n = |pointer: &str| usage.pointer(pointer).and_then(Value::as_u64);
    let prompt = n("/prompt_tokens").unwrap_or(0);
    // OpenAI: prompt_tokens_details.cached_tokens; DeepSeek: prompt_cache_hit_tokens. Both are
    // part of prompt_tokens, while `input_tokens` counts the uncached rest.
    let cached = n("/prompt_tokens_details/cached_tokens")
        .or_else(|| n("/prompt_cache_hit_tokens"))
        .unwrap_or(0);
    Usage {
        input_tokens: prompt.saturating_sub(cached),
        output_tokens: n("/completion_tokens").unwrap_or(0),
        cache_read_tokens: cached,
        cache_write_tokens: 0,
        reasoning_tokens: n("/completion_tokens_details/reasoning_tokens").unwrap_or(0),
    }
}

/// Classifies an error object sent inside the stream (`data: {"error": {...}}`): OpenAI's
/// `{message, type, code, param}`, llama.cpp's numeric `code`, or a bare string.
fn classify_stream_error(error: &Value, at: usize) -> Error {
    let text = |key: &str| {
        error
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_ascii_lowercase()
    };
    let message = match error {
        Value::String(s) => s.clone(),
        _ => error
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| error.to_string(), str::to_owned),
    };
    let (kind_name, code_name) = (text("type"), text("code"));
    let status = error.get("code").and_then(Value::as_u64);
    let has = |needle: &str| kind_name.contains(needle) || code_name.contains(needle);
    let kind = if has("context_length") || super::http::is_context_too_long(&message) {
        ErrorKind::ContextTooLong
    } else if has("rate_limit") || status == Some(429) {
        ErrorKind::RateLimited
    } else if has("overloaded") || status == Some(529) || status == Some(503) {
        ErrorKind::Overloaded
    } else if has("auth")
        || has("api_key")
        || has("permission")
        || matches!(status, Some(401 | 403))
    {
        ErrorKind::Auth
    } else if has("invalid_request") || matches!(status, Some(400..=499)) {
        ErrorKind::InvalidRequest
    } else {
        // server_error and anything unknown: the stream failed mid-way; another attempt may pass.
        ErrorKind::Transient
    };
    let label = [kind_name.as_str(), code_name.as_str()]
        .iter()
        .filter(|s| !s.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    Error::Provider {
        kind,
        message: format!(
            "openai stream error event at event {at}{}: {message}",
            if label.is_empty() {
                String::new()
            } else {
                format!(" ({label})")
            }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::NoDeltas;

    #[test]
    fn env_settings_need_a_key_or_a_base_url() {
        let err = settings_from(None, None).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Auth);
        assert!(err.to_string().contains("OPENAI_API_KEY"), "{err}");
        let local = settings_from(None, Some("http://localhost:11434/v1/".into())).unwrap();
        assert_eq!(local.base_url, "http://localhost:11434/v1");
        assert_eq!(local.api_key, None);
        let openai = settings_from(Some("sk".into()), None).unwrap();
        assert_eq!(openai.base_url, DEFAULT_BASE_URL);
        assert_eq!(openai.api_key.as_deref(), Some("sk"));
    }

    #[test]
    fn dialect_follows_the_host() {
        assert_eq!(
            RenderOptions::for_base_url("https://api.openai.com/v1"),
            RenderOptions::default()
        );
        let deepseek = RenderOptions::for_base_url("https://api.deepseek.com");
        assert_eq!(deepseek.max_tokens_field, MaxTokensField::MaxTokens);
        assert!(deepseek.always_send_reasoning_content);
        let ollama = RenderOptions::for_base_url("http://localhost:11434/v1");
        assert_eq!(ollama.max_tokens_field, MaxTokensField::MaxTokens);
        assert!(!ollama.always_send_reasoning_content);
    }

    #[test]
    fn derived_ids_are_deterministic_short_and_positional() {
        let ctx = CallContext {
            session_id: "01J9Z3-some-long-session-id-with-dashes-and-more".into(),
            turn: 3,
            round: 2,
            attempt: 1,
        };
        let a = derived_tool_call_id(&ctx, 0);
        assert_eq!(a, derived_tool_call_id(&ctx, 0));
        assert_ne!(a, derived_tool_call_id(&ctx, 1));
        assert!(a.len() <= MAX_WIRE_ID_LEN, "{a}");
        assert!(a.ends_with("_3_2_1_0"), "{a}");
        assert!(a.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
    }

    #[test]
    fn in_stream_errors_are_classified() {
        let feed = |data: &str| {
            let mut p = StreamParser::new(CallContext::default(), "m");
            p.feed(data, &NoDeltas).unwrap_err()
        };
        let e = feed(r#"{"error":{"message":"boom","type":"server_error","code":null}}"#);
        assert_eq!(e.kind(), ErrorKind::Transient);
        assert!(e.to_string().contains("boom"), "{e}");
        let e = feed(r#"{"error":{"message":"slow","type":"rate_limit_exceeded"}}"#);
        assert_eq!(e.kind(), ErrorKind::RateLimited);
        let e = feed(
            r#"{"error":{"message":"ctx","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
        );
        assert_eq!(e.kind(), ErrorKind::ContextTooLong);
        let e = feed(
            r#"{"error":{"message":"This model's maximum context length is 8192 tokens","type":"invalid_request_error"}}"#,
        );
        assert_eq!(e.kind(), ErrorKind::ContextTooLong);
        let e = feed(r#"{"error":{"message":"bad role","type":"invalid_request_error"}}"#);
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        let e = feed(r#"{"error":{"code":500,"message":"llama failed","type":"server_error"}}"#);
        assert_eq!(e.kind(), ErrorKind::Transient);
        let e = feed(r#"{"error":"plain string"}"#);
        assert!(e.to_string().contains("plain string"), "{e}");
    }

    #[test]
    fn usage_subtracts_cached_tokens() {
        let u = parse_usage(&json!({
            "prompt_tokens": 100, "completion_tokens": 20,
            "prompt_tokens_details": {"cached_tokens": 60},
            "completion_tokens_details": {"reasoning_tokens": 5}
        }));
        assert_eq!(
            u,
            Usage {
                input_tokens: 40,
                output_tokens: 20,
                cache_read_tokens: 60,
                cache_write_tokens: 0,
                reasoning_tokens: 5
            }
        );
        let deepseek = parse_usage(&json!({
            "prompt_tokens": 10, "completion_tokens": 2, "prompt_cache_hit_tokens": 4
        }));
        assert_eq!(deepseek.cache_read_tokens, 4);
        assert_eq!(deepseek.input_tokens, 6);
    }
}
