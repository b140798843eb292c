//! What the agent of a session last saw of each file, derived from the file tools' results in
//! its transcript: the durable "last read" that `edit_file` and `write_file` compare a file
//! with before changing it.
//!
//! The derivation is pure and reads recorded data only, so it gives the same answer after a
//! crash and in any worker process. The file tools (in `cairn-activities`) produce results in
//! the forms read here, with the names and hash defined here, so both sides agree:
//!
//! - `read_file` of a whole file: the text itself (its SHA-256 is the file's), or, for bytes
//!   that are not UTF-8, a JSON object with a `sha256` member;
//! - `read_file` of a line range (`offset` or `limit` given): the lines, then a last line
//!   `[read_file: ... sha256 HEX]` naming the whole file's hash;
//! - `write_file` and `edit_file`: a JSON object with a `sha256` member (the file as written).
//!
//! Error results and results the transcript keeps only as an omission (over its size limit)
//! say nothing about a file: the agent did not see it whole.

use crate::transcript::{Part, ToolResultContent, Transcript};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The name of the tool that reads files.
pub const READ_FILE: &str = "read_file";
/// The name of the tool that writes whole files.
pub const WRITE_FILE: &str = "write_file";
/// The name of the tool that replaces a string in a file.
pub const EDIT_FILE: &str = "edit_file";

/// What starts the last line of a ranged `read_file` result.
pub const RANGE_TRAILER_START: &str = "[read_file: ";

/// What the agent last saw of one file.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FileVersion {
    /// The path as the tool call gave it (relative to the working directory, or absolute).
    pub path: String,
    /// The SHA-256 of the file's bytes then, lowercase hex.
    pub sha256: String,
}

/// Whether a call of `tool` needs the session's file versions.
pub fn wants_file_versions(tool: &str) -> bool {
    tool == WRITE_FILE || tool == EDIT_FILE
}

/// The lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    digest_hex(&Sha256::digest(bytes))
}

/// A digest in lowercase hex, as [`FileVersion::sha256`] holds it (for a digest of content
/// hashed in pieces).
pub fn digest_hex(digest: &[u8]) -> String {
    let mut out = String::with_capacity(digest.len() * 2);
    for &byte in digest {
        out.push(char::from_digit(u32::from(byte >> 4), 16).unwrap_or('0'));
        out.push(char::from_digit(u32::from(byte & 0xf), 16).unwrap_or('0'));
    }
    out
}

/// The last version of each file the session's file tools reported, one per distinct `path`
/// argument, in the order they were last reported (the latest last).
pub fn file_versions(transcript: &Transcript) -> Vec<FileVersion> {
    // Tool calls by id: (name, arguments).
    let mut calls: BTreeMap<&str, (&str, &str)> = BTreeMap::new();
    let mut order: Vec<FileVersion> = Vec::new();
    for message in &transcript.messages {
        for part in &message.parts {
            match part {
                Part::ToolUse(tool_use) => {
                    calls.insert(
                        &tool_use.id,
                        (tool_use.name.as_str(), tool_use.arguments.as_str()),
                    );
                }
                Part::ToolResult(result) if !result.is_error => {
                    let Some(&(name, arguments)) = calls.get(result.tool_use_id.as_str()) else {
                        continue;
                    };
                    if let Some(version) = reported_version(name, arguments, &result.content) {
                        order.retain(|seen| seen.path != version.path);
                        order.push(version);
                    }
                }
                _ => {}
            }
        }
    }
    order
}

/// The file version one successful file-tool result reports, if any.
fn reported_version(
    name: &str,
    arguments: &str,
    content: &ToolResultContent,
) -> Option<FileVersion> {
    if name != READ_FILE && name != WRITE_FILE && name != EDIT_FILE {
        return None;
    }
    let arguments: serde_json::Value = serde_json::from_str(arguments).ok()?;
    let path = arguments.get("path")?.as_str()?.to_owned();
    let ranged = arguments.get("offset").is_some_and(|v| !v.is_null())
        || arguments.get("limit").is_some_and(|v| !v.is_null());
    let sha256 = match content {
        ToolResultContent::Json(json) => {
            let value = json.to_value().ok()?;
            let sha256 = value.get("sha256")?.as_str()?;
            is_sha256_hex(sha256).then(|| sha256.to_owned())?
        }
        ToolResultContent::Text(text) if name == READ_FILE && ranged => {
            let trailer = text.rsplit('\n').next()?;
            let rest = trailer.strip_prefix(RANGE_TRAILER_START)?;
            let (_, after) = rest.rsplit_once("sha256 ")?;
            let sha256 = after.strip_suffix(']')?;
            is_sha256_hex(sha256).then(|| sha256.to_owned())?
        }
        ToolResultContent::Text(text) if name == READ_FILE => sha256_hex(text.as_bytes()),
        // An image read: its caption ends with the file's hash.
        ToolResultContent::Blocks(blocks) if name == READ_FILE => {
            let Some(crate::media::ToolResultBlock::Text { text }) = blocks.first() else {
                return None;
            };
            let (_, sha256) = text.rsplit_once(", sha256 ")?;
            is_sha256_hex(sha256).then(|| sha256.to_owned())?
        }
        ToolResultContent::Text(_) | ToolResultContent::Blocks(_) => return None,
    };
    Some(FileVersion { path, sha256 })
}

fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transcript::{Message, Role, ToolResult, ToolUse};
    use crate::JsonText;

    fn exchange(id: &str, name: &str, arguments: &str, content: ToolResultContent) -> [Message; 2] {
        exchange_with(id, name, arguments, content, false)
    }

    fn exchange_with(
        id: &str,
        name: &str,
        arguments: &str,
        content: ToolResultContent,
        is_error: bool,
    ) -> [Message; 2] {
        [
            Message {
                role: Role::Assistant,
                parts: vec![Part::ToolUse(ToolUse {
                    id: id.into(),
                    name: name.into(),
                    arguments: arguments.into(),
                    signature: None,
                })],
                provenance: None,
            },
            Message {
                role: Role::User,
                parts: vec![Part::ToolResult(ToolResult {
                    tool_use_id: id.into(),
                    content,
                    is_error,
                })],
                provenance: None,
            },
        ]
    }

    const H1: &str = "1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn sha256_hex_matches_the_standard_vector() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn reads_writes_and_edits_report_versions_latest_last() {
        let mut transcript = Transcript::new();
        let text = |t: &str| ToolResultContent::Text(t.into());
        let json = |t: &str| ToolResultContent::Json(JsonText::parse(t).unwrap());
        for pair in [
            exchange("1", READ_FILE, r#"{"path":"a.txt"}"#, text("hello\n")),
            exchange(
                "2",
                READ_FILE,
                r#"{"path":"b.txt","offset":2,"limit":1}"#,
                text(&format!("two\n[read_file: lines 2-2 of 3; sha256 {H1}]")),
            ),
            exchange(
                "3",
                WRITE_FILE,
                r#"{"path":"c.txt","content":"x"}"#,
                json(&format!(r#"{{"path":"c.txt","bytes":1,"sha256":"{H1}"}}"#)),
            ),
            // A later read of a.txt replaces the first.
            exchange("4", READ_FILE, r#"{"path":"a.txt"}"#, text("changed\n")),
            // Errors, other tools and unparsable arguments report nothing.
            exchange_with(
                "5",
                EDIT_FILE,
                r#"{"path":"d.txt"}"#,
                json(r#"{"sha256":"x"}"#),
                true,
            ),
            exchange("6", "calculator", r#"{"path":"e.txt"}"#, text("1")),
            exchange("7", READ_FILE, "not json", text("zzz")),
            // A whole read whose last line looks like a trailer is still the whole text.
            exchange(
                "8",
                READ_FILE,
                r#"{"path":"f.txt"}"#,
                text(&format!("[read_file: sha256 {H1}]")),
            ),
        ] {
            transcript.messages.extend(pair);
        }
        let versions = file_versions(&transcript);
        let expected = [
            ("b.txt", H1.to_owned()),
            ("c.txt", H1.to_owned()),
            ("a.txt", sha256_hex(b"changed\n")),
            (
                "f.txt",
                sha256_hex(format!("[read_file: sha256 {H1}]").as_bytes()),
            ),
        ];
        let got: Vec<(&str, String)> = versions
            .iter()
            .map(|v| (v.path.as_str(), v.sha256.clone()))
            .collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn a_ranged_read_without_a_valid_trailer_reports_nothing() {
        let mut transcript = Transcript::new();
        transcript.messages.extend(exchange(
            "1",
            READ_FILE,
            r#"{"path":"a.txt","offset":1}"#,
            ToolResultContent::Text("one\n[read_file: sha256 nothex]".into()),
        ));
        assert!(file_versions(&transcript).is_empty());
    }

    #[test]
    fn only_writing_tools_want_versions() {
        assert!(wants_file_versions(EDIT_FILE) && wants_file_versions(WRITE_FILE));
        assert!(!wants_file_versions(READ_FILE) && !wants_file_versions("shell"));
    }
}
