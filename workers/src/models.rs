//! Model resolution: from a `ModelSpec` to the provider that serves it.

use cairn_activities::{providers, Error, ErrorKind, ModelProvider, ScriptedProvider};
use cairn_ledger::ModelSpec;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Finds the provider for a model spec.
pub trait ModelResolver: Send + Sync + 'static {
    /// The provider serving `spec`, or an error the turn fails with.
    fn resolve(&self, spec: &ModelSpec) -> Result<Arc<dyn ModelProvider>, Error>;

    /// The providers it serves, which a worker declares when it leases (`None`: any, so it
    /// gets every model task and fails those it cannot serve).
    fn providers(&self) -> Option<BTreeSet<String>> {
        None
    }
}

/// The providers [`StandardModels`] serves.
pub const STANDARD_PROVIDERS: [&str; 5] = [
    "scripted",
    "anthropic",
    "openai",
    "openai-responses",
    "bedrock",
];

/// The providers this build knows: `scripted:FILE` (loaded once per file), and the HTTP
/// providers `anthropic`, `openai` (Chat Completions and compatible servers),
/// `openai-responses` and `bedrock`, configured from the environment.
/// Relative script paths are resolved against `script_dir` (the current directory by default).
#[derive(Default)]
pub struct StandardModels {
    scripts: Mutex<BTreeMap<String, Arc<ScriptedProvider>>>,
    http: Mutex<BTreeMap<String, Arc<dyn ModelProvider>>>,
    script_dir: Option<PathBuf>,
}

impl StandardModels {
    /// A resolver with an empty script cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// A resolver that reads relative script paths from `dir`.
    pub fn with_script_dir(dir: impl Into<PathBuf>) -> Self {
        StandardModels {
            scripts: Mutex::default(),
            http: Mutex::default(),
            script_dir: Some(dir.into()),
        }
    }

    /// This resolver, with `provider` serving the model spec `scripted:NAME` (instead of a
    /// script file of that name): a script given in code, for examples and tests.
    pub fn with_script(self, name: impl Into<String>, provider: ScriptedProvider) -> Self {
        match self.scripts.lock() {
            Ok(mut scripts) => scripts.insert(name.into(), Arc::new(provider)),
            Err(poisoned) => poisoned
                .into_inner()
                .insert(name.into(), Arc::new(provider)),
        };
        self
    }
}

impl ModelResolver for StandardModels {
    fn providers(&self) -> Option<BTreeSet<String>> {
        Some(STANDARD_PROVIDERS.iter().map(|p| (*p).to_owned()).collect())
    }

    fn resolve(&self, spec: &ModelSpec) -> Result<Arc<dyn ModelProvider>, Error> {
        match spec.provider.as_str() {
            "scripted" => {
                let mut scripts = match self.scripts.lock() {
                    Ok(s) => s,
                    Err(poisoned) => poisoned.into_inner(),
                };
                if let Some(p) = scripts.get(&spec.model) {
                    return Ok(p.clone());
                }
                let path = match &self.script_dir {
                    Some(dir) => dir.join(&spec.model),
                    None => PathBuf::from(&spec.model),
                };
                let provider = Arc::new(ScriptedProvider::from_file(path)?);
                scripts.insert(spec.model.clone(), provider.clone());
                Ok(provider)
            }
            name @ ("anthropic" | "openai" | "openai-responses" | "bedrock") => {
                let mut http = match self.http.lock() {
                    Ok(h) => h,
                    Err(poisoned) => poisoned.into_inner(),
                };
                if let Some(p) = http.get(name) {
                    return Ok(p.clone());
                }
                // Keys, base URLs and regions come from the environment, once per provider.
                let provider: Arc<dyn ModelProvider> = match name {
                    "anthropic" => Arc::new(providers::anthropic::AnthropicProvider::from_env()?),
                    "openai" => Arc::new(providers::openai_chat::OpenAiChatProvider::from_env()?),
                    "openai-responses" => Arc::new(
                        providers::openai_responses::OpenAiResponsesProvider::from_env()?,
                    ),
                    _ => Arc::new(providers::bedrock::BedrockProvider::from_env()?),
                };
                http.insert(name.to_owned(), provider.clone());
                Ok(provider)
            }
            other => Err(Error::Provider {
                kind: ErrorKind::InvalidRequest,
                message: format!(
                    "unknown model provider {other:?} (known: scripted, anthropic, openai, openai-responses, bedrock)"
                ),
            }),
        }
    }
}
