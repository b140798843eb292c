//! `cairn demo`: a complete offline session (`cairn::demo`'s script, prompt and notes) in a
//! temporary store, or kept in one to inspect, and a summary of what it did.

use super::budget;
use super::out::{note, showln};
use super::summary::describe;
use super::StoreDir;
use crate::{outcome_code, parse_model, watch};
use anyhow::Context;
use cairn::demo::{DEMO_NOTES, DEMO_PROMPT, DEMO_SCRIPT};
use cairn::host::Host;
use cairn_ledger::ModelSpec;
use cairn_runtime::store::embedded::{OpenMode, StorageEngine};
use cairn_runtime::{Event, SessionOptions, TurnOutcome};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

pub(crate) async fn run(
    data: Option<PathBuf>,
    engine: Option<StorageEngine>,
    keep: bool,
) -> anyhow::Result<ExitCode> {
    // The scripted model and the file its tool call reads: the demo's own, removed when it
    // ends; so is its store, unless the session is to be kept.
    let fixtures = tempfile::Builder::new()
        .prefix("cairn-demo-")
        .tempdir()
        .context("cannot create a temporary directory")?;
    let keep = keep || data.is_some();
    let store = if keep {
        StoreDir::resolve(data)?
    } else {
        StoreDir {
            path: fixtures.path().join("store"),
            defaulted: false,
        }
    };
    let workdir = fixtures.path().join("work");
    std::fs::create_dir_all(&workdir)?;
    std::fs::write(workdir.join("notes.txt"), DEMO_NOTES)?;
    let script = fixtures.path().join("demo-script.json");
    std::fs::write(&script, DEMO_SCRIPT)?;
    let model = parse_model(&format!("scripted:{}", script.display()))?;
    let mut host = Host::open(&store.path, OpenMode::Create, engine, workdir).await?;
    let options = SessionOptions {
        system_prompt: Some("You are a concise assistant. Use tools when they help.".to_owned()),
        // The built-in tools the demo's script calls (the host also hosts shell).
        ..SessionOptions::new(model, cairn_activities::ToolRegistry::builtin(".").specs())
    };
    let session_id = host.client.start_session(options).await?;
    note!("new session {session_id}");
    // Only the demo's session runs: the store may be one with other sessions in it.
    host.start_for(&session_id).await?;
    showln!("> {DEMO_PROMPT}\n");
    let outcome = run_turn(&host, &session_id, DEMO_PROMPT, None, true).await?;
    let events = host.client.history(&session_id).await?;
    let tool_calls = events
        .iter()
        .filter(|e| matches!(e.event, Event::ToolCallCompleted { .. }))
        .count();
    let engine = host.opened.engine;
    host.shutdown().await;
    let size = dir_size(&store.path);
    drop(fixtures);
    let data = store.flag();
    showln!("\n--- summary");
    showln!("session      {session_id}");
    showln!("outcome      {}", describe(&outcome));
    showln!(
        "events       {} written durably ({} tool calls ran in parallel)",
        events.len(),
        tool_calls
    );
    if !keep {
        showln!(
            "store        a temporary one ({engine}, {} KiB on disk), removed: `cairn demo \
             --keep` keeps the session in the default store to inspect",
            size / 1024
        );
        return Ok(outcome_code(&outcome));
    }
    showln!(
        "store        {}{} ({engine}, {} KiB on disk)",
        store.path.display(),
        if store.defaulted { ", the default" } else { "" },
        size / 1024
    );
    showln!("inspect      cairn sessions{data}");
    showln!("             cairn history{data} {session_id}");
    showln!("             cairn transcript{data} {session_id}");
    showln!("             cairn replay{data} {session_id}");
    Ok(outcome_code(&outcome))
}

/// Sends the prompt and prints the turn live as it runs (see `cli::live`); Ctrl-C cancels
/// it (see `cli::turn`).
async fn run_turn(
    host: &Host,
    session_id: &str,
    prompt: &str,
    model: Option<ModelSpec>,
    show_thinking: bool,
) -> anyhow::Result<TurnOutcome> {
    let outcome = watch(host, session_id, show_thinking)
        .send(prompt, model, Vec::new())
        .await?;
    showln!();
    if !matches!(outcome, TurnOutcome::Completed { .. }) {
        note!("{}", describe(&outcome));
    }
    budget::report(&outcome);
    Ok(outcome)
}

fn dir_size(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            // Allocated, not apparent: fjall preallocates its journal sparsely.
            #[cfg(unix)]
            Ok(m) => std::os::unix::fs::MetadataExt::blocks(&m) * 512,
            #[cfg(not(unix))]
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
