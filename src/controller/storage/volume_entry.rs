//! The volume side of the intent log: the entry of a volume whose PV our own DELETE removed, the
//! entry of a volume that is not to be deleted leaving, and the queue recorded ahead. Which PVs are
//! queued for delete is the volume path's word ([`QueuedForDelete`]); the entries are written
//! here.

use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolume;

use super::AHEAD;
use super::intent::{Intent, IntentLog, Storage, VolumeIntent};
use crate::controller::Context;
use crate::wasm::Plugins;

/// The volume path's word on a cached PV: the provisioner whose guest it will ask to delete the
/// PV's storage, if it will.
pub type QueuedForDelete = for<'a> fn(&Context, &Plugins, &'a PersistentVolume) -> Option<&'a str>;

/// A volume that is not to be deleted may have been recorded ahead of its turn: its entry goes,
/// unless it records our own DELETE of the PV (storage still to delete: recovery's).
pub fn forget(ctx: &Context, pv: &PersistentVolume) {
    if let (Some(log), Some(uid)) = (&ctx.intents, pv.metadata.uid.as_deref()) {
        log.forget_kept_volume(uid);
    }
}

/// The entry of a volume whose PV our own DELETE removed: what deleting its storage needs.
pub fn of_deleted(provisioner: &str, pv: &PersistentVolume, storage: &Storage) -> Intent {
    let Intent::Volume(ahead) = Intent::volume(provisioner, pv) else {
        unreachable!("a volume intent")
    };
    Intent::Volume(VolumeIntent {
        deleted: Some(storage.clone()),
        ..ahead
    })
}

/// Intents for the volumes that will be deleted next (Released, ours, not yet in the log): one
/// intent write then covers a queue of deletes. One whose PV is then kept is dropped by recovery
/// once it sees the PV still there; recovery asks the guest's deletion guard again before it
/// deletes anything from an entry. The writer asks again when its turn comes
/// ([`install_intents_ahead`]).
pub fn intents_ahead(
    ctx: &Context,
    current: &str,
    log: &IntentLog,
    queued: QueuedForDelete,
) -> Vec<(String, Intent)> {
    let plugins = ctx.plugins();
    let mut ahead = Vec::new();
    for cached in ctx.volumes.state() {
        if ahead.len() >= AHEAD {
            break;
        }
        let Some(pv) = cached.whole() else {
            continue;
        };
        let Some(uid) = pv.metadata.uid.as_deref() else {
            continue;
        };
        if uid == current || log.holds(uid) {
            continue;
        }
        let Some(provisioner) = queued(ctx, &plugins, pv) else {
            continue;
        };
        ahead.push((uid.to_string(), Intent::volume(provisioner, pv)));
    }
    ahead
}

/// Lets the intent-log writer record the volumes released by the time its write goes out: PVs
/// are released one by one by kube-controller-manager, so the queue seen when a record is made
/// is short, and the one seen a budget turn later is longer.
pub fn install_intents_ahead(ctx: &Arc<Context>, queued: QueuedForDelete) {
    let (Some(log), false) = (&ctx.intents, ctx.settings.add_pv_finalizer) else {
        return;
    };
    let weak = Arc::downgrade(ctx);
    log.ahead_from(move |log| {
        weak.upgrade()
            .map(|ctx| intents_ahead(&ctx, "", log, queued))
            .unwrap_or_default()
    });
}
