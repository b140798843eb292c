//! The library's first program: the quickstart example runs (its tool, its answer), the
//! README shows exactly its code, a session is followed live through the client, and a turn
//! that no worker can run fails by its deadline instead of waiting forever.

use cairn::prelude::*;
use cairn::runtime::{Error as RuntimeError, Event, UsageTotals};
use std::time::Duration;

#[allow(dead_code)] // its `main` is the example's, not the test's
#[path = "../examples/quickstart.rs"]
mod quickstart;

/// The offline model of these tests: the calculator, then an answer.
const SCRIPT: &str = r#"{"responses": [
  {"parts": [{"type": "text", "text": "Computing."},
             {"type": "tool_use", "id": "toolu_c", "name": "calculator", "input": {"expression": "6 * 7"}}]},
  {"parts": [{"type": "text", "text": "6 * 7 = 42."}]}
]}"#;

#[tokio::test(flavor = "multi_thread")]
async fn the_quickstart_runs_its_tool_and_prints_the_answer() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let mut out = Vec::new();
    quickstart::quickstart(data.path(), &mut out).await?;
    assert_eq!(
        String::from_utf8(out)?,
        "calling weather\n\
         tool result: \"sunny, 21 °C in Lyon\"\n\
         answer: It is sunny in Lyon today, 21 °C.\n"
    );
    Ok(())
}

#[test]
fn the_readme_shows_the_quickstart_as_it_is() -> anyhow::Result<()> {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md"))?;
    let example = std::fs::read_to_string(format!("{root}/examples/quickstart.rs"))?;
    let library = readme
        .split("\n## Library\n")
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("README.md has no \"## Library\" section"))?;
    let shown = library
        .split("```rust\n")
        .nth(1)
        .and_then(|block| block.split("```").next())
        .ok_or_else(|| anyhow::anyhow!("README.md's Library section has no ```rust block"))?;
    // The example without its `//!` header, which says how to run it.
    let code: String = example
        .lines()
        .skip_while(|line| line.starts_with("//!"))
        .skip_while(|line| line.is_empty())
        .map(|line| format!("{line}\n"))
        .collect();
    assert!(
        shown == code,
        "README.md's Library snippet differs from examples/quickstart.rs (after its //! header): \
         copy the example's code into the README\n--- README ---\n{shown}\n--- example ---\n{code}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_followed_session_shows_deltas_tool_calls_results_and_the_outcome_once_in_order(
) -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let cairn = Cairn::builder(data.path())
        .builtin_tools(data.path())
        .script("calc", SCRIPT)
        .start()
        .await?;
    let client = cairn.client();
    let options = cairn.session(ModelSpec::new("scripted", "calc"));
    let offered: Vec<String> = options.tools.iter().map(|t| t.name.clone()).collect();
    assert_eq!(
        offered,
        ["calculator", "list_dir", "read_file"],
        "the registry's specs"
    );
    let session = client.start_session(options).await?;
    let mut events = client.follow(&session).await?;
    let outcome = client.run_turn(&session, "What is 6 * 7?").await?;
    assert_eq!(
        outcome,
        TurnOutcome::Completed {
            turn: 1,
            answer: "6 * 7 = 42.".into(),
            stop_reason: Some(cairn::ledger::StopReason::EndTurn),
            // Two model calls (a tool round, then the answer); the script reports no usage.
            totals: UsageTotals {
                model_calls: 2,
                ..UsageTotals::default()
            }
        }
    );

    let mut seen = Vec::new();
    let mut streamed = String::new();
    let mut seqs = Vec::new();
    while let Some(event) = events.next().await {
        let event = event?;
        if let Some(seq) = event.seq() {
            seqs.push(seq);
        }
        match event {
            SessionEvent::Delta(delta) => {
                if let cairn::ledger::Delta::Text(text) = delta.delta {
                    streamed.push_str(&text);
                }
            }
            SessionEvent::UserMessage { text, .. } => seen.push(format!("user: {text}")),
            SessionEvent::ModelAnswered { response, .. } => {
                seen.push(format!("model: {}", response.text()))
            }
            SessionEvent::ToolCallScheduled { name, .. } => seen.push(format!("call: {name}")),
            SessionEvent::ToolResult { name, content, .. } => seen.push(format!(
                "result of {}: {}",
                name.unwrap_or_default(),
                content.canonical_json()
            )),
            SessionEvent::TurnEnded { outcome: ended, .. } => {
                assert_eq!(ended, outcome, "the followed outcome is run_turn's");
                break;
            }
            _ => {}
        }
    }
    assert_eq!(
        seen,
        [
            "user: What is 6 * 7?",
            "model: Computing.",
            "call: calculator",
            r#"result of calculator: {"expression":"6 * 7","value":42}"#,
            "model: 6 * 7 = 42.",
        ]
    );
    let history = client.history(&session).await?;
    let all: Vec<u64> = history.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, all, "every history event once, in order");
    // Deltas may be dropped on lag, but a reader this fast gets them all.
    assert_eq!(streamed, "Computing.6 * 7 = 42.");

    // Followed from the middle: the rest, with what it refers to read from before.
    let scheduled = history
        .iter()
        .find(|e| matches!(e.event, Event::ToolCallScheduled { .. }))
        .map(|e| e.seq)
        .ok_or_else(|| anyhow::anyhow!("no tool call in {history:?}"))?;
    let mut rest = client.follow_after(&session, scheduled).await?;
    let mut names = Vec::new();
    while let Some(event) = rest.next().await {
        match event? {
            SessionEvent::ToolResult { name, .. } => names.push(name),
            SessionEvent::TurnEnded { outcome: ended, .. } => {
                assert_eq!(ended, outcome, "the answer comes from before the start");
                break;
            }
            SessionEvent::ToolCallScheduled { .. } => anyhow::bail!("an event before the start"),
            _ => {}
        }
    }
    assert_eq!(names, [Some("calculator".to_owned())]);
    cairn.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_turn_no_worker_takes_fails_by_its_deadline_naming_the_task() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let cairn = Cairn::builder(data.path())
        .script("calc", SCRIPT)
        .without_workers()
        .turn_deadline(Duration::from_millis(500))
        .start()
        .await?;
    let client = cairn.client();
    let session = client
        .start_session(cairn.session(ModelSpec::new("scripted", "calc")))
        .await?;
    let started = std::time::Instant::now();
    let failed = client.run_turn(&session, "What is 6 * 7?").await;
    let waited = started.elapsed();
    match failed {
        Err(RuntimeError::TurnDeadline {
            turn,
            deadline_ms,
            pending,
            ..
        }) => {
            assert_eq!((turn, deadline_ms), (1, 500));
            assert!(
                pending.contains("on queue \"default\"")
                    && pending.contains("needs a worker hosting \"scripted\"")
                    && pending.contains("has not been taken"),
                "{pending}"
            );
        }
        other => anyhow::bail!("expected a turn deadline, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    // The turn goes on: a worker started later would run it.
    assert_eq!(client.describe(&session).await?.running_turn, Some(1));
    cairn.shutdown().await;
    Ok(())
}
