//! Usage totals and budgets: what a turn and a session consumed (tokens, priced cost, model
//! calls), summed from recorded numbers only, and the pure checks the workflow makes against
//! the budgets a session recorded in its `session_started` limits.

use crate::pricing::{format_usd, CostMicros};
use cairn_ledger::Usage;
use serde::{Deserialize, Serialize};

/// What model call attempts consumed: their usage, the sum of their recorded costs, how many
/// used tokens without a known price, and how many were scheduled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UsageTotals {
    /// Token usage of every attempt, failed ones included (as far as it is known).
    #[schema(value_type = crate::wire::schema::Usage)]
    pub usage: Usage,
    /// The sum of the attempts' recorded costs, in micro-dollars.
    pub cost_micros: u64,
    /// Attempts that used tokens but have no recorded cost (their model has no price): when
    /// not 0, `cost_micros` is a lower bound.
    #[serde(default)]
    pub unpriced_attempts: u32,
    /// Model call attempts scheduled.
    #[serde(default)]
    pub model_calls: u32,
}

impl UsageTotals {
    /// Counts one attempt's recorded usage and cost.
    pub fn add_attempt(&mut self, usage: &Usage, cost_micros: Option<CostMicros>) {
        self.usage.add(usage);
        match cost_micros {
            Some(cost) => self.cost_micros = self.cost_micros.saturating_add(cost),
            None if tokens(usage) > 0 => self.unpriced_attempts += 1,
            None => {}
        }
    }

    /// Tokens of every class ([`tokens`]).
    pub fn tokens(&self) -> u64 {
        tokens(&self.usage)
    }

    /// The cost when every attempt was priced.
    pub fn cost(&self) -> Option<CostMicros> {
        (self.unpriced_attempts == 0).then_some(self.cost_micros)
    }

    /// `$0.001234`, or `≥ $0.001234 (2 attempts unpriced)` when some cost is unknown.
    pub fn cost_text(&self) -> String {
        match self.cost() {
            Some(cost) => format_usd(cost),
            None => format!(
                "≥ {} ({} attempt(s) unpriced)",
                format_usd(self.cost_micros),
                self.unpriced_attempts
            ),
        }
    }
}

/// The tokens a budget counts: input, output, cache reads and cache writes (reasoning tokens
/// are part of the output).
pub fn tokens(usage: &Usage) -> u64 {
    usage
        .input_tokens
        .saturating_add(usage.output_tokens)
        .saturating_add(usage.cache_read_tokens)
        .saturating_add(usage.cache_write_tokens)
}

/// Limits of one scope (a turn, or the whole session); each absent limit is unlimited. An
/// unknown field is refused: a misspelt limit must not leave a session silently unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// Tokens ([`tokens`]) at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Cost at most, in micro-dollars. Attempts of a model without a price make the cost
    /// unknown, and a turn whose cost budget cannot be checked fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_micros: Option<u64>,
    /// Model call attempts at most (retries count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_calls: Option<u32>,
}

impl Budget {
    /// Whether no limit is set (then it is left out of the record).
    pub fn is_unlimited(&self) -> bool {
        *self == Budget::default()
    }
}

/// Which limit a turn went over.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema, PartialOrd, Ord,
)]
#[serde(rename_all = "snake_case")]
pub enum BudgetLimit {
    /// `max_tokens`.
    Tokens,
    /// `max_cost_micros`.
    CostMicros,
    /// `max_model_calls`.
    ModelCalls,
}

impl BudgetLimit {
    /// The limit's field name.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetLimit::Tokens => "max_tokens",
            BudgetLimit::CostMicros => "max_cost_micros",
            BudgetLimit::ModelCalls => "max_model_calls",
        }
    }
}

/// Whose budget.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema, PartialOrd, Ord,
)]
#[serde(rename_all = "snake_case")]
pub enum BudgetScope {
    /// The turn's (`limits.turn_budget`).
    Turn,
    /// The session's, across its turns (`limits.session_budget`).
    Session,
}

/// The budget a failed turn went over, recorded in its `turn_failed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BudgetExceeded {
    /// The limit.
    pub limit: BudgetLimit,
    /// The turn's or the session's.
    pub scope: BudgetScope,
    /// The limit's value (tokens, micro-dollars or model calls).
    pub limit_value: u64,
    /// How much was used when the workflow checked (for model calls, with the call it would
    /// schedule; for cost, the priced part).
    pub used: u64,
    /// Whether the cost could not be checked because attempts have no price.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cost_unknown: bool,
}

impl BudgetExceeded {
    /// The `turn_failed` reason text.
    pub fn reason(&self) -> String {
        let scope = match self.scope {
            BudgetScope::Turn => "turn",
            BudgetScope::Session => "session",
        };
        let (limit, used) = match self.limit {
            BudgetLimit::Tokens => (
                format!("{} tokens", self.limit_value),
                format!("{} used", self.used),
            ),
            BudgetLimit::CostMicros => (
                format_usd(self.limit_value),
                format!("{} used", format_usd(self.used)),
            ),
            BudgetLimit::ModelCalls => (
                format!("{} model calls", self.limit_value),
                format!("the next would be call {}", self.used),
            ),
        };
        if self.cost_unknown {
            return format!(
                "{scope} budget {} of {limit} cannot be checked: a model call's cost is unknown (no price for its model; {used} by priced calls)",
                self.limit.as_str()
            );
        }
        format!(
            "{scope} budget exceeded: {} {limit}, {used}",
            self.limit.as_str()
        )
    }
}

/// When a check is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Before scheduling a model call: nothing may be left over the limit, and the call must
    /// fit the model call limit.
    BeforeCall,
    /// After a result is recorded: the amounts used must not exceed the limits.
    AfterResult,
}

/// The first limit of `turn` or `session` the totals break at this check, turn first, in the
/// order tokens, cost, model calls.
pub fn check(
    turn_budget: &Budget,
    turn: &UsageTotals,
    session_budget: &Budget,
    session: &UsageTotals,
    when: Check,
) -> Option<BudgetExceeded> {
    check_scope(BudgetScope::Turn, turn_budget, turn, when)
        .or_else(|| check_scope(BudgetScope::Session, session_budget, session, when))
}

fn check_scope(
    scope: BudgetScope,
    budget: &Budget,
    used: &UsageTotals,
    when: Check,
) -> Option<BudgetExceeded> {
    let over = |used: u64, limit: u64| match when {
        Check::BeforeCall => used >= limit,
        Check::AfterResult => used > limit,
    };
    let exceeded = |limit, limit_value, used, cost_unknown| BudgetExceeded {
        limit,
        scope,
        limit_value,
        used,
        cost_unknown,
    };
    if let Some(max) = budget.max_tokens {
        if over(used.tokens(), max) {
            return Some(exceeded(BudgetLimit::Tokens, max, used.tokens(), false));
        }
    }
    if let Some(max) = budget.max_cost_micros {
        if used.unpriced_attempts > 0 {
            return Some(exceeded(
                BudgetLimit::CostMicros,
                max,
                used.cost_micros,
                true,
            ));
        }
        if over(used.cost_micros, max) {
            return Some(exceeded(
                BudgetLimit::CostMicros,
                max,
                used.cost_micros,
                false,
            ));
        }
    }
    if let (Some(max), Check::BeforeCall) = (budget.max_model_calls, when) {
        let next = u64::from(used.model_calls) + 1;
        if next > u64::from(max) {
            return Some(exceeded(
                BudgetLimit::ModelCalls,
                u64::from(max),
                next,
                false,
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(tokens: u64, cost: u64, calls: u32) -> UsageTotals {
        UsageTotals {
            usage: Usage {
                input_tokens: tokens,
                ..Usage::default()
            },
            cost_micros: cost,
            unpriced_attempts: 0,
            model_calls: calls,
        }
    }

    #[test]
    fn a_limit_reached_stops_the_next_call_and_only_going_over_fails_a_result() {
        let budget = Budget {
            max_tokens: Some(100),
            ..Budget::default()
        };
        let none = Budget::default();
        let at = totals(100, 0, 1);
        assert_eq!(check(&budget, &at, &none, &at, Check::AfterResult), None);
        let before = check(&budget, &at, &none, &at, Check::BeforeCall).expect("over");
        assert_eq!(
            (before.limit, before.scope, before.limit_value, before.used),
            (BudgetLimit::Tokens, BudgetScope::Turn, 100, 100)
        );
        assert_eq!(
            before.reason(),
            "turn budget exceeded: max_tokens 100 tokens, 100 used"
        );
    }

    #[test]
    fn model_calls_count_the_call_about_to_start_and_the_session_is_checked_after_the_turn() {
        let calls = Budget {
            max_model_calls: Some(2),
            ..Budget::default()
        };
        let none = Budget::default();
        assert_eq!(
            check(
                &none,
                &totals(0, 0, 1),
                &calls,
                &totals(0, 0, 1),
                Check::BeforeCall
            ),
            None
        );
        let over = check(
            &none,
            &totals(0, 0, 1),
            &calls,
            &totals(0, 0, 2),
            Check::BeforeCall,
        )
        .expect("over");
        assert_eq!((over.scope, over.used), (BudgetScope::Session, 3));
        assert_eq!(
            check(
                &none,
                &totals(0, 0, 9),
                &calls,
                &totals(0, 0, 9),
                Check::AfterResult
            ),
            None
        );
    }

    #[test]
    fn an_unpriced_attempt_makes_a_cost_budget_fail() {
        let budget = Budget {
            max_cost_micros: Some(1_000_000),
            ..Budget::default()
        };
        let mut used = UsageTotals::default();
        used.add_attempt(
            &Usage {
                output_tokens: 5,
                ..Usage::default()
            },
            None,
        );
        assert_eq!(used.cost(), None);
        assert_eq!(used.cost_text(), "≥ $0.000000 (1 attempt(s) unpriced)");
        let over = check(
            &budget,
            &used,
            &Budget::default(),
            &used,
            Check::AfterResult,
        )
        .expect("unknown cost");
        assert!(over.cost_unknown);
        assert!(
            over.reason().contains("cannot be checked"),
            "{}",
            over.reason()
        );
        // A misspelt limit is refused, not ignored.
        let misspelt = serde_json::from_str::<Budget>(r#"{"max_token": 5}"#).unwrap_err();
        assert!(
            misspelt.to_string().contains("unknown field `max_token`"),
            "{misspelt}"
        );
        // An attempt with no tokens costs nothing, priced or not.
        let mut empty = UsageTotals::default();
        empty.add_attempt(&Usage::default(), None);
        assert_eq!(empty.cost(), Some(0));
    }
}
