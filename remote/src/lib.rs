//! Clients and workers of a cairn server in other processes: [`HttpTransport`], the client's
//! transport over the `/v1` API, and [`HttpTaskSource`], the worker pool's. Both reach the
//! server at `http(s)://HOST:PORT` or on a unix socket (`unix:PATH`, the socket a process
//! that has a store open serves it on), through one request function.

// The edge of the system: requests wait on timers (long polls, retries with backoff) and
// workers compare lease expiries with the clock.
#![allow(clippy::disallowed_methods)]

mod connection;
mod report_batch;
mod source;
mod sse;
mod tool_sets;
mod transcripts;
mod transport;

#[cfg(any(test, feature = "test-server"))]
pub mod fake_server;
#[cfg(test)]
mod kept_test_server;
#[cfg(test)]
mod tests;

pub use source::HttpTaskSource;
pub use transport::HttpTransport;

use cairn_runtime::{Client, Result};
use std::sync::Arc;

/// A client of the server at `url` (`http://HOST:PORT`, `https://...` or `unix:PATH`),
/// sending `token` as a bearer token when given. Fails only on an address it cannot use;
/// nothing is sent until the first operation.
pub fn connect(url: &str, token: Option<String>) -> Result<Client> {
    Ok(Client::with_transport(Arc::new(HttpTransport::new(
        url, token,
    )?)))
}
