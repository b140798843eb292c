//! `cairn delete SESSION [--yes]`: deletes a finished session (its history, record and tasks,
//! atomically and durably; the id is never used again), on a store or through a server, as
//! `temporal workflow delete` does. On a terminal it asks first, naming the session's turns;
//! without one it deletes only with `--yes`, so a script never deletes by accident.

use super::exit_codes::usage_bail;
use super::out::outln;
use anyhow::Context;
use cairn_runtime::Client;
use serde::Serialize;
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

/// Whether the delete may go ahead without a question: `--yes`, or a terminal to ask on.
/// Checked before the store is opened, so a refusal changes nothing.
pub fn check_confirmable(session: &str, yes: bool) -> anyhow::Result<()> {
    if !yes && !std::io::stdin().is_terminal() {
        usage_bail!(
            "no terminal to confirm on: pass --yes to delete session {session} without asking"
        );
    }
    Ok(())
}

/// What `cairn delete --json` prints.
#[derive(Debug, Serialize)]
struct Deleted<'a> {
    session_id: &'a str,
    deleted: bool,
    events: u64,
}

/// Deletes `session` through `client`, after asking on the terminal unless `yes`.
pub async fn run(
    client: &Client,
    session: &str,
    yes: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    check_confirmable(session, yes)?;
    if !yes {
        let described = client
            .describe(session)
            .await
            .with_context(|| format!("cannot read session {session}"))?;
        let turns = match described.turns {
            1 => "1 turn".to_owned(),
            n => format!("{n} turns"),
        };
        if !confirm(&format!("delete session {session} ({turns})? [y/N] "))? {
            eprintln_kept(session);
            return Ok(ExitCode::SUCCESS);
        }
    }
    let deleted = client
        .delete_session(session)
        .await
        .with_context(|| format!("cannot delete session {session}"))?;
    if json {
        let shown = Deleted {
            session_id: session,
            deleted: true,
            events: deleted.events,
        };
        outln!("{}", serde_json::to_string(&shown)?)?;
    } else {
        outln!("deleted session {session} ({} events)", deleted.events)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Asks `question` on standard error and reads the answer from standard input: yes only for
/// `y` or `yes` (any case).
fn confirm(question: &str) -> anyhow::Result<bool> {
    let mut err = std::io::stderr().lock();
    let _ = err
        .write_all(question.as_bytes())
        .and_then(|()| err.flush());
    drop(err);
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .context("cannot read the answer from standard input")?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

fn eprintln_kept(session: &str) {
    super::out::note!("not deleted: session {session} is kept");
}
