//! The volume side of the intent log, as earlier versions wrote it: a volume entry is no longer
//! written (our PV finalizer is the record that survives a kill between our DELETE and the
//! storage delete), but logs of those versions still hold them; recovery settles them, and one
//! recorded ahead for a volume that is kept goes here. Every log call of the volume path is one
//! of these.

use k8s_openapi::api::core::v1::PersistentVolume;

use crate::controller::Context;

/// A volume that is not to be deleted may have been recorded ahead of its turn: its entry goes,
/// unless it records our own DELETE of the PV (storage still to delete: recovery's).
pub fn forget(ctx: &Context, pv: &PersistentVolume) {
    if let (Some(log), Some(uid)) = (&ctx.intents, pv.metadata.uid.as_deref()) {
        log.forget_kept_volume(uid);
    }
}

/// After a volume's reconcile: an entry still held (storage the guest has not deleted yet) is
/// recovery's from now.
pub fn attempt_over(ctx: &Context, pv: &PersistentVolume) {
    if let (Some(log), Some(uid)) = (&ctx.intents, pv.metadata.uid.as_deref()) {
        log.attempt_over(uid);
    }
}
