//! Histories as files and looked into, through the real binary: `cairn export` and `cairn
//! import` (byte-identical round trips, refused files naming their line, an interrupted
//! session resuming after an import), `cairn show --at SEQ` and `cairn replay --trace`.

use crate::support::{cairn_command, demo_files};
use cairn_runtime::store::embedded::{self, OpenMode};
use cairn_runtime::{Engine, Event, EventEnvelope, ManualClock, SessionStarted};
use std::path::Path;
use std::process::Output;
use std::sync::Arc;

fn cairn(args: &[&str]) -> Output {
    cairn_command().args(args).output().expect("run cairn")
}

fn ok(output: &Output) -> String {
    assert!(
        output.status.success(),
        "cairn failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).expect("utf-8")
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A store with the demo's session; returns its id.
fn demo_store(data: &Path) -> String {
    ok(&cairn(&["demo", "--data", path(data)]));
    let listed = ok(&cairn(&["sessions", "--data", path(data)]));
    listed
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().next())
        .expect("a session")
        .to_owned()
}

#[test]
fn export_import_export_gives_the_same_bytes_and_a_second_import_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let session = demo_store(&a);
    let first = dir.path().join("first.jsonl");
    ok(&cairn(&[
        "export",
        "--data",
        path(&a),
        &session,
        "-o",
        path(&first),
    ]));
    let said = ok(&cairn(&["import", "--data", path(&b), path(&first)]));
    assert!(
        said.contains(&format!("imported session {session}")),
        "{said}"
    );
    let second = ok(&cairn(&["export", "--data", path(&b), &session]));
    let first_bytes = std::fs::read(&first).unwrap();
    assert_eq!(
        second.as_bytes(),
        &first_bytes[..],
        "export, import, export: the same bytes"
    );
    let header: serde_json::Value = serde_json::from_str(second.lines().next().unwrap()).unwrap();
    assert_eq!(header["format"], "cairn-history");
    assert_eq!(header["version"], 1);
    assert_eq!(
        header["events"].as_u64(),
        Some(second.lines().count() as u64 - 1)
    );
    // Every event line is the line `history --json` prints.
    let history = ok(&cairn(&["history", "--data", path(&a), &session, "--json"]));
    assert_eq!(
        second.lines().skip(1).collect::<Vec<_>>(),
        history.lines().collect::<Vec<_>>()
    );

    let again = cairn(&["import", "--data", path(&b), path(&first)]);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already has a session"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(
        ok(&cairn(&["export", "--data", path(&b), &session])),
        second,
        "the refused import changed nothing"
    );
}

#[test]
fn a_damaged_or_reordered_file_is_refused_naming_its_line_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let session = demo_store(&a);
    let export = ok(&cairn(&["export", "--data", path(&a), &session]));
    let lines: Vec<&str> = export.lines().collect();
    let with = |edit: &dyn Fn(&mut Vec<String>)| {
        let mut lines: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        edit(&mut lines);
        lines.join("\n") + "\n"
    };
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "swapped",
            with(&|l| l.swap(3, 4)),
            "line 4: seq 4 out of order",
        ),
        (
            "garbled",
            with(&|l| l[5] = l[5].replacen('{', "{{", 1)),
            "line 6: not an event envelope",
        ),
        (
            "cut",
            with(&|l| {
                l.pop();
            }),
            "the header says",
        ),
        (
            "version",
            with(&|l| l[0] = l[0].replace("\"version\":1", "\"version\":9")),
            "line 1: export format version 9",
        ),
        (
            "schema",
            with(&|l| l[2] = l[2].replacen("\"schema_version\":1", "\"schema_version\":7", 1)),
            "line 3: unknown event schema version 7",
        ),
        (
            "tampered",
            with(&|l| {
                l[2] = l[2].replace(
                    "\"user_message\":{\"turn\":1",
                    "\"user_message\":{\"turn\":2",
                )
            }),
            "line 3: the history does not replay",
        ),
    ];
    for (name, text, says) in cases {
        let file = dir.path().join(format!("{name}.jsonl"));
        std::fs::write(&file, text).unwrap();
        let target = dir.path().join(format!("into-{name}"));
        let refused = cairn(&["import", "--data", path(&target), path(&file)]);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "{name}: refused");
        assert!(stderr.contains(says), "{name}: {stderr}");
        assert!(stderr.contains("nothing was imported"), "{name}: {stderr}");
        assert!(!target.exists(), "{name}: no store was made");
    }
}

/// A session interrupted after its model call was scheduled (no worker ran it), exported,
/// imported into another store: `cairn resume` there runs the call and completes the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_interrupted_session_resumes() {
    let files =
        demo_files(r#"{"responses": [{"parts": [{"type": "text", "text": "resumed fine"}]}]}"#);
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let session = "interrupted";
    {
        let opened = embedded::open(&a, OpenMode::Create, None).await.unwrap();
        let engine = Engine::new(opened.store.clone(), Arc::new(ManualClock::new(1_000)));
        let model = cairn_ledger::ModelSpec::parse(&format!("scripted:{}", files.script.display()))
            .unwrap();
        let started = SessionStarted {
            call_options: Default::default(),
            model,
            tools: Vec::new().into(),
            system_prompt: None,
            limits: Default::default(),
            model_retry: cairn_runtime::RetryPolicy::model_default(),
            tool_retry: cairn_runtime::RetryPolicy::tool_default(),
            queues: Default::default(),
            forked_from: None,
            workflow_version: cairn_runtime::WORKFLOW_VERSION,
            tool_policy: None,
            compaction: None,
            workdir: None,
        };
        engine
            .start_session(Some(session.into()), started)
            .await
            .unwrap();
        engine.send_message(session, "hello", None).await.unwrap();
    }
    let export = dir.path().join("interrupted.jsonl");
    ok(&cairn(&[
        "export",
        "--data",
        path(&a),
        session,
        "-o",
        path(&export),
    ]));
    let said = ok(&cairn(&["import", "--data", path(&b), path(&export)]));
    assert!(
        said.contains("its turn was interrupted (1 activity queued)"),
        "{said}"
    );
    let show = ok(&cairn(&["show", "--data", path(&b), session, "--json"]));
    let shown: serde_json::Value = serde_json::from_str(&show).unwrap();
    assert_eq!(shown["session"]["status"], "running");
    assert_eq!(shown["session"]["pending_tasks"][0]["activity"], "model:0");
    ok(&cairn(&[
        "resume",
        "--data",
        path(&b),
        "--workdir",
        path(&files.workdir),
    ]));
    let history = ok(&cairn(&["history", "--data", path(&b), session, "--json"]));
    let events: Vec<EventEnvelope> = history
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        matches!(
            events.last().map(|e| &e.event),
            Some(Event::TurnCompleted { turn: 1, .. })
        ),
        "the imported turn completed: {history}"
    );
    assert!(history.contains("resumed fine"), "{history}");
}

#[test]
fn show_at_an_event_gives_the_session_as_it_was_and_replay_trace_gives_every_decision() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let session = demo_store(&a);
    let history = ok(&cairn(&["history", "--data", path(&a), &session, "--json"]));
    let events: Vec<EventEnvelope> = history
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Right after the second tool call was scheduled: both calls open, both pending.
    let second_tool = events
        .iter()
        .filter(|e| matches!(e.event, Event::ToolCallScheduled { .. }))
        .nth(1)
        .expect("the demo schedules two tools")
        .seq;
    let shown: serde_json::Value = serde_json::from_str(&ok(&cairn(&[
        "show",
        "--data",
        path(&a),
        &session,
        "--at",
        &second_tool.to_string(),
        "--json",
    ])))
    .unwrap();
    assert_eq!(shown["at_seq"], second_tool);
    assert_eq!(shown["session"]["status"], "running");
    let open: Vec<&str> = shown["open_tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(open, ["calculator", "read_file"]);
    assert_eq!(
        shown["session"]["pending_tasks"].as_array().unwrap().len(),
        2
    );
    let messages = shown["transcript"]["messages"].as_array().unwrap();
    assert_eq!(
        messages.last().unwrap()["role"],
        "assistant",
        "the transcript ends with the model's tool calls"
    );
    // At the end: idle, nothing open, and the text form says so.
    let text = ok(&cairn(&["show", "--data", path(&a), &session]));
    assert!(text.contains("status: idle"), "{text}");
    assert!(text.contains("pending tasks: none"), "{text}");
    let past = cairn(&["show", "--data", path(&a), &session, "--at", "999"]);
    assert!(!past.status.success());
    assert!(String::from_utf8_lossy(&past.stderr).contains("no event 999"));

    let trace = ok(&cairn(&["replay", "--data", path(&a), &session, "--trace"]));
    let lines: Vec<&str> = trace.lines().collect();
    assert_eq!(
        lines.len(),
        events.len() + 1,
        "one line per event and the verdict"
    );
    assert!(
        trace.contains("model_call_completed  => decides tool_call_scheduled, tool_call_scheduled"),
        "{trace}"
    );
    assert!(lines.last().unwrap().starts_with("ok: "), "{trace}");
}

fn events_of(data: &Path, session: &str) -> Vec<EventEnvelope> {
    ok(&cairn(&[
        "history",
        "--data",
        path(data),
        session,
        "--json",
    ]))
    .lines()
    .map(|l| serde_json::from_str(l).unwrap())
    .collect()
}

/// A fork cut after the demo's tool results, with another model: resumed, it runs only the
/// model call that was pending — no tool again — and completes with the other model's
/// answer; its first event names the parent and seq, the copied prefix is the parent's, and
/// its history replays. A cut inside a transition, and a switch of provider inside a tool
/// loop, are refused with the reason.
#[test]
fn a_fork_goes_on_from_its_cut_without_running_the_prefix_again() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let parent = demo_store(&a);
    let parent_events = events_of(&a, &parent);
    // The cut: right after the model call that follows the tool results was scheduled.
    let cut = parent_events
        .iter()
        .filter(|e| matches!(e.event, Event::ModelCallScheduled { .. }))
        .nth(1)
        .expect("the demo's second model call")
        .seq;
    let other = dir.path().join("other.json");
    std::fs::write(
        &other,
        r#"{"responses": [{"parts": [{"type": "text", "text": "unused"}]}, {"parts": [{"type": "text", "text": "Another model's answer."}]}]}"#,
    )
    .unwrap();
    let model = format!("scripted:{}", other.display());
    let said = ok(&cairn(&[
        "fork",
        "--data",
        path(&a),
        &parent,
        "--at",
        &cut.to_string(),
        "--model",
        &model,
        "--id",
        "child",
    ]));
    assert!(said.contains("forked session child"), "{said}");
    assert!(said.contains("1 activity queued"), "{said}");
    ok(&cairn(&["resume", "--data", path(&a)]));
    let child = events_of(&a, "child");
    let Event::SessionStarted(started) = &child[0].event else {
        panic!("a fork begins with session_started");
    };
    let origin = started
        .forked_from
        .as_ref()
        .expect("the fork names its parent");
    assert_eq!(
        (origin.session_id.as_str(), origin.seq),
        (parent.as_str(), cut)
    );
    for (copied, original) in child
        .iter()
        .zip(&parent_events)
        .skip(1)
        .take(cut as usize - 1)
    {
        assert_eq!(copied.event, original.event, "seq {} is copied", copied.seq);
    }
    let after_cut = &child[cut as usize..];
    assert!(
        !after_cut.iter().any(|e| matches!(
            e.event,
            Event::ToolCallScheduled { .. } | Event::ToolCallCompleted { .. }
        )),
        "no tool runs again in the fork: {after_cut:?}"
    );
    assert_eq!(
        after_cut
            .iter()
            .filter(|e| matches!(e.event, Event::ModelCallCompleted { .. }))
            .count(),
        1,
        "only the pending model call runs"
    );
    let shown = ok(&cairn(&["show", "--data", path(&a), "child"]));
    assert!(shown.contains("Another model's answer."), "{shown}");
    ok(&cairn(&["replay", "--data", path(&a), "child"]));

    // The diff of the fork against its parent.
    let diff: serde_json::Value = serde_json::from_str(&ok(&cairn(&[
        "diff",
        "--data",
        path(&a),
        &parent,
        "child",
        "--json",
    ])))
    .unwrap();
    assert_eq!(diff["config"], serde_json::json!(["model"]));
    assert!(diff["parting"]["seq"].as_u64().unwrap() > cut, "{diff}");
    let changed = &diff["messages"][0];
    assert_eq!(changed["change"], "changed", "{diff}");
    assert!(
        changed["parts"]
            .to_string()
            .contains("Another model's answer."),
        "{diff}"
    );
    assert!(diff["usage"]["delta"][1].as_i64().unwrap() < 0, "{diff}");
    let text = ok(&cairn(&["diff", "--data", path(&a), &parent, "child"]));
    assert!(text.contains("configuration differs: model"), "{text}");

    // Refusals: a cut inside a transition, a provider switch inside the tool loop.
    let inside = cairn(&["fork", "--data", path(&a), &parent, "--at", "2"]);
    assert!(!inside.status.success());
    assert!(
        String::from_utf8_lossy(&inside.stderr).contains("cuts the transition of seq 2"),
        "{}",
        String::from_utf8_lossy(&inside.stderr)
    );
    let switch = cairn(&[
        "fork",
        "--data",
        path(&a),
        &parent,
        "--at",
        &cut.to_string(),
        "--model",
        "openai:gpt-4o",
    ]);
    assert!(!switch.status.success());
    assert!(
        String::from_utf8_lossy(&switch.stderr).contains("inside a tool loop"),
        "{}",
        String::from_utf8_lossy(&switch.stderr)
    );
    let listed = ok(&cairn(&["sessions", "--data", path(&a)]));
    // The column header and the two sessions.
    assert_eq!(
        listed.lines().count(),
        3,
        "refused forks write nothing: {listed}"
    );
}
