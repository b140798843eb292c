//! Tests of the chaos harness's parts: the script, the child's protocol lines, the acks and the
//! checks of the side-effect file and of the acknowledged states.

use super::child::ledger_fingerprint;
use super::script::{script_json, turn_shape};
use super::verify::{check_session, check_side_effects, Ledgers};
use super::*;
use cairn_activities::Tool;
use cairn_ledger::ModelSpec;
use cairn_runtime::{Client, Engine, SessionOptions, SystemClock};
use std::sync::Arc;

#[test]
fn the_script_loads_and_grows_without_changing_its_start() {
    let two = script_json(2, 7);
    let five = script_json(5, 7);
    let short = cairn_activities::Script::from_json(&two, "two.json").unwrap();
    let long = cairn_activities::Script::from_json(&five, "five.json").unwrap();
    for i in 0..short.len() {
        assert_eq!(short.response(i), long.response(i));
    }
    let calls: usize = (1..=5).map(|t| turn_shape(7, t).len() + 1).sum();
    assert_eq!(long.len(), calls);
    assert!((1..=20).all(|t| {
        let shape = turn_shape(7, t);
        (1..=2).contains(&shape.len()) && shape.iter().all(|c| (2..=3).contains(c))
    }));
}

#[test]
fn child_lines_cut_by_a_kill_are_dropped() {
    let text = "ready 3 4 0 2\nack chaos-000 5 00000000000000ff\nack chaos-001 7 00ab\ndone\nack chaos-000 9 1";
    let output = read_child_output(text.as_bytes(), Instant::now());
    assert_eq!(
        output.acks,
        [
            ("chaos-000".to_owned(), 5, 0xff),
            ("chaos-001".to_owned(), 7, 0xab)
        ]
    );
    let ready = output.ready.unwrap();
    assert_eq!((ready.running, ready.requeued, ready.released), (3, 0, 2));
    assert!(output.done);
}

#[test]
fn conflicting_acks_are_problems() {
    let mut acks = Acks::default();
    acks.insert("s", 3, 1);
    acks.insert("s", 3, 1);
    assert!(acks.conflicts.is_empty());
    acks.insert("s", 3, 2);
    assert_eq!(acks.conflicts.len(), 1);
    assert_eq!(acks.len(), 1);
}

fn record(key: &str, pid: u32) -> Vec<u8> {
    record_at(key, pid, 0)
}

fn record_at(key: &str, pid: u32, at_ms: u64) -> Vec<u8> {
    let tool_use_id = key.split_once('/').map_or(key, |(_, t)| t);
    record::encode(&SideEffectRecord {
        key: key.to_owned(),
        tool_use_id: tool_use_id.to_owned(),
        pid,
        attempt: 1,
        at_ms,
    })
}

/// Runs the side-effect check on `lines` against two recorded tool uses, with pid 10 killed.
fn side_effects(records: &[Vec<u8>], recorded: &[(&str, u32)]) -> ChaosReport {
    let explanations = Explanations {
        killed_pids: BTreeSet::from([10]),
        ..Explanations::default()
    };
    side_effects_explained(records, recorded, &explanations)
}

fn side_effects_explained(
    records: &[Vec<u8>],
    recorded: &[(&str, u32)],
    explanations: &Explanations,
) -> ChaosReport {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(SIDE_EFFECTS_FILE);
    std::fs::write(&path, records.concat()).unwrap();
    let ledgers = Ledgers {
        recorded: recorded
            .iter()
            .map(|(key, pid)| ((*key).to_owned(), Some(*pid)))
            .collect(),
    };
    let mut report = ChaosReport::default();
    check_side_effects(&path, &ledgers, explanations, &mut report).unwrap();
    report
}

#[test]
fn a_repeat_after_a_live_workers_run_is_explained_only_by_a_server_kill_between_the_runs() {
    let recorded = [("s/a", 11), ("s/b", 12)];
    // Worker 11 (never killed) ran s/a at 10 000 ms and again at 13 000 ms, after its
    // first report was lost; its lease was taken at most 1 500 ms before the first run.
    let records = [
        record_at("s/a", 11, 10_000),
        record_at("s/b", 12, 10_500),
        record_at("s/a", 11, 13_000),
    ];
    let check = |server_kills_ms: &[u64]| {
        let explanations = Explanations {
            killed_pids: BTreeSet::from([10]),
            server_kills_ms: server_kills_ms.to_vec(),
            lease_ms: 1_500,
        };
        side_effects_explained(&records, &recorded, &explanations)
    };
    for explained in [&[10_200][..], &[8_600], &[13_000], &[5_000, 12_000, 20_000]] {
        let report = check(explained);
        assert!(report.passed(), "{explained:?}: {:?}", report.problems);
        assert_eq!(
            (report.server_kill_repeats, report.same_process_repeats),
            (1, 1)
        );
        assert_eq!(report.max_repeats_per_kill, 1);
    }
    for unexplained in [&[][..], &[8_400], &[13_001], &[1_000, 14_000]] {
        let report = check(unexplained);
        let problems = report.problems.join("\n");
        let expected = if unexplained.is_empty() {
            // No server kill at all: in-process mode's problem.
            "s/a ran again after a run in process 11, which was not killed\n"
        } else {
            "s/a ran again after a run in process 11, which was not killed, and the server \
             was not killed between that run (at 10000 ms, lease 1500 ms) and the next (at \
             13000 ms)"
        };
        assert!(
            format!("{problems}\n").contains(expected),
            "{unexplained:?}: {problems}"
        );
        assert_eq!(report.server_kill_repeats, 0);
    }
}

#[test]
fn repeats_are_counted_and_must_be_explained_by_a_kill() {
    let recorded = [("s/a", 11), ("s/b", 11)];
    // a ran in the killed process 10, then again in 11, which recorded it: one repeat.
    let ok = side_effects(
        &[record("s/a", 10), record("s/b", 11), record("s/a", 11)],
        &recorded,
    );
    assert!(ok.passed(), "{:?}", ok.problems);
    assert_eq!(
        (ok.tool_runs, ok.repeated_tool_runs, ok.repeated_keys),
        (3, 1, 1)
    );
    assert_eq!((ok.max_runs_per_key, ok.max_repeats_per_kill), (2, 1));

    // A repeat after a run in a process that was not killed.
    let unexplained = side_effects(
        &[record("s/a", 12), record("s/a", 11), record("s/b", 11)],
        &recorded,
    );
    assert!(
        unexplained.problems[0].contains("process 12, which was not killed"),
        "{:?}",
        unexplained.problems
    );
    // The recorded result is not from the last run.
    let stale = side_effects(
        &[record("s/a", 11), record("s/a", 10), record("s/b", 11)],
        &recorded,
    );
    assert!(stale
        .problems
        .iter()
        .any(|p| p.contains("came from process 11, but its last run was in process 10")));
    // Twice in one process.
    let twice = side_effects(
        &[record("s/a", 11), record("s/a", 11), record("s/b", 11)],
        &recorded,
    );
    assert_eq!(twice.same_process_repeats, 1);
    // A key that names no tool_use, a tool_use that never ran, a damaged record.
    let mut flipped = record("s/a", 11);
    let last = flipped.len() - 3;
    flipped[last] ^= 0x01;
    let wrong = side_effects(
        &[
            record("s/a", 11),
            record("s/zzz", 11),
            record::encode(&SideEffectRecord {
                key: "s/a".to_owned(),
                tool_use_id: "b".to_owned(),
                pid: 11,
                attempt: 1,
                at_ms: 0,
            }),
            flipped,
        ],
        &recorded,
    );
    let problems = wrong.problems.join("\n");
    assert!(problems.contains(r#"key "s/zzz""#), "{problems}");
    assert!(problems.contains(r#"key "s/a" (tool_use b)"#), "{problems}");
    assert!(
        problems.contains("tool_use s/b has a recorded result but never ran"),
        "{problems}"
    );
    assert!(problems.contains("checksum mismatch"), "{problems}");
}

#[test]
fn a_torn_side_effect_record_is_accepted_only_from_a_killed_process() {
    let recorded = [("s/a", 11), ("s/b", 11)];
    // Process 10 (killed) tore its record of s/b at a 4 KiB page boundary; 11 ran it again.
    let torn = record("s/b", 10);
    // Records of s/a up to 10 bytes or more before the boundary; the first one's `at_ms`
    // (1 to 13 digits) moves the boundary into the torn record, past its pid.
    let filled = |first_at_ms: u64| {
        let mut file = record_at("s/a", 11, first_at_ms);
        while file.len() + record("s/a", 11).len() < 4096 - 10 {
            file.extend_from_slice(&record("s/a", 11));
        }
        file
    };
    let mut file = (0..13)
        .map(|digits| filled(10u64.pow(digits)))
        .find(|file| 4096 - file.len() < torn.len())
        .unwrap();
    let cut = 4096 - file.len();
    assert!(cut > 9 && cut < torn.len());
    file.extend_from_slice(&torn[..cut]);
    file.extend_from_slice(&record("s/b", 11));
    let runs = file.iter().filter(|b| **b == 0x1e).count() - 1;
    let ok = side_effects(&[file.clone()], &recorded);
    let killed_ok = ok.problems.iter().all(|p| !p.contains("torn"));
    assert!(killed_ok, "{:?}", ok.problems);
    assert_eq!((ok.torn_side_effects, ok.tool_runs), (1, runs));

    // The same tear by process 12, which was not killed: a problem.
    let mut by_live = file[..file.len() - record("s/b", 11).len() - cut].to_vec();
    by_live.extend_from_slice(&record("s/b", 12)[..cut]);
    by_live.extend_from_slice(&record("s/b", 11));
    let live = side_effects(&[by_live], &recorded);
    assert!(
        live.problems
            .iter()
            .any(|p| p.contains("a torn record by process 12, which was not killed")),
        "{:?}",
        live.problems
    );
}

#[tokio::test]
async fn acknowledged_states_must_be_in_the_history_with_their_ledger() {
    let engine = Engine::new(
        Arc::new(cairn_runtime::MemoryStore::new()),
        Arc::new(SystemClock),
    );
    let model = ModelSpec::parse("scripted:chaos.json").unwrap();
    let client = Client::new(engine.clone());
    let mut options = SessionOptions::new(model, vec![SideEffect::new("x").spec()]);
    options.session_id = Some(session_id(0));
    let id = client.start_session(options).await.unwrap();
    let after_start = ledger_fingerprint(&engine.state(&id).await.unwrap().transcript);
    engine.send_message(&id, "go", None).await.unwrap();
    let state = engine.state(&id).await.unwrap();
    let seq = state.next_seq - 1;
    let history = client.history(&id).await.unwrap();
    assert_eq!(history.len() as u64, seq);
    assert_ne!(after_start, ledger_fingerprint(&state.transcript));

    let check = |acked: &[(u64, u64)]| {
        let acked: BTreeMap<u64, u64> = acked.iter().copied().collect();
        let mut report = ChaosReport::default();
        check_session(
            &id,
            &history,
            Some(&acked),
            &mut report,
            &mut Ledgers::default(),
        );
        report.problems
    };
    let good = check(&[
        (1, after_start),
        (seq, ledger_fingerprint(&state.transcript)),
    ]);
    // The turn is still running and none completed: only those complaints.
    assert!(
        good.iter()
            .all(|p| p.contains("still running") || p.contains("turns completed")),
        "{good:?}"
    );
    let missing = check(&[(seq + 2, 0)]).join("\n");
    assert!(
        missing.contains(&format!("acknowledged event seq {} is missing", seq + 2)),
        "{missing}"
    );
    let changed = check(&[(seq, after_start)]).join("\n");
    assert!(
        changed.contains(&format!("acknowledged state at seq {seq} had ledger")),
        "{changed}"
    );
}
