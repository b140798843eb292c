//! How each input event moves a session, hooked into the fold in `workflow.rs`: the checks a
//! report must pass (stale or invalid when it fails them), and the handlers that advance the
//! turn and decide its commands (retries, tool rounds, budgets, the turn's end).

use super::required::missing_required;
use super::{
    ActiveTurn, Command, ModelSlot, Phase, SessionState, ToolSlot, ToolSlotState, TurnOutcome,
    WORKFLOW_VERSION,
};
use crate::budget::{BudgetExceeded, Check, UsageTotals};
use crate::error::{Error, Result};
use crate::event::{ActivityFailure, ErrorClass, Event, RetryPolicy, SessionStarted};
use crate::idempotency::{idempotency_key_problem, message_fingerprint, KeyedMessage};
use crate::policy::PolicyDecision;
use cairn_ledger::{
    validate_recorded_response, JsonText, ModelResponse, StopReason, ToolResult, ToolResultContent,
    ToolUse, Usage,
};
use std::collections::BTreeSet;
use std::sync::Arc;

impl SessionState {
    pub(super) fn apply_input(
        &mut self,
        seq: u64,
        now: u64,
        event: &Event,
    ) -> Result<Vec<Command>> {
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
                    phase: Phase::Model(ModelSlot::first_attempt(now)),
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

    pub(super) fn stale(&self, seq: u64, reason: impl Into<String>) -> Error {
        Error::StaleReport {
            session_id: self.session_id.clone(),
            seq,
            reason: reason.into(),
        }
    }

    /// Whether `turn` was started and has ended: every report for it is stale.
    pub(super) fn turn_ended(&self, turn: u32) -> bool {
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
                active.phase = Phase::Model(ModelSlot::retry(
                    attempt,
                    next_start,
                    first_scheduled_ms,
                    failure.heartbeat_details.clone(),
                ));
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
        active.phase = Phase::Model(ModelSlot::first_attempt(now));
        vec![Command::ScheduleModelCall {
            turn,
            round: active.round,
            attempt: 1,
            not_before_ms: now,
        }]
    }

    /// Counts one model attempt's recorded usage and cost in the turn's and the session's
    /// totals. Only recorded numbers: no price is looked up here.
    pub(super) fn count_attempt(&mut self, usage: &Usage, cost_micros: Option<u64>) {
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
    pub(super) fn close_open_tool_uses(&mut self, why: &str) {
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
