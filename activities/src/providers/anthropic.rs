//! Anthropic Messages provider: renders the request from the ledger's transcript (thinking
//! blocks byte-exact and in position, tool_use `input` as the exact argument text, tool ids
//! aliased per request when Anthropic cannot take them), checks Anthropic's transcript rules as
//! pure functions before anything is sent, and parses the SSE stream strictly into one
//! canonical [`ModelResponse`].
//!
//! Wire format (Messages API, `anthropic-version: 2023-06-01`): `message_start` →
//! per block `content_block_start`, `content_block_delta`* (`text_delta`, `thinking_delta`,
//! `signature_delta`, `input_json_delta`), `content_block_stop` → `message_delta` (stop reason,
//! cumulative usage) → `message_stop`; `ping` anywhere, `error` mid-stream, unknown event types
//! ignored. Anything else out of order is a broken stream ([`Error::Stream`]), never a
//! completion.

use crate::context::ActivityContext;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{DeltaSink, ModelProvider, ModelRequest};
use crate::providers::alias::IdAliases;
use crate::providers::drive::{self, WireParser};
use crate::providers::http::HttpSettings;
use crate::providers::sse::{SseDecoder, SseEvent};
use crate::providers::{current_turn_start, prepare_transcript};
use async_trait::async_trait;
use cairn_ledger::{
    Delta, JsonText, ModelResponse, ModelSpec, Part, ProviderJson, Role, ServerToolKind,
    StopReason, ToolChoice, ToolResultContent, ToolSpec, ToolUse, Transcript, Usage,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// The provider family's name, recorded as the provenance of its responses.
pub const PROVIDER: &str = "anthropic";
/// The public API base URL, used when `ANTHROPIC_BASE_URL` is not set.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
/// The `anthropic-version` header value.
pub const API_VERSION: &str = "2023-06-01";
/// The `anthropic-beta` value sent when thinking is enabled, so the model may think between
/// tool calls (interleaved thinking).
pub const INTERLEAVED_THINKING_BETA: &str = "interleaved-thinking-2025-05-14";
/// The `anthropic-beta` value that turns on the web fetch server tool.
pub const WEB_FETCH_BETA: &str = "web-fetch-2025-09-10";
/// The server tools Anthropic offers, as cairn declares them.
pub const SERVER_TOOLS: [ServerToolKind; 2] = [ServerToolKind::WebSearch, ServerToolKind::WebFetch];
/// `max_tokens` sent when the model spec sets none.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;
/// The smallest thinking budget Anthropic accepts.
pub const MIN_THINKING_BUDGET: u32 = 1024;
/// The request path.
pub const MESSAGES_PATH: &str = "/v1/messages";

/// Prefix of the per-request aliases of tool ids Anthropic cannot take.
const ALIAS_PREFIX: &str = "cairn_alias_";

/// The Anthropic Messages API behind the [`ModelProvider`] trait.
#[derive(Debug, Clone)]
pub struct AnthropicProvider {
    settings: HttpSettings,
}

impl AnthropicProvider {
    /// A provider reaching `settings.base_url` with `settings.api_key`.
    pub fn new(settings: HttpSettings) -> Self {
        AnthropicProvider { settings }
    }

    /// A provider configured from `ANTHROPIC_API_KEY` (required), `ANTHROPIC_BASE_URL`
    /// (default [`DEFAULT_BASE_URL`]), and the optional `ANTHROPIC_IDLE_TIMEOUT_SECS` and
    /// `ANTHROPIC_MAX_EVENT_BYTES` ([`HttpSettings::with_env`]).
    pub fn from_env() -> Result<Self> {
        let key = std::env::var("ANTHROPIC_API_KEY")
            .ok()
            .filter(|k| !k.trim().is_empty())
            .ok_or_else(|| Error::Provider {
                kind: ErrorKind::Auth,
                message: "ANTHROPIC_API_KEY is not set (or empty); the anthropic provider needs an API key".into(),
            })?;
        let base_url = std::env::var("ANTHROPIC_BASE_URL")
            .ok()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_BASE_URL.to_owned());
        Ok(Self::new(
            HttpSettings::new(base_url, Some(key)).with_env("ANTHROPIC")?,
        ))
    }

    /// Where and how this provider sends its requests.
    pub fn settings(&self) -> &HttpSettings {
        &self.settings
    }
}

#[async_trait]
impl ModelProvider for AnthropicProvider {
    fn provider(&self) -> &str {
        PROVIDER
    }

    async fn call(
        &self,
        request: &ModelRequest,
        deltas: &dyn DeltaSink,
        context: &ActivityContext,
    ) -> Result<ModelResponse> {
        let (body, aliases) = render_body(request)?;
        let key = self
            .settings
            .api_key
            .clone()
            .ok_or_else(|| Error::Provider {
                kind: ErrorKind::Auth,
                message: "the anthropic provider has no API key (set ANTHROPIC_API_KEY)".into(),
            })?;
        let mut headers = vec![
            ("x-api-key", key),
            ("anthropic-version", API_VERSION.to_owned()),
            ("accept", "text/event-stream".to_owned()),
        ];
        if let Some(betas) = beta_header(request) {
            headers.push(("anthropic-beta", betas));
        }
        let parser = StreamParser::new(request.model.model.clone(), aliases);
        drive::call(
            &self.settings,
            MESSAGES_PATH,
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

/// The request body `request` renders to, as a JSON value (after Anthropic's checks).
///
/// The bytes actually sent come from [`render_body`]; they embed each tool_use `input` as the
/// exact argument text. This value is the same document parsed back, so it is exact too except
/// for numbers beyond 64-bit integers or f64, which a `serde_json::Value` cannot hold.
pub fn render(request: &ModelRequest) -> Result<Value> {
    let (body, _) = render_body(request)?;
    serde_json::from_slice(&body).map_err(|e| Error::Provider {
        kind: ErrorKind::Internal,
        message: format!("the rendered anthropic request is not JSON: {e}"),
    })
}

/// The exact request bytes for `request`, and the id aliases the response parser needs.
///
/// Runs [`prepare_transcript`], then [`check_request`], then renders. Errors are
/// non-retryable `InvalidRequest`s naming the message and part at fault.
pub fn render_body(request: &ModelRequest) -> Result<(Vec<u8>, IdAliases)> {
    let prepared = prepare_transcript(&request.transcript, PROVIDER)?;
    check_request(request)?;
    let mut aliases = IdAliases::new();
    let body = build_body(request, &prepared, &mut aliases)?;
    let bytes = serde_json::to_vec(&body).map_err(|e| Error::Provider {
        kind: ErrorKind::Internal,
        message: format!("cannot serialize the anthropic request: {e}"),
    })?;
    Ok((bytes, aliases))
}

/// Anthropic's rules on a request, as pure checks: the thinking budget, the thinking mode of
/// the current tool loop, and tools defined when the transcript has tool blocks.
pub fn check_request(request: &ModelRequest) -> Result<()> {
    check_thinking_budget(&request.model)?;
    super::call_options::check_server_tools(PROVIDER, &SERVER_TOOLS, &request.options)?;
    super::call_options::check_tool_choice(PROVIDER, &request.options, &request.tools)?;
    if request.model.thinking_budget_tokens.is_some()
        && request
            .options
            .tool_choice
            .as_ref()
            .is_some_and(ToolChoice::forces_a_call)
    {
        return Err(invalid(format!(
            "tool_choice {} forces a tool call, which Anthropic does not allow with extended thinking (only auto and none); drop the thinking budget or the tool choice",
            request.options.tool_choice.as_ref().map(ToString::to_string).unwrap_or_default()
        )));
    }
    check_loop_thinking(
        &request.transcript,
        request.model.thinking_budget_tokens.is_some(),
    )?;
    check_tools_defined(&request.transcript, &request.tools)
}

fn invalid(message: String) -> Error {
    Error::Provider {
        kind: ErrorKind::InvalidRequest,
        message,
    }
}

/// `budget_tokens` ≥ 1024 and below `max_tokens` (the spec's, or [`DEFAULT_MAX_TOKENS`]).
pub fn check_thinking_budget(spec: &ModelSpec) -> Result<()> {
    let Some(budget) = spec.thinking_budget_tokens else {
        return Ok(());
    };
    let max_tokens = spec.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if budget < MIN_THINKING_BUDGET {
        return Err(invalid(format!(
            "thinking budget_tokens {budget} is below Anthropic's minimum of {MIN_THINKING_BUDGET}"
        )));
    }
    if budget >= max_tokens {
        let source = if spec.max_tokens.is_some() {
            "the model spec's"
        } else {
            "the default"
        };
        return Err(invalid(format!(
            "thinking budget_tokens {budget} must be below max_tokens {max_tokens} ({source}); raise max_tokens or lower the budget"
        )));
    }
    Ok(())
}

/// The thinking mode must not change inside a tool loop (the messages after the last user
/// message with text): with thinking enabled, the loop's assistant turn must open with a
/// thinking or redacted_thinking block; with thinking disabled, the loop must hold none.
pub fn check_loop_thinking(transcript: &Transcript, thinking_enabled: bool) -> Result<()> {
    let start = current_turn_start(transcript);
    let in_loop = transcript
        .messages
        .iter()
        .enumerate()
        .skip(start)
        .filter(|(_, m)| m.role == Role::Assistant);
    if thinking_enabled {
        // Only the assistant message opening the loop: with interleaved thinking, later
        // messages of the loop may start with a tool_use (the model need not think again).
        if let Some((index, message)) = in_loop.into_iter().next() {
            match message.parts.first() {
                Some(Part::Thinking { .. } | Part::RedactedThinking { .. }) => {}
                first => {
                    return Err(invalid(format!(
                        "message {index} part 0: thinking is enabled, but the assistant message opening the current tool loop starts with {}, not thinking or redacted_thinking; thinking cannot be switched on inside a tool loop — finish the turn first or disable thinking",
                        first.map_or("nothing", Part::kind)
                    )));
                }
            }
        }
    } else {
        for (index, message) in in_loop {
            if let Some((part, found)) =
                message.parts.iter().enumerate().find(|(_, p)| {
                    matches!(p, Part::Thinking { .. } | Part::RedactedThinking { .. })
                })
            {
                return Err(invalid(format!(
                    "message {index} part {part}: thinking is disabled, but the current tool loop holds a {} block; thinking cannot be switched off inside a tool loop — finish the turn first or enable thinking",
                    found.kind()
                )));
            }
        }
    }
    Ok(())
}

/// Anthropic refuses tool_use or tool_result blocks in a request that defines no tools.
pub fn check_tools_defined(transcript: &Transcript, tools: &[ToolSpec]) -> Result<()> {
    if !tools.is_empty() {
        return Ok(());
    }
    for (index, message) in transcript.messages.iter().enumerate() {
        if let Some((part, found)) = message
            .parts
            .iter()
            .enumerate()
            .find(|(_, p)| matches!(p, Part::ToolUse(_) | Part::ToolResult(_)))
        {
            return Err(invalid(format!(
                "message {index} part {part}: the transcript holds a {} block but the request defines no tools; Anthropic requires tools to be defined then",
                found.kind()
            )));
        }
    }
    Ok(())
}

/// Whether Anthropic accepts `id` as a tool_use id: `^[a-zA-Z0-9_-]+$`.
pub fn acceptable_tool_id(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    max_tokens: u32,
    stream: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    system: Vec<Cached<'a>>,
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<WireToolChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<ThinkingConfig>,
}

#[derive(Serialize)]
struct ThinkingConfig {
    r#type: &'static str,
    budget_tokens: u32,
}

/// A prompt-cache breakpoint: `{"type":"ephemeral"}` (the default five-minute cache).
#[derive(Serialize, Clone, Copy)]
struct CacheControl {
    r#type: &'static str,
}

const EPHEMERAL: CacheControl = CacheControl {
    r#type: "ephemeral",
};

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireToolChoice<'a> {
    Auto,
    Any,
    None,
    Tool { name: &'a str },
}

#[derive(Serialize)]
#[serde(untagged)]
enum WireTool<'a> {
    Function {
        name: &'a str,
        description: &'a str,
        input_schema: &'a RawValue,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
    },
    /// A server tool's declaration: `{"type": VERSIONED_TYPE, "name": NAME, "max_uses": N}`.
    Server {
        r#type: &'static str,
        name: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        max_uses: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
    },
}

impl WireTool<'_> {
    fn set_cache(&mut self) {
        match self {
            WireTool::Function { cache_control, .. } | WireTool::Server { cache_control, .. } => {
                *cache_control = Some(EPHEMERAL)
            }
        }
    }
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: Vec<Cached<'a>>,
}

/// A content block as sent: a modelled block, with a cache breakpoint where the caching rule
/// puts one, or an opaque block verbatim.
#[derive(Serialize)]
#[serde(untagged)]
enum Cached<'a> {
    Block {
        #[serde(flatten)]
        block: Block<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
    },
    Raw(&'a RawValue),
}

impl<'a> Cached<'a> {
    fn block(block: Block<'a>) -> Self {
        Cached::Block {
            block,
            cache_control: None,
        }
    }

    /// Sets a breakpoint when the block can carry one (thinking and opaque blocks cannot).
    fn try_set_cache(&mut self) -> bool {
        match self {
            Cached::Block {
                block: Block::Thinking { .. } | Block::RedactedThinking { .. },
                ..
            }
            | Cached::Raw(_) => false,
            Cached::Block { cache_control, .. } => {
                *cache_control = Some(EPHEMERAL);
                true
            }
        }
    }
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Text {
        text: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        citations: Option<&'a RawValue>,
    },
    Thinking {
        thinking: &'a str,
        signature: &'a str,
    },
    RedactedThinking {
        data: &'a str,
    },
    ToolUse {
        id: String,
        name: &'a str,
        input: &'a RawValue,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        content: Option<ResultContent<'a>>,
        is_error: bool,
    },
    Image {
        source: ImageSource<'a>,
    },
    /// An image or document block built by [`super::media`], already in wire form.
    #[serde(untagged)]
    Media(Value),
}

#[derive(Serialize)]
#[serde(untagged)]
enum ResultContent<'a> {
    Text(&'a str),
    Blocks(Vec<Block<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ImageSource<'a> {
    Base64 { media_type: &'a str, data: &'a str },
    Url { url: &'a str },
}

/// The `anthropic-beta` header value `request` needs, if any: interleaved thinking when thinking
/// is enabled, web fetch when that server tool is on (comma-separated when both).
pub fn beta_header(request: &ModelRequest) -> Option<String> {
    let mut betas = Vec::new();
    if request.model.thinking_budget_tokens.is_some() {
        betas.push(INTERLEAVED_THINKING_BETA);
    }
    if request
        .options
        .server_tools
        .iter()
        .any(|t| t.kind == ServerToolKind::WebFetch)
    {
        betas.push(WEB_FETCH_BETA);
    }
    (!betas.is_empty()).then(|| betas.join(","))
}

/// The documented declaration of a server tool: its versioned `type` and its `name`.
fn server_tool_declaration(kind: ServerToolKind) -> (&'static str, &'static str) {
    match kind {
        ServerToolKind::WebSearch => ("web_search_20250305", "web_search"),
        ServerToolKind::WebFetch => ("web_fetch_20250910", "web_fetch"),
    }
}

/// Places cairn's prompt-cache breakpoints (Anthropic allows 4; this uses at most 3): on the
/// last tool (caching every tool definition), the last system block (caching tools and system
/// prompt), and the last block of the last message that can carry one (caching the whole
/// conversation, which the next call of the turn or session reads back).
fn place_cache_breakpoints(
    system: &mut [Cached<'_>],
    tools: &mut [WireTool<'_>],
    messages: &mut [WireMessage<'_>],
) {
    if let Some(tool) = tools.last_mut() {
        tool.set_cache();
    }
    if let Some(block) = system.last_mut() {
        block.try_set_cache();
    }
    if let Some(message) = messages.last_mut() {
        for block in message.content.iter_mut().rev() {
            if block.try_set_cache() {
                break;
            }
        }
    }
}

fn build_body<'a>(
    request: &'a ModelRequest,
    transcript: &'a Transcript,
    aliases: &mut IdAliases,
) -> Result<Body<'a>> {
    let spec = &request.model;
    let options = &request.options;
    let mut system = Vec::new();
    let mut messages = Vec::new();
    for (mi, message) in transcript.messages.iter().enumerate() {
        if message.role == Role::System {
            for text in super::system_texts(PROVIDER, mi, message)? {
                system.push(Cached::block(Block::Text {
                    text,
                    citations: None,
                }));
            }
            continue;
        }
        let mut content = Vec::with_capacity(message.parts.len());
        for (pi, part) in message.parts.iter().enumerate() {
            if let Some(block) = render_part(mi, pi, part, aliases)? {
                content.push(block);
            }
        }
        if content.is_empty() {
            // Only unsigned reasoning of another family was here; nothing Anthropic can read.
            continue;
        }
        messages.push(WireMessage {
            role: message.role.as_str(),
            content,
        });
    }
    let mut tools = Vec::with_capacity(request.tools.len() + options.server_tools.len());
    for (ti, tool) in request.tools.iter().enumerate() {
        let input_schema =
            serde_json::from_str::<&RawValue>(tool.input_schema.as_str()).map_err(|e| {
                invalid(format!(
                    "tool {ti} ({}): input_schema is not JSON: {e}",
                    tool.name
                ))
            })?;
        tools.push(WireTool::Function {
            name: &tool.name,
            description: &tool.description,
            input_schema,
            cache_control: None,
        });
    }
    for server in &options.server_tools {
        let (r#type, name) = server_tool_declaration(server.kind);
        tools.push(WireTool::Server {
            r#type,
            name,
            max_uses: server.max_uses,
            cache_control: None,
        });
    }
    if !options.no_prompt_cache {
        place_cache_breakpoints(&mut system, &mut tools, &mut messages);
    }
    // A choice without tools means nothing, and Anthropic takes tool_choice only with tools.
    let tool_choice = options
        .tool_choice
        .as_ref()
        .filter(|_| !tools.is_empty())
        .map(|choice| match choice {
            ToolChoice::Auto => WireToolChoice::Auto,
            ToolChoice::Any => WireToolChoice::Any,
            ToolChoice::None => WireToolChoice::None,
            ToolChoice::Tool(name) => WireToolChoice::Tool { name },
        });
    Ok(Body {
        model: &spec.model,
        max_tokens: spec.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        stream: true,
        system,
        messages,
        tools,
        tool_choice,
        thinking: spec
            .thinking_budget_tokens
            .map(|budget_tokens| ThinkingConfig {
                r#type: "enabled",
                budget_tokens,
            }),
    })
}

/// Provider JSON kept in the ledger, as the raw value sent back.
fn raw_json<'a>(mi: usize, pi: usize, what: &str, json: &'a JsonText) -> Result<&'a RawValue> {
    serde_json::from_str::<&RawValue>(json.as_str()).map_err(|e| {
        invalid(format!(
            "message {mi} part {pi}: the {what} is not JSON: {e}"
        ))
    })
}

fn render_part<'a>(
    mi: usize,
    pi: usize,
    part: &'a Part,
    aliases: &mut IdAliases,
) -> Result<Option<Cached<'a>>> {
    let block = match part {
        Part::Text {
            text, citations, ..
        } => Block::Text {
            text,
            citations: match citations.as_ref().and_then(|c| c.for_family(PROVIDER)) {
                Some(json) => Some(raw_json(mi, pi, "text's citations", json)?),
                None => None,
            },
        },
        Part::Thinking { text, signature } => Block::Thinking {
            thinking: text,
            signature,
        },
        Part::RedactedThinking { data } => Block::RedactedThinking { data },
        // Unsigned reasoning and raw reasoning items belong to other families.
        Part::Reasoning { .. } | Part::ReasoningItem { .. } => return Ok(None),
        Part::Opaque(opaque) => {
            return match opaque.for_family(PROVIDER) {
                Some(json) => Ok(Some(Cached::Raw(raw_json(mi, pi, "opaque block", json)?))),
                None => Ok(None),
            }
        }
        Part::ToolUse(tool_use) => render_tool_use(mi, pi, tool_use, aliases)?,
        Part::ToolResult(result) => Block::ToolResult {
            tool_use_id: aliases.wire_id(&result.tool_use_id, acceptable_tool_id, ALIAS_PREFIX),
            content: match &result.content {
                ToolResultContent::Text(text) if text.is_empty() => None,
                ToolResultContent::Text(text) => Some(ResultContent::Text(text)),
                ToolResultContent::Json(json) => Some(ResultContent::Blocks(vec![Block::Text {
                    text: json.as_str(),
                    citations: None,
                }])),
                ToolResultContent::Blocks(blocks) => Some(ResultContent::Blocks(
                    super::media::anthropic_tool_result(blocks)
                        .map_err(|e| {
                            invalid(format!("message {mi} part {pi}: tool_result content {e}"))
                        })?
                        .into_iter()
                        .map(Block::Media)
                        .collect(),
                )),
            },
            is_error: result.is_error,
        },
        Part::Image {
            media_type,
            data_ref,
        } => Block::Image {
            source: image_source(mi, pi, media_type, data_ref)?,
        },
        Part::Media(media) => Block::Media(
            super::media::anthropic_block(media)
                .map_err(|e| invalid(format!("message {mi} part {pi}: {e}")))?,
        ),
    };
    Ok(Some(Cached::block(block)))
}

fn render_tool_use<'a>(
    mi: usize,
    pi: usize,
    tool_use: &'a ToolUse,
    aliases: &mut IdAliases,
) -> Result<Block<'a>> {
    let input = serde_json::from_str::<&RawValue>(&tool_use.arguments).map_err(|e| {
        invalid(format!(
            "message {mi} part {pi}: the arguments of tool_use {} ({}) are not valid JSON ({e}); Anthropic needs a JSON object as input",
            tool_use.id, tool_use.name
        ))
    })?;
    if !input.get().starts_with('{') {
        return Err(invalid(format!(
            "message {mi} part {pi}: the arguments of tool_use {} ({}) are JSON but not an object; Anthropic needs a JSON object as input",
            tool_use.id, tool_use.name
        )));
    }
    Ok(Block::ToolUse {
        id: aliases.wire_id(&tool_use.id, acceptable_tool_id, ALIAS_PREFIX),
        name: &tool_use.name,
        input,
    })
}

fn image_source<'a>(
    mi: usize,
    pi: usize,
    media_type: &'a str,
    data_ref: &'a str,
) -> Result<ImageSource<'a>> {
    if data_ref.starts_with("https://") || data_ref.starts_with("http://") {
        return Ok(ImageSource::Url { url: data_ref });
    }
    if let Some(rest) = data_ref.strip_prefix("data:") {
        if let Some((_, data)) = rest.split_once(";base64,") {
            return Ok(ImageSource::Base64 { media_type, data });
        }
    }
    Err(invalid(format!(
        "message {mi} part {pi}: image data_ref {:?} is neither an http(s) URL nor a base64 data URI; the anthropic provider cannot resolve stored image references",
        data_ref.chars().take(80).collect::<String>()
    )))
}

// ---------------------------------------------------------------------------------------------
// Stream parsing
// ---------------------------------------------------------------------------------------------

fn stream_error(kind: ErrorKind, message: String) -> Error {
    Error::Stream {
        provider: PROVIDER.to_owned(),
        kind,
        message,
    }
}

fn broken(message: String) -> Error {
    stream_error(ErrorKind::InvalidResponse, message)
}

#[derive(Debug)]
enum BlockContent {
    Text(String),
    Thinking {
        text: String,
        signature: String,
    },
    Redacted(String),
    ToolUse {
        id: String,
        name: String,
        json: String,
        /// The `input` of `content_block_start`, used when no fragment arrives.
        initial: String,
    },
    /// A block cairn does not model (`server_tool_use`, `web_search_tool_result`,
    /// `web_fetch_tool_result`, or a type unknown to it), kept as it came.
    Opaque {
        /// The block's `type`.
        kind: String,
        /// The `content_block` of `content_block_start`, exactly as received.
        block: String,
        /// `input_json_delta` fragments (a server tool call's input), set as the block's
        /// `input` at `content_block_stop`.
        input: String,
    },
}

impl BlockContent {
    fn kind(&self) -> &'static str {
        match self {
            BlockContent::Text(_) => "text",
            BlockContent::Thinking { .. } => "thinking",
            BlockContent::Redacted(_) => "redacted_thinking",
            BlockContent::ToolUse { .. } => "tool_use",
            BlockContent::Opaque { .. } => "opaque",
        }
    }
}

#[derive(Debug)]
struct BlockState {
    content: BlockContent,
    open: bool,
    /// A text block's citations, each exactly as received (`content_block_start`'s, then each
    /// `citations_delta`'s).
    citations: Vec<Box<RawValue>>,
}

#[derive(Deserialize)]
struct RawBlockStart<'a> {
    #[serde(borrow)]
    content_block: &'a RawValue,
}

#[derive(Deserialize)]
struct RawTextBlock {
    #[serde(default)]
    citations: Option<Vec<Box<RawValue>>>,
}

#[derive(Deserialize)]
struct RawCitationDelta {
    delta: RawCitation,
}

#[derive(Deserialize)]
struct RawCitation {
    citation: Box<RawValue>,
}

/// A strict parser of one Anthropic Messages SSE stream, fed one event at a time.
///
/// Pure: it never touches the network; [`AnthropicProvider`] feeds it. Every protocol
/// violation is an [`Error::Stream`] saying what and where; a stream that ends before
/// `message_stop` is a retryable (`Transient`) failure.
#[derive(Debug)]
pub struct StreamParser {
    model: String,
    aliases: IdAliases,
    started: bool,
    done: bool,
    events: usize,
    blocks: Vec<BlockState>,
    stop_reason: Option<String>,
    usage: Usage,
}

impl StreamParser {
    /// A parser for a response to a request for `model`, mapping tool ids back through
    /// `aliases` (those the request was rendered with).
    pub fn new(model: impl Into<String>, aliases: IdAliases) -> Self {
        StreamParser {
            model: model.into(),
            aliases,
            started: false,
            done: false,
            events: 0,
            blocks: Vec::new(),
            stop_reason: None,
            usage: Usage::default(),
        }
    }

    /// Whether `message_stop` was seen: the response is complete.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Feeds one SSE event: its `event:` name (when empty or `message`, the data's `type` is
    /// used) and its `data:` text. Deltas go to `deltas` as they arrive.
    pub fn feed(&mut self, event: &str, data: &str, deltas: &dyn DeltaSink) -> Result<()> {
        self.events += 1;
        let at = self.events;
        let value: Value = serde_json::from_str(data).map_err(|e| {
            broken(format!(
                "event #{at} ({event:?}): data is not JSON ({e}): {}",
                data.chars().take(200).collect::<String>()
            ))
        })?;
        let name = if event.is_empty() || event == "message" {
            value.get("type").and_then(Value::as_str).unwrap_or("")
        } else {
            event
        };
        match name {
            "ping" => Ok(()),
            "error" => Err(in_stream_error(&value)),
            "message_start" => self.message_start(at, &value),
            "content_block_start" => self.block_start(at, &value, data, deltas),
            "content_block_delta" => self.block_delta(at, &value, data, deltas),
            "content_block_stop" => self.block_stop(at, &value),
            "message_delta" => self.message_delta(at, &value),
            "message_stop" => self.message_stop(at),
            other => {
                // The API may add event types; they are to be ignored.
                tracing::debug!(event = other, "anthropic: ignoring an unknown stream event");
                Ok(())
            }
        }
    }

    /// The complete response, once `message_stop` was seen.
    pub fn finish(self) -> Result<ModelResponse> {
        if !self.done {
            return Err(stream_error(
                ErrorKind::Transient,
                format!(
                    "the stream ended before message_stop (after {} events{}); the response is incomplete",
                    self.events,
                    if self.started { "" } else { ", without message_start" }
                ),
            ));
        }
        let stop_reason_raw = self.stop_reason.unwrap_or_default();
        if stop_reason_raw == "model_context_window_exceeded" {
            // The window filled while the model wrote: the answer is cut short and is not
            // committed; a compacted transcript leaves it room.
            return Err(stream_error(
                ErrorKind::ContextTooLong,
                "stop reason model_context_window_exceeded: the model's context window filled \
                 while it answered"
                    .to_owned(),
            ));
        }
        let mut parts = Vec::with_capacity(self.blocks.len());
        for block in self.blocks {
            match block.content {
                // An empty text block carries nothing and cannot be a canonical part.
                BlockContent::Text(text) if text.is_empty() => {}
                BlockContent::Text(text) if block.citations.is_empty() => {
                    parts.push(Part::text(text))
                }
                BlockContent::Text(text) => {
                    let list: Vec<&str> = block.citations.iter().map(|c| c.get()).collect();
                    let json = JsonText::parse(format!("[{}]", list.join(","))).map_err(|e| {
                        broken(format!("the citations of a text block are not JSON: {e}"))
                    })?;
                    parts.push(Part::Text {
                        text,
                        item_id: None,
                        citations: Some(ProviderJson::new(PROVIDER, json)),
                    })
                }
                BlockContent::Opaque { kind, block, .. } => {
                    let json = JsonText::parse(block)
                        .map_err(|e| broken(format!("the {kind} block is not JSON: {e}")))?;
                    parts.push(Part::Opaque(ProviderJson::new(PROVIDER, json)))
                }
                BlockContent::Thinking { text, signature } => {
                    parts.push(Part::Thinking { text, signature })
                }
                BlockContent::Redacted(data) => parts.push(Part::RedactedThinking { data }),
                BlockContent::ToolUse { id, name, json, .. } => {
                    parts.push(Part::ToolUse(ToolUse {
                        id,
                        name,
                        arguments: json,
                        signature: None,
                    }))
                }
            }
        }
        let response = ModelResponse {
            provider: PROVIDER.to_owned(),
            model: self.model,
            parts,
            stop_reason: map_stop_reason(&stop_reason_raw),
            stop_reason_raw,
            usage: self.usage,
        };
        super::checked_response(PROVIDER, response)
    }

    fn expect_open_message(&self, at: usize, name: &str) -> Result<()> {
        if !self.started {
            return Err(broken(format!("event #{at}: {name} before message_start")));
        }
        if self.done {
            return Err(broken(format!("event #{at}: {name} after message_stop")));
        }
        Ok(())
    }

    fn message_start(&mut self, at: usize, value: &Value) -> Result<()> {
        if self.started {
            return Err(broken(format!("event #{at}: a second message_start")));
        }
        self.started = true;
        let message = value
            .get("message")
            .ok_or_else(|| broken(format!("event #{at}: message_start without a message")))?;
        if let Some(model) = message.get("model").and_then(Value::as_str) {
            if !model.is_empty() {
                self.model = model.to_owned();
            }
        }
        if let Some(usage) = message.get("usage") {
            apply_usage(&mut self.usage, usage);
        }
        Ok(())
    }

    fn index(at: usize, name: &str, value: &Value) -> Result<usize> {
        value
            .get("index")
            .and_then(Value::as_u64)
            .and_then(|i| usize::try_from(i).ok())
            .ok_or_else(|| broken(format!("event #{at}: {name} without a numeric index")))
    }

    fn block_start(
        &mut self,
        at: usize,
        value: &Value,
        data: &str,
        deltas: &dyn DeltaSink,
    ) -> Result<()> {
        self.expect_open_message(at, "content_block_start")?;
        let index = Self::index(at, "content_block_start", value)?;
        if index != self.blocks.len() {
            return Err(broken(format!(
                "event #{at}: content_block_start for index {index}, expected index {}",
                self.blocks.len()
            )));
        }
        let block = value.get("content_block").ok_or_else(|| {
            broken(format!(
                "event #{at}: content_block_start {index} without a content_block"
            ))
        })?;
        let str_field = |field: &str| block.get(field).and_then(Value::as_str);
        let kind = str_field("type").unwrap_or("");
        let raw_block = || {
            serde_json::from_str::<RawBlockStart<'_>>(data)
                .map(|r| r.content_block)
                .map_err(|e| {
                    broken(format!(
                        "event #{at}: content_block_start {index}: malformed content_block: {e}"
                    ))
                })
        };
        let mut citations = Vec::new();
        let content = match kind {
            "text" => {
                let text = str_field("text").unwrap_or("").to_owned();
                if !text.is_empty() {
                    deltas.delta(Delta::Text(text.clone()));
                }
                let raw: RawTextBlock = serde_json::from_str(raw_block()?.get()).map_err(|e| {
                    broken(format!(
                        "event #{at}: text block {index}: malformed citations: {e}"
                    ))
                })?;
                citations = raw.citations.unwrap_or_default();
                BlockContent::Text(text)
            }
            "thinking" => {
                let text = str_field("thinking").unwrap_or("").to_owned();
                if !text.is_empty() {
                    deltas.delta(Delta::Thinking(text.clone()));
                }
                BlockContent::Thinking {
                    text,
                    signature: str_field("signature").unwrap_or("").to_owned(),
                }
            }
            "redacted_thinking" => {
                let data = str_field("data").filter(|d| !d.is_empty()).ok_or_else(|| {
                    broken(format!(
                        "event #{at}: redacted_thinking block {index} without data"
                    ))
                })?;
                BlockContent::Redacted(data.to_owned())
            }
            "tool_use" => {
                let id = str_field("id").filter(|s| !s.is_empty()).ok_or_else(|| {
                    broken(format!("event #{at}: tool_use block {index} without an id"))
                })?;
                let name = str_field("name").filter(|s| !s.is_empty()).ok_or_else(|| {
                    broken(format!(
                        "event #{at}: tool_use block {index} without a name"
                    ))
                })?;
                let initial = match block.get("input") {
                    Some(input) => serde_json::to_string(input).unwrap_or_default(),
                    None => String::new(),
                };
                BlockContent::ToolUse {
                    id: self.aliases.canonical_id(id),
                    name: name.to_owned(),
                    json: String::new(),
                    initial,
                }
            }
            "" => {
                return Err(broken(format!(
                    "event #{at}: content block {index} has no type"
                )))
            }
            // Server tool calls and results, and block types cairn does not know: kept whole,
            // to go back to Anthropic as they came.
            other => BlockContent::Opaque {
                kind: other.to_owned(),
                block: raw_block()?.get().to_owned(),
                input: String::new(),
            },
        };
        self.blocks.push(BlockState {
            content,
            open: true,
            citations,
        });
        Ok(())
    }

    fn open_block(&mut self, at: usize, name: &str, index: usize) -> Result<&mut BlockContent> {
        match self.blocks.get_mut(index) {
            Some(block) if block.open => Ok(&mut block.content),
            Some(_) => Err(broken(format!(
                "event #{at}: {name} for block {index}, which is already stopped"
            ))),
            None => Err(broken(format!(
                "event #{at}: {name} for block {index}, which was never started"
            ))),
        }
    }

    fn block_delta(
        &mut self,
        at: usize,
        value: &Value,
        data: &str,
        deltas: &dyn DeltaSink,
    ) -> Result<()> {
        self.expect_open_message(at, "content_block_delta")?;
        let index = Self::index(at, "content_block_delta", value)?;
        let delta = value.get("delta").ok_or_else(|| {
            broken(format!(
                "event #{at}: content_block_delta {index} without a delta"
            ))
        })?;
        let delta_type = delta.get("type").and_then(Value::as_str).unwrap_or("");
        if delta_type == "citations_delta" {
            self.open_block(at, "content_block_delta", index)?;
            let state = &mut self.blocks[index];
            if !matches!(state.content, BlockContent::Text(_)) {
                return Err(broken(format!(
                    "event #{at}: a citations_delta cannot apply to block {index}, a {} block",
                    state.content.kind()
                )));
            }
            let citation: RawCitationDelta = serde_json::from_str(data).map_err(|e| {
                broken(format!(
                    "event #{at}: citations_delta for block {index} without a citation object: {e}"
                ))
            })?;
            state.citations.push(citation.delta.citation);
            return Ok(());
        }
        let field = |name: &str| {
            delta.get(name).and_then(Value::as_str).ok_or_else(|| {
                broken(format!(
                    "event #{at}: {delta_type} for block {index} without a string {name:?}"
                ))
            })
        };
        let block = self.open_block(at, "content_block_delta", index)?;
        match (delta_type, block) {
            ("text_delta", BlockContent::Text(text)) => {
                let fragment = field("text")?;
                text.push_str(fragment);
                if !fragment.is_empty() {
                    deltas.delta(Delta::Text(fragment.to_owned()));
                }
            }
            ("thinking_delta", BlockContent::Thinking { text, .. }) => {
                let fragment = field("thinking")?;
                text.push_str(fragment);
                if !fragment.is_empty() {
                    deltas.delta(Delta::Thinking(fragment.to_owned()));
                }
            }
            ("signature_delta", BlockContent::Thinking { signature, .. }) => {
                signature.push_str(field("signature")?);
            }
            ("input_json_delta", BlockContent::Opaque { input, .. }) => {
                input.push_str(field("partial_json")?);
            }
            ("input_json_delta", BlockContent::ToolUse { id, json, .. }) => {
                let fragment = field("partial_json")?;
                json.push_str(fragment);
                if !fragment.is_empty() {
                    deltas.delta(Delta::ToolArguments {
                        tool_use_id: id.clone(),
                        fragment: fragment.to_owned(),
                    });
                }
            }
            (other, BlockContent::Opaque { kind, .. }) => {
                return Err(broken(format!(
                    "event #{at}: a {other:?} delta cannot apply to block {index}, a {kind} block kept as received; only input_json_delta can"
                )))
            }
            (other, block) => {
                return Err(broken(format!(
                    "event #{at}: a {other:?} delta cannot apply to block {index}, a {} block",
                    block.kind()
                )))
            }
        }
        Ok(())
    }

    fn block_stop(&mut self, at: usize, value: &Value) -> Result<()> {
        self.expect_open_message(at, "content_block_stop")?;
        let index = Self::index(at, "content_block_stop", value)?;
        let block = self.open_block(at, "content_block_stop", index)?;
        match block {
            BlockContent::Thinking { text, signature } if signature.is_empty() => {
                return Err(broken(format!(
                    "event #{at}: thinking block {index} ({} bytes of text) stopped without a signature; it could never be sent back",
                    text.len()
                )));
            }
            BlockContent::ToolUse {
                id,
                name,
                json,
                initial,
            } => {
                if json.is_empty() {
                    // No fragments: the start's input (`{}` when the model passed nothing).
                    *json = if initial.is_empty() {
                        "{}".to_owned()
                    } else {
                        std::mem::take(initial)
                    };
                }
                check_arguments(json).map_err(|reason| {
                    broken(format!(
                        "event #{at}: the arguments of tool_use block {index} ({id}, {name}) are not a JSON object at content_block_stop: {reason}"
                    ))
                })?;
            }
            BlockContent::Opaque { kind, block, input } if !input.is_empty() => {
                // A server tool call's input streamed in fragments: it becomes the block's
                // `input`, exactly as streamed.
                *block = super::raw_json::set_field(block, "input", input).map_err(|reason| {
                    broken(format!(
                        "event #{at}: the streamed input of {kind} block {index} does not complete the block: {reason}"
                    ))
                })?;
                input.clear();
            }
            _ => {}
        }
        if let Some(state) = self.blocks.get_mut(index) {
            state.open = false;
        }
        Ok(())
    }

    fn message_delta(&mut self, at: usize, value: &Value) -> Result<()> {
        self.expect_open_message(at, "message_delta")?;
        if let Some(reason) = value.pointer("/delta/stop_reason").and_then(Value::as_str) {
            self.stop_reason = Some(reason.to_owned());
        }
        if let Some(usage) = value.get("usage") {
            apply_usage(&mut self.usage, usage);
        }
        Ok(())
    }

    fn message_stop(&mut self, at: usize) -> Result<()> {
        self.expect_open_message(at, "message_stop")?;
        let Some(reason) = self.stop_reason.as_deref() else {
            return Err(broken(format!(
                "event #{at}: message_stop without a stop reason (no message_delta carried one)"
            )));
        };
        if reason == "max_tokens" {
            let open_tool = self
                .blocks
                .iter()
                .enumerate()
                .find(|(_, b)| b.open && matches!(b.content, BlockContent::ToolUse { .. }));
            let last_tool = self
                .blocks
                .iter()
                .enumerate()
                .rev()
                .find(|(_, b)| !matches!(&b.content, BlockContent::Text(t) if t.is_empty()))
                .filter(|(_, b)| matches!(b.content, BlockContent::ToolUse { .. }));
            if let Some((index, block)) = open_tool.or(last_tool) {
                let id = match &block.content {
                    BlockContent::ToolUse { id, .. } => id.as_str(),
                    _ => "",
                };
                return Err(broken(format!(
                    "event #{at}: the response hit max_tokens inside tool_use block {index} ({id}); the call is incomplete and must not be run"
                )));
            }
        }
        if let Some((index, block)) = self.blocks.iter().enumerate().find(|(_, b)| b.open) {
            return Err(broken(format!(
                "event #{at}: message_stop while {} block {index} is still open",
                block.content.kind()
            )));
        }
        self.done = true;
        Ok(())
    }
}

impl WireParser for StreamParser {
    const PROVIDER: &'static str = PROVIDER;
    type Decoder = SseDecoder;

    fn feed_event(&mut self, event: &SseEvent, deltas: &dyn DeltaSink) -> Result<()> {
        self.feed(&event.event, &event.data, deltas)
    }

    fn is_done(&self) -> bool {
        self.done
    }

    /// Anthropic's counts start at zero and only grow (`message_start`, then `message_delta`),
    /// so the zero before the first count is a true "so far" too.
    fn usage_so_far(&self) -> Option<Usage> {
        Some(self.usage)
    }

    fn finish(self) -> Result<ModelResponse> {
        StreamParser::finish(self)
    }
}

/// Checks that `json` is one JSON object; the reason when it is not.
fn check_arguments(json: &str) -> std::result::Result<(), String> {
    let raw = serde_json::from_str::<&RawValue>(json).map_err(|e| e.to_string())?;
    if raw.get().starts_with('{') {
        Ok(())
    } else {
        Err("valid JSON, but not an object".to_owned())
    }
}

/// Applies a usage object: each field present replaces the previous value (Anthropic's counts
/// are cumulative; the last one wins).
fn apply_usage(usage: &mut Usage, value: &Value) {
    let get = |name: &str| value.get(name).and_then(Value::as_u64);
    if let Some(n) = get("input_tokens") {
        usage.input_tokens = n;
    }
    if let Some(n) = get("output_tokens") {
        usage.output_tokens = n;
    }
    if let Some(n) = get("cache_read_input_tokens") {
        usage.cache_read_tokens = n;
    }
    if let Some(n) = get("cache_creation_input_tokens") {
        usage.cache_write_tokens = n;
    }
}

/// Anthropic's stop reason, normalized; unknown ones are [`StopReason::Other`].
pub fn map_stop_reason(raw: &str) -> StopReason {
    match raw {
        "end_turn" => StopReason::EndTurn,
        "tool_use" => StopReason::ToolUse,
        "max_tokens" => StopReason::MaxTokens,
        "stop_sequence" => StopReason::StopSequence,
        "pause_turn" => StopReason::PauseTurn,
        "refusal" => StopReason::Refusal,
        _ => StopReason::Other,
    }
}

/// An in-stream `error` event as a classified error.
fn in_stream_error(value: &Value) -> Error {
    let error_type = value
        .pointer("/error/type")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    let message = value
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("");
    let kind = match error_type {
        "invalid_request_error" if super::http::is_context_too_long(message) => {
            ErrorKind::ContextTooLong
        }
        "overloaded_error" => ErrorKind::Overloaded,
        "rate_limit_error" => ErrorKind::RateLimited,
        "timeout_error" => ErrorKind::Timeout,
        "authentication_error" | "permission_error" | "billing_error" => ErrorKind::Auth,
        "invalid_request_error" | "not_found_error" | "request_too_large" => {
            ErrorKind::InvalidRequest
        }
        // api_error, and anything new: the service failed mid-stream; another try may pass.
        _ => ErrorKind::Transient,
    };
    stream_error(kind, format!("error event {error_type}: {message}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CallContext, NoDeltas};
    use cairn_ledger::{JsonText, ToolResult};

    fn spec(max_tokens: Option<u32>, budget: Option<u32>) -> ModelSpec {
        ModelSpec {
            provider: PROVIDER.into(),
            model: "claude-test".into(),
            max_tokens,
            thinking_budget_tokens: budget,
        }
    }

    fn tool() -> ToolSpec {
        ToolSpec {
            name: "calc".into(),
            description: "adds".into(),
            input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
        }
    }

    fn response(parts: Vec<Part>) -> ModelResponse {
        ModelResponse {
            provider: PROVIDER.into(),
            model: "claude-test".into(),
            parts,
            stop_reason_raw: "tool_use".into(),
            stop_reason: StopReason::ToolUse,
            usage: Usage::default(),
        }
    }

    fn tool_use(id: &str, arguments: &str) -> Part {
        Part::ToolUse(ToolUse {
            id: id.into(),
            name: "calc".into(),
            arguments: arguments.into(),
            signature: None,
        })
    }

    /// user text, assistant (parts), tool results for its tool_uses.
    fn loop_transcript(parts: Vec<Part>) -> Transcript {
        let mut t = Transcript::new();
        t.push_user_text("go");
        let r = response(parts);
        let ids: Vec<String> = r.tool_uses().map(|t| t.id.clone()).collect();
        t.push_response(&r);
        t.push_tool_results(ids.into_iter().map(|id| ToolResult {
            tool_use_id: id,
            content: ToolResultContent::Text("3".into()),
            is_error: false,
        }));
        t
    }

    fn request(transcript: Transcript, model: ModelSpec) -> ModelRequest {
        ModelRequest {
            options: Default::default(),
            context: CallContext::default(),
            model,
            transcript: transcript.into(),
            tools: vec![tool()].into(),
        }
    }

    fn thinking() -> Part {
        Part::Thinking {
            text: "hmm".into(),
            signature: "sig".into(),
        }
    }

    #[test]
    fn toggling_thinking_inside_a_loop_is_refused_naming_message_and_part() {
        // Thinking produced, then disabled mid-loop.
        let t = loop_transcript(vec![Part::text("a"), thinking(), tool_use("t1", "{}")]);
        let err = render(&request(t, spec(None, None))).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        assert!(err.to_string().contains("message 1 part 1"), "{err}");
        assert!(err.to_string().contains("thinking is disabled"), "{err}");

        // No thinking produced, then enabled mid-loop.
        let t = loop_transcript(vec![tool_use("t1", "{}")]);
        let err = render(&request(t, spec(Some(8000), Some(2000)))).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        assert!(err.to_string().contains("message 1 part 0"), "{err}");
        assert!(err.to_string().contains("starts with tool_use"), "{err}");

        // Consistent modes pass.
        let t = loop_transcript(vec![thinking(), tool_use("t1", "{}")]);
        render(&request(t, spec(Some(8000), Some(2000)))).unwrap();
        let t = loop_transcript(vec![tool_use("t1", "{}")]);
        render(&request(t, spec(None, None))).unwrap();
    }

    #[test]
    fn thinking_in_completed_turns_does_not_matter() {
        let mut t = loop_transcript(vec![thinking(), tool_use("t1", "{}")]);
        t.push_response(&ModelResponse {
            stop_reason_raw: "end_turn".into(),
            stop_reason: StopReason::EndTurn,
            ..response(vec![Part::text("done")])
        });
        t.push_user_text("next");
        render(&request(t, spec(None, None))).unwrap();
    }

    #[test]
    fn thinking_budget_rules() {
        let t = {
            let mut t = Transcript::new();
            t.push_user_text("hi");
            t
        };
        let err = render(&request(t.clone(), spec(Some(8000), Some(1000)))).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        assert!(
            err.to_string()
                .contains("below Anthropic's minimum of 1024"),
            "{err}"
        );
        let err = render(&request(t.clone(), spec(Some(2000), Some(2000)))).unwrap_err();
        assert!(
            err.to_string().contains("must be below max_tokens 2000"),
            "{err}"
        );
        let err = render(&request(t.clone(), spec(None, Some(4096)))).unwrap_err();
        assert!(err.to_string().contains("(the default)"), "{err}");
        let body = render(&request(t, spec(None, Some(1024)))).unwrap();
        assert_eq!(body["max_tokens"], 4096);
        assert_eq!(
            body["thinking"],
            serde_json::json!({"type": "enabled", "budget_tokens": 1024})
        );
    }

    #[test]
    fn bad_arguments_and_missing_tools_are_refused() {
        let t = loop_transcript(vec![tool_use("t1", "{\"a\":")]);
        let err = render(&request(t, spec(None, None))).unwrap_err();
        assert!(err.to_string().contains("message 1 part 0"), "{err}");
        assert!(err.to_string().contains("not valid JSON"), "{err}");
        let t = loop_transcript(vec![tool_use("t1", "[1]")]);
        let err = render(&request(t, spec(None, None))).unwrap_err();
        assert!(err.to_string().contains("not an object"), "{err}");
        let t = loop_transcript(vec![tool_use("t1", "{}")]);
        let mut r = request(t, spec(None, None));
        r.tools = Vec::new().into();
        let err = render(&r).unwrap_err();
        assert!(err.to_string().contains("defines no tools"), "{err}");
    }

    #[test]
    fn odd_ids_are_aliased_and_mapped_back() {
        let t = loop_transcript(vec![tool_use("call.1:x", r#"{"n":9007199254740993}"#)]);
        let r = request(t, spec(None, None));
        let (bytes, aliases) = render_body(&r).unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.contains(r#""input":{"n":9007199254740993}"#), "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        let wire = body["messages"][1]["content"][0]["id"].as_str().unwrap();
        assert!(acceptable_tool_id(wire), "{wire}");
        assert_eq!(body["messages"][2]["content"][0]["tool_use_id"], wire);
        assert_eq!(aliases.canonical_id(wire), "call.1:x");
    }

    #[test]
    fn stop_reasons_map_and_unknown_events_are_ignored() {
        assert_eq!(map_stop_reason("pause_turn"), StopReason::PauseTurn);
        assert_eq!(map_stop_reason("refusal"), StopReason::Refusal);
        assert_eq!(map_stop_reason("something_new"), StopReason::Other);
        let mut p = StreamParser::new("m", IdAliases::new());
        p.feed(
            "brand_new_event",
            r#"{"type":"brand_new_event"}"#,
            &NoDeltas,
        )
        .unwrap();
        let err = p.feed("content_block_start", r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#, &NoDeltas).unwrap_err();
        assert!(err.to_string().contains("before message_start"), "{err}");
    }

    #[test]
    fn a_prompt_too_long_is_its_own_class() {
        let error = |message: &str| {
            let mut p = StreamParser::new("m", IdAliases::new());
            let event = serde_json::json!({
                "type": "error",
                "error": {"type": "invalid_request_error", "message": message}
            });
            p.feed("error", &event.to_string(), &NoDeltas).unwrap_err()
        };
        let err = error("prompt is too long: 210000 tokens > 200000 maximum");
        assert_eq!(err.kind(), ErrorKind::ContextTooLong);
        assert!(err.to_string().contains("210000 tokens"), "{err}");
        assert_eq!(error("messages.1: bad").kind(), ErrorKind::InvalidRequest);
        // A response cut by the window is not committed.
        let mut p = StreamParser::new("m", IdAliases::new());
        for (event, data) in [
            (
                "message_start",
                r#"{"type":"message_start","message":{"usage":{"input_tokens":5}}}"#,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hal"}}"#,
            ),
            (
                "content_block_stop",
                r#"{"type":"content_block_stop","index":0}"#,
            ),
            (
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"model_context_window_exceeded"},"usage":{"output_tokens":1}}"#,
            ),
            ("message_stop", r#"{"type":"message_stop"}"#),
        ] {
            p.feed(event, data, &NoDeltas).unwrap();
        }
        let err = p.finish().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ContextTooLong);
    }
}
