//! The writes a store handle committed, and how long each took: what `/v1/health` and `cairn
//! bench` show as a store's durable commits and sync times. On PostgreSQL each write is a
//! statement in a transaction of its own, which the server makes durable before it answers
//! (`synchronous_commit = on`: its WAL flush, shared among concurrent commits), so the time
//! counted is the whole round trip, the statement's work with it.

use cairn_runtime::store::SyncTimes;
use cairn_runtime::Result;
use std::future::Future;
use std::sync::Mutex;
use std::time::Instant;

/// The commits of one store handle since it connected.
#[derive(Default)]
pub(crate) struct Commits(Mutex<SyncTimes>);

impl Commits {
    /// Runs `write`, and counts it as a commit when it succeeds and `wrote` says it changed
    /// something: a statement that changed no row writes no WAL, and commits with no flush.
    #[allow(clippy::disallowed_methods)] // timing IO for benchmarks; not recorded in history
    pub(crate) async fn timed<T>(
        &self,
        write: impl Future<Output = Result<T>>,
        wrote: impl FnOnce(&T) -> bool,
    ) -> Result<T> {
        let began = Instant::now();
        let outcome = write.await;
        if outcome.as_ref().is_ok_and(wrote) {
            let took = began.elapsed();
            self.0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .record(took);
        }
        outcome
    }

    /// The commits counted so far, with their times.
    pub(crate) fn times(&self) -> SyncTimes {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}
