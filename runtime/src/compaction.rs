//! A session's compaction policy (recorded in `session_started`) and why a compaction ran:
//! the data the workflow's compaction rules (`workflow_compaction.rs`) decide from.

use cairn_ledger::CompactionStrategy;
use serde::{Deserialize, Serialize};

/// When and how a session's transcript is compacted. Recorded in `session_started`; a session
/// without one never compacts (a context-too-long answer fails its turn, as before).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompactionPolicy {
    /// Compact before a model call whose transcript is estimated
    /// ([`cairn_ledger::estimate_tokens`]: canonical JSON bytes / 4) above this many tokens.
    /// `None`: only when the provider answers that the context is too long, or on request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold_tokens: Option<u64>,
    /// The strategies, in the order they are tried; each at most once.
    #[serde(default = "default_strategies")]
    pub strategies: Vec<CompactionStrategy>,
    /// How many turns [`CompactionStrategy::KeepLastTurns`] keeps (the current one counts);
    /// at least 1.
    #[serde(default = "default_keep_last_turns")]
    pub keep_last_turns: u32,
    /// Summarise the turns `keep_last_turns` drops with a model call (the turn's model, run
    /// as an activity, retried under the model retry policy) and put the summary in front of
    /// the first kept message; when it fails for good, the turns are dropped without one.
    /// Compaction on request never summarises.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub summarize: bool,
}

impl Default for CompactionPolicy {
    fn default() -> Self {
        CompactionPolicy {
            threshold_tokens: None,
            strategies: default_strategies(),
            keep_last_turns: default_keep_last_turns(),
            summarize: false,
        }
    }
}

fn default_strategies() -> Vec<CompactionStrategy> {
    vec![
        CompactionStrategy::DropReasoning,
        CompactionStrategy::DropFailedToolResults,
        CompactionStrategy::KeepLastTurns,
    ]
}

fn default_keep_last_turns() -> u32 {
    4
}

impl CompactionPolicy {
    /// Checks the policy is usable: at least one strategy, none twice, a threshold above
    /// zero, and `keep_last_turns` at least 1. The error says which rule is broken.
    pub fn check(&self) -> Result<(), String> {
        if self.strategies.is_empty() {
            return Err("compaction needs at least one strategy".to_owned());
        }
        for (i, s) in self.strategies.iter().enumerate() {
            if self.strategies[..i].contains(s) {
                return Err(format!(
                    "strategy {} is listed twice (strategies[{i}])",
                    s.as_str()
                ));
            }
        }
        if self.threshold_tokens == Some(0) {
            return Err("threshold_tokens must be above 0".to_owned());
        }
        if self.keep_last_turns == 0 {
            return Err("keep_last_turns must be at least 1 (the current turn is kept)".to_owned());
        }
        Ok(())
    }
}

/// Why a compaction ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompactionTrigger {
    /// The transcript's estimate crossed the policy's threshold before a model call.
    Threshold,
    /// The provider answered that the context is too long; the call is retried after it.
    ContextTooLong,
    /// A person or program asked for it (`cairn compact`, `Client::compact`).
    Requested,
}

impl CompactionTrigger {
    /// The snake_case name, as recorded and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            CompactionTrigger::Threshold => "threshold",
            CompactionTrigger::ContextTooLong => "context_too_long",
            CompactionTrigger::Requested => "requested",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_policy_says_what_is_wrong() {
        assert_eq!(CompactionPolicy::default().check(), Ok(()));
        let twice = CompactionPolicy {
            strategies: vec![
                CompactionStrategy::DropReasoning,
                CompactionStrategy::DropReasoning,
            ],
            ..CompactionPolicy::default()
        };
        assert_eq!(
            twice.check(),
            Err("strategy drop_reasoning is listed twice (strategies[1])".to_owned())
        );
        let none = CompactionPolicy {
            strategies: vec![],
            ..CompactionPolicy::default()
        };
        assert!(none.check().unwrap_err().contains("at least one strategy"));
        let zero = CompactionPolicy {
            keep_last_turns: 0,
            ..CompactionPolicy::default()
        };
        assert!(zero.check().unwrap_err().contains("keep_last_turns"));
        let threshold = CompactionPolicy {
            threshold_tokens: Some(0),
            ..CompactionPolicy::default()
        };
        assert!(threshold.check().unwrap_err().contains("threshold_tokens"));
    }

    #[test]
    fn omitted_fields_take_their_defaults() {
        let policy: CompactionPolicy = serde_json::from_str(r#"{"threshold_tokens": 900}"#)
            .expect("a policy with only a threshold");
        assert_eq!(
            policy,
            CompactionPolicy {
                threshold_tokens: Some(900),
                ..CompactionPolicy::default()
            }
        );
        let err = serde_json::from_str::<CompactionPolicy>(r#"{"keep_turns": 2}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `keep_turns`"),
            "{err}"
        );
    }
}
