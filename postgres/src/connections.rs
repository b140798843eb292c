//! The store's pool of PostgreSQL connections: deadpool over sqlx's `PgConnection`, so that a
//! connection goes back to the pool as it is, with no round trip.
//!
//! sqlx's own pool pings every connection as it goes back (a `Sync` and its answer), whatever
//! the statement did, and offers no setting to stop it. Off the operation's path, but not free:
//! a round trip for every statement, a wake of the backend and of the server, and a task
//! spawned to run it. Measured through one server and one worker on PostgreSQL (16 sessions),
//! those pings cost about a tenth of the database's CPU a turn and a seventh of the server's.
//!
//! What the ping bought is kept where it matters. A statement that ended with an answer from
//! the server (rows, or a database error) leaves its connection ready for the next: sqlx
//! itself reads any answer still pending before it sends the next statement. A statement that
//! did not (an IO or protocol error, or a future dropped mid-statement) leaves a [`Held`]
//! marked unsettled, and that connection is pinged before it goes back, and dropped if the
//! ping fails. So is every connection a transaction or the migrations ran on (a dropped
//! transaction's ROLLBACK is sent by that ping, not left with its locks until the next use).
//! A connection idle for [`PING_AFTER_IDLE`] is pinged before it is handed out, so that one a
//! restarted database dropped is replaced before use, and one older than [`MAX_LIFETIME`] is
//! closed and opened anew, as sqlx's pool does by default.

use deadpool::managed::{self, Metrics, Object, PoolError, RecycleError, RecycleResult};
use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgQueryResult, PgRow};
use sqlx::{Connection, Postgres};
use std::time::Duration;

/// How long a pooled connection may sit idle and still be handed out without a ping. A
/// connection in steady use is not pinged; one idle longer is, so that connections a restarted
/// database dropped are found and replaced before use. One that died within this window fails
/// its statement as any connection lost mid-statement does ([`cairn_runtime::Error::
/// StoreUnavailable`], which callers retry).
pub(crate) const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// How long a connection is used before it is closed and replaced (sqlx's default): a
/// backend's caches and memory do not grow for good.
const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// One statement, as sqlx builds it.
pub(crate) type Statement<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// Opens and checks the pool's connections.
struct Connector {
    options: PgConnectOptions,
}

impl managed::Manager for Connector {
    type Type = PgConnection;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<PgConnection, sqlx::Error> {
        PgConnection::connect_with(&self.options).await
    }

    async fn recycle(
        &self,
        connection: &mut PgConnection,
        metrics: &Metrics,
    ) -> RecycleResult<sqlx::Error> {
        if metrics.age() >= MAX_LIFETIME {
            return Err(RecycleError::message("the connection reached its lifetime"));
        }
        if metrics.last_used() >= PING_AFTER_IDLE {
            connection.ping().await?;
        }
        Ok(())
    }
}

/// The pool: at most `max_connections` connections, opened as they are needed, the one used
/// last handed out first (so that a light load keeps few backends awake).
#[derive(Clone)]
pub(crate) struct Connections {
    pool: managed::Pool<Connector>,
}

impl Connections {
    /// A pool of connections to `options`; opens none yet. Waiting for a connection, opening
    /// one and checking one each give up after `acquire_timeout`.
    pub(crate) fn new(
        options: PgConnectOptions,
        max_connections: u32,
        acquire_timeout: Duration,
    ) -> Result<Connections, String> {
        let pool = managed::Pool::builder(Connector { options })
            .max_size(usize::try_from(max_connections.max(1)).unwrap_or(usize::MAX))
            .queue_mode(managed::QueueMode::Lifo)
            .runtime(deadpool::Runtime::Tokio1)
            .wait_timeout(Some(acquire_timeout))
            .create_timeout(Some(acquire_timeout))
            .recycle_timeout(Some(acquire_timeout))
            .build()
            .map_err(|e| format!("building the connection pool: {e}"))?;
        Ok(Connections { pool })
    }

    /// A connection for one operation, as sqlx's errors: a pool that does not hand one out in
    /// time is `PoolTimedOut`, a closed one `PoolClosed` (both retryable).
    pub(crate) async fn get(&self) -> Result<Held, sqlx::Error> {
        match self.pool.get().await {
            Ok(object) => Ok(Held {
                object: Some(object),
                unsettled: false,
            }),
            Err(PoolError::Backend(e)) => Err(e),
            Err(PoolError::Timeout(_)) => Err(sqlx::Error::PoolTimedOut),
            Err(PoolError::Closed) => Err(sqlx::Error::PoolClosed),
            Err(e @ (PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_))) => {
                Err(sqlx::Error::Protocol(format!("the connection pool: {e}")))
            }
        }
    }

    /// Closes the pool: idle connections say goodbye to the server now, and every later
    /// [`Connections::get`] fails. Waits for the connections in use to come back (they are
    /// closed as they do).
    #[allow(clippy::disallowed_methods)] // waiting for connections in use is real time
    pub(crate) async fn close(&self) {
        let idle = self.pool.retain(|_, _| false).removed;
        self.pool.close();
        for connection in idle {
            let _ = connection.close().await;
        }
        while self.pool.status().size > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A connection taken from the pool for one operation; back to the pool when dropped, pinged
/// first if it may not be ready for the next statement (see the module's documentation).
pub(crate) struct Held {
    object: Option<Object<Connector>>,
    /// Whether the last statement may have left an answer unread, a transaction open or the
    /// connection broken.
    unsettled: bool,
}

/// Whether a statement's outcome came as the server's answer, after which sqlx has read
/// (or will read, before the next statement) everything the server sent.
fn answered<T>(outcome: &Result<T, sqlx::Error>) -> bool {
    matches!(
        outcome,
        Ok(_) | Err(sqlx::Error::Database(_) | sqlx::Error::RowNotFound)
    )
}

impl Held {
    fn connection(&mut self) -> &mut PgConnection {
        // Only `drop` takes the object out.
        self.object
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("a held connection is there until it is dropped"))
    }

    /// Records how a statement ended, and gives its outcome back.
    fn settled<T>(&mut self, outcome: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        self.unsettled = !answered(&outcome);
        outcome
    }

    /// Runs `statement` and returns every row.
    pub(crate) async fn fetch_all(
        &mut self,
        statement: Statement<'_>,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        self.unsettled = true;
        let outcome = statement.fetch_all(self.connection()).await;
        self.settled(outcome)
    }

    /// Runs `statement` and returns its first row, if any (the statements that use it return
    /// one row at most, so reading them all costs nothing more).
    pub(crate) async fn fetch_optional(
        &mut self,
        statement: Statement<'_>,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        Ok(self.fetch_all(statement).await?.into_iter().next())
    }

    /// Runs `statement` and returns its one row (`RowNotFound` without one).
    pub(crate) async fn fetch_one(
        &mut self,
        statement: Statement<'_>,
    ) -> Result<PgRow, sqlx::Error> {
        self.fetch_optional(statement)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }

    /// Runs `statement` and says how many rows it changed.
    pub(crate) async fn execute(
        &mut self,
        statement: Statement<'_>,
    ) -> Result<PgQueryResult, sqlx::Error> {
        self.unsettled = true;
        let outcome = statement.execute(self.connection()).await;
        self.settled(outcome)
    }

    /// Runs `sql`, a statement without parameters, by the simple protocol (for what cannot be
    /// prepared, such as VACUUM).
    pub(crate) async fn execute_unprepared(
        &mut self,
        sql: &'static str,
    ) -> Result<PgQueryResult, sqlx::Error> {
        self.unsettled = true;
        let outcome = sqlx::Executor::execute(self.connection(), sql).await;
        self.settled(outcome)
    }

    /// The connection itself, for a transaction or the migrations: it is pinged before it goes
    /// back, whatever happened on it.
    pub(crate) fn raw(&mut self) -> &mut PgConnection {
        self.unsettled = true;
        self.connection()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.unsettled {
            return;
        }
        let Some(mut object) = self.object.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nothing to ping it from: it is not handed out again.
            drop(Object::take(object));
            return;
        };
        runtime.spawn(async move {
            // The ping sends what the connection still holds (a dropped transaction's
            // ROLLBACK), reads every answer pending, and finds a broken connection, which
            // leaves the pool rather than failing the next statement.
            if object.ping().await.is_err() {
                drop(Object::take(object));
            }
        });
    }
}
