//! A fault-injecting store wrapper: [`FaultyStore`] passes every operation to an inner store
//! until told to fail some of them, so tests (and the chaos harness) can check how the engine
//! and the workers behave when the disk is full or reads fail.
//!
//! An injected fault fails the operation with [`Error::Store`] *before* it reaches the inner
//! store, so a failed append writes nothing, exactly like a backend whose transaction failed.
//! Faults apply from the moment they are set until [`FaultyStore::heal`].

use super::{AppendRequest, Lease, LeaseRequest, SessionInfo, Store, Task, TaskFilter, TaskId};
use crate::error::{Error, Result};
use crate::event::EventEnvelope;
use async_trait::async_trait;
use cairn_ledger::JsonText;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The reason of an injected append failure.
pub const DISK_FULL: &str = "injected fault: disk full";
/// The reason of an injected read failure.
pub const READ_ERROR: &str = "injected fault: read error";
/// The reason of an injected lease failure.
pub const LEASE_ERROR: &str = "injected fault: lease write failed";

/// A predicate choosing the appends to fail.
type AppendFilter = Arc<dyn Fn(&AppendRequest) -> bool + Send + Sync>;

/// Which operations fail.
#[derive(Default)]
struct Faults {
    /// Appends still allowed before every further append fails; `None`: no such limit.
    appends_left: Option<u64>,
    /// Sessions whose appends fail.
    sessions: BTreeSet<String>,
    /// Appends matching the filter fail, this many more times.
    matching: Option<(u64, AppendFilter)>,
    /// Reads (`read_history`, `list_sessions`, `list_tasks`, `task`) fail.
    reads: bool,
    /// Lease writes (`lease_tasks`, `extend_lease`, `release_leases`) fail.
    leases: bool,
    /// Operations failed by a fault so far.
    injected: u64,
}

/// Wraps a store and fails chosen operations on command; see the module docs.
pub struct FaultyStore<S> {
    inner: S,
    faults: Mutex<Faults>,
    /// Set by [`FaultyStore::fail_as_a_database`]; [`FaultyStore::heal`] keeps it.
    as_a_database: AtomicBool,
    /// `read_history` calls so far, failed or not.
    history_reads: AtomicU64,
}

impl<S: Store> FaultyStore<S> {
    /// Wraps `inner`, failing nothing yet.
    pub fn new(inner: S) -> Self {
        FaultyStore {
            inner,
            faults: Mutex::new(Faults::default()),
            as_a_database: AtomicBool::new(false),
            history_reads: AtomicU64::new(0),
        }
    }

    /// The wrapped store (bypassing the faults).
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner store.
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn faults(&self) -> MutexGuard<'_, Faults> {
        // Plain flags: consistent even if a holder panicked.
        self.faults
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The next `n` appends pass; the (n+1)th and every later one fails with a "disk full"
    /// `Error::Store`.
    pub fn fail_appends_after(&self, n: u64) {
        self.faults().appends_left = Some(n);
    }

    /// Every append to `session_id` fails with a "disk full" `Error::Store`; other sessions'
    /// appends pass.
    pub fn fail_appends_for(&self, session_id: &str) {
        self.faults().sessions.insert(session_id.to_owned());
    }

    /// The next `times` appends for which `filter` is true fail with a "disk full"
    /// `Error::Store` (e.g. only the appends that complete a task: a worker's report).
    pub fn fail_appends_matching(
        &self,
        times: u64,
        filter: impl Fn(&AppendRequest) -> bool + Send + Sync + 'static,
    ) {
        self.faults().matching = Some((times, Arc::new(filter)));
    }

    /// Reads (`read_history`, `list_sessions`, `list_tasks`, `task`) fail with an `Error::Store`.
    pub fn fail_reads(&self) {
        self.faults().reads = true;
    }

    /// Lease writes (`lease_tasks`, `extend_lease`, `release_leases`) fail with an
    /// `Error::Store`.
    pub fn fail_leases(&self) {
        self.faults().leases = true;
    }

    /// From now on the store acts as a database other processes share ([`Store::shared`]),
    /// and its injected faults fail as such a database does while it restarts: with
    /// `Error::StoreUnavailable`, which callers may retry, instead of `Error::Store`. Kept by
    /// [`FaultyStore::heal`].
    pub fn fail_as_a_database(&self) {
        self.as_a_database.store(true, Ordering::Relaxed);
    }

    /// The error of an injected fault.
    fn fault(&self, reason: &str) -> Error {
        let reason = reason.to_owned();
        if self.as_a_database.load(Ordering::Relaxed) {
            Error::StoreUnavailable { reason }
        } else {
            Error::Store { reason }
        }
    }

    /// Clears every fault: from now on every operation reaches the inner store.
    pub fn heal(&self) {
        let mut faults = self.faults();
        let injected = faults.injected;
        *faults = Faults {
            injected,
            ..Faults::default()
        };
    }

    /// How many times a history was read (`read_history`) so far, failed or not.
    pub fn history_reads(&self) -> u64 {
        self.history_reads.load(Ordering::Relaxed)
    }

    /// How many operations an injected fault failed so far.
    pub fn injected_failures(&self) -> u64 {
        self.faults().injected
    }

    /// Decides whether this append fails, consuming the allowances it uses.
    fn append_fault(&self, request: &AppendRequest) -> Result<()> {
        let mut faults = self.faults();
        let mut fail = faults.sessions.contains(&request.session_id);
        if let Some((times, filter)) = &mut faults.matching {
            if *times > 0 && filter(request) {
                *times -= 1;
                fail = true;
            }
        }
        match &mut faults.appends_left {
            Some(0) => fail = true,
            Some(left) if !fail => *left -= 1,
            _ => {}
        }
        if fail {
            faults.injected += 1;
            return Err(self.fault(DISK_FULL));
        }
        Ok(())
    }

    /// Whether a delete fails: as an append of its session would, without using an allowance.
    fn delete_fault(&self, session_id: &str) -> Result<()> {
        let mut faults = self.faults();
        if faults.sessions.contains(session_id) || faults.appends_left == Some(0) {
            faults.injected += 1;
            return Err(self.fault(DISK_FULL));
        }
        Ok(())
    }

    fn flag_fault(&self, which: fn(&Faults) -> bool, reason: &str) -> Result<()> {
        let mut faults = self.faults();
        if which(&faults) {
            faults.injected += 1;
            return Err(self.fault(reason));
        }
        Ok(())
    }

    fn read_fault(&self) -> Result<()> {
        self.flag_fault(|f| f.reads, READ_ERROR)
    }

    fn lease_fault(&self) -> Result<()> {
        self.flag_fault(|f| f.leases, LEASE_ERROR)
    }
}

#[async_trait]
impl<S: Store> Store for FaultyStore<S> {
    fn shared(&self) -> bool {
        self.as_a_database.load(Ordering::Relaxed) || self.inner.shared()
    }

    async fn append(&self, request: AppendRequest) -> Result<()> {
        self.append_fault(&request)?;
        self.inner.append(request).await
    }

    async fn append_and_lease(
        &self,
        request: AppendRequest,
        lease: &LeaseRequest,
    ) -> Result<Vec<Lease>> {
        self.append_fault(&request)?;
        self.inner.append_and_lease(request, lease).await
    }

    async fn read_history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        self.history_reads.fetch_add(1, Ordering::Relaxed);
        self.read_fault()?;
        self.inner.read_history(session_id, from_seq, limit).await
    }

    async fn sessions_named(&self, session_ids: &[String]) -> Result<Vec<SessionInfo>> {
        self.read_fault()?;
        self.inner.sessions_named(session_ids).await
    }

    async fn list_sessions(&self) -> Result<Vec<SessionInfo>> {
        self.read_fault()?;
        self.inner.list_sessions().await
    }

    async fn deleted_sessions(&self) -> Result<Vec<String>> {
        self.read_fault()?;
        self.inner.deleted_sessions().await
    }

    async fn record_deleted(&self, session_id: &str, now_ms: u64) -> Result<bool> {
        self.delete_fault(session_id)?;
        self.inner.record_deleted(session_id, now_ms).await
    }

    async fn lease_tasks(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        self.lease_fault()?;
        self.inner.lease_tasks(now_ms, lease_ms, max, filter).await
    }

    async fn lease_tasks_in_process(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        self.lease_fault()?;
        self.inner
            .lease_tasks_in_process(now_ms, lease_ms, max, filter)
            .await
    }

    async fn extend_lease(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        self.lease_fault()?;
        self.inner
            .extend_lease(id, lease_attempt, now_ms, lease_ms, details)
            .await
    }

    async fn overdue_tasks(&self, now_ms: u64, max: usize) -> Result<Vec<Task>> {
        self.read_fault()?;
        self.inner.overdue_tasks(now_ms, max).await
    }

    async fn list_tasks(&self) -> Result<Vec<Task>> {
        self.read_fault()?;
        self.inner.list_tasks().await
    }

    async fn task(&self, id: &TaskId) -> Result<Option<Task>> {
        self.read_fault()?;
        self.inner.task(id).await
    }

    async fn release_leases(&self, now_ms: u64) -> Result<usize> {
        self.lease_fault()?;
        self.inner.release_leases(now_ms).await
    }

    async fn delete_session(&self, session_id: &str, now_ms: u64) -> Result<SessionInfo> {
        self.delete_fault(session_id)?;
        self.inner.delete_session(session_id, now_ms).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::conformance::{append_request, message};
    use crate::store::memory::MemoryStore;

    fn is_disk_full(r: &Result<()>) -> bool {
        matches!(r, Err(Error::Store { reason }) if reason == DISK_FULL)
    }

    #[tokio::test]
    async fn appends_fail_after_n_and_write_nothing_until_healed() {
        let store = FaultyStore::new(MemoryStore::new());
        store.fail_appends_after(2);
        for seq in 1..=2 {
            store
                .append(append_request("s", seq, vec![message("s", seq, "ok")], 1))
                .await
                .expect("the first two appends pass");
        }
        for _ in 0..3 {
            let r = store
                .append(append_request("s", 3, vec![message("s", 3, "no")], 1))
                .await;
            assert!(is_disk_full(&r), "{r:?}");
            let r = store
                .append(append_request("t", 1, vec![message("t", 1, "no")], 1))
                .await;
            assert!(is_disk_full(&r), "every session fails: {r:?}");
        }
        assert_eq!(store.injected_failures(), 6);
        assert_eq!(
            store
                .inner()
                .read_history("s", 1, None)
                .await
                .expect("read")
                .len(),
            2,
            "nothing of the failed appends reached the store"
        );
        assert!(store.list_sessions().await.expect("list").len() == 1);
        store.heal();
        store
            .append(append_request("s", 3, vec![message("s", 3, "ok")], 1))
            .await
            .expect("after heal appends pass");
        assert_eq!(store.injected_failures(), 6, "heal keeps the count");
    }

    #[tokio::test]
    async fn per_session_and_matching_faults() {
        let store = FaultyStore::new(MemoryStore::new());
        store.fail_appends_for("bad");
        assert!(is_disk_full(
            &store
                .append(append_request("bad", 1, vec![message("bad", 1, "x")], 1))
                .await
        ));
        store
            .append(append_request("good", 1, vec![message("good", 1, "x")], 1))
            .await
            .expect("other sessions pass");
        store.heal();
        store.fail_appends_matching(1, |r| r.events.len() == 2);
        store
            .append(append_request("good", 2, vec![message("good", 2, "x")], 1))
            .await
            .expect("a non-matching append passes");
        let two = || {
            append_request(
                "good",
                3,
                vec![message("good", 3, "x"), message("good", 4, "y")],
                1,
            )
        };
        assert!(is_disk_full(&store.append(two()).await));
        store
            .append(two())
            .await
            .expect("the matching fault was used up");
        assert_eq!(
            store
                .read_history("good", 1, None)
                .await
                .expect("read")
                .len(),
            4
        );
    }

    #[tokio::test]
    async fn read_and_lease_faults() {
        let store = FaultyStore::new(MemoryStore::new());
        store
            .append(append_request("s", 1, vec![message("s", 1, "x")], 1))
            .await
            .expect("append");
        store.fail_reads();
        for r in [
            store.read_history("s", 1, None).await.map(drop),
            store.list_sessions().await.map(drop),
            store.list_tasks().await.map(drop),
        ] {
            assert!(
                matches!(&r, Err(Error::Store { reason }) if reason == READ_ERROR),
                "{r:?}"
            );
        }
        store.fail_leases();
        assert!(matches!(
            store
                .lease_tasks(0, 1, 1, &crate::store::TaskFilter::default())
                .await,
            Err(Error::Store { .. })
        ));
        assert!(matches!(
            store.release_leases(0).await,
            Err(Error::Store { .. })
        ));
        store.heal();
        assert_eq!(
            store.read_history("s", 1, None).await.expect("read").len(),
            1
        );
        assert_eq!(
            store
                .lease_tasks(0, 1, 1, &crate::store::TaskFilter::default())
                .await
                .expect("lease"),
            vec![]
        );
    }
}
