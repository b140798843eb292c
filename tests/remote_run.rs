//! `cairn run --server` as a person uses it (issue 12): `--json` prints the outcome as the
//! embedded `run` does, and Ctrl-C cancels the turn through the server (once) or leaves it
//! running there (twice), with the embedded `run`'s messages and exit codes.

use crate::delete::{model, Server};
use crate::first_hour::Running;
use crate::support::cairn_command;
use std::path::Path;
use std::process::Stdio;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The outcome line of `cairn run ... --json`, with the exit status.
fn run_json(dir: &Path, args: &[&str]) -> (Option<i32>, serde_json::Value) {
    let out = cairn_command()
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run cairn");
    let stdout = text(&out.stdout);
    assert_eq!(
        stdout.lines().count(),
        1,
        "only the outcome: {stdout}{}",
        text(&out.stderr)
    );
    let value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    (out.status.code(), value)
}

/// The kinds of a session's events, read over HTTP.
async fn kinds(base: &str, session: &str) -> Vec<String> {
    let history: serde_json::Value = reqwest::get(format!("{base}/v1/sessions/{session}/history"))
        .await
        .expect("GET history")
        .json()
        .await
        .expect("JSON");
    history["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["kind"].as_str().expect("kind").to_owned())
        .collect()
}

/// `run --server --json` prints only the outcome, the same object as on a store opened here
/// (session, turn, status, stop reason, totals), and exits by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_json_through_a_server_prints_the_embedded_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let quick = model(root, "quick", 0, &["the answer"]);
    let served = root.join("served");
    let server = Server::start(root, served.to_str().unwrap());
    let embedded = root.join("embedded");
    let (code, local) = run_json(
        root,
        &[
            "run",
            "--data",
            embedded.to_str().unwrap(),
            "--model",
            &quick,
            "--session",
            "j",
            "--json",
            "hi",
        ],
    );
    assert_eq!(code, Some(0));
    let (code, remote) = run_json(
        root,
        &[
            "run",
            "--server",
            &server.base,
            "--model",
            &quick,
            "--session",
            "j",
            "--json",
            "hi",
        ],
    );
    assert_eq!(code, Some(0));
    assert_eq!(remote, local, "the same outcome through the server as here");
    assert_eq!(remote["session_id"], "j");
    let outcome = &remote["outcome"];
    assert_eq!(
        (&outcome["status"], &outcome["turn"], &outcome["answer"]),
        (&"completed".into(), &1.into(), &"the answer".into()),
        "{remote}"
    );
    assert_eq!(outcome["stop_reason"], "end_turn");
    assert_eq!(outcome["totals"]["model_calls"], 1);
}

/// Starts a server over a store in `root` and `cairn run --server` of a slow answer in
/// session `session`; once the answer streams, sends it `ctrl_c` SIGINTs (the second after it
/// offers the choice) and returns the server and the run's exit code, stdout and stderr.
async fn interrupt_run(
    root: &std::path::Path,
    session: &'static str,
    ctrl_c: usize,
) -> (Server, (Option<i32>, String, String)) {
    let slow = model(root, "slow", 150, &["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma"]);
    let data = root.join("store");
    let server = Server::start(root, data.to_str().unwrap());
    let base = server.base.clone();
    let root_owned = root.to_path_buf();
    let ended = tokio::task::spawn_blocking(move || {
        let mut run = Running::spawn(
            &root_owned,
            &[
                "run",
                "--server",
                &base,
                "--model",
                &slow,
                "--session",
                session,
                "talk",
            ],
        );
        run.wait_for("alpha beta", false);
        run.signal(libc::SIGINT);
        if ctrl_c > 1 {
            run.wait_for("press Ctrl-C again", true);
            run.signal(libc::SIGINT);
        }
        run.finish()
    })
    .await
    .expect("join");
    (server, ended)
}

/// Ctrl-C once during `run --server`: the turn is cancelled through the server, durably
/// (its history records it), the message says so, and the status is "turn cancelled" (6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_through_a_server_cancels_the_turn_durably() {
    let dir = tempfile::tempdir().unwrap();
    let (server, (code, stdout, stderr)) = interrupt_run(dir.path(), "c", 1).await;
    assert_eq!(code, Some(6), "{stdout}{stderr}");
    assert!(
        stderr.contains("^C: cancelling turn 1 of session c")
            && stderr.contains("cancelled turn 1 of session c (recorded in its history)"),
        "{stderr}"
    );
    let history = kinds(&server.base, "c").await;
    assert!(
        history.contains(&"turn_cancelled".to_owned()),
        "{history:?}"
    );
    assert!(
        !history.contains(&"turn_completed".to_owned()),
        "{history:?}"
    );
}

/// Ctrl-C twice during `run --server`: nothing is cancelled, the message says how to follow
/// or cancel the turn through the server, the status is 130, and the server completes the
/// turn by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_through_a_server_leaves_the_turn_running_there() {
    let dir = tempfile::tempdir().unwrap();
    let (server, (code, stdout, stderr)) = interrupt_run(dir.path(), "l", 2).await;
    let base = &server.base;
    assert_eq!(code, Some(130), "{stdout}{stderr}");
    assert!(
        stderr.contains("left turn 1 of session l running on the server; nothing was cancelled")
            && stderr.contains(&format!("`cairn cancel --server {base} --turn l`"))
            && stderr.contains(&format!("`cairn describe --server {base} l`")),
        "{stderr}"
    );
    let waited: serde_json::Value =
        reqwest::get(format!("{base}/v1/sessions/l/turns/1?timeout_ms=60000"))
            .await
            .expect("GET turn")
            .json()
            .await
            .expect("JSON");
    assert_eq!(
        waited["outcome"]["status"], "completed",
        "the server completes the turn it was left: {waited}"
    );
    let history = kinds(base, "l").await;
    assert!(
        !history.contains(&"turn_cancelled".to_owned()),
        "{history:?}"
    );
}
