//! The embedded cairn: one builder that opens a store directory, registers the tools once,
//! starts the workers and hands out a [`Client`] — what a program that runs agents in its own
//! process needs, in a few lines.
//!
//! ```no_run
//! # async fn example() -> cairn::Result<()> {
//! use cairn::prelude::*;
//!
//! let cairn = Cairn::builder("data").builtin_tools(".").start().await?;
//! // The session offers every registered tool to the model.
//! let options = cairn.session(ModelSpec::new("anthropic", "claude-sonnet-4-5"));
//! let session = cairn.client().start_session(options).await?;
//! let outcome = cairn.client().run_turn(&session, "What is (17 + 25) * 3?").await?;
//! println!("{outcome:?}");
//! cairn.shutdown().await;
//! # Ok(())
//! # }
//! ```

use crate::error::Result;
use cairn_activities::{ScriptedProvider, Tool, ToolRegistry};
use cairn_ledger::ModelSpec;
use cairn_runtime::store::embedded::{self, OpenMode, OpenedStore, StorageEngine};
use cairn_runtime::{Client, Engine, PriceTable, ResumeReport, SessionOptions, SystemClock};
use cairn_workers::{Activities, ModelResolver, StandardModels, WorkerConfig, WorkerPool};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A store, its engine, the worker pool that runs its tasks and a client, in this process.
/// Build one with [`Cairn::builder`]; [`Cairn::shutdown`] drains the workers.
pub struct Cairn {
    opened: OpenedStore,
    engine: Engine,
    client: Client,
    tools: Arc<ToolRegistry>,
    resumed: ResumeReport,
    workers: Option<WorkerPool>,
}

/// How to open and run a [`Cairn`]; from [`Cairn::builder`].
pub struct CairnBuilder {
    data: PathBuf,
    storage_engine: Option<StorageEngine>,
    tools: ToolRegistry,
    scripts: Vec<(String, String)>,
    models: Option<Arc<dyn ModelResolver>>,
    workers: Option<WorkerConfig>,
    turn_deadline: Option<Duration>,
    prices: Option<PriceTable>,
    mcp_configs: Vec<PathBuf>,
}

impl Cairn {
    /// A builder for the store in directory `data` (created when there is none), with no
    /// tools, the standard model providers (see [`StandardModels`]) and a worker pool.
    pub fn builder(data: impl Into<PathBuf>) -> CairnBuilder {
        CairnBuilder {
            data: data.into(),
            storage_engine: None,
            tools: ToolRegistry::new(),
            scripts: Vec::new(),
            models: None,
            workers: Some(WorkerConfig {
                lease_ms: 5_000,
                // The only worker of a store locked to this process: a task it cannot run (a
                // tool or provider it does not host) fails at once rather than waiting for a
                // worker that cannot come.
                take_unhosted: true,
                ..WorkerConfig::default()
            }),
            turn_deadline: None,
            prices: None,
            mcp_configs: Vec::new(),
        }
    }

    /// The client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The engine (for what the client does not do: forks, exports, timers).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The registered tools.
    pub fn tools(&self) -> &ToolRegistry {
        &self.tools
    }

    /// Options for a session on `model` that offers every registered tool, with default
    /// limits, retries and queues (change the fields before starting it).
    pub fn session(&self, model: ModelSpec) -> SessionOptions {
        SessionOptions::new(model, self.tools.specs())
    }

    /// What opening the store found and did (notes for people).
    pub fn opened(&self) -> &OpenedStore {
        &self.opened
    }

    /// The interrupted sessions that starting carried on.
    pub fn resumed(&self) -> &ResumeReport {
        &self.resumed
    }

    /// Drains the workers: running activities finish or are abandoned to their leases, and
    /// nothing new starts. The store closes when the last handle to it is dropped.
    pub async fn shutdown(mut self) {
        if let Some(pool) = self.workers.take() {
            pool.shutdown().await;
        }
    }
}

impl CairnBuilder {
    /// Registers a tool: the workers run it, and [`Cairn::session`] offers its spec.
    pub fn tool(mut self, tool: impl Tool + 'static) -> Self {
        self.tools.register(Arc::new(tool));
        self
    }

    /// Registers the built-in tools: `calculator`, and `read_file` and `list_dir` confined to
    /// `working_dir`.
    pub fn builtin_tools(mut self, working_dir: impl Into<PathBuf>) -> Self {
        let builtin = ToolRegistry::builtin(working_dir);
        for name in builtin.names() {
            if let Some(tool) = builtin.get(name) {
                self.tools.register(tool);
            }
        }
        self
    }

    /// Plays the scripted responses `script_json` (format in `activities/SCRIPT.md`) for the
    /// model spec `scripted:NAME`: an offline model, for examples and tests. The script is
    /// checked when the cairn starts.
    pub fn script(mut self, name: impl Into<String>, script_json: impl Into<String>) -> Self {
        self.scripts.push((name.into(), script_json.into()));
        self
    }

    /// Resolves models with `models` instead of [`StandardModels`] (scripts given with
    /// [`CairnBuilder::script`] are then not used).
    pub fn models(mut self, models: Arc<dyn ModelResolver>) -> Self {
        self.models = Some(models);
        self
    }

    /// The storage engine of a new store (an existing one keeps its own).
    pub fn storage_engine(mut self, engine: StorageEngine) -> Self {
        self.storage_engine = Some(engine);
        self
    }

    /// The worker pool's settings.
    pub fn worker_config(mut self, config: WorkerConfig) -> Self {
        self.workers = Some(config);
        self
    }

    /// Starts no worker pool: other processes run the tasks (or nobody does, and turns wait;
    /// see [`CairnBuilder::turn_deadline`]).
    pub fn without_workers(mut self) -> Self {
        self.workers = None;
        self
    }

    /// The client's turns fail with [`cairn_runtime::Error::TurnDeadline`] when they have not
    /// ended after `deadline` (see [`Client::with_turn_deadline`]).
    pub fn turn_deadline(mut self, deadline: Duration) -> Self {
        self.turn_deadline = Some(deadline);
        self
    }

    /// Prices each model call as it is recorded with `prices` instead of the built-in table
    /// (see [`PriceTable`]; the README's "Usage, cost and budgets").
    pub fn prices(mut self, prices: PriceTable) -> Self {
        self.prices = Some(prices);
        self
    }

    /// Hosts the tools of the MCP servers configured in the JSON file at `path` (the format of
    /// `cairn run --mcp-config`; README, "MCP tools"): [`CairnBuilder::start`] connects to them,
    /// lists their tools and registers each under its prefixed name, so sessions offer them and
    /// the workers run them. A server that cannot be reached fails the start, naming it.
    pub fn mcp_config(mut self, path: impl Into<PathBuf>) -> Self {
        self.mcp_configs.push(path.into());
        self
    }

    /// Opens the store (see [`embedded::open`]: its lock is held until the cairn is dropped),
    /// carries on interrupted sessions and starts the workers.
    pub async fn start(self) -> Result<Cairn> {
        let models: Arc<dyn ModelResolver> = match self.models {
            Some(models) => models,
            None => {
                let mut models = StandardModels::new();
                for (name, json) in &self.scripts {
                    let provider = ScriptedProvider::from_json(json, format!("script {name:?}"))?;
                    models = models.with_script(name.clone(), provider);
                }
                Arc::new(models)
            }
        };
        // MCP servers first: one that cannot be reached fails the start before the store opens.
        let mut tools = self.tools;
        for path in &self.mcp_configs {
            let servers = cairn_mcp::McpConfig::load(path)?;
            cairn_mcp::McpServers::connect(&servers)
                .await?
                .register_into(&mut tools);
        }
        let opened = embedded::open(&self.data, OpenMode::Create, self.storage_engine).await?;
        for note in &opened.notes {
            tracing::info!(store = %self.data.display(), "{note}");
        }
        let engine = Engine::new(opened.store.clone(), Arc::new(SystemClock));
        if let Some(prices) = self.prices {
            engine.set_prices(prices);
        }
        let tools = Arc::new(tools);
        let mut client = Client::new(engine.clone());
        if let Some(deadline) = self.turn_deadline {
            client = client.with_turn_deadline(deadline);
        }
        let (resumed, workers) = match self.workers {
            Some(config) => {
                // The store is locked to this process: leases left by a dead one are
                // released at once.
                let resumed = engine.resume(true).await?;
                let activities = Activities {
                    models,
                    tools: tools.clone(),
                };
                let pool = WorkerPool::start(engine.clone(), activities, config);
                (resumed, Some(pool))
            }
            None => (ResumeReport::default(), None),
        };
        Ok(Cairn {
            opened,
            engine,
            client,
            tools,
            resumed,
            workers,
        })
    }
}
