//! The CLI's compaction: the `cairn run` flags that record a new session's compaction policy,
//! and the history lines of compaction events.

use cairn_ledger::CompactionStrategy;
use cairn_runtime::{CompactionPolicy, Event};

/// When and how a new session's transcript is compacted (README, "Compaction").
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CompactionArgs {
    /// Compact before a model call whose transcript is estimated (bytes / 4) above this many
    /// tokens; it also compacts and retries when the provider says the context is too long.
    #[arg(long, value_name = "TOKENS", value_parser = clap::value_parser!(u64).range(1..))]
    pub compact_at: Option<u64>,
    /// Compact only when the provider says the context is too long, then retry the call.
    #[arg(long, conflicts_with = "compact_at")]
    pub compact_on_overflow: bool,
    /// How many turns compaction keeps, the current one included (default 4).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub compact_keep_turns: Option<u32>,
    /// The strategies, in order, comma-separated: drop_reasoning, drop_failed_tool_results,
    /// keep_last_turns (default: all three, in this order).
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_strategy)]
    pub compact_strategies: Vec<CompactionStrategy>,
    /// Summarise the turns compaction drops with a model call (the session's model) and keep
    /// the summary in front of the first kept message.
    #[arg(long)]
    pub compact_summarize: bool,
}

fn parse_strategy(name: &str) -> Result<CompactionStrategy, String> {
    serde_json::from_value(serde_json::Value::String(name.trim().to_owned())).map_err(|_| {
        format!(
            "unknown compaction strategy {name:?}: use drop_reasoning, \
             drop_failed_tool_results or keep_last_turns"
        )
    })
}

impl CompactionArgs {
    /// Whether any flag was given (they are fixed when a session starts).
    pub fn given(&self) -> bool {
        self.compact_at.is_some()
            || self.compact_on_overflow
            || self.compact_keep_turns.is_some()
            || !self.compact_strategies.is_empty()
            || self.compact_summarize
    }

    /// The policy a new session records: `None` without flags (the session never compacts
    /// on its own).
    pub fn session_policy(&self) -> anyhow::Result<Option<CompactionPolicy>> {
        if !self.given() {
            return Ok(None);
        }
        let default = CompactionPolicy::default();
        let policy = CompactionPolicy {
            threshold_tokens: self.compact_at,
            strategies: if self.compact_strategies.is_empty() {
                default.strategies
            } else {
                self.compact_strategies.clone()
            },
            keep_last_turns: self.compact_keep_turns.unwrap_or(default.keep_last_turns),
            summarize: self.compact_summarize,
        };
        policy
            .check()
            .map_err(|e| anyhow::anyhow!("--compact-strategies: {e}"))?;
        Ok(Some(policy))
    }

    /// Refuses the flags for an existing session: its history recorded its policy.
    pub fn refuse_for_existing(&self, session_id: &str) -> anyhow::Result<()> {
        if self.given() {
            super::exit_codes::usage_bail!(
                "session {session_id} exists, and the --compact-* flags apply only when a \
                 session starts (its history records its compaction policy); leave them out \
                 to continue the session, or use `cairn compact {session_id}`"
            );
        }
        Ok(())
    }
}

/// What `cairn compact` prints.
pub fn describe(session_id: &str, outcome: &cairn_runtime::wire::CompactionOutcome) -> String {
    if outcome.compacted {
        format!(
            "compacted session {session_id}: {} (estimated tokens {} -> {})",
            outcome.strategies.join(", "),
            outcome.estimate_before,
            outcome.estimate_after
        )
    } else {
        format!(
            "nothing to compact in session {session_id} (estimated tokens {})",
            outcome.estimate_before
        )
    }
}

/// The history line of a compaction event, `None` for other events.
pub fn summarize(event: &Event) -> Option<String> {
    match event {
        Event::TranscriptCompacted {
            turn,
            trigger,
            strategies,
            keep_last_turns,
            cut,
            estimate_before,
            estimate_after,
            summary,
        } => {
            let mut line = format!(
                "turn={turn} trigger={} strategies=[{}]",
                trigger.as_str(),
                strategies
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            );
            if let Some(keep) = keep_last_turns {
                line.push_str(&format!(" keep_last_turns={keep}"));
            }
            if let Some(cut) = cut {
                line.push_str(&format!(" cut={cut}"));
            }
            line.push_str(&format!(" tokens~{estimate_before}->{estimate_after}"));
            if let Some(summary) = summary {
                line.push_str(&format!(" summary+{}", summary.chars().count()));
            }
            Some(line)
        }
        Event::CompactionRequested {} => Some("between turns".to_owned()),
        Event::SummaryCallScheduled { turn, attempt, .. } => {
            Some(format!("turn={turn} attempt={attempt}"))
        }
        Event::SummaryCallCompleted {
            turn,
            attempt,
            summary,
            ..
        } => Some(format!(
            "turn={turn} attempt={attempt} {} chars",
            summary.chars().count()
        )),
        Event::SummaryCallFailed {
            turn,
            attempt,
            failure,
            ..
        } => Some(format!(
            "turn={turn} attempt={attempt} {}: {}",
            failure.class.as_str(),
            failure.message
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_make_a_checked_policy() {
        assert!(CompactionArgs::default()
            .session_policy()
            .unwrap()
            .is_none());
        let args = CompactionArgs {
            compact_at: Some(900),
            compact_strategies: vec![CompactionStrategy::KeepLastTurns],
            ..CompactionArgs::default()
        };
        assert_eq!(
            args.session_policy().unwrap(),
            Some(CompactionPolicy {
                threshold_tokens: Some(900),
                strategies: vec![CompactionStrategy::KeepLastTurns],
                keep_last_turns: 4,
                summarize: false,
            })
        );
        let twice = CompactionArgs {
            compact_strategies: vec![
                CompactionStrategy::DropReasoning,
                CompactionStrategy::DropReasoning,
            ],
            ..CompactionArgs::default()
        };
        let err = twice.session_policy().unwrap_err().to_string();
        assert!(err.contains("listed twice"), "{err}");
        assert!(parse_strategy("keep_last_turns").is_ok());
        let err = parse_strategy("drop_everything").unwrap_err();
        assert!(err.contains("unknown compaction strategy"), "{err}");
    }
}
