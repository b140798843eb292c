//! The worker protocol's messages (`ActivityInput`, `ActivityReport`, `Lease`, `DeltaEvent`)
//! round-trip through JSON and named msgpack unchanged, including the parts that must stay
//! byte-exact: signed thinking, tool arguments as the model wrote them, JSON results verbatim.
//! They are what a remote worker will receive and send.

use cairn_ledger::*;
use cairn_runtime::store::{Lease, TaskId, TaskKind};
use cairn_runtime::*;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Debug;

/// The golden demo history, decoded.
fn demo_history() -> Vec<EventEnvelope> {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden/sessions/demo.history.jsonl"),
    )
    .expect("the golden demo history");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a history line"))
        .collect()
}

fn round_trips<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) {
    let json = serde_json::to_string(value).expect("to json");
    let back: T = serde_json::from_str(&json).expect("from json");
    assert_eq!(&back, value, "through JSON: {json}");
    let packed = rmp_serde::to_vec_named(value).expect("to msgpack");
    let back: T = rmp_serde::from_slice(&packed).expect("from msgpack");
    assert_eq!(&back, value, "through msgpack");
}

#[test]
fn worker_protocol_messages_round_trip_byte_exact() {
    let history = demo_history();
    let replayed = replay(&history[0].session_id, &history).expect("the demo replays");
    let transcript = replayed.state.transcript.clone();
    assert!(
        String::from_utf8_lossy(&transcript.canonical_json()).contains("demo-signature-0001"),
        "the transcript carries signed thinking"
    );
    let origin = ActivityRef {
        session_id: "golden-demo".to_owned(),
        turn: 1,
        activity: "model:1".to_owned(),
        attempt: 2,
    };
    let timeouts = ActivityTimeouts {
        due_at_ms: 1_700_000_000_000,
        schedule_to_start_ms: Some(1_000),
        start_to_close_ms: 60_000,
        heartbeat_ms: None,
    };
    let model = ActivityInput::Model {
        options: Default::default(),
        origin: origin.clone(),
        round: 1,
        model: ModelSpec::parse("scripted:demo.json").expect("spec"),
        transcript,
        transcript_lineage: Some(7),
        transcript_left_out: 3,
        tools: Vec::new().into(),
        tools_digest: None,
        tools_omitted: false,
        timeouts,
        heartbeat_details: Some(JsonText::parse(r#"{"n": 9007199254740993}"#).expect("json")),
    };
    round_trips(&model);
    let json = serde_json::to_string(&model).expect("json");
    assert!(
        json.contains("9007199254740993"),
        "big numbers stay exact: {json}"
    );

    let mut reports = Vec::new();
    for e in &history {
        match &e.event {
            Event::ModelCallCompleted { response, .. } => {
                reports.push(ActivityReport::ModelCompleted(response.clone()))
            }
            Event::ToolCallCompleted {
                content, is_error, ..
            } => reports.push(ActivityReport::ToolCompleted {
                content: content.clone(),
                is_error: *is_error,
            }),
            _ => {}
        }
    }
    // Tool calls exactly as the model wrote their arguments.
    let tool_uses: Vec<ToolUse> = replayed
        .state
        .transcript
        .messages
        .iter()
        .flat_map(|m| m.parts.iter())
        .filter_map(|p| match p {
            Part::ToolUse(t) => Some(t.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(tool_uses.len(), 2, "the demo makes two tool calls");
    for tool_use in tool_uses {
        round_trips(&ActivityInput::Tool {
            origin: origin.clone(),
            idempotency_key: format!("golden-demo/{}", tool_use.id),
            tool_use: tool_use.clone(),
            timeouts,
            heartbeat_details: None,
            workdir: None,
            file_versions: Vec::new(),
        });
        // A session that recorded its tools' directory sends it with each call.
        round_trips(&ActivityInput::Tool {
            origin: origin.clone(),
            idempotency_key: format!("golden-demo/{}", tool_use.id),
            tool_use,
            timeouts,
            heartbeat_details: None,
            workdir: Some("/home/someone/project".into()),
            file_versions: Vec::new(),
        });
    }
    // An edit's input carries what the session last saw of each file; other inputs encode
    // as before, without the field.
    let without = ActivityInput::Tool {
        origin: origin.clone(),
        idempotency_key: "k".into(),
        tool_use: ToolUse {
            id: "t".into(),
            name: "calculator".into(),
            arguments: "{}".into(),
            signature: None,
        },
        timeouts,
        heartbeat_details: None,
        workdir: None,
        file_versions: Vec::new(),
    };
    assert!(!serde_json::to_string(&without)
        .unwrap()
        .contains("file_versions"));
    round_trips(&ActivityInput::Tool {
        origin: origin.clone(),
        idempotency_key: "golden-demo/toolu_edit".into(),
        tool_use: ToolUse {
            id: "toolu_edit".into(),
            name: "edit_file".into(),
            arguments: r#"{"path":"notes.txt","old_string":"a","new_string":"b"}"#.into(),
            signature: None,
        },
        timeouts,
        heartbeat_details: None,
        workdir: None,
        file_versions: vec![cairn_ledger::file_versions::FileVersion {
            path: "notes.txt".into(),
            sha256: cairn_ledger::file_versions::sha256_hex(b"a"),
        }],
    });
    assert!(reports.len() >= 3, "the demo has model and tool results");
    for report in &reports {
        round_trips(report);
    }
    round_trips(&Lease {
        id: TaskId {
            session_id: "golden-demo".to_owned(),
            scheduled_seq: 3,
        },
        kind: TaskKind::Model,
        lease_attempt: 4,
        expires_at_ms: 1_700_000_005_000,
    });
    round_trips(&DeltaEvent {
        origin,
        delta: Delta::Text("partial".to_owned()),
    });
}
