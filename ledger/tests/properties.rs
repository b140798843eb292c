//! Property tests: generated valid transcripts validate, single mutations are rejected with the
//! exact violation they cause, encodings round-trip byte for byte, and the tool-result projection
//! is deterministic and bounded.

use cairn_ledger::{
    project_tool_result, validate_transcript, validate_transcript_from, Error, JsonText, Message,
    Part, Provenance, Role, ToolResult, ToolResultContent, ToolUse, Transcript, Violation,
    PREVIEW_BYTES, TRANSCRIPT_RESULT_LIMIT_BYTES as LIMIT,
};
use proptest::prelude::*;
use proptest::sample::{select, Index};

// ---------------------------------------------------------------------------------------------
// Strings and JSON text
// ---------------------------------------------------------------------------------------------

fn arb_string(len: std::ops::Range<usize>) -> impl Strategy<Value = String> {
    prop_oneof![
        // Mostly readable text, sometimes any Unicode scalar (controls, quotes, astral planes).
        prop::collection::vec(
            select(vec!['a', 'b', 'z', ' ', 'é', '日', '"', '\\']),
            len.clone()
        )
        .prop_map(String::from_iter),
        prop::collection::vec(any::<char>(), len).prop_map(String::from_iter),
    ]
}

/// Insignificant JSON whitespace.
fn arb_ws() -> impl Strategy<Value = &'static str> {
    select(vec!["", "", "", " ", "\n  ", "\t", "\r\n"])
}

fn arb_number() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(|f| serde_json::to_string(&f).unwrap()),
        select(vec![
            "9007199254740993",
            "-9007199254740993",
            "18446744073709551616",
            "123456789012345678901234567890",
            "1.0000000000000000001",
            "0.1",
            "-0",
            "1E+2",
            "2.5e-3",
            "1e400",
        ])
        .prop_map(str::to_owned),
    ]
}

fn arb_key() -> impl Strategy<Value = String> {
    prop_oneof![
        select(vec!["z", "a", "m", "b", "id", "é", "", "A", "_"]).prop_map(str::to_owned),
        arb_string(0..6),
    ]
}

/// One JSON value as text, keys in generated (not sorted) order, with random inner whitespace.
fn arb_json_value() -> BoxedStrategy<String> {
    let leaf = prop_oneof![
        select(vec!["null", "true", "false"]).prop_map(str::to_owned),
        arb_number(),
        arb_string(0..10).prop_map(|s| serde_json::to_string(&s).unwrap()),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            (
                prop::collection::vec((arb_ws(), inner.clone()), 0..4),
                arb_ws()
            )
                .prop_map(|(items, end)| {
                    let items: Vec<String> =
                        items.into_iter().map(|(w, v)| format!("{w}{v}")).collect();
                    format!("[{}{end}]", items.join(","))
                }),
            prop::collection::vec((arb_key(), arb_ws(), inner), 0..4).prop_map(|entries| {
                let entries: Vec<String> = entries
                    .into_iter()
                    .map(|(k, w, v)| format!("{}:{w}{v}", serde_json::to_string(&k).unwrap()))
                    .collect();
                format!("{{{}}}", entries.join(","))
            }),
        ]
    })
    .boxed()
}

/// JSON text as a tool might print it, sometimes with whitespace around the value.
fn arb_json_text() -> impl Strategy<Value = String> {
    (arb_ws(), arb_json_value(), arb_ws()).prop_map(|(a, v, b)| format!("{a}{v}{b}"))
}

// ---------------------------------------------------------------------------------------------
// A trivial model of a valid conversation
// ---------------------------------------------------------------------------------------------

fn arb_reasoning_or_text() -> impl Strategy<Value = Part> {
    prop_oneof![
        (arb_string(0..8), arb_string(1..8))
            .prop_map(|(text, signature)| Part::Thinking { text, signature }),
        arb_string(1..8).prop_map(|data| Part::RedactedThinking { data }),
        arb_string(1..8).prop_map(Part::text),
    ]
}

fn arb_signed_thinking() -> impl Strategy<Value = Part> {
    (arb_string(0..8), arb_string(1..8))
        .prop_map(|(text, signature)| Part::Thinking { text, signature })
}

fn arb_result_content() -> impl Strategy<Value = ToolResultContent> {
    prop_oneof![
        arb_json_text().prop_map(|t| ToolResultContent::Json(JsonText::parse(t).unwrap())),
        arb_string(0..16).prop_map(ToolResultContent::Text),
    ]
}

#[derive(Debug, Clone)]
struct CallSpec {
    thinking_before: Option<Part>,
    name: String,
    arguments: String,
    content: ToolResultContent,
    is_error: bool,
}

#[derive(Debug, Clone)]
struct RoundSpec {
    prefix: Vec<Part>,
    calls: Vec<CallSpec>,
    text_after_results: Option<String>,
}

#[derive(Debug, Clone)]
struct TurnSpec {
    user: String,
    rounds: Vec<RoundSpec>,
    final_prefix: Vec<Part>,
    final_text: String,
}

fn arb_call() -> impl Strategy<Value = CallSpec> {
    (
        prop::option::of(arb_signed_thinking()),
        arb_string(1..8),
        arb_json_text(),
        arb_result_content(),
        any::<bool>(),
    )
        .prop_map(
            |(thinking_before, name, arguments, content, is_error)| CallSpec {
                thinking_before,
                name,
                arguments,
                content,
                is_error,
            },
        )
}

fn arb_round() -> impl Strategy<Value = RoundSpec> {
    (
        prop::collection::vec(arb_reasoning_or_text(), 0..4),
        prop::collection::vec(arb_call(), 1..=3),
        prop::option::of(arb_string(1..8)),
    )
        .prop_map(|(prefix, calls, text_after_results)| RoundSpec {
            prefix,
            calls,
            text_after_results,
        })
}

fn arb_turn() -> impl Strategy<Value = TurnSpec> {
    (
        arb_string(1..12),
        prop::collection::vec(arb_round(), 0..=3),
        prop::collection::vec(arb_reasoning_or_text(), 0..3),
        arb_string(1..12),
    )
        .prop_map(|(user, rounds, final_prefix, final_text)| TurnSpec {
            user,
            rounds,
            final_prefix,
            final_text,
        })
}

fn provenance() -> Option<Provenance> {
    Some(Provenance {
        provider: "scripted".to_owned(),
        model: "demo".to_owned(),
    })
}

fn build(system: Option<String>, turns: Vec<TurnSpec>, id_style: &str) -> Transcript {
    let mut messages = Vec::new();
    if let Some(text) = system {
        messages.push(Message {
            role: Role::System,
            parts: vec![Part::text(text)],
            provenance: None,
        });
    }
    let mut next_id = 0usize;
    for turn in turns {
        messages.push(Message {
            role: Role::User,
            parts: vec![Part::text(turn.user)],
            provenance: None,
        });
        for round in turn.rounds {
            let mut parts = round.prefix;
            let mut results = Vec::new();
            for call in round.calls {
                let id = format!("{id_style}{next_id}");
                next_id += 1;
                parts.extend(call.thinking_before);
                parts.push(Part::ToolUse(ToolUse {
                    id: id.clone(),
                    name: call.name,
                    arguments: call.arguments,
                    signature: None,
                }));
                results.push(Part::ToolResult(ToolResult {
                    tool_use_id: id,
                    content: call.content,
                    is_error: call.is_error,
                }));
            }
            messages.push(Message {
                role: Role::Assistant,
                parts,
                provenance: provenance(),
            });
            results.extend(round.text_after_results.map(Part::text));
            messages.push(Message {
                role: Role::User,
                parts: results,
                provenance: None,
            });
        }
        let mut parts = turn.final_prefix;
        parts.push(Part::text(turn.final_text));
        messages.push(Message {
            role: Role::Assistant,
            parts,
            provenance: provenance(),
        });
    }
    Transcript { messages }
}

fn arb_transcript() -> impl Strategy<Value = Transcript> {
    (
        prop::option::of(arb_string(1..12)),
        prop::collection::vec(arb_turn(), 1..=3),
        select(vec!["toolu_", "call_", "fc-", ""]),
    )
        .prop_map(|(system, turns, id_style)| build(system, turns, id_style))
}

fn has_tool_round(t: &Transcript) -> bool {
    t.messages
        .iter()
        .any(|m| m.parts.iter().any(|p| matches!(p, Part::ToolUse(_))))
}

// ---------------------------------------------------------------------------------------------
// Mutations and the exact error each must produce
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Mutation {
    DropResult,
    SwapResults,
    DuplicateResult,
    ClearSignature,
    EmptyText,
    AppendThinking,
    DuplicateToolUseId,
}

const MUTATIONS: [Mutation; 7] = [
    Mutation::DropResult,
    Mutation::SwapResults,
    Mutation::DuplicateResult,
    Mutation::ClearSignature,
    Mutation::EmptyText,
    Mutation::AppendThinking,
    Mutation::DuplicateToolUseId,
];

/// Where things are in a transcript.
struct Layout {
    /// (message index, number of leading tool_results) of every results message.
    results: Vec<(usize, usize)>,
    thinking: Vec<(usize, usize)>,
    texts: Vec<(usize, usize)>,
    assistants: Vec<usize>,
    /// (message index, part index) of every tool_use, in transcript order.
    tool_uses: Vec<(usize, usize)>,
}

fn layout(t: &Transcript) -> Layout {
    let mut l = Layout {
        results: Vec::new(),
        thinking: Vec::new(),
        texts: Vec::new(),
        assistants: Vec::new(),
        tool_uses: Vec::new(),
    };
    for (mi, m) in t.messages.iter().enumerate() {
        if m.role == Role::Assistant {
            l.assistants.push(mi);
        }
        let leading = m
            .parts
            .iter()
            .take_while(|p| matches!(p, Part::ToolResult(_)))
            .count();
        if leading > 0 {
            l.results.push((mi, leading));
        }
        for (pi, p) in m.parts.iter().enumerate() {
            match p {
                Part::Thinking { .. } => l.thinking.push((mi, pi)),
                Part::Text { .. } => l.texts.push((mi, pi)),
                Part::ToolUse(_) => l.tool_uses.push((mi, pi)),
                _ => {}
            }
        }
    }
    l
}

fn result_id(t: &Transcript, mi: usize, pi: usize) -> String {
    match &t.messages[mi].parts[pi] {
        Part::ToolResult(r) => r.tool_use_id.clone(),
        other => panic!("expected a tool_result at {mi}/{pi}, found {other:?}"),
    }
}

fn tool_use_id(t: &Transcript, mi: usize, pi: usize) -> String {
    match &t.messages[mi].parts[pi] {
        Part::ToolUse(u) => u.id.clone(),
        other => panic!("expected a tool_use at {mi}/{pi}, found {other:?}"),
    }
}

fn at(message: usize, part: Option<usize>, violation: Violation) -> Error {
    Error::InvalidTranscript {
        message,
        part,
        violation,
    }
}

/// Applies `mutation` in place and returns the error validation must report, or `None` when the
/// transcript offers nothing to mutate that way.
/// The index of the first message with a tool_use of `id`.
fn first_use(t: &Transcript, id: &str) -> usize {
    t.messages
        .iter()
        .position(|m| {
            m.parts
                .iter()
                .any(|p| matches!(p, Part::ToolUse(u) if u.id == id))
        })
        .expect("the duplicated id is used")
}

fn mutate(t: &mut Transcript, mutation: Mutation, [a, b, c]: [Index; 3]) -> Option<Error> {
    let l = layout(t);
    match mutation {
        Mutation::DropResult => {
            let &(mi, n) = a.get(&l.results);
            let k = b.index(n);
            let dropped = result_id(t, mi, k);
            let next = (k + 1 < n).then(|| result_id(t, mi, k + 1));
            t.messages[mi].parts.remove(k);
            let len = t.messages[mi].parts.len();
            Some(match next {
                // The following result now stands where the dropped one was expected.
                Some(found) => at(
                    mi,
                    Some(k),
                    Violation::ToolResultOutOfOrder {
                        expected: dropped,
                        found,
                    },
                ),
                None if len == 0 => at(mi, None, Violation::EmptyMessage),
                // Text after the results now stands where the last result was expected.
                None if len > k => at(
                    mi,
                    Some(k),
                    Violation::MissingToolResult {
                        tool_use_id: dropped,
                    },
                ),
                None => at(
                    mi,
                    None,
                    Violation::MissingToolResult {
                        tool_use_id: dropped,
                    },
                ),
            })
        }
        Mutation::SwapResults => {
            let candidates: Vec<(usize, usize)> =
                l.results.iter().copied().filter(|&(_, n)| n >= 2).collect();
            if candidates.is_empty() {
                return None;
            }
            let &(mi, n) = a.get(&candidates);
            let i = b.index(n - 1);
            let j = i + 1 + c.index(n - 1 - i);
            let expected = result_id(t, mi, i);
            let found = result_id(t, mi, j);
            t.messages[mi].parts.swap(i, j);
            Some(at(
                mi,
                Some(i),
                Violation::ToolResultOutOfOrder { expected, found },
            ))
        }
        Mutation::DuplicateResult => {
            let &(mi, n) = a.get(&l.results);
            let k = b.index(n);
            let copy = t.messages[mi].parts[k].clone();
            t.messages[mi].parts.insert(k + 1, copy);
            Some(at(
                mi,
                Some(k + 1),
                Violation::UnexpectedToolResult {
                    tool_use_id: result_id(t, mi, k),
                },
            ))
        }
        Mutation::ClearSignature => {
            if l.thinking.is_empty() {
                return None;
            }
            let &(mi, pi) = a.get(&l.thinking);
            if let Part::Thinking { signature, .. } = &mut t.messages[mi].parts[pi] {
                signature.clear();
            }
            Some(at(mi, Some(pi), Violation::ThinkingWithoutSignature))
        }
        Mutation::EmptyText => {
            let &(mi, pi) = a.get(&l.texts);
            if let Part::Text { text, .. } = &mut t.messages[mi].parts[pi] {
                text.clear();
            }
            Some(at(mi, Some(pi), Violation::EmptyText))
        }
        Mutation::AppendThinking => {
            let mi = *a.get(&l.assistants);
            let parts = &mut t.messages[mi].parts;
            parts.push(Part::Thinking {
                text: "afterthought".to_owned(),
                signature: "sig".to_owned(),
            });
            Some(at(
                mi,
                Some(parts.len() - 1),
                Violation::AssistantEndsOnThinking,
            ))
        }
        Mutation::DuplicateToolUseId => {
            let n = l.tool_uses.len();
            if n < 2 {
                return None;
            }
            let i = a.index(n - 1);
            let j = i + 1 + b.index(n - 1 - i);
            let (mi, pi) = l.tool_uses[i];
            let (mj, pj) = l.tool_uses[j];
            let id = tool_use_id(t, mi, pi);
            if let Part::ToolUse(u) = &mut t.messages[mj].parts[pj] {
                u.id = id.clone();
            }
            Some(at(mj, Some(pj), Violation::DuplicateToolUseId { id }))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Projection inputs
// ---------------------------------------------------------------------------------------------

/// A string whose JSON-escaped form (without the quotes) is exactly `budget` bytes: `units`
/// repeated while they fit, then padded with `a`.
fn fill(units: &[&str], budget: usize) -> String {
    let mut out = String::new();
    let mut used = 0;
    'outer: loop {
        for unit in units {
            let cost = serde_json::to_string(unit).unwrap().len() - 2;
            if used + cost > budget {
                break 'outer;
            }
            out.push_str(unit);
            used += cost;
        }
    }
    out.extend(std::iter::repeat_n('a', budget - used));
    out
}

/// A tool result whose canonical JSON is exactly `target` bytes.
fn sized_result(units: &[&str], target: usize, as_json: bool, is_error: bool) -> ToolResult {
    let content = if as_json {
        // Unsorted keys and a number beyond f64 around a big string.
        let head = r#"{"z":9007199254740993,"data":"#;
        let s = fill(units, target - head.len() - 3);
        let text = format!("{head}{}}}", serde_json::to_string(&s).unwrap());
        ToolResultContent::Json(JsonText::parse(text).unwrap())
    } else {
        ToolResultContent::Text(fill(units, target - 2))
    };
    ToolResult {
        tool_use_id: "toolu_big".to_owned(),
        content,
        is_error,
    }
}

fn arb_size() -> impl Strategy<Value = usize> {
    prop_oneof![
        2 => Just(LIMIT),
        2 => Just(LIMIT + 1),
        6 => (LIMIT - 600)..(LIMIT + 600),
        1 => 64usize..8192,
        2 => (LIMIT + 600)..(4 * LIMIT),
    ]
}

fn arb_units() -> impl Strategy<Value = Vec<&'static str>> {
    prop::collection::vec(
        select(vec![
            "a",
            "é",
            "\"",
            "\\",
            "\n",
            "\u{1}",
            "日本",
            "😀",
            "ab cd ",
            "{\"k\":1}",
        ]),
        1..4,
    )
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn generated_transcripts_are_valid(t in arb_transcript()) {
        prop_assert_eq!(validate_transcript(&t), Ok(()));
    }

    #[test]
    fn every_mutation_is_rejected_with_its_violation(
        t in arb_transcript().prop_filter("needs a tool round", has_tool_round),
        kind in 0..MUTATIONS.len(),
        a in any::<Index>(),
        b in any::<Index>(),
        c in any::<Index>(),
    ) {
        let mut mutated = t.clone();
        let expected = mutate(&mut mutated, MUTATIONS[kind], [a, b, c]);
        prop_assume!(expected.is_some());
        prop_assert_eq!(validate_transcript(&mutated), Err(expected.unwrap()));
    }

    #[test]
    fn a_valid_transcript_is_valid_from_any_point(t in arb_transcript(), from in any::<Index>()) {
        let from = from.index(t.messages.len() + 1);
        prop_assert_eq!(validate_transcript_from(&t, from), Ok(()));
    }

    /// Checked from any point at or before the first broken message, a mutated transcript
    /// fails as the whole check fails; a duplicated tool_use id only when the check starts
    /// at or before its first use.
    #[test]
    fn a_check_from_a_point_before_the_violation_finds_it(
        t in arb_transcript().prop_filter("needs a tool round", has_tool_round),
        kind in 0..MUTATIONS.len(),
        a in any::<Index>(),
        b in any::<Index>(),
        c in any::<Index>(),
        from in any::<Index>(),
    ) {
        let mut mutated = t.clone();
        let expected = mutate(&mut mutated, MUTATIONS[kind], [a, b, c]);
        prop_assume!(expected.is_some());
        let expected = expected.unwrap();
        let Error::InvalidTranscript { message, violation, .. } = &expected else {
            panic!("a mutation breaks a transcript rule: {expected:?}");
        };
        let last_from = match violation {
            Violation::DuplicateToolUseId { id } => first_use(&mutated, id),
            _ => *message,
        };
        let from = from.index(last_from + 1);
        prop_assert_eq!(validate_transcript_from(&mutated, from), Err(expected));
    }

    #[test]
    fn canonical_json_is_deterministic_and_round_trips(t in arb_transcript()) {
        let canonical = t.canonical_json();
        prop_assert_eq!(&t.clone().canonical_json(), &canonical);
        prop_assert_eq!(&serde_json::to_vec(&t).unwrap(), &canonical);

        let via_json: Transcript = serde_json::from_slice(&canonical).unwrap();
        prop_assert_eq!(&via_json, &t);
        prop_assert_eq!(&via_json.canonical_json(), &canonical);

        let packed = rmp_serde::to_vec_named(&t).unwrap();
        let via_msgpack: Transcript = rmp_serde::from_slice(&packed).unwrap();
        prop_assert_eq!(&via_msgpack, &t);
        prop_assert_eq!(&via_msgpack.canonical_json(), &canonical);
        prop_assert_eq!(rmp_serde::to_vec_named(&via_msgpack).unwrap(), packed);
    }

    #[test]
    fn json_text_survives_both_encodings_exactly(text in arb_json_text()) {
        let json = JsonText::parse(text.as_str()).unwrap();
        // Only the whitespace around the value may go.
        prop_assert_eq!(json.as_str(), text.trim_matches([' ', '\n', '\r', '\t']));
        let t = transcript_with_json(json.clone(), &text);

        let via_json: Transcript = serde_json::from_slice(&t.canonical_json()).unwrap();
        let via_msgpack: Transcript =
            rmp_serde::from_slice(&rmp_serde::to_vec_named(&t).unwrap()).unwrap();
        for back in [&via_json, &via_msgpack] {
            let (result, arguments) = json_of(back);
            prop_assert_eq!(result.as_str(), json.as_str());
            prop_assert_eq!(arguments, text.as_str());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn projection_is_deterministic_and_bounded(
        units in arb_units(),
        size in arb_size(),
        as_json in any::<bool>(),
        is_error in any::<bool>(),
    ) {
        let r = sized_result(&units, size, as_json, is_error);
        let canonical = r.content.canonical_json();
        prop_assert_eq!(canonical.len(), size);

        let projected = project_tool_result(r.clone());
        prop_assert_eq!(&project_tool_result(r.clone()), &projected);
        // Projecting twice changes nothing more.
        prop_assert_eq!(&project_tool_result(projected.clone()), &projected);
        // push_tool_results applies the same projection.
        let mut t = Transcript::new();
        t.push_tool_results([r.clone()]);
        prop_assert_eq!(&t.messages[0].parts, &vec![Part::ToolResult(projected.clone())]);

        if size <= LIMIT {
            prop_assert_eq!(&projected, &r);
        } else {
            prop_assert_eq!(&projected.tool_use_id, &r.tool_use_id);
            prop_assert_eq!(projected.is_error, is_error);
            let ToolResultContent::Json(json) = &projected.content else {
                panic!("expected an omission object, got {:?}", projected.content);
            };
            let head = r#"{"omitted":true,"reason":""#;
            prop_assert!(json.as_str().starts_with(head));
            let value = json.to_value().unwrap();
            prop_assert_eq!(&value["omitted"], &serde_json::json!(true));
            prop_assert!(value["reason"].is_string());
            prop_assert_eq!(value["original_bytes"].as_u64(), Some(canonical.len() as u64));
            prop_assert_eq!(value["limit_bytes"].as_u64(), Some(LIMIT as u64));
            let preview = value["preview"].as_str().unwrap();
            prop_assert!(canonical.starts_with(preview));
            // Cut at the last char boundary at or before PREVIEW_BYTES.
            prop_assert!(preview.len() <= PREVIEW_BYTES && preview.len() + 4 > PREVIEW_BYTES);
            // Escaping the preview at most doubles it.
            prop_assert!(
                projected.content.canonical_json().len() <= 2 * PREVIEW_BYTES + 512,
                "projected result is {} bytes",
                projected.content.canonical_json().len()
            );
        }
    }
}

fn transcript_with_json(result: JsonText, arguments: &str) -> Transcript {
    Transcript {
        messages: vec![
            Message {
                role: Role::User,
                parts: vec![Part::text("go")],
                provenance: None,
            },
            Message {
                role: Role::Assistant,
                parts: vec![Part::ToolUse(ToolUse {
                    id: "toolu_1".to_owned(),
                    name: "fetch".to_owned(),
                    arguments: arguments.to_owned(),
                    signature: Some("per-call-sig".to_owned()),
                })],
                provenance: provenance(),
            },
            Message {
                role: Role::User,
                parts: vec![Part::ToolResult(ToolResult {
                    tool_use_id: "toolu_1".to_owned(),
                    content: ToolResultContent::Json(result),
                    is_error: false,
                })],
                provenance: None,
            },
        ],
    }
}

fn json_of(t: &Transcript) -> (&JsonText, &str) {
    let Part::ToolUse(u) = &t.messages[1].parts[0] else {
        panic!("expected a tool_use")
    };
    let Part::ToolResult(ToolResult {
        content: ToolResultContent::Json(json),
        ..
    }) = &t.messages[2].parts[0]
    else {
        panic!("expected a JSON tool_result")
    };
    (json, u.arguments.as_str())
}

#[test]
fn big_numbers_and_key_order_survive_both_round_trips() {
    let text = r#"{"z":9007199254740993,"a":{"y":[1.0000000000000000001,-0,1e400],"b":null},"m":"é\u00e9"}"#;
    let t = transcript_with_json(JsonText::parse(text).unwrap(), text);
    assert_eq!(validate_transcript(&t), Ok(()));

    let canonical = t.canonical_json();
    let embedded = String::from_utf8(canonical.clone()).unwrap();
    assert!(
        embedded.contains(&format!(r#"{{"json":{text}}}"#)),
        "the JSON view embeds the value verbatim: {embedded}"
    );
    let via_json: Transcript = serde_json::from_slice(&canonical).unwrap();
    assert_eq!(json_of(&via_json).0.as_str(), text);
    assert_eq!(json_of(&via_json).1, text);
    assert_eq!(via_json, t);

    let via_msgpack: Transcript =
        rmp_serde::from_slice(&rmp_serde::to_vec_named(&t).unwrap()).unwrap();
    assert_eq!(json_of(&via_msgpack).0.as_str(), text);
    assert_eq!(via_msgpack, t);
    assert_eq!(via_msgpack.canonical_json(), canonical);
}

#[test]
fn json_text_drops_only_the_whitespace_around_the_value() {
    // A tool printing `{...}\n` must give the same JsonText through every encoding.
    let json = JsonText::parse(" {\"b\" : 1,\n \"a\":2}\n").unwrap();
    assert_eq!(json.as_str(), "{\"b\" : 1,\n \"a\":2}");
    let t = transcript_with_json(json.clone(), "{}");
    let via_json: Transcript = serde_json::from_slice(&t.canonical_json()).unwrap();
    assert_eq!(via_json, t);
    let via_msgpack: Transcript =
        rmp_serde::from_slice(&rmp_serde::to_vec_named(&t).unwrap()).unwrap();
    assert_eq!(via_msgpack, t);
}
