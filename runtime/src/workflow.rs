//! The agent turn as a pure, deterministic state machine: `step(state, input) -> Transition`.
//!
//! Inputs (a user message, an activity result, a cancellation) yield commands; each command is
//! recorded as the event that follows its input, and applying that event checks it matches the
//! command the code expects. [`SessionState::step`] does both for a live input and also says
//! which tasks to enqueue and cancel and how the turn ended, so the engine only appends what it
//! returns. Every state change goes through [`SessionState::apply`], which replay calls on each
//! recorded event, so a history that the current code would not produce is caught as
//! [`Error::Nondeterminism`] naming the event. No IO, no clock (time comes from the event
//! envelope), no randomness.

use crate::budget::{BudgetExceeded, Check, UsageTotals};
use crate::compaction::CompactionTrigger;
use crate::error::{Error, Result};
use crate::event::{
    ActivityFailure, ErrorClass, Event, EventEnvelope, RetryPolicy, SessionStarted,
};
use crate::idempotency::{idempotency_key_problem, message_fingerprint, KeyedMessage};
use crate::policy::PolicyDecision;
use crate::store::{NewTask, TaskId, TaskKind};
use cairn_ledger::{
    validate_recorded_response, validate_response, CallOptions, CompactionStrategy, JsonText,
    ModelResponse, ModelSpec, Part, StopReason, ToolChoice, ToolResult, ToolResultContent, ToolUse,
    Transcript, Usage,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

/// The version of the workflow's rules this code decides new sessions by. A session keeps
/// the version it started under (`SessionStarted::workflow_version`), and the rules of every
/// version that may still have sessions stay here, each change behind a check of it:
///
/// 1. The first rules.
/// 2. A tool call whose JSON arguments lack a field its tool's `input_schema` requires is
///    answered at once with an error result naming the field, like an unknown tool, instead
///    of being scheduled for the tool to refuse (a worker round trip and two durable writes
///    saved, and the model told exactly what is missing). Version 1 sessions schedule it.
/// 3. Compaction's `drop_reasoning` keeps the reasoning of the transcript's last assistant
///    message when it holds tool calls (a turn that ended on its tool results), which
///    Anthropic needs with thinking on ([`cairn_ledger::CompactionRules`]); and the usage of
///    an attempt that failed as too long for the context, or of a summary call, counts
///    in the budget totals (with its cost) as every other attempt's does. Version 1 and 2
///    sessions keep the earlier rules.
///
/// Budgets (`Limits::turn_budget`, `Limits::session_budget`) changed no version: a history
/// can only hold them if it was recorded by code that enforces them, and without them every
/// session decides as before.
pub const WORKFLOW_VERSION: u32 = 3;

// Compaction's rules: see the module doc of `workflow_compaction.rs`.
#[path = "workflow_compaction.rs"]
mod compaction_rules;
pub use compaction_rules::SummarySlot;

#[path = "workflow_bytes.rs"]
mod bytes;

/// A decision of the workflow; the engine records it as an event before anything runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Call the model.
    ScheduleModelCall {
        /// Turn.
        turn: u32,
        /// Round.
        round: u32,
        /// Attempt.
        attempt: u32,
        /// Earliest start.
        not_before_ms: u64,
    },
    /// Run a tool.
    ScheduleToolCall {
        /// Turn.
        turn: u32,
        /// The tool_use to answer.
        tool_use_id: String,
        /// Tool name.
        name: String,
        /// Attempt.
        attempt: u32,
        /// Earliest start.
        not_before_ms: u64,
    },
    /// Park a tool call until a person decides (the session's policy asks).
    RequestToolApproval {
        /// Turn.
        turn: u32,
        /// The tool_use that waits.
        tool_use_id: String,
        /// Tool name.
        name: String,
        /// When the call is denied unless decided before, if the policy sets a timeout.
        deadline_ms: Option<u64>,
    },
    /// Compact the transcript (recorded as `transcript_compacted`; see that event).
    CompactTranscript {
        /// Turn.
        turn: u32,
        /// Why.
        trigger: CompactionTrigger,
        /// Strategies, in order.
        strategies: Vec<CompactionStrategy>,
        /// Turns kept, when cut.
        keep_last_turns: Option<u32>,
        /// The first kept message's index before the cut.
        cut: Option<u64>,
        /// Estimated tokens before.
        estimate_before: u64,
        /// Estimated tokens after.
        estimate_after: u64,
        /// The summary of the dropped turns, if one was made.
        summary: Option<String>,
    },
    /// Summarise the turns a compaction drops (recorded as `summary_call_scheduled`).
    ScheduleSummary {
        /// Turn.
        turn: u32,
        /// Attempt.
        attempt: u32,
        /// Earliest start.
        not_before_ms: u64,
    },
    /// End the turn successfully.
    CompleteTurn {
        /// Turn.
        turn: u32,
        /// Usage of all model call attempts of the turn.
        usage: Usage,
    },
    /// End the turn as failed.
    FailTurn {
        /// Turn.
        turn: u32,
        /// Why.
        reason: String,
        /// The budget it went over, when that is why.
        budget_exceeded: Option<BudgetExceeded>,
    },
}

impl Command {
    /// The event that records this command.
    pub fn into_event(self) -> Event {
        match self {
            Command::ScheduleModelCall {
                turn,
                round,
                attempt,
                not_before_ms,
            } => Event::ModelCallScheduled {
                turn,
                round,
                attempt,
                not_before_ms,
            },
            Command::ScheduleToolCall {
                turn,
                tool_use_id,
                name,
                attempt,
                not_before_ms,
            } => Event::ToolCallScheduled {
                turn,
                tool_use_id,
                name,
                attempt,
                not_before_ms,
            },
            Command::RequestToolApproval {
                turn,
                tool_use_id,
                name,
                deadline_ms,
            } => Event::ToolApprovalRequested {
                turn,
                tool_use_id,
                name,
                deadline_ms,
            },
            Command::CompactTranscript {
                turn,
                trigger,
                strategies,
                keep_last_turns,
                cut,
                estimate_before,
                estimate_after,
                summary,
            } => Event::TranscriptCompacted {
                turn,
                trigger,
                strategies,
                keep_last_turns,
                cut,
                estimate_before,
                estimate_after,
                summary,
            },
            Command::ScheduleSummary {
                turn,
                attempt,
                not_before_ms,
            } => Event::SummaryCallScheduled {
                turn,
                attempt,
                not_before_ms,
            },
            Command::CompleteTurn { turn, usage } => Event::TurnCompleted { turn, usage },
            Command::FailTurn {
                turn,
                reason,
                budget_exceeded,
            } => Event::TurnFailed {
                turn,
                reason,
                budget_exceeded,
            },
        }
    }
}

/// How the last finished turn ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum TurnOutcome {
    /// The model ended the turn; `answer` is the final message's text. A `stop_reason` of
    /// `max_tokens`, `refusal` or `content_filter` means the answer is not a normal one
    /// ([`TurnOutcome::abnormal_stop`]).
    Completed {
        /// Turn.
        turn: u32,
        /// Final visible text.
        answer: String,
        /// Why the final response stopped (absent in outcomes from before stop reasons).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stop_reason: Option<StopReason>,
        /// What the turn's model call attempts consumed, failed ones included.
        #[serde(default)]
        totals: UsageTotals,
    },
    /// The turn failed.
    Failed {
        /// Turn.
        turn: u32,
        /// Why.
        reason: String,
        /// The budget it went over, when that is why.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        budget_exceeded: Option<BudgetExceeded>,
        /// What the turn's model call attempts consumed.
        #[serde(default)]
        totals: UsageTotals,
    },
    /// The session was cancelled during or after the turn.
    Cancelled {
        /// Turn.
        turn: u32,
        /// Why.
        reason: String,
        /// What the turn's model call attempts consumed until then.
        #[serde(default)]
        totals: UsageTotals,
    },
}

impl TurnOutcome {
    /// The turn this outcome is about.
    pub fn turn(&self) -> u32 {
        match self {
            TurnOutcome::Completed { turn, .. }
            | TurnOutcome::Failed { turn, .. }
            | TurnOutcome::Cancelled { turn, .. } => *turn,
        }
    }

    /// What the turn's model call attempts consumed.
    pub fn totals(&self) -> &UsageTotals {
        match self {
            TurnOutcome::Completed { totals, .. }
            | TurnOutcome::Failed { totals, .. }
            | TurnOutcome::Cancelled { totals, .. } => totals,
        }
    }

    /// The stop reason of a completed turn whose answer is cut short or withheld
    /// (`max_tokens`, `refusal`, `content_filter`): not a normal completion.
    pub fn abnormal_stop(&self) -> Option<StopReason> {
        match self {
            TurnOutcome::Completed {
                stop_reason:
                    Some(
                        reason @ (StopReason::MaxTokens
                        | StopReason::Refusal
                        | StopReason::ContentFilter),
                    ),
                ..
            } => Some(*reason),
            _ => None,
        }
    }
}

/// A model call slot waiting for its result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSlot {
    /// Current attempt.
    pub attempt: u32,
    /// Seq of the `ModelCallScheduled` event, once recorded; the task is keyed by it.
    pub scheduled_seq: Option<u64>,
    /// When the current attempt is due.
    pub not_before_ms: u64,
    /// When the first attempt was scheduled (the schedule-to-close deadline counts from it).
    pub first_scheduled_ms: u64,
    /// Progress details the previous attempt heartbeated last.
    pub heartbeat_details: Option<JsonText>,
    /// The highest task lease that recorded streamed output (`model_attempt_progress`) for
    /// the current attempt, 0 when none did: output from an older lease is stale.
    pub progress_lease_attempt: u32,
    /// The usage (and its recorded cost) that lease's progress reported last: counted if
    /// that run turns out lost.
    pub progress_usage: Option<(Usage, Option<u64>)>,
}

/// Where one tool call stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolSlotState {
    /// Never scheduled (the turn fails before it would be).
    Unscheduled,
    /// Scheduled; waiting for its result.
    Scheduled {
        /// Current attempt.
        attempt: u32,
        /// Seq of the `ToolCallScheduled` event, once recorded.
        scheduled_seq: Option<u64>,
        /// When the current attempt is due.
        not_before_ms: u64,
        /// When the first attempt was scheduled.
        first_scheduled_ms: u64,
        /// Progress details the previous attempt heartbeated last.
        heartbeat_details: Option<JsonText>,
    },
    /// Parked: the session's policy asks a person first.
    AwaitingApproval {
        /// Seq of the `ToolApprovalRequested` event, once recorded; the deadline's timer task
        /// is keyed by it.
        requested_seq: Option<u64>,
        /// When the call is denied unless decided before.
        deadline_ms: Option<u64>,
    },
    /// Answered.
    Done(ToolResult),
}

/// A tool call parked until a person approves or denies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingApproval {
    /// Turn.
    pub turn: u32,
    /// The call.
    pub tool_use: ToolUse,
    /// Seq of its `ToolApprovalRequested` event.
    pub requested_seq: Option<u64>,
    /// When it is denied unless decided before.
    pub deadline_ms: Option<u64>,
}

/// One tool call of the current round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolSlot {
    /// The call.
    pub tool_use: ToolUse,
    /// Its state.
    pub state: ToolSlotState,
}

/// What an active turn is waiting for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// A model call.
    Model(ModelSlot),
    /// Tool calls, in declaration order.
    Tools(Vec<ToolSlot>),
    /// A summary call, before a compaction and the model call it precedes.
    Summarizing(SummarySlot),
    /// Its end, decided but not yet recorded.
    Ending,
}

/// The turn in progress.
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveTurn {
    /// Turn number.
    pub turn: u32,
    /// Current round (model call index).
    pub round: u32,
    /// The model of this turn.
    pub model: ModelSpec,
    /// The tool choice of this turn, when its message overrides the session's.
    pub tool_choice: Option<ToolChoice>,
    /// What it waits for.
    pub phase: Phase,
    /// Usage of the turn's model call attempts so far.
    pub usage: Usage,
    /// Usage, cost and model calls of the turn's attempts so far.
    pub totals: UsageTotals,
    /// The stop reason of the turn's last response.
    pub stop_reason: Option<StopReason>,
}

/// Which activity a scheduled task runs, resolved from the workflow state.
#[derive(Debug, Clone, PartialEq)]
pub enum ScheduledActivity {
    /// A model call.
    Model {
        /// Turn.
        turn: u32,
        /// Round.
        round: u32,
        /// Attempt.
        attempt: u32,
        /// The model.
        model: ModelSpec,
        /// The call's options (the turn's tool choice for this round, the session's others).
        options: CallOptions,
        /// When the attempt was due.
        not_before_ms: u64,
        /// Details the previous attempt heartbeated last.
        heartbeat_details: Option<JsonText>,
    },
    /// A summary call: the model over the turns a compaction drops.
    Summary {
        /// Turn.
        turn: u32,
        /// The turn's round it precedes.
        round: u32,
        /// Attempt.
        attempt: u32,
        /// The model.
        model: ModelSpec,
        /// When the attempt was due.
        not_before_ms: u64,
        /// The turns the compaction keeps; the summary covers those before them.
        keep_last_turns: u32,
    },
    /// A tool call.
    Tool {
        /// Turn.
        turn: u32,
        /// Attempt.
        attempt: u32,
        /// The call.
        tool_use: ToolUse,
        /// When the attempt was due.
        not_before_ms: u64,
        /// Details the previous attempt heartbeated last.
        heartbeat_details: Option<JsonText>,
    },
}

/// What one input does to a session: everything the engine appends in one atomic write, and
/// what it tells waiters afterwards.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// The input, then one event per command, with consecutive seqs and the input's time.
    pub events: Vec<EventEnvelope>,
    /// The commands the input caused, in order; `events[1..]` records them.
    pub commands: Vec<Command>,
    /// One task per activity the commands schedule, named by the seq of its scheduling event
    /// and not leasable before the attempt is due.
    pub enqueue: Vec<NewTask>,
    /// Tasks of activities the workflow stopped waiting for (a cancelled turn or session), by
    /// ascending seq. The task an input reports on is not among them: the report completes it.
    pub cancel: Vec<TaskId>,
    /// How the turn ended, when this input ended it.
    pub outcome: Option<TurnOutcome>,
}

/// A session's folded state: the ledger and the turn machine.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionState {
    /// Session id.
    pub session_id: String,
    /// The seq the next event gets.
    pub next_seq: u64,
    /// How the session was started; `None` before its first event.
    pub started: Option<SessionStarted>,
    /// The transcript (the ledger). Shared with the model calls in flight, which take it as
    /// it stands (an `Arc` clone, not a copy); a change copies it only while one still holds
    /// it.
    pub transcript: Arc<Transcript>,
    /// Turns started so far.
    pub turns_started: u32,
    /// The turn in progress.
    pub active: Option<ActiveTurn>,
    /// How the last finished turn ended.
    pub last_outcome: Option<TurnOutcome>,
    /// Whether the session was cancelled.
    pub cancelled: bool,
    /// Usage of every model call attempt of the session.
    pub usage: Usage,
    /// Usage, cost and model calls of every attempt of the session.
    pub totals: UsageTotals,
    tool_use_ids: BTreeSet<String>,
    /// The messages sent under an idempotency key, by key.
    message_keys: BTreeMap<String, KeyedMessage>,
    expected: VecDeque<Command>,
    /// The estimated bytes the state holds, kept up to date by `apply` (`workflow_bytes.rs`).
    bytes: usize,
    /// While a whole history is folded ([`SessionState::folding`]), and only then: the
    /// required arguments of each tool called so far.
    required_memo: Option<Box<RequiredMemo>>,
}

/// The required argument names of the tools a fold has seen called, by the tool's index in
/// the session's tools (fixed by its start, which a session has once, before any call), each read from the tool's schema once per fold
/// rather than at every call: reading them scans the whole schema text, about a quarter of
/// the fold of a long session whose model calls tools at every turn. Kept only while a fold
/// runs (a fold, a replay, the state at an event), so a parked state carries none.
#[derive(Debug, Clone, Default, PartialEq)]
struct RequiredMemo {
    by_tool: BTreeMap<usize, Option<Vec<String>>>,
}

impl SessionState {
    /// The state of a session with no events.
    pub fn new(session_id: impl Into<String>) -> Self {
        SessionState {
            session_id: session_id.into(),
            next_seq: 1,
            started: None,
            transcript: Arc::default(),
            turns_started: 0,
            active: None,
            last_outcome: None,
            cancelled: false,
            usage: Usage::default(),
            totals: UsageTotals::default(),
            tool_use_ids: BTreeSet::new(),
            message_keys: BTreeMap::new(),
            expected: VecDeque::new(),
            bytes: bytes::EMPTY_STATE_BYTES,
            required_memo: None,
        }
    }

    /// The message sent under idempotency key `key`, if one was: the turn it started and its
    /// fingerprint ([`crate::idempotency`]).
    pub fn keyed_message(&self, key: &str) -> Option<KeyedMessage> {
        self.message_keys.get(key).copied()
    }

    /// Folds a whole history, checking determinism on the way.
    pub fn fold<'a>(
        session_id: &str,
        events: impl IntoIterator<Item = &'a EventEnvelope>,
    ) -> Result<Self> {
        let mut state = SessionState::folding(session_id);
        for envelope in events {
            state.apply(envelope)?;
        }
        state.folded();
        state.finish_replay()?;
        Ok(state)
    }

    /// A new state for folding a whole history, event by event, with [`SessionState::apply`]:
    /// it reads each called tool's required arguments once (see `RequiredMemo`) until
    /// [`SessionState::folded`], which the folder must call before it keeps or hands the state.
    pub(crate) fn folding(session_id: &str) -> Self {
        let mut state = SessionState::new(session_id);
        state.required_memo = Some(Box::default());
        state
    }

    /// Ends a fold begun with [`SessionState::folding`]: drops what it kept for the fold alone.
    pub(crate) fn folded(&mut self) {
        self.required_memo = None;
    }

    /// After the last event of a history: every decided command must have been recorded.
    pub fn finish_replay(&self) -> Result<()> {
        match self.expected.front() {
            None => Ok(()),
            Some(command) => Err(Error::Nondeterminism {
                session_id: self.session_id.clone(),
                seq: self.next_seq,
                expected: format!("{command:?}"),
                found: "the end of the history".to_owned(),
            }),
        }
    }

    /// The workflow version the session started under, whose rules it keeps (1 until its
    /// start is folded).
    pub fn workflow_version(&self) -> u32 {
        self.started.as_ref().map_or(1, |s| s.workflow_version)
    }

    /// Whether a turn is in progress.
    pub fn is_running(&self) -> bool {
        self.active.is_some()
    }

    /// Resolves the activity a task scheduled at `scheduled_seq` runs, if it is still wanted.
    pub fn scheduled_activity(&self, scheduled_seq: u64) -> Option<ScheduledActivity> {
        let active = self.active.as_ref()?;
        match &active.phase {
            Phase::Model(slot) if slot.scheduled_seq == Some(scheduled_seq) => {
                Some(ScheduledActivity::Model {
                    turn: active.turn,
                    round: active.round,
                    attempt: slot.attempt,
                    model: active.model.clone(),
                    options: self
                        .started
                        .as_ref()
                        .map_or_else(CallOptions::default, |s| {
                            s.call_options
                                .for_call(active.tool_choice.as_ref(), active.round)
                        }),
                    not_before_ms: slot.not_before_ms,
                    heartbeat_details: slot.heartbeat_details.clone(),
                })
            }
            Phase::Summarizing(slot) if slot.scheduled_seq == Some(scheduled_seq) => {
                Some(ScheduledActivity::Summary {
                    turn: active.turn,
                    round: active.round,
                    attempt: slot.attempt,
                    model: active.model.clone(),
                    not_before_ms: slot.not_before_ms,
                    keep_last_turns: slot.keep_last_turns(),
                })
            }
            Phase::Tools(slots) => slots.iter().find_map(|slot| match &slot.state {
                ToolSlotState::Scheduled {
                    attempt,
                    scheduled_seq: Some(seq),
                    not_before_ms,
                    heartbeat_details,
                    ..
                } if *seq == scheduled_seq => Some(ScheduledActivity::Tool {
                    turn: active.turn,
                    attempt: *attempt,
                    tool_use: slot.tool_use.clone(),
                    not_before_ms: *not_before_ms,
                    heartbeat_details: heartbeat_details.clone(),
                }),
                _ => None,
            }),
            _ => None,
        }
    }

    /// The tool calls of the active round parked for approval, in declaration order.
    pub fn pending_approvals(&self) -> Vec<PendingApproval> {
        let Some(ActiveTurn {
            turn,
            phase: Phase::Tools(slots),
            ..
        }) = &self.active
        else {
            return Vec::new();
        };
        slots
            .iter()
            .filter_map(|slot| match slot.state {
                ToolSlotState::AwaitingApproval {
                    requested_seq,
                    deadline_ms,
                } => Some(PendingApproval {
                    turn: *turn,
                    tool_use: slot.tool_use.clone(),
                    requested_seq,
                    deadline_ms,
                }),
                _ => None,
            })
            .collect()
    }

    /// The parked call whose deadline timer is the task at `requested_seq`, if it still waits.
    pub fn approval_timer(&self, requested_seq: u64) -> Option<PendingApproval> {
        self.pending_approvals()
            .into_iter()
            .find(|p| p.requested_seq == Some(requested_seq) && p.deadline_ms.is_some())
    }

    /// The queued task of the outstanding activity scheduled at `scheduled_seq`, or of the
    /// deadline timer of the approval requested there, as the scheduling append enqueued it
    /// (for putting back a task missing from the queue).
    pub fn queued_task(&self, scheduled_seq: u64) -> Option<NewTask> {
        if let Some(parked) = self.approval_timer(scheduled_seq) {
            let command = Command::RequestToolApproval {
                turn: parked.turn,
                tool_use_id: parked.tool_use.id,
                name: parked.tool_use.name,
                deadline_ms: parked.deadline_ms,
            };
            return self.task_for(&command, scheduled_seq);
        }
        let command = match self.scheduled_activity(scheduled_seq)? {
            ScheduledActivity::Model {
                turn,
                round,
                attempt,
                not_before_ms,
                ..
            } => Command::ScheduleModelCall {
                turn,
                round,
                attempt,
                not_before_ms,
            },
            ScheduledActivity::Summary {
                turn,
                attempt,
                not_before_ms,
                ..
            } => Command::ScheduleSummary {
                turn,
                attempt,
                not_before_ms,
            },
            ScheduledActivity::Tool {
                turn,
                attempt,
                tool_use,
                not_before_ms,
                ..
            } => Command::ScheduleToolCall {
                turn,
                tool_use_id: tool_use.id,
                name: tool_use.name,
                attempt,
                not_before_ms,
            },
        };
        self.task_for(&command, scheduled_seq)
    }

    /// The scheduled seqs of every activity the active turn still waits for, and of the
    /// deadline timers of its parked calls.
    pub fn outstanding_tasks(&self) -> Vec<u64> {
        let Some(active) = &self.active else {
            return Vec::new();
        };
        match &active.phase {
            Phase::Model(slot) => slot.scheduled_seq.into_iter().collect(),
            Phase::Summarizing(slot) => slot.scheduled_seq.into_iter().collect(),
            Phase::Tools(slots) => slots
                .iter()
                .filter_map(|s| match s.state {
                    ToolSlotState::Scheduled { scheduled_seq, .. } => scheduled_seq,
                    ToolSlotState::AwaitingApproval {
                        requested_seq,
                        deadline_ms: Some(_),
                    } => requested_seq,
                    _ => None,
                })
                .collect(),
            Phase::Ending => Vec::new(),
        }
    }

    fn invalid(&self, seq: u64, reason: impl Into<String>) -> Error {
        Error::InvalidEvent {
            session_id: self.session_id.clone(),
            seq,
            reason: reason.into(),
        }
    }

    /// Applies a live input and the command events it causes, and says what to append.
    ///
    /// `input` must be an input event (not a command) at `next_seq`; its `recorded_at_ms` is the
    /// time every command is decided and recorded at. When the input is rejected the state is
    /// unchanged. Applying the decided commands cannot fail unless this code contradicts itself;
    /// if it does, the error is returned and the state, advanced part way, must be discarded
    /// (the engine reloads it from the store).
    pub fn step(&mut self, input: EventEnvelope) -> Result<Transition> {
        if input.event.is_command() {
            return Err(self.invalid(input.seq, "command event as input"));
        }
        // Checked on new sessions only, so that a history recorded before still folds: a
        // coefficient that is not a number cannot be written to an export (JSON has no NaN
        // or infinity), so its session could not be exported and imported again.
        if let Event::SessionStarted(started) = &input.event {
            if started.workflow_version == 0 {
                return Err(self.invalid(
                    input.seq,
                    format!(
                        "workflow version 0 is not one this cairn has (1 to {WORKFLOW_VERSION})"
                    ),
                ));
            }
            for (which, policy) in [
                ("model_retry", &started.model_retry),
                ("tool_retry", &started.tool_retry),
            ] {
                let coefficient = policy.backoff_coefficient;
                if !coefficient.is_finite() {
                    return Err(self.invalid(
                        input.seq,
                        format!(
                            "{which}: backoff_coefficient must be a finite number, not \
                             {coefficient}"
                        ),
                    ));
                }
            }
        }
        // The rules added since some histories were recorded, checked on new responses only
        // (folding applies `validate_recorded_response`).
        if let Event::ModelCallCompleted { response, .. } = &input.event {
            validate_response(response)
                .map_err(|e| self.invalid(input.seq, format!("response rejected: {e}")))?;
        }
        let before: BTreeSet<u64> = self.outstanding_tasks().into_iter().collect();
        let reported = self.reported_task(&input.event);
        let was_running = self.is_running();
        let commands = self.apply(&input)?;
        let now = input.recorded_at_ms;
        let mut events = Vec::with_capacity(1 + commands.len());
        events.push(input);
        let mut enqueue = Vec::new();
        for command in &commands {
            let envelope = EventEnvelope::new(
                &self.session_id,
                self.next_seq,
                now,
                command.clone().into_event(),
            );
            self.apply(&envelope)?;
            if let Some(task) = self.task_for(command, envelope.seq) {
                enqueue.push(task);
            }
            events.push(envelope);
        }
        let after: BTreeSet<u64> = self.outstanding_tasks().into_iter().collect();
        let cancel = before
            .difference(&after)
            .filter(|seq| Some(**seq) != reported)
            .map(|seq| self.task_id(*seq))
            .collect();
        let outcome = if was_running && !self.is_running() {
            self.last_outcome.clone()
        } else {
            None
        };
        Ok(Transition {
            events,
            commands,
            enqueue,
            cancel,
            outcome,
        })
    }

    /// The task a scheduling command enqueues: routed on the session's queue for its kind, to
    /// a worker that hosts the tool or the model's provider, with its schedule-to-start
    /// deadline when the retry policy sets one.
    fn task_for(&self, command: &Command, scheduled_seq: u64) -> Option<NewTask> {
        let started = self.started.as_ref()?;
        let (kind, not_before_ms, queue, target, policy) = match command {
            Command::ScheduleModelCall { not_before_ms, .. }
            | Command::ScheduleSummary { not_before_ms, .. } => {
                let model = self
                    .active
                    .as_ref()
                    .map(|a| &a.model)
                    .unwrap_or(&started.model);
                (
                    TaskKind::Model,
                    *not_before_ms,
                    started.queues.model_queue(),
                    model.provider.clone(),
                    &started.model_retry,
                )
            }
            Command::ScheduleToolCall {
                not_before_ms,
                name,
                ..
            } => (
                TaskKind::Tool,
                *not_before_ms,
                started.queues.tool_queue(),
                name.clone(),
                &started.tool_retry,
            ),
            Command::RequestToolApproval {
                deadline_ms, name, ..
            } => {
                // The deadline's timer: visible and overdue at the same moment, so no worker
                // ever leases it (an overdue task is never handed out) and the engine's timers
                // fire it (`Engine::fire_timers`) as they fire a start deadline.
                let deadline = (*deadline_ms)?;
                return Some(NewTask {
                    id: self.task_id(scheduled_seq),
                    kind: TaskKind::Tool,
                    visible_at_ms: deadline,
                    queue: started.queues.tool_queue().to_owned(),
                    target: name.clone(),
                    start_by_ms: Some(deadline),
                });
            }
            Command::CompactTranscript { .. }
            | Command::CompleteTurn { .. }
            | Command::FailTurn { .. } => return None,
        };
        Some(NewTask {
            id: self.task_id(scheduled_seq),
            kind,
            visible_at_ms: not_before_ms,
            queue: queue.to_owned(),
            target,
            start_by_ms: policy
                .schedule_to_start_timeout_ms
                .map(|limit| not_before_ms.saturating_add(limit)),
        })
    }

    fn task_id(&self, scheduled_seq: u64) -> TaskId {
        TaskId {
            session_id: self.session_id.clone(),
            scheduled_seq,
        }
    }

    /// The task an activity report answers (when the workflow waits for it): its slot's
    /// scheduling seq. The report's append completes that task under its lease, so it is not
    /// cancelled as well.
    fn reported_task(&self, event: &Event) -> Option<u64> {
        let phase = &self.active.as_ref()?.phase;
        match (event, phase) {
            (
                Event::ModelCallCompleted { .. } | Event::ModelCallFailed { .. },
                Phase::Model(slot),
            ) => slot.scheduled_seq,
            (
                Event::SummaryCallCompleted { .. } | Event::SummaryCallFailed { .. },
                Phase::Summarizing(slot),
            ) => slot.scheduled_seq,
            (
                Event::ToolCallCompleted { tool_use_id, .. }
                | Event::ToolCallFailed { tool_use_id, .. },
                Phase::Tools(slots),
            ) => slots
                .iter()
                .find(|s| &s.tool_use.id == tool_use_id)
                .and_then(|s| match s.state {
                    ToolSlotState::Scheduled { scheduled_seq, .. } => scheduled_seq,
                    _ => None,
                }),
            _ => None,
        }
    }

    /// Applies one event. Input events return the commands they cause; command events are
    /// checked against the commands decided before them. On error the state is unchanged.
    pub fn apply(&mut self, envelope: &EventEnvelope) -> Result<Vec<Command>> {
        let before = self.bytes_mark();
        let commands = self.apply_event(envelope)?;
        self.count_bytes(before, &envelope.event);
        Ok(commands)
    }

    fn apply_event(&mut self, envelope: &EventEnvelope) -> Result<Vec<Command>> {
        let seq = envelope.seq;
        if seq != self.next_seq {
            return Err(self.invalid(seq, format!("expected seq {}", self.next_seq)));
        }
        if envelope.session_id != self.session_id {
            return Err(self.invalid(seq, format!("event of session {:?}", envelope.session_id)));
        }
        let event = &envelope.event;
        if event.is_command() {
            self.apply_command_event(seq, event)?;
            self.next_seq += 1;
            return Ok(Vec::new());
        }
        if let Some(expected) = self.expected.front() {
            return Err(Error::Nondeterminism {
                session_id: self.session_id.clone(),
                seq,
                expected: format!("{expected:?}"),
                found: format!("{event:?}"),
            });
        }
        let now = envelope.recorded_at_ms;
        let commands = self.apply_input(seq, now, event)?;
        let commands = self.compact_before_model_call(commands);
        self.expected.extend(commands.iter().cloned());
        self.next_seq += 1;
        Ok(commands)
    }

    fn apply_command_event(&mut self, seq: u64, event: &Event) -> Result<()> {
        let Some(expected) = self.expected.front() else {
            return Err(Error::Nondeterminism {
                session_id: self.session_id.clone(),
                seq,
                expected: "no command".to_owned(),
                found: format!("{event:?}"),
            });
        };
        if &expected.clone().into_event() != event {
            return Err(Error::Nondeterminism {
                session_id: self.session_id.clone(),
                seq,
                expected: format!("{expected:?}"),
                found: format!("{event:?}"),
            });
        }
        self.expected.pop_front();
        if let Event::TranscriptCompacted { .. } = event {
            // May run between turns (on request), so before the active-turn check.
            self.apply_compaction(event);
            return Ok(());
        }
        if let Event::SummaryCallScheduled { .. } = event {
            self.summary_scheduled(seq);
            return Ok(());
        }
        let active = self.active.as_mut().ok_or_else(|| Error::InvalidEvent {
            session_id: self.session_id.clone(),
            seq,
            reason: "command event without an active turn".to_owned(),
        })?;
        match event {
            Event::ModelCallScheduled { .. } => {
                if let Phase::Model(slot) = &mut active.phase {
                    slot.scheduled_seq = Some(seq);
                }
                active.totals.model_calls += 1;
                self.totals.model_calls += 1;
            }
            Event::ToolCallScheduled { tool_use_id, .. } => {
                if let Phase::Tools(slots) = &mut active.phase {
                    for slot in slots.iter_mut() {
                        if &slot.tool_use.id == tool_use_id {
                            if let ToolSlotState::Scheduled { scheduled_seq, .. } = &mut slot.state
                            {
                                *scheduled_seq = Some(seq);
                            }
                        }
                    }
                }
            }
            Event::ToolApprovalRequested { tool_use_id, .. } => {
                if let Phase::Tools(slots) = &mut active.phase {
                    for slot in slots.iter_mut() {
                        if &slot.tool_use.id == tool_use_id {
                            if let ToolSlotState::AwaitingApproval { requested_seq, .. } =
                                &mut slot.state
                            {
                                *requested_seq = Some(seq);
                            }
                        }
                    }
                }
            }
            Event::TurnCompleted { turn, .. } => {
                let answer = self
                    .transcript
                    .messages
                    .last()
                    .map(|m| {
                        m.parts
                            .iter()
                            .filter_map(|p| match p {
                                Part::Text { text, .. } => Some(text.as_str()),
                                _ => None,
                            })
                            .collect::<String>()
                    })
                    .unwrap_or_default();
                self.last_outcome = Some(TurnOutcome::Completed {
                    turn: *turn,
                    answer,
                    stop_reason: active.stop_reason,
                    totals: active.totals,
                });
                self.active = None;
            }
            Event::TurnFailed {
                turn,
                reason,
                budget_exceeded,
            } => {
                let turn = *turn;
                let reason = reason.clone();
                let totals = active.totals;
                self.close_open_tool_uses(&format!("turn failed: {reason}"));
                self.last_outcome = Some(TurnOutcome::Failed {
                    turn,
                    reason,
                    budget_exceeded: budget_exceeded.clone(),
                    totals,
                });
                self.active = None;
            }
            _ => {}
        }
        Ok(())
    }

    fn apply_input(&mut self, seq: u64, now: u64, event: &Event) -> Result<Vec<Command>> {
        if self.started.is_none() && !matches!(event, Event::SessionStarted(_)) {
            return Err(self.invalid(seq, "the first event must be session_started"));
        }
        match event {
            Event::SessionStarted(started) => {
                if self.started.is_some() {
                    return Err(self.invalid(seq, "session already started"));
                }
                // Rules this code does not have cannot be replayed by guessing: a session of
                // a newer cairn is refused, not run under older rules. (Version 0, which
                // older code took for 1, still folds; new sessions of it are refused in
                // `step`.)
                let version = started.workflow_version;
                if version > WORKFLOW_VERSION {
                    return Err(self.invalid(
                        seq,
                        format!(
                            "workflow version {version} is not one this cairn has (1 to \
                             {WORKFLOW_VERSION}): the session was started by a newer cairn"
                        ),
                    ));
                }
                if let Some(policy) = &started.tool_policy {
                    policy
                        .check()
                        .map_err(|e| self.invalid(seq, format!("tool_policy: {e}")))?;
                }
                if let Some(policy) = &started.compaction {
                    policy
                        .check()
                        .map_err(|e| self.invalid(seq, format!("compaction: {e}")))?;
                }
                if let Some(prompt) = &started.system_prompt {
                    Arc::make_mut(&mut self.transcript).push_system(prompt.clone());
                }
                self.started = Some(started.clone());
                Ok(Vec::new())
            }
            Event::UserMessage {
                turn,
                text,
                model,
                media,
                tool_choice,
                idempotency_key,
            } => {
                if self.cancelled {
                    return Err(self.invalid(seq, "session is cancelled"));
                }
                if self.active.is_some() {
                    return Err(self.invalid(seq, "a turn is already running"));
                }
                if *turn != self.turns_started + 1 {
                    return Err(self.invalid(
                        seq,
                        format!(
                            "turn {turn} out of order (next is {})",
                            self.turns_started + 1
                        ),
                    ));
                }
                if text.is_empty() && media.is_empty() {
                    return Err(self.invalid(seq, "empty user message"));
                }
                for (i, m) in media.iter().enumerate() {
                    m.check()
                        .map_err(|v| self.invalid(seq, format!("media {i}: {v}")))?;
                }
                // Remembered once the message is known to be accepted, below.
                let keyed = match idempotency_key {
                    None => None,
                    Some(key) => {
                        if let Some(problem) = idempotency_key_problem(key) {
                            return Err(self.invalid(seq, problem));
                        }
                        if let Some(used) = self.message_keys.get(key) {
                            return Err(self.invalid(
                                seq,
                                format!("idempotency key {key:?} was used by turn {}", used.turn),
                            ));
                        }
                        let fingerprint =
                            message_fingerprint(text, model.as_ref(), media, tool_choice.as_ref());
                        let message = KeyedMessage {
                            turn: *turn,
                            fingerprint,
                        };
                        Some((key.clone(), message))
                    }
                };
                let model = match model {
                    Some(m) => m.clone(),
                    None => self.started_ref()?.model.clone(),
                };
                if let Some((key, message)) = keyed {
                    self.message_keys.insert(key, message);
                }
                Arc::make_mut(&mut self.transcript).push_user(text.clone(), media);
                self.turns_started = *turn;
                self.active = Some(ActiveTurn {
                    turn: *turn,
                    round: 0,
                    model,
                    tool_choice: tool_choice.clone(),
                    phase: Phase::Model(ModelSlot {
                        attempt: 1,
                        scheduled_seq: None,
                        not_before_ms: now,
                        first_scheduled_ms: now,
                        heartbeat_details: None,
                        progress_lease_attempt: 0,
                        progress_usage: None,
                    }),
                    usage: Usage::default(),
                    totals: UsageTotals::default(),
                    stop_reason: None,
                });
                if let Some(fail) = self.fail_over_budget(Check::BeforeCall) {
                    return Ok(vec![fail]);
                }
                Ok(vec![Command::ScheduleModelCall {
                    turn: *turn,
                    round: 0,
                    attempt: 1,
                    not_before_ms: now,
                }])
            }
            Event::ModelCallCompleted {
                turn,
                round,
                attempt,
                response,
                cost_micros,
            } => {
                self.check_model_slot(seq, *turn, *round, *attempt)?;
                validate_recorded_response(response)
                    .map_err(|e| self.invalid(seq, format!("response rejected: {e}")))?;
                if let Some(dup) = response
                    .tool_uses()
                    .find(|t| self.tool_use_ids.contains(&t.id))
                {
                    return Err(self.invalid(
                        seq,
                        format!("tool_use id {:?} was already used in this session", dup.id),
                    ));
                }
                Ok(self.on_model_response(now, response, *cost_micros))
            }
            Event::ModelCallFailed {
                turn,
                round,
                attempt,
                failure,
                cost_micros,
            } => {
                self.check_model_slot(seq, *turn, *round, *attempt)?;
                if failure.class == ErrorClass::ContextTooLong {
                    return Ok(self.on_context_too_long(now, *attempt, failure, *cost_micros));
                }
                let policy = self.started_ref()?.model_retry.clone();
                Ok(self.on_model_failure(now, &policy, *attempt, failure, *cost_micros))
            }
            Event::ModelAttemptProgress {
                turn,
                round,
                attempt,
                lease_attempt,
                usage,
                cost_micros,
                ..
            } => {
                // Presentation only: checked like a report (the attempt must be the one waited
                // for, and its lease not older than one that already recorded output), then
                // remembered for that check alone. No transcript change, no command.
                self.check_model_slot(seq, *turn, *round, *attempt)?;
                let latest = match &self.active {
                    Some(ActiveTurn {
                        phase: Phase::Model(slot),
                        ..
                    }) => slot.progress_lease_attempt,
                    _ => 0,
                };
                if *lease_attempt < latest {
                    return Err(self.stale(
                        seq,
                        format!(
                            "progress of lease {lease_attempt} is stale: lease {latest} of this attempt already recorded output"
                        ),
                    ));
                }
                let mut lost = None;
                if let Some(ActiveTurn {
                    phase: Phase::Model(slot),
                    ..
                }) = self.active.as_mut()
                {
                    if *lease_attempt > slot.progress_lease_attempt {
                        // A newer lease runs the attempt again: the older run was lost, and
                        // what its progress reported is all that is known of it.
                        lost = slot.progress_usage.take();
                    }
                    slot.progress_lease_attempt = *lease_attempt;
                    if usage.is_some() {
                        slot.progress_usage = usage.map(|u| (u, *cost_micros));
                    }
                }
                if let Some((usage, cost)) = lost {
                    self.count_attempt(&usage, cost);
                }
                Ok(Vec::new())
            }
            Event::ToolCallCompleted {
                turn,
                tool_use_id,
                attempt,
                content,
                is_error,
            } => {
                self.check_tool_slot(seq, *turn, tool_use_id, *attempt)?;
                let result = ToolResult {
                    tool_use_id: tool_use_id.clone(),
                    content: content.clone(),
                    is_error: *is_error,
                };
                Ok(self.on_tool_done(now, tool_use_id, result))
            }
            Event::ToolCallFailed {
                turn,
                tool_use_id,
                attempt,
                failure,
            } => {
                self.check_tool_slot(seq, *turn, tool_use_id, *attempt)?;
                let policy = self.started_ref()?.tool_retry.clone();
                let first_scheduled_ms = self.tool_first_scheduled(tool_use_id);
                match policy.decide(*attempt, failure, first_scheduled_ms, now) {
                    Ok(next_start) => {
                        let turn = *turn;
                        let name = self.set_tool_attempt(
                            tool_use_id,
                            attempt + 1,
                            next_start,
                            failure.heartbeat_details.clone(),
                        );
                        Ok(vec![Command::ScheduleToolCall {
                            turn,
                            tool_use_id: tool_use_id.clone(),
                            name,
                            attempt: attempt + 1,
                            not_before_ms: next_start,
                        }])
                    }
                    Err(why) => {
                        let result = ToolResult {
                            tool_use_id: tool_use_id.clone(),
                            content: ToolResultContent::Text(format!(
                                "tool failed {why}: {}: {}",
                                failure.class.as_str(),
                                failure.message
                            )),
                            is_error: true,
                        };
                        Ok(self.on_tool_done(now, tool_use_id, result))
                    }
                }
            }
            Event::ToolCallApproved { turn, tool_use_id } => {
                self.check_parked(seq, now, *turn, tool_use_id, false)?;
                let turn = *turn;
                let name = self.set_tool_attempt(tool_use_id, 1, now, None);
                Ok(vec![Command::ScheduleToolCall {
                    turn,
                    tool_use_id: tool_use_id.clone(),
                    name,
                    attempt: 1,
                    not_before_ms: now,
                }])
            }
            Event::ToolCallDenied {
                turn,
                tool_use_id,
                reason,
                by_deadline,
            } => {
                self.check_parked(seq, now, *turn, tool_use_id, *by_deadline)?;
                let result = ToolResult {
                    tool_use_id: tool_use_id.clone(),
                    content: ToolResultContent::Text(format!("the tool call was denied: {reason}")),
                    is_error: true,
                };
                Ok(self.on_tool_done(now, tool_use_id, result))
            }
            Event::TurnCancelled { turn, reason } => {
                match &self.active {
                    Some(active) if active.turn == *turn => {}
                    _ => return Err(self.invalid(seq, format!("turn {turn} is not running"))),
                }
                let totals = self.active.as_ref().map(|a| a.totals).unwrap_or_default();
                self.close_open_tool_uses(&format!("cancelled: {reason}"));
                self.last_outcome = Some(TurnOutcome::Cancelled {
                    turn: *turn,
                    reason: reason.clone(),
                    totals,
                });
                self.active = None;
                Ok(Vec::new())
            }
            Event::SessionCancelled { reason } => {
                if self.cancelled {
                    return Err(self.invalid(seq, "session already cancelled"));
                }
                if let Some(active) = &self.active {
                    let turn = active.turn;
                    let totals = active.totals;
                    self.close_open_tool_uses(&format!("cancelled: {reason}"));
                    self.last_outcome = Some(TurnOutcome::Cancelled {
                        turn,
                        reason: reason.clone(),
                        totals,
                    });
                    self.active = None;
                }
                self.cancelled = true;
                Ok(Vec::new())
            }
            Event::CompactionRequested {} => self.on_compaction_requested(seq),
            Event::SummaryCallCompleted {
                turn,
                attempt,
                summary,
                usage,
                cost_micros,
            } => {
                self.check_summary_slot(seq, *turn, *attempt)?;
                // Recorded since version 3 counts it; earlier versions leave it out, as they
                // did before it was recorded.
                let version = self.workflow_version();
                if let (Some(usage), 3..) = (usage, version) {
                    self.count_attempt(usage, *cost_micros);
                }
                Ok(self.on_summary(now, Some(summary)))
            }
            Event::SummaryCallFailed {
                turn,
                attempt,
                failure,
                cost_micros,
            } => {
                self.check_summary_slot(seq, *turn, *attempt)?;
                Ok(self.on_summary_failure(now, *attempt, failure, *cost_micros))
            }
            Event::ModelCallScheduled { .. }
            | Event::ToolCallScheduled { .. }
            | Event::ToolApprovalRequested { .. }
            | Event::TranscriptCompacted { .. }
            | Event::SummaryCallScheduled { .. }
            | Event::TurnCompleted { .. }
            | Event::TurnFailed { .. } => Err(self.invalid(seq, "command event as input")),
        }
    }

    fn started_ref(&self) -> Result<&SessionStarted> {
        self.started.as_ref().ok_or_else(|| Error::InvalidEvent {
            session_id: self.session_id.clone(),
            seq: self.next_seq,
            reason: "session not started".to_owned(),
        })
    }

    fn stale(&self, seq: u64, reason: impl Into<String>) -> Error {
        Error::StaleReport {
            session_id: self.session_id.clone(),
            seq,
            reason: reason.into(),
        }
    }

    /// Whether `turn` was started and has ended: every report for it is stale.
    fn turn_ended(&self, turn: u32) -> bool {
        turn >= 1
            && turn <= self.turns_started
            && self.active.as_ref().map(|a| a.turn) != Some(turn)
    }

    /// A report for a model call must name the attempt the workflow waits for. One for an
    /// attempt, round or turn already left behind is stale (a late worker); one for something
    /// that never existed is invalid (misuse).
    fn check_model_slot(&self, seq: u64, turn: u32, round: u32, attempt: u32) -> Result<()> {
        let what = || format!("model call of turn {turn} round {round} attempt {attempt}");
        if self.turn_ended(turn) {
            return Err(self.stale(seq, format!("{}: turn {turn} has ended", what())));
        }
        let Some(a) = self.active.as_ref().filter(|a| a.turn == turn) else {
            return Err(self.invalid(
                seq,
                format!("turn {turn} round {round} is not the active model call"),
            ));
        };
        if round < a.round {
            return Err(self.stale(seq, format!("{}: the turn is at round {}", what(), a.round)));
        }
        if round > a.round {
            return Err(self.invalid(
                seq,
                format!("turn {turn} round {round} is not the active model call"),
            ));
        }
        match &a.phase {
            Phase::Model(slot) if slot.attempt == attempt && slot.scheduled_seq.is_some() => Ok(()),
            Phase::Model(slot) if attempt < slot.attempt => Err(self.stale(
                seq,
                format!("{}: attempt {} superseded it", what(), slot.attempt),
            )),
            Phase::Model(_) | Phase::Summarizing(_) => {
                Err(self.invalid(seq, format!("no {} is waiting", what())))
            }
            Phase::Tools(_) | Phase::Ending => Err(self.stale(
                seq,
                format!(
                    "{}: the model call of this round was already answered",
                    what()
                ),
            )),
        }
    }

    /// An approval or denial must name a call of the running turn that is parked (and whose
    /// approval request is recorded); a denial by the deadline must come at or after it.
    fn check_parked(
        &self,
        seq: u64,
        now: u64,
        turn: u32,
        tool_use_id: &str,
        by_deadline: bool,
    ) -> Result<()> {
        let what = || format!("tool call {tool_use_id:?} of turn {turn}");
        let slot = match &self.active {
            Some(ActiveTurn {
                turn: running,
                phase: Phase::Tools(slots),
                ..
            }) if *running == turn => slots.iter().find(|s| s.tool_use.id == tool_use_id),
            _ => None,
        };
        match slot.map(|s| &s.state) {
            Some(ToolSlotState::AwaitingApproval {
                requested_seq: Some(_),
                deadline_ms,
            }) => match (by_deadline, deadline_ms) {
                (false, _) => Ok(()),
                (true, Some(deadline)) if now >= *deadline => Ok(()),
                (true, Some(deadline)) => Err(self.invalid(
                    seq,
                    format!(
                        "{}: its approval deadline at {deadline} ms has not passed",
                        what()
                    ),
                )),
                (true, None) => {
                    Err(self.invalid(seq, format!("{}: its approval has no deadline", what())))
                }
            },
            Some(ToolSlotState::Scheduled { .. } | ToolSlotState::Done(_)) => Err(self.invalid(
                seq,
                format!(
                    "{} does not wait for approval: it was already decided",
                    what()
                ),
            )),
            _ if self.tool_use_ids.contains(tool_use_id) => {
                Err(self.invalid(seq, format!("{} does not wait for approval", what())))
            }
            _ => Err(self.invalid(
                seq,
                format!("no tool call {tool_use_id:?} waits for approval in turn {turn}"),
            )),
        }
    }

    /// Like [`SessionState::check_model_slot`], for a tool call.
    fn check_tool_slot(&self, seq: u64, turn: u32, tool_use_id: &str, attempt: u32) -> Result<()> {
        let what = || format!("tool call {tool_use_id:?} of turn {turn} attempt {attempt}");
        if self.turn_ended(turn) {
            return Err(self.stale(seq, format!("{}: turn {turn} has ended", what())));
        }
        let not_waiting = || self.invalid(seq, format!("no {} is waiting", what()));
        let Some(a) = self.active.as_ref().filter(|a| a.turn == turn) else {
            return Err(not_waiting());
        };
        let slot = match &a.phase {
            Phase::Tools(slots) => slots.iter().find(|s| s.tool_use.id == tool_use_id),
            _ => None,
        };
        match slot.map(|s| &s.state) {
            Some(ToolSlotState::Scheduled {
                attempt: current,
                scheduled_seq,
                ..
            }) => {
                if *current == attempt && scheduled_seq.is_some() {
                    Ok(())
                } else if attempt < *current {
                    Err(self.stale(seq, format!("{}: attempt {current} superseded it", what())))
                } else {
                    Err(not_waiting())
                }
            }
            Some(ToolSlotState::Done(_)) => {
                Err(self.stale(seq, format!("{}: the call was already answered", what())))
            }
            Some(ToolSlotState::Unscheduled | ToolSlotState::AwaitingApproval { .. }) => {
                Err(not_waiting())
            }
            // A call of an earlier round of this turn was answered before that round ended.
            None if self.tool_use_ids.contains(tool_use_id) => {
                Err(self.stale(seq, format!("{}: the call was already answered", what())))
            }
            None => Err(not_waiting()),
        }
    }

    fn on_model_response(
        &mut self,
        now: u64,
        response: &ModelResponse,
        cost_micros: Option<u64>,
    ) -> Vec<Command> {
        self.count_attempt(&response.usage, cost_micros);
        let over_budget = self.over_budget(Check::AfterResult);
        let version = self.workflow_version();
        let mut memo = self.required_memo.as_deref_mut();
        let Some(active) = self.active.as_mut() else {
            return Vec::new();
        };
        if let Phase::Model(slot) = &mut active.phase {
            // The response's own usage supersedes what its run's progress reported.
            slot.progress_usage = None;
        }
        active.stop_reason = Some(response.stop_reason);
        Arc::make_mut(&mut self.transcript).push_response(response);
        for t in response.tool_uses() {
            self.tool_use_ids.insert(t.id.clone());
        }
        let turn = active.turn;
        let tool_uses: Vec<ToolUse> = response.tool_uses().cloned().collect();
        if tool_uses.is_empty() {
            if let Some(exceeded) = over_budget {
                active.phase = Phase::Ending;
                return vec![budget_failure(turn, exceeded)];
            }
            if response.stop_reason == StopReason::PauseTurn {
                return self.next_round(now);
            }
            let usage = active.usage;
            active.phase = Phase::Ending;
            return vec![Command::CompleteTurn { turn, usage }];
        }
        let max_rounds = self.started.as_ref().map_or(1, |s| s.limits.max_rounds);
        let tool_names: BTreeSet<&str> = self
            .started
            .as_ref()
            .map(|s| s.tools.iter().map(|t| t.name.as_str()).collect())
            .unwrap_or_default();
        let tools = self
            .started
            .as_ref()
            .map(|s| &s.tools[..])
            .unwrap_or_default();
        let over_limit = active.round + 1 >= max_rounds || over_budget.is_some();
        let mut commands = Vec::new();
        let mut slots = Vec::with_capacity(tool_uses.len());
        let policy = self.started.as_ref().and_then(|s| s.tool_policy.as_ref());
        for tool_use in tool_uses {
            let mut decision = PolicyDecision::Allow;
            let immediate_error = if !tool_names.contains(tool_use.name.as_str()) {
                Some(format!(
                    "unknown tool {:?}; available tools: {}",
                    tool_use.name,
                    tool_names.iter().copied().collect::<Vec<_>>().join(", ")
                ))
            } else {
                match serde_json::from_str::<serde_json::Value>(&tool_use.arguments) {
                    Err(e) => Some(format!("invalid tool arguments (not JSON): {e}")),
                    Ok(arguments) => {
                        let missing = if version < 2 {
                            None
                        } else {
                            missing_required(tools, memo.as_deref_mut(), &tool_use.name, &arguments)
                        };
                        // Only sessions that recorded a policy have one: the others allow
                        // every call, as before policies existed.
                        match (missing, policy) {
                            (Some(missing), _) => Some(missing),
                            (None, None) => None,
                            (None, Some(policy)) => {
                                let (decided, rule) = policy.decide(&tool_use.name, &arguments);
                                decision = decided;
                                (decided == PolicyDecision::Deny).then(|| {
                                    format!(
                                        "the tool call was denied by the session's policy ({})",
                                        match rule {
                                            Some(n) => format!("rule {n}"),
                                            None => "its default".to_owned(),
                                        }
                                    )
                                })
                            }
                        }
                    }
                }
            };
            let state = match immediate_error {
                Some(message) => ToolSlotState::Done(ToolResult {
                    tool_use_id: tool_use.id.clone(),
                    content: ToolResultContent::Text(message),
                    is_error: true,
                }),
                None if over_limit => ToolSlotState::Unscheduled,
                None if decision == PolicyDecision::Ask => {
                    let deadline_ms = policy
                        .and_then(|p| p.approval_timeout_ms)
                        .map(|timeout| now.saturating_add(timeout));
                    commands.push(Command::RequestToolApproval {
                        turn,
                        tool_use_id: tool_use.id.clone(),
                        name: tool_use.name.clone(),
                        deadline_ms,
                    });
                    ToolSlotState::AwaitingApproval {
                        requested_seq: None,
                        deadline_ms,
                    }
                }
                None => {
                    commands.push(Command::ScheduleToolCall {
                        turn,
                        tool_use_id: tool_use.id.clone(),
                        name: tool_use.name.clone(),
                        attempt: 1,
                        not_before_ms: now,
                    });
                    ToolSlotState::Scheduled {
                        attempt: 1,
                        scheduled_seq: None,
                        not_before_ms: now,
                        first_scheduled_ms: now,
                        heartbeat_details: None,
                    }
                }
            };
            slots.push(ToolSlot { tool_use, state });
        }
        active.phase = Phase::Tools(slots);
        if over_limit {
            // The unscheduled calls are closed with is_error results when TurnFailed applies.
            if let Some(exceeded) = over_budget {
                return vec![budget_failure(turn, exceeded)];
            }
            return vec![Command::FailTurn {
                turn,
                reason: format!("the model asked for tools after {max_rounds} rounds (max_rounds)"),
                budget_exceeded: None,
            }];
        }
        if commands.is_empty() {
            // Every call was answered at once (unknown tools, invalid arguments).
            return self.results_complete(now);
        }
        commands
    }

    fn on_model_failure(
        &mut self,
        now: u64,
        policy: &RetryPolicy,
        attempt: u32,
        failure: &ActivityFailure,
        cost_micros: Option<u64>,
    ) -> Vec<Command> {
        // What the attempt consumed: its own report, else what its run's progress last said
        // (a lapsed lease's failure knows nothing itself).
        let progress = match self.active.as_mut().map(|a| &mut a.phase) {
            Some(Phase::Model(slot)) => slot.progress_usage.take(),
            _ => None,
        };
        match (&failure.usage, progress) {
            (Some(usage), _) => self.count_attempt(usage, cost_micros),
            (None, Some((usage, cost))) => self.count_attempt(&usage, cost),
            (None, None) => {}
        }
        let over_budget = self.over_budget(Check::BeforeCall);
        let Some(active) = self.active.as_mut() else {
            return Vec::new();
        };
        let turn = active.turn;
        let first_scheduled_ms = match &active.phase {
            Phase::Model(slot) => slot.first_scheduled_ms,
            _ => now,
        };
        match policy.decide(attempt, failure, first_scheduled_ms, now) {
            Ok(_) if over_budget.is_some() => {
                active.phase = Phase::Ending;
                over_budget
                    .map(|exceeded| budget_failure(turn, exceeded))
                    .into_iter()
                    .collect()
            }
            Ok(next_start) => {
                active.phase = Phase::Model(ModelSlot {
                    attempt: attempt + 1,
                    scheduled_seq: None,
                    not_before_ms: next_start,
                    first_scheduled_ms,
                    heartbeat_details: failure.heartbeat_details.clone(),
                    progress_lease_attempt: 0,
                    progress_usage: None,
                });
                vec![Command::ScheduleModelCall {
                    turn,
                    round: active.round,
                    attempt: attempt + 1,
                    not_before_ms: next_start,
                }]
            }
            Err(why) => {
                active.phase = Phase::Ending;
                vec![Command::FailTurn {
                    turn,
                    reason: format!(
                        "model call failed {why}: {}: {}",
                        failure.class.as_str(),
                        failure.message
                    ),
                    budget_exceeded: None,
                }]
            }
        }
    }

    fn tool_first_scheduled(&self, tool_use_id: &str) -> u64 {
        if let Some(ActiveTurn {
            phase: Phase::Tools(slots),
            ..
        }) = self.active.as_ref()
        {
            for slot in slots {
                if let (
                    true,
                    ToolSlotState::Scheduled {
                        first_scheduled_ms, ..
                    },
                ) = (slot.tool_use.id == tool_use_id, &slot.state)
                {
                    return *first_scheduled_ms;
                }
            }
        }
        0
    }

    fn set_tool_attempt(
        &mut self,
        tool_use_id: &str,
        attempt: u32,
        not_before_ms: u64,
        heartbeat_details: Option<JsonText>,
    ) -> String {
        if let Some(ActiveTurn {
            phase: Phase::Tools(slots),
            ..
        }) = self.active.as_mut()
        {
            for slot in slots.iter_mut() {
                if slot.tool_use.id == tool_use_id {
                    let first_scheduled_ms = match slot.state {
                        ToolSlotState::Scheduled {
                            first_scheduled_ms, ..
                        } => first_scheduled_ms,
                        _ => not_before_ms,
                    };
                    slot.state = ToolSlotState::Scheduled {
                        attempt,
                        scheduled_seq: None,
                        not_before_ms,
                        first_scheduled_ms,
                        heartbeat_details,
                    };
                    return slot.tool_use.name.clone();
                }
            }
        }
        String::new()
    }

    fn on_tool_done(&mut self, now: u64, tool_use_id: &str, result: ToolResult) -> Vec<Command> {
        if let Some(ActiveTurn {
            phase: Phase::Tools(slots),
            ..
        }) = self.active.as_mut()
        {
            for slot in slots.iter_mut() {
                if slot.tool_use.id == tool_use_id {
                    slot.state = ToolSlotState::Done(result);
                    break;
                }
            }
            if slots
                .iter()
                .all(|s| matches!(s.state, ToolSlotState::Done(_)))
            {
                return self.results_complete(now);
            }
        }
        Vec::new()
    }

    /// All results are in: the tool_result message (declaration order), then the next round.
    fn results_complete(&mut self, now: u64) -> Vec<Command> {
        let Some(active) = self.active.as_mut() else {
            return Vec::new();
        };
        if let Phase::Tools(slots) = std::mem::replace(&mut active.phase, Phase::Ending) {
            let results = slots.into_iter().filter_map(|s| match s.state {
                ToolSlotState::Done(r) => Some(r),
                _ => None,
            });
            Arc::make_mut(&mut self.transcript).push_tool_results(results);
        }
        self.next_round(now)
    }

    fn next_round(&mut self, now: u64) -> Vec<Command> {
        let max_rounds = self.started.as_ref().map_or(1, |s| s.limits.max_rounds);
        let over_budget = self.over_budget(Check::BeforeCall);
        let Some(active) = self.active.as_mut() else {
            return Vec::new();
        };
        let turn = active.turn;
        if active.round + 1 >= max_rounds {
            active.phase = Phase::Ending;
            return vec![Command::FailTurn {
                turn,
                reason: format!("the turn needs more than {max_rounds} model calls (max_rounds)"),
                budget_exceeded: None,
            }];
        }
        if let Some(exceeded) = over_budget {
            active.phase = Phase::Ending;
            return vec![budget_failure(turn, exceeded)];
        }
        active.round += 1;
        active.phase = Phase::Model(ModelSlot {
            attempt: 1,
            scheduled_seq: None,
            not_before_ms: now,
            first_scheduled_ms: now,
            heartbeat_details: None,
            progress_lease_attempt: 0,
            progress_usage: None,
        });
        vec![Command::ScheduleModelCall {
            turn,
            round: active.round,
            attempt: 1,
            not_before_ms: now,
        }]
    }

    /// Counts one model attempt's recorded usage and cost in the turn's and the session's
    /// totals. Only recorded numbers: no price is looked up here.
    fn count_attempt(&mut self, usage: &Usage, cost_micros: Option<u64>) {
        if let Some(active) = self.active.as_mut() {
            active.usage.add(usage);
            active.totals.add_attempt(usage, cost_micros);
        }
        self.usage.add(usage);
        self.totals.add_attempt(usage, cost_micros);
    }

    /// The budget of the running turn or of the session its totals break at this check.
    fn over_budget(&self, when: Check) -> Option<BudgetExceeded> {
        let limits = &self.started.as_ref()?.limits;
        let active = self.active.as_ref()?;
        crate::budget::check(
            &limits.turn_budget,
            &active.totals,
            &limits.session_budget,
            &self.totals,
            when,
        )
    }

    /// The turn's failure when it is over budget at this check, its phase set to ending.
    fn fail_over_budget(&mut self, when: Check) -> Option<Command> {
        let exceeded = self.over_budget(when)?;
        let active = self.active.as_mut()?;
        active.phase = Phase::Ending;
        Some(budget_failure(active.turn, exceeded))
    }

    /// Answers every unanswered tool_use of the active round so the transcript stays valid.
    fn close_open_tool_uses(&mut self, why: &str) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        if let Phase::Tools(slots) = std::mem::replace(&mut active.phase, Phase::Ending) {
            let results: Vec<ToolResult> = slots
                .into_iter()
                .map(|s| match s.state {
                    ToolSlotState::Done(r) => r,
                    _ => ToolResult {
                        tool_use_id: s.tool_use.id,
                        content: ToolResultContent::Text(why.to_owned()),
                        is_error: true,
                    },
                })
                .collect();
            Arc::make_mut(&mut self.transcript).push_tool_results(results);
        }
    }
}

/// The command that fails `turn` for going over a budget.
fn budget_failure(turn: u32, exceeded: BudgetExceeded) -> Command {
    Command::FailTurn {
        turn,
        reason: exceeded.reason(),
        budget_exceeded: Some(exceeded),
    }
}

/// The names a tool's `input_schema` requires: the strings of its `required` array, none when
/// it has no such array (or is not an object); `None` when the schema is not JSON. Replay runs
/// this for every tool call of a history, so the common schema (an object naming `required`
/// once) is read without building the rest of it (a whole schema parsed into a `Value` was a
/// quarter of a long history's fold); any other (`required` twice, where the parsed object
/// keeps the last) is parsed whole, as before.
pub(crate) fn required_fields(schema: &cairn_ledger::JsonText) -> Option<Vec<String>> {
    /// An object's `required` member; every other member skipped unread.
    #[derive(serde::Deserialize)]
    struct RequiredMember {
        #[serde(default)]
        required: serde_json::Value,
    }
    let strings = |required: &serde_json::Value| -> Vec<String> {
        required
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    if let Ok(member) = serde_json::from_str::<RequiredMember>(schema.as_str()) {
        return Some(strings(&member.required));
    }
    let schema = schema.to_value().ok()?;
    Some(schema.get("required").map(strings).unwrap_or_default())
}

/// Version 2's check of a tool call's arguments against its tool's `input_schema`: the
/// arguments must be an object holding every field the schema's `required` names. The
/// error result's text when they do not.
fn missing_required(
    tools: &[cairn_ledger::ToolSpec],
    memo: Option<&mut RequiredMemo>,
    name: &str,
    arguments: &serde_json::Value,
) -> Option<String> {
    let index = tools.iter().position(|t| t.name == name)?;
    let schema = &tools[index].input_schema;
    match memo {
        Some(memo) => {
            let required = memo
                .by_tool
                .entry(index)
                .or_insert_with(|| required_fields(schema))
                .as_deref()?;
            missing_of(name, required, arguments)
        }
        None if schema.as_str().len() > RECENT_REQUIRED_SCHEMA_BYTES => {
            missing_of(name, &required_fields(schema)?, arguments)
        }
        None => RECENT_REQUIRED.with(|recent| {
            let mut recent = recent.borrow_mut();
            missing_of(name, recent.required(schema)?, arguments)
        }),
    }
}

/// The most schemas [`RecentRequired`] keeps: more than the tools a session's model calls
/// in turn, so that a session offering many tools (an MCP server's) does not evict its own
/// schemas call after call. A lookup compares lengths first, so a miss costs little.
pub(crate) const RECENT_REQUIRED_SCHEMAS: usize = 32;
/// The largest schema [`RecentRequired`] keeps, in bytes of text.
const RECENT_REQUIRED_SCHEMA_BYTES: usize = 16 << 10;

thread_local! {
    /// The required fields of the tool schemas this thread read last, outside a fold.
    static RECENT_REQUIRED: std::cell::RefCell<RecentRequired> = const {
        std::cell::RefCell::new(RecentRequired { schemas: Vec::new(), next: 0 })
    };
}

/// The required fields of the last few tool schemas read, by their text. A live session's
/// state keeps no [`RequiredMemo`] (a parked state stays small), so without it every tool
/// call read its tool's schema again, and a fresh session per task always did; the same few
/// schemas come back across sessions, and comparing a schema's text is far cheaper than
/// reading it. What it gives is what [`required_fields`] gives: only the time changes.
pub(crate) struct RecentRequired {
    schemas: Vec<(String, Option<Vec<String>>)>,
    /// The entry the next new schema replaces once full.
    next: usize,
}

impl RecentRequired {
    /// None kept yet.
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        RecentRequired {
            schemas: Vec::new(),
            next: 0,
        }
    }

    /// How many schemas it keeps.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        self.schemas.len()
    }

    /// [`required_fields`] of `schema`, kept for next time (the caller reads a schema larger
    /// than [`RECENT_REQUIRED_SCHEMA_BYTES`] itself, so none is kept).
    pub(crate) fn required(&mut self, schema: &cairn_ledger::JsonText) -> Option<&[String]> {
        let text = schema.as_str();
        let at = match self.schemas.iter().position(|(kept, _)| kept == text) {
            Some(at) => at,
            None if self.schemas.len() < RECENT_REQUIRED_SCHEMAS => {
                self.schemas
                    .push((text.to_owned(), required_fields(schema)));
                self.schemas.len() - 1
            }
            None => {
                let at = self.next;
                self.next = (at + 1) % RECENT_REQUIRED_SCHEMAS;
                self.schemas[at] = (text.to_owned(), required_fields(schema));
                at
            }
        };
        self.schemas[at].1.as_deref()
    }
}

/// The error result's text when `arguments` lack a field of `required` (see
/// [`missing_required`]).
fn missing_of(name: &str, required: &[String], arguments: &serde_json::Value) -> Option<String> {
    let Some(object) = arguments.as_object() else {
        return Some(format!(
            "invalid tool arguments: {name} takes a JSON object (requires: {})",
            required.join(", ")
        ));
    };
    let missing: Vec<String> = required
        .iter()
        .filter(|field| !object.contains_key(field.as_str()))
        .map(|field| format!("{field:?}"))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "invalid tool arguments: missing required argument{} {} ({name} requires: {})",
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", "),
            required.join(", ")
        )
    })
}
