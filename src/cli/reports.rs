//! The `--json` forms of the check commands (`fsck`, `replay`): one JSON object each, with
//! what the text form says, for scripts. The exit status is the same as the text form's.

use super::exit_codes;
use super::out::outln;
use cairn_runtime::fsck::FsckReport;
use cairn_runtime::{replay, Error as RuntimeError, EventEnvelope};
use serde_json::json;
use std::process::ExitCode;

/// `cairn fsck --json`: `{"clean", "sessions", "events", "tasks", "problems": [{"session_id",
/// "seq", "kind", "what"}], "notes"}` (`repaired` instead of `notes` with `--repair`).
pub fn fsck_json(report: &FsckReport, notes: &[String], repair: bool) -> anyhow::Result<()> {
    let problems: Vec<_> = report
        .problems
        .iter()
        .map(|p| {
            json!({
                "session_id": p.session_id,
                "seq": p.seq,
                "kind": p.kind.as_str(),
                "what": p.what,
            })
        })
        .collect();
    let mut object = json!({
        "clean": report.is_clean(),
        "sessions": report.sessions,
        "events": report.events,
        "tasks": report.tasks,
        "problems": problems,
    });
    object[if repair { "repaired" } else { "notes" }] = json!(notes);
    outln!("{object}")?;
    Ok(())
}

/// `cairn replay SESSION --json`: `{"session_id", "replays": true, "events", "commands",
/// "ledger_bytes"}`, or `{"session_id", "replays": false, "events", "divergence"}` (exit
/// [`CHECK_FAILED`](exit_codes::CHECK_FAILED)).
pub fn replay_json(session_id: &str, events: &[EventEnvelope]) -> anyhow::Result<ExitCode> {
    match replay(session_id, events) {
        Ok(replayed) => {
            outln!(
                "{}",
                json!({
                    "session_id": session_id,
                    "replays": true,
                    "events": events.len(),
                    "commands": replayed.commands.len(),
                    "ledger_bytes": replayed.state.transcript.canonical_json().len(),
                })
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Err(
            e @ (RuntimeError::Nondeterminism { .. }
            | RuntimeError::InvalidEvent { .. }
            | RuntimeError::StaleReport { .. }),
        ) => {
            outln!(
                "{}",
                json!({
                    "session_id": session_id,
                    "replays": false,
                    "events": events.len(),
                    "divergence": e.to_string(),
                })
            )?;
            Ok(ExitCode::from(exit_codes::CHECK_FAILED))
        }
        Err(e) => Err(e.into()),
    }
}
