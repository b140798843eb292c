//! `cairn run` through a server: start (or continue) a session, send the message, print the
//! answer as it streams from the session's event stream, and the outcome.

use super::deltas::DeltaWriter;
use super::out::{note, showln};
use cairn_ledger::ModelSpec;
use cairn_runtime::wire::StreamEvent;
use cairn_runtime::{
    Client, Error as RuntimeError, Event, EventStream, SessionOptions, TurnOutcome,
};

/// A server and a client of it.
pub struct Remote {
    /// The client.
    pub client: Client,
}

/// What `cairn run` was asked.
pub struct RunRequest {
    pub model: ModelSpec,
    pub session: Option<String>,
    pub system: Option<String>,
    pub max_rounds: Option<u32>,
    pub prompt: String,
    pub show_thinking: bool,
    /// The tools and tool policy flags of a new session.
    pub policy: super::approvals::PolicyArgs,
    /// The budgets of a new session (the server prices the calls).
    pub budget: super::budget::BudgetArgs,
    /// The compaction flags of a new session.
    pub compaction: super::compaction::CompactionArgs,
    /// Tools a new session offers besides the built-in ones (those of `--mcp-config`).
    pub extra_tools: Vec<cairn_ledger::ToolSpec>,
    /// Tool choice, server tools and prompt caching.
    pub call_options: super::call_options::CallOptionArgs,
}

impl Remote {
    /// A client of the server at `url`.
    pub fn connect(url: &str, token: Option<String>) -> anyhow::Result<Remote> {
        Ok(Remote {
            client: cairn_remote::connect(url, token)?,
        })
    }

    /// Runs one turn as `cairn run` does, the server's workers running its activities; the
    /// outcome, as the embedded run gives it.
    pub async fn run(&self, request: RunRequest) -> anyhow::Result<TurnOutcome> {
        if request.budget.prices.is_some() {
            anyhow::bail!(
                "--prices applies where calls are recorded: through a server, give it to \
                 `cairn server` (or set CAIRN_PRICES there)"
            );
        }
        let client = &self.client;
        let existing = match &request.session {
            Some(id) => match client.describe(id).await {
                Ok(description) => Some(description),
                Err(RuntimeError::UnknownSession { .. }) => None,
                Err(e) => return Err(e.into()),
            },
            None => None,
        };
        let existed = existing.is_some();
        let description = match existing {
            Some(description) => {
                crate::refuse_start_options(
                    &description.session_id,
                    &request.system,
                    request.max_rounds,
                )?;
                crate::refuse_policy_options(&description.session_id, &request.policy)?;
                request
                    .budget
                    .refuse_for_existing(&description.session_id)?;
                request
                    .compaction
                    .refuse_for_existing(&description.session_id)?;
                request
                    .call_options
                    .refuse_for_existing(&description.session_id)?;
                description
            }
            None => {
                // The session declares the built-in tools (and shell with --shell); the
                // server's workers host them.
                let tools = request.policy.offered_tools(&request.extra_tools);
                let tool_policy = request.policy.session_policy(&tools)?;
                let mut options = SessionOptions::new(request.model.clone(), tools);
                options.tool_policy = tool_policy;
                options.compaction = request.compaction.session_policy()?;
                options.call_options = request.call_options.session_options();
                options.session_id = request.session.clone();
                options.system_prompt = request.system.clone();
                if let Some(max_rounds) = request.max_rounds {
                    options.limits.max_rounds = max_rounds;
                }
                request.budget.apply(&mut options.limits);
                let session_id = client.start_session(options).await?;
                note!("new session {session_id}");
                client.describe(&session_id).await?
            }
        };
        let session_id = description.session_id.clone();
        // Subscribed before anything is sent, from the last event recorded: every event and
        // delta of what follows comes through it.
        let mut stream = client.subscribe(&session_id, description.events).await?;
        let mut writer = DeltaWriter::new(request.show_thinking);
        if let Some(turn) = description.running_turn {
            // The server carries a running turn on by itself: wait for it, showing it.
            showln!("[session {session_id}: turn {turn} is still running; following it first]");
            let outcome = follow_turn(client, &mut stream, &mut writer, &session_id, turn).await?;
            showln!();
            if !matches!(outcome, TurnOutcome::Completed { .. }) {
                note!("{}", crate::describe(&outcome));
            }
        }
        let turn_model = match description.model {
            Some(model) if model != request.model => Some(request.model),
            _ => None,
        };
        // A new session recorded the tool choice; an existing one takes it for this turn.
        let turn_choice = request.call_options.tool_choice.clone().filter(|_| existed);
        let turn = match (turn_model, turn_choice) {
            (model, Some(choice)) => {
                client
                    .send_with_tool_choice(&session_id, &request.prompt, model, choice)
                    .await?
            }
            (Some(model), None) => {
                client
                    .send_with_model(&session_id, &request.prompt, model)
                    .await?
            }
            (None, None) => client.send(&session_id, &request.prompt).await?,
        };
        let outcome = follow_turn(client, &mut stream, &mut writer, &session_id, turn).await?;
        showln!();
        if !matches!(outcome, TurnOutcome::Completed { .. }) {
            note!("{}", crate::describe(&outcome));
        }
        super::budget::report(&outcome);
        note!("session {session_id}");
        Ok(outcome)
    }
}

/// Prints `turn`'s deltas from `stream` until its end is recorded; then its outcome. A
/// broken stream stops the printing, not the wait.
async fn follow_turn(
    client: &Client,
    stream: &mut EventStream,
    writer: &mut DeltaWriter,
    session_id: &str,
    turn: u32,
) -> anyhow::Result<TurnOutcome> {
    while let Some(next) = stream.next().await {
        match next {
            Ok(StreamEvent::Delta(delta)) => {
                if delta.origin.turn == turn {
                    writer.write(&delta);
                }
            }
            Ok(StreamEvent::Event(event)) => {
                if let Event::ToolApprovalRequested {
                    tool_use_id, name, ..
                } = &event.event
                {
                    note!(
                        "waiting for approval: {name} (tool_use {tool_use_id}) — `cairn approve {session_id} {tool_use_id}` or `cairn deny {session_id} {tool_use_id} --reason TEXT`"
                    );
                }
                let ended = match event.event {
                    Event::TurnCompleted { turn: t, .. }
                    | Event::TurnFailed { turn: t, .. }
                    | Event::TurnCancelled { turn: t, .. } => t >= turn,
                    Event::SessionCancelled { .. } => true,
                    _ => false,
                };
                if ended {
                    break;
                }
            }
            Err(e) => {
                note!("warning: the session's event stream broke ({e}); waiting for the outcome");
                break;
            }
        }
    }
    Ok(client.wait_turn(session_id, turn).await?)
}
