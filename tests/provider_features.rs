//! Call options and opaque parts through a whole session (issue 14 §2), live and as a full
//! replay: the session's tool choice (forcing only a turn's first call), a turn's override, the
//! session's server tools reaching every call, and an opaque block with cited text going back
//! verbatim to its family while a per-turn switch of provider drops it.

use crate::support::TestHost;
use cairn_activities::{
    Error as ActivityError, ModelProvider, ReceivedCall, ScriptedProvider, ToolRegistry,
};
use cairn_ledger::*;
use cairn_runtime::store::memory::MemoryStore;
use cairn_runtime::*;
use cairn_workers::{Activities, ModelResolver, WorkerConfig};
use std::sync::Arc;

const SEARCH: &str = r#"{"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{"query": "rust", "n": 9007199254740993}}"#;
const CITES: &str = r#"[{"type":"web_search_result_location","url":"https://blog.example","cited_text":"Rust 1.90"}]"#;

/// Two script players of two families: `scripted` and `other`.
struct TwoFamilies {
    scripted: Arc<ScriptedProvider>,
    other: Arc<ScriptedProvider>,
}

impl ModelResolver for TwoFamilies {
    fn resolve(
        &self,
        spec: &ModelSpec,
    ) -> std::result::Result<Arc<dyn ModelProvider>, ActivityError> {
        Ok(match spec.provider.as_str() {
            "other" => self.other.clone(),
            _ => self.scripted.clone(),
        })
    }
}

fn scripted_script() -> String {
    format!(
        r#"{{"responses": [
        {{"turn": 1, "parts": [{{"type": "tool_use", "id": "t1", "name": "calculator", "input": {{"expression": "1+1"}}}}]}},
        {{"turn": 1, "parts": [
            {{"type": "text", "text": "Searching."}},
            {{"type": "opaque", "block": {SEARCH}}},
            {{"type": "text", "text": "Rust 1.90 is out.", "citations": {CITES}}}
        ]}},
        {{"turn": 2, "parts": [{{"type": "text", "text": "Still 1.90."}}]}}
    ]}}"#
    )
}

const OTHER_SCRIPT: &str = r#"{"provider": "other", "model": "other-model", "responses": [
    {"turn": 3, "parts": [{"type": "text", "text": "From elsewhere."}]}
]}"#;

#[tokio::test]
async fn options_and_opaque_parts_reach_their_family_only_live_and_in_replay() {
    let scripted = Arc::new(
        ScriptedProvider::from_json(&scripted_script(), "scripted.json")
            .unwrap()
            .recording(),
    );
    let other = Arc::new(
        ScriptedProvider::from_json(OTHER_SCRIPT, "other.json")
            .unwrap()
            .recording(),
    );
    let tools = ToolRegistry::builtin(std::env::temp_dir());
    let host = TestHost::start_with_activities(
        Arc::new(MemoryStore::new()),
        Arc::new(SystemClock),
        Activities {
            models: Arc::new(TwoFamilies {
                scripted: scripted.clone(),
                other: other.clone(),
            }),
            tools: Arc::new(tools),
        },
        WorkerConfig {
            poll_interval_ms: 5,
            ..WorkerConfig::default()
        },
    );
    let mut options = SessionOptions::new(
        ModelSpec::new("scripted", "scripted.json"),
        host.tools.specs(),
    );
    options.session_id = Some("features".into());
    options.call_options = CallOptions {
        tool_choice: Some(ToolChoice::Any),
        server_tools: vec![ServerTool {
            kind: ServerToolKind::WebSearch,
            max_uses: Some(2),
        }],
        no_prompt_cache: false,
    };
    let client = &host.client;
    let session = client.start_session(options.clone()).await.unwrap();

    // Turn 1: the session's "any" forces the first call only; the second is auto.
    let outcome = client.run_turn(&session, "What is new?").await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );
    // Turn 2: this turn's "none", and the same family gets the opaque block back.
    let turn = client
        .send_with_tool_choice(&session, "And now?", None, ToolChoice::None)
        .await
        .unwrap();
    client.wait_turn(&session, turn).await.unwrap();
    // Turn 3: another family, for this turn only.
    let turn = client
        .send_with_model(
            &session,
            "Elsewhere?",
            ModelSpec::new("other", "other.json"),
        )
        .await
        .unwrap();
    let outcome = client.wait_turn(&session, turn).await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { .. }),
        "{outcome:?}"
    );

    let calls: Vec<ReceivedCall> = scripted.received();
    let choices: Vec<_> = calls
        .iter()
        .map(|c| {
            (
                c.context.turn,
                c.context.round,
                c.options.tool_choice.clone(),
            )
        })
        .collect();
    assert_eq!(
        choices,
        vec![
            (1, 0, Some(ToolChoice::Any)),
            (1, 1, Some(ToolChoice::Auto)),
            (2, 0, Some(ToolChoice::None)),
        ]
    );
    assert!(calls
        .iter()
        .all(|c| c.options.server_tools == options.call_options.server_tools));
    let opaque = Part::Opaque(ProviderJson::new(
        "scripted",
        JsonText::parse(SEARCH).unwrap(),
    ));
    let cited = Part::Text {
        text: "Rust 1.90 is out.".into(),
        item_id: None,
        citations: Some(ProviderJson::new(
            "scripted",
            JsonText::parse(CITES).unwrap(),
        )),
    };
    // The same family: the block and the citations, byte for byte and in position.
    let sent = &calls[2].transcript;
    let answer = sent
        .messages
        .iter()
        .find(|m| m.parts.contains(&opaque))
        .expect("the opaque part reaches its family");
    assert_eq!(
        answer.parts,
        vec![Part::text("Searching."), opaque.clone(), cited.clone()]
    );
    let json = String::from_utf8(sent.canonical_json()).unwrap();
    assert!(json.contains("9007199254740993"), "{json}");

    // Another family: the text only.
    let other_calls = other.received();
    assert_eq!(other_calls.len(), 1);
    let elsewhere = &other_calls[0].transcript;
    assert!(elsewhere
        .messages
        .iter()
        .all(|m| !m.parts.contains(&opaque)));
    let texts: Vec<&Part> = elsewhere
        .messages
        .iter()
        .flat_map(|m| m.parts.iter())
        .filter(|p| matches!(p, Part::Text { text, .. } if text == "Rust 1.90 is out."))
        .collect();
    assert_eq!(texts, vec![&Part::text("Rust 1.90 is out.")]);
    assert_eq!(other_calls[0].options.tool_choice, Some(ToolChoice::Any));

    // The history records the options, and a full replay folds the same ledger.
    let history = client.history(&session).await.unwrap();
    let replayed = replay(&session, &history).unwrap();
    let live = client.transcript(&session).await.unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        live.canonical_json()
    );
    validate_transcript(&live).unwrap();
    assert!(live.messages.iter().any(|m| m.parts.contains(&opaque)));
    let Event::SessionStarted(started) = &history[0].event else {
        panic!("{:?}", history[0].event)
    };
    assert_eq!(started.call_options, options.call_options);
    let choices: Vec<Option<ToolChoice>> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::UserMessage { tool_choice, .. } => Some(tool_choice.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(choices, vec![None, Some(ToolChoice::None), None]);
    host.shutdown().await;
}

/// `cairn run --tool-choice/--server-tool/--no-prompt-cache` through the real binary: a new
/// session records them in `session_started`, a later `--tool-choice` is that turn's (in its
/// `user_message`), the flags fixed at a session's start are refused for an existing one
/// (exit 2, nothing written), and a bad value is a usage error.
#[test]
fn cairn_run_records_call_options_and_refuses_start_only_ones_later() {
    use crate::support::cairn_command;
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        r#"{"responses": [
            {"turn": 1, "parts": [{"type": "text", "text": "first"}]},
            {"turn": 2, "parts": [{"type": "text", "text": "second"}]}
        ]}"#,
    )
    .unwrap();
    let data = dir.path().join("store");
    let model = format!("scripted:{}", script.display());
    let run = |extra: &[&str]| {
        cairn_command()
            .arg("run")
            .arg("--data")
            .arg(&data)
            .args(["--model", &model, "--session", "opts", "--workdir"])
            .arg(dir.path())
            .args(extra)
            .output()
            .unwrap()
    };
    let history = || -> Vec<serde_json::Value> {
        let out = cairn_command()
            .args(["history", "opts", "--json", "--data"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };

    let first = run(&[
        "--tool-choice",
        "none",
        "--server-tool",
        "web_search=2,web_fetch",
        "--no-prompt-cache",
        "hello",
    ]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let events = history();
    assert_eq!(
        events[0]["event"]["session_started"]["call_options"],
        serde_json::json!({
            "tool_choice": "none",
            "server_tools": [{"kind": "web_search", "max_uses": 2}, {"kind": "web_fetch"}],
            "no_prompt_cache": true
        })
    );
    let recorded = events.len();
    // `cairn describe` states them, as text and as JSON.
    let describe = |json: bool| {
        let mut command = cairn_command();
        command.args(["describe", "opts", "--data"]).arg(&data);
        if json {
            command.arg("--json");
        }
        let out = command.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let said = describe(false);
    assert!(
        said.contains(
            "\noptions   tool choice none, server tools web_search=2,web_fetch, prompt cache off\n"
        ),
        "{said}"
    );
    let json: serde_json::Value = serde_json::from_str(&describe(true)).unwrap();
    assert_eq!(
        json["call_options"],
        serde_json::json!({
            "tool_choice": "none",
            "server_tools": ["web_search=2", "web_fetch"],
            "prompt_cache": false
        })
    );

    // Fixed at the start: refused for the existing session, and nothing is written.
    let refused = run(&["--server-tool", "web_search", "again"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--server-tool"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert_eq!(history().len(), recorded);
    // A bad value is a usage error.
    let bad = run(&["--tool-choice", "sometimes", "again"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("sometimes"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );

    // A tool choice for an existing session is this turn's.
    let second = run(&["--tool-choice", "auto", "again"]);
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    assert!(String::from_utf8_lossy(&second.stdout).contains("second"));
    let events = history();
    let message = events
        .iter()
        .filter(|e| e["kind"] == "user_message")
        .nth(1)
        .expect("turn 2's message");
    assert_eq!(message["event"]["user_message"]["tool_choice"], "auto");
    // And the history replays.
    let replay = cairn_command()
        .args(["replay", "--data"])
        .arg(&data)
        .arg("opts")
        .output()
        .unwrap();
    assert!(
        replay.status.success(),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );
}
