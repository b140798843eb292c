//! `cairn chat`: an interactive multi-turn session in the terminal. Each line read from standard
//! input is one turn, shown live as `run` shows it; `/exit` or the end of input ends the chat
//! (the session stays, to continue with `--session` later). Standard input need not be a
//! terminal, so a chat can be piped in.

use super::approvals::PolicyArgs;
use super::out::note;
use super::turn::Watch;
use super::{exit_codes, workdir};
use cairn::host::Host;
use cairn_ledger::ModelSpec;
use cairn_runtime::store::embedded::{OpenMode, StorageEngine};
use cairn_runtime::{Error as RuntimeError, SessionOptions, TurnOutcome};
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// What `cairn chat` was asked for.
pub struct ChatRequest {
    /// The store directory.
    pub data: PathBuf,
    /// Its engine, for a new store.
    pub engine: Option<StorageEngine>,
    /// The model.
    pub model: ModelSpec,
    /// A session to continue or start with this id.
    pub session: Option<String>,
    /// A system prompt for a new session.
    pub system: Option<String>,
    /// Where the session's tools work (a new session records it).
    pub workdir: PathBuf,
    /// Print thinking as it streams.
    pub show_thinking: bool,
}

/// Runs the chat until `/exit` or the end of input. The exit status is the last turn's.
pub async fn run(request: ChatRequest) -> anyhow::Result<ExitCode> {
    let mut host = Host::open(
        &request.data,
        OpenMode::Create,
        request.engine,
        request.workdir.clone(),
    )
    .await?;
    let session_id = start_or_continue(&host, &request).await?;
    host.start_for(&session_id).await?;
    if host.engine.state(&session_id).await?.is_running() {
        exit_codes::usage_bail!(
            "session {session_id} has a turn running; carry it on with `cairn resume --data {}` \
             first",
            request.data.display()
        );
    }
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        note!("type a message and press Enter; /exit or Ctrl-D ends the chat");
    }
    let watch = Watch {
        host: &host,
        session_id: &session_id,
        show_thinking: request.show_thinking,
        quiet: false,
        data_flag: format!(" --data {}", request.data.display()),
    };
    let mut code = exit_codes::OK;
    let mut lines = read_lines();
    loop {
        if interactive {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "> ");
            let _ = err.flush();
        }
        // Ctrl-C at the prompt ends the chat (during a turn it cancels the turn).
        let line = tokio::select! {
            line = lines.recv() => line,
            _ = tokio::signal::ctrl_c() => None,
        };
        let Some(line) = line else {
            break;
        };
        let line = line?;
        let message = line.trim();
        if message.is_empty() {
            continue;
        }
        if message == "/exit" {
            break;
        }
        let outcome = watch.send(message, None, Vec::new()).await?;
        super::turn::report_line(&outcome);
        code = exit_codes::of_outcome(&outcome);
        if matches!(outcome, TurnOutcome::Cancelled { .. })
            && host.engine.state(&session_id).await?.cancelled
        {
            break;
        }
    }
    note!("session {session_id}");
    host.shutdown().await;
    Ok(ExitCode::from(code))
}

/// Standard input's lines, read on a thread of their own (a read blocks) and sent as they
/// come; the channel closes at the end of input.
fn read_lines() -> tokio::sync::mpsc::Receiver<std::io::Result<String>> {
    let (send, receive) = tokio::sync::mpsc::channel(1);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if send.blocking_send(line).is_err() {
                break;
            }
        }
    });
    receive
}

/// The session to chat in: `--session` when it exists, else a new one (with that id).
async fn start_or_continue(host: &Host, request: &ChatRequest) -> anyhow::Result<String> {
    if let Some(id) = &request.session {
        match host.engine.state(id).await {
            Ok(_) => {
                if request.system.is_some() {
                    exit_codes::usage_bail!(
                        "session {id} exists, and --system applies only when a session starts"
                    );
                }
                note!("session {id}");
                return Ok(id.clone());
            }
            Err(RuntimeError::UnknownSession { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let policy = PolicyArgs::default();
    let tools = policy.offered_tools(&[]);
    let tool_policy = policy.session_policy(&tools)?;
    let mut options = SessionOptions::new(request.model.clone(), tools);
    options.tool_policy = tool_policy;
    options.session_id = request.session.clone();
    options.system_prompt = request.system.clone();
    options.workdir = Some(workdir::to_record(Path::new(&request.workdir))?);
    let id = host.client.start_session(options).await?;
    note!("new session {id}");
    Ok(id)
}
