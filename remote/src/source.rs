//! The worker's side of the lease protocol over the `/v1/worker` routes: a [`TaskSource`]
//! that a [`cairn_workers::WorkerPool`] runs over, in a process other than the server's.
//!
//! Results are what a worker must not lose: a report or a heartbeat that fails on the way
//! (the server restarting, a broken connection, a 5xx) is tried again with backoff for as
//! long as its lease lasts, each try given at most half of what the lease has left (so one
//! stuck on a dead connection leaves time for another); a 409 (`stale_report`, `lease_lost`)
//! is final. Deltas are presentation only: they are batched off the activity's path and may
//! be dropped. Those of its session not sent yet when an activity reports go with its
//! report, which the server passes on first: one request fewer in series per model call
//! than sending them ahead of it. Reports that finish together go in one request
//! ([`crate::report_batch`]).

use crate::connection::{Connection, Request, Subject, REQUEST_TIMEOUT};
use crate::report_batch::{BatchOutcome, Entry, ReportBatcher};
use crate::tool_sets::ToolSetCache;
use crate::transcripts::TranscriptCache;
use crate::transport::{new_idempotency_key, retryable};
use async_trait::async_trait;
use cairn_ledger::JsonText;
use cairn_runtime::wire::{
    DeltaBatch, HeartbeatRequest, HeartbeatResponse, LeaseRequest, LeaseResponse, NextTasks,
    ProgressRequest, ReportRequest, ReportResponse,
};
use cairn_runtime::{
    ActivityFailure, ActivityInput, ActivityReport, DeltaEvent, Error, ErrorClass, Lease,
    LeaseRequest as StoreLeaseRequest, LeasedTask, Result, TaskFilter, TaskId,
};
use cairn_workers::TaskSource;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

/// Deltas are sent at most this long after they were published...
const DELTA_BATCH_INTERVAL: Duration = Duration::from_millis(50);
/// ...or as soon as this many are waiting.
const DELTA_BATCH_MAX: usize = 256;
/// Deltas waiting to be sent at most; past it new ones are dropped rather than waited for.
const DELTA_QUEUE: usize = 8192;
/// How long one batch may take to send.
const DELTA_POST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a report waits for the deltas published before it to be sent (so a session's
/// followers see an answer's text before its completion).
const DELTA_FLUSH_WAIT: Duration = Duration::from_secs(6);

/// The shortest time one try of a report, heartbeat or progress record is given, however
/// little its lease has left.
const MIN_TRY_TIMEOUT: Duration = Duration::from_secs(1);
/// The first and the longest pause between tries of a report or a heartbeat.
const RETRY_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));
/// The first and the longest pause after a failed lease request, so that a worker whose
/// server is down does not spin.
const LEASE_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// A task source whose tasks come from a cairn server (`http(s)://HOST:PORT` or
/// `unix:PATH`).
pub struct HttpTaskSource {
    connection: Arc<Connection>,
    /// Sends the first tries of reports that finish together in one request.
    batcher: Arc<ReportBatcher>,
    /// The tool sets its model tasks brought, which the server then leaves out of them.
    tool_sets: Arc<ToolSetCache>,
    /// The transcripts its model tasks brought, whose messages the server then leaves out of
    /// the session's later ones.
    transcripts: Arc<TranscriptCache>,
    /// The delta batcher's queue, started by the first delta.
    deltas: OnceLock<mpsc::Sender<Batched>>,
    /// The latest expiry known of each lease this source handed out: a retry stops there.
    expiries: Mutex<HashMap<(TaskId, u32), u64>>,
    contact: watch::Sender<Contact>,
    lease_failures: AtomicU32,
    /// The server refused a report with tasks to lease (it predates eager dispatch).
    eager_refused: AtomicBool,
    /// The server refused a report with deltas (it predates the field): they go by themselves.
    deltas_refused: AtomicBool,
    /// The `Idempotency-Key` of a lease request whose answer did not come back, and how many
    /// tasks it asked for: the next request goes under it, so that the server answers with
    /// what the lost answer held instead of those tasks waiting, leased to nobody, for their
    /// leases to lapse.
    unanswered_lease: Mutex<Option<(String, usize)>>,
}

/// Whether the server has answered a lease request yet.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Contact {
    Waiting,
    Reached,
    /// It answered with an error that asking again will not change (a refused token).
    Refused {
        status: u16,
        code: String,
        message: String,
    },
}

enum Batched {
    Delta(DeltaEvent),
    /// Send everything queued before this, then acknowledge.
    Flush(oneshot::Sender<()>),
    /// Hand over the deltas of this session queued before this and not sent yet, unsent: a
    /// report of its activity carries them ([`ReportRequest::deltas`]). Other sessions'
    /// stay in the batch: carried by this report, they could reach their followers after
    /// later ones sent by themselves, or be lost with a report that got nowhere.
    Take(String, oneshot::Sender<Vec<DeltaEvent>>),
}

impl HttpTaskSource {
    /// A source leasing from the server at `url`, sending `token` as a bearer token when
    /// given. Nothing is sent until the pool first leases.
    pub fn new(url: &str, token: Option<String>) -> Result<Self> {
        let (contact, _) = watch::channel(Contact::Waiting);
        let connection = Arc::new(Connection::new(url, token)?);
        let tool_sets = Arc::new(ToolSetCache::default());
        let transcripts = Arc::new(TranscriptCache::default());
        Ok(HttpTaskSource {
            batcher: ReportBatcher::new(
                Arc::clone(&connection),
                Arc::clone(&tool_sets),
                Arc::clone(&transcripts),
            ),
            tool_sets,
            transcripts,
            connection,
            deltas: OnceLock::new(),
            expiries: Mutex::default(),
            contact,
            lease_failures: AtomicU32::new(0),
            eager_refused: AtomicBool::new(false),
            deltas_refused: AtomicBool::new(false),
            unanswered_lease: Mutex::new(None),
        })
    }

    /// The server's address as given.
    pub fn url(&self) -> &str {
        self.connection.url()
    }

    /// Waits until the server first answered a lease request: `Ok` once it did, the error
    /// when it refused one in a way asking again will not change (a token it does not know
    /// or of the wrong role, a request it finds invalid). A server that cannot be reached
    /// is waited for: the pool keeps trying.
    pub async fn reached(&self) -> Result<()> {
        let mut contact = self.contact.subscribe();
        let state = contact
            .wait_for(|c| *c != Contact::Waiting)
            .await
            .map(|c| c.clone())
            // The sender lives in `self`, so it cannot be gone while we wait.
            .unwrap_or(Contact::Waiting);
        match state {
            Contact::Refused {
                status,
                code,
                message,
            } => Err(Error::Remote {
                url: self.url().to_owned(),
                status,
                code,
                message,
            }),
            Contact::Reached | Contact::Waiting => Ok(()),
        }
    }

    /// A POST of `body` to the worker route `path`, listing the tool sets and the transcripts
    /// this worker keeps ([`cairn_runtime::wire::TOOL_SETS_HEADER`],
    /// [`cairn_runtime::wire::TRANSCRIPTS_HEADER`]).
    fn worker_request(&self, path: &str, body: &impl Serialize) -> Request {
        let mut request = Request::post(path, body);
        request.tool_sets = Some(self.tool_sets.header());
        request.transcripts = Some(self.transcripts.header());
        request
    }

    /// A report of `lease`'s attempt as [`HttpTaskSource::worker_request`] makes it, but
    /// listing the transcript of the lease's session first: what a report leases (eager
    /// dispatch) is first of all that session's next task.
    fn report_request(&self, lease: &Lease, body: &impl Serialize) -> Request {
        let mut request = Request::post("/v1/worker/report", body);
        request.tool_sets = Some(self.tool_sets.header());
        request.transcripts = Some(self.transcripts.header_for(&[&lease.id.session_id]));
        request
    }

    /// `tasks` made whole: the tools and the transcript's first messages the server left out
    /// of their model tasks filled in, from what this worker keeps or, for what it let go
    /// meanwhile, by fetching the task's input whole again. A task whose input cannot be
    /// fetched is left out: its lease lapses and the attempt is retried under its policy, as
    /// for any task lost on the way.
    async fn made_whole(&self, mut tasks: Vec<LeasedTask>) -> Vec<LeasedTask> {
        let mut missing = self.tool_sets.fill(&mut tasks);
        missing.extend(self.transcripts.fill(&mut tasks));
        if missing.is_empty() {
            return tasks;
        }
        missing.sort_unstable();
        missing.dedup();
        let mut lost = Vec::new();
        for i in missing {
            let lease = &tasks[i].lease;
            let fetched = self
                .connection
                .call_json::<ActivityInput>(
                    Request::post("/v1/worker/input", lease),
                    subject_of(lease),
                    self.try_timeout(lease),
                )
                .await;
            match fetched {
                Ok(input) => {
                    // Whole: kept for the session's next tasks.
                    tasks[i].input = input;
                    let fetched = std::slice::from_mut(&mut tasks[i]);
                    self.tool_sets.fill(fetched);
                    self.transcripts.fill(fetched);
                }
                Err(e) => {
                    warn!(task = %lease.id, error = %e, "a task's tools are not kept here and its input could not be fetched again; it is retried once its lease lapses");
                    lost.push(i);
                }
            }
        }
        tasks
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !lost.contains(i))
            .map(|(_, task)| task)
            .collect()
    }

    /// The value of the header listing the transcripts it keeps.
    #[cfg(test)]
    pub(crate) fn transcripts_header(&self) -> Arc<str> {
        self.transcripts.header()
    }

    /// How many leases this source keeps an expiry of.
    #[cfg(test)]
    pub(crate) fn leases_known(&self) -> usize {
        self.lock_expiries().len()
    }

    fn lock_expiries(&self) -> std::sync::MutexGuard<'_, HashMap<(TaskId, u32), u64>> {
        self.expiries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_unanswered_lease(&self) -> std::sync::MutexGuard<'_, Option<(String, usize)>> {
        self.unanswered_lease
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// When `lease` lapses, as far as this source knows.
    fn expiry(&self, lease: &Lease) -> u64 {
        let known = self
            .lock_expiries()
            .get(&(lease.id.clone(), lease.lease_attempt))
            .copied();
        known.unwrap_or(0).max(lease.expires_at_ms)
    }

    /// How long one try of a request under `lease` may take: half the time the lease has
    /// left, at least [`MIN_TRY_TIMEOUT`] and at most [`REQUEST_TIMEOUT`]. A try stuck on a
    /// connection that went dead without a reset (a NAT or a balancer that dropped it) is
    /// given up while the lease still has time for another try on a new connection, rather
    /// than outliving the lease it was sent to keep.
    fn try_timeout(&self, lease: &Lease) -> Duration {
        let left_ms = self.expiry(lease).saturating_sub(self.now_ms());
        Duration::from_millis(left_ms / 2).clamp(MIN_TRY_TIMEOUT, REQUEST_TIMEOUT)
    }

    /// Sends `request` until it succeeds, fails for good, or `lease` has lapsed (no later
    /// try could be accepted then). Each try is bounded by [`Self::try_timeout`]. With
    /// `first`, the outcome of a first try made already, the tries go on from there.
    async fn with_retries(
        &self,
        lease: &Lease,
        mut first: Option<Result<Vec<u8>>>,
        request: impl Fn() -> Request,
    ) -> Result<Vec<u8>> {
        let subject = subject_of(lease);
        let mut backoff = RETRY_BACKOFF.0;
        loop {
            let tried = match first.take() {
                Some(tried) => tried,
                None => {
                    self.connection
                        .call(request(), subject, self.try_timeout(lease))
                        .await
                }
            };
            match tried {
                Ok(body) => return Ok(body),
                Err(e) if retryable(&e) => {
                    let pause_ms = u64::try_from(backoff.as_millis()).unwrap_or(u64::MAX);
                    if self.now_ms().saturating_add(pause_ms) >= self.expiry(lease) {
                        return Err(e);
                    }
                    debug!(task = %lease.id, error = %e, "trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_BACKOFF.1);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The deltas of `lease`'s session published so far and not sent yet, for the report of
    /// its activity to carry, once those sent before them are (so they stay in order); or,
    /// with a server that takes no deltas with a report, none, once all of them are sent by
    /// themselves. (A session streams one model call at a time: its deltas are that call's.)
    async fn deltas_for_report(&self, lease: &Lease) -> Vec<DeltaEvent> {
        if self.deltas_refused.load(Ordering::Relaxed) {
            self.flush_deltas().await;
            return Vec::new();
        }
        let Some(queue) = self.deltas.get() else {
            return Vec::new();
        };
        let (reply, taken) = oneshot::channel();
        let session = lease.id.session_id.clone();
        if queue.send(Batched::Take(session, reply)).await.is_err() {
            return Vec::new();
        }
        match tokio::time::timeout(DELTA_FLUSH_WAIT, taken).await {
            Ok(Ok(deltas)) => deltas,
            _ => Vec::new(),
        }
    }

    /// What a report asks the server to lease with it, when it can: a server leases the
    /// tasks of the token's namespace only, and one from before eager dispatch refuses the
    /// field (the report then goes alone).
    fn next_tasks(&self, next: &StoreLeaseRequest) -> Option<NextTasks> {
        if next.max == 0
            || next.filter.sessions.is_some()
            || next.filter.namespace.is_some()
            || self.eager_refused.load(Ordering::Relaxed)
        {
            return None;
        }
        Some(NextTasks {
            max: u32::try_from(next.max).unwrap_or(u32::MAX),
            lease_ms: next.lease_ms,
            queues: next.filter.queues.clone(),
            tools: next.filter.tools.clone(),
            providers: next.filter.providers.clone(),
        })
    }

    /// The tasks leased with a report whose request ended with `result`; the report's lease
    /// is forgotten either way.
    async fn leased_with_report(
        &self,
        lease: &Lease,
        result: Result<Vec<u8>>,
    ) -> Result<Vec<LeasedTask>> {
        self.lock_expiries()
            .remove(&(lease.id.clone(), lease.lease_attempt));
        let answer = result?;
        // The report is recorded; what came with it is a bonus. An answer without a body
        // (204) leased nothing, and tasks in an answer that does not decode are recorded as
        // timed out when their leases lapse, and retried under their policies.
        if answer.is_empty() {
            return Ok(Vec::new());
        }
        let tasks = match self
            .connection
            .decode::<ReportResponse>("POST /v1/worker/report", &answer)
        {
            Ok(answer) => self.made_whole(answer.tasks).await,
            Err(e) => {
                tracing::warn!(error = %e, "the tasks leased with a report are lost until their leases lapse");
                return Ok(Vec::new());
            }
        };
        let mut expiries = self.lock_expiries();
        for task in &tasks {
            let lease = &task.lease;
            expiries.insert((lease.id.clone(), lease.lease_attempt), lease.expires_at_ms);
        }
        Ok(tasks)
    }

    /// Posts a report. A server from before a field the report carries refuses it as unknown
    /// (400): without `next` the report goes again and leases nothing; without `deltas` they
    /// go by themselves first, then the report without them; and later reports leave the
    /// field out from the start. A report refused as too large (413) with deltas goes again
    /// without them; one refused so without any would be refused again however often the
    /// activity ran, so the attempt is reported failed instead, saying so (`invalid_request`,
    /// which the default retry policies do not retry: the model reads it as the call's error
    /// result, or the turn fails on it). Dropped, it would run again on every lapsed lease, its
    /// side effects repeated, and fail at last as a lease that lapsed.
    ///
    /// Only the first try carries the deltas: a try that failed may still have reached the
    /// server, which passed them on to the session's followers before it recorded the report
    /// and lost the answer, and they must not see the same text twice. A later try goes
    /// without them ([`ResentReport`]); should the first have got nowhere, they are missed,
    /// as deltas may be.
    async fn post_report(&self, lease: &Lease, body: ReportRequest) -> Result<Vec<u8>> {
        let entry = self.batcher.enter(&body, self.try_timeout(lease));
        self.post_entered_report(lease, body, entry).await
    }

    /// [`Self::post_report`], its first try gone as `entry` says.
    async fn post_entered_report(
        &self,
        lease: &Lease,
        mut body: ReportRequest,
        entry: Entry,
    ) -> Result<Vec<u8>> {
        // `None` when it did not reach the server: the next try goes as a first.
        let mut first_try = self.first_report_try(lease, &body, entry).await;
        loop {
            let first_try = first_try.take();
            let tried = AtomicBool::new(first_try.is_some());
            let result = self
                .with_retries(lease, first_try, || {
                    if tried.swap(true, Ordering::Relaxed) && !body.deltas.is_empty() {
                        self.report_request(lease, &ResentReport::of(&body))
                    } else {
                        self.report_request(lease, &body)
                    }
                })
                .await;
            // Too large with the deltas it carries: the result may fit by itself, and the
            // deltas are presentation only, so the report goes again without them (as a try
            // after the first does; 413 means the server took nothing of the body).
            if let Err(Error::Remote {
                status: 413,
                message,
                ..
            }) = &result
            {
                if !body.deltas.is_empty() {
                    debug!("the report was too large with its deltas; sending it without them");
                    body.deltas.clear();
                    continue;
                }
                if !matches!(body.report, ActivityReport::Failed(_)) {
                    warn!(
                        session_id = %lease.id.session_id,
                        task = %lease.id,
                        reason = %message,
                        "the server refused the result as too large; reporting the attempt failed"
                    );
                    body.report = ActivityReport::Failed(ActivityFailure::new(
                        ErrorClass::InvalidRequest,
                        format!(
                            "the result was not recorded: the server refused it as too large \
                             ({message}); running the call again would give the same"
                        ),
                    ));
                    continue;
                }
            }
            let Err(Error::Remote {
                status: 400,
                message,
                ..
            }) = &result
            else {
                return result;
            };
            if !body.deltas.is_empty() && message.contains("unknown field `deltas`") {
                debug!("the server takes no deltas with a report; sending them by themselves from now on");
                self.deltas_refused.store(true, Ordering::Relaxed);
                post_deltas(&self.connection, std::mem::take(&mut body.deltas)).await;
            } else if body.next.is_some() && message.contains("unknown field `next`") {
                debug!("the server takes no tasks with a report; reporting alone from now on");
                self.eager_refused.store(true, Ordering::Relaxed);
                body.next = None;
            } else {
                return result;
            }
        }
    }

    /// The first try of a report, as the batcher's `entry` says: by itself when fewer than
    /// two report requests are on their way, else in a batch with the reports that finish
    /// meanwhile ([`crate::report_batch`]). `None`: it did not reach the server (the next try
    /// is a first try again, deltas and all).
    async fn first_report_try(
        &self,
        lease: &Lease,
        body: &ReportRequest,
        entry: Entry,
    ) -> Option<Result<Vec<u8>>> {
        match entry {
            Entry::Alone(in_flight) => {
                let answer = self
                    .connection
                    .call(
                        self.report_request(lease, body),
                        subject_of(lease),
                        self.try_timeout(lease),
                    )
                    .await;
                drop(in_flight);
                Some(answer)
            }
            Entry::Queued(outcome) => match outcome.await {
                Ok(BatchOutcome::Answered(status, answer)) => {
                    Some(self.connection.answer(status, answer, subject_of(lease)))
                }
                Ok(BatchOutcome::Lost(reason)) => {
                    Some(Err(self.connection.unreachable_because(&reason)))
                }
                // Never sent (also when the batch could not be: the process is ending).
                Ok(BatchOutcome::NotSent) | Err(_) => None,
            },
        }
    }

    /// Waits (briefly) until the deltas published so far have been sent.
    pub(crate) async fn flush_deltas(&self) {
        let Some(queue) = self.deltas.get() else {
            return;
        };
        let (ack, acked) = oneshot::channel();
        if queue.send(Batched::Flush(ack)).await.is_ok() {
            let _ = tokio::time::timeout(DELTA_FLUSH_WAIT, acked).await;
        }
    }
}

#[async_trait]
impl TaskSource for HttpTaskSource {
    async fn lease(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        wait: Duration,
    ) -> Result<Vec<LeasedTask>> {
        if filter.sessions.is_some() || filter.namespace.is_some() {
            return Err(Error::Unsupported {
                what: "leasing only some sessions' tasks (a server gives a worker the tasks of its token's namespace)".to_owned(),
            });
        }
        // The first request answers at once, so the worker knows soon that the server took it
        // (`reached`), rather than after a whole long poll of an empty queue.
        let wait = if *self.contact.borrow() == Contact::Waiting {
            Duration::ZERO
        } else {
            wait
        };
        let body = LeaseRequest {
            max: u32::try_from(max).unwrap_or(u32::MAX),
            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            lease_ms,
            queues: filter.queues.clone(),
            tools: filter.tools.clone(),
            providers: filter.providers.clone(),
        };
        // The key of the last request if its answer was lost, unless this one asks for
        // fewer tasks than it did (the pool takes no more than it asks for).
        let key = self
            .lock_unanswered_lease()
            .take()
            .filter(|(_, asked)| *asked <= max)
            .map_or_else(new_idempotency_key, |(key, _)| key);
        let mut request = self.worker_request("/v1/worker/lease", &body);
        request.idempotency_key = Some(key.clone());
        let answer = self
            .connection
            .call_json::<LeaseResponse>(request, Subject::default(), REQUEST_TIMEOUT + wait)
            .await;
        if matches!(&answer, Err(e) if retryable(e)) {
            *self.lock_unanswered_lease() = Some((key, max));
        }
        match answer {
            Ok(answer) => {
                self.lease_failures.store(0, Ordering::Relaxed);
                self.contact.send_if_modified(|c| {
                    let first = *c == Contact::Waiting;
                    *c = Contact::Reached;
                    first
                });
                let tasks = self.made_whole(answer.tasks).await;
                let mut expiries = self.lock_expiries();
                for task in &tasks {
                    let lease = &task.lease;
                    expiries.insert((lease.id.clone(), lease.lease_attempt), lease.expires_at_ms);
                }
                Ok(tasks)
            }
            Err(e) => {
                if !retryable(&e) {
                    let (status, code) = match &e {
                        Error::Remote { status, code, .. } => (*status, code.clone()),
                        _ => (0, "refused".to_owned()),
                    };
                    let message = match &e {
                        Error::Remote { message, .. } => message.clone(),
                        other => other.to_string(),
                    };
                    self.contact.send_if_modified(|c| {
                        let first = *c == Contact::Waiting;
                        if first {
                            *c = Contact::Refused {
                                status,
                                code,
                                message,
                            };
                        }
                        first
                    });
                }
                // Pause before answering, so that a pool asking again at once does not spin
                // on a server that is down; the pool's own pause comes on top.
                let failures = self.lease_failures.fetch_add(1, Ordering::Relaxed);
                let pause = LEASE_BACKOFF
                    .0
                    .saturating_mul(1 << failures.min(16))
                    .min(LEASE_BACKOFF.1);
                tokio::time::sleep(pause).await;
                Err(e)
            }
        }
    }

    async fn heartbeat(
        &self,
        lease: &Lease,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        let body = HeartbeatRequest {
            lease: lease.clone(),
            lease_ms,
            details,
        };
        let answer = match self
            .with_retries(lease, None, || Request::post("/v1/worker/heartbeat", &body))
            .await
        {
            Ok(answer) => answer,
            Err(e) => {
                // The lease is lost, or lapsed while the server could not be reached: the
                // attempt ends without a report, which is what forgets a lease otherwise.
                self.lock_expiries()
                    .remove(&(lease.id.clone(), lease.lease_attempt));
                return Err(e);
            }
        };
        let answer: HeartbeatResponse = self
            .connection
            .decode("POST /v1/worker/heartbeat", &answer)?;
        self.lock_expiries().insert(
            (lease.id.clone(), lease.lease_attempt),
            answer.expires_at_ms,
        );
        Ok(answer.expires_at_ms)
    }

    async fn record_progress(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
    ) -> Result<()> {
        self.record_progress_with_usage(lease, text_appended, thinking_appended, None)
            .await
    }

    async fn record_progress_with_usage(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
        usage: Option<cairn_ledger::Usage>,
    ) -> Result<()> {
        // Presentation only, and the next record carries on from what this one held: one try.
        let body = ProgressRequest {
            lease: lease.clone(),
            text_appended,
            thinking_appended,
            usage,
        };
        let subject = Subject {
            session_id: Some(&lease.id.session_id),
            lease: Some(lease),
        };
        self.connection
            .call(
                Request::post("/v1/worker/progress", &body),
                subject,
                self.try_timeout(lease),
            )
            .await?;
        Ok(())
    }

    async fn report(&self, lease: &Lease, report: ActivityReport) -> Result<()> {
        // The followers of the session see the streamed text before the response that ends it:
        // the report carries what is not sent yet.
        let body = ReportRequest {
            lease: lease.clone(),
            report,
            next: None,
            deltas: self.deltas_for_report(lease).await,
        };
        let result = self.post_report(lease, body).await;
        self.lock_expiries()
            .remove(&(lease.id.clone(), lease.lease_attempt));
        result.map(|_| ())
    }

    async fn report_and_lease(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: &StoreLeaseRequest,
    ) -> Result<Vec<LeasedTask>> {
        let Some(next) = self.next_tasks(next) else {
            self.report(lease, report).await?;
            return Ok(Vec::new());
        };
        let body = ReportRequest {
            lease: lease.clone(),
            report,
            next: Some(next),
            deltas: self.deltas_for_report(lease).await,
        };
        let result = self.post_report(lease, body).await;
        self.leased_with_report(lease, result).await
    }

    /// The reports of calls a slot ran in turn go in one batch request (`POST
    /// /v1/worker/reports`), sent at once, where the trait's default would send one request
    /// each; the server records them at once, in one commit. Each goes on by itself from
    /// there, as any report does when its batch fails.
    async fn report_all_and_lease(
        &self,
        reports: Vec<(Lease, ActivityReport)>,
        next: &StoreLeaseRequest,
    ) -> Vec<Result<Vec<LeasedTask>>> {
        let mut next = self.next_tasks(next);
        let deltas = futures_util::future::join_all(
            reports
                .iter()
                .map(|(lease, _)| self.deltas_for_report(lease)),
        )
        .await;
        let bodies: Vec<ReportRequest> = reports
            .into_iter()
            .zip(deltas)
            .map(|((lease, report), deltas)| ReportRequest {
                lease,
                report,
                // The first asks for the tasks, as the trait says.
                next: next.take(),
                deltas,
            })
            .collect();
        let timeout = bodies
            .iter()
            .map(|body| self.try_timeout(&body.lease))
            .min()
            .unwrap_or(MIN_TRY_TIMEOUT);
        let (entries, send_now) = self
            .batcher
            .enter_together(&bodies.iter().collect::<Vec<_>>(), timeout);
        let posts = bodies
            .into_iter()
            .zip(entries)
            .map(|(body, entry)| async move {
                let lease = body.lease.clone();
                let result = self.post_entered_report(&lease, body, entry).await;
                self.leased_with_report(&lease, result).await
            });
        let posted = futures_util::future::join_all(posts);
        match send_now {
            Some(send) => futures_util::future::join(send, posted).await.1,
            None => posted.await,
        }
    }

    fn publish_delta(&self, delta: DeltaEvent) {
        let queue = self.deltas.get_or_init(|| {
            let (queue, batches) = mpsc::channel(DELTA_QUEUE);
            // Pools publish from their tasks, so a runtime is there; without one the
            // batcher's end of the queue is dropped and deltas with it.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(send_deltas(self.connection.clone(), batches));
            }
            queue
        });
        if let Err(e) = queue.try_send(Batched::Delta(delta)) {
            // Never wait in the activity's path: a delta is presentation only.
            debug!(error = %e, "delta dropped");
        }
    }

    fn cancellations(&self) -> Option<broadcast::Receiver<String>> {
        // A server cannot push to a worker: a cancelled activity learns of it when its next
        // heartbeat finds the lease gone (see `WorkerConfig::renew_interval_ms`).
        None
    }

    // The worker's own clock, against the server's lease expiries: they are meant to run on
    // synchronised clocks, and a skew only moves when a retry gives up.
    #[allow(clippy::disallowed_methods)]
    fn now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A report tried again: a [`ReportRequest`] without the deltas its first try carried.
#[derive(Serialize)]
struct ResentReport<'a> {
    lease: &'a Lease,
    report: &'a ActivityReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<&'a NextTasks>,
}

impl<'a> ResentReport<'a> {
    fn of(body: &'a ReportRequest) -> Self {
        ResentReport {
            lease: &body.lease,
            report: &body.report,
            next: body.next.as_ref(),
        }
    }
}

/// Posts one batch of deltas; a failure drops them (they are presentation only).
async fn post_deltas(connection: &Connection, deltas: Vec<DeltaEvent>) {
    let body = DeltaBatch { deltas };
    let sent = connection
        .call(
            Request::post("/v1/worker/deltas", &body),
            Subject::default(),
            DELTA_POST_TIMEOUT,
        )
        .await;
    if let Err(e) = sent {
        debug!(error = %e, deltas = body.deltas.len(), "sending model deltas failed; they are dropped");
    }
}

/// Sends the queued deltas in batches, in order, until the source is dropped (its end of the
/// queue closes). A batch goes when [`DELTA_BATCH_MAX`] are waiting or [`DELTA_BATCH_INTERVAL`]
/// after its first delta, and at once on a flush.
async fn send_deltas(connection: Arc<Connection>, mut queue: mpsc::Receiver<Batched>) {
    let mut batch = Vec::new();
    let mut acks = Vec::new();
    let mut taker = None;
    while let Some(first) = queue.recv().await {
        let mut open = true;
        match first {
            Batched::Delta(delta) => {
                batch.push(delta);
                let deadline = Instant::now() + DELTA_BATCH_INTERVAL;
                while batch.len() < DELTA_BATCH_MAX {
                    tokio::select! {
                        next = queue.recv() => match next {
                            Some(Batched::Delta(delta)) => batch.push(delta),
                            Some(Batched::Flush(ack)) => {
                                acks.push(ack);
                                break;
                            }
                            Some(Batched::Take(session, reply)) => {
                                taker = Some((session, reply));
                                break;
                            }
                            None => {
                                open = false;
                                break;
                            }
                        },
                        _ = tokio::time::sleep_until(deadline) => break,
                    }
                }
            }
            Batched::Flush(ack) => acks.push(ack),
            Batched::Take(session, reply) => taker = Some((session, reply)),
        }
        if let Some((session, reply)) = taker.take() {
            // A report carries its session's: they are not sent here. Should it have given
            // up waiting, they are dropped, as a delta that finds the queue full is.
            let (taken, others) = std::mem::take(&mut batch)
                .into_iter()
                .partition(|delta: &DeltaEvent| delta.origin.session_id == session);
            batch = others;
            let _ = reply.send(taken);
        }
        if !batch.is_empty() {
            post_deltas(&connection, std::mem::take(&mut batch)).await;
        }
        for ack in acks.drain(..) {
            let _ = ack.send(());
        }
        if !open {
            return;
        }
    }
}

/// What a request about `lease` is about, so that its error answers map back.
fn subject_of(lease: &Lease) -> Subject<'_> {
    Subject {
        session_id: Some(&lease.id.session_id),
        lease: Some(lease),
    }
}
