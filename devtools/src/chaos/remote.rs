//! The parent of a chaos run with remote workers ([`ChaosConfig::remote_workers`]): one
//! server child at a time on a fixed loopback port, N worker processes beside it, and the
//! kills falling on either. The protocol, the kill moments and the checks are in the module
//! doc of [`super`], "Remote workers".

use super::child::wall_ms;
use super::{
    absorb, extend_turns, mean, parse_child_line, read_child_lines, tail, verify, Acks,
    ChaosConfig, ChaosReport, ChildOutput, ChildRun, End, Explanations, ServeOptions, SplitMix64,
    FINAL_RUN_TIMEOUT, STARTUP_KILL_ONE_IN, STDERR_TAIL_LINES,
};
use anyhow::{anyhow, bail, Context};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The chaos workers' lease. Short, so that the lease of a killed worker lapses (and its
/// attempt is retried) soon; long enough that a worker that lives renews it (every third of
/// it) with a wide margin on a loaded machine.
pub const LEASE_MS: u64 = 1_500;
/// A chaos worker's long poll for tasks: as long as `cairn worker`'s, since it also decided
/// how long a worker paused after a failed lease request, until that pause was capped.
pub(super) const WORKER_POLL_MS: u64 = 5_000;
/// Attempts allowed per activity beyond one per kill of the run: only a kill fails an
/// attempt (its worker's lease lapses, or the server is down until it does), so a turn that
/// still fails had attempts fail for no kill.
const EXTRA_ATTEMPTS: u32 = 5;
/// One server kill in this many is an outage: the server stays down longer than a lease, so
/// that the leases its workers hold lapse while it is down (their reports, retried until
/// then, are lost) and the next server's timers record them.
const OUTAGE_ONE_IN: u64 = 3;
/// An outage lasts a lease and up to this much more.
const OUTAGE_SPREAD_MS: u64 = 500;
/// How long a worker asked to stop (its stdin closed) may take to drain and exit.
const WORKER_STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the parent looks at its processes while it waits for the next kill.
const WATCH_INTERVAL: Duration = Duration::from_millis(5);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A `cairn chaos-child --serve PORT` process: the engine, the `/v1` API, the drivers.
struct ServerChild {
    child: Child,
    spawned: Instant,
    /// Its protocol lines so far, taken in by a thread as they come.
    output: Arc<Mutex<ChildOutput>>,
    reader: JoinHandle<()>,
    errors: JoinHandle<String>,
    /// Kept open: the child exits when it closes (the parent died without killing it).
    _stdin: Option<ChildStdin>,
}

impl ServerChild {
    fn start(
        config: &ChaosConfig,
        exe: &Path,
        turns: usize,
        serve: ServeOptions,
    ) -> anyhow::Result<Self> {
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
            .arg("--serve")
            .arg(serve.port.to_string())
            .arg("--max-attempts")
            .arg(serve.max_attempts.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let stderr = child.stderr.take().context("child stderr")?;
        let output = Arc::new(Mutex::new(ChildOutput::default()));
        let reader = {
            let output = output.clone();
            std::thread::spawn(move || {
                read_child_lines(stdout, |line| {
                    parse_child_line(line, spawned, &mut lock(&output));
                });
            })
        };
        let errors = std::thread::spawn(move || tail(stderr, STDERR_TAIL_LINES));
        Ok(ServerChild {
            _stdin: child.stdin.take(),
            child,
            spawned,
            output,
            reader,
            errors,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// When it said `ready` (store open, resumed, listening), if it has.
    fn ready_at(&self) -> Option<Instant> {
        lock(&self.output)
            .ready
            .as_ref()
            .map(|r| self.spawned + r.after)
    }

    /// SIGKILLs it (a no-op when it has just exited by itself) and reaps it.
    fn kill(mut self) -> anyhow::Result<ChildRun> {
        let _ = self.child.kill();
        let status = self.child.wait().context("cannot reap the chaos server")?;
        let end = if super::killed(&status) {
            End::Killed
        } else {
            End::Exited(status)
        };
        self.ended(end)
    }

    /// Its run, once it has ended.
    fn ended(self, end: End) -> anyhow::Result<ChildRun> {
        let pid = self.child.id();
        self.reader
            .join()
            .map_err(|_| anyhow!("the chaos server's stdout reader panicked"))?;
        let stderr_tail = self
            .errors
            .join()
            .map_err(|_| anyhow!("the chaos server's stderr reader panicked"))?;
        let output = std::mem::take(&mut *lock(&self.output));
        Ok(ChildRun {
            pid,
            end,
            output,
            stderr_tail,
        })
    }
}

/// A `cairn chaos-worker` process.
struct WorkerChild {
    child: Child,
    /// Closing it asks the worker to drain and exit.
    stdin: Option<ChildStdin>,
    errors: JoinHandle<String>,
}

impl WorkerChild {
    fn start(exe: &Path, url: &str, data: &Path) -> anyhow::Result<Self> {
        let mut child = Command::new(exe)
            .arg("chaos-worker")
            .arg("--server")
            .arg(url)
            .arg("--data")
            .arg(data)
            .arg("--lease-ms")
            .arg(LEASE_MS.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        let stderr = child.stderr.take().context("worker stderr")?;
        let errors = std::thread::spawn(move || tail(stderr, STDERR_TAIL_LINES));
        Ok(WorkerChild {
            stdin: child.stdin.take(),
            child,
            errors,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stderr_tail(self) -> String {
        self.errors
            .join()
            .unwrap_or_else(|_| "(the stderr reader panicked)".to_owned())
    }

    /// SIGKILLs it and reaps it; `Err` when it had exited by itself.
    fn kill(mut self) -> anyhow::Result<()> {
        let _ = self.child.kill();
        let status = self.child.wait().context("cannot reap a chaos worker")?;
        if !super::killed(&status) {
            let pid = self.pid();
            bail!(
                "chaos worker {pid} exited by itself ({status}); its stderr ends:\n{}",
                self.stderr_tail()
            );
        }
        Ok(())
    }

    /// Closes its stdin and waits for it to drain and exit 0.
    fn stop(mut self) -> anyhow::Result<()> {
        drop(self.stdin.take());
        let pid = self.pid();
        match super::wait_or_kill(&mut self.child, WORKER_STOP_TIMEOUT)? {
            End::Exited(status) if status.success() => Ok(()),
            End::TimedOut => bail!(
                "chaos worker {pid} did not stop within {} s of being asked; its stderr ends:\n{}",
                WORKER_STOP_TIMEOUT.as_secs(),
                self.stderr_tail()
            ),
            other => bail!(
                "chaos worker {pid} stopped with {other:?}; its stderr ends:\n{}",
                self.stderr_tail()
            ),
        }
    }
}

/// A free loopback port, chosen once: every server child of the run listens on it.
fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .context("cannot find a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

/// One kill's seeded plan: drawn whole whatever the state of the run, so that a seed gives
/// the same plans.
struct KillPlan {
    /// The server (else a worker)...
    server: bool,
    /// ...this one.
    worker: usize,
    /// A server that is still starting is killed during its startup...
    during_startup: bool,
    /// ...at this fraction of the estimated start-to-ready time.
    startup_fraction: f64,
    /// Otherwise this long after the previous kill (and after the server is ready).
    after: Duration,
    /// A server stays down this long before it is restarted, if at all.
    outage: Option<Duration>,
}

impl KillPlan {
    fn draw(rng: &mut SplitMix64, workers: usize, kill_after_ms: (u64, u64)) -> Self {
        let (lo, hi) = kill_after_ms;
        KillPlan {
            server: rng.below(2) == 0,
            worker: rng.below(workers as u64) as usize,
            during_startup: rng.below(STARTUP_KILL_ONE_IN) == 0,
            startup_fraction: rng.below(1_001) as f64 / 1_000.0,
            after: Duration::from_millis(lo + rng.below(hi - lo + 1)),
            outage: {
                let outage = rng.below(OUTAGE_ONE_IN) == 0;
                let ms = LEASE_MS + rng.below(OUTAGE_SPREAD_MS + 1);
                outage.then(|| Duration::from_millis(ms))
            },
        }
    }
}

/// A remote-mode run: its processes (killed when it is dropped, whatever happened) and what
/// it gathered.
struct Run<'a> {
    config: &'a ChaosConfig,
    exe: &'a Path,
    url: String,
    serve: ServeOptions,
    report: ChaosReport,
    acks: Acks,
    ready_ms: Vec<f64>,
    /// An exponentially weighted mean of the server children's start-to-ready times.
    ready_estimate: Duration,
    explanations: Explanations,
    server: Option<ServerChild>,
    workers: Vec<WorkerChild>,
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        // Only after a failure does anything still run here; the data directory is kept.
        if let Some(mut server) = self.server.take() {
            let _ = server.child.kill();
            let _ = server.child.wait();
        }
        for mut worker in self.workers.drain(..) {
            let _ = worker.child.kill();
            let _ = worker.child.wait();
        }
    }
}

/// Runs the chaos test with `config.remote_workers` worker processes; see [`super::run_chaos`].
pub(super) fn run(
    config: &ChaosConfig,
    exe: &Path,
    started: Instant,
) -> anyhow::Result<ChaosReport> {
    if config.startup_kills > 0 || config.power_cuts > 0 || config.check_each_fault {
        bail!(
            "startup kills, power cuts and checks after each fault run only without remote \
             workers"
        );
    }
    let port = free_port()?;
    let mut run = Run {
        config,
        exe,
        url: format!("http://127.0.0.1:{port}"),
        serve: ServeOptions {
            port,
            max_attempts: u32::try_from(config.kills)
                .unwrap_or(u32::MAX)
                .saturating_add(EXTRA_ATTEMPTS),
        },
        report: ChaosReport {
            seed: config.seed,
            sessions: config.sessions,
            turns_per_session: config.turns_per_session,
            remote_workers: config.remote_workers,
            ..ChaosReport::default()
        },
        acks: Acks::default(),
        ready_ms: Vec::new(),
        ready_estimate: Duration::ZERO,
        explanations: Explanations {
            lease_ms: LEASE_MS,
            ..Explanations::default()
        },
        server: None,
        workers: Vec::new(),
    };
    super::write_script(&config.data, config.turns_per_session, config.seed)?;
    run.start_server()?;
    run.wait_first_ready()?;
    run.start_workers()?;
    run.kill_phase()?;
    run.report.kill_phase = started.elapsed();
    run.final_run()?;
    run.report.mean_ready_ms = mean(&run.ready_ms);
    let mut report = std::mem::take(&mut run.report);
    verify(config, &run.acks, &run.explanations, &mut report)?;
    report.wall_time = started.elapsed();
    Ok(report)
}

impl Run<'_> {
    fn start_server(&mut self) -> anyhow::Result<()> {
        let server = ServerChild::start(
            self.config,
            self.exe,
            self.report.turns_per_session,
            self.serve,
        )?;
        self.server = Some(server);
        self.report.child_runs += 1;
        Ok(())
    }

    fn server(&self) -> anyhow::Result<&ServerChild> {
        self.server.as_ref().context("no chaos server is running")
    }

    fn start_workers(&mut self) -> anyhow::Result<()> {
        for _ in 0..self.config.remote_workers {
            let worker = WorkerChild::start(self.exe, &self.url, &self.config.data)?;
            self.workers.push(worker);
            self.report.worker_starts += 1;
        }
        Ok(())
    }

    /// Stops every worker gently (between workloads, when nothing is leased).
    fn stop_workers(&mut self) -> anyhow::Result<()> {
        for worker in std::mem::take(&mut self.workers) {
            worker.stop()?;
        }
        Ok(())
    }

    /// Takes in a server child's run once it ended.
    fn absorb_server(&mut self, run: &ChildRun) {
        absorb(&mut self.report, &mut self.acks, &mut self.ready_ms, run);
        if let Some(ready) = &run.output.ready {
            self.ready_estimate = if self.ready_estimate.is_zero() {
                ready.after
            } else {
                self.ready_estimate.mul_f64(0.7) + ready.after.mul_f64(0.3)
            };
        }
    }

    /// Waits for the first server to be ready, so that the workers do not start by backing off.
    fn wait_first_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + FINAL_RUN_TIMEOUT;
        while self.server()?.ready_at().is_none() {
            if let Some(run) = self.watch()? {
                bail!(
                    "the first chaos server ended with {:?} before it was ready (seed {}); its \
                     stderr ends:\n{}",
                    run.end,
                    self.config.seed,
                    run.stderr_tail
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "the first chaos server was not ready within {} s",
                    FINAL_RUN_TIMEOUT.as_secs()
                );
            }
            std::thread::sleep(WATCH_INTERVAL);
        }
        let ready = self.server()?.ready_at().unwrap_or_else(Instant::now);
        self.ready_estimate = ready - self.server()?.spawned;
        Ok(())
    }

    /// Looks at the processes once: the server's run when it has exited by itself; `Err`
    /// when a worker did (nothing stops them but the parent).
    fn watch(&mut self) -> anyhow::Result<Option<ChildRun>> {
        for i in 0..self.workers.len() {
            if let Some(status) = self.workers[i]
                .child
                .try_wait()
                .context("cannot poll a chaos worker")?
            {
                let worker = self.workers.remove(i);
                bail!(
                    "chaos worker {} exited by itself ({status}; seed {}); its stderr ends:\n{}",
                    worker.pid(),
                    self.config.seed,
                    worker.stderr_tail()
                );
            }
        }
        let Some(server) = self.server.as_mut() else {
            return Ok(None);
        };
        match server
            .child
            .try_wait()
            .context("cannot poll the chaos server")?
        {
            None => Ok(None),
            Some(status) => {
                let server = self.server.take().context("the chaos server")?;
                Ok(Some(server.ended(End::Exited(status))?))
            }
        }
    }

    /// Waits until `moment`: `None` then, or the server's run as soon as it exits by itself.
    fn wait_until(&mut self, moment: Instant) -> anyhow::Result<Option<ChildRun>> {
        loop {
            if let Some(run) = self.watch()? {
                return Ok(Some(run));
            }
            let now = Instant::now();
            if now >= moment {
                return Ok(None);
            }
            std::thread::sleep(WATCH_INTERVAL.min(moment - now));
        }
    }

    /// The server exited by itself during the kills: the sessions finished their turns
    /// (then turns are added, and the workers, which loaded the script, restart with the
    /// server), else the harness cannot go on.
    fn server_exited(&mut self, run: ChildRun, kills_done: usize) -> anyhow::Result<()> {
        self.absorb_server(&run);
        match run.end {
            End::Exited(status) if status.success() && run.output.done => {
                self.report.early_exits += 1;
                self.stop_workers()?;
                extend_turns(self.config, &mut self.report, self.config.kills, kills_done)?;
                self.start_server()?;
                self.start_workers()
            }
            end => bail!(
                "chaos server child {} ended with {end:?} by itself (seed {}); its stderr \
                 ends:\n{}",
                self.report.child_runs,
                self.config.seed,
                run.stderr_tail
            ),
        }
    }

    /// Delivers `config.kills` SIGKILLs, each to the server or a worker, and restarts the
    /// victim at once.
    fn kill_phase(&mut self) -> anyhow::Result<()> {
        let mut rng = SplitMix64(self.config.seed);
        let mut last_kill = Instant::now();
        while self.report.kills < self.config.kills {
            let plan = KillPlan::draw(
                &mut rng,
                self.config.remote_workers,
                self.config.kill_after_ms,
            );
            // Both kinds of victim in every run: the last kill goes to a kind not yet killed.
            let server_kills = self.report.kills - self.report.worker_kills;
            let last = self.report.kills + 1 == self.config.kills;
            let at_server = if last && server_kills == 0 {
                true
            } else if last && self.report.worker_kills == 0 {
                false
            } else {
                plan.server
            };
            let moment = {
                let server = self.server()?;
                match server.ready_at() {
                    None if at_server && plan.during_startup => {
                        server.spawned + self.ready_estimate.mul_f64(plan.startup_fraction)
                    }
                    None if at_server => {
                        last_kill.max(server.spawned + self.ready_estimate) + plan.after
                    }
                    Some(ready) if at_server => last_kill.max(ready) + plan.after,
                    _ => last_kill + plan.after,
                }
            };
            if let Some(run) = self.wait_until(moment)? {
                self.server_exited(run, self.report.kills)?;
                last_kill = Instant::now();
                continue;
            }
            if at_server {
                let server = self.server.take().context("the chaos server")?;
                let pid = server.pid();
                let killed_at_ms = wall_ms();
                let run = server.kill()?;
                if !matches!(run.end, End::Killed) {
                    // It exited just before the kill: no kill.
                    self.server_exited(run, self.report.kills)?;
                    last_kill = Instant::now();
                    continue;
                }
                self.report.kills += 1;
                self.report.kills_before_ready += usize::from(run.output.ready.is_none());
                self.explanations.killed_pids.insert(pid);
                self.explanations.server_kills_ms.push(killed_at_ms);
                self.absorb_server(&run);
                if let Some(outage) = plan.outage {
                    self.report.server_outages += 1;
                    // No server to exit by itself: only the workers are watched.
                    self.wait_until(Instant::now() + outage)?;
                }
                self.start_server()?;
            } else {
                let worker = self.workers.remove(plan.worker);
                self.explanations.killed_pids.insert(worker.pid());
                worker.kill()?;
                self.report.kills += 1;
                self.report.worker_kills += 1;
                let restarted = WorkerChild::start(self.exe, &self.url, &self.config.data)?;
                self.workers.insert(plan.worker, restarted);
                self.report.worker_starts += 1;
            }
            last_kill = Instant::now();
        }
        Ok(())
    }

    /// The kills are spent: the server running now finishes the work, unkilled, and stops;
    /// then the workers are stopped (drained).
    fn final_run(&mut self) -> anyhow::Result<()> {
        let final_started = Instant::now();
        let deadline = final_started + FINAL_RUN_TIMEOUT;
        let run = match self.wait_until(deadline)? {
            Some(run) => run,
            None => {
                let server = self.server.take().context("the chaos server")?;
                let run = server.kill()?;
                bail!(
                    "the final chaos server did not finish within {} s (seed {}); its stderr \
                     ends:\n{}",
                    FINAL_RUN_TIMEOUT.as_secs(),
                    self.config.seed,
                    run.stderr_tail
                );
            }
        };
        self.absorb_server(&run);
        self.report.final_run = final_started.elapsed();
        match run.end {
            End::Exited(status) if status.success() && run.output.done => {}
            other => bail!(
                "the final chaos server ended with {other:?} (seed {}); its stderr ends:\n{}",
                self.config.seed,
                run.stderr_tail
            ),
        }
        self.stop_workers()
    }
}
