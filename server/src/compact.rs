//! `POST /v1/sessions/{id}/compact`: compaction of a session's transcript on request.

use crate::app::AppState;
use crate::auth::ClientCaller;
use crate::errors::{ApiError, PathParams};
use crate::sessions::{stored_id, SessionPath};
use axum::extract::State;
use axum::Json;
use cairn_runtime::wire::{CompactionOutcome, ErrorBody};

/// Compacts a session's transcript now, between turns, with the session's compaction policy
/// (or the default one: drop reasoning and failed tool results of completed turns, keep the
/// last 4 turns). Recorded in the history (`compaction_requested`, then
/// `transcript_compacted` unless no strategy shrinks the transcript) before the answer, and
/// streamed to the session's SSE followers like every event.
#[utoipa::path(
    post,
    path = "/v1/sessions/{id}/compact",
    tag = "sessions",
    params(SessionPath),
    responses(
        (status = 200, description = "Compacted, or nothing to compact (`compacted: false`)", body = CompactionOutcome),
        (status = 400, description = "Malformed request, or an invalid session id", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "A turn is running, or the session is cancelled", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn compact(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
) -> Result<Json<CompactionOutcome>, ApiError> {
    let stored = stored_id(&caller, &path.id)?;
    state
        .engine
        .compact(&stored)
        .await
        .map(Json)
        .map_err(|e| ApiError::from_runtime(e, &path.id))
}
