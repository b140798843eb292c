//! Transcripts sent as what a worker lacks: a model task's transcript, for a worker that
//! keeps its sessions' transcripts ([`TRANSCRIPTS_HEADER`]), without the messages the worker
//! listed that it holds.
//!
//! A session's transcript grows at its end from one model call to the next, and a long
//! session's is most of what its model tasks carry (hundreds of kilobytes for a coding
//! agent), which the server writes as JSON and the worker parses with every call. Between
//! two calls of one lineage (`transcript_lineage`: no compaction between them) the messages
//! a worker holds are the transcript's first ones, so the server leaves them out and the
//! worker puts them back. The server keeps nothing: the worker's header says what it holds,
//! request by request.

use crate::errors::{single_header, ApiError};
use axum::http::HeaderMap;
use cairn_ledger::Transcript;
use cairn_runtime::wire::{parse_transcripts, KeptTranscript, TRANSCRIPTS_HEADER};
use cairn_runtime::LeasedTask;
use std::sync::Arc;
use utoipa::IntoParams;

/// The header, as the OpenAPI document describes it.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Header)]
pub struct TranscriptsHeader {
    /// Sent by a worker that keeps its sessions' transcripts: those it holds, as
    /// `SESSION=LINEAGE.MESSAGES`, comma-separated (empty when none; at most 64). A model
    /// task of a session it listed with the task's `transcript_lineage` and no more messages
    /// than the transcript has then carries only the messages after those
    /// (`transcript_left_out` says how many were left out).
    #[param(
        rename = "Cairn-Transcripts",
        value_type = String,
        required = false,
        pattern = r"^ *([A-Za-z0-9._:-]{1,128}=[0-9]{1,19}\.[0-9]{1,9}( *, *[A-Za-z0-9._:-]{1,128}=[0-9]{1,19}\.[0-9]{1,9}){0,63})? *$"
    )]
    #[allow(dead_code)] // read from the headers; here for the document only
    transcripts: Option<String>,
}

/// What a request's worker said of the transcripts it keeps.
#[derive(Debug, Default)]
pub struct KeptTranscripts {
    listed: Vec<KeptTranscript>,
}

impl KeptTranscripts {
    /// What `headers` say: nothing without [`TRANSCRIPTS_HEADER`]; a header that is not a
    /// list of kept transcripts is refused (400 naming it).
    pub fn of(headers: &HeaderMap) -> Result<Self, ApiError> {
        let Some(value) = single_header(
            headers,
            TRANSCRIPTS_HEADER,
            "Cairn-Transcripts",
            "use session ids, digits, '=', '.' and commas",
        )?
        else {
            return Ok(KeptTranscripts::default());
        };
        let listed = parse_transcripts(value)
            .map_err(|problem| ApiError::invalid(format!("Cairn-Transcripts: {problem}")))?;
        Ok(KeptTranscripts { listed })
    }

    /// Leaves out of the model tasks of `tasks` the messages the worker listed that it holds:
    /// a task of a session it listed with the task's lineage, and at most as many messages as
    /// the task's transcript has, carries the messages after those. Every other task goes
    /// whole.
    pub fn shorten(&self, tasks: &mut [LeasedTask]) {
        if self.listed.is_empty() {
            return;
        }
        for task in tasks {
            let Some(fields) = task.input.transcript_mut() else {
                continue;
            };
            let (Some(lineage), 0) = (*fields.lineage, *fields.left_out) else {
                continue;
            };
            let Some(held) = self
                .listed
                .iter()
                .find(|kept| kept.session_id == fields.session_id && kept.lineage == lineage)
            else {
                continue;
            };
            let left_out = held.messages as usize;
            if left_out == 0 || left_out > fields.transcript.messages.len() {
                continue;
            }
            *fields.transcript = Arc::new(Transcript {
                messages: fields.transcript.messages[left_out..].to_vec(),
            });
            *fields.left_out = held.messages;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use cairn_runtime::wire::LeaseResponse;

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            TRANSCRIPTS_HEADER,
            HeaderValue::from_str(value).expect("value"),
        );
        headers
    }

    /// A lease answer of one model task of `session`, lineage `lineage`, over `messages`
    /// user messages "m0", "m1", …
    fn model_task(session: &str, lineage: Option<u64>, messages: usize) -> LeasedTask {
        let mut texts = Vec::new();
        for i in 0..messages {
            texts.push(
                serde_json::json!({"role": "user", "parts": [{"text": {"text": format!("m{i}")}}]}),
            );
        }
        let answer = serde_json::json!({"tasks": [{
            "lease": {"id": {"session_id": session, "scheduled_seq": 2}, "kind": "model",
                      "lease_attempt": 1, "expires_at_ms": 100},
            "input": {"model": {
                "origin": {"session_id": session, "turn": 1, "activity": "model:0", "attempt": 1},
                "round": 0,
                "model": {"provider": "scripted", "model": "m"},
                "transcript": {"messages": texts},
                "transcript_lineage": lineage,
                "tools": [],
                "timeouts": {"due_at_ms": 0, "schedule_to_start_ms": null, "start_to_close_ms": 1000, "heartbeat_ms": null},
                "heartbeat_details": null,
            }},
        }]});
        let mut answer: LeaseResponse = serde_json::from_value(answer).expect("a lease answer");
        answer.tasks.remove(0)
    }

    fn texts(task: &LeasedTask) -> Vec<String> {
        let mut input = task.input.clone();
        let fields = input.transcript_mut().expect("a model task");
        fields
            .transcript
            .messages
            .iter()
            .map(|m| match &m.parts[0] {
                cairn_ledger::Part::Text { text, .. } => text.clone(),
                other => panic!("a text part, not {other:?}"),
            })
            .collect()
    }

    fn left_out(task: &mut LeasedTask) -> u32 {
        *task.input.transcript_mut().expect("a model task").left_out
    }

    #[test]
    fn messages_listed_are_left_out_and_nothing_else() {
        let kept = KeptTranscripts::of(&headers("s1=7.2, ns:s2=0.3,s3=0.9")).expect("parsed");
        let mut tasks = vec![
            model_task("s1", Some(7), 5),
            model_task("ns:s2", Some(0), 3),
            model_task("s3", Some(0), 4),
            model_task("s1", Some(8), 5),
            model_task("s4", Some(0), 5),
            model_task("s1", None, 5),
        ];
        kept.shorten(&mut tasks);
        assert_eq!(texts(&tasks[0]), vec!["m2", "m3", "m4"], "after the 2 held");
        assert_eq!(left_out(&mut tasks[0]), 2);
        assert_eq!(texts(&tasks[1]), Vec::<String>::new(), "all 3 held");
        assert_eq!(left_out(&mut tasks[1]), 3);
        for (i, why) in [
            (2, "more held than the transcript has"),
            (3, "another lineage"),
            (4, "a session not listed"),
            (5, "no lineage (a summary)"),
        ] {
            assert_eq!(texts(&tasks[i]).len(), if i == 2 { 4 } else { 5 }, "{why}");
            assert_eq!(left_out(&mut tasks[i]), 0, "{why}");
        }
        let mut whole = vec![model_task("s1", Some(7), 5)];
        KeptTranscripts::of(&HeaderMap::new())
            .expect("none")
            .shorten(&mut whole);
        assert_eq!(texts(&whole[0]).len(), 5, "no header: whole");
    }

    #[test]
    fn the_header_is_parsed_or_refused_naming_what_is_wrong() {
        let empty = KeptTranscripts::of(&headers("")).expect("empty");
        assert!(empty.listed.is_empty());
        let two = KeptTranscripts::of(&headers(" a.b:c=12.3 , d=0.0 ")).expect("two");
        assert_eq!(
            two.listed,
            vec![
                KeptTranscript {
                    session_id: "a.b:c".to_owned(),
                    lineage: 12,
                    messages: 3
                },
                KeptTranscript {
                    session_id: "d".to_owned(),
                    lineage: 0,
                    messages: 0
                },
            ]
        );
        let many = vec!["s=0.1"; 65].join(",");
        for (bad, says) in [
            ("s", "item 0"),
            ("s=1", "item 0"),
            ("s=1.2,", "item 1"),
            ("s=-1.2", "item 0"),
            ("s=1.99999999999", "item 0"),
            ("bad id=1.2", "item 0"),
            ("=1.2", "item 0"),
            (many.as_str(), "65 transcripts"),
        ] {
            let error = KeptTranscripts::of(&headers(bad)).expect_err(bad);
            assert_eq!(error.status(), axum::http::StatusCode::BAD_REQUEST);
            let message = error.body().error.message;
            assert!(
                message.starts_with("Cairn-Transcripts: ") && message.contains(says),
                "{bad}: {message}"
            );
        }
        let mut twice = headers("s=0.1");
        twice.append(TRANSCRIPTS_HEADER, HeaderValue::from_static(""));
        assert!(KeptTranscripts::of(&twice).is_err());
    }
}
