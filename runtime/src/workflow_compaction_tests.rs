//! Compaction scenarios of the workflow, each run live and then as a full replay: the
//! threshold rule, keep-last-N, the context-too-long retry, compaction that cannot shrink,
//! sessions without a policy, compaction on request, and a tampered compaction event.

use crate::compaction::{CompactionPolicy, CompactionTrigger};
use crate::error::Error;
use crate::event::*;
use crate::replay::replay;
use crate::workflow::{Command, SessionState};
use crate::workflow_tests::{model_done, response, started, text, tool_use, user, Live, SID};
use cairn_ledger::*;

const LONG_ERROR: &str =
    "the tool failed: a long error text with a stack trace that goes on and on and on";

fn with_policy(policy: Option<CompactionPolicy>) -> SessionStarted {
    SessionStarted {
        compaction: policy,
        ..started(8)
    }
}

fn policy(
    threshold_tokens: Option<u64>,
    strategies: Vec<CompactionStrategy>,
    keep_last_turns: u32,
) -> CompactionPolicy {
    CompactionPolicy {
        threshold_tokens,
        strategies,
        keep_last_turns,
        summarize: false,
    }
}

fn thinking(text: &str) -> Part {
    Part::Thinking {
        text: text.into(),
        signature: format!("sig-{text}"),
    }
}

/// Runs the rest of turn `turn` after its user message was sent: a model round with thinking
/// and a tool call that fails, then an answer with thinking. Returns the commands of the last
/// input (the turn's completion).
fn finish_turn(live: &mut Live, turn: u32) -> Vec<Command> {
    let id = format!("t{turn}");
    let c = live.input(model_done(
        turn,
        0,
        1,
        response(
            vec![
                thinking(&format!("plan {turn}")),
                text("Using a tool."),
                tool_use(&id, "calculator", r#"{"expression":"1/0"}"#),
            ],
            StopReason::ToolUse,
        ),
    ));
    assert!(matches!(c[..], [Command::ScheduleToolCall { .. }]), "{c:?}");
    let c = live.input(Event::ToolCallCompleted {
        turn,
        tool_use_id: id,
        attempt: 1,
        content: ToolResultContent::Text(LONG_ERROR.into()),
        is_error: true,
    });
    // A compaction may go first (over a threshold), never instead of the call.
    assert!(
        matches!(c.last(), Some(Command::ScheduleModelCall { round: 1, .. })),
        "{c:?}"
    );
    live.input(model_done(
        turn,
        1,
        1,
        response(
            vec![thinking(&format!("answer {turn}")), text("Done.")],
            StopReason::EndTurn,
        ),
    ))
}

fn run_turn(live: &mut Live, turn: u32) {
    live.input(user(turn, &format!("question {turn}")));
    let c = finish_turn(live, turn);
    assert!(matches!(c[..], [Command::CompleteTurn { .. }]), "{c:?}");
}

fn reasoning_count(messages: &[Message]) -> usize {
    messages
        .iter()
        .flat_map(|m| &m.parts)
        .filter(|p| p.is_reasoning())
        .count()
}

#[test]
fn over_the_threshold_a_compaction_goes_before_the_model_call() {
    let all = CompactionPolicy::default().strategies;
    let mut live = Live::new(with_policy(Some(policy(Some(1), all, 4))));
    run_turn(&mut live, 1);
    assert_eq!(live.state.transcript_lineage, 0, "only added to so far");
    let before = Transcript::clone(&live.state.transcript);
    let c = live.input(user(2, "question 2"));
    let with_user = {
        let mut t = before.clone();
        t.push_user_text("question 2");
        t
    };
    let expected = compact(
        &with_user,
        &CompactionPlan {
            strategies: vec![
                CompactionStrategy::DropReasoning,
                CompactionStrategy::DropFailedToolResults,
            ],
            keep_last_turns: 4,
            summary: None,
            rules: CompactionRules::KeepLastCallsReasoning,
        },
    );
    assert_eq!(
        c,
        vec![
            Command::CompactTranscript {
                turn: 2,
                trigger: CompactionTrigger::Threshold,
                // keep_last_turns changes nothing with two turns, so it is not recorded.
                strategies: vec![
                    CompactionStrategy::DropReasoning,
                    CompactionStrategy::DropFailedToolResults,
                ],
                keep_last_turns: None,
                cut: None,
                estimate_before: estimate_tokens(&with_user),
                estimate_after: estimate_tokens(&expected.transcript),
                summary: None,
            },
            Command::ScheduleModelCall {
                turn: 2,
                round: 0,
                attempt: 1,
                not_before_ms: live.now,
            },
        ]
    );
    // The model call goes out over the compacted transcript, a new lineage: the seq of the
    // compaction's event.
    assert_eq!(*live.state.transcript, expected.transcript);
    let compacted_at = live
        .events
        .iter()
        .find(|e| matches!(e.event, Event::TranscriptCompacted { .. }))
        .map(|e| e.seq)
        .expect("the compaction recorded");
    assert_eq!(live.state.transcript_lineage, compacted_at);
    assert_eq!(reasoning_count(&live.state.transcript.messages), 0);
    let note = live.state.transcript.messages[3].parts[0].clone();
    assert!(
        matches!(&note, Part::ToolResult(r) if r.is_error && r.content == ToolResultContent::Text(FAILED_RESULT_NOTE.into())),
        "{note:?}"
    );
    // The current turn's tool loop keeps its thinking and its failed result.
    finish_turn(&mut live, 2);
    assert_eq!(reasoning_count(&live.state.transcript.messages), 2);
    // The history still holds everything the model said, thinking included.
    let recorded_thinking = live
        .events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelCallCompleted { response, .. } => Some(reasoning_count(&[Message {
                role: Role::Assistant,
                parts: response.parts.clone(),
                provenance: None,
            }])),
            _ => None,
        })
        .sum::<usize>();
    assert_eq!(recorded_thinking, 4);
    assert_eq!(
        live.state.transcript_lineage, compacted_at,
        "added to since"
    );
    live.check_replay();
}

/// A fork with another system prompt whose copy holds a compaction decided on the old
/// transcript's estimate is refused with a reason, not a bare nondeterminism.
#[test]
fn a_fork_whose_new_system_prompt_breaks_a_copied_compaction_is_refused() {
    let all = CompactionPolicy::default().strategies;
    let mut live = Live::new(with_policy(Some(policy(Some(1), all, 4))));
    run_turn(&mut live, 1);
    live.input(user(2, "question 2"));
    let request = crate::fork::ForkRequest {
        parent: SID.into(),
        at_seq: live.events.last().unwrap().seq,
        session_id: "fork".into(),
        model: None,
        system_prompt: Some("A much longer system prompt than before. ".repeat(20)),
    };
    match crate::fork::fork_events(&live.events, &request) {
        Err(Error::InvalidEvent { reason, .. }) => assert!(
            reason
                .starts_with("with another system prompt, the copied history no longer replays: ")
                && reason.ends_with("fork before that event, or keep the system prompt"),
            "{reason}"
        ),
        other => panic!("{:?}", other.map(|(events, _)| events.len())),
    }
}

#[test]
fn under_the_threshold_nothing_is_compacted_and_it_stops_once_under() {
    // Measure the transcript at turn 3's start in a session without compaction.
    let mut plain = Live::new(with_policy(None));
    run_turn(&mut plain, 1);
    run_turn(&mut plain, 2);
    let mut at_turn_3 = Transcript::clone(&plain.state.transcript);
    at_turn_3.push_user_text("question 3");
    let without_reasoning = estimate_tokens(&drop_reasoning(&at_turn_3));
    // A threshold that dropping reasoning alone meets: the next strategies are not applied.
    let all = CompactionPolicy::default().strategies;
    let mut live = Live::new(with_policy(Some(policy(Some(without_reasoning), all, 1))));
    run_turn(&mut live, 1);
    run_turn(&mut live, 2);
    let c = live.input(user(3, "question 3"));
    match &c[..] {
        [Command::CompactTranscript {
            strategies,
            estimate_after,
            ..
        }, Command::ScheduleModelCall { .. }] => {
            assert_eq!(strategies, &vec![CompactionStrategy::DropReasoning]);
            assert!(*estimate_after <= without_reasoning);
        }
        other => panic!("{other:?}"),
    }
    live.check_replay();
    // A generous threshold never compacts.
    let mut roomy = Live::new(with_policy(Some(policy(
        Some(1_000_000),
        CompactionPolicy::default().strategies,
        1,
    ))));
    run_turn(&mut roomy, 1);
    run_turn(&mut roomy, 2);
    let c = roomy.input(user(3, "question 3"));
    assert!(
        matches!(c[..], [Command::ScheduleModelCall { .. }]),
        "{c:?}"
    );
    roomy.check_replay();
}

#[test]
fn keep_last_turns_cuts_at_the_start_of_a_turn() {
    let keep = vec![CompactionStrategy::KeepLastTurns];
    let mut live = Live::new(with_policy(Some(policy(Some(1), keep, 2))));
    run_turn(&mut live, 1);
    run_turn(&mut live, 2);
    let before = Transcript::clone(&live.state.transcript);
    let c = live.input(user(3, "question 3"));
    // system, turn 1 (4 messages), turn 2 from index 5.
    match &c[..] {
        [Command::CompactTranscript {
            strategies,
            keep_last_turns: Some(2),
            cut: Some(5),
            ..
        }, Command::ScheduleModelCall { .. }] => {
            assert_eq!(strategies, &vec![CompactionStrategy::KeepLastTurns]);
        }
        other => panic!("{other:?}"),
    }
    let messages = &live.state.transcript.messages;
    assert_eq!(messages[0].role, Role::System);
    assert_eq!(messages[1..before.messages.len() - 4], before.messages[5..]);
    assert_eq!(messages[1].parts, vec![Part::text("question 2")]);
    validate_transcript(&live.state.transcript).unwrap();
    let c = finish_turn(&mut live, 3);
    assert!(matches!(c[..], [Command::CompleteTurn { .. }]), "{c:?}");
    live.check_replay();
}

#[test]
fn context_too_long_compacts_and_retries_then_fails_when_nothing_is_left() {
    let all = CompactionPolicy::default().strategies;
    let mut live = Live::new(with_policy(Some(policy(None, all, 1))));
    run_turn(&mut live, 1);
    run_turn(&mut live, 2);
    let c = live.input(user(3, "question 3"));
    assert!(
        matches!(c[..], [Command::ScheduleModelCall { .. }]),
        "{c:?}"
    );
    let too_long = ActivityFailure::new(
        ErrorClass::ContextTooLong,
        "prompt is too long: 210000 tokens > 200000 maximum",
    );
    let c = live.input(Event::ModelCallFailed {
        turn: 3,
        round: 0,
        attempt: 1,
        failure: too_long.clone(),
        cost_micros: None,
    });
    let now = live.now;
    match &c[..] {
        [Command::CompactTranscript {
            trigger: CompactionTrigger::ContextTooLong,
            strategies,
            cut: Some(_),
            estimate_before,
            estimate_after,
            ..
        }, Command::ScheduleModelCall {
            turn: 3,
            round: 0,
            attempt: 2,
            not_before_ms,
        }] => {
            // Every strategy that changes something, and the retry at once.
            assert_eq!(strategies, &CompactionPolicy::default().strategies);
            assert!(estimate_after < estimate_before);
            assert_eq!(*not_before_ms, now);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        live.state.transcript.messages[1].parts,
        vec![Part::text("question 3")]
    );
    // The compacted request is still too long: nothing is left to compact, the turn fails
    // saying so instead of looping.
    let t = live.step(Event::ModelCallFailed {
        turn: 3,
        round: 0,
        attempt: 2,
        failure: too_long,
        cost_micros: None,
    });
    match &t.commands[..] {
        [Command::FailTurn {
            turn: 3, reason, ..
        }] => {
            assert!(
                reason.contains("compaction cannot shrink the transcript any further"),
                "{reason}"
            );
            assert!(reason.contains("prompt is too long"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        t.outcome,
        Some(crate::workflow::TurnOutcome::Failed { turn: 3, .. })
    ));
    live.check_replay();
    // The next turn runs on the compacted transcript.
    let c = live.input(user(4, "question 4"));
    assert!(
        matches!(c[..], [Command::ScheduleModelCall { .. }]),
        "{c:?}"
    );
    live.check_replay();
}

/// Version 3's rules against version 2's, on a turn cut by its round limit after its tool
/// results, then a context-too-long answer to the next message.
#[test]
fn version_3_keeps_the_reasoning_of_the_last_call_set_and_budgets_a_too_long_attempt() {
    for version in [2, 3] {
        let mut live = Live::new(SessionStarted {
            workflow_version: version,
            compaction: Some(policy(None, vec![CompactionStrategy::DropReasoning], 4)),
            ..started(2)
        });
        live.input(user(1, "loop"));
        live.input(model_done(
            1,
            0,
            1,
            response(
                vec![
                    thinking("p0"),
                    tool_use("a", "calculator", r#"{"expression":"1"}"#),
                ],
                StopReason::ToolUse,
            ),
        ));
        live.input(Event::ToolCallCompleted {
            turn: 1,
            tool_use_id: "a".into(),
            attempt: 1,
            content: ToolResultContent::Text("1".into()),
            is_error: false,
        });
        let c = live.input(model_done(
            1,
            1,
            1,
            response(
                vec![
                    thinking("p1"),
                    tool_use("b", "calculator", r#"{"expression":"2"}"#),
                ],
                StopReason::ToolUse,
            ),
        ));
        assert!(matches!(c[..], [Command::FailTurn { .. }]), "{c:?}");
        let totals_before = live.state.totals;
        live.input(user(2, "next"));
        let mut too_long = ActivityFailure::new(ErrorClass::ContextTooLong, "prompt is too long");
        too_long.usage = Some(Usage {
            input_tokens: 7,
            ..Usage::default()
        });
        let c = live.input(Event::ModelCallFailed {
            turn: 2,
            round: 0,
            attempt: 1,
            failure: too_long,
            cost_micros: Some(5),
        });
        assert!(
            matches!(
                c[..],
                [
                    Command::CompactTranscript { .. },
                    Command::ScheduleModelCall { .. }
                ]
            ),
            "{c:?}"
        );
        let calls: Vec<&Message> = live
            .state
            .transcript
            .messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .collect();
        assert_eq!(calls.len(), 2);
        // The first call set lost its reasoning under both rules.
        assert_eq!(calls[0].parts.len(), 1, "{:?}", calls[0]);
        let kept = if version >= 3 { 2 } else { 1 };
        assert_eq!(
            calls[1].parts.len(),
            kept,
            "version {version}: {:?}",
            calls[1]
        );
        let counted = live.state.totals.usage.input_tokens - totals_before.usage.input_tokens;
        let cost = live.state.totals.cost_micros - totals_before.cost_micros;
        if version >= 3 {
            assert_eq!((counted, cost), (7, 5));
        } else {
            assert_eq!((counted, cost), (0, 0));
            assert_eq!(
                live.state.usage.input_tokens,
                totals_before.usage.input_tokens + 7
            );
        }
        live.check_replay();
    }
}

#[test]
fn without_a_policy_context_too_long_fails_the_turn_at_once() {
    // The retry policy would retry other classes; this one is never retried as it is.
    let mut live = Live::new(with_policy(None));
    run_turn(&mut live, 1);
    live.input(user(2, "question 2"));
    let c = live.input(Event::ModelCallFailed {
        turn: 2,
        round: 0,
        attempt: 1,
        failure: ActivityFailure::new(ErrorClass::ContextTooLong, "maximum context length"),
        cost_micros: None,
    });
    match &c[..] {
        [Command::FailTurn {
            turn: 2, reason, ..
        }] => {
            assert!(reason.contains("context_too_long"), "{reason}");
            assert!(reason.contains("no compaction policy"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // And a session without a policy never compacts before a call, however long.
    let c = live.input(user(3, &"long ".repeat(2_000)));
    assert!(
        matches!(c[..], [Command::ScheduleModelCall { .. }]),
        "{c:?}"
    );
    live.check_replay();
}

#[test]
fn compaction_on_request_runs_between_turns_only() {
    let mut live = Live::new(with_policy(None));
    run_turn(&mut live, 1);
    run_turn(&mut live, 2);
    // The default policy: drop reasoning and failed results; keep 4 turns cuts nothing.
    let c = live.input(Event::CompactionRequested {});
    match &c[..] {
        [Command::CompactTranscript {
            turn: 2,
            trigger: CompactionTrigger::Requested,
            strategies,
            cut: None,
            ..
        }] => assert_eq!(
            strategies,
            &vec![
                CompactionStrategy::DropReasoning,
                CompactionStrategy::DropFailedToolResults
            ]
        ),
        other => panic!("{other:?}"),
    }
    // The last turn counts as current: its reasoning stays.
    assert_eq!(reasoning_count(&live.state.transcript.messages), 2);
    // Again: nothing left to do, the request is recorded and decides nothing.
    assert!(live.input(Event::CompactionRequested {}).is_empty());
    live.input(user(3, "question 3"));
    let err = live.try_input(Event::CompactionRequested {}).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidEvent { reason, .. } if reason.contains("turn 3 is running")),
        "{err}"
    );
    live.check_replay();
}

#[test]
fn the_state_s_byte_count_follows_its_transcript_and_a_compaction_counts_it_again() {
    let mut live = Live::new(with_policy(None));
    let mut last = live.state.approx_bytes();
    assert_eq!(last, live.state.bytes_counted_again());
    for turn in 1..=3 {
        let question = "a question of many words ".repeat(40);
        live.input(user(turn, &question));
        assert!(
            live.state.approx_bytes() >= last + question.len(),
            "turn {turn}"
        );
        finish_turn(&mut live, turn);
        // What `apply` added up equals a count made from scratch.
        assert_eq!(live.state.approx_bytes(), live.state.bytes_counted_again());
        last = live.state.approx_bytes();
    }
    // The transcript is most of the state.
    let transcript = live.state.transcript.heap_bytes();
    assert!(
        last > transcript && last < transcript + 4_096,
        "{last} against a transcript of {transcript}"
    );
    // A compaction (reasoning and failed results dropped) shrinks the state, and the count
    // follows.
    live.input(Event::CompactionRequested {});
    assert!(live.state.approx_bytes() < last);
    assert_eq!(live.state.approx_bytes(), live.state.bytes_counted_again());
    // The replayed state, its count included, equals the live one.
    live.check_replay();
}

#[test]
fn a_bad_policy_is_refused_when_the_session_starts() {
    let mut state = SessionState::new(SID);
    let bad = with_policy(Some(policy(None, vec![], 1)));
    let err = state
        .apply(&EventEnvelope::new(SID, 1, 0, Event::SessionStarted(bad)))
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidEvent { seq: 1, reason, .. } if reason.starts_with("compaction: ")),
        "{err}"
    );
}

#[test]
fn a_tampered_compaction_is_a_nondeterminism_naming_it() {
    let keep = vec![CompactionStrategy::KeepLastTurns];
    let mut live = Live::new(with_policy(Some(policy(Some(1), keep, 1))));
    run_turn(&mut live, 1);
    live.input(user(2, "question 2"));
    let mut events = live.events.clone();
    let at = events
        .iter()
        .position(|e| matches!(e.event, Event::TranscriptCompacted { .. }))
        .expect("a compaction was recorded");
    let seq = events[at].seq;
    if let Event::TranscriptCompacted { cut, .. } = &mut events[at].event {
        *cut = Some(2);
    }
    match replay(SID, &events) {
        Err(Error::Nondeterminism { seq: s, found, .. }) => {
            assert_eq!(s, seq);
            assert!(found.contains("TranscriptCompacted"), "{found}");
        }
        other => panic!("{other:?}"),
    }
    // Dropping it is caught too: the model call is found where the compaction was decided.
    events.remove(at);
    for (i, e) in events.iter_mut().enumerate() {
        e.seq = i as u64 + 1;
    }
    assert!(matches!(
        replay(SID, &events),
        Err(Error::Nondeterminism { seq: s, .. }) if s == seq
    ));
}

fn summarizing(threshold_tokens: Option<u64>) -> SessionStarted {
    with_policy(Some(CompactionPolicy {
        summarize: true,
        ..policy(threshold_tokens, vec![CompactionStrategy::KeepLastTurns], 1)
    }))
}

#[test]
fn a_summary_call_runs_first_and_its_text_is_kept_in_front_of_the_cut() {
    let mut live = Live::new(summarizing(Some(1)));
    run_turn(&mut live, 1);
    let before = Transcript::clone(&live.state.transcript);
    let t = live.step(user(2, "question 2"));
    let due = live.now;
    assert_eq!(
        t.commands,
        vec![Command::ScheduleSummary {
            turn: 2,
            attempt: 1,
            not_before_ms: due,
        }]
    );
    // A model task, named by the summary's seq, runs the turn's model over the older turns.
    let seq = t.events[1].seq;
    assert_eq!(t.enqueue.len(), 1);
    assert_eq!(t.enqueue[0].kind, crate::store::TaskKind::Model);
    assert_eq!(t.enqueue[0].id.scheduled_seq, seq);
    assert_eq!(live.state.outstanding_tasks(), vec![seq]);
    match live.state.scheduled_activity(seq) {
        Some(crate::workflow::ScheduledActivity::Summary {
            turn: 2,
            attempt: 1,
            keep_last_turns: 1,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let request = summary_request(&live.state.transcript, 1);
    validate_transcript(&request).unwrap();
    assert_eq!(request.messages[..4].len(), 4);
    assert_eq!(reasoning_count(&request.messages), 0);
    assert_eq!(
        request.messages.last().unwrap().parts,
        vec![Part::text(SUMMARY_PROMPT)]
    );
    // Nothing is compacted until the summary is in.
    assert_eq!(
        live.state.transcript.messages.len(),
        before.messages.len() + 1
    );
    let totals = live.state.totals;
    let c = live.input(Event::SummaryCallCompleted {
        turn: 2,
        attempt: 1,
        summary: "They asked question 1; the tool failed.".into(),
        usage: Some(Usage {
            input_tokens: 40,
            output_tokens: 9,
            ..Usage::default()
        }),
        cost_micros: Some(12),
    });
    // The summary call counts in the budgets as any model call's attempt.
    assert_eq!(
        live.state.totals.usage.input_tokens,
        totals.usage.input_tokens + 40
    );
    assert_eq!(live.state.totals.cost_micros, totals.cost_micros + 12);
    match &c[..] {
        [Command::CompactTranscript {
            cut: Some(5),
            summary: Some(summary),
            ..
        }, Command::ScheduleModelCall {
            turn: 2,
            round: 0,
            attempt: 1,
            ..
        }] => assert_eq!(summary, "They asked question 1; the tool failed."),
        other => panic!("{other:?}"),
    }
    let first = &live.state.transcript.messages[1];
    assert_eq!(
        first.parts,
        vec![
            Part::text(format!(
                "{SUMMARY_HEADING}\nThey asked question 1; the tool failed."
            )),
            Part::text("question 2"),
        ]
    );
    let c = finish_turn(&mut live, 2);
    assert!(matches!(c[..], [Command::CompleteTurn { .. }]), "{c:?}");
    live.check_replay();
}

/// A session stopped while its summary call is queued is consistent: fsck finds the task
/// pointing at its summary_call_scheduled and reports nothing.
#[tokio::test]
async fn fsck_finds_a_queued_summary_call_in_order() {
    let mut live = Live::new(summarizing(Some(1)));
    run_turn(&mut live, 1);
    let t = live.step(user(2, "question 2"));
    assert!(matches!(t.commands[..], [Command::ScheduleSummary { .. }]));
    let store = crate::MemoryStore::new();
    let written =
        crate::export::write_new_session(&store, live.events.clone(), &live.state, live.now)
            .await
            .unwrap();
    assert_eq!(written.tasks, 1);
    let report = crate::fsck::fsck(&store).await.unwrap();
    assert!(report.is_clean(), "{report}");
}

#[test]
fn a_summary_that_keeps_failing_is_retried_then_left_out() {
    let mut live = Live::new(summarizing(Some(1)));
    run_turn(&mut live, 1);
    live.input(user(2, "question 2"));
    let overloaded = ActivityFailure::new(ErrorClass::Overloaded, "busy");
    let c = live.input(Event::SummaryCallFailed {
        turn: 2,
        attempt: 1,
        failure: overloaded.clone(),
        cost_micros: None,
    });
    // The model retry policy: 100 ms, then at most 2 attempts.
    assert_eq!(
        c,
        vec![Command::ScheduleSummary {
            turn: 2,
            attempt: 2,
            not_before_ms: live.now + 100,
        }]
    );
    let c = live.input(Event::SummaryCallFailed {
        turn: 2,
        attempt: 2,
        failure: overloaded,
        cost_micros: None,
    });
    match &c[..] {
        [Command::CompactTranscript {
            cut: Some(5),
            summary: None,
            ..
        }, Command::ScheduleModelCall { attempt: 1, .. }] => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        live.state.transcript.messages[1].parts,
        vec![Part::text("question 2")]
    );
    // A late report of the first attempt is stale and changes nothing.
    let err = live
        .try_input(Event::SummaryCallCompleted {
            turn: 2,
            attempt: 1,
            summary: "late".into(),
            usage: None,
            cost_micros: None,
        })
        .unwrap_err();
    assert!(matches!(err, Error::StaleReport { .. }), "{err}");
    finish_turn(&mut live, 2);
    live.check_replay();
}

#[test]
fn context_too_long_with_summaries_summarises_then_retries_the_call() {
    let mut live = Live::new(summarizing(None));
    run_turn(&mut live, 1);
    live.input(user(2, "question 2"));
    let c = live.input(Event::ModelCallFailed {
        turn: 2,
        round: 0,
        attempt: 1,
        failure: ActivityFailure::new(ErrorClass::ContextTooLong, "prompt is too long"),
        cost_micros: None,
    });
    assert!(
        matches!(
            c[..],
            [Command::ScheduleSummary {
                turn: 2,
                attempt: 1,
                ..
            }]
        ),
        "{c:?}"
    );
    let c = live.input(Event::SummaryCallCompleted {
        turn: 2,
        attempt: 1,
        summary: "earlier: question 1".into(),
        usage: None,
        cost_micros: None,
    });
    match &c[..] {
        [Command::CompactTranscript {
            trigger: CompactionTrigger::ContextTooLong,
            summary: Some(_),
            ..
        }, Command::ScheduleModelCall {
            turn: 2,
            round: 0,
            attempt: 2,
            ..
        }] => {}
        other => panic!("{other:?}"),
    }
    let c = live.input(model_done(
        2,
        0,
        2,
        response(vec![text("Done.")], StopReason::EndTurn),
    ));
    assert!(matches!(c[..], [Command::CompleteTurn { .. }]), "{c:?}");
    live.check_replay();
}

#[test]
fn a_cancelled_turn_drops_its_summary_call() {
    let mut live = Live::new(summarizing(Some(1)));
    run_turn(&mut live, 1);
    let t = live.step(user(2, "question 2"));
    let seq = t.events[1].seq;
    let t = live.step(Event::TurnCancelled {
        turn: 2,
        reason: "stop".into(),
    });
    assert_eq!(t.cancel.len(), 1);
    assert_eq!(t.cancel[0].scheduled_seq, seq);
    let err = live
        .try_input(Event::SummaryCallCompleted {
            turn: 2,
            attempt: 1,
            summary: "late".into(),
            usage: None,
            cost_micros: None,
        })
        .unwrap_err();
    assert!(matches!(err, Error::StaleReport { .. }), "{err}");
    live.check_replay();
}
