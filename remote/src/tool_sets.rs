//! The tool sets a remote worker keeps ([`TOOL_SETS_HEADER`]): the sets its model tasks
//! brought, by the digest the server named them with; the header that lists them on the lease
//! and report requests; and a model task's tools, left out by the server, filled in again.
//!
//! The sets kept are bounded: the header lists the [`MAX_TOOL_SETS_LISTED`] used last, and
//! twice as many are kept, the one used longest ago let go first. A set listed in a request
//! is then let go before its answer comes only if more new sets came meanwhile than the
//! header lists; its task is then fetched whole again (`POST /v1/worker/input`, which the
//! caller does).

use cairn_ledger::ToolSpec;
use cairn_runtime::wire::{is_tool_set_digest, MAX_TOOL_SETS_LISTED};
use cairn_runtime::LeasedTask;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// The sets kept at most: twice those listed, so that a set listed in a request is still
/// kept when its answer comes.
const KEPT_SETS: usize = 2 * MAX_TOOL_SETS_LISTED;

/// The tool sets this worker keeps.
pub(crate) struct ToolSetCache {
    kept: Mutex<Kept>,
}

struct Kept {
    sets: HashMap<String, Arc<[ToolSpec]>>,
    /// The digests in the order their sets were last used (came or filled a task in), the
    /// longest ago first.
    order: VecDeque<String>,
    /// The header's value listing those used last, made again when they change.
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

    /// The value of the header: the digests of the sets used last, comma-separated.
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
                        kept.used(digest);
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
        while self.order.len() >= KEPT_SETS {
            if let Some(oldest) = self.order.pop_front() {
                self.sets.remove(&oldest);
            }
        }
        self.order.push_back(digest.clone());
        self.sets.insert(digest, set);
        self.list();
    }

    /// `digest`'s set was used: it goes last in the order (unless it is there already).
    fn used(&mut self, digest: &str) {
        if self.order.back().is_some_and(|last| last == digest) {
            return;
        }
        if let Some(at) = self.order.iter().position(|d| d == digest) {
            if let Some(moved) = self.order.remove(at) {
                self.order.push_back(moved);
                self.list();
            }
        }
    }

    /// Makes the header again: the sets used last.
    fn list(&mut self) {
        let skip = self.order.len().saturating_sub(MAX_TOOL_SETS_LISTED);
        self.header = Arc::from(
            self.order
                .iter()
                .skip(skip)
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(","),
        );
    }
}

#[cfg(test)]
#[path = "tool_sets_tests.rs"]
mod tests;
