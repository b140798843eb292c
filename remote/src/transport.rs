//! The client's transport over the `/v1` API: every [`Transport`] operation as the request
//! the route table of `cairn_runtime::wire` names, and a session's event stream that
//! reconnects by itself without losing or repeating a history event.

use crate::connection::{encode, Connection, Request, Subject, REQUEST_TIMEOUT};
use crate::sse::StreamDecoder;
use async_trait::async_trait;
use cairn_ledger::{Media, ModelSpec, ToolChoice, Transcript};
use cairn_runtime::wire::{
    ApprovalDecided, ApprovalDecision, ApprovalRequest, CancelRequest, Cancelled,
    CompactionOutcome, CreateSession, ErrorBody, ErrorCode, Health, HistoryPage, SendMessage,
    SessionCreated, SessionDeleted, SessionDescription, SessionPage, StreamEvent, TurnStarted,
    TurnWait,
};
use cairn_runtime::{
    Error, EventEnvelope, EventStream, Result, SessionOptions, SessionQuery, Transport, TurnOutcome,
};
use futures_util::StreamExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::debug;

/// How long one long poll for a turn's outcome asks the server to wait; the client asks
/// again until the turn ends (or its own deadline passes).
const TURN_POLL: Duration = Duration::from_secs(30);

/// How long an event stream keeps trying to reconnect to a server that stays unreachable
/// (or keeps failing) before it ends with the error; a restart of the server takes less.
const RECONNECT_GIVE_UP: Duration = Duration::from_secs(60);

/// The first and the longest pause between reconnection attempts.
const RECONNECT_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(5));

/// How long a request that starts a turn is sent again, under its idempotency key, while
/// the server stays unreachable (or keeps failing) before the error is given up on, unless
/// [`HttpTransport::with_resend_window`] says otherwise; a restart of the server takes less.
const RESEND_GIVE_UP: Duration = Duration::from_secs(60);

/// A client transport to a cairn server (`http(s)://HOST:PORT` or `unix:PATH`).
#[derive(Clone)]
pub struct HttpTransport {
    connection: Arc<Connection>,
    /// Set once the server refused a session's first message in its `POST /v1/sessions`
    /// (a server from before the field): from then on the message goes by itself.
    first_message_refused: Arc<AtomicBool>,
    /// How long a request that starts a turn is sent again while it fails retryably.
    resend_window: Duration,
}

impl HttpTransport {
    /// A transport to the server at `url`, sending `token` as a bearer token when given.
    /// Nothing is sent until the first operation.
    pub fn new(url: &str, token: Option<String>) -> Result<Self> {
        Ok(HttpTransport {
            connection: Arc::new(Connection::new(url, token)?),
            first_message_refused: Arc::default(),
            resend_window: RESEND_GIVE_UP,
        })
    }

    /// This transport, sending a request that starts a turn again (under its idempotency
    /// key) while it fails retryably for up to `window` instead of 60 s; `Duration::ZERO`
    /// sends it once, and its failure is the caller's to handle. A turn deadline
    /// ([`cairn_runtime::Client::with_turn_deadline`]) does not bound these resends: a
    /// client that must answer sooner sets a window within its deadline.
    pub fn with_resend_window(mut self, window: Duration) -> Self {
        self.resend_window = window;
        self
    }

    /// The server's address as given.
    pub fn url(&self) -> &str {
        self.connection.url()
    }

    /// `GET /v1/health`. A server whose store refuses writes answers 503 with its health
    /// (`status` `failed`, and why): that is returned too, not an error.
    pub async fn health(&self) -> Result<Health> {
        let (status, body) = self
            .connection
            .exchange(Request::get("/v1/health"), REQUEST_TIMEOUT)
            .await?;
        match status {
            200..=299 => self.connection.decode("GET /v1/health", &body),
            503 => serde_json::from_slice::<Health>(&body).map_err(|_| {
                self.connection
                    .error_answer(status, &body, Subject::default())
            }),
            _ => Err(self
                .connection
                .error_answer(status, &body, Subject::default())),
        }
    }
}

fn session_path(session_id: &str) -> String {
    format!("/v1/sessions/{}", encode(session_id))
}

/// A server's 422 `idempotency_key_reused` answer to a message sent under `key` as the
/// typed error the in-process client gives ([`Error::IdempotencyKeyReused`]): the key is the
/// one sent, the turn the first one the server's words name after the quoted key ("...
/// which started turn N ..."). Any other error, or words that name no turn, is left as it is.
fn key_reused(error: Error, key: &str, session_id: Option<&str>) -> Error {
    let turn = match &error {
        Error::Remote {
            status: 422,
            code,
            message,
            ..
        } if code == "idempotency_key_reused" => message
            .split_once(&format!("{key:?}"))
            .and_then(|(_, after_key)| after_key.split_once("turn "))
            .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|digits| digits.parse::<u32>().ok()),
        _ => None,
    };
    match (turn, session_id) {
        (Some(turn), Some(session_id)) => Error::IdempotencyKeyReused {
            session_id: session_id.to_owned(),
            key: key.to_owned(),
            turn,
        },
        _ => error,
    }
}

fn session(session_id: &str) -> Subject<'_> {
    Subject {
        session_id: Some(session_id),
        lease: None,
    }
}

/// The `POST /v1/sessions` body for `options`, with the session's first message if any.
/// A session without an id of its own gets one here, not from the server, so that a resend
/// of the request ([`HttpTransport::until_answered`]) names the session the first one
/// started.
fn create_session(options: SessionOptions, message: Option<SendMessage>) -> CreateSession {
    CreateSession {
        session_id: Some(options.session_id.unwrap_or_else(new_session_id)),
        model: options.model,
        tools: options.tools,
        system_prompt: options.system_prompt,
        // Sent explicitly, so the session records what this client asked for, not the
        // server build's defaults.
        limits: Some(options.limits),
        model_retry: Some(options.model_retry),
        tool_retry: Some(options.tool_retry),
        queues: (!options.queues.is_default()).then_some(options.queues),
        // None leaves the server's default: ask before calls of tools that ask by default.
        tool_policy: options.tool_policy,
        compaction: options.compaction,
        call_options: options.call_options,
        message,
    }
}

/// How long one request that starts a turn asks the server to wait for it (`wait_ms`): the
/// caller's `timeout`, at most a long poll's; `None` when it asks not to wait.
fn start_turn_wait(timeout: Option<Duration>) -> Option<Duration> {
    let wait = timeout.map_or(TURN_POLL, |t| t.min(TURN_POLL));
    (!wait.is_zero()).then_some(wait)
}

/// A message of text alone.
fn text_message(text: &str) -> SendMessage {
    SendMessage {
        text: text.to_owned(),
        model: None,
        media: Vec::new(),
        tool_choice: None,
    }
}

/// A key no other request has: 128 random bits, in hex.
#[allow(clippy::disallowed_methods)] // a client's keys are random by design; not pure code
pub(crate) fn new_idempotency_key() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A new session's id: `s`, the time in hex milliseconds (so ids sort by creation, as the
/// server's own do) and 64 random bits.
#[allow(clippy::disallowed_methods)] // the time and randomness of an id; not pure code
fn new_session_id() -> String {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis());
    format!("s{now_ms:x}-{:016x}", rand::random::<u64>())
}

/// `path` with `?wait_ms=` for `wait`, if any.
fn with_wait(path: &str, wait: Option<Duration>) -> String {
    match wait {
        Some(wait) => format!("{path}?wait_ms={}", wait.as_millis()),
        None => path.to_owned(),
    }
}

impl HttpTransport {
    /// `POST /v1/sessions`, asking the server to wait up to `wait` for the first message's
    /// turn; sent again while it fails retryably ([`HttpTransport::until_answered`]).
    async fn create(&self, body: &CreateSession, wait: Option<Duration>) -> Result<SessionCreated> {
        let subject = Subject {
            session_id: body.session_id.as_deref(),
            lease: None,
        };
        self.until_answered(
            Request::post(with_wait("/v1/sessions", wait), body),
            new_idempotency_key(),
            subject,
            REQUEST_TIMEOUT + wait.unwrap_or_default(),
        )
        .await
    }

    /// `POST /v1/sessions/{id}/messages`, asking the server to wait up to `wait` for the
    /// turn; sent again while it fails retryably ([`HttpTransport::until_answered`]).
    async fn post_message(
        &self,
        session_id: &str,
        body: &SendMessage,
        wait: Option<Duration>,
    ) -> Result<TurnStarted> {
        self.post_message_under(session_id, body, wait, new_idempotency_key())
            .await
    }

    /// [`HttpTransport::post_message`] under idempotency key `key`.
    async fn post_message_under(
        &self,
        session_id: &str,
        body: &SendMessage,
        wait: Option<Duration>,
        key: String,
    ) -> Result<TurnStarted> {
        let path = format!("{}/messages", session_path(session_id));
        self.until_answered(
            Request::post(with_wait(&path, wait), body),
            key,
            session(session_id),
            REQUEST_TIMEOUT + wait.unwrap_or_default(),
        )
        .await
    }

    /// Sends a request that starts a turn under idempotency key `key`, and sends it again
    /// under the same key while it fails retryably (the server unreachable, a broken
    /// connection, a 5xx), backing off, for up to its resend window (60 s by default): the server records the
    /// message once and answers a resend as it did the first request, so a client that lost
    /// an answer neither loses its message nor sends it twice. (A server from before the
    /// header ignores it; a resend to one would start a second turn if the first request
    /// had landed, or be refused as a turn already running.)
    async fn until_answered<T: serde::de::DeserializeOwned>(
        &self,
        mut request: Request,
        key: String,
        subject: Subject<'_>,
        timeout: Duration,
    ) -> Result<T> {
        request.idempotency_key = Some(key.clone());
        let since = Instant::now();
        let mut backoff = RECONNECT_BACKOFF.0;
        loop {
            match self
                .connection
                .call_json(request.clone(), subject, timeout)
                .await
            {
                Err(e) if retryable(&e) && since.elapsed() + backoff < self.resend_window => {
                    debug!(error = %e, path = %request.path, "a request that starts a turn failed; sending it again under its idempotency key");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RECONNECT_BACKOFF.1);
                }
                Err(e) => return Err(key_reused(e, &key, subject.session_id)),
                answered => return answered,
            }
        }
    }

    /// Creates a session with its first message, in one request when the server takes the
    /// message with the session (asking it to wait up to `wait` for the turn), else in two;
    /// returns the session, its turn, and the turn's outcome when the server waited for it
    /// and it ended in time.
    ///
    /// A server from before `message` refuses the field (400), recording nothing; then, and
    /// from then on, the session is created and the message sent by themselves. A server
    /// from before `wait_ms` ignores it and answers without an outcome.
    async fn create_with_message(
        &self,
        options: SessionOptions,
        text: &str,
        wait: Option<Duration>,
    ) -> Result<(String, u32, Option<TurnOutcome>)> {
        let mut body = create_session(options, Some(text_message(text)));
        // The session, when the server created it without the message.
        let mut created = None;
        if !self.first_message_refused.load(Ordering::Relaxed) {
            match self.create(&body, wait).await {
                Ok(SessionCreated {
                    session_id,
                    turn: Some(turn),
                    outcome,
                }) => return Ok((session_id, turn, outcome)),
                // A server that ignores fields it does not know created the session alone.
                Ok(SessionCreated {
                    session_id,
                    turn: None,
                    ..
                }) => created = Some(session_id),
                Err(Error::Remote {
                    status: 400,
                    message,
                    ..
                }) if message.contains("unknown field `message`") => {}
                Err(e) => return Err(e),
            }
            debug!("the server takes no first message with a new session; sending it by itself from now on");
            self.first_message_refused.store(true, Ordering::Relaxed);
        }
        let message = body.message.take().expect("the message was set above");
        let session_id = match created {
            Some(session_id) => session_id,
            None => self.create(&body, None).await?.session_id,
        };
        let started = self.post_message(&session_id, &message, wait).await?;
        Ok((session_id, started.turn, started.outcome))
    }

    /// The outcome of `turn`, given what the request that started it answered: that
    /// request's outcome, or, when it came without one (the turn took longer than the request
    /// waited, or the server is from before `wait_ms`), a wait on until `timeout` from `since`
    /// (as long as it takes when `None`).
    async fn outcome_after_start(
        &self,
        answered: Option<TurnOutcome>,
        session_id: &str,
        turn: u32,
        since: Instant,
        timeout: Option<Duration>,
    ) -> Result<Option<TurnOutcome>> {
        if answered.is_some() {
            return Ok(answered);
        }
        let remaining = match timeout {
            None => None,
            Some(timeout) => {
                let remaining = timeout.saturating_sub(since.elapsed());
                if remaining.is_zero() {
                    return Ok(None);
                }
                Some(remaining)
            }
        };
        self.wait_turn(session_id, turn, remaining).await
    }
}

#[async_trait]
impl Transport for HttpTransport {
    async fn start_session(&self, options: SessionOptions) -> Result<String> {
        let created = self.create(&create_session(options, None), None).await?;
        Ok(created.session_id)
    }

    /// One request, one commit on the server: the session and its first message together
    /// (a server from before that gets the session, then the message).
    async fn start_session_and_send(
        &self,
        options: SessionOptions,
        text: &str,
    ) -> Result<(String, u32)> {
        let (session_id, turn, _) = self.create_with_message(options, text, None).await?;
        Ok((session_id, turn))
    }

    /// One request: the session, its first message, and the wait for that turn's outcome
    /// (then long polls, if the turn takes longer than one may wait).
    async fn start_session_send_and_wait(
        &self,
        options: SessionOptions,
        text: &str,
        timeout: Option<Duration>,
    ) -> Result<(String, u32, Option<TurnOutcome>)> {
        let since = Instant::now();
        let (session_id, turn, answered) = self
            .create_with_message(options, text, start_turn_wait(timeout))
            .await?;
        let outcome = self
            .outcome_after_start(answered, &session_id, turn, since, timeout)
            .await?;
        Ok((session_id, turn, outcome))
    }

    /// One request: the message and the wait for its turn's outcome (then long polls, if the
    /// turn takes longer than one may wait).
    async fn send_and_wait(
        &self,
        session_id: &str,
        text: &str,
        timeout: Option<Duration>,
    ) -> Result<(u32, Option<TurnOutcome>)> {
        let since = Instant::now();
        let started = self
            .post_message(session_id, &text_message(text), start_turn_wait(timeout))
            .await?;
        let outcome = self
            .outcome_after_start(started.outcome, session_id, started.turn, since, timeout)
            .await?;
        Ok((started.turn, outcome))
    }

    async fn send(
        &self,
        session_id: &str,
        text: &str,
        model: Option<ModelSpec>,
        media: Vec<Media>,
        tool_choice: Option<ToolChoice>,
    ) -> Result<u32> {
        let body = SendMessage {
            text: text.to_owned(),
            model,
            media,
            tool_choice,
        };
        Ok(self.post_message(session_id, &body, None).await?.turn)
    }

    /// The message under the caller's key, sent again under it while it fails retryably.
    async fn send_idempotent(
        &self,
        session_id: &str,
        key: &str,
        message: SendMessage,
    ) -> Result<u32> {
        let started = self
            .post_message_under(session_id, &message, None, key.to_owned())
            .await?;
        Ok(started.turn)
    }

    async fn wait_turn(
        &self,
        session_id: &str,
        turn: u32,
        timeout: Option<Duration>,
    ) -> Result<Option<TurnOutcome>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        // A wait is read-only, so one that fails on the way (the server restarting, the store
        // briefly unavailable) is asked again, as the event stream reconnects, for as long as
        // the resend window and the caller's deadline allow: the turn goes on regardless.
        let mut failing_since: Option<Instant> = None;
        let mut backoff = RECONNECT_BACKOFF.0;
        loop {
            let wait = match deadline {
                Some(deadline) => deadline
                    .saturating_duration_since(Instant::now())
                    .min(TURN_POLL),
                None => TURN_POLL,
            };
            let path = format!(
                "{}/turns/{turn}?timeout_ms={}",
                session_path(session_id),
                wait.as_millis()
            );
            let answer = self
                .connection
                .call_json::<TurnWait>(
                    Request::get(path),
                    session(session_id),
                    REQUEST_TIMEOUT + wait,
                )
                .await;
            let answer = match answer {
                Ok(answer) => {
                    failing_since = None;
                    backoff = RECONNECT_BACKOFF.0;
                    answer
                }
                Err(e) if retryable(&e) => {
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    let past_deadline = deadline.is_some_and(|d| Instant::now() + backoff >= d);
                    if past_deadline || since.elapsed() + backoff >= self.resend_window {
                        return Err(e);
                    }
                    debug!(error = %e, "waiting for a turn failed; asking again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RECONNECT_BACKOFF.1);
                    continue;
                }
                Err(e) => return Err(e),
            };
            match answer {
                TurnWait {
                    done: true,
                    outcome: Some(outcome),
                } => return Ok(Some(outcome)),
                TurnWait { done: true, .. } => {
                    return Err(self.connection.bad_answer(format!(
                        "turn {turn} of session {session_id:?} is done without an outcome"
                    )))
                }
                TurnWait { done: false, .. } => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(None);
                    }
                }
            }
        }
    }

    async fn cancel(&self, session_id: &str, reason: &str) -> Result<()> {
        self.cancel_request(session_id, reason, false).await?;
        Ok(())
    }

    async fn cancel_turn(&self, session_id: &str, reason: &str) -> Result<u32> {
        match self.cancel_request(session_id, reason, true).await? {
            Cancelled { turn: Some(turn) } => Ok(turn),
            Cancelled { turn: None } => Err(self.connection.bad_answer(format!(
                "a cancelled turn of session {session_id:?} without its number"
            ))),
        }
    }

    async fn delete_session(&self, session_id: &str) -> Result<SessionDeleted> {
        self.connection
            .call_json(
                Request::delete(session_path(session_id)),
                session(session_id),
                REQUEST_TIMEOUT,
            )
            .await
    }

    async fn compact(&self, session_id: &str) -> Result<CompactionOutcome> {
        let path = format!("{}/compact", session_path(session_id));
        self.connection
            .call_json(
                Request::post(path, &serde_json::json!({})),
                session(session_id),
                REQUEST_TIMEOUT,
            )
            .await
    }

    async fn approve(&self, session_id: &str, tool_use_id: &str) -> Result<()> {
        self.approval_request(session_id, tool_use_id, ApprovalDecision::Approve, None)
            .await
    }

    async fn deny(&self, session_id: &str, tool_use_id: &str, reason: &str) -> Result<()> {
        self.approval_request(
            session_id,
            tool_use_id,
            ApprovalDecision::Deny,
            Some(reason.to_owned()),
        )
        .await
    }

    async fn history(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: Option<usize>,
    ) -> Result<Vec<EventEnvelope>> {
        // The server caps a page: ask again from where it stopped until the history (or the
        // limit) is exhausted.
        let mut events = Vec::new();
        let mut from = from_seq;
        loop {
            let wanted = limit.map(|l| l - events.len());
            if wanted == Some(0) {
                return Ok(events);
            }
            let mut path = format!("{}/history?from_seq={from}", session_path(session_id));
            if let Some(wanted) = wanted {
                path.push_str(&format!("&limit={wanted}"));
            }
            let page: HistoryPage = self
                .connection
                .call_json(Request::get(path), session(session_id), REQUEST_TIMEOUT)
                .await?;
            let Some(last) = page.events.last().map(|e| e.seq) else {
                return Ok(events);
            };
            if last < from || page.next_seq <= last {
                return Err(self.connection.bad_answer(format!(
                    "a history page of session {session_id:?} asked from seq {from} ends at seq {last} with next_seq {}",
                    page.next_seq
                )));
            }
            from = page.next_seq;
            events.extend(page.events);
            if let Some(limit) = limit {
                events.truncate(limit);
            }
        }
    }

    async fn transcript(&self, session_id: &str) -> Result<Transcript> {
        let path = format!("{}/transcript", session_path(session_id));
        self.connection
            .call_json(Request::get(path), session(session_id), REQUEST_TIMEOUT)
            .await
    }

    async fn describe(&self, session_id: &str) -> Result<SessionDescription> {
        self.connection
            .call_json(
                Request::get(session_path(session_id)),
                session(session_id),
                REQUEST_TIMEOUT,
            )
            .await
    }

    async fn sessions(&self, query: &SessionQuery) -> Result<SessionPage> {
        let mut params = Vec::new();
        if let Some(status) = query.status {
            params.push(format!("status={}", status.as_str()));
        }
        if let Some(after) = &query.after {
            params.push(format!("after={}", encode(after)));
        }
        if let Some(limit) = query.limit {
            params.push(format!("limit={limit}"));
        }
        let mut path = "/v1/sessions".to_owned();
        if !params.is_empty() {
            path.push('?');
            path.push_str(&params.join("&"));
        }
        self.connection
            .call_json(Request::get(path), Subject::default(), REQUEST_TIMEOUT)
            .await
    }

    async fn subscribe(&self, session_id: &str, after_seq: u64) -> Result<EventStream> {
        let follower = Follower {
            connection: self.connection.clone(),
            session_id: session_id.to_owned(),
            last_seq: after_seq,
            server_failing_since: None,
        };
        // The first connection is opened here, so an unknown session or a refused token is
        // this call's error rather than the stream's.
        let body = follower.connect(false).await?;
        let (sender, receiver) = mpsc::channel(1024);
        tokio::spawn(follower.run(body, sender));
        Ok(EventStream::new(receiver))
    }
}

impl HttpTransport {
    async fn approval_request(
        &self,
        session_id: &str,
        tool_use_id: &str,
        decision: ApprovalDecision,
        reason: Option<String>,
    ) -> Result<()> {
        let body = ApprovalRequest { decision, reason };
        let path = format!(
            "{}/approvals/{}",
            session_path(session_id),
            encode(tool_use_id)
        );
        let _: ApprovalDecided = self
            .connection
            .call_json(
                Request::post(path, &body),
                session(session_id),
                REQUEST_TIMEOUT,
            )
            .await?;
        Ok(())
    }

    async fn cancel_request(
        &self,
        session_id: &str,
        reason: &str,
        turn_only: bool,
    ) -> Result<Cancelled> {
        let body = CancelRequest {
            reason: Some(reason.to_owned()),
            turn_only,
        };
        let path = format!("{}/cancel", session_path(session_id));
        self.connection
            .call_json(
                Request::post(path, &body),
                session(session_id),
                REQUEST_TIMEOUT,
            )
            .await
    }
}

/// Follows a session's event stream across connections: after a dropped connection it
/// reconnects with `Last-Event-ID` (and `after_seq`) set to the last seq it passed on, skips
/// events it already passed on and reads any it was not sent from the history, so every
/// history event reaches the consumer exactly once, in order. Deltas sent while it was
/// disconnected are missed: they are presentation only.
struct Follower {
    connection: Arc<Connection>,
    session_id: String,
    last_seq: u64,
    /// Since when each connection has ended on the server's `error` message that it could
    /// not read the history (store unavailable), with no event passed on since: reconnecting
    /// gives up after [`RECONNECT_GIVE_UP`] of that, as after failed connects.
    server_failing_since: Option<Instant>,
}

impl Follower {
    /// Opens the stream from after `last_seq`.
    async fn connect(&self, reconnect: bool) -> Result<crate::connection::ByteStream> {
        let mut request = Request::get(format!(
            "{}/events?after_seq={}",
            session_path(&self.session_id),
            self.last_seq
        ));
        request.event_stream = true;
        if reconnect {
            request.last_event_id = Some(self.last_seq);
        }
        let response = tokio::time::timeout(REQUEST_TIMEOUT, self.connection.send(request))
            .await
            .map_err(|_| {
                self.connection
                    .unreachable_because("the event stream did not open in time")
            })??;
        if (200..300).contains(&response.status) {
            return Ok(response.body);
        }
        let status = response.status;
        let body = self.connection.read_body(response.body).await?;
        Err(self
            .connection
            .error_answer(status, &body, session(&self.session_id)))
    }

    async fn run(
        mut self,
        first: crate::connection::ByteStream,
        sender: mpsc::Sender<Result<StreamEvent>>,
    ) {
        let mut body = Some(first);
        let mut backoff = RECONNECT_BACKOFF.0;
        let mut failing_since: Option<Instant> = None;
        loop {
            let Some(stream) = body.take() else {
                tokio::select! {
                    _ = sender.closed() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(RECONNECT_BACKOFF.1);
                match self.connect(true).await {
                    Ok(stream) => {
                        body = Some(stream);
                        failing_since = None;
                        backoff = RECONNECT_BACKOFF.0;
                    }
                    Err(e) => {
                        let since = *failing_since.get_or_insert_with(Instant::now);
                        if !retryable(&e) || since.elapsed() >= RECONNECT_GIVE_UP {
                            let _ = sender.send(Err(e)).await;
                            return;
                        }
                        debug!(session_id = %self.session_id, error = %e, "reconnecting the event stream");
                    }
                }
                continue;
            };
            match self.read(stream, &sender).await {
                Ok(()) => {
                    debug!(session_id = %self.session_id, last_seq = self.last_seq, "event stream ended; reconnecting");
                }
                Err(Some(e)) => {
                    let _ = sender.send(Err(e)).await;
                    return;
                }
                // The consumer is gone.
                Err(None) => return,
            }
        }
    }

    /// Passes on one connection's messages until it ends (`Ok`), the consumer is gone
    /// (`Err(None)`) or the stream is broken beyond a reconnect (`Err(Some)`).
    async fn read(
        &mut self,
        mut stream: crate::connection::ByteStream,
        sender: &mpsc::Sender<Result<StreamEvent>>,
    ) -> std::result::Result<(), Option<Error>> {
        let mut decoder = StreamDecoder::new();
        loop {
            let chunk = tokio::select! {
                _ = sender.closed() => return Err(None),
                chunk = stream.next() => chunk,
            };
            let chunk = match chunk {
                None => return Ok(()),
                Some(Err(reason)) => {
                    debug!(session_id = %self.session_id, %reason, "event stream broke");
                    return Ok(());
                }
                Some(Ok(chunk)) => chunk,
            };
            decoder
                .push(&chunk)
                .map_err(|reason| Some(self.connection.bad_answer(reason)))?;
            while let Some(message) = decoder.next() {
                match message.map_err(|reason| Some(self.connection.bad_answer(reason)))? {
                    None => {}
                    Some(StreamEvent::Event(event)) => self.deliver(event, sender).await?,
                    Some(delta) => sender.send(Ok(delta)).await.map_err(|_| None)?,
                }
            }
            if let Some(data) = decoder.take_server_error() {
                return self.ended_by_the_server(&data);
            }
        }
    }

    /// The server ended the stream with an `error` message (`data`, a JSON error body): one
    /// it says is passing (`unavailable`: its store) is reconnected past, for a while; any
    /// other is the stream's end, passed to the consumer. (Reconnected past, a corrupt record
    /// would end every connection the same way, forever.)
    fn ended_by_the_server(&mut self, data: &str) -> std::result::Result<(), Option<Error>> {
        let passing = serde_json::from_str::<ErrorBody>(data)
            .is_ok_and(|body| body.error.code == ErrorCode::Unavailable);
        let status = if passing { 503 } else { 500 };
        let error =
            self.connection
                .error_answer(status, data.as_bytes(), session(&self.session_id));
        let since = *self.server_failing_since.get_or_insert_with(Instant::now);
        if !passing || since.elapsed() >= RECONNECT_GIVE_UP {
            return Err(Some(error));
        }
        debug!(session_id = %self.session_id, error = %error, "the server ended the event stream for now; reconnecting");
        Ok(())
    }

    /// Passes on a history event unless it was passed on already, after any events between
    /// the last one passed on and it (read from the history).
    async fn deliver(
        &mut self,
        event: EventEnvelope,
        sender: &mpsc::Sender<Result<StreamEvent>>,
    ) -> std::result::Result<(), Option<Error>> {
        if event.seq <= self.last_seq {
            return Ok(());
        }
        let mut events = Vec::new();
        if event.seq > self.last_seq.saturating_add(1) {
            let missing = (event.seq - self.last_seq - 1) as usize;
            let transport = HttpTransport {
                connection: self.connection.clone(),
                first_message_refused: Arc::default(),
                resend_window: RESEND_GIVE_UP,
            };
            let read = transport
                .history(
                    &self.session_id,
                    self.last_seq.saturating_add(1),
                    Some(missing),
                )
                .await
                .map_err(Some)?;
            events.extend(read.into_iter().filter(|e| e.seq < event.seq));
        }
        events.push(event);
        for event in events {
            if event.seq != self.last_seq.saturating_add(1) {
                return Err(Some(self.connection.bad_answer(format!(
                    "the event stream of session {:?} skipped from seq {} to {}, and the history does not have them",
                    self.session_id, self.last_seq, event.seq
                ))));
            }
            self.last_seq = event.seq;
            self.server_failing_since = None;
            if sender.send(Ok(StreamEvent::Event(event))).await.is_err() {
                return Err(None);
            }
        }
        Ok(())
    }
}

/// Whether a failed request may succeed when tried again: the server was unreachable, or
/// failed (5xx: a store error, draining, a proxy without its backend).
pub(crate) fn retryable(error: &Error) -> bool {
    match error {
        Error::Unreachable { .. } => true,
        Error::Remote { status, .. } => *status >= 500,
        _ => false,
    }
}
