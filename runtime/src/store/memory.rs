//! The in-memory store: the reference implementation of the `Store` contract, for tests.
//!
//! Events are kept as encoded records, so the codec runs here exactly as in durable stores.

use super::{
    check_deletable, check_request, unknown_session, AppendRequest, Lease, SessionInfo, Store,
    Task, TaskFence, TaskFilter, TaskId,
};
use crate::codec;
use crate::error::{Error, Result};
use crate::event::EventEnvelope;
use async_trait::async_trait;
use cairn_ledger::JsonText;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

#[derive(Default)]
struct Inner {
    /// Per session: the encoded records, seq 1 at index 0.
    events: BTreeMap<String, Vec<Vec<u8>>>,
    sessions: BTreeMap<String, SessionInfo>,
    tasks: BTreeMap<TaskId, Task>,
    /// (visible_at_ms, id): the queue order.
    queue: BTreeSet<(u64, TaskId)>,
    /// Deleted sessions (tombstones): their ids are never used again.
    deleted: BTreeSet<String>,
}

/// A store in memory; gone with the process.
#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>> {
        self.inner.lock().map_err(|_| Error::Store {
            reason: "memory store lock poisoned".to_owned(),
        })
    }
}

pub(crate) fn lease_current(
    task: Option<&Task>,
    id: &TaskId,
    attempt: u32,
    now_ms: u64,
) -> Result<()> {
    let lost = |reason: String| Error::LeaseLost {
        task: id.to_string(),
        reason,
    };
    match task {
        None => Err(lost("the task is gone (completed or cancelled)".to_owned())),
        Some(t) if t.lease_attempt != attempt => Err(lost(format!(
            "lease attempt {attempt} is stale; the current one is {}",
            t.lease_attempt
        ))),
        Some(t) if t.visible_at_ms <= now_ms => Err(lost(format!(
            "the lease expired at {} (now {now_ms})",
            t.visible_at_ms
        ))),
        Some(_) => Ok(()),
    }
}

/// When a released task becomes leasable, if [`Store::release_leases`] releases it: a leased
/// task (a current lease, or a lapsed one still held) is visible at once; a task that is not
/// leased (new, or a retry waiting for its backoff) is left alone (`None`).
pub(crate) fn released_visibility(task: &Task, now_ms: u64) -> Option<u64> {
    let leased = task.lease_attempt > 0 && (task.held || task.visible_at_ms > now_ms);
    leased.then_some(task.visible_at_ms.min(now_ms))
}

#[async_trait]
impl Store for MemoryStore {
    async fn append(&self, request: AppendRequest) -> Result<()> {
        check_request(&request)?;
        let mut records = Vec::with_capacity(request.events.len());
        for e in &request.events {
            records.push(codec::encode(e)?);
        }
        let mut inner = self.lock()?;
        if inner.deleted.contains(&request.session_id) {
            return Err(Error::SessionDeleted {
                session_id: request.session_id.clone(),
            });
        }
        let actual = inner
            .events
            .get(&request.session_id)
            .map_or(1, |v| v.len() as u64 + 1);
        if actual != request.expected_next_seq {
            return Err(Error::Conflict {
                session_id: request.session_id.clone(),
                expected: request.expected_next_seq,
                actual,
            });
        }
        for (id, attempt) in &request.complete {
            lease_current(inner.tasks.get(id), id, *attempt, request.now_ms)?;
        }
        if let Some(fence) = &request.drop_if_unchanged {
            fence.check(inner.tasks.get(&fence.id).map(TaskFence::of).as_ref())?;
        }
        let count = actual - 1 + records.len() as u64;
        if count == 0 {
            // Nothing recorded for this session yet: an empty append creates nothing.
        } else {
            inner
                .events
                .entry(request.session_id.clone())
                .or_default()
                .extend(records);
            inner.sessions.insert(
                request.session_id.clone(),
                SessionInfo {
                    session_id: request.session_id.clone(),
                    status: request.status,
                    events: count,
                    updated_at_ms: request.now_ms,
                },
            );
        }
        let removed: Vec<TaskId> = request
            .complete
            .iter()
            .map(|(id, _)| id.clone())
            .chain(request.cancel.iter().cloned())
            .chain(
                request
                    .drop_if_unchanged
                    .iter()
                    .map(|fence| fence.id.clone()),
            )
            .collect();
        for id in removed {
            if let Some(task) = inner.tasks.remove(&id) {
                inner.queue.remove(&(task.visible_at_ms, id));
            }
        }
        for new in request.enqueue {
            let task = Task::queued(&new);
            if let Some(old) = inner.tasks.insert(new.id.clone(), task) {
                inner.queue.remove(&(old.visible_at_ms, old.id));
            }
            inner.queue.insert((new.visible_at_ms, new.id));
        }
        Ok(())
    }

    async fn read_history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        let inner = self.lock()?;
        let records = inner
            .events
            .get(session_id)
            .ok_or_else(|| Error::UnknownSession {
                session_id: session_id.to_owned(),
            })?;
        let start = from_seq.max(1);
        records
            .iter()
            .enumerate()
            .skip((start - 1) as usize)
            .take(limit.unwrap_or(usize::MAX))
            .map(|(i, r)| codec::decode(session_id, i as u64 + 1, r))
            .collect()
    }

    async fn list_sessions(&self) -> Result<Vec<SessionInfo>> {
        Ok(self.lock()?.sessions.values().cloned().collect())
    }

    async fn deleted_sessions(&self) -> Result<Vec<String>> {
        Ok(self.lock()?.deleted.iter().cloned().collect())
    }

    async fn record_deleted(&self, session_id: &str, _now_ms: u64) -> Result<bool> {
        super::check_session_id(session_id)?;
        let mut inner = self.lock()?;
        if inner.sessions.contains_key(session_id) {
            return Err(Error::InvalidEvent {
                session_id: session_id.to_owned(),
                seq: 0,
                reason: "the store holds a session of this id; it was not deleted here".into(),
            });
        }
        inner.deleted.insert(session_id.to_owned());
        Ok(true)
    }

    async fn delete_session(&self, session_id: &str, _now_ms: u64) -> Result<SessionInfo> {
        let mut inner = self.lock()?;
        let info = inner
            .sessions
            .get(session_id)
            .cloned()
            .ok_or_else(|| unknown_session(session_id))?;
        let first_task = inner
            .tasks
            .range(
                TaskId {
                    session_id: session_id.to_owned(),
                    scheduled_seq: 0,
                }..,
            )
            .map(|(_, task)| task)
            .next()
            .filter(|task| task.id.session_id == session_id);
        check_deletable(&info, first_task)?;
        inner.events.remove(session_id);
        inner.sessions.remove(session_id);
        inner.deleted.insert(session_id.to_owned());
        Ok(info)
    }

    async fn lease_tasks(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        let mut inner = self.lock()?;
        let Inner { tasks, queue, .. } = &mut *inner;
        let due: Vec<(u64, TaskId)> = queue
            .iter()
            .take_while(|(visible, _)| *visible <= now_ms)
            .filter(|(_, id)| {
                tasks
                    .get(id)
                    .is_some_and(|t| filter.accepts(t) && t.overdue(now_ms).is_none())
            })
            .take(max)
            .cloned()
            .collect();
        let expires_at_ms = now_ms.saturating_add(lease_ms);
        let mut leases = Vec::with_capacity(due.len());
        for key in due {
            queue.remove(&key);
            let Some(task) = tasks.get_mut(&key.1) else {
                continue;
            };
            task.lease_attempt += 1;
            task.visible_at_ms = expires_at_ms;
            task.held = true;
            task.heartbeat_details = None;
            leases.push(Lease {
                id: task.id.clone(),
                kind: task.kind,
                lease_attempt: task.lease_attempt,
                expires_at_ms,
            });
            queue.insert((expires_at_ms, key.1));
        }
        Ok(leases)
    }

    async fn extend_lease(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        let mut inner = self.lock()?;
        lease_current(inner.tasks.get(id), id, lease_attempt, now_ms)?;
        let expires_at_ms = now_ms.saturating_add(lease_ms);
        let old = inner.tasks.get_mut(id).map(|t| {
            if details.is_some() {
                t.heartbeat_details = details;
            }
            std::mem::replace(&mut t.visible_at_ms, expires_at_ms)
        });
        if let Some(old) = old {
            inner.queue.remove(&(old, id.clone()));
            inner.queue.insert((expires_at_ms, id.clone()));
        }
        Ok(expires_at_ms)
    }

    async fn overdue_tasks(&self, now_ms: u64, max: usize) -> Result<Vec<Task>> {
        let inner = self.lock()?;
        Ok(inner
            .queue
            .iter()
            .take_while(|(visible, _)| *visible <= now_ms)
            .filter_map(|(_, id)| inner.tasks.get(id))
            .filter(|t| t.overdue(now_ms).is_some())
            .take(max)
            .cloned()
            .collect())
    }

    async fn list_tasks(&self) -> Result<Vec<Task>> {
        Ok(self.lock()?.tasks.values().cloned().collect())
    }

    async fn task(&self, id: &TaskId) -> Result<Option<Task>> {
        Ok(self.lock()?.tasks.get(id).cloned())
    }

    async fn release_leases(&self, now_ms: u64) -> Result<usize> {
        let mut inner = self.lock()?;
        let Inner { tasks, queue, .. } = &mut *inner;
        let mut released = 0;
        for task in tasks.values_mut() {
            if let Some(visible_at_ms) = released_visibility(task, now_ms) {
                queue.remove(&(task.visible_at_ms, task.id.clone()));
                task.visible_at_ms = visible_at_ms;
                task.held = false;
                queue.insert((visible_at_ms, task.id.clone()));
                released += 1;
            }
        }
        Ok(released)
    }
}
