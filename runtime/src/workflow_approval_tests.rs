//! Workflow scenarios of the tool policy and approvals (allow, deny, ask; parked calls
//! approved, denied by a person or by their deadline), each run live and as a full replay.

use crate::error::Error;
use crate::event::*;
use crate::policy::{rule, PolicyDecision, PrefixKind, ToolPolicy};
use crate::store::{NewTask, TaskId, TaskKind};
use crate::workflow::{Command, ToolSlotState};
use crate::workflow_tests::{model_done, response, started, tool_done, tool_use, user, Live, SID};
use cairn_ledger::*;

/// A session with `calculator`, `read_file` and `shell`, under `policy`.
fn with_policy(policy: Option<ToolPolicy>) -> SessionStarted {
    let mut s = started(8);
    let mut tools = s.tools.to_vec();
    tools.push(ToolSpec {
        name: "shell".into(),
        description: "runs a command".into(),
        input_schema: JsonText::parse(r#"{"type":"object","required":["command"]}"#).unwrap(),
    });
    s.tools = tools.into();
    s.tool_policy = policy;
    s
}

/// read_file under `src` runs, other read_file calls are denied, shell asks; the rest runs.
fn policy(approval_timeout_ms: Option<u64>) -> ToolPolicy {
    ToolPolicy {
        rules: vec![
            rule(
                "read_file",
                PolicyDecision::Allow,
                Some(("path", "src", PrefixKind::Path)),
            ),
            rule("read_file", PolicyDecision::Deny, None),
            rule("shell", PolicyDecision::Ask, None),
        ],
        default: PolicyDecision::Allow,
        approval_timeout_ms,
    }
}

fn approved(id: &str) -> Event {
    Event::ToolCallApproved {
        turn: 1,
        tool_use_id: id.into(),
    }
}

fn denied(id: &str, reason: &str, by_deadline: bool) -> Event {
    Event::ToolCallDenied {
        turn: 1,
        tool_use_id: id.into(),
        reason: reason.into(),
        by_deadline,
    }
}

fn scheduled_tool(id: &str, name: &str, not_before_ms: u64) -> Command {
    Command::ScheduleToolCall {
        turn: 1,
        tool_use_id: id.into(),
        name: name.into(),
        attempt: 1,
        not_before_ms,
    }
}

/// Turn 1 asks for a shell command (and, with `with_calculator`, a calculation too).
fn ask_for_shell(live: &mut Live, with_calculator: bool) -> Vec<Command> {
    live.input(user(1, "list the files"));
    let mut parts = vec![tool_use("sh1", "shell", r#"{"command":"ls"}"#)];
    if with_calculator {
        parts.push(tool_use("c1", "calculator", r#"{"expression":"1+1"}"#));
    }
    live.input(model_done(1, 0, 1, response(parts, StopReason::ToolUse)))
}

/// The text of the tool_result answering `id` in the transcript.
fn result_of(live: &Live, id: &str) -> (String, bool) {
    for message in &live.state.transcript.messages {
        for part in &message.parts {
            if let Part::ToolResult(r) = part {
                if r.tool_use_id == id {
                    let text = match &r.content {
                        ToolResultContent::Text(t) => t.clone(),
                        other => format!("{other:?}"),
                    };
                    return (text, r.is_error);
                }
            }
        }
    }
    panic!("no tool_result for {id}");
}

#[test]
fn rules_allow_deny_and_ask_per_call_by_name_and_argument_prefix() {
    let mut live = Live::new(with_policy(Some(policy(None))));
    live.input(user(1, "look around"));
    let at = live.now + 10;
    let c = live.input(model_done(
        1,
        0,
        1,
        response(
            vec![
                tool_use("c1", "calculator", r#"{"expression":"1+1"}"#),
                tool_use("r1", "read_file", r#"{"path":"src/main.rs"}"#),
                tool_use("r2", "read_file", r#"{"path":"src/../secrets.txt"}"#),
                tool_use("sh1", "shell", r#"{"command":"ls"}"#),
            ],
            StopReason::ToolUse,
        ),
    ));
    assert_eq!(
        c,
        [
            scheduled_tool("c1", "calculator", at),
            scheduled_tool("r1", "read_file", at),
            Command::RequestToolApproval {
                turn: 1,
                tool_use_id: "sh1".into(),
                name: "shell".into(),
                deadline_ms: None,
            },
        ]
    );
    let parked = live.state.pending_approvals();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].tool_use.id, "sh1");
    assert_eq!(parked[0].requested_seq, Some(live.state.next_seq - 1));
    // The allowed calls run meanwhile; the turn goes on only when every result is in.
    assert!(live.input(tool_done(1, "c1", 1, "2")).is_empty());
    assert!(live
        .input(tool_done(1, "r1", 1, r#""fn main() {}""#))
        .is_empty());
    assert_eq!(live.state.pending_approvals().len(), 1);
    let c = live.input(approved("sh1"));
    assert_eq!(c, [scheduled_tool("sh1", "shell", live.now)]);
    assert!(live.state.pending_approvals().is_empty());
    let c = live.input(tool_done(1, "sh1", 1, r#""main.rs""#));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { round: 1, .. }]
    ));
    let (denial, is_error) = result_of(&live, "r2");
    assert!(is_error);
    assert_eq!(
        denial,
        "the tool call was denied by the session's policy (rule 2)"
    );
    assert!(!result_of(&live, "sh1").1);
    live.check_replay();
    // The approval request is recorded as its own event, right after the model's response.
    let kinds: Vec<&str> = live.events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds[3..7],
        [
            "model_call_completed",
            "tool_call_scheduled",
            "tool_call_scheduled",
            "tool_approval_requested"
        ]
    );
}

#[test]
fn a_denial_becomes_an_error_result_carrying_the_reason_and_the_turn_goes_on() {
    let mut live = Live::new(with_policy(Some(policy(None))));
    ask_for_shell(&mut live, false);
    let c = live.input(denied("sh1", "not on this machine", false));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { round: 1, .. }]
    ));
    assert_eq!(
        result_of(&live, "sh1"),
        (
            "the tool call was denied: not on this machine".to_owned(),
            true
        )
    );
    let c = live.input(model_done(
        1,
        1,
        1,
        response(vec![Part::text("ok")], StopReason::EndTurn),
    ));
    assert!(matches!(c[..], [Command::CompleteTurn { turn: 1, .. }]));
    live.check_replay();
}

/// A session whose first turn's shell call waits for approval with a deadline `timeout_ms`
/// after the model's answer; with the transition of that answer.
fn parked_with_a_deadline(timeout_ms: u64) -> (Live, crate::workflow::Transition) {
    let mut live = Live::new(with_policy(Some(policy(Some(timeout_ms)))));
    live.input(user(1, "list the files"));
    let t = live.step(model_done(
        1,
        0,
        1,
        response(
            vec![tool_use("sh1", "shell", r#"{"command":"ls"}"#)],
            StopReason::ToolUse,
        ),
    ));
    (live, t)
}

#[test]
fn the_deadline_is_a_timer_task_no_worker_leases_and_it_denies_once() {
    let (mut live, t) = parked_with_a_deadline(5_000);
    let requested_seq = t.events[1].seq;
    let deadline = live.now + 5_000;
    assert_eq!(
        t.commands,
        [Command::RequestToolApproval {
            turn: 1,
            tool_use_id: "sh1".into(),
            name: "shell".into(),
            deadline_ms: Some(deadline),
        }]
    );
    // Visible and overdue at the same moment: never leasable, fired by the engine's timers.
    let timer = NewTask {
        visible_at_ms: deadline,
        start_by_ms: Some(deadline),
        ..task_at(requested_seq, deadline, "shell")
    };
    assert_eq!(t.enqueue, std::slice::from_ref(&timer));
    assert_eq!(live.state.outstanding_tasks(), [requested_seq]);
    assert_eq!(live.state.queued_task(requested_seq), Some(timer));
    // A deadline denial before the deadline is refused and changes nothing.
    let before = live.state.clone();
    live.now = deadline - 20;
    assert!(matches!(
        live.try_step(denied("sh1", "late", true)),
        Err(Error::InvalidEvent { .. })
    ));
    assert_eq!(live.state, before);
    live.now = deadline - 10;
    let t = live.step(denied("sh1", "nobody approved it in time", true));
    assert!(matches!(
        t.commands[..],
        [Command::ScheduleModelCall { round: 1, .. }]
    ));
    assert_eq!(
        t.cancel,
        [TaskId {
            session_id: SID.into(),
            scheduled_seq: requested_seq
        }]
    );
    assert_eq!(
        result_of(&live, "sh1"),
        (
            "the tool call was denied: nobody approved it in time".to_owned(),
            true
        )
    );
    // Decided once: a second denial (or a late approval) is refused.
    assert!(matches!(
        live.try_step(denied("sh1", "again", true)),
        Err(Error::InvalidEvent { .. })
    ));
    assert!(matches!(
        live.try_step(approved("sh1")),
        Err(Error::InvalidEvent { .. })
    ));
    live.check_replay();
}

/// A copy of a session parked on an approval with a deadline (the import of its export, a
/// fork) keeps the deadline timer's time: due at once like an activity, it would be leased
/// and dropped by a worker, and the call would wait forever.
#[tokio::test]
async fn an_imported_or_forked_session_keeps_its_approval_deadline() {
    use crate::store::{Store, TaskFilter};
    let (live, t) = parked_with_a_deadline(5_000);
    let requested_seq = t.events[1].seq;
    let deadline = live.now + 5_000;
    let store = crate::MemoryStore::new();
    crate::export::write_new_session(&store, live.events.clone(), &live.state, live.now)
        .await
        .unwrap();
    let fork = crate::fork::ForkRequest {
        parent: SID.into(),
        at_seq: live.events.last().unwrap().seq,
        session_id: "fork".into(),
        model: None,
        system_prompt: None,
    };
    crate::fork::fork_session(&store, &fork, live.now)
        .await
        .unwrap();
    let mut tasks = store.list_tasks().await.unwrap();
    tasks.sort_by(|a, b| a.id.cmp(&b.id));
    let times: Vec<_> = tasks
        .iter()
        .map(|t| {
            (
                t.id.session_id.as_str(),
                t.id.scheduled_seq,
                t.visible_at_ms,
                t.start_by_ms,
            )
        })
        .collect();
    assert_eq!(
        times,
        [
            ("fork", requested_seq, deadline, Some(deadline)),
            (SID, requested_seq, deadline, Some(deadline)),
        ]
    );
    let leased = store
        .lease_tasks(deadline - 1, 60_000, 10, &TaskFilter::any())
        .await
        .unwrap();
    assert!(leased.is_empty(), "{leased:?}");
}

fn task_at(seq: u64, visible_at_ms: u64, target: &str) -> NewTask {
    crate::workflow_tests::task(seq, TaskKind::Tool, visible_at_ms, target)
}

#[test]
fn an_approval_schedules_the_call_and_drops_its_deadline_timer() {
    let mut live = Live::new(with_policy(Some(policy(Some(60_000)))));
    ask_for_shell(&mut live, true);
    let requested_seq = live.state.pending_approvals()[0].requested_seq.unwrap();
    let t = live.step(approved("sh1"));
    assert_eq!(t.commands, [scheduled_tool("sh1", "shell", live.now)]);
    assert_eq!(t.enqueue, [task_at(t.events[1].seq, live.now, "shell")]);
    assert_eq!(
        t.cancel,
        [TaskId {
            session_id: SID.into(),
            scheduled_seq: requested_seq
        }]
    );
    live.input(tool_done(1, "c1", 1, "2"));
    let c = live.input(tool_done(1, "sh1", 1, r#""a b""#));
    assert!(matches!(
        c[..],
        [Command::ScheduleModelCall { round: 1, .. }]
    ));
    live.check_replay();
}

#[test]
fn without_a_recorded_policy_every_call_runs_as_before() {
    let mut live = Live::new(with_policy(None));
    let c = ask_for_shell(&mut live, false);
    assert_eq!(c, [scheduled_tool("sh1", "shell", live.now)]);
    live.input(tool_done(1, "sh1", 1, "1"));
    live.check_replay();
}

#[test]
fn approvals_that_name_no_parked_call_and_reports_for_parked_calls_are_refused() {
    let mut live = Live::new(with_policy(Some(policy(None))));
    ask_for_shell(&mut live, true);
    let before = live.state.clone();
    for event in [
        approved("nope"),
        approved("c1"),
        denied("c1", "no", false),
        denied("sh1", "no deadline", true),
        Event::ToolCallApproved {
            turn: 2,
            tool_use_id: "sh1".into(),
        },
        tool_done(1, "sh1", 1, "1"),
    ] {
        let what = format!("{event:?}");
        assert!(
            matches!(live.try_step(event), Err(Error::InvalidEvent { .. })),
            "{what}"
        );
        assert_eq!(live.state, before, "{what}");
    }
    live.input(tool_done(1, "c1", 1, "2"));
    live.input(denied("sh1", "no", false));
    live.check_replay();
}

#[test]
fn cancelling_a_turn_closes_a_parked_call_and_drops_its_timer() {
    let mut live = Live::new(with_policy(Some(policy(Some(1_000)))));
    ask_for_shell(&mut live, false);
    let requested_seq = live.state.pending_approvals()[0].requested_seq.unwrap();
    let t = live.step(Event::TurnCancelled {
        turn: 1,
        reason: "stop".into(),
    });
    assert_eq!(
        t.cancel,
        [TaskId {
            session_id: SID.into(),
            scheduled_seq: requested_seq
        }]
    );
    assert_eq!(
        result_of(&live, "sh1"),
        ("cancelled: stop".to_owned(), true)
    );
    assert!(matches!(
        live.try_step(approved("sh1")),
        Err(Error::InvalidEvent { .. })
    ));
    live.check_replay();
}

#[test]
fn a_policy_that_cannot_be_recorded_is_refused_at_the_start() {
    let mut bad = policy(None);
    bad.rules.push(rule("", PolicyDecision::Allow, None));
    let mut state = crate::workflow::SessionState::new(SID);
    let input = EventEnvelope::new(SID, 1, 1, Event::SessionStarted(with_policy(Some(bad))));
    match state.step(input) {
        Err(Error::InvalidEvent { reason, .. }) => {
            assert!(
                reason.starts_with("tool_policy: rule 4: the tool name is empty"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(state.started.is_none());
}

#[test]
fn the_default_decision_applies_when_no_rule_matches() {
    let ask_all = ToolPolicy {
        rules: vec![rule("calculator", PolicyDecision::Allow, None)],
        default: PolicyDecision::Ask,
        approval_timeout_ms: None,
    };
    let mut live = Live::new(with_policy(Some(ask_all)));
    let c = ask_for_shell(&mut live, true);
    assert!(matches!(c[0], Command::RequestToolApproval { .. }));
    assert!(matches!(c[1], Command::ScheduleToolCall { .. }));
    assert!(matches!(
        live.state.active.as_ref().map(|a| &a.phase),
        Some(crate::workflow::Phase::Tools(slots))
            if matches!(slots[0].state, ToolSlotState::AwaitingApproval { .. })
    ));
    live.input(tool_done(1, "c1", 1, "2"));
    live.input(approved("sh1"));
    live.input(tool_done(1, "sh1", 1, "1"));
    live.check_replay();
}
