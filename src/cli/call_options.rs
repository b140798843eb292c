//! The `cairn run` flags of a session's model-call options: `--tool-choice` (the session's for
//! a new session, this turn's for an existing one), `--server-tool` and `--no-prompt-cache`
//! (fixed when a session starts).

use cairn_ledger::{CallOptions, ServerTool, ToolChoice};

/// Tool choice, server tools and prompt caching (README, "Tool choice, server tools and
/// prompt caching").
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CallOptionArgs {
    /// Which tools the model may or must call: auto, any, none or tool:NAME. For a new
    /// session it is the session's choice; for an existing one, this turn's. A choice that
    /// forces a call (any, tool:NAME) holds for the turn's first model call only.
    #[arg(long, value_name = "CHOICE", value_parser = ToolChoice::parse)]
    pub tool_choice: Option<ToolChoice>,
    /// The provider's own server tools a new session turns on, comma-separated, each with an
    /// optional use limit: web_search[=N],web_fetch[=N] (Anthropic: both; OpenAI Responses:
    /// web_search without a limit; others: none).
    #[arg(long, value_name = "LIST", value_parser = parse_server_tools)]
    pub server_tool: Option<ServerTools>,
    /// Do not place prompt-cache breakpoints (Anthropic `cache_control`, Bedrock `cachePoint`)
    /// in a new session's requests.
    #[arg(long)]
    pub no_prompt_cache: bool,
}

/// The list `--server-tool` names. (A type of its own: clap reads an `Option<Vec<_>>` field
/// as a flag given many times, not as one value that parses into a list.)
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerTools(pub Vec<ServerTool>);

fn parse_server_tools(text: &str) -> Result<ServerTools, String> {
    ServerTool::parse_list(text).map(ServerTools)
}

impl CallOptionArgs {
    /// The options a new session records.
    pub fn session_options(&self) -> CallOptions {
        CallOptions {
            tool_choice: self.tool_choice.clone(),
            server_tools: self.server_tool.clone().unwrap_or_default().0,
            no_prompt_cache: self.no_prompt_cache,
        }
    }

    /// Refuses the flags fixed at a session's start for an existing session; the tool choice
    /// applies to this turn instead.
    pub fn refuse_for_existing(&self, session_id: &str) -> anyhow::Result<()> {
        if self.server_tool.is_some() || self.no_prompt_cache {
            super::exit_codes::usage_bail!(
                "session {session_id} exists, and --server-tool and --no-prompt-cache apply \
                 only when a session starts (its history records them); leave them out to \
                 continue the session"
            );
        }
        Ok(())
    }
}
