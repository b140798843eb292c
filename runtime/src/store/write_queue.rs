//! The write queue between an embedded store and its writer, shared by
//! [`SledStore`](super::sled::SledStore) and [`FjallStore`](super::fjall::FjallStore).
//!
//! Every write (append, lease, lease extension, release) is prepared on the caller's task
//! (validation, encoding: [`PreparedAppend`]) and run by the store's writer ([`ProcessBatch`]),
//! which applies a batch of writes in order, answers a rejected one at once and holds the
//! answers of the others ([`Pending`]) until one sync makes the whole batch durable. That
//! sync's outcome answers them all ([`Shared::settle`]); after a failed one the store refuses
//! further writes until it is reopened ([`Shared::refusal`]). How a batch is applied and made
//! durable is each engine's own: see their module docs.
//!
//! # Where a batch runs: the caller's thread when the writer is idle, else the writer thread
//!
//! The writer's state sits behind a lock ([`SharedWriter`]). On a store that allows it
//! ([`LoneWrites::OnCallersThread`], fjall's; not sled's, whose sync is a sled flush and then
//! an fdatasync and measured no better), a write that finds writes not
//! concurrent (the writer thread's last batch held one at most), nothing queued and the lock
//! free runs as a batch of one on the caller's own thread, synced there, and is answered
//! before the caller awaits anything. Otherwise it goes through an `mpsc` channel to
//! the writer thread and the caller awaits a `tokio::sync::oneshot`; the thread takes every
//! write queued so far, at most [`MAX_BATCH`] ([`next_batch`]), and processes them under the
//! lock. So a lone write, the common case of one session's turn, saves the two thread
//! wake-ups of the trip to the writer thread and back (measured: a turn on a store in memory,
//! where the sync costs nothing, took 0.20 ms through the thread and 0.14 ms inline); while
//! one write syncs inline, the writes that arrive queue for the thread and share its next
//! sync, as before, and once the thread sees a batch of more than one, writes keep going to
//! it until it sees single writes again, so concurrent sessions keep batching as before. The
//! price is that the caller's tokio worker waits for that one sync, as a database client's
//! thread would; on a current-thread runtime, or a multi-thread one with one worker, that
//! would stall every other task and end group commit, so there every write goes to the
//! thread. Order is unchanged: either way, a write runs after every write whose answer its
//! caller saw.
//!
//! Error texts name the engine and its sync ("sled store at …: sync failed", "fjall store at
//! …: persist failed"): an [`Engine`] carries those words.

use super::files::open_error;
use super::keys::{encode_meta, seq_key};
use super::{
    check_request, AppendRequest, Lease, LeaseRequest, NewTask, SessionInfo, SyncTimes, Task,
    TaskFence, TaskFilter, TaskId,
};
use crate::codec;
use crate::error::{Error, Result};
use cairn_ledger::JsonText;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// Writes in one batch at most, bounding the wait of the first one.
pub const MAX_BATCH: usize = 512;

/// How an engine is named in error texts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Engine {
    /// The engine: "sled" in "sled store at …".
    pub(super) name: &'static str,
    /// What makes a batch durable: "sync" in "sync failed".
    pub(super) sync: &'static str,
}

impl Engine {
    /// Why writes are refused after a failed sync.
    pub(super) fn refusal(self, path: &Path, reason: &str) -> Error {
        Error::Store {
            reason: format!(
                "{} store at {} refuses writes after a failed {} ({reason}); reopen it",
                self.name,
                path.display(),
                self.sync
            ),
        }
    }
}

/// What the store and its writer thread share.
#[derive(Default)]
pub(super) struct Shared {
    /// Set when a batch could not be made durable; the store then refuses writes.
    failed: Mutex<Option<String>>,
    /// Batches made durable, or tried to (sled's flushes, fjall's persists: for tests of group
    /// commit).
    pub(super) syncs: AtomicU64,
    /// How long those took ([`Shared::synced`]).
    sync_times: Mutex<SyncTimes>,
    /// Writes committed on their caller's thread rather than the writer's (for tests).
    pub(super) inline: AtomicU64,
    /// Faults injected into the syncs (tests).
    #[cfg(test)]
    pub(super) faults: SyncFaults,
}

/// Faults injected into an engine's syncs (and sled's transactions), for tests of the refusal
/// paths: nothing below the engines can make a real fdatasync or sled write fail, or wait, on
/// demand here.
#[cfg(test)]
#[derive(Default)]
pub(super) struct SyncFaults {
    /// Syncs still to fail as if the disk had refused them.
    pub(super) failing: AtomicU64,
    /// sled transactions of leases, lease extensions, releases and deletes still to fail as if
    /// sled could not write (its `TransactionError::Storage`), committing nothing.
    pub(super) failing_writes: AtomicU64,
    /// Held by the next sync until [`SyncFaults::release`].
    held: Mutex<Option<mpsc::Receiver<()>>>,
    release: Mutex<Option<mpsc::Sender<()>>>,
    /// Told when the held sync has begun to wait.
    reached: Mutex<Option<mpsc::Sender<()>>>,
}

#[cfg(test)]
impl SyncFaults {
    /// Makes the next sync wait, before it does anything, until [`SyncFaults::release`].
    /// The receiver given back hears once that sync waits: by then its batch is applied and
    /// committed, and whatever it answers before its sync is answered.
    pub(super) fn hold_next(&self) -> mpsc::Receiver<()> {
        let (release, held) = mpsc::channel();
        let (reached, waiting) = mpsc::channel();
        *self.held.lock().expect("held") = Some(held);
        *self.release.lock().expect("release") = Some(release);
        *self.reached.lock().expect("reached") = Some(reached);
        waiting
    }

    /// Lets a held sync go on.
    pub(super) fn release(&self) {
        if let Some(release) = self.release.lock().expect("release").take() {
            let _ = release.send(());
        }
    }

    /// Waits if this sync is held, then tells whether it is to fail (counting it off), and
    /// with what words.
    pub(super) fn before_sync(&self) -> Option<String> {
        let held = self.held.lock().expect("held").take();
        if let Some(held) = held {
            if let Some(reached) = self.reached.lock().expect("reached").take() {
                let _ = reached.send(());
            }
            let _ = held.recv();
        }
        self.failing
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                left.checked_sub(1)
            })
            .ok()
            .map(|_| "injected fault: fdatasync failed (EIO)".to_owned())
    }

    /// Whether this sled write is to fail (counting it off), and with what words.
    pub(super) fn write_fails(&self) -> Option<String> {
        self.failing_writes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                left.checked_sub(1)
            })
            .ok()
            .map(|_| "injected fault: sled could not write (ENOSPC)".to_owned())
    }
}

impl Shared {
    pub(super) fn failed(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        // A plain value: consistent even if a holder panicked.
        self.failed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts a batch made durable, or tried to, in `took`.
    pub(super) fn synced(&self, took: Duration) {
        crate::stages::mark("sync.end");
        self.syncs.fetch_add(1, Ordering::Relaxed);
        // A plain value: consistent even if a holder panicked.
        self.sync_times
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .record(took);
    }

    /// A copy of the sync times so far.
    pub(super) fn sync_times(&self) -> SyncTimes {
        self.sync_times
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Why writes are refused, once a sync failed.
    pub(super) fn refusal(&self, engine: Engine, path: &Path) -> Option<Error> {
        let failed = self.failed();
        failed.as_ref().map(|reason| engine.refusal(path, reason))
    }

    /// Why writes are refused, in words ([`Store::write_refusal`](super::Store::write_refusal)).
    pub(super) fn refusal_words(&self, engine: Engine, path: &Path) -> Option<String> {
        self.refusal(engine, path).map(|refused| match refused {
            Error::Store { reason } => reason,
            other => other.to_string(),
        })
    }

    /// Records a failed sync (the first reason stays), then answers every write of the batch
    /// with its outcome.
    pub(super) fn settle(
        &self,
        synced: &std::result::Result<(), String>,
        pending: Vec<Pending>,
        engine: Engine,
        path: &Path,
    ) {
        if let Err(reason) = synced {
            let mut failed = self.failed();
            if failed.is_none() {
                // Once: every write after it is refused with these words.
                tracing::error!(
                    store = %path.display(),
                    engine = engine.name,
                    %reason,
                    "a batch could not be made durable; the store refuses writes until it is reopened"
                );
                *failed = Some(reason.clone());
            }
        }
        for p in pending {
            p.answer(synced, engine, path);
        }
    }
}

/// A write for the writer thread, with where to answer.
pub(super) enum Write {
    Append(PreparedAppend, oneshot::Sender<Result<()>>),
    /// An append, then an in-process lease at its `now_ms`, answered together once durable
    /// ([`Store::append_and_lease`](super::Store::append_and_lease)).
    AppendThenLease(
        PreparedAppend,
        LeaseRequest,
        oneshot::Sender<Result<Vec<Lease>>>,
    ),
    Lease {
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: TaskFilter,
        /// Answered once durable; else once committed
        /// ([`Store::lease_tasks_in_process`](super::Store::lease_tasks_in_process)), unless
        /// a write before it in its batch waits for the batch's sync (an append that may have
        /// queued the tasks it leases): then with that write, once durable.
        durable: bool,
        reply: oneshot::Sender<Result<Vec<Lease>>>,
    },
    Extend {
        id: TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
        reply: oneshot::Sender<Result<u64>>,
    },
    Release {
        now_ms: u64,
        reply: oneshot::Sender<Result<usize>>,
    },
    Delete {
        session_id: String,
        now_ms: u64,
        reply: oneshot::Sender<Result<SessionInfo>>,
    },
}

impl Write {
    /// Answers the write with `error` instead of running it.
    pub(super) fn refuse(self, error: Error) {
        // A caller that stopped waiting dropped its receiver; nothing to do then.
        let _ = match self {
            Write::Append(_, reply) => reply.send(Err(error)).is_ok(),
            Write::AppendThenLease(_, _, reply) => reply.send(Err(error)).is_ok(),
            Write::Lease { reply, .. } => reply.send(Err(error)).is_ok(),
            Write::Extend { reply, .. } => reply.send(Err(error)).is_ok(),
            Write::Release { reply, .. } => reply.send(Err(error)).is_ok(),
            Write::Delete { reply, .. } => reply.send(Err(error)).is_ok(),
        };
    }
}

/// Waits for the next write, then takes every write queued after it, up to [`MAX_BATCH`] in
/// all. `None` once the store closed its end and every write was taken.
pub(super) fn next_batch(queue: &mpsc::Receiver<Write>) -> Option<Vec<Write>> {
    let first = queue.recv().ok()?;
    let mut batch = vec![first];
    while batch.len() < MAX_BATCH {
        match queue.try_recv() {
            Ok(write) => batch.push(write),
            Err(_) => break,
        }
    }
    Some(batch)
}

/// An engine's batch processing: applies a batch in order, makes it durable, answers it.
pub(super) trait ProcessBatch: Send {
    /// Processes a batch on a caller's thread: answered, or answered once durable, when it
    /// returns.
    fn process(&mut self, batch: Vec<Write>);

    /// Processes a batch on the writer thread, which may leave its sync running when it
    /// returns (see fjall's writer) and may take the writes queued since with `more`; by
    /// default as [`process`](Self::process).
    fn process_on_writer_thread(
        &mut self,
        batch: Vec<Write>,
        more: &mut dyn FnMut() -> Vec<Write>,
    ) {
        let _ = more;
        self.process(batch);
    }
}

/// The writer's state behind a lock, shared by the writer thread and callers that commit on
/// their own thread while the writer is idle (see [`WriteQueue::submit`]).
pub(super) struct SharedWriter<W> {
    writer: Mutex<W>,
    /// Writes sent to the writer thread and not yet taken by it.
    queued: AtomicUsize,
    /// Writes in the last batch the writer thread took: more than one means writes are
    /// concurrent, and then every write goes to the thread (see [`WriterHandle::try_process`]).
    last_batch: AtomicUsize,
    /// Whether callers may run a batch at all; else every write goes to the thread.
    inline: bool,
}

/// Where a lone write (one that finds the writer idle and nothing queued) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LoneWrites {
    /// On its caller's thread, as a batch of one (fjall's).
    OnCallersThread,
    /// On the writer thread, like every other write (sled's).
    OnWriterThread,
}

impl<W: ProcessBatch + 'static> SharedWriter<W> {
    fn new(writer: W, lone_writes: LoneWrites) -> Arc<SharedWriter<W>> {
        Arc::new(SharedWriter {
            writer: Mutex::new(writer),
            queued: AtomicUsize::new(0),
            last_batch: AtomicUsize::new(0),
            inline: lone_writes == LoneWrites::OnCallersThread,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, W> {
        // The writer catches fjall's panics itself; its state stays usable.
        self.writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The writer thread: takes batches off the queue and processes each under the lock.
    fn run(&self, queue: &mpsc::Receiver<Write>) {
        while let Some(batch) = next_batch(queue) {
            self.queued.fetch_sub(batch.len(), Ordering::AcqRel);
            self.last_batch.store(batch.len(), Ordering::Release);
            let mut taken = batch.len();
            let mut more = || {
                let mut extra = Vec::new();
                while taken < MAX_BATCH {
                    match queue.try_recv() {
                        Ok(write) => {
                            extra.push(write);
                            taken += 1;
                        }
                        Err(_) => break,
                    }
                }
                self.queued.fetch_sub(extra.len(), Ordering::AcqRel);
                extra
            };
            let mut writer = self.lock();
            writer.process_on_writer_thread(batch, &mut more);
            // Writes taken while the last batch synced count as concurrent with this one.
            self.last_batch.store(taken, Ordering::Release);
            drop(writer);
        }
    }
}

/// Whether the caller runs on a tokio runtime with more than one worker thread. On a
/// current-thread runtime, or a multi-thread one with a single worker (tokio's default on a
/// machine or container with one CPU), a commit on the caller's thread would stop every other
/// task for its sync: concurrent writes would never gather into one batch, and since no write
/// would then reach the writer thread, its batches would never show them concurrent (measured:
/// 16 and 128 sessions at one session's rate, a commit per write). There every write goes to
/// the writer thread.
fn on_more_than_one_worker() -> bool {
    tokio::runtime::Handle::try_current().is_ok_and(|handle| {
        handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
            && handle.metrics().num_workers() > 1
    })
}

/// What a [`WriteQueue`] needs of a [`SharedWriter`]: to commit on the caller's thread, and to
/// count what it queues for the writer thread.
pub(super) trait WriterHandle: Send + Sync {
    /// Processes `write` on this thread when writes are not concurrent (the writer thread's
    /// last batch held one write at most), nothing is queued for the thread and the writer is
    /// not busy; else gives it back.
    fn try_process(&self, write: Write) -> Option<Write>;
    /// Counts a write sent to the writer thread.
    fn sent(&self);
    /// Uncounts a write the writer thread will never take.
    fn unsent(&self);
}

impl<W: ProcessBatch> WriterHandle for SharedWriter<W> {
    fn try_process(&self, write: Write) -> Option<Write> {
        if !self.inline
            || self.queued.load(Ordering::Acquire) != 0
            || self.last_batch.load(Ordering::Acquire) > 1
            || !on_more_than_one_worker()
        {
            return Some(write);
        }
        match self.writer.try_lock() {
            Ok(mut writer) => {
                writer.process(vec![write]);
                None
            }
            Err(std::sync::TryLockError::Poisoned(poisoned)) => {
                poisoned.into_inner().process(vec![write]);
                None
            }
            Err(std::sync::TryLockError::WouldBlock) => Some(write),
        }
    }

    fn sent(&self) {
        self.queued.fetch_add(1, Ordering::AcqRel);
    }

    fn unsent(&self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An accepted write's answer, held until its batch is durable.
pub(super) enum Pending {
    Append(oneshot::Sender<Result<()>>),
    Lease(oneshot::Sender<Result<Vec<Lease>>>, Vec<Lease>),
    Extend(oneshot::Sender<Result<u64>>, u64),
    Release(oneshot::Sender<Result<usize>>, usize),
    Delete(oneshot::Sender<Result<SessionInfo>>, SessionInfo),
}

impl Pending {
    /// Answers the write: its result when `synced` is `Ok`, else a `Store` error saying the
    /// write is not durable.
    pub(super) fn answer(
        self,
        synced: &std::result::Result<(), String>,
        engine: Engine,
        path: &Path,
    ) {
        let error = |reason: &String| Error::Store {
            reason: format!(
                "{} store at {}: {} failed, the write is not durable: {reason}",
                engine.name,
                path.display(),
                engine.sync
            ),
        };
        // A caller that stopped waiting dropped its receiver; nothing to do then.
        match self {
            Pending::Append(reply) => {
                let _ = reply.send(synced.as_ref().map(|_| ()).map_err(error));
            }
            Pending::Lease(reply, leases) => {
                let _ = reply.send(synced.as_ref().map(|_| leases).map_err(error));
            }
            Pending::Extend(reply, expiry) => {
                let _ = reply.send(synced.as_ref().map(|_| expiry).map_err(error));
            }
            Pending::Release(reply, count) => {
                let _ = reply.send(synced.as_ref().map(|_| count).map_err(error));
            }
            Pending::Delete(reply, info) => {
                let _ = reply.send(synced.as_ref().map(|_| info).map_err(error));
            }
        }
    }
}

/// An append, validated and encoded by the caller.
pub(super) struct PreparedAppend {
    pub(super) session_id: String,
    pub(super) expected: u64,
    /// Key and record of each event.
    pub(super) records: Vec<(Vec<u8>, Vec<u8>)>,
    /// Events of the session after the append; 0 when it records nothing (no session record).
    pub(super) count: u64,
    /// The session record to write.
    pub(super) info: Vec<u8>,
    pub(super) complete: Vec<(TaskId, u32)>,
    /// The task to drop only if it is unchanged ([`AppendRequest::drop_if_unchanged`]).
    pub(super) drop_if_unchanged: Option<TaskFence>,
    pub(super) now_ms: u64,
    /// Completed, cancelled and fenced tasks.
    pub(super) removed: Vec<TaskId>,
    /// Tasks to enqueue, with their encoded records.
    pub(super) enqueued: Vec<(NewTask, Vec<u8>)>,
}

impl PreparedAppend {
    pub(super) fn new(request: AppendRequest) -> Result<PreparedAppend> {
        check_request(&request)?;
        let sid = request.session_id.as_str();
        let expected = request.expected_next_seq;
        let mut records = Vec::with_capacity(request.events.len());
        for (i, e) in request.events.iter().enumerate() {
            records.push((seq_key(sid, expected + i as u64), codec::encode(e)?));
        }
        let count = expected.saturating_sub(1) + records.len() as u64;
        let info = encode_meta(
            "session record",
            &SessionInfo {
                session_id: sid.to_owned(),
                status: request.status,
                events: count,
                updated_at_ms: request.now_ms,
            },
        )?;
        let removed = request
            .complete
            .iter()
            .map(|(id, _)| id.clone())
            .chain(request.cancel.iter().cloned())
            .chain(
                request
                    .drop_if_unchanged
                    .iter()
                    .map(|fence| fence.id.clone()),
            )
            .collect();
        let mut enqueued = Vec::with_capacity(request.enqueue.len());
        for new in request.enqueue {
            let task = Task::queued(&new);
            let bytes = encode_meta("task record", &task)?;
            enqueued.push((new, bytes));
        }
        Ok(PreparedAppend {
            session_id: request.session_id,
            expected,
            records,
            count,
            info,
            complete: request.complete,
            drop_if_unchanged: request.drop_if_unchanged,
            now_ms: request.now_ms,
            removed,
            enqueued,
        })
    }
}

/// The store's end of the queue: hands writes to the writer thread and awaits their answers.
pub(super) struct WriteQueue {
    engine: Engine,
    path: PathBuf,
    /// To the writer thread; `None` once closed.
    sender: Option<mpsc::Sender<Write>>,
    pub(super) shared: Arc<Shared>,
    /// The writer, for commits on the caller's thread and to count what is queued for its
    /// thread; `None` once closed.
    writer: Option<Arc<dyn WriterHandle>>,
}

impl WriteQueue {
    /// Starts the writer thread, named `thread_name`, running `writer`; returns the queue
    /// that feeds it and the thread's handle, to join after [`WriteQueue::close`].
    pub(super) fn start<W: ProcessBatch + 'static>(
        engine: Engine,
        path: &Path,
        shared: Arc<Shared>,
        writer: W,
        lone_writes: LoneWrites,
        thread_name: &str,
    ) -> Result<(WriteQueue, std::thread::JoinHandle<()>)> {
        let (sender, queue) = mpsc::channel();
        let writer = SharedWriter::new(writer, lone_writes);
        let thread_writer = Arc::clone(&writer);
        let thread = std::thread::Builder::new()
            .name(thread_name.to_owned())
            .spawn(move || thread_writer.run(&queue))
            .map_err(|e| open_error(path, format!("cannot start the writer thread: {e}")))?;
        let queue = WriteQueue {
            engine,
            path: path.to_path_buf(),
            sender: Some(sender),
            shared,
            writer: Some(writer),
        };
        Ok((queue, thread))
    }

    /// Closes the queue: the writer stops once it has answered what it has, and the writer
    /// thread, holding the last reference to the writer, drops it (and the engine's handles)
    /// as it ends.
    pub(super) fn close(&mut self) {
        drop(self.sender.take());
        drop(self.writer.take());
    }

    /// Refuses writes early once a sync failed (the writer thread refuses them too).
    fn check_writable(&self) -> Result<()> {
        match self.shared.refusal(self.engine, &self.path) {
            Some(refused) => Err(refused),
            None => Ok(()),
        }
    }

    /// Runs a write and waits for its answer: on this thread when the writer is idle and
    /// nothing is queued for it (see the module docs), else on the writer thread.
    async fn submit<T>(&self, write: Write, answer: oneshot::Receiver<Result<T>>) -> Result<T> {
        crate::stages::mark("write.submitted");
        self.check_writable()?;
        let stopped = || Error::Store {
            reason: format!(
                "{} store at {}: the writer thread has stopped",
                self.engine.name,
                self.path.display()
            ),
        };
        let sender = self.sender.as_ref().ok_or_else(stopped)?;
        let writer = self.writer.as_ref().ok_or_else(stopped)?;
        let Some(write) = writer.try_process(write) else {
            // Committed here, and answered: the answer is ready.
            self.shared.inline.fetch_add(1, Ordering::Relaxed);
            return answer.await.map_err(|_| stopped())?;
        };
        writer.sent();
        if sender.send(write).is_err() {
            writer.unsent();
            return Err(stopped());
        }
        answer.await.map_err(|_| stopped())?
    }

    /// [`Store::append`](super::Store::append).
    pub(super) async fn append(&self, request: AppendRequest) -> Result<()> {
        let prepared = PreparedAppend::new(request)?;
        let (reply, answer) = oneshot::channel();
        self.submit(Write::Append(prepared, reply), answer).await
    }

    /// [`Store::append_and_lease`](super::Store::append_and_lease).
    pub(super) async fn append_and_lease(
        &self,
        request: AppendRequest,
        lease: &LeaseRequest,
    ) -> Result<Vec<Lease>> {
        let prepared = PreparedAppend::new(request)?;
        let (reply, answer) = oneshot::channel();
        let write = Write::AppendThenLease(prepared, lease.clone(), reply);
        self.submit(write, answer).await
    }

    /// [`Store::lease_tasks`](super::Store::lease_tasks) when `durable`, else
    /// [`Store::lease_tasks_in_process`](super::Store::lease_tasks_in_process).
    pub(super) async fn lease(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
        durable: bool,
    ) -> Result<Vec<Lease>> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let (reply, answer) = oneshot::channel();
        let write = Write::Lease {
            now_ms,
            lease_ms,
            max,
            filter: filter.clone(),
            durable,
            reply,
        };
        self.submit(write, answer).await
    }

    /// [`Store::extend_lease`](super::Store::extend_lease).
    pub(super) async fn extend(
        &self,
        id: &TaskId,
        lease_attempt: u32,
        now_ms: u64,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        let (reply, answer) = oneshot::channel();
        let write = Write::Extend {
            id: id.clone(),
            lease_attempt,
            now_ms,
            lease_ms,
            details,
            reply,
        };
        self.submit(write, answer).await
    }

    /// [`Store::release_leases`](super::Store::release_leases).
    pub(super) async fn release(&self, now_ms: u64) -> Result<usize> {
        let (reply, answer) = oneshot::channel();
        self.submit(Write::Release { now_ms, reply }, answer).await
    }

    /// [`Store::delete_session`](super::Store::delete_session).
    pub(super) async fn delete(&self, session_id: &str, now_ms: u64) -> Result<SessionInfo> {
        // No session of an invalid id was ever stored.
        if super::check_session_id(session_id).is_err() {
            return Err(super::unknown_session(session_id));
        }
        let (reply, answer) = oneshot::channel();
        let write = Write::Delete {
            session_id: session_id.to_owned(),
            now_ms,
            reply,
        };
        self.submit(write, answer).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLED: Engine = Engine {
        name: "sled",
        sync: "sync",
    };
    const FJALL: Engine = Engine {
        name: "fjall",
        sync: "persist",
    };

    fn reason(error: Error) -> String {
        match error {
            Error::Store { reason } => reason,
            other => panic!("expected a Store error, got {other:?}"),
        }
    }

    /// The texts each engine produced before the queue was shared, word for word.
    #[tokio::test]
    async fn error_texts_name_the_engine_and_its_sync() {
        let path = Path::new("/s");
        for (engine, refused, failed) in [
            (
                SLED,
                "sled store at /s refuses writes after a failed sync (disk); reopen it",
                "sled store at /s: sync failed, the write is not durable: disk",
            ),
            (
                FJALL,
                "fjall store at /s refuses writes after a failed persist (disk); reopen it",
                "fjall store at /s: persist failed, the write is not durable: disk",
            ),
        ] {
            let shared = Shared::default();
            assert!(shared.refusal(engine, path).is_none());
            let (reply, answer) = oneshot::channel();
            shared.settle(
                &Err("disk".to_owned()),
                vec![Pending::Extend(reply, 7)],
                engine,
                path,
            );
            let answered = answer.await.expect("answered").expect_err("not durable");
            assert_eq!(reason(answered), failed);
            let refusal = shared
                .refusal(engine, path)
                .expect("refuses after a failure");
            assert_eq!(reason(refusal), refused);
            // The first failure is the one named.
            shared.settle(&Err("later".to_owned()), Vec::new(), engine, path);
            assert_eq!(
                reason(shared.refusal(engine, path).expect("refuses")),
                refused
            );
        }
    }
}
