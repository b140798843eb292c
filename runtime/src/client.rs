//! The client: start sessions, run turns, read histories and transcripts, follow a session's
//! events. One API over two transports: an in-process engine ([`Client::new`]) or a server
//! (a [`Transport`] over HTTP, from the `cairn-remote` crate), with the same types.

use crate::compaction::CompactionPolicy;
use crate::engine::{status_of, AppendedEvents, DeltaEvent, Engine, WatchGuard};
use crate::error::{Error, Result};
use crate::event::{EventEnvelope, Limits, Queues, RetryPolicy, SessionStarted};
use crate::follow::SessionEvents;
use crate::policy::ToolPolicy;
use crate::store::{SessionInfo, SessionStatus};
use crate::wire::{
    CompactionOutcome, PendingApproval, PendingTask, SendMessage, SessionDeleted,
    SessionDescription, SessionPage, SessionSummary, StreamEvent,
};
use crate::workflow::{ScheduledActivity, SessionState, TurnOutcome};
use async_trait::async_trait;
use cairn_ledger::{CallOptions, Media, ModelSpec, ToolChoice, ToolSpec, Transcript};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};

/// How to start a session.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionOptions {
    /// A chosen id; generated when `None`.
    pub session_id: Option<String>,
    /// The default model.
    pub model: ModelSpec,
    /// Tools offered to the model (shared by the sessions started with these options).
    pub tools: Arc<[ToolSpec]>,
    /// A system prompt.
    pub system_prompt: Option<String>,
    /// Turn limits.
    pub limits: Limits,
    /// Model call retries.
    pub model_retry: RetryPolicy,
    /// Tool call retries.
    pub tool_retry: RetryPolicy,
    /// The task queues of its model and tool calls.
    pub queues: Queues,
    /// Which tool calls run, are denied, or wait for a person; `None` allows every call.
    pub tool_policy: Option<ToolPolicy>,
    /// When and how the transcript is compacted; `None` never compacts on its own.
    pub compaction: Option<CompactionPolicy>,
    /// The absolute directory its tools work in (see [`SessionStarted::workdir`]); `None`:
    /// the worker's own.
    pub workdir: Option<String>,
    /// The options of its model calls: tool choice, server tools, prompt caching.
    pub call_options: CallOptions,
}

impl SessionOptions {
    /// Options with default limits, retry policies and queues.
    pub fn new(model: ModelSpec, tools: impl Into<Arc<[ToolSpec]>>) -> Self {
        SessionOptions {
            session_id: None,
            model,
            tools: tools.into(),
            system_prompt: None,
            limits: Limits::default(),
            model_retry: RetryPolicy::model_default(),
            tool_retry: RetryPolicy::tool_default(),
            queues: Queues::default(),
            tool_policy: None,
            compaction: None,
            workdir: None,
            call_options: CallOptions::default(),
        }
    }

    /// The `session_started` event these options record.
    pub fn started(&self) -> SessionStarted {
        SessionStarted {
            model: self.model.clone(),
            tools: self.tools.clone(),
            system_prompt: self.system_prompt.clone(),
            limits: self.limits.clone(),
            model_retry: self.model_retry.clone(),
            tool_retry: self.tool_retry.clone(),
            queues: self.queues.clone(),
            forked_from: None,
            workflow_version: crate::workflow::WORKFLOW_VERSION,
            tool_policy: self.tool_policy.clone(),
            compaction: self.compaction.clone(),
            workdir: self.workdir.clone(),
            call_options: self.call_options.clone(),
        }
    }
}

/// Which sessions to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionQuery {
    /// Only sessions with this status.
    pub status: Option<SessionStatus>,
    /// Only sessions whose id sorts after this one (paging).
    pub after: Option<String>,
    /// At most this many (the server caps it).
    pub limit: Option<usize>,
}

/// A session's live events: history events exactly once, in order, and model deltas.
pub struct EventStream {
    receiver: mpsc::Receiver<Result<StreamEvent>>,
}

impl EventStream {
    /// A stream fed by `receiver` (for transports).
    pub fn new(receiver: mpsc::Receiver<Result<StreamEvent>>) -> Self {
        EventStream { receiver }
    }

    /// The next event; `None` when the stream ended.
    pub async fn next(&mut self) -> Option<Result<StreamEvent>> {
        self.receiver.recv().await
    }
}

/// What a client does, whatever carries it: an engine in this process, or a server.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Starts a session; returns its id.
    async fn start_session(&self, options: SessionOptions) -> Result<String>;
    /// Starts a session and sends its first message; returns its id and the turn's number.
    /// By default [`Transport::start_session`] then [`Transport::send`]; a transport that can
    /// record both at once does, in one durable commit.
    async fn start_session_and_send(
        &self,
        options: SessionOptions,
        text: &str,
    ) -> Result<(String, u32)> {
        let session_id = self.start_session(options).await?;
        let turn = self.send(&session_id, text, None, Vec::new(), None).await?;
        Ok((session_id, turn))
    }
    /// Sends a message with its images and documents (ahead of the text) and, for this turn
    /// only, a model and a tool choice instead of the session's; returns the turn's number.
    async fn send(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
        tool_choice: Option<ToolChoice>,
    ) -> Result<u32>;
    /// Sends a message under an idempotency key; returns the turn's number. Sent again under
    /// the same key, the same message starts no second turn and gets the first one's number;
    /// another message under a used key is refused ([`Error::IdempotencyKeyReused`], which
    /// the remote client makes of a server's 422 `idempotency_key_reused`).
    async fn send_idempotent(
        &self,
        session_id: &str,
        key: &str,
        message: SendMessage,
    ) -> Result<u32>;
    /// Sends a message and waits up to `timeout` (`None`: as long as it takes) for the turn it
    /// starts; returns the turn's number and, when it ended in time, its outcome. By default
    /// [`Transport::send`] then [`Transport::wait_turn`]; a transport that can ask for both at
    /// once does (one request to a server).
    async fn send_and_wait(
        &self,
        session_id: &str,
        text: &str,
        timeout: Option<Duration>,
    ) -> Result<(u32, Option<TurnOutcome>)> {
        let turn = self.send(session_id, text, None, Vec::new(), None).await?;
        let outcome = self.wait_turn(session_id, turn, timeout).await?;
        Ok((turn, outcome))
    }
    /// Starts a session with its first message and waits up to `timeout` for that turn;
    /// returns the session's id, the turn's number and, when it ended in time, its outcome.
    /// By default [`Transport::start_session_and_send`] then [`Transport::wait_turn`].
    async fn start_session_send_and_wait(
        &self,
        options: SessionOptions,
        text: &str,
        timeout: Option<Duration>,
    ) -> Result<(String, u32, Option<TurnOutcome>)> {
        let (session_id, turn) = self.start_session_and_send(options, text).await?;
        let outcome = self.wait_turn(&session_id, turn, timeout).await?;
        Ok((session_id, turn, outcome))
    }
    /// Waits up to `timeout` (`None`: as long as it takes) for turn `turn`'s outcome.
    async fn wait_turn(
        &self,
        session_id: &str,
        turn: u32,
        timeout: Option<Duration>,
    ) -> Result<Option<TurnOutcome>>;
    /// Cancels the session.
    async fn cancel(&self, session_id: &str, reason: &str) -> Result<()>;
    /// Cancels the running turn only; returns its number.
    async fn cancel_turn(&self, session_id: &str, reason: &str) -> Result<u32>;
    /// Deletes a finished session ([`Client::delete_session`]).
    async fn delete_session(&self, session_id: &str) -> Result<SessionDeleted>;
    /// Compacts the transcript now, between turns.
    async fn compact(&self, session_id: &str) -> Result<CompactionOutcome>;
    /// Approves a tool call parked for approval: it runs.
    async fn approve(&self, session_id: &str, tool_use_id: &str) -> Result<()>;
    /// Denies a tool call parked for approval: the model gets an error result with `reason`.
    async fn deny(&self, session_id: &str, tool_use_id: &str, reason: &str) -> Result<()>;
    /// Events from `from_seq` on, at most `limit`.
    async fn history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>>;
    /// The transcript, folded from the history.
    async fn transcript(&self, session_id: &str) -> Result<Transcript>;
    /// Status, turns, usage and pending tasks.
    async fn describe(&self, session_id: &str) -> Result<SessionDescription>;
    /// One page of sessions.
    async fn sessions(&self, query: &SessionQuery) -> Result<SessionPage>;
    /// Follows a session: events after `after_seq`, then live ones, and model deltas.
    async fn subscribe(&self, session_id: &str, after_seq: u64) -> Result<EventStream>;
}

/// How long a turn waits with nothing started before [`Client::wait_turn`] logs a warning
/// naming the tasks no worker took (by default).
pub const STALL_WARNING: Duration = Duration::from_secs(5);

/// A client; cheap to clone.
#[derive(Clone)]
pub struct Client {
    transport: Arc<dyn Transport>,
    engine: Option<Engine>,
    /// [`Client::wait_turn`] gives up after this long (`None`: never).
    turn_deadline: Option<Duration>,
    /// [`Client::wait_turn`] warns once after this long without an outcome when tasks of the
    /// session are waiting for a worker.
    stall_warning: Duration,
}

impl Client {
    /// A client of an engine in this process.
    pub fn new(engine: Engine) -> Self {
        Client {
            transport: Arc::new(Local {
                engine: engine.clone(),
            }),
            engine: Some(engine),
            turn_deadline: None,
            stall_warning: STALL_WARNING,
        }
    }

    /// A client over another transport (a server).
    pub fn with_transport(transport: Arc<dyn Transport>) -> Self {
        Client {
            transport,
            engine: None,
            turn_deadline: None,
            stall_warning: STALL_WARNING,
        }
    }

    /// This client, with [`Client::run_turn`] and [`Client::wait_turn`] failing with
    /// [`Error::TurnDeadline`] when the turn has not ended after `deadline` (the turn itself
    /// goes on). Without it they wait as long as the turn takes.
    pub fn with_turn_deadline(mut self, deadline: Duration) -> Self {
        self.turn_deadline = Some(deadline);
        self
    }

    /// This client, warning (a `tracing` warning) after `after` instead of [`STALL_WARNING`]
    /// when a turn it waits for has tasks that no worker took.
    pub fn with_stall_warning(mut self, after: Duration) -> Self {
        self.stall_warning = after;
        self
    }

    /// The engine behind an in-process client; `None` for a remote one.
    pub fn engine(&self) -> Option<&Engine> {
        self.engine.as_ref()
    }

    /// Starts a session; returns its id.
    pub async fn start_session(&self, options: SessionOptions) -> Result<String> {
        self.transport.start_session(options).await
    }

    /// Starts a session with its first message, starting turn 1, without waiting for it;
    /// returns the session's id and the turn's number. The start and the message are one
    /// durable commit, in process and through a server (one request there).
    pub async fn start_session_and_send(
        &self,
        options: SessionOptions,
        text: &str,
    ) -> Result<(String, u32)> {
        self.transport.start_session_and_send(options, text).await
    }

    /// Sends a message, starting a turn; returns the turn number without waiting.
    pub async fn send(&self, session_id: &str, text: &str) -> Result<u32> {
        self.transport
            .send(session_id, text, None, Vec::new(), None)
            .await
    }

    /// Sends a message with images and documents, starting a turn; returns the turn number
    /// without waiting. The media go ahead of the text; `text` may be empty when `media` is
    /// not. Bad media (an unsupported media type, bad base64, a URL that is not http(s)) are
    /// refused before anything is recorded.
    pub async fn send_with_media(
        &self,
        session_id: &str,
        text: &str,
        media: Vec<Media>,
    ) -> Result<u32> {
        self.transport
            .send(session_id, text, None, media, None)
            .await
    }

    /// Sends a message with everything it may carry: images and documents (ahead of the text),
    /// and a model for this turn only. Returns the turn number without waiting.
    pub async fn send_message(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
    ) -> Result<u32> {
        self.transport
            .send(session_id, text, model, media, None)
            .await
    }

    /// Sends a message with a model for this turn only.
    pub async fn send_with_model(
        &self,
        session_id: &str,
        text: &str,
        model: ModelSpec,
    ) -> Result<u32> {
        self.transport
            .send(session_id, text, Some(model), Vec::new(), None)
            .await
    }

    /// Sends a message with a tool choice for this turn only (and a model, when given),
    /// instead of the session's.
    pub async fn send_with_tool_choice(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
        tool_choice: ToolChoice,
    ) -> Result<u32> {
        self.transport
            .send(session_id, text, model, Vec::new(), Some(tool_choice))
            .await
    }

    /// Sends a message with everything a turn may carry: images and documents (ahead of the
    /// text), and for this turn only a model and a tool choice instead of the session's.
    /// Returns the turn number without waiting.
    pub async fn send_turn(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
        tool_choice: Option<ToolChoice>,
    ) -> Result<u32> {
        self.transport
            .send(session_id, text, model, media, tool_choice)
            .await
    }

    /// Sends a message under an idempotency key of the caller's (a UUID, say), starting a
    /// turn; returns the turn number without waiting. A process that cannot tell whether a
    /// send landed (it crashed, or lost the answer) sends again under the same key: the
    /// same message starts no second turn and gets the first one's number, while another
    /// message under a used key is refused ([`Error::IdempotencyKeyReused`], through a server
    /// too: its 422 `idempotency_key_reused`). Keys are 1-255 visible ASCII characters,
    /// remembered for the session's life. (The remote client already sends every message
    /// under a key of its own, and again while the server is unreachable.)
    pub async fn send_idempotent(
        &self,
        session_id: &str,
        key: &str,
        message: SendMessage,
    ) -> Result<u32> {
        self.transport
            .send_idempotent(session_id, key, message)
            .await
    }

    /// Sends a message and waits for the turn's outcome (workers must be running: see
    /// [`Client::wait_turn`] for what happens when none takes the turn's tasks). Through a
    /// server the message and the wait go in one request.
    #[allow(clippy::disallowed_methods)] // a client waits on real time; not pure code
    pub async fn run_turn(&self, session_id: &str, text: &str) -> Result<TurnOutcome> {
        let started = tokio::time::Instant::now();
        let (turn, outcome) = self
            .transport
            .send_and_wait(session_id, text, self.first_wait())
            .await?;
        match outcome {
            Some(outcome) => Ok(outcome),
            None => self.wait_turn_since(session_id, turn, started).await,
        }
    }

    /// Starts a session with its first message and waits for that turn's outcome; returns
    /// the session's id and the outcome. The start and the message are one durable commit,
    /// and through a server the start, the message and the wait are one request.
    #[allow(clippy::disallowed_methods)] // a client waits on real time; not pure code
    pub async fn start_session_and_run(
        &self,
        options: SessionOptions,
        text: &str,
    ) -> Result<(String, TurnOutcome)> {
        let started = tokio::time::Instant::now();
        let (session_id, turn, outcome) = self
            .transport
            .start_session_send_and_wait(options, text, self.first_wait())
            .await?;
        let outcome = match outcome {
            Some(outcome) => outcome,
            None => self.wait_turn_since(&session_id, turn, started).await?,
        };
        Ok((session_id, outcome))
    }

    /// How long the first wait for a turn may take before [`Client::wait_turn`] has to look
    /// at it: until the stall warning or the deadline, whichever comes first.
    fn first_wait(&self) -> Option<Duration> {
        let mut slice = self.stall_warning;
        if let Some(deadline) = self.turn_deadline {
            slice = slice.min(deadline);
        }
        Some(slice)
    }

    /// Waits for a turn's outcome.
    ///
    /// A turn whose tasks no worker takes (no pool started, or none serving their queue or
    /// hosting their tool or provider) would wait forever: after the stall warning's delay
    /// ([`STALL_WARNING`] by default) this logs a warning naming those tasks, and with a
    /// deadline ([`Client::with_turn_deadline`]) it fails with [`Error::TurnDeadline`].
    #[allow(clippy::disallowed_methods)] // a client waits on real time; not pure code
    pub async fn wait_turn(&self, session_id: &str, turn: u32) -> Result<TurnOutcome> {
        self.wait_turn_since(session_id, turn, tokio::time::Instant::now())
            .await
    }

    /// [`Client::wait_turn`], its stall warning and deadline counted from `started`.
    #[allow(clippy::disallowed_methods)] // a client waits on real time; not pure code
    async fn wait_turn_since(
        &self,
        session_id: &str,
        turn: u32,
        started: tokio::time::Instant,
    ) -> Result<TurnOutcome> {
        let mut warned = false;
        loop {
            let waited = started.elapsed();
            let mut slice = if warned {
                Duration::MAX
            } else {
                self.stall_warning.saturating_sub(waited)
            };
            if let Some(deadline) = self.turn_deadline {
                slice = slice.min(deadline.saturating_sub(waited));
            }
            let timeout = (slice != Duration::MAX).then_some(slice);
            if let Some(outcome) = self.transport.wait_turn(session_id, turn, timeout).await? {
                return Ok(outcome);
            }
            // A transport may return before the timeout (a server's long poll is capped).
            let waited = started.elapsed();
            if !warned && waited >= self.stall_warning {
                warned = true;
                // Through a server, which does not show leases, a long model or tool call
                // would look the same as a task nobody takes: only the deadline applies there.
                let stalled = match self.engine {
                    Some(_) => self.stalled_tasks(session_id).await,
                    None => None,
                };
                if let Some(stalled) = stalled {
                    tracing::warn!(
                        session = session_id,
                        turn,
                        waited_ms = waited.as_millis() as u64,
                        "turn {turn} of session {session_id:?} is waiting for a worker: {stalled}"
                    );
                }
            }
            if let Some(deadline) = self.turn_deadline {
                if waited >= deadline {
                    let pending = match self.stalled_tasks(session_id).await {
                        Some(stalled) => stalled,
                        None => "its tasks were running".to_owned(),
                    };
                    return Err(Error::TurnDeadline {
                        session_id: session_id.to_owned(),
                        turn,
                        deadline_ms: deadline.as_millis() as u64,
                        pending,
                    });
                }
            }
        }
    }

    /// The session's tasks that no worker holds although they are due, described with their
    /// queue and what a worker must host to take them; `None` when there are none. Through a
    /// server, which does not show leases, every pending task is named.
    async fn stalled_tasks(&self, session_id: &str) -> Option<String> {
        let described: Vec<String> = match &self.engine {
            Some(engine) => {
                let now_ms = wall_clock_ms();
                let tasks = engine.store().list_tasks().await.ok()?;
                tasks
                    .iter()
                    .filter(|t| t.id.session_id == session_id)
                    .filter(|t| !t.held && t.visible_at_ms <= now_ms)
                    .map(|t| {
                        let needs = if t.target.is_empty() {
                            "any worker".to_owned()
                        } else {
                            format!("a worker hosting {:?}", t.target)
                        };
                        format!(
                            "task {} on queue {:?} (needs {needs}) has not been taken",
                            t.id, t.queue
                        )
                    })
                    .collect()
            }
            None => self
                .transport
                .describe(session_id)
                .await
                .ok()?
                .pending_tasks
                .iter()
                .map(|t| {
                    format!(
                        "{} (attempt {}) is pending, running or not",
                        t.activity, t.attempt
                    )
                })
                .collect(),
        };
        if described.is_empty() {
            return None;
        }
        Some(format!(
            "{}; is a worker pool running that serves its queue and hosts what it needs?",
            described.join(", ")
        ))
    }

    /// Waits up to `timeout` for a turn's outcome; `None` when it has not ended by then.
    pub async fn wait_turn_for(
        &self,
        session_id: &str,
        turn: u32,
        timeout: Duration,
    ) -> Result<Option<TurnOutcome>> {
        self.transport
            .wait_turn(session_id, turn, Some(timeout))
            .await
    }

    /// Cancels a session.
    pub async fn cancel(&self, session_id: &str, reason: &str) -> Result<()> {
        self.transport.cancel(session_id, reason).await
    }

    /// Cancels the running turn only; the session takes further turns. Returns the turn.
    pub async fn cancel_turn(&self, session_id: &str, reason: &str) -> Result<u32> {
        self.transport.cancel_turn(session_id, reason).await
    }

    /// Deletes a finished session: its history, record and tasks go, atomically and durably,
    /// like `temporal workflow delete`. Refused with `SessionBusy` while a turn runs or a
    /// task of it is queued (cancel it first); `UnknownSession` when there is none. The id is
    /// never used again: starting a session with it fails with `SessionDeleted`.
    pub async fn delete_session(&self, session_id: &str) -> Result<SessionDeleted> {
        self.transport.delete_session(session_id).await
    }

    /// Compacts the session's transcript now, between turns, with its compaction policy (or
    /// the default one): recorded as `compaction_requested`, then `transcript_compacted`
    /// unless no strategy shrinks it. Refused (`InvalidEvent`) while a turn runs.
    pub async fn compact(&self, session_id: &str) -> Result<CompactionOutcome> {
        self.transport.compact(session_id).await
    }

    /// Approves a tool call the session's policy parked; it is scheduled at once. Refused
    /// (`InvalidEvent`) unless the call waits for approval in the running turn.
    pub async fn approve(&self, session_id: &str, tool_use_id: &str) -> Result<()> {
        self.transport.approve(session_id, tool_use_id).await
    }

    /// Denies a tool call the session's policy parked: the model gets an `is_error` result
    /// carrying `reason`. Refused like [`Client::approve`].
    pub async fn deny(&self, session_id: &str, tool_use_id: &str, reason: &str) -> Result<()> {
        self.transport.deny(session_id, tool_use_id, reason).await
    }

    /// Every event of a session.
    pub async fn history(&self, session_id: &str) -> Result<Vec<EventEnvelope>> {
        self.history_from(session_id, 1, None).await
    }

    /// Events of a session from `from_seq` on, at most `limit`.
    pub async fn history_from(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        self.transport.history(session_id, from_seq, limit).await
    }

    /// The session's transcript, folded from its history.
    pub async fn transcript(&self, session_id: &str) -> Result<Transcript> {
        self.transport.transcript(session_id).await
    }

    /// Status, turns, usage and pending tasks of a session.
    pub async fn describe(&self, session_id: &str) -> Result<SessionDescription> {
        self.transport.describe(session_id).await
    }

    /// Every session (all pages).
    pub async fn sessions(&self) -> Result<Vec<SessionSummary>> {
        let mut query = SessionQuery::default();
        let mut all = Vec::new();
        loop {
            let page = self.transport.sessions(&query).await?;
            all.extend(page.sessions);
            match page.next_after {
                Some(after) => query.after = Some(after),
                None => return Ok(all),
            }
        }
    }

    /// One page of sessions.
    pub async fn list_sessions(&self, query: &SessionQuery) -> Result<SessionPage> {
        self.transport.sessions(query).await
    }

    /// Follows a session: its events after `after_seq` (0: all), each exactly once, then
    /// live ones as they are appended, with model deltas in between.
    pub async fn subscribe(&self, session_id: &str, after_seq: u64) -> Result<EventStream> {
        self.transport.subscribe(session_id, after_seq).await
    }

    /// Follows a session from its start as typed [`SessionEvent`](crate::SessionEvent)s:
    /// every history event exactly once, in order, even when the caller reads slowly (see
    /// [`crate::follow`]), then live ones as they are appended, with model deltas in between
    /// (deltas may be dropped when the caller falls behind).
    pub async fn follow(&self, session_id: &str) -> Result<SessionEvents> {
        Ok(SessionEvents::new(
            self.subscribe(session_id, 0).await?,
            &[],
        ))
    }

    /// Follows a session's events after `after_seq`, as [`Client::follow`]. The events up
    /// to `after_seq` are read once, for what later ones refer to (tool names, answers).
    pub async fn follow_after(&self, session_id: &str, after_seq: u64) -> Result<SessionEvents> {
        let seen = if after_seq == 0 {
            Vec::new()
        } else {
            self.history_from(session_id, 1, Some(after_seq as usize))
                .await?
        };
        let stream = self.subscribe(session_id, after_seq).await?;
        Ok(SessionEvents::new(stream, &seen))
    }

    /// Live deltas of every running model call (in-process clients only).
    pub fn subscribe_deltas(&self) -> Option<broadcast::Receiver<DeltaEvent>> {
        self.engine.as_ref().map(Engine::subscribe_deltas)
    }
}

/// Milliseconds since the Unix epoch, as task times are recorded (0 before the epoch).
#[allow(clippy::disallowed_methods)] // a client's warning, not pure code
fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Describes a session from its folded state and its event count.
pub fn describe_state(state: &SessionState, status: SessionStatus) -> SessionDescription {
    let pending_tasks = state
        .outstanding_tasks()
        .into_iter()
        .filter_map(|seq| {
            let (activity, attempt) = match state.scheduled_activity(seq)? {
                ScheduledActivity::Model { round, attempt, .. } => {
                    (format!("model:{round}"), attempt)
                }
                ScheduledActivity::Summary { round, attempt, .. } => {
                    (format!("summary:{round}"), attempt)
                }
                ScheduledActivity::Tool {
                    tool_use, attempt, ..
                } => (format!("tool:{}", tool_use.id), attempt),
            };
            Some(PendingTask {
                scheduled_seq: seq,
                activity,
                attempt,
            })
        })
        .collect();
    let pending_approvals = state
        .pending_approvals()
        .into_iter()
        .map(|p| PendingApproval {
            turn: p.turn,
            tool_use_id: p.tool_use.id,
            name: p.tool_use.name,
            arguments: p.tool_use.arguments,
            deadline_ms: p.deadline_ms,
        })
        .collect();
    SessionDescription {
        pending_approvals,
        session_id: state.session_id.clone(),
        status,
        events: state.next_seq.saturating_sub(1),
        turns: state.turns_started,
        running_turn: state.active.as_ref().map(|a| a.turn),
        last_outcome: state.last_outcome.clone(),
        usage: state.usage,
        totals: state.totals,
        running_turn_totals: state.active.as_ref().map(|a| a.totals),
        pending_tasks,
        model: state.started.as_ref().map(|s| s.model.clone()),
    }
}

/// Fills in each listed session's totals and the calls it awaits approval for, from its
/// folded state (cached by the engine; `stored_id` gives the id it is stored under). One
/// session must not fail the listing: one deleted since the store listed it leaves the page,
/// and one whose state cannot be read (its history does not fold) is listed without them,
/// with a warning.
pub async fn fill_in_summaries(
    engine: &Engine,
    page: &mut SessionPage,
    stored_id: impl Fn(&str) -> String,
) {
    let mut filled = Vec::with_capacity(page.sessions.len());
    for mut summary in std::mem::take(&mut page.sessions) {
        match engine.state(&stored_id(&summary.session_id)).await {
            Ok(state) => {
                if summary.status == SessionStatus::Running {
                    summary.awaiting_approval = state
                        .pending_approvals()
                        .into_iter()
                        .map(|p| p.tool_use.id)
                        .collect();
                }
                summary.totals = Some(state.totals);
            }
            Err(Error::UnknownSession { .. } | Error::SessionDeleted { .. }) => continue,
            Err(e) => {
                tracing::warn!(session_id = %summary.session_id, error = %e, "a listed session's state cannot be read; listed without its totals");
            }
        }
        filled.push(summary);
    }
    page.sessions = filled;
}

/// One page of a store's listing (ordered by stored id): the sessions `shown` gives an id to
/// (the id the caller sees, e.g. without a namespace prefix; `None` hides the session), whose
/// shown id sorts after `after`, with `status` when given, at most `limit` (at least 1).
/// `shown` must keep the order, as stripping one namespace's common prefix does.
pub fn page_sessions(
    sessions: Vec<SessionInfo>,
    shown: impl Fn(&str) -> Option<&str>,
    after: Option<&str>,
    status: Option<SessionStatus>,
    limit: usize,
) -> SessionPage {
    let limit = limit.max(1);
    let mut page: Vec<SessionSummary> = sessions
        .iter()
        .filter_map(|s| shown(&s.session_id).map(|id| (id, s)))
        .filter(|(id, _)| after.is_none_or(|after| *id > after))
        .filter(|(_, s)| status.is_none_or(|status| s.status == status))
        .take(limit.saturating_add(1))
        .map(|(id, s)| SessionSummary {
            session_id: id.to_owned(),
            status: s.status,
            events: s.events,
            updated_at_ms: s.updated_at_ms,
            awaiting_approval: Vec::new(),
            totals: None,
        })
        .collect();
    let next_after = if page.len() > limit {
        page.truncate(limit);
        page.last().map(|s| s.session_id.clone())
    } else {
        None
    };
    SessionPage {
        sessions: page,
        next_after,
    }
}

/// The in-process transport: calls the engine.
struct Local {
    engine: Engine,
}

#[async_trait]
impl Transport for Local {
    async fn start_session(&self, options: SessionOptions) -> Result<String> {
        let started = options.started();
        self.engine.start_session(options.session_id, started).await
    }

    async fn start_session_and_send(
        &self,
        options: SessionOptions,
        text: &str,
    ) -> Result<(String, u32)> {
        let started = options.started();
        self.engine
            .start_session_and_send(options.session_id, started, text)
            .await
    }

    async fn send(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
        tool_choice: Option<ToolChoice>,
    ) -> Result<u32> {
        self.engine
            .send_turn(session_id, text, model, media, tool_choice)
            .await
    }

    async fn send_idempotent(
        &self,
        session_id: &str,
        key: &str,
        message: SendMessage,
    ) -> Result<u32> {
        self.engine.send_idempotent(session_id, key, &message).await
    }

    async fn wait_turn(
        &self,
        session_id: &str,
        turn: u32,
        timeout: Option<Duration>,
    ) -> Result<Option<TurnOutcome>> {
        let wait = self.engine.wait_turn(session_id, turn);
        match timeout {
            None => wait.await.map(Some),
            Some(limit) => match tokio::time::timeout(limit, wait).await {
                Ok(outcome) => outcome.map(Some),
                Err(_) => Ok(None),
            },
        }
    }

    async fn cancel(&self, session_id: &str, reason: &str) -> Result<()> {
        self.engine.cancel(session_id, reason).await
    }

    async fn cancel_turn(&self, session_id: &str, reason: &str) -> Result<u32> {
        self.engine.cancel_turn(session_id, reason).await
    }

    async fn delete_session(&self, session_id: &str) -> Result<SessionDeleted> {
        let info = self.engine.delete_session(session_id).await?;
        Ok(SessionDeleted {
            session_id: info.session_id,
            events: info.events,
        })
    }

    async fn approve(&self, session_id: &str, tool_use_id: &str) -> Result<()> {
        self.engine.approve(session_id, tool_use_id).await
    }

    async fn compact(&self, session_id: &str) -> Result<CompactionOutcome> {
        self.engine.compact(session_id).await
    }

    async fn deny(&self, session_id: &str, tool_use_id: &str, reason: &str) -> Result<()> {
        self.engine.deny(session_id, tool_use_id, reason).await
    }

    async fn history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        self.engine
            .store()
            .read_history(session_id, from_seq, limit)
            .await
    }

    async fn transcript(&self, session_id: &str) -> Result<Transcript> {
        Ok(Arc::unwrap_or_clone(
            self.engine.state(session_id).await?.transcript,
        ))
    }

    async fn describe(&self, session_id: &str) -> Result<SessionDescription> {
        let state = self.engine.state(session_id).await?;
        Ok(describe_state(&state, status_of(&state)))
    }

    async fn sessions(&self, query: &SessionQuery) -> Result<SessionPage> {
        let mut page = page_sessions(
            self.engine.store().list_sessions().await?,
            |id: &str| Some(id),
            query.after.as_deref(),
            query.status,
            query.limit.unwrap_or(usize::MAX),
        );
        fill_in_summaries(&self.engine, &mut page, str::to_owned).await;
        Ok(page)
    }

    async fn subscribe(&self, session_id: &str, after_seq: u64) -> Result<EventStream> {
        let (sender, receiver) = mpsc::channel(1024);
        let follower = follow(self.engine.clone(), session_id.to_owned(), after_seq);
        tokio::spawn(follower.run(sender));
        Ok(EventStream::new(receiver))
    }
}

/// Follows one session of an engine: subscribes first, reads the history after the last
/// seq sent, then forwards live events it has not sent (and deltas). A lagging subscription
/// reads the store again, so no event is lost or repeated.
pub struct Follower {
    engine: Engine,
    session_id: String,
    last_seq: u64,
    events: broadcast::Receiver<Arc<AppendedEvents>>,
    deltas: broadcast::Receiver<DeltaEvent>,
    /// Sessions the engine deletes: the followed one's deletion ends the follower.
    deletions: broadcast::Receiver<String>,
    /// The model calls (turn, `model:ROUND`, attempt) whose scheduling event was sent.
    scheduled: std::collections::HashSet<(u32, String, u32)>,
    /// Appends taken early that come after a waiting delta: sent once no delta waits.
    held: std::collections::VecDeque<Arc<AppendedEvents>>,
    /// Appends by other writers of the store reach `events` while the session is watched.
    _watch: WatchGuard,
}

/// The model call (turn, `model:ROUND`, attempt) an event schedules, if it schedules one.
fn schedules(event: &crate::event::Event) -> Option<(u32, String, u32)> {
    match event {
        crate::event::Event::ModelCallScheduled {
            turn,
            round,
            attempt,
            ..
        } => Some((*turn, format!("model:{round}"), *attempt)),
        _ => None,
    }
}

/// A follower of `session_id` from after `after_seq`; subscribed from this moment.
pub fn follow(engine: Engine, session_id: String, after_seq: u64) -> Follower {
    Follower {
        _watch: engine.watch(&session_id),
        events: engine.subscribe_events(),
        deltas: engine.subscribe_deltas(),
        deletions: engine.subscribe_deletions(),
        scheduled: Default::default(),
        held: Default::default(),
        engine,
        session_id,
        last_seq: after_seq,
    }
}

impl Follower {
    /// The next message: a history event not sent yet, or a delta. `None` when the engine
    /// is gone.
    pub async fn next(
        &mut self,
        backlog: &mut std::collections::VecDeque<StreamEvent>,
    ) -> Option<Result<()>> {
        if !self.held.is_empty() {
            // Held appends came after a delta: the deltas waiting now go first.
            match self.deltas.try_recv() {
                Ok(delta) => {
                    if delta.origin.session_id == self.session_id {
                        backlog.push_back(StreamEvent::Delta(delta));
                    }
                    return Some(Ok(()));
                }
                Err(broadcast::error::TryRecvError::Lagged(_)) => return Some(Ok(())),
                Err(_) => {
                    let appended = self.held.pop_front()?;
                    return Some(self.take(appended, backlog).await);
                }
            }
        }
        loop {
            tokio::select! {
                // Deltas first: a worker publishes an answer's deltas before it reports the
                // answer, so when both are waiting the deltas are older, and a follower that
                // stops at the turn's end has printed all of its text.
                biased;
                received = self.deltas.recv() => match received {
                    Ok(delta) => {
                        if delta.origin.session_id == self.session_id {
                            if let Err(e) = self.take_events_before(&delta, backlog).await {
                                return Some(Err(e));
                            }
                            backlog.push_back(StreamEvent::Delta(delta));
                            return Some(Ok(()));
                        }
                    }
                    // Deltas are presentation only: a lagging reader skips some.
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
                received = self.events.recv() => match received {
                    Ok(appended) => {
                        if appended.session_id != self.session_id {
                            continue;
                        }
                        return Some(self.take(appended, backlog).await);
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        return Some(self.catch_up(backlog).await);
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
                received = self.deletions.recv() => match received {
                    Ok(deleted) if deleted == self.session_id => {
                        return Some(Err(Error::SessionDeleted {
                            session_id: deleted,
                        }));
                    }
                    Ok(_) => {}
                    // Missed some: whether this session was among them, its history says (a
                    // passing failure to read it says nothing).
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        match self.engine.store().read_history(&self.session_id, 1, Some(1)).await {
                            Err(Error::UnknownSession { .. }) => {
                                return Some(Err(Error::SessionDeleted {
                                    session_id: self.session_id.clone(),
                                }));
                            }
                            Err(e) if !e.is_retryable() => return Some(Err(e)),
                            _ => {}
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
            }
        }
    }

    /// Before a model call's first delta, the events that scheduled the call: a worker that
    /// reported the task before it may be handed the call with its report (eager dispatch)
    /// and stream before this follower took those events from the other channel. Takes the
    /// appends waiting there: when one schedules the call, they go first; otherwise they are
    /// later than the delta and are held, to go once no delta waits (as before: deltas
    /// first).
    async fn take_events_before(
        &mut self,
        delta: &DeltaEvent,
        backlog: &mut std::collections::VecDeque<StreamEvent>,
    ) -> Result<()> {
        let origin = &delta.origin;
        if !origin.activity.starts_with("model:") {
            return Ok(());
        }
        let call = (origin.turn, origin.activity.clone(), origin.attempt);
        if self.scheduled.contains(&call) {
            return Ok(());
        }
        let mut waiting = Vec::new();
        let mut found = false;
        while !found {
            match self.events.try_recv() {
                Ok(appended) if appended.session_id != self.session_id => {}
                Ok(appended) => {
                    found = appended
                        .events
                        .iter()
                        .any(|e| schedules(&e.event).as_ref() == Some(&call));
                    waiting.push(appended);
                }
                Err(broadcast::error::TryRecvError::Lagged(_)) => {
                    self.held.extend(waiting);
                    return self.catch_up(backlog).await;
                }
                Err(_) => break,
            }
        }
        if found {
            for appended in waiting {
                self.take(appended, backlog).await?;
            }
        } else {
            self.held.extend(waiting);
        }
        Ok(())
    }

    /// Sends an append's events not sent yet, reading the store first if some were missed.
    async fn take(
        &mut self,
        appended: Arc<AppendedEvents>,
        backlog: &mut std::collections::VecDeque<StreamEvent>,
    ) -> Result<()> {
        let first = appended.events.first().map(|e| e.seq).unwrap_or(0);
        if first > self.last_seq.saturating_add(1) {
            // Missed some (appended before we subscribed): read them.
            return self.catch_up(backlog).await;
        }
        for event in &appended.events {
            self.send(event.clone(), backlog);
        }
        Ok(())
    }

    /// Sends an event not sent yet.
    fn send(
        &mut self,
        event: EventEnvelope,
        backlog: &mut std::collections::VecDeque<StreamEvent>,
    ) {
        if event.seq > self.last_seq {
            self.last_seq = event.seq;
            if let Some(call) = schedules(&event.event) {
                self.scheduled.insert(call);
            }
            backlog.push_back(StreamEvent::Event(event));
        }
    }

    /// Reads every stored event after the last one sent.
    pub async fn catch_up(
        &mut self,
        backlog: &mut std::collections::VecDeque<StreamEvent>,
    ) -> Result<()> {
        let events = match self
            .engine
            .store()
            .read_history(&self.session_id, self.last_seq.saturating_add(1), None)
            .await
        {
            Ok(events) => events,
            // A session not created yet has nothing to send.
            Err(Error::UnknownSession { .. }) => Vec::new(),
            Err(e) => return Err(e),
        };
        for event in events {
            self.send(event, backlog);
        }
        Ok(())
    }

    async fn run(mut self, sender: mpsc::Sender<Result<StreamEvent>>) {
        let mut backlog = std::collections::VecDeque::new();
        let mut step = self.catch_up(&mut backlog).await;
        loop {
            if let Err(e) = step {
                let _ = sender.send(Err(e)).await;
                return;
            }
            while let Some(event) = backlog.pop_front() {
                if sender.send(Ok(event)).await.is_err() {
                    return;
                }
            }
            // A follower whose reader left ends at once, not at the session's next event
            // (which may never come): it holds the engine and a watch of the session.
            step = tokio::select! {
                next = self.next(&mut backlog) => match next {
                    Some(step) => step,
                    None => return,
                },
                () = sender.closed() => return,
            };
        }
    }
}
