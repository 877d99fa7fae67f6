//! The delete path: one reconcile per PV, from "released and ours?" to storage and PV gone.
//!
//! What to do is decided by [`plan::plan_volume`]; the guest is asked through [`storage`], and a
//! volume's intent-log entry is written by [`storage::volume_entry`]: this module says which PVs
//! are queued for delete ([`queued_for_delete`]) and executes.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use tracing::info_span;

use super::Context;
use super::bookkeeping::{Done, Failure, Operation, Tracked};
use super::cache::CachedVolume;
use super::decide::{self, FINALIZER_PV, Serving, has_finalizer};
use super::events::{self, Event, EventAction};
use super::failures::fingerprint;
use super::gate::{GateError, LockKey};
use super::handle::{Handle, PvDeleted};
use super::node::{self, VolumeOwner};
use super::plan::{self, DeleteOrder, OurDelete, VolumeFacts, VolumePlan};
use super::storage::intent::IntentError;
use super::storage::{self, Deleted, StorageError, volume_entry};
use crate::controller::convert::ConvertError;
use crate::wasm::{CallError, Guest, Plugins};

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
    /// The intent log could not be written (nothing was deleted).
    #[error(transparent)]
    Intent(#[from] IntentError),
}

impl From<StorageError> for VolumeError {
    fn from(error: StorageError) -> Self {
        if let Some(message) = error.retry_later() {
            return VolumeError::Transient(message.to_string());
        }
        match error {
            StorageError::Convert(error) => VolumeError::Convert(error),
            StorageError::Guest(error) => VolumeError::Guest(error),
            StorageError::Kube(error) => VolumeError::Kube(error),
            StorageError::Gate(error) => VolumeError::Gate(error),
            StorageError::Intent(error) => VolumeError::Intent(error),
        }
    }
}

impl Failure for VolumeError {
    fn gate_refusal(&self) -> Option<&GateError> {
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
            VolumeError::Intent(_) => "intent",
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
    let class = class_name_of(&pv);
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
    let result = ctx
        .volume_book
        .track(&handle, &tracked, span, delete(&handle, &pv))
        .await
        .0;
    volume_entry::attempt_over(&ctx, &pv);
    result
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

/// What the volume plan reads, answered from the caches, the settings and our recent writes.
struct Facts<'a> {
    ctx: &'a Context,
    plugins: &'a Plugins,
    pv: &'a PersistentVolume,
}

impl VolumeFacts for Facts<'_> {
    type Guest = Arc<Guest>;

    fn guest(&self, provisioner: &str) -> Option<Arc<Guest>> {
        self.plugins.for_deleting(provisioner).cloned()
    }

    fn owner(&self) -> Option<VolumeOwner> {
        Some(self.ctx.node.as_ref()?.volume_owner(self.pv))
    }

    fn serving(&self, provisioner: &str) -> Serving {
        // A last good module kept only to delete serves this path, whose work is deleting;
        // never the claims' path.
        if self.plugins.deletes(provisioner) {
            return Serving::Yes;
        }
        super::claims::serving(self.plugins, provisioner)
    }

    fn finalizer_mode(&self) -> bool {
        self.ctx.settings.add_pv_finalizer
    }

    fn our_delete(&self) -> OurDelete {
        self.ctx
            .recent
            .our_delete(self.pv.metadata.uid.as_deref().unwrap_or_default())
    }
}

/// Executes the plan for one PV.
async fn delete(handle: &Handle<'_>, pv: &PersistentVolume) -> Result<Done, VolumeError> {
    let ctx = handle.ctx();
    let plugins = ctx.plugins();
    let facts = Facts {
        ctx,
        plugins: &plugins,
        pv,
    };
    let (order, guest) = match plan::plan_volume(pv, &facts) {
        VolumePlan::Skip(reason) => {
            tracing::trace!(reason, "not deleting");
            return Ok(Done::Nothing);
        }
        VolumePlan::NodeGone(gone) => return delete_node_gone(handle, pv, &gone).await,
        VolumePlan::SetFinalizer(add) => {
            handle.set_pv_finalizer::<VolumeError>(pv, add).await?;
            return Ok(Done::Nothing);
        }
        VolumePlan::Keep => {
            volume_entry::forget(ctx, pv);
            return Ok(Done::Nothing);
        }
        VolumePlan::WaitForGuest(provisioner) => {
            volume_entry::forget(ctx, pv);
            wait_for_guest(handle, pv, provisioner, &plugins);
            return Ok(Done::Nothing);
        }
        VolumePlan::Delete { order, guest, .. } => (order, guest),
    };
    tracing::Span::current().record("guest", guest.name());
    // Without a precondition on the delete (storage first), the guard is asked about the PV as
    // the API server has it now; the other orders delete only the version the cache showed.
    let guarded = match order {
        DeleteOrder::StorageFirst => match reread_deletable(handle, pv, &plugins).await? {
            Some(live) => Cow::Owned(live),
            None => return Ok(Done::Nothing),
        },
        DeleteOrder::BehindFinalizer => Cow::Borrowed(pv),
    };
    if !handle
        .guest(storage::guard(&guest, &guarded))
        .await?
        .map_err(VolumeError::from)?
    {
        tracing::debug!("guest's deletion guard kept the volume");
        volume_entry::forget(ctx, pv);
        return Ok(Done::Nothing);
    }
    let live = match order {
        DeleteOrder::BehindFinalizer => {
            // Marked for deletion first, with the version decided on as precondition (the API
            // server's own check that the cache was not behind: the Released, `Delete`,
            // claimRef-set version judged above is the one that goes); the finalizer comes off
            // once the storage is gone, and a failed delete stays in sight as a Terminating PV.
            // Killed after this DELETE, the PV stays terminating with our finalizer, and the
            // next leader deletes the storage from what the live PV says.
            match handle.delete_pv_unchanged::<VolumeError>(pv).await? {
                PvDeleted::Now => pv.clone(),
                PvDeleted::Changed | PvDeleted::Gone => return Ok(Done::Nothing),
            }
        }
        DeleteOrder::StorageFirst => guarded.into_owned(),
    };
    let class = ctx.class(&class_name_of(&live));
    if !delete_storage(handle, &live, &guest, class.as_deref()).await? {
        return Ok(Done::Nothing);
    }
    if order == DeleteOrder::BehindFinalizer {
        handle.set_pv_finalizer::<VolumeError>(&live, false).await?;
    } else {
        remove_pv(handle, &live).await?;
    }
    handle.delete_finished(&live);
    tracing::info!(guest = guest.name(), "volume deleted");
    Ok(Done::Succeeded)
}

/// The PV as the API server has it now, if it is still the one decided on and still to be
/// deleted: the cache may be behind (rebound, switched to Retain, re-annotated, deleted).
async fn reread_deletable(
    handle: &Handle<'_>,
    pv: &PersistentVolume,
    plugins: &Plugins,
) -> Result<Option<PersistentVolume>, VolumeError> {
    let finalizer_mode = handle.ctx().settings.add_pv_finalizer;
    Ok(handle.get_pv(&pv.name_any()).await?.filter(|live| {
        live.metadata.uid == pv.metadata.uid
            && decide::should_delete(live, |p| plugins.deletes(p), finalizer_mode).is_some()
    }))
}

/// The provisioner whose guest the volume path will ask to delete this cached PV's storage:
/// what [`plan::plan_volume`] decides for it now (Released, ours, on this node, not deleted by us
/// already). Recovery asks it, and leaves a volume entry of an earlier version to this path
/// while it will delete the PV.
pub fn queued_for_delete<'a>(
    ctx: &Context,
    plugins: &Plugins,
    pv: &'a PersistentVolume,
) -> Option<&'a str> {
    let facts = Facts { ctx, plugins, pv };
    match plan::plan_volume(pv, &facts) {
        VolumePlan::Delete { provisioner, .. } => Some(provisioner),
        _ => None,
    }
}

fn class_name_of(pv: &PersistentVolume) -> String {
    pv.spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .unwrap_or_default()
}

/// Asks the guest to delete the volume's storage. `Ok(false)`: the guest says it holds none of
/// it (ignored). A failure gets a `VolumeFailedDelete` event.
async fn delete_storage(
    handle: &Handle<'_>,
    pv: &PersistentVolume,
    guest: &Guest,
    class: Option<&StorageClass>,
) -> Result<bool, VolumeError> {
    match handle.guest(storage::delete(guest, pv, class)).await? {
        Ok(Deleted::Gone) => Ok(true),
        Ok(Deleted::NotHeld(reason)) => {
            tracing::debug!(%reason, "guest ignored the volume");
            Ok(false)
        }
        Err(error) => {
            let error = VolumeError::from(error);
            if let VolumeError::Guest(call) = &error {
                handle.event(
                    &pv.object_ref(&()),
                    Event::warning(
                        events::VOLUME_FAILED_DELETE,
                        EventAction::Delete,
                        call.to_string(),
                    ),
                );
            }
            Err(error)
        }
    }
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
    if decide::should_delete(pv, |p| plugins.deletes(p), finalizer_mode).is_none() {
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
    let pin = match node::pinned_node(pv) {
        Some(node::Pin::Name(name)) => node::Pin::Name(name),
        _ => node::Pin::Hostname(gone),
    };
    if handle.node_exists(pin).await? {
        node.node_seen(gone);
        return Ok(Done::Nothing);
    }
    let Some(live) = handle.get_pv(&pv.name_any()).await? else {
        return Ok(Done::Nothing);
    };
    if live.metadata.uid != pv.metadata.uid
        || decide::should_delete(&live, |p| plugins.deletes(p), finalizer_mode).is_none()
    {
        return Ok(Done::Nothing);
    }
    let first = live.metadata.deletion_timestamp.is_none();
    let removed = remove_pv(handle, &live).await?;
    handle.delete_finished(&live);
    if removed && first {
        let grace = node.settings.gone_grace;
        tracing::warn!(
            node = gone,
            "deleted the PV of a removed node without cleaning up its storage"
        );
        handle.event(&live.object_ref(&()), Event::warning(events::DELETED_NODE_GONE, EventAction::Delete, format!("Node {gone} no longer exists (missing for over {grace:?}): deleted the volume without cleaning up its storage, which was on that node")));
        return Ok(Done::Succeeded);
    }
    Ok(Done::Nothing)
}

/// A volume that would be deleted if its guest were loaded gets an event saying it waits; a
/// plugins reload re-runs every volume, so it is deleted once the guest is back.
fn wait_for_guest(
    handle: &Handle<'_>,
    pv: &PersistentVolume,
    provisioner: &str,
    plugins: &Plugins,
) {
    let why = plugins.why_not_served(provisioner);
    handle.event(&pv.object_ref(&()), Event::warning(events::WAITING_FOR_GUEST, EventAction::Delete, format!(
            "No guest serves {provisioner} right now ({why}); the volume's storage is deleted once a guest for it is loaded again"
        )));
}
