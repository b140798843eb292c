//! The cache of folded session states, and following other writers of the store: a cached
//! state catches up with their appends, and its waiters and followers hear of them.

use super::{
    does_not_fold, lock, AppendedEvents, Engine, OutcomeWait, PerSessionEntries, WatchGuard,
};
use crate::error::{Error, Result};
use crate::event::EventEnvelope;
use crate::state_cache::{SessionSlot, StateCache};
use crate::store::StoreChange;
use crate::workflow::{SessionState, TurnOutcome};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::{broadcast, watch};
use tracing::{debug, info};
// Named in doc links only.
#[cfg(doc)]
use super::{CACHE_BYTES, CACHE_CAPACITY};
#[cfg(doc)]
use crate::store::Store;

impl Engine {
    pub(super) fn slot(&self, session_id: &str) -> SessionSlot {
        let mut sessions = lock(&self.inner.sessions);
        let (slot, purged) = sessions.slot(session_id);
        if purged {
            lock(&self.inner.heard_seqs).retain(|id, _| sessions.contains(id));
        }
        slot
    }

    /// Notes a change hint of a cached session (one not cached loads anew anyway).
    fn hear(&self, change: &StoreChange) {
        let cached = lock(&self.inner.sessions).contains(&change.session_id);
        if cached {
            let mut heard = lock(&self.inner.heard_seqs);
            let seq = heard.entry(change.session_id.clone()).or_default();
            *seq = (*seq).max(change.last_seq);
        }
    }

    /// Whether a hint said the session has events past the cached state's (then it is caught
    /// up before deciding); forgets hints the state has caught up with.
    pub(super) fn heard_ahead(&self, state: &SessionState) -> bool {
        let mut heard = lock(&self.inner.heard_seqs);
        match heard.get(&state.session_id) {
            Some(&seq) if seq >= state.next_seq => true,
            Some(_) => {
                heard.remove(&state.session_id);
                false
            }
            None => false,
        }
    }

    /// A receiver of the session's outcomes, the channel created if nobody waited yet.
    pub(super) fn outcome_wait(&self, session_id: &str) -> OutcomeWait {
        let rx = lock(&self.inner.outcomes)
            .entry(session_id.to_owned())
            .or_insert_with(|| watch::channel(None).0)
            .subscribe();
        OutcomeWait {
            engine: self.clone(),
            session_id: session_id.to_owned(),
            rx,
        }
    }

    /// How many entries the engine keeps per session, map by map (for tests and benches).
    #[doc(hidden)]
    pub fn per_session_entries(&self) -> PerSessionEntries {
        PerSessionEntries {
            sessions: lock(&self.inner.sessions).len(),
            outcomes: lock(&self.inner.outcomes).len(),
            watched: lock(&self.inner.watched).len(),
            heard_seqs: lock(&self.inner.heard_seqs).len(),
            leased_here: lock(&self.inner.leased_here).len(),
        }
    }

    /// Whether the session's folded state is cached.
    #[cfg(test)]
    pub(crate) fn holds_state(&self, session_id: &str) -> bool {
        lock(&self.inner.sessions)
            .peek(session_id)
            .is_some_and(|slot| slot.try_lock().is_some_and(|state| state.is_some()))
    }

    /// Sets how many session states are cached before parked ones nobody holds are dropped,
    /// least recently used first ([`CACHE_CAPACITY`] by default). Set it on a new engine,
    /// before it is cloned: on an engine already shared it changes nothing.
    pub fn with_cache_capacity(self, capacity: usize) -> Self {
        self.with_cache(|cache| cache.set_capacity(capacity))
    }

    /// Sets how many bytes the cached session states may hold
    /// ([`SessionState::approx_bytes`]) before parked ones nobody holds are dropped, least
    /// recently used first ([`CACHE_BYTES`] by default). Set it on a new engine, before it is
    /// cloned: on an engine already shared it changes nothing.
    pub fn with_cache_bytes(self, bytes: usize) -> Self {
        self.with_cache(|cache| cache.set_byte_budget(bytes))
    }

    /// Changes the state cache's settings while the engine is not shared yet.
    fn with_cache(mut self, change: impl FnOnce(&mut StateCache)) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            change(match inner.sessions.get_mut() {
                Ok(cache) => cache,
                Err(poisoned) => poisoned.into_inner(),
            });
        }
        self
    }

    /// What the cache of session states holds, and its bounds.
    pub fn cache_stats(&self) -> crate::wire::StateCacheStats {
        let cache = lock(&self.inner.sessions);
        crate::wire::StateCacheStats {
            sessions: cache.len() as u64,
            bytes: cache.bytes() as u64,
            max_sessions: cache.capacity() as u64,
            max_bytes: cache.byte_budget() as u64,
        }
    }

    /// The session's state, caught up with the store: a cached state reads only the events
    /// appended after its next seq (by another writer: this engine's own appends are applied
    /// as they are made), and publishes them to subscribers and waiters as its own appends
    /// are; a miss folds the whole history.
    pub(super) async fn loaded<'a>(
        &self,
        session_id: &str,
        guard: &'a mut Option<SessionState>,
    ) -> Result<&'a mut SessionState> {
        match guard {
            None => {
                let events = self.inner.store.read_history(session_id, 1, None).await?;
                *guard = Some(
                    SessionState::fold(session_id, &events)
                        .map_err(|e| does_not_fold(session_id, e))?,
                );
            }
            Some(state) => {
                let events = match self
                    .inner
                    .store
                    .read_history(session_id, state.next_seq, None)
                    .await
                {
                    Ok(events) => events,
                    // A session being started has nothing stored yet.
                    Err(Error::UnknownSession { .. }) if state.next_seq == 1 => Vec::new(),
                    Err(e) => {
                        *guard = None;
                        return Err(e);
                    }
                };
                if !events.is_empty() {
                    if let Err(e) = self.apply_foreign(state, events) {
                        *guard = None;
                        return Err(does_not_fold(session_id, e));
                    }
                }
            }
        }
        guard.as_mut().ok_or_else(|| Error::UnknownSession {
            session_id: session_id.to_owned(),
        })
    }

    /// Applies events another writer appended to a cached state, then tells subscribers and
    /// turn waiters as if this engine had appended them.
    fn apply_foreign(&self, state: &mut SessionState, events: Vec<EventEnvelope>) -> Result<()> {
        let outcome_before = state.last_outcome.as_ref().map(TurnOutcome::turn);
        for event in &events {
            state.apply(event)?;
        }
        state.finish_replay()?;
        debug!(
            session_id = %state.session_id,
            events = events.len(),
            "caught up with appends of another writer"
        );
        let outcome = state
            .last_outcome
            .clone()
            .filter(|o| Some(o.turn()) != outcome_before);
        self.publish(&state.session_id, events, outcome);
        Ok(())
    }

    /// Tells event subscribers and turn waiters what was appended.
    pub(super) fn publish(
        &self,
        session_id: &str,
        events: Vec<EventEnvelope>,
        outcome: Option<TurnOutcome>,
    ) {
        if self.inner.appended.receiver_count() > 0 {
            // No subscriber left is fine: they read the store when they come back.
            let _ = self.inner.appended.send(Arc::new(AppendedEvents {
                session_id: session_id.to_owned(),
                events,
            }));
        }
        if let Some(outcome) = outcome {
            // Only waiters have a channel: with none, the outcome is in the state.
            if let Some(tx) = lock(&self.inner.outcomes).get(session_id) {
                tx.send_if_modified(|current| {
                    if current.as_ref() != Some(&outcome) {
                        *current = Some(outcome);
                        true
                    } else {
                        false
                    }
                });
            }
        }
    }

    /// Marks a session as watched while the guard lives: [`Engine::follow_store`] then reads
    /// what other writers append to it, so its waiters and followers hear of it.
    pub fn watch(&self, session_id: &str) -> WatchGuard {
        let slot = self.slot(session_id);
        let seen = slot.known_to_have_events();
        let mut watched = lock(&self.inner.watched);
        let entry = watched
            .entry(session_id.to_owned())
            .or_insert_with(|| (0, slot, false));
        entry.0 += 1;
        entry.2 |= seen;
        WatchGuard {
            engine: self.clone(),
            session_id: session_id.to_owned(),
        }
    }

    /// Reads a watched session's foreign appends, if any (see [`Engine::loaded`]); with
    /// `hinted_seq`, only when the cached state does not have that seq yet (the hint of an
    /// append this engine made, or one it caught up with, needs no read).
    async fn refresh(&self, session_id: &str, hinted_seq: Option<u64>) {
        let slot = self.slot(session_id);
        let mut guard = slot.lock().await;
        if let (Some(state), Some(seq)) = (guard.as_ref(), hinted_seq) {
            if seq < state.next_seq {
                return;
            }
        }
        let fresh = guard.is_none();
        let loaded = self.loaded(session_id, &mut guard).await;
        if let Ok(state) = &loaded {
            if state.next_seq > 1 {
                if let Some(entry) = lock(&self.inner.watched).get_mut(session_id) {
                    entry.2 = true;
                }
            }
        }
        match loaded {
            Ok(state) if fresh => {
                // Loaded anew, so what is new to its followers is unknown: the last event
                // makes any follower behind it read the store, and the outcome is as folded.
                let last = self
                    .inner
                    .store
                    .read_history(session_id, state.next_seq.saturating_sub(1), Some(1))
                    .await
                    .unwrap_or_default();
                let outcome = state.last_outcome.clone();
                self.publish(session_id, last, outcome);
            }
            Ok(_) => {}
            // It had events while watched (here, or in the state cached when the watch began)
            // and has none now: another process deleted it. Its followers end as if this
            // engine had deleted it. A session not created yet is not taken for deleted.
            Err(Error::UnknownSession { .. })
                if !fresh
                    || lock(&self.inner.watched)
                        .get(session_id)
                        .is_some_and(|entry| entry.2) =>
            {
                info!(
                    session_id,
                    "a watched session was deleted by another process"
                );
                drop(guard);
                self.forget(session_id);
            }
            Err(Error::UnknownSession { .. }) => {}
            Err(e) => debug!(session_id, error = %e, "cannot read a watched session"),
        }
    }

    /// Follows what other writers do to the store until `stop` completes: on every hint
    /// ([`Store::subscribe_changes`]) and every `poll` (hints may be lost), reads the appends
    /// of the watched sessions ([`Engine::watch`]: turn waiters, event followers) and wakes
    /// leasing waiters when tasks may have been queued elsewhere. Needed only when the store
    /// is shared with other processes ([`Store::shared`]) or other engines.
    // Polling is the one other place the engine waits on time.
    #[allow(clippy::disallowed_methods)]
    pub async fn follow_store(
        &self,
        poll: std::time::Duration,
        stop: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(stop);
        let mut changes = self.inner.store.subscribe_changes();
        let mut ticker = tokio::time::interval(poll);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let hint = async {
                match changes.as_mut() {
                    Some(rx) => Some(rx.recv().await),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut stop => break,
                _ = ticker.tick() => {
                    self.inner.waiters.wake_all();
                    self.refresh_watched().await;
                }
                received = hint => match received {
                    Some(Ok(change)) => {
                        if change.enqueued {
                            self.inner.waiters.wake_all();
                        }
                        self.hear(&change);
                        let watched = lock(&self.inner.watched).contains_key(&change.session_id);
                        if watched {
                            self.refresh(&change.session_id, Some(change.last_seq)).await;
                        }
                    }
                    Some(Err(broadcast::error::RecvError::Lagged(_))) => {
                        self.inner.waiters.wake_all();
                        self.refresh_watched().await;
                    }
                    Some(Err(broadcast::error::RecvError::Closed)) | None => changes = None,
                },
            }
        }
    }

    /// Reads the appends of the watched sessions that moved: one read of their records
    /// ([`Store::sessions_named`]) says which did, and only those (and those without a record:
    /// deleted, or not created yet) have their histories read, so a poll of many idle
    /// followed sessions costs the store one query, not one per session.
    pub(crate) async fn refresh_watched(&self) {
        let sessions: Vec<String> = lock(&self.inner.watched).keys().cloned().collect();
        if sessions.is_empty() {
            return;
        }
        let heads: HashMap<String, u64> = match self.inner.store.sessions_named(&sessions).await {
            Ok(infos) => infos
                .into_iter()
                .map(|info| (info.session_id, info.events))
                .collect(),
            Err(e) => {
                debug!(error = %e, "cannot read the watched sessions' records; reading each");
                HashMap::new()
            }
        };
        for session_id in sessions {
            // A known last seq reads only when the cached state lacks it.
            let last_seq = heads.get(&session_id).copied();
            self.refresh(&session_id, last_seq).await;
        }
    }
}
