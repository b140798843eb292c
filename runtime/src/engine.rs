//! The engine: steps a session's workflow with an input, appends what the step returns (the
//! input, the command events, the tasks to enqueue and cancel) in one atomic, durable store
//! append, then wakes workers and turn waiters. What to enqueue and cancel is the workflow's
//! decision ([`SessionState::step`]), not the engine's.
//!
//! Folded session state is cached; a miss (or any failed append) reloads it from the history.
//! The cache is never trusted blindly, but it is trusted first: a decision on the cached state
//! is appended with the seq it expects next, so a decision taken on a state that missed
//! another writer's events (another engine in this process, or another server on a shared
//! database) fails with `Conflict`, and the engine catches up and decides again. Every other
//! answer — nothing to do, a rejected input — is given only on a state caught up with the
//! store (the events appended since its cached next seq are read first). A cached state that
//! a change hint says is behind is caught up before deciding, which saves the conflict.
//! Waiters and followers of a session hear of foreign appends through [`Engine::follow_store`].

#[path = "engine_cache.rs"]
mod cache;
#[path = "engine_dispatch.rs"]
mod dispatch;
#[path = "engine_idempotent.rs"]
mod idempotent;
#[path = "engine_reports.rs"]
mod reports;
#[path = "engine_resume.rs"]
mod resume;
#[path = "engine_timers.rs"]
mod timers;

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::event::{ActivityFailure, Event, EventEnvelope, SessionStarted};
use crate::pricing::PriceTable;
use crate::state_cache::{SessionSlot, StateCache};
use crate::store::{
    AppendRequest, Lease, LeaseRequest, SessionInfo, SessionStatus, Store, TaskFence, TaskId,
};
use crate::task_waiters::TaskWaiters;
use crate::workflow::{ScheduledActivity, SessionState, Transition, TurnOutcome};
use cairn_ledger::{
    Delta, JsonText, Media, ModelResponse, ModelSpec, ToolResultContent, ToolSpec, ToolUse,
    Transcript,
};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{broadcast, watch};
use tracing::{debug, info, info_span, Instrument};

/// Identifies one activity attempt, so that consumers can tell a retry's stream from the first.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ActivityRef {
    /// Session.
    pub session_id: String,
    /// Turn.
    pub turn: u32,
    /// `model:ROUND` or `tool:TOOL_USE_ID`.
    pub activity: String,
    /// Activity attempt.
    pub attempt: u32,
}

/// A streamed fragment with its origin. Presentation only: never recorded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeltaEvent {
    /// Where it comes from.
    pub origin: ActivityRef,
    /// The fragment.
    pub delta: Delta,
}

/// The time limits of one activity attempt, from its retry policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ActivityTimeouts {
    /// When the attempt was due (epoch ms); schedule-to-start counts from here.
    pub due_at_ms: u64,
    /// Fail the attempt when it starts more than this long after it was due.
    pub schedule_to_start_ms: Option<u64>,
    /// Fail the attempt when it runs longer than this.
    pub start_to_close_ms: u64,
    /// Fail the attempt when it does not heartbeat for this long.
    pub heartbeat_ms: Option<u64>,
}

impl ActivityTimeouts {
    fn of(policy: &crate::event::RetryPolicy, due_at_ms: u64) -> Self {
        ActivityTimeouts {
            due_at_ms,
            schedule_to_start_ms: policy.schedule_to_start_timeout_ms,
            start_to_close_ms: policy.start_to_close_timeout_ms,
            heartbeat_ms: policy.heartbeat_timeout_ms,
        }
    }
}

/// What a leased task asks a worker to do.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivityInput {
    /// Call a model with the transcript as it stands.
    Model {
        /// Origin, for deltas and logs.
        origin: ActivityRef,
        /// Round within the turn.
        round: u32,
        /// The model.
        model: ModelSpec,
        /// The transcript to send, shared with the session's state (not copied per call).
        /// Only its messages after the first `transcript_left_out` on the wire when the
        /// worker keeps the rest.
        transcript: Arc<Transcript>,
        /// Which of its session's transcripts this is, for a worker that keeps them
        /// ([`crate::wire::TRANSCRIPTS_HEADER`]): the seq of the event that last rebuilt the
        /// transcript (a compaction), 0 while it was only ever added to. Between two model
        /// calls of a session with the same lineage the transcript only grew at its end.
        /// `None` for a call on a transcript of its own (a compaction's summary).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        transcript_lineage: Option<u64>,
        /// The transcript's first messages left out (0: none): `transcript` holds those after
        /// them. The worker said it keeps this session's transcript of this lineage with as
        /// many messages, and fills them in.
        #[serde(default, skip_serializing_if = "is_zero")]
        transcript_left_out: u32,
        /// Tools offered, shared with the session's state (not copied per call). Empty on
        /// the wire when `tools_omitted` says the worker keeps them.
        tools: Arc<[ToolSpec]>,
        /// The tools' digest (the first 128 bits of the SHA-256 of their JSON), which a
        /// worker that keeps tool sets keeps them under: set only by a server answering such
        /// a worker ([`crate::wire::TOOL_SETS_HEADER`]), for a non-empty set.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tools_digest: Option<String>,
        /// `tools` were left out (sent empty): they are the set `tools_digest` names, which
        /// the worker said it keeps.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        tools_omitted: bool,
        /// Time limits.
        timeouts: ActivityTimeouts,
        /// Progress the previous attempt heartbeated last.
        heartbeat_details: Option<JsonText>,
        /// The call's options: tool choice, server tools, prompt caching.
        #[serde(default, skip_serializing_if = "cairn_ledger::CallOptions::is_default")]
        options: cairn_ledger::CallOptions,
    },
    /// Run a tool.
    Tool {
        /// Origin.
        origin: ActivityRef,
        /// The call.
        tool_use: ToolUse,
        /// Stable across attempts: `session/tool_use_id`.
        idempotency_key: String,
        /// Time limits.
        timeouts: ActivityTimeouts,
        /// Progress the previous attempt heartbeated last.
        heartbeat_details: Option<JsonText>,
        /// The directory the session recorded for its tools, if any (see
        /// [`SessionStarted::workdir`](crate::event::SessionStarted::workdir)).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        workdir: Option<String>,
        /// For tools that change files: what the session last saw of each file
        /// ([`cairn_ledger::file_versions`]), derived from its transcript.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        file_versions: Vec<cairn_ledger::file_versions::FileVersion>,
    },
}

/// A model task's tool set as the wire carries it ([`ActivityInput::Model`]'s `tools`,
/// `tools_digest` and `tools_omitted`), to change in place: a server leaves out a set a
/// worker keeps, the worker fills it in.
pub struct ToolSetFields<'a> {
    /// The tools, empty when left out.
    pub tools: &'a mut Arc<[ToolSpec]>,
    /// The set's digest, when a server named it.
    pub digest: &'a mut Option<String>,
    /// Whether the tools were left out.
    pub omitted: &'a mut bool,
}

/// A model task's transcript as the wire carries it ([`ActivityInput::Model`]'s
/// `transcript`, `transcript_lineage` and `transcript_left_out`), to change in place: a
/// server leaves out the messages a worker keeps, the worker fills them in.
pub struct TranscriptFields<'a> {
    /// The session whose transcript it is.
    pub session_id: &'a str,
    /// The transcript, or its messages after those left out.
    pub transcript: &'a mut Arc<Transcript>,
    /// Which of the session's transcripts it is, if it is the session's.
    pub lineage: &'a mut Option<u64>,
    /// How many of its first messages were left out.
    pub left_out: &'a mut u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl ActivityInput {
    /// A model task's transcript fields; `None` for a tool task.
    pub fn transcript_mut(&mut self) -> Option<TranscriptFields<'_>> {
        match self {
            ActivityInput::Model {
                origin,
                transcript,
                transcript_lineage,
                transcript_left_out,
                ..
            } => Some(TranscriptFields {
                session_id: &origin.session_id,
                transcript,
                lineage: transcript_lineage,
                left_out: transcript_left_out,
            }),
            ActivityInput::Tool { .. } => None,
        }
    }

    /// A model task's tool set fields; `None` for a tool task.
    pub fn tool_set_mut(&mut self) -> Option<ToolSetFields<'_>> {
        match self {
            ActivityInput::Model {
                tools,
                tools_digest,
                tools_omitted,
                ..
            } => Some(ToolSetFields {
                tools,
                digest: tools_digest,
                omitted: tools_omitted,
            }),
            ActivityInput::Tool { .. } => None,
        }
    }
}

/// What a worker reports for a leased task.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivityReport {
    /// The model answered.
    ModelCompleted(ModelResponse),
    /// The tool returned.
    ToolCompleted {
        /// Result content.
        content: ToolResultContent,
        /// Whether it is an error result.
        is_error: bool,
    },
    /// The attempt failed.
    Failed(ActivityFailure),
}

/// A leased task with what it runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LeasedTask {
    /// The lease: present its attempt with every heartbeat and report.
    pub lease: Lease,
    /// What to run.
    pub input: ActivityInput,
}

/// Events one append recorded, as the engine publishes them to subscribers.
#[derive(Debug, Clone, PartialEq)]
pub struct AppendedEvents {
    /// The session.
    pub session_id: String,
    /// The events, in seq order.
    pub events: Vec<EventEnvelope>,
}

/// What `resume` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResumeReport {
    /// Sessions with a turn in progress.
    pub running_sessions: Vec<String>,
    /// Outstanding activity tasks across them.
    pub outstanding_tasks: usize,
    /// Tasks that were missing from the queue and were enqueued again.
    pub requeued_tasks: usize,
    /// Leases of a previous process released so their tasks run again at once (when asked to).
    pub reclaimed_leases: usize,
    /// Running sessions whose history this code cannot fold (a corrupt record, an event of a
    /// newer cairn, a decision the current code no longer takes), so their tasks were not
    /// checked. Each is left as it is, and every other session is resumed: one damaged
    /// history does not keep a server from starting. Reading such a session gives the same
    /// typed error.
    pub unresumable: Vec<UnresumableSession>,
}

/// A running session [`Engine::resume`] could not load, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnresumableSession {
    /// The session.
    pub session_id: String,
    /// The error its history gave, as displayed.
    pub error: String,
}

/// How many times a decision is taken again after its append lost a race with another
/// writer of the session, before the conflict is returned.
const CONFLICT_RETRIES: usize = 16;

/// Session states the engine caches before it drops parked ones nobody holds, least
/// recently used first (`state_cache`). A dropped state is folded again from the history at
/// its session's next step. Running sessions' states are kept past it, so a busy engine does
/// not fold its turns again.
pub const CACHE_CAPACITY: usize = 512;

/// The bytes the engine's cached states may hold (`SessionState::approx_bytes`) before it
/// drops parked ones nobody holds, least recently used first, as for [`CACHE_CAPACITY`]. A
/// thousand-turn session's state is a megabyte or two, so 512 long sessions would otherwise
/// take a gigabyte.
pub const CACHE_BYTES: usize = 64 << 20;

/// How many entries each of the engine's per-session maps holds
/// ([`Engine::per_session_entries`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PerSessionEntries {
    /// Cached session states (slots).
    pub sessions: usize,
    /// Outcome channels.
    pub outcomes: usize,
    /// Watched sessions.
    pub watched: usize,
    /// Change hints.
    pub heard_seqs: usize,
    /// Leases handed out here and not yet reported.
    pub leased_here: usize,
}

/// A turn waiter's outcome receiver; dropped, it removes the session's outcome channel when
/// it was the last receiver.
struct OutcomeWait {
    engine: Engine,
    session_id: String,
    rx: watch::Receiver<Option<TurnOutcome>>,
}

impl Drop for OutcomeWait {
    fn drop(&mut self) {
        // Receivers subscribe under this lock, so none can appear between the count and the
        // removal; ours is the one still counted.
        let mut outcomes = lock(&self.engine.inner.outcomes);
        if outcomes
            .get(&self.session_id)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            outcomes.remove(&self.session_id);
        }
    }
}

struct Inner {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    /// Folded states, cached. Bounded by [`CACHE_CAPACITY`] and [`CACHE_BYTES`]: past either,
    /// parked (idle) states nobody holds are dropped, least recently used first (see
    /// `state_cache`).
    sessions: Mutex<StateCache>,
    /// Outcome channels of sessions somebody waits on ([`Engine::wait_turn`]): created by the
    /// first waiter, removed when the last one leaves, so parked sessions keep none.
    outcomes: Mutex<HashMap<String, watch::Sender<Option<TurnOutcome>>>>,
    /// Leases waiting for tasks ([`Engine::lease_tasks_waiting`]).
    waiters: TaskWaiters,
    deltas: broadcast::Sender<DeltaEvent>,
    cancellations: broadcast::Sender<String>,
    /// Sessions this engine deleted: their followers end.
    deletions: broadcast::Sender<String>,
    appended: broadcast::Sender<Arc<AppendedEvents>>,
    id_counter: AtomicU64,
    /// Overdue tasks the last round of timers could not record (see [`Engine::fire_timers`]).
    timers_stuck: Mutex<HashSet<TaskId>>,
    /// Sessions somebody waits on or follows, with how many do: [`Engine::follow_store`]
    /// reads their foreign appends.
    /// Also whether the session was seen to have events while watched: found gone after
    /// that, another process deleted it (ids are never used again).
    watched: Mutex<HashMap<String, (usize, SessionSlot, bool)>>,
    /// Leases this engine handed out and has not seen reported, with their attempt and
    /// expiry: on a shared store, a draining server waits for these, not for other servers'.
    /// Those that run out unreported are forgotten by the timers ([`Engine::fire_timers`]).
    leased_here: Mutex<HashMap<TaskId, (u32, u64)>>,
    /// The highest seq change hints reported for cached sessions ([`Engine::follow_store`]):
    /// a cached state whose next seq is not past it missed another writer's append, and is
    /// caught up before it decides.
    heard_seqs: Mutex<HashMap<String, u64>>,
    /// Prices model attempts' usage as their results are recorded ([`Engine::set_prices`]).
    prices: std::sync::RwLock<Arc<PriceTable>>,
}

/// Keeps a session watched (see [`Engine::watch`]) while it lives.
pub struct WatchGuard {
    engine: Engine,
    session_id: String,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        let mut watched = lock(&self.engine.inner.watched);
        if let Some((count, _, _)) = watched.get_mut(&self.session_id) {
            *count -= 1;
            if *count == 0 {
                watched.remove(&self.session_id);
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// The engine handle; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// An engine over a store, reading time from `clock`.
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Self {
        let (deltas, _) = broadcast::channel(4096);
        let (cancellations, _) = broadcast::channel(1024);
        let (deletions, _) = broadcast::channel(1024);
        let (appended, _) = broadcast::channel(4096);
        Engine {
            inner: Arc::new(Inner {
                store,
                clock,
                sessions: Mutex::new(StateCache::new(CACHE_CAPACITY, CACHE_BYTES)),
                outcomes: Mutex::new(HashMap::new()),
                waiters: TaskWaiters::default(),
                deltas,
                cancellations,
                deletions,
                appended,
                id_counter: AtomicU64::new(0),
                timers_stuck: Mutex::new(HashSet::new()),
                watched: Mutex::new(HashMap::new()),
                leased_here: Mutex::new(HashMap::new()),
                heard_seqs: Mutex::new(HashMap::new()),
                prices: std::sync::RwLock::new(Arc::new(PriceTable::built_in())),
            }),
        }
    }

    /// How many reports wait for `session_id`'s append in flight.
    #[cfg(test)]
    pub(crate) fn reports_waiting(&self, session_id: &str) -> usize {
        self.slot(session_id).reports().len()
    }

    /// Forgets that a worker of this engine holds `lease`, as if another server of a shared
    /// database had handed it out.
    #[cfg(test)]
    pub(crate) fn forget_lease_held_here(&self, lease: &crate::store::Lease) {
        lock(&self.inner.leased_here).remove(&lease.id);
    }

    /// Sets the price table that turns each model attempt's usage into the cost recorded
    /// with its result (the built-in table until set).
    pub fn set_prices(&self, prices: PriceTable) {
        *self.inner.prices.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(prices);
    }

    /// The price table in use.
    pub fn prices(&self) -> Arc<PriceTable> {
        self.inner
            .prices
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The clock.
    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// Subscribes to the live deltas of every running model call.
    pub fn subscribe_deltas(&self) -> broadcast::Receiver<DeltaEvent> {
        self.inner.deltas.subscribe()
    }

    /// Subscribes to every event this engine appends, after it is durable. A receiver that
    /// lags misses events (`RecvError::Lagged`) and must read them from the store.
    pub fn subscribe_events(&self) -> broadcast::Receiver<Arc<AppendedEvents>> {
        self.inner.appended.subscribe()
    }

    /// Publishes a delta to subscribers (workers call this while a model streams).
    pub fn publish_delta(&self, event: DeltaEvent) {
        // No subscriber is fine: deltas are presentation only.
        let _ = self.inner.deltas.send(event);
    }

    /// Starts a session; `session_id` is generated when `None`.
    pub async fn start_session(
        &self,
        session_id: Option<String>,
        started: SessionStarted,
    ) -> Result<String> {
        let session_id = match session_id {
            Some(id) => id,
            None => self.new_session_id(),
        };
        crate::store::check_session_id(&session_id)?;
        self.submit_with(
            &session_id,
            |_| Ok(Some(Event::SessionStarted(started.clone()))),
            Vec::new(),
            None,
            true,
        )
        .await?;
        Ok(session_id)
    }

    /// Starts a session and sends its first message in one durable append (a fresh session
    /// per task costs one commit less than [`Engine::start_session`] then
    /// [`Engine::send_message`]); returns the session's id and the turn's number (1).
    pub async fn start_session_and_send(
        &self,
        session_id: Option<String>,
        started: SessionStarted,
        text: &str,
    ) -> Result<(String, u32)> {
        self.start_session_and_send_turn(session_id, started, text, None, Vec::new(), None)
            .await
    }

    /// [`Engine::start_session_and_send`] with the first message's images and documents
    /// (ahead of the text), and a model and a tool choice for turn 1 only, as
    /// [`Engine::send_turn`] takes them.
    pub async fn start_session_and_send_turn(
        &self,
        session_id: Option<String>,
        started: SessionStarted,
        text: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
        tool_choice: Option<cairn_ledger::ToolChoice>,
    ) -> Result<(String, u32)> {
        let session_id = match session_id {
            Some(id) => id,
            None => self.new_session_id(),
        };
        crate::store::check_session_id(&session_id)?;
        crate::stages::mark(crate::stages::TURN_START);
        self.submit_inputs(
            &session_id,
            |_| {
                Ok(Some(vec![
                    Event::SessionStarted(started.clone()),
                    Event::UserMessage {
                        idempotency_key: None,
                        turn: 1,
                        text: text.to_owned(),
                        model: model.clone(),
                        media: media.clone(),
                        tool_choice: tool_choice.clone(),
                    },
                ]))
            },
            Vec::new(),
            None,
            true,
            None,
        )
        .await?;
        Ok((session_id, 1))
    }

    fn new_session_id(&self) -> String {
        let n = self.inner.id_counter.fetch_add(1, Ordering::Relaxed);
        format!("s{:x}-{:x}-{n}", self.now_ms(), std::process::id())
    }

    /// Sends a user message, starting the next turn; returns its number.
    pub async fn send_message(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
    ) -> Result<u32> {
        self.send_turn(session_id, text, model, Vec::new(), None)
            .await
    }

    /// Sends a user message with images and documents (ahead of the text in the transcript),
    /// starting the next turn; returns its number. Bad media are refused before anything is
    /// written ([`Error::InvalidEvent`] naming the media's index and what is wrong).
    pub async fn send_message_with_media(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
    ) -> Result<u32> {
        self.send_turn(session_id, text, model, media, None).await
    }

    /// Sends a user message with its images and documents and, for this turn only, a model
    /// and a tool choice instead of the session's; returns the turn's number. Bad media are
    /// refused before anything is written.
    pub async fn send_turn(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
        tool_choice: Option<cairn_ledger::ToolChoice>,
    ) -> Result<u32> {
        crate::stages::mark(crate::stages::TURN_START);
        let mut turn = 0;
        self.submit(
            session_id,
            |state| {
                turn = state.turns_started + 1;
                Ok(Some(Event::UserMessage {
                    idempotency_key: None,
                    turn,
                    text: text.to_owned(),
                    model: model.clone(),
                    media: media.clone(),
                    tool_choice: tool_choice.clone(),
                }))
            },
            Vec::new(),
        )
        .await?;
        Ok(turn)
    }

    /// Cancels a session: the running turn's open tool calls are closed with error results,
    /// running activities get a cancellation signal, and the session takes no more turns.
    pub async fn cancel(&self, session_id: &str, reason: &str) -> Result<()> {
        self.submit(
            session_id,
            |_| {
                Ok(Some(Event::SessionCancelled {
                    reason: reason.to_owned(),
                }))
            },
            Vec::new(),
        )
        .await?;
        let _ = self.inner.cancellations.send(session_id.to_owned());
        Ok(())
    }

    /// Cancels the running turn only; returns its number. The session takes further turns.
    pub async fn cancel_turn(&self, session_id: &str, reason: &str) -> Result<u32> {
        let mut turn = 0;
        self.submit(
            session_id,
            |state| match &state.active {
                Some(active) => {
                    turn = active.turn;
                    Ok(Some(Event::TurnCancelled {
                        turn,
                        reason: reason.to_owned(),
                    }))
                }
                None => Err(Error::InvalidEvent {
                    session_id: session_id.to_owned(),
                    seq: state.next_seq,
                    reason: "no turn is running".to_owned(),
                }),
            },
            Vec::new(),
        )
        .await?;
        let _ = self.inner.cancellations.send(session_id.to_owned());
        Ok(turn)
    }

    /// Deletes a finished session from the store ([`Store::delete_session`]: its history and
    /// record, leaving a tombstone so the id is never used again) and forgets it here: its
    /// cached state, outcome channel, watch entry and change hints. `SessionBusy` while a turn
    /// runs or a task of it is queued; `UnknownSession` when there is no such session.
    /// Other engines on a shared store find out at their next read or append of it: a read
    /// finds no session, an append `SessionDeleted`.
    pub async fn delete_session(&self, session_id: &str) -> Result<SessionInfo> {
        let span = info_span!("delete_session", session_id = %session_id);
        async move {
            let deleted = {
                // Holding the slot keeps this engine's own decisions on the session out.
                let slot = self.slot(session_id);
                let _guard = slot.lock().await;
                self.inner
                    .store
                    .delete_session(session_id, self.now_ms())
                    .await
            };
            // Gone, now or earlier (through another process).
            if matches!(deleted, Ok(_) | Err(Error::UnknownSession { .. })) {
                self.forget(session_id);
            }
            if let Ok(info) = &deleted {
                info!(events = info.events, "session deleted");
            }
            deleted
        }
        .instrument(span)
        .await
    }

    /// Drops everything this engine keeps for a session that is gone, and ends its
    /// followers: none may be left waiting for events that will never come.
    fn forget(&self, session_id: &str) {
        lock(&self.inner.sessions).remove(session_id);
        lock(&self.inner.outcomes).remove(session_id);
        lock(&self.inner.heard_seqs).remove(session_id);
        lock(&self.inner.watched).remove(session_id);
        let _ = self.inner.deletions.send(session_id.to_owned());
    }

    /// Compacts a session's transcript now, between turns (`compaction_requested`), with its
    /// compaction policy or the default one. Refused (`InvalidEvent`) while a turn runs.
    pub async fn compact(&self, session_id: &str) -> Result<crate::wire::CompactionOutcome> {
        let seq = self
            .submit(
                session_id,
                |_| Ok(Some(Event::CompactionRequested {})),
                Vec::new(),
            )
            .await?;
        // The compaction, when there is one, is in the same append, right after the request.
        let recorded = match seq {
            Some(seq) => {
                self.inner
                    .store
                    .read_history(session_id, seq, Some(2))
                    .await?
            }
            None => Vec::new(),
        };
        if let Some(Event::TranscriptCompacted {
            strategies,
            estimate_before,
            estimate_after,
            ..
        }) = recorded.get(1).map(|e| &e.event)
        {
            return Ok(crate::wire::CompactionOutcome {
                compacted: true,
                strategies: strategies.iter().map(|s| s.as_str().to_owned()).collect(),
                estimate_before: *estimate_before,
                estimate_after: *estimate_after,
            });
        }
        let estimate = cairn_ledger::estimate_tokens(&self.state(session_id).await?.transcript);
        Ok(crate::wire::CompactionOutcome {
            compacted: false,
            strategies: Vec::new(),
            estimate_before: estimate,
            estimate_after: estimate,
        })
    }

    /// Approves a tool call the session's policy parked: it is scheduled at once. Refused
    /// (`InvalidEvent`, naming the call) unless the call waits for approval in the running
    /// turn.
    pub async fn approve(&self, session_id: &str, tool_use_id: &str) -> Result<()> {
        self.decide_parked(session_id, tool_use_id, |turn| Event::ToolCallApproved {
            turn,
            tool_use_id: tool_use_id.to_owned(),
        })
        .await
    }

    /// Denies a tool call the session's policy parked: the model gets an `is_error` result
    /// carrying `reason`. Refused like [`Engine::approve`].
    pub async fn deny(&self, session_id: &str, tool_use_id: &str, reason: &str) -> Result<()> {
        self.decide_parked(session_id, tool_use_id, |turn| Event::ToolCallDenied {
            turn,
            tool_use_id: tool_use_id.to_owned(),
            reason: reason.to_owned(),
            by_deadline: false,
        })
        .await
    }

    async fn decide_parked(
        &self,
        session_id: &str,
        tool_use_id: &str,
        event: impl Fn(u32) -> Event + Send + Sync,
    ) -> Result<()> {
        self.submit(
            session_id,
            |state| {
                // The workflow names what is wrong when the call is not parked; the turn is
                // the running one (or, with none running, one that cannot match).
                let turn = state
                    .active
                    .as_ref()
                    .map_or(state.turns_started, |a| a.turn);
                Ok(Some(event(turn)))
            },
            Vec::new(),
        )
        .await
        .map(|_| debug!(session_id, tool_use_id, "approval decided"))
    }

    /// Session ids whose running activities should stop (workers subscribe).
    pub fn subscribe_cancellations(&self) -> broadcast::Receiver<String> {
        self.inner.cancellations.subscribe()
    }

    /// Session ids this engine deletes, as it deletes them (followers subscribe, to end);
    /// on a shared store, also watched sessions another process deleted, as
    /// [`Engine::follow_store`] finds them gone.
    pub fn subscribe_deletions(&self) -> broadcast::Receiver<String> {
        self.inner.deletions.subscribe()
    }

    /// Waits until turn `turn` has an outcome, and answers with it: that turn's own, even
    /// when the session has gone on to later turns since (a resent message's wait, say).
    pub async fn wait_turn(&self, session_id: &str, turn: u32) -> Result<TurnOutcome> {
        // Subscribed before the state is read: an outcome appended after the read is sent to
        // this receiver, one appended before it is in the state.
        let mut wait = self.outcome_wait(session_id);
        // Another writer of the store may record the outcome: follow the session meanwhile.
        let _watch = self.watch(session_id);
        let ended = {
            let slot = self.slot(session_id);
            let mut guard = slot.lock().await;
            let state = self.loaded(session_id, &mut guard).await?;
            outcome_for(state, turn)
        };
        let ended = match ended {
            Some(outcome) => outcome,
            None => loop {
                if let Some(outcome) = wait.rx.borrow_and_update().as_ref() {
                    if outcome.turn() >= turn {
                        break outcome.clone();
                    }
                }
                if wait.rx.changed().await.is_err() {
                    return Err(Error::Shutdown);
                }
            },
        };
        crate::stages::mark(crate::stages::TURN_END);
        if ended.turn() == turn {
            return Ok(ended);
        }
        Ok(self.past_outcome(session_id, turn).await?.unwrap_or(ended))
    }

    /// Turn `turn`'s own outcome once the session has gone past it: the history folded up to
    /// the event that ended the turn (the state keeps only the last turn's). Rare, so read
    /// whole rather than kept per turn. `None` if no event gave that turn an outcome.
    async fn past_outcome(&self, session_id: &str, turn: u32) -> Result<Option<TurnOutcome>> {
        let history = self.inner.store.read_history(session_id, 1, None).await?;
        let mut state = SessionState::new(session_id);
        for envelope in &history {
            state.apply(envelope)?;
            match &state.last_outcome {
                Some(outcome) if outcome.turn() == turn => return Ok(Some(outcome.clone())),
                Some(outcome) if outcome.turn() > turn => return Ok(None),
                _ => {}
            }
        }
        Ok(None)
    }

    /// The folded state of a session (a clone of the cached one).
    pub async fn state(&self, session_id: &str) -> Result<SessionState> {
        let slot = self.slot(session_id);
        let mut guard = slot.lock().await;
        Ok(self.loaded(session_id, &mut guard).await?.clone())
    }

    async fn discard_task(&self, lease: &Lease) -> Result<()> {
        let session_id = &lease.id.session_id;
        let slot = self.slot(session_id);
        let mut guard = slot.lock().await;
        let mut conflicts = 0;
        loop {
            let state = self.loaded(session_id, &mut guard).await?;
            let request = AppendRequest {
                cancel: vec![lease.id.clone()],
                ..AppendRequest::new(
                    session_id.clone(),
                    state.next_seq,
                    Vec::new(),
                    status_of(state),
                    self.now_ms(),
                )
            };
            match self.inner.store.append(request).await {
                Ok(()) | Err(Error::LeaseLost { .. }) => return Ok(()),
                // Another writer appended meanwhile: catch up and drop it again.
                Err(Error::Conflict { .. }) if conflicts < CONFLICT_RETRIES => conflicts += 1,
                Err(e) => {
                    *guard = None;
                    return Err(e);
                }
            }
        }
    }

    /// Steps the workflow with the input `decide` makes of the session's current state, and
    /// appends the transition atomically (see [`Engine::submit_with`]).
    async fn submit(
        &self,
        session_id: &str,
        decide: impl FnMut(&SessionState) -> Result<Option<Event>> + Send,
        complete: Vec<(TaskId, u32)>,
    ) -> Result<Option<u64>> {
        self.submit_with(session_id, decide, complete, None, false)
            .await
    }

    /// Steps the workflow with the input `decide` makes of the session's state, caught up
    /// with the store, appends the transition atomically (with `complete` fencing it, and
    /// dropping `drop_if_unchanged`'s task from the queue if it is still as the caller read
    /// it, else refusing the append with `LeaseLost`: the task of an overdue attempt the
    /// input records as failed, which has no current lease to complete it with), updates the
    /// cache and tells waiters. When the append loses a race with another writer, catches up
    /// and decides again. Returns the input's seq, or `None` when `decide` found nothing to do.
    /// `starting`: the input starts the session, deciding on an empty state (the store
    /// refuses it if the session exists).
    async fn submit_with(
        &self,
        session_id: &str,
        mut decide: impl FnMut(&SessionState) -> Result<Option<Event>> + Send,
        complete: Vec<(TaskId, u32)>,
        drop_if_unchanged: Option<TaskFence>,
        starting: bool,
    ) -> Result<Option<u64>> {
        self.submit_inputs(
            session_id,
            |state| Ok(decide(state)?.map(|input| vec![input])),
            complete,
            drop_if_unchanged,
            starting,
            None,
        )
        .await
        .map(|(seq, _)| seq)
    }

    /// [`Engine::submit_with`] for inputs that `decide` makes together: the workflow steps
    /// each in turn, and one append records every transition, atomically (a session's start
    /// with its first message costs one durable commit, not two). Returns the first input's
    /// seq. With `eager`, the append leases tasks for the caller's worker too
    /// ([`Store::append_and_lease`]), and returns them.
    async fn submit_inputs(
        &self,
        session_id: &str,
        mut decide: impl FnMut(&SessionState) -> Result<Option<Vec<Event>>> + Send,
        complete: Vec<(TaskId, u32)>,
        drop_if_unchanged: Option<TaskFence>,
        starting: bool,
        eager: Option<&LeaseRequest>,
    ) -> Result<(Option<u64>, Vec<Lease>)> {
        let span = info_span!("session", session_id = %session_id);
        async move {
            let slot = self.slot(session_id);
            let mut guard = slot.lock().await;
            self.submit_locked(
                session_id,
                &mut guard,
                &mut decide,
                &complete,
                &drop_if_unchanged,
                starting,
                eager,
            )
            .await
        }
        .instrument(span)
        .await
    }

    /// [`Engine::submit_inputs`] for a caller that holds the session's slot (`guard`).
    #[allow(clippy::too_many_arguments)] // submit_inputs' own, and the guard
    pub(super) async fn submit_locked(
        &self,
        session_id: &str,
        guard: &mut Option<SessionState>,
        decide: &mut (impl FnMut(&SessionState) -> Result<Option<Vec<Event>>> + Send),
        complete: &[(TaskId, u32)],
        drop_if_unchanged: &Option<TaskFence>,
        starting: bool,
        eager: Option<&LeaseRequest>,
    ) -> Result<(Option<u64>, Vec<Lease>)> {
        let mut conflicts = 0;
        loop {
            match self
                .try_submit(
                    session_id,
                    guard,
                    decide,
                    (complete, drop_if_unchanged),
                    starting,
                    eager,
                )
                .await
            {
                // The session changed under us: the state was dropped, so the next try
                // reloads it with the other writer's events and decides again.
                Err(Error::Conflict { .. }) if conflicts < CONFLICT_RETRIES && guard.is_none() => {
                    conflicts += 1;
                    debug!(
                        conflicts,
                        "append lost a race with another writer; retrying"
                    );
                }
                result => return result,
            }
        }
    }

    async fn try_submit(
        &self,
        session_id: &str,
        guard: &mut Option<SessionState>,
        decide: &mut (impl FnMut(&SessionState) -> Result<Option<Vec<Event>>> + Send),
        (complete, drop_if_unchanged): (&[(TaskId, u32)], &Option<TaskFence>),
        is_start: bool,
        eager: Option<&LeaseRequest>,
    ) -> Result<(Option<u64>, Vec<Lease>)> {
        // The cached state is decided on as it is, unless a hint says it is behind: an append
        // of a decision on a state that missed another writer's events fails with `Conflict`.
        // Any other answer is given on a state caught up with the store (`caught_up`).
        let mut caught_up = is_start
            || match guard.as_ref() {
                Some(state) => self.heard_ahead(state),
                None => true,
            };
        let (state, first_seq, transition, now) = loop {
            let state = if is_start {
                guard.insert(SessionState::new(session_id))
            } else if caught_up {
                self.loaded(session_id, guard).await?
            } else {
                match guard.as_mut() {
                    Some(state) => state,
                    None => self.loaded(session_id, guard).await?,
                }
            };
            let inputs = match decide(state) {
                Ok(Some(inputs)) if !inputs.is_empty() => inputs,
                Ok(_) | Err(_) if !caught_up => {
                    caught_up = true;
                    continue;
                }
                Ok(_) => return Ok((None, Vec::new())),
                Err(e) => return Err(e),
            };
            let now = self.now_ms();
            let first_seq = state.next_seq;
            match step_all(state, session_id, now, inputs) {
                Ok(transition) => break (state, first_seq, transition, now),
                Err(e) => {
                    // A rejected input — a stale report (`StaleReport`, the common case: a
                    // late worker), misuse or a rejection (`InvalidEvent`) — leaves the state
                    // as it was, so the cache stays. A new session's state is dropped, and so
                    // is one a failed step advanced part way (its seq moved): it reloads from
                    // the store.
                    if is_start || state.next_seq != first_seq {
                        *guard = None;
                    }
                    if !caught_up {
                        caught_up = true;
                        continue;
                    }
                    return Err(e);
                }
            }
        };
        let Transition {
            events,
            enqueue,
            cancel,
            outcome,
            ..
        } = transition;
        let request = AppendRequest {
            session_id: session_id.to_owned(),
            expected_next_seq: first_seq,
            events,
            status: status_of(state),
            enqueue,
            complete: complete.to_vec(),
            cancel,
            drop_if_unchanged: drop_if_unchanged.clone(),
            now_ms: now,
        };
        let mut enqueued = request.enqueue.clone();
        let published = (self.inner.appended.receiver_count() > 0).then(|| request.events.clone());
        debug!(
            events = request.events.len(),
            tasks = request.enqueue.len(),
            "append"
        );
        // No worker asked for the tasks this append queues (a client's message, a timer):
        // a lease waiting for one of them (a worker of this process's, or a remote worker's
        // long poll) has them leased with the append and handed over, instead of asking the
        // store again once woken (a write and a sync of its own for a remote lease).
        let claim = match eager {
            None => self.inner.waiters.claim(&request.enqueue),
            Some(_) => None,
        };
        let lease_request = eager.or(claim.as_ref().map(|claim| claim.request()));
        // Out of the cache while the append is in doubt: should this call be dropped before
        // the store answers (its caller gone: a server's handler whose client hung up), the
        // next one loads the session from the store instead of trusting a state the store
        // may never hold. Put back once the append is durable.
        let stepped = guard.take();
        crate::stages::mark("append.start");
        let appended = match lease_request {
            Some(lease) => self.inner.store.append_and_lease(request, lease).await,
            None => self.inner.store.append(request).await.map(|()| Vec::new()),
        };
        crate::stages::mark("append.durable");
        // Dropped on a failure, the claim wakes its lease as an enqueue would.
        let mut leases = match appended {
            Ok(leases) => {
                *guard = stepped;
                leases
            }
            Err(e) => {
                if is_start {
                    if let Error::Conflict { .. } = e {
                        // The session exists: a start is never retried.
                        return Err(Error::InvalidEvent {
                            session_id: session_id.to_owned(),
                            seq: first_seq,
                            reason: "the session already exists".to_owned(),
                        });
                    }
                }
                return Err(e);
            }
        };
        // A task leased with the append has its worker already: waking another for it
        // would only make an empty lease.
        enqueued.retain(|task| !leases.iter().any(|lease| lease.id == task.id));
        if let Some(claim) = claim {
            if leases.is_empty() {
                // The claim wakes its lease for its task, as the wake below would.
                enqueued.retain(|task| !claim.is_for(&task.id));
            }
            let leases = std::mem::take(&mut leases);
            match claim.receiver() {
                Some(receiver) if !leases.is_empty() => {
                    let left = self.give_to_receiver(receiver.as_ref(), guard.as_ref(), leases);
                    if left.is_empty() {
                        claim.received();
                    } else {
                        claim.hand(left);
                    }
                }
                _ => claim.hand(leases),
            }
        }
        self.inner.waiters.wake_for(&enqueued);
        self.publish(session_id, published.unwrap_or_default(), outcome);
        crate::stages::mark("append.published");
        Ok((Some(first_seq), leases))
    }
}

/// The error of a stored history that does not fold. The workflow's refusal of a stored event
/// ([`Error::InvalidEvent`]) or of its transcript ([`Error::Ledger`]) is the history's fault,
/// not the caller's: it reads as [`Error::HistoryUnreadable`], so that nobody takes it for a
/// refusal of their own request (a server answers it 500 `history_unreadable`, not 409 or
/// 400), and trying again reads the same.
fn does_not_fold(session_id: &str, error: Error) -> Error {
    match error {
        Error::InvalidEvent { seq, reason, .. } => Error::HistoryUnreadable {
            session_id: session_id.to_owned(),
            reason: format!("stored event {seq} does not fold: {reason}"),
        },
        Error::Ledger(e) => Error::HistoryUnreadable {
            session_id: session_id.to_owned(),
            reason: format!("its stored transcript breaks the ledger's rules: {e}"),
        },
        other => other,
    }
}

/// Steps `state` with each input in turn, recorded at `now`, and puts their transitions
/// together: every event, task to enqueue and task to cancel, and the last outcome. On an
/// error the state may have taken the inputs before it.
fn step_all(
    state: &mut SessionState,
    session_id: &str,
    now: u64,
    inputs: Vec<Event>,
) -> Result<Transition> {
    let mut all: Option<Transition> = None;
    for input in inputs {
        let seq = state.next_seq;
        debug!(event = input.kind(), seq, "step");
        let transition = state.step(EventEnvelope::new(session_id, seq, now, input))?;
        match &mut all {
            None => all = Some(transition),
            Some(all) => {
                all.events.extend(transition.events);
                all.commands.extend(transition.commands);
                all.enqueue.extend(transition.enqueue);
                all.cancel.extend(transition.cancel);
                if transition.outcome.is_some() {
                    all.outcome = transition.outcome;
                }
            }
        }
    }
    all.ok_or_else(|| Error::InvalidEvent {
        session_id: session_id.to_owned(),
        seq: state.next_seq,
        reason: "no input to record".to_owned(),
    })
}

/// The event that records a failed attempt of `activity`, its known usage priced by
/// `prices`.
fn failed_event(
    prices: &PriceTable,
    activity: ScheduledActivity,
    failure: ActivityFailure,
) -> Event {
    match activity {
        ScheduledActivity::Model {
            turn,
            round,
            attempt,
            model,
            ..
        } => Event::ModelCallFailed {
            turn,
            round,
            attempt,
            cost_micros: failure
                .usage
                .and_then(|usage| prices.cost(&model.provider, &model.model, &usage)),
            failure,
        },
        ScheduledActivity::Summary {
            turn,
            attempt,
            model,
            ..
        } => Event::SummaryCallFailed {
            turn,
            attempt,
            cost_micros: failure
                .usage
                .and_then(|usage| prices.cost(&model.provider, &model.model, &usage)),
            failure,
        },
        ScheduledActivity::Tool {
            turn,
            attempt,
            tool_use,
            ..
        } => Event::ToolCallFailed {
            turn,
            tool_use_id: tool_use.id,
            attempt,
            failure,
        },
    }
}

/// The status a session with this folded state lists with.
pub fn status_of(state: &SessionState) -> SessionStatus {
    if state.cancelled {
        SessionStatus::Cancelled
    } else if state.is_running() {
        SessionStatus::Running
    } else {
        SessionStatus::Idle
    }
}

fn outcome_for(state: &SessionState, turn: u32) -> Option<TurnOutcome> {
    match &state.last_outcome {
        Some(o) if o.turn() >= turn => Some(o.clone()),
        _ => None,
    }
}
