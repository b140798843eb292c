//! Worker requests answered again: reports, and lease requests sent under an
//! `Idempotency-Key`.
//!
//! Each report runs in a task of its own, so a worker that hangs up (its try timed out) does
//! not cut it short, and a try of the same lease's report sent again (its answer was lost)
//! joins the first instead of being refused as stale. A report that leased the worker's next
//! tasks with it (eager dispatch) is remembered until those leases run out, so a try sent
//! again is answered with the same tasks: without that, they would wait, leased to nobody,
//! for their leases to lapse, and each would cost an attempt. A lease request under a key is
//! remembered the same way once it leased, so a try sent again under that key (the answer
//! was lost on the way) is answered with the tasks the first leased. (A lease request, unlike
//! a report, ends when its worker hangs up: a worker that stops must not be leased tasks.)
//!
//! A remembered answer is forgotten as soon as the worker shows it had it (it reports one of
//! the tasks handed with it), or else once their leases have run out; so the answers
//! remembered are about as many as the tasks workers run at once.
//!
//! Only this process remembers: a try that reaches another server over the same database,
//! or this one after a restart, is answered `stale_report` (a report) or leases afresh (a
//! lease request), as before, and tasks handed with the lost answer are retried once their
//! leases lapse.

use cairn_runtime::store::TaskId;
use cairn_runtime::Lease;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;

/// What became of a request (a lease's report, or a lease request), as tries sent again see it.
#[derive(Debug, Clone)]
enum Fate {
    /// The first try is being carried out.
    Pending,
    /// Done (recorded, or leased), handing these leases to the worker.
    Recorded(Vec<Lease>),
    /// The first try failed: nothing is known to be recorded; a try sent again goes on its own.
    Failed,
}

/// A request's entry: its fate, and until when it is kept once done (the last expiry of the
/// leases it handed out).
struct Entry {
    fate: watch::Receiver<Fate>,
    keep_until_ms: Option<u64>,
    /// Which entry of its key this is: a key's expired entry may be replaced before a sweep,
    /// and what refers to the old one must not touch the new.
    generation: u64,
}

/// A lease: its task and lease attempt.
type LeaseKey = (TaskId, u32);

fn key_of(lease: &Lease) -> LeaseKey {
    (lease.id.clone(), lease.lease_attempt)
}

/// What a request is known by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    /// The report of a lease.
    Report(LeaseKey),
    /// A lease request of a namespace's worker, by its `Idempotency-Key`.
    LeaseRequest {
        /// The namespace of the worker's token: workers of others cannot join it.
        namespace: String,
        /// The key the worker chose.
        key: String,
    },
}

/// The requests of this process that may be sent again; cheap to clone.
#[derive(Clone, Default)]
pub struct AnsweredAgain {
    known: Arc<Mutex<Known>>,
}

#[derive(Default)]
struct Known {
    /// The requests being carried out, and those remembered for the tasks they handed out.
    entries: HashMap<Key, Entry>,
    /// The request (and its entry's generation) that handed out each remembered task.
    handed_by: HashMap<LeaseKey, (Key, u64)>,
    /// The generation the next entry gets.
    next_generation: u64,
    /// When requests whose handed leases ran out are next looked for.
    next_sweep_ms: u64,
}

/// How often the remembered requests are swept for leases that ran out: each sweep goes
/// through all of them, so not on every request.
const SWEEP_EVERY_MS: u64 = 1_000;

/// What a try finds: the first (carry it out, then [`First::recorded`] or drop), or another
/// try's fate to wait for.
pub enum Joined {
    /// No try of this request is known: this one carries it out.
    First(First),
    /// A try of this request came first.
    Again(Earlier),
}

/// The try of a request that came first, as one sent again waits for it.
pub struct Earlier(watch::Receiver<Fate>);

/// The first try of a request: says what became of it. Dropped without
/// [`First::recorded`], it counts as failed.
pub struct First {
    answers: AnsweredAgain,
    key: Key,
    generation: u64,
    fate: Option<watch::Sender<Fate>>,
}

impl AnsweredAgain {
    fn lock(&self) -> MutexGuard<'_, Known> {
        // The maps hold no invariant a panic could break half way: keep using them.
        self.known
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The try of `lease`'s report arriving now, at `now_ms`: the first, or one sent again.
    pub fn join_report(&self, lease: &Lease, now_ms: u64) -> Joined {
        let mut known = self.lock();
        // A report of a task handed with an earlier answer: the worker had that answer.
        if let Some((origin, generation)) = known.handed_by.remove(&key_of(lease)) {
            known.remove(&origin, generation);
        }
        self.join(known, Key::Report(key_of(lease)), now_ms)
    }

    /// The try of a lease request of `namespace`'s worker under `key` arriving now, at
    /// `now_ms`: the first, or one sent again.
    pub fn join_lease_request(&self, namespace: &str, key: &str, now_ms: u64) -> Joined {
        let known = self.lock();
        let key = Key::LeaseRequest {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
        };
        self.join(known, key, now_ms)
    }

    fn join(&self, mut known: MutexGuard<'_, Known>, key: Key, now_ms: u64) -> Joined {
        if now_ms >= known.next_sweep_ms {
            known.sweep(now_ms);
        }
        if let Some(entry) = known.entries.get(&key) {
            let kept = entry.keep_until_ms.is_none_or(|until| until > now_ms);
            if kept && !matches!(*entry.fate.borrow(), Fate::Failed) {
                return Joined::Again(Earlier(entry.fate.clone()));
            }
        }
        let (sender, receiver) = watch::channel(Fate::Pending);
        let generation = known.next_generation;
        known.next_generation += 1;
        known.entries.insert(
            key.clone(),
            Entry {
                fate: receiver,
                keep_until_ms: None,
                generation,
            },
        );
        Joined::First(First {
            answers: self.clone(),
            key,
            generation,
            fate: Some(sender),
        })
    }

    /// How many requests and handed tasks are remembered (for tests).
    #[cfg(test)]
    fn len(&self) -> (usize, usize) {
        let known = self.lock();
        (known.entries.len(), known.handed_by.len())
    }
}

impl Known {
    /// Forgets the entry of `key` if it is still the one of `generation`.
    fn remove(&mut self, key: &Key, generation: u64) {
        if self
            .entries
            .get(key)
            .is_some_and(|entry| entry.generation == generation)
        {
            self.entries.remove(key);
        }
    }

    /// Forgets the requests whose handed leases have all run out, and the tasks they handed.
    fn sweep(&mut self, now_ms: u64) {
        self.next_sweep_ms = now_ms.saturating_add(SWEEP_EVERY_MS);
        self.entries
            .retain(|_, entry| entry.keep_until_ms.is_none_or(|until| until > now_ms));
        let entries = &self.entries;
        self.handed_by.retain(|_, (origin, generation)| {
            entries
                .get(origin)
                .is_some_and(|entry| entry.generation == *generation)
        });
    }
}

impl First {
    /// The request is carried out, handing `leases` to the worker: a try sent again is
    /// answered with them while they last. With none, there is nothing to answer again with:
    /// a report sent again finds itself recorded (`stale_report`), a lease request leases
    /// afresh.
    pub fn recorded(mut self, leases: Vec<Lease>) {
        let Some(fate) = self.fate.take() else { return };
        let mut known = self.answers.lock();
        match leases.iter().map(|lease| lease.expires_at_ms).max() {
            Some(until) => {
                if let Some(entry) = known.entries.get_mut(&self.key) {
                    if entry.generation == self.generation {
                        entry.keep_until_ms = Some(until);
                    }
                }
                for lease in &leases {
                    known
                        .handed_by
                        .insert(key_of(lease), (self.key.clone(), self.generation));
                }
            }
            None => known.remove(&self.key, self.generation),
        }
        fate.send_replace(Fate::Recorded(leases));
    }
}

impl Drop for First {
    fn drop(&mut self) {
        if let Some(fate) = self.fate.take() {
            self.answers.lock().remove(&self.key, self.generation);
            fate.send_replace(Fate::Failed);
        }
    }
}

impl Earlier {
    /// What became of it: `Some(leases)` once it was recorded (the leases it handed out,
    /// possibly none), `None` when it failed (the try sent again goes on its own).
    pub async fn outcome(self) -> Option<Vec<Lease>> {
        let mut fate = self.0;
        loop {
            match &*fate.borrow_and_update() {
                Fate::Pending => {}
                Fate::Recorded(leases) => return Some(leases.clone()),
                Fate::Failed => return None,
            }
            // The sender went without a word: the first try's task is gone.
            if fate.changed().await.is_err() {
                return match &*fate.borrow() {
                    Fate::Recorded(leases) => Some(leases.clone()),
                    _ => None,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_runtime::store::TaskKind;

    fn lease(seq: u64, attempt: u32, expires_at_ms: u64) -> Lease {
        Lease {
            id: TaskId {
                session_id: "s".into(),
                scheduled_seq: seq,
            },
            kind: TaskKind::Model,
            lease_attempt: attempt,
            expires_at_ms,
        }
    }

    #[tokio::test]
    async fn a_try_sent_again_gets_the_first_tries_leases_until_they_run_out() {
        let reports = AnsweredAgain::default();
        let reported = lease(2, 1, 1_000);
        let Joined::First(first) = reports.join_report(&reported, 0) else {
            panic!("the first try")
        };
        let Joined::Again(waiting) = reports.join_report(&reported, 1) else {
            panic!("a try while the first is recorded joins it")
        };
        let next = lease(5, 1, 60_000);
        first.recorded(vec![next.clone()]);
        assert_eq!(waiting.outcome().await, Some(vec![next.clone()]));
        let Joined::Again(later) = reports.join_report(&reported, 59_999) else {
            panic!("remembered while the handed lease lasts")
        };
        assert_eq!(later.outcome().await, Some(vec![next]));
        // Another lease attempt of the same task is another report.
        assert!(matches!(
            reports.join_report(&lease(2, 2, 1_000), 59_999),
            Joined::First(_)
        ));
        assert!(matches!(
            reports.join_report(&reported, 60_000),
            Joined::First(_)
        ));
    }

    #[tokio::test]
    async fn a_task_handed_by_an_expired_entry_leaves_its_replacement_alone() {
        let reports = AnsweredAgain::default();
        let reported = lease(2, 1, 1_000);
        let Joined::First(first) = reports.join_report(&reported, 0) else {
            panic!("the first try")
        };
        let handed = lease(5, 1, 500);
        first.recorded(vec![handed.clone()]);
        // Past the handed lease, before a sweep: a try of the report is a first again.
        let Joined::First(again) = reports.join_report(&reported, 600) else {
            panic!("an expired entry is not joined")
        };
        // The handed task's late report must not forget the new, pending entry.
        let Joined::First(late) = reports.join_report(&handed, 650) else {
            panic!("its own report")
        };
        drop(late);
        assert!(
            matches!(reports.join_report(&reported, 700), Joined::Again(_)),
            "the pending try is still joined"
        );
        again.recorded(Vec::new());
    }

    #[tokio::test]
    async fn a_report_of_a_handed_task_shows_the_worker_had_the_answer() {
        let reports = AnsweredAgain::default();
        let reported = lease(2, 1, 1_000);
        let Joined::First(first) = reports.join_report(&reported, 0) else {
            panic!("the first try")
        };
        let (model, tool) = (lease(5, 1, 60_000), lease(6, 1, 60_000));
        first.recorded(vec![model.clone(), tool]);
        assert_eq!(reports.len(), (1, 2));
        let Joined::First(next) = reports.join_report(&model, 10) else {
            panic!("the handed task's own report")
        };
        next.recorded(Vec::new());
        assert_eq!(reports.len().0, 0, "the first report is forgotten");
        assert!(matches!(
            reports.join_report(&reported, 20),
            Joined::First(_)
        ));
    }

    #[tokio::test]
    async fn a_lease_request_sent_again_under_its_key_gets_the_first_tries_leases() {
        let answers = AnsweredAgain::default();
        let Joined::First(first) = answers.join_lease_request("ns", "k1", 0) else {
            panic!("the first try")
        };
        let Joined::Again(waiting) = answers.join_lease_request("ns", "k1", 1) else {
            panic!("a try while the first leases joins it")
        };
        // Another namespace's worker with the same key is another request.
        assert!(matches!(
            answers.join_lease_request("other", "k1", 1),
            Joined::First(_)
        ));
        let handed = lease(5, 1, 30_000);
        first.recorded(vec![handed.clone()]);
        assert_eq!(waiting.outcome().await, Some(vec![handed.clone()]));
        let Joined::Again(later) = answers.join_lease_request("ns", "k1", 100) else {
            panic!("remembered while the lease lasts")
        };
        assert_eq!(later.outcome().await, Some(vec![handed.clone()]));
        // The worker reports the task: it had the answer, and the key is forgotten.
        let Joined::First(report) = answers.join_report(&handed, 200) else {
            panic!("the task's own report")
        };
        report.recorded(Vec::new());
        assert_eq!(answers.len(), (0, 0));
        let Joined::First(afresh) = answers.join_lease_request("ns", "k1", 300) else {
            panic!("forgotten")
        };
        // A first try that leased nothing leaves nothing to answer again with.
        afresh.recorded(Vec::new());
        assert!(matches!(
            answers.join_lease_request("ns", "k1", 400),
            Joined::First(_)
        ));
    }

    #[tokio::test]
    async fn a_failed_or_abandoned_first_try_leaves_the_next_one_to_record_it() {
        let reports = AnsweredAgain::default();
        let reported = lease(2, 1, 1_000);
        let Joined::First(first) = reports.join_report(&reported, 0) else {
            panic!("the first try")
        };
        let Joined::Again(waiting) = reports.join_report(&reported, 0) else {
            panic!("joins")
        };
        drop(first);
        assert_eq!(waiting.outcome().await, None);
        assert_eq!(reports.len(), (0, 0));
        let Joined::First(second) = reports.join_report(&reported, 0) else {
            panic!("the next try records it")
        };
        // Recorded with nothing handed out: nothing to remember.
        second.recorded(Vec::new());
        assert_eq!(reports.len(), (0, 0));
    }
}
