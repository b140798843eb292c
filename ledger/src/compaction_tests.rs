//! Tests of the compaction strategies: each rule on a hand-built transcript, and properties
//! over generated valid transcripts (any compaction is valid, pairs stay together, reasoning is
//! byte-identical or gone, the current turn is untouched).

use super::*;
use crate::transcript::{Provenance, ToolResult, ToolUse};
use crate::validate::validate_transcript;
use proptest::prelude::*;

fn assistant(parts: Vec<Part>) -> Message {
    Message {
        role: Role::Assistant,
        parts,
        provenance: Some(Provenance {
            provider: "scripted".into(),
            model: "m".into(),
        }),
    }
}

fn user(parts: Vec<Part>) -> Message {
    Message {
        role: Role::User,
        parts,
        provenance: None,
    }
}

fn thinking(text: &str) -> Part {
    Part::Thinking {
        text: text.into(),
        signature: format!("sig-{text}"),
    }
}

fn tool_use(id: &str) -> Part {
    Part::ToolUse(ToolUse {
        id: id.into(),
        name: "calc".into(),
        arguments: "{}".into(),
        signature: None,
    })
}

fn result(id: &str, is_error: bool, text: &str) -> Part {
    Part::ToolResult(ToolResult {
        tool_use_id: id.into(),
        content: ToolResultContent::Text(text.into()),
        is_error,
    })
}

/// system; turn 1 (thinking + a failed tool round); turn 2 (plain); turn 3 in a tool loop
/// with thinking and a failed result of its own.
fn three_turns() -> Transcript {
    let mut t = Transcript::new();
    t.push_system("be brief");
    t.messages.push(user(vec![Part::text("one")]));
    t.messages.push(assistant(vec![
        thinking("t1"),
        Part::text("a"),
        tool_use("u1"),
    ]));
    t.messages.push(user(vec![result(
        "u1",
        true,
        "boom: a long error text, with a stack trace that goes on and on",
    )]));
    t.messages
        .push(assistant(vec![thinking("t1b"), Part::text("done one")]));
    t.messages.push(user(vec![Part::text("two")]));
    t.messages.push(assistant(vec![Part::text("done two")]));
    t.messages.push(user(vec![Part::text("three")]));
    t.messages
        .push(assistant(vec![thinking("t3"), tool_use("u3")]));
    t.messages
        .push(user(vec![result("u3", true, "current failure")]));
    validate_transcript(&t).expect("fixture is valid");
    t
}

#[test]
fn turn_starts_skip_tool_result_messages() {
    let t = three_turns();
    assert_eq!(turn_starts(&t), vec![1, 5, 7]);
    assert_eq!(current_turn_start(&t), Some(7));
    assert_eq!(current_turn_start(&Transcript::new()), None);
}

#[test]
fn drop_reasoning_spares_the_current_tool_loop() {
    let t = three_turns();
    let out = drop_reasoning(&t);
    validate_transcript(&out).unwrap();
    assert_eq!(out.messages[2].parts, vec![Part::text("a"), tool_use("u1")]);
    assert_eq!(out.messages[4].parts, vec![Part::text("done one")]);
    // The current turn's thinking goes back unmodified.
    assert_eq!(out.messages[8], t.messages[8]);
    assert!(estimate_tokens(&out) < estimate_tokens(&t));
}

#[test]
fn drop_failed_results_keeps_the_pair_and_the_current_turn() {
    let t = three_turns();
    let out = drop_failed_tool_results(&t);
    validate_transcript(&out).unwrap();
    assert_eq!(
        out.messages[3].parts,
        vec![result("u1", true, FAILED_RESULT_NOTE)]
    );
    assert_eq!(out.messages[9], t.messages[9]);
    // A failed result shorter than the note stays as it is: the strategy never grows.
    let mut short = t.clone();
    short.messages[3] = user(vec![result("u1", true, "boom")]);
    assert_eq!(drop_failed_tool_results(&short), short);
}

#[test]
fn keep_last_turns_cuts_at_a_turn_start_and_keeps_the_system_prompt() {
    let t = three_turns();
    let (out, cut) = keep_last_turns(&t, 2, None);
    assert_eq!(cut, Some(5));
    validate_transcript(&out).unwrap();
    assert_eq!(out.messages.len(), 1 + (t.messages.len() - 5));
    assert_eq!(out.messages[0].role, Role::System);
    assert_eq!(out.messages[1..], t.messages[5..]);
    // Keeping as many turns as there are (or more) changes nothing.
    assert_eq!(keep_last_turns(&t, 3, None), (t.clone(), None));
    // Zero counts as one: the current turn always stays.
    assert_eq!(keep_last_turns(&t, 0, None).1, Some(7));
}

#[test]
fn a_summary_goes_in_front_of_the_first_kept_user_message() {
    let t = three_turns();
    let (out, cut) = keep_last_turns(&t, 1, Some("we did one and two"));
    assert_eq!(cut, Some(7));
    validate_transcript(&out).unwrap();
    assert_eq!(
        out.messages[1].parts,
        vec![
            Part::text(format!("{SUMMARY_HEADING}\nwe did one and two")),
            Part::text("three"),
        ]
    );
    assert_eq!(turns_before_cut(&t, 1).messages, t.messages[1..7].to_vec());
    assert!(turns_before_cut(&t, 5).messages.is_empty());
}

#[test]
fn reasoning_before_the_last_call_set_stays_when_a_turn_ended_on_its_tool_results() {
    // Turn 1 ended after its tool results (its round limit, say); turn 2 is a new message.
    let mut t = Transcript::new();
    t.messages.push(user(vec![Part::text("one")]));
    t.messages
        .push(assistant(vec![thinking("t0"), Part::text("first")]));
    t.messages.push(user(vec![Part::text("two")]));
    t.messages
        .push(assistant(vec![thinking("t1"), tool_use("a")]));
    t.messages.push(user(vec![result("a", false, "1")]));
    t.messages.push(user(vec![Part::text("three")]));
    let first = drop_reasoning_by(&t, CompactionRules::First);
    assert_eq!(first.messages[3].parts, vec![tool_use("a")]);
    assert_eq!(first, drop_reasoning(&t));
    let kept = drop_reasoning_by(&t, CompactionRules::KeepLastCallsReasoning);
    assert_eq!(kept.messages[1].parts, vec![Part::text("first")]);
    assert_eq!(kept.messages[3], t.messages[3]);
    validate_transcript(&kept).unwrap();
    // A summary of the turns before the last one keeps it too: they end on that call set.
    let request = summary_request(&t, 1);
    assert_eq!(request.messages[3], t.messages[3]);
    assert_eq!(request.messages[1].parts, vec![Part::text("first")]);
    validate_transcript(&request).unwrap();
    // Once an answer follows, that call set is no longer the last assistant message.
    t.messages
        .push(assistant(vec![thinking("t2"), Part::text("done")]));
    t.messages.push(user(vec![Part::text("four")]));
    let kept = drop_reasoning_by(&t, CompactionRules::KeepLastCallsReasoning);
    assert_eq!(kept.messages[3].parts, vec![tool_use("a")]);
    assert_eq!(kept.messages[6].parts, vec![Part::text("done")]);
}

#[test]
fn compact_applies_strategies_in_order_and_reports_the_cut() {
    let t = three_turns();
    let plan = CompactionPlan {
        strategies: vec![
            CompactionStrategy::DropReasoning,
            CompactionStrategy::DropFailedToolResults,
            CompactionStrategy::KeepLastTurns,
        ],
        keep_last_turns: 2,
        summary: None,
        rules: CompactionRules::First,
    };
    let out = compact(&t, &plan);
    assert_eq!(out.cut, Some(5));
    validate_transcript(&out.transcript).unwrap();
    assert_eq!(out.transcript.messages[1..], t.messages[5..]);
    // The same plan on the same transcript gives the same bytes.
    assert_eq!(
        compact(&t, &plan).transcript.canonical_json(),
        out.transcript.canonical_json()
    );
    // Compacting again changes nothing: strategies are idempotent.
    assert_eq!(compact(&out.transcript, &plan).transcript, out.transcript);
}

#[test]
fn estimate_is_bytes_over_four_rounded_up() {
    let t = three_turns();
    let bytes = t.canonical_json().len() as u64;
    assert_eq!(estimate_tokens(&t), bytes.div_ceil(4));
    assert_eq!(estimate_tokens(&Transcript::new()), 4); // `{"messages":[]}` is 15 bytes
}

// ---- properties ----

/// One generated turn: rounds of (has thinking, results' error flags), then a final answer
/// with or without thinking.
type TurnShape = (Vec<(bool, Vec<bool>)>, bool);

fn build(system: bool, turns: &[TurnShape], open_loop: bool) -> Transcript {
    let mut t = Transcript::new();
    if system {
        t.push_system("sys");
    }
    let mut next_id = 0;
    for (ti, (rounds, final_thinking)) in turns.iter().enumerate() {
        t.messages
            .push(user(vec![Part::text(format!("turn {ti}"))]));
        for (ri, (with_thinking, errors)) in rounds.iter().enumerate() {
            let mut parts = Vec::new();
            if *with_thinking {
                parts.push(thinking(&format!("{ti}.{ri}")));
            }
            let ids: Vec<String> = errors
                .iter()
                .map(|_| {
                    next_id += 1;
                    format!("id{next_id}")
                })
                .collect();
            for id in &ids {
                parts.push(tool_use(id));
            }
            t.messages.push(assistant(parts));
            t.messages.push(user(
                ids.iter()
                    .zip(errors)
                    .map(|(id, e)| result(id, *e, &format!("out {id}")))
                    .collect(),
            ));
        }
        let last = ti + 1 == turns.len();
        if !(last && open_loop) {
            let mut parts = Vec::new();
            if *final_thinking {
                parts.push(Part::RedactedThinking {
                    data: format!("r{ti}"),
                });
            }
            parts.push(Part::text(format!("answer {ti}")));
            t.messages.push(assistant(parts));
        }
    }
    t
}

fn transcripts() -> impl Strategy<Value = Transcript> {
    let round = (any::<bool>(), prop::collection::vec(any::<bool>(), 1..3));
    let turn = (prop::collection::vec(round, 0..3), any::<bool>());
    (
        any::<bool>(),
        prop::collection::vec(turn, 0..5),
        any::<bool>(),
    )
        .prop_map(|(system, turns, open)| build(system, &turns, open))
}

fn plans() -> impl Strategy<Value = CompactionPlan> {
    let strategy = prop_oneof![
        Just(CompactionStrategy::DropReasoning),
        Just(CompactionStrategy::DropFailedToolResults),
        Just(CompactionStrategy::KeepLastTurns),
    ];
    (
        prop::collection::vec(strategy, 0..4),
        0u32..4,
        prop::option::of("[a-z ]{1,12}"),
        prop::bool::ANY,
    )
        .prop_map(|(mut strategies, keep_last_turns, summary, first_rules)| {
            // A plan names each strategy once (the policy check refuses repeats).
            let mut seen = Vec::new();
            strategies.retain(|s| {
                let new = !seen.contains(s);
                seen.push(*s);
                new
            });
            CompactionPlan {
                strategies,
                keep_last_turns,
                summary,
                rules: if first_rules {
                    CompactionRules::First
                } else {
                    CompactionRules::KeepLastCallsReasoning
                },
            }
        })
}

fn reasoning_of(m: &Message) -> Vec<&Part> {
    m.parts.iter().filter(|p| p.is_reasoning()).collect()
}

proptest! {
    #[test]
    fn any_compaction_of_a_valid_transcript_is_valid(t in transcripts(), plan in plans()) {
        prop_assert!(validate_transcript(&t).is_ok());
        let out = compact(&t, &plan);
        prop_assert!(validate_transcript(&out.transcript).is_ok(), "{:?}", validate_transcript(&out.transcript));
        if plan.summary.is_none() {
            prop_assert!(estimate_tokens(&out.transcript) <= estimate_tokens(&t));
        }
        // The current turn is never touched.
        if let Some(start) = current_turn_start(&t) {
            let tail = &t.messages[start..];
            let out_tail = &out.transcript.messages[out.transcript.messages.len() - tail.len()..];
            if plan.summary.is_none() || out.cut.is_none() {
                prop_assert_eq!(out_tail, tail);
            } else {
                prop_assert_eq!(&out_tail[1..], &tail[1..]);
            }
        }
        // Every kept message maps to an original one: the same message, or the same with
        // reasoning dropped whole, failed results replaced, or the summary put in front.
        let offset = out.cut.map_or(0, |cut| {
            let systems = t.messages.iter().take_while(|m| m.role == Role::System).count();
            cut - systems
        });
        for (i, m) in out.transcript.messages.iter().enumerate() {
            let original = if m.role == Role::System { &t.messages[i] } else { &t.messages[i + offset] };
            prop_assert_eq!(m.role, original.role);
            let r = reasoning_of(m);
            // Reasoning is byte-identical and in order, or all gone.
            prop_assert!(r.is_empty() || r == reasoning_of(original));
            let uses = |m: &Message| m.parts.iter().filter_map(|p| match p {
                Part::ToolUse(u) => Some(u.clone()), _ => None }).collect::<Vec<_>>();
            prop_assert_eq!(uses(m), uses(original));
            let results = |m: &Message| m.parts.iter().filter_map(|p| match p {
                Part::ToolResult(r) => Some((r.tool_use_id.clone(), r.is_error)), _ => None }).collect::<Vec<_>>();
            prop_assert_eq!(results(m), results(original));
        }
    }

    #[test]
    fn compaction_is_idempotent(t in transcripts(), plan in plans()) {
        let once = compact(&t, &plan).transcript;
        let summaryless = CompactionPlan { summary: None, ..plan.clone() };
        prop_assert_eq!(compact(&once, &summaryless).transcript, once);
    }
}
