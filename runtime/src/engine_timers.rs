//! The engine's durable timers: every overdue task (a lapsed lease, an attempt no worker
//! started in time, an approval deadline) is recorded in its session's history, so the
//! workflow decides what comes next.

use super::{failed_event, lock, Engine};
use crate::error::Result;
use crate::event::{ActivityFailure, ErrorClass, Event};
use crate::store::{Lease, Overdue, Task, TaskFence};
use std::collections::HashSet;
use tracing::{debug, warn};

/// Overdue tasks one round of timers records at most (besides those that failed last round).
const TIMER_BATCH: usize = 256;

impl Engine {
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
                Vec::new(),
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
                Vec::new(),
            )
            .await?;
        Ok(submitted.map(|_| true))
    }
}
