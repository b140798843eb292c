//! Call options a session sets for its model calls besides the model itself: which tools the
//! model may or must call (`tool_choice`), the provider's own server tools it may use, and
//! whether Anthropic prompt caching is off. Each provider renders them per its documentation.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Which tools the model may or must call.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides (every provider's default).
    Auto,
    /// The model must call at least one tool, any of them.
    Any,
    /// The model must not call a tool.
    None,
    /// The model must call this tool.
    Tool(String),
}

impl ToolChoice {
    /// Parses `auto`, `any`, `none` or `tool:NAME`.
    pub fn parse(text: &str) -> Result<ToolChoice, String> {
        match text {
            "auto" => Ok(ToolChoice::Auto),
            "any" => Ok(ToolChoice::Any),
            "none" => Ok(ToolChoice::None),
            other => match other.strip_prefix("tool:") {
                Some(name) if !name.is_empty() => Ok(ToolChoice::Tool(name.to_owned())),
                _ => Err(format!(
                    "tool choice {other:?} is not one of auto, any, none or tool:NAME"
                )),
            },
        }
    }

    /// Whether the choice forces a tool call (`any` or a named tool).
    pub fn forces_a_call(&self) -> bool {
        matches!(self, ToolChoice::Any | ToolChoice::Tool(_))
    }
}

impl fmt::Display for ToolChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ToolChoice::Auto => f.write_str("auto"),
            ToolChoice::Any => f.write_str("any"),
            ToolChoice::None => f.write_str("none"),
            ToolChoice::Tool(name) => write!(f, "tool:{name}"),
        }
    }
}

/// A tool the provider itself runs (its calls and results come back as opaque parts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerToolKind {
    /// Web search (Anthropic `web_search`, OpenAI Responses `web_search`).
    WebSearch,
    /// Fetching a web page or PDF (Anthropic `web_fetch`).
    WebFetch,
}

impl ServerToolKind {
    /// Its name, as on the command line and in errors.
    pub fn as_str(self) -> &'static str {
        match self {
            ServerToolKind::WebSearch => "web_search",
            ServerToolKind::WebFetch => "web_fetch",
        }
    }
}

/// A server tool a session turns on.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ServerTool {
    /// Which tool.
    pub kind: ServerToolKind,
    /// How many times one model call may use it (Anthropic's `max_uses`), when limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_uses: Option<u32>,
}

impl ServerTool {
    /// Parses `web_search` or `web_fetch`, optionally with a use limit: `web_search=3`.
    pub fn parse(text: &str) -> Result<ServerTool, String> {
        let (name, max_uses) = match text.split_once('=') {
            Some((name, n)) => {
                let n: u32 = n.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    format!("server tool {text:?}: {n:?} is not a positive use limit")
                })?;
                (name, Some(n))
            }
            None => (text, None),
        };
        let kind = match name {
            "web_search" => ServerToolKind::WebSearch,
            "web_fetch" => ServerToolKind::WebFetch,
            other => {
                return Err(format!(
                    "server tool {other:?} is not one of web_search, web_fetch"
                ))
            }
        };
        Ok(ServerTool { kind, max_uses })
    }

    /// Parses a comma-separated list (`web_search,web_fetch=2`); each tool at most once.
    pub fn parse_list(text: &str) -> Result<Vec<ServerTool>, String> {
        let mut tools: Vec<ServerTool> = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let tool = ServerTool::parse(item)?;
            if tools.iter().any(|t| t.kind == tool.kind) {
                return Err(format!("server tool {} is named twice", tool.kind.as_str()));
            }
            tools.push(tool);
        }
        Ok(tools)
    }
}

/// The options of a session's model calls (all off by default, and then not recorded).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CallOptions {
    /// Which tools the model may or must call; unset means the provider's default (auto).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// The provider's own tools the model may use.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_tools: Vec<ServerTool>,
    /// Turns prompt-cache breakpoints off (Anthropic's `cache_control`, Bedrock's `cachePoint`;
    /// on by default).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_prompt_cache: bool,
}

impl CallOptions {
    /// Whether nothing is set (the record then omits the options).
    pub fn is_default(&self) -> bool {
        *self == CallOptions::default()
    }

    /// The options of one model call: round `round` (from 0) of a turn whose tool choice is
    /// `turn_choice` (the turn's override, else the session's). A choice that forces a call
    /// (`any`, a named tool) applies to the turn's first call only; later rounds are `auto`,
    /// or the turn could never end with an answer.
    pub fn for_call(&self, turn_choice: Option<&ToolChoice>, round: u32) -> CallOptions {
        let choice = turn_choice.or(self.tool_choice.as_ref()).cloned();
        let tool_choice = match choice {
            Some(c) if c.forces_a_call() && round > 0 => Some(ToolChoice::Auto),
            other => other,
        };
        CallOptions {
            tool_choice,
            server_tools: self.server_tools.clone(),
            no_prompt_cache: self.no_prompt_cache,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_and_server_tools_parse_and_print() {
        for text in ["auto", "any", "none", "tool:calculator"] {
            assert_eq!(ToolChoice::parse(text).unwrap().to_string(), text);
        }
        assert!(ToolChoice::parse("tool:")
            .unwrap_err()
            .contains("tool:NAME"));
        assert!(ToolChoice::parse("required").is_err());
        let tools = ServerTool::parse_list("web_search, web_fetch=2").unwrap();
        assert_eq!(
            tools,
            vec![
                ServerTool {
                    kind: ServerToolKind::WebSearch,
                    max_uses: None
                },
                ServerTool {
                    kind: ServerToolKind::WebFetch,
                    max_uses: Some(2)
                }
            ]
        );
        assert!(ServerTool::parse_list("web_search,web_search")
            .unwrap_err()
            .contains("twice"));
        assert!(ServerTool::parse("code_execution")
            .unwrap_err()
            .contains("not one of"));
        assert!(ServerTool::parse("web_search=0").is_err());
    }

    #[test]
    fn a_forced_choice_holds_for_the_first_round_only() {
        let session = CallOptions {
            tool_choice: Some(ToolChoice::Any),
            ..CallOptions::default()
        };
        assert_eq!(session.for_call(None, 0).tool_choice, Some(ToolChoice::Any));
        assert_eq!(
            session.for_call(None, 1).tool_choice,
            Some(ToolChoice::Auto)
        );
        let none = ToolChoice::None;
        assert_eq!(session.for_call(Some(&none), 3).tool_choice, Some(none));
        assert_eq!(
            CallOptions::default().for_call(None, 0),
            CallOptions::default()
        );
        // Unset options are not recorded at all.
        assert_eq!(
            serde_json::to_string(&CallOptions::default()).unwrap(),
            "{}"
        );
    }
}
