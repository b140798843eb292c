//! The transcripts a remote worker keeps ([`TRANSCRIPTS_HEADER`]): the last transcript each
//! session's model tasks brought, by its lineage; the header that lists them on the lease and
//! report requests; and a model task's transcript, its first messages left out by the
//! server, made whole again.
//!
//! Only transcripts of at least [`MIN_KEPT_BYTES`] are kept, so a worker of short sessions
//! lists nothing. The kept are bounded, in number (twice the [`MAX_TRANSCRIPTS_LISTED`] the
//! header lists, the used last) and in bytes ([`KEPT_BYTES`]), the one used longest ago let
//! go first. A transcript listed in a request and let go before its answer comes costs its
//! task a fetch of the input whole (`POST /v1/worker/input`, which the caller does).
//!
//! A transcript is made whole in place when this worker holds the one it kept alone (its
//! last call of the session has ended): the messages that came are pushed onto it, and its
//! earlier messages are neither copied nor parsed again.

use cairn_ledger::{Message, Transcript};
use cairn_runtime::wire::{KeptTranscript, MAX_TRANSCRIPTS_LISTED};
use cairn_runtime::LeasedTask;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// The smallest transcript kept (`Transcript::heap_bytes`): a smaller one costs its header
/// item more than leaving its messages out saves.
pub(crate) const MIN_KEPT_BYTES: usize = 8 * 1024;
/// The bytes of the transcripts kept at most (`Transcript::heap_bytes`).
pub(crate) const KEPT_BYTES: usize = 64 * 1024 * 1024;
/// The transcripts kept at most: twice those listed, so that one listed in a request is
/// still kept when its answer comes.
const KEPT_TRANSCRIPTS: usize = 2 * MAX_TRANSCRIPTS_LISTED;

/// The transcripts this worker keeps.
#[derive(Default)]
pub(crate) struct TranscriptCache {
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    by_session: HashMap<String, Held>,
    /// The sessions in the order their transcripts were last used, the longest ago first.
    order: VecDeque<String>,
    /// The bytes of those kept.
    bytes: usize,
    /// The header's value listing those used last, made again when they change.
    header: Arc<str>,
}

struct Held {
    lineage: u64,
    transcript: Arc<Transcript>,
    bytes: usize,
}

impl TranscriptCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The value of the header: the transcripts used last, comma-separated.
    pub(crate) fn header(&self) -> Arc<str> {
        Arc::clone(&self.lock().header)
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
        let held = self.by_session.remove(session_id)?;
        self.bytes -= held.bytes;
        Some((held.transcript, held.bytes))
    }

    /// Keeps `transcript` (of `bytes`) as `session_id`'s, in place of any before, if it is
    /// large enough; lets go of those used longest ago past the bounds.
    fn keep(&mut self, session_id: &str, lineage: u64, transcript: Arc<Transcript>, bytes: usize) {
        let large = (MIN_KEPT_BYTES..=KEPT_BYTES).contains(&bytes);
        if let Some(old) = self.by_session.remove(session_id) {
            self.bytes -= old.bytes;
        }
        // Still in the order when `take` took it out.
        match self.order.iter().position(|s| s == session_id) {
            Some(at) => {
                self.order.remove(at);
            }
            // Nothing kept of it before, nothing now: the header stands.
            None if !large => return,
            None => {}
        }
        if large {
            while self.order.len() >= KEPT_TRANSCRIPTS || self.bytes + bytes > KEPT_BYTES {
                let Some(oldest) = self.order.pop_front() else {
                    break;
                };
                if let Some(gone) = self.by_session.remove(&oldest) {
                    self.bytes -= gone.bytes;
                }
            }
            self.order.push_back(session_id.to_owned());
            self.by_session.insert(
                session_id.to_owned(),
                Held {
                    lineage,
                    transcript,
                    bytes,
                },
            );
            self.bytes += bytes;
        }
        self.list();
    }

    /// Makes the header again: the transcripts used last.
    fn list(&mut self) {
        let skip = self.order.len().saturating_sub(MAX_TRANSCRIPTS_LISTED);
        let items: Vec<String> = self
            .order
            .iter()
            .skip(skip)
            .filter_map(|session_id| {
                let held = self.by_session.get(session_id)?;
                Some(
                    KeptTranscript {
                        session_id: session_id.clone(),
                        lineage: held.lineage,
                        messages: u32::try_from(held.transcript.messages.len()).ok()?,
                    }
                    .to_string(),
                )
            })
            .collect();
        self.header = Arc::from(items.join(","));
    }
}

#[cfg(test)]
#[path = "transcripts_tests.rs"]
mod tests;
