//! Shared HTTP plumbing every model provider goes through: its settings (endpoint, key, idle
//! timeout, per-event cap), the streaming POST, the scrubbing of secrets from every error a call
//! returns, and the classification of HTTP failures for the retry policy (429, 529/overloaded
//! and 5xx are retryable, honouring `retry-after`; other 4xx are not and carry the provider's
//! message).

use crate::context::ActivityContext;
use crate::error::{Error, ErrorKind, Result};
use crate::providers::secrets::Secrets;
use bytes::Bytes;
use futures_util::stream::{self, BoxStream};
use futures_util::{Stream, StreamExt};
use std::future::Future;
use std::time::Duration;

/// How long a call waits for the response headers, or for the next body bytes, before the
/// attempt fails as stalled ([`Error::IdleTimeout`], retryable).
///
/// Two minutes: providers that stream keep bytes flowing (tokens, or keep-alive pings), so a
/// longer silence means a stalled connection, and failing it lets the retry policy try again
/// long before the call's overall deadline. It stays generous for the legitimately quiet
/// phases: a local server loading a model before answering, or a reasoning model thinking
/// without streaming summaries. Raise it (`<PREFIX>_IDLE_TIMEOUT_SECS`) for models that stay
/// silent longer.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// The largest single stream event (an SSE event's data, or an AWS event-stream frame) a call
/// accepts: 16 MiB, the AWS event-stream frame limit, and far above any real delta. An event
/// past it is refused ([`Error::EventTooLarge`]) instead of being buffered without bound.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// How much of an error response's body is read: enough for any provider's error message,
/// and a bound on what a misbehaving server can make us buffer.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// Suffix of the environment variable overriding [`HttpSettings::idle_timeout`], in seconds
/// (e.g. `ANTHROPIC_IDLE_TIMEOUT_SECS=300`).
pub const IDLE_TIMEOUT_ENV_SUFFIX: &str = "_IDLE_TIMEOUT_SECS";

/// Suffix of the environment variable overriding [`HttpSettings::max_event_bytes`] (e.g.
/// `OPENAI_MAX_EVENT_BYTES=33554432`).
pub const MAX_EVENT_BYTES_ENV_SUFFIX: &str = "_MAX_EVENT_BYTES";

/// Where and how to reach a provider.
#[derive(Clone)]
pub struct HttpSettings {
    /// Base URL without a trailing slash, e.g. `https://host` or `http://127.0.0.1:PORT`.
    pub base_url: String,
    /// The API key, when the provider uses one. Scrubbed from every error.
    pub api_key: Option<String>,
    /// The HTTP client (connection pool).
    pub client: reqwest::Client,
    /// The longest wait for the response headers or for the next body bytes; see
    /// [`DEFAULT_IDLE_TIMEOUT`].
    pub idle_timeout: Duration,
    /// The largest single stream event accepted; see [`DEFAULT_MAX_EVENT_BYTES`].
    pub max_event_bytes: usize,
    /// More values to scrub from errors, besides `api_key` and the credential headers a
    /// provider sends (e.g. the AWS secret access key, which signs requests but is never sent).
    pub secrets: Vec<String>,
}

impl HttpSettings {
    /// Settings for `base_url` with a new client and the default idle timeout and event cap.
    pub fn new(base_url: impl Into<String>, api_key: Option<String>) -> Self {
        let base_url = base_url.into().trim_end_matches('/').to_owned();
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .build()
            .unwrap_or_default();
        HttpSettings {
            base_url,
            api_key,
            client,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            secrets: Vec::new(),
        }
    }

    /// The same settings with another idle timeout.
    pub fn with_idle_timeout(mut self, idle_timeout: Duration) -> Self {
        self.idle_timeout = idle_timeout;
        self
    }

    /// The same settings with another per-event cap.
    pub fn with_max_event_bytes(mut self, max_event_bytes: usize) -> Self {
        self.max_event_bytes = max_event_bytes;
        self
    }

    /// The same settings with one more value to scrub from errors.
    pub fn with_secret(mut self, secret: impl Into<String>) -> Self {
        self.secrets.push(secret.into());
        self
    }

    /// The same settings with the overrides `{prefix}_IDLE_TIMEOUT_SECS` (seconds, fractions
    /// allowed) and `{prefix}_MAX_EVENT_BYTES` applied from the environment, when set.
    pub fn with_env(self, prefix: &str) -> Result<Self> {
        self.with_overrides(prefix, |name| std::env::var(name).ok())
    }

    /// [`HttpSettings::with_env`] reading variables through `lookup`. A value that is not a
    /// positive number is an `InvalidRequest` error naming the variable.
    pub fn with_overrides(
        mut self,
        prefix: &str,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let read = |suffix: &str| {
            let name = format!("{prefix}{suffix}");
            lookup(&name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .map(|v| (name, v))
        };
        let bad = |name: &str, value: &str, want: &str| Error::Provider {
            kind: ErrorKind::InvalidRequest,
            message: format!("{name}={value:?} is not {want}"),
        };
        if let Some((name, value)) = read(IDLE_TIMEOUT_ENV_SUFFIX) {
            self.idle_timeout = value
                .parse::<f64>()
                .ok()
                .filter(|s| *s > 0.0)
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| bad(&name, &value, "a positive number of seconds"))?;
        }
        if let Some((name, value)) = read(MAX_EVENT_BYTES_ENV_SUFFIX) {
            self.max_event_bytes = value
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| bad(&name, &value, "a positive number of bytes"))?;
        }
        Ok(self)
    }

    /// The secrets of a request with `headers`: the API key, [`HttpSettings::secrets`], and the
    /// values of credential headers.
    pub fn secrets_for(&self, headers: &[(&str, String)]) -> Secrets {
        let mut secrets = Secrets::new();
        for value in self.api_key.iter().chain(&self.secrets) {
            secrets.add(value);
        }
        for (name, value) in headers {
            secrets.add_header(name, value);
        }
        secrets
    }
}

impl std::fmt::Debug for HttpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Providers derive Debug and embed these settings: the key must not reach the output.
        f.debug_struct("HttpSettings")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("idle_timeout", &self.idle_timeout)
            .field("max_event_bytes", &self.max_event_bytes)
            .field("secrets", &self.secrets.len())
            .finish_non_exhaustive()
    }
}

/// One streaming model call: POSTs `body` to `base_url + path` with `headers`, hands the
/// response's byte stream (idle-timed) to `consume`, and returns its result. Every error —
/// from the exchange, or built by `consume` from what the provider streamed — comes back with
/// the call's secrets scrubbed ([`HttpSettings::secrets_for`]). Providers run their whole call
/// through here so that no provider text reaches the history unscrubbed.
pub async fn stream_call<T, F, Fut>(
    settings: &HttpSettings,
    provider: &str,
    path: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
    context: &ActivityContext,
    consume: F,
) -> Result<T>
where
    F: FnOnce(BoxStream<'static, Result<Bytes>>) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let secrets = settings.secrets_for(headers);
    let result = match send(settings, &secrets, provider, path, headers, body, context).await {
        Ok(bytes) => consume(bytes).await,
        Err(e) => Err(e),
    };
    result.map_err(|e| secrets.scrub_error(e))
}

/// POSTs `body` to `base_url + path` with `headers`, and returns the response's byte stream when
/// the status is 2xx. Non-2xx statuses become classified errors carrying the provider's message.
/// Waiting for the headers and for each body chunk is bounded by the idle timeout; errors are
/// scrubbed of the call's secrets. Prefer [`stream_call`], which also scrubs the errors built
/// from the streamed events.
pub async fn post_stream(
    settings: &HttpSettings,
    provider: &str,
    path: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
    context: &ActivityContext,
) -> Result<BoxStream<'static, Result<Bytes>>> {
    let secrets = settings.secrets_for(headers);
    match send(settings, &secrets, provider, path, headers, body, context).await {
        Ok(bytes) => Ok(bytes
            .map(move |item| item.map_err(|e| secrets.scrub_error(e)))
            .boxed()),
        Err(e) => Err(secrets.scrub_error(e)),
    }
}

async fn send(
    settings: &HttpSettings,
    secrets: &Secrets,
    provider: &str,
    path: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
    context: &ActivityContext,
) -> Result<BoxStream<'static, Result<Bytes>>> {
    let url = format!("{}{}", settings.base_url, path);
    let idle = settings.idle_timeout;
    let mut request = settings
        .client
        .post(&url)
        .header("content-type", "application/json")
        .body(body);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let response = tokio::select! {
        r = tokio::time::timeout(idle, request.send()) => match r {
            Ok(r) => r.map_err(|e| transport_error(&url, &e))?,
            Err(_) => return Err(idle_error(provider, "the response headers", idle)),
        },
        _ = context.cancelled() => return Err(Error::Cancelled { reason: "cancelled before the response".into() }),
    };
    let status = response.status().as_u16();
    if !(200..300).contains(&status) {
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let text = tokio::select! {
            text = error_body(response, idle) => text,
            _ = context.cancelled() => return Err(Error::Cancelled { reason: "cancelled while reading an error response".into() }),
        };
        // Scrubbed before classification, which may cut the text: a cut must not leave half
        // a key behind.
        return Err(classify_status(status, &secrets.scrub(&text), retry_after));
    }
    let url_for_errors = url.clone();
    let bytes = response
        .bytes_stream()
        .map(move |chunk| chunk.map_err(|e| transport_error(&url_for_errors, &e)));
    Ok(idle_timed(bytes, provider.to_owned(), idle))
}

/// Up to [`MAX_ERROR_BODY_BYTES`] of an error response's body, as text. A body that stalls or
/// breaks off yields what arrived: the status alone still classifies the failure.
async fn error_body(mut response: reqwest::Response, idle: Duration) -> String {
    let mut body = Vec::new();
    while body.len() < MAX_ERROR_BODY_BYTES {
        match tokio::time::timeout(idle, response.chunk()).await {
            Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    body.truncate(MAX_ERROR_BODY_BYTES);
    String::from_utf8_lossy(&body).into_owned()
}

/// `bytes` with each wait for the next chunk bounded by `idle`: a stall ends the stream with
/// an [`Error::IdleTimeout`].
fn idle_timed(
    bytes: impl Stream<Item = Result<Bytes>> + Send + 'static,
    provider: String,
    idle: Duration,
) -> BoxStream<'static, Result<Bytes>> {
    stream::unfold(Some(bytes.boxed()), move |state| {
        let provider = provider.clone();
        async move {
            let mut bytes = state?;
            match tokio::time::timeout(idle, bytes.next()).await {
                Ok(Some(Ok(chunk))) => Some((Ok(chunk), Some(bytes))),
                Ok(Some(Err(e))) => Some((Err(e), None)),
                Ok(None) => None,
                Err(_) => Some((
                    Err(idle_error(
                        &provider,
                        "the next bytes of the response body",
                        idle,
                    )),
                    None,
                )),
            }
        }
    })
    .boxed()
}

fn idle_error(provider: &str, waiting_for: &str, waited: Duration) -> Error {
    Error::IdleTimeout {
        provider: provider.to_owned(),
        waiting_for: waiting_for.to_owned(),
        waited,
    }
}

/// A transport failure (connect, reset, early end): retryable.
pub fn transport_error(url: &str, e: &reqwest::Error) -> Error {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else {
        ErrorKind::Transient
    };
    Error::Http {
        kind,
        status: None,
        message: format!("{url}: {e}"),
        retry_after_ms: None,
    }
}

/// `retry-after` in seconds (the HTTP-date form is not used by model providers).
pub fn parse_retry_after(value: &str) -> Option<u64> {
    let seconds: f64 = value.trim().parse().ok()?;
    (seconds.is_finite() && seconds >= 0.0).then_some((seconds * 1000.0) as u64)
}

/// Whether a provider's error text (a message, an error code or a whole body) says the request
/// is larger than the model's context window. The answers matched, case-insensitively:
/// OpenAI and compatible servers' code `context_length_exceeded` and message "This model's
/// maximum context length is …" (vLLM: "… maximum context length …"), Anthropic's
/// "prompt is too long: N tokens > M maximum" and "input length and `max_tokens` exceed
/// context limit: N + M > L" (both also from Claude on Bedrock), Bedrock's
/// "Input is too long for requested model." and its stop reason
/// `model_context_window_exceeded`, and llama.cpp's "exceeds the available context size".
pub fn is_context_too_long(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    [
        "context_length_exceeded",
        "maximum context length",
        "prompt is too long",
        "exceed context limit",
        "input is too long for requested model",
        "model_context_window_exceeded",
        "exceeds the available context size",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// Classifies an HTTP error status with the provider's body (its message is extracted from the
/// usual JSON error shapes: `{"error":{"message"}}`, `{"message"}`, `{"Message"}`). A 400-class
/// answer whose body says the context is too long ([`is_context_too_long`]) is
/// [`ErrorKind::ContextTooLong`].
pub fn classify_status(status: u16, body: &str, retry_after_ms: Option<u64>) -> Error {
    let message = provider_message(body).unwrap_or_else(|| body.chars().take(500).collect());
    let overloaded = body.contains("overloaded");
    let kind = match status {
        // OpenAI answers a used-up quota with 429 too: a billing matter no retry fixes.
        429 if body.contains("insufficient_quota") => ErrorKind::Auth,
        429 => ErrorKind::RateLimited,
        529 => ErrorKind::Overloaded,
        503 if overloaded => ErrorKind::Overloaded,
        401 | 403 => ErrorKind::Auth,
        408 => ErrorKind::Timeout,
        s if s >= 500 => ErrorKind::Transient,
        _ if is_context_too_long(body) => ErrorKind::ContextTooLong,
        _ => ErrorKind::InvalidRequest,
    };
    Error::Http {
        kind,
        status: Some(status),
        message,
        retry_after_ms,
    }
}

fn provider_message(body: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    let found = value
        .pointer("/error/message")
        .or_else(|| value.get("message"))
        .or_else(|| value.get("Message"))?;
    found.as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_set_the_idle_timeout_and_event_cap() {
        fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect();
            move |name| {
                pairs
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.clone())
            }
        }
        let base = HttpSettings::new("http://h", None);
        let same = base.clone().with_overrides("P", vars(&[])).unwrap();
        assert_eq!(same.idle_timeout, DEFAULT_IDLE_TIMEOUT);
        assert_eq!(same.max_event_bytes, DEFAULT_MAX_EVENT_BYTES);
        let set = base
            .clone()
            .with_overrides(
                "P",
                vars(&[
                    ("P_IDLE_TIMEOUT_SECS", "2.5"),
                    ("P_MAX_EVENT_BYTES", "1024"),
                ]),
            )
            .unwrap();
        assert_eq!(set.idle_timeout, Duration::from_millis(2500));
        assert_eq!(set.max_event_bytes, 1024);
        for (name, value) in [
            ("P_IDLE_TIMEOUT_SECS", "0"),
            ("P_IDLE_TIMEOUT_SECS", "soon"),
            ("P_MAX_EVENT_BYTES", "-1"),
        ] {
            let err = base
                .clone()
                .with_overrides("P", vars(&[(name, value)]))
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidRequest);
            assert!(err.to_string().contains(name), "{err}");
        }
    }

    #[test]
    fn debug_output_hides_the_key() {
        let settings = HttpSettings::new("http://h", Some("sk-very-secret-key".into()));
        let text = format!("{settings:?}");
        assert!(!text.contains("sk-very-secret-key"), "{text}");
        assert!(text.contains("[redacted]"), "{text}");
    }

    #[test]
    fn statuses_are_classified_for_retries() {
        let k = |s, b: &str| classify_status(s, b, None).kind();
        assert_eq!(k(429, ""), ErrorKind::RateLimited);
        // A used-up quota is no reason to wait and retry.
        assert_eq!(
            k(
                429,
                r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#
            ),
            ErrorKind::Auth
        );
        assert_eq!(
            k(
                529,
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            ErrorKind::Overloaded
        );
        assert_eq!(k(500, ""), ErrorKind::Transient);
        assert_eq!(k(401, ""), ErrorKind::Auth);
        assert_eq!(k(400, ""), ErrorKind::InvalidRequest);
        let e = classify_status(
            400,
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"messages.1: bad"}}"#,
            None,
        );
        assert!(e.to_string().contains("messages.1: bad"), "{e}");
        // Every provider's context-too-long answer is its own class.
        for (status, body) in [
            (
                400,
                r#"{"error":{"message":"This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#,
            ),
            (
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#,
            ),
            (
                400,
                r#"{"message":"Input is too long for requested model."}"#,
            ),
            (
                400,
                r#"{"message":"The model returned the following errors: prompt is too long: 227255 tokens > 200000 maximum"}"#,
            ),
            (
                400,
                r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error"}}"#,
            ),
            (
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000, decrease input length or `max_tokens` and try again"}}"#,
            ),
            (
                400,
                r#"{"message":"The model returned the following errors: input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000, decrease input length or `max_tokens` and try again"}"#,
            ),
        ] {
            let e = classify_status(status, body, None);
            assert_eq!(e.kind(), ErrorKind::ContextTooLong, "{body}");
        }
        // The words alone do not make a server error or a refused key one.
        assert_eq!(k(500, "maximum context length"), ErrorKind::Transient);
        assert_eq!(k(401, "prompt is too long"), ErrorKind::Auth);
        assert_eq!(parse_retry_after("2"), Some(2000));
        assert_eq!(parse_retry_after("0.5"), Some(500));
        assert_eq!(parse_retry_after("soon"), None);
    }
}
