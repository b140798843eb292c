//! Crash test of the durable stores, sled and fjall, each in its own test: a child process
//! appends from several concurrent writers and is killed with SIGKILL at random moments; after each kill the store must open, every session's
//! history must be seqs 1..=n that decode, and every append the child saw acknowledged must be
//! there, at its seq, with its content.
//!
//! The child is this test binary itself, re-executed to run only [`crash_child_writer`], with
//! the store directory in `CAIRN_CRASH_CHILD_DIR` and the engine in `CAIRN_CRASH_CHILD_ENGINE`. It prints `ack <session> <seq> <tag>` for
//! every event of an acknowledged append, where `<tag>` is unique to that event. The data
//! directory is kept across trials, so each trial also tests reopening after a kill, and the
//! children continue the sessions from where the store is.
//!
//! A SIGKILL loses what is in the process, not what is in the kernel's page cache: this checks
//! that the engine recovers and that nothing is acknowledged before it is written and flushed,
//! not the fsyncs against power loss (see the durability notes of `cairn_runtime::store::sled`
//! and `cairn_runtime::store::fjall`).
//!
//! The seed is printed; rerun a failure with `CAIRN_CRASH_SEED=<seed>`; `CAIRN_CRASH_TRIALS`
//! changes the number of trials per engine (50).
#![cfg(unix)]

use cairn_runtime::store::fjall::FjallStore;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::{
    AppendRequest, Error, Event, EventEnvelope, NewTask, SessionStatus, Store, TaskId, TaskKind,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CHILD_DIR_ENV: &str = "CAIRN_CRASH_CHILD_DIR";
const CHILD_SEED_ENV: &str = "CAIRN_CRASH_CHILD_SEED";
const CHILD_ENGINE_ENV: &str = "CAIRN_CRASH_CHILD_ENGINE";
const SEED_ENV: &str = "CAIRN_CRASH_SEED";
const TRIALS_ENV: &str = "CAIRN_CRASH_TRIALS";
const DEFAULT_TRIALS: u64 = 50;
const SESSIONS: usize = 3;
const WRITERS_PER_SESSION: usize = 2;

/// An acknowledged event: its seq and unique tag.
type Acks = BTreeMap<String, BTreeMap<u64, String>>;

/// The store engines under test.
#[derive(Debug, Clone, Copy)]
enum Engine {
    Sled,
    Fjall,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Sled => "sled",
            Engine::Fjall => "fjall",
        }
    }

    fn from_name(name: &str) -> Option<Engine> {
        [Engine::Sled, Engine::Fjall]
            .into_iter()
            .find(|e| e.name() == name)
    }

    /// A file the engine writes when it creates a store: without it, nothing was stored yet.
    fn marker_file(self) -> &'static str {
        match self {
            Engine::Sled => "db",
            Engine::Fjall => "version",
        }
    }

    fn open(self, dir: &Path) -> cairn_runtime::Result<Arc<dyn Store>> {
        Ok(match self {
            Engine::Sled => Arc::new(SledStore::open(dir)?),
            Engine::Fjall => Arc::new(FjallStore::open(dir)?),
        })
    }

    fn open_existing(self, dir: &Path) -> cairn_runtime::Result<Arc<dyn Store>> {
        Ok(match self {
            Engine::Sled => Arc::new(SledStore::open_existing(dir)?),
            Engine::Fjall => Arc::new(FjallStore::open_existing(dir)?),
        })
    }
}

#[test]
fn sled_store_keeps_every_acknowledged_append_across_sigkills() {
    keeps_every_acknowledged_append_across_sigkills(Engine::Sled);
}

#[test]
fn fjall_store_keeps_every_acknowledged_append_across_sigkills() {
    keeps_every_acknowledged_append_across_sigkills(Engine::Fjall);
}

fn keeps_every_acknowledged_append_across_sigkills(engine: Engine) {
    let name = engine.name();
    let seed = std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(rand::random);
    eprintln!("store_crash {name}: seed {seed} (rerun with {SEED_ENV}={seed})");
    let trials = std::env::var(TRIALS_ENV)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(DEFAULT_TRIALS);
    let mut rng = StdRng::seed_from_u64(seed);
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("store");
    let exe = std::env::current_exe().expect("current_exe");
    let started = Instant::now();

    let mut acked: Acks = BTreeMap::new();
    let mut killed_before_first_ack = 0;
    for trial in 0..trials {
        let fail = |what: String| -> ! {
            panic!("store_crash {name} trial {trial} of {trials}, seed {seed}: {what}")
        };
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "store_crash::crash_child_writer",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR_ENV, &data)
            .env(CHILD_ENGINE_ENV, name)
            .env(
                CHILD_SEED_ENV,
                (seed ^ trial.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_string(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| fail(format!("cannot start the child: {e}")));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr = child.stderr.take().expect("piped stderr");
        let reader = std::thread::spawn(move || {
            let mut acks = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let mut words = line.split(' ');
                if words.next() == Some("ack") {
                    if let (Some(s), Some(seq), Some(tag)) =
                        (words.next(), words.next(), words.next())
                    {
                        if let Ok(seq) = seq.parse::<u64>() {
                            acks.push((s.to_owned(), seq, tag.to_owned()));
                        }
                    }
                }
            }
            acks
        });
        let errors = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });

        std::thread::sleep(Duration::from_millis(rng.gen_range(20..=300)));
        let _ = child.kill(); // SIGKILL on Unix
        let status = child
            .wait()
            .unwrap_or_else(|e| fail(format!("cannot reap the child: {e}")));
        let acks = reader.join().expect("stdout reader");
        let child_stderr = errors.join().expect("stderr reader");
        if status.signal() != Some(libc::SIGKILL) {
            fail(format!("the child exited by itself ({status}) instead of being killed; its stderr:\n{child_stderr}"));
        }
        if acks.is_empty() {
            killed_before_first_ack += 1;
        }

        for (s, seq, tag) in acks {
            if let Some(previous) = acked.entry(s.clone()).or_default().insert(seq, tag.clone()) {
                fail(format!(
                    "{s} seq {seq} was acknowledged twice: as {previous} in an earlier trial, \
                     then as {tag}: an acknowledged event was lost and its seq reused"
                ));
            }
        }
        verify(engine, &data, &acked).unwrap_or_else(|what| fail(what));
    }
    let events: usize = acked.values().map(BTreeMap::len).sum();
    eprintln!(
        "store_crash {name}: {trials} trials, {events} acknowledged events all present, \
         {killed_before_first_ack} kills before the first ack, {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        events > 0,
        "no child ever acknowledged an append: the test tested nothing"
    );
}

/// Opens the store as it was left and checks it against everything acknowledged so far.
fn verify(engine: Engine, data: &Path, acked: &Acks) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| format!("tokio: {e}"))?;
    if !data.join(engine.marker_file()).exists() {
        // Killed before the engine created its files; nothing can have been acknowledged.
        return if acked.is_empty() {
            Ok(())
        } else {
            Err("the store's files are gone".to_owned())
        };
    }
    let store = engine
        .open_existing(data)
        .map_err(|e| format!("the store does not open after the kill: {e}"))?;
    runtime.block_on(async {
        let sessions = store
            .list_sessions()
            .await
            .map_err(|e| format!("list_sessions fails: {e}"))?;
        let mut listed = BTreeMap::new();
        for info in &sessions {
            let history = store
                .read_history(&info.session_id, 1, None)
                .await
                .map_err(|e| format!("the history of {} does not read: {e}", info.session_id))?;
            let seqs_ok = history.iter().enumerate().all(|(i, e)| e.seq == i as u64 + 1);
            if !seqs_ok || history.len() as u64 != info.events {
                return Err(format!(
                    "{} lists {} events but its history has {} with seqs {:?}",
                    info.session_id,
                    info.events,
                    history.len(),
                    history.iter().map(|e| e.seq).collect::<Vec<_>>()
                ));
            }
            listed.insert(info.session_id.clone(), history);
        }
        // A task is enqueued in the same append as its scheduling event: atomicity means no
        // task without that event.
        let tasks = store
            .list_tasks()
            .await
            .map_err(|e| format!("list_tasks fails: {e}"))?;
        for task in &tasks {
            let scheduled = listed
                .get(&task.id.session_id)
                .and_then(|h| h.get((task.id.scheduled_seq as usize).wrapping_sub(1)));
            if !matches!(
                scheduled.map(|e| &e.event),
                Some(Event::ToolCallScheduled { .. })
            ) {
                return Err(format!(
                    "task {} is queued but its session has no scheduling event at that seq \
                     (found {:?}): the append that enqueued it was torn",
                    task.id,
                    scheduled.map(|e| e.kind.as_str())
                ));
            }
        }
        for (s, events) in acked {
            let Some(history) = listed.get(s) else {
                return Err(format!("session {s}, with {} acknowledged events, is gone", events.len()));
            };
            for (seq, tag) in events {
                match history.get((*seq as usize).wrapping_sub(1)) {
                    None => {
                        return Err(format!(
                            "acknowledged event {s} seq {seq} ({tag}) is missing: the history ends at seq {}",
                            history.len()
                        ))
                    }
                    Some(e) if tag_of(e) != Some(tag.as_str()) => {
                        return Err(format!(
                            "{s} seq {seq} holds {:?}, not the acknowledged {tag}",
                            tag_of(e)
                        ))
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(())
    })
}

fn tag_of(envelope: &EventEnvelope) -> Option<&str> {
    match &envelope.event {
        Event::UserMessage { text, .. } => text.split(' ').next(),
        Event::ToolCallScheduled { tool_use_id, .. } => Some(tool_use_id.as_str()),
        _ => None,
    }
}

/// The child: appends until it is killed. Does nothing unless run by the crash test.
#[test]
#[ignore = "run by the *_store_keeps_every_acknowledged_append_across_sigkills tests in a child process"]
fn crash_child_writer() {
    let Ok(dir) = std::env::var(CHILD_DIR_ENV) else {
        return;
    };
    let seed: u64 = std::env::var(CHILD_SEED_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let engine = std::env::var(CHILD_ENGINE_ENV)
        .ok()
        .and_then(|name| Engine::from_name(&name))
        .expect("child: CAIRN_CRASH_CHILD_ENGINE names no engine");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let store = engine.open(Path::new(&dir)).expect("child: open the store");
        let mut handles = Vec::new();
        for w in 0..SESSIONS * WRITERS_PER_SESSION {
            let store = Arc::clone(&store);
            let session = format!("crash-{}", w % SESSIONS);
            let mut rng = StdRng::seed_from_u64(seed.wrapping_add(w as u64));
            handles.push(tokio::spawn(async move {
                writer(&*store, &session, w, &mut rng, seed).await
            }));
        }
        handles.push(tokio::spawn(async move { worker(&*store, seed).await }));
        for handle in handles {
            handle.await.expect("child task");
        }
    });
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Tells the parent these events are acknowledged.
fn ack(events: &[EventEnvelope]) {
    let mut out = std::io::stdout().lock();
    for e in events {
        let _ = writeln!(
            out,
            "ack {} {} {}",
            e.session_id,
            e.seq,
            tag_of(e).unwrap_or("?")
        );
    }
    let _ = out.flush();
}

/// The next seq of a session, as the store has it.
async fn next_seq(store: &dyn Store, session: &str) -> u64 {
    match store.list_sessions().await {
        Ok(list) => list
            .iter()
            .find(|i| i.session_id == session)
            .map_or(1, |i| i.events + 1),
        Err(e) => panic!("child: list_sessions: {e}"),
    }
}

/// Appends batches of 1–3 events to `session` forever, some scheduling a task.
async fn writer(store: &dyn Store, session: &str, w: usize, rng: &mut StdRng, seed: u64) {
    let mut next = next_seq(store, session).await;
    for n in 0u64.. {
        let tag = |k: u64| format!("s{seed:x}-w{w}-n{n}-k{k}");
        let count = rng.gen_range(1..=3u64);
        let mut enqueue = Vec::new();
        let events: Vec<EventEnvelope> = (0..count)
            .map(|k| {
                let seq = next + k;
                let event = if rng.gen_ratio(1, 4) {
                    enqueue.push(NewTask::new(
                        TaskId {
                            session_id: session.to_owned(),
                            scheduled_seq: seq,
                        },
                        TaskKind::Tool,
                        0,
                    ));
                    Event::ToolCallScheduled {
                        turn: 1,
                        tool_use_id: tag(k),
                        name: "bash".to_owned(),
                        attempt: 1,
                        not_before_ms: 0,
                    }
                } else {
                    // Mostly a few hundred bytes to a few KiB; now and then a blob-sized one.
                    let size = if rng.gen_ratio(1, 40) {
                        150_000
                    } else {
                        rng.gen_range(200..4_000)
                    };
                    Event::UserMessage {
                        idempotency_key: None,
                        tool_choice: None,
                        turn: 1,
                        text: format!(
                            "{} {}",
                            tag(k),
                            crate::support::incompressible_text(seq, size)
                        ),
                        model: None,
                        media: Vec::new(),
                    }
                };
                EventEnvelope::new(session, seq, now_ms(), event)
            })
            .collect();
        let request = AppendRequest {
            enqueue,
            ..AppendRequest::new(
                session,
                next,
                events.clone(),
                SessionStatus::Running,
                now_ms(),
            )
        };
        match store.append(request).await {
            Ok(()) => {
                ack(&events);
                next += count;
            }
            Err(Error::Conflict { actual, .. }) => next = actual,
            Err(e) => panic!("child: append to {session}: {e}"),
        }
    }
}

/// Leases tasks and completes them with an event, as an activity worker does.
async fn worker(store: &dyn Store, seed: u64) {
    for n in 0u64.. {
        let leases = match store
            .lease_tasks(now_ms(), 60_000, 4, &cairn_runtime::TaskFilter::default())
            .await
        {
            Ok(leases) => leases,
            Err(e) => panic!("child: lease_tasks: {e}"),
        };
        if leases.is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        for lease in leases {
            let session = lease.id.session_id.clone();
            let mut next = next_seq(store, &session).await;
            loop {
                let event = EventEnvelope::new(
                    &session,
                    next,
                    now_ms(),
                    Event::UserMessage {
                        idempotency_key: None,
                        tool_choice: None,
                        turn: 1,
                        text: format!("s{seed:x}-done-{n}-{} result", lease.id.scheduled_seq),
                        model: None,
                        media: Vec::new(),
                    },
                );
                let request = AppendRequest {
                    complete: vec![(lease.id.clone(), lease.lease_attempt)],
                    ..AppendRequest::new(
                        session.clone(),
                        next,
                        vec![event.clone()],
                        SessionStatus::Running,
                        now_ms(),
                    )
                };
                match store.append(request).await {
                    Ok(()) => {
                        ack(&[event]);
                        break;
                    }
                    Err(Error::Conflict { actual, .. }) => next = actual,
                    Err(Error::LeaseLost { .. }) => break,
                    Err(e) => panic!("child: completing {}: {e}", lease.id),
                }
            }
        }
    }
}
