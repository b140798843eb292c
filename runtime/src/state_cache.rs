//! The engine's cache of folded session states: bounded by a count and by bytes, least
//! recently used parked states dropped first.
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
//!
//! The count alone would let a few long sessions take gigabytes (a thousand-turn session's
//! transcript is megabytes), so the cache also keeps the bytes of its states
//! (`SessionState::approx_bytes`) under a budget: a slot's lock guard notes its state's bytes
//! in a running total when it is released, and a new slot finding the total over the budget
//! purges parked states, least recently used first, down to three quarters of it.

use crate::report_queue::ReportQueue;
use crate::workflow::SessionState;
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// What a slot's byte count is set to once the slot left the cache: its guards then stop
/// adding to the total.
const DETACHED: usize = usize::MAX;

/// A session's cached state, `None` until it is first loaded; the engine holds the lock while
/// it steps the session.
#[derive(Debug, Clone)]
pub(crate) struct SessionSlot(Arc<SlotInner>);

#[derive(Debug)]
struct SlotInner {
    state: tokio::sync::Mutex<Option<SessionState>>,
    /// The state's bytes when its lock was last released; [`DETACHED`] once out of the cache.
    bytes: AtomicUsize,
    /// The cache's total, which this slot's bytes are part of.
    total: Arc<AtomicUsize>,
    /// Workers' reports waiting for the state's lock, to be recorded together.
    reports: ReportQueue,
}

impl SessionSlot {
    /// Locks the state; the guard notes its bytes in the cache's total when released.
    pub(crate) async fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            slot: &self.0,
            state: self.0.state.lock().await,
        }
    }

    /// The reports waiting for this session.
    pub(crate) fn reports(&self) -> &ReportQueue {
        &self.0.reports
    }

    /// Locks the state if nobody holds it.
    pub(crate) fn try_lock(&self) -> Option<StateGuard<'_>> {
        let state = self.0.state.try_lock().ok()?;
        Some(StateGuard {
            slot: &self.0,
            state,
        })
    }

    /// Whether someone besides the cache holds the slot (a step, a watch, a waiter).
    fn is_held(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }

    /// Whether the slot holds a state with events, as far as a look now can tell (a locked
    /// state counts as not known). Through the bare lock, like [`Self::is_running_or_busy`].
    pub(crate) fn known_to_have_events(&self) -> bool {
        self.0
            .state
            .try_lock()
            .is_ok_and(|state| state.as_ref().is_some_and(|s| s.next_seq > 1))
    }

    /// Whether the slot's session is running, or its state is locked (in use). It looks
    /// through the bare lock, not a [`StateGuard`]: a look changes no bytes to note.
    fn is_running_or_busy(&self) -> bool {
        match self.0.state.try_lock() {
            Ok(state) => state.as_ref().is_some_and(SessionState::is_running),
            Err(_) => true,
        }
    }

    /// Takes the slot's bytes out of the cache's total for good.
    fn detach(&self) {
        let bytes = self.0.bytes.swap(DETACHED, Ordering::AcqRel);
        if bytes != DETACHED {
            self.0.total.fetch_sub(bytes, Ordering::AcqRel);
        }
    }
}

/// A locked session state; it derefs to the state and, when dropped, notes the state's bytes
/// in the cache's total.
pub(crate) struct StateGuard<'a> {
    slot: &'a SlotInner,
    state: tokio::sync::MutexGuard<'a, Option<SessionState>>,
}

impl Deref for StateGuard<'_> {
    type Target = Option<SessionState>;

    fn deref(&self) -> &Self::Target {
        &self.state
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.state
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        let bytes = self.state.as_ref().map_or(0, SessionState::approx_bytes);
        // A compare-and-swap, not a store, so that a slot detached meanwhile stays detached:
        // its bytes left the total when it was, and must not come back.
        let Ok(current) =
            self.slot
                .bytes
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                    (current != DETACHED && current != bytes).then_some(bytes)
                })
        else {
            return;
        };
        // Added before subtracted, so the total never wraps below zero on the way.
        self.slot.total.fetch_add(bytes, Ordering::AcqRel);
        self.slot.total.fetch_sub(current, Ordering::AcqRel);
    }
}

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
    /// The bytes the cached states may hold before parked ones are dropped.
    byte_budget: usize,
    /// The bytes the cached states hold, as their guards last noted them.
    bytes: Arc<AtomicUsize>,
}

impl StateCache {
    /// An empty cache of at most `capacity` states (at least one) and `byte_budget` bytes,
    /// besides running ones.
    pub(crate) fn new(capacity: usize, byte_budget: usize) -> Self {
        StateCache {
            slots: HashMap::new(),
            uses: 0,
            capacity: capacity.max(1),
            byte_budget,
            bytes: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Sets the capacity (at least one).
    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
    }

    /// Sets the byte budget.
    pub(crate) fn set_byte_budget(&mut self, byte_budget: usize) {
        self.byte_budget = byte_budget;
    }

    /// The states it keeps before it drops parked ones.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The bytes it keeps before it drops parked ones.
    pub(crate) fn byte_budget(&self) -> usize {
        self.byte_budget
    }

    /// The bytes the cached states hold, as their guards last noted them.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
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
        let purged = self.slots.len() >= self.capacity || self.bytes() > self.byte_budget;
        if purged {
            self.purge();
        }
        let slot = SessionSlot(Arc::new(SlotInner {
            state: tokio::sync::Mutex::new(None),
            bytes: AtomicUsize::new(0),
            total: self.bytes.clone(),
            reports: ReportQueue::default(),
        }));
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
    /// capacity and of the byte budget (see the module docs); then, if as many sessions still
    /// run as the cache holds, every state nobody holds.
    fn purge(&mut self) {
        // At least one slot of room, so that a small cache purges as a large one does.
        let keep = self.capacity - (self.capacity / 4).max(1);
        let keep_bytes = self.byte_budget - self.byte_budget / 4;
        // Nobody else holds a slot the cache alone holds, so its lock is free; a state not
        // loaded yet (`None`) is as good as parked.
        let mut parked: Vec<(u64, String)> = self
            .slots
            .iter()
            .filter(|(_, cached)| !cached.slot.is_held() && !cached.slot.is_running_or_busy())
            .map(|(id, cached)| (cached.used, id.clone()))
            .collect();
        parked.sort_unstable();
        for (_, id) in parked {
            if self.slots.len() <= keep && self.bytes() <= keep_bytes {
                break;
            }
            if let Some(cached) = self.slots.remove(&id) {
                cached.slot.detach();
            }
        }
        if self.slots.len() >= self.capacity {
            self.slots.retain(|_, cached| {
                let kept = cached.slot.is_held();
                if !kept {
                    cached.slot.detach();
                }
                kept
            });
        }
    }

    /// Forgets the session's state.
    pub(crate) fn remove(&mut self, session_id: &str) {
        if let Some(cached) = self.slots.remove(session_id) {
            cached.slot.detach();
        }
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
    use crate::workflow_tests::{model_done, response, started, text, user, Live};
    use cairn_ledger::{ModelSpec, StopReason, Usage};

    fn parked(cache: &mut StateCache, id: &str) {
        let (slot, _) = cache.slot(id);
        *slot.try_lock().expect("free") = Some(SessionState::new(id));
    }

    /// A parked state of one finished turn whose question is `len` bytes.
    fn finished_turn(len: usize) -> SessionState {
        let mut live = Live::new(started(8));
        live.input(user(1, &"x".repeat(len)));
        live.input(model_done(
            1,
            0,
            1,
            response(vec![text("ok")], StopReason::EndTurn),
        ));
        assert!(!live.state.is_running());
        live.state
    }

    fn park(cache: &mut StateCache, id: &str, state: SessionState) {
        let (slot, _) = cache.slot(id);
        *slot.try_lock().expect("free") = Some(state);
    }

    #[test]
    fn over_its_byte_budget_the_cache_drops_the_least_recently_used_parked_states() {
        let state = finished_turn(20_000);
        let one = state.approx_bytes();
        assert!(one > 20_000, "{one}");
        // Room for three and a half states; the count is no limit here.
        let mut cache = StateCache::new(100, 3 * one + one / 2);
        for id in ["a", "b", "c"] {
            park(&mut cache, id, state.clone());
        }
        assert_eq!(cache.bytes(), 3 * one);
        cache.slot("a");
        // Under the budget: no purge.
        let (_, purged) = cache.slot("d");
        assert!(!purged);
        park(&mut cache, "d", state.clone());
        assert_eq!(cache.bytes(), 4 * one);
        // Over it: parked states go, least recently used first (b, then c), until the bytes
        // are down to three quarters of the budget.
        let (_, purged) = cache.slot("e");
        assert!(purged);
        for (id, kept) in [
            ("a", true),
            ("b", false),
            ("c", false),
            ("d", true),
            ("e", true),
        ] {
            assert_eq!(cache.contains(id), kept, "{id}");
        }
        assert_eq!(cache.bytes(), 2 * one);
        // A state emptied (an error drops it) leaves the total.
        *cache.peek("a").expect("cached").try_lock().expect("free") = None;
        assert_eq!(cache.bytes(), one);
    }

    #[test]
    fn held_states_stay_over_the_budget_and_a_slot_forgotten_while_held_leaves_the_total() {
        let state = finished_turn(5_000);
        let one = state.approx_bytes();
        let mut cache = StateCache::new(100, one);
        let (held, _) = cache.slot("held");
        *held.try_lock().expect("free") = Some(state.clone());
        park(&mut cache, "parked", state.clone());
        assert_eq!(cache.bytes(), 2 * one);
        cache.slot("new");
        // The parked state went; the held one stayed, over the budget.
        assert!(cache.contains("held") && !cache.contains("parked") && cache.contains("new"));
        assert_eq!(cache.bytes(), one);
        // Forgotten (the session deleted) while a step still holds it: its bytes leave the
        // total at once, and its guard, released afterwards, does not bring them back.
        let mut guard = held.try_lock().expect("free");
        cache.remove("held");
        assert_eq!(cache.bytes(), 0);
        *guard = Some(finished_turn(9_000));
        drop(guard);
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn a_full_cache_drops_the_least_recently_used_parked_states_first() {
        let mut cache = StateCache::new(4, usize::MAX);
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
        let mut cache = StateCache::new(2, usize::MAX);
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
        let mut cache = StateCache::new(2, usize::MAX);
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
