//! For the tests of what a worker keeps (tool sets, transcripts): a model task to shape, and
//! a test server that answers lease requests with tasks given in turn, recording one header
//! of each, and `POST /v1/worker/input` as a test says, `lease_lost` otherwise.

use crate::fake_server::{serve_tcp, Served};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Json;
use cairn_ledger::ModelSpec;
use cairn_runtime::wire::{ErrorBody, ErrorCode, ErrorDetail, LeaseResponse};
use cairn_runtime::{
    ActivityInput, ActivityRef, ActivityTimeouts, Lease, LeasedTask, TaskId, TaskKind,
};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// A leased model task of `session` at `seq`, over an empty transcript, offering no tools,
/// nothing left out: each test shapes its fields.
pub(crate) fn model_task(session: &str, seq: u64) -> LeasedTask {
    LeasedTask {
        lease: Lease {
            id: TaskId {
                session_id: session.to_owned(),
                scheduled_seq: seq,
            },
            kind: TaskKind::Model,
            lease_attempt: 1,
            expires_at_ms: 0,
        },
        input: ActivityInput::Model {
            origin: ActivityRef {
                session_id: session.to_owned(),
                turn: 1,
                activity: "model:0".to_owned(),
                attempt: 1,
            },
            round: 0,
            model: ModelSpec::parse("scripted:x.json").expect("model"),
            transcript: Arc::default(),
            transcript_lineage: None,
            transcript_left_out: 0,
            tools: Arc::new([]),
            tools_digest: None,
            tools_omitted: false,
            timeouts: ActivityTimeouts {
                due_at_ms: 0,
                schedule_to_start_ms: None,
                start_to_close_ms: 1,
                heartbeat_ms: None,
            },
            heartbeat_details: None,
            options: Default::default(),
        },
    }
}

/// What the server saw: the header of each lease request.
#[derive(Default)]
pub(crate) struct Seen {
    pub(crate) headers: Mutex<Vec<Option<String>>>,
    answers: Mutex<VecDeque<Vec<LeasedTask>>>,
    header: &'static str,
    input: Option<fn(&Lease) -> Option<ActivityInput>>,
}

/// A server answering lease requests with `answers` in turn, recording their `header`, and
/// `POST /v1/worker/input` with what `input` gives for the lease, `lease_lost` for `None`.
pub(crate) async fn serve(
    header: &'static str,
    answers: Vec<Vec<LeasedTask>>,
    input: fn(&Lease) -> Option<ActivityInput>,
) -> (Served, Arc<Seen>) {
    let seen = Arc::new(Seen {
        answers: Mutex::new(answers.into()),
        header,
        input: Some(input),
        ..Seen::default()
    });
    let router = axum::Router::new()
        .route(
            "/v1/worker/lease",
            post(
                |State(seen): State<Arc<Seen>>, headers: HeaderMap| async move {
                    let header = headers
                        .get(seen.header)
                        .map(|v| v.to_str().unwrap().to_owned());
                    seen.headers.lock().unwrap().push(header);
                    let tasks = seen.answers.lock().unwrap().pop_front().unwrap_or_default();
                    Json(LeaseResponse { tasks })
                },
            ),
        )
        .route(
            "/v1/worker/input",
            post(
                |State(seen): State<Arc<Seen>>, Json(lease): Json<Lease>| async move {
                    match seen.input.and_then(|input| input(&lease)) {
                        Some(input) => Json(input).into_response(),
                        None => {
                            let body = ErrorBody {
                                error: ErrorDetail {
                                    code: ErrorCode::LeaseLost,
                                    message: "not current".to_owned(),
                                },
                            };
                            (StatusCode::CONFLICT, Json(body)).into_response()
                        }
                    }
                },
            ),
        )
        .with_state(Arc::clone(&seen));
    (serve_tcp(router).await.unwrap(), seen)
}
