//! The offline `scripted` provider: plays canned canonical responses from a JSON script, in
//! order, so demos and tests run without a network and replay deterministically.
//!
//! # Which response is played
//!
//! The response for a request is the one at index = the number of assistant messages in
//! `request.transcript`. The provider keeps no state, so a session continued in a new process
//! (or replayed) picks up exactly where it was. Asking past the end is
//! [`Error::ScriptExhausted`].
//!
//! # Script format
//!
//! (Also in `activities/SCRIPT.md`.)
//!
//! ```json
//! {
//!   "model": "scripted-demo",
//!   "chunk_delay_ms": 0,
//!   "responses": [
//!     {
//!       "parts": [
//!         {"type": "thinking", "text": "Let me compute.", "signature": "sig-1"},
//!         {"type": "redacted_thinking", "data": "opaque"},
//!         {"type": "text", "text": "I'll use tools."},
//!         {"type": "tool_use", "id": "toolu_01", "name": "calculator", "input": {"expression": "2+2"}},
//!         {"type": "tool_use", "id": "toolu_02", "name": "read_file", "arguments": "{\"path\": \"notes.txt\"}"}
//!       ],
//!       "stop_reason": "tool_use",
//!       "usage": {"input_tokens": 10, "output_tokens": 5},
//!       "delay_ms": 0,
//!       "jitter_ms": 0,
//!       "fail_attempts": 0
//!     }
//!   ]
//! }
//! ```
//!
//! Top level:
//! - `provider` (optional): the provider family its responses (and their opaque parts and
//!   citations) carry; default `scripted`. A request is seen as that family would render it
//!   (other families' reasoning, opaque parts and citations dropped; see [`ReceivedCall`]).
//! - `model` (optional): the model name in every response; default `scripted`.
//! - `chunk_delay_ms` (optional, default 0): pause between streamed deltas.
//! - `summary` (optional): the text a summary call of compaction (a request that ends with
//!   [`cairn_ledger::SUMMARY_PROMPT`]) gets; without it such a call fails.
//! - `context_window_tokens` (optional): a request whose transcript is estimated
//!   ([`cairn_ledger::estimate_tokens`]) over this many tokens fails with an
//!   [`ErrorKind::ContextTooLong`] provider error, like a real model's context window.
//! - `responses` (required, at least one): played in order.
//!
//! Each response:
//! - `parts` (required, non-empty), in provider order:
//!   - `{"type": "text", "text": ...}`: visible text, non-empty.
//!   - `{"type": "thinking", "text": ..., "signature": ...}`: reasoning; `signature` is
//!     required and non-empty (unsigned thinking cannot be sent back to a provider); `text`
//!     defaults to empty.
//!   - `{"type": "redacted_thinking", "data": ...}`: opaque reasoning, non-empty.
//!   - `{"type": "opaque", "block": <JSON>, "provider": ...}`: a block the ledger does not model
//!     ([`Part::Opaque`]), kept as its exact text for `provider` (default: the script's).
//!   - A text part may carry `"citations": <JSON>`, kept for the script's family.
//!   - `{"type": "tool_use", "id": ..., "name": ..., "input": <JSON> | "arguments": "<text>",
//!     "signature": ...}`: a tool call. Exactly one of `input` (any JSON value, stored as compact
//!     JSON text with key order and number text preserved) or `arguments` (the exact arguments
//!     text, which may even be invalid JSON, for tests). `signature` is optional. Ids must be
//!     unique across the whole script, since they share one session transcript.
//! - `stop_reason` (optional): the raw stop reason, kept as `stop_reason_raw`; `end_turn`,
//!   `tool_use`, `max_tokens`, `stop_sequence`, `pause_turn`, `refusal` and `content_filter` map
//!   to their [`StopReason`], anything else to [`StopReason::Other`]. Default: `tool_use` when
//!   the response has a tool_use part, else `end_turn`.
//! - `usage` (optional): `input_tokens`, `output_tokens`, `cache_read_tokens`,
//!   `cache_write_tokens`, `reasoning_tokens`, each defaulting to 0.
//! - `delay_ms` (optional, default 0): sleep this long before answering (every attempt), to
//!   add latency in chaos tests.
//! - `jitter_ms` (optional, default 0): sleep up to this much longer, a pseudo-random extra in
//!   `0..=jitter_ms` derived from a hash of `request.context` (session id, turn, round, attempt):
//!   varied latency across sessions and attempts, yet the same for the same call (no randomness).
//! - `fail_attempts` (optional, default 0): attempts `1..=fail_attempts` of this response
//!   (`request.context.attempt`, 1-based) fail with a transient [`Error::Provider`], for retry
//!   tests.
//! - `turn` (optional): the turn (from 1) this response answers. When responses name their
//!   turns (all or none must), the response for a call is the `round`-th (0-based) of those of
//!   the call's turn, instead of the one at the count of assistant messages, so a script still
//!   plays right after compaction dropped old messages.
//!
//! Unknown fields anywhere are rejected, so typos are caught. Every response is built and checked
//! with [`cairn_ledger::validate_response`] when the script is loaded; any problem is one
//! [`Error::Script`] naming the file, the response and part, and the line and column.
//!
//! # Streaming
//!
//! While answering, the provider emits thinking and visible text as word-sized
//! [`Delta::Thinking`] / [`Delta::Text`] chunks (split after whitespace) and tool arguments as
//! [`Delta::ToolArguments`] fragments; each part's chunks concatenate to its exact text.
//! Redacted thinking emits nothing.

use crate::context::ActivityContext;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{CallContext, DeltaSink, ModelProvider, ModelRequest};
use async_trait::async_trait;
use cairn_ledger::{
    CallOptions, Delta, JsonText, ModelResponse, Part, ProviderJson, Role, StopReason, ToolUse,
    Transcript, Usage,
};
use serde::de::IgnoredAny;
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The provider family name of scripted responses.
const PROVIDER: &str = "scripted";

/// The model name when the script does not set one.
const DEFAULT_MODEL: &str = "scripted";

/// Tool arguments stream in fragments of at most this many bytes.
const ARGUMENT_FRAGMENT_BYTES: usize = 24;

/// The script `cairn demo` plays (`activities/scripts/demo.json`): a calculator and a read_file
/// call in parallel, then a final answer.
pub const DEMO_SCRIPT: &str = include_str!("../scripts/demo.json");

/// A loaded and validated script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Script {
    path: String,
    provider: String,
    model: String,
    chunk_delay: Duration,
    context_window_tokens: Option<u64>,
    summary: Option<String>,
    steps: Vec<Step>,
}

/// One scripted response and how to play it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Step {
    response: ModelResponse,
    delay: Duration,
    jitter_ms: u64,
    fail_attempts: u32,
    turn: Option<u32>,
}

impl Script {
    /// Parses and validates a script; `path` is only used to name the script in errors.
    pub fn from_json(text: &str, path: impl Into<String>) -> Result<Script> {
        Loader {
            text,
            path: path.into(),
        }
        .load()
    }

    /// Reads, parses and validates a script file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Script> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| Error::Script {
            path: shown.clone(),
            reason: format!("cannot read the script: {e}"),
        })?;
        Script::from_json(&text, shown)
    }

    /// The path the script was loaded from, as given.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The provider family its responses carry (and its opaque parts and citations).
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The model name its responses carry.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The pause between streamed deltas.
    pub fn chunk_delay(&self) -> Duration {
        self.chunk_delay
    }

    /// How many responses the script has.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether the script has no responses (a loaded script always has at least one).
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The response at `index`, as it will be returned.
    pub fn response(&self, index: usize) -> Option<&ModelResponse> {
        self.steps.get(index).map(|s| &s.response)
    }
}

/// The offline provider that plays a [`Script`]; see the module docs for the format.
#[derive(Debug, Clone)]
pub struct ScriptedProvider {
    script: Arc<Script>,
    /// The calls received, when recording ([`ScriptedProvider::recording`]).
    received: Option<Arc<Mutex<Vec<ReceivedCall>>>>,
}

/// What a recording scripted provider received in one call, as a real provider of its family
/// would render it: the transcript prepared for the family (other families' reasoning, opaque
/// parts and citations dropped) and the call's options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedCall {
    /// Where the call sits in its session.
    pub context: CallContext,
    /// The transcript as this family receives it.
    pub transcript: Transcript,
    /// The call's options (tool choice, server tools, prompt caching).
    pub options: CallOptions,
}

impl ScriptedProvider {
    /// The provider family name, as in `ModelSpec::provider` and each response's provenance.
    pub const PROVIDER: &'static str = PROVIDER;

    /// A provider playing `script`.
    pub fn new(script: Script) -> Self {
        ScriptedProvider {
            script: Arc::new(script),
            received: None,
        }
    }

    /// This provider, keeping every call it receives (for tests: see [`Self::received`]).
    pub fn recording(mut self) -> Self {
        self.received = Some(Arc::default());
        self
    }

    /// The calls received so far, oldest first; empty unless [`Self::recording`].
    pub fn received(&self) -> Vec<ReceivedCall> {
        match &self.received {
            Some(log) => match log.lock() {
                Ok(calls) => calls.clone(),
                Err(poisoned) => poisoned.into_inner().clone(),
            },
            None => Vec::new(),
        }
    }

    /// Parses and validates a script; `path_for_errors` names it in errors.
    pub fn from_json(text: &str, path_for_errors: impl Into<String>) -> Result<Self> {
        Script::from_json(text, path_for_errors).map(Self::new)
    }

    /// Reads, parses and validates a script file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        Script::from_file(path).map(Self::new)
    }

    /// A provider playing [`DEMO_SCRIPT`].
    pub fn demo() -> Result<Self> {
        Self::from_json(DEMO_SCRIPT, "activities/scripts/demo.json")
    }

    /// The script being played.
    pub fn script(&self) -> &Script {
        &self.script
    }
}

#[async_trait]
impl ModelProvider for ScriptedProvider {
    fn provider(&self) -> &str {
        &self.script.provider
    }

    // Activities are the impure edge: the scripted latency stands in for a real network call.
    #[allow(clippy::disallowed_methods)]
    async fn call(
        &self,
        request: &ModelRequest,
        deltas: &dyn DeltaSink,
        context: &ActivityContext,
    ) -> Result<ModelResponse> {
        let script = &self.script;
        // What a real provider of this family would be sent: the same rules of provenance
        // (a switch inside a tool loop refused, other families' provider-bound parts dropped).
        let prepared = crate::providers::prepare_transcript(&request.transcript, &script.provider)?;
        if let Some(log) = &self.received {
            let call = ReceivedCall {
                context: request.context.clone(),
                transcript: prepared.into_owned(),
                options: request.options.clone(),
            };
            match log.lock() {
                Ok(mut calls) => calls.push(call),
                Err(poisoned) => poisoned.into_inner().push(call),
            }
        }
        if let Some(window) = script.context_window_tokens {
            let estimate = cairn_ledger::estimate_tokens(&request.transcript);
            if estimate > window {
                // Worded like Anthropic's answer, so it reads like the real thing.
                return Err(Error::Provider {
                    kind: ErrorKind::ContextTooLong,
                    message: format!(
                        "prompt is too long: {estimate} tokens > {window} maximum (the \
                         script's context_window_tokens)"
                    ),
                });
            }
        }
        // A summary call (compaction's): its request ends with the summary prompt.
        let asks_summary = request.transcript.messages.last().is_some_and(|m| {
            m.role == Role::User
                && matches!(m.parts.first(), Some(Part::Text { text, .. }) if text == cairn_ledger::SUMMARY_PROMPT)
        });
        if asks_summary {
            let Some(summary) = script.summary.as_ref().filter(|s| !s.is_empty()) else {
                return Err(Error::Provider {
                    kind: ErrorKind::InvalidRequest,
                    message: format!(
                        "script {} has no \"summary\" for compaction's summary call",
                        script.path
                    ),
                });
            };
            let response = ModelResponse {
                provider: script.provider.clone(),
                model: script.model.clone(),
                parts: vec![Part::text(summary.clone())],
                stop_reason_raw: "end_turn".to_owned(),
                stop_reason: StopReason::EndTurn,
                usage: Usage::default(),
            };
            stream(&response, script.chunk_delay, deltas).await;
            return Ok(response);
        }
        // The position in the script comes from the request alone, so restarts and replays
        // pick the same response: by turn and round when the responses name their turns
        // (which survives compaction), else by the transcript's assistant messages.
        let index = if script.steps.first().is_some_and(|s| s.turn.is_some()) {
            script
                .steps
                .iter()
                .enumerate()
                .filter(|(_, s)| s.turn == Some(request.context.turn))
                .nth(request.context.round as usize)
                .map_or(script.steps.len(), |(i, _)| i)
        } else {
            request
                .transcript
                .messages
                .iter()
                .filter(|m| m.role == Role::Assistant)
                .count()
        };
        let step = script
            .steps
            .get(index)
            .ok_or_else(|| Error::ScriptExhausted {
                path: script.path.clone(),
                responses: script.steps.len(),
                call_index: index,
            })?;
        tracing::debug!(
            session = %request.context.session_id,
            attempt = request.context.attempt,
            index,
            script = %script.path,
            "scripted model call"
        );
        let delay = step.delay + Duration::from_millis(jitter(&request.context, step.jitter_ms));
        if !delay.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = context.cancelled() => {
                    return Err(Error::Cancelled { reason: "cancelled while waiting for the model".to_owned() });
                }
            }
        }
        // Attempts are 1-based; a caller that leaves the attempt at 0 means the first one.
        if request.context.attempt.max(1) <= step.fail_attempts {
            return Err(Error::Provider {
                kind: ErrorKind::Transient,
                message: format!(
                    "scripted failure: response {index} of {} fails its first {} attempts \
                     (this is attempt {})",
                    script.path, step.fail_attempts, request.context.attempt
                ),
            });
        }
        stream(&step.response, script.chunk_delay, deltas).await;
        Ok(step.response.clone())
    }
}

/// The extra latency of a call: a pseudo-random value in `0..=max_ms` from an FNV-1a hash of
/// the call's context, so it varies across sessions, turns, rounds and attempts but is the same
/// for the same call in any process.
fn jitter(context: &CallContext, max_ms: u64) -> u64 {
    if max_ms == 0 {
        return 0;
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    feed(context.session_id.as_bytes());
    feed(&[0xff]);
    feed(&context.turn.to_le_bytes());
    feed(&context.round.to_le_bytes());
    feed(&context.attempt.to_le_bytes());
    // FNV's low bits mix poorly; fold the high half in before reducing.
    (hash ^ (hash >> 32)) % (max_ms + 1)
}

/// Emits a response's deltas, pausing `chunk_delay` between consecutive ones.
#[allow(clippy::disallowed_methods)] // simulated streaming latency, at the impure edge
async fn stream(response: &ModelResponse, chunk_delay: Duration, sink: &dyn DeltaSink) {
    let mut deltas = Vec::new();
    for part in &response.parts {
        match part {
            Part::Text { text, .. } => {
                deltas.extend(word_chunks(text).map(|c| Delta::Text(c.to_owned())));
            }
            Part::Thinking { text, .. } | Part::Reasoning { text } => {
                deltas.extend(word_chunks(text).map(|c| Delta::Thinking(c.to_owned())));
            }
            Part::ToolUse(tool_use) => {
                deltas.extend(
                    fragments(&tool_use.arguments, ARGUMENT_FRAGMENT_BYTES).map(|f| {
                        Delta::ToolArguments {
                            tool_use_id: tool_use.id.clone(),
                            fragment: f.to_owned(),
                        }
                    }),
                );
            }
            Part::RedactedThinking { .. }
            | Part::ReasoningItem { .. }
            | Part::ToolResult(_)
            | Part::Image { .. }
            | Part::Media(_)
            | Part::Opaque(_) => {}
        }
    }
    for (i, delta) in deltas.into_iter().enumerate() {
        if i > 0 && !chunk_delay.is_zero() {
            tokio::time::sleep(chunk_delay).await;
        }
        sink.delta(delta);
    }
}

/// Splits text after each run of whitespace: `"a  b\nc"` → `"a  "`, `"b\n"`, `"c"`.
fn word_chunks(text: &str) -> impl Iterator<Item = &str> {
    let mut start = 0;
    let mut previous_was_space = false;
    let mut cuts = Vec::new();
    for (i, c) in text.char_indices() {
        let is_space = c.is_whitespace();
        if previous_was_space && !is_space {
            cuts.push(&text[start..i]);
            start = i;
        }
        previous_was_space = is_space;
    }
    if start < text.len() {
        cuts.push(&text[start..]);
    }
    cuts.into_iter()
}

/// Splits text into pieces of at most `max_bytes` (more for a single wider character), on
/// character boundaries.
fn fragments(text: &str, max_bytes: usize) -> impl Iterator<Item = &str> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = max_bytes.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        let (piece, tail) = rest.split_at(cut);
        pieces.push(piece);
        rest = tail;
    }
    pieces.into_iter()
}

// ---- Loading -------------------------------------------------------------------------------
//
// The script is parsed in layers: the top level keeps each response as raw text, each response
// keeps each part as raw text, and each part is parsed by its `type`. Raw values borrow from the
// script text, so every error can be placed at an absolute line and column, and `input` keeps
// its exact number text and key order.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a script object")]
struct RawScript<'a> {
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    chunk_delay_ms: u64,
    #[serde(default)]
    context_window_tokens: Option<u64>,
    #[serde(default)]
    summary: Option<String>,
    #[serde(borrow)]
    responses: Vec<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a response object")]
struct RawResponse<'a> {
    #[serde(borrow)]
    parts: Vec<&'a RawValue>,
    #[serde(default)]
    stop_reason: Option<String>,
    #[serde(default)]
    usage: RawUsage,
    #[serde(default)]
    delay_ms: u64,
    #[serde(default)]
    jitter_ms: u64,
    #[serde(default)]
    fail_attempts: u32,
    #[serde(default)]
    turn: Option<u32>,
}

#[derive(Default, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "a usage object")]
struct RawUsage {
    input_tokens: u64,
    output_tokens: u64,
    cache_read_tokens: u64,
    cache_write_tokens: u64,
    reasoning_tokens: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum PartKind {
    Text,
    Thinking,
    RedactedThinking,
    ToolUse,
    Opaque,
}

/// Reads only a part's `type`, to choose the strict parser for the rest.
#[derive(Deserialize)]
#[serde(expecting = "a part object with a \"type\"")]
struct PartTag {
    #[serde(rename = "type")]
    kind: PartKind,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a text part")]
struct TextPart<'a> {
    #[serde(rename = "type")]
    _kind: IgnoredAny,
    text: String,
    #[serde(default, borrow)]
    citations: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an opaque part")]
struct OpaquePart<'a> {
    #[serde(rename = "type")]
    _kind: IgnoredAny,
    #[serde(default)]
    provider: Option<String>,
    #[serde(borrow)]
    block: &'a RawValue,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a thinking part")]
struct ThinkingPart {
    #[serde(rename = "type")]
    _kind: IgnoredAny,
    #[serde(default)]
    text: String,
    signature: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a redacted_thinking part")]
struct RedactedThinkingPart {
    #[serde(rename = "type")]
    _kind: IgnoredAny,
    data: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a tool_use part")]
struct ToolUsePart<'a> {
    #[serde(rename = "type")]
    _kind: IgnoredAny,
    id: String,
    name: String,
    #[serde(default, borrow, deserialize_with = "present_raw")]
    input: Option<&'a RawValue>,
    #[serde(default)]
    arguments: Option<String>,
    #[serde(default)]
    signature: Option<String>,
}

/// A present field as `Some`, even when it is `null` (an `Option` alone would read `null` as
/// absent).
fn present_raw<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<&'de RawValue>, D::Error> {
    <&'de RawValue>::deserialize(deserializer).map(Some)
}

/// Loads one script text, placing every error in it.
struct Loader<'t> {
    text: &'t str,
    path: String,
}

impl<'t> Loader<'t> {
    fn load(&self) -> Result<Script> {
        let raw: RawScript<'t> =
            serde_json::from_str(self.text).map_err(|e| self.json_error(None, self.text, &e))?;
        let provider = match raw.provider {
            Some(provider) if provider.is_empty() => {
                return Err(self.error(None, self.text, "\"provider\" is empty"))
            }
            Some(provider) => provider,
            None => PROVIDER.to_owned(),
        };
        let model = match raw.model {
            Some(model) if model.is_empty() => {
                return Err(self.error(None, self.text, "\"model\" is empty"))
            }
            Some(model) => model,
            None => DEFAULT_MODEL.to_owned(),
        };
        if raw.responses.is_empty() {
            return Err(self.error(
                None,
                self.text,
                "\"responses\" is empty; a script needs at least one",
            ));
        }
        let mut tool_use_ids = BTreeMap::new();
        let steps = raw
            .responses
            .iter()
            .enumerate()
            .map(|(index, raw)| self.step(index, raw, &provider, &model, &mut tool_use_ids))
            .collect::<Result<Vec<_>>>()?;
        let with_turn = steps.iter().filter(|s| s.turn.is_some()).count();
        if with_turn != 0 && with_turn != steps.len() {
            let first = steps.iter().position(|s| s.turn.is_none()).unwrap_or(0);
            return Err(self.error(
                Some(&format!("responses[{first}]")),
                raw.responses[first].get(),
                "\"turn\" is missing: when one response names its turn, every response must",
            ));
        }
        Ok(Script {
            path: self.path.clone(),
            provider,
            model,
            chunk_delay: Duration::from_millis(raw.chunk_delay_ms),
            context_window_tokens: raw.context_window_tokens,
            summary: raw.summary,
            steps,
        })
    }

    fn step(
        &self,
        index: usize,
        raw: &'t RawValue,
        provider: &str,
        model: &str,
        tool_use_ids: &mut BTreeMap<String, String>,
    ) -> Result<Step> {
        let here = format!("responses[{index}]");
        let source = raw.get();
        let response: RawResponse<'t> =
            serde_json::from_str(source).map_err(|e| self.json_error(Some(&here), source, &e))?;
        let mut parts = Vec::with_capacity(response.parts.len());
        for (pi, raw_part) in response.parts.iter().enumerate() {
            let part_here = format!("{here}.parts[{pi}]");
            let part = self.part(&part_here, raw_part.get(), provider)?;
            if let Part::ToolUse(tool_use) = &part {
                if let Some(first) = tool_use_ids.insert(tool_use.id.clone(), part_here.clone()) {
                    return Err(self.error(
                        Some(&part_here),
                        raw_part.get(),
                        &format!(
                            "tool_use id {:?} is already used by {first}; ids must be unique \
                             across the script because they share one session transcript",
                            tool_use.id
                        ),
                    ));
                }
            }
            parts.push(part);
        }
        let has_tool_use = parts.iter().any(|p| matches!(p, Part::ToolUse(_)));
        let stop_reason_raw = response
            .stop_reason
            .unwrap_or_else(|| if has_tool_use { "tool_use" } else { "end_turn" }.to_owned());
        let usage = response.usage;
        let model_response = ModelResponse {
            provider: provider.to_owned(),
            model: model.to_owned(),
            parts,
            stop_reason: stop_reason(&stop_reason_raw),
            stop_reason_raw,
            usage: Usage {
                input_tokens: usage.input_tokens,
                output_tokens: usage.output_tokens,
                cache_read_tokens: usage.cache_read_tokens,
                cache_write_tokens: usage.cache_write_tokens,
                reasoning_tokens: usage.reasoning_tokens,
            },
        };
        if let Err(e) = cairn_ledger::validate_response(&model_response) {
            return Err(match e {
                cairn_ledger::Error::InvalidResponse {
                    part: Some(pi),
                    violation,
                } => {
                    let part_source = response.parts.get(pi).map_or(source, |p| p.get());
                    self.error(
                        Some(&format!("{here}.parts[{pi}]")),
                        part_source,
                        &violation.to_string(),
                    )
                }
                cairn_ledger::Error::InvalidResponse {
                    part: None,
                    violation,
                } => self.error(Some(&here), source, &violation.to_string()),
                other => self.error(Some(&here), source, &other.to_string()),
            });
        }
        Ok(Step {
            response: model_response,
            delay: Duration::from_millis(response.delay_ms),
            jitter_ms: response.jitter_ms,
            fail_attempts: response.fail_attempts,
            turn: response.turn,
        })
    }

    fn part(&self, here: &str, source: &'t str, provider: &str) -> Result<Part> {
        let parse_error = |e: serde_json::Error| self.json_error(Some(here), source, &e);
        let tag: PartTag = serde_json::from_str(source).map_err(parse_error)?;
        let provider_json = |raw: &RawValue, family: Option<String>| {
            JsonText::parse(raw.get())
                .map(|json| ProviderJson::new(family.unwrap_or_else(|| provider.to_owned()), json))
                .map_err(|e| self.error(Some(here), source, &e.to_string()))
        };
        Ok(match tag.kind {
            PartKind::Text => {
                let p: TextPart<'t> = serde_json::from_str(source).map_err(parse_error)?;
                Part::Text {
                    text: p.text,
                    item_id: None,
                    citations: match p.citations {
                        Some(raw) => Some(provider_json(raw, None)?),
                        None => None,
                    },
                }
            }
            PartKind::Opaque => {
                let p: OpaquePart<'t> = serde_json::from_str(source).map_err(parse_error)?;
                Part::Opaque(provider_json(p.block, p.provider)?)
            }
            PartKind::Thinking => {
                let p: ThinkingPart = serde_json::from_str(source).map_err(parse_error)?;
                Part::Thinking {
                    text: p.text,
                    signature: p.signature,
                }
            }
            PartKind::RedactedThinking => {
                let p: RedactedThinkingPart = serde_json::from_str(source).map_err(parse_error)?;
                Part::RedactedThinking { data: p.data }
            }
            PartKind::ToolUse => {
                let p: ToolUsePart<'t> = serde_json::from_str(source).map_err(parse_error)?;
                let arguments =
                    match (p.input, p.arguments) {
                        (Some(input), None) => compact_json(input.get()),
                        (None, Some(arguments)) => arguments,
                        (Some(_), Some(_)) => {
                            return Err(self.error(
                                Some(here),
                                source,
                                "tool_use has both \"input\" and \"arguments\"; give exactly one",
                            ))
                        }
                        (None, None) => return Err(self.error(
                            Some(here),
                            source,
                            "tool_use needs \"input\" (a JSON value) or \"arguments\" (the exact \
                             arguments text)",
                        )),
                    };
                Part::ToolUse(ToolUse {
                    id: p.id,
                    name: p.name,
                    arguments,
                    signature: p.signature,
                })
            }
        })
    }

    /// An error placed at the start of `source`, a slice of the script text.
    fn error(&self, context: Option<&str>, source: &str, message: &str) -> Error {
        let (line, column) = self.line_column(self.offset_of(source));
        self.script_error(context, message, line, column)
    }

    /// A serde_json error from parsing `source`, a slice of the script text, moved to its
    /// absolute line and column.
    fn json_error(&self, context: Option<&str>, source: &str, e: &serde_json::Error) -> Error {
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let message = full.strip_suffix(&suffix).unwrap_or(&full);
        let (base_line, base_column) = self.line_column(self.offset_of(source));
        let (line, column) = match e.line() {
            // No position: the error concerns the slice as a whole.
            0 => (base_line, base_column),
            1 => (base_line, base_column - 1 + e.column()),
            n => (base_line + n - 1, e.column()),
        };
        self.script_error(context, message, line, column)
    }

    fn script_error(
        &self,
        context: Option<&str>,
        message: &str,
        line: usize,
        column: usize,
    ) -> Error {
        let place = format!("line {line} column {column}");
        Error::Script {
            path: self.path.clone(),
            reason: match context {
                Some(context) => format!("{context}: {message} at {place}"),
                None => format!("{message} at {place}"),
            },
        }
    }

    /// The byte offset of `source` within the script text (0 when it is not a slice of it).
    fn offset_of(&self, source: &str) -> usize {
        let base = self.text.as_ptr() as usize;
        let start = source.as_ptr() as usize;
        if start >= base && start + source.len() <= base + self.text.len() {
            start - base
        } else {
            0
        }
    }

    /// 1-based line and column (in bytes, as serde_json counts) of a byte offset.
    fn line_column(&self, offset: usize) -> (usize, usize) {
        let before = &self.text.as_bytes()[..offset.min(self.text.len())];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let line_start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        (line, before.len() - line_start + 1)
    }
}

/// Normalizes a raw stop reason.
fn stop_reason(raw: &str) -> StopReason {
    match raw {
        "end_turn" => StopReason::EndTurn,
        "tool_use" => StopReason::ToolUse,
        "max_tokens" => StopReason::MaxTokens,
        "stop_sequence" => StopReason::StopSequence,
        "pause_turn" => StopReason::PauseTurn,
        "refusal" => StopReason::Refusal,
        "content_filter" => StopReason::ContentFilter,
        _ => StopReason::Other,
    }
}

/// Removes the whitespace between the tokens of valid JSON text, keeping strings, numbers and
/// key order exactly as written.
fn compact_json(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    let mut in_string = false;
    let mut escaped = false;
    for c in json.chars() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if !matches!(c, ' ' | '\t' | '\n' | '\r') {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CallContext, NoDeltas};
    use cairn_ledger::{ModelSpec, ToolResult, ToolResultContent, Transcript};
    use std::sync::Mutex;

    const EXAMPLE: &str = r#"{
  "model": "scripted-demo",
  "responses": [
    {
      "parts": [
        {"type": "thinking", "text": "Let me compute.", "signature": "sig-1"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "I'll use tools."},
        {"type": "tool_use", "id": "toolu_01", "name": "calculator", "input": {"expression": "2+2"}},
        {"type": "tool_use", "id": "toolu_02", "name": "read_file", "arguments": "{\"path\": \"notes.txt\"}"},
        {"type": "tool_use", "id": "toolu_03", "name": "echo", "signature": "ts",
         "input": {"z": 9007199254740993, "a": [1.0000000000000000001, {"y": "a b\"}", "b": 2}]}},
        {"type": "tool_use", "id": "toolu_04", "name": "echo", "arguments": "{\"path\": "}
      ],
      "stop_reason": "tool_use",
      "usage": {"input_tokens": 10, "output_tokens": 5},
      "delay_ms": 0,
      "fail_attempts": 0
    },
    {
      "parts": [{"type": "text", "text": "Done: 4."}],
      "usage": {"cache_read_tokens": 7}
    }
  ]
}"#;

    fn tool_use(id: &str, name: &str, arguments: &str, signature: Option<&str>) -> Part {
        Part::ToolUse(ToolUse {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
            signature: signature.map(Into::into),
        })
    }

    fn request(transcript: Transcript, attempt: u32) -> ModelRequest {
        ModelRequest {
            options: Default::default(),
            context: CallContext {
                session_id: "s1".into(),
                turn: 1,
                round: 1,
                attempt,
            },
            model: ModelSpec::parse("scripted:example.json").unwrap(),
            transcript: transcript.into(),
            tools: Vec::new().into(),
        }
    }

    fn script_error(text: &str) -> (String, String) {
        match Script::from_json(text, "bad.json") {
            Err(Error::Script { path, reason }) => (path, reason),
            other => panic!("expected Error::Script, got {other:?}"),
        }
    }

    #[test]
    fn parses_every_part_kind_exactly() {
        let script = Script::from_json(EXAMPLE, "example.json").unwrap();
        assert_eq!(
            (script.path(), script.model(), script.len()),
            ("example.json", "scripted-demo", 2)
        );
        let first = script.response(0).unwrap();
        assert_eq!(first.provider, "scripted");
        assert_eq!(first.model, "scripted-demo");
        assert_eq!(
            first.parts,
            [
                Part::Thinking {
                    text: "Let me compute.".into(),
                    signature: "sig-1".into()
                },
                Part::RedactedThinking {
                    data: "opaque".into()
                },
                Part::text("I'll use tools."),
                tool_use("toolu_01", "calculator", r#"{"expression":"2+2"}"#, None),
                tool_use("toolu_02", "read_file", r#"{"path": "notes.txt"}"#, None),
                tool_use(
                    "toolu_03",
                    "echo",
                    r#"{"z":9007199254740993,"a":[1.0000000000000000001,{"y":"a b\"}","b":2}]}"#,
                    Some("ts")
                ),
                tool_use("toolu_04", "echo", r#"{"path": "#, None),
            ]
        );
        assert_eq!(
            (first.stop_reason, first.stop_reason_raw.as_str()),
            (StopReason::ToolUse, "tool_use")
        );
        assert_eq!(
            first.usage,
            Usage {
                input_tokens: 10,
                output_tokens: 5,
                ..Usage::default()
            }
        );
        let second = script.response(1).unwrap();
        assert_eq!(
            (second.stop_reason, second.stop_reason_raw.as_str()),
            (StopReason::EndTurn, "end_turn")
        );
        assert_eq!(second.usage.cache_read_tokens, 7);
        assert_eq!(second.usage.input_tokens, 0);
        assert!(script.response(2).is_none());
    }

    #[test]
    fn stop_reasons_map_and_keep_the_raw_text() {
        let cases = [
            ("end_turn", StopReason::EndTurn),
            ("tool_use", StopReason::ToolUse),
            ("max_tokens", StopReason::MaxTokens),
            ("stop_sequence", StopReason::StopSequence),
            ("pause_turn", StopReason::PauseTurn),
            ("refusal", StopReason::Refusal),
            ("content_filter", StopReason::ContentFilter),
            ("guardrail_intervened", StopReason::Other),
        ];
        for (raw, normalized) in cases {
            let text = format!(
                r#"{{"responses": [{{"parts": [{{"type": "text", "text": "x"}}], "stop_reason": "{raw}"}}]}}"#
            );
            let script = Script::from_json(&text, "s.json").unwrap();
            let response = script.response(0).unwrap();
            assert_eq!(
                (response.stop_reason, response.stop_reason_raw.as_str()),
                (normalized, raw)
            );
            assert_eq!(response.model, "scripted");
        }
        let text = r#"{"responses": [{"parts": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]}"#;
        let response = Script::from_json(text, "s.json")
            .unwrap()
            .steps
            .remove(0)
            .response;
        assert_eq!(
            (response.stop_reason, response.stop_reason_raw.as_str()),
            (StopReason::ToolUse, "tool_use")
        );
    }

    #[test]
    fn bad_json_names_file_line_and_column() {
        let (path, reason) = script_error("{\n  \"responses\": [\n    {\"parts\": [}\n  ]\n}");
        assert_eq!(path, "bad.json");
        assert_eq!(reason, "expected value at line 3 column 16");
    }

    #[test]
    fn unknown_fields_are_rejected_where_they_are() {
        let top = "{\n  \"responses\": [],\n  \"modle\": \"x\"\n}";
        let (_, reason) = script_error(top);
        assert!(
            reason.starts_with("unknown field `modle`, expected one of"),
            "{reason}"
        );
        assert!(reason.ends_with("at line 3 column 9"), "{reason}");

        let response = "{\"responses\": [\n  {\"parts\": [{\"type\": \"text\", \"text\": \"x\"}],\n   \"stop_reasons\": \"end_turn\"}\n]}";
        let (_, reason) = script_error(response);
        assert!(
            reason.starts_with("responses[0]: unknown field `stop_reasons`"),
            "{reason}"
        );
        assert!(reason.ends_with("at line 3 column 17"), "{reason}");

        let part = "{\"responses\": [\n  {\"parts\": [\n    {\"type\": \"thinking\", \"text\": \"t\", \"sig\": \"s\"},\n    {\"type\": \"text\", \"text\": \"x\"}]}]}";
        let (_, reason) = script_error(part);
        assert_eq!(
            reason,
            "responses[0].parts[0]: unknown field `sig`, expected one of `type`, `text`, \
             `signature` at line 3 column 43"
        );

        let usage = "{\"responses\": [{\"parts\": [{\"type\": \"text\", \"text\": \"x\"}], \"usage\": {\"input\": 1}}]}";
        let (_, reason) = script_error(usage);
        assert!(
            reason.starts_with("responses[0]: unknown field `input`"),
            "{reason}"
        );
        assert!(reason.ends_with("at line 1 column 75"), "{reason}");
    }

    #[test]
    fn unknown_part_types_are_rejected() {
        let text =
            "{\"responses\": [{\"parts\": [\n  {\"type\": \"tool_result\", \"content\": \"x\"}]}]}";
        let (_, reason) = script_error(text);
        assert!(
            reason.starts_with("responses[0].parts[0]: unknown variant `tool_result`, expected one of `text`, `thinking`, `redacted_thinking`, `tool_use`"),
            "{reason}"
        );
        assert!(reason.ends_with("at line 2 column 24"), "{reason}");
        let (_, reason) = script_error("{\"responses\": [{\"parts\": [\"text\"]}]}");
        assert_eq!(
            reason,
            "responses[0].parts[0]: invalid type: string \"text\", expected a part object with a \
             \"type\" at line 1 column 32"
        );
    }

    #[test]
    fn thinking_without_signature_is_rejected() {
        let missing = "{\"responses\": [{\"parts\": [\n  {\"type\": \"thinking\", \"text\": \"hmm\"},\n  {\"type\": \"text\", \"text\": \"x\"}]}]}";
        let (path, reason) = script_error(missing);
        assert_eq!(path, "bad.json");
        assert_eq!(
            reason,
            "responses[0].parts[0]: missing field `signature` at line 2 column 37"
        );
        let empty = "{\"responses\": [{\"parts\": [\n  {\"type\": \"thinking\", \"text\": \"hmm\", \"signature\": \"\"},\n  {\"type\": \"text\", \"text\": \"x\"}]}]}";
        let (_, reason) = script_error(empty);
        assert_eq!(
            reason,
            "responses[0].parts[0]: thinking block has no signature (it cannot be sent back) at \
             line 2 column 3"
        );
    }

    #[test]
    fn empty_parts_and_other_response_rules_are_rejected_with_place() {
        let empty = "{\"responses\": [\n  {\"parts\": [{\"type\": \"text\", \"text\": \"ok\"}]},\n  {\"parts\": []}\n]}";
        let (_, reason) = script_error(empty);
        assert_eq!(
            reason,
            "responses[1]: response has no parts at line 3 column 3"
        );

        let ends_on_thinking = "{\"responses\": [{\"parts\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": \"redacted_thinking\", \"data\": \"d\"}]}]}";
        let (_, reason) = script_error(ends_on_thinking);
        assert_eq!(
            reason,
            "responses[0].parts[1]: assistant message ends on a thinking block at line 1 column 58"
        );

        let empty_text = r#"{"responses": [{"parts": [{"type": "text", "text": ""}]}]}"#;
        assert!(script_error(empty_text).1.contains("text part is empty"));

        let truncated = r#"{"responses": [{"parts": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}], "stop_reason": "max_tokens"}]}"#;
        assert!(script_error(truncated)
            .1
            .contains("hit max_tokens inside tool_use \"t\""));

        let no_responses = "{\"responses\": []}";
        assert!(script_error(no_responses)
            .1
            .contains("\"responses\" is empty"));
    }

    #[test]
    fn tool_use_needs_exactly_one_of_input_and_arguments_and_unique_ids() {
        let both = r#"{"responses": [{"parts": [{"type": "tool_use", "id": "t", "name": "n", "input": {}, "arguments": "{}"}]}]}"#;
        assert!(script_error(both)
            .1
            .contains("both \"input\" and \"arguments\""));
        let neither =
            r#"{"responses": [{"parts": [{"type": "tool_use", "id": "t", "name": "n"}]}]}"#;
        assert!(script_error(neither).1.contains("needs \"input\""));
        let null_input = r#"{"responses": [{"parts": [{"type": "tool_use", "id": "t", "name": "n", "input": null}]}]}"#;
        let script = Script::from_json(null_input, "s.json").unwrap();
        assert_eq!(
            script
                .response(0)
                .unwrap()
                .tool_uses()
                .next()
                .unwrap()
                .arguments,
            "null"
        );
        let duplicate = "{\"responses\": [\n {\"parts\": [{\"type\": \"tool_use\", \"id\": \"t\", \"name\": \"n\", \"input\": {}}]},\n {\"parts\": [{\"type\": \"tool_use\", \"id\": \"t\", \"name\": \"n\", \"input\": {}}]}]}";
        assert_eq!(
            script_error(duplicate).1,
            "responses[1].parts[0]: tool_use id \"t\" is already used by responses[0].parts[0]; \
             ids must be unique across the script because they share one session transcript at \
             line 3 column 13"
        );
    }

    #[test]
    fn unreadable_files_are_script_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.json");
        match ScriptedProvider::from_file(&path) {
            Err(Error::Script {
                path: shown,
                reason,
            }) => {
                assert!(shown.ends_with("absent.json"));
                assert!(reason.starts_with("cannot read the script"), "{reason}");
            }
            other => panic!("expected Error::Script, got {other:?}"),
        }
        let good = dir.path().join("good.json");
        std::fs::write(&good, EXAMPLE).unwrap();
        let provider = ScriptedProvider::from_file(&good).unwrap();
        assert_eq!(provider.script().len(), 2);
        assert_eq!(provider.script().path(), good.display().to_string());
    }

    fn results_for(response: &ModelResponse) -> Vec<ToolResult> {
        response
            .tool_uses()
            .map(|t| ToolResult {
                tool_use_id: t.id.clone(),
                content: ToolResultContent::Text("ok".into()),
                is_error: false,
            })
            .collect()
    }

    #[tokio::test]
    async fn the_response_is_chosen_by_assistant_message_count() {
        let provider = ScriptedProvider::from_json(EXAMPLE, "example.json").unwrap();
        let mut transcript = Transcript::new();
        transcript.push_system("be brief");
        transcript.push_user_text("what is 2+2?");
        let first = provider
            .call(
                &request(transcript.clone(), 1),
                &NoDeltas,
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        assert_eq!(&first, provider.script().response(0).unwrap());
        // The same transcript gets the same response: the provider keeps no state.
        let again = provider
            .call(
                &request(transcript.clone(), 2),
                &NoDeltas,
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        assert_eq!(again, first);

        transcript.push_response(&first);
        transcript.push_tool_results(results_for(&first));
        // A fresh provider, as in a new process, continues where the transcript is.
        let restarted = ScriptedProvider::from_json(EXAMPLE, "example.json").unwrap();
        let second = restarted
            .call(
                &request(transcript.clone(), 1),
                &NoDeltas,
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        assert_eq!(second.text(), "Done: 4.");
        cairn_ledger::validate_transcript(&{
            let mut t = transcript.clone();
            t.push_response(&second);
            t
        })
        .unwrap();

        transcript.push_response(&second);
        transcript.push_user_text("and now?");
        let err = provider
            .call(
                &request(transcript, 1),
                &NoDeltas,
                &ActivityContext::detached(),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::ScriptExhausted { path, responses: 2, call_index: 2 } if path == "example.json"),
            "{err:?}"
        );
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    }

    #[tokio::test]
    async fn deltas_concatenate_to_the_exact_texts() {
        let text = r#"{"responses": [{"parts": [
            {"type": "thinking", "text": "  First,\tthink  twice.\n\nThen act é ", "signature": "s"},
            {"type": "text", "text": "Hello,  wörld!\nNext line."},
            {"type": "tool_use", "id": "a", "name": "n", "input": {"expression": "(17 + 25) * 3", "note": "ünïcödé ünïcödé ünïcödé"}},
            {"type": "tool_use", "id": "b", "name": "n", "arguments": ""},
            {"type": "text", "text": "bye"}
        ]}]}"#;
        let provider = ScriptedProvider::from_json(text, "s.json").unwrap();
        let seen = Mutex::new(Vec::new());
        let sink = |d: Delta| seen.lock().unwrap().push(d);
        let response = provider
            .call(
                &request(Transcript::new(), 1),
                &sink,
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        let deltas = seen.into_inner().unwrap();

        let mut thinking = Vec::new();
        let mut visible = Vec::new();
        let mut arguments: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for delta in &deltas {
            match delta {
                Delta::Thinking(t) => thinking.push(t.clone()),
                Delta::Text(t) => visible.push(t.clone()),
                Delta::ToolArguments {
                    tool_use_id,
                    fragment,
                } => arguments
                    .entry(tool_use_id.clone())
                    .or_default()
                    .push(fragment.clone()),
            }
        }
        assert_eq!(
            thinking,
            [
                "  ",
                "First,\t",
                "think  ",
                "twice.\n\n",
                "Then ",
                "act ",
                "é "
            ]
        );
        assert_eq!(visible.concat(), format!("{}", response.text()));
        assert_eq!(visible, ["Hello,  ", "wörld!\n", "Next ", "line.", "bye"]);
        let a = response.tool_uses().next().unwrap();
        assert!(arguments["a"].len() > 1, "{:?}", arguments["a"]);
        assert_eq!(arguments["a"].concat(), a.arguments);
        assert!(
            !arguments.contains_key("b"),
            "empty arguments stream nothing"
        );
    }

    #[test]
    fn chunkers_preserve_text() {
        for text in ["", " ", "a", "  a  b  ", "x\n\ny", "ünïcödé wörds ok"] {
            assert_eq!(word_chunks(text).collect::<String>(), text);
            for max in [1, 2, 5] {
                let pieces: Vec<&str> = fragments(text, max).collect();
                assert_eq!(pieces.concat(), text);
                assert!(pieces.iter().all(|p| !p.is_empty()));
            }
        }
    }

    #[tokio::test]
    async fn fail_attempts_fail_the_first_attempts_transiently() {
        let text = r#"{"responses": [{"parts": [{"type": "text", "text": "finally"}], "fail_attempts": 2}]}"#;
        let provider = ScriptedProvider::from_json(text, "flaky.json").unwrap();
        for attempt in [1, 2] {
            let err = provider
                .call(
                    &request(Transcript::new(), attempt),
                    &NoDeltas,
                    &ActivityContext::detached(),
                )
                .await
                .unwrap_err();
            assert!(
                matches!(&err, Error::Provider { kind: ErrorKind::Transient, message } if message.contains(&format!("attempt {attempt}"))),
                "{err:?}"
            );
            assert!(err.is_retryable_by_default());
        }
        let response = provider
            .call(
                &request(Transcript::new(), 3),
                &NoDeltas,
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        assert_eq!(response.text(), "finally");
        // Attempt 0 counts as the first attempt, and never fails a response without failures.
        assert!(provider
            .call(
                &request(Transcript::new(), 0),
                &NoDeltas,
                &ActivityContext::detached()
            )
            .await
            .is_err());
        let steady =
            ScriptedProvider::from_json(&text.replace(", \"fail_attempts\": 2", ""), "s.json")
                .unwrap();
        assert!(steady
            .call(
                &request(Transcript::new(), 0),
                &NoDeltas,
                &ActivityContext::detached()
            )
            .await
            .is_ok());
    }

    #[tokio::test]
    #[allow(clippy::disallowed_methods)] // measures the simulated latency
    async fn delays_add_latency() {
        let text = r#"{"chunk_delay_ms": 10, "responses": [{"parts": [{"type": "text", "text": "a b c"}], "delay_ms": 40}]}"#;
        let provider = ScriptedProvider::from_json(text, "slow.json").unwrap();
        assert_eq!(provider.script().chunk_delay(), Duration::from_millis(10));
        let started = std::time::Instant::now();
        provider
            .call(
                &request(Transcript::new(), 1),
                &NoDeltas,
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        // 40 ms before answering, then 10 ms between each of the three chunks.
        assert!(
            started.elapsed() >= Duration::from_millis(60),
            "{:?}",
            started.elapsed()
        );
    }

    fn context(session_id: &str, turn: u32, round: u32, attempt: u32) -> CallContext {
        CallContext {
            session_id: session_id.into(),
            turn,
            round,
            attempt,
        }
    }

    #[test]
    fn jitter_is_bounded_deterministic_and_varied() {
        assert_eq!(jitter(&context("s1", 1, 1, 1), 0), 0);
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..20 {
            for turn in 1..4 {
                for round in 0..3 {
                    for attempt in 1..3 {
                        let c = context(&format!("chaos-{s:03}"), turn, round, attempt);
                        let j = jitter(&c, 50);
                        assert!(j <= 50, "{c:?}: {j}");
                        assert_eq!(jitter(&c.clone(), 50), j, "the same call, the same jitter");
                        seen.insert(j);
                    }
                }
            }
        }
        // 360 calls over 51 possible values: a hash that ignored its inputs would give one.
        assert!(seen.len() > 40, "{seen:?}");
        // Each field of the context moves it.
        let base = context("a", 1, 1, 1);
        for other in [
            context("b", 1, 1, 1),
            context("a", 2, 1, 1),
            context("a", 1, 2, 1),
            context("a", 1, 1, 2),
        ] {
            let differs = (1..=1000).any(|max| jitter(&base, max) != jitter(&other, max));
            assert!(differs, "{other:?} jitters like {base:?}");
        }
    }

    #[tokio::test]
    #[allow(clippy::disallowed_methods)] // measures the simulated latency
    async fn jitter_adds_its_share_of_latency() {
        let text = r#"{"responses": [{"parts": [{"type": "text", "text": "ok"}], "delay_ms": 5, "jitter_ms": 200}]}"#;
        let provider = ScriptedProvider::from_json(text, "jitter.json").unwrap();
        // A context whose jitter is large enough to measure.
        let mut req = request(Transcript::new(), 1);
        let extra = (1..100)
            .map(|a| (a, jitter(&context("s1", 1, 1, a), 200)))
            .find(|(_, j)| *j >= 60)
            .expect("some attempt jitters by 60 ms or more");
        req.context.attempt = extra.0;
        let started = std::time::Instant::now();
        provider
            .call(&req, &NoDeltas, &ActivityContext::detached())
            .await
            .unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(5 + extra.1),
            "{:?} < 5 + {} ms",
            started.elapsed(),
            extra.1
        );
    }

    #[tokio::test]
    async fn the_demo_script_loads_validates_and_plays() {
        let provider = ScriptedProvider::demo().unwrap();
        assert_eq!(provider.provider(), "scripted");
        let script = provider.script();
        assert_eq!((script.len(), script.model()), (2, "scripted-demo"));
        let first = script.response(0).unwrap();
        assert!(
            matches!(&first.parts[0], Part::Thinking { signature, .. } if !signature.is_empty())
        );
        let calls: Vec<(&str, &str)> = first
            .tool_uses()
            .map(|t| (t.name.as_str(), t.arguments.as_str()))
            .collect();
        assert_eq!(
            calls,
            [
                ("calculator", r#"{"expression":"(17 + 25) * 3"}"#),
                ("read_file", r#"{"path":"notes.txt"}"#)
            ]
        );
        assert_eq!(first.stop_reason, StopReason::ToolUse);
        let last = script.response(1).unwrap();
        assert!(
            matches!(&last.parts[0], Part::Thinking { signature, .. } if !signature.is_empty())
        );
        assert_eq!(last.stop_reason, StopReason::EndTurn);
        let answer = last.text();
        assert!(
            answer.contains("126") && answer.contains("Tuesday") && answer.contains("notes.txt"),
            "{answer}"
        );

        let mut transcript = Transcript::new();
        transcript.push_user_text("What is (17 + 25) * 3, and what do my notes say?");
        transcript.push_response(first);
        transcript.push_tool_results(results_for(first));
        transcript.push_response(last);
        cairn_ledger::validate_transcript(&transcript).unwrap();
    }
}
