//! The intent log's in-memory book: the entries the next write holds, their bounds in bytes,
//! and what this process knows of each (recorded ahead, worked on now, outcome unknown). Plain
//! data under the log's lock; the writer and the stored ConfigMaps read and settle it.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::IntentError;
use super::entry::{Intent, MAX_ENTRY_BYTES, MAX_LOG_BYTES};

/// Entries written as called ahead of their turn ([`LogState::put_soon`]) at most at once.
pub(super) const SOON_WHILE_BELOW: usize = 64;

#[derive(Default)]
pub(super) struct LogState {
    /// Key (claim or PV UID) -> stored text: what the next write holds.
    pub(super) entries: BTreeMap<String, String>,
    /// Bytes of keys and texts in `entries`.
    pub(super) bytes: usize,
    /// Bumped by every change that must be durable; `flushed` is what the last write covered.
    pub(super) generation: u64,
    pub(super) flushed: u64,
    /// Removals not yet written.
    pub(super) removals: bool,
    /// Updates not yet written that nobody waits for (they ride on the next write).
    pub(super) lazy: bool,
    /// Key -> the generation that last changed it (durable once `flushed` reaches it).
    pub(super) entry_generation: HashMap<String, u64>,
    /// Keys a reconcile of this process is working on now: it sees to them itself.
    pub(super) fresh: HashSet<String>,
    /// Keys recorded ahead whose own turn has not come yet.
    pub(super) ahead: HashSet<String>,
    /// Keys written as called because their turn was next in line ([`LogState::put_soon`]),
    /// whose own turn has not come yet: bounded by [`SOON_WHILE_BELOW`].
    pub(super) soon: HashSet<String>,
    /// Keys whose outcome this process does not know: taken from a stored log (an earlier
    /// process, another replica), or whose last guest call ended without an answer (a fault, a
    /// timeout, a build going on in the background).
    pub(super) unknown: HashSet<String>,
    /// The keys our last successful write stored: one of them missing from the stored log later
    /// was removed by someone else (`forget-storage`), not yet to be written.
    pub(super) written: HashSet<String>,
    /// Our last write's resourceVersion (None: not written by this process yet).
    pub(super) version: Option<String>,
    /// The last write's error, for records waiting on it.
    pub(super) error: Option<IntentError>,
}

impl LogState {
    /// Puts `text` under `key` if it fits the entry and log bounds.
    pub(super) fn put(
        &mut self,
        key: &str,
        intent: &Intent,
        generation: u64,
    ) -> Result<(), IntentError> {
        let text = intent.to_text();
        self.bytes = self.bytes_with(key, &text, intent)?;
        self.entries.insert(key.to_string(), text);
        self.entry_generation.insert(key.to_string(), generation);
        Ok(())
    }

    /// The log's bytes once `text` is stored under `key`, if that fits the entry and log bounds.
    pub(super) fn bytes_with(
        &self,
        key: &str,
        text: &str,
        intent: &Intent,
    ) -> Result<usize, IntentError> {
        let size = key.len() + text.len();
        if size > MAX_ENTRY_BYTES {
            return Err(IntentError::TooLarge {
                pv: intent.pv().to_string(),
                bytes: size,
                limit: MAX_ENTRY_BYTES,
            });
        }
        let replaced = self.entries.get(key).map_or(0, |old| key.len() + old.len());
        let bytes = self.bytes - replaced + size;
        if bytes > MAX_LOG_BYTES {
            return Err(IntentError::Full {
                pv: intent.pv().to_string(),
                limit: MAX_LOG_BYTES,
            });
        }
        Ok(bytes)
    }

    /// Records `intent` ahead of its turn under `key` unless an entry is there already. Ahead is
    /// a saving, not a need: what does not fit waits its turn.
    pub(super) fn put_ahead(&mut self, key: String, intent: &Intent, generation: u64) {
        let intent = intent.clone().marked_ahead(true);
        if !self.entries.contains_key(&key) && self.put(&key, &intent, generation).is_ok() {
            self.ahead.insert(key);
        }
    }

    /// Records `intent` as called under `key`, ahead of a turn that is next in line: the write
    /// that some other claim's turn makes anyway carries it, and this claim's own turn then
    /// needs no write of its own. Nothing is written for a key already held as called, and
    /// nothing once [`SOON_WHILE_BELOW`] such keys wait for their turns: a guess that keeps
    /// missing (limits lowered, claims gone) costs at most that many entries that say "called"
    /// of a claim whose guest was not. Like ahead, a saving: what does not fit waits its turn.
    pub(super) fn put_soon(&mut self, key: String, intent: &Intent, generation: u64) {
        if self.soon.len() >= SOON_WHILE_BELOW {
            return;
        }
        let held_ahead = self.ahead.contains(&key);
        if self.entries.contains_key(&key) && !held_ahead {
            return;
        }
        let called = intent.clone().marked_ahead(false);
        if self.put(&key, &called, generation).is_ok() {
            self.ahead.remove(&key);
            self.soon.insert(key);
        }
    }

    /// Whether the entry under `key` is written, not marked ahead: its guest may be called
    /// without another write.
    pub(super) fn called_and_durable(&self, key: &str) -> bool {
        let durable = self
            .entry_generation
            .get(key)
            .is_some_and(|generation| *generation <= self.flushed);
        durable && self.intent(key).is_some_and(|held| !held.is_ahead())
    }

    /// Forgets entries someone else removed from the stored log (the caller replaces
    /// `written` with what the write stored).
    pub(super) fn forget_removed(&mut self, removed: &[String]) {
        for key in removed {
            self.fresh.remove(key);
            if self.remove(key) {
                tracing::info!(%key, "intent-log entry removed by someone else (forget-storage); forgotten here too");
            }
        }
    }

    /// The entry held under `key`, read back.
    pub(super) fn intent(&self, key: &str) -> Option<Intent> {
        serde_json::from_str(self.entries.get(key)?).ok()
    }

    /// Forgets an entry and that a reconcile works on it.
    pub(super) fn forget(&mut self, key: &str) {
        self.fresh.remove(key);
        self.remove(key);
    }

    pub(super) fn remove(&mut self, key: &str) -> bool {
        self.entry_generation.remove(key);
        self.ahead.remove(key);
        self.soon.remove(key);
        self.unknown.remove(key);
        match self.entries.remove(key) {
            Some(text) => {
                self.bytes -= key.len() + text.len();
                self.removals = true;
                true
            }
            None => false,
        }
    }

    /// A change to be written: its generation.
    pub(super) fn bump(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_refuses_an_entry_too_large_and_one_that_does_not_fit_alone() {
        let mut state = LogState::default();
        let mut big = Intent::claim("p", "pvc-big", "n", "c");
        if let Intent::Claim(claim) = &mut big {
            claim.retries.error = Some("x".repeat(MAX_ENTRY_BYTES));
        }
        assert!(matches!(
            state.put("big", &big, 1),
            Err(IntentError::TooLarge { .. })
        ));
        let small = Intent::claim("p", "pvc-u", "n", &"c".repeat(200));
        let mut n = 0;
        while state.put(&format!("uid-{n}"), &small, 1).is_ok() {
            n += 1;
        }
        assert!(state.bytes <= MAX_LOG_BYTES);
        assert!(n > 1000, "a log holds over a thousand claims ({n})");
        assert!(matches!(
            state.put("one-more", &small, 1),
            Err(IntentError::Full { .. })
        ));
        // Leaving makes room again, and replacing an entry counts only the difference.
        assert!(state.remove("uid-0"));
        state.put("one-more", &small, 1).unwrap();
        state.put("one-more", &small, 2).unwrap();
        let expected: usize = state.entries.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert_eq!(state.bytes, expected);
    }
}
