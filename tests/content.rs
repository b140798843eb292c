//! Images and documents end to end: a user message with an image and a PDF and a tool result
//! with an image through the scripted provider, live, after a restart and as a full replay;
//! bad media refused before anything is written; the HTTP API (a real server process) and
//! `cairn run --attach` (the real binary).

use crate::server::{openapi_document, script, send, wait_turn, Server};
use crate::support::{cairn_command, reopen_sled, TestHost};
use cairn_activities::ToolRegistry;
use cairn_ledger::file_versions::sha256_hex;
use cairn_ledger::{validate_transcript, Media, MediaKind, MediaSource, Part};
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::*;
use cairn_workers::{Activities, StandardModels, WorkerConfig};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

/// A PNG signature and IHDR start: enough for the magic-number checks.
const PNG_BYTES: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";
const PNG_BASE64: &str = "iVBORw0KGgoAAAANSUhEUg==";
const PDF_BYTES: &[u8] = b"%PDF-1.4\n";
const PDF_BASE64: &str = "JVBERi0xLjQK";

fn host(store: Arc<dyn Store>, workdir: &Path) -> TestHost {
    TestHost::start_with_activities(
        store,
        Arc::new(SystemClock),
        Activities {
            models: Arc::new(StandardModels::new()),
            tools: Arc::new(ToolRegistry::builtin(workdir)),
        },
        WorkerConfig {
            concurrency: 2,
            lease_ms: 2_000,
            poll_interval_ms: 5,
            progress_interval_ms: None,
            ..WorkerConfig::default()
        },
    )
}

fn pdf() -> Media {
    Media {
        kind: MediaKind::Document,
        source: MediaSource::Base64 {
            media_type: "application/pdf".into(),
            data: PDF_BASE64.into(),
        },
        name: Some("report.pdf".into()),
    }
}

#[tokio::test]
async fn a_user_image_and_a_tool_result_image_live_after_a_restart_and_in_replay() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    let workdir = dir.path().join("work");
    std::fs::create_dir_all(&workdir).unwrap();
    std::fs::write(workdir.join("shot.png"), PNG_BYTES).unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        json!({"responses": [
            {"parts": [{"type": "tool_use", "id": "r1", "name": "read_file", "input": {"path": "shot.png"}}]},
            {"parts": [{"type": "text", "text": "both show a header"}]}
        ]})
        .to_string(),
    )
    .unwrap();

    let first = host(Arc::new(SledStore::open(&data).unwrap()), &workdir);
    let mut options = first.session_options(&script, "media");
    options.system_prompt = None;
    let session = first.client.start_session(options).await.unwrap();
    // Bad media are refused before anything is written.
    let before = first.client.history(&session).await.unwrap().len();
    let refused = first
        .client
        .send_with_media(
            &session,
            "look",
            vec![Media::image_base64("image/png", "not base64!")],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::InvalidEvent { reason, .. }
            if reason.contains("media 0") && reason.contains("not valid base64")),
        "{refused:?}"
    );
    assert_eq!(first.client.history(&session).await.unwrap().len(), before);

    let image = Media::image_base64("image/png", PNG_BASE64);
    let turn = first
        .client
        .send_with_media(&session, "what do these show?", vec![image, pdf()])
        .await
        .unwrap();
    let outcome = first.client.wait_turn(&session, turn).await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "both show a header"),
        "{outcome:?}"
    );
    let live = first.client.transcript(&session).await.unwrap();
    first.shutdown().await;

    // The ledger, byte for byte: the media ahead of the text, the tool's image as a block.
    let sha = sha256_hex(PNG_BYTES);
    let expected = format!(
        concat!(
            r#"{{"messages":[{{"role":"user","parts":["#,
            r#"{{"media":{{"kind":"image","source":{{"base64":{{"media_type":"image/png","data":"{png}"}}}}}}}},"#,
            r#"{{"media":{{"kind":"document","source":{{"base64":{{"media_type":"application/pdf","data":"{pdf}"}}}},"name":"report.pdf"}}}},"#,
            r#"{{"text":{{"text":"what do these show?"}}}}]}},"#,
            r#"{{"role":"assistant","parts":[{{"tool_use":{{"id":"r1","name":"read_file","arguments":"{{\"path\":\"shot.png\"}}"}}}}],"provenance":{{"provider":"scripted","model":"scripted"}}}},"#,
            r#"{{"role":"user","parts":[{{"tool_result":{{"tool_use_id":"r1","content":{{"blocks":["#,
            r#"{{"text":{{"text":"shot.png: image/png, 16 bytes, sha256 {sha}"}}}},"#,
            r#"{{"media":{{"kind":"image","source":{{"base64":{{"media_type":"image/png","data":"{png}"}}}}}}}}]}},"is_error":false}}}}]}},"#,
            r#"{{"role":"assistant","parts":[{{"text":{{"text":"both show a header"}}}}],"provenance":{{"provider":"scripted","model":"scripted"}}}}]}}"#
        ),
        png = PNG_BASE64,
        pdf = PDF_BASE64,
        sha = sha,
    );
    assert_eq!(String::from_utf8(live.canonical_json()).unwrap(), expected);
    validate_transcript(&live).unwrap();

    // A new process over the same store: the persisted history folds to the same bytes.
    let store = reopen_sled(&data).await;
    let second = host(Arc::new(store), &workdir);
    let history = second.client.history(&session).await.unwrap();
    let replayed = replay(&session, &history).unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        live.canonical_json()
    );
    // The persisted user message carries the media; a text-only message has no media field.
    let user = history.iter().find(|e| e.kind == "user_message").unwrap();
    let bytes = codec::encode(user).unwrap();
    assert_eq!(codec::decode(&session, user.seq, &bytes).unwrap(), *user);
    let Event::UserMessage { media, text, .. } = &user.event else {
        unreachable!()
    };
    assert_eq!(text, "what do these show?");
    assert_eq!(media.len(), 2);
    let text_only = Event::UserMessage {
        idempotency_key: None,
        turn: 2,
        text: "hi".into(),
        model: None,
        media: Vec::new(),
        tool_choice: None,
    };
    let encoded = serde_json::to_string(&text_only).unwrap();
    assert_eq!(encoded, r#"{"user_message":{"turn":2,"text":"hi"}}"#);
    second.shutdown().await;
}

#[tokio::test]
async fn the_http_api_takes_media_and_renders_them_per_provider() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), &["an image and a PDF", "a cat"]);
    let server = Server::start(&dir.path().join("store"), &["--local-workers", "1"]);
    let http = reqwest::Client::new();
    let created = send(
        &http,
        Method::POST,
        server.url("/v1/sessions"),
        None,
        Some(json!({"session_id": "m1", "model": model})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let image = json!({"kind": "image", "source": {"base64": {"media_type": "image/png", "data": PNG_BASE64}}});
    let url_pdf = json!({"kind": "document", "source": {"url": {"url": "https://example.com/a.pdf"}}, "name": "a.pdf"});

    // Bad media: a typed 400 naming the media, and no turn.
    for (bad, needle) in [
        (
            json!({"kind": "image", "source": {"base64": {"media_type": "image/tiff", "data": PNG_BASE64}}}),
            "media[0]: image media type \"image/tiff\" is not supported",
        ),
        (
            json!({"kind": "image", "source": {"base64": {"media_type": "", "data": PNG_BASE64}}}),
            "media[0]: image has an empty media type",
        ),
        (
            json!({"kind": "image", "source": {"url": {"url": "ftp://example.com/x.png"}}}),
            "is not an http(s) URL",
        ),
    ] {
        let answer = send(
            &http,
            Method::POST,
            server.url("/v1/sessions/m1/messages"),
            None,
            Some(json!({"text": "look", "media": [bad]})),
        )
        .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.body);
        assert_eq!(answer.code(), "invalid_request", "{}", answer.body);
        let message = answer.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message}");
    }

    let started = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/m1/messages"),
        None,
        Some(json!({"text": "", "media": [image, url_pdf]})),
    )
    .await;
    assert_eq!(started.status, StatusCode::ACCEPTED, "{}", started.body);
    assert_eq!(started.body["turn"], 1);
    let outcome = wait_turn(&http, &server, None, "m1", 1).await;
    assert_eq!(outcome["answer"], "an image and a PDF", "{outcome}");

    let ledger = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/m1/transcript"),
        None,
        None,
    )
    .await;
    assert_eq!(
        ledger.body["messages"][0],
        json!({"role": "user", "parts": [{"media": image}, {"media": url_pdf}]})
    );
    let anthropic = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/m1/transcript?as=anthropic&model=claude-x"),
        None,
        None,
    )
    .await;
    assert_eq!(
        anthropic.body["messages"][0]["content"],
        json!([
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_BASE64}},
            {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}, "title": "a.pdf"},
        ]),
        "{}",
        anthropic.body
    );
    // Bedrock takes no URL source: the rendering is refused, saying why.
    let bedrock = send(
        &http,
        Method::GET,
        server.url("/v1/sessions/m1/transcript?as=bedrock&model=anthropic.claude-x"),
        None,
        None,
    )
    .await;
    assert_eq!(bedrock.status, StatusCode::CONFLICT, "{}", bedrock.body);
    assert!(bedrock.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not from a URL"));
    // The remote client sends media through the same route.
    let remote = cairn_remote::connect(&server.url(""), None).unwrap();
    let cat = Media::url(MediaKind::Image, "https://example.com/cat.jpg");
    let turn = remote
        .send_with_media("m1", "and this?", vec![cat.clone()])
        .await
        .unwrap();
    assert_eq!(turn, 2);
    let outcome = remote.wait_turn("m1", 2).await.unwrap();
    assert!(
        matches!(outcome, TurnOutcome::Completed { ref answer, .. } if answer == "a cat"),
        "{outcome:?}"
    );
    let transcript = remote.transcript("m1").await.unwrap();
    assert_eq!(
        transcript.messages[2].parts,
        vec![Part::Media(cat), Part::text("and this?")]
    );
    // Bad media from the remote client: refused by the server, typed, nothing recorded.
    let before = remote.history("m1").await.unwrap().len();
    let refused = remote
        .send_with_media("m1", "x", vec![Media::image_base64("image/png", "%%")])
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("not valid base64"),
        "{refused}"
    );
    assert_eq!(remote.history("m1").await.unwrap().len(), before);
    // The OpenAPI document describes the media of a message.
    let openapi = openapi_document(&http, &server).await;
    let schemas = &openapi["components"]["schemas"];
    assert!(
        schemas["SendMessage"]["properties"]["media"].is_object(),
        "{}",
        schemas["SendMessage"]
    );
    for name in ["Media", "ImageSource", "DocumentSource"] {
        assert!(schemas[name].is_object(), "no schema {name}");
    }
}

fn run_with(args: &[&str]) -> std::process::Output {
    cairn_command().args(args).output().unwrap()
}

fn history(data: &str, session: &str) -> Vec<Value> {
    let out = run_with(&["history", session, "--json", "--data", data]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn cairn_run_attach_sends_files_and_urls_and_refuses_bad_ones_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let script_path = dir.path().join("script.json");
    std::fs::write(
        &script_path,
        json!({"responses": [{"parts": [{"type": "text", "text": "seen"}]}]}).to_string(),
    )
    .unwrap();
    let model = format!("scripted:{}", script_path.display());
    let png = dir.path().join("shot.png");
    std::fs::write(&png, PNG_BYTES).unwrap();
    let pdf = dir.path().join("report.pdf");
    std::fs::write(&pdf, PDF_BYTES).unwrap();
    let fake_png = dir.path().join("fake.png");
    std::fs::write(&fake_png, b"not a png").unwrap();
    let notes = dir.path().join("notes.docx");
    std::fs::write(&notes, b"x").unwrap();
    let data = dir.path().join("store");
    let data = data.to_str().unwrap();
    let work = dir.path().to_str().unwrap();

    // Refused before anything is written: no store appears.
    for (bad, needle) in [
        (fake_png.to_str().unwrap(), "is not a image/png image"),
        (notes.to_str().unwrap(), "unsupported file type"),
        ("missing.png", "missing.png"),
        ("https://example.com/picture", "cannot tell the URL's kind"),
    ] {
        let out = run_with(&[
            "run",
            "--data",
            data,
            "--model",
            &model,
            "--workdir",
            work,
            "--attach",
            bad,
            "look",
        ]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{bad}: {stderr}");
        assert!(!Path::new(data).exists(), "{bad}: a store was made");
    }

    let out = run_with(&[
        "run",
        "--data",
        data,
        "--model",
        &model,
        "--workdir",
        work,
        "--session",
        "a1",
        "--attach",
        png.to_str().unwrap(),
        "--attach",
        pdf.to_str().unwrap(),
        "--attach",
        "https://example.com/cat.jpg?size=2",
        "what are these?",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("seen"));
    let events = history(data, "a1");
    let user = events
        .iter()
        .find(|e| e["kind"] == "user_message")
        .expect("a user message");
    assert_eq!(
        user["event"]["user_message"],
        json!({"turn": 1, "text": "what are these?", "media": [
            {"kind": "image", "source": {"base64": {"media_type": "image/png", "data": PNG_BASE64}}, "name": "shot.png"},
            {"kind": "document", "source": {"base64": {"media_type": "application/pdf", "data": PDF_BASE64}}, "name": "report.pdf"},
            {"kind": "image", "source": {"url": {"url": "https://example.com/cat.jpg?size=2"}}},
        ]})
    );
    let listed = run_with(&["history", "a1", "--data", data]);
    assert!(
        String::from_utf8_lossy(&listed.stdout)
            .contains(r#"turn=1 "what are these?" media=[image/png,application/pdf,url]"#),
        "{}",
        String::from_utf8_lossy(&listed.stdout)
    );
    let replay = run_with(&["replay", "--data", data, "a1"]);
    assert!(
        replay.status.success(),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );
}
