//! Resuming after a restart: every running session's outstanding activities get their
//! queued tasks back, and a dead process's leases can be released at once.

use super::{status_of, Engine, ResumeReport, UnresumableSession};
use crate::error::{Error, Result};
use crate::store::{AppendRequest, SessionStatus, TaskId};
use std::collections::BTreeSet;
// Named in doc links only.
#[cfg(doc)]
use crate::store::Store;

impl Engine {
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
}
