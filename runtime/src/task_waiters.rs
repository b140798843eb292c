//! Who waits for tasks, and whom an enqueue wakes: each queued task wakes one waiting lease
//! whose filter accepts it, the one that has waited longest, rather than every waiting lease
//! (each of which would ask the store, and all but one in vain: a thundering herd).
//!
//! A waiter registers its [`TaskFilter`] before it leases, so an enqueue between an empty
//! lease and the wait is not missed (a wake before the wait is kept as a permit). A woken
//! waiter leaves the registry, so the next task wakes another. A wake must not be lost with a
//! waiter that does not lease what it was woken for — it was dropped (a client went away, the
//! lease failed) or it took other tasks — so such a waiter passes the wakes of the tasks it
//! did not lease on to the others ([`Waiter::leased`], and its drop). A woken waiter whose
//! next lease had room and still did not find its task ends the wake there
//! ([`Waiter::leased_after_wake`]): the task was taken by another lease, and a wake passed on
//! for it would go round the waiters for good. Wakes whose tasks are unknown (another process
//! queued them: a change hint, a poll) go to every waiter.

use crate::store::{NewTask, TaskFilter, TaskId, TaskKind};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// A queued task as far as routing is concerned.
#[derive(Debug, Clone)]
struct Routed {
    id: TaskId,
    kind: TaskKind,
    queue: String,
    target: String,
}

impl Routed {
    fn of(task: &NewTask) -> Self {
        Routed {
            id: task.id.clone(),
            kind: task.kind,
            queue: task.queue.clone(),
            target: task.target.clone(),
        }
    }

    fn accepted_by(&self, filter: &TaskFilter) -> bool {
        filter.accepts_route(&self.id.session_id, self.kind, &self.queue, &self.target)
    }
}

/// One waiting lease.
struct Waiting {
    filter: TaskFilter,
    notify: Notify,
    /// The tasks it was woken for (empty for a wake of unknown tasks).
    woken_for: Mutex<Vec<Routed>>,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    /// By registration, so the longest waiting comes first.
    waiting: BTreeMap<u64, Arc<Waiting>>,
}

/// The waiting leases of one engine.
#[derive(Default)]
pub(crate) struct TaskWaiters {
    registry: Mutex<Registry>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl TaskWaiters {
    /// Registers a lease about to ask the store for tasks `filter` accepts.
    pub(crate) fn register(&self, filter: &TaskFilter) -> Waiter<'_> {
        let waiting = Arc::new(Waiting {
            filter: filter.clone(),
            notify: Notify::new(),
            woken_for: Mutex::new(Vec::new()),
        });
        let mut registry = lock(&self.registry);
        let id = registry.next_id;
        registry.next_id += 1;
        registry.waiting.insert(id, waiting.clone());
        Waiter {
            waiters: self,
            id,
            waiting,
            settled: false,
        }
    }

    /// Wakes, for each task, the longest-waiting lease that accepts it and was not woken for
    /// another of them. Tasks no waiting lease accepts wake nobody: they wait for the next
    /// lease that asks.
    pub(crate) fn wake_for(&self, tasks: &[NewTask]) {
        self.wake_routed(tasks.iter().map(Routed::of).collect());
    }

    fn wake_routed(&self, tasks: Vec<Routed>) {
        if tasks.is_empty() {
            return;
        }
        let mut registry = lock(&self.registry);
        for task in tasks {
            let chosen = registry
                .waiting
                .iter()
                .find(|(_, waiting)| task.accepted_by(&waiting.filter))
                .map(|(id, _)| *id);
            if let Some(waiting) = chosen.and_then(|id| registry.waiting.remove(&id)) {
                lock(&waiting.woken_for).push(task);
                waiting.notify.notify_one();
            }
        }
    }

    /// Wakes every waiting lease (tasks may have been queued, which ones is unknown).
    pub(crate) fn wake_all(&self) {
        let waiting = std::mem::take(&mut lock(&self.registry).waiting);
        for waiting in waiting.values() {
            waiting.notify.notify_one();
        }
    }
}

/// A registered lease; leaves the registry when dropped.
pub(crate) struct Waiter<'a> {
    waiters: &'a TaskWaiters,
    id: u64,
    waiting: Arc<Waiting>,
    /// Whether it said what it leased ([`Waiter::leased`]).
    settled: bool,
}

impl Waiter<'_> {
    /// Completes when an enqueue woke it (at once if one did since it registered).
    pub(crate) async fn woken(&self) {
        self.waiting.notify.notified().await;
    }

    /// Says which tasks the lease that followed its registration took: the wakes it got for
    /// tasks it did not take go on to other waiters (the wake may have come after the lease
    /// looked, so the task may be there still).
    pub(crate) fn leased<'t>(mut self, taken: impl IntoIterator<Item = &'t TaskId>) {
        self.settled = true;
        let taken: Vec<&TaskId> = taken.into_iter().collect();
        let missed = self.missed(|id| taken.contains(&id));
        self.waiters.wake_routed(missed);
    }

    /// Says which tasks the lease that followed its wake took, and whether that lease was
    /// `full` (it took as many tasks as it asked for). A task it was woken for and did not
    /// take was queued before that lease looked: when the lease had room, the task was gone
    /// (another lease took it) or not yet due, and the wake ends here — passing it on would
    /// send it round the waiters for good, one empty lease per hop. A full lease may have
    /// left it queued, so then the wake goes on.
    pub(crate) fn leased_after_wake<'t>(
        mut self,
        taken: impl IntoIterator<Item = &'t TaskId>,
        full: bool,
    ) {
        self.settled = true;
        let taken: Vec<&TaskId> = taken.into_iter().collect();
        let missed = self.missed(|id| taken.contains(&id));
        if full {
            self.waiters.wake_routed(missed);
        }
    }

    /// Takes the tasks it was woken for that `taken` does not hold, leaving the registry.
    fn missed(&mut self, taken: impl Fn(&TaskId) -> bool) -> Vec<Routed> {
        lock(&self.waiters.registry).waiting.remove(&self.id);
        let mut woken_for = lock(&self.waiting.woken_for);
        woken_for
            .drain(..)
            .filter(|task| !taken(&task.id))
            .collect()
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let missed = self.missed(|_| false);
        self.waiters.wake_routed(missed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::time::Duration;

    fn task(seq: u64, queue: &str) -> NewTask {
        let mut task = NewTask::new(
            TaskId {
                session_id: "s".to_owned(),
                scheduled_seq: seq,
            },
            TaskKind::Tool,
            0,
        );
        task.queue = queue.to_owned();
        task
    }

    fn on_queue(queue: &str) -> TaskFilter {
        TaskFilter {
            queues: Some(BTreeSet::from([queue.to_owned()])),
            ..TaskFilter::any()
        }
    }

    async fn is_woken(waiter: &Waiter<'_>) -> bool {
        tokio::time::timeout(Duration::from_millis(20), waiter.woken())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn one_task_wakes_one_accepting_waiter_the_longest_waiting() {
        let waiters = TaskWaiters::default();
        let other_queue = waiters.register(&on_queue("gpu"));
        let first = waiters.register(&TaskFilter::any());
        let second = waiters.register(&TaskFilter::any());
        waiters.wake_for(&[task(1, "default")]);
        assert!(
            is_woken(&first).await,
            "the longest-waiting accepting waiter wakes"
        );
        assert!(!is_woken(&second).await, "one task wakes one waiter");
        assert!(
            !is_woken(&other_queue).await,
            "a waiter of another queue is not woken"
        );
        waiters.wake_for(&[task(2, "gpu"), task(3, "default")]);
        assert!(is_woken(&other_queue).await);
        assert!(is_woken(&second).await, "a woken waiter is not woken twice");
    }

    #[tokio::test]
    async fn a_wake_before_the_wait_is_kept() {
        let waiters = TaskWaiters::default();
        let waiter = waiters.register(&TaskFilter::any());
        waiters.wake_for(&[task(1, "default")]);
        assert!(is_woken(&waiter).await);
    }

    #[tokio::test]
    async fn wakes_for_tasks_not_taken_pass_on() {
        let waiters = TaskWaiters::default();
        let dropped = waiters.register(&TaskFilter::any());
        let busy = waiters.register(&TaskFilter::any());
        let next = waiters.register(&TaskFilter::any());
        let last = waiters.register(&TaskFilter::any());
        waiters.wake_for(&[task(1, "default"), task(2, "default")]);
        assert!(is_woken(&dropped).await && is_woken(&busy).await);
        drop(dropped);
        assert!(
            is_woken(&next).await,
            "a waiter dropped before it leased passes its wake on"
        );
        busy.leased([&task(5, "default").id]);
        assert!(
            is_woken(&last).await,
            "a waiter that took other tasks passes its wake on"
        );
        let waiter = waiters.register(&TaskFilter::any());
        next.leased([&task(1, "default").id]);
        assert!(
            !is_woken(&waiter).await,
            "a waiter that took its task passes nothing on"
        );
        drop(last);
        assert!(is_woken(&waiter).await);
    }

    #[tokio::test]
    async fn a_wake_whose_task_is_gone_ends_with_a_lease_that_had_room() {
        let waiters = TaskWaiters::default();
        let woken = waiters.register(&TaskFilter::any());
        let other = waiters.register(&TaskFilter::any());
        waiters.wake_for(&[task(1, "default")]);
        assert!(is_woken(&woken).await);
        woken.leased_after_wake([], false);
        assert!(
            !is_woken(&other).await,
            "a task a lease with room did not find was taken: its wake is not passed on"
        );
        let woken = waiters.register(&TaskFilter::any());
        waiters.wake_for(&[task(2, "default")]);
        assert!(is_woken(&other).await, "the longest waiting wakes first");
        other.leased_after_wake([&task(7, "default").id], true);
        assert!(
            is_woken(&woken).await,
            "a full lease may have left its task queued: the wake goes on"
        );
    }

    #[tokio::test]
    async fn unknown_tasks_wake_everyone() {
        let waiters = TaskWaiters::default();
        let a = waiters.register(&on_queue("a"));
        let b = waiters.register(&on_queue("b"));
        waiters.wake_all();
        assert!(is_woken(&a).await && is_woken(&b).await);
        let c = waiters.register(&on_queue("a"));
        drop(a);
        assert!(
            !is_woken(&c).await,
            "a wake of unknown tasks is not passed on: everyone had it"
        );
    }
}
