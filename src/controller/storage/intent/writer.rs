//! The intent log's batching writer: every record waiting at one moment shares one write of the
//! whole log, finished entries leave with the next one, and the stored log is read back (and
//! what it holds of an earlier process adopted) whenever our idea of its version is lost.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::PostParams;

use super::book::LogState;
use super::{Intent, IntentError, IntentLog};

/// How long removals of finished entries may wait for the next write before they are written on
/// their own (they are not needed for safety, only for tidiness).
const IDLE_FLUSH: Duration = Duration::from_secs(2);

/// What one write of the log did.
pub(super) struct Written {
    /// The log's new resourceVersion.
    pub(super) version: String,
    /// Entries the stored log held that we did not (an earlier process'): now ours.
    pub(super) adopted: BTreeMap<String, String>,
    /// Entries we had written that the stored log no longer held: removed by someone else.
    pub(super) removed: Vec<String>,
    /// Every key the write stored.
    pub(super) keys: HashSet<String>,
}

impl IntentLog {
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
    pub(super) async fn write(
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
}
