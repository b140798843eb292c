//! `cairn server`: opens the store like every writing command, binds the listener, says where
//! it listens, and serves the `/v1` API (`cairn-server`) until SIGTERM or SIGINT, then drains
//! and exits 0. Optional in-process workers run the tasks they host.

use crate::cli::database::{self, StoreLocation};
use crate::cli::out::{note, showln};
use anyhow::Context;
use cairn::host::describe_losses;
use cairn_activities::ToolRegistry;
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::{Engine, SystemClock};
use cairn_server::{ServerConfig, Tokens};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// What `cairn server` was asked for.
pub struct ServeArgs {
    /// The store: a directory, or a database several servers may share.
    pub store: StoreLocation,
    /// How a database store uses its connections.
    pub pool: database::PoolArgs,
    /// Where to listen.
    pub listen: SocketAddr,
    /// The tokens file.
    pub tokens: Option<PathBuf>,
    /// The storage engine of a new store.
    pub engine: Option<StorageEngine>,
    /// In-process workers (0: none).
    pub local_workers: usize,
    /// The directory the in-process workers' `read_file` may read.
    pub workdir: PathBuf,
    /// The cap on long polls.
    pub max_poll_ms: u64,
    /// Prices each model call as it is recorded.
    pub prices: cairn_runtime::PriceTable,
    /// Session states cached before parked ones are dropped.
    pub cache_sessions: usize,
    /// Bytes the cached session states may hold before parked ones are dropped.
    pub cache_bytes: usize,
    /// Event streams open at once, at most.
    pub max_streams: usize,
    /// Request bodies larger than this are refused with 413.
    pub body_limit_bytes: usize,
}

/// Runs the server until a signal, then drains; exit 0 after a clean shutdown.
pub async fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let tokens = args.tokens.as_deref().map(Tokens::load).transpose()?;
    let config = ServerConfig {
        tokens,
        max_poll_ms: args.max_poll_ms,
        max_streams: args.max_streams,
        body_limit_bytes: args.body_limit_bytes,
        ..ServerConfig::default()
    };
    // Checked before the store is opened: a refused address changes nothing.
    cairn_server::check_exposure(args.listen, &config)?;
    let (store, opened, dir) = match &args.store {
        StoreLocation::Dir(dir) => {
            let opened = embedded::open(dir, OpenMode::Create, args.engine).await?;
            for note in &opened.notes {
                note!("note: {note}");
            }
            if !opened.losses.is_empty() {
                note!("warning: {}", describe_losses(&opened.losses));
            }
            (opened.store.clone(), Some(opened), Some(dir.clone()))
        }
        StoreLocation::Url(url) => {
            if args.engine.is_some() {
                anyhow::bail!(
                    "--engine chooses an embedded store's engine; it does not apply to --store"
                );
            }
            (database::connect(url, &args.pool).await?, None, None)
        }
    };
    let engine = Engine::new(store, Arc::new(SystemClock))
        .with_cache_capacity(args.cache_sessions)
        .with_cache_bytes(args.cache_bytes);
    engine.set_prices(args.prices);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    // The line tests and scripts wait for; with port 0 it names the port the OS chose.
    showln!("listening on http://{addr}");
    std::io::stdout().flush()?;

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let signals = tokio::spawn(async move {
        wait_for_signal().await;
        let _ = stop.send(true);
    });
    let pool =
        (args.local_workers > 0).then(|| start_workers(&engine, args.local_workers, &args.workdir));
    // The pool stops leasing when the drain begins, so that its running activities report
    // while the server still takes reports.
    let pool_stopped = {
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            let _ = stopped.wait_for(|s| *s).await;
            if let Some(pool) = pool {
                pool.shutdown().await;
            }
        })
    };
    let shutdown = {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    // Commands run on this machine against the store directory reach it through its socket.
    let socket = dir.and_then(|dir| match cairn::socket::StoreSocket::serve(&dir, engine.clone()) {
        Ok(socket) => Some(socket),
        Err(e) => {
            note!(
                "note: cannot serve the store's socket in {} ({e}); commands with --data cannot reach this store while the server runs",
                dir.display()
            );
            None
        }
    });
    let served = cairn_server::serve(engine, listener, config, shutdown).await;
    signals.abort();
    if let Some(socket) = socket {
        socket.close().await;
    }
    served?;
    // Activities still running past the drain are cut off with the process: their leases
    // lapse, and the next start records the attempts as timed out and retries them.
    if tokio::time::timeout(Duration::from_secs(1), pool_stopped)
        .await
        .is_err()
    {
        note!(
            "note: in-process workers still running at exit; their tasks are retried after a restart"
        );
    }
    drop(opened);
    Ok(ExitCode::SUCCESS)
}

fn start_workers(engine: &Engine, concurrency: usize, workdir: &Path) -> WorkerPool {
    let activities = Activities {
        models: Arc::new(StandardModels::new()),
        tools: Arc::new(ToolRegistry::hosted(workdir.to_path_buf())),
    };
    WorkerPool::start(
        engine.clone(),
        activities,
        WorkerConfig {
            concurrency,
            // Other workers (remote ones) may host what these do not: leave their tasks queued.
            take_unhosted: false,
            ..WorkerConfig::default()
        },
    )
}

/// Completes on SIGTERM or SIGINT.
async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                note!("warning: cannot listen for SIGTERM ({e}); stop with SIGINT");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
