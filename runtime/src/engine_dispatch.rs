//! Leasing tasks to workers: long polls that wait for work, leases an append hands over to
//! a waiting worker, what each leased task runs, and heartbeats that renew leases.

use super::{lock, ActivityInput, ActivityRef, ActivityTimeouts, Engine, LeasedTask};
use crate::error::Result;
use crate::store::{Lease, LeaseHolder, TaskFilter, TaskId};
use crate::task_waiters::TaskReceiver;
use crate::workflow::{ScheduledActivity, SessionState};
use cairn_ledger::JsonText;
use std::sync::Arc;
use tracing::{debug, warn};
// Named in doc links only.
#[cfg(doc)]
use crate::store::Store;

/// Whose lease waits for tasks ([`Engine::lease_tasks_waiting`]).
enum WaitingFor {
    /// A worker elsewhere: a server's long poll.
    Remote,
    /// A worker of this process, with where an append gives the tasks it leases for it, if
    /// not to the lease itself.
    InProcess(Option<Arc<dyn TaskReceiver>>),
}

impl Engine {
    /// Leases like [`Engine::lease_tasks_for`], waiting until `deadline` for the first task if
    /// none is due (a long poll). An enqueue wakes one waiting lease per task, one whose
    /// filter accepts it; tasks queued by other processes wake every waiting lease. When
    /// `stop` completes during the wait, answers at once with no task.
    pub async fn lease_tasks_waiting(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        deadline: tokio::time::Instant,
        stop: impl std::future::Future<Output = ()>,
        holder: LeaseHolder,
    ) -> Result<Vec<LeasedTask>> {
        let waiting_for = match holder {
            LeaseHolder::InProcess => WaitingFor::InProcess(None),
            LeaseHolder::Remote => WaitingFor::Remote,
        };
        self.wait_for_tasks(filter, max, lease_ms, deadline, stop, waiting_for)
            .await
    }

    /// Leases like [`Engine::lease_tasks_waiting`] for a worker of this process, except that
    /// while it waits idle, the tasks an append of this engine queues (a client's message, a
    /// timer) are leased with that append and given to `receiver` at once, instead of
    /// waking this lease to return them: a worker pool's receiver starts each on a slot of
    /// its own, so the task's first step follows the append's sync without a wake of the
    /// pool's lease loop in between. This lease returns what it leases itself, and what
    /// `receiver` had no room for.
    pub async fn lease_tasks_waiting_receiving(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        deadline: tokio::time::Instant,
        receiver: Arc<dyn TaskReceiver>,
    ) -> Result<Vec<LeasedTask>> {
        let waiting_for = WaitingFor::InProcess(Some(receiver));
        self.wait_for_tasks(
            filter,
            max,
            lease_ms,
            deadline,
            std::future::pending(),
            waiting_for,
        )
        .await
    }

    // A long poll waits on real time.
    #[allow(clippy::disallowed_methods)]
    async fn wait_for_tasks(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
        deadline: tokio::time::Instant,
        stop: impl std::future::Future<Output = ()>,
        waiting_for: WaitingFor,
    ) -> Result<Vec<LeasedTask>> {
        tokio::pin!(stop);
        let waiters = &self.inner.waiters;
        // An append may lease the tasks it queues for this lease and hand them over
        // (`TaskWaiters::claim`), durably for a remote worker; what a lease that stopped
        // waiting was handed goes to the next lease like it (`Engine::lease_tasks_for`).
        let (holder, receiver) = match waiting_for {
            WaitingFor::InProcess(receiver) => (LeaseHolder::InProcess, receiver),
            WaitingFor::Remote => (LeaseHolder::Remote, None),
        };
        let shared = Arc::new(filter.clone());
        let register = || waiters.register(&shared, max, lease_ms, holder, receiver.clone());
        // Registered before leasing, so an enqueue between an empty lease and the wait wakes it.
        let mut waiter = register();
        let mut leased = self.lease_tasks_for(holder, filter, max, lease_ms).await?;
        loop {
            if !leased.is_empty() || tokio::time::Instant::now() >= deadline {
                // A wake this waiter got may be for a task queued after the lease looked: it
                // passes on every wake whose task it did not take.
                waiter.leased(leased.iter().map(|task| &task.lease.id));
                return Ok(leased);
            }
            waiter.idle();
            tokio::select! {
                _ = waiter.woken() => {}
                _ = tokio::time::sleep_until(deadline) => {}
                _ = &mut stop => {
                    // Leases an append handed it are its caller's, durable for a remote one:
                    // returned rather than left to lapse. Dropped, the waiter passes its
                    // wakes on.
                    let handed = waiter.take_handed();
                    let leased = self.with_activities(handed).await;
                    waiter.leased(leased.iter().map(|task| &task.lease.id));
                    return Ok(leased);
                }
            }
            let handed = waiter.take_handed();
            if !handed.is_empty() {
                let leased = self.with_activities(handed).await;
                waiter.leased(leased.iter().map(|task| &task.lease.id));
                return Ok(leased);
            }
            let woken = waiter;
            waiter = register();
            leased = self.lease_tasks_for(holder, filter, max, lease_ms).await?;
            // The woken waiter's wakes came before this lease looked.
            woken.leased_after_wake(
                leased.iter().map(|task| &task.lease.id),
                leased.len() >= max,
            );
        }
    }

    /// What a leased task should run; `None` when the workflow no longer wants it (the task is
    /// then removed from the queue).
    pub async fn activity(&self, lease: &Lease) -> Result<Option<ActivityInput>> {
        let session_id = &lease.id.session_id;
        let slot = self.slot(session_id);
        let mut guard = slot.lock().await;
        // This engine applies its own appends to its cached state, so a cached state that
        // holds the task's scheduling and heard of no append elsewhere since answers without
        // a read: the common case, a task this engine queued. Otherwise, and before a task is
        // dropped as unwanted, the state catches up with the store first.
        let cached = guard
            .as_ref()
            .filter(|state| lease.id.scheduled_seq < state.next_seq && !self.heard_ahead(state))
            .and_then(|state| activity_input(state, lease));
        let input = match cached {
            Some(input) => Some(input),
            None => activity_input(self.loaded(session_id, &mut guard).await?, lease),
        };
        drop(guard);
        if input.is_none() {
            self.discard_task(lease).await?;
        }
        Ok(input)
    }

    /// Leases up to `max` due tasks that `filter` accepts, each for `lease_ms`, with what they
    /// run, durably (for any worker: see [`Engine::lease_tasks_for`]). Tasks the workflow no
    /// longer wants are dropped on the way and not returned.
    pub async fn lease_tasks(
        &self,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
    ) -> Result<Vec<LeasedTask>> {
        self.lease_tasks_for(LeaseHolder::Remote, filter, max, lease_ms)
            .await
    }

    /// Leases like [`Engine::lease_tasks`] for a worker of `holder`'s kind: a lease for a
    /// worker of this process may be handed out before it is durable
    /// ([`Store::lease_tasks_in_process`]). Either takes first the current leases an append
    /// handed to a waiting lease of the same filter and holder that stopped waiting
    /// ([`Engine::lease_tasks_waiting`]).
    pub async fn lease_tasks_for(
        &self,
        holder: LeaseHolder,
        filter: &TaskFilter,
        max: usize,
        lease_ms: u64,
    ) -> Result<Vec<LeasedTask>> {
        let now_ms = self.now_ms();
        let orphans = self.inner.waiters.take_orphans(filter, holder, max, now_ms);
        if !orphans.is_empty() {
            return Ok(self.with_activities(orphans).await);
        }
        let store = &self.inner.store;
        let leases = match holder {
            LeaseHolder::InProcess => {
                store
                    .lease_tasks_in_process(now_ms, lease_ms, max, filter)
                    .await?
            }
            LeaseHolder::Remote => store.lease_tasks(now_ms, lease_ms, max, filter).await?,
        };
        Ok(self.with_activities(leases).await)
    }

    /// Gives `receiver` the leases an append just took for a claimed lease, each with what it
    /// runs as `state` (the appending session's, current: the append is durable) schedules
    /// it; returns the leases it did not take, and those of tasks `state` does not say how to
    /// run (another session's, leased with the append), for the lease itself, which finds
    /// out as it would have.
    pub(super) fn give_to_receiver(
        &self,
        receiver: &dyn TaskReceiver,
        state: Option<&SessionState>,
        leases: Vec<Lease>,
    ) -> Vec<Lease> {
        let mut left = Vec::new();
        let mut tasks = Vec::with_capacity(leases.len());
        for lease in leases {
            let input = state
                .filter(|state| state.session_id == lease.id.session_id)
                .and_then(|state| activity_input(state, &lease));
            match input {
                Some(input) => tasks.push(LeasedTask { lease, input }),
                None => left.push(lease),
            }
        }
        if tasks.is_empty() {
            return left;
        }
        {
            let mut here = lock(&self.inner.leased_here);
            for task in &tasks {
                here.insert(
                    task.lease.id.clone(),
                    (task.lease.lease_attempt, task.lease.expires_at_ms),
                );
            }
        }
        // Given back, a lease goes to the lease itself, which records it here again.
        left.extend(receiver.receive(tasks).into_iter().map(|task| task.lease));
        left
    }

    /// The leases this engine handed out, each with what it runs; tasks the workflow no
    /// longer wants are dropped on the way and not returned.
    pub(super) async fn with_activities(&self, leases: Vec<Lease>) -> Vec<LeasedTask> {
        if !leases.is_empty() {
            let mut here = lock(&self.inner.leased_here);
            for lease in &leases {
                here.insert(lease.id.clone(), (lease.lease_attempt, lease.expires_at_ms));
            }
        }
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            match self.activity(&lease).await {
                Ok(Some(input)) => out.push(LeasedTask { lease, input }),
                Ok(None) => {
                    debug!(task = %lease.id, "task no longer wanted; dropped");
                    lock(&self.inner.leased_here).remove(&lease.id);
                }
                // Its lease lapses and the timers record the attempt as failed.
                Err(e) => {
                    warn!(task = %lease.id, error = %e, "cannot load a leased task's activity");
                    lock(&self.inner.leased_here).remove(&lease.id);
                }
            }
        }
        out
    }

    /// Renews a lease for `lease_ms` from now (a heartbeat), storing `details` durably when
    /// given: if the attempt's lease later lapses, its failure carries them to the next
    /// attempt. Returns the new expiry; `LeaseLost` when the lease is no longer current (the
    /// task was cancelled or completed, or its lease lapsed), and the worker should stop.
    pub async fn heartbeat(
        &self,
        lease: &Lease,
        lease_ms: u64,
        details: Option<JsonText>,
    ) -> Result<u64> {
        let expires_at_ms = self
            .inner
            .store
            .extend_lease(
                &lease.id,
                lease.lease_attempt,
                self.now_ms(),
                lease_ms,
                details,
            )
            .await?;
        if let Some(entry) = lock(&self.inner.leased_here).get_mut(&lease.id) {
            if entry.0 == lease.lease_attempt {
                entry.1 = expires_at_ms;
            }
        }
        Ok(expires_at_ms)
    }

    /// The leases this engine handed out that have neither been reported nor run out, by
    /// task and attempt (a draining server waits for these). Forgets the ones that ran out.
    pub fn leases_held_here(&self) -> Vec<(TaskId, u32)> {
        let now = self.now_ms();
        let mut here = lock(&self.inner.leased_here);
        here.retain(|_, (_, expires_at_ms)| *expires_at_ms > now);
        here.iter()
            .map(|(id, (attempt, _))| (id.clone(), *attempt))
            .collect()
    }

    /// How many leases wait idle for tasks here ([`Engine::lease_tasks_waiting`]: their look
    /// at the store found nothing). For tests that need a pool waiting before they append.
    #[doc(hidden)]
    pub fn idle_leases(&self) -> usize {
        self.inner.waiters.idle()
    }
}

/// What `lease`'s task runs, as `state` schedules it; `None` when the workflow does not want
/// it (any more).
fn activity_input(state: &SessionState, lease: &Lease) -> Option<ActivityInput> {
    let session_id = &lease.id.session_id;
    let started = state.started.as_ref()?;
    match state.scheduled_activity(lease.id.scheduled_seq) {
        Some(ScheduledActivity::Model {
            turn,
            round,
            attempt,
            model,
            options,
            not_before_ms,
            heartbeat_details,
        }) => Some(ActivityInput::Model {
            origin: ActivityRef {
                session_id: session_id.clone(),
                turn,
                activity: format!("model:{round}"),
                attempt,
            },
            round,
            model,
            transcript: state.transcript.clone(),
            transcript_lineage: Some(state.transcript_lineage),
            transcript_left_out: 0,
            tools: started.tools.clone(),
            tools_digest: None,
            tools_omitted: false,
            timeouts: ActivityTimeouts::of(&started.model_retry, not_before_ms),
            heartbeat_details,
            options,
        }),
        Some(ScheduledActivity::Summary {
            turn,
            round,
            attempt,
            model,
            not_before_ms,
            keep_last_turns,
        }) => Some(ActivityInput::Model {
            origin: ActivityRef {
                session_id: session_id.clone(),
                turn,
                activity: format!("summary:{round}"),
                attempt,
            },
            round,
            model,
            transcript: Arc::new(cairn_ledger::summary_request(
                &state.transcript,
                keep_last_turns,
            )),
            transcript_lineage: None,
            transcript_left_out: 0,
            // Older turns may hold tool blocks, which providers accept only with tools.
            tools: started.tools.clone(),
            tools_digest: None,
            tools_omitted: false,
            timeouts: ActivityTimeouts::of(&started.model_retry, not_before_ms),
            heartbeat_details: None,
            // A summary is plain text: no forced tool call, no server tools.
            options: cairn_ledger::CallOptions::default(),
        }),
        Some(ScheduledActivity::Tool {
            turn,
            attempt,
            tool_use,
            not_before_ms,
            heartbeat_details,
        }) => Some(ActivityInput::Tool {
            origin: ActivityRef {
                session_id: session_id.clone(),
                turn,
                activity: format!("tool:{}", tool_use.id),
                attempt,
            },
            idempotency_key: format!("{session_id}/{}", tool_use.id),
            file_versions: if cairn_ledger::file_versions::wants_file_versions(&tool_use.name) {
                cairn_ledger::file_versions::file_versions(&state.transcript)
            } else {
                Vec::new()
            },
            tool_use,
            timeouts: ActivityTimeouts::of(&started.tool_retry, not_before_ms),
            heartbeat_details,
            workdir: started.workdir.clone(),
        }),
        None => None,
    }
}
