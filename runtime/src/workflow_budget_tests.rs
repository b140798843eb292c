//! Workflow scenarios of usage, cost and budgets (costs recorded with results and summed,
//! failed and lost attempts counted, turn and session budgets, stop reasons in the outcome),
//! each run live and as a full replay.

use crate::budget::{Budget, BudgetExceeded, BudgetLimit, BudgetScope, UsageTotals};
use crate::event::*;
use crate::workflow::{Command, TurnOutcome};
use crate::workflow_tests::{response, started, text, tool_done, tool_use, user, Live};
use cairn_ledger::*;

/// A session with these budgets (16 rounds).
fn budgeted(turn_budget: Budget, session_budget: Budget) -> SessionStarted {
    let mut s = started(16);
    s.limits.turn_budget = turn_budget;
    s.limits.session_budget = session_budget;
    s
}

/// A completed model call whose usage the engine priced at `cost`.
fn priced(turn: u32, round: u32, attempt: u32, r: ModelResponse, cost: Option<u64>) -> Event {
    Event::ModelCallCompleted {
        turn,
        round,
        attempt,
        response: r,
        cost_micros: cost,
    }
}

fn answer(t: &str) -> ModelResponse {
    response(vec![text(t)], StopReason::EndTurn)
}

fn asks_calculator(id: &str) -> ModelResponse {
    response(
        vec![tool_use(id, "calculator", r#"{"expression":"1+1"}"#)],
        StopReason::ToolUse,
    )
}

fn usage(input: u64, output: u64) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: output,
        ..Usage::default()
    }
}

/// A transient failure of a model attempt that consumed `used`, priced at `cost`.
fn model_failed(attempt: u32, used: Option<Usage>, cost: Option<u64>) -> Event {
    let mut failure = ActivityFailure::new(ErrorClass::Transient, "stream cut");
    failure.usage = used;
    Event::ModelCallFailed {
        turn: 1,
        round: 0,
        attempt,
        failure,
        cost_micros: cost,
    }
}

/// The `turn_failed` event of the history, if any.
fn turn_failed(live: &Live) -> Option<(String, Option<BudgetExceeded>)> {
    live.events.iter().find_map(|e| match &e.event {
        Event::TurnFailed {
            reason,
            budget_exceeded,
            ..
        } => Some((reason.clone(), budget_exceeded.clone())),
        _ => None,
    })
}

fn totals_of(outcome: &Option<TurnOutcome>) -> UsageTotals {
    *outcome.as_ref().expect("an outcome").totals()
}

#[test]
fn costs_are_stored_with_results_and_summed_with_failed_attempts() {
    let mut live = Live::new(budgeted(Budget::default(), Budget::default()));
    live.input(user(1, "hi"));
    // The first attempt dies after 3 input and 2 output tokens; its cost counts.
    let c = live.input(model_failed(1, Some(usage(3, 2)), Some(7)));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { attempt: 2, .. }]
    ));
    live.input(priced(1, 0, 2, answer("hello"), Some(100)));
    let turn1 = totals_of(&live.state.last_outcome);
    assert_eq!(turn1.usage, usage(13, 7));
    assert_eq!((turn1.cost_micros, turn1.unpriced_attempts), (107, 0));
    assert_eq!(turn1.model_calls, 2);
    assert_eq!(turn1.cost(), Some(107));
    // Turn 2 with a tool round: two priced responses.
    live.input(user(2, "again"));
    live.input(priced(2, 0, 1, asks_calculator("c1"), Some(40)));
    live.input(tool_done(2, "c1", 1, "2"));
    live.input(priced(2, 1, 1, answer("2"), Some(60)));
    let turn2 = totals_of(&live.state.last_outcome);
    assert_eq!((turn2.cost_micros, turn2.model_calls), (100, 2));
    assert_eq!(turn2.usage, usage(20, 10));
    // The session sums both turns; the legacy usage sum agrees.
    assert_eq!(live.state.totals.cost_micros, 207);
    assert_eq!(live.state.totals.model_calls, 4);
    assert_eq!(live.state.totals.usage, usage(33, 17));
    assert_eq!(live.state.usage, live.state.totals.usage);
    // The cost is in the recorded event's bytes, not looked up again.
    let recorded = live
        .events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ModelCallCompleted { cost_micros, .. } => *cost_micros,
            _ => None,
        })
        .collect::<Vec<_>>();
    assert_eq!(recorded, vec![100, 40, 60]);
    live.check_replay();
}

#[test]
fn an_unknown_price_leaves_the_cost_unknown_never_guessed() {
    let mut live = Live::new(budgeted(Budget::default(), Budget::default()));
    live.input(user(1, "hi"));
    live.input(priced(1, 0, 1, answer("hello"), None));
    let totals = totals_of(&live.state.last_outcome);
    assert_eq!(totals.cost(), None);
    assert_eq!((totals.cost_micros, totals.unpriced_attempts), (0, 1));
    assert!(totals.cost_text().contains("1 attempt(s) unpriced"));
    assert!(matches!(
        live.state.last_outcome,
        Some(TurnOutcome::Completed { .. })
    ));
    live.check_replay();
}

#[test]
fn a_turn_token_budget_stops_the_next_call_before_it_is_scheduled() {
    let turn_budget = Budget {
        max_tokens: Some(15),
        ..Budget::default()
    };
    let mut live = Live::new(budgeted(turn_budget, Budget::default()));
    live.input(user(1, "add"));
    // 15 tokens: at the limit, not over it, so the tool runs.
    let c = live.input(priced(1, 0, 1, asks_calculator("c1"), None));
    assert!(matches!(c[..], [Command::ScheduleToolCall { .. }]));
    // The next model call would start with nothing left: it is not scheduled.
    let c = live.input(tool_done(1, "c1", 1, "2"));
    let exceeded = BudgetExceeded {
        limit: BudgetLimit::Tokens,
        scope: BudgetScope::Turn,
        limit_value: 15,
        used: 15,
        cost_unknown: false,
    };
    assert_eq!(
        c,
        vec![Command::FailTurn {
            turn: 1,
            reason: "turn budget exceeded: max_tokens 15 tokens, 15 used".into(),
            budget_exceeded: Some(exceeded.clone()),
        }]
    );
    assert_eq!(live.state.totals.model_calls, 1);
    match &live.state.last_outcome {
        Some(TurnOutcome::Failed {
            budget_exceeded,
            totals,
            ..
        }) => {
            assert_eq!(budget_exceeded.as_ref(), Some(&exceeded));
            assert_eq!(totals.tokens(), 15);
        }
        other => panic!("expected a failed turn, got {other:?}"),
    }
    // The session takes further turns.
    assert!(!live.state.is_running());
    live.check_replay();
}

#[test]
fn a_result_that_goes_over_the_turn_budget_fails_the_turn_instead_of_completing_it() {
    let turn_budget = Budget {
        max_tokens: Some(10),
        ..Budget::default()
    };
    let mut live = Live::new(budgeted(turn_budget, Budget::default()));
    live.input(user(1, "hi"));
    let c = live.input(priced(1, 0, 1, answer("a long answer"), None));
    assert!(matches!(
        &c[..],
        [Command::FailTurn { budget_exceeded: Some(b), .. }]
            if b.used == 15 && b.limit == BudgetLimit::Tokens
    ));
    // Over budget with tool calls pending: they are never run, and closed in the transcript.
    live.input(user(2, "add"));
    let c = live.input(priced(2, 0, 1, asks_calculator("c2"), None));
    assert!(matches!(
        &c[..],
        [Command::FailTurn {
            budget_exceeded: Some(_),
            ..
        }]
    ));
    let (reason, _) = turn_failed(&live).expect("turn_failed recorded");
    assert_eq!(
        reason,
        "turn budget exceeded: max_tokens 10 tokens, 15 used"
    );
    live.check_replay();
}

#[test]
fn a_session_cost_budget_holds_across_turns() {
    let session_budget = Budget {
        max_cost_micros: Some(150),
        ..Budget::default()
    };
    let mut live = Live::new(budgeted(Budget::default(), session_budget));
    live.input(user(1, "one"));
    live.input(priced(1, 0, 1, answer("1"), Some(100)));
    assert!(matches!(
        live.state.last_outcome,
        Some(TurnOutcome::Completed { .. })
    ));
    // Turn 2 may start (100 < 150) but its result takes the session over.
    live.input(user(2, "two"));
    let c = live.input(priced(2, 0, 1, answer("2"), Some(100)));
    assert!(matches!(
        &c[..],
        [Command::FailTurn { budget_exceeded: Some(b), .. }]
            if b.scope == BudgetScope::Session && b.used == 200 && b.limit_value == 150
    ));
    // Turn 3 fails at once: no model call is scheduled at all.
    let c = live.input(user(3, "three"));
    assert_eq!(
        c,
        vec![Command::FailTurn {
            turn: 3,
            reason: "session budget exceeded: max_cost_micros $0.000150, $0.000200 used".into(),
            budget_exceeded: Some(BudgetExceeded {
                limit: BudgetLimit::CostMicros,
                scope: BudgetScope::Session,
                limit_value: 150,
                used: 200,
                cost_unknown: false,
            }),
        }]
    );
    assert_eq!(live.state.totals.model_calls, 2);
    live.check_replay();
}

#[test]
fn a_cost_budget_fails_a_turn_whose_cost_is_unknown() {
    let turn_budget = Budget {
        max_cost_micros: Some(1_000_000),
        ..Budget::default()
    };
    let mut live = Live::new(budgeted(turn_budget, Budget::default()));
    live.input(user(1, "hi"));
    let c = live.input(priced(1, 0, 1, answer("hello"), None));
    assert!(matches!(
        &c[..],
        [Command::FailTurn { budget_exceeded: Some(b), reason, .. }]
            if b.cost_unknown && reason.contains("cannot be checked")
    ));
    live.check_replay();
}

#[test]
fn a_model_call_budget_counts_rounds_and_retries() {
    let turn_budget = Budget {
        max_model_calls: Some(2),
        ..Budget::default()
    };
    let mut live = Live::new(budgeted(turn_budget, Budget::default()));
    live.input(user(1, "add twice"));
    live.input(priced(1, 0, 1, asks_calculator("c1"), None));
    let c = live.input(tool_done(1, "c1", 1, "2"));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { round: 1, .. }]
    ));
    live.input(priced(1, 1, 1, asks_calculator("c2"), None));
    let c = live.input(tool_done(1, "c2", 1, "2"));
    assert!(matches!(
        &c[..],
        [Command::FailTurn { budget_exceeded: Some(b), reason, .. }]
            if b.limit == BudgetLimit::ModelCalls && b.used == 3
                && reason == "turn budget exceeded: max_model_calls 2 model calls, the next would be call 3"
    ));
    // A retry is a model call too: with one allowed, a failed attempt is not retried.
    live.input(user(2, "again"));
    let one = Budget {
        max_model_calls: Some(1),
        ..Budget::default()
    };
    let mut single = Live::new(budgeted(one, Budget::default()));
    single.input(user(1, "hi"));
    let c = single.input(model_failed(1, None, None));
    assert!(matches!(
        &c[..],
        [Command::FailTurn { budget_exceeded: Some(b), .. }] if b.used == 2
    ));
    live.check_replay();
    single.check_replay();
}

#[test]
fn stop_reasons_that_cut_an_answer_short_are_not_a_normal_completion() {
    for (stop, abnormal) in [
        (StopReason::MaxTokens, true),
        (StopReason::Refusal, true),
        (StopReason::ContentFilter, true),
        (StopReason::EndTurn, false),
        (StopReason::StopSequence, false),
    ] {
        let mut live = Live::new(budgeted(Budget::default(), Budget::default()));
        live.input(user(1, "hi"));
        live.input(priced(
            1,
            0,
            1,
            response(vec![text("partial")], stop),
            Some(5),
        ));
        let outcome = live.state.last_outcome.clone().expect("outcome");
        match &outcome {
            TurnOutcome::Completed {
                stop_reason,
                totals,
                answer,
                ..
            } => {
                assert_eq!(*stop_reason, Some(stop));
                assert_eq!(totals.cost(), Some(5));
                assert_eq!(answer, "partial");
            }
            other => panic!("expected completed, got {other:?}"),
        }
        assert_eq!(outcome.abnormal_stop().is_some(), abnormal, "{stop:?}");
        let json = serde_json::to_value(&outcome).expect("json");
        assert_eq!(
            json["stop_reason"],
            serde_json::to_value(stop).expect("stop json")
        );
        assert_eq!(json["totals"]["cost_micros"], 5);
        live.check_replay();
    }
}

#[test]
fn a_lost_run_counts_what_its_progress_reported() {
    let mut live = Live::new(budgeted(Budget::default(), Budget::default()));
    live.input(user(1, "hi"));
    let progress = |lease_attempt, used: Usage, cost| Event::ModelAttemptProgress {
        turn: 1,
        round: 0,
        attempt: 1,
        lease_attempt,
        text_appended: "x".into(),
        thinking_appended: String::new(),
        usage: Some(used),
        cost_micros: Some(cost),
    };
    live.input(progress(1, usage(100, 0), 30));
    live.input(progress(1, usage(100, 4), 31));
    assert_eq!(live.state.totals.usage, Usage::default());
    // The worker died; a new lease runs the attempt again: lease 1's last report counts.
    live.input(progress(2, usage(100, 1), 30));
    assert_eq!(live.state.totals.usage, usage(100, 4));
    assert_eq!(live.state.totals.cost_micros, 31);
    // Lease 2 lapses too: the engine's timeout failure knows no usage, so lease 2's last
    // report counts for it.
    let c = live.input(model_failed(1, None, None));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { attempt: 2, .. }]
    ));
    assert_eq!(live.state.totals.usage, usage(200, 5));
    assert_eq!(live.state.totals.cost_micros, 61);
    // Attempt 2 completes with its own usage, which is all that counts for it.
    live.input(progress_of_attempt_2());
    live.input(priced(1, 0, 2, answer("hi"), Some(9)));
    let totals = totals_of(&live.state.last_outcome);
    assert_eq!(totals.usage, usage(210, 10));
    assert_eq!(totals.cost_micros, 70);
    live.check_replay();
}

fn progress_of_attempt_2() -> Event {
    Event::ModelAttemptProgress {
        turn: 1,
        round: 0,
        attempt: 2,
        lease_attempt: 1,
        text_appended: "h".into(),
        thinking_appended: String::new(),
        usage: Some(usage(10, 1)),
        cost_micros: Some(2),
    }
}

#[test]
fn limits_without_budgets_encode_as_before_and_old_outcomes_decode() {
    let limits = Limits::default();
    let bytes = rmp_serde::to_vec_named(&limits).expect("encode");
    #[derive(serde::Serialize)]
    struct OldLimits {
        max_rounds: u32,
    }
    assert_eq!(
        bytes,
        rmp_serde::to_vec_named(&OldLimits { max_rounds: 16 }).expect("encode")
    );
    let old: TurnOutcome =
        serde_json::from_str(r#"{"status":"completed","turn":1,"answer":"hi"}"#).expect("old");
    assert_eq!(
        old,
        TurnOutcome::Completed {
            turn: 1,
            answer: "hi".into(),
            stop_reason: None,
            totals: UsageTotals::default(),
        }
    );
    let old: TurnOutcome =
        serde_json::from_str(r#"{"status":"failed","turn":1,"reason":"x"}"#).expect("old");
    assert_eq!(old.totals(), &UsageTotals::default());
}
