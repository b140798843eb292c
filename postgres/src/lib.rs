//! `cairn-postgres`: the runtime's [`Store`](cairn_runtime::store::Store) on PostgreSQL, so
//! that several cairn servers share one database of histories and one task queue.
//!
//! [`PgStore::connect`] opens a pool of sqlx connections (deadpool: `connections`, which
//! returns a connection to the pool without sqlx's ping), runs the embedded migrations
//! (`postgres/migrations/`) and returns a store that passes the runtime's conformance suite,
//! with the memory store's semantics. The SQL is a subset that CockroachDB and YugabyteDB also
//! run: plain tables and indexes, no PL/pgSQL, no triggers, no advisory locks (the migrator
//! runs without its lock), LISTEN/NOTIFY for hints only; transactions run at the default
//! isolation (READ COMMITTED on PostgreSQL) with explicit row locks, and every connection sets
//! `synchronous_commit = on`, so an `Ok` means the commit is durable.
//!
//! # Schema
//!
//! Every order is byte order, as in the embedded stores: the statements sort ids with `COLLATE
//! "C"` (columns cannot be declared so on CockroachDB), whatever the database's default
//! collation. Every u64 is a BIGINT, and values past `i64::MAX` are refused, never wrapped.
//!
//! - `cairn_sessions (session_id PK, status, last_seq, updated_at_ms)`: one row per session
//!   with events; `status` is `idle`, `running` or `cancelled`, `last_seq` the event count
//!   (= the last seq), `updated_at_ms` the time of the last append. A deleted session keeps
//!   its row as its tombstone, with the status `deleted` and no events (migration 2).
//! - `cairn_events (session_id → cairn_sessions, seq, record BYTEA, PK (session_id, seq))`:
//!   each event as the runtime's record (`codec::encode`: format byte, codec byte, CRC32,
//!   named-field msgpack compressed against the runtime's dictionary), so these histories
//!   carry the same checksummed, versioned bytes as the embedded stores' and decode through
//!   the same `codec::decode`.
//! - `cairn_tasks (session_id, scheduled_seq PK, kind, visible_at_ms, lease_attempt, queue,
//!   target, start_by_ms NULL, held, heartbeat_details NULL)`: the queue, one row per task with
//!   the fields of [`Task`](cairn_runtime::store::Task) (`kind` is `model` or `tool`,
//!   `heartbeat_details` JSON text as written). Indexes: `(visible_at_ms, session_id,
//!   scheduled_seq)` for leasing in queue order, and the same columns, partial on `held OR
//!   (lease_attempt = 0 AND start_by_ms IS NOT NULL)`, for the timers' overdue scan.
//!
//! The migrator records applied migrations in sqlx's `_sqlx_migrations` table, which another
//! sqlx application in the same schema would share: give cairn its own database or schema.
//!
//! # Statements
//!
//! - Append: one transaction (`append` module): lock the session row (`FOR UPDATE`), check the
//!   next seq (`Conflict`) and the completed tasks' leases on their locked rows, found by key
//!   (`LATERAL`), never by a scan of the queue (`LeaseLost`, nothing written), insert or
//!   update the session row, insert the events with one `INSERT ... SELECT FROM UNNEST`,
//!   delete completed and cancelled tasks (by key too), upsert enqueued ones (a re-enqueue
//!   resets the task to never leased), commit. Two first appends of a new session race on
//!   its row's insert; the loser gets `Conflict`.
//! - Lease: one `UPDATE ... FROM (SELECT ... ORDER BY visible_at_ms, session_id COLLATE "C",
//!   scheduled_seq LIMIT n FOR UPDATE SKIP LOCKED)`, with the routing filter and the overdue rule in SQL; no
//!   task is handed out twice, from any number of processes (`tasks` module).
//! - Delete: one transaction (`delete` module): lock the session row, check that the session
//!   is finished and has no task (`SessionBusy`), delete its events, set the row's status to
//!   `deleted`; appends then find that status under the same lock (`SessionDeleted`).
//! - Heartbeat: a conditional `UPDATE` (current attempt, not expired); timers, listings and
//!   releases: one statement each.
//!
//! The queue turns over: every task done leaves dead rows in `cairn_tasks` until VACUUM, and
//! a lease steps over them. Each store handle vacuums it (`VACUUM (SKIP_LOCKED, TRUNCATE
//! false)`) once its own writes have left a few thousand, rather than waiting for
//! autovacuum's next look (`upkeep` module). Pooled connections are pinged only after a
//! second idle, not before each statement.
//!
//! Serialization failures and deadlocks (`40001`, `40P01`) run the statement or transaction
//! again, a few times, before they become [`Error::StoreUnavailable`](cairn_runtime::Error::StoreUnavailable); an IO error during
//! COMMIT is answered as `StoreUnavailable` at once (the append may or may not have
//! committed). See `failure` for the classification of errors.
//!
//! # Hints
//!
//! After an append commits, the store hands its [`StoreChange`](cairn_runtime::store::StoreChange)
//! to the store's sender task, which sends what gathered as `pg_notify('cairn_changes', 'v2
//! ORIGIN LAST_SEQ ENQUEUED SESSION_ID')`, outside the append's path; a `PgListener` that the
//! store starts on the first [`subscribe_changes`](cairn_runtime::store::Store::subscribe_changes)
//! (and aborts when dropped) hears the hints of other store handles (other processes) and
//! drops the echo of its own, which the engine that appended knows already. A handle sends
//! none while no other handle is connected to the database (each names its connections
//! `cairn ORIGIN` in `application_name`, looked for in `pg_stat_activity` at most every
//! 500 ms). Nothing correct depends on them (see `changes`).

mod append;
mod changes;
mod commits;
mod connections;
#[cfg(test)]
mod connections_tests;
mod delete;
mod failure;
#[cfg(test)]
mod plan_tests;
mod rows;
mod store;
mod tasks;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod upkeep;
mod url;

pub use store::{PgOptions, PgStore};
pub use url::{redact as redact_url, with_database as url_with_database};
