//! An MCP tool result as a cairn tool output, pure: text stays text, structured content is
//! JSON, and anything else — images, audio, resource links, embedded resources, several
//! blocks — is kept as the MCP content blocks themselves, in a JSON object
//! `{"content": [...]}`, so the ledger holds them as the server sent them.

use cairn_activities::ToolOutput;
use cairn_ledger::{JsonText, ToolResultContent};
use rmcp::model::{CallToolResult, ContentBlock};

/// The output a result becomes; `isError` becomes `is_error`.
pub fn tool_output(result: &CallToolResult) -> ToolOutput {
    let is_error = result.is_error.unwrap_or(false);
    let content = match (&result.structured_content, result.content.as_slice()) {
        (Some(structured), _) => ToolResultContent::Json(JsonText::from_value(structured)),
        (None, [ContentBlock::Text(text)]) if !text.text.is_empty() => {
            ToolResultContent::Text(text.text.clone())
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

        let image = CallToolResult::success(vec![ContentBlock::image("iVBORw0=", "image/png")]);
        assert_eq!(
            tool_output(&image).content,
            json(r#"{"content":[{"type":"image","data":"iVBORw0=","mimeType":"image/png"}]}"#)
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
