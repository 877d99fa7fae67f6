//! The provision path: one reconcile per claim, from "is it ours?" to a created PV.
//!
//! Intent is recorded durably before any guest call: our finalizer on the claim. It comes off
//! only once the PV exists or the storage is gone, so a claim deleted mid-provision, or a
//! controller killed between the guest call and the PV create, ends with exactly one PV or no
//! storage, never an orphan.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tracing::{Instrument, info_span};

use super::Context;
use super::decide::{self, ClaimDecision, FINALIZER_CLAIM, has_finalizer};
use super::events::{self, publish};
use super::failures::fingerprint;
use super::gate::{self, GateError, LockKey};
use super::node::{self, ClaimOwner};
use crate::metrics::Queue;
use crate::wasm::bindings::types::{DeleteRequest, ProvisionError, ProvisionRequest};
use crate::wasm::convert::{self, ConvertError, PvIdentity};
use crate::wasm::{Availability, CallError, Guest, Plugins};

/// Why a claim reconcile did not finish.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The claim's class is not in the cache (yet).
    #[error("storageclass.storage.k8s.io {0:?} not found")]
    ClassNotFound(String),
    /// The guest failed for good (final error, fault or a refused volume).
    #[error(transparent)]
    Guest(CallError),
    /// The guest asked to be retried.
    #[error("{0}")]
    Transient(String),
    /// The guest is still working in the background.
    #[error("provisioning in background: {0}")]
    InBackground(String),
    /// The PV could not be created; its storage was deleted again.
    #[error("creating PV {pv}: {source}")]
    CreatePv {
        /// The PV name.
        pv: String,
        /// The last API error.
        #[source]
        source: kube::Error,
    },
    /// The PV could not be created and its storage could not be deleted either.
    #[error("cleaning up storage of PV {pv} failed: {source}")]
    Cleanup {
        /// The PV name.
        pv: String,
        /// The guest's error.
        #[source]
        source: CallError,
    },
    /// The claim cannot be expressed in the contract.
    #[error(transparent)]
    Convert(#[from] ConvertError),
    /// An API request failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The whole operation ran past `--provision-timeout`.
    #[error("provisioning did not finish within {0:?}")]
    Timeout(Duration),
    /// The claim has no UID (never from a real API server).
    #[error("claim has no uid")]
    NoUid,
    /// This replica may not write now (not the leader, or another replica holds the claim).
    #[error(transparent)]
    Gate(#[from] GateError),
}

impl ClaimError {
    /// Whether this failure counts toward `--failed-provision-threshold`.
    pub fn counts(&self) -> bool {
        !matches!(
            self,
            ClaimError::Transient(_) | ClaimError::InBackground(_) | ClaimError::Gate(_)
        )
    }

    /// Short label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            ClaimError::ClassNotFound(_) => "class-not-found",
            ClaimError::Guest(CallError::Fault { kind, .. }) => kind.as_str(),
            ClaimError::Guest(CallError::Rejected { .. }) => "rejected",
            ClaimError::Guest(CallError::Guest { .. }) => "final",
            ClaimError::Transient(_) => "transient",
            ClaimError::InBackground(_) => "in-background",
            ClaimError::CreatePv { .. } => "create-pv",
            ClaimError::Cleanup { .. } => "cleanup",
            ClaimError::Convert(_) => "invalid-claim",
            ClaimError::Kube(_) => "api",
            ClaimError::Timeout(_) => "timeout",
            ClaimError::NoUid => "invalid-claim",
            ClaimError::Gate(_) => "not-leader",
        }
    }
}

/// How a provision attempt that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    /// A PV was created for the claim.
    Provisioned,
    /// Nothing to do, or the claim was settled without a PV (ignored, abandoned, cleaned up).
    Nothing,
    /// Look again after this long (node mode: the wait before competing for a claim).
    RetryIn(Duration),
}

/// The data-source kind of a claim, the library's `source` metric label ("" without one).
fn source_kind(pvc: &PersistentVolumeClaim) -> String {
    pvc.spec
        .as_ref()
        .and_then(|s| s.data_source.as_ref())
        .map(|d| d.kind.clone())
        .unwrap_or_default()
}

/// What identifies "the same claim spec" for give-up purposes.
fn claim_fingerprint(pvc: &PersistentVolumeClaim) -> u64 {
    fingerprint(&(
        &pvc.spec,
        decide::claim_provisioner(pvc),
        decide::claim_class(pvc),
        decide::selected_node(pvc),
    ))
}

/// Claims that name `class` and are still unbound: re-checked when the class appears or changes.
pub fn claims_of_class(
    claims: &Store<PersistentVolumeClaim>,
    class: &StorageClass,
) -> Vec<ObjectRef<PersistentVolumeClaim>> {
    let name = class.name_any();
    claims
        .state()
        .iter()
        .filter(|c| decide::claim_class(c) == Some(name.as_str()))
        .filter(|c| {
            c.spec
                .as_ref()
                .and_then(|s| s.volume_name.as_ref())
                .is_none()
        })
        .map(|c| ObjectRef::from_obj(c.as_ref()))
        .collect()
}

/// Reconciles one claim under the write gate (per-claim mode: the claim's own lease).
pub async fn reconcile(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
) -> Result<Action, ClaimError> {
    let uid = pvc.metadata.uid.clone().ok_or(ClaimError::NoUid)?;
    gate::scope(
        ctx.election.clone(),
        LockKey::Claim(uid),
        reconcile_gated(pvc, ctx),
    )
    .await
}

/// Bookkeeping around [`provision`].
async fn reconcile_gated(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
) -> Result<Action, ClaimError> {
    let uid = pvc.metadata.uid.clone().ok_or(ClaimError::NoUid)?;
    let reconciling = ctx.metrics.reconcile_started(Queue::Claims, &uid);
    let class = decide::claim_class(&pvc).unwrap_or_default().to_string();
    let span = info_span!(
        "claim",
        namespace = %pvc.namespace().unwrap_or_default(),
        claim = %pvc.name_any(),
        %uid,
        pv = decide::pv_name(&pvc).unwrap_or_default(),
        class = %class,
        guest = tracing::field::Empty,
    );
    let fp = claim_fingerprint(&pvc);
    let deleting = pvc.metadata.deletion_timestamp.is_some();
    if !deleting
        && ctx
            .claim_failures
            .lock()
            .expect("lock")
            .is_given_up(&uid, fp)
    {
        return Ok(Action::await_change());
    }
    let timeout = ctx.settings.provision_timeout;
    let outcome = match tokio::time::timeout(
        timeout,
        provision(pvc.clone(), ctx.clone()).instrument(span.clone()),
    )
    .await
    {
        Ok(outcome) => outcome,
        Err(_) => Err(ClaimError::Timeout(timeout)),
    };
    match outcome {
        Ok(done) => {
            if done == Done::Provisioned {
                let took = reconciling.elapsed();
                ctx.metrics
                    .provision_succeeded(&class, &source_kind(&pvc), took);
            }
            if let Done::RetryIn(wait) = done {
                return Ok(Action::requeue(wait));
            }
            Ok(Action::await_change())
        }
        Err(error @ ClaimError::Gate(_)) => {
            tracing::debug!(parent: &span, %error, "not provisioning on this replica now");
            Err(error)
        }
        Err(error) => {
            let _entered = span.enter();
            tracing::warn!(%error, kind = error.label(), "provisioning failed");
            ctx.metrics
                .provision_failed(&class, &source_kind(&pvc), error.label());
            if error.counts() {
                let threshold = ctx.settings.failed_provision_threshold;
                let failures = ctx
                    .claim_failures
                    .lock()
                    .expect("lock")
                    .record_failure(&uid, fp);
                if decide::exceeded_threshold(failures, threshold) {
                    ctx.claim_failures.lock().expect("lock").give_up(&uid, fp);
                    tracing::warn!(failures, "giving up on claim");
                    publish(
                        &ctx.recorder,
                        &pvc.object_ref(&()),
                        true,
                        events::GIVEN_UP,
                        "Provision",
                        format!(
                            "Giving up after {failures} failed attempts (threshold {threshold}); the last error was: {error}. Change the claim or restart the provisioner to retry."
                        ),
                    )
                    .await;
                }
            }
            Err(error)
        }
    }
}

/// Requeue policy: exponential backoff for counted failures, the start interval for the rest.
pub fn error_policy(
    pvc: Arc<PersistentVolumeClaim>,
    error: &ClaimError,
    ctx: Arc<Context>,
) -> Action {
    let settings = &ctx.settings;
    let Some(uid) = pvc.metadata.uid.as_deref() else {
        return Action::await_change();
    };
    if let ClaimError::Gate(gate) = error {
        return gate
            .retry_in()
            .map_or_else(Action::await_change, Action::requeue);
    }
    let fp = claim_fingerprint(&pvc);
    let mut book = ctx.claim_failures.lock().expect("lock");
    if book.is_given_up(uid, fp) {
        return Action::await_change();
    }
    ctx.metrics.retry_scheduled(Queue::Claims, uid);
    if !error.counts() {
        return Action::requeue(settings.retry_interval_start);
    }
    let failures = book.failures(uid, fp);
    Action::requeue(decide::backoff(
        failures,
        settings.retry_interval_start,
        settings.retry_interval_max,
    ))
}

async fn provision(pvc: Arc<PersistentVolumeClaim>, ctx: Arc<Context>) -> Result<Done, ClaimError> {
    if pvc.metadata.deletion_timestamp.is_some() {
        // Node mode: only the claim's node holds (and can clean up) its storage; another node
        // finishing first would drop the finalizer that keeps that node's cleanup from leaking.
        if let Some(node) = &ctx.node
            && !node::cleans_up_deleted_claim(&pvc, &node.settings.name)
        {
            return Ok(Done::Nothing);
        }
        return finish_deleted_claim(&pvc, &ctx).await;
    }
    let plugins = ctx.plugins();
    let class = decide::claim_class(&pvc).and_then(|name| ctx.class(name));
    let decision = decide::should_provision(&pvc, |p| serving(&plugins, p), class.as_deref());
    let (provisioner, class_name) = match decision {
        ClaimDecision::GuestGone(provisioner) => {
            let why = plugins.why_not_served(provisioner);
            publish(
                &ctx.recorder,
                &pvc.object_ref(&()),
                true,
                events::WAITING_FOR_GUEST,
                "Provision",
                format!(
                    "No guest serves {provisioner} right now ({why}); the claim waits and is provisioned once a guest for it is loaded again"
                ),
            )
            .await;
            // Not a failure: a plugins reload re-runs every claim.
            return Ok(Done::Nothing);
        }
        ClaimDecision::Skip(reason) => {
            tracing::trace!(reason, "not provisioning");
            release_if_pv_exists(&pvc, &ctx).await?;
            return Ok(Done::Nothing);
        }
        ClaimDecision::ClassMissing(name) => {
            ctx.write_gate().await?;
            let error = ClaimError::ClassNotFound(name.to_string());
            warn_claim(&ctx, &pvc, events::PROVISIONING_FAILED, error.to_string()).await;
            return Err(error);
        }
        ClaimDecision::Provision { provisioner, class } => {
            (provisioner.to_string(), class.to_string())
        }
    };
    let class = class.expect("decided with a class");
    let guest = plugins
        .for_provisioner(&provisioner)
        .expect("decided for a served provisioner")
        .clone();
    tracing::Span::current().record("guest", guest.name());
    let pv_name = decide::pv_name(&pvc).ok_or(ClaimError::NoUid)?;
    if ctx.volumes.get(&ObjectRef::new(&pv_name)).is_some() || ctx.recently_created(&pv_name) {
        release_if_pv_exists(&pvc, &ctx).await?;
        return Ok(Done::Nothing);
    }
    if let Some(node) = &ctx.node {
        let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
        match node.claim_owner(&pvc, &class) {
            ClaimOwner::Mine => node.compete_done(uid),
            ClaimOwner::OtherNode | ClaimOwner::OptedOut => {
                tracing::trace!("not this node's claim");
                node.compete_done(uid);
                return Ok(Done::Nothing);
            }
            ClaimOwner::Compete => return pick_this_node(&ctx, &pvc).await,
        }
    }
    if ctx.write_gate().await? {
        // Just took this claim's lease: another replica may have created its PV a moment ago.
        ctx.api_budget().await;
        let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
        if pvs.get_opt(&pv_name).await?.is_some() {
            release_if_pv_exists(&pvc, &ctx).await?;
            return Ok(Done::Nothing);
        }
    }
    if guest.at_capacity() {
        // Waiting here would hold a reconcile worker every other guest needs too.
        return Err(ClaimError::Transient(format!(
            "guest {} is at its max-concurrency of {}; retrying",
            guest.name(),
            guest.grants().max_concurrency
        )));
    }
    if decide::wants_block(&pvc) && !guest.supports_block().await.map_err(ClaimError::Guest)? {
        let uid = pvc.metadata.uid.clone().unwrap_or_default();
        ctx.claim_failures
            .lock()
            .expect("lock")
            .give_up(&uid, claim_fingerprint(&pvc));
        warn_claim(
            &ctx,
            &pvc,
            events::PROVISIONING_FAILED,
            format!("{provisioner} does not support block volume provisioning"),
        )
        .await;
        return Ok(Done::Nothing);
    }
    let request = provision_request(&pvc, &class, &guest, &pv_name)?;
    ctx.write_gate().await?;
    if !guest
        .should_provision(&request.claim, &request.storage_class)
        .await
        .map_err(ClaimError::Guest)?
    {
        tracing::debug!("guest's qualifier declined the claim");
        return Ok(Done::Nothing);
    }

    let pvc = if ctx.settings.claim_finalizer {
        set_finalizer(&ctx, &pvc, true).await?
    } else {
        (*pvc).clone()
    };
    publish(
        &ctx.recorder,
        &pvc.object_ref(&()),
        false,
        events::PROVISIONING,
        "Provision",
        format!(
            "External provisioner is provisioning volume for claim \"{}/{}\"",
            pvc.namespace().unwrap_or_default(),
            pvc.name_any()
        ),
    )
    .await;

    ctx.write_gate().await?;
    let built = match guest.provision(&request).await {
        Ok(built) => built,
        Err(CallError::Guest { error, guest: name }) => {
            return guest_declined(&ctx, &pvc, name, error).await;
        }
        Err(error) => {
            warn_claim(&ctx, &pvc, events::PROVISIONING_FAILED, error.to_string()).await;
            return Err(ClaimError::Guest(error));
        }
    };
    let pv = convert::persistent_volume(
        &PvIdentity {
            name: &pv_name,
            claim: &pvc,
            class: &class,
            class_name: &class_name,
        },
        &built,
    );

    // The claim may have been deleted while the guest worked: then the storage goes, no PV.
    // The cache is enough: our finalizer keeps the claim, so deletion shows as a timestamp
    // within a watch event; if the cache lags, the PV is created and reclaimed as Released.
    let cached = ctx
        .claims
        .get(&ObjectRef::from_obj(&pvc))
        .filter(|c| c.metadata.uid == pvc.metadata.uid);
    if cached
        .as_ref()
        .is_none_or(|c| c.metadata.deletion_timestamp.is_some())
    {
        tracing::info!(pv = %pv_name, "claim deleted while provisioning; deleting the new storage");
        ctx.write_gate().await?;
        delete_storage(&guest, &pv, Some(&class))
            .await
            .map_err(|source| ClaimError::Cleanup {
                pv: pv_name.clone(),
                source,
            })?;
        if let Some(deleting) = cached {
            set_finalizer(&ctx, &deleting, false).await?;
            publish(
                &ctx.recorder,
                &deleting.object_ref(&()),
                false,
                events::PROVISIONING_ABANDONED,
                "Provision",
                format!("Claim was deleted while provisioning; storage for {pv_name} was deleted"),
            )
            .await;
        }
        return Ok(Done::Nothing);
    }
    let live = &pvc;

    match create_pv(&ctx, &pv).await? {
        Ok(()) => {
            ctx.remember_created(&pv_name);
            publish(
                &ctx.recorder,
                &live.object_ref(&()),
                false,
                events::PROVISIONING_SUCCEEDED,
                "Provision",
                format!("Successfully provisioned volume {pv_name}"),
            )
            .await;
            set_finalizer(&ctx, live, false).await?;
            ctx.claim_failures
                .lock()
                .expect("lock")
                .forget(live.metadata.uid.as_deref().unwrap_or_default());
            tracing::info!(pv = %pv_name, guest = guest.name(), "provisioned");
            Ok(Done::Provisioned)
        }
        Err(source) => {
            warn_claim(
                &ctx,
                live,
                events::PROVISIONING_FAILED,
                format!(
                    "Error creating provisioned PV object for claim {}/{}: {source}. Deleting the volume.",
                    live.namespace().unwrap_or_default(),
                    live.name_any()
                ),
            )
            .await;
            match delete_storage_with_retries(&ctx, &guest, &pv, Some(&class)).await? {
                Ok(()) => {
                    set_finalizer(&ctx, live, false).await?;
                    Err(ClaimError::CreatePv {
                        pv: pv_name,
                        source,
                    })
                }
                Err(cleanup) => {
                    warn_claim(
                        &ctx,
                        live,
                        events::PROVISIONING_CLEANUP_FAILED,
                        format!(
                            "Error cleaning provisioned volume for claim {}/{}: {cleanup}. Please delete manually.",
                            live.namespace().unwrap_or_default(),
                            live.name_any()
                        ),
                    )
                    .await;
                    Err(ClaimError::Cleanup {
                        pv: pv_name,
                        source: cleanup,
                    })
                }
            }
        }
    }
}

/// Node mode, immediate binding: after a randomised wait, set `selected-node` to this node with a
/// resourceVersion precondition. Exactly one instance's write succeeds; the claim's update then
/// brings it back here as this node's claim. The others get a conflict, or see the node set.
async fn pick_this_node(ctx: &Context, pvc: &PersistentVolumeClaim) -> Result<Done, ClaimError> {
    let node = ctx.node.as_ref().expect("node mode");
    let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
    if let Some(wait) = node.compete_wait(uid) {
        tracing::debug!(
            ?wait,
            "immediate-binding claim: competing for it after a wait"
        );
        return Ok(Done::RetryIn(wait));
    }
    let me = &node.settings.name;
    let patch = json!({
        "metadata": {
            "resourceVersion": pvc.metadata.resource_version,
            "annotations": { decide::ANN_SELECTED_NODE: me },
        }
    });
    let claims: Api<PersistentVolumeClaim> =
        Api::namespaced(ctx.client.clone(), &pvc.namespace().unwrap_or_default());
    ctx.write_gate().await?;
    ctx.api_budget().await;
    match claims
        .patch(
            &pvc.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => {
            node.compete_done(uid);
            tracing::info!(node = %me, "picked this node for the immediate-binding claim");
            publish(
                &ctx.recorder,
                &pvc.object_ref(&()),
                false,
                events::NODE_SELECTED,
                "Provision",
                format!("Node {me} picked for the immediate-binding claim (node deployment)"),
            )
            .await;
            Ok(Done::Nothing)
        }
        // Someone changed the claim first (often: another node picked it). Its watch event
        // brings the claim back; if no node was picked, this instance tries again at once.
        Err(kube::Error::Api(status)) if status.is_conflict() => {
            tracing::debug!("claim changed while competing for it; looking again");
            Ok(Done::Nothing)
        }
        Err(kube::Error::Api(status)) if status.is_not_found() => {
            node.compete_done(uid);
            Ok(Done::Nothing)
        }
        Err(error) => Err(error.into()),
    }
}

/// Maps the guest's typed refusal to what the controller does.
async fn guest_declined(
    ctx: &Context,
    pvc: &PersistentVolumeClaim,
    guest: String,
    error: ProvisionError,
) -> Result<Done, ClaimError> {
    match error {
        ProvisionError::Ignored(reason) => {
            tracing::debug!(%guest, %reason, "guest ignored the claim");
            set_finalizer(ctx, pvc, false).await?;
            Ok(Done::Nothing)
        }
        ProvisionError::Transient(message) => Err(ClaimError::Transient(message)),
        ProvisionError::InBackground(message) => Err(ClaimError::InBackground(message)),
        ProvisionError::Reschedule(message) => {
            warn_claim(
                ctx,
                pvc,
                events::PROVISIONING_FAILED,
                format!("guest {guest} asks to reschedule: {message}"),
            )
            .await;
            if decide::selected_node(pvc).is_some() {
                let claims: Api<PersistentVolumeClaim> =
                    Api::namespaced(ctx.client.clone(), &pvc.namespace().unwrap_or_default());
                let patch = json!({
                    "metadata": {
                        "resourceVersion": pvc.metadata.resource_version,
                        "annotations": {
                            decide::ANN_SELECTED_NODE: null,
                            decide::ANN_ALPHA_SELECTED_NODE: null,
                        },
                        "finalizers": finalizers_without(pvc),
                    }
                });
                ctx.write_gate().await?;
                ctx.api_budget().await;
                claims
                    .patch(
                        &pvc.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await?;
            } else {
                set_finalizer(ctx, pvc, false).await?;
            }
            Ok(Done::Nothing)
        }
        ProvisionError::Final(message) => {
            let error = CallError::Guest {
                guest,
                error: ProvisionError::Final(message),
            };
            warn_claim(ctx, pvc, events::PROVISIONING_FAILED, error.to_string()).await;
            Err(ClaimError::Guest(error))
        }
    }
}

/// A claim with our finalizer is being deleted: make sure no storage outlives it.
async fn finish_deleted_claim(
    pvc: &PersistentVolumeClaim,
    ctx: &Context,
) -> Result<Done, ClaimError> {
    // Finished already, by us a moment ago if the cache still shows the finalizer: cleaning up
    // again would call the guest for storage nobody is left to delete if we crash meanwhile.
    if !ctx.holds_claim_finalizer(pvc) {
        return Ok(Done::Nothing);
    }
    let pv_name = decide::pv_name(pvc).ok_or(ClaimError::NoUid)?;
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    ctx.api_budget().await;
    if pvs.get_opt(&pv_name).await?.is_some() {
        // The PV exists: its reclaim policy now decides what happens to the storage.
        set_finalizer(ctx, pvc, false).await?;
        return Ok(Done::Nothing);
    }
    let plugins = ctx.plugins();
    let provisioner = decide::claim_provisioner(pvc)
        .unwrap_or_default()
        .to_string();
    let class_name = decide::claim_class(pvc).unwrap_or_default().to_string();
    let Some(guest) = plugins.for_provisioner(&provisioner).cloned() else {
        // Our finalizer says this claim is ours and only its guest can clean up: wait for it
        // (a plugins reload re-runs every claim) rather than fail.
        let why = plugins.why_not_served(&provisioner);
        publish(
            &ctx.recorder,
            &pvc.object_ref(&()),
            true,
            events::WAITING_FOR_GUEST,
            "Delete",
            format!(
                "No guest serves {provisioner} right now ({why}); the storage of this deleted claim is cleaned up once a guest for it is loaded again"
            ),
        )
        .await;
        return Ok(Done::Nothing);
    };
    let Some(class) = ctx.class(&class_name) else {
        let error = ClaimError::ClassNotFound(format!(
            "{class_name} (needed to clean up storage of the deleted claim)"
        ));
        warn_claim(
            ctx,
            pvc,
            events::PROVISIONING_CLEANUP_FAILED,
            error.to_string(),
        )
        .await;
        return Err(error);
    };
    // Provision is idempotent: asking again yields the description of whatever storage an
    // interrupted attempt created, which is what delete needs.
    let request = provision_request(pvc, &class, &guest, &pv_name)?;
    ctx.write_gate().await?;
    match guest.provision(&request).await {
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
            ctx.write_gate().await?;
            delete_storage(&guest, &pv, Some(&class))
                .await
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
    set_finalizer(ctx, pvc, false).await?;
    publish(
        &ctx.recorder,
        &pvc.object_ref(&()),
        false,
        events::PROVISIONING_ABANDONED,
        "Provision",
        format!(
            "Claim was deleted before its volume was created; storage for {pv_name} was cleaned up"
        ),
    )
    .await;
    Ok(Done::Nothing)
}

/// A provisioner's standing for the pure decision.
fn serving(plugins: &Plugins, provisioner: &str) -> decide::Serving {
    match plugins.availability(provisioner) {
        Availability::Served => decide::Serving::Yes,
        Availability::Unavailable(_) => decide::Serving::Gone,
        Availability::Unknown => decide::Serving::No,
    }
}

fn provision_request(
    pvc: &PersistentVolumeClaim,
    class: &StorageClass,
    guest: &Guest,
    pv_name: &str,
) -> Result<ProvisionRequest, ClaimError> {
    Ok(ProvisionRequest {
        pv_name: pv_name.to_string(),
        claim: convert::claim(pvc)?,
        storage_class: convert::storage_class(class),
        selected_node: decide::selected_node(pvc).map(str::to_string),
        config: guest.grants().config_json.clone(),
    })
}

/// Removes our finalizer when the claim's PV already exists (e.g. after a crash right after create).
async fn release_if_pv_exists(
    pvc: &PersistentVolumeClaim,
    ctx: &Context,
) -> Result<(), ClaimError> {
    // A claim cached before our own removal landed still shows the finalizer: removing it
    // again would be a wasted request per claim (measured: 0.2-0.8 extra PATCHes per claim).
    if !ctx.holds_claim_finalizer(pvc) {
        return Ok(());
    }
    let Some(pv_name) = decide::pv_name(pvc) else {
        return Ok(());
    };
    let exists = ctx.volumes.get(&ObjectRef::new(&pv_name)).is_some() || {
        ctx.api_budget().await;
        Api::<PersistentVolume>::all(ctx.client.clone())
            .get_opt(&pv_name)
            .await?
            .is_some()
    };
    if exists {
        set_finalizer(ctx, pvc, false).await?;
    }
    Ok(())
}

fn finalizers_without(pvc: &PersistentVolumeClaim) -> Vec<String> {
    pvc.metadata
        .finalizers
        .iter()
        .flatten()
        .filter(|f| *f != FINALIZER_CLAIM)
        .cloned()
        .collect()
}

/// Adds or removes our finalizer; returns the updated claim. A strategic-merge patch touches
/// only our entry of the list, so it needs no resourceVersion and never conflicts; the API
/// server refuses to add a finalizer to a claim that is already being deleted.
async fn set_finalizer(
    ctx: &Context,
    pvc: &PersistentVolumeClaim,
    present: bool,
) -> Result<PersistentVolumeClaim, ClaimError> {
    if has_finalizer(&pvc.metadata.finalizers, FINALIZER_CLAIM) == present {
        return Ok(pvc.clone());
    }
    let claims: Api<PersistentVolumeClaim> =
        Api::namespaced(ctx.client.clone(), &pvc.namespace().unwrap_or_default());
    let patch = decide::finalizer_patch(&pvc.metadata.uid, FINALIZER_CLAIM, present);
    ctx.write_gate().await?;
    ctx.api_budget().await;
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
        ctx.remember_claim_finalizer(pvc.metadata.uid.as_deref().unwrap_or_default(), present);
    }
    result
}

/// Creates the PV, retrying `--create-pv-retry-count` times; AlreadyExists is success. The outer
/// error is the gate closing between attempts: then nothing more is written, not even cleanup.
async fn create_pv(
    ctx: &Context,
    pv: &PersistentVolume,
) -> Result<Result<(), kube::Error>, GateError> {
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let attempts = ctx.settings.create_pv_retry_count.max(1);
    let mut last = None;
    for attempt in 1..=attempts {
        ctx.write_gate().await?;
        ctx.api_budget().await;
        match pvs.create(&PostParams::default(), pv).await {
            Ok(_) => return Ok(Ok(())),
            Err(kube::Error::Api(status)) if status.is_already_exists() => return Ok(Ok(())),
            Err(error) => {
                tracing::warn!(%error, attempt, attempts, pv = pv.metadata.name.as_deref(), "creating PV failed");
                last = Some(error);
                if attempt < attempts {
                    tokio::time::sleep(ctx.settings.create_pv_retry_interval).await;
                }
            }
        }
    }
    Ok(Err(last.expect("at least one attempt")))
}

fn delete_request(
    guest: &Guest,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
) -> Result<DeleteRequest, CallError> {
    let volume = convert::volume(pv).map_err(|e| CallError::Rejected {
        guest: guest.name().to_string(),
        message: e.to_string(),
    })?;
    Ok(DeleteRequest {
        volume,
        storage_class: class.map(convert::storage_class),
        config: guest.grants().config_json.clone(),
    })
}

async fn delete_storage(
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
    ctx: &Context,
    guest: &Guest,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
) -> Result<Result<(), CallError>, GateError> {
    let attempts = ctx.settings.create_pv_retry_count.max(1);
    let mut attempt = 1;
    loop {
        ctx.write_gate().await?;
        match delete_storage(guest, pv, class).await {
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

async fn warn_claim(ctx: &Context, pvc: &PersistentVolumeClaim, reason: &str, note: String) {
    publish(
        &ctx.recorder,
        &pvc.object_ref(&()),
        true,
        reason,
        "Provision",
        note,
    )
    .await;
}
