//! The claim path's endings: saving the PV a guest built (or deleting that storage when the PV
//! cannot be saved), deleting it when the claim went while the guest worked, and releasing our
//! finalizer from a deleted claim.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::{Resource, ResourceExt};

use super::{ClaimError, warn_claim};
use crate::controller::bookkeeping::Done;
use crate::controller::decide;
use crate::controller::events::{self, Event, EventAction};
use crate::controller::gate::GateError;
use crate::controller::handle::{Handle, PvCreated};
use crate::controller::node::Pin;
use crate::controller::storage::{self, StorageError};
use crate::wasm::Guest;

/// Saves the PV, retrying `--create-pv-retry-count` times; if it cannot be saved, its storage is
/// deleted again so nothing is left without a PV.
pub(super) async fn save_pv(
    handle: &Handle<'_>,
    guest: &Arc<Guest>,
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    class: &StorageClass,
) -> Result<Done, ClaimError> {
    let ctx = handle.ctx();
    let pv_name = pv.name_any();
    let attempts = ctx.settings.create_pv_retry_count.get();
    let mut outcome = PvCreated::Created;
    for attempt in 1..=attempts {
        outcome = handle.create_pv(pv).await?;
        match &outcome {
            PvCreated::Created => break,
            PvCreated::Refused(error) => {
                tracing::warn!(%error, attempt, attempts, pv = %pv_name, "creating PV failed");
                if attempt < attempts {
                    tokio::time::sleep(ctx.settings.create_pv_retry_interval).await;
                }
            }
        }
    }
    let source = match outcome {
        PvCreated::Created => {
            handle.event(
                &pvc.object_ref(&()),
                Event::normal(
                    events::PROVISIONING_SUCCEEDED,
                    EventAction::Provision,
                    format!("Successfully provisioned volume {pv_name}"),
                ),
            );
            handle.release_claim::<ClaimError>(pvc).await?;
            tracing::info!(pv = %pv_name, guest = guest.name(), "provisioned");
            return Ok(Done::Succeeded);
        }
        PvCreated::Refused(source) => source,
    };
    warn_claim(
        handle,
        pvc,
        events::PROVISIONING_FAILED,
        format!(
            "Error creating provisioned PV object for claim {}/{}: {source}. Deleting the volume.",
            pvc.namespace().unwrap_or_default(),
            pvc.name_any()
        ),
    );
    match delete_storage_with_retries(handle, guest, pv, Some(class)).await? {
        Cleanup::Deleted => {
            handle.release_claim::<ClaimError>(pvc).await?;
            Err(ClaimError::CreatePv {
                pv: pv_name,
                source,
            })
        }
        Cleanup::Failed(cleanup) => {
            warn_claim(
                handle,
                pvc,
                events::PROVISIONING_CLEANUP_FAILED,
                format!(
                    "Error cleaning provisioned volume for claim {}/{}: {cleanup}. Please delete manually.",
                    pvc.namespace().unwrap_or_default(),
                    pvc.name_any()
                ),
            );
            Err(ClaimError::Cleanup {
                pv: pv_name,
                source: cleanup,
            })
        }
    }
}

/// The claim was deleted while its guest worked: delete the new storage, create no PV.
pub(super) async fn abandon_deleted_while_provisioning(
    handle: &Handle<'_>,
    guest: &Guest,
    pv: &PersistentVolume,
    class: &StorageClass,
    cached: Option<Arc<PersistentVolumeClaim>>,
) -> Result<Done, ClaimError> {
    let pv_name = pv.name_any();
    tracing::info!(pv = %pv_name, "claim deleted while provisioning; deleting the new storage");
    handle
        .guest(storage::delete(guest, pv, Some(class)))
        .await?
        .map_err(|source| ClaimError::Cleanup {
            pv: pv_name.clone(),
            source,
        })?;
    if let Some(deleting) = cached {
        handle.release_claim::<ClaimError>(&deleting).await?;
        handle.event(
            &deleting.object_ref(&()),
            Event::normal(
                events::PROVISIONING_ABANDONED,
                EventAction::Provision,
                format!("Claim was deleted while provisioning; storage for {pv_name} was deleted"),
            ),
        );
    }
    Ok(Done::Nothing)
}

/// A claim with our finalizer is being deleted, and no reconcile of this process is working on
/// it: its guest was called (the finalizer went on before the call) and no PV records what it
/// built. Nothing else does: in this mode the claim carries the intent, not what was built, and
/// the guest is not asked again (its answer could name storage a live object uses). So the claim
/// is released and its storage, if any, kept, with an event saying so; a PV that does exist
/// decides by its own reclaim policy.
pub(super) async fn finish_deleted_claim(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
) -> Result<Done, ClaimError> {
    // Finished already, by us a moment ago if the cache still shows the finalizer.
    if !handle.holds_claim_finalizer(pvc) {
        return Ok(Done::Nothing);
    }
    let pv_name = decide::pv_name(pvc).ok_or(ClaimError::NoUid)?;
    if handle.get_pv(&pv_name).await?.is_some() {
        handle.release_claim::<ClaimError>(pvc).await?;
        return Ok(Done::Nothing);
    }
    handle.release_claim::<ClaimError>(pvc).await?;
    let provisioner = decide::claim_provisioner(pvc).unwrap_or_default();
    tracing::warn!(pv = %pv_name, "claim deleted mid-provision with nothing recorded of its storage; keeping whatever its guest built");
    handle.event(&pvc.object_ref(&()), Event::warning(events::STORAGE_KEPT, EventAction::Delete, format!(
            "Storage kept: the claim was deleted before its volume {pv_name} was created, and nothing records what the guest for {provisioner} built for it (a guest is never asked again what to delete); check that guest's storage for {pv_name}"
        )));
    Ok(Done::Nothing)
}

/// Node mode: a deleted claim whose node no longer exists. Its storage went with the node, so
/// no guest is called: after `--node-gone-grace` any instance releases the claim.
pub(super) async fn finish_deleted_claim_of_gone_node(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    gone: &str,
) -> Result<Done, ClaimError> {
    let node = handle.ctx().node.as_ref().expect("node mode");
    if let Some(wait) = node.gone_wait(gone) {
        return Ok(Done::RetryIn(wait));
    }
    // The cache may lag a node that came back: ask the API server first.
    if handle.node_exists(Pin::Name(gone)).await? {
        node.node_seen(gone);
        return Ok(Done::Nothing);
    }
    handle.release_claim::<ClaimError>(pvc).await?;
    handle.event(&pvc.object_ref(&()), Event::warning(events::PROVISIONING_ABANDONED, EventAction::Provision, format!(
            "Node {gone} no longer exists: released the deleted claim without cleaning up, its storage was on that node"
        )));
    Ok(Done::Nothing)
}

/// Removes our finalizer when the claim's PV exists (e.g. after a crash right after create).
pub(super) async fn release_if_pv_exists(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
) -> Result<(), ClaimError> {
    // A claim cached before our own removal landed still shows the finalizer: removing it
    // again would be a wasted request per claim (measured: 0.2-0.8 extra PATCHes per claim).
    if !handle.holds_claim_finalizer(pvc) {
        return Ok(());
    }
    let Some(pv_name) = decide::pv_name(pvc) else {
        return Ok(());
    };
    if handle.pv_known(&pv_name) || handle.get_pv(&pv_name).await?.is_some() {
        handle.release_claim::<ClaimError>(pvc).await?;
    }
    Ok(())
}

/// How the cleanup of an unsaved PV's storage ended.
enum Cleanup {
    /// The storage is gone (or the guest holds none).
    Deleted,
    /// The last try failed.
    Failed(StorageError),
}

/// Deletes the storage of a PV that could not be saved, with the PV create's retry budget.
async fn delete_storage_with_retries(
    handle: &Handle<'_>,
    guest: &Guest,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
) -> Result<Cleanup, GateError> {
    let ctx = handle.ctx();
    let attempts = ctx.settings.create_pv_retry_count.get();
    let mut attempt = 1;
    loop {
        match handle.guest(storage::delete(guest, pv, class)).await? {
            Ok(_) => return Ok(Cleanup::Deleted),
            Err(error) if attempt >= attempts => return Ok(Cleanup::Failed(error)),
            Err(error) => {
                tracing::warn!(%error, attempt, attempts, "deleting storage of an unsaved PV failed");
                attempt += 1;
                tokio::time::sleep(ctx.settings.create_pv_retry_interval).await;
            }
        }
    }
}

/// A claim whose data source only a volume populator can fill: the leader says so once (given
/// up for this spec: no retries, nothing recorded) and drops a finalizer an earlier version of
/// us may have added.
pub(super) async fn leave_to_populator(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    kind: &str,
    api_group: &str,
) -> Result<Done, ClaimError> {
    handle.lease().await?;
    handle.release_claim::<ClaimError>(pvc).await?;
    let ctx = handle.ctx();
    let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
    ctx.claim_book
        .give_up(uid, super::claim_fingerprint(pvc, ctx));
    let group = if api_group.is_empty() {
        "core"
    } else {
        api_group
    };
    handle.event(
        &pvc.object_ref(&()),
        Event::normal(
            events::LEFT_TO_POPULATOR,
            EventAction::Provision,
            format!(
                "the claim's data source is a {kind} (API group {group}), which only a volume populator can fill: this provisioner leaves the claim to it and creates no volume"
            ),
        ),
    );
    Ok(Done::Nothing)
}
