//! [`PgStore`]: connecting (pool, migrations) and the [`Store`] operations, each one statement
//! or one transaction (the queue's in `tasks`, the append's in `append`).

use crate::append;
use crate::changes::{application_name, Hints, Origin};
use crate::commits::Commits;
use crate::connections::Connections;
use crate::failure::{classify, retrying};
use crate::rows::{self, count_to_db};
use crate::tasks;
use crate::upkeep::QueueUpkeep;
use crate::url::redact;
use async_trait::async_trait;
use cairn_ledger::JsonText;
use cairn_runtime::codec;
use cairn_runtime::event::EventEnvelope;
use cairn_runtime::store::{
    check_session_id, AppendRequest, Lease, LeaseRequest, SessionInfo, Store, StoreChange,
    SyncTimes, Task, TaskFilter, TaskId,
};
use cairn_runtime::{Error, Result};
use sqlx::migrate::MigrateError;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::Row;
use std::str::FromStr;
use std::time::Duration;
use tokio::sync::broadcast;

/// How a [`PgStore`] uses the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgOptions {
    /// The most connections the store's pool opens (the change listener has one more of its
    /// own, once someone subscribes). Default 10.
    pub max_connections: u32,
    /// How long an operation waits for a pooled connection before it fails with
    /// [`Error::StoreUnavailable`]. Default 5 s.
    pub acquire_timeout: Duration,
    /// Whether appends send a NOTIFY hint and [`Store::subscribe_changes`] listens for the
    /// hints of other processes. Off, subscribers hear nothing, and engines rely on polling the
    /// store alone. Default on.
    pub notify: bool,
    /// The longest one statement may run (PostgreSQL's `statement_timeout`), so that an
    /// operation held up by a lock or an overloaded server fails ([`Error::StoreUnavailable`],
    /// SQLSTATE 57014) rather than hanging a request. Default 30 s.
    pub statement_timeout: Duration,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            notify: true,
            statement_timeout: Duration::from_secs(30),
        }
    }
}

/// The store on a PostgreSQL database, which several processes may share (see the crate
/// documentation for the schema and the statements).
pub struct PgStore {
    connections: Connections,
    hints: Hints,
    /// The URL without its password, for errors.
    shown_url: String,
    /// The writes this handle committed, timed.
    commits: Commits,
    /// The dead queue rows this handle's writes left, and the task that vacuums them.
    upkeep: QueueUpkeep,
}

/// How many times connecting runs the migrations when they fail: two processes starting on a
/// new database create the tables at once, and the loser finds them on its next run.
const MIGRATION_TRIES: u32 = 3;

impl PgStore {
    /// Connects to the database at `url` (`postgres://user:password@host:port/database`),
    /// creates or upgrades cairn's tables (the embedded migrations), and returns the store.
    ///
    /// Errors name the URL without its password: [`Error::StoreUnavailable`] when the server
    /// cannot be reached now (retryable), [`Error::StoreOpen`] otherwise (a bad URL, refused
    /// credentials, a schema this version does not know).
    pub async fn connect(url: &str, options: PgOptions) -> Result<PgStore> {
        let shown_url = redact(url);
        let open_error = |reason: String| Error::StoreOpen {
            path: shown_url.clone(),
            reason,
        };
        // sqlx reads any scheme as PostgreSQL's: refuse the others here, so that a URL meant
        // for another database is named as such, not tried.
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(open_error(
                "not a PostgreSQL URL (postgres://user:password@host:port/database)".to_owned(),
            ));
        }
        let origin = Origin::random();
        let connect_options = PgConnectOptions::from_str(url)
            .map_err(|e| open_error(format!("not a PostgreSQL URL: {e}")))?
            // Named for this handle, so that the others see it is there (`changes`).
            .application_name(&application_name(origin))
            // An `Ok` from an append must mean durable, whatever the server's or the role's
            // default: session-start options override both.
            .options([
                ("synchronous_commit", "on".to_owned()),
                (
                    "statement_timeout",
                    options.statement_timeout.as_millis().max(1).to_string(),
                ),
            ]);
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| open_error(format!("connecting needs a tokio runtime: {e}")))?;
        let failed = |what: &str, e: &sqlx::Error| match classify(what, e) {
            Error::StoreUnavailable { reason } => Error::StoreUnavailable {
                reason: format!("PostgreSQL at {shown_url}: {reason}"),
            },
            _ => open_error(format!("{what}: {e}")),
        };
        let connections = Connections::new(
            connect_options.clone(),
            options.max_connections,
            options.acquire_timeout,
        )
        .map_err(open_error)?;
        // The first connection now, so that an unreachable server or refused credentials are
        // this call's error; the migrations run on it.
        let mut first = connections
            .get()
            .await
            .map_err(|e| failed("connecting", &e))?;
        migrate(first.raw()).await.map_err(|e| match e {
            MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _) => {
                failed("creating cairn's tables", &e)
            }
            e => open_error(format!("creating cairn's tables: {e}")),
        })?;
        drop(first);
        let source = options.notify.then(|| {
            // One connection, kept for good (no idle or age limit): a LISTEN lives as long as
            // its connection.
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(options.acquire_timeout)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_lazy_with(connect_options);
            (pool, runtime.clone())
        });
        let hints = Hints::new(origin, &connections, source, options.acquire_timeout);
        let upkeep = QueueUpkeep::start(&connections, &runtime);
        Ok(PgStore {
            connections,
            hints,
            shown_url,
            commits: Commits::default(),
            upkeep,
        })
    }

    /// The database's URL without its password.
    pub fn url(&self) -> &str {
        &self.shown_url
    }

    /// Closes the store's connections: operations fail with [`Error::StoreUnavailable`] from
    /// then on. Waits for the connections in use to come back.
    pub async fn close(&self) {
        self.hints.stop();
        self.upkeep.stop();
        self.connections.close().await;
    }
}

/// Runs the embedded migrations (`postgres/migrations/`), without sqlx's advisory lock, which
/// CockroachDB does not have: every statement of a migration tolerates a concurrent creator,
/// and a migration that lost such a race runs again and finds its work done.
#[allow(clippy::disallowed_methods)] // the pause between tries is real time, by design
async fn migrate(connection: &mut PgConnection) -> Result<(), MigrateError> {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.set_locking(false);
    let mut tries = 0;
    loop {
        tries += 1;
        match migrator.run_direct(connection).await {
            Err(MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _))
                if tries < MIGRATION_TRIES =>
            {
                tracing::debug!(error = %e, tries, "creating cairn's tables failed; trying again");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            outcome => return outcome,
        }
    }
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("url", &self.shown_url)
            .finish_non_exhaustive()
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        self.hints.stop();
        self.upkeep.stop();
    }
}

impl PgStore {
    /// Appends, leasing with `lease` among the tasks the append queues, then hints the
    /// change (a task leased with the append wakes nobody).
    async fn append_leasing(
        &self,
        request: &AppendRequest,
        lease: Option<&LeaseRequest>,
    ) -> Result<Vec<Lease>> {
        let mut prepared = append::prepare(request)?;
        let leases = match lease {
            Some(lease) => prepared.lease_queued(lease)?,
            None => Vec::new(),
        };
        self.commits
            .timed(append::append(&self.connections, &prepared), |_| true)
            .await?;
        self.upkeep.left_dead(prepared.removes());
        self.hints.notify(StoreChange {
            session_id: request.session_id.clone(),
            last_seq: request.events.last().map_or(0, |event| event.seq),
            enqueued: prepared.queues_unleased(),
        });
        Ok(leases)
    }
}

#[async_trait]
impl Store for PgStore {
    fn shared(&self) -> bool {
        true
    }

    fn subscribe_changes(&self) -> Option<broadcast::Receiver<StoreChange>> {
        Some(self.hints.subscribe())
    }

    /// The writes this handle committed: appends, leases that leased something, heartbeats,
    /// releases that released something, deletions. Each is a transaction PostgreSQL makes
    /// durable before it answers; another server's are its own to count.
    fn durable_commits(&self) -> Option<u64> {
        Some(self.commits.times().count())
    }

    /// How long those writes took, each a whole round trip (`commits`).
    fn sync_times(&self) -> Option<SyncTimes> {
        Some(self.commits.times())
    }

    async fn append(&self, request: AppendRequest) -> Result<()> {
        self.append_leasing(&request, None).await.map(drop)
    }

    /// Leases among the tasks the append queues, in the append's own statement
    /// (`append::Prepared::lease_queued`): durable with it, so fit for any holder, and no
    /// lease statement of its own.
    async fn append_and_lease(
        &self,
        request: AppendRequest,
        lease: &LeaseRequest,
    ) -> Result<Vec<Lease>> {
        self.append_leasing(&request, Some(lease)).await
    }

    async fn read_history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        let unknown = || Error::UnknownSession {
            session_id: session_id.to_owned(),
        };
        // No session of an invalid id was ever stored (appends check ids).
        if check_session_id(session_id).is_err() {
            return Err(unknown());
        }
        // Past i64::MAX there is no seq: reading from there reads nothing.
        let from = i64::try_from(from_seq.max(1)).unwrap_or(i64::MAX);
        let limit = limit.map_or(i64::MAX, count_to_db);
        // One statement, so one snapshot: the session row says whether the session exists
        // (it has events), the lateral join brings the range, possibly empty.
        let rows = retrying("reading a history", || async {
            let statement = sqlx::query(
                "SELECT e.seq, e.record FROM cairn_sessions AS s \
                 LEFT JOIN LATERAL ( \
                     SELECT seq, record FROM cairn_events \
                     WHERE session_id = s.session_id AND seq >= $2 \
                     ORDER BY seq LIMIT $3 \
                 ) AS e ON TRUE \
                 WHERE s.session_id = $1 AND s.status <> 'deleted' \
                 ORDER BY e.seq",
            )
            .bind(session_id)
            .bind(from)
            .bind(limit);
            Ok(self.connections.get().await?.fetch_all(statement).await?)
        })
        .await?;
        if rows.is_empty() {
            return Err(unknown());
        }
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            let Some(seq) = rows::get::<Option<i64>>(row, "seq")? else {
                continue;
            };
            let record: Vec<u8> = rows::get(row, "record")?;
            events.push(codec::decode(
                session_id,
                rows::from_db("seq", seq)?,
                &record,
            )?);
        }
        Ok(events)
    }

    async fn list_sessions(&self) -> Result<Vec<SessionInfo>> {
        let rows = retrying("listing sessions", || async {
            let statement = sqlx::query(
                "SELECT session_id, status, last_seq, updated_at_ms FROM cairn_sessions \
                 WHERE status <> 'deleted' ORDER BY session_id COLLATE \"C\"",
            );
            Ok(self.connections.get().await?.fetch_all(statement).await?)
        })
        .await?;
        rows.iter().map(rows::session).collect()
    }

    async fn deleted_sessions(&self) -> Result<Vec<String>> {
        let rows = retrying("listing deleted sessions", || async {
            let statement = sqlx::query(
                "SELECT session_id FROM cairn_sessions WHERE status = 'deleted' \
                 ORDER BY session_id COLLATE \"C\"",
            );
            Ok(self.connections.get().await?.fetch_all(statement).await?)
        })
        .await?;
        rows.iter()
            .map(|row| {
                row.try_get::<String, _>("session_id")
                    .map_err(|e| Error::Store {
                        reason: format!("bad data: a deleted session's id: {e}"),
                    })
            })
            .collect()
    }

    async fn record_deleted(&self, session_id: &str, now_ms: u64) -> Result<bool> {
        self.commits
            .timed(
                crate::delete::record_deleted(&self.connections, session_id, now_ms),
                |recorded| *recorded,
            )
            .await
    }

    async fn sessions_named(&self, session_ids: &[String]) -> Result<Vec<SessionInfo>> {
        if session_ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = retrying("reading session records", || async {
            let statement = sqlx::query(
                "SELECT session_id, status, last_seq, updated_at_ms FROM cairn_sessions \
                 WHERE session_id = ANY($1) AND status <> 'deleted'",
            )
            .bind(session_ids);
            Ok(self.connections.get().await?.fetch_all(statement).await?)
        })
        .await?;
        rows.iter().map(rows::session).collect()
    }

    async fn lease_tasks(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        let leases = self
            .commits
            .timed(
                tasks::lease(&self.connections, now_ms, lease_ms, max, filter),
                |leases| !leases.is_empty(),
            )
            .await?;
        self.upkeep.left_dead(leases.len() as u64);
        Ok(leases)
    }

    async fn extend_lease(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        let expiry = self
            .commits
            .timed(
                tasks::extend(
                    &self.connections,
                    id,
                    lease_attempt,
                    now_ms,
                    lease_ms,
                    details,
                ),
                |_| true,
            )
            .await?;
        self.upkeep.left_dead(1);
        Ok(expiry)
    }

    async fn overdue_tasks(&self, now_ms: u64, max: usize) -> Result<Vec<Task>> {
        tasks::overdue(&self.connections, now_ms, max).await
    }

    async fn list_tasks(&self) -> Result<Vec<Task>> {
        tasks::list(&self.connections).await
    }

    async fn task(&self, id: &TaskId) -> Result<Option<Task>> {
        tasks::get(&self.connections, id).await
    }

    async fn release_leases(&self, now_ms: u64) -> Result<usize> {
        let released = self
            .commits
            .timed(tasks::release(&self.connections, now_ms), |released| {
                *released > 0
            })
            .await?;
        self.upkeep.left_dead(released as u64);
        Ok(released)
    }

    async fn delete_session(&self, session_id: &str, now_ms: u64) -> Result<SessionInfo> {
        self.commits
            .timed(
                crate::delete::delete(&self.connections, session_id, now_ms),
                |_| true,
            )
            .await
    }
}
