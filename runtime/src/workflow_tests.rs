//! Workflow scenarios, each run live (inputs stepped as the engine does) and then as a full
//! replay of the recorded history: the commands and the ledger bytes must match.

use crate::error::Error;
use crate::event::*;
use crate::replay::replay;
use crate::store::{NewTask, TaskId, TaskKind};
use crate::workflow::{Command, SessionState, Transition, TurnOutcome};
use cairn_ledger::*;

pub(super) const SID: &str = "wf-test";

/// Drives a session like the engine: step the input, record the events the step returns.
pub(super) struct Live {
    pub(super) state: SessionState,
    pub(super) events: Vec<EventEnvelope>,
    pub(super) commands: Vec<(u64, Command)>,
    pub(super) now: u64,
}

impl Live {
    pub(super) fn new(started: SessionStarted) -> Self {
        let mut live = Live {
            state: SessionState::new(SID),
            events: Vec::new(),
            commands: Vec::new(),
            now: 1_000,
        };
        live.input(Event::SessionStarted(started));
        live
    }

    pub(super) fn try_step(&mut self, event: Event) -> Result<Transition, Error> {
        self.now += 10;
        let input = EventEnvelope::new(SID, self.state.next_seq, self.now, event);
        let seq = input.seq;
        let transition = self.state.step(input)?;
        assert_eq!(transition.events.len(), 1 + transition.commands.len());
        for c in &transition.commands {
            self.commands.push((seq, c.clone()));
        }
        self.events.extend(transition.events.iter().cloned());
        Ok(transition)
    }

    pub(super) fn try_input(&mut self, event: Event) -> Result<Vec<Command>, Error> {
        Ok(self.try_step(event)?.commands)
    }

    pub(super) fn step(&mut self, event: Event) -> Transition {
        self.try_step(event).unwrap()
    }

    pub(super) fn input(&mut self, event: Event) -> Vec<Command> {
        self.step(event).commands
    }

    /// The full replay must reproduce every command and the same ledger bytes.
    pub(super) fn check_replay(&self) {
        let replayed = replay(SID, &self.events).unwrap();
        assert_eq!(replayed.commands, self.commands);
        assert_eq!(
            replayed.state.transcript.canonical_json(),
            self.state.transcript.canonical_json()
        );
        assert_eq!(replayed.state, self.state);
        // A fold reads each tool's required arguments once (a memo the step-by-step replay
        // above does not keep): the same state either way.
        assert_eq!(SessionState::fold(SID, &self.events).unwrap(), self.state);
        validate_transcript(&self.state.transcript).unwrap();
    }
}

pub(super) fn started(max_rounds: u32) -> SessionStarted {
    SessionStarted {
        call_options: Default::default(),
        queues: Default::default(),
        forked_from: None,
        workflow_version: crate::workflow::WORKFLOW_VERSION,
        tool_policy: None,
        compaction: None,
        model: ModelSpec::parse("scripted:test.json").unwrap(),
        tools: vec![
            ToolSpec {
                name: "calculator".into(),
                description: "math".into(),
                input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
            },
            ToolSpec {
                name: "read_file".into(),
                description: "files".into(),
                input_schema: JsonText::parse(r#"{"type":"object"}"#).unwrap(),
            },
        ]
        .into(),
        system_prompt: Some("be brief".into()),
        limits: Limits {
            max_rounds,
            ..Limits::default()
        },
        model_retry: RetryPolicy {
            initial_interval_ms: 100,
            backoff_coefficient: 2.0,
            maximum_interval_ms: 1000,
            maximum_attempts: 2,
            non_retryable: vec![ErrorClass::InvalidRequest],
            start_to_close_timeout_ms: 5000,
            ..RetryPolicy::model_default()
        },
        tool_retry: RetryPolicy {
            maximum_attempts: 2,
            ..RetryPolicy::tool_default()
        },
        workdir: None,
    }
}

pub(super) fn tool_use(id: &str, name: &str, args: &str) -> Part {
    Part::ToolUse(ToolUse {
        id: id.into(),
        name: name.into(),
        arguments: args.into(),
        signature: None,
    })
}

pub(super) fn response(parts: Vec<Part>, stop: StopReason) -> ModelResponse {
    ModelResponse {
        provider: "scripted".into(),
        model: "test".into(),
        parts,
        stop_reason_raw: format!("{stop:?}"),
        stop_reason: stop,
        usage: Usage {
            input_tokens: 10,
            output_tokens: 5,
            ..Usage::default()
        },
    }
}

/// Totals of `calls` model calls that used these tokens, `unpriced` of them without a cost.
fn totals(input: u64, output: u64, calls: u32, unpriced: u32) -> crate::budget::UsageTotals {
    crate::budget::UsageTotals {
        usage: Usage {
            input_tokens: input,
            output_tokens: output,
            ..Usage::default()
        },
        cost_micros: 0,
        unpriced_attempts: unpriced,
        model_calls: calls,
    }
}

fn thinking(text: &str) -> Part {
    Part::Thinking {
        text: text.into(),
        signature: format!("sig-{text}"),
    }
}

pub(super) fn text(t: &str) -> Part {
    Part::text(t)
}

pub(super) fn user(turn: u32, t: &str) -> Event {
    Event::UserMessage {
        idempotency_key: None,
        tool_choice: None,
        turn,
        text: t.into(),
        model: None,
        media: Vec::new(),
    }
}

pub(super) fn model_done(turn: u32, round: u32, attempt: u32, r: ModelResponse) -> Event {
    Event::ModelCallCompleted {
        turn,
        round,
        attempt,
        response: r,
        cost_micros: None,
    }
}

pub(super) fn tool_done(turn: u32, id: &str, attempt: u32, content: &str) -> Event {
    Event::ToolCallCompleted {
        turn,
        tool_use_id: id.into(),
        attempt,
        content: ToolResultContent::Json(JsonText::parse(content).unwrap()),
        is_error: false,
    }
}

fn failed(class: ErrorClass) -> ActivityFailure {
    ActivityFailure::new(class, "boom")
}

/// A session started under workflow rules this code does not have (a newer cairn's) is
/// refused, live and on replay, naming the version: never run under older rules. Version 0,
/// which older code took for 1, is refused for a new session but still folds.
#[test]
fn a_workflow_version_this_code_does_not_have_is_refused() {
    let at = |version: u32| {
        let started = SessionStarted {
            workflow_version: version,
            ..started(8)
        };
        EventEnvelope::new(SID, 1, 1_000, Event::SessionStarted(started))
    };
    for version in [crate::workflow::WORKFLOW_VERSION + 1, u32::MAX] {
        let expected = format!(
            "workflow version {version} is not one this cairn has (1 to {}): the session was \
             started by a newer cairn",
            crate::workflow::WORKFLOW_VERSION
        );
        match SessionState::new(SID).step(at(version)) {
            Err(Error::InvalidEvent { seq: 1, reason, .. }) => assert_eq!(reason, expected),
            other => panic!("version {version}: {other:?}"),
        }
        match replay(SID, &[at(version)]) {
            Err(Error::InvalidEvent { seq: 1, reason, .. }) => assert_eq!(reason, expected),
            other => panic!("version {version}: {:?}", other.map(|r| r.commands)),
        }
    }
    match SessionState::new(SID).step(at(0)) {
        Err(Error::InvalidEvent { seq: 1, reason, .. }) => assert_eq!(
            reason,
            format!(
                "workflow version 0 is not one this cairn has (1 to {})",
                crate::workflow::WORKFLOW_VERSION
            )
        ),
        other => panic!("version 0: {other:?}"),
    }
    assert!(replay(SID, &[at(0)]).is_ok(), "a recorded version 0 folds");
}

/// A new session whose retry policy's backoff coefficient is not a finite number (which
/// only the Rust API can give: JSON has none) is refused naming the field: its export could
/// not be imported again. Nothing is recorded.
#[test]
fn a_retry_coefficient_that_is_not_a_number_is_refused_at_the_start() {
    for (coefficient, words) in [(f64::NAN, "NaN"), (f64::INFINITY, "inf")] {
        let mut state = SessionState::new(SID);
        let mut bad = started(8);
        bad.tool_retry.backoff_coefficient = coefficient;
        let event = EventEnvelope::new(SID, 1, 1_000, Event::SessionStarted(bad));
        match state.step(event) {
            Err(Error::InvalidEvent { seq: 1, reason, .. }) => assert_eq!(
                reason,
                format!("tool_retry: backoff_coefficient must be a finite number, not {words}")
            ),
            other => panic!("{coefficient}: {:?}", other.map(|t| t.events.len())),
        }
        assert_eq!(state.next_seq, 1, "nothing was applied");
    }
}

#[test]
fn a_turn_with_two_parallel_tools_finishing_out_of_order() {
    let mut live = Live::new(started(8));
    let c = live.input(user(1, "what is (17+25)*3?"));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall {
            turn: 1,
            round: 0,
            attempt: 1,
            ..
        }]
    ));
    let c = live.input(model_done(
        1,
        0,
        1,
        response(
            vec![
                thinking("plan"),
                text("Using tools."),
                tool_use("t1", "calculator", r#"{"expression":"(17+25)*3"}"#),
                thinking("between"),
                tool_use("t2", "read_file", r#"{"path":"notes.txt"}"#),
            ],
            StopReason::ToolUse,
        ),
    ));
    assert_eq!(c.len(), 2);
    assert!(matches!(&c[0], Command::ScheduleToolCall { tool_use_id, .. } if tool_use_id == "t1"));
    assert!(matches!(&c[1], Command::ScheduleToolCall { tool_use_id, .. } if tool_use_id == "t2"));
    // t2 finishes first; nothing happens until t1 is in.
    assert!(live.input(tool_done(1, "t2", 1, r#""notes""#)).is_empty());
    let c = live.input(tool_done(1, "t1", 1, r#"{"value":126}"#));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall {
            round: 1,
            attempt: 1,
            ..
        }]
    ));
    // Results are in declaration order, whatever the completion order.
    let results = &live.state.transcript.messages.last().unwrap().parts;
    assert!(matches!(&results[0], Part::ToolResult(r) if r.tool_use_id == "t1"));
    assert!(matches!(&results[1], Part::ToolResult(r) if r.tool_use_id == "t2"));
    let c = live.input(model_done(
        1,
        1,
        1,
        response(
            vec![thinking("done"), text("It is 126.")],
            StopReason::EndTurn,
        ),
    ));
    assert!(
        matches!(c[..], [Command::CompleteTurn { turn: 1, usage }] if usage.input_tokens == 20)
    );
    assert_eq!(
        live.state.last_outcome,
        Some(TurnOutcome::Completed {
            turn: 1,
            answer: "It is 126.".into(),
            stop_reason: Some(StopReason::EndTurn),
            // Two rounds of 10 + 5 tokens, recorded without a cost.
            totals: totals(20, 10, 2, 2)
        })
    );
    assert!(!live.state.is_running());
    // Thinking stays byte-exact and in place (interleaved, not hoisted).
    let assistant = &live.state.transcript.messages[2];
    assert_eq!(assistant.parts[3], thinking("between"));
    live.check_replay();
}

#[test]
fn unknown_tools_and_invalid_arguments_become_error_results_at_once() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    let c = live.input(model_done(
        1,
        0,
        1,
        response(
            vec![
                tool_use("a", "no_such_tool", "{}"),
                tool_use("b", "calculator", "{not json"),
            ],
            StopReason::ToolUse,
        ),
    ));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { round: 1, .. }]
    ));
    let results = &live.state.transcript.messages.last().unwrap().parts;
    let Part::ToolResult(a) = &results[0] else {
        panic!()
    };
    assert!(a.is_error);
    assert!(
        matches!(&a.content, ToolResultContent::Text(t) if t.contains("unknown tool \"no_such_tool\""))
    );
    let Part::ToolResult(b) = &results[1] else {
        panic!()
    };
    assert!(b.is_error);
    assert!(
        matches!(&b.content, ToolResultContent::Text(t) if t.contains("invalid tool arguments"))
    );
    live.input(model_done(
        1,
        1,
        1,
        response(vec![text("sorry")], StopReason::EndTurn),
    ));
    live.check_replay();
}

#[test]
fn required_arguments_are_checked_at_every_call_and_a_fold_gives_the_same_state() {
    let mut s = started(8);
    let mut tools = s.tools.to_vec();
    tools[0].input_schema = JsonText::parse(
        r#"{"type":"object","properties":{"expression":{"type":"string"}},"required":["expression"]}"#,
    )
    .unwrap();
    tools[1].input_schema =
        JsonText::parse(r#"{"required":["path"],"properties":{"path":{"required":["no"]}}}"#)
            .unwrap();
    s.tools = tools.into();
    let mut live = Live::new(s);
    live.input(user(1, "go"));
    let error_of = |live: &Live, index: usize| -> Option<String> {
        let parts = &live.state.transcript.messages.last().unwrap().parts;
        match &parts[index] {
            Part::ToolResult(r) if r.is_error => match &r.content {
                ToolResultContent::Text(t) => Some(t.clone()),
                _ => None,
            },
            _ => None,
        }
    };
    // Round 0: the calculator misses its argument; read_file has it and is scheduled.
    let c = live.input(model_done(
        1,
        0,
        1,
        response(
            vec![
                tool_use("a", "calculator", "{}"),
                tool_use("b", "read_file", r#"{"path":"x"}"#),
            ],
            StopReason::ToolUse,
        ),
    ));
    assert!(
        matches!(&c[..], [Command::ScheduleToolCall { tool_use_id, .. }] if tool_use_id == "b")
    );
    live.input(tool_done(1, "b", 1, r#""contents""#));
    assert!(error_of(&live, 0)
        .unwrap()
        .contains("missing required argument \"expression\" (calculator requires: expression)"));
    assert_eq!(error_of(&live, 1), None);
    // Round 1: the same tools, the other way round.
    let c = live.input(model_done(
        1,
        1,
        1,
        response(
            vec![
                tool_use("c", "calculator", r#"{"expression":"1+1"}"#),
                tool_use("d", "read_file", "{}"),
            ],
            StopReason::ToolUse,
        ),
    ));
    assert!(
        matches!(&c[..], [Command::ScheduleToolCall { tool_use_id, .. }] if tool_use_id == "c")
    );
    live.input(tool_done(1, "c", 1, "2"));
    assert_eq!(error_of(&live, 0), None);
    assert!(error_of(&live, 1)
        .unwrap()
        .contains("missing required argument \"path\" (read_file requires: path)"));
    live.input(model_done(
        1,
        2,
        1,
        response(vec![text("done")], StopReason::EndTurn),
    ));
    live.check_replay();
}

#[test]
fn tool_failures_retry_then_become_an_error_result() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    live.input(model_done(
        1,
        0,
        1,
        response(vec![tool_use("t", "calculator", "{}")], StopReason::ToolUse),
    ));
    let c = live.input(Event::ToolCallFailed {
        turn: 1,
        tool_use_id: "t".into(),
        attempt: 1,
        failure: failed(ErrorClass::Transient),
    });
    let now = live.now;
    assert!(
        matches!(&c[..], [Command::ScheduleToolCall { attempt: 2, not_before_ms, .. }] if *not_before_ms == now + 1000)
    );
    // A late report of attempt 1 is stale and changes nothing.
    let before = live.state.clone();
    let err = live.try_input(tool_done(1, "t", 1, "1")).unwrap_err();
    assert!(matches!(err, Error::StaleReport { .. }), "{err}");
    assert_eq!(live.state, before);
    let c = live.input(Event::ToolCallFailed {
        turn: 1,
        tool_use_id: "t".into(),
        attempt: 2,
        failure: failed(ErrorClass::Transient),
    });
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { round: 1, .. }]
    ));
    let Part::ToolResult(r) = &live.state.transcript.messages.last().unwrap().parts[0] else {
        panic!()
    };
    assert!(r.is_error);
    assert!(
        matches!(&r.content, ToolResultContent::Text(t) if t.starts_with("tool failed after 2 attempt(s): transient"))
    );
    live.input(model_done(
        1,
        1,
        1,
        response(vec![text("ok")], StopReason::EndTurn),
    ));
    live.check_replay();
}

#[test]
fn a_model_call_that_keeps_failing_fails_the_turn_and_the_next_turn_works() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    let c = live.input(Event::ModelCallFailed {
        turn: 1,
        round: 0,
        attempt: 1,
        failure: ActivityFailure {
            usage: Some(Usage {
                input_tokens: 7,
                ..Usage::default()
            }),
            ..failed(ErrorClass::Overloaded)
        },
        cost_micros: None,
    });
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { attempt: 2, .. }]
    ));
    let c = live.input(Event::ModelCallFailed {
        turn: 1,
        round: 0,
        attempt: 2,
        failure: failed(ErrorClass::Overloaded),
        cost_micros: None,
    });
    assert!(
        matches!(&c[..], [Command::FailTurn { turn: 1, reason, .. }] if reason.contains("after 2 attempt(s): overloaded"))
    );
    assert!(matches!(
        live.state.last_outcome,
        Some(TurnOutcome::Failed { turn: 1, .. })
    ));
    assert_eq!(
        live.state.usage.input_tokens, 7,
        "usage of failed attempts counts"
    );
    // A non-retryable class fails at once.
    live.input(user(2, "again"));
    let c = live.input(Event::ModelCallFailed {
        turn: 2,
        round: 0,
        attempt: 1,
        failure: failed(ErrorClass::InvalidRequest),
        cost_micros: None,
    });
    assert!(matches!(c[..], [Command::FailTurn { turn: 2, .. }]));
    live.input(user(3, "third"));
    live.input(model_done(
        3,
        0,
        1,
        response(vec![text("fine")], StopReason::EndTurn),
    ));
    live.check_replay();
}

#[test]
fn max_rounds_fails_the_turn_and_closes_open_tool_uses() {
    let mut live = Live::new(started(2));
    live.input(user(1, "loop"));
    live.input(model_done(
        1,
        0,
        1,
        response(vec![tool_use("a", "calculator", "{}")], StopReason::ToolUse),
    ));
    live.input(tool_done(1, "a", 1, "1"));
    let c = live.input(model_done(
        1,
        1,
        1,
        response(vec![tool_use("b", "calculator", "{}")], StopReason::ToolUse),
    ));
    assert!(matches!(&c[..], [Command::FailTurn { reason, .. }] if reason.contains("max_rounds")));
    let Part::ToolResult(r) = &live.state.transcript.messages.last().unwrap().parts[0] else {
        panic!()
    };
    assert!(r.is_error && r.tool_use_id == "b");
    // The transcript is valid for the next turn.
    live.input(user(2, "next"));
    live.input(model_done(
        2,
        0,
        1,
        response(vec![text("ok")], StopReason::EndTurn),
    ));
    live.check_replay();
}

#[test]
fn cancellation_closes_unanswered_tool_uses_and_ends_the_session() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    live.input(model_done(
        1,
        0,
        1,
        response(
            vec![
                tool_use("a", "calculator", "{}"),
                tool_use("b", "read_file", "{}"),
            ],
            StopReason::ToolUse,
        ),
    ));
    live.input(tool_done(1, "a", 1, "1"));
    assert!(live
        .input(Event::SessionCancelled {
            reason: "user".into()
        })
        .is_empty());
    assert!(live.state.cancelled);
    let parts = &live.state.transcript.messages.last().unwrap().parts;
    assert!(matches!(&parts[0], Part::ToolResult(r) if !r.is_error));
    assert!(
        matches!(&parts[1], Part::ToolResult(r) if r.is_error && matches!(&r.content, ToolResultContent::Text(t) if t == "cancelled: user"))
    );
    assert!(live.try_input(user(2, "more")).is_err());
    live.check_replay();
}

#[test]
fn oversized_tool_results_are_projected_in_the_ledger_but_kept_whole_in_history() {
    let mut live = Live::new(started(8));
    live.input(user(1, "read"));
    live.input(model_done(
        1,
        0,
        1,
        response(
            vec![tool_use("big", "read_file", "{}")],
            StopReason::ToolUse,
        ),
    ));
    let big = "x".repeat(100_000);
    live.input(Event::ToolCallCompleted {
        turn: 1,
        tool_use_id: "big".into(),
        attempt: 1,
        content: ToolResultContent::Text(big.clone()),
        is_error: false,
    });
    let Part::ToolResult(r) = &live.state.transcript.messages.last().unwrap().parts[0] else {
        panic!()
    };
    assert!(
        matches!(&r.content, ToolResultContent::Json(j) if j.as_str().starts_with(r#"{"omitted":true"#))
    );
    assert!(live.events.iter().any(|e| matches!(&e.event, Event::ToolCallCompleted { content: ToolResultContent::Text(t), .. } if *t == big)));
    live.input(model_done(
        1,
        1,
        1,
        response(vec![text("ok")], StopReason::EndTurn),
    ));
    live.check_replay();
}

#[test]
fn invalid_inputs_are_rejected_without_changing_state() {
    let mut live = Live::new(started(8));
    let before = live.state.clone();
    for bad in [
        user(2, "skips turn 1"),
        model_done(1, 0, 1, response(vec![text("x")], StopReason::EndTurn)),
        tool_done(1, "nope", 1, "1"),
    ] {
        assert!(matches!(
            live.try_input(bad),
            Err(Error::InvalidEvent { .. })
        ));
        assert_eq!(live.state, before);
    }
    live.input(user(1, "go"));
    // A response that breaks the ledger's rules is rejected, not committed.
    let bad = response(vec![text("x"), thinking("last")], StopReason::EndTurn);
    let err = live.try_input(model_done(1, 0, 1, bad)).unwrap_err();
    assert!(
        err.to_string().contains("ends on a thinking block"),
        "{err}"
    );
    live.input(model_done(
        1,
        0,
        1,
        response(vec![text("ok")], StopReason::EndTurn),
    ));
    live.check_replay();
}

#[test]
fn a_response_with_media_is_refused_live_but_one_recorded_still_folds() {
    let with_media = response(
        vec![
            text("here"),
            Part::Media(Media::image_base64("image/png", "iVBORw0KGgo=")),
        ],
        StopReason::EndTurn,
    );
    let mut live = Live::new(started(8));
    live.input(user(1, "draw"));
    let before = live.state.clone();
    let seq = live.state.next_seq;
    let err = live
        .try_input(model_done(1, 0, 1, with_media.clone()))
        .unwrap_err();
    assert!(err.to_string().contains("response rejected"), "{err}");
    assert!(err.to_string().contains("image"), "{err}");
    assert!(
        matches!(err, Error::InvalidEvent { seq: at, .. } if at == seq),
        "{err:?}"
    );
    assert_eq!(live.state, before);

    // A history recorded before the rule: the event folds as it did.
    let mut recorded = live.events.clone();
    recorded.push(EventEnvelope::new(
        SID,
        seq,
        live.now,
        model_done(1, 0, 1, with_media.clone()),
    ));
    recorded.push(EventEnvelope::new(
        SID,
        seq + 1,
        live.now,
        Event::TurnCompleted {
            turn: 1,
            usage: with_media.usage,
        },
    ));
    let replayed = replay(SID, &recorded).unwrap();
    let last = replayed.state.transcript.messages.last().unwrap();
    assert!(matches!(last.parts[1], Part::Media(_)), "{last:?}");
}

#[test]
fn replaying_a_history_the_code_would_not_produce_names_the_event() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    live.input(model_done(
        1,
        0,
        1,
        response(
            vec![
                tool_use("a", "calculator", "{}"),
                tool_use("b", "read_file", "{}"),
            ],
            StopReason::ToolUse,
        ),
    ));
    // The untampered history replays to the live run's decisions and state.
    let replayed = replay(SID, &live.events).unwrap();
    assert_eq!(
        (&replayed.commands, &replayed.state),
        (&live.commands, &live.state)
    );
    // Swap the two recorded schedule events: a different decision order.
    let mut tampered = live.events.clone();
    let (i, j) = (4, 5);
    assert!(matches!(tampered[i].event, Event::ToolCallScheduled { .. }));
    let (ei, ej) = (tampered[i].event.clone(), tampered[j].event.clone());
    tampered[i].event = ej;
    tampered[j].event = ei;
    match replay(SID, &tampered) {
        Err(Error::Nondeterminism {
            seq,
            expected,
            found,
            ..
        }) => {
            assert_eq!(seq, 5);
            assert!(
                expected.contains("\"a\"") && found.contains("\"b\""),
                "{expected} / {found}"
            );
        }
        other => panic!("expected nondeterminism, got {other:?}"),
    }
    // A missing decision at the end is divergence too.
    let truncated = &live.events[..live.events.len() - 1];
    assert!(matches!(
        replay(SID, truncated),
        Err(Error::Nondeterminism { seq: 6, .. })
    ));
    // An extra decision the code never makes.
    let mut extra = live.events.clone();
    extra.push(EventEnvelope::new(
        SID,
        7,
        live.now,
        Event::TurnFailed {
            turn: 1,
            reason: "x".into(),
            budget_exceeded: None,
        },
    ));
    assert!(matches!(
        replay(SID, &extra),
        Err(Error::Nondeterminism { seq: 7, .. })
    ));
}

#[test]
fn a_cancelled_turn_closes_open_calls_and_the_session_goes_on() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    live.input(model_done(
        1,
        0,
        1,
        response(vec![tool_use("a", "calculator", "{}")], StopReason::ToolUse),
    ));
    assert!(live
        .try_input(Event::TurnCancelled {
            turn: 2,
            reason: "x".into()
        })
        .is_err());
    assert!(live
        .input(Event::TurnCancelled {
            turn: 1,
            reason: "stop".into()
        })
        .is_empty());
    assert_eq!(
        live.state.last_outcome,
        Some(TurnOutcome::Cancelled {
            turn: 1,
            reason: "stop".into(),
            totals: totals(10, 5, 1, 1)
        })
    );
    assert!(!live.state.cancelled);
    // The late result of the cancelled call is rejected.
    assert!(live.try_input(tool_done(1, "a", 1, "1")).is_err());
    live.input(user(2, "next"));
    live.input(model_done(
        2,
        0,
        1,
        response(vec![text("ok")], StopReason::EndTurn),
    ));
    live.check_replay();
}

#[test]
fn retries_carry_heartbeat_details_and_stop_at_the_schedule_to_close_deadline() {
    let mut s = started(8);
    s.tool_retry = RetryPolicy {
        initial_interval_ms: 100,
        backoff_coefficient: 1.0,
        maximum_interval_ms: 100,
        maximum_attempts: 0,
        non_retryable: vec![],
        start_to_close_timeout_ms: 1000,
        schedule_to_start_timeout_ms: None,
        schedule_to_close_timeout_ms: Some(150),
        heartbeat_timeout_ms: Some(50),
    };
    let mut live = Live::new(s);
    live.input(user(1, "go"));
    live.input(model_done(
        1,
        0,
        1,
        response(vec![tool_use("a", "calculator", "{}")], StopReason::ToolUse),
    ));
    let scheduled_at = live.now;
    let mut failure = ActivityFailure::new(ErrorClass::Timeout, "heartbeat timeout");
    failure.heartbeat_details = Some(JsonText::parse(r#"{"step":3}"#).unwrap());
    let c = live.input(Event::ToolCallFailed {
        turn: 1,
        tool_use_id: "a".into(),
        attempt: 1,
        failure,
    });
    assert!(
        matches!(&c[..], [Command::ScheduleToolCall { attempt: 2, not_before_ms, .. }] if *not_before_ms == live.now + 100)
    );
    // The next attempt is handed the details.
    let seq = live.events.last().unwrap().seq;
    match live.state.scheduled_activity(seq) {
        Some(crate::workflow::ScheduledActivity::Tool {
            heartbeat_details, ..
        }) => assert_eq!(heartbeat_details.unwrap().as_str(), r#"{"step":3}"#),
        other => panic!("{other:?}"),
    }
    // Attempt 2 fails 120 ms after the first schedule: a retry would start past the deadline.
    live.now = scheduled_at + 110;
    let c = live.input(Event::ToolCallFailed {
        turn: 1,
        tool_use_id: "a".into(),
        attempt: 2,
        failure: failed(ErrorClass::Transient),
    });
    assert!(matches!(c[..], [Command::ScheduleModelCall { .. }]));
    let Part::ToolResult(r) = &live.state.transcript.messages.last().unwrap().parts[0] else {
        panic!()
    };
    assert!(
        matches!(&r.content, ToolResultContent::Text(t) if t.contains("150 ms schedule-to-close deadline")),
        "{r:?}"
    );
    live.input(model_done(
        1,
        1,
        1,
        response(vec![text("ok")], StopReason::EndTurn),
    ));
    live.check_replay();
}

fn progress(turn: u32, round: u32, attempt: u32, lease_attempt: u32, text: &str) -> Event {
    Event::ModelAttemptProgress {
        turn,
        round,
        attempt,
        lease_attempt,
        text_appended: text.into(),
        thinking_appended: String::new(),
        cost_micros: None,
        usage: None,
    }
}

impl Live {
    /// Applies a presentation-only input the way the engine does, without moving the clock,
    /// so that a run with such inputs decides exactly what a run without them decides.
    fn note(&mut self, event: Event) {
        self.now -= 10;
        assert!(self.input(event).is_empty(), "progress decided something");
    }
}

/// One turn — a tool round whose model call is retried, then the answer — driven with or
/// without progress records of the streaming model calls.
fn streamed_turn(with_progress: bool) -> Live {
    let mut live = Live::new(started(8));
    live.input(user(1, "what is 6*7?"));
    if with_progress {
        live.note(progress(1, 0, 1, 1, "Let me "));
        // A crash: the same attempt runs again under a new lease and streams afresh.
        live.note(progress(1, 0, 1, 2, "Let me"));
        live.note(progress(1, 0, 1, 2, " compute."));
    }
    live.input(Event::ModelCallFailed {
        turn: 1,
        round: 0,
        attempt: 1,
        failure: failed(ErrorClass::Transient),
        cost_micros: None,
    });
    if with_progress {
        live.note(progress(1, 0, 2, 1, "Let me compute."));
    }
    live.input(model_done(
        1,
        0,
        2,
        response(
            vec![
                text("Let me compute."),
                tool_use("c1", "calculator", r#"{"expression":"6*7"}"#),
            ],
            StopReason::ToolUse,
        ),
    ));
    live.input(tool_done(1, "c1", 1, r#"{"value":42}"#));
    if with_progress {
        live.note(Event::ModelAttemptProgress {
            turn: 1,
            round: 1,
            attempt: 1,
            lease_attempt: 1,
            text_appended: "It is".into(),
            thinking_appended: "easy".into(),
            cost_micros: None,
            usage: None,
        });
        live.note(progress(1, 1, 1, 1, " 42."));
    }
    live.input(model_done(
        1,
        1,
        1,
        response(vec![text("It is 42.")], StopReason::EndTurn),
    ));
    live
}

#[test]
fn progress_records_change_no_ledger_byte_and_no_command_live_or_replayed() {
    let plain = streamed_turn(false);
    let noted = streamed_turn(true);
    plain.check_replay();
    noted.check_replay();
    let kinds = |live: &Live| {
        live.events
            .iter()
            .filter(|e| e.kind == "model_attempt_progress")
            .count()
    };
    assert_eq!((kinds(&plain), kinds(&noted)), (0, 6));
    // The same ledger bytes and the same decisions (their seqs shift by the records between).
    assert_eq!(
        noted.state.transcript.canonical_json(),
        plain.state.transcript.canonical_json()
    );
    let decided = |live: &Live| {
        live.commands
            .iter()
            .map(|(_, c)| c.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(decided(&noted), decided(&plain));
    assert_eq!(noted.state.last_outcome, plain.state.last_outcome);
    assert_eq!(noted.state.usage, plain.state.usage);
    // Replaying the history with the records removed (seqs renumbered) gives that same state.
    let stripped: Vec<EventEnvelope> = noted
        .events
        .iter()
        .filter(|e| e.kind != "model_attempt_progress")
        .enumerate()
        .map(|(i, e)| EventEnvelope {
            seq: i as u64 + 1,
            ..e.clone()
        })
        .collect();
    assert_eq!(stripped, plain.events);
    // What each run streamed is read back whole, per (attempt, lease).
    let runs = crate::progress::streamed_outputs(&noted.events, 1, 0);
    let texts: Vec<(u32, u32, &str)> = runs
        .iter()
        .map(|r| (r.attempt, r.lease_attempt, r.text.as_str()))
        .collect();
    assert_eq!(
        texts,
        [
            (1, 1, "Let me "),
            (1, 2, "Let me compute."),
            (2, 1, "Let me compute.")
        ]
    );
    let round1 = crate::progress::streamed_outputs(&noted.events, 1, 1);
    assert_eq!(
        (round1[0].text.as_str(), round1[0].thinking.as_str()),
        ("It is 42.", "easy")
    );
}

#[test]
fn stale_progress_is_rejected_and_changes_nothing() {
    let mut live = Live::new(started(8));
    // Before any turn nothing waits for output.
    assert!(matches!(
        live.try_input(progress(1, 0, 1, 1, "x")),
        Err(Error::InvalidEvent { .. })
    ));
    live.input(user(1, "go"));
    let before = live.state.clone();
    for bad in [
        progress(1, 0, 2, 1, "future attempt"),
        progress(1, 1, 1, 1, "other round"),
        progress(2, 0, 1, 1, "other turn"),
    ] {
        assert!(matches!(
            live.try_input(bad),
            Err(Error::InvalidEvent { .. })
        ));
        assert_eq!(live.state, before);
    }
    live.note(progress(1, 0, 1, 2, "new lease"));
    // Output of an older lease of the same attempt, after a newer one recorded output.
    let before = live.state.clone();
    let err = live
        .try_input(progress(1, 0, 1, 1, "old lease"))
        .unwrap_err();
    assert!(err.to_string().contains("stale"), "{err}");
    assert_eq!(live.state, before);
    // While tools run, and after the turn ended, no model call waits for output.
    live.input(model_done(
        1,
        0,
        1,
        response(
            vec![tool_use("c1", "calculator", "{}")],
            StopReason::ToolUse,
        ),
    ));
    assert!(live.try_input(progress(1, 0, 1, 2, "late")).is_err());
    live.input(tool_done(1, "c1", 1, "1"));
    live.input(model_done(
        1,
        1,
        1,
        response(vec![text("done")], StopReason::EndTurn),
    ));
    let before = live.state.clone();
    assert!(live
        .try_input(progress(1, 1, 1, 1, "after the end"))
        .is_err());
    assert_eq!(live.state, before);
    live.check_replay();
}

#[test]
fn stale_reports_get_their_own_error_and_change_nothing() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    live.input(Event::ModelCallFailed {
        turn: 1,
        round: 0,
        attempt: 1,
        failure: failed(ErrorClass::Transient),
        cost_micros: None,
    });
    let stale = |live: &mut Live, event: Event| {
        let before = live.state.clone();
        let err = live.try_input(event).unwrap_err();
        assert!(
            matches!(&err, Error::StaleReport { session_id, .. } if session_id == SID),
            "{err}"
        );
        assert!(err.is_stale_report());
        assert_eq!(live.state, before);
    };
    // The superseded attempt of the model call reports late.
    let answer = response(vec![tool_use("t", "calculator", "{}")], StopReason::ToolUse);
    stale(&mut live, model_done(1, 0, 1, answer.clone()));
    // A future attempt is misuse, not staleness.
    let err = live
        .try_input(model_done(1, 0, 3, answer.clone()))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidEvent { .. }), "{err}");
    live.input(model_done(1, 0, 2, answer.clone()));
    // The answered model call reports again (a duplicate), and a failure of it.
    stale(&mut live, model_done(1, 0, 2, answer));
    stale(
        &mut live,
        Event::ModelCallFailed {
            turn: 1,
            round: 0,
            attempt: 2,
            failure: failed(ErrorClass::Transient),
            cost_micros: None,
        },
    );
    live.input(tool_done(1, "t", 1, "1"));
    // The answered tool call reports again.
    stale(&mut live, tool_done(1, "t", 1, "2"));
    live.input(model_done(
        1,
        1,
        1,
        response(vec![text("ok")], StopReason::EndTurn),
    ));
    // After the turn ended, everything of it is stale.
    stale(&mut live, tool_done(1, "t", 1, "3"));
    stale(&mut live, progress(1, 1, 1, 1, "late"));
    // A turn that never started is misuse.
    let err = live.try_input(tool_done(2, "t", 1, "4")).unwrap_err();
    assert!(matches!(err, Error::InvalidEvent { .. }), "{err}");
    live.check_replay();
}

/// The task a session with default queues and no schedule-to-start limit enqueues: on the
/// default queue, for a worker hosting `target` (the tool, or the model's provider).
pub(super) fn task(seq: u64, kind: TaskKind, visible_at_ms: u64, target: &str) -> NewTask {
    NewTask {
        target: target.into(),
        ..NewTask::new(
            TaskId {
                session_id: SID.into(),
                scheduled_seq: seq,
            },
            kind,
            visible_at_ms,
        )
    }
}

#[test]
fn step_returns_the_tasks_and_the_outcome_of_a_turn_with_two_parallel_tools() {
    let mut live = Live::new(started(8));
    // seq 2: the message; seq 3: its model call, due at once.
    let t = live.step(user(1, "what is (17+25)*3?"));
    assert_eq!(t.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
    assert!(t.events.iter().all(|e| e.recorded_at_ms == live.now));
    assert_eq!(t.enqueue, [task(3, TaskKind::Model, live.now, "scripted")]);
    assert!(t.cancel.is_empty() && t.outcome.is_none());
    // seq 4: the answer with two calls; seqs 5 and 6 schedule them, in declaration order.
    let t = live.step(model_done(
        1,
        0,
        1,
        response(
            vec![
                tool_use("t1", "calculator", r#"{"expression":"(17+25)*3"}"#),
                tool_use("t2", "read_file", r#"{"path":"notes.txt"}"#),
            ],
            StopReason::ToolUse,
        ),
    ));
    assert_eq!(t.events.len(), 3);
    assert!(matches!(
        (&t.events[1].event, &t.events[2].event),
        (Event::ToolCallScheduled { tool_use_id: a, .. }, Event::ToolCallScheduled { tool_use_id: b, .. })
            if a == "t1" && b == "t2"
    ));
    assert_eq!(
        t.enqueue,
        [
            task(5, TaskKind::Tool, live.now, "calculator"),
            task(6, TaskKind::Tool, live.now, "read_file")
        ]
    );
    // The reported model task is completed by its report, not cancelled.
    assert!(t.cancel.is_empty() && t.outcome.is_none());
    // The first result in: nothing to do until the other one is.
    let t = live.step(tool_done(1, "t2", 1, r#""notes""#));
    assert_eq!(t.events.len(), 1);
    assert!(t.enqueue.is_empty());
    assert!(t.cancel.is_empty() && t.outcome.is_none());
    // The last result: the next model call (seq 9 is scheduled by seq 8).
    let t = live.step(tool_done(1, "t1", 1, r#"{"value":126}"#));
    assert_eq!(t.events.len(), 2);
    assert_eq!(t.enqueue, [task(9, TaskKind::Model, live.now, "scripted")]);
    assert!(t.cancel.is_empty() && t.outcome.is_none());
    // The answer ends the turn: no task, and the outcome.
    let t = live.step(model_done(
        1,
        1,
        1,
        response(vec![text("It is 126.")], StopReason::EndTurn),
    ));
    assert!(matches!(
        t.commands[..],
        [Command::CompleteTurn { turn: 1, .. }]
    ));
    assert!(t.enqueue.is_empty());
    assert!(t.cancel.is_empty());
    assert_eq!(
        t.outcome,
        Some(TurnOutcome::Completed {
            turn: 1,
            answer: "It is 126.".into(),
            stop_reason: Some(StopReason::EndTurn),
            // Two rounds of 10 + 5 tokens, recorded without a cost.
            totals: totals(20, 10, 2, 2)
        })
    );
    live.check_replay();
}

#[test]
fn step_routes_tasks_on_the_session_queues_with_targets_and_start_deadlines() {
    let mut started = started(8);
    started.queues = Queues {
        model: Some("llm".into()),
        tool: Some("gpu".into()),
    };
    started.model_retry.schedule_to_start_timeout_ms = Some(2_000);
    started.tool_retry.schedule_to_start_timeout_ms = Some(500);
    let mut live = Live::new(started);
    let routed =
        |seq: u64, kind, visible_at_ms: u64, queue: &str, target: &str, limit: u64| NewTask {
            queue: queue.into(),
            start_by_ms: Some(visible_at_ms + limit),
            ..task(seq, kind, visible_at_ms, target)
        };
    // seq 3: the model call, on the model queue, for a worker hosting the "scripted" provider,
    // to be started within the model policy's 2 s.
    let t = live.step(user(1, "go"));
    assert_eq!(
        t.enqueue,
        [routed(
            3,
            TaskKind::Model,
            live.now,
            "llm",
            "scripted",
            2_000
        )]
    );
    assert_eq!(
        live.state.queued_task(3),
        Some(t.enqueue[0].clone()),
        "resume puts back the task the step enqueued"
    );
    // seq 5: the tool call, on the tool queue, for a worker hosting "calculator".
    let t = live.step(model_done(
        1,
        0,
        1,
        response(
            vec![tool_use("t1", "calculator", r#"{"expression":"1+1"}"#)],
            StopReason::ToolUse,
        ),
    ));
    assert_eq!(
        t.enqueue,
        [routed(
            5,
            TaskKind::Tool,
            live.now,
            "gpu",
            "calculator",
            500
        )]
    );
    assert_eq!(live.state.queued_task(5), Some(t.enqueue[0].clone()));
    assert_eq!(
        live.state.queued_task(3),
        None,
        "the model call is answered"
    );
    // A timed-out attempt: the retry waits for its backoff, and its start deadline counts
    // from when it is due, not from when it was scheduled.
    let mut timeout = failed(ErrorClass::Timeout);
    timeout.message = "lease lapsed".into();
    let t = live.step(Event::ToolCallFailed {
        turn: 1,
        tool_use_id: "t1".into(),
        attempt: 1,
        failure: timeout,
    });
    let due = live.now + 1_000;
    assert_eq!(
        t.enqueue,
        [routed(7, TaskKind::Tool, due, "gpu", "calculator", 500)]
    );
    assert_eq!(live.state.queued_task(5), None, "attempt 1 is over");
    assert_eq!(live.state.queued_task(7), Some(t.enqueue[0].clone()));
    live.input(tool_done(1, "t1", 2, "2"));
    live.input(model_done(
        1,
        1,
        1,
        response(vec![text("2")], StopReason::EndTurn),
    ));
    // A turn on another model: its calls need a worker hosting that model's provider.
    let t = live.step(Event::UserMessage {
        idempotency_key: None,
        tool_choice: None,
        turn: 2,
        text: "again".into(),
        model: Some(ModelSpec::parse("anthropic:claude-test").unwrap()),
        media: Vec::new(),
    });
    let seq = t.events[1].seq;
    assert_eq!(
        t.enqueue,
        [routed(
            seq,
            TaskKind::Model,
            live.now,
            "llm",
            "anthropic",
            2_000
        )]
    );
    assert_eq!(live.state.queued_task(seq), Some(t.enqueue[0].clone()));
    live.check_replay();
}

#[test]
fn step_cancels_the_tasks_a_cancelled_turn_no_longer_waits_for() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    // seq 4 answers with three calls, scheduled at seqs 5, 6 and 7.
    live.input(model_done(
        1,
        0,
        1,
        response(
            vec![
                tool_use("a", "calculator", "{}"),
                tool_use("b", "read_file", "{}"),
                tool_use("c", "calculator", "{}"),
            ],
            StopReason::ToolUse,
        ),
    ));
    // b is answered: its task is done, not cancelled later.
    live.input(tool_done(1, "b", 1, "1"));
    let t = live.step(Event::TurnCancelled {
        turn: 1,
        reason: "stop".into(),
    });
    assert_eq!(t.events.len(), 1);
    assert!(t.enqueue.is_empty());
    let seqs: Vec<u64> = t.cancel.iter().map(|id| id.scheduled_seq).collect();
    assert_eq!(seqs, [5, 7]);
    assert!(t.cancel.iter().all(|id| id.session_id == SID));
    assert_eq!(
        t.outcome,
        Some(TurnOutcome::Cancelled {
            turn: 1,
            reason: "stop".into(),
            totals: totals(10, 5, 1, 1)
        })
    );
    // A waiting model call is cancelled the same way when the whole session is.
    live.input(user(2, "again"));
    let waiting = live.state.outstanding_tasks();
    let t = live.step(Event::SessionCancelled {
        reason: "bye".into(),
    });
    assert_eq!(
        t.cancel
            .iter()
            .map(|id| id.scheduled_seq)
            .collect::<Vec<_>>(),
        waiting
    );
    assert_eq!(t.cancel.len(), 1);
    assert!(matches!(
        t.outcome,
        Some(TurnOutcome::Cancelled { turn: 2, .. })
    ));
    live.check_replay();
}

#[test]
fn step_refuses_command_events_and_a_stale_report_changes_nothing() {
    let mut live = Live::new(started(8));
    live.input(user(1, "go"));
    let before = live.state.clone();
    let command = EventEnvelope::new(
        SID,
        live.state.next_seq,
        live.now,
        Event::TurnFailed {
            turn: 1,
            reason: "x".into(),
            budget_exceeded: None,
        },
    );
    assert!(matches!(
        live.state.step(command),
        Err(Error::InvalidEvent { .. })
    ));
    assert_eq!(live.state, before);
    live.input(Event::ModelCallFailed {
        turn: 1,
        round: 0,
        attempt: 1,
        failure: failed(ErrorClass::Transient),
        cost_micros: None,
    });
    // The superseded attempt's late answer: the new variant, no events, no state change.
    let before = (live.state.clone(), live.events.len());
    let err = live
        .try_step(model_done(
            1,
            0,
            1,
            response(vec![text("late")], StopReason::EndTurn),
        ))
        .unwrap_err();
    assert!(matches!(err, Error::StaleReport { .. }), "{err}");
    assert_eq!((live.state.clone(), live.events.len()), before);
    live.check_replay();
}

/// The names a schema requires, read from the whole parsed schema: what the replay of every
/// recorded history must keep giving.
fn required_the_whole_way(schema: &JsonText) -> Option<Vec<String>> {
    let schema = schema.to_value().ok()?;
    Some(
        schema
            .get("required")
            .and_then(|r| r.as_array())
            .map(|r| {
                r.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
    )
}

#[test]
fn recent_schemas_give_what_reading_them_gives_and_keep_a_bounded_number() {
    let most = crate::workflow::RECENT_REQUIRED_SCHEMAS;
    let mut recent = crate::workflow::RecentRequired::new();
    let schema = |i: usize| {
        JsonText::parse(format!(
            r#"{{"type":"object","required":["field{i}","other{i}"]}}"#
        ))
        .unwrap()
    };
    let no_required = JsonText::parse(r#"{"type":"object"}"#).unwrap();
    // More schemas than it keeps, each read three times in a row and again after the others
    // evicted it.
    for round in 0..2 {
        for i in 0..most + 12 {
            for _ in 0..3 {
                let expected = crate::workflow::required_fields(&schema(i));
                assert_eq!(
                    recent.required(&schema(i)).map(<[String]>::to_vec),
                    expected,
                    "schema {i}, round {round}"
                );
            }
            assert!(recent.kept() <= most, "{} schemas kept", recent.kept());
        }
    }
    assert_eq!(recent.required(&no_required), Some(&[][..]));
    assert_eq!(recent.kept(), most);
    // A schema kept earlier still answers with its own fields, not a neighbour's.
    assert_eq!(
        recent.required(&schema(most + 11)),
        Some(&[format!("field{}", most + 11), format!("other{}", most + 11)][..])
    );
}

#[test]
fn a_schemas_required_names_read_in_part_are_those_of_the_whole_schema() {
    let schemas = [
        r#"{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}"#,
        r#"{"required":["a","b"],"properties":{"a":{"required":["inner"]}}}"#,
        r#"{"type":"object","properties":{"q":{"type":"object","required":["deep"]}}}"#,
        r#"{"type":"object"}"#,
        r#"{}"#,
        r#"{"required":null}"#,
        r#"{"required":"path"}"#,
        r#"{"required":["a",1,null,"b",{"c":1}]}"#,
        r#"{"required":[]}"#,
        r#"{"required":["first"],"required":["second","third"]}"#,
        r#"{"required":["first"],"type":"object","required":null}"#,
        r#"true"#,
        r#"[]"#,
        r#"["required"]"#,
        r#""required""#,
        r#"3"#,
        r#"null"#,
        r#"{"Required":["x"],"required ":["y"]}"#,
        r#"{"re\u0071uired":["escaped key"]}"#,
    ];
    for schema in schemas {
        let schema = JsonText::parse(schema).unwrap();
        assert_eq!(
            crate::workflow::required_fields(&schema),
            required_the_whole_way(&schema),
            "{}",
            schema.as_str()
        );
    }
    let path = JsonText::parse(schemas[0]).unwrap();
    assert_eq!(
        crate::workflow::required_fields(&path),
        Some(vec!["path".to_owned()])
    );
    let twice = JsonText::parse(schemas[9]).unwrap();
    assert_eq!(
        crate::workflow::required_fields(&twice),
        Some(vec!["second".to_owned(), "third".to_owned()])
    );
}
