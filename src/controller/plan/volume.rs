//! The volume decision, once, as a pure function returning a [`VolumePlan`]: whose PV this is,
//! whether our finalizer should change, whether its storage is to be deleted, and in which order.
//! The volume reconcile only executes what it says.

use k8s_openapi::api::core::v1::PersistentVolume;

use crate::controller::decide::{self, FINALIZER_PV, Serving, has_finalizer};
use crate::controller::node::VolumeOwner;

/// What the plan reads about the world; the shell answers from caches, settings and its own
/// recent writes.
pub trait VolumeFacts {
    /// The guest a plan hands on to be called (the shell's `Arc<Guest>`; tables use `()`).
    type Guest;
    /// The guest serving `provisioner` (`Some` whenever [`VolumeFacts::serving`] says `Yes`).
    fn guest(&self, provisioner: &str) -> Option<Self::Guest>;
    /// Node mode: whose volume this is (`None` outside node mode).
    fn owner(&self) -> Option<VolumeOwner>;
    /// Whether a provisioner name is served here.
    fn serving(&self, provisioner: &str) -> Serving;
    /// `--add-pv-finalizer`: our finalizer holds a `Delete` PV until its storage is gone.
    fn finalizer_mode(&self) -> bool;
    /// How far our own delete of this PV (this UID) got a moment ago.
    fn our_delete(&self) -> OurDelete;
}

/// How far our own delete of a PV (by UID) got, as far as this process remembers (its recent
/// writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OurDelete {
    /// None of ours recently.
    None,
    /// Our DELETE landed; with our finalizer on the PV, its storage and the finalizer may still
    /// be to go.
    Marked,
    /// Its storage is gone and the PV deleted (our finalizer off): nothing is left to do.
    Finished,
}

/// In which order a volume's storage and its PV go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteOrder {
    /// Our finalizer holds the PV: it is marked deleted (the version decided on as
    /// precondition), then the storage goes, then the finalizer. A kill at any point leaves the
    /// PV terminating with our finalizer, which the next leader finishes.
    BehindFinalizer,
    /// The live PV re-read, the storage deleted, then the PV (marked deleted already and held
    /// by our finalizer, or `--add-pv-finalizer=false`, the Go library's order).
    StorageFirst,
}

/// What to do with a PV; `G` is the guest a delete calls, chosen by the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumePlan<'a, G = ()> {
    /// Nothing: another node's, or deleted by us a moment ago.
    Skip(&'static str),
    /// Node mode: pinned to a node that no longer exists; its storage went with it.
    NodeGone(String),
    /// Add (`true`) or remove our PV finalizer.
    SetFinalizer(bool),
    /// Not to be deleted (not Released with `Delete`, or not ours): an intent-log entry recorded
    /// ahead for it goes, nothing is deleted.
    Keep,
    /// To be deleted, but its guest is gone for now: say so and wait for a reload.
    WaitForGuest(&'a str),
    /// Ask the guest's deletion guard, then delete in this order.
    Delete {
        /// The provisioner whose guest deletes the storage.
        provisioner: &'a str,
        /// In which order storage and PV go.
        order: DeleteOrder,
        /// The guest serving the provisioner.
        guest: G,
    },
}

/// Decides what to do with a PV.
pub fn plan_volume<'a, F: VolumeFacts>(
    pv: &'a PersistentVolume,
    facts: &F,
) -> VolumePlan<'a, F::Guest> {
    match facts.owner() {
        None | Some(VolumeOwner::Mine) => {}
        Some(VolumeOwner::OtherNode) => return VolumePlan::Skip("another node's volume"),
        Some(VolumeOwner::NotPinned) => return VolumePlan::Skip("not pinned to this node"),
        Some(VolumeOwner::NodeGone(node)) => return VolumePlan::NodeGone(node),
    }
    let finalizer_mode = facts.finalizer_mode();
    let served = |p: &str| facts.serving(p) == Serving::Yes;
    let ours = decide::claim_provisioner_of_volume(pv).is_some_and(served);
    if ours && let Some(add) = decide::pv_finalizer_change(pv, finalizer_mode) {
        return VolumePlan::SetFinalizer(add);
    }
    let Some(provisioner) = decide::should_delete(pv, served, finalizer_mode) else {
        let gone = |p: &str| facts.serving(p) == Serving::Gone;
        return match decide::should_delete(pv, gone, finalizer_mode) {
            Some(provisioner) => VolumePlan::WaitForGuest(provisioner),
            None => VolumePlan::Keep,
        };
    };
    let held = has_finalizer(&pv.metadata.finalizers, FINALIZER_PV);
    match facts.our_delete() {
        // Updates sent before our delete landed still arrive: the one our DELETE made (marked
        // deleted, our finalizer on) often comes after we took the finalizer off, and would
        // cost a re-read of a PV that is gone (measured: 0.28 GETs per delete, on the budget).
        OurDelete::Finished => return VolumePlan::Skip("deleted by us, storage gone"),
        // With our finalizer still on it, its removal is what is left to do.
        OurDelete::Marked if !held => return VolumePlan::Skip("deleted by us"),
        OurDelete::Marked | OurDelete::None => {}
    }
    let order = if finalizer_mode && held && pv.metadata.deletion_timestamp.is_none() {
        DeleteOrder::BehindFinalizer
    } else {
        DeleteOrder::StorageFirst
    };
    // Served (decided above), so its guest is there: the plugins are one snapshot.
    match facts.guest(provisioner) {
        Some(guest) => VolumePlan::Delete {
            provisioner,
            order,
            guest,
        },
        None => VolumePlan::WaitForGuest(provisioner),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    const P: &str = "example.com/p";

    #[derive(Clone)]
    struct Facts {
        owner: Option<VolumeOwner>,
        serving: Serving,
        finalizer_mode: bool,
        our_delete: OurDelete,
    }

    impl Default for Facts {
        fn default() -> Self {
            Facts {
                owner: None,
                serving: Serving::Yes,
                finalizer_mode: false,
                our_delete: OurDelete::None,
            }
        }
    }

    impl VolumeFacts for Facts {
        type Guest = ();
        fn guest(&self, p: &str) -> Option<()> {
            (self.serving(p) == Serving::Yes).then_some(())
        }
        fn owner(&self) -> Option<VolumeOwner> {
            self.owner.clone()
        }
        fn serving(&self, p: &str) -> Serving {
            if p == P { self.serving } else { Serving::No }
        }
        fn finalizer_mode(&self) -> bool {
            self.finalizer_mode
        }
        fn our_delete(&self) -> OurDelete {
            self.our_delete
        }
    }

    fn pv(phase: &str, policy: &str, finalizer: bool, deleting: bool) -> PersistentVolume {
        let mut pv = decide::test_pv(phase, policy, Some(P));
        pv.metadata.name = Some("pvc-u".into());
        pv.metadata.uid = Some("u".into());
        pv.metadata.finalizers = finalizer.then(|| vec![FINALIZER_PV.to_string()]);
        pv.metadata.deletion_timestamp = deleting.then(|| Time(Default::default()));
        pv
    }

    fn cleared(mut pv: PersistentVolume) -> PersistentVolume {
        pv.spec.as_mut().unwrap().claim_ref = None;
        pv
    }

    fn delete(order: DeleteOrder) -> VolumePlan<'static> {
        VolumePlan::Delete {
            provisioner: P,
            order,
            guest: (),
        }
    }

    #[test]
    fn the_volume_plan_table() {
        // `log` is the mode without our finalizer (`--add-pv-finalizer=false`).
        let log = Facts::default();
        let finalizers = Facts {
            finalizer_mode: true,
            ..Facts::default()
        };
        let cases: Vec<(&str, PersistentVolume, Facts, VolumePlan<'static>)> = vec![
            (
                "no finalizer mode: storage first (the Go library's order)",
                pv("Released", "Delete", false, false),
                log.clone(),
                delete(DeleteOrder::StorageFirst),
            ),
            (
                "finalizer mode, released before it was held: hold it first",
                pv("Released", "Delete", false, false),
                finalizers.clone(),
                VolumePlan::SetFinalizer(true),
            ),
            (
                "finalizer mode, held, claimRef cleared by an admin: kept",
                cleared(pv("Released", "Delete", true, false)),
                finalizers.clone(),
                VolumePlan::Keep,
            ),
            (
                "finalizer mode, marked deleted, claimRef cleared: let go, storage kept",
                cleared(pv("Released", "Delete", true, true)),
                finalizers.clone(),
                VolumePlan::SetFinalizer(false),
            ),
            (
                "no finalizer mode, claimRef cleared: kept",
                cleared(pv("Released", "Delete", false, false)),
                log.clone(),
                VolumePlan::Keep,
            ),
            (
                "finalizer mode, held, not yet marked: behind the finalizer",
                pv("Released", "Delete", true, false),
                finalizers.clone(),
                delete(DeleteOrder::BehindFinalizer),
            ),
            (
                "finalizer mode, marked deleted already: storage, then the finalizer",
                pv("Released", "Delete", true, true),
                finalizers.clone(),
                delete(DeleteOrder::StorageFirst),
            ),
            (
                "Retain: kept (an entry recorded ahead goes)",
                pv("Released", "Retain", false, false),
                log.clone(),
                VolumePlan::Keep,
            ),
            (
                "bound: kept",
                pv("Bound", "Delete", false, false),
                log.clone(),
                VolumePlan::Keep,
            ),
            (
                "being deleted by someone else, no finalizer of ours: kept",
                pv("Released", "Delete", false, true),
                log.clone(),
                VolumePlan::Keep,
            ),
            (
                "not ours",
                pv("Released", "Delete", false, false),
                Facts {
                    serving: Serving::No,
                    ..log.clone()
                },
                VolumePlan::Keep,
            ),
            (
                "its guest is gone for now: wait",
                pv("Released", "Delete", false, false),
                Facts {
                    serving: Serving::Gone,
                    ..log.clone()
                },
                VolumePlan::WaitForGuest(P),
            ),
            (
                "deleted by us a moment ago",
                pv("Released", "Delete", false, false),
                Facts {
                    our_delete: OurDelete::Marked,
                    ..log.clone()
                },
                VolumePlan::Skip("deleted by us"),
            ),
            (
                "deleted by us, finalizer still on: its removal is left",
                pv("Released", "Delete", true, true),
                Facts {
                    our_delete: OurDelete::Marked,
                    ..finalizers.clone()
                },
                delete(DeleteOrder::StorageFirst),
            ),
            (
                "our delete finished, the update our DELETE made arrives after it: nothing left",
                pv("Released", "Delete", true, true),
                Facts {
                    our_delete: OurDelete::Finished,
                    ..finalizers.clone()
                },
                VolumePlan::Skip("deleted by us, storage gone"),
            ),
            (
                "our delete finished, an update from before our DELETE arrives: nothing left",
                pv("Released", "Delete", true, false),
                Facts {
                    our_delete: OurDelete::Finished,
                    ..finalizers.clone()
                },
                VolumePlan::Skip("deleted by us, storage gone"),
            ),
            (
                "finalizer mode, bound Delete volume without it: add",
                pv("Bound", "Delete", false, false),
                finalizers.clone(),
                VolumePlan::SetFinalizer(true),
            ),
            (
                "our finalizer outside finalizer mode: remove",
                pv("Bound", "Delete", true, false),
                log.clone(),
                VolumePlan::SetFinalizer(false),
            ),
            (
                "another node's volume",
                pv("Released", "Delete", false, false),
                Facts {
                    owner: Some(VolumeOwner::OtherNode),
                    ..log.clone()
                },
                VolumePlan::Skip("another node's volume"),
            ),
            (
                "its node is gone",
                pv("Released", "Delete", false, false),
                Facts {
                    owner: Some(VolumeOwner::NodeGone("n1".into())),
                    ..log.clone()
                },
                VolumePlan::NodeGone("n1".into()),
            ),
        ];
        for (name, pv, facts, want) in cases {
            assert_eq!(plan_volume(&pv, &facts), want, "{name}");
        }
    }
}
