//! The `read_file` tool: reads one file inside a working directory, whole or a range of its
//! lines, refusing any path that escapes it (by `..`, an absolute path or a symlink).

use crate::context::ActivityContext;
use crate::error::Result;
use crate::tool::{Tool, ToolCall, ToolOutput};
use crate::tools::confine::WorkDir;
use crate::tools::file_io::{read_limited, Limited};
use async_trait::async_trait;
use base64::Engine;
use cairn_ledger::file_versions::{sha256_hex, RANGE_TRAILER_START};
use cairn_ledger::{JsonText, Media, ToolResultBlock, ToolSpec};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The tool's name.
const NAME: &str = cairn_ledger::file_versions::READ_FILE;

/// Files larger than this are refused, so one call cannot flood the transcript or memory.
const READ_LIMIT_BYTES: u64 = 1024 * 1024;

/// Reads a file confined to a working directory.
///
/// Input `{"path": "..."}`, relative to the working directory (an absolute path is accepted only
/// when it lies inside it). The path is resolved, canonicalized, and refused when it escapes the
/// directory, including through symlinks. UTF-8 content is returned as text; a PNG, JPEG, GIF
/// or WebP image (known by its magic number) as a caption `path: media type, n bytes, sha256
/// HEX` and the image itself, so a vision model sees it; anything else as JSON
/// `{"path": ..., "bytes": n, "sha256": "...", "base64": "..."}`. Missing files,
/// directories, escapes and files over [`ReadFile::MAX_BYTES`] (1 MiB) are `is_error` outputs
/// the model can recover from.
///
/// With `offset` (the 1-based first line) and/or `limit` (how many lines), only those lines of
/// a UTF-8 file are returned, followed by a last line
/// `[read_file: lines A-B of N; sha256 HEX]` giving the whole file's hash, so that a later
/// `edit_file` knows which version the agent saw (see [`cairn_ledger::file_versions`]).
#[derive(Debug, Clone)]
pub struct ReadFile {
    working_dir: WorkDir,
}

impl ReadFile {
    /// The largest file this tool reads, in bytes (1 MiB).
    pub const MAX_BYTES: u64 = READ_LIMIT_BYTES;

    /// A reader confined to `working_dir`. The directory is resolved on each call, so it may be
    /// created after the tool.
    pub fn new(working_dir: impl Into<PathBuf>) -> Self {
        ReadFile {
            working_dir: WorkDir::new(working_dir.into(), NAME, "reads"),
        }
    }

    /// The directory this reader is confined to, as given.
    pub fn working_dir(&self) -> &Path {
        self.working_dir.path()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadFileInput {
    path: String,
    #[serde(default)]
    offset: Option<u64>,
    #[serde(default)]
    limit: Option<u64>,
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
                },
                "offset": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "The line to start reading at, from 1; only for text files."
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "How many lines to read; only for text files."
                }
            },
            "required": ["path"],
            "additionalProperties": false
        });
        ToolSpec {
            name: NAME.to_owned(),
            description: format!(
                "Reads a file inside the working directory and returns its content: text when it \
                 is UTF-8, otherwise base64. Files over {READ_LIMIT_BYTES} bytes are refused. \
                 Give offset and limit to read only some lines of a large text file."
            ),
            input_schema: JsonText::from_value(&schema),
        }
    }

    async fn call(&self, call: &ToolCall, context: &ActivityContext) -> Result<ToolOutput> {
        let input: ReadFileInput = call.parse_arguments()?;
        let requested = input.path.as_str();
        let range = match LineRange::of(input.offset, input.limit) {
            Ok(range) => range,
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        let path = match self
            .working_dir
            .for_session(context)
            .existing(requested)
            .await?
        {
            Ok(path) => path,
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        let bytes = match read_limited(&path, requested, READ_LIMIT_BYTES).await {
            Ok(Limited::Whole(bytes)) => bytes,
            Ok(Limited::TooLarge(at_least)) => {
                return Ok(ToolOutput::error(too_large(requested, at_least)))
            }
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        tracing::debug!(path = %path.display(), bytes = bytes.len(), "read_file");
        Ok(match (String::from_utf8(bytes), range) {
            (Ok(text), None) => ToolOutput::text(text),
            (Ok(text), Some(range)) => range.select(requested, &text),
            (Err(_), Some(_)) => ToolOutput::error(format!(
                "{requested:?} is not UTF-8 text, so it has no lines; read it without offset \
                 and limit"
            )),
            (Err(not_utf8), None) => {
                let bytes = not_utf8.into_bytes();
                if let Some(media_type) = cairn_ledger::sniff_image_media_type(&bytes) {
                    // An image goes to the model as an image, so a vision model can look at it.
                    let caption = format!(
                        "{requested}: {media_type}, {} bytes, sha256 {}",
                        bytes.len(),
                        sha256_hex(&bytes)
                    );
                    return Ok(ToolOutput::blocks(vec![
                        ToolResultBlock::Text { text: caption },
                        ToolResultBlock::Media(Media::image_bytes(media_type, &bytes)),
                    ]));
                }
                let result = serde_json::json!({
                    "path": requested,
                    "bytes": bytes.len(),
                    "sha256": sha256_hex(&bytes),
                    "base64": base64::engine::general_purpose::STANDARD.encode(&bytes),
                });
                ToolOutput::json(JsonText::from_value(&result))
            }
        })
    }
}

/// The lines a ranged read returns: from `first` (0-based), at most `count`.
#[derive(Debug, Clone, Copy)]
struct LineRange {
    first: usize,
    count: Option<usize>,
}

impl LineRange {
    /// The range of the arguments; `None` when neither is given (the whole file).
    fn of(offset: Option<u64>, limit: Option<u64>) -> std::result::Result<Option<Self>, String> {
        if offset.is_none() && limit.is_none() {
            return Ok(None);
        }
        let first = match offset {
            Some(0) => return Err("offset counts lines from 1; 0 is not a line".to_owned()),
            Some(line) => usize::try_from(line - 1).unwrap_or(usize::MAX),
            None => 0,
        };
        let count = match limit {
            Some(0) => return Err("limit must be at least 1 line".to_owned()),
            Some(lines) => Some(usize::try_from(lines).unwrap_or(usize::MAX)),
            None => None,
        };
        Ok(Some(LineRange { first, count }))
    }

    /// The selected lines of `text`, each as in the file, then the trailer naming the range
    /// and the whole file's hash.
    fn select(self, requested: &str, text: &str) -> ToolOutput {
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        let total = lines.len();
        if self.first >= total && !(self.first == 0 && total == 0) {
            return ToolOutput::error(format!(
                "offset {} is past the end of {requested:?}, which has {total} lines",
                self.first.saturating_add(1)
            ));
        }
        let end = match self.count {
            Some(count) => self.first.saturating_add(count).min(total),
            None => total,
        };
        let mut out: String = lines[self.first..end].concat();
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&format!(
            "{RANGE_TRAILER_START}lines {}-{end} of {total}; sha256 {}]",
            self.first + 1,
            sha256_hex(text.as_bytes())
        ));
        ToolOutput::text(out)
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
    use crate::error::Error;
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

    #[tokio::test]
    async fn images_are_returned_as_images_with_a_caption() {
        let (_dir, work) = setup();
        let png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";
        std::fs::write(work.join("shot.png"), png).unwrap();
        let tool = ReadFile::new(&work);
        let out = tool
            .call(&call("shot.png"), &ActivityContext::detached())
            .await
            .unwrap();
        let caption = format!("shot.png: image/png, 16 bytes, sha256 {}", sha256_hex(png));
        assert_eq!(
            out,
            ToolOutput::blocks(vec![
                ToolResultBlock::Text {
                    text: caption.clone()
                },
                ToolResultBlock::Media(Media::image_base64(
                    "image/png",
                    "iVBORw0KGgoAAAANSUhEUg=="
                )),
            ])
        );
        // The read is a version of the file for a later edit, by the caption's hash.
        let mut transcript = cairn_ledger::Transcript::new();
        transcript.push_user_text("look");
        transcript.messages.push(cairn_ledger::Message {
            role: cairn_ledger::Role::Assistant,
            parts: vec![cairn_ledger::Part::ToolUse(cairn_ledger::ToolUse {
                id: "r1".into(),
                name: "read_file".into(),
                arguments: r#"{"path":"shot.png"}"#.into(),
                signature: None,
            })],
            provenance: None,
        });
        transcript.push_tool_results([cairn_ledger::ToolResult {
            tool_use_id: "r1".into(),
            content: out.content,
            is_error: false,
        }]);
        let versions = cairn_ledger::file_versions::file_versions(&transcript);
        assert_eq!(versions.len(), 1);
        assert_eq!(versions[0].sha256, sha256_hex(png));
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
                JsonText::parse(format!(
                    r#"{{"path":"blob.bin","bytes":4,"sha256":"{}","base64":"/wD+YQ=="}}"#,
                    sha256_hex(&[0xff, 0x00, 0xfe, b'a'])
                ))
                .unwrap()
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

    fn ranged(path: &str, offset: Option<u64>, limit: Option<u64>) -> ToolCall {
        let mut arguments = serde_json::json!({ "path": path });
        if let Some(offset) = offset {
            arguments["offset"] = offset.into();
        }
        if let Some(limit) = limit {
            arguments["limit"] = limit.into();
        }
        ToolCall {
            arguments: arguments.to_string(),
            ..call(path)
        }
    }

    #[tokio::test]
    async fn line_ranges_return_those_lines_and_the_whole_files_hash() {
        let (_dir, work) = setup();
        let text = "one\ntwo\nthree\nfour";
        std::fs::write(work.join("lines.txt"), text).unwrap();
        let hash = sha256_hex(text.as_bytes());
        let tool = ReadFile::new(&work);
        let cases = [
            (
                Some(2),
                Some(2),
                format!("two\nthree\n[read_file: lines 2-3 of 4; sha256 {hash}]"),
            ),
            (
                Some(3),
                None,
                format!("three\nfour\n[read_file: lines 3-4 of 4; sha256 {hash}]"),
            ),
            (
                None,
                Some(1),
                format!("one\n[read_file: lines 1-1 of 4; sha256 {hash}]"),
            ),
            (
                Some(4),
                Some(100),
                format!("four\n[read_file: lines 4-4 of 4; sha256 {hash}]"),
            ),
        ];
        for (offset, limit, expected) in cases {
            let out = tool
                .call(
                    &ranged("lines.txt", offset, limit),
                    &ActivityContext::detached(),
                )
                .await
                .unwrap();
            assert_eq!(out, ToolOutput::text(expected), "{offset:?} {limit:?}");
        }
        // Without a range the file comes whole, as before.
        let out = tool
            .call(&call("lines.txt"), &ActivityContext::detached())
            .await
            .unwrap();
        assert_eq!(out, ToolOutput::text(text));
    }

    #[tokio::test]
    async fn bad_ranges_are_error_outputs() {
        let (_dir, work) = setup();
        std::fs::write(work.join("lines.txt"), "one\ntwo\n").unwrap();
        std::fs::write(work.join("blob.bin"), [0xff, 0xfe]).unwrap();
        let tool = ReadFile::new(&work);
        for (call, expected) in [
            (
                ranged("lines.txt", Some(3), None),
                "offset 3 is past the end of \"lines.txt\", which has 2 lines",
            ),
            (
                ranged("lines.txt", Some(0), None),
                "offset counts lines from 1",
            ),
            (
                ranged("lines.txt", None, Some(0)),
                "limit must be at least 1",
            ),
            (
                ranged("blob.bin", Some(1), None),
                "\"blob.bin\" is not UTF-8 text",
            ),
            (
                ranged("../secret.txt", Some(1), None),
                "escapes the working directory",
            ),
        ] {
            let out = tool
                .call(&call, &ActivityContext::detached())
                .await
                .unwrap();
            assert_error(&out, expected);
        }
        let mut negative = call("lines.txt");
        negative.arguments = r#"{"path":"lines.txt","offset":-1}"#.into();
        let err = tool
            .call(&negative, &ActivityContext::detached())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArguments { .. }), "{err:?}");
    }
}
