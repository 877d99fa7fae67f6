//! The claim decision, once, as a pure function returning a [`ClaimPlan`]; the guest's typed
//! refusals mapped to [`Reaction`]s by another; and the volume decision ([`volume`]). The
//! reconciles only execute what these say.

pub mod volume;

pub use volume::{DeleteOrder, OurDelete, VolumeFacts, VolumePlan, plan_volume};

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;

use super::data_source::{self, DataSource};
use super::decide::{self, ClaimDecision, Serving, Unmarked};
use super::node::ClaimOwner;
use crate::wasm::CallError;
use crate::wasm::bindings::types::ProvisionError;

/// Who finishes a deleted claim in node mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeletedOwner {
    /// Not node mode, or this instance's node holds the storage.
    Me,
    /// Another (existing) node holds it, or no node was ever picked.
    Other,
    /// The claim's node no longer exists: its storage went with it.
    NodeGone(String),
}

/// What the plan reads about the world; the shell answers from caches and its own memory.
pub trait ClaimFacts {
    /// The guest a plan hands on to be called (the shell's `Arc<Guest>`; tables use `()`).
    type Guest;
    /// Whether a provisioner name is served here.
    fn serving(&self, provisioner: &str) -> Serving;
    /// The guest serving `provisioner` (`Some` whenever [`ClaimFacts::serving`] says `Yes`).
    fn guest(&self, provisioner: &str) -> Option<Self::Guest>;
    /// The cached class of this name.
    fn class(&self, name: &str) -> Option<&StorageClass>;
    /// Whether the claim holds our finalizer (our latest write wins over the cache).
    fn holds_finalizer(&self) -> bool;
    /// Whether the PV cache holds every PV yet (its first list is done).
    fn volumes_listed(&self) -> bool;
    /// Whether the claim's PV exists as far as the cache and our own writes tell.
    fn pv_known(&self) -> bool;
    /// Node mode: whose claim this is (None outside node mode).
    fn owner(&self, class: &StorageClass) -> Option<ClaimOwner>;
    /// Who finishes the claim once deleted.
    fn deleted_owner(&self) -> DeletedOwner;
    /// Whether the guest serving `provisioner` is at its max-concurrency.
    fn guest_busy(&self, provisioner: &str) -> bool;
    /// Whether a claim of `class` not marked by kube-controller-manager yet may go ahead of the
    /// mark (the setting, and whether a PV of the class could take the claim instead).
    fn unmarked(&self, class: &StorageClass) -> Unmarked;
}

/// What to do with a claim; `G` is the guest a provision calls, chosen by the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimPlan<'a, G = ()> {
    /// Nothing: not ours, bound, not ready, or another node's.
    Skip(&'static str),
    /// Drop our finalizer if the PV exists (it may not be in the cache yet: ask).
    ReleaseIfPvExists,
    /// Ours, but its guest is gone for now: say so and wait for a reload.
    WaitForGuest(&'a str),
    /// Ours, but its class is unknown: a counted failure.
    ClassMissing(&'a str),
    /// Deleted with our finalizer: release it (what an attempt may have built is kept, unrecorded).
    FinishDeleted(&'a str),
    /// Deleted with our finalizer, and its node is gone (node mode): release without a guest.
    FinishDeletedNodeGone(String),
    /// Node mode: an immediate-binding claim this instance competes for.
    Compete,
    /// Ours by class, but its data source names a kind an external populator serves: leave it
    /// to the populator (drop our finalizer if an earlier version of us added it), say so once.
    ForPopulator {
        /// The kind its data source names.
        kind: &'a str,
        /// That kind's API group ("" for the core group).
        api_group: &'a str,
    },
    /// The guest or the class is at its limit: look again shortly; not a failure.
    Busy(&'static str),
    /// Call the guest.
    Provision {
        /// The provisioner name.
        provisioner: &'a str,
        /// The class name.
        class: &'a str,
        /// The guest serving the provisioner.
        guest: G,
    },
}

/// Decides what to do with a claim.
pub fn plan_claim<'a, F: ClaimFacts>(
    pvc: &'a PersistentVolumeClaim,
    facts: &'a F,
) -> ClaimPlan<'a, F::Guest> {
    let class = decide::claim_class(pvc).and_then(|name| facts.class(name));
    if pvc.metadata.deletion_timestamp.is_some() {
        if !facts.holds_finalizer() {
            return ClaimPlan::Skip("deleted, and no storage of ours can exist");
        }
        let provisioner = decide::provisioner_of(pvc, class).unwrap_or_default();
        // Another instance (other guests) shares the finalizer name: only ours are ours.
        match facts.serving(provisioner) {
            Serving::No => {
                return ClaimPlan::Skip("deleted claim of a provisioner not served here");
            }
            Serving::Gone | Serving::Yes => {}
        }
        return match facts.deleted_owner() {
            DeletedOwner::Me => ClaimPlan::FinishDeleted(provisioner),
            DeletedOwner::Other => ClaimPlan::Skip("another node cleans up"),
            DeletedOwner::NodeGone(node) => ClaimPlan::FinishDeletedNodeGone(node),
        };
    }
    let released = |reason| {
        if facts.holds_finalizer() {
            ClaimPlan::ReleaseIfPvExists
        } else {
            ClaimPlan::Skip(reason)
        }
    };
    let unmarked = |class: &StorageClass| facts.unmarked(class);
    let (provisioner, class_name) =
        match decide::should_provision(pvc, |p| facts.serving(p), class, unmarked) {
            ClaimDecision::Skip(reason) => return released(reason),
            ClaimDecision::GuestGone(p) => return ClaimPlan::WaitForGuest(p),
            ClaimDecision::ClassMissing(name) => return ClaimPlan::ClassMissing(name),
            ClaimDecision::Provision { provisioner, class } => (provisioner, class),
        };
    let class = class.expect("decided with a class");
    if let DataSource::Populator { kind, api_group } = data_source::of(pvc) {
        return ClaimPlan::ForPopulator { kind, api_group };
    }
    if !facts.volumes_listed() {
        // Right after a start: whether its PV exists, and which node paths are served (the
        // index a returned path is checked against), are not known yet.
        return ClaimPlan::Busy("PVs still being listed");
    }
    if facts.pv_known() {
        return released("its PV exists");
    }
    match facts.owner(class) {
        None | Some(ClaimOwner::Mine) => {}
        Some(ClaimOwner::OtherNode | ClaimOwner::OptedOut) => {
            return ClaimPlan::Skip("not this node's claim");
        }
        Some(ClaimOwner::Compete) => return ClaimPlan::Compete,
    }
    if facts.guest_busy(provisioner) {
        return ClaimPlan::Busy("guest at its max-concurrency");
    }
    // Served (decided above), so its guest is there: the plugins are one snapshot.
    match facts.guest(provisioner) {
        Some(guest) => ClaimPlan::Provision {
            provisioner,
            class: class_name,
            guest,
        },
        None => ClaimPlan::WaitForGuest(provisioner),
    }
}

/// What the controller does with a guest's typed refusal of `provision`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reaction {
    /// Not the guest's claim after all: drop the finalizer, no event.
    Ignore,
    /// Try again later; not counted.
    Retry(String),
    /// The guest works in the background; look again later; not counted.
    InBackground(String),
    /// Ask the scheduler for another node: warn, drop the finalizer and (if one is set) the
    /// selected node, in one write.
    Reschedule {
        /// The guest's message.
        message: String,
        /// Whether the claim has a selected node to clear.
        clear_node: bool,
    },
    /// A failure for good: warn, drop the finalizer (the guest holds no storage), count it.
    Fail(String),
}

/// Maps the guest's refusal to a reaction.
pub fn react(error: &ProvisionError, has_selected_node: bool) -> Reaction {
    match error {
        ProvisionError::Ignored(_) => Reaction::Ignore,
        ProvisionError::Transient(m) => Reaction::Retry(m.clone()),
        ProvisionError::InBackground(m) => Reaction::InBackground(m.clone()),
        ProvisionError::Reschedule(m) => Reaction::Reschedule {
            message: m.clone(),
            clear_node: has_selected_node,
        },
        ProvisionError::Final(m) => Reaction::Fail(m.clone()),
    }
}

/// Whether a build that failed other than by the guest's typed refusal (see [`react`]) leaves the
/// claim's intent in place. A fault keeps it: storage may exist. The host's rejection of what the
/// guest built does not: nothing of it is saved, and the guest's next answer decides anew.
pub fn failed_build_keeps_intent(error: &CallError) -> bool {
    !matches!(error, CallError::Rejected { .. })
}

/// Whether the claim went while its guest worked: then the storage goes, no PV. `cached` is the
/// claim as the cache holds it now, if it is still this claim (same UID). The cache is enough:
/// our finalizer keeps the claim, so deletion shows as a timestamp within a watch event; if the
/// cache lags, the PV is created and reclaimed as Released.
pub fn deleted_while_provisioning(cached: Option<&PersistentVolumeClaim>) -> bool {
    cached.is_none_or(|c| c.metadata.deletion_timestamp.is_some())
}

/// The annotation on a StorageClass that caps its claims in flight (guest calls running).
pub const ANN_MAX_IN_FLIGHT: &str = "wasm-provisioner.dev/max-claims-in-flight";

/// A class's limit of claims in flight, if it sets a valid one (a positive integer).
pub fn class_limit(class: &StorageClass) -> Option<usize> {
    class
        .metadata
        .annotations
        .as_ref()?
        .get(ANN_MAX_IN_FLIGHT)?
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolumeClaimSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    const P: &str = "example.com/p";

    #[derive(Clone)]
    struct Facts {
        serving: Serving,
        class: Option<StorageClass>,
        finalizer: bool,
        listed: bool,
        pv: bool,
        owner: Option<ClaimOwner>,
        deleted_owner: DeletedOwner,
        guest_busy: bool,
    }

    impl Default for Facts {
        fn default() -> Self {
            Facts {
                serving: Serving::Yes,
                class: Some(StorageClass {
                    metadata: ObjectMeta {
                        name: Some("fast".into()),
                        ..Default::default()
                    },
                    provisioner: P.into(),
                    ..Default::default()
                }),
                finalizer: false,
                listed: true,
                pv: false,
                owner: None,
                deleted_owner: DeletedOwner::Me,
                guest_busy: false,
            }
        }
    }

    impl ClaimFacts for Facts {
        type Guest = ();
        fn serving(&self, p: &str) -> Serving {
            if p == P { self.serving } else { Serving::No }
        }
        fn guest(&self, p: &str) -> Option<()> {
            (self.serving(p) == Serving::Yes).then_some(())
        }
        fn class(&self, name: &str) -> Option<&StorageClass> {
            self.class
                .as_ref()
                .filter(|c| c.metadata.name.as_deref() == Some(name))
        }
        fn holds_finalizer(&self) -> bool {
            self.finalizer
        }
        fn volumes_listed(&self) -> bool {
            self.listed
        }
        fn pv_known(&self) -> bool {
            self.pv
        }
        fn owner(&self, _: &StorageClass) -> Option<ClaimOwner> {
            self.owner
        }
        fn deleted_owner(&self) -> DeletedOwner {
            self.deleted_owner.clone()
        }
        fn guest_busy(&self, _: &str) -> bool {
            self.guest_busy
        }
        fn unmarked(&self, _: &StorageClass) -> Unmarked {
            Unmarked::Ahead {
                bindable_pv_in_class: false,
            }
        }
    }

    fn claim(deleted: bool) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("c".into()),
                uid: Some("u".into()),
                annotations: Some(
                    [(
                        decide::ANN_BETA_STORAGE_PROVISIONER.to_string(),
                        P.to_string(),
                    )]
                    .into(),
                ),
                deletion_timestamp: deleted.then(|| Time(Default::default())),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                storage_class_name: Some("fast".into()),
                ..Default::default()
            }),
            status: None,
        }
    }

    #[test]
    fn plan_table() {
        let base = Facts::default();
        let provision = ClaimPlan::Provision {
            provisioner: P,
            class: "fast",
            guest: (),
        };
        let cases: Vec<(&str, bool, Facts, ClaimPlan)> = vec![
            ("ready", false, base.clone(), provision.clone()),
            (
                "PVs still being listed (just started)",
                false,
                Facts {
                    listed: false,
                    pv: true,
                    ..base.clone()
                },
                ClaimPlan::Busy("PVs still being listed"),
            ),
            (
                "guest busy",
                false,
                Facts {
                    guest_busy: true,
                    ..base.clone()
                },
                ClaimPlan::Busy("guest at its max-concurrency"),
            ),
            (
                "pv exists, finalizer held",
                false,
                Facts {
                    pv: true,
                    finalizer: true,
                    ..base.clone()
                },
                ClaimPlan::ReleaseIfPvExists,
            ),
            (
                "pv exists, no finalizer",
                false,
                Facts {
                    pv: true,
                    ..base.clone()
                },
                ClaimPlan::Skip("its PV exists"),
            ),
            (
                "guest gone",
                false,
                Facts {
                    serving: Serving::Gone,
                    ..base.clone()
                },
                ClaimPlan::WaitForGuest(P),
            ),
            (
                "class missing",
                false,
                Facts {
                    class: None,
                    ..base.clone()
                },
                ClaimPlan::ClassMissing("fast"),
            ),
            (
                "another node's",
                false,
                Facts {
                    owner: Some(ClaimOwner::OtherNode),
                    ..base.clone()
                },
                ClaimPlan::Skip("not this node's claim"),
            ),
            (
                "compete",
                false,
                Facts {
                    owner: Some(ClaimOwner::Compete),
                    ..base.clone()
                },
                ClaimPlan::Compete,
            ),
            (
                "deleted without finalizer",
                true,
                base.clone(),
                ClaimPlan::Skip("deleted, and no storage of ours can exist"),
            ),
            (
                "deleted with finalizer",
                true,
                Facts {
                    finalizer: true,
                    ..base.clone()
                },
                ClaimPlan::FinishDeleted(P),
            ),
            (
                "deleted, class gone: still finished (the class is recorded)",
                true,
                Facts {
                    finalizer: true,
                    class: None,
                    ..base.clone()
                },
                ClaimPlan::FinishDeleted(P),
            ),
            (
                "deleted, guest gone: finished (the shell waits for the guest)",
                true,
                Facts {
                    finalizer: true,
                    serving: Serving::Gone,
                    ..base.clone()
                },
                ClaimPlan::FinishDeleted(P),
            ),
            (
                "deleted, provisioner never served here",
                true,
                Facts {
                    finalizer: true,
                    serving: Serving::No,
                    ..base.clone()
                },
                ClaimPlan::Skip("deleted claim of a provisioner not served here"),
            ),
            (
                "deleted, its node is gone",
                true,
                Facts {
                    finalizer: true,
                    deleted_owner: DeletedOwner::NodeGone("n1".into()),
                    ..base.clone()
                },
                ClaimPlan::FinishDeletedNodeGone("n1".into()),
            ),
            (
                "deleted, another node's",
                true,
                Facts {
                    finalizer: true,
                    deleted_owner: DeletedOwner::Other,
                    ..base.clone()
                },
                ClaimPlan::Skip("another node cleans up"),
            ),
        ];
        for (what, deleted, facts, want) in cases {
            let pvc = claim(deleted);
            assert_eq!(plan_claim(&pvc, &facts), want, "{what}");
        }
    }

    #[test]
    fn reactions() {
        let m = || "m".to_string();
        assert_eq!(
            react(&ProvisionError::Ignored(m()), false),
            Reaction::Ignore
        );
        assert_eq!(
            react(&ProvisionError::Transient(m()), false),
            Reaction::Retry(m())
        );
        assert_eq!(
            react(&ProvisionError::InBackground(m()), false),
            Reaction::InBackground(m())
        );
        assert_eq!(
            react(&ProvisionError::Reschedule(m()), true),
            Reaction::Reschedule {
                message: m(),
                clear_node: true
            }
        );
        assert_eq!(
            react(&ProvisionError::Final(m()), false),
            Reaction::Fail(m())
        );
    }

    #[test]
    fn class_limits_are_positive_integers() {
        let with = |v: &str| StorageClass {
            metadata: ObjectMeta {
                annotations: Some([(ANN_MAX_IN_FLIGHT.to_string(), v.to_string())].into()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(class_limit(&with("8")), Some(8));
        assert_eq!(class_limit(&with(" 2 ")), Some(2));
        assert_eq!(class_limit(&with("0")), None);
        assert_eq!(class_limit(&with("many")), None);
        assert_eq!(class_limit(&StorageClass::default()), None);
    }
}
