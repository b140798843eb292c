//! Worker pools: lease due tasks from the store, run their activities under timeouts with
//! lease heartbeats, and report results to the engine. Shutdown stops leasing and drains.

// Workers are the impure edge: they wait on timers (poll intervals, heartbeats, timeouts).
#![allow(clippy::disallowed_methods)]

mod first_wait;
mod models;
pub mod policy;
mod pool;
mod progress;
mod source;

pub use models::{ModelResolver, StandardModels, STANDARD_PROVIDERS};
pub use pool::{
    filter_of, Activities, WorkerConfig, WorkerPool, DEFAULT_CONCURRENCY, MAX_EXTRA_HANDED,
};
pub use source::{EngineSource, TaskSource};

/// The workers' one error type.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] cairn_runtime::Error),
    /// An activity could not be set up.
    #[error(transparent)]
    Activity(#[from] cairn_activities::Error),
    /// A requested tool policy cannot be recorded.
    #[error("invalid tool policy: {reason}")]
    InvalidPolicy {
        /// Which rule, and what is wrong with it.
        reason: String,
    },
}

/// Result alias for workers.
pub type Result<T, E = Error> = std::result::Result<T, E>;
