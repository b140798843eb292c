//! The record codec: an event as named-field msgpack, compressed against a dictionary compiled
//! into the binary, behind a format byte and a CRC32 that also covers where the record belongs.
//!
//! Every record starts with its format byte. This code writes format 2 and reads formats 1 and
//! 2; a format, once written, is read forever.
//!
//! **Format 2** (written since issue 13, "history bytes"):
//!
//! ```text
//! [format: u8 = 2][codec: u8][crc32: u32 LE][body]
//! ```
//!
//! - `codec` says how `body` is stored: `0` as it is, `1` as one zstd frame compressed against
//!   dictionary 1 ([`DICTIONARY_1`], `runtime/dictionaries/records-1.zdict`). A future dictionary
//!   gets the next number; a dictionary, once shipped, never changes (a test pins its hash). A
//!   body is stored as it is when compression does not make it smaller (small records) or when
//!   it is larger than [`MAX_COMPRESSED_BODY_BYTES`].
//! - `crc32` is the CRC32 of, in order: the format and codec bytes, the session id's length
//!   (u64 LE) and bytes, the seq (u64 LE), and the stored body. The session id and seq are not
//!   stored (the store's key holds them and every reader knows them) but are checked: a record
//!   read under another key fails its checksum.
//! - The decompressed body is the named-field msgpack of `{schema_version, recorded_at_ms,
//!   event}`: the envelope without the session id, the seq and the kind tag (the kind is the
//!   event's own enum tag). Field names and kind tags repeat in every record; the dictionary is
//!   what removes that repetition, so schema evolution keeps relying on named fields.
//! - The zstd frame carries its content size and neither a checksum nor a dictionary id (the
//!   CRC and the codec byte do those jobs). Decoding refuses a frame that does not declare its
//!   size or declares more than [`MAX_COMPRESSED_BODY_BYTES`], so a damaged or forged size can
//!   never make it allocate more than that; a frame that decodes to another size is corrupt.
//!
//! **Format 1** (every record written before format 2; read, never written):
//!
//! ```text
//! [format: u8 = 1][crc32 of payload: u32 LE][payload: named-field msgpack of EventEnvelope]
//! ```
//!
//! The payload holds the whole envelope, session id, seq and kind tag included; decoding checks
//! them against where the record was read.
//!
//! Decoding checks the format, the checksum, then the schema version, before the body; every
//! failure is a typed error naming the session and seq where the record was read, never a panic.

use crate::error::{Error, Result};
use crate::event::{Event, EventEnvelope, SCHEMA_VERSION};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::sync::OnceLock;

/// The record format byte this code writes.
pub const RECORD_FORMAT: u8 = 2;
/// The first record format: the whole envelope as named-field msgpack, uncompressed.
pub const RECORD_FORMAT_1: u8 = 1;
const HEADER_LEN_1: usize = 5;
const HEADER_LEN_2: usize = 6;

/// Format 2's codec byte of a body stored as it is.
const CODEC_STORED: u8 = 0;
/// Format 2's codec byte of a body compressed against [`DICTIONARY_1`].
const CODEC_DICTIONARY_1: u8 = 1;

/// Dictionary 1 of format 2's compressed bodies, trained with zstd's dictionary builder on the
/// bodies of the golden sessions (`cairn train-dictionary`, in `cairn_devtools::dictionary`,
/// which makes it again byte for byte). It never changes: records compressed against it must
/// decode forever.
pub const DICTIONARY_1: &[u8] = include_bytes!("../dictionaries/records-1.zdict");

/// The largest body that is stored compressed, and so the most a record's decompression may
/// produce: 64 MiB. Larger bodies (a huge tool result) are stored as they are.
pub const MAX_COMPRESSED_BODY_BYTES: usize = 64 << 20;

/// The zstd level bodies are compressed at. Levels 1 and -1 measured no cheaper for records
/// this small (callgrind, one session's turns: zstd's fixed cost per frame dominates), and
/// their histories were 2% and 7% larger.
const COMPRESSION_LEVEL: i32 = 3;

/// The envelope fields a format-2 body holds, borrowed for encoding.
#[derive(Serialize)]
struct BodyRef<'a> {
    schema_version: u16,
    recorded_at_ms: u64,
    event: &'a Event,
}

/// A decoded format-2 body.
#[derive(Deserialize)]
struct Body {
    schema_version: u16,
    recorded_at_ms: u64,
    event: Event,
}

/// The version alone, read again when a body does not decode, to name a newer schema as such.
#[derive(Deserialize)]
struct BodyVersion {
    schema_version: u16,
}

/// Dictionary 1 prepared for compression, once per process.
fn encoder_dictionary() -> &'static zstd::dict::EncoderDictionary<'static> {
    static PREPARED: OnceLock<zstd::dict::EncoderDictionary<'static>> = OnceLock::new();
    PREPARED.get_or_init(|| zstd::dict::EncoderDictionary::copy(DICTIONARY_1, COMPRESSION_LEVEL))
}

/// Dictionary 1 prepared for decompression, once per process.
fn decoder_dictionary() -> &'static zstd::dict::DecoderDictionary<'static> {
    static PREPARED: OnceLock<zstd::dict::DecoderDictionary<'static>> = OnceLock::new();
    PREPARED.get_or_init(|| zstd::dict::DecoderDictionary::copy(DICTIONARY_1))
}

thread_local! {
    /// This thread's compression context, made on its first record and reused.
    static COMPRESSOR: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    /// This thread's decompression context, made on its first compressed record and reused.
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// The uncompressed body of `envelope`'s format-2 record: named-field msgpack of its schema
/// version, time and event. What the dictionary is trained on.
pub fn record_body(envelope: &EventEnvelope) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    write_body(envelope, &mut body)?;
    Ok(body)
}

/// Writes `envelope`'s format-2 body to the end of `out`.
fn write_body(envelope: &EventEnvelope, out: &mut Vec<u8>) -> Result<()> {
    rmp_serde::encode::write_named(
        out,
        &BodyRef {
            schema_version: envelope.schema_version,
            recorded_at_ms: envelope.recorded_at_ms,
            event: &envelope.event,
        },
    )
    .map_err(|e| encode_error(envelope, e.to_string()))
}

/// Encodes an envelope as a format-2 record.
///
/// The body is written to, and compressed into, buffers this thread keeps and reuses, so a
/// record costs one allocation of its own exact size: growing a fresh body buffer string by
/// string, and zero-filling a compression buffer of the worst-case size, were a sixth of
/// the encoding's instructions (callgrind).
pub fn encode(envelope: &EventEnvelope) -> Result<Vec<u8>> {
    SCRATCH.with(|cell| {
        let mut scratch = cell.borrow_mut();
        let Scratch { body, compressed } = &mut *scratch;
        body.clear();
        write_body(envelope, body)?;
        let mut codec = CODEC_STORED;
        if body.len() <= MAX_COMPRESSED_BODY_BYTES {
            compressed.clear();
            compressed.reserve(zstd::zstd_safe::compress_bound(body.len()));
            let written =
                with_compressor(|compressor| compressor.compress_to_buffer(&body[..], compressed))
                    .map_err(|e| encode_error(envelope, format!("compressing the body: {e}")))?;
            if written < body.len() {
                codec = CODEC_DICTIONARY_1;
            }
        }
        let stored: &[u8] = if codec == CODEC_STORED {
            body
        } else {
            compressed
        };
        let crc = checksum(
            &envelope.session_id,
            envelope.seq,
            RECORD_FORMAT,
            codec,
            stored,
        );
        let mut record = Vec::with_capacity(HEADER_LEN_2 + stored.len());
        record.extend_from_slice(&[RECORD_FORMAT, codec]);
        record.extend_from_slice(&crc.to_le_bytes());
        record.extend_from_slice(stored);
        // A huge body (a large tool result) leaves no huge buffer behind on the thread.
        if body.capacity() > SCRATCH_KEPT_BYTES {
            *body = Vec::new();
        }
        if compressed.capacity() > SCRATCH_KEPT_BYTES {
            *compressed = Vec::new();
        }
        Ok(record)
    })
}

/// The largest scratch buffer a thread keeps between records.
const SCRATCH_KEPT_BYTES: usize = 1 << 20;

/// A thread's buffers for encoding records.
#[derive(Default)]
struct Scratch {
    body: Vec<u8>,
    compressed: Vec<u8>,
}

thread_local! {
    /// This thread's encoding buffers, reused from record to record.
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Runs `f` with this thread's compressor, made on first use.
fn with_compressor<T>(
    f: impl FnOnce(&mut zstd::bulk::Compressor<'static>) -> std::io::Result<T>,
) -> std::io::Result<T> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        let compressor = match &mut *slot {
            Some(compressor) => compressor,
            empty => {
                let mut compressor =
                    zstd::bulk::Compressor::with_prepared_dictionary(encoder_dictionary())?;
                // The codec byte names the dictionary and the CRC covers the record.
                compressor.set_parameter(zstd::zstd_safe::CParameter::DictIdFlag(false))?;
                compressor.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(false))?;
                compressor.set_parameter(zstd::zstd_safe::CParameter::ContentSizeFlag(true))?;
                empty.insert(compressor)
            }
        };
        f(compressor)
    })
}

/// Runs `f` with this thread's decompressor, made on first use.
fn with_decompressor<T>(
    f: impl FnOnce(&mut zstd::bulk::Decompressor<'static>) -> std::io::Result<T>,
) -> std::io::Result<T> {
    DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        let decompressor = match &mut *slot {
            Some(decompressor) => decompressor,
            empty => empty.insert(zstd::bulk::Decompressor::with_prepared_dictionary(
                decoder_dictionary(),
            )?),
        };
        f(decompressor)
    })
}

/// The format-2 checksum: header bytes, where the record belongs, then the stored body.
fn checksum(session_id: &str, seq: u64, format: u8, codec: u8, body: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[format, codec]);
    hasher.update(&(session_id.len() as u64).to_le_bytes());
    hasher.update(session_id.as_bytes());
    hasher.update(&seq.to_le_bytes());
    hasher.update(body);
    hasher.finalize()
}

/// The `Encode` error of `envelope`.
fn encode_error(envelope: &EventEnvelope, reason: String) -> Error {
    Error::Encode {
        session_id: envelope.session_id.clone(),
        seq: envelope.seq,
        reason,
    }
}

/// Decodes a record of any format. `session_id` and `seq` say where it was read: errors name
/// them, and the record must be theirs.
pub fn decode(session_id: &str, seq: u64, record: &[u8]) -> Result<EventEnvelope> {
    match record.first() {
        None => Err(truncated(session_id, seq, record)),
        Some(&RECORD_FORMAT_1) => decode_format1(session_id, seq, record),
        Some(&RECORD_FORMAT) => decode_format2(session_id, seq, record),
        Some(&format) => Err(corrupt(
            session_id,
            seq,
            format!("unknown record format {format}"),
        )),
    }
}

/// Decodes a format-2 record.
fn decode_format2(session_id: &str, seq: u64, record: &[u8]) -> Result<EventEnvelope> {
    if record.len() < HEADER_LEN_2 {
        return Err(truncated(session_id, seq, record));
    }
    let (format, codec) = (record[0], record[1]);
    let stored = u32::from_le_bytes([record[2], record[3], record[4], record[5]]);
    let body = &record[HEADER_LEN_2..];
    let actual = checksum(session_id, seq, format, codec, body);
    if stored != actual {
        return Err(corrupt(
            session_id,
            seq,
            format!(
                "checksum mismatch (stored {stored:#010x}, computed {actual:#010x}): the record \
                 is damaged or belongs to another session or seq"
            ),
        ));
    }
    match codec {
        CODEC_STORED => decode_body(session_id, seq, body),
        CODEC_DICTIONARY_1 => {
            let decompressed = decompress(session_id, seq, body)?;
            decode_body(session_id, seq, &decompressed)
        }
        other => Err(corrupt(
            session_id,
            seq,
            format!("unknown record codec {other} (no dictionary {other} in this build)"),
        )),
    }
}

/// Decompresses a body against dictionary 1, allocating no more than the size its frame
/// declares, itself at most [`MAX_COMPRESSED_BODY_BYTES`].
fn decompress(session_id: &str, seq: u64, frame: &[u8]) -> Result<Vec<u8>> {
    let declared = match zstd::zstd_safe::get_frame_content_size(frame) {
        Ok(Some(size)) => size,
        Ok(None) => {
            return Err(corrupt(
                session_id,
                seq,
                "compressed body does not declare its size".to_owned(),
            ))
        }
        Err(_) => {
            return Err(corrupt(
                session_id,
                seq,
                "compressed body has no valid frame header".to_owned(),
            ))
        }
    };
    let size = usize::try_from(declared)
        .ok()
        .filter(|&size| size <= MAX_COMPRESSED_BODY_BYTES)
        .ok_or_else(|| {
            corrupt(
                session_id,
                seq,
                format!(
                    "compressed body declares {declared} bytes, over the \
                     {MAX_COMPRESSED_BODY_BYTES} a record may hold"
                ),
            )
        })?;
    let mut out = Vec::with_capacity(size);
    let written =
        with_decompressor(|decompressor| decompressor.decompress_to_buffer(frame, &mut out))
            .map_err(|e| corrupt(session_id, seq, format!("undecompressable body: {e}")))?;
    if written != size {
        return Err(corrupt(
            session_id,
            seq,
            format!("compressed body declares {size} bytes and holds {written}"),
        ));
    }
    Ok(out)
}

/// Decodes a format-2 body read at `session_id`/`seq`.
fn decode_body(session_id: &str, seq: u64, body: &[u8]) -> Result<EventEnvelope> {
    match rmp_serde::from_slice::<Body>(body) {
        Ok(body) => {
            check_version(session_id, seq, body.schema_version)?;
            Ok(EventEnvelope {
                schema_version: body.schema_version,
                kind: body.event.kind().to_owned(),
                session_id: session_id.to_owned(),
                seq,
                recorded_at_ms: body.recorded_at_ms,
                event: body.event,
            })
        }
        Err(body_error) => {
            let version: BodyVersion = rmp_serde::from_slice(body)
                .map_err(|e| corrupt(session_id, seq, format!("unreadable body: {e}")))?;
            check_version(session_id, seq, version.schema_version)?;
            Err(corrupt(
                session_id,
                seq,
                format!("undecodable event: {body_error}"),
            ))
        }
    }
}

/// Encodes an envelope as a format-1 record, as every record was written before format 2:
/// what the tests build old records with.
#[cfg(test)]
pub(crate) fn encode_format1(envelope: &EventEnvelope) -> Result<Vec<u8>> {
    let payload =
        rmp_serde::to_vec_named(envelope).map_err(|e| encode_error(envelope, e.to_string()))?;
    let mut record = Vec::with_capacity(HEADER_LEN_1 + payload.len());
    record.push(RECORD_FORMAT_1);
    record.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    record.extend_from_slice(&payload);
    Ok(record)
}

/// The envelope fields of a format-1 record read before the body, so that version and identity
/// are known first. The session id is borrowed from the record (msgpack strings are stored as
/// they are read).
#[derive(Deserialize)]
struct Format1Header<'a> {
    schema_version: u16,
    #[serde(borrow)]
    session_id: std::borrow::Cow<'a, str>,
    seq: u64,
}

/// Decodes a format-1 record.
///
/// A good record is read in one pass: the whole envelope, then its version and identity are
/// checked. Only when the envelope does not decode is the record read again for its header
/// alone, so that a newer schema version or another session's record is named as such rather
/// than as an undecodable body; the errors are those of checking the header first.
fn decode_format1(session_id: &str, seq: u64, record: &[u8]) -> Result<EventEnvelope> {
    let payload = checked_payload_format1(session_id, seq, record)?;
    match rmp_serde::from_slice::<EventEnvelope>(payload) {
        Ok(envelope) => {
            check_header_format1(
                session_id,
                seq,
                envelope.schema_version,
                &envelope.session_id,
                envelope.seq,
            )?;
            if envelope.kind != envelope.event.kind() {
                return Err(corrupt(
                    session_id,
                    seq,
                    format!(
                        "kind tag {:?} does not match body {:?}",
                        envelope.kind,
                        envelope.event.kind()
                    ),
                ));
            }
            Ok(envelope)
        }
        Err(body_error) => {
            let header: Format1Header = rmp_serde::from_slice(payload)
                .map_err(|e| corrupt(session_id, seq, format!("unreadable envelope: {e}")))?;
            check_header_format1(
                session_id,
                seq,
                header.schema_version,
                &header.session_id,
                header.seq,
            )?;
            Err(corrupt(
                session_id,
                seq,
                format!("undecodable event: {body_error}"),
            ))
        }
    }
}

/// The `CorruptRecord` error of the record at `session_id`/`seq`.
fn corrupt(session_id: &str, seq: u64, reason: String) -> Error {
    Error::CorruptRecord {
        session_id: session_id.to_owned(),
        seq,
        reason,
    }
}

/// The error of a record too short for its header.
fn truncated(session_id: &str, seq: u64, record: &[u8]) -> Error {
    corrupt(
        session_id,
        seq,
        format!("record of {} bytes is truncated", record.len()),
    )
}

/// The payload of a format-1 record whose checksum is good.
fn checked_payload_format1<'a>(session_id: &str, seq: u64, record: &'a [u8]) -> Result<&'a [u8]> {
    if record.len() < HEADER_LEN_1 {
        return Err(truncated(session_id, seq, record));
    }
    let stored = u32::from_le_bytes([record[1], record[2], record[3], record[4]]);
    let payload = &record[HEADER_LEN_1..];
    let actual = crc32fast::hash(payload);
    if stored != actual {
        return Err(corrupt(
            session_id,
            seq,
            format!("checksum mismatch (stored {stored:#010x}, computed {actual:#010x})"),
        ));
    }
    Ok(payload)
}

/// Checks a schema version: one this build reads.
fn check_version(session_id: &str, seq: u64, schema_version: u16) -> Result<()> {
    if schema_version == 0 || schema_version > SCHEMA_VERSION {
        return Err(Error::UnknownSchemaVersion {
            session_id: session_id.to_owned(),
            seq,
            version: schema_version,
        });
    }
    Ok(())
}

/// Checks a format-1 record's schema version, then that it is the record of `session_id`/`seq`.
fn check_header_format1(
    session_id: &str,
    seq: u64,
    schema_version: u16,
    record_session: &str,
    record_seq: u64,
) -> Result<()> {
    check_version(session_id, seq, schema_version)?;
    if record_session != session_id || record_seq != seq {
        return Err(corrupt(
            session_id,
            seq,
            format!("record belongs to session {record_session:?} seq {record_seq}"),
        ));
    }
    Ok(())
}
