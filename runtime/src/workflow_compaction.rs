//! The workflow's compaction rules, hooked into `workflow.rs`: when a transcript is compacted
//! (before a model call over the policy's threshold, after a context-too-long answer, on
//! request), what the recorded `transcript_compacted` carries, and how the fold applies it.
//!
//! Compaction itself needed no new workflow version: a session compacts only when its history
//! records a compaction policy or a `compaction_requested`, which no history did before
//! compaction existed, and the `context_too_long` failure class is new too — so every older
//! history decides, replays and resumes exactly as before. Changes to its rules since are
//! behind the session's version ([`SessionState::compaction_rules`]).
//!
//! With `summarize`, a compaction that cuts turns first runs a summary call (`Phase::Summarizing`,
//! a model task over `cairn_ledger::summary_request`); its text goes in front of the first kept
//! message, and the model call the compaction precedes is scheduled after it. A summary call
//! that fails is retried under the model retry policy; when it fails for good (or the summary
//! request is itself too long), the compaction goes on without a summary, so the turn never
//! fails for want of one. A context-too-long failure is never retried as it is (the same
//! request fails the same way): with a policy it is compacted and retried once per shrink;
//! when compaction cannot shrink the transcript any further, or without a policy, the turn
//! fails with a reason that says so. Compaction strategies are idempotent, so the retry loop
//! ends: a second context-too-long answer finds nothing left to compact and fails the turn.

use super::{ActiveTurn, Command, ModelSlot, Phase, SessionState};
use crate::compaction::{CompactionPolicy, CompactionTrigger};
use crate::error::Result;
use crate::event::{ActivityFailure, ErrorClass, Event};
use cairn_ledger::{
    compact, estimate_tokens, CompactionPlan, CompactionRules, CompactionStrategy, Transcript,
};
use std::sync::Arc;

/// Decides the compaction `trigger` calls for under `policy`: strategies are tried in the
/// policy's order and kept only when they change the transcript; a threshold compaction stops
/// as soon as the estimate is at or under the threshold. `None` when nothing would change.
fn decide(
    transcript: &Transcript,
    policy: &CompactionPolicy,
    rules: CompactionRules,
    trigger: CompactionTrigger,
    turn: u32,
) -> Option<Command> {
    let estimate_before = estimate_tokens(transcript);
    let mut plan = CompactionPlan {
        strategies: Vec::new(),
        keep_last_turns: policy.keep_last_turns,
        summary: None,
        rules,
    };
    let mut current = transcript.clone();
    let mut cut = None;
    for strategy in &policy.strategies {
        if trigger == CompactionTrigger::Threshold
            && policy
                .threshold_tokens
                .is_some_and(|limit| estimate_tokens(&current) <= limit)
        {
            break;
        }
        let mut tried = plan.clone();
        tried.strategies.push(*strategy);
        let out = compact(transcript, &tried);
        if out.transcript != current {
            plan = tried;
            current = out.transcript;
            cut = out.cut;
        }
    }
    if plan.strategies.is_empty() {
        return None;
    }
    let keeps = plan.strategies.contains(&CompactionStrategy::KeepLastTurns);
    Some(Command::CompactTranscript {
        turn,
        trigger,
        strategies: plan.strategies,
        keep_last_turns: keeps.then_some(plan.keep_last_turns),
        cut: cut.map(|c| c as u64),
        estimate_before,
        estimate_after: estimate_tokens(&current),
        summary: None,
    })
}

/// A summary call in progress, and what follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummarySlot {
    /// Current attempt.
    pub attempt: u32,
    /// Seq of the `SummaryCallScheduled` event, once recorded; the task is keyed by it.
    pub scheduled_seq: Option<u64>,
    /// When the current attempt is due.
    pub not_before_ms: u64,
    /// When the first attempt was scheduled.
    pub first_scheduled_ms: u64,
    /// The compaction decided (a `CompactTranscript`), applied with the summary.
    pub compaction: Command,
    /// The model call scheduled after the compaction.
    pub then: ModelSlot,
}

impl SummarySlot {
    /// The turns the compaction keeps.
    pub fn keep_last_turns(&self) -> u32 {
        match &self.compaction {
            Command::CompactTranscript {
                keep_last_turns, ..
            } => keep_last_turns.unwrap_or(1),
            _ => 1,
        }
    }
}

/// Whether a compaction cuts turns, so a summary of them can be made.
fn cuts(command: &Command) -> bool {
    matches!(command, Command::CompactTranscript { cut: Some(_), .. })
}

impl SessionState {
    fn compaction_policy(&self) -> Option<&CompactionPolicy> {
        self.started.as_ref().and_then(|s| s.compaction.as_ref())
    }

    /// The threshold rule: when an input's commands schedule a model call and the transcript
    /// is estimated over the policy's threshold, a compaction goes first. Decides only; the
    /// compaction changes the transcript when its event is applied, before the model call's.
    pub(super) fn compact_before_model_call(&mut self, mut commands: Vec<Command>) -> Vec<Command> {
        let Some(policy) = self.compaction_policy() else {
            return commands;
        };
        let Some(threshold) = policy.threshold_tokens else {
            return commands;
        };
        let Some(at) = commands
            .iter()
            .position(|c| matches!(c, Command::ScheduleModelCall { .. }))
        else {
            return commands;
        };
        if commands
            .iter()
            .any(|c| matches!(c, Command::CompactTranscript { .. }))
            || estimate_tokens(&self.transcript) <= threshold
        {
            return commands;
        }
        let turn = self.active.as_ref().map_or(self.turns_started, |a| a.turn);
        let summarize = policy.summarize;
        let rules = self.compaction_rules();
        if let Some(compaction) = decide(
            &self.transcript,
            policy,
            rules,
            CompactionTrigger::Threshold,
            turn,
        ) {
            if summarize && cuts(&compaction) {
                if let Some(summary) = self.start_summary(compaction) {
                    commands[at] = summary;
                }
                return commands;
            }
            commands.insert(at, compaction);
        }
        commands
    }

    /// Parks the model call the active turn is about to make behind a summary call; the
    /// command that schedules it, or `None` when the turn is not at a model call.
    fn start_summary(&mut self, compaction: Command) -> Option<Command> {
        let active = self.active.as_mut()?;
        let Phase::Model(then) = &active.phase else {
            return None;
        };
        let then = then.clone();
        let not_before_ms = then.not_before_ms;
        let turn = active.turn;
        active.phase = Phase::Summarizing(SummarySlot {
            attempt: 1,
            scheduled_seq: None,
            not_before_ms,
            first_scheduled_ms: not_before_ms,
            compaction,
            then,
        });
        Some(Command::ScheduleSummary {
            turn,
            attempt: 1,
            not_before_ms,
        })
    }

    /// Records the seq of a recorded `summary_call_scheduled` (its task is keyed by it).
    pub(super) fn summary_scheduled(&mut self, seq: u64) {
        if let Some(ActiveTurn {
            phase: Phase::Summarizing(slot),
            ..
        }) = self.active.as_mut()
        {
            slot.scheduled_seq = Some(seq);
        }
    }

    /// A summary report must name the attempt the workflow waits for; like a model report,
    /// one left behind is stale and one that never existed is invalid.
    pub(super) fn check_summary_slot(&self, seq: u64, turn: u32, attempt: u32) -> Result<()> {
        let what = format!("summary call of turn {turn} attempt {attempt}");
        if self.turn_ended(turn) {
            return Err(self.stale(seq, format!("{what}: turn {turn} has ended")));
        }
        match &self.active {
            Some(ActiveTurn {
                turn: running,
                phase: Phase::Summarizing(slot),
                ..
            }) if *running == turn => {
                if slot.attempt == attempt && slot.scheduled_seq.is_some() {
                    Ok(())
                } else if attempt < slot.attempt {
                    Err(self.stale(
                        seq,
                        format!("{what}: attempt {} superseded it", slot.attempt),
                    ))
                } else {
                    Err(self.invalid(seq, format!("no {what} is waiting")))
                }
            }
            // A summary of the running turn given up or answered already (a late worker).
            Some(ActiveTurn { turn: running, .. }) if *running == turn => Err(self.stale(
                seq,
                format!("{what}: the turn no longer waits for a summary"),
            )),
            _ => Err(self.invalid(seq, format!("no {what} is waiting"))),
        }
    }

    /// The summary is in (or will not come): the compaction with it, then the model call.
    pub(super) fn on_summary(&mut self, now: u64, summary: Option<&String>) -> Vec<Command> {
        let rules = self.compaction_rules();
        let Some(active) = self.active.as_mut() else {
            return Vec::new();
        };
        let Phase::Summarizing(slot) = std::mem::replace(&mut active.phase, Phase::Ending) else {
            return Vec::new();
        };
        let mut compaction = slot.compaction;
        if let Command::CompactTranscript {
            strategies,
            keep_last_turns,
            estimate_after,
            summary: recorded,
            ..
        } = &mut compaction
        {
            *recorded = summary.filter(|s| !s.trim().is_empty()).cloned();
            let plan = CompactionPlan {
                strategies: strategies.clone(),
                keep_last_turns: keep_last_turns.unwrap_or(1),
                summary: recorded.clone(),
                rules,
            };
            *estimate_after = estimate_tokens(&compact(&self.transcript, &plan).transcript);
        }
        let mut then = slot.then;
        then.not_before_ms = then.not_before_ms.max(now);
        let call = Command::ScheduleModelCall {
            turn: active.turn,
            round: active.round,
            attempt: then.attempt,
            not_before_ms: then.not_before_ms,
        };
        active.phase = Phase::Model(then);
        vec![compaction, call]
    }

    /// A failed summary attempt: retried under the model retry policy, else the compaction
    /// goes on without a summary.
    pub(super) fn on_summary_failure(
        &mut self,
        now: u64,
        attempt: u32,
        failure: &ActivityFailure,
        cost_micros: Option<u64>,
    ) -> Vec<Command> {
        let policy = self.started.as_ref().map(|s| s.model_retry.clone());
        if self.active.is_none() {
            return Vec::new();
        }
        if let Some(usage) = &failure.usage {
            self.count_attempt_of_compaction(usage, cost_micros);
        }
        let Some(active) = self.active.as_mut() else {
            return Vec::new();
        };
        let turn = active.turn;
        let Phase::Summarizing(slot) = &mut active.phase else {
            return Vec::new();
        };
        let retry = match (&policy, failure.class) {
            // The same request fails the same way.
            (_, ErrorClass::ContextTooLong) | (None, _) => None,
            (Some(policy), _) => policy
                .decide(attempt, failure, slot.first_scheduled_ms, now)
                .ok(),
        };
        match retry {
            Some(next_start) => {
                slot.attempt = attempt + 1;
                slot.scheduled_seq = None;
                slot.not_before_ms = next_start;
                vec![Command::ScheduleSummary {
                    turn,
                    attempt: attempt + 1,
                    not_before_ms: next_start,
                }]
            }
            None => self.on_summary(now, None),
        }
    }

    /// The context-too-long rule (see the module doc): compact and retry the call at once as
    /// the next attempt, or fail the turn saying why.
    pub(super) fn on_context_too_long(
        &mut self,
        now: u64,
        attempt: u32,
        failure: &ActivityFailure,
        cost_micros: Option<u64>,
    ) -> Vec<Command> {
        let summarize = self.compaction_policy().is_some_and(|p| p.summarize);
        let rules = self.compaction_rules();
        let compaction = self.compaction_policy().map(|policy| {
            let turn = self.active.as_ref().map_or(self.turns_started, |a| a.turn);
            decide(
                &self.transcript,
                policy,
                rules,
                CompactionTrigger::ContextTooLong,
                turn,
            )
        });
        let estimate = estimate_tokens(&self.transcript);
        if self.active.is_none() {
            return Vec::new();
        }
        if let Some(usage) = &failure.usage {
            self.count_attempt_of_compaction(usage, cost_micros);
        }
        let Some(active) = self.active.as_mut() else {
            return Vec::new();
        };
        let turn = active.turn;
        let reason = match compaction {
            Some(Some(compaction)) => {
                let first_scheduled_ms = match &active.phase {
                    Phase::Model(slot) => slot.first_scheduled_ms,
                    _ => now,
                };
                active.phase = Phase::Model(ModelSlot::retry(
                    attempt,
                    now,
                    first_scheduled_ms,
                    failure.heartbeat_details.clone(),
                ));
                if summarize && cuts(&compaction) {
                    return self.start_summary(compaction).into_iter().collect();
                }
                return vec![
                    compaction,
                    Command::ScheduleModelCall {
                        turn,
                        round: active.round,
                        attempt: attempt + 1,
                        not_before_ms: now,
                    },
                ];
            }
            Some(None) => format!(
                "the model's context window is exceeded and compaction cannot shrink the \
                 transcript any further (estimated {estimate} tokens): {}",
                failure.message
            ),
            None => format!(
                "model call failed: context_too_long: {} (the session has no compaction policy)",
                failure.message
            ),
        };
        active.phase = Phase::Ending;
        vec![Command::FailTurn {
            turn,
            reason,
            budget_exceeded: None,
        }]
    }

    /// `compaction_requested`: between turns only; compacts with the session's policy, or
    /// the default one when it has none. No command when nothing would change.
    pub(super) fn on_compaction_requested(&self, seq: u64) -> Result<Vec<Command>> {
        if self.cancelled {
            return Err(self.invalid(seq, "session is cancelled"));
        }
        if let Some(ActiveTurn { turn, .. }) = &self.active {
            return Err(self.invalid(
                seq,
                format!("turn {turn} is running: compaction on request runs between turns"),
            ));
        }
        let default = CompactionPolicy::default();
        let policy = self.compaction_policy().unwrap_or(&default);
        Ok(decide(
            &self.transcript,
            policy,
            self.compaction_rules(),
            CompactionTrigger::Requested,
            self.turns_started,
        )
        .into_iter()
        .collect())
    }

    /// Counts the usage of a failed summary call, or of an attempt that failed as too long for
    /// the context: version 3 counts it in the budget totals as every other attempt's, with
    /// its cost; before, it went to the usage sums alone, and budgets did not see it. (A
    /// completed summary's usage, recorded since version 3, counts from version 3 on.)
    fn count_attempt_of_compaction(
        &mut self,
        usage: &cairn_ledger::Usage,
        cost_micros: Option<u64>,
    ) {
        if self.workflow_version() >= 3 {
            self.count_attempt(usage, cost_micros);
            return;
        }
        if let Some(active) = self.active.as_mut() {
            active.usage.add(usage);
        }
        self.usage.add(usage);
    }

    /// The compaction rules of this session's workflow version: version 3 keeps the
    /// reasoning of a call set a turn ended on (see [`CompactionRules`]).
    pub(super) fn compaction_rules(&self) -> CompactionRules {
        match self.workflow_version() {
            ..=2 => CompactionRules::First,
            _ => CompactionRules::KeepLastCallsReasoning,
        }
    }

    /// Applies a recorded `transcript_compacted` (already checked against the decided
    /// command) at `seq`: the ledger's `compact` over the current transcript with its
    /// parameters, a new lineage of the transcript.
    pub(super) fn apply_compaction(&mut self, seq: u64, event: &Event) {
        if let Event::TranscriptCompacted {
            strategies,
            keep_last_turns,
            summary,
            ..
        } = event
        {
            let plan = CompactionPlan {
                strategies: strategies.clone(),
                keep_last_turns: keep_last_turns.unwrap_or(1),
                summary: summary.clone(),
                rules: self.compaction_rules(),
            };
            self.transcript = Arc::new(compact(&self.transcript, &plan).transcript);
            self.transcript_lineage = seq;
        }
    }
}
