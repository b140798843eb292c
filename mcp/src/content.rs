//! An MCP tool result as a cairn tool output, pure: text stays text, structured content is
//! JSON, a result with images becomes text and image blocks (so a provider shows the model the
//! pictures; any other block in it — audio, a resource link, an embedded resource — becomes a
//! text block holding that MCP block's JSON), and anything else — audio, resource links,
//! embedded resources, several text blocks — is kept as the MCP content blocks themselves, in
//! a JSON object `{"content": [...]}`, so the ledger holds them as the server sent them.

use cairn_activities::ToolOutput;
use cairn_ledger::{JsonText, Media, ToolResultBlock, ToolResultContent};
use rmcp::model::{CallToolResult, ContentBlock};

/// The output a result becomes; `isError` becomes `is_error`.
pub fn tool_output(result: &CallToolResult) -> ToolOutput {
    let is_error = result.is_error.unwrap_or(false);
    let content = match (&result.structured_content, result.content.as_slice()) {
        (Some(structured), _) => ToolResultContent::Json(JsonText::from_value(structured)),
        (None, [ContentBlock::Text(text)]) if !text.text.is_empty() => {
            ToolResultContent::Text(text.text.clone())
        }
        (None, blocks) if blocks.iter().any(|b| matches!(b, ContentBlock::Image(_))) => {
            ToolResultContent::Blocks(blocks.iter().map(result_block).collect())
        }
        (None, blocks) => {
            let blocks = serde_json::to_value(blocks).unwrap_or_else(|e| {
                serde_json::Value::String(format!("content not representable: {e}"))
            });
            ToolResultContent::Json(JsonText::from_value(
                &serde_json::json!({ "content": blocks }),
            ))
        }
    };
    ToolOutput { content, is_error }
}

/// One MCP block of a result with images as a ledger block.
fn result_block(block: &ContentBlock) -> ToolResultBlock {
    match block {
        ContentBlock::Text(text) => ToolResultBlock::Text {
            text: text.text.clone(),
        },
        ContentBlock::Image(image) => {
            ToolResultBlock::Media(Media::image_base64(&image.mime_type, &image.data))
        }
        other => ToolResultBlock::Text {
            text: serde_json::to_string(other)
                .unwrap_or_else(|e| format!("content not representable: {e}")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> ToolResultContent {
        ToolResultContent::Json(JsonText::parse(text).unwrap())
    }

    #[test]
    fn text_json_images_links_and_errors() {
        let text = CallToolResult::success(vec![ContentBlock::text("hi")]);
        assert_eq!(tool_output(&text), ToolOutput::text("hi"));

        let structured = CallToolResult::structured(serde_json::json!({"sum": 3, "terms": [1, 2]}));
        assert_eq!(
            tool_output(&structured).content,
            json(r#"{"sum":3,"terms":[1,2]}"#)
        );

        let image = CallToolResult::success(vec![
            ContentBlock::text("a chart"),
            ContentBlock::image("iVBORw0=", "image/png"),
        ]);
        assert_eq!(
            tool_output(&image).content,
            ToolResultContent::Blocks(vec![
                ToolResultBlock::Text {
                    text: "a chart".into()
                },
                ToolResultBlock::Media(Media::image_base64("image/png", "iVBORw0=")),
            ])
        );

        let audio = CallToolResult::success(vec![ContentBlock::audio("UklGRg==", "audio/wav")]);
        assert_eq!(
            tool_output(&audio).content,
            json(r#"{"content":[{"type":"audio","data":"UklGRg==","mimeType":"audio/wav"}]}"#)
        );

        let two = CallToolResult::success(vec![ContentBlock::text("a"), ContentBlock::text("b")]);
        assert_eq!(
            tool_output(&two).content,
            json(r#"{"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#)
        );

        let failed = CallToolResult::error(vec![ContentBlock::text("no such city")]);
        assert_eq!(tool_output(&failed), ToolOutput::error("no such city"));

        let empty = CallToolResult::success(vec![]);
        assert_eq!(tool_output(&empty).content, json(r#"{"content":[]}"#));
    }
}
