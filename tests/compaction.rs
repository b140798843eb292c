//! Compaction through the `cairn` binary and the scripted provider: a session whose
//! transcript outgrows the script's context window is compacted and its call retried, the
//! compaction shows in `cairn history` and `cairn show`, and replays; `cairn compact` on
//! request.

use crate::support::{cairn_command, demo_files};
use std::process::Output;

fn cairn(args: &[&str]) -> Output {
    cairn_command().args(args).output().expect("run cairn")
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// Three turns, one response each (named by turn, so they play right after compaction), with
/// long answers: the third request is over the 400-token window until compaction keeps only
/// the current turn.
fn script() -> String {
    let long = "word ".repeat(140);
    let answer = |turn: u32| {
        serde_json::json!({
            "turn": turn,
            "parts": [
                {"type": "thinking", "text": format!("thinking {turn}"), "signature": format!("sig-{turn}")},
                {"type": "text", "text": format!("answer {turn}: {long}")}
            ]
        })
    };
    serde_json::json!({
        "context_window_tokens": 400,
        "responses": [answer(1), answer(2), answer(3)]
    })
    .to_string()
}

#[test]
fn a_context_too_long_is_compacted_retried_and_shown_in_the_history() {
    let files = demo_files(&script());
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
            "long",
            "--workdir",
            workdir,
            "--hide-thinking",
        ];
        args.extend_from_slice(extra);
        args.push(prompt);
        cairn(&args)
    };
    let flags = ["--compact-on-overflow", "--compact-keep-turns", "1"];
    for (turn, prompt) in [(1, "first"), (2, "second"), (3, "third")] {
        let out = run(prompt, if turn == 1 { &flags[..] } else { &[] });
        assert!(
            out.status.success(),
            "turn {turn}: {}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        assert!(
            text(&out.stdout).contains(&format!("answer {turn}:")),
            "{}",
            text(&out.stdout)
        );
    }
    // The flags are fixed when the session starts.
    let refused = run("fourth", &["--compact-at", "100"]);
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("--compact-* flags apply only when a session starts"),
        "{}",
        text(&refused.stderr)
    );

    let history = cairn(&["history", "--data", data, "long"]);
    let lines = text(&history.stdout);
    assert!(
        lines.contains("model_call_failed") && lines.contains("context_too_long"),
        "{lines}"
    );
    let compacted: Vec<&str> = lines
        .lines()
        .filter(|l| l.contains("transcript_compacted"))
        .collect();
    assert_eq!(compacted.len(), 1, "{lines}");
    assert!(
        compacted[0].contains(
            "turn=3 trigger=context_too_long strategies=[drop_reasoning,keep_last_turns] keep_last_turns=1 cut=4"
        ),
        "{lines}"
    );
    // The retry is attempt 2 of the same call, after the compaction.
    let json = cairn(&["history", "--data", data, "long", "--json"]);
    let events: Vec<serde_json::Value> = text(&json.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    let at = kinds
        .iter()
        .position(|k| *k == "transcript_compacted")
        .unwrap();
    assert_eq!(kinds[at - 1], "model_call_failed");
    assert_eq!(kinds[at + 1], "model_call_scheduled");
    assert_eq!(
        events[at + 1]["event"]["model_call_scheduled"]["attempt"],
        2
    );
    let compaction = &events[at]["event"]["transcript_compacted"];
    assert!(
        compaction["estimate_before"].as_u64().unwrap() > 400
            && compaction["estimate_after"].as_u64().unwrap() < 400,
        "{compaction}"
    );
    // The whole history stays: the first answers and their thinking are still recorded.
    assert_eq!(
        events
            .iter()
            .filter(|e| e["kind"] == "model_call_completed")
            .count(),
        3
    );

    // The ledger holds only the last turn; the state before the compaction is still there.
    let transcript = cairn(&["transcript", "--data", data, "long"]);
    let ledger: serde_json::Value = serde_json::from_slice(&transcript.stdout).unwrap();
    let messages = ledger["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2, "{ledger}");
    assert_eq!(messages[0]["parts"][0]["text"]["text"], "third");
    let seq = events[at]["seq"].as_u64().unwrap();
    let before = cairn(&[
        "show",
        "--data",
        data,
        "long",
        "--at",
        &(seq - 1).to_string(),
    ]);
    assert!(
        text(&before.stdout).contains("transcript: 5 messages"),
        "{}",
        text(&before.stdout)
    );
    let after = cairn(&["show", "--data", data, "long", "--at", &seq.to_string()]);
    assert!(
        text(&after.stdout).contains("(transcript_compacted)")
            && text(&after.stdout).contains("transcript: 1 messages"),
        "{}",
        text(&after.stdout)
    );

    let replay = cairn(&["replay", "--data", data, "long"]);
    assert!(replay.status.success(), "{}", text(&replay.stdout));
}

#[test]
fn compact_on_request_drops_old_reasoning_between_turns() {
    let files = demo_files(&script());
    let data = files.dir.path().join("store");
    let data = data.to_str().unwrap();
    let model = format!("scripted:{}", files.script.display());
    let workdir = files.workdir.to_str().unwrap();
    for prompt in ["first", "second"] {
        let out = cairn(&[
            "run",
            "--data",
            data,
            "--model",
            &model,
            "--session",
            "asked",
            "--workdir",
            workdir,
            prompt,
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let out = cairn(&["compact", "--data", data, "asked"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("compacted session asked: drop_reasoning (estimated tokens"),
        "{}",
        text(&out.stdout)
    );
    // Turn 1's thinking is gone from the ledger; turn 2's, the last, stays.
    let transcript = cairn(&["transcript", "--data", data, "asked"]);
    let ledger = text(&transcript.stdout);
    assert!(
        !ledger.contains("thinking 1") && ledger.contains("thinking 2"),
        "{ledger}"
    );
    // Nothing left to do: said so, and nothing is recorded but the request.
    let again = cairn(&["compact", "--data", data, "asked"]);
    assert!(
        text(&again.stdout).starts_with("nothing to compact in session asked"),
        "{}",
        text(&again.stdout)
    );
    let history = text(&cairn(&["history", "--data", data, "asked"]).stdout);
    assert_eq!(
        history.matches("compaction_requested").count(),
        2,
        "{history}"
    );
    assert_eq!(
        history.matches("transcript_compacted").count(),
        1,
        "{history}"
    );
    let replay = cairn(&["replay", "--data", data, "asked"]);
    assert!(replay.status.success(), "{}", text(&replay.stdout));
}

#[test]
fn a_summarising_session_keeps_a_summary_of_the_turns_it_drops() {
    let script = serde_json::json!({
        "summary": "Earlier, the user said first and got answer 1.",
        "responses": [
            {"turn": 1, "parts": [{"type": "text", "text": "answer 1"}]},
            {"turn": 2, "parts": [{"type": "text", "text": "answer 2"}]}
        ]
    });
    let files = demo_files(&script.to_string());
    let data = files.dir.path().join("store");
    let data = data.to_str().unwrap();
    let model = format!("scripted:{}", files.script.display());
    let workdir = files.workdir.to_str().unwrap();
    let flags: &[&str] = &[
        "--compact-at",
        "1",
        "--compact-strategies",
        "keep_last_turns",
        "--compact-keep-turns",
        "1",
        "--compact-summarize",
    ];
    for (turn, prompt) in [(1, "first"), (2, "second")] {
        let mut args = vec![
            "run",
            "--data",
            data,
            "--model",
            &model,
            "--session",
            "sum",
            "--workdir",
            workdir,
        ];
        if turn == 1 {
            args.extend_from_slice(flags);
        }
        args.push(prompt);
        let out = cairn(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(text(&out.stdout).contains(&format!("answer {turn}")));
    }
    let history = text(&cairn(&["history", "--data", data, "sum"]).stdout);
    for kind in [
        "summary_call_scheduled",
        "summary_call_completed",
        "transcript_compacted",
    ] {
        assert_eq!(history.matches(kind).count(), 1, "{kind}: {history}");
    }
    assert!(
        history.contains("trigger=threshold strategies=[keep_last_turns] keep_last_turns=1 cut=2")
            && history.contains("summary+46"),
        "{history}"
    );
    // The summary call's usage is recorded, so budgets count it.
    let events = text(&cairn(&["history", "--data", data, "sum", "--json"]).stdout);
    let summary: serde_json::Value = events
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .find(|event| event["kind"] == "summary_call_completed")
        .unwrap();
    let usage = &summary["event"]["summary_call_completed"]["usage"];
    // (the scripted provider reports no tokens for a summary: zeros, but recorded)
    assert!(usage["input_tokens"].is_u64(), "{summary}");
    let transcript = cairn(&["transcript", "--data", data, "sum"]);
    let ledger: serde_json::Value = serde_json::from_slice(&transcript.stdout).unwrap();
    let first = &ledger["messages"][0]["parts"];
    assert_eq!(
        first[0]["text"]["text"],
        "[Summary of the earlier conversation]\nEarlier, the user said first and got answer 1."
    );
    assert_eq!(first[1]["text"]["text"], "second");
    let replay = cairn(&["replay", "--data", data, "sum"]);
    assert!(replay.status.success(), "{}", text(&replay.stdout));
}
