//! Histories as files (`cairn export`, `cairn import`): a session's events as JSON lines
//! behind a header, to move a session between stores or keep it for replaying elsewhere.
//!
//! The format, version 1 (documented in the README):
//!
//! ```text
//! {"format":"cairn-history","version":1,"session_id":"s1","events":12}
//! {"schema_version":1,"kind":"session_started","session_id":"s1","seq":1,...}
//! ...
//! ```
//!
//! Line 1 is the header; each further line is one event envelope exactly as `cairn history
//! --json` prints it, seqs 1..=n in order. Event bodies keep their JSON text byte for byte
//! (tool arguments and results are `JsonText`), so export, import and export again give the
//! same bytes.

use crate::engine::status_of;
use crate::error::{Error, Result};
use crate::event::{EventEnvelope, SCHEMA_VERSION};
use crate::store::{AppendRequest, Store};
use crate::workflow::SessionState;
use serde::{Deserialize, Serialize};

/// The `format` of an export's header.
pub const EXPORT_FORMAT: &str = "cairn-history";

/// The export format version this code writes; it reads every version up to it.
pub const EXPORT_VERSION: u32 = 1;

/// Line 1 of an export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportHeader {
    /// Always [`EXPORT_FORMAT`].
    pub format: String,
    /// The format version.
    pub version: u32,
    /// The session exported.
    pub session_id: String,
    /// How many event lines follow.
    pub events: u64,
}

/// What an import wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportReport {
    /// The session created.
    pub session_id: String,
    /// Events written.
    pub events: u64,
    /// Whether its turn was interrupted (tasks were queued for it: it resumes).
    pub running: bool,
    /// Activity tasks queued so that the interrupted turn goes on.
    pub tasks: usize,
}

/// The export of `events` (a whole history of `session_id`): the header line and one line
/// per event, each ending in `\n`.
pub fn export_lines(session_id: &str, events: &[EventEnvelope]) -> Result<String> {
    let header = ExportHeader {
        format: EXPORT_FORMAT.to_owned(),
        version: EXPORT_VERSION,
        session_id: session_id.to_owned(),
        events: events.len() as u64,
    };
    let encode = |e: serde_json::Error| Error::Encode {
        session_id: session_id.to_owned(),
        seq: 0,
        reason: e.to_string(),
    };
    let mut out = serde_json::to_string(&header).map_err(encode)?;
    out.push('\n');
    for event in events {
        out.push_str(&serde_json::to_string(event).map_err(encode)?);
        out.push('\n');
    }
    Ok(out)
}

/// Exports a stored session (see [`export_lines`]).
pub async fn export_session(store: &dyn Store, session_id: &str) -> Result<String> {
    let events = store.read_history(session_id, 1, None).await?;
    export_lines(session_id, &events)
}

/// Reads an export: the header and its events, checked line by line — the header's format
/// and version, every line an event envelope of a known schema version, of the header's
/// session, with seqs 1..=n in order and as many as the header says — and the whole history
/// replayed with the current code. Any failure is [`Error::InvalidImport`] naming the line.
pub fn parse_export(text: &str) -> Result<(ExportHeader, Vec<EventEnvelope>, SessionState)> {
    let invalid = |line: usize, reason: String| Error::InvalidImport { line, reason };
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    let Some((_, first)) = lines.next() else {
        return Err(invalid(
            1,
            "the file is empty: line 1 must be the header".into(),
        ));
    };
    let header: ExportHeader = serde_json::from_str(first).map_err(|e| {
        invalid(
            1,
            format!("not a cairn export header ({{\"format\":\"{EXPORT_FORMAT}\",\"version\":N,\"session_id\",\"events\"}}): {e}"),
        )
    })?;
    if header.format != EXPORT_FORMAT {
        return Err(invalid(
            1,
            format!("format {:?} is not {EXPORT_FORMAT:?}", header.format),
        ));
    }
    if header.version == 0 || header.version > EXPORT_VERSION {
        return Err(invalid(
            1,
            format!(
                "export format version {} is not one this cairn reads (1..={EXPORT_VERSION})",
                header.version
            ),
        ));
    }
    crate::store::check_session_id(&header.session_id).map_err(|e| invalid(1, e.to_string()))?;
    let mut events = Vec::new();
    let mut state = SessionState::new(&header.session_id);
    for (line, text) in lines {
        if text.trim().is_empty() {
            return Err(invalid(
                line,
                "an empty line: every line after the header is one event".into(),
            ));
        }
        let event: EventEnvelope = serde_json::from_str(text)
            .map_err(|e| invalid(line, format!("not an event envelope: {e}")))?;
        if event.schema_version == 0 || event.schema_version > SCHEMA_VERSION {
            return Err(invalid(
                line,
                format!(
                    "unknown event schema version {} (this cairn reads 1..={SCHEMA_VERSION})",
                    event.schema_version
                ),
            ));
        }
        if event.session_id != header.session_id {
            return Err(invalid(
                line,
                format!(
                    "an event of session {:?} in the export of {:?}",
                    event.session_id, header.session_id
                ),
            ));
        }
        let expected = events.len() as u64 + 1;
        if event.seq != expected {
            return Err(invalid(
                line,
                format!("seq {} out of order: seq {expected} comes here", event.seq),
            ));
        }
        if event.kind != event.event.kind() {
            return Err(invalid(
                line,
                format!(
                    "kind {:?} does not name the event, a {:?}",
                    event.kind,
                    event.event.kind()
                ),
            ));
        }
        state
            .apply(&event)
            .map_err(|e| invalid(line, format!("the history does not replay: {e}")))?;
        events.push(event);
    }
    let last_line = events.len() + 1;
    if events.is_empty() {
        return Err(invalid(
            last_line,
            "no events: a history begins with its session_started event".into(),
        ));
    }
    if events.len() as u64 != header.events {
        return Err(invalid(
            last_line,
            format!(
                "the header says {} events, the file holds {} (a cut file?)",
                header.events,
                events.len()
            ),
        ));
    }
    state
        .finish_replay()
        .map_err(|e| invalid(last_line, format!("the history does not replay: {e}")))?;
    Ok((header, events, state))
}

/// Imports an export into `store` as a new session (see [`write_new_session`]). Nothing is
/// written when the file is refused ([`parse_export`]) or the session exists.
pub async fn import_session(store: &dyn Store, text: &str, now_ms: u64) -> Result<ImportReport> {
    let (_, events, state) = parse_export(text)?;
    write_new_session(store, events, &state, now_ms).await
}

/// Writes a whole checked history (`state` is its fold) as a new session, in one atomic
/// append: its events as they are, its status, and, when its turn is in progress, a task
/// for every activity the turn waits for, due at once, so that it goes on (an approval's
/// deadline keeps its time: due early, the timer would be leased like an activity and
/// dropped, and the call would wait forever). `InvalidEvent` when the session exists;
/// nothing is written then.
pub async fn write_new_session(
    store: &dyn Store,
    events: Vec<EventEnvelope>,
    state: &SessionState,
    now_ms: u64,
) -> Result<ImportReport> {
    let session_id = state.session_id.clone();
    let enqueue: Vec<_> = state
        .outstanding_tasks()
        .into_iter()
        .filter_map(|seq| state.queued_task(seq))
        .map(|mut task| {
            if state.approval_timer(task.id.scheduled_seq).is_none() {
                task.visible_at_ms = task.visible_at_ms.min(now_ms);
            }
            task
        })
        .collect();
    let report = ImportReport {
        session_id: session_id.clone(),
        events: events.len() as u64,
        running: state.is_running(),
        tasks: enqueue.len(),
    };
    let recorded_at_ms = events.last().map_or(now_ms, |e| e.recorded_at_ms);
    let request = AppendRequest {
        enqueue,
        ..AppendRequest::new(
            session_id.clone(),
            1,
            events,
            status_of(state),
            recorded_at_ms,
        )
    };
    match store.append(request).await {
        Ok(()) => Ok(report),
        Err(Error::Conflict { .. }) => Err(Error::InvalidEvent {
            session_id,
            seq: 1,
            reason: "the store already has a session of this id; nothing was written".into(),
        }),
        Err(e) => Err(e),
    }
}

/// The verdict on one export file of a folder ([`check_exports`]).
#[derive(Debug)]
pub struct ExportCheck {
    /// The file.
    pub path: std::path::PathBuf,
    /// Its events, when it was read.
    pub events: usize,
    /// Why it does not replay with the current code (the first divergence, named by line),
    /// or why it could not be read; `None` when it replays.
    pub divergence: Option<Error>,
}

/// Replays every export (`*.jsonl`) in `dir`, in name order, with the current code: what a
/// user's CI runs against a folder of exported histories before deploying new workflow code.
/// Each file gets its verdict; only failing to list the folder is an error.
pub fn check_exports(dir: &std::path::Path) -> std::io::Result<Vec<ExportCheck>> {
    let mut paths: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "jsonl"))
        .collect();
    paths.sort();
    Ok(paths
        .into_iter()
        .map(|path| {
            let verdict = std::fs::read_to_string(&path)
                .map_err(|e| Error::InvalidImport {
                    line: 0,
                    reason: format!("cannot read the file: {e}"),
                })
                .and_then(|text| parse_export(&text));
            match verdict {
                Ok((_, events, _)) => ExportCheck {
                    path,
                    events: events.len(),
                    divergence: None,
                },
                Err(e) => ExportCheck {
                    path,
                    events: 0,
                    divergence: Some(e),
                },
            }
        })
        .collect())
}
