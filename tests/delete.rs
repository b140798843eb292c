//! `cairn delete` (issue 12): a finished session deleted after a question on a terminal, or
//! with `--yes`; refused without a terminal, refused while a turn runs; through a server
//! (`DELETE /v1/sessions/{id}`); and SIGKILLed mid-delete, leaving each session whole or gone
//! and `cairn fsck` clean.

use crate::support::cairn_command;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn cairn(dir: &Path, args: &[&str]) -> Output {
    cairn_command()
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run cairn")
}

/// A scripted model answering `answers` in order; the `--model` value.
pub(crate) fn model(dir: &Path, name: &str, chunk_delay_ms: u64, answers: &[&str]) -> String {
    let responses: Vec<serde_json::Value> = answers
        .iter()
        .map(|a| serde_json::json!({"parts": [{"type": "text", "text": a}]}))
        .collect();
    let body = serde_json::json!({"chunk_delay_ms": chunk_delay_ms, "responses": responses});
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, body.to_string()).expect("write the script");
    format!("scripted:{}", path.display())
}

/// Runs one turn of `session` on the store `data`; panics unless it completes.
fn run_turn(dir: &Path, data: &str, model: &str, session: &str) {
    let out = cairn(
        dir,
        &[
            "run",
            "--data",
            data,
            "--model",
            model,
            "--session",
            session,
            "hello",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// The sessions of a store, as `cairn sessions --json` lists them: (id, events).
fn listed(dir: &Path, data: &str) -> Vec<(String, u64)> {
    let out = cairn(dir, &["sessions", "--data", data, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut sessions = Vec::new();
    for line in text(&out.stdout).lines() {
        let value: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        let id = value["session_id"].as_str().expect("session_id").to_owned();
        sessions.push((id, value["events"].as_u64().expect("events")));
    }
    sessions
}

/// `cairn fsck` of a store finds nothing wrong.
fn assert_fsck_clean(dir: &Path, data: &str) {
    let out = cairn(dir, &["fsck", "--data", data]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("no problems"),
        "fsck: {stdout}{}",
        text(&out.stderr)
    );
}

/// `cairn delete` under a pseudo-terminal (`script(1)`), answering `answer` to its question.
fn delete_on_a_terminal(dir: &Path, data: &str, session: &str, answer: &str) -> Output {
    let bin = env!("CARGO_BIN_EXE_cairn");
    let mut child = cairn_command()
        .current_dir(dir)
        .args([
            "-qec",
            &format!("{bin} delete --data {data} {session}"),
            "/dev/null",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn_with_program("script");
    // The answer goes to the terminal only once the question is there to read it.
    let mut stdout = child.stdout.take().expect("stdout");
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 256];
    while !text(&seen).contains("[y/N]") {
        assert!(Instant::now() < deadline, "no question: {}", text(&seen));
        let n = stdout.read(&mut buf).expect("read the terminal");
        assert!(
            n > 0,
            "the terminal closed before the question: {}",
            text(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(format!("{answer}\n").as_bytes())
        .expect("answer");
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).expect("read the rest");
    seen.extend_from_slice(&rest);
    let output = child.wait_with_output().expect("wait");
    Output {
        stdout: seen,
        ..output
    }
}

/// Reads a child's streamed output until `needle` shows (a turn's answer streams without a
/// newline until it ends, so lines would come too late).
pub(crate) fn wait_for_stream(from: &mut impl Read, needle: &str) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !text(&seen).contains(needle) {
        let n = from.read(&mut buf).expect("read");
        assert!(n > 0, "{needle:?} never streamed: {}", text(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
}

/// `Command::new(program)` with the arguments and environment of `self`.
trait SpawnWith {
    fn spawn_with_program(&mut self, program: &str) -> Child;
}

impl SpawnWith for std::process::Command {
    fn spawn_with_program(&mut self, program: &str) -> Child {
        let mut command = std::process::Command::new(program);
        command.args(self.get_args());
        for (key, value) in self.get_envs() {
            match value {
                Some(value) => command.env(key, value),
                None => command.env_remove(key),
            };
        }
        if let Some(dir) = self.get_current_dir() {
            command.current_dir(dir);
        }
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
    }
}

/// On a terminal, `delete` asks with the session's turns and deletes only on "y"; without one
/// it refuses with the usage status, saying to pass --yes, and changes nothing; `--yes`
/// deletes without asking and `--json` says what went. The store then checks clean, the
/// session is not found, and its id is not taken again.
#[test]
fn delete_asks_on_a_terminal_and_needs_yes_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = root.join("store");
    let data = data.to_str().unwrap();
    let model = model(root, "m", 0, &["one", "two", "three"]);
    run_turn(root, data, &model, "kept");
    run_turn(root, data, &model, "asked");
    run_turn(root, data, &model, "asked");
    run_turn(root, data, &model, "scripted");
    let before = listed(root, data);
    assert_eq!(before.len(), 3, "{before:?}");

    let refused = cairn(root, &["delete", "--data", data, "asked"]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr)
            .contains("no terminal to confirm on: pass --yes to delete session asked"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(listed(root, data), before, "a refusal changes nothing");

    let declined = delete_on_a_terminal(root, data, "asked", "n");
    let shown = text(&declined.stdout);
    assert!(declined.status.success(), "{shown}");
    assert!(
        shown.contains("delete session asked (2 turns)? [y/N]")
            && shown.contains("not deleted: session asked is kept"),
        "{shown}"
    );
    assert_eq!(listed(root, data), before, "a no keeps the session");

    let accepted = delete_on_a_terminal(root, data, "asked", "y");
    let shown = text(&accepted.stdout);
    assert!(accepted.status.success(), "{shown}");
    assert!(shown.contains("deleted session asked ("), "{shown}");

    let json = cairn(
        root,
        &["delete", "--data", data, "scripted", "--yes", "--json"],
    );
    assert!(json.status.success(), "{}", text(&json.stderr));
    let value: serde_json::Value =
        serde_json::from_str(text(&json.stdout).trim()).expect("one JSON object");
    let events = before
        .iter()
        .find(|(id, _)| id == "scripted")
        .map(|(_, n)| *n)
        .unwrap();
    assert_eq!(
        value,
        serde_json::json!({"session_id": "scripted", "deleted": true, "events": events})
    );

    let kept: Vec<_> = before.into_iter().filter(|(id, _)| id == "kept").collect();
    assert_eq!(
        listed(root, data),
        kept,
        "only the kept session is left, as it was"
    );
    assert_fsck_clean(root, data);
    for args in [
        vec!["delete", "--data", data, "asked", "--yes"],
        vec!["history", "--data", data, "asked"],
        vec!["describe", "--data", data, "scripted"],
    ] {
        let gone = cairn(root, &args);
        assert_eq!(
            gone.status.code(),
            Some(3),
            "{args:?}: {}",
            text(&gone.stderr)
        );
    }
    let again = cairn(
        root,
        &[
            "run",
            "--data",
            data,
            "--model",
            &model,
            "--session",
            "asked",
            "hi",
        ],
    );
    assert!(!again.status.success());
    assert!(
        text(&again.stderr).contains("was deleted; its id cannot be used again"),
        "{}",
        text(&again.stderr)
    );
    assert_fsck_clean(root, data);
}

/// A session whose turn was left running (a second Ctrl-C) is refused with the busy status
/// (4), saying why, and stays whole; once its turn is cancelled, it is deleted.
#[test]
fn a_running_session_is_refused_until_its_turn_ends() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = root.join("store");
    let data = data.to_str().unwrap();
    let slow = model(
        root,
        "slow",
        150,
        &["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron"],
    );
    let mut run = cairn_command()
        .current_dir(root)
        .args([
            "run",
            "--data",
            data,
            "--model",
            &slow,
            "--session",
            "r",
            "talk",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cairn run");
    wait_for_stream(run.stdout.as_mut().unwrap(), "alpha");
    // Killed mid-turn: the session stays running, as after a second Ctrl-C.
    run.kill().expect("kill");
    run.wait().expect("wait");
    let before = listed(root, data);

    let busy = cairn(root, &["delete", "--data", data, "r", "--yes"]);
    assert_eq!(busy.status.code(), Some(4), "{}", text(&busy.stderr));
    assert!(
        text(&busy.stderr).contains("cannot be deleted: a turn is running"),
        "{}",
        text(&busy.stderr)
    );
    assert_eq!(
        listed(root, data),
        before,
        "a refused delete changes nothing"
    );

    let cancel = cairn(root, &["cancel", "--data", data, "--turn", "r"]);
    assert!(cancel.status.success(), "{}", text(&cancel.stderr));
    let deleted = cairn(root, &["delete", "--data", data, "r", "--yes"]);
    assert!(deleted.status.success(), "{}", text(&deleted.stderr));
    assert!(listed(root, data).is_empty());
    assert_fsck_clean(root, data);
}

/// Processes deleting sessions, SIGKILLed at moments spread over their lives (opening the
/// store, deleting, closing): afterwards the store opens, fsck is clean, each session is
/// wholly there (every event) or wholly gone, and each delete that was acknowledged stuck.
#[test]
fn a_sigkill_mid_delete_leaves_each_session_whole_or_gone() {
    const SESSIONS: usize = 12;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = root.join("store");
    let data = data.to_str().unwrap();
    let model = model(root, "m", 0, &["done"]);
    for n in 0..SESSIONS {
        run_turn(root, data, &model, &format!("s{n}"));
    }
    let before = listed(root, data);
    assert_eq!(before.len(), SESSIONS);
    // How long one delete takes from spawn to exit, to spread the kills over it.
    let started = Instant::now();
    let probe = cairn(root, &["delete", "--data", data, "s0", "--yes"]);
    assert!(probe.status.success(), "{}", text(&probe.stderr));
    let life = started.elapsed();
    let mut acknowledged = vec!["s0".to_owned()];
    for n in 1..SESSIONS {
        let session = format!("s{n}");
        let mut child = cairn_command()
            .current_dir(root)
            .args(["delete", "--data", data, &session, "--yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn cairn delete");
        std::thread::sleep(life.mul_f64(n as f64 / SESSIONS as f64));
        // SIGKILL, unless it is done already.
        let _ = child.kill();
        let output = child.wait_with_output().expect("wait");
        if text(&output.stdout).contains(&format!("deleted session {session}")) {
            acknowledged.push(session);
        }
    }
    assert_fsck_clean(root, data);
    let after = listed(root, data);
    for (session, events) in &after {
        assert!(
            before.contains(&(session.clone(), *events)),
            "{session} must be whole ({events} events) or gone: {before:?}"
        );
        assert!(
            !acknowledged.contains(session),
            "{session}'s delete was acknowledged"
        );
        let history = cairn(root, &["history", "--data", data, session, "--json"]);
        assert!(history.status.success(), "{}", text(&history.stderr));
        assert_eq!(text(&history.stdout).lines().count() as u64, *events);
    }
    for (session, _) in &before {
        if after.iter().all(|(id, _)| id != session) {
            let gone = cairn(root, &["history", "--data", data, session]);
            assert_eq!(gone.status.code(), Some(3), "{session} is wholly gone");
        }
    }
    // The survivors are deleted in the end, and the store stays clean.
    for (session, _) in &after {
        let deleted = cairn(root, &["delete", "--data", data, session, "--yes"]);
        assert!(deleted.status.success(), "{}", text(&deleted.stderr));
    }
    assert!(listed(root, data).is_empty());
    assert_fsck_clean(root, data);
}

/// A `cairn server` child on a free loopback port; killed when dropped.
pub(crate) struct Server {
    child: Child,
    pub(crate) base: String,
}

impl Server {
    pub(crate) fn start(dir: &Path, data: &str) -> Server {
        let mut child = cairn_command()
            .current_dir(dir)
            .args(["server", "--data", data, "--listen", "127.0.0.1:0"])
            .args(["--local-workers", "2"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start cairn server");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let base = loop {
            line.clear();
            assert!(
                lines.read_line(&mut line).expect("read") > 0,
                "cairn server ended before it listened"
            );
            if let Some(url) = line.trim().strip_prefix("listening on ") {
                break url.to_owned();
            }
        };
        // Keep draining its stdout so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines.lines() {});
        Server { child, base }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Through a server: `DELETE /v1/sessions/{id}` answers 409 `session_busy` while the turn
/// runs, 200 with the event count once it ended, 404 for an unknown or deleted session; the
/// history is gone over HTTP; `cairn delete --server` deletes too, and says "not found"
/// (exit 3) for a session that is not there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_through_a_server_is_refused_while_running_and_not_found_after() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let data = root.join("store");
    let data = data.to_str().unwrap().to_owned();
    let slow = model(
        &root,
        "slow",
        150,
        &["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi"],
    );
    let quick = model(&root, "quick", 0, &["done"]);
    let server = Server::start(&root, &data);
    let base = server.base.clone();
    let http = reqwest::Client::new();
    let delete = |id: &str| http.delete(format!("{base}/v1/sessions/{id}")).send();

    let unknown = delete("nobody").await.expect("DELETE");
    assert_eq!(unknown.status().as_u16(), 404);
    let body: serde_json::Value = unknown.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "not_found", "{body}");

    let mut run = cairn_command()
        .current_dir(&root)
        .args([
            "run",
            "--server",
            &base,
            "--model",
            &slow,
            "--session",
            "busy",
            "talk",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cairn run");
    let mut stdout = run.stdout.take().unwrap();
    wait_for_stream(&mut stdout, "alpha");
    let busy = delete("busy").await.expect("DELETE");
    assert_eq!(busy.status().as_u16(), 409);
    let body: serde_json::Value = busy.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "session_busy", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("a turn is running")),
        "{body}"
    );
    let cli_busy = cairn(&root, &["delete", "--server", &base, "busy", "--yes"]);
    assert_eq!(
        cli_busy.status.code(),
        Some(4),
        "{}",
        text(&cli_busy.stderr)
    );
    let ran = tokio::task::spawn_blocking(move || {
        let _ = std::io::copy(&mut stdout, &mut std::io::sink());
        run.wait().expect("wait")
    })
    .await
    .expect("join");
    assert!(ran.success(), "the turn completes through the server");

    let history = http
        .get(format!("{base}/v1/sessions/busy/history"))
        .send()
        .await
        .expect("GET");
    let events = history.json::<serde_json::Value>().await.expect("JSON")["events"]
        .as_array()
        .map(Vec::len)
        .expect("events") as u64;
    // A client following the session when it is deleted is told so, and its stream ends.
    let followed = http
        .get(format!("{base}/v1/sessions/busy/events?after_seq={events}"))
        .send()
        .await
        .expect("GET events");
    assert_eq!(followed.status().as_u16(), 200);
    let rest = tokio::spawn(followed.text());
    // And so is a remote client's stream, as the error of its own: connected once it has
    // the last event.
    let remote = cairn_remote::connect(&base, None).expect("client");
    let mut remote_stream = remote
        .subscribe("busy", events - 1)
        .await
        .expect("subscribe");
    let first = remote_stream.next().await.expect("the last event");
    assert!(
        matches!(&first, Ok(cairn_runtime::wire::StreamEvent::Event(e)) if e.seq == events),
        "{first:?}"
    );
    let deleted = delete("busy").await.expect("DELETE");
    assert_eq!(deleted.status().as_u16(), 200);
    let rest = tokio::time::timeout(Duration::from_secs(10), rest)
        .await
        .expect("the stream ends once its session is deleted")
        .expect("join")
        .expect("the stream's body");
    assert!(
        rest.contains("event: error")
            && rest.contains(r#""code":"conflict""#)
            && rest.contains(r#"session \"busy\" was deleted"#),
        "{rest}"
    );
    let remote_end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match remote_stream.next().await {
                Some(Ok(cairn_runtime::wire::StreamEvent::Delta(_))) => {}
                other => return other,
            }
        }
    })
    .await
    .expect("the remote stream ends once its session is deleted");
    assert!(
        matches!(&remote_end, Some(Err(cairn_runtime::Error::SessionDeleted { session_id })) if session_id == "busy"),
        "{remote_end:?}"
    );
    let body: serde_json::Value = deleted.json().await.expect("JSON");
    assert_eq!(
        body,
        serde_json::json!({"session_id": "busy", "events": events})
    );
    let again = delete("busy").await.expect("DELETE");
    assert_eq!(again.status().as_u16(), 404);
    let gone = http
        .get(format!("{base}/v1/sessions/busy/history"))
        .send()
        .await
        .expect("GET");
    assert_eq!(gone.status().as_u16(), 404);

    let out = cairn(
        &root,
        &[
            "run",
            "--server",
            &base,
            "--model",
            &quick,
            "--session",
            "q",
            "hi",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = cairn(
        &root,
        &["delete", "--server", &base, "q", "--yes", "--json"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let value: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).expect("JSON");
    assert_eq!(value["session_id"], "q");
    assert_eq!(value["deleted"], true);
    let out = cairn(&root, &["delete", "--server", &base, "q", "--yes"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    // An id no session can have is the client's own typed error through a server too, and
    // a usage error (exit 2) to the CLI.
    let err = remote.describe("bad id!").await.unwrap_err();
    assert!(
        matches!(&err, cairn_runtime::Error::InvalidSessionId { session_id } if session_id == "bad id!"),
        "{err:?}"
    );
    let out = cairn(&root, &["delete", "--server", &base, "bad id!", "--yes"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("invalid session id"),
        "{}",
        text(&out.stderr)
    );
    let listing = cairn(&root, &["sessions", "--server", &base]);
    assert!(
        text(&listing.stdout).contains("no sessions"),
        "{}",
        text(&listing.stdout)
    );
    drop(server);
    assert_fsck_clean(&root, &data);
}
