//! One durable state transition, timed in this process for `cairn bench --goals`: an activity's
//! completion recorded and the session's next task handed to the worker that reported it, as
//! a worker slot of this process runs it (eager dispatch), on a new embedded store, reopened
//! as a restarted server's is ([`crate::bench::open_restarted`]).
//!
//! The same loop as the criterion group `state_transition` (`benches/engine.rs`): a session
//! whose model asks for one tool per round, each round two transitions (the model's answer →
//! the tool's task, the tool's result → the next model task), the responses made here, with
//! no model or tool run in between. Each pair of transitions is timed alone; the figure is
//! the median of their halves, beside the median of an fdatasync probe on the same
//! filesystem run just before and just after ([`ProbedFdatasync`]).

// A benchmark reads clocks.
#![allow(clippy::disallowed_methods)]

use crate::bench::ProbedFdatasync;
use crate::fixtures;
use anyhow::{bail, Context};
use cairn_ledger::{JsonText, ToolResultContent};
use cairn_runtime::store::embedded::StorageEngine;
use cairn_runtime::store::{Lease, LeaseHolder, LeaseRequest, TaskFilter};
use cairn_runtime::{ActivityReport, Engine, SystemClock};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rounds of one session: its `max_rounds` is one more, so the last round's model call is
/// still answered with a tool call the workflow accepts.
const ROUNDS_PER_SESSION: u32 = 6;

/// What [`measure`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct TransitionResult {
    /// The storage engine.
    pub engine: StorageEngine,
    /// Transitions timed.
    pub transitions: usize,
    /// The median transition, ms.
    pub p50_ms: f64,
    /// The mean transition, ms.
    pub mean_ms: f64,
    /// The fdatasync probe run just before and just after: the median of both runs, and of
    /// each apart.
    pub fdatasync: ProbedFdatasync,
}

impl TransitionResult {
    /// The median transition over the median fdatasync of the probe runs on both sides (issue
    /// 13's goal: at most 1.5).
    pub fn over_fdatasync(&self) -> f64 {
        self.p50_ms / self.fdatasync.p50_ms
    }
}

/// The next task of the session, leased in a round of its own (the first task of a session,
/// or the next one from a store that hands none with a report).
async fn lease_one(engine: &Engine) -> anyhow::Result<Lease> {
    let mut leased = engine
        .store()
        .lease_tasks_in_process(engine.now_ms(), 60_000, 1, &TaskFilter::default())
        .await?;
    if leased.is_empty() {
        bail!("the session's next task was not due");
    }
    Ok(leased.remove(0))
}

/// Reports `report` for `lease` and takes the next task: the one handed with the report, else
/// one leased in a round of its own.
async fn report(
    engine: &Engine,
    lease: &Lease,
    report: ActivityReport,
    next: &LeaseRequest,
) -> anyhow::Result<Lease> {
    let handed = engine.report_and_lease(lease, report, next).await?;
    match handed.into_iter().next() {
        Some(task) => Ok(task.lease),
        None => lease_one(engine).await,
    }
}

/// Times transitions on a new `engine` store in `dir`, reopened, for about `duration` (at
/// least 60).
pub async fn measure(
    dir: &std::path::Path,
    engine: StorageEngine,
    duration: Duration,
) -> anyhow::Result<TransitionResult> {
    let probed_before = crate::bench::probe_in(dir).await?;
    let opened = crate::bench::open_restarted(&dir.join("store"), engine).await?;
    let runtime = Engine::new(opened.store.clone(), Arc::new(SystemClock));
    let next = LeaseRequest {
        filter: Arc::new(TaskFilter::default()),
        max: 1,
        lease_ms: 60_000,
        holder: LeaseHolder::InProcess,
    };
    let tool_result = ToolResultContent::Json(JsonText::parse(r#"{"value":126}"#)?);
    let mut pairs: Vec<Duration> = Vec::new();
    let began = Instant::now();
    let mut session = 0;
    while pairs.len() < 30 || began.elapsed() < duration {
        session += 1;
        let session_id = runtime
            .start_session(
                Some(format!("transitions-{session}")),
                fixtures::bench_session(ROUNDS_PER_SESSION + 2)?,
            )
            .await?;
        runtime.send_message(&session_id, "go", None).await?;
        // Untimed: the first task of a session is leased in a round of its own.
        let mut lease = lease_one(&runtime).await?;
        for round in 1..=ROUNDS_PER_SESSION {
            let timed = Instant::now();
            let tool = report(
                &runtime,
                &lease,
                ActivityReport::ModelCompleted(fixtures::tool_call_response(round, 1)),
                &next,
            )
            .await
            .with_context(|| format!("session {session_id}, round {round}: the model's answer"))?;
            lease = report(
                &runtime,
                &tool,
                ActivityReport::ToolCompleted {
                    content: tool_result.clone(),
                    is_error: false,
                },
                &next,
            )
            .await
            .with_context(|| format!("session {session_id}, round {round}: the tool's result"))?;
            pairs.push(timed.elapsed());
        }
    }
    // With the store still open, as before.
    let fdatasync = ProbedFdatasync::of(&probed_before, &crate::bench::probe_in(dir).await?);
    drop(runtime);
    drop(opened);
    let transitions = pairs.len() * 2;
    let total: Duration = pairs.iter().sum();
    pairs.sort();
    Ok(TransitionResult {
        engine,
        transitions,
        p50_ms: pairs[pairs.len() / 2].as_secs_f64() * 1e3 / 2.0,
        mean_ms: total.as_secs_f64() * 1e3 / transitions as f64,
        fdatasync,
    })
}
