//! Tool sets sent once per worker, against `cairn server` as a real process on loopback: the
//! protocol by hand (a worker that lists the sets it keeps gets each set once, by digest, on
//! the lease and both report routes; one that does not gets the tools every time; a bad
//! header is refused), and a remote worker pool whose model sees every call's tools whole
//! while the server leaves them out.

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
use cairn_ledger::{JsonText, ModelResponse, ModelSpec, ToolSpec};
use cairn_runtime::SessionOptions;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

const HEADER: &str = "cairn-tool-sets";

/// A tool spec with a long description, as a coding agent's are.
fn long_spec(name: &str) -> ToolSpec {
    ToolSpec {
        name: name.to_owned(),
        description: format!("{name}: ").repeat(200),
        input_schema: JsonText::parse(
            r#"{"type":"object","properties":{"path":{"type":"string"}}}"#,
        )
        .unwrap(),
    }
}

/// `POST path` with `body`, listing `tool_sets` (none: no header).
async fn worker_post(
    http: &reqwest::Client,
    server: &Server,
    path: &str,
    tool_sets: Option<&str>,
    body: Value,
) -> crate::server::Answer {
    worker_support::worker_post(http, server, path, tool_sets.map(|v| (HEADER, v)), body).await
}

/// The first task a lease request listing `tool_sets` gets, waiting for it.
async fn lease_listing(http: &reqwest::Client, server: &Server, tool_sets: &str) -> Value {
    lease_one(http, server, Some((HEADER, tool_sets))).await
}

#[tokio::test]
async fn a_worker_that_keeps_tool_sets_is_sent_each_set_once_and_others_every_time() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("store"), &[]);
    let http = reqwest::Client::new();
    let calculator = serde_json::to_value(Calculator.spec()).unwrap();
    let tools = json!([calculator, serde_json::to_value(long_spec("read")).unwrap()]);
    start_turn(&http, &server, "kept", &tools, "1+2?").await;

    // A worker that keeps sets and holds none yet: the tools whole, with their digest.
    let first = &lease_listing(&http, &server, "").await;
    let input = model_input(first);
    assert_eq!(input["tools"], tools, "{first}");
    assert!(input.get("tools_omitted").is_none(), "{first}");
    let digest = input["tools_digest"].as_str().expect("a digest").to_owned();
    assert!(cairn_runtime::wire::is_tool_set_digest(&digest), "{digest}");

    // Its report, listing the set, leases the tool task: no tool set there.
    let header = Some((HEADER, digest.as_str()));
    let tool_task = report_and_take_next(&http, &server, header, first, tool_use_report()).await;
    assert_eq!(tool_task["lease"]["kind"], "tool", "{tool_task}");
    assert!(tool_task["input"]["tool"].get("tools_digest").is_none());

    // The tool's result in a batch, listing the set among others: the next model task
    // leaves the tools out and names them.
    let among_others = format!("{}, {digest}", "0".repeat(32));
    let second = report_in_batch_and_take_next(
        &http,
        &server,
        Some((HEADER, &among_others)),
        &tool_task,
        tool_result_report(),
    )
    .await;
    let input = model_input(&second);
    assert_eq!(input["tools"], json!([]), "{second}");
    assert_eq!(input["tools_omitted"], true, "{second}");
    assert_eq!(input["tools_digest"], digest.as_str(), "{second}");
    assert!(
        input["transcript"].to_string().contains("toolu_1"),
        "the transcript still goes whole: {second}"
    );
    // What the lease runs, fetched again (a worker that let the set go): whole.
    let again = input_again(&http, &server, &second).await;
    assert_eq!(again["model"]["tools"], tools, "{again}");
    assert!(again["model"].get("tools_digest").is_none());
    let done = send(
        &http,
        Method::POST,
        server.url("/v1/worker/report"),
        None,
        Some(json!({"lease": second["lease"], "report": answer_report()})),
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

    // Another session with the same tools: the same digest, so a worker holding it is
    // not sent them; a worker that does not send the header gets them whole, as before.
    start_turn(&http, &server, "same-tools", &tools, "1+2?").await;
    let task = &lease_listing(&http, &server, &digest).await;
    assert_eq!(model_input(task)["tools"], json!([]), "{task}");
    assert_eq!(model_input(task)["tools_digest"], digest.as_str(), "{task}");
    let tool_task = report_and_take_next(&http, &server, None, task, tool_use_report()).await;
    let task = &report_and_take_next(&http, &server, None, &tool_task, tool_result_report()).await;
    assert_eq!(model_input(task)["tools"], tools, "{task}");
    assert!(model_input(task).get("tools_digest").is_none(), "{task}");
    assert!(model_input(task).get("tools_omitted").is_none(), "{task}");

    // A session with other tools: another digest.
    start_turn(&http, &server, "other-tools", &json!([calculator]), "1+2?").await;
    let task = &lease_listing(&http, &server, &digest).await;
    assert_eq!(model_input(task)["tools"], json!([calculator]), "{task}");
    let other_digest = model_input(task)["tools_digest"].as_str().expect("digest");
    assert_ne!(other_digest, digest);

    // A header that lists no digests is refused, naming it, and leases nothing.
    for bad in [
        "not-a-digest",
        &format!("{digest},"),
        &digest.to_uppercase(),
    ] {
        assert_lease_refused(&http, &server, (HEADER, bad), "Cairn-Tool-Sets").await;
    }
    let idle = worker_post(
        &http,
        &server,
        "/v1/worker/lease",
        Some(""),
        json!({"max": 8, "wait_ms": 0, "lease_ms": 30000}),
    )
    .await;
    assert_eq!(idle.body["tasks"], json!([]), "{}", idle.body);
}

/// A model that records the tools of every call: first it calls the calculator, then it
/// answers.
#[derive(Default)]
struct ToolsSeen {
    calls: Mutex<Vec<Vec<ToolSpec>>>,
}

#[async_trait]
impl ModelProvider for ToolsSeen {
    fn provider(&self) -> &str {
        "seen"
    }

    async fn call(
        &self,
        request: &ModelRequest,
        _deltas: &dyn DeltaSink,
        _context: &ActivityContext,
    ) -> Result<ModelResponse, ActivityError> {
        self.calls.lock().unwrap().push(request.tools.to_vec());
        let answered = request.transcript.messages.len() > 2;
        Ok(calculator_turn(answered, "toolu_1".into()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_workers_model_sees_every_calls_tools_whole_while_each_set_crosses_once() {
    let dir = tempfile::tempdir().unwrap();
    let seen = Arc::new(ToolsSeen::default());
    let mut proxied = ProxiedPool::start(dir.path(), seen.clone()).await;
    let client = proxied.client.clone();
    let tools: Arc<[ToolSpec]> = vec![Calculator.spec(), long_spec("read")].into();
    let model = ModelSpec::parse("scripted:unused.json").unwrap();
    for session in 0..3 {
        // The third session's tools differ: a set of its own.
        let tools = if session == 2 {
            vec![Calculator.spec()].into()
        } else {
            tools.clone()
        };
        let id = client
            .start_session(SessionOptions::new(model.clone(), tools))
            .await
            .unwrap();
        assert_turn_answers_3(&client, &id, "1+2?").await;
    }
    proxied.stop().await;
    let calls = seen.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 6, "two model calls a turn");
    for (i, call) in calls.iter().enumerate() {
        let expected: Vec<ToolSpec> = if i >= 4 {
            vec![Calculator.spec()]
        } else {
            tools.to_vec()
        };
        assert_eq!(call, &expected, "call {i}");
    }
    // The long tool's description crossed once: with the first model task; the three other
    // calls with that set were sent its digest.
    let received = proxied.received();
    let marker = long_spec("read").description;
    assert_eq!(received.matches(&marker).count(), 1, "{received}");
}
