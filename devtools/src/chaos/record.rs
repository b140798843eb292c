//! The side-effect file's record format: self-delimiting and checksummed, so that a record torn
//! by a kill is recognised as such and real damage is not.
//!
//! A kill can tear even a single `write` of a regular file: the kernel copies it page by page
//! and stops at a page boundary when a fatal signal is pending, so a SIGKILL leaves a prefix of
//! the record (4 KiB pages: a record crossing a boundary). The next run appends after that
//! prefix. Each record is therefore framed:
//!
//! ```text
//! RS PID LEN CRC JSON LF        RS = 0x1e; PID, LEN, CRC: 8 lowercase hex digits, each
//!                               followed by one space; LEN and CRC (CRC-32 IEEE) are of JSON
//! ```
//!
//! `0x1e` never occurs in the rest of a record (compact JSON escapes control characters, the
//! header is hex and spaces), so every record starts at one and a reader resynchronises after a
//! torn one. A frame shorter than its header announces, without a newline, and whose bytes
//! match the format so far, is a torn record: [`parse`] reports it with its writer's pid when
//! the pid got out. Anything else that does not check (a flipped bit, a lost byte, bytes before
//! the first record) is damage.

use super::SideEffectRecord;

/// Starts every record.
const RS: u8 = 0x1e;
/// `RS`, three 8-digit hex fields each with its space.
const HEADER_LEN: usize = 1 + 3 * 9;

/// The bytes of one record.
pub fn encode(record: &SideEffectRecord) -> Vec<u8> {
    // Serializing a struct of strings and integers cannot fail.
    let json = serde_json::to_vec(record).unwrap_or_default();
    let mut out = Vec::with_capacity(HEADER_LEN + json.len() + 1);
    out.push(RS);
    out.extend_from_slice(
        format!(
            "{:08x} {:08x} {:08x} ",
            record.pid,
            json.len(),
            crc32fast::hash(&json)
        )
        .as_bytes(),
    );
    out.extend_from_slice(&json);
    out.push(b'\n');
    out
}

/// A record cut short by a kill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Torn {
    /// Where it starts in the file.
    pub offset: usize,
    /// Its writer, when the cut came after the pid.
    pub pid: Option<u32>,
}

/// What a side-effect file holds.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// Whole records, in file order.
    pub records: Vec<SideEffectRecord>,
    /// Records torn by a kill.
    pub torn: Vec<Torn>,
    /// Damage: what does not check, with its offset.
    pub damage: Vec<String>,
}

/// Reads a side-effect file's bytes.
pub fn parse(bytes: &[u8]) -> Parsed {
    let mut parsed = Parsed::default();
    let starts: Vec<usize> = bytes
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == RS)
        .map(|(i, _)| i)
        .collect();
    let first = starts.first().copied().unwrap_or(bytes.len());
    if first > 0 {
        parsed.damage.push(format!(
            "offset 0: {first} byte(s) before the first record: {:?}",
            String::from_utf8_lossy(&bytes[..first.min(80)])
        ));
    }
    for (i, &start) in starts.iter().enumerate() {
        let end = starts.get(i + 1).copied().unwrap_or(bytes.len());
        match frame(&bytes[start..end]) {
            Frame::Record(record) => parsed.records.push(record),
            Frame::Torn(pid) => parsed.torn.push(Torn { offset: start, pid }),
            Frame::Damaged(what) => parsed.damage.push(format!("offset {start}: {what}")),
        }
    }
    parsed
}

enum Frame {
    Record(SideEffectRecord),
    Torn(Option<u32>),
    Damaged(String),
}

/// One frame: from an `RS` to the next one or the end of the file.
fn frame(frame: &[u8]) -> Frame {
    let shown = || String::from_utf8_lossy(&frame[..frame.len().min(120)]).into_owned();
    // The header so far must have the format: hex digits, and spaces at 9, 18 and 27.
    let header = &frame[..frame.len().min(HEADER_LEN)];
    let header_ok = header.iter().enumerate().skip(1).all(|(i, b)| {
        if i % 9 == 0 {
            *b == b' '
        } else {
            b.is_ascii_digit() || (b'a'..=b'f').contains(b)
        }
    });
    if !header_ok {
        return Frame::Damaged(format!("not a record header: {:?}", shown()));
    }
    let field = |k: usize| {
        std::str::from_utf8(&frame[1 + 9 * k..9 + 9 * k])
            .ok()
            .and_then(|h| u32::from_str_radix(h, 16).ok())
    };
    let pid = if frame.len() >= 9 { field(0) } else { None };
    let newline = frame.iter().position(|b| *b == b'\n');
    if frame.len() < HEADER_LEN {
        return match newline {
            None => Frame::Torn(pid),
            Some(_) => Frame::Damaged(format!("a record header cut by a newline: {:?}", shown())),
        };
    }
    let (Some(pid), Some(len), Some(crc)) = (field(0), field(1), field(2)) else {
        return Frame::Damaged(format!("not a record header: {:?}", shown()));
    };
    let whole = HEADER_LEN + len as usize + 1;
    if frame.len() < whole && newline.is_none() {
        // A prefix of a record (its checksum cannot be checked): the kill tore it.
        return Frame::Torn(Some(pid));
    }
    if frame.len() != whole || newline != Some(whole - 1) {
        return Frame::Damaged(format!(
            "a record of {} bytes announces {whole}: {:?}",
            frame.len(),
            shown()
        ));
    }
    let json = &frame[HEADER_LEN..whole - 1];
    if crc32fast::hash(json) != crc {
        return Frame::Damaged(format!("checksum mismatch: {:?}", shown()));
    }
    match serde_json::from_slice::<SideEffectRecord>(json) {
        Ok(record) if record.pid == pid => Frame::Record(record),
        Ok(record) => Frame::Damaged(format!(
            "the header's pid {pid} is not the record's {}",
            record.pid
        )),
        Err(e) => Frame::Damaged(format!("not a record ({e}): {:?}", shown())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: u32) -> SideEffectRecord {
        SideEffectRecord {
            key: format!("chaos-001/toolu_t{n}_r0_0"),
            tool_use_id: format!("toolu_t{n}_r0_0"),
            pid: 4000 + n,
            attempt: 1,
            at_ms: 1_700_000_000_000 + u64::from(n),
        }
    }

    /// Records 0, 1, … until the next one would cross `page`; then that one cut exactly at
    /// `page` (as a kill tears a write), then one more whole record (the next run's).
    fn torn_at_page(page: usize) -> (Vec<u8>, SideEffectRecord, usize, SideEffectRecord) {
        let mut bytes = Vec::new();
        let mut n = 0;
        loop {
            let next = encode(&record(n));
            if bytes.len() + next.len() > page {
                break;
            }
            bytes.extend_from_slice(&next);
            n += 1;
        }
        let torn = record(n);
        let torn_at = bytes.len();
        bytes.extend_from_slice(&encode(&torn)[..page - torn_at]);
        assert_eq!(bytes.len(), page);
        let after = record(n + 1);
        bytes.extend_from_slice(&encode(&after));
        (bytes, torn, torn_at, after)
    }

    #[test]
    fn records_round_trip() {
        let bytes: Vec<u8> = (0..3).flat_map(|n| encode(&record(n))).collect();
        let parsed = parse(&bytes);
        assert_eq!(parsed.records, [record(0), record(1), record(2)]);
        assert!(
            parsed.torn.is_empty() && parsed.damage.is_empty(),
            "{parsed:?}"
        );
        assert_eq!(parse(b""), Parsed::default());
    }

    #[test]
    fn a_record_torn_at_a_page_boundary_is_recognised_and_the_next_one_read() {
        let (bytes, torn, torn_at, after) = torn_at_page(4096);
        let parsed = parse(&bytes);
        assert!(parsed.damage.is_empty(), "{:?}", parsed.damage);
        assert_eq!(
            parsed.torn,
            [Torn {
                offset: torn_at,
                pid: (4096 - torn_at >= 9).then_some(torn.pid),
            }]
        );
        assert_eq!(parsed.records.last(), Some(&after));
        assert_eq!(parsed.records.len(), torn_at / encode(&record(0)).len() + 1);
    }

    #[test]
    fn a_record_torn_anywhere_is_torn_not_damaged() {
        // Every cut of a record, from one byte in to one byte short, followed by a record or
        // the end of the file.
        let whole = encode(&record(7));
        for cut in 1..whole.len() {
            for tail in [Vec::new(), encode(&record(8))] {
                let mut bytes = encode(&record(6));
                bytes.extend_from_slice(&whole[..cut]);
                bytes.extend_from_slice(&tail);
                let parsed = parse(&bytes);
                assert!(parsed.damage.is_empty(), "cut {cut}: {:?}", parsed.damage);
                assert_eq!(parsed.torn.len(), 1, "cut {cut}");
                let pid = parsed.torn[0].pid;
                assert_eq!(pid, (cut >= 9).then_some(4007), "cut {cut}");
                assert_eq!(parsed.records.len(), 1 + usize::from(!tail.is_empty()));
            }
        }
    }

    #[test]
    fn damage_is_not_taken_for_a_torn_record() {
        let good = encode(&record(1));
        let damaged = |bytes: Vec<u8>| {
            let parsed = parse(&bytes);
            assert!(parsed.torn.is_empty(), "{parsed:?}");
            parsed.damage.join("\n")
        };
        // A flipped bit in the JSON.
        let mut flipped = good.clone();
        flipped[HEADER_LEN + 5] ^= 0x01;
        assert!(damaged(flipped).contains("checksum mismatch"));
        // A byte lost in the middle of a whole record (it still ends with its newline).
        let mut short = good.clone();
        short.remove(HEADER_LEN + 3);
        assert!(damaged(short).contains("announces"));
        // A byte too many.
        let mut long = good.clone();
        long.insert(HEADER_LEN + 3, b'x');
        assert!(damaged(long).contains("announces"));
        // Bytes before the first record: the old line format, or garbage.
        let mut before = b"{\"key\":\"s/a\"}\n".to_vec();
        before.extend_from_slice(&good);
        assert!(damaged(before).contains("before the first record"));
        // A damaged header.
        let mut header = good.clone();
        header[3] = b'z';
        assert!(damaged(header).contains("not a record header"));
    }
}
