//! Copying every session of one store into another (`cairn migrate`): histories event for
//! event with their seqs, statuses and queued tasks, and the ids of deleted sessions, through
//! the `Store` API only, so any backend copies to any other.

use super::{AppendRequest, NewTask, SessionInfo, Store};
use crate::error::{Error, Result};

/// Events per append while copying a history: the last batch of a session also carries its
/// tasks, so a session lands whole or is left incomplete at a batch boundary.
const COPY_BATCH: usize = 512;

/// What a copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Sessions copied.
    pub sessions: usize,
    /// Events copied.
    pub events: u64,
    /// Queued tasks copied (leases are not: a task its worker held in the source is leasable
    /// at once in the destination, as a new lease with attempt 1).
    pub tasks: usize,
    /// Ids of sessions deleted in the source, recorded as deleted in the destination too, so
    /// that they are never used again there either.
    pub deleted: usize,
    /// Ids of sessions deleted in the source that the destination cannot record as deleted
    /// without a history ([`Store::record_deleted`]): it may use them again.
    pub deleted_left_behind: Vec<String>,
}

/// Copies every session of `from` into `to`, which must hold none of them: a session id
/// already in `to`, or deleted there, is refused before anything is written. Each session's
/// events are appended with their own seqs, times and records; its tasks go in with its last
/// batch, visible when they were (a held lease's task at `now_ms`, since the worker that held
/// it is gone). Then the ids of the sessions deleted in `from` are recorded as deleted in
/// `to` ([`Store::record_deleted`]), where it can.
pub async fn copy_sessions(from: &dyn Store, to: &dyn Store, now_ms: u64) -> Result<CopyReport> {
    let sessions = from.list_sessions().await?;
    let deleted_here = to.deleted_sessions().await?;
    let existing: std::collections::BTreeSet<String> = to
        .list_sessions()
        .await?
        .into_iter()
        .map(|info| info.session_id)
        .chain(deleted_here.iter().cloned())
        .collect();
    let clashes: Vec<&str> = sessions
        .iter()
        .map(|info| info.session_id.as_str())
        .filter(|id| existing.contains(*id))
        .collect();
    if !clashes.is_empty() {
        return Err(Error::InvalidEvent {
            session_id: clashes[0].to_owned(),
            seq: 1,
            reason: format!(
                "the destination already holds (or deleted) {} of the sessions to copy ({}); \
                 nothing was copied",
                clashes.len(),
                clashes.join(", ")
            ),
        });
    }
    let mut tasks = from.list_tasks().await?;
    let mut report = CopyReport::default();
    for info in &sessions {
        let mut enqueue: Vec<NewTask> = Vec::new();
        tasks.retain(|task| {
            if task.id.session_id != info.session_id {
                return true;
            }
            enqueue.push(NewTask {
                id: task.id.clone(),
                kind: task.kind,
                visible_at_ms: if task.held || task.lease_attempt > 0 {
                    task.visible_at_ms.min(now_ms)
                } else {
                    task.visible_at_ms
                },
                queue: task.queue.clone(),
                target: task.target.clone(),
                start_by_ms: task.start_by_ms,
            });
            false
        });
        report.tasks += enqueue.len();
        report.events += copy_session(from, to, info, enqueue).await?;
        report.sessions += 1;
    }
    let deleted_here: std::collections::BTreeSet<String> = deleted_here.into_iter().collect();
    for session_id in from.deleted_sessions().await? {
        if deleted_here.contains(&session_id) || to.record_deleted(&session_id, now_ms).await? {
            report.deleted += 1;
        } else {
            report.deleted_left_behind.push(session_id);
        }
    }
    Ok(report)
}

async fn copy_session(
    from: &dyn Store,
    to: &dyn Store,
    info: &SessionInfo,
    mut enqueue: Vec<NewTask>,
) -> Result<u64> {
    let mut next_seq = 1;
    loop {
        let events = from
            .read_history(&info.session_id, next_seq, Some(COPY_BATCH))
            .await?;
        let last = next_seq + events.len() as u64 > info.events;
        let count = events.len() as u64;
        to.append(AppendRequest {
            enqueue: if last {
                std::mem::take(&mut enqueue)
            } else {
                Vec::new()
            },
            ..AppendRequest::new(
                info.session_id.clone(),
                next_seq,
                events,
                info.status,
                info.updated_at_ms,
            )
        })
        .await?;
        next_seq += count;
        if last || count == 0 {
            return Ok(next_seq - 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::conformance::{append_request, message};
    use crate::store::memory::MemoryStore;
    use crate::store::{SessionStatus, TaskFilter, TaskId, TaskKind};

    fn task(session_id: &str, seq: u64, visible_at_ms: u64) -> NewTask {
        NewTask::new(
            TaskId {
                session_id: session_id.to_owned(),
                scheduled_seq: seq,
            },
            TaskKind::Tool,
            visible_at_ms,
        )
    }

    #[tokio::test]
    async fn a_copy_holds_the_same_histories_statuses_and_tasks_and_refuses_to_overwrite() {
        let from = MemoryStore::new();
        let long: Vec<_> = (1..=1_300).map(|seq| message("long", seq, "x")).collect();
        let mut request = append_request("long", 1, long, 77);
        request.enqueue = vec![task("long", 1_300, 5)];
        from.append(request).await.unwrap();
        let mut request = append_request("held", 1, vec![message("held", 1, "y")], 88);
        request.status = SessionStatus::Idle;
        request.enqueue = vec![task("held", 1, 0)];
        from.append(request).await.unwrap();
        let leased = from
            .lease_tasks(10, 60_000, 1, &TaskFilter::any())
            .await
            .unwrap();
        assert_eq!(leased.len(), 1, "one task was due");

        let to = MemoryStore::new();
        let report = copy_sessions(&from, &to, 1_000).await.unwrap();
        assert_eq!(
            report,
            CopyReport {
                sessions: 2,
                events: 1_301,
                tasks: 2,
                ..CopyReport::default()
            }
        );
        assert_eq!(
            to.list_sessions().await.unwrap(),
            from.list_sessions().await.unwrap()
        );
        for s in ["long", "held"] {
            assert_eq!(
                to.read_history(s, 1, None).await.unwrap(),
                from.read_history(s, 1, None).await.unwrap(),
                "{s} is copied event for event"
            );
        }
        let copied: Vec<(TaskId, u64, u32, bool)> = to
            .list_tasks()
            .await
            .unwrap()
            .into_iter()
            .map(|t| (t.id, t.visible_at_ms, t.lease_attempt, t.held))
            .collect();
        let held_id = leased[0].id.clone();
        assert!(
            copied.contains(&(held_id, 1_000, 0, false)),
            "the held task is leasable at once, unleased: {copied:?}"
        );

        let again = copy_sessions(&from, &to, 1_000).await;
        assert!(
            matches!(&again, Err(Error::InvalidEvent { reason, .. }) if reason.contains("held, long")),
            "a second copy is refused naming the sessions, got {again:?}"
        );
        assert_eq!(to.read_history("long", 1, None).await.unwrap().len(), 1_300);
    }

    /// A session deleted in the source stays deleted in the destination (its id is never
    /// used there either), and a destination that deleted a session of the source's id is
    /// refused before anything is written; one that cannot record a deletion says which ids
    /// it left behind.
    #[tokio::test]
    async fn deleted_ids_are_carried_over_and_a_deleted_destination_id_is_refused() {
        let from = MemoryStore::new();
        for id in ["kept", "gone"] {
            let mut request = append_request(id, 1, vec![message(id, 1, "x")], 10);
            request.status = SessionStatus::Idle;
            from.append(request).await.unwrap();
        }
        from.delete_session("gone", 20).await.unwrap();

        let to = MemoryStore::new();
        let report = copy_sessions(&from, &to, 1_000).await.unwrap();
        assert_eq!((report.sessions, report.deleted), (1, 1));
        assert!(report.deleted_left_behind.is_empty());
        assert_eq!(to.deleted_sessions().await.unwrap(), ["gone"]);
        let reused = to
            .append(append_request(
                "gone",
                1,
                vec![message("gone", 1, "y")],
                2_000,
            ))
            .await;
        assert!(
            matches!(&reused, Err(Error::SessionDeleted { session_id }) if session_id == "gone"),
            "{reused:?}"
        );

        // A destination that deleted "kept" itself: refused, nothing written.
        let other = MemoryStore::new();
        let mut request = append_request("kept", 1, vec![message("kept", 1, "z")], 10);
        request.status = SessionStatus::Idle;
        other.append(request).await.unwrap();
        other.delete_session("kept", 20).await.unwrap();
        let refused = copy_sessions(&from, &other, 1_000).await;
        assert!(
            matches!(&refused, Err(Error::InvalidEvent { reason, .. }) if reason.contains("(or deleted) 1 of the sessions to copy (kept)")),
            "{refused:?}"
        );
        assert_eq!(other.deleted_sessions().await.unwrap(), ["kept"]);

        // A destination that cannot hold a tombstone without a history (sled's, fjall's).
        let dir = tempfile::tempdir().unwrap();
        let sled = crate::store::sled::SledStore::open(dir.path()).unwrap();
        let report = copy_sessions(&from, &sled, 1_000).await.unwrap();
        assert_eq!(
            (report.sessions, report.deleted, report.deleted_left_behind),
            (1, 0, vec!["gone".to_owned()])
        );
    }
}
