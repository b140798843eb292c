//! The record codec: an event envelope as named-field msgpack behind a format byte and a CRC32.
//!
//! Record layout: `[format: u8 = 1][crc32 of payload: u32 LE][payload: msgpack of EventEnvelope]`.
//! Decoding checks the format, the checksum, then the schema version, before the body.

use crate::error::{Error, Result};
use crate::event::{EventEnvelope, SCHEMA_VERSION};
use serde::Deserialize;

/// The record format byte this code writes.
pub const RECORD_FORMAT: u8 = 1;
const HEADER_LEN: usize = 5;

/// Encodes an envelope as a checksummed record.
pub fn encode(envelope: &EventEnvelope) -> Result<Vec<u8>> {
    let payload = rmp_serde::to_vec_named(envelope).map_err(|e| Error::Encode {
        session_id: envelope.session_id.clone(),
        seq: envelope.seq,
        reason: e.to_string(),
    })?;
    let mut record = Vec::with_capacity(HEADER_LEN + payload.len());
    record.push(RECORD_FORMAT);
    record.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    record.extend_from_slice(&payload);
    Ok(record)
}

/// The envelope fields read before the body, so that version and identity are known first.
#[derive(Deserialize)]
struct Header {
    schema_version: u16,
    session_id: String,
    seq: u64,
}

/// Decodes a record. `session_id` and `seq` say where it was read, for errors.
pub fn decode(session_id: &str, seq: u64, record: &[u8]) -> Result<EventEnvelope> {
    let corrupt = |reason: String| Error::CorruptRecord {
        session_id: session_id.to_owned(),
        seq,
        reason,
    };
    if record.len() < HEADER_LEN {
        return Err(corrupt(format!(
            "record of {} bytes is truncated",
            record.len()
        )));
    }
    if record[0] != RECORD_FORMAT {
        return Err(corrupt(format!("unknown record format {}", record[0])));
    }
    let stored = u32::from_le_bytes([record[1], record[2], record[3], record[4]]);
    let payload = &record[HEADER_LEN..];
    let actual = crc32fast::hash(payload);
    if stored != actual {
        return Err(corrupt(format!(
            "checksum mismatch (stored {stored:#010x}, computed {actual:#010x})"
        )));
    }
    let header: Header =
        rmp_serde::from_slice(payload).map_err(|e| corrupt(format!("unreadable envelope: {e}")))?;
    if header.schema_version == 0 || header.schema_version > SCHEMA_VERSION {
        return Err(Error::UnknownSchemaVersion {
            session_id: session_id.to_owned(),
            seq,
            version: header.schema_version,
        });
    }
    if header.session_id != session_id || header.seq != seq {
        return Err(corrupt(format!(
            "record belongs to session {:?} seq {}",
            header.session_id, header.seq
        )));
    }
    let envelope: EventEnvelope =
        rmp_serde::from_slice(payload).map_err(|e| corrupt(format!("undecodable event: {e}")))?;
    if envelope.kind != envelope.event.kind() {
        return Err(corrupt(format!(
            "kind tag {:?} does not match body {:?}",
            envelope.kind,
            envelope.event.kind()
        )));
    }
    Ok(envelope)
}
