//! Streamed model output on stdout: text, thinking (dimmed on a terminal, when asked for), a
//! line between attempts and a note on retries. One writer for the embedded `run` and the one
//! through a server, so both print the same.

use cairn_ledger::Delta;
use cairn_runtime::DeltaEvent;
use std::io::{IsTerminal, Write};

/// Writes one session's deltas as they come.
pub struct DeltaWriter {
    show_thinking: bool,
    dim: bool,
    last_origin: Option<(String, u32)>,
    in_thinking: bool,
}

impl DeltaWriter {
    /// A writer to stdout.
    pub fn new(show_thinking: bool) -> Self {
        DeltaWriter {
            show_thinking,
            dim: std::io::stdout().is_terminal(),
            last_origin: None,
            in_thinking: false,
        }
    }

    /// Ends the line the streamed output stopped in (closing thinking's dimming), so that a
    /// line of another kind starts on its own; the next attempt's output starts afresh.
    pub fn end_line(&mut self) {
        let mut out = std::io::stdout().lock();
        if self.in_thinking {
            self.in_thinking = false;
            let _ = write!(out, "{}", if self.dim { "\x1b[0m" } else { "" });
        }
        let _ = writeln!(out);
        let _ = out.flush();
        self.last_origin = None;
    }

    /// Writes `event` (output errors are ignored: a closed stdout must not fail the turn).
    pub fn write(&mut self, event: &DeltaEvent) {
        let mut out = std::io::stdout().lock();
        let origin = (event.origin.activity.clone(), event.origin.attempt);
        if self.last_origin.as_ref() != Some(&origin) {
            if self.last_origin.is_some() {
                let _ = writeln!(out);
            }
            if origin.1 > 1 {
                let _ = writeln!(out, "[retry: attempt {}]", origin.1);
            }
            self.last_origin = Some(origin);
        }
        match &event.delta {
            Delta::Thinking(text) if self.show_thinking => {
                if !self.in_thinking {
                    self.in_thinking = true;
                    let _ = write!(out, "{}", if self.dim { "\x1b[2m" } else { "[thinking] " });
                }
                let _ = write!(out, "{text}");
            }
            Delta::Text(text) => {
                if self.in_thinking {
                    self.in_thinking = false;
                    let _ = write!(out, "{}", if self.dim { "\x1b[0m\n" } else { "\n" });
                }
                let _ = write!(out, "{text}");
            }
            _ => {}
        }
        let _ = out.flush();
    }
}
