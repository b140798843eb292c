//! The runtime: history events and their codec, the pure workflow state machine, the `Store`
//! trait with memory and sled backends, the engine (append, then dispatch), the client, replay.

pub mod codec;
pub mod error;
pub mod event;
pub mod store;
pub mod workflow;

pub use error::{Error, Result};
pub use event::{
    ActivityFailure, ErrorClass, Event, EventEnvelope, Limits, RetryPolicy, SessionStarted,
    SCHEMA_VERSION,
};
pub use store::memory::MemoryStore;
pub use store::{
    AppendRequest, Lease, NewTask, SessionInfo, SessionStatus, Store, Task, TaskId, TaskKind,
};
pub use workflow::{Command, SessionState, TurnOutcome};
