//! The clean stop of a replica's intent log: entries recorded ahead leave, an empty log is
//! deleted, and one that still holds entries is written as held, for recovery; retried through
//! an API-server outage for a bounded while.

use std::time::Duration;

use kube::ResourceExt;
use kube::api::{DeleteParams, Preconditions};

use super::{IntentError, IntentLog};

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

impl IntentLog {
    /// Entries recorded ahead of their turn, or written as called because it was next in line,
    /// whose turn never came (their guest was never called: they stand for no storage) leave
    /// the log. For a clean stop, once no reconcile runs:
    /// returns how many left.
    pub fn drop_ahead(&self) -> usize {
        let mut state = self.state();
        let ahead: Vec<String> = state
            .entries
            .keys()
            .filter(|key| !state.fresh.contains(*key))
            .filter(|key| {
                state.soon.contains(*key) || state.intent(key).is_some_and(|held| held.is_ahead())
            })
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
}
