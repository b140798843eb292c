//! The `list_dir` tool: lists one directory inside a working directory, confined like
//! `read_file`.

use crate::context::ActivityContext;
use crate::error::Result;
use crate::tool::{PolicySubject, SubjectKind, Tool, ToolCall, ToolOutput};
use crate::tools::confine::{io_message, WorkDir};
use async_trait::async_trait;
use cairn_ledger::{JsonText, ToolSpec};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The tool's name.
const NAME: &str = "list_dir";

/// Lists a directory confined to a working directory.
///
/// Input `{"path": "..."}` (optional; the working directory itself by default). The result is
/// text, one entry a line, sorted by name: directories end in `/`, symlinks in `@`. At most
/// [`ListDir::MAX_ENTRIES`] entries are listed; a last line says how many more there are.
/// Escapes, missing paths and files are `is_error` outputs.
#[derive(Debug, Clone)]
pub struct ListDir {
    working_dir: WorkDir,
}

impl ListDir {
    /// The most entries one call lists.
    pub const MAX_ENTRIES: usize = 1000;

    /// A lister confined to `working_dir`.
    pub fn new(working_dir: impl Into<PathBuf>) -> Self {
        ListDir {
            working_dir: WorkDir::new(working_dir.into(), NAME, "lists"),
        }
    }

    /// The directory this lister is confined to, as given.
    pub fn working_dir(&self) -> &Path {
        self.working_dir.path()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Input {
    #[serde(default)]
    path: Option<String>,
}

#[async_trait]
impl Tool for ListDir {
    fn spec(&self) -> ToolSpec {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "The directory, relative to the working directory (default: the working directory)."
                }
            },
            "additionalProperties": false
        });
        ToolSpec {
            name: NAME.to_owned(),
            description: "Lists a directory inside the working directory: one entry a line, \
                          directories ending in /, symlinks in @."
                .to_owned(),
            input_schema: JsonText::from_value(&schema),
        }
    }

    fn policy_subject(&self) -> Option<PolicySubject> {
        Some(PolicySubject {
            argument: "path",
            kind: SubjectKind::Path,
        })
    }

    async fn call(&self, call: &ToolCall, context: &ActivityContext) -> Result<ToolOutput> {
        let working_dir = self.working_dir.for_session(context);
        let input: Input = call.parse_arguments()?;
        let requested = input.path.as_deref().unwrap_or(".");
        let dir = match working_dir.existing(requested).await? {
            Ok(dir) => dir,
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        let mut entries = match tokio::fs::read_dir(&dir).await {
            Ok(entries) => entries,
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
                return Ok(ToolOutput::error(format!(
                    "{requested:?} is a file, not a directory"
                )))
            }
            Err(e) => return Ok(ToolOutput::error(io_message(requested, &e))),
        };
        let mut names = Vec::new();
        loop {
            match entries.next_entry().await {
                Ok(Some(entry)) => {
                    let mut name = entry.file_name().to_string_lossy().into_owned();
                    match entry.file_type().await {
                        Ok(kind) if kind.is_dir() => name.push('/'),
                        Ok(kind) if kind.is_symlink() => name.push('@'),
                        _ => {}
                    }
                    names.push(name);
                }
                Ok(None) => break,
                Err(e) => return Ok(ToolOutput::error(io_message(requested, &e))),
            }
        }
        names.sort();
        let more = names.len().saturating_sub(Self::MAX_ENTRIES);
        names.truncate(Self::MAX_ENTRIES);
        let mut out = names.join("\n");
        if more > 0 {
            out.push_str(&format!("\n({more} more entries not listed)"));
        }
        if out.is_empty() {
            out = format!("{requested:?} is empty");
        }
        Ok(ToolOutput::text(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::ToolResultContent;

    fn call(path: Option<&str>) -> ToolCall {
        ToolCall {
            tool_use_id: "toolu_1".into(),
            name: NAME.into(),
            arguments: match path {
                Some(path) => serde_json::json!({ "path": path }).to_string(),
                None => "{}".into(),
            },
            idempotency_key: "k".into(),
        }
    }

    fn text(out: &ToolOutput) -> &str {
        let ToolResultContent::Text(text) = &out.content else {
            panic!("expected text, got {out:?}")
        };
        text
    }

    #[tokio::test]
    async fn lists_sorted_entries_marking_directories_and_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir_all(work.join("src/deep")).unwrap();
        std::fs::write(work.join("b.txt"), "b").unwrap();
        std::fs::write(work.join("src/lib.rs"), "").unwrap();
        std::os::unix::fs::symlink(work.join("b.txt"), work.join("a-link")).unwrap();
        let tool = ListDir::new(&work);
        let out = tool
            .call(&call(None), &ActivityContext::detached())
            .await
            .unwrap();
        assert!(!out.is_error);
        assert_eq!(text(&out), "a-link@\nb.txt\nsrc/");
        let out = tool
            .call(&call(Some("src")), &ActivityContext::detached())
            .await
            .unwrap();
        assert_eq!(text(&out), "deep/\nlib.rs");
        let out = tool
            .call(&call(Some("src/deep")), &ActivityContext::detached())
            .await
            .unwrap();
        assert_eq!(text(&out), "\"src/deep\" is empty");
    }

    #[tokio::test]
    async fn refuses_escapes_files_and_missing_paths() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        std::fs::write(work.join("f.txt"), "f").unwrap();
        std::os::unix::fs::symlink(dir.path(), work.join("out")).unwrap();
        let tool = ListDir::new(&work);
        for (path, expected) in [
            (
                "..",
                "escapes the working directory; list_dir only lists files inside it",
            ),
            ("/", "escapes the working directory"),
            ("out", "escapes the working directory"),
            ("f.txt", "\"f.txt\" is a file, not a directory"),
            ("nope", "no such file: \"nope\""),
        ] {
            let out = tool
                .call(&call(Some(path)), &ActivityContext::detached())
                .await
                .unwrap();
            assert!(out.is_error, "{path}: {out:?}");
            assert!(text(&out).contains(expected), "{path}: {out:?}");
        }
    }

    #[tokio::test]
    async fn long_listings_are_cut_with_a_count() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..ListDir::MAX_ENTRIES + 3 {
            std::fs::write(dir.path().join(format!("f{i:05}")), "").unwrap();
        }
        let out = ListDir::new(dir.path())
            .call(&call(None), &ActivityContext::detached())
            .await
            .unwrap();
        let text = text(&out);
        assert_eq!(text.lines().count(), ListDir::MAX_ENTRIES + 1);
        assert!(text.ends_with("\n(3 more entries not listed)"), "{text}");
    }
}
