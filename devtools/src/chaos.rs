//! Chaos: many concurrent sessions run in a child process that is killed with SIGKILL at random
//! moments and resumed by a new child each time (their activities run in the child, or in
//! worker processes that are killed too); then everything the log promises is checked.
//!
//! # Parent and child
//!
//! [`run_chaos`] (the parent) writes a scripted model's script (`DATA/chaos-script.json`) and
//! starts `cairn chaos-child --data DATA --sessions S --turns T` again and again. Each child
//! opens the sled store (`DATA/store`; sled's file lock means one process at a time), resumes
//! with `Engine::resume(true)` (releasing the leases its killed predecessor held, so their
//! tasks run again at once), starts a worker pool, creates the sessions that do not exist yet
//! (`chaos-000`, `chaos-001`, …) and drives each one: while it has completed fewer than `T`
//! turns, send the next user message and wait for the turn.
//!
//! The parent kills it with SIGKILL, reaps it and starts the next. Four kills in five fall
//! [`ChaosConfig::kill_after_ms`] after the child is ready — the parent estimates when from the
//! previous children, since opening the store and resuming take longer as histories grow — and
//! one in five at a random moment of the startup itself (sled recovering, the engine resuming).
//! The moments are seeded. After the configured number of kills one last child runs, unkilled,
//! to completion. If the sessions finish their turns while kills remain, the parent raises `T`
//! (the script grows; its earlier responses stay as they were), so that every kill lands on
//! work; the report says so.
//!
//! Two more kinds of fault follow the kills when configured: startup kills
//! ([`ChaosConfig::startup_kills`]), each a SIGKILL at a random moment a few tens of
//! milliseconds after the child was started, while sled opens and recovers the store and the
//! engine resumes; and power cuts ([`ChaosConfig::power_cuts`]): the child runs under the
//! [`crate::powercut`] shim, which at a seeded operation of the store directory drops every
//! write and name change not yet fsynced and exits (every third cut falls within the child's
//! start, the rest on its work: how many operations a start makes is learnt from the cuts,
//! see `CutAim`). The acknowledgements reach the parent on a pipe, out of the cut's reach, as
//! a client on another machine would hold them. With [`ChaosConfig::check_each_fault`] a copy
//! of the store is checked after every fault (it opens, holds every acknowledged state, fsck
//! is clean); the first failed check stops the run with the store left as the fault left it.
//! The store engine is a parameter ([`StoreEngine`]).
//!
//! A child talks to the parent on stdout, one line each, each ended by a newline (a line cut by
//! the kill is ignored):
//!
//! - `opened` — the store is open (sled has recovered it); `resume` has not run yet.
//! - `ready RUNNING OUTSTANDING REQUEUED RECLAIMED` — the store is open and `resume` is done.
//! - `ack SESSION SEQ HASH` — the engine holds a state of SESSION folded from events `1..=SEQ`,
//!   whose ledger has the fingerprint HASH (FNV-1a, hex, of its message count, part count and
//!   last message). The engine changes its cached state only under the session's lock and
//!   keeps it only when the append succeeded, so every state it shows was acknowledged by the
//!   store. The child acks at every step of its drivers and samples all sessions every few
//!   milliseconds (tool results arrive between steps).
//! - `done` — every session has completed all its turns.
//!
//! # Remote workers
//!
//! With [`ChaosConfig::remote_workers`] N > 0 (`cairn chaos --remote-workers N`) the
//! activities run in other processes over the `/v1` HTTP API, as with `cairn server` and
//! `cairn worker` (the parent's loop is in `chaos/remote.rs`). The parent picks a free loopback
//! port once and starts `cairn chaos-child --serve PORT --max-attempts A`: the same child,
//! but it runs no pool; it resumes with `Engine::resume(false)` (workers may still hold
//! leases, and report once it is back) and serves the API with [`cairn_server::serve`], whose
//! timers record a lapsed lease as a failed attempt of class `timeout`. Beside it run N
//! `cairn chaos-worker --server URL --data DATA` processes: a [`WorkerPool`] over
//! [`cairn_remote::HttpTaskSource`] hosting the scripted model and `side_effect`, with a
//! 1.5 s lease renewed every 0.5 s. A worker drains and exits when its stdin closes; a
//! serving child exits when its stdin closes, so that a parent that dies leaves nothing
//! behind.
//!
//! The drivers stay in the child, beside the engine, and the acks are taken from the engine's
//! own state as above. An ack so means the same in both modes — a state folded from events the
//! store acknowledged — and the workers' results reach that state only through the engine, so
//! every state a remote report produced is acknowledged and checked like any other. Drivers in
//! the parent (`cairn_remote::connect`) could ack only what the API shows, and the API has no
//! read of one whole state: a session's seq (`describe`) and its ledger (`transcript`) are two
//! requests, which a concurrent step can fall between. (The client's side of a server restart
//! is tested in `tests/server.rs`.) A server kill also kills the drivers; they resume with the
//! next child.
//!
//! Each kill falls on the server (the child) or on one of the workers, half and half, seeded; the
//! last kill goes to a kind not yet killed, so that a run has both. The victim is restarted at
//! once, a server on the same port. A server kill falls [`ChaosConfig::kill_after_ms`] after the
//! later of the previous kill and the server's `ready` — or, one in five while the server is still
//! starting, at a random moment of its estimated startup —, a worker kill that long after the
//! previous kill. One server kill in three is an outage: the next server starts only after a lease
//! and up to 0.5 s more, so the workers' leases lapse while nobody serves (their reports, retried
//! until then, are lost) and the next server's timers record them. Work goes on between kills, so
//! there is no separate final child: after the last kill the server running then finishes the
//! turns, unkilled, says `done`, stops serving and exits; then the workers are stopped (each must
//! drain and exit 0) and the store is verified as below. When the sessions finish while kills
//! remain, turns are added as in-process, and the workers restart with the next server (they load
//! the script once). Every lapsed lease is a failed attempt, so the sessions' retry policies are
//! set explicitly: at most the run's kills plus 5 attempts (only a kill fails an attempt: a
//! worker's, or the server's when it stays down until the lease lapses) and a backoff of 50 ms
//! doubling to 400 ms. Startup kills, power cuts and the checks after each fault run in-process
//! only.
//!
//! # The side effect
//!
//! The only tool, `side_effect`, appends one record `{"key", "tool_use_id", "pid", "attempt",
//! "at_ms"}` to `DATA/side-effects.jsonl` (one `write`, then `fdatasync`), works a few
//! milliseconds and returns `{"key", "pid"}`. A kill can cut even one `write` at a page
//! boundary, so records are framed and checksummed ([`record`]): a torn record is told from
//! damage, and must be by a killed process. A kill after the record is written and before the
//! result is recorded runs the call again after the resume, with the same idempotency key:
//! that is the at-least-once contract of activities, and the file counts how often it happens.
//! With remote workers a run is repeated also when its worker lives but the server is killed
//! and stays down until the run's lease lapses, so its report is never recorded.
//!
//! # The checks
//!
//! At the end `verify` opens the store and checks, per session: it is idle with all its turns
//! completed (no failed or cancelled turn); its history replays with the current code; the ledger
//! validates; every acknowledged state is there (events `1..=SEQ` exist and fold to a ledger with
//! the acknowledged fingerprint, and no seq was acknowledged with two different ledgers); every
//! tool_use has exactly one `tool_call_completed`, whose result carries its idempotency key; every
//! failed attempt is a timeout (a lapsed lease: nothing but the kills may fail an attempt); and the
//! task queue is empty. In the side-effect file every line's key names its own tool_use
//! (`SESSION/TOOL_USE_ID`), every tool_use ran, the recorded result is the one of its key's last
//! run, and every earlier run was made by a process the parent killed, or (remote mode) the server
//! was killed after that run's lease was taken (at most a lease before the record's `at_ms`) and
//! before the next run of its key (the lapse is recorded, and the retry scheduled, only after the
//! kill): each repeat is explained by a kill. The repeats (lines − distinct keys) are counted.

// Chaos is the impure edge: it waits on real time, reads clocks and kills processes at random
// (seeded) moments; the clock and sleep ban is for pure code.
#![allow(clippy::disallowed_methods)]

pub use child::{run_chaos_child, run_chaos_worker, ServeOptions, SideEffect, SideEffectRecord};
pub use report::ChaosReport;

use crate::powercut::{Cut, CutFigures, CUT_EXIT_STATUS};
use anyhow::{anyhow, bail, Context};
use cairn_runtime::store::embedded::StorageEngine;
use cut_aim::CutAim;
use script::{write_script, SplitMix64};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use verify::{check_after_fault, verify};

// Named in doc links only.
#[cfg(doc)]
use cairn_workers::WorkerPool;

/// The tool every chaos session calls.
pub const SIDE_EFFECT_TOOL: &str = "side_effect";
/// The store, under the data directory.
pub const STORE_DIR: &str = "store";
/// The scripted model's script, under the data directory.
pub const SCRIPT_FILE: &str = "chaos-script.json";
/// The side-effect record, under the data directory.
pub const SIDE_EFFECTS_FILE: &str = "side-effects.jsonl";

/// One kill in this many falls at a random moment of the child's startup.
const STARTUP_KILL_ONE_IN: u64 = 5;

/// The most the estimate of a child's time to ready grows to after kills that came too early.
const READY_ESTIMATE_MAX: Duration = Duration::from_secs(20);
/// The final, unkilled child must finish within this.
const FINAL_RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// Lines of a failed child's stderr kept for the error.
const STDERR_TAIL_LINES: usize = 30;

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChaosConfig {
    /// The data directory: store, script, side-effect file (created if missing).
    pub data: PathBuf,
    /// Concurrent sessions.
    pub sessions: usize,
    /// Turns each session completes. When the children finish every turn before the kills are
    /// spent, the parent adds this many turns again (and says so in the report), so that every
    /// kill lands on work in progress.
    pub turns_per_session: usize,
    /// SIGKILLs to deliver before the final run.
    pub kills: usize,
    /// Seeds the kill moments and the script (latencies, tool calls per round, rounds per turn).
    pub seed: u64,
    /// Most children are killed this many milliseconds (uniformly in the range, inclusive) after
    /// they are ready, as estimated from the previous children's start-to-ready times (opening
    /// the store and resuming take longer as histories grow). One in five is killed instead at
    /// a uniformly random moment of its startup, while sled recovers or the engine resumes.
    pub kill_after_ms: (u64, u64),
    /// SIGKILLs delivered after the `kills`, each at a uniformly random moment this many
    /// milliseconds (inclusive range) after the child was started, while it opens the store
    /// and resumes: [`ChaosConfig::startup_kill_ms`].
    pub startup_kills: usize,
    /// The window of the startup kills, measured from the start of the child.
    pub startup_kill_ms: (u64, u64),
    /// Power cuts after the kills (see [`crate::powercut`]): each child runs with the shim and
    /// cuts at a seeded operation of the store directory, losing every unsynced write.
    pub power_cuts: usize,
    /// After every kill or cut, check a copy of the store as it was left: it opens, every
    /// acknowledged state is there, and fsck (histories replay, queue matches) is clean.
    pub check_each_fault: bool,
    /// The store the children use.
    pub store: StoreEngine,
    /// Worker processes (`cairn chaos-worker`) beside a child that serves the `/v1` API
    /// instead of running a pool; the kills then fall on the child or on one of them (see
    /// the module doc, "Remote workers"). 0: the child runs its own pool, as always.
    pub remote_workers: usize,
}

impl ChaosConfig {
    /// 20 sessions × 60 turns, 100 kills, most 10–150 ms after the child is ready (the
    /// `cairn chaos` defaults).
    pub fn new(data: impl Into<PathBuf>, seed: u64) -> Self {
        ChaosConfig {
            data: data.into(),
            sessions: 20,
            turns_per_session: 60,
            kills: 100,
            seed,
            kill_after_ms: (10, 150),
            startup_kills: 0,
            startup_kill_ms: (0, 50),
            power_cuts: 0,
            check_each_fault: false,
            store: StoreEngine::DEFAULT,
            remote_workers: 0,
        }
    }
}

/// The store engine a chaos run uses (a parameter so that every engine gets the same test).
pub type StoreEngine = StorageEngine;

/// The id of session `i`.
pub fn session_id(i: usize) -> String {
    format!("chaos-{i:03}")
}

// ---- The parent --------------------------------------------------------------------------------

/// Runs the chaos test: kills `config.kills` children of `child_exe` (the `cairn` binary, run as
/// `cairn chaos-child ...`), runs a last one to completion, then verifies the store. Returns the
/// report (check [`ChaosReport::passed`]); `Err` when the harness itself cannot go on (a child
/// failed by itself, or the final run did not finish).
pub fn run_chaos(config: &ChaosConfig, child_exe: &Path) -> anyhow::Result<ChaosReport> {
    let started = Instant::now();
    if config.sessions == 0 || config.turns_per_session == 0 {
        bail!("chaos needs at least one session and one turn");
    }
    if config.kill_after_ms.0 > config.kill_after_ms.1 {
        bail!(
            "kill range {}..{} ms is empty",
            config.kill_after_ms.0,
            config.kill_after_ms.1
        );
    }
    std::fs::create_dir_all(&config.data)
        .with_context(|| format!("cannot create {}", config.data.display()))?;
    if config.remote_workers > 0 {
        return remote::run(config, child_exe, started);
    }
    let mut rng = SplitMix64(config.seed);
    let mut report = ChaosReport {
        seed: config.seed,
        sessions: config.sessions,
        turns_per_session: config.turns_per_session,
        ..ChaosReport::default()
    };
    write_script(&config.data, config.turns_per_session, config.seed)?;
    let mut acks = Acks::default();
    let mut ready_ms = Vec::new();
    let mut killed_pids = BTreeSet::new();
    let mut ready_estimate = Duration::ZERO;
    let shim = if config.power_cuts > 0 {
        Some(crate::powercut::build_shim(&config.data.join("powercut"))?)
    } else {
        None
    };
    // The shim recognises the store's files by their path as the child names them.
    let store_dir = std::path::absolute(config.data.join(STORE_DIR)).context("the store's path")?;
    let faults = config.kills + config.startup_kills + config.power_cuts;

    let mut faults_done = 0;
    // Whether the last kill or cut was aimed past the child's readiness (four kills in five
    // are, two cuts in three).
    let mut aimed_after_ready = false;
    let mut cut_aim = CutAim::new();
    while faults_done < faults {
        let plan = if report.kills < config.kills {
            let (lo, hi) = config.kill_after_ms;
            aimed_after_ready = rng.below(STARTUP_KILL_ONE_IN) != 0;
            let window = if aimed_after_ready {
                ready_estimate + Duration::from_millis(lo + rng.below(hi - lo + 1))
            } else {
                ready_estimate.mul_f64(rng.below(1_001) as f64 / 1_000.0)
            };
            Plan::Kill(window)
        } else if report.startup_kills < config.startup_kills {
            let (lo, hi) = config.startup_kill_ms;
            Plan::StartupKill(Duration::from_millis(lo + rng.below(hi - lo + 1)))
        } else {
            let (cut, at_work) = cut_aim.next(&mut rng);
            aimed_after_ready = at_work;
            Plan::Cut(cut)
        };
        let env = match (&plan, &shim) {
            (Plan::Cut(cut), Some(shim)) => shim.env(&store_dir, cut),
            _ => Vec::new(),
        };
        let run = run_child(config, child_exe, report.turns_per_session, &plan, &env)?;
        report.child_runs += 1;
        absorb(&mut report, &mut acks, &mut ready_ms, &run);
        match (&plan, &run.output.ready) {
            (Plan::Kill(_), Some(ready)) => {
                // An exponentially weighted mean: it follows the growth of the histories.
                ready_estimate = ready_estimate.mul_f64(0.7) + ready.after.mul_f64(0.3);
            }
            (Plan::Kill(after), None) if aimed_after_ready => {
                // A kill meant for work came before the child was ready: startup is slower
                // than estimated (a loaded machine; or the first children, with no estimate
                // yet), and no ready time comes to say by how much, so the estimate grows
                // past this kill's moment until kills land on work again.
                ready_estimate = ready_estimate
                    .mul_f64(1.5)
                    .max(*after)
                    .min(READY_ESTIMATE_MAX);
            }
            (Plan::Cut(cut), None) if aimed_after_ready => cut_aim.missed_the_work(cut),
            _ => {}
        }
        let before_ready = run.output.ready.is_none();
        let fault = match (&run.end, &plan) {
            (End::Killed, Plan::Kill(after)) => {
                report.kills += 1;
                report.kills_before_ready += usize::from(before_ready);
                format!("kill {} ({} ms after the start)", report.kills, after.as_millis())
            }
            (End::Killed, Plan::StartupKill(after)) => {
                report.startup_kills += 1;
                report.startup_kills_before_ready += usize::from(before_ready);
                report.startup_kills_before_open += usize::from(!run.output.opened);
                format!(
                    "startup kill {} ({} ms after the start{})",
                    report.startup_kills,
                    after.as_millis(),
                    if before_ready { ", before ready" } else { "" }
                )
            }
            (End::Cut(figures), Plan::Cut(cut)) => {
                report.power_cuts += 1;
                report.cuts_before_ready += usize::from(before_ready);
                report.cut_reverted_writes += figures.reverted_writes;
                report.cut_reverted_bytes += figures.reverted_bytes;
                report.cut_kept_writes += figures.kept_writes;
                report.cut_undone_names += figures.undone_names;
                format!(
                    "power cut {} ({cut:?}{}; {figures})",
                    report.power_cuts,
                    if before_ready { ", before ready" } else { "" }
                )
            }
            (End::Exited(status), _) if status.success() && run.output.done => {
                report.early_exits += 1;
                extend_turns(config, &mut report, faults, faults_done)?;
                continue;
            }
            (end, _) => bail!(
                "chaos child {} ({plan:?}) ended with {end:?} by itself (seed {}); its stderr ends:\n{}",
                report.child_runs,
                config.seed,
                run.stderr_tail
            ),
        };
        faults_done += 1;
        killed_pids.insert(run.pid);
        if config.check_each_fault {
            let before = report.problems.len();
            check_after_fault(config, &acks, &fault, &mut report)?;
            report.fault_problems += report.problems.len() - before;
            if report.problems.len() > before {
                // The store is left as the fault left it (a copy is kept by the check); the
                // next child would only fail on it or repair it.
                report.problems.extend(acks.conflicts.iter().cloned());
                report.stopped = true;
                report.mean_ready_ms = mean(&ready_ms);
                report.kill_phase = started.elapsed();
                report.wall_time = started.elapsed();
                return Ok(report);
            }
        }
    }
    report.kill_phase = started.elapsed();

    let final_started = Instant::now();
    let run = run_child(
        config,
        child_exe,
        report.turns_per_session,
        &Plan::Finish,
        &[],
    )?;
    report.child_runs += 1;
    absorb(&mut report, &mut acks, &mut ready_ms, &run);
    report.final_run = final_started.elapsed();
    match run.end {
        End::Exited(status) if status.success() && run.output.done => {}
        End::TimedOut => bail!(
            "the final chaos child did not finish within {} s (seed {}); its stderr ends:\n{}",
            FINAL_RUN_TIMEOUT.as_secs(),
            config.seed,
            run.stderr_tail
        ),
        other => bail!(
            "the final chaos child ended with {other:?} (seed {}); its stderr ends:\n{}",
            config.seed,
            run.stderr_tail
        ),
    }
    report.mean_ready_ms = mean(&ready_ms);

    let explanations = Explanations {
        killed_pids,
        ..Explanations::default()
    };
    verify(config, &acks, &explanations, &mut report)?;
    report.wall_time = started.elapsed();
    Ok(report)
}

/// What explains a repeated tool run: a kill of the process that made the earlier run, or (in
/// remote mode) a kill of the server while that run held its lease.
#[derive(Debug, Default)]
struct Explanations {
    /// Every process the parent killed: children, and in remote mode workers.
    killed_pids: BTreeSet<u32>,
    /// When the server was killed, in ms since the Unix epoch (the clock of the side-effect
    /// records' `at_ms`); remote mode only.
    server_kills_ms: Vec<u64>,
    /// The workers' lease: a run's lease was taken at most this long before it wrote its
    /// record (or it could not have reported).
    lease_ms: u64,
}

/// Everything is done before the faults are spent: gives the sessions more turns (and the
/// script their responses), so that the remaining faults land on work: as many as the faults
/// so far took per turn suggest, with a margin, but at most twice as many (later turns are
/// slower: longer ledgers, longer resumes), and at least the configured turns again.
fn extend_turns(
    config: &ChaosConfig,
    report: &mut ChaosReport,
    faults: usize,
    faults_done: usize,
) -> anyhow::Result<()> {
    let so_far = report.turns_per_session;
    let remaining = (faults - faults_done) as f64;
    let estimate = if faults_done == 0 {
        so_far
    } else {
        (1.25 * remaining * so_far as f64 / faults_done as f64).ceil() as usize
    };
    report.turns_per_session += estimate.min(so_far).max(config.turns_per_session);
    report.turn_extensions += 1;
    write_script(&config.data, report.turns_per_session, config.seed)
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// Acknowledged states: session → seq → ledger hash.
#[derive(Debug, Default)]
struct Acks {
    states: BTreeMap<String, BTreeMap<u64, u64>>,
    /// The same (session, seq) acknowledged with two different ledgers: an acknowledged event
    /// was lost and its seq reused.
    conflicts: Vec<String>,
}

impl Acks {
    fn insert(&mut self, session: &str, seq: u64, hash: u64) {
        let states = self.states.entry(session.to_owned()).or_default();
        match states.insert(seq, hash) {
            Some(previous) if previous != hash => self.conflicts.push(format!(
                "{session} seq {seq} was acknowledged with ledger {previous:016x}, later with \
                 {hash:016x}: an acknowledged event was lost and its seq reused"
            )),
            _ => {}
        }
    }

    fn len(&self) -> usize {
        self.states.values().map(BTreeMap::len).sum()
    }
}

fn absorb(report: &mut ChaosReport, acks: &mut Acks, ready_ms: &mut Vec<f64>, run: &ChildRun) {
    for (session, seq, hash) in &run.output.acks {
        acks.insert(session, *seq, *hash);
    }
    if let Some(ready) = &run.output.ready {
        ready_ms.push(ready.after.as_secs_f64() * 1000.0);
        report.resumed_sessions += ready.running;
        report.requeued_tasks += ready.requeued;
        report.released_leases += ready.released;
    }
}

#[derive(Debug)]
enum End {
    /// Killed by us.
    Killed,
    /// Cut by the power-cut shim, which reported what it undid.
    Cut(CutFigures),
    /// Exited by itself.
    Exited(ExitStatus),
    /// Did not finish in time (and was killed).
    TimedOut,
}

/// How a child's run is to end.
#[derive(Debug)]
enum Plan {
    /// SIGKILL this long after the start (a regular kill).
    Kill(Duration),
    /// SIGKILL this long after the start (a startup kill).
    StartupKill(Duration),
    /// The shim cuts the power (the child runs with its environment).
    Cut(Cut),
    /// No fault: the child runs to completion.
    Finish,
}

#[derive(Debug, Default)]
struct Ready {
    after: Duration,
    running: usize,
    requeued: usize,
    released: usize,
}

#[derive(Debug, Default)]
struct ChildOutput {
    /// The child said `opened`: the store is open (recovered), resume not yet done.
    opened: bool,
    ready: Option<Ready>,
    acks: Vec<(String, u64, u64)>,
    done: bool,
}

struct ChildRun {
    pid: u32,
    end: End,
    output: ChildOutput,
    stderr_tail: String,
}

/// Starts a child with `env` added to its environment; kills it as `plan` says, or waits for
/// it to finish (or to cut its power).
fn run_child(
    config: &ChaosConfig,
    exe: &Path,
    turns: usize,
    plan: &Plan,
    env: &[(&str, std::ffi::OsString)],
) -> anyhow::Result<ChildRun> {
    let spawned = Instant::now();
    let mut child = Command::new(exe)
        .arg("chaos-child")
        .arg("--data")
        .arg(&config.data)
        .arg("--sessions")
        .arg(config.sessions.to_string())
        .arg("--turns")
        .arg(turns.to_string())
        .arg("--store")
        .arg(config.store.as_str())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", exe.display()))?;
    let pid = child.id();
    let stdout = child.stdout.take().context("child stdout")?;
    let stderr = child.stderr.take().context("child stderr")?;
    let reader = std::thread::spawn(move || read_child_output(stdout, spawned));
    let errors = std::thread::spawn(move || tail(stderr, STDERR_TAIL_LINES));

    let end = match plan {
        Plan::Kill(after) | Plan::StartupKill(after) => {
            let after = *after;
            std::thread::sleep(after.saturating_sub(spawned.elapsed()));
            // SIGKILL on Unix. A child that already exited is a zombie until `wait`: the kill
            // is then a no-op and `wait` reports its own exit.
            let _ = child.kill();
            let status = child.wait().context("cannot reap the chaos child")?;
            if killed(&status) {
                End::Killed
            } else {
                End::Exited(status)
            }
        }
        Plan::Cut(_) | Plan::Finish => wait_or_kill(&mut child, FINAL_RUN_TIMEOUT)?,
    };
    let output = reader
        .join()
        .map_err(|_| anyhow!("the child's stdout reader panicked"))?;
    let stderr_tail = errors
        .join()
        .map_err(|_| anyhow!("the child's stderr reader panicked"))?;
    let end = match end {
        End::Exited(status) if status.code() == Some(CUT_EXIT_STATUS) => {
            match CutFigures::parse(&stderr_tail) {
                Some(figures) => End::Cut(figures),
                None => bail!(
                    "chaos child exited with the power-cut status {CUT_EXIT_STATUS} but did not \
                     report a cut; its stderr ends:\n{stderr_tail}"
                ),
            }
        }
        other => other,
    };
    Ok(ChildRun {
        pid,
        end,
        output,
        stderr_tail,
    })
}

fn wait_or_kill(child: &mut Child, timeout: Duration) -> anyhow::Result<End> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().context("cannot poll the chaos child")? {
            return Ok(End::Exited(status));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(End::TimedOut);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(unix)]
fn killed(status: &ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    const SIGKILL: i32 = 9;
    status.signal() == Some(SIGKILL)
}

#[cfg(not(unix))]
fn killed(status: &ExitStatus) -> bool {
    !status.success()
}

/// Parses the child's protocol lines; a last line without its newline (cut by the kill) is
/// dropped.
fn read_child_output(stdout: impl Read, spawned: Instant) -> ChildOutput {
    let mut output = ChildOutput::default();
    read_child_lines(stdout, |text| parse_child_line(text, spawned, &mut output));
    output
}

/// Calls `each` with every whole line of the child's stdout (without its newline), until the
/// stream ends; a last line without its newline (cut by the kill) is dropped.
fn read_child_lines(stdout: impl Read, mut each: impl FnMut(&str)) {
    let mut reader = BufReader::new(stdout);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if line.last() != Some(&b'\n') {
            break;
        }
        if let Ok(text) = std::str::from_utf8(&line[..line.len() - 1]) {
            each(text);
        }
    }
}

/// Takes one protocol line of a child started at `spawned` into `output`.
fn parse_child_line(text: &str, spawned: Instant, output: &mut ChildOutput) {
    let words: Vec<&str> = text.split(' ').collect();
    match words.as_slice() {
        ["ack", session, seq, hash] => {
            if let (Ok(seq), Ok(hash)) = (seq.parse(), u64::from_str_radix(hash, 16)) {
                output.acks.push(((*session).to_owned(), seq, hash));
            }
        }
        ["ready", running, _outstanding, requeued, released] => {
            let n = |s: &str| s.parse::<usize>().unwrap_or(0);
            output.ready = Some(Ready {
                after: spawned.elapsed(),
                running: n(running),
                requeued: n(requeued),
                released: n(released),
            });
        }
        ["done"] => output.done = true,
        ["opened"] => output.opened = true,
        _ => {}
    }
}

/// The last `keep` lines of a stream.
fn tail(stream: impl Read, keep: usize) -> String {
    let mut lines = std::collections::VecDeque::new();
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        if lines.len() == keep {
            lines.pop_front();
        }
        lines.push_back(line);
    }
    Vec::from(lines).join("\n")
}

mod child;
mod cut_aim;
pub mod record;
mod remote;
mod report;
mod script;
#[cfg(test)]
mod tests;
mod verify;
