//! Claims in flight per StorageClass, capped by the class's own annotation
//! ([`super::plan::ANN_MAX_IN_FLIGHT`]), so one class's storm of claims cannot hold every worker
//! and guest slot while the claims of other classes wait; and retries in flight, capped below
//! the worker count, so that claims whose guest keeps failing never hold every worker.
//!
//! Why the retry cap: once every worker is busy, kube-runtime's runner moves each due object into
//! a set it serves in hash order, not in time order (`Scheduler::hold`). Thousands of claims
//! retrying faster than the workers can attempt them keep every worker busy for good, and a claim
//! of another class whose place in that order is late waits for as long as the storm lasts
//! (measured: > 60 s behind 5,000 with 2 s retries). With a worker always left over, and a retry
//! that finds the cap reached parked (no guest call, no write, no requeue) until a retry in
//! flight ends, the scheduler holds only new work and the retries in flight, and the leftover
//! worker reaches the other claims at once.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::reflector::ObjectRef;

use super::plan::class_limit;

/// Guest calls running per class name.
#[derive(Debug, Default)]
pub struct InFlight(Mutex<HashMap<String, usize>>);

/// One claim's place in its class's count, given back when dropped.
#[derive(Debug)]
pub struct Slot<'a> {
    counts: &'a InFlight,
    class: Option<String>,
}

impl InFlight {
    /// Whether `class` has as many claims in flight as its annotation allows.
    pub fn at_limit(&self, class: &StorageClass) -> bool {
        class_limit(class).is_some_and(|limit| self.running(class) >= limit)
    }

    /// Takes a place for one claim of `class`, unless it is at its limit. A class without a
    /// limit always gets one (uncounted).
    pub fn try_acquire(&self, class: &StorageClass) -> Option<Slot<'_>> {
        let Some(limit) = class_limit(class) else {
            return Some(Slot {
                counts: self,
                class: None,
            });
        };
        let name = class.metadata.name.clone().unwrap_or_default();
        let mut counts = self.0.lock().expect("lock");
        let running = counts.entry(name.clone()).or_default();
        if *running >= limit {
            return None;
        }
        *running += 1;
        Some(Slot {
            counts: self,
            class: Some(name),
        })
    }

    /// Claims of `class` in flight.
    pub fn running(&self, class: &StorageClass) -> usize {
        let name = class.metadata.name.as_deref().unwrap_or_default();
        self.0.lock().expect("lock").get(name).copied().unwrap_or(0)
    }

    /// Classes with claims in flight (entries are dropped at zero).
    pub fn len(&self) -> usize {
        self.0.lock().expect("lock").len()
    }

    /// Whether no class has a claim in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let Some(class) = &self.class else { return };
        let mut counts = self.counts.0.lock().expect("lock");
        if let Some(running) = counts.get_mut(class) {
            *running -= 1;
            if *running == 0 {
                counts.remove(class);
            }
        }
    }
}

/// Attempts of claims that wait for a retry (their last attempt failed), in flight at once; and
/// the retries that found the limit reached, parked in arrival order until a place frees.
///
/// Parked, not requeued: a retry requeued on its backoff comes back due, and thousands of them
/// keep kube-runtime's scheduler so full of due objects that its leftover worker never reaches
/// another class's new claim when the process is short of CPU (measured: not reconciled within
/// 60 s behind 5,000 with 2 s retries, with a build on both cores). Parked, a retry costs nothing
/// until a place frees, and the scheduler holds only new work and the retries in flight.
#[derive(Debug)]
pub struct Retries {
    state: Mutex<RetryState>,
    limit: usize,
    wake: UnboundedSender<ObjectRef<PersistentVolumeClaim>>,
    wakeups: Mutex<Option<UnboundedReceiver<ObjectRef<PersistentVolumeClaim>>>>,
}

#[derive(Debug, Default)]
struct RetryState {
    running: usize,
    parked: VecDeque<ObjectRef<PersistentVolumeClaim>>,
    is_parked: HashSet<ObjectRef<PersistentVolumeClaim>>,
}

/// One retry's place, given back when dropped (waking the longest parked retry).
#[derive(Debug)]
pub struct RetrySlot<'a>(&'a Retries);

impl Retries {
    /// At most one less than `workers` retries at once (one with a single worker).
    pub fn new(workers: u16) -> Retries {
        let (wake, wakeups) = unbounded();
        Retries {
            state: Mutex::default(),
            limit: usize::from(workers).saturating_sub(1).max(1),
            wake,
            wakeups: Mutex::new(Some(wakeups)),
        }
    }

    /// Takes a place for `claim`'s retry; when the retries in flight are at the limit, parks
    /// `claim` (once) to be woken through [`Retries::wakeups`] when a place frees.
    pub fn acquire_or_park(
        &self,
        claim: ObjectRef<PersistentVolumeClaim>,
    ) -> Option<RetrySlot<'_>> {
        // One lock for the count and the queue: a place freed between a refusal and the parking
        // would otherwise find nobody to wake.
        let mut state = self.state.lock().expect("lock");
        if state.running >= self.limit {
            if state.is_parked.insert(claim.clone()) {
                state.parked.push_back(claim);
            }
            return None;
        }
        state.running += 1;
        Some(RetrySlot(self))
    }

    /// The parked retries to reconcile, one each time a place frees; for the claim controller's
    /// `reconcile_on`. Empty after the first call.
    pub fn wakeups(&self) -> UnboundedReceiver<ObjectRef<PersistentVolumeClaim>> {
        self.wakeups
            .lock()
            .expect("lock")
            .take()
            .unwrap_or_else(|| unbounded().1)
    }

    /// Forgets parked claims that `exists` says are gone, and wakes parked claims for places
    /// that are free. A woken claim may not take the place it was woken for (deleted, bound or
    /// no longer failing meanwhile), and nothing else would wake the others until a retry in
    /// flight ends; run periodically, this bounds such a stall.
    pub fn refresh(&self, exists: impl Fn(&ObjectRef<PersistentVolumeClaim>) -> bool) {
        let mut state = self.state.lock().expect("lock");
        let RetryState {
            running,
            parked,
            is_parked,
        } = &mut *state;
        parked.retain(|claim| exists(claim) || !is_parked.remove(claim));
        for _ in 0..self.limit.saturating_sub(*running) {
            let Some(claim) = parked.pop_front() else {
                break;
            };
            is_parked.remove(&claim);
            let _ = self.wake.unbounded_send(claim);
        }
    }

    /// Retries in flight.
    pub fn running(&self) -> usize {
        self.state.lock().expect("lock").running
    }

    /// Retries parked.
    pub fn parked(&self) -> usize {
        self.state.lock().expect("lock").parked.len()
    }

    /// How many retries may be in flight at once.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl Drop for RetrySlot<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().expect("lock");
        state.running -= 1;
        if let Some(claim) = state.parked.pop_front() {
            state.is_parked.remove(&claim);
            // The receiver is gone only at shutdown.
            let _ = self.0.wake.unbounded_send(claim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::plan::ANN_MAX_IN_FLIGHT;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn class(name: &str, limit: Option<&str>) -> StorageClass {
        StorageClass {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: limit.map(|l| [(ANN_MAX_IN_FLIGHT.to_string(), l.to_string())].into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_class_limit_caps_its_own_claims_only() {
        let counts = InFlight::default();
        let storm = class("storm", Some("2"));
        let quiet = class("quiet", None);
        let a = counts.try_acquire(&storm).expect("first");
        let b = counts.try_acquire(&storm).expect("second");
        assert!(counts.at_limit(&storm));
        assert!(
            counts.try_acquire(&storm).is_none(),
            "third of a limit of 2"
        );
        let unlimited: Vec<_> = (0..10).map(|_| counts.try_acquire(&quiet)).collect();
        assert!(
            unlimited.iter().all(Option::is_some),
            "other classes are not held up"
        );
        drop(a);
        assert!(!counts.at_limit(&storm));
        let c = counts.try_acquire(&storm).expect("a freed place");
        drop((b, c));
        assert!(counts.is_empty(), "counts are dropped at zero");
    }

    #[test]
    fn retries_leave_a_worker_over_and_park_in_order() {
        use futures::StreamExt;
        let claim = |name: &str| ObjectRef::<PersistentVolumeClaim>::new(name).within("ns");
        let retries = Retries::new(4);
        let mut wakeups = retries.wakeups();
        let mut held: Vec<_> = (0..3)
            .map(|n| {
                retries
                    .acquire_or_park(claim(&format!("held-{n}")))
                    .expect("place")
            })
            .collect();
        assert!(
            retries.acquire_or_park(claim("a")).is_none(),
            "the fourth worker stays free"
        );
        assert!(retries.acquire_or_park(claim("b")).is_none());
        assert!(retries.acquire_or_park(claim("a")).is_none(), "parked once");
        assert!(retries.acquire_or_park(claim("gone")).is_none());
        assert_eq!((retries.running(), retries.parked()), (3, 3));
        retries.refresh(|c| c.name != "gone");
        assert_eq!(retries.parked(), 2, "no place free: nobody woken");
        held.pop();
        held.pop();
        held.pop();
        assert_eq!(retries.running(), 0);
        let woken: Vec<_> = futures::executor::block_on(wakeups.by_ref().take(2).collect());
        assert_eq!(woken, [claim("a"), claim("b")], "longest parked first");
        assert_eq!(retries.parked(), 0);
        assert!(
            wakeups.try_recv().is_err(),
            "the third free place found nobody parked"
        );
        assert_eq!(Retries::new(1).limit(), 1, "a single worker still retries");
        assert_eq!(Retries::new(0).limit(), 1);
    }

    #[test]
    fn a_refresh_wakes_parked_claims_for_places_nobody_took() {
        let claim = |name: &str| ObjectRef::<PersistentVolumeClaim>::new(name).within("ns");
        let retries = Retries::new(2);
        let mut wakeups = retries.wakeups();
        let held = retries.acquire_or_park(claim("held")).expect("place");
        for name in ["a", "b"] {
            assert!(retries.acquire_or_park(claim(name)).is_none());
        }
        drop(held);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("a")));
        // `a` was deleted meanwhile and never takes its place: `b` waits though a place is free.
        assert_eq!((retries.running(), retries.parked()), (0, 1));
        retries.refresh(|_| true);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("b")));
        assert_eq!(retries.parked(), 0);
    }
}
