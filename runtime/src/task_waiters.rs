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
//!
//! A waiting lease may also be **handed** its tasks ([`TaskWaiters::claim`]): an append that
//! queues a task no worker reported for (a client's message starting a turn, a timer) claims
//! the longest-waiting lease that accepts it, when that lease waits idle, before it is
//! written, leases for it in the same write
//! ([`Store::append_and_lease`](crate::store::Store::append_and_lease)), and hands it the
//! leases once they are durable, so that the lease does not ask the store again (eager
//! dispatch, as a report's next task). That holds for a lease of a worker of this process and
//! for a server's long poll of a worker elsewhere alike: a remote lease is written durably in
//! the append's own write, so the turn's first task costs no commit of its own (Temporal's
//! matching calls this a sync match: a task that finds a poller waiting is handed to it
//! rather than stored for a later poll). A claimed lease stays registered: another enqueue
//! meanwhile wakes it, and it leases from the store at once, as before, rather than wait for
//! the claiming append's sync; the claim's leases then go to its next lease. A store that hands
//! no task with an append, or a failed append, wakes it as any enqueue would. A lease
//! registered with a [`TaskReceiver`] (a worker pool's, which runs each task on a slot of its
//! own) is not even woken: the append gives the tasks to the receiver at once, and the lease
//! waits on, claimable again ([`Claim::received`]); the tasks the receiver has no room for are
//! handed to the lease. Leases handed to a lease that stopped waiting meanwhile (its deadline
//! came, its caller went: a worker that hung up) are kept here, and the next lease of this
//! process with the same filter for the same kind of holder takes them first
//! ([`TaskWaiters::take_orphans`]), while they are current: no task leased for a worker of
//! this process waits for its lease to lapse, and one leased for a remote worker that went
//! away goes to that worker's next poll, or else lapses as any lease of a vanished worker
//! does.

use crate::engine::LeasedTask;
use crate::store::{Lease, LeaseHolder, LeaseRequest, NewTask, TaskFilter, TaskId, TaskKind};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// Takes the tasks an append hands a waiting lease of a worker of this process, to run at
/// once, so that the lease need not be woken to return them (and its caller to start them):
/// a worker pool spawns a slot for each. See [`crate::Engine::lease_tasks_waiting_receiving`].
pub trait TaskReceiver: Send + Sync {
    /// Starts running `tasks`, each leased durably for this process's workers; gives back
    /// those it has no room for (no free slot, the pool stopping), which the waiting lease
    /// then returns.
    fn receive(&self, tasks: Vec<LeasedTask>) -> Vec<LeasedTask>;
}

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
    filter: Arc<TaskFilter>,
    notify: Notify,
    /// The tasks it was woken for (empty for a wake of unknown tasks).
    woken_for: Mutex<Vec<Routed>>,
    /// What an append may lease for it ([`TaskWaiters::claim`]).
    handing: Handing,
    /// Where an append gives the tasks it leases for it, if not to the lease itself.
    receiver: Option<Arc<dyn TaskReceiver>>,
    /// Leases an append took for it, until the lease takes them.
    handed: Mutex<Handed>,
    /// Whether it waits for a wake: its look at the store found nothing. Only such a lease is
    /// claimed: one that is still looking may find tasks queued before, which a lease in an
    /// append would hold back until that append is durable.
    idle: AtomicBool,
}

/// What an append leases for a claimed lease: how many tasks, for how long, for whom.
#[derive(Debug, Clone, Copy)]
struct Handing {
    max: usize,
    lease_ms: u64,
    holder: LeaseHolder,
}

/// A lease handed to a lease that stopped waiting, kept for the next one like it.
struct Orphan {
    /// The filter it was leased for.
    filter: Arc<TaskFilter>,
    /// Whom it was leased for: a remote lease is durable, an in-process one may not be.
    holder: LeaseHolder,
    lease: Lease,
}

/// What an append handed a waiting lease.
#[derive(Default)]
enum Handed {
    /// Nothing yet.
    #[default]
    Nothing,
    /// An append leases for it.
    Claimed,
    /// Leases for it to take.
    Leases(Vec<Lease>),
    /// The lease is gone: nothing more may be handed to it.
    Gone,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    /// By registration, so the longest waiting comes first.
    waiting: BTreeMap<u64, Arc<Waiting>>,
    /// Leases handed to a lease that was no longer waiting, for the next lease with the same
    /// filter and holder.
    orphans: Vec<Orphan>,
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
    /// Registers a lease for `holder` about to ask the store for at most `max` tasks `filter`
    /// accepts, for `lease_ms`: an enqueue wakes it, or an append leases them for it and hands
    /// them over ([`TaskWaiters::claim`], [`Waiter::take_handed`]), or, for a worker of this
    /// process, gives them to `receiver`.
    pub(crate) fn register(
        &self,
        filter: &Arc<TaskFilter>,
        max: usize,
        lease_ms: u64,
        holder: LeaseHolder,
        receiver: Option<Arc<dyn TaskReceiver>>,
    ) -> Waiter<'_> {
        let handing = Handing {
            max,
            lease_ms,
            holder,
        };
        let waiting = Arc::new(Waiting {
            filter: Arc::clone(filter),
            notify: Notify::new(),
            woken_for: Mutex::new(Vec::new()),
            handing,
            receiver,
            handed: Mutex::new(Handed::Nothing),
            idle: AtomicBool::new(false),
        });
        let mut registry = lock(&self.registry);
        let id = registry.next_id;
        registry.next_id += 1;
        registry.waiting.insert(id, waiting.clone());
        Waiter {
            waiters: self,
            id,
            waiting,
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

    /// How many leases wait idle ([`Waiter::idle`]).
    pub(crate) fn idle(&self) -> usize {
        lock(&self.registry)
            .waiting
            .values()
            .filter(|waiting| waiting.idle.load(Ordering::Acquire))
            .count()
    }

    /// Claims the waiting lease an enqueue of `tasks` would wake first, if it waits idle
    /// ([`Waiter::idle`]) and no other append claimed it,
    /// for the append that queues them to lease for it. The claim then hands it the leases
    /// (taking it out of the registry), or wakes it as an enqueue would; dropped unsettled
    /// (the append's caller gone), it wakes it.
    pub(crate) fn claim(&self, tasks: &[NewTask]) -> Option<Claim<'_>> {
        let registry = lock(&self.registry);
        for task in tasks {
            let task = Routed::of(task);
            let Some(waiting) = registry
                .waiting
                .values()
                .find(|waiting| task.accepted_by(&waiting.filter))
            else {
                continue;
            };
            let handing = waiting.handing;
            if !waiting.idle.load(Ordering::Acquire) {
                return None;
            }
            let mut handed = lock(&waiting.handed);
            if !matches!(*handed, Handed::Nothing) {
                return None;
            }
            *handed = Handed::Claimed;
            drop(handed);
            // It stays registered: another enqueue meanwhile wakes it as before, and it leases
            // from the store at once instead of waiting for this append's sync; what the
            // claim hands it then goes to its next lease.
            let waiting = Arc::clone(waiting);
            let request = LeaseRequest {
                filter: Arc::clone(&waiting.filter),
                max: handing.max,
                lease_ms: handing.lease_ms,
                holder: handing.holder,
            };
            return Some(Claim {
                waiters: self,
                waiting,
                task,
                request,
                settled: false,
            });
        }
        None
    }

    /// Takes up to `max` of the leases handed to a lease no longer waiting that was leasing
    /// with `filter` for `holder`, for a lease with the same filter and holder (a pool, and a
    /// remote worker, ask with the same one every time). Leases that lapsed by `now_ms` are
    /// dropped, whoever they were for: their tasks are due again in the store, for any lease.
    pub(crate) fn take_orphans(
        &self,
        filter: &TaskFilter,
        holder: LeaseHolder,
        max: usize,
        now_ms: u64,
    ) -> Vec<Lease> {
        let mut registry = lock(&self.registry);
        if registry.orphans.is_empty() {
            return Vec::new();
        }
        let mut taken = Vec::new();
        registry.orphans.retain(|orphan| {
            if orphan.lease.expires_at_ms <= now_ms {
                return false;
            }
            let take = taken.len() < max && orphan.holder == holder && *orphan.filter == *filter;
            if take {
                taken.push(orphan.lease.clone());
            }
            !take
        });
        taken
    }

    /// Keeps `leases`, leased for `filter` and `holder`, for the next lease with that filter
    /// and holder, and wakes the one waiting longest, if one is.
    fn orphan(&self, filter: &Arc<TaskFilter>, holder: LeaseHolder, leases: Vec<Lease>) {
        let mut registry = lock(&self.registry);
        registry
            .orphans
            .extend(leases.into_iter().map(|lease| Orphan {
                filter: Arc::clone(filter),
                holder,
                lease,
            }));
        let waiting = registry
            .waiting
            .iter()
            .find(|(_, waiting)| waiting.handing.holder == holder && *waiting.filter == **filter)
            .map(|(id, _)| *id)
            .and_then(|id| registry.waiting.remove(&id));
        drop(registry);
        if let Some(waiting) = waiting {
            waiting.notify.notify_one();
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

/// A waiting lease claimed by an append ([`TaskWaiters::claim`]).
pub(crate) struct Claim<'a> {
    waiters: &'a TaskWaiters,
    waiting: Arc<Waiting>,
    /// The task it was claimed for.
    task: Routed,
    request: LeaseRequest,
    settled: bool,
}

impl Claim<'_> {
    /// Whether it was claimed for task `id` (the one it is woken for when handed nothing).
    pub(crate) fn is_for(&self, id: &TaskId) -> bool {
        self.task.id == *id
    }

    /// What the append leases for the claimed lease.
    pub(crate) fn request(&self) -> &LeaseRequest {
        &self.request
    }

    /// Where the claimed lease's tasks go to run at once, if it has a receiver.
    pub(crate) fn receiver(&self) -> Option<&Arc<dyn TaskReceiver>> {
        self.waiting.receiver.as_ref()
    }

    /// Says that the claimed lease's receiver took every lease the append made: the lease,
    /// never woken, waits on and may be claimed again.
    pub(crate) fn received(mut self) {
        self.settled = true;
        let mut handed = lock(&self.waiting.handed);
        if matches!(*handed, Handed::Claimed) {
            *handed = Handed::Nothing;
        }
    }

    /// Hands `leases`, taken by the append (durable), to the claimed lease and wakes it; with
    /// none, wakes it as an enqueue of its task would. When the lease stopped waiting
    /// meanwhile, the leases go to the next one that accepts them.
    pub(crate) fn hand(mut self, leases: Vec<Lease>) {
        self.settled = true;
        if leases.is_empty() {
            self.wake();
            return;
        }
        let mut handed = lock(&self.waiting.handed);
        match &mut *handed {
            Handed::Gone => {
                drop(handed);
                self.waiters
                    .orphan(&self.request.filter, self.request.holder, leases);
                return;
            }
            Handed::Leases(earlier) => earlier.extend(leases),
            open @ (Handed::Nothing | Handed::Claimed) => *open = Handed::Leases(leases),
        }
        drop(handed);
        // Out of the registry: it returns these, and a wake for another task would be lost
        // with it.
        lock(&self.waiters.registry)
            .waiting
            .retain(|_, waiting| !Arc::ptr_eq(waiting, &self.waiting));
        self.waiting.notify.notify_one();
    }

    /// Wakes the claimed lease as an enqueue of its task would (the append failed, or handed
    /// nothing); when that lease is gone, the wake goes to the others.
    fn wake(&mut self) {
        self.settled = true;
        {
            let mut handed = lock(&self.waiting.handed);
            if matches!(*handed, Handed::Claimed) {
                *handed = Handed::Nothing;
            }
        }
        // It is still registered unless another wake took it: the wake goes to it or on.
        self.waiters.wake_routed(vec![self.task.clone()]);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.settled {
            // An append failed or abandoned: its task, if queued after all, is found by the
            // lease this wake makes.
            self.wake();
        }
    }
}

/// A registered lease; leaves the registry when dropped.
pub(crate) struct Waiter<'a> {
    waiters: &'a TaskWaiters,
    id: u64,
    waiting: Arc<Waiting>,
}

impl Waiter<'_> {
    /// Says that its look at the store found nothing and it waits for a wake: from now on an
    /// append may claim it ([`TaskWaiters::claim`]).
    pub(crate) fn idle(&self) {
        self.waiting.idle.store(true, Ordering::Release);
    }

    /// Completes when an enqueue woke it (at once if one did since it registered).
    pub(crate) async fn woken(&self) {
        self.waiting.notify.notified().await;
    }

    /// The leases an append handed it since it registered ([`TaskWaiters::claim`]), taken:
    /// its own from here, to run.
    pub(crate) fn take_handed(&self) -> Vec<Lease> {
        let mut handed = lock(&self.waiting.handed);
        match &mut *handed {
            Handed::Leases(leases) => {
                let leases = std::mem::take(leases);
                *handed = Handed::Nothing;
                leases
            }
            Handed::Nothing | Handed::Claimed | Handed::Gone => Vec::new(),
        }
    }

    /// Says which tasks the lease that followed its registration took: the wakes it got for
    /// tasks it did not take go on to other waiters (the wake may have come after the lease
    /// looked, so the task may be there still).
    pub(crate) fn leased<'t>(mut self, taken: impl IntoIterator<Item = &'t TaskId>) {
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
        let left = std::mem::replace(&mut *lock(&self.waiting.handed), Handed::Gone);
        if let Handed::Leases(leases) = left {
            // Handed in the moment between the hand and this lease's return (its caller
            // stopped waiting): the next lease with its filter and holder takes them.
            self.waiters
                .orphan(&self.waiting.filter, self.waiting.handing.holder, leases);
        }
        // Every wake it got and did not settle ([`Waiter::leased`] and
        // [`Waiter::leased_after_wake`] take theirs) goes on: all of them when it never leased,
        // else one that came after (a claim's, as its lease went).
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

    /// A remote worker's lease of one task for a second, as a server's long poll registers.
    fn remote_lease<'w>(waiters: &'w TaskWaiters, filter: &TaskFilter) -> Waiter<'w> {
        waiters.register(
            &Arc::new(filter.clone()),
            1,
            1_000,
            LeaseHolder::Remote,
            None,
        )
    }

    async fn is_woken(waiter: &Waiter<'_>) -> bool {
        tokio::time::timeout(Duration::from_millis(20), waiter.woken())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn one_task_wakes_one_accepting_waiter_the_longest_waiting() {
        let waiters = TaskWaiters::default();
        let other_queue = remote_lease(&waiters, &on_queue("gpu"));
        let first = remote_lease(&waiters, &TaskFilter::any());
        let second = remote_lease(&waiters, &TaskFilter::any());
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
        let waiter = remote_lease(&waiters, &TaskFilter::any());
        waiters.wake_for(&[task(1, "default")]);
        assert!(is_woken(&waiter).await);
    }

    #[tokio::test]
    async fn wakes_for_tasks_not_taken_pass_on() {
        let waiters = TaskWaiters::default();
        let dropped = remote_lease(&waiters, &TaskFilter::any());
        let busy = remote_lease(&waiters, &TaskFilter::any());
        let next = remote_lease(&waiters, &TaskFilter::any());
        let last = remote_lease(&waiters, &TaskFilter::any());
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
        let waiter = remote_lease(&waiters, &TaskFilter::any());
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
        let woken = remote_lease(&waiters, &TaskFilter::any());
        let other = remote_lease(&waiters, &TaskFilter::any());
        waiters.wake_for(&[task(1, "default")]);
        assert!(is_woken(&woken).await);
        woken.leased_after_wake([], false);
        assert!(
            !is_woken(&other).await,
            "a task a lease with room did not find was taken: its wake is not passed on"
        );
        let woken = remote_lease(&waiters, &TaskFilter::any());
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
        let a = remote_lease(&waiters, &on_queue("a"));
        let b = remote_lease(&waiters, &on_queue("b"));
        waiters.wake_all();
        assert!(is_woken(&a).await && is_woken(&b).await);
        let c = remote_lease(&waiters, &on_queue("a"));
        drop(a);
        assert!(
            !is_woken(&c).await,
            "a wake of unknown tasks is not passed on: everyone had it"
        );
    }

    fn lease_of(task: &NewTask) -> Lease {
        Lease {
            id: task.id.clone(),
            kind: task.kind,
            lease_attempt: 1,
            expires_at_ms: 30_000,
        }
    }

    fn ids(leases: &[Lease]) -> Vec<String> {
        leases.iter().map(|lease| lease.id.to_string()).collect()
    }

    /// An enqueue claims the waiting lease it would wake first when that lease is a worker's
    /// of this process waiting idle, with its own lease request; another claim passes it by,
    /// another enqueue still wakes it, and the claim's hand wakes it and takes it out of the
    /// registry.
    #[tokio::test]
    async fn an_enqueue_claims_the_longest_waiting_in_process_lease_and_hands_it_its_leases() {
        let waiters = TaskWaiters::default();
        let gpu = Arc::new(on_queue("gpu"));
        let any = Arc::new(TaskFilter::any());
        let other_queue = waiters.register(&gpu, 4, 1_000, LeaseHolder::InProcess, None);
        let first = waiters.register(&any, 3, 2_000, LeaseHolder::InProcess, None);
        let second = waiters.register(&any, 5, 3_000, LeaseHolder::InProcess, None);
        let queued = task(1, "default");
        assert!(
            waiters.claim(std::slice::from_ref(&queued)).is_none(),
            "a lease still looking at the store is not claimed"
        );
        for waiter in [&other_queue, &first, &second] {
            waiter.idle();
        }
        let claim = waiters
            .claim(std::slice::from_ref(&queued))
            .expect("a waiting lease of this process accepts it");
        assert!(claim.is_for(&queued.id));
        let request = claim.request();
        assert_eq!(
            (*request.filter == *any, request.max, request.lease_ms),
            (true, 3, 2_000),
            "the longest-waiting accepting lease's request"
        );
        assert_eq!(request.holder, LeaseHolder::InProcess);
        assert!(
            waiters.claim(&[task(2, "default")]).is_none(),
            "claimed once: the next append wakes it after its own write"
        );
        claim.hand(vec![lease_of(&queued)]);
        assert!(is_woken(&first).await, "handed, it wakes");
        assert_eq!(ids(&first.take_handed()), ["s/1"]);
        assert!(first.take_handed().is_empty(), "taken once");
        waiters.wake_for(&[task(2, "default")]);
        assert!(
            is_woken(&second).await,
            "handed, it left the registry: the next task wakes the next lease"
        );
        assert!(!is_woken(&other_queue).await);

        // A claimed lease another enqueue wakes first leases as before; the claim's leases
        // then go to the next lease of its filter.
        let third = waiters.register(&any, 1, 1_000, LeaseHolder::InProcess, None);
        third.idle();
        let claim = waiters.claim(&[task(5, "default")]).expect("claimed");
        waiters.wake_for(&[task(6, "default")]);
        assert!(is_woken(&third).await, "still registered, woken");
        third.leased_after_wake([&task(6, "default").id], true);
        claim.hand(vec![lease_of(&task(5, "default"))]);
        assert_eq!(
            ids(&waiters.take_orphans(&TaskFilter::any(), LeaseHolder::InProcess, 4, 0)),
            ["s/5"]
        );
    }

    /// The lease a remote worker waits with (a server's long poll) is claimed as one of this
    /// process's is, and the append leases for it as a remote worker's: durably.
    #[tokio::test]
    async fn a_remote_workers_waiting_lease_is_claimed_for_a_durable_lease() {
        let waiters = TaskWaiters::default();
        let remote = waiters.register(
            &Arc::new(TaskFilter::any()),
            7,
            30_000,
            LeaseHolder::Remote,
            None,
        );
        assert!(
            waiters.claim(&[task(1, "default")]).is_none(),
            "still looking at the store"
        );
        remote.idle();
        let claim = waiters.claim(&[task(1, "default")]).expect("claimed");
        let request = claim.request();
        assert_eq!(
            (request.max, request.lease_ms, request.holder),
            (7, 30_000, LeaseHolder::Remote)
        );
        assert!(claim.receiver().is_none());
        claim.hand(vec![lease_of(&task(1, "default"))]);
        assert!(is_woken(&remote).await);
        assert_eq!(ids(&remote.take_handed()), ["s/1"]);
    }

    /// A claim whose append handed nothing (a store that leases in a round of its own), or
    /// that was dropped unsettled (a failed or abandoned append), wakes its lease for its
    /// task as an enqueue would.
    #[tokio::test]
    async fn a_claim_that_hands_nothing_wakes_its_lease() {
        let waiters = TaskWaiters::default();
        let any = Arc::new(TaskFilter::any());
        let mut handed_nothing = waiters.register(&any, 1, 1_000, LeaseHolder::InProcess, None);
        handed_nothing.idle();
        waiters
            .claim(&[task(2, "default")])
            .expect("claimed")
            .hand(Vec::new());
        assert!(is_woken(&handed_nothing).await);
        assert!(handed_nothing.take_handed().is_empty());
        let missed = handed_nothing.missed(|_| false);
        assert_eq!(missed.len(), 1, "woken for its task, as by an enqueue");
        assert_eq!(missed[0].id.to_string(), "s/2");
        let abandoned = waiters.register(&any, 1, 1_000, LeaseHolder::InProcess, None);
        abandoned.idle();
        drop(waiters.claim(&[task(3, "default")]).expect("claimed"));
        assert!(
            is_woken(&abandoned).await,
            "a dropped claim wakes its lease"
        );
        drop(abandoned);

        // The claimed lease went before the wake: the wake goes to another that accepts it.
        let gone = waiters.register(&any, 1, 1_000, LeaseHolder::InProcess, None);
        gone.idle();
        let claim = waiters.claim(&[task(4, "default")]).expect("claimed");
        drop(gone);
        let other = remote_lease(&waiters, &TaskFilter::any());
        claim.hand(Vec::new());
        assert!(is_woken(&other).await, "the wake went on");
    }

    /// Leases handed to a lease that stopped waiting (dropped before the hand, or after it
    /// without taking them) are kept for the next lease of the same filter, which a waiting
    /// one is woken for; a lease of another filter does not take them.
    #[tokio::test]
    async fn leases_handed_to_a_lease_gone_go_to_the_next_lease_of_its_filter() {
        let waiters = TaskWaiters::default();
        let any = Arc::new(TaskFilter::any());
        let gone = waiters.register(&any, 2, 1_000, LeaseHolder::InProcess, None);
        gone.idle();
        let claim = waiters.claim(&[task(1, "default")]).expect("claimed");
        drop(gone);
        let waiting = waiters.register(&any, 2, 1_000, LeaseHolder::InProcess, None);
        claim.hand(vec![lease_of(&task(1, "default"))]);
        assert!(
            is_woken(&waiting).await,
            "a lease of the filter is woken for them"
        );
        assert!(waiters
            .take_orphans(&on_queue("gpu"), LeaseHolder::InProcess, 10, 0)
            .is_empty());
        assert_eq!(
            ids(&waiters.take_orphans(&TaskFilter::any(), LeaseHolder::InProcess, 10, 0)),
            ["s/1"]
        );
        assert!(waiters
            .take_orphans(&TaskFilter::any(), LeaseHolder::InProcess, 10, 0)
            .is_empty());

        let dropped_after = waiters.register(&any, 2, 1_000, LeaseHolder::InProcess, None);
        dropped_after.idle();
        let claim = waiters.claim(&[task(2, "default")]).expect("claimed");
        claim.hand(vec![
            lease_of(&task(2, "default")),
            lease_of(&task(3, "default")),
        ]);
        drop(dropped_after);
        assert_eq!(
            ids(&waiters.take_orphans(&TaskFilter::any(), LeaseHolder::InProcess, 1, 0)),
            ["s/2"],
            "at most max"
        );
        assert_eq!(
            ids(&waiters.take_orphans(&TaskFilter::any(), LeaseHolder::InProcess, 1, 0)),
            ["s/3"]
        );
    }

    /// A lease handed to a remote worker's lease that went (its worker hung up) goes to the
    /// next remote lease of its filter, never to one of this process's, and only while it is
    /// current: one that lapsed is dropped, its task due again in the store.
    #[tokio::test]
    async fn a_remote_lease_gone_goes_to_the_next_remote_lease_of_its_filter_while_current() {
        let waiters = TaskWaiters::default();
        let any = Arc::new(TaskFilter::any());
        for seq in [1, 2] {
            let gone = waiters.register(&any, 1, 1_000, LeaseHolder::Remote, None);
            gone.idle();
            let claim = waiters.claim(&[task(seq, "default")]).expect("claimed");
            drop(gone);
            claim.hand(vec![lease_of(&task(seq, "default"))]);
        }
        let in_process = waiters.register(&any, 1, 1_000, LeaseHolder::InProcess, None);
        let orphaned = waiters.register(&any, 1, 1_000, LeaseHolder::Remote, None);
        waiters.orphan(
            &any,
            LeaseHolder::Remote,
            vec![lease_of(&task(3, "default"))],
        );
        assert!(
            is_woken(&orphaned).await,
            "the remote lease of the filter is woken for it"
        );
        assert!(!is_woken(&in_process).await, "not one of this process's");
        assert!(waiters
            .take_orphans(&TaskFilter::any(), LeaseHolder::InProcess, 10, 0)
            .is_empty());
        assert_eq!(
            ids(&waiters.take_orphans(&TaskFilter::any(), LeaseHolder::Remote, 1, 29_999)),
            ["s/1"],
            "current until it expires at 30,000"
        );
        assert!(
            waiters
                .take_orphans(&TaskFilter::any(), LeaseHolder::Remote, 10, 30_000)
                .is_empty(),
            "lapsed, the others are dropped"
        );
        assert!(waiters
            .take_orphans(&TaskFilter::any(), LeaseHolder::Remote, 10, 0)
            .is_empty());
    }

    struct NoRoom;

    impl TaskReceiver for NoRoom {
        fn receive(&self, tasks: Vec<LeasedTask>) -> Vec<LeasedTask> {
            tasks
        }
    }

    /// A lease registered with a receiver is claimed as any other, and says where its tasks
    /// go; once the receiver took them, the lease is neither woken nor taken out of the
    /// registry, and the next append may claim it again. A lease without one has none.
    #[tokio::test]
    async fn a_claim_whose_receiver_took_the_tasks_leaves_its_lease_waiting_and_claimable() {
        let waiters = TaskWaiters::default();
        let any = Arc::new(TaskFilter::any());
        let receiving = waiters.register(
            &any,
            2,
            1_000,
            LeaseHolder::InProcess,
            Some(Arc::new(NoRoom)),
        );
        receiving.idle();
        let claim = waiters.claim(&[task(1, "default")]).expect("claimed");
        assert!(
            claim.receiver().is_some(),
            "its receiver comes with the claim"
        );
        assert!(
            waiters.claim(&[task(2, "default")]).is_none(),
            "claimed, until the claim settles"
        );
        claim.received();
        assert!(!is_woken(&receiving).await, "never woken");
        assert!(receiving.take_handed().is_empty(), "nothing handed to it");
        assert_eq!(waiters.idle(), 1, "still registered, idle");
        let again = waiters
            .claim(&[task(3, "default")])
            .expect("claimable again");
        again.hand(vec![lease_of(&task(3, "default"))]);
        assert!(is_woken(&receiving).await, "what it is handed wakes it");
        assert_eq!(ids(&receiving.take_handed()), ["s/3"]);

        let plain = waiters.register(&any, 1, 1_000, LeaseHolder::InProcess, None);
        plain.idle();
        let claim = waiters.claim(&[task(4, "default")]).expect("claimed");
        assert!(claim.receiver().is_none());
    }
}
