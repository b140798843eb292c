//! Secret scrubbing: the configured credentials of a model call (API keys, AWS secret key and
//! session token, the values of credential headers) are replaced by [`REDACTED`] in every error
//! the call returns.
//!
//! Errors are recorded verbatim in the session history and shown in logs, and providers do echo
//! what they were sent ("invalid x-api-key: sk-..."), so scrubbing happens in the shared HTTP
//! layer ([`super::http`]), which every HTTP provider's call goes through: a new provider is
//! covered without doing anything.

use crate::error::Error;

/// What a secret is replaced with.
pub const REDACTED: &str = "[redacted]";

/// Values shorter than this are not scrubbed: they cannot be real credentials (keys and tokens
/// are tens of characters), and replacing a short placeholder such as `x` everywhere would
/// mangle every message it occurs in.
pub const MIN_SECRET_LEN: usize = 8;

/// Request headers whose values are credentials.
pub const SENSITIVE_HEADERS: [&str; 7] = [
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "x-amz-security-token",
    "cookie",
];

/// The secret values of one call, and the forms in which they may come back.
#[derive(Clone, Default)]
pub struct Secrets {
    /// Every form to replace, longest first so a secret containing another is replaced whole.
    forms: Vec<String>,
}

impl Secrets {
    /// No secrets.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `value`: it is scrubbed as sent, and as it appears inside a JSON string (a
    /// provider echoing it in a JSON body escapes quotes, backslashes and control characters,
    /// and some encoders also `/`, which AWS secret keys contain).
    pub fn add(&mut self, value: &str) {
        let value = value.trim();
        if value.len() < MIN_SECRET_LEN {
            return;
        }
        let mut forms = vec![value.to_owned()];
        if let Ok(quoted) = serde_json::to_string(value) {
            let escaped = &quoted[1..quoted.len() - 1];
            forms.push(escaped.to_owned());
            forms.push(escaped.replace('/', "\\/"));
        }
        forms.dedup();
        for form in forms {
            if !self.forms.contains(&form) {
                self.forms.push(form);
            }
        }
        self.forms.sort_by_key(|f| std::cmp::Reverse(f.len()));
    }

    /// Adds the value of request header `name` when it carries credentials: the whole value,
    /// and for `Authorization: <scheme> <credentials>` the credentials alone.
    pub fn add_header(&mut self, name: &str, value: &str) {
        if !SENSITIVE_HEADERS
            .iter()
            .any(|h| h.eq_ignore_ascii_case(name))
        {
            return;
        }
        self.add(value);
        if let Some((_scheme, credentials)) = value.trim().split_once(' ') {
            self.add(credentials);
        }
    }

    /// Whether there is nothing to scrub.
    pub fn is_empty(&self) -> bool {
        self.forms.is_empty()
    }

    /// `text` with every secret replaced by [`REDACTED`].
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for form in &self.forms {
            if out.contains(form.as_str()) {
                out = out.replace(form.as_str(), REDACTED);
            }
        }
        out
    }

    /// `error` with every secret replaced by [`REDACTED`] in all its text.
    pub fn scrub_error(&self, error: Error) -> Error {
        if self.is_empty() {
            return error;
        }
        error.map_text(|text| self.scrub(text))
    }
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the values themselves: this type exists to keep them out of output.
        write!(f, "Secrets({} forms)", self.forms.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn scrubs_plain_json_escaped_and_bearer_forms() {
        let mut secrets = Secrets::new();
        secrets.add("sk-ant-api03-abc\"def\\ghi");
        secrets.add_header("Authorization", "Bearer sk-proj-0123456789");
        secrets.add_header("content-type", "application/json");
        secrets.add("short");
        let text = "key sk-ant-api03-abc\"def\\ghi, json \"sk-ant-api03-abc\\\"def\\\\ghi\", \
                    token sk-proj-0123456789, type application/json, short";
        let scrubbed = secrets.scrub(text);
        assert_eq!(
            scrubbed,
            "key [redacted], json \"[redacted]\", token [redacted], type application/json, short"
        );
        let err = secrets.scrub_error(Error::Http {
            kind: ErrorKind::Auth,
            status: Some(401),
            message: "invalid key sk-proj-0123456789".into(),
            retry_after_ms: None,
        });
        assert_eq!(err.to_string(), "HTTP 401: invalid key [redacted]");
        assert!(!format!("{err:?}").contains("0123456789"));
        assert!(!format!("{secrets:?}").contains("sk-"));
    }

    #[test]
    fn escaped_slashes_are_scrubbed() {
        let mut secrets = Secrets::new();
        secrets.add("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY");
        assert_eq!(
            secrets.scrub(r#"{"m":"wJalrXUtnFEMI\/K7MDENG\/bPxRfiCYEXAMPLEKEY"}"#),
            r#"{"m":"[redacted]"}"#
        );
    }

    #[test]
    fn a_secret_containing_another_is_replaced_whole() {
        let mut secrets = Secrets::new();
        secrets.add("abcdefgh");
        secrets.add("abcdefgh-ijklmnop");
        assert_eq!(secrets.scrub("x abcdefgh-ijklmnop y"), "x [redacted] y");
    }
}
