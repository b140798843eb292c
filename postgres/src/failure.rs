//! How database failures become the runtime's errors, and the internal retry of transactions
//! that lost a race.
//!
//! Retryable ([`Error::StoreUnavailable`]): the database is unreachable or restarting (SQLSTATE
//! class `08`, `57P01`-`57P03`, IO errors, an exhausted or closed pool), it refused the work
//! for now (`53300` too many connections, `25006` a read-only standby after a failover, `55P03`
//! and `57014` lock or statement timeouts), or a transaction lost a race after every internal
//! retry (`40001` serialization failure, `40P01` deadlock, `40003` CockroachDB's unknown
//! outcome). Everything else is [`Error::Store`] and not retryable: constraint violations, bad
//! data, SQL the server does not accept, decoding failures.

use cairn_runtime::Error;
use std::future::Future;
use std::time::Duration;

/// How many times a store operation runs when it keeps losing races (serialization failures,
/// deadlocks): those are known not to have committed, so running again is safe.
const TRIES: u32 = 5;

/// Why one run of a store operation failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The database failed; [`retrying`] decides whether to run again.
    Sql(sqlx::Error),
    /// The operation's answer (a conflict, a lost lease, bad input): final.
    Done(Error),
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        Failure::Sql(e)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Done(e)
    }
}

/// The SQLSTATE of a database error, if it is one.
pub(crate) fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
        _ => None,
    }
}

/// A transaction that lost a race and did not commit: the same transaction may succeed now.
fn lost_race(e: &sqlx::Error) -> bool {
    matches!(sqlstate(e).as_deref(), Some("40001" | "40P01"))
}

/// SQLSTATEs of conditions that pass: the server is (re)starting, shutting down, out of
/// connections, read-only after a failover, or a race or timeout that may go the other way.
fn transient_state(code: &str) -> bool {
    code.starts_with("08")
        || matches!(
            code,
            "40001"
                | "40P01"
                | "40003"
                | "57P01"
                | "57P02"
                | "57P03"
                | "53300"
                | "25006"
                | "55P03"
                | "57014"
        )
}

/// The runtime's error for a database failure while doing `what`.
pub(crate) fn classify(what: &str, e: &sqlx::Error) -> Error {
    let transient = match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| transient_state(&code)),
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    };
    let reason = match sqlstate(e) {
        Some(code) => format!("{what}: {e} (SQLSTATE {code})"),
        None => format!("{what}: {e}"),
    };
    if transient {
        Error::StoreUnavailable { reason }
    } else {
        Error::Store { reason }
    }
}

/// Runs `op` (one statement, or one transaction that rolls back when dropped) until it does
/// not lose a race, at most [`TRIES`] times, with a short pause between tries so that the
/// winners finish. A failure that is not a lost race is answered at once: in particular an
/// IO error during COMMIT, whose outcome is unknown, is never retried here.
#[allow(clippy::disallowed_methods)] // the pause between tries is real time, by design
pub(crate) async fn retrying<T, F, Fut>(what: &str, mut op: F) -> cairn_runtime::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
{
    let mut tries = 0;
    loop {
        tries += 1;
        match op().await {
            Ok(value) => return Ok(value),
            Err(Failure::Done(e)) => return Err(e),
            Err(Failure::Sql(e)) if lost_race(&e) && tries < TRIES => {
                tracing::debug!(what, tries, error = %e, "transaction lost a race; running it again");
                tokio::time::sleep(Duration::from_millis(2u64 << tries)).await;
            }
            Err(Failure::Sql(e)) => return Err(classify(what, &e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_and_io_failures_are_retryable() {
        for e in [
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
        ] {
            let classified = classify("reading", &e);
            assert!(classified.is_retryable(), "{e:?} gave {classified:?}");
        }
    }

    #[test]
    fn decoding_failures_are_not_retryable() {
        let e = sqlx::Error::ColumnNotFound("x".to_owned());
        assert!(matches!(classify("reading", &e), Error::Store { .. }));
    }

    #[test]
    fn transient_states() {
        for code in [
            "08006", "08001", "57P01", "57P03", "40001", "40P01", "53300",
        ] {
            assert!(transient_state(code), "{code}");
        }
        for code in ["23505", "23514", "22021", "42P01", "XX000", "53100"] {
            assert!(!transient_state(code), "{code}");
        }
    }
}
