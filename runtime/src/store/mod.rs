//! The `Store` boundary: an append-only event log per session with optimistic concurrency, and
//! a task queue written in the same atomic step (a transactional outbox).
//!
//! The trait speaks in whole operations (append a batch with its task changes, read a range,
//! lease due tasks) so that a SQL backend implements each as one transaction.

use crate::error::Result;
use crate::event::EventEnvelope;
use async_trait::async_trait;
use cairn_ledger::JsonText;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt;

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod copy;
pub mod embedded;
#[cfg(test)]
mod engine_tests;
pub mod faulty;
mod files;
pub mod fjall;
mod keys;
pub(crate) use keys::missing_seq;
pub mod marks;
pub mod memory;
pub mod sled;
mod sync_times;
mod write_queue;

pub use sync_times::SyncTimes;

/// Which kind of activity a task runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// A model call.
    Model,
    /// A tool call.
    Tool,
}

/// A task is named by its session and the seq of the event that scheduled it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TaskId {
    /// Session.
    pub session_id: String,
    /// Seq of the `*Scheduled` event.
    pub scheduled_seq: u64,
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.session_id, self.scheduled_seq)
    }
}

/// The queue a task goes to when a session names none.
pub const DEFAULT_QUEUE: &str = "default";

fn default_queue() -> String {
    DEFAULT_QUEUE.to_owned()
}

/// A task to enqueue with an append.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewTask {
    /// Its id.
    pub id: TaskId,
    /// What it runs.
    pub kind: TaskKind,
    /// Not leasable before this time (epoch ms).
    pub visible_at_ms: u64,
    /// The queue it is routed on.
    pub queue: String,
    /// What a worker must host to run it: the tool's name for a tool task, the model's
    /// provider for a model task. Empty: any worker of the queue.
    pub target: String,
    /// The schedule-to-start deadline (epoch ms): a task no worker leased by then is no longer
    /// handed out; [`Store::overdue_tasks`] reports it, so the engine records the timeout.
    pub start_by_ms: Option<u64>,
}

impl NewTask {
    /// A task on the default queue that any worker may run, without a start deadline.
    pub fn new(id: TaskId, kind: TaskKind, visible_at_ms: u64) -> Self {
        NewTask {
            id,
            kind,
            visible_at_ms,
            queue: default_queue(),
            target: String::new(),
            start_by_ms: None,
        }
    }
}

/// A task as the queue holds it.
///
/// Records written before routing existed have no queue, target, deadline, holder flag or
/// details: they decode as on the default queue, for any worker, never held (so a lease they
/// carry is treated as released, as before).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// Its id.
    pub id: TaskId,
    /// What it runs.
    pub kind: TaskKind,
    /// Leasable from this time; while leased, this is the lease's expiry.
    pub visible_at_ms: u64,
    /// How many times it was leased; the current lease's fencing token.
    pub lease_attempt: u32,
    /// The queue it is routed on.
    #[serde(default = "default_queue")]
    pub queue: String,
    /// What a worker must host to run it (see [`NewTask::target`]); empty: anything.
    #[serde(default)]
    pub target: String,
    /// The schedule-to-start deadline, if any (see [`NewTask::start_by_ms`]).
    #[serde(default)]
    pub start_by_ms: Option<u64>,
    /// Whether a worker holds its lease: set by a lease, cleared by
    /// [`Store::release_leases`]. A held task past its expiry has a lapsed lease: its worker
    /// stopped heartbeating, and only [`Store::overdue_tasks`] reports it.
    #[serde(default)]
    pub held: bool,
    /// What the current lease last heartbeated, kept durably so that a lapsed attempt's
    /// progress reaches the next attempt.
    #[serde(default)]
    pub heartbeat_details: Option<JsonText>,
}

impl Task {
    /// A new task's record: never leased.
    pub fn queued(new: &NewTask) -> Self {
        Task {
            id: new.id.clone(),
            kind: new.kind,
            visible_at_ms: new.visible_at_ms,
            lease_attempt: 0,
            queue: new.queue.clone(),
            target: new.target.clone(),
            start_by_ms: new.start_by_ms,
            held: false,
            heartbeat_details: None,
        }
    }

    /// Why the task is overdue at `now_ms`, if it is: its lease lapsed, or no worker started it
    /// before its schedule-to-start deadline. An overdue task is never leased; the engine
    /// records the failed attempt and drops it.
    pub fn overdue(&self, now_ms: u64) -> Option<Overdue> {
        if self.held && self.visible_at_ms <= now_ms {
            return Some(Overdue::LeaseLapsed);
        }
        match self.start_by_ms {
            Some(deadline) if self.lease_attempt == 0 && deadline <= now_ms => {
                Some(Overdue::NotStarted)
            }
            _ => None,
        }
    }
}

/// Why a task is overdue (see [`Task::overdue`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overdue {
    /// A worker leased it and stopped renewing the lease before it ran out.
    LeaseLapsed,
    /// No worker leased it before its schedule-to-start deadline.
    NotStarted,
}

/// Which tasks a worker can run: its queues, and the tools and model providers it hosts.
/// `None` accepts anything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskFilter {
    /// Queues it serves.
    #[serde(default)]
    pub queues: Option<BTreeSet<String>>,
    /// Tools it hosts.
    #[serde(default)]
    pub tools: Option<BTreeSet<String>>,
    /// Model providers it hosts.
    #[serde(default)]
    pub providers: Option<BTreeSet<String>>,
    /// Only these sessions.
    #[serde(default)]
    pub sessions: Option<BTreeSet<String>>,
    /// Only sessions of this namespace: ids `NAMESPACE:...`, or, for `Some("")`, ids without
    /// a `:` (the default namespace).
    #[serde(default)]
    pub namespace: Option<String>,
}

impl TaskFilter {
    /// Accepts every task.
    pub fn any() -> Self {
        TaskFilter::default()
    }

    /// Whether a worker with this filter can run `task`.
    pub fn accepts(&self, task: &Task) -> bool {
        self.accepts_route(&task.id.session_id, task.kind, &task.queue, &task.target)
    }

    /// Whether a worker with this filter can run a task of `session_id` of this kind, queue
    /// and target ([`Task`]'s fields of the same names).
    pub fn accepts_route(
        &self,
        session_id: &str,
        kind: TaskKind,
        queue: &str,
        target: &str,
    ) -> bool {
        let in_set = |set: &Option<BTreeSet<String>>, name: &str| {
            set.as_ref().is_none_or(|set| set.contains(name))
        };
        let hosted = target.is_empty()
            || match kind {
                TaskKind::Tool => in_set(&self.tools, target),
                TaskKind::Model => in_set(&self.providers, target),
            };
        let in_namespace = match self.namespace.as_deref() {
            None => true,
            Some("") => !session_id.contains(':'),
            Some(namespace) => session_id
                .strip_prefix(namespace)
                .is_some_and(|rest| rest.starts_with(':')),
        };
        in_set(&self.queues, queue) && hosted && in_namespace && in_set(&self.sessions, session_id)
    }
}

/// Where the worker that will hold a lease runs: whether the lease must be durable before it
/// is handed out ([`Store::lease_tasks_in_process`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseHolder {
    /// A worker of this process, which dies with it.
    InProcess,
    /// A worker elsewhere (a worker process over HTTP), which outlives this process.
    Remote,
}

/// What to lease with an append ([`Store::append_and_lease`]): up to `max` tasks `filter`
/// accepts, each for `lease_ms`, for `holder`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRequest {
    /// Which tasks the worker can run; shared, as a pool sends the same one with every
    /// report (a filter holds sets of names, and copying them was about 1% of a busy
    /// process's CPU).
    pub filter: std::sync::Arc<TaskFilter>,
    /// How many at most.
    pub max: usize,
    /// For how long, from the append's `now_ms`.
    pub lease_ms: u64,
    /// Who takes them: a worker of this process may be answered before its lease is
    /// durable ([`Store::lease_tasks_in_process`]), a worker elsewhere may not.
    pub holder: LeaseHolder,
}

/// A task leased to a worker until `expires_at_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The task's id.
    pub id: TaskId,
    /// What it runs.
    pub kind: TaskKind,
    /// The fencing token: completions must present it.
    pub lease_attempt: u32,
    /// When the lease lapses unless renewed: from then on the task is overdue
    /// ([`Task::overdue`]), never leased again, and the engine records the attempt as failed.
    pub expires_at_ms: u64,
}

/// A session's status as listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    /// No turn running.
    Idle,
    /// A turn is running.
    Running,
    /// Cancelled; takes no more turns.
    Cancelled,
}

impl SessionStatus {
    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            SessionStatus::Idle => "idle",
            SessionStatus::Running => "running",
            SessionStatus::Cancelled => "cancelled",
        }
    }
}

/// A session as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// Session id.
    pub session_id: String,
    /// Status after the last append.
    pub status: SessionStatus,
    /// Events recorded (= the last seq).
    pub events: u64,
    /// Time of the last append (epoch ms).
    pub updated_at_ms: u64,
}

/// One atomic append: events, the session's new status, and task queue changes.
#[derive(Debug, Clone, PartialEq)]
pub struct AppendRequest {
    /// Session.
    pub session_id: String,
    /// The seq the first event must have (1 for a new session): optimistic concurrency.
    pub expected_next_seq: u64,
    /// Events with consecutive seqs starting at `expected_next_seq`; may be empty.
    pub events: Vec<EventEnvelope>,
    /// The session's status after the append.
    pub status: SessionStatus,
    /// Tasks to enqueue.
    pub enqueue: Vec<NewTask>,
    /// Tasks this append completes, each with the lease attempt that ran it (fencing): when
    /// any of those leases is not current, the whole append is refused with `LeaseLost` and
    /// nothing is written. More than one when an engine records several workers' reports of
    /// one session in one append.
    pub complete: Vec<(TaskId, u32)>,
    /// Tasks to drop without a lease check (the workflow no longer wants them).
    pub cancel: Vec<TaskId>,
    /// A task to drop only if it is still exactly as the caller read it (see [`TaskFence`]):
    /// the task of an overdue attempt the append records as failed. A timer reads the
    /// overdue tasks first and appends later, and a worker may lease the task (or renew its
    /// lease) in between; dropping it then would record a running attempt as timed out and
    /// take its task from under it. So when the task changed or is gone, the whole append is
    /// refused with `LeaseLost` and nothing is written.
    pub drop_if_unchanged: Option<TaskFence>,
    /// The caller's clock, for lease checks and `updated_at_ms`.
    pub now_ms: u64,
}

impl AppendRequest {
    /// An append of `events` (from `expected_next_seq`; none for a change of tasks only)
    /// that leaves the session `status`, at `now_ms`, changing no task: set `enqueue`,
    /// `complete`, `cancel` or `drop_if_unchanged` on it (or build it with
    /// `AppendRequest { enqueue, ..AppendRequest::new(...) }`) for those.
    pub fn new(
        session_id: impl Into<String>,
        expected_next_seq: u64,
        events: Vec<EventEnvelope>,
        status: SessionStatus,
        now_ms: u64,
    ) -> Self {
        AppendRequest {
            session_id: session_id.into(),
            expected_next_seq,
            events,
            status,
            enqueue: Vec::new(),
            complete: Vec::new(),
            cancel: Vec::new(),
            drop_if_unchanged: None,
            now_ms,
        }
    }
}

/// A task as the caller read it, for a drop that must not race a worker
/// ([`AppendRequest::drop_if_unchanged`]): its lease attempt, visibility time and holder flag.
///
/// "Unchanged" means the store holds the task with the same three values. Every change a
/// worker or a store makes to a queued task moves one of them: a lease (in process or not)
/// bumps the attempt; a renewal (a heartbeat) moves the lease's expiry, which is the
/// visibility time; a release ([`Store::release_leases`]) clears `held` (and moves the
/// visibility time of a lease still current); a completion or a cancellation removes the
/// task, which is a change too. The one renewal it cannot tell is one whose new expiry
/// equals the old one (its clock read in the same millisecond as the lease's or the last
/// renewal's): that renewal extends nothing, so the lease lapses when the timer read it had,
/// and only the heartbeat details it stored are not in the timer's failure.
/// A fence is a request field, never stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskFence {
    /// The task.
    pub id: TaskId,
    /// Its lease attempt when read ([`Task::lease_attempt`]).
    pub lease_attempt: u32,
    /// Its visibility time (a lease's expiry) when read ([`Task::visible_at_ms`]).
    pub visible_at_ms: u64,
    /// Whether a worker held it when read ([`Task::held`]).
    pub held: bool,
}

impl TaskFence {
    /// The fence of `task` as it stands.
    pub fn of(task: &Task) -> Self {
        TaskFence {
            id: task.id.clone(),
            lease_attempt: task.lease_attempt,
            visible_at_ms: task.visible_at_ms,
            held: task.held,
        }
    }

    /// Checks that the task is unchanged: `now` is the fence of the task as the store holds
    /// it at the append (`None`: gone). `LeaseLost`, saying what changed, when it is not.
    pub fn check(&self, now: Option<&TaskFence>) -> Result<()> {
        let changed = |reason: String| {
            Err(crate::error::Error::LeaseLost {
                task: self.id.to_string(),
                reason,
            })
        };
        let Some(now) = now else {
            return changed(
                "the task is gone (completed or cancelled) since it was read".to_owned(),
            );
        };
        if now.lease_attempt != self.lease_attempt {
            return changed(format!(
                "the task was leased since it was read: lease attempt {} then, {} now",
                self.lease_attempt, now.lease_attempt
            ));
        }
        if now.held != self.held {
            return changed(format!(
                "the task's lease was {} since it was read",
                if now.held { "taken" } else { "released" }
            ));
        }
        if now.visible_at_ms != self.visible_at_ms {
            return changed(format!(
                "the task's lease was renewed since it was read: visible at {} then, {} now",
                self.visible_at_ms, now.visible_at_ms
            ));
        }
        Ok(())
    }
}

/// A hint that a session changed in a store: an append took its history to `last_seq`
/// (`last_seq` is 0 for an append of task changes only), and queued tasks when `enqueued`.
///
/// Hints wake engines up; they are never the truth. They may come late, twice or not at all
/// (a database connection that broke loses the ones sent meanwhile), so an engine that waits
/// on a shared store also polls, and reads the store before it decides anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreChange {
    /// The session appended to.
    pub session_id: String,
    /// The session's last seq after the append; 0 when the append had no events.
    pub last_seq: u64,
    /// Whether the append queued tasks.
    pub enqueued: bool,
}

/// The storage boundary every backend implements; one conformance suite checks them all.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Whether processes other than this one may write to the store (a database server that
    /// several cairn servers share). An engine over a shared store polls it for changes made
    /// elsewhere, besides listening to [`Store::subscribe_changes`]. Shared store or not, an
    /// engine's append of a decision taken on stale state fails (`Conflict`), and it reads
    /// the events it did not write before it answers anything but a successful append.
    fn shared(&self) -> bool {
        false
    }

    /// Hints of the appends other writers made to this store (other processes, or other
    /// handles of it), or `None` when it gives none; not of this handle's own appends, which
    /// the engine that made them knows. See [`StoreChange`]: a hint only.
    fn subscribe_changes(&self) -> Option<tokio::sync::broadcast::Receiver<StoreChange>> {
        None
    }

    /// Durable commits this handle made since it was opened: batches of writes made durable
    /// by one sync each (group commit shares one among concurrent writes). `None` when the
    /// store does not count them. For benchmarks: commits per turn at one session in flight
    /// are the commits a turn waits for in series.
    fn durable_commits(&self) -> Option<u64> {
        None
    }

    /// How long each of those durable commits took to sync (the sync alone: an engine's flush
    /// and fdatasync), or `None` when the store does not time them. For benchmarks: the
    /// store's own sync set beside an fdatasync probe's.
    fn sync_times(&self) -> Option<SyncTimes> {
        None
    }

    /// Why the store refuses writes until it is reopened, when it does (an embedded store
    /// after a write or sync that failed: what it wrote since its last good sync is in
    /// doubt); `None` while it takes writes. For health checks: a process whose store refuses
    /// writes makes no progress until it is restarted.
    fn write_refusal(&self) -> Option<String> {
        None
    }

    /// Appends atomically and durably: when this returns `Ok`, everything in the request
    /// survives a crash or power loss. Fails with `Conflict` when `expected_next_seq` is not the
    /// session's next seq, and with `LeaseLost` when `complete` names a task whose lease is not
    /// current at `now_ms` (expired, re-leased or gone) or when `drop_if_unchanged` names a
    /// task that changed since its caller read it ([`TaskFence`]); nothing is written then.
    async fn append(&self, request: AppendRequest) -> Result<()>;

    /// Events of a session with `from_seq <= seq`, in order, at most `limit`.
    /// `UnknownSession` when the session has no events.
    async fn read_history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>>;

    /// Every session with its status, ordered by id.
    async fn list_sessions(&self) -> Result<Vec<SessionInfo>>;

    /// The ids of the sessions deleted from the store ([`Store::delete_session`]), which are
    /// never used again, ordered.
    async fn deleted_sessions(&self) -> Result<Vec<String>>;

    /// Records that a session of this id was deleted elsewhere (a copy of another store
    /// carries its tombstones along), so that the id is never used here either: `Ok(true)`
    /// once recorded (or when it was deleted here already); `InvalidEvent` when the store
    /// holds a session of that id. `Ok(false)` from a store that cannot hold a tombstone
    /// without the session's history, whatever the id (the default; nothing is written).
    async fn record_deleted(&self, session_id: &str, now_ms: u64) -> Result<bool> {
        let _ = (session_id, now_ms);
        Ok(false)
    }

    /// The records of those of `session_ids` the store holds (a deleted or unknown id has
    /// none), in any order: how an engine polling a shared store for other writers' appends
    /// ([`Engine::follow_store`](crate::Engine::follow_store)) learns which of its watched
    /// sessions moved, in one read, before it reads the histories of those alone. The default
    /// lists every session; a shared store should answer with a lookup of the ids.
    async fn sessions_named(&self, session_ids: &[String]) -> Result<Vec<SessionInfo>> {
        let wanted: std::collections::BTreeSet<&str> =
            session_ids.iter().map(String::as_str).collect();
        let mut all = self.list_sessions().await?;
        all.retain(|info| wanted.contains(info.session_id.as_str()));
        Ok(all)
    }

    /// Leases up to `max` tasks visible at `now_ms` that `filter` accepts and that are not
    /// overdue ([`Task::overdue`]), oldest first, each until `now_ms + lease_ms`: increments
    /// its lease attempt, marks it held and clears its heartbeat details.
    async fn lease_tasks(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>>;

    /// Leases like [`Store::lease_tasks`], for a worker in this process: one that dies with
    /// it. An exclusive embedded store (sled, fjall: locked to one process) answers such a
    /// lease once it is applied, without waiting for a sync; the lease reaches the disk with
    /// the next durable write, which every report of the lease is. Should the process die
    /// first, the lease is gone with its holder, and nothing durable names it: a progress
    /// record, a heartbeat or a completion of the lease is a later write, durable only once
    /// everything written before it is (the log is written in order). The lease attempt of
    /// every durable record therefore stays below the next lease's after a restart. A lease
    /// applied behind writes that wait for a sync (the append that queued the task it leases,
    /// say) is answered with them, once durable: no task runs before the event that scheduled
    /// it is on disk.
    ///
    /// A store that other processes share, or a lease for a worker elsewhere, must use
    /// [`Store::lease_tasks`], durable before it is answered: that worker outlives a crash
    /// of this process, and its fencing token must never be handed out again. The default
    /// is [`Store::lease_tasks`].
    async fn lease_tasks_in_process(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        self.lease_tasks(now_ms, lease_ms, max, filter).await
    }

    /// Appends like [`Store::append`], then leases at the append's `now_ms`, like
    /// [`Store::lease_tasks_in_process`] for a worker of this process and like
    /// [`Store::lease_tasks`] for one elsewhere (`lease.holder`): eager dispatch, where the
    /// worker that reported a result takes the next task its report queued without asking
    /// again. Both are answered once the append is durable, so no task runs before the event
    /// that scheduled it is on disk. An append that fails leases nothing; a lease that fails
    /// after the append leaves the append standing and answers no task (the tasks stay queued
    /// for any worker). A store may lease only among the tasks the append queues (the
    /// session's next step, as eager dispatch means), or none.
    ///
    /// The default appends, then leases; an embedded store does both in one write, and
    /// PostgreSQL writes the tasks it queues already leased.
    async fn append_and_lease(
        &self,
        request: AppendRequest,
        lease: &LeaseRequest,
    ) -> Result<Vec<Lease>> {
        let now_ms = request.now_ms;
        self.append(request).await?;
        let leased = match lease.holder {
            LeaseHolder::InProcess => {
                self.lease_tasks_in_process(now_ms, lease.lease_ms, lease.max, &lease.filter)
                    .await
            }
            LeaseHolder::Remote => {
                self.lease_tasks(now_ms, lease.lease_ms, lease.max, &lease.filter)
                    .await
            }
        };
        match leased {
            Ok(leases) => Ok(leases),
            Err(e) => {
                tracing::warn!(error = %e, "leasing after an append failed; the tasks stay queued");
                Ok(Vec::new())
            }
        }
    }

    /// Extends a current lease (a heartbeat), storing `details` when given (kept otherwise).
    /// Durable like a lease. `LeaseLost` when the lease is not current.
    async fn extend_lease(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64>;

    /// Up to `max` tasks overdue at `now_ms` ([`Task::overdue`]), oldest first. Reads only.
    async fn overdue_tasks(&self, now_ms: u64, max: usize) -> Result<Vec<Task>>;

    /// Every queued task (leased or not), ordered by id.
    async fn list_tasks(&self) -> Result<Vec<Task>>;

    /// The queued task of this id (leased or not), as [`Store::list_tasks`] would list it;
    /// `None` when there is none (never queued, completed or cancelled). Reads only: how a
    /// server checks one lease is current without listing every task. The default lists
    /// them; a store should answer with a lookup of the key.
    async fn task(&self, id: &TaskId) -> Result<Option<Task>> {
        Ok(self.list_tasks().await?.into_iter().find(|t| &t.id == id))
    }

    /// Makes every currently leased task (`lease_attempt > 0` and `visible_at_ms > now_ms`)
    /// leasable at `now_ms` again and no longer held, without changing its lease attempt or
    /// counting a failed attempt (its worker died with the process, through no fault of the
    /// activity): the next lease bumps the attempt, so a completion or heartbeat from the released lease is still fenced off
    /// (`LeaseLost`). Returns how many tasks it released. Durable like a lease.
    ///
    /// Only safe when no other process can hold leases on this store: an embedded store that
    /// the OS locks to one process (like sled), reopened after that process died, so every
    /// lease in it belongs to a dead worker. On a shared store a live worker elsewhere would
    /// lose its lease; there, let leases lapse instead.
    async fn release_leases(&self, now_ms: u64) -> Result<usize>;

    /// Deletes a finished session in one atomic, durable write: its events, its record and
    /// its tasks (a finished session has none), leaving a tombstone, so that its id is never
    /// used again: an append to it fails with `SessionDeleted`, whichever process or stale
    /// cache makes it. Returns the session as it was listed last.
    ///
    /// `UnknownSession` when the session has no events (or was deleted already);
    /// `SessionBusy` when a turn is running or a task of it is queued or leased (see
    /// [`check_deletable`]). Nothing is written then.
    async fn delete_session(&self, session_id: &str, now_ms: u64) -> Result<SessionInfo>;
}

/// Whether a session may be deleted: not running, and no task of it (`task`: the first one
/// the store holds, if any) queued or leased. `SessionBusy` says why not.
pub fn check_deletable(info: &SessionInfo, task: Option<&Task>) -> Result<()> {
    let busy = |reason: String| {
        Err(crate::error::Error::SessionBusy {
            session_id: info.session_id.clone(),
            reason,
        })
    };
    if info.status == SessionStatus::Running {
        return busy("a turn is running; cancel it first, or wait for it to end".to_owned());
    }
    match task {
        Some(task) if task.held => busy(format!("its task {} is leased by a worker", task.id)),
        Some(task) => busy(format!("its task {} is queued", task.id)),
        None => Ok(()),
    }
}

/// The error for an id that names no session: `UnknownSession`.
pub(crate) fn unknown_session(session_id: &str) -> crate::error::Error {
    crate::error::Error::UnknownSession {
        session_id: session_id.to_owned(),
    }
}

/// Checks a session id is usable as a store key.
pub fn check_session_id(session_id: &str) -> Result<()> {
    let ok = !session_id.is_empty()
        && session_id.len() <= 128
        && session_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'));
    if ok {
        Ok(())
    } else {
        Err(crate::error::Error::InvalidSessionId {
            session_id: session_id.to_owned(),
        })
    }
}

/// Checks that the request expects a seq a session can have next: seqs start at 1, so 0
/// is refused (`InvalidEvent`) by every store alike.
pub fn check_expected_seq(request: &AppendRequest) -> Result<()> {
    if request.expected_next_seq == 0 {
        return Err(crate::error::Error::InvalidEvent {
            session_id: request.session_id.clone(),
            seq: 0,
            reason: "an append must expect seq 1 or later next: seqs start at 1".into(),
        });
    }
    Ok(())
}

/// Checks that the request's events carry consecutive seqs of its session.
pub(crate) fn check_request(request: &AppendRequest) -> Result<()> {
    check_session_id(&request.session_id)?;
    check_expected_seq(request)?;
    for (i, e) in request.events.iter().enumerate() {
        let want = u64::try_from(i)
            .ok()
            .and_then(|i| request.expected_next_seq.checked_add(i));
        if e.session_id != request.session_id || Some(e.seq) != want {
            return Err(crate::error::Error::InvalidEvent {
                session_id: request.session_id.clone(),
                seq: e.seq,
                reason: match want {
                    Some(want) => {
                        format!("append batch position {i} must be seq {want} of this session")
                    }
                    None => format!("append batch position {i} is past the largest seq"),
                },
            });
        }
    }
    Ok(())
}
