//! The worker pool: one leasing loop feeding a bounded set of activity runs.

use crate::models::ModelResolver;
use crate::progress::PendingOutput;
use crate::source::{EngineSource, TaskSource};
use cairn_activities::{
    ActivityContext, CallContext, DeltaSink, ErrorKind, ModelRequest, ToolCall, ToolRegistry,
};
use cairn_ledger::{
    current_turn_start, validate_response, validate_transcript_from, Delta, JsonText,
};
use cairn_runtime::{
    ActivityFailure, ActivityInput, ActivityRef, ActivityReport, DeltaEvent, Engine, Error,
    ErrorClass, FailurePhase, Lease, LeaseHolder, LeaseRequest, LeasedTask, TaskFilter,
    TaskReceiver,
};
use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, info_span, warn, Instrument};

/// [`WorkerConfig::concurrency`]'s default.
pub const DEFAULT_CONCURRENCY: usize = 1_000;

/// Pool settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Activities run at once at most. Default 1,000, as Temporal's Go SDK: an activity
    /// here mostly waits (a model call on the network, for seconds), and a slot is a task,
    /// not a thread; 64 held 128 sessions with 50 ms model calls to half their rate.
    pub concurrency: usize,
    /// Lease length; a running activity renews it every third of it (heartbeat). This long
    /// after a crashed worker's last renewal its leases lapse, and the engine's timers record
    /// those attempts as failed, so their retries run.
    pub lease_ms: u64,
    /// How often to look for due tasks when not woken (catches retries whose backoff ended);
    /// for a remote source, how long a lease request waits for a task. After a failed lease
    /// request the pool asks again after at most 100 ms, whatever this is.
    pub poll_interval_ms: u64,
    /// How often at most a streaming model attempt records what it streamed since its
    /// previous record (a `model_attempt_progress` event), so output a person already saw
    /// survives a crash; a failed attempt records its remainder once more. Each record is one
    /// append sharing the store's group commit, never a flush per delta. `None`: never.
    /// Default 250 ms.
    pub progress_interval_ms: Option<u64>,
    /// Lease only tasks of these sessions (`None`: every session's). Used by `cairn run`,
    /// which must not carry on other sessions' interrupted turns.
    pub only_sessions: Option<BTreeSet<String>>,
    /// The queues it serves (`None`: every queue).
    pub queues: Option<BTreeSet<String>>,
    /// Lease tasks whatever tool or provider they need, and fail those it does not host
    /// (for a process that is the store's only worker, where nobody else could run them).
    /// Otherwise (the default) it declares what it hosts and never gets a task it cannot run.
    pub take_unhosted: bool,
    /// How often a running activity renews its lease at least (sending its heartbeat
    /// details). A remote worker learns of a cancellation when a renewal finds its lease
    /// gone, so this bounds how long a cancelled activity runs on. `None`: a third of the
    /// lease.
    pub renew_interval_ms: Option<u64>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: DEFAULT_CONCURRENCY,
            lease_ms: 30_000,
            poll_interval_ms: 100,
            progress_interval_ms: Some(250),
            only_sessions: None,
            queues: None,
            take_unhosted: false,
            renew_interval_ms: None,
        }
    }
}

/// What the workers can run: model providers and tools.
#[derive(Clone)]
pub struct Activities {
    /// Model providers.
    pub models: Arc<dyn ModelResolver>,
    /// Tools.
    pub tools: Arc<ToolRegistry>,
}

/// A running pool; `shutdown` drains it.
pub struct WorkerPool {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    /// The engine's timer loop, for a pool started on an in-process engine.
    timers: Option<tokio::task::JoinHandle<()>>,
}

/// The longest pause after a failed lease request. The poll interval is not the pause: for a
/// remote source it is the long poll's wait (5 s in `cairn worker`), and such a source backs
/// off by itself, so pausing the poll interval on top left a worker idle for seconds after
/// every restart of its server.
const LEASE_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// How often an in-process pool's engine fires its timers.
const TIMER_INTERVAL: Duration = Duration::from_millis(200);

/// The first and the longest pause before a report, or a lease renewal, that failed for now
/// is sent again ([`TaskSource::fails_for_now`]).
const RESEND_PAUSE: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(1));

impl WorkerPool {
    /// Starts leasing and running tasks of an engine in this process, and the engine's timer
    /// loop beside it (lapsed leases and start deadlines are recorded by the engine, and an
    /// in-process pool is often all there is; a second timer loop on the same engine, as a
    /// server or host runs, only finds nothing left to fire).
    pub fn start(engine: Engine, activities: Activities, config: WorkerConfig) -> Self {
        let timers_engine = engine.clone();
        let mut pool = Self::start_with(Arc::new(EngineSource::new(engine)), activities, config);
        let mut stopped = pool.stop.subscribe();
        pool.timers = Some(tokio::spawn(async move {
            timers_engine
                .run_timers(TIMER_INTERVAL, async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                })
                .await
        }));
        pool
    }

    /// Starts leasing and running tasks from `source` (in-process, or a server).
    pub fn start_with(
        source: Arc<dyn TaskSource>,
        activities: Activities,
        config: WorkerConfig,
    ) -> Self {
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(lease_loop(source, activities, config, stop_rx));
        WorkerPool {
            stop,
            task,
            timers: None,
        }
    }

    /// Stops leasing and waits for the running activities to finish and report.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await {
            warn!(error = %e, "worker pool loop ended abnormally");
        }
        if let Some(timers) = self.timers {
            let _ = timers.await;
        }
    }
}

/// Running activities by session, so that a session's cancellation reaches them.
#[derive(Default)]
struct Running {
    next_id: u64,
    by_id: HashMap<u64, (String, CancellationToken)>,
}

type RunningRegistry = Arc<Mutex<Running>>;

fn lock(running: &RunningRegistry) -> std::sync::MutexGuard<'_, Running> {
    running
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Forwards the engine's cancellations to the tokens of that session's running activities.
/// It runs until the pool has drained, so cancellations reach activities during shutdown too.
async fn cancellation_listener(
    cancellations: Option<tokio::sync::broadcast::Receiver<String>>,
    running: RunningRegistry,
) {
    let Some(mut cancellations) = cancellations else {
        return;
    };
    loop {
        match cancellations.recv().await {
            Ok(session_id) => {
                for (session, token) in lock(&running).by_id.values() {
                    if *session == session_id {
                        token.cancel();
                    }
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
        }
    }
}

/// What a pool with these activities and settings may lease.
pub fn filter_of(activities: &Activities, config: &WorkerConfig) -> TaskFilter {
    let (tools, providers) = if config.take_unhosted {
        (None, None)
    } else {
        (
            Some(
                activities
                    .tools
                    .names()
                    .into_iter()
                    .map(str::to_owned)
                    .collect(),
            ),
            activities.models.providers(),
        )
    };
    TaskFilter {
        queues: config.queues.clone(),
        tools,
        providers,
        sessions: config.only_sessions.clone(),
        namespace: None,
    }
}

/// Tasks a report may hand a slot beyond its own next one, each to a free slot of the pool
/// (eager dispatch of a model call's parallel tool calls: the report that schedules them
/// hands them out with its answer, with no lease round of their own). Like Temporal's eager
/// activities, a bounded few, so that one worker's reports do not take a whole queue while
/// others wait on theirs. The pool's lease loop leaves as many slots free for them while it
/// waits (but asks for one at least).
///
/// Seven, so that a model call's eight parallel tool calls go out together: with three, the
/// other four waited for the lease loop and reported after the first results' shared append
/// had begun, one session's eight-tool turn took 1.36–1.41 ms and 7.8 commits against
/// 1.03 ms and 5.6 with seven (docs/benchmarks.md); two-tool turns measured the same.
pub const MAX_EXTRA_HANDED: usize = 7;

/// What every slot of a pool shares.
struct Slots {
    source: Arc<dyn TaskSource>,
    activities: Activities,
    registry: RunningRegistry,
    timing: Timing,
    /// What a slot's report leases with it (eager dispatch); its `max` is set per report.
    next: LeaseRequest,
    permits: Arc<Semaphore>,
    tracker: TaskTracker,
    /// The pool's runtime: a slot a receiver starts is spawned there, whatever runtime the
    /// append that hands its task runs on.
    runtime: tokio::runtime::Handle,
    stop: watch::Receiver<bool>,
}

/// Starts the tasks an append of this process hands the pool's waiting lease on slots of
/// their own at once ([`TaskSource::lease_or_receive`]): without it, the append would wake
/// the lease loop, which would start them.
struct SlotReceiver(Arc<Slots>);

impl TaskReceiver for SlotReceiver {
    fn receive(&self, tasks: Vec<LeasedTask>) -> Vec<LeasedTask> {
        let slots = &self.0;
        let mut left = Vec::new();
        for task in tasks {
            // Stopping, the pool starts nothing new: the lease, given the task back, returns
            // it to a lease loop that is going (its leases then go to the next lease).
            if *slots.stop.borrow() {
                left.push(task);
                continue;
            }
            match slots.permits.clone().try_acquire_owned() {
                Ok(permit) => slots.spawn(task, permit),
                Err(_) => left.push(task),
            }
        }
        left
    }
}

impl Slots {
    /// Runs `task` on a slot of its own, holding `permit`: then each task its reports hand it
    /// (eager dispatch), until a report hands none or the pool stops. Tasks handed beyond the
    /// slot's own next one get slots of their own.
    fn spawn(self: &Arc<Self>, task: LeasedTask, permit: OwnedSemaphorePermit) {
        let slots = self.clone();
        let runtime = self.runtime.clone();
        self.tracker.spawn_on(
            async move {
                let mut task = Some(task);
                let mut siblings = Vec::new();
                while let Some(this) = task.take() {
                    let eager = (!*slots.stop.borrow()).then_some(EagerDispatch {
                        request: &slots.next,
                        permits: &slots.permits,
                    });
                    let handed = slots.run_tasks(this, siblings, eager).await;
                    task = handed.next;
                    siblings = handed.more;
                }
                // A report hands its slot's next task first: with none, there are no others.
                for (more, permit) in siblings {
                    slots.spawn(more, permit);
                }
                drop(permit);
            },
            &runtime,
        );
    }

    /// Runs `task`, then each of `siblings` of its session in turn while none has had to
    /// wait, and reports those it ran together; returns what their reports handed.
    ///
    /// The siblings are tasks the same report handed (a model's parallel tool calls), each
    /// with a slot of its own. As long as every run so far finished without waiting (tools
    /// that answer at once), running the next here costs less than starting it on its own
    /// slot: no task spawned and no other thread woken, and one report with all the results
    /// instead of one each, which the engine would otherwise hold for one another. As soon
    /// as a run has to wait, every sibling left gets its own slot and runs beside it.
    async fn run_tasks(
        self: &Arc<Self>,
        task: LeasedTask,
        siblings: Vec<(LeasedTask, OwnedSemaphorePermit)>,
        eager: Option<EagerDispatch<'_>>,
    ) -> Handed {
        let session_id = task.lease.id.session_id.clone();
        let mut siblings: std::collections::VecDeque<_> = siblings.into();
        let mut attempted = Vec::new();
        let mut current = Some(task);
        while let Some(task) = current.take() {
            let run = attempt(
                self.source.as_ref(),
                &self.activities,
                &self.registry,
                task,
                self.timing,
            );
            let done = crate::first_wait::on_first_wait(run, || {
                for (more, permit) in siblings.drain(..) {
                    self.spawn(more, permit);
                }
            })
            .await;
            attempted.extend(done);
            while let Some((more, permit)) = siblings.pop_front() {
                if more.lease.id.session_id == session_id {
                    // Its slot is not needed: this one runs it.
                    drop(permit);
                    current = Some(more);
                    break;
                }
                self.spawn(more, permit);
            }
        }
        let handed = finish_all(self.source.as_ref(), attempted, eager).await;
        cairn_runtime::stages::mark("activity.reported");
        handed
    }
}

async fn lease_loop(
    source: Arc<dyn TaskSource>,
    activities: Activities,
    config: WorkerConfig,
    mut stop: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let registry: RunningRegistry = Arc::default();
    let listener = tokio::spawn(cancellation_listener(
        source.cancellations(),
        registry.clone(),
    ));
    let filter = filter_of(&activities, &config);
    let poll = Duration::from_millis(config.poll_interval_ms.max(1));
    let renew_ms = config
        .renew_interval_ms
        .unwrap_or(config.lease_ms / 3)
        .clamp(1, (config.lease_ms / 3).max(1));
    let slots = Arc::new(Slots {
        source: source.clone(),
        activities,
        registry,
        timing: Timing {
            lease_ms: config.lease_ms,
            renew_ms,
            progress_every: config.progress_interval_ms,
        },
        // The source decides where the holder is: a server leases for its workers as for
        // workers elsewhere, whatever this says.
        next: LeaseRequest {
            filter: Arc::new(filter.clone()),
            max: 1,
            lease_ms: config.lease_ms,
            holder: LeaseHolder::InProcess,
        },
        permits: permits.clone(),
        tracker: TaskTracker::new(),
        runtime: tokio::runtime::Handle::current(),
        stop: stop.clone(),
    });
    let receiver: Arc<dyn TaskReceiver> = Arc::new(SlotReceiver(slots.clone()));
    loop {
        if *stop.borrow() {
            break;
        }
        let free = permits.available_permits();
        if free == 0 {
            // Wait for a slot to come free.
            tokio::select! {
                _ = permits.acquire() => {}
                _ = stop.changed() => {}
            }
            continue;
        }
        // The slots a lease asks for are its own until it answers, so that every task it
        // gets has one; a few stay free for the tasks reports hand on beside their own
        // (eager dispatch), which would otherwise take the slots of tasks leased here.
        let wanted = free.saturating_sub(MAX_EXTRA_HANDED).max(1);
        let reserved = tokio::select! {
            reserved = permits.clone().acquire_many_owned(u32::try_from(wanted).unwrap_or(u32::MAX)) => reserved,
            _ = stop.changed() => continue,
        };
        let Ok(mut reserved) = reserved else {
            break;
        };
        let leased = tokio::select! {
            leased = source.lease_or_receive(&filter, reserved.num_permits(), config.lease_ms, poll, receiver.clone()) => leased,
            _ = stop.changed() => continue,
        };
        let leased = match leased {
            Ok(leased) => leased,
            Err(e) => {
                warn!(error = %e, "leasing tasks failed");
                // Do not spin on a source that fails at once (a store error; a remote source
                // pauses by itself, backing off while its server is down).
                tokio::select! {
                    _ = tokio::time::sleep(poll.min(LEASE_ERROR_PAUSE)) => {}
                    _ = stop.changed() => {}
                }
                continue;
            }
        };
        for task in leased {
            match reserved.split(1) {
                Some(permit) => slots.spawn(task, permit),
                // A source that hands more than asked for breaks the protocol: the task's
                // lease lapses unused and it runs again.
                None => warn!(
                    task = %task.lease.id,
                    "a lease handed more tasks than asked for; this one is left to lapse"
                ),
            }
        }
    }
    // Drain: let every running activity finish and report.
    slots.tracker.close();
    slots.tracker.wait().await;
    listener.abort();
}

/// How a slot times the task it runs: its leases, their renewals, its progress records.
#[derive(Debug, Clone, Copy)]
struct Timing {
    lease_ms: u64,
    renew_ms: u64,
    progress_every: Option<u64>,
}

/// How long a cancelled activity may take to stop by itself before it is abandoned.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

/// An attempt that ran to its report, with the lease it ran under and the span it ran in.
struct Attempted {
    lease: Lease,
    /// The lease's expiry as far as the slot knows (renewals included).
    lease_expires_at_ms: u64,
    report: ActivityReport,
    span: tracing::Span,
}

/// Runs `task`'s attempt under its lease: renews the lease, records streamed output,
/// enforces the heartbeat timeout; returns the report to send, or none when the lease was
/// lost.
async fn attempt(
    engine: &dyn TaskSource,
    activities: &Activities,
    registry: &RunningRegistry,
    task: LeasedTask,
    timing: Timing,
) -> Option<Attempted> {
    let Timing {
        lease_ms,
        renew_ms,
        progress_every,
    } = timing;
    let LeasedTask { lease, input } = task;
    let (origin, timeouts) = match &input {
        ActivityInput::Model {
            origin, timeouts, ..
        }
        | ActivityInput::Tool {
            origin, timeouts, ..
        } => (origin.clone(), *timeouts),
    };
    let span = info_span!(
        "activity",
        session_id = %origin.session_id,
        turn = origin.turn,
        activity = %origin.activity,
        attempt = origin.attempt,
        lease_attempt = lease.lease_attempt
    );
    async {
        // Schedule-to-start is the server's to enforce: the store never leases a task past
        // its deadline, and the engine's timers record it. A worker's clock may be off.
        cairn_runtime::stages::mark("activity.start");
        let token = CancellationToken::new();
        let id = {
            let mut running = lock(registry);
            running.next_id += 1;
            let id = running.next_id;
            running
                .by_id
                .insert(id, (origin.session_id.clone(), token.clone()));
            id
        };
        let beats = Arc::new(Mutex::new(Heartbeats {
            last: tokio::time::Instant::now(),
            details: None,
        }));
        let beats_in = beats.clone();
        let (previous, file_versions) = match &input {
            ActivityInput::Model {
                heartbeat_details, ..
            } => (heartbeat_details.clone(), Vec::new()),
            ActivityInput::Tool {
                heartbeat_details,
                file_versions,
                ..
            } => (heartbeat_details.clone(), file_versions.clone()),
        };
        // A tool works in its session's recorded directory, whatever this process's is.
        let session_workdir = match &input {
            ActivityInput::Tool { workdir, .. } => workdir.as_deref().map(std::path::Path::new),
            ActivityInput::Model { .. } => None,
        };
        let context = ActivityContext::new(origin.attempt, previous, token.clone(), move |details| {
            let mut b = beats_in.lock().unwrap_or_else(|p| p.into_inner());
            b.last = tokio::time::Instant::now();
            if details.is_some() {
                b.details = details;
            }
        })
        .with_working_dir(session_workdir)
        .with_file_versions(file_versions);
        // Streamed output not yet recorded; only model calls stream, and only when asked to.
        let is_model = matches!(input, ActivityInput::Model { .. });
        let pending = (is_model && progress_every.is_some()).then(PendingOutput::default);
        let mut recording = pending.is_some();
        let progress_every = Duration::from_millis(progress_every.unwrap_or(0).max(1));
        let mut next_progress = tokio::time::Instant::now() + progress_every;
        // The lease's expiry as far as this runner knows; past it the task may be someone
        // else's, so output is no longer recorded under this lease.
        let mut lease_expires_at_ms = lease.expires_at_ms;
        let work = run_activity(engine, activities, input, &context, pending.as_ref());
        tokio::pin!(work);
        let renew_every = Duration::from_millis(renew_ms.max(1));
        // The heartbeat details last sent, so a renewal sends them only when they changed.
        let mut details_sent: Option<JsonText> = None;
        let check_every = match timeouts.heartbeat_ms {
            Some(ms) => Duration::from_millis((ms / 4).max(1)).min(renew_every),
            None => renew_every,
        };
        // A lease handed late (a report's answer sent again after a while) may have less left
        // than a renewal interval: the first renewal comes by half of what is left.
        let left = Duration::from_millis(lease.expires_at_ms.saturating_sub(engine.now_ms()));
        let mut next_renewal = tokio::time::Instant::now() + renew_every.min(left / 2);
        // Deadlines, not fresh sleeps per loop turn: the progress branch ends a turn every
        // interval, and must not keep pushing the checks (and lease renewals) back.
        let mut next_check = (tokio::time::Instant::now() + check_every).min(next_renewal);
        let mut cancelled_at = None;
        let mut lease_lost = false;
        // A renewal and a progress record in flight are polled beside the activity, never
        // instead of it: through a server either can take seconds (a restart, a connection
        // gone dead), and the work must go on meanwhile, heartbeating as it does; a renewal
        // awaited in place stopped the activity, so a heartbeat timeout could fire on a
        // healthy one as soon as the renewal came back.
        let mut renewal: Option<InFlight<'_, (Option<JsonText>, cairn_runtime::Result<u64>)>> = None;
        let mut progress: Option<InFlight<'_, bool>> = None;
        let report = loop {
            tokio::select! {
                report = &mut work => break (!lease_lost).then_some(report),
                Some((details, extended)) = in_flight(&mut renewal) => {
                    renewal = None;
                    match extended {
                        Ok(expires_at_ms) => {
                            lease_expires_at_ms = expires_at_ms;
                            if details.is_some() {
                                details_sent = details;
                            }
                        }
                        // The store is unavailable for now, and the lease still holds: the
                        // activity goes on, and the renewal is tried again soon.
                        Err(e) if e.is_retryable()
                            && engine.fails_for_now()
                            && engine.now_ms() < lease_expires_at_ms =>
                        {
                            debug!(error = %e, "renewing the lease failed for now; trying again");
                            let soon = tokio::time::Instant::now() + RESEND_PAUSE.1.min(renew_every);
                            next_renewal = next_renewal.min(soon);
                            next_check = next_check.min(soon);
                        }
                        Err(e) => {
                            // The task was cancelled, or another worker owns it now: ask
                            // the activity to stop, and report nothing.
                            debug!(error = %e, "lease lost while running; cancelling the attempt");
                            lease_lost = true;
                            token.cancel();
                        }
                    }
                }
                Some(go_on) = in_flight(&mut progress) => {
                    progress = None;
                    recording = go_on;
                }
                _ = tokio::time::sleep_until(next_progress), if recording && !lease_lost && progress.is_none() => {
                    next_progress = tokio::time::Instant::now() + progress_every;
                    if let Some(pending) = &pending {
                        let usage = context.reported_usage();
                        progress = Some(Box::pin(record_pending(engine, &lease, lease_expires_at_ms, pending, usage)));
                    }
                }
                _ = tokio::time::sleep_until(next_check) => {
                    let now = tokio::time::Instant::now();
                    next_check = now + check_every;
                    if let (Some(limit), None) = (timeouts.heartbeat_ms, cancelled_at) {
                        let (last, details) = {
                            let b = beats.lock().unwrap_or_else(|p| p.into_inner());
                            (b.last, b.details.clone())
                        };
                        if now.duration_since(last) > Duration::from_millis(limit) {
                            token.cancel();
                            let mut report = ActivityFailure::new(
                                ErrorClass::Timeout,
                                format!("heartbeat timeout: no heartbeat for {limit} ms"),
                            );
                            report.heartbeat_details = details;
                            break Some(ActivityReport::Failed(report));
                        }
                    }
                    if token.is_cancelled() {
                        let since = *cancelled_at.get_or_insert(now);
                        if now.duration_since(since) > CANCEL_GRACE {
                            warn!("cancelled activity did not stop within its grace period; abandoned");
                            break (!lease_lost).then(|| failure(ErrorClass::Cancelled, "cancelled"));
                        }
                    }
                    if now >= next_renewal && !lease_lost && renewal.is_none() {
                        next_renewal = now + renew_every;
                        let details = beats
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .details
                            .clone()
                            .filter(|d| details_sent.as_ref() != Some(d));
                        let lease = &lease;
                        renewal = Some(Box::pin(async move {
                            let extended = engine.heartbeat(lease, lease_ms, details.clone()).await;
                            (details, extended)
                        }));
                    }
                }
            }
        };
        // A record of streamed output still on its way goes before the last one.
        if let Some(progress) = progress.take() {
            recording = progress.await;
        }
        drop(progress);
        drop(renewal);
        lock(registry).by_id.remove(&id);
        if let Some(report) = report {
            // A failed attempt's last output goes on record before the failure does; a
            // completed one's is superseded by its response, so nothing more is written.
            if let (ActivityReport::Failed(_), Some(pending), true) = (&report, &pending, recording) {
                record_pending(engine, &lease, lease_expires_at_ms, pending, context.reported_usage()).await;
            }
            cairn_runtime::stages::mark("activity.end");
            return Some(Attempted {
                lease,
                lease_expires_at_ms,
                report,
                span: tracing::Span::current(),
            });
        }
        None
    }
    .instrument(span)
    .await
}

/// Appends the output streamed since the last record, if any; returns whether to go on
/// recording (not after the attempt's progress was found stale).
async fn record_pending(
    engine: &dyn TaskSource,
    lease: &Lease,
    lease_expires_at_ms: u64,
    pending: &PendingOutput,
    usage: Option<cairn_ledger::Usage>,
) -> bool {
    if engine.now_ms() >= lease_expires_at_ms {
        // The lease may have lapsed and the task be another worker's now.
        return false;
    }
    let Some((text, thinking)) = pending.take() else {
        return true;
    };
    match engine
        .record_progress_with_usage(lease, text, thinking, usage)
        .await
    {
        Ok(()) => true,
        // Stale progress (a newer lease recorded output, or the attempt is over) changes
        // nothing; a later record of this lease would be stale too.
        Err(e @ (Error::StaleReport { .. } | Error::LeaseLost { .. })) => {
            info!(session_id = %lease.id.session_id, task = %lease.id, error = %e, "stale progress dropped");
            false
        }
        Err(e) => {
            // Progress is presentation only: losing a record must not fail the attempt.
            warn!(error = %e, "recording streamed output failed; the attempt goes on");
            true
        }
    }
}

/// A request of a running attempt's (a lease renewal, a progress record) on its way.
type InFlight<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// The output of the request in `slot` once it is done; never, while there is none.
async fn in_flight<T>(slot: &mut Option<InFlight<'_, T>>) -> Option<T> {
    match slot {
        Some(request) => Some(request.await),
        None => std::future::pending().await,
    }
}

struct Heartbeats {
    last: tokio::time::Instant,
    details: Option<JsonText>,
}

/// How a slot's report leases more tasks with it (eager dispatch).
#[derive(Clone, Copy)]
struct EagerDispatch<'a> {
    /// The lease request, but for its `max`.
    request: &'a LeaseRequest,
    /// The pool's free slots, for the tasks beyond the slot's own next one.
    permits: &'a Arc<Semaphore>,
}

impl EagerDispatch<'_> {
    /// Takes up to [`MAX_EXTRA_HANDED`] free slots of the pool for tasks the report may hand
    /// beyond the slot's own next one; none when the pool has none free.
    fn extra_slots(&self) -> Option<OwnedSemaphorePermit> {
        let wanted = self.permits.available_permits().min(MAX_EXTRA_HANDED);
        let wanted = u32::try_from(wanted).ok().filter(|n| *n > 0)?;
        self.permits.clone().try_acquire_many_owned(wanted).ok()
    }

    /// The free slots taken for more tasks, and the lease request asking for them beside
    /// this slot's next one.
    fn request_for_more(&self) -> (Option<OwnedSemaphorePermit>, Cow<'_, LeaseRequest>) {
        let extra = self.extra_slots();
        let more = extra.as_ref().map_or(0, OwnedSemaphorePermit::num_permits);
        // The request as it is when only this slot's next task is wanted (its `max` is 1).
        let request = match more {
            0 => Cow::Borrowed(self.request),
            more => Cow::Owned(LeaseRequest {
                max: 1 + more,
                ..self.request.clone()
            }),
        };
        (extra, request)
    }
}

/// What a report handed a slot: its next task, and tasks beyond it with the slot each runs on.
#[derive(Default)]
struct Handed {
    next: Option<LeasedTask>,
    more: Vec<(LeasedTask, OwnedSemaphorePermit)>,
}

impl Handed {
    /// Hands out `tasks`: the first to the slot that reported, each other one with a slot of
    /// `extra` (whose unused slots go back to the pool when it drops).
    fn of(tasks: Vec<LeasedTask>, mut extra: Option<OwnedSemaphorePermit>) -> Handed {
        let mut tasks = tasks.into_iter();
        let next = tasks.next();
        let mut more = Vec::new();
        for task in tasks {
            match extra.as_mut().and_then(|slots| slots.split(1)) {
                Some(slot) => more.push((task, slot)),
                // A source that hands more than asked for breaks the protocol: the task's
                // lease lapses unused and it runs again.
                None => warn!(
                    task = %task.lease.id,
                    "a report handed more tasks than asked for; this one is left to lapse"
                ),
            }
        }
        Handed { next, more }
    }
}

/// Reports the attempts' results, in one report when there are several and the source is
/// up; with `next`, takes tasks with them (eager dispatch): one for this slot and, when the
/// pool has slots free, a few more for them.
async fn finish_all(
    engine: &dyn TaskSource,
    attempted: Vec<Attempted>,
    next: Option<EagerDispatch<'_>>,
) -> Handed {
    let mut attempted = attempted.into_iter();
    let Some(first) = attempted.next() else {
        return Handed::default();
    };
    let others: Vec<Attempted> = attempted.collect();
    if others.is_empty() {
        let span = first.span.clone();
        return finish(
            engine,
            &first.lease,
            first.lease_expires_at_ms,
            first.report,
            next,
        )
        .instrument(span)
        .await;
    }
    let Some(eager) = next.filter(|_| !engine.fails_for_now()) else {
        // Each on its own, side by side: a source that may fail for now has each one sent
        // again while its own lease holds.
        let span = first.span.clone();
        let own = finish(
            engine,
            &first.lease,
            first.lease_expires_at_ms,
            first.report,
            next,
        )
        .instrument(span);
        let rest = futures_util::future::join_all(others.into_iter().map(|a| {
            let span = a.span.clone();
            async move {
                finish(engine, &a.lease, a.lease_expires_at_ms, a.report, None)
                    .instrument(span)
                    .await
            }
        }));
        return tokio::join!(own, rest).0;
    };
    let (extra, request) = eager.request_for_more();
    let span = first.span.clone();
    let leases: Vec<Lease> = std::iter::once(&first)
        .chain(&others)
        .map(|a| a.lease.clone())
        .collect();
    let reports = std::iter::once(first)
        .chain(others)
        .map(|a| (a.lease, a.report))
        .collect();
    let answers = engine
        .report_all_and_lease(reports, &request)
        .instrument(span)
        .await;
    let mut handed = Handed::default();
    let mut extra = Some(extra);
    for (at, (answer, lease)) in answers.into_iter().zip(&leases).enumerate() {
        match answer {
            Ok(tasks) if at == 0 => handed = Handed::of(tasks, extra.take().flatten()),
            Ok(_) => {}
            Err(e) => {
                dropped(lease, e);
            }
        }
    }
    handed
}

/// Reports the attempt's result; with `next`, takes tasks with it (eager dispatch): one for
/// this slot and, when the pool has slots free, a few more for them.
async fn finish(
    engine: &dyn TaskSource,
    lease: &Lease,
    lease_expires_at_ms: u64,
    report: ActivityReport,
    next: Option<EagerDispatch<'_>>,
) -> Handed {
    let sent = if engine.fails_for_now() {
        resend_while_unavailable(engine, lease, lease_expires_at_ms, report, next).await
    } else {
        send_report(engine, lease, report, next).await
    };
    sent.unwrap_or_else(|e| dropped(lease, e))
}

/// Sends the report, and again after a pause as long as it fails for now (the store is
/// unavailable: a database restarting) and the lease holds; a copy is kept for that. A try
/// that failed so may have landed: the next is then stale, and dropped as such.
async fn resend_while_unavailable(
    engine: &dyn TaskSource,
    lease: &Lease,
    lease_expires_at_ms: u64,
    report: ActivityReport,
    next: Option<EagerDispatch<'_>>,
) -> Result<Handed, Error> {
    let mut pause = RESEND_PAUSE.0;
    loop {
        match send_report(engine, lease, report.clone(), next).await {
            Err(e) if e.is_retryable() => {
                let pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX);
                if engine.now_ms().saturating_add(pause_ms) >= lease_expires_at_ms {
                    return Err(e);
                }
                debug!(task = %lease.id, error = %e, "reporting failed for now; sending again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RESEND_PAUSE.1);
            }
            other => return other,
        }
    }
}

async fn send_report(
    engine: &dyn TaskSource,
    lease: &Lease,
    report: ActivityReport,
    next: Option<EagerDispatch<'_>>,
) -> Result<Handed, Error> {
    match next {
        Some(eager) => {
            let (extra, request) = eager.request_for_more();
            engine
                .report_and_lease(lease, report, &request)
                .await
                .map(|tasks| Handed::of(tasks, extra))
        }
        None => engine
            .report(lease, report)
            .await
            .map(|()| Handed::default()),
    }
}

/// Logs a report that failed: nothing is handed, and the task runs again once its lease
/// lapses (unless the lease was already lost).
fn dropped(lease: &Lease, error: Error) -> Handed {
    match error {
        // Normal when a lease lapsed and another worker took over: the history already holds the
        // truth and nothing was changed, so nothing is retried; info, because it means an
        // attempt's work was thrown away.
        e @ (Error::StaleReport { .. } | Error::LeaseLost { .. }) => {
            info!(session_id = %lease.id.session_id, task = %lease.id, error = %e, "stale report dropped")
        }
        e => warn!(error = %e, "reporting the result failed; the task will run again"),
    }
    Handed::default()
}

fn failure(class: ErrorClass, message: impl Into<String>) -> ActivityReport {
    ActivityReport::Failed(ActivityFailure::new(class, message))
}

/// Maps an activity error kind onto the runtime's persisted error class.
pub(crate) fn class_of(kind: ErrorKind) -> ErrorClass {
    match kind {
        ErrorKind::Transient => ErrorClass::Transient,
        ErrorKind::RateLimited => ErrorClass::RateLimited,
        ErrorKind::Overloaded => ErrorClass::Overloaded,
        ErrorKind::Timeout => ErrorClass::Timeout,
        ErrorKind::InvalidRequest => ErrorClass::InvalidRequest,
        ErrorKind::InvalidResponse => ErrorClass::InvalidResponse,
        ErrorKind::Auth => ErrorClass::Auth,
        ErrorKind::ToolFailed => ErrorClass::ToolFailed,
        ErrorKind::Cancelled => ErrorClass::Cancelled,
        ErrorKind::Internal => ErrorClass::Internal,
        ErrorKind::ContextTooLong => ErrorClass::ContextTooLong,
    }
}

/// Publishes a model call's deltas, and remembers whether any arrived (the failure phase).
struct EngineDeltas<'a> {
    engine: &'a dyn TaskSource,
    origin: ActivityRef,
    streamed: AtomicBool,
    context: &'a ActivityContext,
    pending: Option<&'a PendingOutput>,
}

impl DeltaSink for EngineDeltas<'_> {
    fn delta(&self, delta: Delta) {
        self.streamed.store(true, Ordering::Relaxed);
        // A streaming model is alive: deltas count as heartbeats.
        self.context.heartbeat(None);
        if let Some(pending) = self.pending {
            pending.push(&delta);
        }
        self.engine.publish_delta(DeltaEvent {
            origin: self.origin.clone(),
            delta,
        });
    }
}

async fn run_activity(
    engine: &dyn TaskSource,
    activities: &Activities,
    input: ActivityInput,
    context: &ActivityContext,
    pending: Option<&PendingOutput>,
) -> ActivityReport {
    match input {
        ActivityInput::Model {
            origin,
            round,
            model,
            transcript,
            tools,
            timeouts,
            options,
            ..
        } => {
            // The workflow checks every input it adds to a session's transcript (each user
            // message and its media, each response, tool_use ids unique in the session), so
            // only the current turn is checked again here: a model call late in a long
            // session costs the length of its turn, not of the session.
            if let Err(e) =
                validate_transcript_from(&transcript, current_turn_start(&transcript).unwrap_or(0))
            {
                return failure(
                    ErrorClass::InvalidRequest,
                    format!("transcript not sendable: {e}"),
                );
            }
            let provider = match activities.models.resolve(&model) {
                Ok(p) => p,
                Err(e) => return failure(class_of(e.kind()), e.to_string()),
            };
            let request = ModelRequest {
                context: CallContext {
                    session_id: origin.session_id.clone(),
                    turn: origin.turn,
                    round,
                    attempt: origin.attempt,
                },
                model,
                transcript,
                tools,
                options,
            };
            let sink = EngineDeltas {
                engine,
                origin,
                streamed: AtomicBool::new(false),
                context,
                pending,
            };
            let call = provider.call(&request, &sink, context);
            let limit = timeouts.start_to_close_ms;
            let outcome = tokio::time::timeout(Duration::from_millis(limit), call).await;
            let phase = if sink.streamed.load(Ordering::Relaxed) {
                FailurePhase::Streaming
            } else {
                FailurePhase::BeforeStream
            };
            let mut failed = match outcome {
                Ok(Ok(response)) => match validate_response(&response) {
                    Ok(()) => return ActivityReport::ModelCompleted(response),
                    Err(e) => {
                        let mut f =
                            ActivityFailure::new(ErrorClass::InvalidResponse, e.to_string());
                        f.usage = Some(response.usage);
                        f.phase = Some(FailurePhase::Validation);
                        return ActivityReport::Failed(f);
                    }
                },
                Ok(Err(e)) => {
                    let mut f = ActivityFailure::new(class_of(e.kind()), e.to_string());
                    f.retry_after_ms = e.retry_after_ms();
                    f
                }
                Err(_) => ActivityFailure::new(
                    ErrorClass::Timeout,
                    format!("model call exceeded its start-to-close timeout of {limit} ms"),
                ),
            };
            failed.phase = Some(phase);
            // Tokens a broken attempt consumed still count.
            failed.usage = context.reported_usage();
            ActivityReport::Failed(failed)
        }
        ActivityInput::Tool {
            tool_use,
            idempotency_key,
            timeouts,
            ..
        } => {
            let Some(tool) = activities.tools.get(&tool_use.name) else {
                return failure(
                    ErrorClass::InvalidRequest,
                    format!("this worker has no tool {:?}", tool_use.name),
                );
            };
            let call = ToolCall {
                tool_use_id: tool_use.id,
                name: tool_use.name,
                arguments: tool_use.arguments,
                idempotency_key,
            };
            let limit = timeouts.start_to_close_ms;
            match tokio::time::timeout(Duration::from_millis(limit), tool.call(&call, context))
                .await
            {
                Ok(Ok(output)) => ActivityReport::ToolCompleted {
                    content: output.content,
                    is_error: output.is_error,
                },
                Ok(Err(e)) => failure(class_of(e.kind()), e.to_string()),
                Err(_) => failure(
                    ErrorClass::Timeout,
                    format!("tool call exceeded its start-to-close timeout of {limit} ms"),
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StandardModels;
    use async_trait::async_trait;
    use cairn_ledger::{Part, Role, Transcript};
    use tokio::sync::{broadcast, Notify};
    use tokio::time::Instant;

    /// A remote source whose server is down at the first lease request: the request fails at
    /// once. It records when it is asked, and says when it is asked again.
    #[derive(Default)]
    struct DownOnce {
        asked_at: Mutex<Vec<Instant>>,
        asked_again: Notify,
    }

    #[async_trait]
    impl TaskSource for DownOnce {
        async fn lease(
            &self,
            _filter: &TaskFilter,
            _max: usize,
            _lease_ms: u64,
            wait: Duration,
        ) -> cairn_runtime::Result<Vec<LeasedTask>> {
            let asked = {
                let mut asked_at = self.asked_at.lock().unwrap();
                asked_at.push(Instant::now());
                asked_at.len()
            };
            if asked == 1 {
                return Err(Error::Unreachable {
                    url: "http://127.0.0.1:1".to_owned(),
                    reason: "connection refused".to_owned(),
                });
            }
            self.asked_again.notify_one();
            // Back, with nothing to do: a whole long poll.
            tokio::time::sleep(wait).await;
            Ok(Vec::new())
        }

        async fn heartbeat(
            &self,
            _lease: &Lease,
            _lease_ms: u64,
            _details: Option<JsonText>,
        ) -> cairn_runtime::Result<u64> {
            unreachable!("nothing is leased")
        }

        async fn record_progress(
            &self,
            _lease: &Lease,
            _text_appended: String,
            _thinking_appended: String,
        ) -> cairn_runtime::Result<()> {
            unreachable!("nothing is leased")
        }

        async fn report(
            &self,
            _lease: &Lease,
            _report: ActivityReport,
        ) -> cairn_runtime::Result<()> {
            unreachable!("nothing is leased")
        }

        fn publish_delta(&self, _delta: DeltaEvent) {}

        fn cancellations(&self) -> Option<broadcast::Receiver<String>> {
            None
        }

        fn now_ms(&self) -> u64 {
            0
        }
    }

    fn message(role: Role, parts: Vec<Part>) -> cairn_ledger::Message {
        cairn_ledger::Message {
            role,
            parts,
            provenance: None,
        }
    }

    fn tool_use(id: &str) -> Part {
        Part::ToolUse(cairn_ledger::ToolUse {
            id: id.to_owned(),
            name: "calculator".to_owned(),
            arguments: r#"{"expression":"1+2"}"#.to_owned(),
            signature: None,
        })
    }

    fn tool_result(id: &str) -> Part {
        Part::ToolResult(cairn_ledger::ToolResult {
            tool_use_id: id.to_owned(),
            content: cairn_ledger::ToolResultContent::Text("3".to_owned()),
            is_error: false,
        })
    }

    /// A model call on `transcript` (two assistant messages), with a scripted model answering
    /// "ok".
    async fn call_model(transcript: Transcript) -> ActivityReport {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("script.json");
        std::fs::write(
            &script,
            // The script answers by the assistant messages before the call: two here.
            r#"{"responses": [
                {"parts": [{"type": "text", "text": "first"}]},
                {"parts": [{"type": "text", "text": "second"}]},
                {"parts": [{"type": "text", "text": "ok"}]}]}"#,
        )
        .unwrap();
        let input = ActivityInput::Model {
            origin: ActivityRef {
                session_id: "s".to_owned(),
                turn: 2,
                activity: "model:1".to_owned(),
                attempt: 1,
            },
            round: 1,
            model: cairn_ledger::ModelSpec::parse(&format!("scripted:{}", script.display()))
                .unwrap(),
            transcript: Arc::new(transcript),
            transcript_lineage: None,
            transcript_left_out: 0,
            tools: Vec::new().into(),
            tools_digest: None,
            tools_omitted: false,
            timeouts: cairn_runtime::ActivityTimeouts {
                due_at_ms: 0,
                schedule_to_start_ms: None,
                start_to_close_ms: 10_000,
                heartbeat_ms: None,
            },
            heartbeat_details: None,
            options: Default::default(),
        };
        let activities = Activities {
            models: Arc::new(StandardModels::new()),
            tools: Arc::new(ToolRegistry::new()),
        };
        run_activity(
            &DownOnce::default(),
            &activities,
            input,
            &ActivityContext::detached(),
            None,
        )
        .await
    }

    /// A session's second turn: its first turn, then "again", a tool round, and `results`.
    fn second_turn(first_answer: &str, results: Vec<Part>) -> Transcript {
        Transcript {
            messages: vec![
                message(Role::User, vec![Part::text("go")]),
                message(Role::Assistant, vec![Part::text(first_answer)]),
                message(Role::User, vec![Part::text("again")]),
                message(Role::Assistant, vec![tool_use("a"), tool_use("b")]),
                message(Role::User, results),
            ],
        }
    }

    /// Before a model call the worker checks the current turn of its transcript: a broken
    /// one fails the call as an invalid request naming the message, while an earlier turn,
    /// which the workflow checked as it grew, is not read again.
    #[tokio::test]
    async fn a_model_call_checks_the_current_turn_of_its_transcript() {
        let ok = second_turn("done", vec![tool_result("a"), tool_result("b")]);
        assert_eq!(current_turn_start(&ok), Some(2));
        match call_model(ok).await {
            ActivityReport::ModelCompleted(response) => assert_eq!(response.text(), "ok"),
            other => panic!("a sendable transcript is sent, got {other:?}"),
        }

        let out_of_order = second_turn("done", vec![tool_result("b"), tool_result("a")]);
        match call_model(out_of_order).await {
            ActivityReport::Failed(failure) => {
                assert_eq!(failure.class, ErrorClass::InvalidRequest);
                assert!(
                    failure.message.starts_with(
                        "transcript not sendable: invalid transcript at message 4, part 0"
                    ),
                    "{}",
                    failure.message
                );
            }
            other => panic!("a broken current turn fails the call, got {other:?}"),
        }

        // An empty text in the first turn: outside the current turn, not checked again.
        let earlier = second_turn("", vec![tool_result("a"), tool_result("b")]);
        assert!(cairn_ledger::validate_transcript(&earlier).is_err());
        assert!(matches!(
            call_model(earlier).await,
            ActivityReport::ModelCompleted(_)
        ));
    }

    // The clock is paused: the pauses are measured in virtual time, exactly.
    #[tokio::test(start_paused = true)]
    async fn a_failed_lease_request_is_retried_soon_not_after_a_whole_long_poll() {
        let source = Arc::new(DownOnce::default());
        let long_poll = Duration::from_secs(5);
        let pool = WorkerPool::start_with(
            source.clone(),
            Activities {
                models: Arc::new(StandardModels::new()),
                tools: Arc::new(ToolRegistry::new()),
            },
            WorkerConfig {
                // As `cairn worker` sets it: the poll interval is the long poll's wait.
                poll_interval_ms: long_poll.as_millis() as u64,
                ..WorkerConfig::default()
            },
        );
        source.asked_again.notified().await;
        let asked_at = source.asked_at.lock().unwrap().clone();
        pool.shutdown().await;
        let pause = asked_at[1] - asked_at[0];
        assert!(
            pause <= LEASE_ERROR_PAUSE,
            "the pool asked again {pause:?} after a failed lease request (long poll {long_poll:?})"
        );
    }

    /// A source that hands one tool task whose lease has only 300 ms left (a report's answer
    /// sent again late), then nothing; it records when the lease was renewed.
    struct LateLease {
        start: Instant,
        handed: AtomicBool,
        renewed_at: Mutex<Vec<Duration>>,
        reported: Notify,
    }

    impl LateLease {
        fn task(&self) -> LeasedTask {
            let now_ms = self.now_ms();
            LeasedTask {
                lease: Lease {
                    id: cairn_runtime::TaskId {
                        session_id: "late".to_owned(),
                        scheduled_seq: 5,
                    },
                    kind: cairn_runtime::TaskKind::Tool,
                    lease_attempt: 1,
                    expires_at_ms: now_ms + 300,
                },
                input: ActivityInput::Tool {
                    origin: ActivityRef {
                        session_id: "late".to_owned(),
                        turn: 1,
                        activity: "tool:t1".to_owned(),
                        attempt: 1,
                    },
                    tool_use: cairn_ledger::ToolUse {
                        id: "t1".to_owned(),
                        name: "slow".to_owned(),
                        arguments: "{}".to_owned(),
                        signature: None,
                    },
                    idempotency_key: "late/t1".to_owned(),
                    timeouts: cairn_runtime::ActivityTimeouts {
                        due_at_ms: now_ms,
                        schedule_to_start_ms: None,
                        start_to_close_ms: 60_000,
                        heartbeat_ms: None,
                    },
                    heartbeat_details: None,
                    workdir: None,
                    file_versions: Vec::new(),
                },
            }
        }
    }

    #[async_trait]
    impl TaskSource for LateLease {
        async fn lease(
            &self,
            _filter: &TaskFilter,
            _max: usize,
            _lease_ms: u64,
            wait: Duration,
        ) -> cairn_runtime::Result<Vec<LeasedTask>> {
            if !self.handed.swap(true, Ordering::SeqCst) {
                return Ok(vec![self.task()]);
            }
            tokio::time::sleep(wait).await;
            Ok(Vec::new())
        }

        async fn heartbeat(
            &self,
            lease: &Lease,
            lease_ms: u64,
            _details: Option<JsonText>,
        ) -> cairn_runtime::Result<u64> {
            self.renewed_at.lock().unwrap().push(self.start.elapsed());
            let _ = lease;
            Ok(self.now_ms() + lease_ms)
        }

        async fn record_progress(
            &self,
            _lease: &Lease,
            _text_appended: String,
            _thinking_appended: String,
        ) -> cairn_runtime::Result<()> {
            Ok(())
        }

        async fn report(
            &self,
            _lease: &Lease,
            _report: ActivityReport,
        ) -> cairn_runtime::Result<()> {
            self.reported.notify_one();
            Ok(())
        }

        fn publish_delta(&self, _delta: DeltaEvent) {}

        fn cancellations(&self) -> Option<broadcast::Receiver<String>> {
            None
        }

        fn now_ms(&self) -> u64 {
            u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
        }
    }

    /// A tool that works for 2 s.
    struct Slow;

    #[async_trait]
    impl cairn_activities::Tool for Slow {
        fn spec(&self) -> cairn_ledger::ToolSpec {
            cairn_ledger::ToolSpec {
                name: "slow".into(),
                description: "works for a while".into(),
                input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
            }
        }
        async fn call(
            &self,
            _call: &ToolCall,
            _context: &ActivityContext,
        ) -> cairn_activities::Result<cairn_activities::ToolOutput> {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok(cairn_activities::ToolOutput::text("done"))
        }
    }

    // The clock is paused: the renewal's time is measured in virtual time, exactly.
    #[tokio::test(start_paused = true)]
    async fn a_lease_handed_with_little_left_is_renewed_before_it_lapses() {
        let source = Arc::new(LateLease {
            start: Instant::now(),
            handed: AtomicBool::new(false),
            renewed_at: Mutex::new(Vec::new()),
            reported: Notify::new(),
        });
        let pool = WorkerPool::start_with(
            source.clone(),
            Activities {
                models: Arc::new(StandardModels::new()),
                tools: Arc::new(ToolRegistry::new().with(Slow)),
            },
            WorkerConfig {
                // Renewals every 10 s: far more than the 300 ms the lease has left.
                lease_ms: 30_000,
                ..WorkerConfig::default()
            },
        );
        source.reported.notified().await;
        pool.shutdown().await;
        let renewed_at = source.renewed_at.lock().unwrap().clone();
        assert!(
            renewed_at
                .first()
                .is_some_and(|first| *first < Duration::from_millis(300)),
            "the first renewal came at {renewed_at:?}, after the lease lapsed at 300 ms"
        );
    }
}
