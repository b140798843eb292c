//! `--mcp-config FILE` of `cairn run` and `cairn worker`: the MCP servers of the file
//! connected, and their tools added to what this process hosts (and, for `run`, to what a new
//! session offers).

use super::out::note;
use anyhow::Context;
use cairn_activities::ToolRegistry;
use cairn_mcp::{McpConfig, McpServers};
use std::path::Path;
use std::sync::Arc;

/// The servers of `config`, connected, their tools listed; `None` without a file.
pub async fn connect(config: Option<&Path>) -> anyhow::Result<Option<McpServers>> {
    let Some(config) = config else {
        return Ok(None);
    };
    let servers = McpConfig::load(config)?;
    let connected = McpServers::connect(&servers)
        .await
        .with_context(|| format!("--mcp-config {}", config.display()))?;
    let names: Vec<String> = connected.tools().iter().map(|t| t.spec_name()).collect();
    note!(
        "mcp: {} server(s), tools {}",
        servers.len(),
        if names.is_empty() {
            "(none)".to_owned()
        } else {
            names.join(", ")
        }
    );
    Ok(Some(connected))
}

/// `tools` with the servers' tools added.
pub fn with_tools(tools: &Arc<ToolRegistry>, servers: Option<&McpServers>) -> Arc<ToolRegistry> {
    match servers {
        None => tools.clone(),
        Some(servers) => {
            let mut registry = (**tools).clone();
            servers.register_into(&mut registry);
            Arc::new(registry)
        }
    }
}
