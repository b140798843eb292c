//! The price table: turns one model attempt's usage into a cost, in integer micro-dollars,
//! when the attempt's result is recorded (the engine prices it and the event stores it; a
//! fold never looks a price up).
//!
//! The format is JSON (`runtime/prices.json` is the built-in table and its example):
//!
//! ```json
//! { "models": [
//!   { "providers": ["anthropic"], "model": "claude-sonnet-4-5",
//!     "input": 3, "output": 15, "cache_read": 0.3, "cache_write": 3.75 }
//! ] }
//! ```
//!
//! Prices are US dollars per million tokens of each usage class, with at most six decimals.
//! A model is matched within its provider by its exact name, else by the longest entry whose
//! name is followed by a date or version suffix (`-20250929`, `-2024-08-06`, `-latest`), so
//! dated ids match their family and `gpt-4o-mini` never takes `gpt-4o`'s price. An unknown
//! model has no cost (`None`), never a guess.

use crate::error::{Error, Result};
use cairn_ledger::Usage;
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;

/// The built-in table's text.
pub const BUILT_IN_PRICES: &str = include_str!("../prices.json");

/// An amount of money in micro-dollars (millionths of a US dollar).
pub type CostMicros = u64;

/// Formats micro-dollars as dollars with six decimals (`$0.012345`).
pub fn format_usd(micros: CostMicros) -> String {
    format!("${}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

/// Parses a dollar amount (`0.25`, `$3`, at most six decimals) into micro-dollars.
pub fn parse_usd(text: &str) -> std::result::Result<CostMicros, String> {
    let t = text.trim().trim_start_matches('$');
    let (whole, fraction) = t.split_once('.').unwrap_or((t, ""));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || !(fraction.is_empty() || digits(fraction)) {
        return Err(format!("{text:?} is not a dollar amount like 0.25"));
    }
    if fraction.len() > 6 {
        return Err(format!("{text:?} has more than six decimals"));
    }
    let whole: u64 = whole
        .parse()
        .map_err(|_| format!("{text:?} is too large"))?;
    let fraction: u64 = format!("{fraction:0<6}").parse().unwrap_or(0);
    whole
        .checked_mul(1_000_000)
        .and_then(|w| w.checked_add(fraction))
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Prices of one model, in micro-dollars per million tokens of each usage class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPrice {
    /// Input tokens (not counting cache reads).
    pub input: u64,
    /// Output tokens (reasoning tokens are part of them).
    pub output: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read: u64,
    /// Input tokens written to the prompt cache.
    pub cache_write: u64,
}

impl ModelPrice {
    /// The cost of `usage`, rounded up to the micro-dollar.
    pub fn cost(&self, usage: &Usage) -> CostMicros {
        let scaled = u128::from(usage.input_tokens) * u128::from(self.input)
            + u128::from(usage.output_tokens) * u128::from(self.output)
            + u128::from(usage.cache_read_tokens) * u128::from(self.cache_read)
            + u128::from(usage.cache_write_tokens) * u128::from(self.cache_write);
        u64::try_from(scaled.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

/// A price table: models by provider and name.
///
/// Keyed by provider first, so a model call's lookup reads only its provider's entries, and
/// none for a provider the table does not price (a scripted or custom model): the lookup runs
/// at every model call, and a scan of the whole table was 1.5% of a turn's instructions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriceTable {
    models: BTreeMap<String, BTreeMap<String, ModelPrice>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TableFile {
    #[serde(default)]
    #[allow(dead_code)]
    about: Option<String>,
    models: Vec<EntryFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryFile {
    providers: Vec<String>,
    model: String,
    input: Dollars,
    output: Dollars,
    cache_read: Dollars,
    cache_write: Dollars,
}

/// A price in dollars per million tokens, checked where it is read so that a bad one is
/// reported at its line and column.
struct Dollars(u64);

impl<'de> Deserialize<'de> for Dollars {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let value = f64::deserialize(deserializer)?;
        if !value.is_finite() || !(0.0..=1.0e9).contains(&value) {
            return Err(serde::de::Error::custom(format!(
                "price {value} is not a dollar amount between 0 and 1e9"
            )));
        }
        let micros = (value * 1_000_000.0).round();
        if (value * 1_000_000.0 - micros).abs() > 1e-3 {
            return Err(serde::de::Error::custom(format!(
                "price {value} has more than six decimals"
            )));
        }
        Ok(Dollars(micros as u64))
    }
}

impl PriceTable {
    /// The built-in table (`runtime/prices.json`).
    pub fn built_in() -> PriceTable {
        // Checked by a test; an empty table rather than a panic if it ever were broken.
        PriceTable::parse("built-in", BUILT_IN_PRICES).unwrap_or(PriceTable {
            models: BTreeMap::new(),
        })
    }

    /// Parses a table; `source_name` names it in errors.
    pub fn parse(source_name: &str, text: &str) -> Result<PriceTable> {
        let invalid = |reason: String| Error::InvalidPrices {
            source_name: source_name.to_owned(),
            reason,
        };
        let file: TableFile = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let mut models = BTreeMap::new();
        for entry in file.models {
            if entry.model.is_empty() {
                return Err(invalid("an entry has an empty model name".to_owned()));
            }
            if entry.providers.is_empty() {
                return Err(invalid(format!(
                    "model {:?} names no provider",
                    entry.model
                )));
            }
            let price = ModelPrice {
                input: entry.input.0,
                output: entry.output.0,
                cache_read: entry.cache_read.0,
                cache_write: entry.cache_write.0,
            };
            for provider in entry.providers {
                let by_model: &mut BTreeMap<String, ModelPrice> =
                    models.entry(provider.clone()).or_default();
                if by_model.insert(entry.model.clone(), price).is_some() {
                    return Err(invalid(format!(
                        "model {:?} of provider {:?} is priced twice",
                        entry.model, provider
                    )));
                }
            }
        }
        Ok(PriceTable { models })
    }

    /// Reads a table from a file.
    pub fn load(path: &std::path::Path) -> Result<PriceTable> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| Error::InvalidPrices {
            source_name: name.clone(),
            reason: format!("cannot read it: {e}"),
        })?;
        PriceTable::parse(&name, &text)
    }

    /// The table a process uses: the file `path` when given, else the file `CAIRN_PRICES`
    /// names when set, else the built-in one.
    pub fn from_file_or_env(path: Option<&std::path::Path>) -> Result<PriceTable> {
        match path {
            Some(path) => PriceTable::load(path),
            None => match std::env::var_os("CAIRN_PRICES") {
                Some(path) if !path.is_empty() => PriceTable::load(std::path::Path::new(&path)),
                _ => Ok(PriceTable::built_in()),
            },
        }
    }

    /// The price of `model` of `provider`: its exact entry, else the longest entry followed
    /// by a date or version suffix; `None` when unknown.
    pub fn price(&self, provider: &str, model: &str) -> Option<ModelPrice> {
        let by_model = self.models.get(provider)?;
        if let Some(price) = by_model.get(model) {
            return Some(*price);
        }
        by_model
            .iter()
            .filter(|(name, _)| {
                model
                    .strip_prefix(name.as_str())
                    .is_some_and(is_version_suffix)
            })
            .max_by_key(|(name, _)| name.len())
            .map(|(_, price)| *price)
    }

    /// The cost of `usage` on `model` of `provider`; `None` when the model has no price.
    pub fn cost(&self, provider: &str, model: &str, usage: &Usage) -> Option<CostMicros> {
        self.price(provider, model).map(|p| p.cost(usage))
    }
}

/// `-latest`, or `-` then digits and dashes (`-20250929`, `-2024-08-06`).
fn is_version_suffix(rest: &str) -> bool {
    let Some(rest) = rest.strip_prefix('-') else {
        return false;
    };
    rest == "latest"
        || (rest.starts_with(|c: char| c.is_ascii_digit())
            && rest.chars().all(|c| c.is_ascii_digit() || c == '-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(input: u64, output: u64, cache_read: u64, cache_write: u64) -> Usage {
        Usage {
            input_tokens: input,
            output_tokens: output,
            cache_read_tokens: cache_read,
            cache_write_tokens: cache_write,
            reasoning_tokens: 0,
        }
    }

    /// Anthropic's documented prompt-cache multipliers of the base input price: 5-minute
    /// cache writes cost 1.25×, cache reads 0.1×. Every Anthropic entry must follow them, and a
    /// call's cache tokens are priced at those rates.
    #[test]
    fn anthropic_cache_reads_and_writes_are_priced_by_the_documented_multipliers() {
        let table = PriceTable::built_in();
        let mut checked = 0;
        for (model, price) in &table.models["anthropic"] {
            assert_eq!(
                price.cache_write * 100,
                price.input * 125,
                "{model} cache write"
            );
            assert_eq!(price.cache_read * 10, price.input, "{model} cache read");
            checked += 1;
        }
        assert!(checked >= 5, "{checked} anthropic entries");
        // 1000 cache writes × $3.75/M + 10000 cache reads × $0.30/M = 0.00375 + 0.003
        let cost = table.cost(
            "anthropic",
            "claude-sonnet-4-5",
            &usage(0, 0, 10_000, 1_000),
        );
        assert_eq!(cost, Some(6_750));
    }

    #[test]
    fn the_built_in_table_parses_and_prices_dated_ids() {
        let table = PriceTable::parse("built-in", BUILT_IN_PRICES).expect("built-in table");
        // 1000 in × $3/M + 500 out × $15/M + 2000 cache reads × $0.30/M = 0.003 + 0.0075 + 0.0006
        let cost = table.cost(
            "anthropic",
            "claude-sonnet-4-5-20250929",
            &usage(1000, 500, 2000, 0),
        );
        assert_eq!(cost, Some(11_100));
        assert_eq!(
            table.price("openai", "gpt-4o-2024-08-06"),
            table.price("openai", "gpt-4o")
        );
        // The longest family wins, and a non-version suffix is not a match.
        assert_eq!(
            table
                .price("openai", "gpt-4o-mini-2024-07-18")
                .map(|p| p.input),
            Some(150_000)
        );
        assert_eq!(table.price("openai", "gpt-4o-audio-preview"), None);
        assert_eq!(table.price("anthropic", "gpt-4o"), None);
        assert_eq!(table.cost("scripted", "x.json", &usage(1, 1, 0, 0)), None);
    }

    #[test]
    fn cost_rounds_up_to_the_micro_dollar() {
        let price = ModelPrice {
            input: 1,
            output: 0,
            cache_read: 0,
            cache_write: 0,
        };
        assert_eq!(price.cost(&usage(1, 0, 0, 0)), 1);
        assert_eq!(price.cost(&usage(0, 0, 0, 0)), 0);
    }

    #[test]
    fn a_syntax_error_names_its_line_and_column() {
        let text =
            "{\"models\": [\n  {\"providers\": [\"x\"], \"model\": \"m\",\n   \"input\": oops}\n]}";
        let err = PriceTable::parse("p.json", text).unwrap_err().to_string();
        assert!(err.starts_with("price table p.json:"), "{err}");
        assert!(err.contains("line 3"), "{err}");
    }

    #[test]
    fn a_bad_price_names_its_line() {
        let text = "{\"models\": [\n {\"providers\": [\"x\"], \"model\": \"m\", \"input\": 1, \"output\": 1,\n  \"cache_read\": -2, \"cache_write\": 0}]}";
        let err = PriceTable::parse("p.json", text).unwrap_err().to_string();
        assert!(err.contains("price -2 is not a dollar amount"), "{err}");
        assert!(err.contains("line 3"), "{err}");
        let text = "{\"models\": [{\"providers\": [\"x\"], \"model\": \"m\", \"input\": 0.0000001, \"output\": 1, \"cache_read\": 0, \"cache_write\": 0}]}";
        let err = PriceTable::parse("p.json", text).unwrap_err().to_string();
        assert!(err.contains("more than six decimals"), "{err}");
    }

    #[test]
    fn a_duplicate_or_nameless_entry_names_the_model() {
        let entry = r#"{"providers": ["x"], "model": "m", "input": 1, "output": 1, "cache_read": 0, "cache_write": 0}"#;
        let text = format!("{{\"models\": [{entry}, {entry}]}}");
        let err = PriceTable::parse("p.json", &text).unwrap_err().to_string();
        assert!(
            err.contains("model \"m\" of provider \"x\" is priced twice"),
            "{err}"
        );
        let text = r#"{"models": [{"providers": [], "model": "m", "input": 1, "output": 1, "cache_read": 0, "cache_write": 0}]}"#;
        let err = PriceTable::parse("p.json", text).unwrap_err().to_string();
        assert!(err.contains("model \"m\" names no provider"), "{err}");
    }

    #[test]
    fn dollar_amounts_parse_exactly() {
        assert_eq!(parse_usd("0.25"), Ok(250_000));
        assert_eq!(parse_usd("$3"), Ok(3_000_000));
        assert_eq!(parse_usd("1.000001"), Ok(1_000_001));
        assert!(parse_usd("1.0000001").is_err());
        assert!(parse_usd("-1").is_err());
        assert!(parse_usd("abc").is_err());
        assert_eq!(format_usd(1_234_567), "$1.234567");
    }
}
