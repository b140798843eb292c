//! Tool-result projection: oversized results become a deterministic omission object in the
//! transcript, while the history keeps them whole.

use crate::json::JsonText;
use crate::transcript::{ToolResult, ToolResultContent};

/// Results whose canonical JSON is longer than this many bytes are omitted from the transcript.
pub const TRANSCRIPT_RESULT_LIMIT_BYTES: usize = 64 * 1024;

/// How many bytes of the canonical JSON the omission object previews.
pub const PREVIEW_BYTES: usize = 2048;

/// Replaces a result over [`TRANSCRIPT_RESULT_LIMIT_BYTES`] by an omission object:
/// `{"omitted":true,"reason":...,"original_bytes":N,"limit_bytes":65536,"preview":"..."}`.
/// Smaller results pass through unchanged. Pure and deterministic.
pub fn project_tool_result(result: ToolResult) -> ToolResult {
    let canonical = result.content.canonical_json();
    if canonical.len() <= TRANSCRIPT_RESULT_LIMIT_BYTES {
        return result;
    }
    let mut cut = PREVIEW_BYTES.min(canonical.len());
    while !canonical.is_char_boundary(cut) {
        cut -= 1;
    }
    let omission = serde_json::json!({
        "omitted": true,
        "reason": "tool result exceeds the transcript size limit; the history keeps it whole",
        "original_bytes": canonical.len(),
        "limit_bytes": TRANSCRIPT_RESULT_LIMIT_BYTES,
        "preview": &canonical[..cut],
    });
    ToolResult {
        tool_use_id: result.tool_use_id,
        content: ToolResultContent::Json(JsonText::from_value(&omission)),
        is_error: result.is_error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_result(len: usize) -> ToolResult {
        ToolResult {
            tool_use_id: "t1".into(),
            content: ToolResultContent::Text("é".repeat(len / 2)),
            is_error: false,
        }
    }

    #[test]
    fn small_results_pass_through() {
        let r = text_result(1000);
        assert_eq!(project_tool_result(r.clone()), r);
    }

    #[test]
    fn oversized_results_become_a_deterministic_omission() {
        let r = text_result(200_000);
        let a = project_tool_result(r.clone());
        let b = project_tool_result(r);
        assert_eq!(a, b);
        let ToolResultContent::Json(json) = &a.content else {
            panic!("expected an omission object, got {:?}", a.content)
        };
        let value = json.to_value().unwrap();
        assert_eq!(value["omitted"], true);
        assert_eq!(value["original_bytes"], 200_002);
        assert_eq!(value["limit_bytes"], 65536);
        let preview = value["preview"].as_str().unwrap();
        assert!(preview.len() <= PREVIEW_BYTES && preview.starts_with("\"éé"));
        assert!(json.as_str().starts_with(r#"{"omitted":true,"reason":"#));
    }

    #[test]
    fn the_limit_is_inclusive() {
        // A JSON string of n bytes of 'a' has canonical length n + 2.
        let at_limit = ToolResult {
            tool_use_id: "t".into(),
            content: ToolResultContent::Text("a".repeat(TRANSCRIPT_RESULT_LIMIT_BYTES - 2)),
            is_error: false,
        };
        assert_eq!(project_tool_result(at_limit.clone()), at_limit);
        let over = ToolResult {
            content: ToolResultContent::Text("a".repeat(TRANSCRIPT_RESULT_LIMIT_BYTES - 1)),
            ..at_limit
        };
        assert!(matches!(
            project_tool_result(over).content,
            ToolResultContent::Json(_)
        ));
    }
}
