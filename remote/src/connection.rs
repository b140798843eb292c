//! One request function over two ways of reaching a server: HTTP(S) through reqwest, and a
//! unix socket through hyper (reqwest cannot dial one). Everything above it — paths, bodies,
//! error answers, streams — is shared, so the two cannot behave differently.

use bytes::Bytes;
use cairn_runtime::wire::{ErrorBody, ErrorCode, TOOL_SETS_HEADER, TRANSCRIPTS_HEADER};
use cairn_runtime::{Error, Result};
use futures_util::stream::{self, BoxStream, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use reqwest::Method;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tracing::debug;

/// The largest answer read whole (a history page, a transcript): past it the answer is
/// refused rather than buffered.
pub(crate) const MAX_BODY_BYTES: usize = 256 * 1024 * 1024;

/// How long a connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an ordinary request may take; long polls add their own wait to it.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A body arriving in chunks; an error is the transport's, with its cause chain.
pub(crate) type ByteStream = BoxStream<'static, std::result::Result<Bytes, String>>;

/// Where the server is.
#[derive(Debug, Clone)]
enum Endpoint {
    /// `http(s)://HOST:PORT[/PREFIX]`, parsed: a request's URL is this one with its path and
    /// query set ([`request_url`]), so the host is not parsed again per request (URL parsing
    /// was about 7% of a worker's CPU).
    Http { url: reqwest::Url },
    /// `unix:PATH`.
    Unix { path: PathBuf },
}

/// A request: method, path and query (`/v1/...`), and an optional JSON body.
#[derive(Clone)]
pub(crate) struct Request {
    pub method: Method,
    pub path: String,
    pub body: Option<Vec<u8>>,
    /// `Last-Event-ID` of an SSE reconnect.
    pub last_event_id: Option<u64>,
    /// Ask for an event stream rather than JSON.
    pub event_stream: bool,
    /// `Idempotency-Key` of a request that starts a turn, the same on each resend.
    pub idempotency_key: Option<String>,
    /// `Cairn-Tool-Sets` of a worker's request: the tool sets it keeps.
    pub tool_sets: Option<Arc<str>>,
    /// `Cairn-Transcripts` of a worker's request: the transcripts it keeps.
    pub transcripts: Option<Arc<str>>,
}

impl Request {
    /// A request without a body.
    pub fn get(path: impl Into<String>) -> Self {
        Request {
            method: Method::GET,
            path: path.into(),
            body: None,
            last_event_id: None,
            event_stream: false,
            idempotency_key: None,
            tool_sets: None,
            transcripts: None,
        }
    }

    /// A DELETE, without a body.
    pub fn delete(path: impl Into<String>) -> Self {
        Request {
            method: Method::DELETE,
            ..Request::get(path)
        }
    }

    /// A POST of `body` as JSON.
    pub fn post(path: impl Into<String>, body: &impl Serialize) -> Self {
        Request {
            method: Method::POST,
            path: path.into(),
            // The wire types are plain data with string keys: serializing them cannot fail.
            body: Some(serde_json::to_vec(body).unwrap_or_default()),
            last_event_id: None,
            event_stream: false,
            idempotency_key: None,
            tool_sets: None,
            transcripts: None,
        }
    }
}

/// An answer: its status and its body, not read yet.
pub(crate) struct Response {
    pub status: u16,
    pub body: ByteStream,
}

/// What an error answer is about, so that it maps back to the runtime's own errors.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Subject<'a> {
    /// The session the request named.
    pub session_id: Option<&'a str>,
    /// The lease a worker request presented.
    pub lease: Option<&'a cairn_runtime::Lease>,
}

/// A connection to one server; cheap to share.
pub(crate) struct Connection {
    endpoint: Endpoint,
    /// The URL as given, for error messages.
    url: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Connection {
    /// A connection to `url` (`http://HOST:PORT`, `https://...`, or `unix:PATH`), sending
    /// `token` as a bearer token when given.
    pub fn new(url: &str, token: Option<String>) -> Result<Self> {
        let endpoint = parse_url(url)?;
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            // Long polls and event streams stay open; a dead peer is found by keepalives.
            .tcp_keepalive(Duration::from_secs(30))
            .build()
            .map_err(|e| Error::Unreachable {
                url: url.to_owned(),
                reason: format!("cannot set up an HTTP client: {}", cause_chain(&e)),
            })?;
        Ok(Connection {
            endpoint,
            url: url.to_owned(),
            token: token.filter(|t| !t.is_empty()),
            http,
        })
    }

    /// The server's URL as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends `request`; the answer's body is left to read. Fails only when the server could
    /// not be reached or broke the connection before answering.
    pub async fn send(&self, request: Request) -> Result<Response> {
        match &self.endpoint {
            Endpoint::Http { url } => self.send_http(url, request).await,
            Endpoint::Unix { path } => self.send_unix(path, request).await,
        }
    }

    async fn send_http(&self, base: &reqwest::Url, request: Request) -> Result<Response> {
        let url = request_url(base, &request.path);
        let mut builder = self.http.request(request.method.clone(), url);
        for (name, value) in self.headers(&request) {
            builder = builder.header(name, value);
        }
        if let Some(body) = request.body {
            builder = builder.body(body);
        }
        let answer = builder.send().await.map_err(|e| self.unreachable(&e))?;
        let status = answer.status().as_u16();
        let body = answer
            .bytes_stream()
            .map(|chunk| chunk.map_err(|e| cause_chain(&e)))
            .boxed();
        Ok(Response { status, body })
    }

    async fn send_unix(&self, path: &std::path::Path, request: Request) -> Result<Response> {
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(path))
            .await
            .map_err(|_| self.unreachable_because("timed out connecting"))?
            .map_err(|e| self.unreachable(&e))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
                .await
                .map_err(|e| self.unreachable(&e))?;
        // The connection is driven by its own task: it must make progress while the caller
        // reads the body, and it ends when the body is finished or dropped (one request per
        // connection: a unix socket costs nothing to reconnect).
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                debug!(error = %cause_chain(&e), "unix socket connection ended with an error");
            }
        });
        let mut builder = hyper::Request::builder()
            .method(request.method.clone())
            .uri(&request.path)
            .header(hyper::header::HOST, "localhost");
        for (name, value) in self.headers(&request) {
            builder = builder.header(name, value);
        }
        let http_request = builder
            .body(Full::new(Bytes::from(request.body.unwrap_or_default())))
            .map_err(|e| self.unreachable_because(&format!("invalid request: {e}")))?;
        let answer = sender
            .send_request(http_request)
            .await
            .map_err(|e| self.unreachable(&e))?;
        let status = answer.status().as_u16();
        let body = stream::unfold(answer.into_body(), |mut body| async move {
            loop {
                match body.frame().await? {
                    Ok(frame) => match frame.into_data() {
                        Ok(data) => return Some((Ok(data), body)),
                        // Trailers carry nothing for us.
                        Err(_) => continue,
                    },
                    Err(e) => return Some((Err(cause_chain(&e)), body)),
                }
            }
        })
        .boxed();
        Ok(Response { status, body })
    }

    fn headers(&self, request: &Request) -> Vec<(&'static str, String)> {
        let mut headers = Vec::new();
        if let Some(token) = &self.token {
            headers.push(("authorization", format!("Bearer {token}")));
        }
        if request.body.is_some() {
            headers.push(("content-type", "application/json".to_owned()));
        }
        if request.event_stream {
            headers.push(("accept", "text/event-stream".to_owned()));
            headers.push(("cache-control", "no-cache".to_owned()));
        } else {
            headers.push(("accept", "application/json".to_owned()));
        }
        if let Some(id) = request.last_event_id {
            headers.push(("last-event-id", id.to_string()));
        }
        if let Some(key) = &request.idempotency_key {
            headers.push(("idempotency-key", key.clone()));
        }
        if let Some(tool_sets) = &request.tool_sets {
            headers.push((TOOL_SETS_HEADER, tool_sets.to_string()));
        }
        if let Some(transcripts) = &request.transcripts {
            headers.push((TRANSCRIPTS_HEADER, transcripts.to_string()));
        }
        headers
    }

    /// Sends `request` and reads its answer whole, within `timeout`: the body of a success,
    /// or the runtime error an error answer stands for.
    pub async fn call(
        &self,
        request: Request,
        subject: Subject<'_>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let (status, body) = self.exchange(request, timeout).await?;
        self.answer(status, body, subject)
    }

    /// An answer's body, or the error its status and body stand for.
    pub fn answer(&self, status: u16, body: Vec<u8>, subject: Subject<'_>) -> Result<Vec<u8>> {
        if (200..300).contains(&status) {
            Ok(body)
        } else {
            Err(self.error_answer(status, &body, subject))
        }
    }

    /// Sends `request` and reads its answer whole within `timeout`: its status and body,
    /// whatever the status.
    pub async fn exchange(&self, request: Request, timeout: Duration) -> Result<(u16, Vec<u8>)> {
        let what = format!("{} {}", request.method, request.path);
        let exchange = async {
            let response = self.send(request).await?;
            let status = response.status;
            let body = self.read_body(response.body).await?;
            Ok::<_, Error>((status, body))
        };
        let (status, body) = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| {
                self.unreachable_because(&format!(
                    "no complete answer to {what} within {} s",
                    timeout.as_secs()
                ))
            })??;
        Ok((status, body))
    }

    /// [`Connection::call`], decoding the answer as JSON.
    pub async fn call_json<T: DeserializeOwned>(
        &self,
        request: Request,
        subject: Subject<'_>,
        timeout: Duration,
    ) -> Result<T> {
        let what = format!("{} {}", request.method, request.path);
        let body = self.call(request, subject, timeout).await?;
        self.decode(&what, &body)
    }

    /// Decodes an answer's JSON body.
    pub fn decode<T: DeserializeOwned>(&self, what: &str, body: &[u8]) -> Result<T> {
        from_json(body)
            .map_err(|e| self.bad_answer(format!("the answer to {what} does not decode: {e}")))
    }

    /// Reads a body whole, up to [`MAX_BODY_BYTES`].
    pub async fn read_body(&self, mut body: ByteStream) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|reason| self.unreachable_because(&reason))?;
            if bytes.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(
                    self.bad_answer(format!("an answer over {MAX_BODY_BYTES} bytes; refused"))
                );
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    }

    /// The runtime error that an error answer (`status`, `body`) stands for.
    pub fn error_answer(&self, status: u16, body: &[u8], subject: Subject<'_>) -> Error {
        let Ok(ErrorBody { error }) = serde_json::from_slice::<ErrorBody>(body) else {
            // Not a cairn error body: a proxy's page, or an unknown code of a newer server.
            let code = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.pointer("/error/code")?.as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("http_{status}"));
            let message = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.pointer("/error/message")?.as_str().map(str::to_owned))
                .unwrap_or_else(|| snippet(body));
            return Error::Remote {
                url: self.url.clone(),
                status,
                code,
                message,
            };
        };
        let message = error.message;
        match (error.code, subject.session_id, subject.lease) {
            (ErrorCode::NotFound, Some(session_id), _) => Error::UnknownSession {
                session_id: session_id.to_owned(),
            },
            // The server refuses an id no session can have as a bad request; by the same
            // rule the stores apply, it is the in-process client's typed error (a usage
            // error to the CLI, not a failure of the server).
            (ErrorCode::InvalidRequest, Some(session_id), _)
                if cairn_runtime::store::check_session_id(session_id).is_err() =>
            {
                Error::InvalidSessionId {
                    session_id: session_id.to_owned(),
                }
            }
            (ErrorCode::SessionBusy, session_id, _) => Error::SessionBusy {
                session_id: session_id.unwrap_or_default().to_owned(),
                reason: message
                    .split_once("cannot be deleted: ")
                    .map_or(message.as_str(), |(_, reason)| reason)
                    .to_owned(),
            },
            (ErrorCode::HistoryUnreadable, session_id, _) => Error::HistoryUnreadable {
                session_id: session_id.unwrap_or_default().to_owned(),
                reason: message,
            },
            (ErrorCode::StaleReport, _, Some(lease)) => Error::StaleReport {
                session_id: lease.id.session_id.clone(),
                seq: lease.id.scheduled_seq,
                reason: message,
            },
            (ErrorCode::StaleReport, session_id, None) => Error::StaleReport {
                session_id: session_id.unwrap_or_default().to_owned(),
                seq: 0,
                reason: message,
            },
            (ErrorCode::LeaseLost, _, Some(lease)) => Error::LeaseLost {
                task: lease.id.to_string(),
                reason: message,
            },
            (ErrorCode::LeaseLost, _, None) => Error::LeaseLost {
                task: String::new(),
                reason: message,
            },
            // The server's words for `Error::SessionDeleted` (a write to a deleted session,
            // or a stream that ends as its session is deleted).
            (ErrorCode::Conflict, Some(session_id), _)
                if message.ends_with("was deleted; its id cannot be used again") =>
            {
                Error::SessionDeleted {
                    session_id: session_id.to_owned(),
                }
            }
            (ErrorCode::Conflict, session_id, _) => {
                let session_id = session_id.unwrap_or_default();
                let (seq, reason) =
                    rejected_event(session_id, &message).unwrap_or((0, message.clone()));
                Error::InvalidEvent {
                    session_id: session_id.to_owned(),
                    seq,
                    reason,
                }
            }
            (code, _, _) => Error::Remote {
                url: self.url.clone(),
                status,
                code: code.as_str().to_owned(),
                message,
            },
        }
    }

    /// An `Unreachable` error from a transport failure, with its cause chain.
    pub fn unreachable(&self, error: &(dyn std::error::Error + 'static)) -> Error {
        self.unreachable_because(&cause_chain(error))
    }

    /// An `Unreachable` error for `reason`.
    pub fn unreachable_because(&self, reason: &str) -> Error {
        Error::Unreachable {
            url: self.url.clone(),
            reason: reason.to_owned(),
        }
    }

    /// A `BadAnswer` error.
    pub fn bad_answer(&self, reason: String) -> Error {
        Error::BadAnswer {
            url: self.url.clone(),
            reason,
        }
    }
}

/// Parses a server address: `http://HOST:PORT[/PREFIX]`, `https://...` or `unix:PATH`.
fn parse_url(url: &str) -> Result<Endpoint> {
    let invalid = |why: &str| Error::Unreachable {
        url: url.to_owned(),
        reason: format!(
            "not a server address ({why}); use http://HOST:PORT, https://HOST:PORT or unix:PATH"
        ),
    };
    if let Some(path) = url.strip_prefix("unix:") {
        // `unix:///run/cairn.sock` and `unix:/run/cairn.sock` name the same file.
        let path = path.strip_prefix("//").unwrap_or(path);
        if path.is_empty() {
            return Err(invalid("no socket path"));
        }
        return Ok(Endpoint::Unix {
            path: PathBuf::from(path),
        });
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid(&format!("scheme {:?}", parsed.scheme())));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("no host"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(invalid("a query or fragment"));
    }
    Ok(Endpoint::Http { url: parsed })
}

/// Parses a JSON body. As text checked for UTF-8 once, whole: parsed from bytes, serde_json
/// checks each string as it meets it, a fifth of the parse of a worker's task. A body that is
/// not UTF-8 is parsed from its bytes, for serde_json's error, which says where.
pub(crate) fn from_json<T: DeserializeOwned>(body: &[u8]) -> serde_json::Result<T> {
    match std::str::from_utf8(body) {
        Ok(text) => serde_json::from_str(text),
        Err(_) => serde_json::from_slice(body),
    }
}

/// The URL of `path_and_query` (`/v1/...`, its segments already encoded) on the server at
/// `base`, under its prefix if it has one: what parsing `base` and the path joined as text
/// gives, without parsing the host again.
fn request_url(base: &reqwest::Url, path_and_query: &str) -> reqwest::Url {
    let (path, query) = match path_and_query.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path_and_query, None),
    };
    let mut url = base.clone();
    url.set_path(&format!("{}{path}", base.path().trim_end_matches('/')));
    url.set_query(query);
    url
}

/// An error and its causes, joined with `: `, without repeating a cause its parent already
/// quoted ("error sending request: connection refused", not just the first part).
pub(crate) fn cause_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let part = cause.to_string();
        if !part.is_empty() && !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = cause.source();
    }
    text
}

/// The start of a body that is not a cairn error, as text for a message.
fn snippet(body: &[u8]) -> String {
    const MAX_CHARS: usize = 300;
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        return "no error body".to_owned();
    }
    let mut short: String = text.chars().take(MAX_CHARS).collect();
    if short.len() < text.len() {
        short.push('…');
    }
    short
}

/// The seq and reason of an `InvalidEvent` the server passed on as its message
/// (`session "ID" seq N: event rejected: REASON`), so the error reads as it would locally.
fn rejected_event(session_id: &str, message: &str) -> Option<(u64, String)> {
    let rest = message.strip_prefix(&format!("session {session_id:?} seq "))?;
    let (seq, reason) = rest.split_once(": event rejected: ")?;
    Some((seq.parse().ok()?, reason.to_owned()))
}

/// Percent-encodes one path segment or query value (everything but RFC 3986's unreserved
/// characters), so no id can change the route.
pub(crate) fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's URL is what parsing the server's address and the path joined as text
    /// gives: prefixes kept, encoded segments left encoded, the query kept.
    #[test]
    fn request_urls_are_the_address_and_the_path_joined() {
        for base in [
            "http://127.0.0.1:7070",
            "http://127.0.0.1:7070/",
            "https://example.test/cairn",
            "https://example.test/cairn/",
            "http://[::1]:8787/a/b",
        ] {
            let Endpoint::Http { url } = parse_url(base).unwrap() else {
                panic!("{base} is an http address");
            };
            for path in [
                "/v1/health",
                "/v1/sessions/a%2Fb%20c/messages?wait_ms=5000",
                "/v1/sessions?status=idle&after=x%3Ay&limit=3",
                "/v1/sessions/s1/turns/2?timeout_ms=30000",
            ] {
                let joined = format!("{}{path}", base.trim_end_matches('/'));
                assert_eq!(
                    request_url(&url, path).as_str(),
                    reqwest::Url::parse(&joined).unwrap().as_str(),
                    "{base} + {path}"
                );
            }
        }
    }

    #[test]
    fn addresses_parse_or_are_refused_with_the_reason() {
        let http = parse_url("http://127.0.0.1:7070/").unwrap();
        assert!(
            matches!(http, Endpoint::Http { ref url } if url.as_str() == "http://127.0.0.1:7070/")
        );
        let prefixed = parse_url("https://example.test/cairn/").unwrap();
        assert!(
            matches!(prefixed, Endpoint::Http { ref url } if url.as_str() == "https://example.test/cairn/")
        );
        for (url, path) in [
            ("unix:/tmp/x/cairn.sock", "/tmp/x/cairn.sock"),
            ("unix:///tmp/x/cairn.sock", "/tmp/x/cairn.sock"),
            ("unix:data/cairn.sock", "data/cairn.sock"),
        ] {
            let parsed = parse_url(url).unwrap();
            assert!(
                matches!(parsed, Endpoint::Unix { path: ref p } if p == std::path::Path::new(path)),
                "{url}: {parsed:?}"
            );
        }
        for bad in [
            "",
            "127.0.0.1:7070",
            "ftp://host",
            "unix:",
            "http://",
            "http://h/?a=1",
        ] {
            let err = parse_url(bad).unwrap_err();
            assert!(
                matches!(&err, Error::Unreachable { reason, .. } if reason.contains("not a server address")),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn a_json_body_parses_from_text_and_one_not_utf8_is_refused_saying_where() {
        let parsed: std::collections::BTreeMap<String, Vec<String>> =
            from_json("{\"tools\": [\"calc\", \"r\u{e9}sum\u{e9}\"]}".as_bytes()).unwrap();
        assert_eq!(parsed["tools"], ["calc", "r\u{e9}sum\u{e9}"]);
        let err = from_json::<std::collections::BTreeMap<String, Vec<String>>>(
            b"{\"tools\": [\"calc\", \"r\xe9sum\"]}",
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid unicode code point at line 1 column 22",
            "serde_json's error from the bytes, with where"
        );
    }

    #[test]
    fn encoding_keeps_ids_inside_their_segment() {
        assert_eq!(encode("s-1.a_b~"), "s-1.a_b~");
        assert_eq!(encode("a/b?c=d&e f"), "a%2Fb%3Fc%3Dd%26e%20f");
        assert_eq!(encode("é"), "%C3%A9");
    }

    #[test]
    fn a_rejection_the_server_passes_on_reads_as_the_local_error() {
        assert_eq!(
            rejected_event(
                "s1",
                "session \"s1\" seq 7: event rejected: turn 2 is running"
            ),
            Some((7, "turn 2 is running".to_owned()))
        );
        assert_eq!(rejected_event("s1", "session id s1 is taken"), None);
        assert_eq!(
            rejected_event("s2", "session \"s1\" seq 7: event rejected: x"),
            None
        );
    }

    #[test]
    fn the_cause_chain_names_the_root_cause_once() {
        #[derive(Debug)]
        struct Layer(&'static str, Option<Box<Layer>>);
        impl std::fmt::Display for Layer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Layer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|l| l as _)
            }
        }
        let error = Layer(
            "error sending request",
            Some(Box::new(Layer(
                "client error (Connect)",
                Some(Box::new(Layer("Connection refused (os error 111)", None))),
            ))),
        );
        assert_eq!(
            cause_chain(&error),
            "error sending request: client error (Connect): Connection refused (os error 111)"
        );
        let repeating = Layer(
            "tcp connect error: refused",
            Some(Box::new(Layer("refused", None))),
        );
        assert_eq!(cause_chain(&repeating), "tcp connect error: refused");
    }
}
