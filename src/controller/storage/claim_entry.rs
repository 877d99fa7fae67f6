//! The claim side of the intent log: where a claim's intent is recorded before its guest call
//! ([`intent_mode`], [`record`]: the entry, names only, with the queue recorded ahead), what the
//! guest built once it returned ([`record_built`]), and the entry's fate after an attempt
//! ([`settle`], [`release`]). The claim path says which claims are queued and how an attempt
//! ended; the rules for the entry are written here, and every log call of the claim path is one
//! of these.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;

use super::AHEAD;
use super::intent::{Behind, Intent, IntentError, IntentLog, Storage};
use crate::controller::decide;
use crate::controller::{Context, IntentRecord};
use crate::wasm::Plugins;

/// Where a claim's intent is recorded before its guest is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntentMode {
    /// Our finalizer on the claim (per-claim and node modes).
    Finalizer,
    /// An entry in this replica's intent log.
    Log,
    /// Nowhere (`--intent off`, or a log that is not open).
    Nowhere,
}

/// Where this replica records a claim's intent: what the settings call for, given whether its
/// log is open.
pub fn intent_mode(ctx: &Context) -> IntentMode {
    mode_for(ctx.settings.intent, ctx.intents.is_some())
}

/// The record the settings call for, given whether this replica's log is open.
fn mode_for(record: IntentRecord, log_open: bool) -> IntentMode {
    match record {
        IntentRecord::ClaimFinalizer => IntentMode::Finalizer,
        IntentRecord::Log if log_open => IntentMode::Log,
        IntentRecord::Log | IntentRecord::Off => IntentMode::Nowhere,
    }
}

/// How recording a claim's entry in the log went.
#[derive(Debug)]
pub enum Recorded {
    /// The entry is durable: the guest may be called.
    Logged,
    /// The log holds as much as it may (claims whose calls never answered, say): this claim
    /// carries its own intent instead, our finalizer, as in per-claim mode. The log is shared by
    /// every class, and one full of another's entries must not stop the others.
    OnClaimInstead(IntentError),
}

/// Whether a failed record falls back to our finalizer on the claim rather than failing it.
pub fn falls_back_to_finalizer(error: &IntentError) -> bool {
    matches!(
        error,
        IntentError::Full { .. } | IntentError::TooLarge { .. }
    )
}

/// Records the claim's entry before its guest call, with the claims queued behind it recorded
/// ahead (`queued`: the claim path's word, see [`intents_ahead`]). Without an open log, nothing
/// is recorded and `Logged` is answered: the caller asked [`intent_mode`] first.
pub async fn record(
    ctx: &Context,
    pvc: &PersistentVolumeClaim,
    provisioner: &str,
    pv_name: &str,
    queued: impl Fn(&Plugins, &PersistentVolumeClaim) -> Option<String>,
) -> Result<Recorded, IntentError> {
    let Some(log) = &ctx.intents else {
        return Ok(Recorded::Logged);
    };
    let uid = pvc.metadata.uid.as_deref().unwrap_or_default();
    // Most turns of a burst find their entry written as called already (see [`SOON`]): the
    // claims behind them are looked up only for a record that writes.
    let behind = if log.recorded_as_called(uid) {
        Behind::default()
    } else {
        Behind {
            soon: intents_soon(ctx, uid, &queued),
            ahead: intents_ahead(ctx, uid, log, &queued),
        }
    };
    match log
        .record(uid, &of(provisioner, pv_name, pvc), behind)
        .await
    {
        Ok(()) => Ok(Recorded::Logged),
        Err(error) if falls_back_to_finalizer(&error) => Ok(Recorded::OnClaimInstead(error)),
        Err(error) => Err(error),
    }
}

/// The claim's storage is settled (its PV exists, the storage is gone, or the guest holds
/// none): its entry leaves the log.
pub fn release(ctx: &Context, uid: &str) {
    if let Some(log) = &ctx.intents {
        log.done(uid);
    }
}

/// After a reconcile: the entry's fate (the rules of `settle_in`), when this replica keeps a log.
pub fn settle(ctx: &Context, key: &str, attempt: Attempt) {
    if let Some(log) = &ctx.intents {
        settle_in(log, key, attempt);
    }
}

/// How a claim's attempt ended, as far as its log entry is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The reconcile finished (the PV exists, or the claim waits or was let go).
    Finished,
    /// It failed with an answer: the guest refused, or a request or the record failed.
    Failed,
    /// The guest call ended without an answer (a fault, a timeout, a build left in the
    /// background): it may have built anything.
    Unanswered,
}

/// After an attempt: an entry whose guest built nothing and holds nothing in flight leaves the
/// log (a claim that waits or fails is not kept there: it is recorded again when its turn
/// comes); one that may stand for storage stays, recovery's from now on. A call that ended
/// without an answer may have built anything: should the claim go before a later call answers,
/// its storage is kept and said so.
fn settle_in(log: &IntentLog, key: &str, attempt: Attempt) {
    let built = matches!(log.get(key), Some(Intent::Claim(entry)) if entry.built.is_some());
    match attempt {
        Attempt::Unanswered => log.attempt_unanswered(key),
        Attempt::Finished => log.attempt_over(key),
        Attempt::Failed if built => log.attempt_over(key),
        Attempt::Failed => log.done(key),
    }
}

/// The log entry of a claim handed to its guest: names only.
pub fn of(provisioner: &str, pv: &str, pvc: &PersistentVolumeClaim) -> Intent {
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
pub fn record_built(
    ctx: &Context,
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
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

/// No claim is recorded ahead while the log holds this many entries recorded ahead whose turn has
/// not come: they leave only when their claim's turn comes, and with thousands of claims waiting
/// in line they would otherwise pile up faster than turns come until the log is full (measured:
/// full at 768 KiB, 5,000 claims waiting). Entries that stay for other reasons (calls that never
/// answered, entries inherited after a restart) do not count: counting them turned batching off
/// for every new claim once a few hundred of them were held.
const AHEAD_WHILE_BELOW: usize = 256;

/// Claims whose turns come next (the turns' own order) that ride on a write as called: about
/// as many as the turns one write lasts. Measured at 20 ms from the API server, the equal
/// budget: with only the claim taking its turn written as called, the log took 0.94 writes per
/// claim (200 claims), one per turn or two; with the parked claims next in line written too,
/// 0.05 and 0.13 (500 claims, two sittings); see docs/benchmarks.md. Only parked claims are
/// written so: with turns free nothing is, and a stored entry not marked ahead is then always
/// one whose guest was called; under a burst at most 64 more may not have been (their
/// claims deleted while the process is down are said to have storage that may be kept).
const SOON: usize = 32;

/// Intents for the claims whose turns come next, in the turns' order (see [`SOON`]), as
/// `queued` says they would be recorded at their turn.
fn intents_soon(
    ctx: &Context,
    current: &str,
    queued: &impl Fn(&Plugins, &PersistentVolumeClaim) -> Option<String>,
) -> Vec<(String, Intent)> {
    let plugins = ctx.plugins();
    ctx.turns
        .next_up(SOON)
        .iter()
        .filter_map(|claim| ctx.claims.get(claim))
        .filter_map(|pvc| {
            let uid = pvc.metadata.uid.as_deref().filter(|uid| *uid != current)?;
            let provisioner = queued(&plugins, &pvc)?;
            let pv = decide::pv_name(&pvc)?;
            Some((uid.to_string(), of(&provisioner, &pv, &pvc)))
        })
        .collect()
}

/// Intents for the claims that will be provisioned next (not yet in the log): one intent write
/// then covers a whole queue of claims instead of one. `queued` is the claim path's word on a
/// cached claim: the provisioner whose guest it will call when the claim's turn comes. An intent
/// for a claim that is then never provisioned is harmless: it is dropped once the claim is
/// settled, and if the claim goes first, recovery drops it too (it records nothing built, so it
/// deletes nothing).
fn intents_ahead(
    ctx: &Context,
    current: &str,
    log: &IntentLog,
    queued: &impl Fn(&Plugins, &PersistentVolumeClaim) -> Option<String>,
) -> Vec<(String, Intent)> {
    let mut ahead = Vec::new();
    let room = AHEAD.min(AHEAD_WHILE_BELOW.saturating_sub(log.ahead_len()));
    if room == 0 {
        return ahead;
    }
    let plugins = ctx.plugins();
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
        let Some(provisioner) = queued(&plugins, pvc) else {
            continue;
        };
        let Some(pv) = decide::pv_name(pvc) else {
            continue;
        };
        ahead.push((uid.to_string(), of(&provisioner, &pv, pvc)));
    }
    ahead
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_is_used_only_when_asked_for_and_open() {
        let table = [
            (IntentRecord::Log, true, IntentMode::Log),
            (IntentRecord::Log, false, IntentMode::Nowhere),
            (IntentRecord::ClaimFinalizer, true, IntentMode::Finalizer),
            (IntentRecord::ClaimFinalizer, false, IntentMode::Finalizer),
            (IntentRecord::Off, true, IntentMode::Nowhere),
            (IntentRecord::Off, false, IntentMode::Nowhere),
        ];
        for (record, open, want) in table {
            assert_eq!(mode_for(record, open), want, "{record:?}, log open: {open}");
        }
    }
}
