//! The task queue's statements: leasing, heartbeats, timers, listing and releasing, each one
//! statement (atomic on its own) with the memory store's semantics in its WHERE clause.

use crate::connections::Connections;
use crate::failure::{retrying, Failure};
use crate::rows::{self, count_to_db, storable, time_to_db, to_db, TASK_COLUMNS};
use cairn_ledger::JsonText;
use cairn_runtime::store::{check_session_id, Lease, Task, TaskFilter, TaskId};
use cairn_runtime::{Error, Result};
use std::collections::BTreeSet;

/// The lease statement ([`lease`]): `$1` now, `$2` the leases' expiry, `$3` the most tasks,
/// `$4`..`$8` the filter's queues, tools, providers, sessions and namespace (NULL: any).
pub(crate) const LEASE: &str = "WITH picked AS ( \
     SELECT session_id, scheduled_seq, visible_at_ms AS was_visible_at_ms \
     FROM cairn_tasks \
     WHERE visible_at_ms <= $1 \
       AND NOT held \
       AND (lease_attempt > 0 OR start_by_ms IS NULL OR start_by_ms > $1) \
       AND ($4::TEXT[] IS NULL OR queue = ANY($4::TEXT[])) \
       AND (target = '' \
            OR (kind = 'tool' AND ($5::TEXT[] IS NULL OR target = ANY($5::TEXT[]))) \
            OR (kind = 'model' AND ($6::TEXT[] IS NULL OR target = ANY($6::TEXT[])))) \
       AND ($7::TEXT[] IS NULL OR session_id = ANY($7::TEXT[])) \
       AND ($8::TEXT IS NULL \
            OR ($8::TEXT = '' AND strpos(session_id, ':') = 0) \
            OR ($8::TEXT <> '' \
                AND substr(session_id, 1, char_length($8::TEXT) + 1) = ($8::TEXT || ':'))) \
     ORDER BY visible_at_ms, session_id COLLATE \"C\", scheduled_seq \
     LIMIT $3 \
     FOR UPDATE SKIP LOCKED \
 ) \
 UPDATE cairn_tasks AS t \
 SET lease_attempt = t.lease_attempt + 1, visible_at_ms = $2, held = TRUE, \
     heartbeat_details = NULL \
 FROM picked \
 WHERE t.session_id = picked.session_id AND t.scheduled_seq = picked.scheduled_seq \
 RETURNING t.session_id, t.scheduled_seq, t.kind, t.lease_attempt, \
     picked.was_visible_at_ms";

/// Leases due tasks that `filter` accepts and that are not overdue, oldest first.
///
/// The subquery picks the tasks in queue order and locks them with `FOR UPDATE SKIP LOCKED`:
/// a task another lease (in this process or another) is taking is skipped rather than waited
/// for, and a task that another lease took and committed since this statement's snapshot is
/// checked again against the WHERE clause on its new version (`held` is then true) and
/// dropped. So no task is handed out twice for one lease attempt.
///
/// The WHERE clause is [`TaskFilter::accepts`] and "not [`Task::overdue`]":
/// - visible (`visible_at_ms <= now`), hence overdue if held (a lapsed lease): `NOT held`;
/// - not past a start deadline without ever having been leased;
/// - its queue among the worker's, when it names queues;
/// - an empty target, or a tool (model) target among the tools (providers) it hosts, when it
///   names them;
/// - its session among the worker's sessions, when it names sessions;
/// - in the worker's namespace: for `""`, an id without `:`; for `ns`, an id starting `ns:`.
pub(crate) async fn lease(
    connections: &Connections,
    now_ms: u64,
    lease_ms: u64,
    max: usize,
    filter: &TaskFilter,
) -> Result<Vec<Lease>> {
    if max == 0 {
        return Ok(Vec::new());
    }
    // Names PostgreSQL text cannot hold match no task: leave them out of the sets.
    let set = |names: &Option<BTreeSet<String>>| -> Option<Vec<String>> {
        names.as_ref().map(|names| {
            names
                .iter()
                .filter(|name| storable(name))
                .cloned()
                .collect()
        })
    };
    let (queues, tools, providers) = (
        set(&filter.queues),
        set(&filter.tools),
        set(&filter.providers),
    );
    let sessions = set(&filter.sessions);
    let namespace = filter.namespace.as_deref();
    if namespace.is_some_and(|namespace| !storable(namespace)) {
        return Ok(Vec::new());
    }
    let now = time_to_db(now_ms);
    let expires_at_ms = now_ms.saturating_add(lease_ms);
    let expires = time_to_db(expires_at_ms);
    let max = count_to_db(max);
    let rows = retrying("leasing tasks", || async {
        let statement = sqlx::query(LEASE)
            .bind(now)
            .bind(expires)
            .bind(max)
            .bind(&queues)
            .bind(&tools)
            .bind(&providers)
            .bind(&sessions)
            .bind(namespace);
        Ok(connections.get().await?.fetch_all(statement).await?)
    })
    .await?;
    // RETURNING has no order: put the leases in queue order (as they stood before the lease).
    let mut leases = Vec::with_capacity(rows.len());
    for row in &rows {
        let was_visible_at_ms: i64 = rows::get(row, "was_visible_at_ms")?;
        let lease = Lease {
            id: rows::task_id(row)?,
            kind: rows::kind_from_db(&rows::get::<String>(row, "kind")?)?,
            lease_attempt: rows::attempt_from_db(rows::get(row, "lease_attempt")?)?,
            expires_at_ms,
        };
        leases.push((was_visible_at_ms, lease));
    }
    leases.sort_by(|a, b| (a.0, &a.1.id).cmp(&(b.0, &b.1.id)));
    Ok(leases.into_iter().map(|(_, lease)| lease).collect())
}

/// Extends a current lease, storing `details` when given: one conditional UPDATE, and when it
/// changes nothing, a read of the task to say why the lease is not current.
pub(crate) async fn extend(
    connections: &Connections,
    id: &TaskId,
    lease_attempt: u32,
    now_ms: u64,
    lease_ms: u64,
    details: Option<JsonText>,
) -> Result<u64> {
    let lost = |reason: String| Error::LeaseLost {
        task: id.to_string(),
        reason,
    };
    let gone = || lost("the task is gone (completed or cancelled)".to_owned());
    // No task of an id that cannot be a session's was ever stored.
    if check_session_id(&id.session_id).is_err() {
        return Err(gone());
    }
    let seq = to_db("scheduled seq", id.scheduled_seq)?;
    let now = time_to_db(now_ms);
    let expires_at_ms = now_ms.saturating_add(lease_ms);
    let expires = time_to_db(expires_at_ms);
    let details = details.as_ref().map(JsonText::as_str);
    let extended = retrying("extending a lease", || async {
        let statement = sqlx::query(
            "UPDATE cairn_tasks \
             SET visible_at_ms = $5, heartbeat_details = COALESCE($6, heartbeat_details) \
             WHERE session_id = $1 AND scheduled_seq = $2 AND lease_attempt = $3 \
               AND visible_at_ms > $4",
        )
        .bind(&id.session_id)
        .bind(seq)
        .bind(i64::from(lease_attempt))
        .bind(now)
        .bind(expires)
        .bind(details);
        let done = connections.get().await?.execute(statement).await?;
        Ok::<_, Failure>(done.rows_affected() == 1)
    })
    .await?;
    if extended {
        return Ok(expires_at_ms);
    }
    let row = retrying("reading a task whose lease was not extended", || async {
        let statement = sqlx::query(
            "SELECT lease_attempt, visible_at_ms FROM cairn_tasks \
             WHERE session_id = $1 AND scheduled_seq = $2",
        )
        .bind(&id.session_id)
        .bind(seq);
        Ok(connections.get().await?.fetch_optional(statement).await?)
    })
    .await?;
    let Some(row) = row else {
        return Err(gone());
    };
    let current = rows::attempt_from_db(rows::get(&row, "lease_attempt")?)?;
    let expiry: i64 = rows::get(&row, "visible_at_ms")?;
    Err(if current != lease_attempt {
        lost(format!(
            "lease attempt {lease_attempt} is stale; the current one is {current}"
        ))
    } else if expiry <= now {
        lost(format!("the lease expired at {expiry} (now {now_ms})"))
    } else {
        // The row changed between the UPDATE and this read (another heartbeat of the same
        // lease, from a worker that retried): this one was not applied.
        lost("the lease changed while it was being extended".to_owned())
    })
}

/// Up to `max` overdue tasks, oldest first: visible, and held (a lapsed lease) or never leased
/// and past its start deadline. Reads only.
pub(crate) async fn overdue(
    connections: &Connections,
    now_ms: u64,
    max: usize,
) -> Result<Vec<Task>> {
    if max == 0 {
        return Ok(Vec::new());
    }
    let now = time_to_db(now_ms);
    let rows = retrying("listing overdue tasks", || async {
        let sql = format!(
            "SELECT {TASK_COLUMNS} FROM cairn_tasks \
             WHERE visible_at_ms <= $1 \
               AND (held OR (lease_attempt = 0 AND start_by_ms IS NOT NULL AND start_by_ms <= $1)) \
             ORDER BY visible_at_ms, session_id COLLATE \"C\", scheduled_seq \
             LIMIT $2"
        );
        let statement = sqlx::query(&sql).bind(now).bind(count_to_db(max));
        Ok(connections.get().await?.fetch_all(statement).await?)
    })
    .await?;
    rows.iter().map(rows::task).collect()
}

/// Every queued task, ordered by id.
pub(crate) async fn list(connections: &Connections) -> Result<Vec<Task>> {
    let rows = retrying("listing tasks", || async {
        let sql = format!(
            "SELECT {TASK_COLUMNS} FROM cairn_tasks \
             ORDER BY session_id COLLATE \"C\", scheduled_seq"
        );
        let statement = sqlx::query(&sql);
        Ok(connections.get().await?.fetch_all(statement).await?)
    })
    .await?;
    rows.iter().map(rows::task).collect()
}

/// The task of this id, if it is queued: one row by its primary key. Reads only.
pub(crate) async fn get(connections: &Connections, id: &TaskId) -> Result<Option<Task>> {
    // No task of an id that cannot be a session's, or of a seq PostgreSQL cannot hold, was
    // ever stored.
    let Ok(seq) = to_db("scheduled seq", id.scheduled_seq) else {
        return Ok(None);
    };
    if check_session_id(&id.session_id).is_err() {
        return Ok(None);
    }
    let row = retrying("reading a task", || async {
        let sql = format!(
            "SELECT {TASK_COLUMNS} FROM cairn_tasks \
             WHERE session_id = $1 AND scheduled_seq = $2"
        );
        let statement = sqlx::query(&sql).bind(&id.session_id).bind(seq);
        Ok(connections.get().await?.fetch_optional(statement).await?)
    })
    .await?;
    row.as_ref().map(rows::task).transpose()
}

/// Releases every leased task, current or lapsed (the memory store's `released_visibility`):
/// no longer held, visible at the earlier of its expiry and now, its lease attempt kept.
pub(crate) async fn release(connections: &Connections, now_ms: u64) -> Result<usize> {
    let now = time_to_db(now_ms);
    let released = retrying("releasing leases", || async {
        let statement = sqlx::query(
            "UPDATE cairn_tasks SET visible_at_ms = LEAST(visible_at_ms, $1), held = FALSE \
             WHERE lease_attempt > 0 AND (held OR visible_at_ms > $1)",
        )
        .bind(now);
        Ok(connections
            .get()
            .await?
            .execute(statement)
            .await?
            .rows_affected())
    })
    .await?;
    usize::try_from(released).map_err(|_| Error::Store {
        reason: format!("released {released} tasks, more than this machine can count"),
    })
}
