//! The CLI through a server: `cairn worker` and `cairn run --server` as separate processes
//! (over the remote crate's test server, an engine in this process), the inspection commands
//! with `--server`, and a store held by another process reached through its `cairn.sock`.

use crate::support::demo_files;
use cairn::demo::DEMO_SCRIPT;
use cairn_remote::fake_server::{serve_tcp, serve_unix_at, FakeServer, Faults};
use cairn_runtime::store::embedded::{self, OpenMode};
use cairn_runtime::{Client, Engine, SessionOptions, SessionStatus, SystemClock};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;

fn cairn(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .env_remove("CAIRN_SERVER")
        .env_remove("CAIRN_TOKEN")
        .envs(env.iter().copied())
        .output()
        .expect("run cairn")
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A `cairn worker` child, killed if the test ends without stopping it.
struct Worker(Option<Child>);

impl Worker {
    /// Starts `cairn worker` and waits until it says it is ready.
    fn start(url: &str, token: &str, workdir: &std::path::Path) -> Worker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["worker", "--server", url, "--workdir"])
            .arg(workdir)
            .env_remove("CAIRN_SERVER")
            .env("CAIRN_TOKEN", token)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start cairn worker");
        let stdout = child.stdout.take().expect("its stdout");
        let mut lines = BufReader::new(stdout).lines();
        match lines.next() {
            Some(Ok(line)) if line == "worker ready" => {}
            other => {
                let _ = child.kill();
                let out = child.wait_with_output().expect("its output");
                panic!("no `worker ready`: {other:?}\n{}", text(&out.stderr));
            }
        }
        Worker(Some(child))
    }

    /// SIGTERM; returns how it exited and its stderr.
    fn stop(mut self) -> (std::process::ExitStatus, String) {
        let child = self.0.take().expect("running");
        let pid = libc::pid_t::try_from(child.id()).expect("a pid");
        // SAFETY: kill(2) with a pid this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let out = child.wait_with_output().expect("its output");
        (out.status, text(&out.stderr))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn a_turn_runs_through_a_server_on_a_worker_process() {
    let rt = runtime();
    let server = FakeServer::new(Some("tok"), Faults::default());
    let served = rt.block_on(serve_tcp(server.router())).expect("serve");
    let url = served.url.as_str();
    let files = demo_files(DEMO_SCRIPT);
    let worker = Worker::start(url, "tok", &files.workdir);

    let model = format!("scripted:{}", files.script.display());
    let run = cairn(
        &[
            "run",
            "--server",
            url,
            "--token",
            "tok",
            "--model",
            &model,
            "--session",
            "r1",
            "What is (17 + 25) * 3?",
        ],
        &[],
    );
    let stdout = text(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", text(&run.stderr));
    assert!(
        stdout.contains("126") && stdout.contains("Tuesday"),
        "{stdout}"
    );
    assert!(
        text(&run.stderr).contains("session r1"),
        "{}",
        text(&run.stderr)
    );

    // The inspection commands, with the server from the environment.
    let env = [("CAIRN_SERVER", url), ("CAIRN_TOKEN", "tok")];
    let sessions = cairn(&["sessions"], &env);
    assert!(sessions.status.success(), "{}", text(&sessions.stderr));
    let listing = text(&sessions.stdout);
    // Under the column header, the session's row.
    assert!(
        listing.lines().nth(1).is_some_and(|l| l.starts_with("r1 ")) && listing.contains("idle"),
        "{listing}"
    );
    let local = Client::new(server.engine.clone());
    let history = rt.block_on(local.history("r1")).expect("history");
    let json = cairn(&["history", "r1", "--json"], &env);
    let lines: Vec<serde_json::Value> = text(&json.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), history.len());
    assert_eq!(
        lines,
        history
            .iter()
            .map(|e| serde_json::to_value(e).unwrap())
            .collect::<Vec<_>>()
    );
    let transcript = cairn(&["transcript", "r1"], &env);
    let expected = rt.block_on(local.transcript("r1")).expect("transcript");
    assert_eq!(
        transcript.stdout,
        [expected.canonical_json(), b"\n".to_vec()].concat()
    );
    let rendered = cairn(&["transcript", "r1", "--as", "anthropic"], &env);
    assert!(rendered.status.success(), "{}", text(&rendered.stderr));
    let body: serde_json::Value = serde_json::from_slice(&rendered.stdout).expect("a body");
    assert!(
        body["messages"].as_array().is_some_and(|m| !m.is_empty()),
        "{body}"
    );

    // A wrong token is refused, an unknown session named.
    let refused = cairn(&["sessions", "--server", url, "--token", "nope"], &[]);
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("401 unauthorized"),
        "{}",
        text(&refused.stderr)
    );
    let unknown = cairn(&["history", "nope"], &env);
    assert!(
        text(&unknown.stderr).contains("unknown session \"nope\""),
        "{}",
        text(&unknown.stderr)
    );

    let cancel = cairn(&["cancel", "r1"], &env);
    assert!(cancel.status.success(), "{}", text(&cancel.stderr));
    let described = rt.block_on(local.describe("r1")).expect("describe");
    assert_eq!(described.status, SessionStatus::Cancelled);

    let (status, stderr) = worker.stop();
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(stderr.contains("drained"), "{stderr}");
}

#[test]
fn a_worker_the_server_refuses_exits_with_the_reason() {
    let rt = runtime();
    let server = FakeServer::new(Some("right"), Faults::default());
    let served = rt.block_on(serve_tcp(server.router())).expect("serve");
    let out = cairn(
        &["worker", "--server", &served.url, "--token", "wrong"],
        &[],
    );
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("refused") && stderr.contains("401"),
        "{stderr}"
    );
    let out = cairn(&["worker"], &[]);
    assert!(
        text(&out.stderr).contains("needs a server"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_store_held_by_another_process_is_reached_through_its_socket() {
    let rt = runtime();
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("store");
    let data_arg = data.to_str().expect("a UTF-8 path");
    // This process holds the store, as `cairn run` would.
    let opened = rt
        .block_on(embedded::open(&data, OpenMode::Create, None))
        .expect("open");
    let engine = Engine::new(opened.store.clone(), Arc::new(SystemClock));
    let local = Client::new(engine.clone());
    let files = demo_files(DEMO_SCRIPT);
    let model = cairn_ledger::ModelSpec::parse(&format!("scripted:{}", files.script.display()))
        .expect("a model");
    let mut options = SessionOptions::new(model, Vec::new());
    options.session_id = Some("held".to_owned());
    rt.block_on(local.start_session(options)).expect("start");
    rt.block_on(local.send("held", "hello")).expect("send");

    // Without a socket, the lock is the answer.
    let out = cairn(&["sessions", "--data", data_arg], &[]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("in use by another process"),
        "{}",
        text(&out.stderr)
    );

    let server = FakeServer::with_engine(engine, None, Faults::default());
    let _served = rt
        .block_on(async { serve_unix_at(&data.join("cairn.sock"), server.router()) })
        .expect("serve");
    let out = cairn(&["sessions", "--data", data_arg], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("held") && text(&out.stdout).contains("running"),
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("acting through its socket"),
        "{}",
        text(&out.stderr)
    );
    let out = cairn(&["history", "--data", data_arg, "held"], &[]);
    assert!(
        text(&out.stdout).contains("user_message"),
        "{}",
        text(&out.stdout)
    );
    // Even CAIRN_SERVER does not override an explicit --data.
    let out = cairn(
        &["cancel", "--data", data_arg, "held", "--turn"],
        &[("CAIRN_SERVER", "http://127.0.0.1:9")],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("cancelled turn 1 of session held"),
        "{}",
        text(&out.stdout)
    );
    let described = rt.block_on(local.describe("held")).expect("describe");
    assert_eq!(described.status, SessionStatus::Idle);
    // Both a store and a server named: a mistake, said so.
    let out = cairn(
        &[
            "sessions",
            "--data",
            data_arg,
            "--server",
            "http://127.0.0.1:9",
        ],
        &[],
    );
    assert!(
        text(&out.stderr).contains("both given"),
        "{}",
        text(&out.stderr)
    );
    drop(opened);
}
