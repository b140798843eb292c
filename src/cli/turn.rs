//! Watching a turn from the command line until it ends: the live view while it runs, and
//! Ctrl-C. A first Ctrl-C cancels the turn durably (after a short window, said on stderr);
//! a second one within that window leaves the turn running for `cairn resume`, says how to
//! resume or cancel it, and exits at once with [`LEFT_RUNNING`](super::exit_codes::LEFT_RUNNING).

use super::exit_codes::{self, usage_bail};
use super::live::LiveView;
use super::out::{note, outln, showln};
use anyhow::Context;
use cairn::host::Host;
use cairn_ledger::{Media, ModelSpec};
use cairn_runtime::TurnOutcome;
use std::time::Duration;

/// How long after a first Ctrl-C the turn is cancelled; a second Ctrl-C before then leaves it
/// running instead.
pub const SECOND_CTRL_C_WINDOW: Duration = Duration::from_millis(1500);

/// The reason a Ctrl-C cancellation records in the history.
pub const CTRL_C_REASON: &str = "cancelled with Ctrl-C";

/// One session's turns, watched from this process.
pub struct Watch<'a> {
    /// The host running the session.
    pub host: &'a Host,
    /// The session.
    pub session_id: &'a str,
    /// Print thinking as it streams.
    pub show_thinking: bool,
    /// Print nothing while the turn runs (`--json` prints only the outcome).
    pub quiet: bool,
    /// How printed commands name the store: ` --data DIR`.
    pub data_flag: String,
}

impl Watch<'_> {
    /// Sends `prompt` with `media` (with another model for this turn, if given) and watches
    /// the turn it starts until it ends.
    pub async fn send(
        &self,
        prompt: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
    ) -> anyhow::Result<TurnOutcome> {
        self.send_with(prompt, model, media, None).await
    }

    /// [`Watch::send`], with a tool choice for this turn when given.
    pub async fn send_with(
        &self,
        prompt: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
        tool_choice: Option<cairn_ledger::ToolChoice>,
    ) -> anyhow::Result<TurnOutcome> {
        let after_seq = self.last_seq().await?;
        // Following from the last event before the message: nothing of the turn is missed.
        let live = self.live(after_seq).await?;
        let client = &self.host.client;
        let turn = client
            .send_turn(self.session_id, prompt, model, media, tool_choice)
            .await;
        let turn = match turn {
            Ok(turn) => turn,
            Err(e) => {
                if let Some(live) = live {
                    live.stop().await;
                }
                return Err(e.into());
            }
        };
        self.watch(turn, live).await
    }

    /// Watches the running turn `turn` (an interrupted one being carried on) with `live`,
    /// started before the workers were, so that nothing of it is missed.
    pub async fn running_with(
        &self,
        turn: u32,
        live: Option<LiveView>,
    ) -> anyhow::Result<TurnOutcome> {
        self.watch(turn, live).await
    }

    /// The seq of the session's last event.
    pub async fn last_seq(&self) -> anyhow::Result<u64> {
        let state = self.host.engine.state(self.session_id).await?;
        Ok(state.next_seq.saturating_sub(1))
    }

    async fn live(&self, after_seq: u64) -> anyhow::Result<Option<LiveView>> {
        if self.quiet {
            return Ok(None);
        }
        let live = LiveView::start(
            &self.host.client,
            self.session_id,
            after_seq,
            self.show_thinking,
            false,
        )
        .await?;
        Ok(Some(live))
    }

    // The window after a first Ctrl-C is real time, a person's.
    #[allow(clippy::disallowed_methods)]
    async fn watch(&self, turn: u32, live: Option<LiveView>) -> anyhow::Result<TurnOutcome> {
        let engine = &self.host.engine;
        let wait = super::approvals::wait_turn(engine, self.session_id, turn, false);
        tokio::pin!(wait);
        let ended = loop {
            tokio::select! {
                outcome = &mut wait => break outcome?,
                signal = tokio::signal::ctrl_c() => {
                    signal.context("cannot listen for Ctrl-C")?;
                    note!(
                        "\n^C: cancelling turn {turn} of session {} — press Ctrl-C again to \
                         leave it running for `cairn resume` instead",
                        self.session_id
                    );
                    tokio::select! {
                        outcome = &mut wait => break outcome?,
                        _ = tokio::signal::ctrl_c() => {
                            if let Some(live) = live {
                                live.stop().await;
                            }
                            self.leave_running(turn);
                        }
                        _ = tokio::time::sleep(SECOND_CTRL_C_WINDOW) => {
                            match self.host.client.cancel_turn(self.session_id, CTRL_C_REASON).await {
                                Ok(cancelled) => note!(
                                    "cancelled turn {cancelled} of session {} (recorded in its \
                                     history)",
                                    self.session_id
                                ),
                                // The turn ended on its own meanwhile: its outcome says how.
                                Err(e) => note!("the turn was not cancelled: {e}"),
                            }
                        }
                    }
                }
            }
        };
        if let Some(live) = live {
            live.finish().await;
        }
        ended.context("the turn's wait ended without an outcome")
    }

    /// Says how to carry on or cancel the turn left running, and ends the process now: the
    /// workers stop mid-call as a crash would stop them, which the history is made for.
    fn leave_running(&self, turn: u32) -> ! {
        let data = &self.data_flag;
        let id = self.session_id;
        note!(
            "left turn {turn} of session {id} running; nothing was cancelled. Carry it on with \
             `cairn resume{data}`, or cancel it with `cairn cancel{data} --turn {id}`"
        );
        std::process::exit(i32::from(exit_codes::LEFT_RUNNING));
    }
}

/// The prompt argument, or standard input's whole text when it is `-`.
pub fn read_prompt(argument: String) -> anyhow::Result<String> {
    if argument != "-" {
        return Ok(argument);
    }
    let mut text = String::new();
    if let Err(e) = std::io::Read::read_to_string(&mut std::io::stdin(), &mut text) {
        usage_bail!("the prompt is `-`, but standard input cannot be read as text: {e}");
    }
    Ok(text.trim_end_matches('\n').to_owned())
}

/// Says how the turn ended: for a person (after its streamed answer; a turn that did not
/// complete is described on stderr), or as one JSON object `{"session_id", "outcome":
/// {"status", "turn", "answer" | "reason"}}`.
pub fn report(session_id: &str, outcome: &TurnOutcome, json: bool) -> anyhow::Result<()> {
    if json {
        outln!(
            "{}",
            serde_json::json!({ "session_id": session_id, "outcome": outcome })
        )?;
        return Ok(());
    }
    showln!();
    if !matches!(outcome, TurnOutcome::Completed { .. }) {
        note!("{}", crate::describe(outcome));
    }
    super::budget::report(outcome);
    note!("session {session_id}");
    Ok(())
}

/// After a turn of a chat: ends its streamed line, and describes a turn that did not complete.
pub fn report_line(outcome: &TurnOutcome) {
    showln!();
    if !matches!(outcome, TurnOutcome::Completed { .. }) {
        note!("{}", crate::describe(outcome));
    }
    super::budget::report(outcome);
}
