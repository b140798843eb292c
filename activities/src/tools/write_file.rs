//! The `write_file` tool: writes a whole file inside a working directory (confined like
//! `read_file`), creating its parent directories; an existing file is overwritten only when
//! the session has seen its current content.

use crate::context::ActivityContext;
use crate::error::Result;
use crate::tool::{PolicySubject, SubjectKind, Tool, ToolCall, ToolOutput};
use crate::tools::confine::{check_unchanged_since_seen, io_message, WorkDir};
use crate::tools::file_io::{compare_with, write_atomically};
use async_trait::async_trait;
use cairn_ledger::file_versions::{sha256_hex, WRITE_FILE};
use cairn_ledger::{JsonText, ToolSpec};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Writes a file confined to a working directory.
///
/// Input `{"path": "...", "content": "..."}`. A new file is created, with the directories it
/// needs inside the working directory. An existing file is overwritten only when this session
/// read (or wrote) it and it has not changed since, as Claude Code's Write does: an agent
/// cannot clobber a file it never looked at, or changes a person made meanwhile. Writing the
/// content a file already has always succeeds, so a retried call is harmless. The result is
/// JSON `{"path", "bytes", "sha256", "created"}`. Sessions offering it ask before each call
/// unless their policy says otherwise.
#[derive(Debug, Clone)]
pub struct WriteFile {
    working_dir: WorkDir,
}

impl WriteFile {
    /// A writer confined to `working_dir`.
    pub fn new(working_dir: impl Into<PathBuf>) -> Self {
        WriteFile {
            working_dir: WorkDir::new(working_dir.into(), WRITE_FILE, "writes"),
        }
    }

    /// The directory this writer is confined to, as given.
    pub fn working_dir(&self) -> &Path {
        self.working_dir.path()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Input {
    path: String,
    content: String,
}

#[async_trait]
impl Tool for WriteFile {
    fn spec(&self) -> ToolSpec {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "Path of the file, relative to the working directory."
                },
                "content": {
                    "type": "string",
                    "description": "The whole new content of the file."
                }
            },
            "required": ["path", "content"],
            "additionalProperties": false
        });
        ToolSpec {
            name: WRITE_FILE.to_owned(),
            description: "Writes a whole file inside the working directory, creating it and its \
                          directories if needed. An existing file must have been read first."
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

    fn asks_by_default(&self) -> bool {
        true
    }

    async fn call(&self, call: &ToolCall, context: &ActivityContext) -> Result<ToolOutput> {
        let working_dir = self.working_dir.for_session(context);
        let input: Input = call.parse_arguments()?;
        let requested = input.path.as_str();
        let (path, exists) = match working_dir.for_write(requested).await? {
            Ok(found) => found,
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        if exists {
            // Read in pieces: the file may be far larger than anything the session read.
            let current = match compare_with(&path, requested, input.content.as_bytes()).await {
                Ok(current) => current,
                Err(message) => return Ok(ToolOutput::error(message)),
            };
            if !current.same {
                if let Err(message) = check_unchanged_since_seen(
                    &working_dir,
                    context.file_versions(),
                    &path,
                    requested,
                    &current.sha256,
                )
                .await?
                {
                    return Ok(ToolOutput::error(message));
                }
            }
        } else if let Some(parent) = path.parent() {
            if let Err(e) = tokio::fs::create_dir_all(parent).await {
                return Ok(ToolOutput::error(io_message(requested, &e)));
            }
        }
        if let Err(e) = write_atomically(&path, input.content.as_bytes()).await {
            return Ok(ToolOutput::error(io_message(requested, &e)));
        }
        tracing::debug!(path = %path.display(), bytes = input.content.len(), "write_file");
        let result = serde_json::json!({
            "path": requested,
            "bytes": input.content.len(),
            "sha256": sha256_hex(input.content.as_bytes()),
            "created": !exists,
        });
        Ok(ToolOutput::json(JsonText::from_value(&result)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::file_versions::FileVersion;
    use cairn_ledger::ToolResultContent;

    fn call(path: &str, content: &str) -> ToolCall {
        ToolCall {
            tool_use_id: "toolu_1".into(),
            name: WRITE_FILE.into(),
            arguments: serde_json::json!({ "path": path, "content": content }).to_string(),
            idempotency_key: "k".into(),
        }
    }

    fn seen(path: &str, content: &str) -> ActivityContext {
        ActivityContext::detached().with_file_versions(vec![FileVersion {
            path: path.into(),
            sha256: sha256_hex(content.as_bytes()),
        }])
    }

    fn error_text(out: &ToolOutput) -> &str {
        assert!(out.is_error, "expected an error, got {out:?}");
        let ToolResultContent::Text(text) = &out.content else {
            panic!("expected text, got {out:?}")
        };
        text
    }

    #[tokio::test]
    async fn creates_files_and_their_directories_inside() {
        let dir = tempfile::tempdir().unwrap();
        let tool = WriteFile::new(dir.path());
        let out = tool
            .call(
                &call("src/new/mod.rs", "fn main() {}\n"),
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        let expected = format!(
            r#"{{"path":"src/new/mod.rs","bytes":13,"sha256":"{}","created":true}}"#,
            sha256_hex(b"fn main() {}\n")
        );
        assert_eq!(out, ToolOutput::json(JsonText::parse(expected).unwrap()));
        assert_eq!(
            std::fs::read(dir.path().join("src/new/mod.rs")).unwrap(),
            b"fn main() {}\n"
        );
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path().join("src/new"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["mod.rs"]);
    }

    #[tokio::test]
    async fn overwrites_only_what_the_session_saw_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "old\n").unwrap();
        let tool = WriteFile::new(dir.path());
        // Never read: refused, the file untouched.
        let out = tool
            .call(&call("a.txt", "new\n"), &ActivityContext::detached())
            .await
            .unwrap();
        assert!(error_text(&out).contains("has not been read in this session"));
        // Read, then changed by someone else: refused.
        let out = tool
            .call(&call("a.txt", "new\n"), &seen("a.txt", "older\n"))
            .await
            .unwrap();
        assert!(error_text(&out).contains("changed since this session last read or wrote it"));
        assert_eq!(std::fs::read(dir.path().join("a.txt")).unwrap(), b"old\n");
        // Read as it is (under another spelling of its path): written.
        let out = tool
            .call(&call("a.txt", "new\n"), &seen("./a.txt", "old\n"))
            .await
            .unwrap();
        assert!(!out.is_error, "{out:?}");
        assert_eq!(std::fs::read(dir.path().join("a.txt")).unwrap(), b"new\n");
        // A retry of the same write, the version now stale: harmless.
        let out = tool
            .call(&call("a.txt", "new\n"), &seen("a.txt", "old\n"))
            .await
            .unwrap();
        assert!(!out.is_error, "{out:?}");
    }

    #[tokio::test]
    async fn refuses_escapes_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir_all(work.join("sub")).unwrap();
        std::os::unix::fs::symlink(dir.path(), work.join("out")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("x.txt"), work.join("dangling")).unwrap();
        let tool = WriteFile::new(&work);
        for (path, expected) in [
            (
                "../x.txt",
                "escapes the working directory; write_file only writes files inside it",
            ),
            ("/tmp/x.txt", "escapes the working directory"),
            ("out/x.txt", "escapes the working directory"),
            ("out/new/x.txt", "escapes the working directory"),
            ("dangling", "escapes the working directory"),
            ("sub", "is a directory"),
            (".", "is the working directory"),
            ("", "the path is empty"),
        ] {
            let out = tool
                .call(&call(path, "x"), &ActivityContext::detached())
                .await
                .unwrap();
            assert!(error_text(&out).contains(expected), "{path}: {out:?}");
        }
        assert!(!dir.path().join("x.txt").exists());
        assert!(!dir.path().join("new").exists());
    }
}
