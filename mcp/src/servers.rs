//! Connections to MCP servers and their tools as cairn tools: one client session per server,
//! shared by its tools and closed (a stdio server's process ended) when the last goes.

use crate::config::{exposed_name, Server, Transport};
use crate::content::tool_output;
use crate::error::{Error, Result};
use async_trait::async_trait;
use cairn_activities::{ActivityContext, Tool, ToolCall, ToolOutput, ToolRegistry};
use cairn_ledger::{JsonText, ToolSpec};
use rmcp::model::{CallToolRequestParams, RequestMetaObject};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceError, ServiceExt};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Once};
use std::time::Duration;

/// The `_meta` key a call's idempotency key travels under, so a server can recognise a
/// retried call.
pub const IDEMPOTENCY_KEY_META: &str = "cairn/idempotency_key";

/// How long connecting to a server and listing its tools may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

type Client = RunningService<RoleClient, ()>;

/// The connected servers of a configuration and their tools.
pub struct McpServers {
    tools: Vec<McpTool>,
}

/// One tool of an MCP server, as a cairn tool.
#[derive(Clone)]
pub struct McpTool {
    spec: ToolSpec,
    /// The tool's name on its server.
    remote_name: String,
    server: String,
    timeout: Duration,
    client: Arc<Client>,
}

impl McpServers {
    /// Connects to every server and lists its tools. A server that cannot be reached, or two
    /// tools exposed under one name, fail the whole; a tool whose exposed name would be
    /// invalid or too long is left out with a warning.
    pub async fn connect(servers: &[Server]) -> Result<McpServers> {
        let mut tools: Vec<McpTool> = Vec::new();
        let mut names: BTreeMap<String, String> = BTreeMap::new();
        for server in servers {
            let client = Arc::new(connect(server).await?);
            let listed = tokio::time::timeout(CONNECT_TIMEOUT, client.list_all_tools())
                .await
                .map_err(|_| Error::ListTools {
                    server: server.name.clone(),
                    reason: format!("no answer within {} s", CONNECT_TIMEOUT.as_secs()),
                })?
                .map_err(|e| Error::ListTools {
                    server: server.name.clone(),
                    reason: e.to_string(),
                })?;
            for tool in listed {
                let Some(name) = exposed_name(&server.prefix, &tool.name) else {
                    tracing::warn!(
                        server = %server.name,
                        tool = %tool.name,
                        "MCP tool left out: its exposed name would not be a valid tool name of at most 64 characters"
                    );
                    continue;
                };
                if let Some(first) = names.insert(name.clone(), server.name.clone()) {
                    return Err(Error::DuplicateName {
                        name,
                        first,
                        second: server.name.clone(),
                    });
                }
                let schema = serde_json::Value::Object((*tool.input_schema).clone());
                tools.push(McpTool {
                    spec: ToolSpec {
                        name,
                        description: tool.description.as_deref().unwrap_or_default().to_owned(),
                        input_schema: JsonText::from_value(&schema),
                    },
                    remote_name: tool.name.to_string(),
                    server: server.name.clone(),
                    timeout: server.timeout,
                    client: client.clone(),
                });
            }
        }
        Ok(McpServers { tools })
    }

    /// The tools, in the order the servers listed them.
    pub fn tools(&self) -> &[McpTool] {
        &self.tools
    }

    /// The tools' specs, as a session offers them.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.tools.iter().map(|t| t.spec.clone()).collect()
    }

    /// Adds every tool to `registry`.
    pub fn register_into(&self, registry: &mut ToolRegistry) {
        for tool in &self.tools {
            registry.register(Arc::new(tool.clone()));
        }
    }
}

/// Starts or reaches one server and completes the MCP handshake.
async fn connect(server: &Server) -> Result<Client> {
    let failed = |reason: String| Error::Connect {
        server: server.name.clone(),
        reason,
    };
    let handshake = async {
        match &server.transport {
            Transport::Stdio {
                command,
                args,
                env,
                cwd,
            } => {
                let mut process = tokio::process::Command::new(command);
                process.args(args).envs(env).kill_on_drop(true);
                if let Some(cwd) = cwd {
                    process.current_dir(cwd);
                }
                let (transport, _) = TokioChildProcess::builder(process)
                    .stderr(std::process::Stdio::inherit())
                    .spawn()
                    .map_err(|e| failed(format!("cannot start {command:?}: {e}")))?;
                ().serve(transport).await.map_err(|e| failed(e.to_string()))
            }
            Transport::Http { url, headers } => {
                install_crypto_provider();
                let mut custom = HashMap::new();
                for (name, value) in headers {
                    // Checked when the configuration was read.
                    let name = http::HeaderName::try_from(name.as_str())
                        .map_err(|e| failed(format!("header {name:?}: {e}")))?;
                    let value = http::HeaderValue::try_from(value.as_str())
                        .map_err(|e| failed(format!("header {name:?}: {e}")))?;
                    custom.insert(name, value);
                }
                let config = StreamableHttpClientTransportConfig::with_uri(url.as_str())
                    .custom_headers(custom);
                let transport = StreamableHttpClientTransport::from_config(config);
                ().serve(transport).await.map_err(|e| failed(e.to_string()))
            }
        }
    };
    tokio::time::timeout(CONNECT_TIMEOUT, handshake)
        .await
        .map_err(|_| {
            failed(format!(
                "no handshake within {} s",
                CONNECT_TIMEOUT.as_secs()
            ))
        })?
}

/// HTTPS to MCP servers goes through rustls with the ring provider (the one cairn's other
/// HTTP clients use), installed once for the process unless one already is.
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[async_trait]
impl Tool for McpTool {
    fn spec(&self) -> ToolSpec {
        self.spec.clone()
    }

    async fn call(
        &self,
        call: &ToolCall,
        context: &ActivityContext,
    ) -> cairn_activities::Result<ToolOutput> {
        let arguments = match serde_json::from_str::<serde_json::Value>(&call.arguments) {
            Ok(serde_json::Value::Object(arguments)) => arguments,
            Ok(_) => {
                return Err(cairn_activities::Error::InvalidArguments {
                    tool: self.spec.name.clone(),
                    reason: "arguments must be a JSON object".to_owned(),
                })
            }
            Err(e) => {
                return Err(cairn_activities::Error::InvalidArguments {
                    tool: self.spec.name.clone(),
                    reason: format!("arguments are not valid JSON: {e}"),
                })
            }
        };
        let mut meta = serde_json::Map::new();
        meta.insert(
            IDEMPOTENCY_KEY_META.to_owned(),
            serde_json::Value::String(call.idempotency_key.clone()),
        );
        let mut request =
            CallToolRequestParams::new(self.remote_name.clone()).with_arguments(arguments);
        request.meta = Some(RequestMetaObject::from(meta));
        // Dropping the request (on timeout or cancellation) makes the SDK send the server a
        // `notifications/cancelled` for it.
        let answer = tokio::select! {
            answer = tokio::time::timeout(self.timeout, self.client.call_tool(request)) => answer,
            _ = context.cancelled() => {
                return Err(cairn_activities::Error::Cancelled {
                    reason: format!("the call of {} was cancelled", self.spec.name),
                })
            }
        };
        match answer {
            Err(_) => Err(cairn_activities::Error::ToolTimeout {
                tool: self.spec.name.clone(),
                timeout_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
            }),
            Ok(Ok(result)) => Ok(tool_output(&result)),
            // The server refused the request (unknown tool, invalid parameters): the model
            // sees why and can correct its call.
            Ok(Err(ServiceError::McpError(error))) => Ok(ToolOutput::error(format!(
                "MCP server {:?} refused the call (error {}): {}",
                self.server, error.code.0, error.message
            ))),
            Ok(Err(e)) => Err(cairn_activities::Error::ToolFailed {
                tool: self.spec.name.clone(),
                message: format!("MCP server {:?}: {e}", self.server),
            }),
        }
    }
}

impl McpTool {
    /// The name the tool is exposed under.
    pub fn spec_name(&self) -> String {
        self.spec.name.clone()
    }

    /// The server it belongs to, by its name in the configuration.
    pub fn server(&self) -> &str {
        &self.server
    }
}

impl std::fmt::Debug for McpTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpTool")
            .field("name", &self.spec.name)
            .field("server", &self.server)
            .field("remote_name", &self.remote_name)
            .field("timeout", &self.timeout)
            .finish()
    }
}
