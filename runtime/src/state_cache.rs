//! The engine's cache of folded session states: bounded by a count, least recently used
//! parked states dropped first.
//!
//! A session waiting for its next message may wait for days, so its state cannot stay
//! cached forever; a session in a chat is answered again within minutes, and folding its
//! history again at each message would cost a read of all of it. So when the cache is full
//! it drops the parked states (idle, held by nobody) least recently used first, down to three
//! quarters of its capacity (one less than the capacity for a cache of under eight). That
//! leaves room for a quarter of new sessions before the next purge: a purge sorts the cache,
//! so it runs once per so many new sessions, not per session. Running sessions' states are
//! kept past the capacity, so a busy engine does not fold its turns again; only when as many
//! sessions run as the cache holds are the states nobody holds at that moment dropped too.

use crate::workflow::SessionState;
use std::collections::HashMap;
use std::sync::Arc;

/// A session's cached state, `None` until it is first loaded; the engine holds the lock while
/// it steps the session.
pub(crate) type SessionSlot = Arc<tokio::sync::Mutex<Option<SessionState>>>;

#[derive(Debug)]
struct Cached {
    slot: SessionSlot,
    /// The cache's use counter at this slot's last use.
    used: u64,
}

/// Session states by session id (see the module docs).
#[derive(Debug)]
pub(crate) struct StateCache {
    slots: HashMap<String, Cached>,
    /// Counts uses; a slot's `used` orders the purge.
    uses: u64,
    capacity: usize,
}

impl StateCache {
    /// An empty cache of at most `capacity` states (at least one) besides running ones.
    pub(crate) fn new(capacity: usize) -> Self {
        StateCache {
            slots: HashMap::new(),
            uses: 0,
            capacity: capacity.max(1),
        }
    }

    /// Sets the capacity (at least one).
    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
    }

    /// The session's slot, made (after a purge when the cache is full) if it has none, and
    /// marked as just used. Returns whether a purge ran.
    pub(crate) fn slot(&mut self, session_id: &str) -> (SessionSlot, bool) {
        self.uses += 1;
        let used = self.uses;
        if let Some(cached) = self.slots.get_mut(session_id) {
            cached.used = used;
            return (cached.slot.clone(), false);
        }
        let purged = self.slots.len() >= self.capacity;
        if purged {
            self.purge();
        }
        let slot: SessionSlot = Arc::new(tokio::sync::Mutex::new(None));
        self.slots.insert(
            session_id.to_owned(),
            Cached {
                slot: slot.clone(),
                used,
            },
        );
        (slot, purged)
    }

    /// Drops parked states, least recently used first, down to three quarters of the
    /// capacity (see the module docs); then, if as many sessions still run as the cache
    /// holds, every state nobody holds.
    fn purge(&mut self) {
        // At least one slot of room, so that a small cache purges as a large one does.
        let keep = self.capacity - (self.capacity / 4).max(1);
        // Nobody else holds a slot with one reference, so `try_lock` finds it free; a state
        // not loaded yet (`None`) is as good as parked.
        let mut parked: Vec<(u64, String)> =
            self.slots
                .iter()
                .filter(|(_, cached)| {
                    Arc::strong_count(&cached.slot) == 1
                        && cached.slot.try_lock().is_ok_and(|state| {
                            !state.as_ref().is_some_and(SessionState::is_running)
                        })
                })
                .map(|(id, cached)| (cached.used, id.clone()))
                .collect();
        parked.sort_unstable();
        let excess = self.slots.len().saturating_sub(keep);
        for (_, id) in parked.into_iter().take(excess) {
            self.slots.remove(&id);
        }
        if self.slots.len() >= self.capacity {
            self.slots
                .retain(|_, cached| Arc::strong_count(&cached.slot) > 1);
        }
    }

    /// Forgets the session's state.
    pub(crate) fn remove(&mut self, session_id: &str) {
        self.slots.remove(session_id);
    }

    /// Whether the session has a slot.
    pub(crate) fn contains(&self, session_id: &str) -> bool {
        self.slots.contains_key(session_id)
    }

    /// The session's slot, if it has one, without marking it used.
    #[cfg(test)]
    pub(crate) fn peek(&self, session_id: &str) -> Option<&SessionSlot> {
        self.slots.get(session_id).map(|cached| &cached.slot)
    }

    /// How many slots the cache holds.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::UsageTotals;
    use crate::workflow::{ActiveTurn, Phase};
    use cairn_ledger::{ModelSpec, Usage};

    fn parked(cache: &mut StateCache, id: &str) {
        let (slot, _) = cache.slot(id);
        *slot.try_lock().expect("free") = Some(SessionState::new(id));
    }

    #[test]
    fn a_full_cache_drops_the_least_recently_used_parked_states_first() {
        let mut cache = StateCache::new(4);
        for id in ["a", "b", "c", "d"] {
            parked(&mut cache, id);
        }
        // a is used again; b and c are now the least recently used.
        cache.slot("a");
        let (_, purged) = cache.slot("e");
        assert!(purged);
        // Down to three (three quarters of four), then e: b went, the rest stayed.
        assert_eq!(cache.len(), 4);
        for (id, kept) in [
            ("a", true),
            ("b", false),
            ("c", true),
            ("d", true),
            ("e", true),
        ] {
            assert_eq!(cache.contains(id), kept, "{id}");
        }
        // The next new session drops c, then the least recently used.
        cache.slot("f");
        assert!(!cache.contains("c") && cache.contains("d") && cache.contains("a"));
    }

    #[test]
    fn held_states_are_kept_and_a_cache_of_held_states_grows_past_its_capacity() {
        let mut cache = StateCache::new(2);
        let (held_a, _) = cache.slot("a");
        let (held_b, _) = cache.slot("b");
        let (_, purged) = cache.slot("c");
        assert!(purged);
        assert!(cache.contains("a") && cache.contains("b") && cache.contains("c"));
        drop(held_a);
        // a and c are now held by nobody and not loaded: the next purge drops both (down to
        // one, the held b).
        cache.slot("d");
        assert!(!cache.contains("a") && !cache.contains("c"));
        assert!(cache.contains("b") && cache.contains("d"));
        assert_eq!(cache.len(), 2);
        drop(held_b);
    }

    #[test]
    fn running_states_nobody_holds_are_kept_until_only_running_ones_are_left() {
        let mut cache = StateCache::new(2);
        for id in ["r1", "r2"] {
            let (slot, _) = cache.slot(id);
            let mut state = SessionState::new(id);
            state.active = Some(ActiveTurn {
                turn: 1,
                round: 1,
                model: ModelSpec::new("scripted", "running"),
                tool_choice: None,
                phase: Phase::Ending,
                usage: Usage::default(),
                totals: UsageTotals::default(),
                stop_reason: None,
            });
            assert!(state.is_running());
            *slot.try_lock().expect("free") = Some(state);
        }
        // Both run and nobody holds them: the purge finds no parked state, and as many run
        // as the cache holds, so it drops them (they fold again from the history).
        cache.slot("p");
        assert_eq!(cache.len(), 1);
        assert!(cache.contains("p"));
    }
}
