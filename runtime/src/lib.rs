//! The runtime: history events and their codec, the pure workflow state machine, the `Store`
//! trait with memory and sled backends, the engine (append, then dispatch), the client, replay.

pub mod budget;
pub mod client;
pub mod clock;
pub mod codec;
pub mod compaction;
pub mod diff;
pub mod engine;
pub mod error;
pub mod event;
pub mod export;
pub mod follow;
pub mod fork;
pub mod fsck;
pub mod idempotency;
pub mod policy;
pub mod pricing;
pub mod progress;
pub mod replay;
mod report_queue;
pub mod stages;
mod state_cache;
pub mod store;
mod task_waiters;
pub mod wire;
pub mod workflow;

#[cfg(test)]
mod client_tests;
#[cfg(test)]
mod codec_props;
#[cfg(test)]
mod engine_handoff_tests;
#[cfg(test)]
mod engine_idempotent_tests;
#[cfg(test)]
mod engine_memory_tests;
#[cfg(test)]
mod engine_race_tests;
#[cfg(test)]
mod engine_report_batch_tests;
#[cfg(test)]
mod engine_resume_tests;
#[cfg(test)]
mod engine_test_store;
#[cfg(test)]
mod engine_test_support;
#[cfg(test)]
mod workflow_approval_tests;
#[cfg(test)]
mod workflow_budget_tests;
#[cfg(test)]
mod workflow_compaction_tests;
#[cfg(test)]
mod workflow_props;
#[cfg(test)]
mod workflow_tests;

pub use budget::{Budget, BudgetExceeded, BudgetLimit, BudgetScope, UsageTotals};
pub use client::{Client, EventStream, SessionOptions, SessionQuery, Transport};
pub use clock::{Clock, ManualClock, SystemClock};
pub use compaction::{CompactionPolicy, CompactionTrigger};
pub use engine::{
    ActivityInput, ActivityRef, ActivityReport, ActivityTimeouts, AppendedEvents, DeltaEvent,
    Engine, LeasedTask, ResumeReport, ToolSetFields, TranscriptFields, UnresumableSession,
    WatchGuard,
};
pub use error::{Error, Result};
pub use event::{
    ActivityFailure, ErrorClass, Event, EventEnvelope, FailurePhase, ForkOrigin, Limits, Queues,
    RetryPolicy, SessionStarted, SCHEMA_VERSION,
};
pub use follow::{SessionEvent, SessionEvents};
pub use policy::{PolicyDecision, PolicyRule, PrefixKind, ToolPolicy};
pub use pricing::{CostMicros, PriceTable};
pub use progress::{interrupted_output, streamed_outputs, StreamedOutput};
pub use replay::{replay, Replay};
pub use store::memory::MemoryStore;
pub use store::{
    AppendRequest, Lease, LeaseHolder, LeaseRequest, NewTask, SessionInfo, SessionStatus, Store,
    SyncTimes, Task, TaskFence, TaskFilter, TaskId, TaskKind, DEFAULT_QUEUE,
};
pub use task_waiters::TaskReceiver;
pub use workflow::{Command, SessionState, Transition, TurnOutcome, WORKFLOW_VERSION};
