//! `cairn chaos`: the chaos test's parent (children killed at random moments and resumed,
//! then every promise of the log checked) run in a work directory of its own, and its report.

use super::cleanup;
use super::out::outln;
use anyhow::{bail, Context};
use cairn_runtime::store::embedded::{self, StorageEngine};
use std::path::PathBuf;
use std::process::ExitCode;

/// `cairn chaos`: runs the parent of the chaos test in a blocking thread and prints its report.
/// What `cairn chaos` was asked for.
pub(crate) struct ChaosArgs {
    pub(crate) kills: usize,
    pub(crate) sessions: usize,
    pub(crate) turns: usize,
    pub(crate) seed: Option<u64>,
    pub(crate) kill_after_ms: (u64, u64),
    pub(crate) startup_kills: usize,
    pub(crate) power_cuts: usize,
    pub(crate) engine: StorageEngine,
    pub(crate) remote_workers: usize,
    pub(crate) data: Option<PathBuf>,
    pub(crate) keep: bool,
}

pub(crate) async fn run(args: ChaosArgs) -> anyhow::Result<ExitCode> {
    let ChaosArgs {
        kills,
        sessions,
        turns,
        seed,
        kill_after_ms,
        startup_kills,
        power_cuts,
        engine,
        remote_workers,
        data,
        keep,
    } = args;
    // Only a directory made here is removed, and only after checks that passed.
    let remove_after = data.is_none() && !keep;
    let data = match data {
        Some(d) => refuse_store_as_chaos_dir(d)?,
        None => tempfile::Builder::new()
            .prefix("cairn-chaos-")
            .tempdir()
            .context("cannot create a temporary directory")?
            .keep(),
    };
    let seed = match seed {
        Some(seed) => seed,
        None => chaos_seed(),
    };
    let config = cairn_devtools::chaos::ChaosConfig {
        data: data.clone(),
        sessions,
        turns_per_session: turns,
        kills,
        seed,
        kill_after_ms,
        startup_kills,
        power_cuts,
        check_each_fault: startup_kills + power_cuts > 0,
        store: engine,
        remote_workers,
        ..cairn_devtools::chaos::ChaosConfig::new(&data, seed)
    };
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let workers = if remote_workers == 0 {
        String::new()
    } else {
        format!(", {remote_workers} remote workers (kills fall on the server or a worker)")
    };
    outln!(
        "chaos on {engine}: {sessions} sessions x {turns} turns, {kills} SIGKILLs (most {}-{} ms after the child is ready), {startup_kills} startup kills, {power_cuts} power cuts{workers}, seed {seed}, data {}",
        kill_after_ms.0,
        kill_after_ms.1,
        data.display()
    )?;
    let report =
        tokio::task::spawn_blocking(move || cairn_devtools::chaos::run_chaos(&config, &exe))
            .await
            .context("the chaos run panicked")??;
    outln!("{report}")?;
    cleanup::chaos_data(&data, remove_after && report.passed())?;
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

// A seed for a run nobody gave one: the one place the CLI reads the clock for randomness.
#[allow(clippy::disallowed_methods)]
fn chaos_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ u64::from(std::process::id()).rotate_left(32)
}

/// `cairn chaos --data DIR` takes a work directory of its own (its children's store is
/// `DIR/store`, beside their side-effect files): a store given there is refused, so that the
/// run's sessions never mix with a store's.
fn refuse_store_as_chaos_dir(dir: PathBuf) -> anyhow::Result<PathBuf> {
    if embedded::detect(&dir)?.is_some() {
        bail!(
            "{} is a cairn store; cairn chaos --data takes a work directory of its own (the \
             chaos children's store is made in DIR/store): name a new directory",
            dir.display()
        );
    }
    Ok(dir)
}
