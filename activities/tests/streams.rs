//! Stream limits and secret scrubbing against the fake server, through real providers: a stalled
//! provider fails the attempt with a retryable idle timeout, a multi-megabyte event parses, an
//! event over the cap is a typed error, and no error carries the API key it was sent with.

mod support;

use cairn_activities::providers::anthropic::{AnthropicProvider, PROVIDER};
use cairn_activities::providers::http::{post_stream, HttpSettings};
use cairn_activities::providers::openai_chat::OpenAiChatProvider;
use cairn_activities::providers::openai_responses::OpenAiResponsesProvider;
use cairn_activities::{
    ActivityContext, CallContext, Error, ErrorKind, ModelProvider, ModelRequest, NoDeltas,
};
use cairn_ledger::{ModelSpec, Part, Transcript};
use serde_json::{json, Value};
use std::time::Duration;
use support::{Canned, FakeServer};

const KEY: &str = "sk-ant-api03-SECRETSECRETSECRET-0123456789";

fn request(provider: &str) -> ModelRequest {
    let mut transcript = Transcript::new();
    transcript.push_user_text("hi");
    ModelRequest {
        options: Default::default(),
        context: CallContext::default(),
        model: ModelSpec {
            provider: provider.into(),
            model: "m".into(),
            max_tokens: Some(1000),
            thinking_budget_tokens: None,
        },
        transcript: transcript.into(),
        tools: vec![].into(),
    }
}

fn anthropic(settings: HttpSettings) -> AnthropicProvider {
    AnthropicProvider::new(settings)
}

async fn call(provider: &dyn ModelProvider) -> Result<cairn_ledger::ModelResponse, Error> {
    provider
        .call(
            &request(provider.provider()),
            &NoDeltas,
            &ActivityContext::detached(),
        )
        .await
}

/// An Anthropic SSE body answering `text`, with `line_end` between lines.
fn anthropic_text(text: &str, line_end: &str) -> String {
    let events: [Value; 6] = [
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
            "role": "assistant", "content": [], "model": "m", "stop_reason": null,
            "usage": {"input_tokens": 1, "output_tokens": 1}}}),
        json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 2}}),
        json!({"type": "message_stop"}),
    ];
    let mut out = String::new();
    for event in events {
        let name = event["type"].as_str().unwrap();
        out.push_str(&format!(
            "event: {name}{line_end}data: {event}{line_end}{line_end}"
        ));
    }
    out
}

fn assert_idle_timeout(err: &Error, provider: &str, waiting_for: &str) {
    assert!(
        matches!(err, Error::IdleTimeout { provider: p, waiting_for: w, waited }
            if p == provider && w == waiting_for && *waited == Duration::from_millis(300)),
        "{err:?}"
    );
    assert_eq!(err.kind(), ErrorKind::Timeout);
    assert!(err.is_retryable_by_default());
    let text = err.to_string();
    assert!(
        text.contains(provider) && text.contains("300ms") && text.contains("idle timeout"),
        "{text}"
    );
}

#[tokio::test]
async fn headers_then_silence_is_a_retryable_idle_timeout() {
    let server = FakeServer::start().await;
    let mut stalled = Canned::sse("event: ping\ndata: {\"type\": \"ping\"}\n\n");
    // The rest never comes (well, not within any test run).
    stalled
        .chunks
        .push((Duration::from_secs(3600), b"data: late\n\n".to_vec()));
    server.push(stalled);
    let settings = HttpSettings::new(server.base_url(), Some(KEY.into()))
        .with_idle_timeout(Duration::from_millis(300));
    let err = call(&anthropic(settings)).await.unwrap_err();
    assert_idle_timeout(&err, PROVIDER, "the next bytes of the response body");
}

#[tokio::test]
async fn a_server_that_never_answers_is_a_retryable_idle_timeout() {
    // Accepts the connection, reads nothing, answers nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let settings = HttpSettings::new(format!("http://{addr}/v1"), Some(KEY.into()))
        .with_idle_timeout(Duration::from_millis(300));
    let err = call(&OpenAiChatProvider::new(settings)).await.unwrap_err();
    assert_idle_timeout(&err, "openai", "the response headers");
    silent.abort();
}

#[tokio::test]
async fn a_slow_but_steady_stream_is_not_idle() {
    // Five pauses of 400 ms: 2 s in all, longer than the 1.5 s idle timeout, but no single
    // silence comes close to it. The timeout is between bytes, not over the whole body.
    let server = FakeServer::start().await;
    let body = anthropic_text("steady", "\n");
    let mut canned = Canned::sse("");
    canned.chunks = body
        .as_bytes()
        .chunks(body.len() / 5 + 1)
        .map(|c| (Duration::from_millis(400), c.to_vec()))
        .collect();
    server.push(canned);
    let settings = HttpSettings::new(server.base_url(), Some(KEY.into()))
        .with_idle_timeout(Duration::from_millis(1500));
    let response = call(&anthropic(settings)).await.unwrap();
    assert_eq!(response.parts, vec![Part::text("steady")]);
}

#[tokio::test]
async fn a_twenty_megabyte_event_parses_in_small_chunks() {
    let server = FakeServer::start().await;
    let text = "0123456789abcdef".repeat(20 * 1024 * 1024 / 16);
    let body = anthropic_text(&text, "\r\n");
    let mut canned = Canned::sse("");
    canned.chunks = body
        .as_bytes()
        .chunks(64 * 1024)
        .map(|c| (Duration::ZERO, c.to_vec()))
        .collect();
    server.push(canned);
    let settings = HttpSettings::new(server.base_url(), Some(KEY.into()))
        .with_max_event_bytes(32 * 1024 * 1024);
    let response = call(&anthropic(settings)).await.unwrap();
    assert_eq!(response.parts, vec![Part::text(text)]);
}

#[tokio::test]
async fn an_event_over_the_cap_is_a_typed_error_naming_cap_and_provider() {
    let server = FakeServer::start().await;
    server.push(Canned::sse(&anthropic_text(&"x".repeat(5000), "\n")));
    let settings =
        HttpSettings::new(server.base_url(), Some(KEY.into())).with_max_event_bytes(4096);
    let err = call(&anthropic(settings)).await.unwrap_err();
    assert!(
        matches!(&err, Error::EventTooLarge { provider, limit_bytes: 4096, .. } if provider == PROVIDER),
        "{err:?}"
    );
    assert_eq!(err.kind(), ErrorKind::InvalidResponse);
    let text = err.to_string();
    assert!(
        text.contains("anthropic stream") && text.contains("4096 bytes"),
        "{text}"
    );
}

#[tokio::test]
async fn line_endings_and_chunk_boundaries_do_not_change_the_response() {
    let mut responses = Vec::new();
    for line_end in ["\n", "\r\n", "\r"] {
        for chunk in [1, 7, 4096] {
            let server = FakeServer::start().await;
            let body = anthropic_text("same answer", line_end);
            let mut canned = Canned::sse("");
            canned.chunks = body
                .as_bytes()
                .chunks(chunk)
                .map(|c| (Duration::ZERO, c.to_vec()))
                .collect();
            server.push(canned);
            let settings = HttpSettings::new(server.base_url(), Some(KEY.into()));
            responses.push(call(&anthropic(settings)).await.unwrap());
        }
    }
    assert!(responses.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(responses[0].parts, vec![Part::text("same answer")]);
}

fn assert_no_key(err: &Error, key: &str) {
    let shown = err.to_string();
    let debugged = format!("{err:?}");
    assert!(
        !shown.contains(key) && !debugged.contains(key),
        "{shown} / {debugged}"
    );
    // Nor a telling piece of it.
    assert!(!shown.contains("SECRETSECRET") && !debugged.contains("SECRETSECRET"));
    assert!(shown.contains("[redacted]"), "{shown}");
}

#[tokio::test]
async fn an_error_body_echoing_the_key_is_scrubbed() {
    let server = FakeServer::start().await;
    // Plain echo, in the message a provider's JSON error carries.
    server.push(Canned::error(
        401,
        &json!({"type": "error", "error": {"type": "authentication_error",
            "message": format!("invalid x-api-key: {KEY}")}})
        .to_string(),
    ));
    let settings = HttpSettings::new(server.base_url(), Some(KEY.into()));
    let err = call(&anthropic(settings)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Auth);
    assert_no_key(&err, KEY);
    assert!(err.to_string().contains("invalid x-api-key"), "{err}");
}

#[tokio::test]
async fn a_json_escaped_echo_in_an_unrecognised_body_is_scrubbed() {
    // A key with characters JSON escapes, echoed inside a body whose shape we do not know, so
    // the raw (escaped) body becomes the message.
    let key = "sk-proj-SECRETSECRET\"quoted\\slashed/0123";
    let server = FakeServer::start().await;
    let body = json!({"detail": {"header": format!("Bearer {key}")}}).to_string();
    assert!(!body.contains(key), "the body holds the escaped form only");
    server.push(Canned::error(400, &body));
    let settings = HttpSettings::new(format!("{}/v1", server.base_url()), Some(key.into()));
    let err = call(&OpenAiResponsesProvider::new(settings))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert_no_key(&err, key);
    assert!(!err.to_string().contains("quoted"), "{err}");
}

#[tokio::test]
async fn an_error_event_echoing_the_key_mid_stream_is_scrubbed() {
    // Errors built by a provider's stream parser pass through the same scrubbing.
    let server = FakeServer::start().await;
    let error = json!({"type": "error", "error": {"type": "overloaded_error",
        "message": format!("overloaded (request by {KEY})")}});
    server.push(Canned::sse(&format!("event: error\ndata: {error}\n\n")));
    let settings = HttpSettings::new(server.base_url(), Some(KEY.into()));
    let err = call(&anthropic(settings)).await.unwrap_err();
    assert_no_key(&err, KEY);
}

#[tokio::test]
async fn post_stream_scrubs_its_errors_too() {
    let server = FakeServer::start().await;
    server.push(Canned::error(500, &format!("upstream said: key={KEY}")));
    let settings = HttpSettings::new(server.base_url(), None);
    let err = post_stream(
        &settings,
        "test",
        "/x",
        &[("authorization", format!("Bearer {KEY}"))],
        b"{}".to_vec(),
        &ActivityContext::detached(),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(err.kind(), ErrorKind::Transient);
    assert_no_key(&err, KEY);
}
