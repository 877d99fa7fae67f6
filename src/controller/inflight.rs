//! Claims in flight per StorageClass, capped by the class's own annotation
//! ([`super::plan::ANN_MAX_IN_FLIGHT`]), so one class's storm of claims cannot hold every worker
//! and guest slot while the claims of other classes wait.

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
}
