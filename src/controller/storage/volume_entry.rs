//! The volume side of the intent log, as earlier versions wrote it: a volume entry is no longer
//! written (our PV finalizer is the record that survives a kill between our DELETE and the
//! storage delete), but logs of those versions still hold them; recovery settles them, and one
//! recorded ahead for a volume that is kept goes here.

use k8s_openapi::api::core::v1::PersistentVolume;

use crate::controller::Context;

/// A volume that is not to be deleted may have been recorded ahead of its turn: its entry goes,
/// unless it records our own DELETE of the PV (storage still to delete: recovery's).
pub fn forget(ctx: &Context, pv: &PersistentVolume) {
    if let (Some(log), Some(uid)) = (&ctx.intents, pv.metadata.uid.as_deref()) {
        log.forget_kept_volume(uid);
    }
}
