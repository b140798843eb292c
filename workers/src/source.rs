//! Where a worker pool gets its tasks and sends its results: one trait, with the in-process
//! implementation over an [`Engine`] here and the HTTP one (a server) in `cairn-remote`, so
//! the same pool code serves `cairn run` and `cairn worker`.

use async_trait::async_trait;
use cairn_ledger::{JsonText, Usage};
use cairn_runtime::{
    ActivityReport, DeltaEvent, Engine, Lease, LeaseHolder, LeaseRequest, LeasedTask, Result,
    TaskFilter, TaskReceiver,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;

/// The worker's side of the lease protocol.
#[async_trait]
pub trait TaskSource: Send + Sync + 'static {
    /// Leases up to `max` tasks that `filter` accepts, each for `lease_ms`, with what they
    /// run; waits up to `wait` for the first one (a long poll, never a busy one).
    async fn lease(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        wait: Duration,
    ) -> Result<Vec<LeasedTask>>;

    /// Leases like [`TaskSource::lease`]; meanwhile, a source in this process may give the
    /// tasks an append of its own queues to `receiver` at once, leased with the append,
    /// rather than return them ([`Engine::lease_tasks_waiting_receiving`]). By default it
    /// leases, and gives `receiver` nothing.
    async fn lease_or_receive(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        wait: Duration,
        receiver: Arc<dyn TaskReceiver>,
    ) -> Result<Vec<LeasedTask>> {
        let _ = receiver;
        self.lease(filter, max, lease_ms, wait).await
    }

    /// Renews a lease, recording `details` durably when given; returns the new expiry.
    /// `LeaseLost` means stop: the task was cancelled or completed, or the lease lapsed.
    async fn heartbeat(
        &self,
        lease: &Lease,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64>;

    /// Records what a model attempt streamed since its previous record.
    async fn record_progress(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
    ) -> Result<()>;

    /// [`TaskSource::record_progress`] with the usage the run's stream reported so far (what
    /// is known of it if the run is lost). By default the usage is not passed on.
    async fn record_progress_with_usage(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
        usage: Option<Usage>,
    ) -> Result<()> {
        let _ = usage;
        self.record_progress(lease, text_appended, thinking_appended)
            .await
    }

    /// Reports an attempt's result, fenced by its lease attempt: a stale one is
    /// `StaleReport` or `LeaseLost` and changes nothing.
    async fn report(&self, lease: &Lease, report: ActivityReport) -> Result<()>;

    /// Reports like [`TaskSource::report`], and takes up to `next.max` due tasks for the same
    /// worker with it when the source can (eager dispatch: the report that queues a session's
    /// next task hands it to the worker that reported). By default it reports, and takes none.
    async fn report_and_lease(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: &LeaseRequest,
    ) -> Result<Vec<LeasedTask>> {
        let _ = next;
        self.report(lease, report).await?;
        Ok(Vec::new())
    }

    /// Reports several attempts at once (a model's parallel tool calls that one slot ran in
    /// turn), like [`TaskSource::report_and_lease`] for the first and [`TaskSource::report`]
    /// for the others; answers each, in order, the first with the tasks taken. A source that
    /// can records them together, in one append; by default they are sent side by side, so
    /// that a source holding a report for its siblings' gets them all at once.
    async fn report_all_and_lease(
        &self,
        reports: Vec<(Lease, ActivityReport)>,
        next: &LeaseRequest,
    ) -> Vec<Result<Vec<LeasedTask>>> {
        let sends = reports
            .into_iter()
            .enumerate()
            .map(|(at, (lease, report))| async move {
                match at {
                    0 => self.report_and_lease(&lease, report, next).await,
                    _ => self.report(&lease, report).await.map(|()| Vec::new()),
                }
            });
        futures_util::future::join_all(sends).await
    }

    /// Passes a model delta on to the session's followers (presentation only: may be lost).
    fn publish_delta(&self, delta: DeltaEvent);

    /// Session ids whose running activities should stop at once, when the source can say
    /// so; otherwise cancellation reaches an activity when its next heartbeat finds its
    /// lease lost.
    fn cancellations(&self) -> Option<broadcast::Receiver<String>>;

    /// The source's clock (epoch ms), for schedule-to-start checks and lease expiries.
    fn now_ms(&self) -> u64;

    /// Whether a report or a lease renewal may fail for a while and then go through (a
    /// database restarting, its connections all taken: an error that
    /// [`is_retryable`](cairn_runtime::Error::is_retryable)) without the source trying
    /// again itself. The pool then keeps a copy of each report to send again, and takes a
    /// failed renewal for a passing one, while the lease holds. Default: no.
    fn fails_for_now(&self) -> bool {
        false
    }
}

/// The in-process source: the engine itself.
#[derive(Clone)]
pub struct EngineSource {
    engine: Engine,
}

impl EngineSource {
    /// A source over `engine`.
    pub fn new(engine: Engine) -> Self {
        EngineSource { engine }
    }
}

#[async_trait]
impl TaskSource for EngineSource {
    async fn lease(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        wait: Duration,
    ) -> Result<Vec<LeasedTask>> {
        let deadline = tokio::time::Instant::now() + wait;
        self.engine
            .lease_tasks_waiting(
                filter,
                max,
                lease_ms,
                deadline,
                std::future::pending(),
                LeaseHolder::InProcess,
            )
            .await
    }

    async fn lease_or_receive(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        wait: Duration,
        receiver: Arc<dyn TaskReceiver>,
    ) -> Result<Vec<LeasedTask>> {
        let deadline = tokio::time::Instant::now() + wait;
        self.engine
            .lease_tasks_waiting_receiving(filter, max, lease_ms, deadline, receiver)
            .await
    }

    async fn heartbeat(
        &self,
        lease: &Lease,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        self.engine.heartbeat(lease, lease_ms, details).await
    }

    async fn record_progress(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
    ) -> Result<()> {
        self.engine
            .record_progress(lease, text_appended, thinking_appended)
            .await
    }

    async fn record_progress_with_usage(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
        usage: Option<Usage>,
    ) -> Result<()> {
        self.engine
            .record_progress_with_usage(lease, text_appended, thinking_appended, usage)
            .await
    }

    async fn report(&self, lease: &Lease, report: ActivityReport) -> Result<()> {
        self.engine.report(lease, report).await
    }

    async fn report_and_lease(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: &LeaseRequest,
    ) -> Result<Vec<LeasedTask>> {
        self.engine.report_and_lease(lease, report, next).await
    }

    async fn report_all_and_lease(
        &self,
        reports: Vec<(Lease, ActivityReport)>,
        next: &LeaseRequest,
    ) -> Vec<Result<Vec<LeasedTask>>> {
        self.engine.report_all_and_lease(reports, Some(next)).await
    }

    fn publish_delta(&self, delta: DeltaEvent) {
        self.engine.publish_delta(delta);
    }

    fn cancellations(&self) -> Option<broadcast::Receiver<String>> {
        Some(self.engine.subscribe_cancellations())
    }

    fn now_ms(&self) -> u64 {
        self.engine.now_ms()
    }

    /// A store other processes share is a database, which may be unavailable for a while;
    /// an embedded store's failures are for good.
    fn fails_for_now(&self) -> bool {
        self.engine.store().shared()
    }
}
