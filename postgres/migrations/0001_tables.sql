-- cairn's tables (schema version 1). Applied once by sqlx's migrator, which records it in
-- _sqlx_migrations with this file's checksum: never edit this file once released, add a new one.
--
-- Ids are plain TEXT: CockroachDB cannot create a column COLLATE "C". The statements order by
-- `session_id COLLATE "C"` instead (byte order, whatever the database's default collation), so
-- session listings and the queue order are the embedded stores' orders. BIGINT holds every u64
-- the runtime stores (seqs, epoch milliseconds, lease attempts): the store refuses values past
-- i64::MAX instead of wrapping them.
--
-- IF NOT EXISTS: the migrator runs without its advisory lock (CockroachDB has none), so two
-- processes may create the tables at once; the loser retries and finds them.

-- One row per session that has events: written in the same transaction as its events.
CREATE TABLE IF NOT EXISTS cairn_sessions (
    session_id    TEXT PRIMARY KEY,
    status        TEXT NOT NULL CHECK (status IN ('idle', 'running', 'cancelled')),
    last_seq      BIGINT NOT NULL CHECK (last_seq > 0),
    updated_at_ms BIGINT NOT NULL CHECK (updated_at_ms >= 0)
);

-- The histories: each event as the runtime's checksummed, versioned record (runtime/src/codec.rs).
CREATE TABLE IF NOT EXISTS cairn_events (
    session_id TEXT NOT NULL REFERENCES cairn_sessions (session_id),
    seq        BIGINT NOT NULL CHECK (seq > 0),
    record     BYTEA NOT NULL,
    PRIMARY KEY (session_id, seq)
);

-- The task queue. No reference to cairn_sessions: an append without events may enqueue tasks of
-- a session that has no events yet (see the conformance suite's empty_appends).
CREATE TABLE IF NOT EXISTS cairn_tasks (
    session_id        TEXT NOT NULL,
    scheduled_seq     BIGINT NOT NULL CHECK (scheduled_seq >= 0),
    kind              TEXT NOT NULL CHECK (kind IN ('model', 'tool')),
    -- Leasable from then; while leased, the lease's expiry.
    visible_at_ms     BIGINT NOT NULL CHECK (visible_at_ms >= 0),
    -- The fencing token, a u32.
    lease_attempt     BIGINT NOT NULL CHECK (lease_attempt BETWEEN 0 AND 4294967295),
    queue             TEXT NOT NULL,
    target            TEXT NOT NULL,
    start_by_ms       BIGINT CHECK (start_by_ms >= 0),
    held              BOOLEAN NOT NULL,
    -- JSON text, kept as written.
    heartbeat_details TEXT,
    PRIMARY KEY (session_id, scheduled_seq)
);

-- Leasing walks the queue in this order (oldest first, ties by id) and stops at the first
-- task not yet visible. Where the default collation is not byte order, the index still gives
-- the order of visible_at_ms, and ties are sorted (incrementally) by the statement.
CREATE INDEX IF NOT EXISTS cairn_tasks_queue_order
    ON cairn_tasks (visible_at_ms, session_id, scheduled_seq);

-- Timers look for overdue tasks only, which are held or have a start deadline: a backlog of
-- due tasks does not make every timer round read it all.
CREATE INDEX IF NOT EXISTS cairn_tasks_timer_order
    ON cairn_tasks (visible_at_ms, session_id, scheduled_seq)
    WHERE held OR (lease_attempt = 0 AND start_by_ms IS NOT NULL);
