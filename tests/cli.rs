//! The `cairn` binary: the demo, a run, inspection commands, and clear errors.

use crate::support::demo_files;
use std::path::Path;
use std::process::{Command, Output};

fn cairn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .output()
        .expect("run cairn")
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

#[test]
fn demo_runs_offline_and_its_store_can_be_inspected_and_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("demo");
    let out = cairn(&["demo", "--data", data.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("126") && stdout.contains("Tuesday"),
        "{stdout}"
    );
    // The demo streams for about half a second, so besides its 11 events it may record what
    // it streamed (model_attempt_progress) on the way; the counts below include those.
    let events: usize = stdout
        .split("events       ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no event count: {stdout}"));
    assert!(
        stdout.contains(&format!("events       {events} written durably")),
        "{stdout}"
    );
    let store = data.join("store");
    let store = store.to_str().unwrap();
    let sessions = cairn(&["sessions", "--data", store]);
    let listing = text(&sessions.stdout);
    let session = listing.split_whitespace().next().unwrap().to_owned();
    assert!(
        listing.contains("idle") && listing.contains(&format!("{events} events")),
        "{listing}"
    );

    let history = cairn(&["history", "--data", store, &session, "--json"]);
    assert!(history.status.success());
    let all: Vec<serde_json::Value> = text(&history.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(all.len(), events);
    let lines: Vec<&serde_json::Value> = all
        .iter()
        .filter(|e| e["kind"] != "model_attempt_progress")
        .collect();
    assert_eq!(lines.len(), 11);
    assert_eq!(lines[0]["kind"], "session_started");
    assert_eq!(lines[0]["seq"], 1);
    assert!(
        lines[3]["event"]["model_call_completed"]["response"]["parts"][0]["thinking"]["signature"]
            == "demo-signature-0001"
    );

    let plain = cairn(&["history", "--data", store, &session]);
    assert!(text(&plain.stdout).contains("tool_call_completed"));

    let transcript = cairn(&["transcript", "--data", store, &session]);
    let ledger: serde_json::Value = serde_json::from_slice(&transcript.stdout).unwrap();
    assert_eq!(ledger["messages"].as_array().unwrap().len(), 5);

    let replay = cairn(&["replay", "--data", store, &session]);
    assert!(replay.status.success(), "{}", text(&replay.stdout));
    assert!(text(&replay.stdout).starts_with(&format!("ok: {events} events")));
}

#[test]
fn run_starts_and_continues_a_session() {
    let files = demo_files(
        r#"{"responses": [
            {"parts": [{"type": "text", "text": "first answer"}]},
            {"parts": [{"type": "tool_use", "id": "c1", "name": "calculator", "input": {"expression": "6*7"}}]},
            {"parts": [{"type": "text", "text": "it is 42"}]}
        ]}"#,
    );
    let data = files.dir.path().join("store");
    let data = data.to_str().unwrap();
    let model = format!("scripted:{}", files.script.display());
    let workdir = files.workdir.to_str().unwrap();
    let first = cairn(&[
        "run",
        "--data",
        data,
        "--model",
        &model,
        "--session",
        "chat",
        "--workdir",
        workdir,
        "hello",
    ]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(text(&first.stdout).contains("first answer"));
    let second = cairn(&[
        "run",
        "--data",
        data,
        "--model",
        &model,
        "--session",
        "chat",
        "--workdir",
        workdir,
        "what is 6*7?",
    ]);
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert!(text(&second.stdout).contains("it is 42"));
    let replay = cairn(&["replay", "--data", data, "chat"]);
    assert!(replay.status.success());
    let resume = cairn(&["resume", "--data", data]);
    assert!(text(&resume.stdout).contains("nothing to resume"));
}

#[test]
fn errors_a_person_can_act_on_are_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let out = cairn(&["sessions", "--data", missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("error: cannot open store at") && err.contains("no store here"),
        "{err}"
    );
    assert!(!err.contains("panicked"));

    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let data = files.dir.path().join("store");
    let data = data.to_str().unwrap();
    let model = format!("scripted:{}", files.script.display());
    assert!(cairn(&[
        "run",
        "--data",
        data,
        "--model",
        &model,
        "--session",
        "x",
        "--workdir",
        files.workdir.to_str().unwrap(),
        "hi"
    ])
    .status
    .success());
    let out = cairn(&["history", "--data", data, "no-such-session"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("unknown session \"no-such-session\""),
        "{}",
        text(&out.stderr)
    );

    let bad = files.dir.path().join("bad.json");
    std::fs::write(&bad, "{\"responses\": [\n  {\"parts\": [}\n]}").unwrap();
    let out = cairn(&[
        "run",
        "--data",
        data,
        "--model",
        &format!("scripted:{}", bad.display()),
        "hi",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("bad.json") && err.contains("line 2"), "{err}");
    let _ = Path::new(".");
}

#[test]
fn an_interrupted_session_is_cancelled_from_the_command_line_and_stays_valid() {
    // A store whose session was interrupted mid-turn: the engine took the message, no worker ran.
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let data = files.dir.path().join("store");
    {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let store =
                std::sync::Arc::new(cairn_runtime::store::sled::SledStore::open(&data).unwrap());
            let engine =
                cairn_runtime::Engine::new(store, std::sync::Arc::new(cairn_runtime::SystemClock));
            let client = cairn_runtime::Client::new(engine);
            let tools = cairn_activities::ToolRegistry::builtin(&files.workdir);
            let model =
                cairn_ledger::ModelSpec::parse(&format!("scripted:{}", files.script.display()))
                    .unwrap();
            let mut options = cairn_runtime::SessionOptions::new(model, tools.specs());
            options.session_id = Some("stuck".into());
            client.start_session(options).await.unwrap();
            client.send("stuck", "go").await.unwrap();
        });
    }
    let data = data.to_str().unwrap();
    let listing = text(&cairn(&["sessions", "--data", data]).stdout);
    assert!(listing.contains("running"), "{listing}");
    let out = cairn(&[
        "cancel", "--data", data, "stuck", "--turn", "--reason", "operator",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim(),
        "cancelled turn 1 of session stuck"
    );
    let listing = text(&cairn(&["sessions", "--data", data]).stdout);
    assert!(listing.contains("idle"), "{listing}");
    let history = text(&cairn(&["history", "--data", data, "stuck"]).stdout);
    assert!(
        history.contains("turn_cancelled") && history.contains("operator"),
        "{history}"
    );
    assert!(cairn(&["replay", "--data", data, "stuck"]).status.success());
    assert!(cairn(&["fsck", "--data", data]).status.success());
    // Cancelling again: no turn is running — a clear error, not a panic.
    let again = cairn(&["cancel", "--data", data, "stuck", "--turn"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        text(&again.stderr).contains("no turn is running"),
        "{}",
        text(&again.stderr)
    );
    // The whole session can still be cancelled.
    assert!(cairn(&["cancel", "--data", data, "stuck"]).status.success());
    assert!(text(&cairn(&["sessions", "--data", data]).stdout).contains("cancelled"));
}

/// A `cairn` child whose stdout is collected as it streams.
struct Streaming {
    child: std::process::Child,
    seen: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Streaming {
    fn spawn(args: &[&str]) -> Streaming {
        use std::io::Read;
        let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn cairn");
        let mut stdout = child.stdout.take().unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = seen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Streaming { child, seen }
    }

    /// Waits until `needle` was printed, lets `linger` pass, then SIGKILLs the child.
    fn kill_after_printing(mut self, needle: &str, linger: std::time::Duration) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !self.seen.lock().unwrap().contains(needle) {
            assert!(
                std::time::Instant::now() < deadline,
                "{needle:?} never printed: {}",
                self.seen.lock().unwrap()
            );
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "the child ended early: {}",
                self.seen.lock().unwrap()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::thread::sleep(linger);
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the child ended before the kill"
        );
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let seen = self.seen.lock().unwrap().clone();
        seen
    }
}

fn history_json(data: &str, session: &str) -> Vec<u8> {
    let out = cairn(&["history", "--data", data, session, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    out.stdout
}

fn events_of(history: &[u8]) -> Vec<serde_json::Value> {
    text(history)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A slowly streaming scripted model: a long first answer (cut by a SIGKILL), then a short one.
fn slow_script(dir: &Path, name: &str, first: &str, second: &str) -> String {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(
        &path,
        format!(
            r#"{{"chunk_delay_ms": 120, "responses": [
                {{"parts": [{{"type": "text", "text": "{first}"}}]}},
                {{"parts": [{{"type": "text", "text": "{second}"}}]}}
            ]}}"#
        ),
    )
    .unwrap();
    format!("scripted:{}", path.display())
}

/// `run --session X` on a session whose turn was cut by a SIGKILL: the interrupted turn is
/// carried on first (saying what it had streamed, and that the answer is generated again),
/// then the new message runs as the next turn. Another interrupted session of the store is
/// not touched: its history stays byte for byte what it was.
#[test]
fn run_on_an_interrupted_session_finishes_that_turn_first_and_touches_no_other_session() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    let data = data.to_str().unwrap();
    let workdir = dir.path().to_str().unwrap();
    let alpha_first = "alpha one two three four five six seven eight nine ten eleven twelve";
    let alpha = slow_script(dir.path(), "alpha", alpha_first, "alpha second answer");
    let beta = slow_script(
        dir.path(),
        "beta",
        "beta one two three four five six seven eight nine ten eleven twelve",
        "beta second answer",
    );
    let run_args = |model: &str, session: &str, prompt: &str| -> Vec<String> {
        [
            "run",
            "--data",
            data,
            "--model",
            model,
            "--session",
            session,
            "--workdir",
            workdir,
            prompt,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let spawn =
        |args: Vec<String>| Streaming::spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // Both sessions are killed while their first answers stream, after a progress record.
    let linger = std::time::Duration::from_millis(400);
    spawn(run_args(&alpha, "alpha", "first")).kill_after_printing("alpha one two", linger);
    let beta_seen =
        spawn(run_args(&beta, "beta", "first")).kill_after_printing("beta one two", linger);
    assert!(
        !beta_seen.contains("alpha"),
        "beta's run printed alpha's work: {beta_seen}"
    );
    let alpha_before = history_json(data, "alpha");
    let beta_before = history_json(data, "beta");
    let listing = text(&cairn(&["sessions", "--data", data]).stdout);
    assert_eq!(listing.matches("running").count(), 2, "{listing}");
    // Beta's run left alpha's history alone too.
    let alpha_streamed: String = events_of(&alpha_before)
        .iter()
        .filter(|e| e["kind"] == "model_attempt_progress")
        .map(|e| {
            e["event"]["model_attempt_progress"]["text_appended"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(
        alpha_streamed.starts_with("alpha one two") && alpha_first.starts_with(&alpha_streamed),
        "{alpha_streamed:?}"
    );

    let out = cairn(
        &run_args(&alpha, "alpha", "next")
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("turn 1 was interrupted; continuing it first"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "had streamed {} characters of its answer: {:?}",
            alpha_streamed.chars().count(),
            alpha_streamed.trim_end()
        )) && stdout.contains("the answer is being generated again"),
        "{stdout}"
    );
    // The old turn's whole answer, then the new turn's, in that order.
    let old = stdout.rfind(alpha_first).expect("the first answer streams");
    let new = stdout
        .find("alpha second answer")
        .expect("the second answer");
    assert!(old < new, "{stdout}");

    let after = history_json(data, "alpha");
    assert_eq!(after[..alpha_before.len()], alpha_before[..]);
    let events = events_of(&after);
    let count = |kind: &str| events.iter().filter(|e| e["kind"] == kind).count();
    assert_eq!(count("user_message"), 2);
    assert_eq!(count("turn_completed"), 2);
    let completed: Vec<(u64, u64)> = events
        .iter()
        .filter(|e| e["kind"] == "model_call_completed")
        .map(|e| {
            let c = &e["event"]["model_call_completed"];
            (c["turn"].as_u64().unwrap(), c["round"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(completed, [(1, 0), (2, 0)]);
    assert!(cairn(&["replay", "--data", data, "alpha"]).status.success());

    // Beta: byte for byte as the kill left it, and still waiting for `cairn resume`.
    assert_eq!(history_json(data, "beta"), beta_before);
    let listing = text(&cairn(&["sessions", "--data", data]).stdout);
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("beta ") && l.contains("running")),
        "{listing}"
    );
    let resume = cairn(&["resume", "--data", data, "--workdir", workdir]);
    let stdout = text(&resume.stdout);
    assert!(
        resume.status.success(),
        "{stdout}\n{}",
        text(&resume.stderr)
    );
    assert!(
        stdout.contains("beta: [interrupted: turn 1")
            && stdout.contains("being generated again")
            && stdout.contains("beta: turn 1 completed"),
        "{stdout}"
    );
    assert!(cairn(&["fsck", "--data", data]).status.success());
}
