//! `cairn bench --footprint`: the bytes one long session costs, from the messages to the disk.
//!
//! One session of `turns` turns runs on a new embedded store with the scripted model and a
//! worker pool with its default settings, as `cairn run` does. Each turn sends a few hundred
//! bytes of user text; the model answers with a short text and one `read_file` call, whose
//! file holds a few hundred bytes of text, then with a few hundred bytes of answer. The texts
//! are made of words picked by a fixed pseudo-random sequence, so that they compress about as
//! prose does rather than as one repeated string.
//!
//! It reports, each as a multiple of the raw message bytes:
//! - raw message bytes: the user texts, the model's text and reasoning, the tool calls'
//!   arguments and the tool results' content, as sent;
//! - transcript bytes: the ledger's canonical JSON of the session's transcript;
//! - history bytes: the stored event records' encoded sizes (the store's values, as
//!   [`codec::encode`] writes them), with a breakdown by event kind;
//! - disk bytes: the blocks the store directory's files take (allocated, not their lengths: a
//!   preallocated journal is mostly a hole), while the store is open after the run, once it is
//!   closed, and once it is reopened and the history read back;
//! - and each also as a multiple of the history bytes and of the store's logical bytes: the
//!   keys and values it holds live in every keyspace once the session is done
//!   (`FjallStore::live_bytes`, `SledStore::live_bytes`).
//!
//! It also reports what a miss of the engine's state cache costs on this session, the cost a
//! snapshot would save: the time to read the history back from the reopened store and to fold
//! it, beside a turn's time at the session's end with the state cached and at its start (the
//! means of the last and the first tenth of the turns, at most 100 each), and the folded
//! state's estimated bytes (`SessionState::approx_bytes`, what the cache's byte budget counts).

use anyhow::{bail, Context};
use cairn_activities::ToolRegistry;
use cairn_ledger::{ModelSpec, Part, ToolResultContent, Transcript};
use cairn_runtime::codec;
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::store::fjall::FjallStore;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::{
    Client, Engine, EventEnvelope, SessionOptions, SessionState, SystemClock, TurnOutcome,
};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes a directory's files take.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskUsage {
    /// Allocated blocks × 512 (`st_blocks`), summed over every file.
    pub allocated: u64,
    /// File lengths summed.
    pub apparent: u64,
}

/// The bytes of one event kind in the history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindBytes {
    /// The kind tag.
    pub kind: String,
    /// Its records.
    pub events: u64,
    /// Their encoded bytes.
    pub bytes: u64,
}

/// What one footprint measurement found.
#[derive(Debug, Clone)]
pub struct Footprint {
    /// The engine measured.
    pub engine: StorageEngine,
    /// Turns run.
    pub turns: usize,
    /// User texts, model text and reasoning, tool arguments and tool results, as sent.
    pub raw_bytes: u64,
    /// The transcript's canonical JSON.
    pub transcript_bytes: u64,
    /// The encoded event records.
    pub history_bytes: u64,
    /// The history by event kind, largest first.
    pub by_kind: Vec<KindBytes>,
    /// The store's logical bytes: the keys and values it holds live in every keyspace once the
    /// session is done (the history with its keys, the session's record, what is left of the
    /// task queue).
    pub live_bytes: u64,
    /// The store directory while the store is open after the run.
    pub disk_open: DiskUsage,
    /// The store directory once the store is closed.
    pub disk_closed: DiskUsage,
    /// The store directory once reopened and the history read back.
    pub disk_reopened: DiskUsage,
    /// The session's history (what the dictionary trainer samples).
    pub history: Vec<EventEnvelope>,
    /// The mean time of the first turns (a tenth of them, at most 100).
    pub first_turns: Duration,
    /// The mean time of the last turns (as many), run with the session's state cached.
    pub last_turns: Duration,
    /// Reading the whole history back from the reopened store.
    pub miss_read: Duration,
    /// Folding that history into the session's state.
    pub miss_fold: Duration,
    /// The folded state's estimated bytes.
    pub state_bytes: usize,
}

/// Words the texts are made of (their frequencies are flat, so they compress less than prose).
const WORDS: &[&str] = &[
    "the",
    "session",
    "durable",
    "history",
    "event",
    "store",
    "worker",
    "model",
    "tool",
    "answer",
    "result",
    "journal",
    "record",
    "append",
    "lease",
    "task",
    "turn",
    "replay",
    "engine",
    "fold",
    "compaction",
    "bytes",
    "disk",
    "memory",
    "page",
    "table",
    "key",
    "value",
    "commit",
    "flush",
    "sync",
    "queue",
    "retry",
    "timeout",
    "request",
    "response",
    "stream",
    "token",
    "budget",
    "policy",
    "approval",
    "person",
    "file",
    "line",
    "path",
    "read",
    "write",
    "and",
    "of",
    "to",
    "in",
    "is",
    "that",
    "for",
    "with",
    "as",
    "on",
    "by",
    "it",
    "not",
    "be",
    "are",
    "from",
    "or",
    "this",
    "which",
    "when",
    "then",
    "each",
    "every",
    "one",
    "two",
    "after",
    "before",
    "because",
    "while",
    "until",
    "since",
    "only",
    "also",
    "still",
    "again",
];

/// A deterministic text of about `len` bytes: words of [`WORDS`] picked by a xorshift from
/// `seed`, with a full stop every few words.
pub(crate) fn text(seed: u64, len: usize) -> String {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = String::with_capacity(len + 16);
    let mut sentence = 0;
    while out.len() < len {
        let word = WORDS[(next() % WORDS.len() as u64) as usize];
        if sentence == 0 {
            let mut chars = word.chars();
            if let Some(first) = chars.next() {
                out.extend(first.to_uppercase());
                out.push_str(chars.as_str());
            }
        } else {
            out.push_str(word);
        }
        sentence += 1;
        if sentence > 6 && next() % 4 == 0 {
            out.push_str(". ");
            sentence = 0;
        } else {
            out.push(' ');
        }
    }
    out.truncate(out.trim_end().len());
    out.push('.');
    out
}

/// The user text of turn `turn` (from 1).
fn user_text(turn: usize) -> String {
    text(turn as u64 * 3, 300)
}

/// The scripted session: per turn, a short text and a `read_file` of `notes-N.txt`, then an
/// answer.
fn script(turns: usize) -> anyhow::Result<String> {
    let mut responses = Vec::with_capacity(turns * 2);
    for turn in 1..=turns {
        responses.push(serde_json::json!({"parts": [
            {"type": "text", "text": format!("I will read notes-{turn}.txt first.")},
            {"type": "tool_use", "id": format!("toolu_{turn}"), "name": "read_file",
             "input": {"path": format!("notes-{turn}.txt")}},
        ], "usage": {"input_tokens": 1200, "output_tokens": 40}}));
        responses.push(serde_json::json!({"parts": [
            {"type": "text", "text": text(turn as u64 * 3 + 2, 400)},
        ], "usage": {"input_tokens": 1500, "output_tokens": 100}}));
    }
    Ok(serde_json::to_string(
        &serde_json::json!({ "responses": responses }),
    )?)
}

/// The raw message bytes of a transcript: what was said, without any framing.
pub fn raw_bytes(transcript: &Transcript) -> u64 {
    let part_bytes = |part: &Part| -> usize {
        match part {
            Part::Text { text, .. } | Part::Thinking { text, .. } | Part::Reasoning { text } => {
                text.len()
            }
            Part::RedactedThinking { data } => data.len(),
            Part::ReasoningItem { item } => item.as_str().len(),
            Part::ToolUse(call) => call.arguments.len(),
            Part::ToolResult(result) => match &result.content {
                ToolResultContent::Text(text) => text.len(),
                other => other.canonical_json().len(),
            },
            Part::Image { data_ref, .. } => data_ref.len(),
            Part::Media(_) | Part::Opaque(_) => 0,
        }
    };
    transcript
        .messages
        .iter()
        .flat_map(|message| message.parts.iter())
        .map(|part| part_bytes(part) as u64)
        .sum()
}

/// The bytes `dir`'s files take, recursively.
pub fn disk_usage(dir: &Path) -> anyhow::Result<DiskUsage> {
    let mut usage = DiskUsage::default();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let entry = entry?;
            let metadata = entry.metadata()?;
            if metadata.is_dir() {
                pending.push(entry.path());
            } else {
                usage.allocated += metadata.blocks() * 512;
                usage.apparent += metadata.len();
            }
        }
    }
    Ok(usage)
}

/// Runs one session of `turns` turns on a new `engine` store and measures its bytes.
// A benchmark: it reads the clock to time turns and a cache miss, and nothing depends on it.
#[allow(clippy::disallowed_methods)]
pub async fn measure(turns: usize, engine: StorageEngine) -> anyhow::Result<Footprint> {
    if turns == 0 {
        bail!("a footprint needs at least one turn");
    }
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let work = dir.path().join("work");
    std::fs::create_dir(&work).context("the tools' directory")?;
    for turn in 1..=turns {
        std::fs::write(
            work.join(format!("notes-{turn}.txt")),
            text(turn as u64 * 3 + 1, 400),
        )
        .context("writing a notes file")?;
    }
    let script_path = dir.path().join("footprint.json");
    std::fs::write(&script_path, script(turns)?).context("writing the footprint script")?;
    let model = ModelSpec::parse(&format!("scripted:{}", script_path.display()))
        .context("the footprint model spec")?;
    let store_dir = dir.path().join("store");
    let session_id = "footprint";

    let opened = embedded::open(&store_dir, OpenMode::Create, Some(engine)).await?;
    let runtime = Engine::new(opened.store.clone(), Arc::new(SystemClock));
    let tools = ToolRegistry::builtin(&work);
    let pool = WorkerPool::start(
        runtime.clone(),
        Activities {
            models: Arc::new(StandardModels::new()),
            tools: Arc::new(ToolRegistry::builtin(&work)),
        },
        WorkerConfig::default(),
    );
    let client = Client::new(runtime);
    let run = async {
        let mut options = SessionOptions::new(model, tools.specs());
        options.session_id = Some(session_id.to_owned());
        let id = client.start_session(options).await?;
        let timed = (turns / 10).clamp(1, 100);
        let (mut first_turns, mut last_turns) = (Duration::ZERO, Duration::ZERO);
        for turn in 1..=turns {
            let began = Instant::now();
            let outcome = client.run_turn(&id, &user_text(turn)).await?;
            if turn <= timed {
                first_turns += began.elapsed() / timed as u32;
            }
            if turn > turns - timed {
                last_turns += began.elapsed() / timed as u32;
            }
            if !matches!(outcome, TurnOutcome::Completed { .. }) {
                bail!("footprint turn {turn} did not complete: {outcome:?}");
            }
        }
        let transcript = client.transcript(&id).await?;
        let history = client.history(&id).await?;
        anyhow::Ok((transcript, history, first_turns, last_turns))
    };
    let ran = run.await;
    pool.shutdown().await;
    let (transcript, history, first_turns, last_turns) = ran?;
    let disk_open = disk_usage(&store_dir)?;
    drop(client);
    drop(opened);
    let disk_closed = disk_usage(&store_dir)?;

    let mut kinds: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut history_bytes = 0;
    for envelope in &history {
        let bytes = codec::encode(envelope)?.len() as u64;
        history_bytes += bytes;
        let entry = kinds.entry(envelope.kind.clone()).or_default();
        entry.0 += 1;
        entry.1 += bytes;
    }
    let mut by_kind: Vec<KindBytes> = kinds
        .into_iter()
        .map(|(kind, (events, bytes))| KindBytes {
            kind,
            events,
            bytes,
        })
        .collect();
    by_kind.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.kind.cmp(&b.kind)));

    let reopened = embedded::open(&store_dir, OpenMode::Existing, Some(engine))
        .await
        .context("reopening the store")?;
    let began = Instant::now();
    let read_back = reopened.store.read_history(session_id, 1, None).await?;
    let miss_read = began.elapsed();
    let began = Instant::now();
    let state = SessionState::fold(session_id, &read_back)?;
    let miss_fold = began.elapsed();
    if read_back != history {
        bail!("the reopened store's history differs from the one written");
    }
    if *state.transcript != transcript {
        bail!("the history folded again gives another transcript");
    }
    let disk_reopened = disk_usage(&store_dir)?;
    drop(reopened);
    let live_bytes = live_bytes(&store_dir, engine)?;

    Ok(Footprint {
        engine,
        turns,
        raw_bytes: raw_bytes(&transcript),
        transcript_bytes: transcript.canonical_json().len() as u64,
        history_bytes,
        by_kind,
        disk_open,
        disk_closed,
        disk_reopened,
        live_bytes,
        history,
        first_turns,
        last_turns,
        miss_read,
        miss_fold,
        state_bytes: state.approx_bytes(),
    })
}

/// The live keys and values of the closed store at `dir`, opened on its own for the count.
fn live_bytes(dir: &Path, engine: StorageEngine) -> anyhow::Result<u64> {
    Ok(match engine {
        StorageEngine::Fjall => FjallStore::open_existing(dir)?.live_bytes()?,
        StorageEngine::Sled => SledStore::open_existing(dir)?.live_bytes()?,
    })
}

/// `part` as a multiple of `whole`, `–` when `whole` is 0.
fn times(part: u64, whole: u64) -> String {
    if whole == 0 {
        "–".to_owned()
    } else {
        format!("{:.2}×", part as f64 / whole as f64)
    }
}

impl Footprint {
    /// The report: a table of the byte counts and their multiples, then the history's event
    /// kinds, largest first (Markdown).
    pub fn report(&self) -> String {
        let raw = self.raw_bytes;
        let history = self.history_bytes;
        let mut out = format!(
            "footprint of one {}-turn session on {}\n\n| bytes | total | per turn | × raw | × history | × live |\n|---|---|---|---|---|---|\n",
            self.turns, self.engine
        );
        let turns = self.turns.max(1) as u64;
        let mut row = |name: &str, bytes: u64| {
            out.push_str(&format!(
                "| {name} | {bytes} | {} | {} | {} | {} |\n",
                bytes / turns,
                times(bytes, raw),
                times(bytes, history),
                times(bytes, self.live_bytes)
            ));
        };
        row("raw messages", raw);
        row("transcript (canonical JSON)", self.transcript_bytes);
        row("history (encoded records)", history);
        row("live keys and values (logical)", self.live_bytes);
        for (when, usage) in [
            ("open after the run", self.disk_open),
            ("closed", self.disk_closed),
            ("reopened", self.disk_reopened),
        ] {
            row(&format!("disk allocated, {when}"), usage.allocated);
            row(&format!("disk file lengths, {when}"), usage.apparent);
        }
        let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
        out.push_str(&format!(
            "\nA miss of the engine's state cache on this session: reading its {} events back {}, \
             folding them {} (a turn at the session's end, state cached: {}; at its start: {}); \
             the folded state's estimate {} bytes ({} the transcript's canonical JSON).\n",
            self.history.len(),
            ms(self.miss_read),
            ms(self.miss_fold),
            ms(self.last_turns),
            ms(self.first_turns),
            self.state_bytes,
            times(self.state_bytes as u64, self.transcript_bytes)
        ));
        out.push_str("\n| event kind | events | bytes | share of history | bytes per event |\n|---|---|---|---|---|\n");
        for kind in &self.by_kind {
            out.push_str(&format!(
                "| {} | {} | {} | {:.1}% | {} |\n",
                kind.kind,
                kind.events,
                kind.bytes,
                100.0 * kind.bytes as f64 / history.max(1) as f64,
                kind.bytes / kind.events.max(1)
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_deterministic_varied_and_near_their_length() {
        let a = text(7, 300);
        assert_eq!(a, text(7, 300));
        assert_ne!(a, text(8, 300));
        assert!((300..330).contains(&a.len()), "{}", a.len());
        assert!(a.ends_with('.'));
    }

    #[test]
    fn raw_bytes_count_what_was_said_and_disk_usage_counts_blocks() {
        let mut transcript = Transcript::new();
        transcript.push_user_text("hello");
        assert_eq!(raw_bytes(&transcript), 5);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), vec![1u8; 10_000]).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/b"), b"xy").unwrap();
        let usage = disk_usage(dir.path()).unwrap();
        assert_eq!(usage.apparent, 10_002);
        assert!(usage.allocated >= 10_000, "{usage:?}");
    }
}
