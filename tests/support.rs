//! Shared test helpers: an in-process host over any store, and the demo fixtures.

use cairn_activities::ToolRegistry;
use cairn_runtime::{Client, Clock, Engine, SessionOptions, Store};
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Large events must be made of text compression does not shrink much: records are compressed.
pub use cairn_runtime::store::conformance::incompressible_text;

/// A store, an engine and a worker pool, in this process.
pub struct TestHost {
    pub client: Client,
    pub pool: Option<WorkerPool>,
    pub tools: Arc<ToolRegistry>,
}

impl TestHost {
    pub fn start(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        workdir: &Path,
        config: WorkerConfig,
    ) -> TestHost {
        Self::start_with_models(store, clock, workdir, config, StandardModels::new())
    }

    pub fn start_with_models(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        workdir: &Path,
        config: WorkerConfig,
        models: StandardModels,
    ) -> TestHost {
        let engine = Engine::new(store, clock);
        let tools = Arc::new(ToolRegistry::builtin(workdir));
        let pool = WorkerPool::start(
            engine.clone(),
            Activities {
                models: Arc::new(models),
                tools: tools.clone(),
            },
            config,
        );
        TestHost {
            client: Client::new(engine),
            pool: Some(pool),
            tools,
        }
    }

    /// A host with the given activities (custom tools or model providers).
    pub fn start_with_activities(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        activities: Activities,
        config: WorkerConfig,
    ) -> TestHost {
        let engine = Engine::new(store, clock);
        let tools = activities.tools.clone();
        let pool = WorkerPool::start(engine.clone(), activities, config);
        TestHost {
            client: Client::new(engine),
            pool: Some(pool),
            tools,
        }
    }

    pub fn session_options(&self, script: &Path, session_id: &str) -> SessionOptions {
        let model = cairn_ledger::ModelSpec::parse(&format!("scripted:{}", script.display()))
            .expect("model spec");
        SessionOptions {
            session_id: Some(session_id.to_owned()),
            system_prompt: Some("You are a concise assistant.".to_owned()),
            ..SessionOptions::new(model, self.tools.specs())
        }
    }

    pub async fn shutdown(mut self) {
        if let Some(pool) = self.pool.take() {
            pool.shutdown().await;
        }
    }
}

/// A directory holding the demo script (`script.json`) and the demo's `work/notes.txt`.
pub struct DemoFiles {
    pub dir: tempfile::TempDir,
    pub script: PathBuf,
    pub workdir: PathBuf,
}

pub fn demo_files(script: &str) -> DemoFiles {
    let dir = tempfile::tempdir().expect("tempdir");
    let workdir = dir.path().join("work");
    std::fs::create_dir_all(&workdir).expect("workdir");
    std::fs::write(workdir.join("notes.txt"), cairn::demo::DEMO_NOTES).expect("notes");
    let script_path = dir.path().join("script.json");
    std::fs::write(&script_path, script).expect("script");
    DemoFiles {
        dir,
        script: script_path,
        workdir,
    }
}

/// Fast retry policies so retry tests finish in milliseconds.
pub fn fast_retries(options: &mut SessionOptions) {
    for policy in [&mut options.model_retry, &mut options.tool_retry] {
        policy.initial_interval_ms = 1;
        policy.maximum_interval_ms = 5;
    }
}

/// Reopens a sled store a test has just closed. sled releases its file lock when its last
/// internal handle goes, which its background threads can hold a moment after the store is
/// dropped; a test reopening at once retries while the lock is still held.
pub async fn reopen_sled(data: &std::path::Path) -> cairn_runtime::store::sled::SledStore {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match cairn_runtime::store::sled::SledStore::open_existing(data) {
            Ok(store) => return store,
            Err(e) if e.to_string().contains("in use by another process") => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the store stayed locked: {e}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            Err(e) => panic!("cannot reopen {}: {e}", data.display()),
        }
    }
}

/// Breaks a session's history the way an older or newer cairn's might: opens the embedded
/// store in `data` (its process gone) and appends the end of turn 1 while its model call is
/// outstanding, which no workflow records; the history no longer folds (it diverges).
pub async fn append_a_turn_end_no_workflow_records(data: &Path, session_id: &str) {
    append_raw_event(
        data,
        session_id,
        cairn_runtime::Event::TurnCompleted {
            turn: 1,
            usage: Default::default(),
        },
    )
    .await;
}

/// As [`append_a_turn_end_no_workflow_records`], but appends a second message while turn 1
/// runs, which the workflow refuses (a client sending it is refused); the history no longer
/// folds. Returns the event's seq.
pub async fn append_a_message_the_workflow_refuses(data: &Path, session_id: &str) -> u64 {
    append_raw_event(
        data,
        session_id,
        cairn_runtime::Event::UserMessage {
            turn: 2,
            text: "again".into(),
            model: None,
            media: Vec::new(),
            tool_choice: None,
            idempotency_key: None,
        },
    )
    .await
}

/// Appends `event` after the session's last one in the embedded store in `data` (its process
/// gone), as no engine would check it; returns its seq.
async fn append_raw_event(data: &Path, session_id: &str, event: cairn_runtime::Event) -> u64 {
    use cairn_runtime::store::embedded::{open, OpenMode};
    let opened = open(data, OpenMode::Existing, None).await.expect("open");
    let next_seq = opened
        .store
        .read_history(session_id, 1, None)
        .await
        .expect("history")
        .len() as u64
        + 1;
    opened
        .store
        .append(cairn_runtime::AppendRequest::new(
            session_id,
            next_seq,
            vec![cairn_runtime::EventEnvelope::new(
                session_id, next_seq, 1, event,
            )],
            cairn_runtime::SessionStatus::Running,
            1,
        ))
        .await
        .expect("append");
    next_seq
}

/// The `cairn` binary as a command, with its environment pinned: no server from
/// `CAIRN_SERVER`, no database from `CAIRN_STORE` or `DATABASE_URL` (scripts/test sets the
/// latter for the PostgreSQL tests), and a default data directory no store can be made in (a path under a
/// file), so a command that was not given `--data` fails instead of touching a real home.
/// Tests of the default directory set `CAIRN_DATA` themselves.
pub fn cairn_command() -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"));
    command
        .env(
            "CAIRN_DATA",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml/no-default-store"),
        )
        .env_remove("CAIRN_SERVER")
        .env_remove("CAIRN_TOKEN")
        .env_remove("CAIRN_STORE")
        .env_remove("DATABASE_URL")
        .env_remove("RUST_LOG");
    command
}

/// A small tmpfs, unmounted (and its directory removed) when dropped.
pub struct Tmpfs {
    pub dir: PathBuf,
}

impl Tmpfs {
    pub fn mount(dir: PathBuf, size: &str) -> Tmpfs {
        std::fs::create_dir_all(&dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "this test mounts a small tmpfs to fill it and needs root (CAP_SYS_ADMIN) for that; \
             mount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs { dir }
    }

    pub fn resize(&self, size: &str) {
        let out = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "remount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.dir).status();
    }
}
