//! `fsck`: checks a store's consistency through the [`Store`] API and reports every problem
//! found, instead of stopping at the first.
//!
//! For every session: every record decodes (a corrupt one is noted and reading goes on after
//! it), the seqs are 1..=n without gaps and n is the session's recorded event count, the
//! decodable prefix replays with the current code (no `Nondeterminism`, `InvalidEvent` or
//! `StaleReport`), and the recorded status matches the folded state. For every queued task: it
//! belongs to a running session, points at a `*_scheduled` event of its kind, and the workflow
//! still waits for it;
//! and every activity a running session waits for has a queued task.
//!
//! Run it on a store nothing else is writing to (the CLI opens the store exclusively): a
//! concurrent append can look like a mismatch.

use crate::error::{Error, Result};
use crate::event::{Event, EventEnvelope};
use crate::replay::{replay, step_through};
use crate::store::{missing_seq, SessionInfo, SessionStatus, Store, TaskKind};
use crate::workflow::SessionState;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// What kind of problem fsck found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProblemKind {
    /// A record that does not decode (checksum, format, misplaced) or is missing.
    CorruptRecord,
    /// A record written by a newer cairn than this one.
    UnknownSchemaVersion,
    /// The seqs read are not 1..=n, or n is not the session's recorded event count.
    Sequence,
    /// Replaying the readable history fails: nondeterminism or an event the workflow rejects.
    Replay,
    /// The session's recorded status is not the one its history folds to.
    Status,
    /// A queued task that should not be queued.
    Task,
    /// An activity a running session waits for has no queued task (`resume` re-enqueues it).
    MissingTask,
    /// Events the store acknowledged that its storage engine no longer has (per the
    /// high-water marks).
    Lost,
    /// Records that cannot be read at all (the storage engine failed, not the record's check).
    Unreadable,
}

impl ProblemKind {
    /// A short name, for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ProblemKind::CorruptRecord => "corrupt record",
            ProblemKind::UnknownSchemaVersion => "unknown schema version",
            ProblemKind::Sequence => "sequence",
            ProblemKind::Replay => "replay",
            ProblemKind::Status => "status",
            ProblemKind::Task => "task",
            ProblemKind::MissingTask => "missing task",
            ProblemKind::Lost => "lost events",
            ProblemKind::Unreadable => "unreadable",
        }
    }
}

/// One problem: where, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The session concerned.
    pub session_id: String,
    /// The seq concerned (of the record, or of the event a task points at), when there is one.
    pub seq: Option<u64>,
    /// The kind of problem.
    pub kind: ProblemKind,
    /// What is wrong, for people.
    pub what: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "session {:?}", self.session_id)?;
        if let Some(seq) = self.seq {
            write!(f, " seq {seq}")?;
        }
        write!(f, ": {}: {}", self.kind.as_str(), self.what)
    }
}

/// What fsck checked and found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FsckReport {
    /// Sessions checked.
    pub sessions: usize,
    /// Event records read (including corrupt ones).
    pub events: u64,
    /// Queued tasks checked.
    pub tasks: usize,
    /// Every problem, by session in id order (then tasks).
    pub problems: Vec<Problem>,
}

impl FsckReport {
    /// Whether no problem was found.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }

    /// Adds acknowledged events the store lost (found when opening it) as problems.
    pub fn add_losses(&mut self, losses: &[crate::store::marks::Loss]) {
        for loss in losses {
            self.problems.push(Problem {
                session_id: loss
                    .session_id
                    .clone()
                    .unwrap_or_else(|| "(unknown)".to_owned()),
                seq: Some(loss.first_seq),
                kind: ProblemKind::Lost,
                what: format!(
                    "acknowledged events {} lost: the storage engine dropped them while \
                     recovering (`cairn fsck --repair` accepts the loss after copying the store \
                     away)",
                    loss
                ),
            });
        }
        self.problems
            .sort_by(|a, b| a.session_id.cmp(&b.session_id));
    }

    /// The problems of one session.
    pub fn problems_of<'a>(&'a self, session_id: &'a str) -> impl Iterator<Item = &'a Problem> {
        self.problems
            .iter()
            .filter(move |p| p.session_id == session_id)
    }
}

impl fmt::Display for FsckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural =
            |n: u64, one: &'static str, many: &'static str| if n == 1 { one } else { many };
        write!(
            f,
            "checked {} {}, {} {}, {} queued {}: ",
            self.sessions,
            plural(self.sessions as u64, "session", "sessions"),
            self.events,
            plural(self.events, "event", "events"),
            self.tasks,
            plural(self.tasks as u64, "task", "tasks"),
        )?;
        if self.problems.is_empty() {
            return writeln!(f, "no problems");
        }
        let n = self.problems.len() as u64;
        writeln!(f, "{n} {}", plural(n, "problem", "problems"))?;
        for p in &self.problems {
            writeln!(f, "  {p}")?;
        }
        Ok(())
    }
}

/// What the task checks need to know of a session.
struct Checked {
    status: SessionStatus,
    /// The scheduled events read: seq → whether it schedules a model (or a tool) call.
    scheduled: BTreeMap<u64, TaskKind>,
    /// Seqs that could not be read.
    unreadable: Unreadable,
    /// The activities the session waits for, when its whole history folded cleanly.
    outstanding: Option<BTreeSet<u64>>,
}

/// Checks every session and queued task of `store`; see the module docs. Fails only when the
/// store cannot be listed or read at all (`Error::Store`); damage is reported as problems.
pub async fn fsck(store: &dyn Store) -> Result<FsckReport> {
    let mut report = FsckReport::default();
    let mut checked = BTreeMap::new();
    for info in store.list_sessions().await? {
        report.sessions += 1;
        let c = check_session(store, &info, &mut report).await?;
        checked.insert(info.session_id, c);
    }
    let tasks = store.list_tasks().await?;
    report.tasks = tasks.len();
    let mut queued: BTreeMap<&str, BTreeSet<u64>> = BTreeMap::new();
    for task in &tasks {
        let sid = task.id.session_id.as_str();
        let seq = task.id.scheduled_seq;
        queued.entry(sid).or_default().insert(seq);
        let mut problem = |what: String| {
            report.problems.push(Problem {
                session_id: sid.to_owned(),
                seq: Some(seq),
                kind: ProblemKind::Task,
                what,
            })
        };
        let Some(c) = checked.get(sid) else {
            problem(format!("task {} belongs to no listed session", task.id));
            continue;
        };
        if c.status != SessionStatus::Running {
            problem(format!(
                "task {} is queued but the session is {}",
                task.id,
                c.status.as_str()
            ));
            continue;
        }
        if c.unreadable.contains(seq) {
            continue; // the corrupt record is reported already
        }
        match c.scheduled.get(&seq) {
            None => problem(format!(
                "task {} does not point at a model_call_scheduled, summary_call_scheduled or \
                 tool_call_scheduled event",
                task.id
            )),
            Some(kind) if *kind != task.kind => problem(format!(
                "task {} is a {:?} task but its event schedules a {:?} call",
                task.id, task.kind, kind
            )),
            Some(_) => {
                if let Some(outstanding) = &c.outstanding {
                    if !outstanding.contains(&seq) {
                        problem(format!(
                            "task {} is queued but the workflow no longer waits for it",
                            task.id
                        ));
                    }
                }
            }
        }
    }
    for (sid, c) in &checked {
        let Some(outstanding) = &c.outstanding else {
            continue;
        };
        for seq in outstanding {
            if !queued.get(sid.as_str()).is_some_and(|q| q.contains(seq)) {
                report.problems.push(Problem {
                    session_id: sid.clone(),
                    seq: Some(*seq),
                    kind: ProblemKind::MissingTask,
                    what: format!(
                        "the session waits for the activity scheduled at seq {seq} but no task \
                         is queued for it (cairn resume re-enqueues it)"
                    ),
                });
            }
        }
    }
    Ok(report)
}

/// Reads and replays one session, noting its problems.
async fn check_session(
    store: &dyn Store,
    info: &SessionInfo,
    report: &mut FsckReport,
) -> Result<Checked> {
    let sid = info.session_id.as_str();
    let mut problems = Vec::new();
    let mut problem = |seq: Option<u64>, kind: ProblemKind, what: String| {
        problems.push(Problem {
            session_id: sid.to_owned(),
            seq,
            kind,
            what,
        })
    };
    let (events, unreadable) = read_all(store, sid, info.events, &mut problem).await?;
    report.events = report
        .events
        .saturating_add(events.len() as u64)
        .saturating_add(unreadable.count());

    // Seqs: 1..=n, each either decoded or noted as unreadable, n = the recorded count. The
    // count is the session record's, which no checksum covers: a gap is one problem, however
    // long, so a damaged count costs no more than the records there are.
    let mut sequence_ok = true;
    let mut known: Vec<(u64, u64)> = events
        .iter()
        .map(|e| (e.seq, e.seq))
        .chain(unreadable.ranges.iter().copied())
        .collect();
    known.sort_unstable();
    let mut missing = |first: u64, last: u64| {
        let what = if first == last {
            "seq missing from the history".to_owned()
        } else {
            format!("seqs {first}..={last} missing from the history")
        };
        problem(Some(first), ProblemKind::Sequence, what);
    };
    let mut expected = 1u64;
    for &(first, last) in &known {
        if first > info.events {
            break;
        }
        if first > expected {
            missing(expected, first - 1);
            sequence_ok = false;
        }
        expected = expected.max(last.saturating_add(1));
    }
    if expected <= info.events {
        missing(expected, info.events);
        sequence_ok = false;
    }
    let mut extra: Vec<u64> = known
        .iter()
        .map(|&(first, last)| first.max(info.events.saturating_add(1)).min(last))
        .filter(|&seq| seq > info.events)
        .collect();
    extra.dedup();
    let strays = events.windows(2).any(|w| w[1].seq <= w[0].seq);
    if !extra.is_empty() || strays {
        let read = if extra.len() > 8 {
            format!("{:?} and {} more", &extra[..8], extra.len() - 8)
        } else {
            format!("{extra:?}")
        };
        problem(
            extra.first().copied(),
            ProblemKind::Sequence,
            if strays {
                format!(
                    "the session records {} events but its seqs were read out of order",
                    info.events
                )
            } else {
                format!(
                    "the session records {} events but seqs {read} were read",
                    info.events
                )
            },
        );
        sequence_ok = false;
    }

    // Replay the readable prefix: the whole history when nothing is missing.
    let complete = sequence_ok && unreadable.ranges.is_empty();
    let prefix_end = events
        .iter()
        .enumerate()
        .take_while(|(i, e)| e.seq == *i as u64 + 1)
        .count();
    let prefix = &events[..prefix_end];
    let mut state: Option<SessionState> = None;
    if complete {
        match replay(sid, prefix) {
            Ok(replayed) => state = Some(replayed.state),
            Err(e) => replay_problem(e, &mut problem),
        }
    } else if let Some(Err(e)) = step_through(sid, prefix).find(|r| r.is_err()) {
        replay_problem(e, &mut problem);
    }

    let mut scheduled = BTreeMap::new();
    for e in &events {
        match e.event {
            Event::ModelCallScheduled { .. } | Event::SummaryCallScheduled { .. } => {
                scheduled.insert(e.seq, TaskKind::Model);
            }
            Event::ToolCallScheduled { .. } => {
                scheduled.insert(e.seq, TaskKind::Tool);
            }
            // An approval deadline's timer is queued as a tool task that is never leased.
            Event::ToolApprovalRequested {
                deadline_ms: Some(_),
                ..
            } => {
                scheduled.insert(e.seq, TaskKind::Tool);
            }
            _ => {}
        }
    }
    let outstanding = state.as_ref().map(|s| {
        let folded = status_of(s);
        if folded != info.status {
            problem(
                None,
                ProblemKind::Status,
                format!(
                    "recorded as {} but the history folds to {}",
                    info.status.as_str(),
                    folded.as_str()
                ),
            );
        }
        s.outstanding_tasks().into_iter().collect()
    });
    report.problems.extend(problems);
    Ok(Checked {
        status: info.status,
        scheduled,
        unreadable,
        outstanding,
    })
}

/// Seqs of a session that could not be read, as inclusive ranges: a range may be as long as
/// a damaged count says, and costs one entry.
#[derive(Debug, Default)]
struct Unreadable {
    ranges: Vec<(u64, u64)>,
}

impl Unreadable {
    fn insert(&mut self, seq: u64) {
        self.ranges.push((seq, seq));
    }

    /// Seqs `first..=last`; nothing when `last < first`.
    fn insert_range(&mut self, first: u64, last: u64) {
        if first <= last {
            self.ranges.push((first, last));
        }
    }

    fn contains(&self, seq: u64) -> bool {
        self.ranges
            .iter()
            .any(|&(first, last)| (first..=last).contains(&seq))
    }

    fn count(&self) -> u64 {
        self.ranges.iter().fold(0u64, |n, &(first, last)| {
            n.saturating_add(last - first).saturating_add(1)
        })
    }
}

/// Where a read of a session's records stopped short.
enum Stop {
    /// At a record that is stored but cannot be read.
    Bad(ProblemKind, String),
    /// At a record not stored at all; the next seq that is (none up to the recorded count).
    Missing(Option<u64>),
}

/// Records read one by one, at most, when the store's answers disagree on where a bad
/// record is; a longer stretch is reported unreadable as a whole.
const MAX_ONE_BY_ONE: u64 = 10_000;

/// Reads every record of a session, noting and skipping unreadable ones. Returns the decoded
/// events in order and the seqs that could not be read.
async fn read_all(
    store: &dyn Store,
    sid: &str,
    recorded: u64,
    problem: &mut impl FnMut(Option<u64>, ProblemKind, String),
) -> Result<(Vec<EventEnvelope>, Unreadable)> {
    let mut events = Vec::new();
    let mut unreadable = Unreadable::default();
    let mut next = 1u64;
    // Each round either ends the reading or moves `next` forward past a bad record, or past
    // a gap of records not stored at all.
    loop {
        let (seq, stop) = match store.read_history(sid, next, None).await {
            Ok(rest) => {
                events.extend(rest);
                break;
            }
            Err(Error::UnknownSession { .. }) => {
                problem(
                    None,
                    ProblemKind::Sequence,
                    format!("listed with {recorded} events, but the store has no history"),
                );
                break;
            }
            Err(Error::CorruptRecord { seq, reason, .. }) => match missing_seq(&reason) {
                // A gap: reading goes on at the next stored seq.
                Some(Some(stored)) if seq < stored && stored <= recorded => {
                    (seq, Stop::Missing(Some(stored)))
                }
                // Nothing stored up to the recorded count.
                Some(None) => (seq, Stop::Missing(None)),
                // The next key does not read as a seq of this history (a damaged key): a bad
                // record, after which reading goes on.
                Some(Some(_)) => (seq, Stop::Bad(ProblemKind::CorruptRecord, reason)),
                None => (seq, Stop::Bad(ProblemKind::CorruptRecord, reason)),
            },
            Err(e @ Error::UnknownSchemaVersion { seq, .. }) => (
                seq,
                Stop::Bad(ProblemKind::UnknownSchemaVersion, e.to_string()),
            ),
            Err(e) => {
                // The storage engine itself failed (a missing blob, an IO error): nothing
                // from here on can be told apart, so the rest of this session is unreadable,
                // and the other sessions are still checked.
                problem(
                    Some(next),
                    ProblemKind::Unreadable,
                    format!("seqs {next}..={recorded} cannot be read: {e}"),
                );
                unreadable.insert_range(next, recorded.max(next));
                break;
            }
        };
        let seq = seq.max(next);
        if seq > next {
            read_before(store, sid, next, seq, &mut events, &mut unreadable, problem).await;
        }
        match stop {
            Stop::Bad(kind, what) => {
                problem(Some(seq), kind, what);
                unreadable.insert(seq);
                match seq.checked_add(1) {
                    Some(after) if after <= recorded => next = after,
                    _ => break,
                }
            }
            // Not stored at all: the sequence check reports the gap, as one problem however
            // long, and reading goes on at the next stored seq, if any.
            Stop::Missing(Some(stored)) => next = stored,
            Stop::Missing(None) => break,
        }
    }
    Ok((events, unreadable))
}

/// Reads the records `next..seq`, before a bad one: at once, or one by one when the store's
/// answers disagree (at most [`MAX_ONE_BY_ONE`] of them; a longer stretch is unreadable).
async fn read_before(
    store: &dyn Store,
    sid: &str,
    next: u64,
    seq: u64,
    events: &mut Vec<EventEnvelope>,
    unreadable: &mut Unreadable,
    problem: &mut impl FnMut(Option<u64>, ProblemKind, String),
) {
    let before = usize::try_from(seq - next).unwrap_or(usize::MAX);
    match store.read_history(sid, next, Some(before)).await {
        Ok(good) => events.extend(good),
        Err(Error::CorruptRecord { .. } | Error::UnknownSchemaVersion { .. })
            if seq - next > MAX_ONE_BY_ONE =>
        {
            problem(
                Some(next),
                ProblemKind::Unreadable,
                format!(
                    "seqs {next}..={} cannot be read: the store's answers disagree on which \
                     record is bad",
                    seq - 1
                ),
            );
            unreadable.insert_range(next, seq - 1);
        }
        Err(Error::CorruptRecord { .. } | Error::UnknownSchemaVersion { .. }) => {
            // Inconsistent answers; read them one by one.
            for s in next..seq {
                match store.read_history(sid, s, Some(1)).await {
                    Ok(one) => events.extend(one),
                    Err(e @ (Error::CorruptRecord { .. } | Error::UnknownSchemaVersion { .. })) => {
                        problem(Some(s), ProblemKind::CorruptRecord, e.to_string());
                        unreadable.insert(s);
                    }
                    Err(e) => {
                        problem(Some(s), ProblemKind::Unreadable, e.to_string());
                        unreadable.insert(s);
                    }
                }
            }
        }
        Err(e) => {
            problem(Some(next), ProblemKind::Unreadable, e.to_string());
            unreadable.insert_range(next, seq - 1);
        }
    }
}

fn replay_problem(e: Error, problem: &mut impl FnMut(Option<u64>, ProblemKind, String)) {
    let seq = match &e {
        Error::Nondeterminism { seq, .. }
        | Error::InvalidEvent { seq, .. }
        | Error::StaleReport { seq, .. } => Some(*seq),
        _ => None,
    };
    problem(seq, ProblemKind::Replay, e.to_string());
}

/// The status a folded state should be recorded with (as the engine records it).
fn status_of(state: &SessionState) -> SessionStatus {
    if state.cancelled {
        SessionStatus::Cancelled
    } else if state.is_running() {
        SessionStatus::Running
    } else {
        SessionStatus::Idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;
    use crate::event::{Limits, RetryPolicy, SessionStarted};
    use crate::store::conformance::append_request;
    use crate::store::memory::MemoryStore;
    use crate::store::sled::SledStore;
    use crate::store::{NewTask, TaskId};
    use cairn_ledger::ModelSpec;

    fn started() -> Event {
        Event::SessionStarted(SessionStarted {
            call_options: Default::default(),
            queues: Default::default(),
            forked_from: None,
            workflow_version: crate::workflow::WORKFLOW_VERSION,
            tool_policy: None,
            compaction: None,
            model: ModelSpec::parse("scripted:x.json").expect("model spec"),
            tools: Vec::new().into(),
            system_prompt: None,
            limits: Limits::default(),
            model_retry: RetryPolicy::model_default(),
            tool_retry: RetryPolicy::tool_default(),
            workdir: None,
        })
    }

    /// A session with a turn waiting for its model call: seqs 1..=3, the task queued.
    async fn waiting_session(store: &dyn Store, sid: &str) {
        let mut state = SessionState::new(sid);
        let mut events = Vec::new();
        for event in [
            started(),
            Event::UserMessage {
                idempotency_key: None,
                tool_choice: None,
                turn: 1,
                text: format!("hello from {sid}"),
                model: None,
                media: Vec::new(),
            },
        ] {
            let e = EventEnvelope::new(sid, state.next_seq, 100, event);
            events.extend(state.step(e).expect("step").events);
        }
        assert_eq!(events.len(), 3);
        let mut request = append_request(sid, 1, events, 100);
        request.enqueue = vec![NewTask::new(
            TaskId {
                session_id: sid.to_owned(),
                scheduled_seq: 3,
            },
            TaskKind::Model,
            100,
        )];
        store.append(request).await.expect("append");
    }

    /// Opens the sled store at `dir` again once sled's flusher thread, which lets go of the
    /// file lock a moment after the last handle goes, has let go.
    #[allow(clippy::disallowed_methods)] // waits for sled's thread
    async fn reopen_sled(dir: &std::path::Path) -> SledStore {
        let mut tries = 0;
        loop {
            match SledStore::open_existing(dir) {
                Err(Error::StoreOpen { reason, .. })
                    if reason.contains("lock is held") && tries < 500 =>
                {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                other => return other.expect("reopen"),
            }
        }
    }

    /// A closed sled store (in the returned directory, kept while it lives) with sessions
    /// a, b and c each waiting for its model call, and the store's path, for raw edits.
    async fn closed_sled_store_of_three_sessions() -> (tempfile::TempDir, std::path::PathBuf) {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(root.path()).expect("open");
        for sid in ["a", "b", "c"] {
            waiting_session(&store, sid).await;
        }
        let dir = store.path().to_path_buf();
        drop(store);
        (root, dir)
    }

    #[tokio::test]
    async fn a_consistent_store_is_clean() {
        let store = MemoryStore::new();
        for sid in ["a", "b"] {
            waiting_session(&store, sid).await;
        }
        let report = fsck(&store).await.expect("fsck");
        assert!(report.is_clean(), "{report}");
        assert_eq!((report.sessions, report.events, report.tasks), (2, 6, 2));
        assert_eq!(
            report.to_string(),
            "checked 2 sessions, 6 events, 2 queued tasks: no problems\n"
        );
    }

    #[tokio::test]
    async fn replay_status_and_task_problems_are_reported() {
        let store = MemoryStore::new();
        waiting_session(&store, "ok").await;
        // A history the workflow rejects: a user message before session_started.
        let bad = EventEnvelope::new(
            "bad",
            1,
            1,
            Event::UserMessage {
                idempotency_key: None,
                tool_choice: None,
                turn: 1,
                text: "x".to_owned(),
                model: None,
                media: Vec::new(),
            },
        );
        let mut request = append_request("bad", 1, vec![bad], 1);
        // A task pointing at an event that schedules nothing, of a session that is running.
        request.enqueue = vec![NewTask::new(
            TaskId {
                session_id: "bad".to_owned(),
                scheduled_seq: 1,
            },
            TaskKind::Tool,
            0,
        )];
        store.append(request).await.expect("append");
        // A session recorded idle whose history has a running turn, its task gone.
        waiting_session(&store, "idle").await;
        let mut request = append_request("idle", 4, Vec::new(), 1);
        request.status = SessionStatus::Idle;
        request.cancel = vec![TaskId {
            session_id: "idle".to_owned(),
            scheduled_seq: 3,
        }];
        store.append(request).await.expect("append");

        let report = fsck(&store).await.expect("fsck");
        let found: Vec<(&str, Option<u64>, ProblemKind)> = report
            .problems
            .iter()
            .map(|p| (p.session_id.as_str(), p.seq, p.kind))
            .collect();
        assert_eq!(
            found,
            [
                ("bad", Some(1), ProblemKind::Replay),
                ("idle", None, ProblemKind::Status),
                ("bad", Some(1), ProblemKind::Task),
                ("idle", Some(3), ProblemKind::MissingTask),
            ],
            "{report}"
        );
        assert!(report.problems_of("ok").next().is_none());
        let text = report.to_string();
        assert!(text.contains("4 problems"), "{text}");
        assert!(
            text.contains(
                "session \"idle\": status: recorded as idle but the history folds to running"
            ),
            "{text}"
        );
    }

    /// A record damaged inside the store (sled checks only its own log): fsck names the
    /// session and seq, goes on reading after it, and other sessions stay clean.
    #[tokio::test]
    async fn corrupt_records_are_reported_and_reading_goes_on() {
        let (_root, dir) = closed_sled_store_of_three_sessions().await;
        {
            let db = sled::open(&dir).expect("raw sled");
            let events = db.open_tree("events").expect("tree");
            let key = |sid: &str, seq: u64| {
                let mut k = sid.as_bytes().to_vec();
                k.push(0);
                k.extend_from_slice(&seq.to_be_bytes());
                k
            };
            let mut record = events.get(key("b", 2)).expect("get").expect("b/2").to_vec();
            let last = record.len() - 1;
            record[last] ^= 0x20;
            events.insert(key("b", 2), record).expect("insert");
            // c's seq 1 replaced by a record of another session.
            let foreign = codec::encode(&EventEnvelope::new("a", 1, 1, started())).expect("enc");
            events.insert(key("c", 1), foreign).expect("insert");
            db.flush().expect("flush");
        }
        let store = reopen_sled(&dir).await;
        match store.read_history("b", 1, None).await {
            Err(Error::CorruptRecord {
                session_id, seq, ..
            }) => {
                assert_eq!((session_id.as_str(), seq), ("b", 2));
            }
            other => panic!("expected CorruptRecord at b/2, got {other:?}"),
        }
        let report = fsck(&store).await.expect("fsck");
        let found: Vec<(&str, Option<u64>, ProblemKind)> = report
            .problems
            .iter()
            .map(|p| (p.session_id.as_str(), p.seq, p.kind))
            .collect();
        assert_eq!(
            found,
            [
                ("b", Some(2), ProblemKind::CorruptRecord),
                ("c", Some(1), ProblemKind::CorruptRecord),
            ],
            "{report}"
        );
        assert_eq!(report.events, 9, "every record was visited");
        assert!(report.problems[0].what.contains("checksum"), "{report}");
        assert!(report.problems[1].what.contains("belongs to"), "{report}");
        assert!(report
            .to_string()
            .contains("session \"b\" seq 2: corrupt record"));
        assert_eq!(
            store
                .read_history("a", 1, None)
                .await
                .expect("a is intact")
                .len(),
            3
        );
    }

    /// A session record whose event count was damaged to far more than is stored (no checksum
    /// covers it), and a record missing in the middle: fsck reports each gap as one problem,
    /// however long, and finishes at once instead of stepping through every seq it names.
    #[tokio::test]
    async fn a_damaged_count_and_a_missing_record_are_one_problem_each() {
        let (_root, dir) = closed_sled_store_of_three_sessions().await;
        let damaged = 1u64 << 40;
        {
            let db = sled::open(&dir).expect("raw sled");
            let sessions = db.open_tree("sessions").expect("tree");
            let record = sessions.get(b"a").expect("get").expect("a's record");
            let mut info: SessionInfo = rmp_serde::from_slice(&record).expect("decode");
            info.events = damaged;
            let record = rmp_serde::to_vec(&info).expect("encode");
            sessions.insert(b"a", record).expect("insert");
            let events = db.open_tree("events").expect("tree");
            let mut key = b"b".to_vec();
            key.push(0);
            key.extend_from_slice(&2u64.to_be_bytes());
            assert!(events.remove(key).expect("remove").is_some());
            // c: a damaged key between seqs 1 and 2, read as seq 511 (past the history).
            let mut key = b"c".to_vec();
            key.push(0);
            key.extend_from_slice(&1u64.to_be_bytes());
            key.push(0xff);
            events.insert(key, b"junk".to_vec()).expect("insert");
            db.flush().expect("flush");
        }
        let store = reopen_sled(&dir).await;
        let report = fsck(&store).await.expect("fsck");
        let found: Vec<(&str, Option<u64>, ProblemKind, &str)> = report
            .problems
            .iter()
            .map(|p| (p.session_id.as_str(), p.seq, p.kind, p.what.as_str()))
            .collect();
        let tail = format!("seqs 4..={damaged} missing from the history");
        assert_eq!(
            found,
            [
                ("a", Some(4), ProblemKind::Sequence, tail.as_str()),
                (
                    "b",
                    Some(2),
                    ProblemKind::Sequence,
                    "seq missing from the history"
                ),
                (
                    "c",
                    Some(2),
                    ProblemKind::CorruptRecord,
                    "missing from the store (the next stored seq is 511)"
                ),
            ],
            "{report}"
        );
        assert_eq!(report.events, 8, "the records there are: {report}");
    }
}
