//! Amazon Bedrock Converse (`ConverseStream`): the request body rendered from the ledger alone,
//! Bedrock's transcript rules checked as pure functions, a strict parser of the stream events
//! into one canonical response, a decoder of the AWS event-stream binary framing, and SigV4
//! signing. Only [`BedrockProvider::call`] touches the network and the clock.
//!
//! Wire facts (Bedrock API reference): `POST /model/{modelId}/converse-stream`; content blocks
//! `text`, `toolUse{toolUseId, name, input}`, `toolResult{toolUseId, content:[{json}|{text}],
//! status}`, `reasoningContent{reasoningText{text, signature} | redactedContent}` (a blob, so
//! base64 in JSON); tool ids are 1–64 chars of `[a-zA-Z0-9_-]`; a request whose history has tool
//! blocks must carry `toolConfig` (`ValidationException: The toolConfig field must be defined
//! when using toolUse and toolResult content blocks`). Stream events: `messageStart`,
//! `contentBlockStart`, `contentBlockDelta`, `contentBlockStop`, `messageStop`, `metadata`, and
//! exceptions (`:message-type` `exception`, named by `:exception-type`).
//!
//! Blocks cairn does not model (a server tool's `toolUse`/`toolResult`, an `image`, a kind
//! added later) are kept as opaque parts of this family, in the shape a request's `content[]`
//! takes, and sent back verbatim in place; citations stay with their text and go back as a
//! `citationsContent` block. Another family's opaque parts and citations are dropped. Cache
//! points (`cachePoint`) follow Anthropic's rule where the model supports them
//! ([`cache_fields`]).

use crate::context::ActivityContext;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{DeltaSink, ModelProvider, ModelRequest};
use crate::providers::alias::IdAliases;
use crate::providers::drive::{self, WireDecoder, WireParser};
use crate::providers::http::{HttpSettings, DEFAULT_MAX_EVENT_BYTES};
use crate::providers::{current_turn_start, prepare_transcript};
use async_trait::async_trait;
use base64::Engine as _;
use cairn_ledger::{
    validate_transcript, Delta, JsonText, ModelResponse, Part, ProviderJson, Role, StopReason,
    ToolChoice, ToolResultBlock, ToolResultContent, Usage,
};
use serde::Serialize;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::time::SystemTime;

/// The provider family name, recorded as provenance.
pub const PROVIDER: &str = "bedrock";

/// The signing name of the Bedrock runtime service.
const SIGNING_SERVICE: &str = "bedrock";

/// The prefix of per-request id aliases (`cairn_0`, `cairn_1`, ...): itself a valid Bedrock id.
const ALIAS_PREFIX: &str = "cairn_";

/// The event-stream prelude (total length, headers length, prelude CRC) plus the message CRC.
const MIN_FRAME_BYTES: usize = 16;

/// Static AWS credentials for SigV4.
#[derive(Clone, PartialEq, Eq)]
pub struct AwsCredentials {
    /// The access key id (`AKIA...` / `ASIA...`).
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// The session token of temporary credentials.
    pub session_token: Option<String>,
}

impl std::fmt::Debug for AwsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"** redacted **")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "** redacted **"),
            )
            .finish()
    }
}

fn invalid_request(message: String) -> Error {
    Error::Provider {
        kind: ErrorKind::InvalidRequest,
        message,
    }
}

fn stream_error(kind: ErrorKind, message: String) -> Error {
    Error::Stream {
        provider: PROVIDER.into(),
        kind,
        message,
    }
}

fn protocol(message: String) -> Error {
    stream_error(ErrorKind::InvalidResponse, message)
}

// ---------------------------------------------------------------------------------------------
// Request rendering (pure)
// ---------------------------------------------------------------------------------------------

/// Whether Bedrock accepts `id` as a `toolUseId` as it is.
pub fn is_valid_tool_use_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Body<'a> {
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    system: Vec<SystemBlock<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    inference_config: Option<InferenceConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_config: Option<ToolConfig<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    additional_model_request_fields: Option<serde_json::Value>,
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: Vec<Block<'a>>,
}

/// A `system` entry: text, or a cache point after it.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
enum SystemBlock<'a> {
    Text(&'a str),
    CachePoint(CachePoint),
}

/// Converse's `CachePointBlock`, `{"type": "default"}`: everything before it in `system`,
/// `toolConfig.tools` or `messages` is a cached prefix.
#[derive(Serialize, Clone, Copy)]
struct CachePoint {
    r#type: &'static str,
}

const CACHE_POINT: CachePoint = CachePoint { r#type: "default" };

/// Where Converse takes cache points for a model: none, or `system` and `messages`, and
/// `toolConfig.tools` too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheFields {
    /// The tool definitions can be a cached prefix.
    pub tools: bool,
}

/// The cache points `model_id` accepts, by the Bedrock user guide's table of prompt-caching
/// models ("Supported models, Regions, and limits"): Claude 3.5 Haiku, 3.7 Sonnet and the
/// Claude 4 family take them in the system prompt, messages and tools; Amazon Nova Micro, Lite
/// and Pro in the system prompt and messages only. Any other model (older Claude models
/// included) gets none, since Converse refuses a `cachePoint` the model does not support.
/// Inference profiles (`us.anthropic...`, `global.anthropic...`) and ARNs name the model
/// inside the id, so the test is on the model's own name.
pub fn cache_fields(model_id: &str) -> Option<CacheFields> {
    let id = model_id.to_ascii_lowercase();
    const OLD_CLAUDE: [&str; 6] = [
        "claude-v2",
        "claude-instant",
        "claude-3-sonnet",
        "claude-3-opus",
        "claude-3-haiku",
        "claude-3-5-sonnet",
    ];
    if id.contains("anthropic.claude") {
        if OLD_CLAUDE.iter().any(|old| id.contains(old)) {
            return None;
        }
        return Some(CacheFields { tools: true });
    }
    let nova = ["amazon.nova-micro", "amazon.nova-lite", "amazon.nova-pro"];
    if nova.iter().any(|n| id.contains(n)) {
        return Some(CacheFields { tools: false });
    }
    None
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InferenceConfig {
    max_tokens: u32,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolConfig<'a> {
    tools: Vec<ToolEntry<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<WireToolChoice<'a>>,
}

/// Converse's `toolChoice` union: `{"auto": {}}`, `{"any": {}}` or `{"tool": {"name": ...}}`.
/// It has no "none".
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
enum WireToolChoice<'a> {
    Auto {},
    Any {},
    Tool { name: &'a str },
}

/// The `toolChoice` of `choice`; Converse has no way to forbid tool calls, so `none` is a typed
/// error before the call rather than a silent `auto`.
fn wire_tool_choice(choice: &ToolChoice) -> Result<WireToolChoice<'_>> {
    match choice {
        ToolChoice::Auto => Ok(WireToolChoice::Auto {}),
        ToolChoice::Any => Ok(WireToolChoice::Any {}),
        ToolChoice::Tool(name) => Ok(WireToolChoice::Tool { name }),
        ToolChoice::None => Err(invalid_request(
            "bedrock: tool_choice none cannot be expressed: Converse's toolChoice has only auto, any and tool".into(),
        )),
    }
}

/// A `toolConfig.tools` entry: a tool, or a cache point after them.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
enum ToolEntry<'a> {
    ToolSpec(ToolSpecWire<'a>),
    CachePoint(CachePoint),
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolSpecWire<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: JsonWrap<'a>,
}

#[derive(Serialize)]
struct JsonWrap<'a> {
    json: &'a RawValue,
}

/// One content block; externally tagged, so `{"text": ...}`, `{"toolUse": {...}}`, ...
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
enum Block<'a> {
    Text(&'a str),
    ToolUse(ToolUseWire<'a>),
    ToolResult(ToolResultWire<'a>),
    ReasoningContent(Reasoning<'a>),
    /// Text with the citations Bedrock attached to it, as Converse's `CitationsContentBlock`:
    /// `{"content": [{"text": ...}], "citations": [Citation, ...]}`. The stream delivers such a
    /// block as `text` deltas and `citation` deltas on one index (each `CitationsDelta` has
    /// exactly a `Citation`'s members), so keeping the text as a text part with the citations
    /// beside it rebuilds the block exactly, and leaves the text readable to everyone.
    CitationsContent {
        content: [CitationText<'a>; 1],
        citations: &'a RawValue,
    },
    CachePoint(CachePoint),
    /// An `image` or `document` block built by [`super::media`], already in wire form.
    #[serde(untagged)]
    Media(serde_json::Value),
    /// A block Bedrock sent that cairn does not model, exactly as it came.
    #[serde(untagged)]
    Raw(&'a RawValue),
}

/// Converse's `CitationGeneratedContent` union, text member.
#[derive(Serialize)]
struct CitationText<'a> {
    text: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolUseWire<'a> {
    tool_use_id: String,
    name: &'a str,
    input: &'a RawValue,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolResultWire<'a> {
    tool_use_id: String,
    content: Vec<ResultContent<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<&'static str>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
enum ResultContent<'a> {
    Json(&'a RawValue),
    Text(&'a str),
    /// An `image` or `document` member built by [`super::media`].
    #[serde(untagged)]
    Media(serde_json::Value),
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
enum Reasoning<'a> {
    ReasoningText { text: &'a str, signature: &'a str },
    RedactedContent(&'a str),
}

/// The request body for `request` as a JSON value (after Bedrock's checks). The bytes actually
/// sent come from [`render_body`], which keeps tool inputs and JSON results byte-exact.
pub fn render(request: &ModelRequest) -> Result<serde_json::Value> {
    let (body, _) = render_body(request)?;
    serde_json::from_slice(&body)
        .map_err(|e| invalid_request(format!("bedrock: rendered body is not JSON: {e}")))
}

/// The exact request body bytes for `request`, and the id aliases used in it (the stream parser
/// maps wire ids back through them).
///
/// Checks, each a non-retryable `InvalidRequest` naming the message and part: the transcript's
/// general rules ([`validate_transcript`]); with thinking enabled the current tool loop's first
/// assistant message starts with reasoning, with thinking disabled the loop has none (no toggle
/// inside a loop); an error tool result has non-empty content; tool inputs are valid JSON;
/// tool blocks in the history need tools to declare in `toolConfig`; only text, reasoning, tool
/// use, tool result, media and this family's opaque parts can be rendered.
pub fn render_body(request: &ModelRequest) -> Result<(Vec<u8>, IdAliases)> {
    let transcript = prepare_transcript(&request.transcript, PROVIDER)?;
    validate_transcript(&transcript)
        .map_err(|e| invalid_request(format!("bedrock: transcript cannot be sent: {e}")))?;
    check_thinking(request, &transcript)?;
    // Converse has no server tools cairn declares.
    super::call_options::check_server_tools(PROVIDER, &[], &request.options)?;
    super::call_options::check_tool_choice(PROVIDER, &request.options, &request.tools)?;

    let mut aliases = IdAliases::new();
    let mut system = Vec::new();
    let mut messages = Vec::new();
    let mut has_tool_blocks = false;
    for (mi, message) in transcript.messages.iter().enumerate() {
        if message.role == Role::System {
            for text in super::system_texts(PROVIDER, mi, message)? {
                system.push(SystemBlock::Text(text));
            }
            continue;
        }
        let mut content = Vec::with_capacity(message.parts.len());
        for (pi, part) in message.parts.iter().enumerate() {
            let at = || format!("bedrock: message {mi} part {pi}");
            let block = match part {
                Part::Text {
                    text,
                    citations: Some(citations),
                    ..
                } if citations.provider == PROVIDER => Block::CitationsContent {
                    content: [CitationText { text }],
                    citations: serde_json::from_str(citations.json.as_str()).map_err(|e| {
                        invalid_request(format!("{}: the text's citations are not JSON: {e}", at()))
                    })?,
                },
                // Another family's citations stay behind; the text goes.
                Part::Text { text, .. } => Block::Text(text),
                Part::Opaque(opaque) => match opaque.for_family(PROVIDER) {
                    Some(json) => Block::Raw(serde_json::from_str(json.as_str()).map_err(|e| {
                        invalid_request(format!("{}: the opaque block is not JSON: {e}", at()))
                    })?),
                    // Another family's block means nothing to Bedrock.
                    None => continue,
                },
                Part::Thinking { text, signature } => {
                    Block::ReasoningContent(Reasoning::ReasoningText { text, signature })
                }
                Part::RedactedThinking { data } => {
                    Block::ReasoningContent(Reasoning::RedactedContent(data))
                }
                Part::ToolUse(tool_use) => {
                    has_tool_blocks = true;
                    let input: &RawValue = serde_json::from_str(&tool_use.arguments).map_err(|e| {
                        invalid_request(format!(
                            "{}: tool_use {:?} has arguments that are not valid JSON ({e}); Bedrock takes the input as a JSON document",
                            at(),
                            tool_use.id
                        ))
                    })?;
                    Block::ToolUse(ToolUseWire {
                        tool_use_id: aliases.wire_id(
                            &tool_use.id,
                            is_valid_tool_use_id,
                            ALIAS_PREFIX,
                        ),
                        name: &tool_use.name,
                        input,
                    })
                }
                Part::ToolResult(result) => {
                    has_tool_blocks = true;
                    let content = match &result.content {
                        ToolResultContent::Blocks(blocks) => {
                            let mut content = Vec::with_capacity(blocks.len());
                            for (bi, block) in blocks.iter().enumerate() {
                                content.push(match block {
                                    ToolResultBlock::Text { text } => ResultContent::Text(text),
                                    ToolResultBlock::Media(media) => ResultContent::Media(
                                        super::media::bedrock_block(media).map_err(|e| {
                                            invalid_request(format!(
                                                "{}: tool_result {:?} block {bi}: {e}",
                                                at(),
                                                result.tool_use_id
                                            ))
                                        })?,
                                    ),
                                });
                            }
                            content
                        }
                        ToolResultContent::Json(json) => {
                            let raw: &RawValue =
                                serde_json::from_str(json.as_str()).map_err(|e| {
                                    invalid_request(format!(
                                        "{}: tool_result {:?} holds invalid JSON: {e}",
                                        at(),
                                        result.tool_use_id
                                    ))
                                })?;
                            // Bedrock's `json` content must be an object; other values go as text.
                            if raw.get().trim_start().starts_with('{') {
                                vec![ResultContent::Json(raw)]
                            } else {
                                vec![ResultContent::Text(json.as_str())]
                            }
                        }
                        ToolResultContent::Text(text) => {
                            if result.is_error && text.is_empty() {
                                return Err(invalid_request(format!(
                                    "{}: error tool_result {:?} has empty content; Bedrock needs content with status \"error\"",
                                    at(),
                                    result.tool_use_id
                                )));
                            }
                            vec![ResultContent::Text(text)]
                        }
                    };
                    Block::ToolResult(ToolResultWire {
                        tool_use_id: aliases.wire_id(
                            &result.tool_use_id,
                            is_valid_tool_use_id,
                            ALIAS_PREFIX,
                        ),
                        content,
                        status: result.is_error.then_some("error"),
                    })
                }
                Part::Media(media) => Block::Media(
                    super::media::bedrock_block(media)
                        .map_err(|e| invalid_request(format!("{}: {e}", at())))?,
                ),
                other => {
                    return Err(invalid_request(format!(
                        "{}: a {} part cannot be sent to Bedrock",
                        at(),
                        other.kind()
                    )))
                }
            };
            content.push(block);
        }
        // Converse wants the roles to alternate. A turn that ended without an answer (cut
        // after its tool results, cancelled, failed) leaves a user message that the next
        // person's message follows: one user message on the wire, as Anthropic's API merges
        // them itself.
        match messages.last_mut() {
            Some(WireMessage {
                role,
                content: last,
            }) if *role == message.role.as_str() => {
                last.extend(content);
            }
            _ => messages.push(WireMessage {
                role: message.role.as_str(),
                content,
            }),
        }
    }

    // The caching rule Anthropic's requests follow (see anthropic.rs): a cache point after the
    // system prompt, after the tools and at the end of the last turn, unless the session turns
    // prompt caching off; only where the model takes them.
    let caching = cache_fields(&request.model.model).filter(|_| !request.options.no_prompt_cache);
    if caching.is_some() {
        if !system.is_empty() {
            system.push(SystemBlock::CachePoint(CACHE_POINT));
        }
        if let Some(last) = messages.last_mut() {
            last.content.push(Block::CachePoint(CACHE_POINT));
        }
    }
    let tool_config = if request.tools.is_empty() {
        if has_tool_blocks {
            return Err(invalid_request(
                "bedrock: the transcript has tool_use/tool_result blocks but the request declares no tools; Bedrock requires toolConfig (with at least one tool) whenever the history has tool blocks".into(),
            ));
        }
        None
    } else {
        let mut tools = Vec::with_capacity(request.tools.len());
        for (ti, tool) in request.tools.iter().enumerate() {
            let schema: &RawValue =
                serde_json::from_str(tool.input_schema.as_str()).map_err(|e| {
                    invalid_request(format!(
                        "bedrock: tool {ti} ({:?}): input schema is not valid JSON: {e}",
                        tool.name
                    ))
                })?;
            tools.push(ToolEntry::ToolSpec(ToolSpecWire {
                name: &tool.name,
                description: &tool.description,
                input_schema: JsonWrap { json: schema },
            }));
        }
        if caching.is_some_and(|fields| fields.tools) {
            tools.push(ToolEntry::CachePoint(CACHE_POINT));
        }
        let tool_choice = match &request.options.tool_choice {
            Some(choice) => Some(wire_tool_choice(choice)?),
            None => None,
        };
        Some(ToolConfig { tools, tool_choice })
    };

    let additional_model_request_fields = request.model.thinking_budget_tokens.map(
        |budget| serde_json::json!({"thinking": {"type": "enabled", "budget_tokens": budget}}),
    );
    let body = Body {
        messages,
        system,
        inference_config: request
            .model
            .max_tokens
            .map(|max_tokens| InferenceConfig { max_tokens }),
        tool_config,
        additional_model_request_fields,
    };
    let bytes = serde_json::to_vec(&body)
        .map_err(|e| invalid_request(format!("bedrock: cannot serialize the request: {e}")))?;
    Ok((bytes, aliases))
}

/// Thinking rules: the budget's bounds, and no toggle inside the current tool loop.
fn check_thinking(request: &ModelRequest, transcript: &cairn_ledger::Transcript) -> Result<()> {
    let start = current_turn_start(transcript);
    let in_loop = || {
        transcript
            .messages
            .iter()
            .enumerate()
            .skip(start)
            .filter(|(_, m)| m.role == Role::Assistant)
    };
    match request.model.thinking_budget_tokens {
        Some(budget) => {
            if budget < 1024 {
                return Err(invalid_request(format!(
                    "bedrock: thinking budget {budget} is below the minimum of 1024 tokens"
                )));
            }
            match request.model.max_tokens {
                Some(max) if budget < max => {}
                Some(max) => {
                    return Err(invalid_request(format!(
                        "bedrock: thinking budget {budget} must be below max_tokens {max}"
                    )))
                }
                None => {
                    return Err(invalid_request(
                        "bedrock: thinking needs max_tokens set above the thinking budget".into(),
                    ))
                }
            }
            if let Some((mi, first)) = in_loop().next() {
                let starts_with_reasoning = first.parts.first().is_some_and(|p| {
                    matches!(p, Part::Thinking { .. } | Part::RedactedThinking { .. })
                });
                if !starts_with_reasoning {
                    return Err(invalid_request(format!(
                        "bedrock: message {mi} part 0: thinking is enabled but the current tool loop's first assistant message starts with {}, not thinking — the loop began with thinking disabled, and thinking cannot be toggled inside a tool loop (finish the turn first)",
                        first.parts.first().map_or("nothing", Part::kind)
                    )));
                }
            }
        }
        None => {
            for (mi, message) in in_loop() {
                if let Some(pi) = message.parts.iter().position(|p| {
                    matches!(p, Part::Thinking { .. } | Part::RedactedThinking { .. })
                }) {
                    return Err(invalid_request(format!(
                        "bedrock: message {mi} part {pi}: thinking is disabled but the current tool loop has a thinking block — the loop began with thinking enabled, and thinking cannot be toggled inside a tool loop (finish the turn first)"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// The model id as one URL path segment: everything but unreserved characters percent-encoded
/// (model ids hold `:`, ARNs `/` and `:`).
pub fn encode_model_id(model_id: &str) -> String {
    let mut out = String::with_capacity(model_id.len());
    for b in model_id.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The path of the ConverseStream operation for `model_id`.
pub fn converse_stream_path(model_id: &str) -> String {
    format!("/model/{}/converse-stream", encode_model_id(model_id))
}

// ---------------------------------------------------------------------------------------------
// SigV4 (pure: the time is an argument)
// ---------------------------------------------------------------------------------------------

/// The SigV4 headers (`authorization`, `x-amz-date`, and `x-amz-security-token` with a session
/// token) for a `POST` of `body` to `url` with `content-type: application/json`, signed at
/// `time`. The caller sends exactly these headers, that content type and that body.
pub fn sign_headers(
    credentials: &AwsCredentials,
    region: &str,
    url: &str,
    body: &[u8],
    time: SystemTime,
) -> Result<Vec<(String, String)>> {
    use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
    let parsed = reqwest::Url::parse(url)
        .map_err(|e| invalid_request(format!("bedrock: cannot sign: bad URL {url:?}: {e}")))?;
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid_request(format!(
            "bedrock: cannot sign: URL {url:?} has no host"
        )));
    }
    let identity = aws_credential_types::Credentials::new(
        credentials.access_key_id.clone(),
        credentials.secret_access_key.clone(),
        credentials.session_token.clone(),
        None,
        "cairn",
    )
    .into();
    let params = aws_sigv4::sign::v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(SIGNING_SERVICE)
        .time(time)
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| invalid_request(format!("bedrock: cannot sign: {e}")))?
        .into();
    let signable = SignableRequest::new(
        "POST",
        url,
        [("content-type", "application/json")].into_iter(),
        SignableBody::Bytes(body),
    )
    .map_err(|e| invalid_request(format!("bedrock: cannot sign request to {url}: {e}")))?;
    let (instructions, _signature) = sign(signable, &params)
        .map_err(|e| invalid_request(format!("bedrock: cannot sign request to {url}: {e}")))?
        .into_parts();
    Ok(instructions
        .headers()
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Event-stream framing (pure)
// ---------------------------------------------------------------------------------------------

/// One decoded event-stream message, as the stream parser wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireEvent {
    /// The `:event-type` of an event, or the `:exception-type` of an exception.
    pub event_type: String,
    /// The JSON payload.
    pub payload: bytes::Bytes,
}

/// Accumulates the response bytes and decodes complete event-stream frames (CRC-checked).
///
/// A frame declaring more than the cap ([`HttpSettings::max_event_bytes`], by default the AWS
/// limit of 16 MiB) is refused with [`Error::EventTooLarge`] as soon as its prelude arrives,
/// so it is never buffered. Each byte is copied a bounded number of times: decoded frames are
/// skipped by an offset, and the buffer is compacted once per pushed chunk.
#[derive(Debug)]
pub struct FrameDecoder {
    buffer: Vec<u8>,
    /// Start of the first undecoded frame in `buffer`.
    start: usize,
    /// Stream offset of `buffer[start]`, for error messages.
    offset: u64,
    max_frame_bytes: usize,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    /// An empty decoder with the default cap ([`DEFAULT_MAX_EVENT_BYTES`]).
    pub fn new() -> Self {
        Self::with_max_frame_bytes(DEFAULT_MAX_EVENT_BYTES)
    }

    /// An empty decoder refusing frames over `max_frame_bytes`.
    pub fn with_max_frame_bytes(max_frame_bytes: usize) -> Self {
        FrameDecoder {
            buffer: Vec::new(),
            start: 0,
            offset: 0,
            max_frame_bytes,
        }
    }

    /// Appends a chunk of the response body.
    pub fn push(&mut self, chunk: &[u8]) {
        if self.start > 0 {
            // What is left is at most one partial frame: cheap to move, and moving it once per
            // chunk (not once per frame) keeps many small frames in one chunk linear.
            self.buffer.drain(..self.start);
            self.start = 0;
        }
        self.buffer.extend_from_slice(chunk);
    }

    /// The next complete event, `None` until more bytes arrive. An `error` message (`:error-code`)
    /// becomes a transient stream error; a corrupt frame an `InvalidResponse` stream error; a
    /// frame over the cap an [`Error::EventTooLarge`].
    pub fn next_event(&mut self) -> Result<Option<WireEvent>> {
        use aws_smithy_eventstream::frame::read_message_from;
        let rest = &self.buffer[self.start..];
        let Some(prelude) = rest.get(..4) else {
            return Ok(None);
        };
        let total = u32::from_be_bytes([prelude[0], prelude[1], prelude[2], prelude[3]]) as usize;
        if total > self.max_frame_bytes {
            return Err(Error::EventTooLarge {
                provider: PROVIDER.into(),
                limit_bytes: self.max_frame_bytes,
                what: format!(
                    "the event-stream frame at byte {} (declaring {total} bytes)",
                    self.offset
                ),
            });
        }
        if total < MIN_FRAME_BYTES {
            return Err(protocol(format!(
                "event-stream frame at byte {} declares {total} bytes, less than the {MIN_FRAME_BYTES} of an empty frame",
                self.offset
            )));
        }
        if rest.len() < total {
            return Ok(None);
        }
        let at = self.offset;
        let message = read_message_from(&rest[..total])
            .map_err(|e| protocol(format!("corrupt event-stream frame at byte {at}: {e}")))?;
        self.start += total;
        self.offset += total as u64;

        let header = |name: &str| {
            message
                .headers()
                .iter()
                .find(|h| h.name().as_str() == name)
                .and_then(|h| h.value().as_string().ok())
                .map(|s| s.as_str().to_owned())
        };
        let message_type = header(":message-type").unwrap_or_else(|| "event".into());
        let event_type = match message_type.as_str() {
            "event" => header(":event-type"),
            "exception" => header(":exception-type"),
            "error" => {
                return Err(stream_error(
                    ErrorKind::Transient,
                    format!(
                        "error message at byte {at}: {}: {}",
                        header(":error-code").unwrap_or_default(),
                        header(":error-message").unwrap_or_default()
                    ),
                ))
            }
            other => {
                return Err(protocol(format!(
                    "event-stream frame at byte {at} has unknown :message-type {other:?}"
                )))
            }
        };
        let event_type = event_type.ok_or_else(|| {
            protocol(format!(
                "event-stream {message_type} at byte {at} has no type header"
            ))
        })?;
        Ok(Some(WireEvent {
            event_type,
            payload: message.payload().clone(),
        }))
    }

    /// Checks that the body ended on a frame boundary.
    pub fn finish(&self) -> Result<()> {
        let left = self.buffer.len() - self.start;
        if left == 0 {
            Ok(())
        } else {
            Err(stream_error(
                ErrorKind::Transient,
                format!(
                    "stream ended inside an event-stream frame ({left} bytes left at byte {})",
                    self.offset
                ),
            ))
        }
    }
}

impl WireDecoder for FrameDecoder {
    type Event = WireEvent;

    /// Frame errors name the Bedrock provider whatever `_provider` says: this framing is AWS's.
    fn with_cap(_provider: &str, max_event_bytes: usize) -> Self {
        FrameDecoder::with_max_frame_bytes(max_event_bytes)
    }

    fn push(&mut self, chunk: &[u8]) -> Result<()> {
        FrameDecoder::push(self, chunk);
        Ok(())
    }

    fn next_event(&mut self) -> Result<Option<WireEvent>> {
        FrameDecoder::next_event(self)
    }

    fn finish(&mut self) -> Result<()> {
        FrameDecoder::finish(self)
    }
}

// ---------------------------------------------------------------------------------------------
// Stream parser (pure)
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
enum BlockState {
    Text {
        text: String,
        /// The block's `citation` deltas, each exactly as received. A `CitationsDelta` has the
        /// members of a `Citation` (`title`, `source`, `sourceContent: [{text}]`, `location`),
        /// so the list is, as it is, the `citations` of the `citationsContent` block that goes
        /// back (see [`Block::CitationsContent`]).
        citations: Vec<Box<RawValue>>,
    },
    Reasoning {
        text: String,
        signature: String,
        redacted: Vec<u8>,
    },
    ToolUse {
        id: String,
        name: String,
        input: String,
    },
    /// A block cairn does not model, kept to go back to Bedrock as it came: a server tool's
    /// call (`toolUse` whose start has `type: "server_tool_use"`) or result (`toolResult`), an
    /// `image`, or a start or delta kind added to the API later.
    Opaque {
        /// The content-block union member: `toolUse`, `toolResult`, `image`, ...
        kind: String,
        /// The member's value so far, as exact JSON text: the start's, then extended by each
        /// delta of the same kind ([`super::raw_json::extend`]); `None` before the first.
        body: Option<String>,
        /// A server tool call's `toolUse.input` fragments, set as the block's `input` at the
        /// stop (as a function call's are).
        input: String,
        /// A `toolResult` block's delta items (`ToolResultBlockDelta`: `{text}` or `{json}`, the
        /// members a `ToolResultContentBlock` has), set as the block's `content` at the stop.
        content: Vec<Box<RawValue>>,
    },
}

impl BlockState {
    fn kind(&self) -> &'static str {
        match self {
            BlockState::Text { .. } => "text",
            BlockState::Reasoning { .. } => "reasoningContent",
            BlockState::ToolUse { .. } => "toolUse",
            BlockState::Opaque { .. } => "opaque",
        }
    }

    fn opaque(kind: &str, body: Option<String>) -> Self {
        BlockState::Opaque {
            kind: kind.to_owned(),
            body,
            input: String::new(),
            content: Vec::new(),
        }
    }
}

/// The one member of the union `field` of an event's payload, with its value's exact text.
fn union_member(payload: &[u8], field: &str, where_: &str) -> Result<(String, Box<RawValue>)> {
    let text = std::str::from_utf8(payload)
        .map_err(|e| protocol(format!("{where_}: payload is not UTF-8: {e}")))?;
    let outer = super::raw_json::members(text)
        .map_err(|reason| protocol(format!("{where_}: payload is {reason}")))?;
    let value = outer
        .into_iter()
        .find(|(k, _)| k == field)
        .map(|(_, v)| v)
        .ok_or_else(|| protocol(format!("{where_}: missing {field:?}")))?;
    let mut inner = super::raw_json::members(value.get())
        .map_err(|reason| protocol(format!("{where_}: {field:?} is {reason}")))?;
    if inner.len() != 1 {
        return Err(protocol(format!(
            "{where_}: {field} must have exactly one member, found {}",
            inner.len()
        )));
    }
    Ok(inner.remove(0))
}

#[derive(Debug)]
struct OpenBlock {
    state: BlockState,
    stopped: bool,
}

/// A strict parser of ConverseStream events into one canonical response.
#[derive(Debug)]
pub struct StreamParser {
    model: String,
    aliases: IdAliases,
    started: bool,
    blocks: BTreeMap<u64, OpenBlock>,
    stop_reason: Option<String>,
    usage: Option<Usage>,
}

fn payload_json(event_type: &str, payload: &[u8]) -> Result<serde_json::Value> {
    serde_json::from_slice(payload)
        .map_err(|e| protocol(format!("{event_type} payload is not JSON: {e}")))
}

fn block_index(event_type: &str, value: &serde_json::Value) -> Result<u64> {
    value
        .get("contentBlockIndex")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| protocol(format!("{event_type} without a contentBlockIndex")))
}

fn string_field<'v>(value: &'v serde_json::Value, field: &str, where_: &str) -> Result<&'v str> {
    value
        .get(field)
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| protocol(format!("{where_}: missing string {field:?}")))
}

/// The retry class of an in-stream exception.
fn exception_kind(exception_type: &str) -> ErrorKind {
    match exception_type {
        "throttlingException" => ErrorKind::RateLimited,
        "validationException" => ErrorKind::InvalidRequest,
        "serviceUnavailableException" | "internalServerException" | "modelStreamErrorException" => {
            ErrorKind::Transient
        }
        _ => ErrorKind::Transient,
    }
}

/// Bedrock's stop reason, normalized.
pub fn map_stop_reason(raw: &str) -> StopReason {
    match raw {
        "end_turn" => StopReason::EndTurn,
        "tool_use" => StopReason::ToolUse,
        "max_tokens" => StopReason::MaxTokens,
        "stop_sequence" => StopReason::StopSequence,
        "guardrail_intervened" | "content_filtered" => StopReason::ContentFilter,
        _ => StopReason::Other,
    }
}

impl StreamParser {
    /// A parser for a response of `model`, mapping wire tool ids back through `aliases` (the
    /// ones [`render_body`] used for the request).
    pub fn new(model: impl Into<String>, aliases: IdAliases) -> Self {
        StreamParser {
            model: model.into(),
            aliases,
            started: false,
            blocks: BTreeMap::new(),
            stop_reason: None,
            usage: None,
        }
    }

    /// Feeds one event (`:event-type`, or `:exception-type` for exceptions) with its JSON
    /// payload; emits deltas for text, reasoning text and tool input fragments.
    pub fn feed(&mut self, event_type: &str, payload: &[u8], deltas: &dyn DeltaSink) -> Result<()> {
        if event_type.ends_with("Exception") {
            let message = serde_json::from_slice::<serde_json::Value>(payload)
                .ok()
                .and_then(|v| {
                    v.get("message")
                        .or_else(|| v.get("Message"))
                        .and_then(serde_json::Value::as_str)
                        .map(str::to_owned)
                })
                .unwrap_or_else(|| String::from_utf8_lossy(payload).chars().take(500).collect());
            let kind = match exception_kind(event_type) {
                ErrorKind::InvalidRequest if super::http::is_context_too_long(&message) => {
                    ErrorKind::ContextTooLong
                }
                kind => kind,
            };
            return Err(stream_error(kind, format!("{event_type}: {message}")));
        }
        let known = matches!(
            event_type,
            "messageStart"
                | "contentBlockStart"
                | "contentBlockDelta"
                | "contentBlockStop"
                | "messageStop"
                | "metadata"
        );
        if !known {
            // Events added to the API later carry nothing the canonical response holds.
            return Ok(());
        }
        let value = payload_json(event_type, payload)?;
        if event_type != "messageStart" && !self.started {
            return Err(protocol(format!("{event_type} before messageStart")));
        }
        if self.stop_reason.is_some() && event_type != "metadata" {
            return Err(protocol(format!("{event_type} after messageStop")));
        }
        match event_type {
            "messageStart" => {
                if self.started {
                    return Err(protocol("a second messageStart".into()));
                }
                let role = string_field(&value, "role", "messageStart")?;
                if role != "assistant" {
                    return Err(protocol(format!(
                        "messageStart with role {role:?}, expected \"assistant\""
                    )));
                }
                self.started = true;
            }
            "contentBlockStart" => self.block_start(&value, payload)?,
            "contentBlockDelta" => self.block_delta(&value, payload, deltas)?,
            "contentBlockStop" => self.block_stop(&value)?,
            "messageStop" => {
                let raw = string_field(&value, "stopReason", "messageStop")?;
                if raw == "max_tokens" {
                    if let Some((index, _)) = self
                        .blocks
                        .iter()
                        .find(|(_, b)| !b.stopped && matches!(b.state, BlockState::ToolUse { .. }))
                    {
                        return Err(protocol(format!(
                            "stopReason max_tokens inside toolUse block {index}: the call's input is incomplete and cannot be run"
                        )));
                    }
                }
                if let Some((index, block)) = self.blocks.iter().find(|(_, b)| !b.stopped) {
                    return Err(protocol(format!(
                        "messageStop while {} block {index} has no contentBlockStop",
                        block.state.kind()
                    )));
                }
                self.stop_reason = Some(raw.to_owned());
            }
            "metadata" => {
                if self.usage.is_some() {
                    return Err(protocol("a second metadata event".into()));
                }
                let usage = value
                    .get("usage")
                    .ok_or_else(|| protocol("metadata without usage".into()))?;
                let tokens = |field: &str| {
                    usage
                        .get(field)
                        .and_then(serde_json::Value::as_u64)
                        .unwrap_or(0)
                };
                self.usage = Some(Usage {
                    input_tokens: tokens("inputTokens"),
                    output_tokens: tokens("outputTokens"),
                    cache_read_tokens: tokens("cacheReadInputTokens"),
                    cache_write_tokens: tokens("cacheWriteInputTokens"),
                    reasoning_tokens: 0,
                });
            }
            _ => {}
        }
        Ok(())
    }

    /// A block's start. Converse's `ContentBlockStart` union has the members `toolUse`
    /// (`toolUseId`, `name`, optional `type`: `server_tool_use`), `toolResult` (`toolUseId`,
    /// optional `type` and `status`) and `image` (`format`) — AWS SDK models, e.g.
    /// `aws-sdk-bedrockruntime` `types.rb` and `@aws-sdk/client-bedrock-runtime`. A function call
    /// is modelled; every other start (a server tool's call or result, an image, a member added
    /// later) opens an opaque block holding the member exactly as received.
    fn block_start(&mut self, value: &serde_json::Value, payload: &[u8]) -> Result<()> {
        let index = block_index("contentBlockStart", value)?;
        let where_ = format!("contentBlockStart {index}");
        if self.blocks.contains_key(&index) {
            return Err(protocol(format!("{where_}: block {index} already exists")));
        }
        let (kind, body) = union_member(payload, "start", &where_)?;
        let tool_use = value.pointer("/start/toolUse");
        // Only a call cairn runs is a `ToolUse` part; a server tool's call is Bedrock's own.
        let function_call = tool_use.is_some_and(|t| match t.get("type") {
            None | Some(serde_json::Value::Null) => true,
            Some(kind) => kind.as_str() == Some("tool_use"),
        });
        let Some(tool_use) = tool_use.filter(|_| kind == "toolUse" && function_call) else {
            tracing::debug!(%where_, %kind, "bedrock: keeping a block cairn does not model as opaque");
            self.blocks.insert(
                index,
                OpenBlock {
                    state: BlockState::opaque(&kind, Some(body.get().to_owned())),
                    stopped: false,
                },
            );
            return Ok(());
        };
        let wire_id = string_field(tool_use, "toolUseId", &where_)?;
        let name = string_field(tool_use, "name", &where_)?;
        if wire_id.is_empty() || name.is_empty() {
            return Err(protocol(format!(
                "{where_}: toolUse with an empty toolUseId or name"
            )));
        }
        let id = self.aliases.canonical_id(wire_id);
        if self
            .blocks
            .values()
            .any(|b| matches!(&b.state, BlockState::ToolUse { id: other, .. } if *other == id))
        {
            return Err(protocol(format!(
                "{where_}: duplicate toolUseId {wire_id:?}"
            )));
        }
        self.blocks.insert(
            index,
            OpenBlock {
                state: BlockState::ToolUse {
                    id,
                    name: name.to_owned(),
                    input: String::new(),
                },
                stopped: false,
            },
        );
        Ok(())
    }

    /// A delta. Converse's `ContentBlockDelta` union has the members `text`, `toolUse`
    /// (`{input}`), `toolResult` (a list of `{text}` / `{json}`), `reasoningContent` (`text`,
    /// `signature` or `redactedContent`), `citation` (a `CitationsDelta`) and `image` — the
    /// same AWS SDK models as [`Self::block_start`]. Citations attach to the text block they
    /// annotate; a kind cairn does not model extends an opaque block of that kind.
    fn block_delta(
        &mut self,
        value: &serde_json::Value,
        payload: &[u8],
        deltas: &dyn DeltaSink,
    ) -> Result<()> {
        let index = block_index("contentBlockDelta", value)?;
        let where_ = format!("contentBlockDelta {index}");
        let (kind, raw) = union_member(payload, "delta", &where_)?;
        let body = value
            .pointer("/delta")
            .and_then(|d| d.get(&kind))
            .ok_or_else(|| protocol(format!("{where_}: missing \"delta\" object")))?;
        let block = match self.blocks.entry(index) {
            std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::btree_map::Entry::Vacant(entry) => {
                let state = match kind.as_str() {
                    // A citation may come before the text it annotates.
                    "text" | "citation" => BlockState::Text {
                        text: String::new(),
                        citations: Vec::new(),
                    },
                    "reasoningContent" => BlockState::Reasoning {
                        text: String::new(),
                        signature: String::new(),
                        redacted: Vec::new(),
                    },
                    "toolUse" => {
                        return Err(protocol(format!(
                            "{where_}: toolUse delta before its contentBlockStart"
                        )))
                    }
                    other => {
                        tracing::debug!(%where_, kind = other, "bedrock: keeping a delta kind cairn does not model as an opaque block");
                        BlockState::opaque(other, None)
                    }
                };
                entry.insert(OpenBlock {
                    state,
                    stopped: false,
                })
            }
        };
        if block.stopped {
            return Err(protocol(format!(
                "{where_}: delta after the block's contentBlockStop"
            )));
        }
        match (kind.as_str(), &mut block.state) {
            ("text", BlockState::Text { text, .. }) => {
                let fragment = body
                    .as_str()
                    .ok_or_else(|| protocol(format!("{where_}: text delta is not a string")))?;
                text.push_str(fragment);
                if !fragment.is_empty() {
                    deltas.delta(Delta::Text(fragment.to_owned()));
                }
            }
            ("citation", BlockState::Text { citations, .. }) => {
                if !body.is_object() {
                    return Err(protocol(format!(
                        "{where_}: citation delta is not an object"
                    )));
                }
                citations.push(raw);
            }
            ("toolUse", BlockState::ToolUse { id, input, .. }) => {
                let fragment = string_field(body, "input", &where_)?;
                input.push_str(fragment);
                if !fragment.is_empty() {
                    deltas.delta(Delta::ToolArguments {
                        tool_use_id: id.clone(),
                        fragment: fragment.to_owned(),
                    });
                }
            }
            (
                "reasoningContent",
                BlockState::Reasoning {
                    text,
                    signature,
                    redacted,
                },
            ) => {
                let members = body.as_object().ok_or_else(|| {
                    protocol(format!("{where_}: reasoningContent delta is not an object"))
                })?;
                for (member, value) in members {
                    let fragment = value.as_str().ok_or_else(|| {
                        protocol(format!(
                            "{where_}: reasoningContent.{member} is not a string"
                        ))
                    })?;
                    match member.as_str() {
                        "text" => {
                            text.push_str(fragment);
                            if !fragment.is_empty() {
                                deltas.delta(Delta::Thinking(fragment.to_owned()));
                            }
                        }
                        "signature" => signature.push_str(fragment),
                        "redactedContent" => {
                            let bytes = base64::engine::general_purpose::STANDARD
                                .decode(fragment)
                                .map_err(|e| {
                                    protocol(format!(
                                        "{where_}: redactedContent is not base64: {e}"
                                    ))
                                })?;
                            redacted.extend_from_slice(&bytes);
                        }
                        other => {
                            return Err(protocol(format!(
                                "{where_}: unsupported reasoningContent member {other:?}"
                            )))
                        }
                    }
                }
            }
            (
                "toolUse",
                BlockState::Opaque {
                    kind: open, input, ..
                },
            ) if open == "toolUse" => {
                input.push_str(string_field(body, "input", &where_)?);
            }
            (
                "toolResult",
                BlockState::Opaque {
                    kind: open,
                    content,
                    ..
                },
            ) if open == "toolResult" => {
                let items: Vec<Box<RawValue>> = serde_json::from_str(raw.get()).map_err(|e| {
                    protocol(format!("{where_}: toolResult delta is not a list: {e}"))
                })?;
                content.extend(items);
            }
            (
                delta,
                BlockState::Opaque {
                    kind: open, body, ..
                },
            ) if delta == open.as_str() => {
                *body = Some(match body.take() {
                    None => raw.get().to_owned(),
                    Some(so_far) => {
                        super::raw_json::extend(&so_far, raw.get()).map_err(|reason| {
                            protocol(format!(
                                "{where_}: the {delta} delta does not extend its block: {reason}"
                            ))
                        })?
                    }
                });
            }
            (delta, BlockState::Opaque { kind: open, .. }) => {
                return Err(protocol(format!(
                    "{where_}: {delta} delta for the opaque {open} block"
                )))
            }
            (delta, state) => {
                return Err(protocol(format!(
                    "{where_}: {delta} delta for a {} block",
                    state.kind()
                )))
            }
        }
        Ok(())
    }

    fn block_stop(&mut self, value: &serde_json::Value) -> Result<()> {
        let index = block_index("contentBlockStop", value)?;
        let where_ = format!("contentBlockStop {index}");
        let Some(block) = self.blocks.get_mut(&index) else {
            return Err(protocol(format!("{where_}: no such block")));
        };
        if block.stopped {
            return Err(protocol(format!("{where_}: block already stopped")));
        }
        block.stopped = true;
        match &mut block.state {
            BlockState::ToolUse { id, input, .. } => {
                if input.is_empty() {
                    // No input fragments: the call takes no arguments.
                    input.push_str("{}");
                }
                if let Err(e) = serde_json::from_str::<&RawValue>(input) {
                    return Err(protocol(format!(
                        "{where_}: toolUse {id:?} input is not valid JSON ({e}): {input}"
                    )));
                }
            }
            BlockState::Reasoning {
                text,
                signature,
                redacted,
            } => {
                if !redacted.is_empty() && (!text.is_empty() || !signature.is_empty()) {
                    return Err(protocol(format!(
                        "{where_}: reasoning block mixes redactedContent with text/signature"
                    )));
                }
                if redacted.is_empty() && signature.is_empty() {
                    return Err(protocol(format!(
                        "{where_}: reasoning text without a signature cannot be sent back"
                    )));
                }
            }
            BlockState::Opaque {
                kind,
                body,
                input,
                content,
            } => {
                let Some(so_far) = body.as_deref() else {
                    return Err(protocol(format!("{where_}: {kind} block has no content")));
                };
                // The fields a server tool's call and result stream in pieces become the
                // block's own, as in Converse's `ToolUseBlock` and `ToolResultBlock`.
                let completed = if kind == "toolUse" {
                    if input.is_empty() {
                        input.push_str("{}");
                    }
                    if let Err(e) = serde_json::from_str::<&RawValue>(input) {
                        return Err(protocol(format!(
                            "{where_}: server toolUse input is not valid JSON ({e}): {input}"
                        )));
                    }
                    Some(super::raw_json::set_field(so_far, "input", input))
                } else if kind == "toolResult" && !content.is_empty() {
                    let items: Vec<&str> = content.iter().map(|c| c.get()).collect();
                    let list = format!("[{}]", items.join(","));
                    Some(super::raw_json::set_field(so_far, "content", &list))
                } else {
                    None
                };
                if let Some(completed) = completed {
                    *body = Some(completed.map_err(|reason| {
                        protocol(format!(
                            "{where_}: the streamed fields of the {kind} block do not complete it: {reason}"
                        ))
                    })?);
                }
            }
            BlockState::Text { .. } => {}
        }
        Ok(())
    }

    /// The canonical response, once the stream has ended. A stream without `messageStop` is a
    /// transient failure, never a completion; the response must pass [`cairn_ledger::validate_response`].
    pub fn finish(self) -> Result<ModelResponse> {
        let Some(stop_reason_raw) = self.stop_reason else {
            let open = self
                .blocks
                .iter()
                .find(|(_, b)| !b.stopped)
                .map(|(i, b)| format!(" ({} block {i} still open)", b.state.kind()))
                .unwrap_or_default();
            return Err(stream_error(
                ErrorKind::Transient,
                format!("stream ended before messageStop{open}"),
            ));
        };
        if stop_reason_raw == "model_context_window_exceeded" {
            // The window filled while the model wrote: what it wrote is cut short and cannot
            // be committed as an answer; a compacted transcript leaves it room.
            return Err(stream_error(
                ErrorKind::ContextTooLong,
                "stop reason model_context_window_exceeded: the model's context window \
                 filled while it answered"
                    .to_owned(),
            ));
        }
        let stop_reason = map_stop_reason(&stop_reason_raw);
        let mut parts = Vec::with_capacity(self.blocks.len());
        for (_, block) in self.blocks {
            match block.state {
                BlockState::Text { text, citations } => {
                    let list: Vec<&str> = citations.iter().map(|c| c.get()).collect();
                    let list = format!("[{}]", list.join(","));
                    if citations.is_empty() {
                        // An empty text block carries nothing and cannot be a canonical part.
                        if !text.is_empty() {
                            parts.push(Part::text(text));
                        }
                    } else if text.is_empty() {
                        // Citations without generated text: kept whole, as the block they
                        // would go back as.
                        let json = format!(
                            r#"{{"citationsContent":{{"content":[],"citations":{list}}}}}"#
                        );
                        parts.push(Part::Opaque(ProviderJson::new(
                            PROVIDER,
                            JsonText::parse(json).map_err(|e| {
                                protocol(format!("the citations of a block are not JSON: {e}"))
                            })?,
                        )));
                    } else {
                        parts.push(Part::Text {
                            text,
                            item_id: None,
                            citations: Some(ProviderJson::new(
                                PROVIDER,
                                JsonText::parse(list).map_err(|e| {
                                    protocol(format!(
                                        "the citations of a text block are not JSON: {e}"
                                    ))
                                })?,
                            )),
                        });
                    }
                }
                BlockState::Opaque { kind, body, .. } => {
                    // Stopped blocks always have a body; `messageStop` refuses open ones.
                    let body = body.unwrap_or_default();
                    let key = serde_json::to_string(&kind).unwrap_or_default();
                    let json = JsonText::parse(format!("{{{key}:{body}}}"))
                        .map_err(|e| protocol(format!("the {kind} block is not JSON: {e}")))?;
                    parts.push(Part::Opaque(ProviderJson::new(PROVIDER, json)));
                }
                BlockState::Reasoning {
                    text,
                    signature,
                    redacted,
                } => {
                    if redacted.is_empty() {
                        parts.push(Part::Thinking { text, signature });
                    } else {
                        parts.push(Part::RedactedThinking {
                            data: base64::engine::general_purpose::STANDARD.encode(redacted),
                        });
                    }
                }
                BlockState::ToolUse { id, name, input } => {
                    parts.push(Part::ToolUse(cairn_ledger::ToolUse {
                        id,
                        name,
                        arguments: input,
                        signature: None,
                    }));
                }
            }
        }
        if stop_reason == StopReason::MaxTokens {
            if let Some(Part::ToolUse(t)) = parts.last() {
                return Err(protocol(format!(
                    "stopReason max_tokens right after toolUse {:?}: the call may be cut and cannot be run",
                    t.id
                )));
            }
        }
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

impl WireParser for StreamParser {
    const PROVIDER: &'static str = PROVIDER;
    type Decoder = FrameDecoder;

    fn feed_event(&mut self, event: &WireEvent, deltas: &dyn DeltaSink) -> Result<()> {
        self.feed(&event.event_type, &event.payload, deltas)
    }

    // `is_done` keeps its default: the `metadata` event with the usage follows `messageStop`,
    // so the body is read to its end.

    /// Bedrock reports usage once, in `metadata`.
    fn usage_so_far(&self) -> Option<Usage> {
        self.usage
    }

    fn finish(self) -> Result<ModelResponse> {
        StreamParser::finish(self)
    }
}

// ---------------------------------------------------------------------------------------------
// The provider (impure edge)
// ---------------------------------------------------------------------------------------------

/// Amazon Bedrock through ConverseStream, SigV4-signed.
#[derive(Debug, Clone)]
pub struct BedrockProvider {
    settings: HttpSettings,
    credentials: AwsCredentials,
    region: String,
}

impl BedrockProvider {
    /// A provider for `region` reaching `settings.base_url` (usually
    /// `https://bedrock-runtime.{region}.amazonaws.com`). The secret access key and session
    /// token join the settings' secrets, so no error can carry them.
    pub fn new(settings: HttpSettings, credentials: AwsCredentials, region: String) -> Self {
        let mut settings = settings;
        settings.secrets.push(credentials.secret_access_key.clone());
        settings.secrets.extend(credentials.session_token.clone());
        BedrockProvider {
            settings,
            credentials,
            region,
        }
    }

    /// From the environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optional
    /// `AWS_SESSION_TOKEN`, `AWS_REGION` (or `AWS_DEFAULT_REGION`), and optional
    /// `BEDROCK_BASE_URL` (default: the regional endpoint), and the optional
    /// `BEDROCK_IDLE_TIMEOUT_SECS` and `BEDROCK_MAX_EVENT_BYTES` ([`HttpSettings::with_env`]).
    /// Missing credentials or region are an `Auth` error.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let missing = |what: &str| Error::Provider {
            kind: ErrorKind::Auth,
            message: format!("bedrock: {what} is not set"),
        };
        let access_key_id = var("AWS_ACCESS_KEY_ID").ok_or_else(|| missing("AWS_ACCESS_KEY_ID"))?;
        let secret_access_key =
            var("AWS_SECRET_ACCESS_KEY").ok_or_else(|| missing("AWS_SECRET_ACCESS_KEY"))?;
        let region = var("AWS_REGION")
            .or_else(|| var("AWS_DEFAULT_REGION"))
            .ok_or_else(|| missing("AWS_REGION (or AWS_DEFAULT_REGION)"))?;
        let base_url = var("BEDROCK_BASE_URL")
            .unwrap_or_else(|| format!("https://bedrock-runtime.{region}.amazonaws.com"));
        Ok(Self::new(
            HttpSettings::new(base_url, None).with_env("BEDROCK")?,
            AwsCredentials {
                access_key_id,
                secret_access_key,
                session_token: var("AWS_SESSION_TOKEN"),
            },
            region,
        ))
    }
}

/// The wall clock, for request signing only: SigV4 signatures carry their time and expire.
#[allow(clippy::disallowed_methods)]
fn signing_time() -> SystemTime {
    // The impure edge: the pure signer takes the time as an argument.
    SystemTime::now()
}

#[async_trait]
impl ModelProvider for BedrockProvider {
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
        let path = converse_stream_path(&request.model.model);
        let url = format!("{}{}", self.settings.base_url, path);
        let signed = sign_headers(&self.credentials, &self.region, &url, &body, signing_time())?;
        let mut headers: Vec<(&str, String)> = signed
            .iter()
            .map(|(name, value)| (name.as_str(), value.clone()))
            .collect();
        headers.push(("accept", "application/vnd.amazon.eventstream".into()));
        let parser = StreamParser::new(request.model.model.clone(), aliases);
        drive::call(
            &self.settings,
            &path,
            &headers,
            body,
            parser,
            deltas,
            context,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CallContext, NoDeltas};
    use cairn_ledger::{JsonText, ModelSpec, ToolResult, ToolSpec, ToolUse, Transcript};

    fn request(transcript: Transcript) -> ModelRequest {
        ModelRequest {
            options: Default::default(),
            context: CallContext::default(),
            model: ModelSpec {
                provider: PROVIDER.into(),
                model: "anthropic.claude-sonnet-4-20250514-v1:0".into(),
                max_tokens: Some(4096),
                thinking_budget_tokens: None,
            },
            transcript: transcript.into(),
            tools: vec![ToolSpec {
                name: "calc".into(),
                description: "adds".into(),
                input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
            }]
            .into(),
        }
    }

    fn tool_loop(ids: &[&str], results: Vec<ToolResultContent>, is_error: bool) -> Transcript {
        let mut t = Transcript::new();
        t.push_user_text("go");
        t.push_response(&ModelResponse {
            provider: PROVIDER.into(),
            model: "m".into(),
            parts: ids
                .iter()
                .map(|id| {
                    Part::ToolUse(ToolUse {
                        id: (*id).into(),
                        name: "calc".into(),
                        arguments: r#"{"a": 1.10}"#.into(),
                        signature: None,
                    })
                })
                .collect(),
            stop_reason_raw: "tool_use".into(),
            stop_reason: StopReason::ToolUse,
            usage: Usage::default(),
        });
        t.push_tool_results(ids.iter().zip(results).map(|(id, content)| ToolResult {
            tool_use_id: (*id).into(),
            content,
            is_error,
        }));
        t
    }

    #[test]
    fn an_error_result_with_empty_content_is_refused() {
        let t = tool_loop(&["a"], vec![ToolResultContent::Text(String::new())], true);
        let err = render(&request(t)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        let text = err.to_string();
        assert!(
            text.contains("message 2 part 0") && text.contains("empty"),
            "{text}"
        );
        // The same empty text without the error flag is sent.
        let t = tool_loop(&["a"], vec![ToolResultContent::Text(String::new())], false);
        assert!(render(&request(t)).is_ok());
    }

    #[test]
    fn a_message_after_a_turn_that_ended_on_tool_results_joins_them_in_one_user_message() {
        let mut t = tool_loop(&["a"], vec![ToolResultContent::Text("2".into())], false);
        t.push_user_text("and now?");
        let body = render(&request(t)).unwrap();
        let messages = body["messages"].as_array().unwrap();
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["user", "assistant", "user"]);
        let content = messages[2]["content"].as_array().unwrap();
        assert_eq!(content[0]["toolResult"]["toolUseId"], "a");
        assert_eq!(content[1]["text"], "and now?");
    }

    #[test]
    fn ids_are_aliased_bijectively_and_inputs_kept_exact() {
        let long = "x".repeat(65);
        let ids = ["call.1", "ok_id-2", long.as_str(), "cairn_0"];
        let results = vec![
            ToolResultContent::Text("r1".into()),
            ToolResultContent::Json(JsonText::parse(r#"{"n": 9007199254740993}"#).unwrap()),
            ToolResultContent::Json(JsonText::parse("[1, 2]").unwrap()),
            ToolResultContent::Json(JsonText::parse("42").unwrap()),
        ];
        let (bytes, aliases) = render_body(&request(tool_loop(&ids, results, false))).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains(r#""input":{"a": 1.10}"#), "{text}");
        assert!(
            text.contains(r#"{"json":{"n": 9007199254740993}}"#),
            "{text}"
        );
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let uses: Vec<&str> = body["messages"][1]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["toolUse"]["toolUseId"].as_str().unwrap())
            .collect();
        let results: Vec<&str> = body["messages"][2]["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b.get("cachePoint").is_none())
            .map(|b| b["toolResult"]["toolUseId"].as_str().unwrap())
            .collect();
        assert_eq!(uses, results);
        assert_eq!(uses[1], "ok_id-2");
        assert!(uses.iter().all(|id| is_valid_tool_use_id(id)), "{uses:?}");
        let unique: std::collections::BTreeSet<&&str> = uses.iter().collect();
        assert_eq!(unique.len(), 4, "{uses:?}");
        // The canonical "cairn_0" must not collide with an alias handed to "call.1".
        for (canonical, wire) in ids.iter().zip(&uses) {
            assert_eq!(aliases.canonical_id(wire), *canonical);
        }
        // Non-object JSON results go as text.
        assert_eq!(
            body["messages"][2]["content"][2]["toolResult"]["content"][0]["text"],
            "[1, 2]"
        );
        assert_eq!(
            body["messages"][2]["content"][3]["toolResult"]["content"][0]["text"],
            "42"
        );
        assert!(body["toolConfig"]["tools"][0]["toolSpec"]["inputSchema"]["json"].is_object());
    }

    #[test]
    fn tool_blocks_without_tools_and_thinking_toggles_are_refused() {
        let t = tool_loop(&["a"], vec![ToolResultContent::Text("r".into())], false);
        let mut r = request(t.clone());
        r.tools = Vec::new().into();
        let err = render(&r).unwrap_err();
        assert!(err.to_string().contains("toolConfig"), "{err}");
        // Thinking turned on inside a loop that began without it.
        let mut r = request(t);
        r.model.thinking_budget_tokens = Some(2048);
        let err = render(&r).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        assert!(err.to_string().contains("message 1 part 0"), "{err}");
    }

    #[test]
    fn cache_points_follow_the_rule_where_the_model_takes_them() {
        const POINT: &str = r#"{"cachePoint":{"type":"default"}}"#;
        let mut t = Transcript::new();
        t.push_system("Be brief.");
        t.messages
            .extend(tool_loop(&["a"], vec![ToolResultContent::Text("r".into())], false).messages);
        let body = |model: &str, off: bool| {
            let mut r = request(t.clone());
            r.model.model = model.into();
            r.options.no_prompt_cache = off;
            String::from_utf8(render_body(&r).unwrap().0).unwrap()
        };
        // Claude: after the system prompt, after the tools, at the end of the last turn.
        let claude = body("us.anthropic.claude-sonnet-4-20250514-v1:0", false);
        assert!(
            claude.contains(&format!(r#""system":[{{"text":"Be brief."}},{POINT}]"#)),
            "{claude}"
        );
        assert!(
            claude.contains(&format!(
                r#""toolConfig":{{"tools":[{{"toolSpec":{{"name":"calc","description":"adds","inputSchema":{{"json":{{"type":"object"}}}}}}}},{POINT}]}}"#
            )),
            "{claude}"
        );
        assert!(
            claude.contains(&format!(
                r#"{{"toolResult":{{"toolUseId":"a","content":[{{"text":"r"}}]}}}},{POINT}]}}]"#
            )),
            "{claude}"
        );
        assert_eq!(claude.matches(POINT).count(), 3, "{claude}");
        // Nova: system and messages only.
        let nova = body("amazon.nova-pro-v1:0", false);
        assert_eq!(nova.matches(POINT).count(), 2, "{nova}");
        let value: serde_json::Value = serde_json::from_str(&nova).unwrap();
        assert_eq!(value["toolConfig"]["tools"].as_array().unwrap().len(), 1);
        // Off by the session's option, and never for a model that refuses them.
        for (model, off) in [
            ("anthropic.claude-sonnet-4-20250514-v1:0", true),
            ("anthropic.claude-3-haiku-20240307-v1:0", false),
            ("meta.llama3-70b-instruct-v1:0", false),
        ] {
            let plain = body(model, off);
            assert!(!plain.contains("cachePoint"), "{model}: {plain}");
        }
        assert_eq!(cache_fields("arn:aws:bedrock:us-east-1:1:inference-profile/global.anthropic.claude-opus-4-1-20250805-v1:0"), Some(CacheFields { tools: true }));
    }

    #[test]
    fn unmodelled_blocks_are_kept_and_malformed_ones_named() {
        let run = |events: &[(&str, &str)]| {
            let mut p = StreamParser::new("m", IdAliases::new());
            for (kind, payload) in events {
                p.feed(kind, payload.as_bytes(), &NoDeltas)?;
            }
            p.finish()
        };
        let start = ("messageStart", r#"{"role":"assistant"}"#);
        let stop = ("messageStop", r#"{"stopReason":"end_turn"}"#);
        // A server tool's call: its input set from its fragments, exactly as streamed.
        let response = run(&[
            start,
            ("contentBlockStart", r#"{"contentBlockIndex":0,"start":{"toolUse":{"toolUseId":"s1","name":"nova_grounding","type":"server_tool_use"}}}"#),
            ("contentBlockDelta", r#"{"contentBlockIndex":0,"delta":{"toolUse":{"input":"{\"q\": 1.10"}}}"#),
            ("contentBlockDelta", r#"{"contentBlockIndex":0,"delta":{"toolUse":{"input":"}"}}}"#),
            ("contentBlockStop", r#"{"contentBlockIndex":0}"#),
            ("contentBlockStart", r#"{"contentBlockIndex":1,"start":{"toolResult":{"toolUseId":"s1","type":"nova_grounding_result","status":"success"}}}"#),
            ("contentBlockDelta", r#"{"contentBlockIndex":1,"delta":{"toolResult":[{"text":"found"}]}}"#),
            ("contentBlockDelta", r#"{"contentBlockIndex":1,"delta":{"toolResult":[{"json":{"n": 9007199254740993}}]}}"#),
            ("contentBlockStop", r#"{"contentBlockIndex":1}"#),
            stop,
        ])
        .unwrap();
        let opaque: Vec<&str> = response
            .parts
            .iter()
            .map(|p| match p {
                Part::Opaque(o) if o.provider == PROVIDER => o.json.as_str(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            opaque,
            [
                r#"{"toolUse":{"toolUseId":"s1","name":"nova_grounding","type":"server_tool_use","input":{"q": 1.10}}}"#,
                r#"{"toolResult":{"toolUseId":"s1","type":"nova_grounding_result","status":"success","content":[{"text":"found"},{"json":{"n": 9007199254740993}}]}}"#,
            ]
        );

        // Citations with no text to carry them: kept whole as the block they would go back as.
        let response = run(&[
            start,
            (
                "contentBlockDelta",
                r#"{"contentBlockIndex":0,"delta":{"citation":{"title":"t"}}}"#,
            ),
            ("contentBlockStop", r#"{"contentBlockIndex":0}"#),
            stop,
        ])
        .unwrap();
        assert_eq!(
            response.parts,
            vec![Part::Opaque(ProviderJson::new(
                PROVIDER,
                JsonText::parse(
                    r#"{"citationsContent":{"content":[],"citations":[{"title":"t"}]}}"#
                )
                .unwrap()
            ))]
        );

        let broken = |events: &[(&str, &str)], wanted: &str| {
            let mut all = vec![start];
            all.extend_from_slice(events);
            let err = run(&all).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidResponse, "{err}");
            assert!(err.to_string().contains(wanted), "{err}");
        };
        broken(
            &[(
                "contentBlockStart",
                r#"{"contentBlockIndex":0,"start":{"image":{"format":"png"},"video":{}}}"#,
            )],
            "contentBlockStart 0: start must have exactly one member, found 2",
        );
        broken(
            &[("contentBlockStart", r#"{"contentBlockIndex":0,"start":[]}"#)],
            "contentBlockStart 0: \"start\" is not a JSON object",
        );
        broken(
            &[
                (
                    "contentBlockStart",
                    r#"{"contentBlockIndex":0,"start":{"toolUse":{"toolUseId":"t","name":"calc"}}}"#,
                ),
                (
                    "contentBlockDelta",
                    r#"{"contentBlockIndex":0,"delta":{"citation":{"title":"x"}}}"#,
                ),
            ],
            "contentBlockDelta 0: citation delta for a toolUse block",
        );
        broken(
            &[(
                "contentBlockDelta",
                r#"{"contentBlockIndex":0,"delta":{"citation":"x"}}"#,
            )],
            "contentBlockDelta 0: citation delta is not an object",
        );
        broken(
            &[
                (
                    "contentBlockStart",
                    r#"{"contentBlockIndex":0,"start":{"toolResult":{"toolUseId":"s"}}}"#,
                ),
                (
                    "contentBlockDelta",
                    r#"{"contentBlockIndex":0,"delta":{"toolResult":{"text":"x"}}}"#,
                ),
            ],
            "contentBlockDelta 0: toolResult delta is not a list",
        );
        broken(
            &[
                ("contentBlockStart", r#"{"contentBlockIndex":0,"start":{"image":{"format":"png"}}}"#),
                ("contentBlockDelta", r#"{"contentBlockIndex":0,"delta":{"image":{"format":{"x":1}}}}"#),
            ],
            "contentBlockDelta 0: the image delta does not extend its block: format: an object cannot extend a string",
        );
        broken(
            &[
                (
                    "contentBlockStart",
                    r#"{"contentBlockIndex":0,"start":{"image":{"format":"png"}}}"#,
                ),
                (
                    "contentBlockDelta",
                    r#"{"contentBlockIndex":0,"delta":{"text":"x"}}"#,
                ),
            ],
            "contentBlockDelta 0: text delta for the opaque image block",
        );
        broken(
            &[
                (
                    "contentBlockStart",
                    r#"{"contentBlockIndex":0,"start":{"toolUse":{"toolUseId":"s","name":"w","type":"server_tool_use"}}}"#,
                ),
                (
                    "contentBlockDelta",
                    r#"{"contentBlockIndex":0,"delta":{"toolUse":{"input":"{"}}}"#,
                ),
                ("contentBlockStop", r#"{"contentBlockIndex":0}"#),
            ],
            "contentBlockStop 0: server toolUse input is not valid JSON",
        );
    }

    #[test]
    fn model_ids_are_one_encoded_path_segment() {
        assert_eq!(
            converse_stream_path("anthropic.claude-v2:1"),
            "/model/anthropic.claude-v2%3A1/converse-stream"
        );
        assert_eq!(
            encode_model_id("arn:aws:bedrock:us-east-1:1:inference-profile/us.x"),
            "arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ainference-profile%2Fus.x"
        );
    }

    #[test]
    fn parser_refuses_deltas_of_another_kind_and_early_ends() {
        let mut p = StreamParser::new("m", IdAliases::new());
        p.feed("messageStart", br#"{"role":"assistant"}"#, &NoDeltas)
            .unwrap();
        p.feed(
            "contentBlockDelta",
            br#"{"contentBlockIndex":0,"delta":{"text":"hi"}}"#,
            &NoDeltas,
        )
        .unwrap();
        let err = p
            .feed(
                "contentBlockDelta",
                br#"{"contentBlockIndex":0,"delta":{"reasoningContent":{"text":"x"}}}"#,
                &NoDeltas,
            )
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidResponse);
        let err = p.finish().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Transient);
        assert!(err.to_string().contains("before messageStop"), "{err}");
    }

    #[test]
    fn an_input_too_long_is_its_own_class() {
        let exception = |message: &str| {
            let mut p = StreamParser::new("m", IdAliases::new());
            let payload = serde_json::json!({ "message": message }).to_string();
            p.feed("validationException", payload.as_bytes(), &NoDeltas)
                .unwrap_err()
        };
        let err = exception("Input is too long for requested model.");
        assert_eq!(err.kind(), ErrorKind::ContextTooLong);
        let err = exception(
            "The model returned the following errors: prompt is too long: 227255 tokens > 200000 maximum",
        );
        assert_eq!(err.kind(), ErrorKind::ContextTooLong);
        assert_eq!(
            exception("The toolConfig field must be defined").kind(),
            ErrorKind::InvalidRequest
        );
        // The stop reason says the window filled while the model wrote.
        let mut p = StreamParser::new("m", IdAliases::new());
        p.feed("messageStart", br#"{"role":"assistant"}"#, &NoDeltas)
            .unwrap();
        p.feed(
            "contentBlockDelta",
            br#"{"contentBlockIndex":0,"delta":{"text":"hi"}}"#,
            &NoDeltas,
        )
        .unwrap();
        p.feed("contentBlockStop", br#"{"contentBlockIndex":0}"#, &NoDeltas)
            .unwrap();
        p.feed(
            "messageStop",
            br#"{"stopReason":"model_context_window_exceeded"}"#,
            &NoDeltas,
        )
        .unwrap();
        let err = p.finish().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ContextTooLong);
    }

    #[test]
    fn signing_is_deterministic_for_a_given_time() {
        let creds = AwsCredentials {
            access_key_id: "AKID".into(),
            secret_access_key: "secret".into(),
            session_token: Some("token".into()),
        };
        let time = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        let url = "https://bedrock-runtime.us-east-1.amazonaws.com/model/m%3A0/converse-stream";
        let a = sign_headers(&creds, "us-east-1", url, b"{}", time).unwrap();
        let b = sign_headers(&creds, "us-east-1", url, b"{}", time).unwrap();
        assert_eq!(a, b);
        let get = |n: &str| a.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!(get("x-amz-date"), Some("20231114T221320Z"));
        assert_eq!(get("x-amz-security-token"), Some("token"));
        let auth = get("authorization").unwrap();
        assert!(
            auth.starts_with(
                "AWS4-HMAC-SHA256 Credential=AKID/20231114/us-east-1/bedrock/aws4_request"
            ),
            "{auth}"
        );
        assert!(sign_headers(&creds, "us-east-1", "not a url", b"", time).is_err());
    }
}
