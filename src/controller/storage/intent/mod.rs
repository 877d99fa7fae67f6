//! The intent log: one ConfigMap per replica listing the storage it may be about to leave without
//! an object naming it. Two kinds of entries ([`entry`]): a claim whose guest it calls, and a
//! Released PV it deletes ahead of its storage. Each says what deleting storage needs only once
//! that storage is known to be ours to delete: what the guest returned for the claim, or the PV
//! our own DELETE (UID and resourceVersion as preconditions) removed. Entries recorded ahead,
//! or left by a process that stopped before it knew, delete nothing (`recovery.rs`).
//!
//! It is written in batches: all entries waiting at one moment share one write, and finished
//! entries leave with the next write. That is the leak protection of the claim finalizer at
//! about one write per claim on the API budget (the PV create) instead of three. The log is
//! bounded in bytes: an entry that does not fit fails its own claim or volume, never the log.
//!
//! This module is the log's face (what a reconcile or recovery asks of it); its parts are the
//! in-memory book of entries (`book`), the batching writer (`writer`), the stored ConfigMaps
//! (`stored`: the start check, taking over stopped replicas' logs, names) and the clean stop
//! (`close`).

mod book;
mod close;
pub mod entry;
mod stored;
mod writer;

use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};

use book::LogState;
pub use close::Closed;
pub use entry::{ClaimIntent, Intent, Retries, Storage, VolumeIntent};
pub use stored::{LOG_LABEL, log_name};

use crate::controller::ratelimit::RateLimiter;

/// Why an intent could not be recorded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum IntentError {
    /// The API server refused or failed the write.
    #[error("recording the intent log {log}: {message}")]
    Write {
        /// The ConfigMap.
        log: String,
        /// The API error.
        message: String,
    },
    /// This one entry is larger than an entry may be.
    #[error(
        "the intent record for {pv} takes {bytes} bytes, more than the {limit} an entry may take"
    )]
    TooLarge {
        /// The PV it is about.
        pv: String,
        /// Its size.
        bytes: usize,
        /// [`entry::MAX_ENTRY_BYTES`].
        limit: usize,
    },
    /// The log holds as much as it may; this entry waits until others leave.
    #[error("the intent log is full ({limit} bytes); {pv} waits until other entries leave")]
    Full {
        /// The PV it is about.
        pv: String,
        /// [`entry::MAX_LOG_BYTES`].
        limit: usize,
    },
    /// The writer task is gone (the process is stopping).
    #[error("the intent writer stopped")]
    Stopped,
    /// Someone else wrote the log since our last write (`forget-storage`): it is read back and
    /// written again at once; never reported to a record.
    #[error("the intent log {log} was changed by someone else")]
    Changed {
        /// The ConfigMap.
        log: String,
    },
}

/// The claims queued behind the one whose intent is recorded, riding on its write.
#[derive(Debug, Default)]
pub struct Behind {
    /// Next in line (their turns come within about one write): written as called.
    pub soon: Vec<(String, Intent)>,
    /// Further back: written marked as recorded ahead.
    pub ahead: Vec<(String, Intent)>,
}

/// This replica's intent log.
pub struct IntentLog {
    api: Api<ConfigMap>,
    name: String,
    group: String,
    budget: Arc<RateLimiter>,
    state: Mutex<LogState>,
    wake: tokio::sync::Notify,
    written: tokio::sync::watch::Sender<u64>,
}

impl IntentLog {
    /// The log of replica `identity` of the deployment whose lease is `group`, in `namespace`.
    pub fn new(
        client: Client,
        namespace: &str,
        group: &str,
        identity: &str,
        budget: Arc<RateLimiter>,
    ) -> IntentLog {
        IntentLog {
            api: Api::namespaced(client, namespace),
            name: log_name(group, identity),
            group: group.to_string(),
            budget,
            state: Mutex::new(LogState::default()),
            wake: tokio::sync::Notify::new(),
            written: tokio::sync::watch::channel(0).0,
        }
    }

    /// This log's ConfigMap name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.state.lock().expect("intent log lock")
    }

    /// Records an intent durably: returns once a write holding it has succeeded. `behind` are
    /// the claims queued behind this one, riding on the same write: those next in line written
    /// as called (`behind.soon`: their own turns then need no write, see
    /// [`book::LogState::put_soon`]), the rest marked as recorded ahead (their guest not called);
    /// one that does not fit is left out. An entry recorded ahead loses that mark when its own
    /// turn comes, in a write that succeeds before this returns (before its guest is called): a
    /// stored entry marked ahead is one whose guest was never called, whenever the process
    /// stops. Any other intent already written returns at once. An entry that does not fit
    /// fails alone.
    pub async fn record(
        &self,
        key: &str,
        intent: &Intent,
        behind: Behind,
    ) -> Result<(), IntentError> {
        let generation = {
            let mut state = self.state();
            state.fresh.insert(key.to_string());
            state.ahead.remove(key);
            state.soon.remove(key);
            if state.called_and_durable(key) {
                return Ok(());
            }
            let held_ahead = state.intent(key).filter(Intent::is_ahead);
            let pending = state.entry_generation.get(key).copied();
            match (held_ahead, pending) {
                // Held already and on its way: the next write carries it.
                (None, Some(generation)) => generation,
                (held_ahead, _) => {
                    let entry =
                        held_ahead.map_or_else(|| intent.clone(), |held| held.marked_ahead(false));
                    let generation = state.generation + 1;
                    state.put(key, &entry, generation)?;
                    state.generation = generation;
                    for (other, intent) in behind.soon {
                        state.put_soon(other, &intent, generation);
                    }
                    for (other, intent) in behind.ahead {
                        state.put_ahead(other, &intent, generation);
                    }
                    generation
                }
            }
        };
        self.durable(generation).await
    }

    /// Replaces the entry under `key` (it says more now: what was built, our DELETE done, a
    /// failure counted). The change rides on the next write, or is written on its own once
    /// things are quiet; an entry settled before then is never written at all (most are: the
    /// PV exists, the storage is gone). Returns the generation to wait for with
    /// [`IntentLog::durable`] when it must be written now.
    pub fn update(&self, key: &str, intent: &Intent) -> Result<u64, IntentError> {
        let mut state = self.state();
        let generation = state.generation + 1;
        state.put(key, intent, generation)?;
        state.lazy = true;
        Ok(generation)
    }

    /// Whether `intent` would fit under `key` now (entry and log bounds).
    pub fn fits(&self, key: &str, intent: &Intent) -> bool {
        self.state()
            .bytes_with(key, &intent.to_text(), intent)
            .is_ok()
    }

    /// Counts a failed attempt in the entry under `key` (written with the next batch) and returns
    /// its count; `None` when the log holds no such entry.
    pub fn failed(
        &self,
        key: &str,
        error: &str,
        threshold: u32,
    ) -> Result<Option<Retries>, IntentError> {
        let Some(mut intent) = self.get(key) else {
            return Ok(None);
        };
        intent.retries_mut().failed(error, threshold);
        self.update(key, &intent)?;
        Ok(Some(intent.retries().clone()))
    }

    /// Waits until a write covering `generation` has succeeded.
    pub async fn durable(&self, generation: u64) -> Result<(), IntentError> {
        {
            let mut state = self.state();
            if state.generation < generation {
                state.generation = generation;
            }
        }
        let mut written = self.written.subscribe();
        self.wake.notify_one();
        loop {
            if *written.borrow_and_update() >= generation {
                let state = self.state();
                if state.flushed >= generation {
                    return Ok(());
                }
                if let Some(error) = &state.error {
                    return Err(error.clone());
                }
            }
            if written.changed().await.is_err() {
                return Err(IntentError::Stopped);
            }
        }
    }

    /// Whether the log holds an entry under `key` (written or about to be).
    pub fn holds(&self, key: &str) -> bool {
        self.state().entries.contains_key(key)
    }

    /// The entry under `key`, as held now.
    pub fn get(&self, key: &str) -> Option<Intent> {
        self.state().intent(key)
    }

    /// Every entry held now (this process's, and those adopted from stopped replicas).
    pub fn entries(&self) -> Vec<(String, Intent)> {
        let state = self.state();
        state
            .entries
            .iter()
            .filter_map(|(key, text)| Some((key.clone(), serde_json::from_str(text).ok()?)))
            .collect()
    }

    /// Forgets an entry; written with the next record, or on its own after a quiet while (the writer's `IDLE_FLUSH`).
    pub fn done(&self, key: &str) {
        self.state().forget(key);
    }

    /// Forgets the entry of a volume that is kept after all (recorded ahead of its turn). One
    /// that records our own DELETE of the PV stays: it stands for storage still to delete,
    /// whatever the PV shows meanwhile (it lingers, terminating, behind kube-controller-manager's
    /// pv-protection finalizer, and the volume path keeps a terminating PV).
    pub fn forget_kept_volume(&self, key: &str) {
        let mut state = self.state();
        let records_delete =
            matches!(state.intent(key), Some(Intent::Volume(v)) if v.deleted.is_some());
        if !records_delete {
            state.forget(key);
        }
    }

    /// Forgets an entry unless a reconcile took it up since recovery looked (that one settles it).
    pub fn drop_unless_fresh(&self, key: &str) {
        let mut state = self.state();
        if !state.fresh.contains(key) {
            state.remove(key);
        }
    }

    /// The reconcile that recorded `key` is over without settling it (a retry comes, or the
    /// object goes): from now on recovery looks after the entry too.
    pub fn attempt_over(&self, key: &str) {
        self.state().fresh.remove(key);
    }

    /// The reconcile that recorded `key` is over and its guest call ended without an answer:
    /// whatever the guest built is unknown from now on, as after a crash.
    pub fn attempt_unanswered(&self, key: &str) {
        let mut state = self.state();
        state.fresh.remove(key);
        if state.entries.contains_key(key) {
            state.unknown.insert(key.to_string());
        }
    }

    /// Whether this process does not know what became of the entry under `key`: it came from a
    /// stored log, or its last guest call ended without an answer.
    pub fn outcome_unknown(&self, key: &str) -> bool {
        self.state().unknown.contains(key)
    }

    /// Whether a reconcile of this process is working on `key` now (recovery leaves it alone).
    pub fn is_fresh(&self, key: &str) -> bool {
        self.state().fresh.contains(key)
    }

    /// Entries recorded ahead whose own turn has not come yet.
    pub fn ahead_len(&self) -> usize {
        self.state().ahead.len()
    }

    /// Whether the entry under `key` is durable and says its guest may be called: its record
    /// returns at once, and whatever would ride on its write is not needed now.
    pub fn recorded_as_called(&self, key: &str) -> bool {
        self.state().called_and_durable(key)
    }

    /// Entries written as called because their turn was next in line, whose turn has not come
    /// yet.
    pub fn soon_len(&self) -> usize {
        self.state().soon.len()
    }

    /// Entries held (in memory: the next write's content).
    pub fn len(&self) -> usize {
        self.state().entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the entries take (bounded by [`entry::MAX_LOG_BYTES`]).
    pub fn bytes(&self) -> usize {
        self.state().bytes
    }
}
