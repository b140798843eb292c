//! A session's server-sent event stream decoded into [`StreamEvent`]s. The SSE framing is the
//! activities crate's decoder — the one the model providers' streams go through, linear in its
//! input, bounded per event, tested against the spec — and this module gives the messages
//! their meaning: `event` messages are history events, `delta` messages model deltas, and an
//! `error` message the server's reason for ending the stream.

use crate::connection::MAX_BODY_BYTES;
use cairn_activities::providers::sse::{SseDecoder, SseEvent};
use cairn_runtime::wire::StreamEvent;
use cairn_runtime::{DeltaEvent, EventEnvelope};
use serde::de::DeserializeOwned;
use tracing::debug;

/// Decodes one connection's body, chunk by chunk.
pub(crate) struct StreamDecoder {
    sse: SseDecoder,
    /// The data of an `error` message: the server's last word on this connection (it ends
    /// the stream after one, when it cannot read the history on).
    server_error: Option<String>,
}

impl StreamDecoder {
    /// A decoder for a new connection.
    pub fn new() -> Self {
        StreamDecoder {
            sse: SseDecoder::new("cairn server", MAX_BODY_BYTES),
            server_error: None,
        }
    }

    /// The data of the `error` message the server ended the stream with, if it did (a JSON
    /// error body).
    pub fn take_server_error(&mut self) -> Option<String> {
        self.server_error.take()
    }

    /// Feeds a chunk of the body. An error (an event over the size cap, a line that is not
    /// UTF-8) is final for this connection.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), String> {
        self.sse.push(chunk).map_err(|e| e.to_string())
    }

    /// The next complete message: `Some(Ok(None))` for one that carries nothing for us (a
    /// message type this client does not know, or a delta it cannot read: deltas are
    /// presentation only), an error for a history event that does not decode.
    pub fn next(&mut self) -> Option<Result<Option<StreamEvent>, String>> {
        let message = self.sse.next_event()?;
        if message.event == "error" {
            self.server_error = Some(message.data);
            return Some(Ok(None));
        }
        Some(decode(&message))
    }
}

/// The meaning of one SSE message. The data is a [`StreamEvent`] (`{"type", "data"}`), or
/// the bare event or delta its SSE type names: both are read, so either way of writing the
/// stream works.
fn decode(message: &SseEvent) -> Result<Option<StreamEvent>, String> {
    let tagged = || serde_json::from_str::<StreamEvent>(&message.data).ok();
    match message.event.as_str() {
        "event" => match tagged() {
            Some(event) => Ok(Some(event)),
            None => parse::<EventEnvelope>(message).map(|e| Some(StreamEvent::Event(e))),
        },
        "delta" => match tagged() {
            Some(event) => Ok(Some(event)),
            None => match parse::<DeltaEvent>(message) {
                Ok(delta) => Ok(Some(StreamEvent::Delta(delta))),
                Err(e) => {
                    debug!(error = %e, "skipping a delta this client cannot read");
                    Ok(None)
                }
            },
        },
        // No `event:` field: the data must say what it is.
        "message" => match tagged() {
            Some(event) => Ok(Some(event)),
            None => parse::<EventEnvelope>(message).map(|e| Some(StreamEvent::Event(e))),
        },
        other => {
            debug!(
                kind = other,
                "skipping an SSE message of a kind this client does not know"
            );
            Ok(None)
        }
    }
}

fn parse<T: DeserializeOwned>(message: &SseEvent) -> Result<T, String> {
    serde_json::from_str(&message.data).map_err(|e| {
        format!(
            "an SSE {:?} message (id {:?}) does not decode: {e}",
            message.event, message.id
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::Delta;
    use cairn_runtime::{ActivityRef, Event};

    fn envelope(seq: u64) -> EventEnvelope {
        EventEnvelope {
            schema_version: cairn_runtime::SCHEMA_VERSION,
            kind: "user_message".to_owned(),
            session_id: "s1".to_owned(),
            seq,
            recorded_at_ms: 1_700_000_000_000 + seq,
            event: Event::UserMessage {
                idempotency_key: None,
                tool_choice: None,
                turn: 1,
                text: format!("line one\nline two of {seq}"),
                model: None,
                media: Vec::new(),
            },
        }
    }

    fn delta(text: &str) -> DeltaEvent {
        DeltaEvent {
            origin: ActivityRef {
                session_id: "s1".to_owned(),
                turn: 1,
                activity: "model:0".to_owned(),
                attempt: 1,
            },
            delta: Delta::Text(text.to_owned()),
        }
    }

    /// Decodes `chunks` in order, as one connection.
    fn decode_chunks(chunks: &[&[u8]]) -> Result<Vec<StreamEvent>, String> {
        let mut decoder = StreamDecoder::new();
        let mut out = Vec::new();
        for chunk in chunks {
            decoder.push(chunk)?;
            while let Some(message) = decoder.next() {
                out.extend(message?);
            }
        }
        Ok(out)
    }

    /// A stream as a server may write it: a comment, a tagged event, a bare delta whose
    /// JSON spans several `data:` lines, a message of an unknown kind, a bare event.
    fn sample() -> (String, Vec<StreamEvent>) {
        let first = StreamEvent::Event(envelope(1));
        let pretty_delta = serde_json::to_string_pretty(&delta("Hel")).unwrap();
        let multi_line_data: String = pretty_delta
            .lines()
            .map(|line| format!("data: {line}\n"))
            .collect();
        let text = format!(
            ": keepalive\n\nevent: event\nid: 1\ndata: {}\n\nevent: delta\n{multi_line_data}\nevent: ping\ndata: {{}}\n\nevent: event\nid: 2\ndata: {}\n\n",
            serde_json::to_string(&first).unwrap(),
            serde_json::to_string(&envelope(2)).unwrap(),
        );
        let expected = vec![
            first,
            StreamEvent::Delta(delta("Hel")),
            StreamEvent::Event(envelope(2)),
        ];
        (text, expected)
    }

    #[test]
    fn tagged_bare_multi_line_and_unknown_messages() {
        let (text, expected) = sample();
        assert_eq!(decode_chunks(&[text.as_bytes()]).unwrap(), expected);
    }

    #[test]
    fn chunks_split_anywhere_and_crlf_decode_the_same() {
        let (text, expected) = sample();
        for text in [
            text.clone(),
            text.replace('\n', "\r\n"),
            text.replace('\n', "\r"),
        ] {
            let bytes = text.as_bytes();
            for split in 0..=bytes.len() {
                let (a, b) = bytes.split_at(split);
                assert_eq!(
                    decode_chunks(&[a, b]).unwrap(),
                    expected,
                    "split at {split} of {text:?}"
                );
            }
            // One byte at a time.
            let bytes: Vec<&[u8]> = bytes.chunks(1).collect();
            assert_eq!(decode_chunks(&bytes).unwrap(), expected);
        }
    }

    #[test]
    fn a_message_cut_off_by_the_connection_is_not_delivered() {
        let (text, expected) = sample();
        // Everything up to the last blank line but one byte: the last event is incomplete.
        let cut = &text.as_bytes()[..text.len() - 1];
        assert_eq!(decode_chunks(&[cut]).unwrap(), expected[..2]);
    }

    #[test]
    fn an_event_that_does_not_decode_is_an_error_and_a_delta_is_skipped() {
        let err = decode_chunks(&[b"event: event\nid: 3\ndata: {\"seq\": 3}\n\n"]).unwrap_err();
        assert!(
            err.contains("\"event\"") && err.contains("id \"3\""),
            "{err}"
        );
        let skipped = decode_chunks(&[b"event: delta\ndata: {\"future\": 1}\n\n"]).unwrap();
        assert!(skipped.is_empty());
        let err = decode_chunks(&[b"data: not json\n\n"]).unwrap_err();
        assert!(err.contains("does not decode"), "{err}");
    }
}
