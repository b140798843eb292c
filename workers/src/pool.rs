//! The worker pool: one leasing loop feeding a bounded set of activity runs.

use crate::models::ModelResolver;
use cairn_activities::{
    ActivityContext, CallContext, DeltaSink, ErrorKind, ModelRequest, ToolCall, ToolRegistry,
};
use cairn_ledger::{validate_response, validate_transcript, Delta};
use cairn_runtime::{
    ActivityFailure, ActivityInput, ActivityRef, ActivityReport, DeltaEvent, Engine, ErrorClass,
    Lease,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, info_span, warn, Instrument};

/// Pool settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Activities run at once at most.
    pub concurrency: usize,
    /// Lease length; a running activity renews it every third of it (heartbeat). A crashed
    /// worker's tasks become leasable again this long after its last renewal.
    pub lease_ms: u64,
    /// How often to look for due tasks when not woken (catches retry backoffs and expired
    /// leases of other workers).
    pub poll_interval_ms: u64,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: 64,
            lease_ms: 30_000,
            poll_interval_ms: 100,
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
}

impl WorkerPool {
    /// Starts leasing and running tasks.
    pub fn start(engine: Engine, activities: Activities, config: WorkerConfig) -> Self {
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(lease_loop(engine, activities, config, stop_rx));
        WorkerPool { stop, task }
    }

    /// Stops leasing and waits for the running activities to finish and report.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await {
            warn!(error = %e, "worker pool loop ended abnormally");
        }
    }
}

async fn lease_loop(
    engine: Engine,
    activities: Activities,
    config: WorkerConfig,
    mut stop: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let mut running = JoinSet::new();
    let poll = Duration::from_millis(config.poll_interval_ms.max(1));
    loop {
        if *stop.borrow() {
            break;
        }
        while running.try_join_next().is_some() {}
        let free = permits.available_permits();
        if free == 0 {
            tokio::select! {
                _ = running.join_next() => {}
                _ = stop.changed() => {}
            }
            continue;
        }
        let ready = engine.tasks_ready();
        tokio::pin!(ready);
        ready.as_mut().enable();
        let leases = match engine
            .store()
            .lease_tasks(engine.now_ms(), config.lease_ms, free)
            .await
        {
            Ok(leases) => leases,
            Err(e) => {
                warn!(error = %e, "leasing tasks failed");
                Vec::new()
            }
        };
        if leases.is_empty() {
            tokio::select! {
                _ = ready => {}
                _ = tokio::time::sleep(poll) => {}
                _ = stop.changed() => {}
                Some(_) = running.join_next(), if !running.is_empty() => {}
            }
            continue;
        }
        for lease in leases {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let engine = engine.clone();
            let activities = activities.clone();
            let lease_ms = config.lease_ms;
            running.spawn(async move {
                run_task(&engine, &activities, lease, lease_ms).await;
                drop(permit);
            });
        }
    }
    // Drain: let every running activity finish and report.
    while running.join_next().await.is_some() {}
}

async fn run_task(engine: &Engine, activities: &Activities, lease: Lease, lease_ms: u64) {
    let input = match engine.activity(&lease).await {
        Ok(Some(input)) => input,
        Ok(None) => {
            debug!(task = %lease.id, "task no longer wanted; dropped");
            return;
        }
        Err(e) => {
            warn!(task = %lease.id, error = %e, "cannot load the task's activity");
            return;
        }
    };
    let origin = match &input {
        ActivityInput::Model { origin, .. } | ActivityInput::Tool { origin, .. } => origin.clone(),
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
        let work = run_activity(engine, activities, input);
        tokio::pin!(work);
        let heartbeat_every = Duration::from_millis((lease_ms / 3).max(1));
        let report = loop {
            tokio::select! {
                report = &mut work => break Some(report),
                _ = tokio::time::sleep(heartbeat_every) => {
                    let extended = engine
                        .store()
                        .extend_lease(&lease.id, lease.lease_attempt, engine.now_ms(), lease_ms)
                        .await;
                    if let Err(e) = extended {
                        // Another worker owns the task now; stop and let it run.
                        warn!(error = %e, "lease lost while running; abandoning the attempt");
                        break None;
                    }
                }
            }
        };
        let Some(report) = report else { return };
        match engine.report(&lease, report).await {
            Ok(()) => {}
            Err(e) if e.is_stale_report() => debug!(error = %e, "stale report dropped"),
            Err(e) => warn!(error = %e, "reporting the result failed; the task will run again"),
        }
    }
    .instrument(span)
    .await
}

fn failure(class: ErrorClass, message: impl Into<String>) -> ActivityReport {
    ActivityReport::Failed(ActivityFailure {
        class,
        message: message.into(),
        usage: None,
    })
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
    }
}

struct EngineDeltas<'a> {
    engine: &'a Engine,
    origin: ActivityRef,
}

impl DeltaSink for EngineDeltas<'_> {
    fn delta(&self, delta: Delta) {
        self.engine.publish_delta(DeltaEvent {
            origin: self.origin.clone(),
            delta,
        });
    }
}

async fn run_activity(
    engine: &Engine,
    activities: &Activities,
    input: ActivityInput,
) -> ActivityReport {
    match input {
        ActivityInput::Model {
            origin,
            round,
            model,
            transcript,
            tools,
            timeout_ms,
        } => {
            if let Err(e) = validate_transcript(&transcript) {
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
            };
            let sink = EngineDeltas { engine, origin };
            let context = ActivityContext::detached();
            let call = provider.call(&request, &sink, &context);
            match tokio::time::timeout(Duration::from_millis(timeout_ms), call).await {
                Ok(Ok(response)) => match validate_response(&response) {
                    Ok(()) => ActivityReport::ModelCompleted(response),
                    Err(e) => ActivityReport::Failed(ActivityFailure {
                        class: ErrorClass::InvalidResponse,
                        message: e.to_string(),
                        usage: Some(response.usage),
                    }),
                },
                Ok(Err(e)) => failure(class_of(e.kind()), e.to_string()),
                Err(_) => failure(
                    ErrorClass::Timeout,
                    format!("model call exceeded its start-to-close timeout of {timeout_ms} ms"),
                ),
            }
        }
        ActivityInput::Tool {
            tool_use,
            idempotency_key,
            timeout_ms,
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
            match tokio::time::timeout(
                Duration::from_millis(timeout_ms),
                tool.call(&call, &ActivityContext::detached()),
            )
            .await
            {
                Ok(Ok(output)) => ActivityReport::ToolCompleted {
                    content: output.content,
                    is_error: output.is_error,
                },
                Ok(Err(e)) => failure(class_of(e.kind()), e.to_string()),
                Err(_) => failure(
                    ErrorClass::Timeout,
                    format!("tool call exceeded its start-to-close timeout of {timeout_ms} ms"),
                ),
            }
        }
    }
}
