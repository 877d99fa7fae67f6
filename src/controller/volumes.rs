//! The delete path: one reconcile per PV, from "released and ours?" to storage and PV gone.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolume};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use tracing::{Instrument, info_span};

use super::Context;
use super::decide::{self, FINALIZER_PV, has_finalizer};
use super::events::{self, publish};
use super::failures::fingerprint;
use super::gate::{self, GateError, LockKey};
use super::node::{self, VolumeOwner};
use crate::metrics::Queue;
use crate::wasm::bindings::types::{DeleteRequest, ProvisionError};
use crate::wasm::convert::{self, ConvertError};
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

impl VolumeError {
    /// Whether this failure counts toward `--failed-delete-threshold`.
    pub fn counts(&self) -> bool {
        !matches!(self, VolumeError::Transient(_) | VolumeError::Gate(_))
    }

    /// Short label for logs and metrics.
    pub fn label(&self) -> &'static str {
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
}

/// How a delete attempt that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    /// The storage and the PV are gone.
    Deleted,
    /// Nothing to do (not ours, not released, kept by the guest, finalizer bookkeeping).
    Nothing,
    /// Look again after this long (node mode: a node not yet gone for the grace period).
    RetryIn(Duration),
}

fn volume_fingerprint(pv: &PersistentVolume) -> u64 {
    fingerprint(&pv.spec)
}

/// Reconciles one PV under the write gate (per-claim mode: the volume's own lease).
pub async fn reconcile(
    pv: Arc<PersistentVolume>,
    ctx: Arc<Context>,
) -> Result<Action, VolumeError> {
    let key = LockKey::Volume(pv.metadata.uid.clone().unwrap_or_else(|| pv.name_any()));
    gate::scope(ctx.election.clone(), key, reconcile_gated(pv, ctx)).await
}

/// Bookkeeping around [`delete`].
async fn reconcile_gated(
    pv: Arc<PersistentVolume>,
    ctx: Arc<Context>,
) -> Result<Action, VolumeError> {
    let name = pv.name_any();
    let fp = volume_fingerprint(&pv);
    if ctx
        .volume_failures
        .lock()
        .expect("lock")
        .is_given_up(&name, fp)
    {
        return Ok(Action::await_change());
    }
    let reconciling = ctx.metrics.reconcile_started(Queue::Volumes, &name);
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
    let timeout = ctx.settings.delete_timeout;
    let outcome = match tokio::time::timeout(
        timeout,
        delete(pv.clone(), ctx.clone()).instrument(span.clone()),
    )
    .await
    {
        Ok(outcome) => outcome,
        Err(_) => Err(VolumeError::Timeout(timeout)),
    };
    if let Ok(Done::Deleted) = outcome {
        ctx.metrics.delete_succeeded(&class, reconciling.elapsed());
    }
    if let Err(error @ VolumeError::Gate(_)) = &outcome {
        tracing::debug!(parent: &span, %error, "not deleting on this replica now");
    } else if let Err(error) = &outcome {
        let _entered = span.enter();
        tracing::warn!(%error, kind = error.label(), "deleting volume failed");
        ctx.metrics.delete_failed(&class, error.label());
        if error.counts() {
            let threshold = ctx.settings.failed_delete_threshold;
            let failures = ctx
                .volume_failures
                .lock()
                .expect("lock")
                .record_failure(&name, fp);
            if decide::exceeded_threshold(failures, threshold) {
                ctx.volume_failures.lock().expect("lock").give_up(&name, fp);
                publish(
                    &ctx.recorder,
                    &pv.object_ref(&()),
                    true,
                    events::DELETE_GIVEN_UP,
                    "Delete",
                    format!("Giving up after {failures} failed attempts (threshold {threshold}); the last error was: {error}. Change the volume or restart the provisioner to retry."),
                )
                .await;
            }
        }
    }
    outcome.map(|done| match done {
        Done::RetryIn(wait) => Action::requeue(wait),
        Done::Deleted | Done::Nothing => Action::await_change(),
    })
}

/// Requeue policy for volumes.
pub fn error_policy(pv: Arc<PersistentVolume>, error: &VolumeError, ctx: Arc<Context>) -> Action {
    if let VolumeError::Gate(gate) = error {
        return gate
            .retry_in()
            .map_or_else(Action::await_change, Action::requeue);
    }
    let settings = &ctx.settings;
    let mut book = ctx.volume_failures.lock().expect("lock");
    let name = pv.name_any();
    let fp = volume_fingerprint(&pv);
    if book.is_given_up(&name, fp) {
        return Action::await_change();
    }
    ctx.metrics.retry_scheduled(Queue::Volumes, &name);
    if !error.counts() {
        return Action::requeue(settings.retry_interval_start);
    }
    Action::requeue(decide::backoff(
        book.failures(&name, fp),
        settings.retry_interval_start,
        settings.retry_interval_max,
    ))
}

async fn delete(pv: Arc<PersistentVolume>, ctx: Arc<Context>) -> Result<Done, VolumeError> {
    let plugins = ctx.plugins();
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let name = pv.name_any();
    if let Some(node) = &ctx.node {
        match node.volume_owner(&pv) {
            VolumeOwner::Mine => {}
            VolumeOwner::OtherNode | VolumeOwner::NotPinned => return Ok(Done::Nothing),
            VolumeOwner::NodeGone(gone) => return delete_node_gone(&ctx, &pv, &gone).await,
        }
    }
    let ours = decide::claim_provisioner_of_volume(&pv).is_some_and(|p| plugins.serves(p));
    if ours && let Some(add) = decide::pv_finalizer_change(&pv, ctx.settings.add_pv_finalizer) {
        set_pv_finalizer(&ctx, &pvs, &pv, add).await?;
        return Ok(Done::Nothing);
    }
    let Some(provisioner) =
        decide::should_delete(&pv, |p| plugins.serves(p), ctx.settings.add_pv_finalizer)
    else {
        wait_for_guest(&ctx, &pv, &plugins).await;
        return Ok(Done::Nothing);
    };
    let guest = plugins
        .for_provisioner(provisioner)
        .expect("served")
        .clone();
    tracing::Span::current().record("guest", guest.name());
    let volume = convert::volume(&pv)?;
    ctx.write_gate().await?;
    if !guest
        .should_delete(&volume)
        .await
        .map_err(VolumeError::Guest)?
    {
        tracing::debug!("guest's deletion guard kept the volume");
        return Ok(Done::Nothing);
    }
    // Re-read from the API server: the cache may be behind (the PV rebound, already deleted).
    ctx.api_budget().await;
    let Some(live) = pvs.get_opt(&name).await? else {
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
    ctx.write_gate().await?;
    match guest.delete(&request).await {
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
            publish(
                &ctx.recorder,
                &live.object_ref(&()),
                true,
                events::VOLUME_FAILED_DELETE,
                "Delete",
                error.to_string(),
            )
            .await;
            return Err(VolumeError::Guest(error));
        }
    }
    remove_pv(&ctx, &pvs, &live).await?;
    ctx.volume_failures.lock().expect("lock").forget(&name);
    tracing::info!(guest = guest.name(), "volume deleted");
    Ok(Done::Deleted)
}

/// Deletes the PV object we looked at (UID precondition), then our PV finalizer if it has one.
/// Returns whether this call deleted it (false: already gone).
async fn remove_pv(
    ctx: &Context,
    pvs: &Api<PersistentVolume>,
    live: &PersistentVolume,
) -> Result<bool, VolumeError> {
    let name = live.name_any();
    ctx.write_gate().await?;
    ctx.api_budget().await;
    let deleted = match pvs
        .delete(&name, &DeleteParams::default().preconditions_uid(live))
        .await
    {
        Ok(_) => true,
        Err(kube::Error::Api(status)) if status.is_not_found() => false,
        Err(error) => return Err(error.into()),
    };
    if ctx.settings.add_pv_finalizer && has_finalizer(&live.metadata.finalizers, FINALIZER_PV) {
        ctx.api_budget().await;
        if let Some(current) = pvs.get_opt(&name).await? {
            set_pv_finalizer(ctx, pvs, &current, false).await?;
        }
    }
    Ok(deleted)
}

/// Node mode: a Released PV pinned to a node that no longer exists. Its storage went with the
/// node, so no guest is called: after `--node-gone-grace` (a node briefly re-registering must not
/// lose its volumes) any instance deletes the PV object and says so in an event. Instances race
/// harmlessly: the UID precondition lets one delete win.
async fn delete_node_gone(
    ctx: &Context,
    pv: &PersistentVolume,
    gone: &str,
) -> Result<Done, VolumeError> {
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
    ctx.api_budget().await;
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
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    ctx.api_budget().await;
    let Some(live) = pvs.get_opt(&pv.name_any()).await? else {
        return Ok(Done::Nothing);
    };
    if live.metadata.uid != pv.metadata.uid
        || decide::should_delete(&live, |p| plugins.serves(p), finalizer_mode).is_none()
    {
        return Ok(Done::Nothing);
    }
    let first = live.metadata.deletion_timestamp.is_none();
    if remove_pv(ctx, &pvs, &live).await? && first {
        let grace = node.settings.gone_grace;
        tracing::warn!(
            node = gone,
            "deleted the PV of a removed node without cleaning up its storage"
        );
        publish(
            &ctx.recorder,
            &live.object_ref(&()),
            true,
            events::DELETED_NODE_GONE,
            "Delete",
            format!("Node {gone} no longer exists (missing for over {grace:?}): deleted the volume without cleaning up its storage, which was on that node"),
        )
        .await;
        return Ok(Done::Deleted);
    }
    Ok(Done::Nothing)
}

trait PreconditionsUid {
    fn preconditions_uid(self, pv: &PersistentVolume) -> Self;
}

impl PreconditionsUid for DeleteParams {
    /// Deletes only the PV we looked at, never a namesake created since.
    fn preconditions_uid(mut self, pv: &PersistentVolume) -> Self {
        self.preconditions = Some(kube::api::Preconditions {
            uid: pv.metadata.uid.clone(),
            resource_version: None,
        });
        self
    }
}

async fn set_pv_finalizer(
    ctx: &Context,
    pvs: &Api<PersistentVolume>,
    pv: &PersistentVolume,
    present: bool,
) -> Result<(), VolumeError> {
    // A strategic-merge patch touches only our entry of the list: no resourceVersion, so no
    // conflict with kube-controller-manager's pv-protection controller writing the same PV.
    let patch = decide::finalizer_patch(&pv.metadata.uid, FINALIZER_PV, present);
    ctx.write_gate().await?;
    ctx.api_budget().await;
    match pvs
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

/// A volume that would be deleted if its guest were loaded gets an event saying it waits; a
/// plugins reload re-runs every volume, so it is deleted once the guest is back.
async fn wait_for_guest(ctx: &Context, pv: &PersistentVolume, plugins: &Plugins) {
    let unavailable = |p: &str| matches!(plugins.availability(p), Availability::Unavailable(_));
    let Some(provisioner) = decide::should_delete(pv, unavailable, ctx.settings.add_pv_finalizer)
    else {
        return;
    };
    let why = plugins.why_not_served(provisioner);
    publish(
        &ctx.recorder,
        &pv.object_ref(&()),
        true,
        events::WAITING_FOR_GUEST,
        "Delete",
        format!(
            "No guest serves {provisioner} right now ({why}); the volume's storage is deleted once a guest for it is loaded again"
        ),
    )
    .await;
}
