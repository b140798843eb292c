//! `cairn bench`: durable agent turns per second and per-turn latency, embedded and through
//! servers with worker processes, measured on whole processes in a closed loop.
//!
//! The workload is the one the README's figures use: a fresh session per turn, then a model
//! call, two parallel tool calls (`calculator`; `parallel_tools` sets how many) and a model
//! call, every step durable. The model is scripted, answering after `model_latency_ms`.
//! `sessions` clients each run turns back to back for `seconds`; the figures are completed
//! turns per second and the p50 and p99 of one turn's latency (send → outcome).
//!
//! Through servers, the parent starts `servers` `cairn server` processes on loopback ports,
//! over a new embedded store (one server) or a scratch database on a PostgreSQL server (any
//! number, sharing it), and `workers` `cairn worker` processes split across the servers round
//! robin; client `i` drives its turns through server `i mod servers` with the remote client.
//! Embedded, one process holds the store, the engine and a worker pool with its default
//! settings, as `cairn run` does.
//!
//! Each measurement first probes the disk: [`fdatasync_probe`] times 8 KiB overwrites and
//! fdatasyncs of a file beside the store, so that a row's latency can be read against the
//! flush it waits for, measured under the same load. Embedded, the store counts its durable
//! commits ([`Store::durable_commits`]); commits per turn at one session in flight are the
//! commits a turn waits for in series, and the row shows p50 ÷ (commits × p50 fdatasync): 1.0
//! would be a turn that costs nothing but its flushes. Beside the probe's p50 stands the
//! store's own ([`Store::sync_times`]): the probe's is the cheapest durable write there is,
//! the store's is what its commits paid in the same row, so the two tell a turn's time in
//! its syncs from its time between them. Every row also shows the CPU time (user and system)
//! the serving processes used in its measured window per completed turn ([`crate::cpu`]):
//! this process embedded, the servers and workers through servers.

// A benchmark reads clocks and waits on real time.
#![allow(clippy::disallowed_methods)]

use crate::cpu::total_cpu_seconds;
use crate::process::{start_and_wait, Process};
use crate::scratch_database::ScratchDatabase;
use anyhow::{bail, Context};
use cairn_activities::ToolRegistry;
use cairn_ledger::{ModelSpec, ToolSpec};
use cairn_runtime::stages::{self, Recording, SlowTurns, Step};
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::store::Store;
use cairn_runtime::{Client, Engine, SessionOptions, SystemClock, TurnOutcome};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::io::Write as _;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::warn;

/// One measurement's load.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Clients running turns at once (sessions in flight).
    pub sessions: usize,
    /// How long to run turns, after a warm-up of a tenth of it.
    pub seconds: f64,
    /// The scripted model's latency per call.
    pub model_latency_ms: u64,
    /// Activities each worker process runs at once (`cairn worker --concurrency`), so that
    /// more worker processes mean more capacity, as when they run on more machines.
    pub worker_concurrency: usize,
    /// Tool calls the model asks for at once, between its two calls ([`DEFAULT_PARALLEL_TOOLS`]
    /// in the README's workload).
    pub parallel_tools: usize,
    /// About this many bytes of JSON of further tool specs offered to the model (never
    /// called), beside the built-in ones: a coding agent's tool list is tens of kilobytes,
    /// which a model task through a server carries ([`bench_tools`]).
    pub tool_spec_bytes: usize,
    /// Turns each client runs on one session before it starts a fresh one (1: a fresh
    /// session per turn, the README's workload). A long session's transcript grows from
    /// turn to turn, and through a server every model task carries it.
    pub turns_per_session: usize,
    /// About this many bytes of text in each turn's user message (0: the word `go`), so
    /// that a long session's transcript grows as an agent's does.
    pub message_bytes: usize,
    /// Record the marks on the turns' path ([`cairn_runtime::stages`]) in the measured
    /// window, embedded only; [`BenchResult::stages`] then holds their steps.
    pub stages: bool,
}

/// Where the servers keep their sessions. (No `Debug`: a URL may hold a password.)
#[derive(Clone)]
pub enum ServerStore {
    /// A new embedded store of this engine, which one server holds.
    Embedded(StorageEngine),
    /// A scratch database created for the measurement on the PostgreSQL server this URL
    /// names, shared by every server.
    Postgres {
        /// The URL of any database on that server (the scratch database replaces its name).
        server_url: String,
    },
}

/// The processes of one measurement through servers.
#[derive(Clone)]
pub struct Deployment {
    /// The store the servers use.
    pub store: ServerStore,
    /// `cairn server` processes.
    pub servers: usize,
    /// `cairn worker` processes, split across the servers round robin.
    pub workers: usize,
}

impl Deployment {
    /// The row label: `server, 2 worker processes` over an embedded store, `postgres, 2
    /// servers, 4 worker processes` over a database.
    pub fn label(&self) -> String {
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let workers = plural(self.workers, "worker process", "worker processes");
        match self.store {
            ServerStore::Embedded(engine) => format!("server over {engine}, {workers}"),
            ServerStore::Postgres { .. } => format!(
                "postgres, {}, {workers}",
                plural(self.servers, "server", "servers")
            ),
        }
    }
}

/// The quantile of the turns' durations whose turns `--stages` takes apart beside all: the
/// p99 of the table's rows.
pub const SLOW_TURNS_QUANTILE: f64 = 0.99;

/// What one measurement found.
#[derive(Debug, Clone)]
pub struct BenchResult {
    /// Where it ran: `embedded`, or a [`Deployment::label`].
    pub setup: String,
    /// Worker processes, through servers; `None` embedded.
    pub worker_processes: Option<usize>,
    /// Sessions in flight.
    pub sessions: usize,
    /// The model latency.
    pub model_latency_ms: u64,
    /// Turns completed in the measured time.
    pub turns: usize,
    /// Completed turns per second.
    pub turns_per_sec: f64,
    /// Median latency of a turn, ms.
    pub p50_ms: f64,
    /// 99th percentile latency of a turn, ms.
    pub p99_ms: f64,
    /// One fdatasync on the store's filesystem, probed just before and just after the
    /// measurement: the median of both runs, and of each apart.
    pub fdatasync: ProbedFdatasync,
    /// The store's durable commits in the measured time per completed turn (through servers,
    /// as their `/v1/health` counts them, summed); `None` when the store does not count them.
    /// At one session in flight these are the commits a turn waits for in series.
    pub commits_per_turn: Option<f64>,
    /// Median of the store's own syncs in the measured time ([`Store::sync_times`]), beside
    /// the probe's; through servers, the highest of the servers' medians over their lives
    /// (`/v1/health`); `None` when the store does not time them.
    pub store_sync_p50_ms: Option<f64>,
    /// The CPU time (user and system) the processes that serve the turns used in the measured
    /// time, per completed turn, ms: this process embedded (store, engine, workers and the
    /// bench's clients), the servers and workers through servers. `None` when no turn
    /// completed or `/proc` could not be read.
    pub cpu_ms_per_turn: Option<f64>,
    /// The steps between the marks on the turns' path in the measured window, when
    /// [`BenchConfig::stages`] asked for them (embedded); else empty.
    pub stages: Vec<Step>,
    /// The slowest 1% of the turns recorded with [`stages`](Self::stages) (at or above the
    /// p99), step by step beside all of them; `None` without stages or whole turns.
    pub slow_turns: Option<SlowTurns>,
}

impl BenchResult {
    /// This measurement's turns/s over `workers` × those of `one_worker` (the same setup with
    /// one worker process): 1.0 is linear scaling in worker processes.
    /// `None` embedded, and when the one-worker measurement completed no turn.
    pub fn scaling(&self, one_worker: &BenchResult) -> Option<f64> {
        let workers = self.worker_processes?;
        (one_worker.turns > 0)
            .then(|| self.turns_per_sec / (workers as f64 * one_worker.turns_per_sec))
    }

    /// The p50 turn over (commits per turn × the p50 fdatasync): how far one session's turn is
    /// from costing only the flushes it waits for in series. Only at one session in flight
    /// (with more, commits are shared and not in series), with zero model latency, and when
    /// the commits were counted.
    pub fn over_flushes(&self) -> Option<f64> {
        let commits = self.commits_per_turn?;
        let flushes_ms = commits * self.fdatasync.p50_ms;
        (self.sessions == 1 && self.model_latency_ms == 0 && self.turns > 0 && flushes_ms > 0.0)
            .then(|| self.p50_ms / flushes_ms)
    }

    /// One row of the report table, with the [`scaling`](Self::scaling) when known. Without
    /// a completed turn the latencies are `–`: the window was shorter than one turn.
    pub fn row(&self, scaling: Option<f64>) -> String {
        let shown = |value: Option<f64>, format: fn(f64) -> String| {
            value.map_or_else(|| "–".to_owned(), format)
        };
        let latency = |ms: f64| (self.turns > 0).then_some(ms);
        format!(
            "| {} | {} | {} ms | {:.0} turns/s | {} | {} | {} | {:.3} ms | {} | {} | {} | {} |",
            self.setup,
            self.sessions,
            self.model_latency_ms,
            self.turns_per_sec,
            shown(latency(self.p50_ms), |ms| format!("{ms:.2} ms")),
            shown(latency(self.p99_ms), |ms| format!("{ms:.2} ms")),
            shown(self.cpu_ms_per_turn, |ms| format!("{ms:.2} ms")),
            self.fdatasync.p50_ms,
            shown(self.store_sync_p50_ms, |ms| format!("{ms:.3} ms")),
            shown(self.commits_per_turn, |n| format!("{n:.2}")),
            shown(self.over_flushes(), |ratio| format!("{ratio:.2}")),
            shown(scaling, |ratio| format!("{ratio:.2}")),
        )
    }

    /// The header of the report table.
    pub fn header() -> &'static str {
        "| setup | sessions in flight | model latency | throughput | p50 turn | p99 turn | CPU per turn | p50 fdatasync | p50 store sync | durable commits per turn | p50 turn ÷ (commits × fdatasync) | turns/s ÷ (N × 1 worker's) |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    }
}

/// What serves a closed loop's turns, as its row names and measures it.
struct Served {
    /// The row's setup: `embedded, fjall`, or a [`Deployment::label`].
    setup: String,
    /// Worker processes, through servers; `None` embedded.
    worker_processes: Option<usize>,
    /// The store, when it is in this process: its commits and syncs are counted.
    store: Option<Arc<dyn Store>>,
    /// The servers, through servers: the commits of their stores are counted, as their
    /// `/v1/health` reports them, and added up.
    servers: Vec<cairn_remote::HttpTransport>,
    /// The processes whose CPU time is counted.
    serving: Vec<u32>,
    /// Where the probe runs: beside the store.
    probe_dir: PathBuf,
    /// The probe's fdatasync times beside the store, just before.
    probed_before: Vec<Duration>,
}

/// Tool calls at once in the README's workload: two.
pub const DEFAULT_PARALLEL_TOOLS: usize = 2;
/// The most tool calls at once `cairn bench --parallel-tools` takes.
pub const MAX_PARALLEL_TOOLS: usize = 64;

/// The tools a bench session offers: the built-in ones, and specs of tools never called
/// whose JSON adds up to at least `extra_bytes` (none for 0), each with a description of
/// about a kilobyte, as a coding agent's tools have.
pub fn bench_tools(extra_bytes: usize) -> Arc<[ToolSpec]> {
    let mut tools = ToolRegistry::builtin(".").specs();
    let mut added = 0;
    while added < extra_bytes {
        let n = tools.len();
        let spec = ToolSpec {
            name: format!("offered_{n}"),
            description: format!(
                "Tool {n}, offered to the model and never called in the bench. {}",
                "It stands for the long description a real agent's tool has. ".repeat(16)
            ),
            input_schema: cairn_ledger::JsonText::parse(
                r#"{"type":"object","properties":{"path":{"type":"string","description":"A path in the working directory."}},"required":["path"]}"#,
            )
            .unwrap_or_else(|_| unreachable!("a constant schema")),
        };
        added += serde_json::to_vec(&spec).map_or(0, |json| json.len() + 1);
        tools.push(spec);
    }
    tools.into()
}

/// The scripted session of `turns` turns, each `tools` parallel calculator calls, then an
/// answer. With two tools and one turn, the turn is the one every figure so far was measured
/// on, byte for byte; later turns' tool-use ids carry their turn, as a session's must differ.
fn script(latency_ms: u64, tools: usize, turns: usize) -> String {
    let turn = |turn: usize| {
        let calls = (1..=tools)
            .map(|i| {
                let expression = match i {
                    1 => "1+2".to_owned(),
                    2 => "3*4".to_owned(),
                    i => format!("{i}*{i}"),
                };
                let id = if turn == 1 {
                    format!("t{i}")
                } else {
                    format!("t{turn}_{i}")
                };
                format!(
                    r#"    {{"type": "tool_use", "id": "{id}", "name": "calculator", "input": {{"expression": "{expression}"}}}}"#
                )
            })
            .collect::<Vec<_>>()
            .join(",\n");
        format!(
            r#"  {{"delay_ms": {latency_ms}, "parts": [
{calls}]}},
  {{"delay_ms": {latency_ms}, "parts": [{{"type": "text", "text": "3 and 12"}}]}}"#
        )
    };
    let turns: Vec<String> = (1..=turns.max(1)).map(turn).collect();
    format!("{{\"responses\": [\n{}\n]}}", turns.join(",\n"))
}

/// Writes the script of a session of `turns` turns with `tools` parallel tool calls each
/// into `dir` and returns the model spec that reads it.
pub(crate) fn write_script(
    dir: &Path,
    latency_ms: u64,
    tools: usize,
    turns: usize,
) -> anyhow::Result<ModelSpec> {
    if !(1..=MAX_PARALLEL_TOOLS).contains(&tools) {
        anyhow::bail!(
            "{tools} parallel tool calls: the bench's turn asks for 1 to {MAX_PARALLEL_TOOLS}"
        );
    }
    let path = dir.join("bench-turn.json");
    std::fs::write(&path, script(latency_ms, tools, turns)).context("writing the bench script")?;
    ModelSpec::parse(&format!("scripted:{}", path.display())).context("the bench model spec")
}

/// The user message of a bench turn: `go`, or about `bytes` bytes of words (a fresh text
/// for each turn of a session, `turn` from 1).
pub fn bench_message(bytes: usize, turn: usize) -> String {
    if bytes == 0 {
        "go".to_owned()
    } else {
        crate::footprint::text(turn as u64 * 7 + 1, bytes)
    }
}

/// How long [`fdatasync_probe`] runs before each measurement.
const PROBE_TIME: Duration = Duration::from_millis(500);

/// The median time of one fdatasync in `dir`, in ms: an 8 KiB overwrite of a preallocated
/// file then `fdatasync`, repeated for `duration` (and at least 50 times), the file removed
/// afterwards. It is the flush a durable commit waits for, measured on the store's
/// filesystem under the load of the moment.
pub fn fdatasync_probe(dir: &Path, duration: Duration) -> anyhow::Result<f64> {
    Ok(median_ms(&fdatasync_probe_times(dir, duration)?))
}

/// The times of [`fdatasync_probe`]'s fdatasyncs, sorted.
pub fn fdatasync_probe_times(dir: &Path, duration: Duration) -> anyhow::Result<Vec<Duration>> {
    let path = dir.join("fdatasync-probe");
    let probe = || -> std::io::Result<Vec<Duration>> {
        let mut file = std::fs::File::create(&path)?;
        let block = vec![0x5au8; 8192];
        file.write_all(&block)?;
        file.sync_all()?;
        let mut times = Vec::new();
        let started = Instant::now();
        while times.len() < 50 || started.elapsed() < duration {
            let begin = Instant::now();
            file.write_all_at(&block, 0)?;
            file.sync_data()?;
            times.push(begin.elapsed());
        }
        Ok(times)
    };
    let probed = probe();
    let _ = std::fs::remove_file(&path);
    let mut times = probed.with_context(|| format!("the fdatasync probe in {}", dir.display()))?;
    times.sort();
    Ok(times)
}

/// The median of sorted times, in ms (`NaN` when there are none).
fn median_ms(sorted: &[Duration]) -> f64 {
    sorted
        .get(sorted.len() / 2)
        .map_or(f64::NAN, |median| median.as_secs_f64() * 1e3)
}

/// The fdatasync probe run on both sides of a measurement, the reference its ratios are taken
/// against. The disk's fdatasync drifts by tens of percent from one second to the next (seen on
/// a KVM disk: p50s of 0.13 and 0.18 ms a few seconds apart), so a probe run only before a
/// measurement of a few seconds can be far from what the measurement met; the median of both
/// runs is nearer, and the two runs apart show the drift.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbedFdatasync {
    /// The median over both runs, ms.
    pub p50_ms: f64,
    /// The median of the run just before, ms.
    pub before_p50_ms: f64,
    /// The median of the run just after, ms.
    pub after_p50_ms: f64,
}

impl ProbedFdatasync {
    /// The figures of the runs `before` and `after` (each sorted).
    pub fn of(before: &[Duration], after: &[Duration]) -> ProbedFdatasync {
        let mut both: Vec<Duration> = before.iter().chain(after).copied().collect();
        both.sort();
        ProbedFdatasync {
            p50_ms: median_ms(&both),
            before_p50_ms: median_ms(before),
            after_p50_ms: median_ms(after),
        }
    }

    /// `0.150 ms (0.140 before, 0.160 after)`.
    pub fn words(&self) -> String {
        format!(
            "{:.3} ms ({:.3} before, {:.3} after)",
            self.p50_ms, self.before_p50_ms, self.after_p50_ms
        )
    }
}

/// Runs the probe (for [`PROBE_TIME`]) off the async threads.
pub(crate) async fn probe_in(dir: &Path) -> anyhow::Result<Vec<Duration>> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || fdatasync_probe_times(&dir, PROBE_TIME))
        .await
        .context("the fdatasync probe panicked")?
}

/// Runs the closed loop, client `i` on `clients[i % clients.len()]`, and measures it;
/// `store`, when the store is in this process, counts its durable commits in the window.
///
/// Throughput counts the turns that ended in the measured window, wherever they began, so
/// that a long turn latency does not lower it (turns cut by either end of the window would
/// otherwise be missing); the latencies are those of the same turns.
async fn closed_loop(
    clients: &[Client],
    model: ModelSpec,
    config: &BenchConfig,
    served: Served,
) -> anyhow::Result<BenchResult> {
    let Served {
        setup,
        worker_processes,
        store,
        servers,
        serving,
        probe_dir,
        probed_before,
    } = served;
    if clients.is_empty() {
        bail!("no client to run the bench turns on");
    }
    let tools = bench_tools(config.tool_spec_bytes);
    let warmup = Duration::from_secs_f64(config.seconds / 10.0);
    let measured = Duration::from_secs_f64(config.seconds);
    let started = Instant::now();
    let measure_from = started + warmup;
    let measure_until = measure_from + measured;
    let record_stages = config.stages && store.is_some();
    // The store's commit counter and sync times, and the serving processes' CPU time, read at
    // both ends of the measured window; the marks of the turns' path recorded in it.
    let counters = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        let recording = record_stages.then(Recording::start);
        let first_cpu = total_cpu_seconds(&serving);
        let first = store
            .as_ref()
            .map(|store| (store.durable_commits(), store.sync_times()));
        let first_served = servers_commits(&servers).await;
        tokio::time::sleep_until(measure_until.into()).await;
        let steps = recording.map_or_else(
            || (Vec::new(), None),
            |recording| {
                let marks = recording.finish();
                (
                    stages::steps(&marks),
                    stages::slowest_turns(&marks, SLOW_TURNS_QUANTILE),
                )
            },
        );
        let cpu = match (first_cpu, total_cpu_seconds(&serving)) {
            (Ok(first), Ok(last)) => Some(last - first),
            (Err(e), _) | (_, Err(e)) => {
                warn!(error = %format!("{e:#}"), "no CPU figure for this row");
                None
            }
        };
        let Some((store, (first, first_times))) = store.zip(first) else {
            let last_served = servers_commits(&servers).await;
            let commits = first_served
                .zip(last_served.as_ref())
                .map(|(first, last)| last.commits - first.commits);
            let sync_p50_ms = last_served.map(|last| last.slowest_sync_p50_ms);
            return (commits, sync_p50_ms, cpu, steps);
        };
        let commits = store
            .durable_commits()
            .zip(first)
            .map(|(last, first)| last - first);
        let sync_p50_ms = store
            .sync_times()
            .zip(first_times)
            .and_then(|(last, first)| last.since(&first))
            .and_then(|times| times.quantile_ms(0.5));
        (commits, sync_p50_ms, cpu, steps)
    });
    let mut runners = Vec::new();
    for client_no in 0..config.sessions {
        let client = clients[client_no % clients.len()].clone();
        let model = model.clone();
        let tools = tools.clone();
        let (turns_per_session, message_bytes) =
            (config.turns_per_session.max(1), config.message_bytes);
        runners.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut n = 0u64;
            let mut session: Option<(String, usize)> = None;
            loop {
                let begin = Instant::now();
                if begin >= measure_until {
                    return Ok::<_, anyhow::Error>(latencies);
                }
                let outcome = match session.take() {
                    Some((id, turn)) => {
                        let outcome = client
                            .run_turn(&id, &bench_message(message_bytes, turn))
                            .await?;
                        if turn < turns_per_session {
                            session = Some((id, turn + 1));
                        }
                        outcome
                    }
                    None => {
                        n += 1;
                        let mut options = SessionOptions::new(model.clone(), tools.clone());
                        options.session_id = Some(format!("bench-{client_no}-{n}"));
                        let (id, outcome) = client
                            .start_session_and_run(options, &bench_message(message_bytes, 1))
                            .await?;
                        if turns_per_session > 1 {
                            session = Some((id, 2));
                        }
                        outcome
                    }
                };
                if !matches!(outcome, TurnOutcome::Completed { .. }) {
                    bail!("a bench turn did not complete: {outcome:?}");
                }
                let end = Instant::now();
                if end >= measure_from && end <= measure_until {
                    latencies.push(end.duration_since(begin));
                }
            }
        }));
    }
    let mut latencies = Vec::new();
    for runner in runners {
        latencies.extend(runner.await.context("a bench client panicked")??);
    }
    latencies.sort();
    let pick = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map(|d| d.as_secs_f64() * 1e3)
            .unwrap_or(f64::NAN)
    };
    let (commits, store_sync_p50_ms, cpu_seconds, (stages, slow_turns)) =
        counters.await.context("the commit counter panicked")?;
    // While the store (or its servers) is still up, as before the measurement.
    let fdatasync = ProbedFdatasync::of(&probed_before, &probe_in(&probe_dir).await?);
    Ok(BenchResult {
        setup,
        worker_processes,
        sessions: config.sessions,
        model_latency_ms: config.model_latency_ms,
        turns: latencies.len(),
        turns_per_sec: latencies.len() as f64 / measured.as_secs_f64(),
        p50_ms: pick(0.5),
        p99_ms: pick(0.99),
        fdatasync,
        commits_per_turn: commits
            .filter(|_| !latencies.is_empty())
            .map(|n| n as f64 / latencies.len() as f64),
        store_sync_p50_ms,
        cpu_ms_per_turn: cpu_seconds
            .filter(|_| !latencies.is_empty())
            .map(|seconds| seconds * 1e3 / latencies.len() as f64),
        stages,
        slow_turns,
    })
}

/// What the servers' stores report of their commits so far.
struct ServedCommits {
    /// Their durable commits, summed.
    commits: u64,
    /// The highest of their median syncs over their lives (on PostgreSQL, a commit's whole
    /// round trip), in milliseconds.
    slowest_sync_p50_ms: f64,
}

/// The durable commits of the servers' stores so far, summed, and their median syncs, as
/// their `/v1/health` reports them (on PostgreSQL each server counts and times the writes it
/// committed); `None` when a server does not report them or cannot be asked.
async fn servers_commits(servers: &[cairn_remote::HttpTransport]) -> Option<ServedCommits> {
    if servers.is_empty() {
        return None;
    }
    let mut served = ServedCommits {
        commits: 0,
        slowest_sync_p50_ms: 0.0,
    };
    for server in servers {
        let syncs = server.health().await.ok()?.store_syncs?;
        served.commits += syncs.durable_commits;
        served.slowest_sync_p50_ms = served
            .slowest_sync_p50_ms
            .max(syncs.sync_p50_us as f64 / 1e3);
    }
    Some(served)
}

/// Opens a new `engine` store at `path` as a restarted process finds it: created, closed and
/// opened again. A server spends most of its life on a store it reopened, and a reopened
/// store may sync dearer than a new one (fjall's recovered journal did, until cairn patched
/// it: `vendor/README.md`), so the embedded measurements run on one.
pub async fn open_restarted(
    path: &Path,
    engine: StorageEngine,
) -> anyhow::Result<embedded::OpenedStore> {
    drop(embedded::open(path, OpenMode::Create, Some(engine)).await?);
    Ok(embedded::open(path, OpenMode::Existing, Some(engine)).await?)
}

/// A measurement's scratch directory, with the bench's script written into it and the
/// fdatasync probe run there just before the measurement.
struct Prepared {
    dir: tempfile::TempDir,
    model: ModelSpec,
    probed_before: Vec<Duration>,
}

/// Makes a measurement's scratch directory for `config`: its script, then the probe.
async fn prepare(config: &BenchConfig) -> anyhow::Result<Prepared> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let model = write_script(
        dir.path(),
        config.model_latency_ms,
        config.parallel_tools,
        config.turns_per_session,
    )?;
    let probed_before = probe_in(dir.path()).await?;
    Ok(Prepared {
        dir,
        model,
        probed_before,
    })
}

/// Embedded: a new store of `engine`, reopened ([`open_restarted`]), the engine and a worker
/// pool with default settings in this process.
pub async fn embedded(config: &BenchConfig, engine: StorageEngine) -> anyhow::Result<BenchResult> {
    let Prepared {
        dir,
        model,
        probed_before,
    } = prepare(config).await?;
    let setup = format!("embedded, {engine}");
    let opened = open_restarted(&dir.path().join("store"), engine).await?;
    let engine = Engine::new(opened.store.clone(), Arc::new(SystemClock));
    let pool = WorkerPool::start(
        engine.clone(),
        Activities {
            models: Arc::new(StandardModels::new()),
            tools: Arc::new(ToolRegistry::builtin(dir.path())),
        },
        WorkerConfig::default(),
    );
    let served = Served {
        setup,
        worker_processes: None,
        store: Some(opened.store.clone()),
        servers: Vec::new(),
        serving: vec![std::process::id()],
        probe_dir: dir.path().to_path_buf(),
        probed_before,
    };
    let result = closed_loop(&[Client::new(engine)], model, config, served).await;
    pool.shutdown().await;
    result
}

/// Through servers: the `cairn server` and `cairn worker` processes of `deployment`, started
/// from `exe`, the turns driven by the clients `connect` makes for the servers' URLs. A
/// database store is a scratch database, dropped afterwards.
pub async fn through_servers(
    exe: &Path,
    deployment: &Deployment,
    config: &BenchConfig,
    connect: impl Fn(&str) -> anyhow::Result<Client>,
) -> anyhow::Result<BenchResult> {
    let database = match &deployment.store {
        ServerStore::Embedded(_) => None,
        ServerStore::Postgres { server_url } => Some(ScratchDatabase::create(server_url).await?),
    };
    let result = run_deployment(
        exe,
        deployment,
        database.as_ref().map(ScratchDatabase::url),
        config,
        connect,
    )
    .await;
    if let Some(database) = database {
        let name = database.name().to_owned();
        if let Err(e) = database.drop_database().await {
            warn!(database = %name, error = %e, "cannot drop a bench database; it was left behind");
        }
    }
    result
}

/// Starts the processes (every one of them killed when this returns) and measures.
async fn run_deployment(
    exe: &Path,
    deployment: &Deployment,
    database_url: Option<&str>,
    config: &BenchConfig,
    connect: impl Fn(&str) -> anyhow::Result<Client>,
) -> anyhow::Result<BenchResult> {
    if deployment.servers == 0 {
        bail!("no server to measure through");
    }
    let Prepared {
        dir,
        model,
        probed_before,
    } = prepare(config).await?;
    let store_args: Vec<String> = match (&deployment.store, database_url) {
        (ServerStore::Embedded(engine), _) => {
            if deployment.servers != 1 {
                bail!(
                    "an embedded store is held by one server; {} servers need a database store (--store)",
                    deployment.servers
                );
            }
            // Created and closed here, so that the server opens it again, as a restarted
            // server does (as the embedded rows do: [`open_restarted`]).
            drop(embedded::open(&dir.path().join("store"), OpenMode::Create, Some(*engine)).await?);
            vec![
                "--data".into(),
                dir.path().join("store").display().to_string(),
                "--engine".into(),
                engine.to_string(),
            ]
        }
        (ServerStore::Postgres { .. }, Some(url)) => vec!["--store".into(), url.to_owned()],
        (ServerStore::Postgres { .. }, None) => bail!("no scratch database for the servers"),
    };
    // Every process is SIGKILLed when dropped, also on an early return.
    let mut servers: Vec<Process> = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..deployment.servers {
        let mut args: Vec<String> = vec!["server".into()];
        args.extend(store_args.iter().cloned());
        args.extend(["--listen".into(), "127.0.0.1:0".into()]);
        // Their notes would break the table; a child that fails says so by exiting early.
        let (server, url) = start_and_wait(exe, &args, "listening on", Stdio::null())?;
        servers.push(server);
        urls.push(url);
    }
    let per_worker = config.worker_concurrency.max(1);
    let mut workers = Vec::new();
    for worker_no in 0..deployment.workers {
        let (worker, _) = start_and_wait(
            exe,
            &[
                "worker".into(),
                "--server".into(),
                urls[worker_no % urls.len()].clone(),
                "--concurrency".into(),
                per_worker.to_string(),
                "--workdir".into(),
                dir.path().display().to_string(),
            ],
            "worker ready",
            Stdio::null(),
        )?;
        workers.push(worker);
    }
    let clients = urls
        .iter()
        .map(|url| connect(url))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let serving = servers
        .iter()
        .chain(&workers)
        .map(|process| process.child.id())
        .collect();
    let served = Served {
        setup: deployment.label(),
        worker_processes: Some(deployment.workers),
        store: None,
        servers: urls
            .iter()
            .map(|url| cairn_remote::HttpTransport::new(url, None))
            .collect::<Result<_, _>>()?,
        serving,
        probe_dir: dir.path().to_path_buf(),
        probed_before,
    };
    let result = closed_loop(&clients, model, config, served).await;
    // Workers first, so that none of them sees its server go and retries against it.
    drop(workers);
    drop(servers);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(sessions: usize, commits_per_turn: Option<f64>) -> BenchResult {
        BenchResult {
            setup: "embedded, fjall".into(),
            worker_processes: None,
            sessions,
            model_latency_ms: 0,
            turns: 100,
            turns_per_sec: 10.0,
            p50_ms: 3.0,
            p99_ms: 5.0,
            fdatasync: ProbedFdatasync {
                p50_ms: 0.25,
                before_p50_ms: 0.24,
                after_p50_ms: 0.26,
            },
            commits_per_turn,
            store_sync_p50_ms: Some(0.3),
            cpu_ms_per_turn: Some(0.75),
            stages: Vec::new(),
            slow_turns: None,
        }
    }

    #[test]
    fn one_session_rows_show_the_turn_over_its_flushes() {
        let one = result(1, Some(6.0));
        assert_eq!(one.over_flushes(), Some(2.0));
        assert_eq!(
            one.row(None),
            "| embedded, fjall | 1 | 0 ms | 10 turns/s | 3.00 ms | 5.00 ms | 0.75 ms | 0.250 ms | 0.300 ms | 6.00 | 2.00 | – |"
        );
        let untimed = BenchResult {
            store_sync_p50_ms: None,
            ..result(1, Some(6.0))
        };
        assert!(untimed.row(None).contains("| 0.250 ms | – | 6.00 |"));
        // Commits are shared, not in series, with more sessions; unknown through servers.
        assert_eq!(result(16, Some(0.5)).over_flushes(), None);
        assert_eq!(result(1, None).over_flushes(), None);
        let header_columns = BenchResult::header()
            .lines()
            .next()
            .unwrap()
            .matches('|')
            .count();
        assert_eq!(one.row(None).matches('|').count(), header_columns);
    }

    #[test]
    fn the_probe_times_real_flushes_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let p50_ms = fdatasync_probe(dir.path(), Duration::ZERO).unwrap();
        assert!(p50_ms > 0.0 && p50_ms < 1_000.0, "{p50_ms} ms");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let missing = fdatasync_probe(&dir.path().join("missing"), Duration::ZERO);
        assert!(format!("{:#}", missing.unwrap_err()).contains("fdatasync probe"));
    }

    #[test]
    fn the_reference_fdatasync_is_the_median_of_the_runs_before_and_after() {
        let us = |values: &[u64]| -> Vec<Duration> {
            values.iter().map(|&v| Duration::from_micros(v)).collect()
        };
        // The disk slowed down during the measurement: the run after is slower throughout.
        let probed = ProbedFdatasync::of(&us(&[100, 110, 120]), &us(&[150, 160, 170, 180]));
        assert_eq!(probed.before_p50_ms, 0.11);
        assert_eq!(probed.after_p50_ms, 0.17);
        assert_eq!(probed.p50_ms, 0.15);
        assert_eq!(probed.words(), "0.150 ms (0.110 before, 0.170 after)");
        let none = ProbedFdatasync::of(&[], &[]);
        assert!(none.p50_ms.is_nan());
    }

    /// The turn's script asks for `tools` calls at once with distinct ids, then answers; with
    /// the default two, it is the turn every figure so far was measured on.
    #[test]
    fn the_script_asks_for_as_many_parallel_calls_as_given() {
        for tools in [1, 2, 5, MAX_PARALLEL_TOOLS] {
            let script: serde_json::Value =
                serde_json::from_str(&script(7, tools, 1)).expect("the script is JSON");
            let responses = script["responses"].as_array().expect("responses");
            assert_eq!(responses.len(), 2);
            assert_eq!(responses[0]["delay_ms"], 7);
            let parts = responses[0]["parts"].as_array().expect("parts");
            assert_eq!(parts.len(), tools);
            let ids: std::collections::BTreeSet<&str> = parts
                .iter()
                .map(|p| {
                    assert_eq!(p["type"], "tool_use");
                    assert_eq!(p["name"], "calculator");
                    p["id"].as_str().expect("an id")
                })
                .collect();
            assert_eq!(ids.len(), tools, "ids repeat: {ids:?}");
            assert_eq!(responses[1]["parts"][0]["text"], "3 and 12");
        }
        let two: serde_json::Value = serde_json::from_str(&script(0, 2, 1)).expect("JSON");
        assert_eq!(
            two["responses"][0]["parts"],
            serde_json::json!([
                {"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "1+2"}},
                {"type": "tool_use", "id": "t2", "name": "calculator", "input": {"expression": "3*4"}}
            ])
        );
        let dir = tempfile::tempdir().expect("tempdir");
        for tools in [0, MAX_PARALLEL_TOOLS + 1] {
            let refused = write_script(dir.path(), 0, tools, 1).expect_err("out of range");
            assert!(refused.to_string().contains("1 to 64"), "{refused}");
        }
    }

    /// A session of several turns: each turn the same calls and answer, the tool-use ids
    /// distinct across the session; a message of the bytes asked for, another each turn.
    #[test]
    fn a_long_session_s_script_and_messages() {
        let script: serde_json::Value =
            serde_json::from_str(&script(0, 2, 3)).expect("the script is JSON");
        let responses = script["responses"].as_array().expect("responses");
        assert_eq!(responses.len(), 6);
        let ids: std::collections::BTreeSet<&str> = responses
            .iter()
            .step_by(2)
            .flat_map(|r| r["parts"].as_array().expect("parts"))
            .map(|p| p["id"].as_str().expect("an id"))
            .collect();
        assert_eq!(ids.len(), 6, "{ids:?}");
        assert!(ids.contains("t1") && ids.contains("t3_2"), "{ids:?}");
        for answer in responses.iter().skip(1).step_by(2) {
            assert_eq!(answer["parts"][0]["text"], "3 and 12");
        }
        assert_eq!(bench_message(0, 5), "go");
        let message = bench_message(2_000, 2);
        assert!((2_000..2_100).contains(&message.len()), "{}", message.len());
        assert_ne!(message, bench_message(2_000, 3));
    }

    #[test]
    fn offered_tools_add_the_bytes_asked_for() {
        let json_len = |tools: &[ToolSpec]| serde_json::to_vec(tools).expect("json").len();
        let builtin = bench_tools(0);
        assert_eq!(builtin.len(), ToolRegistry::builtin(".").specs().len());
        let offered = bench_tools(20_000);
        let added = json_len(&offered) - json_len(&builtin);
        assert!((20_000..22_000).contains(&added), "{added} bytes added");
        let names: std::collections::BTreeSet<&str> =
            offered.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names.len(), offered.len(), "names repeat");
        assert!(offered.iter().any(|t| t.name == "calculator"));
    }
}
