//! The growth decision, as pure functions: does a claim ask to grow, is it ours to grow, and
//! what its status becomes once it has.

use k8s_openapi::api::core::v1::{
    PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimCondition,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};

use crate::controller::convert::quantity_bytes;
use crate::controller::decide::{self, Serving};
use crate::controller::node::VolumeOwner;

/// The claim conditions a resize sets (the CSI external-resizer's and kubelet's), cleared once
/// the claim has its new capacity.
pub const RESIZE_CONDITIONS: [&str; 2] = ["Resizing", "FileSystemResizePending"];

/// The size a claim asks to grow to: its `spec.resources.requests.storage` when it is Bound,
/// not being deleted, and that request is more than its `status.capacity.storage`. A claim
/// whose quantities do not parse asks for nothing here (it never got a volume of ours).
pub fn wanted(pvc: &PersistentVolumeClaim) -> Option<u64> {
    if pvc.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let spec = pvc.spec.as_ref()?;
    spec.volume_name.as_deref().filter(|v| !v.is_empty())?;
    let requested = spec.resources.as_ref()?.requests.as_ref()?.get("storage")?;
    let capacity = pvc.status.as_ref()?.capacity.as_ref()?.get("storage")?;
    let (requested, capacity) = (
        quantity_bytes(&requested.0).ok()?,
        quantity_bytes(&capacity.0).ok()?,
    );
    (requested > capacity).then_some(requested)
}

/// What the growth path reads about the world; the shell answers from the caches and guests.
pub trait ExpandFacts {
    /// The guest a plan hands on to be called.
    type Guest;
    /// Whether a provisioner name is served here.
    fn serving(&self, provisioner: &str) -> Serving;
    /// The guest serving `provisioner`.
    fn guest(&self, provisioner: &str) -> Option<Self::Guest>;
    /// Whether that guest exports the `expansion` hook.
    fn expands(&self, guest: &Self::Guest) -> bool;
    /// Node mode: whose volume this is (None outside node mode).
    fn owner(&self, pv: &PersistentVolume) -> Option<VolumeOwner>;
}

/// What to do with a claim that asks to grow.
#[derive(Debug, Clone, PartialEq)]
pub enum ExpandPlan<'a, G = ()> {
    /// Not ours to grow (another provisioner's PV, another node's volume, not bound to it).
    Skip(&'static str),
    /// Ours, but its guest is not loaded now: a reload looks again.
    WaitForGuest(&'a str),
    /// Ours, but its class is not in the cache: a counted failure, retried.
    ClassMissing(&'a str),
    /// Ours, and it cannot grow (its class does not allow it, or its guest has no hook): one
    /// warning, nothing changed, and no retry until the claim or its class changes.
    Refuse(String),
    /// Call the guest's `expand`.
    Expand {
        /// The guest serving the PV's provisioner.
        guest: G,
        /// The claim's class.
        class: &'a StorageClass,
    },
}

/// Decides what to do with `pvc` (which [`wanted`] to grow), bound to the live `pv`.
pub fn plan_expansion<'a, F: ExpandFacts>(
    pvc: &PersistentVolumeClaim,
    pv: &'a PersistentVolume,
    class: Option<&'a StorageClass>,
    class_name: &'a str,
    facts: &F,
) -> ExpandPlan<'a, F::Guest> {
    let Some(provisioner) = decide::claim_provisioner_of_volume(pv) else {
        return ExpandPlan::Skip("its PV names no provisioner");
    };
    match facts.serving(provisioner) {
        Serving::No => return ExpandPlan::Skip("its PV's provisioner is not served here"),
        Serving::Gone => return ExpandPlan::WaitForGuest(provisioner),
        Serving::Yes => {}
    }
    let bound_here = pv
        .spec
        .as_ref()
        .and_then(|s| s.claim_ref.as_ref())
        .is_some_and(|r| r.uid.is_some() && r.uid == pvc.metadata.uid);
    if !bound_here {
        return ExpandPlan::Skip("its PV is not bound to it");
    }
    match facts.owner(pv) {
        None | Some(VolumeOwner::Mine) => {}
        Some(_) => return ExpandPlan::Skip("not this node's volume"),
    }
    let Some(class) = class else {
        return ExpandPlan::ClassMissing(class_name);
    };
    if class.allow_volume_expansion != Some(true) {
        return ExpandPlan::Refuse(format!(
            "StorageClass {class_name} does not allow volume expansion (allowVolumeExpansion is not true); the PV and the claim stay as they are"
        ));
    }
    let Some(guest) = facts.guest(provisioner) else {
        return ExpandPlan::WaitForGuest(provisioner);
    };
    if !facts.expands(&guest) {
        return ExpandPlan::Refuse(format!(
            "class {class_name} cannot expand: the guest serving {provisioner} does not export the `expansion` hook; the PV and the claim stay as they are"
        ));
    }
    ExpandPlan::Expand { guest, class }
}

/// The capacity to write for `bytes` grown: the claim's request as written when that is what
/// was granted (`2Gi` stays `2Gi`), else the bytes.
pub fn capacity_quantity(pvc: &PersistentVolumeClaim, bytes: u64) -> Quantity {
    pvc.spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .filter(|q| quantity_bytes(&q.0).ok() == Some(bytes))
        .cloned()
        .unwrap_or_else(|| crate::controller::convert::bytes_quantity(bytes))
}

/// The claim's conditions with `Resizing` set, or `None` when it is set already.
pub fn resizing_patch(pvc: &PersistentVolumeClaim, now: &str) -> Option<Value> {
    let conditions = conditions_of(pvc);
    if conditions
        .iter()
        .any(|c| c.type_ == "Resizing" && c.status == "True")
    {
        return None;
    }
    let mut kept = without_resize(conditions);
    kept.push(json!({
        "type": "Resizing",
        "status": "True",
        "lastTransitionTime": now,
    }));
    Some(json!({ "status": { "conditions": kept } }))
}

/// The claim's status once grown: its capacity, and its conditions without the resize ones.
pub fn grown_patch(pvc: &PersistentVolumeClaim, capacity: &Quantity) -> Value {
    json!({
        "status": {
            "capacity": { "storage": capacity },
            "conditions": without_resize(conditions_of(pvc)),
        }
    })
}

fn conditions_of(pvc: &PersistentVolumeClaim) -> &[PersistentVolumeClaimCondition] {
    pvc.status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default()
}

fn without_resize(conditions: &[PersistentVolumeClaimCondition]) -> Vec<Value> {
    conditions
        .iter()
        .filter(|c| !RESIZE_CONDITIONS.contains(&c.type_.as_str()))
        .map(|c| serde_json::to_value(c).expect("a condition serialises"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ObjectReference, PersistentVolumeClaimSpec, PersistentVolumeClaimStatus,
        PersistentVolumeSpec, VolumeResourceRequirements,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use std::collections::BTreeMap;

    const PROVISIONER: &str = "example.com/hostpath";

    fn claim(requested: &str, capacity: Option<&str>, bound: bool) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("data".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                volume_name: bound.then(|| "pvc-u1".to_string()),
                storage_class_name: Some("fast".into()),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(BTreeMap::from([(
                        "storage".to_string(),
                        Quantity(requested.into()),
                    )])),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: capacity.map(|c| PersistentVolumeClaimStatus {
                capacity: Some(BTreeMap::from([(
                    "storage".to_string(),
                    Quantity(c.into()),
                )])),
                ..Default::default()
            }),
        }
    }

    fn volume(bound_to: &str, by: Option<&str>) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some("pvc-u1".into()),
                annotations: by.map(|by| {
                    BTreeMap::from([(decide::ANN_PROVISIONED_BY.to_string(), by.to_string())])
                }),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                claim_ref: Some(ObjectReference {
                    uid: Some(bound_to.into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn class(allow: Option<bool>) -> StorageClass {
        StorageClass {
            metadata: ObjectMeta {
                name: Some("fast".into()),
                ..Default::default()
            },
            provisioner: PROVISIONER.into(),
            allow_volume_expansion: allow,
            ..Default::default()
        }
    }

    struct World {
        serving: Serving,
        hook: bool,
        owner: Option<VolumeOwner>,
    }

    impl ExpandFacts for World {
        type Guest = ();
        fn serving(&self, _: &str) -> Serving {
            self.serving
        }
        fn guest(&self, _: &str) -> Option<()> {
            (self.serving == Serving::Yes).then_some(())
        }
        fn expands(&self, _: &()) -> bool {
            self.hook
        }
        fn owner(&self, _: &PersistentVolume) -> Option<VolumeOwner> {
            self.owner.clone()
        }
    }

    const SERVED: World = World {
        serving: Serving::Yes,
        hook: true,
        owner: None,
    };

    #[test]
    fn a_bound_claim_asking_for_more_than_its_capacity_wants_to_grow() {
        assert_eq!(wanted(&claim("2Gi", Some("1Gi"), true)), Some(2 << 30));
        assert_eq!(wanted(&claim("1Gi", Some("1Gi"), true)), None, "as much");
        assert_eq!(wanted(&claim("1Gi", Some("2Gi"), true)), None, "less");
        assert_eq!(wanted(&claim("2Gi", None, true)), None, "no capacity yet");
        assert_eq!(wanted(&claim("2Gi", Some("1Gi"), false)), None, "unbound");
        assert_eq!(
            wanted(&claim("lots", Some("1Gi"), true)),
            None,
            "unparsable"
        );
        let mut deleted = claim("2Gi", Some("1Gi"), true);
        deleted.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
        );
        assert_eq!(wanted(&deleted), None, "being deleted");
    }

    #[test]
    fn only_our_own_pv_bound_to_the_claim_on_our_node_with_a_class_that_allows_it_grows() {
        let pvc = claim("2Gi", Some("1Gi"), true);
        let (ours, allows) = (volume("u1", Some(PROVISIONER)), class(Some(true)));
        let plan = |pv: &PersistentVolume, class: Option<&StorageClass>, world: &World| {
            format!("{:?}", plan_expansion(&pvc, pv, class, "fast", world))
        };
        assert!(plan(&ours, Some(&allows), &SERVED).starts_with("Expand"));
        let skipped = [
            (volume("u1", None), "names no provisioner"),
            (volume("u2", Some(PROVISIONER)), "not bound to it"),
        ];
        for (pv, why) in skipped {
            assert!(plan(&pv, Some(&allows), &SERVED).contains(why), "{why}");
        }
        let elsewhere = World {
            serving: Serving::No,
            ..SERVED
        };
        assert!(plan(&ours, Some(&allows), &elsewhere).contains("not served here"));
        let unloaded = World {
            serving: Serving::Gone,
            ..SERVED
        };
        assert!(plan(&ours, Some(&allows), &unloaded).starts_with("WaitForGuest"));
        let other_node = World {
            owner: Some(VolumeOwner::OtherNode),
            ..SERVED
        };
        assert!(plan(&ours, Some(&allows), &other_node).contains("not this node's"));
        let my_node = World {
            owner: Some(VolumeOwner::Mine),
            ..SERVED
        };
        assert!(plan(&ours, Some(&allows), &my_node).starts_with("Expand"));
        assert!(plan(&ours, None, &SERVED).starts_with("ClassMissing"));
        for allow in [None, Some(false)] {
            assert!(plan(&ours, Some(&class(allow)), &SERVED).contains("does not allow"));
        }
        let no_hook = World {
            hook: false,
            ..SERVED
        };
        assert!(plan(&ours, Some(&allows), &no_hook).contains("`expansion` hook"));
    }

    #[test]
    fn the_grown_status_keeps_the_request_as_written_and_drops_only_resize_conditions() {
        let mut pvc = claim("2Gi", Some("1Gi"), true);
        assert_eq!(capacity_quantity(&pvc, 2 << 30), Quantity("2Gi".into()));
        assert_eq!(
            capacity_quantity(&pvc, (3 << 30) + 1).0,
            ((3u64 << 30) + 1).to_string()
        );
        let resizing = resizing_patch(&pvc, "2026-12-06T00:00:00Z").expect("not set yet");
        assert_eq!(resizing["status"]["conditions"][0]["type"], "Resizing");
        let condition = |type_: &str| PersistentVolumeClaimCondition {
            type_: type_.into(),
            status: "True".into(),
            ..Default::default()
        };
        pvc.status.as_mut().unwrap().conditions =
            Some(vec![condition("Resizing"), condition("Other")]);
        assert_eq!(resizing_patch(&pvc, "now"), None, "set already");
        let grown = grown_patch(&pvc, &Quantity("2Gi".into()));
        assert_eq!(grown["status"]["capacity"]["storage"], "2Gi");
        let kept = grown["status"]["conditions"].as_array().unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0]["type"], "Other");
    }
}
