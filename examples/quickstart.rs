//! The quickstart (README, "Library"): an agent with a custom tool, on an embedded store,
//! followed live. Runs offline: `cargo run --example quickstart [DATA_DIR]`.

use cairn::prelude::*;
use std::io::Write;
use std::path::Path;

/// A custom tool: the weather in a city (made up; a real one would call a service).
struct Weather;

#[async_trait]
impl Tool for Weather {
    fn spec(&self) -> ToolSpec {
        let input = serde_json::json!({
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"]
        });
        ToolSpec::new("weather", "Today's weather in a city.", &input)
    }

    async fn call(
        &self,
        call: &ToolCall,
        _context: &ActivityContext,
    ) -> Result<ToolOutput, ToolError> {
        let input: serde_json::Value = call.parse_arguments()?;
        let city = input["city"].as_str().unwrap_or("nowhere");
        Ok(ToolOutput::text(format!("sunny, 21 °C in {city}")))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let data = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "quickstart-data".into());
    quickstart(Path::new(&data), &mut std::io::stdout()).await
}

/// Runs one turn in a new session of the store in `data`, printing what happens on `out`.
pub async fn quickstart(data: &Path, out: &mut impl Write) -> anyhow::Result<()> {
    // Opens (or creates) the store, registers the tool once and starts the workers.
    let cairn = Cairn::builder(data)
        .tool(Weather)
        // An offline model that plays SCRIPT. For a real one, drop this line and use e.g.
        // ModelSpec::new("anthropic", "claude-sonnet-4-5") with ANTHROPIC_API_KEY set.
        .script("quickstart", SCRIPT)
        .start()
        .await?;
    let client = cairn.client();
    // The session offers the model every registered tool.
    let model = ModelSpec::new("scripted", "quickstart");
    let session = client.start_session(cairn.session(model)).await?;

    let mut events = client.follow(&session).await?;
    client.send(&session, "What's the weather in Lyon?").await?;
    while let Some(event) = events.next().await {
        match event? {
            SessionEvent::ToolCallScheduled { name, .. } => writeln!(out, "calling {name}")?,
            SessionEvent::ToolResult { content, .. } => {
                writeln!(out, "tool result: {}", content.canonical_json())?
            }
            SessionEvent::TurnEnded { outcome, .. } => {
                match outcome {
                    TurnOutcome::Completed { answer, .. } => writeln!(out, "answer: {answer}")?,
                    other => writeln!(out, "the turn did not complete: {other:?}")?,
                }
                break;
            }
            _ => {}
        }
    }
    cairn.shutdown().await;
    Ok(())
}

/// The offline model's answers: a call to `weather`, then the final text.
const SCRIPT: &str = r#"{"responses": [
  {"parts": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Lyon"}}]},
  {"parts": [{"type": "text", "text": "It is sunny in Lyon today, 21 °C."}]}
]}"#;
