//! A session's live stream as server-sent events: every history event after the one the
//! client names (`Last-Event-ID`, or `after_seq`), exactly once and in order, then live ones
//! as they are appended, with the model deltas of the session in between.
//!
//! Messages: `event: event` with `id: SEQ` and the event envelope as `data` (the form of
//! `cairn history --json`); `event: delta` without an id and the delta as `data`; and, if the
//! store fails while the stream catches up, one `event: error` with an error body, after
//! which the stream ends (reconnect with the last id seen). Comments keep the connection
//! alive. The stream ends when the server shuts down, and with an `event: error` (409
//! `conflict`, the session was deleted) when this server deletes the session.

use crate::app::AppState;
use crate::auth::ClientCaller;
use crate::errors::{ApiError, PathParams, QueryParams};
use crate::sessions::{for_client, stored_id, SessionPath};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use cairn_runtime::client::{follow, Follower};
use cairn_runtime::wire::{split_session_id, ErrorBody, ErrorCode, StreamEvent};
use futures_util::Stream;
use serde::Deserialize;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use utoipa::IntoParams;

/// The highest seq an event can have.
const MAX_SEQ: u64 = i64::MAX.unsigned_abs();

/// How often an idle stream sends a keep-alive comment.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Where to start.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Send the events after this seq (default 0: all). `Last-Event-ID` takes precedence.
    after_seq: Option<u64>,
}

/// Follows a session: its events after a seq, each exactly once, then live ones, and its
/// model deltas.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/events",
    tag = "sessions",
    params(
        SessionPath,
        EventsQuery,
        ("Last-Event-ID" = Option<u64>, Header, description = "The last seq received: resume after it"),
    ),
    responses(
        (status = 200, description = "A stream of `event` (id = seq, data = an event envelope) and `delta` messages", content_type = "text/event-stream", body = String),
        (status = 400, description = "Invalid path, query or `Last-Event-ID`", body = ErrorBody),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 403, description = "Not a client token", body = ErrorBody),
        (status = 404, description = "No such session in this namespace", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
        (status = 503, description = "The store is unavailable for now (a database restarting or busy), or the server has as many event streams open as it allows (`--max-streams`); retry", body = ErrorBody),
    )
)]
pub async fn events(
    State(state): State<AppState>,
    ClientCaller(caller): ClientCaller,
    PathParams(path): PathParams<SessionPath>,
    QueryParams(query): QueryParams<EventsQuery>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let stored = stored_id(&caller, &path.id)?;
    let after_seq = match headers.get("last-event-id") {
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| ApiError::invalid("Last-Event-ID must be the seq of an event"))?,
        None => query.after_seq.unwrap_or(0),
    };
    // No store holds a seq past i64's range (PostgreSQL's is a bigint), and the stream counts
    // on from the one after: anything beyond is no event's.
    if after_seq > MAX_SEQ {
        return Err(ApiError::invalid(format!(
            "Last-Event-ID or after_seq {after_seq} is past any event's seq (at most {MAX_SEQ})"
        )));
    }
    let slot = StreamSlot::take(&state)?;
    // Subscribe before checking the session exists, so nothing appended in between is missed.
    let follower = follow(state.engine.clone(), stored.clone(), after_seq);
    state
        .engine
        .state(&stored)
        .await
        .map_err(|e| ApiError::from_runtime(e, &path.id))?;
    let feed = Feed {
        _slot: slot,
        session_id: path.id,
        follower,
        backlog: VecDeque::new(),
        caught_up: false,
        ended: false,
        closing: state.closing.clone(),
    };
    let stream = futures_util::stream::unfold(feed, |mut feed| async move {
        let message = feed.next().await?;
        Some((Ok(message), feed))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)))
}

/// One stream's state: the follower and what it found but has not sent yet.
struct Feed {
    /// Its place among the server's open streams, given back when the stream ends.
    _slot: StreamSlot,
    /// The session's id as the client names it.
    session_id: String,
    follower: Follower,
    backlog: VecDeque<StreamEvent>,
    caught_up: bool,
    ended: bool,
    closing: CancellationToken,
}

impl Feed {
    /// The next SSE message; `None` when the stream ends.
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if self.ended {
                return None;
            }
            if let Some(message) = self.backlog.pop_front() {
                return Some(to_sse(message));
            }
            let step = if self.caught_up {
                tokio::select! {
                    step = self.follower.next(&mut self.backlog) => step,
                    _ = self.closing.cancelled() => None,
                }
            } else {
                self.caught_up = true;
                Some(self.follower.catch_up(&mut self.backlog).await)
            };
            match step {
                None => return None,
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    self.ended = true;
                    let error = ApiError::from_runtime(e, &self.session_id);
                    return Some(
                        SseEvent::default()
                            .event("error")
                            .json_data(error.body())
                            .unwrap_or_default(),
                    );
                }
            }
        }
    }
}

/// One open stream, counted against [`ServerConfig::max_streams`](crate::ServerConfig) while
/// it lives.
struct StreamSlot {
    open: Arc<AtomicUsize>,
}

impl StreamSlot {
    /// A place for one more stream, or 503 when the server has as many open as it allows.
    fn take(state: &AppState) -> Result<StreamSlot, ApiError> {
        let max = state.config.max_streams;
        let open = state.open_streams.clone();
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .map_err(|_| {
            ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "this server has {max} event streams open, as many as it allows \
                     (--max-streams); retry once one closes"
                ),
            )
        })?;
        Ok(StreamSlot { open })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

fn to_sse(message: StreamEvent) -> SseEvent {
    match message {
        StreamEvent::Event(event) => {
            let event = for_client(event);
            SseEvent::default()
                .event("event")
                .id(event.seq.to_string())
                .json_data(&event)
                .unwrap_or_default()
        }
        StreamEvent::Delta(mut delta) => {
            delta.origin.session_id = split_session_id(&delta.origin.session_id).1.to_owned();
            SseEvent::default()
                .event("delta")
                .json_data(&delta)
                .unwrap_or_default()
        }
    }
}
