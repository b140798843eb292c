//! The report of a chaos run: its figures, what verification found, and how it prints.

use super::remote;
use std::fmt;
use std::time::Duration;

// Named in doc links only.
#[cfg(doc)]
use super::ChaosConfig;

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
