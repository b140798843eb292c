//! A session's working directory: `cairn run` records where the session's tools work when it
//! starts (`session_started.workdir`), so that `cairn resume` from anywhere, or a later `run`,
//! reads and runs where the session began, not where that process happens to be.

use super::exit_codes::usage_bail;
use anyhow::Context;
use cairn_runtime::SessionState;
use std::path::Path;

/// The absolute, canonical form of `workdir`, as a new session records it.
pub fn to_record(workdir: &Path) -> anyhow::Result<String> {
    let absolute = std::fs::canonicalize(workdir)
        .with_context(|| format!("cannot resolve the working directory {}", workdir.display()))?;
    match absolute.to_str() {
        Some(text) => Ok(text.to_owned()),
        None => usage_bail!(
            "the working directory {} is not UTF-8, which a session cannot record; use another",
            absolute.display()
        ),
    }
}

/// Refuses `--workdir` for a session that recorded another directory: its tools work where it
/// began, and taking the flag silently would mislead.
pub fn refuse_other(state: &SessionState, given: Option<&Path>) -> anyhow::Result<()> {
    let (Some(given), Some(recorded)) = (
        given,
        state.started.as_ref().and_then(|s| s.workdir.as_deref()),
    ) else {
        return Ok(());
    };
    if to_record(given)? != recorded {
        usage_bail!(
            "session {} works in {recorded} (recorded when it started), and --workdir {} \
             applies only when a session starts; leave it out to continue the session, or \
             start a new one",
            state.session_id,
            given.display()
        );
    }
    Ok(())
}
