//! A test server for what a worker keeps (tool sets, transcripts): it answers lease requests
//! with tasks given in turn, recording one header of each, and `POST /v1/worker/input` as a
//! test says, `lease_lost` otherwise.

use crate::fake_server::{serve_tcp, Served};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Json;
use cairn_runtime::wire::{ErrorBody, ErrorCode, ErrorDetail, LeaseResponse};
use cairn_runtime::{ActivityInput, Lease, LeasedTask};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

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
