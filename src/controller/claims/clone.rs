//! Claims that copy another claim: the source read live and checked, held by a finalizer while
//! the guest copies it, and let go when the call returns (or, after a crash, by the next
//! reconcile of the source).
//!
//! ```text
//! clone claim ─▶ source claim (list by name, same namespace) ─▶ Bound, not deleting, same class
//!             ─▶ its PV (live): provisioned by the same provisioner ─▶ finalizer on the source
//!             ─▶ guest provision-clone(request, source) ─▶ finalizer off (last copy of it)
//! ```

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;

use super::ClaimError;
use crate::controller::convert;
use crate::controller::data_source::{self, DataSource};
use crate::controller::decide::{self, FINALIZER_CLONE_SOURCE, Serving, has_finalizer};
use crate::controller::events;
use crate::controller::handle::Handle;
use crate::wasm::bindings::cloning::CloneSource;

/// The sources this process is copying now, by UID, with how many copies of each: the finalizer
/// comes off when the last one returns, and a source with none in flight may lose it at once.
#[derive(Debug, Default)]
pub struct CloneSources(Mutex<HashMap<String, usize>>);

impl CloneSources {
    fn enter(&self, uid: &str) {
        *self.lock().entry(uid.to_owned()).or_default() += 1;
    }

    /// Whether this was the last copy of `uid` in flight.
    fn leave(&self, uid: &str) -> bool {
        let mut copies = self.lock();
        let Some(count) = copies.get_mut(uid) else {
            return true;
        };
        *count -= 1;
        if *count == 0 {
            copies.remove(uid);
            return true;
        }
        false
    }

    /// Whether a copy of `uid` is in flight here.
    pub fn copying(&self, uid: &str) -> bool {
        self.lock().contains_key(uid)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.0.lock().expect("clone sources lock")
    }
}

/// A source held for one copy: what the guest is handed, and the claim the finalizer is on.
pub(super) struct Held {
    /// What the guest is handed.
    pub(super) source: CloneSource,
    claim: PersistentVolumeClaim,
}

/// For a claim that clones another: the source, held ([`hold_source`]); a source that cannot
/// be copied is a `ProvisioningFailed` event and the error. `None` for any other claim.
pub(super) async fn hold_if_clone(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    provisioner: &str,
) -> Result<Option<Held>, ClaimError> {
    let DataSource::Claim { name, namespace } = data_source::of(pvc) else {
        return Ok(None);
    };
    match hold_source(handle, pvc, provisioner, name, namespace).await {
        Ok(held) => Ok(Some(held)),
        Err(error) => {
            if let ClaimError::Source(why) = &error {
                super::warn_claim(handle, pvc, events::PROVISIONING_FAILED, why.clone());
            }
            Err(error)
        }
    }
}

/// Finds the claim `pvc` copies, checks it may be copied, and holds it with our finalizer.
async fn hold_source(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    provisioner: &str,
    name: &str,
    namespace: Option<&str>,
) -> Result<Held, ClaimError> {
    let own = pvc.namespace().unwrap_or_default();
    let refuse = |why: String| ClaimError::Source(format!("source claim {own}/{name} {why}"));
    if let Some(other) = namespace.filter(|ns| *ns != own) {
        return Err(ClaimError::Source(format!(
            "source claim {other}/{name} is in another namespace: a clone is made only from a claim of its own namespace"
        )));
    }
    let Some(source) = handle.find_claim(&own, name).await? else {
        return Err(refuse("does not exist".into()));
    };
    let volume = checked(&source, pvc).map_err(refuse)?;
    let Some(pv) = handle.get_pv(&volume).await? else {
        return Err(refuse(format!(
            "names volume {volume}, which does not exist"
        )));
    };
    match decide::claim_provisioner_of_volume(&pv) {
        Some(p) if p == provisioner => {}
        other => {
            return Err(refuse(format!(
                "is bound to {volume}, provisioned by {}, not {provisioner}: a clone is made only from a volume of the same provisioner",
                other.unwrap_or("nobody (a static volume)")
            )));
        }
    }
    let source_uid = source.metadata.uid.clone().unwrap_or_default();
    let ctx = handle.ctx();
    ctx.clone_sources.enter(&source_uid);
    let claim = source_claim_ref(&source_uid, &own, name);
    match hold(handle, &source, &pv, pvc, provisioner, &refuse).await {
        Ok(volume) => Ok(Held {
            source: CloneSource {
                namespace: own.clone(),
                name: name.to_owned(),
                uid: source_uid,
                volume,
            },
            claim,
        }),
        Err(error) => {
            release(handle, &source_uid, &claim).await;
            Err(error)
        }
    }
}

/// Puts our finalizer on `source` and checks that what it holds is what was checked: not a
/// source deleted, rebound or emptied between the read and the write.
async fn hold(
    handle: &Handle<'_>,
    source: &PersistentVolumeClaim,
    pv: &k8s_openapi::api::core::v1::PersistentVolume,
    pvc: &PersistentVolumeClaim,
    provisioner: &str,
    refuse: &(dyn Fn(String) -> ClaimError + Sync),
) -> Result<crate::wasm::bindings::types::Volume, ClaimError> {
    // Naming the provisioner its PV was checked to be of: [`release_if_stale`] judges by it.
    let now = handle
        .set_other_claim_finalizer::<ClaimError>(source, FINALIZER_CLONE_SOURCE, Some(provisioner))
        .await?;
    checked(&now, pvc).map_err(refuse)?;
    Ok(convert::volume(pv)?)
}

/// The source's volume when it may be copied into `pvc`: Bound, not being deleted, in the
/// same class.
fn checked(source: &PersistentVolumeClaim, pvc: &PersistentVolumeClaim) -> Result<String, String> {
    if source.metadata.deletion_timestamp.is_some() {
        return Err("is being deleted".into());
    }
    let bound = source.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    let volume = source
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|v| !v.is_empty() && bound)
        .ok_or_else(|| "is not Bound to a volume yet".to_owned())?;
    let (theirs, ours) = (decide::claim_class(source), decide::claim_class(pvc));
    if theirs != ours {
        return Err(format!(
            "is of class {:?}, not {:?}: a clone is made only within one class",
            theirs.unwrap_or_default(),
            ours.unwrap_or_default()
        ));
    }
    Ok(volume)
}

/// Lets the source go once the guest returned for `clone`: the finalizer comes off with the
/// last copy, unless another clone of the source is still waiting for its volume (it may be
/// copying on another replica, in per-claim mode, or be about to).
pub(super) async fn let_go(handle: &Handle<'_>, held: Held, clone: &PersistentVolumeClaim) {
    let uid = held.source.uid.clone();
    if pending_clones(handle, &held.claim, clone.metadata.uid.as_deref()) {
        handle.ctx().clone_sources.leave(&uid);
        return;
    }
    release(handle, &uid, &held.claim).await;
}

/// Whether a claim other than `except` copies `source` and has no volume yet (the cache keeps
/// such claims whole: they are unbound and of our class).
fn pending_clones(
    handle: &Handle<'_>,
    source: &PersistentVolumeClaim,
    except: Option<&str>,
) -> bool {
    let (namespace, name) = (source.namespace(), source.name_any());
    handle.ctx().claims.state().iter().any(|claim| {
        claim.metadata.uid.as_deref() != except
            && claim.namespace() == namespace
            && claim.metadata.deletion_timestamp.is_none()
            && claim
                .spec
                .as_ref()
                .and_then(|s| s.volume_name.as_deref())
                .is_none_or(str::is_empty)
            && matches!(
                data_source::of(claim),
                DataSource::Claim { name: n, namespace: None } if n == name
            )
    })
}

async fn release(handle: &Handle<'_>, uid: &str, claim: &PersistentVolumeClaim) {
    if !handle.ctx().clone_sources.leave(uid) {
        return;
    }
    if let Err(error) = handle
        .set_other_claim_finalizer::<ClaimError>(claim, FINALIZER_CLONE_SOURCE, None)
        .await
    {
        // The next reconcile of the source takes it off (`release_if_stale`).
        tracing::warn!(%error, source = %claim.name_any(), "could not take the clone-source finalizer off");
    }
}

/// A claim holding our clone-source finalizer with no copy of it in flight here and no clone of
/// it waiting for a volume (a crash, or a leader that changed, during the copy) is let go.
pub(super) async fn release_if_stale(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
) -> Result<(), ClaimError> {
    let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
    if !has_finalizer(&pvc.metadata.finalizers, FINALIZER_CLONE_SOURCE) {
        return Ok(());
    }
    // Every instance uses this finalizer's name: only the one serving the source's provisioner
    // (whose guests copy it) may judge whether a copy of it is under way. The finalizer's write
    // named it on the claim, also on one provisioned ahead of kube-controller-manager's mark.
    let provisioner = decide::claim_provisioner(pvc).unwrap_or_default();
    let plugins = handle.ctx().plugins();
    if matches!(super::serving(&plugins, provisioner), Serving::No)
        || handle.ctx().clone_sources.copying(uid)
        || pending_clones(handle, pvc, None)
    {
        return Ok(());
    }
    handle.lease().await?;
    handle
        .set_other_claim_finalizer::<ClaimError>(pvc, FINALIZER_CLONE_SOURCE, None)
        .await?;
    Ok(())
}

fn source_claim_ref(uid: &str, namespace: &str, name: &str) -> PersistentVolumeClaim {
    let mut claim = PersistentVolumeClaim::default();
    claim.metadata.uid = Some(uid.to_owned());
    claim.metadata.namespace = Some(namespace.to_owned());
    claim.metadata.name = Some(name.to_owned());
    claim
}
