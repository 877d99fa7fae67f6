//! Turns: the claim attempts that may be in flight at once, always fewer than the reconcile
//! workers over every class together, a few per call slot of each guest over every class it
//! serves ([`guest_turns`]; the calls themselves wait for the guest's claim slots),
//! and no more than a class's own annotation ([`super::plan::ANN_MAX_IN_FLIGHT`]); over that, a
//! claim is parked in its class's queue, and freed turns go round the classes with claims parked.
//!
//! Why: once every worker is busy, kube-runtime's runner moves each due object into a set it
//! serves in hash order, not in time order (`Scheduler::hold`). A burst of thousands of claims
//! (new ones, or retries of a guest that keeps failing) that kept every worker busy held a claim
//! whose place in that order is late for as long as it lasted: another class's claim had its PV
//! 65.3 s after it behind one class's 5,000 first attempts; with a limit per class and none
//! shared, two classes of 2,500 held every worker between them, and 158 of their own claims were
//! not attempted once within 300 s. Parked, a claim costs nothing (no request, guest call or
//! requeue) and leaves kube-runtime's queue, which then holds only new work and the woken, and
//! a worker is always left for it. Freed turns go round the classes, so a class with one claim
//! waits behind at most one claim of each other class, never behind a crowd; within a class,
//! first come, first served. A guest's last slot is never a claim's: deletes find it free, and
//! claims over the guest's turns park instead of finding it busy and going back to
//! kube-runtime's queue on a timer.

mod state;
#[cfg(test)]
mod tests;

use std::sync::Mutex;
use std::time::Duration;

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use k8s_openapi::api::storage::v1::StorageClass;

use super::plan::class_limit;
use state::{ClaimRef, Limits, State};

/// Claim attempts in flight, and the claims parked for a turn: the bookkeeping behind one lock, and
/// the channel its wakeups go out on.
#[derive(Debug)]
pub struct Turns {
    state: Mutex<State>,
    wake: UnboundedSender<ClaimRef>,
    wakeups: Mutex<Option<UnboundedReceiver<ClaimRef>>>,
}

/// One attempt's turn, given back when dropped (waking the next parked claim).
#[derive(Debug)]
pub struct Turn<'a> {
    turns: &'a Turns,
    class: String,
    guest: String,
}

impl Turns {
    /// Turns for a controller with `workers` reconcile workers.
    pub fn new(workers: u16) -> Turns {
        let (wake, wakeups) = unbounded();
        let ceiling = usize::from(workers).saturating_sub(1).max(1);
        Turns {
            state: Mutex::new(State::new(ceiling)),
            wake,
            wakeups: Mutex::new(Some(wakeups)),
        }
    }

    /// How many attempts of `class` may be in flight at once: one less than the workers (at
    /// least one), and no more than the class's annotation.
    pub fn limit(&self, class: &StorageClass) -> usize {
        share(class, self.lock().ceiling)
    }

    /// Takes a turn for `claim` of `class`, served by `guest` with `guest_slots` calls at once,
    /// or parks it (once) to be woken through [`Turns::wakeups`] when a turn is its.
    ///
    /// First come, first served within a class: a claim that comes on its own (a retry come
    /// due, a change) neither takes the turn kept for a woken claim nor passes the claims parked
    /// before it. Otherwise retries coming due, each taking the turn freed a moment before, kept
    /// the claims parked longest waiting for minutes.
    pub fn acquire_or_park(
        &self,
        class: &StorageClass,
        guest: &str,
        guest_slots: usize,
        claim: ClaimRef,
    ) -> Option<Turn<'_>> {
        let name = class.metadata.name.clone().unwrap_or_default();
        // One lock for the counts and the queues: a turn freed between a refusal and the
        // parking would otherwise find nobody to wake.
        let mut state = self.lock();
        let limits = Limits {
            class: share(class, state.ceiling),
            guest,
            guest_limit: guest_turns(guest_slots),
        };
        let took = state.acquire(&name, limits, claim);
        // Parked, the claim may have freed a kept turn (limits lowered since it was woken); with
        // a turn, it may have taken one on another guest (a plugin reload), freeing the old
        // guest's slot. Whoever waits for those goes now, not at a refresh.
        self.wake_all(state.fill());
        took.then(|| Turn {
            turns: self,
            class: name,
            guest: guest.to_owned(),
        })
    }

    /// Lets go of whatever `claim` of `class` holds in the queue (its place, or the turn kept
    /// for it): it needs no turn now (bound, deleted, not ours), and the next one gets it at once.
    pub fn pass(&self, class: &str, claim: &ClaimRef) {
        let mut state = self.lock();
        if state.pass(class, claim) {
            self.wake_all(state.fill());
        }
    }

    /// The parked claims to reconcile, one each time a turn is theirs; for the claim
    /// controller's `reconcile_on`. Empty after the first call.
    pub fn wakeups(&self) -> UnboundedReceiver<ClaimRef> {
        self.wakeups
            .lock()
            .expect("lock")
            .take()
            .unwrap_or_else(|| unbounded().1)
    }

    /// Forgets claims that `belongs` says are no longer of the class they wait in (deleted, not
    /// ours, or of another class now), and wakes parked claims for the turns that frees. A
    /// claim woken longer than `kept_for` ago and not back (its wakeup waits behind others in
    /// kube-runtime's queue, or its reconcile stopped before taking the turn) is woken again,
    /// its turn still kept. Run every few seconds, this bounds how long a turn can stay kept for
    /// a claim that will never take it.
    pub fn refresh(&self, belongs: impl Fn(&str, &ClaimRef) -> bool, kept_for: Duration) {
        let mut state = self.lock();
        let again = state.refresh(belongs, kept_for);
        self.wake_all(again);
        self.wake_all(state.fill());
    }

    /// Attempts of `class` in flight.
    pub fn running(&self, class: &str) -> usize {
        self.lock().running(class)
    }

    /// Up to `count` claims whose turns are likely to come next, in that order (woken ones
    /// first, then the parked round the classes): the intent log records them with the write
    /// one of them needs anyway, so that their own turns need none.
    pub fn next_up(&self, count: usize) -> Vec<ClaimRef> {
        self.lock().next_up(count)
    }

    /// Claims parked, over every class.
    pub fn parked(&self) -> usize {
        self.lock().parked()
    }

    /// Classes with attempts in flight or claims parked or woken.
    pub fn classes(&self) -> usize {
        self.lock().classes()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("turns lock")
    }

    fn wake_all(&self, claims: Vec<ClaimRef>) {
        for claim in claims {
            // The receiver is gone only at shutdown.
            let _ = self.wake.unbounded_send(claim);
        }
    }
}

/// Turns a claim of a guest with `guest_slots` calls at once may hold together, over every class
/// it serves: [`TURNS_PER_CLAIM_SLOT`] for each call a claim may make at once
/// ([`crate::wasm::claim_slots`]). A turn spends most of its time on API round trips (the
/// intent write, the PV create), not in the guest (a hostpath call takes about 0.1 ms,
/// docs/benchmarks.md §2): with turns bound to the slots, 20 ms from the API server, 4 workers
/// and 16 made the same 14 PVs/s. So a guest's slots bound the calls, and its turns only how
/// much of the ceiling one guest may hold: a slow guest's claims wait for its slots holding at
/// most this many turns, the other guests keeping the rest.
pub fn guest_turns(guest_slots: usize) -> usize {
    crate::wasm::claim_slots(guest_slots) * TURNS_PER_CLAIM_SLOT
}

/// See [`guest_turns`].
const TURNS_PER_CLAIM_SLOT: usize = 8;

/// A class's limit under `ceiling`: its annotation, when that is lower.
fn share(class: &StorageClass, ceiling: usize) -> usize {
    class_limit(class).map_or(ceiling, |annotated| annotated.min(ceiling))
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut state = self.turns.lock();
        state.finish(&self.class, &self.guest);
        self.turns.wake_all(state.fill());
    }
}
