//! Shared HTTP plumbing: settings, a streaming POST, and the classification of HTTP failures
//! for the retry policy (429, 529/overloaded and 5xx are retryable, honouring `retry-after`;
//! other 4xx are not and carry the provider's message).

use crate::context::ActivityContext;
use crate::error::{Error, ErrorKind, Result};
use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use std::time::Duration;

/// Where and how to reach a provider.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    /// Base URL without a trailing slash, e.g. `https://host` or `http://127.0.0.1:PORT`.
    pub base_url: String,
    /// The API key, when the provider uses one.
    pub api_key: Option<String>,
    /// The HTTP client (connection pool).
    pub client: reqwest::Client,
}

impl HttpSettings {
    /// Settings for `base_url` with a new client.
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
        }
    }
}

/// POSTs `body` to `base_url + path` with `headers`, and returns the response's byte stream when
/// the status is 2xx. Non-2xx statuses become classified errors carrying the provider's message.
pub async fn post_stream(
    settings: &HttpSettings,
    path: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
    context: &ActivityContext,
) -> Result<BoxStream<'static, Result<Bytes>>> {
    let url = format!("{}{}", settings.base_url, path);
    let mut request = settings
        .client
        .post(&url)
        .header("content-type", "application/json")
        .body(body);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let response = tokio::select! {
        r = request.send() => r.map_err(|e| transport_error(&url, &e))?,
        _ = context.cancelled() => return Err(Error::Cancelled { reason: "cancelled before the response".into() }),
    };
    let status = response.status().as_u16();
    if !(200..300).contains(&status) {
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let text = response.text().await.unwrap_or_default();
        return Err(classify_status(status, &text, retry_after));
    }
    let url_for_errors = url.clone();
    Ok(response
        .bytes_stream()
        .map(move |chunk| chunk.map_err(|e| transport_error(&url_for_errors, &e)))
        .boxed())
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

/// Classifies an HTTP error status with the provider's body (its message is extracted from the
/// usual JSON error shapes: `{"error":{"message"}}`, `{"message"}`, `{"Message"}`).
pub fn classify_status(status: u16, body: &str, retry_after_ms: Option<u64>) -> Error {
    let message = provider_message(body).unwrap_or_else(|| body.chars().take(500).collect());
    let overloaded = body.contains("overloaded");
    let kind = match status {
        429 => ErrorKind::RateLimited,
        529 => ErrorKind::Overloaded,
        503 if overloaded => ErrorKind::Overloaded,
        401 | 403 => ErrorKind::Auth,
        408 => ErrorKind::Timeout,
        s if s >= 500 => ErrorKind::Transient,
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
    fn statuses_are_classified_for_retries() {
        let k = |s, b: &str| classify_status(s, b, None).kind();
        assert_eq!(k(429, ""), ErrorKind::RateLimited);
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
        assert_eq!(parse_retry_after("2"), Some(2000));
        assert_eq!(parse_retry_after("0.5"), Some(500));
        assert_eq!(parse_retry_after("soon"), None);
    }
}
