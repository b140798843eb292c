//! What a first program needs, in one import: `use cairn::prelude::*;`.
//!
//! The embedded cairn and its builder, the client and what it takes and gives back, and what a
//! tool implements. Everything else is in the member crates ([`crate::runtime`],
//! [`crate::activities`], [`crate::workers`], [`crate::ledger`]).

pub use crate::builder::{Cairn, CairnBuilder};
pub use crate::error::{Error, Result};
pub use async_trait::async_trait;
pub use cairn_activities::{ActivityContext, Error as ToolError, Tool, ToolCall, ToolOutput};
pub use cairn_ledger::{ModelSpec, ToolSpec};
pub use cairn_runtime::{Client, SessionEvent, SessionEvents, SessionOptions, TurnOutcome};
