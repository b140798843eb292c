//! Bearer tokens and namespaces: the tokens file, and the extractors that turn a request's
//! `Authorization` header into the [`Caller`] a route acts for (401 without a known token, 403
//! with a token of the wrong role). Without a tokens file every request acts for the default
//! namespace with both roles; [`crate::check_exposure`] keeps such a server on loopback.

use crate::app::AppState;
use crate::errors::ApiError;
use crate::{Error, Result};
use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use cairn_runtime::wire::{ErrorCode, DEFAULT_NAMESPACE, NAMESPACE_SEPARATOR};
use serde::Deserialize;
use std::path::Path;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Start sessions, send messages, read them, cancel them.
    Client,
    /// Lease tasks and report their results.
    Worker,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Worker => "worker",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    token: String,
    namespace: String,
    role: Role,
}

/// The server's tokens: `{"tokens": [{"token": "...", "namespace": "acme", "role":
/// "client"}]}`. Each token belongs to one namespace and has one role.
pub struct Tokens {
    entries: Vec<TokenEntry>,
}

impl std::fmt::Debug for Tokens {
    // Never print a token, not even in a debug dump of the configuration.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} tokens)", self.entries.len())
    }
}

impl Tokens {
    /// Reads and checks a tokens file.
    pub fn load(path: &Path) -> Result<Tokens> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Tokens {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Tokens::parse(&text).map_err(|reason| Error::Tokens {
            path: path.display().to_string(),
            reason,
        })
    }

    /// Parses and checks a tokens file's text: tokens are non-empty, without whitespace, and
    /// unique; namespaces are 1-64 of `[A-Za-z0-9._-]`.
    pub fn parse(text: &str) -> std::result::Result<Tokens, String> {
        let file: TokensFile = serde_json::from_str(text).map_err(|e| {
            format!(
                "{e} (expected {{\"tokens\": [{{\"token\": \"...\", \"namespace\": \"...\", \"role\": \"client\"|\"worker\"}}]}})"
            )
        })?;
        for (i, entry) in file.tokens.iter().enumerate() {
            if entry.token.is_empty()
                || entry
                    .token
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control())
            {
                return Err(format!(
                    "token {} (namespace {:?}) is empty or has whitespace",
                    i + 1,
                    entry.namespace
                ));
            }
            if !valid_namespace(&entry.namespace) {
                return Err(format!(
                    "token {}: invalid namespace {:?}: use 1-64 characters of [A-Za-z0-9._-]",
                    i + 1,
                    entry.namespace
                ));
            }
            if file.tokens[..i].iter().any(|e| e.token == entry.token) {
                return Err(format!(
                    "token {} repeats an earlier token (a token has one namespace and one role)",
                    i + 1
                ));
            }
        }
        Ok(Tokens {
            entries: file.tokens,
        })
    }

    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none (every request is refused).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry of a presented token. Compares against every token in constant time per
    /// byte, so the answer's timing does not tell how much of a guess was right.
    fn find(&self, presented: &str) -> Option<&TokenEntry> {
        let mut found = None;
        for entry in &self.entries {
            if constant_time_eq(entry.token.as_bytes(), presented.as_bytes()) {
                found = Some(entry);
            }
        }
        found
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn valid_namespace(namespace: &str) -> bool {
    !namespace.is_empty()
        && namespace.len() <= 64
        && !namespace.contains(NAMESPACE_SEPARATOR)
        && namespace
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Who a request acts for: a namespace and the roles it may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The namespace its sessions live in.
    pub namespace: String,
    client: bool,
    worker: bool,
}

impl Caller {
    /// The caller of a server without tokens: the default namespace, both roles.
    pub fn unauthenticated() -> Self {
        Caller {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            client: true,
            worker: true,
        }
    }

    fn may(&self, role: Role) -> bool {
        match role {
            Role::Client => self.client,
            Role::Worker => self.worker,
        }
    }
}

fn authenticate(parts: &Parts, state: &AppState) -> Result<Caller, ApiError> {
    let Some(tokens) = &state.config.tokens else {
        return Ok(Caller::unauthenticated());
    };
    let unauthorized = |message: &str| ApiError::new(ErrorCode::Unauthorized, message);
    let Some(value) = parts.headers.get(AUTHORIZATION) else {
        return Err(unauthorized("no token: send `Authorization: Bearer TOKEN`"));
    };
    let presented = value
        .to_str()
        .ok()
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .ok_or_else(|| unauthorized("the `Authorization` header must be `Bearer TOKEN`"))?;
    let entry = tokens
        .find(presented)
        .ok_or_else(|| unauthorized("unknown token"))?;
    Ok(Caller {
        namespace: entry.namespace.clone(),
        client: entry.role == Role::Client,
        worker: entry.role == Role::Worker,
    })
}

fn authorize(parts: &Parts, state: &AppState, role: Option<Role>) -> Result<Caller, ApiError> {
    let caller = authenticate(parts, state)?;
    match role {
        Some(role) if !caller.may(role) => Err(ApiError::new(
            ErrorCode::Forbidden,
            format!("this route needs a token of role {}", role.as_str()),
        )),
        _ => Ok(caller),
    }
}

/// A caller with the client role.
pub struct ClientCaller(pub Caller);

impl FromRequestParts<AppState> for ClientCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        authorize(parts, state, Some(Role::Client)).map(ClientCaller)
    }
}

/// A caller with the worker role.
pub struct WorkerCaller(pub Caller);

impl FromRequestParts<AppState> for WorkerCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        authorize(parts, state, Some(Role::Worker)).map(WorkerCaller)
    }
}

/// A caller with a known token of either role (the routes it guards act for no namespace).
pub struct AnyCaller;

impl FromRequestParts<AppState> for AnyCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        authorize(parts, state, None).map(|_| AnyCaller)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokens_file_is_checked() {
        let ok = Tokens::parse(
            r#"{"tokens": [{"token": "t1", "namespace": "acme", "role": "client"},
                           {"token": "t2", "namespace": "default", "role": "worker"}]}"#,
        )
        .unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(ok.find("t2").unwrap().role, Role::Worker);
        assert!(ok.find("t").is_none());
        assert!(
            !format!("{ok:?}").contains("t1"),
            "Debug never shows tokens"
        );

        for (text, why) in [
            (
                r#"{"tokens": [{"token": "", "namespace": "a", "role": "client"}]}"#,
                "empty",
            ),
            (
                r#"{"tokens": [{"token": "a b", "namespace": "a", "role": "client"}]}"#,
                "whitespace",
            ),
            (
                r#"{"tokens": [{"token": "t", "namespace": "a:b", "role": "client"}]}"#,
                "namespace",
            ),
            (
                r#"{"tokens": [{"token": "t", "namespace": "a", "role": "admin"}]}"#,
                "role",
            ),
            (
                r#"{"tokens": [{"token": "t", "namespace": "a", "role": "client"},
                            {"token": "t", "namespace": "b", "role": "worker"}]}"#,
                "repeats",
            ),
            (
                r#"{"tokens": [{"token": "t", "namespace": "a", "role": "client", "x": 1}]}"#,
                "unknown field",
            ),
        ] {
            let err = Tokens::parse(text)
                .err()
                .unwrap_or_else(|| panic!("accepted: {text}"));
            assert!(err.contains(why), "{why}: {err}");
        }
    }
}
