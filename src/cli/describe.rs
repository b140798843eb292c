//! `cairn describe SESSION`: one session at a glance — status, model, working directory, the
//! options of its model calls (tool choice, server tools, prompt caching), each turn with its
//! outcome and usage, the session's usage, and what the running turn waits for
//! (tasks, approvals). Read from the session's description and history, so it works on a store
//! and through a server alike; `--json` prints the same as one object.

use super::live::one_line;
use super::out::outln;
use cairn_ledger::{CallOptions, ModelSpec, Usage};
use cairn_runtime::wire::{PendingApproval, PendingTask, SessionDescription};
use cairn_runtime::{Client, Event, EventEnvelope};
use serde::Serialize;

/// A session as `cairn describe` shows it.
#[derive(Debug, Serialize)]
pub struct Described {
    /// The session.
    pub session_id: String,
    /// `idle`, `running` or `cancelled`.
    pub status: &'static str,
    /// The default model, `PROVIDER:MODEL`.
    pub model: Option<String>,
    /// The directory its tools work in, when it recorded one.
    pub workdir: Option<String>,
    /// The options of its model calls, as its start recorded them.
    pub call_options: ShownCallOptions,
    /// When its first event was recorded (epoch ms).
    pub started_at_ms: u64,
    /// When its last event was recorded (epoch ms).
    pub updated_at_ms: u64,
    /// Events recorded.
    pub events: u64,
    /// Its turns, in order.
    pub turns: Vec<TurnSummary>,
    /// Token usage of every model call attempt.
    pub usage: Usage,
    /// Usage, cost and model calls of every attempt, failed ones included.
    pub totals: cairn_runtime::UsageTotals,
    /// Activities the running turn waits for.
    pub pending_tasks: Vec<PendingTask>,
    /// Tool calls the running turn waits on a person for.
    pub pending_approvals: Vec<PendingApproval>,
}

/// A session's model-call options, each stated even when unset (`cairn run --tool-choice`,
/// `--server-tool`, `--no-prompt-cache`).
#[derive(Debug, PartialEq, Eq, Serialize)]
pub struct ShownCallOptions {
    /// `auto`, `any`, `none` or `tool:NAME`; `None` when unset (the provider's default, auto).
    /// A turn may override it.
    pub tool_choice: Option<String>,
    /// The provider's own tools turned on, each `NAME` or `NAME=MAX_USES`.
    pub server_tools: Vec<String>,
    /// Whether prompt-cache breakpoints are placed (Anthropic, and Bedrock models that take
    /// cache points); on unless the session turned them off.
    pub prompt_cache: bool,
}

impl ShownCallOptions {
    /// `options` as shown.
    pub fn new(options: &CallOptions) -> Self {
        ShownCallOptions {
            tool_choice: options.tool_choice.as_ref().map(ToString::to_string),
            server_tools: options
                .server_tools
                .iter()
                .map(|tool| match tool.max_uses {
                    Some(n) => format!("{}={n}", tool.kind.as_str()),
                    None => tool.kind.as_str().to_owned(),
                })
                .collect(),
            prompt_cache: !options.no_prompt_cache,
        }
    }

    /// One line: `tool choice auto (default), server tools none, prompt cache on`.
    pub fn text(&self) -> String {
        format!(
            "tool choice {}, server tools {}, prompt cache {}",
            self.tool_choice.as_deref().unwrap_or("auto (default)"),
            if self.server_tools.is_empty() {
                "none".to_owned()
            } else {
                self.server_tools.join(",")
            },
            if self.prompt_cache { "on" } else { "off" }
        )
    }
}

/// One turn of a session.
#[derive(Debug, Serialize)]
pub struct TurnSummary {
    /// Its number, from 1.
    pub turn: u32,
    /// `completed`, `failed`, `cancelled` or `running`.
    pub outcome: &'static str,
    /// The message that started it.
    pub prompt: String,
    /// The final answer (completed) or the reason (failed, cancelled).
    pub detail: Option<String>,
    /// Tool calls it made.
    pub tool_calls: u32,
    /// Token usage of its model call attempts.
    pub usage: Usage,
    /// When its message was recorded (epoch ms).
    pub started_at_ms: u64,
    /// When it ended (epoch ms); `None` while it runs.
    pub ended_at_ms: Option<u64>,
}

/// Reads `session_id` through `client`.
pub async fn read(client: &Client, session_id: &str) -> anyhow::Result<Described> {
    let description = client.describe(session_id).await?;
    let history = client.history(session_id).await?;
    Ok(build(description, &history))
}

/// Puts a description and its history together.
pub fn build(description: SessionDescription, history: &[EventEnvelope]) -> Described {
    let started = history.iter().find_map(|e| match &e.event {
        Event::SessionStarted(started) => Some(started),
        _ => None,
    });
    let workdir = started.and_then(|s| s.workdir.clone());
    // A history without its start (never written so) shows the defaults.
    let call_options =
        ShownCallOptions::new(&started.map(|s| s.call_options.clone()).unwrap_or_default());
    Described {
        session_id: description.session_id,
        status: description.status.as_str(),
        model: description.model.as_ref().map(model_name),
        workdir,
        call_options,
        started_at_ms: history.first().map_or(0, |e| e.recorded_at_ms),
        updated_at_ms: history.last().map_or(0, |e| e.recorded_at_ms),
        events: description.events,
        turns: turns(history),
        usage: description.usage,
        totals: description.totals,
        pending_tasks: description.pending_tasks,
        pending_approvals: description.pending_approvals,
    }
}

/// `PROVIDER:MODEL`.
pub fn model_name(model: &ModelSpec) -> String {
    format!("{}:{}", model.provider, model.model)
}

/// Each turn of `history`, with how it ended.
pub fn turns(history: &[EventEnvelope]) -> Vec<TurnSummary> {
    let mut turns: Vec<TurnSummary> = Vec::new();
    for envelope in history {
        let at = envelope.recorded_at_ms;
        match &envelope.event {
            Event::UserMessage { turn, text, .. } => turns.push(TurnSummary {
                turn: *turn,
                outcome: "running",
                prompt: text.clone(),
                detail: None,
                tool_calls: 0,
                usage: Usage::default(),
                started_at_ms: at,
                ended_at_ms: None,
            }),
            Event::ModelCallCompleted { turn, response, .. } => {
                if let Some(t) = turn_mut(&mut turns, *turn) {
                    t.usage.add(&response.usage);
                    let text = response.text();
                    if !text.is_empty() {
                        t.detail = Some(text);
                    }
                }
            }
            Event::ModelCallFailed { turn, failure, .. } => {
                if let (Some(t), Some(usage)) = (turn_mut(&mut turns, *turn), &failure.usage) {
                    t.usage.add(usage);
                }
            }
            Event::ToolCallScheduled { turn, attempt, .. } if *attempt == 1 => {
                if let Some(t) = turn_mut(&mut turns, *turn) {
                    t.tool_calls += 1;
                }
            }
            Event::TurnCompleted { turn, .. } => end(&mut turns, *turn, "completed", None, at),
            Event::TurnFailed { turn, reason, .. } => {
                end(&mut turns, *turn, "failed", Some(reason), at)
            }
            Event::TurnCancelled { turn, reason } => {
                end(&mut turns, *turn, "cancelled", Some(reason), at)
            }
            Event::SessionCancelled { reason } => {
                if let Some(t) = turns.last_mut().filter(|t| t.ended_at_ms.is_none()) {
                    t.outcome = "cancelled";
                    t.detail = Some(reason.clone());
                    t.ended_at_ms = Some(at);
                }
            }
            _ => {}
        }
    }
    turns
}

fn turn_mut(turns: &mut [TurnSummary], turn: u32) -> Option<&mut TurnSummary> {
    turns.iter_mut().rev().find(|t| t.turn == turn)
}

fn end(
    turns: &mut [TurnSummary],
    turn: u32,
    outcome: &'static str,
    reason: Option<&String>,
    at: u64,
) {
    if let Some(t) = turn_mut(turns, turn) {
        t.outcome = outcome;
        if let Some(reason) = reason {
            t.detail = Some(reason.clone());
        }
        t.ended_at_ms = Some(at);
    }
}

/// Prints `described` for a person, or as one JSON object.
pub fn print(described: &Described, json: bool) -> anyhow::Result<()> {
    if json {
        outln!("{}", serde_json::to_string(described)?)?;
        return Ok(());
    }
    let d = described;
    outln!("session   {}", d.session_id)?;
    outln!("status    {}", d.status)?;
    outln!("model     {}", d.model.as_deref().unwrap_or("-"))?;
    outln!(
        "workdir   {}",
        d.workdir
            .as_deref()
            .unwrap_or("- (not recorded: the resuming process's)")
    )?;
    outln!("options   {}", d.call_options.text())?;
    outln!(
        "started   {}   last activity {}",
        super::sessions::timestamp(d.started_at_ms),
        super::sessions::timestamp(d.updated_at_ms)
    )?;
    outln!("events    {}", d.events)?;
    outln!("usage     {}", usage_text(&d.usage))?;
    outln!("totals    {}", super::budget::totals_text(&d.totals))?;
    outln!("turns     {}", d.turns.len())?;
    for t in &d.turns {
        let took = match t.ended_at_ms {
            Some(end) => format!(
                "{:.1} s",
                end.saturating_sub(t.started_at_ms) as f64 / 1000.0
            ),
            None => "…".to_owned(),
        };
        outln!(
            "  {:>3}  {:<9}  {:>8}  {:>3} tool calls  {}  {:?}",
            t.turn,
            t.outcome,
            took,
            t.tool_calls,
            usage_text(&t.usage),
            one_line(&t.prompt, 40)
        )?;
        if let Some(detail) = &t.detail {
            outln!("       {}", one_line(detail, 100))?;
        }
    }
    if !d.pending_tasks.is_empty() {
        outln!("pending tasks")?;
        for task in &d.pending_tasks {
            outln!(
                "  {} attempt {} (scheduled at seq {})",
                task.activity,
                task.attempt,
                task.scheduled_seq
            )?;
        }
    }
    if !d.pending_approvals.is_empty() {
        outln!("waiting for approval")?;
        for a in &d.pending_approvals {
            outln!(
                "  {} {} {} — `cairn approve {} {}`",
                a.tool_use_id,
                a.name,
                one_line(&a.arguments, 60),
                d.session_id,
                a.tool_use_id
            )?;
        }
    }
    Ok(())
}

/// `in/out tokens`.
pub fn usage_text(usage: &Usage) -> String {
    format!(
        "{} in / {} out tokens",
        usage.input_tokens, usage.output_tokens
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::{ServerTool, ServerToolKind, ToolChoice};

    #[test]
    fn call_options_are_stated_even_when_unset() {
        let unset = ShownCallOptions::new(&CallOptions::default());
        assert_eq!(
            unset.text(),
            "tool choice auto (default), server tools none, prompt cache on"
        );
        let set = ShownCallOptions::new(&CallOptions {
            tool_choice: Some(ToolChoice::Tool("calc".into())),
            server_tools: vec![
                ServerTool {
                    kind: ServerToolKind::WebSearch,
                    max_uses: Some(2),
                },
                ServerTool {
                    kind: ServerToolKind::WebFetch,
                    max_uses: None,
                },
            ],
            no_prompt_cache: true,
        });
        assert_eq!(
            set.text(),
            "tool choice tool:calc, server tools web_search=2,web_fetch, prompt cache off"
        );
        assert_eq!(
            serde_json::to_value(&set).unwrap(),
            serde_json::json!({
                "tool_choice": "tool:calc",
                "server_tools": ["web_search=2", "web_fetch"],
                "prompt_cache": false
            })
        );
    }
}
