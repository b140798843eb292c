//! The tools of MCP servers, hosted by cairn workers: a configuration file names the servers
//! (a command over stdio, or a streamable HTTP URL), [`McpServers::connect`] starts or reaches
//! each with the official SDK (`rmcp`), lists its tools, and exposes each as a cairn [`Tool`]
//! named `PREFIX__tool` that runs with the server's timeout, stops when its activity is
//! cancelled, and sends the call's idempotency key in the request's `_meta`.
//!
//! [`Tool`]: cairn_activities::Tool

#![warn(missing_docs)]

mod config;
mod content;
mod error;
mod servers;
pub mod test_server;

pub use config::{
    exposed_name, McpConfig, Server, ServerConfig, Transport, DEFAULT_TIMEOUT, MAX_TOOL_NAME,
};
pub use content::tool_output;
pub use error::{Error, Result};
pub use servers::{McpServers, McpTool, IDEMPOTENCY_KEY_META};
