//! Tool-result projection: oversized results become a deterministic omission object in the
//! transcript, while the history keeps them whole.

use crate::json::JsonText;
use crate::media::ToolResultBlock;
use crate::transcript::{ToolResult, ToolResultContent};

/// Results whose canonical JSON is longer than this many bytes are omitted from the transcript.
pub const TRANSCRIPT_RESULT_LIMIT_BYTES: usize = 64 * 1024;

/// How many bytes of the canonical JSON the omission object previews.
pub const PREVIEW_BYTES: usize = 2048;

/// Replaces a result over [`TRANSCRIPT_RESULT_LIMIT_BYTES`] by an omission object:
/// `{"omitted":true,"reason":...,"original_bytes":N,"limit_bytes":65536,"preview":"..."}`.
/// Smaller results pass through unchanged. Pure and deterministic.
pub fn project_tool_result(result: ToolResult) -> ToolResult {
    let result = sanitize_blocks(result);
    // Most results are far under the limit, and replay projects every result of a history
    // again: those that cannot reach it are kept without writing their JSON out (a text's
    // JSON string is at most six bytes per byte, `\u00XX`, and its two quotes).
    let surely_fits = match &result.content {
        ToolResultContent::Json(json) => json.as_str().len() <= TRANSCRIPT_RESULT_LIMIT_BYTES,
        ToolResultContent::Text(text) => text
            .len()
            .checked_mul(6)
            .and_then(|bytes| bytes.checked_add(2))
            .is_some_and(|bytes| bytes <= TRANSCRIPT_RESULT_LIMIT_BYTES),
        ToolResultContent::Blocks(_) => false,
    };
    if surely_fits {
        return result;
    }
    // Media blocks are kept whole (a provider bounds their size itself); the limit applies to
    // the result's text, so a screenshot is not turned into an omission notice.
    let canonical = match &result.content {
        ToolResultContent::Blocks(_) => result.content.text_view(),
        _ => result.content.canonical_json(),
    };
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

/// A result of blocks that breaks a block rule would make every later request of its session
/// unsendable; the transcript gets it repaired instead (the history keeps it as the tool gave
/// it): an empty block list becomes empty text, a bad media block a text block naming why.
fn sanitize_blocks(mut result: ToolResult) -> ToolResult {
    let ToolResultContent::Blocks(blocks) = &mut result.content else {
        return result;
    };
    if blocks.is_empty() {
        result.content = ToolResultContent::Text(String::new());
        return result;
    }
    for block in blocks.iter_mut() {
        if let ToolResultBlock::Media(media) = block {
            if let Err(violation) = media.check() {
                *block = ToolResultBlock::Text {
                    text: format!("[{} omitted: {violation}]", media.kind.as_str()),
                };
            }
        }
    }
    result
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
    fn media_blocks_are_kept_whole_and_bad_ones_repaired() {
        use crate::media::Media;
        let big = Media::image_bytes("image/png", &vec![7u8; 200_000]);
        let r = ToolResult {
            tool_use_id: "t".into(),
            content: ToolResultContent::Blocks(vec![
                ToolResultBlock::Text {
                    text: "shot".into(),
                },
                ToolResultBlock::Media(big.clone()),
                ToolResultBlock::Media(Media::image_base64("image/bmp", "AA==")),
            ]),
            is_error: false,
        };
        let projected = project_tool_result(r);
        assert_eq!(
            projected.content,
            ToolResultContent::Blocks(vec![
                ToolResultBlock::Text {
                    text: "shot".into()
                },
                ToolResultBlock::Media(big),
                ToolResultBlock::Text {
                    text: "[image omitted: image media type \"image/bmp\" is not supported \
                           (accepted: image/png, image/jpeg, image/gif, image/webp)]"
                        .into()
                },
            ])
        );
        let empty = ToolResult {
            tool_use_id: "t".into(),
            content: ToolResultContent::Blocks(vec![]),
            is_error: false,
        };
        assert_eq!(
            project_tool_result(empty).content,
            ToolResultContent::Text(String::new())
        );
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

    /// Results kept without their JSON written out are those whose JSON fits: texts of
    /// control characters (six bytes each as JSON) at the bound and just past it, texts too
    /// long for the bound that still fit, and JSON at the limit and past it.
    #[test]
    fn only_results_whose_json_fits_are_kept() {
        let text = |content: String| ToolResult {
            tool_use_id: "t".into(),
            content: ToolResultContent::Text(content),
            is_error: false,
        };
        let fits =
            |r: &ToolResult| r.content.canonical_json().len() <= TRANSCRIPT_RESULT_LIMIT_BYTES;
        // A JSON string of `len` bytes of 'b': `len` + 2 bytes.
        let json = |len: usize| ToolResult {
            content: ToolResultContent::Json(
                JsonText::parse(format!("\"{}\"", "b".repeat(len))).unwrap(),
            ),
            ..text(String::new())
        };
        let controls = (TRANSCRIPT_RESULT_LIMIT_BYTES - 2) / 6;
        for result in [
            text("\u{1}".repeat(controls)),
            text("\u{1}".repeat(controls + 1)),
            text(format!(
                "{}\n",
                "a".repeat(TRANSCRIPT_RESULT_LIMIT_BYTES - 5)
            )),
            text(format!(
                "{}\n",
                "a".repeat(TRANSCRIPT_RESULT_LIMIT_BYTES - 4)
            )),
            text(format!(
                "\"{}",
                "a".repeat(TRANSCRIPT_RESULT_LIMIT_BYTES - 4)
            )),
            json(TRANSCRIPT_RESULT_LIMIT_BYTES - 2),
            json(TRANSCRIPT_RESULT_LIMIT_BYTES - 1),
        ] {
            let projected = project_tool_result(result.clone());
            assert_eq!(
                projected == result,
                fits(&result),
                "{}",
                result.content.canonical_json().len()
            );
        }
    }
}
