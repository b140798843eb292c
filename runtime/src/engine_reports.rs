//! Workers' reports: a leased task's result or failure, and a model attempt's streamed
//! progress, recorded as events of its session's history.

use super::{failed_event, lock, ActivityReport, Engine, LeasedTask};
use crate::error::{Error, Result};
use crate::event::{ActivityFailure, Event};
use crate::pricing::PriceTable;
use crate::report_queue::{QueuedReport, ReportQueue};
use crate::store::{Lease, LeaseRequest, TaskId};
use crate::workflow::{ScheduledActivity, SessionState};
use std::time::Duration;
use tracing::{debug, info_span, Instrument};

/// How long a report holds its session for the reports of the parallel calls still running
/// beside it, so that all of them share one append and one sync. The step cannot go on before
/// the last of them is recorded, so the hold costs the turn nothing while they come within it
/// (tools that finish together: one commit instead of two in series), and at most about one
/// commit when the last comes just after it; it keeps the reporting worker waiting that long
/// for its answer. tokio's timers tick in milliseconds, so this is the shortest hold there is.
pub(crate) const SIBLING_HOLD: Duration = Duration::from_millis(1);

/// Waits, up to [`SIBLING_HOLD`], until `queue` holds a report of each of `siblings`.
// A hold waits on real time, as a long poll does.
#[allow(clippy::disallowed_methods)]
async fn wait_for_siblings(queue: &ReportQueue, siblings: &[TaskId]) {
    let deadline = tokio::time::Instant::now() + SIBLING_HOLD;
    while !siblings.iter().all(|id| queue.holds(id)) {
        if tokio::time::timeout_at(deadline, queue.pushed())
            .await
            .is_err()
        {
            return;
        }
    }
}

impl Engine {
    /// Records a worker's report for a leased task. A stale report is
    /// [`Error::StaleReport`] (the workflow already moved on) or [`Error::LeaseLost`] (the lease
    /// lapsed): the worker drops it, the history is unchanged.
    pub async fn report(&self, lease: &Lease, report: ActivityReport) -> Result<()> {
        self.report_with(lease, report, None).await.map(drop)
    }

    /// Reports like [`Engine::report`], and leases with the report's append up to
    /// `next.max` due tasks `next.filter` accepts for the same worker of this process (eager
    /// dispatch: the next task of a session goes to the worker that finished the last one,
    /// without a lease round of its own). The tasks come with what they run, like
    /// [`Engine::lease_tasks`]; they are handed out once the report is durable.
    pub async fn report_and_lease(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: &LeaseRequest,
    ) -> Result<Vec<LeasedTask>> {
        crate::stages::mark("report.start");
        let leases = self.report_with(lease, report, Some(next)).await?;
        let handed = self.with_activities(leases).await;
        crate::stages::mark("report.handed");
        Ok(handed)
    }

    /// Reports several attempts at once, like [`Engine::report_and_lease`] for each: those of
    /// the first one's session in one append (a model's parallel tool calls that one worker
    /// slot ran in turn), with no hold for the siblings among them, and the tasks leased with
    /// it, when `next` asks for some, going to the first report. A report of another session
    /// is recorded alone after them. Answers each report, in order.
    pub async fn report_all_and_lease(
        &self,
        reports: Vec<(Lease, ActivityReport)>,
        next: Option<&LeaseRequest>,
    ) -> Vec<Result<Vec<LeasedTask>>> {
        crate::stages::mark("report.start");
        let Some(session_id) = reports
            .first()
            .map(|(lease, _)| lease.id.session_id.clone())
        else {
            return Vec::new();
        };
        let mut answers: Vec<Option<Result<Vec<Lease>>>> = Vec::with_capacity(reports.len());
        let mut together = Vec::with_capacity(reports.len());
        let mut alone = Vec::new();
        for (at, (lease, report)) in reports.into_iter().enumerate() {
            answers.push(None);
            match lease.id.session_id == session_id {
                true => together.push((at, lease, report)),
                false => alone.push((at, lease, report)),
            }
        }
        for (at, answer) in self.report_together(&session_id, together, next).await {
            answers[at] = Some(answer);
        }
        for (at, lease, report) in alone {
            answers[at] = Some(self.report_with(&lease, report, None).await);
        }
        let mut handed = Vec::with_capacity(answers.len());
        for answer in answers {
            handed.push(match answer {
                Some(Ok(leases)) => Ok(self.with_activities(leases).await),
                Some(Err(e)) => Err(e),
                // Every report was put in one of the two lists above and answered there.
                None => Ok(Vec::new()),
            });
        }
        crate::stages::mark("report.handed");
        handed
    }

    /// Records the reports of one session's tasks (`(index, lease, report)`, the first of
    /// them leasing with `next`, if any) in one append with any others of the session waiting, after
    /// holding it for their siblings still running here; answers each by its index.
    async fn report_together(
        &self,
        session_id: &str,
        reports: Vec<(usize, Lease, ActivityReport)>,
        next: Option<&LeaseRequest>,
    ) -> Vec<(usize, Result<Vec<Lease>>)> {
        let Some(first) = reports.first().map(|(_, lease, _)| lease.clone()) else {
            return Vec::new();
        };
        self.no_longer_running_here(reports.iter().map(|(_, lease, _)| lease));
        let span = info_span!("session", session_id = %session_id);
        async move {
            let slot = self.slot(session_id);
            let mut queued = Vec::with_capacity(reports.len());
            for (n, (at, lease, report)) in reports.into_iter().enumerate() {
                let wants = next.filter(|_| n == 0).cloned();
                let (ticket, answer) = slot.reports().push(&lease, report, wants);
                queued.push((at, lease, ticket, answer));
            }
            let stale = {
                let mut guard = slot.lock().await;
                // Siblings none of these reports holds are running elsewhere in this process
                // (a slot of their own): held for as a lone report is.
                let siblings = self.running_siblings(guard.as_ref(), &first);
                if !siblings.is_empty() {
                    wait_for_siblings(slot.reports(), &siblings).await;
                }
                let waiting = slot.reports().take();
                self.record_reports(session_id, &mut guard, waiting).await
            };
            let mut answers = Vec::with_capacity(queued.len());
            let mut waits = Vec::with_capacity(queued.len());
            for (at, lease, ticket, answer) in queued {
                drop(ticket);
                waits.push((at, lease, answer));
            }
            self.refuse_stale(stale).await;
            for (at, lease, answer) in waits {
                answers.push((at, answer.await.unwrap_or_else(|_| Err(in_doubt(&lease)))));
            }
            answers
        }
        .instrument(span)
        .await
    }

    /// Records `report` with every other report of its session that is waiting when this
    /// one gets the session: reports that come while an append of the session is in flight
    /// share the next append (see `report_queue`). Each caller gets its own report's answer.
    async fn report_with(
        &self,
        lease: &Lease,
        report: ActivityReport,
        next: Option<&LeaseRequest>,
    ) -> Result<Vec<Lease>> {
        let session_id = &lease.id.session_id;
        self.no_longer_running_here(std::iter::once(lease));
        let span = info_span!("session", session_id = %session_id);
        async move {
            let slot = self.slot(session_id);
            let mut free = slot.try_lock();
            let mut siblings = Vec::new();
            if let Some(guard) = free.as_mut() {
                if slot.reports().is_empty() {
                    siblings = self.running_siblings(guard.as_ref(), lease);
                    if siblings.is_empty() {
                        // No append of the session in flight, no report waiting and no
                        // parallel call running, as for most reports: recorded alone, with
                        // nothing to queue or answer through a channel.
                        let recorded = self
                            .record_one(session_id, guard, lease, &report, next)
                            .await;
                        drop(free);
                        if let Some(leases) = recorded? {
                            return Ok(leases);
                        }
                        self.discard_task(lease).await?;
                        return Err(stale_report(lease));
                    }
                }
            }
            // Queued, to share the next append with the reports that wait (or, on a free
            // session, with those that waited and are not woken yet, or that its running
            // siblings are about to send).
            let (ticket, answer) = slot.reports().push(lease, report, next.cloned());
            let stale = {
                let mut guard = match free {
                    Some(guard) => guard,
                    None => slot.lock().await,
                };
                if !siblings.is_empty() {
                    wait_for_siblings(slot.reports(), &siblings).await;
                }
                let waiting = slot.reports().take();
                self.record_reports(session_id, &mut guard, waiting).await
            };
            drop(ticket);
            self.refuse_stale(stale).await;
            answer.await.unwrap_or_else(|_| Err(in_doubt(lease)))
        }
        .instrument(span)
        .await
    }

    /// Takes the tasks of `leases` out of those a worker of this engine holds, as their
    /// reports come (a newer lease attempt of one stays: its worker still runs it).
    fn no_longer_running_here<'a>(&self, leases: impl Iterator<Item = &'a Lease>) {
        let mut here = lock(&self.inner.leased_here);
        for lease in leases {
            if here
                .get(&lease.id)
                .is_some_and(|(attempt, _)| *attempt == lease.lease_attempt)
            {
                here.remove(&lease.id);
            }
        }
    }

    /// The tasks of the calls the session's active step runs beside `lease`'s (a model's
    /// parallel tool calls) that a worker of this engine holds now, their reports still to
    /// come; none when the session's state is not at hand.
    fn running_siblings(&self, state: Option<&SessionState>, lease: &Lease) -> Vec<TaskId> {
        let Some(state) = state else {
            return Vec::new();
        };
        let outstanding = state.outstanding_tasks();
        if outstanding.len() < 2 {
            return Vec::new();
        }
        let here = lock(&self.inner.leased_here);
        outstanding
            .into_iter()
            .filter(|seq| *seq != lease.id.scheduled_seq)
            .map(|scheduled_seq| TaskId {
                session_id: lease.id.session_id.clone(),
                scheduled_seq,
            })
            .filter(|id| here.contains_key(id))
            .collect()
    }

    /// Answers the reports the workflow no longer waits for, once their tasks are dropped from
    /// the queue (nothing will run them again; the reports themselves change nothing).
    async fn refuse_stale(&self, stale: Vec<QueuedReport>) {
        for queued in stale {
            let answer = match self.discard_task(&queued.lease).await {
                Ok(()) => Err(stale_report(&queued.lease)),
                Err(e) => Err(e),
            };
            answer_report(queued, answer);
        }
    }

    /// Records the reports `waiting` for the session whose state `guard` holds: in one
    /// append when there are several, each in its own when that one is refused (a stale
    /// report among them, a lost lease) or fails. Answers each report but the stale ones,
    /// which it returns: their tasks are dropped from the queue once the session is let go.
    async fn record_reports(
        &self,
        session_id: &str,
        guard: &mut Option<SessionState>,
        waiting: Vec<QueuedReport>,
    ) -> Vec<QueuedReport> {
        let prices = self.prices();
        if waiting.len() > 1 && of_distinct_tasks(&waiting) {
            let complete: Vec<(TaskId, u32)> = waiting
                .iter()
                .map(|q| (q.lease.id.clone(), q.lease.lease_attempt))
                .collect();
            // The first that asked for more tasks gets those the append leases.
            let eager_at = waiting.iter().position(|q| q.next.is_some());
            let eager = eager_at.and_then(|at| waiting[at].next.as_ref());
            let mut decide = |state: &SessionState| {
                let mut events = Vec::with_capacity(waiting.len());
                for queued in &waiting {
                    let Some(activity) = state.scheduled_activity(queued.lease.id.scheduled_seq)
                    else {
                        return Err(stale_report(&queued.lease));
                    };
                    events.push(report_event(
                        &prices,
                        &queued.lease,
                        activity,
                        queued.report.clone(),
                    )?);
                }
                Ok(Some(events))
            };
            let together = self
                .submit_locked(
                    session_id,
                    guard,
                    &mut decide,
                    &complete,
                    &None,
                    false,
                    eager,
                )
                .await;
            match together {
                Ok((Some(_), leases)) => {
                    let mut leases = Some(leases);
                    for (at, queued) in waiting.into_iter().enumerate() {
                        let handed = match Some(at) == eager_at {
                            true => leases.take().unwrap_or_default(),
                            false => Vec::new(),
                        };
                        answer_report(queued, Ok(handed));
                    }
                    return Vec::new();
                }
                Ok((None, _)) => {}
                Err(e) => debug!(
                    reports = waiting.len(),
                    error = %e,
                    "the reports could not be recorded together; recording each alone"
                ),
            }
        }
        let mut stale = Vec::new();
        for queued in waiting {
            let recorded = self
                .record_one(
                    session_id,
                    guard,
                    &queued.lease,
                    &queued.report,
                    queued.next.as_ref(),
                )
                .await;
            match recorded {
                Ok(Some(leases)) => answer_report(queued, Ok(leases)),
                Ok(None) => stale.push(queued),
                Err(e) => answer_report(queued, Err(e)),
            }
        }
        stale
    }

    /// Records one report in an append of its own, the session's state in `guard`, with the
    /// tasks it leases (eager dispatch); `None` when the workflow no longer waits for its
    /// task (nothing was written).
    async fn record_one(
        &self,
        session_id: &str,
        guard: &mut Option<SessionState>,
        lease: &Lease,
        report: &ActivityReport,
        next: Option<&LeaseRequest>,
    ) -> Result<Option<Vec<Lease>>> {
        let prices = self.prices();
        let mut decide =
            |state: &SessionState| match state.scheduled_activity(lease.id.scheduled_seq) {
                Some(activity) => report_event(&prices, lease, activity, report.clone())
                    .map(|event| Some(vec![event])),
                None => Ok(None),
            };
        let (submitted, leases) = self
            .submit_locked(
                session_id,
                guard,
                &mut decide,
                &[(lease.id.clone(), lease.lease_attempt)],
                &None,
                false,
                next,
            )
            .await?;
        Ok(submitted.map(|_| leases))
    }

    /// Records what a leased model attempt streamed since its previous record, as a
    /// `model_attempt_progress` event (presentation only). It goes through the same append
    /// path as everything else, so it shares the store's group-commit flushes. Stale progress —
    /// the workflow no longer waits for this attempt, or a newer lease of it already recorded
    /// output — is rejected with [`Error::StaleReport`] (see [`Error::is_stale_report`]) and changes
    /// nothing; the attempt itself goes on.
    pub async fn record_progress(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
    ) -> Result<()> {
        self.record_progress_with_usage(lease, text_appended, thinking_appended, None)
            .await
    }

    /// [`Engine::record_progress`] with the usage the run's stream reported so far, priced
    /// now and recorded with it: if the run is lost, it is what is known of its usage.
    pub async fn record_progress_with_usage(
        &self,
        lease: &Lease,
        text_appended: String,
        thinking_appended: String,
        usage: Option<cairn_ledger::Usage>,
    ) -> Result<()> {
        let session_id = &lease.id.session_id;
        let prices = self.prices();
        // The workflow checks the attempt again when it steps, so a completion that lands
        // in between makes this progress stale rather than misplaced.
        self.submit(
            session_id,
            |state| match state.scheduled_activity(lease.id.scheduled_seq) {
                Some(ScheduledActivity::Model {
                    turn,
                    round,
                    attempt,
                    model,
                    ..
                }) => Ok(Some(Event::ModelAttemptProgress {
                    turn,
                    round,
                    attempt,
                    lease_attempt: lease.lease_attempt,
                    text_appended: text_appended.clone(),
                    thinking_appended: thinking_appended.clone(),
                    usage,
                    cost_micros: usage.and_then(|u| prices.cost(&model.provider, &model.model, &u)),
                })),
                _ => Err(Error::StaleReport {
                    session_id: session_id.clone(),
                    seq: lease.id.scheduled_seq,
                    reason: format!(
                        "progress of task {} for a model call the workflow no longer waits for",
                        lease.id
                    ),
                }),
            },
            Vec::new(),
        )
        .await?;
        Ok(())
    }
}

/// Gives `queued` its answer through its channel. A caller that left cannot be answered; its
/// report was recorded all the same.
fn answer_report(queued: QueuedReport, answer: Result<Vec<Lease>>) {
    let _ = queued.reply.send(answer);
}

/// The answer to a report whose recording was dropped before the store answered.
fn in_doubt(lease: &Lease) -> Error {
    Error::Store {
        reason: format!(
            "the report of task {} is in doubt: the call recording it with other reports of \
             its session was dropped before the store answered",
            lease.id
        ),
    }
}

/// Whether no two of `reports` report the same task (two lease attempts of one task: one of
/// them is stale, and only recording each alone tells which).
fn of_distinct_tasks(reports: &[QueuedReport]) -> bool {
    let mut ids: Vec<&TaskId> = reports.iter().map(|q| &q.lease.id).collect();
    ids.sort();
    ids.windows(2).all(|pair| pair[0] != pair[1])
}

/// The answer to a report the workflow no longer waits for.
fn stale_report(lease: &Lease) -> Error {
    Error::StaleReport {
        session_id: lease.id.session_id.clone(),
        seq: lease.id.scheduled_seq,
        reason: format!("the workflow no longer waits for task {}", lease.id),
    }
}

/// The event that records `report` for `activity`, the activity `lease` ran, a model
/// attempt's usage priced by `prices`.
fn report_event(
    prices: &PriceTable,
    lease: &Lease,
    activity: ScheduledActivity,
    report: ActivityReport,
) -> Result<Event> {
    Ok(match (activity, report) {
        (
            ScheduledActivity::Model {
                turn,
                round,
                attempt,
                model,
                ..
            },
            ActivityReport::ModelCompleted(response),
        ) => {
            // The model the provider says answered (a dated id), else the one asked for.
            let cost_micros = prices
                .cost(&model.provider, &response.model, &response.usage)
                .or_else(|| prices.cost(&model.provider, &model.model, &response.usage));
            Event::ModelCallCompleted {
                turn,
                round,
                attempt,
                response,
                cost_micros,
            }
        }
        (
            ScheduledActivity::Tool {
                turn,
                attempt,
                tool_use,
                ..
            },
            ActivityReport::ToolCompleted { content, is_error },
        ) => Event::ToolCallCompleted {
            turn,
            tool_use_id: tool_use.id,
            attempt,
            content,
            is_error,
        },
        (
            ScheduledActivity::Summary {
                turn,
                attempt,
                model,
                ..
            },
            ActivityReport::ModelCompleted(response),
        ) => {
            let usage = response.usage;
            let cost_micros = prices
                .cost(&model.provider, &response.model, &usage)
                .or_else(|| prices.cost(&model.provider, &model.model, &usage));
            let summary: String = response
                .parts
                .iter()
                .filter_map(|p| match p {
                    cairn_ledger::Part::Text { text, .. } => Some(text.as_str()),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("\n");
            if summary.trim().is_empty() {
                // Its usage is left out: a version 2 session would add it to its turn's usage,
                // which the code before did not (an empty summary counted nothing).
                Event::SummaryCallFailed {
                    turn,
                    attempt,
                    failure: ActivityFailure::new(
                        crate::event::ErrorClass::InvalidResponse,
                        "the summary call answered without text",
                    ),
                    cost_micros: None,
                }
            } else {
                Event::SummaryCallCompleted {
                    turn,
                    attempt,
                    summary,
                    usage: Some(usage),
                    cost_micros,
                }
            }
        }
        (activity, ActivityReport::Failed(failure)) => failed_event(prices, activity, failure),
        (activity, report) => {
            return Err(Error::InvalidEvent {
                session_id: lease.id.session_id.clone(),
                seq: lease.id.scheduled_seq,
                reason: format!("report {report:?} does not fit activity {activity:?}"),
            })
        }
    })
}
