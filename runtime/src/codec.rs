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
/// The session id is borrowed from the record (msgpack strings are stored as they are read).
#[derive(Deserialize)]
struct Header<'a> {
    schema_version: u16,
    #[serde(borrow)]
    session_id: std::borrow::Cow<'a, str>,
    seq: u64,
}

/// Decodes a record. `session_id` and `seq` say where it was read, for errors.
///
/// A good record is read in one pass: the whole envelope, then its version and identity are
/// checked. Only when the envelope does not decode is the record read again for its header
/// alone, so that a newer schema version or another session's record is named as such rather
/// than as an undecodable body; the errors are those of checking the header first.
pub fn decode(session_id: &str, seq: u64, record: &[u8]) -> Result<EventEnvelope> {
    let payload = checked_payload(session_id, seq, record)?;
    match rmp_serde::from_slice::<EventEnvelope>(payload) {
        Ok(envelope) => {
            check_header(
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
            let header: Header = rmp_serde::from_slice(payload)
                .map_err(|e| corrupt(session_id, seq, format!("unreadable envelope: {e}")))?;
            check_header(
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

/// The payload of a record whose format byte and checksum are good.
fn checked_payload<'a>(session_id: &str, seq: u64, record: &'a [u8]) -> Result<&'a [u8]> {
    if record.len() < HEADER_LEN {
        return Err(corrupt(
            session_id,
            seq,
            format!("record of {} bytes is truncated", record.len()),
        ));
    }
    if record[0] != RECORD_FORMAT {
        return Err(corrupt(
            session_id,
            seq,
            format!("unknown record format {}", record[0]),
        ));
    }
    let stored = u32::from_le_bytes([record[1], record[2], record[3], record[4]]);
    let payload = &record[HEADER_LEN..];
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

/// Checks a record's schema version, then that it is the record of `session_id`/`seq`.
fn check_header(
    session_id: &str,
    seq: u64,
    schema_version: u16,
    record_session: &str,
    record_seq: u64,
) -> Result<()> {
    if schema_version == 0 || schema_version > SCHEMA_VERSION {
        return Err(Error::UnknownSchemaVersion {
            session_id: session_id.to_owned(),
            seq,
            version: schema_version,
        });
    }
    if record_session != session_id || record_seq != seq {
        return Err(corrupt(
            session_id,
            seq,
            format!("record belongs to session {record_session:?} seq {record_seq}"),
        ));
    }
    Ok(())
}
