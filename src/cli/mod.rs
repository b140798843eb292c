//! The parts of the `cairn` command line that reach a store through a server: choosing
//! between opening the store and a server (`--server`, `CAIRN_SERVER`, or the socket of the
//! process that holds the store), the session commands over a server, `cairn worker`, and
//! the printing of streamed deltas both share.

pub mod deltas;
pub mod remote;
pub mod worker;

use anyhow::{bail, Context};
use cairn::host::Host;
use cairn_runtime::store::embedded::{OpenMode, StorageEngine};
use cairn_runtime::{replay, Client, Error as RuntimeError, SessionState};
use std::path::{Path, PathBuf};

/// The socket a process that holds a store open serves the `/v1` API on, in the store's
/// directory.
pub use cairn_runtime::store::embedded::SOCKET_FILE as SOCKET_NAME;

/// Where a session command finds its sessions: a cairn server.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServerArgs {
    /// Act through the cairn server at URL (http://HOST:PORT, https://..., or unix:PATH)
    /// instead of opening a store (default: $CAIRN_SERVER, when --data is not given).
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// The server's bearer token (default: $CAIRN_TOKEN).
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,
}

impl ServerArgs {
    /// The server to use, if any: `--server`, else `CAIRN_SERVER` unless a store was named
    /// (an explicit `--data` wins over the environment). Both flags at once are a mistake.
    pub fn resolve(&self, data: Option<&Path>) -> anyhow::Result<Option<(String, Option<String>)>> {
        let server = match (&self.server, data) {
            (Some(_), Some(data)) => bail!(
                "--data {} and --server both given: use one (a store opened here, or a server)",
                data.display()
            ),
            (Some(server), None) => Some(server.clone()),
            (None, Some(_)) => None,
            (None, None) => env_value("CAIRN_SERVER"),
        };
        Ok(server.map(|url| (url, self.token.clone().or_else(|| env_value("CAIRN_TOKEN")))))
    }
}

fn env_value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// A store opened in this process, or a server.
pub enum Access {
    /// The store, opened here.
    Local {
        /// The host over it.
        host: Box<Host>,
        /// Its directory.
        data: PathBuf,
    },
    /// A server: named, or the socket of the process holding the store.
    Remote(remote::Remote),
}

impl Access {
    /// Opens the store at `data` as `mode` says, or connects to the server `server` names.
    /// When the store is held by another process that serves it on `DATA/cairn.sock`, that
    /// process is asked instead (said on stderr).
    pub async fn open(
        data: Option<PathBuf>,
        server: &ServerArgs,
        mode: OpenMode,
        engine: Option<StorageEngine>,
        workdir: PathBuf,
    ) -> anyhow::Result<Access> {
        if let Some((url, token)) = server.resolve(data.as_deref())? {
            if let Some(engine) = engine {
                bail!("--engine {engine} applies to a store opened here, not to --server {url}");
            }
            return Ok(Access::Remote(remote::Remote::connect(&url, token)?));
        }
        let Some(data) = data else {
            bail!("give the store (--data DIR) or a server (--server URL, or CAIRN_SERVER)");
        };
        match Host::open(&data, mode, engine, workdir).await {
            Ok(host) => Ok(Access::Local {
                host: Box::new(host),
                data,
            }),
            Err(e) => {
                let in_use = e
                    .downcast_ref::<RuntimeError>()
                    .is_some_and(RuntimeError::is_store_in_use);
                let socket = data.join(SOCKET_NAME);
                if !in_use || !socket.exists() {
                    return Err(e);
                }
                let socket = std::path::absolute(&socket)
                    .with_context(|| format!("cannot resolve {}", socket.display()))?;
                eprintln!(
                    "note: the store is in use by another process; acting through its socket {}",
                    socket.display()
                );
                let url = format!("unix:{}", socket.display());
                Ok(Access::Remote(remote::Remote::connect(&url, None)?))
            }
        }
    }

    /// The client: of the engine here, or of the server.
    pub fn client(&self) -> &Client {
        match self {
            Access::Local { host, .. } => &host.client,
            Access::Remote(remote) => &remote.client,
        }
    }

    /// A session's folded state: the engine's, or the server's history folded here (the
    /// same fold, so the same state).
    pub async fn state(&self, session_id: &str) -> anyhow::Result<SessionState> {
        match self {
            Access::Local { host, .. } => Ok(host.engine.state(session_id).await?),
            Access::Remote(remote) => {
                let history = remote.client.history(session_id).await?;
                Ok(replay(session_id, &history)?.state)
            }
        }
    }
}
