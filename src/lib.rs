//! cairn: a durable-workflow runtime for LLM agents. This facade re-exports the crates:
//! [`ledger`] (pure transcript model), [`runtime`] (events, workflow, stores, engine, client),
//! [`activities`] (model providers and tools) and [`workers`] (pools that run activities).

pub use cairn_activities as activities;
pub use cairn_ledger as ledger;
pub use cairn_runtime as runtime;
pub use cairn_workers as workers;

pub mod demo;
pub mod host;
pub mod socket;
