//! Workers' reports waiting for their session: those that arrive while an append of the
//! session is in flight wait here, and whoever takes the session next records them together.
//!
//! A session's appends run one at a time (each waits for the one before to be durable), so
//! the reports of N parallel tool calls that finish together would cost N durable commits in
//! series. Queued here instead, every report that came while the first was being committed
//! goes into the next append: two commits, whatever N.

use crate::engine::ActivityReport;
use crate::error::Result;
use crate::store::{Lease, LeaseRequest};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use tokio::sync::oneshot;

/// A report waiting for its session, with the channel its caller waits on for the answer:
/// the tasks leased with its append (eager dispatch), or why it was not recorded.
pub(crate) struct QueuedReport {
    ticket: u64,
    pub(crate) lease: Lease,
    pub(crate) report: ActivityReport,
    pub(crate) next: Option<LeaseRequest>,
    pub(crate) reply: oneshot::Sender<Result<Vec<Lease>>>,
}

/// The waiting reports of every session, in the order they came.
#[derive(Default)]
pub(crate) struct ReportQueues {
    queues: Mutex<HashMap<String, Vec<QueuedReport>>>,
    tickets: AtomicU64,
}

/// A report's place in its session's queue: dropped before the report was taken (its caller
/// gone while it waited for the session), it takes the report out, so that nothing records a
/// report nobody waits for.
pub(crate) struct QueuedTicket<'a> {
    queues: &'a ReportQueues,
    session_id: &'a str,
    ticket: u64,
}

impl ReportQueues {
    /// Queues a report of `lease`'s session; the receiver gets its answer.
    pub(crate) fn push<'a>(
        &'a self,
        lease: &'a Lease,
        report: ActivityReport,
        next: Option<LeaseRequest>,
    ) -> (QueuedTicket<'a>, oneshot::Receiver<Result<Vec<Lease>>>) {
        let (reply, answer) = oneshot::channel();
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let session_id = lease.id.session_id.as_str();
        self.lock()
            .entry(session_id.to_owned())
            .or_default()
            .push(QueuedReport {
                ticket,
                lease: lease.clone(),
                report,
                next,
                reply,
            });
        let ticket = QueuedTicket {
            queues: self,
            session_id,
            ticket,
        };
        (ticket, answer)
    }

    /// Takes every report waiting for `session_id`, oldest first.
    pub(crate) fn take(&self, session_id: &str) -> Vec<QueuedReport> {
        self.lock().remove(session_id).unwrap_or_default()
    }

    /// How many reports wait for `session_id`.
    #[cfg(test)]
    pub(crate) fn waiting(&self, session_id: &str) -> usize {
        self.lock().get(session_id).map_or(0, Vec::len)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<QueuedReport>>> {
        // A panic elsewhere while this was held left whole entries: the map is still sound.
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for QueuedTicket<'_> {
    fn drop(&mut self) {
        let mut queues = self.queues.lock();
        if let Some(queue) = queues.get_mut(self.session_id) {
            queue.retain(|queued| queued.ticket != self.ticket);
            if queue.is_empty() {
                queues.remove(self.session_id);
            }
        }
    }
}
