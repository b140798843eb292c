//! `DELETE /v1/sessions/{id}`: deletes a finished session (its history, record and tasks, at
//! once and durably; the id is never used again), as `temporal workflow delete` does.

use crate::app::AppState;
use crate::auth::ClientCaller;
use crate::errors::{ApiError, PathParams};
use crate::sessions::{session_span, stored_id, SessionPath};
use axum::extract::State;
use axum::Json;
use cairn_runtime::wire::{ErrorBody, SessionDeleted};
use tracing::Instrument;

/// Deletes a finished session.
#[utoipa::path(
    delete,
    path = "/v1/sessions/{id}",
    tag = "sessions",
    params(SessionPath),
    responses(
        (status = 200, description = "Deleted: its history, record and tasks are gone, and the id is never used again", body = SessionDeleted),
        (status = 400, description = "Invalid session id", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace (or it was deleted already)", body = ErrorBody),
        (status = 409, description = "`session_busy`: a turn is running, or a task of the session is queued or leased; cancel it first", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn delete_session(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
) -> Result<Json<SessionDeleted>, ApiError> {
    let stored = stored_id(&caller, &path.id)?;
    let info = state
        .engine
        .delete_session(&stored)
        .instrument(session_span(&caller, &path.id))
        .await
        .map_err(|e| ApiError::from_runtime(e, &path.id))?;
    Ok(Json(SessionDeleted {
        session_id: path.id,
        events: info.events,
    }))
}
