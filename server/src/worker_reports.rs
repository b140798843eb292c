//! The report routes: a worker's report of one attempt (`POST /v1/worker/report`), or of
//! several at once (`POST /v1/worker/reports`), recorded as its session's events; a try sent
//! again is answered as its first try was. A batch's run of reports of one session (a model's
//! parallel calls that one worker slot ran in turn) is recorded in one append.

use crate::answered_again::{First, Joined};
use crate::app::AppState;
use crate::auth::{Caller, WorkerCaller};
use crate::errors::{ApiError, JsonBody};
use crate::tool_sets::ToolSetsHeader;
use crate::transcripts::TranscriptsHeader;
use crate::worker::{
    bounded, check_lease, check_session, fetched_again, lease_span, worker_filter, WorkerKeeps,
};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cairn_ledger::{Media, Part, ToolResultBlock, ToolResultContent};
use cairn_runtime::wire::{
    ErrorBody, ReportAnswer, ReportBatch, ReportBatchAnswer, ReportRequest, ReportResponse,
    MAX_REPORTS_PER_BATCH,
};
use cairn_runtime::{ActivityReport, Lease, LeaseHolder, LeaseRequest as StoreLeaseRequest};
use std::sync::Arc;
use tracing::Instrument;

/// Reports an attempt's result, fenced by its lease attempt; with `next`, leases this worker's
/// next tasks with it (eager dispatch), answered once the report and the leases are durable.
/// The report is carried to its end even if the worker hangs up. A try sent again for the
/// same lease (its answer was lost) while the first is recorded waits for it and is answered
/// as the first was; a report that leased tasks is remembered after, and a try sent again
/// gets the same tasks while their leases last (fetched again), until the worker reports one
/// of them. A try that finds nothing remembered — a report that leased nothing, recorded
/// before; another server's; this one's before a restart — finds the report recorded
/// (`stale_report`), and tasks leased with it are retried once their leases lapse.
#[utoipa::path(
    post,
    path = "/v1/worker/report",
    tag = "worker",
    params(ToolSetsHeader, TranscriptsHeader),
    request_body = ReportRequest,
    responses(
        (status = 200, description = "Recorded, with the tasks leased with it (a request with `next`)", body = ReportResponse),
        (status = 204, description = "Recorded (a request without `next`)"),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a worker token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "Stale (`stale_report`, `lease_lost`): nothing changed; or a report that does not fit its task (`conflict`)", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn report(
    State(state): State<AppState>,
    WorkerCaller(caller): WorkerCaller,
    headers: HeaderMap,
    JsonBody(request): JsonBody<ReportRequest>,
) -> Result<Response, ApiError> {
    let keeps = WorkerKeeps::of(&headers)?;
    Ok(match record_report(&state, &caller, request).await? {
        Some(mut answer) => {
            keeps.shorten(&state, &mut answer.tasks);
            Json(answer).into_response()
        }
        None => StatusCode::NO_CONTENT.into_response(),
    })
}

/// Records several reports in one request, each as `POST /v1/worker/report` would, at once
/// (so they share the store's commits), and answers each with what that route would have
/// answered it: its status and its body. A worker whose activities finish together sends one
/// request instead of one each. The items stand alone: one refused (stale, of another
/// namespace) leaves the others recorded. Items of one session next to each other (the
/// parallel calls one worker slot ran in turn) are recorded in one append, the tasks leased
/// with it going to the first of them that asks for tasks.
#[utoipa::path(
    post,
    path = "/v1/worker/reports",
    tag = "worker",
    params(ToolSetsHeader, TranscriptsHeader),
    request_body = ReportBatch,
    responses(
        (status = 200, description = "Each report recorded or refused, answered in order", body = ReportBatchAnswer),
        (status = 400, description = "Malformed request: no reports, more than the server takes at once, or a report whose media break their rules", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a worker token", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
    )
)]
pub async fn reports(
    State(state): State<AppState>,
    WorkerCaller(caller): WorkerCaller,
    headers: HeaderMap,
    JsonBody(batch): JsonBody<ReportBatch>,
) -> Result<Json<ReportBatchAnswer>, ApiError> {
    let keeps = WorkerKeeps::of(&headers)?;
    if batch.reports.is_empty() || batch.reports.len() > MAX_REPORTS_PER_BATCH {
        return Err(ApiError::invalid(format!(
            "a batch holds from 1 to {MAX_REPORTS_PER_BATCH} reports, not {}",
            batch.reports.len()
        )));
    }
    // Refused whole, as a malformed request, before anything is recorded: media a report
    // could only fail on later, item by item, break the document's patterns.
    for (i, request) in batch.reports.iter().enumerate() {
        media_problem(&request.report).map_or(Ok(()), |problem| {
            Err(ApiError::invalid(format!("reports[{i}]: {problem}")))
        })?;
    }
    let recorded = runs_of_one_session(batch.reports)
        .into_iter()
        .map(|run| record_run(&state, &caller, run));
    let answers = futures_util::future::join_all(recorded)
        .await
        .into_iter()
        .flatten()
        .map(|answer| {
            let (status, body) = match answer {
                Ok(Some(mut leased)) => {
                    keeps.shorten(&state, &mut leased.tasks);
                    (StatusCode::OK, serde_json::value::to_raw_value(&leased))
                }
                Ok(None) => {
                    return Ok(ReportAnswer {
                        status: 204,
                        body: None,
                    })
                }
                Err(e) => (e.status(), serde_json::value::to_raw_value(&e.body())),
            };
            Ok(ReportAnswer {
                status: status.as_u16(),
                body: Some(body.map_err(|e| ApiError::internal(&e))?),
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(Json(ReportBatchAnswer { answers }))
}

/// What is wrong with the first media of `report` that breaks its rules (the document's
/// patterns: media type, canonical base64, an http(s) URL), if any. Only the media: the
/// ledger's other rules for a tool result (`check_result_blocks`: no empty list of blocks,
/// say) are not the document's, so a batch breaking them is well-formed, and the report's own
/// answer says what is wrong with it.
fn media_problem(report: &ActivityReport) -> Option<String> {
    let media: Vec<&Media> = match report {
        ActivityReport::ToolCompleted { content, .. } => media_of(content),
        ActivityReport::ModelCompleted(response) => response
            .parts
            .iter()
            .flat_map(|part| match part {
                Part::Media(media) => vec![media],
                Part::ToolResult(result) => media_of(&result.content),
                _ => Vec::new(),
            })
            .collect(),
        _ => Vec::new(),
    };
    media
        .into_iter()
        .find_map(|media| media.check().err())
        .map(|violation| format!("media: {violation}"))
}

/// The media blocks of a tool result.
fn media_of(content: &ToolResultContent) -> Vec<&Media> {
    match content {
        ToolResultContent::Blocks(blocks) => blocks
            .iter()
            .filter_map(|block| match block {
                ToolResultBlock::Media(media) => Some(media),
                ToolResultBlock::Text { .. } => None,
            })
            .collect(),
        ToolResultContent::Json(_) | ToolResultContent::Text(_) => Vec::new(),
    }
}

/// Records one report ([`report`]): the tasks leased with it for a request with `next`,
/// `None` for one without.
async fn record_report(
    state: &AppState,
    caller: &Caller,
    request: ReportRequest,
) -> Result<Option<ReportResponse>, ApiError> {
    let checked = checked(state, caller, request)?;
    let first = match first_try(state, &checked).await {
        Ok(first) => first,
        Err(answer) => return Ok(answer),
    };
    let Checked {
        lease,
        report,
        next,
        wants_tasks,
    } = checked;
    let engine = state.engine.clone();
    let reported = lease.clone();
    // In a task of its own: a worker that hangs up (its try timed out) cuts nothing short,
    // and its next try is answered with what this one recorded.
    let recording = tokio::spawn(
        async move {
            let result = match next {
                Some(next) => engine.report_and_lease(&reported, report, &next).await,
                None => engine.report(&reported, report).await.map(|()| Vec::new()),
            };
            if let Ok(tasks) = &result {
                first.recorded(tasks.iter().map(|t| t.lease.clone()).collect());
            }
            result
        }
        .instrument(lease_span(&lease)),
    );
    let tasks = recording
        .await
        .map_err(|e| ApiError::internal(&e))?
        .map_err(|e| ApiError::from_runtime(e, &lease.id.session_id))?;
    Ok(wants_tasks.then_some(ReportResponse { tasks }))
}

/// A report checked against its caller, its deltas passed on, as the engine records it.
struct Checked {
    lease: Lease,
    report: ActivityReport,
    /// The tasks to lease with it: none when it asks for none, or the server is draining.
    next: Option<StoreLeaseRequest>,
    /// Whether its answer lists tasks (its request has `next`), however many there are.
    wants_tasks: bool,
}

/// Checks that `request`'s lease and deltas are of the caller's namespace, and passes its
/// deltas on.
fn checked(state: &AppState, caller: &Caller, request: ReportRequest) -> Result<Checked, ApiError> {
    check_lease(caller, &request.lease)?;
    for delta in &request.deltas {
        check_session(caller, &delta.origin.session_id)?;
    }
    let ReportRequest {
        lease,
        report,
        next,
        deltas,
    } = request;
    // Before the report's events, as the deltas route would have passed them on.
    for delta in deltas {
        state.engine.publish_delta(delta);
    }
    let wants_tasks = next.is_some();
    // A draining server records the report but hands out nothing more.
    let next = next
        .map(|next| {
            let (max, lease_ms) = bounded(next.max, next.lease_ms);
            StoreLeaseRequest {
                filter: Arc::new(worker_filter(
                    caller,
                    next.queues,
                    next.tools,
                    next.providers,
                )),
                max: if state.is_draining() { 0 } else { max },
                lease_ms,
                holder: LeaseHolder::Remote,
            }
        })
        .filter(|next| next.max > 0);
    Ok(Checked {
        lease,
        report,
        next,
        wants_tasks,
    })
}

/// Joins the tries of a report: `Ok` when this one is the first, to record it; otherwise
/// the answer of a try sent again, as the first try recorded it.
async fn first_try(state: &AppState, checked: &Checked) -> Result<First, Option<ReportResponse>> {
    loop {
        match state
            .answered_again
            .join_report(&checked.lease, state.engine.now_ms())
        {
            Joined::First(first) => return Ok(first),
            Joined::Again(earlier) => match earlier.outcome().await {
                Some(leases) => {
                    return Err(answered_again(state, leases, checked.wants_tasks).await)
                }
                // The first try failed: this one records the report.
                None => continue,
            },
        }
    }
}

/// `reports` cut into runs of one session each, in order: the reports of a model's
/// parallel calls that one slot ran in turn come next to each other. A lease met again
/// starts a run of its own: a try of a report waits for the one before it, which must not
/// be held back in the same run.
fn runs_of_one_session(reports: Vec<ReportRequest>) -> Vec<Vec<ReportRequest>> {
    let mut runs: Vec<Vec<ReportRequest>> = Vec::new();
    for report in reports {
        match runs.last_mut() {
            Some(run)
                if run[0].lease.id.session_id == report.lease.id.session_id
                    && !run.iter().any(|r| r.lease == report.lease) =>
            {
                run.push(report)
            }
            _ => runs.push(vec![report]),
        }
    }
    runs
}

/// Records a run of reports of one session ([`runs_of_one_session`]) and answers each, in
/// order: one by itself as [`record_report`] does; several in one append, each checked and
/// joined with its tries as it would be by itself.
async fn record_run(
    state: &AppState,
    caller: &Caller,
    run: Vec<ReportRequest>,
) -> Vec<Result<Option<ReportResponse>, ApiError>> {
    if run.len() == 1 {
        let mut run = run;
        let request = run.pop().expect("a run of one");
        return vec![record_report(state, caller, request).await];
    }
    let mut answers: Vec<Option<Result<Option<ReportResponse>, ApiError>>> =
        Vec::with_capacity(run.len());
    let mut firsts = Vec::with_capacity(run.len());
    for (at, request) in run.into_iter().enumerate() {
        answers.push(None);
        let checked = match checked(state, caller, request) {
            Ok(checked) => checked,
            Err(e) => {
                answers[at] = Some(Err(e));
                continue;
            }
        };
        match first_try(state, &checked).await {
            Ok(first) => firsts.push((at, checked, first)),
            Err(answer) => answers[at] = Some(Ok(answer)),
        }
    }
    let Some((_, leading, _)) = firsts.first() else {
        return answers.into_iter().flatten().collect();
    };
    let span = lease_span(&leading.lease);
    let session_id = leading.lease.id.session_id.clone();
    // The first that asks for tasks leads, so that the tasks go to it.
    if let Some(asking) = firsts.iter().position(|(_, c, _)| c.next.is_some()) {
        firsts[..=asking].rotate_right(1);
    }
    let next = firsts[0].1.next.clone();
    let mut reports = Vec::with_capacity(firsts.len());
    let mut joined = Vec::with_capacity(firsts.len());
    for (at, checked, first) in firsts {
        reports.push((checked.lease, checked.report));
        joined.push((at, checked.wants_tasks, first));
    }
    let engine = state.engine.clone();
    // In a task of its own, as one report is.
    let recording = tokio::spawn(
        async move {
            let results = engine.report_all_and_lease(reports, next.as_ref()).await;
            joined
                .into_iter()
                .zip(results)
                .map(|((at, wants_tasks, first), result)| {
                    if let Ok(tasks) = &result {
                        first.recorded(tasks.iter().map(|t| t.lease.clone()).collect());
                    }
                    (at, wants_tasks, result)
                })
                .collect::<Vec<_>>()
        }
        .instrument(span),
    );
    match recording.await {
        Ok(recorded) => {
            for (at, wants_tasks, result) in recorded {
                answers[at] = Some(
                    result
                        .map(|tasks| wants_tasks.then_some(ReportResponse { tasks }))
                        .map_err(|e| ApiError::from_runtime(e, &session_id)),
                );
            }
        }
        Err(e) => {
            for answer in answers.iter_mut().filter(|a| a.is_none()) {
                *answer = Some(Err(ApiError::internal(&e)));
            }
        }
    }
    answers
        .into_iter()
        .map(|answer| {
            answer.unwrap_or_else(|| Err(ApiError::internal(&"a report of a run went unanswered")))
        })
        .collect()
}

/// The answer to a try of a report the first try recorded: the same tasks, fetched again,
/// those whose leases still last and that the workflow still wants.
async fn answered_again(
    state: &AppState,
    leases: Vec<Lease>,
    wants_tasks: bool,
) -> Option<ReportResponse> {
    if !wants_tasks {
        return None;
    }
    Some(ReportResponse {
        tasks: fetched_again(state, leases).await,
    })
}
