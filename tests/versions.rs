//! Upgrading workflow code without breaking sessions in flight: a history recorded under
//! workflow version 1 replays and resumes under the rules it was recorded with, while new
//! sessions follow the current rules; and `cairn replay --dir` checks a folder of exports
//! against the current code.
//!
//! `tests/golden/histories/v1-missing-argument.jsonl` was made by
//! [`record_missing_argument_session`] with the code of version 1 (before version 2's rule
//! existed) and is never regenerated: it is what a session in flight during the upgrade
//! holds. `tests/golden/histories/v2-demo.jsonl` is the demo session as version 2 recorded it.

use crate::support::{cairn_command, demo_files};
use cairn_ledger::{ModelResponse, ModelSpec, Part, StopReason, ToolUse, Usage};
use cairn_runtime::store::memory::MemoryStore;
use cairn_runtime::{
    ActivityReport, Engine, Event, EventEnvelope, ManualClock, RetryPolicy, SessionStarted,
};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;

fn golden_history() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/histories/v1-missing-argument.jsonl")
}

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

fn calculator() -> cairn_ledger::ToolSpec {
    cairn_activities::ToolRegistry::builtin(".")
        .specs()
        .into_iter()
        .find(|s| s.name == "calculator")
        .expect("the calculator")
}

/// A session whose model calls the calculator without its required `expression`,
/// interrupted with that call scheduled. Under version 1 a call with JSON arguments is always
/// scheduled (the tool itself refuses it); the current version answers it at once.
async fn record_missing_argument_session(script: &Path, workflow_version: u32) -> String {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), Arc::new(ManualClock::new(1_700_000_000_000)));
    let started = SessionStarted {
        call_options: Default::default(),
        model: ModelSpec::parse(&format!("scripted:{}", script.display())).expect("spec"),
        tools: vec![calculator()].into(),
        system_prompt: None,
        limits: Default::default(),
        model_retry: RetryPolicy::model_default(),
        tool_retry: RetryPolicy::tool_default(),
        queues: Default::default(),
        forked_from: None,
        workflow_version,
        tool_policy: None,
        compaction: None,
        workdir: None,
    };
    let id = engine
        .start_session(Some("missing-argument".into()), started)
        .await
        .unwrap();
    engine.send_message(&id, "add", None).await.unwrap();
    let leased = engine
        .lease_tasks(&Default::default(), 1, 60_000)
        .await
        .unwrap();
    let response = ModelResponse {
        provider: "scripted".into(),
        model: "versions".into(),
        parts: vec![Part::ToolUse(ToolUse {
            id: "call-1".into(),
            name: "calculator".into(),
            arguments: "{}".into(),
            signature: None,
        })],
        stop_reason_raw: "tool_use".into(),
        stop_reason: StopReason::ToolUse,
        usage: Usage::default(),
    };
    engine
        .report(&leased[0].lease, ActivityReport::ModelCompleted(response))
        .await
        .unwrap();
    cairn_runtime::export::export_session(&*store, &id)
        .await
        .unwrap()
}

fn events(export: &str) -> Vec<EventEnvelope> {
    export
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

const SCRIPT: &str = r#"{"responses": [
  {"parts": [{"type": "tool_use", "id": "call-1", "name": "calculator", "input": {}}]},
  {"parts": [{"type": "text", "text": "I could not add."}]}
]}"#;

/// The v1 golden history: made once by the code of version 1 (when it is missing), never
/// again; the current code must read, replay and resume it as version 1 did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_recorded_under_version_1_replays_and_resumes_under_its_rules() {
    let files = demo_files(SCRIPT);
    let golden = golden_history();
    assert!(
        golden.exists(),
        "{} is missing: it was recorded by workflow version 1 and cannot be made again",
        golden.display()
    );
    let text = std::fs::read_to_string(&golden).unwrap();
    let recorded = events(&text);
    assert!(
        matches!(
            recorded.last().map(|e| &e.event),
            Some(Event::ToolCallScheduled { .. })
        ),
        "version 1 scheduled the call without its argument"
    );
    // The golden names the script by a path of the machine that made it: point it here.
    let Event::SessionStarted(started) = &recorded[0].event else {
        panic!("a history begins with session_started");
    };
    assert_eq!(
        started.workflow_version, 1,
        "no version recorded reads as 1"
    );
    let text = text.replace(
        &started.model.model,
        files.script.to_str().expect("utf-8 path"),
    );
    let import = files.dir.path().join("v1.jsonl");
    std::fs::write(&import, &text).unwrap();
    let data = files.dir.path().join("store");
    let data_arg = data.to_str().unwrap();
    let said = ok(&cairn(&[
        "import",
        "--data",
        data_arg,
        import.to_str().unwrap(),
    ]));
    assert!(said.contains("1 activity queued"), "{said}");
    ok(&cairn(&[
        "resume",
        "--data",
        data_arg,
        "--workdir",
        files.workdir.to_str().unwrap(),
    ]));
    let history: Vec<EventEnvelope> = ok(&cairn(&[
        "history",
        "--data",
        data_arg,
        "missing-argument",
        "--json",
    ]))
    .lines()
    .map(|l| serde_json::from_str(l).unwrap())
    .collect();
    // Under version 1 the call was scheduled, so a worker ran the tool, which refused it.
    let refused = history.iter().find_map(|e| match &e.event {
        Event::ToolCallFailed { failure, .. } => Some(failure.clone()),
        _ => None,
    });
    let refused = refused.expect("the v1 session ran the tool after resuming");
    assert_eq!(
        refused.class,
        cairn_runtime::ErrorClass::InvalidRequest,
        "{refused:?}"
    );
    assert!(
        matches!(
            history.last().map(|e| &e.event),
            Some(Event::TurnCompleted { .. })
        ),
        "the resumed v1 turn completed"
    );
    ok(&cairn(&["replay", "--data", data_arg, "missing-argument"]));
}

/// The demo session as version 2 recorded it (`tests/golden/histories/v2-demo.jsonl`, the
/// demo's golden history when version 3 came, never regenerated): the current code folds it
/// under version 2's rules to the very ledger bytes of the demo's golden transcript.
#[test]
fn the_demo_recorded_under_version_2_replays_to_its_ledger_bytes() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let text = std::fs::read_to_string(golden.join("histories/v2-demo.jsonl")).unwrap();
    let recorded: Vec<EventEnvelope> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let Event::SessionStarted(started) = &recorded[0].event else {
        panic!("a history begins with session_started");
    };
    assert_eq!(started.workflow_version, 2);
    let replayed = cairn_runtime::replay(&started_id(&recorded), &recorded).unwrap();
    let transcript = std::fs::read_to_string(golden.join("sessions/demo.transcript.json")).unwrap();
    assert_eq!(
        String::from_utf8(replayed.state.transcript.canonical_json()).unwrap() + "\n",
        transcript
    );
}

/// A new session records the current version and follows its rule: the call without its
/// required argument is answered at once with an error naming the field, never scheduled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sessions_follow_the_current_rules() {
    let files = demo_files(SCRIPT);
    let export =
        record_missing_argument_session(&files.script, cairn_runtime::WORKFLOW_VERSION).await;
    let recorded = events(&export);
    let Event::SessionStarted(started) = &recorded[0].event else {
        panic!("a history begins with session_started");
    };
    assert_eq!(started.workflow_version, cairn_runtime::WORKFLOW_VERSION);
    const { assert!(cairn_runtime::WORKFLOW_VERSION >= 2) };
    assert!(
        !recorded
            .iter()
            .any(|e| matches!(e.event, Event::ToolCallScheduled { .. })),
        "the current rules never schedule a call that lacks a required argument"
    );
    let state = cairn_runtime::replay(&started_id(&recorded), &recorded)
        .unwrap()
        .state;
    let transcript = String::from_utf8(state.transcript.canonical_json()).unwrap();
    assert!(
        transcript.contains("missing required argument \\\"expression\\\""),
        "{transcript}"
    );
}

fn started_id(events: &[EventEnvelope]) -> String {
    events[0].session_id.clone()
}

/// `cairn replay --dir`: every export in a folder replayed with the current code; a history
/// the current code would not make is named with its first divergence, and the exit is 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_dir_checks_a_folder_of_exports_and_names_each_divergence() {
    let files = demo_files(SCRIPT);
    let dir = files.dir.path().join("exports");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(golden_history(), dir.join("v1.jsonl")).unwrap();
    let current =
        record_missing_argument_session(&files.script, cairn_runtime::WORKFLOW_VERSION).await;
    std::fs::write(dir.join("current.jsonl"), &current).unwrap();
    let clean = ok(&cairn(&["replay", "--dir", dir.to_str().unwrap()]));
    assert!(clean.contains("ok: 2 of 2 histories replay"), "{clean}");

    // A v1 history that claims version 2: the current rules would not have scheduled its
    // call, so replay names the divergence.
    let golden = std::fs::read_to_string(golden_history()).unwrap();
    let lied = golden.replacen(
        "\"session_started\":{",
        "\"session_started\":{\"workflow_version\":2,",
        1,
    );
    std::fs::write(dir.join("relabelled.jsonl"), lied).unwrap();
    let out = cairn(&["replay", "--dir", dir.to_str().unwrap()]);
    // A divergence has its own exit status.
    assert_eq!(out.status.code(), Some(7));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("relabelled.jsonl: diverges"), "{said}");
    assert!(said.contains("failed: 2 of 3 histories replay"), "{said}");
}
