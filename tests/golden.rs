//! Golden files: the encoded bytes of every event kind, and whole demo sessions as text.
//! `events/*.bin` are format-1 records (written before format 2): they are never made again and
//! must keep decoding forever. `events/format2/` holds the same records as `codec::encode`
//! writes them now. Regenerate with `CAIRN_BLESS=1 cargo test --test integration golden` — only
//! for new files or an intended format change; old event files must keep decoding forever.

use crate::support::{demo_files, TestHost};
use cairn_ledger::*;
use cairn_runtime::codec;
use cairn_runtime::Error;
use cairn_runtime::*;
use cairn_workers::WorkerConfig;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn bless() -> bool {
    std::env::var_os("CAIRN_BLESS").is_some()
}

/// Checks `envelope`'s golden records. `events/NAME` holds it in format 1, as every record was
/// written before format 2: it must decode to the envelope forever and is never rewritten.
/// `events/format2/NAME` holds what `codec::encode` writes today (written when missing or
/// blessed): it must decode to the envelope, and the encoding must not change. Returns the
/// format-2 record's decoding.
fn assert_golden_record(name: &str, envelope: &EventEnvelope) -> EventEnvelope {
    let (session_id, seq) = (envelope.session_id.as_str(), envelope.seq);
    let format1 = golden_dir().join("events").join(name);
    let stored = std::fs::read(&format1).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (format-1 files are never made again)",
            format1.display()
        )
    });
    assert_eq!(stored[0], 1, "{} is a format-1 record", format1.display());
    let decoded = codec::decode(session_id, seq, &stored)
        .unwrap_or_else(|e| panic!("{}: {e}", format1.display()));
    assert_eq!(
        &decoded,
        envelope,
        "{} decodes to a different event",
        format1.display()
    );
    assert_format2_record(name, envelope)
}

/// `events/format2/NAME` holds what `codec::encode` writes today (written when missing or
/// blessed): it must decode to the envelope, and the encoding must not change. For shapes
/// added after format 2, which have no format-1 record. Returns the record's decoding.
fn assert_format2_record(name: &str, envelope: &EventEnvelope) -> EventEnvelope {
    let (session_id, seq) = (envelope.session_id.as_str(), envelope.seq);
    let format2 = golden_dir().join("events/format2").join(name);
    let bytes = codec::encode(envelope).unwrap();
    if bless() || !format2.exists() {
        std::fs::create_dir_all(format2.parent().unwrap()).unwrap();
        std::fs::write(&format2, &bytes).unwrap();
    }
    let stored = std::fs::read(&format2).unwrap();
    let decoded = codec::decode(session_id, seq, &stored)
        .unwrap_or_else(|e| panic!("{}: {e}", format2.display()));
    assert_eq!(
        &decoded,
        envelope,
        "{} decodes to a different event",
        format2.display()
    );
    assert_eq!(bytes, stored, "{}: the encoding changed", format2.display());
    decoded
}

fn sample_events() -> Vec<Event> {
    let usage = Usage {
        input_tokens: 9007199254740993,
        output_tokens: 2,
        cache_read_tokens: 3,
        cache_write_tokens: 4,
        reasoning_tokens: 5,
    };
    let response = ModelResponse {
        provider: "scripted".into(),
        model: "golden".into(),
        parts: vec![
            Part::Thinking {
                text: "think".into(),
                signature: "sig".into(),
            },
            Part::RedactedThinking {
                data: "opaque".into(),
            },
            Part::text("hi"),
            Part::ToolUse(ToolUse {
                id: "toolu_1".into(),
                name: "calculator".into(),
                arguments: r#"{"z":1,"a":9007199254740993}"#.into(),
                signature: Some("call-sig".into()),
            }),
            Part::Image {
                media_type: "image/png".into(),
                data_ref: "sha256:00".into(),
            },
        ],
        stop_reason_raw: "tool_use".into(),
        stop_reason: StopReason::ToolUse,
        usage,
    };
    let failure = ActivityFailure {
        class: ErrorClass::RateLimited,
        message: "slow down".into(),
        usage: Some(usage),
        phase: None,
        heartbeat_details: None,
        retry_after_ms: None,
    };
    vec![
        Event::SessionStarted(SessionStarted {
            call_options: Default::default(),
            queues: Default::default(),
            forked_from: None,
            workflow_version: 1,
            tool_policy: None,
            compaction: None,
            model: ModelSpec {
                provider: "scripted".into(),
                model: "demo.json".into(),
                max_tokens: Some(1024),
                thinking_budget_tokens: Some(2048),
            },
            tools: vec![ToolSpec {
                name: "calculator".into(),
                description: "arithmetic".into(),
                input_schema: JsonText::parse(r#"{"type":"object","required":["expression"]}"#)
                    .unwrap(),
            }]
            .into(),
            system_prompt: Some("be brief".into()),
            limits: Limits {
                max_rounds: 8,
                session_budget: Default::default(),
                turn_budget: Default::default(),
            },
            // Pinned as written in v1 (before model calls got a default overall deadline).
            model_retry: RetryPolicy {
                schedule_to_close_timeout_ms: None,
                ..RetryPolicy::model_default()
            },
            tool_retry: RetryPolicy::tool_default(),
            workdir: None,
        }),
        Event::UserMessage {
            idempotency_key: None,
            tool_choice: None,
            turn: 1,
            text: "hello".into(),
            model: None,
            media: Vec::new(),
        },
        Event::ModelCallScheduled {
            turn: 1,
            round: 0,
            attempt: 1,
            not_before_ms: 1_700_000_000_000,
        },
        Event::ModelCallCompleted {
            turn: 1,
            round: 0,
            attempt: 1,
            response,
            cost_micros: None,
        },
        Event::ModelCallFailed {
            turn: 1,
            round: 0,
            attempt: 2,
            failure: failure.clone(),
            cost_micros: None,
        },
        Event::ToolCallScheduled {
            turn: 1,
            tool_use_id: "toolu_1".into(),
            name: "calculator".into(),
            attempt: 1,
            not_before_ms: 1_700_000_000_001,
        },
        Event::ToolCallCompleted {
            turn: 1,
            tool_use_id: "toolu_1".into(),
            attempt: 1,
            content: ToolResultContent::Json(
                JsonText::parse(r#"{"value":9007199254740993,"b":[1,2]}"#).unwrap(),
            ),
            is_error: false,
        },
        Event::ToolCallFailed {
            turn: 1,
            tool_use_id: "toolu_1".into(),
            attempt: 2,
            failure: ActivityFailure {
                class: ErrorClass::ToolFailed,
                message: "disk".into(),
                usage: None,
                phase: None,
                heartbeat_details: None,
                retry_after_ms: None,
            },
        },
        Event::TurnCompleted { turn: 1, usage },
        Event::TurnFailed {
            turn: 2,
            reason: "max_rounds".into(),
            budget_exceeded: None,
        },
        Event::SessionCancelled {
            reason: "user".into(),
        },
        // Kinds added later go last, so that older kinds keep their seqs in the golden files.
        Event::TurnCancelled {
            turn: 3,
            reason: "user".into(),
        },
        Event::ModelAttemptProgress {
            turn: 4,
            round: 1,
            attempt: 2,
            lease_attempt: 3,
            text_appended: "The answer is 4".into(),
            thinking_appended: "two and two".into(),
            cost_micros: None,
            usage: None,
        },
        Event::ToolApprovalRequested {
            turn: 5,
            tool_use_id: "toolu_sh".into(),
            name: "shell".into(),
            deadline_ms: Some(1_700_000_060_000),
        },
        Event::ToolCallApproved {
            turn: 5,
            tool_use_id: "toolu_sh".into(),
        },
        Event::ToolCallDenied {
            turn: 5,
            tool_use_id: "toolu_sh2".into(),
            reason: "nobody approved it before its deadline".into(),
            by_deadline: true,
        },
        Event::TranscriptCompacted {
            turn: 6,
            trigger: CompactionTrigger::ContextTooLong,
            strategies: vec![
                CompactionStrategy::DropReasoning,
                CompactionStrategy::DropFailedToolResults,
                CompactionStrategy::KeepLastTurns,
            ],
            keep_last_turns: Some(2),
            cut: Some(9),
            estimate_before: 210_000,
            estimate_after: 12_345,
            summary: None,
        },
        Event::CompactionRequested {},
        Event::SummaryCallScheduled {
            turn: 7,
            attempt: 2,
            not_before_ms: 1_700_000_000_002,
        },
        Event::SummaryCallCompleted {
            turn: 7,
            attempt: 2,
            summary: "The user asked for sums; 126 was the answer.".into(),
            usage: None,
            cost_micros: None,
        },
        Event::SummaryCallFailed {
            turn: 7,
            attempt: 1,
            failure: ActivityFailure::new(ErrorClass::Overloaded, "overloaded"),
            cost_micros: None,
        },
    ]
}

#[test]
fn every_event_kind_has_golden_bytes_that_decode_and_reencode_identically() {
    let dir = golden_dir().join("events");
    let mut kinds = Vec::new();
    for (i, event) in sample_events().into_iter().enumerate() {
        let kind = event.kind();
        kinds.push(kind);
        let envelope = EventEnvelope::new("golden-session", i as u64 + 1, 1_700_000_000_000, event);
        assert_golden_record(&format!("v1-{kind}.bin"), &envelope);
    }
    // Every kind is covered, in both formats: a new kind without a golden file fails here.
    let mut expected: Vec<String> = kinds.iter().map(|k| format!("v1-{k}.bin")).collect();
    expected.sort();
    for dir in [dir.clone(), dir.join("format2")] {
        let mut found: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("v1-"))
            .collect();
        found.sort();
        assert_eq!(found, expected, "{}", dir.display());
    }
    assert_eq!(kinds.len(), 21);
}

/// A forked session's first event records its parent and seq; the field, added after v1,
/// is left out of every other record (the v1 files above are unchanged by it).
#[test]
fn a_forked_session_started_has_golden_bytes() {
    let Event::SessionStarted(mut started) = sample_events().remove(0) else {
        panic!("the first sample is a session_started");
    };
    started.forked_from = Some(ForkOrigin {
        session_id: "parent".into(),
        seq: 7,
    });
    let envelope = EventEnvelope::new(
        "golden-fork",
        1,
        1_700_000_000_000,
        Event::SessionStarted(started),
    );
    assert_golden_record("fork-session_started.bin", &envelope);
}

/// A session_started with a tool policy; the field, added after v1, is left out of every
/// record without one (the v1 files above are unchanged by it).
#[test]
fn a_session_started_with_a_tool_policy_has_golden_bytes() {
    let Event::SessionStarted(mut started) = sample_events().remove(0) else {
        panic!("the first sample is a session_started");
    };
    started.tool_policy = Some(
        serde_json::from_str(
            r#"{"rules":[{"tool":"shell","decision":"allow","prefix":"git status","argument":"command","kind":"command"},
                         {"tool":"read_file","decision":"deny","prefix":"secrets","argument":"path","kind":"path"},
                         {"tool":"shell","decision":"ask"}],
                "default":"ask","approval_timeout_ms":600000}"#,
        )
        .unwrap(),
    );
    let envelope = EventEnvelope::new(
        "golden-policy",
        1,
        1_700_000_000_000,
        Event::SessionStarted(started),
    );
    assert_golden_record("policy-session_started.bin", &envelope);
}

/// The events that carry costs, budgets and usage so far, added after v1: each field is
/// left out of every record without it (the v1 files above are unchanged by them), and these
/// files pin the records with them.
#[test]
fn cost_and_budget_fields_have_golden_bytes() {
    let samples = sample_events();
    let budget = Budget {
        max_tokens: Some(100_000),
        max_cost_micros: Some(2_500_000),
        max_model_calls: Some(20),
    };
    let mut cases = Vec::new();
    for event in samples {
        let with = match event {
            Event::SessionStarted(mut started) => {
                started.limits.turn_budget = Budget {
                    max_model_calls: None,
                    ..budget
                };
                started.limits.session_budget = budget;
                Event::SessionStarted(started)
            }
            Event::ModelCallCompleted {
                turn,
                round,
                attempt,
                response,
                ..
            } => Event::ModelCallCompleted {
                turn,
                round,
                attempt,
                response,
                cost_micros: Some(1_234),
            },
            Event::ModelCallFailed {
                turn,
                round,
                attempt,
                mut failure,
                ..
            } => {
                failure.usage = Some(Usage {
                    input_tokens: 7,
                    output_tokens: 3,
                    ..Usage::default()
                });
                Event::ModelCallFailed {
                    turn,
                    round,
                    attempt,
                    failure,
                    cost_micros: Some(66),
                }
            }
            Event::TurnFailed { turn, .. } => Event::TurnFailed {
                turn,
                reason: "turn budget exceeded: max_tokens 100 tokens, 120 used".into(),
                budget_exceeded: Some(BudgetExceeded {
                    limit: BudgetLimit::Tokens,
                    scope: BudgetScope::Turn,
                    limit_value: 100,
                    used: 120,
                    cost_unknown: false,
                }),
            },
            Event::ModelAttemptProgress {
                turn,
                round,
                attempt,
                lease_attempt,
                text_appended,
                thinking_appended,
                ..
            } => Event::ModelAttemptProgress {
                turn,
                round,
                attempt,
                lease_attempt,
                text_appended,
                thinking_appended,
                usage: Some(Usage {
                    input_tokens: 900,
                    cache_read_tokens: 100,
                    ..Usage::default()
                }),
                cost_micros: Some(2_730),
            },
            _ => continue,
        };
        cases.push(with);
    }
    assert_eq!(cases.len(), 5);
    for (i, event) in cases.into_iter().enumerate() {
        let kind = event.kind();
        let envelope = EventEnvelope::new("golden-budget", i as u64 + 1, 1_700_000_000_000, event);
        assert_golden_record(&format!("budget-{kind}.bin"), &envelope);
    }
}

/// Records of compaction beside the event kinds: a session_started with a compaction policy
/// (the field, added after v1, is left out of every record without one) and a model call that
/// failed because the context is too long (a class added after v1).
#[test]
fn compaction_records_have_golden_bytes() {
    let Event::SessionStarted(mut started) = sample_events().remove(0) else {
        panic!("the first sample is a session_started");
    };
    started.compaction = Some(CompactionPolicy {
        threshold_tokens: Some(150_000),
        strategies: vec![
            CompactionStrategy::DropFailedToolResults,
            CompactionStrategy::KeepLastTurns,
        ],
        keep_last_turns: 3,
        summarize: true,
    });
    let failed = Event::ModelCallFailed {
        turn: 2,
        round: 0,
        attempt: 1,
        failure: ActivityFailure::new(
            ErrorClass::ContextTooLong,
            "prompt is too long: 210000 tokens > 200000 maximum",
        ),
        cost_micros: None,
    };
    for (name, event) in [
        ("compaction-session_started", Event::SessionStarted(started)),
        ("context_too_long-model_call_failed", failed),
    ] {
        let envelope = EventEnvelope::new("golden-compaction", 1, 1_700_000_000_000, event);
        assert_golden_record(&format!("{name}.bin"), &envelope);
    }
}

/// A session_started that records its tools' working directory; the field, added after v1,
/// is left out of every record without one (the v1 files above are unchanged by it).
#[test]
fn a_session_started_with_a_workdir_has_golden_bytes() {
    let Event::SessionStarted(mut started) = sample_events().remove(0) else {
        panic!("the first sample is a session_started");
    };
    started.workdir = Some("/home/someone/project".into());
    let envelope = EventEnvelope::new(
        "golden-workdir",
        1,
        1_700_000_000_000,
        Event::SessionStarted(started),
    );
    let decoded = assert_golden_record("workdir-session_started.bin", &envelope);
    let Event::SessionStarted(decoded) = decoded.event else {
        panic!("a session_started decodes as one");
    };
    assert_eq!(decoded.workdir.as_deref(), Some("/home/someone/project"));
}

#[test]
fn corrupt_or_unknown_records_are_typed_errors() {
    let envelope = EventEnvelope::new("s", 1, 5, Event::SessionCancelled { reason: "x".into() });
    let good = codec::encode(&envelope).unwrap();
    let mut flipped = good.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    assert!(matches!(
        codec::decode("s", 1, &flipped),
        Err(Error::CorruptRecord { ref session_id, seq: 1, ref reason }) if session_id == "s" && reason.contains("checksum")
    ));
    assert!(matches!(
        codec::decode("s", 1, &good[..3]),
        Err(Error::CorruptRecord { ref reason, .. }) if reason.contains("truncated")
    ));
    // A record from a future schema version.
    let mut future = envelope.clone();
    future.schema_version = 99;
    let bytes = codec::encode(&future).unwrap();
    assert!(matches!(
        codec::decode("s", 1, &bytes),
        Err(Error::UnknownSchemaVersion {
            version: 99,
            seq: 1,
            ..
        })
    ));
    // A record stored under the wrong key.
    assert!(matches!(
        codec::decode("s", 2, &good),
        Err(Error::CorruptRecord { seq: 2, .. })
    ));
}

/// The demo session, run on the memory store with a frozen clock and one worker so that the
/// history is the same on every run, compared as text with the checked-in files.
#[tokio::test]
async fn the_demo_session_matches_its_golden_history_and_transcript() {
    let files = demo_files(cairn::demo::DEMO_SCRIPT);
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let store = Arc::new(MemoryStore::new());
    let host = TestHost::start_with_models(
        store.clone(),
        clock,
        &files.workdir,
        WorkerConfig {
            concurrency: 1,
            // Progress records depend on how fast the stream runs; this history must not.
            progress_interval_ms: None,
            ..WorkerConfig::default()
        },
        cairn_workers::StandardModels::with_script_dir(files.dir.path()),
    );
    let mut options = host.session_options(Path::new("script.json"), "golden-demo");
    options.system_prompt = Some("You are a concise assistant. Use tools when they help.".into());
    let session = host.client.start_session(options).await.unwrap();
    let outcome = host
        .client
        .run_turn(&session, cairn::demo::DEMO_PROMPT)
        .await
        .unwrap();
    assert!(
        matches!(&outcome, TurnOutcome::Completed { answer, .. } if answer.contains("126") && answer.contains("Tuesday"))
    );
    let history = host.client.history(&session).await.unwrap();
    let transcript = host.client.transcript(&session).await.unwrap();
    host.shutdown().await;

    let mut history_text = String::new();
    for e in &history {
        history_text.push_str(&serde_json::to_string(e).unwrap());
        history_text.push('\n');
    }
    let transcript_text = String::from_utf8(transcript.canonical_json()).unwrap() + "\n";
    check_text("sessions/demo.history.jsonl", &history_text);
    check_text("sessions/demo.transcript.json", &transcript_text);

    // The recorded history replays to the same ledger bytes.
    let replayed = replay(&session, &history).unwrap();
    assert_eq!(
        replayed.state.transcript.canonical_json(),
        transcript.canonical_json()
    );
    validate_transcript(&transcript).unwrap();
}

fn check_text(relative: &str, actual: &str) {
    let path = golden_dir().join(relative);
    if bless() || !path.exists() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap();
    if expected != actual {
        let line = expected
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b)
            .map_or(expected.lines().count().min(actual.lines().count()), |i| i);
        panic!(
            "{} differs at line {} (run with CAIRN_BLESS=1 if the change is intended)\nexpected: {}\nactual:   {}",
            path.display(),
            line + 1,
            expected.lines().nth(line).unwrap_or("<end>"),
            actual.lines().nth(line).unwrap_or("<end>")
        );
    }
}

/// Issue 14 §2's shapes, added after v1 and left out of records without them: a session's
/// call options, a turn's tool choice, and a response with an opaque part and cited text.
#[test]
fn call_options_tool_choice_and_opaque_parts_have_golden_bytes() {
    let Event::SessionStarted(mut started) = sample_events().remove(0) else {
        panic!("the first sample is a session_started");
    };
    started.call_options = CallOptions {
        tool_choice: Some(ToolChoice::Tool("calculator".into())),
        server_tools: vec![
            ServerTool {
                kind: ServerToolKind::WebSearch,
                max_uses: Some(3),
            },
            ServerTool {
                kind: ServerToolKind::WebFetch,
                max_uses: None,
            },
        ],
        no_prompt_cache: true,
    };
    let family = |json: &str| ProviderJson::new("anthropic", JsonText::parse(json).unwrap());
    let events = [
        ("session_started", Event::SessionStarted(started)),
        (
            "user_message",
            Event::UserMessage {
                idempotency_key: None,
                turn: 1,
                text: "search".into(),
                model: None,
                media: Vec::new(),
                tool_choice: Some(ToolChoice::None),
            },
        ),
        (
            "model_call_completed",
            Event::ModelCallCompleted {
                turn: 1,
                round: 0,
                attempt: 1,
                response: ModelResponse {
                    provider: "anthropic".into(),
                    model: "claude-sonnet-4-5".into(),
                    parts: vec![
                        Part::Opaque(family(
                            r#"{"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{"query": "x", "n": 9007199254740993}}"#,
                        )),
                        Part::Text {
                            text: "cited".into(),
                            item_id: None,
                            citations: Some(family(
                                r#"[{"type":"web_search_result_location","url":"https://e.example","cited_text":"c"}]"#,
                            )),
                        },
                    ],
                    stop_reason_raw: "end_turn".into(),
                    stop_reason: StopReason::EndTurn,
                    usage: Usage::default(),
                },
                cost_micros: None,
            },
        ),
    ];
    for (seq, (kind, event)) in events.into_iter().enumerate() {
        let envelope =
            EventEnvelope::new("golden-options", seq as u64 + 1, 1_700_000_000_000, event);
        assert_golden_record(&format!("options-{kind}.bin"), &envelope);
    }
}

/// A user message sent under an idempotency key: the field, added after format 2, is left
/// out of every message sent without one (the records above are unchanged by it).
#[test]
fn a_user_message_sent_under_an_idempotency_key_has_golden_bytes() {
    let envelope = EventEnvelope::new(
        "golden-keyed",
        2,
        1_700_000_000_000,
        Event::UserMessage {
            turn: 1,
            text: "once".into(),
            model: None,
            media: Vec::new(),
            tool_choice: None,
            idempotency_key: Some("0b4f5a1e-2c3d-4e5f-8a9b-0c1d2e3f4a5b".into()),
        },
    );
    let decoded = assert_format2_record("keyed-user_message.bin", &envelope);
    let Event::UserMessage {
        idempotency_key, ..
    } = decoded.event
    else {
        panic!("a user_message decodes as one");
    };
    assert_eq!(
        idempotency_key.as_deref(),
        Some("0b4f5a1e-2c3d-4e5f-8a9b-0c1d2e3f4a5b")
    );
}
