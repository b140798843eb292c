//! Error answers: every failed request gets an [`ErrorBody`] with the status of its
//! [`ErrorCode`], including axum's own rejections (malformed JSON, a wrong content type, a body
//! over the limit, a bad path or query), which the extractors here turn into that body.

use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use cairn_runtime::wire::{ErrorBody, ErrorCode, ErrorDetail};
use cairn_runtime::Error as RuntimeError;
use serde::de::DeserializeOwned;

/// A request's failure as the client sees it: a code and a sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The code (and so the status).
    pub code: ErrorCode,
    /// What was wrong, for people.
    pub message: String,
}

impl ApiError {
    /// An error of `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }

    /// 400 `invalid_request`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// 409 `conflict`.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
    }

    /// 404 for a session the caller's namespace does not have.
    pub fn no_session(session_id: &str) -> Self {
        Self::not_found(format!("no session {session_id:?}"))
    }

    /// The answer to an engine error on session `session_id` (the caller's id: engine
    /// messages name the stored one, so only their reasons are passed on).
    pub fn from_runtime(error: RuntimeError, session_id: &str) -> Self {
        match error {
            RuntimeError::UnknownSession { .. } => Self::no_session(session_id),
            RuntimeError::InvalidSessionId { .. } => Self::invalid(format!(
                "invalid session id {session_id:?}: use 1-128 characters of [A-Za-z0-9._-]"
            )),
            // The workflow refused the input in the session's current state: a message while
            // a turn runs, a message to a cancelled session, a report that does not fit.
            RuntimeError::InvalidEvent { reason, .. } => Self::conflict(reason),
            RuntimeError::StaleReport { reason, .. } => Self::new(ErrorCode::StaleReport, reason),
            RuntimeError::LeaseLost { task, reason } => Self::new(
                ErrorCode::LeaseLost,
                format!("lease of task {task}: {reason}"),
            ),
            RuntimeError::SessionDeleted { .. } => Self::conflict(format!(
                "session {session_id:?} was deleted; its id cannot be used again"
            )),
            RuntimeError::SessionBusy { reason, .. } => Self::new(
                ErrorCode::SessionBusy,
                format!("session {session_id:?} cannot be deleted: {reason}"),
            ),
            RuntimeError::IdempotencyKeyReused { key, turn, .. } => Self::new(
                ErrorCode::IdempotencyKeyReused,
                format!(
                    "Idempotency-Key {key:?} was sent with another message, which started turn \
                     {turn} of session {session_id:?}; send a new message under a new key"
                ),
            ),
            // Other writers of the session won every race the engine ran for this request
            // (it decides again after each): nothing was written, and the same request may
            // go through in a moment. A 503, which clients and workers retry, not a 409,
            // which says the request itself does not fit the session.
            RuntimeError::Conflict { .. } => Self::new(
                ErrorCode::Unavailable,
                format!(
                    "session {session_id:?} kept changing under other writers while this \
                     request was applied, and nothing was written; retry"
                ),
            ),
            RuntimeError::Ledger(e) => Self::invalid(e.to_string()),
            RuntimeError::Shutdown => {
                Self::new(ErrorCode::Unavailable, "the server is shutting down")
            }
            // The database is restarting or its connections are all taken: the client may
            // retry. Whether a failed write landed is read back from the session.
            RuntimeError::StoreUnavailable { reason } => {
                tracing::warn!(reason = %reason, "store unavailable");
                Self::new(
                    ErrorCode::Unavailable,
                    "the store is unavailable for now; retry (a write that failed this way may \
                     have landed: read the session first)",
                )
            }
            // The session's own history, not the server, is at fault, and trying again
            // reads the same: say what is wrong with it (the client may read its history).
            RuntimeError::HistoryUnreadable { reason, .. } => {
                Self::unreadable_history(session_id, reason)
            }
            RuntimeError::CorruptRecord { seq, reason, .. } => {
                Self::unreadable_history(session_id, format!("record {seq} is corrupt: {reason}"))
            }
            RuntimeError::UnknownSchemaVersion { seq, version, .. } => Self::unreadable_history(
                session_id,
                format!(
                    "event {seq} has schema version {version}, newer than this server reads \
                     (up to {})",
                    cairn_runtime::event::SCHEMA_VERSION
                ),
            ),
            RuntimeError::Nondeterminism {
                seq,
                expected,
                found,
                ..
            } => Self::unreadable_history(
                session_id,
                format!(
                    "replayed with this server's code it diverges at event {seq}: the workflow \
                     expected {expected}, the history has {found}"
                ),
            ),
            other => Self::internal(&other),
        }
    }

    /// 500 `history_unreadable` for a session whose history this server cannot fold: not a
    /// passing failure, so the message says what is wrong rather than inviting a retry.
    fn unreadable_history(session_id: &str, what: String) -> Self {
        tracing::error!(session_id, what = %what, "a session's history cannot be read");
        Self::new(
            ErrorCode::HistoryUnreadable,
            format!(
                "the history of session {session_id:?} cannot be read by this server, and trying \
                 again will not change that: {what}"
            ),
        )
    }

    /// A failure of the store outside any session: 503 when it is retryable (the database
    /// restarting, its connections all taken), else 500 `internal`.
    pub fn from_store(error: RuntimeError) -> Self {
        if error.is_retryable() {
            return Self::from_runtime(error, "");
        }
        Self::internal(&error)
    }

    /// 500 `internal`: the details go to the log, the client gets a sentence without them
    /// (store paths and engine internals are the operator's business).
    pub fn internal(error: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %error, "request failed");
        Self::new(
            ErrorCode::Internal,
            "the server failed to carry out the request (see its log); it may be retried",
        )
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message.clone(),
            },
        }
    }

    /// The code of a status the server answers without a handler (no route, a wrong method,
    /// a layer's refusal).
    pub fn code_of_status(status: StatusCode) -> ErrorCode {
        match status.as_u16() {
            401 => ErrorCode::Unauthorized,
            403 => ErrorCode::Forbidden,
            404 => ErrorCode::NotFound,
            405 => ErrorCode::MethodNotAllowed,
            409 => ErrorCode::Conflict,
            413 => ErrorCode::TooLarge,
            415 => ErrorCode::UnsupportedMediaType,
            503 => ErrorCode::Unavailable,
            // 400, and client errors the API has no code of (408, 411, ...).
            400..=499 => ErrorCode::InvalidRequest,
            _ => ErrorCode::Internal,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        match self.code {
            ErrorCode::Unauthorized => {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // The rest of the body was not read, so the connection cannot carry another
            // request: say so, or a client reusing it sees its next request cut off.
            ErrorCode::TooLarge => {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        response
    }
}

/// A JSON body; rejections are [`ApiError`]s: 415 without a JSON content type, 413 over the
/// body limit, 400 when it does not parse (naming the field). Integers may be spelled as whole
/// floats, as JSON Schema allows ([`crate::lenient`]).
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !is_json(req.headers()) {
            return Err(ApiError::new(
                ErrorCode::UnsupportedMediaType,
                "the body must be JSON, sent with `content-type: application/json`",
            ));
        }
        let bytes = match Bytes::from_request(req, state).await {
            Ok(bytes) => bytes,
            Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                return Err(ApiError::new(
                    ErrorCode::TooLarge,
                    "the body is larger than the server takes",
                ))
            }
            Err(rejection) => return Err(ApiError::invalid(rejection.body_text())),
        };
        crate::lenient::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
    }
}

/// The value of the request's header `name` (written `shown` in errors) as text, `None`
/// when absent: one sent more than once is 400 naming it, and so is one that is not visible
/// ASCII, with `use_instead` saying what to write.
pub fn single_header<'a>(
    headers: &'a axum::http::HeaderMap,
    name: &str,
    shown: &str,
    use_instead: &str,
) -> Result<Option<&'a str>, ApiError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::invalid(format!(
            "{shown}: the header is sent more than once"
        )));
    }
    value
        .to_str()
        .map(Some)
        .map_err(|_| ApiError::invalid(format!("{shown}: {use_instead}")))
}

/// Whether the request says its body is JSON (`application/json`, or `application/*+json`).
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Query parameters; rejections are 400 [`ApiError`]s.
pub struct QueryParams<T>(pub T);

impl<S, T> FromRequestParts<S> for QueryParams<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(QueryParams(value)),
            Err(rejection) => Err(query_rejection(rejection)),
        }
    }
}

fn query_rejection(rejection: QueryRejection) -> ApiError {
    ApiError::invalid(rejection.body_text())
}

/// Path parameters; rejections are 400 [`ApiError`]s.
pub struct PathParams<T>(pub T);

impl<S, T> FromRequestParts<S> for PathParams<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(PathParams(value)),
            Err(rejection) => Err(path_rejection(rejection)),
        }
    }
}

fn path_rejection(rejection: PathRejection) -> ApiError {
    ApiError::invalid(rejection.body_text())
}

/// Gives every error answer that did not come from a handler — no route (404), a wrong
/// method (405, its `Allow` header kept), a layer's refusal — the JSON body of its status.
pub async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let code = ApiError::code_of_status(status);
    let message = match code {
        ErrorCode::NotFound => "no such route".to_owned(),
        ErrorCode::MethodNotAllowed => {
            "this route does not take this method (see `Allow`)".to_owned()
        }
        _ => status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_owned(),
    };
    let (mut parts, _) = response.into_parts();
    let body = ApiError::new(code, message).body();
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_maps_back_from_its_status() {
        for code in [
            ErrorCode::InvalidRequest,
            ErrorCode::Unauthorized,
            ErrorCode::Forbidden,
            ErrorCode::NotFound,
            ErrorCode::MethodNotAllowed,
            ErrorCode::Conflict,
            ErrorCode::TooLarge,
            ErrorCode::UnsupportedMediaType,
            ErrorCode::Internal,
            ErrorCode::Unavailable,
        ] {
            let status = StatusCode::from_u16(code.status()).unwrap();
            assert_eq!(ApiError::code_of_status(status), code);
        }
    }

    #[test]
    fn engine_rejections_are_conflicts_and_store_failures_hide_their_details() {
        let busy = ApiError::from_runtime(
            RuntimeError::InvalidEvent {
                session_id: "acme:s1".into(),
                seq: 3,
                reason: "a turn is already running".into(),
            },
            "s1",
        );
        assert_eq!(busy.code, ErrorCode::Conflict);
        assert_eq!(busy.message, "a turn is already running");
        let failed = ApiError::from_runtime(
            RuntimeError::Store {
                reason: "io error at /secret/path".into(),
            },
            "s1",
        );
        assert_eq!(failed.code, ErrorCode::Internal);
        assert!(!failed.message.contains("/secret/path"));
        let unknown = ApiError::from_runtime(
            RuntimeError::UnknownSession {
                session_id: "acme:s1".into(),
            },
            "s1",
        );
        assert_eq!(unknown.code, ErrorCode::NotFound);
        assert!(!unknown.message.contains("acme"));
    }

    #[test]
    fn a_history_that_does_not_fold_is_said_plainly_in_the_callers_ids() {
        let diverged = ApiError::from_runtime(
            RuntimeError::Nondeterminism {
                session_id: "acme:s1".into(),
                seq: 4,
                expected: "no command".into(),
                found: "TurnCompleted".into(),
            },
            "s1",
        );
        assert_eq!(
            (diverged.status(), diverged.code),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::HistoryUnreadable
            )
        );
        assert_eq!(
            diverged.message,
            "the history of session \"s1\" cannot be read by this server, and trying again \
             will not change that: replayed with this server's code it diverges at event 4: the \
             workflow expected no command, the history has TurnCompleted"
        );
        let corrupt = ApiError::from_runtime(
            RuntimeError::CorruptRecord {
                session_id: "acme:s1".into(),
                seq: 2,
                reason: "checksum mismatch".into(),
            },
            "s1",
        );
        assert!(
            corrupt
                .message
                .ends_with("record 2 is corrupt: checksum mismatch")
                && !corrupt.message.contains("acme"),
            "{}",
            corrupt.message
        );
    }

    #[test]
    fn an_append_that_kept_losing_races_is_a_retryable_503_not_a_refusal() {
        let contended = ApiError::from_runtime(
            RuntimeError::Conflict {
                session_id: "acme:s1".into(),
                expected: 7,
                actual: 9,
            },
            "s1",
        );
        assert_eq!(
            (contended.status(), contended.code),
            (StatusCode::SERVICE_UNAVAILABLE, ErrorCode::Unavailable)
        );
        assert!(
            contended.message.contains("\"s1\"") && contended.message.ends_with("retry"),
            "{}",
            contended.message
        );
        // What a client makes of that answer: an error it tries again.
        let seen = RuntimeError::Remote {
            url: "http://127.0.0.1:1".into(),
            status: contended.status().as_u16(),
            code: contended.code.as_str().into(),
            message: contended.message.clone(),
        };
        assert!(seen.is_retryable());
    }
}
