//! The canonical transcript: messages of ordered parts, exactly as a provider must get them back.

use crate::json::JsonText;
use crate::media::{Media, MediaSource, ToolResultBlock};
use crate::projection::project_tool_result;
use crate::response::ModelResponse;
use serde::{Deserialize, Serialize};

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Instructions ahead of the conversation.
    System,
    /// The person, and tool results.
    User,
    /// The model.
    Assistant,
}

impl Role {
    /// The role's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// Which provider and model produced an assistant message.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Provenance {
    /// Provider family, e.g. `anthropic`, `scripted`.
    pub provider: String,
    /// Model name as the provider spells it.
    pub model: String,
}

/// A tool call the model made.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ToolUse {
    /// The provider's call id; results refer to it.
    pub id: String,
    /// Tool name.
    pub name: String,
    /// The arguments as the exact JSON text the model produced (it may even be invalid JSON).
    pub arguments: String,
    /// A per-call provider signature, when the provider issues one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

/// The content of a tool result.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolResultContent {
    /// A JSON value, kept as its exact text.
    Json(JsonText),
    /// Plain text.
    Text(String),
    /// Text and media blocks in order (a tool that returns images, an MCP result with images).
    Blocks(Vec<ToolResultBlock>),
}

impl ToolResultContent {
    /// The canonical JSON text of this content: the JSON itself, or the text as a JSON string.
    pub fn canonical_json(&self) -> String {
        match self {
            ToolResultContent::Json(json) => json.as_str().to_owned(),
            ToolResultContent::Text(text) => {
                serde_json::to_string(text).unwrap_or_else(|_| String::from("\"\""))
            }
            ToolResultContent::Blocks(blocks) => {
                let blocks: Vec<serde_json::Value> = blocks.iter().map(block_json).collect();
                serde_json::to_string(&blocks).unwrap_or_else(|_| String::from("[]"))
            }
        }
    }

    /// The text of this content without its media: the JSON or text itself, or the text
    /// blocks joined by newlines with a `[image]`/`[document]` marker for each media block.
    /// What a text-only view or a provider that takes only text in a tool result shows.
    pub fn text_view(&self) -> String {
        match self {
            ToolResultContent::Json(json) => json.as_str().to_owned(),
            ToolResultContent::Text(text) => text.clone(),
            ToolResultContent::Blocks(blocks) => blocks
                .iter()
                .map(|b| match b {
                    ToolResultBlock::Text { text } => text.clone(),
                    ToolResultBlock::Media(m) => format!("[{}]", m.kind.as_str()),
                })
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    /// The media blocks of this content, in order (none for JSON or text).
    pub fn media(&self) -> Vec<&Media> {
        match self {
            ToolResultContent::Blocks(blocks) => blocks
                .iter()
                .filter_map(|b| match b {
                    ToolResultBlock::Media(m) => Some(m),
                    ToolResultBlock::Text { .. } => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// A block as a self-describing JSON object (`{"type":"text",...}`, `{"type":"image",...}`).
fn block_json(block: &ToolResultBlock) -> serde_json::Value {
    match block {
        ToolResultBlock::Text { text } => serde_json::json!({"type": "text", "text": text}),
        ToolResultBlock::Media(media) => {
            let mut value = match &media.source {
                MediaSource::Base64 { media_type, data } => serde_json::json!({
                    "type": media.kind.as_str(), "media_type": media_type, "data": data,
                }),
                MediaSource::Url { url } => {
                    serde_json::json!({"type": media.kind.as_str(), "url": url})
                }
            };
            if let Some(name) = &media.name {
                value["name"] = serde_json::Value::from(name.as_str());
            }
            value
        }
    }
}

/// The answer to one tool_use.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ToolResult {
    /// The id of the tool_use this answers.
    pub tool_use_id: String,
    /// What the tool returned (or the error text).
    pub content: ToolResultContent,
    /// Whether the content describes a failure.
    pub is_error: bool,
}

/// One block of a message, in provider order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// Visible text.
    Text {
        /// The text; never empty.
        text: String,
        /// The provider's id of the output item that carried this text, when it must be sent
        /// back (OpenAI Responses `msg_…` items, which a reasoning item is paired with).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_id: Option<String>,
        /// The citations the provider attached to this text, kept raw: shown to no one, sent
        /// back only to the family that produced them (the text itself goes to every provider).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        citations: Option<ProviderJson>,
    },
    /// Reasoning with the provider's signature. Kept byte-exact and in position.
    Thinking {
        /// Reasoning text; may be empty when the provider omits it.
        text: String,
        /// The provider's signature; required.
        signature: String,
    },
    /// Reasoning the provider encrypted; sent back as is.
    RedactedThinking {
        /// Opaque data.
        data: String,
    },
    /// Unsigned reasoning text (OpenAI-compatible servers' `reasoning_content`): sent back only
    /// to the provider family that produced it.
    Reasoning {
        /// The reasoning text.
        text: String,
    },
    /// A provider's reasoning item kept raw (OpenAI Responses `reasoning` with
    /// `encrypted_content`): sent back verbatim and in position.
    ReasoningItem {
        /// The item exactly as the provider produced it.
        item: JsonText,
    },
    /// A tool call.
    ToolUse(ToolUse),
    /// A tool call's answer.
    ToolResult(ToolResult),
    /// An image by reference (an http(s) URL or a `data:` URI), the first image shape; new
    /// content uses [`Part::Media`], which says what the source is.
    Image {
        /// MIME type, e.g. `image/png`.
        media_type: String,
        /// Where the bytes are: a content hash or URI.
        data_ref: String,
    },
    /// An image or a document (user messages only), by its bytes or a URL.
    Media(Media),
    /// A block the ledger does not model (a server tool's call or result, a new block type),
    /// kept exactly as the provider sent it and in position: sent back verbatim to the same
    /// provider family, dropped for any other.
    Opaque(ProviderJson),
}

/// JSON a provider family produced, kept as its exact text for that family alone.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProviderJson {
    /// The provider family, e.g. `anthropic`, `openai-responses`.
    pub provider: String,
    /// The JSON exactly as received.
    pub json: JsonText,
}

impl ProviderJson {
    /// `json` of `provider`.
    pub fn new(provider: impl Into<String>, json: JsonText) -> Self {
        ProviderJson {
            provider: provider.into(),
            json,
        }
    }

    /// The JSON when it belongs to `family`.
    pub fn for_family(&self, family: &str) -> Option<&JsonText> {
        (self.provider == family).then_some(&self.json)
    }
}

impl Part {
    /// A text part.
    pub fn text(text: impl Into<String>) -> Part {
        Part::Text {
            text: text.into(),
            item_id: None,
            citations: None,
        }
    }

    /// The part kind's name, for errors and views.
    pub fn kind(&self) -> &'static str {
        match self {
            Part::Text { .. } => "text",
            Part::Thinking { .. } => "thinking",
            Part::RedactedThinking { .. } => "redacted_thinking",
            Part::Reasoning { .. } => "reasoning",
            Part::ReasoningItem { .. } => "reasoning_item",
            Part::ToolUse(_) => "tool_use",
            Part::ToolResult(_) => "tool_result",
            Part::Image { .. } => "image",
            Part::Media(media) => media.kind.as_str(),
            Part::Opaque(_) => "opaque",
        }
    }

    /// Whether this part is reasoning (thinking or redacted thinking).
    pub fn is_reasoning(&self) -> bool {
        matches!(
            self,
            Part::Thinking { .. }
                | Part::RedactedThinking { .. }
                | Part::Reasoning { .. }
                | Part::ReasoningItem { .. }
        )
    }

    /// Whether this part may only go back to the provider family that produced it: reasoning
    /// and opaque blocks (such a part of another family is dropped when the provider changes).
    pub fn is_provider_bound(&self) -> bool {
        self.is_reasoning() || matches!(self, Part::Opaque(_))
    }

    /// Whether `family` may receive this part as it is ([`Part::for_family`] would return a
    /// copy of it): not an opaque block or citations of another family.
    pub fn is_whole_for_family(&self, family: &str) -> bool {
        match self {
            Part::Opaque(opaque) => opaque.provider == family,
            Part::Text {
                citations: Some(c), ..
            } => c.provider == family,
            _ => true,
        }
    }

    /// This part as `family` may receive it: `None` when it is an opaque block of another
    /// family; text loses the citations of another family.
    pub fn for_family(&self, family: &str) -> Option<Part> {
        match self {
            Part::Opaque(opaque) if opaque.provider != family => None,
            Part::Text {
                text,
                item_id,
                citations: Some(c),
            } if c.provider != family => Some(Part::Text {
                text: text.clone(),
                item_id: item_id.clone(),
                citations: None,
            }),
            other => Some(other.clone()),
        }
    }
}

/// One message.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// Ordered parts.
    pub parts: Vec<Part>,
    /// For assistant messages: which provider and model produced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<Provenance>,
}

/// An ordered list of messages; the state a provider request is rendered from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Transcript {
    /// The messages, oldest first.
    pub messages: Vec<Message>,
}

impl Transcript {
    /// An empty transcript.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a system message.
    pub fn push_system(&mut self, text: impl Into<String>) {
        self.messages.push(Message {
            role: Role::System,
            parts: vec![Part::text(text)],
            provenance: None,
        });
    }

    /// Appends a user message of text.
    pub fn push_user_text(&mut self, text: impl Into<String>) {
        self.messages.push(Message {
            role: Role::User,
            parts: vec![Part::text(text)],
            provenance: None,
        });
    }

    /// Appends a user message of media followed by text (either may be absent, not both).
    /// Media come first: Anthropic documents that Claude works best with images and documents
    /// placed before the text about them.
    pub fn push_user(&mut self, text: impl Into<String>, media: &[Media]) {
        let text = text.into();
        let mut parts: Vec<Part> = media.iter().cloned().map(Part::Media).collect();
        if !text.is_empty() {
            parts.push(Part::text(text));
        }
        self.messages.push(Message {
            role: Role::User,
            parts,
            provenance: None,
        });
    }

    /// Appends a model response as an assistant message, parts in provider order.
    pub fn push_response(&mut self, response: &ModelResponse) {
        self.messages.push(Message {
            role: Role::Assistant,
            parts: response.parts.clone(),
            provenance: Some(Provenance {
                provider: response.provider.clone(),
                model: response.model.clone(),
            }),
        });
    }

    /// Appends one user message of tool results, in the order given, each projected to the
    /// transcript size limit.
    pub fn push_tool_results(&mut self, results: impl IntoIterator<Item = ToolResult>) {
        let parts: Vec<Part> = results
            .into_iter()
            .map(|r| Part::ToolResult(project_tool_result(r)))
            .collect();
        if parts.is_empty() {
            return;
        }
        self.messages.push(Message {
            role: Role::User,
            parts,
            provenance: None,
        });
    }

    /// The tool_uses of the last message when it is an assistant message, in declaration order.
    pub fn trailing_tool_uses(&self) -> Vec<&ToolUse> {
        match self.messages.last() {
            Some(m) if m.role == Role::Assistant => m
                .parts
                .iter()
                .filter_map(|p| match p {
                    Part::ToolUse(t) => Some(t),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The canonical JSON bytes of the transcript: deterministic, compact, struct-ordered.
    pub fn canonical_json(&self) -> Vec<u8> {
        // Serializing plain data with string keys cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}
