//! The tool boundary: one call as the runtime hands it over, what a tool returns, the `Tool`
//! trait, and the registry that finds tools by name.

use crate::context::ActivityContext;
use crate::error::{Error, Result};
use crate::tools::{Calculator, EditFile, ListDir, ReadFile, Shell, WriteFile};
use async_trait::async_trait;
use cairn_ledger::{JsonText, ToolResultBlock, ToolResultContent, ToolSpec};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

/// One tool call, as the model made it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ToolCall {
    /// The tool_use id the result must answer.
    pub tool_use_id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments as the exact JSON text the model produced; it may be invalid.
    pub arguments: String,
    /// Stable across retries and replays of this call, so tools with side effects can
    /// deduplicate them.
    pub idempotency_key: String,
}

impl ToolCall {
    /// Parses the arguments into a tool's input type.
    ///
    /// Text that is not JSON, a missing field, an unknown field or a wrong type becomes
    /// [`Error::InvalidArguments`] naming the tool, what is wrong and where.
    pub fn parse_arguments<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_str(&self.arguments).map_err(|e| {
            let what = match e.classify() {
                serde_json::error::Category::Data => "arguments do not match the input schema",
                serde_json::error::Category::Eof => "arguments are incomplete JSON",
                _ => "arguments are not valid JSON",
            };
            Error::InvalidArguments {
                tool: self.name.clone(),
                reason: format!("{what}: {e}"),
            }
        })
    }
}

/// What a tool returns. A failure the model should see and recover from (a division by zero, a
/// missing file) is an output with `is_error`, not an `Err`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ToolOutput {
    /// The result content.
    pub content: ToolResultContent,
    /// Whether the content describes a failure.
    pub is_error: bool,
}

impl ToolOutput {
    /// A successful plain-text result.
    pub fn text(text: impl Into<String>) -> Self {
        ToolOutput {
            content: ToolResultContent::Text(text.into()),
            is_error: false,
        }
    }

    /// A successful JSON result.
    pub fn json(json: JsonText) -> Self {
        ToolOutput {
            content: ToolResultContent::Json(json),
            is_error: false,
        }
    }

    /// A successful result of text and media blocks, in order (e.g. a caption and a
    /// screenshot). Media a provider cannot take are repaired into text notes in the
    /// transcript ([`cairn_ledger::project_tool_result`]); the history keeps them as given.
    pub fn blocks(blocks: Vec<ToolResultBlock>) -> Self {
        ToolOutput {
            content: ToolResultContent::Blocks(blocks),
            is_error: false,
        }
    }

    /// A failure the model sees as text.
    pub fn error(message: impl Into<String>) -> Self {
        ToolOutput {
            content: ToolResultContent::Text(message.into()),
            is_error: true,
        }
    }
}

/// A tool the model can call.
#[async_trait]
pub trait Tool: Send + Sync {
    /// The tool as the model sees it; `spec().name` is its registry key.
    fn spec(&self) -> ToolSpec;

    /// Runs one call. Bad arguments are [`Error::InvalidArguments`]; failures the model should
    /// see are `Ok` outputs with `is_error`; `Err` otherwise means the tool itself broke.
    async fn call(&self, call: &ToolCall, context: &ActivityContext) -> Result<ToolOutput>;

    /// The argument a tool policy's prefix rule compares for this tool, and how (a path for
    /// file tools, a command for a shell); `None`: rules match this tool by name only.
    fn policy_subject(&self) -> Option<PolicySubject> {
        None
    }

    /// Whether a session that offers this tool asks a person before each call unless its
    /// policy says otherwise (the default policy records an `ask` rule for it).
    fn asks_by_default(&self) -> bool {
        false
    }
}

/// What a tool policy's prefix rule compares (see [`Tool::policy_subject`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicySubject {
    /// The argument's name in the call's JSON object.
    pub argument: &'static str,
    /// How a prefix is compared with it.
    pub kind: SubjectKind,
}

/// How a tool policy compares a prefix with an argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubjectKind {
    /// A file path, by components.
    Path,
    /// A shell command, at a word boundary.
    Command,
}

/// The tools of a session, by name.
#[derive(Clone, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

impl ToolRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The built-in tools: `calculator`, and `read_file` and `list_dir` confined to
    /// `working_dir`.
    pub fn builtin(working_dir: impl Into<PathBuf>) -> Self {
        let working_dir = working_dir.into();
        Self::new()
            .with(Calculator::new())
            .with(ReadFile::new(working_dir.clone()))
            .with(ListDir::new(working_dir))
    }

    /// The tools that change the working directory: `write_file` and `edit_file`.
    pub fn editing(working_dir: impl Into<PathBuf>) -> Self {
        let working_dir = working_dir.into();
        Self::new()
            .with(WriteFile::new(working_dir.clone()))
            .with(EditFile::new(working_dir))
    }

    /// What a process hosts for its workers: the built-in tools, `shell`, `write_file` and
    /// `edit_file`, all working in `working_dir`. Sessions offer `shell` and the editing
    /// tools only when asked to (see [`Shell`], [`ToolRegistry::editing`]).
    pub fn hosted(working_dir: impl Into<PathBuf>) -> Self {
        let working_dir = working_dir.into();
        let mut hosted = Self::builtin(working_dir.clone()).with(Shell::new(working_dir.clone()));
        hosted.extend(Self::editing(working_dir));
        hosted
    }

    /// Adds every tool of `other`; tools of the same name are replaced.
    pub fn extend(&mut self, other: ToolRegistry) {
        self.tools.extend(other.tools);
    }

    /// Adds a tool, builder style; a tool of the same name is replaced.
    pub fn with(mut self, tool: impl Tool + 'static) -> Self {
        self.register(Arc::new(tool));
        self
    }

    /// Adds a tool; a tool of the same name is replaced.
    pub fn register(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.spec().name, tool);
    }

    /// The tool of this name.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.tools.get(name).cloned()
    }

    /// The tool specs, sorted by name.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.tools.values().map(|t| t.spec()).collect()
    }

    /// The tool names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.tools.keys().map(String::as_str).collect()
    }

    /// How many tools are registered.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether no tool is registered.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// Runs a call on the tool it names; [`Error::UnknownTool`] when there is none.
    pub async fn call(&self, call: &ToolCall, context: &ActivityContext) -> Result<ToolOutput> {
        let tool = self.get(&call.name).ok_or_else(|| Error::UnknownTool {
            name: call.name.clone(),
        })?;
        tool.call(call, context).await
    }
}

impl fmt::Debug for ToolRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolRegistry")
            .field("tools", &self.names())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(&'static str);

    #[async_trait]
    impl Tool for Echo {
        fn spec(&self) -> ToolSpec {
            ToolSpec {
                name: self.0.to_owned(),
                description: "echoes".into(),
                input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
            }
        }
        async fn call(&self, call: &ToolCall, _context: &ActivityContext) -> Result<ToolOutput> {
            Ok(ToolOutput::text(call.arguments.clone()))
        }
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            tool_use_id: "toolu_1".into(),
            name: name.into(),
            arguments: arguments.into(),
            idempotency_key: "s/1/1/toolu_1".into(),
        }
    }

    #[tokio::test]
    async fn registry_finds_tools_and_sorts_specs() {
        let registry = ToolRegistry::new().with(Echo("zeta")).with(Echo("alpha"));
        let names: Vec<String> = registry.specs().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["alpha", "zeta"]);
        assert!(registry.get("alpha").is_some() && registry.get("beta").is_none());
        let out = registry
            .call(&call("zeta", "{\"x\":1}"), &ActivityContext::detached())
            .await
            .unwrap();
        assert_eq!(out, ToolOutput::text("{\"x\":1}"));
        let err = registry
            .call(&call("beta", "{}"), &ActivityContext::detached())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::UnknownTool { ref name } if name == "beta"));
    }

    #[test]
    fn builtin_has_calculator_and_the_reading_file_tools() {
        let registry = ToolRegistry::builtin("/tmp");
        assert_eq!(registry.names(), ["calculator", "list_dir", "read_file"]);
        assert_eq!(
            format!("{registry:?}"),
            r#"ToolRegistry { tools: ["calculator", "list_dir", "read_file"] }"#
        );
        let hosted = ToolRegistry::hosted("/tmp");
        assert_eq!(
            hosted.names(),
            [
                "calculator",
                "edit_file",
                "list_dir",
                "read_file",
                "shell",
                "write_file"
            ]
        );
        // Changing files asks by default, as shell does; reading does not.
        let asking: Vec<&str> = hosted
            .names()
            .into_iter()
            .filter(|n| hosted.get(n).unwrap().asks_by_default())
            .collect();
        assert_eq!(asking, ["edit_file", "shell", "write_file"]);
        // Every name is provider-valid.
        for name in hosted.names() {
            assert!(name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'));
        }
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Input {
        path: String,
    }

    #[test]
    fn bad_arguments_say_what_is_wrong() {
        let cases = [
            ("not json", "not valid JSON"),
            ("{\"path\": ", "incomplete JSON"),
            ("{}", "missing field `path`"),
            (
                "{\"path\": 3}",
                "invalid type: integer `3`, expected a string",
            ),
            ("{\"path\": \"a\", \"mode\": 1}", "unknown field `mode`"),
        ];
        for (arguments, expected) in cases {
            let err = call("read_file", arguments)
                .parse_arguments::<Input>()
                .unwrap_err();
            let Error::InvalidArguments { tool, reason } = &err else {
                panic!("expected InvalidArguments for {arguments:?}, got {err:?}")
            };
            assert_eq!(tool, "read_file");
            assert!(reason.contains(expected), "{arguments:?}: {reason}");
            assert!(reason.contains("line 1 column"), "{arguments:?}: {reason}");
        }
    }
}
