//! The workflow's compaction rules, hooked into `workflow.rs`: when a transcript is compacted
//! (before a model call over the policy's threshold, after a context-too-long answer, on
//! request), what the recorded `transcript_compacted` carries, and how the fold applies it.
//!
//! No new workflow version: a session compacts only when its history records a compaction
//! policy or a `compaction_requested`, which no history did before compaction existed, and the
//! `context_too_long` failure class is new too — so every older history decides, replays and
//! resumes exactly as before. A context-too-long failure is never retried as it is (the same
//! request fails the same way): with a policy it is compacted and retried once per shrink;
//! when compaction cannot shrink the transcript any further, or without a policy, the turn
//! fails with a reason that says so. Compaction strategies are idempotent, so the retry loop
//! ends: a second context-too-long answer finds nothing left to compact and fails the turn.

use super::{ActiveTurn, Command, ModelSlot, Phase, SessionState};
use crate::compaction::{CompactionPolicy, CompactionTrigger};
use crate::error::Result;
use crate::event::{ActivityFailure, Event};
use cairn_ledger::{compact, estimate_tokens, CompactionPlan, CompactionStrategy, Transcript};

/// Decides the compaction `trigger` calls for under `policy`: strategies are tried in the
/// policy's order and kept only when they change the transcript; a threshold compaction stops
/// as soon as the estimate is at or under the threshold. `None` when nothing would change.
fn decide(
    transcript: &Transcript,
    policy: &CompactionPolicy,
    trigger: CompactionTrigger,
    turn: u32,
) -> Option<Command> {
    let estimate_before = estimate_tokens(transcript);
    let mut plan = CompactionPlan {
        strategies: Vec::new(),
        keep_last_turns: policy.keep_last_turns,
        summary: None,
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
    })
}

impl SessionState {
    fn compaction_policy(&self) -> Option<&CompactionPolicy> {
        self.started.as_ref().and_then(|s| s.compaction.as_ref())
    }

    /// The threshold rule: when an input's commands schedule a model call and the transcript
    /// is estimated over the policy's threshold, a compaction goes first. Decides only; the
    /// compaction changes the transcript when its event is applied, before the model call's.
    pub(super) fn compact_before_model_call(&self, mut commands: Vec<Command>) -> Vec<Command> {
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
        if let Some(compaction) =
            decide(&self.transcript, policy, CompactionTrigger::Threshold, turn)
        {
            commands.insert(at, compaction);
        }
        commands
    }

    /// The context-too-long rule (see the module doc): compact and retry the call at once as
    /// the next attempt, or fail the turn saying why.
    pub(super) fn on_context_too_long(
        &mut self,
        now: u64,
        attempt: u32,
        failure: &ActivityFailure,
    ) -> Vec<Command> {
        let compaction = self.compaction_policy().map(|policy| {
            let turn = self.active.as_ref().map_or(self.turns_started, |a| a.turn);
            decide(
                &self.transcript,
                policy,
                CompactionTrigger::ContextTooLong,
                turn,
            )
        });
        let estimate = estimate_tokens(&self.transcript);
        let Some(active) = self.active.as_mut() else {
            return Vec::new();
        };
        if let Some(usage) = &failure.usage {
            active.usage.add(usage);
            self.usage.add(usage);
        }
        let turn = active.turn;
        let reason = match compaction {
            Some(Some(compaction)) => {
                let first_scheduled_ms = match &active.phase {
                    Phase::Model(slot) => slot.first_scheduled_ms,
                    _ => now,
                };
                active.phase = Phase::Model(ModelSlot {
                    attempt: attempt + 1,
                    scheduled_seq: None,
                    not_before_ms: now,
                    first_scheduled_ms,
                    heartbeat_details: failure.heartbeat_details.clone(),
                    progress_lease_attempt: 0,
                });
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
        vec![Command::FailTurn { turn, reason }]
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
            CompactionTrigger::Requested,
            self.turns_started,
        )
        .into_iter()
        .collect())
    }

    /// Applies a recorded `transcript_compacted` (already checked against the decided
    /// command): the ledger's `compact` over the current transcript with its parameters.
    pub(super) fn apply_compaction(&mut self, event: &Event) {
        if let Event::TranscriptCompacted {
            strategies,
            keep_last_turns,
            ..
        } = event
        {
            let plan = CompactionPlan {
                strategies: strategies.clone(),
                keep_last_turns: keep_last_turns.unwrap_or(1),
                summary: None,
            };
            self.transcript = compact(&self.transcript, &plan).transcript;
        }
    }
}
