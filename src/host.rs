//! An embedded host: a sled store, an engine and a worker pool in this process.

use anyhow::Context;
use cairn_activities::ToolRegistry;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::{Client, Engine, ResumeReport, SystemClock};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Everything a CLI command needs: store, engine, client and (optionally) workers.
pub struct Host {
    /// The store.
    pub store: Arc<SledStore>,
    /// A client of the engine.
    pub client: Client,
    /// The tools the workers run.
    pub tools: Arc<ToolRegistry>,
    workers: Option<WorkerPool>,
}

impl Host {
    /// Opens (or, with `create`, creates) the store at `data`; tools work in `workdir`.
    pub fn open(data: &Path, create: bool, workdir: PathBuf) -> anyhow::Result<Host> {
        let store = if create {
            SledStore::open(data)
        } else {
            SledStore::open_existing(data)
        }
        .with_context(|| format!("cannot open the store at {}", data.display()))?;
        let store = Arc::new(store);
        let engine = Engine::new(store.clone(), Arc::new(SystemClock));
        Ok(Host {
            store,
            client: Client::new(engine),
            tools: Arc::new(ToolRegistry::builtin(workdir)),
            workers: None,
        })
    }

    /// Carries on every interrupted session (the store is locked to this process, so leases
    /// left by a dead one are released at once), then starts the worker pool.
    pub async fn start(&mut self) -> anyhow::Result<ResumeReport> {
        let report = self.client.engine().resume(true).await?;
        if !report.running_sessions.is_empty() {
            tracing::info!(
                sessions = report.running_sessions.len(),
                "resuming interrupted sessions"
            );
        }
        self.start_workers();
        Ok(report)
    }

    /// Carries on `session_id`'s interrupted turn, if it has one, and starts a worker pool
    /// that runs that session's tasks only: other sessions of the store, interrupted or not,
    /// are left as they are (their histories untouched) for `cairn resume`.
    pub async fn start_for(&mut self, session_id: &str) -> anyhow::Result<ResumeReport> {
        let report = self
            .client
            .engine()
            .resume_session(session_id, true)
            .await?;
        self.start_pool(Some(std::iter::once(session_id.to_owned()).collect()));
        Ok(report)
    }

    /// Starts the worker pool (without resuming; see [`Host::start`]).
    pub fn start_workers(&mut self) {
        self.start_pool(None);
    }

    fn start_pool(&mut self, only_sessions: Option<BTreeSet<String>>) {
        if self.workers.is_none() {
            let activities = Activities {
                models: Arc::new(StandardModels::new()),
                tools: self.tools.clone(),
            };
            self.workers = Some(WorkerPool::start(
                self.client.engine().clone(),
                activities,
                WorkerConfig {
                    lease_ms: 5_000,
                    only_sessions,
                    ..WorkerConfig::default()
                },
            ));
        }
    }

    /// Drains the workers.
    pub async fn shutdown(mut self) {
        if let Some(pool) = self.workers.take() {
            pool.shutdown().await;
        }
    }
}
