//! What a model call is asked with: the model settings, the tool specs, and the live deltas a
//! streaming call emits (presentation only; the history records the final response once).

use crate::json::JsonText;
use serde::{Deserialize, Serialize};

/// A tool as the model sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Tool name, unique within a session.
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// JSON Schema of the tool's input object.
    pub input_schema: JsonText,
}

/// Which model to call and how.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Provider family: `scripted`, later `anthropic`, `openai`, ...
    pub provider: String,
    /// Model name; for `scripted`, the script file's path.
    pub model: String,
    /// Output token limit, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Extended-thinking budget, when thinking is enabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking_budget_tokens: Option<u32>,
}

impl ToolSpec {
    /// A tool spec whose input is described by the JSON Schema `input_schema`.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        input_schema: &serde_json::Value,
    ) -> Self {
        ToolSpec {
            name: name.into(),
            description: description.into(),
            input_schema: JsonText::from_value(input_schema),
        }
    }
}

impl ModelSpec {
    /// The model `model` of `provider` (e.g. `anthropic`, `claude-sonnet-4-5`), without a
    /// token limit or thinking budget.
    pub fn new(provider: impl Into<String>, model: impl Into<String>) -> Self {
        ModelSpec {
            provider: provider.into(),
            model: model.into(),
            max_tokens: None,
            thinking_budget_tokens: None,
        }
    }

    /// Parses `PROVIDER:MODEL`, e.g. `scripted:demo.json`.
    pub fn parse(text: &str) -> Option<ModelSpec> {
        let (provider, model) = text.split_once(':')?;
        if provider.is_empty() || model.is_empty() {
            return None;
        }
        Some(ModelSpec {
            provider: provider.to_owned(),
            model: model.to_owned(),
            max_tokens: None,
            thinking_budget_tokens: None,
        })
    }
}

/// A fragment of a response while it streams.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Delta {
    /// Visible text.
    Text(String),
    /// Reasoning text.
    Thinking(String),
    /// A fragment of a tool call's arguments.
    ToolArguments {
        /// The call's id.
        tool_use_id: String,
        /// The fragment.
        fragment: String,
    },
}
