//! Faults: leases of a dead process reclaimed on resume, IO errors while appending (injected
//! with `FaultyStore`, and a real full disk on a small tmpfs), and corruption found by
//! `cairn fsck`.

use crate::support::{demo_files, TestHost, Tmpfs};
use cairn_runtime::fsck::fsck;
use cairn_runtime::store::faulty::{FaultyStore, DISK_FULL};
use cairn_runtime::store::marks::MARKS_FILE;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::*;
use cairn_workers::WorkerConfig;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn fast_workers(lease_ms: u64) -> WorkerConfig {
    WorkerConfig {
        concurrency: 8,
        lease_ms,
        poll_interval_ms: 5,
        ..WorkerConfig::default()
    }
}

fn kinds(history: &[EventEnvelope]) -> Vec<&str> {
    history.iter().map(|e| e.kind.as_str()).collect()
}

/// A client with no workers, for driving an engine by hand.
fn probe(client: &Client, workdir: &Path) -> TestHost {
    TestHost {
        client: client.clone(),
        pool: None,
        tools: Arc::new(cairn_activities::ToolRegistry::builtin(workdir)),
    }
}

fn assert_disk_full<T: std::fmt::Debug>(result: Result<T>, what: &str) {
    match result {
        Err(Error::Store { reason }) => assert_eq!(reason, DISK_FULL, "{what}"),
        other => panic!("{what}: expected the injected Store error, got {other:?}"),
    }
}

/// Polls `check` every 5 ms for up to 10 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const ONE_ANSWER: &str = r#"{"responses": [{"parts": [{"type": "text", "text": "answered"}]}]}"#;

/// A worker of a process that died leased the model task for 60 s. The next process holds
/// sled's lock, so `resume(true)` may release that lease: the turn completes at once.
#[tokio::test]
async fn resume_reclaims_the_leases_of_a_dead_process() {
    let files = demo_files(ONE_ANSWER);
    let data = files.dir.path().join("store");
    let leased_at = {
        let store = Arc::new(SledStore::open(&data).unwrap());
        let engine = Engine::new(store.clone(), Arc::new(SystemClock));
        let client = Client::new(engine.clone());
        let host = probe(&client, &files.workdir);
        client
            .start_session(host.session_options(&files.script, "reclaim"))
            .await
            .unwrap();
        client.send("reclaim", "go").await.unwrap();
        let now = engine.now_ms();
        let dead = store
            .lease_tasks(now, 60_000, 10, &cairn_runtime::TaskFilter::default())
            .await
            .unwrap();
        assert_eq!(dead.len(), 1, "the dead worker holds the model task");
        assert_eq!(dead[0].lease_attempt, 1);
        assert_eq!(dead[0].expires_at_ms, now + 60_000);
        now
    };
    let store = Arc::new(crate::support::reopen_sled(&data).await);
    let tasks = store.list_tasks().await.unwrap();
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].lease_attempt, 1, "the lease survived the reopen");
    assert_eq!(tasks[0].visible_at_ms, leased_at + 60_000);
    assert!(
        store
            .lease_tasks(
                SystemClock.now_ms(),
                1_000,
                10,
                &cairn_runtime::TaskFilter::default()
            )
            .await
            .unwrap()
            .is_empty(),
        "without reclaiming, the task stays hidden until the dead lease lapses"
    );

    // As `cairn resume` does: resume, then start the workers.
    let engine = Engine::new(store.clone(), Arc::new(SystemClock));
    let started = Instant::now();
    let report = engine.resume(true).await.unwrap();
    assert_eq!(report.reclaimed_leases, 1);
    assert_eq!(report.running_sessions, ["reclaim"]);
    assert_eq!(report.outstanding_tasks, 1);
    assert_eq!(report.requeued_tasks, 0);
    let tasks = store.list_tasks().await.unwrap();
    assert_eq!(
        (
            tasks[0].lease_attempt,
            tasks[0].visible_at_ms <= SystemClock.now_ms()
        ),
        (1, true),
        "released: leasable now, its lease attempt kept"
    );
    let pool = cairn_workers::WorkerPool::start(
        engine.clone(),
        cairn_workers::Activities {
            models: Arc::new(cairn_workers::StandardModels::new()),
            tools: Arc::new(cairn_activities::ToolRegistry::builtin(&files.workdir)),
        },
        fast_workers(2_000),
    );
    let host = TestHost {
        client: Client::new(engine),
        pool: Some(pool),
        tools: Arc::new(cairn_activities::ToolRegistry::builtin(&files.workdir)),
    };
    let outcome =
        tokio::time::timeout(Duration::from_secs(10), host.client.wait_turn("reclaim", 1))
            .await
            .expect("the turn completes well before the 60 s lease would lapse")
            .unwrap();
    assert!(
        matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "answered"),
        "{outcome:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    let history = host.client.history("reclaim").await.unwrap();
    assert_eq!(
        kinds(&history),
        [
            "session_started",
            "user_message",
            "model_call_scheduled",
            "model_call_completed",
            "turn_completed"
        ]
    );
    host.shutdown().await;
    assert!(store.list_tasks().await.unwrap().is_empty());
    assert_eq!(
        store.release_leases(SystemClock.now_ms()).await.unwrap(),
        0,
        "nothing is leased any more"
    );
}

const THREE_ANSWERS: &str = r#"{"responses": [
    {"parts": [{"type": "text", "text": "first answer"}]},
    {"parts": [{"type": "text", "text": "second answer"}]},
    {"parts": [{"type": "text", "text": "third answer"}]}
]}"#;

fn answer(outcome: &TurnOutcome) -> &str {
    match outcome {
        TurnOutcome::Completed { answer, .. } => answer,
        other => panic!("the turn should complete, got {other:?}"),
    }
}

/// Appends that fail (a full disk) are clear `Store` errors to the caller and write nothing;
/// a fault of one session leaves the others working; after healing, the session goes on, and
/// everything acknowledged is in the store, also after reopening it.
#[tokio::test]
async fn failed_appends_are_clear_errors_and_lose_nothing_acknowledged() {
    let files = demo_files(THREE_ANSWERS);
    let data = files.dir.path().join("store");
    let store = Arc::new(FaultyStore::new(SledStore::open(&data).unwrap()));
    let host = TestHost::start(
        store.clone(),
        Arc::new(SystemClock),
        &files.workdir,
        fast_workers(2_000),
    );
    let client = host.client.clone();
    for s in ["a", "b"] {
        client
            .start_session(host.session_options(&files.script, s))
            .await
            .unwrap();
    }
    assert_eq!(
        answer(&client.run_turn("a", "one").await.unwrap()),
        "first answer"
    );
    let acknowledged_a = client.history("a").await.unwrap();
    let acknowledged_b = client.history("b").await.unwrap();

    // The disk fills up: every append fails.
    store.fail_appends_after(0);
    assert_disk_full(client.send("a", "two").await, "send on a full disk");
    assert_disk_full(
        client
            .start_session(host.session_options(&files.script, "c"))
            .await,
        "starting a session on a full disk",
    );
    assert_eq!(
        client.history("a").await.unwrap(),
        acknowledged_a,
        "nothing half-written"
    );
    assert!(matches!(
        client.history("c").await,
        Err(Error::UnknownSession { .. })
    ));
    assert!(!client
        .engine()
        .expect("in-process")
        .state("a")
        .await
        .unwrap()
        .is_running());
    store.heal();

    // Only session a's appends fail: b runs a whole turn meanwhile.
    store.fail_appends_for("a");
    assert_disk_full(client.send("a", "two").await, "send to the failing session");
    assert_eq!(
        answer(&client.run_turn("b", "one").await.unwrap()),
        "first answer"
    );
    assert_disk_full(client.send("a", "two").await, "a still fails");
    assert_eq!(client.history("a").await.unwrap(), acknowledged_a);
    assert_eq!(store.injected_failures(), 4);

    // Healed: a continues where its acknowledged history ends.
    store.heal();
    assert_eq!(
        answer(&client.run_turn("a", "two").await.unwrap()),
        "second answer"
    );
    let final_a = client.history("a").await.unwrap();
    let final_b = client.history("b").await.unwrap();
    assert_eq!(&final_a[..acknowledged_a.len()], acknowledged_a.as_slice());
    assert_eq!(&final_b[..acknowledged_b.len()], acknowledged_b.as_slice());
    assert_eq!(
        kinds(&final_a[acknowledged_a.len()..]),
        [
            "user_message",
            "model_call_scheduled",
            "model_call_completed",
            "turn_completed"
        ],
        "the failed sends left no trace: turn 2 is the next one"
    );
    match &final_a[acknowledged_a.len()].event {
        Event::UserMessage { turn, text, .. } => assert_eq!((*turn, text.as_str()), (2, "two")),
        other => panic!("{other:?}"),
    }
    host.shutdown().await;
    drop(client);
    let store = Arc::into_inner(store)
        .expect("the host is gone: the test holds the only handle")
        .into_inner();
    drop(store);

    // The persisted records: exactly what the clients were told.
    let store = crate::support::reopen_sled(&data).await;
    assert_eq!(store.read_history("a", 1, None).await.unwrap(), final_a);
    assert_eq!(store.read_history("b", 1, None).await.unwrap(), final_b);
    let report = fsck(&store).await.unwrap();
    assert!(report.is_clean(), "{report}");
    assert_eq!((report.sessions, report.tasks), (2, 0));
}

const TWO_TOOLS: &str = r#"{"responses": [
    {"parts": [{"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "6*7"}},
               {"type": "tool_use", "id": "t2", "name": "calculator", "input": {"expression": "1+1"}}]},
    {"parts": [{"type": "text", "text": "done"}]}
]}"#;

/// Whether `request` records a tool's result.
fn records_a_tool_result(request: &AppendRequest) -> bool {
    matches!(
        request.events.first().map(|e| &e.event),
        Some(Event::ToolCallCompleted { .. })
    )
}

/// Session `id` on `store` (workers with 10 s leases, a clock standing at 1,000,000 ms)
/// sent a message whose model calls two tools, the next `failures` appends for which
/// `failing` is true failing; with the files the host's workers use (kept for the test's
/// length).
async fn two_tools_failing_their_reports(
    store: &Arc<FaultyStore<MemoryStore>>,
    failures: u64,
    failing: impl Fn(&AppendRequest) -> bool + Send + Sync + 'static,
    id: &str,
) -> (TestHost, Arc<ManualClock>, crate::support::DemoFiles) {
    let files = demo_files(TWO_TOOLS);
    let clock = Arc::new(ManualClock::new(1_000_000));
    store.fail_appends_matching(failures, failing);
    let host = TestHost::start(
        store.clone(),
        clock.clone(),
        &files.workdir,
        fast_workers(10_000),
    );
    host.client
        .start_session(host.session_options(&files.script, id))
        .await
        .unwrap();
    host.client.send(id, "go").await.unwrap();
    (host, clock, files)
}

/// A worker's report fails to append: the task stays queued under its lease. Once the lease
/// lapses the engine's timers record the attempt as failed (timeout, "lease lapsed"), the retry
/// runs the tool again, and the turn completes with exactly one result per tool_use.
#[tokio::test]
async fn a_report_that_fails_to_append_runs_again_after_the_lease_lapses() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    // t1's report fails as its worker sees it: its append alone fails once. The two results
    // may first come together (a report holds its session for its running sibling's), and
    // that shared append fails too; the engine then records each alone, and t2's stands.
    let t1_failed_alone = AtomicBool::new(false);
    let t1_report = move |request: &AppendRequest| {
        let completes_t1 = request.events.iter().any(|e| {
            matches!(&e.event, Event::ToolCallCompleted { tool_use_id, .. } if tool_use_id == "t1")
        });
        if !completes_t1 || t1_failed_alone.load(Ordering::SeqCst) {
            return false;
        }
        if request.events.len() == 1 {
            t1_failed_alone.store(true, Ordering::SeqCst);
        }
        true
    };
    let (host, clock, _files) =
        two_tools_failing_their_reports(&store, 2, t1_report, "report").await;
    let client = host.client.clone();
    let completed = |history: &[EventEnvelope]| -> Vec<String> {
        history
            .iter()
            .filter_map(|e| match &e.event {
                Event::ToolCallCompleted { tool_use_id, .. } => Some(tool_use_id.clone()),
                _ => None,
            })
            .collect()
    };
    eventually("one failed and one recorded tool report", || async {
        store.injected_failures() >= 1
            && completed(&client.history("report").await.unwrap()).len() == 1
    })
    .await;
    // Give the workers time to (wrongly) run it again while the lease holds.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let history = client.history("report").await.unwrap();
    let done = completed(&history);
    assert_eq!(done.len(), 1, "{:?}", kinds(&history));
    let tasks = store.list_tasks().await.unwrap();
    assert_eq!(
        tasks.len(),
        1,
        "the unreported task is still queued: {tasks:?}"
    );
    assert_eq!(tasks[0].kind, TaskKind::Tool);
    assert_eq!(
        tasks[0].lease_attempt, 1,
        "not leased again while the lease holds"
    );
    assert_eq!(tasks[0].visible_at_ms, 1_010_000);
    assert!(client
        .engine()
        .expect("in-process")
        .state("report")
        .await
        .unwrap()
        .is_running());

    let engine = client.engine().expect("in-process").clone();
    assert_eq!(
        engine.fire_timers().await.unwrap(),
        0,
        "nothing is overdue while the lease holds"
    );
    let lost = ["t1", "t2"]
        .into_iter()
        .find(|id| !done.iter().any(|d| d == id))
        .expect("one tool_use is unanswered");
    clock.advance(10_001);
    assert_eq!(
        engine.fire_timers().await.unwrap(),
        1,
        "the lapsed lease is recorded"
    );
    let history = client.history("report").await.unwrap();
    let failures: Vec<(String, u32, ActivityFailure)> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallFailed {
                tool_use_id,
                attempt,
                failure,
                ..
            } => Some((tool_use_id.clone(), *attempt, failure.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let (failed_id, failed_attempt, failure) = &failures[0];
    assert_eq!((failed_id.as_str(), *failed_attempt), (lost, 1));
    assert_eq!(failure.class, ErrorClass::Timeout);
    assert!(
        failure.message.contains("lease lapsed"),
        "{}",
        failure.message
    );
    // The retry waits for its backoff (1 s by default).
    clock.advance(1_000);
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.wait_turn("report", 1))
        .await
        .expect("the tool runs again after its lease lapsed")
        .unwrap();
    assert_eq!(answer(&outcome), "done");
    let history = client.history("report").await.unwrap();
    let mut done = completed(&history);
    done.sort();
    assert_eq!(done, ["t1", "t2"], "exactly one result per tool_use");
    for e in &history {
        if let Event::ToolCallCompleted {
            tool_use_id,
            attempt,
            ..
        } = &e.event
        {
            let want = if tool_use_id == lost { 2 } else { 1 };
            assert_eq!(
                *attempt, want,
                "the lost report's tool_use is answered by its retry"
            );
        }
    }
    assert_eq!(
        history
            .iter()
            .filter(|e| matches!(e.event, Event::ToolCallFailed { .. }))
            .count(),
        1,
        "the lapsed attempt is the only failure"
    );
    let replayed = replay("report", &history).unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        client.transcript("report").await.unwrap().canonical_json()
    );
    host.shutdown().await;
    assert!(store.list_tasks().await.unwrap().is_empty());
    let report = fsck(store.as_ref()).await.unwrap();
    assert!(report.is_clean(), "{report}");
}

/// On a database that is unavailable for a while (`StoreUnavailable`, as PostgreSQL while it
/// restarts), an in-process worker sends a report that failed so again, while its lease
/// holds, instead of dropping the result: the tool runs once, no attempt fails, and the turn
/// completes without waiting for a lease to lapse.
#[tokio::test]
async fn a_report_the_database_refuses_for_now_is_sent_again_while_its_lease_holds() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    store.fail_as_a_database();
    let (host, _clock, _files) =
        two_tools_failing_their_reports(&store, 3, records_a_tool_result, "unavailable").await;
    let client = host.client.clone();
    // The clock stands still: no lease lapses, so only a report sent again ends the turn.
    let outcome = tokio::time::timeout(Duration::from_secs(10), client.wait_turn("unavailable", 1))
        .await
        .expect("the refused reports are sent again")
        .unwrap();
    assert_eq!(answer(&outcome), "done");
    assert_eq!(store.injected_failures(), 3);
    let history = client.history("unavailable").await.unwrap();
    let attempts: Vec<(String, u32)> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallCompleted {
                tool_use_id,
                attempt,
                ..
            } => Some((tool_use_id.clone(), *attempt)),
            _ => None,
        })
        .collect();
    let mut attempts = attempts;
    attempts.sort();
    assert_eq!(attempts, [("t1".to_owned(), 1), ("t2".to_owned(), 1)]);
    assert!(
        !history
            .iter()
            .any(|e| matches!(e.event, Event::ToolCallFailed { .. })),
        "{:?}",
        kinds(&history)
    );
    host.shutdown().await;
}

/// Where the full-disk child fills a store; set only for it.
const FULL_DISK_CHILD_ENV: &str = "CAIRN_FULL_DISK_CHILD_STORE";

/// The full-disk test's event `seq`: 40 KiB of random letters, so no compression (the codec's
/// or the engine's) takes it away.
fn full_disk_event(seq: u64) -> EventEnvelope {
    EventEnvelope::new(
        "fill",
        seq,
        seq,
        Event::UserMessage {
            idempotency_key: None,
            tool_choice: None,
            turn: 1,
            text: crate::support::incompressible_text(seq, 40 * 1024),
            model: None,
            media: Vec::new(),
        },
    )
}

/// A real full disk: a sled store on a 2 MiB tmpfs, filled by a child process appending large
/// events until an append fails. The failure is a clear `Store` error (no panic), the store
/// then refuses writes, and the child closes it and exits (sled 0.34 can hang forever in its
/// close after a failed log write; the store gives up waiting). After the disk grows, every
/// acknowledged event is there when the store is opened again.
#[test]
fn a_full_disk_fails_appends_clearly_and_keeps_every_acknowledged_event() {
    let root = tempfile::tempdir().unwrap();
    let mnt = Tmpfs::mount(root.path().join("mnt"), "2m");
    let data = mnt.dir.join("store");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "faults::full_disk_child",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FULL_DISK_CHILD_ENV, &data)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the child");
    let started = Instant::now();
    while child.try_wait().expect("wait for the child").is_none() {
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the full-disk child did not exit within 120 s: closing the store hung");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("the child's output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the full-disk child failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    // The test harness prints the test's name on the same line, before the child's words.
    let acknowledged: u64 = stdout
        .lines()
        .find_map(|line| line.split_once("acknowledged ").map(|(_, n)| n))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("the child said how many appends were acknowledged: {stdout}"));
    eprintln!("full disk: {acknowledged} appends acknowledged");
    assert!(acknowledged >= 5, "only {acknowledged} appends fit");
    let acknowledged: Vec<EventEnvelope> = (1..=acknowledged).map(full_disk_event).collect();

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        // Still full: sled needs room to open (it did not, when this was written), and that is
        // a clear error too; should it open, the acknowledged events must be there.
        match SledStore::open_existing(&data) {
            Err(Error::StoreOpen { reason, .. }) => {
                assert!(reason.contains("No space left"), "{reason}")
            }
            Err(other) => panic!("opening on a full disk: expected StoreOpen, got {other}"),
            Ok(store) => {
                let history = store.read_history("fill", 1, None).await.unwrap();
                assert_eq!(&history[..acknowledged.len()], acknowledged.as_slice());
            }
        }
        // Room again (as after freeing space): reopen and read back every acknowledged event.
        mnt.resize("64m");
        let store = crate::support::reopen_sled(&data).await;
        let history = store.read_history("fill", 1, None).await.unwrap();
        assert!(
            history.len() >= acknowledged.len(),
            "{} events read, {} acknowledged",
            history.len(),
            acknowledged.len()
        );
        assert_eq!(&history[..acknowledged.len()], acknowledged.as_slice());
    });
    drop(mnt);
}

/// The full-disk test's child: appends [`full_disk_event`]s to the store it is given until an
/// append fails, checks the failure and that the store then refuses writes, prints
/// `acknowledged N` and closes the store. Does nothing unless run by that test.
#[test]
#[ignore = "run by a_full_disk_fails_appends_clearly_and_keeps_every_acknowledged_event in a child process"]
fn full_disk_child() {
    let Some(data) = std::env::var_os(FULL_DISK_CHILD_ENV) else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let store = SledStore::open(Path::new(&data)).unwrap();
        let append = |event: EventEnvelope| {
            let (session_id, seq, at) = (event.session_id.clone(), event.seq, event.recorded_at_ms);
            AppendRequest::new(session_id, seq, vec![event], SessionStatus::Running, at)
        };
        let mut acknowledged = 0;
        let mut failure = None;
        for seq in 1..=200u64 {
            match store.append(append(full_disk_event(seq))).await {
                Ok(()) => acknowledged = seq,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let failure = failure.expect("a 2 MiB disk must fill up within 8 MiB of appends");
        eprintln!("full disk: {acknowledged} appends acknowledged, then: {failure}");
        match &failure {
            Error::Store { reason } => assert!(reason.contains("No space left"), "{reason}"),
            other => panic!("a full disk must be an Error::Store, got {other:?}"),
        }
        // The store refuses further writes rather than pretending.
        let next = acknowledged + 1;
        let again = store
            .append(append(EventEnvelope::new(
                "other",
                1,
                next,
                Event::SessionCancelled {
                    reason: "x".to_owned(),
                },
            )))
            .await;
        match again {
            Err(Error::Store { reason }) => {
                assert!(reason.contains("refus"), "{reason}")
            }
            other => panic!("after a failed write the store refuses writes: {other:?}"),
        }
        println!("acknowledged {acknowledged}");
        // Closing must end even when sled cannot finish its flush.
        drop(store);
    });
}

fn cairn(args: &[&str]) -> Output {
    crate::support::cairn_command()
        .args(args)
        .output()
        .expect("run cairn")
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// Runs the demo into the store `dir` and returns it, the session id and its number of
/// events (from the demo's summary, so the store is not opened again). The count is 11, plus
/// the progress records of what it streamed, which depend on how fast the stream ran.
fn demo_store(dir: &Path) -> (PathBuf, String, usize) {
    // sled: the tests using it damage sled's own files.
    let out = cairn(&["demo", "--engine", "sled", "--data", dir.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let session = stdout
        .lines()
        .find_map(|l| l.strip_prefix("session "))
        .expect("the summary names the session")
        .trim()
        .to_owned();
    let events = stdout
        .lines()
        .find_map(|l| l.strip_prefix("events "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("the summary counts the events");
    assert!(events >= 11, "{stdout}");
    (dir.to_path_buf(), session, events)
}

#[test]
fn fsck_of_a_clean_demo_store_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _, events) = demo_store(&dir.path().join("demo"));
    let out = cairn(&["fsck", "--data", store.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(
        text(&out.stdout),
        format!("checked 1 session, {events} events, 0 queued tasks: no problems\n")
    );
}

/// A record damaged inside sled (its own log checksums still fine): fsck names the session and
/// seq, exits 1, and reads on past it.
#[test]
fn fsck_names_a_corrupt_record_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let (store, session, events) = demo_store(&dir.path().join("demo"));
    {
        let db = sled::open(&store).unwrap();
        let events = db.open_tree("events").unwrap();
        let mut key = session.as_bytes().to_vec();
        key.push(0);
        key.extend_from_slice(&4u64.to_be_bytes());
        let mut record = events.get(&key).unwrap().expect("seq 4").to_vec();
        let mid = record.len() / 2;
        record[mid] ^= 0x01;
        events.insert(key, record).unwrap();
        db.flush().unwrap();
    }
    let out = cairn(&["fsck", "--data", store.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    // fsck's problems have their own exit status.
    assert_eq!(out.status.code(), Some(7), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.starts_with(&format!(
            "checked 1 session, {events} events, 0 queued tasks: 1 problem\n"
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "session {session:?} seq 4: corrupt record: checksum mismatch"
        )),
        "{stdout}"
    );
}

/// A byte flipped in sled's log file: sled would drop the damaged log message and everything
/// after it without an error. Read-only commands name the loss by session and seq and change no
/// byte; writable ones refuse and put the files back; `fsck --repair` accepts it after copying
/// the files away.
#[test]
fn a_byte_flip_in_the_log_is_named_and_destroys_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, session, _) = demo_store(&dir.path().join("demo"));
    assert!(store.join(MARKS_FILE).is_file());
    // The demo's user prompt is recorded once in the log, compressed inside its record: find
    // the record's bytes as the encoder writes them (the event from a read-only export) and
    // damage its first copy, in the middle of the compressed body.
    let export = cairn(&["export", "--data", store.to_str().unwrap(), &session]);
    assert!(export.status.success(), "{}", text(&export.stderr));
    let prompt = text(&export.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<EventEnvelope>(line).ok())
        .find(|e| {
            matches!(&e.event, Event::UserMessage { text, .. }
                if text.contains("notes.txt say about the launch"))
        })
        .expect("the prompt is in the history");
    let record = codec::encode(&prompt).unwrap();
    let db_path = store.join("db");
    let mut db = std::fs::read(&db_path).unwrap();
    let at = db
        .windows(record.len())
        .position(|w| w == record.as_slice())
        .expect("the prompt's record is in the log");
    db[at + record.len() / 2] ^= 0x01;
    std::fs::write(&db_path, &db).unwrap();
    let before = tree_bytes(&store);
    let data = store.to_str().unwrap();

    let out = cairn(&["fsck", "--data", data]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains(&format!("session {session:?} seq ")) && stdout.contains("lost events"),
        "{stdout}"
    );
    let sessions = cairn(&["sessions", "--data", data]);
    assert!(
        text(&sessions.stderr).contains("lost acknowledged events"),
        "{}",
        text(&sessions.stderr)
    );
    assert_eq!(
        tree_bytes(&store),
        before,
        "read-only commands changed the store"
    );

    let resume = cairn(&["resume", "--data", data]);
    assert_eq!(resume.status.code(), Some(1));
    let stderr = text(&resume.stderr);
    assert!(
        stderr.contains("lost acknowledged events") && stderr.contains(&session),
        "{stderr}"
    );
    assert_eq!(
        tree_bytes(&store),
        before,
        "a refused open changed the store"
    );

    let repair = cairn(&["fsck", "--repair", "--data", data]);
    let stdout = text(&repair.stdout);
    assert!(stdout.contains("repaired: accepted the loss"), "{stdout}");
    assert!(store.join("set-aside").is_dir());
    let after = cairn(&["fsck", "--data", data]);
    assert!(
        !text(&after.stdout).contains("lost events"),
        "{}",
        text(&after.stdout)
    );
}

/// Every file under `dir` with its bytes.
fn tree_bytes(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push((path.display().to_string(), std::fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}
