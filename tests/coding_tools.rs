//! The coding tools with the engine and real workers: a scripted model lists, reads (a range),
//! edits and writes files; the edit's "last read" comes from the recorded history, so it holds
//! across a restart of the whole process, and a file changed behind the agent's back is not
//! edited. Every session is replayed from its history to the same ledger bytes.

use crate::support::TestHost;
use cairn_activities::ToolRegistry;
use cairn_ledger::file_versions::sha256_hex;
use cairn_ledger::{validate_transcript, Part, ToolResultContent};
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::*;
use cairn_workers::{Activities, StandardModels, WorkerConfig};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;

fn workers() -> WorkerConfig {
    WorkerConfig {
        concurrency: 4,
        lease_ms: 2_000,
        poll_interval_ms: 5,
        progress_interval_ms: None,
        ..WorkerConfig::default()
    }
}

/// A host over `store` whose workers host every built-in tool in `workdir`.
fn host(store: Arc<dyn Store>, workdir: &Path) -> TestHost {
    TestHost::start_with_activities(
        store,
        Arc::new(SystemClock),
        Activities {
            models: Arc::new(StandardModels::new()),
            tools: Arc::new(ToolRegistry::hosted(workdir)),
        },
        workers(),
    )
}

/// Replays the session's history and checks it folds to the engine's ledger, byte for byte.
async fn assert_replays(client: &Client, session: &str) -> Vec<EventEnvelope> {
    let history = client.history(session).await.unwrap();
    let replayed = replay(session, &history).unwrap();
    let live = client.transcript(session).await.unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        live.canonical_json(),
        "replay of {session} gives different ledger bytes"
    );
    validate_transcript(&live).unwrap();
    history
}

/// The recorded results by tool_use id: (content, is_error).
fn results(history: &[EventEnvelope]) -> Vec<(String, ToolResultContent, bool)> {
    let replayed = replay(&history[0].session_id, history).unwrap();
    replayed
        .state
        .transcript
        .messages
        .iter()
        .flat_map(|m| m.parts.iter())
        .filter_map(|p| match p {
            Part::ToolResult(r) => Some((r.tool_use_id.clone(), r.content.clone(), r.is_error)),
            _ => None,
        })
        .collect()
}

fn tool_use(id: &str, name: &str, input: serde_json::Value) -> serde_json::Value {
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

#[tokio::test]
async fn a_model_lists_reads_edits_and_writes_files_live_and_in_replay() {
    let dir = tempfile::tempdir().unwrap();
    let workdir = dir.path().join("work");
    std::fs::create_dir_all(workdir.join("src")).unwrap();
    let original = "fn main() {\n    println!(\"hello\");\n}\n";
    std::fs::write(workdir.join("src/main.rs"), original).unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        json!({"responses": [
            {"parts": [tool_use("t1", "list_dir", json!({"path": "src"}))]},
            {"parts": [tool_use("t2", "read_file", json!({"path": "src/main.rs", "offset": 2, "limit": 1}))]},
            {"parts": [tool_use("t3", "edit_file", json!({"path": "src/main.rs", "old_string": "hello", "new_string": "hello, cairn"}))]},
            {"parts": [tool_use("t4", "write_file", json!({"path": "docs/NOTES.md", "content": "# Notes\n"}))]},
            {"parts": [{"type": "text", "text": "done"}]}
        ]})
        .to_string(),
    )
    .unwrap();
    let host = host(Arc::new(MemoryStore::new()), &workdir);
    let session = host
        .client
        .start_session(host.session_options(&script, "coding"))
        .await
        .unwrap();
    let outcome = host
        .client
        .run_turn(&session, "fix the greeting")
        .await
        .unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "done"),
        "{outcome:?}"
    );
    let edited = "fn main() {\n    println!(\"hello, cairn\");\n}\n";
    assert_eq!(
        std::fs::read_to_string(workdir.join("src/main.rs")).unwrap(),
        edited
    );
    assert_eq!(
        std::fs::read_to_string(workdir.join("docs/NOTES.md")).unwrap(),
        "# Notes\n"
    );

    let history = assert_replays(&host.client, &session).await;
    let results = results(&history);
    let expected = [
        ("t1", ToolResultContent::Text("main.rs".into()), false),
        (
            "t2",
            ToolResultContent::Text(format!(
                "    println!(\"hello\");\n[read_file: lines 2-2 of 3; sha256 {}]",
                sha256_hex(original.as_bytes())
            )),
            false,
        ),
        (
            "t3",
            ToolResultContent::Json(
                cairn_ledger::JsonText::parse(format!(
                    r#"{{"path":"src/main.rs","replacements":1,"sha256":"{}"}}"#,
                    sha256_hex(edited.as_bytes())
                ))
                .unwrap(),
            ),
            false,
        ),
        (
            "t4",
            ToolResultContent::Json(
                cairn_ledger::JsonText::parse(format!(
                    r#"{{"path":"docs/NOTES.md","bytes":8,"sha256":"{}","created":true}}"#,
                    sha256_hex(b"# Notes\n")
                ))
                .unwrap(),
            ),
            false,
        ),
    ];
    let got: Vec<(&str, ToolResultContent, bool)> = results
        .iter()
        .map(|(id, c, e)| (id.as_str(), c.clone(), *e))
        .collect();
    assert_eq!(got, expected);
    // The recorded bytes of the edit's result, as the history's JSON carries them.
    let completed: Vec<String> = history
        .iter()
        .filter(|e| e.kind == "tool_call_completed")
        .map(|e| serde_json::to_string(&e.event).unwrap())
        .collect();
    assert!(
        completed.iter().any(|c| c.contains(&format!(
            r#""content":{{"json":{{"path":"src/main.rs","replacements":1,"sha256":"{}"}}}}"#,
            sha256_hex(edited.as_bytes())
        ))),
        "{completed:?}"
    );
    host.shutdown().await;
}

#[tokio::test]
async fn last_read_survives_a_restart_and_a_file_changed_since_is_not_edited() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    let workdir = dir.path().join("work");
    std::fs::create_dir_all(&workdir).unwrap();
    std::fs::write(workdir.join("a.txt"), "alpha\nbeta\n").unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        json!({"responses": [
            // Turn 1: read.
            {"parts": [tool_use("r1", "read_file", json!({"path": "a.txt"}))]},
            {"parts": [{"type": "text", "text": "read it"}]},
            // Turn 2, in a new process: edit on what turn 1 read.
            {"parts": [tool_use("e1", "edit_file", json!({"path": "./a.txt", "old_string": "beta", "new_string": "BETA"}))]},
            {"parts": [{"type": "text", "text": "edited"}]},
            // Turn 3: someone changed the file meanwhile; the edit is refused.
            {"parts": [tool_use("e2", "edit_file", json!({"path": "a.txt", "old_string": "alpha", "new_string": "ALPHA"}))]},
            {"parts": [{"type": "text", "text": "refused"}]}
        ]})
        .to_string(),
    )
    .unwrap();

    let store = SledStore::open(&data).unwrap();
    let first = host(Arc::new(store), &workdir);
    let session = first
        .client
        .start_session(first.session_options(&script, "restart"))
        .await
        .unwrap();
    first.client.run_turn(&session, "read a.txt").await.unwrap();
    first.shutdown().await;

    // A new process: a new engine and new workers over the same store, nothing in memory.
    let store = crate::support::reopen_sled(&data).await;
    let second = host(Arc::new(store), &workdir);
    second.client.run_turn(&session, "edit it").await.unwrap();
    assert_eq!(
        std::fs::read_to_string(workdir.join("a.txt")).unwrap(),
        "alpha\nBETA\n"
    );

    std::fs::write(workdir.join("a.txt"), "alpha\nBETA\ngamma\n").unwrap();
    second
        .client
        .run_turn(&session, "edit again")
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(workdir.join("a.txt")).unwrap(),
        "alpha\nBETA\ngamma\n",
        "a file changed since the last read must not be edited"
    );
    let history = assert_replays(&second.client, &session).await;
    let results = results(&history);
    let (_, refused, is_error) = results.iter().find(|(id, ..)| id == "e2").unwrap();
    assert!(*is_error);
    assert_eq!(
        refused,
        &ToolResultContent::Text(
            "\"a.txt\" changed since this session last read or wrote it; read it again before \
             changing it"
                .into()
        )
    );
    let (_, edited, is_error) = results.iter().find(|(id, ..)| id == "e1").unwrap();
    assert!(!is_error, "{edited:?}");
    second.shutdown().await;
}

/// `cairn run --edit` offers write_file and edit_file; they ask by default, so a run that
/// allows edit_file only edits the file and parks the write for approval.
#[test]
fn cairn_run_edit_offers_the_editing_tools_and_they_ask_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let workdir = dir.path().join("work");
    std::fs::create_dir_all(&workdir).unwrap();
    std::fs::write(workdir.join("a.txt"), "one\n").unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        json!({"responses": [
            {"parts": [tool_use("r", "read_file", json!({"path": "a.txt"}))]},
            {"parts": [tool_use("e", "edit_file", json!({"path": "a.txt", "old_string": "one", "new_string": "two"}))]},
            {"parts": [tool_use("w", "write_file", json!({"path": "b.txt", "content": "new"}))]},
            {"parts": [{"type": "text", "text": "done"}]}
        ]})
        .to_string(),
    )
    .unwrap();
    let data = dir.path().join("store");
    let output = crate::support::cairn_command()
        .arg("run")
        .arg("--data")
        .arg(&data)
        .arg("--model")
        .arg(format!("scripted:{}", script.display()))
        .arg("--workdir")
        .arg(&workdir)
        .args([
            "--session",
            "s1",
            "--edit",
            "--allow",
            "edit_file",
            "--approval-timeout-ms",
            "200",
        ])
        .arg("edit a.txt")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(workdir.join("a.txt")).unwrap(),
        "two\n"
    );
    // write_file asked, nobody answered within the deadline: denied, nothing written.
    assert!(!workdir.join("b.txt").exists(), "{stderr}");
    let history = crate::support::cairn_command()
        .args(["history", "s1", "--json", "--data"])
        .arg(&data)
        .output()
        .unwrap();
    let kinds: Vec<(String, String)> = String::from_utf8_lossy(&history.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|e| {
            let kind = e["kind"].as_str().unwrap_or_default().to_owned();
            let id = e["event"][&kind]["tool_use_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            (kind, id)
        })
        .filter(|(_, id)| !id.is_empty())
        .collect();
    let has = |kind: &str, id: &str| kinds.iter().any(|(k, i)| k == kind && i == id);
    assert!(
        has("tool_call_scheduled", "e") && !has("tool_approval_requested", "e"),
        "{kinds:?}"
    );
    assert!(
        has("tool_approval_requested", "w") && has("tool_call_denied", "w"),
        "{kinds:?}"
    );
}
