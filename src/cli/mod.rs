//! The parts of the `cairn` command line shared by its commands: where the store is (`--data`,
//! else the default data directory), choosing between opening the store and a server
//! (`--server`, `CAIRN_SERVER`, or the socket of the process that holds the store), the
//! session commands over a server, `cairn worker`, the printing of streamed deltas, and
//! printing that survives a closed pipe (`out`).

pub mod approvals;
pub mod args;
pub mod attach;
pub mod budget;
pub mod call_options;
pub mod chaos;
pub mod chat;
pub mod cleanup;
pub mod compaction;
pub mod completions;
pub mod database;
pub mod delete;
pub mod deltas;
pub mod demo_command;
pub mod describe;
pub mod exit_codes;
pub mod history_files;
pub mod live;
pub mod mcp;
pub mod out;
pub mod remote;
pub mod reports;
pub mod resume;
pub mod sessions;
pub mod summary;
pub mod turn;
pub mod workdir;
pub mod worker;

use out::note;

use anyhow::{bail, Context};
use cairn::host::Host;
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
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
            (Some(_), Some(data)) => exit_codes::usage_bail!(
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

/// How the default data directory is found, for help texts and errors.
pub const DEFAULT_DATA_RULE: &str =
    "$CAIRN_DATA, else $XDG_DATA_HOME/cairn, else ~/.local/share/cairn";

/// The help of `--data` on commands that only open a store.
pub const DATA_HELP: &str = "The store directory (default: $CAIRN_DATA, else \
    $XDG_DATA_HOME/cairn, else ~/.local/share/cairn)";

/// The help of `--data` on the session commands, which may act through a server instead.
pub const SESSION_DATA_HELP: &str = "The store directory (default: the server of --server or \
    $CAIRN_SERVER when given, else $CAIRN_DATA, else $XDG_DATA_HOME/cairn, else \
    ~/.local/share/cairn)";

/// The store a command uses when given no `--data` (and, for the session commands, no
/// server): `$CAIRN_DATA`, else `$XDG_DATA_HOME/cairn` (when absolute, as the XDG spec
/// requires), else `$HOME/.local/share/cairn`.
pub fn default_data_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CAIRN_DATA").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(xdg) = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
    {
        return Ok(xdg.join("cairn"));
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".local/share/cairn")),
        None => bail!(
            "no default data directory: neither CAIRN_DATA, XDG_DATA_HOME nor HOME is set; give \
             the store with --data DIR"
        ),
    }
}

/// A command's store directory: given with `--data`, or the default one.
#[derive(Debug, Clone)]
pub struct StoreDir {
    /// The directory.
    pub path: PathBuf,
    /// Whether it is the default (no `--data` given).
    pub defaulted: bool,
}

impl StoreDir {
    /// `--data`, else the default data directory.
    pub fn resolve(data: Option<PathBuf>) -> anyhow::Result<StoreDir> {
        Ok(match data {
            Some(path) => StoreDir {
                path,
                defaulted: false,
            },
            None => StoreDir {
                path: default_data_dir()?,
                defaulted: true,
            },
        })
    }

    /// For a command that needs an existing store: the default one not made yet is said
    /// plainly, with what makes it (a named directory gets the store's own "no store here").
    pub fn check_exists(&self) -> anyhow::Result<()> {
        if self.defaulted && embedded::detect(&self.path)?.is_none() {
            bail!(
                "no store yet at {} (the default data directory: {DEFAULT_DATA_RULE}); `cairn \
                 demo` or `cairn run` makes one there, or name a store with --data DIR",
                self.path.display()
            );
        }
        Ok(())
    }

    /// How to name this store on a command line printed for the user: nothing for the
    /// default (unless `CAIRN_SERVER` would then send the command to a server), else
    /// ` --data DIR`.
    pub fn flag(&self) -> String {
        if self.defaulted && env_value("CAIRN_SERVER").is_none() {
            String::new()
        } else {
            format!(" --data {}", self.path.display())
        }
    }
}

/// Where a session command acts: a server, or a store opened here.
#[derive(Debug, Clone)]
pub enum Target {
    /// The server at `url`.
    Server {
        /// Its URL.
        url: String,
        /// The bearer token.
        token: Option<String>,
    },
    /// A store directory.
    Store(StoreDir),
}

impl Target {
    /// `--data`, else `--server`, else `CAIRN_SERVER`, else the default data directory (both
    /// flags at once are a mistake).
    pub fn resolve(data: Option<PathBuf>, server: &ServerArgs) -> anyhow::Result<Target> {
        Ok(match server.resolve(data.as_deref())? {
            Some((url, token)) => Target::Server { url, token },
            None => Target::Store(StoreDir::resolve(data)?),
        })
    }
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
    /// Opens the store `target` names as `mode` says, or connects to its server. When the
    /// store is held by another process that serves it on `DATA/cairn.sock`, that process is
    /// asked instead (said on stderr).
    pub async fn open(
        target: Target,
        mode: OpenMode,
        engine: Option<StorageEngine>,
        workdir: PathBuf,
    ) -> anyhow::Result<Access> {
        let store = match target {
            Target::Server { url, token } => {
                if let Some(engine) = engine {
                    bail!(
                        "--engine {engine} applies to a store opened here, not to --server {url}"
                    );
                }
                let flag = format!(" --server {url}");
                return Ok(Access::Remote(
                    remote::Remote::connect(&url, token)?.named(flag),
                ));
            }
            Target::Store(store) => store,
        };
        if mode != OpenMode::Create {
            store.check_exists()?;
        }
        let data = store.path;
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
                note!(
                    "note: the store is in use by another process; acting through its socket {}",
                    socket.display()
                );
                let url = format!("unix:{}", socket.display());
                let flag = format!(" --data {}", data.display());
                Ok(Access::Remote(
                    remote::Remote::connect(&url, None)?.named(flag),
                ))
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
