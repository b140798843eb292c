//! The MCP configuration file: which servers a worker hosts the tools of, how to reach each
//! (a command over stdio, or a streamable HTTP URL), the prefix its tools are exposed under
//! and the time limit of one call. The shape follows the `mcpServers` files other MCP clients
//! read, so an existing file works as it is.

use crate::error::{Error, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long one tool call may take when the configuration names no timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest exposed tool name providers accept.
pub const MAX_TOOL_NAME: usize = 64;

/// The whole file: `{"mcpServers": {"NAME": {...}, ...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// The servers, by name.
    #[serde(rename = "mcpServers")]
    pub servers: BTreeMap<String, ServerConfig>,
}

/// One server.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// `stdio` or `http` (`streamable-http` is accepted too); inferred from `command` or
    /// `url` when absent.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// The program to start (stdio).
    #[serde(default)]
    pub command: Option<String>,
    /// Its arguments (stdio).
    #[serde(default)]
    pub args: Vec<String>,
    /// Environment variables set for it (stdio), on top of the worker's.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Its working directory (stdio; default: the worker's).
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// The streamable HTTP endpoint (http).
    #[serde(default)]
    pub url: Option<String>,
    /// Headers sent with every request (http), e.g. `Authorization`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// What the server's tools are exposed under: `PREFIX__tool`; default: the server's name.
    #[serde(default)]
    pub prefix: Option<String>,
    /// The time limit of one tool call, in milliseconds (default 60 000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// How to reach one server, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// A child process speaking MCP on its stdin and stdout.
    Stdio {
        /// The program.
        command: String,
        /// Its arguments.
        args: Vec<String>,
        /// Extra environment.
        env: BTreeMap<String, String>,
        /// Its working directory.
        cwd: Option<PathBuf>,
    },
    /// A streamable HTTP endpoint.
    Http {
        /// The endpoint.
        url: String,
        /// Headers sent with every request.
        headers: BTreeMap<String, String>,
    },
}

/// One server, checked: its name, transport, prefix and timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// Its name in the configuration.
    pub name: String,
    /// How to reach it.
    pub transport: Transport,
    /// What its tools are exposed under.
    pub prefix: String,
    /// The time limit of one call.
    pub timeout: Duration,
}

impl McpConfig {
    /// Reads and checks a configuration file.
    pub fn load(path: &Path) -> Result<Vec<Server>> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::ReadConfig {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Checks a configuration's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Vec<Server>> {
        let invalid = |reason: String| Error::InvalidConfig {
            path: path.to_owned(),
            reason,
        };
        let config: McpConfig = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let mut servers = Vec::new();
        for (name, server) in config.servers {
            servers.push(
                server
                    .check(&name)
                    .map_err(|reason| invalid(format!("mcpServers.{name}: {reason}")))?,
            );
        }
        Ok(servers)
    }
}

impl ServerConfig {
    fn check(self, name: &str) -> std::result::Result<Server, String> {
        let kind = match (self.kind.as_deref(), &self.command, &self.url) {
            (Some("stdio"), ..) | (None, Some(_), None) => "stdio",
            (Some("http" | "streamable-http" | "streamable_http"), ..) | (None, None, Some(_)) => {
                "http"
            }
            (Some(other), ..) => {
                return Err(format!(
                    "type {other:?} is not supported; use \"stdio\" or \"http\""
                ))
            }
            (None, Some(_), Some(_)) => return Err("give either command or url, not both".into()),
            (None, None, None) => return Err("give a command (stdio) or a url (http)".into()),
        };
        let transport = if kind == "stdio" {
            let Some(command) = self.command.filter(|c| !c.is_empty()) else {
                return Err("a stdio server needs a command".into());
            };
            if self.url.is_some() || !self.headers.is_empty() {
                return Err("url and headers are for http servers".into());
            }
            Transport::Stdio {
                command,
                args: self.args,
                env: self.env,
                cwd: self.cwd,
            }
        } else {
            let Some(url) = self.url.filter(|u| !u.is_empty()) else {
                return Err("an http server needs a url".into());
            };
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!("url {url:?} is not an http:// or https:// URL"));
            }
            if self.command.is_some() || !self.args.is_empty() || !self.env.is_empty() {
                return Err("command, args and env are for stdio servers".into());
            }
            for (header, value) in &self.headers {
                http::HeaderName::try_from(header.as_str())
                    .map_err(|_| format!("header name {header:?} is not valid"))?;
                http::HeaderValue::try_from(value.as_str())
                    .map_err(|_| format!("the value of header {header:?} is not valid"))?;
            }
            Transport::Http {
                url,
                headers: self.headers,
            }
        };
        let prefix = self.prefix.unwrap_or_else(|| name.to_owned());
        if prefix.is_empty()
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(format!(
                "prefix {prefix:?} must be letters, digits, _ or - (tool names providers accept); \
                 set \"prefix\" when the server's name is not"
            ));
        }
        if prefix.len() + 3 > MAX_TOOL_NAME {
            return Err(format!(
                "prefix {prefix:?} leaves no room for tool names within {MAX_TOOL_NAME} characters"
            ));
        }
        let timeout = match self.timeout_ms {
            Some(0) => return Err("timeout_ms must be at least 1".into()),
            Some(ms) => Duration::from_millis(ms),
            None => DEFAULT_TIMEOUT,
        };
        Ok(Server {
            name: name.to_owned(),
            transport,
            prefix,
            timeout,
        })
    }
}

/// The name a server's tool is exposed under: `PREFIX__tool`, with characters providers do
/// not accept in names replaced by `_`; `None` when it would exceed [`MAX_TOOL_NAME`].
pub fn exposed_name(prefix: &str, tool: &str) -> Option<String> {
    let tool: String = tool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let name = format!("{prefix}__{tool}");
    (!tool.is_empty() && name.len() <= MAX_TOOL_NAME).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<Server>> {
        McpConfig::parse(text, Path::new("mcp.json"))
    }

    #[test]
    fn reads_stdio_and_http_servers_with_defaults() {
        let servers = parse(
            r#"{"mcpServers": {
                "files": {"command": "mcp-files", "args": ["--root", "."], "env": {"A": "1"}},
                "web": {"type": "http", "url": "https://example.invalid/mcp",
                        "headers": {"Authorization": "Bearer t"}, "prefix": "w", "timeout_ms": 5000}
            }}"#,
        )
        .unwrap();
        assert_eq!(
            servers,
            [
                Server {
                    name: "files".into(),
                    transport: Transport::Stdio {
                        command: "mcp-files".into(),
                        args: vec!["--root".into(), ".".into()],
                        env: BTreeMap::from([("A".into(), "1".into())]),
                        cwd: None,
                    },
                    prefix: "files".into(),
                    timeout: DEFAULT_TIMEOUT,
                },
                Server {
                    name: "web".into(),
                    transport: Transport::Http {
                        url: "https://example.invalid/mcp".into(),
                        headers: BTreeMap::from([("Authorization".into(), "Bearer t".into())]),
                    },
                    prefix: "w".into(),
                    timeout: Duration::from_millis(5000),
                },
            ]
        );
    }

    #[test]
    fn bad_configurations_say_what_and_where() {
        let cases = [
            (
                r#"{"mcpServers": {"a": {}}}"#,
                "mcpServers.a: give a command (stdio) or a url",
            ),
            (
                r#"{"mcpServers": {"a": {"command": "x", "url": "http://h"}}}"#,
                "not both",
            ),
            (
                r#"{"mcpServers": {"a": {"type": "sse", "url": "http://h"}}}"#,
                "type \"sse\" is not supported",
            ),
            (
                r#"{"mcpServers": {"a": {"url": "ftp://h"}}}"#,
                "is not an http:// or https:// URL",
            ),
            (
                r#"{"mcpServers": {"a.b": {"command": "x"}}}"#,
                "prefix \"a.b\" must be letters",
            ),
            (
                r#"{"mcpServers": {"a": {"command": "x", "timeout_ms": 0}}}"#,
                "timeout_ms must be at least 1",
            ),
            (
                r#"{"mcpServers": {"a": {"command": "x", "bogus": 1}}}"#,
                "unknown field `bogus`",
            ),
            (
                r#"{"mcpServers": {"a": {"url": "http://h", "headers": {"bad header": "v"}}}}"#,
                "header name \"bad header\"",
            ),
            (r#"{"servers": {}}"#, "unknown field `servers`"),
            ("not json", "expected ident"),
        ];
        for (text, expected) in cases {
            let error = parse(text).unwrap_err();
            let message = error.to_string();
            assert!(
                message.starts_with("the MCP configuration mcp.json is invalid"),
                "{message}"
            );
            assert!(message.contains(expected), "{text}: {message}");
        }
    }

    #[test]
    fn exposed_names_are_provider_valid_and_bounded() {
        assert_eq!(exposed_name("fs", "read").as_deref(), Some("fs__read"));
        assert_eq!(
            exposed_name("fs", "files.read/all").as_deref(),
            Some("fs__files_read_all")
        );
        assert_eq!(exposed_name("fs", &"x".repeat(61)), None);
        assert_eq!(exposed_name("fs", ""), None);
        let longest = exposed_name("p", &"x".repeat(MAX_TOOL_NAME - 3)).unwrap();
        assert_eq!(longest.len(), MAX_TOOL_NAME);
    }
}
