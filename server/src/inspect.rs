//! The routes that look into a history and branch from it: the state of a session at one of
//! its events (read-only: it folds the stored history and writes nothing) and a fork from an
//! event (a new session copying the history up to it, through
//! [`cairn_runtime::fork::fork_session`]).

use crate::app::AppState;
use crate::auth::ClientCaller;
use crate::errors::{ApiError, JsonBody, PathParams, QueryParams};
use crate::sessions::{new_session_id, session_span, stored_id, SessionPath};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use cairn_ledger::ModelSpec;
use cairn_runtime::event::EventEnvelope;
use cairn_runtime::fork::{fork_session, ForkRequest};
use cairn_runtime::replay::describe_at;
use cairn_runtime::wire::{split_session_id, ErrorBody, ForkSession, Forked, StateAt};
use cairn_runtime::Error as RuntimeError;
use serde::Deserialize;
use tracing::Instrument;
use utoipa::IntoParams;

/// Which event.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StateQuery {
    /// The seq of the event the state is taken after (default: the last).
    #[param(minimum = 1)]
    at: Option<u64>,
}

/// The whole stored history of the caller's session `id` (stored as `stored`).
async fn whole_history(
    state: &AppState,
    stored: &str,
    id: &str,
) -> Result<Vec<EventEnvelope>, ApiError> {
    state
        .engine
        .store()
        .read_history(stored, 1, None)
        .await
        .map_err(|e| ApiError::from_runtime(e, id))
}

/// Checks that `seq` names an event of a history whose last seq is `last`: 0 is a bad
/// request, a seq past the end names no event (404).
fn check_seq(id: &str, seq: u64, last: u64, field: &str) -> Result<(), ApiError> {
    if seq == 0 {
        return Err(ApiError::invalid(format!(
            "{field} must be the seq of an event, from 1"
        )));
    }
    if seq > last {
        return Err(ApiError::not_found(format!(
            "session {id:?} has no event {seq}: its history holds seqs 1..={last}"
        )));
    }
    Ok(())
}

/// An engine error about a history that the current code folds differently (or not at all):
/// the reason is the client's business (it names the seq), not a server failure.
fn refusal(error: RuntimeError, id: &str) -> ApiError {
    match error {
        RuntimeError::Nondeterminism { .. } => ApiError::conflict(error.to_string()),
        other => ApiError::from_runtime(other, id),
    }
}

/// The session as it was right after one of its events: status, turns, usage so far,
/// pending tasks, open tool calls and the transcript. Writes nothing.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/state",
    tag = "sessions",
    params(SessionPath, StateQuery),
    responses(
        (status = 200, description = "The state right after event `at`", body = StateAt),
        (status = 400, description = "Invalid path or query (`at` 0, not a number)", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace, or no event `at` in its history", body = ErrorBody),
        (status = 409, description = "The history does not fold with this server's code up to `at`", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn state_at(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
    QueryParams(query): QueryParams<StateQuery>,
) -> Result<Json<StateAt>, ApiError> {
    let stored = stored_id(&caller, &path.id)?;
    let events = whole_history(&state, &stored, &path.id).await?;
    let last = events.last().map_or(0, |e| e.seq);
    let seq = query.at.unwrap_or(last);
    check_seq(&path.id, seq, last, "at")?;
    let mut shown = describe_at(&stored, &events, seq).map_err(|e| refusal(e, &path.id))?;
    shown.session.session_id = path.id;
    Ok(Json(shown))
}

/// Forks the session at one of its events: a new session whose history is this one's up to
/// `at` (its first event records the parent and seq), going on from there. A fork cut inside
/// a turn gets that turn's pending calls queued, and the server's workers run them.
#[utoipa::path(
    post,
    path = "/v1/sessions/{id}/fork",
    tag = "sessions",
    params(SessionPath),
    request_body = ForkSession,
    responses(
        (status = 201, description = "The fork was created", body = Forked),
        (status = 400, description = "Malformed or invalid request (`at` 0, a bad id or model)", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace, or no event `at` in its history", body = ErrorBody),
        (status = 409, description = "Refused: `at` cuts a transition (the answer names the seqs to use), the model switches provider inside a tool loop, or the fork's id is taken", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn fork(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
    JsonBody(request): JsonBody<ForkSession>,
) -> Result<(StatusCode, Json<Forked>), ApiError> {
    let parent = stored_id(&caller, &path.id)?;
    let model = match &request.model {
        None => None,
        Some(text) => Some(ModelSpec::parse(text).ok_or_else(|| {
            ApiError::invalid(format!(
                "model: {text:?} is not PROVIDER:MODEL (e.g. anthropic:claude-sonnet-4-5)"
            ))
        })?),
    };
    let id = request.id.unwrap_or_else(|| new_session_id(&state));
    let session_id = stored_id(&caller, &id)?;
    let events = whole_history(&state, &parent, &path.id).await?;
    check_seq(
        &path.id,
        request.at,
        events.last().map_or(0, |e| e.seq),
        "at",
    )?;
    let fork = ForkRequest {
        parent,
        at_seq: request.at,
        session_id: session_id.clone(),
        model,
        system_prompt: request.system,
    };
    async {
        // The history is read again inside: a fork of a session that moved on in between
        // still copies exactly the prefix asked for, which is immutable.
        let report = fork_session(&**state.engine.store(), &fork, state.engine.now_ms())
            .await
            .map_err(|e| refusal(e, &path.id))?;
        tracing::info!(
            parent = %path.id,
            at_seq = fork.at_seq,
            events = report.events,
            tasks = report.tasks,
            "forked"
        );
        if report.running && report.tasks > 0 {
            // The fork's tasks were queued by a direct append, which does not wake the
            // workers waiting for tasks; resuming the one session does.
            state
                .engine
                .resume_session(&session_id, false)
                .await
                .map_err(|e| ApiError::from_runtime(e, &id))?;
        }
        Ok((
            StatusCode::CREATED,
            Json(Forked {
                session_id: split_session_id(&report.session_id).1.to_owned(),
                events: report.events,
                running: report.running,
                tasks: report.tasks as u64,
            }),
        ))
    }
    .instrument(session_span(&caller, &id))
    .await
}
