//! The live view of a running turn on stdout: the model's answer as it streams (what its
//! deltas did not show, printed from the recorded answer: deltas are presentation only and
//! may not arrive), and between its parts each tool call with its arguments when it is
//! scheduled, each result (shortened) when it is recorded, each retry with its cause and
//! delay, and each call that waits for approval. It reads the session's own event stream ([`Client::subscribe`]), so it sees
//! exactly what the history records, in order, and works in process and through a server.
//!
//! One session streams as it comes (`run`, `chat`, `resume` of one session); several at once
//! (`resume`) print whole lines, each prefixed with its session id, so they do not interleave
//! mid-word.

use super::deltas::DeltaWriter;
use cairn_ledger::{Delta, Part};
use cairn_runtime::wire::StreamEvent;
use cairn_runtime::{ActivityRef, Client, DeltaEvent, Event, EventEnvelope};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::Duration;

/// How long [`LiveView::finish`] waits for the stream to reach the turn's end.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(3);

/// A tool result's length at most in a live line, in characters.
const RESULT_PREVIEW_CHARS: usize = 120;

/// A running live view of one session.
pub struct LiveView {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl LiveView {
    /// Starts printing `session_id`'s events after `after_seq` (and its deltas) until a turn
    /// ends or the session is cancelled. With `prefix`, whole lines prefixed with the session
    /// id instead of a raw stream.
    pub async fn start(
        client: &Client,
        session_id: &str,
        after_seq: u64,
        show_thinking: bool,
        prefix: bool,
    ) -> anyhow::Result<LiveView> {
        let mut stream = client.subscribe(session_id, after_seq).await?;
        let mut printer = LinePrinter {
            raw: DeltaWriter::new(show_thinking && !prefix),
            prefix: prefix.then(|| session_id.to_owned()),
            partial: String::new(),
            mid_line: false,
            calls: BTreeMap::new(),
            streamed: BTreeMap::new(),
            completed: BTreeSet::new(),
            failures: BTreeMap::new(),
        };
        let (stop, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            loop {
                let item = tokio::select! {
                    item = stream.next() => item,
                    _ = &mut stop_rx => break,
                };
                match item {
                    Some(Ok(StreamEvent::Delta(delta))) => printer.delta(&delta),
                    Some(Ok(StreamEvent::Event(envelope))) => {
                        if printer.event(&envelope) {
                            break;
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "the live view's stream broke");
                        break;
                    }
                    None => break,
                }
            }
            printer.end();
        });
        Ok(LiveView { stop, task })
    }

    /// Waits (a little) for the stream to reach the turn's end, so that everything recorded
    /// is printed, then stops.
    pub async fn finish(mut self) {
        if tokio::time::timeout(DRAIN_TIMEOUT, &mut self.task)
            .await
            .is_err()
        {
            let _ = self.stop.send(());
            let _ = self.task.await;
        }
    }

    /// Stops at once (the turn is left running).
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Prints what the stream brings, in one of the two forms.
struct LinePrinter {
    raw: DeltaWriter,
    /// Prefixed form: the session id, and the text of the line being assembled.
    prefix: Option<String>,
    partial: String,
    /// Raw form: whether the streamed text stopped mid-line.
    mid_line: bool,
    /// Each tool call's name and arguments, from the model's answer that made it.
    calls: BTreeMap<String, (String, String)>,
    /// The last failure of each activity (`model:ROUND` or a tool_use id), said with its retry.
    failures: BTreeMap<String, String>,
    /// The answer text each model call attempt (turn, `model:ROUND`, attempt) streamed so far.
    streamed: BTreeMap<(u32, String, u32), String>,
    /// The model call attempts whose answer is recorded: their late deltas are not shown
    /// again (the answer's text was shown from the event).
    completed: BTreeSet<(u32, String, u32)>,
}

/// What a model's answer (`parts`) holds of text beyond what its deltas showed (`streamed`):
/// all of it when none arrived, the rest when they stopped part way, nothing when they showed
/// it all (or something else). Deltas are presentation only: a reader that falls behind skips
/// some, and a live view that starts after a fast turn has ended reads the turn from the
/// history, whose events carry no deltas.
fn unstreamed_text(streamed: &str, parts: &[Part]) -> Option<String> {
    let answer: String = parts
        .iter()
        .filter_map(|part| match part {
            Part::Text { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let rest = answer.strip_prefix(streamed)?;
    (!rest.is_empty()).then(|| rest.to_owned())
}

impl LinePrinter {
    fn delta(&mut self, event: &DeltaEvent) {
        let delta = &event.delta;
        let origin = &event.origin;
        let key = (origin.turn, origin.activity.clone(), origin.attempt);
        if self.completed.contains(&key) {
            return;
        }
        if let Delta::Text(text) = delta {
            self.streamed.entry(key).or_default().push_str(text);
        }
        match (&self.prefix, delta) {
            (None, _) => {
                if let Delta::Text(text) | Delta::Thinking(text) = delta {
                    if !text.is_empty() {
                        self.mid_line = !text.ends_with('\n');
                    }
                }
                self.raw.write(event);
            }
            (Some(_), Delta::Text(text)) => {
                self.partial.push_str(text);
                while let Some(end) = self.partial.find('\n') {
                    let line: String = self.partial.drain(..=end).collect();
                    self.print(line.trim_end_matches('\n'));
                }
            }
            (Some(_), _) => {}
        }
    }

    /// Prints a line of its own (ending streamed text's line first).
    fn line(&mut self, text: &str) {
        if self.prefix.is_some() {
            self.flush_partial();
        } else if self.mid_line {
            self.mid_line = false;
            self.raw.end_line();
        }
        self.print(text);
    }

    fn print(&self, text: &str) {
        let mut out = std::io::stdout().lock();
        let _ = match &self.prefix {
            Some(session) => writeln!(out, "{session}: {text}"),
            None => writeln!(out, "{text}"),
        };
        let _ = out.flush();
    }

    fn flush_partial(&mut self) {
        if !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.print(&line);
        }
    }

    fn end(&mut self) {
        if self.prefix.is_some() {
            self.flush_partial();
        } else if self.mid_line {
            self.mid_line = false;
            self.raw.end_line();
        }
    }

    /// Prints what `envelope` shows; true when the turn (or the session) has ended.
    fn event(&mut self, envelope: &EventEnvelope) -> bool {
        match &envelope.event {
            Event::ModelCallCompleted {
                turn,
                round,
                attempt,
                response,
                ..
            } => {
                // The answer's text the deltas did not show, shown as they would have.
                let key = (*turn, format!("model:{round}"), *attempt);
                let streamed = self.streamed.remove(&key).unwrap_or_default();
                if let Some(rest) = unstreamed_text(&streamed, &response.parts) {
                    self.delta(&DeltaEvent {
                        origin: ActivityRef {
                            session_id: envelope.session_id.clone(),
                            turn: *turn,
                            activity: key.1.clone(),
                            attempt: *attempt,
                        },
                        delta: Delta::Text(rest),
                    });
                    self.streamed.remove(&key);
                }
                self.completed.insert(key);
                for part in &response.parts {
                    if let Part::ToolUse(call) = part {
                        self.calls
                            .insert(call.id.clone(), (call.name.clone(), call.arguments.clone()));
                    }
                }
            }
            Event::ModelCallFailed {
                turn,
                round,
                attempt,
                failure,
                ..
            } => {
                self.streamed
                    .remove(&(*turn, format!("model:{round}"), *attempt));
                let cause = format!(
                    "model call {round} attempt {attempt} failed ({}): {}",
                    failure.class.as_str(),
                    one_line(&failure.message, RESULT_PREVIEW_CHARS)
                );
                self.failures.insert(format!("model:{round}"), cause);
            }
            Event::ModelCallScheduled {
                round,
                attempt,
                not_before_ms,
                ..
            } if *attempt > 1 => {
                let cause = self
                    .failures
                    .remove(&format!("model:{round}"))
                    .unwrap_or_else(|| format!("model call {round} attempt {} ended", attempt - 1));
                let delay = not_before_ms.saturating_sub(envelope.recorded_at_ms);
                self.line(&format!(
                    "[retry: {cause}; attempt {attempt} in {}]",
                    millis(delay)
                ));
            }
            Event::ToolCallScheduled {
                tool_use_id,
                name,
                attempt,
                not_before_ms,
                ..
            } => {
                let arguments = self
                    .calls
                    .get(tool_use_id)
                    .map_or_else(String::new, |(_, a)| one_line(a, RESULT_PREVIEW_CHARS));
                if *attempt > 1 {
                    let cause = self
                        .failures
                        .remove(tool_use_id)
                        .unwrap_or_else(|| format!("{name} attempt {} ended", attempt - 1));
                    let delay = not_before_ms.saturating_sub(envelope.recorded_at_ms);
                    self.line(&format!(
                        "[retry: {cause}; attempt {attempt} in {}]",
                        millis(delay)
                    ));
                } else {
                    self.line(&format!("[tool] {name} {arguments}"));
                }
            }
            Event::ToolCallFailed {
                tool_use_id,
                attempt,
                failure,
                ..
            } => {
                let name = self.name_of(tool_use_id);
                let cause = format!(
                    "{name} attempt {attempt} failed ({}): {}",
                    failure.class.as_str(),
                    one_line(&failure.message, RESULT_PREVIEW_CHARS)
                );
                self.failures.insert(tool_use_id.clone(), cause);
            }
            Event::ToolCallCompleted {
                tool_use_id,
                content,
                is_error,
                ..
            } => {
                let name = self.name_of(tool_use_id);
                let text = match content {
                    cairn_ledger::ToolResultContent::Text(text) => text.clone(),
                    json @ cairn_ledger::ToolResultContent::Json(_) => json.canonical_json(),
                    blocks @ cairn_ledger::ToolResultContent::Blocks(_) => blocks.text_view(),
                };
                let label = if *is_error { "error" } else { "result" };
                self.line(&format!(
                    "[{label}] {name}: {}",
                    one_line(&text, RESULT_PREVIEW_CHARS)
                ));
            }
            Event::ToolApprovalRequested {
                tool_use_id, name, ..
            } => {
                let arguments = self
                    .calls
                    .get(tool_use_id)
                    .map_or_else(String::new, |(_, a)| one_line(a, RESULT_PREVIEW_CHARS));
                self.line(&format!(
                    "[approval needed] {name} {arguments} (`cairn approve {session} {tool_use_id}` or `cairn deny {session} {tool_use_id}`)",
                    session = envelope.session_id
                ));
            }
            Event::ToolCallApproved { tool_use_id, .. } => {
                let name = self.name_of(tool_use_id);
                self.line(&format!("[approved] {name} {tool_use_id}"));
            }
            Event::ToolCallDenied {
                tool_use_id,
                reason,
                ..
            } => {
                let name = self.name_of(tool_use_id);
                self.line(&format!(
                    "[denied] {name} {tool_use_id}: {}",
                    one_line(reason, RESULT_PREVIEW_CHARS)
                ));
            }
            Event::TurnCompleted { .. }
            | Event::TurnFailed { .. }
            | Event::TurnCancelled { .. }
            | Event::SessionCancelled { .. } => return true,
            _ => {}
        }
        false
    }

    fn name_of(&self, tool_use_id: &str) -> String {
        self.calls
            .get(tool_use_id)
            .map_or_else(|| tool_use_id.to_owned(), |(name, _)| name.clone())
    }
}

/// A delay in words: `250 ms`, `1.5 s`.
fn millis(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

/// `text` on one line, cut to `max` characters (an ellipsis says it was cut).
pub fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        flat
    } else {
        format!("{}…", flat.chars().take(max).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(text: &str) -> Part {
        Part::Text {
            text: text.to_owned(),
            item_id: None,
            citations: None,
        }
    }

    #[test]
    fn the_answer_text_the_deltas_did_not_show_is_what_is_left_to_print() {
        let parts = [
            Part::Thinking {
                text: "hidden".to_owned(),
                signature: "sig".to_owned(),
            },
            text("first "),
            text("answer"),
        ];
        // No delta arrived (the live view read a finished turn from the history).
        assert_eq!(unstreamed_text("", &parts).as_deref(), Some("first answer"));
        // The deltas stopped part way (a reader that fell behind skipped the rest).
        assert_eq!(unstreamed_text("first", &parts).as_deref(), Some(" answer"));
        // Everything was shown, or something that is not this answer: nothing more.
        assert_eq!(unstreamed_text("first answer", &parts), None);
        assert_eq!(unstreamed_text("other", &parts), None);
        // An answer of tool calls only has no text to show.
        assert_eq!(unstreamed_text("", &[]), None);
    }
}
