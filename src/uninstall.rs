//! `release-finalizers`: the uninstall path. Removes our finalizers from claims (and, for the
//! named provisioners, the library's PV finalizer) so nothing hangs once the provisioner is gone.
//!
//! A claim keeps our finalizer only while a guest may hold storage for it; releasing it means
//! that storage, if any, is no longer cleaned up by us. The command says which claims it released
//! so an operator can check their storage. It also lists the storage the intent logs still name
//! (deletes that keep failing); `forget-storage` takes one out of the logs.

use std::collections::BTreeSet;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};

use crate::controller::decide::{
    self, FINALIZER_CLAIM, FINALIZER_CLONE_SOURCE, FINALIZER_PV, has_finalizer,
};
use crate::controller::storage::intent::{Intent, LOG_LABEL};

/// What to release.
#[derive(Debug, Clone)]
pub enum Target {
    /// Every claim holding our finalizer (and PVs of `provisioners`).
    All,
    /// One claim, `namespace/name`.
    Claim {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

/// Releases our finalizers; returns a report, one line per object.
pub async fn release_finalizers(
    client: Client,
    target: Target,
    provisioners: &BTreeSet<String>,
    dry_run: bool,
) -> anyhow::Result<String> {
    let mut report = String::new();
    let verb = if dry_run { "would release" } else { "released" };
    let claims: Vec<PersistentVolumeClaim> = match &target {
        Target::All => Api::<PersistentVolumeClaim>::all(client.clone())
            .list(&ListParams::default())
            .await
            .context("listing claims (RBAC: list persistentvolumeclaims)")?
            .items
            .into_iter()
            .filter(holds_ours)
            .filter(|c| {
                provisioners.is_empty()
                    || decide::claim_provisioner(c).is_some_and(|p| provisioners.contains(p))
            })
            .collect(),
        Target::Claim { namespace, name } => {
            // A list by name: the shipped RBAC lists and watches claims, it does not get them.
            let by_name = ListParams::default().fields(&format!("metadata.name={name}"));
            let claim = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace)
                .list(&by_name)
                .await
                .with_context(|| format!("reading claim {namespace}/{name}"))?
                .items
                .into_iter()
                .find(|c| c.metadata.name.as_deref() == Some(name.as_str()))
                .with_context(|| format!("claim {namespace}/{name} not found"))?;
            if !holds_ours(&claim) {
                report.push_str(&format!(
                    "claim {namespace}/{name} holds neither the {FINALIZER_CLAIM} nor the {FINALIZER_CLONE_SOURCE} finalizer\n"
                ));
            }
            vec![claim]
        }
    };
    let mut released = 0;
    for claim in claims
        .iter()
        .filter(|c| has_finalizer(&c.metadata.finalizers, FINALIZER_CLONE_SOURCE))
    {
        let (namespace, name) = (claim.namespace().unwrap_or_default(), claim.name_any());
        if !dry_run {
            let patch = decide::finalizer_patch(&claim.metadata.uid, FINALIZER_CLONE_SOURCE, false);
            Api::<PersistentVolumeClaim>::namespaced(client.clone(), &namespace)
                .patch(&name, &PatchParams::default(), &Patch::Strategic(&patch))
                .await
                .with_context(|| format!("releasing clone source {namespace}/{name}"))?;
        }
        released += 1;
        report.push_str(&format!(
            "{verb} clone source {namespace}/{name} (a clone of it still being copied may come out incomplete)\n"
        ));
    }
    for claim in claims
        .iter()
        .filter(|c| has_finalizer(&c.metadata.finalizers, FINALIZER_CLAIM))
    {
        let (namespace, name) = (claim.namespace().unwrap_or_default(), claim.name_any());
        if !dry_run {
            let patch = decide::claim_finalizer_patch(&claim.metadata.uid, false);
            Api::<PersistentVolumeClaim>::namespaced(client.clone(), &namespace)
                .patch(&name, &PatchParams::default(), &Patch::Strategic(&patch))
                .await
                .with_context(|| format!("releasing claim {namespace}/{name}"))?;
        }
        released += 1;
        let pv = decide::pv_name(claim).unwrap_or_default();
        report.push_str(&format!(
            "{verb} claim {namespace}/{name} (storage for {pv}, if a guest made any, is no longer cleaned up)\n"
        ));
    }
    let mut volumes = 0;
    if matches!(target, Target::All) && !provisioners.is_empty() {
        let pvs = Api::<PersistentVolume>::all(client.clone());
        for pv in pvs
            .list(&ListParams::default())
            .await
            .context("listing volumes (RBAC: list persistentvolumes)")?
            .items
            .iter()
            .filter(|pv| has_finalizer(&pv.metadata.finalizers, FINALIZER_PV))
            .filter(|pv| {
                decide::claim_provisioner_of_volume(pv).is_some_and(|p| provisioners.contains(p))
            })
        {
            if !dry_run {
                let patch = decide::finalizer_patch(&pv.metadata.uid, FINALIZER_PV, false);
                pvs.patch(
                    &pv.name_any(),
                    &PatchParams::default(),
                    &Patch::Strategic(&patch),
                )
                .await
                .with_context(|| format!("releasing volume {}", pv.name_any()))?;
            }
            volumes += 1;
            report.push_str(&format!(
                "{verb} volume {} (its storage is no longer deleted by us)\n",
                pv.name_any()
            ));
        }
    }
    report.push_str(&format!(
        "{verb} {released} claim(s), {volumes} volume(s)\n"
    ));
    if matches!(target, Target::All) && provisioners.is_empty() {
        report.push_str(&format!(
            "volumes untouched: {FINALIZER_PV} is shared with other provisioners; name yours with --provisioner to release it\n"
        ));
    }
    Ok(report)
}

/// Whether a claim holds one of our finalizers (provisioning, or clone source).
fn holds_ours(claim: &PersistentVolumeClaim) -> bool {
    has_finalizer(&claim.metadata.finalizers, FINALIZER_CLAIM)
        || has_finalizer(&claim.metadata.finalizers, FINALIZER_CLONE_SOURCE)
}

/// The intent-log entries in `namespace` that still name storage (a delete that keeps failing,
/// given up, or waiting for recovery), one line each: what an operator decides about before an
/// uninstall, and removes with [`forget_storage`].
pub async fn report_intents(client: &Client, namespace: &str) -> anyhow::Result<String> {
    let mut report = String::new();
    for (log, key, intent) in intent_entries(client, namespace).await? {
        let Some(storage) = intent.storage() else {
            continue;
        };
        let retries = intent.retries();
        let state = if retries.given_up {
            "given up"
        } else {
            "pending"
        };
        let source = storage
            .volume
            .spec
            .as_ref()
            .map(|s| {
                serde_json::to_string(&(&s.host_path, &s.local, &s.nfs, &s.csi)).unwrap_or_default()
            })
            .unwrap_or_default();
        report.push_str(&format!(
            "storage of {} ({state}, {} failed attempt(s){}) in intent log {log} entry {key}: {source}\n",
            intent.pv(),
            retries.attempts,
            retries.error.as_deref().map(|e| format!(", last: {e}")).unwrap_or_default(),
        ));
    }
    Ok(report)
}

/// `forget-storage PV`: removes the entries naming PV from every intent log in `namespace`, so
/// no replica deletes (or retries deleting) that storage. The storage itself is left as it is.
pub async fn forget_storage(
    client: Client,
    namespace: &str,
    pv: &str,
    dry_run: bool,
) -> anyhow::Result<String> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let mut report = String::new();
    let verb = if dry_run { "would forget" } else { "forgot" };
    let mut forgotten = 0;
    for mut cm in list_logs(&client, namespace).await? {
        let name = cm.name_any();
        let keys: Vec<String> = cm
            .data
            .iter()
            .flatten()
            .filter(|(_, text)| {
                serde_json::from_str::<Intent>(text).is_ok_and(|intent| intent.pv() == pv)
            })
            .map(|(key, _)| key.clone())
            .collect();
        if keys.is_empty() {
            continue;
        }
        if let Some(data) = cm.data.as_mut() {
            for key in &keys {
                data.remove(key);
            }
        }
        if !dry_run {
            // The resourceVersion read is the precondition: a replica writing meanwhile wins,
            // and the command says to run it again.
            api.replace(&name, &PostParams::default(), &cm)
                .await
                .with_context(|| {
                    format!(
                        "updating intent log {name} (run the command again if it changed meanwhile)"
                    )
                })?;
        }
        forgotten += keys.len();
        report.push_str(&format!(
            "{verb} the storage of {pv} in intent log {name} (nothing deletes it now; it is left on disk)\n"
        ));
    }
    if forgotten == 0 {
        anyhow::bail!("no intent log in namespace {namespace} names {pv}");
    }
    Ok(report)
}

async fn list_logs(client: &Client, namespace: &str) -> anyhow::Result<Vec<ConfigMap>> {
    Ok(Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(LOG_LABEL))
        .await
        .with_context(|| format!("listing intent logs in {namespace} (RBAC: list configmaps)"))?
        .items)
}

async fn intent_entries(
    client: &Client,
    namespace: &str,
) -> anyhow::Result<Vec<(String, String, Intent)>> {
    let mut entries = Vec::new();
    for cm in list_logs(client, namespace).await? {
        let name = cm.name_any();
        for (key, text) in cm.data.unwrap_or_default() {
            if let Ok(intent) = serde_json::from_str::<Intent>(&text) {
                entries.push((name.clone(), key, intent));
            }
        }
    }
    Ok(entries)
}

/// Parses `namespace/name`.
pub fn parse_claim(text: &str) -> Result<Target, String> {
    match text.split_once('/') {
        Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => Ok(Target::Claim {
            namespace: namespace.to_string(),
            name: name.to_string(),
        }),
        _ => Err(format!("expected NAMESPACE/NAME, got {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_are_named_namespace_slash_name() {
        assert!(matches!(
            parse_claim("team-a/data"),
            Ok(Target::Claim { namespace, name }) if namespace == "team-a" && name == "data"
        ));
        assert!(parse_claim("data").is_err());
        assert!(parse_claim("/data").is_err());
    }
}
