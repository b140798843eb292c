//! Several `cairn server` processes on one PostgreSQL database, with `cairn worker` processes
//! attached to each and clients on every server; `cairn migrate` from a store directory. The
//! database comes from `DATABASE_URL` (scripts/test starts a throwaway PostgreSQL); without
//! one these tests fail, never skip.

use crate::service::{check_session, free_addr, scripted, start, worker, TOOL_TURN};
use cairn_devtools::process::Process;
use cairn_ledger::{ModelSpec, ToolSpec};
use cairn_runtime::{Client, Event, SessionOptions, TurnOutcome};
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
        let results = history
            .iter()
            .filter(|e| matches!(e.event, Event::ToolCallCompleted { .. }))
            .count();
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
    assert!(said.contains("copied 1 session(s)"), "{said}");
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
