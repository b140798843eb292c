//! `cairn resume`: carries on every session whose turn was interrupted, streaming what each
//! produces as `run` does (one session raw; several as whole lines prefixed with their ids),
//! and leaves turns that wait only on a person parked.

use super::exit_codes;
use super::live::LiveView;
use super::out::{note, showln};
use super::StoreDir;
use cairn::host::Host;
use cairn_runtime::store::embedded::OpenMode;
use cairn_runtime::{interrupted_output, TurnOutcome};
use std::path::PathBuf;
use std::process::ExitCode;

/// Resumes the store's interrupted sessions, tools working in `workdir` for sessions that
/// recorded no directory of their own.
pub async fn run(store: StoreDir, workdir: PathBuf) -> anyhow::Result<ExitCode> {
    store.check_exists()?;
    let mut host = Host::open(&store.path, OpenMode::Existing, None, workdir).await?;
    let report = host.engine.resume(true).await?;
    // A damaged history is said and left; the other sessions carry on.
    for unresumable in &report.unresumable {
        note!(
            "{}: cannot resume: {}",
            unresumable.session_id,
            unresumable.error
        );
    }
    let first_code = if report.unresumable.is_empty() {
        exit_codes::OK
    } else {
        exit_codes::ERROR
    };
    if report.running_sessions.is_empty() {
        if report.unresumable.is_empty() {
            showln!("nothing to resume");
        }
        return Ok(ExitCode::from(first_code));
    }
    showln!(
        "resuming {} session(s), {} outstanding activit{}{}",
        report.running_sessions.len(),
        report.outstanding_tasks,
        if report.outstanding_tasks == 1 {
            "y"
        } else {
            "ies"
        },
        if report.requeued_tasks > 0 {
            format!(" ({} re-enqueued)", report.requeued_tasks)
        } else {
            String::new()
        }
    );
    if report.reclaimed_leases > 0 {
        showln!(
            "released {} lease(s) held by the previous process",
            report.reclaimed_leases
        );
    }
    // Several sessions stream at once: whole lines, prefixed, so they do not interleave.
    let prefixed = report.running_sessions.len() > 1;
    let mut watched = Vec::new();
    for session_id in &report.running_sessions {
        let state = host.engine.state(session_id).await?;
        let history = host.client.history(session_id).await?;
        if let Some(cut) = interrupted_output(&state, &history) {
            showln!("{session_id}: {}", crate::interrupted_notice(&cut));
        }
        // Followed from its last event before the workers start: nothing of it is missed.
        let after_seq = state.next_seq.saturating_sub(1);
        let live = LiveView::start(&host.client, session_id, after_seq, true, prefixed).await?;
        watched.push((session_id.clone(), state.turns_started, live));
    }
    host.start_workers();
    let mut code = first_code;
    for (session_id, turn, live) in watched {
        // A turn parked on a person is left parked: deciding it needs no process.
        let Some(outcome) =
            super::approvals::wait_turn(&host.engine, &session_id, turn, true).await?
        else {
            live.stop().await;
            showln!("{session_id}: turn {turn} waits for approval");
            continue;
        };
        live.finish().await;
        if !prefixed {
            showln!();
        }
        showln!("{session_id}: {}", crate::describe(&outcome));
        if !matches!(outcome, TurnOutcome::Completed { .. }) && code == exit_codes::OK {
            code = exit_codes::of_outcome(&outcome);
        }
    }
    host.shutdown().await;
    Ok(ExitCode::from(code))
}
