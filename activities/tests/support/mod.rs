//! A fake HTTP provider for tests: answers each request from a queue of canned responses
//! (status, headers, body chunks with optional pauses) and records every request it got.

#![allow(dead_code, clippy::disallowed_methods)]

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One request the fake server received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Recorded {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("request body is JSON")
    }
}

/// A canned answer.
#[derive(Debug, Clone)]
pub struct Canned {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// Body chunks, each sent after its pause.
    pub chunks: Vec<(Duration, Vec<u8>)>,
}

impl Canned {
    /// A 200 SSE response whose body is `text` in one chunk.
    pub fn sse(text: &str) -> Canned {
        Canned {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            chunks: vec![(Duration::ZERO, text.as_bytes().to_vec())],
        }
    }

    /// A JSON error response.
    pub fn error(status: u16, body: &str) -> Canned {
        Canned {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            chunks: vec![(Duration::ZERO, body.as_bytes().to_vec())],
        }
    }

    /// A response with arbitrary bytes and content type.
    pub fn bytes(content_type: &str, body: Vec<u8>) -> Canned {
        Canned {
            status: 200,
            headers: vec![("content-type".into(), content_type.into())],
            chunks: vec![(Duration::ZERO, body)],
        }
    }
}

type Judge = Arc<dyn Fn(&Recorded) -> Option<Canned> + Send + Sync>;

struct State {
    queue: Mutex<VecDeque<Canned>>,
    recorded: Mutex<Vec<Recorded>>,
    /// Checks a request before the queue answers; `Some` overrides (e.g. a 400 for a bad one).
    judge: Mutex<Option<Judge>>,
}

/// A fake provider on 127.0.0.1, stopped when dropped.
pub struct FakeServer {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeServer {
    pub async fn start() -> FakeServer {
        let state = Arc::new(State {
            queue: Mutex::new(VecDeque::new()),
            recorded: Mutex::new(Vec::new()),
            judge: Mutex::new(None),
        });
        let handler_state = state.clone();
        let app = axum::Router::new().fallback(
            move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                let state = handler_state.clone();
                async move { answer(state, method, uri, headers, body) }
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeServer { addr, state, task }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn push(&self, canned: Canned) {
        self.state.queue.lock().unwrap().push_back(canned);
    }

    /// Installs a request checker that can answer instead of the queue.
    pub fn judge(&self, judge: impl Fn(&Recorded) -> Option<Canned> + Send + Sync + 'static) {
        *self.state.judge.lock().unwrap() = Some(Arc::new(judge));
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.state.recorded.lock().unwrap().clone()
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn answer(
    state: Arc<State>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let recorded = Recorded {
        method: method.to_string(),
        path: uri.path().to_owned(),
        headers,
        body: body.to_vec(),
    };
    state.recorded.lock().unwrap().push(recorded.clone());
    let judged = state
        .judge
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|j| j(&recorded));
    let canned = judged
        .or_else(|| state.queue.lock().unwrap().pop_front())
        .unwrap_or(Canned::error(
            500,
            r#"{"error":{"message":"fake server: no canned response left"}}"#,
        ));
    let chunks = canned.chunks.clone();
    let stream = async_stream(chunks);
    let mut response = Response::builder().status(StatusCode::from_u16(canned.status).unwrap());
    for (k, v) in &canned.headers {
        response = response.header(k, v);
    }
    response.body(Body::from_stream(stream)).unwrap()
}

fn async_stream(
    chunks: Vec<(Duration, Vec<u8>)>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    futures_util::stream::unfold(chunks.into_iter(), |mut rest| async move {
        let (pause, bytes) = rest.next()?;
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        Some((Ok(Bytes::from(bytes)), rest))
    })
}
