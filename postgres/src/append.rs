//! The append: one transaction that checks the session's next seq and the completed task's
//! lease, then writes the events, the session row and the queue changes, or nothing.
//!
//! ```text
//! BEGIN
//! SELECT last_seq FROM cairn_sessions WHERE session_id = $1 FOR UPDATE    -- next seq, row locked
//! SELECT lease_attempt, visible_at_ms FROM cairn_tasks WHERE ... FOR UPDATE  -- with `complete`
//! INSERT INTO cairn_sessions ... / UPDATE cairn_sessions ...              -- when it has events
//! INSERT INTO cairn_events SELECT $1, * FROM UNNEST($2::BIGINT[], $3::BYTEA[])
//! DELETE FROM cairn_tasks WHERE (session_id, scheduled_seq) IN (SELECT * FROM UNNEST(...))
//! INSERT INTO cairn_tasks SELECT ... FROM UNNEST(...) ON CONFLICT ... DO UPDATE  -- re-enqueue resets
//! COMMIT
//! ```
//!
//! Appends to one session queue on its row lock, so each sees the one before it committed. A
//! new session has no row to lock: two first appends race on inserting it, and the loser's
//! unique violation (`23505`; a serialization failure on CockroachDB, which the retry turns
//! into the same answer) becomes `Conflict` with the winner's next seq.

use crate::failure::{retrying, sqlstate, Failure};
use crate::rows::{attempt_from_db, from_db, kind_name, storable, to_db};
use cairn_runtime::codec;
use cairn_runtime::store::{check_session_id, AppendRequest, TaskId};
use cairn_runtime::{Error, Result};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool, Postgres};
use sqlx::{Connection, Row};
use std::collections::BTreeMap;

/// An append checked and converted to column values, before any IO.
pub(crate) struct Prepared<'r> {
    request: &'r AppendRequest,
    session_id: &'r str,
    seqs: Vec<i64>,
    records: Vec<Vec<u8>>,
    status: &'static str,
    now_ms: i64,
    /// The completed task, and its lease attempt; `None` also when the task cannot exist
    /// (an id PostgreSQL cannot store), which the lease check answers as gone.
    complete: Option<(String, i64, u32)>,
    removed: Removed,
    enqueued: Enqueued,
}

/// Task ids to delete, as two parallel arrays for UNNEST.
#[derive(Default)]
struct Removed {
    session_ids: Vec<String>,
    seqs: Vec<i64>,
}

/// Tasks to enqueue, as parallel arrays for UNNEST, one entry per id.
#[derive(Default)]
struct Enqueued {
    session_ids: Vec<String>,
    seqs: Vec<i64>,
    kinds: Vec<&'static str>,
    visible_at_ms: Vec<i64>,
    queues: Vec<String>,
    targets: Vec<String>,
    start_by_ms: Vec<Option<i64>>,
}

/// Checks a request as the memory store does (a valid session id, events with consecutive seqs
/// of the session from `expected_next_seq`) and encodes its events.
pub(crate) fn prepare(request: &AppendRequest) -> Result<Prepared<'_>> {
    check_session_id(&request.session_id)?;
    let mut seqs = Vec::with_capacity(request.events.len());
    let mut records = Vec::with_capacity(request.events.len());
    for (i, event) in request.events.iter().enumerate() {
        let want = u64::try_from(i)
            .ok()
            .and_then(|i| request.expected_next_seq.checked_add(i));
        if event.session_id != request.session_id || Some(event.seq) != want {
            return Err(Error::InvalidEvent {
                session_id: request.session_id.clone(),
                seq: event.seq,
                reason: match want {
                    Some(want) => {
                        format!("append batch position {i} must be seq {want} of this session")
                    }
                    None => format!("append batch position {i} is past the largest seq"),
                },
            });
        }
        seqs.push(to_db("seq", event.seq)?);
        records.push(codec::encode(event)?);
    }
    // An id PostgreSQL cannot store names no queued task: completing it finds the task gone,
    // cancelling it removes nothing.
    let storable_id = |id: &TaskId| {
        let seq = i64::try_from(id.scheduled_seq).ok()?;
        storable(&id.session_id).then(|| (id.session_id.clone(), seq))
    };
    let complete = request.complete.as_ref().and_then(|(id, attempt)| {
        storable_id(id).map(|(session_id, seq)| (session_id, seq, *attempt))
    });
    let mut removed = Removed::default();
    for (session_id, seq) in request
        .complete
        .iter()
        .map(|(id, _)| id)
        .chain(&request.cancel)
        .filter_map(storable_id)
    {
        removed.session_ids.push(session_id);
        removed.seqs.push(seq);
    }
    // One row per id, the last enqueue winning as in the memory store: an INSERT ... ON
    // CONFLICT cannot change one row twice.
    let mut last: BTreeMap<&TaskId, usize> = BTreeMap::new();
    for (i, task) in request.enqueue.iter().enumerate() {
        last.insert(&task.id, i);
    }
    let mut enqueued = Enqueued::default();
    for (i, task) in request.enqueue.iter().enumerate() {
        if last.get(&task.id) != Some(&i) {
            continue;
        }
        for (what, text) in [
            ("session id", &task.id.session_id),
            ("queue", &task.queue),
            ("target", &task.target),
        ] {
            if !storable(text) {
                return Err(Error::Store {
                    reason: format!(
                        "task {}: its {what} {text:?} holds a NUL byte, which PostgreSQL text \
                         cannot store",
                        task.id
                    ),
                });
            }
        }
        enqueued.session_ids.push(task.id.session_id.clone());
        enqueued
            .seqs
            .push(to_db("scheduled seq", task.id.scheduled_seq)?);
        enqueued.kinds.push(kind_name(task.kind));
        enqueued
            .visible_at_ms
            .push(to_db("visible_at_ms", task.visible_at_ms)?);
        enqueued.queues.push(task.queue.clone());
        enqueued.targets.push(task.target.clone());
        enqueued.start_by_ms.push(
            task.start_by_ms
                .map(|ms| to_db("start_by_ms", ms))
                .transpose()?,
        );
    }
    Ok(Prepared {
        request,
        session_id: &request.session_id,
        seqs,
        records,
        status: request.status.as_str(),
        now_ms: to_db("now_ms", request.now_ms)?,
        complete,
        removed,
        enqueued,
    })
}

/// Runs the append transaction, again while it loses races. Answers the connection it
/// committed on, for the hint that follows.
pub(crate) async fn append(
    pool: &PgPool,
    prepared: &Prepared<'_>,
) -> Result<PoolConnection<Postgres>> {
    retrying("appending", || async {
        let mut conn = pool.acquire().await?;
        transaction(&mut conn, prepared).await?;
        Ok(conn)
    })
    .await
}

/// The failure of a first append whose session row another append inserted after this one
/// found none: `Conflict` with the store's next seq as it is now, unless the session turns
/// out not to exist (then the violation was something else, and is answered as it is).
async fn lost_first_append(conn: &mut PgConnection, p: &Prepared<'_>, e: sqlx::Error) -> Failure {
    let row = sqlx::query("SELECT last_seq FROM cairn_sessions WHERE session_id = $1")
        .bind(p.session_id)
        .fetch_optional(&mut *conn)
        .await;
    let last_seq: i64 = match row {
        Ok(Some(row)) => match row.try_get("last_seq") {
            Ok(last_seq) => last_seq,
            Err(e) => return e.into(),
        },
        Ok(None) => return e.into(),
        Err(e) => return e.into(),
    };
    match from_db("last_seq", last_seq) {
        Ok(last_seq) => Failure::Done(Error::Conflict {
            session_id: p.session_id.to_owned(),
            expected: p.request.expected_next_seq,
            actual: last_seq.saturating_add(1),
        }),
        Err(e) => e.into(),
    }
}

async fn transaction(conn: &mut PgConnection, p: &Prepared<'_>) -> Result<(), Failure> {
    let mut tx = conn.begin().await?;
    let last_seq: Option<i64> =
        sqlx::query("SELECT last_seq FROM cairn_sessions WHERE session_id = $1 FOR UPDATE")
            .bind(p.session_id)
            .fetch_optional(&mut *tx)
            .await?
            .map(|row| row.try_get("last_seq"))
            .transpose()?;
    let actual = from_db("last_seq", last_seq.unwrap_or(0))?.saturating_add(1);
    if actual != p.request.expected_next_seq {
        return Err(Error::Conflict {
            session_id: p.session_id.to_owned(),
            expected: p.request.expected_next_seq,
            actual,
        }
        .into());
    }
    if let Some((id, _)) = &p.request.complete {
        check_lease(&mut tx, p, id).await?;
    }
    // The session's event count after the append is its last seq.
    let count = p.seqs.last().copied().or(last_seq).unwrap_or(0);
    if count > 0 {
        // The session row goes first: events reference it, and a new session's insert is where
        // two first appends meet.
        let statement = if last_seq.is_some() {
            "UPDATE cairn_sessions SET status = $2, last_seq = $3, updated_at_ms = $4 \
             WHERE session_id = $1"
        } else {
            "INSERT INTO cairn_sessions (session_id, status, last_seq, updated_at_ms) \
             VALUES ($1, $2, $3, $4)"
        };
        let written = sqlx::query(statement)
            .bind(p.session_id)
            .bind(p.status)
            .bind(count)
            .bind(p.now_ms)
            .execute(&mut *tx)
            .await;
        if let Err(e) = written {
            if last_seq.is_none() && sqlstate(&e).as_deref() == Some("23505") {
                drop(tx);
                return Err(lost_first_append(conn, p, e).await);
            }
            return Err(e.into());
        }
    }
    // Else: nothing recorded for this session yet, and an empty append creates nothing.
    if !p.seqs.is_empty() {
        sqlx::query(
            "INSERT INTO cairn_events (session_id, seq, record) \
             SELECT $1, e.seq, e.record FROM UNNEST($2::BIGINT[], $3::BYTEA[]) AS e (seq, record)",
        )
        .bind(p.session_id)
        .bind(&p.seqs)
        .bind(&p.records)
        .execute(&mut *tx)
        .await?;
    }
    if !p.removed.seqs.is_empty() {
        sqlx::query(
            "DELETE FROM cairn_tasks WHERE (session_id, scheduled_seq) IN \
             (SELECT * FROM UNNEST($1::TEXT[], $2::BIGINT[]))",
        )
        .bind(&p.removed.session_ids)
        .bind(&p.removed.seqs)
        .execute(&mut *tx)
        .await?;
    }
    let e = &p.enqueued;
    if !e.seqs.is_empty() {
        // Enqueueing a queued id replaces the task with a new, never leased one.
        sqlx::query(
            "INSERT INTO cairn_tasks (session_id, scheduled_seq, kind, visible_at_ms, \
                 lease_attempt, queue, target, start_by_ms, held, heartbeat_details) \
             SELECT n.session_id, n.scheduled_seq, n.kind, n.visible_at_ms, 0, n.queue, \
                 n.target, n.start_by_ms, FALSE, NULL \
             FROM UNNEST($1::TEXT[], $2::BIGINT[], $3::TEXT[], $4::BIGINT[], $5::TEXT[], \
                 $6::TEXT[], $7::BIGINT[]) \
                 AS n (session_id, scheduled_seq, kind, visible_at_ms, queue, target, start_by_ms) \
             ON CONFLICT (session_id, scheduled_seq) DO UPDATE SET \
                 kind = EXCLUDED.kind, visible_at_ms = EXCLUDED.visible_at_ms, \
                 lease_attempt = 0, queue = EXCLUDED.queue, target = EXCLUDED.target, \
                 start_by_ms = EXCLUDED.start_by_ms, held = FALSE, heartbeat_details = NULL",
        )
        .bind(&e.session_ids)
        .bind(&e.seqs)
        .bind(&e.kinds)
        .bind(&e.visible_at_ms)
        .bind(&e.queues)
        .bind(&e.targets)
        .bind(&e.start_by_ms)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The memory store's lease check of `complete` (`lease_current`), on the task's row locked
/// until the append commits, so no lease or heartbeat slips in between.
async fn check_lease(tx: &mut PgConnection, p: &Prepared<'_>, id: &TaskId) -> Result<(), Failure> {
    let lost = |reason: String| {
        Failure::Done(Error::LeaseLost {
            task: id.to_string(),
            reason,
        })
    };
    let gone = || lost("the task is gone (completed or cancelled)".to_owned());
    let Some((session_id, scheduled_seq, attempt)) = &p.complete else {
        return Err(gone());
    };
    let row = sqlx::query(
        "SELECT lease_attempt, visible_at_ms FROM cairn_tasks \
         WHERE session_id = $1 AND scheduled_seq = $2 FOR UPDATE",
    )
    .bind(session_id)
    .bind(scheduled_seq)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        return Err(gone());
    };
    let current = attempt_from_db(row.try_get("lease_attempt")?)?;
    let expires_at_ms: i64 = row.try_get("visible_at_ms")?;
    if current != *attempt {
        return Err(lost(format!(
            "lease attempt {attempt} is stale; the current one is {current}"
        )));
    }
    if expires_at_ms <= p.now_ms {
        return Err(lost(format!(
            "the lease expired at {expires_at_ms} (now {})",
            p.now_ms
        )));
    }
    Ok(())
}
