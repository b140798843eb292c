//! The tool sets a worker keeps: filled in, let go, listed; and a set let go fetched whole again
//! from a server.

use super::*;
use cairn_ledger::JsonText;
use cairn_runtime::wire::parse_tool_sets;
use cairn_runtime::ActivityInput;

fn set(name: &str) -> Arc<[ToolSpec]> {
    Arc::new([ToolSpec {
        name: name.to_owned(),
        description: String::new(),
        input_schema: JsonText::parse("{}").expect("schema"),
    }])
}

fn model_task(tools: Arc<[ToolSpec]>, digest: Option<String>, omitted: bool) -> LeasedTask {
    let mut task = crate::kept_test_server::model_task("s", 1);
    let set = task.input.tool_set_mut().expect("a model task");
    *set.tools = tools;
    *set.digest = digest;
    *set.omitted = omitted;
    task
}

fn tools_of(task: &LeasedTask) -> (Arc<[ToolSpec]>, bool) {
    match &task.input {
        ActivityInput::Model {
            tools,
            tools_omitted,
            ..
        } => (Arc::clone(tools), *tools_omitted),
        ActivityInput::Tool { .. } => unreachable!("a model task"),
    }
}

fn digest(n: usize) -> String {
    format!("{n:032x}")
}

#[test]
fn a_set_sent_whole_is_kept_and_fills_the_tasks_that_leave_it_out() {
    let cache = ToolSetCache::default();
    assert_eq!(&*cache.header(), "");
    let mut tasks = vec![
        model_task(set("read"), Some(digest(1)), false),
        model_task(Arc::new([]), Some(digest(1)), true),
    ];
    assert!(cache.fill(&mut tasks).is_empty());
    assert_eq!(&*cache.header(), digest(1));
    for task in &tasks {
        let (tools, omitted) = tools_of(task);
        assert!(!omitted);
        assert_eq!(tools[0].name, "read");
    }
    // Left out in a later answer, filled in from what was kept.
    let mut later = vec![model_task(Arc::new([]), Some(digest(1)), true)];
    assert!(cache.fill(&mut later).is_empty());
    assert_eq!(tools_of(&later[0]).0[0].name, "read");
}

#[test]
fn a_set_not_kept_is_reported_missing_and_the_one_used_longest_ago_goes_first() {
    let cache = ToolSetCache::default();
    let kept = 2 * MAX_TOOL_SETS_LISTED;
    let mut tasks: Vec<LeasedTask> = (0..kept + 2)
        .map(|n| model_task(set(&format!("t{n}")), Some(digest(n)), false))
        .collect();
    // A task without a digest (a server that does not name sets) is left as it came.
    tasks.push(model_task(set("plain"), None, false));
    assert!(cache.fill(&mut tasks).is_empty());
    assert_eq!(cache.len(), kept, "the two oldest went");
    let header = cache.header();
    let listed = parse_tool_sets(&header).expect("a header the server takes");
    assert_eq!(listed.len(), MAX_TOOL_SETS_LISTED, "the sets used last");
    assert_eq!(listed[0], digest(kept + 2 - MAX_TOOL_SETS_LISTED));
    assert_eq!(*listed.last().unwrap(), digest(kept + 1));

    let mut asked = vec![
        model_task(Arc::new([]), Some(digest(0)), true),
        // Kept though no longer listed: filled in, and used last now.
        model_task(Arc::new([]), Some(digest(5)), true),
        // Left out without a digest (a server's mistake): fetched whole too, never run
        // without its tools.
        model_task(Arc::new([]), None, true),
    ];
    assert_eq!(cache.fill(&mut asked), vec![0, 2]);
    assert!(tools_of(&asked[0]).1, "still to be fetched");
    assert_eq!(tools_of(&asked[1]).0[0].name, "t5");
    let header = cache.header();
    let listed = parse_tool_sets(&header).unwrap();
    assert_eq!(*listed.last().unwrap(), digest(5), "{header}");
    assert_eq!(listed.len(), MAX_TOOL_SETS_LISTED);

    // Every set a request listed is still kept after as many new sets as it listed came.
    let listed: Vec<String> = listed.into_iter().map(str::to_owned).collect();
    let mut newer: Vec<LeasedTask> = (0..MAX_TOOL_SETS_LISTED)
        .map(|n| model_task(set("new"), Some(digest(1000 + n)), false))
        .collect();
    assert!(cache.fill(&mut newer).is_empty());
    let mut answered: Vec<LeasedTask> = listed
        .iter()
        .map(|d| model_task(Arc::new([]), Some(d.clone()), true))
        .collect();
    assert!(cache.fill(&mut answered).is_empty());
}

#[test]
fn a_digest_not_of_the_form_is_not_kept() {
    let cache = ToolSetCache::default();
    let mut tasks = vec![model_task(
        set("read"),
        Some("not, a digest".to_owned()),
        false,
    )];
    assert!(cache.fill(&mut tasks).is_empty());
    assert_eq!(cache.len(), 0);
    assert_eq!(&*cache.header(), "");
}

/// A server answering lease requests with `answers` in turn, and `POST /v1/worker/input`
/// with the model task whole for seq 1 and `lease_lost` for any other.
async fn server(
    answers: Vec<Vec<LeasedTask>>,
) -> (
    crate::fake_server::Served,
    Arc<crate::kept_test_server::Seen>,
) {
    crate::kept_test_server::serve(cairn_runtime::wire::TOOL_SETS_HEADER, answers, |lease| {
        (lease.id.scheduled_seq == 1).then(|| model_task(set("whole"), None, false).input)
    })
    .await
}

fn at_seq(mut task: LeasedTask, seq: u64) -> LeasedTask {
    task.lease.id.scheduled_seq = seq;
    task
}

#[tokio::test]
async fn a_worker_lists_its_sets_and_fetches_whole_a_task_whose_set_it_does_not_keep() {
    use cairn_runtime::TaskFilter;
    use cairn_workers::TaskSource;
    use std::time::Duration;

    let (served, seen) = server(vec![
        // Left out by a server that thinks the worker keeps the set: seq 1 is fetched whole,
        // seq 2's fetch finds the lease gone, so it is left out of what the pool gets.
        vec![
            at_seq(model_task(Arc::new([]), Some(digest(7)), true), 1),
            at_seq(model_task(Arc::new([]), Some(digest(7)), true), 2),
        ],
        vec![at_seq(model_task(set("kept"), Some(digest(8)), false), 3)],
        vec![at_seq(model_task(Arc::new([]), Some(digest(8)), true), 4)],
    ])
    .await;
    let source = crate::HttpTaskSource::new(&served.url, None).unwrap();
    let filter = TaskFilter::default();
    let lease = || source.lease(&filter, 8, 30_000, Duration::ZERO);

    let first = lease().await.unwrap();
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].lease.id.scheduled_seq, 1);
    let (tools, omitted) = tools_of(&first[0]);
    assert!(!omitted);
    assert_eq!(tools[0].name, "whole");

    let second = lease().await.unwrap();
    assert_eq!(tools_of(&second[0]).0[0].name, "kept");
    let third = lease().await.unwrap();
    assert_eq!(third[0].lease.id.scheduled_seq, 4);
    assert_eq!(
        tools_of(&third[0]).0[0].name,
        "kept",
        "filled in from the set kept"
    );

    let headers = seen.headers.lock().unwrap().clone();
    assert_eq!(
        headers,
        [Some(String::new()), Some(String::new()), Some(digest(8))],
        "every lease request says the worker keeps sets, and which"
    );
}
