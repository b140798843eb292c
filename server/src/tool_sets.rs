//! Tool sets sent once per worker: a model task's tools, for a worker that keeps tool sets
//! ([`TOOL_SETS_HEADER`]), named by their digest and left out when the worker listed it.
//!
//! A session's tool specs are often most of a model task's bytes (tens of kilobytes for a
//! coding agent's tools, against a short transcript), the same for every call of the session
//! and for many sessions, and both processes spend CPU on them: the server writes them into
//! every answer, the worker parses them from it. A worker that keeps them is sent each set
//! once, as a sticky worker keeps what it was sent.

use crate::errors::{single_header, ApiError};
use axum::http::HeaderMap;
use cairn_ledger::ToolSpec;
use cairn_runtime::wire::{parse_tool_sets, TOOL_SETS_HEADER};
use cairn_runtime::LeasedTask;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use utoipa::IntoParams;

/// The sets remembered by address at most; past it that memo starts afresh.
const MEMO_ENTRIES: usize = 1024;
/// The distinct sets remembered by content at most, the oldest let go first.
const RECENT_SETS: usize = 16;

/// The header, as the OpenAPI document describes it.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Header)]
pub struct ToolSetsHeader {
    /// Sent by a worker that keeps tool sets: the digests of those it holds, comma-separated
    /// (empty when none yet; at most 64, each 32 lowercase hex digits). Its model tasks then
    /// carry `tools_digest`, and `tools` empty with `tools_omitted: true` when the digest is
    /// one it listed.
    #[param(
        rename = "Cairn-Tool-Sets",
        value_type = String,
        required = false,
        pattern = r"^ *([0-9a-f]{32}( *, *[0-9a-f]{32}){0,63})? *$"
    )]
    #[allow(dead_code)] // read from the headers; here for the document only
    tool_sets: Option<String>,
}

/// What a request's worker said of the tool sets it keeps.
#[derive(Debug, Default)]
pub struct KnownToolSets {
    /// It keeps tool sets: its model tasks carry their digest.
    keeps: bool,
    /// The digests of the sets it holds.
    digests: Vec<String>,
}

impl KnownToolSets {
    /// What `headers` say: nothing without [`TOOL_SETS_HEADER`]; a header that is not a list
    /// of digests is refused (400 naming it).
    pub fn of(headers: &HeaderMap) -> Result<Self, ApiError> {
        let Some(value) = single_header(
            headers,
            TOOL_SETS_HEADER,
            "Cairn-Tool-Sets",
            "use digests of lowercase hex digits and commas",
        )?
        else {
            return Ok(KnownToolSets::default());
        };
        let digests = parse_tool_sets(value)
            .map_err(|problem| ApiError::invalid(format!("Cairn-Tool-Sets: {problem}")))?;
        Ok(KnownToolSets {
            keeps: true,
            digests: digests.into_iter().map(str::to_owned).collect(),
        })
    }
}

/// The digests of the tool sets of sessions this server handed tasks of, by the set's
/// address: a session's model tasks share its set
/// ([`cairn_runtime::ActivityInput::Model`]'s `tools`), so its digest is computed once while
/// the set is remembered. Each entry holds a weak reference to its set: the set's specs go
/// with its last session, but its allocation stays while the entry does, so no other set
/// can take its address. The last distinct sets are also remembered by content: the
/// sessions of one application offer the same tools, each in a set of its own, and
/// comparing a new session's set with them costs far less than writing it as JSON and
/// hashing it. Cheap to clone.
#[derive(Clone, Default)]
pub struct ToolSetDigests {
    memo: Arc<Mutex<Memo>>,
}

#[derive(Default)]
struct Memo {
    /// Each set remembered, by its address, with its digest.
    by_address: HashMap<usize, (Weak<[ToolSpec]>, Arc<str>)>,
    /// The last distinct sets with their digests, the newest last.
    recent: Vec<(Arc<[ToolSpec]>, Arc<str>)>,
}

impl ToolSetDigests {
    /// Gives the model tasks of `tasks` their tools' digest, and leaves out the tools of each
    /// whose digest the worker listed; nothing for a worker that does not keep tool sets.
    pub fn shorten(&self, tasks: &mut [LeasedTask], known: &KnownToolSets) {
        if !known.keeps {
            return;
        }
        for task in tasks {
            let Some(set) = task.input.tool_set_mut() else {
                continue;
            };
            if set.tools.is_empty() || *set.omitted {
                continue;
            }
            let digest = self.digest(set.tools);
            if known.digests.iter().any(|d| **d == *digest) {
                *set.tools = Arc::new([]);
                *set.omitted = true;
            }
            *set.digest = Some(digest.to_string());
        }
    }

    /// The digest of `tools`: remembered by the set's address, or by its content, or
    /// computed.
    fn digest(&self, tools: &Arc<[ToolSpec]>) -> Arc<str> {
        let address = Arc::as_ptr(tools).cast::<ToolSpec>() as usize;
        let known = {
            let memo = self.lock();
            if let Some((_, digest)) = memo.by_address.get(&address) {
                return Arc::clone(digest);
            }
            memo.recent
                .iter()
                .rev()
                .find(|(set, _)| **set == **tools)
                .map(|(_, digest)| Arc::clone(digest))
        };
        let digest: Arc<str> = known.unwrap_or_else(|| {
            let digest: Arc<str> = tool_set_digest(tools).into();
            let mut memo = self.lock();
            if memo.recent.len() >= RECENT_SETS {
                memo.recent.remove(0);
            }
            memo.recent.push((Arc::clone(tools), Arc::clone(&digest)));
            digest
        });
        let mut memo = self.lock();
        if memo.by_address.len() >= MEMO_ENTRIES {
            memo.by_address.clear();
        }
        memo.by_address
            .insert(address, (Arc::downgrade(tools), Arc::clone(&digest)));
        digest
    }

    /// How many distinct sets are remembered by content.
    #[cfg(test)]
    fn recent_sets(&self) -> usize {
        self.lock().recent.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memo> {
        self.memo.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A tool set's digest: the first 128 bits of the SHA-256 of its JSON, in 32 lowercase hex
/// digits. A cryptographic hash, so that no session can be given tools whose digest another
/// session's set has (a worker would run that session's calls with the other's tools). Only
/// this server computes it; a worker keeps sets under the digest it was sent, so a server of
/// another version that writes the JSON otherwise costs a worker one more copy of each set.
pub fn tool_set_digest(tools: &[ToolSpec]) -> String {
    // Plain data with string keys: serializing cannot fail.
    let json = serde_json::to_vec(tools).unwrap_or_default();
    let hash = Sha256::digest(&json);
    hash[..16].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use cairn_runtime::wire::is_tool_set_digest;

    fn specs(names: &[&str]) -> Arc<[ToolSpec]> {
        names
            .iter()
            .map(|name| ToolSpec {
                name: (*name).to_owned(),
                description: format!("the {name} tool"),
                input_schema: cairn_ledger::JsonText::parse(r#"{"type":"object"}"#)
                    .expect("schema"),
            })
            .collect()
    }

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            TOOL_SETS_HEADER,
            HeaderValue::from_str(value).expect("value"),
        );
        headers
    }

    #[test]
    fn digests_are_of_the_content_and_pinned() {
        let digest = tool_set_digest(&specs(&["read", "write"]));
        assert!(is_tool_set_digest(&digest), "{digest}");
        assert_eq!(digest, tool_set_digest(&specs(&["read", "write"])));
        assert_ne!(digest, tool_set_digest(&specs(&["write", "read"])));
        assert_ne!(digest, tool_set_digest(&specs(&["read"])));
        // The digest of the JSON `[]`: the form is SHA-256's, so a worker's digests from one
        // server version hold for the next.
        assert_eq!(tool_set_digest(&[]), "4f53cda18c2baa0c0354bb5f9a3ecbe5");
    }

    #[test]
    fn a_set_equal_to_one_seen_gets_its_digest_without_a_new_entry() {
        let digests = ToolSetDigests::default();
        let first = specs(&["read", "write"]);
        let same = specs(&["read", "write"]);
        assert!(!Arc::ptr_eq(&first, &same));
        let digest = digests.digest(&first);
        assert_eq!(&*digest, tool_set_digest(&first));
        assert_eq!(digests.digest(&same), digest);
        assert_eq!(digests.digest(&first), digest);
        assert_eq!(digests.recent_sets(), 1, "one distinct set");
        let other = specs(&["read"]);
        assert_eq!(&*digests.digest(&other), tool_set_digest(&other));
        assert_eq!(digests.recent_sets(), 2);
        for n in 0..RECENT_SETS * 2 {
            digests.digest(&specs(&[&format!("t{n}")]));
        }
        assert_eq!(digests.recent_sets(), RECENT_SETS, "bounded");
        assert_eq!(digests.digest(&specs(&["read", "write"])), digest);
    }

    #[test]
    fn a_set_no_session_holds_is_not_kept_alive_by_the_memo() {
        let digests = ToolSetDigests::default();
        let set = specs(&["long"]);
        let address = Arc::as_ptr(&set).cast::<ToolSpec>() as usize;
        let digest = digests.digest(&set);
        // Pushed out of the sets remembered by content by newer ones.
        for n in 0..RECENT_SETS {
            digests.digest(&specs(&[&format!("t{n}")]));
        }
        drop(set);
        let memo = digests.lock();
        let (weak, remembered) = memo.by_address.get(&address).expect("remembered");
        assert_eq!(*remembered, digest);
        assert_eq!(
            weak.strong_count(),
            0,
            "its specs are gone with its last holder"
        );
    }

    #[test]
    fn the_header_is_parsed_or_refused_naming_what_is_wrong() {
        let none = KnownToolSets::of(&HeaderMap::new()).expect("none");
        assert!(!none.keeps);
        let empty = KnownToolSets::of(&headers("")).expect("empty");
        assert!(empty.keeps && empty.digests.is_empty());
        let a = "0".repeat(32);
        let b = "ab".repeat(16);
        let two = KnownToolSets::of(&headers(&format!("{a} , {b}"))).expect("two");
        assert_eq!(two.digests, vec![a.clone(), b]);
        for (bad, says) in [
            ("xyz", "item 0"),
            (&format!("{a},"), "item 1"),
            (&"A".repeat(32), "item 0"),
            (&vec![a.as_str(); 65].join(","), "65 digests"),
        ] {
            let error = KnownToolSets::of(&headers(bad)).expect_err(bad);
            assert_eq!(error.status(), axum::http::StatusCode::BAD_REQUEST);
            let message = error.body().error.message;
            assert!(
                message.starts_with("Cairn-Tool-Sets: ") && message.contains(says),
                "{message}"
            );
        }
        let mut twice = headers(&a);
        twice.append(TOOL_SETS_HEADER, HeaderValue::from_static(""));
        assert!(KnownToolSets::of(&twice).is_err());
    }
}
