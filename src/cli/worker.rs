//! `cairn worker`: a worker pool of this process running a server's tasks — model calls with
//! the providers configured in this process's environment (API keys never leave it), the
//! built-in tools in `--workdir` and the tools of `--mcp-config`'s MCP servers — until SIGTERM
//! or SIGINT, then draining.

use super::out::{note, showln};
use anyhow::Context;
use cairn_activities::ToolRegistry;
use cairn_remote::HttpTaskSource;
use cairn_runtime::DEFAULT_QUEUE;
use cairn_workers::{Activities, StandardModels, WorkerConfig, WorkerPool};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// How long a remote lease request waits for a task (a long poll).
const LEASE_WAIT_MS: u64 = 5_000;

/// How often a running activity renews its lease: a cancelled activity learns of its
/// cancellation by its next renewal finding the lease gone, so this bounds how long it runs on.
const RENEW_INTERVAL_MS: u64 = 1_000;

/// What `cairn worker` was asked.
pub struct WorkerRequest {
    pub url: String,
    pub token: Option<String>,
    /// The queues served; empty: the default queue.
    pub queues: Vec<String>,
    pub concurrency: usize,
    pub workdir: PathBuf,
    /// The built-in tools hosted; `None`: all.
    pub tools: Option<Vec<String>>,
    /// The MCP servers whose tools are hosted too.
    pub mcp_config: Option<PathBuf>,
    /// Lease length.
    pub lease_ms: u64,
}

/// Runs the pool until a signal, then drains it; exit 0 when drained, 1 when interrupted
/// again while draining.
pub async fn run(request: WorkerRequest) -> anyhow::Result<ExitCode> {
    let mut signals = Signals {
        terminate: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
        interrupt: signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?,
    };
    let source = Arc::new(HttpTaskSource::new(&request.url, request.token)?);
    let queues: BTreeSet<String> = if request.queues.is_empty() {
        BTreeSet::from([DEFAULT_QUEUE.to_owned()])
    } else {
        request.queues.into_iter().collect()
    };
    let mut tools = hosted_tools(ToolRegistry::hosted(request.workdir), request.tools)?;
    if let Some(mcp) = super::mcp::connect(request.mcp_config.as_deref()).await? {
        mcp.register_into(&mut tools);
    }
    note!(
        "worker: queues {}; tools {}; {} at once; server {}",
        queues.iter().cloned().collect::<Vec<_>>().join(", "),
        tools.names().join(", "),
        request.concurrency,
        request.url
    );
    let activities = Activities {
        models: Arc::new(StandardModels::new()),
        tools: Arc::new(tools),
    };
    let config = WorkerConfig {
        concurrency: request.concurrency.max(1),
        poll_interval_ms: LEASE_WAIT_MS,
        queues: Some(queues),
        // It declares what it hosts, and is given nothing else.
        take_unhosted: false,
        renew_interval_ms: Some(RENEW_INTERVAL_MS),
        lease_ms: request.lease_ms,
        ..WorkerConfig::default()
    };
    let pool = WorkerPool::start_with(source.clone(), activities, config);
    tokio::select! {
        reached = source.reached() => {
            if let Err(e) = reached {
                pool.shutdown().await;
                return Err(e).context("the server refused this worker");
            }
            showln!("worker ready");
            let _ = std::io::stdout().flush();
            signals.next().await;
        }
        _ = signals.next() => {}
    }
    note!("worker: draining (running activities finish and report; again to stop at once)");
    tokio::select! {
        _ = pool.shutdown() => {
            note!("worker: drained");
            Ok(ExitCode::SUCCESS)
        }
        _ = signals.next() => {
            note!("worker: stopped without draining; the tasks it held run again when their leases lapse");
            Ok(ExitCode::from(1))
        }
    }
}

/// The tools of `all` named in `only` (all of them for `None`); an unknown name is an error.
fn hosted_tools(all: ToolRegistry, only: Option<Vec<String>>) -> anyhow::Result<ToolRegistry> {
    let Some(names) = only else {
        return Ok(all);
    };
    let mut hosted = ToolRegistry::new();
    for name in names {
        let tool = all.get(&name).with_context(|| {
            format!(
                "--tools: no built-in tool {name:?} (there are: {})",
                all.names().join(", ")
            )
        })?;
        hosted.register(tool);
    }
    Ok(hosted)
}

struct Signals {
    terminate: Signal,
    interrupt: Signal,
}

impl Signals {
    /// The next SIGTERM or SIGINT.
    async fn next(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }
}
