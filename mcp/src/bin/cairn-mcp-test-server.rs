//! `cairn-mcp-test-server [--http ADDR] [--cancel-log FILE]`: the test MCP server of
//! `cairn_mcp::test_server`, on stdio, or on streamable HTTP at `http://ADDR/mcp` (it prints
//! the address it bound, for ADDR ending in `:0`).

use cairn_mcp::test_server::TestServer;
use std::io::Write;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut http = None;
    let mut cancel_log = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--http" => http = args.next(),
            "--cancel-log" => cancel_log = args.next().map(Into::into),
            other => {
                return Err(std::io::Error::other(format!(
                    "unknown argument {other:?}; usage: cairn-mcp-test-server [--http ADDR] [--cancel-log FILE]"
                )))
            }
        }
    }
    let server = TestServer::new(cancel_log);
    match http {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(&addr).await?;
            let mut stdout = std::io::stdout();
            writeln!(stdout, "http://{}/mcp", listener.local_addr()?)?;
            stdout.flush()?;
            server.serve_http(listener).await
        }
        None => server.serve_stdio().await,
    }
}
