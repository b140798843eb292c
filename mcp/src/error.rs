//! The crate's one error type: what can go wrong loading an MCP configuration and connecting
//! to its servers, each naming the file or server concerned.

use std::path::PathBuf;

/// A failure loading the configuration or reaching a server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration file cannot be read.
    #[error("cannot read the MCP configuration {path}: {source}")]
    ReadConfig {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The configuration is not valid JSON of the expected shape.
    #[error("the MCP configuration {path} is invalid: {reason}")]
    InvalidConfig {
        /// The file (or `<inline>`).
        path: PathBuf,
        /// What is wrong, and where.
        reason: String,
    },
    /// A server could not be started or connected to, or did not complete the handshake.
    #[error("MCP server {server:?}: cannot connect: {reason}")]
    Connect {
        /// The server's name in the configuration.
        server: String,
        /// Why.
        reason: String,
    },
    /// A server's tools could not be listed.
    #[error("MCP server {server:?}: cannot list its tools: {reason}")]
    ListTools {
        /// The server's name in the configuration.
        server: String,
        /// Why.
        reason: String,
    },
    /// Two tools would be exposed under the same name.
    #[error("MCP tool name {name:?} is exposed twice (by {first:?} and {second:?}); give one of the servers another prefix")]
    DuplicateName {
        /// The exposed name.
        name: String,
        /// The server that exposed it first.
        first: String,
        /// The server that exposed it again.
        second: String,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
