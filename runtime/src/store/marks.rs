//! Per-session high-water marks: an independent record of the events each session had durably,
//! so that an embedded engine that loses acknowledged events while recovering (sled drops a
//! damaged log and everything after it without an error; fjall truncates a damaged journal)
//! is caught and the loss named by session and seq, instead of an emptier store that looks fine.
//!
//! # The file
//!
//! `cairn-hwm` in the store directory is an append-only journal of lines, one per flush:
//!
//! ```text
//! v2 crc32=1c291ca3 s1:12 s2:7
//! ```
//!
//! Each line lists sessions whose last durable seq rose since the previous line, with a CRC32
//! of everything after the CRC field. A `forget` line (`forget crc32=... s1`) drops the marks
//! of deleted sessions: a deleted session is not a loss, and its mark must not come back. Reading takes the highest seq seen per session. A line
//! that fails its check (a torn last write, or damage) is skipped and noted: the marks are a
//! lower bound, so a skipped line can only weaken the check, never invent a loss. A store
//! written before per-session marks has a single `cairn-hwm v1 events=N crc32=...` line (the
//! total), which is still checked as a total. When the journal has grown well past the size of
//! a full listing, it is rewritten as one line through a temporary file and `rename`.
//!
//! # Deleting a session
//!
//! [`MarkedStore::delete_session`] writes the `forget` line (synced) before the store deletes
//! anything, so a crash between the two leaves a store that still has the session and marks
//! that no longer name it: a weaker check for that session, never a claimed loss, and the next
//! open rewrites the marks from the listing, which names it again. A delete the store refuses
//! (a running session) puts the mark back at once.
//!
//! # Why it cannot claim a loss that did not happen
//!
//! [`MarkedStore`] raises a session's mark only after its `append` returned `Ok`, which for the
//! embedded stores means the events are durable; the journal is written by a background thread
//! every [`MARKS_INTERVAL`] (one `fdatasync` per interval, not per append) and once more when the
//! store closes. So a mark never exceeds what the store acknowledged, and it lags the
//! acknowledged writes by at most the interval: damage to the very last writes before a crash
//! can pass unseen, anything older cannot.

pub(crate) use super::files::sync_dir;
use super::{
    AppendRequest, Lease, LeaseRequest, SessionInfo, Store, SyncTimes, Task, TaskFilter, TaskId,
};
use crate::error::{Error, Result};
use crate::event::EventEnvelope;
use async_trait::async_trait;
use cairn_ledger::JsonText;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The marks file in a store directory.
pub const MARKS_FILE: &str = "cairn-hwm";
/// The marks are written at most this often.
pub const MARKS_INTERVAL: Duration = Duration::from_millis(100);

/// The marks as read from a file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Marks {
    /// Per session, the last seq known durable.
    pub sessions: BTreeMap<String, u64>,
    /// A total event count from a store written before per-session marks (`v1`).
    pub legacy_total: Option<u64>,
    /// Lines that failed their check and were skipped (1-based line numbers).
    pub skipped_lines: Vec<usize>,
}

/// Acknowledged events a store no longer has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loss {
    /// The session; `None` for a loss only known as a total (a `v1` mark).
    pub session_id: Option<String>,
    /// The first seq missing.
    pub first_seq: u64,
    /// The last seq missing (the session's mark).
    pub last_seq: u64,
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.session_id {
            Some(sid) if self.first_seq == self.last_seq => {
                write!(f, "session {sid:?} seq {}", self.first_seq)
            }
            Some(sid) => write!(
                f,
                "session {sid:?} seqs {}..={}",
                self.first_seq, self.last_seq
            ),
            None => write!(
                f,
                "{} event(s) of unknown sessions (the store's old total mark)",
                self.last_seq - self.first_seq + 1
            ),
        }
    }
}

impl Marks {
    /// Reads the marks of the store in `dir`; no file gives empty marks.
    pub fn read(dir: &Path) -> std::io::Result<Marks> {
        let bytes = match fs::read(dir.join(MARKS_FILE)) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Marks::default()),
            Err(e) => return Err(e),
        };
        Ok(Marks::parse(&bytes))
    }

    /// Parses a marks file (never fails: bad lines are skipped and noted).
    pub fn parse(bytes: &[u8]) -> Marks {
        let mut marks = Marks::default();
        for (i, line) in bytes.split(|b| *b == b'\n').enumerate() {
            if line.is_empty() {
                continue;
            }
            let parsed = std::str::from_utf8(line).ok().and_then(parse_line);
            match parsed {
                Some(Line::Total(total)) => {
                    marks.legacy_total = Some(marks.legacy_total.unwrap_or(0).max(total))
                }
                Some(Line::Sessions(list)) => {
                    for (sid, seq) in list {
                        let mark = marks.sessions.entry(sid).or_insert(0);
                        *mark = (*mark).max(seq);
                    }
                }
                Some(Line::Forget(list)) => {
                    for sid in list {
                        marks.sessions.remove(&sid);
                    }
                }
                None => marks.skipped_lines.push(i + 1),
            }
        }
        marks
    }

    /// What the listed sessions lack of these marks: every session whose recorded event count
    /// is below its mark (or that is gone), and a shortfall of the old total mark.
    pub fn losses(&self, listed: &[SessionInfo]) -> Vec<Loss> {
        let have: HashMap<&str, u64> = listed
            .iter()
            .map(|i| (i.session_id.as_str(), i.events))
            .collect();
        let mut losses = Vec::new();
        for (sid, mark) in &self.sessions {
            let events = have.get(sid.as_str()).copied().unwrap_or(0);
            if events < *mark {
                losses.push(Loss {
                    session_id: Some(sid.clone()),
                    first_seq: events + 1,
                    last_seq: *mark,
                });
            }
        }
        if let Some(total) = self.legacy_total {
            let stored: u64 = listed.iter().map(|i| i.events).sum();
            if stored < total {
                losses.push(Loss {
                    session_id: None,
                    first_seq: stored + 1,
                    last_seq: total,
                });
            }
        }
        losses
    }
}

enum Line {
    Total(u64),
    Sessions(Vec<(String, u64)>),
    Forget(Vec<String>),
}

fn parse_line(line: &str) -> Option<Line> {
    if let Some(rest) = line.strip_prefix("cairn-hwm v1 events=") {
        let (n, crc) = rest.split_once(" crc32=")?;
        let body = format!("cairn-hwm v1 events={n}");
        if crc != format!("{:08x}", crc32fast::hash(body.as_bytes())) {
            return None;
        }
        return n.parse().ok().map(Line::Total);
    }
    if let Some(rest) = line.strip_prefix("forget crc32=") {
        let (crc, body) = rest.split_at_checked(8)?;
        if u32::from_str_radix(crc, 16).ok()? != crc32fast::hash(body.as_bytes()) {
            return None;
        }
        let list = body.split(' ').filter(|s| !s.is_empty());
        return Some(Line::Forget(list.map(str::to_owned).collect()));
    }
    let rest = line.strip_prefix("v2 crc32=")?;
    let (crc, body) = rest.split_at_checked(8)?;
    if u32::from_str_radix(crc, 16).ok()? != crc32fast::hash(body.as_bytes()) {
        return None;
    }
    let mut list = Vec::new();
    for item in body.split(' ').filter(|s| !s.is_empty()) {
        let (sid, seq) = item.rsplit_once(':')?;
        list.push((sid.to_owned(), seq.parse().ok()?));
    }
    Some(Line::Sessions(list))
}

/// One journal line for `marks`.
fn line_of<'a>(marks: impl IntoIterator<Item = (&'a String, &'a u64)>) -> String {
    let mut body = String::new();
    for (sid, seq) in marks {
        body.push(' ');
        body.push_str(sid);
        body.push(':');
        body.push_str(&seq.to_string());
    }
    format!("v2 crc32={:08x}{body}\n", crc32fast::hash(body.as_bytes()))
}

/// The journal line that forgets a deleted session's mark.
fn forget_line(session_id: &str) -> String {
    let body = format!(" {session_id}");
    format!(
        "forget crc32={:08x}{body}\n",
        crc32fast::hash(body.as_bytes())
    )
}

/// Rewrites the marks file of `dir` to hold exactly `marks` (temporary file, fsync, rename,
/// fsync of the directory).
pub fn write_marks(dir: &Path, marks: &BTreeMap<String, u64>) -> std::io::Result<()> {
    let tmp = dir.join(format!("{MARKS_FILE}.tmp"));
    let mut file = File::create(&tmp)?;
    file.write_all(line_of(marks).as_bytes())?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, dir.join(MARKS_FILE))?;
    sync_dir(dir)
}

/// What the store and its marks writer share.
#[derive(Default)]
struct Pending {
    /// Raised marks not yet in the file.
    dirty: BTreeMap<String, u64>,
}

/// A store that keeps per-session high-water marks in its directory; see the module docs.
pub struct MarkedStore {
    inner: Arc<dyn Store>,
    pending: Arc<Mutex<Pending>>,
    /// To the writer thread; dropping it stops the writer.
    commands: Option<mpsc::Sender<Command>>,
    writer: Option<JoinHandle<()>>,
}

/// What the store asks of its marks writer besides the periodic flush.
enum Command {
    /// Write (and sync) a `forget` line for a session, and drop its mark; answers with the
    /// mark it had.
    Forget(String, tokio::sync::oneshot::Sender<std::io::Result<u64>>),
}

impl std::fmt::Debug for MarkedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MarkedStore").finish_non_exhaustive()
    }
}

impl MarkedStore {
    /// Wraps `inner`, whose files are in `dir`, whose sessions are `listed` now; the marks file
    /// is rewritten to the current counts first (so it starts compact and exact).
    pub fn new(
        inner: Arc<dyn Store>,
        dir: &Path,
        listed: &[SessionInfo],
    ) -> std::io::Result<MarkedStore> {
        let all: BTreeMap<String, u64> = listed
            .iter()
            .map(|i| (i.session_id.clone(), i.events))
            .collect();
        write_marks(dir, &all)?;
        let pending = Arc::new(Mutex::new(Pending::default()));
        let (commands, received) = mpsc::channel();
        let mut writer = MarksWriter {
            dir: dir.to_path_buf(),
            pending: Arc::clone(&pending),
            file: None,
            written: 0,
            compact_size: line_of(&all).len() as u64,
            all: all.into_iter().collect(),
            failures: 0,
        };
        let writer = std::thread::Builder::new()
            .name("cairn-marks".to_owned())
            .spawn(move || writer.run(&received))?;
        Ok(MarkedStore {
            inner,
            pending,
            commands: Some(commands),
            writer: Some(writer),
        })
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }
}

impl Drop for MarkedStore {
    fn drop(&mut self) {
        // Closing the channel makes the writer write what is left and stop.
        self.commands.take();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// The background thread writing the marks journal.
struct MarksWriter {
    dir: PathBuf,
    pending: Arc<Mutex<Pending>>,
    file: Option<File>,
    /// Bytes appended since the last rewrite.
    written: u64,
    /// The size of the last full rewrite.
    compact_size: u64,
    /// Every session's mark (for rewrites).
    all: HashMap<String, u64>,
    failures: u32,
}

impl MarksWriter {
    fn run(&mut self, commands: &mpsc::Receiver<Command>) {
        loop {
            let wait = MARKS_INTERVAL * (1 << self.failures.min(5));
            let received = commands.recv_timeout(wait);
            self.flush();
            match received {
                Ok(Command::Forget(session_id, reply)) => {
                    let _ = reply.send(self.forget(&session_id));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Writes a `forget` line for a session, after the raised marks (flushed just before), and
    /// drops its mark; returns the mark it had. A raise still pending for it (an append that
    /// raced the delete) is written first, so the forget line comes after it.
    fn forget(&mut self, session_id: &str) -> std::io::Result<u64> {
        if self.failures > 0 {
            // The raised marks could not be written: the forget line must not go before them.
            return Err(std::io::Error::other(
                "the high-water marks cannot be written now",
            ));
        }
        self.append(&forget_line(session_id))?;
        Ok(self.all.remove(session_id).unwrap_or(0))
    }

    fn take(&self) -> BTreeMap<String, u64> {
        let mut pending = self
            .pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        std::mem::take(&mut pending.dirty)
    }

    fn flush(&mut self) {
        let dirty = self.take();
        if dirty.is_empty() {
            return;
        }
        for (sid, seq) in &dirty {
            let mark = self.all.entry(sid.clone()).or_insert(0);
            *mark = (*mark).max(*seq);
        }
        let result = if self.written > 4 * self.compact_size.max(64 * 1024) {
            self.rewrite()
        } else {
            self.append(&line_of(&dirty))
        };
        match result {
            Ok(()) => self.failures = 0,
            Err(e) => {
                // The events are durable regardless; only the check weakens. Retry later.
                self.failures = self.failures.saturating_add(1);
                self.file = None;
                let mut pending = self
                    .pending
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                for (sid, seq) in dirty {
                    let mark = pending.dirty.entry(sid).or_insert(0);
                    *mark = (*mark).max(seq);
                }
                tracing::warn!(store = %self.dir.display(), error = %e,
                    "cannot write the high-water marks; will retry");
            }
        }
    }

    fn append(&mut self, line: &str) -> std::io::Result<()> {
        if self.file.is_none() {
            self.file = Some(
                File::options()
                    .append(true)
                    .create(true)
                    .open(self.dir.join(MARKS_FILE))?,
            );
        }
        let file = self.file.as_mut().expect("opened above");
        file.write_all(line.as_bytes())?;
        file.sync_data()?;
        self.written += line.len() as u64;
        Ok(())
    }

    fn rewrite(&mut self) -> std::io::Result<()> {
        let all: BTreeMap<String, u64> = self.all.iter().map(|(s, n)| (s.clone(), *n)).collect();
        self.file = None;
        write_marks(&self.dir, &all)?;
        self.compact_size = line_of(&all).len() as u64;
        self.written = 0;
        Ok(())
    }
}

/// The session and last seq an append records events up to, if it records any.
fn appended_to(request: &AppendRequest) -> Option<(String, u64)> {
    request
        .events
        .last()
        .map(|e| (request.session_id.clone(), e.seq))
}

impl MarkedStore {
    /// Marks the session's journal entry dirty up to `appended`'s seq.
    fn mark_dirty(&self, appended: Option<(String, u64)>) {
        if let Some((sid, seq)) = appended {
            let mut pending = self
                .pending
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let mark = pending.dirty.entry(sid).or_insert(0);
            *mark = (*mark).max(seq);
        }
    }
}

#[async_trait]
impl Store for MarkedStore {
    fn durable_commits(&self) -> Option<u64> {
        self.inner.durable_commits()
    }

    fn sync_times(&self) -> Option<SyncTimes> {
        self.inner.sync_times()
    }

    fn write_refusal(&self) -> Option<String> {
        self.inner.write_refusal()
    }

    async fn append(&self, request: AppendRequest) -> Result<()> {
        let appended = appended_to(&request);
        self.inner.append(request).await?;
        self.mark_dirty(appended);
        Ok(())
    }

    async fn append_and_lease(
        &self,
        request: AppendRequest,
        lease: &LeaseRequest,
    ) -> Result<Vec<Lease>> {
        let appended = appended_to(&request);
        let leases = self.inner.append_and_lease(request, lease).await?;
        self.mark_dirty(appended);
        Ok(leases)
    }

    async fn read_history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        self.inner.read_history(session_id, from_seq, limit).await
    }

    async fn list_sessions(&self) -> Result<Vec<SessionInfo>> {
        self.inner.list_sessions().await
    }

    async fn deleted_sessions(&self) -> Result<Vec<String>> {
        self.inner.deleted_sessions().await
    }
    async fn record_deleted(&self, session_id: &str, now_ms: u64) -> Result<bool> {
        self.inner.record_deleted(session_id, now_ms).await
    }

    async fn lease_tasks(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        self.inner.lease_tasks(now_ms, lease_ms, max, filter).await
    }

    async fn lease_tasks_in_process(
        &self,
        now_ms: u64,
        lease_ms: u64,
        max: usize,
        filter: &TaskFilter,
    ) -> Result<Vec<Lease>> {
        self.inner
            .lease_tasks_in_process(now_ms, lease_ms, max, filter)
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
        self.inner
            .extend_lease(id, lease_attempt, now_ms, lease_ms, details)
            .await
    }

    async fn overdue_tasks(&self, now_ms: u64, max: usize) -> Result<Vec<Task>> {
        self.inner.overdue_tasks(now_ms, max).await
    }

    async fn list_tasks(&self) -> Result<Vec<Task>> {
        self.inner.list_tasks().await
    }

    async fn task(&self, id: &TaskId) -> Result<Option<Task>> {
        self.inner.task(id).await
    }

    async fn release_leases(&self, now_ms: u64) -> Result<usize> {
        self.inner.release_leases(now_ms).await
    }

    async fn delete_session(&self, session_id: &str, now_ms: u64) -> Result<SessionInfo> {
        let unavailable = |reason: String| Error::Store {
            reason: format!("cannot delete session {session_id:?}: {reason}"),
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let command = Command::Forget(session_id.to_owned(), reply);
        self.commands
            .as_ref()
            .and_then(|commands| commands.send(command).ok())
            .ok_or_else(|| unavailable("the high-water marks writer has stopped".to_owned()))?;
        let mark = answer
            .await
            .map_err(|_| unavailable("the high-water marks writer has stopped".to_owned()))?
            .map_err(|e| unavailable(format!("cannot write the high-water marks: {e}")))?;
        let deleted = self.inner.delete_session(session_id, now_ms).await;
        let refused = matches!(
            deleted,
            Err(Error::SessionBusy { .. } | Error::UnknownSession { .. })
        );
        if refused && mark > 0 {
            // Nothing was deleted: the mark stands again. (After a failed write it is unknown
            // whether the delete landed; the mark stays forgotten, a weaker check, and the
            // next open's rewrite from the listing names the session again if it is there.)
            let mut pending = self
                .pending
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let raised = pending.dirty.entry(session_id.to_owned()).or_insert(0);
            *raised = (*raised).max(mark);
        }
        deleted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SessionStatus;

    fn info(sid: &str, events: u64) -> SessionInfo {
        SessionInfo {
            session_id: sid.to_owned(),
            status: SessionStatus::Idle,
            events,
            updated_at_ms: 0,
        }
    }

    #[test]
    fn lines_round_trip_and_the_highest_mark_wins() {
        let mut a = BTreeMap::new();
        a.insert("s1".to_owned(), 5);
        a.insert("s-2.x_y".to_owned(), 9);
        let mut b = BTreeMap::new();
        b.insert("s1".to_owned(), 7);
        let text = format!("{}{}", line_of(&a), line_of(&b));
        let marks = Marks::parse(text.as_bytes());
        assert_eq!(marks.sessions.get("s1"), Some(&7));
        assert_eq!(marks.sessions.get("s-2.x_y"), Some(&9));
        assert!(marks.skipped_lines.is_empty());
    }

    #[test]
    fn a_damaged_or_torn_line_is_skipped_and_never_raises_a_mark() {
        let mut a = BTreeMap::new();
        a.insert("s1".to_owned(), 5);
        let mut b = BTreeMap::new();
        b.insert("s1".to_owned(), 50);
        let good = line_of(&a);
        let flipped = line_of(&b).replace("s1:50", "s1:90");
        let torn = &line_of(&b)[..10];
        let text = format!("{good}{flipped}{torn}");
        let marks = Marks::parse(text.as_bytes());
        assert_eq!(marks.sessions.get("s1"), Some(&5));
        assert_eq!(marks.skipped_lines, vec![2, 3]);
        assert!(Marks::parse(b"\xff\xfe garbage").sessions.is_empty());
    }

    #[test]
    fn losses_name_each_session_and_seq_range() {
        let mut sessions = BTreeMap::new();
        sessions.insert("a".to_owned(), 10);
        sessions.insert("b".to_owned(), 4);
        sessions.insert("gone".to_owned(), 1);
        let marks = Marks {
            sessions,
            legacy_total: None,
            skipped_lines: vec![],
        };
        let losses = marks.losses(&[info("a", 7), info("b", 4)]);
        let text: Vec<String> = losses.iter().map(|l| l.to_string()).collect();
        assert_eq!(
            text,
            vec!["session \"a\" seqs 8..=10", "session \"gone\" seq 1"]
        );
    }

    #[test]
    fn the_old_total_mark_is_still_checked() {
        let body = "cairn-hwm v1 events=6";
        let line = format!("{body} crc32={:08x}\n", crc32fast::hash(body.as_bytes()));
        let marks = Marks::parse(line.as_bytes());
        assert_eq!(marks.legacy_total, Some(6));
        assert!(marks.losses(&[info("a", 6)]).is_empty());
        assert_eq!(
            marks.losses(&[info("a", 4)])[0].to_string(),
            "2 event(s) of unknown sessions (the store's old total mark)"
        );
        let bad = line.replace("events=6", "events=7");
        assert_eq!(Marks::parse(bad.as_bytes()).legacy_total, None);
    }

    #[test]
    fn a_forget_line_drops_the_marks_before_it_and_is_checked() {
        let mut a = BTreeMap::new();
        a.insert("s1".to_owned(), 5);
        a.insert("s2".to_owned(), 3);
        let text = format!("{}{}", line_of(&a), forget_line("s1"));
        let marks = Marks::parse(text.as_bytes());
        assert_eq!(marks.sessions.get("s1"), None);
        assert_eq!(marks.sessions.get("s2"), Some(&3));
        assert!(marks.losses(&[info("s2", 3)]).is_empty());
        // A damaged forget line is skipped: the mark stays (a claimed loss fsck names, never
        // a silent one).
        let damaged = format!("{}{}", line_of(&a), forget_line("s1").replace("s1", "s9"));
        let marks = Marks::parse(damaged.as_bytes());
        assert_eq!(marks.sessions.get("s1"), Some(&5));
        assert_eq!(marks.skipped_lines, vec![2]);
    }

    #[tokio::test]
    async fn a_deleted_session_is_forgotten_and_a_refused_delete_keeps_its_mark() {
        use crate::store::conformance::{append_request, message};
        use crate::store::memory::MemoryStore;
        let root = tempfile::tempdir().expect("tempdir");
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let store = MarkedStore::new(inner.clone(), root.path(), &[]).expect("marked");
        for (sid, status) in [
            ("done", SessionStatus::Idle),
            ("busy", SessionStatus::Running),
        ] {
            for seq in 1..=3 {
                let mut request = append_request(sid, seq, vec![message(sid, seq, "x")], 1);
                request.status = status;
                store.append(request).await.expect("append");
            }
        }
        // The writer flushes the raised marks before it writes a forget line.
        let deleted = store.delete_session("done", 5).await.expect("delete");
        assert_eq!(deleted.events, 3);
        let refused = store.delete_session("busy", 5).await;
        assert!(
            matches!(refused, Err(Error::SessionBusy { .. })),
            "{refused:?}"
        );
        let unknown = store.delete_session("nothing", 5).await;
        assert!(
            matches!(unknown, Err(Error::UnknownSession { .. })),
            "{unknown:?}"
        );
        drop(store);
        let marks = Marks::read(root.path()).expect("read");
        assert_eq!(
            marks.sessions.get("done"),
            None,
            "the deleted session is forgotten"
        );
        assert_eq!(
            marks.sessions.get("busy"),
            Some(&3),
            "the refused delete kept its mark"
        );
        let listed = inner.list_sessions().await.expect("list");
        assert!(
            marks.losses(&listed).is_empty(),
            "{:?}",
            marks.losses(&listed)
        );
        assert!(marks.skipped_lines.is_empty());
    }

    #[tokio::test]
    async fn marks_follow_acknowledged_appends_and_are_complete_on_close() {
        use crate::store::conformance::{append_request, message};
        use crate::store::memory::MemoryStore;
        let root = tempfile::tempdir().expect("tempdir");
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let store = MarkedStore::new(inner, root.path(), &[]).expect("marked");
        for seq in 1..=3 {
            store
                .append(append_request("s", seq, vec![message("s", seq, "x")], 1))
                .await
                .expect("append");
        }
        // A rejected append (a seq conflict) raises nothing.
        assert!(store
            .append(append_request("s", 9, vec![message("s", 9, "x")], 1))
            .await
            .is_err());
        drop(store);
        let marks = Marks::read(root.path()).expect("read");
        assert_eq!(marks.sessions.get("s"), Some(&3));
        assert!(marks.skipped_lines.is_empty());
    }
}
