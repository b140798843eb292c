//! `cairn train-dictionary`: trains a zstd dictionary for the record codec's compressed bodies
//! (`cairn_runtime::codec`, format 2) from realistic records, and reproduces how dictionary 1
//! (`runtime/dictionaries/records-1.zdict`) was made.
//!
//! The samples are the format-2 bodies ([`codec::record_body`]: named-field msgpack, before
//! compression) of:
//! - the golden sessions of `tests/golden/` listed in [`DICTIONARY_1_SAMPLES`]: the demo
//!   session (as version 2 recorded it), the old history and the golden records of every
//!   event kind (format 1);
//! - with `--turns N`, for experiments only, the session `cairn bench --footprint` runs (`N`
//!   turns on fjall).
//!
//! zstd's dictionary builder (`ZDICT_trainFromBuffer`) then picks the byte strings that recur
//! across them (field names, kind tags, the words of the texts), up to [`DICTIONARY_BYTES`].
//!
//! Dictionary 1 was trained on the golden files alone (`cairn train-dictionary --out FILE`,
//! 8,976 bytes: the golden records hold no more that recurs), and that run reproduces it byte
//! for byte (a test checks it). The demo session it was trained on is the one workflow
//! version 2 recorded, kept as `histories/v2-demo.jsonl`: the demo's own golden history has
//! moved on since, and training on that would make another dictionary. Not on the footprint session: that is the workload the history goal is measured
//! on, and a dictionary that knows its words would flatter the figure (0.60× raw with them,
//! 1.05× without). A shipped dictionary is never replaced; a new one gets a new codec id.

use crate::footprint;
use anyhow::Context;
use cairn_runtime::codec;
use cairn_runtime::store::embedded::StorageEngine;
use cairn_runtime::EventEnvelope;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The size of a trained dictionary: 32 KiB.
pub const DICTIONARY_BYTES: usize = 32 * 1024;

/// The golden files of the repository this binary was built from.
pub fn default_golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden")
}

/// The training samples, with how many records each source gave.
#[derive(Debug, Default)]
pub struct Samples {
    /// Format-2 bodies, uncompressed.
    pub bodies: Vec<Vec<u8>>,
    /// Records per source (a file name, or `footprint`).
    pub sources: BTreeMap<String, usize>,
}

impl Samples {
    fn add(&mut self, source: &str, envelopes: &[EventEnvelope]) -> anyhow::Result<()> {
        for envelope in envelopes {
            self.bodies.push(codec::record_body(envelope)?);
        }
        *self.sources.entry(source.to_owned()).or_default() += envelopes.len();
        Ok(())
    }
}

/// The envelopes of a history file: one JSON envelope per line; lines that are not envelopes
/// (an export's header line) are skipped.
fn jsonl_envelopes(path: &Path) -> anyhow::Result<Vec<EventEnvelope>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str::<EventEnvelope>(line).ok())
        .collect())
}

/// The envelope of a golden format-1 record (its payload is the whole envelope).
fn format1_envelope(path: &Path) -> anyhow::Result<EventEnvelope> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(
        bytes.first() == Some(&codec::RECORD_FORMAT_1) && bytes.len() > 5,
        "{} is not a format-1 record",
        path.display()
    );
    rmp_serde::from_slice(&bytes[5..]).with_context(|| format!("decoding {}", path.display()))
}

/// The golden files dictionary 1 was trained on, under `tests/golden/`, in order. Golden files
/// added later are not samples: training on this list keeps making dictionary 1.
pub const DICTIONARY_1_SAMPLES: &[&str] = &[
    // The demo session as it was recorded then (workflow version 2); the demo's own golden
    // history has moved on since.
    "histories/v2-demo.jsonl",
    "histories/v1-missing-argument.jsonl",
    "events/budget-model_attempt_progress.bin",
    "events/budget-model_call_completed.bin",
    "events/budget-model_call_failed.bin",
    "events/budget-session_started.bin",
    "events/budget-turn_failed.bin",
    "events/compaction-session_started.bin",
    "events/context_too_long-model_call_failed.bin",
    "events/fork-session_started.bin",
    "events/media-tool_call_completed.bin",
    "events/media-user_message.bin",
    "events/options-model_call_completed.bin",
    "events/options-session_started.bin",
    "events/options-user_message.bin",
    "events/policy-session_started.bin",
    "events/v1-compaction_requested.bin",
    "events/v1-model_attempt_progress.bin",
    "events/v1-model_call_completed.bin",
    "events/v1-model_call_failed.bin",
    "events/v1-model_call_scheduled.bin",
    "events/v1-session_cancelled.bin",
    "events/v1-session_started.bin",
    "events/v1-summary_call_completed.bin",
    "events/v1-summary_call_failed.bin",
    "events/v1-summary_call_scheduled.bin",
    "events/v1-tool_approval_requested.bin",
    "events/v1-tool_call_approved.bin",
    "events/v1-tool_call_completed.bin",
    "events/v1-tool_call_denied.bin",
    "events/v1-tool_call_failed.bin",
    "events/v1-tool_call_scheduled.bin",
    "events/v1-transcript_compacted.bin",
    "events/v1-turn_cancelled.bin",
    "events/v1-turn_completed.bin",
    "events/v1-turn_failed.bin",
    "events/v1-user_message.bin",
    "events/workdir-session_started.bin",
];

/// Gathers the samples: the golden files of [`DICTIONARY_1_SAMPLES`] under `golden`, then,
/// unless `footprint_turns` is 0, a footprint session of that many turns.
pub async fn samples(golden: &Path, footprint_turns: usize) -> anyhow::Result<Samples> {
    let mut samples = Samples::default();
    let mut events = Vec::new();
    for name in DICTIONARY_1_SAMPLES {
        let path = golden.join(name);
        if name.ends_with(".jsonl") {
            samples.add(name, &jsonl_envelopes(&path)?)?;
        } else {
            events.push(format1_envelope(&path)?);
        }
    }
    samples.add("events/*.bin", &events)?;
    if footprint_turns > 0 {
        let measured = footprint::measure(footprint_turns, StorageEngine::Fjall).await?;
        samples.add("footprint", &measured.history)?;
    }
    Ok(samples)
}

/// Trains a dictionary of [`DICTIONARY_BYTES`] on `samples`.
pub fn train(samples: &Samples) -> anyhow::Result<Vec<u8>> {
    zstd::dict::from_samples(&samples.bodies, DICTIONARY_BYTES)
        .context("zstd's dictionary builder failed")
}

/// The bytes format-2 records of `bodies` would take with `dictionary` in place of the
/// shipped one: per record the header and the smaller of the compressed and the plain body
/// (what [`codec::encode`] keeps), at the codec's level, summed.
pub fn record_bytes(bodies: &[Vec<u8>], dictionary: &[u8]) -> anyhow::Result<u64> {
    let mut compressor = zstd::bulk::Compressor::with_dictionary(3, dictionary)?;
    compressor.set_parameter(zstd::zstd_safe::CParameter::DictIdFlag(false))?;
    let mut total = 0;
    for body in bodies {
        total += 6 + compressor.compress(body)?.len().min(body.len()) as u64;
    }
    Ok(total)
}

/// A dictionary tried on a footprint session it may not have been trained on: the session's
/// raw message bytes and its records' bytes with that dictionary.
pub async fn evaluate(dictionary: &[u8], turns: usize) -> anyhow::Result<(u64, u64)> {
    let measured = footprint::measure(turns, StorageEngine::Fjall).await?;
    let bodies = measured
        .history
        .iter()
        .map(codec::record_body)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((measured.raw_bytes, record_bytes(&bodies, dictionary)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dictionary 1 is what training on the golden files gives, byte for byte: how it was made
    /// stays reproducible, and a change to the samples (or to zstd's trainer) shows here, never
    /// in the shipped dictionary.
    #[tokio::test]
    async fn training_on_the_golden_files_makes_dictionary_1_again() {
        let samples = samples(&default_golden_dir(), 0).await.expect("samples");
        let trained = train(&samples).expect("train");
        assert_eq!(trained.len(), codec::DICTIONARY_1.len());
        assert!(trained == codec::DICTIONARY_1, "the bytes differ");
    }
}
