//! Streamed model output not yet recorded. A running attempt's text and thinking deltas
//! accumulate here; its runner takes them at most every `WorkerConfig::progress_interval_ms`
//! and appends them as one `model_attempt_progress` record, so what a person saw survives a
//! crash without a durable write per delta, and the records hold each byte once.

use cairn_ledger::Delta;
use std::sync::Mutex;

/// Output streamed since the last take.
#[derive(Debug, Default)]
pub(crate) struct PendingOutput {
    inner: Mutex<Pending>,
}

#[derive(Debug, Default)]
struct Pending {
    text: String,
    thinking: String,
}

impl PendingOutput {
    /// Adds a delta; tool argument fragments are not shown to people and are not kept.
    pub(crate) fn push(&self, delta: &Delta) {
        let mut pending = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match delta {
            Delta::Text(text) => pending.text.push_str(text),
            Delta::Thinking(text) => pending.thinking.push_str(text),
            Delta::ToolArguments { .. } => {}
        }
    }

    /// Takes what accumulated since the last take, as (text, thinking); `None` when nothing did.
    pub(crate) fn take(&self) -> Option<(String, String)> {
        let mut pending = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if pending.text.is_empty() && pending.thinking.is_empty() {
            return None;
        }
        Some((
            std::mem::take(&mut pending.text),
            std::mem::take(&mut pending.thinking),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_each_streamed_byte_once_and_skips_tool_arguments() {
        let pending = PendingOutput::default();
        assert_eq!(pending.take(), None);
        pending.push(&Delta::Thinking("hmm ".into()));
        pending.push(&Delta::Text("The answer ".into()));
        pending.push(&Delta::ToolArguments {
            tool_use_id: "t".into(),
            fragment: "{".into(),
        });
        pending.push(&Delta::Text("is".into()));
        assert_eq!(
            pending.take(),
            Some(("The answer is".to_owned(), "hmm ".to_owned()))
        );
        assert_eq!(pending.take(), None);
        pending.push(&Delta::Text(" 42".into()));
        assert_eq!(pending.take(), Some((" 42".to_owned(), String::new())));
    }
}
