//! The transcripts a worker keeps: made whole in place, kept by lineage, let go, listed; and
//! one let go fetched whole again from a server.

use super::*;
use cairn_ledger::{Part, Role};
use cairn_runtime::wire::parse_transcripts;

/// A message of about `bytes` bytes of text, "m{n}" first.
fn message(n: usize, bytes: usize) -> Message {
    let mut text = format!("m{n} ");
    while text.len() < bytes {
        text.push('x');
    }
    Message {
        role: Role::User,
        parts: vec![Part::text(text)],
        provenance: None,
    }
}

/// Messages `from..to`, each of about `bytes` bytes.
fn messages(from: usize, to: usize, bytes: usize) -> Vec<Message> {
    (from..to).map(|n| message(n, bytes)).collect()
}

fn model_task(
    session: &str,
    seq: u64,
    messages: Vec<Message>,
    lineage: Option<u64>,
    left_out: u32,
) -> LeasedTask {
    let mut task = crate::kept_test_server::model_task(session, seq);
    let fields = task.input.transcript_mut().expect("a model task");
    *fields.transcript = Arc::new(Transcript { messages });
    *fields.lineage = lineage;
    *fields.left_out = left_out;
    task
}

/// The transcript of a model task, and how many of its messages are left out.
fn transcript_of(task: &mut LeasedTask) -> (Arc<Transcript>, u32) {
    let fields = task.input.transcript_mut().expect("a model task");
    (Arc::clone(fields.transcript), *fields.left_out)
}

/// The first word of each message: "m0", "m1", …
fn names(transcript: &Transcript) -> Vec<String> {
    transcript
        .messages
        .iter()
        .map(|m| match &m.parts[0] {
            Part::Text { text, .. } => text.split(' ').next().unwrap_or_default().to_owned(),
            other => panic!("a text part, not {other:?}"),
        })
        .collect()
}

fn numbered(from: usize, to: usize) -> Vec<String> {
    (from..to).map(|n| format!("m{n}")).collect()
}

#[test]
fn a_transcript_sent_whole_is_kept_and_makes_whole_the_next_in_place() {
    let cache = TranscriptCache::default();
    assert_eq!(&*cache.header(), "");
    let mut first = vec![model_task("s", 2, messages(0, 4, 4096), Some(0), 0)];
    assert!(cache.fill(&mut first).is_empty());
    assert_eq!(&*cache.header(), "s=0.4");
    // Its address only: holding it would make the next fill copy it.
    let kept_first = Arc::as_ptr(&transcript_of(&mut first[0]).0);
    drop(first);

    // The server left out the 4 held: the 2 that came go on the end of the one kept, in
    // place (its allocation is the one the first task brought).
    let mut second = vec![model_task("s", 4, messages(4, 6, 100), Some(0), 4)];
    assert!(cache.fill(&mut second).is_empty());
    let (whole, left_out) = transcript_of(&mut second[0]);
    assert_eq!(left_out, 0, "whole now");
    assert_eq!(names(&whole), numbered(0, 6));
    assert!(
        std::ptr::eq(Arc::as_ptr(&whole), kept_first),
        "made whole in place"
    );
    assert_eq!(&*cache.header(), "s=0.6");

    // While that task still holds it, the next one is made whole on a copy, equal.
    let mut third = vec![model_task("s", 6, messages(6, 7, 100), Some(0), 6)];
    assert!(cache.fill(&mut third).is_empty());
    let (third_whole, _) = transcript_of(&mut third[0]);
    assert_eq!(names(&third_whole), numbered(0, 7));
    assert_eq!(
        names(&whole),
        numbered(0, 6),
        "the running task's is untouched"
    );
    assert_eq!(&*cache.header(), "s=0.7");

    // An answer to a request that listed fewer messages than are kept now: its first ones.
    let mut late = vec![model_task("s", 8, messages(90, 91, 100), Some(0), 5)];
    assert!(cache.fill(&mut late).is_empty());
    let (late_whole, _) = transcript_of(&mut late[0]);
    let mut expected = numbered(0, 5);
    expected.push("m90".to_owned());
    assert_eq!(names(&late_whole), expected);
}

#[test]
fn what_is_not_kept_is_reported_missing() {
    let cache = TranscriptCache::default();
    let mut tasks = vec![
        model_task("s", 2, messages(0, 3, 4096), Some(5), 0),
        // Another lineage than the one kept (compacted since).
        model_task("s", 4, messages(3, 4, 10), Some(6), 3),
        // More left out than are kept.
        model_task("s", 5, messages(4, 5, 10), Some(5), 4),
        // A session not kept.
        model_task("t", 2, messages(0, 1, 10), Some(0), 2),
    ];
    assert_eq!(cache.fill(&mut tasks), vec![1, 2, 3]);
    for task in &mut tasks[1..] {
        assert_ne!(
            transcript_of(task).1,
            0,
            "left as it came, to be fetched whole"
        );
    }
    // Made whole from the one kept, which stays.
    let mut kept = vec![model_task("s", 6, messages(3, 4, 10), Some(5), 3)];
    assert!(cache.fill(&mut kept).is_empty());
    assert_eq!(names(&transcript_of(&mut kept[0]).0), numbered(0, 4));
}

#[test]
fn small_transcripts_are_not_kept_and_a_summary_is_left_alone() {
    let cache = TranscriptCache::default();
    let mut tasks = vec![
        model_task("small", 2, messages(0, 3, 100), Some(0), 0),
        model_task("summary", 2, messages(0, 3, 4096), None, 0),
    ];
    assert!(cache.fill(&mut tasks).is_empty());
    assert_eq!(cache.held().0, 0);
    assert_eq!(&*cache.header(), "");
    // A kept one compacted to a small one: let go.
    let mut big = vec![model_task("s", 2, messages(0, 3, 4096), Some(0), 0)];
    cache.fill(&mut big);
    assert_eq!(cache.held().0, 1);
    let mut compacted = vec![model_task("s", 9, messages(0, 1, 100), Some(8), 0)];
    cache.fill(&mut compacted);
    assert_eq!(cache.held(), (0, 0));
    assert_eq!(&*cache.header(), "");
}

#[test]
fn the_kept_are_bounded_the_one_used_longest_ago_going_first() {
    let cache = TranscriptCache::default();
    let kept = KEPT_TRANSCRIPTS;
    let mut tasks: Vec<LeasedTask> = (0..kept + 2)
        .map(|n| {
            model_task(
                &format!("s{n}"),
                2,
                messages(0, 1, MIN_KEPT_BYTES),
                Some(0),
                0,
            )
        })
        .collect();
    assert!(cache.fill(&mut tasks).is_empty());
    assert_eq!(cache.held().0, kept, "the two oldest went");
    let header = cache.header();
    let listed = parse_transcripts(&header).expect("a header the server takes");
    assert_eq!(listed.len(), MAX_TRANSCRIPTS_LISTED, "those used last");
    assert_eq!(
        listed[0].session_id,
        format!("s{}", kept + 2 - MAX_TRANSCRIPTS_LISTED)
    );
    assert_eq!(listed.last().unwrap().session_id, format!("s{}", kept + 1));
    assert_eq!((listed[0].lineage, listed[0].messages), (0, 1));

    // Used again: listed last.
    let mut again = vec![model_task("s5", 4, messages(1, 2, 10), Some(0), 1)];
    assert!(cache.fill(&mut again).is_empty());
    let header = cache.header();
    let listed = parse_transcripts(&header).unwrap();
    assert_eq!(listed.last().unwrap().to_string(), "s5=0.2");

    // A report's header lists its own sessions' first, those kept and not among the used
    // last, once each; then the used last, as many as fit.
    assert_eq!(
        cache.header_for(&["s5", "gone", "s0"]),
        header,
        "listed already"
    );
    let for_report = cache.header_for(&["s10", "s5", "s10", "s11"]);
    let listed = parse_transcripts(&for_report).expect("a header the server takes");
    assert_eq!(listed.len(), MAX_TRANSCRIPTS_LISTED);
    let names: Vec<&str> = listed.iter().map(|k| k.session_id.as_str()).collect();
    assert_eq!(
        &names[..3],
        [
            "s10",
            "s11",
            &format!("s{}", kept + 5 - MAX_TRANSCRIPTS_LISTED)
        ]
    );
    assert_eq!(*names.last().unwrap(), "s5");
    assert_eq!(cache.header_for(&[]), header);

    // Bounded in bytes: one transcript of nearly all of them pushes the others out.
    let huge = KEPT_BYTES - MIN_KEPT_BYTES;
    let mut tasks = vec![model_task("huge", 2, messages(0, 1, huge), Some(0), 0)];
    cache.fill(&mut tasks);
    let (count, bytes) = cache.held();
    assert!(bytes <= KEPT_BYTES, "{bytes}");
    assert!(count < 3, "{count}");
    assert!(cache.header().ends_with("huge=0.1"));
}

/// A server answering lease requests with `answers` in turn, and `POST /v1/worker/input`
/// with session `s`'s model task whole (messages 0 to 6) for seq 5 and `lease_lost` for any
/// other.
async fn server(
    answers: Vec<Vec<LeasedTask>>,
) -> (
    crate::fake_server::Served,
    Arc<crate::kept_test_server::Seen>,
) {
    crate::kept_test_server::serve(cairn_runtime::wire::TRANSCRIPTS_HEADER, answers, |lease| {
        (lease.id.scheduled_seq == 5)
            .then(|| model_task("s", 5, messages(0, 6, 4096), Some(3), 0).input)
    })
    .await
}

#[tokio::test]
async fn a_worker_lists_its_transcripts_and_fetches_whole_what_it_lacks() {
    use cairn_runtime::TaskFilter;
    use cairn_workers::TaskSource;
    use std::time::Duration;

    let (served, seen) = server(vec![
        vec![model_task("s", 2, messages(0, 4, 4096), Some(0), 0)],
        // Shortened against the one kept.
        vec![model_task("s", 4, messages(4, 5, 100), Some(0), 4)],
        // Shortened against a lineage this worker does not hold: seq 5 is fetched whole,
        // seq 6's fetch finds the lease gone, so it is left out of what the pool gets.
        vec![
            model_task("s", 5, messages(5, 6, 100), Some(3), 5),
            model_task("s", 6, messages(5, 6, 100), Some(3), 5),
        ],
    ])
    .await;
    let source = crate::HttpTaskSource::new(&served.url, None).unwrap();
    let filter = TaskFilter::default();
    let lease = || source.lease(&filter, 8, 30_000, Duration::ZERO);

    let mut first = lease().await.unwrap();
    assert_eq!(names(&transcript_of(&mut first[0]).0), numbered(0, 4));
    let mut second = lease().await.unwrap();
    assert_eq!(
        transcript_of(&mut second[0]),
        (
            Arc::new(Transcript {
                messages: [messages(0, 4, 4096), messages(4, 5, 100)].concat()
            }),
            0
        ),
        "made whole, equal to what the server holds"
    );
    let mut third = lease().await.unwrap();
    assert_eq!(third.len(), 1, "{third:?}");
    assert_eq!(third[0].lease.id.scheduled_seq, 5);
    assert_eq!(names(&transcript_of(&mut third[0]).0), numbered(0, 6));

    let headers = seen.headers.lock().unwrap().clone();
    assert_eq!(
        headers,
        [
            Some(String::new()),
            Some("s=0.4".to_owned()),
            Some("s=0.5".to_owned())
        ],
        "every lease request says the worker keeps transcripts, and which"
    );
    // The one fetched whole is kept under its lineage.
    assert_eq!(&*source.transcripts_header(), "s=3.6");
}
