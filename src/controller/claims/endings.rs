//! The claim path's endings: saving the PV a guest built (or deleting its storage when that
//! fails), cleaning up after a claim deleted mid-provision, and releasing our finalizer.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::{Api, Resource, ResourceExt};

use super::{ClaimError, provision_request, warn_claim};
use crate::controller::bookkeeping::Done;
use crate::controller::convert::{self, PvIdentity};
use crate::controller::decide;
use crate::controller::events;
use crate::controller::gate::GateError;
use crate::controller::handle::Handle;
use crate::wasm::bindings::types::{DeleteRequest, ProvisionError};
use crate::wasm::{CallError, Guest};

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
    let attempts = ctx.settings.create_pv_retry_count.max(1);
    let mut outcome = Ok(());
    for attempt in 1..=attempts {
        outcome = handle.create_pv(pv).await?;
        match &outcome {
            Ok(()) => break,
            Err(error) => {
                tracing::warn!(%error, attempt, attempts, pv = %pv_name, "creating PV failed");
                if attempt < attempts {
                    tokio::time::sleep(ctx.settings.create_pv_retry_interval).await;
                }
            }
        }
    }
    let source = match outcome {
        Ok(()) => {
            handle.event(
                &pvc.object_ref(&()),
                false,
                events::PROVISIONING_SUCCEEDED,
                "Provision",
                format!("Successfully provisioned volume {pv_name}"),
            );
            handle.release_claim::<ClaimError>(pvc).await?;
            tracing::info!(pv = %pv_name, guest = guest.name(), "provisioned");
            return Ok(Done::Succeeded);
        }
        Err(source) => source,
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
        Ok(()) => {
            handle.release_claim::<ClaimError>(pvc).await?;
            Err(ClaimError::CreatePv {
                pv: pv_name,
                source,
            })
        }
        Err(cleanup) => {
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
        .guest(delete_storage(guest, pv, Some(class)))
        .await?
        .map_err(|source| ClaimError::Cleanup {
            pv: pv_name.clone(),
            source,
        })?;
    if let Some(deleting) = cached {
        handle.release_claim::<ClaimError>(&deleting).await?;
        handle.event(
            &deleting.object_ref(&()),
            false,
            events::PROVISIONING_ABANDONED,
            "Provision",
            format!("Claim was deleted while provisioning; storage for {pv_name} was deleted"),
        );
    }
    Ok(Done::Nothing)
}

/// A claim with our finalizer is being deleted: make sure no storage outlives it. Its class may
/// be gone by now: the record written with the finalizer stands in for it.
pub(super) async fn finish_deleted_claim(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
) -> Result<Done, ClaimError> {
    let ctx = handle.ctx();
    // Finished already, by us a moment ago if the cache still shows the finalizer: cleaning up
    // again would call the guest for storage nobody is left to delete if we crash meanwhile.
    if !handle.holds_claim_finalizer(pvc) {
        return Ok(Done::Nothing);
    }
    let pv_name = decide::pv_name(pvc).ok_or(ClaimError::NoUid)?;
    if handle.get_pv(&pv_name).await?.is_some() {
        // The PV exists: its reclaim policy now decides what happens to the storage.
        handle.release_claim::<ClaimError>(pvc).await?;
        return Ok(Done::Nothing);
    }
    let plugins = ctx.plugins();
    let provisioner = decide::claim_provisioner(pvc)
        .unwrap_or_default()
        .to_string();
    let class_name = decide::claim_class(pvc).unwrap_or_default().to_string();
    let Some(guest) = plugins.for_provisioner(&provisioner).cloned() else {
        // Our finalizer says this claim is ours and only its guest can clean up: wait for it
        // (a plugins reload re-runs every claim) rather than fail. `release-finalizers` is
        // the operator's way out if it never comes back.
        let why = plugins.why_not_served(&provisioner);
        handle.event(
            &pvc.object_ref(&()),
            true,
            events::WAITING_FOR_GUEST,
            "Delete",
            format!(
                "No guest serves {provisioner} right now ({why}); the storage of this deleted claim is cleaned up once a guest for it is loaded again"
            ),
        );
        return Ok(Done::Nothing);
    };
    let class = ctx
        .class(&class_name)
        .map(|c| (*c).clone())
        .or_else(|| decide::recorded_class(pvc));
    let Some(class) = class else {
        let error = ClaimError::ClassNotFound(format!(
            "{class_name} (needed to clean up storage of the deleted claim, which has no record of it)"
        ));
        warn_claim(
            handle,
            pvc,
            events::PROVISIONING_CLEANUP_FAILED,
            error.to_string(),
        );
        return Err(error);
    };
    // Provision is idempotent: asking again yields the description of whatever storage an
    // interrupted attempt created, which is what delete needs.
    let request = provision_request(pvc, &class, &guest, &pv_name)?;
    match handle.guest(guest.provision(&request)).await? {
        Ok(built) => {
            let pv = convert::persistent_volume(
                &PvIdentity {
                    name: &pv_name,
                    claim: pvc,
                    class: &class,
                    class_name: &class_name,
                },
                &built,
            );
            // The claim still exists (our finalizer holds it), so no namesake can; but a PV
            // left from an earlier claim may name the same storage: that one is not ours.
            if let Some(other) = crate::controller::recovery::other_volume_naming(ctx, &pv) {
                handle.event(
                    &pvc.object_ref(&()),
                    true,
                    events::STORAGE_KEPT,
                    "Delete",
                    format!("Storage kept: PV {other} names the storage the guest describes for {pv_name}"),
                );
                handle.release_claim::<ClaimError>(pvc).await?;
                return Ok(Done::Nothing);
            }
            handle
                .guest(delete_storage(&guest, &pv, Some(&class)))
                .await?
                .map_err(|source| ClaimError::Cleanup {
                    pv: pv_name.clone(),
                    source,
                })?;
            tracing::info!(pv = %pv_name, "deleted storage of a claim deleted mid-provision");
        }
        Err(CallError::Guest {
            error: ProvisionError::Transient(m) | ProvisionError::InBackground(m),
            ..
        }) => return Err(ClaimError::Transient(m)),
        Err(error @ CallError::Fault { .. }) => return Err(ClaimError::Guest(error)),
        Err(error) => {
            // The guest refuses the claim outright, so it holds no storage for it.
            tracing::info!(%error, "guest holds no storage for the deleted claim");
        }
    }
    handle.release_claim::<ClaimError>(pvc).await?;
    handle.event(
        &pvc.object_ref(&()),
        false,
        events::PROVISIONING_ABANDONED,
        "Provision",
        format!(
            "Claim was deleted before its volume was created; storage for {pv_name} was cleaned up"
        ),
    );
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
    handle.budget().await;
    if Api::<Node>::all(handle.ctx().client.clone())
        .get_metadata_opt(gone)
        .await?
        .is_some()
    {
        node.node_seen(gone);
        return Ok(Done::Nothing);
    }
    handle.release_claim::<ClaimError>(pvc).await?;
    handle.event(
        &pvc.object_ref(&()),
        true,
        events::PROVISIONING_ABANDONED,
        "Provision",
        format!(
            "Node {gone} no longer exists: released the deleted claim without cleaning up, its storage was on that node"
        ),
    );
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

fn delete_request(
    guest: &Guest,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
) -> Result<DeleteRequest, CallError> {
    convert::delete_request(pv, class, guest.grants().config_json.clone()).map_err(|e| {
        CallError::Rejected {
            guest: guest.name().to_string(),
            message: e.to_string(),
        }
    })
}

/// Deletes the storage a guest described; a guest that ignores it holds none.
pub(in crate::controller) async fn delete_storage(
    guest: &Guest,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
) -> Result<(), CallError> {
    let request = delete_request(guest, pv, class)?;
    match guest.delete(&request).await {
        Err(CallError::Guest {
            error: ProvisionError::Ignored(_),
            ..
        }) => Ok(()),
        other => other,
    }
}

async fn delete_storage_with_retries(
    handle: &Handle<'_>,
    guest: &Guest,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
) -> Result<Result<(), CallError>, GateError> {
    let ctx = handle.ctx();
    let attempts = ctx.settings.create_pv_retry_count.max(1);
    let mut attempt = 1;
    loop {
        match handle.guest(delete_storage(guest, pv, class)).await? {
            Ok(()) => return Ok(Ok(())),
            Err(error) if attempt >= attempts => return Ok(Err(error)),
            Err(error) => {
                tracing::warn!(%error, attempt, attempts, "deleting storage of an unsaved PV failed");
                attempt += 1;
                tokio::time::sleep(ctx.settings.create_pv_retry_interval).await;
            }
        }
    }
}
