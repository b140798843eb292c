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

#[path = "engine_idempotent.rs"]
mod idempotent;

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::event::ErrorClass;
use crate::event::{ActivityFailure, Event, EventEnvelope, SessionStarted};
use crate::pricing::PriceTable;
use crate::state_cache::{SessionSlot, StateCache};
use crate::store::{
    AppendRequest, Lease, LeaseHolder, LeaseRequest, Overdue, SessionInfo, SessionStatus, Store,
    StoreChange, Task, TaskFence, TaskFilter, TaskId,
};
use crate::task_waiters::{TaskReceiver, TaskWaiters};
use crate::workflow::{ScheduledActivity, SessionState, Transition, TurnOutcome};
use cairn_ledger::{
    Delta, JsonText, Media, ModelResponse, ModelSpec, ToolResultContent, ToolSpec, ToolUse,
    Transcript,
};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{broadcast, watch};
use tracing::{debug, info, info_span, warn, Instrument};

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
        transcript: Arc<Transcript>,
        /// Tools offered, shared with the session's state (not copied per call).
        tools: Arc<[ToolSpec]>,
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

/// Whose lease waits for tasks ([`Engine::lease_tasks_waiting`]).
enum WaitingFor {
    /// A worker elsewhere: a server's long poll.
    Remote,
    /// A worker of this process, with where an append gives the tasks it leases for it, if
    /// not to the lease itself.
    InProcess(Option<Arc<dyn TaskReceiver>>),
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

/// Overdue tasks one round of timers records at most (besides those that failed last round).
const TIMER_BATCH: usize = 256;

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

    /// Leases like [`Engine::lease_tasks_for`], waiting until `deadline` for the first task if
    /// none is due (a long poll). An enqueue wakes one waiting lease per task, one whose
    /// filter accepts it; tasks queued by other processes wake every waiting lease. When
    /// `stop` completes during the wait, answers at once with no task.
    pub async fn lease_tasks_waiting(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        deadline: tokio::time::Instant,
        stop: impl std::future::Future<Output = ()>,
        holder: LeaseHolder,
    ) -> Result<Vec<LeasedTask>> {
        let waiting_for = match holder {
            LeaseHolder::InProcess => WaitingFor::InProcess(None),
            LeaseHolder::Remote => WaitingFor::Remote,
        };
        self.wait_for_tasks(filter, max, lease_ms, deadline, stop, waiting_for)
            .await
    }

    /// Leases like [`Engine::lease_tasks_waiting`] for a worker of this process, except that
    /// while it waits idle, the tasks an append of this engine queues (a client's message, a
    /// timer) are leased with that append and given to `receiver` at once, instead of
    /// waking this lease to return them: a worker pool's receiver starts each on a slot of
    /// its own, so the task's first step follows the append's sync without a wake of the
    /// pool's lease loop in between. This lease returns what it leases itself, and what
    /// `receiver` had no room for.
    pub async fn lease_tasks_waiting_receiving(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        deadline: tokio::time::Instant,
        receiver: Arc<dyn TaskReceiver>,
    ) -> Result<Vec<LeasedTask>> {
        let waiting_for = WaitingFor::InProcess(Some(receiver));
        self.wait_for_tasks(
            filter,
            max,
            lease_ms,
            deadline,
            std::future::pending(),
            waiting_for,
        )
        .await
    }

    // A long poll waits on real time.
    #[allow(clippy::disallowed_methods)]
    async fn wait_for_tasks(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        deadline: tokio::time::Instant,
        stop: impl std::future::Future<Output = ()>,
        waiting_for: WaitingFor,
    ) -> Result<Vec<LeasedTask>> {
        tokio::pin!(stop);
        let waiters = &self.inner.waiters;
        // A worker of this process may be handed the tasks an append queues, leased with it
        // (`TaskWaiters::claim`); what a lease that stopped waiting was handed goes to its next
        // lease (`Engine::lease_tasks_for`).
        let (holder, in_process) = match waiting_for {
            WaitingFor::InProcess(receiver) => (
                LeaseHolder::InProcess,
                Some((Arc::new(filter.clone()), receiver)),
            ),
            WaitingFor::Remote => (LeaseHolder::Remote, None),
        };
        let register = || match &in_process {
            Some((shared, receiver)) => {
                waiters.register_in_process(shared, max, lease_ms, receiver.clone())
            }
            None => waiters.register(filter),
        };
        // Registered before leasing, so an enqueue between an empty lease and the wait wakes it.
        let mut waiter = register();
        let mut leased = self.lease_tasks_for(holder, filter, max, lease_ms).await?;
        loop {
            if !leased.is_empty() || tokio::time::Instant::now() >= deadline {
                // A wake this waiter got may be for a task queued after the lease looked: it
                // passes on every wake whose task it did not take.
                waiter.leased(leased.iter().map(|task| &task.lease.id));
                return Ok(leased);
            }
            waiter.idle();
            tokio::select! {
                _ = waiter.woken() => {}
                _ = tokio::time::sleep_until(deadline) => {}
                // Dropped, the waiter passes its wakes (and any leases handed to it) on.
                _ = &mut stop => return Ok(Vec::new()),
            }
            let handed = waiter.take_handed();
            if !handed.is_empty() {
                let leased = self.with_activities(handed).await;
                waiter.leased(leased.iter().map(|task| &task.lease.id));
                return Ok(leased);
            }
            let woken = waiter;
            waiter = register();
            leased = self.lease_tasks_for(holder, filter, max, lease_ms).await?;
            // The woken waiter's wakes came before this lease looked.
            woken.leased_after_wake(
                leased.iter().map(|task| &task.lease.id),
                leased.len() >= max,
            );
        }
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
            None,
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
            None,
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
            None,
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
            None,
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
            None,
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
                None,
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
            None,
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

    /// What a leased task should run; `None` when the workflow no longer wants it (the task is
    /// then removed from the queue).
    pub async fn activity(&self, lease: &Lease) -> Result<Option<ActivityInput>> {
        let session_id = &lease.id.session_id;
        let slot = self.slot(session_id);
        let mut guard = slot.lock().await;
        // This engine applies its own appends to its cached state, so a cached state that
        // holds the task's scheduling and heard of no append elsewhere since answers without
        // a read: the common case, a task this engine queued. Otherwise, and before a task is
        // dropped as unwanted, the state catches up with the store first.
        let cached = guard
            .as_ref()
            .filter(|state| lease.id.scheduled_seq < state.next_seq && !self.heard_ahead(state))
            .and_then(|state| activity_input(state, lease));
        let input = match cached {
            Some(input) => Some(input),
            None => activity_input(self.loaded(session_id, &mut guard).await?, lease),
        };
        drop(guard);
        if input.is_none() {
            self.discard_task(lease).await?;
        }
        Ok(input)
    }

    /// Leases up to `max` due tasks that `filter` accepts, each for `lease_ms`, with what they
    /// run, durably (for any worker: see [`Engine::lease_tasks_for`]). Tasks the workflow no
    /// longer wants are dropped on the way and not returned.
    pub async fn lease_tasks(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
    ) -> Result<Vec<LeasedTask>> {
        self.lease_tasks_for(LeaseHolder::Remote, filter, max, lease_ms)
            .await
    }

    /// Leases like [`Engine::lease_tasks`] for a worker of `holder`'s kind: a lease for a
    /// worker of this process may be handed out before it is durable
    /// ([`Store::lease_tasks_in_process`]), and takes first the leases an append handed to a
    /// waiting lease of the same filter that stopped waiting ([`Engine::lease_tasks_waiting`]).
    pub async fn lease_tasks_for(
        &self,
        holder: LeaseHolder,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
    ) -> Result<Vec<LeasedTask>> {
        if holder == LeaseHolder::InProcess {
            let orphans = self.inner.waiters.take_orphans(filter, max);
            if !orphans.is_empty() {
                return Ok(self.with_activities(orphans).await);
            }
        }
        let store = &self.inner.store;
        let now_ms = self.now_ms();
        let leases = match holder {
            LeaseHolder::InProcess => {
                store
                    .lease_tasks_in_process(now_ms, lease_ms, max, filter)
                    .await?
            }
            LeaseHolder::Remote => store.lease_tasks(now_ms, lease_ms, max, filter).await?,
        };
        Ok(self.with_activities(leases).await)
    }

    /// Gives `receiver` the leases an append just took for a claimed lease, each with what it
    /// runs as `state` (the appending session's, current: the append is durable) schedules
    /// it; returns the leases it did not take, and those of tasks `state` does not say how to
    /// run (another session's, leased with the append), for the lease itself, which finds
    /// out as it would have.
    fn give_to_receiver(
        &self,
        receiver: &dyn TaskReceiver,
        state: Option<&SessionState>,
        leases: Vec<Lease>,
    ) -> Vec<Lease> {
        let mut left = Vec::new();
        let mut tasks = Vec::with_capacity(leases.len());
        for lease in leases {
            let input = state
                .filter(|state| state.session_id == lease.id.session_id)
                .and_then(|state| activity_input(state, &lease));
            match input {
                Some(input) => tasks.push(LeasedTask { lease, input }),
                None => left.push(lease),
            }
        }
        if tasks.is_empty() {
            return left;
        }
        {
            let mut here = lock(&self.inner.leased_here);
            for task in &tasks {
                here.insert(
                    task.lease.id.clone(),
                    (task.lease.lease_attempt, task.lease.expires_at_ms),
                );
            }
        }
        // Given back, a lease goes to the lease itself, which records it here again.
        left.extend(receiver.receive(tasks).into_iter().map(|task| task.lease));
        left
    }

    /// The leases this engine handed out, each with what it runs; tasks the workflow no
    /// longer wants are dropped on the way and not returned.
    async fn with_activities(&self, leases: Vec<Lease>) -> Vec<LeasedTask> {
        if !leases.is_empty() {
            let mut here = lock(&self.inner.leased_here);
            for lease in &leases {
                here.insert(lease.id.clone(), (lease.lease_attempt, lease.expires_at_ms));
            }
        }
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            match self.activity(&lease).await {
                Ok(Some(input)) => out.push(LeasedTask { lease, input }),
                Ok(None) => {
                    debug!(task = %lease.id, "task no longer wanted; dropped");
                    lock(&self.inner.leased_here).remove(&lease.id);
                }
                // Its lease lapses and the timers record the attempt as failed.
                Err(e) => {
                    warn!(task = %lease.id, error = %e, "cannot load a leased task's activity");
                    lock(&self.inner.leased_here).remove(&lease.id);
                }
            }
        }
        out
    }

    /// Renews a lease for `lease_ms` from now (a heartbeat), storing `details` durably when
    /// given: if the attempt's lease later lapses, its failure carries them to the next
    /// attempt. Returns the new expiry; `LeaseLost` when the lease is no longer current (the
    /// task was cancelled or completed, or its lease lapsed), and the worker should stop.
    pub async fn heartbeat(
        &self,
        lease: &Lease,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        let expires_at_ms = self
            .inner
            .store
            .extend_lease(
                &lease.id,
                lease.lease_attempt,
                self.now_ms(),
                lease_ms,
                details,
            )
            .await?;
        if let Some(entry) = lock(&self.inner.leased_here).get_mut(&lease.id) {
            if entry.0 == lease.lease_attempt {
                entry.1 = expires_at_ms;
            }
        }
        Ok(expires_at_ms)
    }

    /// The leases this engine handed out that have neither been reported nor run out, by
    /// task and attempt (a draining server waits for these). Forgets the ones that ran out.
    pub fn leases_held_here(&self) -> Vec<(TaskId, u32)> {
        let now = self.now_ms();
        let mut here = lock(&self.inner.leased_here);
        here.retain(|_, (_, expires_at_ms)| *expires_at_ms > now);
        here.iter()
            .map(|(id, (attempt, _))| (id.clone(), *attempt))
            .collect()
    }

    /// Fires the durable timers that are due: every overdue task ([`Task::overdue`]) — a
    /// lease that lapsed because its worker stopped heartbeating, or an attempt no worker
    /// started before its schedule-to-start deadline — is recorded as a failed attempt
    /// (`timeout`) and dropped from the queue, so the retry policy decides what comes next.
    /// The deadlines are in the store, so they fire after a restart too, and no worker is
    /// needed to notice. Returns how many attempts it recorded as failed.
    pub async fn fire_timers(&self) -> Result<usize> {
        let now = self.now_ms();
        // Leases handed out here that ran out without a report (their worker stopped, or
        // dropped the task) are forgotten here, or they would be kept for the process's life.
        lock(&self.inner.leased_here).retain(|_, (_, expires_at_ms)| *expires_at_ms > now);
        // Tasks that failed to fire stay overdue and first in line; asking for that many more
        // keeps them (a session that cannot load, say) from starving the ones behind them.
        let stuck = lock(&self.inner.timers_stuck).len();
        let overdue = self
            .inner
            .store
            .overdue_tasks(now, TIMER_BATCH.saturating_add(stuck))
            .await?;
        let mut fired = 0;
        let mut failed = HashSet::new();
        for task in overdue {
            match self.record_overdue(&task, now).await {
                Ok(true) => fired += 1,
                Ok(false) => {}
                Err(e) if e.is_stale_report() => {}
                Err(e) => {
                    // Tried again every round (a session whose history does not fold stays
                    // so): said once as a warning, then only at debug level.
                    if lock(&self.inner.timers_stuck).contains(&task.id) {
                        debug!(task = %task.id, error = %e, "still cannot record an overdue task");
                    } else {
                        warn!(task = %task.id, error = %e, "cannot record an overdue task; it stays overdue and is tried again every round");
                    }
                    failed.insert(task.id);
                }
            }
        }
        *lock(&self.inner.timers_stuck) = failed;
        Ok(fired)
    }

    /// Runs [`Engine::fire_timers`] every `every` until `stop` completes.
    // The one place the engine waits on time: the timer loop of a server or host.
    #[allow(clippy::disallowed_methods)]
    pub async fn run_timers(
        &self,
        every: std::time::Duration,
        stop: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(stop);
        loop {
            if let Err(e) = self.fire_timers().await {
                warn!(error = %e, "firing timers failed");
            }
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    async fn record_overdue(&self, task: &Task, now: u64) -> Result<bool> {
        let Some(why) = task.overdue(now) else {
            return Ok(false);
        };
        let session_id = &task.id.session_id;
        if let Some(recorded) = self.deny_at_deadline(task).await? {
            return Ok(recorded);
        }
        let lease = Lease {
            id: task.id.clone(),
            kind: task.kind,
            lease_attempt: task.lease_attempt,
            expires_at_ms: task.visible_at_ms,
        };
        let message = match why {
            Overdue::LeaseLapsed => format!(
                "lease lapsed: the worker stopped renewing lease {} of task {}, which expired at {} ms",
                task.lease_attempt, task.id, task.visible_at_ms
            ),
            Overdue::NotStarted => format!(
                "schedule-to-start timeout: no worker started task {} on queue {:?} (needs {:?}) by its deadline at {} ms",
                task.id,
                task.queue,
                task.target,
                task.start_by_ms.unwrap_or_default()
            ),
        };
        let mut failure = ActivityFailure::new(ErrorClass::Timeout, message);
        failure.heartbeat_details = task.heartbeat_details.clone();
        let prices = self.prices();
        // The task is dropped with the failure only if it is still as `overdue_tasks` read
        // it: a worker may have leased it (its clock read before the deadline), renewed its
        // lease or had it released since, and that attempt is not the one timed out. Then
        // the append is refused (`LeaseLost`, skipped by `fire_timers`) and the next round
        // reads the task again.
        let submitted = self
            .submit_with(
                session_id,
                |state| match state.scheduled_activity(task.id.scheduled_seq) {
                    Some(activity) => Ok(Some(failed_event(&prices, activity, failure.clone()))),
                    None => Ok(None),
                },
                None,
                Some(TaskFence::of(task)),
                false,
            )
            .await?;
        if submitted.is_none() {
            // Unfenced: whoever may hold the task now, the workflow no longer wants its
            // result, so a report of it would be refused as stale anyway.
            self.discard_task(&lease).await?;
            return Ok(false);
        }
        Ok(true)
    }

    /// Fires an approval deadline: when `task` is the timer of a call that still waits for
    /// approval, records its denial (the transition drops the timer) and says so; otherwise
    /// `None`, and the task is an activity's (or a timer nothing waits on, dropped as one).
    /// The workflow checks that the deadline has passed by the event's time.
    async fn deny_at_deadline(&self, task: &Task) -> Result<Option<bool>> {
        let seq = task.id.scheduled_seq;
        let submitted = self
            .submit(
                &task.id.session_id,
                |state| {
                    Ok(state.approval_timer(seq).map(|parked| {
                        let deadline = parked.deadline_ms.unwrap_or_default();
                        Event::ToolCallDenied {
                            turn: parked.turn,
                            tool_use_id: parked.tool_use.id,
                            reason: format!(
                                "nobody approved it before its deadline at {deadline} ms"
                            ),
                            by_deadline: true,
                        }
                    }))
                },
                None,
            )
            .await?;
        Ok(submitted.map(|_| true))
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

    /// Records a worker's report for a leased task. A stale report is
    /// [`Error::StaleReport`] (the workflow already moved on) or [`Error::LeaseLost`] (the lease
    /// lapsed): the worker drops it, the history is unchanged.
    pub async fn report(&self, lease: &Lease, report: ActivityReport) -> Result<()> {
        self.report_with(lease, report, None).await.map(drop)
    }

    /// Reports like [`Engine::report`], and leases with the report's append up to
    /// `next.max` due tasks `next.filter` accepts for the same worker of this process (eager
    /// dispatch: the next task of a session goes to the worker that finished the last one,
    /// without a lease round of its own). The tasks come with what they run, like
    /// [`Engine::lease_tasks`]; they are handed out once the report is durable.
    pub async fn report_and_lease(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: &LeaseRequest,
    ) -> Result<Vec<LeasedTask>> {
        crate::stages::mark("report.start");
        let leases = self.report_with(lease, report, Some(next)).await?;
        let handed = self.with_activities(leases).await;
        crate::stages::mark("report.handed");
        Ok(handed)
    }

    async fn report_with(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: Option<&LeaseRequest>,
    ) -> Result<Vec<Lease>> {
        let session_id = &lease.id.session_id;
        {
            let mut here = lock(&self.inner.leased_here);
            if here
                .get(&lease.id)
                .is_some_and(|(attempt, _)| *attempt == lease.lease_attempt)
            {
                here.remove(&lease.id);
            }
        }
        let prices = self.prices();
        let (submitted, leases) = self
            .submit_inputs(
                session_id,
                |state| match state.scheduled_activity(lease.id.scheduled_seq) {
                    Some(activity) => report_event(&prices, lease, activity, report.clone())
                        .map(|event| Some(vec![event])),
                    None => Ok(None),
                },
                Some((lease.id.clone(), lease.lease_attempt)),
                None,
                false,
                next,
            )
            .await?;
        if submitted.is_none() {
            // Nothing will run it again, so the queue drops it; the report itself changes nothing.
            self.discard_task(lease).await?;
            return Err(Error::StaleReport {
                session_id: session_id.clone(),
                seq: lease.id.scheduled_seq,
                reason: format!("the workflow no longer waits for task {}", lease.id),
            });
        }
        Ok(leases)
    }

    /// Records what a leased model attempt streamed since its previous record, as a
    /// `model_attempt_progress` event (presentation only). It goes through the same append
    /// path as everything else, so it shares the store's group-commit flushes. Stale progress —
    /// the workflow no longer waits for this attempt, or a newer lease of it already recorded
    /// output — is rejected with [`Error::StaleReport`] (see [`Error::is_stale_report`]) and changes
    /// nothing; the attempt itself goes on.
    pub async fn record_progress(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
    ) -> Result<()> {
        self.record_progress_with_usage(lease, text_appended, thinking_appended, None)
            .await
    }

    /// [`Engine::record_progress`] with the usage the run's stream reported so far, priced
    /// now and recorded with it: if the run is lost, it is what is known of its usage.
    pub async fn record_progress_with_usage(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
        usage: Option<cairn_ledger::Usage>,
    ) -> Result<()> {
        let session_id = &lease.id.session_id;
        let prices = self.prices();
        // The workflow checks the attempt again when it steps, so a completion that lands
        // in between makes this progress stale rather than misplaced.
        self.submit(
            session_id,
            |state| match state.scheduled_activity(lease.id.scheduled_seq) {
                Some(ScheduledActivity::Model {
                    turn,
                    round,
                    attempt,
                    model,
                    ..
                }) => Ok(Some(Event::ModelAttemptProgress {
                    turn,
                    round,
                    attempt,
                    lease_attempt: lease.lease_attempt,
                    text_appended: text_appended.clone(),
                    thinking_appended: thinking_appended.clone(),
                    usage,
                    cost_micros: usage.and_then(|u| prices.cost(&model.provider, &model.model, &u)),
                })),
                _ => Err(Error::StaleReport {
                    session_id: session_id.clone(),
                    seq: lease.id.scheduled_seq,
                    reason: format!(
                        "progress of task {} for a model call the workflow no longer waits for",
                        lease.id
                    ),
                }),
            },
            None,
        )
        .await?;
        Ok(())
    }

    /// Finds every session with a turn in progress, loads it, and makes sure each of its
    /// outstanding activities has a queued task (they normally do: tasks are written with their
    /// events). Lapsed leases need nothing here: [`Engine::fire_timers`] records them as failed
    /// attempts and the retry policy schedules the next.
    ///
    /// With `reclaim_leases`, first releases every lease in the store
    /// ([`Store::release_leases`]), so tasks leased by workers of a dead process run again at
    /// once, as the same attempt, rather than fail as lapsed leases. Only for a store no other process can hold
    /// leases on (an embedded store the OS locks to this process, like sled); on a shared
    /// store ([`Store::shared`]) it is ignored and leases lapse.
    ///
    /// A running session whose history does not fold ([`Error::is_history_fault`]) is listed
    /// in [`ResumeReport::unresumable`] and skipped; the store's own failures are errors.
    pub async fn resume(&self, reclaim_leases: bool) -> Result<ResumeReport> {
        self.resume_where(reclaim_leases, |_| true).await
    }

    /// [`Engine::resume`] for one session only: if its turn is in progress, makes sure each of
    /// its outstanding activities has a queued task. Other sessions' histories and tasks are
    /// left as they are, except that `reclaim_leases` releases every lease in the store (the
    /// store releases leases only all at once); that changes no history, and a pool that runs
    /// only this session's tasks leaves the others queued. A history that does not fold is
    /// this call's error.
    pub async fn resume_session(
        &self,
        session_id: &str,
        reclaim_leases: bool,
    ) -> Result<ResumeReport> {
        let report = self
            .resume_where(reclaim_leases, |id| id == session_id)
            .await?;
        if !report.unresumable.is_empty() {
            // The one session asked for: its own typed error, not a report entry.
            self.state(session_id).await?;
        }
        Ok(report)
    }

    async fn resume_where(
        &self,
        reclaim_leases: bool,
        wanted: impl Fn(&str) -> bool,
    ) -> Result<ResumeReport> {
        let mut report = ResumeReport::default();
        // On a store other processes write, a lease may be a live worker's elsewhere:
        // releasing it would hand its task out twice. There leases only lapse.
        if reclaim_leases && !self.inner.store.shared() {
            report.reclaimed_leases = self.inner.store.release_leases(self.now_ms()).await?;
        }
        // Each running session's state first, then the queue: a task is missing only if the
        // state read before the listing has it outstanding and the listing lacks it. Listed
        // first, the queue could miss a task another engine on the same store scheduled
        // after the listing and before the state was read, and queueing it again would hand
        // its lease out twice. Should the session move on after its state was read, the
        // append that queues its missing tasks conflicts and is dropped: its tasks are then
        // the latest events' to queue.
        let mut running = Vec::new();
        for info in self.inner.store.list_sessions().await? {
            if info.status != SessionStatus::Running || !wanted(&info.session_id) {
                continue;
            }
            let session_id = info.session_id;
            let slot = self.slot(&session_id);
            let mut guard = slot.lock().await;
            let state = match self.loaded(&session_id, &mut guard).await {
                Ok(state) => state,
                // Deleted since the listing: nothing of it runs any more.
                Err(Error::UnknownSession { .. } | Error::SessionDeleted { .. }) => continue,
                Err(e) if e.is_history_fault() => {
                    tracing::error!(
                        session_id = %session_id,
                        error = %e,
                        "cannot resume a session: its history does not fold with this code"
                    );
                    report.unresumable.push(UnresumableSession {
                        session_id,
                        error: e.to_string(),
                    });
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut outstanding = Vec::new();
            for seq in state.outstanding_tasks() {
                report.outstanding_tasks += 1;
                if let Some(mut task) = state.queued_task(seq) {
                    // An approval deadline keeps its time: visible early, it would be
                    // leased like an activity.
                    if state.approval_timer(seq).is_none() {
                        task.visible_at_ms = 0;
                    }
                    outstanding.push(task);
                }
            }
            running.push((session_id, state.next_seq, status_of(state), outstanding));
        }
        let queued: BTreeSet<TaskId> = self
            .inner
            .store
            .list_tasks()
            .await?
            .into_iter()
            .map(|t| t.id)
            .collect();
        for (session_id, next_seq, status, outstanding) in running {
            let missing: Vec<_> = outstanding
                .into_iter()
                .filter(|task| !queued.contains(&task.id))
                .collect();
            if !missing.is_empty() {
                let slot = self.slot(&session_id);
                let mut guard = slot.lock().await;
                let count = missing.len();
                let request = AppendRequest {
                    enqueue: missing,
                    ..AppendRequest::new(
                        session_id.clone(),
                        next_seq,
                        Vec::new(),
                        status,
                        self.now_ms(),
                    )
                };
                match self.inner.store.append(request).await {
                    Ok(()) => report.requeued_tasks += count,
                    Err(Error::Conflict { .. }) => *guard = None,
                    // Deleted by another process since its state was read: nothing runs.
                    Err(Error::SessionDeleted { .. } | Error::UnknownSession { .. }) => {
                        *guard = None;
                        continue;
                    }
                    Err(e) => {
                        *guard = None;
                        return Err(e);
                    }
                }
            }
            report.running_sessions.push(session_id);
        }
        self.inner.waiters.wake_all();
        Ok(report)
    }

    fn slot(&self, session_id: &str) -> SessionSlot {
        let mut sessions = lock(&self.inner.sessions);
        let (slot, purged) = sessions.slot(session_id);
        if purged {
            lock(&self.inner.heard_seqs).retain(|id, _| sessions.contains(id));
        }
        slot
    }

    /// Notes a change hint of a cached session (one not cached loads anew anyway).
    fn hear(&self, change: &StoreChange) {
        let cached = lock(&self.inner.sessions).contains(&change.session_id);
        if cached {
            let mut heard = lock(&self.inner.heard_seqs);
            let seq = heard.entry(change.session_id.clone()).or_default();
            *seq = (*seq).max(change.last_seq);
        }
    }

    /// Whether a hint said the session has events past the cached state's (then it is caught
    /// up before deciding); forgets hints the state has caught up with.
    fn heard_ahead(&self, state: &SessionState) -> bool {
        let mut heard = lock(&self.inner.heard_seqs);
        match heard.get(&state.session_id) {
            Some(&seq) if seq >= state.next_seq => true,
            Some(_) => {
                heard.remove(&state.session_id);
                false
            }
            None => false,
        }
    }

    /// A receiver of the session's outcomes, the channel created if nobody waited yet.
    fn outcome_wait(&self, session_id: &str) -> OutcomeWait {
        let rx = lock(&self.inner.outcomes)
            .entry(session_id.to_owned())
            .or_insert_with(|| watch::channel(None).0)
            .subscribe();
        OutcomeWait {
            engine: self.clone(),
            session_id: session_id.to_owned(),
            rx,
        }
    }

    /// How many entries the engine keeps per session, map by map (for tests and benches).
    #[doc(hidden)]
    pub fn per_session_entries(&self) -> PerSessionEntries {
        PerSessionEntries {
            sessions: lock(&self.inner.sessions).len(),
            outcomes: lock(&self.inner.outcomes).len(),
            watched: lock(&self.inner.watched).len(),
            heard_seqs: lock(&self.inner.heard_seqs).len(),
            leased_here: lock(&self.inner.leased_here).len(),
        }
    }

    /// How many leases wait idle for tasks here ([`Engine::lease_tasks_waiting`]: their look
    /// at the store found nothing). For tests that need a pool waiting before they append.
    #[doc(hidden)]
    pub fn idle_leases(&self) -> usize {
        self.inner.waiters.idle()
    }

    /// Whether the session's folded state is cached.
    #[cfg(test)]
    pub(crate) fn holds_state(&self, session_id: &str) -> bool {
        lock(&self.inner.sessions)
            .peek(session_id)
            .is_some_and(|slot| slot.try_lock().is_some_and(|state| state.is_some()))
    }

    /// Sets how many session states are cached before parked ones nobody holds are dropped,
    /// least recently used first ([`CACHE_CAPACITY`] by default). Set it on a new engine,
    /// before it is cloned: on an engine already shared it changes nothing.
    pub fn with_cache_capacity(self, capacity: usize) -> Self {
        self.with_cache(|cache| cache.set_capacity(capacity))
    }

    /// Sets how many bytes the cached session states may hold
    /// ([`SessionState::approx_bytes`]) before parked ones nobody holds are dropped, least
    /// recently used first ([`CACHE_BYTES`] by default). Set it on a new engine, before it is
    /// cloned: on an engine already shared it changes nothing.
    pub fn with_cache_bytes(self, bytes: usize) -> Self {
        self.with_cache(|cache| cache.set_byte_budget(bytes))
    }

    /// Changes the state cache's settings while the engine is not shared yet.
    fn with_cache(mut self, change: impl FnOnce(&mut StateCache)) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            change(match inner.sessions.get_mut() {
                Ok(cache) => cache,
                Err(poisoned) => poisoned.into_inner(),
            });
        }
        self
    }

    /// What the cache of session states holds, and its bounds.
    pub fn cache_stats(&self) -> crate::wire::StateCacheStats {
        let cache = lock(&self.inner.sessions);
        crate::wire::StateCacheStats {
            sessions: cache.len() as u64,
            bytes: cache.bytes() as u64,
            max_sessions: cache.capacity() as u64,
            max_bytes: cache.byte_budget() as u64,
        }
    }

    /// The session's state, caught up with the store: a cached state reads only the events
    /// appended after its next seq (by another writer: this engine's own appends are applied
    /// as they are made), and publishes them to subscribers and waiters as its own appends
    /// are; a miss folds the whole history.
    async fn loaded<'a>(
        &self,
        session_id: &str,
        guard: &'a mut Option<SessionState>,
    ) -> Result<&'a mut SessionState> {
        match guard {
            None => {
                let events = self.inner.store.read_history(session_id, 1, None).await?;
                *guard = Some(
                    SessionState::fold(session_id, &events)
                        .map_err(|e| does_not_fold(session_id, e))?,
                );
            }
            Some(state) => {
                let events = match self
                    .inner
                    .store
                    .read_history(session_id, state.next_seq, None)
                    .await
                {
                    Ok(events) => events,
                    // A session being started has nothing stored yet.
                    Err(Error::UnknownSession { .. }) if state.next_seq == 1 => Vec::new(),
                    Err(e) => {
                        *guard = None;
                        return Err(e);
                    }
                };
                if !events.is_empty() {
                    if let Err(e) = self.apply_foreign(state, events) {
                        *guard = None;
                        return Err(does_not_fold(session_id, e));
                    }
                }
            }
        }
        guard.as_mut().ok_or_else(|| Error::UnknownSession {
            session_id: session_id.to_owned(),
        })
    }

    /// Applies events another writer appended to a cached state, then tells subscribers and
    /// turn waiters as if this engine had appended them.
    fn apply_foreign(&self, state: &mut SessionState, events: Vec<EventEnvelope>) -> Result<()> {
        let outcome_before = state.last_outcome.as_ref().map(TurnOutcome::turn);
        for event in &events {
            state.apply(event)?;
        }
        state.finish_replay()?;
        debug!(
            session_id = %state.session_id,
            events = events.len(),
            "caught up with appends of another writer"
        );
        let outcome = state
            .last_outcome
            .clone()
            .filter(|o| Some(o.turn()) != outcome_before);
        self.publish(&state.session_id, events, outcome);
        Ok(())
    }

    /// Tells event subscribers and turn waiters what was appended.
    fn publish(&self, session_id: &str, events: Vec<EventEnvelope>, outcome: Option<TurnOutcome>) {
        if self.inner.appended.receiver_count() > 0 {
            // No subscriber left is fine: they read the store when they come back.
            let _ = self.inner.appended.send(Arc::new(AppendedEvents {
                session_id: session_id.to_owned(),
                events,
            }));
        }
        if let Some(outcome) = outcome {
            // Only waiters have a channel: with none, the outcome is in the state.
            if let Some(tx) = lock(&self.inner.outcomes).get(session_id) {
                tx.send_if_modified(|current| {
                    if current.as_ref() != Some(&outcome) {
                        *current = Some(outcome);
                        true
                    } else {
                        false
                    }
                });
            }
        }
    }

    /// Marks a session as watched while the guard lives: [`Engine::follow_store`] then reads
    /// what other writers append to it, so its waiters and followers hear of it.
    pub fn watch(&self, session_id: &str) -> WatchGuard {
        let slot = self.slot(session_id);
        let seen = slot.known_to_have_events();
        let mut watched = lock(&self.inner.watched);
        let entry = watched
            .entry(session_id.to_owned())
            .or_insert_with(|| (0, slot, false));
        entry.0 += 1;
        entry.2 |= seen;
        WatchGuard {
            engine: self.clone(),
            session_id: session_id.to_owned(),
        }
    }

    /// Reads a watched session's foreign appends, if any (see [`Engine::loaded`]); with
    /// `hinted_seq`, only when the cached state does not have that seq yet (the hint of an
    /// append this engine made, or one it caught up with, needs no read).
    async fn refresh(&self, session_id: &str, hinted_seq: Option<u64>) {
        let slot = self.slot(session_id);
        let mut guard = slot.lock().await;
        if let (Some(state), Some(seq)) = (guard.as_ref(), hinted_seq) {
            if seq < state.next_seq {
                return;
            }
        }
        let fresh = guard.is_none();
        let loaded = self.loaded(session_id, &mut guard).await;
        if let Ok(state) = &loaded {
            if state.next_seq > 1 {
                if let Some(entry) = lock(&self.inner.watched).get_mut(session_id) {
                    entry.2 = true;
                }
            }
        }
        match loaded {
            Ok(state) if fresh => {
                // Loaded anew, so what is new to its followers is unknown: the last event
                // makes any follower behind it read the store, and the outcome is as folded.
                let last = self
                    .inner
                    .store
                    .read_history(session_id, state.next_seq.saturating_sub(1), Some(1))
                    .await
                    .unwrap_or_default();
                let outcome = state.last_outcome.clone();
                self.publish(session_id, last, outcome);
            }
            Ok(_) => {}
            // It had events while watched (here, or in the state cached when the watch began)
            // and has none now: another process deleted it. Its followers end as if this
            // engine had deleted it. A session not created yet is not taken for deleted.
            Err(Error::UnknownSession { .. })
                if !fresh
                    || lock(&self.inner.watched)
                        .get(session_id)
                        .is_some_and(|entry| entry.2) =>
            {
                info!(
                    session_id,
                    "a watched session was deleted by another process"
                );
                drop(guard);
                self.forget(session_id);
            }
            Err(Error::UnknownSession { .. }) => {}
            Err(e) => debug!(session_id, error = %e, "cannot read a watched session"),
        }
    }

    /// Follows what other writers do to the store until `stop` completes: on every hint
    /// ([`Store::subscribe_changes`]) and every `poll` (hints may be lost), reads the appends
    /// of the watched sessions ([`Engine::watch`]: turn waiters, event followers) and wakes
    /// leasing waiters when tasks may have been queued elsewhere. Needed only when the store
    /// is shared with other processes ([`Store::shared`]) or other engines.
    // Polling is the one other place the engine waits on time.
    #[allow(clippy::disallowed_methods)]
    pub async fn follow_store(
        &self,
        poll: std::time::Duration,
        stop: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(stop);
        let mut changes = self.inner.store.subscribe_changes();
        let mut ticker = tokio::time::interval(poll);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let hint = async {
                match changes.as_mut() {
                    Some(rx) => Some(rx.recv().await),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut stop => break,
                _ = ticker.tick() => {
                    self.inner.waiters.wake_all();
                    self.refresh_watched().await;
                }
                received = hint => match received {
                    Some(Ok(change)) => {
                        if change.enqueued {
                            self.inner.waiters.wake_all();
                        }
                        self.hear(&change);
                        let watched = lock(&self.inner.watched).contains_key(&change.session_id);
                        if watched {
                            self.refresh(&change.session_id, Some(change.last_seq)).await;
                        }
                    }
                    Some(Err(broadcast::error::RecvError::Lagged(_))) => {
                        self.inner.waiters.wake_all();
                        self.refresh_watched().await;
                    }
                    Some(Err(broadcast::error::RecvError::Closed)) | None => changes = None,
                },
            }
        }
    }

    /// Reads the appends of the watched sessions that moved: one read of their records
    /// ([`Store::sessions_named`]) says which did, and only those (and those without a record:
    /// deleted, or not created yet) have their histories read, so a poll of many idle
    /// followed sessions costs the store one query, not one per session.
    pub(crate) async fn refresh_watched(&self) {
        let sessions: Vec<String> = lock(&self.inner.watched).keys().cloned().collect();
        if sessions.is_empty() {
            return;
        }
        let heads: HashMap<String, u64> = match self.inner.store.sessions_named(&sessions).await {
            Ok(infos) => infos
                .into_iter()
                .map(|info| (info.session_id, info.events))
                .collect(),
            Err(e) => {
                debug!(error = %e, "cannot read the watched sessions' records; reading each");
                HashMap::new()
            }
        };
        for session_id in sessions {
            // A known last seq reads only when the cached state lacks it.
            let last_seq = heads.get(&session_id).copied();
            self.refresh(&session_id, last_seq).await;
        }
    }

    /// Steps the workflow with the input `decide` makes of the session's current state, and
    /// appends the transition atomically (see [`Engine::submit_with`]).
    async fn submit(
        &self,
        session_id: &str,
        decide: impl FnMut(&SessionState) -> Result<Option<Event>> + Send,
        complete: Option<(TaskId, u32)>,
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
        complete: Option<(TaskId, u32)>,
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
        complete: Option<(TaskId, u32)>,
        drop_if_unchanged: Option<TaskFence>,
        starting: bool,
        eager: Option<&LeaseRequest>,
    ) -> Result<(Option<u64>, Vec<Lease>)> {
        let span = info_span!("session", session_id = %session_id);
        async move {
            let slot = self.slot(session_id);
            let mut guard = slot.lock().await;
            let mut conflicts = 0;
            loop {
                match self
                    .try_submit(
                        session_id,
                        &mut guard,
                        &mut decide,
                        (&complete, &drop_if_unchanged),
                        starting,
                        eager,
                    )
                    .await
                {
                    // The session changed under us: the state was dropped, so the next try
                    // reloads it with the other writer's events and decides again.
                    Err(Error::Conflict { .. })
                        if conflicts < CONFLICT_RETRIES && guard.is_none() =>
                    {
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
        .instrument(span)
        .await
    }

    async fn try_submit(
        &self,
        session_id: &str,
        guard: &mut Option<SessionState>,
        decide: &mut (impl FnMut(&SessionState) -> Result<Option<Vec<Event>>> + Send),
        (complete, drop_if_unchanged): (&Option<(TaskId, u32)>, &Option<TaskFence>),
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
            complete: complete.clone(),
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
        // a lease of a worker of this process waiting for one of them has them leased with
        // the append and handed over, instead of asking the store again once woken.
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

/// What `lease`'s task runs, as `state` schedules it; `None` when the workflow does not want
/// it (any more).
fn activity_input(state: &SessionState, lease: &Lease) -> Option<ActivityInput> {
    let session_id = &lease.id.session_id;
    let started = state.started.as_ref()?;
    match state.scheduled_activity(lease.id.scheduled_seq) {
        Some(ScheduledActivity::Model {
            turn,
            round,
            attempt,
            model,
            options,
            not_before_ms,
            heartbeat_details,
        }) => Some(ActivityInput::Model {
            origin: ActivityRef {
                session_id: session_id.clone(),
                turn,
                activity: format!("model:{round}"),
                attempt,
            },
            round,
            model,
            transcript: state.transcript.clone(),
            tools: started.tools.clone(),
            timeouts: ActivityTimeouts::of(&started.model_retry, not_before_ms),
            heartbeat_details,
            options,
        }),
        Some(ScheduledActivity::Summary {
            turn,
            round,
            attempt,
            model,
            not_before_ms,
            keep_last_turns,
        }) => Some(ActivityInput::Model {
            origin: ActivityRef {
                session_id: session_id.clone(),
                turn,
                activity: format!("summary:{round}"),
                attempt,
            },
            round,
            model,
            transcript: Arc::new(cairn_ledger::summary_request(
                &state.transcript,
                keep_last_turns,
            )),
            // Older turns may hold tool blocks, which providers accept only with tools.
            tools: started.tools.clone(),
            timeouts: ActivityTimeouts::of(&started.model_retry, not_before_ms),
            heartbeat_details: None,
            // A summary is plain text: no forced tool call, no server tools.
            options: cairn_ledger::CallOptions::default(),
        }),
        Some(ScheduledActivity::Tool {
            turn,
            attempt,
            tool_use,
            not_before_ms,
            heartbeat_details,
        }) => Some(ActivityInput::Tool {
            origin: ActivityRef {
                session_id: session_id.clone(),
                turn,
                activity: format!("tool:{}", tool_use.id),
                attempt,
            },
            idempotency_key: format!("{session_id}/{}", tool_use.id),
            file_versions: if cairn_ledger::file_versions::wants_file_versions(&tool_use.name) {
                cairn_ledger::file_versions::file_versions(&state.transcript)
            } else {
                Vec::new()
            },
            tool_use,
            timeouts: ActivityTimeouts::of(&started.tool_retry, not_before_ms),
            heartbeat_details,
            workdir: started.workdir.clone(),
        }),
        None => None,
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

/// The event that records `report` for `activity`, the activity `lease` ran, a model
/// attempt's usage priced by `prices`.
fn report_event(
    prices: &PriceTable,
    lease: &Lease,
    activity: ScheduledActivity,
    report: ActivityReport,
) -> Result<Event> {
    Ok(match (activity, report) {
        (
            ScheduledActivity::Model {
                turn,
                round,
                attempt,
                model,
                ..
            },
            ActivityReport::ModelCompleted(response),
        ) => {
            // The model the provider says answered (a dated id), else the one asked for.
            let cost_micros = prices
                .cost(&model.provider, &response.model, &response.usage)
                .or_else(|| prices.cost(&model.provider, &model.model, &response.usage));
            Event::ModelCallCompleted {
                turn,
                round,
                attempt,
                response,
                cost_micros,
            }
        }
        (
            ScheduledActivity::Tool {
                turn,
                attempt,
                tool_use,
                ..
            },
            ActivityReport::ToolCompleted { content, is_error },
        ) => Event::ToolCallCompleted {
            turn,
            tool_use_id: tool_use.id,
            attempt,
            content,
            is_error,
        },
        (
            ScheduledActivity::Summary {
                turn,
                attempt,
                model,
                ..
            },
            ActivityReport::ModelCompleted(response),
        ) => {
            let usage = response.usage;
            let cost_micros = prices
                .cost(&model.provider, &response.model, &usage)
                .or_else(|| prices.cost(&model.provider, &model.model, &usage));
            let summary: String = response
                .parts
                .iter()
                .filter_map(|p| match p {
                    cairn_ledger::Part::Text { text, .. } => Some(text.as_str()),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("\n");
            if summary.trim().is_empty() {
                // Its usage is left out: a version 2 session would add it to its turn's usage,
                // which the code before did not (an empty summary counted nothing).
                Event::SummaryCallFailed {
                    turn,
                    attempt,
                    failure: ActivityFailure::new(
                        crate::event::ErrorClass::InvalidResponse,
                        "the summary call answered without text",
                    ),
                    cost_micros: None,
                }
            } else {
                Event::SummaryCallCompleted {
                    turn,
                    attempt,
                    summary,
                    usage: Some(usage),
                    cost_micros,
                }
            }
        }
        (activity, ActivityReport::Failed(failure)) => failed_event(prices, activity, failure),
        (activity, report) => {
            return Err(Error::InvalidEvent {
                session_id: lease.id.session_id.clone(),
                seq: lease.id.scheduled_seq,
                reason: format!("report {report:?} does not fit activity {activity:?}"),
            })
        }
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
