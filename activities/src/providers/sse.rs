//! A server-sent events decoder that is linear in its input and bounds each event's size.
//!
//! Follows the SSE spec's parsing rules (WHATWG HTML, "Server-sent events"): lines end with CRLF,
//! LF or CR; a blank line dispatches the event; `data:` lines are joined with `\n`; `event:`
//! sets the type (default `message`); `id:` sets the last event id (ignored if it holds NUL);
//! lines starting with `:` are comments; one space after the colon is dropped; a field without
//! a colon has an empty value; a leading UTF-8 BOM is skipped; an event not ended by a blank
//! line when the stream ends is discarded. `retry:` is ignored: we never reconnect, a broken
//! stream is a failed attempt.
//!
//! Why our own: the generic decoder we used re-parsed its whole buffer on every chunk, so one
//! large event cost time quadratic in its size. Here every byte is scanned once, and an event
//! growing past the cap is refused with [`Error::EventTooLarge`] before it is buffered further.

use crate::error::{Error, ErrorKind, Result};
use crate::providers::drive::WireDecoder;
use std::collections::VecDeque;

/// One dispatched event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The event type: the last `event:` field, or `message`.
    pub event: String,
    /// The `data:` lines joined with `\n`.
    pub data: String,
    /// The last event id seen so far in the stream (`id:` fields persist across events).
    pub id: String,
}

/// Incremental decoder: [`SseDecoder::push`] the body's chunks, take events with
/// [`SseDecoder::next_event`].
#[derive(Debug)]
pub struct SseDecoder {
    provider: String,
    max_event_bytes: usize,
    /// Received bytes not yet consumed as complete lines.
    pending: Vec<u8>,
    /// Stream offset of `pending[0]`, for error messages.
    offset: u64,
    /// The previous chunk ended with CR: an LF starting the next chunk ends the same line.
    skip_lf: bool,
    /// No line has been processed yet (the BOM may only appear before the first).
    first_line: bool,
    event_type: String,
    data: String,
    /// Whether any `data:` field was seen in the current event (the buffer may hold `""` then).
    has_data: bool,
    last_id: String,
    /// Stream offset where the current event began.
    event_start: u64,
    ready: VecDeque<SseEvent>,
}

impl SseDecoder {
    /// A decoder for `provider`'s stream refusing events over `max_event_bytes`.
    ///
    /// An event's size is its data (lines joined) plus any line still being received, i.e. what
    /// the decoder would have to hold for it.
    pub fn new(provider: impl Into<String>, max_event_bytes: usize) -> Self {
        SseDecoder {
            provider: provider.into(),
            max_event_bytes,
            pending: Vec::new(),
            offset: 0,
            skip_lf: false,
            first_line: true,
            event_type: String::new(),
            data: String::new(),
            has_data: false,
            last_id: String::new(),
            event_start: 0,
            ready: VecDeque::new(),
        }
    }

    /// Decodes `chunk`, queueing every event it completes. Errors (an event over the cap, a
    /// line that is not UTF-8) are final: the stream cannot be resynchronised.
    pub fn push(&mut self, chunk: &[u8]) -> Result<()> {
        let mut chunk = chunk;
        if self.skip_lf && !chunk.is_empty() {
            self.skip_lf = false;
            if chunk[0] == b'\n' {
                chunk = &chunk[1..];
                self.offset += 1;
                if self.event_is_empty() {
                    self.event_start = self.offset;
                }
            }
        }
        // Only the new bytes are scanned: everything before them in `pending` holds no line end.
        let mut scan = self.pending.len();
        self.pending.extend_from_slice(chunk);
        let mut line_start = 0;
        while let Some(found) = self.pending[scan..]
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
        {
            let end = scan + found;
            let next = match self.pending[end] {
                b'\r' => match self.pending.get(end + 1) {
                    Some(b'\n') => end + 2,
                    Some(_) => end + 1,
                    None => {
                        // The LF of a CRLF may come with the next chunk.
                        self.skip_lf = true;
                        end + 1
                    }
                },
                _ => end + 1,
            };
            let at = self.offset + line_start as u64;
            let line = std::mem::take(&mut self.pending);
            let result = self.line(&line[line_start..end], at);
            self.pending = line;
            result?;
            line_start = next;
            scan = next;
            if self.event_is_empty() {
                self.event_start = self.offset + next as u64;
            }
        }
        // Compact once per chunk: what remains is part of one line, never longer than the cap
        // (checked below), so the copying stays proportional to the input.
        if line_start > 0 {
            self.pending.drain(..line_start);
            self.offset += line_start as u64;
        }
        let held = self.data.len() + self.pending.len();
        if held > self.max_event_bytes {
            return Err(self.too_large(held));
        }
        Ok(())
    }

    /// The next complete event, if one is queued.
    pub fn next_event(&mut self) -> Option<SseEvent> {
        self.ready.pop_front()
    }

    /// Ends the stream: an event not ended by a blank line is discarded (as the spec says);
    /// the provider's parser then sees the stream end without its final event.
    pub fn finish(&mut self) {
        if !self.pending.is_empty() || self.has_data {
            tracing::debug!(
                provider = %self.provider,
                at = self.event_start,
                "SSE stream ended inside an event; the partial event is discarded"
            );
        }
        self.pending.clear();
        self.data.clear();
        self.has_data = false;
    }

    fn event_is_empty(&self) -> bool {
        !self.has_data && self.event_type.is_empty()
    }

    fn too_large(&self, held: usize) -> Error {
        Error::EventTooLarge {
            provider: self.provider.clone(),
            limit_bytes: self.max_event_bytes,
            what: format!(
                "the SSE event starting at byte {} ({held} bytes so far)",
                self.event_start
            ),
        }
    }

    fn line(&mut self, line: &[u8], at: u64) -> Result<()> {
        let mut line = line;
        if self.first_line {
            self.first_line = false;
            line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch();
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(());
        }
        let line = std::str::from_utf8(line).map_err(|e| Error::Stream {
            provider: self.provider.clone(),
            kind: ErrorKind::InvalidResponse,
            message: format!("the SSE line at byte {at} is not valid UTF-8: {e}"),
        })?;
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "event" => value.clone_into(&mut self.event_type),
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.has_data = true;
                self.data.push_str(value);
                if self.data.len() > self.max_event_bytes {
                    return Err(self.too_large(self.data.len()));
                }
            }
            "id" if !value.contains('\0') => value.clone_into(&mut self.last_id),
            // `retry` and unknown fields are ignored.
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self) {
        let event_type = std::mem::take(&mut self.event_type);
        if !std::mem::take(&mut self.has_data) {
            // No data: nothing is dispatched, and the type buffer resets.
            return;
        }
        self.ready.push_back(SseEvent {
            event: if event_type.is_empty() {
                "message".to_owned()
            } else {
                event_type
            },
            data: std::mem::take(&mut self.data),
            id: self.last_id.clone(),
        });
    }
}

impl WireDecoder for SseDecoder {
    type Event = SseEvent;

    fn with_cap(provider: &str, max_event_bytes: usize) -> Self {
        SseDecoder::new(provider, max_event_bytes)
    }

    fn push(&mut self, chunk: &[u8]) -> Result<()> {
        SseDecoder::push(self, chunk)
    }

    fn next_event(&mut self) -> Result<Option<SseEvent>> {
        Ok(SseDecoder::next_event(self))
    }

    fn finish(&mut self) -> Result<()> {
        // SSE may end anywhere: a partial event is dropped, and the parser decides whether the
        // stream was complete.
        SseDecoder::finish(self);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CAP: usize = 1 << 20;

    fn decode_chunks(chunks: &[&[u8]], cap: usize) -> Result<Vec<SseEvent>> {
        let mut decoder = SseDecoder::new("test", cap);
        let mut out = Vec::new();
        for chunk in chunks {
            decoder.push(chunk)?;
            while let Some(event) = decoder.next_event() {
                out.push(event);
            }
        }
        decoder.finish();
        Ok(out)
    }

    fn decode(text: &str) -> Vec<SseEvent> {
        decode_chunks(&[text.as_bytes()], CAP).unwrap()
    }

    fn event(event: &str, data: &str, id: &str) -> SseEvent {
        SseEvent {
            event: event.into(),
            data: data.into(),
            id: id.into(),
        }
    }

    #[test]
    fn spec_examples() {
        // The examples of the spec's "Event stream interpretation" section.
        assert_eq!(
            decode(
                ": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event\n"
            ),
            [
                event("message", "first event", "1"),
                event("message", "second event", ""),
            ]
        );
        assert_eq!(
            decode("data\n\ndata\ndata\n\ndata:"),
            [event("message", "", ""), event("message", "\n", "")]
        );
        assert_eq!(
            decode("data:test\n\ndata: test\n\n"),
            [event("message", "test", ""), event("message", "test", "")]
        );
        assert_eq!(
            decode("data: YHOO\ndata: +2\ndata: 10\n\n"),
            [event("message", "YHOO\n+2\n10", "")]
        );
    }

    #[test]
    fn event_types_ids_comments_and_unknown_fields() {
        assert_eq!(
            decode(
                "\u{feff}event: ping\n:comment\nretry: 10\nfoo: bar\ndata: {}\n\nevent: only-type\n\nid: a\0b\ndata: x\n\n"
            ),
            [event("ping", "{}", ""), event("message", "x", "")]
        );
        // A BOM is only skipped at the very start.
        assert_eq!(decode("data: a\n\n\u{feff}data: b\n\n").len(), 1);
    }

    #[test]
    fn line_endings_are_equivalent() {
        let lf = "event: a\ndata: 1\ndata: 2\n\n:c\ndata: 3\n\n";
        let expected = decode(lf);
        assert_eq!(expected.len(), 2);
        assert_eq!(decode(&lf.replace('\n', "\r\n")), expected);
        assert_eq!(decode(&lf.replace('\n', "\r")), expected);
        // CR then LF in separate chunks is one line end, not two.
        let crlf = lf.replace('\n', "\r\n");
        let bytes = crlf.as_bytes();
        for split in 0..bytes.len() {
            let (a, b) = bytes.split_at(split);
            assert_eq!(
                decode_chunks(&[a, b], CAP).unwrap(),
                expected,
                "split {split}"
            );
        }
    }

    #[test]
    fn a_multi_megabyte_event_decodes_in_small_chunks() {
        // 20 MB of data in 16 KiB chunks: a decoder that re-scans its buffer per chunk would
        // take minutes here; this one scans each byte once.
        let payload = "x".repeat(20 * 1024 * 1024);
        let text = format!("event: big\ndata: {payload}\n\n");
        let chunks: Vec<&[u8]> = text.as_bytes().chunks(16 * 1024).collect();
        let events = decode_chunks(&chunks, 32 * 1024 * 1024).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].data.len(), payload.len());
    }

    #[test]
    fn an_event_over_the_cap_is_a_typed_error() {
        // A single long line still arriving.
        let long = format!("data: {}", "y".repeat(100));
        let err = decode_chunks(&[b"data: ok\n\n", long.as_bytes()], 64).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidResponse);
        assert!(
            matches!(&err, Error::EventTooLarge { provider, limit_bytes: 64, .. } if provider == "test"),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("test stream") && text.contains("64 bytes") && text.contains("byte 10"),
            "{text}"
        );
        // Many short data lines in one chunk.
        let many = "data: 0123456789\n".repeat(10);
        let err = decode_chunks(&[many.as_bytes()], 64).unwrap_err();
        assert!(matches!(err, Error::EventTooLarge { .. }), "{err:?}");
        // At the cap exactly: fine.
        let exact = format!("data: {}\n\n", "z".repeat(64));
        assert_eq!(decode_chunks(&[exact.as_bytes()], 64).unwrap().len(), 1);
    }

    #[test]
    fn invalid_utf8_is_a_stream_error() {
        let err = decode_chunks(&[b"data: ok\n\ndata: \xff\n\n"], CAP).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidResponse);
        assert!(err.to_string().contains("byte 10"), "{err}");
    }

    fn arb_stream() -> impl Strategy<Value = String> {
        let line = prop_oneof![
            "[a-z {}\":,]{0,12}".prop_map(|v| format!("data: {v}")),
            "[a-z{}]{0,6}".prop_map(|v| format!("data:{v}")),
            "[a-z_]{1,8}".prop_map(|v| format!("event: {v}")),
            "[0-9]{1,3}".prop_map(|v| format!("id: {v}")),
            "[a-z ]{0,8}".prop_map(|v| format!(":{v}")),
            Just(String::new()),
            Just("data".to_owned()),
        ];
        let ending = prop_oneof![Just("\n"), Just("\r\n"), Just("\r")];
        proptest::collection::vec((line, ending), 0..40).prop_map(|lines| {
            lines
                .into_iter()
                .map(|(line, end)| format!("{line}{end}"))
                .collect()
        })
    }

    proptest! {
        #[test]
        fn splitting_a_stream_anywhere_changes_nothing(
            text in arb_stream(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let bytes = text.as_bytes();
            let whole = decode_chunks(&[bytes], CAP).unwrap();
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
            points.sort_unstable();
            let mut chunks = Vec::new();
            let mut from = 0;
            for p in points {
                chunks.push(&bytes[from..p]);
                from = p;
            }
            chunks.push(&bytes[from..]);
            prop_assert_eq!(decode_chunks(&chunks, CAP).unwrap(), whole.clone());
            // Every line ending style gives the same events.
            let lf = text.replace("\r\n", "\n").replace('\r', "\n");
            prop_assert_eq!(decode(&lf), whole.clone());
            prop_assert_eq!(decode(&lf.replace('\n', "\r\n")), whole);
        }
    }
}
