//! The integration test binary: one binary, one module per area.

// Tests wait on real time (polling for a lease, child processes); the clock ban is for pure code.
#![allow(clippy::disallowed_methods)]

mod approvals;
mod budget;
mod chaos;
mod cli;
mod coding_tools;
mod compaction;
mod content;
mod corruption;
mod delete;
mod engine;
mod faults;
mod first_hour;
mod golden;
mod golden_media;
mod history_files;
mod idempotency;
mod library;
mod lifecycle;
mod mcp;
mod postgres;
mod powercut;
mod provider_features;
mod providers;
mod remote;
mod remote_run;
mod server;
mod service;
mod store_crash;
mod support;
mod tool_sets;
mod transcripts;
mod ui;
mod versions;
mod wire;
mod worker_support;
