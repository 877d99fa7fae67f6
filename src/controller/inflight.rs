//! Claims in flight per StorageClass, capped by the class's own annotation
//! ([`super::plan::ANN_MAX_IN_FLIGHT`]), so one class's storm of claims cannot hold every worker
//! and guest slot while the claims of other classes wait; and retries in flight, capped below
//! the worker count, so that claims whose guest keeps failing never hold every worker.
//!
//! Why the retry cap: once every worker is busy, kube-runtime's runner moves each due object into
//! a set it serves in hash order, not in time order (`Scheduler::hold`). Thousands of claims
//! retrying faster than the workers can attempt them keep every worker busy for good, and a claim
//! of another class whose place in that order is late waits for as long as the storm lasts
//! (measured: > 60 s behind 5,000 with 2 s retries). With a worker always left over, a retry that
//! finds the cap reached goes back to wait without a guest call or a write (microseconds), so
//! the leftover worker runs through the due objects at once and reaches the other claims.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::storage::v1::StorageClass;

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

/// Attempts of claims that wait for a retry (their last attempt failed), in flight at once.
#[derive(Debug)]
pub struct Retries {
    running: Mutex<usize>,
    limit: usize,
}

/// One retry's place, given back when dropped.
#[derive(Debug)]
pub struct RetrySlot<'a>(&'a Retries);

impl Retries {
    /// At most one less than `workers` retries at once (one with a single worker).
    pub fn new(workers: u16) -> Retries {
        Retries {
            running: Mutex::new(0),
            limit: usize::from(workers).saturating_sub(1).max(1),
        }
    }

    /// Takes a place for one retry, unless the retries already in flight are at the limit.
    pub fn try_acquire(&self) -> Option<RetrySlot<'_>> {
        let mut running = self.running.lock().expect("lock");
        if *running >= self.limit {
            return None;
        }
        *running += 1;
        Some(RetrySlot(self))
    }

    /// Retries in flight.
    pub fn running(&self) -> usize {
        *self.running.lock().expect("lock")
    }

    /// How many retries may be in flight at once.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl Drop for RetrySlot<'_> {
    fn drop(&mut self) {
        *self.0.running.lock().expect("lock") -= 1;
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
    fn retries_leave_a_worker_over() {
        let retries = Retries::new(4);
        let held: Vec<_> = (0..3)
            .map(|_| retries.try_acquire().expect("place"))
            .collect();
        assert!(
            retries.try_acquire().is_none(),
            "the fourth worker stays free"
        );
        assert_eq!(retries.running(), 3);
        drop(held);
        assert_eq!(retries.running(), 0);
        assert_eq!(Retries::new(1).limit(), 1, "a single worker still retries");
        assert_eq!(Retries::new(0).limit(), 1);
    }
}
