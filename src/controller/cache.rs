//! What the claim and PV caches hold: the whole object while it may still need work from us, and
//! less once it is settled (bound, with nothing of ours left to do), so the caches grow with the
//! work in flight rather than with the size of the cluster. A settled PV is kept as its identity
//! (the claim path asks whether a claim's PV exists); a settled claim is not kept at all, nor is
//! an unbound claim of a provisioner no loaded guest knows ([`super::claim_watch`] leaves both
//! out, and lists the claims again when a reload serves such a claim's provisioner).
//!
//! A settled object needs no decision: every path that reads the cache looks at a settled entry
//! only for its identity (name, UID, deletion). When it changes (a claim deleted, a PV released)
//! its watch event carries the whole object again, and the cache holds that until it settles.

use std::borrow::Cow;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::Deserialize;

use super::decide::{self, FINALIZER_CLAIM, FINALIZER_CLONE_SOURCE, has_finalizer};

/// A cached claim or PV: whole, or settled down to its identity.
#[derive(Debug, Clone)]
#[expect(
    clippy::large_enum_variant,
    reason = "held behind the store's Arc: boxing the identity would add an allocation per entry"
)]
pub enum Cached<K> {
    /// The whole object (slimmed of managed fields): it may still need work.
    Whole(Arc<K>),
    /// Only its identity, and for a PV which storage it names (see [`storage_of`]): it needs no
    /// work until its next change.
    Settled(ObjectMeta, Option<u64>),
}

/// A cached PV.
pub type CachedVolume = Cached<PersistentVolume>;

impl<K> Cached<K> {
    /// The whole object, when it is held.
    pub fn whole(&self) -> Option<&Arc<K>> {
        match self {
            Cached::Whole(object) => Some(object),
            Cached::Settled(..) => None,
        }
    }
}

impl CachedVolume {
    /// Which storage this PV names (see [`storage_of`]), whole or settled.
    pub fn storage(&self) -> Option<u64> {
        match self {
            Cached::Whole(pv) => storage_of(pv),
            Cached::Settled(_, storage) => *storage,
        }
    }
}

/// A fingerprint of the storage a PV names (its volume source: path, server and path, driver and
/// handle), so that storage another PV still names is never deleted (a PV recreated over it, a
/// namesake claim's volume). `None`: the PV names no source.
pub fn storage_of(pv: &PersistentVolume) -> Option<u64> {
    let spec = pv.spec.as_ref()?;
    let source = if let Some(h) = &spec.host_path {
        ("hostPath", h.path.trim_end_matches('/'), "")
    } else if let Some(l) = &spec.local {
        ("local", l.path.trim_end_matches('/'), "")
    } else if let Some(n) = &spec.nfs {
        ("nfs", n.path.trim_end_matches('/'), n.server.as_str())
    } else if let Some(c) = &spec.csi {
        ("csi", c.volume_handle.as_str(), c.driver.as_str())
    } else {
        return None;
    };
    Some(super::failures::fingerprint(&source))
}

impl<K> From<K> for Cached<K> {
    fn from(object: K) -> Self {
        Cached::Whole(Arc::new(object))
    }
}

impl<K: Resource + Clone> Cached<K> {
    /// Keeps only the identity (and `storage` of it) when `settled` says the whole object needs
    /// no work.
    pub fn settle(
        &mut self,
        settled: impl FnOnce(&K) -> bool,
        storage: impl FnOnce(&K) -> Option<u64>,
    ) {
        if let Cached::Whole(object) = self
            && settled(object)
        {
            *self = Cached::Settled(identity(object.meta()), storage(object));
        }
    }
}

/// What a settled entry keeps: enough to find it, tell it from a namesake, and see it deleted.
fn identity(meta: &ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
        deletion_timestamp: meta.deletion_timestamp.clone(),
        ..ObjectMeta::default()
    }
}

/// A bound claim without a finalizer of ours that asks for no more than it has: no plan acts on
/// it (it is provisioned, no storage of ours depends on its deletion, no clone holds it, and it
/// does not ask to grow).
pub fn claim_settled(pvc: &PersistentVolumeClaim) -> bool {
    let bound = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .is_some_and(|v| !v.is_empty());
    bound
        && !has_finalizer(&pvc.metadata.finalizers, FINALIZER_CLAIM)
        && !has_finalizer(&pvc.metadata.finalizers, FINALIZER_CLONE_SOURCE)
        && super::expand::wanted(pvc).is_none()
}

/// A bound PV not being deleted whose finalizers are as they should be: the delete path acts
/// only on Released PVs and on finalizer changes, so it has nothing to do.
pub fn volume_settled(pv: &PersistentVolume, finalizer_mode: bool) -> bool {
    let bound = pv.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    let settled = bound
        && pv.metadata.deletion_timestamp.is_none()
        && decide::pv_finalizer_change(pv, finalizer_mode).is_none();
    settled || never_ours(pv)
}

/// A PV no provisioner made (no `provisioned-by`: a static pool of local PVs, say) and without
/// the PV finalizer: whatever its phase, no path of ours ever acts on it, so its identity is
/// enough, even while it waits Available or lies Released.
fn never_ours(pv: &PersistentVolume) -> bool {
    decide::claim_provisioner_of_volume(pv).is_none()
        && !has_finalizer(&pv.metadata.finalizers, decide::FINALIZER_PV)
}

impl<'de, K: Deserialize<'de>> Deserialize<'de> for Cached<K> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        K::deserialize(deserializer).map(Cached::from)
    }
}

impl<K> Resource for Cached<K>
where
    K: Resource<DynamicType = ()> + Clone,
{
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        match self {
            Cached::Whole(object) => object.meta(),
            Cached::Settled(meta, _) => meta,
        }
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Cached::Whole(object) => Arc::make_mut(object).meta_mut(),
            Cached::Settled(meta, _) => meta,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    fn claim(volume: Option<&str>, finalizers: &[&str]) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "n", "uid": "u", "resourceVersion": "7",
                         "finalizers": finalizers, "labels": {"app": "x"}},
            "spec": {"volumeName": volume, "storageClassName": "fast"},
        }))
        .expect("claim")
    }

    fn volume(phase: &str, policy: &str, finalizers: &[&str]) -> PersistentVolume {
        serde_json::from_value(json!({
            "metadata": {"name": "pv", "uid": "u", "finalizers": finalizers,
                         "annotations": {decide::ANN_PROVISIONED_BY: "example.com/p"}},
            "spec": {"persistentVolumeReclaimPolicy": policy,
                     "claimRef": {"namespace": "ns", "name": "data", "uid": "claim-uid"}},
            "status": {"phase": phase},
        }))
        .expect("pv")
    }

    #[test]
    fn claims_settle_once_bound_without_our_finalizer() {
        let cases = [
            ("pending", claim(None, &[]), false),
            ("bound", claim(Some("pv"), &[]), true),
            (
                "bound, protection only",
                claim(Some("pv"), &["kubernetes.io/pvc-protection"]),
                true,
            ),
            (
                "bound, our finalizer",
                claim(Some("pv"), &[FINALIZER_CLAIM]),
                false,
            ),
            ("empty volume name", claim(Some(""), &[]), false),
        ];
        for (what, pvc, want) in cases {
            assert_eq!(claim_settled(&pvc), want, "{what}");
        }
    }

    #[test]
    fn volumes_settle_while_bound_with_nothing_to_change() {
        let ours = decide::FINALIZER_PV;
        let cases = [
            ("bound", volume("Bound", "Delete", &[]), false, true),
            ("released", volume("Released", "Delete", &[]), false, false),
            (
                "available",
                volume("Available", "Delete", &[]),
                false,
                false,
            ),
            (
                "bound, finalizer to add",
                volume("Bound", "Delete", &[]),
                true,
                false,
            ),
            (
                "bound, finalizer in place",
                volume("Bound", "Delete", &[ours]),
                true,
                true,
            ),
            (
                "bound, finalizer to remove",
                volume("Bound", "Delete", &[ours]),
                false,
                false,
            ),
        ];
        for (what, pv, finalizer_mode, want) in cases {
            assert_eq!(volume_settled(&pv, finalizer_mode), want, "{what}");
        }
        let mut deleting = volume("Bound", "Delete", &[]);
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        assert!(!volume_settled(&deleting, false), "being deleted");
        for phase in ["Available", "Released", "Bound"] {
            let mut unowned = volume(phase, "Delete", &[]);
            unowned.metadata.annotations = None;
            assert!(
                volume_settled(&unowned, true),
                "a static PV, {phase}: identity only"
            );
            unowned.metadata.finalizers = Some(vec![ours.to_string()]);
            assert!(
                !volume_settled(&unowned, false),
                "a finalizer of ours to remove"
            );
        }
    }

    #[test]
    fn settling_keeps_the_identity_and_drops_the_rest() {
        let mut cached = Cached::from(claim(Some("pv"), &[]));
        cached.settle(claim_settled, |_| None);
        assert!(cached.whole().is_none());
        let meta = cached.meta();
        assert_eq!(meta.name.as_deref(), Some("c"));
        assert_eq!(meta.namespace.as_deref(), Some("n"));
        assert_eq!(meta.uid.as_deref(), Some("u"));
        assert_eq!(meta.resource_version.as_deref(), Some("7"));
        assert_eq!(meta.labels, None);
        assert_eq!(meta.finalizers, None);

        let mut pending = Cached::from(claim(None, &[]));
        pending.settle(claim_settled, |_| None);
        assert!(pending.whole().is_some(), "work left: kept whole");
    }

    #[test]
    fn deserializes_as_the_whole_object_with_the_kinds_own_api_path() {
        let cached: CachedVolume =
            serde_json::from_value(json!({"metadata": {"name": "pv"}})).expect("pv");
        assert!(cached.whole().is_some());
        assert_eq!(
            CachedVolume::url_path(&(), None),
            PersistentVolume::url_path(&(), None)
        );
        assert_eq!(
            Cached::<PersistentVolumeClaim>::url_path(&(), Some("n")),
            PersistentVolumeClaim::url_path(&(), Some("n"))
        );
    }
}
