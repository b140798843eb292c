//! The client routes: start a session, send a message, wait for a turn, describe, list, read
//! the history and the transcript, cancel, approve or deny a parked tool call. Session ids are the caller's namespace's own: a
//! session `ID` of namespace `N` is stored as `N:ID` and never seen by another namespace.

use crate::app::AppState;
use crate::auth::{Caller, ClientCaller};
use crate::errors::{ApiError, JsonBody, PathParams, QueryParams};
use crate::idempotency_key::{idempotency_key, session_id_for_key, IdempotencyKeyHeader};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cairn_activities::providers::{render_request, RequestFormat};
use cairn_activities::{CallContext, ModelRequest};
use cairn_ledger::ModelSpec;
use cairn_runtime::client::describe_state;
use cairn_runtime::client::page_sessions;
use cairn_runtime::engine::status_of;
use cairn_runtime::event::{Event, EventEnvelope, RetryPolicy, SessionStarted};
use cairn_runtime::store::{check_session_id, SessionStatus};
use cairn_runtime::wire::{
    schema, split_session_id, store_session_id, ApprovalDecided, ApprovalDecision, ApprovalRequest,
    CancelRequest, Cancelled, CreateSession, ErrorBody, HistoryPage, SessionCreated,
    SessionDescription, SessionPage, TurnStarted, TurnWait,
};
use cairn_runtime::{SessionState, TurnOutcome};
use serde::Deserialize;
use std::sync::atomic::Ordering;
use tracing::Instrument;
use utoipa::{IntoParams, ToSchema};

/// A wait for a turn answers after this long when the request names no timeout.
const DEFAULT_TURN_WAIT_MS: u64 = 30_000;
/// A listing page holds this many sessions when the request names no limit...
const DEFAULT_PAGE: usize = 100;
/// ...and never more than this many.
const MAX_PAGE: usize = 1_000;
/// A history page holds at most this many events.
const MAX_HISTORY_PAGE: usize = 1_000;

/// The stored id of the caller's session `id`, checked: 1-128 of `[A-Za-z0-9._-]`, and short
/// enough with the namespace prefix for the store.
pub fn stored_id(caller: &Caller, id: &str) -> Result<String, ApiError> {
    let valid = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !valid {
        return Err(ApiError::invalid(format!(
            "invalid session id {id:?}: use 1-128 characters of [A-Za-z0-9._-]"
        )));
    }
    let stored = store_session_id(&caller.namespace, id);
    if check_session_id(&stored).is_err() {
        return Err(ApiError::invalid(format!(
            "session id {id:?} is too long for namespace {:?}: its ids have at most {} characters",
            caller.namespace,
            127usize.saturating_sub(caller.namespace.len())
        )));
    }
    Ok(stored)
}

/// The caller's id of a stored session id.
fn client_id(stored: &str) -> &str {
    split_session_id(stored).1
}

/// An event as the caller sees it: its session id, and a fork's parent, are the namespace's
/// own.
pub fn for_client(mut event: EventEnvelope) -> EventEnvelope {
    event.session_id = client_id(&event.session_id).to_owned();
    if let Event::SessionStarted(started) = &mut event.event {
        if let Some(origin) = &mut started.forked_from {
            origin.session_id = client_id(&origin.session_id).to_owned();
        }
    }
    event
}

/// A new session id, unique to this server process: the clock, the process and a counter.
pub fn new_session_id(state: &AppState) -> String {
    format!(
        "s{:x}-{:x}-{}",
        state.engine.now_ms(),
        std::process::id(),
        state.id_counter.fetch_add(1, Ordering::Relaxed)
    )
}

fn check_model(model: &ModelSpec, field: &str) -> Result<(), ApiError> {
    if model.provider.is_empty() || model.model.is_empty() {
        return Err(ApiError::invalid(format!(
            "{field}: the model provider and name must not be empty"
        )));
    }
    Ok(())
}

/// The folded state of the caller's session.
async fn session_state(
    state: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<(String, SessionState), ApiError> {
    let stored = stored_id(caller, id)?;
    let session = state
        .engine
        .state(&stored)
        .await
        .map_err(|e| ApiError::from_runtime(e, id))?;
    Ok((stored, session))
}

pub fn session_span(caller: &Caller, id: &str) -> tracing::Span {
    tracing::info_span!("session", namespace = %caller.namespace, session_id = %id)
}

/// Starts a session, with its first message when the body has one (one commit); with
/// `wait_ms` as well, answers once that turn has ended (or that time has passed) and with its
/// outcome.
#[utoipa::path(
    post,
    path = "/v1/sessions",
    tag = "sessions",
    params(StartTurnQuery, IdempotencyKeyHeader),
    request_body = CreateSession,
    responses(
        (status = 201, description = "The session was started (with `wait_ms`, its first turn's outcome when that ended in time)", body = SessionCreated),
        (status = 400, description = "Malformed or invalid request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 409, description = "The session id is taken (under an `Idempotency-Key`: by a start that was not this one)", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn create_session(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    QueryParams(query): QueryParams<StartTurnQuery>,
    headers: HeaderMap,
    JsonBody(request): JsonBody<CreateSession>,
) -> Result<(StatusCode, Json<SessionCreated>), ApiError> {
    let key = idempotency_key(&headers)?;
    check_model(&request.model, "model")?;
    if let Some(policy) = &request.compaction {
        policy
            .check()
            .map_err(|e| ApiError::invalid(format!("compaction: {e}")))?;
    }
    let id = match (request.session_id, &key) {
        (Some(id), _) => id,
        (None, Some(key)) => session_id_for_key(key),
        (None, None) => new_session_id(&state),
    };
    let stored = stored_id(&caller, &id)?;
    let tool_policy = cairn_workers::policy::session_policy(
        tools_hosted(),
        &request.tools,
        request.tool_policy,
        false,
    )
    .map_err(|e| ApiError::invalid(e.to_string()))?;
    let started = SessionStarted {
        model: request.model,
        tools: request.tools,
        system_prompt: request.system_prompt,
        limits: request.limits.unwrap_or_default(),
        model_retry: request
            .model_retry
            .unwrap_or_else(RetryPolicy::model_default),
        tool_retry: request.tool_retry.unwrap_or_else(RetryPolicy::tool_default),
        queues: request.queues.unwrap_or_default(),
        forked_from: None,
        workflow_version: cairn_runtime::WORKFLOW_VERSION,
        tool_policy,
        compaction: request.compaction,
        workdir: None,
        call_options: request.call_options,
    };
    if let Some(message) = &request.message {
        check_message(message, "message.")?;
    }
    async {
        let created = match (key, request.message) {
            (Some(key), message) => {
                state
                    .engine
                    .start_session_idempotent(&stored, started, &key, message.as_ref())
                    .await
            }
            (None, None) => state
                .engine
                .start_session(Some(stored.clone()), started)
                .await
                .map(|_| None),
            (None, Some(message)) => state
                .engine
                .start_session_and_send_turn(
                    Some(stored.clone()),
                    started,
                    &message.text,
                    message.model,
                    message.media,
                    message.tool_choice,
                )
                .await
                .map(|(_, turn)| Some(turn)),
        };
        match created {
            Ok(turn) => {
                let outcome = match turn {
                    Some(turn) => query.outcome(&state, &stored, turn).await,
                    None => None,
                };
                Ok((
                    StatusCode::CREATED,
                    Json(SessionCreated {
                        session_id: id.clone(),
                        turn,
                        outcome,
                    }),
                ))
            }
            Err(cairn_runtime::Error::Conflict { .. }) => {
                Err(ApiError::conflict(format!("session {id:?} exists already")))
            }
            Err(e) => Err(ApiError::from_runtime(e, &id)),
        }
    }
    .instrument(session_span(&caller, &id))
    .await
}

/// Which sessions to list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only sessions with this status.
    #[param(value_type = Option<schema::SessionStatus>)]
    status: Option<SessionStatus>,
    /// Only sessions whose id sorts after this one (the previous page's `next_after`).
    after: Option<String>,
    /// At most this many (default 100; more than 1000 gives 1000).
    #[param(minimum = 1)]
    limit: Option<u64>,
}

/// Lists the namespace's sessions, ordered by id, one page at a time.
#[utoipa::path(
    get,
    path = "/v1/sessions",
    tag = "sessions",
    params(ListQuery),
    responses(
        (status = 200, description = "One page of sessions", body = SessionPage),
        (status = 400, description = "Invalid query", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn list_sessions(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    QueryParams(query): QueryParams<ListQuery>,
) -> Result<Json<SessionPage>, ApiError> {
    let limit = match query.limit {
        None => DEFAULT_PAGE,
        Some(0) => return Err(ApiError::invalid("limit must be at least 1")),
        Some(n) => usize::try_from(n).unwrap_or(MAX_PAGE).min(MAX_PAGE),
    };
    let all = state
        .engine
        .store()
        .list_sessions()
        .await
        .map_err(ApiError::from_store)?;
    // Stored ids of one namespace share its prefix, so the store's order is the order of the
    // namespace's own ids.
    let mut page = page_sessions(
        all,
        |stored| {
            let (namespace, id) = split_session_id(stored);
            (namespace == caller.namespace).then_some(id)
        },
        query.after.as_deref(),
        query.status,
        limit,
    );
    cairn_runtime::client::fill_in_summaries(&state.engine, &mut page, |id| {
        store_session_id(&caller.namespace, id)
    })
    .await;
    Ok(Json(page))
}

/// A session in the path.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct SessionPath {
    /// The session's id.
    #[param(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    pub id: String,
}

/// Status, turns, usage and pending tasks of a session.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}",
    tag = "sessions",
    params(SessionPath),
    responses(
        (status = 200, description = "The session", body = SessionDescription),
        (status = 400, description = "Invalid session id", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn describe_session(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
) -> Result<Json<SessionDescription>, ApiError> {
    let (_, session) = session_state(&state, &caller, &path.id).await?;
    let mut description = describe_state(&session, status_of(&session));
    description.session_id = path.id;
    Ok(Json(description))
}

/// How long a request that starts a turn waits for it.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StartTurnQuery {
    /// Answer once the turn has ended, with its outcome, or after this many milliseconds
    /// without it (capped by the server, as a long poll is); absent or 0: answer at once. The
    /// turn starts either way. A new session without a first message has no turn: it is
    /// answered at once.
    wait_ms: Option<u64>,
}

impl StartTurnQuery {
    /// The outcome of turn `turn` of the stored session once it has ended, waiting up to
    /// `wait_ms`; `None` when asked not to wait, when it has not ended by then, when the
    /// server is closing, or when waiting failed. The turn has started, so the request
    /// succeeds even then: a failed answer would have the client send its message again.
    async fn outcome(&self, state: &AppState, stored: &str, turn: u32) -> Option<TurnOutcome> {
        let wait_ms = self.wait_ms.filter(|&ms| ms > 0)?;
        let wait = state.poll_wait(Some(wait_ms), 0);
        tokio::select! {
            outcome = state.engine.wait_turn(stored, turn) => match outcome {
                Ok(outcome) => Some(outcome),
                Err(e) => {
                    tracing::warn!(error = %e, turn, "waiting for a turn the request started failed; answering without its outcome");
                    None
                }
            },
            _ = tokio::time::sleep(wait) => None,
            _ = state.closing.cancelled() => None,
        }
    }
}

/// Sends a user message, starting the next turn; with `wait_ms`, answers once the turn has
/// ended (or that time has passed) and with its outcome, sparing a wait request.
#[utoipa::path(
    post,
    path = "/v1/sessions/{id}/messages",
    tag = "sessions",
    params(SessionPath, StartTurnQuery, IdempotencyKeyHeader),
    request_body = cairn_runtime::wire::SendMessage,
    responses(
        (status = 200, description = "The turn started and ended within `wait_ms`: its outcome is in the answer", body = TurnStarted),
        (status = 202, description = "The turn started (and, with `wait_ms`, had not ended by then)", body = TurnStarted),
        (status = 400, description = "Malformed or invalid request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "A turn is running, or the session is cancelled", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 422, description = "The `Idempotency-Key` was sent with another message of the session", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn send_message(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
    QueryParams(query): QueryParams<StartTurnQuery>,
    headers: HeaderMap,
    JsonBody(request): JsonBody<cairn_runtime::wire::SendMessage>,
) -> Result<(StatusCode, Json<TurnStarted>), ApiError> {
    let key = idempotency_key(&headers)?;
    let stored = stored_id(&caller, &path.id)?;
    check_message(&request, "")?;
    let sent = async {
        match key {
            Some(key) => state.engine.send_idempotent(&stored, &key, &request).await,
            None => {
                state
                    .engine
                    .send_turn(
                        &stored,
                        &request.text,
                        request.model,
                        request.media,
                        request.tool_choice,
                    )
                    .await
            }
        }
    };
    let turn = sent
        .instrument(session_span(&caller, &path.id))
        .await
        .map_err(|e| ApiError::from_runtime(e, &path.id))?;
    let outcome = query
        .outcome(&state, &stored, turn)
        .instrument(session_span(&caller, &path.id))
        .await;
    let status = match outcome {
        Some(_) => StatusCode::OK,
        None => StatusCode::ACCEPTED,
    };
    Ok((status, Json(TurnStarted { turn, outcome })))
}

/// Checks a user message before anything is recorded; `at` prefixes the fields named in
/// errors (`message.` in a [`CreateSession`]).
fn check_message(message: &cairn_runtime::wire::SendMessage, at: &str) -> Result<(), ApiError> {
    if message.text.is_empty() && message.media.is_empty() {
        return Err(ApiError::invalid(format!(
            "{at}text: the message must not be empty (unless it carries media)"
        )));
    }
    if let Some(model) = &message.model {
        check_model(model, &format!("{at}model"))?;
    }
    for (i, media) in message.media.iter().enumerate() {
        media
            .check()
            .map_err(|v| ApiError::invalid(format!("{at}media[{i}]: {v}")))?;
    }
    Ok(())
}

/// A turn in the path.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct TurnPath {
    /// The session's id.
    #[param(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    pub id: String,
    /// The turn's number, from 1.
    turn: u32,
}

/// How long to wait.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// Answer `done: false` after this long (ms; default 30 000, capped by the server).
    timeout_ms: Option<u64>,
}

/// Waits for a turn's outcome (a long poll): `done: false` when it has not ended in time.
/// The outcome is this turn's own, even when the session has gone on to later turns.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/turns/{turn}",
    tag = "sessions",
    params(TurnPath, WaitQuery),
    responses(
        (status = 200, description = "The outcome, or `done: false` after the timeout", body = TurnWait),
        (status = 400, description = "Invalid path or query", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace, or no such turn", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn wait_turn(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<TurnPath>,
    QueryParams(query): QueryParams<WaitQuery>,
) -> Result<Json<TurnWait>, ApiError> {
    let (stored, session) = session_state(&state, &caller, &path.id).await?;
    if path.turn == 0 || path.turn > session.turns_started {
        return Err(ApiError::not_found(format!(
            "session {:?} has no turn {} (it started {})",
            path.id, path.turn, session.turns_started
        )));
    }
    let wait = state.poll_wait(query.timeout_ms, DEFAULT_TURN_WAIT_MS);
    let outcome = tokio::select! {
        outcome = state.engine.wait_turn(&stored, path.turn) => {
            Some(outcome.map_err(|e| ApiError::from_runtime(e, &path.id))?)
        }
        _ = tokio::time::sleep(wait) => None,
        _ = state.closing.cancelled() => None,
    };
    Ok(Json(TurnWait {
        done: outcome.is_some(),
        outcome,
    }))
}

/// Which events.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    /// The first seq wanted (default 1).
    from_seq: Option<u64>,
    /// At most this many events (default and cap 1000).
    #[param(minimum = 1)]
    limit: Option<u64>,
}

/// A session's events from a seq on.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/history",
    tag = "sessions",
    params(SessionPath, HistoryQuery),
    responses(
        (status = 200, description = "Events in seq order", body = HistoryPage),
        (status = 400, description = "Invalid path or query", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn history(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
    QueryParams(query): QueryParams<HistoryQuery>,
) -> Result<Json<HistoryPage>, ApiError> {
    let stored = stored_id(&caller, &path.id)?;
    let from_seq = query.from_seq.unwrap_or(1).max(1);
    let limit = match query.limit {
        None => MAX_HISTORY_PAGE,
        Some(0) => return Err(ApiError::invalid("limit must be at least 1")),
        Some(n) => usize::try_from(n)
            .unwrap_or(MAX_HISTORY_PAGE)
            .min(MAX_HISTORY_PAGE),
    };
    let events = state
        .engine
        .store()
        .read_history(&stored, from_seq, Some(limit))
        .await
        .map_err(|e| ApiError::from_runtime(e, &path.id))?;
    let next_seq = events.last().map_or(from_seq, |e| e.seq + 1);
    Ok(Json(HistoryPage {
        events: events.into_iter().map(for_client).collect(),
        next_seq,
    }))
}

/// A provider's request format.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
pub enum TranscriptFormat {
    /// Anthropic Messages.
    #[serde(rename = "anthropic")]
    Anthropic,
    /// OpenAI Chat Completions.
    #[serde(rename = "openai")]
    OpenAi,
    /// OpenAI Chat Completions (the CLI's name).
    #[serde(rename = "openai-chat")]
    OpenAiChat,
    /// OpenAI Responses.
    #[serde(rename = "openai-responses")]
    OpenAiResponses,
    /// Amazon Bedrock Converse.
    #[serde(rename = "bedrock")]
    Bedrock,
}

impl From<TranscriptFormat> for RequestFormat {
    fn from(format: TranscriptFormat) -> Self {
        match format {
            TranscriptFormat::Anthropic => RequestFormat::Anthropic,
            TranscriptFormat::OpenAi | TranscriptFormat::OpenAiChat => RequestFormat::OpenAiChat,
            TranscriptFormat::OpenAiResponses => RequestFormat::OpenAiResponses,
            TranscriptFormat::Bedrock => RequestFormat::Bedrock,
        }
    }
}

/// Which rendering of the transcript.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TranscriptQuery {
    /// Instead of the canonical transcript, the exact request body this provider would be
    /// sent next.
    #[serde(rename = "as")]
    #[param(rename = "as", value_type = Option<TranscriptFormat>)]
    format: Option<TranscriptFormat>,
    /// With `as`: the model name to render with (default: the session's model).
    model: Option<String>,
}

/// The session's transcript (the ledger) as canonical JSON, or a provider's request body.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/transcript",
    tag = "sessions",
    params(SessionPath, TranscriptQuery),
    responses(
        (status = 200, description = "The canonical transcript `{\"messages\": [...]}`, or the provider's request body", body = Object),
        (status = 400, description = "Invalid path or query", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "The transcript breaks the provider's rules", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn transcript(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
    QueryParams(query): QueryParams<TranscriptQuery>,
) -> Result<Response, ApiError> {
    let (stored, session) = session_state(&state, &caller, &path.id).await?;
    let Some(format) = query.format else {
        // The canonical bytes, not a re-serialization: they are what replay compares.
        return Ok((
            [(header::CONTENT_TYPE, "application/json")],
            session.transcript.canonical_json(),
        )
            .into_response());
    };
    let Some(started) = &session.started else {
        return Err(ApiError::no_session(&path.id));
    };
    let mut model = session
        .active
        .as_ref()
        .map_or_else(|| started.model.clone(), |a| a.model.clone());
    if let Some(name) = query.model {
        model.model = name;
    }
    let request = ModelRequest {
        context: CallContext {
            session_id: stored,
            turn: session.turns_started,
            round: session.active.as_ref().map_or(0, |a| a.round),
            attempt: 1,
        },
        model,
        transcript: session.transcript.clone(),
        tools: started.tools.clone(),
        options: session.active.as_ref().map_or_else(
            || started.call_options.for_call(None, 0),
            |a| {
                started
                    .call_options
                    .for_call(a.tool_choice.as_ref(), a.round)
            },
        ),
    };
    let body = render_request(format.into(), &request)
        .map_err(|e| ApiError::conflict(format!("cannot render the transcript: {e}")))?;
    Ok(Json(body).into_response())
}

/// Cancels a session, or only its running turn.
#[utoipa::path(
    post,
    path = "/v1/sessions/{id}/cancel",
    tag = "sessions",
    params(SessionPath),
    request_body = CancelRequest,
    responses(
        (status = 200, description = "Cancelled", body = Cancelled),
        (status = 400, description = "Malformed or invalid request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "No turn runs (`turn_only`), or the session is cancelled already", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn cancel(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
    JsonBody(request): JsonBody<CancelRequest>,
) -> Result<Json<Cancelled>, ApiError> {
    let stored = stored_id(&caller, &path.id)?;
    let reason = request
        .reason
        .unwrap_or_else(|| "cancelled through the API".to_owned());
    let span = session_span(&caller, &path.id);
    if request.turn_only {
        let turn = state
            .engine
            .cancel_turn(&stored, &reason)
            .instrument(span)
            .await
            .map_err(|e| ApiError::from_runtime(e, &path.id))?;
        Ok(Json(Cancelled { turn: Some(turn) }))
    } else {
        state
            .engine
            .cancel(&stored, &reason)
            .instrument(span)
            .await
            .map_err(|e| ApiError::from_runtime(e, &path.id))?;
        Ok(Json(Cancelled { turn: None }))
    }
}

/// The tools a server knows the policy subjects and defaults of: the ones its workers host.
/// The tools a worker hosts, for what a session's policy asks of them by default. Built once:
/// a registry builds every tool's spec and schema, which cost more than the rest of a
/// create request.
fn tools_hosted() -> &'static cairn_activities::ToolRegistry {
    static HOSTED: std::sync::LazyLock<cairn_activities::ToolRegistry> =
        std::sync::LazyLock::new(|| cairn_activities::ToolRegistry::hosted("."));
    &HOSTED
}

/// A tool call in the path.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct ToolCallPath {
    /// The session's id.
    #[param(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    pub id: String,
    /// The tool_use id of the parked call.
    #[param(min_length = 1, max_length = 256)]
    pub tool_use_id: String,
}

/// Approves or denies a tool call the session's policy parked for approval. An approved call
/// is scheduled at once; a denied one is answered with an `is_error` result carrying the
/// reason, which the model reads. Both are recorded in the history
/// (`tool_call_approved`, `tool_call_denied`) before the answer.
#[utoipa::path(
    post,
    path = "/v1/sessions/{id}/approvals/{tool_use_id}",
    tag = "sessions",
    params(ToolCallPath),
    request_body = ApprovalRequest,
    responses(
        (status = 200, description = "The decision is recorded", body = ApprovalDecided),
        (status = 400, description = "Malformed or invalid request", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 409, description = "No such tool call waits for approval (never parked, or already decided)", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy); retry", body = ErrorBody),
    )
)]
pub async fn decide_approval(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<ToolCallPath>,
    JsonBody(request): JsonBody<ApprovalRequest>,
) -> Result<Json<ApprovalDecided>, ApiError> {
    let stored = stored_id(&caller, &path.id)?;
    if path.tool_use_id.is_empty() || path.tool_use_id.len() > 256 {
        return Err(ApiError::invalid("tool_use_id: 1-256 characters"));
    }
    let decided = match request.decision {
        ApprovalDecision::Approve => state.engine.approve(&stored, &path.tool_use_id).await,
        ApprovalDecision::Deny => {
            let reason = request
                .reason
                .filter(|r| !r.trim().is_empty())
                .unwrap_or_else(|| "denied by a person (no reason given)".to_owned());
            state.engine.deny(&stored, &path.tool_use_id, &reason).await
        }
    };
    decided
        .map_err(|e| ApiError::from_runtime(e, &path.id))
        .map(|()| {
            Json(ApprovalDecided {
                tool_use_id: path.tool_use_id,
                decision: request.decision,
            })
        })
}
