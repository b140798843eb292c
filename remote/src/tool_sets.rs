//! The tool sets a remote worker keeps ([`TOOL_SETS_HEADER`]): the sets its model tasks
//! brought, by the digest the server named them with; the header that lists them on the lease
//! and report requests; and a model task's tools, left out by the server, filled in again.
//!
//! The sets kept are bounded ([`MAX_TOOL_SETS_LISTED`], the oldest going first): a set the
//! worker let go between listing it and the answer leaves its task to be fetched whole again
//! (`POST /v1/worker/input`, which the caller does).

use cairn_ledger::ToolSpec;
use cairn_runtime::wire::{is_tool_set_digest, MAX_TOOL_SETS_LISTED};
use cairn_runtime::LeasedTask;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// The tool sets this worker keeps.
pub(crate) struct ToolSetCache {
    kept: Mutex<Kept>,
}

struct Kept {
    sets: HashMap<String, Arc<[ToolSpec]>>,
    /// The digests in the order their sets came, the oldest first.
    order: VecDeque<String>,
    /// The header's value listing them, made again when they change.
    header: Arc<str>,
}

impl Default for ToolSetCache {
    fn default() -> Self {
        ToolSetCache {
            kept: Mutex::new(Kept {
                sets: HashMap::new(),
                order: VecDeque::new(),
                header: Arc::from(""),
            }),
        }
    }
}

impl ToolSetCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The value of the header: the digests of the sets kept, comma-separated.
    pub(crate) fn header(&self) -> Arc<str> {
        Arc::clone(&self.lock().header)
    }

    /// How many sets are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().sets.len()
    }

    /// Fills in the tools the server left out of the model tasks of `tasks` and keeps the
    /// sets sent whole under their digests. Answers the positions of the tasks whose set is
    /// not kept (any more): their input is to be fetched whole.
    pub(crate) fn fill(&self, tasks: &mut [LeasedTask]) -> Vec<usize> {
        let mut missing = Vec::new();
        let mut kept = None;
        for (i, task) in tasks.iter_mut().enumerate() {
            let Some(set) = task.input.tool_set_mut() else {
                continue;
            };
            if !*set.omitted && set.digest.is_none() {
                continue;
            }
            let kept = kept.get_or_insert_with(|| self.lock());
            match (set.digest.as_deref(), *set.omitted) {
                (Some(digest), true) => match kept.sets.get(digest) {
                    Some(tools) => {
                        *set.tools = Arc::clone(tools);
                        *set.omitted = false;
                    }
                    None => missing.push(i),
                },
                // Left out without naming the set: only the whole input will do.
                (None, true) => missing.push(i),
                (Some(digest), false) => {
                    if is_tool_set_digest(digest) && !kept.sets.contains_key(digest) {
                        kept.keep(digest.to_owned(), Arc::clone(set.tools));
                    }
                }
                (None, false) => {}
            }
        }
        missing
    }
}

impl Kept {
    fn keep(&mut self, digest: String, set: Arc<[ToolSpec]>) {
        while self.order.len() >= MAX_TOOL_SETS_LISTED {
            if let Some(oldest) = self.order.pop_front() {
                self.sets.remove(&oldest);
            }
        }
        self.order.push_back(digest.clone());
        self.sets.insert(digest, set);
        self.header = Arc::from(
            self.order
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(","),
        );
    }
}

#[cfg(test)]
#[path = "tool_sets_tests.rs"]
mod tests;
