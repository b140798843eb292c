//! The worker routes but the reports (`worker_reports`): lease tasks (a long poll), fetch a
//! lease's input again, heartbeat, record streamed progress, pass on model deltas. Leases name
//! sessions as stored (`N:ID` in namespace `N`), so idempotency keys stay unique across
//! namespaces; a worker token of namespace `N` leases only `N`'s tasks and may touch no other
//! lease (404).

use crate::answered_again::Joined;
use crate::app::AppState;
use crate::auth::{Caller, WorkerCaller};
use crate::errors::{ApiError, JsonBody};
use crate::idempotency_key::{idempotency_key, LeaseIdempotencyKey};
use crate::tool_sets::{KnownToolSets, ToolSetsHeader};
use crate::transcripts::{KeptTranscripts, TranscriptsHeader};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use cairn_runtime::wire::{
    schema, split_session_id, DeltaBatch, ErrorBody, ErrorCode, HeartbeatRequest,
    HeartbeatResponse, LeaseRequest, LeaseResponse, ProgressRequest, DEFAULT_NAMESPACE,
};
use cairn_runtime::{ActivityInput, Lease, LeaseHolder, LeasedTask, TaskFilter};
use std::collections::BTreeSet;
use tracing::Instrument;

/// A lease asks for at most this many tasks...
const MAX_TASKS: usize = 256;
/// ...each leased for at most this long (a worker renews it with heartbeats), so a worker
/// that vanished holds nothing for long.
const MAX_LEASE_MS: u64 = 3_600_000;

/// What a worker says it keeps (`KnownToolSets`, `KeptTranscripts`, from its request's
/// headers): the tasks answered to it leave those out.
pub(crate) struct WorkerKeeps {
    tool_sets: KnownToolSets,
    transcripts: KeptTranscripts,
}

impl WorkerKeeps {
    /// Reads both headers; a malformed one is a 400.
    pub(crate) fn of(headers: &HeaderMap) -> Result<Self, ApiError> {
        Ok(WorkerKeeps {
            tool_sets: KnownToolSets::of(headers)?,
            transcripts: KeptTranscripts::of(headers)?,
        })
    }

    /// Leaves out of `tasks` the tool sets and the transcripts' messages the worker keeps.
    pub(crate) fn shorten(&self, state: &AppState, tasks: &mut [LeasedTask]) {
        state.tool_set_digests.shorten(tasks, &self.tool_sets);
        self.transcripts.shorten(tasks);
    }
}

/// Checks the lease is of the caller's namespace (404 otherwise: other namespaces' sessions
/// do not exist for it).
pub(crate) fn check_lease(caller: &Caller, lease: &Lease) -> Result<(), ApiError> {
    check_session(caller, &lease.id.session_id)
}

pub(crate) fn check_session(caller: &Caller, stored: &str) -> Result<(), ApiError> {
    if split_session_id(stored).0 == caller.namespace {
        Ok(())
    } else {
        Err(ApiError::not_found(format!(
            "no session {stored:?} in namespace {:?}",
            caller.namespace
        )))
    }
}

pub(crate) fn lease_span(lease: &Lease) -> tracing::Span {
    tracing::info_span!("session", session_id = %lease.id.session_id, task = %lease.id)
}

fn unavailable() -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        "the server is draining: it hands out no more tasks",
    )
}

/// The tasks a worker of `caller`'s namespace may lease, of the queues, tools and providers it
/// names.
pub(crate) fn worker_filter(
    caller: &Caller,
    queues: Option<BTreeSet<String>>,
    tools: Option<BTreeSet<String>>,
    providers: Option<BTreeSet<String>>,
) -> TaskFilter {
    TaskFilter {
        queues,
        tools,
        providers,
        sessions: None,
        // `Some("")` is the default namespace: ids without a prefix.
        namespace: Some(if caller.namespace == DEFAULT_NAMESPACE {
            String::new()
        } else {
            caller.namespace.clone()
        }),
    }
}

/// A request's task count and lease length, within the server's bounds.
pub(crate) fn bounded(max: u32, lease_ms: u64) -> (usize, u64) {
    (
        usize::try_from(max).unwrap_or(MAX_TASKS).min(MAX_TASKS),
        lease_ms.min(MAX_LEASE_MS),
    )
}

/// Leases due tasks this worker can run, waiting up to `wait_ms` for the first.
///
/// Under an `Idempotency-Key`, a try sent again under the same key (the answer to the first
/// was lost on the way) is answered with the tasks the first leased, fetched again, while
/// their leases last: without that, they would wait, leased to nobody, for their leases to
/// lapse, each costing an attempt. A try that comes while the first still waits waits for
/// it. The key is remembered by this server process until the worker reports one of those
/// tasks or their leases run out; a first try that leased nothing is not remembered, so one
/// sent again leases afresh.
///
/// The wait is the request's own: a worker that hangs up (it is stopping, or gave up on the
/// try) ends it, so no task is leased to a worker that is gone. A draining server answers
/// with what it remembers and leases nothing new (503).
#[utoipa::path(
    post,
    path = "/v1/worker/lease",
    tag = "worker",
    params(LeaseIdempotencyKey, ToolSetsHeader, TranscriptsHeader),
    request_body = LeaseRequest,
    responses(
        (status = 200, description = "Leased tasks, possibly none after `wait_ms`", body = LeaseResponse),
        (status = 400, description = "Malformed or invalid request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a worker token", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The server is draining", body = ErrorBody),
    )
)]
pub async fn lease(
    State(state): State<AppState>,
    WorkerCaller(caller): WorkerCaller,
    headers: HeaderMap,
    JsonBody(request): JsonBody<LeaseRequest>,
) -> Result<Json<LeaseResponse>, ApiError> {
    let key = idempotency_key(&headers)?;
    let keeps = WorkerKeeps::of(&headers)?;
    let answer = |mut tasks: Vec<LeasedTask>| {
        keeps.shorten(&state, &mut tasks);
        Json(LeaseResponse { tasks })
    };
    let filter = worker_filter(&caller, request.queues, request.tools, request.providers);
    let (max, lease_ms) = bounded(request.max, request.lease_ms);
    if max == 0 {
        return Ok(Json(LeaseResponse { tasks: Vec::new() }));
    }
    let deadline = AppState::deadline(state.poll_wait(Some(request.wait_ms), 0));
    let Some(key) = key else {
        let tasks = lease_waiting(&state, filter, max, lease_ms, deadline).await?;
        return Ok(answer(tasks));
    };
    let first = loop {
        let joined =
            state
                .answered_again
                .join_lease_request(&caller.namespace, &key, state.engine.now_ms());
        match joined {
            Joined::First(first) => break first,
            Joined::Again(earlier) => match earlier.outcome().await {
                Some(leases) => {
                    let tasks = fetched_again(&state, leases).await;
                    return Ok(answer(tasks));
                }
                // The first try failed (or its worker hung up): this one leases.
                None => continue,
            },
        }
    };
    // Dropped with this request's future if the worker hangs up first, `first` counts as
    // failed; recorded, it answers the tries sent again.
    let tasks = lease_waiting(&state, filter, max, lease_ms, deadline).await?;
    first.recorded(tasks.iter().map(|t| t.lease.clone()).collect());
    Ok(answer(tasks))
}

/// Leases up to `max` tasks of `filter`, waiting until `deadline` for the first: 503 on a
/// draining server; a wait that outlives the start of the drain answers at once, and a drain
/// that left it nothing is 503 too.
async fn lease_waiting(
    state: &AppState,
    filter: TaskFilter,
    max: usize,
    lease_ms: u64,
    deadline: tokio::time::Instant,
) -> Result<Vec<LeasedTask>, ApiError> {
    if state.is_draining() {
        return Err(unavailable());
    }
    let tasks = state
        .engine
        .lease_tasks_waiting(
            &filter,
            max,
            lease_ms,
            deadline,
            state.draining.cancelled(),
            LeaseHolder::Remote,
        )
        .await
        .map_err(ApiError::from_store)?;
    if tasks.is_empty() && state.is_draining() {
        return Err(unavailable());
    }
    Ok(tasks)
}

/// What a lease runs, again (for a worker that lost the lease answer, or restarted).
#[utoipa::path(
    post,
    path = "/v1/worker/input",
    tag = "worker",
    request_body = schema::Lease,
    responses(
        (status = 200, description = "What the task runs: `{\"model\": {...}}` or `{\"tool\": {...}}`", body = Object),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a worker token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "The lease is not current (`lease_lost`)", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn input(
    State(state): State<AppState>,
    WorkerCaller(caller): WorkerCaller,
    JsonBody(lease): JsonBody<Lease>,
) -> Result<Json<ActivityInput>, ApiError> {
    check_lease(&caller, &lease)?;
    let lost = |reason: &str| {
        ApiError::new(
            ErrorCode::LeaseLost,
            format!(
                "lease {} of task {}: {reason}",
                lease.lease_attempt, lease.id
            ),
        )
    };
    // The store answers for a lease only through a heartbeat, which would renew it; so look
    // the task up by its key (a worker's fallback when it no longer holds a task's tool set).
    let now = state.engine.now_ms();
    let task = state
        .engine
        .store()
        .task(&lease.id)
        .await
        .map_err(ApiError::from_store)?;
    let current = task
        .is_some_and(|t| t.lease_attempt == lease.lease_attempt && t.held && t.visible_at_ms > now);
    if !current {
        return Err(lost(
            "it is not current (lapsed, superseded, completed or cancelled)",
        ));
    }
    match state
        .engine
        .activity(&lease)
        .instrument(lease_span(&lease))
        .await
        .map_err(|e| ApiError::from_runtime(e, &lease.id.session_id))?
    {
        Some(input) => Ok(Json(input)),
        None => Err(lost("the workflow no longer waits for this task")),
    }
}

/// Renews a lease, storing progress details durably.
#[utoipa::path(
    post,
    path = "/v1/worker/heartbeat",
    tag = "worker",
    request_body = HeartbeatRequest,
    responses(
        (status = 200, description = "The lease's new expiry", body = HeartbeatResponse),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a worker token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "The lease is not current (`lease_lost`): stop the attempt", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn heartbeat(
    State(state): State<AppState>,
    WorkerCaller(caller): WorkerCaller,
    JsonBody(request): JsonBody<HeartbeatRequest>,
) -> Result<Json<HeartbeatResponse>, ApiError> {
    check_lease(&caller, &request.lease)?;
    let expires_at_ms = state
        .engine
        .heartbeat(
            &request.lease,
            request.lease_ms.min(MAX_LEASE_MS),
            request.details,
        )
        .instrument(lease_span(&request.lease))
        .await
        .map_err(|e| ApiError::from_runtime(e, &request.lease.id.session_id))?;
    Ok(Json(HeartbeatResponse { expires_at_ms }))
}

/// Records what a model attempt streamed since its last record.
#[utoipa::path(
    post,
    path = "/v1/worker/progress",
    tag = "worker",
    request_body = ProgressRequest,
    responses(
        (status = 204, description = "Recorded"),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a worker token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "Stale (`stale_report`): the attempt goes on, the record is dropped", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn progress(
    State(state): State<AppState>,
    WorkerCaller(caller): WorkerCaller,
    JsonBody(request): JsonBody<ProgressRequest>,
) -> Result<StatusCode, ApiError> {
    check_lease(&caller, &request.lease)?;
    state
        .engine
        .record_progress_with_usage(
            &request.lease,
            request.text_appended,
            request.thinking_appended,
            request.usage,
        )
        .instrument(lease_span(&request.lease))
        .await
        .map_err(|e| ApiError::from_runtime(e, &request.lease.id.session_id))?;
    Ok(StatusCode::NO_CONTENT)
}

/// The tasks of `leases` handed out by a first try, fetched again for a try sent again:
/// those whose leases still last and that the workflow still wants.
pub(crate) async fn fetched_again(state: &AppState, leases: Vec<Lease>) -> Vec<LeasedTask> {
    let now = state.engine.now_ms();
    let mut tasks = Vec::with_capacity(leases.len());
    for lease in leases {
        if lease.expires_at_ms <= now {
            continue;
        }
        match state
            .engine
            .activity(&lease)
            .instrument(lease_span(&lease))
            .await
        {
            Ok(Some(input)) => tasks.push(LeasedTask { lease, input }),
            Ok(None) => {}
            // Its lease lapses and the timers record the attempt, as for any lost task.
            Err(e) => {
                tracing::warn!(task = %lease.id, error = %e, "cannot fetch a handed task again")
            }
        }
    }
    tasks
}

/// Passes model deltas on to the sessions' event streams (presentation only).
#[utoipa::path(
    post,
    path = "/v1/worker/deltas",
    tag = "worker",
    request_body = DeltaBatch,
    responses(
        (status = 204, description = "Passed on"),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a worker token", body = ErrorBody),
        (status = 404, description = "A delta of a session of another namespace", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn deltas(
    State(state): State<AppState>,
    WorkerCaller(caller): WorkerCaller,
    JsonBody(batch): JsonBody<DeltaBatch>,
) -> Result<StatusCode, ApiError> {
    for delta in &batch.deltas {
        check_session(&caller, &delta.origin.session_id)?;
    }
    for delta in batch.deltas {
        state.engine.publish_delta(delta);
    }
    Ok(StatusCode::NO_CONTENT)
}
