//! Looking into and moving histories: `cairn export` and `cairn import` (the JSON-lines format
//! of `runtime/src/export.rs`), `cairn show --at SEQ` (a session as it was at one event) and
//! `cairn replay --trace` (every event with what the current code decides on it).

use super::out::{outln, showln};
use anyhow::Context;
use cairn_runtime::client::describe_state;
use cairn_runtime::engine::status_of;
use cairn_runtime::export::{export_lines, import_session};
use cairn_runtime::replay::{describe_at, open_tool_calls, state_at, trace};
use cairn_runtime::store::embedded::{self, OpenMode};
use cairn_runtime::{Clock, EventEnvelope, SystemClock};
use std::path::Path;
use std::process::ExitCode;

/// `cairn export`: the session's history as an export, to `output` or stdout.
pub fn export(
    session: &str,
    events: &[EventEnvelope],
    output: Option<&Path>,
) -> anyhow::Result<()> {
    let lines = export_lines(session, events)?;
    match output {
        Some(path) => {
            std::fs::write(path, lines.as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))?;
            showln!(
                "exported {} events of session {session} to {}",
                events.len(),
                path.display()
            );
        }
        None => outln!("{}", lines.trim_end_matches('\n'))?,
    }
    Ok(())
}

/// `cairn import FILE`: a new session in the store at `data` (made when missing) from an
/// export; an interrupted turn resumes with `cairn resume`.
pub async fn import(data: &Path, file: &Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    // Checked before the store is opened (or made): a refused file changes nothing.
    cairn_runtime::export::parse_export(&text)
        .with_context(|| format!("{} is refused", file.display()))?;
    let opened = embedded::open(data, OpenMode::Create, None).await?;
    let report = import_session(&*opened.store, &text, SystemClock.now_ms())
        .await
        .with_context(|| format!("importing {}", file.display()))?;
    showln!(
        "imported session {} ({} events) into {}{}",
        report.session_id,
        report.events,
        data.display(),
        if report.running {
            format!(
                "; its turn was interrupted ({} activit{} queued): `cairn resume --data {}` carries it on",
                report.tasks,
                if report.tasks == 1 { "y" } else { "ies" },
                data.display()
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

/// `cairn show SESSION [--at SEQ]`: status, usage, pending tasks, open tool calls and the
/// transcript as they were right after event `at` (default: the last).
pub fn show(
    session: &str,
    events: &[EventEnvelope],
    at: Option<u64>,
    json: bool,
) -> anyhow::Result<()> {
    let last = events.last().map_or(0, |e| e.seq);
    let seq = at.unwrap_or(last);
    if json {
        // The same description the server's `GET /v1/sessions/{id}/state` answers.
        let shown = describe_at(session, events, seq)?;
        outln!("{}", serde_json::to_string(&shown)?)?;
        return Ok(());
    }
    let state = state_at(session, events, seq)?;
    let description = describe_state(&state, status_of(&state));
    let open: Vec<_> = open_tool_calls(&state);
    let at_event = events
        .iter()
        .find(|e| e.seq == seq)
        .map_or("", |e| e.kind.as_str());
    outln!("session {session} at seq {seq} of {last} ({at_event})")?;
    outln!(
        "status: {}{}",
        description.status.as_str(),
        match description.running_turn {
            Some(turn) => format!(" (turn {turn} running)"),
            None => String::new(),
        }
    )?;
    outln!("turns started: {}", description.turns)?;
    outln!(
        "transcript: {} messages, ~{} tokens estimated",
        state.transcript.messages.len(),
        cairn_ledger::estimate_tokens(&state.transcript)
    )?;
    if let Some(outcome) = &description.last_outcome {
        outln!("last outcome: {}", serde_json::to_string(outcome)?)?;
    }
    let usage = &description.usage;
    outln!(
        "usage so far: {} input, {} output tokens ({} cache read, {} cache write)",
        usage.input_tokens,
        usage.output_tokens,
        usage.cache_read_tokens,
        usage.cache_write_tokens
    )?;
    outln!(
        "totals so far: {}",
        super::budget::totals_text(&description.totals)
    )?;
    if let Some(turn) = &description.running_turn_totals {
        outln!("running turn: {}", super::budget::totals_text(turn))?;
    }
    if description.pending_tasks.is_empty() {
        outln!("pending tasks: none")?;
    }
    for task in &description.pending_tasks {
        outln!(
            "pending task: {} attempt {} (scheduled at seq {})",
            task.activity,
            task.attempt,
            task.scheduled_seq
        )?;
    }
    for slot in &open {
        outln!(
            "open tool call: {} {} {}",
            slot.tool_use.id,
            slot.tool_use.name,
            slot.tool_use.arguments
        )?;
    }
    outln!("transcript:")?;
    outln!(
        "{}",
        String::from_utf8_lossy(&state.transcript.canonical_json())
    )?;
    Ok(())
}

/// `cairn replay --trace`: every event with the commands the current code decides on it;
/// exit 1 at the first divergence, named after the events that replayed.
pub fn print_trace(session: &str, events: &[EventEnvelope]) -> anyhow::Result<ExitCode> {
    let (steps, divergence) = trace(session, events);
    for step in &steps {
        let decided = if step.decided.is_empty() {
            String::new()
        } else {
            let commands: Vec<String> = step
                .decided
                .iter()
                .map(|c| c.clone().into_event().kind().to_owned())
                .collect();
            format!("  => decides {}", commands.join(", "))
        };
        outln!("{:>5}  {}{decided}", step.event.seq, step.event.kind)?;
    }
    match divergence {
        None => {
            outln!("ok: {} events replay deterministically", events.len())?;
            Ok(ExitCode::SUCCESS)
        }
        Some(e) => {
            outln!("divergence: {e}")?;
            Ok(ExitCode::from(super::exit_codes::CHECK_FAILED))
        }
    }
}

/// `cairn fork`: a new session in the store at `data` from a prefix of `request.parent`.
pub async fn fork(data: &Path, request: &cairn_runtime::fork::ForkRequest) -> anyhow::Result<()> {
    let opened = embedded::open(data, OpenMode::Existing, None).await?;
    let report =
        cairn_runtime::fork::fork_session(&*opened.store, request, SystemClock.now_ms()).await?;
    showln!(
        "forked session {} from {} at seq {} ({} events copied){}",
        report.session_id,
        request.parent,
        request.at_seq,
        report.events,
        if report.running {
            format!(
                "; its turn goes on from there ({} activit{} queued): `cairn resume --data {}`",
                report.tasks,
                if report.tasks == 1 { "y" } else { "ies" },
                data.display()
            )
        } else {
            format!(
                "; continue it with `cairn run --data {} --session {} ...`",
                data.display(),
                report.session_id
            )
        }
    );
    Ok(())
}

/// `cairn diff A B`: where two sessions part, their transcripts' differences by message and
/// part, and their usage.
pub fn diff(
    (a, events_a): (&str, &[EventEnvelope]),
    (b, events_b): (&str, &[EventEnvelope]),
    json: bool,
) -> anyhow::Result<()> {
    use cairn_runtime::diff::{diff_sessions, MessageDiff};
    let diff = diff_sessions(a, events_a, b, events_b)?;
    if json {
        outln!("{}", serde_json::to_string(&diff)?)?;
        return Ok(());
    }
    match &diff.parting {
        None => outln!("histories: the same {} events", events_a.len())?,
        Some(p) => outln!(
            "histories part at seq {}: {} | {}",
            p.seq,
            p.a.as_deref().unwrap_or("(end)"),
            p.b.as_deref().unwrap_or("(end)")
        )?,
    }
    if !diff.config.is_empty() {
        outln!("configuration differs: {}", diff.config.join(", "))?;
    }
    outln!("transcript: {} messages in common", diff.common_messages)?;
    for message in &diff.messages {
        match message {
            MessageDiff::OnlyInA { index, message } => {
                outln!("  message {index} only in {a}: {message}")?
            }
            MessageDiff::OnlyInB { index, message } => {
                outln!("  message {index} only in {b}: {message}")?
            }
            MessageDiff::Changed {
                index,
                roles,
                parts,
            } => {
                if let Some((ra, rb)) = roles {
                    outln!("  message {index}: role {ra} | {rb}")?;
                }
                for (part, pa, pb) in parts {
                    outln!("  message {index} part {part}:")?;
                    outln!("    {a}: {pa}")?;
                    outln!("    {b}: {pb}")?;
                }
            }
        }
    }
    let u = &diff.usage;
    outln!(
        "usage: {a} {} in / {} out, {b} {} in / {} out (delta {:+} / {:+}; cache read {:+}, cache write {:+}, reasoning {:+})",
        u.a.input_tokens,
        u.a.output_tokens,
        u.b.input_tokens,
        u.b.output_tokens,
        u.delta[0],
        u.delta[1],
        u.delta[2],
        u.delta[3],
        u.delta[4]
    )?;
    Ok(())
}

/// `cairn replay --dir EXPORTS`: every export of the folder replayed with the current code.
pub fn check_exports(dir: &Path) -> anyhow::Result<ExitCode> {
    let checks = cairn_runtime::export::check_exports(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?;
    let mut clean = 0;
    for check in &checks {
        let name = check.path.file_name().map_or_else(
            || check.path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        match &check.divergence {
            None => {
                clean += 1;
                outln!("{name}: ok ({} events)", check.events)?;
            }
            Some(e) => outln!("{name}: diverges: {e}")?,
        }
    }
    outln!(
        "{}: {clean} of {} histories replay with this code",
        if clean == checks.len() {
            "ok"
        } else {
            "failed"
        },
        checks.len()
    )?;
    Ok(if clean == checks.len() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(super::exit_codes::CHECK_FAILED)
    })
}
