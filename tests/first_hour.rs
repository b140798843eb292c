//! A newcomer's first hour with the `cairn` binary (issue 12): a session works in the directory
//! it started in wherever it is resumed from; the live view of a turn; Ctrl-C; exit codes by
//! case; `describe`; `sessions` filters and columns; `--json`; `run -`; completions.

use crate::support::cairn_command;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn cairn_at(dir: &Path, args: &[&str]) -> Output {
    cairn_command()
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run cairn")
}

fn events(data: &Path, session: &str) -> Vec<serde_json::Value> {
    let out = cairn_at(
        data.parent().unwrap(),
        &[
            "history",
            "--data",
            data.to_str().unwrap(),
            session,
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn kinds(events: &[serde_json::Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect()
}

/// A script file in `dir`; returns the `--model` value.
fn script(dir: &Path, name: &str, body: &str) -> String {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, body).unwrap();
    format!("scripted:{}", path.display())
}

/// A `cairn` child whose stdout and stderr are collected as they come.
pub(crate) struct Running {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

fn collect(mut from: impl Read + Send + 'static) -> Arc<Mutex<String>> {
    let seen = Arc::new(Mutex::new(String::new()));
    let sink = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    seen
}

impl Running {
    pub(crate) fn spawn(dir: &Path, args: &[&str]) -> Running {
        let mut child = cairn_command()
            .current_dir(dir)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn cairn");
        let stdout = collect(child.stdout.take().unwrap());
        let stderr = collect(child.stderr.take().unwrap());
        Running {
            child,
            stdout,
            stderr,
        }
    }

    pub(crate) fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    pub(crate) fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Waits until `needle` was printed on stdout (`on_stderr`: on stderr).
    pub(crate) fn wait_for(&mut self, needle: &str, on_stderr: bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let seen = if on_stderr {
                self.stderr()
            } else {
                self.stdout()
            };
            if seen.contains(needle) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{needle:?} never printed:\n{}\n{}",
                self.stdout(),
                self.stderr()
            );
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "the child ended before printing {needle:?}:\n{}\n{}",
                self.stdout(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub(crate) fn signal(&self, signal: i32) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) on our own child's pid, with a valid signal number.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// Waits for the child to end (a minute at most); its exit code.
    pub(crate) fn finish(mut self) -> (Option<i32>, String, String) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "the child did not end");
            std::thread::sleep(Duration::from_millis(10));
        };
        // Let the readers drain the pipes.
        std::thread::sleep(Duration::from_millis(100));
        (status.code(), self.stdout(), self.stderr())
    }
}

/// Issue 12, defect 2: a turn interrupted before its `read_file` ran, resumed from another
/// directory, reads the file where the session started (not "no such file", not the other
/// directory's file of the same name). The directory is recorded in `session_started`.
#[test]
fn a_turn_resumed_from_another_directory_reads_where_its_session_started() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let (here, elsewhere) = (root.join("here"), root.join("elsewhere"));
    for (d, notes) in [(&here, "the notes of here"), (&elsewhere, "decoy notes")] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("notes.txt"), notes).unwrap();
    }
    std::fs::create_dir_all(root.join("empty")).unwrap();
    let data = root.join("store");
    let data_str = data.to_str().unwrap();
    // The first answer streams slowly, then calls read_file: a kill while it streams leaves
    // the read for the resumed turn.
    let model = script(
        &root,
        "reader",
        r#"{"chunk_delay_ms": 100, "responses": [
            {"parts": [
                {"type": "text", "text": "one two three four five six seven eight nine ten eleven twelve"},
                {"type": "tool_use", "id": "toolu_read", "name": "read_file", "input": {"path": "notes.txt"}}
            ]},
            {"parts": [{"type": "text", "text": "I read it."}]}
        ]}"#,
    );
    let mut run = Running::spawn(
        &here,
        &[
            "run",
            "--data",
            data_str,
            "--model",
            &model,
            "--session",
            "w",
            "read the notes",
        ],
    );
    run.wait_for("one two", false);
    run.signal(libc::SIGKILL);
    let (code, _, _) = run.finish();
    assert_eq!(code, None, "killed by a signal");
    let before = events(&data, "w");
    assert_eq!(
        before[0]["event"]["session_started"]["workdir"],
        here.to_str().unwrap(),
        "the session records where it started"
    );
    assert!(!kinds(&before).contains(&"tool_call_completed".to_owned()));

    // From a directory without notes.txt, then one with another notes.txt: the session's own
    // directory is used.
    let resume = cairn_at(&root.join("empty"), &["resume", "--data", data_str]);
    assert!(
        resume.status.success(),
        "{}{}",
        text(&resume.stdout),
        text(&resume.stderr)
    );
    let after = events(&data, "w");
    let result = after
        .iter()
        .find(|e| e["kind"] == "tool_call_completed")
        .expect("the read ran");
    assert_eq!(
        result["event"]["tool_call_completed"]["content"]["text"], "the notes of here",
        "{result}"
    );
    assert_eq!(result["event"]["tool_call_completed"]["is_error"], false);
    // The resumed turn streamed its answer (a single session prints as run does).
    let stdout = text(&resume.stdout);
    assert!(
        stdout.contains("[result] read_file: the notes of here") && stdout.contains("I read it."),
        "{stdout}"
    );
    assert!(stdout.contains("w: turn 1 completed"), "{stdout}");

    // `describe` shows the directory; another --workdir for the session is refused (exit 2),
    // and nothing is written.
    let described = cairn_at(&elsewhere, &["describe", "--data", data_str, "w", "--json"]);
    let described: serde_json::Value = serde_json::from_slice(&described.stdout).unwrap();
    assert_eq!(described["workdir"], here.to_str().unwrap());
    let refused = cairn_at(
        &elsewhere,
        &[
            "run",
            "--data",
            data_str,
            "--model",
            &model,
            "--session",
            "w",
            "--workdir",
            ".",
            "again",
        ],
    );
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("applies only when a session starts"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(events(&data, "w").len(), after.len());
}

/// The live view: the session id first, each tool call with its arguments, each result,
/// each retry with its cause and delay, and a call that waits for approval; the approval from
/// another command lets the turn finish.
#[test]
fn run_shows_tool_calls_results_retries_and_approvals_as_they_happen() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    std::fs::write(root.join("notes.txt"), "launch on Tuesday").unwrap();
    let data = root.join("store");
    let data_str = data.to_str().unwrap();
    let model = script(
        &root,
        "live",
        r#"{"responses": [
            {"parts": [
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_calc", "name": "calculator", "input": {"expression": "6*7"}},
                {"type": "tool_use", "id": "toolu_notes", "name": "read_file", "input": {"path": "notes.txt"}}
            ], "fail_attempts": 1},
            {"parts": [{"type": "text", "text": "It is 42 and Tuesday."}]}
        ]}"#,
    );
    let mut run = Running::spawn(
        &root,
        &[
            "run",
            "--data",
            data_str,
            "--model",
            &model,
            "--session",
            "live",
            "--ask",
            "read_file",
            "go",
        ],
    );
    run.wait_for("[approval needed] read_file", false);
    let approve = cairn_at(
        &root,
        &["approve", "--data", data_str, "live", "toolu_notes"],
    );
    assert!(approve.status.success(), "{}", text(&approve.stderr));
    let (code, stdout, stderr) = run.finish();
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stderr.starts_with("new session live"),
        "the session id comes first: {stderr}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("{needle:?} not in:\n{stdout}"))
    };
    let retry = at("[retry: model call 0 attempt 1 failed (");
    assert!(
        lines[retry].contains("; attempt 2 in "),
        "the retry says its delay: {}",
        lines[retry]
    );
    let calc = at(r#"[tool] calculator {"expression":"6*7"}"#);
    let calc_result = at(r#"[result] calculator: {"expression":"6*7","value":42}"#);
    let asked =
        at(r#"[approval needed] read_file {"path":"notes.txt"} (`cairn approve live toolu_notes`"#);
    let approved = at("[approved] read_file toolu_notes");
    let scheduled = at(r#"[tool] read_file {"path":"notes.txt"}"#);
    let result = at("[result] read_file: launch on Tuesday");
    let answer = at("It is 42 and Tuesday.");
    assert!(retry < calc && calc < calc_result, "{stdout}");
    assert!(
        asked < approved && approved < scheduled && scheduled < result && result < answer,
        "{stdout}"
    );
    // What it showed is what the history records.
    let history = kinds(&events(&data, "live"));
    for kind in [
        "model_call_failed",
        "tool_approval_requested",
        "tool_call_approved",
        "turn_completed",
    ] {
        assert!(history.contains(&kind.to_owned()), "{history:?}");
    }
}

/// A slowly streaming script: the turn runs for seconds, long enough for Ctrl-C.
fn slow_model(dir: &Path) -> String {
    script(
        dir,
        "slow",
        r#"{"chunk_delay_ms": 150, "responses": [
            {"parts": [{"type": "text", "text": "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma"}]},
            {"parts": [{"type": "text", "text": "second answer"}]}
        ]}"#,
    )
}

/// Ctrl-C once: the turn is cancelled durably (the history records it), the message says so,
/// and the exit status is "turn cancelled" (6).
#[test]
fn ctrl_c_cancels_the_turn_durably_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let data = root.join("store");
    let model = slow_model(&root);
    let mut run = Running::spawn(
        &root,
        &[
            "run",
            "--data",
            data.to_str().unwrap(),
            "--model",
            &model,
            "--session",
            "c",
            "talk",
        ],
    );
    run.wait_for("alpha beta", false);
    run.signal(libc::SIGINT);
    let (code, stdout, stderr) = run.finish();
    assert_eq!(code, Some(6), "{stdout}{stderr}");
    assert!(
        stderr.contains("^C: cancelling turn 1 of session c")
            && stderr.contains("cancelled turn 1 of session c (recorded in its history)"),
        "{stderr}"
    );
    let history = events(&data, "c");
    let cancelled = history
        .iter()
        .find(|e| e["kind"] == "turn_cancelled")
        .expect("the cancellation is recorded");
    assert_eq!(
        cancelled["event"]["turn_cancelled"]["reason"],
        "cancelled with Ctrl-C"
    );
    assert!(!kinds(&history).contains(&"turn_completed".to_owned()));
    // The session takes its next turn.
    let next = cairn_at(
        &root,
        &[
            "run",
            "--data",
            data.to_str().unwrap(),
            "--model",
            &model,
            "--session",
            "c",
            "again",
        ],
    );
    assert!(next.status.success(), "{}", text(&next.stderr));
}

/// Ctrl-C twice: the turn is left running (nothing cancelled), the message says how to
/// resume or cancel it, the exit status is 130; `cairn resume` then finishes it, streaming.
#[test]
fn a_second_ctrl_c_leaves_the_turn_for_resume() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let data = root.join("store");
    let data_str = data.to_str().unwrap();
    let model = slow_model(&root);
    let mut run = Running::spawn(
        &root,
        &[
            "run",
            "--data",
            data_str,
            "--model",
            &model,
            "--session",
            "l",
            "talk",
        ],
    );
    run.wait_for("alpha beta", false);
    run.signal(libc::SIGINT);
    run.wait_for("press Ctrl-C again", true);
    run.signal(libc::SIGINT);
    let (code, stdout, stderr) = run.finish();
    assert_eq!(code, Some(130), "{stdout}{stderr}");
    assert!(
        stderr.contains("left turn 1 of session l running; nothing was cancelled")
            && stderr.contains(&format!("`cairn resume --data {data_str}`"))
            && stderr.contains(&format!("`cairn cancel --data {data_str} --turn l`")),
        "{stderr}"
    );
    let history = kinds(&events(&data, "l"));
    assert!(
        !history.contains(&"turn_cancelled".to_owned()),
        "{history:?}"
    );
    let listing = text(
        &cairn_at(
            &root,
            &["sessions", "--data", data_str, "--status", "running"],
        )
        .stdout,
    );
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("l ") && l.contains("running")),
        "{listing}"
    );
    let resume = cairn_at(&root, &["resume", "--data", data_str]);
    let stdout = text(&resume.stdout);
    assert!(resume.status.success(), "{stdout}{}", text(&resume.stderr));
    assert!(
        stdout.contains("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma")
            && stdout.contains("l: turn 1 completed"),
        "resume streams the answer: {stdout}"
    );
    assert!(kinds(&events(&data, "l")).contains(&"turn_completed".to_owned()));
}

/// Several sessions resumed at once stream as whole lines, each prefixed with its session.
#[test]
fn resume_of_several_sessions_prefixes_their_lines() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let data = root.join("store");
    let data_str = data.to_str().unwrap();
    let model = slow_model(&root);
    for id in ["p1", "p2"] {
        let mut run = Running::spawn(
            &root,
            &[
                "run",
                "--data",
                data_str,
                "--model",
                &model,
                "--session",
                id,
                "go",
            ],
        );
        run.wait_for("alpha", false);
        run.signal(libc::SIGKILL);
        run.finish();
    }
    let resume = cairn_at(&root, &["resume", "--data", data_str]);
    let stdout = text(&resume.stdout);
    assert!(resume.status.success(), "{stdout}{}", text(&resume.stderr));
    for id in ["p1", "p2"] {
        assert!(
            stdout.lines().any(|l| l == format!("{id}: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!("{id}: turn 1 completed")),
            "{stdout}"
        );
    }
}

/// Exit codes tell cases apart: usage (2), not found (3), store busy (4), turn failed (5),
/// turn cancelled (6, in the Ctrl-C test), replay diverged or fsck problems (7).
#[test]
fn exit_codes_tell_cases_apart() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let data = root.join("store");
    let data_str = data.to_str().unwrap();
    let code = |args: &[&str]| cairn_at(&root, args).status.code();
    let calls_a_tool = script(
        &root,
        "tool",
        r#"{"responses": [
            {"parts": [{"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "1+1"}}]},
            {"parts": [{"type": "text", "text": "2"}]}
        ]}"#,
    );
    // Usage: clap's and ours.
    assert_eq!(code(&["sessions", "--no-such-flag"]), Some(2));
    assert_eq!(
        code(&["run", "--data", data_str, "--model", "nope", "hi"]),
        Some(2)
    );
    assert_eq!(
        code(&["sessions", "--data", data_str, "--status", "sleeping"]),
        Some(2)
    );
    // A failed turn: one model call allowed, and the model asks for a tool.
    assert_eq!(
        code(&[
            "run",
            "--data",
            data_str,
            "--model",
            &calls_a_tool,
            "--session",
            "f",
            "--max-rounds",
            "1",
            "hi",
        ]),
        Some(5)
    );
    // Not found.
    assert_eq!(code(&["describe", "--data", data_str, "nope"]), Some(3));
    assert_eq!(code(&["history", "--data", data_str, "nope"]), Some(3));
    // Busy: another process holds the store (and serves no socket).
    let rt = tokio::runtime::Runtime::new().unwrap();
    let held = rt
        .block_on(cairn_runtime::store::embedded::open(
            &data,
            cairn_runtime::store::embedded::OpenMode::Existing,
            None,
        ))
        .unwrap();
    assert_eq!(code(&["fsck", "--data", data_str]), Some(4));
    drop(held);
    // Unreachable server.
    assert_eq!(
        code(&["sessions", "--server", "http://127.0.0.1:1"]),
        Some(4)
    );
    // A replay that diverges: an export whose session_started claims a future workflow.
    let export = root.join("f.jsonl");
    assert_eq!(
        code(&[
            "export",
            "--data",
            data_str,
            "f",
            "-o",
            export.to_str().unwrap()
        ]),
        Some(0)
    );
    let exports = root.join("exports");
    std::fs::create_dir_all(&exports).unwrap();
    let lied = std::fs::read_to_string(&export).unwrap().replacen(
        "\"turn_failed\":{\"turn\":1,\"reason\":\"",
        "\"turn_failed\":{\"turn\":1,\"reason\":\"not ",
        1,
    );
    std::fs::write(exports.join("f.jsonl"), lied).unwrap();
    assert_eq!(
        code(&["replay", "--dir", exports.to_str().unwrap()]),
        Some(7)
    );
    assert_eq!(code(&["fsck", "--data", data_str]), Some(0));
}

/// `describe` and `sessions`: turns with their outcomes, model, usage, status and time
/// filters, readable columns, and the JSON forms of them, of `run`, `fsck` and `replay`.
#[test]
fn describe_sessions_and_json_forms() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let data = root.join("store");
    let data_str = data.to_str().unwrap();
    let model = script(
        &root,
        "two",
        r#"{"responses": [
            {"parts": [{"type": "text", "text": "first answer"}], "usage": {"input_tokens": 10, "output_tokens": 3}},
            {"parts": [{"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "1+1"}}], "usage": {"input_tokens": 20, "output_tokens": 4}}
        ]}"#,
    );
    // `run --json`: only the outcome on stdout; `-` reads the prompt from stdin.
    let mut child = cairn_command()
        .current_dir(&root)
        .args([
            "run",
            "--data",
            data_str,
            "--model",
            &model,
            "--session",
            "d",
            "--json",
            "-",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"a prompt from stdin\nover two lines\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let outcome: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        outcome,
        serde_json::json!({"session_id": "d", "outcome": {
            "status": "completed", "turn": 1, "answer": "first answer", "stop_reason": "end_turn",
            // The scripted model has no price: its attempt is counted, its cost unknown.
            "totals": {
                "usage": {"input_tokens": 10, "output_tokens": 3, "cache_read_tokens": 0,
                          "cache_write_tokens": 0, "reasoning_tokens": 0},
                "cost_micros": 0, "unpriced_attempts": 1, "model_calls": 1
            }
        }})
    );
    let history = events(&data, "d");
    assert_eq!(
        history[1]["event"]["user_message"]["text"],
        "a prompt from stdin\nover two lines"
    );
    // A second turn fails (one round only, and the model asks for a tool).
    let failed = cairn_at(
        &root,
        &[
            "run",
            "--data",
            data_str,
            "--model",
            &model,
            "--session",
            "e",
            "--max-rounds",
            "1",
            "x",
        ],
    );
    assert_eq!(failed.status.code(), Some(0), "the first answer completes");
    let failed = cairn_at(
        &root,
        &[
            "run",
            "--data",
            data_str,
            "--model",
            &model,
            "--session",
            "e",
            "--json",
            "y",
        ],
    );
    assert_eq!(failed.status.code(), Some(5));
    let outcome: serde_json::Value = serde_json::from_slice(&failed.stdout).unwrap();
    assert_eq!(outcome["outcome"]["status"], "failed", "{outcome}");

    let described = cairn_at(&root, &["describe", "--data", data_str, "e"]);
    let said = text(&described.stdout);
    assert!(described.status.success(), "{}", text(&described.stderr));
    for needle in [
        "session   e",
        "status    idle",
        &format!("model     {model}"),
        &format!("workdir   {}", root.display()),
        // No call options given: each stated with its default.
        "options   tool choice auto (default), server tools none, prompt cache on",
        "usage     30 in / 7 out tokens",
        "totals    37 tokens (30 in, 7 out, 0 cache read, 0 cache write), ",
        "attempt(s) unpriced)",
        "turns     2",
    ] {
        assert!(said.contains(needle), "{needle:?} in:\n{said}");
    }
    let turn_lines: Vec<&str> = said
        .lines()
        .filter(|l| {
            l.starts_with("    ") && l.trim_start().starts_with(|c: char| c.is_ascii_digit())
        })
        .collect();
    assert!(
        turn_lines[0].contains("completed") && turn_lines[0].contains("10 in / 3 out tokens"),
        "{said}"
    );
    assert!(turn_lines[1].contains("failed"), "{said}");
    let json: serde_json::Value = serde_json::from_slice(
        &cairn_at(&root, &["describe", "--data", data_str, "e", "--json"]).stdout,
    )
    .unwrap();
    let outcomes: Vec<&str> = json["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["completed", "failed"]);
    assert_eq!(json["turns"][0]["detail"], "first answer");
    assert_eq!(json["usage"]["input_tokens"], 30);
    assert_eq!(json["model"], model);
    assert_eq!(
        json["call_options"],
        serde_json::json!({"tool_choice": null, "server_tools": [], "prompt_cache": true})
    );

    // sessions: columns under a header, filters, JSON lines.
    let listing = text(&cairn_at(&root, &["sessions", "--data", data_str]).stdout);
    let lines: Vec<&str> = listing.lines().collect();
    assert!(
        lines[0].starts_with("SESSION  STATUS  MODEL") && lines[0].contains("LAST ACTIVITY"),
        "{listing}"
    );
    assert_eq!(lines.len(), 3, "{listing}");
    // Columns line up: each row's status starts where the header's does.
    let status_at = lines[0].find("STATUS").unwrap();
    assert!(
        lines[1..]
            .iter()
            .all(|l| &l[status_at..status_at + 4] == "idle"),
        "{listing}"
    );
    assert!(
        lines[2].starts_with("e ") && lines[2].contains("30 in / 7 out tokens"),
        "{listing}"
    );
    let json_lines = text(&cairn_at(&root, &["sessions", "--data", data_str, "--json"]).stdout);
    let listed: Vec<serde_json::Value> = json_lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[1]["session_id"], "e");
    assert_eq!(listed[1]["turns"], 2);
    assert_eq!(listed[1]["model"], model);
    assert_eq!(listed[1]["usage"]["output_tokens"], 7);
    let only = |args: &[&str]| {
        let mut all = vec!["sessions", "--data", data_str, "--json"];
        all.extend(args);
        text(&cairn_at(&root, &all).stdout).lines().count()
    };
    assert_eq!(only(&["--status", "idle"]), 2);
    assert_eq!(only(&["--status", "running"]), 0);
    assert_eq!(only(&["--since", "1h"]), 2);
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(only(&["--since", "1s"]), 0);
    let none = text(
        &cairn_at(
            &root,
            &["sessions", "--data", data_str, "--status", "cancelled"],
        )
        .stdout,
    );
    assert_eq!(none, "no sessions\n");

    // fsck and replay --json.
    let fsck: serde_json::Value =
        serde_json::from_slice(&cairn_at(&root, &["fsck", "--data", data_str, "--json"]).stdout)
            .unwrap();
    assert_eq!(fsck["clean"], true);
    assert_eq!(fsck["sessions"], 2);
    assert_eq!(fsck["problems"], serde_json::json!([]));
    let replayed: serde_json::Value = serde_json::from_slice(
        &cairn_at(&root, &["replay", "--data", data_str, "e", "--json"]).stdout,
    )
    .unwrap();
    assert_eq!(replayed["replays"], true);
    assert_eq!(replayed["events"], events(&data, "e").len());
}

/// `cairn completions SHELL` prints a script that knows the commands.
#[test]
fn completions_name_the_commands() {
    let dir = tempfile::tempdir().unwrap();
    for (shell, marker) in [
        ("bash", "_cairn()"),
        ("zsh", "#compdef cairn"),
        ("fish", "complete -c cairn"),
    ] {
        let out = cairn_at(dir.path(), &["completions", shell]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let script = text(&out.stdout);
        assert!(script.contains(marker), "{shell}: {script}");
        assert!(
            script.contains("describe") && script.contains("resume"),
            "{shell}"
        );
    }
    assert_eq!(
        cairn_at(dir.path(), &["completions", "tcsh"]).status.code(),
        Some(2)
    );
}

/// `cairn chat` with piped input: one turn per line, answers streamed, `/exit` ends it (what
/// follows is not sent); the end of input ends a chat too, and a later chat continues the
/// session.
#[test]
fn chat_takes_one_turn_per_line_until_exit_or_end_of_input() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let data = root.join("store");
    let data_str = data.to_str().unwrap();
    let model = script(
        &root,
        "chat",
        r#"{"responses": [
            {"parts": [{"type": "text", "text": "answer one"}]},
            {"parts": [{"type": "text", "text": "answer two"}]},
            {"parts": [{"type": "text", "text": "answer three"}]}
        ]}"#,
    );
    let chat = |input: &[u8]| {
        let mut child = cairn_command()
            .current_dir(&root)
            .args([
                "chat",
                "--data",
                data_str,
                "--model",
                &model,
                "--session",
                "talk",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        child.wait_with_output().unwrap()
    };
    let out = chat(b"first question\n\nsecond question\n/exit\nnever sent\n");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        text(&out.stderr).starts_with("new session talk"),
        "{}",
        text(&out.stderr)
    );
    let one = stdout.find("answer one").expect("first answer");
    let two = stdout.find("answer two").expect("second answer");
    assert!(one < two, "{stdout}");
    let messages = |events: &[serde_json::Value]| -> Vec<String> {
        events
            .iter()
            .filter(|e| e["kind"] == "user_message")
            .map(|e| {
                e["event"]["user_message"]["text"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(
        messages(&events(&data, "talk")),
        ["first question", "second question"]
    );
    // End of input without /exit; the same session goes on.
    let out = chat(b"third question");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("answer three"));
    assert_eq!(
        messages(&events(&data, "talk")),
        ["first question", "second question", "third question"]
    );
}

/// `demo` and `chaos` clean up after themselves unless asked to keep their data (the demo
/// closing its store first, quietly).
#[test]
fn demo_and_chaos_clean_up_unless_asked_to_keep() {
    let dir = tempfile::tempdir().unwrap();
    let default = dir.path().join("default");
    let in_default = |args: &[&str]| {
        cairn_command()
            .current_dir(dir.path())
            .env("CAIRN_DATA", &default)
            .args(args)
            .output()
            .unwrap()
    };
    let demo = in_default(&["demo"]);
    let stdout = text(&demo.stdout);
    assert!(demo.status.success(), "{stdout}{}", text(&demo.stderr));
    assert!(
        stdout.contains("a temporary one") && stdout.contains("removed"),
        "{stdout}"
    );
    assert!(
        !default.exists(),
        "the demo wrote nothing in the default store"
    );
    // It says nothing on stderr but its session and its turn's usage: its store is closed
    // before its directory goes, so no warning of files already removed follows the summary
    // (a follower of the session used to keep the store open until the process exited).
    let stderr = text(&demo.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines[0].starts_with("new session "), "{stderr}");
    assert!(lines[1].starts_with("turn 1: "), "{stderr}");
    let kept = in_default(&["demo", "--keep"]);
    assert!(kept.status.success(), "{}", text(&kept.stderr));
    let listed = in_default(&["sessions", "--json"]);
    assert_eq!(text(&listed.stdout).lines().count(), 1, "the kept session");

    // chaos: the data directory it made is removed after a passing run, kept with --keep.
    let chaos_dir = |out: &Output| -> std::path::PathBuf {
        let said = text(&out.stdout);
        assert!(out.status.success(), "{said}{}", text(&out.stderr));
        let line = said
            .lines()
            .find(|l| l.contains("chaos data"))
            .unwrap_or_else(|| panic!("{said}"))
            .to_owned();
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .unwrap()
            .to_owned();
        std::path::PathBuf::from(path)
    };
    let small = ["chaos", "--kills", "1", "--sessions", "1", "--turns", "1"];
    let removed = chaos_dir(&cairn_at(dir.path(), &small));
    assert!(!removed.exists(), "{}", removed.display());
    let mut keep = small.to_vec();
    keep.push("--keep");
    let kept = chaos_dir(&cairn_at(dir.path(), &keep));
    assert!(kept.join("store").exists(), "{}", kept.display());
    std::fs::remove_dir_all(kept).unwrap();
}
