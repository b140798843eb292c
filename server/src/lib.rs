//! The cairn server: one process owns the embedded store and runs the engine; clients and
//! workers are other processes speaking the `/v1` HTTP API of [`cairn_runtime::wire`].
//!
//! [`Server::router`] is the whole API as an axum [`Router`](axum::Router), transport-agnostic
//! (serve it on TCP, a unix socket, or call it in-process); [`serve`] runs it on a TCP listener
//! with the engine's timers and a graceful drain on shutdown.

// The server is the impure edge: long polls and the drain wait on real time.
#![allow(clippy::disallowed_methods)]

mod answered_again;
mod app;
mod auth;
mod compact;
mod delete;
mod errors;
mod events;
mod idempotency_key;
mod inspect;
mod lenient;
mod openapi;
mod serve;
mod sessions;
mod tool_sets;
mod transcripts;
mod ui;
mod worker;
mod worker_reports;

pub use auth::{Caller, Role, Tokens};
pub use errors::ApiError;
pub use openapi::openapi;
pub use serve::{check_exposure, router, serve, Server};

/// Event streams a server keeps open at once by default ([`ServerConfig::max_streams`]).
pub const DEFAULT_MAX_STREAMS: usize = 4096;

/// Request bodies larger than this are refused with 413 by default (4 MiB).
pub const DEFAULT_BODY_LIMIT_BYTES: u64 = 4 * 1024 * 1024;

/// How a server behaves.
#[derive(Debug)]
pub struct ServerConfig {
    /// The tokens; `None` serves every request as the default namespace with both roles,
    /// which [`check_exposure`] allows on loopback addresses only.
    pub tokens: Option<Tokens>,
    /// Bodies larger than this are refused with 413.
    pub body_limit_bytes: usize,
    /// Long polls (a turn's outcome, leasing) answer after at most this long.
    pub max_poll_ms: u64,
    /// On shutdown, keep taking reports and heartbeats for at most this long while workers
    /// still hold leases.
    pub drain_ms: u64,
    /// How often the engine's durable timers (lapsed leases, start deadlines) fire.
    pub timer_interval_ms: u64,
    /// On a store other servers write too ([`cairn_runtime::store::Store::shared`]): how
    /// often the engine polls for their appends, besides the store's change hints (which
    /// may be lost).
    pub store_poll_ms: u64,
    /// Event streams open at once, at most; one more is refused with 503. Each keeps its
    /// session's state in memory beyond the state cache's bounds.
    pub max_streams: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            tokens: None,
            body_limit_bytes: DEFAULT_BODY_LIMIT_BYTES as usize,
            max_poll_ms: 300_000,
            drain_ms: 10_000,
            timer_interval_ms: 200,
            store_poll_ms: 500,
            max_streams: DEFAULT_MAX_STREAMS,
        }
    }
}

/// Errors of the server crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tokens file cannot be read or is malformed.
    #[error("tokens file {path}: {reason}")]
    Tokens {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A server without tokens was asked to listen where other machines can reach it.
    #[error(
        "refusing to listen on {addr} without a tokens file: anyone who can reach it could \
         read and run every session; pass --tokens FILE, or listen on a loopback address \
         (127.0.0.1, ::1)"
    )]
    Exposed {
        /// The address.
        addr: std::net::SocketAddr,
    },
    /// Listening or serving failed.
    #[error("serving failed: {0}")]
    Io(#[from] std::io::Error),
    /// The engine failed at start (resuming sessions).
    #[error(transparent)]
    Runtime(#[from] cairn_runtime::Error),
}

/// Result alias of the server crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
