//! The `Store` boundary: an append-only event log per session with optimistic concurrency, and
//! a task queue written in the same atomic step (a transactional outbox).
//!
//! The trait speaks in whole operations (append a batch with its task changes, read a range,
//! lease due tasks) so that a SQL backend implements each as one transaction.

use crate::error::Result;
use crate::event::EventEnvelope;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::fmt;

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod embedded;
#[cfg(test)]
mod engine_tests;
pub mod faulty;
mod files;
pub mod fjall;
mod keys;
pub mod marks;
pub mod memory;
pub mod sled;
mod write_queue;

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

/// A task to enqueue with an append.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewTask {
    /// Its id.
    pub id: TaskId,
    /// What it runs.
    pub kind: TaskKind,
    /// Not leasable before this time (epoch ms).
    pub visible_at_ms: u64,
}

/// A task as the queue holds it.
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
    /// When the lease lapses and the task becomes leasable again.
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
    /// A task this append completes, with the lease attempt that ran it (fencing).
    pub complete: Option<(TaskId, u32)>,
    /// Tasks to drop without a lease check (the workflow no longer wants them).
    pub cancel: Vec<TaskId>,
    /// The caller's clock, for lease checks and `updated_at_ms`.
    pub now_ms: u64,
}

/// The storage boundary every backend implements; one conformance suite checks them all.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Appends atomically and durably: when this returns `Ok`, everything in the request
    /// survives a crash or power loss. Fails with `Conflict` when `expected_next_seq` is not the
    /// session's next seq, and with `LeaseLost` when `complete` names a task whose lease is not
    /// current at `now_ms` (expired, re-leased or gone); nothing is written then.
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

    /// Leases up to `max` tasks visible at `now_ms` (oldest first), each until
    /// `now_ms + lease_ms`, incrementing its lease attempt.
    async fn lease_tasks(&self, now_ms: u64, lease_ms: u64, max: usize) -> Result<Vec<Lease>>;

    /// Extends a current lease (a heartbeat). `LeaseLost` when it is not current.
    async fn extend_lease(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<u64>;

    /// Every queued task (leased or not), ordered by id.
    async fn list_tasks(&self) -> Result<Vec<Task>>;

    /// Makes every currently leased task (`lease_attempt > 0` and `visible_at_ms > now_ms`)
    /// leasable at `now_ms` again, without changing its lease attempt: the next lease bumps
    /// it, so a completion or heartbeat from the released lease is still fenced off
    /// (`LeaseLost`). Returns how many tasks it released. Durable like a lease.
    ///
    /// Only safe when no other process can hold leases on this store: an embedded store that
    /// the OS locks to one process (like sled), reopened after that process died, so every
    /// lease in it belongs to a dead worker. On a shared store a live worker elsewhere would
    /// lose its lease; there, let leases lapse instead.
    async fn release_leases(&self, now_ms: u64) -> Result<usize>;
}

/// Checks a session id is usable as a store key.
pub fn check_session_id(session_id: &str) -> Result<()> {
    let ok = !session_id.is_empty()
        && session_id.len() <= 128
        && session_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(crate::error::Error::InvalidSessionId {
            session_id: session_id.to_owned(),
        })
    }
}

/// Checks that the request's events carry consecutive seqs of its session.
pub(crate) fn check_request(request: &AppendRequest) -> Result<()> {
    check_session_id(&request.session_id)?;
    for (i, e) in request.events.iter().enumerate() {
        if e.session_id != request.session_id || e.seq != request.expected_next_seq + i as u64 {
            return Err(crate::error::Error::InvalidEvent {
                session_id: request.session_id.clone(),
                seq: e.seq,
                reason: format!(
                    "append batch position {i} must be seq {} of this session",
                    request.expected_next_seq + i as u64
                ),
            });
        }
    }
    Ok(())
}
