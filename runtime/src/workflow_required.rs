//! The check of a tool call's required arguments (workflow version 2 on): the fields its
//! tool's `input_schema` requires, read once per fold or kept for the schemas read last, and
//! the error result's text when the call lacks one.

use std::collections::BTreeMap;

/// The required argument names of the tools a fold has seen called, by the tool's index in
/// the session's tools (fixed by its start, which a session has once, before any call), each read from the tool's schema once per fold
/// rather than at every call: reading them scans the whole schema text, about a quarter of
/// the fold of a long session whose model calls tools at every turn. Kept only while a fold
/// runs (a fold, a replay, the state at an event), so a parked state carries none.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct RequiredMemo {
    by_tool: BTreeMap<usize, Option<Vec<String>>>,
}

/// The names a tool's `input_schema` requires: the strings of its `required` array, none when
/// it has no such array (or is not an object); `None` when the schema is not JSON. Replay runs
/// this for every tool call of a history, so the common schema (an object naming `required`
/// once) is read without building the rest of it (a whole schema parsed into a `Value` was a
/// quarter of a long history's fold); any other (`required` twice, where the parsed object
/// keeps the last) is parsed whole, as before.
pub(crate) fn required_fields(schema: &cairn_ledger::JsonText) -> Option<Vec<String>> {
    /// An object's `required` member; every other member skipped unread.
    #[derive(serde::Deserialize)]
    struct RequiredMember {
        #[serde(default)]
        required: serde_json::Value,
    }
    let strings = |required: &serde_json::Value| -> Vec<String> {
        required
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    if let Ok(member) = serde_json::from_str::<RequiredMember>(schema.as_str()) {
        return Some(strings(&member.required));
    }
    let schema = schema.to_value().ok()?;
    Some(schema.get("required").map(strings).unwrap_or_default())
}

/// Version 2's check of a tool call's arguments against its tool's `input_schema`: the
/// arguments must be an object holding every field the schema's `required` names. The
/// error result's text when they do not.
pub(super) fn missing_required(
    tools: &[cairn_ledger::ToolSpec],
    memo: Option<&mut RequiredMemo>,
    name: &str,
    arguments: &serde_json::Value,
) -> Option<String> {
    let index = tools.iter().position(|t| t.name == name)?;
    let schema = &tools[index].input_schema;
    match memo {
        Some(memo) => {
            let required = memo
                .by_tool
                .entry(index)
                .or_insert_with(|| required_fields(schema))
                .as_deref()?;
            missing_of(name, required, arguments)
        }
        None if schema.as_str().len() > RECENT_REQUIRED_SCHEMA_BYTES => {
            missing_of(name, &required_fields(schema)?, arguments)
        }
        None => RECENT_REQUIRED.with(|recent| {
            let mut recent = recent.borrow_mut();
            missing_of(name, recent.required(schema)?, arguments)
        }),
    }
}

/// The most schemas [`RecentRequired`] keeps: more than the tools a session's model calls
/// in turn, so that a session offering many tools (an MCP server's) does not evict its own
/// schemas call after call. A lookup compares lengths first, so a miss costs little.
pub(crate) const RECENT_REQUIRED_SCHEMAS: usize = 32;
/// The largest schema [`RecentRequired`] keeps, in bytes of text.
const RECENT_REQUIRED_SCHEMA_BYTES: usize = 16 << 10;

thread_local! {
    /// The required fields of the tool schemas this thread read last, outside a fold.
    static RECENT_REQUIRED: std::cell::RefCell<RecentRequired> = const {
        std::cell::RefCell::new(RecentRequired { schemas: Vec::new(), next: 0 })
    };
}

/// The required fields of the last few tool schemas read, by their text. A live session's
/// state keeps no [`RequiredMemo`] (a parked state stays small), so without it every tool
/// call read its tool's schema again, and a fresh session per task always did; the same few
/// schemas come back across sessions, and comparing a schema's text is far cheaper than
/// reading it. What it gives is what [`required_fields`] gives: only the time changes.
pub(crate) struct RecentRequired {
    schemas: Vec<(String, Option<Vec<String>>)>,
    /// The entry the next new schema replaces once full.
    next: usize,
}

impl RecentRequired {
    /// None kept yet.
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        RecentRequired {
            schemas: Vec::new(),
            next: 0,
        }
    }

    /// How many schemas it keeps.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        self.schemas.len()
    }

    /// [`required_fields`] of `schema`, kept for next time (the caller reads a schema larger
    /// than [`RECENT_REQUIRED_SCHEMA_BYTES`] itself, so none is kept).
    pub(crate) fn required(&mut self, schema: &cairn_ledger::JsonText) -> Option<&[String]> {
        let text = schema.as_str();
        let at = match self.schemas.iter().position(|(kept, _)| kept == text) {
            Some(at) => at,
            None if self.schemas.len() < RECENT_REQUIRED_SCHEMAS => {
                self.schemas
                    .push((text.to_owned(), required_fields(schema)));
                self.schemas.len() - 1
            }
            None => {
                let at = self.next;
                self.next = (at + 1) % RECENT_REQUIRED_SCHEMAS;
                self.schemas[at] = (text.to_owned(), required_fields(schema));
                at
            }
        };
        self.schemas[at].1.as_deref()
    }
}

/// The error result's text when `arguments` lack a field of `required` (see
/// [`missing_required`]).
fn missing_of(name: &str, required: &[String], arguments: &serde_json::Value) -> Option<String> {
    let Some(object) = arguments.as_object() else {
        return Some(format!(
            "invalid tool arguments: {name} takes a JSON object (requires: {})",
            required.join(", ")
        ));
    };
    let missing: Vec<String> = required
        .iter()
        .filter(|field| !object.contains_key(field.as_str()))
        .map(|field| format!("{field:?}"))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "invalid tool arguments: missing required argument{} {} ({name} requires: {})",
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", "),
            required.join(", ")
        )
    })
}
