//! The PVs kube-controller-manager could still bind a new claim to, by class, fed from the PV
//! watch: while a class has one, its claims not marked yet wait for kube-controller-manager's
//! mark (it may bind them to that PV) instead of being provisioned ahead of it
//! ([`super::decide::Unmarked`]).
//!
//! Counted from whole objects as the watch delivers them, before the cache settles them down to
//! their identity (a static PV, never ours, is kept as no more than that).

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::ResourceExt;
use kube::runtime::watcher;

use super::cache::CachedVolume;
use super::decide::{claim_provisioner_of_volume, volume_class};

/// The class of a PV kube-controller-manager could bind a claim to: not being deleted, not
/// Bound, Released or Failed, and not a provisioned PV made for one claim (its claimRef naming
/// that claim's UID: ours included, it takes no other). A PV pre-bound by name only (an admin's
/// `claimRef` without UID) counts: which claim it is meant for is kube-controller-manager's to
/// match. So does a static PV whose claimRef has a UID while it is not Bound yet: that is
/// kube-controller-manager binding it (it writes the claimRef first, then the phase, then the
/// claim's `volumeName`), and the claim it binds must not be provisioned meanwhile.
pub fn bindable_class(pv: &PersistentVolume) -> Option<&str> {
    if pv.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Bound" | "Released" | "Failed")) {
        return None;
    }
    let spec = pv.spec.as_ref()?;
    let made_for_a_claim = claim_provisioner_of_volume(pv).is_some()
        && spec
            .claim_ref
            .as_ref()
            .and_then(|r| r.uid.as_deref())
            .is_some_and(|uid| !uid.is_empty());
    if made_for_a_claim {
        return None;
    }
    volume_class(pv)
}

/// Bindable PVs by name (their class), and how many each class has.
#[derive(Debug, Default)]
struct Index {
    class_of: HashMap<String, String>,
    per_class: HashMap<String, usize>,
}

impl Index {
    fn set(&mut self, name: &str, class: Option<&str>) {
        if self.class_of.get(name).map(String::as_str) == class {
            return;
        }
        if let Some(was) = self.class_of.remove(name)
            && let Some(count) = self.per_class.get_mut(&was)
        {
            *count -= 1;
            if *count == 0 {
                self.per_class.remove(&was);
            }
        }
        if let Some(class) = class {
            self.class_of.insert(name.to_owned(), class.to_owned());
            *self.per_class.entry(class.to_owned()).or_default() += 1;
        }
    }
}

/// The index, and the one a re-list is building (it replaces the index once the list is done).
#[derive(Debug, Default)]
pub struct BindableVolumes {
    state: Mutex<(Index, Option<Index>)>,
}

impl BindableVolumes {
    /// Applies one event of the PV watch.
    pub fn observe(&self, event: &watcher::Event<CachedVolume>) {
        let mut state = self.state.lock().expect("lock");
        let (index, listing) = &mut *state;
        match event {
            watcher::Event::Init => *listing = Some(Index::default()),
            watcher::Event::InitApply(pv) => {
                if let Some(listing) = listing {
                    listing.set(&pv.name_any(), pv.whole().and_then(|pv| bindable_class(pv)));
                }
            }
            watcher::Event::InitDone => {
                if let Some(listed) = listing.take() {
                    *index = listed;
                }
            }
            watcher::Event::Apply(pv) => {
                index.set(&pv.name_any(), pv.whole().and_then(|pv| bindable_class(pv)));
            }
            watcher::Event::Delete(pv) => index.set(&pv.name_any(), None),
        }
    }

    /// Whether a PV of `class` waits to be bound.
    pub fn in_class(&self, class: &str) -> bool {
        self.state
            .lock()
            .expect("lock")
            .0
            .per_class
            .contains_key(class)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ObjectReference, PersistentVolumeSpec, PersistentVolumeStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    use crate::controller::decide::{ANN_BETA_STORAGE_CLASS, ANN_PROVISIONED_BY};

    /// A PV of `class`; one whose claimRef has a UID is a provisioned one (`provisioned-by`).
    fn pv(
        name: &str,
        class: &str,
        phase: Option<&str>,
        claim_uid: Option<&str>,
    ) -> PersistentVolume {
        let provisioned = claim_uid.is_some_and(|uid| !uid.is_empty());
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: provisioned.then(|| {
                    [(ANN_PROVISIONED_BY.to_string(), "example.com/p".to_string())].into()
                }),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                storage_class_name: Some(class.into()),
                claim_ref: claim_uid.map(|uid| ObjectReference {
                    namespace: Some("ns".into()),
                    name: Some("claim".into()),
                    uid: (!uid.is_empty()).then(|| uid.into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: phase.map(|p| PersistentVolumeStatus {
                phase: Some(p.into()),
                ..Default::default()
            }),
        }
    }

    /// A static PV (no `provisioned-by`) kube-controller-manager has written a claim's UID into.
    fn static_held(phase: Option<&str>) -> PersistentVolume {
        let mut pv = pv("s", "fast", phase, Some("u"));
        pv.metadata.annotations = None;
        pv
    }

    #[test]
    fn what_kube_controller_manager_could_still_bind() {
        let deleting = {
            let mut pv = pv("d", "fast", Some("Available"), None);
            pv.metadata.deletion_timestamp = Some(Time(Default::default()));
            pv
        };
        let by_annotation = {
            let mut pv = pv("a", "", Some("Available"), None);
            pv.metadata.annotations =
                Some([(ANN_BETA_STORAGE_CLASS.to_string(), "slow".to_string())].into());
            pv
        };
        let cases = [
            (
                "available",
                pv("p", "fast", Some("Available"), None),
                Some("fast"),
            ),
            (
                "new, no phase yet",
                pv("p", "fast", None, None),
                Some("fast"),
            ),
            (
                "pending",
                pv("p", "fast", Some("Pending"), None),
                Some("fast"),
            ),
            (
                "pre-bound by name only",
                pv("p", "fast", Some("Available"), Some("")),
                Some("fast"),
            ),
            (
                "made for one claim (ours too)",
                pv("p", "fast", Some("Pending"), Some("u")),
                None,
            ),
            ("bound", pv("p", "fast", Some("Bound"), Some("u")), None),
            (
                "static, being bound by kube-controller-manager",
                static_held(Some("Available")),
                Some("fast"),
            ),
            ("static, bound", static_held(Some("Bound")), None),
            (
                "released",
                pv("p", "fast", Some("Released"), Some("u")),
                None,
            ),
            ("failed", pv("p", "fast", Some("Failed"), None), None),
            ("no class", pv("p", "", Some("Available"), None), None),
            ("being deleted", deleting, None),
            ("class by the beta annotation", by_annotation, Some("slow")),
        ];
        for (what, pv, want) in &cases {
            assert_eq!(bindable_class(pv), *want, "{what}");
        }
    }

    #[test]
    fn follows_the_watch_and_a_relist_replaces_what_it_knew() {
        let index = BindableVolumes::default();
        let apply = |pv| watcher::Event::Apply(CachedVolume::from(pv));
        index.observe(&apply(pv("s1", "fast", Some("Available"), None)));
        index.observe(&apply(pv("s2", "fast", Some("Available"), None)));
        index.observe(&apply(pv("ours", "slow", Some("Pending"), Some("u"))));
        assert!(index.in_class("fast"));
        assert!(
            !index.in_class("slow"),
            "a PV made for one claim takes no other"
        );
        // One bound, one deleted: none left in the class.
        index.observe(&apply(pv("s1", "fast", Some("Bound"), Some("u1"))));
        assert!(index.in_class("fast"));
        index.observe(&watcher::Event::Delete(CachedVolume::from(pv(
            "s2",
            "fast",
            Some("Available"),
            None,
        ))));
        assert!(!index.in_class("fast"));
        // Applying the same state twice counts it once.
        let again = pv("s3", "fast", Some("Available"), None);
        index.observe(&apply(again.clone()));
        index.observe(&apply(again));
        index.observe(&apply(pv("s3", "fast", Some("Bound"), Some("u3"))));
        assert!(!index.in_class("fast"));
        // A re-list replaces the index once done, not before.
        index.observe(&apply(pv("gone", "old", Some("Available"), None)));
        index.observe(&watcher::Event::Init);
        index.observe(&watcher::Event::InitApply(CachedVolume::from(pv(
            "s4",
            "fast",
            Some("Available"),
            None,
        ))));
        assert!(index.in_class("old") && !index.in_class("fast"));
        index.observe(&watcher::Event::InitDone);
        assert!(!index.in_class("old") && index.in_class("fast"));
    }
}
