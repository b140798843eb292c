//! Several `cairn server` processes on one PostgreSQL database, with `cairn worker` processes
//! attached to each and clients on every server; `cairn migrate` from a store directory. The
//! database comes from `DATABASE_URL` (scripts/test starts a throwaway PostgreSQL); without
//! one these tests fail, never skip.

use crate::service::{
    acknowledged_turns, check_session, free_addr, running, scripted, start, tool_results, worker,
    TOOL_TURN,
};
use cairn_devtools::process::Process;
use cairn_ledger::{ModelSpec, ToolSpec};
use cairn_runtime::{Client, SessionOptions, TurnOutcome};
use std::time::Duration;

/// `cairn server` on a free loopback port over the database at `store`; returns it and its
/// URL.
pub fn server_on(store: &str, extra: &[&str]) -> (Process, String) {
    server_at(store, &free_addr(), extra)
}

/// `cairn server` on `listen` over the database at `store`.
pub fn server_at(store: &str, listen: &str, extra: &[&str]) -> (Process, String) {
    let mut args = vec![
        "server".to_owned(),
        "--store".into(),
        store.into(),
        "--listen".into(),
        listen.into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    start(&args, "listening on")
}

fn calculator() -> Vec<ToolSpec> {
    cairn_activities::ToolRegistry::builtin(".")
        .specs()
        .into_iter()
        .filter(|s| s.name == "calculator")
        .collect()
}

fn options(model: &ModelSpec, id: &str) -> SessionOptions {
    let mut o = SessionOptions::new(model.clone(), calculator());
    o.session_id = Some(id.to_owned());
    o
}

fn client(url: &str) -> Client {
    cairn_remote::connect(url, None).expect("client")
}

/// Two servers, a worker on each, clients on both: each session is started on one server,
/// its turn sent through the other and awaited on the first; every session completes with a
/// valid ledger and one result per tool_use, and both servers give the same histories.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_database_complete_every_session() {
    let database = cairn_postgres::testing::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let model = scripted(dir.path(), "turn.json", 20, TOOL_TURN);
    let (_a, url_a) = server_on(&database, &[]);
    let (_b, url_b) = server_on(&database, &[]);
    let _workers: Vec<Process> = [&url_a, &url_b]
        .into_iter()
        .map(|url| worker(url, &["--concurrency", "8"]))
        .collect();
    let clients = [client(&url_a), client(&url_b)];
    let runs: Vec<_> = (0..30)
        .map(|i| {
            let first = clients[i % 2].clone();
            let other = clients[(i + 1) % 2].clone();
            let model = model.clone();
            tokio::spawn(async move {
                let id = first
                    .start_session(options(&model, &format!("p{i:02}")))
                    .await?;
                let turn = other.send(&id, "what are 1+2 and 3*4?").await?;
                first.wait_turn(&id, turn).await
            })
        })
        .collect();
    for run in runs {
        let outcome = run.await.unwrap().expect("turn");
        assert!(
            matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer == "3 and 12"),
            "{outcome:?}"
        );
    }
    let listed = clients[1].sessions().await.unwrap();
    assert_eq!(listed.len(), 30, "server B lists what both created");
    for s in listed {
        let history = check_session(&clients[0], &s.session_id).await;
        assert_eq!(
            history,
            clients[1].history(&s.session_id).await.unwrap(),
            "{}: both servers read the same history",
            s.session_id
        );
        let results = tool_results(&history);
        assert_eq!(results, 2, "{}", s.session_id);
    }
}

/// An interrupted session in a store directory, copied with `cairn migrate`, resumes on a
/// server over the database: its turn completes there, and the copied prefix is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_interrupted_session_resumes_on_postgres() {
    let database = cairn_postgres::testing::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    // A model call slow enough that the kill lands inside the turn.
    let model = scripted(dir.path(), "turn.json", 60_000, TOOL_TURN);
    let (mut embedded, url) = crate::service::server(&data, "127.0.0.1:0");
    let _worker = worker(&url, &[]);
    let before = client(&url);
    let id = before
        .start_session(options(&model, "moved"))
        .await
        .unwrap();
    let turn = before.send(&id, "go").await.unwrap();
    let copied = before.history(&id).await.unwrap();
    // A session deleted in the directory: its id stays unusable on the database.
    let gone = before.start_session(options(&model, "gone")).await.unwrap();
    before.delete_session(&gone).await.unwrap();
    embedded.kill();

    // Later calls answer at once: the session resumes with a fast model.
    let fast = scripted(dir.path(), "turn.json", 0, TOOL_TURN);
    assert_eq!(fast, model, "the same script file, rewritten");
    let status = crate::support::cairn_command()
        .args(["migrate", "--from"])
        .arg(&data)
        .args(["--to", &database])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "migrate failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let said = String::from_utf8_lossy(&status.stdout);
    assert!(
        said.contains("copied 1 session(s)") && said.contains("and 1 deleted session id(s)"),
        "{said}"
    );
    let again = crate::support::cairn_command()
        .args(["migrate", "--from"])
        .arg(&data)
        .args(["--to", &database])
        .output()
        .unwrap();
    assert!(!again.status.success(), "a second copy is refused");
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already holds"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    let (_pg, pg_url) = server_on(&database, &["--local-workers", "4"]);
    let after = client(&pg_url);
    let reused = after.start_session(options(&model, "gone")).await;
    assert!(
        matches!(&reused, Err(cairn_runtime::Error::SessionDeleted { .. })),
        "a deleted id is not used again after the move: {reused:?}"
    );
    let outcome = tokio::time::timeout(Duration::from_secs(60), after.wait_turn(&id, turn))
        .await
        .expect("the migrated turn completes")
        .unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    let history = check_session(&after, &id).await;
    assert_eq!(
        &history[..copied.len()],
        &copied[..],
        "the copied prefix is the history as it was"
    );
}

/// Retries `op` while it fails (a server or the database restarting), up to `PATIENCE`.
async fn patiently<T, F, Fut>(what: &str, mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = cairn_runtime::Result<T>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        match op().await {
            Ok(value) => return value,
            Err(e) if tokio::time::Instant::now() < deadline => {
                eprintln!("{what}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{what} still failed after {PATIENCE:?}: {e}"),
        }
    }
}

/// How long a fault test waits for the system to come back before it fails.
const PATIENCE: Duration = Duration::from_secs(90);

/// A PostgreSQL cluster of the test's own (`scripts/postgres start` with no `DATABASE_URL`),
/// so the test may restart it; stopped and removed when dropped.
struct OwnCluster {
    env: Vec<(String, String)>,
}

impl OwnCluster {
    fn start() -> OwnCluster {
        let out =
            std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/postgres"))
                .arg("start")
                .env_remove("DATABASE_URL")
                .env_remove("CAIRN_PG_DIR")
                .stderr(std::process::Stdio::inherit())
                .output()
                .expect("run scripts/postgres start");
        assert!(
            out.status.success(),
            "scripts/postgres could not start a PostgreSQL of this test's own"
        );
        let exports = String::from_utf8(out.stdout).expect("utf-8 exports");
        let env = exports
            .split_whitespace()
            .filter_map(|word| word.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.trim_matches(['\'', '"']).to_owned()))
            .collect::<Vec<_>>();
        assert!(
            env.iter().any(|(k, _)| k == "CAIRN_PG_DIR"),
            "scripts/postgres printed no CAIRN_PG_DIR: {exports}"
        );
        OwnCluster { env }
    }

    fn url(&self) -> String {
        self.var("DATABASE_URL")
    }

    fn var(&self, name: &str) -> String {
        self.env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("scripts/postgres printed no {name}"))
    }

    fn run(&self, what: &str) -> bool {
        std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/postgres"))
            .arg(what)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(std::process::Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        self.run("stop");
    }
}

/// PostgreSQL restarted (`pg_ctl restart`) while two servers run turns: the servers
/// reconnect, and every turn a client was told about completes with a valid history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_mid_run_loses_nothing_acknowledged() {
    let cluster = OwnCluster::start();
    let database = cluster.url();
    let dir = tempfile::tempdir().unwrap();
    // Each model call takes 400 ms, so turns are running when the database goes away.
    let model = scripted(dir.path(), "turn.json", 400, TOOL_TURN);
    let (_a, url_a) = server_on(&database, &[]);
    let (_b, url_b) = server_on(&database, &[]);
    let _workers: Vec<Process> = [&url_a, &url_b]
        .into_iter()
        .map(|url| worker(url, &["--lease-ms", "3000"]))
        .collect();
    let clients = [client(&url_a), client(&url_b)];
    let mut acked = Vec::new();
    for i in 0..12 {
        let c = &clients[i % 2];
        let id = c
            .start_session(options(&model, &format!("r{i:02}")))
            .await
            .unwrap();
        let turn = c.send(&id, "go").await.unwrap();
        acked.push((id, turn));
    }
    assert!(
        running(&clients[0], &acked).await > 0,
        "the restart must land in the middle of turns"
    );
    assert!(cluster.run("restart"), "scripts/postgres restart failed");
    for (i, (id, turn)) in acked.iter().enumerate() {
        let c = clients[(i + 1) % 2].clone();
        let outcome = patiently("waiting for a turn across the restart", || {
            let c = c.clone();
            let id = id.clone();
            let turn = *turn;
            async move { c.wait_turn(&id, turn).await }
        })
        .await;
        assert!(
            matches!(outcome, TurnOutcome::Completed { .. }),
            "{id}: {outcome:?}"
        );
        check_session(&c, id).await;
    }
    // Both servers still serve after the restart: a new session on each completes.
    for (i, c) in clients.iter().enumerate() {
        let id = patiently("starting a session after the restart", || {
            c.start_session(options(&model, &format!("after{i}")))
        })
        .await;
        let outcome = c.run_turn(&id, "again").await.unwrap();
        assert!(
            matches!(outcome, TurnOutcome::Completed { .. }),
            "{outcome:?}"
        );
    }
}

/// One of two servers SIGKILLed mid-turn, with its worker cut off: the leases that worker
/// held lapse, the other server's timers record them, and its worker finishes every turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_servers_sessions_continue_on_the_other() {
    let database = cairn_postgres::testing::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let model = scripted(dir.path(), "turn.json", 1_500, TOOL_TURN);
    let (mut a, url_a) = server_on(&database, &[]);
    let (_b, url_b) = server_on(&database, &[]);
    let _worker_a = worker(&url_a, &["--lease-ms", "1500"]);
    let via_a = client(&url_a);
    let acked = acknowledged_turns(&via_a, &model, 8).await;
    // Server A's worker is inside model calls when A dies.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let via_b = client(&url_b);
    assert!(
        running(&via_b, &acked).await > 0,
        "the kill must land in the middle of turns"
    );
    a.kill();
    let _worker_b = worker(&url_b, &["--lease-ms", "1500"]);
    for (id, turn) in &acked {
        let outcome = tokio::time::timeout(PATIENCE, via_b.wait_turn(id, *turn))
            .await
            .unwrap_or_else(|_| panic!("{id}: the turn never completed on server B"))
            .unwrap();
        assert!(
            matches!(outcome, TurnOutcome::Completed { .. }),
            "{id}: {outcome:?}"
        );
        let history = check_session(&via_b, id).await;
        assert_eq!(tool_results(&history), 2, "{id}");
    }
}

/// Every connection of a server's pool held up by a lock another client of the database
/// holds: requests are answered 503 `unavailable` — after the acquire deadline, or the
/// statement timeout for those holding a connection — never left hanging, and nothing they
/// tried was written; once the lock goes, the server serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_answers_503_and_never_hangs() {
    use sqlx::{Connection, Executor};
    let database = cairn_postgres::testing::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let model = scripted(dir.path(), "turn.json", 0, TOOL_TURN);
    let (_server, url) = server_on(
        &database,
        &[
            "--store-connections",
            "2",
            "--store-acquire-ms",
            "300",
            "--store-statement-ms",
            "2000",
            "--local-workers",
            "2",
        ],
    );
    let c = client(&url);
    let ids: Vec<String> = {
        let mut ids = Vec::new();
        for i in 0..6 {
            ids.push(
                c.start_session(options(&model, &format!("x{i}")))
                    .await
                    .unwrap(),
            );
        }
        ids
    };
    let mut other = sqlx::PgConnection::connect(&database).await.unwrap();
    let mut lock = other.begin().await.unwrap();
    lock.execute("LOCK TABLE cairn_sessions IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let sends: Vec<_> = ids
        .iter()
        .map(|id| {
            let request = http
                .post(format!("{url}/v1/sessions/{id}/messages"))
                .json(&serde_json::json!({ "text": "go" }));
            tokio::spawn(async move {
                let answer = request.send().await.expect("an answer");
                let status = answer.status().as_u16();
                let body: serde_json::Value = answer.json().await.expect("a JSON body");
                (status, body)
            })
        })
        .collect();
    for send in sends {
        let (status, body) = tokio::time::timeout(Duration::from_secs(30), send)
            .await
            .expect("a request on an exhausted pool must be answered, not hang")
            .unwrap();
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
    }
    let refused = c.send(&ids[0], "refused").await.unwrap_err();
    assert!(
        refused.is_retryable(),
        "the client sees the 503 as retryable: {refused:?}"
    );
    lock.rollback().await.unwrap();
    for id in &ids {
        let history = c.history(id).await.unwrap();
        assert_eq!(history.len(), 1, "{id}: a refused message wrote nothing");
    }
    let outcome = c.run_turn(&ids[0], "now").await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
}

/// A server on a shared database drains for the leases it handed out only: SIGTERMed while
/// the other server's worker holds a long lease, it exits without waiting out its drain time
/// (10 s) for a lease that is not its own, and the other server finishes the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_server_waits_for_its_own_leases_only() {
    let database = cairn_postgres::testing::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let model = scripted(dir.path(), "turn.json", 4_000, TOOL_TURN);
    let (mut a, _url_a) = server_on(&database, &[]);
    let (_b, url_b) = server_on(&database, &[]);
    let _worker_b = worker(&url_b, &[]);
    let via_b = client(&url_b);
    let id = via_b.start_session(options(&model, "drain")).await.unwrap();
    let turn = via_b.send(&id, "go").await.unwrap();
    // Server B's worker is inside the model call.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(via_b.describe(&id).await.unwrap().running_turn.is_some());
    let pid = a.child.id() as libc::pid_t;
    // SAFETY: a plain signal to a child process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let exited = tokio::task::spawn_blocking(move || {
        for _ in 0..60 {
            if let Ok(Some(status)) = a.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    })
    .await
    .unwrap();
    let status = exited.expect("server A must not wait out its drain time for B's lease");
    assert!(status.success(), "a drained server exits 0: {status:?}");
    let outcome = via_b.wait_turn(&id, turn).await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
}

/// A session deleted through one server ends the event streams that follow it on another
/// (which finds it gone on its next read of the database), rather than leaving them open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_deleted_on_one_server_ends_its_streams_on_the_other() {
    let database = cairn_postgres::testing::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let model = scripted(dir.path(), "turn.json", 0, TOOL_TURN);
    let (_a, url_a) = server_on(&database, &[]);
    let (_b, url_b) = server_on(&database, &[]);
    let (a, b) = (client(&url_a), client(&url_b));
    let id = a.start_session(options(&model, "doomed")).await.unwrap();
    let mut followed = a.subscribe(&id, 0).await.expect("subscribe");
    let first = followed.next().await.expect("the first event");
    assert!(
        matches!(&first, Ok(cairn_runtime::wire::StreamEvent::Event(e)) if e.seq == 1),
        "{first:?}"
    );
    b.delete_session(&id)
        .await
        .expect("delete on the other server");
    let end = tokio::time::timeout(Duration::from_secs(20), followed.next())
        .await
        .expect("the stream ends once its session is deleted elsewhere");
    assert!(
        matches!(&end, Some(Err(cairn_runtime::Error::SessionDeleted { session_id })) if session_id == "doomed"),
        "{end:?}"
    );
}
