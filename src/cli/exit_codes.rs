//! The exit status of every `cairn` command: one table, so a script can tell cases apart
//! (a usage error, a session not found, a store busy or unreachable, a failed or cancelled
//! turn, a diverged replay or an unclean fsck) without reading messages. The README's table
//! is this one.

use cairn_runtime::{Error as RuntimeError, TurnOutcome};
use std::fmt;
use std::process::ExitCode;

/// Done as asked.
pub const OK: u8 = 0;
/// An error no other code stands for (an IO failure, a corrupt store, a server's failure).
pub const ERROR: u8 = 1;
/// The command line is wrong: an unknown flag, a bad value, options that do not go together
/// (clap's own errors exit with 2 as well).
pub const USAGE: u8 = 2;
/// The session named does not exist.
pub const NOT_FOUND: u8 = 3;
/// The store is held by another process that does not serve it, or the store or server
/// cannot be reached for now; or the session is busy (a delete of a session whose turn runs).
pub const UNAVAILABLE: u8 = 4;
/// The turn ended failed, whatever the cause (the model, a limit, a budget).
pub const TURN_FAILED: u8 = 5;
/// The turn was cancelled (Ctrl-C, `cairn cancel`).
pub const TURN_CANCELLED: u8 = 6;
/// A replay diverged from its history, or fsck found problems.
pub const CHECK_FAILED: u8 = 7;
/// The turn completed, but its answer stopped short: the model stopped for max_tokens, a
/// refusal or a content filter (`TurnOutcome::abnormal_stop`).
pub const STOPPED_SHORT: u8 = 8;
/// A second Ctrl-C left the running turn for `cairn resume` (128 + SIGINT, as shells report).
pub const LEFT_RUNNING: u8 = 130;

/// A mistake on the command line, found after parsing (exit [`USAGE`]).
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// `bail!` for a usage error: returns a [`UsageError`] from the enclosing function.
macro_rules! usage_bail {
    ($($arg:tt)*) => {
        return Err($crate::cli::exit_codes::UsageError(format!($($arg)*)).into())
    };
}

pub(crate) use usage_bail;

/// The exit status of a turn's outcome.
pub fn of_outcome(outcome: &TurnOutcome) -> u8 {
    match outcome {
        TurnOutcome::Completed { .. } if outcome.abnormal_stop().is_some() => STOPPED_SHORT,
        TurnOutcome::Completed { .. } => OK,
        TurnOutcome::Cancelled { .. } => TURN_CANCELLED,
        // Every other ending is a failure, whatever its cause (kinds added later too).
        _ => TURN_FAILED,
    }
}

/// [`of_outcome`] as an [`ExitCode`].
pub fn outcome_code(outcome: &TurnOutcome) -> ExitCode {
    ExitCode::from(of_outcome(outcome))
}

/// The exit status of a command that ended with `error`: the first cause in its chain that
/// a code stands for.
pub fn of_error(error: &anyhow::Error) -> u8 {
    for cause in error.chain() {
        if cause.is::<UsageError>() || cause.is::<clap::Error>() {
            return USAGE;
        }
        if let Some(e) = cause.downcast_ref::<RuntimeError>() {
            match e {
                RuntimeError::UnknownSession { .. } => return NOT_FOUND,
                RuntimeError::InvalidSessionId { .. } => return USAGE,
                e if e.is_store_in_use() || e.is_retryable() => return UNAVAILABLE,
                RuntimeError::Remote { status: 404, .. } => return NOT_FOUND,
                RuntimeError::SessionBusy { .. } => return UNAVAILABLE,
                RuntimeError::Nondeterminism { .. } => return CHECK_FAILED,
                _ => {}
            }
        }
    }
    ERROR
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_their_codes_through_context() {
        use anyhow::Context;
        let unknown: anyhow::Result<()> = Err(RuntimeError::UnknownSession {
            session_id: "x".into(),
        })
        .context("cannot read session x");
        assert_eq!(of_error(&unknown.unwrap_err()), NOT_FOUND);
        let busy = anyhow::Error::new(RuntimeError::Unreachable {
            url: "http://127.0.0.1:1".into(),
            reason: "connection refused".into(),
        });
        assert_eq!(of_error(&busy), UNAVAILABLE);
        let usage: anyhow::Error = UsageError("bad".into()).into();
        assert_eq!(of_error(&usage.context("while parsing")), USAGE);
        assert_eq!(of_error(&anyhow::anyhow!("disk full")), ERROR);
    }

    #[test]
    fn outcomes_map_to_their_codes() {
        let completed = TurnOutcome::Completed {
            turn: 1,
            answer: "ok".into(),
            stop_reason: Some(cairn_ledger::StopReason::EndTurn),
            totals: Default::default(),
        };
        let short = TurnOutcome::Completed {
            turn: 1,
            answer: "cut".into(),
            stop_reason: Some(cairn_ledger::StopReason::MaxTokens),
            totals: Default::default(),
        };
        let failed = TurnOutcome::Failed {
            turn: 1,
            reason: "no".into(),
            budget_exceeded: None,
            totals: Default::default(),
        };
        let cancelled = TurnOutcome::Cancelled {
            turn: 1,
            reason: "^C".into(),
            totals: Default::default(),
        };
        assert_eq!(of_outcome(&completed), OK);
        assert_eq!(of_outcome(&short), STOPPED_SHORT);
        assert_eq!(of_outcome(&failed), TURN_FAILED);
        assert_eq!(of_outcome(&cancelled), TURN_CANCELLED);
    }
}
