//! The sled store: the embedded, durable default backend.
//!
//! # Layout
//!
//! One sled database per store directory, with four trees, `events`, `sessions`, `tasks` and
//! `queue`, laid out exactly like the fjall store's keyspaces. The layout (keys, values, and why
//! their byte order gives the orders the [`Store`] contract asks for) and the record codecs are
//! shared with the fjall store and described where they live, in the `keys` module
//! (`store/keys.rs`). The next seq of a session is its `SessionInfo::events + 1`.
//!
//! # Writes: one writer thread, group commit
//!
//! Every write (append, lease, lease extension, release) is prepared on the caller's task
//! (validation, encoding) and sent to the store's writer thread; the caller awaits a
//! `tokio::sync::oneshot` for the answer, so no tokio worker ever waits on the disk (unlike
//! fjall's, sled's writer never runs a lone write on its caller's thread). The writer
//! takes every write queued so far (a batch), commits it, makes the whole batch durable with
//! one flush and answers it. Writes that arrive during a flush form the next batch, so N
//! concurrent appends cost about one flush, not N. The queue itself (the writes, their
//! preparation, batching, the held answers and the refusal after a failed sync) is shared with
//! the fjall store, in the `write_queue` module (`store/write_queue.rs`); what follows is what
//! sled's writer does with a batch.
//!
//! Consecutive appends of a batch commit in one sled transaction over the four trees, in
//! order, each seeing the ones before it. Each append still stands alone: its seq check
//! (`Conflict`), its fencing checks of `complete` and `drop_if_unchanged` (`LeaseLost`) and
//! every read of a record it replaces come before its first write, so a rejected append
//! writes nothing and is answered at once, while the others of the group commit; its events,
//! session record and queue changes go in together or not at all. One transaction per group rather than per append
//! matters: a sled transaction costs tens of microseconds whatever its size, which made
//! concurrent appends CPU-bound (about 3.5 times fewer appends per second with 256 sessions).
//!
//! Why the writer runs the transactions, not the appending tasks: sled 0.34 serializes
//! transactions with a process-wide reader-writer lock, and `Db::flush` holds the read side
//! until its writes reach the disk. A transaction started during a flush would block its
//! thread, a tokio worker, for the whole flush, and since that lock is task-fair, every read
//! arriving after it would block as well. With all transactions and flushes on one thread, a
//! writer never waits for a flush, and reads, which run on the caller's thread, only ever wait
//! for a commit in progress (microseconds for one append, a few milliseconds for a group of
//! hundreds; a batch holds at most 512 writes). The transactions were serialized anyway. (The
//! lock is sled's, process-wide: two stores in one process wait on each other's commits.)
//!
//! Leasing needs a scan of `queue`, which sled transactions cannot do; the writer thread scans
//! and then leases the due tasks in one transaction, and since it is the only writer nothing
//! can change between the two. The thread stops, after answering its last batch, when the store
//! is dropped, and the drop joins it.
//!
//! # Durability
//!
//! A write is answered `Ok` only once it survives a power loss, not only a process crash
//! (leases too: a fencing token handed out must not be handed out again after a restart),
//! with one exception. A lease for a worker of this process
//! ([`Store::lease_tasks_in_process`]) is answered once committed, and the next sync carries
//! it to the disk: a crash before that takes its holder down with it, and the log is
//! written in order, so no durable record can name a lease that was lost. That takes one
//! sync per lease off a turn's path. It holds only for a lease that no write before it in its
//! batch waits behind: an append there may have queued the very task it leases, and no task
//! may run before the event that scheduled it is on disk. Such a lease is answered with those
//! writes, once their sync succeeds (with its failure when it fails); a batch of in-process
//! leases alone is not synced at all.
//! sled alone does not give that:
//!
//! * sled writes its log into the `db` file and ends each write with `sync_file_range` on
//!   Linux. That pushes the pages to the device but neither flushes the device's volatile write
//!   cache nor persists the file's size when the log grew, so `Db::flush` returning is not a
//!   power-loss guarantee. After every flush this store calls `fdatasync` (`File::sync_data`)
//!   on its own handle to `db`; an fsync acts on the file, whichever descriptor is used.
//! * Log messages larger than a quarter of a segment (about 128 KiB with the default 512 KiB
//!   segments) go to files `blobs/<lsn>`, which sled writes and never syncs. A large tool
//!   result, or a leaf node of several big events, becomes a blob, and no configuration keeps
//!   every possible event below the threshold. So after each flush the store lists `blobs/`,
//!   `fdatasync`s every blob it has not synced at its current size, and then fsyncs the
//!   `blobs/` directory so the new names are durable too. sled writes a blob completely
//!   before the log message pointing at it can reach the disk, so every blob a flush made
//!   stable is complete when the listing runs.
//! * sled writes `conf` at creation without syncing it, and writes `snap.*` files (synced,
//!   then renamed) only while opening. After opening, the store syncs `conf` and `db`, fsyncs
//!   `blobs/` and the store directory, and the parents of the directories it created.
//!
//! If a flush or an fsync fails, every write of that batch gets `Error::Store`, and the store
//! refuses further writes until it is reopened: after a failed fsync the kernel may have
//! dropped the dirty pages, so a later fsync that succeeds would prove nothing. So does a
//! failed write into sled (a full disk) of any kind, an append, a lease, an extension, a
//! release or a delete, after which sled's own state is in doubt; closing such a store waits
//! for sled a few seconds at most (see `close_after_a_failure`). (A write this store refuses
//! itself, a conflict or a lost lease, aborts its transaction and leaves sled as it was.)
//!
//! # A lost log tail
//!
//! sled checksums every message of its log, but when one is damaged (a flipped bit on the disk,
//! in `db` or in a blob) it takes it for a torn write at the end of the log: it recovers the log
//! up to that message and drops it and everything after it, without an error. This store does
//! not try to notice: [`embedded`](super::embedded) opens stores through a copy and checks the
//! per-session high-water marks of [`marks`](super::marks), so a loss is named and the store's
//! files are left as they were.
//!
//! Reads can see a write whose batch is still being flushed (its writer has not been answered
//! yet). Flushes are ordered, so a write that was acknowledged never depends on one that was
//! not: if the process dies before that flush, the unacknowledged write and everything after it
//! are lost together, and the readers that saw it died with the process.

use super::files::{
    check_store_dir, create_store_dir, open_error, panic_message, sync_dir_described,
};
use super::keys::{
    decode_info, decode_task, deleted, encode_meta, is_tombstone_key, key_visible, queue_key,
    read_events, seq_key, task_key, tombstone_key, Tombstone, EVENTS, QUEUE, SESSIONS, TASKS,
};
use super::memory::{lease_current, released_visibility};
use super::write_queue::{
    Engine, LoneWrites, Pending, PreparedAppend, ProcessBatch, Shared, Write, WriteQueue,
};
use super::{
    check_deletable, check_session_id, unknown_session, AppendRequest, Lease, LeaseHolder,
    LeaseRequest, SessionInfo, Store, SyncTimes, Task, TaskFence, TaskFilter, TaskId,
};
use crate::error::{Error, Result};
use crate::event::EventEnvelope;
use async_trait::async_trait;
use cairn_ledger::JsonText;
use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{self, File};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime};
use tokio::sync::oneshot;

/// How error texts name this engine and its sync.
const ENGINE: Engine = Engine {
    name: "sled",
    sync: "sync",
};
/// What error texts call a part of the database.
const SPACE: &str = "tree";

/// The sled database and its trees.
#[derive(Clone)]
struct Handles {
    db: sled::Db,
    events: sled::Tree,
    sessions: sled::Tree,
    tasks: sled::Tree,
    queue: sled::Tree,
}

/// A durable store in a directory, backed by sled; see the module docs.
pub struct SledStore {
    path: PathBuf,
    /// `None` only while dropping.
    handles: Option<Handles>,
    /// To the writer thread; closed only while dropping.
    writes: WriteQueue,
    writer: Option<JoinHandle<()>>,
}

/// sled's page cache (its default is 1 GiB, which a long-lived process fills: issue 13
/// measured RSS following it). The engine caches running sessions' states, so sled's reads are
/// mostly of pages just written or of a parked session's history when its next turn starts.
/// sled counts its cache low: 100,000 parked sessions took about 52 MiB of RSS plus 1.75 times
/// this figure (8 MiB: 65 MiB; 24 MiB: 91–94 MiB, at the edge of issue 13's 100 MB), while
/// turns per second at 1, 16 and 128 sessions did not change between 8 and 24 MiB.
pub const CACHE_BYTES: u64 = 16 * 1024 * 1024;

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl SledStore {
    /// Opens the store in `dir`, creating the directory and an empty store when there is none.
    pub fn open(dir: impl AsRef<Path>) -> Result<SledStore> {
        let dir = dir.as_ref();
        create_store_dir(dir)?;
        Self::open_dir(dir)
    }

    /// Opens the store in `dir`, failing with `StoreOpen` when `dir` holds no store (rather than
    /// creating an empty one, as [`SledStore::open`] does).
    pub fn open_existing(dir: impl AsRef<Path>) -> Result<SledStore> {
        let dir = dir.as_ref();
        check_store_dir(dir)?;
        if !dir.join("db").is_file() || !dir.join("conf").is_file() {
            return Err(open_error(
                dir,
                "no store here: the directory has no sled database (`db` and `conf` files)"
                    .to_owned(),
            ));
        }
        Self::open_dir(dir)
    }

    fn open_dir(dir: &Path) -> Result<SledStore> {
        let config = sled::Config::new().path(dir).cache_capacity(CACHE_BYTES);
        // sled 0.34 unwraps in places while recovering, so garbage files could make it panic:
        // that must be an error, never a crash of the caller.
        let db = catch_unwind(AssertUnwindSafe(|| config.open()))
            .map_err(|panic| {
                open_error(
                    dir,
                    format!(
                        "sled panicked while recovering (are the files corrupt?): {}",
                        panic_message(&*panic)
                    ),
                )
            })?
            .map_err(|e| {
                let words = Words(&e).to_string();
                if words.contains("could not acquire lock") {
                    open_error(
                        dir,
                        "the store is in use by another process (sled's lock is held)".to_owned(),
                    )
                } else {
                    open_error(dir, format!("sled cannot open its files: {words}"))
                }
            })?;
        let tree = |name: &str| {
            db.open_tree(name)
                .map_err(|e| open_error(dir, format!("cannot open tree {name:?}: {}", Words(&e))))
        };
        let handles = Handles {
            events: tree(EVENTS)?,
            sessions: tree(SESSIONS)?,
            tasks: tree(TASKS)?,
            queue: tree(QUEUE)?,
            db: db.clone(),
        };
        let mut syncer = Syncer::new(dir).map_err(|e| open_error(dir, e))?;
        syncer
            .sync_after_open(&db)
            .map_err(|e| open_error(dir, e))?;
        let shared = Arc::new(Shared::default());
        let writer = Writer {
            path: dir.to_path_buf(),
            handles: handles.clone(),
            syncer,
            shared: Arc::clone(&shared),
        };
        // Every write goes to the thread: sled's flush is a sled flush and then an fdatasync,
        // too long to hold a caller's thread (measured: no gain for one session, a loss at 16).
        let (writes, thread) = WriteQueue::start(
            ENGINE,
            dir,
            shared,
            writer,
            LoneWrites::OnWriterThread,
            "cairn-sled-writer",
        )?;
        Ok(SledStore {
            path: dir.to_path_buf(),
            handles: Some(handles),
            writes,
            writer: Some(thread),
        })
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes the store's files take on disk.
    pub fn size_on_disk(&self) -> Result<u64> {
        self.handles()?
            .db
            .size_on_disk()
            .map_err(|e| sled_error(&self.path, "measuring the size on disk", Words(&e)))
    }

    /// The store's logical bytes: the keys and values it holds live in every tree (events,
    /// sessions, tasks, queue), what its disk bytes are compared with.
    pub fn live_bytes(&self) -> Result<u64> {
        let h = self.handles()?;
        let mut total = 0u64;
        for tree in [&h.events, &h.sessions, &h.tasks, &h.queue] {
            for item in tree.iter() {
                let (key, value) =
                    item.map_err(|e| sled_error(&self.path, "counting the live bytes", Words(&e)))?;
                total += (key.len() + value.len()) as u64;
            }
        }
        Ok(total)
    }

    fn handles(&self) -> Result<&Handles> {
        self.handles.as_ref().ok_or_else(|| Error::Store {
            reason: format!("sled store at {} is closed", self.path.display()),
        })
    }
}

#[cfg(test)]
impl SledStore {
    /// What the store shares with its writer: counters, injected faults.
    pub(super) fn writer_shared(&self) -> &super::write_queue::Shared {
        &self.writes.shared
    }

    /// A writer of this store's database beside its own writer thread, to hand batches to.
    pub(super) fn writer_beside(&self) -> Box<dyn ProcessBatch> {
        Box::new(Writer {
            path: self.path.clone(),
            handles: self.handles().expect("handles").clone(),
            syncer: Syncer::new(&self.path).expect("a handle to sync"),
            shared: Arc::clone(&self.writes.shared),
        })
    }
}

impl Drop for SledStore {
    fn drop(&mut self) {
        // Closing the channel stops the writer once it has answered what it has.
        self.writes.close();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
        if let Some(handles) = self.handles.take() {
            if self.writes.shared.failed().is_some() {
                close_after_a_failure(handles, &self.path);
            } else {
                // sled's last handle flushes and unwraps an fsync while dropping: keep a disk
                // error there from turning into a panic in the caller (or an abort while
                // unwinding).
                let _ = catch_unwind(AssertUnwindSafe(move || drop(handles)));
                wait_for_sled_to_unlock(&self.path.join("db"));
            }
        }
    }
}

/// How long a close waits for sled to let go of its lock.
const UNLOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits, [`UNLOCK_WAIT`] at most, until nothing holds the lock sled takes on `db` (a `flock`).
/// sled's background threads can keep it for a moment after its last handle is dropped, and a
/// store closed must open again at once (measured: 2 reopens in 300 right after a close were
/// refused as "in use", on a loaded machine).
#[allow(clippy::disallowed_methods)] // a close waits on real time for sled's threads; not pure code
fn wait_for_sled_to_unlock(db: &Path) {
    let Ok(file) = File::open(db) else {
        return;
    };
    let deadline = std::time::Instant::now() + UNLOCK_WAIT;
    loop {
        match file.try_lock() {
            Ok(()) => {
                let _ = file.unlock();
                return;
            }
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(_) => return,
        }
    }
}

/// How long closing a store that failed a write waits for sled to let go of it.
const CLOSE_AFTER_A_FAILURE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Drops the handles of a store that failed a write, waiting [`CLOSE_AFTER_A_FAILURE_WAIT`]
/// at most. sled's last handle flushes while dropping, and after a failed log write (a full
/// disk) sled 0.34 can wait forever for a log position it never writes, even once there is
/// room again. Nothing acknowledged depends on that flush (every acknowledged write was
/// synced), so the close gives up waiting and says so; sled keeps its lock on the store until
/// the process exits.
fn close_after_a_failure(handles: Handles, path: &Path) {
    let (closed, done) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("cairn-sled-close".to_owned())
        .spawn(move || {
            let _ = catch_unwind(AssertUnwindSafe(move || drop(handles)));
            let _ = closed.send(());
        });
    let finished = match spawned {
        Ok(_) => done.recv_timeout(CLOSE_AFTER_A_FAILURE_WAIT).is_ok(),
        Err(_) => false,
    };
    if finished {
        // As after any close: sled's threads may hold its lock a moment longer.
        wait_for_sled_to_unlock(&path.join("db"));
    } else {
        tracing::warn!(
            store = %path.display(),
            "sled did not finish closing the store after a failed write; it keeps the store \
             locked until this process exits (every acknowledged write was synced)"
        );
    }
}

/// The writer thread: runs every write's transaction, then syncs once per batch.
struct Writer {
    path: PathBuf,
    handles: Handles,
    syncer: Syncer,
    shared: Arc<Shared>,
}

impl ProcessBatch for Writer {
    /// Runs every write's transaction in order, then syncs once.
    fn process(&mut self, batch: Vec<Write>) {
        let mut pending = Vec::with_capacity(batch.len());
        let mut appends = Vec::new();
        for write in batch {
            match write {
                Write::Append(prepared, reply) => appends.push((prepared, reply)),
                other => {
                    // Keep the order: appends before this write commit before it.
                    self.append_group(std::mem::take(&mut appends), &mut pending);
                    self.apply(other, &mut pending);
                }
            }
        }
        self.append_group(appends, &mut pending);
        if pending.is_empty() {
            return;
        }
        // Everything in `pending` committed before this flush starts.
        #[allow(clippy::disallowed_methods)] // timing IO for benchmarks; not recorded in history
        let began = Instant::now();
        crate::stages::mark("sync.start");
        let synced = catch_unwind(AssertUnwindSafe(|| {
            #[cfg(test)]
            if let Some(reason) = self.shared.faults.before_sync() {
                return Err(format!("sled flush failed: {reason}"));
            }
            self.syncer.sync(&self.handles.db)
        }))
        .unwrap_or_else(|panic| {
            Err(format!(
                "sled panicked while flushing: {}",
                panic_message(&*panic)
            ))
        });
        self.shared.synced(began.elapsed());
        self.shared.settle(&synced, pending, ENGINE, &self.path);
    }
}

impl Writer {
    /// Why writes are refused, once a sync failed.
    fn refusal(&self) -> Option<Error> {
        self.shared.refusal(ENGINE, &self.path)
    }

    /// Why a group failed, in words; a storage failure makes the store refuse further writes.
    fn group_failed(&self, failure: GroupFailure) -> String {
        match failure {
            GroupFailure::Aborted(reason) => reason,
            GroupFailure::Storage(reason) => {
                self.write_failed(&reason);
                reason
            }
        }
    }

    /// Makes the store refuse further writes after sled failed one (see
    /// [`GroupFailure::Storage`]): whichever write it was, sled's state is in doubt. The first
    /// reason stays.
    fn write_failed(&self, reason: &str) {
        let mut failed = self.shared.failed();
        if failed.is_none() {
            tracing::error!(
                store = %self.path.display(),
                %reason,
                "sled failed a write; the store refuses writes until it is reopened"
            );
            *failed = Some(format!("a write failed: {reason}"));
        }
    }

    /// Commits consecutive appends in one transaction (each still all or nothing): answers the
    /// rejected ones now, queues the others' answers for the sync.
    fn append_group(
        &self,
        group: Vec<(PreparedAppend, oneshot::Sender<Result<()>>)>,
        pending: &mut Vec<Pending>,
    ) {
        if group.is_empty() {
            return;
        }
        if self.refusal().is_some() {
            for (_, reply) in group {
                let _ = reply.send(Err(self.refusal().unwrap_or(Error::Shutdown)));
            }
            return;
        }
        let (prepared, replies): (Vec<PreparedAppend>, Vec<_>) = group.into_iter().unzip();
        match append_all(&self.handles, &prepared) {
            Ok(outcomes) => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    match outcome {
                        Ok(()) => pending.push(Pending::Append(reply)),
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                }
            }
            Err(failure) => {
                let reason = self.group_failed(failure);
                for reply in replies {
                    let _ = reply.send(Err(sled_error(&self.path, "append", &reason)));
                }
            }
        }
    }

    /// Runs a lease or an extension: answers it now when it fails, or queues its answer.
    fn apply(&self, write: Write, pending: &mut Vec<Pending>) {
        if let Some(refused) = self.refusal() {
            write.refuse(refused);
            return;
        }
        match write {
            Write::Append(prepared, reply) => self.append_group(vec![(prepared, reply)], pending),
            Write::AppendThenLease(prepared, lease, reply) => {
                match append_all(&self.handles, std::slice::from_ref(&prepared)) {
                    Ok(mut outcomes) => match outcomes.pop() {
                        Some(Ok(())) => {
                            // Durable with the append, so fit for any holder.
                            let LeaseRequest {
                                filter,
                                max,
                                lease_ms,
                                holder: _,
                            } = &lease;
                            let leases = self
                                .lease(prepared.now_ms, *lease_ms, *max, filter)
                                .unwrap_or_else(|e| {
                                    tracing::warn!(error = %e, "leasing after an append failed; the tasks stay queued");
                                    Vec::new()
                                });
                            // Answered once durable, with the append.
                            pending.push(Pending::Lease(reply, leases));
                        }
                        Some(Err(e)) => {
                            let _ = reply.send(Err(e));
                        }
                        None => unreachable!("one outcome per append"),
                    },
                    Err(failure) => {
                        let reason = self.group_failed(failure);
                        let _ = reply.send(Err(sled_error(&self.path, "append", &reason)));
                    }
                }
            }
            Write::Lease {
                now_ms,
                lease_ms,
                max,
                filter,
                durable,
                reply,
            } => match self.lease(now_ms, lease_ms, max, &filter) {
                // Committed: an in-process lease is answered now, and reaches the disk with
                // the next flush, unless a write before it in this batch waits for this
                // flush: an append there may have queued the very tasks it leases, and no
                // task may run before the event that scheduled it is durable. Then it is
                // answered with that write (it costs no flush: the batch flushes anyway).
                Ok(leases) if leases.is_empty() || (!durable && pending.is_empty()) => {
                    let _ = reply.send(Ok(leases));
                }
                Ok(leases) => pending.push(Pending::Lease(reply, leases)),
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
                Ok(expiry) => pending.push(Pending::Extend(reply, expiry)),
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Write::Release { now_ms, reply } => match self.release(now_ms) {
                Ok(0) => {
                    let _ = reply.send(Ok(0));
                }
                Ok(count) => pending.push(Pending::Release(reply, count)),
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Write::Delete {
                session_id,
                now_ms,
                reply,
            } => match self.delete(&session_id, now_ms) {
                Ok(info) => pending.push(Pending::Delete(reply, info)),
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
        }
    }

    /// The outcome of a lease's, an extension's, a release's or a delete's transaction. An
    /// abort is this store's own refusal (a lost lease, a record that does not decode) and
    /// wrote nothing; a storage failure is sled's, after which its state is in doubt as after
    /// a failed append, so the store refuses further writes.
    fn txn_result<T>(
        &self,
        doing: &str,
        r: std::result::Result<T, TransactionError<Error>>,
    ) -> Result<T> {
        match r {
            Ok(v) => Ok(v),
            Err(TransactionError::Abort(e)) => Err(e),
            Err(TransactionError::Storage(e)) => {
                self.write_failed(&format!("{doing}: {}", Words(&e)));
                Err(sled_error(&self.path, doing, Words(&e)))
            }
        }
    }

    fn lease(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        let h = &self.handles;
        let expires_at_ms = now_ms.saturating_add(lease_ms);
        // This thread is the only writer: the queue cannot change between scan and transaction.
        let mut due: Vec<sled::IVec> = Vec::new();
        for item in h.queue.iter() {
            if due.len() >= max {
                break;
            }
            let (key, _) =
                item.map_err(|e| sled_error(&self.path, "scanning the queue", Words(&e)))?;
            let visible = key_visible(&key).ok_or_else(|| bad_queue_key(&self.path, &key))?;
            if visible > now_ms {
                break;
            }
            let tkey = &key[8..];
            let task = h
                .tasks
                .get(tkey)
                .map_err(|e| sled_error(&self.path, "reading the tasks tree", Words(&e)))?;
            if let Some(bytes) = task {
                let task = decode_task(&String::from_utf8_lossy(tkey), &bytes, SPACE)?;
                if !filter.accepts(&task) || task.overdue(now_ms).is_some() {
                    continue;
                }
            }
            // A stray entry (no task) is kept so the transaction drops it.
            due.push(key);
        }
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let trees = (&h.tasks, &h.queue);
        let result = trees.transaction(|(tasks, queue)| {
            #[cfg(test)]
            injected_write_fault(&self.shared)?;
            let mut leases = Vec::with_capacity(due.len());
            for qkey in &due {
                let tkey = &qkey[8..]; // 8 bytes at least: checked while scanning
                let Some(bytes) = tasks.get(tkey)? else {
                    // Appends remove both together, so this cannot happen; should it, drop the
                    // stray entry rather than fail every lease from now on (memory skips it too).
                    tracing::warn!(
                        store = %self.path.display(),
                        task = %String::from_utf8_lossy(tkey),
                        "dropping a queue entry whose task is gone"
                    );
                    queue.remove(qkey)?;
                    continue;
                };
                let mut task =
                    decode_task(&String::from_utf8_lossy(tkey), &bytes, SPACE).map_err(abort)?;
                task.lease_attempt = task.lease_attempt.saturating_add(1);
                task.visible_at_ms = expires_at_ms;
                task.held = true;
                task.heartbeat_details = None;
                let bytes = encode_meta("task record", &task).map_err(abort)?;
                tasks.insert(tkey, bytes)?;
                queue.remove(qkey)?;
                queue.insert(queue_key(expires_at_ms, &task.id), &[] as &[u8])?;
                leases.push(Lease {
                    id: task.id,
                    kind: task.kind,
                    lease_attempt: task.lease_attempt,
                    expires_at_ms,
                });
            }
            Ok(leases)
        });
        self.txn_result("leasing tasks", result)
    }

    /// One delete (see [`Store::delete_session`]): checks the session, then removes its
    /// events and record and writes its tombstone in one transaction. (This thread is the
    /// only writer: nothing changes between the checks and the transaction.)
    fn delete(&self, sid: &str, now_ms: u64) -> Result<SessionInfo> {
        let h = &self.handles;
        let read_error = |tree: &str, e: sled::Error| {
            sled_error(&self.path, &format!("reading the {tree} tree"), Words(&e))
        };
        let info = match h
            .sessions
            .get(sid.as_bytes())
            .map_err(|e| read_error("sessions", e))?
        {
            Some(bytes) => decode_info(sid, &bytes, SPACE)?,
            None => return Err(unknown_session(sid)),
        };
        let first_task = match h
            .tasks
            .range(seq_key(sid, 0)..=seq_key(sid, u64::MAX))
            .next()
            .transpose()
            .map_err(|e| read_error("tasks", e))?
        {
            Some((key, bytes)) => Some(decode_task(&String::from_utf8_lossy(&key), &bytes, SPACE)?),
            None => None,
        };
        check_deletable(&info, first_task.as_ref())?;
        let tombstone = encode_meta(
            "tombstone",
            &Tombstone {
                deleted_at_ms: now_ms,
                events: info.events,
            },
        )?;
        let trees = (&h.events, &h.sessions);
        let result = trees.transaction(|(events, sessions)| {
            #[cfg(test)]
            injected_write_fault(&self.shared)?;
            for seq in 1..=info.events {
                events.remove(seq_key(sid, seq))?;
            }
            sessions.remove(sid.as_bytes())?;
            sessions.insert(tombstone_key(sid), tombstone.as_slice())?;
            Ok(())
        });
        self.txn_result("deleting a session", result)?;
        Ok(info)
    }

    fn extend(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        let h = &self.handles;
        let expires_at_ms = now_ms.saturating_add(lease_ms);
        let key = task_key(id);
        let trees = (&h.tasks, &h.queue);
        let result = trees.transaction(|(tasks, queue)| {
            #[cfg(test)]
            injected_write_fault(&self.shared)?;
            let task = match tasks.get(&key)? {
                Some(bytes) => Some(decode_task(id, &bytes, SPACE).map_err(abort)?),
                None => None,
            };
            lease_current(task.as_ref(), id, lease_attempt, now_ms).map_err(abort)?;
            let Some(mut task) = task else {
                return Ok(()); // unreachable: lease_current rejects a missing task
            };
            queue.remove(queue_key(task.visible_at_ms, id))?;
            task.visible_at_ms = expires_at_ms;
            if details.is_some() {
                task.heartbeat_details = details.clone();
            }
            let bytes = encode_meta("task record", &task).map_err(abort)?;
            tasks.insert(key.as_slice(), bytes)?;
            queue.insert(queue_key(expires_at_ms, id), &[] as &[u8])?;
            Ok(())
        });
        self.txn_result("extending a lease", result)?;
        Ok(expires_at_ms)
    }

    /// Makes every leased task leasable at `now_ms`, keeping its lease attempt.
    fn release(&self, now_ms: u64) -> Result<usize> {
        let h = &self.handles;
        // Leased tasks are queued at their expiry: after now, or (lapsed, still held) before.
        // This thread is the only writer: the queue cannot change between scan and transaction.
        let mut later: Vec<sled::IVec> = Vec::new();
        for item in h.queue.iter() {
            let (key, _) =
                item.map_err(|e| sled_error(&self.path, "scanning the queue", Words(&e)))?;
            // The transaction takes the task key after the visibility time: a key too short
            // for one is damage, named here, not a panic of this thread.
            if key_visible(&key).is_none() {
                return Err(bad_queue_key(&self.path, &key));
            }
            later.push(key);
        }
        if later.is_empty() {
            return Ok(0);
        }
        let trees = (&h.tasks, &h.queue);
        let result = trees.transaction(|(tasks, queue)| {
            #[cfg(test)]
            injected_write_fault(&self.shared)?;
            let mut released = 0;
            for qkey in &later {
                let tkey = &qkey[8..]; // 8 bytes at least: checked while scanning
                let Some(bytes) = tasks.get(tkey)? else {
                    continue; // a stray entry; leasing drops it
                };
                let mut task =
                    decode_task(&String::from_utf8_lossy(tkey), &bytes, SPACE).map_err(abort)?;
                let Some(visible_at_ms) = released_visibility(&task, now_ms) else {
                    continue; // not leased: new, or a retry waiting for its backoff
                };
                queue.remove(qkey)?;
                task.visible_at_ms = visible_at_ms;
                task.held = false;
                let bytes = encode_meta("task record", &task).map_err(abort)?;
                tasks.insert(tkey, bytes)?;
                queue.insert(queue_key(visible_at_ms, &task.id), &[] as &[u8])?;
                released += 1;
            }
            Ok(released)
        });
        self.txn_result("releasing leases", result)
    }
}

/// The files sled writes and this store fsyncs.
struct Syncer {
    dir: PathBuf,
    db_file: File,
    blobs_dir: PathBuf,
    /// Blob files synced, with the (length, mtime) they had then.
    synced_blobs: HashMap<OsString, (u64, Option<SystemTime>)>,
}

impl Syncer {
    fn new(dir: &Path) -> std::result::Result<Syncer, String> {
        let db_path = dir.join("db");
        let db_file = File::options()
            .read(true)
            .write(true)
            .open(&db_path)
            .map_err(|e| format!("cannot open {} for syncing: {e}", db_path.display()))?;
        Ok(Syncer {
            dir: dir.to_path_buf(),
            db_file,
            blobs_dir: dir.join("blobs"),
            synced_blobs: HashMap::new(),
        })
    }

    /// Syncs what sled wrote while opening: `conf`, `db`, blobs, the directories.
    fn sync_after_open(&mut self, db: &sled::Db) -> std::result::Result<(), String> {
        let conf = self.dir.join("conf");
        File::open(&conf)
            .and_then(|f| f.sync_all())
            .map_err(|e| format!("cannot sync {}: {e}", conf.display()))?;
        self.sync(db)?;
        sync_dir_described(&self.blobs_dir)?;
        sync_dir_described(&self.dir)
    }

    /// Makes everything committed so far durable.
    fn sync(&mut self, db: &sled::Db) -> std::result::Result<(), String> {
        db.flush()
            .map_err(|e| format!("sled flush failed: {}", Words(&e)))?;
        self.db_file
            .sync_data()
            .map_err(|e| format!("fdatasync of {} failed: {e}", self.dir.join("db").display()))?;
        self.sync_blobs()
    }

    fn sync_blobs(&mut self) -> std::result::Result<(), String> {
        let listing = fs::read_dir(&self.blobs_dir)
            .map_err(|e| format!("cannot list {}: {e}", self.blobs_dir.display()))?;
        let mut seen = HashMap::with_capacity(self.synced_blobs.len());
        let mut any_new = false;
        for entry in listing {
            let entry =
                entry.map_err(|e| format!("cannot list {}: {e}", self.blobs_dir.display()))?;
            let path = entry.path();
            let meta = match entry.metadata() {
                Ok(meta) => meta,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // collected
                Err(e) => return Err(format!("cannot stat {}: {e}", path.display())),
            };
            let stamp = (meta.len(), meta.modified().ok());
            let name = entry.file_name();
            if self.synced_blobs.get(&name) != Some(&stamp) {
                match File::open(&path).and_then(|f| f.sync_data()) {
                    Ok(()) => any_new = true,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(format!("fdatasync of {} failed: {e}", path.display())),
                }
            }
            seen.insert(name, stamp);
        }
        if any_new {
            sync_dir_described(&self.blobs_dir)?;
        }
        self.synced_blobs = seen;
        Ok(())
    }
}

/// A sled error in words: sled's `Display` prints a corruption's place and backtrace in their
/// `Debug` form, which must not reach people.
struct Words<'a>(&'a sled::Error);

impl std::fmt::Display for Words<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            sled::Error::Io(e) => write!(f, "{e}"),
            sled::Error::Corruption { .. } => {
                f.write_str("sled read corrupted data from its files")
            }
            e => write!(f, "{e}"),
        }
    }
}

fn sled_error(path: &Path, doing: &str, e: impl std::fmt::Display) -> Error {
    Error::Store {
        reason: format!("sled store at {}: {doing}: {e}", path.display()),
    }
}

/// A key of the queue tree too short to begin with its visibility time, which every key this
/// store writes does ([`queue_key`]): damage on the disk.
fn bad_queue_key(path: &Path, key: &[u8]) -> Error {
    sled_error(
        path,
        "scanning the queue",
        format!(
            "bad key {key:?} ({} bytes, shorter than the 8 of its visibility time)",
            key.len()
        ),
    )
}

/// Commits `appends` in one sled transaction, in order, each seeing the ones before it.
/// The outer error is sled's (nothing committed); the inner ones are rejected appends.
fn append_all(
    h: &Handles,
    appends: &[PreparedAppend],
) -> std::result::Result<Vec<Result<()>>, GroupFailure> {
    let trees = (&h.events, &h.sessions, &h.tasks, &h.queue);
    let result = trees.transaction(|trees| {
        let mut outcomes = Vec::with_capacity(appends.len());
        for p in appends {
            outcomes.push(append_one(p, trees)?);
        }
        Ok(outcomes)
    });
    match result {
        Ok(outcomes) => Ok(outcomes),
        Err(TransactionError::Abort(e)) => Err(GroupFailure::Aborted(e.to_string())),
        Err(TransactionError::Storage(e)) => Err(GroupFailure::Storage(e.to_string())),
    }
}

/// Why a group of appends committed nothing.
#[derive(Debug)]
enum GroupFailure {
    /// The transaction was aborted; sled is as it was.
    Aborted(String),
    /// sled failed to write (a full disk): what it holds in memory is in doubt (sled 0.34 can
    /// then wait forever for a log position it never writes), so the store refuses writes from
    /// then on, as after a failed sync.
    Storage(String),
}

type TxTrees = (
    sled::transaction::TransactionalTree,
    sled::transaction::TransactionalTree,
    sled::transaction::TransactionalTree,
    sled::transaction::TransactionalTree,
);

/// One append inside the group transaction. Every check and read comes before the first
/// write, so a rejected append (`Ok(Err(..))`) writes nothing; `Err` is sled's and aborts all.
fn append_one(
    p: &PreparedAppend,
    (events, sessions, tasks, queue): &TxTrees,
) -> std::result::Result<Result<()>, ConflictableTransactionError<Error>> {
    let sid = p.session_id.as_str();
    let actual = match sessions.get(sid.as_bytes())? {
        Some(bytes) => match decode_info(sid, &bytes, SPACE) {
            Ok(info) => info.events + 1,
            Err(e) => return Ok(Err(e)),
        },
        None if sessions.get(tombstone_key(sid))?.is_some() => return Ok(Err(deleted(sid))),
        None => 1,
    };
    if actual != p.expected {
        return Ok(Err(Error::Conflict {
            session_id: sid.to_owned(),
            expected: p.expected,
            actual,
        }));
    }
    let stored_task = |id: &TaskId| -> std::result::Result<
        Result<Option<Task>>,
        ConflictableTransactionError<Error>,
    > {
        Ok(match tasks.get(task_key(id))? {
            Some(bytes) => decode_task(id, &bytes, SPACE).map(Some),
            None => Ok(None),
        })
    };
    for (id, attempt) in &p.complete {
        let task = match stored_task(id)? {
            Ok(task) => task,
            Err(e) => return Ok(Err(e)),
        };
        if let Err(e) = lease_current(task.as_ref(), id, *attempt, p.now_ms) {
            return Ok(Err(e));
        }
    }
    if let Some(fence) = &p.drop_if_unchanged {
        let task = match stored_task(&fence.id)? {
            Ok(task) => task,
            Err(e) => return Ok(Err(e)),
        };
        if let Err(e) = fence.check(task.as_ref().map(TaskFence::of).as_ref()) {
            return Ok(Err(e));
        }
    }
    // Stored tasks this append replaces or removes must decode, or it is rejected whole.
    for id in p
        .removed
        .iter()
        .chain(p.enqueued.iter().map(|(new, _)| &new.id))
    {
        if let Err(e) = stored_task(id)? {
            return Ok(Err(e));
        }
    }

    if p.count > 0 {
        for (key, record) in &p.records {
            events.insert(key.as_slice(), record.as_slice())?;
        }
        sessions.insert(sid.as_bytes(), p.info.as_slice())?;
    }
    for id in &p.removed {
        if let Some(bytes) = tasks.remove(task_key(id))? {
            let old = decode_task(id, &bytes, SPACE).map_err(abort)?;
            queue.remove(queue_key(old.visible_at_ms, id))?;
        }
    }
    for (new, bytes) in &p.enqueued {
        if let Some(old) = tasks.insert(task_key(&new.id), bytes.as_slice())? {
            let old = decode_task(&new.id, &old, SPACE).map_err(abort)?;
            queue.remove(queue_key(old.visible_at_ms, &new.id))?;
        }
        queue.insert(queue_key(new.visible_at_ms, &new.id), &[] as &[u8])?;
    }
    Ok(Ok(()))
}

fn abort(e: Error) -> ConflictableTransactionError<Error> {
    ConflictableTransactionError::Abort(e)
}

/// Fails a transaction, before it writes anything, the way sled fails one it cannot write
/// (`Storage`), when a test asked for it ([`SyncFaults::write_fails`]): nothing else makes
/// sled fail a write on demand.
///
/// [`SyncFaults::write_fails`]: super::write_queue::SyncFaults::write_fails
#[cfg(test)]
fn injected_write_fault(
    shared: &Shared,
) -> std::result::Result<(), ConflictableTransactionError<Error>> {
    match shared.faults.write_fails() {
        Some(reason) => Err(ConflictableTransactionError::Storage(sled::Error::Io(
            std::io::Error::other(reason),
        ))),
        None => Ok(()),
    }
}

#[async_trait]
impl Store for SledStore {
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
        let info = match h
            .sessions
            .get(session_id.as_bytes())
            .map_err(|e| sled_error(&self.path, "reading the sessions tree", Words(&e)))?
        {
            Some(bytes) => decode_info(session_id, &bytes, SPACE)?,
            None => return Err(unknown()),
        };
        read_events(session_id, info.events, from_seq, limit, |range| {
            h.events.range(range).map(|item| {
                item.map_err(|e| {
                    sled_error(
                        &self.path,
                        &format!("reading session {session_id:?}"),
                        Words(&e),
                    )
                })
            })
        })
    }

    async fn list_sessions(&self) -> Result<Vec<SessionInfo>> {
        let h = self.handles()?;
        let mut out = Vec::new();
        for item in h.sessions.iter() {
            let (key, bytes) =
                item.map_err(|e| sled_error(&self.path, "reading the sessions tree", Words(&e)))?;
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
        for key in h.sessions.iter().keys() {
            let key =
                key.map_err(|e| sled_error(&self.path, "reading the sessions tree", Words(&e)))?;
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

    /// For a worker of this process, appends only, and leases nothing: eager dispatch did not
    /// pay there. Each eager lease is a sled transaction of its own, where a worker's lease
    /// round takes several tasks in one, and an in-process lease costs no sync either way; at
    /// 128 sessions in flight sled ran 0.6–0.75× the turns/s with it (fjall, whose leases are
    /// cheap, ran faster). The tasks go to the workers that lease them.
    ///
    /// For a worker elsewhere (through a server), leases with the append: a remote lease is
    /// durable, so a lease round of its own costs a sync of its own, in series on the turn's
    /// path, where leased with the append it shares the append's.
    async fn append_and_lease(
        &self,
        request: AppendRequest,
        lease: &LeaseRequest,
    ) -> Result<Vec<Lease>> {
        match lease.holder {
            LeaseHolder::Remote => self.writes.append_and_lease(request, lease).await,
            LeaseHolder::InProcess => {
                self.writes.append(request).await?;
                Ok(Vec::new())
            }
        }
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
        let mut out = Vec::new();
        for item in h.queue.iter() {
            if out.len() >= max {
                break;
            }
            let (key, _) =
                item.map_err(|e| sled_error(&self.path, "scanning the queue", Words(&e)))?;
            let Some(visible) = key_visible(&key) else {
                return Err(bad_queue_key(&self.path, &key));
            };
            if visible > now_ms {
                break;
            }
            let tkey = &key[8..]; // 8 bytes at least: `key_visible` read them
            let bytes = h
                .tasks
                .get(tkey)
                .map_err(|e| sled_error(&self.path, "reading the tasks tree", Words(&e)))?;
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
        for item in h.tasks.iter() {
            let (key, bytes) =
                item.map_err(|e| sled_error(&self.path, "reading the tasks tree", Words(&e)))?;
            out.push(decode_task(&String::from_utf8_lossy(&key), &bytes, SPACE)?);
        }
        Ok(out)
    }

    async fn task(&self, id: &TaskId) -> Result<Option<Task>> {
        let h = self.handles()?;
        match h
            .tasks
            .get(task_key(id))
            .map_err(|e| sled_error(&self.path, "reading the tasks tree", Words(&e)))?
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
#[path = "sled_tests.rs"]
mod tests;
