//! Property tests of the record codec: decoding never panics on any bytes, every valid record
//! round-trips, and every single-byte flip, truncation or extension of a valid record is
//! detected as a `CorruptRecord` naming where it was read; so is a record read under another
//! session or seq. Format-1 records, built by the old encoder (`encode_format1`), still decode.

use crate::codec::{decode, encode, encode_format1, RECORD_FORMAT, RECORD_FORMAT_1};
use crate::compaction::CompactionTrigger;
use crate::error::Error;
use crate::event::{ActivityFailure, ErrorClass, Event, EventEnvelope};
use cairn_ledger::{
    CompactionStrategy, Media, MediaKind, MediaSource, ToolResultBlock, ToolResultContent, Usage,
};
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{0,12}",
        any::<String>(),
        Just(String::new()),
        "[\\x00-\\x7f]{0,300}",
    ]
}

/// Any media (the codec keeps even ones the checks would refuse).
fn media() -> impl Strategy<Value = Media> {
    (any::<bool>(), text(), text(), proptest::option::of(text())).prop_map(
        |(is_url, a, b, name)| Media {
            kind: if is_url {
                MediaKind::Document
            } else {
                MediaKind::Image
            },
            source: if is_url {
                MediaSource::Url { url: a }
            } else {
                MediaSource::Base64 {
                    media_type: a,
                    data: b,
                }
            },
            name,
        },
    )
}

fn event() -> impl Strategy<Value = Event> {
    let small = 0u32..4;
    prop_oneof![
        (
            small.clone(),
            text(),
            proptest::collection::vec(media(), 0..3)
        )
            .prop_map(|(turn, text, media)| Event::UserMessage {
                idempotency_key: None,
                turn,
                text,
                model: None,
                media,
                tool_choice: None,
            }),
        (small.clone(), text(), small.clone(), text(), text()).prop_map(
            |(turn, tool_use_id, attempt, caption, data)| Event::ToolCallCompleted {
                turn,
                tool_use_id,
                attempt,
                content: ToolResultContent::Blocks(vec![
                    ToolResultBlock::Text { text: caption },
                    ToolResultBlock::Media(Media::image_base64("image/png", data)),
                ]),
                is_error: false,
            }
        ),
        (small.clone(), small.clone(), small.clone(), any::<u64>()).prop_map(
            |(turn, round, attempt, not_before_ms)| Event::ModelCallScheduled {
                turn,
                round,
                attempt,
                not_before_ms
            }
        ),
        (small.clone(), text(), text(), small.clone(), any::<u64>()).prop_map(
            |(turn, tool_use_id, name, attempt, not_before_ms)| Event::ToolCallScheduled {
                turn,
                tool_use_id,
                name,
                attempt,
                not_before_ms
            }
        ),
        (small.clone(), text(), text(), any::<Option<u64>>()).prop_map(
            |(turn, tool_use_id, name, deadline_ms)| Event::ToolApprovalRequested {
                turn,
                tool_use_id,
                name,
                deadline_ms
            }
        ),
        (small.clone(), text())
            .prop_map(|(turn, tool_use_id)| Event::ToolCallApproved { turn, tool_use_id }),
        (small.clone(), text(), text(), any::<bool>()).prop_map(
            |(turn, tool_use_id, reason, by_deadline)| Event::ToolCallDenied {
                turn,
                tool_use_id,
                reason,
                by_deadline
            }
        ),
        (small.clone(), text(), small.clone(), text(), any::<bool>()).prop_map(
            |(turn, tool_use_id, attempt, content, is_error)| Event::ToolCallCompleted {
                turn,
                tool_use_id,
                attempt,
                content: ToolResultContent::Text(content),
                is_error
            }
        ),
        (
            small.clone(),
            small.clone(),
            small.clone(),
            text(),
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(turn, round, attempt, message, cost_micros)| {
                Event::ModelCallFailed {
                    turn,
                    round,
                    attempt,
                    failure: ActivityFailure::new(ErrorClass::Transient, message),
                    cost_micros,
                }
            }),
        (small.clone(), any::<u64>()).prop_map(|(turn, tokens)| Event::TurnCompleted {
            turn,
            usage: Usage {
                input_tokens: tokens,
                ..Usage::default()
            }
        }),
        (small.clone(), text()).prop_map(|(turn, reason)| Event::TurnFailed {
            turn,
            reason,
            budget_exceeded: None
        }),
        text().prop_map(|reason| Event::SessionCancelled { reason }),
        (
            small.clone(),
            prop::collection::vec(
                prop_oneof![
                    Just(CompactionStrategy::DropReasoning),
                    Just(CompactionStrategy::DropFailedToolResults),
                    Just(CompactionStrategy::KeepLastTurns),
                ],
                0..4
            ),
            any::<Option<u32>>(),
            any::<Option<u64>>(),
            any::<(u64, u64)>(),
            any::<bool>(),
        )
            .prop_map(
                |(turn, strategies, keep_last_turns, cut, (before, after), on_request)| {
                    Event::TranscriptCompacted {
                        turn,
                        trigger: if on_request {
                            CompactionTrigger::Requested
                        } else {
                            CompactionTrigger::ContextTooLong
                        },
                        strategies,
                        keep_last_turns,
                        cut,
                        estimate_before: before,
                        estimate_after: after,
                        summary: on_request.then(|| "a summary".to_owned()),
                    }
                }
            ),
        Just(Event::CompactionRequested {}),
        (
            small.clone(),
            small.clone(),
            text(),
            proptest::option::of(any::<u64>()),
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(turn, attempt, summary, tokens, cost_micros)| {
                Event::SummaryCallCompleted {
                    turn,
                    attempt,
                    summary,
                    usage: tokens.map(|output_tokens| Usage {
                        output_tokens,
                        ..Usage::default()
                    }),
                    cost_micros,
                }
            }),
        (
            small.clone(),
            small.clone(),
            small.clone(),
            small,
            text(),
            text()
        )
            .prop_map(
                |(turn, round, attempt, lease_attempt, text_appended, thinking_appended)| {
                    Event::ModelAttemptProgress {
                        turn,
                        round,
                        attempt,
                        lease_attempt,
                        text_appended,
                        thinking_appended,
                        cost_micros: None,
                        usage: None,
                    }
                }
            ),
    ]
}

fn envelope() -> impl Strategy<Value = EventEnvelope> {
    (
        "[a-zA-Z0-9._-]{1,20}",
        1u64..1_000_000,
        any::<u64>(),
        event(),
    )
        .prop_map(|(sid, seq, at, event)| EventEnvelope::new(&sid, seq, at, event))
}

/// The decoder's verdict must be a corrupt record at the place it was asked to read.
fn assert_corrupt_at(result: crate::error::Result<EventEnvelope>, sid: &str, seq: u64) -> String {
    match result {
        Err(Error::CorruptRecord {
            session_id,
            seq: s,
            reason,
        }) => {
            assert_eq!((session_id.as_str(), s), (sid, seq));
            reason
        }
        other => panic!("expected CorruptRecord for {sid}/{seq}, got {other:?}"),
    }
}

/// A format-2 record of `body` under `codec`, with a valid checksum for `sid`/`seq` (the
/// layout of `codec.rs`, written out here so that the tests do not trust the encoder).
fn format2_record(sid: &str, seq: u64, codec: u8, body: &[u8]) -> Vec<u8> {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[RECORD_FORMAT, codec]);
    hasher.update(&(sid.len() as u64).to_le_bytes());
    hasher.update(sid.as_bytes());
    hasher.update(&seq.to_le_bytes());
    hasher.update(body);
    let mut record = vec![RECORD_FORMAT, codec];
    record.extend_from_slice(&hasher.finalize().to_le_bytes());
    record.extend_from_slice(body);
    record
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any bytes: an error naming the place (or, impossibly rarely, a record), never a panic.
    #[test]
    fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        match decode("s", 7, &bytes) {
            Ok(_) => {}
            Err(Error::CorruptRecord { session_id, seq, .. })
            | Err(Error::UnknownSchemaVersion { session_id, seq, .. }) => {
                prop_assert_eq!((session_id.as_str(), seq), ("s", 7));
            }
            Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
        }
    }

    /// Random bytes behind a valid format-1 header (format byte and the payload's own CRC)
    /// reach the msgpack decoder: still never a panic.
    #[test]
    fn decoding_random_format1_payloads_with_valid_checksums_never_panics(
        payload in proptest::collection::vec(any::<u8>(), 0..600)
    ) {
        let mut record = vec![RECORD_FORMAT_1];
        record.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        record.extend_from_slice(&payload);
        match decode("s", 7, &record) {
            Ok(_) | Err(Error::CorruptRecord { .. }) | Err(Error::UnknownSchemaVersion { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
        }
    }

    /// Random bytes behind a valid format-2 header reach the decompressor (codec 1) or the
    /// msgpack decoder (codec 0), or name an unknown codec: never a panic.
    #[test]
    fn decoding_random_format2_bodies_with_valid_checksums_never_panics(
        codec in 0u8..4,
        body in proptest::collection::vec(any::<u8>(), 0..600)
    ) {
        match decode("s", 7, &format2_record("s", 7, codec, &body)) {
            Ok(_) | Err(Error::UnknownSchemaVersion { .. }) => {}
            Err(Error::CorruptRecord { session_id, seq, reason }) => {
                prop_assert_eq!((session_id.as_str(), seq), ("s", 7));
                if codec > 1 {
                    prop_assert!(reason.contains("unknown record codec"), "{}", reason);
                }
            }
            Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
        }
    }

    /// A valid zstd frame (from the real encoder, so it passes the header checks) with random
    /// bytes spliced into it behind a valid checksum: an error or the record, never a panic.
    #[test]
    fn decoding_damaged_frames_with_valid_checksums_never_panics(
        e in envelope(),
        position in any::<prop::sample::Index>(),
        bytes in proptest::collection::vec(any::<u8>(), 1..8),
    ) {
        let record = encode(&e).expect("encode");
        let mut body = record[6..].to_vec();
        let at = position.index(body.len().max(1));
        for (i, b) in bytes.iter().enumerate() {
            if let Some(slot) = body.get_mut(at + i) {
                *slot ^= b;
            }
        }
        match decode(&e.session_id, e.seq, &format2_record(&e.session_id, e.seq, record[1], &body)) {
            Ok(_) | Err(Error::CorruptRecord { .. }) | Err(Error::UnknownSchemaVersion { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
        }
    }

    #[test]
    fn valid_records_round_trip(e in envelope()) {
        let record = encode(&e).expect("encode");
        prop_assert_eq!(record[0], RECORD_FORMAT);
        prop_assert_eq!(decode(&e.session_id, e.seq, &record).expect("decode"), e);
    }

    /// Records of the first format, as every history before format 2 holds them, decode to
    /// the same envelope forever.
    #[test]
    fn format1_records_still_decode(e in envelope()) {
        let record = encode_format1(&e).expect("encode");
        prop_assert_eq!(record[0], RECORD_FORMAT_1);
        prop_assert_eq!(decode(&e.session_id, e.seq, &record).expect("decode"), e);
    }

    /// CRC32 detects every error burst of up to 32 bits, so every single-byte change is caught:
    /// in the format byte as an unknown format (or, turned into the other format, as that
    /// format's checksum mismatch), anywhere else as a checksum mismatch: the codec byte is
    /// under the checksum too.
    #[test]
    fn every_single_byte_flip_is_detected(
        e in envelope(),
        format1 in any::<bool>(),
        position in any::<prop::sample::Index>(),
        mask in 1u8..=255,
    ) {
        let mut record = if format1 { encode_format1(&e) } else { encode(&e) }.expect("encode");
        let at = position.index(record.len());
        record[at] ^= mask;
        let reason = assert_corrupt_at(decode(&e.session_id, e.seq, &record), &e.session_id, e.seq);
        if at == 0 && ![RECORD_FORMAT, RECORD_FORMAT_1].contains(&record[0]) {
            prop_assert!(reason.contains("unknown record format"), "{}", reason);
        } else if at == 0 {
            prop_assert!(reason.contains("checksum") || reason.contains("truncated"), "{}", reason);
        } else {
            prop_assert!(reason.contains("checksum"), "{}", reason);
        }
    }

    /// A record cut short, or with bytes added, is corrupt.
    #[test]
    fn truncated_and_extended_records_are_detected(
        e in envelope(),
        format1 in any::<bool>(),
        cut in any::<prop::sample::Index>(),
        extra in proptest::collection::vec(any::<u8>(), 1..16),
    ) {
        let record = if format1 { encode_format1(&e) } else { encode(&e) }.expect("encode");
        let short = &record[..cut.index(record.len())];
        assert_corrupt_at(decode(&e.session_id, e.seq, short), &e.session_id, e.seq);
        let mut long = record.clone();
        long.extend_from_slice(&extra);
        let reason = assert_corrupt_at(decode(&e.session_id, e.seq, &long), &e.session_id, e.seq);
        prop_assert!(reason.contains("checksum"), "{}", reason);
    }

    /// A valid record read under another seq is corrupt, never taken for that event.
    #[test]
    fn a_record_read_in_the_wrong_place_is_detected(
        e in envelope(),
        format1 in any::<bool>(),
        other_seq in 1u64..1_000_000,
    ) {
        prop_assume!(other_seq != e.seq);
        let record = if format1 { encode_format1(&e) } else { encode(&e) }.expect("encode");
        let reason = assert_corrupt_at(decode(&e.session_id, other_seq, &record), &e.session_id, other_seq);
        prop_assert!(reason.contains("belongs to"), "{}", reason);
    }

    /// A valid record read under another session id (with its own seq) is corrupt too: the
    /// format-2 checksum covers the session id, which the record does not store.
    #[test]
    fn a_record_read_under_another_session_is_detected(
        e in envelope(),
        format1 in any::<bool>(),
        other in "[a-zA-Z0-9._-]{1,20}",
    ) {
        prop_assume!(other != e.session_id);
        let record = if format1 { encode_format1(&e) } else { encode(&e) }.expect("encode");
        let reason = assert_corrupt_at(decode(&other, e.seq, &record), &other, e.seq);
        prop_assert!(reason.contains("belongs to"), "{}", reason);
    }
}

/// A frame that declares a huge size (behind a valid checksum, as a forged record would) is
/// refused before anything is allocated for it.
#[test]
fn a_compressed_body_declaring_more_than_the_maximum_is_refused() {
    // A zstd frame header: magic, a descriptor with an 8-byte content size and single segment,
    // then 2^40 as the content size, then a raw block of 3 bytes.
    let mut frame = vec![0x28, 0xb5, 0x2f, 0xfd, 0b1110_0000];
    frame.extend_from_slice(&(1u64 << 40).to_le_bytes());
    frame.extend_from_slice(&[0x19, 0x00, 0x00, 1, 2, 3]);
    let reason = assert_corrupt_at(decode("s", 3, &format2_record("s", 3, 1, &frame)), "s", 3);
    assert!(reason.contains("declares 1099511627776 bytes"), "{reason}");
    // A frame that does not say its size at all.
    let mut frame = vec![0x28, 0xb5, 0x2f, 0xfd, 0b0000_0000, 0x58];
    frame.extend_from_slice(&[0x19, 0x00, 0x00, 1, 2, 3]);
    let reason = assert_corrupt_at(decode("s", 3, &format2_record("s", 3, 1, &frame)), "s", 3);
    assert!(reason.contains("does not declare its size"), "{reason}");
}

/// A record of a dictionary this build does not have (a later cairn's) is named as such.
#[test]
fn an_unknown_codec_is_named() {
    let e = EventEnvelope::new("s", 4, 1, Event::SessionCancelled { reason: "x".into() });
    let body = crate::codec::record_body(&e).unwrap();
    let reason = assert_corrupt_at(decode("s", 4, &format2_record("s", 4, 2, &body)), "s", 4);
    assert!(reason.contains("unknown record codec 2"), "{reason}");
    // The same body stored as it is (codec 0) decodes.
    assert_eq!(
        decode("s", 4, &format2_record("s", 4, 0, &body)).unwrap(),
        e
    );
}

/// A dictionary, once shipped, never changes: records compressed against it must decode
/// forever. A new dictionary is a new file and a new codec id.
#[test]
fn dictionary_1_is_the_one_shipped() {
    assert_eq!(crate::codec::DICTIONARY_1.len(), 8_976);
    assert_eq!(crc32fast::hash(crate::codec::DICTIONARY_1), 0x8a5fc35f);
}

/// The encoder reuses its thread's buffers from record to record: a record's bytes must not
/// depend on what the thread encoded before, whether longer, noisier or too big to keep.
#[test]
fn a_record_does_not_depend_on_what_its_thread_encoded_before() {
    let small = EventEnvelope::new(
        "s",
        7,
        1,
        Event::SessionCancelled {
            reason: "done".into(),
        },
    );
    let first = std::thread::spawn({
        let small = small.clone();
        move || encode(&small).unwrap()
    })
    .join()
    .unwrap();
    // Long and compressible, then noise (compressed much less), then over what a thread keeps
    // of its buffers.
    let mut noise = String::new();
    let mut x: u32 = 1;
    for _ in 0..4_000 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        noise.push(char::from(b'!' + (x >> 16) as u8 % 90));
    }
    let before = [
        "a compressible reason ".repeat(500),
        noise,
        "x".repeat(3 << 20),
    ];
    for (i, reason) in before.into_iter().enumerate() {
        let big = EventEnvelope::new("s", 8, 1, Event::SessionCancelled { reason });
        let record = encode(&big).unwrap();
        assert_eq!(decode("s", 8, &record).unwrap(), big, "record {i}");
        assert_eq!(encode(&small).unwrap(), first, "after record {i}");
    }
    assert_eq!(decode("s", 7, &first).unwrap(), small);
}
