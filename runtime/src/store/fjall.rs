//! The fjall store: an embedded, durable backend on fjall 3 (an LSM tree with a journal), beside
//! the sled one. Both pass the same conformance suite; switching engines is switching the type
//! (`FjallStore::open` for `SledStore::open`), not the data: each reads only its own files.
//!
//! # Layout
//!
//! One fjall database per store directory, with four keyspaces, `events`, `sessions`, `tasks`
//! and `queue`, laid out exactly like sled's trees. The layout (keys, values, and why their byte
//! order gives the orders the [`Store`] contract asks for) and the record codecs are shared with
//! the sled store and described where they live, in the `keys` module (`store/keys.rs`). The
//! next seq of a session is its `SessionInfo::events + 1`.
//!
//! # Writes: one writer thread, group commit, one write batch, one persist
//!
//! Every write (append, lease, lease extension, release) is prepared on the caller's task
//! (validation, encoding) and run by the store's writer: on the caller's thread when the
//! writer is idle and nothing is queued, else on the writer thread, the caller awaiting a
//! `tokio::sync::oneshot` for the answer. (That queue, the choice of thread, its batching,
//! the held answers and the refusal after a failed persist are shared with the sled store, in
//! the `write_queue` module, `store/write_queue.rs`.) The writer thread
//! takes every write queued so far (a batch of at most [`MAX_BATCH`]) and applies them in order
//! to an in-memory overlay of the batch's changes, each write reading through the overlay, so
//! it sees the writes before it. Each write still stands alone: an append's seq check
//! (`Conflict`), its fencing checks of `complete` and `drop_if_unchanged` (`LeaseLost`) and
//! every read of a record it replaces come before it stages anything, and its changes reach
//! the overlay together, only once it was accepted; a rejected write is answered at once and
//! leaves nothing behind.
//! Leasing scans the queue merged with the overlay; as the only writer, the thread sees a queue
//! nothing else changes.
//!
//! The queue is kept in memory only (a set of its keys, `visible_at_ms ++ task key`), never
//! written: every task record holds its `visible_at_ms`, so the task records are the queue's
//! durable truth and opening the store derives the set from them. The writer changes the set
//! after each commit. Scanning a queue keyspace instead was most of the store's CPU (an LSM
//! tree keeps a deleted key as a tombstone until a compaction drops it, and every lease and
//! completion deletes queue keys, so a scan from the start walked every task done since the
//! last compaction), and writing one cost three or four journal items per task, about 47
//! bytes each: a third of a turn's journal items and an eighth of its bytes. Stores made
//! before kept the queue in the `queue` keyspace too; this store no longer reads it or
//! writes it, and the entries an older version left there stay, unread.
//!
//! Then the whole overlay goes to fjall as one [`fjall::OwnedWriteBatch`] over the
//! keyspaces (one journal record, atomic: after a crash all of it or none of it is there),
//! and one `persist(PersistMode::SyncData)` makes it durable; only then are the batch's
//! writers answered. Writes that arrive meanwhile form the next batch, so N concurrent appends
//! cost about one fdatasync, not N. Nothing is persisted per event, and no history is re-read:
//! an append reads one session record and the task records it touches.
//!
//! The writer also keeps every live task record in memory, as committed, read at open with the
//! queue: as the only writer it knows them, so an append's check of the task it completes, a
//! lease and a release read no memtable. Live tasks are the work in flight, so it holds few
//! records. Reading them from fjall's memtable instead (a skiplist search past every superseded
//! version and tombstone since the last flush) was 16 reads per turn of one session, and
//! keeping them cut the instructions of a turn by about 6% (callgrind); runs of the builds
//! before and after in turn did not separate in turns/s from the machine's noise. For the same
//! reason it keeps the session records it committed last (a bounded map, emptied when full):
//! an append reads its session's record, and a session in a turn appends again within
//! milliseconds (a turn of one session: 22k instructions of memtable reads, 12k with them).
//!
//! On the writer thread the persist runs on a second thread, `cairn-fjall-sync`, which then
//! answers the batch, while the writer thread already applies the writes that came meanwhile
//! to a new overlay (reads, checks, encoding: about half of a batch's work). The next batch
//! waits for that persist before it commits (fjall's persist holds the journal through its
//! fdatasync anyway) and takes the writes that came during the wait too, so batches are as
//! large as without the overlap; after a failed persist it is refused, never committed. So
//! answers still follow a persist that began after their commit, and commits stay in order.
//! A lone write committed on its caller's thread waits for a persist in flight, then persists
//! itself. Measured (`cairn bench --engine fjall --seconds 3`, builds in turn, eight rounds
//! on a disk whose speed varied): 16 sessions 0.86–1.21× the turns/s (median 1.06×), 128
//! sessions 0.82–1.51× (median about 1.2×).
//!
//! Reads run on the caller's thread, each on a fjall snapshot, which shows whole write batches
//! only (fjall's plain `Keyspace::get`/`range` read at the newest sequence number and could see
//! a batch half applied to the memtables). A read can see a batch whose persist is still
//! running; persists are ordered, so if the process dies first, that batch and everything after
//! it are lost together, and the readers that saw it died with the process.
//!
//! The thread stops, after answering its last batch, when the store is dropped, and the drop
//! joins it.
//!
//! # Durability (what fjall 3.1 does, read in its source)
//!
//! A write is answered `Ok` only once it survives a power loss, not only a process crash
//! (leases too: a fencing token handed out must not be handed out again after a restart),
//! with one exception. A lease for a worker of this process
//! ([`Store::lease_tasks_in_process`]) is answered once committed, and the next sync carries
//! it to the disk: a crash before that takes its holder down with it, and the log is
//! written in order, so no durable record can name a lease that was lost. That takes one
//! sync per lease off a turn's path. It holds only for a lease of tasks durable before its
//! batch: one that takes a task an append before it in the batch queued would let it run
//! before the event that scheduled it is on disk, so such a lease is answered with the batch's
//! other writes, once their persist succeeds (with its failure when it fails). A batch of
//! in-process leases alone is not persisted at all. (A lone write on its caller's thread is a
//! batch of one, so there a lease never waits.)
//!
//! * Every write batch is one journal record (start marker, items, end marker with an xxh3
//!   checksum and a magic trailer) appended to the active journal file `<n>.jnl` through an
//!   8 KiB buffer. The database is opened with `manual_journal_persist`, so a commit does not
//!   even flush that buffer: `Database::persist(SyncData)` writes the buffer out and calls
//!   `fdatasync` on the journal. That is the one sync per batch. (A lone write committed on
//!   its caller's thread, persisted right after, writes its record out at the commit and
//!   starts the disk's write of it there, before fjall's memtable inserts: patch 4 in
//!   `vendor/README.md`. The fdatasync still follows before any answer.)
//! * fdatasync is enough for the journal: fjall creates each journal preallocated to 64 MiB
//!   (`set_len` then `sync_all`, then an fsync of the directory), and fdatasync persists a size
//!   change when the file does grow (past 64 MiB). After recovery has cut a reopened store's
//!   journal at its last whole batch, the patched fjall this store builds on
//!   (`vendor/README.md`) preallocates the file again and writes on inside it, instead of
//!   appending, so that an fdatasync there writes data only, as in a new journal. It also
//!   writes zeros up to 64 KiB ahead of the journal's end, so that a sync seldom allocates
//!   a block of the hole (which would make it write the inode's block map too).
//! * Everything else fjall writes in the background it syncs itself: a memtable flush or a
//!   compaction writes a table file, `sync_all`s it and fsyncs `tables/`; the tree's version
//!   file is written, `sync_all`ed, its directory fsynced, and the `current` pointer replaced
//!   atomically (temporary file, fsync, rename, fsync of the directory). Journal rotation
//!   `sync_all`s the old journal and fsyncs the directory after creating the new one. Old
//!   journals are deleted only once every keyspace has flushed past them; a deletion lost to a
//!   power loss just replays data fjall then skips by sequence number.
//! * What fjall leaves out: creating a database fsyncs the store directory and `keyspaces/`,
//!   but creating a keyspace fsyncs only the keyspace's own directories, not its entry in
//!   `keyspaces/`; and nothing fsyncs the parents of a store directory it created. So after
//!   opening, this store fsyncs `keyspaces/`, the store directory and the parents of the
//!   directories it created.
//!
//! If a commit or a persist fails, every write of that batch gets `Error::Store`, and the store
//! refuses further writes until it is reopened: after a failed fsync the kernel may have dropped
//! the dirty pages, so a later fsync that succeeds would prove nothing. (fjall poisons its
//! database on such a failure too and refuses writes with `Poisoned`.)
//!
//! # Recovery, and what it does to damaged files
//!
//! Opening replays the journals (the active one and any sealed ones not yet flushed) into
//! memtables, and **modifies them**: fjall reads journal entries until one does not decode (an
//! unknown tag, a bad end-marker trailer, a short read, a value that does not decompress) and
//! then truncates the file there (`set_len` + `sync_all`), without an error; a last batch
//! without its end marker is cut off the same way. That is right for a torn write (the
//! preallocated zeros after the last write read as an unknown tag), but a flipped bit in a
//! marker, a tag or a length inside older data looks the same and cuts off everything after it,
//! acknowledged batches included. A batch whose entries all decode but whose checksum does not
//! match (a flipped bit in a key or value) fails the open instead
//! (`JournalRecovery(ChecksumMismatch)`), as does a batch with the wrong number of items; such a
//! store does not open until the journal is repaired by hand. (A power loss during a persist can
//! leave a batch that way too, if the device wrote its end marker but not a page inside one
//! of its values; fjall does not tell that unacknowledged tail from damage.) Table files carry block checksums
//! that make a damaged block a read error. The journal-damage test below pins these cases down.
//! This store does not detect a silently truncated journal (a per-session high-water mark
//! around every store is being built separately).
//!
//! # Bounded journal
//!
//! fjall rotates the active journal once it is past 64 MB (hard-coded) at the next memtable
//! flush, and deletes sealed journals once every keyspace has flushed past them. A keyspace that
//! is written rarely (`sessions` and `queue` hold small records) would take long to fill its
//! memtable and so pin old journals; `max_journaling_size` is the bound past which fjall flushes
//! such stragglers. This store sets it to [`MAX_JOURNAL_BYTES`], 64 MiB, the least fjall
//! accepts (the default is 512 MiB), so journals stay at about one active plus at most one
//! sealed journal, and a reopen replays at most that much. Memtables are capped at
//! [`MEMTABLE_BYTES`] for the events and [`SMALL_MEMTABLE_BYTES`] for the other keyspaces (the
//! default is 64 MiB) and the block cache at
//! [`CACHE_BYTES`], which bounds memory and makes the
//! busy `events` keyspace flush several times per journal. fjall's background flushes and
//! compactions stay on (its worker threads). When they fall behind (four sealed memtables
//! waiting in a keyspace, or twenty runs in its level 0), fjall stalls the commit, which here
//! means the writer thread and so every write: backpressure rather than unbounded memory.

use super::files::{
    check_store_dir, create_store_dir, open_error, panic_message, sync_dir_described,
};
use super::keys::{
    decode_info, decode_task, deleted, encode_meta, is_tombstone_key, key_seq, key_visible,
    queue_key, read_events, seq_key, task_key, tombstone_key, Tombstone, EVENTS, QUEUE, SESSIONS,
    TASKS,
};
use super::memory::{lease_current, released_visibility};
pub use super::write_queue::MAX_BATCH;
use super::write_queue::{
    Engine, LoneWrites, Pending, PreparedAppend, ProcessBatch, Shared, Write, WriteQueue,
};
use super::{
    check_deletable, check_session_id, unknown_session, AppendRequest, Lease, LeaseRequest,
    SessionInfo, Store, SyncTimes, Task, TaskFence, TaskFilter, TaskId,
};
use crate::error::{Error, Result};
use crate::event::EventEnvelope;
use async_trait::async_trait;
use cairn_ledger::JsonText;
use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode, Readable};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::ops::Bound;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::oneshot;

/// How error texts name this engine and its sync.
const ENGINE: Engine = Engine {
    name: "fjall",
    sync: "persist",
};
/// What error texts call a part of the database.
const SPACE: &str = "keyspace";
/// The file fjall writes first in a database directory.
const VERSION_FILE: &str = "version";
/// fjall's `max_journaling_size`: the least it accepts (see the module docs).
pub const MAX_JOURNAL_BYTES: u64 = 64 * 1024 * 1024;
/// The events keyspace's memtable is flushed to a table file past this size (fjall's default
/// is 64 MiB). Applies when a keyspace is created; fjall keeps the setting in the database.
/// Memtables (the active one and the sealed ones waiting for their flush) are most of the
/// store's resident memory with many parked sessions, but 4 MiB ones for the events ran
/// 0.72× the turns/s at 128 sessions in flight (more flushes and compactions), so the events'
/// stay at 16 MiB.
pub const MEMTABLE_BYTES: u64 = 16 * 1024 * 1024;
/// The memtable size of the other keyspaces (sessions, tasks, queue). Their records are small
/// and short-lived (a task is written, leased and deleted within a turn), so a memtable of
/// them is mostly superseded versions and tombstones: 16 MiB of them held about 40 MiB of the
/// RSS of 100,000 parked sessions, and 4 MiB ones cost no measurable turns/s at 128 sessions.
pub const SMALL_MEMTABLE_BYTES: u64 = 4 * 1024 * 1024;
/// The memtable size a keyspace is created with.
fn memtable_bytes(keyspace: &str) -> u64 {
    if keyspace == EVENTS {
        MEMTABLE_BYTES
    } else {
        SMALL_MEMTABLE_BYTES
    }
}

/// fjall's block cache (its default is 32 MiB). The engine caches the states of running
/// sessions, so the store's reads are mostly of events just written (in the memtables) or of
/// a parked session's history when its next turn starts.
pub const CACHE_BYTES: u64 = 8 * 1024 * 1024;

/// The database and its keyspaces.
#[derive(Clone)]
struct Handles {
    db: Database,
    events: Keyspace,
    sessions: Keyspace,
    tasks: Keyspace,
    queue: Keyspace,
}

/// A keyspace, to index a batch's overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ks {
    Events = 0,
    Sessions = 1,
    Tasks = 2,
    Queue = 3,
}

impl Handles {
    fn keyspace(&self, ks: Ks) -> &Keyspace {
        match ks {
            Ks::Events => &self.events,
            Ks::Sessions => &self.sessions,
            Ks::Tasks => &self.tasks,
            Ks::Queue => &self.queue,
        }
    }
}

/// The queue keyspace's keys, in memory (see the module docs): what is committed to it.
type QueueIndex = Arc<RwLock<BTreeSet<Vec<u8>>>>;

/// A map of store keys, which the writer reads or changes on every append. Hashed with
/// foldhash (seeded per map, as hashbrown's default): with std's SipHash, hashing these
/// short keys was most of what the maps cost, and foldhash takes about 2,700 instructions
/// off an append of one session's turn, of some 110,000 (callgrind, 2026-12-06).
type KeyMap<V> = foldhash::HashMap<Vec<u8>, V>;

/// The tasks keyspace's live records, key → record, in memory (see the module docs): what is
/// committed to it.
type LiveTasks = KeyMap<Vec<u8>>;

/// The sessions keyspace's records the writer committed last, key → record (`None`: removed),
/// at most [`RECENT_SESSION_RECORDS`] of them (see [`Writer::remember_session_record`]).
type RecentSessionRecords = KeyMap<Option<Vec<u8>>>;

/// How many committed session records the writer keeps. Every append reads its session's
/// record, and a session in a turn appends again within milliseconds, so the sessions in
/// flight are what it needs: reading each from fjall's memtable was a skiplist search of
/// about 3,500 instructions, four of a fresh session's five appends per turn (callgrind).
/// At most about 200 KiB, so parked sessions cost no more.
const RECENT_SESSION_RECORDS: usize = 1024;

/// A durable store in a directory, backed by fjall; see the module docs.
pub struct FjallStore {
    path: PathBuf,
    /// `None` only while dropping.
    handles: Option<Handles>,
    queue_index: QueueIndex,
    /// To the writer thread; closed only while dropping.
    writes: WriteQueue,
    writer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for FjallStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FjallStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl FjallStore {
    /// Opens the store in `dir`, creating the directory and an empty store when there is none.
    pub fn open(dir: impl AsRef<Path>) -> Result<FjallStore> {
        let dir = dir.as_ref();
        create_store_dir(dir)?;
        Self::open_dir(dir)
    }

    /// Opens the store in `dir`, failing with `StoreOpen` when `dir` holds no fjall store
    /// (rather than creating an empty one, as [`FjallStore::open`] does).
    pub fn open_existing(dir: impl AsRef<Path>) -> Result<FjallStore> {
        let dir = dir.as_ref();
        check_store_dir(dir)?;
        if !dir.join(VERSION_FILE).is_file() {
            return Err(open_error(
                dir,
                format!(
                    "no store here: the directory has no fjall database (`{VERSION_FILE}` file)"
                ),
            ));
        }
        Self::open_dir(dir)
    }

    fn open_dir(dir: &Path) -> Result<FjallStore> {
        // A sled store's directory would otherwise get an empty fjall database beside it,
        // and the caller would see an empty store.
        if !dir.join(VERSION_FILE).exists()
            && dir.join("conf").is_file()
            && dir.join("db").is_file()
        {
            return Err(open_error(
                dir,
                "the directory holds a sled store, not a fjall one; open it with SledStore"
                    .to_owned(),
            ));
        }
        clear_interrupted_creation(dir).map_err(|e| open_error(dir, e))?;
        let builder = Database::builder(dir)
            .manual_journal_persist(true)
            .cache_size(CACHE_BYTES)
            .max_journaling_size(MAX_JOURNAL_BYTES);
        // fjall asserts and expects in places while recovering (a stray directory named
        // `*.jnl`, a keyspace folder that is not a number), so damaged files could make it
        // panic: that must be an error, never a crash of the caller.
        let db = catch_unwind(AssertUnwindSafe(|| builder.open()))
            .map_err(|panic| {
                open_error(
                    dir,
                    format!(
                        "fjall panicked while recovering (are the files corrupt?): {}",
                        panic_message(&*panic)
                    ),
                )
            })?
            .map_err(|e| match e {
                fjall::Error::Locked => open_error(
                    dir,
                    "the store is in use by another process (fjall's lock is held)".to_owned(),
                ),
                e => open_error(dir, format!("fjall cannot open its files: {}", words(&e))),
            })?;
        let keyspace = |name: &str| {
            catch_unwind(AssertUnwindSafe(|| {
                db.keyspace(name, || {
                    KeyspaceCreateOptions::default().max_memtable_size(memtable_bytes(name))
                })
            }))
            .map_err(|panic| {
                open_error(
                    dir,
                    format!(
                        "fjall panicked opening keyspace {name:?}: {}",
                        panic_message(&*panic)
                    ),
                )
            })?
            .map_err(|e| open_error(dir, format!("cannot open keyspace {name:?}: {}", words(&e))))
        };
        let handles = Handles {
            events: keyspace(EVENTS)?,
            sessions: keyspace(SESSIONS)?,
            tasks: keyspace(TASKS)?,
            queue: keyspace(QUEUE)?,
            db: db.clone(),
        };
        // What fjall leaves unsynced when it creates things (see the module docs).
        sync_dir_described(&dir.join("keyspaces"))
            .and_then(|()| sync_dir_described(dir))
            .map_err(|e| open_error(dir, e))?;
        let (live_tasks, queue) = tasks_at_open(dir, &handles.tasks)?;
        let queue_index: QueueIndex = Arc::new(RwLock::new(queue));

        let shared = Arc::new(Shared::default());
        let writer = Writer {
            path: dir.to_path_buf(),
            handles: handles.clone(),
            shared: Arc::clone(&shared),
            overlay: Overlay::default(),
            queue_index: Arc::clone(&queue_index),
            live_tasks,
            recent_sessions: RecentSessionRecords::default(),
            syncer: None,
        };
        let (writes, thread) = WriteQueue::start(
            ENGINE,
            dir,
            shared,
            writer,
            LoneWrites::OnCallersThread,
            "cairn-fjall-writer",
        )?;
        Ok(FjallStore {
            path: dir.to_path_buf(),
            handles: Some(handles),
            queue_index,
            writes,
            writer: Some(thread),
        })
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes the store's files take on disk, as fjall counts them: table files plus the
    /// journals at their file length (the active journal is preallocated to 64 MiB, most of it
    /// a hole until written).
    pub fn size_on_disk(&self) -> Result<u64> {
        self.handles()?
            .db
            .disk_space()
            .map_err(|e| fjall_error(&self.path, "measuring the size on disk", &e))
    }

    /// The store's logical bytes: the keys and values it holds live in every keyspace (events,
    /// sessions, tasks, queue), what its disk bytes are compared with.
    pub fn live_bytes(&self) -> Result<u64> {
        let h = self.handles()?;
        let mut total = 0u64;
        for keyspace in [&h.events, &h.sessions, &h.tasks, &h.queue] {
            for item in keyspace.iter() {
                let (key, value) = item
                    .into_inner()
                    .map_err(|e| fjall_error(&self.path, "counting the live bytes", &e))?;
                total += (key.len() + value.len()) as u64;
            }
        }
        Ok(total)
    }

    /// Persists (journal fdatasyncs) done since the store was opened: with group commit,
    /// concurrent writes share them.
    pub fn persists(&self) -> u64 {
        self.writes.shared.syncs.load(Ordering::Relaxed)
    }

    fn handles(&self) -> Result<&Handles> {
        self.handles.as_ref().ok_or_else(|| Error::Store {
            reason: format!("fjall store at {} is closed", self.path.display()),
        })
    }
}

#[cfg(test)]
impl FjallStore {
    /// What the store shares with its writer: counters, injected faults.
    pub(super) fn writer_shared(&self) -> &super::write_queue::Shared {
        &self.writes.shared
    }

    /// A writer of this store's database beside its own writer thread, to hand batches to.
    pub(super) fn writer_beside(&self) -> Box<dyn ProcessBatch> {
        Box::new(tests::writer_beside(self))
    }
}

impl Drop for FjallStore {
    fn drop(&mut self) {
        // Closing the channel stops the writer once it has answered what it has.
        self.writes.close();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
        if let Some(handles) = self.handles.take() {
            // fjall's last handle stops its workers and syncs the journal, expecting on locks
            // as it goes: keep a failure there from becoming a panic in the caller (or an abort
            // while unwinding).
            let _ = catch_unwind(AssertUnwindSafe(move || drop(handles)));
        }
    }
}

/// The changes of the batch being built, not yet committed: per keyspace, key → new value
/// (`None`: removed). Committed in key order as one fjall write batch.
#[derive(Default)]
struct Overlay {
    keyspaces: [BTreeMap<Vec<u8>, Option<Vec<u8>>>; 4],
}

impl Overlay {
    fn map(&self, ks: Ks) -> &BTreeMap<Vec<u8>, Option<Vec<u8>>> {
        &self.keyspaces[ks as usize]
    }

    fn is_empty(&self) -> bool {
        self.keyspaces.iter().all(BTreeMap::is_empty)
    }
}

/// One write's changes, staged until the write is accepted whole. Task records it wrote are
/// kept to be read back, so the write sees its own changes in order.
#[derive(Default)]
struct Staged {
    writes: Vec<(Ks, Vec<u8>, Option<Vec<u8>>)>,
    tasks: KeyMap<Option<Vec<u8>>>,
}

impl Staged {
    fn put(&mut self, ks: Ks, key: Vec<u8>, value: Option<Vec<u8>>) {
        if ks == Ks::Tasks {
            self.tasks.insert(key.clone(), value.clone());
        }
        self.writes.push((ks, key, value));
    }
}

fn read_index(index: &QueueIndex) -> std::sync::RwLockReadGuard<'_, BTreeSet<Vec<u8>>> {
    // A set of keys, changed whole per key: consistent even if a holder panicked.
    index
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write_index(index: &QueueIndex) -> std::sync::RwLockWriteGuard<'_, BTreeSet<Vec<u8>>> {
    index
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An in-process lease's answer, sent once its batch is committed (a lease of no task an
/// earlier write of its batch wrote; see [`Writer::apply`]).
type Committed = (oneshot::Sender<Result<Vec<Lease>>>, Vec<Lease>);

/// The live task records, by key, and the queue's keys, one per task record: its visibility
/// time and its key. The queue is never stored apart from the tasks (see the module docs), so
/// a task's record is its queue entry.
fn tasks_at_open(dir: &Path, tasks: &Keyspace) -> Result<(LiveTasks, BTreeSet<Vec<u8>>)> {
    let mut live = LiveTasks::default();
    let mut keys = BTreeSet::new();
    for item in tasks.iter() {
        let (key, value) = item
            .into_inner()
            .map_err(|e| open_error(dir, format!("cannot read the tasks: {}", words(&e))))?;
        let name = task_name(&key);
        let task = decode_task(&name, &value, SPACE).map_err(|e| match e {
            Error::Store { reason } => open_error(dir, reason),
            e => open_error(dir, e.to_string()),
        })?;
        if task_key(&task.id) != *key {
            return Err(open_error(
                dir,
                format!(
                    "the record of task {name} in the tasks keyspace names another task, {}",
                    task.id
                ),
            ));
        }
        keys.insert(queue_key(task.visible_at_ms, &task.id));
        live.insert(key.to_vec(), value.to_vec());
    }
    Ok((live, keys))
}

/// A task key as its task's name (`session/seq`), or its bytes when it is not a task key.
fn task_name(key: &[u8]) -> String {
    match key_seq(key) {
        Some(seq) if key.len() > 9 && key[key.len() - 9] == 0 => {
            format!("{}/{seq}", String::from_utf8_lossy(&key[..key.len() - 9]))
        }
        _ => format!("{:?}", String::from_utf8_lossy(key)),
    }
}

/// The writer thread: applies every write of a batch to the overlay, commits it, persists.
struct Writer {
    path: PathBuf,
    handles: Handles,
    shared: Arc<Shared>,
    overlay: Overlay,
    /// Changed here only, after each commit.
    queue_index: QueueIndex,
    /// Changed here only, after each commit.
    live_tasks: LiveTasks,
    /// Changed here only, after each commit.
    recent_sessions: RecentSessionRecords,
    /// The thread that persists the writer thread's batches, started with the first.
    syncer: Option<Syncer>,
}

/// The thread that persists a committed batch and answers it, while the writer thread
/// applies the next one.
struct Syncer {
    /// The committed batches' held answers, to persist and answer.
    jobs: Option<std::sync::mpsc::Sender<Vec<Pending>>>,
    /// One message per batch persisted and answered.
    done: std::sync::mpsc::Receiver<()>,
    /// Whether a batch sent is not persisted yet.
    in_flight: bool,
    thread: Option<JoinHandle<()>>,
}

impl Syncer {
    fn start(path: &Path, db: Database, shared: Arc<Shared>) -> std::io::Result<Syncer> {
        let (jobs, queue) = std::sync::mpsc::channel::<Vec<Pending>>();
        let (finished, done) = std::sync::mpsc::channel();
        let path = path.to_path_buf();
        let thread = std::thread::Builder::new()
            .name("cairn-fjall-sync".to_owned())
            .spawn(move || {
                for pending in queue {
                    let outcome = persist(&db, &shared);
                    shared.settle(&outcome, pending, ENGINE, &path);
                    if finished.send(()).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Syncer {
            jobs: Some(jobs),
            done,
            in_flight: false,
            thread: Some(thread),
        })
    }

    /// Waits until the batch in flight, if any, is persisted and answered.
    fn wait(&mut self) {
        if self.in_flight {
            // An error means the thread ended, having answered what it took.
            let _ = self.done.recv();
            self.in_flight = false;
        }
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        self.wait();
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Makes every commit so far durable with one fdatasync of the journal, timed. A panic in
/// fjall is a failed persist.
fn persist(db: &Database, shared: &Shared) -> std::result::Result<(), String> {
    #[allow(clippy::disallowed_methods)] // timing IO for benchmarks; not recorded in history
    let began = Instant::now();
    crate::stages::mark("sync.start");
    #[cfg(test)]
    if let Some(reason) = shared.faults.before_sync() {
        shared.synced(began.elapsed());
        return Err(format!(
            "fjall persist (fdatasync of the journal) failed: {reason}"
        ));
    }
    let persisted = catch_unwind(AssertUnwindSafe(|| db.persist(PersistMode::SyncData)))
        .map_err(|panic| {
            format!(
                "fjall panicked while persisting: {}",
                panic_message(&*panic)
            )
        })
        .and_then(|persisted| {
            persisted.map_err(|e| {
                format!(
                    "fjall persist (fdatasync of the journal) failed: {}",
                    words(&e)
                )
            })
        });
    shared.synced(began.elapsed());
    persisted
}

impl ProcessBatch for Writer {
    /// Applies a batch in order, commits it as one write batch, persists it once, answers.
    /// In-process leases of tasks durable before the batch are answered once committed (the
    /// others with the batch's persist); a batch of nothing else is not persisted: the next
    /// durable batch carries it to the disk.
    fn process(&mut self, batch: Vec<Write>) {
        if let Some(syncer) = &mut self.syncer {
            syncer.wait();
        }
        let mut pending = Vec::with_capacity(batch.len());
        let mut committed = Vec::new();
        for write in batch {
            self.apply(write, &mut pending, &mut committed);
        }
        crate::stages::mark("write.applied");
        self.settle_in_place(pending, committed);
    }

    /// As [`process`](Self::process), but the batch is persisted and answered by the sync
    /// thread, so that the next batch is applied while this one syncs. Only its commit waits
    /// for the sync before it (fjall's persist holds the journal through its fdatasync), and
    /// a failed sync refuses the batch applied behind it.
    fn process_on_writer_thread(
        &mut self,
        batch: Vec<Write>,
        more: &mut dyn FnMut() -> Vec<Write>,
    ) {
        let mut pending = Vec::with_capacity(batch.len());
        let mut committed = Vec::new();
        for write in batch {
            self.apply(write, &mut pending, &mut committed);
        }
        if self.syncer.is_none() {
            match Syncer::start(
                &self.path,
                self.handles.db.clone(),
                Arc::clone(&self.shared),
            ) {
                Ok(syncer) => self.syncer = Some(syncer),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the fjall sync thread; syncing on the writer thread");
                    return self.settle_in_place(pending, committed);
                }
            }
        }
        if let Some(syncer) = &mut self.syncer {
            #[cfg(test)]
            if syncer.in_flight {
                // A sync held by a test goes on once this batch is applied behind it.
                self.shared.faults.release();
            }
            syncer.wait();
        }
        // The writes that came while the last batch synced join this one, as they would
        // have without the overlap.
        for write in more() {
            self.apply(write, &mut pending, &mut committed);
        }
        if let Some(refused) = self.shared.refusal(ENGINE, &self.path) {
            self.overlay = Overlay::default();
            let reason = Err(refused.to_string());
            for (reply, leases) in committed {
                Pending::Lease(reply, leases).answer(&reason, ENGINE, &self.path);
            }
            self.shared.settle(&reason, pending, ENGINE, &self.path);
            return;
        }
        // Not `persist_follows`: the sync thread persists it, while this thread applies the
        // next batch; a journal write started here would take the submission off the sync
        // thread and onto this one.
        let Some(pending) = self.commit_answering_leases(pending, committed, false) else {
            return;
        };
        let Some(syncer) = &mut self.syncer else {
            unreachable!("started above")
        };
        match syncer.jobs.as_ref().map(|jobs| jobs.send(pending)) {
            Some(Ok(())) => syncer.in_flight = true,
            Some(Err(std::sync::mpsc::SendError(pending))) => {
                let outcome = persist(&self.handles.db, &self.shared);
                self.shared.settle(&outcome, pending, ENGINE, &self.path);
            }
            None => unreachable!("the jobs end is dropped only with the syncer"),
        }
    }
}

impl Writer {
    /// The rest of [`process`](ProcessBatch::process) for a batch applied: commits it as one
    /// write batch, answers its in-process leases, persists it once, answers the rest.
    fn settle_in_place(&mut self, pending: Vec<Pending>, committed: Vec<Committed>) {
        let Some(pending) = self.commit_answering_leases(pending, committed, true) else {
            return;
        };
        crate::stages::mark("write.committed");
        let outcome = self.persist();
        self.shared.settle(&outcome, pending, ENGINE, &self.path);
    }

    /// Commits the overlay and answers the in-process leases of the batch, then gives back
    /// the answers that wait for a persist, if any; when the commit fails (or fjall panics in
    /// it), answers the whole batch with the failure instead and gives back nothing.
    /// `persist_follows`: this thread persists the batch right after, so the commit starts
    /// the journal's write before the memtable inserts (see [`Writer::commit`]).
    fn commit_answering_leases(
        &mut self,
        pending: Vec<Pending>,
        committed: Vec<Committed>,
        persist_follows: bool,
    ) -> Option<Vec<Pending>> {
        if pending.is_empty() && committed.is_empty() {
            return None;
        }
        let start_journal_write = persist_follows && !pending.is_empty();
        let outcome = catch_unwind(AssertUnwindSafe(|| self.commit(start_journal_write)))
            .unwrap_or_else(|panic| {
                Err(format!(
                    "fjall panicked while committing: {}",
                    panic_message(&*panic)
                ))
            });
        self.overlay = Overlay::default();
        if outcome.is_err() {
            // Not committed: refused like the rest of the batch.
            for (reply, leases) in committed {
                Pending::Lease(reply, leases).answer(&outcome, ENGINE, &self.path);
            }
            self.shared.settle(&outcome, pending, ENGINE, &self.path);
            return None;
        }
        // In order: reports of these leases can only come after this commit.
        for (reply, leases) in committed {
            let _ = reply.send(Ok(leases));
        }
        (!pending.is_empty()).then_some(pending)
    }

    /// Commits the overlay as one fjall write batch (to the journal's buffer, not synced).
    ///
    /// With `start_journal_write`, for a batch this thread persists right after, the commit
    /// also writes the batch's journal record out and starts the device's write of it
    /// before fjall applies the batch to its memtables (patch 4, `vendor/README.md`): the
    /// inserts, a few microseconds an append, then run while the device writes, and the
    /// persist's fdatasync waits for a write already under way. Durability is unchanged:
    /// nothing is answered before that fdatasync.
    fn commit(&mut self, start_journal_write: bool) -> std::result::Result<(), String> {
        if self.overlay.is_empty() {
            // Only writes that change nothing (empty appends to new sessions).
            return Ok(());
        }
        let mut overlay = std::mem::take(&mut self.overlay);
        // The queue's changes go to the index only: the task records are its durable truth.
        let queue_changes = std::mem::take(&mut overlay.keyspaces[Ks::Queue as usize]);
        let mut batch = self
            .handles
            .db
            .batch()
            .start_journal_write(start_journal_write);
        // Events first, the session records that count them last (snapshot reads see the
        // batch whole anyway; plain reads at the newest seqno then see no count too high).
        for ks in [Ks::Events, Ks::Tasks, Ks::Sessions] {
            let keyspace = self.handles.keyspace(ks);
            if ks != Ks::Events {
                // Kept for the live tasks and the recent session records once committed.
                for (key, value) in &overlay.keyspaces[ks as usize] {
                    match value {
                        Some(value) => batch.insert(keyspace, key.as_slice(), value.as_slice()),
                        None => batch.remove(keyspace, key.as_slice()),
                    }
                }
                continue;
            }
            for (key, value) in std::mem::take(&mut overlay.keyspaces[ks as usize]) {
                match value {
                    Some(value) => batch.insert(keyspace, key, value),
                    None => batch.remove(keyspace, key),
                }
            }
        }
        batch
            .commit()
            .map_err(|e| format!("fjall commit failed: {}", words(&e)))?;
        for (key, value) in std::mem::take(&mut overlay.keyspaces[Ks::Tasks as usize]) {
            match value {
                Some(value) => self.live_tasks.insert(key, value),
                None => self.live_tasks.remove(&key),
            };
        }
        for (key, value) in std::mem::take(&mut overlay.keyspaces[Ks::Sessions as usize]) {
            self.remember_session_record(key, value);
        }
        let mut index = write_index(&self.queue_index);
        for (key, value) in queue_changes {
            match value {
                Some(_) => index.insert(key),
                None => index.remove(&key),
            };
        }
        Ok(())
    }

    /// Keeps a committed change of the sessions keyspace for the next appends' reads. When
    /// the map is full it starts again empty: cheaper than ordering its entries by age, and the
    /// sessions still in flight are back in it at their next append.
    fn remember_session_record(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        if self.recent_sessions.len() >= RECENT_SESSION_RECORDS
            && !self.recent_sessions.contains_key(&key)
        {
            self.recent_sessions.clear();
        }
        self.recent_sessions.insert(key, value);
    }

    /// Makes every commit so far durable with one fdatasync of the journal: this batch's and
    /// the unsynced in-process leases before it.
    fn persist(&mut self) -> std::result::Result<(), String> {
        persist(&self.handles.db, &self.shared)
    }

    /// Runs one write against the overlay: answers it now when it fails, or queues its answer.
    fn apply(&mut self, write: Write, pending: &mut Vec<Pending>, committed: &mut Vec<Committed>) {
        if let Some(refused) = self.shared.refusal(ENGINE, &self.path) {
            write.refuse(refused);
            return;
        }
        match write {
            Write::Append(prepared, reply) => match self.append(&prepared) {
                Ok(staged) => {
                    self.stage(staged);
                    self.stage_records(prepared);
                    pending.push(Pending::Append(reply));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Write::AppendThenLease(prepared, lease, reply) => match self.append(&prepared) {
                Ok(staged) => {
                    let now_ms = prepared.now_ms;
                    self.stage(staged);
                    self.stage_records(prepared);
                    // Durable with the append, so fit for any holder.
                    let LeaseRequest {
                        filter,
                        max,
                        lease_ms,
                        holder: _,
                    } = &lease;
                    // Through the overlay: the lease sees the tasks the append queued.
                    let leases = match self.lease(now_ms, *lease_ms, *max, filter) {
                        Ok((leases, staged)) => {
                            self.stage(staged);
                            leases
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "leasing after an append failed; the tasks stay queued");
                            Vec::new()
                        }
                    };
                    // Answered once durable, with the append.
                    pending.push(Pending::Lease(reply, leases));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Write::Lease {
                now_ms,
                lease_ms,
                max,
                filter,
                durable,
                reply,
            } => match self.lease(now_ms, lease_ms, max, &filter) {
                Ok((leases, staged)) if leases.is_empty() && staged.writes.is_empty() => {
                    let _ = reply.send(Ok(leases));
                }
                Ok((leases, staged)) => {
                    // An in-process lease is answered once committed, unless a write before
                    // it in this batch wrote a task it leases (an append that queued it): no
                    // task may run before the event that scheduled it is durable. Then it is
                    // answered with that write (it costs no persist: the batch is persisted
                    // anyway). A lease of tasks durable before the batch need not wait.
                    let written_in_batch = leases
                        .iter()
                        .any(|l| self.overlay.map(Ks::Tasks).contains_key(&task_key(&l.id)));
                    self.stage(staged);
                    if durable || written_in_batch {
                        pending.push(Pending::Lease(reply, leases));
                    } else {
                        committed.push((reply, leases));
                    }
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Write::Extend {
                id,
                lease_attempt,
                now_ms,
                lease_ms,
                details,
                reply,
            } => match self.extend(&id, lease_attempt, now_ms, lease_ms, details) {
                Ok((expiry, staged)) => {
                    self.stage(staged);
                    pending.push(Pending::Extend(reply, expiry));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Write::Release { now_ms, reply } => match self.release(now_ms) {
                Ok((0, _)) => {
                    let _ = reply.send(Ok(0));
                }
                Ok((count, staged)) => {
                    self.stage(staged);
                    pending.push(Pending::Release(reply, count));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Write::Delete {
                session_id,
                now_ms,
                reply,
            } => match self.delete(&session_id, now_ms) {
                Ok((info, staged)) => {
                    self.stage(staged);
                    pending.push(Pending::Delete(reply, info));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
        }
    }

    /// Adds an accepted append's events and session record to the overlay (after its
    /// [`append`](Self::append) staged its task changes), moving their bytes.
    fn stage_records(&mut self, p: PreparedAppend) {
        if p.count == 0 {
            return;
        }
        let events = &mut self.overlay.keyspaces[Ks::Events as usize];
        for (key, record) in p.records {
            events.insert(key, Some(record));
        }
        self.overlay.keyspaces[Ks::Sessions as usize]
            .insert(p.session_id.into_bytes(), Some(p.info));
    }

    /// Adds an accepted write's changes to the overlay, in order.
    fn stage(&mut self, staged: Staged) {
        for (ks, key, value) in staged.writes {
            self.overlay.keyspaces[ks as usize].insert(key, value);
        }
    }

    /// A record as the batch so far leaves it: the overlay, else the live tasks for a task,
    /// else a session record committed lately, else the keyspace. (This thread is the only
    /// writer, so reading the keyspace at its newest seqno is consistent.)
    fn get(&self, ks: Ks, key: &[u8]) -> Result<Option<Vec<u8>>> {
        if let Some(value) = self.overlay.map(ks).get(key) {
            return Ok(value.clone());
        }
        if ks == Ks::Tasks {
            return Ok(self.live_tasks.get(key).cloned());
        }
        if ks == Ks::Sessions {
            if let Some(value) = self.recent_sessions.get(key) {
                return Ok(value.clone());
            }
        }
        self.handles
            .keyspace(ks)
            .get(key)
            .map(|v| v.map(|v| v.to_vec()))
            .map_err(|e| fjall_error(&self.path, "reading", &e))
    }

    /// A task record as `staged` (then the batch) leaves it.
    fn task_bytes(&self, staged: &Staged, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match staged.tasks.get(key) {
            Some(value) => Ok(value.clone()),
            None => self.get(Ks::Tasks, key),
        }
    }

    fn task(&self, staged: &Staged, id: &TaskId) -> Result<Option<Task>> {
        match self.task_bytes(staged, &task_key(id))? {
            Some(bytes) => decode_task(id, &bytes, SPACE).map(Some),
            None => Ok(None),
        }
    }

    /// One append, checked, and its task changes staged. Every check and read comes before its
    /// first change, and the changes reach the overlay only when it returns `Ok`, so a rejected
    /// append (any `Err`: a conflict, a lost lease, a record that does not decode, a failed
    /// read) writes nothing. Its events and session record are staged after it by
    /// [`stage_records`](Self::stage_records), moved rather than copied.
    fn append(&self, p: &PreparedAppend) -> Result<Staged> {
        let sid = p.session_id.as_str();
        let actual = match self.get(Ks::Sessions, sid.as_bytes())? {
            Some(bytes) => decode_info(sid, &bytes, SPACE)?.events + 1,
            None if self.get(Ks::Sessions, &tombstone_key(sid))?.is_some() => {
                return Err(deleted(sid))
            }
            None => 1,
        };
        if actual != p.expected {
            return Err(Error::Conflict {
                session_id: sid.to_owned(),
                expected: p.expected,
                actual,
            });
        }
        // Each task the append touches is read once, as the batch so far leaves it (a lease
        // earlier in the batch, in process or not, included): the completed ones (first in
        // `removed`, their leases checked), the cancelled ones, the fenced one (checked
        // unchanged) and those it enqueues, which must all decode or the append is rejected
        // whole. Only their visibility times are needed afterwards.
        let mut before: Vec<(Vec<u8>, Option<u64>)> =
            Vec::with_capacity(p.removed.len() + p.enqueued.len());
        let no_changes = Staged::default();
        for id in p
            .removed
            .iter()
            .chain(p.enqueued.iter().map(|(new, _)| &new.id))
        {
            let key = task_key(id);
            if before.iter().any(|(read, _)| *read == key) {
                continue;
            }
            let task = self.task(&no_changes, id)?;
            for (completed, attempt) in &p.complete {
                if completed == id {
                    lease_current(task.as_ref(), id, *attempt, p.now_ms)?;
                }
            }
            if let Some(fence) = &p.drop_if_unchanged {
                if fence.id == *id {
                    fence.check(task.as_ref().map(TaskFence::of).as_ref())?;
                }
            }
            before.push((key, task.map(|t| t.visible_at_ms)));
        }
        let mut staged = Staged::default();
        // A task's visibility as `staged` leaves it (a task staged earlier in this append
        // wins over the stored one).
        let visible_at = |staged: &Staged, id: &TaskId, key: &Vec<u8>| -> Result<Option<u64>> {
            match staged.tasks.get(key) {
                Some(Some(bytes)) => Ok(Some(decode_task(id, bytes, SPACE)?.visible_at_ms)),
                Some(None) => Ok(None),
                None => Ok(before
                    .iter()
                    .find(|(read, _)| read == key)
                    .and_then(|(_, visible)| *visible)),
            }
        };

        for id in &p.removed {
            let key = task_key(id);
            if let Some(old_visible) = visible_at(&staged, id, &key)? {
                staged.put(Ks::Tasks, key, None);
                staged.put(Ks::Queue, queue_key(old_visible, id), None);
            }
        }
        for (new, bytes) in &p.enqueued {
            let key = task_key(&new.id);
            if let Some(old_visible) = visible_at(&staged, &new.id, &key)? {
                staged.put(Ks::Queue, queue_key(old_visible, &new.id), None);
            }
            staged.put(Ks::Tasks, key, Some(bytes.clone()));
            staged.put(
                Ks::Queue,
                queue_key(new.visible_at_ms, &new.id),
                Some(Vec::new()),
            );
        }
        Ok(staged)
    }

    /// Queue keys from `from_ms` on, in order, as the batch so far leaves the queue: the
    /// keyspace merged with the overlay, less those `keep` refuses. Stops after `max` kept
    /// keys, or at the first key visible after `until_ms`.
    fn queue_keys(
        &self,
        from_ms: u64,
        until_ms: Option<u64>,
        max: usize,
        mut keep: impl FnMut(&[u8]) -> Result<bool>,
    ) -> Result<Vec<Vec<u8>>> {
        let start = from_ms.to_be_bytes().to_vec();
        let scan_error = |reason: String| Error::Store {
            reason: format!(
                "fjall store at {}: scanning the queue: {reason}",
                self.path.display()
            ),
        };
        let index = read_index(&self.queue_index);
        let mut stored = index
            .range::<Vec<u8>, _>((Bound::Included(start.clone()), Bound::Unbounded))
            .peekable();
        let mut staged = self
            .overlay
            .map(Ks::Queue)
            .range::<Vec<u8>, _>((Bound::Included(start), Bound::Unbounded))
            .peekable();
        let mut keys = Vec::new();
        while keys.len() < max {
            let from_store = match (stored.peek(), staged.peek()) {
                (None, None) => break,
                (Some(s), Some((o, _))) => s < o,
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            let key = if from_store {
                match stored.next() {
                    Some(key) => key.clone(),
                    None => unreachable!("peeked a key"),
                }
            } else {
                let Some((key, value)) = staged.next() else {
                    unreachable!("peeked an overlay entry")
                };
                // The overlay decides for a key both have.
                if stored.peek() == Some(&key) {
                    stored.next();
                }
                match value {
                    Some(_) => key.clone(),
                    None => continue, // removed in this batch
                }
            };
            let visible =
                key_visible(&key).ok_or_else(|| scan_error(format!("bad key {key:?}")))?;
            if until_ms.is_some_and(|until| visible > until) {
                break;
            }
            if keep(&key)? {
                keys.push(key);
            }
        }
        Ok(keys)
    }

    fn lease(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<(Vec<Lease>, Staged)> {
        let expires_at_ms = now_ms.saturating_add(lease_ms);
        let nothing_staged = Staged::default();
        // The task of each key the scan keeps, decoded once, in the scan's order (`None` for a
        // stray entry): the loop below leases them without reading them again.
        let mut kept: Vec<Option<Task>> = Vec::new();
        let due = self.queue_keys(0, Some(now_ms), max, |qkey| {
            let tkey = &qkey[8..];
            // A stray entry (no task) is kept so that the loop below drops it.
            let keep = match self.task_bytes(&nothing_staged, tkey)? {
                Some(bytes) => {
                    let task = decode_task(&String::from_utf8_lossy(tkey), &bytes, SPACE)?;
                    let keep = filter.accepts(&task) && task.overdue(now_ms).is_none();
                    keep.then_some(Some(task))
                }
                None => Some(None),
            };
            let is_kept = keep.is_some();
            kept.extend(keep);
            Ok(is_kept)
        })?;
        let mut staged = Staged::default();
        let mut leases = Vec::with_capacity(due.len());
        for (qkey, task) in due.into_iter().zip(kept) {
            let tkey = qkey[8..].to_vec();
            // A task has one queue entry; should one have two, the second lease takes the
            // record as the first left it, as a read through `staged` would.
            let task = match staged.tasks.get(&tkey) {
                None => task,
                Some(Some(bytes)) => {
                    Some(decode_task(&String::from_utf8_lossy(&tkey), bytes, SPACE)?)
                }
                Some(None) => None,
            };
            let Some(mut task) = task else {
                // Appends remove both together, so this cannot happen; should it, drop the
                // stray entry rather than fail every lease from now on (memory skips it too).
                tracing::warn!(
                    store = %self.path.display(),
                    task = %String::from_utf8_lossy(&tkey),
                    "dropping a queue entry whose task is gone"
                );
                staged.put(Ks::Queue, qkey, None);
                continue;
            };
            task.lease_attempt = task.lease_attempt.saturating_add(1);
            task.visible_at_ms = expires_at_ms;
            task.held = true;
            task.heartbeat_details = None;
            let bytes = encode_meta("task record", &task)?;
            staged.put(Ks::Tasks, tkey, Some(bytes));
            staged.put(Ks::Queue, qkey, None);
            staged.put(
                Ks::Queue,
                queue_key(expires_at_ms, &task.id),
                Some(Vec::new()),
            );
            leases.push(Lease {
                id: task.id,
                kind: task.kind,
                lease_attempt: task.lease_attempt,
                expires_at_ms,
            });
        }
        Ok((leases, staged))
    }

    fn extend(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<(u64, Staged)> {
        let expires_at_ms = now_ms.saturating_add(lease_ms);
        let mut staged = Staged::default();
        let task = self.task(&staged, id)?;
        lease_current(task.as_ref(), id, lease_attempt, now_ms)?;
        let Some(mut task) = task else {
            unreachable!("lease_current rejects a missing task")
        };
        staged.put(Ks::Queue, queue_key(task.visible_at_ms, id), None);
        task.visible_at_ms = expires_at_ms;
        if details.is_some() {
            task.heartbeat_details = details;
        }
        let bytes = encode_meta("task record", &task)?;
        staged.put(Ks::Tasks, task_key(id), Some(bytes));
        staged.put(Ks::Queue, queue_key(expires_at_ms, id), Some(Vec::new()));
        Ok((expires_at_ms, staged))
    }

    /// One delete, checked and staged (see [`Store::delete_session`]): the session must exist
    /// as the batch so far leaves it, not run, and have no task; then its events and record
    /// go and its tombstone comes, all in this batch.
    fn delete(&self, sid: &str, now_ms: u64) -> Result<(SessionInfo, Staged)> {
        let info = match self.get(Ks::Sessions, sid.as_bytes())? {
            Some(bytes) => decode_info(sid, &bytes, SPACE)?,
            None => return Err(unknown_session(sid)),
        };
        let first_task = self.first_task(sid)?;
        check_deletable(&info, first_task.as_ref())?;
        let mut staged = Staged::default();
        for seq in 1..=info.events {
            staged.put(Ks::Events, seq_key(sid, seq), None);
        }
        staged.put(Ks::Sessions, sid.as_bytes().to_vec(), None);
        let tombstone = Tombstone {
            deleted_at_ms: now_ms,
            events: info.events,
        };
        staged.put(
            Ks::Sessions,
            tombstone_key(sid),
            Some(encode_meta("tombstone", &tombstone)?),
        );
        Ok((info, staged))
    }

    /// The first task of a session as the batch so far leaves the tasks keyspace.
    fn first_task(&self, sid: &str) -> Result<Option<Task>> {
        let range = seq_key(sid, 0)..=seq_key(sid, u64::MAX);
        let overlay = self.overlay.map(Ks::Tasks);
        let staged = overlay
            .range(range.clone())
            .find(|(_, value)| value.is_some())
            .map(|(key, _)| key.clone());
        let mut stored = None;
        for guard in self.handles.tasks.range(range) {
            let key = guard
                .key()
                .map_err(|e| fjall_error(&self.path, "reading the tasks keyspace", &e))?;
            // A task this batch removed is gone.
            if !matches!(overlay.get(&*key), Some(None)) {
                stored = Some(key.to_vec());
                break;
            }
        }
        let Some(key) = staged.into_iter().chain(stored).min() else {
            return Ok(None);
        };
        match self.get(Ks::Tasks, &key)? {
            Some(bytes) => decode_task(&String::from_utf8_lossy(&key), &bytes, SPACE).map(Some),
            None => Ok(None),
        }
    }

    /// Makes every leased task leasable at `now_ms`, keeping its lease attempt.
    fn release(&self, now_ms: u64) -> Result<(usize, Staged)> {
        let mut staged = Staged::default();
        // Leased tasks are queued at their expiry: after now, or (lapsed, still held) before.
        let mut released = 0;
        for qkey in self.queue_keys(0, None, usize::MAX, |_| Ok(true))? {
            let tkey = qkey[8..].to_vec();
            let Some(bytes) = self.task_bytes(&staged, &tkey)? else {
                continue; // a stray entry; leasing drops it
            };
            let mut task = decode_task(&String::from_utf8_lossy(&tkey), &bytes, SPACE)?;
            let Some(visible_at_ms) = released_visibility(&task, now_ms) else {
                continue; // not leased: new, or a retry waiting for its backoff
            };
            staged.put(Ks::Queue, qkey, None);
            task.visible_at_ms = visible_at_ms;
            task.held = false;
            let bytes = encode_meta("task record", &task)?;
            staged.put(Ks::Tasks, tkey, Some(bytes));
            staged.put(
                Ks::Queue,
                queue_key(visible_at_ms, &task.id),
                Some(Vec::new()),
            );
            released += 1;
        }
        Ok((released, staged))
    }
}

/// Removes what an interrupted creation of a fjall database left, so it can be created again.
///
/// fjall creates `lock`, an empty `keyspaces/`, the journal `0.jnl` (64 MiB of preallocated
/// zeros) and, last, `version`; before `version` exists, opening creates the database again,
/// which fails for good on the existing `0.jnl` ("File exists"). A process killed in between
/// (the crash test does that) must not leave a directory that never opens again. Nothing can
/// have been written then, and only exactly that shape is cleared: no `version`, nothing in
/// `keyspaces/`, one journal `0.jnl` that holds only zeros.
fn clear_interrupted_creation(dir: &Path) -> std::result::Result<(), String> {
    if !interrupted_creation(dir)? {
        return Ok(());
    }
    let journal = dir.join("0.jnl");
    tracing::warn!(
        store = %dir.display(),
        "removing the empty journal of an interrupted fjall database creation"
    );
    fs::remove_file(&journal).map_err(|e| format!("cannot remove {}: {e}", journal.display()))?;
    sync_dir_described(dir)
}

/// Whether `dir` holds exactly what an interrupted creation leaves (see
/// [`clear_interrupted_creation`]): no `version`, nothing in `keyspaces/`, and one journal
/// `0.jnl` holding only zeros. Opening through `store::embedded` sets that journal aside
/// before this store sees it.
pub(crate) fn interrupted_creation(dir: &Path) -> std::result::Result<bool, String> {
    use std::io::Read as _;
    let journal = dir.join("0.jnl");
    if dir.join(VERSION_FILE).exists() || !journal.is_file() {
        return Ok(false);
    }
    let keyspaces = dir.join("keyspaces");
    let keyspaces_empty = match fs::read_dir(&keyspaces) {
        Ok(mut entries) => entries.next().is_none(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => return Err(format!("cannot list {}: {e}", keyspaces.display())),
    };
    let other_journals = fs::read_dir(dir)
        .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok())
        .any(|entry| {
            let name = entry.file_name();
            name != "0.jnl" && Path::new(&name).extension().is_some_and(|x| x == "jnl")
        });
    if !keyspaces_empty || other_journals {
        return Ok(false); // not that shape: leave it to fjall (and to whoever repairs it)
    }
    let read_error = |e: std::io::Error| format!("cannot read {}: {e}", journal.display());
    let mut file = File::open(&journal).map_err(read_error)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(read_error)?;
        if n == 0 {
            return Ok(true);
        }
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false); // it holds writes: not an interrupted creation
        }
    }
}

fn fjall_error(path: &Path, doing: &str, e: &fjall::Error) -> Error {
    Error::Store {
        reason: format!("fjall store at {}: {doing}: {}", path.display(), words(e)),
    }
}

/// What a fjall error says, in words: fjall's own `Display` prints its `Debug` form
/// (`FjallError: Storage(Io(Os { code: 20, kind: NotADirectory, .. }))`), which must not
/// reach people.
pub(crate) fn words(e: &fjall::Error) -> String {
    use fjall::JournalRecoveryError as Journal;
    match e {
        fjall::Error::Io(e) => e.to_string(),
        fjall::Error::Storage(e) => lsm_words(e),
        fjall::Error::JournalRecovery(e) => format!(
            "the journal cannot be recovered: {}",
            match e {
                Journal::InsufficientLength => "a batch is shorter than its header says",
                Journal::TooManyItems => "a batch holds more items than its header says",
                Journal::ChecksumMismatch => "a batch fails its checksum",
                Journal::InvalidFileName => "a journal file has a name fjall does not know",
            }
        ),
        fjall::Error::InvalidVersion(Some(version)) => {
            format!(
                "the database's format version {} is not supported",
                u8::from(*version)
            )
        }
        fjall::Error::InvalidVersion(None) => {
            "the database's format version cannot be read".to_owned()
        }
        fjall::Error::Decompress(kind) => format!("a {kind} block does not decompress"),
        fjall::Error::InvalidTrailer => "a journal entry has an invalid trailer".to_owned(),
        fjall::Error::InvalidTag((what, tag)) => format!("invalid {what} tag {tag}"),
        fjall::Error::Poisoned => "an earlier write to the journal failed, so fjall takes no \
                                   more writes (poisoned); reopen the store"
            .to_owned(),
        fjall::Error::KeyspaceDeleted => "the keyspace was deleted".to_owned(),
        fjall::Error::Locked => "the database is locked by another process".to_owned(),
        fjall::Error::Unrecoverable => {
            "the database cannot be recovered (fjall logged why)".to_owned()
        }
        _ => "an error fjall does not describe".to_owned(),
    }
}

/// What an error of fjall's LSM trees says, in words (see [`words`]).
fn lsm_words(e: &fjall::LsmError) -> String {
    match e {
        fjall::LsmError::Io(e) => e.to_string(),
        fjall::LsmError::Decompress(kind) => format!("a {kind} block does not decompress"),
        fjall::LsmError::InvalidVersion(version) => {
            format!("a table's format version {version} is not supported")
        }
        fjall::LsmError::Unrecoverable => "files a tree needs cannot be recovered".to_owned(),
        fjall::LsmError::ChecksumMismatch { got, expected } => {
            format!("a block fails its checksum (recorded {expected}, computed {got})")
        }
        fjall::LsmError::InvalidTag((what, tag)) => format!("invalid {what} tag {tag}"),
        fjall::LsmError::InvalidTrailer => "a block has an invalid trailer".to_owned(),
        fjall::LsmError::InvalidHeader(what) => format!("invalid {what} header"),
        fjall::LsmError::Utf8(e) => format!("invalid UTF-8: {e}"),
        _ => "an error fjall's trees do not describe".to_owned(),
    }
}

#[async_trait]
impl Store for FjallStore {
    fn durable_commits(&self) -> Option<u64> {
        Some(self.writes.shared.syncs.load(Ordering::Relaxed))
    }

    fn sync_times(&self) -> Option<SyncTimes> {
        Some(self.writes.shared.sync_times())
    }

    fn write_refusal(&self) -> Option<String> {
        self.writes.shared.refusal_words(ENGINE, &self.path)
    }

    async fn append(&self, request: AppendRequest) -> Result<()> {
        self.writes.append(request).await
    }

    async fn read_history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        let unknown = || Error::UnknownSession {
            session_id: session_id.to_owned(),
        };
        if check_session_id(session_id).is_err() {
            return Err(unknown()); // no such id can have been stored
        }
        let h = self.handles()?;
        // One snapshot for the session record and its events: whole write batches only.
        let snapshot = h.db.snapshot();
        let info = match snapshot
            .get(&h.sessions, session_id.as_bytes())
            .map_err(|e| fjall_error(&self.path, "reading the sessions keyspace", &e))?
        {
            Some(bytes) => decode_info(session_id, &bytes, SPACE)?,
            None => return Err(unknown()),
        };
        read_events(session_id, info.events, from_seq, limit, |range| {
            snapshot.range(&h.events, range).map(|item| {
                item.into_inner().map_err(|e| {
                    fjall_error(&self.path, &format!("reading session {session_id:?}"), &e)
                })
            })
        })
    }

    async fn list_sessions(&self) -> Result<Vec<SessionInfo>> {
        let h = self.handles()?;
        let mut out = Vec::new();
        for item in h.db.snapshot().iter(&h.sessions) {
            let (key, bytes) = item
                .into_inner()
                .map_err(|e| fjall_error(&self.path, "reading the sessions keyspace", &e))?;
            if is_tombstone_key(&key) {
                continue;
            }
            out.push(decode_info(&String::from_utf8_lossy(&key), &bytes, SPACE)?);
        }
        Ok(out)
    }

    async fn deleted_sessions(&self) -> Result<Vec<String>> {
        let h = self.handles()?;
        let mut out = Vec::new();
        for item in h.db.snapshot().iter(&h.sessions) {
            let (key, _) = item
                .into_inner()
                .map_err(|e| fjall_error(&self.path, "reading the sessions keyspace", &e))?;
            if let Some(id) = key.strip_suffix(&[0]) {
                out.push(String::from_utf8_lossy(id).into_owned());
            }
        }
        Ok(out)
    }

    async fn lease_tasks(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        self.writes.lease(now_ms, lease_ms, max, filter, true).await
    }

    async fn append_and_lease(
        &self,
        request: AppendRequest,
        lease: &LeaseRequest,
    ) -> Result<Vec<Lease>> {
        self.writes.append_and_lease(request, lease).await
    }

    async fn lease_tasks_in_process(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        self.writes
            .lease(now_ms, lease_ms, max, filter, false)
            .await
    }

    async fn extend_lease(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        self.writes
            .extend(id, lease_attempt, now_ms, lease_ms, details)
            .await
    }

    async fn overdue_tasks(&self, now_ms: u64, max: usize) -> Result<Vec<Task>> {
        let h = self.handles()?;
        let until = now_ms.saturating_add(1).to_be_bytes().to_vec();
        // The due keys first (the index, not the keyspace: see the module docs), then their
        // tasks from one snapshot; a task done in between is gone from it and skipped.
        let due: Vec<Vec<u8>> = read_index(&self.queue_index)
            .range::<Vec<u8>, _>(..until)
            .cloned()
            .collect();
        let snapshot = h.db.snapshot();
        let mut out = Vec::new();
        for key in due {
            if out.len() >= max {
                break;
            }
            let tkey = &key[8.min(key.len())..];
            let bytes = snapshot
                .get(&h.tasks, tkey)
                .map_err(|e| fjall_error(&self.path, "reading the tasks keyspace", &e))?;
            if let Some(bytes) = bytes {
                let task = decode_task(&String::from_utf8_lossy(tkey), &bytes, SPACE)?;
                if task.overdue(now_ms).is_some() {
                    out.push(task);
                }
            }
        }
        Ok(out)
    }

    async fn list_tasks(&self) -> Result<Vec<Task>> {
        let h = self.handles()?;
        let mut out = Vec::new();
        for item in h.db.snapshot().iter(&h.tasks) {
            let (key, bytes) = item
                .into_inner()
                .map_err(|e| fjall_error(&self.path, "reading the tasks keyspace", &e))?;
            out.push(decode_task(&String::from_utf8_lossy(&key), &bytes, SPACE)?);
        }
        Ok(out)
    }

    async fn task(&self, id: &TaskId) -> Result<Option<Task>> {
        let h = self.handles()?;
        match h
            .tasks
            .get(task_key(id))
            .map_err(|e| fjall_error(&self.path, "reading the tasks keyspace", &e))?
        {
            Some(bytes) => decode_task(id, &bytes, SPACE).map(Some),
            None => Ok(None),
        }
    }

    async fn delete_session(&self, session_id: &str, now_ms: u64) -> Result<SessionInfo> {
        self.writes.delete(session_id, now_ms).await
    }

    async fn release_leases(&self, now_ms: u64) -> Result<usize> {
        self.writes.release(now_ms).await
    }
}

#[cfg(test)]
#[path = "fjall_tests.rs"]
mod tests;
