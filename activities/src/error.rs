//! The activities' one error type, and the classification the runtime's retry policy reads.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// Result alias for activity operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What class of failure an error is, so the runtime can decide on retries without knowing
/// which provider or tool produced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// A failure that may well pass on the next attempt (network blip, 5xx).
    Transient,
    /// The provider asked us to slow down (HTTP 429).
    RateLimited,
    /// The provider is overloaded (e.g. HTTP 529).
    Overloaded,
    /// The call took longer than its deadline.
    Timeout,
    /// The request itself is wrong; sending it again cannot help.
    InvalidRequest,
    /// The provider answered with something that breaks the canonical response rules.
    InvalidResponse,
    /// Credentials are missing or rejected, or the account may not make calls now (OpenAI's
    /// `insufficient_quota`: the plan's quota is used up, which waiting does not fix).
    Auth,
    /// A tool failed while running (not because of its arguments).
    ToolFailed,
    /// The activity was cancelled.
    Cancelled,
    /// A bug or broken environment on our side.
    Internal,
    /// The request is larger than the model's context window (OpenAI
    /// `context_length_exceeded`, Anthropic `prompt is too long`, Bedrock `Input is too long
    /// for requested model`): the same request fails the same way, a compacted one may pass.
    ContextTooLong,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 11] = [
        ErrorKind::Transient,
        ErrorKind::RateLimited,
        ErrorKind::Overloaded,
        ErrorKind::Timeout,
        ErrorKind::InvalidRequest,
        ErrorKind::InvalidResponse,
        ErrorKind::Auth,
        ErrorKind::ToolFailed,
        ErrorKind::Cancelled,
        ErrorKind::Internal,
        ErrorKind::ContextTooLong,
    ];

    /// The snake_case name, as recorded in histories and shown in views.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Transient => "transient",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::Timeout => "timeout",
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::InvalidResponse => "invalid_response",
            ErrorKind::Auth => "auth",
            ErrorKind::ToolFailed => "tool_failed",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Internal => "internal",
            ErrorKind::ContextTooLong => "context_too_long",
        }
    }

    /// Whether a retry policy with no overrides should try again.
    ///
    /// A wrong request, rejected credentials, a cancellation or a context too long give the
    /// same outcome on every attempt, so retrying them only burns budget; every other kind
    /// may pass next time.
    pub fn is_retryable_by_default(self) -> bool {
        !matches!(
            self,
            ErrorKind::InvalidRequest
                | ErrorKind::Auth
                | ErrorKind::Cancelled
                | ErrorKind::ContextTooLong
        )
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Errors of model providers and tools.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A script file is unreadable or malformed; `reason` says where (line and column).
    #[error("script {path}: {reason}")]
    Script {
        /// The script's path, as given.
        path: String,
        /// What is wrong, and where.
        reason: String,
    },
    /// The transcript asks for a response past the end of the script.
    #[error(
        "script {path} is exhausted: it has {responses} responses, and call {call_index} \
         (0-based, counted by assistant messages in the transcript) asks for one more"
    )]
    ScriptExhausted {
        /// The script's path, as given.
        path: String,
        /// How many responses the script has.
        responses: usize,
        /// The 0-based index of the response asked for.
        call_index: usize,
    },
    /// A model provider failed; `kind` classifies how.
    #[error("model provider error ({kind}): {message}")]
    Provider {
        /// The failure class.
        kind: ErrorKind,
        /// What the provider said, or what went wrong talking to it.
        message: String,
    },
    /// An HTTP exchange with a provider failed (a status, or the transport).
    #[error("{}{message}", status.map(|s| format!("HTTP {s}: ")).unwrap_or_default())]
    Http {
        /// The failure class.
        kind: ErrorKind,
        /// The HTTP status, when the provider answered.
        status: Option<u16>,
        /// The provider's message, or the transport error.
        message: String,
        /// The provider's `retry-after`, in milliseconds.
        retry_after_ms: Option<u64>,
    },
    /// A provider's stream broke its protocol or ended early: an error, never a completion.
    #[error("{provider} stream: {message}")]
    Stream {
        /// Provider family.
        provider: String,
        /// Transient for early ends; InvalidResponse for protocol violations.
        kind: ErrorKind,
        /// What is wrong, and where in the stream.
        message: String,
    },
    /// A provider went silent: no response headers, or no body bytes, for longer than the
    /// configured idle timeout. The connection is presumed stalled; a new attempt may succeed.
    #[error(
        "{provider}: nothing received for {waited:?} while waiting for {waiting_for} \
         (idle timeout; raise it in the provider's settings or environment if the model \
         legitimately stays silent longer)"
    )]
    IdleTimeout {
        /// Provider family.
        provider: String,
        /// What the call was waiting for, e.g. `the response headers`.
        waiting_for: String,
        /// How long nothing arrived: the configured idle timeout.
        waited: Duration,
    },
    /// One stream event (an SSE event, or an AWS event-stream frame) outgrew the per-event cap,
    /// so it was refused rather than buffered further.
    #[error(
        "{provider} stream: {what} exceeds the cap of {limit_bytes} bytes per event \
         (max_event_bytes; raise it in the provider's settings or environment)"
    )]
    EventTooLarge {
        /// Provider family.
        provider: String,
        /// The cap, in bytes.
        limit_bytes: usize,
        /// Which event and where, e.g. `the event at byte 1024 (2000000 bytes so far)`.
        what: String,
    },
    /// A provider answered, but its response breaks the canonical response rules.
    #[error("provider {provider} returned an invalid response: {source}")]
    InvalidResponse {
        /// The provider family.
        provider: String,
        /// The broken rule.
        #[source]
        source: cairn_ledger::Error,
    },
    /// A tool call's arguments are not valid JSON or do not match the tool's input schema.
    #[error("invalid arguments for tool {tool}: {reason}")]
    InvalidArguments {
        /// The tool's name.
        tool: String,
        /// What is wrong, and where.
        reason: String,
    },
    /// No tool of this name is registered.
    #[error("unknown tool {name:?}")]
    UnknownTool {
        /// The name asked for.
        name: String,
    },
    /// A tool failed while running, for a reason other than its arguments.
    #[error("tool {tool} failed: {message}")]
    ToolFailed {
        /// The tool's name.
        tool: String,
        /// What went wrong.
        message: String,
    },
    /// A tool did not answer within its own time limit (an MCP server's per-call timeout).
    #[error("tool {tool} did not answer within {timeout_ms} ms")]
    ToolTimeout {
        /// The tool's name.
        tool: String,
        /// The limit it exceeded.
        timeout_ms: u64,
    },
    /// A filesystem operation failed on our side.
    #[error("io error on {path}: {source}")]
    Io {
        /// The path operated on.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The activity was cancelled before it finished.
    #[error("cancelled: {reason}")]
    Cancelled {
        /// Why, e.g. the session was cancelled or the deadline passed.
        reason: String,
    },
}

impl Error {
    /// The failure class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Script { .. }
            | Error::ScriptExhausted { .. }
            | Error::InvalidArguments { .. }
            | Error::UnknownTool { .. } => ErrorKind::InvalidRequest,
            Error::Provider { kind, .. } => *kind,
            Error::Http { kind, .. } | Error::Stream { kind, .. } => *kind,
            Error::IdleTimeout { .. } | Error::ToolTimeout { .. } => ErrorKind::Timeout,
            Error::InvalidResponse { .. } | Error::EventTooLarge { .. } => {
                ErrorKind::InvalidResponse
            }
            Error::ToolFailed { .. } => ErrorKind::ToolFailed,
            Error::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::TimedOut => ErrorKind::Timeout,
                std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock => {
                    ErrorKind::Transient
                }
                _ => ErrorKind::Internal,
            },
            Error::Cancelled { .. } => ErrorKind::Cancelled,
        }
    }

    /// Whether a retry policy with no overrides should try again; see
    /// [`ErrorKind::is_retryable_by_default`].
    pub fn is_retryable_by_default(&self) -> bool {
        self.kind().is_retryable_by_default()
    }

    /// How long the provider asked us to wait before retrying, when it said.
    pub fn retry_after_ms(&self) -> Option<u64> {
        match self {
            Error::Http { retry_after_ms, .. } => *retry_after_ms,
            _ => None,
        }
    }

    /// The same error with every text field passed through `scrub`: how secrets are removed
    /// from errors before they leave an activity (see `providers::secrets`). Wrapped sources
    /// (I/O errors, ledger rule violations) are ours and carry no provider text, so they stay.
    pub(crate) fn map_text(self, scrub: impl Fn(&str) -> String) -> Error {
        match self {
            Error::Script { path, reason } => Error::Script {
                path: scrub(&path),
                reason: scrub(&reason),
            },
            Error::ScriptExhausted { .. } => self,
            Error::Provider { kind, message } => Error::Provider {
                kind,
                message: scrub(&message),
            },
            Error::Http {
                kind,
                status,
                message,
                retry_after_ms,
            } => Error::Http {
                kind,
                status,
                message: scrub(&message),
                retry_after_ms,
            },
            Error::Stream {
                provider,
                kind,
                message,
            } => Error::Stream {
                provider,
                kind,
                message: scrub(&message),
            },
            Error::IdleTimeout { .. } | Error::EventTooLarge { .. } | Error::ToolTimeout { .. } => {
                self
            }
            Error::InvalidResponse { .. } => self,
            Error::InvalidArguments { tool, reason } => Error::InvalidArguments {
                tool,
                reason: scrub(&reason),
            },
            Error::UnknownTool { name } => Error::UnknownTool { name: scrub(&name) },
            Error::ToolFailed { tool, message } => Error::ToolFailed {
                tool,
                message: scrub(&message),
            },
            Error::Io { path, source } => Error::Io {
                path: scrub(&path),
                source,
            },
            Error::Cancelled { reason } => Error::Cancelled {
                reason: scrub(&reason),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_names_are_snake_case_and_match_serde() {
        let names: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "transient",
                "rate_limited",
                "overloaded",
                "timeout",
                "invalid_request",
                "invalid_response",
                "auth",
                "tool_failed",
                "cancelled",
                "internal",
                "context_too_long"
            ]
        );
        for kind in ErrorKind::ALL {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
            assert_eq!(serde_json::from_str::<ErrorKind>(&json).unwrap(), kind);
        }
    }

    #[test]
    fn only_request_auth_cancel_and_context_are_not_retryable() {
        let not_retryable: Vec<ErrorKind> = ErrorKind::ALL
            .into_iter()
            .filter(|k| !k.is_retryable_by_default())
            .collect();
        assert_eq!(
            not_retryable,
            [
                ErrorKind::InvalidRequest,
                ErrorKind::Auth,
                ErrorKind::Cancelled,
                ErrorKind::ContextTooLong
            ]
        );
    }

    #[test]
    fn every_variant_is_classified() {
        let cases = [
            (
                Error::Script {
                    path: "s.json".into(),
                    reason: "bad".into(),
                },
                ErrorKind::InvalidRequest,
            ),
            (
                Error::ScriptExhausted {
                    path: "s.json".into(),
                    responses: 1,
                    call_index: 1,
                },
                ErrorKind::InvalidRequest,
            ),
            (
                Error::Provider {
                    kind: ErrorKind::RateLimited,
                    message: "429".into(),
                },
                ErrorKind::RateLimited,
            ),
            (
                Error::InvalidResponse {
                    provider: "p".into(),
                    source: cairn_ledger::Error::InvalidJson { reason: "x".into() },
                },
                ErrorKind::InvalidResponse,
            ),
            (
                Error::InvalidArguments {
                    tool: "t".into(),
                    reason: "r".into(),
                },
                ErrorKind::InvalidRequest,
            ),
            (
                Error::UnknownTool { name: "t".into() },
                ErrorKind::InvalidRequest,
            ),
            (
                Error::ToolFailed {
                    tool: "t".into(),
                    message: "m".into(),
                },
                ErrorKind::ToolFailed,
            ),
            (
                Error::Io {
                    path: "p".into(),
                    source: std::io::Error::from(std::io::ErrorKind::TimedOut),
                },
                ErrorKind::Timeout,
            ),
            (
                Error::Io {
                    path: "p".into(),
                    source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
                },
                ErrorKind::Internal,
            ),
            (
                Error::Cancelled {
                    reason: "stop".into(),
                },
                ErrorKind::Cancelled,
            ),
            (
                Error::IdleTimeout {
                    provider: "p".into(),
                    waiting_for: "the response headers".into(),
                    waited: Duration::from_secs(1),
                },
                ErrorKind::Timeout,
            ),
            (
                Error::EventTooLarge {
                    provider: "p".into(),
                    limit_bytes: 16,
                    what: "the event at byte 0".into(),
                },
                ErrorKind::InvalidResponse,
            ),
        ];
        for (error, kind) in cases {
            assert_eq!(error.kind(), kind, "{error}");
            assert_eq!(
                error.is_retryable_by_default(),
                kind.is_retryable_by_default()
            );
        }
    }

    #[test]
    fn messages_say_what_and_where() {
        let e = Error::ScriptExhausted {
            path: "demo.json".into(),
            responses: 2,
            call_index: 2,
        };
        let text = e.to_string();
        assert!(
            text.contains("demo.json") && text.contains("2 responses"),
            "{text}"
        );
    }
}
