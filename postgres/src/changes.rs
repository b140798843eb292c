//! Change hints ([`StoreChange`]): sent with `pg_notify` after each append, heard by a
//! `PgListener` that the store owns, and handed to the store's subscribers through one
//! broadcast channel. A store's subscribers hear the appends made through other store handles
//! (other processes): each handle marks its hints with a random origin and drops their echo,
//! since the engine that appended through it knows what it appended.
//!
//! The NOTIFYs leave the append's path: an append hands its hint to the store's sender task,
//! which sends whatever has gathered since its last statement as one `SELECT pg_notify(...)
//! FROM UNNEST(...)` (one hint per session, its highest seq), outside any data transaction.
//! Under load many appends share one statement, and no append waits for a round trip it does
//! not need.
//!
//! Hints go unsent while no other store handle is connected to the database: nobody would
//! hear them but this handle's own listener, which drops its echo. Every connection of a
//! handle names it (`application_name` is `cairn ORIGIN`, [`application_name`]), and the
//! sender looks for another `cairn` connection in `pg_stat_activity` at most every
//! [`RECHECK_OTHERS`]. A server that starts is found within that time; until then it misses
//! this handle's hints, which its polls of the store make up for (hints only wake; polls make
//! sure). With a single server, this saves a statement and a backend's wake per batch of
//! appends, and a wake of the listener and its backend for each echo.
//!
//! Hints are never the truth, so nothing here is allowed to fail an operation: a NOTIFY that
//! fails is logged at debug and dropped, a payload that does not parse is ignored, and the
//! listener reconnects after any error (hints sent while it was away are lost; engines poll a
//! shared store anyway). A database without LISTEN/NOTIFY (CockroachDB) has no hints.

use crate::connections::Connections;
use cairn_runtime::store::{check_session_id, StoreChange};
use sqlx::postgres::{PgListener, PgPool};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;

/// The NOTIFY channel every cairn store of a database shares.
pub(crate) const CHANNEL: &str = "cairn_changes";

/// Hints a subscriber may fall behind by before it misses some (it then gets `Lagged` and
/// should read the store, as after any missed hint).
const BACKLOG: usize = 1024;

/// Hints waiting to be sent before the sender drops new ones (a database that does not
/// answer); more than any burst of appends between two sends.
const UNSENT_MAX: usize = 4096;

/// The most hints one NOTIFY statement carries.
const BATCH_MAX: usize = 512;

/// How often the sender looks again for another store handle on the database.
const RECHECK_OTHERS: Duration = Duration::from_millis(500);

/// Whether another cairn store handle (another process, or another handle in this one) has a
/// connection to the current database: the connections of every handle since this version
/// are named `cairn ORIGIN`, and earlier versions' `cairn`.
const OTHERS_CONNECTED: &str = "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
     WHERE datname = current_database() \
       AND (application_name = 'cairn' OR application_name LIKE 'cairn %') \
       AND application_name <> $1) AS others";

/// The first pause before the listener reconnects, doubled after each failure up to
/// [`PAUSE_MAX`], so that a database without LISTEN is not asked many times a second.
const PAUSE_MIN: Duration = Duration::from_millis(100);
const PAUSE_MAX: Duration = Duration::from_secs(5);

/// A hint as a NOTIFY payload: `v2 ORIGIN LAST_SEQ ENQUEUED SESSION_ID`, with ORIGIN the
/// sending store's [`Origin`] and ENQUEUED `0` or `1`. Session ids hold no spaces
/// ([`check_session_id`]), so the id is the rest of the line. (`v1` payloads, without ORIGIN,
/// came from versions that sent hints inside the append; they still parse, as foreign.)
pub(crate) fn payload(origin: Origin, change: &StoreChange) -> String {
    format!(
        "v2 {origin} {} {} {}",
        change.last_seq,
        u8::from(change.enqueued),
        change.session_id
    )
}

/// Which store handle sent a hint: random per [`Hints`], so that a store hears other
/// handles' hints (other processes') and not the echo of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Origin(u64);

impl Origin {
    // An origin only tells store handles apart; nothing is decided on it.
    #[allow(clippy::disallowed_methods)]
    pub(crate) fn random() -> Self {
        Origin(rand::random())
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The `application_name` of every connection of the store handle of `origin`: how other
/// handles see that it is there ([`OTHERS_CONNECTED`]).
pub(crate) fn application_name(origin: Origin) -> String {
    format!("cairn {origin}")
}

/// The hint of a NOTIFY payload, with its origin when it names one, or `None` when it is not
/// one this code writes.
pub(crate) fn parse(payload: &str) -> Option<(Option<Origin>, StoreChange)> {
    let (origin, rest) = if let Some(rest) = payload.strip_prefix("v2 ") {
        let (origin, rest) = rest.split_once(' ')?;
        if origin.len() != 16 {
            return None;
        }
        (Some(Origin(u64::from_str_radix(origin, 16).ok()?)), rest)
    } else {
        (None, payload.strip_prefix("v1 ")?)
    };
    let mut fields = rest.splitn(3, ' ');
    let last_seq = fields.next()?.parse().ok()?;
    let enqueued = match fields.next()? {
        "0" => false,
        "1" => true,
        _ => return None,
    };
    let session_id = fields.next()?;
    check_session_id(session_id).ok()?;
    Some((
        origin,
        StoreChange {
            session_id: session_id.to_owned(),
            last_seq,
            enqueued,
        },
    ))
}

/// The hints of one store: its subscribers' channel and, once someone subscribes, the task
/// that listens to the database (aborted when the store is dropped).
pub(crate) struct Hints {
    sender: broadcast::Sender<StoreChange>,
    /// Where to listen from: a pool of one connection of its own (a LISTEN holds its
    /// connection for good, which must not take one of the store's), and the runtime the store
    /// was connected in. `None` when NOTIFY is off.
    source: Option<(PgPool, tokio::runtime::Handle)>,
    listener: Mutex<Option<JoinHandle<()>>>,
    /// The queue of hints to NOTIFY, and the task that sends them; `None` when NOTIFY is off.
    sender_task: Option<(mpsc::Sender<StoreChange>, JoinHandle<()>)>,
    /// What this handle's hints carry, so that its listener drops their echo.
    origin: Origin,
}

impl Hints {
    /// Hints for the store handle of `origin`, whose appends run on `connections`; `source`
    /// is where to listen from, and `None` turns NOTIFY off.
    pub(crate) fn new(
        origin: Origin,
        connections: &Connections,
        source: Option<(PgPool, tokio::runtime::Handle)>,
        send_timeout: Duration,
    ) -> Self {
        let sender_task = source.as_ref().map(|(_, runtime)| {
            let (queue, unsent) = mpsc::channel(UNSENT_MAX);
            let task = runtime.spawn(send(connections.clone(), origin, unsent, send_timeout));
            (queue, task)
        });
        Hints {
            sender: broadcast::channel(BACKLOG).0,
            source,
            listener: Mutex::new(None),
            sender_task,
            origin,
        }
    }

    /// Queues the NOTIFY of an append that committed. A full queue drops it (the database is
    /// not answering; hints may be lost).
    pub(crate) fn notify(&self, change: StoreChange) {
        if let Some((queue, _)) = &self.sender_task {
            if queue.try_send(change).is_err() {
                tracing::debug!("the change hint queue is full; dropping a hint");
            }
        }
    }

    /// A new subscriber; starts the listener on the first subscription.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<StoreChange> {
        let receiver = self.sender.subscribe();
        if let Some((pool, runtime)) = &self.source {
            // A poisoned lock only means a subscriber panicked while starting the listener;
            // the handle inside is still right.
            let mut listener = self
                .listener
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // A closed store (`PgStore::close`) listens no more.
            if listener.is_none() && !pool.is_closed() {
                *listener =
                    Some(runtime.spawn(listen(pool.clone(), self.origin, self.sender.clone())));
            }
        }
        receiver
    }

    /// Stops listening (for [`PgStore::close`](crate::PgStore::close) and drop).
    pub(crate) fn stop(&self) {
        let listener = self
            .listener
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(listener) = listener {
            listener.abort();
        }
        if let Some((_, task)) = &self.sender_task {
            task.abort();
        }
        if let Some((pool, _)) = &self.source {
            // Closing the listener's pool lets its connection go at once; the store's own
            // pool is closed by its owner.
            let pool = pool.clone();
            drop(pool.close());
        }
    }
}

impl Drop for Hints {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sends the queued hints until the queue closes: whatever gathered while the last statement
/// ran goes in the next, one hint per session (the highest seq, queued tasks if any of its
/// hints had them), while another store handle is connected. A failed or slow send loses its
/// hints, which hints allow.
#[allow(clippy::disallowed_methods)] // a send that does not answer is given up on, in real time
async fn send(
    connections: Connections,
    origin: Origin,
    mut unsent: mpsc::Receiver<StoreChange>,
    send_timeout: Duration,
) {
    let mut batch = Vec::with_capacity(BATCH_MAX);
    let mut others: Option<(bool, tokio::time::Instant)> = None;
    while unsent.recv_many(&mut batch, BATCH_MAX).await > 0 {
        let stale = others.is_none_or(|(_, at)| at.elapsed() >= RECHECK_OTHERS);
        if stale {
            let found = others_connected(&connections, origin, send_timeout).await;
            others = Some((found, tokio::time::Instant::now()));
        }
        if others.is_some_and(|(found, _)| !found) {
            batch.clear();
            continue;
        }
        let payloads = merged(origin, batch.drain(..));
        let sent = async {
            let statement = sqlx::query("SELECT pg_notify($1, p) FROM UNNEST($2::TEXT[]) AS p")
                .bind(CHANNEL)
                .bind(&payloads);
            connections.get().await?.execute(statement).await
        };
        match tokio::time::timeout(send_timeout, sent).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(hints = payloads.len(), error = %e, "sending change hints failed")
            }
            Err(_) => tracing::debug!(hints = payloads.len(), "sending change hints timed out"),
        }
    }
}

/// Whether another store handle is connected to the database ([`OTHERS_CONNECTED`]); yes
/// when that cannot be read, since hints sent for nobody cost less than hints missed.
#[allow(clippy::disallowed_methods)] // a look that does not answer is given up on, in real time
async fn others_connected(connections: &Connections, origin: Origin, within: Duration) -> bool {
    let looked = async {
        let statement = sqlx::query(OTHERS_CONNECTED).bind(application_name(origin));
        let row = connections.get().await?.fetch_one(statement).await?;
        sqlx::Row::try_get::<bool, _>(&row, "others")
    };
    match tokio::time::timeout(within, looked).await {
        Ok(Ok(others)) => others,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "cannot tell whether another store handle is connected");
            true
        }
        Err(_) => true,
    }
}

/// The payloads of `changes`, one per session: its highest seq, and queued tasks when any
/// change queued some.
fn merged(origin: Origin, changes: impl Iterator<Item = StoreChange>) -> Vec<String> {
    let mut sessions: BTreeMap<String, StoreChange> = BTreeMap::new();
    for change in changes {
        match sessions.get_mut(&change.session_id) {
            Some(merged) => {
                merged.last_seq = merged.last_seq.max(change.last_seq);
                merged.enqueued |= change.enqueued;
            }
            None => {
                sessions.insert(change.session_id.clone(), change);
            }
        }
    }
    sessions
        .values()
        .map(|change| payload(origin, change))
        .collect()
}

/// Listens on [`CHANNEL`] for good, reconnecting after every error.
#[allow(clippy::disallowed_methods)] // the pause before reconnecting is real time, by design
async fn listen(pool: PgPool, origin: Origin, sender: broadcast::Sender<StoreChange>) {
    let mut pause = PAUSE_MIN;
    loop {
        let error = listen_until_error(&pool, origin, &sender, &mut pause).await;
        tracing::debug!(error = %error, pause_ms = pause.as_millis(), "listening for cairn change hints failed; reconnecting");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PAUSE_MAX);
    }
}

/// Listens until the connection fails; resets `pause` once listening works.
async fn listen_until_error(
    pool: &PgPool,
    origin: Origin,
    sender: &broadcast::Sender<StoreChange>,
    pause: &mut Duration,
) -> sqlx::Error {
    let mut listener = match PgListener::connect_with(pool).await {
        Ok(listener) => listener,
        Err(e) => return e,
    };
    if let Err(e) = listener.listen(CHANNEL).await {
        return e;
    }
    *pause = PAUSE_MIN;
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) => match parse(notification.payload()) {
                // The echo of this handle's own append: its engine knows it.
                Some((Some(from), _)) if from == origin => {}
                Some((_, change)) => {
                    let _ = sender.send(change);
                }
                None => tracing::debug!(
                    payload = notification.payload(),
                    "ignoring a {CHANNEL} notification that is not a cairn hint"
                ),
            },
            // The connection broke and the listener connected and listened again: hints
            // sent in between are lost, which hints allow.
            Ok(None) => tracing::debug!("the change hint listener reconnected"),
            Err(e) => return e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip() {
        for change in [
            StoreChange {
                session_id: "acme:s-1.x_y".to_owned(),
                last_seq: 42,
                enqueued: true,
            },
            StoreChange {
                session_id: "s".to_owned(),
                last_seq: 0,
                enqueued: false,
            },
        ] {
            let origin = Origin::random();
            assert_eq!(
                parse(&payload(origin, &change)),
                Some((Some(origin), change.clone()))
            );
            let v1 = format!(
                "v1 {} {} {}",
                change.last_seq,
                u8::from(change.enqueued),
                change.session_id
            );
            assert_eq!(parse(&v1), Some((None, change)), "v1 payloads still parse");
        }
    }

    #[test]
    fn hints_of_one_session_merge() {
        let change = |session_id: &str, last_seq, enqueued| StoreChange {
            session_id: session_id.to_owned(),
            last_seq,
            enqueued,
        };
        let origin = Origin(0xfe);
        let payloads = merged(
            origin,
            [
                change("b", 4, true),
                change("a", 2, false),
                change("b", 7, false),
                change("a", 3, false),
            ]
            .into_iter(),
        );
        assert_eq!(
            payloads,
            ["v2 00000000000000fe 3 0 a", "v2 00000000000000fe 7 1 b"]
        );
    }

    #[test]
    fn malformed_payloads_are_ignored() {
        for bad in [
            "",
            "v1",
            "v1 1 1",
            "v3 1 1 s",
            "v2 1 1 s",
            "v2 00000000000000fe 1 1",
            "v2 0000000000000xfe 1 1 s",
            "v2 fe 1 1 s",
            "v1 x 1 s",
            "v1 -1 1 s",
            "v1 1 2 s",
            "v1 1 1 has space",
            "v1 1 1 ",
            "hello world",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
