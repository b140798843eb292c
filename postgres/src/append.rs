//! The append: one statement that checks the session's next seq, the completed tasks' leases
//! and that the fenced task is unchanged, then writes the events, the session row and the
//! queue changes, or nothing.
//!
//! One statement rather than a transaction of six to eight: every statement is a round trip
//! and a parse-bind-execute in the backend, and PostgreSQL's CPU is what a durable turn on this
//! store is bound by. The statement is a chain of data-modifying CTEs (see [`APPEND`]):
//!
//! ```text
//! WITH s  AS (SELECT last_seq ... FROM cairn_sessions ... FOR UPDATE)          -- next seq, row locked
//!      l  AS (SELECT ..., lease_attempt, visible_at_ms FROM cairn_tasks ... FOR UPDATE) -- `complete`
//!      f  AS (SELECT lease_attempt, visible_at_ms, held ... FOR UPDATE)    -- with a fenced drop
//!      ok AS (the seq, the lease and the fence checks)
//!      UPDATE / INSERT cairn_sessions, INSERT cairn_events (UNNEST), DELETE and upsert
//!      cairn_tasks (UNNEST)                                 -- each only WHERE the checks passed
//! SELECT ok, last_seq, the completed tasks' leases, the fenced task  -- why, when they failed
//! ```
//!
//! It runs as its own transaction: when a check fails, nothing is written and the answer says
//! which. Appends to one session queue on its row lock (`FOR UPDATE` waits, then reads the
//! row as the append before it committed it), so each sees the one before. A new session has
//! no row to lock: two first appends race on inserting it, and the loser's unique violation
//! (`23505`; a serialization failure on CockroachDB, which the retry turns into the same
//! answer) becomes `Conflict` with the winner's next seq. The sub-statements never touch one
//! row twice, which PostgreSQL leaves unpredictable: a task both removed and enqueued is only
//! enqueued (the upsert replaces it anyway).
//!
//! The fenced task's row is locked like the completed ones': a lease (`FOR UPDATE SKIP
//! LOCKED`) skips it while the append runs and finds it gone after, a heartbeat's UPDATE
//! waits and then finds it gone; and a lease or heartbeat that committed first is what the
//! lock reads (READ COMMITTED reads the newest version of a row it locks), so the fence sees
//! it and refuses the append.

use crate::connections::{Connections, Held};
use crate::failure::{retrying, sqlstate, Failure};
use crate::rows::{attempt_from_db, from_db, kind_name, storable, time_to_db, to_db};
use cairn_runtime::codec;
use cairn_runtime::store::{
    check_session_id, AppendRequest, Lease, LeaseRequest, Task, TaskFence, TaskId,
};
use cairn_runtime::{Error, Result};
use sqlx::postgres::PgRow;
use sqlx::Row;
use std::collections::BTreeMap;

/// An append checked and converted to column values, before any IO.
pub(crate) struct Prepared<'r> {
    request: &'r AppendRequest,
    session_id: &'r str,
    seqs: Vec<i64>,
    records: Vec<Vec<u8>>,
    status: &'static str,
    now_ms: i64,
    /// The completed tasks with their lease attempts, as parallel arrays for UNNEST. A task
    /// whose id PostgreSQL cannot store is left out: it cannot exist, so the lease check,
    /// which counts the current leases against `request.complete`, answers it as gone.
    completed: Completed,
    /// The task to drop only if unchanged, as column values: its session and scheduled seq
    /// (`None` when the id cannot be stored: the task is gone, the fence check fails), lease
    /// attempt, visibility time and holder flag.
    fenced: Option<Fenced>,
    removed: Removed,
    enqueued: Enqueued,
}

/// [`AppendRequest::drop_if_unchanged`] as column values.
struct Fenced {
    id: Option<(String, i64)>,
    lease_attempt: i64,
    visible_at_ms: i64,
    held: bool,
}

/// Completed tasks and the lease attempts that ran them, as parallel arrays for UNNEST.
#[derive(Default)]
struct Completed {
    session_ids: Vec<String>,
    seqs: Vec<i64>,
    attempts: Vec<i64>,
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
    /// 0, or 1 for a task leased as it is queued ([`Prepared::lease_queued`]).
    lease_attempts: Vec<i64>,
    /// Whether a worker holds it from the start (leased as it is queued).
    held: Vec<bool>,
    /// Where each came from in the request's `enqueue`.
    sources: Vec<usize>,
}

/// Checks a request as the memory store does (a valid session id, events with consecutive seqs
/// of the session from `expected_next_seq`) and encodes its events.
pub(crate) fn prepare(request: &AppendRequest) -> Result<Prepared<'_>> {
    check_session_id(&request.session_id)?;
    cairn_runtime::store::check_expected_seq(request)?;
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
    let mut completed = Completed::default();
    for (id, attempt) in &request.complete {
        if let Some((session_id, seq)) = storable_id(id) {
            completed.session_ids.push(session_id);
            completed.seqs.push(seq);
            completed.attempts.push(i64::from(*attempt));
        }
    }
    let fenced = request.drop_if_unchanged.as_ref().map(|fence| Fenced {
        id: storable_id(&fence.id),
        lease_attempt: i64::from(fence.lease_attempt),
        visible_at_ms: time_to_db(fence.visible_at_ms),
        held: fence.held,
    });
    // One row per id, the last enqueue winning as in the memory store: an INSERT ... ON
    // CONFLICT cannot change one row twice.
    let mut last: BTreeMap<&TaskId, usize> = BTreeMap::new();
    for (i, task) in request.enqueue.iter().enumerate() {
        last.insert(&task.id, i);
    }
    // A task both removed and enqueued is only enqueued: the upsert replaces it with a new,
    // never leased one, which is what removing it first gave; and one statement must not
    // change a row twice.
    let mut removed = Removed::default();
    for (session_id, seq) in request
        .complete
        .iter()
        .map(|(id, _)| id)
        .chain(&request.cancel)
        .chain(request.drop_if_unchanged.iter().map(|fence| &fence.id))
        .filter(|id| !last.contains_key(id))
        .filter_map(storable_id)
    {
        removed.session_ids.push(session_id);
        removed.seqs.push(seq);
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
        enqueued.visible_at_ms.push(time_to_db(task.visible_at_ms));
        enqueued.queues.push(task.queue.clone());
        enqueued.targets.push(task.target.clone());
        enqueued.start_by_ms.push(task.start_by_ms.map(time_to_db));
        enqueued.lease_attempts.push(0);
        enqueued.held.push(false);
        enqueued.sources.push(i);
    }
    Ok(Prepared {
        request,
        session_id: &request.session_id,
        seqs,
        records,
        status: request.status.as_str(),
        now_ms: time_to_db(request.now_ms),
        completed,
        fenced,
        removed,
        enqueued,
    })
}

impl Prepared<'_> {
    /// Leases up to `lease.max` of the tasks this append queues, as they are queued: those
    /// `lease.filter` accepts and that are due at the append's time, oldest first. They are
    /// written held, at attempt 1, until now + `lease.lease_ms`, by the append's own statement,
    /// so they are durable with it and cost no statement of their own; the leases are the
    /// answer once the append succeeds. Tasks queued before this append are left to leases.
    pub(crate) fn lease_queued(&mut self, lease: &LeaseRequest) -> Result<Vec<Lease>> {
        let now_ms = self.request.now_ms;
        let expires_at_ms = now_ms.saturating_add(lease.lease_ms);
        let expires = time_to_db(expires_at_ms);
        let mut due: Vec<(u64, &TaskId, usize)> = Vec::new();
        for (at, &source) in self.enqueued.sources.iter().enumerate() {
            let task = &self.request.enqueue[source];
            let queued = Task::queued(task);
            if queued.visible_at_ms <= now_ms
                && queued.overdue(now_ms).is_none()
                && lease.filter.accepts(&queued)
            {
                due.push((task.visible_at_ms, &task.id, at));
            }
        }
        due.sort();
        let mut leases = Vec::new();
        for (_, _, at) in due.into_iter().take(lease.max) {
            let task = &self.request.enqueue[self.enqueued.sources[at]];
            self.enqueued.lease_attempts[at] = 1;
            self.enqueued.held[at] = true;
            self.enqueued.visible_at_ms[at] = expires;
            leases.push(Lease {
                id: task.id.clone(),
                kind: task.kind,
                lease_attempt: 1,
                expires_at_ms,
            });
        }
        Ok(leases)
    }

    /// How many queued tasks the append deletes, if they are there: each leaves a dead row.
    pub(crate) fn removes(&self) -> u64 {
        self.removed.seqs.len() as u64
    }

    /// Whether the append queues a task no lease took with it.
    pub(crate) fn queues_unleased(&self) -> bool {
        self.enqueued.held.iter().any(|held| !held)
    }
}

/// The append statement. Parameters: `$1` session id, `$2` the last seq the append expects
/// (its first seq − 1), `$3` status, `$4` the new last seq (NULL without events), `$5` now,
/// `$6`/`$7` the events' seqs and records, `$8` how many tasks it completes, `$9`/`$10`/`$11`
/// their sessions, scheduled seqs and lease attempts (those whose ids can be stored),
/// `$12`/`$13` the tasks to remove, `$14`..`$22` the tasks to enqueue (`$21` and `$22` their
/// lease attempts and holder flags: 0 and false, but for tasks leased as they are queued),
/// `$23` whether it drops a task only if unchanged, `$24`/`$25` that task's session and
/// scheduled seq (NULL when the id cannot be stored), `$26`/`$27`/`$28` its lease attempt,
/// visibility time and holder flag as the caller read them (the task is also among those to
/// remove).
///
/// The checks are evaluated once (`ok`, materialized) and every write is conditional on them;
/// the last SELECT says what the checks found. The session row is written before the events
/// that reference it: foreign keys are checked at the end of the statement, when a new
/// session's row is there.
pub(crate) const APPEND: &str = "\
WITH s AS MATERIALIZED ( \
    SELECT last_seq, status FROM cairn_sessions WHERE session_id = $1 FOR UPDATE \
), l AS MATERIALIZED ( \
    SELECT t.session_id, t.scheduled_seq, t.lease_attempt, t.visible_at_ms \
    FROM (SELECT DISTINCT * FROM UNNEST($9::TEXT[], $10::BIGINT[])) AS c (session_id, seq), \
    LATERAL ( \
        SELECT session_id, scheduled_seq, lease_attempt, visible_at_ms FROM cairn_tasks \
        WHERE session_id = c.session_id AND scheduled_seq = c.seq FOR UPDATE \
    ) AS t \
), f AS MATERIALIZED ( \
    SELECT lease_attempt, visible_at_ms, held FROM cairn_tasks \
    WHERE $23 AND session_id = $24 AND scheduled_seq = $25 FOR UPDATE \
), ok AS MATERIALIZED ( \
    SELECT COALESCE((SELECT last_seq FROM s), 0) = $2 \
       AND COALESCE((SELECT status FROM s), '') <> 'deleted' \
       AND (SELECT count(*) FROM l JOIN UNNEST($9::TEXT[], $10::BIGINT[], $11::BIGINT[]) \
                AS c (session_id, scheduled_seq, lease_attempt) \
                ON l.session_id = c.session_id AND l.scheduled_seq = c.scheduled_seq \
            WHERE l.lease_attempt = c.lease_attempt AND l.visible_at_ms > $5) = $8 \
       AND (NOT $23 OR EXISTS ( \
            SELECT 1 FROM f WHERE lease_attempt = $26 AND visible_at_ms = $27 AND held = $28)) \
       AS passed \
), session_updated AS ( \
    UPDATE cairn_sessions SET status = $3, last_seq = COALESCE($4, last_seq), updated_at_ms = $5 \
    WHERE session_id = $1 AND (SELECT passed FROM ok) \
    RETURNING 1 \
), session_inserted AS ( \
    INSERT INTO cairn_sessions (session_id, status, last_seq, updated_at_ms) \
    SELECT $1, $3, $4, $5 \
    WHERE (SELECT passed FROM ok) AND $4 IS NOT NULL AND NOT EXISTS (SELECT 1 FROM s) \
    RETURNING 1 \
), events_inserted AS ( \
    INSERT INTO cairn_events (session_id, seq, record) \
    SELECT $1, e.seq, e.record FROM UNNEST($6::BIGINT[], $7::BYTEA[]) AS e (seq, record) \
    WHERE (SELECT passed FROM ok) \
    RETURNING 1 \
), tasks_removed AS ( \
    DELETE FROM cairn_tasks \
    WHERE session_id = ANY($12::TEXT[]) AND scheduled_seq = ANY($13::BIGINT[]) \
      AND (session_id, scheduled_seq) IN (SELECT * FROM UNNEST($12::TEXT[], $13::BIGINT[])) \
      AND (SELECT passed FROM ok) \
    RETURNING 1 \
), tasks_enqueued AS ( \
    INSERT INTO cairn_tasks (session_id, scheduled_seq, kind, visible_at_ms, lease_attempt, \
        queue, target, start_by_ms, held, heartbeat_details) \
    SELECT n.session_id, n.scheduled_seq, n.kind, n.visible_at_ms, n.lease_attempt, n.queue, \
        n.target, n.start_by_ms, n.held, NULL \
    FROM UNNEST($14::TEXT[], $15::BIGINT[], $16::TEXT[], $17::BIGINT[], $18::TEXT[], \
        $19::TEXT[], $20::BIGINT[], $21::BIGINT[], $22::BOOLEAN[]) \
        AS n (session_id, scheduled_seq, kind, visible_at_ms, queue, target, start_by_ms, \
            lease_attempt, held) \
    WHERE (SELECT passed FROM ok) \
    ON CONFLICT (session_id, scheduled_seq) DO UPDATE SET \
        kind = EXCLUDED.kind, visible_at_ms = EXCLUDED.visible_at_ms, \
        lease_attempt = EXCLUDED.lease_attempt, queue = EXCLUDED.queue, \
        target = EXCLUDED.target, start_by_ms = EXCLUDED.start_by_ms, held = EXCLUDED.held, \
        heartbeat_details = NULL \
    RETURNING 1 \
) \
SELECT (SELECT passed FROM ok) AS passed, (SELECT last_seq FROM s) AS last_seq, \
    (SELECT status FROM s) AS status, \
    (SELECT array_agg(session_id) FROM l) AS leased_sessions, \
    (SELECT array_agg(scheduled_seq) FROM l) AS leased_seqs, \
    (SELECT array_agg(lease_attempt) FROM l) AS lease_attempts, \
    (SELECT array_agg(visible_at_ms) FROM l) AS lease_expiries, \
    (SELECT lease_attempt FROM f) AS fenced_attempt, \
    (SELECT visible_at_ms FROM f) AS fenced_visible_at_ms, (SELECT held FROM f) AS fenced_held";

/// Runs the append statement, again while it loses races.
pub(crate) async fn append(connections: &Connections, prepared: &Prepared<'_>) -> Result<()> {
    retrying("appending", || async {
        let mut conn = connections.get().await?;
        statement(&mut conn, prepared).await
    })
    .await
}

/// The failure of a first append whose session row another append inserted after this one
/// found none: `Conflict` with the store's next seq as it is now, unless the session turns
/// out not to exist (then the violation was something else, and is answered as it is).
async fn lost_first_append(conn: &mut Held, p: &Prepared<'_>, e: sqlx::Error) -> Failure {
    let row = conn
        .fetch_optional(
            sqlx::query("SELECT last_seq FROM cairn_sessions WHERE session_id = $1")
                .bind(p.session_id),
        )
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

async fn statement(conn: &mut Held, p: &Prepared<'_>) -> Result<(), Failure> {
    let expected_last = to_db(
        "expected next seq",
        p.request.expected_next_seq.saturating_sub(1),
    )?;
    let completions = i64::try_from(p.request.complete.len()).unwrap_or(i64::MAX);
    let (fenced_session, fenced_seq) = match p.fenced.as_ref().and_then(|f| f.id.as_ref()) {
        Some((session_id, seq)) => (Some(session_id.as_str()), Some(*seq)),
        None => (None, None),
    };
    let e = &p.enqueued;
    let statement = sqlx::query(APPEND)
        .bind(p.session_id)
        .bind(expected_last)
        .bind(p.status)
        .bind(p.seqs.last().copied())
        .bind(p.now_ms)
        .bind(&p.seqs)
        .bind(&p.records)
        .bind(completions)
        .bind(&p.completed.session_ids)
        .bind(&p.completed.seqs)
        .bind(&p.completed.attempts)
        .bind(&p.removed.session_ids)
        .bind(&p.removed.seqs)
        .bind(&e.session_ids)
        .bind(&e.seqs)
        .bind(&e.kinds)
        .bind(&e.visible_at_ms)
        .bind(&e.queues)
        .bind(&e.targets)
        .bind(&e.start_by_ms)
        .bind(&e.lease_attempts)
        .bind(&e.held)
        .bind(p.fenced.is_some())
        .bind(fenced_session)
        .bind(fenced_seq)
        .bind(p.fenced.as_ref().map(|f| f.lease_attempt))
        .bind(p.fenced.as_ref().map(|f| f.visible_at_ms))
        .bind(p.fenced.as_ref().map(|f| f.held));
    let row = match conn.fetch_one(statement).await {
        Ok(row) => row,
        // Two first appends of a session met on its row (or on its first event).
        Err(e) if p.request.expected_next_seq == 1 && sqlstate(&e).as_deref() == Some("23505") => {
            return Err(lost_first_append(conn, p, e).await)
        }
        Err(e) => return Err(e.into()),
    };
    let passed: bool = row.try_get("passed")?;
    if passed {
        return Ok(());
    }
    let status: Option<String> = row.try_get("status")?;
    if status.as_deref() == Some(crate::rows::DELETED) {
        return Err(Error::SessionDeleted {
            session_id: p.session_id.to_owned(),
        }
        .into());
    }
    let last_seq: Option<i64> = row.try_get("last_seq")?;
    let actual = from_db("last_seq", last_seq.unwrap_or(0))?.saturating_add(1);
    if actual != p.request.expected_next_seq {
        return Err(Error::Conflict {
            session_id: p.session_id.to_owned(),
            expected: p.request.expected_next_seq,
            actual,
        }
        .into());
    }
    if let Some(lost) = lease_lost(p, &row)? {
        return Err(lost);
    }
    Err(fence_refused(p, &row))
}

/// Why the fenced task is not as its caller read it: the fence's own check
/// ([`TaskFence::check`]) on the task row the append found, or on nothing when it is gone.
fn fence_refused(p: &Prepared<'_>, row: &PgRow) -> Failure {
    let Some(fence) = &p.request.drop_if_unchanged else {
        return Failure::Done(Error::Store {
            reason: "an append failed none of its checks yet was not written".to_owned(),
        });
    };
    let found = match fenced_task(row, fence) {
        Ok(found) => found,
        Err(failure) => return failure,
    };
    match fence.check(found.as_ref()) {
        Err(e) => Failure::Done(e),
        // The statement saw a change this row does not show: refused all the same.
        Ok(()) => Failure::Done(Error::LeaseLost {
            task: fence.id.to_string(),
            reason: "the task changed while the append ran".to_owned(),
        }),
    }
}

/// The fence of the fenced task as the append found its row; `None` when there was none.
fn fenced_task(row: &PgRow, fence: &TaskFence) -> Result<Option<TaskFence>, Failure> {
    let attempt: Option<i64> = row.try_get("fenced_attempt")?;
    let visible_at_ms: Option<i64> = row.try_get("fenced_visible_at_ms")?;
    let held: Option<bool> = row.try_get("fenced_held")?;
    let (Some(attempt), Some(visible_at_ms), Some(held)) = (attempt, visible_at_ms, held) else {
        return Ok(None);
    };
    Ok(Some(TaskFence {
        id: fence.id.clone(),
        lease_attempt: attempt_from_db(attempt)?,
        visible_at_ms: from_db("visible_at_ms", visible_at_ms)?,
        held,
    }))
}

/// The leases of the completed tasks as the append found their rows: session, scheduled
/// seq, lease attempt and expiry of each task that is there.
fn found_leases(row: &PgRow) -> Result<Vec<(String, i64, i64, i64)>, Failure> {
    let sessions: Option<Vec<String>> = row.try_get("leased_sessions")?;
    let seqs: Option<Vec<i64>> = row.try_get("leased_seqs")?;
    let attempts: Option<Vec<i64>> = row.try_get("lease_attempts")?;
    let expiries: Option<Vec<i64>> = row.try_get("lease_expiries")?;
    let mut found = Vec::new();
    for (((session_id, seq), attempt), expiry) in sessions
        .unwrap_or_default()
        .into_iter()
        .zip(seqs.unwrap_or_default())
        .zip(attempts.unwrap_or_default())
        .zip(expiries.unwrap_or_default())
    {
        found.push((session_id, seq, attempt, expiry));
    }
    Ok(found)
}

/// Why the first completed task whose lease is not current is not (the memory store's
/// `lease_current`), from the task rows the append found; `None` when every lease is current.
fn lease_lost(p: &Prepared<'_>, row: &PgRow) -> Result<Option<Failure>, Failure> {
    if p.request.complete.is_empty() {
        return Ok(None);
    }
    let found = found_leases(row)?;
    for (id, attempt) in &p.request.complete {
        let lost = |reason: String| {
            Failure::Done(Error::LeaseLost {
                task: id.to_string(),
                reason,
            })
        };
        let lease = found.iter().find(|(session_id, seq, _, _)| {
            *session_id == id.session_id && i64::try_from(id.scheduled_seq).ok() == Some(*seq)
        });
        let Some((_, _, current, expires_at_ms)) = lease else {
            return Ok(Some(lost(
                "the task is gone (completed or cancelled)".to_owned(),
            )));
        };
        let current = attempt_from_db(*current)?;
        if current != *attempt {
            return Ok(Some(lost(format!(
                "lease attempt {attempt} is stale; the current one is {current}"
            ))));
        }
        if *expires_at_ms <= p.now_ms {
            return Ok(Some(lost(format!(
                "the lease expired at {expires_at_ms} (now {})",
                p.now_ms
            ))));
        }
    }
    Ok(None)
}
