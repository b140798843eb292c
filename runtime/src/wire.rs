//! The wire types of the `/v1` HTTP API: one module of serde types shared by the server, the
//! remote client and remote workers, so that the three cannot drift apart.
//!
//! # Routes
//! Client role (a token with role `client`):
//!
//! | method | path | body → answer |
//! |---|---|---|
//! | POST | `/v1/sessions` | [`CreateSession`] → 201 [`SessionCreated`] |
//! | GET | `/v1/sessions?status=&after=&limit=` | → [`SessionPage`] |
//! | GET | `/v1/sessions/{id}` | → [`SessionDescription`] |
//! | POST | `/v1/sessions/{id}/messages` | [`SendMessage`] → 202 [`TurnStarted`] |
//! | GET | `/v1/sessions/{id}/turns/{turn}?timeout_ms=` | long poll → [`TurnWait`] |
//! | GET | `/v1/sessions/{id}/history?from_seq=&limit=` | → [`HistoryPage`] |
//! | GET | `/v1/sessions/{id}/transcript?as=` | → the canonical transcript JSON, or a provider's |
//! | POST | `/v1/sessions/{id}/cancel` | [`CancelRequest`] → [`Cancelled`] |
//! | GET | `/v1/sessions/{id}/events?after_seq=` | SSE: [`StreamEvent`]s; `id` = seq, `Last-Event-ID` resumes |
//!
//! Worker role (a token with role `worker`):
//!
//! | method | path | body → answer |
//! |---|---|---|
//! | POST | `/v1/worker/lease` | [`LeaseRequest`] → [`LeaseResponse`] (long poll up to `wait_ms`) |
//! | POST | `/v1/worker/input` | [`Lease`] → [`ActivityInput`](crate::engine::ActivityInput) (what a lease runs, again) |
//! | POST | `/v1/worker/heartbeat` | [`HeartbeatRequest`] → [`HeartbeatResponse`] |
//! | POST | `/v1/worker/progress` | [`ProgressRequest`] → 204 |
//! | POST | `/v1/worker/report` | [`ReportRequest`] → 204 |
//! | POST | `/v1/worker/deltas` | [`DeltaBatch`] → 204 |
//!
//! Either role: `GET /v1/health` → [`Health`]; `GET /v1/openapi.json`, the OpenAPI document.
//!
//! Every error is [`ErrorBody`] with the fitting status; [`ErrorCode`] names the cases a
//! program branches on (a stale worker report is 409 `stale_report` or `lease_lost`).
//!
//! Session ids on the wire are the namespace's own: the server stores a session of namespace
//! `N` (other than [`DEFAULT_NAMESPACE`]) as `N:ID`, and a token of one namespace never sees
//! another's sessions.

use crate::engine::{ActivityReport, DeltaEvent, LeasedTask};
use crate::event::{EventEnvelope, Limits, Queues, RetryPolicy};
use crate::store::{Lease, SessionStatus};
use crate::workflow::TurnOutcome;
use cairn_ledger::{JsonText, ModelSpec, ToolSpec, Usage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// The namespace of a server without a tokens file, and of sessions stored without a prefix.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The separator between a namespace and a session id in the store (`N:ID`).
pub const NAMESPACE_SEPARATOR: char = ':';

/// `POST /v1/sessions`: how to start a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// A chosen id (1-128 of `[A-Za-z0-9._-]`); generated when absent.
    #[serde(default)]
    pub session_id: Option<String>,
    /// The default model.
    pub model: ModelSpec,
    /// Tools offered to the model.
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    /// A system prompt.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Turn limits; defaults when absent.
    #[serde(default)]
    pub limits: Option<Limits>,
    /// Model call retries; defaults when absent.
    #[serde(default)]
    pub model_retry: Option<RetryPolicy>,
    /// Tool call retries; defaults when absent.
    #[serde(default)]
    pub tool_retry: Option<RetryPolicy>,
    /// The queues of its model and tool calls; `default` when absent.
    #[serde(default)]
    pub queues: Option<Queues>,
}

/// `201` to [`CreateSession`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionCreated {
    /// The session's id.
    pub session_id: String,
}

/// `POST /v1/sessions/{id}/messages`: a user message, starting a turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendMessage {
    /// The message.
    pub text: String,
    /// A model for this turn only.
    #[serde(default)]
    pub model: Option<ModelSpec>,
}

/// `202` to [`SendMessage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnStarted {
    /// The turn's number.
    pub turn: u32,
}

/// The answer to a long poll for a turn's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnWait {
    /// Whether the turn has ended (`outcome` is set).
    pub done: bool,
    /// How it ended.
    #[serde(default)]
    pub outcome: Option<TurnOutcome>,
}

/// `POST /v1/sessions/{id}/cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    /// Why; recorded in the history.
    #[serde(default)]
    pub reason: Option<String>,
    /// Cancel the running turn only; the session takes further turns.
    #[serde(default)]
    pub turn_only: bool,
}

/// The answer to [`CancelRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancelled {
    /// The turn that was cancelled, when `turn_only`.
    #[serde(default)]
    pub turn: Option<u32>,
}

/// One session in a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionSummary {
    /// Its id (in the caller's namespace).
    pub session_id: String,
    /// Its status after the last append.
    pub status: SessionStatus,
    /// Events recorded.
    pub events: u64,
    /// Time of the last append (epoch ms).
    pub updated_at_ms: u64,
}

/// `GET /v1/sessions`: one page, ordered by id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionPage {
    /// The sessions.
    pub sessions: Vec<SessionSummary>,
    /// Pass as `after` for the next page; absent on the last.
    #[serde(default)]
    pub next_after: Option<String>,
}

/// A pending activity task of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingTask {
    /// The seq of the event that scheduled it.
    pub scheduled_seq: u64,
    /// `model:ROUND` or `tool:TOOL_USE_ID`.
    pub activity: String,
    /// Its attempt.
    pub attempt: u32,
}

/// `GET /v1/sessions/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionDescription {
    /// Its id.
    pub session_id: String,
    /// Its status.
    pub status: SessionStatus,
    /// Events recorded.
    pub events: u64,
    /// Turns started.
    pub turns: u32,
    /// The running turn, if any.
    #[serde(default)]
    pub running_turn: Option<u32>,
    /// How the last finished turn ended.
    #[serde(default)]
    pub last_outcome: Option<TurnOutcome>,
    /// Token usage of every model call attempt so far.
    pub usage: Usage,
    /// Activities the running turn waits for.
    pub pending_tasks: Vec<PendingTask>,
    /// The session's default model.
    #[serde(default)]
    pub model: Option<ModelSpec>,
}

/// `GET /v1/sessions/{id}/history`: events from a seq on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryPage {
    /// The events, in seq order.
    pub events: Vec<EventEnvelope>,
    /// The seq to ask from for the next page (one past the last event given).
    pub next_seq: u64,
}

/// One message of a session's SSE stream. The SSE `event` field is `event` or `delta`; an
/// `event` message's `id` is its seq.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)] // most messages of a stream are events, the large variant
pub enum StreamEvent {
    /// A history event, exactly once per stream (also across reconnects with `Last-Event-ID`).
    Event(EventEnvelope),
    /// A model delta, tagged with its attempt; presentation only, may be missed.
    Delta(DeltaEvent),
}

/// `POST /v1/worker/lease`: what this worker can run and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Tasks wanted at most.
    pub max: u32,
    /// How long to wait for the first task (ms); 0 answers at once.
    #[serde(default)]
    pub wait_ms: u64,
    /// Lease length (ms); renew it with heartbeats before it runs out.
    pub lease_ms: u64,
    /// The queues it serves; absent: every queue.
    #[serde(default)]
    pub queues: Option<BTreeSet<String>>,
    /// The tools it hosts; absent: any.
    #[serde(default)]
    pub tools: Option<BTreeSet<String>>,
    /// The model providers it hosts; absent: any.
    #[serde(default)]
    pub providers: Option<BTreeSet<String>>,
}

/// The answer to [`LeaseRequest`]: possibly empty after `wait_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseResponse {
    /// Leased tasks with what they run.
    pub tasks: Vec<LeasedTask>,
}

/// `POST /v1/worker/heartbeat`: renews a lease, recording progress details durably.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    /// The lease.
    pub lease: Lease,
    /// Renew for this long from now (ms).
    pub lease_ms: u64,
    /// Progress to hand the next attempt if this one fails.
    #[serde(default)]
    pub details: Option<JsonText>,
}

/// The answer to [`HeartbeatRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    /// The lease's new expiry (epoch ms).
    pub expires_at_ms: u64,
}

/// `POST /v1/worker/progress`: what a model attempt streamed since its last record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgressRequest {
    /// The lease.
    pub lease: Lease,
    /// Text streamed since the last record.
    pub text_appended: String,
    /// Thinking streamed since the last record.
    pub thinking_appended: String,
}

/// `POST /v1/worker/report`: an attempt's result, fenced by its lease attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    /// The lease.
    pub lease: Lease,
    /// The result.
    pub report: ActivityReport,
}

/// `POST /v1/worker/deltas`: model deltas for the sessions' live streams.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeltaBatch {
    /// The deltas, in order.
    pub deltas: Vec<DeltaEvent>,
}

/// `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// `ok`, or `draining` once the server stopped handing out tasks.
    pub status: String,
}

/// Every error answer: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// A stable code to branch on.
    pub code: ErrorCode,
    /// A sentence for people: what was wrong, and where.
    pub message: String,
}

/// The error codes of the API, with their HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: malformed JSON, a wrong type, a missing field, an invalid value.
    InvalidRequest,
    /// 401: no token, or a token the server does not know.
    Unauthorized,
    /// 403: a token of the wrong role for this route.
    Forbidden,
    /// 404: no such session (in this namespace), or no such route.
    NotFound,
    /// 405: the route exists, the method does not.
    MethodNotAllowed,
    /// 409: a message while a turn runs, a cancel with nothing to cancel, a session id taken.
    Conflict,
    /// 409: a worker's report the workflow no longer waits for.
    StaleReport,
    /// 409: a worker's lease that is no longer current (lapsed, completed or cancelled).
    LeaseLost,
    /// 413: the body is too large.
    TooLarge,
    /// 415: the body is not JSON.
    UnsupportedMediaType,
    /// 500: the server failed (a store error); the request may be retried.
    Internal,
    /// 503: the server is draining (shutting down) and takes no new work.
    Unavailable,
}

impl ErrorCode {
    /// The HTTP status of this code.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::Conflict | ErrorCode::StaleReport | ErrorCode::LeaseLost => 409,
            ErrorCode::TooLarge => 413,
            ErrorCode::UnsupportedMediaType => 415,
            ErrorCode::Internal => 500,
            ErrorCode::Unavailable => 503,
        }
    }

    /// The snake_case name, as on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Conflict => "conflict",
            ErrorCode::StaleReport => "stale_report",
            ErrorCode::LeaseLost => "lease_lost",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::Internal => "internal",
            ErrorCode::Unavailable => "unavailable",
        }
    }
}

/// The store id of namespace `namespace`'s session `session_id` (`N:ID`, or `ID` in the
/// default namespace).
pub fn store_session_id(namespace: &str, session_id: &str) -> String {
    if namespace == DEFAULT_NAMESPACE {
        session_id.to_owned()
    } else {
        format!("{namespace}{NAMESPACE_SEPARATOR}{session_id}")
    }
}

/// The namespace and the namespace's own id of a stored session id.
pub fn split_session_id(stored: &str) -> (&str, &str) {
    match stored.split_once(NAMESPACE_SEPARATOR) {
        Some((namespace, id)) => (namespace, id),
        None => (DEFAULT_NAMESPACE, stored),
    }
}
