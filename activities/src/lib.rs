//! The edges of cairn: model providers and tools behind one activity boundary, each failure
//! classified so the runtime can retry without knowing who failed.

#![warn(missing_docs)]

mod context;
mod error;
mod model;
pub mod providers;
mod scripted;
mod tool;
mod tools;

pub use context::ActivityContext;
pub use error::{Error, ErrorKind, Result};
pub use model::{CallContext, DeltaSink, ModelProvider, ModelRequest, NoDeltas};
pub use scripted::{ReceivedCall, Script, ScriptedProvider, DEMO_SCRIPT};
pub use tool::{PolicySubject, SubjectKind, Tool, ToolCall, ToolOutput, ToolRegistry};
pub use tools::{Calculator, EditFile, ListDir, ReadFile, Shell, WriteFile};
