//! The wire types of the `/v1` HTTP API: one module of serde types shared by the server, the
//! remote client and remote workers, so that the three cannot drift apart.
//!
//! # Routes
//! Client role (a token with role `client`):
//!
//! | method | path | body → answer |
//! |---|---|---|
//! | POST | `/v1/sessions?wait_ms=` | [`CreateSession`] → 201 [`SessionCreated`] (with `wait_ms` and a first message: its turn's outcome when it ends in time) |
//! | GET | `/v1/sessions?status=&after=&limit=` | → [`SessionPage`] |
//! | GET | `/v1/sessions/{id}` | → [`SessionDescription`] |
//! | POST | `/v1/sessions/{id}/messages?wait_ms=` | [`SendMessage`] → 202 [`TurnStarted`] (with `wait_ms`: 200 and the turn's outcome when it ends in time) |
//! | GET | `/v1/sessions/{id}/turns/{turn}?timeout_ms=` | long poll → [`TurnWait`] |
//! | GET | `/v1/sessions/{id}/history?from_seq=&limit=` | → [`HistoryPage`] |
//! | GET | `/v1/sessions/{id}/transcript?as=` | → the canonical transcript JSON, or a provider's |
//! | POST | `/v1/sessions/{id}/cancel` | [`CancelRequest`] → [`Cancelled`] |
//! | DELETE | `/v1/sessions/{id}` | → [`SessionDeleted`] (404 unknown, 409 `session_busy` while it runs) |
//! | POST | `/v1/sessions/{id}/approvals/{tool_use_id}` | [`ApprovalRequest`] → [`ApprovalDecided`] |
//! | POST | `/v1/sessions/{id}/compact` | → [`CompactionOutcome`] |
//! | GET | `/v1/sessions/{id}/events?after_seq=` | SSE: [`StreamEvent`]s; `id` = seq, `Last-Event-ID` resumes |
//! | GET | `/v1/sessions/{id}/state?at=` | → [`StateAt`] (read-only) |
//! | POST | `/v1/sessions/{id}/fork` | [`ForkSession`] → 201 [`Forked`] |
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
//! | POST | `/v1/worker/reports` | [`ReportBatch`] → [`ReportBatchAnswer`] (what the route above would have answered each) |
//! | POST | `/v1/worker/deltas` | [`DeltaBatch`] → 204 |
//!
//! A worker that keeps tool sets says so with [`TOOL_SETS_HEADER`] on the lease and report
//! routes, and its model tasks then carry their session's tools once; one that keeps
//! transcripts says so with [`TRANSCRIPTS_HEADER`], and its model tasks then carry only the
//! messages it lacks.
//!
//! Either role: `GET /v1/health` → [`Health`]; `GET /v1/openapi.json`, the OpenAPI document.
//!
//! Every error is [`ErrorBody`] with the fitting status; [`ErrorCode`] names the cases a
//! program branches on (a stale worker report is 409 `stale_report` or `lease_lost`).
//!
//! Session ids on the wire are the namespace's own: the server stores a session of namespace
//! `N` (other than [`DEFAULT_NAMESPACE`]) as `N:ID`, and a token of one namespace never sees
//! another's sessions.

use crate::budget::UsageTotals;
use crate::compaction::CompactionPolicy;
use crate::engine::{ActivityReport, DeltaEvent, LeasedTask};
use crate::event::{EventEnvelope, Limits, Queues, RetryPolicy};
use crate::policy::ToolPolicy;
use crate::store::{Lease, SessionStatus};
use crate::workflow::TurnOutcome;
use cairn_ledger::{CallOptions, JsonText, ModelSpec, ToolChoice, ToolSpec, Usage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use utoipa::ToSchema;

/// The namespace of a server without a tokens file, and of sessions stored without a prefix.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The separator between a namespace and a session id in the store (`N:ID`).
pub const NAMESPACE_SEPARATOR: char = ':';

/// `POST /v1/sessions`: how to start a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// A chosen id (1-128 of `[A-Za-z0-9._-]`; in a namespace `N` other than `default`, at
    /// most 127 - len(N), since the store keeps `N:ID`); generated when absent.
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9._-]{1,128}$", min_length = 1, max_length = 128)]
    pub session_id: Option<String>,
    /// The default model.
    #[schema(value_type = schema::ModelSpec)]
    pub model: ModelSpec,
    /// Tools offered to the model.
    #[serde(default)]
    #[schema(value_type = Vec<schema::ToolSpec>)]
    pub tools: std::sync::Arc<[ToolSpec]>,
    /// A system prompt.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Turn limits; defaults when absent.
    #[serde(default)]
    #[schema(value_type = Option<schema::Limits>)]
    pub limits: Option<Limits>,
    /// Model call retries; defaults when absent.
    #[serde(default)]
    #[schema(value_type = Option<schema::RetryPolicy>)]
    pub model_retry: Option<RetryPolicy>,
    /// Tool call retries; defaults when absent.
    #[serde(default)]
    #[schema(value_type = Option<schema::RetryPolicy>)]
    pub tool_retry: Option<RetryPolicy>,
    /// The queues of its model and tool calls; `default` when absent.
    #[serde(default)]
    #[schema(value_type = Option<schema::Queues>)]
    pub queues: Option<Queues>,
    /// Which tool calls run, are denied, or wait for a person. When absent, calls of tools
    /// that ask by default (`shell`) wait for approval and the rest run.
    #[serde(default)]
    #[schema(value_type = Option<schema::ToolPolicy>)]
    pub tool_policy: Option<ToolPolicy>,
    /// When and how the transcript is compacted; never on its own when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<schema::CompactionPolicy>)]
    pub compaction: Option<CompactionPolicy>,
    /// The options of its model calls (tool choice, server tools, prompt caching); all unset
    /// when absent.
    #[serde(default, skip_serializing_if = "CallOptions::is_default")]
    #[schema(value_type = Option<schema::CallOptions>, nullable = false)]
    pub call_options: CallOptions,
    /// The session's first message, starting turn 1 in the same durable append as the
    /// session (one request and one commit instead of two, as `Client::start_session_and_send`
    /// sends it); the answer then names the turn. Checked like a `POST
    /// /v1/sessions/{id}/messages` body. Absent: the session waits for its first message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<SendMessage>,
}

/// The answer to `POST /v1/sessions/{id}/compact`: what compaction on request did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CompactionOutcome {
    /// Whether the transcript changed (`transcript_compacted` recorded); false when no
    /// strategy would shrink it.
    pub compacted: bool,
    /// The strategies applied, in order.
    pub strategies: Vec<String>,
    /// Estimated tokens before (canonical JSON bytes / 4).
    pub estimate_before: u64,
    /// Estimated tokens after.
    pub estimate_after: u64,
}

/// `POST /v1/sessions/{id}/approvals/{tool_use_id}`: a person's decision on a parked tool
/// call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalRequest {
    /// Run the call, or answer it with an error result.
    pub decision: ApprovalDecision,
    /// Why, for a denial: the model reads it in the error result (an approval ignores it).
    #[serde(default)]
    pub reason: Option<String>,
}

/// A person's decision on a parked tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalDecision {
    /// Run it.
    Approve,
    /// Answer it with an `is_error` result carrying the reason.
    Deny,
}

/// The answer to [`ApprovalRequest`]: the decision is recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ApprovalDecided {
    /// The tool call decided.
    pub tool_use_id: String,
    /// What was decided.
    pub decision: ApprovalDecision,
}

/// A tool call waiting for a person's approval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PendingApproval {
    /// The turn it belongs to.
    pub turn: u32,
    /// The tool_use to approve or deny.
    pub tool_use_id: String,
    /// The tool's name.
    pub name: String,
    /// The call's arguments, as the model wrote them (JSON text).
    pub arguments: String,
    /// When it is denied unless decided before (epoch ms), if the policy sets a timeout.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
}

/// `201` to [`CreateSession`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SessionCreated {
    /// The session's id.
    pub session_id: String,
    /// The turn the request's first message started (1); absent when it sent none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
    /// How that turn ended, when the request asked to wait for it (`wait_ms`) and it ended in
    /// time; absent otherwise (then wait with `GET /v1/sessions/{id}/turns/{turn}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<schema::TurnOutcome>)]
    pub outcome: Option<TurnOutcome>,
}

/// `POST /v1/sessions/{id}/messages`: a user message, starting a turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SendMessage {
    /// The message's text; empty only when `media` is not.
    pub text: String,
    /// A model for this turn only.
    #[serde(default)]
    #[schema(value_type = Option<schema::ModelSpec>)]
    pub model: Option<ModelSpec>,
    /// Images and documents sent with the text, in order (they go ahead of the text). Each is
    /// checked before anything is recorded: a supported media type for its kind, valid base64
    /// data, or an http(s) URL.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<schema::Media>)]
    pub media: Vec<cairn_ledger::Media>,
    /// A tool choice for this turn only: `"auto"`, `"any"`, `"none"` or `{"tool": NAME}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<schema::ToolChoice>)]
    pub tool_choice: Option<ToolChoice>,
}

/// `202` to [`SendMessage`] (`200` when it carries the turn's outcome).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TurnStarted {
    /// The turn's number.
    pub turn: u32,
    /// How the turn ended, when the request asked to wait for it (`wait_ms`) and it ended in
    /// time; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<schema::TurnOutcome>)]
    pub outcome: Option<TurnOutcome>,
}

/// The answer to a long poll for a turn's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TurnWait {
    /// Whether the turn has ended (`outcome` is set).
    pub done: bool,
    /// How it ended.
    #[serde(default)]
    #[schema(value_type = Option<schema::TurnOutcome>)]
    pub outcome: Option<TurnOutcome>,
}

/// `POST /v1/sessions/{id}/cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Cancelled {
    /// The turn that was cancelled, when `turn_only`.
    #[serde(default)]
    pub turn: Option<u32>,
}

/// The answer to `DELETE /v1/sessions/{id}`: the session as it was when it was deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SessionDeleted {
    /// Its id (in the caller's namespace).
    pub session_id: String,
    /// The events its history had.
    pub events: u64,
}

/// One session in a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SessionSummary {
    /// Its id (in the caller's namespace).
    pub session_id: String,
    /// Its status after the last append.
    #[schema(value_type = schema::SessionStatus)]
    pub status: SessionStatus,
    /// Events recorded.
    pub events: u64,
    /// Time of the last append (epoch ms).
    pub updated_at_ms: u64,
    /// The tool_use ids of its running turn's calls that wait for approval (a `running`
    /// session parked on a person); absent when none does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub awaiting_approval: Vec<String>,
    /// What its model call attempts consumed (usage, cost, model calls), failed ones
    /// included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub totals: Option<UsageTotals>,
}

/// `GET /v1/sessions`: one page, ordered by id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SessionPage {
    /// The sessions.
    pub sessions: Vec<SessionSummary>,
    /// Pass as `after` for the next page; absent on the last.
    #[serde(default)]
    pub next_after: Option<String>,
}

/// A pending activity task of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PendingTask {
    /// The seq of the event that scheduled it.
    pub scheduled_seq: u64,
    /// `model:ROUND` or `tool:TOOL_USE_ID`.
    pub activity: String,
    /// Its attempt.
    pub attempt: u32,
}

/// `GET /v1/sessions/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SessionDescription {
    /// Its id.
    pub session_id: String,
    /// Its status.
    #[schema(value_type = schema::SessionStatus)]
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
    #[schema(value_type = Option<schema::TurnOutcome>)]
    pub last_outcome: Option<TurnOutcome>,
    /// Token usage of every model call attempt so far.
    #[schema(value_type = schema::Usage)]
    pub usage: Usage,
    /// Usage, cost and model calls of every attempt of the session so far, failed ones
    /// included.
    #[serde(default)]
    pub totals: UsageTotals,
    /// Usage, cost and model calls of the running turn so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_turn_totals: Option<UsageTotals>,
    /// Activities the running turn waits for.
    pub pending_tasks: Vec<PendingTask>,
    /// Tool calls of the running turn that wait for a person's approval.
    #[serde(default)]
    pub pending_approvals: Vec<PendingApproval>,
    /// The session's default model.
    #[serde(default)]
    #[schema(value_type = Option<schema::ModelSpec>)]
    pub model: Option<ModelSpec>,
}

/// `GET /v1/sessions/{id}/history`: events from a seq on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HistoryPage {
    /// The events, in seq order.
    #[schema(value_type = Vec<schema::EventEnvelope>)]
    pub events: Vec<EventEnvelope>,
    /// The seq to ask from for the next page (one past the last event given).
    pub next_seq: u64,
}

/// `GET /v1/sessions/{id}/state?at=SEQ`: a session as it was right after one event (what
/// `cairn show --at SEQ --json` prints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StateAt {
    /// The event the state is taken after.
    pub at_seq: u64,
    /// The history's last seq when the state was read.
    pub of_seqs: u64,
    /// Status, turns, usage so far and pending tasks at that event.
    pub session: SessionDescription,
    /// The running turn's tool calls that had no result yet.
    pub open_tool_calls: Vec<OpenToolCall>,
    /// The transcript at that event, as canonical JSON (`{"messages": [...]}`).
    #[schema(value_type = Object)]
    pub transcript: serde_json::Value,
}

/// A tool call of the running turn with no result yet, in a [`StateAt`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OpenToolCall {
    /// The tool_use's id.
    pub tool_use_id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, as the exact text the model produced.
    pub arguments: String,
    /// The attempt scheduled, when one is (none while it waits for its retry).
    #[serde(default)]
    pub attempt: Option<u32>,
}

/// `POST /v1/sessions/{id}/fork`: a new session whose history is this one's up to `at`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkSession {
    /// The last event the fork copies; it must end a transition (not cut an input from the
    /// commands it decided).
    #[schema(minimum = 1)]
    pub at: u64,
    /// The fork's id (1-128 of `[A-Za-z0-9._-]`); generated when absent.
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9._-]{1,128}$", min_length = 1, max_length = 128)]
    pub id: Option<String>,
    /// Another default model, `PROVIDER:MODEL`.
    #[serde(default)]
    #[schema(pattern = r"^[^:]+:.+$")]
    pub model: Option<String>,
    /// Another system prompt.
    #[serde(default)]
    pub system: Option<String>,
}

/// `201` to [`ForkSession`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Forked {
    /// The fork's id.
    pub session_id: String,
    /// Events copied from the parent.
    pub events: u64,
    /// Whether the fork was cut inside a turn, which goes on (its pending calls queued).
    pub running: bool,
    /// Activities queued for that turn.
    pub tasks: u64,
}

/// One message of a session's SSE stream. The SSE `event` field is `event` (its `data` the
/// [`EventEnvelope`], its `id` the seq) or `delta` (its `data` the [`DeltaEvent`], no `id`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data", rename_all = "snake_case")]
// Both variants are built to be sent at once; boxing would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum StreamEvent {
    /// A history event, exactly once per stream (also across reconnects with `Last-Event-ID`).
    Event(EventEnvelope),
    /// A model delta, tagged with its attempt; presentation only, may be missed.
    Delta(DeltaEvent),
}

/// `POST /v1/worker/lease`: what this worker can run and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
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
    // Declared as a plain array: a repeated name is accepted (it is a set), not an error.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub queues: Option<BTreeSet<String>>,
    /// The tools it hosts; absent: any.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub tools: Option<BTreeSet<String>>,
    /// The model providers it hosts; absent: any.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub providers: Option<BTreeSet<String>>,
}

/// The answer to [`LeaseRequest`]: possibly empty after `wait_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LeaseResponse {
    /// Leased tasks with what they run.
    #[schema(value_type = Vec<schema::LeasedTask>)]
    pub tasks: Vec<LeasedTask>,
}

/// `POST /v1/worker/heartbeat`: renews a lease, recording progress details durably.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    /// The lease.
    #[schema(value_type = schema::Lease)]
    pub lease: Lease,
    /// Renew for this long from now (ms).
    pub lease_ms: u64,
    /// Progress to hand the next attempt if this one fails: any JSON value.
    #[serde(default)]
    #[schema(value_type = Option<Value>)]
    pub details: Option<JsonText>,
}

/// The answer to [`HeartbeatRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct HeartbeatResponse {
    /// The lease's new expiry (epoch ms).
    pub expires_at_ms: u64,
}

/// `POST /v1/worker/progress`: what a model attempt streamed since its last record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ProgressRequest {
    /// The lease.
    #[schema(value_type = schema::Lease)]
    pub lease: Lease,
    /// Text streamed since the last record.
    pub text_appended: String,
    /// Thinking streamed since the last record.
    pub thinking_appended: String,
    /// The usage the attempt's stream reported so far (cumulative), when it reported any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<schema::Usage>)]
    pub usage: Option<Usage>,
}

/// `POST /v1/worker/report`: an attempt's result, fenced by its lease attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    /// The lease.
    #[schema(value_type = schema::Lease)]
    pub lease: Lease,
    /// The result.
    #[schema(value_type = schema::ActivityReport)]
    pub report: ActivityReport,
    /// Tasks to lease with the report (eager dispatch): the report that queues a session's
    /// next task hands it to this worker, with no lease request of its own. Absent: the
    /// answer is 204 with no body; present: 200 with a [`ReportResponse`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<NextTasks>,
    /// Model deltas of the reported task's session the worker published and has not sent
    /// yet (`POST /v1/worker/deltas`), in order: passed on to the session's live stream before
    /// the report is recorded, so its followers see an answer's text before its end without a
    /// request of its own ahead of the report. Presentation only, like the deltas route: a worker sends them with
    /// a report's first try only, because a try whose answer was lost may already have passed
    /// them on. Absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<schema::DeltaEvent>)]
    pub deltas: Vec<DeltaEvent>,
}

/// What a report leases with it ([`ReportRequest::next`]), like a [`LeaseRequest`] that does
/// not wait.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NextTasks {
    /// Tasks wanted at most (0 leases none).
    pub max: u32,
    /// Lease length (ms); renew it with heartbeats before it runs out.
    pub lease_ms: u64,
    /// The queues it serves; absent: every queue.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub queues: Option<BTreeSet<String>>,
    /// The tools it hosts; absent: any.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub tools: Option<BTreeSet<String>>,
    /// The model providers it hosts; absent: any.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub providers: Option<BTreeSet<String>>,
}

/// The answer to a [`ReportRequest`] with `next`: the tasks leased with the report, once it
/// is durable (possibly none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReportResponse {
    /// Leased tasks with what they run.
    #[schema(value_type = Vec<schema::LeasedTask>)]
    pub tasks: Vec<LeasedTask>,
}

/// The request header by which a worker says it keeps tool sets, and which it keeps: the
/// digests of the sets it holds, comma-separated (empty when it holds none yet). On `POST
/// /v1/worker/lease`, `/report` and `/reports`, a server answers such a worker's model tasks
/// with their tools' digest ([`ActivityInput::Model`](crate::engine::ActivityInput::Model)'s
/// `tools_digest`) and leaves out the tools of a set it listed (`tools_omitted`): a session's
/// tool specs, often most of a model task's bytes, cross once per worker rather than with
/// every call, as a sticky worker keeps what it was sent. A server from before the header
/// ignores it and sends the tools; a worker that does not send it gets them every time.
pub const TOOL_SETS_HEADER: &str = "cairn-tool-sets";

/// The most digests [`TOOL_SETS_HEADER`] lists.
pub const MAX_TOOL_SETS_LISTED: usize = 64;

/// The length of a tool set's digest: 32 lowercase hex digits.
pub const TOOL_SET_DIGEST_LEN: usize = 32;

/// The digests a [`TOOL_SETS_HEADER`] value lists, or what is wrong with it: at most
/// [`MAX_TOOL_SETS_LISTED`] digests of [`TOOL_SET_DIGEST_LEN`] lowercase hex digits, separated
/// by commas (spaces around them allowed); an empty value lists none.
pub fn parse_tool_sets(value: &str) -> std::result::Result<Vec<&str>, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(Vec::new());
    }
    let digests: Vec<&str> = value.split(',').map(str::trim).collect();
    if digests.len() > MAX_TOOL_SETS_LISTED {
        return Err(format!(
            "lists {} digests, more than the {MAX_TOOL_SETS_LISTED} allowed",
            digests.len()
        ));
    }
    match digests.iter().position(|d| !is_tool_set_digest(d)) {
        Some(i) => Err(format!(
            "item {i} ({:?}) is not a digest: {TOOL_SET_DIGEST_LEN} lowercase hex digits",
            digests[i].chars().take(40).collect::<String>()
        )),
        None => Ok(digests),
    }
}

/// Whether `digest` is of a tool set's digest's form.
pub fn is_tool_set_digest(digest: &str) -> bool {
    digest.len() == TOOL_SET_DIGEST_LEN
        && digest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The request header by which a worker says it keeps its sessions' transcripts, and which
/// it keeps: `SESSION=LINEAGE.MESSAGES` for each, comma-separated (empty when it holds none
/// yet), where `LINEAGE` is the transcript's
/// [`transcript_lineage`](crate::engine::ActivityInput::Model) and `MESSAGES` how many
/// messages it holds. On `POST /v1/worker/lease`, `/report` and `/reports`, a server answers
/// such a worker's model tasks with their `transcript_lineage`, and when the worker listed
/// the task's session with that lineage and at most as many messages as the transcript has,
/// leaves those messages out (`transcript_left_out`): a session's transcript, which grows
/// at its end from call to call, crosses once per worker rather than whole with every call.
/// A server from before the header ignores it and sends the transcript whole; a worker that
/// does not send it gets it whole every time.
pub const TRANSCRIPTS_HEADER: &str = "cairn-transcripts";

/// The most transcripts [`TRANSCRIPTS_HEADER`] lists.
pub const MAX_TRANSCRIPTS_LISTED: usize = 64;

/// A transcript a worker keeps, as [`TRANSCRIPTS_HEADER`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptTranscript {
    /// Its session, as the worker routes name it.
    pub session_id: String,
    /// Its lineage ([`ActivityInput::Model`](crate::engine::ActivityInput::Model)'s
    /// `transcript_lineage`).
    pub lineage: u64,
    /// How many messages the worker holds of it.
    pub messages: u32,
}

impl std::fmt::Display for KeptTranscript {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}.{}", self.session_id, self.lineage, self.messages)
    }
}

/// The transcripts a [`TRANSCRIPTS_HEADER`] value lists, or what is wrong with it: at most
/// [`MAX_TRANSCRIPTS_LISTED`] items `SESSION=LINEAGE.MESSAGES` (a session id, then two
/// decimal numbers), separated by commas (spaces around them allowed); an empty value lists
/// none.
pub fn parse_transcripts(value: &str) -> std::result::Result<Vec<KeptTranscript>, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(Vec::new());
    }
    let items: Vec<&str> = value.split(',').map(str::trim).collect();
    if items.len() > MAX_TRANSCRIPTS_LISTED {
        return Err(format!(
            "lists {} transcripts, more than the {MAX_TRANSCRIPTS_LISTED} allowed",
            items.len()
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            parse_kept_transcript(item).ok_or_else(|| {
                format!(
                    "item {i} ({:?}) is not SESSION=LINEAGE.MESSAGES (a session id, then two \
                     decimal numbers)",
                    item.chars().take(60).collect::<String>()
                )
            })
        })
        .collect()
}

fn parse_kept_transcript(item: &str) -> Option<KeptTranscript> {
    let (session_id, numbers) = item.split_once('=')?;
    let (lineage, messages) = numbers.split_once('.')?;
    let decimal = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    if !decimal(lineage) || !decimal(messages) {
        return None;
    }
    crate::store::check_session_id(session_id).ok()?;
    Some(KeptTranscript {
        session_id: session_id.to_owned(),
        lineage: lineage.parse().ok()?,
        messages: messages.parse().ok()?,
    })
}

/// The most reports one [`ReportBatch`] holds.
pub const MAX_REPORTS_PER_BATCH: usize = 64;

/// `POST /v1/worker/reports`: several reports in one request, each recorded as `POST
/// /v1/worker/report` would record it (1 to [`MAX_REPORTS_PER_BATCH`] of them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportBatch {
    /// The reports, in any order: each stands alone.
    #[schema(min_items = 1, max_items = 64)]
    pub reports: Vec<ReportRequest>,
}

/// The answer to a [`ReportBatch`]: one answer per report, in the batch's order.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReportBatchAnswer {
    /// What `POST /v1/worker/report` would have answered each report.
    pub answers: Vec<ReportAnswer>,
}

/// What `POST /v1/worker/report` would have answered one report of a batch.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReportAnswer {
    /// Its HTTP status: 200 (a [`ReportResponse`]), 204 (no body) or an error's (an
    /// [`ErrorBody`]).
    pub status: u16,
    /// Its body: a [`ReportResponse`] or an [`ErrorBody`]; absent with 204.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub body: Option<Box<serde_json::value::RawValue>>,
}

/// `POST /v1/worker/deltas`: model deltas for the sessions' live streams.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeltaBatch {
    /// The deltas, in order.
    #[schema(value_type = Vec<schema::DeltaEvent>)]
    pub deltas: Vec<DeltaEvent>,
}

/// `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// `ok`; `draining` once the server stopped handing out tasks; `failed`, answered with
    /// status 503, while its store refuses writes (after a write or sync that failed, until
    /// the server is restarted: `reason` says why).
    pub status: String,
    /// Why the server is `failed`; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The server's cache of session states (absent from servers before it was reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_cache: Option<StateCacheStats>,
    /// The store's durable commits and how long their syncs took, since it opened; absent
    /// for a store that does not time them and from servers before it was reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_syncs: Option<StoreSyncStats>,
    /// The event streams open now, and how many the server allows at once (absent from
    /// servers before it was reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_streams: Option<EventStreamStats>,
}

/// The server's open event streams (`GET /v1/sessions/{id}/events`) against its cap: each
/// keeps its session's state in memory, beyond the state cache's bounds, so their number is
/// bounded too, and a stream past the cap is refused (503) rather than opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EventStreamStats {
    /// Streams open now.
    pub open: u64,
    /// Streams allowed at once (`--max-streams`).
    pub max: u64,
}

/// What the store made durable since it opened ([`Store::durable_commits`] and
/// [`Store::sync_times`](crate::Store::sync_times)): its commits, each a batch of writes made
/// durable by one sync, and how long those syncs took, in microseconds (to two significant
/// digits). A p50 well above the disk's own fdatasync says the disk, not the server, is slow.
/// On PostgreSQL, the writes this server committed (each a transaction the database makes
/// durable before it answers), each timed as its whole round trip.
///
/// [`Store::durable_commits`]: crate::Store::durable_commits
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StoreSyncStats {
    /// Durable commits.
    pub durable_commits: u64,
    /// Median sync, µs.
    pub sync_p50_us: u64,
    /// 99th percentile sync, µs.
    pub sync_p99_us: u64,
    /// Slowest sync, µs.
    pub sync_max_us: u64,
}

/// What an engine's cache of session states holds, and its bounds
/// ([`Engine::with_cache_capacity`](crate::Engine::with_cache_capacity),
/// [`Engine::with_cache_bytes`](crate::Engine::with_cache_bytes)). Past either bound, a new
/// session drops parked states, least recently used first; a dropped state is folded again
/// from its history when its session next steps. Figures for the whole process, every
/// namespace together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StateCacheStats {
    /// Sessions with a cached slot (a state, or one about to be loaded).
    pub sessions: u64,
    /// The bytes the cached states hold, by their estimate.
    pub bytes: u64,
    /// The sessions the cache keeps before it drops parked ones.
    pub max_sessions: u64,
    /// The bytes the cache keeps before it drops parked ones.
    pub max_bytes: u64,
}

/// Every error answer: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable code to branch on.
    pub code: ErrorCode,
    /// A sentence for people: what was wrong, and where.
    pub message: String,
}

/// The error codes of the API, with their HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
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
    /// 409: a delete of a session that is not finished (a turn runs, a task is queued).
    SessionBusy,
    /// 422: a message under an `Idempotency-Key` that an earlier, different message of the
    /// session was sent under.
    IdempotencyKeyReused,
    /// 500: the session's history cannot be read by this server (a corrupt record, an event
    /// of a newer cairn, a replay that diverges); retrying will not help.
    HistoryUnreadable,
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
            ErrorCode::Conflict
            | ErrorCode::StaleReport
            | ErrorCode::LeaseLost
            | ErrorCode::SessionBusy => 409,
            ErrorCode::TooLarge => 413,
            ErrorCode::UnsupportedMediaType => 415,
            ErrorCode::IdempotencyKeyReused => 422,
            ErrorCode::Internal | ErrorCode::HistoryUnreadable => 500,
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
            ErrorCode::SessionBusy => "session_busy",
            ErrorCode::IdempotencyKeyReused => "idempotency_key_reused",
            ErrorCode::HistoryUnreadable => "history_unreadable",
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

/// OpenAPI schemas of the types the wire types embed from other modules and crates (the
/// ledger's model spec, the engine's reports, the store's leases, ...), which carry no schema
/// derive themselves: each mirrors its type's serde form field for field, with the
/// constraints the server checks (an empty model provider is refused, so `min_length = 1`).
/// Only the OpenAPI document uses them; the server's conformance test (schemathesis) checks
/// real answers and accepted requests against them, so a drifting mirror fails it.
pub mod schema {
    #![allow(dead_code)]

    use serde::Serialize;
    use utoipa::ToSchema;

    /// Which model to call and how.
    #[derive(Serialize, ToSchema)]
    pub struct ModelSpec {
        /// Provider family: `scripted`, `anthropic`, `openai`, `openai-responses`, `bedrock`.
        #[schema(min_length = 1)]
        pub provider: String,
        /// Model name; for `scripted`, the script file's path.
        #[schema(min_length = 1)]
        pub model: String,
        /// Output token limit, when set.
        pub max_tokens: Option<u32>,
        /// Extended-thinking budget, when thinking is enabled.
        pub thinking_budget_tokens: Option<u32>,
    }

    /// The options of a session's model calls.
    #[derive(Serialize, ToSchema)]
    pub struct CallOptions {
        /// Which tools the model may or must call: `"auto"`, `"any"`, `"none"` or
        /// `{"tool": NAME}`. A forcing choice (any, a tool) holds for each turn's first call.
        pub tool_choice: Option<ToolChoice>,
        /// The provider's own tools: `[{"kind": "web_search" | "web_fetch", "max_uses": N}]`.
        #[schema(nullable = false)]
        pub server_tools: Option<Vec<ServerTool>>,
        /// Turns prompt-cache breakpoints off (Anthropic's, and Bedrock's cache points).
        #[schema(nullable = false)]
        pub no_prompt_cache: Option<bool>,
    }

    /// Which tools the model may or must call: `"auto"`, `"any"`, `"none"` or
    /// `{"tool": NAME}`.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum ToolChoice {
        /// The model decides.
        Auto,
        /// The model must call some tool.
        Any,
        /// The model may call no tool.
        None,
        /// The model must call the tool of this name.
        Tool(String),
    }

    /// A provider's own tool, turned on for a session.
    #[derive(Serialize, ToSchema)]
    pub struct ServerTool {
        /// Which tool.
        pub kind: ServerToolKind,
        /// How many times one model call may use it (Anthropic's `max_uses`).
        pub max_uses: Option<u32>,
    }

    /// The provider server tools cairn can turn on.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum ServerToolKind {
        /// Web search (Anthropic `web_search`, OpenAI Responses `web_search`).
        WebSearch,
        /// Web fetch (Anthropic `web_fetch`).
        WebFetch,
    }

    /// A tool as the model sees it.
    #[derive(Serialize, ToSchema)]
    pub struct ToolSpec {
        /// Tool name, unique within a session.
        pub name: String,
        /// What the tool does, for the model.
        pub description: String,
        /// JSON Schema of the tool's input object (any JSON value, kept as its exact text).
        #[schema(value_type = Value)]
        pub input_schema: (),
    }

    /// Limits of a turn and budgets of a turn and of the session.
    #[derive(Serialize, ToSchema)]
    pub struct Limits {
        /// Model calls per turn at most; a turn that needs more fails.
        pub max_rounds: u32,
        /// What one turn may consume; unlimited when absent.
        #[schema(required = false)]
        pub turn_budget: crate::budget::Budget,
        /// What the session's turns may consume together; unlimited when absent.
        #[schema(required = false)]
        pub session_budget: crate::budget::Budget,
    }

    /// A class of activity failure, for retry decisions.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum ErrorClass {
        /// A passing fault: connection reset, 5xx, stream ended early.
        Transient,
        /// The provider asked us to slow down (429).
        RateLimited,
        /// The provider is overloaded (529).
        Overloaded,
        /// The attempt ran past its timeout, or its lease expired.
        Timeout,
        /// The request itself is wrong; retrying cannot help.
        InvalidRequest,
        /// The provider answered, but the response failed validation.
        InvalidResponse,
        /// Credentials were refused.
        Auth,
        /// A tool reported failure.
        ToolFailed,
        /// The activity was cancelled.
        Cancelled,
        /// A bug or an unexpected state on our side.
        Internal,
    }

    /// When and how often an activity is retried.
    #[derive(Serialize, ToSchema)]
    pub struct RetryPolicy {
        /// Delay before the second attempt.
        pub initial_interval_ms: u64,
        /// Each further delay is the previous one times this.
        pub backoff_coefficient: f64,
        /// Delays never exceed this.
        pub maximum_interval_ms: u64,
        /// Attempts at most, counting the first; 0 means unlimited.
        pub maximum_attempts: u32,
        /// Classes that are never retried.
        pub non_retryable: Vec<ErrorClass>,
        /// How long one attempt may run before it is failed as timed out.
        pub start_to_close_timeout_ms: u64,
        /// How long a scheduled attempt may wait for a worker before it is failed as timed out.
        pub schedule_to_start_timeout_ms: Option<u64>,
        /// The overall deadline of all attempts, from the first schedule.
        pub schedule_to_close_timeout_ms: Option<u64>,
        /// A running attempt that does not heartbeat for this long is failed as timed out.
        pub heartbeat_timeout_ms: Option<u64>,
    }

    /// The task queues of a session's activities; absent is the `default` queue.
    #[derive(Serialize, ToSchema)]
    pub struct Queues {
        /// The queue of model calls.
        pub model: Option<String>,
        /// The queue of tool calls.
        pub tool: Option<String>,
    }

    /// What a tool policy decides for a call.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum PolicyDecision {
        /// Run it.
        Allow,
        /// Answer it at once with an error result.
        Deny,
        /// Park it until a person approves or denies it.
        Ask,
    }

    /// How a rule's prefix is compared with the argument.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum PrefixKind {
        /// A file path, by components.
        Path,
        /// A shell command, at a word boundary.
        Command,
    }

    /// One rule of a tool policy.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct PolicyRule {
        /// The tool's name, or `*` for any tool.
        #[schema(min_length = 1)]
        pub tool: String,
        /// What the rule decides for the calls it matches.
        pub decision: PolicyDecision,
        /// Only calls whose argument starts with this.
        pub prefix: Option<String>,
        /// The argument the prefix is compared with; the tool's own when absent.
        pub argument: Option<String>,
        /// How the prefix is compared; the tool's own when absent.
        pub kind: Option<PrefixKind>,
    }

    /// Which tool calls run, are denied, or wait for a person: the first matching rule
    /// decides, else `default`.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ToolPolicy {
        /// Checked in order.
        #[schema(required = false)]
        pub rules: Vec<PolicyRule>,
        /// The decision when no rule matches (allow when absent).
        #[schema(required = false)]
        pub default: PolicyDecision,
        /// How long a parked call waits before it is denied (ms); forever when absent.
        pub approval_timeout_ms: Option<u64>,
    }

    /// When and how a session's transcript is compacted.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct CompactionPolicy {
        /// Compact before a model call estimated above this many tokens; only when the
        /// provider says the context is too long (or on request) when absent.
        #[schema(minimum = 1)]
        pub threshold_tokens: Option<u64>,
        /// The strategies, tried in order, each at most once (all three when absent).
        #[schema(required = false, min_items = 1)]
        pub strategies: std::collections::BTreeSet<CompactionStrategy>,
        /// Turns `keep_last_turns` keeps, the current one included (4 when absent).
        #[schema(required = false, minimum = 1)]
        pub keep_last_turns: u32,
        /// Summarise the turns `keep_last_turns` drops with a model call (false when absent).
        #[schema(required = false)]
        pub summarize: bool,
    }

    /// One way of shrinking a transcript's completed turns.
    #[derive(Serialize, ToSchema, PartialEq, Eq, PartialOrd, Ord)]
    #[serde(rename_all = "snake_case")]
    pub enum CompactionStrategy {
        /// Drop their reasoning parts.
        DropReasoning,
        /// Replace the content of their failed tool results by a short note.
        DropFailedToolResults,
        /// Keep only the last turns.
        KeepLastTurns,
    }

    /// A session's status as listed.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum SessionStatus {
        /// No turn running.
        Idle,
        /// A turn is running.
        Running,
        /// Cancelled; takes no more turns.
        Cancelled,
    }

    /// How a turn ended.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    #[serde(tag = "status")]
    pub enum TurnOutcome {
        /// The model ended the turn; `answer` is the final message's text. A
        /// `stop_reason` of `max_tokens`, `refusal` or `content_filter` is not a normal
        /// completion.
        Completed {
            /// Turn.
            turn: u32,
            /// Final visible text.
            answer: String,
            /// Why the final response stopped.
            stop_reason: Option<StopReason>,
            /// What the turn's model call attempts consumed, failed ones included.
            #[schema(value_type = crate::budget::UsageTotals)]
            totals: (),
        },
        /// The turn failed.
        Failed {
            /// Turn.
            turn: u32,
            /// Why.
            reason: String,
            /// The budget it went over, when that is why.
            #[schema(value_type = Option<crate::budget::BudgetExceeded>)]
            budget_exceeded: (),
            /// What the turn's model call attempts consumed.
            #[schema(value_type = crate::budget::UsageTotals)]
            totals: (),
        },
        /// The session was cancelled during or after the turn.
        Cancelled {
            /// Turn.
            turn: u32,
            /// Why.
            reason: String,
            /// What the turn's model call attempts consumed until then.
            #[schema(value_type = crate::budget::UsageTotals)]
            totals: (),
        },
    }

    /// Token usage.
    #[derive(Serialize, ToSchema)]
    pub struct Usage {
        /// Input tokens (not counting cache reads).
        pub input_tokens: u64,
        /// Output tokens.
        pub output_tokens: u64,
        /// Input tokens read from the prompt cache.
        pub cache_read_tokens: u64,
        /// Input tokens written to the prompt cache.
        pub cache_write_tokens: u64,
        /// Reasoning tokens, where the provider reports them separately.
        pub reasoning_tokens: u64,
    }

    /// One history event with its envelope (the form of `cairn history --json`).
    #[derive(Serialize, ToSchema)]
    pub struct EventEnvelope {
        /// Schema version of the event body.
        pub schema_version: u16,
        /// The event kind's tag, also the single key of `event`.
        pub kind: String,
        /// The session (in the caller's namespace).
        pub session_id: String,
        /// Position in the session's history, from 1, without gaps.
        pub seq: u64,
        /// Milliseconds since the Unix epoch, when the engine appended the event.
        pub recorded_at_ms: u64,
        /// The event: `{"KIND": {...}}` (see the README's `history --json`).
        #[schema(value_type = Object)]
        pub event: (),
    }

    /// Which kind of activity a task runs.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum TaskKind {
        /// A model call.
        Model,
        /// A tool call.
        Tool,
    }

    /// A task's name: its session (as stored: `N:ID` in namespace `N`) and the seq of the
    /// event that scheduled it.
    #[derive(Serialize, ToSchema)]
    pub struct TaskId {
        /// Session, as stored.
        pub session_id: String,
        /// Seq of the `*_scheduled` event.
        pub scheduled_seq: u64,
    }

    /// A worker's time-limited claim on a task.
    #[derive(Serialize, ToSchema)]
    pub struct Lease {
        /// The task.
        pub id: TaskId,
        /// What it runs.
        pub kind: TaskKind,
        /// The fencing token: heartbeats and reports must present it.
        pub lease_attempt: u32,
        /// When the lease lapses (epoch ms).
        pub expires_at_ms: u64,
    }

    /// A leased task with what it runs.
    #[derive(Serialize, ToSchema)]
    pub struct LeasedTask {
        /// The lease.
        pub lease: Lease,
        /// What to run: `{"model": {...}}` or `{"tool": {...}}` (an `ActivityInput`).
        #[schema(value_type = Object)]
        pub input: (),
    }

    /// Why the model stopped, normalized across providers.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum StopReason {
        /// The model finished its answer.
        EndTurn,
        /// The model wants tool results.
        ToolUse,
        /// The output limit was reached.
        MaxTokens,
        /// A stop sequence matched.
        StopSequence,
        /// The provider paused a long turn.
        PauseTurn,
        /// The model refused.
        Refusal,
        /// A content filter or guardrail intervened.
        ContentFilter,
        /// Anything else.
        Other,
    }

    /// A tool call the model made.
    #[derive(Serialize, ToSchema)]
    pub struct ToolUse {
        /// The provider's call id.
        pub id: String,
        /// Tool name.
        pub name: String,
        /// The arguments as the exact JSON text the model produced.
        pub arguments: String,
        /// A per-call provider signature.
        pub signature: Option<String>,
    }

    /// The content of a tool result.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum ToolResultContent {
        /// A JSON value, kept as its exact text.
        Json(serde_json::Value),
        /// Plain text.
        Text(String),
        /// Text and media blocks in order.
        Blocks(Vec<ToolResultBlock>),
    }

    /// One block of a tool result made of blocks.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum ToolResultBlock {
        /// Text.
        Text {
            /// The text.
            text: String,
        },
        /// An image or a document.
        Media(Media),
    }

    /// An image or a document, e.g.
    /// `{"kind":"image","source":{"base64":{"media_type":"image/png","data":"iVBORw0KGgo="}}}`
    /// or `{"kind":"document","source":{"url":{"url":"https://example.com/a.pdf"}},"name":"a.pdf"}`.
    /// (Two shapes told apart by `kind`, so that each states the media types its kind takes:
    /// a document that claims an image type, or an image a document type, is refused.)
    #[derive(Serialize, ToSchema)]
    #[serde(untagged)]
    pub enum Media {
        /// An image.
        Image(ImageMedia),
        /// A document.
        Document(DocumentMedia),
    }

    /// An image: PNG, JPEG, GIF or WebP.
    #[derive(Serialize, ToSchema)]
    pub struct ImageMedia {
        /// `image`.
        pub kind: ImageKind,
        /// Where its bytes are.
        pub source: ImageSource,
        /// A file name or title.
        pub name: Option<String>,
    }

    /// The kind of an image.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum ImageKind {
        /// A picture.
        Image,
    }

    /// Where the bytes of an image are.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum ImageSource {
        /// The bytes, in standard padded base64.
        Base64 {
            /// MIME type: `image/png`, `image/jpeg`, `image/gif` or `image/webp`.
            #[schema(pattern = "^image/(png|jpeg|gif|webp)$")]
            media_type: String,
            /// The bytes in standard padded base64 (canonical, as the server decodes it:
            /// unused bits of the last character are zero).
            #[schema(
                min_length = 4,
                pattern = "^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/][AQgw]==|[A-Za-z0-9+/]{2}[AEIMQUYcgkosw048]=)?$"
            )]
            data: String,
        },
        /// An http(s) URL the provider fetches.
        Url {
            /// The URL, without white space. (The server's check counts U+0085 as white
            /// space, as Unicode does; a pattern's `\s` does not, so it is named.)
            #[schema(pattern = "^https?://[^\\s\\u0085]+$")]
            url: String,
        },
    }

    /// A document: a PDF, or plain UTF-8 text.
    #[derive(Serialize, ToSchema)]
    pub struct DocumentMedia {
        /// `document`.
        pub kind: DocumentKind,
        /// Where its bytes are.
        pub source: DocumentSource,
        /// A file name or title.
        pub name: Option<String>,
    }

    /// The kind of a document.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum DocumentKind {
        /// A document.
        Document,
    }

    /// Where the bytes of a document are.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum DocumentSource {
        /// The bytes, in standard padded base64.
        Base64 {
            /// MIME type: `application/pdf`; `text/plain` is taken too when its bytes are
            /// UTF-8 (which a pattern cannot say, so the schema names only the PDF type).
            #[schema(pattern = "^application/pdf$")]
            media_type: String,
            /// The bytes in standard padded base64 (canonical, as the server decodes it:
            /// unused bits of the last character are zero).
            #[schema(
                min_length = 4,
                pattern = "^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/][AQgw]==|[A-Za-z0-9+/]{2}[AEIMQUYcgkosw048]=)?$"
            )]
            data: String,
        },
        /// An http(s) URL the provider fetches.
        Url {
            /// The URL, without white space. (The server's check counts U+0085 as white
            /// space, as Unicode does; a pattern's `\s` does not, so it is named.)
            #[schema(pattern = "^https?://[^\\s\\u0085]+$")]
            url: String,
        },
    }

    /// The answer to one tool_use.
    #[derive(Serialize, ToSchema)]
    pub struct ToolResult {
        /// The id of the tool_use this answers.
        pub tool_use_id: String,
        /// What the tool returned.
        pub content: ToolResultContent,
        /// Whether the content describes a failure.
        pub is_error: bool,
    }

    /// One block of a message, in provider order.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum Part {
        /// Visible text.
        Text {
            /// The text.
            text: String,
            /// The provider's output item id, when it must be sent back.
            item_id: Option<String>,
        },
        /// Reasoning with the provider's signature.
        Thinking {
            /// Reasoning text.
            text: String,
            /// The provider's signature.
            signature: String,
        },
        /// Reasoning the provider encrypted.
        RedactedThinking {
            /// Opaque data.
            data: String,
        },
        /// Unsigned reasoning text.
        Reasoning {
            /// The reasoning text.
            text: String,
        },
        /// A provider's reasoning item kept raw.
        ReasoningItem {
            /// The item exactly as the provider produced it (any JSON value).
            #[schema(value_type = Value)]
            item: (),
        },
        /// A tool call.
        ToolUse(ToolUse),
        /// A tool call's answer.
        ToolResult(ToolResult),
        /// An image, by reference to its data.
        Image {
            /// MIME type.
            media_type: String,
            /// A content hash or URI.
            data_ref: String,
        },
        /// An image or a document in a user message.
        Media(Media),
    }

    /// One complete model response in canonical form.
    #[derive(Serialize, ToSchema)]
    pub struct ModelResponse {
        /// Provider family that produced it.
        pub provider: String,
        /// Model name.
        pub model: String,
        /// Assistant parts in provider order.
        pub parts: Vec<Part>,
        /// The stop reason exactly as the provider sent it.
        pub stop_reason_raw: String,
        /// The normalized stop reason.
        pub stop_reason: StopReason,
        /// Token usage.
        pub usage: Usage,
    }

    /// How far an attempt got before it failed.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum FailurePhase {
        /// Nothing was received.
        BeforeStream,
        /// Output had started streaming.
        Streaming,
        /// A complete response failed validation.
        Validation,
    }

    /// A failed activity attempt.
    #[derive(Serialize, ToSchema)]
    pub struct ActivityFailure {
        /// The class that drives the retry decision.
        pub class: ErrorClass,
        /// The error, for people.
        pub message: String,
        /// Usage the failed attempt consumed, when known.
        pub usage: Option<Usage>,
        /// How far a model call got before it failed.
        pub phase: Option<FailurePhase>,
        /// The progress details the attempt heartbeated last (any JSON value).
        #[schema(value_type = Option<Value>)]
        pub heartbeat_details: Option<()>,
        /// How long the provider asked us to wait, in milliseconds.
        pub retry_after_ms: Option<u64>,
    }

    /// What a worker reports for a leased task.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum ActivityReport {
        /// The model answered.
        ModelCompleted(ModelResponse),
        /// The tool returned.
        ToolCompleted {
            /// Result content.
            content: ToolResultContent,
            /// Whether it is an error result.
            is_error: bool,
        },
        /// The attempt failed.
        Failed(ActivityFailure),
    }

    /// Identifies one activity attempt.
    #[derive(Serialize, ToSchema)]
    pub struct ActivityRef {
        /// Session (as stored, on worker routes; the caller's id on a session's stream).
        pub session_id: String,
        /// Turn.
        pub turn: u32,
        /// `model:ROUND` or `tool:TOOL_USE_ID`.
        pub activity: String,
        /// Activity attempt.
        pub attempt: u32,
    }

    /// A fragment of a response while it streams.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "snake_case")]
    pub enum Delta {
        /// Visible text.
        Text(String),
        /// Reasoning text.
        Thinking(String),
        /// A fragment of a tool call's arguments.
        ToolArguments {
            /// The call's id.
            tool_use_id: String,
            /// The fragment.
            fragment: String,
        },
    }

    /// A streamed fragment with its origin.
    #[derive(Serialize, ToSchema)]
    pub struct DeltaEvent {
        /// Where it comes from.
        pub origin: ActivityRef,
        /// The fragment.
        pub delta: Delta,
    }
}
