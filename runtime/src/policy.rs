//! The tool policy: per tool call, allow it, deny it, or ask a person first. Recorded in
//! `session_started`, evaluated by the pure workflow, so every decision replays.
//!
//! Rules are checked in order and the first that matches decides; none matching, `default`
//! does (allow when not given). A rule names a tool (`*`: any) and may narrow it to calls
//! whose argument starts with a prefix: a path prefix for file tools (compared by path
//! components after `.` and `..` are resolved lexically, so `src` matches `src/a.rs` and
//! `./src/../src/a.rs` but not `srcx` or `src/../etc`), or a command prefix for a shell
//! (compared at a word boundary). An `allow` rule with a command prefix matches a simple
//! command only: one with a shell control character (`;`, `&`, `|`, a backquote, `$(`, `>`,
//! `<` or a newline) never passes as its prefix, so `git status; rm -rf ~` is not
//! `git status`. A session without a recorded policy allows every call, as sessions did
//! before policies existed.

use serde::{Deserialize, Serialize};
use std::path::{Component, Path};

/// What a policy decides for one tool call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyDecision {
    /// Run it.
    #[default]
    Allow,
    /// Answer it at once with an `is_error` result.
    Deny,
    /// Park it until a person approves or denies it (or its deadline denies it).
    Ask,
}

impl PolicyDecision {
    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyDecision::Allow => "allow",
            PolicyDecision::Deny => "deny",
            PolicyDecision::Ask => "ask",
        }
    }

    fn is_allow(&self) -> bool {
        *self == PolicyDecision::Allow
    }
}

/// How a rule's prefix is compared with the argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixKind {
    /// A file path, compared by components.
    Path,
    /// A shell command, compared at a word boundary.
    Command,
}

/// One rule of a [`ToolPolicy`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyRule {
    /// The tool's name, or `*` for any tool.
    pub tool: String,
    /// What the rule decides for the calls it matches.
    pub decision: PolicyDecision,
    /// Only calls whose `argument` starts with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// The argument `prefix` is compared with (a string field of the call's JSON object).
    /// Required with a prefix in a recorded policy; tools declare theirs, and the CLI fills
    /// it in from them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argument: Option<String>,
    /// How `prefix` is compared; required with a prefix in a recorded policy, filled in like
    /// `argument`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<PrefixKind>,
}

/// Which calls need what: recorded in `session_started` (`tool_policy`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolPolicy {
    /// Checked in order; the first that matches decides.
    #[serde(default)]
    pub rules: Vec<PolicyRule>,
    /// The decision when no rule matches; allow when absent.
    #[serde(default, skip_serializing_if = "PolicyDecision::is_allow")]
    pub default: PolicyDecision,
    /// How long a parked call waits for a person before it is denied, in milliseconds from
    /// the moment it was parked; without it, a parked call waits as long as it takes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_timeout_ms: Option<u64>,
}

/// What a tool declares about its arguments for policies: the argument a prefix rule
/// compares, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySubject {
    /// The argument's name.
    pub argument: String,
    /// How it is compared.
    pub kind: PrefixKind,
}

impl ToolPolicy {
    /// The policy of a session whose tools include ones that ask by default (`asking`, e.g.
    /// `shell`): ask for each of them, allow the rest. `None` when none asks, which records
    /// no policy at all (allow everything, as before policies existed).
    pub fn default_for<'a>(asking: impl IntoIterator<Item = &'a str>) -> Option<ToolPolicy> {
        let rules: Vec<PolicyRule> = asking
            .into_iter()
            .map(|tool| PolicyRule {
                tool: tool.to_owned(),
                decision: PolicyDecision::Ask,
                prefix: None,
                argument: None,
                kind: None,
            })
            .collect();
        (!rules.is_empty()).then(|| ToolPolicy {
            rules,
            ..ToolPolicy::default()
        })
    }

    /// Fills in the argument and kind of prefix rules that leave them out, from what the
    /// tools declare (`subject` of a tool name); rules of tools that declare nothing keep
    /// theirs, and [`ToolPolicy::check`] names what is still missing.
    pub fn resolve(&mut self, subject: impl Fn(&str) -> Option<PolicySubject>) {
        for rule in &mut self.rules {
            if rule.prefix.is_none() || (rule.argument.is_some() && rule.kind.is_some()) {
                continue;
            }
            if let Some(found) = subject(&rule.tool) {
                rule.argument.get_or_insert(found.argument);
                rule.kind.get_or_insert(found.kind);
            }
        }
    }

    /// Whether the policy can be recorded: every rule names a tool. The error names the rule
    /// (from 1). A prefix rule without its argument and kind can be recorded but never
    /// matches; [`ToolPolicy::unresolved`] finds those.
    pub fn check(&self) -> Result<(), String> {
        match self.rules.iter().position(|rule| rule.tool.is_empty()) {
            Some(i) => Err(format!(
                "rule {}: the tool name is empty (use \"*\" for any)",
                i + 1
            )),
            None => Ok(()),
        }
    }

    /// The first prefix rule that does not say which argument it compares and how (a tool
    /// that declares none, and the rule gives none): it would never match. The message names
    /// the rule (from 1).
    pub fn unresolved(&self) -> Option<String> {
        self.rules.iter().enumerate().find_map(|(i, rule)| {
            let n = i + 1;
            match (&rule.prefix, &rule.argument, rule.kind) {
                (Some(_), None, _) => Some(format!(
                    "rule {n} ({}): a prefix needs the argument it compares (\"argument\")",
                    rule.tool
                )),
                (Some(_), _, None) => Some(format!(
                    "rule {n} ({}): a prefix needs its kind (\"path\" or \"command\")",
                    rule.tool
                )),
                _ => None,
            }
        })
    }

    /// The decision for a call of `tool` with these JSON arguments, and the rule (from 1)
    /// that made it (`None`: the default).
    pub fn decide(
        &self,
        tool: &str,
        arguments: &serde_json::Value,
    ) -> (PolicyDecision, Option<usize>) {
        for (i, rule) in self.rules.iter().enumerate() {
            if rule.matches(tool, arguments) {
                return (rule.decision, Some(i + 1));
            }
        }
        (self.default, None)
    }
}

impl PolicyRule {
    /// Whether the rule applies to a call of `tool` with these JSON arguments.
    pub fn matches(&self, tool: &str, arguments: &serde_json::Value) -> bool {
        if self.tool != "*" && self.tool != tool {
            return false;
        }
        let Some(prefix) = &self.prefix else {
            return true;
        };
        let (Some(argument), Some(kind)) = (&self.argument, self.kind) else {
            // Refused by `check` before it is recorded; never matches if it got here anyway.
            return false;
        };
        let Some(value) = arguments.get(argument).and_then(|v| v.as_str()) else {
            return false;
        };
        match kind {
            PrefixKind::Path => path_has_prefix(value, prefix),
            PrefixKind::Command => {
                command_has_prefix(value, prefix)
                    && (self.decision != PolicyDecision::Allow || is_simple_command(value))
            }
        }
    }
}

/// The path's components with `.` dropped and `..` taking the previous normal component
/// away (one that cannot is kept, so a path that climbs out never matches a prefix below).
fn normalized(path: &str) -> Vec<Component<'_>> {
    let mut out: Vec<Component<'_>> = Vec::new();
    for component in Path::new(path).components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => match out.last() {
                Some(Component::Normal(_)) => {
                    out.pop();
                }
                _ => out.push(component),
            },
            other => out.push(other),
        }
    }
    out
}

/// Whether `path` is `prefix` or below it, by components.
fn path_has_prefix(path: &str, prefix: &str) -> bool {
    let path = normalized(path);
    let prefix = normalized(prefix);
    path.len() >= prefix.len() && path[..prefix.len()] == prefix[..]
}

/// Whether `command` (leading blanks ignored) starts with `prefix` at a word boundary.
fn command_has_prefix(command: &str, prefix: &str) -> bool {
    let command = command.trim_start();
    let prefix = prefix.trim_start();
    let Some(rest) = command.strip_prefix(prefix) else {
        return false;
    };
    rest.is_empty()
        || prefix.ends_with(char::is_whitespace)
        || rest.starts_with(char::is_whitespace)
}

/// Whether the command has no shell control character that could chain another command.
fn is_simple_command(command: &str) -> bool {
    !command.contains([';', '&', '|', '`', '>', '<', '\n']) && !command.contains("$(")
}

/// A rule for tests: `prefix` is (argument, prefix, kind).
#[cfg(test)]
pub(crate) fn rule(
    tool: &str,
    decision: PolicyDecision,
    prefix: Option<(&str, &str, PrefixKind)>,
) -> PolicyRule {
    PolicyRule {
        tool: tool.to_owned(),
        decision,
        prefix: prefix.map(|p| p.1.to_owned()),
        argument: prefix.map(|p| p.0.to_owned()),
        kind: prefix.map(|p| p.2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn path_prefixes_compare_components() {
        let r = rule(
            "read_file",
            PolicyDecision::Allow,
            Some(("path", "src", PrefixKind::Path)),
        );
        assert!(r.matches("read_file", &json!({"path": "src/a.rs"})));
        assert!(r.matches("read_file", &json!({"path": "./src/../src/a.rs"})));
        assert!(r.matches("read_file", &json!({"path": "src"})));
        assert!(!r.matches("read_file", &json!({"path": "srcx/a.rs"})));
        assert!(!r.matches("read_file", &json!({"path": "src/../etc/passwd"})));
        assert!(!r.matches("read_file", &json!({"path": "../src/a.rs"})));
        assert!(!r.matches("shell", &json!({"path": "src/a.rs"})));
        assert!(!r.matches("read_file", &json!({"file": "src/a.rs"})));
    }

    #[test]
    fn command_prefixes_compare_words_and_allow_only_simple_commands() {
        let allow = rule(
            "shell",
            PolicyDecision::Allow,
            Some(("command", "git status", PrefixKind::Command)),
        );
        assert!(allow.matches("shell", &json!({"command": "git status"})));
        assert!(allow.matches("shell", &json!({"command": "  git status --short"})));
        assert!(!allow.matches("shell", &json!({"command": "git statusx"})));
        assert!(!allow.matches("shell", &json!({"command": "git status; rm -rf ~"})));
        assert!(!allow.matches("shell", &json!({"command": "git status && rm x"})));
        assert!(!allow.matches("shell", &json!({"command": "git status $(rm x)"})));
        assert!(!allow.matches("shell", &json!({"command": "git status > x"})));
        let deny = rule(
            "shell",
            PolicyDecision::Deny,
            Some(("command", "rm", PrefixKind::Command)),
        );
        assert!(deny.matches("shell", &json!({"command": "rm -rf x; ls"})));
        assert!(!deny.matches("shell", &json!({"command": "rmdir x"})));
    }

    #[test]
    fn the_first_matching_rule_decides_then_the_default() {
        let policy = ToolPolicy {
            rules: vec![
                rule(
                    "shell",
                    PolicyDecision::Allow,
                    Some(("command", "ls", PrefixKind::Command)),
                ),
                rule(
                    "shell",
                    PolicyDecision::Deny,
                    Some(("command", "rm", PrefixKind::Command)),
                ),
                rule("shell", PolicyDecision::Ask, None),
            ],
            default: PolicyDecision::Allow,
            approval_timeout_ms: None,
        };
        assert_eq!(
            policy.decide("shell", &json!({"command": "ls -l"})),
            (PolicyDecision::Allow, Some(1))
        );
        assert_eq!(
            policy.decide("shell", &json!({"command": "rm x"})),
            (PolicyDecision::Deny, Some(2))
        );
        assert_eq!(
            policy.decide("shell", &json!({"command": "ls; rm x"})),
            (PolicyDecision::Ask, Some(3))
        );
        assert_eq!(
            policy.decide("calculator", &json!({})),
            (PolicyDecision::Allow, None)
        );
    }

    #[test]
    fn check_names_the_rule_and_resolve_fills_declared_subjects() {
        let mut policy = ToolPolicy {
            rules: vec![
                rule("shell", PolicyDecision::Ask, None),
                PolicyRule {
                    prefix: Some("git".to_owned()),
                    ..rule("shell", PolicyDecision::Allow, None)
                },
            ],
            ..ToolPolicy::default()
        };
        let error = policy.unresolved().expect("a prefix without its argument");
        assert!(error.starts_with("rule 2 (shell)"), "{error}");
        assert_eq!(policy.check(), Ok(()));
        policy.resolve(|tool| {
            (tool == "shell").then(|| PolicySubject {
                argument: "command".to_owned(),
                kind: PrefixKind::Command,
            })
        });
        assert_eq!(policy.unresolved(), None);
        assert_eq!(policy.rules[1].argument.as_deref(), Some("command"));
        let empty = ToolPolicy {
            rules: vec![rule("", PolicyDecision::Deny, None)],
            ..ToolPolicy::default()
        };
        assert!(empty.check().is_err());
    }

    #[test]
    fn a_policy_reads_its_short_json_form() {
        let policy: ToolPolicy = serde_json::from_str(
            r#"{"rules":[{"tool":"shell","prefix":"git","decision":"allow"}],"default":"ask","approval_timeout_ms":60000}"#,
        )
        .expect("parses");
        assert_eq!(policy.default, PolicyDecision::Ask);
        assert_eq!(policy.approval_timeout_ms, Some(60_000));
        assert!(serde_json::from_str::<ToolPolicy>(r#"{"rules":[],"bogus":1}"#).is_err());
    }
}
