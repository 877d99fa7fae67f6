//! Intent-log recovery: what becomes of an entry nobody is working on. Storage is deleted only
//! when the live cluster agrees, read at the moment of deleting, never from a record alone and
//! never by asking a guest again what it built:
//! - a volume entry deletes only if our own DELETE of that PV (UID and resourceVersion as
//!   preconditions: Released with policy `Delete` at that version) succeeded and was recorded,
//!   no live PV names the same storage, and the guest's guard agrees;
//! - a claim entry deletes only what the guest returned for it, once the claim is gone and no
//!   live PV or claim names that storage;
//! - anything else keeps its storage and leaves the log, saying exactly what is known: nothing
//!   at all for an entry that stands for no storage (recorded ahead of a turn that never came,
//!   a guest that answered without building, a claim whose PV exists or that is bound to it),
//!   "may be kept" for a call whose answer was never recorded (the guest may or may not have
//!   built storage), "kept" for storage known to exist that a live object names.
//!
//! The decision is [`plan_entry`] (pure, from the caches: no request while claims wait); this
//! module executes it, and asks the API server only right before it deletes.

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use kube::runtime::reflector::ObjectRef;

use super::StorageError;
use super::intent::{ClaimIntent, Intent, IntentLog, Storage, VolumeIntent};
use crate::controller::Context;
use crate::controller::cache::{self, CachedVolume};
use crate::controller::events::{self, Event, EventAction};
use crate::controller::gate::LockKey;
use crate::controller::handle::Handle;

/// What the caches say about the objects one entry names.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct EntryFacts {
    /// The PV of the entry's name: its UID, and whether the volume path will delete it.
    pub pv: Option<(String, bool)>,
    /// The claim of the entry's namespace and name: its UID, whether it is being deleted, and
    /// whether it is bound.
    pub claim: Option<(String, bool, bool)>,
    /// The claim of the entry's UID is bound to the entry's PV: that PV was created, and its
    /// reclaim policy decides about the storage (whether the PV is still cached or not).
    pub bound_to_its_pv: bool,
    /// Another live PV names the recorded storage.
    pub storage_named_elsewhere: bool,
    /// What the entry's guest call did is unknown: the entry came from a stored log (an earlier
    /// process or another replica), or its last call ended without an answer.
    pub outcome_unknown: bool,
}

/// What to do with one entry.
#[derive(Debug, Clone, PartialEq)]
pub enum EntryPlan {
    /// Someone else's turn (the claim or volume path), or not now.
    Leave,
    /// Nothing left to do: the entry leaves the log.
    Drop,
    /// Its storage stays: the entry leaves the log, and why is said (log line and event).
    Keep(String),
    /// Whether it built storage is unknown (a call whose answer was never recorded): the entry
    /// leaves the log, and that its storage may be kept is said (log line and event).
    MayBeKept(String),
    /// Delete the recorded storage, after the live checks.
    Delete,
}

/// Decides what becomes of entry `key`, from the caches alone.
pub fn plan_entry(key: &str, intent: &Intent, facts: &EntryFacts) -> EntryPlan {
    if intent.retries().given_up {
        return EntryPlan::Leave;
    }
    match intent {
        Intent::Claim(claim) => plan_claim_entry(key, claim, facts),
        Intent::Volume(volume) => plan_volume_entry(key, volume, facts),
    }
}

fn plan_claim_entry(key: &str, claim: &ClaimIntent, facts: &EntryFacts) -> EntryPlan {
    if facts.pv.is_some() || facts.bound_to_its_pv {
        // Its PV exists, or did: the reclaim policy decides about the storage from now on.
        return EntryPlan::Drop;
    }
    match &facts.claim {
        Some((uid, deleting, _)) if uid == key && !*deleting => return EntryPlan::Leave,
        // Recorded ahead of a turn that never came: its guest was never called.
        _ if claim.ahead => return EntryPlan::Drop,
        // A namesake still unbound may be given the same storage by a name-based pattern: wait
        // until it has a PV, whose storage the live checks then compare.
        Some((uid, false, false)) if uid != key && claim.built.is_some() => {
            return EntryPlan::Leave;
        }
        _ => {}
    }
    match &claim.built {
        None if facts.outcome_unknown => EntryPlan::MayBeKept(format!(
            "the guest of {} was called for claim {}/{} (PV {}, the claim now deleted) and no answer was recorded (the provisioner stopped during the call, or the call timed out, faulted or went on in the background); it may or may not have built storage, and what it built is unknown, so nothing was deleted: look for storage of {} in the guest's backend",
            claim.provisioner, claim.namespace, claim.name, claim.pv, claim.pv
        )),
        // Recorded ahead and never called, or called and refused: nothing was built.
        None => EntryPlan::Drop,
        Some(_) if facts.storage_named_elsewhere => EntryPlan::Keep(format!(
            "the storage built for deleted claim {}/{} ({}) is named by another live volume",
            claim.namespace, claim.name, claim.pv
        )),
        Some(_) => EntryPlan::Delete,
    }
}

fn plan_volume_entry(key: &str, volume: &VolumeIntent, facts: &EntryFacts) -> EntryPlan {
    match (&facts.pv, &volume.deleted) {
        // Our DELETE of it succeeded: the cache has not caught up yet.
        (Some((uid, _)), Some(_)) if uid == key => EntryPlan::Leave,
        // Still there: the volume path decides on the live object.
        (Some((uid, queued)), _) if uid == key => {
            if *queued {
                EntryPlan::Leave
            } else {
                EntryPlan::Drop
            }
        }
        (Some(_), Some(_)) => EntryPlan::Keep(format!(
            "PV {} was created again over storage whose delete had not finished",
            volume.pv
        )),
        (_, Some(_)) if facts.storage_named_elsewhere => EntryPlan::Keep(format!(
            "the storage of deleted PV {} is named by another live volume",
            volume.pv
        )),
        (_, Some(_)) => EntryPlan::Delete,
        (_, None) if facts.outcome_unknown => EntryPlan::MayBeKept(format!(
            "PV {} is gone but no record says this provisioner deleted it (someone else did, or the provisioner stopped before it recorded its delete): whether its storage is still there is unknown, so nothing was deleted",
            volume.pv
        )),
        // Recorded ahead, and the volume path declined or another party deleted the PV.
        (_, None) => EntryPlan::Drop,
    }
}

/// Recovers every entry of this replica's log, after taking over the logs of stopped replicas.
/// `queued`: whether the volume path will delete this cached PV's storage (an entry for it is
/// that path's). Returns how many entries left the log.
pub async fn recover_intents(
    ctx: &Context,
    queued: &(dyn Fn(&PersistentVolume) -> bool + Sync),
) -> Result<usize, kube::Error> {
    let Some(log) = &ctx.intents else {
        return Ok(0);
    };
    log.adopt_others().await?;
    let (mut settled, mut fresh) = (0, 0);
    let entries = log.entries();
    let total = entries.len();
    for (key, intent) in entries {
        if log.is_fresh(&key) {
            fresh += 1;
            continue;
        }
        let lock = match intent {
            Intent::Claim(_) => LockKey::Claim(key.clone()),
            Intent::Volume(_) => LockKey::Volume(key.clone()),
        };
        let Ok(handle) = Handle::open(ctx, lock) else {
            // Not the leader (any more): the leader recovers.
            break;
        };
        let facts = facts_of(ctx, log, &key, &intent, queued);
        let plan = plan_entry(&key, &intent, &facts);
        if let Intent::Volume(_) = intent {
            // Volume entries are few (a queue of deletes): each one's plan, for the debug log.
            tracing::debug!(%key, pv = %intent.pv(), ?plan, ?facts, "volume entry planned");
        }
        let outcome = match plan {
            EntryPlan::Leave => Ok(false),
            EntryPlan::Drop => Ok(true),
            EntryPlan::Keep(why) => {
                keep(&handle, &key, &intent, Known::Kept, &why);
                Ok(true)
            }
            EntryPlan::MayBeKept(why) => {
                keep(&handle, &key, &intent, Known::MayBeKept, &why);
                Ok(true)
            }
            EntryPlan::Delete => delete_recorded(&handle, log, &key, &intent).await,
        };
        match outcome {
            Ok(true) => {
                log.drop_unless_fresh(&key);
                settled += 1;
            }
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(%error, pv = %intent.pv(), "recovering an intent failed; retried later")
            }
        }
    }
    tracing::debug!(entries = total, fresh, settled, "intent log recovery pass");
    Ok(settled)
}

/// At a clean stop, once no reconcile runs: the entries that stand for no storage leave this
/// replica's log without a request or a guest call (recorded ahead of a turn that never came, a
/// claim whose PV exists), decided by [`plan_entry`] from the caches as recovery decides them.
/// Whatever recovery would act on or say something about stays, for the next leader. Returns
/// how many left.
pub fn drop_settled(ctx: &Context, queued: &(dyn Fn(&PersistentVolume) -> bool + Sync)) -> usize {
    let Some(log) = &ctx.intents else {
        return 0;
    };
    let dropped = log.drop_ahead();
    let mut settled = 0;
    for (key, intent) in log.entries() {
        if log.is_fresh(&key) {
            continue;
        }
        let facts = facts_of(ctx, log, &key, &intent, queued);
        if plan_entry(&key, &intent, &facts) == EntryPlan::Drop {
            log.drop_unless_fresh(&key);
            settled += 1;
        }
    }
    dropped + settled
}

fn facts_of(
    ctx: &Context,
    log: &IntentLog,
    key: &str,
    intent: &Intent,
    queued: &(dyn Fn(&PersistentVolume) -> bool + Sync),
) -> EntryFacts {
    let pv = ctx.volume(intent.pv()).map(|cached| {
        let uid = cached_uid(&cached);
        (uid, cached.whole().is_some_and(|pv| queued(pv)))
    });
    let cached_claim = match intent {
        Intent::Claim(claim) => ctx
            .claims
            .get(&ObjectRef::new(&claim.name).within(&claim.namespace)),
        Intent::Volume(_) => None,
    };
    let claim = cached_claim.as_deref().map(claim_facts);
    let bound_to_its_pv = cached_claim
        .as_deref()
        .is_some_and(|pvc| bound_to(pvc, key, intent.pv()));
    let storage_named_elsewhere = intent
        .storage()
        .is_some_and(|storage| named_elsewhere(ctx, storage));
    EntryFacts {
        pv,
        claim,
        bound_to_its_pv,
        storage_named_elsewhere,
        outcome_unknown: log.outcome_unknown(key),
    }
}

fn cached_uid(cached: &CachedVolume) -> String {
    use kube::Resource;
    cached.meta().uid.clone().unwrap_or_default()
}

/// Whether `pvc` is the claim of UID `key` and is bound to PV `pv`.
fn bound_to(pvc: &PersistentVolumeClaim, key: &str, pv: &str) -> bool {
    pvc.metadata.uid.as_deref() == Some(key)
        && pvc.spec.as_ref().and_then(|s| s.volume_name.as_deref()) == Some(pv)
}

fn claim_facts(pvc: &PersistentVolumeClaim) -> (String, bool, bool) {
    let bound = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .is_some_and(|v| !v.is_empty());
    (
        pvc.metadata.uid.clone().unwrap_or_default(),
        pvc.metadata.deletion_timestamp.is_some(),
        bound,
    )
}

/// Whether a PV in the cache other than the recorded one names the recorded storage.
fn named_elsewhere(ctx: &Context, storage: &Storage) -> bool {
    other_volume_naming(ctx, &storage.volume).is_some()
}

/// A PV in the cache, other than `pv` itself (by UID and name), that names the storage `pv`
/// names: storage that is someone else's now.
fn other_volume_naming(ctx: &Context, pv: &PersistentVolume) -> Option<String> {
    use kube::Resource;
    let mine = cache::storage_of(pv)?;
    let (uid, name) = (pv.metadata.uid.as_deref(), pv.metadata.name.as_deref());
    ctx.volumes
        .state()
        .iter()
        .find(|cached| {
            let meta = cached.meta();
            meta.uid.as_deref() != uid
                && meta.name.as_deref() != name
                && cached.storage() == Some(mine)
        })
        .and_then(|cached| cached.meta().name.clone())
}

/// What is known about storage recovery leaves in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// It exists, and a live object names it (or the guest's guard keeps it).
    Kept,
    /// Whether it exists is unknown.
    MayBeKept,
}

/// The storage stays; says so where an operator looks (on the claim or the PV it was for), and
/// whether it is known to exist.
fn keep(handle: &Handle<'_>, key: &str, intent: &Intent, known: Known, why: &str) {
    let said = match known {
        Known::Kept => "Storage kept",
        Known::MayBeKept => "Storage may be kept",
    };
    tracing::warn!(pv = %intent.pv(), "{}: {why}", said.to_lowercase());
    let reference = match intent {
        Intent::Claim(claim) => ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("PersistentVolumeClaim".into()),
            namespace: Some(claim.namespace.clone()),
            name: Some(claim.name.clone()),
            uid: Some(key.to_string()),
            ..ObjectReference::default()
        },
        Intent::Volume(volume) => pv_reference(&volume.pv, Some(key)),
    };
    handle.event(
        &reference,
        Event::warning(
            events::STORAGE_KEPT,
            EventAction::Delete,
            format!("{said}: {why}"),
        ),
    );
}

fn pv_reference(name: &str, uid: Option<&str>) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolume".into()),
        name: Some(name.to_string()),
        uid: uid.map(str::to_string),
        ..ObjectReference::default()
    }
}

/// Deletes what the entry records, after asking the API server that no live PV of that name and
/// no live claim of that name and namespace stand for it now. `Ok(true)`: the entry is settled.
async fn delete_recorded(
    handle: &Handle<'_>,
    log: &IntentLog,
    key: &str,
    intent: &Intent,
) -> Result<bool, StorageError> {
    let ctx = handle.ctx();
    let storage = intent.storage().expect("planned with storage");
    match live_owner(handle, key, intent).await? {
        LiveOwner::None => {}
        LiveOwner::Undecided(why) => {
            tracing::debug!(pv = %intent.pv(), "recorded storage not deleted yet: {why}");
            return Ok(false);
        }
        LiveOwner::Named(why) => {
            keep(handle, key, intent, Known::Kept, &why);
            return Ok(true);
        }
        LiveOwner::Settled(why) => {
            tracing::debug!(pv = %intent.pv(), "recorded storage is a PV's: {why}");
            return Ok(true);
        }
    }
    let plugins = ctx.plugins();
    let Some(guest) = plugins.for_deleting(intent.provisioner()).cloned() else {
        tracing::info!(pv = %intent.pv(), provisioner = %intent.provisioner(), "recorded storage waits for its guest");
        return Ok(false);
    };
    if let Intent::Volume(_) = intent
        && !handle
            .guest(super::guard(&guest, &storage.volume))
            .await??
    {
        keep(
            handle,
            key,
            intent,
            Known::Kept,
            "the guest's deletion guard keeps it",
        );
        return Ok(true);
    }
    let deleted = super::delete(&guest, &storage.volume, storage.class.as_ref());
    match handle.guest(deleted).await? {
        Ok(_) => {
            tracing::info!(pv = %intent.pv(), guest = guest.name(), "deleted recorded storage (intent log)");
            Ok(true)
        }
        Err(error) => {
            failed(handle, log, key, intent, &error.to_string())?;
            Err(error)
        }
    }
}

/// Counts a failed delete in the entry (its handle for operators), with an event on the PV
/// name, and gives up at `--failed-delete-threshold`.
fn failed(
    handle: &Handle<'_>,
    log: &IntentLog,
    key: &str,
    intent: &Intent,
    error: &str,
) -> Result<(), StorageError> {
    let threshold = handle.ctx().settings.failed_delete_threshold;
    let retries = log.failed(key, error, threshold)?.unwrap_or_default();
    let reference = pv_reference(intent.pv(), Some(key));
    handle.event(
        &reference,
        Event::warning(
            events::VOLUME_FAILED_DELETE,
            EventAction::Delete,
            format!(
                "Deleting the storage of {} failed (attempt {}): {error}",
                intent.pv(),
                retries.attempts
            ),
        ),
    );
    if retries.given_up {
        handle.event(&reference, Event::warning(events::DELETE_GIVEN_UP, EventAction::Delete, format!(
                "Gave up deleting the storage of {} after {} attempts; it is listed by `wasm-provisioner release-finalizers --dry-run` and removed from the intent log by `wasm-provisioner forget-storage {}`",
                intent.pv(),
                retries.attempts,
                intent.pv()
            )));
    }
    Ok(())
}

/// Who stands for the recorded storage in the live cluster now.
enum LiveOwner {
    /// Nobody: the storage may be deleted.
    None,
    /// A live object names it: it is kept for good (why).
    Named(String),
    /// A claim entry whose PV exists or existed (the claim is bound to it): the storage is that
    /// PV's, its reclaim policy decides; nothing to keep or say (why, for the debug log).
    Settled(String),
    /// A namesake claim whose volume is not known yet may be given the same storage by a
    /// name-based pattern: not now (why), looked at again on the next pass.
    Undecided(String),
}

/// Asks the API server who stands for the recorded storage now: a PV of the recorded name
/// (recreated over it, or the claim's PV), or a live claim of the recorded name and namespace
/// (the claim itself, or a namesake that uses, or may yet be given, the same storage).
async fn live_owner(
    handle: &Handle<'_>,
    key: &str,
    intent: &Intent,
) -> Result<LiveOwner, StorageError> {
    if let Some(live) = handle.get_pv(intent.pv()).await? {
        if let Intent::Claim(_) = intent {
            // Named after the claim's UID: the claim's own PV, created after all.
            return Ok(LiveOwner::Settled(format!("PV {} exists", intent.pv())));
        }
        let same = live.metadata.uid.as_deref() == Some(key);
        return Ok(LiveOwner::Named(if same {
            format!("PV {} is still there", intent.pv())
        } else {
            format!("PV {} exists again", intent.pv())
        }));
    }
    let Intent::Claim(claim) = intent else {
        return Ok(LiveOwner::None);
    };
    let Some(live) = handle.find_claim(&claim.namespace, &claim.name).await? else {
        return Ok(LiveOwner::None);
    };
    let (namespace, name) = (&claim.namespace, &claim.name);
    if bound_to(&live, key, &claim.pv) {
        return Ok(LiveOwner::Settled(format!(
            "claim {namespace}/{name} is bound to {}",
            claim.pv
        )));
    }
    if live.metadata.deletion_timestamp.is_some() {
        return Ok(LiveOwner::None);
    }
    if live.metadata.uid.as_deref() == Some(key) {
        // The cache has not caught up with it: the claim path's, not now.
        return Ok(LiveOwner::Undecided(format!(
            "claim {namespace}/{name} is still there"
        )));
    }
    let volume = live
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|v| !v.is_empty());
    let Some(volume) = volume else {
        return Ok(LiveOwner::Undecided(format!(
            "claim {namespace}/{name} (another claim of the same name) has no volume yet"
        )));
    };
    let Some(pv) = handle.get_pv(volume).await? else {
        return Ok(LiveOwner::Undecided(format!(
            "claim {namespace}/{name} (another claim of the same name) is bound to {volume}, which cannot be read"
        )));
    };
    let recorded = intent.storage().and_then(|s| cache::storage_of(&s.volume));
    if cache::storage_of(&pv) == recorded {
        return Ok(LiveOwner::Named(format!(
            "claim {namespace}/{name} (another claim of the same name) uses it through PV {volume}"
        )));
    }
    Ok(LiveOwner::None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a table row says: the case, the entry, the facts, and what the plan must be.
    type Case = (&'static str, Intent, EntryFacts, fn(&EntryPlan) -> bool);

    fn volume_entry(deleted: bool) -> Intent {
        let pv: PersistentVolume = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "pvc-a", "uid": "pv-uid", "resourceVersion": "5"},
            "spec": {"hostPath": {"path": "/data/a"}, "persistentVolumeReclaimPolicy": "Delete"}
        }))
        .unwrap();
        let mut intent = Intent::volume("p", &pv);
        if deleted && let Intent::Volume(v) = &mut intent {
            v.deleted = Some(Storage::of(&pv, None));
        }
        intent
    }

    fn claim_entry(built: bool) -> Intent {
        let mut intent = Intent::claim("p", "pvc-c", "team", "data");
        if built && let Intent::Claim(c) = &mut intent {
            let pv: PersistentVolume = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "pvc-c"}, "spec": {"hostPath": {"path": "/data/team/data"}}
            }))
            .unwrap();
            c.built = Some(Storage::of(&pv, None));
        }
        intent
    }

    #[test]
    fn volume_entries_delete_only_after_our_recorded_delete_and_nothing_names_the_storage() {
        use EntryPlan::*;
        let gone = EntryFacts::default();
        let inherited = EntryFacts {
            outcome_unknown: true,
            ..EntryFacts::default()
        };
        let there = |queued| EntryFacts {
            pv: Some(("pv-uid".into(), queued)),
            ..EntryFacts::default()
        };
        let recreated = EntryFacts {
            pv: Some(("other-uid".into(), false)),
            ..EntryFacts::default()
        };
        let named = EntryFacts {
            storage_named_elsewhere: true,
            ..EntryFacts::default()
        };
        let cases: Vec<Case> = vec![
            (
                "ahead, PV gone (Retain then deleted by an admin)",
                volume_entry(false),
                gone.clone(),
                |p| *p == Drop,
            ),
            (
                "ahead, PV gone, after a restart",
                volume_entry(false),
                inherited.clone(),
                |p| matches!(p, MayBeKept(_)),
            ),
            (
                "ahead, PV waits for the volume path",
                volume_entry(false),
                there(true),
                |p| *p == Leave,
            ),
            (
                "ahead, PV kept by the volume path (Retain, rebound)",
                volume_entry(false),
                there(false),
                |p| *p == Drop,
            ),
            (
                "deleted by us, PV gone",
                volume_entry(true),
                gone.clone(),
                |p| *p == Delete,
            ),
            (
                "deleted by us, after a restart",
                volume_entry(true),
                inherited.clone(),
                |p| *p == Delete,
            ),
            (
                "deleted by us, the cache not caught up",
                volume_entry(true),
                there(false),
                |p| *p == Leave,
            ),
            (
                "deleted by us, PV recreated under the name",
                volume_entry(true),
                recreated.clone(),
                |p| matches!(p, Keep(_)),
            ),
            (
                "deleted by us, another PV names the storage",
                volume_entry(true),
                named.clone(),
                |p| matches!(p, Keep(_)),
            ),
            (
                "ahead, PV recreated under the name",
                volume_entry(false),
                recreated,
                |p| *p == Drop,
            ),
        ];
        for (what, intent, facts, expected) in cases {
            let plan = plan_entry("pv-uid", &intent, &facts);
            assert!(expected(&plan), "{what}: {plan:?}");
        }
        let mut given_up = volume_entry(true);
        given_up.retries_mut().given_up = true;
        assert_eq!(plan_entry("pv-uid", &given_up, &gone), Leave);
    }

    #[test]
    fn claim_entries_delete_only_what_the_guest_built_for_a_gone_claim() {
        use EntryPlan::*;
        let alive = EntryFacts {
            claim: Some(("claim-uid".into(), false, false)),
            ..EntryFacts::default()
        };
        let namesake_waiting = EntryFacts {
            claim: Some(("new-uid".into(), false, false)),
            ..EntryFacts::default()
        };
        let namesake_bound = EntryFacts {
            claim: Some(("new-uid".into(), false, true)),
            ..EntryFacts::default()
        };
        let with_pv = EntryFacts {
            pv: Some(("pv-uid".into(), false)),
            ..EntryFacts::default()
        };
        let inherited = EntryFacts {
            outcome_unknown: true,
            ..EntryFacts::default()
        };
        let named = EntryFacts {
            storage_named_elsewhere: true,
            ..EntryFacts::default()
        };
        let ahead = claim_entry(false).marked_ahead(true);
        let alive_inherited = EntryFacts {
            claim: Some(("claim-uid".into(), false, false)),
            outcome_unknown: true,
            ..EntryFacts::default()
        };
        let bound = EntryFacts {
            claim: Some(("claim-uid".into(), true, true)),
            bound_to_its_pv: true,
            outcome_unknown: true,
            ..EntryFacts::default()
        };
        let cases: Vec<Case> = vec![
            (
                "claim alive: the claim path's",
                claim_entry(true),
                alive.clone(),
                |p| *p == Leave,
            ),
            (
                "claim alive, nothing built",
                claim_entry(false),
                alive,
                |p| *p == Leave,
            ),
            ("PV exists", claim_entry(true), with_pv, |p| *p == Drop),
            (
                "gone, built",
                claim_entry(true),
                EntryFacts::default(),
                |p| *p == Delete,
            ),
            (
                "gone, nothing built, this process",
                claim_entry(false),
                EntryFacts::default(),
                |p| *p == Drop,
            ),
            (
                "gone, called, no answer recorded (in flight at a kill, or unanswered)",
                claim_entry(false),
                inherited.clone(),
                |p| matches!(p, MayBeKept(why) if why.contains("may or may not")),
            ),
            (
                "gone, recorded ahead of a turn that never came, after a restart",
                ahead.clone(),
                inherited.clone(),
                |p| *p == Drop,
            ),
            (
                "alive, recorded ahead: its turn comes",
                ahead,
                alive_inherited,
                |p| *p == Leave,
            ),
            (
                "bound to its PV, the PV not cached (deleted since, or not listed yet)",
                claim_entry(false),
                bound,
                |p| *p == Drop,
            ),
            (
                "gone, namesake not yet bound",
                claim_entry(true),
                namesake_waiting,
                |p| *p == Leave,
            ),
            (
                "gone, namesake bound (its PV is compared live)",
                claim_entry(true),
                namesake_bound,
                |p| *p == Delete,
            ),
            (
                "gone, a live PV names the storage",
                claim_entry(true),
                named,
                |p| matches!(p, Keep(_)),
            ),
        ];
        for (what, intent, facts, expected) in cases {
            let plan = plan_entry("claim-uid", &intent, &facts);
            assert!(expected(&plan), "{what}: {plan:?}");
        }
    }
}
