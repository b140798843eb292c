//! Running a server: resume the engine's sessions, fire its timers, serve the router on a
//! listener, and on shutdown drain — stop handing out tasks, keep taking reports and
//! heartbeats while workers hold leases (up to the drain time), end long polls and event
//! streams, and close gracefully.

use crate::app::{self, AppState};
use crate::{Error, Result, ServerConfig};
use cairn_runtime::Engine;
use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;
use tracing::{info, warn};

/// After the drain, connections still open (a slow upload) get this long to finish.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// A server over an engine: its routers share one state, so every transport it is served on
/// drains together.
#[derive(Clone)]
pub struct Server {
    state: AppState,
}

impl Server {
    /// A server over `engine`.
    pub fn new(engine: Engine, config: ServerConfig) -> Self {
        Server {
            state: AppState::new(engine, config),
        }
    }

    /// The whole API, to serve on any transport (TCP, a unix socket) or call in-process.
    pub fn router(&self) -> axum::Router {
        app::router(self.state.clone())
    }

    /// Starts draining: leasing answers 503 and health says `draining`.
    pub fn drain(&self) {
        self.state.draining.cancel();
    }

    /// Ends every long poll and event stream (their connections then close).
    pub fn close(&self) {
        self.state.closing.cancel();
    }

    /// Serves on `listener` until `shutdown` completes, then drains and closes (see the
    /// module doc). Resumes the engine's sessions first, keeping leases (workers of a
    /// previous run may still hold them; lapsed ones are recorded by the timers), and fires
    /// the engine's timers while it serves.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<()> {
        let addr = listener.local_addr()?;
        check_exposure(addr, &self.state.config)?;
        let engine = self.state.engine.clone();
        let config = self.state.config.clone();
        let resumed = engine.resume(false).await?;
        if !resumed.running_sessions.is_empty() {
            info!(
                sessions = resumed.running_sessions.len(),
                tasks = resumed.outstanding_tasks,
                "resumed sessions with a turn in progress"
            );
        }
        match &config.tokens {
            None => warn!(
                %addr,
                "no tokens file: every request acts for namespace `default` with both roles \
                 (loopback only)"
            ),
            Some(tokens) => info!(%addr, tokens = tokens.len(), "serving with bearer tokens"),
        }
        let timers_stop = tokio_util::sync::CancellationToken::new();
        let timers = tokio::spawn({
            let engine = engine.clone();
            let stop = timers_stop.clone();
            let every = Duration::from_millis(config.timer_interval_ms.max(1));
            async move { engine.run_timers(every, stop.cancelled_owned()).await }
        });
        // Other servers on the same database append too: follow them, so that turn waiters,
        // event streams and long-polling workers here hear of what they record.
        let follower = engine.store().shared().then(|| {
            let engine = engine.clone();
            let stop = timers_stop.clone();
            let poll = Duration::from_millis(config.store_poll_ms.max(1));
            tokio::spawn(async move { engine.follow_store(poll, stop.cancelled_owned()).await })
        });

        let app = self.router();
        let state = self.state.clone();
        let drained = async move {
            shutdown.await;
            info!("shutting down: draining");
            state.draining.cancel();
            wait_for_leases(&state.engine, Duration::from_millis(config.drain_ms)).await;
            state.closing.cancel();
        };
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(drained)
            .into_future();
        tokio::pin!(served);
        let closing = self.state.closing.clone();
        let result = tokio::select! {
            result = &mut served => result.map_err(Error::Io),
            _ = async {
                closing.cancelled().await;
                tokio::time::sleep(CLOSE_GRACE).await;
            } => {
                warn!("connections still open {CLOSE_GRACE:?} after the drain; closing them");
                Ok(())
            }
        };
        timers_stop.cancel();
        if let Err(e) = timers.await {
            warn!(error = %e, "the timer task ended abnormally");
        }
        if let Some(follower) = follower {
            if let Err(e) = follower.await {
                warn!(error = %e, "the store follower ended abnormally");
            }
        }
        info!("shut down");
        result
    }
}

/// Waits until no worker holds a lease this server handed out, or `limit` passed. Leases
/// other servers of a shared store handed out are theirs to wait for.
async fn wait_for_leases(engine: &Engine, limit: Duration) {
    let deadline = AppState::deadline(limit);
    loop {
        let now = engine.now_ms();
        let here: std::collections::BTreeSet<_> = engine.leases_held_here().into_iter().collect();
        let mut held = 0;
        for (id, lease_attempt) in &here {
            match engine.store().task(id).await {
                Ok(Some(t))
                    if t.held && t.visible_at_ms > now && t.lease_attempt == *lease_attempt =>
                {
                    held += 1;
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(error = %e, "cannot read the held leases while draining");
                    held = 0;
                    break;
                }
            }
        }
        if held == 0 {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            warn!(
                held,
                "drain time is up with leases still held; they lapse and are retried after a restart"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Refuses to serve without tokens anywhere but on a loopback address: without them anyone
/// who can connect reads and runs every session.
pub fn check_exposure(addr: SocketAddr, config: &ServerConfig) -> Result<()> {
    if config.tokens.is_none() && !addr.ip().is_loopback() {
        return Err(Error::Exposed { addr });
    }
    Ok(())
}

/// The API of a new server over `engine`, for a caller that serves it itself. Use
/// [`Server::router`] to serve one server on several transports that drain together.
pub fn router(engine: Engine, config: ServerConfig) -> axum::Router {
    Server::new(engine, config).router()
}

/// [`Server::serve`] of a new server over `engine`.
pub async fn serve(
    engine: Engine,
    listener: TcpListener,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    Server::new(engine, config).serve(listener, shutdown).await
}
