//! Failure bookkeeping per key: counts toward the threshold, and given-up keys that stay given up.
//!
//! The Go library's give-up leaks because every resync re-queues the key. Here a given-up key
//! is remembered with a fingerprint of the object's spec and stays given up until the spec
//! changes (or the process restarts); resyncs and unrelated updates do not revive it.

use std::collections::HashMap;

#[derive(Debug, Default, Clone, Copy)]
struct Entry {
    failures: u32,
    fingerprint: u64,
    given_up: bool,
}

/// Failure counts and given-up marks, keyed by claim UID or PV name.
#[derive(Debug, Default)]
pub struct FailureBook {
    entries: HashMap<String, Entry>,
}

impl FailureBook {
    fn entry(&mut self, key: &str, fingerprint: u64) -> &mut Entry {
        let entry = self.entries.entry(key.to_string()).or_default();
        if entry.fingerprint != fingerprint {
            // The spec changed: start afresh.
            *entry = Entry {
                fingerprint,
                ..Entry::default()
            };
        }
        entry
    }

    /// Records a failure and returns the count so far for this spec.
    pub fn record_failure(&mut self, key: &str, fingerprint: u64) -> u32 {
        let entry = self.entry(key, fingerprint);
        entry.failures += 1;
        entry.failures
    }

    /// Failures recorded for this key and spec (nothing is stored by asking).
    pub fn failures(&self, key: &str, fingerprint: u64) -> u32 {
        self.entries
            .get(key)
            .filter(|e| e.fingerprint == fingerprint)
            .map_or(0, |e| e.failures)
    }

    /// Marks the key given up for this spec.
    pub fn give_up(&mut self, key: &str, fingerprint: u64) {
        self.entry(key, fingerprint).given_up = true;
    }

    /// Whether the key is given up for this spec (nothing is stored by asking: every claim and
    /// PV of the cluster is asked about, most of them never ours).
    pub fn is_given_up(&self, key: &str, fingerprint: u64) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.fingerprint == fingerprint && e.given_up)
    }

    /// Keeps only the keys `alive` says still exist.
    pub fn retain(&mut self, alive: impl Fn(&str) -> bool) {
        self.entries.retain(|key, _| alive(key));
    }

    /// Forgets the key (success, or the object is gone).
    pub fn forget(&mut self, key: &str) {
        self.entries.remove(key);
    }

    /// Keys currently tracked.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A stable fingerprint of a serialisable value (the object's spec).
pub fn fingerprint<T: serde::Serialize>(value: &T) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(value)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_reset_when_the_spec_changes() {
        let mut book = FailureBook::default();
        assert_eq!(book.record_failure("k", 1), 1);
        assert_eq!(book.record_failure("k", 1), 2);
        assert_eq!(book.record_failure("k", 2), 1);
        assert_eq!(book.failures("k", 2), 1);
    }

    #[test]
    fn given_up_survives_repeated_checks_until_spec_changes() {
        let mut book = FailureBook::default();
        book.record_failure("k", 7);
        book.give_up("k", 7);
        for _ in 0..3 {
            assert!(book.is_given_up("k", 7), "a resync must not revive it");
        }
        assert!(!book.is_given_up("k", 8), "a new spec retries");
        assert_eq!(book.record_failure("k", 8), 1, "and counts afresh");
        assert!(!book.is_given_up("k", 7), "the old give-up is gone with it");
    }

    #[test]
    fn asking_about_objects_stores_nothing_and_retain_drops_the_gone() {
        let mut book = FailureBook::default();
        for n in 0..10_000 {
            let key = format!("foreign-{n}");
            assert!(!book.is_given_up(&key, 1));
            assert_eq!(book.failures(&key, 1), 0);
        }
        assert!(
            book.is_empty(),
            "{} entries for objects that never failed",
            book.len()
        );
        book.record_failure("mine", 1);
        book.record_failure("gone", 1);
        book.retain(|key| key == "mine");
        assert_eq!(book.len(), 1);
        assert_eq!(book.failures("mine", 1), 1);
    }

    #[test]
    fn forget_clears() {
        let mut book = FailureBook::default();
        book.record_failure("k", 1);
        book.forget("k");
        assert!(book.is_empty() || book.failures("k", 1) == 0);
    }

    #[test]
    fn fingerprint_is_stable_and_sensitive() {
        assert_eq!(fingerprint(&("a", 1)), fingerprint(&("a", 1)));
        assert_ne!(fingerprint(&("a", 1)), fingerprint(&("a", 2)));
    }
}
