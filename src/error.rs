//! The facade's error: what opening and running an embedded cairn ([`crate::Cairn`]) can fail
//! with, wrapping the member crates' errors.

/// An error of the facade.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store, the engine or a client call failed.
    #[error(transparent)]
    Runtime(#[from] cairn_runtime::Error),
    /// A model provider or tool could not be set up (a script that does not parse).
    #[error(transparent)]
    Activities(#[from] cairn_activities::Error),
    /// An MCP server's configuration could not be read, or the server not reached.
    #[error(transparent)]
    Mcp(#[from] cairn_mcp::Error),
}

/// A result of the facade.
pub type Result<T, E = Error> = std::result::Result<T, E>;
