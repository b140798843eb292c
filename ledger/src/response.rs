//! The canonical model response every provider adapter produces.

use crate::transcript::{Part, ToolUse};
use serde::{Deserialize, Serialize};

/// Why the model stopped, normalized across providers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model finished its answer.
    EndTurn,
    /// The model wants tool results.
    ToolUse,
    /// The output limit was reached.
    MaxTokens,
    /// A stop sequence matched.
    StopSequence,
    /// The provider paused a long turn; continue it.
    PauseTurn,
    /// The model refused.
    Refusal,
    /// A content filter or guardrail intervened.
    ContentFilter,
    /// Anything else; the raw reason says what.
    Other,
}

/// Token usage of one model call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Usage {
    /// Input tokens (not counting cache reads).
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read_tokens: u64,
    /// Input tokens written to the prompt cache.
    pub cache_write_tokens: u64,
    /// Reasoning tokens, where the provider reports them separately.
    pub reasoning_tokens: u64,
}

impl Usage {
    /// Field-wise sum, saturating: the numbers come from providers and workers, and a sum
    /// that wrapped would read as little usage and let a budget pass.
    pub fn add(&mut self, other: &Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cache_read_tokens = self
            .cache_read_tokens
            .saturating_add(other.cache_read_tokens);
        self.cache_write_tokens = self
            .cache_write_tokens
            .saturating_add(other.cache_write_tokens);
        self.reasoning_tokens = self.reasoning_tokens.saturating_add(other.reasoning_tokens);
    }
}

/// One complete model response in canonical form.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelResponse {
    /// Provider family that produced it.
    pub provider: String,
    /// Model name.
    pub model: String,
    /// Assistant parts in provider order.
    pub parts: Vec<Part>,
    /// The stop reason exactly as the provider sent it.
    pub stop_reason_raw: String,
    /// The normalized stop reason.
    pub stop_reason: StopReason,
    /// Token usage.
    pub usage: Usage,
}

impl ModelResponse {
    /// The tool calls in declaration order.
    pub fn tool_uses(&self) -> impl Iterator<Item = &ToolUse> {
        self.parts.iter().filter_map(|p| match p {
            Part::ToolUse(t) => Some(t),
            _ => None,
        })
    }

    /// The concatenated visible text.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for part in &self.parts {
            if let Part::Text { text, .. } = part {
                out.push_str(text);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_sums_saturate_instead_of_wrapping() {
        let huge = Usage {
            input_tokens: u64::MAX / 2 + 1,
            output_tokens: 1,
            cache_read_tokens: u64::MAX,
            cache_write_tokens: 2,
            reasoning_tokens: u64::MAX / 2 + 1,
        };
        let mut sum = huge;
        sum.add(&huge);
        assert_eq!(
            sum,
            Usage {
                input_tokens: u64::MAX,
                output_tokens: 2,
                cache_read_tokens: u64::MAX,
                cache_write_tokens: 4,
                reasoning_tokens: u64::MAX,
            }
        );
    }
}
