//! Reports that finish together go to the server in one request (`POST /v1/worker/reports`),
//! as a store's group commit shares one sync: while [`MAX_IN_FLIGHT`] report requests are on
//! their way, a new report's first try waits, and the reports that gathered meanwhile go
//! together as soon as one of those requests is answered. A report that finds fewer in flight
//! goes at once, by itself, so a lone report never waits. Each request's fixed cost (a
//! connection's turn, the HTTP exchange, a task on each side) is then paid once for many
//! reports, which the server records at once, in the same commits. Reports that a slot ran in
//! turn (a model's parallel calls that each answered at once) go together from the start: one
//! batch, sent at once while fewer than [`MAX_IN_FLIGHT`] requests are on their way.
//!
//! Only a first try is batched. A batch that did not reach the server, or that the server took
//! none of (a server from before the route, a body too large for it), lets each report go by
//! itself as a first try; one whose answer was lost lets each go again by itself as a try sent
//! again ([`BatchOutcome::Lost`]). A server that does not know the route is not sent batches
//! again.

use crate::connection::{Connection, Request};
use crate::tool_sets::ToolSetCache;
use crate::transcripts::TranscriptCache;
use cairn_runtime::wire::{ReportBatchAnswer, ReportRequest, MAX_REPORTS_PER_BATCH};
use serde::Serialize;
use serde_json::value::RawValue;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::debug;

/// Report requests on their way at once before new reports wait to go together. Two, so that
/// the second of two reports finishing together (a turn's parallel tool calls) does not wait
/// for the first's answer.
const MAX_IN_FLIGHT: usize = 2;
/// A batch stops growing past this many bytes of reports (the server's default body limit is
/// larger); the rest go in the next.
const MAX_BATCH_BYTES: usize = 1 << 20;

/// What became of a report sent in a batch.
#[derive(Debug)]
pub(crate) enum BatchOutcome {
    /// The server's answer to it: what `POST /v1/worker/report` would have answered, its
    /// status and body.
    Answered(u16, Vec<u8>),
    /// The server took nothing of the batch: send the report by itself, as a first try.
    NotSent,
    /// The batch may have reached the server, but no answer to it came back: send the report
    /// by itself, as a try sent again.
    Lost(String),
}

/// How a report's first try goes.
pub(crate) enum Entry {
    /// By itself, now; the guard (none when batching is off) counts it in flight until dropped.
    Alone(Option<InFlight>),
    /// In a batch, with the reports that gather while others are in flight: the outcome comes
    /// here.
    Queued(oneshot::Receiver<BatchOutcome>),
}

/// Gathers the reports that wait and sends them together.
pub(crate) struct ReportBatcher {
    connection: Arc<Connection>,
    /// The tool sets the worker keeps, which every report request lists.
    tool_sets: Arc<ToolSetCache>,
    /// The transcripts the worker keeps, listed on each batch.
    transcripts: Arc<TranscriptCache>,
    state: Mutex<State>,
    /// The server has no batch route (it predates it): every report goes by itself.
    refused: AtomicBool,
}

#[derive(Default)]
struct State {
    in_flight: usize,
    queued: Vec<Queued>,
}

struct Queued {
    report: Box<RawValue>,
    /// The session of its lease: its transcript is the one the answer may leave out.
    session_id: String,
    /// The time its first try is given ([`crate::source`]'s per-lease bound).
    timeout: Duration,
    reply: oneshot::Sender<BatchOutcome>,
}

/// A report request on its way; dropped when it is answered, which sends what gathered.
pub(crate) struct InFlight(Arc<ReportBatcher>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.leave();
    }
}

/// A batch's body: the reports as they were serialized when they were queued.
#[derive(Serialize)]
struct BatchBody<'a> {
    reports: Vec<&'a RawValue>,
}

impl ReportBatcher {
    pub(crate) fn new(
        connection: Arc<Connection>,
        tool_sets: Arc<ToolSetCache>,
        transcripts: Arc<TranscriptCache>,
    ) -> Arc<Self> {
        Arc::new(ReportBatcher {
            connection,
            tool_sets,
            transcripts,
            state: Mutex::default(),
            refused: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How the first try of `report`, given `timeout`, goes.
    pub(crate) fn enter(self: &Arc<Self>, report: &ReportRequest, timeout: Duration) -> Entry {
        let report_of = report;
        if self.refused.load(Ordering::Relaxed) {
            return Entry::Alone(None);
        }
        {
            let mut state = self.lock();
            if state.in_flight < MAX_IN_FLIGHT {
                state.in_flight += 1;
                return Entry::Alone(Some(InFlight(Arc::clone(self))));
            }
        }
        let Ok(report) = serde_json::value::to_raw_value(report) else {
            return Entry::Alone(None);
        };
        let (reply, outcome) = oneshot::channel();
        let mut state = self.lock();
        if state.in_flight < MAX_IN_FLIGHT {
            // Answered while this one was serialized.
            state.in_flight += 1;
            return Entry::Alone(Some(InFlight(Arc::clone(self))));
        }
        state.queued.push(Queued {
            report,
            session_id: report_session(report_of),
            timeout,
            reply,
        });
        Entry::Queued(outcome)
    }

    /// How the first tries of reports that finished together go (a slot's parallel calls,
    /// run in turn): in one batch, which the returned future sends when it is awaited if
    /// fewer than [`MAX_IN_FLIGHT`] report requests are on their way, else queued whole with
    /// the reports that gather meanwhile. Each entry's outcome comes when the batch is
    /// answered, so the future must be awaited beside them. Reports that could not go in one
    /// batch (more than it holds, or a server without the route) go as [`Self::enter`] says.
    pub(crate) fn enter_together(
        self: &Arc<Self>,
        reports: &[&ReportRequest],
        timeout: Duration,
    ) -> (
        Vec<Entry>,
        Option<impl Future<Output = ()> + Send + 'static>,
    ) {
        let one_by_one = |batcher: &Arc<Self>| {
            let entries = reports.iter().map(|r| batcher.enter(r, timeout)).collect();
            (entries, None)
        };
        if reports.len() < 2
            || reports.len() > MAX_REPORTS_PER_BATCH
            || self.refused.load(Ordering::Relaxed)
        {
            return one_by_one(self);
        }
        let mut batch = Vec::with_capacity(reports.len());
        let mut entries = Vec::with_capacity(reports.len());
        let mut bytes = 0;
        for report in reports {
            let Ok(raw) = serde_json::value::to_raw_value(report) else {
                return one_by_one(self);
            };
            bytes += raw.get().len();
            let (reply, outcome) = oneshot::channel();
            batch.push(Queued {
                report: raw,
                session_id: report_session(report),
                timeout,
                reply,
            });
            entries.push(Entry::Queued(outcome));
        }
        if bytes > MAX_BATCH_BYTES {
            return one_by_one(self);
        }
        let mut state = self.lock();
        if state.in_flight >= MAX_IN_FLIGHT {
            state.queued.extend(batch);
            return (entries, None);
        }
        state.in_flight += 1;
        drop(state);
        let guard = InFlight(Arc::clone(self));
        let send = async move {
            guard.0.send(batch).await;
            drop(guard);
        };
        (entries, Some(send))
    }

    /// A request was answered: the reports that gathered go, as one batch.
    fn leave(self: &Arc<Self>) {
        let mut state = self.lock();
        state.in_flight -= 1;
        if state.queued.is_empty() {
            return;
        }
        let mut bytes = 0;
        let mut count = 0;
        for queued in &state.queued {
            if count == MAX_REPORTS_PER_BATCH
                || (count > 0 && bytes + queued.report.get().len() > MAX_BATCH_BYTES)
            {
                break;
            }
            bytes += queued.report.get().len();
            count += 1;
        }
        let batch: Vec<Queued> = state.queued.drain(..count).collect();
        // Dropped here without a runtime (the process ending), the reports go by themselves.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        state.in_flight += 1;
        drop(state);
        let guard = InFlight(Arc::clone(self));
        runtime.spawn(async move {
            guard.0.send(batch).await;
            drop(guard);
        });
    }

    async fn send(&self, batch: Vec<Queued>) {
        let timeout = batch
            .iter()
            .map(|queued| queued.timeout)
            .min()
            .unwrap_or_default();
        let body = BatchBody {
            reports: batch.iter().map(|queued| queued.report.as_ref()).collect(),
        };
        let mut request = Request::post("/v1/worker/reports", &body);
        request.tool_sets = Some(self.tool_sets.header());
        let sessions: Vec<&str> = batch.iter().map(|q| q.session_id.as_str()).collect();
        request.transcripts = Some(self.transcripts.header_for(&sessions));
        let outcomes = match self.connection.exchange(request, timeout).await {
            Ok((200, body)) => match crate::connection::from_json::<ReportBatchAnswer>(&body) {
                Ok(answer) if answer.answers.len() == batch.len() => answer
                    .answers
                    .into_iter()
                    .map(|answer| {
                        let body = answer
                            .body
                            .map(|body| body.get().as_bytes().to_vec())
                            .unwrap_or_default();
                        BatchOutcome::Answered(answer.status, body)
                    })
                    .collect(),
                Ok(answer) => lost(
                    &batch,
                    format!(
                        "the server answered {} of a batch of {} reports",
                        answer.answers.len(),
                        batch.len()
                    ),
                ),
                Err(e) => lost(
                    &batch,
                    format!("the answer to a batch of reports does not decode: {e}"),
                ),
            },
            // A server from before the route: it never records a batch.
            Ok((404 | 405, _)) => {
                debug!("the server takes no batches of reports; reporting one by one from now on");
                self.refused.store(true, Ordering::Relaxed);
                not_sent(&batch)
            }
            // Refused whole before anything was recorded: too large, not taken as a batch, or
            // from a token the server does not take (each report by itself hears why).
            Ok((400 | 401 | 403 | 413 | 415, _)) => not_sent(&batch),
            Ok((status, _)) => lost(
                &batch,
                format!("the server answered a batch of reports with status {status}"),
            ),
            Err(e) => lost(&batch, e.to_string()),
        };
        for (queued, outcome) in batch.into_iter().zip(outcomes) {
            // A report no longer waited for (its worker stopping) is dropped with its answer.
            let _ = queued.reply.send(outcome);
        }
    }
}

fn not_sent(batch: &[Queued]) -> Vec<BatchOutcome> {
    batch.iter().map(|_| BatchOutcome::NotSent).collect()
}

fn lost(batch: &[Queued], reason: String) -> Vec<BatchOutcome> {
    debug!(reports = batch.len(), %reason, "a batch of reports got no answer; each goes again by itself");
    batch
        .iter()
        .map(|_| BatchOutcome::Lost(reason.clone()))
        .collect()
}

#[cfg(test)]
#[path = "report_batch_tests.rs"]
mod tests;

/// The session of a report's lease.
fn report_session(report: &ReportRequest) -> String {
    report.lease.id.session_id.clone()
}
