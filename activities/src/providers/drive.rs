//! The one drive loop every model provider's `call` runs: POST the rendered request, decode the
//! response body into wire events, feed each to the provider's pure stream parser, and finish.
//!
//! A provider supplies two pure pieces — a [`WireDecoder`] (SSE events, or AWS event-stream
//! frames) and a [`WireParser`] (its strict protocol parser) — and [`call`] does the rest the
//! same way for all of them: deltas go to the sink as the parser emits them, the activity
//! context is heartbeated on every wire event, the usage so far is reported to the context
//! whenever it changes (so an attempt killed mid-stream still records what it consumed), and
//! cancellation stops the read between events. The idle timeout and secret scrubbing come from
//! [`http::stream_call`], the per-event cap from the decoder.

use crate::context::ActivityContext;
use crate::error::{Error, Result};
use crate::model::DeltaSink;
use crate::providers::http::{self, HttpSettings};
use bytes::Bytes;
use cairn_ledger::{ModelResponse, Usage};
use futures_util::stream::{self, BoxStream};
use futures_util::StreamExt;

/// An incremental decoder of a response body into wire events, each capped in size.
///
/// Pure: it is pushed the body's chunks and hands out complete events; errors are final (the
/// stream cannot be resynchronised after a corrupt or oversized event).
pub trait WireDecoder: Send + 'static {
    /// One decoded wire event.
    type Event: Send + 'static;

    /// A decoder for `provider`'s stream refusing events over `max_event_bytes`.
    fn with_cap(provider: &str, max_event_bytes: usize) -> Self;

    /// Decodes `chunk`, queueing the events it completes.
    fn push(&mut self, chunk: &[u8]) -> Result<()>;

    /// The next complete event, `None` until more bytes arrive.
    fn next_event(&mut self) -> Result<Option<Self::Event>>;

    /// The body ended: an error when the format cannot end where it did.
    fn finish(&mut self) -> Result<()>;
}

/// A provider's strict, pure stream parser, fed one wire event at a time.
pub trait WireParser: Send {
    /// The provider family's name (error messages, the decoder's errors).
    const PROVIDER: &'static str;

    /// How the response body is framed.
    type Decoder: WireDecoder;

    /// Feeds one wire event, emitting the deltas it carries to `deltas`.
    fn feed_event(
        &mut self,
        event: &<Self::Decoder as WireDecoder>::Event,
        deltas: &dyn DeltaSink,
    ) -> Result<()>;

    /// Whether the response is complete and nothing more needs reading. Formats whose usage
    /// arrives after the last content (Bedrock's `metadata`) keep the default and are read to
    /// the end of the body.
    fn is_done(&self) -> bool {
        false
    }

    /// The usage the stream has reported so far (cumulative), `None` before any.
    fn usage_so_far(&self) -> Option<Usage>;

    /// The canonical response, once the stream has ended.
    fn finish(self) -> Result<ModelResponse>;
}

/// POSTs `body` to `settings.base_url + path` and drives `parser` over the streamed response:
/// see the module documentation. Every error is scrubbed of the call's secrets.
pub async fn call<P: WireParser>(
    settings: &HttpSettings,
    path: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
    parser: P,
    deltas: &dyn DeltaSink,
    context: &ActivityContext,
) -> Result<ModelResponse> {
    let decoder = P::Decoder::with_cap(P::PROVIDER, settings.max_event_bytes);
    http::stream_call(
        settings,
        P::PROVIDER,
        path,
        headers,
        body,
        context,
        |bytes| drive(events(bytes, decoder), parser, deltas, context),
    )
    .await
}

/// Feeds `events` to `parser` until it is done or the events end, then finishes it.
pub async fn drive<P: WireParser>(
    mut events: BoxStream<'static, Result<<P::Decoder as WireDecoder>::Event>>,
    mut parser: P,
    deltas: &dyn DeltaSink,
    context: &ActivityContext,
) -> Result<ModelResponse> {
    let mut reported: Option<Usage> = None;
    while !parser.is_done() {
        let next = tokio::select! {
            next = events.next() => next,
            _ = context.cancelled() => {
                return Err(Error::Cancelled {
                    reason: format!("{}: cancelled while the response was streaming", P::PROVIDER),
                })
            }
        };
        let Some(event) = next else { break };
        let event = event?;
        // Every wire event is progress, including pings and events carrying no delta: a long
        // quiet stretch of them must not fail the attempt's heartbeat timeout.
        context.heartbeat(None);
        let fed = parser.feed_event(&event, deltas);
        // Reported before a feed error propagates: the usage so far outlives a stream that
        // breaks later, and the runtime records it with the failed attempt.
        let usage = parser.usage_so_far();
        if let Some(now) = usage.filter(|_| usage != reported) {
            context.report_usage(now);
            reported = usage;
        }
        fed?;
    }
    parser.finish()
}

/// The events `decoder` makes of `bytes`: byte-stream errors pass through, decoding errors and
/// a body ending where the format cannot end the stream with that error.
pub fn events<D: WireDecoder>(
    bytes: BoxStream<'static, Result<Bytes>>,
    decoder: D,
) -> BoxStream<'static, Result<D::Event>> {
    stream::unfold(Some((bytes, decoder)), |state| async move {
        let (mut bytes, mut decoder) = state?;
        loop {
            match decoder.next_event() {
                Ok(Some(event)) => return Some((Ok(event), Some((bytes, decoder)))),
                Ok(None) => {}
                Err(e) => return Some((Err(e), None)),
            }
            match bytes.next().await {
                Some(Ok(chunk)) => {
                    if let Err(e) = decoder.push(&chunk) {
                        return Some((Err(e), None));
                    }
                }
                Some(Err(e)) => return Some((Err(e), None)),
                None => return decoder.finish().err().map(|e| (Err(e), None)),
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::NoDeltas;
    use crate::providers::sse::{SseDecoder, SseEvent};
    use cairn_ledger::StopReason;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio_util::sync::CancellationToken;

    /// Each event's data is its output-token count so far; `stop` ends the response.
    #[derive(Default)]
    struct Counting {
        usage: Option<Usage>,
        done: bool,
        fed: usize,
    }

    impl WireParser for Counting {
        const PROVIDER: &'static str = "counting";
        type Decoder = SseDecoder;

        fn feed_event(&mut self, event: &SseEvent, _deltas: &dyn DeltaSink) -> Result<()> {
            self.fed += 1;
            match event.data.as_str() {
                "stop" => self.done = true,
                "bad" => {
                    return Err(Error::Provider {
                        kind: crate::error::ErrorKind::InvalidResponse,
                        message: "bad".into(),
                    })
                }
                n => {
                    self.usage = n.parse().ok().map(|output_tokens| Usage {
                        output_tokens,
                        ..Usage::default()
                    })
                }
            }
            Ok(())
        }

        fn is_done(&self) -> bool {
            self.done
        }

        fn usage_so_far(&self) -> Option<Usage> {
            self.usage
        }

        fn finish(self) -> Result<ModelResponse> {
            Ok(ModelResponse {
                provider: Self::PROVIDER.into(),
                model: format!("fed {}", self.fed),
                parts: Vec::new(),
                stop_reason_raw: String::new(),
                stop_reason: StopReason::EndTurn,
                usage: self.usage.unwrap_or_default(),
            })
        }
    }

    fn body(events: &[&str]) -> BoxStream<'static, Result<SseEvent>> {
        let text: String = events.iter().map(|d| format!("data: {d}\n\n")).collect();
        let bytes = stream::iter([Ok(Bytes::from(text))]).boxed();
        events_of(bytes)
    }

    fn events_of(bytes: BoxStream<'static, Result<Bytes>>) -> BoxStream<'static, Result<SseEvent>> {
        events(bytes, SseDecoder::with_cap("counting", 1024))
    }

    fn counting_context(cancel: CancellationToken) -> (ActivityContext, Arc<AtomicUsize>) {
        let beats = Arc::new(AtomicUsize::new(0));
        let counter = beats.clone();
        let context = ActivityContext::new(1, None, cancel, move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        (context, beats)
    }

    #[tokio::test]
    async fn heartbeats_per_event_reports_usage_and_stops_when_done() {
        let (context, beats) = counting_context(CancellationToken::new());
        let response = drive(
            body(&["x", "3", "7", "stop", "never read"]),
            Counting::default(),
            &NoDeltas,
            &context,
        )
        .await
        .unwrap();
        // Nothing after the end of the response is read.
        assert_eq!(response.model, "fed 4");
        assert_eq!(beats.load(Ordering::SeqCst), 4);
        assert_eq!(context.reported_usage().map(|u| u.output_tokens), Some(7));
    }

    #[tokio::test]
    async fn usage_is_reported_before_a_feed_error_and_cancellation_stops_the_read() {
        let (context, _) = counting_context(CancellationToken::new());
        let err = drive(
            body(&["5", "bad"]),
            Counting::default(),
            &NoDeltas,
            &context,
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::InvalidResponse);
        assert_eq!(context.reported_usage().map(|u| u.output_tokens), Some(5));

        let cancel = CancellationToken::new();
        let (context, _) = counting_context(cancel.clone());
        cancel.cancel();
        // A body that never ends: only cancellation can stop the read.
        let err = drive(
            events_of(stream::pending().boxed()),
            Counting::default(),
            &NoDeltas,
            &context,
        )
        .await
        .unwrap_err();
        assert!(matches!(err, Error::Cancelled { .. }), "{err:?}");
        assert!(err.to_string().contains("counting"), "{err}");
    }
}
