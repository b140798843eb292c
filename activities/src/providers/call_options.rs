//! Checks of a call's options shared by every provider, made before anything is sent: a server
//! tool the provider does not offer, a tool choice naming an undefined tool, or forcing a call
//! when no tool is defined, are typed `InvalidRequest` errors naming the provider and the option.

use crate::error::{Error, ErrorKind, Result};
use cairn_ledger::{CallOptions, ServerToolKind, ToolChoice, ToolSpec};

fn invalid(message: String) -> Error {
    Error::Provider {
        kind: ErrorKind::InvalidRequest,
        message,
    }
}

/// Every server tool in `options` must be one `provider` offers (`offered`).
pub fn check_server_tools(
    provider: &str,
    offered: &[ServerToolKind],
    options: &CallOptions,
) -> Result<()> {
    for tool in &options.server_tools {
        if !offered.contains(&tool.kind) {
            let list = if offered.is_empty() {
                "none".to_owned()
            } else {
                offered
                    .iter()
                    .map(|k| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(invalid(format!(
                "{provider}: the session turns on the server tool {}, which {provider} does not offer (its server tools: {list})",
                tool.kind.as_str()
            )));
        }
    }
    Ok(())
}

/// A named tool choice must name a defined tool, and a choice that forces a call needs at least
/// one tool (function tools or server tools).
pub fn check_tool_choice(provider: &str, options: &CallOptions, tools: &[ToolSpec]) -> Result<()> {
    match &options.tool_choice {
        Some(ToolChoice::Tool(name)) => {
            let server = options.server_tools.iter().any(|t| t.kind.as_str() == name);
            if !server && !tools.iter().any(|t| &t.name == name) {
                return Err(invalid(format!(
                    "{provider}: tool_choice names the tool {name:?}, which the session does not define"
                )));
            }
        }
        Some(ToolChoice::Any) if tools.is_empty() && options.server_tools.is_empty() => {
            return Err(invalid(format!(
                "{provider}: tool_choice any forces a tool call, but the session defines no tools"
            )));
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::ServerTool;

    #[test]
    fn unsupported_server_tools_and_unknown_choices_are_named() {
        let options = CallOptions {
            server_tools: vec![ServerTool {
                kind: ServerToolKind::WebFetch,
                max_uses: None,
            }],
            ..CallOptions::default()
        };
        let err = check_server_tools("openai-responses", &[ServerToolKind::WebSearch], &options)
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest);
        assert!(
            err.to_string().contains(
                "the server tool web_fetch, which openai-responses does not offer (its server tools: web_search)"
            ),
            "{err}"
        );
        let err = check_server_tools("bedrock", &[], &options).unwrap_err();
        assert!(
            err.to_string().contains("(its server tools: none)"),
            "{err}"
        );
        check_server_tools(
            "anthropic",
            &[ServerToolKind::WebSearch, ServerToolKind::WebFetch],
            &options,
        )
        .unwrap();

        let named = CallOptions {
            tool_choice: Some(ToolChoice::Tool("missing".into())),
            ..CallOptions::default()
        };
        let err = check_tool_choice("anthropic", &named, &[]).unwrap_err();
        assert!(err.to_string().contains("\"missing\""), "{err}");
        let any = CallOptions {
            tool_choice: Some(ToolChoice::Any),
            ..CallOptions::default()
        };
        assert!(check_tool_choice("anthropic", &any, &[])
            .unwrap_err()
            .to_string()
            .contains("defines no tools"));
        // A server tool may be the named one.
        let web = CallOptions {
            tool_choice: Some(ToolChoice::Tool("web_fetch".into())),
            ..options
        };
        check_tool_choice("anthropic", &web, &[]).unwrap();
    }
}
