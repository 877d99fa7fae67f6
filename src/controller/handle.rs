//! One reconcile's hands: every guest call, API write and event of a reconcile goes through its
//! [`Handle`], which owns the write gate, the API budget and the memory of our own recent writes.
//!
//! There is no ambient default: a write needs a handle, and a handle is only made by opening the
//! gate for one object. Reads go through it too, so the API budget covers them.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, ResourceExt};

use super::Context;
use super::decide::{self, FINALIZER_CLAIM, FINALIZER_PV, has_finalizer};
use super::gate::{GateError, LockKey, Scope};

/// How long our own recent writes are remembered while the caches catch up.
const WRITE_MEMORY: Duration = Duration::from_secs(120);

/// One reconcile's gate scope over the shared [`Context`].
pub struct Handle<'a> {
    ctx: &'a Context,
    gate: Scope,
}

impl<'a> Handle<'a> {
    /// Opens the gate for one object (a standby in leader mode is refused here).
    pub fn open(ctx: &'a Context, key: LockKey) -> Result<Handle<'a>, GateError> {
        Ok(Handle {
            ctx,
            gate: Scope::open(ctx.election.clone(), key)?,
        })
    }

    /// The shared state.
    pub fn ctx(&self) -> &'a Context {
        self.ctx
    }

    /// Checks the gate right before a guest call or API write. `Ok(true)`: a per-object lease was
    /// just taken, and another replica may have finished the object a moment ago.
    pub async fn gate(&self) -> Result<bool, GateError> {
        self.gate.check().await
    }

    /// Waits for the API budget (reads and writes share it).
    pub async fn budget(&self) {
        self.ctx.api_rate.acquire().await;
    }

    /// Runs a guest call once the gate allows it.
    pub async fn guest<F: Future>(&self, call: F) -> Result<F::Output, GateError> {
        self.gate.check().await?;
        Ok(call.await)
    }

    /// Publishes an event when this replica may write now (otherwise it is not ours to send).
    pub fn event(
        &self,
        reference: &ObjectReference,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        if self.gate.may_write_now() {
            self.ctx
                .recorder
                .publish(reference, warning, reason, action, note);
        } else {
            tracing::debug!(reason, "not publishing: this replica may not write now");
        }
    }

    /// Reads a PV from the API server (the cache may be behind).
    pub async fn get_pv(&self, name: &str) -> Result<Option<PersistentVolume>, kube::Error> {
        self.budget().await;
        Api::<PersistentVolume>::all(self.ctx.client.clone())
            .get_opt(name)
            .await
    }

    /// Reads a claim from the API server (None: it does not exist). A list by name rather than a
    /// get: the shipped RBAC grants list and watch on claims, and nothing more than it needs.
    pub async fn find_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<PersistentVolumeClaim>, kube::Error> {
        self.budget().await;
        let by_name = ListParams::default().fields(&format!("metadata.name={name}"));
        Ok(
            Api::<PersistentVolumeClaim>::namespaced(self.ctx.client.clone(), namespace)
                .list(&by_name)
                .await?
                .items
                .into_iter()
                .find(|c| c.metadata.name.as_deref() == Some(name)),
        )
    }

    /// Creates a PV; AlreadyExists is success. The outer error is the gate closing.
    pub async fn create_pv(
        &self,
        pv: &PersistentVolume,
    ) -> Result<Result<(), kube::Error>, GateError> {
        self.gate.check().await?;
        self.budget().await;
        let result = match Api::<PersistentVolume>::all(self.ctx.client.clone())
            .create(&PostParams::default(), pv)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(()),
            Err(error) => Err(error),
        };
        if result.is_ok() {
            self.ctx.recent.created(&pv.name_any());
        }
        Ok(result)
    }

    /// Whether we created this PV recently (the cache may not show it yet).
    pub fn recently_created(&self, pv: &str) -> bool {
        self.ctx.recent.was_created(pv)
    }

    /// Whether we deleted the PV with this UID recently (its last updates may still arrive).
    pub fn recently_deleted(&self, pv: &PersistentVolume) -> bool {
        self.ctx
            .recent
            .was_deleted(pv.metadata.uid.as_deref().unwrap_or_default())
    }

    /// Whether a PV of this name exists as far as the cache and our own writes tell.
    pub fn pv_known(&self, pv: &str) -> bool {
        self.ctx.volume(pv).is_some() || self.recently_created(pv)
    }

    /// Whether the claim holds our finalizer: our own latest write about it wins over the cache,
    /// which may not show that write yet.
    pub fn holds_claim_finalizer(&self, pvc: &PersistentVolumeClaim) -> bool {
        let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
        self.ctx
            .recent
            .claim_finalizer(uid)
            .unwrap_or_else(|| has_finalizer(&pvc.metadata.finalizers, FINALIZER_CLAIM))
    }

    /// Adds or removes our claim finalizer in one strategic-merge patch (only our entry of the
    /// list). Adding is conditional on the claim's resourceVersion; removing is unconditional.
    pub async fn set_claim_finalizer<E>(
        &self,
        pvc: &PersistentVolumeClaim,
        present: bool,
    ) -> Result<PersistentVolumeClaim, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        if self.holds_claim_finalizer(pvc) == present {
            return Ok(pvc.clone());
        }
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(
            self.ctx.client.clone(),
            &pvc.namespace().unwrap_or_default(),
        );
        let mut patch = decide::claim_finalizer_patch(&pvc.metadata.uid, present);
        if present {
            // Only on the claim we decided on: a cache behind the API server (a reschedule or a
            // removal of ours it does not show yet) gets a conflict, never a stale guest call.
            patch["metadata"]["resourceVersion"] = serde_json::json!(pvc.metadata.resource_version);
        }
        self.gate.check().await?;
        self.budget().await;
        let result = match claims
            .patch(
                &pvc.name_any(),
                &PatchParams::default(),
                &Patch::Strategic(&patch),
            )
            .await
        {
            Ok(updated) => Ok(updated),
            Err(kube::Error::Api(status)) if status.is_not_found() && !present => Ok(pvc.clone()),
            Err(error) => Err(error.into()),
        };
        if result.is_ok() {
            let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
            self.ctx.recent.claim_finalizer_set(uid, present);
        }
        result
    }

    /// The claim's storage is settled (its PV exists, the storage is gone, or the guest holds
    /// none): drop whatever intent record it has, our finalizer or its intent-log entry.
    pub async fn release_claim<E>(
        &self,
        pvc: &PersistentVolumeClaim,
    ) -> Result<PersistentVolumeClaim, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        if let Some(log) = &self.ctx.intents {
            log.done(pvc.metadata.uid.as_deref().unwrap_or_default());
        }
        self.set_claim_finalizer(pvc, false).await
    }

    /// A merge patch of a claim (with whatever precondition it carries); the API answer is the
    /// caller's to judge (a conflict is often expected).
    pub async fn merge_patch_claim(
        &self,
        pvc: &PersistentVolumeClaim,
        patch: &serde_json::Value,
    ) -> Result<Result<PersistentVolumeClaim, kube::Error>, GateError> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(
            self.ctx.client.clone(),
            &pvc.namespace().unwrap_or_default(),
        );
        self.gate.check().await?;
        self.budget().await;
        let result = claims
            .patch(
                &pvc.name_any(),
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await;
        if result.is_ok()
            && let Some(finalizers) = patch.pointer("/metadata/finalizers")
        {
            let present = finalizers
                .as_array()
                .is_some_and(|list| list.iter().any(|f| f == FINALIZER_CLAIM));
            let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
            self.ctx.recent.claim_finalizer_set(uid, present);
        }
        Ok(result)
    }

    /// Deletes exactly the PV we looked at (UID precondition). `Ok(false)`: it was gone already.
    pub async fn delete_pv<E>(&self, live: &PersistentVolume) -> Result<bool, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        Ok(self.send_pv_delete(live, false).await?? == PvDeleted::Now)
    }

    /// Deletes the PV only if it is still exactly the version we looked at (UID and
    /// resourceVersion preconditions): the API server's own check that nothing changed since,
    /// however far behind the cache is, in the same request as the delete.
    pub async fn delete_pv_unchanged<E>(&self, seen: &PersistentVolume) -> Result<PvDeleted, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        match self.send_pv_delete(seen, true).await? {
            Err(kube::Error::Api(status)) if status.is_conflict() => Ok(PvDeleted::Changed),
            other => Ok(other?),
        }
    }

    async fn send_pv_delete(
        &self,
        pv: &PersistentVolume,
        same_version: bool,
    ) -> Result<Result<PvDeleted, kube::Error>, GateError> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pv.metadata.uid.clone(),
                resource_version: pv
                    .metadata
                    .resource_version
                    .clone()
                    .filter(|_| same_version),
            }),
            ..DeleteParams::default()
        };
        self.gate.check().await?;
        self.budget().await;
        let uid = pv.metadata.uid.as_deref().unwrap_or_default();
        Ok(
            match Api::<PersistentVolume>::all(self.ctx.client.clone())
                .delete(&pv.name_any(), &params)
                .await
            {
                Ok(_) => {
                    self.ctx.recent.deleted(uid);
                    Ok(PvDeleted::Now)
                }
                Err(kube::Error::Api(status)) if status.is_not_found() => Ok(PvDeleted::Gone),
                Err(error) => Err(error),
            },
        )
    }

    /// Adds or removes the library's PV finalizer (strategic merge: only our entry, no conflict
    /// with kube-controller-manager's pv-protection writing the same PV).
    pub async fn set_pv_finalizer<E>(&self, pv: &PersistentVolume, present: bool) -> Result<(), E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        let patch = decide::finalizer_patch(&pv.metadata.uid, FINALIZER_PV, present);
        self.gate.check().await?;
        self.budget().await;
        match Api::<PersistentVolume>::all(self.ctx.client.clone())
            .patch(
                &pv.name_any(),
                &PatchParams::default(),
                &Patch::Strategic(&patch),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
            Err(error) => Err(error.into()),
        }
    }
}

/// What a PV delete with preconditions did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PvDeleted {
    /// This request deleted it (or marked it for deletion behind finalizers).
    Now,
    /// It did not exist.
    Gone,
    /// It exists, but not as the version (or UID) we looked at.
    Changed,
}

/// Our own writes of the last [`WRITE_MEMORY`]: what the caches may not show yet.
#[derive(Debug, Default)]
pub struct RecentWrites {
    /// PVs we created.
    created: Mutex<Expiring<()>>,
    /// Claims (by UID) whose finalizer we added (`true`) or removed (`false`).
    claim_finalizers: Mutex<Expiring<bool>>,
    /// PVs (by UID) we deleted.
    deleted: Mutex<Expiring<()>>,
}

impl RecentWrites {
    fn created(&self, pv: &str) {
        self.created.lock().expect("lock").insert(pv, ());
    }

    fn was_created(&self, pv: &str) -> bool {
        self.created.lock().expect("lock").get(pv).is_some()
    }

    fn deleted(&self, uid: &str) {
        self.deleted.lock().expect("lock").insert(uid, ());
    }

    pub(super) fn was_deleted(&self, uid: &str) -> bool {
        self.deleted.lock().expect("lock").get(uid).is_some()
    }

    fn claim_finalizer_set(&self, uid: &str, present: bool) {
        self.claim_finalizers
            .lock()
            .expect("lock")
            .insert(uid, present);
    }

    fn claim_finalizer(&self, uid: &str) -> Option<bool> {
        self.claim_finalizers.lock().expect("lock").get(uid)
    }

    /// Entries held (both kinds): bounded by the writes of the last two minutes.
    pub fn len(&self) -> usize {
        self.created.lock().expect("lock").entries.len()
            + self.claim_finalizers.lock().expect("lock").entries.len()
            + self.deleted.lock().expect("lock").entries.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A map whose entries expire after [`WRITE_MEMORY`]; expired ones are swept at most once a
/// second, so the map holds about the writes of the last two minutes, whatever the churn.
#[derive(Debug)]
struct Expiring<V> {
    entries: HashMap<String, (V, Instant)>,
    swept: Instant,
}

impl<V> Default for Expiring<V> {
    fn default() -> Self {
        Expiring {
            entries: HashMap::new(),
            swept: Instant::now(),
        }
    }
}

impl<V: Copy> Expiring<V> {
    fn insert(&mut self, key: &str, value: V) {
        if self.swept.elapsed() >= Duration::from_secs(1) {
            self.entries
                .retain(|_, (_, at)| at.elapsed() < WRITE_MEMORY);
            self.swept = Instant::now();
        }
        self.entries
            .insert(key.to_string(), (value, Instant::now()));
    }

    fn get(&self, key: &str) -> Option<V> {
        self.entries
            .get(key)
            .filter(|(_, at)| at.elapsed() < WRITE_MEMORY)
            .map(|(value, _)| *value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_writes_remember_the_latest_finalizer_write() {
        let recent = RecentWrites::default();
        assert_eq!(recent.claim_finalizer("u1"), None);
        recent.claim_finalizer_set("u1", false);
        assert_eq!(recent.claim_finalizer("u1"), Some(false));
        recent.claim_finalizer_set("u1", true);
        assert_eq!(recent.claim_finalizer("u1"), Some(true));
        recent.created("pvc-1");
        assert!(recent.was_created("pvc-1") && !recent.was_created("pvc-2"));
        assert_eq!(recent.len(), 2);
    }
}
