//! The claim side of the intent log: the entry recorded before a guest call (names only), what
//! the guest built once it returned, the queue recorded ahead, and the entry's fate after an
//! attempt.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::Action;

use super::{ClaimError, Facts, claim_fingerprint};
use crate::controller::Context;
use crate::controller::decide;
use crate::controller::handle::Handle;
use crate::controller::plan::{self, ClaimPlan};
use crate::controller::storage::intent::{Intent, IntentLog, Storage};
use crate::wasm::{CallError, Plugins};

/// After an attempt: an entry whose guest built nothing and holds nothing in flight leaves the
/// log (a claim that waits or fails is not kept there: it is recorded again when its turn
/// comes); one that may stand for storage stays, recovery's from now on. A call that ended
/// without an answer (a fault, a timeout, a build left in the background) may have built
/// anything: should the claim go before a later call answers, its storage is kept and said so.
pub(super) fn settle_entry(log: &IntentLog, key: &str, result: &Result<Action, ClaimError>) {
    let unanswered = matches!(
        result,
        Err(ClaimError::InBackground(_)
            | ClaimError::Timeout(_)
            | ClaimError::Guest(CallError::Fault { .. }))
    );
    let built = matches!(log.get(key), Some(Intent::Claim(entry)) if entry.built.is_some());
    if unanswered {
        log.attempt_unanswered(key);
    } else if result.is_ok() || built {
        log.attempt_over(key);
    } else {
        log.done(key);
    }
}

/// The log entry of a claim handed to its guest: names only.
pub(super) fn claim_entry(provisioner: &str, pv: &str, pvc: &PersistentVolumeClaim) -> Intent {
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
pub(super) fn record_built(
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

/// No claim is recorded ahead while the log holds this many entries recorded ahead whose turn has
/// not come: they leave only when their claim's turn comes, and with thousands of claims waiting
/// in line they would otherwise pile up faster than turns come until the log is full (measured:
/// full at 768 KiB, 5,000 claims waiting). Entries that stay for other reasons (calls that never
/// answered, entries inherited after a restart) do not count: counting them turned batching off
/// for every new claim once a few hundred of them were held.
const AHEAD_WHILE_BELOW: usize = 256;

/// Intents for the claims that will be provisioned next (ready as the plan sees them, not yet in
/// the log): one intent write then covers a whole queue of claims instead of one. An intent for a
/// claim that is then never provisioned is harmless: it is dropped once the claim is settled, and
/// if the claim goes first, recovery drops it too (it records nothing built, so it deletes nothing).
pub(super) fn intents_ahead(
    handle: &Handle<'_>,
    plugins: &Plugins,
    current: &str,
    log: &IntentLog,
) -> Vec<(String, Intent)> {
    let ctx = handle.ctx();
    let mut ahead = Vec::new();
    let room = AHEAD.min(AHEAD_WHILE_BELOW.saturating_sub(log.ahead_len()));
    if room == 0 {
        return ahead;
    }
    for pvc in ctx.claims.state().iter() {
        if ahead.len() >= room {
            break;
        }
        let Some(uid) = pvc.metadata.uid.as_deref() else {
            continue;
        };
        if uid == current || log.holds(uid) {
            continue;
        }
        let facts = Facts {
            handle,
            pvc,
            plugins,
            class: decide::claim_class(pvc).and_then(|name| ctx.class(name)),
        };
        let ClaimPlan::Provision { provisioner, .. } = plan::plan_claim(pvc, &facts) else {
            continue;
        };
        let Some(pv) = decide::pv_name(pvc) else {
            continue;
        };
        // Given up or backing off after a failure: recorded when its turn comes, not ahead.
        if ctx.claim_book.is_given_up(uid, claim_fingerprint(pvc, ctx))
            || ctx.claim_book.is_retrying(uid)
        {
            continue;
        }
        ahead.push((uid.to_string(), claim_entry(provisioner, &pv, pvc)));
    }
    ahead
}
