//! A store for the engine's race tests: in memory, with appends that can be held before they
//! reach it, a log of the tasks each append completes, and task reads that can let something
//! happen right after they read.

use crate::error::Result;
use crate::event::EventEnvelope;
use crate::store::{AppendRequest, Lease, SessionInfo, Store, Task, TaskFilter, TaskId};
use crate::MemoryStore;
use async_trait::async_trait;
use cairn_ledger::JsonText;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tokio::sync::Notify;

/// See the module docs.
#[derive(Default)]
pub(crate) struct GatedStore {
    pub(crate) inner: MemoryStore,
    /// While set, an append tells `entered` and then waits forever, never reaching the store.
    pub(crate) hold_appends: AtomicBool,
    /// While set, the next append tells `entered`, clears it and waits for `release`, then
    /// reaches the store.
    pub(crate) hold_next: AtomicBool,
    pub(crate) entered: Notify,
    pub(crate) release: Notify,
    /// The completed tasks of each append that completed any, and whether it was written.
    pub(crate) completions: Mutex<Vec<(Vec<TaskId>, bool)>>,
    /// Run inside the next `list_tasks`, after the tasks were read.
    pub(crate) after_listing: Meanwhile,
    /// Run inside the next `overdue_tasks`, after the overdue tasks were read.
    pub(crate) after_overdue: Meanwhile,
}

/// Something to run once inside a store call, after the call read what it answers with and
/// before it answers: another writer acting in between.
#[derive(Default)]
pub(crate) struct Meanwhile(
    Mutex<Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>>,
);

impl Meanwhile {
    pub(crate) fn set(&self, meanwhile: impl std::future::Future<Output = ()> + Send + 'static) {
        *self.0.lock().expect("meanwhile") = Some(Box::pin(meanwhile));
    }

    async fn run_once(&self) {
        let meanwhile = self.0.lock().expect("meanwhile").take();
        if let Some(meanwhile) = meanwhile {
            meanwhile.await;
        }
    }
}

#[async_trait]
impl Store for GatedStore {
    async fn append(&self, request: AppendRequest) -> Result<()> {
        if self.hold_appends.load(Ordering::SeqCst) {
            self.entered.notify_one();
            std::future::pending::<()>().await;
        }
        if self.hold_next.swap(false, Ordering::SeqCst) {
            self.entered.notify_one();
            self.release.notified().await;
        }
        let completed: Vec<TaskId> = request.complete.iter().map(|(id, _)| id.clone()).collect();
        let result = self.inner.append(request).await;
        if !completed.is_empty() {
            let mut log = self.completions.lock().expect("log");
            log.push((completed, result.is_ok()));
        }
        result
    }
    async fn read_history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        self.inner.read_history(session_id, from_seq, limit).await
    }
    async fn list_sessions(&self) -> Result<Vec<SessionInfo>> {
        self.inner.list_sessions().await
    }
    async fn deleted_sessions(&self) -> Result<Vec<String>> {
        self.inner.deleted_sessions().await
    }
    async fn record_deleted(&self, session_id: &str, now_ms: u64) -> Result<bool> {
        self.inner.record_deleted(session_id, now_ms).await
    }
    async fn lease_tasks(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        self.inner.lease_tasks(now_ms, lease_ms, max, filter).await
    }
    async fn extend_lease(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        self.inner
            .extend_lease(id, lease_attempt, now_ms, lease_ms, details)
            .await
    }
    async fn overdue_tasks(&self, now_ms: u64, max: usize) -> Result<Vec<Task>> {
        let tasks = self.inner.overdue_tasks(now_ms, max).await?;
        self.after_overdue.run_once().await;
        Ok(tasks)
    }
    async fn list_tasks(&self) -> Result<Vec<Task>> {
        let tasks = self.inner.list_tasks().await?;
        self.after_listing.run_once().await;
        Ok(tasks)
    }
    async fn task(&self, id: &TaskId) -> Result<Option<Task>> {
        self.inner.task(id).await
    }
    async fn release_leases(&self, now_ms: u64) -> Result<usize> {
        self.inner.release_leases(now_ms).await
    }
    async fn delete_session(&self, session_id: &str, now_ms: u64) -> Result<SessionInfo> {
        self.inner.delete_session(session_id, now_ms).await
    }
}
