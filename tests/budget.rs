//! Usage, cost and budgets through the `cairn` binary: a price file prices each call as it is
//! recorded, a session budget stops a turn with a clear reason and exit code, the history
//! records which limit, `sessions` and `show` print the totals, and an answer cut short is
//! not reported as a normal completion.

use crate::support::{cairn_command, demo_files, TestHost};
use cairn_ledger::{ModelResponse, Part, StopReason, Usage};
use cairn_runtime::{
    ActivityReport, Client, Clock, Engine, Event, ManualClock, MemoryStore, PriceTable, Store,
};
use std::process::Output;
use std::sync::Arc;

fn cairn(args: &[&str]) -> Output {
    cairn_command().args(args).output().expect("run cairn")
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// $1 per million input tokens and $2 per million output tokens for the script's model.
const PRICES: &str = r#"{"models": [
  {"providers": ["scripted"], "model": "budget-model",
   "input": 1, "output": 2, "cache_read": 0.1, "cache_write": 1.25}
]}"#;

/// Every answer uses 1000 input and 500 output tokens: $0.002 at [`PRICES`].
const SCRIPT: &str = r#"{"model": "budget-model", "responses": [
  {"parts": [{"type": "text", "text": "first answer"}], "usage": {"input_tokens": 1000, "output_tokens": 500}},
  {"parts": [{"type": "text", "text": "second answer"}], "usage": {"input_tokens": 1000, "output_tokens": 500}},
  {"parts": [{"type": "text", "text": "third answer"}], "usage": {"input_tokens": 1000, "output_tokens": 500}}
]}"#;

#[test]
fn a_session_cost_budget_stops_the_turn_that_goes_over_and_the_next_before_its_call() {
    let files = demo_files(SCRIPT);
    let prices = files.dir.path().join("prices.json");
    std::fs::write(&prices, PRICES).unwrap();
    let prices = prices.to_str().unwrap();
    let data = files.dir.path().join("store");
    let data = data.to_str().unwrap();
    let model = format!("scripted:{}", files.script.display());
    let workdir = files.workdir.to_str().unwrap();
    let run = |prompt: &str, extra: &[&str]| {
        let mut args = vec![
            "run",
            "--data",
            data,
            "--model",
            &model,
            "--session",
            "spend",
            "--workdir",
            workdir,
            "--prices",
            prices,
        ];
        args.extend_from_slice(extra);
        args.push(prompt);
        cairn(&args)
    };
    let first = run("one", &["--max-session-cost", "0.003"]);
    let err = text(&first.stderr);
    assert!(first.status.success(), "{err}");
    assert!(text(&first.stdout).contains("first answer"));
    assert!(
        err.contains(
            "turn 1: 1500 tokens (1000 in, 500 out, 0 cache read, 0 cache write), 1 model call(s), cost $0.002000"
        ),
        "{err}"
    );
    // Budgets are recorded when the session starts: refused for the existing one.
    let refused = run("two", &["--max-turn-tokens", "5"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        text(&refused.stderr).contains("apply only when a session starts"),
        "{}",
        text(&refused.stderr)
    );
    // Turn 2 may start ($0.002 < $0.003); its answer takes the session to $0.004.
    let second = run("two", &[]);
    let err = text(&second.stderr);
    assert_eq!(second.status.code(), Some(5), "{err}");
    assert!(
        err.contains(
            "turn 2 failed: session budget exceeded: max_cost_micros $0.003000, $0.004000 used"
        ),
        "{err}"
    );
    // Turn 3 fails before any model call is scheduled.
    let third = run("three", &[]);
    assert_eq!(third.status.code(), Some(5));
    assert!(
        text(&third.stderr).contains("turn 3 failed: session budget exceeded"),
        "{}",
        text(&third.stderr)
    );
    assert!(!text(&third.stdout).contains("third answer"));

    // The history records the costs and which limit, in the documented JSON form.
    let history = cairn(&["history", "--data", data, "spend", "--json"]);
    let events: Vec<serde_json::Value> = text(&history.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let costs: Vec<u64> = events
        .iter()
        .filter_map(|e| e["event"]["model_call_completed"]["cost_micros"].as_u64())
        .collect();
    assert_eq!(costs, [2_000, 2_000]);
    let failures: Vec<&serde_json::Value> = events
        .iter()
        .filter_map(|e| e["event"].get("turn_failed"))
        .collect();
    assert_eq!(failures.len(), 2);
    for failure in &failures {
        assert_eq!(failure["budget_exceeded"]["limit"], "cost_micros");
        assert_eq!(failure["budget_exceeded"]["scope"], "session");
        assert_eq!(failure["budget_exceeded"]["limit_value"], 3_000);
        assert_eq!(failure["budget_exceeded"]["used"], 4_000);
    }
    let scheduled = events
        .iter()
        .filter(|e| e["kind"] == "model_call_scheduled")
        .count();
    assert_eq!(scheduled, 2, "turn 3 scheduled no model call");
    let started = &events[0]["event"]["session_started"]["limits"];
    assert_eq!(started["session_budget"]["max_cost_micros"], 3_000);

    // The totals: in the listing, in `show`, and the replay agrees.
    let listing = text(&cairn(&["sessions", "--data", data]).stdout);
    assert!(
        listing.contains("3000 tokens") && listing.contains("$0.004000"),
        "{listing}"
    );
    let show = text(&cairn(&["show", "--data", data, "spend"]).stdout);
    assert!(
        show.contains("totals so far: 3000 tokens (2000 in, 1000 out, 0 cache read, 0 cache write), 2 model call(s), cost $0.004000"),
        "{show}"
    );
    let replay = cairn(&["replay", "--data", data, "spend"]);
    assert!(replay.status.success(), "{}", text(&replay.stdout));
}

#[test]
fn an_answer_cut_short_exits_3_and_an_unknown_price_is_said_so() {
    let files = demo_files(
        r#"{"responses": [
          {"parts": [{"type": "text", "text": "the beginning of"}], "stop_reason": "max_tokens",
           "usage": {"input_tokens": 10, "output_tokens": 4}}
        ]}"#,
    );
    let data = files.dir.path().join("store");
    let model = format!("scripted:{}", files.script.display());
    let out = cairn(&[
        "run",
        "--data",
        data.to_str().unwrap(),
        "--model",
        &model,
        "--workdir",
        files.workdir.to_str().unwrap(),
        "write a lot",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(8), "{err}");
    assert!(text(&out.stdout).contains("the beginning of"));
    assert!(
        err.contains("stopped short: the model stopped for max_tokens"),
        "{err}"
    );
    // The scripted model has no built-in price: the cost is unknown, not $0.
    assert!(
        err.contains("cost ≥ $0.000000 (1 attempt(s) unpriced)"),
        "{err}"
    );
}

#[test]
fn a_bad_price_file_is_refused_before_anything_is_written_naming_the_line() {
    let files = demo_files(SCRIPT);
    let prices = files.dir.path().join("prices.json");
    std::fs::write(
        &prices,
        "{\"models\": [\n  {\"providers\": [\"scripted\"], \"model\": \"m\",\n   \"input\": -1, \"output\": 1, \"cache_read\": 0, \"cache_write\": 0}]}",
    )
    .unwrap();
    let data = files.dir.path().join("store");
    let model = format!("scripted:{}", files.script.display());
    let out = cairn(&[
        "run",
        "--data",
        data.to_str().unwrap(),
        "--model",
        &model,
        "--prices",
        prices.to_str().unwrap(),
        "hi",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("price table")
            && err.contains("price -1 is not a dollar amount")
            && err.contains("line 3"),
        "{err}"
    );
    assert!(!data.exists(), "nothing was written");
}

/// A worker killed mid-stream: the engine prices the usage its progress reported, and when its
/// lease lapses the timeout it records knows no usage, so that report is what counts; the
/// retry's completion is priced from the table the engine holds, and the turn's totals hold
/// both.
#[tokio::test]
async fn a_killed_attempt_counts_the_usage_its_progress_reported_priced_by_the_engine() {
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(store.clone(), clock.clone());
    let script = files.script.display().to_string();
    engine.set_prices(
        PriceTable::parse(
            "test",
            &format!(
                r#"{{"models": [{{"providers": ["scripted"], "model": {script:?},
                    "input": 1, "output": 2, "cache_read": 0, "cache_write": 0}}]}}"#
            ),
        )
        .unwrap(),
    );
    let client = Client::new(engine.clone());
    let probe = TestHost {
        client: client.clone(),
        pool: None,
        tools: Arc::new(cairn_activities::ToolRegistry::builtin(&files.workdir)),
    };
    let session = client
        .start_session(probe.session_options(&files.script, "killed"))
        .await
        .unwrap();
    let turn = client.send(&session, "greet me").await.unwrap();
    let lease = |now| {
        let store = store.clone();
        async move {
            store
                .lease_tasks(now, 1_000, 1, &cairn_runtime::TaskFilter::default())
                .await
                .unwrap()
                .remove(0)
        }
    };
    let first = lease(clock.now_ms()).await;
    let so_far = Usage {
        input_tokens: 1_000,
        ..Usage::default()
    };
    engine
        .record_progress_with_usage(&first, "Hel".into(), String::new(), Some(so_far))
        .await
        .unwrap();
    // The worker dies; its lease lapses and the timers record the attempt as timed out.
    clock.advance(1_001);
    assert_eq!(engine.fire_timers().await.unwrap(), 1);
    clock.advance(1_000);
    let second = lease(clock.now_ms()).await;
    let answer = ModelResponse {
        provider: "scripted".into(),
        model: "not-in-the-table".into(),
        parts: vec![Part::text("Hello.")],
        stop_reason_raw: "end_turn".into(),
        stop_reason: StopReason::EndTurn,
        usage: Usage {
            input_tokens: 1_000,
            output_tokens: 10,
            ..Usage::default()
        },
    };
    engine
        .report(&second, ActivityReport::ModelCompleted(answer))
        .await
        .unwrap();
    let outcome = engine.wait_turn(&session, turn).await.unwrap();
    let totals = outcome.totals();
    assert_eq!(totals.usage.input_tokens, 2_000);
    assert_eq!(totals.usage.output_tokens, 10);
    // $1/M × 1000 for the lost run; $1/M × 1000 + $2/M × 10 for the answer (its reported
    // model is unknown, so the session's model prices it).
    assert_eq!(totals.cost(), Some(1_000 + 1_020));
    assert_eq!(totals.model_calls, 2);
    let history = client.history(&session).await.unwrap();
    let recorded: Vec<(&str, Option<u64>)> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelAttemptProgress { cost_micros, .. } => Some(("progress", *cost_micros)),
            Event::ModelCallFailed { cost_micros, .. } => Some(("failed", *cost_micros)),
            Event::ModelCallCompleted { cost_micros, .. } => Some(("completed", *cost_micros)),
            _ => None,
        })
        .collect();
    assert_eq!(
        recorded,
        [
            ("progress", Some(1_000)),
            ("failed", None),
            ("completed", Some(1_020))
        ]
    );
    // A replay of the history gives the same totals: only recorded numbers are summed.
    let replayed = cairn_runtime::replay(&session, &history).unwrap();
    assert_eq!(
        replayed.state.totals,
        engine.state(&session).await.unwrap().totals
    );
}
