//! The key layout and record codecs the embedded stores share: sled's trees and fjall's
//! keyspaces have the same names, keys and values, so a change here changes both.
//!
//! | tree / keyspace | key                                              | value                   |
//! |-----------------|--------------------------------------------------|-------------------------|
//! | `events`        | session id bytes ++ `0x00` ++ seq (u64 BE)       | the [`codec`] record    |
//! | `sessions`      | session id bytes                                 | msgpack [`SessionInfo`] |
//! | `sessions`      | session id bytes ++ `0x00` (a deleted session)   | msgpack [`Tombstone`]   |
//! | `tasks`         | session id bytes ++ `0x00` ++ scheduled seq (BE) | msgpack [`Task`]        |
//! | `queue`         | visible_at_ms (u64 BE) ++ task key               | empty                   |
//!
//! fjall keeps the queue in memory only, derived from the task records when it opens (see
//! `store/fjall.rs`); sled writes its `queue` tree in the same transactions as the tasks.
//!
//! The msgpack records are arrays of their fields in order ([`encode_meta`]); older stores'
//! records, maps of named fields, decode as well.
//!
//! Session ids pass [`check_session_id`](super::check_session_id), so they never contain
//! `0x00` and the separator keeps one session's keys from running into another's; the byte
//! order of the keys is the order of `(session id, seq)`, `TaskId` and
//! `(visible_at_ms, TaskId)`, so range scans give the orders the [`Store`](super::Store)
//! contract asks for. The next seq of a session is its `SessionInfo::events + 1`.
//!
//! A deleted session's record is replaced by its tombstone, under a key no session record can
//! have (ids never hold `0x00`), written in the same batch that removes its events: listings
//! skip it, and an append to its id finds it and is refused, so the id is never used again.
//!
//! Decoding errors name where the record was ("the sessions tree", "the tasks keyspace"): the
//! callers pass their engine's word for it.

use super::{SessionInfo, Task, TaskId};
use crate::codec;
use crate::error::{Error, Result};
use crate::event::EventEnvelope;
use std::ops::RangeInclusive;

/// The events, by session and seq.
pub(super) const EVENTS: &str = "events";
/// The session records, by session.
pub(super) const SESSIONS: &str = "sessions";
/// The task records, by task.
pub(super) const TASKS: &str = "tasks";
/// The task queue, by visibility time and task.
pub(super) const QUEUE: &str = "queue";

/// `session ++ 0x00 ++ n (BE)`: the key of an event (n = seq) or a task (n = scheduled seq).
pub(super) fn seq_key(session_id: &str, n: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(session_id.len() + 9);
    push_seq_key(&mut key, session_id, n);
    key
}

/// Writes [`seq_key`]`(session_id, n)` at the end of `key`.
fn push_seq_key(key: &mut Vec<u8>, session_id: &str, n: u64) {
    key.extend_from_slice(session_id.as_bytes());
    key.push(0);
    key.extend_from_slice(&n.to_be_bytes());
}

/// The key of a deleted session's tombstone in the sessions tree or keyspace.
pub(super) fn tombstone_key(session_id: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(session_id.len() + 1);
    key.extend_from_slice(session_id.as_bytes());
    key.push(0);
    key
}

/// Whether a key of the sessions tree or keyspace is a tombstone's, not a session record's.
pub(super) fn is_tombstone_key(key: &[u8]) -> bool {
    key.last() == Some(&0)
}

/// What a deleted session leaves: when it was deleted and how many events it had.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Tombstone {
    /// When the delete was made (epoch ms, the caller's clock).
    pub(super) deleted_at_ms: u64,
    /// The events it had.
    pub(super) events: u64,
}

/// The `SessionDeleted` error of an append to a deleted session.
pub(super) fn deleted(session_id: &str) -> Error {
    Error::SessionDeleted {
        session_id: session_id.to_owned(),
    }
}

/// The key of a task record.
pub(super) fn task_key(id: &TaskId) -> Vec<u8> {
    seq_key(&id.session_id, id.scheduled_seq)
}

/// The key of a queue entry: visibility time, then the task key.
pub(super) fn queue_key(visible_at_ms: u64, id: &TaskId) -> Vec<u8> {
    // One allocation of the exact size: a turn makes several of these per task.
    let mut key = Vec::with_capacity(8 + id.session_id.len() + 9);
    key.extend_from_slice(&visible_at_ms.to_be_bytes());
    push_seq_key(&mut key, &id.session_id, id.scheduled_seq);
    key
}

/// The visibility time at the start of a queue key.
pub(super) fn key_visible(key: &[u8]) -> Option<u64> {
    let head: [u8; 8] = key.get(..8)?.try_into().ok()?;
    Some(u64::from_be_bytes(head))
}

/// The seq at the end of an event key.
pub(super) fn key_seq(key: &[u8]) -> Option<u64> {
    let tail: [u8; 8] = key.get(key.len().checked_sub(8)?..)?.try_into().ok()?;
    Some(u64::from_be_bytes(tail))
}

/// Encodes a session, task or tombstone record (`what` names it in the error) as a msgpack
/// array of its fields in declaration order, without their names.
///
/// These records are rewritten with every append and lease, so their bytes are most of what
/// a turn writes besides its events: named fields made a task record about 150 bytes, 110 of
/// them field names, and a session record about 70. Records written with names before
/// (stores made before this layout) still decode: rmp-serde reads a struct from a map as well
/// as from an array. A field added later must go last and have a `#[serde(default)]`, so
/// that the shorter arrays already stored decode too.
pub(super) fn encode_meta<T: serde::Serialize>(what: &str, value: &T) -> Result<Vec<u8>> {
    // Room for a task or session record at once: grown from empty, a record of about a
    // hundred bytes took four reallocations.
    let mut bytes = Vec::with_capacity(META_CAPACITY);
    rmp_serde::encode::write(&mut bytes, value).map_err(|e| Error::Store {
        reason: format!("cannot encode {what}: {e}"),
    })?;
    Ok(bytes)
}

/// The bytes [`encode_meta`] reserves before it writes a record.
const META_CAPACITY: usize = 128;

/// Decodes a session record; `space` is the engine's word for where it was ("tree").
pub(super) fn decode_info(session_id: &str, bytes: &[u8], space: &str) -> Result<SessionInfo> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::Store {
        reason: format!("corrupt record of session {session_id:?} in the sessions {space}: {e}"),
    })
}

/// Decodes a task record; `space` is the engine's word for where it was ("tree").
pub(super) fn decode_task(what: &dyn std::fmt::Display, bytes: &[u8], space: &str) -> Result<Task> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::Store {
        reason: format!("corrupt record of task {what} in the tasks {space}: {e}"),
    })
}

/// The most events [`read_events`] makes room for before it has read them.
const READ_RESERVE: usize = 1 << 14;

/// Reads the events `from_seq..` (at most `limit`) of a session whose record says it has
/// `events`. `scan` gives the stored `(key, record)` pairs of a range of event keys, in order,
/// with the engine's read errors; a seq missing from them, or a record that does not decode,
/// is `CorruptRecord` at that seq.
pub(super) fn read_events<K, V, I>(
    session_id: &str,
    events: u64,
    from_seq: u64,
    limit: Option<usize>,
    scan: impl FnOnce(RangeInclusive<Vec<u8>>) -> I,
) -> Result<Vec<EventEnvelope>>
where
    K: AsRef<[u8]>,
    V: AsRef<[u8]> + Send,
    I: Iterator<Item = Result<(K, V)>>,
{
    let start = from_seq.max(1);
    let limit = limit.unwrap_or(usize::MAX);
    if limit == 0 || start > events {
        return Ok(Vec::new());
    }
    let count = usize::try_from(events - start + 1).unwrap_or(usize::MAX);
    let range = seq_key(session_id, start)..=seq_key(session_id, events);
    let threads = decode_threads();
    if count.min(limit) < PARALLEL_DECODE_RECORDS || threads < 2 {
        // Room for the whole range up front (no regrowing copies of a long history), but no
        // more than READ_RESERVE: the count comes from a stored record, which may be damaged.
        let mut records = Vec::with_capacity(count.min(limit).min(READ_RESERVE));
        let gap = scan_records(start, events, limit, scan(range), |record| {
            records.push(record)
        })?;
        let out = decode_chunk(session_id, start, &records)?;
        return with_gap(session_id, events, start, out, gap);
    }
    let batches = Batches::default();
    let (scanned, panicked) = std::thread::scope(|scope| {
        // Should the scan panic (inside the engine's iterator), the unwinding closes the
        // batches, so that the decoding threads end and the scope can return the panic
        // instead of waiting for them forever.
        let _close_on_unwind = CloseOnDrop(&batches);
        let workers: Vec<_> = (1..threads)
            .filter_map(|_| {
                let batches = &batches;
                std::thread::Builder::new()
                    .name("cairn-decode".into())
                    .spawn_scoped(scope, move || batches.decode(session_id, start))
                    .ok()
            })
            .collect();
        let mut offset = 0;
        let mut batch = Vec::with_capacity(DECODE_BATCH);
        let scanned = scan_records(start, events, limit, scan(range), |record| {
            batch.push(record);
            if batch.len() == DECODE_BATCH {
                let full = std::mem::replace(&mut batch, Vec::with_capacity(DECODE_BATCH));
                batches.push(offset, full);
                offset += DECODE_BATCH;
            }
        });
        if !batch.is_empty() {
            batches.push(offset, batch);
        }
        // After a read error nothing is decoded: the error is the answer.
        batches.close(scanned.is_err());
        // A thread that could not start leaves its batches to this one, which decodes the
        // rest too once its scan is done.
        batches.decode(session_id, start);
        let mut panicked = false;
        for worker in workers {
            panicked |= worker.join().is_err();
        }
        (scanned, panicked)
    });
    let gap = scanned?;
    if panicked {
        return Err(Error::Store {
            reason: format!(
                "decoding session {session_id:?} from seq {start}: a decoding thread panicked"
            ),
        });
    }
    // A record that does not decode comes before the gap, so its error is the one to give,
    // as when each record was decoded as it was read.
    let out = batches.into_events()?;
    with_gap(session_id, events, start, out, gap)
}

/// Reads `scan`'s records in seq order from `start`, giving each to `keep`, up to `limit` or
/// the first seq missing. `Ok(Some(next))` names a gap: the next seq stored after it, or
/// `None` when the range ended before `events`.
fn scan_records<K, V>(
    start: u64,
    events: u64,
    limit: usize,
    scan: impl Iterator<Item = Result<(K, V)>>,
    mut keep: impl FnMut(V),
) -> Result<Option<Option<u64>>>
where
    K: AsRef<[u8]>,
{
    let mut expected = start;
    let mut kept = 0usize;
    for item in scan {
        if kept >= limit {
            return Ok(None);
        }
        let (key, record) = item?;
        let seq = key_seq(key.as_ref()).unwrap_or(0);
        if seq != expected {
            return Ok(Some(Some(seq)));
        }
        keep(record);
        kept += 1;
        expected += 1;
    }
    // Events are written with their session record, so the range must hold all of them.
    if kept < limit && expected <= events {
        return Ok(Some(None));
    }
    Ok(None)
}

/// `out`, the events decoded from `start` up to a gap, or the gap's `CorruptRecord` when
/// there is one.
fn with_gap(
    session_id: &str,
    events: u64,
    start: u64,
    out: Vec<EventEnvelope>,
    gap: Option<Option<u64>>,
) -> Result<Vec<EventEnvelope>> {
    match gap {
        Some(next_stored) => Err(Error::CorruptRecord {
            session_id: session_id.to_owned(),
            seq: start + out.len() as u64,
            reason: missing_reason(next_stored, events),
        }),
        None => Ok(out),
    }
}

/// Records at least this many are decoded on more than one thread.
const PARALLEL_DECODE_RECORDS: usize = 4096;

/// Records handed to a decoding thread at a time.
const DECODE_BATCH: usize = 256;

/// The threads a long history is decoded on: the cores, counted once per process (counting
/// reads the cgroup's files).
fn decode_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Decodes `records`, the events of `session_id` from `first_seq` on, in order; the first
/// record that does not decode gives the error.
fn decode_chunk<V: AsRef<[u8]>>(
    session_id: &str,
    first_seq: u64,
    records: &[V],
) -> Result<Vec<EventEnvelope>> {
    (first_seq..)
        .zip(records)
        .map(|(seq, record)| codec::decode(session_id, seq, record.as_ref()))
        .collect()
}

/// A long history's records in batches, decoded by every thread that takes one while the
/// reading thread is still scanning the rest, then by the reading thread too. Decoding
/// (checksum, zstd, msgpack) is most of a cold read: a 1,000-turn session's 8,001 records
/// took about 15 ms on one core of a 2-core machine, and scanning them about half of that,
/// so decoding only once the scan was done left the scan's time in series.
struct Batches<V> {
    state: std::sync::Mutex<BatchState<V>>,
    ready: std::sync::Condvar,
}

struct BatchState<V> {
    /// Batches not taken yet, by their offset in the read.
    waiting: std::collections::VecDeque<(usize, Vec<V>)>,
    /// Whether the scan is over: no batch will come.
    closed: bool,
    /// Each batch's events, or its first record's error, by offset.
    decoded: Vec<(usize, Result<Vec<EventEnvelope>>)>,
}

impl<V> Default for Batches<V> {
    fn default() -> Self {
        Batches {
            state: std::sync::Mutex::new(BatchState {
                waiting: std::collections::VecDeque::new(),
                closed: false,
                decoded: Vec::new(),
            }),
            ready: std::sync::Condvar::new(),
        }
    }
}

impl<V: AsRef<[u8]>> Batches<V> {
    fn state(&self) -> std::sync::MutexGuard<'_, BatchState<V>> {
        // Decoding returns errors rather than panicking; a poisoned lock still holds whole
        // batches and results.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn push(&self, offset: usize, batch: Vec<V>) {
        self.state().waiting.push_back((offset, batch));
        self.ready.notify_one();
    }

    /// Ends the scan; with `discard`, the batches not taken are dropped undecoded.
    fn close(&self, discard: bool) {
        let mut state = self.state();
        state.closed = true;
        if discard {
            state.waiting.clear();
        }
        drop(state);
        self.ready.notify_all();
    }

    /// Takes batches and decodes them until the scan is over and none is left.
    fn decode(&self, session_id: &str, first_seq: u64) {
        let mut state = self.state();
        loop {
            if let Some((offset, batch)) = state.waiting.pop_front() {
                drop(state);
                let events = decode_chunk(session_id, first_seq + offset as u64, &batch);
                drop(batch);
                state = self.state();
                state.decoded.push((offset, events));
            } else if state.closed {
                return;
            } else {
                state = self
                    .ready
                    .wait(state)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
    }

    /// Every batch's events in order; the first record that did not decode gives the error.
    fn into_events(self) -> Result<Vec<EventEnvelope>> {
        let state = self
            .state
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut decoded = state.decoded;
        decoded.sort_unstable_by_key(|(offset, _)| *offset);
        let mut out = Vec::with_capacity(
            decoded
                .iter()
                .map(|(_, events)| events.as_ref().map_or(0, Vec::len))
                .sum(),
        );
        for (_, events) in decoded {
            out.extend(events?);
        }
        Ok(out)
    }
}

/// Closes [`Batches`] when dropped, undecoded batches dropped: ends the decoding threads
/// when the scan unwinds (after a normal close it changes nothing).
struct CloseOnDrop<'a, V: AsRef<[u8]>>(&'a Batches<V>);

impl<V: AsRef<[u8]>> Drop for CloseOnDrop<'_, V> {
    fn drop(&mut self) {
        self.0.close(true);
    }
}

/// The words of [`read_events`]'s `CorruptRecord` for a seq that is not stored at all: with
/// the next seq that is, or none up to the recorded count.
fn missing_reason(next_stored: Option<u64>, events: u64) -> String {
    match next_stored {
        Some(seq) => format!("{MISSING} (the next stored seq is {seq})"),
        None => format!("{MISSING} (the session records {events} events)"),
    }
}

const MISSING: &str = "missing from the store";

/// Whether a `CorruptRecord`'s reason says its seq is not stored at all (rather than stored
/// and unreadable), and if so the next seq that is stored (`None`: none up to the session's
/// recorded count). So a check can step over a gap, however long, at once.
pub(crate) fn missing_seq(reason: &str) -> Option<Option<u64>> {
    let rest = reason.strip_prefix(MISSING)?;
    if rest.starts_with(" (the session records ") {
        return Some(None);
    }
    let next = rest
        .strip_prefix(" (the next stored seq is ")?
        .strip_suffix(')')?;
    next.parse().ok().map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{NewTask, Overdue, SessionStatus, TaskFilter, TaskKind, DEFAULT_QUEUE};
    use cairn_ledger::JsonText;

    /// Keys and records in store order.
    type Stored = Vec<(Vec<u8>, Vec<u8>)>;

    #[test]
    fn a_queue_key_is_the_visibility_time_then_the_task_key() {
        let id = TaskId {
            session_id: "s-1".to_owned(),
            scheduled_seq: 0x0102,
        };
        let key = queue_key(0x0a0b, &id);
        assert_eq!(
            key,
            [
                &[0, 0, 0, 0, 0, 0, 0x0a, 0x0b][..],
                b"s-1\0",
                &[0, 0, 0, 0, 0, 0, 0x01, 0x02][..]
            ]
            .concat()
        );
        assert_eq!(key[8..], task_key(&id)[..]);
        assert_eq!(key_visible(&key), Some(0x0a0b));
        assert_eq!(key.capacity(), key.len());
    }

    /// `count` events of session `s`, and how a store holds them.
    fn stored_history(count: u64) -> (Vec<EventEnvelope>, Stored) {
        let events: Vec<EventEnvelope> = (1..=count)
            .map(|seq| {
                EventEnvelope::new(
                    "s",
                    seq,
                    seq,
                    crate::event::Event::UserMessage {
                        idempotency_key: None,
                        tool_choice: None,
                        turn: seq as u32,
                        text: format!("message {seq}"),
                        model: None,
                        media: Vec::new(),
                    },
                )
            })
            .collect();
        let stored = events
            .iter()
            .map(|e| (seq_key("s", e.seq), codec::encode(e).unwrap()))
            .collect();
        (events, stored)
    }

    fn read(
        stored: &[(Vec<u8>, Vec<u8>)],
        events: u64,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        read_events("s", events, from_seq, limit, |range| {
            stored
                .iter()
                .filter(move |(key, _)| range.contains(key))
                .map(|(k, v)| Ok((k.clone(), v.clone())))
        })
    }

    /// A history long enough to be decoded on several threads reads back whole and in order,
    /// from any seq and to any limit; the first record that does not decode is named, before
    /// a gap after it, and a gap alone is named as before.
    #[test]
    fn a_long_history_decodes_on_several_threads_as_on_one() {
        let count = PARALLEL_DECODE_RECORDS as u64 + 1_000;
        let (events, stored) = stored_history(count);
        assert_eq!(read(&stored, count, 1, None).unwrap(), events);
        assert_eq!(
            read(&stored, count, 700, Some(4_300)).unwrap(),
            events[699..4_999].to_vec()
        );
        assert_eq!(read(&stored, count, 4_000, None).unwrap(), events[3_999..]);

        let mut damaged = stored.clone();
        let last = damaged[4_600].1.len() - 1;
        damaged[4_600].1[last] ^= 0x40;
        damaged.remove(4_900);
        let corrupt_seq = |result: Result<Vec<EventEnvelope>>| match result {
            Err(Error::CorruptRecord { seq, reason, .. }) => (seq, reason),
            other => panic!("expected a corrupt record, got {other:?}"),
        };
        let (seq, reason) = corrupt_seq(read(&damaged, count, 1, None));
        assert_eq!(seq, 4_601, "{reason}");
        assert!(!reason.contains("missing from the store"), "{reason}");
        damaged[4_600] = stored[4_600].clone();
        let (seq, reason) = corrupt_seq(read(&damaged, count, 1, None));
        assert_eq!(seq, 4_901, "{reason}");
        assert!(
            reason.contains("missing from the store (the next stored seq is 4902)"),
            "{reason}"
        );
        let (seq, reason) = corrupt_seq(read(&stored, count + 3, 1, None));
        assert_eq!(seq, count + 1, "{reason}");
        assert!(
            reason.contains(&format!("(the session records {} events)", count + 3)),
            "{reason}"
        );
    }

    /// A read error in the middle of a long history's scan is the answer, whatever the
    /// decoding threads were doing with the batches before it.
    #[test]
    fn a_read_error_in_a_long_scan_is_the_answer() {
        let count = PARALLEL_DECODE_RECORDS as u64 + 1_000;
        let (_, stored) = stored_history(count);
        let result = read_events("s", count, 1, None, |_| {
            stored.iter().enumerate().map(|(i, (k, v))| {
                if i == 3_000 {
                    Err(Error::Store {
                        reason: "the disk said no".into(),
                    })
                } else {
                    Ok((k.clone(), v.clone()))
                }
            })
        });
        match result {
            Err(Error::Store { reason }) => assert_eq!(reason, "the disk said no"),
            other => panic!("expected the read error, got {other:?}"),
        }
    }

    /// A panic inside the engine's iterator in the middle of a long scan reaches the caller,
    /// instead of leaving the read waiting for decoding threads that wait for more batches.
    #[test]
    fn a_panic_in_a_long_scan_reaches_the_caller() {
        let count = PARALLEL_DECODE_RECORDS as u64 + 1_000;
        let (_, stored) = stored_history(count);
        let (answer, answered) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                read_events("s", count, 1, None, |_| {
                    stored.iter().enumerate().map(|(i, (k, v))| {
                        assert!(i != 3_000, "the engine's iterator broke");
                        Ok((k.clone(), v.clone()))
                    })
                })
            }));
            let _ = answer.send(read.is_err());
        });
        let panicked = answered
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the read hung after its scan panicked");
        assert!(panicked, "the scan's panic did not reach the caller");
    }

    /// A task record as stores wrote it before routing, deadlines, the holder flag and durable
    /// heartbeat details existed.
    #[derive(serde::Serialize)]
    struct OldTask {
        id: TaskId,
        kind: TaskKind,
        visible_at_ms: u64,
        lease_attempt: u32,
    }

    fn id(seq: u64) -> TaskId {
        TaskId {
            session_id: "old".to_owned(),
            scheduled_seq: seq,
        }
    }

    #[test]
    fn an_old_task_record_decodes_as_a_default_queue_task_for_any_worker_never_held() {
        let old = OldTask {
            id: id(7),
            kind: TaskKind::Tool,
            visible_at_ms: 5_000,
            lease_attempt: 2,
        };
        let bytes = rmp_serde::to_vec_named(&old).expect("encode the old shape");
        let task = decode_task(&"old/7", &bytes, "tree").expect("an old record must decode");
        assert_eq!(
            task,
            Task {
                id: id(7),
                kind: TaskKind::Tool,
                visible_at_ms: 5_000,
                lease_attempt: 2,
                queue: DEFAULT_QUEUE.to_owned(),
                target: String::new(),
                start_by_ms: None,
                held: false,
                heartbeat_details: None,
            }
        );
        // Any worker may lease it, whatever it declares.
        let picky = TaskFilter {
            queues: Some([DEFAULT_QUEUE.to_owned()].into()),
            tools: Some(Default::default()),
            providers: Some(Default::default()),
            ..TaskFilter::any()
        };
        assert!(picky.accepts(&task));
        // The lease an old process left is treated as released: once expired, the task is due
        // again (as before routing), never a lapsed lease or a missed start deadline.
        assert_eq!(task.overdue(4_999), None);
        assert_eq!(task.overdue(1_000_000), None);
        let mut held = task.clone();
        held.held = true;
        assert_eq!(held.overdue(5_000), Some(Overdue::LeaseLapsed));
    }

    #[test]
    fn a_task_record_round_trips_with_every_field() {
        let task = Task {
            lease_attempt: 3,
            held: true,
            heartbeat_details: Some(JsonText::parse(r#"{"rows":12}"#).expect("json")),
            ..Task::queued(&NewTask {
                queue: "gpu".to_owned(),
                target: "anthropic".to_owned(),
                start_by_ms: Some(9_000),
                ..NewTask::new(id(3), TaskKind::Model, 8_000)
            })
        };
        let bytes = encode_meta("task record", &task).expect("encode");
        assert_eq!(decode_task(&"old/3", &bytes, "tree").expect("decode"), task);
        let unrouted = Task::queued(&NewTask::new(id(4), TaskKind::Tool, 0));
        let bytes = encode_meta("task record", &unrouted).expect("encode");
        assert_eq!(
            decode_task(&"old/4", &bytes, "tree").expect("decode"),
            unrouted
        );
    }

    #[test]
    fn records_are_arrays_of_their_fields_and_named_ones_from_older_stores_decode_too() {
        let task = Task {
            lease_attempt: 1,
            held: true,
            ..Task::queued(&NewTask::new(id(12), TaskKind::Model, 1_764_000_000_000))
        };
        let compact = encode_meta("task record", &task).expect("encode");
        // A fixarray of the nine fields, in declaration order, with no field names.
        assert_eq!(compact[0], 0x90 | 9, "{compact:02x?}");
        assert_eq!(&compact[1..3], &[0x92, 0xa3], "the id: [session, seq]");
        let named = rmp_serde::to_vec_named(&task).expect("the older layout");
        assert!(
            compact.len() * 3 < named.len(),
            "{} bytes against {} named",
            compact.len(),
            named.len()
        );
        assert_eq!(
            decode_task(&"old/12", &compact, "tree").expect("decode"),
            task
        );
        assert_eq!(
            decode_task(&"old/12", &named, "tree").expect("decode"),
            task
        );

        let info = SessionInfo {
            session_id: "old".to_owned(),
            status: SessionStatus::Running,
            events: 300,
            updated_at_ms: 1_764_000_000_000,
        };
        let compact = encode_meta("session record", &info).expect("encode");
        assert_eq!(
            compact,
            [
                &[0x94, 0xa3][..],
                b"old",
                &[0xa7],
                b"running",
                &[0xcd, 0x01, 0x2c, 0xcf],
                &1_764_000_000_000u64.to_be_bytes(),
            ]
            .concat()
        );
        let named = rmp_serde::to_vec_named(&info).expect("the older layout");
        assert_eq!(decode_info("old", &compact, "tree").expect("decode"), info);
        assert_eq!(decode_info("old", &named, "tree").expect("decode"), info);
        // A damaged record is an error naming the session, not a panic.
        let error = decode_info("old", &compact[..compact.len() - 3], "tree").unwrap_err();
        assert!(
            error
                .to_string()
                .contains("session \"old\" in the sessions tree"),
            "{error}"
        );
    }
}
