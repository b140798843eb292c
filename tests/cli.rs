//! The `cairn` binary: the demo, a run, inspection commands, and clear errors.

use crate::support::{cairn_command, demo_files};
use std::path::Path;
use std::process::Output;
use std::sync::Arc;

fn cairn(args: &[&str]) -> Output {
    cairn_command().args(args).output().expect("run cairn")
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
    // `--data` names the store itself, for the demo as for every other command.
    let store = data.to_str().unwrap();
    let sessions = cairn(&["sessions", "--data", store]);
    let listing = text(&sessions.stdout);
    // Under the column header, the session's row starts with its id.
    assert!(listing.starts_with("SESSION "), "{listing}");
    let session = listing
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
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
    // Not found has its own exit status.
    assert_eq!(out.status.code(), Some(3));
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
        let mut child = cairn_command()
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

/// Runs `cairn` with `default` as its default data directory (`CAIRN_DATA`).
fn cairn_in(default: &Path, args: &[&str]) -> Output {
    cairn_command()
        .env("CAIRN_DATA", default)
        .args(args)
        .output()
        .expect("run cairn")
}

/// A store at `data` (made if missing) with session `id` interrupted mid-turn: the engine took
/// its message, no worker ran.
fn interrupted_session(data: &Path, id: &str, script: &Path) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let opened = cairn_runtime::store::embedded::open(
            data,
            cairn_runtime::store::embedded::OpenMode::Create,
            None,
        )
        .await
        .unwrap();
        let engine = cairn_runtime::Engine::new(
            opened.store.clone(),
            std::sync::Arc::new(cairn_runtime::SystemClock),
        );
        let client = cairn_runtime::Client::new(engine);
        let tools = cairn_activities::ToolRegistry::builtin(".");
        let model =
            cairn_ledger::ModelSpec::parse(&format!("scripted:{}", script.display())).unwrap();
        let mut options = cairn_runtime::SessionOptions::new(model, tools.specs());
        options.session_id = Some(id.into());
        client.start_session(options).await.unwrap();
        client.send(id, "go").await.unwrap();
    });
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// `cairn demo` then `cairn sessions`, with no flags: both use the default data directory,
/// the demo's session is there to inspect, and the demo left the store's other sessions as
/// they were (an interrupted one stays for `cairn resume`).
#[test]
fn demo_then_sessions_meet_in_the_default_data_directory() {
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let default = files.dir.path().join("data");
    // No store yet: said plainly, naming the directory and what makes one.
    let out = cairn_in(&default, &["sessions"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("no store yet at {}", default.display()))
            && err.contains("cairn demo"),
        "{err}"
    );
    assert!(!default.exists(), "a read made nothing");

    interrupted_session(&default, "stuck", &files.script);
    let default_str = default.to_str().unwrap();
    let stuck_before = history_json(default_str, "stuck");

    let demo = cairn_in(&default, &["demo", "--keep"]);
    let stdout = text(&demo.stdout);
    assert!(demo.status.success(), "{stdout}\n{}", text(&demo.stderr));
    let session = text(&demo.stderr)
        .lines()
        .find_map(|l| l.strip_prefix("new session "))
        .unwrap_or_else(|| panic!("no new session line: {}", text(&demo.stderr)))
        .to_owned();
    assert!(
        stdout.contains(&format!("store        {}, the default", default.display()))
            && stdout.contains(&format!("cairn history {session}\n")),
        "{stdout}"
    );
    let listing = text(&cairn_in(&default, &["sessions"]).stdout);
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with(&format!("{session} ")) && l.contains("idle")),
        "{listing}"
    );
    for args in [
        vec!["history", &session],
        vec!["transcript", &session],
        vec!["replay", &session],
        vec!["fsck"],
    ] {
        let out = cairn_in(&default, &args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    }
    // The other session: untouched, still waiting for `cairn resume`.
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("stuck ") && l.contains("running")),
        "{listing}"
    );
    assert_eq!(history_json(default_str, "stuck"), stuck_before);
    // The demo's script and the file it reads went with it: the directory is the store.
    let names = names_in(&default);
    assert!(
        !names.iter().any(|n| n.contains("demo") || n == "work"),
        "{names:?}"
    );

    // A server (CAIRN_SERVER) comes before the default directory; an explicit --data before
    // the server.
    let via_server = cairn_command()
        .env("CAIRN_DATA", &default)
        .env("CAIRN_SERVER", "http://127.0.0.1:1")
        .arg("sessions")
        .output()
        .unwrap();
    // Unreachable has its own exit status.
    assert_eq!(via_server.status.code(), Some(4));
    assert!(
        text(&via_server.stderr).contains("cannot reach the cairn server at http://127.0.0.1:1"),
        "{}",
        text(&via_server.stderr)
    );
    let explicit = cairn_command()
        .env("CAIRN_SERVER", "http://127.0.0.1:1")
        .args(["sessions", "--data", default_str])
        .output()
        .unwrap();
    assert!(explicit.status.success(), "{}", text(&explicit.stderr));
    assert!(text(&explicit.stdout).contains(&session));
}

/// Without `CAIRN_DATA` the default is `$XDG_DATA_HOME/cairn` (when absolute, as the XDG spec
/// says), else `~/.local/share/cairn`; `--help` says so, and where it is on this machine.
#[test]
fn the_default_data_directory_follows_xdg_then_home_and_help_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    let xdg = dir.path().join("xdg");
    let sessions = |xdg: &Path| {
        let out = cairn_command()
            .env_remove("CAIRN_DATA")
            .env("XDG_DATA_HOME", xdg)
            .env("HOME", &home)
            .arg("sessions")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        text(&out.stderr)
    };
    let err = sessions(&xdg);
    assert!(
        err.contains(&format!("no store yet at {}", xdg.join("cairn").display())),
        "{err}"
    );
    let err = sessions(Path::new("relative/xdg"));
    assert!(
        err.contains(&format!(
            "no store yet at {}",
            home.join(".local/share/cairn").display()
        )),
        "{err}"
    );

    let default = dir.path().join("mine");
    let help = text(&cairn_in(&default, &["--help"]).stdout);
    assert!(
        help.contains("$CAIRN_DATA, else $XDG_DATA_HOME/cairn, else ~/.local/share/cairn")
            && help.contains(&format!("(here: {})", default.display())),
        "{help}"
    );
    for command in ["demo", "run", "sessions", "fsck", "server"] {
        let help = text(&cairn_in(&default, &[command, "--help"]).stdout);
        assert!(help.contains("$CAIRN_DATA"), "{command}: {help}");
    }
}

/// `--data` means the store directory for every command: a directory holding other files
/// (here, the layout the demo used to make: its store in `DIR/store`) is never made a store,
/// and `cairn chaos --data` refuses a store.
#[test]
fn a_directory_of_other_files_is_not_made_a_store() {
    let files = demo_files(r#"{"responses": [{"parts": [{"type": "text", "text": "hi"}]}]}"#);
    let old = files.dir.path().join("old-demo");
    let inner = old.join("store");
    interrupted_session(&inner, "s", &files.script);
    std::fs::write(old.join("demo-script.json"), cairn::demo::DEMO_SCRIPT).unwrap();
    std::fs::create_dir(old.join("work")).unwrap();
    let old_str = old.to_str().unwrap();
    let before = names_in(&old);

    let out = cairn(&["sessions", "--data", old_str]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("no store here") && err.contains(&format!("({} is one)", inner.display())),
        "{err}"
    );
    let model = format!("scripted:{}", files.script.display());
    for args in [
        vec!["run", "--data", old_str, "--model", &model, "hello"],
        vec!["demo", "--data", old_str],
    ] {
        let out = cairn(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = text(&out.stderr);
        assert!(
            err.starts_with(&format!("error: cannot open store at {old_str}: "))
                && err.contains("not empty")
                && err.contains("demo-script.json, store/, work/"),
            "{err}"
        );
        assert_eq!(names_in(&old), before, "{args:?} wrote nothing");
    }

    let inner_str = inner.to_str().unwrap();
    let store_before = history_json(inner_str, "s");
    let out = cairn(&["chaos", "--data", inner_str, "--kills", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("is a cairn store"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(history_json(inner_str, "s"), store_before);
    assert!(!inner.join("store").exists());
}

/// `run` checks what it can before it writes anything (no store made, no session started),
/// says "new session X" when it starts one, and refuses options that only a new session takes.
#[test]
fn run_checks_before_writing_and_says_when_it_starts_a_session() {
    let files = demo_files(
        r#"{"responses": [
            {"parts": [{"type": "text", "text": "one"}]},
            {"parts": [{"type": "text", "text": "two"}]},
            {"parts": [{"type": "text", "text": "three"}]}
        ]}"#,
    );
    let data = files.dir.path().join("store");
    let data_str = data.to_str().unwrap();
    let model = format!("scripted:{}", files.script.display());
    let workdir = files.workdir.to_str().unwrap();
    let missing = files.dir.path().join("missing");
    let missing = missing.to_str().unwrap();
    let no_keys = |args: &[&str]| {
        let mut command = cairn_command();
        for var in [
            "ANTHROPIC_API_KEY",
            "OPENAI_API_KEY",
            "OPENAI_BASE_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
        ] {
            command.env_remove(var);
        }
        command.args(args).output().unwrap()
    };
    let refusals: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["--model", &model, "  \n"],
            2,
            "error: the prompt is empty",
        ),
        (
            vec!["--model", "anthropic:claude-sonnet-4-5", "hi"],
            1,
            "ANTHROPIC_API_KEY is not set",
        ),
        (
            vec!["--model", "openai:gpt-5", "hi"],
            1,
            "OPENAI_API_KEY is not set",
        ),
        (
            vec!["--model", "openai-responses:gpt-5", "hi"],
            1,
            "OPENAI_API_KEY is not set",
        ),
        (
            vec!["--model", "bedrock:anthropic.claude", "hi"],
            1,
            "AWS_ACCESS_KEY_ID is not set",
        ),
        (
            vec!["--model", &model, "--workdir", missing, "hi"],
            2,
            "no such directory",
        ),
        (
            vec!["--model", &model, "--max-rounds", "0", "hi"],
            2,
            "--max-rounds",
        ),
    ];
    let refuse_all = |session: &str| {
        for (args, code, says) in &refusals {
            let mut full = vec!["run", "--data", data_str, "--session", session];
            full.extend(args);
            let out = no_keys(&full);
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(*code), "{full:?}: {err}");
            assert!(err.contains(says), "{full:?}: {err}");
        }
    };
    // On no store: none is made.
    refuse_all("chat");
    assert!(!data.exists(), "a refused run made a store");

    let run = |args: &[&str]| {
        let mut full = vec![
            "run",
            "--data",
            data_str,
            "--workdir",
            workdir,
            "--model",
            &model,
        ];
        full.extend(args);
        cairn(&full)
    };
    let first = run(&["--session", "chat", "hello"]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(
        text(&first.stderr).lines().any(|l| l == "new session chat"),
        "{}",
        text(&first.stderr)
    );
    let history = history_json(data_str, "chat");
    let listing = text(&cairn(&["sessions", "--data", data_str]).stdout);

    // On a store and a session that exist: nothing is written either.
    refuse_all("chat");
    refuse_all("other");
    for (options, says) in [
        (
            vec!["--system", "be brief"],
            "session chat exists, and --system applies only when a session starts",
        ),
        (
            vec!["--max-rounds", "3"],
            "session chat exists, and --max-rounds applies only when a session starts",
        ),
        (
            vec!["--system", "be brief", "--max-rounds", "3"],
            "--system and --max-rounds apply only",
        ),
    ] {
        let mut args = vec!["--session", "chat"];
        args.extend(options);
        args.push("again");
        let out = run(&args);
        // A usage error: the options do not go with an existing session.
        assert_eq!(out.status.code(), Some(2));
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
    assert_eq!(history_json(data_str, "chat"), history);
    assert_eq!(
        text(&cairn(&["sessions", "--data", data_str]).stdout),
        listing
    );

    // Continuing says nothing of a new session; a run without --session names the one it made.
    let second = run(&["--session", "chat", "again"]);
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert!(!text(&second.stderr).contains("new session"));
    let fresh = run(&["--max-rounds", "4", "--system", "be brief", "hi"]);
    assert!(fresh.status.success(), "{}", text(&fresh.stderr));
    let id = text(&fresh.stderr)
        .lines()
        .find_map(|l| l.strip_prefix("new session "))
        .expect("the new session is named")
        .to_owned();
    let started = &events_of(&history_json(data_str, &id))[0]["event"]["session_started"];
    assert_eq!(started["limits"]["max_rounds"], 4, "{started}");
    assert_eq!(started["system_prompt"], "be brief", "{started}");
}

/// Runs `cairn` with its standard output a pipe whose reader is already gone, as `cairn
/// sessions | head -c 10` leaves it once head has read enough (without a race: the reader is
/// closed before the child starts).
fn cairn_into_a_closed_pipe(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    cairn_command()
        .args(args)
        .stdout(writer)
        .output()
        .expect("run cairn")
}

/// Writing into a closed pipe ends a command quietly with exit 0, never a panic (exit 101); a
/// turn goes on to its end all the same.
#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    let files = demo_files(
        r#"{"responses": [
            {"parts": [{"type": "text", "text": "one"}]},
            {"parts": [{"type": "text", "text": "two"}]}
        ]}"#,
    );
    let data = files.dir.path().join("store");
    let data = data.to_str().unwrap();
    let model = format!("scripted:{}", files.script.display());
    let workdir = files.workdir.to_str().unwrap();
    let demo_store = files.dir.path().join("demo");
    let demo_store = demo_store.to_str().unwrap();
    let quiet = |args: &[&str]| {
        let out = cairn_into_a_closed_pipe(args);
        let err = text(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
        err
    };
    let err = quiet(&[
        "run",
        "--data",
        data,
        "--model",
        &model,
        "--workdir",
        workdir,
        "--session",
        "s",
        "hello",
    ]);
    assert!(err.contains("new session s"), "{err}");
    quiet(&["demo", "--data", demo_store]);
    for args in [
        vec!["sessions", "--data", data],
        vec!["history", "--data", data, "s"],
        vec!["history", "--data", data, "s", "--json"],
        vec!["transcript", "--data", data, "s"],
        vec!["transcript", "--data", data, "s", "--as", "anthropic"],
        vec!["replay", "--data", data, "s"],
        vec!["fsck", "--data", data],
        vec!["resume", "--data", data],
        vec!["sessions", "--data", demo_store],
    ] {
        quiet(&args);
    }
    // The turns ran to their end though nobody read them.
    for store in [data, demo_store] {
        let listing = text(&cairn(&["sessions", "--data", store]).stdout);
        assert!(
            // The column header, then the one session.
            listing.lines().count() == 2 && listing.contains("idle"),
            "{listing}"
        );
    }
    let turn = events_of(&history_json(data, "s"));
    assert!(
        turn.iter().any(|e| e["kind"] == "turn_completed"),
        "{turn:?}"
    );
}

/// Errors say their whole cause once, in words: no repeated "cannot open store at", no Rust
/// `Debug` forms (`Os { code: 11, kind: WouldBlock, .. }`), the cause of a refused
/// connection, and no colour codes when stderr is not a terminal.
#[test]
fn errors_say_their_whole_cause_once_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    let data_str = data.to_str().unwrap();
    // Each with its exit status: 4 for a store or server out of reach, 1 for other errors.
    let plain = |out: &Output, code: i32| {
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{err}");
        for debug in ["Os {", "kind:", "FjallError", "Error(", "\x1b["] {
            assert!(!err.contains(debug), "{debug:?} in {err}");
        }
        assert!(err.matches("cannot open store at").count() <= 1, "{err}");
        err
    };

    // A store another process holds (this test): who holds it, in words.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let held = rt
        .block_on(cairn_runtime::store::embedded::open(
            &data,
            cairn_runtime::store::embedded::OpenMode::Create,
            None,
        ))
        .unwrap();
    for args in [
        vec!["sessions", "--data", data_str],
        vec!["fsck", "--data", data_str],
        vec!["replay", "--data", data_str, "x"],
        vec!["resume", "--data", data_str],
    ] {
        let err = plain(&cairn(&args), 4);
        assert!(
            err.starts_with(&format!(
                "error: cannot open store at {data_str}: the store is in use by another process ("
            )) && !err.contains("os error"),
            "{args:?}: {err}"
        );
    }
    drop(held);

    // An engine that cannot read its files: the store named once, the cause in words.
    assert!(cairn(&["sessions", "--data", data_str]).status.success());
    let keyspaces = data.join("keyspaces");
    std::fs::remove_dir_all(&keyspaces).unwrap();
    std::fs::write(&keyspaces, "not a directory").unwrap();
    for args in [
        vec!["sessions", "--data", data_str],
        vec!["resume", "--data", data_str],
    ] {
        let err = plain(&cairn(&args), 1);
        assert!(
            err.starts_with(&format!("error: cannot open store at {data_str}: "))
                && err.contains("Not a directory"),
            "{args:?}: {err}"
        );
    }

    // A refused connection: the cause, not only "error sending request".
    let err = plain(&cairn(&["sessions", "--server", "http://127.0.0.1:1"]), 4);
    assert!(err.contains("Connection refused"), "{err}");

    // A command that logs (RUST_LOG=debug): plain text into a pipe.
    let logged = cairn_command()
        .env("RUST_LOG", "debug")
        .args(["sessions", "--data", data_str])
        .output()
        .unwrap();
    let err = text(&logged.stderr);
    assert!(err.contains("DEBUG") && !err.contains('\x1b'), "{err}");
}

/// The line `cairn bench` prints above its figures, naming the machine they were measured on:
/// its CPUs and, on Linux, the kernel and the file system the stores were made on.
fn assert_machine_line(stdout: &str) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("machine: "))
        .unwrap_or_else(|| panic!("no machine line: {stdout}"));
    assert!(line.contains(" CPU"), "{line}");
    let stores = format!(
        "stores in {}",
        std::env::temp_dir().canonicalize().unwrap().display()
    );
    assert!(line.contains(&stores), "{line}");
    if cfg!(target_os = "linux") {
        assert!(line.contains(", Linux "), "{line}");
        assert!(!line.contains("file system unknown"), "{line}");
    }
}

/// The cells of the first line of `cairn bench`'s table that starts with `start` (the header
/// starts with `| setup |`), trimmed.
/// `cairn ARGS` fails, its error saying `says`.
fn assert_refused(args: &[&str], says: &str) {
    let refused = cairn(args);
    assert!(!refused.status.success(), "{args:?} must be refused");
    assert!(
        text(&refused.stderr).contains(says),
        "{}",
        text(&refused.stderr)
    );
}

fn bench_table_line<'a>(stdout: &'a str, start: &str) -> Vec<&'a str> {
    stdout
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line starting {start:?}: {stdout}"))
        .split('|')
        .map(str::trim)
        .collect()
}

/// How far a row's commits per turn may move because the `seconds` window cuts a turn (of up
/// to `most` commits) at each end: two turns' commits spread over the turns it counted.
fn cut_turns_slack(row: &[&str], header: &[&str], seconds: f64, most: f64, stdout: &str) -> f64 {
    let throughput = row[bench_column(header, "throughput", stdout)];
    let per_second: f64 = throughput
        .strip_suffix(" turns/s")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a throughput: {throughput:?} in {stdout}"));
    let turns = (per_second * seconds).max(1.0);
    2.0 * most / turns
}

/// Where the column `name` is in `header`, a line of [`bench_table_line`].
fn bench_column(header: &[&str], name: &str, stdout: &str) -> usize {
    header
        .iter()
        .position(|c| *c == name)
        .unwrap_or_else(|| panic!("no column {name}: {stdout}"))
}

/// `cairn bench` runs durable turns on each embedded engine and reports, per row, the probe's
/// p50 fdatasync beside the store's own p50 sync, the commits a turn waited for in series
/// (four or five at one session: the start, the model's result, the two tools' results, in
/// one append when they come within a report's hold for its running sibling, the second
/// model's), and the CPU time a turn cost.
#[test]
fn bench_rows_set_the_stores_own_syncs_beside_the_probe() {
    let out = cairn(&["bench", "--sessions", "1", "--seconds", "0.5"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert_machine_line(&stdout);
    let header = bench_table_line(&stdout, "| setup |");
    let column = |name: &str| bench_column(&header, name, &stdout);
    let (probe, store, commits, cpu) = (
        column("p50 fdatasync"),
        column("p50 store sync"),
        column("durable commits per turn"),
        column("CPU per turn"),
    );
    let ms = |cell: &str| -> f64 {
        cell.strip_suffix(" ms")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("not a time: {cell:?} in {stdout}"))
    };
    for engine in ["fjall", "sled"] {
        let row = bench_table_line(&stdout, &format!("| embedded, {engine} | 1 |"));
        assert_eq!(row.len(), header.len(), "{stdout}");
        assert!(ms(row[probe]) > 0.0, "{stdout}");
        let store_sync = ms(row[store]);
        assert!(
            store_sync > 0.0 && store_sync < 60_000.0,
            "{engine}: {stdout}"
        );
        // Counted over the measured window, which cuts the turns at its ends.
        let per_turn: f64 = row[commits].parse().expect("a number");
        let cut = cut_turns_slack(&row, &header, 0.5, 5.0, &stdout);
        assert!(
            (3.8 - cut..=5.2 + cut).contains(&per_turn),
            "{engine}: {stdout}"
        );
        // Some CPU, and not seconds of it: a turn is a few milliseconds of work.
        let cpu_per_turn = ms(row[cpu]);
        assert!(
            cpu_per_turn > 0.0 && cpu_per_turn < 1_000.0,
            "{engine}: {stdout}"
        );
    }
}

/// `cairn bench --parallel-tools N` runs turns whose model asks for N tool calls at once: the
/// header names them, and at one session the commits of a turn follow from them. One tool
/// makes four (the start, the model's result, the tool's, the second model's); with four,
/// the results share appends (one when they come within a report's hold for its running
/// siblings, the rest of them in the next when some come after the first's append began), so
/// a turn takes four commits when they all gather and seven when none do. The count is over
/// the measured window, which cuts a turn at each end: with few turns (a loaded machine) the
/// bounds widen by what two cut turns can move it.
#[test]
fn bench_parallel_tools_set_the_tool_calls_of_a_turn() {
    let commits_per_turn = |tools: &str| -> (f64, f64, String) {
        let out = cairn(&[
            "bench",
            "--sessions",
            "1",
            "--seconds",
            "0.5",
            "--engine",
            "fjall",
            "--parallel-tools",
            tools,
        ]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        assert!(
            stdout.contains(&format!("model → {tools} parallel tool")),
            "{stdout}"
        );
        let header = bench_table_line(&stdout, "| setup |");
        let commits = bench_column(&header, "durable commits per turn", &stdout);
        let row = bench_table_line(&stdout, "| embedded, fjall | 1 |");
        let per_turn: f64 = row[commits].parse().expect("a number");
        let cut = cut_turns_slack(&row, &header, 0.5, 7.0, &stdout);
        (per_turn, cut, stdout)
    };
    let (one, cut, stdout) = commits_per_turn("1");
    assert!((one - 4.0).abs() < 0.2 + cut, "{stdout}");
    let (four, cut, stdout) = commits_per_turn("4");
    assert!((3.8 - cut..=7.2 + cut).contains(&four), "{stdout}");

    assert_refused(&["bench", "--parallel-tools", "0"], "0 is not in 1..=64");
}

/// `cairn bench --tool-spec-bytes` offers the bench sessions' model more tools, whose specs
/// the header counts; the turns still complete (the tools are never called).
#[test]
fn bench_tool_spec_bytes_offer_more_tools_and_say_so() {
    let out = cairn(&[
        "bench",
        "--sessions",
        "1",
        "--seconds",
        "0.3",
        "--engine",
        "fjall",
        "--tool-spec-bytes",
        "20000",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let offered = stdout
        .split(" tools offered in ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|bytes| bytes.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("no count of the specs' bytes: {stdout}"));
    assert!((20_000..24_000).contains(&offered), "{stdout}");
    let row = bench_table_line(&stdout, "| embedded, fjall | 1 |");
    assert!(row.iter().any(|cell| cell.ends_with("turns/s")), "{stdout}");

    assert_refused(
        &["bench", "--goals", "--tool-spec-bytes", "1000"],
        "cannot be used with",
    );
}

/// `cairn bench --turns-per-session --message-bytes` runs sessions of several turns with long
/// messages, embedded and through a server, and says so; every turn completes (a script too
/// short for a session's turns would fail one), and the server's row counts its store's
/// commits, as the embedded row does.
#[test]
fn bench_long_sessions_run_their_turns_and_say_so() {
    let out = cairn(&[
        "bench",
        "--sessions",
        "2",
        "--seconds",
        "0.6",
        "--engine",
        "fjall",
        "--workers",
        "1",
        "--turns-per-session",
        "5",
        "--message-bytes",
        "3000",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains(
            "(a session of 5 turns, model → 2 parallel tools → model, user messages of 3000 bytes)"
        ),
        "{stdout}"
    );
    let header = bench_table_line(&stdout, "| setup |");
    let commits = bench_column(&header, "durable commits per turn", &stdout);
    for row in [
        "| embedded, fjall | 2 |",
        "| server over fjall, 1 worker process | 2 |",
    ] {
        let row = bench_table_line(&stdout, row);
        assert!(row.iter().any(|cell| cell.ends_with("turns/s")), "{stdout}");
        // Through the server too, as its `/v1/health` counts them: a turn is at least its
        // start and its two model results, fewer when turns in flight share commits.
        let per_turn: f64 = row[commits]
            .parse()
            .unwrap_or_else(|_| panic!("no commits per turn in {row:?}: {stdout}"));
        assert!(per_turn > 0.5 && per_turn < 8.0, "{stdout}");
    }
    assert_refused(
        &["bench", "--goals", "--turns-per-session", "5"],
        "cannot be used with",
    );
}

/// `cairn bench --store` measures through servers on a PostgreSQL database (a scratch one,
/// dropped after), and counts the writes its servers committed: a turn of one session is at
/// least its start and its two model results, each an append the database made durable.
#[test]
fn bench_through_postgres_counts_the_servers_commits() {
    let server = cairn_postgres::testing::server_url();
    let out = cairn(&[
        "bench",
        "--store",
        &server,
        "--no-embedded",
        "--workers",
        "1",
        "--sessions",
        "1",
        "--seconds",
        "0.6",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let header = bench_table_line(&stdout, "| setup |");
    let commits = bench_column(&header, "durable commits per turn", &stdout);
    let row = bench_table_line(&stdout, "| postgres, 1 server, 1 worker process | 1 |");
    let per_turn: f64 = row[commits]
        .parse()
        .unwrap_or_else(|_| panic!("no commits per turn in {row:?}: {stdout}"));
    assert!((3.0..8.0).contains(&per_turn), "{stdout}");
}

/// `cairn bench --stages` times one session's turns step by step on each engine: the store's
/// syncs (five a turn, as its commits), the encoding and the writer before each, the
/// activities (four a turn), each step's share and the marks covering about a turn's time;
/// it refuses to measure through servers.
#[test]
fn bench_stages_time_a_turn_step_by_step_on_each_engine() {
    let out = cairn(&["bench", "--stages", "--seconds", "0.5"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert_machine_line(&stdout);
    // An engine's table: its head line and rows, up to the blank line after them.
    let table_of = |engine: &str| -> Vec<&str> {
        stdout
            .lines()
            .skip_while(|l| !l.starts_with(&format!("embedded, {engine}: ")))
            .take_while(|l| !l.is_empty())
            .collect()
    };
    for engine in ["fjall", "sled"] {
        let table = table_of(engine);
        assert!(table.len() > 3, "no table for {engine}: {stdout}");
        let number = |text: &str, unit: &str| -> f64 {
            text.trim()
                .strip_suffix(unit)
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("not a number of {unit:?}: {text:?} in {stdout}"))
        };
        // "embedded, fjall: N turns, p50 turn T ms, marks covering C ms per turn; ..."
        let head = table[0];
        let p50_turn = number(
            head.split("p50 turn ")
                .nth(1)
                .unwrap()
                .split(',')
                .next()
                .unwrap(),
            "ms",
        );
        let covered = number(
            head.split("marks covering ")
                .nth(1)
                .unwrap()
                .split("per turn")
                .next()
                .unwrap(),
            "ms",
        );
        assert!(p50_turn > 0.0, "{engine}: {stdout}");
        // The marks cover the turns back to back: about the mean turn, which the line on the
        // slowest turns gives ("against M ms for all"). Not the p50: on a loaded machine one
        // turn stalled in a sync for a quarter of a second raised a half-second run's mean to
        // four and a half times its p50.
        let all_mean = number(
            stdout
                .lines()
                .skip_while(|l| !l.starts_with(&format!("embedded, {engine}: ")))
                .find(|l| l.starts_with("the slowest 1% of turns: "))
                .and_then(|l| l.split("against ").nth(1))
                .and_then(|rest| rest.split(" for all").next())
                .unwrap_or_else(|| panic!("{engine}: no mean of all turns in {stdout}")),
            "ms",
        );
        assert!(
            covered > 0.5 * all_mean && covered < 2.0 * all_mean,
            "{engine}: {covered} ms covered against a mean turn of {all_mean} ms in {stdout}"
        );
        let row = |from: &str, to: &str| -> Vec<&str> {
            table
                .iter()
                .find(|l| l.starts_with(&format!("| {from} → {to} |")))
                .unwrap_or_else(|| panic!("{engine}: no step {from} → {to}: {stdout}"))
                .split('|')
                .map(str::trim)
                .collect()
        };
        // Five syncs and four activities a turn; fewer pairs when a mark of another thread
        // falls between (the two tools run at once now and then).
        let sync = row("sync.start", "sync.end");
        let per_turn: f64 = sync[2].parse().expect("a number");
        assert!((3.5..=5.2).contains(&per_turn), "{engine}: {stdout}");
        assert!(number(sync[3], "µs") > 1.0, "{engine}: {stdout}");
        let activities: f64 = row("activity.start", "activity.end")[2]
            .parse()
            .expect("a number");
        assert!((2.0..=4.2).contains(&activities), "{engine}: {stdout}");
        let shares: f64 = table[3..]
            .iter()
            .map(|l| number(l.split('|').nth(5).unwrap(), "%"))
            .sum();
        assert!(
            shares > 70.0 && shares <= 100.5,
            "{engine}: {shares}% in {stdout}"
        );
    }
    // After each engine's table, its slowest 1% of turns beside all: how many, the least of
    // them, their mean against all turns', and the steps they spend more time on.
    let slow_heads: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("the slowest 1% of turns: "))
        .collect();
    assert_eq!(slow_heads.len(), 2, "{stdout}");
    for head in slow_heads {
        let words: Vec<&str> = head.split_whitespace().collect();
        let slow: usize = words[5].parse().expect("a count");
        let whole: usize = words[7].parse().expect("a count");
        assert!(slow >= 1 && slow <= whole, "{head}");
        let ms_after = |label: &str| -> f64 {
            head.split(label)
                .nth(1)
                .and_then(|rest| rest.split(" ms").next())
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {label:?} in {head}"))
        };
        let (least, slow_mean, all_mean) = (
            ms_after("at least "),
            ms_after("(mean "),
            ms_after("against "),
        );
        assert!(slow_mean >= least && slow_mean >= all_mean, "{head}");
        let rows: Vec<&str> = stdout
            .lines()
            .skip_while(|l| *l != head)
            .skip(3)
            .take_while(|l| l.starts_with("| "))
            .collect();
        assert!(!rows.is_empty(), "no steps after {head}: {stdout}");
        for row in rows {
            let cells: Vec<f64> = row
                .split('|')
                .skip(2)
                .filter_map(|c| c.trim().parse().ok())
                .collect();
            assert_eq!(cells.len(), 3, "{row}");
            assert!(
                cells[2] >= 1.0 && (cells[0] - cells[1] - cells[2]).abs() < 0.2,
                "{row}"
            );
        }
    }
    // fjall commits a lone write on its caller's thread: its writer's steps (the records
    // encoded, then checked and staged) follow the workflow's in series.
    let fjall = table_of("fjall").join("\n");
    assert!(
        fjall.contains("| append.start → write.submitted |"),
        "{stdout}"
    );
    assert!(
        fjall.contains("| write.submitted → write.applied |"),
        "{stdout}"
    );
    // --stages measures one session embedded: nothing through servers.
    let refused = cairn(&["bench", "--stages", "--workers", "1"]);
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("--stages") && text(&refused.stderr).contains("--workers"),
        "{}",
        text(&refused.stderr)
    );
}

/// `cairn bench --footprint` runs a short session on each engine and reports its bytes: the
/// raw messages as 1.00×, a history larger than them, the store's live keys and values, every
/// event kind a turn records, and what a miss of the state cache costs.
#[test]
fn bench_footprint_reports_the_bytes_of_a_session_on_each_engine() {
    let out = cairn(&["bench", "--footprint", "--turns", "3"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    for engine in ["fjall", "sled"] {
        assert!(
            stdout.contains(&format!("footprint of one 3-turn session on {engine}")),
            "{stdout}"
        );
    }
    let history_multiples: Vec<f64> = stdout
        .lines()
        .filter(|l| l.starts_with("| history (encoded records) |"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            cells[4].trim_end_matches('×').parse().expect("a multiple")
        })
        .collect();
    assert_eq!(history_multiples.len(), 2, "{stdout}");
    assert!(history_multiples.iter().all(|&m| m > 1.0), "{stdout}");
    // The store's live keys and values hold the history and its keys: more than the history,
    // and exactly 1.00× of themselves.
    let live_rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("| live keys and values (logical) |"))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    assert_eq!(live_rows.len(), 2, "{stdout}");
    for cells in &live_rows {
        let of_history: f64 = cells[5].trim_end_matches('×').parse().expect("a multiple");
        assert!(of_history > 1.0, "{stdout}");
        assert_eq!(cells[6], "1.00×", "{stdout}");
    }
    for kind in [
        "session_started",
        "user_message",
        "model_call_scheduled",
        "tool_call_completed",
        "turn_completed",
    ] {
        assert!(stdout.contains(&format!("| {kind} |")), "{kind}: {stdout}");
    }
    // What a miss of the state cache costs: 3 turns are 25 events read back and folded, into
    // a state estimated at about the transcript's JSON bytes.
    let misses: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            l.starts_with(
                "A miss of the engine's state cache on this session: reading its 25 events back ",
            )
        })
        .collect();
    assert_eq!(misses.len(), 2, "{stdout}");
    for miss in misses {
        let of_json: f64 = miss
            .rsplit_once(" bytes (")
            .and_then(|(_, rest)| rest.split_once('×'))
            .and_then(|(multiple, _)| multiple.parse().ok())
            .unwrap_or_else(|| panic!("no multiple of the transcript in {miss}"));
        assert!((0.5..4.0).contains(&of_json), "{miss}");
    }
}

/// `cairn bench --goals` measures every goal of issue 13 on the engine asked for, one row
/// each with a figure and whether it is met; a run that parks fewer sessions than the goal
/// names never counts the memory goal met, and `--turns` without a mode that takes it is
/// refused.
#[test]
fn bench_goals_reports_one_row_per_goal() {
    let out = cairn(&[
        "bench",
        "--goals",
        "--seconds",
        "0.3",
        "--turns",
        "3",
        "--parked",
        "20",
        "--engine",
        "fjall",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert_machine_line(&stdout);
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("| ") && l.contains(" | fjall | "))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    let goals: Vec<&str> = rows.iter().map(|cells| cells[1]).collect();
    assert_eq!(
        goals,
        [
            "≥ 3,000 turns/s at 128 sessions, default settings",
            "1 session: p50 turn ≤ 1.5 × commits × p50 fdatasync",
            "1 state transition ≤ 1.5 × p50 fdatasync",
            "history ≤ 1.3 × raw message bytes",
            "store on disk ≤ 2 × logical bytes",
            "replay ≥ 1,000,000 events/s folded in memory",
            "replay ≥ 300,000 events/s cold from the store",
            "100,000 parked sessions < 100 MB RSS",
        ],
        "{stdout}"
    );
    for cells in &rows {
        assert!(matches!(cells[4], "yes" | "no"), "{stdout}");
        // Each measured cell starts with its figure.
        assert!(
            cells[3].starts_with(|c: char| c.is_ascii_digit()),
            "{stdout}"
        );
    }
    // Three turns are 25 events; their history is the history --footprint measures.
    assert!(rows[5][3].ends_with("(25 events)"), "{stdout}");
    assert!(rows[3][3].contains("(3 turns: "), "{stdout}");
    assert!(rows[7][3].ends_with("for 20"), "{stdout}");
    assert_eq!(rows[7][4], "no", "{stdout}");

    assert_refused(
        &["bench", "--turns", "3"],
        "--turns goes with --footprint or --goals",
    );
}

#[tokio::test]
async fn resume_says_which_session_cannot_be_resumed_and_resumes_the_others() {
    use cairn_runtime::store::embedded::{open, OpenMode};
    use cairn_runtime::{Client, Engine, SessionOptions, SystemClock};
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        r#"{"responses": [{"parts": [{"type": "text", "text": "resumed answer"}]}]}"#,
    )
    .unwrap();
    let data = dir.path().join("store");
    {
        // A process that accepted two messages and died before any worker ran.
        let opened = open(&data, OpenMode::Create, None).await.unwrap();
        let client = Client::new(Engine::new(opened.store.clone(), Arc::new(SystemClock)));
        for id in ["broken", "good"] {
            let mut options = SessionOptions::new(
                cairn_ledger::ModelSpec::new("scripted", script.display().to_string()),
                Vec::new(),
            );
            options.session_id = Some(id.into());
            options.workdir = Some(dir.path().display().to_string());
            client.start_session(options).await.unwrap();
            client.send(id, "go").await.unwrap();
        }
    }
    crate::support::append_a_turn_end_no_workflow_records(&data, "broken").await;
    let data = data.to_str().unwrap();
    let resume = cairn(&["resume", "--data", data]);
    let (stdout, stderr) = (text(&resume.stdout), text(&resume.stderr));
    assert_eq!(resume.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("broken: cannot resume: nondeterminism in session \"broken\" at seq 4"),
        "{stderr}"
    );
    assert!(
        stdout.contains("resuming 1 session(s)") && stdout.contains("resumed answer"),
        "{stdout}"
    );
    let listed = cairn(&["sessions", "--data", data]);
    let listing = text(&listed.stdout);
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("good ") && l.contains("idle")),
        "{listing}"
    );
    assert!(
        listing.lines().any(|l| l.starts_with("broken ")
            && l.contains("running")
            && l.contains("unreadable: nondeterminism in session \"broken\" at seq 4")),
        "{listing}"
    );
    assert!(cairn(&["replay", "--data", data, "good"]).status.success());
}
