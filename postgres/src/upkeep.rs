//! Vacuuming the task queue as it turns over, rather than when autovacuum next looks.
//!
//! `cairn_tasks` is a queue: every task done leaves dead row versions behind (its lease's
//! update, its deletion), and each stays in the table and its indexes until VACUUM. A lease
//! reads the queue from its oldest entries, so it steps over every dead entry left since the
//! last VACUUM; autovacuum looks at a table at most once a minute by default, in which a busy
//! server leaves tens of thousands (a lease took 2.5 ms with 36,000, against microseconds
//! with none, and a 40 s run at 16 sessions spent a fifth more of PostgreSQL's CPU a turn
//! without this). So each store handle counts the dead versions its own writes leave, and
//! after [`VACUUM_AFTER`] of them its upkeep task runs `VACUUM (SKIP_LOCKED, TRUNCATE false)
//! cairn_tasks`: about a millisecond on a table that holds only the tasks in flight, and no
//! lock that appends or leases wait for. `SKIP_LOCKED` lets a handle pass when another
//! (another server's) is vacuuming the table already. `TRUNCATE false`, because giving the
//! emptied pages at the table's end back to the file system takes the table's exclusive
//! lock, which every append and lease waits for, and VACUUM waits up to seconds to get it:
//! with it, a vacuum took 141 ms at the median under 16 sessions, against 0.95 without. A
//! queue's pages are filled again at once anyway.
//!
//! VACUUM is upkeep, never the truth: a failure is logged and the queue is left to
//! autovacuum, after a failure that will not pass (a database without VACUUM, such as
//! CockroachDB, which collects its garbage itself) for good.

use crate::connections::Connections;
use crate::failure::{classify, sqlstate};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// Dead row versions a handle leaves in the queue before it vacuums it: a lease then steps
/// over at most about this many (and those of other handles) besides the live tasks.
pub(crate) const VACUUM_AFTER: u64 = 2_000;

/// The least time between two vacuums of one handle, so that a queue turning over faster than
/// VACUUM runs costs at most a share of one connection.
const VACUUM_GAP: Duration = Duration::from_millis(200);

/// One store handle's count of the dead row versions it left, and the task that vacuums.
pub(crate) struct QueueUpkeep {
    dead: Arc<AtomicU64>,
    due: Arc<Notify>,
    task: JoinHandle<()>,
}

impl QueueUpkeep {
    /// Starts the upkeep task of a store whose statements run on `pool`.
    pub(crate) fn start(connections: &Connections, runtime: &tokio::runtime::Handle) -> Self {
        let dead = Arc::new(AtomicU64::new(0));
        let due = Arc::new(Notify::new());
        let task = runtime.spawn(vacuum_when_due(
            connections.clone(),
            dead.clone(),
            due.clone(),
        ));
        QueueUpkeep { dead, due, task }
    }

    /// Counts `rows` dead versions a committed write left in `cairn_tasks` (tasks deleted,
    /// leased or extended), waking the upkeep task when they reach [`VACUUM_AFTER`].
    pub(crate) fn left_dead(&self, rows: u64) {
        if rows == 0 {
            return;
        }
        let before = self.dead.fetch_add(rows, Ordering::Relaxed);
        if before < VACUUM_AFTER && before + rows >= VACUUM_AFTER {
            self.due.notify_one();
        }
    }

    /// Stops the upkeep task (for the store's close and drop).
    pub(crate) fn stop(&self) {
        self.task.abort();
    }
}

/// Vacuums the queue each time its dead versions reach [`VACUUM_AFTER`], at most once per
/// [`VACUUM_GAP`], until a failure that will not pass.
#[allow(clippy::disallowed_methods)] // the gap between vacuums is real time, by design
async fn vacuum_when_due(connections: Connections, dead: Arc<AtomicU64>, due: Arc<Notify>) {
    loop {
        due.notified().await;
        if dead.load(Ordering::Relaxed) < VACUUM_AFTER {
            continue;
        }
        dead.store(0, Ordering::Relaxed);
        let vacuumed = match connections.get().await {
            Ok(mut conn) => {
                conn.execute_unprepared("VACUUM (SKIP_LOCKED, TRUNCATE false) cairn_tasks")
                    .await
            }
            Err(e) => Err(e),
        };
        match vacuumed {
            Ok(_) => tracing::debug!("vacuumed the task queue"),
            Err(e) => {
                let error = classify("vacuuming the task queue", &e);
                if !error.is_retryable() {
                    tracing::warn!(
                        %error,
                        sqlstate = sqlstate(&e).as_deref().unwrap_or(""),
                        "the task queue cannot be vacuumed; leaving it to autovacuum"
                    );
                    return;
                }
                tracing::debug!(%error, "vacuuming the task queue failed; trying again later");
            }
        }
        // Dead versions that reach the count meanwhile leave a wake-up `Notify` keeps.
        tokio::time::sleep(VACUUM_GAP).await;
    }
}
