//! Values between the runtime's types and the tables' columns: u64 and BIGINT with checks,
//! kinds and statuses as their names, task rows.

use crate::failure::classify;
use cairn_ledger::JsonText;
use cairn_runtime::store::{SessionInfo, SessionStatus, Task, TaskId, TaskKind};
use cairn_runtime::{Error, Result};
use sqlx::postgres::PgRow;
use sqlx::Row;

/// The columns of `cairn_tasks` that [`task`] reads, in a SELECT or RETURNING list.
pub(crate) const TASK_COLUMNS: &str = "session_id, scheduled_seq, kind, visible_at_ms, \
     lease_attempt, queue, target, start_by_ms, held, heartbeat_details";

/// `value` as a BIGINT. Seqs and epoch milliseconds are far below `i64::MAX`; a value past it
/// is refused rather than wrapped into a negative number.
pub(crate) fn to_db(what: &str, value: u64) -> Result<i64> {
    i64::try_from(value).map_err(|_| Error::Store {
        reason: format!("{what} {value} is past the largest value PostgreSQL stores (i64::MAX)"),
    })
}

/// A time in epoch ms as a BIGINT, saturating: `i64::MAX` ms is some 292 million years
/// away, so a later time (a deadline of now plus a timeout meant as "never") means the same,
/// and is stored as a time every other store takes is, not refused.
pub(crate) fn time_to_db(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// A `usize` count or limit as a BIGINT, saturating: asking for more than `i64::MAX` rows is
/// asking for all of them.
pub(crate) fn count_to_db(value: usize) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// A BIGINT column as the u64 it stores; a negative value is bad data.
pub(crate) fn from_db(what: &str, value: i64) -> Result<u64> {
    u64::try_from(value).map_err(|_| Error::Store {
        reason: format!("bad data: {what} {value} is negative"),
    })
}

/// The lease attempt column as the u32 fencing token it stores.
pub(crate) fn attempt_from_db(value: i64) -> Result<u32> {
    u32::try_from(value).map_err(|_| Error::Store {
        reason: format!("bad data: lease attempt {value} is not a u32"),
    })
}

pub(crate) fn kind_name(kind: TaskKind) -> &'static str {
    match kind {
        TaskKind::Model => "model",
        TaskKind::Tool => "tool",
    }
}

pub(crate) fn kind_from_db(name: &str) -> Result<TaskKind> {
    match name {
        "model" => Ok(TaskKind::Model),
        "tool" => Ok(TaskKind::Tool),
        other => Err(Error::Store {
            reason: format!("bad data: unknown task kind {other:?}"),
        }),
    }
}

fn status_from_db(name: &str) -> Result<SessionStatus> {
    [
        SessionStatus::Idle,
        SessionStatus::Running,
        SessionStatus::Cancelled,
    ]
    .into_iter()
    .find(|status| status.as_str() == name)
    .ok_or_else(|| Error::Store {
        reason: format!("bad data: unknown session status {name:?}"),
    })
}

/// One column of `row`.
pub(crate) fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(column)
        .map_err(|e| classify(&format!("reading column {column}"), &e))
}

/// A task id from the `session_id` and `scheduled_seq` columns of `row`.
pub(crate) fn task_id(row: &PgRow) -> Result<TaskId> {
    Ok(TaskId {
        session_id: get(row, "session_id")?,
        scheduled_seq: from_db("scheduled seq", get(row, "scheduled_seq")?)?,
    })
}

/// A task from a row of [`TASK_COLUMNS`].
pub(crate) fn task(row: &PgRow) -> Result<Task> {
    let id = task_id(row)?;
    let heartbeat_details = match get::<Option<String>>(row, "heartbeat_details")? {
        Some(text) => Some(JsonText::parse(text).map_err(|e| Error::Store {
            reason: format!("bad data: heartbeat details of task {id} are not JSON: {e}"),
        })?),
        None => None,
    };
    Ok(Task {
        kind: kind_from_db(&get::<String>(row, "kind")?)?,
        visible_at_ms: from_db("visible_at_ms", get(row, "visible_at_ms")?)?,
        lease_attempt: attempt_from_db(get(row, "lease_attempt")?)?,
        queue: get(row, "queue")?,
        target: get(row, "target")?,
        start_by_ms: get::<Option<i64>>(row, "start_by_ms")?
            .map(|ms| from_db("start_by_ms", ms))
            .transpose()?,
        held: get(row, "held")?,
        heartbeat_details,
        id,
    })
}

/// A session from a row of `session_id, status, last_seq, updated_at_ms`.
/// The status of a deleted session's row, its tombstone (never listed).
pub(crate) const DELETED: &str = "deleted";

pub(crate) fn session(row: &PgRow) -> Result<SessionInfo> {
    Ok(SessionInfo {
        session_id: get(row, "session_id")?,
        status: status_from_db(&get::<String>(row, "status")?)?,
        events: from_db("last_seq", get(row, "last_seq")?)?,
        updated_at_ms: from_db("updated_at_ms", get(row, "updated_at_ms")?)?,
    })
}

/// Whether `text` can be stored in (or compared with) a text column: PostgreSQL's text never
/// holds a NUL byte, so a name with one cannot match anything stored.
pub(crate) fn storable(text: &str) -> bool {
    !text.contains('\0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bigint_bounds_are_checked() {
        assert_eq!(to_db("seq", 7).ok(), Some(7));
        assert_eq!(to_db("seq", i64::MAX as u64).ok(), Some(i64::MAX));
        assert!(matches!(to_db("seq", u64::MAX), Err(Error::Store { .. })));
        assert!(matches!(from_db("seq", -1), Err(Error::Store { .. })));
        assert_eq!(count_to_db(usize::MAX), i64::MAX);
        assert_eq!(time_to_db(u64::MAX), i64::MAX);
        assert_eq!(time_to_db(5), 5);
        assert!(attempt_from_db(i64::from(u32::MAX) + 1).is_err());
    }

    #[test]
    fn names_round_trip() {
        for kind in [TaskKind::Model, TaskKind::Tool] {
            assert_eq!(kind_from_db(kind_name(kind)).ok(), Some(kind));
        }
        for status in [
            SessionStatus::Idle,
            SessionStatus::Running,
            SessionStatus::Cancelled,
        ] {
            assert_eq!(status_from_db(status.as_str()).ok(), Some(status));
        }
        assert!(kind_from_db("gpu").is_err());
    }
}
