//! A small MCP server built from the SDK's server support, for tests and for trying
//! `--mcp-config` by hand (the `cairn-mcp-test-server` binary): `echo` (text), `add`
//! (structured JSON), `pixel` (an image), `link` (a resource link), `fail` (an `isError`
//! result), `slow` (sleeps, and notes when it is cancelled) and `meta` (returns the request's
//! `_meta`, to see the idempotency key). Served over stdio or streamable HTTP.

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, Resource, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A 1×1 PNG, base64, as `pixel` returns it.
pub const PIXEL_PNG_BASE64: &str =
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==";

/// The test server. With a `cancel_log`, a cancelled `slow` call appends a line there.
#[derive(Debug, Clone, Default)]
pub struct TestServer {
    cancel_log: Option<PathBuf>,
}

impl TestServer {
    /// A server that writes the `slow` tool's cancellations to `cancel_log`, if given.
    pub fn new(cancel_log: Option<PathBuf>) -> Self {
        TestServer { cancel_log }
    }

    /// Serves on stdin and stdout until the client goes.
    pub async fn serve_stdio(self) -> std::io::Result<()> {
        let running = self
            .serve(rmcp::transport::stdio())
            .await
            .map_err(std::io::Error::other)?;
        running.waiting().await.map_err(std::io::Error::other)?;
        Ok(())
    }

    /// Serves streamable HTTP at `/mcp` on `listener` until the process ends.
    pub async fn serve_http(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
        use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
        let service = StreamableHttpService::new(
            move || Ok(self.clone()),
            Arc::new(LocalSessionManager::default()),
            StreamableHttpServerConfig::default(),
        );
        let router = axum::Router::new().nest_service("/mcp", service);
        axum::serve(listener, router).await
    }
}

fn schema(properties: Value, required: &[&str]) -> Arc<serde_json::Map<String, Value>> {
    let Value::Object(map) = json!({
        "type": "object",
        "properties": properties,
        "required": required,
    }) else {
        unreachable!("a literal object")
    };
    Arc::new(map)
}

fn argument<'a>(request: &'a CallToolRequestParams, name: &str) -> Option<&'a Value> {
    request.arguments.as_ref().and_then(|a| a.get(name))
}

#[allow(clippy::disallowed_methods)] // the slow tool sleeps: a server's side effect, not workflow code
impl ServerHandler for TestServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let text = json!({"text": {"type": "string"}});
        let numbers = json!({"a": {"type": "number"}, "b": {"type": "number"}});
        Ok(ListToolsResult::with_all_items(vec![
            Tool::new("echo", "Returns its text.", schema(text, &["text"])),
            Tool::new(
                "add",
                "Adds two numbers; structured result.",
                schema(numbers, &["a", "b"]),
            ),
            Tool::new("pixel", "Returns a 1x1 PNG image.", schema(json!({}), &[])),
            Tool::new("link", "Returns a resource link.", schema(json!({}), &[])),
            Tool::new("fail", "Always fails (isError).", schema(json!({}), &[])),
            Tool::new(
                "slow",
                "Sleeps for ms milliseconds.",
                schema(json!({"ms": {"type": "integer"}}), &["ms"]),
            ),
            Tool::new(
                "meta",
                "Returns the request's _meta.",
                schema(json!({}), &[]),
            ),
            Tool::new(
                "dotted.name",
                "Echoes, under a name with a dot.",
                schema(json!({}), &[]),
            ),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let result = match request.name.as_ref() {
            "echo" => {
                let text = argument(&request, "text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ErrorData::invalid_params("text must be a string", None))?;
                CallToolResult::success(vec![ContentBlock::text(text)])
            }
            "add" => {
                let number = |name| argument(&request, name).and_then(Value::as_f64);
                let (Some(a), Some(b)) = (number("a"), number("b")) else {
                    return Err(ErrorData::invalid_params("a and b must be numbers", None));
                };
                CallToolResult::structured(json!({"sum": a + b, "terms": [a, b]}))
            }
            "pixel" => {
                CallToolResult::success(vec![ContentBlock::image(PIXEL_PNG_BASE64, "image/png")])
            }
            "link" => CallToolResult::success(vec![ContentBlock::resource_link(Resource::new(
                "file:///notes/today.md",
                "today",
            ))]),
            "fail" => CallToolResult::error(vec![ContentBlock::text("the tool failed on purpose")]),
            "slow" => {
                let ms = argument(&request, "ms")
                    .and_then(Value::as_u64)
                    .unwrap_or(1000);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
                    _ = context.ct.cancelled() => {
                        if let Some(log) = &self.cancel_log {
                            use std::io::Write;
                            if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
                                let _ = writeln!(file, "cancelled");
                            }
                        }
                        return Err(ErrorData::internal_error("cancelled", None));
                    }
                }
                CallToolResult::success(vec![ContentBlock::text(format!("slept {ms} ms"))])
            }
            "meta" => CallToolResult::success(vec![ContentBlock::text(
                serde_json::to_string(&context.meta.0 .0).unwrap_or_default(),
            )]),
            "dotted.name" => CallToolResult::success(vec![ContentBlock::text("dotted")]),
            other => {
                return Err(ErrorData::invalid_params(
                    format!("no tool {other:?}"),
                    None,
                ));
            }
        };
        Ok(CallToolResponse::Complete(result))
    }
}
