//! cairn: a durable-workflow runtime for LLM agents. This facade re-exports the crates:
//! [`ledger`] (pure transcript model), [`runtime`] (events, workflow, stores, engine, client),
//! [`activities`] (model providers and tools) and [`workers`] (pools that run activities), and
//! gives a first program what it needs: [`prelude`] and the embedded [`Cairn`] ([`builder`]).

pub use cairn_activities as activities;
pub use cairn_ledger as ledger;
pub use cairn_runtime as runtime;
pub use cairn_workers as workers;

pub mod builder;
pub mod demo;
pub mod error;
pub mod host;
pub mod prelude;
pub mod socket;

pub use builder::{Cairn, CairnBuilder};
pub use error::{Error, Result};
