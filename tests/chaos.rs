//! The chaos test: a `cairn chaos-child` process runs 20 concurrent sessions (scripted model with
//! seeded latency, parallel calls of a tool that records each run with its idempotency key in a
//! file) and is killed with SIGKILL at random moments, over 100 times; after each kill a new one
//! resumes. Then every session must have completed, every ledger validate, every acknowledged
//! event be present, every tool_use have exactly one recorded result, and the repeated tool runs
//! be few and each carry its call's key. The protocol and the checks are in `cairn_devtools::chaos`.
//!
//! The same with remote workers: the child serves the `/v1` API, two `cairn chaos-worker`
//! processes run the model and tool calls over HTTP, and each kill falls on the server or on a
//! worker; the same checks, with a repeat explained also by a server kill that lost a live
//! worker's report.
//!
//! The seed is printed; rerun a failure with `CAIRN_CHAOS_SEED=<seed>`; `CAIRN_CHAOS_KILLS`
//! changes the number of kills (100), `CAIRN_CHAOS_REMOTE_KILLS` those of the remote test (8).
//! A failed run keeps its data directory and prints where.
#![cfg(unix)]

use cairn_devtools::chaos::{run_chaos, ChaosConfig, ChaosReport};
use std::path::Path;

const SEED_ENV: &str = "CAIRN_CHAOS_SEED";
const KILLS_ENV: &str = "CAIRN_CHAOS_KILLS";
const DEFAULT_KILLS: usize = 100;
const REMOTE_KILLS_ENV: &str = "CAIRN_CHAOS_REMOTE_KILLS";
const DEFAULT_REMOTE_KILLS: usize = 8;

fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

#[test]
fn sessions_complete_and_keep_every_promise_across_random_sigkills() {
    let seed = env_number(SEED_ENV).unwrap_or_else(rand::random::<u64>);
    let kills = env_number(KILLS_ENV).unwrap_or(DEFAULT_KILLS);
    eprintln!("chaos: seed {seed} (rerun with {SEED_ENV}={seed})");
    let root = tempfile::Builder::new()
        .prefix("cairn-chaos-test-")
        .tempdir()
        .expect("tempdir");
    let config = ChaosConfig {
        sessions: 20,
        // About one turn per kill: the work outlasts the kills, and the final run finishes it.
        turns_per_session: 40,
        kills,
        kill_after_ms: (10, 150),
        ..ChaosConfig::new(root.path().join("data"), seed)
    };
    run_and_check(seed, root, &config, |report| check(report, kills));
}

#[test]
fn remote_workers_and_their_server_keep_every_promise_across_random_sigkills() {
    let seed = env_number(SEED_ENV).unwrap_or_else(rand::random::<u64>);
    let kills = env_number(REMOTE_KILLS_ENV).unwrap_or(DEFAULT_REMOTE_KILLS);
    eprintln!("chaos with remote workers: seed {seed} (rerun with {SEED_ENV}={seed})");
    let root = tempfile::Builder::new()
        .prefix("cairn-chaos-remote-test-")
        .tempdir()
        .expect("tempdir");
    let config = ChaosConfig {
        sessions: 4,
        turns_per_session: 3,
        kills,
        // A killed worker's tasks wait for its lease (1.5 s) to lapse: kills further apart
        // than in-process, so that work goes on between them.
        kill_after_ms: (100, 400),
        remote_workers: 2,
        ..ChaosConfig::new(root.path().join("data"), seed)
    };
    run_and_check(seed, root, &config, |report| check_remote(report, kills));
}

/// Runs `config`, prints the report and applies `check`; on failure keeps the data directory
/// and panics with the seed.
fn run_and_check(
    seed: u64,
    root: tempfile::TempDir,
    config: &ChaosConfig,
    check: impl FnOnce(&ChaosReport) -> Result<(), String>,
) {
    let checked = run_chaos(config, Path::new(env!("CARGO_BIN_EXE_cairn")))
        .map_err(|e| format!("{e:#}"))
        .and_then(|report| {
            eprintln!("{report}");
            check(&report)
        });
    if let Err(what) = checked {
        let kept = root.keep();
        panic!(
            "chaos, seed {seed} (data kept in {}): {what}",
            kept.display()
        );
    }
}

fn check_remote(report: &ChaosReport, kills: usize) -> Result<(), String> {
    if !report.passed() {
        return Err(format!("verification failed:\n{report}"));
    }
    let server_kills = report.kills - report.worker_kills;
    if report.kills < kills || (kills >= 2 && (server_kills == 0 || report.worker_kills == 0)) {
        return Err(format!(
            "{server_kills} server and {} worker kills, expected {kills} with both kinds\n{report}",
            report.worker_kills
        ));
    }
    // Every worker started is one of the first, a restart after a kill, or one of those the
    // turns added restarted with the server.
    let expected_starts = report.remote_workers * (1 + report.early_exits) + report.worker_kills;
    if report.worker_starts != expected_starts {
        return Err(format!(
            "{} worker processes started, expected {expected_starts}\n{report}",
            report.worker_starts
        ));
    }
    if report.acked_states == 0 || report.tool_runs == 0 {
        return Err(format!(
            "nothing was acknowledged or no tool ran: the test tested nothing\n{report}"
        ));
    }
    // One kill repeats at most the tool calls in flight: 3 parallel calls per session.
    if report.max_repeats_per_kill > 3 * report.sessions {
        return Err(format!(
            "one kill caused {} repeated tool runs, more than the {} calls that can be in flight\n{report}",
            report.max_repeats_per_kill,
            3 * report.sessions
        ));
    }
    Ok(())
}

fn check(report: &ChaosReport, kills: usize) -> Result<(), String> {
    if !report.passed() {
        return Err(format!("verification failed:\n{report}"));
    }
    if report.kills < kills {
        return Err(format!("only {} kills, expected {kills}", report.kills));
    }
    // Kills must land on work in progress too, not only on a child still opening the store.
    // One in five is aimed at startup; on a loaded machine (CI runs this beside the corruption
    // matrix and the power cuts) startups slow down and more kills land early, so the bar is a
    // fifth of the kills on work, not most.
    if report.kills_before_ready * 5 > report.kills * 4 {
        return Err(format!(
            "{} of {} kills came before the child was ready: the kills test startup, not work",
            report.kills_before_ready, report.kills
        ));
    }
    if report.resumed_sessions == 0 || report.acked_states == 0 {
        return Err(format!(
            "no interrupted session was resumed or nothing was acknowledged: the test tested \
             nothing\n{report}"
        ));
    }
    // At least once, and no more than kills explain: every repeated run was made by a process
    // that was then killed before its result was recorded (verified above, with the key), so
    // one kill repeats at most the tool calls in flight: 3 parallel calls per session.
    if report.max_repeats_per_kill > 3 * report.sessions {
        return Err(format!(
            "one kill caused {} repeated tool runs, more than the {} calls that can be in flight\n{report}",
            report.max_repeats_per_kill,
            3 * report.sessions
        ));
    }
    // Within one process the lease (10 s, heartbeated) never lapses: repeats come from kills.
    if report.same_process_repeats > 0 {
        return Err(format!(
            "{} tool runs were repeated within one process\n{report}",
            report.same_process_repeats
        ));
    }
    Ok(())
}
