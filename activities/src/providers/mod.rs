//! HTTP model providers: each renders its request from the ledger alone, checks the provider's
//! rules as pure functions before sending, parses the stream strictly into a canonical
//! response, and classifies errors for the retry policy.
//!
//! Every provider module has the same shape: a pure `render(&ModelRequest) -> Result<Value>`
//! (validation + the exact request body), a pure stream parser fed one wire event at a time,
//! and a `ModelProvider` that glues them to HTTP through [`http`].

pub mod alias;
pub mod anthropic;
pub mod bedrock;
pub mod http;
pub mod openai_chat;
pub mod openai_responses;

use crate::error::{Error, ErrorKind, Result};
use crate::model::ModelRequest;

/// A provider wire format a request can be rendered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestFormat {
    /// Anthropic Messages.
    Anthropic,
    /// OpenAI Chat Completions (and compatible servers).
    OpenAiChat,
    /// OpenAI Responses.
    OpenAiResponses,
    /// Amazon Bedrock Converse.
    Bedrock,
}

impl RequestFormat {
    /// Parses a format or provider name: `anthropic`, `openai-chat` (or `openai`),
    /// `openai-responses`, `bedrock`.
    pub fn parse(name: &str) -> Result<RequestFormat> {
        match name {
            "anthropic" => Ok(RequestFormat::Anthropic),
            "openai-chat" | "openai" => Ok(RequestFormat::OpenAiChat),
            "openai-responses" => Ok(RequestFormat::OpenAiResponses),
            "bedrock" => Ok(RequestFormat::Bedrock),
            other => Err(Error::Provider {
                kind: ErrorKind::InvalidRequest,
                message: format!(
                    "unknown request format {other:?} (anthropic, openai-chat, openai-responses, bedrock)"
                ),
            }),
        }
    }
}

/// The exact request body `format` would send next for `request` (after its provider's checks).
pub fn render_request(format: RequestFormat, request: &ModelRequest) -> Result<serde_json::Value> {
    match format {
        RequestFormat::Anthropic => anthropic::render(request),
        RequestFormat::OpenAiChat => openai_chat::render(request),
        RequestFormat::OpenAiResponses => openai_responses::render(request),
        RequestFormat::Bedrock => bedrock::render(request),
    }
}
