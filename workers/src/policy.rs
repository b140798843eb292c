//! The tool policy a new session records, from what the hosted tools declare: prefix rules
//! get the argument and comparison their tool names, and a session without a requested
//! policy gets the default one (ask before each call of a tool that asks by default, such
//! as `shell`; allow the rest), so the history always says which rules applied.

use crate::{Error, Result};
use cairn_activities::{SubjectKind, ToolRegistry};
use cairn_ledger::ToolSpec;
use cairn_runtime::policy::{PolicySubject, PrefixKind, ToolPolicy};

/// The policy to record for a session offering `tools`: `requested` completed from what the
/// tools `hosted` declare and checked, or, when none is requested, the default policy of
/// those tools (`None`, allow everything, when none of them asks by default).
/// [`Error::InvalidPolicy`] names the rule that cannot be recorded, or, when `strict`, a
/// prefix rule that would never match (its tool declares no argument and it names none): a
/// server records those (they may name tools its workers do not host), the CLI refuses them.
pub fn session_policy(
    hosted: &ToolRegistry,
    tools: &[ToolSpec],
    requested: Option<ToolPolicy>,
    strict: bool,
) -> Result<Option<ToolPolicy>> {
    let Some(mut policy) = requested else {
        let asking: Vec<&str> = tools
            .iter()
            .filter(|spec| hosted.get(&spec.name).is_some_and(|t| t.asks_by_default()))
            .map(|spec| spec.name.as_str())
            .collect();
        return Ok(ToolPolicy::default_for(asking));
    };
    policy.resolve(|name| {
        let subject = hosted.get(name)?.policy_subject()?;
        Some(PolicySubject {
            argument: subject.argument.to_owned(),
            kind: match subject.kind {
                SubjectKind::Path => PrefixKind::Path,
                SubjectKind::Command => PrefixKind::Command,
            },
        })
    });
    policy
        .check()
        .map_err(|reason| Error::InvalidPolicy { reason })?;
    if let Some(reason) = policy.unresolved().filter(|_| strict) {
        return Err(Error::InvalidPolicy { reason });
    }
    Ok(Some(policy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_runtime::policy::PolicyDecision;

    #[test]
    fn shell_and_the_editing_tools_ask_by_default_and_prefix_rules_get_their_tools_argument() {
        let hosted = ToolRegistry::hosted(".");
        let specs = hosted.specs();
        let policy = session_policy(&hosted, &specs, None, true)
            .unwrap()
            .unwrap();
        let asking: Vec<(&str, PolicyDecision)> = policy
            .rules
            .iter()
            .map(|r| (r.tool.as_str(), r.decision))
            .collect();
        assert_eq!(
            asking,
            [
                ("edit_file", PolicyDecision::Ask),
                ("shell", PolicyDecision::Ask),
                ("write_file", PolicyDecision::Ask)
            ]
        );
        let without_shell = ToolRegistry::builtin(".").specs();
        assert_eq!(
            session_policy(&hosted, &without_shell, None, true).unwrap(),
            None
        );

        let requested: ToolPolicy = serde_json::from_str(
            r#"{"rules":[{"tool":"shell","prefix":"git status","decision":"allow"},{"tool":"read_file","prefix":"src","decision":"allow"}]}"#,
        )
        .unwrap();
        let policy = session_policy(&hosted, &specs, Some(requested), true)
            .unwrap()
            .unwrap();
        assert_eq!(policy.rules[0].argument.as_deref(), Some("command"));
        assert_eq!(policy.rules[0].kind, Some(PrefixKind::Command));
        assert_eq!(policy.rules[1].argument.as_deref(), Some("path"));
        assert_eq!(policy.rules[1].kind, Some(PrefixKind::Path));

        let unknown: ToolPolicy = serde_json::from_str(
            r#"{"rules":[{"tool":"mystery","prefix":"x","decision":"deny"}]}"#,
        )
        .unwrap();
        let error = session_policy(&hosted, &specs, Some(unknown.clone()), true).unwrap_err();
        assert!(error.to_string().contains("rule 1 (mystery)"), "{error}");
        assert!(session_policy(&hosted, &specs, Some(unknown), false).is_ok());
    }
}
