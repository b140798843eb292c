//! The router: every route of the `/v1` API over one shared [`AppState`], with the layers
//! every request goes through (a tracing span, the body limit, JSON error bodies, a panic
//! guard), and the health route.

use crate::answered_again::AnsweredAgain;
use crate::auth::AnyCaller;
use crate::errors::{json_errors, ApiError};
use crate::tool_sets::ToolSetDigests;
use crate::{
    compact, delete, events, inspect, openapi, sessions, ui, worker, worker_reports, ServerConfig,
};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{Request, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use cairn_runtime::wire::{ErrorBody, EventStreamStats, Health, StoreSyncStats};
use cairn_runtime::Engine;
use cairn_runtime::Store;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

/// What every handler shares; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The engine.
    pub engine: Engine,
    /// The configuration.
    pub config: Arc<ServerConfig>,
    /// Cancelled once shutdown began: no more tasks are handed out.
    pub draining: CancellationToken,
    /// Cancelled when the server closes: long polls answer and event streams end, so that
    /// their connections let the graceful shutdown finish.
    pub closing: CancellationToken,
    /// Numbers the session ids the server generates.
    pub id_counter: Arc<AtomicU64>,
    /// Event streams open now (bounded by [`ServerConfig::max_streams`]).
    pub open_streams: Arc<AtomicUsize>,
    /// Worker reports being recorded, and those that handed out tasks, by lease; lease
    /// requests under a key, by key: a try sent again is answered as the first was.
    pub answered_again: AnsweredAgain,
    /// The digests of the tool sets of model tasks handed to workers that keep them.
    pub tool_set_digests: ToolSetDigests,
}

impl AppState {
    /// A state over `engine`, not draining.
    pub fn new(engine: Engine, config: ServerConfig) -> Self {
        AppState {
            engine,
            config: Arc::new(config),
            draining: CancellationToken::new(),
            closing: CancellationToken::new(),
            id_counter: Arc::new(AtomicU64::new(0)),
            answered_again: AnsweredAgain::default(),
            tool_set_digests: ToolSetDigests::default(),
            open_streams: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Whether shutdown began.
    pub fn is_draining(&self) -> bool {
        self.draining.is_cancelled()
    }

    /// A long poll's wait: `requested_ms` (or `default_ms`), at most the configured cap.
    pub fn poll_wait(&self, requested_ms: Option<u64>, default_ms: u64) -> Duration {
        Duration::from_millis(
            requested_ms
                .unwrap_or(default_ms)
                .min(self.config.max_poll_ms),
        )
    }

    /// When a wait of `wait` from now ends; waits past what the clock can say end in a year.
    pub fn deadline(wait: Duration) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        now.checked_add(wait)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
    }
}

/// The API over `state`.
pub fn router(state: AppState) -> Router {
    let body_limit = state.config.body_limit_bytes;
    let api = Router::new()
        .route(
            "/v1/sessions",
            post(sessions::create_session).get(sessions::list_sessions),
        )
        .route(
            "/v1/sessions/{id}",
            get(sessions::describe_session).delete(delete::delete_session),
        )
        .route("/v1/sessions/{id}/messages", post(sessions::send_message))
        .route("/v1/sessions/{id}/turns/{turn}", get(sessions::wait_turn))
        .route("/v1/sessions/{id}/history", get(sessions::history))
        .route("/v1/sessions/{id}/transcript", get(sessions::transcript))
        .route("/v1/sessions/{id}/cancel", post(sessions::cancel))
        .route("/v1/sessions/{id}/compact", post(compact::compact))
        .route("/v1/sessions/{id}/events", get(events::events))
        .route("/v1/sessions/{id}/state", get(inspect::state_at))
        .route("/v1/sessions/{id}/fork", post(inspect::fork))
        .route(
            "/v1/sessions/{id}/approvals/{tool_use_id}",
            post(sessions::decide_approval),
        )
        .route("/v1/worker/lease", post(worker::lease))
        .route("/v1/worker/input", post(worker::input))
        .route("/v1/worker/heartbeat", post(worker::heartbeat))
        .route("/v1/worker/progress", post(worker::progress))
        .route("/v1/worker/report", post(worker_reports::report))
        .route("/v1/worker/reports", post(worker_reports::reports))
        .route("/v1/worker/deltas", post(worker::deltas))
        .route("/v1/health", get(health))
        .route("/v1/openapi.json", get(openapi::document))
        .merge(ui::routes())
        .fallback(|| async { ApiError::not_found("no such route") })
        .with_state(state);
    api.layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::map_response(json_errors))
        .layer(CatchPanicLayer::custom(panicked))
        .layer(
            // One span per request: method and path only (no query, no headers, no body:
            // tokens and prompts stay out of the log).
            TraceLayer::new_for_http().make_span_with(|request: &Request<_>| {
                tracing::info_span!(
                    "request",
                    method = %request.method(),
                    path = %request.uri().path(),
                )
            }),
        )
}

/// The last line of defence: a panic in a handler is a bug, answered as 500 JSON (its
/// message goes to the log only).
fn panicked(panic: Box<dyn std::any::Any + Send + 'static>) -> axum::response::Response {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!(panic = %what, "a request handler panicked");
    use axum::response::IntoResponse;
    ApiError::new(
        cairn_runtime::wire::ErrorCode::Internal,
        "the server failed to carry out the request (see its log)",
    )
    .into_response()
}

/// `GET /v1/health`: `ok`, or `draining` once shutdown began; `failed`, with status 503,
/// while the store refuses writes (an embedded store after a write or sync that failed: what
/// it wrote since its last good sync is in doubt, and only a restart, which reopens it, ends
/// that), so that a supervisor's probe restarts the server. Also what the cache of session
/// states holds; and, on an embedded store, its durable commits and sync times.
#[utoipa::path(
    get,
    path = "/v1/health",
    tag = "server",
    responses(
        (status = 200, description = "The server's state", body = Health),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store refuses writes until the server restarts (`status` is `failed`, `reason` says why)", body = Health),
    )
)]
pub async fn health(
    State(state): State<AppState>,
    _caller: AnyCaller,
) -> (StatusCode, Json<Health>) {
    let store = state.engine.store();
    // The store's own words name its files; the log has them (the store logged the failure).
    let reason = store
        .write_refusal()
        .map(|_| STORE_REFUSES_WRITES.to_owned());
    let (code, status) = match (&reason, state.is_draining()) {
        (Some(_), _) => (StatusCode::SERVICE_UNAVAILABLE, "failed"),
        (None, true) => (StatusCode::OK, "draining"),
        (None, false) => (StatusCode::OK, "ok"),
    };
    (
        code,
        Json(Health {
            status: status.to_owned(),
            reason,
            state_cache: Some(state.engine.cache_stats()),
            store_syncs: store_syncs(store.as_ref()),
            event_streams: Some(EventStreamStats {
                open: state.open_streams.load(Ordering::Relaxed) as u64,
                max: state.config.max_streams as u64,
            }),
        }),
    )
}

/// Why a server is `failed`, as `/v1/health` says it.
pub const STORE_REFUSES_WRITES: &str = "the store refuses writes after a write or sync that \
    failed (what it wrote since its last good sync is in doubt); restart the server to reopen \
    it (the server's log names the failure)";

/// The store's durable commits and sync times, when it times them.
fn store_syncs(store: &dyn Store) -> Option<StoreSyncStats> {
    let durable_commits = store.durable_commits()?;
    let times = store.sync_times()?;
    Some(StoreSyncStats {
        durable_commits,
        sync_p50_us: times.quantile_us(0.5).unwrap_or(0),
        sync_p99_us: times.quantile_us(0.99).unwrap_or(0),
        sync_max_us: times.quantile_us(1.0).unwrap_or(0),
    })
}
