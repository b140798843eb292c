//! `cairn run` through a server: start (or continue) a session, send the message, print the
//! answer as it streams from the session's event stream, and the outcome.

use super::deltas::DeltaWriter;
use super::out::{note, showln};
use anyhow::Context;
use cairn_ledger::ModelSpec;
use cairn_runtime::wire::StreamEvent;
use cairn_runtime::{
    Client, Error as RuntimeError, Event, EventStream, SessionOptions, TurnOutcome,
};

/// A server and a client of it.
pub struct Remote {
    /// The client.
    pub client: Client,
    /// How printed commands reach the same server: ` --server URL` (or ` --data DIR` for a
    /// store served by the process that holds it).
    pub flag: String,
}

/// What `cairn run` was asked.
pub struct RunRequest {
    pub model: ModelSpec,
    pub session: Option<String>,
    pub system: Option<String>,
    pub max_rounds: Option<u32>,
    pub prompt: String,
    /// Images and documents sent with the prompt (`--attach`).
    pub media: Vec<cairn_ledger::Media>,
    pub show_thinking: bool,
    /// The tools and tool policy flags of a new session.
    pub policy: super::approvals::PolicyArgs,
    /// The budgets of a new session (the server prices the calls).
    pub budget: super::budget::BudgetArgs,
    /// The compaction flags of a new session.
    pub compaction: super::compaction::CompactionArgs,
    /// Tools a new session offers besides the built-in ones (those of `--mcp-config`).
    pub extra_tools: Vec<cairn_ledger::ToolSpec>,
    /// Print only the outcome, as one JSON object (`--json`).
    pub json: bool,
    /// Tool choice, server tools and prompt caching.
    pub call_options: super::call_options::CallOptionArgs,
}

impl Remote {
    /// A client of the server at `url`.
    pub fn connect(url: &str, token: Option<String>) -> anyhow::Result<Remote> {
        Ok(Remote {
            client: cairn_remote::connect(url, token)?,
            flag: format!(" --server {url}"),
        })
    }

    /// The same client, with printed commands naming the server by `flag`.
    pub fn named(self, flag: String) -> Remote {
        Remote { flag, ..self }
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
        // `--json` prints the outcome only.
        let mut writer = (!request.json).then(|| DeltaWriter::new(request.show_thinking));
        if let Some(turn) = description.running_turn {
            // The server carries a running turn on by itself: wait for it, showing it.
            if !request.json {
                showln!("[session {session_id}: turn {turn} is still running; following it first]");
            }
            let outcome = follow_turn(client, &mut stream, &mut writer, &session_id, turn);
            let outcome = self.interruptible(&session_id, turn, outcome).await?;
            if !request.json {
                showln!();
                if !matches!(outcome, TurnOutcome::Completed { .. }) {
                    note!("{}", crate::describe(&outcome));
                }
            }
        }
        let turn_model = match description.model {
            Some(model) if model != request.model => Some(request.model),
            _ => None,
        };
        // A new session recorded the tool choice; an existing one takes it for this turn.
        let turn_choice = request.call_options.tool_choice.clone().filter(|_| existed);
        let turn = client
            .send_turn(
                &session_id,
                &request.prompt,
                turn_model,
                request.media,
                turn_choice,
            )
            .await?;
        let outcome = follow_turn(client, &mut stream, &mut writer, &session_id, turn);
        let outcome = self.interruptible(&session_id, turn, outcome).await?;
        super::turn::report(&session_id, &outcome, request.json)?;
        Ok(outcome)
    }

    /// Waits for `outcome` of the turn, with Ctrl-C as the embedded `run` has it: a first
    /// Ctrl-C cancels the turn through the server after a short window (durably: the server
    /// records it), a second one within the window leaves it running on the server, says how
    /// to follow or cancel it, and exits with
    /// [`LEFT_RUNNING`](super::exit_codes::LEFT_RUNNING).
    // The window after a first Ctrl-C is real time, a person's.
    #[allow(clippy::disallowed_methods)]
    async fn interruptible(
        &self,
        session_id: &str,
        turn: u32,
        outcome: impl std::future::Future<Output = anyhow::Result<TurnOutcome>>,
    ) -> anyhow::Result<TurnOutcome> {
        tokio::pin!(outcome);
        tokio::select! {
            outcome = &mut outcome => return outcome,
            signal = tokio::signal::ctrl_c() => {
                signal.context("cannot listen for Ctrl-C")?;
            }
        }
        note!(
            "\n^C: cancelling turn {turn} of session {session_id} — press Ctrl-C again to leave \
             it running on the server instead"
        );
        tokio::select! {
            outcome = &mut outcome => return outcome,
            _ = tokio::signal::ctrl_c() => self.leave_running(session_id, turn),
            _ = tokio::time::sleep(super::turn::SECOND_CTRL_C_WINDOW) => {}
        }
        match self
            .client
            .cancel_turn(session_id, super::turn::CTRL_C_REASON)
            .await
        {
            Ok(cancelled) => note!(
                "cancelled turn {cancelled} of session {session_id} (recorded in its history)"
            ),
            // The turn ended on its own meanwhile: its outcome says how.
            Err(e) => note!("the turn was not cancelled: {e}"),
        }
        outcome.await
    }

    /// Says how to follow or cancel the turn left running on the server, and ends the process
    /// now (the server carries the turn on by itself).
    fn leave_running(&self, session_id: &str, turn: u32) -> ! {
        let flag = &self.flag;
        note!(
            "left turn {turn} of session {session_id} running on the server; nothing was \
             cancelled. Follow it with `cairn run{flag} --session {session_id} PROMPT` (which \
             waits for it first) or `cairn describe{flag} {session_id}`, or cancel it with \
             `cairn cancel{flag} --turn {session_id}`"
        );
        std::process::exit(i32::from(super::exit_codes::LEFT_RUNNING));
    }
}

/// Prints `turn`'s deltas from `stream` until its end is recorded; then its outcome. A
/// broken stream stops the printing, not the wait.
async fn follow_turn(
    client: &Client,
    stream: &mut EventStream,
    writer: &mut Option<DeltaWriter>,
    session_id: &str,
    turn: u32,
) -> anyhow::Result<TurnOutcome> {
    while let Some(next) = stream.next().await {
        match next {
            Ok(StreamEvent::Delta(delta)) => {
                if let Some(writer) = writer.as_mut().filter(|_| delta.origin.turn == turn) {
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
