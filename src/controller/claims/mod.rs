//! The provision path: one reconcile per claim, from "is it ours?" to a created PV.
//!
//! Intent is recorded durably before any guest call: an entry in this replica's intent log, or
//! our finalizer on the claim (per-claim and node modes). Storage is deleted only from what a
//! guest call returned: at once when the claim went while its guest worked or its PV could not
//! be created, later by recovery from the log entry that recorded it. A claim deleted after a
//! crash mid-call keeps whatever its guest may have built, and an event says so: a guest is never
//! asked again what to delete (its answer could name storage a live object uses). No claim is
//! left stuck: the finalizer comes off once the PV exists, the storage is gone, the guest holds
//! none, or the claim is deleted.
//!
//! What to do is decided once by [`plan::plan_claim`]; the guest's refusals are mapped by
//! [`plan::react`]; this module executes, every write through the reconcile's [`Handle`]. Its
//! parts: `error` (why a reconcile did not finish), `facts` (what the plan reads, and which
//! claims are queued), `endings` (saving the PV, the cleanup of unsaved storage, releasing a
//! deleted claim). The claim's intent-log entry is written by
//! [`storage::claim_entry`]; this module says which claims are queued and how an attempt ended.

use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::info_span;

use super::Context;
use super::bookkeeping::{Done, Ending, Operation, Tracked, busy_wait};
use super::decide::{self, FINALIZER_CLAIM, Serving};
use super::events::{self, Event, EventAction};
use super::failures::fingerprint;
use super::gate::{LockKey, Standing};
use super::handle::{ClaimPatched, Handle};
use super::plan::{self, ClaimPlan, Reaction};
use super::storage::claim_entry::{self, Attempt, IntentMode, Recorded};
use super::storage::{self, Qualified, StorageError};
use crate::controller::convert::PvIdentity;
use crate::wasm::bindings::types::{ProvisionError, ProvisionRequest};
use crate::wasm::{Availability, CallError, Guest, Plugins};

mod clone;
pub(super) mod endings;
mod error;
mod facts;

pub use clone::CloneSources;
pub use error::ClaimError;
use facts::{Facts, queued_for_provision};

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
    let provisioner = decide::provisioner_of(pvc, class.as_deref());
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
        class.as_ref().and_then(|c| c.metadata.uid.clone()),
        // A class that starts allowing growth is a new chance for a claim refused before.
        class.as_ref().and_then(|c| c.allow_volume_expansion),
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

/// The claim as its class's queue holds it: name and namespace only, for the queue may hold
/// thousands.
fn queue_ref(pvc: &PersistentVolumeClaim) -> ObjectRef<PersistentVolumeClaim> {
    ObjectRef::new(&pvc.name_any()).within(&pvc.namespace().unwrap_or_default())
}

/// The claim needs no turn now (bound, given up, not ours): its place in its class's queue, or
/// the turn kept for it, goes to the next claim at once.
fn leave_queue(ctx: &Context, pvc: &PersistentVolumeClaim) {
    let class = decide::claim_class(pvc).unwrap_or_default();
    ctx.turns.pass(class, &queue_ref(pvc));
}

/// Reconciles one claim: opens its gate scope, then runs [`provision`] with the shared bookkeeping.
pub async fn reconcile(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
) -> Result<Action, ClaimError> {
    if let Some(requested) = super::expand::wanted(&pvc) {
        // Bound, so no provision is due: the claim asks to grow.
        let fingerprint = claim_fingerprint(&pvc, &ctx);
        return super::expand::reconcile(pvc, ctx, requested, fingerprint).await;
    }
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
    let (result, ending) = ctx
        .claim_book
        .track(&handle, &tracked, span.clone(), provision(&handle, &pvc))
        .await;
    claim_entry::settle(&ctx, &tracked.key, attempt(&result));
    match ending {
        // No attempt comes: its place in the queue, or a turn kept for it, goes on.
        Ending::Skipped => leave_queue(&ctx, &pvc),
        Ending::GaveUp => {
            // No more attempts, so no more storage: the finalizer must not keep the claim.
            let _entered = span.enter();
            if let Err(error) = handle.release_claim::<ClaimError>(&pvc).await {
                tracing::warn!(%error, "could not release the finalizer of a given-up claim");
            }
        }
        Ending::Ran => {}
    }
    result
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

/// How the attempt ended, for the claim's intent-log entry: a call that ended without an answer
/// may have built anything.
fn attempt(result: &Result<Action, ClaimError>) -> Attempt {
    match result {
        Ok(_) => Attempt::Finished,
        Err(
            ClaimError::InBackground(_)
            | ClaimError::Timeout(_)
            | ClaimError::Guest(CallError::Fault { .. }),
        ) => Attempt::Unanswered,
        Err(_) => Attempt::Failed,
    }
}

/// Executes the plan for one claim.
async fn provision(handle: &Handle<'_>, pvc: &PersistentVolumeClaim) -> Result<Done, ClaimError> {
    clone::release_if_stale(handle, pvc).await?;
    let ctx = handle.ctx();
    let plugins = ctx.plugins();
    let facts = Facts::of(handle, pvc, &plugins);
    let plan = plan::plan_claim(pvc, &facts);
    if !matches!(plan, ClaimPlan::Provision { .. } | ClaimPlan::Busy(_)) {
        leave_queue(ctx, pvc);
    }
    match plan {
        ClaimPlan::Skip(reason) => {
            tracing::trace!(reason, "not provisioning");
            Ok(Done::Nothing)
        }
        ClaimPlan::ReleaseIfPvExists => {
            endings::release_if_pv_exists(handle, pvc).await?;
            Ok(Done::Nothing)
        }
        ClaimPlan::WaitForGuest(provisioner) => {
            let why = plugins.why_not_served(provisioner);
            handle.event(
                &pvc.object_ref(&()),
                Event::warning(
                    events::WAITING_FOR_GUEST,
                    EventAction::Provision,
                    format!(
                        "No guest serves {provisioner} right now ({why}); the claim waits and is provisioned once a guest for it is loaded again"
                    ),
                ),
            );
            // Not a failure: a plugins reload re-runs every claim.
            Ok(Done::Nothing)
        }
        ClaimPlan::ClassMissing(name) => {
            // A standby neither warns nor counts: the failure is the leader's to report.
            handle.lease().await?;
            let error = ClaimError::ClassNotFound(name.to_string());
            warn_claim(handle, pvc, events::PROVISIONING_FAILED, error.to_string());
            Err(error)
        }
        ClaimPlan::ForPopulator { kind, api_group } => {
            endings::leave_to_populator(handle, pvc, kind, api_group).await
        }
        ClaimPlan::FinishDeleted(_) => endings::finish_deleted_claim(handle, pvc).await,
        ClaimPlan::FinishDeletedNodeGone(node) => {
            endings::finish_deleted_claim_of_gone_node(handle, pvc, &node).await
        }
        ClaimPlan::Compete => pick_this_node(handle, pvc).await,
        ClaimPlan::Busy(reason) => {
            // Waiting here would hold a reconcile worker every other guest needs too.
            tracing::debug!(reason, "busy; looking again shortly");
            Ok(Done::RetryIn(busy_wait()))
        }
        ClaimPlan::Provision { guest, .. } => {
            let class = facts.class.clone().expect("planned with a class");
            call_guest(handle, pvc, &guest, &class).await
        }
    }
}

/// The intent recorded on the claim itself: our finalizer, before any guest call. `None`: the
/// claim changed since the cache showed it, and is decided again on the new one.
async fn finalizer_intent(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    provisioner: &str,
) -> Result<Option<PersistentVolumeClaim>, ClaimError> {
    match handle
        .set_claim_finalizer::<ClaimError>(pvc, Some(provisioner))
        .await
    {
        Ok(updated) => Ok(Some(updated)),
        Err(ClaimError::Kube(kube::Error::Api(status))) if status.is_conflict() => {
            tracing::debug!("claim changed since it was read; looking again");
            Ok(None)
        }
        Err(error) => Err(error),
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
    let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
    // No burst takes every worker or a guest's every slot (see `inflight`): when no turn is
    // free for the claim it is parked, before any request or guest call, until one is its.
    let slots = guest.grants().max_concurrency;
    let Some(_turn) = ctx
        .turns
        .acquire_or_park(class, guest.name(), slots, queue_ref(pvc))
    else {
        tracing::trace!("no turn free; parked");
        ctx.metrics.parked(crate::metrics::Queue::Claims, uid);
        return Ok(Done::Nothing);
    };
    if handle.lease().await? == Standing::JustTaken {
        // Just took this claim's lease: another replica may have created its PV a moment ago.
        if handle.get_pv(&pv_name).await?.is_some() {
            endings::release_if_pv_exists(handle, pvc).await?;
            return Ok(Done::Nothing);
        }
    }
    let Some(request) = qualified(handle, pvc, guest, class, &pv_name).await? else {
        return Ok(Done::Nothing);
    };
    // A clone's source is held (our finalizer on it) from before the intent until the guest
    // returns: a source that cannot be copied fails here, before anything is recorded or built.
    let held = clone::hold_if_clone(handle, pvc, &class.provisioner).await?;
    let pvc = match record_intent(handle, pvc, &class.provisioner, &pv_name).await {
        Ok(Some(pvc)) => pvc,
        recorded => {
            if let Some(held) = held {
                clone::let_go(handle, held, pvc).await;
            }
            return recorded.map(|_| Done::RetryIn(busy_wait()));
        }
    };
    handle.event(
        &pvc.object_ref(&()),
        Event::normal(
            events::PROVISIONING,
            EventAction::Provision,
            format!(
                "External provisioner is provisioning volume for claim \"{}/{}\"",
                pvc.namespace().unwrap_or_default(),
                pvc.name_any()
            ),
        ),
    );
    let class_name = class.name_any();
    let identity = PvIdentity {
        name: &pv_name,
        claim: &pvc,
        class: class.as_ref(),
        class_name: &class_name,
        held: ctx.settings.add_pv_finalizer,
    };
    let source = held.as_ref().map(|held| &held.source);
    let built = {
        let _slot = guest.claim_slot().await;
        handle
            .guest(storage::build(guest, &request, source, &identity))
            .await
    };
    if let Some(held) = held {
        clone::let_go(handle, held, &pvc).await;
    }
    let pv = match built? {
        Ok(pv) => pv,
        Err(error) => return build_failed(handle, &pvc, error).await,
    };
    claim_entry::record_built(ctx, &pvc, &pv, class);
    let cached = ctx
        .claims
        .get(&ObjectRef::from_obj(&pvc))
        .filter(|c| c.metadata.uid == pvc.metadata.uid);
    if plan::deleted_while_provisioning(cached.as_deref()) {
        return endings::abandon_deleted_while_provisioning(handle, guest, &pv, class, cached)
            .await;
    }
    endings::save_pv(handle, guest, &pvc, &pv, class).await
}

/// The steps before building (capabilities, request, qualifier), executed: the request to build
/// from, or `None` when the claim was let go or given up here.
async fn qualified(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    guest: &Arc<Guest>,
    class: &StorageClass,
    pv_name: &str,
) -> Result<Option<Box<ProvisionRequest>>, ClaimError> {
    let qualified = {
        let _slot = guest.claim_slot().await;
        handle
            .guest(storage::qualify(guest, pvc, class, pv_name))
            .await?
    };
    match qualified {
        Ok(Qualified::Ready(request)) => Ok(Some(request)),
        Ok(Qualified::Unsupported(missing)) => {
            // Final for this spec: given up at once (no retries, no threshold to reach), our
            // finalizer off, the failure counted; an edited claim is looked at again.
            let ctx = handle.ctx();
            let uid = pvc.metadata.uid.clone().unwrap_or_default();
            ctx.claim_book.give_up(&uid, claim_fingerprint(pvc, ctx));
            handle.release_claim::<ClaimError>(pvc).await?;
            let class_name = class.metadata.name.as_deref().unwrap_or_default();
            ctx.metrics
                .provision_failed(class_name, "PersistentVolumeClaim", "unsupported");
            warn_claim(
                handle,
                pvc,
                events::PROVISIONING_FAILED,
                missing.refusal(&class.provisioner, guest.name()),
            );
            Ok(None)
        }
        Ok(Qualified::Declined) => {
            tracing::debug!("guest's qualifier declined the claim");
            handle.release_claim::<ClaimError>(pvc).await?;
            Ok(None)
        }
        Err(StorageError::Convert(error)) => {
            let error = ClaimError::Convert(error);
            warn_claim(handle, pvc, events::PROVISIONING_FAILED, error.to_string());
            Err(error)
        }
        Err(error) => Err(error.into()),
    }
}

/// Records the claim's intent before its guest is called, where [`claim_entry::intent_mode`]
/// says: the claim to go on with (our finalizer's write returns it), or `None` when it changed
/// since the cache showed it and is decided again.
async fn record_intent(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    provisioner: &str,
    pv_name: &str,
) -> Result<Option<PersistentVolumeClaim>, ClaimError> {
    let ctx = handle.ctx();
    match claim_entry::intent_mode(ctx) {
        IntentMode::Finalizer => return finalizer_intent(handle, pvc, provisioner).await,
        IntentMode::Nowhere => return Ok(Some(pvc.clone())),
        IntentMode::Log => {}
    }
    let recorded = handle
        .record(claim_entry::record(
            ctx,
            pvc,
            provisioner,
            pv_name,
            |plugins, queued| queued_for_provision(handle, plugins, queued),
        ))
        .await?;
    match recorded {
        Ok(Recorded::Logged) => Ok(Some(pvc.clone())),
        Ok(Recorded::OnClaimInstead(error)) => {
            tracing::info!(%error, "intent recorded on the claim instead (our finalizer)");
            finalizer_intent(handle, pvc, provisioner).await
        }
        Err(error) => {
            warn_claim(handle, pvc, events::PROVISIONING_FAILED, error.to_string());
            Err(error.into())
        }
    }
}

/// Executes what follows a build that failed: the guest's typed refusal goes to [`react`];
/// anything else is warned about, and the intent kept or dropped as
/// [`plan::failed_build_keeps_intent`] says.
async fn build_failed(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    error: CallError,
) -> Result<Done, ClaimError> {
    if let CallError::Guest { error, guest } = error {
        return react(handle, pvc, guest, error).await;
    }
    warn_claim(handle, pvc, events::PROVISIONING_FAILED, error.to_string());
    if !plan::failed_build_keeps_intent(&error) {
        handle.release_claim::<ClaimError>(pvc).await?;
    }
    Err(ClaimError::Guest(error))
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
                if let ClaimPatched::Refused(error) = handle.merge_patch_claim(pvc, &patch).await? {
                    return Err(error.into());
                }
                claim_entry::release(
                    handle.ctx(),
                    pvc.metadata.uid.as_deref().unwrap_or_default(),
                );
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
        ClaimPatched::Patched => {
            node.compete_done(uid);
            tracing::info!(node = %me, "picked this node for the immediate-binding claim");
            handle.event(
                &pvc.object_ref(&()),
                Event::normal(
                    events::NODE_SELECTED,
                    EventAction::Provision,
                    format!("Node {me} picked for the immediate-binding claim (node deployment)"),
                ),
            );
            Ok(Done::Nothing)
        }
        // Someone changed the claim first (often: another node picked it). Its watch event
        // brings the claim back; if no node was picked, this instance tries again at once.
        ClaimPatched::Refused(kube::Error::Api(status)) if status.is_conflict() => {
            tracing::debug!("claim changed while competing for it; looking again");
            Ok(Done::Nothing)
        }
        ClaimPatched::Refused(kube::Error::Api(status)) if status.is_not_found() => {
            node.compete_done(uid);
            Ok(Done::Nothing)
        }
        ClaimPatched::Refused(error) => Err(error.into()),
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

fn finalizers_without(pvc: &PersistentVolumeClaim) -> Vec<String> {
    pvc.metadata
        .finalizers
        .iter()
        .flatten()
        .filter(|f| *f != FINALIZER_CLAIM)
        .cloned()
        .collect()
}

/// A warning event on a claim, from the provision path.
pub(crate) fn warn_claim(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    reason: &'static str,
    note: String,
) {
    let event = Event::warning(reason, EventAction::Provision, note);
    handle.event(&pvc.object_ref(&()), event);
}
