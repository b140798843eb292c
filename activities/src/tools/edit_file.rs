//! The `edit_file` tool: replaces an exact string in a file inside a working directory
//! (confined like `read_file`), refusing when the file changed since the session last read
//! or wrote it.

use crate::context::ActivityContext;
use crate::error::Result;
use crate::tool::{PolicySubject, SubjectKind, Tool, ToolCall, ToolOutput};
use crate::tools::confine::{check_unchanged_since_seen, io_message, WorkDir};
use crate::tools::file_io::{read_limited, write_atomically, Limited};
use async_trait::async_trait;
use cairn_ledger::file_versions::{sha256_hex, EDIT_FILE};
use cairn_ledger::{JsonText, ToolSpec};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Replaces an exact string in a file confined to a working directory.
///
/// Input `{"path", "old_string", "new_string", "replace_all"}` (`replace_all` optional, false
/// by default). Refused as `is_error` results: `old_string` empty, equal to `new_string`,
/// absent, or (without `replace_all`) found more than once; a file this session has not read,
/// or that changed since it last read or wrote it — "last read" comes from the session's
/// recorded history ([`ActivityContext::file_versions`]), so it holds across crashes and
/// worker processes. A retry of an edit that was applied before its result was recorded is
/// recognised (undoing it gives the version last seen) and answered as done. The result is
/// JSON `{"path", "replacements", "sha256"}`. Sessions offering it ask before each call unless
/// their policy says otherwise.
#[derive(Debug, Clone)]
pub struct EditFile {
    working_dir: WorkDir,
}

impl EditFile {
    /// The largest file this tool edits, in bytes (1 MiB, as `read_file` reads).
    pub const MAX_BYTES: usize = 1024 * 1024;

    /// An editor confined to `working_dir`.
    pub fn new(working_dir: impl Into<PathBuf>) -> Self {
        EditFile {
            working_dir: WorkDir::new(working_dir.into(), EDIT_FILE, "edits"),
        }
    }

    /// The directory this editor is confined to, as given.
    pub fn working_dir(&self) -> &Path {
        self.working_dir.path()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Input {
    path: String,
    old_string: String,
    new_string: String,
    #[serde(default)]
    replace_all: bool,
}

#[async_trait]
impl Tool for EditFile {
    fn spec(&self) -> ToolSpec {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "Path of the file, relative to the working directory."
                },
                "old_string": {
                    "type": "string",
                    "description": "The exact text to replace; it must occur once unless replace_all is true."
                },
                "new_string": {
                    "type": "string",
                    "description": "The text to put in its place."
                },
                "replace_all": {
                    "type": "boolean",
                    "description": "Replace every occurrence of old_string (default false)."
                }
            },
            "required": ["path", "old_string", "new_string"],
            "additionalProperties": false
        });
        ToolSpec {
            name: EDIT_FILE.to_owned(),
            description: "Replaces an exact string in a file inside the working directory. Read \
                          the file first; the edit is refused if it changed since."
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
        if input.old_string.is_empty() {
            return Ok(ToolOutput::error(
                "old_string is empty; to create a file use write_file",
            ));
        }
        if input.old_string == input.new_string {
            return Ok(ToolOutput::error(
                "old_string and new_string are the same; there is nothing to change",
            ));
        }
        let path = match working_dir.existing(requested).await? {
            Ok(path) => path,
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        let current = match read_limited(&path, requested, Self::MAX_BYTES as u64).await {
            Ok(Limited::Whole(current)) => current,
            Ok(Limited::TooLarge(at_least)) => {
                return Ok(ToolOutput::error(format!(
                    "{requested:?} is too large to edit: at least {at_least} bytes, and \
                     edit_file edits at most {} bytes (1 MiB)",
                    Self::MAX_BYTES
                )))
            }
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        let Ok(text) = String::from_utf8(current) else {
            return Ok(ToolOutput::error(format!(
                "{requested:?} is not UTF-8 text; edit_file edits text files only"
            )));
        };
        let versions = context.file_versions();
        if let Err(refusal) = check_unchanged_since_seen(
            &working_dir,
            versions,
            &path,
            requested,
            &sha256_hex(text.as_bytes()),
        )
        .await?
        {
            if let Some(done) =
                Self::already_applied(&working_dir, &input, &text, &path, versions).await?
            {
                return Ok(done);
            }
            return Ok(ToolOutput::error(refusal));
        }
        let found = text.matches(input.old_string.as_str()).count();
        if found == 0 {
            return Ok(ToolOutput::error(format!(
                "old_string was not found in {requested:?}; it must match the file exactly, \
                 whitespace included"
            )));
        }
        if found > 1 && !input.replace_all {
            return Ok(ToolOutput::error(format!(
                "old_string occurs {found} times in {requested:?}; give more surrounding text \
                 to make it unique, or set replace_all to replace every occurrence"
            )));
        }
        let edited = if input.replace_all {
            text.replace(&input.old_string, &input.new_string)
        } else {
            text.replacen(&input.old_string, &input.new_string, 1)
        };
        if let Err(e) = write_atomically(&path, edited.as_bytes()).await {
            return Ok(ToolOutput::error(io_message(requested, &e)));
        }
        tracing::debug!(path = %path.display(), replacements = found, "edit_file");
        Ok(done(requested, found, &edited))
    }
}

impl EditFile {
    /// The result of this very edit when it was already applied (an attempt that wrote the
    /// file and crashed before its result was recorded): undoing it gives the version the
    /// session last saw. Only an exact hash match counts, so this never hides a real change.
    async fn already_applied(
        working_dir: &WorkDir,
        input: &Input,
        text: &str,
        path: &Path,
        versions: &[cairn_ledger::file_versions::FileVersion],
    ) -> Result<Option<ToolOutput>> {
        if input.new_string.is_empty() {
            return Ok(None);
        }
        let applied = text.matches(input.new_string.as_str()).count();
        if applied == 0 || (applied > 1 && !input.replace_all) {
            return Ok(None);
        }
        let Some(seen) = working_dir.last_seen(versions, path).await? else {
            return Ok(None);
        };
        let undone = text.replace(&input.new_string, &input.old_string);
        Ok(
            (seen.sha256 == sha256_hex(undone.as_bytes()))
                .then(|| done(&input.path, applied, text)),
        )
    }
}

/// The result of an applied edit.
fn done(requested: &str, replacements: usize, edited: &str) -> ToolOutput {
    let result = serde_json::json!({
        "path": requested,
        "replacements": replacements,
        "sha256": sha256_hex(edited.as_bytes()),
    });
    ToolOutput::json(JsonText::from_value(&result))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ReadFile;
    use cairn_ledger::file_versions::{file_versions, FileVersion, READ_FILE};
    use cairn_ledger::{Message, Part, Role, ToolResult, ToolResultContent, ToolUse, Transcript};

    fn edit(path: &str, old: &str, new: &str, replace_all: Option<bool>) -> ToolCall {
        let mut arguments =
            serde_json::json!({ "path": path, "old_string": old, "new_string": new });
        if let Some(all) = replace_all {
            arguments["replace_all"] = all.into();
        }
        ToolCall {
            tool_use_id: "toolu_e".into(),
            name: EDIT_FILE.into(),
            arguments: arguments.to_string(),
            idempotency_key: "s/toolu_e".into(),
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

    fn setup(content: &str) -> (tempfile::TempDir, EditFile) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.rs"), content).unwrap();
        let tool = EditFile::new(dir.path());
        (dir, tool)
    }

    #[tokio::test]
    async fn replaces_a_unique_string_and_reports_the_new_hash() {
        let (dir, tool) = setup("fn a() {}\nfn b() {}\n");
        let out = tool
            .call(
                &edit("a.rs", "fn b", "fn c", None),
                &seen("a.rs", "fn a() {}\nfn b() {}\n"),
            )
            .await
            .unwrap();
        let expected = format!(
            r#"{{"path":"a.rs","replacements":1,"sha256":"{}"}}"#,
            sha256_hex(b"fn a() {}\nfn c() {}\n")
        );
        assert_eq!(out, ToolOutput::json(JsonText::parse(expected).unwrap()));
        assert_eq!(
            std::fs::read_to_string(dir.path().join("a.rs")).unwrap(),
            "fn a() {}\nfn c() {}\n"
        );
    }

    #[tokio::test]
    async fn refuses_absent_ambiguous_empty_and_identical_strings() {
        let content = "x = 1\nx = 1\n";
        let (dir, tool) = setup(content);
        for (call, expected) in [
            (
                edit("a.rs", "y = 2", "z", None),
                "old_string was not found in \"a.rs\"",
            ),
            (
                edit("a.rs", "x = 1", "x = 2", None),
                "old_string occurs 2 times in \"a.rs\"",
            ),
            (
                edit("a.rs", "x = 1", "x = 2", Some(false)),
                "occurs 2 times",
            ),
            (edit("a.rs", "", "x", None), "old_string is empty"),
            (edit("a.rs", "x", "x", None), "are the same"),
        ] {
            let out = tool.call(&call, &seen("a.rs", content)).await.unwrap();
            assert!(error_text(&out).contains(expected), "{out:?}");
        }
        assert_eq!(
            std::fs::read_to_string(dir.path().join("a.rs")).unwrap(),
            content
        );
        let out = tool
            .call(
                &edit("a.rs", "x = 1", "x = 2", Some(true)),
                &seen("a.rs", content),
            )
            .await
            .unwrap();
        assert!(!out.is_error, "{out:?}");
        assert!(out.content.canonical_json().contains(r#""replacements":2"#));
        assert_eq!(
            std::fs::read_to_string(dir.path().join("a.rs")).unwrap(),
            "x = 2\nx = 2\n"
        );
    }

    #[tokio::test]
    async fn refuses_files_not_read_or_changed_since() {
        let (dir, tool) = setup("one\n");
        let out = tool
            .call(
                &edit("a.rs", "one", "two", None),
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        assert!(error_text(&out).contains("\"a.rs\" has not been read in this session"));
        // Read as "one", then someone else changed it.
        std::fs::write(dir.path().join("a.rs"), "one!\n").unwrap();
        let out = tool
            .call(&edit("a.rs", "one", "two", None), &seen("a.rs", "one\n"))
            .await
            .unwrap();
        assert!(error_text(&out).contains("changed since this session last read or wrote it"));
        assert_eq!(
            std::fs::read_to_string(dir.path().join("a.rs")).unwrap(),
            "one!\n"
        );
        // The latest version of the file counts, under any spelling of its path.
        let versions = vec![
            FileVersion {
                path: "a.rs".into(),
                sha256: sha256_hex(b"one\n"),
            },
            FileVersion {
                path: format!("{}/a.rs", dir.path().display()),
                sha256: sha256_hex(b"one!\n"),
            },
        ];
        let context = ActivityContext::detached().with_file_versions(versions);
        let out = tool
            .call(&edit("./a.rs", "one", "two", None), &context)
            .await
            .unwrap();
        assert!(!out.is_error, "{out:?}");
    }

    #[tokio::test]
    async fn refuses_escapes_directories_and_binary_files() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir_all(work.join("sub")).unwrap();
        std::fs::write(dir.path().join("secret.txt"), "secret").unwrap();
        std::fs::write(work.join("blob"), [0xff, 0xfe]).unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret.txt"), work.join("link")).unwrap();
        let tool = EditFile::new(&work);
        for (path, expected) in [
            (
                "../secret.txt",
                "escapes the working directory; edit_file only edits files inside it",
            ),
            ("link", "escapes the working directory"),
            ("sub", "is a directory"),
            ("blob", "is not UTF-8 text"),
            ("nope", "no such file"),
        ] {
            let out = tool
                .call(&edit(path, "secret", "x", None), &seen(path, "secret"))
                .await
                .unwrap();
            assert!(error_text(&out).contains(expected), "{path}: {out:?}");
        }
        assert_eq!(
            std::fs::read_to_string(dir.path().join("secret.txt")).unwrap(),
            "secret"
        );
    }

    /// The transcript of a session that read `path` with read_file, as recorded.
    fn transcript_after_read(path: &str, arguments: &str, result: ToolOutput) -> Transcript {
        let mut transcript = Transcript::new();
        transcript.messages.push(Message {
            role: Role::Assistant,
            parts: vec![Part::ToolUse(ToolUse {
                id: "toolu_r".into(),
                name: READ_FILE.into(),
                arguments: arguments.into(),
                signature: None,
            })],
            provenance: None,
        });
        transcript.push_tool_results([ToolResult {
            tool_use_id: "toolu_r".into(),
            content: result.content,
            is_error: result.is_error,
        }]);
        let _ = path;
        transcript
    }

    #[tokio::test]
    async fn last_read_comes_from_the_recorded_transcript_across_a_restart() {
        // A read (whole, then ranged) is recorded; a new process (new tools, nothing in
        // memory) derives the versions from the transcript alone and edits.
        for arguments in [
            r#"{"path":"a.rs"}"#,
            r#"{"path":"a.rs","offset":2,"limit":1}"#,
        ] {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("a.rs"), "one\ntwo\nthree\n").unwrap();
            let read = ReadFile::new(dir.path())
                .call(
                    &ToolCall {
                        tool_use_id: "toolu_r".into(),
                        name: READ_FILE.into(),
                        arguments: arguments.into(),
                        idempotency_key: "s/toolu_r".into(),
                    },
                    &ActivityContext::detached(),
                )
                .await
                .unwrap();
            let transcript = transcript_after_read("a.rs", arguments, read);
            let recorded = serde_json::to_vec(&transcript).unwrap();
            // The restart: only the recorded bytes survive.
            let restored: Transcript = serde_json::from_slice(&recorded).unwrap();
            let context = ActivityContext::detached().with_file_versions(file_versions(&restored));
            let tool = EditFile::new(dir.path());
            let out = tool
                .call(&edit("a.rs", "two", "2", None), &context)
                .await
                .unwrap();
            assert!(!out.is_error, "{arguments}: {out:?}");
            assert_eq!(
                std::fs::read_to_string(dir.path().join("a.rs")).unwrap(),
                "one\n2\nthree\n"
            );
            // The same call again (its first attempt's result was lost): answered as done,
            // the file unchanged.
            let again = tool
                .call(&edit("a.rs", "two", "2", None), &context)
                .await
                .unwrap();
            assert_eq!(again, out, "{arguments}");
            assert_eq!(
                std::fs::read_to_string(dir.path().join("a.rs")).unwrap(),
                "one\n2\nthree\n"
            );
            // Another edit on the same stale version is refused: the file changed.
            let other = tool
                .call(&edit("a.rs", "one", "1", None), &context)
                .await
                .unwrap();
            assert!(error_text(&other).contains("changed since"), "{arguments}");
        }
    }
}
