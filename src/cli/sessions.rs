//! `cairn sessions`: the sessions of a store or server, filtered by status and by last
//! activity, in aligned columns (id, status, model, turns, last activity, usage, events) or as
//! JSON lines.

use super::describe::{model_name, usage_text};
use super::exit_codes::usage_bail;
use super::out::outln;
use cairn_ledger::Usage;
use cairn_runtime::budget::UsageTotals;
use cairn_runtime::{Client, Error as RuntimeError, SessionQuery, SessionStatus};
use serde::Serialize;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What `cairn sessions` lists.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SessionFilter {
    /// Only sessions with this status: idle, running or cancelled.
    #[arg(long, value_parser = parse_status)]
    pub status: Option<SessionStatus>,
    /// Only sessions active within this long before now, e.g. 30m, 2h, 7d.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub since: Option<Duration>,
    /// One JSON object per session.
    #[arg(long)]
    pub json: bool,
}

fn parse_status(text: &str) -> Result<SessionStatus, String> {
    match text {
        "idle" => Ok(SessionStatus::Idle),
        "running" => Ok(SessionStatus::Running),
        "cancelled" => Ok(SessionStatus::Cancelled),
        other => Err(format!(
            "unknown status {other:?} (known: idle, running, cancelled)"
        )),
    }
}

/// One listed session. A session whose history this build cannot read (a corrupt record,
/// an event of a newer cairn) is listed with what the store's listing knows and `unreadable`
/// saying why, rather than failing the whole listing.
#[derive(Debug, Serialize)]
struct Listed {
    session_id: String,
    status: &'static str,
    model: Option<String>,
    turns: Option<u32>,
    updated_at_ms: u64,
    usage: Option<Usage>,
    totals: Option<UsageTotals>,
    events: u64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    awaiting_approval: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    unreadable: Option<String>,
}

/// Lists the sessions `filter` selects.
pub async fn list(client: &Client, filter: &SessionFilter) -> anyhow::Result<()> {
    let mut query = SessionQuery {
        status: filter.status,
        ..SessionQuery::default()
    };
    let since_ms = match filter.since {
        Some(since) => {
            let Some(from) = now().checked_sub(since) else {
                usage_bail!(
                    "--since {}: longer than the clock goes back",
                    humantime::format_duration(since)
                );
            };
            Some(epoch_ms(from))
        }
        None => None,
    };
    let mut listed = Vec::new();
    loop {
        let page = client.list_sessions(&query).await?;
        for summary in page.sessions {
            if since_ms.is_some_and(|since| summary.updated_at_ms < since) {
                continue;
            }
            let (description, unreadable) = match client.describe(&summary.session_id).await {
                Ok(description) => (Some(description), None),
                // Deleted since the page was read.
                Err(RuntimeError::UnknownSession { .. }) => continue,
                Err(e) if e.is_history_fault() => (None, Some(e.to_string())),
                Err(e) => return Err(e.into()),
            };
            listed.push(Listed {
                status: summary.status.as_str(),
                model: description
                    .as_ref()
                    .and_then(|d| d.model.as_ref().map(model_name)),
                turns: description.as_ref().map(|d| d.turns),
                updated_at_ms: summary.updated_at_ms,
                usage: description.as_ref().map(|d| d.usage),
                totals: description.map(|d| d.totals),
                events: summary.events,
                awaiting_approval: summary.awaiting_approval,
                session_id: summary.session_id,
                unreadable,
            });
        }
        match page.next_after {
            Some(after) => query.after = Some(after),
            None => break,
        }
    }
    if filter.json {
        for l in &listed {
            outln!("{}", serde_json::to_string(l)?)?;
        }
        return Ok(());
    }
    if listed.is_empty() {
        outln!("no sessions")?;
        return Ok(());
    }
    let rows: Vec<[String; 8]> = listed
        .iter()
        .map(|l| {
            [
                l.session_id.clone(),
                l.status.to_owned(),
                l.model.clone().unwrap_or_else(|| "-".to_owned()),
                l.turns.map_or_else(|| "-".to_owned(), |t| t.to_string()),
                timestamp(l.updated_at_ms),
                l.usage.as_ref().map(usage_text).unwrap_or_default(),
                super::budget::summary_columns(l.totals.as_ref()),
                format!("{} events", l.events),
            ]
        })
        .collect();
    let header = [
        "SESSION",
        "STATUS",
        "MODEL",
        "TURNS",
        "LAST ACTIVITY (UTC)",
        "USAGE",
        "TOTALS",
        "EVENTS",
    ];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    outln!("{}", columns(&header, &widths))?;
    for (row, l) in rows.iter().zip(&listed) {
        let parked = if l.awaiting_approval.is_empty() {
            String::new()
        } else {
            format!("  awaiting approval: {}", l.awaiting_approval.join(", "))
        };
        let unreadable = match &l.unreadable {
            Some(why) => format!("  unreadable: {why}"),
            None => String::new(),
        };
        outln!("{}{parked}{unreadable}", columns(row, &widths))?;
    }
    Ok(())
}

/// Cells padded to their column's width (numbers to the right), two spaces apart.
fn columns(cells: &[String], widths: &[usize]) -> String {
    let mut line = String::new();
    for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
        if i > 0 {
            line.push_str("  ");
        }
        let pad = width.saturating_sub(cell.chars().count());
        if i == 3 {
            line.push_str(&" ".repeat(pad));
            line.push_str(cell);
        } else {
            line.push_str(cell);
            if i + 1 < cells.len() {
                line.push_str(&" ".repeat(pad));
            }
        }
    }
    line
}

/// An epoch-ms time as `2026-01-02 03:04:05` (UTC).
pub fn timestamp(ms: u64) -> String {
    let time = UNIX_EPOCH + Duration::from_millis(ms);
    humantime::format_rfc3339_seconds(time)
        .to_string()
        .replace('T', " ")
        .trim_end_matches('Z')
        .to_owned()
}

// Filtering by "within DURATION of now" reads the clock: a listing, not pure code.
#[allow(clippy::disallowed_methods)]
fn now() -> SystemTime {
    SystemTime::now()
}

fn epoch_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
