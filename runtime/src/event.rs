//! History events: the append-only facts a session is folded from, each in a versioned envelope.
//!
//! Persisted format contract: enum variant names and field names are the wire tags (msgpack maps
//! with named fields, externally tagged enums). Never rename or reuse one; add new fields with
//! `#[serde(default)]`; bump [`SCHEMA_VERSION`] only with a decoder for the old version.

use crate::budget::{Budget, BudgetExceeded};
use crate::compaction::{CompactionPolicy, CompactionTrigger};
use crate::policy::ToolPolicy;
use cairn_ledger::{
    CallOptions, CompactionStrategy, JsonText, Media, ModelResponse, ModelSpec, ToolChoice,
    ToolResultContent, ToolSpec, Usage,
};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The schema version this code writes. Decoders accept every version up to it.
pub const SCHEMA_VERSION: u16 = 1;

/// One event with its envelope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventEnvelope {
    /// Schema version of the event body.
    pub schema_version: u16,
    /// The event kind's tag (equal to the body's variant name); readable without the body.
    pub kind: String,
    /// The session the event belongs to.
    pub session_id: String,
    /// Position in the session's history, from 1, without gaps.
    pub seq: u64,
    /// Milliseconds since the Unix epoch, recorded by the engine when it appended the event.
    pub recorded_at_ms: u64,
    /// The event itself.
    pub event: Event,
}

impl EventEnvelope {
    /// Wraps an event at `seq`, stamping the current schema version and kind tag.
    pub fn new(session_id: &str, seq: u64, recorded_at_ms: u64, event: Event) -> Self {
        EventEnvelope {
            schema_version: SCHEMA_VERSION,
            kind: event.kind().to_owned(),
            session_id: session_id.to_owned(),
            seq,
            recorded_at_ms,
            event,
        }
    }
}

/// Everything that can happen to a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
// Events are built once per append and matched everywhere; boxing the one large variant would
// cost every match for nothing measurable.
#[allow(clippy::large_enum_variant)]
pub enum Event {
    /// The session exists, with its model, tools and limits.
    SessionStarted(SessionStarted),
    /// A person's message; starts turn `turn`.
    UserMessage {
        /// Turn number, from 1.
        turn: u32,
        /// The message text.
        text: String,
        /// A model for this turn only, instead of the session's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<ModelSpec>,
        /// Images and documents sent with the text, in order; they go ahead of the text in
        /// the transcript's user message. Absent from text-only messages (and old histories).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        media: Vec<Media>,
        /// A tool choice for this turn only, instead of the session's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_choice: Option<ToolChoice>,
        /// The key the client sent the message under (`Idempotency-Key`): a resend under it
        /// starts no second turn. Absent from messages sent without one (and old histories).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        idempotency_key: Option<String>,
    },
    /// A model call was scheduled (its task enqueued in the same append).
    ModelCallScheduled {
        /// Turn number.
        turn: u32,
        /// Model call index within the turn, from 0.
        round: u32,
        /// Attempt, from 1; a retry is a new attempt.
        attempt: u32,
        /// Earliest start, in epoch milliseconds (a retry's backoff).
        not_before_ms: u64,
    },
    /// A model call returned a valid response; the only response committed for its slot.
    ModelCallCompleted {
        /// Turn number.
        turn: u32,
        /// Round.
        round: u32,
        /// Attempt that produced it.
        attempt: u32,
        /// The canonical response.
        response: ModelResponse,
        /// The response's usage priced when it was recorded, in micro-dollars; absent when
        /// its model has no price (or in histories from before prices).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost_micros: Option<u64>,
    },
    /// A model call attempt failed.
    ModelCallFailed {
        /// Turn number.
        turn: u32,
        /// Round.
        round: u32,
        /// The failed attempt.
        attempt: u32,
        /// What went wrong.
        failure: ActivityFailure,
        /// The failure's known usage priced when it was recorded, in micro-dollars; absent
        /// when no usage is known or its model has no price.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost_micros: Option<u64>,
    },
    /// A tool call was scheduled (its task enqueued in the same append).
    ToolCallScheduled {
        /// Turn number.
        turn: u32,
        /// The tool_use this call answers.
        tool_use_id: String,
        /// Tool name.
        name: String,
        /// Attempt, from 1.
        attempt: u32,
        /// Earliest start, in epoch milliseconds.
        not_before_ms: u64,
    },
    /// A tool call returned (possibly an `is_error` result the tool chose to give).
    ToolCallCompleted {
        /// Turn number.
        turn: u32,
        /// The tool_use answered.
        tool_use_id: String,
        /// Attempt that produced it.
        attempt: u32,
        /// The full result (the transcript may carry a projection of it).
        content: ToolResultContent,
        /// Whether the content describes a failure.
        is_error: bool,
    },
    /// A tool call attempt failed.
    ToolCallFailed {
        /// Turn number.
        turn: u32,
        /// The tool_use concerned.
        tool_use_id: String,
        /// The failed attempt.
        attempt: u32,
        /// What went wrong.
        failure: ActivityFailure,
    },
    /// The model ended the turn.
    TurnCompleted {
        /// Turn number.
        turn: u32,
        /// Usage of every model call attempt of the turn.
        usage: Usage,
    },
    /// The turn could not finish.
    TurnFailed {
        /// Turn number.
        turn: u32,
        /// Why, for people.
        reason: String,
        /// The budget the turn went over, when that is why it failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        budget_exceeded: Option<BudgetExceeded>,
    },
    /// The running turn was cancelled; the session takes further turns.
    TurnCancelled {
        /// Turn number.
        turn: u32,
        /// Why, for people.
        reason: String,
    },
    /// The session was cancelled; it takes no further turns.
    SessionCancelled {
        /// Why, for people.
        reason: String,
    },
    /// What a model attempt streamed since the run's previous progress record, appended while
    /// it streams (at most every `WorkerConfig::progress_interval_ms`, and once more when the
    /// attempt fails), so that output a person already read survives a crash. Presentation
    /// only: the workflow accepts it without touching the transcript or deciding anything; the
    /// attempt's `model_call_completed` supersedes it. Each record carries only the new text,
    /// so a run's records concatenate to what it streamed and cost O(output) bytes in all.
    ModelAttemptProgress {
        /// Turn number.
        turn: u32,
        /// Round.
        round: u32,
        /// The attempt that is streaming.
        attempt: u32,
        /// The task lease that ran it. A crash re-runs the same attempt under a new lease, so
        /// a run's text is the records of one (attempt, lease_attempt).
        lease_attempt: u32,
        /// Visible text streamed since the previous record of this run.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        text_appended: String,
        /// Reasoning text streamed since the previous record of this run.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        thinking_appended: String,
        /// The usage the run's stream reported so far (cumulative), when it reported any: if
        /// the run is lost (its worker dies), this is what is known of what it consumed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
        /// `usage` priced when it was recorded, in micro-dollars.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost_micros: Option<u64>,
    },
    /// The session's tool policy asks a person about this tool call: it is parked, neither
    /// scheduled nor answered, until `tool_call_approved` or `tool_call_denied` (a person's, or
    /// the deadline's). A command: the policy recorded in `session_started` decided it. With a
    /// deadline, its timer is a task named by this event's seq that no worker ever leases.
    ToolApprovalRequested {
        /// Turn number.
        turn: u32,
        /// The tool_use that waits.
        tool_use_id: String,
        /// Tool name.
        name: String,
        /// When the call is denied unless decided before (epoch ms), if the policy sets a
        /// timeout.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<u64>,
    },
    /// A person approved a parked tool call: it is scheduled now.
    ToolCallApproved {
        /// Turn number.
        turn: u32,
        /// The tool_use approved.
        tool_use_id: String,
    },
    /// A parked tool call was denied, by a person or by its deadline: the model gets an
    /// `is_error` result carrying the reason.
    ToolCallDenied {
        /// Turn number.
        turn: u32,
        /// The tool_use denied.
        tool_use_id: String,
        /// Why, for the model and for people.
        reason: String,
        /// Whether the approval deadline denied it (no person decided in time).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        by_deadline: bool,
    },
    /// The transcript was compacted (a command: the session's `compaction` policy decided
    /// it). The fold recomputes the compacted transcript from the transcript before it and
    /// these parameters with the ledger's pure `compact`; every older event stays in the
    /// history untouched.
    TranscriptCompacted {
        /// The turn running (or the last one, when compacted on request between turns).
        turn: u32,
        /// Why it ran.
        trigger: CompactionTrigger,
        /// The strategies applied, in order (those that changed nothing are left out).
        strategies: Vec<CompactionStrategy>,
        /// The turns kept, when `keep_last_turns` is among the strategies.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        keep_last_turns: Option<u32>,
        /// The index, in the transcript before, of the first message kept after the cut.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cut: Option<u64>,
        /// Estimated tokens before ([`cairn_ledger::estimate_tokens`]).
        estimate_before: u64,
        /// Estimated tokens after.
        estimate_after: u64,
        /// The summary of the dropped turns, put in front of the first kept message, when the
        /// policy summarises and the summary call succeeded.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        summary: Option<String>,
    },
    /// A summary call of the turns a compaction drops was scheduled (a command; its model
    /// task is enqueued in the same append). The model call it precedes waits for it.
    SummaryCallScheduled {
        /// Turn number.
        turn: u32,
        /// Attempt, from 1.
        attempt: u32,
        /// Earliest start, in epoch milliseconds.
        not_before_ms: u64,
    },
    /// The summary call returned: its text is the summary.
    SummaryCallCompleted {
        /// Turn number.
        turn: u32,
        /// Attempt that produced it.
        attempt: u32,
        /// The summary.
        summary: String,
        /// The call's token usage (absent in histories recorded before it was kept).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
        /// That usage priced when it was recorded, in micro-dollars; absent when its model
        /// has no price.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost_micros: Option<u64>,
    },
    /// A summary call attempt failed; retried under the model retry policy, then the
    /// compaction goes on without a summary.
    SummaryCallFailed {
        /// Turn number.
        turn: u32,
        /// The failed attempt.
        attempt: u32,
        /// What went wrong.
        failure: ActivityFailure,
        /// The failure's known usage priced when it was recorded, in micro-dollars.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost_micros: Option<u64>,
    },
    /// A person or program asked to compact the transcript now (`cairn compact`), between
    /// turns. The workflow answers with `transcript_compacted`, or nothing when no strategy
    /// shrinks it.
    CompactionRequested {},
}

impl Event {
    /// The kind tag, as written in envelopes and JSON views.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::SessionStarted(_) => "session_started",
            Event::UserMessage { .. } => "user_message",
            Event::ModelCallScheduled { .. } => "model_call_scheduled",
            Event::ModelCallCompleted { .. } => "model_call_completed",
            Event::ModelCallFailed { .. } => "model_call_failed",
            Event::ToolCallScheduled { .. } => "tool_call_scheduled",
            Event::ToolCallCompleted { .. } => "tool_call_completed",
            Event::ToolCallFailed { .. } => "tool_call_failed",
            Event::TurnCompleted { .. } => "turn_completed",
            Event::TurnFailed { .. } => "turn_failed",
            Event::TurnCancelled { .. } => "turn_cancelled",
            Event::SessionCancelled { .. } => "session_cancelled",
            Event::ModelAttemptProgress { .. } => "model_attempt_progress",
            Event::ToolApprovalRequested { .. } => "tool_approval_requested",
            Event::ToolCallApproved { .. } => "tool_call_approved",
            Event::ToolCallDenied { .. } => "tool_call_denied",
            Event::TranscriptCompacted { .. } => "transcript_compacted",
            Event::CompactionRequested { .. } => "compaction_requested",
            Event::SummaryCallScheduled { .. } => "summary_call_scheduled",
            Event::SummaryCallCompleted { .. } => "summary_call_completed",
            Event::SummaryCallFailed { .. } => "summary_call_failed",
        }
    }

    /// Whether the event records a workflow decision (a command) rather than an input.
    pub fn is_command(&self) -> bool {
        matches!(
            self,
            Event::ModelCallScheduled { .. }
                | Event::ToolCallScheduled { .. }
                | Event::ToolApprovalRequested { .. }
                | Event::TranscriptCompacted { .. }
                | Event::SummaryCallScheduled { .. }
                | Event::TurnCompleted { .. }
                | Event::TurnFailed { .. }
        )
    }
}

/// How a session was started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionStarted {
    /// The default model.
    pub model: ModelSpec,
    /// The tools the model may call; shared, not copied, by the session's state and every
    /// model call's input (the same bytes as a list on the wire and in the history).
    pub tools: Arc<[ToolSpec]>,
    /// A system prompt, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Turn limits.
    pub limits: Limits,
    /// Retry policy of model calls.
    pub model_retry: RetryPolicy,
    /// Retry policy of tool calls.
    pub tool_retry: RetryPolicy,
    /// The task queues its model and tool calls go to. Omitted from the record when both are
    /// the default, so histories written before routing existed read the same.
    #[serde(default, skip_serializing_if = "Queues::is_default")]
    pub queues: Queues,
    /// The session and seq this one was forked from (`cairn fork`): its history up to here
    /// is a copy of that prefix. Omitted from the record when not a fork, so other histories
    /// read the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkOrigin>,
    /// The version of the workflow's rules the session started under
    /// ([`WORKFLOW_VERSION`](crate::workflow::WORKFLOW_VERSION) then): it keeps them for
    /// good, so its history replays and resumes as recorded after an upgrade. Histories
    /// recorded before versions existed read as 1, and 1 is left out of the record.
    #[serde(
        default = "first_workflow_version",
        skip_serializing_if = "is_first_workflow_version"
    )]
    pub workflow_version: u32,
    /// Which tool calls run, which are denied and which wait for a person
    /// ([`ToolPolicy`]). `None` allows every call, as sessions did before policies existed,
    /// and is left out of the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_policy: Option<ToolPolicy>,
    /// When and how the transcript is compacted ([`CompactionPolicy`]). `None` never
    /// compacts, as sessions did before compaction existed, and is left out of the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compaction: Option<CompactionPolicy>,
    /// The absolute directory the session's tools work in (`read_file` reads there, `shell`
    /// runs there), recorded so that a turn resumed by another process, started elsewhere,
    /// still works where it began. `None`: the worker's own directory, as sessions did
    /// before it was recorded; left out of the record then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// The options of its model calls: tool choice, the provider's server tools, prompt
    /// caching. Left out of the record when all are unset, so other histories read the same.
    #[serde(default, skip_serializing_if = "CallOptions::is_default")]
    pub call_options: CallOptions,
}

fn first_workflow_version() -> u32 {
    1
}

fn is_first_workflow_version(version: &u32) -> bool {
    *version == 1
}

/// Where a forked session came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkOrigin {
    /// The parent session.
    pub session_id: String,
    /// The last seq of the parent's history the fork copied.
    pub seq: u64,
}

/// The task queues of a session's activities; `None` is [`DEFAULT_QUEUE`](crate::store::DEFAULT_QUEUE).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Queues {
    /// The queue of model calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The queue of tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
}

impl Queues {
    /// Whether both are the default queue.
    pub fn is_default(&self) -> bool {
        self.model.is_none() && self.tool.is_none()
    }

    /// The queue of model calls.
    pub fn model_queue(&self) -> &str {
        self.model.as_deref().unwrap_or(crate::store::DEFAULT_QUEUE)
    }

    /// The queue of tool calls.
    pub fn tool_queue(&self) -> &str {
        self.tool.as_deref().unwrap_or(crate::store::DEFAULT_QUEUE)
    }
}

/// Limits of a turn and budgets of a turn and of the session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Model calls per turn at most; a turn that needs more fails.
    pub max_rounds: u32,
    /// What one turn may consume (tokens, cost, model call attempts). Unlimited by default,
    /// and then left out of the record.
    #[serde(default, skip_serializing_if = "Budget::is_unlimited")]
    pub turn_budget: Budget,
    /// What the session's turns may consume together. Unlimited by default, and then left
    /// out of the record.
    #[serde(default, skip_serializing_if = "Budget::is_unlimited")]
    pub session_budget: Budget,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_rounds: 16,
            turn_budget: Budget::default(),
            session_budget: Budget::default(),
        }
    }
}

/// A class of activity failure, for retry decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
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
    /// The request itself is wrong (400-class, invalid tool arguments); retrying cannot help.
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
    /// The request is larger than the model's context window. Never retried as it is: a
    /// session with a compaction policy compacts and retries, others fail the turn.
    ContextTooLong,
}

impl ErrorClass {
    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::RateLimited => "rate_limited",
            ErrorClass::Overloaded => "overloaded",
            ErrorClass::Timeout => "timeout",
            ErrorClass::InvalidRequest => "invalid_request",
            ErrorClass::InvalidResponse => "invalid_response",
            ErrorClass::Auth => "auth",
            ErrorClass::ToolFailed => "tool_failed",
            ErrorClass::Cancelled => "cancelled",
            ErrorClass::Internal => "internal",
            ErrorClass::ContextTooLong => "context_too_long",
        }
    }
}

/// A failed activity attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivityFailure {
    /// The class that drives the retry decision.
    pub class: ErrorClass,
    /// The error, for people.
    pub message: String,
    /// Usage the failed attempt consumed, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// How far a model call got before it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<FailurePhase>,
    /// The progress details the attempt heartbeated last; the next attempt receives them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_details: Option<JsonText>,
    /// How long the provider asked us to wait (`retry-after`), in milliseconds: the next
    /// attempt starts no earlier, whatever the backoff says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl ActivityFailure {
    /// A failure of `class` with a message and nothing else known.
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        ActivityFailure {
            class,
            message: message.into(),
            usage: None,
            phase: None,
            heartbeat_details: None,
            retry_after_ms: None,
        }
    }
}

/// How far an attempt got before it failed: LLM calls are retried differently once output
/// started streaming, and a response that arrived but failed validation is its own case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePhase {
    /// Nothing was received: connection, request or early provider errors.
    BeforeStream,
    /// Output had started streaming when the attempt failed.
    Streaming,
    /// A complete response arrived but failed validation; it was not committed.
    Validation,
}

/// When and how often an activity is retried.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule_to_start_timeout_ms: Option<u64>,
    /// The overall deadline of all attempts, from the first schedule: no retry starts after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule_to_close_timeout_ms: Option<u64>,
    /// A running attempt that does not heartbeat for this long is failed as timed out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_timeout_ms: Option<u64>,
}

impl RetryPolicy {
    /// Defaults for model calls: 1s, ×2, ≤60s, 5 attempts, 10 min per attempt, and 30 min for
    /// all attempts together (no retry starts after that).
    pub fn model_default() -> Self {
        RetryPolicy {
            initial_interval_ms: 1_000,
            backoff_coefficient: 2.0,
            maximum_interval_ms: 60_000,
            maximum_attempts: 5,
            non_retryable: vec![
                ErrorClass::InvalidRequest,
                ErrorClass::Auth,
                ErrorClass::Cancelled,
            ],
            start_to_close_timeout_ms: 600_000,
            schedule_to_start_timeout_ms: None,
            schedule_to_close_timeout_ms: Some(1_800_000),
            heartbeat_timeout_ms: None,
        }
    }

    /// Defaults for tool calls: 1s, ×2, ≤30s, 3 attempts, 5 min per attempt.
    pub fn tool_default() -> Self {
        RetryPolicy {
            initial_interval_ms: 1_000,
            backoff_coefficient: 2.0,
            maximum_interval_ms: 30_000,
            maximum_attempts: 3,
            non_retryable: vec![
                ErrorClass::InvalidRequest,
                ErrorClass::Auth,
                ErrorClass::Cancelled,
            ],
            start_to_close_timeout_ms: 300_000,
            schedule_to_start_timeout_ms: None,
            schedule_to_close_timeout_ms: None,
            heartbeat_timeout_ms: None,
        }
    }

    /// The retry decision after a failure at `now_ms` of an activity first scheduled at
    /// `first_scheduled_ms`: the next attempt's start time, or why the failure is final.
    /// Pure: the same inputs give the same answer on every replay.
    pub fn decide(
        &self,
        failed_attempt: u32,
        failure: &ActivityFailure,
        first_scheduled_ms: u64,
        now_ms: u64,
    ) -> Result<u64, String> {
        let class = failure.class;
        let Some(backoff) = self.next_delay_ms(failed_attempt, class) else {
            return Err(format!("after {failed_attempt} attempt(s)"));
        };
        let delay = backoff.max(failure.retry_after_ms.unwrap_or(0));
        let next_start = now_ms.saturating_add(delay);
        if let Some(limit) = self.schedule_to_close_timeout_ms {
            if next_start > first_scheduled_ms.saturating_add(limit) {
                return Err(format!(
                    "after {failed_attempt} attempt(s) (its {limit} ms schedule-to-close deadline leaves no time for another)"
                ));
            }
        }
        Ok(next_start)
    }

    /// The delay before attempt `failed_attempt + 1`, or `None` when the failure is final.
    /// Pure: the same inputs give the same answer on every replay.
    pub fn next_delay_ms(&self, failed_attempt: u32, class: ErrorClass) -> Option<u64> {
        if self.non_retryable.contains(&class) {
            return None;
        }
        if self.maximum_attempts != 0 && failed_attempt >= self.maximum_attempts {
            return None;
        }
        let exponent = failed_attempt.saturating_sub(1).min(64) as i32;
        let delay = self.initial_interval_ms as f64 * self.backoff_coefficient.powi(exponent);
        let capped = if delay.is_finite() {
            delay.min(self.maximum_interval_ms as f64)
        } else {
            self.maximum_interval_ms as f64
        };
        Some(capped.max(0.0) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_caps_and_stops() {
        let p = RetryPolicy {
            initial_interval_ms: 100,
            backoff_coefficient: 2.0,
            maximum_interval_ms: 350,
            maximum_attempts: 4,
            non_retryable: vec![ErrorClass::InvalidRequest],
            start_to_close_timeout_ms: 1000,
            schedule_to_start_timeout_ms: None,
            schedule_to_close_timeout_ms: None,
            heartbeat_timeout_ms: None,
        };
        assert_eq!(p.next_delay_ms(1, ErrorClass::Transient), Some(100));
        assert_eq!(p.next_delay_ms(2, ErrorClass::Transient), Some(200));
        assert_eq!(p.next_delay_ms(3, ErrorClass::Transient), Some(350));
        assert_eq!(p.next_delay_ms(4, ErrorClass::Transient), None);
        assert_eq!(p.next_delay_ms(1, ErrorClass::InvalidRequest), None);
    }

    #[test]
    fn retry_after_outweighs_a_shorter_backoff() {
        let p = RetryPolicy {
            initial_interval_ms: 100,
            ..RetryPolicy::model_default()
        };
        let mut f = ActivityFailure::new(ErrorClass::RateLimited, "429");
        assert_eq!(p.decide(1, &f, 0, 1_000), Ok(1_100));
        f.retry_after_ms = Some(3_000);
        assert_eq!(p.decide(1, &f, 0, 1_000), Ok(4_000));
        // Past the overall deadline, a long retry-after makes the failure final.
        let bounded = RetryPolicy {
            schedule_to_close_timeout_ms: Some(2_000),
            ..p
        };
        assert!(bounded.decide(1, &f, 0, 1_000).is_err());
    }
}
