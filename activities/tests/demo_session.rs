//! End-to-end through the public API: the demo script drives the built-in tools for two rounds,
//! and the resulting transcript is valid.

use cairn_activities::{
    ActivityContext, CallContext, DeltaSink, ErrorKind, ModelProvider, ModelRequest, NoDeltas,
    ScriptedProvider, ToolCall, ToolRegistry, DEMO_SCRIPT,
};
use cairn_ledger::{
    validate_transcript, Delta, ModelSpec, ToolResult, ToolResultContent, Transcript,
};
use std::sync::Mutex;

fn request(transcript: &Transcript, tools: &ToolRegistry, round: u32) -> ModelRequest {
    ModelRequest {
        options: Default::default(),
        context: CallContext {
            session_id: "demo".into(),
            turn: 1,
            round,
            attempt: 1,
        },
        model: ModelSpec::parse("scripted:demo.json").expect("valid model spec"),
        transcript: transcript.clone().into(),
        tools: tools.specs().into(),
    }
}

#[tokio::test]
async fn demo_script_runs_both_tools_and_answers() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("notes.txt"),
        "cairn demo notes: the launch is on Tuesday.\n",
    )
    .unwrap();
    let tools = ToolRegistry::builtin(dir.path());
    let provider = ScriptedProvider::from_json(DEMO_SCRIPT, "demo.json").unwrap();

    let mut transcript = Transcript::new();
    transcript.push_user_text("What is (17 + 25) * 3, and what do my notes say?");

    let seen = Mutex::new(Vec::new());
    let sink = |d: Delta| seen.lock().unwrap().push(d);
    let first = provider
        .call(
            &request(&transcript, &tools, 1),
            &sink as &dyn DeltaSink,
            &ActivityContext::detached(),
        )
        .await
        .unwrap();
    assert!(!seen.lock().unwrap().is_empty(), "the demo streams deltas");

    let mut results = Vec::new();
    for tool_use in first.tool_uses() {
        let call = ToolCall {
            tool_use_id: tool_use.id.clone(),
            name: tool_use.name.clone(),
            arguments: tool_use.arguments.clone(),
            idempotency_key: format!("demo/1/1/{}", tool_use.id),
        };
        let output = tools
            .call(&call, &ActivityContext::detached())
            .await
            .unwrap();
        assert!(!output.is_error, "{output:?}");
        results.push(ToolResult {
            tool_use_id: tool_use.id.clone(),
            content: output.content,
            is_error: output.is_error,
        });
    }
    assert_eq!(
        results
            .iter()
            .map(|r| r.content.canonical_json())
            .collect::<Vec<_>>(),
        [
            r#"{"expression":"(17 + 25) * 3","value":126}"#.to_owned(),
            serde_json::to_string("cairn demo notes: the launch is on Tuesday.\n").unwrap(),
        ]
    );
    assert!(matches!(&results[1].content, ToolResultContent::Text(_)));
    transcript.push_response(&first);
    transcript.push_tool_results(results);

    let last = provider
        .call(
            &request(&transcript, &tools, 2),
            &NoDeltas,
            &ActivityContext::detached(),
        )
        .await
        .unwrap();
    assert!(last.text().contains("126") && last.text().contains("Tuesday"));
    transcript.push_response(&last);
    validate_transcript(&transcript).unwrap();

    let err = provider
        .call(
            &request(&transcript, &tools, 3),
            &NoDeltas,
            &ActivityContext::detached(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
}

#[tokio::test]
async fn providers_are_usable_as_trait_objects() {
    let provider: std::sync::Arc<dyn ModelProvider> =
        std::sync::Arc::new(ScriptedProvider::demo().unwrap());
    assert_eq!(provider.provider(), "scripted");
    let mut transcript = Transcript::new();
    transcript.push_user_text("hi");
    let response = provider
        .call(
            &request(&transcript, &ToolRegistry::new(), 1),
            &NoDeltas,
            &ActivityContext::detached(),
        )
        .await
        .unwrap();
    assert_eq!(response.tool_uses().count(), 2);
}
