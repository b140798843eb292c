//! What a session's folded state says, read only, for the engine and tools: the rules' version
//! it keeps, the activity a task runs, what the running turn waits for (tasks, approvals, their
//! timers), and the message sent under an idempotency key.

use super::{
    ActiveTurn, Command, PendingApproval, Phase, ScheduledActivity, SessionState, ToolSlotState,
};
use crate::idempotency::KeyedMessage;
use crate::store::NewTask;
use cairn_ledger::CallOptions;

impl SessionState {
    /// The message sent under idempotency key `key`, if one was: the turn it started and its
    /// fingerprint ([`crate::idempotency`]).
    pub fn keyed_message(&self, key: &str) -> Option<KeyedMessage> {
        self.message_keys.get(key).copied()
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
}
