//! The in-process client: start sessions, run turns, read histories and transcripts.
//! (A remote client over HTTP will offer the same operations.)

use crate::engine::{DeltaEvent, Engine};
use crate::error::Result;
use crate::event::{EventEnvelope, Limits, RetryPolicy, SessionStarted};
use crate::store::SessionInfo;
use crate::workflow::TurnOutcome;
use cairn_ledger::{ModelSpec, ToolSpec, Transcript};
use tokio::sync::broadcast;

/// How to start a session.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionOptions {
    /// A chosen id; generated when `None`.
    pub session_id: Option<String>,
    /// The default model.
    pub model: ModelSpec,
    /// Tools offered to the model.
    pub tools: Vec<ToolSpec>,
    /// A system prompt.
    pub system_prompt: Option<String>,
    /// Turn limits.
    pub limits: Limits,
    /// Model call retries.
    pub model_retry: RetryPolicy,
    /// Tool call retries.
    pub tool_retry: RetryPolicy,
}

impl SessionOptions {
    /// Options with default limits and retry policies.
    pub fn new(model: ModelSpec, tools: Vec<ToolSpec>) -> Self {
        SessionOptions {
            session_id: None,
            model,
            tools,
            system_prompt: None,
            limits: Limits::default(),
            model_retry: RetryPolicy::model_default(),
            tool_retry: RetryPolicy::tool_default(),
        }
    }
}

/// A client of an in-process engine; cheap to clone.
#[derive(Clone)]
pub struct Client {
    engine: Engine,
}

impl Client {
    /// A client of `engine`.
    pub fn new(engine: Engine) -> Self {
        Client { engine }
    }

    /// The engine behind this client.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Starts a session; returns its id.
    pub async fn start_session(&self, options: SessionOptions) -> Result<String> {
        let started = SessionStarted {
            model: options.model,
            tools: options.tools,
            system_prompt: options.system_prompt,
            limits: options.limits,
            model_retry: options.model_retry,
            tool_retry: options.tool_retry,
        };
        self.engine.start_session(options.session_id, started).await
    }

    /// Sends a message, starting a turn; returns the turn number without waiting.
    pub async fn send(&self, session_id: &str, text: &str) -> Result<u32> {
        self.engine.send_message(session_id, text, None).await
    }

    /// Sends a message with a model for this turn only.
    pub async fn send_with_model(
        &self,
        session_id: &str,
        text: &str,
        model: ModelSpec,
    ) -> Result<u32> {
        self.engine
            .send_message(session_id, text, Some(model))
            .await
    }

    /// Sends a message and waits for the turn's outcome (workers must be running).
    pub async fn run_turn(&self, session_id: &str, text: &str) -> Result<TurnOutcome> {
        let turn = self.send(session_id, text).await?;
        self.engine.wait_turn(session_id, turn).await
    }

    /// Waits for a turn's outcome.
    pub async fn wait_turn(&self, session_id: &str, turn: u32) -> Result<TurnOutcome> {
        self.engine.wait_turn(session_id, turn).await
    }

    /// Cancels a session.
    pub async fn cancel(&self, session_id: &str, reason: &str) -> Result<()> {
        self.engine.cancel(session_id, reason).await
    }

    /// Cancels the running turn only; the session takes further turns. Returns the turn.
    pub async fn cancel_turn(&self, session_id: &str, reason: &str) -> Result<u32> {
        self.engine.cancel_turn(session_id, reason).await
    }

    /// Every event of a session.
    pub async fn history(&self, session_id: &str) -> Result<Vec<EventEnvelope>> {
        self.engine.store().read_history(session_id, 1, None).await
    }

    /// The session's transcript, folded from its history.
    pub async fn transcript(&self, session_id: &str) -> Result<Transcript> {
        Ok(self.engine.state(session_id).await?.transcript)
    }

    /// Every session.
    pub async fn sessions(&self) -> Result<Vec<SessionInfo>> {
        self.engine.store().list_sessions().await
    }

    /// Live deltas of running model calls.
    pub fn subscribe_deltas(&self) -> broadcast::Receiver<DeltaEvent> {
        self.engine.subscribe_deltas()
    }
}
