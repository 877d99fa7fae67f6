//! The intent logs as stored: one ConfigMap per replica, labelled with its deployment's lease;
//! checking at start that ours may be written, taking over the logs of stopped replicas, and the
//! name a replica's log goes by.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};

use super::{Intent, IntentError, IntentLog};

/// Label on intent logs; its value is the lease name, which names one provisioner deployment.
pub const LOG_LABEL: &str = "wasm-provisioner.dev/intents";

impl IntentLog {
    /// Our log as a ConfigMap holding `data` (at `version` when it replaces one).
    pub(super) fn config_map(
        &self,
        data: BTreeMap<String, String>,
        version: Option<String>,
    ) -> ConfigMap {
        let mut cm = ConfigMap {
            data: Some(data),
            ..Default::default()
        };
        cm.metadata.name = Some(self.name.clone());
        cm.metadata.resource_version = version;
        cm.metadata.labels = Some([(LOG_LABEL.to_string(), self.group.clone())].into());
        cm
    }

    /// A failed request on our log, as the log reports it.
    pub(super) fn error(&self, error: kube::Error) -> IntentError {
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
}
