//! How many bytes a transcript holds in memory, estimated: what bounds a cache of transcripts
//! by bytes rather than by count.
//!
//! The estimate counts each string's length (the text, ids, signatures, raw JSON, base64 data)
//! and the inline size of each message and part. It leaves out allocator rounding and spare
//! capacity, so it is a little under the true figure, and it is deterministic: the same
//! transcript gives the same count on every machine and after every replay.

use crate::media::{Media, MediaSource, ToolResultBlock};
use crate::transcript::{Message, Part, ToolResultContent, Transcript};
use std::mem::size_of;

impl Transcript {
    /// The estimated bytes the transcript holds in memory (see the module docs).
    pub fn heap_bytes(&self) -> usize {
        size_of::<Transcript>() + self.messages.iter().map(Message::heap_bytes).sum::<usize>()
    }
}

impl Message {
    /// The estimated bytes the message holds in memory, its own inline size included.
    pub fn heap_bytes(&self) -> usize {
        let provenance = self
            .provenance
            .as_ref()
            .map_or(0, |p| p.provider.len() + p.model.len());
        size_of::<Message>() + provenance + self.parts.iter().map(part_bytes).sum::<usize>()
    }
}

/// A part's inline size and the strings it owns.
fn part_bytes(part: &Part) -> usize {
    let owned = match part {
        Part::Text {
            text,
            item_id,
            citations,
        } => {
            text.len()
                + item_id.as_ref().map_or(0, String::len)
                + citations
                    .as_ref()
                    .map_or(0, |c| c.provider.len() + c.json.as_str().len())
        }
        Part::Thinking { text, signature } => text.len() + signature.len(),
        Part::RedactedThinking { data } => data.len(),
        Part::Reasoning { text } => text.len(),
        Part::ReasoningItem { item } => item.as_str().len(),
        Part::ToolUse(call) => {
            call.id.len()
                + call.name.len()
                + call.arguments.len()
                + call.signature.as_ref().map_or(0, String::len)
        }
        Part::ToolResult(result) => {
            result.tool_use_id.len()
                + match &result.content {
                    ToolResultContent::Json(json) => json.as_str().len(),
                    ToolResultContent::Text(text) => text.len(),
                    ToolResultContent::Blocks(blocks) => blocks
                        .iter()
                        .map(|block| {
                            size_of::<ToolResultBlock>()
                                + match block {
                                    ToolResultBlock::Text { text } => text.len(),
                                    ToolResultBlock::Media(media) => media_bytes(media),
                                }
                        })
                        .sum(),
                }
        }
        Part::Image {
            media_type,
            data_ref,
        } => media_type.len() + data_ref.len(),
        Part::Media(media) => media_bytes(media),
        Part::Opaque(json) => json.provider.len() + json.json.as_str().len(),
    };
    size_of::<Part>() + owned
}

/// The strings a media block owns.
fn media_bytes(media: &Media) -> usize {
    let source = match &media.source {
        MediaSource::Base64 { media_type, data } => media_type.len() + data.len(),
        MediaSource::Url { url } => url.len(),
    };
    source + media.name.as_ref().map_or(0, String::len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transcript::{ToolResult, ToolUse};
    use crate::{ModelResponse, StopReason, Usage};

    #[test]
    fn the_estimate_counts_every_string_and_grows_by_each_message() {
        let mut transcript = Transcript::new();
        let empty = transcript.heap_bytes();
        assert_eq!(empty, size_of::<Transcript>());
        transcript.push_user_text("x".repeat(1_000));
        let one = transcript.heap_bytes();
        assert_eq!(
            one - empty,
            size_of::<Message>() + size_of::<Part>() + 1_000
        );
        transcript.push_response(&ModelResponse {
            provider: "scripted".to_owned(),
            model: "m".to_owned(),
            parts: vec![Part::ToolUse(ToolUse {
                id: "toolu_1".to_owned(),
                name: "read_file".to_owned(),
                arguments: r#"{"path":"a.txt"}"#.to_owned(),
                signature: None,
            })],
            stop_reason_raw: "tool_use".to_owned(),
            stop_reason: StopReason::ToolUse,
            usage: Usage::default(),
        });
        transcript.push_tool_results([ToolResult {
            tool_use_id: "toolu_1".to_owned(),
            content: ToolResultContent::Text("y".repeat(500)),
            is_error: false,
        }]);
        let three = transcript.heap_bytes();
        let response = size_of::<Message>() + size_of::<Part>() + "scripted".len() + 1 + 7 + 9 + 16;
        let result = size_of::<Message>() + size_of::<Part>() + 7 + 500;
        assert_eq!(three - one, response + result);
        // The transcript's estimate is the sum of its messages'.
        let messages: usize = transcript.messages.iter().map(Message::heap_bytes).sum();
        assert_eq!(three, size_of::<Transcript>() + messages);
    }
}
