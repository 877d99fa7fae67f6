//! The delete path: one reconcile per PV, from "released and ours?" to storage and PV gone.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolume};
use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use tracing::info_span;

use super::Context;
use super::bookkeeping::{Done, Failure, Operation, Tracked};
use super::cache::CachedVolume;
use super::decide::{self, FINALIZER_PV, has_finalizer};
use super::events;
use super::failures::fingerprint;
use super::gate::{GateError, LockKey};
use super::handle::Handle;
use super::node::{self, VolumeOwner};
use crate::controller::convert::{self, ConvertError};
use crate::wasm::bindings::types::{DeleteRequest, ProvisionError};
use crate::wasm::{Availability, CallError, Plugins};

/// Why a volume reconcile did not finish.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The guest could not delete the storage.
    #[error(transparent)]
    Guest(CallError),
    /// The guest asked to be retried.
    #[error("{0}")]
    Transient(String),
    /// The PV cannot be expressed in the contract.
    #[error(transparent)]
    Convert(#[from] ConvertError),
    /// An API request failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The whole operation ran past `--delete-timeout`.
    #[error("deleting did not finish within {0:?}")]
    Timeout(Duration),
    /// This replica may not write now (not the leader, or another replica holds the volume).
    #[error(transparent)]
    Gate(#[from] GateError),
}

impl Failure for VolumeError {
    fn gate(&self) -> Option<&GateError> {
        match self {
            VolumeError::Gate(gate) => Some(gate),
            _ => None,
        }
    }

    fn counts(&self) -> bool {
        !matches!(self, VolumeError::Transient(_) | VolumeError::Gate(_))
    }

    fn label(&self) -> &'static str {
        match self {
            VolumeError::Guest(CallError::Fault { kind, .. }) => kind.as_str(),
            VolumeError::Guest(_) => "final",
            VolumeError::Transient(_) => "transient",
            VolumeError::Convert(_) => "invalid-volume",
            VolumeError::Kube(_) => "api",
            VolumeError::Timeout(_) => "timeout",
            VolumeError::Gate(_) => "not-leader",
        }
    }

    fn timed_out(after: Duration) -> Self {
        VolumeError::Timeout(after)
    }
}

fn volume_fingerprint(pv: &PersistentVolume) -> u64 {
    fingerprint(&pv.spec)
}

/// Reconciles one PV: opens its gate scope, then runs [`delete`] with the shared bookkeeping.
pub async fn reconcile(
    pv: Arc<PersistentVolume>,
    ctx: Arc<Context>,
) -> Result<Action, VolumeError> {
    let name = pv.name_any();
    let key = LockKey::Volume(pv.metadata.uid.clone().unwrap_or_else(|| name.clone()));
    let handle = Handle::open(&ctx, key)?;
    let class = pv
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .unwrap_or_default();
    let claim_ref = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
    let span = info_span!(
        "volume",
        pv = %name,
        class = %class,
        namespace = claim_ref.and_then(|r| r.namespace.clone()).unwrap_or_default(),
        claim = claim_ref.and_then(|r| r.name.clone()).unwrap_or_default(),
        guest = tracing::field::Empty,
    );
    let tracked = Tracked {
        key: name,
        fingerprint: volume_fingerprint(&pv),
        reference: pv.object_ref(&()),
        operation: Operation::Delete { class },
    };
    ctx.volume_book
        .track(&handle, &tracked, span, delete(&handle, &pv))
        .await
        .0
}

/// Requeue policy: the shared one (see [`super::bookkeeping::Book::requeue`]).
pub fn error_policy(pv: Arc<PersistentVolume>, error: &VolumeError, ctx: Arc<Context>) -> Action {
    ctx.volume_book
        .requeue(&ctx, &pv.name_any(), volume_fingerprint(&pv), error)
}

/// The controller's entry: a settled PV (bound, finalizers in place) has nothing to do, so only
/// a whole one is reconciled.
pub async fn reconcile_cached(
    cached: Arc<CachedVolume>,
    ctx: Arc<Context>,
) -> Result<Action, VolumeError> {
    match cached.whole() {
        Some(pv) => reconcile(pv.clone(), ctx).await,
        None => Ok(Action::await_change()),
    }
}

/// The controller's requeue policy (only whole PVs can fail).
pub fn error_policy_cached(
    cached: Arc<CachedVolume>,
    error: &VolumeError,
    ctx: Arc<Context>,
) -> Action {
    match cached.whole() {
        Some(pv) => error_policy(pv.clone(), error, ctx),
        None => Action::await_change(),
    }
}

async fn delete(handle: &Handle<'_>, pv: &PersistentVolume) -> Result<Done, VolumeError> {
    let ctx = handle.ctx();
    let plugins = ctx.plugins();
    let name = pv.name_any();
    if let Some(node) = &ctx.node {
        match node.volume_owner(pv) {
            VolumeOwner::Mine => {}
            VolumeOwner::OtherNode | VolumeOwner::NotPinned => return Ok(Done::Nothing),
            VolumeOwner::NodeGone(gone) => return delete_node_gone(handle, pv, &gone).await,
        }
    }
    let ours = decide::claim_provisioner_of_volume(pv).is_some_and(|p| plugins.serves(p));
    if ours && let Some(add) = decide::pv_finalizer_change(pv, ctx.settings.add_pv_finalizer) {
        handle.set_pv_finalizer::<VolumeError>(pv, add).await?;
        return Ok(Done::Nothing);
    }
    let Some(provisioner) =
        decide::should_delete(pv, |p| plugins.serves(p), ctx.settings.add_pv_finalizer)
    else {
        wait_for_guest(handle, pv, &plugins);
        return Ok(Done::Nothing);
    };
    if handle.recently_deleted(pv) && !has_finalizer(&pv.metadata.finalizers, FINALIZER_PV) {
        // Updates sent before our delete landed still arrive: nothing to re-read. (With our PV
        // finalizer still on it, the removal below is what is left to do.)
        return Ok(Done::Nothing);
    }
    let guest = plugins
        .for_provisioner(provisioner)
        .expect("served")
        .clone();
    tracing::Span::current().record("guest", guest.name());
    let volume = convert::volume(pv)?;
    if !handle
        .guest(guest.should_delete(&volume))
        .await?
        .map_err(VolumeError::Guest)?
    {
        tracing::debug!("guest's deletion guard kept the volume");
        return Ok(Done::Nothing);
    }
    // Re-read from the API server: the cache may be behind (the PV rebound, already deleted).
    let Some(live) = handle.get_pv(&name).await? else {
        return Ok(Done::Nothing);
    };
    if live.metadata.uid != pv.metadata.uid
        || decide::should_delete(&live, |p| plugins.serves(p), ctx.settings.add_pv_finalizer)
            .is_none()
    {
        return Ok(Done::Nothing);
    }
    let class_name = live
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .unwrap_or_default();
    let request = DeleteRequest {
        volume: convert::volume(&live)?,
        storage_class: ctx.class(&class_name).map(|c| convert::storage_class(&c)),
        config: guest.grants().config_json.clone(),
    };
    match handle.guest(guest.delete(&request)).await? {
        Ok(()) => {}
        Err(CallError::Guest {
            error: ProvisionError::Ignored(reason),
            ..
        }) => {
            tracing::debug!(%reason, "guest ignored the volume");
            return Ok(Done::Nothing);
        }
        Err(CallError::Guest {
            error: ProvisionError::Transient(m) | ProvisionError::InBackground(m),
            ..
        }) => return Err(VolumeError::Transient(m)),
        Err(error) => {
            handle.event(
                &live.object_ref(&()),
                true,
                events::VOLUME_FAILED_DELETE,
                "Delete",
                error.to_string(),
            );
            return Err(VolumeError::Guest(error));
        }
    }
    remove_pv(handle, &live).await?;
    tracing::info!(guest = guest.name(), "volume deleted");
    Ok(Done::Succeeded)
}

/// Deletes the PV object we looked at (UID precondition), then our PV finalizer if it has one.
/// Returns whether this call deleted it (false: already gone).
async fn remove_pv(handle: &Handle<'_>, live: &PersistentVolume) -> Result<bool, VolumeError> {
    let deleted = handle.delete_pv::<VolumeError>(live).await?;
    if handle.ctx().settings.add_pv_finalizer
        && has_finalizer(&live.metadata.finalizers, FINALIZER_PV)
        && let Some(current) = handle.get_pv(&live.name_any()).await?
    {
        handle
            .set_pv_finalizer::<VolumeError>(&current, false)
            .await?;
    }
    Ok(deleted)
}

/// Node mode: a Released PV pinned to a node that no longer exists. Its storage went with the
/// node, so no guest is called: after `--node-gone-grace` (a node briefly re-registering must not
/// lose its volumes) any instance deletes the PV object and says so in an event. Instances race
/// harmlessly: the UID precondition lets one delete win.
async fn delete_node_gone(
    handle: &Handle<'_>,
    pv: &PersistentVolume,
    gone: &str,
) -> Result<Done, VolumeError> {
    let ctx = handle.ctx();
    let plugins = ctx.plugins();
    let finalizer_mode = ctx.settings.add_pv_finalizer;
    if decide::should_delete(pv, |p| plugins.serves(p), finalizer_mode).is_none() {
        return Ok(Done::Nothing);
    }
    let node = ctx.node.as_ref().expect("node mode");
    if let Some(wait) = node.gone_wait(gone) {
        tracing::info!(
            node = gone,
            ?wait,
            "volume's node is missing; deleting the PV without cleanup once the grace period is over"
        );
        return Ok(Done::RetryIn(wait));
    }
    // The cache may lag a node that came back: ask the API server before deleting.
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    handle.budget().await;
    let back = match node::pinned_node(pv) {
        Some(node::Pin::Name(name)) => nodes.get_metadata_opt(name).await?.is_some(),
        _ => !nodes
            .list_metadata(
                &ListParams::default()
                    .labels(&format!("{}={gone}", node::HOSTNAME_LABEL))
                    .limit(1),
            )
            .await?
            .items
            .is_empty(),
    };
    if back {
        node.node_seen(gone);
        return Ok(Done::Nothing);
    }
    let Some(live) = handle.get_pv(&pv.name_any()).await? else {
        return Ok(Done::Nothing);
    };
    if live.metadata.uid != pv.metadata.uid
        || decide::should_delete(&live, |p| plugins.serves(p), finalizer_mode).is_none()
    {
        return Ok(Done::Nothing);
    }
    let first = live.metadata.deletion_timestamp.is_none();
    if remove_pv(handle, &live).await? && first {
        let grace = node.settings.gone_grace;
        tracing::warn!(
            node = gone,
            "deleted the PV of a removed node without cleaning up its storage"
        );
        handle.event(
            &live.object_ref(&()),
            true,
            events::DELETED_NODE_GONE,
            "Delete",
            format!("Node {gone} no longer exists (missing for over {grace:?}): deleted the volume without cleaning up its storage, which was on that node"),
        );
        return Ok(Done::Succeeded);
    }
    Ok(Done::Nothing)
}

/// A volume that would be deleted if its guest were loaded gets an event saying it waits; a
/// plugins reload re-runs every volume, so it is deleted once the guest is back.
fn wait_for_guest(handle: &Handle<'_>, pv: &PersistentVolume, plugins: &Plugins) {
    let finalizer_mode = handle.ctx().settings.add_pv_finalizer;
    let unavailable = |p: &str| matches!(plugins.availability(p), Availability::Unavailable(_));
    let Some(provisioner) = decide::should_delete(pv, unavailable, finalizer_mode) else {
        return;
    };
    let why = plugins.why_not_served(provisioner);
    handle.event(
        &pv.object_ref(&()),
        true,
        events::WAITING_FOR_GUEST,
        "Delete",
        format!(
            "No guest serves {provisioner} right now ({why}); the volume's storage is deleted once a guest for it is loaded again"
        ),
    );
}
