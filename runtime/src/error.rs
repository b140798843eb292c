//! The runtime's one error type.

/// How the reason of [`Error::StoreOpen`] begins when another process holds the store's lock.
pub const STORE_IN_USE: &str = "the store is in use by another process";

/// Result alias for runtime operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the runtime: codec, workflow, stores, engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A stored record fails its checksum or does not decode.
    #[error("corrupt record in session {session_id:?} at seq {seq}: {reason}")]
    CorruptRecord {
        /// Session of the record.
        session_id: String,
        /// Seq of the record.
        seq: u64,
        /// What is wrong.
        reason: String,
    },
    /// A record written by a newer cairn.
    #[error("session {session_id:?} seq {seq}: unknown event schema version {version} (this build reads up to {max})", max = crate::event::SCHEMA_VERSION)]
    UnknownSchemaVersion {
        /// Session of the record.
        session_id: String,
        /// Seq of the record.
        seq: u64,
        /// The version found.
        version: u16,
    },
    /// An event could not be encoded.
    #[error("cannot encode event {seq} of session {session_id:?}: {reason}")]
    Encode {
        /// Session.
        session_id: String,
        /// Seq.
        seq: u64,
        /// Why.
        reason: String,
    },
    /// Optimistic concurrency: someone else appended first.
    #[error("append conflict on session {session_id:?}: expected next seq {expected}, store has {actual}")]
    Conflict {
        /// Session.
        session_id: String,
        /// The next seq the caller expected.
        expected: u64,
        /// The store's next seq.
        actual: u64,
    },
    /// A task completion from a lease that is no longer current (expired, or re-leased).
    #[error("lease lost on task {task}: {reason}")]
    LeaseLost {
        /// The task, as `session/seq`.
        task: String,
        /// Why the lease is not current.
        reason: String,
    },
    /// No session of that id.
    #[error("unknown session {session_id:?}")]
    UnknownSession {
        /// The id asked for.
        session_id: String,
    },
    /// A session that cannot be deleted now: a turn is running, or a task of it is queued
    /// or leased ([`Store::delete_session`](crate::store::Store::delete_session)).
    #[error("session {session_id:?} cannot be deleted: {reason}")]
    SessionBusy {
        /// The session.
        session_id: String,
        /// Why (what runs or waits).
        reason: String,
    },
    /// A write to a session that was deleted: a deleted session's id is never used again.
    #[error("session {session_id:?} was deleted; its id cannot be used again")]
    SessionDeleted {
        /// The session.
        session_id: String,
    },
    /// A session id with characters the stores cannot key on.
    #[error("invalid session id {session_id:?}: use 1-128 characters of [A-Za-z0-9._-], and `:` only after a namespace")]
    InvalidSessionId {
        /// The id given.
        session_id: String,
    },
    /// An event the workflow cannot accept in its current state: client misuse (a turn out of
    /// order, a report for an activity that never existed) or a rejection (a response that
    /// breaks the ledger's rules). Stale reports are [`Error::StaleReport`].
    #[error("session {session_id:?} seq {seq}: event rejected: {reason}")]
    InvalidEvent {
        /// Session.
        session_id: String,
        /// Seq the event has or would have.
        seq: u64,
        /// Why.
        reason: String,
    },
    /// A message sent under an idempotency key that an earlier, different message of the
    /// session was sent under (a resend of the same message is answered with its turn).
    #[error("session {session_id:?}: idempotency key {key:?} was used by turn {turn} for another message")]
    IdempotencyKeyReused {
        /// Session.
        session_id: String,
        /// The key.
        key: String,
        /// The turn the key's first message started.
        turn: u32,
    },
    /// A report (a result, a failure, streamed output) for a lease or attempt the workflow no
    /// longer waits for: a retry superseded it, a newer lease already recorded output, the
    /// activity was answered or cancelled, or the turn ended. Expected in normal operation (a
    /// worker whose lease lapsed comes back late); it changes nothing, and the history already
    /// holds the truth.
    #[error("session {session_id:?} seq {seq}: stale report dropped: {reason}")]
    StaleReport {
        /// Session.
        session_id: String,
        /// The seq the report would have taken; when the engine refuses a report before it
        /// becomes an event, the seq of the event that scheduled the reported task.
        seq: u64,
        /// What the workflow waits for instead.
        reason: String,
    },
    /// Replaying the history with this code does not give the recorded decisions.
    #[error("nondeterminism in session {session_id:?} at seq {seq}: the workflow expected {expected}, the history has {found}")]
    Nondeterminism {
        /// Session.
        session_id: String,
        /// Seq of the first divergent event.
        seq: u64,
        /// What the current code decided.
        expected: String,
        /// What the history records.
        found: String,
    },
    /// The session's stored history cannot be read: a cairn server said so
    /// (`history_unreadable`: a corrupt record, an event of a newer cairn, a replay that
    /// diverges from it), or the engine found a stored event the workflow refuses.
    #[error("session {session_id:?}: {reason}")]
    HistoryUnreadable {
        /// The session.
        session_id: String,
        /// The server's or the engine's words.
        reason: String,
    },
    /// The ledger rejected a transcript or response.
    #[error(transparent)]
    Ledger(#[from] cairn_ledger::Error),
    /// The store's backend failed (IO, a full disk, a poisoned database).
    #[error("store error: {reason}")]
    Store {
        /// What failed.
        reason: String,
    },
    /// The store is unreachable for now, or a transaction lost a race it may win when tried
    /// again: a lost database connection, a serialization failure, an exhausted connection
    /// pool. Retryable ([`Error::is_retryable`]); whether an append that failed this way was
    /// written is unknown until the history is read again.
    #[error("store unavailable: {reason}")]
    StoreUnavailable {
        /// What failed.
        reason: String,
    },
    /// The store could not be opened.
    #[error("cannot open store at {path}: {reason}")]
    StoreOpen {
        /// Where.
        path: String,
        /// Why.
        reason: String,
    },
    /// The store no longer has events it acknowledged (its engine lost them while recovering).
    #[error(
        "the store at {path} lost acknowledged events: {}; nothing was changed. `cairn fsck` \
         shows what is readable; `cairn fsck --repair` accepts the loss (it copies the store's \
         files away first)",
        lost.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ")
    )]
    EventsLost {
        /// Where.
        path: String,
        /// What is missing, by session and seq.
        lost: Vec<crate::store::marks::Loss>,
    },
    /// A history file to import (`cairn import`) that cannot be taken as it is.
    #[error("cannot import line {line}: {reason}; nothing was imported")]
    InvalidImport {
        /// The line of the file (from 1; the header is line 1).
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The engine is shutting down.
    #[error("the engine is shut down")]
    Shutdown,
    /// A cairn server answered with an error no other variant stands for (a failure of the
    /// server, a refused token), or with an error status but no cairn error body (a proxy).
    #[error("the cairn server at {url} answered {status} {code}: {message}")]
    Remote {
        /// The server.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The API's error code (`internal`, `unauthorized`, ...), or `http_STATUS` when the
        /// answer had no cairn error body.
        code: String,
        /// What the server said.
        message: String,
    },
    /// A cairn server could not be reached, or the connection broke before it answered.
    #[error("cannot reach the cairn server at {url}: {reason}")]
    Unreachable {
        /// The server.
        url: String,
        /// Why, with the whole cause chain (e.g. `connection refused`).
        reason: String,
    },
    /// A cairn server answered something the API does not allow (a body that does not
    /// decode, a stream in another format).
    #[error("unexpected answer from the cairn server at {url}: {reason}")]
    BadAnswer {
        /// The server.
        url: String,
        /// What was wrong with it.
        reason: String,
    },
    /// A turn did not end by the client's deadline ([`Client::with_turn_deadline`]); the
    /// turn goes on (cancel it with [`Client::cancel_turn`] if it should not).
    ///
    /// [`Client::with_turn_deadline`]: crate::Client::with_turn_deadline
    /// [`Client::cancel_turn`]: crate::Client::cancel_turn
    #[error(
        "turn {turn} of session {session_id:?} did not end within {deadline_ms} ms; {pending}"
    )]
    TurnDeadline {
        /// The session.
        session_id: String,
        /// The turn.
        turn: u32,
        /// The deadline.
        deadline_ms: u64,
        /// What the turn was waiting for (its tasks, and whether a worker had them).
        pending: String,
    },
    /// An operation this transport cannot carry (e.g. leasing only some sessions' tasks over
    /// HTTP, where the server scopes a worker by its token).
    #[error("not supported over this transport: {what}")]
    Unsupported {
        /// What was asked.
        what: String,
    },
    /// A price table (`--prices FILE`, `CAIRN_PRICES`) that does not parse or holds a bad
    /// entry.
    #[error("price table {source_name}: {reason}")]
    InvalidPrices {
        /// The file, or `built-in`.
        source_name: String,
        /// What is wrong, with the line and column or the model concerned.
        reason: String,
    },
}

impl Error {
    /// Whether the error is caused by a stale or duplicate activity report — the workflow no
    /// longer waits for it, or the store fenced off its lease — which callers drop: the history
    /// already holds the truth and nothing was changed.
    pub fn is_stale_report(&self) -> bool {
        matches!(self, Error::LeaseLost { .. } | Error::StaleReport { .. })
    }

    /// Whether the same operation may succeed when tried again later: the store was
    /// unavailable ([`Error::StoreUnavailable`]), or, through a server, the server could not
    /// be reached or answered 503 (draining, or its store unavailable). Constraint
    /// violations, corrupt records and rejections are not retryable.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::StoreUnavailable { .. }
                | Error::Unreachable { .. }
                | Error::Remote { status: 503, .. }
        )
    }

    /// Whether the error is a fault of one session's stored history rather than of the store
    /// or the request: a record that does not decode, an event of a newer cairn, a history
    /// the current code replays to other decisions, or events the workflow or the ledger
    /// refuses. Other sessions are not affected by it.
    pub fn is_history_fault(&self) -> bool {
        matches!(
            self,
            Error::CorruptRecord { .. }
                | Error::UnknownSchemaVersion { .. }
                | Error::Nondeterminism { .. }
                | Error::HistoryUnreadable { .. }
                | Error::InvalidEvent { .. }
                | Error::Ledger(_)
        )
    }

    /// Whether opening a store failed because another process holds it (its lock): that
    /// process may serve the store on its socket instead.
    pub fn is_store_in_use(&self) -> bool {
        matches!(self, Error::StoreOpen { reason, .. } if reason.starts_with(STORE_IN_USE))
    }
}
