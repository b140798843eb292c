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

use crate::powercut::{Cut, CutFigures, CUT_EXIT_STATUS};
use anyhow::{anyhow, bail, Context};
use async_trait::async_trait;
use cairn_activities::{ActivityContext, Tool, ToolCall, ToolOutput, ToolRegistry};
use cairn_ledger::{validate_transcript, JsonText, ModelSpec, Part, Role, ToolSpec, Transcript};
use cairn_runtime::store::embedded::{self, OpenMode, OpenedStore, StorageEngine};
use cairn_runtime::{
    replay, Client, Engine, Error as RuntimeError, ErrorClass, Event, RetryPolicy, SessionOptions,
    SessionState, SessionStatus, SystemClock, TurnOutcome,
};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use cut_aim::CutAim;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The tool every chaos session calls.
pub const SIDE_EFFECT_TOOL: &str = "side_effect";
/// The store, under the data directory.
pub const STORE_DIR: &str = "store";
/// The scripted model's script, under the data directory.
pub const SCRIPT_FILE: &str = "chaos-script.json";
/// The side-effect record, under the data directory.
pub const SIDE_EFFECTS_FILE: &str = "side-effects.jsonl";

/// Base latency of a scripted model response; each response adds a seeded 0–`MODEL_DELAY_SPREAD_MS`.
const MODEL_DELAY_MS: u64 = 8;
const MODEL_DELAY_SPREAD_MS: u64 = 12;
/// The scripted provider's `jitter_ms`: per call (session, turn, round, attempt) extra latency.
const MODEL_JITTER_MS: u64 = 25;
/// One kill in this many falls at a random moment of the child's startup.
const STARTUP_KILL_ONE_IN: u64 = 5;

/// The most the estimate of a child's time to ready grows to after kills that came too early.
const READY_ESTIMATE_MAX: Duration = Duration::from_secs(20);
/// How long the side-effect tool works after writing its record.
const TOOL_WORK_MS: u64 = 3;
/// How often the child samples every session's state for acks, besides its turn boundaries.
const ACK_POLL_MS: u64 = 15;
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

/// Opens the store in `dir` through [`embedded`], as a child would: creating it when `create`
/// (nothing acknowledged yet), else requiring it. Blocks on `runtime`.
fn open_store(
    runtime: &tokio::runtime::Runtime,
    engine: StoreEngine,
    dir: &Path,
    create: bool,
) -> anyhow::Result<OpenedStore> {
    let mode = if create {
        OpenMode::Create
    } else {
        OpenMode::Existing
    };
    runtime
        .block_on(embedded::open(dir, mode, Some(engine)))
        .with_context(|| format!("cannot open the {engine} store in {}", dir.display()))
}

/// The figures of a chaos run and what verification found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChaosReport {
    /// The seed (rerun with it).
    pub seed: u64,
    /// Sessions.
    pub sessions: usize,
    /// Turns each session completed (the configured turns, plus any added; see
    /// [`ChaosConfig::turns_per_session`]).
    pub turns_per_session: usize,
    /// How many times turns were added because the children finished early.
    pub turn_extensions: usize,
    /// SIGKILLs delivered.
    pub kills: usize,
    /// Of them, kills before the child reported `ready` (while opening the store or resuming).
    pub kills_before_ready: usize,
    /// Worker processes beside the child ([`ChaosConfig::remote_workers`]).
    pub remote_workers: usize,
    /// Of the kills, those of a worker process rather than the child (the server).
    pub worker_kills: usize,
    /// Worker processes started, restarts included.
    pub worker_starts: usize,
    /// Of the server kills, those after which it stayed down longer than a lease.
    pub server_outages: usize,
    /// Startup kills delivered ([`ChaosConfig::startup_kills`]).
    pub startup_kills: usize,
    /// Of them, kills before the child reported `ready` (store opened and resume done).
    pub startup_kills_before_ready: usize,
    /// Of them, kills before the child reported `opened` (while sled opened and recovered).
    pub startup_kills_before_open: usize,
    /// Power cuts made ([`ChaosConfig::power_cuts`]).
    pub power_cuts: usize,
    /// Of them, cuts before the child reported `ready` (while opening or recovering).
    pub cuts_before_ready: usize,
    /// Unsynced writes the cuts undid, summed.
    pub cut_reverted_writes: u64,
    /// Their bytes.
    pub cut_reverted_bytes: u64,
    /// Unsynced writes torn cuts kept.
    pub cut_kept_writes: u64,
    /// Name changes (creations, renames, unlinks) the cuts undid.
    pub cut_undone_names: u64,
    /// Checks of the store after a fault ([`ChaosConfig::check_each_fault`]).
    pub fault_checks: usize,
    /// Acknowledged states checked by them, summed over the checks.
    pub fault_checked_acks: usize,
    /// Problems those checks found (each is in `problems` too): 0 when no fault lost an
    /// acknowledged event or left a store that does not open or check clean.
    pub fault_problems: usize,
    /// Torn side-effect records (a run killed while writing its record), each by a process
    /// that was killed.
    pub torn_side_effects: usize,
    /// Children started, the final one included; every one after the first resumed the store.
    pub child_runs: usize,
    /// Children that finished by themselves before the kill was due (the workload was done).
    pub early_exits: usize,
    /// Sessions with a turn in progress found by the resumes, summed over children.
    pub resumed_sessions: usize,
    /// Leases of killed children released by the resumes, summed.
    pub released_leases: usize,
    /// Tasks missing from the queue that resumes re-enqueued, summed (expected 0).
    pub requeued_tasks: usize,
    /// Mean time from starting a child to its `ready` (store open and resume done).
    pub mean_ready_ms: f64,
    /// Distinct acknowledged states (session, seq) checked against the final histories.
    pub acked_states: usize,
    /// Events in all histories.
    pub events: usize,
    /// Turns completed, all sessions.
    pub turns_completed: usize,
    /// Tool uses in all ledgers.
    pub tool_uses: usize,
    /// Tool runs recorded in the side-effect file.
    pub tool_runs: usize,
    /// Tool runs beyond the first of their key (`tool_runs` − distinct keys). Each must be a
    /// run in a process that was then killed before its result was recorded.
    pub repeated_tool_runs: usize,
    /// Most repeated runs caused by one kill (runs a killed process made that ran again).
    pub max_repeats_per_kill: usize,
    /// Keys that ran more than once.
    pub repeated_keys: usize,
    /// Most runs of one key.
    pub max_runs_per_key: usize,
    /// Repeats whose runs were in the same process (a lapsed lease, not a kill).
    pub same_process_repeats: usize,
    /// Repeats after a run in a worker that was not killed: its report was lost because the
    /// server was killed while the run held its lease (see the module doc).
    pub server_kill_repeats: usize,
    /// Failed activity attempts recorded (`model_call_failed` + `tool_call_failed`), retried.
    pub failed_attempts: usize,
    /// Time spent in the kill phase.
    pub kill_phase: Duration,
    /// Time the final child took to finish the work.
    pub final_run: Duration,
    /// Time the whole run took, verification included.
    pub wall_time: Duration,
    /// The run stopped at a failed check after a fault: no final run, no verification.
    pub stopped: bool,
    /// Every violated promise; empty when verification passes.
    pub problems: Vec<String>,
}

impl ChaosReport {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

impl fmt::Display for ChaosReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "chaos run, seed {}: {} sessions x {} turns{}",
            self.seed,
            self.sessions,
            self.turns_per_session,
            if self.turn_extensions > 0 {
                format!(
                    " (turns raised {} time(s): the sessions finished before the kills)",
                    self.turn_extensions
                )
            } else {
                String::new()
            }
        )?;
        if self.remote_workers == 0 {
            writeln!(
                f,
                "  kills               {} SIGKILLs ({} before the child was ready), {} child runs, {} finished early",
                self.kills, self.kills_before_ready, self.child_runs, self.early_exits
            )?;
        } else {
            writeln!(
                f,
                "  kills               {} SIGKILLs: {} of the server ({} before it was ready, {} followed by an outage longer than a lease), {} of workers; {} server runs, {} finished early",
                self.kills,
                self.kills - self.worker_kills,
                self.kills_before_ready,
                self.server_outages,
                self.worker_kills,
                self.child_runs,
                self.early_exits
            )?;
            writeln!(
                f,
                "  remote workers      {} worker processes ({} started in all, lease {} ms); {} repeated runs by workers that lived on, each after a server kill",
                self.remote_workers,
                self.worker_starts,
                remote::LEASE_MS,
                self.server_kill_repeats
            )?;
        }
        if self.startup_kills > 0 {
            writeln!(
                f,
                "  startup kills       {} SIGKILLs early in the child's start ({} before the store was open, {} more before resume was done)",
                self.startup_kills,
                self.startup_kills_before_open,
                self.startup_kills_before_ready
                    .saturating_sub(self.startup_kills_before_open)
            )?;
        }
        if self.power_cuts > 0 {
            writeln!(
                f,
                "  power cuts          {} ({} before the child was ready): {} unsynced writes ({} bytes) lost, {} kept by torn cuts, {} name changes undone",
                self.power_cuts,
                self.cuts_before_ready,
                self.cut_reverted_writes,
                self.cut_reverted_bytes,
                self.cut_kept_writes,
                self.cut_undone_names
            )?;
        }
        if self.fault_checks > 0 {
            writeln!(
                f,
                "  checks after faults {} (the store opens, every acknowledged state is there, fsck is clean): {} acknowledged states checked in all, {} problem(s)",
                self.fault_checks,
                self.fault_checked_acks,
                self.fault_problems
            )?;
        }
        writeln!(
            f,
            "  resumes             {} interrupted sessions resumed, {} dead leases released, {} tasks re-enqueued; {:.0} ms mean start-to-ready",
            self.resumed_sessions, self.released_leases, self.requeued_tasks, self.mean_ready_ms
        )?;
        if self.stopped {
            writeln!(
                f,
                "  stopped             at the first failed check after a fault: no final run, no verification"
            )?;
        } else {
            self.fmt_verification(f)?;
        }
        writeln!(
            f,
            "  time                {:.1} s in all: {:.1} s killing, {:.1} s final run",
            self.wall_time.as_secs_f64(),
            self.kill_phase.as_secs_f64(),
            self.final_run.as_secs_f64()
        )?;
        self.fmt_verdict(f)
    }
}

impl ChaosReport {
    /// The figures of the final verification.
    fn fmt_verification(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  history             {} events, {} turns completed, {} acknowledged states all present",
            self.events, self.turns_completed, self.acked_states
        )?;
        writeln!(
            f,
            "  tools               {} tool uses, each with exactly one recorded result; {} runs, {} torn side-effect records",
            self.tool_uses, self.tool_runs, self.torn_side_effects
        )?;
        writeln!(
            f,
            "  repeated runs       {} ({:.1}% of runs; {:.1} per kill or cut, at most {} for one; {} keys, at most {} runs of one key, {} within one process), each with its call's key",
            self.repeated_tool_runs,
            if self.tool_runs == 0 {
                0.0
            } else {
                100.0 * self.repeated_tool_runs as f64 / self.tool_runs as f64
            },
            {
                let faults = self.kills + self.startup_kills + self.power_cuts;
                if faults == 0 {
                    0.0
                } else {
                    self.repeated_tool_runs as f64 / faults as f64
                }
            },
            self.max_repeats_per_kill,
            self.repeated_keys,
            self.max_runs_per_key,
            self.same_process_repeats
        )?;
        writeln!(
            f,
            "  failed attempts     {} (retried)",
            self.failed_attempts
        )
    }

    fn fmt_verdict(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.problems.is_empty() {
            write!(f, "  verdict             PASS: every session completed, every ledger validates, every acknowledged event is present")
        } else {
            writeln!(
                f,
                "  verdict             FAIL: {} problem(s)",
                self.problems.len()
            )?;
            for (i, p) in self.problems.iter().enumerate() {
                if i > 0 {
                    writeln!(f)?;
                }
                write!(f, "    - {p}")?;
            }
            Ok(())
        }
    }
}

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

/// A small seeded generator (SplitMix64) for kill moments and the script.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0), up to a negligible modulo bias.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// FNV-1a, 64 bits, continuing from `hash`: the same in every process and build.
fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// A fingerprint of a ledger: FNV-1a of its message count, its part count and its last message
/// (as JSON). Cheap enough to take at every acknowledged step of a long session (hashing the
/// whole ledger each time is quadratic), and it changes with every event that changes the
/// ledger; events that do not (a scheduled call) are pinned by their seq.
fn ledger_fingerprint(transcript: &Transcript) -> u64 {
    let parts: usize = transcript.messages.iter().map(|m| m.parts.len()).sum();
    let mut hash = fnv1a(
        0xcbf2_9ce4_8422_2325,
        &(transcript.messages.len() as u64).to_le_bytes(),
    );
    hash = fnv1a(hash, &(parts as u64).to_le_bytes());
    if let Some(last) = transcript.messages.last() {
        hash = fnv1a(hash, &serde_json::to_vec(last).unwrap_or_default());
    }
    hash
}

// ---- The script --------------------------------------------------------------------------------

/// The shape of turn `turn`: how many parallel tool calls each of its tool rounds makes (1–2
/// rounds of 2–3 calls), then a final text. Seeded, and the same for every session.
fn turn_shape(seed: u64, turn: usize) -> Vec<usize> {
    let mut rng = SplitMix64(seed ^ (turn as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let rounds = 1 + rng.below(2) as usize;
    (0..rounds).map(|_| 2 + rng.below(2) as usize).collect()
}

/// The script for `turns` turns. The provider picks a response by the count of assistant
/// messages in the transcript, so the script is every model call of every turn in order; the
/// responses of turn `t` do not depend on how many turns follow, so adding turns keeps the
/// earlier responses as they were.
fn script_json(turns: usize, seed: u64) -> String {
    let mut rng = SplitMix64(seed.rotate_left(17) ^ 0x5851_F42D_4C95_7F2D);
    let mut responses = Vec::new();
    for turn in 1..=turns {
        for (round, calls) in turn_shape(seed, turn).into_iter().enumerate() {
            let mut parts = vec![serde_json::json!({
                "type": "thinking",
                "text": format!("Turn {turn}, round {round}: {calls} side effects, in parallel."),
                "signature": format!("sig-t{turn}-r{round}"),
            })];
            for k in 0..calls {
                parts.push(serde_json::json!({
                    "type": "tool_use",
                    "id": format!("toolu_t{turn}_r{round}_{k}"),
                    "name": SIDE_EFFECT_TOOL,
                    "input": {"turn": turn, "round": round, "call": k},
                }));
            }
            responses.push(serde_json::json!({
                "parts": parts,
                "usage": {"input_tokens": 100 + 10 * turn, "output_tokens": 20},
                "delay_ms": MODEL_DELAY_MS + rng.below(MODEL_DELAY_SPREAD_MS + 1),
                "jitter_ms": MODEL_JITTER_MS,
            }));
        }
        responses.push(serde_json::json!({
            "parts": [{"type": "text", "text": format!("Turn {turn} done.")}],
            "usage": {"input_tokens": 120 + 10 * turn, "output_tokens": 5},
            "delay_ms": MODEL_DELAY_MS + rng.below(MODEL_DELAY_SPREAD_MS + 1),
            "jitter_ms": MODEL_JITTER_MS,
        }));
    }
    serde_json::json!({"model": "scripted-chaos", "responses": responses}).to_string()
}

/// Writes the script atomically (a child may be reading it only when none is running, but a
/// torn file after a crash of the parent would still be confusing).
fn write_script(data: &Path, turns: usize, seed: u64) -> anyhow::Result<()> {
    let path = data.join(SCRIPT_FILE);
    let temporary = data.join(format!("{SCRIPT_FILE}.tmp"));
    std::fs::write(&temporary, script_json(turns, seed))
        .with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, &path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

mod cut_aim;
pub mod record;
mod remote;

// ---- The side-effect tool ----------------------------------------------------------------------

/// The chaos tool: records each run with its idempotency key in a file, then works briefly.
#[derive(Debug, Clone)]
pub struct SideEffect {
    path: PathBuf,
}

impl SideEffect {
    /// Records runs in `path` (appended to; created if missing).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        SideEffect { path: path.into() }
    }
}

/// One record of the side-effect file (framed and checksummed by [`record`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct SideEffectRecord {
    /// The call's idempotency key, `SESSION/TOOL_USE_ID`.
    pub key: String,
    /// The tool_use it answers.
    pub tool_use_id: String,
    /// The process that ran it.
    pub pid: u32,
    /// The activity attempt.
    pub attempt: u32,
    /// When it ran, in ms since the Unix epoch by the machine's clock, which the parent's
    /// record of server kills shares: a repeat after a run in a worker that was not killed
    /// must follow a server kill (see the module doc, "The checks").
    #[serde(default)]
    pub at_ms: u64,
}

/// The machine's clock in ms since the Unix epoch: the one clock the parent and every process
/// it starts share.
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn append_durably(path: &Path, record: &[u8]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    // One write, but a kill can still cut it at a page boundary: the framing of `record`
    // lets the reader tell that torn prefix from damage and read on after it.
    file.write_all(record)?;
    file.sync_data()
}

#[async_trait]
impl Tool for SideEffect {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: SIDE_EFFECT_TOOL.to_owned(),
            description: "Performs an externally visible side effect (appends a record)."
                .to_owned(),
            input_schema: JsonText::from_value(&serde_json::json!({"type": "object"})),
        }
    }

    async fn call(
        &self,
        call: &ToolCall,
        context: &ActivityContext,
    ) -> cairn_activities::Result<ToolOutput> {
        let pid = std::process::id();
        let record = SideEffectRecord {
            key: call.idempotency_key.clone(),
            tool_use_id: call.tool_use_id.clone(),
            pid,
            attempt: context.attempt(),
            at_ms: wall_ms(),
        };
        let line = record::encode(&record);
        let path = self.path.clone();
        let shown = path.display().to_string();
        tokio::task::spawn_blocking(move || append_durably(&path, &line))
            .await
            .map_err(|e| cairn_activities::Error::ToolFailed {
                tool: SIDE_EFFECT_TOOL.to_owned(),
                message: format!("the writer task failed: {e}"),
            })?
            .map_err(|source| cairn_activities::Error::Io {
                path: shown,
                source,
            })?;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(TOOL_WORK_MS)) => {}
            _ = context.cancelled() => {
                return Err(cairn_activities::Error::Cancelled {
                    reason: "cancelled after the side effect was recorded".to_owned(),
                });
            }
        }
        Ok(ToolOutput::json(JsonText::from_value(&serde_json::json!({
            "key": call.idempotency_key,
            "pid": pid,
        }))))
    }
}

// ---- The child ---------------------------------------------------------------------------------

/// Prints an ack line for a session's state when its seq moved past the last one printed.
#[derive(Default)]
struct Acker {
    printed: Mutex<HashMap<String, u64>>,
}

impl Acker {
    fn ack(&self, session_id: &str, state: &SessionState) {
        let seq = state.next_seq.saturating_sub(1);
        let mut printed = match self.printed.lock() {
            Ok(p) => p,
            Err(poisoned) => poisoned.into_inner(),
        };
        let last = printed.entry(session_id.to_owned()).or_insert(0);
        if seq > *last {
            *last = seq;
            // Under the lock, so a session's acks leave in seq order.
            let mut out = std::io::stdout().lock();
            let _ = writeln!(
                out,
                "ack {session_id} {seq} {:016x}",
                ledger_fingerprint(&state.transcript)
            );
            let _ = out.flush();
        }
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// How a child serves remote workers instead of running its own pool (remote mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeOptions {
    /// The loopback port it serves the `/v1` API on: the same for every child of a run, so
    /// that the workers find each one where the killed one was.
    pub port: u16,
    /// Attempts at most of each activity, in the retry policies of the sessions it creates.
    pub max_attempts: u32,
}

/// The retry policy of the chaos sessions in remote mode: every lease a kill lets lapse is a
/// failed attempt (class `timeout`), so `max_attempts` (more than the kills of the run) and a
/// short backoff, so that kills delay turns but never fail them.
fn chaos_retry(defaults: RetryPolicy, max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        initial_interval_ms: 50,
        backoff_coefficient: 2.0,
        maximum_interval_ms: 400,
        maximum_attempts: max_attempts,
        ..defaults
    }
}

/// The exit status of a remote-mode child or worker whose parent went away.
const ORPHANED_EXIT_STATUS: i32 = 3;

/// Ends this process when its stdin closes, which happens when the parent dies without
/// killing it (a remote-mode child would otherwise drive sessions no worker runs, forever).
fn exit_when_stdin_closes() {
    std::thread::spawn(|| {
        let mut sink = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        std::process::exit(ORPHANED_EXIT_STATUS);
    });
}

/// Binds the loopback `port`, trying again for a while: the killed predecessor's socket may
/// not be released yet.
async fn bind_loopback(port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
    let mut tries = 0;
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(e) if tries < 100 => {
                tries += 1;
                eprintln!("note: cannot listen on {addr} yet ({e}); trying again");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("cannot listen on {addr}")),
        }
    }
}

/// The child: opens the store, resumes, and drives `sessions` sessions to `turns` completed
/// turns each; returns when they are all done. Run by `cairn chaos-child`. With `serve`, it
/// runs no pool: it serves the `/v1` API for remote workers (`cairn chaos-worker`), resumes
/// keeping their leases, and stops serving when the sessions are done.
pub async fn run_chaos_child(
    data: &Path,
    sessions: usize,
    turns: usize,
    store: StoreEngine,
    serve: Option<ServeOptions>,
) -> anyhow::Result<()> {
    if serve.is_some() {
        exit_when_stdin_closes();
    }
    let opened = embedded::open(&data.join(STORE_DIR), OpenMode::Create, Some(store))
        .await
        .with_context(|| format!("cannot open the store in {}", data.display()))?;
    say("opened");
    let store = opened.store.clone();
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    // In-process, this process holds the store's lock: every lease in the store belongs to a
    // killed child, so reclaim them rather than wait for them to lapse. Remote workers may
    // still hold theirs and report: keep them (a lapsed one is recorded by the timers).
    let resumed = engine.resume(serve.is_none()).await?;
    let mut server = None;
    if let Some(options) = serve {
        let listener = bind_loopback(options.port).await?;
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let config = cairn_server::ServerConfig {
            drain_ms: 2_000,
            ..cairn_server::ServerConfig::default()
        };
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        // `serve` resumes again (finding nothing left to do) and fires the engine's timers.
        let task = tokio::spawn(cairn_server::serve(
            engine.clone(),
            listener,
            config,
            shutdown,
        ));
        server = Some((stop, task));
    }
    say(&format!(
        "ready {} {} {} {}",
        resumed.running_sessions.len(),
        resumed.outstanding_tasks,
        resumed.requeued_tasks,
        resumed.reclaimed_leases
    ));

    let tools = Arc::new(ToolRegistry::new().with(SideEffect::new(data.join(SIDE_EFFECTS_FILE))));
    let pool = serve.is_none().then(|| {
        WorkerPool::start(
            engine.clone(),
            Activities {
                models: Arc::new(StandardModels::new()),
                tools: tools.clone(),
            },
            WorkerConfig {
                lease_ms: 10_000,
                poll_interval_ms: 20,
                ..WorkerConfig::default()
            },
        )
    });
    let client = Client::new(engine.clone());
    let script = std::path::absolute(data.join(SCRIPT_FILE)).context("the script's path")?;
    let model = ModelSpec::parse(&format!("scripted:{}", script.display()))
        .context("the script's model spec")?;
    let ids: Vec<String> = (0..sessions).map(session_id).collect();
    for id in &ids {
        match engine.state(id).await {
            Ok(_) => {}
            Err(RuntimeError::UnknownSession { .. }) => {
                let mut options = SessionOptions {
                    session_id: Some(id.clone()),
                    system_prompt: Some("You are a chaos test. Call side_effect.".to_owned()),
                    ..SessionOptions::new(model.clone(), tools.specs())
                };
                if let Some(serve) = serve {
                    options.model_retry = chaos_retry(options.model_retry, serve.max_attempts);
                    options.tool_retry = chaos_retry(options.tool_retry, serve.max_attempts);
                }
                client.start_session(options).await?;
            }
            Err(e) => return Err(e.into()),
        }
    }

    let acker = Arc::new(Acker::default());
    let turns = u32::try_from(turns).context("too many turns")?;
    let mut drivers = tokio::task::JoinSet::new();
    for id in ids.clone() {
        let engine = engine.clone();
        let acker = acker.clone();
        drivers.spawn(async move { drive(&engine, &id, turns, &acker).await });
    }
    let poller = {
        let engine = engine.clone();
        let acker = acker.clone();
        tokio::spawn(async move {
            loop {
                for id in &ids {
                    if let Ok(state) = engine.state(id).await {
                        acker.ack(id, &state);
                    }
                }
                tokio::time::sleep(Duration::from_millis(ACK_POLL_MS)).await;
            }
        })
    };
    let driven = async {
        while let Some(joined) = drivers.join_next().await {
            match joined {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(anyhow!("a session driver panicked: {e}")),
            }
        }
        Ok(())
    };
    let result = match &mut server {
        None => driven.await,
        Some((_, task)) => tokio::select! {
            result = driven => result,
            served = task => Err(match served {
                Ok(Ok(())) => anyhow!("the server stopped before the sessions were done"),
                Ok(Err(e)) => anyhow::Error::new(e).context("the server failed"),
                Err(e) => anyhow!("the server panicked: {e}"),
            }),
        },
    };
    poller.abort();
    result?;
    say("done");
    if let Some(pool) = pool {
        pool.shutdown().await;
    }
    if let Some((stop, task)) = server {
        // Nothing is leased any more: the drain ends at once, long polls are ended.
        let _ = stop.send(true);
        task.await
            .map_err(|e| anyhow!("the server panicked: {e}"))?
            .context("the server failed")?;
    }
    Ok(())
}

/// A remote worker of a chaos run (`cairn chaos-worker`): a pool over the server at `server`
/// hosting the scripted model and the `side_effect` tool (recording in `data`'s side-effect
/// file), with a `lease_ms` lease renewed every third of it. Says `worker ready` once the
/// server answered; drains and returns when its stdin closes (the parent stops it so, or died).
pub async fn run_chaos_worker(server: &str, data: &Path, lease_ms: u64) -> anyhow::Result<()> {
    let (closed, stdin_closed) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        let _ = closed.send(());
    });
    let source = Arc::new(
        cairn_remote::HttpTaskSource::new(server, None)
            .with_context(|| format!("cannot use the server address {server}"))?,
    );
    let activities = Activities {
        models: Arc::new(StandardModels::new()),
        tools: Arc::new(ToolRegistry::new().with(SideEffect::new(data.join(SIDE_EFFECTS_FILE)))),
    };
    let config = WorkerConfig {
        lease_ms,
        // How long a lease request waits for a task.
        poll_interval_ms: remote::WORKER_POLL_MS,
        renew_interval_ms: Some(lease_ms / 3),
        take_unhosted: false,
        ..WorkerConfig::default()
    };
    let pool = WorkerPool::start_with(source.clone(), activities, config);
    tokio::pin!(stdin_closed);
    tokio::select! {
        reached = source.reached() => {
            if let Err(e) = reached {
                pool.shutdown().await;
                return Err(e).context("the server refused this worker");
            }
            say("worker ready");
            let _ = stdin_closed.await;
        }
        _ = &mut stdin_closed => {}
    }
    pool.shutdown().await;
    Ok(())
}

/// Drives one session until it has completed `turns` turns.
async fn drive(engine: &Engine, id: &str, turns: u32, acker: &Acker) -> anyhow::Result<()> {
    loop {
        let state = engine.state(id).await?;
        acker.ack(id, &state);
        if state.active.is_some() {
            let outcome = engine.wait_turn(id, state.turns_started).await?;
            if !matches!(outcome, TurnOutcome::Completed { .. }) {
                bail!("{id}: turn {} ended {outcome:?}", state.turns_started);
            }
            continue;
        }
        match &state.last_outcome {
            None | Some(TurnOutcome::Completed { .. }) => {}
            Some(other) => bail!("{id}: turn {} ended {other:?}", other.turn()),
        }
        if state.turns_started >= turns {
            return Ok(());
        }
        engine
            .send_message(
                id,
                &format!("Chaos turn {}.", state.turns_started + 1),
                None,
            )
            .await?;
    }
}

// ---- Verification ------------------------------------------------------------------------------

/// What verification gathers besides the report's figures.
#[derive(Default)]
struct Ledgers {
    /// Every tool_use of every ledger by idempotency key (`SESSION/TOOL_USE_ID`), with the pid
    /// in its one recorded result (the process whose run was recorded).
    recorded: BTreeMap<String, Option<u32>>,
}

/// Checks the store and the side-effect file against the acks and the kills; fills in
/// the report's figures and problems. `Err` only when the store cannot be read at all.
fn verify(
    config: &ChaosConfig,
    acks: &Acks,
    explanations: &Explanations,
    report: &mut ChaosReport,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a runtime for verification")?;
    let opened = runtime
        .block_on(embedded::open(
            &config.data.join(STORE_DIR),
            OpenMode::ReadOnly,
            Some(config.store),
        ))
        .context("the store does not open after the run")?;
    for loss in &opened.losses {
        report
            .problems
            .push(format!("acknowledged events lost: {loss}"));
    }
    let store = opened.store.clone();
    report.problems.extend(acks.conflicts.iter().cloned());
    report.acked_states = acks.len();
    let mut ledgers = Ledgers::default();
    runtime.block_on(async {
        let listed: BTreeMap<String, SessionStatus> = store
            .list_sessions()
            .await?
            .into_iter()
            .map(|i| (i.session_id, i.status))
            .collect();
        for i in 0..config.sessions {
            let id = session_id(i);
            match listed.get(&id) {
                None => {
                    report.problems.push(format!("{id} does not exist"));
                    continue;
                }
                Some(SessionStatus::Idle) => {}
                Some(other) => report
                    .problems
                    .push(format!("{id} is {}, not idle", other.as_str())),
            }
            let history = store.read_history(&id, 1, None).await?;
            check_session(&id, &history, acks.states.get(&id), report, &mut ledgers);
        }
        if listed.len() != config.sessions {
            report.problems.push(format!(
                "the store lists {} sessions, expected {}",
                listed.len(),
                config.sessions
            ));
        }
        let tasks = store.list_tasks().await?;
        if let Some(task) = tasks.first() {
            report.problems.push(format!(
                "{} task(s) are still queued after every turn completed, e.g. {}",
                tasks.len(),
                task.id
            ));
        }
        anyhow::Ok(())
    })?;
    report.tool_uses = ledgers.recorded.len();
    check_side_effects(
        &config.data.join(SIDE_EFFECTS_FILE),
        &ledgers,
        explanations,
        report,
    )
}

/// One session: status of its turns, replay, ledger validation, acknowledged states, one
/// recorded result per tool_use.
fn check_session(
    id: &str,
    history: &[cairn_runtime::EventEnvelope],
    acked: Option<&BTreeMap<u64, u64>>,
    report: &mut ChaosReport,
    ledgers: &mut Ledgers,
) {
    report.events += history.len();
    let problems = &mut report.problems;
    if !check_acked(id, history, acked, problems) {
        return;
    }

    let replayed = match replay(id, history) {
        Ok(r) => r,
        Err(e) => {
            problems.push(format!("{id}: replay fails: {e}"));
            return;
        }
    };
    let transcript = &replayed.state.transcript;
    if let Err(e) = validate_transcript(transcript) {
        problems.push(format!("{id}: the ledger does not validate: {e}"));
    }
    if replayed.state.active.is_some() {
        problems.push(format!("{id}: a turn is still running"));
    }
    let mut completed = 0;
    let mut results: BTreeMap<&str, Vec<&cairn_ledger::ToolResultContent>> = BTreeMap::new();
    for e in history {
        match &e.event {
            Event::TurnCompleted { .. } => completed += 1,
            Event::TurnFailed { turn, reason, .. } => {
                problems.push(format!("{id}: turn {turn} failed: {reason}"))
            }
            Event::ModelCallFailed { failure, .. } | Event::ToolCallFailed { failure, .. } => {
                report.failed_attempts += 1;
                // A kill fails an attempt only as a lapsed lease (a remote worker's, or one
                // held while the server was down): any other failure is not the kills'.
                if failure.class != ErrorClass::Timeout {
                    problems.push(format!(
                        "{id}: seq {} ({}) failed with class {}: {}; only kills, as lapsed \
                         leases, should fail attempts",
                        e.seq,
                        e.event.kind(),
                        failure.class.as_str(),
                        failure.message
                    ));
                }
            }
            Event::ToolCallCompleted {
                tool_use_id,
                content,
                ..
            } => results.entry(tool_use_id).or_default().push(content),
            _ => {}
        }
    }
    report.turns_completed += completed;
    let turns = report.turns_per_session;
    if completed != turns || replayed.state.turns_started as usize != turns {
        problems.push(format!(
            "{id}: {completed} turns completed of {} started, expected {turns}",
            replayed.state.turns_started
        ));
    }
    let mut in_ledger = BTreeSet::new();
    for message in &transcript.messages {
        if message.role != Role::Assistant {
            continue;
        }
        for part in &message.parts {
            if let Part::ToolUse(tool_use) = part {
                in_ledger.insert(tool_use.id.as_str());
            }
        }
    }
    for tool_use_id in &in_ledger {
        let key = format!("{id}/{tool_use_id}");
        let pid = match results.get(tool_use_id).map(Vec::as_slice) {
            Some([content]) => {
                let result = ToolResultJson::parse(content);
                match result {
                    Some(r) if r.key == key => Some(r.pid),
                    _ => {
                        problems.push(format!(
                            "{id}: the result of {tool_use_id} does not carry its key {key}: {}",
                            content.canonical_json()
                        ));
                        None
                    }
                }
            }
            Some(many) => {
                problems.push(format!(
                    "{id}: tool_use {tool_use_id} has {} recorded results",
                    many.len()
                ));
                None
            }
            None => {
                problems.push(format!(
                    "{id}: tool_use {tool_use_id} has no recorded result"
                ));
                None
            }
        };
        ledgers.recorded.insert(key, pid);
    }
    for tool_use_id in results.keys() {
        if !in_ledger.contains(tool_use_id) {
            problems.push(format!(
                "{id}: a result is recorded for {tool_use_id}, which is no tool_use of the ledger"
            ));
        }
    }
}

/// Every acknowledged state of session `id`: its events are in `history` and fold to the
/// acknowledged ledger. Returns false when the history does not fold at all.
fn check_acked(
    id: &str,
    history: &[cairn_runtime::EventEnvelope],
    acked: Option<&BTreeMap<u64, u64>>,
    problems: &mut Vec<String>,
) -> bool {
    let mut state = SessionState::new(id);
    let empty = BTreeMap::new();
    let acked = acked.unwrap_or(&empty);
    for envelope in history {
        if let Err(e) = state.apply(envelope) {
            problems.push(format!("{id}: folding seq {} fails: {e}", envelope.seq));
            return false;
        }
        if let Some(hash) = acked.get(&envelope.seq) {
            let found = ledger_fingerprint(&state.transcript);
            if found != *hash {
                problems.push(format!(
                    "{id}: acknowledged state at seq {} had ledger {hash:016x}, the history \
                     folds to {found:016x} there",
                    envelope.seq
                ));
            }
        }
    }
    if let Some((&seq, _)) = acked.range(history.len() as u64 + 1..).next() {
        problems.push(format!(
            "{id}: acknowledged event seq {seq} is missing; the history ends at seq {}",
            history.len()
        ));
    }
    true
}

/// After a kill or a power cut: a copy of the store as the fault left it must open, hold every
/// state acknowledged so far and check clean with fsck (every history decodes, is complete and
/// replays; the queue matches the sessions). A copy, so that the next child still recovers the
/// store exactly as the fault left it. Problems are prefixed with `fault`; a failed check keeps
/// nothing else: the run stops, leaving the store as the fault left it.
fn check_after_fault(
    config: &ChaosConfig,
    acks: &Acks,
    fault: &str,
    report: &mut ChaosReport,
) -> anyhow::Result<()> {
    report.fault_checks += 1;
    let store_dir = config.data.join(STORE_DIR);
    let copy = config.data.join("fault-check");
    if copy.exists() {
        std::fs::remove_dir_all(&copy)
            .with_context(|| format!("cannot remove {}", copy.display()))?;
    }
    if store_dir.exists() {
        copy_tree(&store_dir, &copy)?;
    }
    let mut problems = Vec::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a runtime for the check")?;
    // Cut before anything was acknowledged, perhaps while the store was being created: the
    // next child creates what is missing, and must be able to.
    let opened = open_store(&runtime, config.store, &copy, acks.len() == 0);
    match opened {
        Err(e) => {
            let diagnosis = diagnose_unopenable(config, &copy, acks);
            problems.push(format!("the store does not open: {e:#}{diagnosis}"));
        }
        Ok(opened) => {
            report.fault_checked_acks += acks.len();
            let store = opened.store.clone();
            runtime.block_on(async {
                for (id, acked) in &acks.states {
                    match store.read_history(id, 1, None).await {
                        Ok(history) => {
                            check_acked(id, &history, Some(acked), &mut problems);
                        }
                        Err(e) => problems.push(format!("{id}: the history does not read: {e}")),
                    }
                }
                match cairn_runtime::fsck::fsck(&*store).await {
                    Ok(fsck) if fsck.is_clean() => {}
                    Ok(fsck) => problems.push(format!("fsck is not clean:\n{fsck}")),
                    Err(e) => problems.push(format!("fsck cannot read the store: {e}")),
                }
            });
        }
    }
    std::fs::remove_dir_all(&copy).ok();
    // The run stops at a failed check, so the store stays exactly as the fault left it.
    let kept_note = format!("{} is left as the fault left it", store_dir.display());
    for p in problems {
        report.problems.push(format!(
            "after {fault} (seed {}): {p}; {kept_note}",
            config.seed
        ));
    }
    Ok(())
}

/// sled's leftover of a snapshot it was writing when the process died.
const SLED_GENERATING_SUFFIX: &str = ".generating";

/// Why a store copy does not open, when a known defect explains it: sled 0.34 takes a
/// `snap.*.generating` file (a snapshot it was writing when the process died, before its
/// rename) for its newest snapshot, finds it incomplete and refuses to open. Retries without
/// those files and says whether the store then opens and holds every acknowledged state.
fn diagnose_unopenable(config: &ChaosConfig, copy: &Path, acks: &Acks) -> String {
    let Ok(entries) = std::fs::read_dir(copy) else {
        return String::new();
    };
    let leftovers: Vec<(String, u64)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let is_leftover = name.starts_with("snap.") && name.ends_with(SLED_GENERATING_SUFFIX);
            is_leftover.then(|| (name, e.metadata().map_or(0, |m| m.len())))
        })
        .collect();
    if leftovers.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = leftovers
        .iter()
        .map(|(name, len)| format!("{name} ({len} bytes)"))
        .collect();
    for (name, _) in &leftovers {
        let _ = std::fs::remove_file(copy.join(name));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let Ok(runtime) = runtime else {
        return String::new();
    };
    let without = match open_store(&runtime, config.store, copy, false) {
        Err(e) => format!("still does not open ({e:#})"),
        Ok(opened) => {
            let store = opened.store.clone();
            let mut missing = Vec::new();
            {
                runtime.block_on(async {
                    for (id, acked) in &acks.states {
                        match store.read_history(id, 1, None).await {
                            Ok(history) => {
                                check_acked(id, &history, Some(acked), &mut missing);
                            }
                            Err(e) => missing.push(format!("{id}: {e}")),
                        }
                    }
                });
            }
            if missing.is_empty() {
                format!("opens and holds all {} acknowledged states", acks.len())
            } else {
                format!("opens but: {}", missing.join("; "))
            }
        }
    };
    format!(
        " [known sled 0.34 defect: the interrupted snapshot {} is read as the newest snapshot; \
         without it the store {without}]",
        shown.join(", ")
    )
}

/// Copies a directory tree (regular files and directories; sled makes no others).
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("cannot create {}", to.display()))?;
    for entry in
        std::fs::read_dir(from).with_context(|| format!("cannot list {}", from.display()))?
    {
        let entry = entry.with_context(|| format!("cannot list {}", from.display()))?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("cannot copy {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// The side-effect tool's result.
#[derive(Deserialize)]
struct ToolResultJson {
    key: String,
    pid: u32,
}

impl ToolResultJson {
    fn parse(content: &cairn_ledger::ToolResultContent) -> Option<Self> {
        match content {
            cairn_ledger::ToolResultContent::Json(json) => serde_json::from_str(json.as_str()).ok(),
            cairn_ledger::ToolResultContent::Text(_)
            | cairn_ledger::ToolResultContent::Blocks(_) => None,
        }
    }
}

/// The side-effect file against the ledgers: every run names a tool_use by its key; every
/// tool_use ran; the recorded result is its last run's; every earlier run was cut short by a
/// kill of the process that made it, or (remote mode) lost its report to a kill of the server
/// between the run and the next run of its key.
fn check_side_effects(
    path: &Path,
    ledgers: &Ledgers,
    explanations: &Explanations,
    report: &mut ChaosReport,
) -> anyhow::Result<()> {
    let killed_pids = &explanations.killed_pids;
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let shown = path.display();
    let parsed = record::parse(&bytes);
    for damage in parsed.damage {
        report.problems.push(format!("{shown}: {damage}"));
    }
    // A record torn by a kill: a run that never finished writing it, and whose call therefore
    // ran again. Only a killed process can leave one.
    report.torn_side_effects = parsed.torn.len();
    for torn in &parsed.torn {
        if let Some(pid) = torn.pid.filter(|pid| !killed_pids.contains(pid)) {
            report.problems.push(format!(
                "{shown} offset {}: a torn record by process {pid}, which was not killed",
                torn.offset
            ));
        }
    }
    let mut runs: BTreeMap<String, Vec<SideEffectRecord>> = BTreeMap::new();
    for (n, record) in parsed.records.into_iter().enumerate() {
        report.tool_runs += 1;
        let names_its_call = record
            .key
            .split_once('/')
            .is_some_and(|(_, tool_use_id)| tool_use_id == record.tool_use_id);
        if !names_its_call || !ledgers.recorded.contains_key(&record.key) {
            report.problems.push(format!(
                "{shown} record {}: key {:?} (tool_use {}) names no tool_use of the ledgers",
                n + 1,
                record.key,
                record.tool_use_id
            ));
        }
        runs.entry(record.key.clone()).or_default().push(record);
    }
    for key in ledgers.recorded.keys() {
        if !runs.contains_key(key) {
            report.problems.push(format!(
                "tool_use {key} has a recorded result but never ran"
            ));
        }
    }
    let mut repeats_by_kill: BTreeMap<Kill, usize> = BTreeMap::new();
    for (key, records) in &runs {
        report.max_runs_per_key = report.max_runs_per_key.max(records.len());
        let Some((last, earlier)) = records.split_last() else {
            continue;
        };
        if let Some(Some(recorded_pid)) = ledgers.recorded.get(key) {
            if last.pid != *recorded_pid {
                report.problems.push(format!(
                    "the recorded result of {key} came from process {recorded_pid}, but its last \
                     run was in process {}",
                    last.pid
                ));
            }
        }
        if earlier.is_empty() {
            continue;
        }
        report.repeated_keys += 1;
        report.repeated_tool_runs += earlier.len();
        let pids: BTreeSet<u32> = records.iter().map(|r| r.pid).collect();
        report.same_process_repeats += records.len() - pids.len();
        for (run, next) in earlier.iter().zip(&records[1..]) {
            let kill = if killed_pids.contains(&run.pid) {
                Kill::Process(run.pid)
            } else if let Some(at_ms) = explanations.server_kill_between(run, next) {
                report.server_kill_repeats += 1;
                Kill::Server(at_ms)
            } else {
                report.problems.push(format!(
                    "{key} ran again after a run in process {}, which was not killed{}",
                    run.pid,
                    if explanations.server_kills_ms.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ", and the server was not killed between that run (at {} ms, \
                             lease {} ms) and the next (at {} ms)",
                            run.at_ms, explanations.lease_ms, next.at_ms
                        )
                    }
                ));
                continue;
            };
            *repeats_by_kill.entry(kill).or_default() += 1;
        }
    }
    report.max_repeats_per_kill = repeats_by_kill.values().copied().max().unwrap_or(0);
    Ok(())
}

/// The kill a repeated run is put down to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kill {
    /// Of the process that made the earlier run.
    Process(u32),
    /// Of the server, at this moment (ms since the epoch).
    Server(u64),
}

impl Explanations {
    /// The first server kill that can have lost `run`'s report, if any: one after its lease
    /// was taken (at most a lease before its record) and before `next` ran. A report is lost
    /// only when the server is down until the lease lapses; the lapse is recorded, and only
    /// then is the next attempt scheduled, so that kill comes before `next`.
    fn server_kill_between(&self, run: &SideEffectRecord, next: &SideEffectRecord) -> Option<u64> {
        let leased_after = run.at_ms.saturating_sub(self.lease_ms);
        self.server_kills_ms
            .iter()
            .copied()
            .filter(|k| (leased_after..=next.at_ms).contains(k))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_loads_and_grows_without_changing_its_start() {
        let two = script_json(2, 7);
        let five = script_json(5, 7);
        let short = cairn_activities::Script::from_json(&two, "two.json").unwrap();
        let long = cairn_activities::Script::from_json(&five, "five.json").unwrap();
        for i in 0..short.len() {
            assert_eq!(short.response(i), long.response(i));
        }
        let calls: usize = (1..=5).map(|t| turn_shape(7, t).len() + 1).sum();
        assert_eq!(long.len(), calls);
        assert!((1..=20).all(|t| {
            let shape = turn_shape(7, t);
            (1..=2).contains(&shape.len()) && shape.iter().all(|c| (2..=3).contains(c))
        }));
    }

    #[test]
    fn child_lines_cut_by_a_kill_are_dropped() {
        let text = "ready 3 4 0 2\nack chaos-000 5 00000000000000ff\nack chaos-001 7 00ab\ndone\nack chaos-000 9 1";
        let output = read_child_output(text.as_bytes(), Instant::now());
        assert_eq!(
            output.acks,
            [
                ("chaos-000".to_owned(), 5, 0xff),
                ("chaos-001".to_owned(), 7, 0xab)
            ]
        );
        let ready = output.ready.unwrap();
        assert_eq!((ready.running, ready.requeued, ready.released), (3, 0, 2));
        assert!(output.done);
    }

    #[test]
    fn conflicting_acks_are_problems() {
        let mut acks = Acks::default();
        acks.insert("s", 3, 1);
        acks.insert("s", 3, 1);
        assert!(acks.conflicts.is_empty());
        acks.insert("s", 3, 2);
        assert_eq!(acks.conflicts.len(), 1);
        assert_eq!(acks.len(), 1);
    }

    fn record(key: &str, pid: u32) -> Vec<u8> {
        record_at(key, pid, 0)
    }

    fn record_at(key: &str, pid: u32, at_ms: u64) -> Vec<u8> {
        let tool_use_id = key.split_once('/').map_or(key, |(_, t)| t);
        record::encode(&SideEffectRecord {
            key: key.to_owned(),
            tool_use_id: tool_use_id.to_owned(),
            pid,
            attempt: 1,
            at_ms,
        })
    }

    /// Runs the side-effect check on `lines` against two recorded tool uses, with pid 10 killed.
    fn side_effects(records: &[Vec<u8>], recorded: &[(&str, u32)]) -> ChaosReport {
        let explanations = Explanations {
            killed_pids: BTreeSet::from([10]),
            ..Explanations::default()
        };
        side_effects_explained(records, recorded, &explanations)
    }

    fn side_effects_explained(
        records: &[Vec<u8>],
        recorded: &[(&str, u32)],
        explanations: &Explanations,
    ) -> ChaosReport {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SIDE_EFFECTS_FILE);
        std::fs::write(&path, records.concat()).unwrap();
        let ledgers = Ledgers {
            recorded: recorded
                .iter()
                .map(|(key, pid)| ((*key).to_owned(), Some(*pid)))
                .collect(),
        };
        let mut report = ChaosReport::default();
        check_side_effects(&path, &ledgers, explanations, &mut report).unwrap();
        report
    }

    #[test]
    fn a_repeat_after_a_live_workers_run_is_explained_only_by_a_server_kill_between_the_runs() {
        let recorded = [("s/a", 11), ("s/b", 12)];
        // Worker 11 (never killed) ran s/a at 10 000 ms and again at 13 000 ms, after its
        // first report was lost; its lease was taken at most 1 500 ms before the first run.
        let records = [
            record_at("s/a", 11, 10_000),
            record_at("s/b", 12, 10_500),
            record_at("s/a", 11, 13_000),
        ];
        let check = |server_kills_ms: &[u64]| {
            let explanations = Explanations {
                killed_pids: BTreeSet::from([10]),
                server_kills_ms: server_kills_ms.to_vec(),
                lease_ms: 1_500,
            };
            side_effects_explained(&records, &recorded, &explanations)
        };
        for explained in [&[10_200][..], &[8_600], &[13_000], &[5_000, 12_000, 20_000]] {
            let report = check(explained);
            assert!(report.passed(), "{explained:?}: {:?}", report.problems);
            assert_eq!(
                (report.server_kill_repeats, report.same_process_repeats),
                (1, 1)
            );
            assert_eq!(report.max_repeats_per_kill, 1);
        }
        for unexplained in [&[][..], &[8_400], &[13_001], &[1_000, 14_000]] {
            let report = check(unexplained);
            let problems = report.problems.join("\n");
            let expected = if unexplained.is_empty() {
                // No server kill at all: in-process mode's problem.
                "s/a ran again after a run in process 11, which was not killed\n"
            } else {
                "s/a ran again after a run in process 11, which was not killed, and the server \
                 was not killed between that run (at 10000 ms, lease 1500 ms) and the next (at \
                 13000 ms)"
            };
            assert!(
                format!("{problems}\n").contains(expected),
                "{unexplained:?}: {problems}"
            );
            assert_eq!(report.server_kill_repeats, 0);
        }
    }

    #[test]
    fn repeats_are_counted_and_must_be_explained_by_a_kill() {
        let recorded = [("s/a", 11), ("s/b", 11)];
        // a ran in the killed process 10, then again in 11, which recorded it: one repeat.
        let ok = side_effects(
            &[record("s/a", 10), record("s/b", 11), record("s/a", 11)],
            &recorded,
        );
        assert!(ok.passed(), "{:?}", ok.problems);
        assert_eq!(
            (ok.tool_runs, ok.repeated_tool_runs, ok.repeated_keys),
            (3, 1, 1)
        );
        assert_eq!((ok.max_runs_per_key, ok.max_repeats_per_kill), (2, 1));

        // A repeat after a run in a process that was not killed.
        let unexplained = side_effects(
            &[record("s/a", 12), record("s/a", 11), record("s/b", 11)],
            &recorded,
        );
        assert!(
            unexplained.problems[0].contains("process 12, which was not killed"),
            "{:?}",
            unexplained.problems
        );
        // The recorded result is not from the last run.
        let stale = side_effects(
            &[record("s/a", 11), record("s/a", 10), record("s/b", 11)],
            &recorded,
        );
        assert!(stale
            .problems
            .iter()
            .any(|p| p.contains("came from process 11, but its last run was in process 10")));
        // Twice in one process.
        let twice = side_effects(
            &[record("s/a", 11), record("s/a", 11), record("s/b", 11)],
            &recorded,
        );
        assert_eq!(twice.same_process_repeats, 1);
        // A key that names no tool_use, a tool_use that never ran, a damaged record.
        let mut flipped = record("s/a", 11);
        let last = flipped.len() - 3;
        flipped[last] ^= 0x01;
        let wrong = side_effects(
            &[
                record("s/a", 11),
                record("s/zzz", 11),
                record::encode(&SideEffectRecord {
                    key: "s/a".to_owned(),
                    tool_use_id: "b".to_owned(),
                    pid: 11,
                    attempt: 1,
                    at_ms: 0,
                }),
                flipped,
            ],
            &recorded,
        );
        let problems = wrong.problems.join("\n");
        assert!(problems.contains(r#"key "s/zzz""#), "{problems}");
        assert!(problems.contains(r#"key "s/a" (tool_use b)"#), "{problems}");
        assert!(
            problems.contains("tool_use s/b has a recorded result but never ran"),
            "{problems}"
        );
        assert!(problems.contains("checksum mismatch"), "{problems}");
    }

    #[test]
    fn a_torn_side_effect_record_is_accepted_only_from_a_killed_process() {
        let recorded = [("s/a", 11), ("s/b", 11)];
        // Process 10 (killed) tore its record of s/b at a 4 KiB page boundary; 11 ran it again.
        let torn = record("s/b", 10);
        // Records of s/a up to 10 bytes or more before the boundary; the first one's `at_ms`
        // (1 to 13 digits) moves the boundary into the torn record, past its pid.
        let filled = |first_at_ms: u64| {
            let mut file = record_at("s/a", 11, first_at_ms);
            while file.len() + record("s/a", 11).len() < 4096 - 10 {
                file.extend_from_slice(&record("s/a", 11));
            }
            file
        };
        let mut file = (0..13)
            .map(|digits| filled(10u64.pow(digits)))
            .find(|file| 4096 - file.len() < torn.len())
            .unwrap();
        let cut = 4096 - file.len();
        assert!(cut > 9 && cut < torn.len());
        file.extend_from_slice(&torn[..cut]);
        file.extend_from_slice(&record("s/b", 11));
        let runs = file.iter().filter(|b| **b == 0x1e).count() - 1;
        let ok = side_effects(&[file.clone()], &recorded);
        let killed_ok = ok.problems.iter().all(|p| !p.contains("torn"));
        assert!(killed_ok, "{:?}", ok.problems);
        assert_eq!((ok.torn_side_effects, ok.tool_runs), (1, runs));

        // The same tear by process 12, which was not killed: a problem.
        let mut by_live = file[..file.len() - record("s/b", 11).len() - cut].to_vec();
        by_live.extend_from_slice(&record("s/b", 12)[..cut]);
        by_live.extend_from_slice(&record("s/b", 11));
        let live = side_effects(&[by_live], &recorded);
        assert!(
            live.problems
                .iter()
                .any(|p| p.contains("a torn record by process 12, which was not killed")),
            "{:?}",
            live.problems
        );
    }

    #[tokio::test]
    async fn acknowledged_states_must_be_in_the_history_with_their_ledger() {
        let engine = Engine::new(
            Arc::new(cairn_runtime::MemoryStore::new()),
            Arc::new(SystemClock),
        );
        let model = ModelSpec::parse("scripted:chaos.json").unwrap();
        let client = Client::new(engine.clone());
        let mut options = SessionOptions::new(model, vec![SideEffect::new("x").spec()]);
        options.session_id = Some(session_id(0));
        let id = client.start_session(options).await.unwrap();
        let after_start = ledger_fingerprint(&engine.state(&id).await.unwrap().transcript);
        engine.send_message(&id, "go", None).await.unwrap();
        let state = engine.state(&id).await.unwrap();
        let seq = state.next_seq - 1;
        let history = client.history(&id).await.unwrap();
        assert_eq!(history.len() as u64, seq);
        assert_ne!(after_start, ledger_fingerprint(&state.transcript));

        let check = |acked: &[(u64, u64)]| {
            let acked: BTreeMap<u64, u64> = acked.iter().copied().collect();
            let mut report = ChaosReport::default();
            check_session(
                &id,
                &history,
                Some(&acked),
                &mut report,
                &mut Ledgers::default(),
            );
            report.problems
        };
        let good = check(&[
            (1, after_start),
            (seq, ledger_fingerprint(&state.transcript)),
        ]);
        // The turn is still running and none completed: only those complaints.
        assert!(
            good.iter()
                .all(|p| p.contains("still running") || p.contains("turns completed")),
            "{good:?}"
        );
        let missing = check(&[(seq + 2, 0)]).join("\n");
        assert!(
            missing.contains(&format!("acknowledged event seq {} is missing", seq + 2)),
            "{missing}"
        );
        let changed = check(&[(seq, after_start)]).join("\n");
        assert!(
            changed.contains(&format!("acknowledged state at seq {seq} had ledger")),
            "{changed}"
        );
    }
}
