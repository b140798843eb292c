//! The `shell` tool: runs one command with `sh -c` in the session's working directory, with a
//! timeout (the whole process group is killed) and a cap on the output it keeps. Sessions
//! that offer it ask a person before each call unless their policy says otherwise
//! ([`Tool::asks_by_default`]).

use crate::context::ActivityContext;
use crate::error::{Error, Result};
use crate::tool::{PolicySubject, SubjectKind, Tool, ToolCall, ToolOutput};
use async_trait::async_trait;
use cairn_ledger::{JsonText, ToolSpec};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The tool's name.
const NAME: &str = "shell";

/// Runs a shell command in a working directory.
///
/// Input `{"command": "...", "timeout_ms": n}` (`timeout_ms` optional, at most the tool's
/// limit). The result is JSON `{"exit_code", "stdout", "stderr", "timed_out", "truncated"}`
/// (`exit_code` null when a signal ended it): each stream keeps its first
/// [`Shell::MAX_OUTPUT_BYTES`] bytes, and `truncated` says when more was dropped. A non-zero
/// exit or a timeout is an `is_error` result. On timeout or cancellation the command's whole
/// process group is killed, so children it started do not outlive it.
#[derive(Debug, Clone)]
pub struct Shell {
    working_dir: PathBuf,
    timeout: Duration,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Input {
    command: String,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

impl Shell {
    /// Bytes of each output stream kept in the result (64 KiB).
    pub const MAX_OUTPUT_BYTES: usize = 64 * 1024;
    /// The timeout of a call that names none, and the most one may name (2 minutes).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

    /// A shell that runs commands in `working_dir`.
    pub fn new(working_dir: impl Into<PathBuf>) -> Self {
        Shell {
            working_dir: working_dir.into(),
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    /// The same, with another timeout limit.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The directory commands run in.
    pub fn working_dir(&self) -> &Path {
        &self.working_dir
    }
}

/// Reads a stream to its end, keeping the first `cap` bytes; says whether it dropped any.
async fn read_capped(mut stream: impl AsyncRead + Unpin, cap: usize) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buffer = [0u8; 8192];
    loop {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return (kept, truncated),
            Ok(n) => {
                let room = cap.saturating_sub(kept.len());
                kept.extend_from_slice(&buffer[..n.min(room)]);
                truncated |= n > room;
            }
        }
    }
}

/// Kills a command's process group when dropped, unless disarmed: the call's future may be
/// dropped at any await (the pool's own activity timeout, a cancelled task), and then
/// `kill_on_drop` alone would kill only `sh`, leaving what it started running.
struct GroupKiller(Option<u32>);

impl GroupKiller {
    /// The command finished on its own (what it left behind is left alone, as before), or was
    /// killed already.
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for GroupKiller {
    fn drop(&mut self) {
        kill_group(self.0.take());
    }
}

/// Kills the process group `pgid` leads.
fn kill_group(pgid: Option<u32>) {
    if let Some(pid) = pgid.and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: kill(2) with a negative pid signals that process group; no memory involved.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

#[async_trait]
impl Tool for Shell {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: NAME.to_owned(),
            description: "Runs a shell command (sh -c) in the working directory and returns its exit code, stdout and stderr (each cut at 64 KiB). Needs a person's approval unless the session's policy allows it.".to_owned(),
            input_schema: JsonText::parse(
                r#"{"type":"object","properties":{"command":{"type":"string","description":"The command line, run by sh -c"},"timeout_ms":{"type":"integer","minimum":1,"description":"Kill it after this long (at most 120000)"}},"required":["command"],"additionalProperties":false}"#,
            )
            .unwrap_or_else(|_| JsonText::from_value(&serde_json::json!({"type": "object"}))),
        }
    }

    fn policy_subject(&self) -> Option<PolicySubject> {
        Some(PolicySubject {
            argument: "command",
            kind: SubjectKind::Command,
        })
    }

    fn asks_by_default(&self) -> bool {
        true
    }

    // The timeout waits on real time: this is the impure edge.
    #[allow(clippy::disallowed_methods)]
    async fn call(&self, call: &ToolCall, context: &ActivityContext) -> Result<ToolOutput> {
        let input: Input = call.parse_arguments()?;
        if input.command.trim().is_empty() {
            return Err(Error::InvalidArguments {
                tool: NAME.to_owned(),
                reason: "command: the command is empty".to_owned(),
            });
        }
        let timeout = match input.timeout_ms {
            Some(0) => {
                return Err(Error::InvalidArguments {
                    tool: NAME.to_owned(),
                    reason: "timeout_ms: must be at least 1".to_owned(),
                })
            }
            Some(ms) => Duration::from_millis(ms).min(self.timeout),
            None => self.timeout,
        };
        // The session's own directory, when it recorded one (see `ActivityContext`).
        let working_dir = context.working_dir().unwrap_or(&self.working_dir);
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&input.command)
            .current_dir(working_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::Io {
                path: working_dir.display().to_string(),
                source,
            })?;
        let pgid = child.id();
        let mut group = GroupKiller(pgid);
        let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
            kill_group(pgid);
            return Err(Error::ToolFailed {
                tool: NAME.to_owned(),
                message: "the command's output pipes were not opened".to_owned(),
            });
        };
        let run = async {
            let (out, err, status) = tokio::join!(
                read_capped(stdout, Self::MAX_OUTPUT_BYTES),
                read_capped(stderr, Self::MAX_OUTPUT_BYTES),
                child.wait()
            );
            (out, err, status)
        };
        let (out, err, status, timed_out) = tokio::select! {
            finished = run => {
                group.disarm();
                (finished.0, finished.1, Some(finished.2), false)
            }
            _ = tokio::time::sleep(timeout) => {
                kill_group(pgid);
                group.disarm();
                ((Vec::new(), false), (Vec::new(), false), None, true)
            }
            _ = context.cancelled() => {
                kill_group(pgid);
                group.disarm();
                return Err(Error::ToolFailed {
                    tool: NAME.to_owned(),
                    message: "cancelled; the command was killed".to_owned(),
                });
            }
        };
        let exit_code = match status {
            Some(Ok(status)) => status.code(),
            Some(Err(source)) => {
                return Err(Error::Io {
                    path: working_dir.display().to_string(),
                    source,
                })
            }
            None => None,
        };
        let result = serde_json::json!({
            "exit_code": exit_code,
            "stdout": String::from_utf8_lossy(&out.0),
            "stderr": String::from_utf8_lossy(&err.0),
            "timed_out": timed_out,
            "truncated": out.1 || err.1,
        });
        let is_error = timed_out || exit_code != Some(0);
        Ok(ToolOutput {
            content: cairn_ledger::ToolResultContent::Json(JsonText::from_value(&result)),
            is_error,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(arguments: &str) -> ToolCall {
        ToolCall {
            tool_use_id: "toolu_1".into(),
            name: NAME.into(),
            arguments: arguments.into(),
            idempotency_key: "s/toolu_1".into(),
        }
    }

    async fn run(shell: &Shell, arguments: &str) -> Result<(serde_json::Value, bool)> {
        let out = shell
            .call(&call(arguments), &ActivityContext::detached())
            .await?;
        let cairn_ledger::ToolResultContent::Json(json) = &out.content else {
            panic!("not JSON: {:?}", out.content)
        };
        Ok((json.to_value().expect("json"), out.is_error))
    }

    #[tokio::test]
    async fn runs_in_the_working_directory_with_exit_code_and_output() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("here.txt"), "x").unwrap();
        let shell = Shell::new(dir.path());
        let (out, is_error) = run(&shell, r#"{"command":"ls; echo oops >&2"}"#)
            .await
            .unwrap();
        assert!(!is_error);
        assert_eq!(out["exit_code"], 0);
        assert_eq!(out["stdout"], "here.txt\n");
        assert_eq!(out["stderr"], "oops\n");
        assert_eq!(out["truncated"], false);
        let (out, is_error) = run(&shell, r#"{"command":"exit 3"}"#).await.unwrap();
        assert!(is_error);
        assert_eq!(out["exit_code"], 3);
    }

    /// A session's recorded directory (in the context) is where the command runs.
    #[tokio::test]
    async fn runs_in_the_session_directory_given_by_the_context() {
        let own = tempfile::tempdir().unwrap();
        let session = tempfile::tempdir().unwrap();
        std::fs::write(session.path().join("session.txt"), "x").unwrap();
        let context = ActivityContext::detached().with_working_dir(Some(session.path()));
        let out = Shell::new(own.path())
            .call(&call(r#"{"command":"ls"}"#), &context)
            .await
            .unwrap();
        let cairn_ledger::ToolResultContent::Json(json) = &out.content else {
            panic!("not JSON: {:?}", out.content)
        };
        assert_eq!(json.to_value().unwrap()["stdout"], "session.txt\n");
    }

    #[tokio::test]
    async fn output_is_capped_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let (out, _) = run(
            &Shell::new(dir.path()),
            r#"{"command":"head -c 200000 /dev/zero | tr '\\0' a"}"#,
        )
        .await
        .unwrap();
        assert_eq!(out["truncated"], true);
        assert_eq!(
            out["stdout"].as_str().unwrap().len(),
            Shell::MAX_OUTPUT_BYTES
        );
    }

    #[tokio::test]
    #[allow(clippy::disallowed_methods)]
    async fn a_timeout_kills_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let shell = Shell::new(dir.path());
        let started = std::time::Instant::now();
        // The grandchild would keep the pipe open (and the call waiting) if it survived.
        let (out, is_error) = run(
            &shell,
            r#"{"command":"sleep 30 & sleep 30; echo done","timeout_ms":300}"#,
        )
        .await
        .unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(is_error);
        assert_eq!(out["timed_out"], true);
        assert_eq!(out["exit_code"], serde_json::Value::Null);
    }

    #[tokio::test]
    #[allow(clippy::disallowed_methods)]
    async fn a_call_dropped_by_an_outer_timeout_kills_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let shell = Shell::new(dir.path());
        // The pool's own timeout drops the call's future before the tool's timeout fires.
        let dropped = tokio::time::timeout(
            Duration::from_millis(500),
            run(
                &shell,
                r#"{"command":"sleep 30 & echo $! > background; wait","timeout_ms":60000}"#,
            ),
        )
        .await;
        assert!(dropped.is_err(), "the call finished: {dropped:?}");
        let background: i32 = std::fs::read_to_string(dir.path().join("background"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let alive = || {
            std::fs::read_to_string(format!("/proc/{background}/stat"))
                .is_ok_and(|stat| !stat.rsplit(')').next().unwrap_or("").contains(" Z "))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while alive() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            !alive(),
            "the command's background process {background} survived"
        );
    }

    #[tokio::test]
    async fn bad_arguments_are_typed_errors_naming_what_is_wrong() {
        let shell = Shell::new(".");
        for (arguments, expected) in [
            ("{}", "missing field `command`"),
            (r#"{"command":""}"#, "command: the command is empty"),
            (
                r#"{"command":"ls","timeout_ms":0}"#,
                "timeout_ms: must be at least 1",
            ),
            (r#"{"command":"ls","cwd":"/"}"#, "unknown field `cwd`"),
            ("not json", "not valid JSON"),
        ] {
            match run(&shell, arguments).await {
                Err(Error::InvalidArguments { tool, reason }) => {
                    assert_eq!(tool, NAME);
                    assert!(reason.contains(expected), "{arguments}: {reason}");
                }
                other => panic!("{arguments}: {other:?}"),
            }
        }
    }
}
