//! Transcripts sent as what a worker lacks, against `cairn server` as a real process on
//! loopback: the protocol by hand (a worker that lists the transcripts it keeps is sent only
//! the messages after them, on the lease and both report routes; a lineage or a count that
//! does not fit, or no header, gets the transcript whole; a bad header is refused), and a
//! remote worker pool whose model sees every call's transcript whole while a long message
//! crosses the wire once.

use crate::server::{history, kinds, send, wait_turn, Server};
use crate::worker_support::{
    self, answer_report, assert_lease_refused, assert_turn_answers_3, calculator_turn, input_again,
    lease_one, model_input, report_and_take_next, report_in_batch_and_take_next, start_turn,
    tool_result_report, tool_use_report, ProxiedPool,
};
use async_trait::async_trait;
use cairn_activities::{
    ActivityContext, Calculator, DeltaSink, Error as ActivityError, ModelProvider, ModelRequest,
    Tool,
};
use cairn_ledger::{ModelResponse, ModelSpec, Part, ToolSpec, Transcript};
use cairn_runtime::SessionOptions;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

const HEADER: &str = "cairn-transcripts";

/// A user message long enough for a worker to keep its transcript.
fn long_text() -> String {
    "a long message that a worker keeps; ".repeat(400)
}

/// A session offering the calculator, its first turn asking `text`.
async fn start(http: &reqwest::Client, server: &Server, id: &str, text: &str) {
    let tools = json!([serde_json::to_value(Calculator.spec()).unwrap()]);
    start_turn(http, server, id, &tools, text).await;
}

/// `POST path` with `body`, listing `transcripts` (none: no header).
async fn worker_post(
    http: &reqwest::Client,
    server: &Server,
    path: &str,
    transcripts: Option<&str>,
    body: Value,
) -> crate::server::Answer {
    worker_support::worker_post(http, server, path, transcripts.map(|v| (HEADER, v)), body).await
}

/// The first task a lease request listing `transcripts` gets, waiting for it.
async fn lease_listing(
    http: &reqwest::Client,
    server: &Server,
    transcripts: Option<&str>,
) -> Value {
    lease_one(http, server, transcripts.map(|v| (HEADER, v))).await
}

fn messages(input: &Value) -> &Vec<Value> {
    input["transcript"]["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("a transcript: {input}"))
}

#[tokio::test]
async fn a_worker_that_keeps_transcripts_is_sent_only_the_messages_it_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    let long = long_text();
    start(&http, &server, "kept", &long).await;

    // A worker that keeps transcripts and holds none: the transcript whole, with its
    // lineage (no compaction yet: 0).
    let first = lease_listing(&http, &server, Some("")).await;
    let input = model_input(&first);
    assert_eq!(input["transcript_lineage"], 0, "{first}");
    assert!(input.get("transcript_left_out").is_none(), "{first}");
    let held = messages(input).len();
    assert!(input["transcript"].to_string().contains(&long));

    // Its report, listing the transcript, leases the tool task.
    let listed = format!("kept=0.{held}");
    let header = Some((HEADER, listed.as_str()));
    let tool_task = report_and_take_next(&http, &server, header, &first, tool_use_report()).await;
    assert_eq!(tool_task["lease"]["kind"], "tool", "{tool_task}");

    // The tool's result in a batch, listing it among others: the next model task carries
    // only the two messages after those held.
    let among_others = format!("other=0.1, {listed}");
    let second = report_in_batch_and_take_next(
        &http,
        &server,
        Some((HEADER, &among_others)),
        &tool_task,
        tool_result_report(),
    )
    .await;
    let input = model_input(&second);
    assert_eq!(input["transcript_left_out"], held, "{second}");
    assert_eq!(input["transcript_lineage"], 0, "{second}");
    let came = messages(input);
    assert_eq!(came.len(), 2, "{second}");
    assert_eq!(came[0]["role"], "assistant", "{second}");
    assert!(came[0].to_string().contains("toolu_1"), "{second}");
    assert!(came[1].to_string().contains("tool_result"), "{second}");
    assert!(!input.to_string().contains(&long), "{second}");

    // What the lease runs, fetched again (a worker that let the transcript go): whole.
    let again = input_again(&http, &server, &second).await;
    let whole = &again["model"];
    assert_eq!(messages(whole).len(), held + 2, "{whole}");
    assert!(whole.get("transcript_left_out").is_none(), "{whole}");
    assert_eq!(
        &messages(whole)[held..],
        &came[..],
        "the left-out ones are the first"
    );
    assert!(whole["transcript"].to_string().contains(&long));

    // The answer lands as without the header.
    let done = worker_post(
        &http,
        &server,
        "/v1/worker/report",
        Some(&format!("kept=0.{}", held + 2)),
        json!({"lease": second["lease"], "report": answer_report()}),
    )
    .await;
    assert_eq!(done.status, StatusCode::NO_CONTENT, "{}", done.body);
    let outcome = wait_turn(&http, &server, None, "kept", 1).await;
    assert_eq!(outcome["answer"], "3", "{outcome}");
    assert_eq!(
        kinds(&history(&http, &server, None, "kept").await).len(),
        9,
        "the turn ran as without the header"
    );

    // The next turn's first task, by a lease listing the transcript as it was: the new
    // messages only.
    let again = send(
        &http,
        Method::POST,
        server.url("/v1/sessions/kept/messages"),
        None,
        Some(json!({"text": "again"})),
    )
    .await;
    assert!(again.status.is_success(), "{}", again.body);
    let third = lease_listing(&http, &server, Some(&format!("kept=0.{}", held + 2))).await;
    let input = model_input(&third);
    assert_eq!(input["transcript_left_out"], held + 2, "{third}");
    let came = messages(input);
    assert_eq!(came.len(), 2, "the answer and the new message: {third}");
    assert!(came[1].to_string().contains("again"), "{third}");

    // Whole when the lineage differs, when more are listed than the transcript has, and
    // without the header (the lineage still named).
    for (id, header) in [
        ("lineage", Some("lineage=4.1")),
        ("more", Some("more=0.9")),
        ("plain", None),
    ] {
        start(&http, &server, id, &long).await;
        let task = lease_listing(&http, &server, header).await;
        let input = model_input(&task);
        assert_eq!(input["transcript_lineage"], 0, "{id}: {task}");
        assert!(input.get("transcript_left_out").is_none(), "{id}: {task}");
        assert!(input["transcript"].to_string().contains(&long), "{id}");
    }

    // A header that is not a list of kept transcripts is refused, naming it, and leases
    // nothing.
    start(&http, &server, "waiting", "1+2?").await;
    for bad in ["kept", "kept=0", "kept=0.1,", "bad id=0.1", "kept=x.1"] {
        assert_lease_refused(&http, &server, (HEADER, bad), "Cairn-Transcripts").await;
    }
    let waiting = lease_listing(&http, &server, Some("")).await;
    assert_eq!(waiting["lease"]["id"]["session_id"], "waiting", "{waiting}");
    assert_eq!(
        waiting["lease"]["lease_attempt"], 1,
        "not leased before: {waiting}"
    );
}

/// A model that records the transcript of every call: it calls the calculator, then
/// answers once the tool's result is the last message.
#[derive(Default)]
struct TranscriptsSeen {
    calls: Mutex<Vec<Transcript>>,
}

#[async_trait]
impl ModelProvider for TranscriptsSeen {
    fn provider(&self) -> &str {
        "seen"
    }

    async fn call(
        &self,
        request: &ModelRequest,
        _deltas: &dyn DeltaSink,
        _context: &ActivityContext,
    ) -> Result<ModelResponse, ActivityError> {
        // A copy: holding the call's own would make the worker copy its next one.
        self.calls
            .lock()
            .unwrap()
            .push((*request.transcript).clone());
        let answered = request
            .transcript
            .messages
            .last()
            .is_some_and(|m| matches!(m.parts.first(), Some(Part::ToolResult(_))));
        let id = format!("toolu_{}", request.transcript.messages.len());
        Ok(calculator_turn(answered, id))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_workers_model_sees_every_transcript_whole_while_a_long_message_crosses_once() {
    let dir = tempfile::tempdir().unwrap();
    let seen = Arc::new(TranscriptsSeen::default());
    let mut proxied = ProxiedPool::start(dir.path(), seen.clone()).await;
    let client = proxied.client.clone();
    let tools: Arc<[ToolSpec]> = vec![Calculator.spec()].into();
    let model = ModelSpec::parse("scripted:unused.json").unwrap();
    let id = client
        .start_session(SessionOptions::new(model, tools))
        .await
        .unwrap();
    let long = long_text();
    for text in [long.as_str(), "again", "and again"] {
        assert_turn_answers_3(&client, &id, text).await;
    }
    proxied.stop().await;
    let calls = seen.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 6, "two model calls a turn");
    // Each call saw the session's transcript as it stood: the first messages of the last.
    let transcript = client.transcript(&id).await.unwrap();
    for (i, call) in calls.iter().enumerate() {
        let len = call.messages.len();
        assert_eq!(
            call.messages[..],
            transcript.messages[..len],
            "call {i} saw the transcript whole"
        );
    }
    let lengths: Vec<usize> = calls.iter().map(|c| c.messages.len()).collect();
    assert_eq!(lengths, [1, 3, 5, 7, 9, 11]);
    // The long message crossed to the worker once: with the first model task; the five
    // other calls were sent the messages after those the worker kept.
    let received = proxied.received();
    assert_eq!(received.matches(&long).count(), 1);
    assert!(received.contains("\"transcript_left_out\":"));
}
