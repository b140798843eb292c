//! Usage, cost and budgets on the command line: the budget flags of a new session, the price
//! table flag, the usage line `cairn run` prints after a turn, and its exit code for a turn
//! that stopped short.

use super::out::note;
use cairn_runtime::budget::{Budget, UsageTotals};
use cairn_runtime::pricing::{format_usd, parse_usd};
use cairn_runtime::{Limits, PriceTable, TurnOutcome};
use std::path::PathBuf;

fn usd(text: &str) -> Result<u64, String> {
    parse_usd(text)
}

/// The budgets of a new session (each refused for an existing one: they are recorded when
/// the session starts), and the price table.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct BudgetArgs {
    /// Tokens (input + output + cache) one turn may use, for a new session.
    #[arg(long, value_name = "N")]
    pub max_turn_tokens: Option<u64>,
    /// Dollars one turn may cost (e.g. 0.50), for a new session.
    #[arg(long, value_name = "USD", value_parser = usd)]
    pub max_turn_cost: Option<u64>,
    /// Model calls (attempts, retries included) one turn may make, for a new session.
    #[arg(long, value_name = "N")]
    pub max_turn_model_calls: Option<u32>,
    /// Tokens the session's turns may use together, for a new session.
    #[arg(long, value_name = "N")]
    pub max_session_tokens: Option<u64>,
    /// Dollars the session's turns may cost together, for a new session.
    #[arg(long, value_name = "USD", value_parser = usd)]
    pub max_session_cost: Option<u64>,
    /// Model calls the session's turns may make together, for a new session.
    #[arg(long, value_name = "N")]
    pub max_session_model_calls: Option<u32>,
    /// The price table (JSON; see the README) that prices each model call as it is
    /// recorded, instead of `CAIRN_PRICES` or the built-in one.
    #[arg(long, value_name = "FILE")]
    pub prices: Option<PathBuf>,
}

impl BudgetArgs {
    fn turn_budget(&self) -> Budget {
        Budget {
            max_tokens: self.max_turn_tokens,
            max_cost_micros: self.max_turn_cost,
            max_model_calls: self.max_turn_model_calls,
        }
    }

    fn session_budget(&self) -> Budget {
        Budget {
            max_tokens: self.max_session_tokens,
            max_cost_micros: self.max_session_cost,
            max_model_calls: self.max_session_model_calls,
        }
    }

    /// Records the budgets given in a new session's limits.
    pub fn apply(&self, limits: &mut Limits) {
        limits.turn_budget = self.turn_budget();
        limits.session_budget = self.session_budget();
    }

    /// Refuses budgets for a session that exists: its history recorded its limits.
    pub fn refuse_for_existing(&self, session_id: &str) -> anyhow::Result<()> {
        if !self.turn_budget().is_unlimited() || !self.session_budget().is_unlimited() {
            super::exit_codes::usage_bail!(
                "session {session_id} exists, and --max-turn-* and --max-session-* budgets \
                 apply only when a session starts (its history records its limits); leave \
                 them out to continue the session, or start a new one"
            );
        }
        Ok(())
    }

    /// The price table: `--prices`, else `CAIRN_PRICES`, else the built-in one.
    pub fn price_table(&self) -> anyhow::Result<PriceTable> {
        Ok(PriceTable::from_file_or_env(self.prices.as_deref())?)
    }
}

/// `1234 tokens (1000 in, 234 out, 0 cache read, 0 cache write), 2 model calls, $0.001234`.
pub fn totals_text(totals: &UsageTotals) -> String {
    let u = &totals.usage;
    format!(
        "{} tokens ({} in, {} out, {} cache read, {} cache write), {} model call(s), cost {}",
        totals.tokens(),
        u.input_tokens,
        u.output_tokens,
        u.cache_read_tokens,
        u.cache_write_tokens,
        totals.model_calls,
        totals.cost_text()
    )
}

/// Prints a finished turn's usage and cost, and says so when its answer stopped short.
pub fn report(outcome: &TurnOutcome) {
    note!("turn {}: {}", outcome.turn(), totals_text(outcome.totals()));
    if let Some(stop) = outcome.abnormal_stop() {
        note!(
            "turn {} stopped short: the model stopped for {} — the answer is incomplete or withheld",
            outcome.turn(),
            serde_json::to_value(stop)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("{stop:?}"))
        );
    }
}

/// A session's totals for `cairn sessions`: `tokens cost`.
pub fn summary_columns(totals: Option<&UsageTotals>) -> String {
    match totals {
        Some(t) => format!(
            "{:>10} tokens {:>6} calls {:>12}",
            t.tokens(),
            t.model_calls,
            match t.cost() {
                Some(cost) => format_usd(cost),
                None => format!("≥{}", format_usd(t.cost_micros)),
            }
        ),
        None => String::new(),
    }
}
