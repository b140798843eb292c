//! Tool approvals on the command line: the policy flags of `cairn run` (`--shell`, `--allow`,
//! `--ask`, `--deny`, `--policy FILE`, `--approval-timeout-ms`) made into the policy a new
//! session records, and the waits of `run` and `resume` that say which calls wait for a
//! person and how to decide them.

use super::out::note;
use anyhow::{bail, Context};
use cairn_activities::{Shell, Tool, ToolRegistry};
use cairn_ledger::ToolSpec;
use cairn_runtime::policy::{PolicyDecision, PolicyRule, ToolPolicy};
use cairn_runtime::{Engine, SessionState, TurnOutcome};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

/// The tool policy flags of `cairn run`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PolicyArgs {
    /// Offer the model the `shell` tool too (sh -c in --workdir). Its calls wait for your
    /// approval unless a rule allows them.
    #[arg(long)]
    pub shell: bool,
    /// Offer the model the `write_file` and `edit_file` tools too (in --workdir). Their calls
    /// wait for your approval unless a rule allows them.
    #[arg(long)]
    pub edit: bool,
    /// Run calls of TOOL, or with TOOL:PREFIX only those whose path (read_file, list_dir,
    /// write_file, edit_file) or command (shell) starts with PREFIX, without asking.
    /// Repeatable.
    #[arg(long, value_name = "TOOL[:PREFIX]")]
    pub allow: Vec<String>,
    /// Ask before running such calls (see --allow). Repeatable.
    #[arg(long, value_name = "TOOL[:PREFIX]")]
    pub ask: Vec<String>,
    /// Refuse such calls: the model gets an error result (see --allow). Repeatable.
    #[arg(long, value_name = "TOOL[:PREFIX]")]
    pub deny: Vec<String>,
    /// The whole policy as a JSON file (README, "Tool policy"); instead of the flags above.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["allow", "ask", "deny"])]
    pub policy: Option<PathBuf>,
    /// Deny a call nobody approved within this many milliseconds of its request.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub approval_timeout_ms: Option<u64>,
}

impl PolicyArgs {
    /// Whether any flag was given (they are fixed when a session starts).
    pub fn given(&self) -> bool {
        self.shell
            || self.edit
            || !self.allow.is_empty()
            || !self.ask.is_empty()
            || !self.deny.is_empty()
            || self.policy.is_some()
            || self.approval_timeout_ms.is_some()
    }

    /// The tools a new session offers: the built-in ones, `shell` with `--shell`,
    /// `write_file` and `edit_file` with `--edit`, and `extra` (the tools of `--mcp-config`'s
    /// servers).
    pub fn offered_tools(&self, extra: &[ToolSpec]) -> Vec<ToolSpec> {
        let mut tools = ToolRegistry::builtin(".").specs();
        if self.shell {
            tools.push(Shell::new(".").spec());
        }
        if self.edit {
            tools.extend(ToolRegistry::editing(".").specs());
        }
        tools.extend(extra.iter().cloned());
        tools
    }

    /// The policy a new session offering `tools` records: the file's, or the flags' rules
    /// (prefix rules before whole-tool ones; among those, deny before ask before allow),
    /// followed by the default asks of tools that ask by default; `None` when nothing asks,
    /// denies or was given (every call runs). Completed from what the hosted tools declare.
    pub fn session_policy(&self, tools: &[ToolSpec]) -> anyhow::Result<Option<ToolPolicy>> {
        let hosted = ToolRegistry::hosted(".");
        let requested = match &self.policy {
            Some(file) => {
                let text = std::fs::read_to_string(file)
                    .with_context(|| format!("cannot read the policy file {}", file.display()))?;
                let mut policy: ToolPolicy = serde_json::from_str(&text).with_context(|| {
                    format!("the policy file {} is not a policy", file.display())
                })?;
                if self.approval_timeout_ms.is_some() {
                    policy.approval_timeout_ms = self.approval_timeout_ms;
                }
                Some(policy)
            }
            None => {
                let mut rules = Vec::new();
                for (flag, decision, given) in [
                    ("--deny", PolicyDecision::Deny, &self.deny),
                    ("--ask", PolicyDecision::Ask, &self.ask),
                    ("--allow", PolicyDecision::Allow, &self.allow),
                ] {
                    for rule in given {
                        rules.push(parse_rule(flag, decision, rule, tools)?);
                    }
                }
                // Narrow rules first, so `--allow shell:git --ask shell` allows git only.
                rules.sort_by_key(|r| r.prefix.is_none());
                if rules.is_empty() && self.approval_timeout_ms.is_none() {
                    None
                } else {
                    let asking: BTreeSet<&str> = tools
                        .iter()
                        .filter(|t| hosted.get(&t.name).is_some_and(|h| h.asks_by_default()))
                        .map(|t| t.name.as_str())
                        .collect();
                    rules.extend(
                        ToolPolicy::default_for(asking.iter().copied())
                            .map(|p| p.rules)
                            .unwrap_or_default(),
                    );
                    Some(ToolPolicy {
                        rules,
                        default: PolicyDecision::Allow,
                        approval_timeout_ms: self.approval_timeout_ms,
                    })
                }
            }
        };
        Ok(cairn_workers::policy::session_policy(
            &hosted, tools, requested, true,
        )?)
    }
}

/// `TOOL` or `TOOL:PREFIX` of a policy flag, naming a tool the session offers (or `*`).
fn parse_rule(
    flag: &str,
    decision: PolicyDecision,
    given: &str,
    tools: &[ToolSpec],
) -> anyhow::Result<PolicyRule> {
    let (tool, prefix) = match given.split_once(':') {
        Some((tool, prefix)) => (tool, Some(prefix.to_owned())),
        None => (given, None),
    };
    if tool != "*" && !tools.iter().any(|t| t.name == tool) {
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        bail!(
            "{flag} {given}: the session offers no tool {tool:?} (it offers {}; --shell adds shell)",
            names.join(", ")
        );
    }
    if prefix.as_deref() == Some("") {
        bail!("{flag} {given}: the prefix after ':' is empty");
    }
    Ok(PolicyRule {
        tool: tool.to_owned(),
        decision,
        prefix,
        argument: None,
        kind: None,
    })
}

/// Whether the running turn of `state` waits only on people: calls parked for approval and
/// no activity scheduled.
fn waits_only_on_people(state: &SessionState) -> bool {
    !state.pending_approvals().is_empty()
        && state
            .outstanding_tasks()
            .into_iter()
            .all(|seq| state.scheduled_activity(seq).is_none())
}

/// Says, once per call, that `session_id` waits for a person to approve it and how to decide.
fn announce(state: &SessionState, announced: &mut BTreeSet<String>) {
    for parked in state.pending_approvals() {
        if announced.insert(parked.tool_use.id.clone()) {
            let deadline = match parked.deadline_ms {
                Some(ms) => format!(" (denied at {ms} ms unless decided before)"),
                None => String::new(),
            };
            note!(
                "waiting for approval: {} {} — `cairn approve {} {}` or `cairn deny {} {} --reason TEXT`{deadline}",
                parked.tool_use.name,
                parked.tool_use.arguments,
                state.session_id,
                parked.tool_use.id,
                state.session_id,
                parked.tool_use.id,
            );
        }
    }
}

/// Waits for turn `turn` of `session_id` to end, saying which calls wait for approval while
/// it waits. With `stop_when_parked`, returns `None` once the turn waits only on people
/// (`cairn resume` leaves such sessions parked; their decision needs no running process).
// The CLI waits on real time between looks at the session.
#[allow(clippy::disallowed_methods)]
pub async fn wait_turn(
    engine: &Engine,
    session_id: &str,
    turn: u32,
    stop_when_parked: bool,
) -> anyhow::Result<Option<TurnOutcome>> {
    let wait = engine.wait_turn(session_id, turn);
    tokio::pin!(wait);
    let mut announced = BTreeSet::new();
    loop {
        tokio::select! {
            outcome = &mut wait => return Ok(Some(outcome?)),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                let state = engine.state(session_id).await?;
                announce(&state, &mut announced);
                if stop_when_parked && state.active.as_ref().map(|a| a.turn) == Some(turn)
                    && waits_only_on_people(&state)
                {
                    return Ok(None);
                }
            }
        }
    }
}
