//! The transcripts a remote worker keeps ([`TRANSCRIPTS_HEADER`]): the last transcript each
//! session's model tasks brought, by its lineage; the header that lists them on the lease and
//! report requests; and a model task's transcript, its first messages left out by the
//! server, made whole again.
//!
//! Only transcripts of at least [`MIN_KEPT_BYTES`] are kept, so a worker of short sessions
//! lists nothing. The kept are bounded, in number ([`KEPT_TRANSCRIPTS`]) and in bytes
//! ([`KEPT_BYTES`]), the one used longest ago let go first. A request lists the
//! [`MAX_TRANSCRIPTS_LISTED`] used last; a report lists its own session's first, since what
//! it leases is first of all that session's next task. A transcript listed in a request and
//! let go before its answer comes costs its task a fetch of the input whole (`POST
//! /v1/worker/input`, which the caller does).
//!
//! A transcript is made whole in place when this worker holds the one it kept alone (its
//! last call of the session has ended): the messages that came are pushed onto it, and its
//! earlier messages are neither copied nor parsed again.

use cairn_ledger::{Message, Transcript};
use cairn_runtime::wire::{KeptTranscript, MAX_TRANSCRIPTS_LISTED};
use cairn_runtime::LeasedTask;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// The smallest transcript kept (`Transcript::heap_bytes`): a smaller one costs its header
/// item more than leaving its messages out saves.
pub(crate) const MIN_KEPT_BYTES: usize = 8 * 1024;
/// The bytes of the transcripts kept at most (`Transcript::heap_bytes`).
pub(crate) const KEPT_BYTES: usize = 64 * 1024 * 1024;
/// The transcripts kept at most. Far more than a lease request lists, so that one listed is
/// still kept when its answer comes, and so that a report, which lists its own session's,
/// finds it kept with as many sessions in flight.
const KEPT_TRANSCRIPTS: usize = 16 * MAX_TRANSCRIPTS_LISTED;

/// The transcripts this worker keeps.
#[derive(Default)]
pub(crate) struct TranscriptCache {
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    by_session: HashMap<String, Held>,
    /// The sessions by when their transcripts were last used (a count of uses), the longest
    /// ago first.
    order: BTreeMap<u64, String>,
    /// Uses so far.
    uses: u64,
    /// The bytes of those kept.
    bytes: usize,
    /// The header's value listing those used last, made again when asked for after they
    /// changed (`None`).
    header: Option<Arc<str>>,
    /// The oldest use the header lists: a transcript last used since is listed.
    listed_from: u64,
}

struct Held {
    lineage: u64,
    transcript: Arc<Transcript>,
    bytes: usize,
    /// When it was last used: its key in `order`.
    used: u64,
}

impl TranscriptCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The value of the header: the transcripts used last, comma-separated.
    pub(crate) fn header(&self) -> Arc<str> {
        let mut kept = self.lock();
        kept.header()
    }

    /// The value of the header for a report request: the transcripts kept of `sessions`
    /// (those of the reports' leases), then the used last. What a report leases is its own
    /// session's next task first, whose transcript, with more sessions in flight than the
    /// header lists, may not be among the used last; but a store may lease other sessions'
    /// due tasks with it too.
    pub(crate) fn header_for(&self, sessions: &[&str]) -> Arc<str> {
        let mut kept = self.lock();
        let last = kept.header();
        let mut own: Vec<String> = Vec::new();
        for session_id in sessions {
            let Some(held) = kept.by_session.get(*session_id) else {
                continue;
            };
            if held.used >= kept.listed_from {
                continue; // listed already
            }
            if let Some(item) = kept.item(session_id).map(|item| item.to_string()) {
                if !own.contains(&item) {
                    own.push(item);
                }
            }
        }
        if own.is_empty() {
            return last;
        }
        own.truncate(MAX_TRANSCRIPTS_LISTED);
        let listed = if last.is_empty() {
            0
        } else {
            last.split(',').count()
        };
        // The oldest of the used last give way, so that at most as many are listed as allowed.
        let skip = (listed + own.len()).saturating_sub(MAX_TRANSCRIPTS_LISTED);
        own.extend(
            last.split(',')
                .filter(|item| !item.is_empty())
                .skip(skip)
                .map(str::to_owned),
        );
        Arc::from(own.join(","))
    }

    /// How many transcripts are kept, and their bytes.
    #[cfg(test)]
    pub(crate) fn held(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.by_session.len(), kept.bytes)
    }

    /// Makes whole the transcripts the server shortened in the model tasks of `tasks`, and
    /// keeps each session's transcript as its last task brought it. Answers the positions of
    /// the tasks whose left-out messages are not kept (any more): their input is to be
    /// fetched whole.
    pub(crate) fn fill(&self, tasks: &mut [LeasedTask]) -> Vec<usize> {
        let mut missing = Vec::new();
        for (i, task) in tasks.iter_mut().enumerate() {
            let Some(fields) = task.input.transcript_mut() else {
                continue;
            };
            let Some(lineage) = *fields.lineage else {
                continue;
            };
            let left_out = *fields.left_out as usize;
            let mut kept = self.lock();
            if left_out == 0 {
                let bytes = fields.transcript.heap_bytes();
                kept.keep(
                    fields.session_id,
                    lineage,
                    Arc::clone(fields.transcript),
                    bytes,
                );
                continue;
            }
            let Some((mut whole, bytes)) = kept.take(fields.session_id, lineage, left_out) else {
                missing.push(i);
                continue;
            };
            let came = std::mem::take(&mut Arc::make_mut(fields.transcript).messages);
            let bytes_came: usize = came.iter().map(Message::heap_bytes).sum();
            let bytes = if whole.messages.len() == left_out {
                // This worker's last call of the session has ended: no copy.
                Arc::make_mut(&mut whole).messages.extend(came);
                bytes + bytes_came
            } else {
                // A later task of the session came meanwhile: its first messages are these.
                let mut messages = whole.messages[..left_out].to_vec();
                messages.extend(came);
                whole = Arc::new(Transcript { messages });
                whole.heap_bytes()
            };
            *fields.transcript = Arc::clone(&whole);
            *fields.left_out = 0;
            kept.keep(fields.session_id, lineage, whole, bytes);
        }
        missing
    }
}

impl Kept {
    /// The transcript kept of `session_id`, taken out, when it is of `lineage` and holds at
    /// least `left_out` messages (its first ones are those left out: a lineage only grows).
    /// With its bytes.
    fn take(
        &mut self,
        session_id: &str,
        lineage: u64,
        left_out: usize,
    ) -> Option<(Arc<Transcript>, usize)> {
        let held = self.by_session.get(session_id)?;
        if held.lineage != lineage || held.transcript.messages.len() < left_out {
            return None;
        }
        let held = self.remove(session_id)?;
        Some((held.transcript, held.bytes))
    }

    fn remove(&mut self, session_id: &str) -> Option<Held> {
        let held = self.by_session.remove(session_id)?;
        self.order.remove(&held.used);
        self.bytes -= held.bytes;
        self.header = None;
        Some(held)
    }

    /// Keeps `transcript` (of `bytes`) as `session_id`'s, in place of any before, if it is
    /// large enough; lets go of those used longest ago past the bounds.
    fn keep(&mut self, session_id: &str, lineage: u64, transcript: Arc<Transcript>, bytes: usize) {
        self.remove(session_id);
        if !(MIN_KEPT_BYTES..=KEPT_BYTES).contains(&bytes) {
            return;
        }
        while self.by_session.len() >= KEPT_TRANSCRIPTS || self.bytes + bytes > KEPT_BYTES {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.remove(&oldest);
        }
        self.uses += 1;
        self.order.insert(self.uses, session_id.to_owned());
        self.by_session.insert(
            session_id.to_owned(),
            Held {
                lineage,
                transcript,
                bytes,
                used: self.uses,
            },
        );
        self.bytes += bytes;
        self.header = None;
    }

    /// The header's item for `session_id`'s transcript, if one is kept.
    fn item(&self, session_id: &str) -> Option<KeptTranscript> {
        let held = self.by_session.get(session_id)?;
        Some(KeptTranscript {
            session_id: session_id.to_owned(),
            lineage: held.lineage,
            messages: u32::try_from(held.transcript.messages.len()).ok()?,
        })
    }

    /// The header's value listing the transcripts used last, the one used last at the end,
    /// made again if they changed since.
    fn header(&mut self) -> Arc<str> {
        if let Some(header) = &self.header {
            return Arc::clone(header);
        }
        let listed: Vec<(u64, &String)> = self
            .order
            .iter()
            .rev()
            .take(MAX_TRANSCRIPTS_LISTED)
            .map(|(used, session_id)| (*used, session_id))
            .collect();
        self.listed_from = listed.last().map_or(u64::MAX, |(used, _)| *used);
        let items: Vec<String> = listed
            .iter()
            .rev()
            .filter_map(|(_, session_id)| Some(self.item(session_id)?.to_string()))
            .collect();
        let header: Arc<str> = Arc::from(items.join(","));
        self.header = Some(Arc::clone(&header));
        header
    }
}

#[cfg(test)]
#[path = "transcripts_tests.rs"]
mod tests;
