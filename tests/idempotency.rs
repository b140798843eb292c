//! `Idempotency-Key` on the routes that start a turn, against `cairn server` as a real
//! process on loopback: a resend records nothing and is answered as the first request was
//! (across a restart too), another message under a used key is refused (422), a bad key is
//! refused naming the header, and a create without a session id gets one derived from its
//! key so that its resend finds the session.

use crate::server::{history, kinds, script, send_with_headers, wait_turn, Answer, Server};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// A POST of `body` under `key`.
async fn post_keyed(http: &reqwest::Client, url: String, key: &str, body: Value) -> Answer {
    send_with_headers(
        http,
        Method::POST,
        url,
        None,
        &[("Idempotency-Key", key)],
        Some(body),
    )
    .await
}

#[tokio::test]
async fn a_resent_request_under_its_key_starts_no_second_turn_and_gets_the_first_answer() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["One.", "Two.", "Three."]);
    let http = reqwest::Client::new();
    let mut server = Server::start(&dir.path().join("store"), &["--local-workers", "1"]);
    let create = json!({"model": model, "message": {"text": "one"}});

    // A create without a session id: the id comes from the key, and the resend finds it.
    let created = post_keyed(
        &http,
        server.url("/v1/sessions?wait_ms=30000"),
        "create-1",
        create.clone(),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let id = created.body["session_id"].as_str().unwrap().to_owned();
    assert!(id.starts_with('k') && id.len() == 33, "{id}");
    assert_eq!(created.body["turn"], 1);
    assert_eq!(
        created.body["outcome"]["answer"], "One.",
        "{}",
        created.body
    );
    let recorded = history(&http, &server, None, &id).await;
    let resent = post_keyed(
        &http,
        server.url("/v1/sessions?wait_ms=30000"),
        "create-1",
        create.clone(),
    )
    .await;
    assert_eq!(resent.status, StatusCode::CREATED, "{}", resent.body);
    assert_eq!(resent.body, created.body, "answered as the first was");
    assert_eq!(history(&http, &server, None, &id).await, recorded);
    // The same key with another first message: the session is someone else's start.
    let other = post_keyed(
        &http,
        server.url("/v1/sessions"),
        "create-1",
        json!({"model": model, "message": {"text": "not one"}}),
    )
    .await;
    assert_eq!(other.status, StatusCode::CONFLICT, "{}", other.body);
    assert_eq!(other.code(), "conflict");

    // A message under a key: the resend gets the same turn and outcome, nothing recorded.
    let url = server.url(&format!("/v1/sessions/{id}/messages?wait_ms=30000"));
    let sent = post_keyed(&http, url.clone(), "m-2", json!({"text": "two"})).await;
    assert_eq!(sent.status, StatusCode::OK, "{}", sent.body);
    assert_eq!(sent.body["turn"], 2);
    assert_eq!(sent.body["outcome"]["answer"], "Two.", "{}", sent.body);
    let recorded = history(&http, &server, None, &id).await;
    let resent = post_keyed(&http, url.clone(), "m-2", json!({"text": "two"})).await;
    assert_eq!(resent.status, StatusCode::OK, "{}", resent.body);
    assert_eq!(resent.body, sent.body);
    assert_eq!(history(&http, &server, None, &id).await, recorded);
    // The key is in the message's event, and only there.
    let keyed: Vec<(&str, Option<&str>)> = recorded
        .iter()
        .filter(|e| e["kind"] == "user_message")
        .map(|e| {
            let message = &e["event"]["user_message"];
            (
                message["text"].as_str().unwrap(),
                message["idempotency_key"].as_str(),
            )
        })
        .collect();
    assert_eq!(keyed, [("one", Some("create-1")), ("two", Some("m-2"))]);

    // Another message under a used key.
    let reused = post_keyed(&http, url.clone(), "m-2", json!({"text": "three"})).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reused.body
    );
    assert_eq!(reused.code(), "idempotency_key_reused");
    let message = reused.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("\"m-2\"") && message.contains("turn 2"),
        "{message}"
    );
    // Through the remote client, the typed error the in-process client gives.
    let remote = cairn_remote::connect(&server.url(""), None).unwrap();
    let three = cairn_runtime::wire::SendMessage {
        text: "three".into(),
        model: None,
        media: Vec::new(),
        tool_choice: None,
    };
    match remote.send_idempotent(&id, "m-2", three).await {
        Err(cairn_runtime::Error::IdempotencyKeyReused {
            session_id,
            key,
            turn,
        }) => assert_eq!(
            (session_id.as_str(), key.as_str(), turn),
            (id.as_str(), "m-2", 2)
        ),
        other => panic!("expected IdempotencyKeyReused, got {other:?}"),
    }
    // Keys that are none, refused naming the header, with nothing recorded.
    for key in ["a b", &"k".repeat(256)] {
        let refused = post_keyed(&http, url.clone(), key, json!({"text": "three"})).await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.body);
        assert_eq!(refused.code(), "invalid_request");
        let message = refused.body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("Idempotency-Key: "), "{message}");
    }
    assert_eq!(history(&http, &server, None, &id).await, recorded);

    // The keys are in the history: after a SIGKILL and a restart, a resend still finds its
    // turn, and a new key starts the next one.
    server.kill().await;
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "1"]);
    let url = server.url(&format!("/v1/sessions/{id}/messages?wait_ms=30000"));
    let resent = post_keyed(&http, url.clone(), "m-2", json!({"text": "two"})).await;
    assert_eq!(resent.status, StatusCode::OK, "{}", resent.body);
    assert_eq!(resent.body, sent.body);
    let third = post_keyed(&http, url, "m-3", json!({"text": "three"})).await;
    assert_eq!(third.status, StatusCode::OK, "{}", third.body);
    assert_eq!(third.body["turn"], 3);
    assert_eq!(third.body["outcome"]["answer"], "Three.");
    let events = history(&http, &server, None, &id).await;
    assert_eq!(
        kinds(&events)
            .iter()
            .filter(|kind| **kind == "user_message")
            .count(),
        3
    );
    assert_eq!(
        wait_turn(&http, &server, None, &id, 3).await["answer"],
        "Three."
    );
}

/// The remote client across a server SIGKILLed while it holds a request that started a turn:
/// the broken connection is retried under the same key until a restarted server answers it,
/// which finds the session and its message recorded, starts nothing, and answers with the
/// turn's outcome once a worker has run it. The turn runs once.
#[tokio::test]
async fn a_client_resends_across_a_server_killed_mid_request_and_the_turn_runs_once() {
    let dir = tempfile::tempdir().unwrap();
    script(dir.path(), &["One.", "Two."]);
    let model = cairn_ledger::ModelSpec::new(
        "scripted",
        dir.path().join("script.json").display().to_string(),
    );
    let store = dir.path().join("store");
    // No worker: the turn waits, and so does the request that started it.
    let mut server = Server::start(&store, &["--local-workers", "0"]);
    let base = server.url("");
    let listen = base.trim_start_matches("http://").to_owned();
    let client = cairn_remote::connect(&base, None)
        .unwrap()
        .with_stall_warning(std::time::Duration::from_secs(30));
    let mut options = cairn_runtime::SessionOptions::new(model, Vec::new());
    options.session_id = Some("killed".into());
    let run = tokio::spawn(async move { client.start_session_and_run(options, "one").await });
    let http = reqwest::Client::new();
    let mut recorded = false;
    for _ in 0..200 {
        let answer = http
            .get(server.url("/v1/sessions/killed"))
            .send()
            .await
            .unwrap();
        if answer.status() == StatusCode::OK {
            recorded = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert!(recorded, "the session was not created");
    assert!(!run.is_finished(), "the request still waits for its turn");
    server.kill().await;
    let server = Server::start_on(&listen, &store, &["--local-workers", "1"]);
    let (session, outcome) = tokio::time::timeout(std::time::Duration::from_secs(60), run)
        .await
        .expect("the client got its answer")
        .expect("the client task ran")
        .expect("the turn's outcome");
    assert_eq!(session, "killed");
    match outcome {
        cairn_runtime::TurnOutcome::Completed { turn, answer, .. } => {
            assert_eq!((turn, answer.as_str()), (1, "One."))
        }
        other => panic!("expected turn 1 completed, got {other:?}"),
    }
    let events = history(&http, &server, None, "killed").await;
    let kinds = kinds(&events);
    assert_eq!(
        kinds
            .iter()
            .filter(|kind| ["session_started", "user_message"].contains(kind))
            .count(),
        2,
        "{kinds:?}"
    );
}
