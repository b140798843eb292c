//! The shared HTTP layer against the fake server: streaming bodies, and classified errors.

mod support;

use cairn_activities::providers::http::{post_stream, HttpSettings};
use cairn_activities::{ActivityContext, ErrorKind};
use futures_util::StreamExt;
use support::{Canned, FakeServer};

#[tokio::test]
async fn streams_bodies_and_classifies_errors_with_retry_after() {
    let server = FakeServer::start().await;
    server.push(Canned::sse("data: one\n\ndata: two\n\n"));
    let mut limited = Canned::error(429, r#"{"error":{"message":"slow down"}}"#);
    limited.headers.push(("retry-after".into(), "3".into()));
    server.push(limited);
    let settings = HttpSettings::new(server.base_url(), Some("k".into()));
    let ctx = ActivityContext::detached();
    let mut body = Vec::new();
    let mut stream = post_stream(
        &settings,
        "test",
        "/v1/x",
        &[("x-api-key", "k".into())],
        b"{}".to_vec(),
        &ctx,
    )
    .await
    .unwrap();
    while let Some(chunk) = stream.next().await {
        body.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(body, b"data: one\n\ndata: two\n\n");
    let err = post_stream(&settings, "test", "/v1/x", &[], b"{}".to_vec(), &ctx)
        .await
        .err()
        .unwrap();
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    assert_eq!(err.retry_after_ms(), Some(3000));
    assert_eq!(err.to_string(), "HTTP 429: slow down");
    let requests = server.requests();
    assert_eq!(requests[0].path, "/v1/x");
    assert_eq!(requests[0].headers["x-api-key"], "k");
}
