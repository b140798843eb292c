//! Workers' reports waiting for their session: those that arrive while an append of the
//! session is in flight wait here, and whoever takes the session next records them together.
//!
//! A session's appends run one at a time (each waits for the one before to be durable), so
//! the reports of N parallel tool calls that finish together would cost N durable commits in
//! series. Queued here instead, every report that came while the first was being committed
//! goes into the next append: two commits, whatever N. Each session's slot holds its queue
//! (see `state_cache`), so a report finds it without a lookup of its own. A report whose
//! parallel siblings are still running may also hold its session a moment for theirs
//! ([`ReportQueue::pushed`]), so that all of them make one commit (see `engine_reports`).

use crate::engine::ActivityReport;
use crate::error::Result;
use crate::store::{Lease, LeaseRequest, TaskId};
use std::sync::Mutex;
use tokio::sync::{oneshot, Notify};

/// A report waiting to be recorded, with where its answer goes: the tasks leased with its
/// append (eager dispatch), or why it was not recorded.
pub(crate) struct QueuedReport {
    ticket: u64,
    pub(crate) lease: Lease,
    pub(crate) report: ActivityReport,
    pub(crate) next: Option<LeaseRequest>,
    /// The channel its caller waits on.
    pub(crate) reply: oneshot::Sender<Result<Vec<Lease>>>,
}

/// One session's waiting reports, in the order they came.
#[derive(Default)]
pub(crate) struct ReportQueue {
    waiting: Mutex<Waiting>,
    /// Told of every report pushed, for a report that holds the session for its siblings'.
    pushed: Notify,
}

#[derive(Default)]
struct Waiting {
    next_ticket: u64,
    reports: Vec<QueuedReport>,
}

/// A report's place in its session's queue: dropped before the report was taken (its caller
/// gone while it waited for the session), it takes the report out, so that nothing records a
/// report nobody waits for.
pub(crate) struct QueuedTicket<'a> {
    queue: &'a ReportQueue,
    ticket: u64,
}

impl ReportQueue {
    /// Queues a report; the receiver gets its answer.
    pub(crate) fn push(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: Option<LeaseRequest>,
    ) -> (QueuedTicket<'_>, oneshot::Receiver<Result<Vec<Lease>>>) {
        let (reply, answer) = oneshot::channel();
        let mut waiting = self.lock();
        let ticket = waiting.next_ticket;
        waiting.next_ticket += 1;
        waiting.reports.push(QueuedReport {
            ticket,
            lease: lease.clone(),
            report,
            next,
            reply,
        });
        drop(waiting);
        self.pushed.notify_one();
        (
            QueuedTicket {
                queue: self,
                ticket,
            },
            answer,
        )
    }

    /// Takes every waiting report, oldest first.
    pub(crate) fn take(&self) -> Vec<QueuedReport> {
        std::mem::take(&mut self.lock().reports)
    }

    /// Whether the report of task `id` waits.
    pub(crate) fn holds(&self, id: &TaskId) -> bool {
        self.lock()
            .reports
            .iter()
            .any(|queued| queued.lease.id == *id)
    }

    /// Completes once a report was pushed since the last call completed (at once if one was
    /// pushed meanwhile): a wake to look again, not a promise of any report.
    pub(crate) async fn pushed(&self) {
        self.pushed.notified().await;
    }

    /// Whether no report waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.lock().reports.is_empty()
    }

    /// How many reports wait.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().reports.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        // A panic elsewhere while this was held left whole entries: the queue is still sound.
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for ReportQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let waiting = self.lock().reports.len();
        f.debug_struct("ReportQueue")
            .field("waiting", &waiting)
            .finish()
    }
}

impl Drop for QueuedTicket<'_> {
    fn drop(&mut self) {
        let mut waiting = self.queue.lock();
        if !waiting.reports.is_empty() {
            waiting
                .reports
                .retain(|queued| queued.ticket != self.ticket);
        }
    }
}
