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

pub mod entry;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::{Api, Client, ResourceExt};

pub use entry::{ClaimIntent, Intent, Retries, Storage, VolumeIntent};
use entry::{MAX_ENTRY_BYTES, MAX_LOG_BYTES};

use crate::controller::ratelimit::RateLimiter;

/// Label on intent logs; its value is the lease name, which names one provisioner deployment.
pub const LOG_LABEL: &str = "wasm-provisioner.dev/intents";

/// How long removals of finished entries may wait for the next write before they are written on
/// their own (they are not needed for safety, only for tidiness).
const IDLE_FLUSH: Duration = Duration::from_secs(2);

/// What one write of the log did.
struct Written {
    /// The log's new resourceVersion.
    version: String,
    /// Entries the stored log held that we did not (an earlier process'): now ours.
    adopted: BTreeMap<String, String>,
    /// Entries we had written that the stored log no longer held: removed by someone else.
    removed: Vec<String>,
    /// Every key the write stored.
    keys: HashSet<String>,
}

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
        /// [`MAX_ENTRY_BYTES`].
        limit: usize,
    },
    /// The log holds as much as it may; this entry waits until others leave.
    #[error("the intent log is full ({limit} bytes); {pv} waits until other entries leave")]
    Full {
        /// The PV it is about.
        pv: String,
        /// [`MAX_LOG_BYTES`].
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

/// How a clean stop left the log ([`IntentLog::close`]).
#[derive(Debug)]
pub enum Closed {
    /// The stored log is gone (`entries` 0) or holds exactly `entries`, for recovery;
    /// `dropped` entries recorded ahead of a turn that never came left it.
    Done {
        /// Entries the stored log still holds.
        entries: usize,
        /// Entries recorded ahead that left.
        dropped: usize,
    },
    /// The last try failed (an API-server outage, say): the stored log is as the last
    /// successful write left it.
    Failed {
        /// The last error.
        error: IntentError,
        /// Entries held now.
        entries: usize,
        /// Entries recorded ahead dropped here (still stored if no write went through).
        dropped: usize,
    },
}

#[derive(Default)]
struct LogState {
    /// Key (claim or PV UID) -> stored text: what the next write holds.
    entries: BTreeMap<String, String>,
    /// Bytes of keys and texts in `entries`.
    bytes: usize,
    /// Bumped by every change that must be durable; `flushed` is what the last write covered.
    generation: u64,
    flushed: u64,
    /// Removals not yet written.
    removals: bool,
    /// Updates not yet written that nobody waits for (they ride on the next write).
    lazy: bool,
    /// Key -> the generation that last changed it (durable once `flushed` reaches it).
    entry_generation: HashMap<String, u64>,
    /// Keys a reconcile of this process is working on now: it sees to them itself.
    fresh: HashSet<String>,
    /// Keys recorded ahead whose own turn has not come yet.
    ahead: HashSet<String>,
    /// Keys whose outcome this process does not know: taken from a stored log (an earlier
    /// process, another replica), or whose last guest call ended without an answer (a fault, a
    /// timeout, a build going on in the background).
    unknown: HashSet<String>,
    /// The keys our last successful write stored: one of them missing from the stored log later
    /// was removed by someone else (`forget-storage`), not yet to be written.
    written: HashSet<String>,
    /// Our last write's resourceVersion (None: not written by this process yet).
    version: Option<String>,
    /// The last write's error, for records waiting on it.
    error: Option<IntentError>,
}

impl LogState {
    /// Puts `text` under `key` if it fits the entry and log bounds.
    fn put(&mut self, key: &str, intent: &Intent, generation: u64) -> Result<(), IntentError> {
        let text = intent.to_text();
        self.bytes = self.bytes_with(key, &text, intent)?;
        self.entries.insert(key.to_string(), text);
        self.entry_generation.insert(key.to_string(), generation);
        Ok(())
    }

    /// The log's bytes once `text` is stored under `key`, if that fits the entry and log bounds.
    fn bytes_with(&self, key: &str, text: &str, intent: &Intent) -> Result<usize, IntentError> {
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
    fn put_ahead(&mut self, key: String, intent: &Intent, generation: u64) {
        let intent = intent.clone().marked_ahead(true);
        if !self.entries.contains_key(&key) && self.put(&key, &intent, generation).is_ok() {
            self.ahead.insert(key);
        }
    }

    /// Forgets entries someone else removed from the stored log (the caller replaces
    /// `written` with what the write stored).
    fn forget_removed(&mut self, removed: &[String]) {
        for key in removed {
            self.fresh.remove(key);
            if self.remove(key) {
                tracing::info!(%key, "intent-log entry removed by someone else (forget-storage); forgotten here too");
            }
        }
    }

    /// The entry held under `key`, read back.
    fn intent(&self, key: &str) -> Option<Intent> {
        serde_json::from_str(self.entries.get(key)?).ok()
    }

    /// Forgets an entry and that a reconcile works on it.
    fn forget(&mut self, key: &str) {
        self.fresh.remove(key);
        self.remove(key);
    }

    fn remove(&mut self, key: &str) -> bool {
        self.entry_generation.remove(key);
        self.ahead.remove(key);
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
    fn bump(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }
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

    /// Records an intent durably: returns once a write holding it has succeeded. `ahead` are
    /// entries for work that will come soon (the queue behind this one): they ride on the same
    /// write, marked as recorded ahead (their guest not called), and one that does not fit is
    /// left out. An entry recorded ahead loses that mark when its own turn comes, in a write
    /// that succeeds before this returns (before its guest is called): a stored entry marked
    /// ahead is one whose guest was never called, whenever the process stops. Any other intent
    /// already written returns at once. An entry that does not fit fails alone.
    pub async fn record(
        &self,
        key: &str,
        intent: &Intent,
        ahead: Vec<(String, Intent)>,
    ) -> Result<(), IntentError> {
        let generation = {
            let mut state = self.state();
            state.fresh.insert(key.to_string());
            state.ahead.remove(key);
            let held_ahead = state.intent(key).filter(Intent::is_ahead);
            match state.entry_generation.get(key).copied() {
                Some(_) if held_ahead.is_some() => {
                    let called = held_ahead.expect("held").marked_ahead(false);
                    let generation = state.generation + 1;
                    state.put(key, &called, generation)?;
                    state.generation = generation;
                    for (other, intent) in ahead {
                        state.put_ahead(other, &intent, generation);
                    }
                    generation
                }
                Some(generation) if generation <= state.flushed => return Ok(()),
                Some(generation) => generation,
                None => {
                    let generation = state.generation + 1;
                    state.put(key, intent, generation)?;
                    state.generation = generation;
                    for (other, intent) in ahead {
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

    /// Forgets an entry; written with the next record, or on its own after [`IDLE_FLUSH`].
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

    /// Entries held (in memory: the next write's content).
    pub fn len(&self) -> usize {
        self.state().entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the entries take (bounded by [`MAX_LOG_BYTES`]).
    pub fn bytes(&self) -> usize {
        self.state().bytes
    }

    /// The writer: batches every record waiting into one write. Runs for the life of the process.
    pub async fn run(self: Arc<Self>) -> &'static str {
        let mut again = false;
        loop {
            let woken = again
                || tokio::time::timeout(IDLE_FLUSH, self.wake.notified())
                    .await
                    .is_ok();
            again = false;
            let due = |state: &LogState| {
                let records_waiting = state.generation > state.flushed;
                // Removals and lazy updates alone are written once things are quiet.
                let quiet_removals = (state.removals || state.lazy) && !woken;
                records_waiting || quiet_removals
            };
            if !due(&self.state()) {
                continue;
            }
            // The budget first, the snapshot after: every record that arrives while the write
            // waits its turn (the budget is busiest exactly when records come fastest) rides
            // on it.
            self.budget.acquire().await;
            let snapshot = {
                let state = self.state();
                let written = match state.version {
                    // The stored log is read back first: what we wrote and it lacks was removed.
                    None => state.written.clone(),
                    Some(_) => HashSet::new(),
                };
                (
                    state.generation,
                    state.entries.clone(),
                    state.version.clone(),
                    written,
                )
            };
            let (generation, data, version, written) = snapshot;
            let outcome = self.write(data, version, &written).await;
            let mut state = self.state();
            match outcome {
                Ok(Written {
                    version,
                    adopted,
                    removed,
                    keys,
                }) => {
                    state.forget_removed(&removed);
                    state.written = keys;
                    for (key, text) in adopted {
                        let Ok(intent) = serde_json::from_str::<Intent>(&text) else {
                            tracing::warn!(%key, "an earlier process's intent is unreadable; left out");
                            continue;
                        };
                        if state.entries.contains_key(&key) {
                            continue;
                        }
                        match state.put(&key, &intent, 0) {
                            Ok(()) => {
                                state.unknown.insert(key);
                            }
                            Err(error) => {
                                tracing::warn!(%key, %error, "an earlier process's intent does not fit the log; left out")
                            }
                        }
                    }
                    state.version = Some(version);
                    state.flushed = generation;
                    state.removals = false;
                    state.lazy = false;
                    state.error = None;
                }
                Err(IntentError::Changed { .. }) => {
                    // Read back and written again right away; the records keep waiting.
                    tracing::debug!("the intent log changed under us; reading it back");
                    state.version = None;
                    again = true;
                    continue;
                }
                Err(error) => {
                    tracing::warn!(%error, "writing the intent log failed");
                    state.error = Some(error);
                    // Our idea of the version may be stale (someone else wrote): read it again.
                    state.version = None;
                }
            }
            drop(state);
            self.written.send_replace(generation);
        }
    }

    /// Writes `data` as the whole log (create, or replace at `version`), its first request on a
    /// budget token the caller holds. Without a version (the first write of this process, or
    /// after a failed one) the stored log is read first and its entries we do not hold are kept:
    /// an earlier process's intents wait for recovery. Returns the new version and those adopted
    /// entries.
    async fn write(
        &self,
        mut data: BTreeMap<String, String>,
        version: Option<String>,
        written: &HashSet<String>,
    ) -> Result<Written, IntentError> {
        let mut adopted = BTreeMap::new();
        let mut removed = Vec::new();
        let read_first = version.is_none();
        let version = match version {
            Some(version) => Some(version),
            None => {
                let stored = self
                    .api
                    .get_opt(&self.name)
                    .await
                    .map_err(|e| self.error(e))?;
                stored.and_then(|cm| {
                    let stored = cm.data.unwrap_or_default();
                    for key in written {
                        // Ours once, gone from the store now: removed by someone else.
                        if !stored.contains_key(key) && data.remove(key).is_some() {
                            removed.push(key.clone());
                        }
                    }
                    for (key, text) in stored {
                        // One we wrote and hold no more was settled here since: not adopted
                        // back (after a failed write, settled entries came back as if an
                        // earlier process had left them).
                        if !data.contains_key(&key) && !written.contains(&key) {
                            data.insert(key.clone(), text.clone());
                            adopted.insert(key, text);
                        }
                    }
                    cm.metadata.resource_version
                })
            }
        };
        let keys = data.keys().cloned().collect();
        let cm = self.config_map(data, version.clone());
        if read_first {
            self.budget.acquire().await;
        }
        let saved = match version {
            Some(_) => {
                self.api
                    .replace(&self.name, &PostParams::default(), &cm)
                    .await
            }
            None => self.api.create(&PostParams::default(), &cm).await,
        }
        .map_err(|error| match error {
            // Only a write at a version we hold can be retried at once: after a read-back the
            // conflict is a real race, reported like any failed write.
            kube::Error::Api(status) if status.is_conflict() && !read_first => {
                IntentError::Changed {
                    log: self.name.clone(),
                }
            }
            error => self.error(error),
        })?;
        Ok(Written {
            version: saved.resource_version().unwrap_or_default(),
            adopted,
            removed,
            keys,
        })
    }

    fn config_map(&self, data: BTreeMap<String, String>, version: Option<String>) -> ConfigMap {
        let mut cm = ConfigMap {
            data: Some(data),
            ..Default::default()
        };
        cm.metadata.name = Some(self.name.clone());
        cm.metadata.resource_version = version;
        cm.metadata.labels = Some([(LOG_LABEL.to_string(), self.group.clone())].into());
        cm
    }

    fn error(&self, error: kube::Error) -> IntentError {
        IntentError::Write {
            log: self.name.clone(),
            message: error.to_string(),
        }
    }

    /// Whether this replica may write its log at all (namespace exists, RBAC allows it): a
    /// dry-run create, so a misconfigured process fails at start instead of provisioning nothing.
    pub async fn check_writable(&self) -> Result<(), IntentError> {
        let cm = self.config_map(BTreeMap::new(), None);
        let params = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        match self.api.create(&params, &cm).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.reason == "AlreadyExists" => Ok(()),
            Err(error) => Err(self.error(error)),
        }
    }

    /// Takes over the logs of this deployment's other replicas (stopped, or standing by with
    /// nothing in flight): their entries join this log, durably, and their ConfigMaps are
    /// deleted (resourceVersion precondition: a replica writing meanwhile keeps its log until
    /// next time). Only the leader calls this, and only the leader records intents.
    pub async fn adopt_others(&self) -> Result<usize, kube::Error> {
        self.budget.acquire().await;
        let logs = self
            .api
            .list(&ListParams::default().labels(&format!("{LOG_LABEL}={}", self.group)))
            .await?;
        let mut adopted = 0;
        for log in logs.items {
            let name = log.name_any();
            if name == self.name {
                adopted += self.take_up_stored(&log);
                continue;
            }
            let mut generation = None;
            let mut kept_all = true;
            for (key, text) in log.data.clone().unwrap_or_default() {
                let Ok(intent) = serde_json::from_str::<Intent>(&text) else {
                    tracing::warn!(log = %name, %key, "unreadable intent left in place");
                    kept_all = false;
                    continue;
                };
                let mut state = self.state();
                if state.entries.contains_key(&key) {
                    continue;
                }
                let next = state.generation + 1;
                match state.put(&key, &intent, next) {
                    Ok(()) => {
                        generation = Some(state.bump());
                        state.unknown.insert(key);
                        adopted += 1;
                    }
                    Err(error) => {
                        tracing::warn!(%error, log = %name, "cannot adopt an intent now");
                        kept_all = false;
                    }
                }
            }
            if let Some(generation) = generation
                && let Err(error) = self.durable(generation).await
            {
                tracing::warn!(%error, log = %name, "adopting intents failed; retried later");
                continue;
            }
            if kept_all {
                self.delete_log(&name, log.resource_version()).await?;
            }
        }
        Ok(adopted)
    }

    /// Takes up what an earlier process of this replica left in its own log, once, before this
    /// process has written it (the writer would read it then too): those entries are durable
    /// already.
    fn take_up_stored(&self, log: &ConfigMap) -> usize {
        let mut state = self.state();
        if state.version.is_some() {
            return 0;
        }
        let mut taken = 0;
        for (key, text) in log.data.iter().flatten() {
            if state.entries.contains_key(key) {
                continue;
            }
            let Ok(intent) = serde_json::from_str::<Intent>(text) else {
                continue;
            };
            if state.put(key, &intent, 0).is_ok() {
                state.unknown.insert(key.clone());
                taken += 1;
            }
        }
        // The next write replaces this version: entries settled meanwhile are not read back.
        state.version = log.resource_version();
        taken
    }

    /// Entries recorded ahead of their turn whose turn never came (their guest was never
    /// called: they stand for no storage) leave the log. For a clean stop, once no reconcile runs:
    /// returns how many left.
    pub fn drop_ahead(&self) -> usize {
        let mut state = self.state();
        let ahead: Vec<String> = state
            .entries
            .keys()
            .filter(|key| !state.fresh.contains(*key))
            .filter(|key| state.intent(key).is_some_and(|held| held.is_ahead()))
            .cloned()
            .collect();
        for key in &ahead {
            state.remove(key);
        }
        ahead.len()
    }

    /// The clean stop of this replica's log, after the controllers stopped and the writer with
    /// them: entries recorded ahead leave ([`IntentLog::drop_ahead`]); an empty log is deleted
    /// (a log per process start would pile up), and one that still holds entries is written as
    /// held now, for recovery. A failed request (an API-server outage, say) is tried again until
    /// `within` has passed.
    pub async fn close(&self, within: Duration) -> Closed {
        let dropped = self.drop_ahead();
        let deadline = tokio::time::Instant::now() + within;
        let mut pause = Duration::from_millis(200);
        loop {
            let error = match self.close_once().await {
                Ok(entries) => return Closed::Done { entries, dropped },
                Err(error) => error,
            };
            if tokio::time::Instant::now() + pause > deadline {
                return Closed::Failed {
                    error,
                    entries: self.len(),
                    dropped,
                };
            }
            tracing::debug!(%error, "closing the intent log failed; trying again");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// One try of [`IntentLog::close`]: `Ok(n)` once the stored log is gone (n = 0) or holds
    /// exactly our n entries.
    async fn close_once(&self) -> Result<usize, IntentError> {
        let (data, version, written) = {
            let state = self.state();
            let settled = state.generation <= state.flushed && !state.removals && !state.lazy;
            if settled && state.version.is_none() && state.written.is_empty() {
                // Never written by this process: what is stored (if anything) is an earlier
                // process's, read below.
            } else if settled && !state.entries.is_empty() {
                return Ok(state.entries.len());
            }
            (
                state.entries.clone(),
                state.version.clone(),
                state.written.clone(),
            )
        };
        self.budget.acquire().await;
        if data.is_empty() {
            // Delete at the version we wrote, or at the stored one if it holds nothing of
            // anyone's but ours (entries we wrote and have settled since).
            let version = match version {
                Some(version) => version,
                None => match self
                    .api
                    .get_opt(&self.name)
                    .await
                    .map_err(|e| self.error(e))?
                {
                    None => return Ok(0),
                    Some(stored) => {
                        let others = stored
                            .data
                            .iter()
                            .flatten()
                            .filter(|(key, _)| !written.contains(*key))
                            .count();
                        if others > 0 {
                            // An earlier process's entries this one never took up (it never
                            // led): recovery's, on the leader.
                            return Ok(others);
                        }
                        stored.resource_version().unwrap_or_default()
                    }
                },
            };
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: Some(version),
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            return match self.api.delete(&self.name, &params).await {
                Ok(_) => Ok(0),
                Err(kube::Error::Api(status)) if status.is_not_found() => Ok(0),
                Err(error) => {
                    // A conflict: the stored log changed (forget-storage); read it again.
                    self.state().version = None;
                    Err(self.error(error))
                }
            };
        }
        // Entries stay: the stored log is made to hold exactly them (no entry recorded ahead,
        // none settled).
        let generation = self.state().generation;
        match self.write(data, version, &written).await {
            Ok(saved) => {
                let mut state = self.state();
                state.forget_removed(&saved.removed);
                state.written = saved.keys;
                state.version = Some(saved.version);
                state.flushed = state.flushed.max(generation);
                state.removals = false;
                state.lazy = false;
                // What an earlier process left, taken up by this write, is kept too.
                for (key, text) in saved.adopted {
                    if !state.entries.contains_key(&key) {
                        state.bytes += key.len() + text.len();
                        state.entries.insert(key, text);
                    }
                }
                Ok(state.entries.len())
            }
            Err(error) => {
                self.state().version = None;
                Err(error)
            }
        }
    }

    async fn delete_log(&self, name: &str, version: Option<String>) -> Result<(), kube::Error> {
        self.budget.acquire().await;
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: version,
                uid: None,
            }),
            ..DeleteParams::default()
        };
        match self.api.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.is_conflict() || status.is_not_found() => {
                Ok(())
            }
            Err(error) => Err(error),
        }
    }
}

/// The ConfigMap name of one replica's log (a valid name whatever the identity holds).
pub fn log_name(group: &str, identity: &str) -> String {
    let clean: String = identity
        .to_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let name = format!("{group}-intents-{clean}");
    let mut name: String = name.chars().take(253).collect();
    while name.ends_with(['-', '.']) {
        name.pop();
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_names_are_valid_configmap_names() {
        assert_eq!(
            log_name("wasm-provisioner", "Node-1_a8f3"),
            "wasm-provisioner-intents-node-1-a8f3"
        );
        assert!(log_name("wp", &"x".repeat(400)).len() <= 253);
        assert!(!log_name("wp", "a_").ends_with('-'));
    }

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
