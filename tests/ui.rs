//! The history viewer (`/ui`) in headless Chromium, driven over WebDriver (chromedriver and
//! fantoccini) against `cairn server` as a real process on loopback, with sessions run offline
//! by the scripted provider on the server's own workers: the list and its filter, a session's
//! tool calls, a live event appearing without a reload, the state at a clicked event, and a
//! fork from one. Also the two routes the viewer added, through plain HTTP: bad seqs, unknown
//! sessions, fork refusals, and that reading a state writes nothing.
//!
//! Chromium and chromedriver come from `scripts/chromium` (Debian's packages; `CAIRN_CHROMIUM`
//! and `CAIRN_CHROMEDRIVER` name others). Without them these tests fail saying so: they are
//! never skipped.

use crate::service::{free_addr, scripted, start};
use cairn_devtools::process::Process;
use fantoccini::{Client as Browser, ClientBuilder, Locator};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long the page may take to show what a test waits for.
const PATIENCE: Duration = Duration::from_secs(60);

/// The calculator twice in parallel, an answer, and one more answer for a later turn.
const TOOL_SCRIPT: &str = r#"[
  {"parts": [
    {"type": "thinking", "text": "Two sums, in parallel.", "signature": "sig-ui-1"},
    {"type": "text", "text": "Let me compute both."},
    {"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "1+2"}},
    {"type": "tool_use", "id": "t2", "name": "calculator", "input": {"expression": "3*4"}}],
   "usage": {"input_tokens": 40, "output_tokens": 12}},
  {"parts": [{"type": "text", "text": "3 and 12"}], "usage": {"input_tokens": 60, "output_tokens": 4}},
  {"parts": [{"type": "text", "text": "Still 3 and 12."}], "usage": {"input_tokens": 70, "output_tokens": 5}}
]"#;

/// The ids of the list's visible rows, once exactly one is visible.
const ONE_ROW_SHOWN: &str = "const shown = [...document.querySelectorAll('#sessions tr.session')]
         .filter((row) => !row.hidden).map((row) => row.dataset.id);
     return shown.length === 1 && shown;";

/// A server, the browser and an HTTP client for the API.
struct Viewer {
    dir: tempfile::TempDir,
    base: String,
    http: reqwest::Client,
    browser: Browser,
    // Dropped (killed) after the browser session is closed.
    _chromedriver: Process,
    _server: Process,
}

impl Viewer {
    /// `cairn server` with two local workers, and a headless Chromium session.
    async fn start() -> Viewer {
        let dir = tempfile::tempdir().expect("tempdir");
        let workdir = dir.path().join("work");
        std::fs::create_dir_all(&workdir).expect("workdir");
        let (server, url) = start(
            &[
                "server".into(),
                "--data".into(),
                dir.path().join("store").display().to_string(),
                "--listen".into(),
                free_addr(),
                "--local-workers".into(),
                "4".into(),
                "--workdir".into(),
                workdir.display().to_string(),
            ],
            "listening on",
        );
        let (chromedriver, browser) = browser().await;
        Viewer {
            dir,
            base: url,
            http: reqwest::Client::new(),
            browser,
            _chromedriver: chromedriver,
            _server: server,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn api(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut request = self.http.request(method, self.url(path));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("request");
        let status = response.status();
        let bytes = response.bytes().await.expect("body");
        let body = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "{path}: not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        (status, body)
    }

    /// Starts session `id` on a scripted model playing `responses` after `delay_ms`.
    async fn create(&self, id: &str, responses: &str, delay_ms: u64) {
        let model = scripted(self.dir.path(), &format!("{id}.json"), delay_ms, responses);
        let (status, body) = self
            .api(
                Method::POST,
                "/v1/sessions",
                Some(json!({
                    "session_id": id,
                    "model": {"provider": model.provider, "model": model.model},
                    "tools": [{"name": "calculator", "description": "Evaluates arithmetic.",
                               "input_schema": {"type": "object",
                                                "properties": {"expression": {"type": "string"}},
                                                "required": ["expression"]}}],
                })),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }

    /// Sends a message to `id`; returns the turn it started.
    async fn send(&self, id: &str, text: &str) -> u64 {
        let (status, body) = self
            .api(
                Method::POST,
                &format!("/v1/sessions/{id}/messages"),
                Some(json!({ "text": text })),
            )
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        body["turn"].as_u64().expect("turn")
    }

    /// Waits for turn `turn` of `id` to end; returns its outcome.
    async fn outcome(&self, id: &str, turn: u64) -> Value {
        for _ in 0..60 {
            let (status, body) = self
                .api(
                    Method::GET,
                    &format!("/v1/sessions/{id}/turns/{turn}?timeout_ms=1000"),
                    None,
                )
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
            if body["done"] == true {
                return body["outcome"].clone();
            }
        }
        panic!("turn {turn} of {id} did not end");
    }

    /// A session with one finished tool turn: two calculator calls and an answer.
    async fn tool_session(&self, id: &str) {
        self.create(id, TOOL_SCRIPT, 0).await;
        let turn = self.send(id, "What are 1+2 and 3*4?").await;
        let outcome = self.outcome(id, turn).await;
        assert_eq!(outcome["status"], "completed", "{outcome}");
        assert_eq!(outcome["answer"], "3 and 12", "{outcome}");
    }

    async fn history(&self, id: &str) -> Vec<Value> {
        let (status, body) = self
            .api(Method::GET, &format!("/v1/sessions/{id}/history"), None)
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body["events"].as_array().expect("events").clone()
    }

    /// Opens a viewer page and waits until its script has loaded what it shows.
    async fn open(&self, path: &str) {
        self.browser.goto(&self.url(path)).await.expect("goto");
        self.wait_for(
            &format!("{path} loaded"),
            "const main = document.getElementById('main');
             const error = document.querySelector('.error');
             if (error) return 'error: ' + error.textContent;
             return main && main.dataset.loaded === 'true';",
        )
        .await;
    }

    /// Runs `script` (a function body) in the page until it returns something truthy, and
    /// returns that; fails naming `what` after [`PATIENCE`], and at once on a string starting
    /// with `error: ` (an error the page shows).
    async fn wait_for(&self, what: &str, script: &str) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let value = self
                .browser
                .execute(script, Vec::new())
                .await
                .unwrap_or_else(|e| panic!("{what}: the script failed: {e}"));
            if let Some(error) = value.as_str().and_then(|s| s.strip_prefix("error: ")) {
                panic!("{what}: the page shows an error: {error}");
            }
            let truthy = match &value {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                Value::Array(a) => !a.is_empty(),
                _ => true,
            };
            if truthy {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not there after {PATIENCE:?}; the page shows:\n{}",
                self.page_text().await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What the page shows, for failure messages.
    async fn page_text(&self) -> String {
        self.browser
            .execute("return document.body.innerText;", Vec::new())
            .await
            .map(|v| v.as_str().unwrap_or_default().to_owned())
            .unwrap_or_else(|e| format!("(cannot read the page: {e})"))
    }

    /// The texts of the elements `selector` finds, in document order.
    async fn texts(&self, selector: &str) -> Vec<String> {
        let value = self
            .browser
            .execute(
                "return [...document.querySelectorAll(arguments[0])].map((e) => e.textContent);",
                vec![json!(selector)],
            )
            .await
            .expect("query");
        serde_json::from_value(value).expect("texts")
    }

    /// Saves a PNG of the window to the target directory's `ui-screenshots/NAME.png`, and
    /// with `CAIRN_UPDATE_SCREENSHOTS=1` to `docs/DOC_NAME` too.
    async fn screenshot(&self, name: &str, doc_name: &str) {
        let png = self.browser.screenshot().await.expect("screenshot");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        let dir = screenshot_dir();
        std::fs::create_dir_all(&dir).expect("screenshot dir");
        std::fs::write(dir.join(format!("{name}.png")), &png).expect("write screenshot");
        if std::env::var("CAIRN_UPDATE_SCREENSHOTS").is_ok_and(|v| v == "1") {
            let doc = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("docs")
                .join(doc_name);
            std::fs::write(&doc, &png).expect("write the docs screenshot");
        }
    }

    async fn close(self) {
        self.browser
            .close()
            .await
            .expect("close the browser session");
    }
}

/// `ui-screenshots/` in the target directory (`CARGO_TARGET_DIR` when set).
fn screenshot_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("ui-screenshots")
}

/// Chromium's and chromedriver's executables: `CAIRN_CHROMIUM`/`CAIRN_CHROMEDRIVER`, else
/// Debian's. Fails saying how to get them when missing.
fn executables() -> (PathBuf, PathBuf) {
    let pick = |var: &str, default: &str| {
        let path = PathBuf::from(std::env::var(var).unwrap_or_else(|_| default.to_owned()));
        assert!(
            path.is_file(),
            "{} not found: the viewer's tests need Chromium and chromedriver; run scripts/chromium \
             (it installs Debian's chromium and chromium-driver), or set {var}",
            path.display()
        );
        path
    };
    (
        pick("CAIRN_CHROMIUM", "/usr/bin/chromium"),
        pick("CAIRN_CHROMEDRIVER", "/usr/bin/chromedriver"),
    )
}

/// chromedriver on a free loopback port, and a headless Chromium session through it.
async fn browser() -> (Process, Browser) {
    let (chromium, chromedriver) = executables();
    let port = free_addr()
        .rsplit(':')
        .next()
        .expect("port")
        .parse::<u16>()
        .expect("port");
    let child = Command::new(&chromedriver)
        .arg(format!("--port={port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromedriver.display()));
    let mut driver = Process { child };
    let webdriver = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(response) = http.get(format!("{webdriver}/status")).send().await {
            if response.status().is_success() {
                break;
            }
        }
        if let Ok(Some(status)) = driver.child.try_wait() {
            panic!("{} exited at start: {status}", chromedriver.display());
        }
        assert!(
            Instant::now() < deadline,
            "{} did not answer on port {port} within 30 s",
            chromedriver.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium.display().to_string(),
            // Root in a container: no sandbox; no GPU; a fixed size for the screenshots.
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1500,1000"],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let browser = ClientBuilder::new(connector)
        .capabilities(capabilities)
        .connect(&webdriver)
        .await
        .unwrap_or_else(|e| {
            driver.kill();
            panic!(
                "chromedriver could not start {} headless: {e}",
                chromium.display()
            )
        });
    (driver, browser)
}

#[tokio::test]
async fn the_list_shows_sessions_with_status_model_turns_and_usage_and_filters_them() {
    let viewer = Viewer::start().await;
    viewer.tool_session("alpha-list").await;
    // A session of a provider nobody runs here: idle, no turns.
    let (status, body) = viewer
        .api(
            Method::POST,
            "/v1/sessions",
            Some(json!({"session_id": "beta-other", "model": {"provider": "custom", "model": "other-model"}})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    viewer.open("/ui").await;
    let row = |id: &str, cell: &str| format!("#sessions tr[data-id='{id}'] td.{cell}");
    let model = viewer.texts(&row("alpha-list", "model")).await;
    assert_eq!(model.len(), 1, "{}", viewer.page_text().await);
    assert!(
        model[0].starts_with("scripted:") && model[0].ends_with("alpha-list.json"),
        "{model:?}"
    );
    assert_eq!(viewer.texts(&row("alpha-list", "status")).await, ["idle"]);
    assert_eq!(viewer.texts(&row("alpha-list", "turns")).await, ["1"]);
    // Both model calls' usage: 40 + 60 in, 12 + 4 out.
    assert_eq!(
        viewer.texts(&row("alpha-list", "usage")).await,
        ["100 in / 16 out"]
    );
    assert_eq!(
        viewer.texts(&row("beta-other", "model")).await,
        ["custom:other-model"]
    );
    assert_eq!(viewer.texts(&row("beta-other", "turns")).await, ["0"]);
    assert_eq!(
        viewer.texts(&row("alpha-list", "updated")).await[0].len(),
        "2026-01-01 00:00:00".len()
    );

    viewer.screenshot("sessions", "ui-sessions.png").await;

    let filter = viewer
        .browser
        .find(Locator::Css("#filter"))
        .await
        .expect("filter");
    filter.send_keys("custom").await.expect("type");
    let shown = viewer.wait_for("the filter by model", ONE_ROW_SHOWN).await;
    assert_eq!(shown, json!(["beta-other"]));
    filter.clear().await.expect("clear");
    filter.send_keys("IDLE alpha").await.expect("type");
    let shown = viewer
        .wait_for("the filter by status and id", ONE_ROW_SHOWN)
        .await;
    assert_eq!(shown, json!(["alpha-list"]));
    viewer.close().await;
}

#[tokio::test]
async fn a_session_page_shows_its_tool_calls_and_the_transcript_as_it_is() {
    let viewer = Viewer::start().await;
    viewer.tool_session("tools").await;
    viewer.open("/ui/sessions/tools").await;

    // The transcript: thinking collapsed, the tool_use parts with their input, the results.
    let thinking = viewer
        .browser
        .execute(
            "return [...document.querySelectorAll('#transcript details.thinking')].map((d) => d.open);",
            Vec::new(),
        )
        .await
        .expect("thinking");
    assert_eq!(thinking, json!([false]), "thinking is shown collapsed");
    assert_eq!(
        viewer.texts("#transcript .tool-use .name").await,
        ["calculator", "calculator"]
    );
    let arguments = viewer.texts("#transcript .tool-use .arguments").await;
    assert!(
        arguments[0].contains("\"expression\": \"1+2\""),
        "{arguments:?}"
    );
    let results = viewer.texts("#transcript .tool-result .content").await;
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].contains("\"value\": 3"), "{results:?}");
    assert!(results[1].contains("\"value\": 12"), "{results:?}");
    assert_eq!(
        viewer
            .texts("#transcript .tool-result.is-error")
            .await
            .len(),
        0
    );
    assert_eq!(
        viewer.texts("#transcript .message.assistant .text").await,
        ["Let me compute both.", "3 and 12"]
    );

    // The timeline: the turn, its two model calls and two tool calls, each with its attempt.
    assert_eq!(
        viewer.texts("#timeline .call.tool .tool-name").await,
        ["calculator", "calculator"]
    );
    assert_eq!(viewer.texts("#timeline .call.model").await.len(), 2);
    let heads = viewer.texts("#timeline .call .head").await;
    assert!(
        heads.iter().all(|h| h.contains("1 attempt")),
        "every call took one attempt: {heads:?}"
    );
    assert!(
        heads[0].contains("40 in / 12 out"),
        "the first model call's usage: {heads:?}"
    );
    let turn = viewer.texts("#timeline .turn .head .status").await;
    assert_eq!(turn, ["completed"]);
    // Every event of the history is a row of the timeline.
    let history = viewer.history("tools").await;
    let rows = viewer.texts("#timeline li.event .seq").await;
    let seqs: Vec<String> = history.iter().map(|e| e["seq"].to_string()).collect();
    let mut shown = rows.clone();
    shown.sort_by_key(|s| s.parse::<u64>().unwrap_or(0));
    assert_eq!(shown, seqs);
    viewer.close().await;
}

#[tokio::test]
async fn a_live_event_appears_without_a_reload() {
    let viewer = Viewer::start().await;
    // Each model call waits 1.5 s, so the page sees the turn run.
    viewer
        .create(
            "live",
            r#"[{"parts": [{"type": "text", "text": "first answer"}]},
                {"parts": [{"type": "text", "text": "second answer"}]}]"#,
            1500,
        )
        .await;
    let turn = viewer.send("live", "one").await;
    viewer.outcome("live", turn).await;
    viewer.open("/ui/sessions/live").await;
    // A mark in the page's memory: a reload would lose it.
    viewer
        .browser
        .execute("window.cairnMark = 'still here'; return true;", Vec::new())
        .await
        .expect("mark");
    viewer
        .wait_for(
            "the stream connected",
            "return document.getElementById('live').textContent === 'live';",
        )
        .await;
    assert_eq!(
        viewer
            .texts("#timeline li.event[data-kind='user_message']")
            .await
            .len(),
        1
    );

    viewer.send("live", "two").await;
    viewer
        .wait_for(
            "the second user message in the timeline",
            "return document.querySelectorAll(\"#timeline li.event[data-kind='user_message']\").length === 2;",
        )
        .await;
    // The turn is still running (its model call waits): the page got it while it ran.
    let (_, described) = viewer.api(Method::GET, "/v1/sessions/live", None).await;
    assert_eq!(described["status"], "running", "{described}");
    viewer
        .wait_for(
            "the second answer in the transcript",
            "return [...document.querySelectorAll('#transcript .message.assistant .text')]
                 .some((e) => e.textContent === 'second answer');",
        )
        .await;
    viewer
        .wait_for(
            "the second turn completed in the timeline",
            "return document.querySelectorAll(\"#timeline li.event[data-kind='turn_completed']\").length === 2;",
        )
        .await;
    let mark = viewer
        .browser
        .execute("return window.cairnMark;", Vec::new())
        .await
        .expect("mark");
    assert_eq!(mark, json!("still here"), "the page was reloaded");
    viewer.outcome("live", 2).await;
    viewer.close().await;
}

/// The seq of the first event of `kind` in `history`.
fn seq_of(history: &[Value], kind: &str) -> u64 {
    history
        .iter()
        .find(|e| e["kind"] == kind)
        .and_then(|e| e["seq"].as_u64())
        .unwrap_or_else(|| panic!("no {kind} in the history"))
}

#[tokio::test]
async fn clicking_an_event_shows_the_state_at_it_and_forking_from_it_makes_a_runnable_session() {
    let viewer = Viewer::start().await;
    viewer.tool_session("parent").await;
    let history = viewer.history("parent").await;
    // Right after the first tool result: one tool call still open, two messages before the
    // model's answer to them.
    let at = seq_of(&history, "tool_call_completed");
    viewer.open("/ui/sessions/parent").await;
    viewer
        .browser
        .find(Locator::Css(&format!(
            "#timeline li.event[data-seq='{at}']"
        )))
        .await
        .expect("the event's row")
        .click()
        .await
        .expect("click");
    viewer
        .wait_for(
            "the state panel",
            &format!(
                "const b = document.getElementById('state-body');
                 if (b.dataset.loaded === 'error') return 'error: ' + b.textContent;
                 return b.dataset.loaded === '{at}';"
            ),
        )
        .await;
    let (status, state) = viewer
        .api(
            Method::GET,
            &format!("/v1/sessions/parent/state?at={at}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{state}");
    let messages = state["transcript"]["messages"]
        .as_array()
        .expect("messages");
    // The tool calls' assistant message is the last: no result is in the ledger yet.
    assert_eq!(
        messages.last().map(|m| &m["role"]),
        Some(&json!("assistant")),
        "{state}"
    );
    assert_eq!(
        viewer.texts("#state-messages").await,
        [messages.len().to_string()]
    );
    assert_eq!(
        viewer.texts("#state-event").await,
        [format!("{at} of {} (tool_call_completed)", history.len())]
    );
    assert_eq!(viewer.texts("#state-status .status").await, ["running"]);
    assert_eq!(viewer.texts("#state-usage").await, ["40 in / 12 out"]);
    // The tools run in parallel: the other call than the one that returned first is open.
    let returned = &history[at as usize - 1]["event"]["tool_call_completed"]["tool_use_id"];
    let other = if returned == "t1" { "t2" } else { "t1" };
    assert_eq!(state["open_tool_calls"][0]["tool_use_id"], other, "{state}");
    let open = viewer.texts("#state-open li").await;
    assert_eq!(open.len(), 1, "{open:?}");
    assert!(open[0].contains(&format!("calculator {other}")), "{open:?}");
    assert_eq!(
        viewer.texts("#state-transcript .message").await.len(),
        messages.len()
    );
    let url = viewer.browser.current_url().await.expect("url");
    assert_eq!(url.fragment(), Some(format!("at={at}").as_str()));
    viewer.screenshot("session", "ui-session.png").await;

    // Fork there, from the panel: the page goes to the fork, whose pending tool call the
    // server's workers run, and which takes a further turn.
    viewer
        .browser
        .find(Locator::Css("#fork-id"))
        .await
        .expect("fork id")
        .send_keys("forked")
        .await
        .expect("type");
    viewer
        .browser
        .find(Locator::Css("#fork"))
        .await
        .expect("fork button")
        .click()
        .await
        .expect("click");
    viewer
        .wait_for(
            "the fork's page",
            "const e = document.getElementById('fork-error');
             if (e) return 'error: ' + e.textContent;
             return location.pathname === '/ui/sessions/forked'
                 && document.getElementById('main').dataset.loaded === 'true';",
        )
        .await;
    assert_eq!(
        viewer.texts("#forked-from a").await,
        ["parent"],
        "the fork's page names its parent"
    );
    let outcome = viewer.outcome("forked", 1).await;
    assert_eq!(outcome["status"], "completed", "{outcome}");
    assert_eq!(outcome["answer"], "3 and 12", "{outcome}");
    let forked = viewer.history("forked").await;
    assert_eq!(
        forked[0]["event"]["session_started"]["forked_from"],
        json!({"session_id": "parent", "seq": at})
    );
    // The prefix is the parent's, event for event (but for the session's id and origin).
    for (mine, theirs) in forked.iter().zip(&history).take(at as usize).skip(1) {
        let mut theirs = theirs.clone();
        theirs["session_id"] = json!("forked");
        assert_eq!(mine, &theirs);
    }
    // The call that was still open ran in the fork (its result was not in the prefix).
    assert_eq!(
        forked
            .iter()
            .filter(|e| e["kind"] == "tool_call_completed")
            .count(),
        2
    );
    let turn = viewer.send("forked", "Again?").await;
    let outcome = viewer.outcome("forked", turn).await;
    assert_eq!(outcome["answer"], "Still 3 and 12.", "{outcome}");
    // The page followed it all live.
    viewer
        .wait_for(
            "the fork's second turn on its page",
            "return document.querySelectorAll(\"#timeline li.event[data-kind='turn_completed']\").length === 2;",
        )
        .await;
    viewer.close().await;
}

#[tokio::test]
async fn the_state_route_answers_bad_seqs_clearly_and_writes_nothing() {
    let viewer = Viewer::start().await;
    viewer.tool_session("s").await;
    let history = viewer.history("s").await;
    let last = history.len() as u64;
    let (_, listed_before) = viewer.api(Method::GET, "/v1/sessions", None).await;
    let raw = |path: String| {
        let http = viewer.http.clone();
        let url = viewer.url(&path);
        async move {
            http.get(url)
                .send()
                .await
                .expect("request")
                .bytes()
                .await
                .expect("body")
        }
    };
    let bytes_before = raw("/v1/sessions/s/history".into()).await;

    for seq in 1..=last {
        let (status, state) = viewer
            .api(Method::GET, &format!("/v1/sessions/s/state?at={seq}"), None)
            .await;
        assert_eq!(status, StatusCode::OK, "{state}");
        assert_eq!(state["at_seq"], seq);
        assert_eq!(state["of_seqs"], last);
        assert_eq!(state["session"]["session_id"], "s");
        assert_eq!(state["session"]["events"], seq);
    }
    // Without `at`: the last event, as `cairn show` does.
    let (status, latest) = viewer.api(Method::GET, "/v1/sessions/s/state", None).await;
    assert_eq!(status, StatusCode::OK, "{latest}");
    assert_eq!(latest["at_seq"], last);
    assert_eq!(latest["session"]["status"], "idle");
    assert_eq!(latest["open_tool_calls"], json!([]));

    let past = last + 1;
    for (path, expected, words) in [
        (
            format!("/v1/sessions/s/state?at={past}"),
            StatusCode::NOT_FOUND,
            format!("has no event {past}: its history holds seqs 1..={last}"),
        ),
        (
            "/v1/sessions/s/state?at=0".into(),
            StatusCode::BAD_REQUEST,
            "at must be the seq of an event".into(),
        ),
        (
            "/v1/sessions/s/state?at=first".into(),
            StatusCode::BAD_REQUEST,
            "at".into(),
        ),
        (
            "/v1/sessions/nope/state?at=1".into(),
            StatusCode::NOT_FOUND,
            "no session \"nope\"".into(),
        ),
    ] {
        let (status, body) = viewer.api(Method::GET, &path, None).await;
        assert_eq!(status, expected, "{path}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(&words), "{path}: {message}");
    }

    // Nothing was written: the same history bytes and the same listing.
    assert_eq!(raw("/v1/sessions/s/history".into()).await, bytes_before);
    let (_, listed_after) = viewer.api(Method::GET, "/v1/sessions", None).await;
    assert_eq!(listed_after, listed_before);
    viewer.close().await;
}

#[tokio::test]
async fn the_fork_route_refuses_what_cannot_be_forked_and_says_why() {
    let viewer = Viewer::start().await;
    viewer.tool_session("p").await;
    let history = viewer.history("p").await;
    let last = history.len() as u64;
    let user_message = seq_of(&history, "user_message");
    let fork = |body: Value| viewer.api(Method::POST, "/v1/sessions/p/fork", Some(body));

    // A user message's decision (the model call) is recorded after it: a cut there is refused.
    let (status, body) = fork(json!({"at": user_message})).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("cuts the transition of seq {user_message}")),
        "{message}"
    );
    let (status, body) = fork(json!({"at": last + 1})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let (status, body) = fork(json!({"at": 0})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = fork(json!({"at": last, "model": "no-colon"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = fork(json!({"at": last, "id": "bad id!"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = fork(json!({"at": last, "unknown": 1})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = viewer
        .api(
            Method::POST,
            "/v1/sessions/nope/fork",
            Some(json!({"at": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    // Nothing of the refused forks was written.
    let (_, listed) = viewer.api(Method::GET, "/v1/sessions", None).await;
    assert_eq!(
        listed["sessions"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );

    // After the turn: a fork with another system prompt and model, then its id is taken.
    let (status, body) = fork(json!({"at": last, "id": "f", "system": "Be brief."})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(
        body,
        json!({"session_id": "f", "events": last, "running": false, "tasks": 0})
    );
    let forked = viewer.history("f").await;
    assert_eq!(
        forked[0]["event"]["session_started"]["system_prompt"],
        "Be brief."
    );
    let (status, body) = fork(json!({"at": last, "id": "f"})).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    // The fork takes its next turn (the script's third answer).
    let turn = viewer.send("f", "Again?").await;
    assert_eq!(turn, 2);
    let outcome = viewer.outcome("f", turn).await;
    assert_eq!(outcome["answer"], "Still 3 and 12.", "{outcome}");
    // Without an id, one is made.
    let (status, body) = fork(json!({"at": last})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(body["session_id"].as_str().is_some_and(|id| !id.is_empty()));
    viewer.close().await;
}

#[tokio::test]
async fn with_tokens_the_page_is_served_and_the_new_routes_keep_to_the_namespace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = dir.path().join("tokens.json");
    std::fs::write(
        &tokens,
        json!({"tokens": [{"token": "acme-client", "namespace": "acme", "role": "client"},
                          {"token": "other-client", "namespace": "other", "role": "client"}]})
        .to_string(),
    )
    .expect("tokens");
    let (_server, base) = start(
        &[
            "server".into(),
            "--data".into(),
            dir.path().join("store").display().to_string(),
            "--listen".into(),
            free_addr(),
            "--tokens".into(),
            tokens.display().to_string(),
        ],
        "listening on",
    );
    let http = reqwest::Client::new();
    // The page holds no data: it is served without a token, and asks for one.
    let page = http.get(format!("{base}/ui")).send().await.expect("page");
    assert_eq!(page.status(), StatusCode::OK);
    assert!(page.headers()["content-type"]
        .to_str()
        .is_ok_and(|t| t.starts_with("text/html")));
    let call = |method: Method, path: &str, token: Option<&str>, body: Option<Value>| {
        let mut request = http.request(method, format!("{base}{path}"));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        async move {
            let response = request.send().await.expect("request");
            let status = response.status();
            (status, response.json::<Value>().await.expect("JSON"))
        }
    };
    let (status, body) = call(
        Method::POST,
        "/v1/sessions",
        Some("acme-client"),
        Some(json!({"session_id": "p", "model": {"provider": "custom", "model": "m"}})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, _) = call(Method::GET, "/v1/sessions/p/state?at=1", None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = call(
        Method::GET,
        "/v1/sessions/p/state?at=1",
        Some("other-client"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "another namespace's session");
    let (status, _) = call(
        Method::POST,
        "/v1/sessions/p/fork",
        Some("other-client"),
        Some(json!({"at": 1})),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "another namespace's session");
    let (status, body) = call(
        Method::POST,
        "/v1/sessions/p/fork",
        Some("acme-client"),
        Some(json!({"at": 1, "id": "f"})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["session_id"], "f");
    // The fork's origin is told in the namespace's own ids.
    let (status, history) = call(
        Method::GET,
        "/v1/sessions/f/history",
        Some("acme-client"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{history}");
    assert_eq!(
        history["events"][0]["event"]["session_started"]["forked_from"],
        json!({"session_id": "p", "seq": 1})
    );
    let (status, state) = call(
        Method::GET,
        "/v1/sessions/f/state?at=1",
        Some("acme-client"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{state}");
    assert_eq!(state["session"]["session_id"], "f");
}
