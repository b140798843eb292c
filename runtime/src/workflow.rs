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

use crate::budget::{BudgetExceeded, UsageTotals};
use crate::compaction::CompactionTrigger;
use crate::error::{Error, Result};
use crate::event::{Event, EventEnvelope, SessionStarted};
use crate::idempotency::KeyedMessage;
use crate::store::{NewTask, TaskId, TaskKind};
use cairn_ledger::{
    validate_response, CallOptions, CompactionStrategy, JsonText, ModelSpec, Part, StopReason,
    ToolChoice, ToolResult, ToolUse, Transcript, Usage,
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

#[path = "workflow_inputs.rs"]
mod inputs;
#[path = "workflow_queries.rs"]
mod queries;
#[path = "workflow_required.rs"]
mod required;
use required::RequiredMemo;
#[cfg(test)]
pub(crate) use required::{required_fields, RecentRequired, RECENT_REQUIRED_SCHEMAS};

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

impl ModelSlot {
    /// A round's first attempt, due at `now_ms` and not yet scheduled.
    pub fn first_attempt(now_ms: u64) -> Self {
        ModelSlot {
            attempt: 1,
            scheduled_seq: None,
            not_before_ms: now_ms,
            first_scheduled_ms: now_ms,
            heartbeat_details: None,
            progress_lease_attempt: 0,
            progress_usage: None,
        }
    }

    /// The attempt after `attempt` failed: due at `not_before_ms`, its deadline still counted
    /// from `first_scheduled_ms`, with the progress the failed attempt heartbeated last.
    pub fn retry(
        attempt: u32,
        not_before_ms: u64,
        first_scheduled_ms: u64,
        heartbeat_details: Option<JsonText>,
    ) -> Self {
        ModelSlot {
            attempt: attempt + 1,
            scheduled_seq: None,
            not_before_ms,
            first_scheduled_ms,
            heartbeat_details,
            progress_lease_attempt: 0,
            progress_usage: None,
        }
    }
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
    /// The seq of the event that last rebuilt the transcript (a compaction); 0 while it was
    /// only ever added to. Between two reads of one lineage the transcript only grew at its
    /// end (`Transcript`'s `push_*`), so a worker that keeps an earlier one is sent only the
    /// messages after it ([`ActivityInput::Model`](crate::ActivityInput::Model)'s
    /// `transcript_lineage`). It depends on the history alone, so every engine folding it
    /// agrees.
    pub transcript_lineage: u64,
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

impl SessionState {
    /// The state of a session with no events.
    pub fn new(session_id: impl Into<String>) -> Self {
        SessionState {
            session_id: session_id.into(),
            next_seq: 1,
            started: None,
            transcript: Arc::default(),
            transcript_lineage: 0,
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
            self.apply_compaction(seq, event);
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
}
