//! Deleting a finished session: one transaction that locks the session's row, checks that no
//! turn runs and no task is queued, removes the events and turns the row into the session's
//! tombstone (status `deleted`), which appends find under the same lock: the id is never used
//! again.

use crate::connections::Connections;
use crate::failure::{retrying, Failure};
use crate::rows::{self, time_to_db, DELETED};
use cairn_runtime::store::{check_deletable, check_session_id, SessionInfo};
use cairn_runtime::{Error, Result};
use sqlx::Connection;

/// [`Store::delete_session`](cairn_runtime::store::Store::delete_session) on PostgreSQL.
pub(crate) async fn delete(
    connections: &Connections,
    session_id: &str,
    now_ms: u64,
) -> Result<SessionInfo> {
    let unknown = || Error::UnknownSession {
        session_id: session_id.to_owned(),
    };
    // No session of an invalid id was ever stored (appends check ids).
    if check_session_id(session_id).is_err() {
        return Err(unknown());
    }
    let now = time_to_db(now_ms);
    retrying("deleting a session", || async {
        let mut held = connections.get().await?;
        let mut tx = held.raw().begin().await?;
        let row = sqlx::query(
            "SELECT session_id, status, last_seq, updated_at_ms FROM cairn_sessions \
             WHERE session_id = $1 FOR UPDATE",
        )
        .bind(session_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Err(Failure::Done(unknown()));
        };
        if rows::get::<String>(&row, "status")? == DELETED {
            return Err(Failure::Done(unknown()));
        }
        let info = rows::session(&row)?;
        // Appends lock the row first, so no task of the session can be queued meanwhile.
        let task = sqlx::query(&format!(
            "SELECT {} FROM cairn_tasks WHERE session_id = $1 ORDER BY scheduled_seq LIMIT 1",
            rows::TASK_COLUMNS
        ))
        .bind(session_id)
        .fetch_optional(&mut *tx)
        .await?;
        let task = task.as_ref().map(rows::task).transpose()?;
        check_deletable(&info, task.as_ref())?;
        sqlx::query("DELETE FROM cairn_events WHERE session_id = $1")
            .bind(session_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "UPDATE cairn_sessions SET status = $2, updated_at_ms = $3 WHERE session_id = $1",
        )
        .bind(session_id)
        .bind(DELETED)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(info)
    })
    .await
}

/// Records a tombstone for an id with no row here (a session deleted in the store a copy
/// comes from): a row with the status `deleted` and no events, as a delete leaves. Already
/// deleted here: nothing to do. A live session of the id: `InvalidEvent`, nothing written.
pub(crate) async fn record_deleted(
    connections: &Connections,
    session_id: &str,
    now_ms: u64,
) -> Result<bool> {
    check_session_id(session_id)?;
    let now = time_to_db(now_ms);
    retrying("recording a deleted session", || async {
        let mut held = connections.get().await?;
        let mut tx = held.raw().begin().await?;
        sqlx::query(
            "INSERT INTO cairn_sessions (session_id, status, last_seq, updated_at_ms) \
             VALUES ($1, $2, 1, $3) ON CONFLICT (session_id) DO NOTHING",
        )
        .bind(session_id)
        .bind(DELETED)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query("SELECT status FROM cairn_sessions WHERE session_id = $1")
            .bind(session_id)
            .fetch_one(&mut *tx)
            .await?;
        if rows::get::<String>(&row, "status")? != DELETED {
            return Err(Failure::Done(Error::InvalidEvent {
                session_id: session_id.to_owned(),
                seq: 0,
                reason: "the store holds a session of this id; it was not deleted here".into(),
            }));
        }
        tx.commit().await?;
        Ok(true)
    })
    .await
}
