//! The scripted model's script that every chaos session follows (`DATA/chaos-script.json`), and
//! the seeded generator behind it and behind the kill moments and the cuts.

use super::{SCRIPT_FILE, SIDE_EFFECT_TOOL};
use anyhow::Context;
use std::path::Path;

/// Base latency of a scripted model response; each response adds a seeded 0–`MODEL_DELAY_SPREAD_MS`.
const MODEL_DELAY_MS: u64 = 8;
const MODEL_DELAY_SPREAD_MS: u64 = 12;
/// The scripted provider's `jitter_ms`: per call (session, turn, round, attempt) extra latency.
const MODEL_JITTER_MS: u64 = 25;

/// A small seeded generator (SplitMix64) for kill moments and the script.
pub(super) struct SplitMix64(pub(super) u64);

impl SplitMix64 {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0), up to a negligible modulo bias.
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

// ---- The script --------------------------------------------------------------------------------

/// The shape of turn `turn`: how many parallel tool calls each of its tool rounds makes (1–2
/// rounds of 2–3 calls), then a final text. Seeded, and the same for every session.
pub(super) fn turn_shape(seed: u64, turn: usize) -> Vec<usize> {
    let mut rng = SplitMix64(seed ^ (turn as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let rounds = 1 + rng.below(2) as usize;
    (0..rounds).map(|_| 2 + rng.below(2) as usize).collect()
}

/// The script for `turns` turns. The provider picks a response by the count of assistant
/// messages in the transcript, so the script is every model call of every turn in order; the
/// responses of turn `t` do not depend on how many turns follow, so adding turns keeps the
/// earlier responses as they were.
pub(super) fn script_json(turns: usize, seed: u64) -> String {
    let mut rng = SplitMix64(seed.rotate_left(17) ^ 0x5851_F42D_4C95_7F2D);
    let mut responses = Vec::new();
    for turn in 1..=turns {
        for (round, calls) in turn_shape(seed, turn).into_iter().enumerate() {
            let mut parts = vec![serde_json::json!({
                "type": "thinking",
                "text": format!("Turn {turn}, round {round}: {calls} side effects, in parallel."),
                "signature": format!("sig-t{turn}-r{round}"),
            })];
            for k in 0..calls {
                parts.push(serde_json::json!({
                    "type": "tool_use",
                    "id": format!("toolu_t{turn}_r{round}_{k}"),
                    "name": SIDE_EFFECT_TOOL,
                    "input": {"turn": turn, "round": round, "call": k},
                }));
            }
            responses.push(serde_json::json!({
                "parts": parts,
                "usage": {"input_tokens": 100 + 10 * turn, "output_tokens": 20},
                "delay_ms": MODEL_DELAY_MS + rng.below(MODEL_DELAY_SPREAD_MS + 1),
                "jitter_ms": MODEL_JITTER_MS,
            }));
        }
        responses.push(serde_json::json!({
            "parts": [{"type": "text", "text": format!("Turn {turn} done.")}],
            "usage": {"input_tokens": 120 + 10 * turn, "output_tokens": 5},
            "delay_ms": MODEL_DELAY_MS + rng.below(MODEL_DELAY_SPREAD_MS + 1),
            "jitter_ms": MODEL_JITTER_MS,
        }));
    }
    serde_json::json!({"model": "scripted-chaos", "responses": responses}).to_string()
}

/// Writes the script atomically (a child may be reading it only when none is running, but a
/// torn file after a crash of the parent would still be confusing).
pub(super) fn write_script(data: &Path, turns: usize, seed: u64) -> anyhow::Result<()> {
    let path = data.join(SCRIPT_FILE);
    let temporary = data.join(format!("{SCRIPT_FILE}.tmp"));
    std::fs::write(&temporary, script_json(turns, seed))
        .with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, &path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
