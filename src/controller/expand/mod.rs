//! The growth path: a Bound claim of ours that asks for more than it has is grown, as the CSI
//! external-resizer grows the claims of its driver (kube-controller-manager only says
//! `ExternalExpanding` for a volume it cannot grow itself, and waits for us).
//!
//! ```text
//! claim: requests.storage > status.capacity ─▶ the live PV ─▶ plan (ours? this node's? class
//!   allows it? guest has the hook?) ─▶ `Resizing` condition + event ─▶ guest `expand` (the host
//!   raises an enforced limit to its answer) ─▶ PV spec.capacity ─▶ claim status.capacity,
//!   resize conditions cleared ─▶ `VolumeResizeSuccessful`
//! ```
//!
//! A failure is retried with the claim's backoff and give-up rules (counted as a provision
//! failure is), with `VolumeResizeFailed` events. Every step is idempotent: a process killed
//! between the PV and the claim write finds the claim still asking and grows again (the guest's
//! `expand` returns what it has, the limit stays, the PV write is skipped).

mod plan;

use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::info_span;

pub use plan::{ExpandFacts, ExpandPlan, RESIZE_CONDITIONS, plan_expansion, wanted};

use super::Context;
use super::bookkeeping::{Done, Operation, Tracked, busy_wait};
use super::claims::ClaimError;
use super::convert;
use super::decide::{self, Serving};
use super::events::{self, Event, EventAction};
use super::gate::LockKey;
use super::handle::Handle;
use super::node::VolumeOwner;
use crate::wasm::bindings::expansion::ExpandRequest;
use crate::wasm::bindings::types::ProvisionError;
use crate::wasm::{CallError, Guest, Plugins};

/// Reconciles a claim that [`wanted`] to grow to `requested` bytes, with the claim queue's
/// bookkeeping (failures, give-up, backoff) under the operation `Expand`.
pub async fn reconcile(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
    requested: u64,
    fingerprint: u64,
) -> Result<Action, ClaimError> {
    let uid = pvc.metadata.uid.clone().ok_or(ClaimError::NoUid)?;
    let handle = Handle::open(&ctx, LockKey::Claim(uid.clone()))?;
    let class = decide::claim_class(&pvc).unwrap_or_default().to_string();
    let span = info_span!(
        "expand",
        namespace = %pvc.namespace().unwrap_or_default(),
        claim = %pvc.name_any(),
        %uid,
        pv = pvc.spec.as_ref().and_then(|s| s.volume_name.as_deref()).unwrap_or_default(),
        class = %class,
        requested,
    );
    let tracked = Tracked {
        key: uid,
        fingerprint,
        reference: pvc.object_ref(&()),
        operation: Operation::Expand { class },
    };
    let work = grow(&handle, &pvc, requested, fingerprint);
    ctx.claim_book.track(&handle, &tracked, span, work).await.0
}

/// What the plan reads, answered from the guests and the node cache.
struct Facts<'a> {
    ctx: &'a Context,
    plugins: &'a Plugins,
}

impl ExpandFacts for Facts<'_> {
    type Guest = Arc<Guest>;

    fn serving(&self, provisioner: &str) -> Serving {
        super::claims::serving(self.plugins, provisioner)
    }

    fn guest(&self, provisioner: &str) -> Option<Arc<Guest>> {
        self.plugins.for_provisioner(provisioner).cloned()
    }

    fn expands(&self, guest: &Arc<Guest>) -> bool {
        guest.expands()
    }

    fn owner(&self, pv: &PersistentVolume) -> Option<VolumeOwner> {
        Some(self.ctx.node.as_ref()?.volume_owner(pv))
    }
}

/// Executes the plan for one claim.
async fn grow(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    requested: u64,
    fingerprint: u64,
) -> Result<Done, ClaimError> {
    let ctx = handle.ctx();
    if handle.grown_to(pvc).is_some_and(|bytes| bytes >= requested) {
        // Our own write of the grown status, which the cache does not show yet.
        tracing::debug!("grown already");
        return Ok(Done::Nothing);
    }
    let pv_name = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .unwrap_or_default();
    // The PV as it is now (the cache keeps a settled PV as its identity only, and its capacity
    // and source are what the guest and the host act on).
    let Some(pv) = handle.get_pv(&pv_name).await? else {
        tracing::debug!("its PV does not exist; nothing to grow");
        return Ok(Done::Nothing);
    };
    let plugins = ctx.plugins();
    let class_name = decide::claim_class(pvc).unwrap_or_default();
    let class = ctx.class(class_name);
    let facts = Facts {
        ctx,
        plugins: &plugins,
    };
    match plan_expansion(pvc, &pv, class.as_deref(), class_name, &facts) {
        ExpandPlan::Skip(reason) => {
            tracing::trace!(reason, "not growing");
            Ok(Done::Nothing)
        }
        ExpandPlan::WaitForGuest(provisioner) => {
            // Not a failure: a plugins reload re-runs every claim.
            tracing::info!(provisioner, "no guest serves its provisioner now; waiting");
            Ok(Done::Nothing)
        }
        ExpandPlan::ClassMissing(name) => {
            handle.lease().await?;
            let error = ClaimError::ClassNotFound(name.to_owned());
            warn(handle, pvc, error.to_string());
            Err(error)
        }
        ExpandPlan::Refuse(message) => {
            // Final for this claim as written and this class: no retries, one warning.
            handle.lease().await?;
            let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
            ctx.claim_book.give_up(uid, fingerprint);
            ctx.metrics.expand_failed(class_name, "unsupported");
            warn(handle, pvc, message);
            Ok(Done::Nothing)
        }
        ExpandPlan::Expand { guest, class } => {
            expand_with(handle, pvc, &pv, &guest, class, requested).await
        }
    }
}

/// The guest call and the writes that follow it.
async fn expand_with(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    guest: &Arc<Guest>,
    class: &StorageClass,
    requested: u64,
) -> Result<Done, ClaimError> {
    handle.lease().await?;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    if let Some(patch) = plan::resizing_patch(pvc, &now) {
        handle
            .patch_claim_status::<ClaimError>(pvc, &patch, None)
            .await?;
    }
    handle.event(
        &pvc.object_ref(&()),
        Event::normal(
            events::RESIZING,
            EventAction::Expand,
            format!("External resizer is resizing volume {}", pv.name_any()),
        ),
    );
    let request = ExpandRequest {
        volume: convert::volume(pv)?,
        requested_bytes: requested,
        storage_class: convert::storage_class(class),
        config: guest.grants().config_json.clone(),
    };
    let grown = match handle.guest(guest.expand(&request)).await? {
        Ok(grown) => grown,
        Err(error) => return expand_failed(handle, pvc, error).await,
    };
    tracing::info!(
        bytes = grown.bytes,
        limit_raised = grown.limit_raised,
        "guest grew the volume"
    );
    let had = request.volume.capacity_bytes;
    // A PV that says as much already was grown before (a process killed before the claim's
    // write, or an operator's edit): it is not written again, and never made smaller.
    let bytes = grown.bytes.max(had);
    let capacity = plan::capacity_quantity(pvc, bytes);
    if grown.bytes > had {
        let patch = json!({ "spec": { "capacity": { "storage": capacity } } });
        match handle.patch_pv_as_read::<ClaimError>(pv, &patch).await {
            Ok(()) => {}
            // The PV changed since it was read (its status, say): read again, not a failure;
            // the guest's `expand` is idempotent.
            Err(ClaimError::Kube(kube::Error::Api(status))) if status.is_conflict() => {
                return Ok(Done::RetryIn(busy_wait()));
            }
            Err(error) => return Err(error),
        }
    }
    handle
        .patch_claim_status::<ClaimError>(pvc, &plan::grown_patch(pvc, &capacity), Some(bytes))
        .await?;
    handle.event(
        &pvc.object_ref(&()),
        Event::normal(
            events::RESIZE_SUCCESSFUL,
            EventAction::Expand,
            format!(
                "resize volume {} successful ({})",
                pv.name_any(),
                capacity.0
            ),
        ),
    );
    Ok(Done::Succeeded)
}

/// What follows a failed `expand`: the guest's typed refusal as a provision's is read
/// (`ignored` leaves the claim, `transient`/`in-background` retry uncounted), anything else is
/// warned about and counted.
async fn expand_failed(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    error: CallError,
) -> Result<Done, ClaimError> {
    if let CallError::Guest { error, guest } = &error {
        match error {
            ProvisionError::Ignored(message) => {
                tracing::debug!(%guest, message, "guest ignored the growth");
                return Ok(Done::Nothing);
            }
            ProvisionError::Transient(message) => {
                return Err(ClaimError::Transient(message.clone()));
            }
            ProvisionError::InBackground(message) => {
                return Err(ClaimError::InBackground(message.clone()));
            }
            ProvisionError::Final(_) | ProvisionError::Reschedule(_) => {}
        }
    }
    warn(handle, pvc, error.to_string());
    Err(ClaimError::Guest(error))
}

/// A `VolumeResizeFailed` warning on the claim.
fn warn(handle: &Handle<'_>, pvc: &PersistentVolumeClaim, note: String) {
    let event = Event::warning(events::RESIZE_FAILED, EventAction::Expand, note);
    handle.event(&pvc.object_ref(&()), event);
}
