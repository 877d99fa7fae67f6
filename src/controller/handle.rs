//! One reconcile's hands: every guest call, API write and event of a reconcile goes through its
//! [`Handle`], which owns the write gate, the API budget and the memory of our own recent writes.
//!
//! There is no ambient default: a write needs a handle, and a handle is only made by opening the
//! gate for one object. Reads go through it too, so the API budget covers them.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, ObjectReference, PersistentVolume, PersistentVolumeClaim};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, ResourceExt};

use super::Context;
use super::decide::{self, FINALIZER_CLAIM, FINALIZER_PV, has_finalizer};
use super::events::Event;
use super::gate::{GateError, LockKey, Scope, Standing};
use super::node::{HOSTNAME_LABEL, Pin};
use super::plan::OurDelete;
use super::storage::claim_entry;

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

    /// The lease this reconcile writes under, checked now (refused: the gate's reason). A lease
    /// [`Standing::JustTaken`] means another replica may have finished the object a moment ago.
    pub async fn lease(&self) -> Result<Standing, GateError> {
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

    /// Runs a write of our own record (the intent log) once the gate allows it: the record is
    /// the leader's, as the guest call it precedes.
    pub async fn record<F: Future>(&self, write: F) -> Result<F::Output, GateError> {
        self.gate.check().await?;
        Ok(write.await)
    }

    /// Publishes an event when this replica may write now (otherwise it is not ours to send).
    pub fn event(&self, reference: &ObjectReference, event: Event) {
        if self.gate.may_write_now() {
            self.ctx.recorder.publish(reference, event);
        } else {
            let reason = event.reason;
            tracing::debug!(reason, "not publishing: this replica may not write now");
        }
    }

    /// Whether the node a pin names exists, asked of the API server (the node cache may lag a
    /// node that came back).
    pub async fn node_exists(&self, pin: Pin<'_>) -> Result<bool, kube::Error> {
        self.budget().await;
        let nodes: Api<Node> = Api::all(self.ctx.client.clone());
        Ok(match pin {
            Pin::Name(name) => nodes.get_metadata_opt(name).await?.is_some(),
            Pin::Hostname(hostname) => !nodes
                .list_metadata(
                    &ListParams::default()
                        .labels(&format!("{HOSTNAME_LABEL}={hostname}"))
                        .limit(1),
                )
                .await?
                .items
                .is_empty(),
        })
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

    /// Creates a PV; AlreadyExists is success. The error is the gate closing; the API server's
    /// refusal is an answer, the caller's to retry.
    pub async fn create_pv(&self, pv: &PersistentVolume) -> Result<PvCreated, GateError> {
        self.gate.check().await?;
        self.budget().await;
        let created = match Api::<PersistentVolume>::all(self.ctx.client.clone())
            .create(&PostParams::default(), pv)
            .await
        {
            Ok(_) => PvCreated::Created,
            Err(kube::Error::Api(status)) if status.is_already_exists() => PvCreated::Created,
            Err(error) => PvCreated::Refused(error),
        };
        if let PvCreated::Created = created {
            self.ctx.recent.created(&pv.name_any());
        }
        Ok(created)
    }

    /// Whether we created this PV recently (the cache may not show it yet).
    pub fn recently_created(&self, pv: &str) -> bool {
        self.ctx.recent.was_created(pv)
    }

    /// Remembers that the delete of this PV is over: its storage is gone and our last write
    /// (the finalizer's removal, or the PV's DELETE) has landed. Updates the watch delivers
    /// after it are of a PV with nothing left to do: reconciling one would only re-read it.
    pub fn delete_finished(&self, pv: &PersistentVolume) {
        if let Some(uid) = pv.metadata.uid.as_deref() {
            self.ctx.recent.deleted(uid, OurDelete::Finished);
        }
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

    /// Adds (naming `provisioner` on a claim not marked yet, see [`decide::name_provisioner`])
    /// or removes (`None`) our claim finalizer in one strategic-merge patch (only our entry of
    /// the list). Adding is conditional on the claim's resourceVersion; removing is unconditional.
    pub async fn set_claim_finalizer<E>(
        &self,
        pvc: &PersistentVolumeClaim,
        provisioner: Option<&str>,
    ) -> Result<PersistentVolumeClaim, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        let present = provisioner.is_some();
        if self.holds_claim_finalizer(pvc) == present {
            return Ok(pvc.clone());
        }
        let mut patch = decide::claim_finalizer_patch(&pvc.metadata.uid, present);
        if let Some(provisioner) = provisioner {
            decide::name_provisioner(&mut patch, pvc, provisioner);
            // Only on the claim we decided on: a cache behind the API server (a reschedule or a
            // removal of ours it does not show yet) gets a conflict, never a stale guest call.
            patch["metadata"]["resourceVersion"] = serde_json::json!(pvc.metadata.resource_version);
        }
        let result = self.patch_claim_finalizers(pvc, &patch, present).await;
        if result.is_ok() {
            let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
            self.ctx.recent.claim_finalizer_set(uid, present);
        }
        result
    }

    /// Adds (naming `provisioner` on a claim not marked yet, see [`decide::name_provisioner`])
    /// or removes (`None`) `finalizer` (not our provisioning one: [`Handle::set_claim_finalizer`]
    /// keeps the books for that) on a claim, with its UID as a precondition, so a namesake is
    /// never touched. Removing it from a claim that is gone is done.
    pub async fn set_other_claim_finalizer<E>(
        &self,
        pvc: &PersistentVolumeClaim,
        finalizer: &str,
        provisioner: Option<&str>,
    ) -> Result<PersistentVolumeClaim, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        let present = provisioner.is_some();
        let mut patch = decide::finalizer_patch(&pvc.metadata.uid, finalizer, present);
        if let Some(provisioner) = provisioner {
            decide::name_provisioner(&mut patch, pvc, provisioner);
        }
        self.patch_claim_finalizers(pvc, &patch, present).await
    }

    /// One strategic-merge patch of a claim's finalizers, once the gate and the budget allow;
    /// a removal from a claim that is gone is done.
    async fn patch_claim_finalizers<E>(
        &self,
        pvc: &PersistentVolumeClaim,
        patch: &serde_json::Value,
        present: bool,
    ) -> Result<PersistentVolumeClaim, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(
            self.ctx.client.clone(),
            &pvc.namespace().unwrap_or_default(),
        );
        self.gate.check().await?;
        self.budget().await;
        match claims
            .patch(
                &pvc.name_any(),
                &PatchParams::default(),
                &Patch::Strategic(patch),
            )
            .await
        {
            Ok(updated) => Ok(updated),
            Err(kube::Error::Api(status)) if status.is_not_found() && !present => Ok(pvc.clone()),
            Err(error) => Err(error.into()),
        }
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
        claim_entry::release(self.ctx, pvc.metadata.uid.as_deref().unwrap_or_default());
        self.set_claim_finalizer(pvc, None).await
    }

    /// A merge patch of a claim (with whatever precondition it carries); the API server's
    /// refusal is the caller's to judge (a conflict is often expected).
    pub async fn merge_patch_claim(
        &self,
        pvc: &PersistentVolumeClaim,
        patch: &serde_json::Value,
    ) -> Result<ClaimPatched, GateError> {
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
        Ok(match result {
            Ok(_) => ClaimPatched::Patched,
            Err(error) => ClaimPatched::Refused(error),
        })
    }

    /// The capacity, in bytes, we wrote to the claim's `status` lately ([`Handle::patch_claim_status`]
    /// with `grown`): the cache may still show the claim asking for it.
    pub fn grown_to(&self, pvc: &PersistentVolumeClaim) -> Option<u64> {
        self.ctx
            .recent
            .grown_to(pvc.metadata.uid.as_deref().unwrap_or_default())
    }

    /// A merge patch of a claim's `status` subresource (the growth path's capacity and
    /// conditions), once the gate and the budget allow; `grown` is the capacity in bytes the
    /// patch writes, remembered for [`Handle::grown_to`].
    pub async fn patch_claim_status<E>(
        &self,
        pvc: &PersistentVolumeClaim,
        patch: &serde_json::Value,
        grown: Option<u64>,
    ) -> Result<(), E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        self.gate.check().await?;
        self.budget().await;
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(
            self.ctx.client.clone(),
            &pvc.namespace().unwrap_or_default(),
        );
        claims
            .patch_status(
                &pvc.name_any(),
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await?;
        if let Some(bytes) = grown {
            let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
            self.ctx.recent.grown(uid, bytes);
        }
        Ok(())
    }

    /// A merge patch of a PV (the growth path's capacity) with the UID and resourceVersion of
    /// the PV we read as preconditions: a PV changed or replaced since is read again.
    pub async fn patch_pv_as_read<E>(
        &self,
        pv: &PersistentVolume,
        patch: &serde_json::Value,
    ) -> Result<(), E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        self.gate.check().await?;
        self.budget().await;
        let mut patch = patch.clone();
        patch["metadata"]["uid"] = serde_json::json!(pv.metadata.uid);
        patch["metadata"]["resourceVersion"] = serde_json::json!(pv.metadata.resource_version);
        Api::<PersistentVolume>::all(self.ctx.client.clone())
            .patch(
                &pv.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }

    /// Deletes exactly the PV we looked at (UID precondition). `Ok(false)`: it was gone already.
    pub async fn delete_pv<E>(&self, live: &PersistentVolume) -> Result<bool, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        Ok(self.send_pv_delete::<E>(live, false).await? == PvDeleted::Now)
    }

    /// Deletes the PV only if it is still exactly the version we looked at (UID and
    /// resourceVersion preconditions): the API server's own check that nothing changed since,
    /// however far behind the cache is, in the same request as the delete.
    pub async fn delete_pv_unchanged<E>(&self, seen: &PersistentVolume) -> Result<PvDeleted, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
        self.send_pv_delete(seen, true).await
    }

    /// The PV delete with its UID precondition, and with `same_version` its resourceVersion
    /// too; only then is a conflict an answer ([`PvDeleted::Changed`]) rather than an error.
    async fn send_pv_delete<E>(
        &self,
        pv: &PersistentVolume,
        same_version: bool,
    ) -> Result<PvDeleted, E>
    where
        E: From<GateError> + From<kube::Error>,
    {
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
        match Api::<PersistentVolume>::all(self.ctx.client.clone())
            .delete(&pv.name_any(), &params)
            .await
        {
            Ok(_) => {
                self.ctx.recent.deleted(uid, OurDelete::Marked);
                Ok(PvDeleted::Now)
            }
            Err(kube::Error::Api(status)) if status.is_not_found() => Ok(PvDeleted::Gone),
            Err(kube::Error::Api(status)) if same_version && status.is_conflict() => {
                Ok(PvDeleted::Changed)
            }
            Err(error) => Err(error.into()),
        }
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

/// What a PV create came to.
#[derive(Debug)]
pub enum PvCreated {
    /// It exists now (this request created it, or it existed already).
    Created,
    /// The API server refused it.
    Refused(kube::Error),
}

/// What a claim patch came to.
#[derive(Debug)]
pub enum ClaimPatched {
    /// The claim is patched.
    Patched,
    /// The API server refused it (a conflict with the precondition, not found, ...).
    Refused(kube::Error),
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
    /// PVs (by UID) we deleted, and how far.
    deleted: Mutex<Expiring<OurDelete>>,
    /// Claims (by UID) we wrote a grown `status.capacity` for, in bytes.
    grown: Mutex<Expiring<u64>>,
}

impl RecentWrites {
    fn created(&self, pv: &str) {
        self.created.lock().expect("lock").insert(pv, ());
    }

    fn was_created(&self, pv: &str) -> bool {
        self.created.lock().expect("lock").get(pv).is_some()
    }

    fn deleted(&self, uid: &str, how_far: OurDelete) {
        self.deleted.lock().expect("lock").insert(uid, how_far);
    }

    pub(super) fn our_delete(&self, uid: &str) -> OurDelete {
        self.deleted
            .lock()
            .expect("lock")
            .get(uid)
            .unwrap_or(OurDelete::None)
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

    fn grown(&self, uid: &str, bytes: u64) {
        self.grown.lock().expect("lock").insert(uid, bytes);
    }

    fn grown_to(&self, uid: &str) -> Option<u64> {
        self.grown.lock().expect("lock").get(uid)
    }

    /// Entries held (every kind): bounded by the writes of the last two minutes.
    pub fn len(&self) -> usize {
        self.created.lock().expect("lock").entries.len()
            + self.claim_finalizers.lock().expect("lock").entries.len()
            + self.deleted.lock().expect("lock").entries.len()
            + self.grown.lock().expect("lock").entries.len()
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
