//! Property tests of the workflow state machine: random sequences of events (inputs with small
//! random field values, recorded commands, stray command events, wrong seqs) never make
//! `SessionState::apply` panic; every rejection is `InvalidEvent`, `StaleReport` or
//! `Nondeterminism` and leaves the state exactly as it was; every accepted event leaves a
//! transcript a model call may be sent (the workers check only the current turn's), which
//! within one lineage only grew at its end; and the accepted events replay to the same state.

use crate::error::Error;
use crate::event::{
    ActivityFailure, ErrorClass, Event, EventEnvelope, Limits, RetryPolicy, SessionStarted,
};
use crate::replay::replay;
use crate::workflow::{Command, Phase, SessionState, ToolSlotState};
use cairn_ledger::{
    validate_transcript, JsonText, ModelResponse, ModelSpec, Part, Role, StopReason,
    ToolResultContent, ToolSpec, ToolUse, Usage, Violation,
};
use proptest::prelude::*;
use std::collections::VecDeque;

const SID: &str = "prop";

/// One step of a generated run.
#[derive(Debug, Clone)]
enum Step {
    /// Apply this event at the next seq.
    Event(Event),
    /// Record the oldest command decided and not yet recorded (what the engine does).
    RecordCommand,
    /// Apply this event at a wrong seq (`next_seq + offset`, offset ≠ 0).
    WrongSeq(Event, i64),
    /// Apply this event as another session's.
    WrongSession(Event),
    /// Start the next turn.
    NextTurn,
    /// Answer the model call the turn waits for (if any) with this response.
    ModelAnswer(ModelResponse),
    /// Fail the model call the turn waits for (if any).
    ModelFail(ActivityFailure),
    /// Answer the tool call at this index of the round (if it waits).
    ToolAnswer(prop::sample::Index, bool),
    /// Fail the tool call at this index of the round (if it waits).
    ToolFail(prop::sample::Index, ActivityFailure),
    /// Record streamed output of the model call the turn waits for (if any), under this lease;
    /// an older lease than one that already recorded output is rejected.
    ModelProgress(u32, String),
}

fn tool_spec(name: &str) -> ToolSpec {
    ToolSpec {
        name: name.to_owned(),
        description: name.to_owned(),
        input_schema: JsonText::parse(r#"{"type":"object"}"#).expect("schema"),
    }
}

fn started() -> impl Strategy<Value = Event> {
    let budgets = (
        proptest::option::of(0u64..120),
        proptest::option::of(0u64..60),
        proptest::option::of(0u32..6),
    );
    (1u32..6, 0u32..4, 0u32..4, 0u64..5, budgets).prop_map(
        |(max_rounds, model_max, tool_max, delay, (turn_tokens, session_cost, session_calls))| {
            let policy = |default: RetryPolicy, max: u32| RetryPolicy {
                initial_interval_ms: delay,
                maximum_interval_ms: delay * 2,
                maximum_attempts: max,
                ..default
            };
            Event::SessionStarted(SessionStarted {
                call_options: Default::default(),
                queues: Default::default(),
                forked_from: None,
                workflow_version: crate::workflow::WORKFLOW_VERSION,
                tool_policy: None,
                compaction: None,
                workdir: None,
                model: ModelSpec::parse("scripted:props.json").expect("model"),
                tools: vec![tool_spec("calculator"), tool_spec("read_file")].into(),
                system_prompt: Some("be brief".to_owned()),
                // Budgets, sometimes: tokens per turn, cost and model calls per session.
                limits: Limits {
                    max_rounds,
                    turn_budget: crate::budget::Budget {
                        max_tokens: turn_tokens,
                        ..Default::default()
                    },
                    session_budget: crate::budget::Budget {
                        max_cost_micros: session_cost,
                        max_model_calls: session_calls,
                        ..Default::default()
                    },
                },
                model_retry: policy(RetryPolicy::model_default(), model_max),
                tool_retry: policy(RetryPolicy::tool_default(), tool_max),
            })
        },
    )
}

fn tool_id() -> impl Strategy<Value = String> {
    prop::sample::select(vec!["t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8"])
        .prop_map(str::to_owned)
}

fn part() -> impl Strategy<Value = Part> {
    prop_oneof![
        4 => prop::sample::select(vec!["hi", "done", "hi", ""])
            .prop_map(Part::text),
        1 => prop::sample::select(vec!["", "sig"]).prop_map(|s| Part::Thinking {
            text: "hmm".to_owned(),
            signature: s.to_owned(),
        }),
        5 => (
            tool_id(),
            prop::sample::select(vec!["calculator", "read_file", "calculator", "nope"]),
            prop::sample::select(vec!["{}", "{\"expression\":\"1+1\"}", "{}", "not json"]),
        )
            .prop_map(|(id, name, arguments)| Part::ToolUse(ToolUse {
                id,
                name: name.to_owned(),
                arguments: arguments.to_owned(),
                signature: None,
            })),
    ]
}

/// Valid and invalid responses: empty, empty text, unsigned thinking, ending on thinking,
/// duplicate or reused tool ids, unknown tools, arguments that are not JSON, pauses.
fn response() -> impl Strategy<Value = ModelResponse> {
    (
        prop::collection::vec(part(), 0..4),
        prop::sample::select(vec![
            StopReason::EndTurn,
            StopReason::ToolUse,
            StopReason::MaxTokens,
            StopReason::PauseTurn,
        ]),
        0u64..100,
    )
        .prop_map(|(parts, stop_reason, tokens)| ModelResponse {
            provider: "scripted".to_owned(),
            model: "props".to_owned(),
            parts,
            stop_reason_raw: format!("{stop_reason:?}"),
            stop_reason,
            usage: Usage {
                input_tokens: tokens,
                output_tokens: tokens / 2,
                ..Usage::default()
            },
        })
}

fn failure() -> impl Strategy<Value = ActivityFailure> {
    prop::sample::select(vec![
        ErrorClass::Transient,
        ErrorClass::Transient,
        ErrorClass::Timeout,
        ErrorClass::InvalidRequest,
        ErrorClass::ToolFailed,
    ])
    .prop_map(|class| ActivityFailure::new(class, "boom"))
}

fn event() -> impl Strategy<Value = Event> {
    let turn = 0u32..4;
    let round = 0u32..4;
    let attempt = 0u32..4;
    prop_oneof![
        1 => started(),
        3 => (turn.clone(), prop::option::of("[ab ]")).prop_map(|(turn, idempotency_key)| Event::UserMessage {
            // Sometimes a key used already, sometimes one that is no key (a space).
            idempotency_key,
            tool_choice: None,
            turn,
            text: "go".to_owned(),
            model: None,
            media: Vec::new(),
        }),
        5 => (turn.clone(), round.clone(), attempt.clone(), response()).prop_map(
            |(turn, round, attempt, response)| Event::ModelCallCompleted {
                turn,
                round,
                attempt,
                response, cost_micros: None
            }
        ),
        2 => (turn.clone(), round.clone(), attempt.clone(), failure()).prop_map(
            |(turn, round, attempt, failure)| Event::ModelCallFailed {
                turn,
                round,
                attempt,
                failure, cost_micros: None
            }
        ),
        4 => (turn.clone(), tool_id(), attempt.clone(), any::<bool>()).prop_map(
            |(turn, tool_use_id, attempt, is_error)| Event::ToolCallCompleted {
                turn,
                tool_use_id,
                attempt,
                content: ToolResultContent::Text("42".to_owned()),
                is_error,
            }
        ),
        2 => (turn.clone(), tool_id(), attempt.clone(), failure()).prop_map(
            |(turn, tool_use_id, attempt, failure)| Event::ToolCallFailed {
                turn,
                tool_use_id,
                attempt,
                failure,
            }
        ),
        1 => turn.clone().prop_map(|turn| Event::TurnCancelled {
            turn,
            reason: "stop".to_owned(),
        }),
        1 => Just(Event::SessionCancelled {
            reason: "bye".to_owned(),
        }),
        // Command events out of the blue: almost never the decided command.
        1 => (turn.clone(), round, attempt.clone(), 0u64..3).prop_map(
            |(turn, round, attempt, not_before_ms)| Event::ModelCallScheduled {
                turn,
                round,
                attempt,
                not_before_ms,
            }
        ),
        1 => (turn.clone(), tool_id(), attempt).prop_map(|(turn, tool_use_id, attempt)| {
            Event::ToolCallScheduled {
                turn,
                tool_use_id,
                name: "calculator".to_owned(),
                attempt,
                not_before_ms: 0,
            }
        }),
        1 => turn.clone().prop_map(|turn| Event::TurnCompleted {
            turn,
            usage: Usage::default(),
        }),
        1 => turn.prop_map(|turn| Event::TurnFailed {
            turn,
            reason: "no".to_owned(), budget_exceeded: None
        }),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => event().prop_map(Step::Event),
        8 => Just(Step::RecordCommand),
        2 => Just(Step::NextTurn),
        6 => response().prop_map(Step::ModelAnswer),
        1 => failure().prop_map(Step::ModelFail),
        5 => (any::<prop::sample::Index>(), any::<bool>())
            .prop_map(|(i, is_error)| Step::ToolAnswer(i, is_error)),
        1 => (any::<prop::sample::Index>(), failure()).prop_map(|(i, f)| Step::ToolFail(i, f)),
        3 => (1u32..4, "[a-z ]{0,8}").prop_map(|(lease, text)| Step::ModelProgress(lease, text)),
        1 => (event(), prop::sample::select(vec![-2i64, -1, 1, 2]))
            .prop_map(|(e, off)| Step::WrongSeq(e, off)),
        1 => event().prop_map(Step::WrongSession),
    ]
}

/// The event a targeted step stands for in this state, when there is one: the right turn,
/// round, attempt and tool_use id, with the generated payload.
fn targeted(state: &SessionState, step: Step) -> Option<Event> {
    let active = state.active.as_ref();
    let tool = |index: &prop::sample::Index| -> Option<(u32, String, u32)> {
        let active = active?;
        let Phase::Tools(slots) = &active.phase else {
            return None;
        };
        if slots.is_empty() {
            return None;
        }
        let slot = &slots[index.index(slots.len())];
        match &slot.state {
            ToolSlotState::Scheduled { attempt, .. } => {
                Some((active.turn, slot.tool_use.id.clone(), *attempt))
            }
            _ => None,
        }
    };
    let model = || -> Option<(u32, u32, u32)> {
        let active = active?;
        match &active.phase {
            Phase::Model(slot) => Some((active.turn, active.round, slot.attempt)),
            _ => None,
        }
    };
    match step {
        Step::NextTurn => Some(Event::UserMessage {
            idempotency_key: None,
            tool_choice: None,
            turn: state.turns_started + 1,
            text: "go on".to_owned(),
            model: None,
            media: Vec::new(),
        }),
        Step::ModelAnswer(response) => {
            model().map(|(turn, round, attempt)| Event::ModelCallCompleted {
                turn,
                round,
                attempt,
                // Priced by its output, as an engine's table would.
                cost_micros: Some(response.usage.output_tokens),
                response,
            })
        }
        Step::ModelFail(failure) => model().map(|(turn, round, attempt)| Event::ModelCallFailed {
            turn,
            round,
            attempt,
            failure,
            cost_micros: None,
        }),
        Step::ModelProgress(lease_attempt, text) => {
            model().map(|(turn, round, attempt)| Event::ModelAttemptProgress {
                turn,
                round,
                attempt,
                lease_attempt,
                text_appended: text,
                thinking_appended: String::new(),
                cost_micros: None,
                usage: None,
            })
        }
        Step::ToolAnswer(i, is_error) => {
            tool(&i).map(|(turn, tool_use_id, attempt)| Event::ToolCallCompleted {
                turn,
                tool_use_id,
                attempt,
                content: ToolResultContent::Text("42".to_owned()),
                is_error,
            })
        }
        Step::ToolFail(i, failure) => {
            tool(&i).map(|(turn, tool_use_id, attempt)| Event::ToolCallFailed {
                turn,
                tool_use_id,
                attempt,
                failure,
            })
        }
        _ => None,
    }
}

/// Mostly: start the session first, so that runs get past the first event.
fn run() -> impl Strategy<Value = (Option<Event>, Vec<Step>)> {
    (
        prop::option::weighted(0.9, started()),
        prop::collection::vec(step(), 0..80),
    )
}

/// Applies one envelope, checking the rejection contract; returns whether it was accepted.
/// The state's transcript passes `validate_transcript`, but for a trailing assistant message
/// whose tool_uses are not answered yet (its tool round in progress): a worker checks only the
/// current turn of a model call's transcript, so every accepted input must keep it so.
fn assert_sendable(state: &SessionState, envelope: &EventEnvelope) -> Result<(), TestCaseError> {
    let messages = &state.transcript.messages;
    match validate_transcript(&state.transcript) {
        Ok(()) => Ok(()),
        Err(cairn_ledger::Error::InvalidTranscript {
            message,
            violation: Violation::MissingToolResult { .. },
            ..
        }) if message + 1 == messages.len() && messages[message].role == Role::Assistant => Ok(()),
        Err(e) => Err(TestCaseError::fail(format!(
            "after {envelope:?} the transcript is not sendable: {e}"
        ))),
    }
}

fn apply_checked(
    state: &mut SessionState,
    envelope: &EventEnvelope,
    decided: &mut VecDeque<Command>,
) -> Result<bool, TestCaseError> {
    let before = state.clone();
    match state.apply(envelope) {
        Ok(commands) => {
            decided.extend(commands);
            assert_sendable(state, envelope)?;
            // What a worker that keeps transcripts relies on: within a lineage the transcript
            // only grows at its end.
            if state.transcript_lineage == before.transcript_lineage {
                let kept = &before.transcript.messages;
                prop_assert!(
                    state.transcript.messages.starts_with(kept),
                    "after {:?} the transcript of lineage {} no longer starts with the \
                     messages it had",
                    envelope,
                    state.transcript_lineage
                );
            }
            Ok(true)
        }
        Err(
            Error::InvalidEvent { .. } | Error::StaleReport { .. } | Error::Nondeterminism { .. },
        ) => {
            prop_assert_eq!(&*state, &before, "a rejected event changed the state");
            Ok(false)
        }
        Err(other) => Err(TestCaseError::fail(format!(
            "apply of {envelope:?} failed with {other:?}: only InvalidEvent, StaleReport and \
             Nondeterminism are allowed"
        ))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_event_sequences_never_panic_reject_cleanly_and_replay_to_the_same_state(
        (start, steps) in run(),
        tick in 1u64..50,
    ) {
        let mut state = SessionState::new(SID);
        let mut accepted: Vec<EventEnvelope> = Vec::new();
        let mut decided: VecDeque<Command> = VecDeque::new();
        let mut now = 1_000u64;
        let mut steps: Vec<Step> = steps;
        if let Some(start) = start {
            steps.insert(0, Step::Event(start));
        }
        for step in steps {
            now += tick;
            let envelope = match step {
                Step::Event(event) => EventEnvelope::new(SID, state.next_seq, now, event),
                Step::RecordCommand => match decided.pop_front() {
                    Some(command) => {
                        let envelope =
                            EventEnvelope::new(SID, state.next_seq, now, command.into_event());
                        let ok = apply_checked(&mut state, &envelope, &mut decided)?;
                        prop_assert!(ok, "the decided command {:?} was rejected", envelope.event);
                        accepted.push(envelope);
                        continue;
                    }
                    None => continue,
                },
                Step::WrongSeq(event, offset) => {
                    let seq = state.next_seq.saturating_add_signed(offset);
                    if seq == state.next_seq {
                        continue;
                    }
                    let envelope = EventEnvelope::new(SID, seq, now, event);
                    prop_assert!(!apply_checked(&mut state, &envelope, &mut decided)?);
                    continue;
                }
                Step::WrongSession(event) => {
                    let envelope = EventEnvelope::new("other", state.next_seq, now, event);
                    prop_assert!(!apply_checked(&mut state, &envelope, &mut decided)?);
                    continue;
                }
                step => match targeted(&state, step) {
                    Some(event) => EventEnvelope::new(SID, state.next_seq, now, event),
                    None => continue,
                },
            };
            if apply_checked(&mut state, &envelope, &mut decided)? {
                if envelope.event.is_command() {
                    // It happened to be the decided command: it is recorded now.
                    decided.pop_front();
                }
                accepted.push(envelope);
            }
        }
        // Record what is still decided, as the engine does in the same append.
        while let Some(command) = decided.pop_front() {
            now += tick;
            let envelope = EventEnvelope::new(SID, state.next_seq, now, command.into_event());
            prop_assert!(apply_checked(&mut state, &envelope, &mut decided)?);
            accepted.push(envelope);
        }
        prop_assert_eq!(state.next_seq, accepted.len() as u64 + 1);
        let replayed = replay(SID, &accepted)
            .map_err(|e| TestCaseError::fail(format!("the accepted events do not replay: {e}")))?;
        prop_assert_eq!(&replayed.state, &state);
        prop_assert_eq!(
            replayed.state.transcript.canonical_json(),
            state.transcript.canonical_json()
        );
    }
}
