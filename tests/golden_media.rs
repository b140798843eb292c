//! Golden bytes of the content shapes added after v1: a user message with an image and a
//! document, and a tool result of text and image blocks. Old records are unchanged by them
//! (the `media` field is left out of a text-only message; see `golden.rs`), and these files pin
//! the records with them, in format 1 (never made again) and in format 2 (`format2/`).
//! Regenerate only new files, with `CAIRN_BLESS=1`.

use cairn_ledger::{Media, MediaKind, MediaSource, ToolResultBlock, ToolResultContent};
use cairn_runtime::{codec, Event, EventEnvelope};
use std::path::{Path, PathBuf};

fn golden_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/events")
        .join(name)
}

/// Checks `event`'s golden records: `NAME` is its format-1 record (written before format 2,
/// never made again), which must keep decoding to it; `format2/NAME` is its record as
/// `codec::encode` writes it now (written when missing or blessed), which must decode to it and
/// not change.
fn assert_golden(name: &str, seq: u64, event: Event) {
    let envelope = EventEnvelope::new("golden-media", seq, 1_700_000_000_000, event);
    let format1 = std::fs::read(golden_path(name)).unwrap();
    assert_eq!(format1[0], 1, "{name} is a format-1 record");
    assert_eq!(
        codec::decode("golden-media", seq, &format1).unwrap(),
        envelope
    );
    let path = golden_path(&format!("format2/{name}"));
    let bytes = codec::encode(&envelope).unwrap();
    if std::env::var_os("CAIRN_BLESS").is_some() || !path.exists() {
        std::fs::write(&path, &bytes).unwrap();
    }
    let stored = std::fs::read(&path).unwrap();
    assert_eq!(
        codec::decode("golden-media", seq, &stored).unwrap(),
        envelope
    );
    assert_eq!(bytes, stored, "the encoding of {name} changed");
}

#[test]
fn a_user_message_with_media_has_golden_bytes() {
    assert_golden(
        "media-user_message.bin",
        2,
        Event::UserMessage {
            idempotency_key: None,
            turn: 1,
            text: "compare these".into(),
            model: None,
            tool_choice: None,
            media: vec![
                Media::image_base64("image/png", "iVBORw0KGgo="),
                Media {
                    kind: MediaKind::Document,
                    source: MediaSource::Url {
                        url: "https://example.com/a.pdf".into(),
                    },
                    name: Some("a.pdf".into()),
                },
                Media {
                    kind: MediaKind::Document,
                    source: MediaSource::Base64 {
                        media_type: "text/plain".into(),
                        data: "aGVsbG8=".into(),
                    },
                    name: None,
                },
            ],
        },
    );
}

#[test]
fn a_tool_result_of_blocks_has_golden_bytes() {
    assert_golden(
        "media-tool_call_completed.bin",
        5,
        Event::ToolCallCompleted {
            turn: 1,
            tool_use_id: "toolu_1".into(),
            attempt: 1,
            content: ToolResultContent::Blocks(vec![
                ToolResultBlock::Text {
                    text: "the screen".into(),
                },
                ToolResultBlock::Media(Media::image_base64("image/jpeg", "/9j/4A==")),
            ]),
            is_error: false,
        },
    );
}
