//! The intent log: one ConfigMap per replica listing the storage it may be about to leave without
//! an object naming it, with what deleting that storage needs. Two kinds of entries:
//! - a claim whose guest it is about to call (the storage may exist before its PV does);
//! - a Released PV it is about to delete ahead of its storage (the PV goes first).
//!
//! It is written in batches: all entries waiting at one moment share one write, and finished
//! entries leave with the next write. That is the leak protection of the claim finalizer (a claim
//! deleted mid-provision, a crash between the guest call and the PV create) at about one write per
//! claim on the API budget (the PV create) instead of three, and one per deleted volume (the PV
//! delete) instead of two; and claims carry nothing of ours that could keep them from being
//! deleted once the provisioner is gone.
//!
//! Recovery (`cleanup::recover_intents`) reads the logs of every replica of this provisioner: a
//! claim entry whose PV exists, or whose claim is still there, is left to the normal path; one
//! whose claim is gone has its storage deleted by its guest, from the recorded claim and class. A
//! volume entry whose PV is still there and not being deleted is left to the normal path; one
//! whose PV is gone (or going while Released) has its storage deleted from the recorded PV.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, Client, ResourceExt};
use serde::{Deserialize, Serialize};

use super::ratelimit::RateLimiter;

/// Label on intent logs; its value is the lease name, which names one provisioner deployment.
pub const LOG_LABEL: &str = "wasm-provisioner.dev/intents";

/// How long removals of finished claims may wait for the next write before they are written on
/// their own (they are not needed for safety, only for tidiness).
const IDLE_FLUSH: Duration = Duration::from_secs(2);

/// One entry of the log: what deleting some storage needs if the process dies before the
/// object that names that storage (a PV, or the claim it was made for) can be looked at again.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Intent {
    /// A Released PV is about to be deleted ahead of its storage (keyed by the PV's UID).
    Delete(Box<DeleteIntent>),
    /// A claim's guest is about to be called to make storage (keyed by the claim's UID).
    Provision(Box<ProvisionIntent>),
}

/// What deleting a claim's storage needs when the claim itself is gone.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProvisionIntent {
    /// The provisioner (which guest).
    pub provisioner: String,
    /// The PV name (deterministic, from the claim UID).
    pub pv: String,
    /// The claim as the guest was asked about it (metadata slimmed).
    pub claim: PersistentVolumeClaim,
    /// The class as it was.
    pub class: StorageClass,
}

/// What deleting a volume's storage needs once its PV is gone: the PV deleted first (with its
/// resourceVersion as precondition, so only the Released PV we decided on goes) costs one
/// request per volume where a re-read and a delete cost two.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeleteIntent {
    /// The provisioner (which guest).
    pub provisioner: String,
    /// The PV as it was when it was Released (metadata slimmed, no status).
    pub volume: PersistentVolume,
    /// Its class, if it still existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<StorageClass>,
}

impl Intent {
    /// The intent for `pvc` of `class`, keeping only what a guest's request reads.
    pub fn provision(
        provisioner: &str,
        pv: &str,
        pvc: &PersistentVolumeClaim,
        class: &StorageClass,
    ) -> Intent {
        let claim = PersistentVolumeClaim {
            metadata: slim_meta(&pvc.metadata),
            spec: pvc.spec.clone(),
            status: None,
        };
        Intent::Provision(Box::new(ProvisionIntent {
            provisioner: provisioner.to_string(),
            pv: pv.to_string(),
            claim,
            class: slim_class(class),
        }))
    }

    /// The intent to delete `pv`'s storage after the PV, keeping what a delete request reads.
    pub fn delete(
        provisioner: &str,
        pv: &PersistentVolume,
        class: Option<&StorageClass>,
    ) -> Intent {
        let volume = PersistentVolume {
            metadata: slim_meta(&pv.metadata),
            spec: pv.spec.clone(),
            status: None,
        };
        Intent::Delete(Box::new(DeleteIntent {
            provisioner: provisioner.to_string(),
            volume,
            class: class.map(slim_class),
        }))
    }

    /// The PV this intent is about.
    pub fn pv(&self) -> &str {
        match self {
            Intent::Delete(delete) => delete.volume.metadata.name.as_deref().unwrap_or_default(),
            Intent::Provision(provision) => &provision.pv,
        }
    }
}

/// The identity and the labels and annotations a guest's request reads; no resourceVersion,
/// finalizers or managed fields.
fn slim_meta(meta: &ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        uid: meta.uid.clone(),
        labels: meta.labels.clone(),
        annotations: meta.annotations.clone(),
        ..ObjectMeta::default()
    }
}

fn slim_class(class: &StorageClass) -> StorageClass {
    serde_json::from_str(&super::decide::class_record(class)).unwrap_or_default()
}

/// Why an intent could not be recorded.
#[derive(Debug, Clone, thiserror::Error)]
#[error("recording the intent log {log}: {message}")]
pub struct IntentError {
    /// The ConfigMap.
    pub log: String,
    /// The API error.
    pub message: String,
}

#[derive(Default)]
struct LogState {
    /// Claim UID -> serialized intent: what the next write holds.
    entries: BTreeMap<String, String>,
    /// Bumped by every record; `flushed` is the generation the last write covered.
    generation: u64,
    flushed: u64,
    /// Removals not yet written.
    removals: bool,
    /// Claim UID -> the generation that added it (it is durable once `flushed` reaches it).
    entry_generation: std::collections::HashMap<String, u64>,
    /// Claims a reconcile of this process is working on now: it sees to them itself.
    fresh: std::collections::HashSet<String>,
    /// Our last write's resourceVersion (None: not written by this process yet).
    version: Option<String>,
    /// The last write's error, for records waiting on it.
    error: Option<IntentError>,
}

impl LogState {
    fn insert(&mut self, uid: &str, text: String, generation: u64) {
        self.entries.insert(uid.to_string(), text);
        self.entry_generation.insert(uid.to_string(), generation);
    }
}

/// Entries one log holds at most (a ConfigMap holds 1 MiB; an entry is about 1 KiB): beyond it,
/// intents are not recorded ahead, only for the claims being provisioned.
const MAX_ENTRIES: usize = 512;

/// Intents the writer adds to a write at the moment it makes it (see [`IntentLog::ahead_from`]).
type AheadSource = Box<dyn Fn(&IntentLog) -> Vec<(String, Intent)> + Send + Sync>;

/// This replica's intent log.
pub struct IntentLog {
    ahead: std::sync::OnceLock<AheadSource>,
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
            ahead: std::sync::OnceLock::new(),
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

    /// Records an intent durably: returns once a write holding it has succeeded. `ahead` are
    /// intents for claims that will be provisioned soon (the queue behind this one): they ride on
    /// the same write, so their own records later cost nothing. An intent already written
    /// returns at once.
    pub async fn record(
        &self,
        uid: &str,
        intent: &Intent,
        ahead: Vec<(String, Intent)>,
    ) -> Result<(), IntentError> {
        let mut written = self.written.subscribe();
        let generation = {
            let mut state = self.state.lock().expect("lock");
            state.fresh.insert(uid.to_string());
            match state.entry_generation.get(uid).copied() {
                Some(generation) if generation <= state.flushed => return Ok(()),
                Some(generation) => generation,
                None => {
                    state.generation += 1;
                    let generation = state.generation;
                    let text = serde_json::to_string(intent).unwrap_or_default();
                    state.insert(uid, text, generation);
                    for (other, intent) in ahead {
                        if state.entries.len() >= MAX_ENTRIES {
                            break;
                        }
                        if !state.entries.contains_key(&other) {
                            let text = serde_json::to_string(&intent).unwrap_or_default();
                            state.insert(&other, text, generation);
                        }
                    }
                    generation
                }
            }
        };
        self.wake.notify_one();
        loop {
            if *written.borrow_and_update() >= generation {
                let state = self.state.lock().expect("lock");
                if state.flushed >= generation {
                    return Ok(());
                }
                if let Some(error) = &state.error {
                    return Err(error.clone());
                }
            }
            if written.changed().await.is_err() {
                return Err(IntentError {
                    log: self.name.clone(),
                    message: "the intent writer stopped".into(),
                });
            }
        }
    }

    /// Where the writer finds more intents to record at the moment it writes (its turn on the
    /// budget may come a while after the records that woke it): volumes released meanwhile ride
    /// on the same write instead of waking the next one. Set once; later calls are ignored.
    pub fn ahead_from(
        &self,
        source: impl Fn(&IntentLog) -> Vec<(String, Intent)> + Send + Sync + 'static,
    ) {
        let _ = self.ahead.set(Box::new(source));
    }

    /// Whether the log holds an intent for `uid` (written or about to be).
    pub fn holds(&self, uid: &str) -> bool {
        self.state.lock().expect("lock").entries.contains_key(uid)
    }

    /// Forgets an intent; written with the next record, or on its own after [`IDLE_FLUSH`].
    pub fn done(&self, uid: &str) {
        let mut state = self.state.lock().expect("lock");
        state.fresh.remove(uid);
        state.entry_generation.remove(uid);
        if state.entries.remove(uid).is_some() {
            state.removals = true;
        }
    }

    /// The reconcile that recorded `uid` is over without settling it (a retry comes, or the claim
    /// goes): from now on recovery looks after the entry too.
    pub fn attempt_over(&self, uid: &str) {
        self.state.lock().expect("lock").fresh.remove(uid);
    }

    /// Whether a reconcile of this process is working on `uid` now (recovery leaves it alone).
    pub fn is_fresh(&self, uid: &str) -> bool {
        self.state.lock().expect("lock").fresh.contains(uid)
    }

    /// Intents held (in memory: the next write's content).
    pub fn len(&self) -> usize {
        self.state.lock().expect("lock").entries.len()
    }

    /// Whether no intent is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The writer: batches every record waiting into one write. Runs for the life of the process.
    pub async fn run(self: Arc<Self>) -> &'static str {
        loop {
            let woken = tokio::time::timeout(IDLE_FLUSH, self.wake.notified())
                .await
                .is_ok();
            let due = |state: &LogState| {
                let records_waiting = state.generation > state.flushed;
                // Removals alone are written once things are quiet.
                let quiet_removals = state.removals && !woken;
                records_waiting || quiet_removals
            };
            if !due(&self.state.lock().expect("lock")) {
                continue;
            }
            // The budget first, the snapshot after: every record that arrives while the write
            // waits its turn (the budget is busiest exactly when records come fastest) rides
            // on it.
            self.budget.acquire().await;
            let records_waiting = {
                let state = self.state.lock().expect("lock");
                state.generation > state.flushed
            };
            let more = match self.ahead.get() {
                Some(source) if records_waiting => source(&self),
                _ => Vec::new(),
            };
            let (generation, data, version) = {
                let mut state = self.state.lock().expect("lock");
                if state.generation > state.flushed {
                    let generation = state.generation;
                    for (uid, intent) in more {
                        if state.entries.len() >= MAX_ENTRIES {
                            break;
                        }
                        if !state.entries.contains_key(&uid) {
                            let text = serde_json::to_string(&intent).unwrap_or_default();
                            state.insert(&uid, text, generation);
                        }
                    }
                }
                (
                    state.generation,
                    state.entries.clone(),
                    state.version.clone(),
                )
            };
            let outcome = self.write(data, version).await;
            let mut state = self.state.lock().expect("lock");
            match outcome {
                Ok((version, adopted)) => {
                    for (uid, text) in adopted {
                        if !state.entries.contains_key(&uid) {
                            state.insert(&uid, text, 0);
                        }
                    }
                    state.version = Some(version);
                    state.flushed = generation;
                    state.removals = false;
                    state.error = None;
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
    ) -> Result<(String, BTreeMap<String, String>), IntentError> {
        let error = |e: kube::Error| IntentError {
            log: self.name.clone(),
            message: e.to_string(),
        };
        let mut adopted = BTreeMap::new();
        let read_first = version.is_none();
        let version = match version {
            Some(version) => Some(version),
            None => {
                let stored = self.api.get_opt(&self.name).await.map_err(error)?;
                stored.and_then(|cm| {
                    for (uid, text) in cm.data.unwrap_or_default() {
                        if !data.contains_key(&uid) {
                            data.insert(uid.clone(), text.clone());
                            adopted.insert(uid, text);
                        }
                    }
                    cm.metadata.resource_version
                })
            }
        };
        let mut cm = ConfigMap {
            data: Some(data),
            ..Default::default()
        };
        cm.metadata.name = Some(self.name.clone());
        cm.metadata.labels = Some([(LOG_LABEL.to_string(), self.group.clone())].into());
        if read_first {
            self.budget.acquire().await;
        }
        let saved = match version {
            Some(version) => {
                cm.metadata.resource_version = Some(version);
                self.api
                    .replace(&self.name, &PostParams::default(), &cm)
                    .await
            }
            None => self.api.create(&PostParams::default(), &cm).await,
        }
        .map_err(error)?;
        Ok((saved.resource_version().unwrap_or_default(), adopted))
    }

    /// Every intent in the logs of this deployment's replicas: (log name, claim UID, intent).
    pub async fn list_all(&self) -> Result<Vec<(String, String, Intent)>, kube::Error> {
        self.budget.acquire().await;
        let logs = self
            .api
            .list(&ListParams::default().labels(&format!("{LOG_LABEL}={}", self.group)))
            .await?;
        let mut all = Vec::new();
        for log in logs.items {
            let name = log.name_any();
            for (uid, text) in log.data.unwrap_or_default() {
                match serde_json::from_str::<Intent>(&text) {
                    Ok(intent) => all.push((name.clone(), uid, intent)),
                    Err(error) => tracing::warn!(%error, log = %name, %uid, "unreadable intent"),
                }
            }
        }
        Ok(all)
    }

    /// Drops finished entries from another replica's log (with its resourceVersion: a live
    /// replica's concurrent write wins, and the entries are looked at again next time).
    pub async fn drop_from(&self, log: &str, uids: &[String]) -> Result<(), kube::Error> {
        if log == self.name {
            let mut state = self.state.lock().expect("lock");
            for uid in uids {
                // Taken up by a reconcile since recovery looked: that reconcile settles it.
                if !state.fresh.contains(uid) && state.entries.remove(uid).is_some() {
                    state.entry_generation.remove(uid);
                    state.removals = true;
                }
            }
            return Ok(());
        }
        self.budget.acquire().await;
        let Some(mut cm) = self.api.get_opt(log).await? else {
            return Ok(());
        };
        if let Some(data) = cm.data.as_mut() {
            for uid in uids {
                data.remove(uid);
            }
        }
        self.budget.acquire().await;
        match self.api.replace(log, &PostParams::default(), &cm).await {
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
    fn an_intent_keeps_what_a_request_reads_and_no_more() {
        let pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "n", "uid": "u", "resourceVersion": "9",
                         "annotations": {"a": "b"}, "finalizers": ["f"]},
            "spec": {"storageClassName": "fast"}
        }))
        .unwrap();
        let class: StorageClass = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "fast", "uid": "cu", "resourceVersion": "3"},
            "provisioner": "p", "parameters": {"k": "v"}
        }))
        .unwrap();
        let intent = Intent::provision("p", "pvc-u", &pvc, &class);
        let text = serde_json::to_string(&intent).unwrap();
        let Intent::Provision(back) = serde_json::from_str(&text).unwrap() else {
            panic!("read back as a delete: {text}");
        };
        assert_eq!(back.claim.metadata.uid.as_deref(), Some("u"));
        assert_eq!(back.claim.metadata.resource_version, None);
        assert_eq!(back.claim.metadata.finalizers, None);
        assert_eq!(back.class.parameters, class.parameters);
        assert_eq!(back.class.metadata.resource_version, None);
    }

    #[test]
    fn a_delete_intent_reads_back_as_one_and_keeps_no_status() {
        let pv: PersistentVolume = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "pvc-u", "uid": "pu", "resourceVersion": "7",
                         "finalizers": ["kubernetes.io/pv-protection"]},
            "spec": {"hostPath": {"path": "/x"}, "persistentVolumeReclaimPolicy": "Delete"},
            "status": {"phase": "Released"}
        }))
        .unwrap();
        let text = serde_json::to_string(&Intent::delete("p", &pv, None)).unwrap();
        let Intent::Delete(back) = serde_json::from_str(&text).unwrap() else {
            panic!("read back as a provision: {text}");
        };
        assert_eq!(back.volume.metadata.uid.as_deref(), Some("pu"));
        assert_eq!(back.volume.metadata.finalizers, None);
        assert!(back.volume.status.is_none() && back.class.is_none());
        assert_eq!(Intent::Delete(back).pv(), "pvc-u");
    }
}
