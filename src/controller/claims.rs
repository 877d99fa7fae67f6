//! The provision path: one reconcile per claim, from "is it ours?" to a created PV.
//!
//! Intent is recorded durably before any guest call: our finalizer on the claim, with a record of
//! its class. It is present only while storage may exist: it comes off once the PV exists, the
//! storage is gone, or the guest says it holds none (a final refusal, a rejected volume, a
//! give-up). So a claim deleted mid-provision, or a controller killed between the guest call and
//! the PV create, ends with exactly one PV or no storage, and no claim is left stuck.
//!
//! What to do is decided once by [`plan::plan_claim`]; the guest's refusals are mapped by
//! [`plan::react`]; this module executes, every write through the reconcile's [`Handle`].

use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::info_span;

use super::bookkeeping::{Done, Failure, Operation, Tracked, busy_wait};
use super::cleanup;
use super::decide::{self, FINALIZER_CLAIM, Serving};
use super::events;
use super::failures::fingerprint;
use super::gate::{GateError, LockKey};
use super::handle::Handle;
use super::intent::{Intent, IntentError, Storage};
use super::node::{ClaimOwner, Pin};
use super::plan::{self, ClaimFacts, ClaimPlan, DeletedOwner, Reaction};
use super::{Context, IntentRecord};
use crate::controller::convert::{self, ConvertError, PvIdentity};
use crate::wasm::bindings::types::{ProvisionError, ProvisionRequest};
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
    #[error("the claim cannot be provisioned as written: {0}")]
    Convert(#[from] ConvertError),
    /// An API request failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The whole operation ran past `--provision-timeout`.
    #[error("provisioning did not finish within {0:?}")]
    Timeout(std::time::Duration),
    /// The claim has no UID (never from a real API server).
    #[error("claim has no uid")]
    NoUid,
    /// This replica may not write now (not the leader, or another replica holds the claim).
    #[error(transparent)]
    Gate(#[from] GateError),
    /// The intent could not be recorded, so the guest was not called.
    #[error(transparent)]
    Intent(#[from] IntentError),
}

impl Failure for ClaimError {
    fn gate(&self) -> Option<&GateError> {
        match self {
            ClaimError::Gate(gate) => Some(gate),
            _ => None,
        }
    }

    fn counts(&self) -> bool {
        !matches!(
            self,
            ClaimError::Transient(_) | ClaimError::InBackground(_) | ClaimError::Gate(_)
        )
    }

    fn label(&self) -> &'static str {
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
            ClaimError::Intent(_) => "intent",
        }
    }

    fn timed_out(after: std::time::Duration) -> Self {
        ClaimError::Timeout(after)
    }
}

/// The data-source kind of a claim, the library's `source` metric label ("" without one).
fn source_kind(pvc: &PersistentVolumeClaim) -> String {
    pvc.spec
        .as_ref()
        .and_then(|s| s.data_source.as_ref())
        .map(|d| d.kind.clone())
        .unwrap_or_default()
}

/// What identifies "the same attempt" for give-up purposes: the claim as written, its class as it
/// exists now (a class deleted and created again is a new chance) and the guest serving it (a new
/// module, for instance one that now supports block volumes, too). A deleted claim is a new case.
fn claim_fingerprint(pvc: &PersistentVolumeClaim, ctx: &Context) -> u64 {
    let class = decide::claim_class(pvc).and_then(|name| ctx.class(name));
    let provisioner = decide::claim_provisioner(pvc);
    let guest = provisioner.and_then(|p| {
        ctx.plugins()
            .for_provisioner(p)
            .map(|g| g.sha256().to_string())
    });
    fingerprint(&(
        &pvc.spec,
        provisioner,
        decide::claim_class(pvc),
        decide::selected_node(pvc),
        class.and_then(|c| c.metadata.uid.clone()),
        guest,
        pvc.metadata.deletion_timestamp.is_some(),
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

/// Reconciles one claim: opens its gate scope, then runs [`provision`] with the shared bookkeeping.
pub async fn reconcile(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
) -> Result<Action, ClaimError> {
    let uid = pvc.metadata.uid.clone().ok_or(ClaimError::NoUid)?;
    let handle = Handle::open(&ctx, LockKey::Claim(uid.clone()))?;
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
    let tracked = Tracked {
        key: uid,
        fingerprint: claim_fingerprint(&pvc, &ctx),
        reference: pvc.object_ref(&()),
        operation: Operation::Provision {
            class,
            source: source_kind(&pvc),
        },
    };
    let (result, given_up) = ctx
        .claim_book
        .track(&handle, &tracked, span.clone(), provision(&handle, &pvc))
        .await;
    if let Some(log) = &ctx.intents {
        settle_entry(log, &tracked.key, &result);
    }
    if given_up {
        // No more attempts, so no more storage: the finalizer must not keep the claim forever.
        let _entered = span.enter();
        if let Err(error) = handle.release_claim::<ClaimError>(&pvc).await {
            tracing::warn!(%error, "could not release the finalizer of a given-up claim");
        }
    }
    result
}

/// After an attempt: an entry whose guest built nothing and holds nothing in flight leaves the
/// log (a claim that waits or fails is not kept there: it is recorded again when its turn
/// comes); one that may stand for storage stays, recovery's from now on.
fn settle_entry(log: &super::intent::IntentLog, key: &str, result: &Result<Action, ClaimError>) {
    let may_hold_storage = match result {
        Ok(_) => true,
        Err(ClaimError::InBackground(_) | ClaimError::Timeout(_)) => true,
        Err(ClaimError::Guest(CallError::Fault { .. })) => true,
        Err(_) => false,
    };
    let built = matches!(log.get(key), Some(Intent::Claim(entry)) if entry.built.is_some());
    if may_hold_storage || built {
        log.attempt_over(key);
    } else {
        log.done(key);
    }
}

/// Requeue policy: the shared one (see [`super::bookkeeping::Book::requeue`]).
pub fn error_policy(
    pvc: Arc<PersistentVolumeClaim>,
    error: &ClaimError,
    ctx: Arc<Context>,
) -> Action {
    let Some(uid) = pvc.metadata.uid.as_deref() else {
        return Action::await_change();
    };
    let fingerprint = claim_fingerprint(&pvc, &ctx);
    ctx.claim_book.requeue(&ctx, uid, fingerprint, error)
}

/// What the plan reads, answered from the caches, the guests and our own recent writes.
struct Facts<'a> {
    handle: &'a Handle<'a>,
    pvc: &'a PersistentVolumeClaim,
    plugins: &'a Plugins,
    class: Option<Arc<StorageClass>>,
}

impl ClaimFacts for Facts<'_> {
    fn serving(&self, provisioner: &str) -> Serving {
        serving(self.plugins, provisioner)
    }

    fn class(&self, name: &str) -> Option<&StorageClass> {
        self.class
            .as_deref()
            .filter(|c| c.metadata.name.as_deref() == Some(name))
    }

    fn holds_finalizer(&self) -> bool {
        self.handle.holds_claim_finalizer(self.pvc)
    }

    fn pv_known(&self) -> bool {
        decide::pv_name(self.pvc).is_some_and(|pv| self.handle.pv_known(&pv))
    }

    fn owner(&self, class: &StorageClass) -> Option<ClaimOwner> {
        let node = self.handle.ctx().node.as_ref()?;
        Some(node.claim_owner(self.pvc, class))
    }

    fn deleted_owner(&self) -> DeletedOwner {
        let Some(node) = &self.handle.ctx().node else {
            return DeletedOwner::Me;
        };
        match decide::selected_node(self.pvc) {
            Some(me) if me == node.settings.name => DeletedOwner::Me,
            Some(other) if !node.exists(Pin::Name(other)) => DeletedOwner::NodeGone(other.into()),
            _ => DeletedOwner::Other,
        }
    }

    fn guest_busy(&self, provisioner: &str) -> bool {
        self.plugins
            .for_provisioner(provisioner)
            .is_some_and(|g| g.at_capacity())
    }

    fn class_busy(&self, class: &StorageClass) -> bool {
        self.handle.ctx().in_flight.at_limit(class)
    }
}

/// Executes the plan for one claim.
async fn provision(handle: &Handle<'_>, pvc: &PersistentVolumeClaim) -> Result<Done, ClaimError> {
    let ctx = handle.ctx();
    let plugins = ctx.plugins();
    let facts = Facts {
        handle,
        pvc,
        plugins: &plugins,
        class: decide::claim_class(pvc).and_then(|name| ctx.class(name)),
    };
    match plan::plan_claim(pvc, &facts) {
        ClaimPlan::Skip(reason) => {
            tracing::trace!(reason, "not provisioning");
            Ok(Done::Nothing)
        }
        ClaimPlan::ReleaseIfPvExists => {
            cleanup::release_if_pv_exists(handle, pvc).await?;
            Ok(Done::Nothing)
        }
        ClaimPlan::WaitForGuest(provisioner) => {
            let why = plugins.why_not_served(provisioner);
            handle.event(
                &pvc.object_ref(&()),
                true,
                events::WAITING_FOR_GUEST,
                "Provision",
                format!(
                    "No guest serves {provisioner} right now ({why}); the claim waits and is provisioned once a guest for it is loaded again"
                ),
            );
            // Not a failure: a plugins reload re-runs every claim.
            Ok(Done::Nothing)
        }
        ClaimPlan::ClassMissing(name) => {
            handle.gate().await?;
            let error = ClaimError::ClassNotFound(name.to_string());
            warn_claim(handle, pvc, events::PROVISIONING_FAILED, error.to_string());
            Err(error)
        }
        ClaimPlan::FinishDeleted(_) => cleanup::finish_deleted_claim(handle, pvc).await,
        ClaimPlan::FinishDeletedNodeGone(node) => {
            cleanup::finish_deleted_claim_of_gone_node(handle, pvc, &node).await
        }
        ClaimPlan::Compete => pick_this_node(handle, pvc).await,
        ClaimPlan::Busy(reason) => {
            // Waiting here would hold a reconcile worker every other guest needs too.
            tracing::debug!(reason, "busy; looking again shortly");
            Ok(Done::RetryIn(busy_wait()))
        }
        ClaimPlan::Provision { provisioner, .. } => {
            let guest = plugins
                .for_provisioner(provisioner)
                .expect("planned for a served provisioner")
                .clone();
            let class = facts.class.clone().expect("planned with a class");
            call_guest(handle, pvc, &guest, &class).await
        }
    }
}

/// The guest call and what follows it: intent, provision, PV create or cleanup.
async fn call_guest(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    guest: &Arc<Guest>,
    class: &Arc<StorageClass>,
) -> Result<Done, ClaimError> {
    let ctx = handle.ctx();
    tracing::Span::current().record("guest", guest.name());
    let pv_name = decide::pv_name(pvc).ok_or(ClaimError::NoUid)?;
    let class_name = class.name_any();
    if handle.gate().await? {
        // Just took this claim's lease: another replica may have created its PV a moment ago.
        if handle.get_pv(&pv_name).await?.is_some() {
            cleanup::release_if_pv_exists(handle, pvc).await?;
            return Ok(Done::Nothing);
        }
    }
    let Some(_slot) = ctx.in_flight.try_acquire(class) else {
        return Ok(Done::RetryIn(busy_wait()));
    };
    if decide::wants_block(pvc)
        && !handle
            .guest(guest.supports_block())
            .await?
            .map_err(ClaimError::Guest)?
    {
        let uid = pvc.metadata.uid.clone().unwrap_or_default();
        ctx.claim_book.give_up(&uid, claim_fingerprint(pvc, ctx));
        handle.release_claim::<ClaimError>(pvc).await?;
        warn_claim(
            handle,
            pvc,
            events::PROVISIONING_FAILED,
            format!(
                "{} does not support block volume provisioning",
                class.provisioner
            ),
        );
        return Ok(Done::Nothing);
    }
    let request = match provision_request(pvc, class, guest, &pv_name) {
        Ok(request) => request,
        Err(error) => {
            handle.gate().await?;
            warn_claim(handle, pvc, events::PROVISIONING_FAILED, error.to_string());
            return Err(error);
        }
    };
    if !handle
        .guest(guest.should_provision(&request.claim, &request.storage_class))
        .await?
        .map_err(ClaimError::Guest)?
    {
        tracing::debug!("guest's qualifier declined the claim");
        handle.release_claim::<ClaimError>(pvc).await?;
        return Ok(Done::Nothing);
    }

    let pvc = match (ctx.settings.intent, &ctx.intents) {
        (IntentRecord::ClaimFinalizer, _) => {
            let record = decide::class_record(class);
            match handle
                .set_claim_finalizer::<ClaimError>(pvc, true, Some(&record))
                .await
            {
                Ok(updated) => updated,
                // The claim changed since the cache showed it: decide again on the new one.
                Err(ClaimError::Kube(kube::Error::Api(status))) if status.is_conflict() => {
                    tracing::debug!("claim changed since it was read; looking again");
                    return Ok(Done::RetryIn(busy_wait()));
                }
                Err(error) => return Err(error),
            }
        }
        (IntentRecord::Log, Some(log)) => {
            let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
            handle.gate().await?;
            let ahead = intents_ahead(handle, &ctx.plugins(), uid, log);
            log.record(uid, &claim_entry(&class.provisioner, &pv_name, pvc), ahead)
                .await
                .inspect_err(|error| {
                    warn_claim(handle, pvc, events::PROVISIONING_FAILED, error.to_string())
                })?;
            pvc.clone()
        }
        (IntentRecord::Log | IntentRecord::Off, _) => pvc.clone(),
    };
    handle.event(
        &pvc.object_ref(&()),
        false,
        events::PROVISIONING,
        "Provision",
        format!(
            "External provisioner is provisioning volume for claim \"{}/{}\"",
            pvc.namespace().unwrap_or_default(),
            pvc.name_any()
        ),
    );

    let built = match handle.guest(guest.provision(&request)).await? {
        Ok(built) => built,
        Err(CallError::Guest { error, guest: name }) => {
            return react(handle, &pvc, name, error).await;
        }
        Err(error) => {
            warn_claim(handle, &pvc, events::PROVISIONING_FAILED, error.to_string());
            if let CallError::Rejected { .. } = error {
                // The host refused what the guest built: nothing of it is saved, and the
                // guest's next answer decides anew. A fault keeps the finalizer: storage may exist.
                handle.release_claim::<ClaimError>(&pvc).await?;
            }
            return Err(ClaimError::Guest(error));
        }
    };
    let pv = convert::persistent_volume(
        &PvIdentity {
            name: &pv_name,
            claim: &pvc,
            class: class.as_ref(),
            class_name: &class_name,
        },
        &built,
    );
    record_built(ctx, &pvc, &pv, class);

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
        return cleanup::abandon_deleted_while_provisioning(handle, guest, &pv, class, cached)
            .await;
    }
    cleanup::save_pv(handle, guest, &pvc, &pv, class).await
}

/// The log entry of a claim handed to its guest: names only.
fn claim_entry(provisioner: &str, pv: &str, pvc: &PersistentVolumeClaim) -> Intent {
    Intent::claim(
        provisioner,
        pv,
        pvc.metadata.namespace.as_deref().unwrap_or_default(),
        pvc.metadata.name.as_deref().unwrap_or_default(),
    )
}

/// The guest returned: its entry now says what it built, the only storage recovery may delete
/// for this claim should it be gone before its PV exists. The write rides on the next batch
/// (most PVs exist before it, and the entry leaves unwritten); one too large to record leaves
/// the PV create as the only record.
fn record_built(
    ctx: &Context,
    pvc: &PersistentVolumeClaim,
    pv: &k8s_openapi::api::core::v1::PersistentVolume,
    class: &StorageClass,
) {
    let (Some(log), Some(uid)) = (&ctx.intents, pvc.metadata.uid.as_deref()) else {
        return;
    };
    let Some(Intent::Claim(mut entry)) = log.get(uid) else {
        return;
    };
    entry.built = Some(Storage::of(pv, Some(class)));
    if let Err(error) = log.update(uid, &Intent::Claim(entry)) {
        tracing::warn!(%error, "what the guest built is not recorded; its PV is the record");
    }
}

/// Claims recorded ahead per intent write at most.
const AHEAD: usize = 64;

/// Intents for the claims that will be provisioned next (ready as the plan sees them, not yet in
/// the log): one intent write then covers a whole queue of claims instead of one. An intent for a
/// claim that is then never provisioned is harmless: it is dropped once the claim is settled, and
/// if the claim goes first, recovery asks its guest for (and deletes) whatever storage exists.
fn intents_ahead(
    handle: &Handle<'_>,
    plugins: &Plugins,
    current: &str,
    log: &super::intent::IntentLog,
) -> Vec<(String, Intent)> {
    let ctx = handle.ctx();
    let mut ahead = Vec::new();
    for pvc in ctx.claims.state().iter() {
        if ahead.len() >= AHEAD {
            break;
        }
        let Some(uid) = pvc.metadata.uid.as_deref() else {
            continue;
        };
        if uid == current || log.holds(uid) {
            continue;
        }
        let class = decide::claim_class(pvc).and_then(|name| ctx.class(name));
        let facts = Facts {
            handle,
            pvc,
            plugins,
            class: class.clone(),
        };
        let ClaimPlan::Provision { provisioner, .. } = plan::plan_claim(pvc, &facts) else {
            continue;
        };
        let (Some(class), Some(pv)) = (class, decide::pv_name(pvc)) else {
            continue;
        };
        // Given up or backing off after a failure: recorded when its turn comes, not ahead.
        if ctx.claim_book.is_given_up(uid, claim_fingerprint(pvc, ctx))
            || ctx.claim_book.is_retrying(uid)
        {
            continue;
        }
        let _ = class;
        ahead.push((uid.to_string(), claim_entry(provisioner, &pv, pvc)));
    }
    ahead
}

/// Executes the reaction to a guest's typed refusal.
async fn react(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    guest: String,
    error: ProvisionError,
) -> Result<Done, ClaimError> {
    match plan::react(&error, decide::selected_node(pvc).is_some()) {
        Reaction::Ignore => {
            tracing::debug!(%guest, ?error, "guest ignored the claim");
            handle.release_claim::<ClaimError>(pvc).await?;
            Ok(Done::Nothing)
        }
        Reaction::Retry(message) => Err(ClaimError::Transient(message)),
        Reaction::InBackground(message) => Err(ClaimError::InBackground(message)),
        Reaction::Reschedule {
            message,
            clear_node,
        } => {
            warn_claim(
                handle,
                pvc,
                events::PROVISIONING_FAILED,
                format!("guest {guest} asks to reschedule: {message}"),
            );
            if clear_node {
                let patch = json!({
                    "metadata": {
                        "resourceVersion": pvc.metadata.resource_version,
                        "annotations": {
                            decide::ANN_SELECTED_NODE: null,
                            decide::ANN_ALPHA_SELECTED_NODE: null,
                            decide::ANN_CLASS_RECORD: null,
                        },
                        "finalizers": finalizers_without(pvc),
                    }
                });
                handle.merge_patch_claim(pvc, &patch).await??;
                if let Some(log) = &handle.ctx().intents {
                    log.done(pvc.metadata.uid.as_deref().unwrap_or_default());
                }
            } else {
                handle.release_claim::<ClaimError>(pvc).await?;
            }
            Ok(Done::Nothing)
        }
        Reaction::Fail(message) => {
            let error = CallError::Guest {
                guest,
                error: ProvisionError::Final(message),
            };
            warn_claim(handle, pvc, events::PROVISIONING_FAILED, error.to_string());
            // The guest says it holds no storage for this claim: nothing for a finalizer to guard.
            handle.release_claim::<ClaimError>(pvc).await?;
            Err(ClaimError::Guest(error))
        }
    }
}

/// Node mode, immediate binding: after a randomised wait, set `selected-node` to this node with a
/// resourceVersion precondition. Exactly one instance's write succeeds; the claim's update then
/// brings it back here as this node's claim. The others get a conflict, or see the node set.
async fn pick_this_node(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
) -> Result<Done, ClaimError> {
    let node = handle.ctx().node.as_ref().expect("node mode");
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
    match handle.merge_patch_claim(pvc, &patch).await? {
        Ok(_) => {
            node.compete_done(uid);
            tracing::info!(node = %me, "picked this node for the immediate-binding claim");
            handle.event(
                &pvc.object_ref(&()),
                false,
                events::NODE_SELECTED,
                "Provision",
                format!("Node {me} picked for the immediate-binding claim (node deployment)"),
            );
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

/// A provisioner's standing for the pure decision.
pub(crate) fn serving(plugins: &Plugins, provisioner: &str) -> Serving {
    match plugins.availability(provisioner) {
        Availability::Served => Serving::Yes,
        Availability::Unavailable(_) => Serving::Gone,
        Availability::Unknown => Serving::No,
    }
}

/// The guest's request for a claim.
pub(crate) fn provision_request(
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

fn finalizers_without(pvc: &PersistentVolumeClaim) -> Vec<String> {
    pvc.metadata
        .finalizers
        .iter()
        .flatten()
        .filter(|f| *f != FINALIZER_CLAIM)
        .cloned()
        .collect()
}

/// A warning event on a claim.
pub(crate) fn warn_claim(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    reason: &str,
    note: String,
) {
    handle.event(&pvc.object_ref(&()), true, reason, "Provision", note);
}
