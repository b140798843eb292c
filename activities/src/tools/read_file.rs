//! The `read_file` tool: reads one file inside a working directory, refusing any path that
//! escapes it (by `..`, an absolute path or a symlink).

use crate::context::ActivityContext;
use crate::error::{Error, Result};
use crate::tool::{Tool, ToolCall, ToolOutput};
use async_trait::async_trait;
use base64::Engine;
use cairn_ledger::{JsonText, ToolSpec};
use serde::Deserialize;
use std::io::ErrorKind as IoKind;
use std::path::{Component, Path, PathBuf};
use tokio::io::AsyncReadExt;

/// The tool's name.
const NAME: &str = "read_file";

/// Files larger than this are refused, so one call cannot flood the transcript or memory.
const READ_LIMIT_BYTES: u64 = 1024 * 1024;

/// Reads a file confined to a working directory.
///
/// Input `{"path": "..."}`, relative to the working directory (an absolute path is accepted only
/// when it lies inside it). The path is resolved, canonicalized, and refused when it escapes the
/// directory, including through symlinks. UTF-8 content is returned as text; anything else as
/// JSON `{"path": ..., "bytes": n, "base64": "..."}`. Missing files, directories, escapes and
/// files over [`ReadFile::MAX_BYTES`] (1 MiB) are `is_error` outputs the model can recover from.
#[derive(Debug, Clone)]
pub struct ReadFile {
    working_dir: PathBuf,
}

impl ReadFile {
    /// The largest file this tool reads, in bytes (1 MiB).
    pub const MAX_BYTES: u64 = READ_LIMIT_BYTES;

    /// A reader confined to `working_dir`. The directory is resolved on each call, so it may be
    /// created after the tool.
    pub fn new(working_dir: impl Into<PathBuf>) -> Self {
        ReadFile {
            working_dir: working_dir.into(),
        }
    }

    /// The directory this reader is confined to, as given.
    pub fn working_dir(&self) -> &Path {
        &self.working_dir
    }

    /// Resolves `requested` to a canonical path inside `working_dir`, or says why not.
    async fn resolve(
        working_dir: &Path,
        requested: &str,
    ) -> Result<std::result::Result<PathBuf, String>> {
        let root = tokio::fs::canonicalize(working_dir)
            .await
            .map_err(|source| Error::Io {
                path: working_dir.display().to_string(),
                source,
            })?;
        if requested.is_empty() {
            return Ok(Err("the path is empty".to_owned()));
        }
        let escapes = || {
            format!(
                "{requested:?} escapes the working directory; read_file only reads files inside it"
            )
        };
        // Checked before touching the filesystem, so paths outside never reveal whether they
        // exist. The working directory as given counts too: an absolute path the model built from
        // it need not be canonical.
        let joined = root.join(requested);
        let lexical = normalize(&joined);
        let given_root = std::path::absolute(working_dir)
            .map(|given| normalize(&given))
            .unwrap_or_else(|_| root.clone());
        let lexical_alt = normalize(&given_root.join(requested));
        if !lexical.starts_with(&root) && !lexical_alt.starts_with(&given_root) {
            return Ok(Err(escapes()));
        }
        let candidate = if lexical.starts_with(&root) {
            lexical
        } else {
            lexical_alt
        };
        // Symlinks are only visible after canonicalizing; this check is the one that decides.
        match tokio::fs::canonicalize(&candidate).await {
            Ok(resolved) if resolved.starts_with(&root) => Ok(Ok(resolved)),
            Ok(_) => Ok(Err(escapes())),
            Err(e) => Ok(Err(io_message(requested, &e))),
        }
    }
}

/// Removes `.` and resolves `..` without touching the filesystem.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// A filesystem failure as the model should read it.
fn io_message(requested: &str, error: &std::io::Error) -> String {
    match error.kind() {
        IoKind::NotFound => format!("no such file: {requested:?}"),
        IoKind::PermissionDenied => format!("permission denied: {requested:?}"),
        _ => format!("cannot read {requested:?}: {error}"),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadFileInput {
    path: String,
}

#[async_trait]
impl Tool for ReadFile {
    fn policy_subject(&self) -> Option<crate::tool::PolicySubject> {
        Some(crate::tool::PolicySubject {
            argument: "path",
            kind: crate::tool::SubjectKind::Path,
        })
    }

    fn spec(&self) -> ToolSpec {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "Path of the file, relative to the working directory."
                }
            },
            "required": ["path"],
            "additionalProperties": false
        });
        ToolSpec {
            name: NAME.to_owned(),
            description: format!(
                "Reads a file inside the working directory and returns its content: text when it \
                 is UTF-8, otherwise base64. Files over {READ_LIMIT_BYTES} bytes are refused."
            ),
            input_schema: JsonText::from_value(&schema),
        }
    }

    async fn call(&self, call: &ToolCall, context: &ActivityContext) -> Result<ToolOutput> {
        let input: ReadFileInput = call.parse_arguments()?;
        let requested = input.path.as_str();
        // The session's own directory, when it recorded one: it may differ from the
        // directory of the process that hosts this tool (a turn resumed from elsewhere).
        let working_dir = context.working_dir().unwrap_or(&self.working_dir);
        let path = match Self::resolve(working_dir, requested).await? {
            Ok(path) => path,
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        let file = match tokio::fs::File::open(&path).await {
            Ok(file) => file,
            Err(e) => return Ok(ToolOutput::error(io_message(requested, &e))),
        };
        let metadata = match file.metadata().await {
            Ok(metadata) => metadata,
            Err(e) => return Ok(ToolOutput::error(io_message(requested, &e))),
        };
        if metadata.is_dir() {
            return Ok(ToolOutput::error(format!(
                "{requested:?} is a directory, not a file"
            )));
        }
        if metadata.len() > READ_LIMIT_BYTES {
            return Ok(ToolOutput::error(too_large(requested, metadata.len())));
        }
        // Read one byte past the limit, so a file that grew since the metadata is still caught.
        let mut bytes = Vec::new();
        if let Err(e) = file
            .take(READ_LIMIT_BYTES + 1)
            .read_to_end(&mut bytes)
            .await
        {
            return Ok(ToolOutput::error(io_message(requested, &e)));
        }
        if bytes.len() as u64 > READ_LIMIT_BYTES {
            return Ok(ToolOutput::error(too_large(requested, bytes.len() as u64)));
        }
        tracing::debug!(path = %path.display(), bytes = bytes.len(), "read_file");
        Ok(match String::from_utf8(bytes) {
            Ok(text) => ToolOutput::text(text),
            Err(not_utf8) => {
                let bytes = not_utf8.into_bytes();
                let result = serde_json::json!({
                    "path": requested,
                    "bytes": bytes.len(),
                    "base64": base64::engine::general_purpose::STANDARD.encode(&bytes),
                });
                ToolOutput::json(JsonText::from_value(&result))
            }
        })
    }
}

fn too_large(requested: &str, bytes: u64) -> String {
    format!(
        "{requested:?} is too large to read: at least {bytes} bytes, and read_file reads at most \
         {READ_LIMIT_BYTES} bytes (1 MiB)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::ToolResultContent;

    fn call(path: &str) -> ToolCall {
        ToolCall {
            tool_use_id: "toolu_1".into(),
            name: NAME.into(),
            arguments: serde_json::json!({ "path": path }).to_string(),
            idempotency_key: "k".into(),
        }
    }

    /// A working directory `work` with `notes.txt`, next to a `secret.txt` outside it.
    fn setup() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir_all(work.join("sub")).unwrap();
        std::fs::write(work.join("notes.txt"), "the launch is on Tuesday.\n").unwrap();
        std::fs::write(work.join("sub/inner.txt"), "inner").unwrap();
        std::fs::write(dir.path().join("secret.txt"), "secret").unwrap();
        (dir, work)
    }

    /// A session's recorded directory (in the context) is where the file is read, confined
    /// there as the tool's own directory would be; without one, the tool's own.
    #[tokio::test]
    async fn the_session_directory_in_the_context_wins_and_confines() {
        let (dir, work) = setup();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("notes.txt"), "elsewhere's notes").unwrap();
        let tool = ReadFile::new(&elsewhere);
        let session = ActivityContext::detached().with_working_dir(Some(&work));
        let out = tool.call(&call("notes.txt"), &session).await.unwrap();
        assert_eq!(out, ToolOutput::text("the launch is on Tuesday.\n"));
        assert_error(
            &tool.call(&call("../secret.txt"), &session).await.unwrap(),
            "escapes the working directory",
        );
        let own = tool
            .call(&call("notes.txt"), &ActivityContext::detached())
            .await
            .unwrap();
        assert_eq!(own, ToolOutput::text("elsewhere's notes"));
    }

    fn assert_error(out: &ToolOutput, contains: &str) {
        assert!(out.is_error, "expected an error output, got {out:?}");
        let ToolResultContent::Text(text) = &out.content else {
            panic!("expected text, got {out:?}")
        };
        assert!(
            text.contains(contains),
            "{text:?} does not contain {contains:?}"
        );
    }

    #[tokio::test]
    async fn reads_text_files_inside() {
        let (_dir, work) = setup();
        let tool = ReadFile::new(&work);
        for path in ["notes.txt", "./notes.txt", "sub/../notes.txt"] {
            let out = tool
                .call(&call(path), &ActivityContext::detached())
                .await
                .unwrap();
            assert_eq!(
                out,
                ToolOutput::text("the launch is on Tuesday.\n"),
                "{path}"
            );
        }
        let absolute = work.join("sub/inner.txt");
        let out = tool
            .call(
                &call(absolute.to_str().unwrap()),
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        assert_eq!(out, ToolOutput::text("inner"));
    }

    #[tokio::test]
    async fn refuses_escapes_by_dotdot_absolute_path_and_symlink() {
        let (dir, work) = setup();
        let secret = dir.path().join("secret.txt");
        std::os::unix::fs::symlink(&secret, work.join("link.txt")).unwrap();
        std::os::unix::fs::symlink(dir.path(), work.join("linkdir")).unwrap();
        let tool = ReadFile::new(&work);
        for path in [
            "../secret.txt",
            "sub/../../secret.txt",
            secret.to_str().unwrap(),
            "/etc/passwd",
            "link.txt",
            "linkdir/secret.txt",
            "../does-not-exist.txt",
        ] {
            let out = tool
                .call(&call(path), &ActivityContext::detached())
                .await
                .unwrap();
            assert_error(&out, "escapes the working directory");
        }
    }

    #[tokio::test]
    async fn symlinks_inside_are_followed() {
        let (_dir, work) = setup();
        std::os::unix::fs::symlink(work.join("notes.txt"), work.join("alias.txt")).unwrap();
        let out = ReadFile::new(&work)
            .call(&call("alias.txt"), &ActivityContext::detached())
            .await
            .unwrap();
        assert_eq!(out, ToolOutput::text("the launch is on Tuesday.\n"));
    }

    #[tokio::test]
    async fn missing_files_directories_and_empty_paths_are_error_outputs() {
        let (_dir, work) = setup();
        let tool = ReadFile::new(&work);
        assert_error(
            &tool
                .call(&call("nope.txt"), &ActivityContext::detached())
                .await
                .unwrap(),
            "no such file: \"nope.txt\"",
        );
        assert_error(
            &tool
                .call(&call("sub"), &ActivityContext::detached())
                .await
                .unwrap(),
            "is a directory",
        );
        assert_error(
            &tool
                .call(&call(""), &ActivityContext::detached())
                .await
                .unwrap(),
            "the path is empty",
        );
    }

    #[tokio::test]
    async fn binary_content_is_base64_json() {
        let (_dir, work) = setup();
        std::fs::write(work.join("blob.bin"), [0xff, 0x00, 0xfe, b'a']).unwrap();
        let out = ReadFile::new(&work)
            .call(&call("blob.bin"), &ActivityContext::detached())
            .await
            .unwrap();
        assert_eq!(
            out,
            ToolOutput::json(
                JsonText::parse(r#"{"path":"blob.bin","bytes":4,"base64":"/wD+YQ=="}"#).unwrap()
            )
        );
    }

    #[tokio::test]
    async fn files_over_one_mebibyte_are_refused() {
        let (_dir, work) = setup();
        let limit = READ_LIMIT_BYTES as usize;
        std::fs::write(work.join("exact.txt"), "a".repeat(limit)).unwrap();
        std::fs::write(work.join("big.txt"), "a".repeat(limit + 1)).unwrap();
        let tool = ReadFile::new(&work);
        let out = tool
            .call(&call("exact.txt"), &ActivityContext::detached())
            .await
            .unwrap();
        assert!(!out.is_error);
        let out = tool
            .call(&call("big.txt"), &ActivityContext::detached())
            .await
            .unwrap();
        assert_error(&out, "reads at most 1048576 bytes (1 MiB)");
    }

    #[tokio::test]
    async fn a_missing_working_directory_is_an_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let tool = ReadFile::new(dir.path().join("absent"));
        let err = tool
            .call(&call("notes.txt"), &ActivityContext::detached())
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Io { ref path, .. } if path.ends_with("absent")),
            "{err:?}"
        );
        assert_eq!(err.kind(), crate::ErrorKind::Internal);
    }

    #[tokio::test]
    async fn bad_arguments_are_invalid_arguments() {
        let (_dir, work) = setup();
        let mut bad = call("x");
        bad.arguments = r#"{"path": 7}"#.into();
        let err = ReadFile::new(&work)
            .call(&bad, &ActivityContext::detached())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArguments { ref tool, .. } if tool == NAME));
    }
}
