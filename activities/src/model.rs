//! The model-provider boundary: what a call is asked with, where its live deltas go, and the
//! trait every provider (scripted now, HTTP later) implements.

use crate::context::ActivityContext;
use crate::error::Result;
use async_trait::async_trait;
use cairn_ledger::{CallOptions, Delta, ModelResponse, ModelSpec, ToolSpec, Transcript};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Where a model call sits in its session, for logs, idempotency and deterministic providers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CallContext {
    /// The session the call belongs to.
    pub session_id: String,
    /// The user turn, counted from the session start.
    pub turn: u32,
    /// The model round within the turn (each round of tool results is one more).
    pub round: u32,
    /// The attempt number of this activity, 1-based; retries count up.
    pub attempt: u32,
}

/// Everything one model call needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRequest {
    /// Where the call sits in its session.
    pub context: CallContext,
    /// Which model to call, and its limits.
    pub model: ModelSpec,
    /// The conversation so far; the provider renders its request from it. Shared with the
    /// session's state rather than copied: a long session's transcript is megabytes, and a
    /// copy per call was most of a long session's turn.
    pub transcript: Arc<Transcript>,
    /// The tools the model may call; shared with the session's state rather than copied.
    pub tools: Arc<[ToolSpec]>,
    /// This call's options: tool choice, server tools, prompt caching.
    #[serde(default, skip_serializing_if = "CallOptions::is_default")]
    pub options: CallOptions,
}

/// Receives the fragments of a response while it streams.
///
/// Deltas are presentation only: the history records the final [`ModelResponse`] once, so a sink
/// may drop, buffer or forward them as it likes. `delta` is called from the provider's task and
/// should not block.
pub trait DeltaSink: Send + Sync {
    /// One fragment, in stream order.
    fn delta(&self, delta: Delta);
}

/// A sink that drops every delta, for callers that only want the final response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoDeltas;

impl DeltaSink for NoDeltas {
    fn delta(&self, _delta: Delta) {}
}

/// Any `Fn(Delta)` closure is a sink, e.g. one that forwards to a channel.
impl<F> DeltaSink for F
where
    F: Fn(Delta) + Send + Sync,
{
    fn delta(&self, delta: Delta) {
        self(delta)
    }
}

/// A model provider: turns a request into one canonical response, streaming deltas meanwhile.
///
/// Implementations classify failures through [`crate::Error::kind`] (rate limits, overload,
/// timeouts, bad requests, ...) so the runtime can retry without knowing the provider. A
/// returned response must pass [`cairn_ledger::validate_response`]; providers that receive a
/// response breaking it return [`crate::Error::InvalidResponse`]. The runtime may drop the
/// future to cancel or time out a call, so implementations must be cancel-safe.
#[async_trait]
pub trait ModelProvider: Send + Sync {
    /// The provider family's name, e.g. `scripted`; recorded as the response's provenance.
    fn provider(&self) -> &str;

    /// Runs one model call.
    async fn call(
        &self,
        request: &ModelRequest,
        deltas: &dyn DeltaSink,
        context: &ActivityContext,
    ) -> Result<ModelResponse>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn closures_are_sinks_and_no_deltas_drops() {
        let seen = Mutex::new(Vec::new());
        let sink = |d: Delta| seen.lock().unwrap().push(d);
        let as_dyn: &dyn DeltaSink = &sink;
        as_dyn.delta(Delta::Text("a".into()));
        as_dyn.delta(Delta::Thinking("b".into()));
        NoDeltas.delta(Delta::Text("dropped".into()));
        assert_eq!(
            *seen.lock().unwrap(),
            [Delta::Text("a".into()), Delta::Thinking("b".into())]
        );
    }
}
