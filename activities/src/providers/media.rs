//! Images and documents ([`Media`]) as each provider family's documented request blocks, for
//! user messages and tool results. Each function says what its provider cannot carry and
//! refuses it with a message naming the media (the caller adds the message and part).
//!
//! Wire formats, as documented:
//! - Anthropic Messages: `image` blocks with a `base64` or `url` source; `document` blocks with
//!   a `base64` PDF, a `text` source (`media_type: text/plain`, the text itself) or a `url` PDF
//!   source, and an optional `title`. A `tool_result`'s `content` takes text, image and
//!   document blocks.
//! - OpenAI Chat Completions: `image_url` parts (`{"url": ...}`, an http(s) URL or a data URI);
//!   `file` parts (`{"filename", "file_data": data URI}`) for PDF only, and no file URLs (the
//!   file-inputs guide's table); a text file is sent as a `text` part, as that guide says to.
//!   `tool` messages take text only.
//! - OpenAI Responses: `input_image` (`image_url`: URL or data URI, `detail` required, sent as
//!   `auto`); `input_file` with `filename` + `file_data` (data URI) or `file_url`. A
//!   `function_call_output`'s `output` may be a list of `input_text`/`input_image`/
//!   `input_file`.
//! - Bedrock Converse: `image` (`format`: png|jpeg|gif|webp, `source.bytes`: base64) and
//!   `document` (`format`: pdf|txt, `name` of alphanumerics, single spaces, hyphens,
//!   parentheses and square brackets, at most 200 characters, `source.bytes`); no URL sources
//!   (only bytes or S3). `toolResult` content takes `text`, `json`, `image` and `document`.

use cairn_ledger::{Media, MediaKind, MediaSource, ToolResultBlock};
use serde_json::{json, Value};

/// The Anthropic block for `media`.
pub fn anthropic_block(media: &Media) -> Result<Value, String> {
    media.check().map_err(|v| v.to_string())?;
    let mut block = match (&media.kind, &media.source) {
        (MediaKind::Image, MediaSource::Base64 { media_type, data }) => json!({
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }),
        (MediaKind::Image, MediaSource::Url { url }) => json!({
            "type": "image",
            "source": {"type": "url", "url": url},
        }),
        (MediaKind::Document, MediaSource::Base64 { media_type, .. })
            if media_type == "text/plain" =>
        {
            json!({
                "type": "document",
                "source": {"type": "text", "media_type": "text/plain", "data": plain_text(media)?},
            })
        }
        (MediaKind::Document, MediaSource::Base64 { media_type, data }) => json!({
            "type": "document",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }),
        (MediaKind::Document, MediaSource::Url { url }) => json!({
            "type": "document",
            "source": {"type": "url", "url": url},
        }),
    };
    if let (MediaKind::Document, Some(name)) = (media.kind, &media.name) {
        block["title"] = Value::from(name.as_str());
    }
    Ok(block)
}

/// The Anthropic `tool_result` content for blocks (empty text blocks left out: the API
/// refuses empty text).
pub fn anthropic_tool_result(blocks: &[ToolResultBlock]) -> Result<Vec<Value>, String> {
    let mut out = Vec::with_capacity(blocks.len());
    for (bi, block) in blocks.iter().enumerate() {
        match block {
            ToolResultBlock::Text { text } if text.is_empty() => {}
            ToolResultBlock::Text { text } => out.push(json!({"type": "text", "text": text})),
            ToolResultBlock::Media(media) => {
                out.push(anthropic_block(media).map_err(|e| format!("block {bi}: {e}"))?)
            }
        }
    }
    Ok(out)
}

/// The Chat Completions content part for `media` in a user message.
pub fn chat_part(media: &Media) -> Result<Value, String> {
    media.check().map_err(|v| v.to_string())?;
    match (&media.kind, &media.source) {
        (MediaKind::Image, _) => {
            Ok(json!({"type": "image_url", "image_url": {"url": media.uri()}}))
        }
        (MediaKind::Document, MediaSource::Base64 { media_type, .. })
            if media_type == "application/pdf" =>
        {
            Ok(json!({
                "type": "file",
                "file": {"filename": file_name(media, "document.pdf"), "file_data": media.uri()},
            }))
        }
        (MediaKind::Document, MediaSource::Base64 { .. }) => {
            Ok(json!({"type": "text", "text": plain_text(media)?}))
        }
        (MediaKind::Document, MediaSource::Url { .. }) => Err(
            "OpenAI Chat Completions takes no file URLs (only inline PDF data); attach the \
             document's bytes instead"
                .to_owned(),
        ),
    }
}

/// The Responses content item for `media` (in a user message or a function_call_output).
pub fn responses_item(media: &Media) -> Result<Value, String> {
    media.check().map_err(|v| v.to_string())?;
    Ok(match (&media.kind, &media.source) {
        (MediaKind::Image, _) => {
            json!({"type": "input_image", "image_url": media.uri(), "detail": "auto"})
        }
        (MediaKind::Document, MediaSource::Base64 { media_type, .. }) => {
            let default = if media_type == "text/plain" {
                "document.txt"
            } else {
                "document.pdf"
            };
            json!({
                "type": "input_file",
                "filename": file_name(media, default),
                "file_data": media.uri(),
            })
        }
        (MediaKind::Document, MediaSource::Url { url }) => {
            json!({"type": "input_file", "file_url": url})
        }
    })
}

/// The Responses `function_call_output` output list for blocks.
pub fn responses_output(blocks: &[ToolResultBlock]) -> Result<Vec<Value>, String> {
    let mut out = Vec::with_capacity(blocks.len());
    for (bi, block) in blocks.iter().enumerate() {
        match block {
            ToolResultBlock::Text { text } => out.push(json!({"type": "input_text", "text": text})),
            ToolResultBlock::Media(media) => {
                out.push(responses_item(media).map_err(|e| format!("block {bi}: {e}"))?)
            }
        }
    }
    Ok(out)
}

/// The Bedrock Converse block for `media`: `{"image": {...}}` or `{"document": {...}}`.
pub fn bedrock_block(media: &Media) -> Result<Value, String> {
    media.check().map_err(|v| v.to_string())?;
    let (media_type, data) = match &media.source {
        MediaSource::Base64 { media_type, data } => (media_type.as_str(), data.as_str()),
        MediaSource::Url { .. } => {
            return Err(format!(
                "Bedrock Converse takes a {} only as bytes (or from S3), not from a URL; \
                 attach its bytes instead",
                media.kind.as_str()
            ))
        }
    };
    let format = match media_type {
        "image/png" => "png",
        "image/jpeg" => "jpeg",
        "image/gif" => "gif",
        "image/webp" => "webp",
        "application/pdf" => "pdf",
        "text/plain" => "txt",
        other => return Err(format!("Bedrock Converse has no format for {other:?}")),
    };
    Ok(match media.kind {
        MediaKind::Image => json!({"image": {"format": format, "source": {"bytes": data}}}),
        MediaKind::Document => json!({"document": {
            "format": format,
            "name": bedrock_document_name(media.name.as_deref()),
            "source": {"bytes": data},
        }}),
    })
}

/// A name Bedrock accepts: the file name without its extension, every character outside
/// alphanumerics, hyphens, parentheses and square brackets made a space, runs of spaces made
/// one, at most 200 characters; `document` when nothing is left.
pub fn bedrock_document_name(name: Option<&str>) -> String {
    let stem = name
        .map(|n| n.rsplit_once('.').map_or(n, |(stem, _)| stem))
        .unwrap_or("");
    let mut out = String::new();
    for c in stem.chars() {
        let c = if c.is_alphanumeric() || "-()[]".contains(c) {
            c
        } else {
            ' '
        };
        if c == ' ' && (out.is_empty() || out.ends_with(' ')) {
            continue;
        }
        out.push(c);
        if out.chars().count() == 200 {
            break;
        }
    }
    let out = out.trim_end().to_owned();
    if out.is_empty() {
        "document".to_owned()
    } else {
        out
    }
}

fn file_name(media: &Media, default: &str) -> String {
    media.name.clone().unwrap_or_else(|| default.to_owned())
}

fn plain_text(media: &Media) -> Result<String, String> {
    let bytes = media
        .decoded()
        .ok_or_else(|| "the text document's data is not valid base64".to_owned())?;
    String::from_utf8(bytes).map_err(|_| "the text document is not UTF-8".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bedrock_names_keep_only_allowed_characters() {
        assert_eq!(bedrock_document_name(Some("Q4 report.pdf")), "Q4 report");
        assert_eq!(bedrock_document_name(Some("a__b  (v2).txt")), "a b (v2)");
        assert_eq!(bedrock_document_name(Some("....pdf")), "document");
        assert_eq!(bedrock_document_name(None), "document");
        assert_eq!(
            bedrock_document_name(Some(&"x".repeat(300)))
                .chars()
                .count(),
            200
        );
    }
}
