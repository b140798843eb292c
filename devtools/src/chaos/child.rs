//! The processes the parent starts and kills: the child (`cairn chaos-child`), which drives the
//! sessions and prints its protocol lines and acks, and the remote workers (`cairn chaos-worker`),
//! with the side-effect tool both run.

use super::{
    record, remote, session_id, StoreEngine, SCRIPT_FILE, SIDE_EFFECTS_FILE, SIDE_EFFECT_TOOL,
    STORE_DIR,
};
use anyhow::{anyhow, bail, Context};
use async_trait::async_trait;
use cairn_activities::{ActivityContext, Tool, ToolCall, ToolOutput, ToolRegistry};
use cairn_ledger::{JsonText, ModelSpec, ToolSpec, Transcript};
use cairn_runtime::store::embedded::{self, OpenMode};
use cairn_runtime::{
    Client, Engine, Error as RuntimeError, RetryPolicy, SessionOptions, SessionState, SystemClock,
    TurnOutcome,
};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use serde::Deserialize;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long the side-effect tool works after writing its record.
const TOOL_WORK_MS: u64 = 3;
/// How often the child samples every session's state for acks, besides its turn boundaries.
const ACK_POLL_MS: u64 = 15;

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
pub(super) fn ledger_fingerprint(transcript: &Transcript) -> u64 {
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
pub(super) fn wall_ms() -> u64 {
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
