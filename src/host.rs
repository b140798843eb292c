//! An embedded host: a store opened through `store::embedded`, an engine and a worker pool in
//! this process.

use crate::socket::StoreSocket;
use cairn_activities::ToolRegistry;
use cairn_runtime::store::embedded::{self, OpenMode, OpenedStore, StorageEngine};
use cairn_runtime::store::marks::Loss;
use cairn_runtime::{Client, Engine, ResumeReport, Store, SystemClock};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How often, and how many times, [`Host::shutdown`] looks whether the tasks that held the
/// store have let it go: at most two seconds in all.
const STORE_RELEASE_POLL: std::time::Duration = std::time::Duration::from_millis(1);
const STORE_RELEASE_POLLS: u32 = 2_000;

/// Everything a CLI command needs: store, engine, client and (optionally) workers.
pub struct Host {
    /// The store.
    pub store: Arc<dyn Store>,
    /// What opening the store found and did.
    pub opened: OpenedStore,
    /// The store's directory, as given.
    pub data: PathBuf,
    /// The engine.
    pub engine: Engine,
    /// A client of the engine.
    pub client: Client,
    /// The tools the workers run.
    pub tools: Arc<ToolRegistry>,
    /// The worker pool; it also runs the engine's timers (lapsed leases, start deadlines).
    workers: Option<WorkerPool>,
    /// The API on the store's socket, while this process holds the store for writing.
    socket: Option<StoreSocket>,
}

impl Host {
    /// Opens the store at `data` as `mode` says (see [`embedded::open`]); tools work in
    /// `workdir`. What the open did, and any acknowledged events a read-only open found
    /// missing, are printed on stderr.
    pub async fn open(
        data: &Path,
        mode: OpenMode,
        engine: Option<StorageEngine>,
        workdir: PathBuf,
    ) -> anyhow::Result<Host> {
        let opened = embedded::open(data, mode, engine).await?;
        for note in &opened.notes {
            say(format_args!("note: {note}"));
        }
        if !opened.losses.is_empty() {
            say(format_args!("warning: {}", describe_losses(&opened.losses)));
        }
        let store = opened.store.clone();
        let engine = Engine::new(store.clone(), Arc::new(SystemClock));
        if matches!(mode, OpenMode::Create | OpenMode::Existing) {
            // Model calls recorded here are priced by `CAIRN_PRICES` when it names a table
            // (`cairn run --prices` sets its own afterwards).
            engine.set_prices(cairn_runtime::PriceTable::from_file_or_env(None)?);
        }
        // A writer holds the store's lock: other commands reach the store through its socket.
        let socket = match mode {
            OpenMode::Create | OpenMode::Existing => match StoreSocket::serve(data, engine.clone())
            {
                Ok(socket) => Some(socket),
                Err(e) => {
                    say(format_args!(
                        "note: cannot serve the store's socket in {} ({e}); other commands cannot reach this store while it runs",
                        data.display()
                    ));
                    None
                }
            },
            OpenMode::ReadOnly | OpenMode::Repair => None,
        };
        Ok(Host {
            store,
            opened,
            data: data.to_owned(),
            client: Client::new(engine.clone()),
            engine,
            tools: Arc::new(ToolRegistry::hosted(workdir)),
            workers: None,
            socket,
        })
    }

    /// Carries on every interrupted session (the store is locked to this process, so leases
    /// left by a dead one are released at once), then starts the worker pool.
    pub async fn start(&mut self) -> anyhow::Result<ResumeReport> {
        let report = self.engine.resume(true).await?;
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
        let report = self.engine.resume_session(session_id, true).await?;
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
                self.engine.clone(),
                activities,
                WorkerConfig {
                    lease_ms: 5_000,
                    only_sessions,
                    // The only worker of a store locked to this process: a task it cannot run
                    // fails at once rather than waiting for a worker that cannot come.
                    take_unhosted: true,
                    ..WorkerConfig::default()
                },
            ));
        }
    }

    /// Drains the workers, then closes the store here, once the tasks that still held it
    /// have ended, so that a caller may remove its directory next.
    #[allow(clippy::disallowed_methods)] // waits on real time for other tasks, not workflow code
    pub async fn shutdown(self) {
        let Host {
            store,
            opened,
            engine,
            client,
            workers,
            socket,
            ..
        } = self;
        if let Some(pool) = workers {
            pool.shutdown().await;
        }
        if let Some(socket) = socket {
            socket.close().await;
        }
        drop((store, engine, client));
        // A task that held the engine (a follower whose reader has gone) ends at its next
        // poll. Until it has, it holds the store, and the store would close in that task after
        // this returns: after `cairn demo` removed the store's directory, say, whose engine
        // then warned of files it could not delete. So wait for such tasks, a little. The
        // store closes when `opened` drops its reference, the last, and only then its lock.
        for _ in 0..STORE_RELEASE_POLLS {
            if Arc::strong_count(&opened.store) == 1 {
                break;
            }
            tokio::time::sleep(STORE_RELEASE_POLL).await;
        }
        drop(opened);
    }
}

/// Writes a line on stderr; a closed stderr is ignored (`eprintln!` would panic).
fn say(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{args}");
}

/// A warning about acknowledged events a store no longer has.
pub fn describe_losses(losses: &[Loss]) -> String {
    format!(
        "the store lost acknowledged events: {} (their sessions show what is left; `cairn fsck \
         --repair` accepts the loss after copying the store's files away)",
        losses
            .iter()
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// `shutdown` closes the store before it returns, also while a task still holds the
    /// engine for a moment (as a follower whose reader has gone does until its next poll):
    /// the last reference to the store is dropped, and so the store closed, by `shutdown`
    /// itself, not by that task after a caller removed the store's directory.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[allow(clippy::disallowed_methods)] // the holder lets go after a real pause
    async fn shutdown_closes_the_store_after_the_tasks_that_held_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("store");
        let host = Host::open(
            &data,
            OpenMode::Create,
            Some(StorageEngine::Fjall),
            dir.path().to_owned(),
        )
        .await
        .expect("open");
        let store = Arc::downgrade(&host.store);
        let engine = host.engine.clone();
        let holder = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(engine);
        });
        host.shutdown().await;
        assert_eq!(
            store.strong_count(),
            0,
            "the store must be closed when shutdown returns"
        );
        holder.await.expect("the holder ends");
    }
}
