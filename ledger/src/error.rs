//! The ledger's one error type: every validation failure names the message and part it found.

use std::fmt;

/// Result alias for ledger operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the pure ledger.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A transcript rule is broken at a precise place.
    #[error("invalid transcript at message {message}{}: {violation}", part_suffix(*.part))]
    InvalidTranscript {
        /// Index of the offending message.
        message: usize,
        /// Index of the offending part within that message, when one part is at fault.
        part: Option<usize>,
        /// Which rule is broken.
        violation: Violation,
    },
    /// A model response breaks a rule; `part` is the index in the response's parts.
    #[error("invalid model response{}: {violation}", part_suffix(*.part))]
    InvalidResponse {
        /// Index of the offending part, when one part is at fault.
        part: Option<usize>,
        /// Which rule is broken.
        violation: Violation,
    },
    /// Text that should hold JSON does not parse.
    #[error("invalid JSON: {reason}")]
    InvalidJson {
        /// The parser's message, with line and column.
        reason: String,
    },
}

fn part_suffix(part: Option<usize>) -> String {
    match part {
        Some(p) => format!(", part {p}"),
        None => String::new(),
    }
}

/// A transcript or response rule, as data so that callers can match on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A message has no parts.
    EmptyMessage,
    /// A text part is empty.
    EmptyText,
    /// A system message appears after a non-system message.
    SystemNotFirst,
    /// A part kind appears in a role that cannot carry it.
    PartNotAllowedInRole {
        /// The part kind.
        part_kind: &'static str,
        /// The message role.
        role: &'static str,
    },
    /// Thinking with no signature cannot be sent back to a provider; never patched.
    ThinkingWithoutSignature,
    /// Redacted thinking with no data.
    EmptyRedactedThinking,
    /// An assistant message ends on a thinking block.
    AssistantEndsOnThinking,
    /// A tool_use id is empty.
    EmptyToolUseId,
    /// A tool_use name is empty.
    EmptyToolName,
    /// A tool_use id appears twice in the transcript.
    DuplicateToolUseId {
        /// The repeated id.
        id: String,
    },
    /// A tool_use has no tool_result in the next user message.
    MissingToolResult {
        /// The unanswered tool_use id.
        tool_use_id: String,
    },
    /// A tool_result answers no tool_use of the previous assistant message, or answers one twice.
    UnexpectedToolResult {
        /// The tool_result's tool_use_id.
        tool_use_id: String,
    },
    /// Tool results are not in tool_use declaration order.
    ToolResultOutOfOrder {
        /// The id expected at this position.
        expected: String,
        /// The id found.
        found: String,
    },
    /// A tool_result follows text or another non-result part in its message.
    ToolResultAfterOtherContent,
    /// The message after an assistant message with tool_uses is not a user message.
    ToolResultsNotNext,
    /// A response carries no parts.
    EmptyResponse,
    /// A response stopped on `max_tokens` inside a tool_use: the call is incomplete and never run.
    TruncatedToolUse {
        /// The incomplete call's id.
        tool_use_id: String,
    },
    /// An image or document states an empty media type.
    EmptyMediaType {
        /// `image` or `document`.
        kind: &'static str,
    },
    /// An image or document has a media type its kind does not accept.
    UnsupportedMediaType {
        /// `image` or `document`.
        kind: &'static str,
        /// The media type given.
        media_type: String,
    },
    /// An image or document has no data.
    EmptyMediaData {
        /// `image` or `document`.
        kind: &'static str,
    },
    /// An image's or document's data is not valid standard base64.
    InvalidBase64 {
        /// `image` or `document`.
        kind: &'static str,
        /// The decoder's message, with the offending position.
        reason: String,
    },
    /// A plain-text document's bytes are not UTF-8.
    TextDocumentNotUtf8,
    /// An image's or document's URL is not an http(s) URL.
    InvalidMediaUrl {
        /// `image` or `document`.
        kind: &'static str,
        /// The URL given (its first 200 characters).
        url: String,
    },
    /// A block of a tool result made of blocks breaks a rule.
    InToolResultBlock {
        /// Index of the block in the result.
        block: usize,
        /// The rule it breaks.
        violation: Box<Violation>,
    },
    /// A tool result made of blocks has none.
    EmptyToolResultBlocks,
    /// An opaque part (or a text's citations) names no provider family, so no provider could
    /// ever be sent it.
    ProviderJsonWithoutFamily,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::EmptyMessage => write!(f, "message has no parts"),
            Violation::EmptyText => write!(f, "text part is empty"),
            Violation::SystemNotFirst => write!(f, "system message after a non-system message"),
            Violation::PartNotAllowedInRole { part_kind, role } => {
                write!(f, "{part_kind} part not allowed in a {role} message")
            }
            Violation::ThinkingWithoutSignature => {
                write!(f, "thinking block has no signature (it cannot be sent back)")
            }
            Violation::EmptyRedactedThinking => write!(f, "redacted thinking has no data"),
            Violation::AssistantEndsOnThinking => {
                write!(f, "assistant message ends on a thinking block")
            }
            Violation::EmptyToolUseId => write!(f, "tool_use id is empty"),
            Violation::EmptyToolName => write!(f, "tool_use name is empty"),
            Violation::DuplicateToolUseId { id } => write!(f, "tool_use id {id:?} is not unique"),
            Violation::MissingToolResult { tool_use_id } => {
                write!(f, "tool_use {tool_use_id:?} has no tool_result in the next user message")
            }
            Violation::UnexpectedToolResult { tool_use_id } => write!(
                f,
                "tool_result {tool_use_id:?} answers no open tool_use of the previous assistant message"
            ),
            Violation::ToolResultOutOfOrder { expected, found } => write!(
                f,
                "tool_result {found:?} out of declaration order (expected {expected:?})"
            ),
            Violation::ToolResultAfterOtherContent => {
                write!(f, "tool_result after other content (results must come first)")
            }
            Violation::ToolResultsNotNext => write!(
                f,
                "assistant message with tool_use is not followed by a user message of tool_results"
            ),
            Violation::EmptyResponse => write!(f, "response has no parts"),
            Violation::ProviderJsonWithoutFamily => write!(
                f,
                "opaque part or citations without a provider family; no provider could be sent it"
            ),
            Violation::TruncatedToolUse { tool_use_id } => write!(
                f,
                "response hit max_tokens inside tool_use {tool_use_id:?}; the call is incomplete"
            ),
            Violation::EmptyMediaType { kind } => write!(f, "{kind} has an empty media type"),
            Violation::UnsupportedMediaType { kind, media_type } => {
                let accepted = match *kind {
                    "image" => crate::media::IMAGE_MEDIA_TYPES.join(", "),
                    _ => crate::media::DOCUMENT_MEDIA_TYPES.join(", "),
                };
                write!(
                    f,
                    "{kind} media type {media_type:?} is not supported (accepted: {accepted})"
                )
            }
            Violation::EmptyMediaData { kind } => write!(f, "{kind} has no data"),
            Violation::InvalidBase64 { kind, reason } => {
                write!(f, "{kind} data is not valid base64: {reason}")
            }
            Violation::TextDocumentNotUtf8 => write!(f, "text/plain document is not UTF-8"),
            Violation::InvalidMediaUrl { kind, url } => {
                write!(f, "{kind} URL {url:?} is not an http(s) URL")
            }
            Violation::InToolResultBlock { block, violation } => {
                write!(f, "tool_result block {block}: {violation}")
            }
            Violation::EmptyToolResultBlocks => write!(f, "tool_result has an empty block list"),
        }
    }
}
