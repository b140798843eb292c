//! The session and the model answers the benchmarks run: a scripted model with one
//! calculator tool, and answers that think, say a word and call it, as a typical round does.
//! The criterion benches and `cairn bench --goals` share them, so their figures are of the
//! same records.

use anyhow::Context;
use cairn_ledger::{
    JsonText, ModelResponse, ModelSpec, Part, StopReason, ToolSpec, ToolUse, Usage,
};
use cairn_runtime::{Limits, RetryPolicy, SessionStarted};

/// A session on the scripted model `bench` with one tool, `calculator`, and `max_rounds`.
pub fn bench_session(max_rounds: u32) -> anyhow::Result<SessionStarted> {
    Ok(SessionStarted {
        call_options: Default::default(),
        queues: Default::default(),
        forked_from: None,
        workflow_version: cairn_runtime::WORKFLOW_VERSION,
        tool_policy: None,
        compaction: None,
        model: ModelSpec::parse("scripted:bench.json").context("the bench model spec")?,
        tools: vec![ToolSpec {
            name: "calculator".into(),
            description: "math".into(),
            input_schema: JsonText::parse(r#"{"type":"object"}"#)?,
        }]
        .into(),
        system_prompt: Some("bench".into()),
        limits: Limits {
            max_rounds,
            ..Limits::default()
        },
        model_retry: RetryPolicy::model_default(),
        tool_retry: RetryPolicy::tool_default(),
        workdir: None,
    })
}

/// The model `bench`'s answer made of `parts`: it stops for tools when it calls one.
pub fn response(parts: Vec<Part>) -> ModelResponse {
    let (stop_reason, raw) = if parts.iter().any(|p| matches!(p, Part::ToolUse(_))) {
        (StopReason::ToolUse, "tool_use")
    } else {
        (StopReason::EndTurn, "end_turn")
    };
    ModelResponse {
        provider: "scripted".into(),
        model: "bench".into(),
        parts,
        stop_reason_raw: raw.into(),
        stop_reason,
        usage: Usage::default(),
    }
}

/// An answer that thinks, says a word and makes `calls` calculator calls, `toolu_{turn}_{i}`.
pub fn tool_call_response(turn: u32, calls: usize) -> ModelResponse {
    let mut parts = vec![
        Part::Thinking {
            text: "thinking about which tools to call ".repeat(4),
            signature: "c2lnbmF0dXJl".repeat(8),
        },
        Part::text("Let me check."),
    ];
    for i in 0..calls {
        parts.push(Part::ToolUse(ToolUse {
            id: format!("toolu_{turn}_{i}"),
            name: "calculator".into(),
            arguments: r#"{"expression":"(17 + 25) * 3"}"#.into(),
            signature: None,
        }));
    }
    response(parts)
}
