//! Pure decisions: is this claim ours to provision, is this volume ours to delete, has a key failed
//! too often, how long to back off. Plain data in, plain answers out; no I/O.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;

use crate::wasm::capabilities::{Capabilities, Capability};

/// The GA storage-provisioner annotation the PV controller sets on claims (Kubernetes 1.23+).
pub const ANN_STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
/// The beta annotation, the only one Kubernetes up to 1.22 sets.
pub const ANN_BETA_STORAGE_PROVISIONER: &str = "volume.beta.kubernetes.io/storage-provisioner";
/// The node the scheduler picked for a WaitForFirstConsumer claim.
pub const ANN_SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// The pre-1.12 selected-node key, read only as a fallback.
pub const ANN_ALPHA_SELECTED_NODE: &str = "volume.alpha.kubernetes.io/selected-node";
/// The beta class annotation, which wins over `spec.storageClassName`.
pub const ANN_BETA_STORAGE_CLASS: &str = "volume.beta.kubernetes.io/storage-class";
/// Names the provisioner that created a PV.
pub const ANN_PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// The PV finalizer of the Go library's `AddFinalizer` mode.
pub const FINALIZER_PV: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// Our claim finalizer: set before a guest is called, removed once the PV exists or the asset is
/// gone, so neither a deleted claim nor a crash between guest call and PV create leaks storage.
pub const FINALIZER_CLAIM: &str = "wasm-provisioner.dev/provisioning";
/// Our finalizer on a claim whose data a guest is copying into a clone: set before the call,
/// removed when it returns (or, after a crash, by the next reconcile of the source).
pub const FINALIZER_CLONE_SOURCE: &str = "wasm-provisioner.dev/clone-source";

/// A non-empty annotation value.
fn annotation<'a>(annotations: &'a Option<BTreeMap<String, String>>, key: &str) -> Option<&'a str> {
    annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// The provisioner a claim asks for: GA annotation first, beta as fallback.
pub fn claim_provisioner(pvc: &PersistentVolumeClaim) -> Option<&str> {
    let anns = &pvc.metadata.annotations;
    annotation(anns, ANN_STORAGE_PROVISIONER)
        .or_else(|| annotation(anns, ANN_BETA_STORAGE_PROVISIONER))
        .filter(|p| !p.is_empty())
}

/// The class a claim names: the beta annotation wins over `spec.storageClassName`.
pub fn claim_class(pvc: &PersistentVolumeClaim) -> Option<&str> {
    annotation(&pvc.metadata.annotations, ANN_BETA_STORAGE_CLASS)
        .or_else(|| pvc.spec.as_ref()?.storage_class_name.as_deref())
        .filter(|c| !c.is_empty())
}

/// The class a PV is of, as kube-controller-manager matches it to claims: the beta annotation
/// wins over `spec.storageClassName`, as for a claim ([`claim_class`]).
pub fn volume_class(pv: &PersistentVolume) -> Option<&str> {
    annotation(&pv.metadata.annotations, ANN_BETA_STORAGE_CLASS)
        .or_else(|| pv.spec.as_ref()?.storage_class_name.as_deref())
        .filter(|c| !c.is_empty())
}

/// The selected node, GA key first, alpha as fallback.
pub fn selected_node(pvc: &PersistentVolumeClaim) -> Option<&str> {
    let anns = &pvc.metadata.annotations;
    annotation(anns, ANN_SELECTED_NODE)
        .or_else(|| annotation(anns, ANN_ALPHA_SELECTED_NODE))
        .filter(|n| !n.is_empty())
}

/// The provisioner that created a PV (`pv.kubernetes.io/provisioned-by`).
pub fn claim_provisioner_of_volume(pv: &PersistentVolume) -> Option<&str> {
    annotation(&pv.metadata.annotations, ANN_PROVISIONED_BY)
}

/// The deterministic PV name for a claim.
pub fn pv_name(pvc: &PersistentVolumeClaim) -> Option<String> {
    pvc.metadata.uid.as_ref().map(|uid| format!("pvc-{uid}"))
}

/// Whether the claim wants a raw block volume.
pub fn wants_block(pvc: &PersistentVolumeClaim) -> bool {
    pvc.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block")
}

/// What the claim needs beyond a plain volume. A guest that does not declare all of it is never
/// called for the claim: it is refused, not provisioned as if it needed nothing.
pub fn claim_needs(pvc: &PersistentVolumeClaim) -> Capabilities {
    use super::data_source::{self, DataSource};
    let selector = pvc.spec.as_ref().is_some_and(|s| s.selector.is_some());
    let source = data_source::of(pvc);
    Capabilities::NONE
        .with_if(Capability::Block, wants_block(pvc))
        .with_if(Capability::Selector, selector)
        .with_if(
            Capability::Clone,
            matches!(source, DataSource::Claim { .. }),
        )
        .with_if(
            Capability::Snapshot,
            matches!(source, DataSource::Snapshot { .. }),
        )
}

/// Whether an object carries a finalizer.
pub fn has_finalizer(finalizers: &Option<Vec<String>>, finalizer: &str) -> bool {
    finalizers.iter().flatten().any(|f| f == finalizer)
}

/// Whether a provisioner name is served here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serving {
    /// A loaded guest serves it.
    Yes,
    /// Its guest served it earlier and is gone for now (unloaded or refused on reload).
    Gone,
    /// Not ours.
    No,
}

impl From<bool> for Serving {
    fn from(served: bool) -> Serving {
        if served { Serving::Yes } else { Serving::No }
    }
}

/// What to do with a claim, before any guest hook is asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimDecision<'a> {
    /// Not ours, already bound, or not ready: leave it alone.
    Skip(&'static str),
    /// Ours, but its guest is gone for now: wait (with an event) until it is loaded again.
    GuestGone(&'a str),
    /// Ours, but its class is not (yet) known: retry with backoff and say so.
    ClassMissing(&'a str),
    /// Ours and ready: provision with this class.
    Provision {
        /// The provisioner name the claim asks for.
        provisioner: &'a str,
        /// The class name.
        class: &'a str,
    },
}

/// Whether a claim kube-controller-manager has not marked for a provisioner yet (no
/// storage-provisioner annotation) is provisioned ahead of that mark, by its class's provisioner.
///
/// Why: kube-controller-manager marks claims in the one worker that also binds every PV created
/// for them, so with many claims its marks, not the provisioner, set the pace (the last mark of
/// 500 claims came at 4.1-4.2 s 20 ms from the API server, docs/benchmarks.md). It marks a claim
/// only once no PV can take it; a PV created for the claim (its claimRef naming the claim's UID)
/// is the one it binds first. So a claim goes ahead only when no PV of its class could be bound
/// to it instead, and only in a class that deletes its volumes: should kube-controller-manager
/// still bind the claim elsewhere (a PV that arrived in between), the PV made ahead is Released
/// by it and deleted by the volume path, as any provisioned PV whose claim is bound elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmarked {
    /// Never: only marked claims are provisioned (`--wait-for-mark`, the Go library's way).
    Wait,
    /// When nothing else could take it: `bindable_pv_in_class` says whether a PV of the claim's
    /// class waits unbound (see [`super::bindable`]).
    Ahead {
        /// A PV kube-controller-manager could bind a claim of this class to exists.
        bindable_pv_in_class: bool,
    },
}

/// The provisioner a claim is for: the one kube-controller-manager's mark names, or, on a claim
/// not marked, its class's (the claim of a class served here is provisioned ahead of the mark,
/// see [`Unmarked`]). `class` is the cached class the claim names, if it exists.
pub fn provisioner_of<'a>(
    pvc: &'a PersistentVolumeClaim,
    class: Option<&'a StorageClass>,
) -> Option<&'a str> {
    claim_provisioner(pvc).or_else(|| {
        class
            .map(|c| c.provisioner.as_str())
            .filter(|p| !p.is_empty())
    })
}

/// Why an unmarked claim of a served class waits for kube-controller-manager's mark, if it does.
fn waits_for_mark(class: &StorageClass, unmarked: Unmarked) -> Option<&'static str> {
    let keeps = class
        .reclaim_policy
        .as_deref()
        .is_some_and(|p| p != "Delete");
    match unmarked {
        Unmarked::Wait => Some("waiting for kube-controller-manager's mark (--wait-for-mark)"),
        Unmarked::Ahead { .. } if keeps => {
            Some("waiting for kube-controller-manager's mark: its class keeps released volumes")
        }
        Unmarked::Ahead {
            bindable_pv_in_class: true,
        } => Some("waiting for kube-controller-manager's mark: a PV of its class may take it"),
        Unmarked::Ahead { .. } => None,
    }
}

/// Should this claim be provisioned? The library's `shouldProvision`, minus the guest hook, and
/// ahead of kube-controller-manager's mark as `unmarked` says for the claim's class (asked only
/// of a claim not marked). `served` says whether a provisioner name has a loaded guest; `class`
/// is the cached class the claim names ([`claim_class`]), if it exists.
pub fn should_provision<'a, S: Into<Serving>>(
    pvc: &'a PersistentVolumeClaim,
    served: impl Fn(&str) -> S,
    class: Option<&'a StorageClass>,
    unmarked: impl FnOnce(&StorageClass) -> Unmarked,
) -> ClaimDecision<'a> {
    if pvc.metadata.deletion_timestamp.is_some() {
        return ClaimDecision::Skip("claim is being deleted");
    }
    if pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .is_some_and(|v| !v.is_empty())
    {
        return ClaimDecision::Skip("claim already names a volume");
    }
    let Some(provisioner) = provisioner_of(pvc, class) else {
        return ClaimDecision::Skip("no storage-provisioner annotation");
    };
    // Not marked: the provisioner is the class's (so the class is there).
    if claim_provisioner(pvc).is_none()
        && let Some(class) = class
        && let Some(reason) = waits_for_mark(class, unmarked(class))
    {
        return ClaimDecision::Skip(reason);
    }
    match served(provisioner).into() {
        Serving::Yes => {}
        Serving::Gone => return ClaimDecision::GuestGone(provisioner),
        Serving::No => return ClaimDecision::Skip("provisioner not served here"),
    }
    let Some(class_name) = claim_class(pvc) else {
        return ClaimDecision::Skip("claim names no class");
    };
    let Some(class) = class else {
        return ClaimDecision::ClassMissing(class_name);
    };
    if class.provisioner != provisioner {
        return ClaimDecision::Skip("class names another provisioner");
    }
    if class.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer")
        && selected_node(pvc).is_none()
    {
        return ClaimDecision::Skip("waiting for first consumer");
    }
    ClaimDecision::Provision {
        provisioner,
        class: class_name,
    }
}

/// Should this PV's storage be deleted? The library's `shouldDelete`, minus the guest hook.
/// Returns the provisioner name that owns it when the answer is yes.
pub fn should_delete(
    pv: &PersistentVolume,
    served: impl Fn(&str) -> bool,
    finalizer_mode: bool,
) -> Option<&str> {
    let provisioner = annotation(&pv.metadata.annotations, ANN_PROVISIONED_BY)?;
    if !served(provisioner) {
        return None;
    }
    if pv.metadata.deletion_timestamp.is_some() {
        // In finalizer mode a PV being deleted still needs its storage removed while our
        // finalizer holds it; otherwise someone else is deleting it.
        if !(finalizer_mode && has_finalizer(&pv.metadata.finalizers, FINALIZER_PV)) {
            return None;
        }
    }
    // Released in every mode, as the library: a PV deleted while Bound is held by
    // pv-protection until its claim goes, and only then may its storage go (a pod may be using it).
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    let policy = pv
        .spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.as_deref());
    (phase == Some("Released") && policy == Some("Delete") && released_by_its_claim(pv))
        .then_some(provisioner)
}

/// Whether the PV still names the claim it was released by. An admin who clears `claimRef` on
/// a Released PV (to reuse it by hand) leaves it `Released` until kube-controller-manager marks
/// it `Available`: milliseconds, or as long as kube-controller-manager is down. It never
/// reclaims a PV without a claimRef, and neither do we (the Go library does, in that window).
pub fn released_by_its_claim(pv: &PersistentVolume) -> bool {
    pv.spec
        .as_ref()
        .and_then(|s| s.claim_ref.as_ref())
        .is_some_and(|r| {
            r.name.as_deref().is_some_and(|n| !n.is_empty())
                && r.uid.as_deref().is_some_and(|u| !u.is_empty())
        })
}

/// Should our PV finalizer be added (`Some(true)`) or removed (`Some(false)`)? In finalizer
/// mode it goes on `Delete` volumes that are bound or released by their claim (a PV created
/// before carries it from its create): it is what survives a kill between our DELETE and the
/// storage delete. It comes off outside that mode, for other policies, and from a PV being
/// deleted whose storage is not ours to delete any more (its claimRef cleared, or not bound or
/// released): the storage is kept, and the PV is not held for ever.
pub fn pv_finalizer_change(pv: &PersistentVolume, finalizer_mode: bool) -> Option<bool> {
    let has = has_finalizer(&pv.metadata.finalizers, FINALIZER_PV);
    let policy = pv
        .spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.as_deref());
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    let bound_or_released = matches!(phase, Some("Bound" | "Released"));
    let deleting = pv.metadata.deletion_timestamp.is_some();
    let add = finalizer_mode
        && !has
        && policy == Some("Delete")
        && !deleting
        && bound_or_released
        && released_by_its_claim(pv);
    let remove = has
        && (!finalizer_mode
            || policy != Some("Delete")
            || (deleting && !(bound_or_released && released_by_its_claim(pv))));
    if add {
        Some(true)
    } else if remove {
        Some(false)
    } else {
        None
    }
}

/// A strategic-merge patch adding or removing one finalizer. It touches only that entry of the
/// list, so it needs no resourceVersion and never conflicts with other writers; the `uid` makes it
/// fail on a namesake created since.
pub fn finalizer_patch(uid: &Option<String>, finalizer: &str, present: bool) -> serde_json::Value {
    if present {
        serde_json::json!({ "metadata": { "uid": uid, "finalizers": [finalizer] } })
    } else {
        serde_json::json!({ "metadata": { "uid": uid, "$deleteFromPrimitiveList/finalizers": [finalizer] } })
    }
}

/// Annotation that earlier versions wrote with our claim finalizer (the claim's class, for a
/// cleanup that asked the guest again what it built). Nothing reads it now; removing our
/// finalizer removes it too, so claims of those versions are left clean.
pub const ANN_CLASS_RECORD: &str = "wasm-provisioner.dev/storage-class";

/// The claim-finalizer patch: [`finalizer_patch`] for [`FINALIZER_CLAIM`]; taking it off also
/// drops an earlier version's [`ANN_CLASS_RECORD`] (one write either way).
pub fn claim_finalizer_patch(uid: &Option<String>, present: bool) -> serde_json::Value {
    let mut patch = finalizer_patch(uid, FINALIZER_CLAIM, present);
    if !present {
        patch["metadata"]["annotations"] = serde_json::json!({ ANN_CLASS_RECORD: null });
    }
    patch
}

/// Names `provisioner` on a claim `patch` with both storage-provisioner annotations, as
/// kube-controller-manager marks a claim (1.23+ writes both, and finds nothing to change), unless
/// the claim is marked already: a claim holding a finalizer of ours says whose it is, also when
/// it was provisioned ahead of the mark and bound without one. Part of the finalizer's own write.
pub fn name_provisioner(
    patch: &mut serde_json::Value,
    pvc: &PersistentVolumeClaim,
    provisioner: &str,
) {
    if claim_provisioner(pvc).is_some() {
        return;
    }
    let annotations = &mut patch["metadata"]["annotations"];
    annotations[ANN_STORAGE_PROVISIONER] = serde_json::json!(provisioner);
    annotations[ANN_BETA_STORAGE_PROVISIONER] = serde_json::json!(provisioner);
}

/// What of a class an intent-log entry records: what a guest's delete reads (name, provisioner,
/// parameters, reclaim policy, mount options, binding mode), not its metadata.
pub fn class_record(class: &StorageClass) -> String {
    let record = StorageClass {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: class.metadata.name.clone(),
            uid: class.metadata.uid.clone(),
            ..Default::default()
        },
        provisioner: class.provisioner.clone(),
        parameters: class.parameters.clone(),
        reclaim_policy: class.reclaim_policy.clone(),
        mount_options: class.mount_options.clone(),
        volume_binding_mode: class.volume_binding_mode.clone(),
        allow_volume_expansion: class.allow_volume_expansion,
        allowed_topologies: class.allowed_topologies.clone(),
    };
    serde_json::to_string(&record).unwrap_or_default()
}

/// Exponential backoff: `start` doubled per earlier failure, capped at `max`.
pub fn backoff(failures: u32, start: Duration, max: Duration) -> Duration {
    let shift = failures.saturating_sub(1).min(30);
    start.saturating_mul(1u32 << shift).min(max)
}

/// Whether a key with this many failures is given up (threshold 0 = never).
pub fn exceeded_threshold(failures: u32, threshold: u32) -> bool {
    threshold > 0 && failures >= threshold
}

/// A PV named `pvc-1` in `phase` with reclaim `policy`, provisioned by `by`: the fixture of the
/// decision tables here and in [`super::plan`].
#[cfg(test)]
pub(crate) fn test_pv(phase: &str, policy: &str, by: Option<&str>) -> PersistentVolume {
    use k8s_openapi::api::core::v1::{PersistentVolumeSpec, PersistentVolumeStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some("pvc-1".into()),
            annotations: by.map(|b| [(ANN_PROVISIONED_BY.to_string(), b.to_string())].into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            persistent_volume_reclaim_policy: Some(policy.into()),
            claim_ref: Some(k8s_openapi::api::core::v1::ObjectReference {
                namespace: Some("default".into()),
                name: Some("data".into()),
                uid: Some("claim-uid".into()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: Some(PersistentVolumeStatus {
            phase: Some(phase.into()),
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolumeClaimSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    const P: &str = "example.com/p";

    struct ClaimBuilder(PersistentVolumeClaim);

    fn claim(name: &str) -> ClaimBuilder {
        ClaimBuilder(PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}")),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec::default()),
            status: None,
        })
    }

    impl ClaimBuilder {
        fn ann(mut self, k: &str, v: &str) -> Self {
            self.0
                .metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(k.into(), v.into());
            self
        }
        fn provisioner(self, p: &str) -> Self {
            self.ann(ANN_BETA_STORAGE_PROVISIONER, p)
        }
        fn class(mut self, c: &str) -> Self {
            self.0.spec.as_mut().unwrap().storage_class_name = Some(c.into());
            self
        }
        fn bound_to(mut self, v: &str) -> Self {
            self.0.spec.as_mut().unwrap().volume_name = Some(v.into());
            self
        }
        fn deleting(mut self) -> Self {
            self.0.metadata.deletion_timestamp = Some(Time(Default::default()));
            self
        }
    }

    fn class(name: &str, provisioner: &str, wffc: bool) -> StorageClass {
        StorageClass {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            provisioner: provisioner.into(),
            volume_binding_mode: wffc.then(|| "WaitForFirstConsumer".into()),
            ..Default::default()
        }
    }

    fn decide<'a>(
        pvc: &'a PersistentVolumeClaim,
        classes: &'a [StorageClass],
    ) -> ClaimDecision<'a> {
        let class = claim_class(pvc).and_then(|n| {
            classes
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(n))
        });
        should_provision(pvc, |p| p == P, class, |_| Unmarked::Wait)
    }

    #[test]
    fn claims_of_a_gone_guest_wait_and_unknown_provisioners_are_skipped() {
        let classes = [class("fast", P, false)];
        let pvc = claim("a").provisioner(P).class("fast").0;
        let class = Some(&classes[0]);
        assert_eq!(
            should_provision(&pvc, |_| Serving::Gone, class, |_| Unmarked::Wait),
            ClaimDecision::GuestGone(P)
        );
        assert_eq!(
            should_provision(&pvc, |_| Serving::No, class, |_| Unmarked::Wait),
            ClaimDecision::Skip("provisioner not served here")
        );
        // A bound or deleted claim never waits for anything.
        let bound = claim("b").provisioner(P).class("fast").bound_to("pv").0;
        assert!(matches!(
            should_provision(&bound, |_| Serving::Gone, class, |_| Unmarked::Wait),
            ClaimDecision::Skip(_)
        ));
        let deleting = claim("c").provisioner(P).class("fast").deleting().0;
        assert!(matches!(
            should_provision(&deleting, |_| Serving::Gone, class, |_| Unmarked::Wait),
            ClaimDecision::Skip(_)
        ));
    }

    #[test]
    fn should_provision_table() {
        let fast = class("fast", P, false);
        let wffc = class("local", P, true);
        let other = class("other", "someone/else", false);
        let classes = [fast, wffc, other];
        let provision = |c| ClaimDecision::Provision {
            provisioner: P,
            class: c,
        };
        let cases: Vec<(&str, PersistentVolumeClaim, ClaimDecision)> = vec![
            (
                "beta annotation",
                claim("a").provisioner(P).class("fast").0,
                provision("fast"),
            ),
            (
                "GA annotation",
                claim("a").ann(ANN_STORAGE_PROVISIONER, P).class("fast").0,
                provision("fast"),
            ),
            (
                "GA wins over beta",
                claim("a")
                    .ann(ANN_STORAGE_PROVISIONER, P)
                    .ann(ANN_BETA_STORAGE_PROVISIONER, "x/y")
                    .class("fast")
                    .0,
                provision("fast"),
            ),
            (
                "no annotation, waiting for the mark",
                claim("a").class("fast").0,
                ClaimDecision::Skip("waiting for kube-controller-manager's mark (--wait-for-mark)"),
            ),
            (
                "no annotation, no class",
                claim("a").0,
                ClaimDecision::Skip("no storage-provisioner annotation"),
            ),
            (
                "other provisioner",
                claim("a").provisioner("x/y").class("fast").0,
                ClaimDecision::Skip("provisioner not served here"),
            ),
            (
                "bound",
                claim("a").provisioner(P).class("fast").bound_to("pv1").0,
                ClaimDecision::Skip("claim already names a volume"),
            ),
            (
                "deleting",
                claim("a").provisioner(P).class("fast").deleting().0,
                ClaimDecision::Skip("claim is being deleted"),
            ),
            (
                "class missing",
                claim("a").provisioner(P).class("nope").0,
                ClaimDecision::ClassMissing("nope"),
            ),
            (
                "beta class annotation wins",
                claim("a")
                    .provisioner(P)
                    .class("nope")
                    .ann(ANN_BETA_STORAGE_CLASS, "fast")
                    .0,
                provision("fast"),
            ),
            (
                "no class",
                claim("a").provisioner(P).0,
                ClaimDecision::Skip("claim names no class"),
            ),
            (
                "class of another provisioner",
                claim("a").provisioner(P).class("other").0,
                ClaimDecision::Skip("class names another provisioner"),
            ),
            (
                "wffc without node",
                claim("a").provisioner(P).class("local").0,
                ClaimDecision::Skip("waiting for first consumer"),
            ),
            (
                "wffc with node",
                claim("a")
                    .provisioner(P)
                    .class("local")
                    .ann(ANN_SELECTED_NODE, "n1")
                    .0,
                provision("local"),
            ),
            (
                "wffc with alpha node",
                claim("a")
                    .provisioner(P)
                    .class("local")
                    .ann(ANN_ALPHA_SELECTED_NODE, "n1")
                    .0,
                provision("local"),
            ),
        ];
        for (what, pvc, want) in &cases {
            assert_eq!(&decide(pvc, &classes), want, "{what}");
        }
    }

    #[test]
    fn unmarked_claims_go_ahead_only_where_nothing_else_could_take_them() {
        let mut keeping = class("keeping", P, false);
        keeping.reclaim_policy = Some("Retain".into());
        let mut deleting = class("deleting", P, false);
        deleting.reclaim_policy = Some("Delete".into());
        let classes = [
            class("fast", P, false),
            class("local", P, true),
            class("other", "someone/else", false),
            keeping,
            deleting,
        ];
        let ahead = Unmarked::Ahead {
            bindable_pv_in_class: false,
        };
        let beside_a_pv = Unmarked::Ahead {
            bindable_pv_in_class: true,
        };
        let provision = |c| ClaimDecision::Provision {
            provisioner: P,
            class: c,
        };
        let cases: Vec<(&str, PersistentVolumeClaim, Unmarked, ClaimDecision)> = vec![
            (
                "ahead",
                claim("a").class("fast").0,
                ahead,
                provision("fast"),
            ),
            (
                "ahead, Delete spelled out",
                claim("a").class("deleting").0,
                ahead,
                provision("deleting"),
            ),
            (
                "a PV of the class may take it",
                claim("a").class("fast").0,
                beside_a_pv,
                ClaimDecision::Skip(
                    "waiting for kube-controller-manager's mark: a PV of its class may take it",
                ),
            ),
            (
                "marked claims never wait for a mark",
                claim("a").provisioner(P).class("fast").0,
                beside_a_pv,
                provision("fast"),
            ),
            (
                "a class that keeps released volumes",
                claim("a").class("keeping").0,
                ahead,
                ClaimDecision::Skip(
                    "waiting for kube-controller-manager's mark: its class keeps released volumes",
                ),
            ),
            (
                "another provisioner's class",
                claim("a").class("other").0,
                ahead,
                ClaimDecision::Skip("provisioner not served here"),
            ),
            (
                "class not known yet",
                claim("a").class("nope").0,
                ahead,
                ClaimDecision::Skip("no storage-provisioner annotation"),
            ),
            (
                "wffc without node",
                claim("a").class("local").0,
                ahead,
                ClaimDecision::Skip("waiting for first consumer"),
            ),
            (
                "wffc with node",
                claim("a").class("local").ann(ANN_SELECTED_NODE, "n1").0,
                ahead,
                provision("local"),
            ),
            (
                "bound",
                claim("a").class("fast").bound_to("pv1").0,
                ahead,
                ClaimDecision::Skip("claim already names a volume"),
            ),
            (
                "deleting",
                claim("a").class("fast").deleting().0,
                ahead,
                ClaimDecision::Skip("claim is being deleted"),
            ),
        ];
        for (what, pvc, unmarked, want) in &cases {
            let class = claim_class(pvc).and_then(|n| {
                classes
                    .iter()
                    .find(|c| c.metadata.name.as_deref() == Some(n))
            });
            assert_eq!(
                &should_provision(pvc, |p| p == P, class, |_| *unmarked),
                want,
                "{what}"
            );
        }
        // An unmarked claim's guest gone for now: it waits for the guest, as a marked one does.
        let pvc = claim("a").class("fast").0;
        assert_eq!(
            should_provision(&pvc, |_| Serving::Gone, Some(&classes[0]), |_| ahead),
            ClaimDecision::GuestGone(P)
        );
        // Whose claim it is: the mark's provisioner, else its class's.
        assert_eq!(provisioner_of(&pvc, Some(&classes[0])), Some(P));
        let marked = claim("a").provisioner("x/y").class("fast").0;
        assert_eq!(provisioner_of(&marked, Some(&classes[0])), Some("x/y"));
        assert_eq!(provisioner_of(&pvc, None), None);
    }

    fn pv(phase: &str, policy: &str, by: Option<&str>) -> PersistentVolume {
        test_pv(phase, policy, by)
    }

    fn cleared(mut pv: PersistentVolume) -> PersistentVolume {
        pv.spec.as_mut().unwrap().claim_ref = None;
        pv
    }

    #[test]
    fn should_delete_table() {
        let served = |p: &str| p == P;
        let cases = [
            (
                "released delete ours",
                pv("Released", "Delete", Some(P)),
                false,
                Some(P),
            ),
            ("bound", pv("Bound", "Delete", Some(P)), false, None),
            ("retain", pv("Released", "Retain", Some(P)), false, None),
            (
                "not ours",
                pv("Released", "Delete", Some("x/y")),
                false,
                None,
            ),
            ("static", pv("Released", "Delete", None), false, None),
            ("failed phase", pv("Failed", "Delete", Some(P)), false, None),
            (
                "released, claimRef cleared by an admin",
                cleared(pv("Released", "Delete", Some(P))),
                false,
                None,
            ),
            (
                "released, claimRef cleared, finalizer mode",
                cleared(pv("Released", "Delete", Some(P))),
                true,
                None,
            ),
        ];
        for (what, volume, mode, want) in &cases {
            assert_eq!(should_delete(volume, served, *mode), *want, "{what}");
        }
        let mut deleting = pv("Released", "Delete", Some(P));
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        assert_eq!(
            should_delete(&deleting, served, false),
            None,
            "being deleted, no finalizer mode"
        );
        deleting.metadata.finalizers = Some(vec![FINALIZER_PV.into()]);
        assert_eq!(
            should_delete(&deleting, served, true),
            Some(P),
            "finalizer mode holds it"
        );
        deleting.metadata.finalizers = None;
        assert_eq!(
            should_delete(&deleting, served, true),
            None,
            "finalizer already gone"
        );
        // `kubectl delete pv` on a Bound volume: its claim (and a pod) still use the storage.
        let mut bound_deleting = pv("Bound", "Delete", Some(P));
        bound_deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        bound_deleting.metadata.finalizers = Some(vec![FINALIZER_PV.into()]);
        assert_eq!(
            should_delete(&bound_deleting, served, true),
            None,
            "bound and being deleted in finalizer mode: the storage stays until Released"
        );
    }

    #[test]
    fn pv_finalizer_changes() {
        let bound = pv("Bound", "Delete", Some(P));
        assert_eq!(pv_finalizer_change(&bound, true), Some(true));
        assert_eq!(pv_finalizer_change(&bound, false), None);
        let mut with = bound.clone();
        with.metadata.finalizers = Some(vec![FINALIZER_PV.into()]);
        assert_eq!(pv_finalizer_change(&with, false), Some(false));
        assert_eq!(pv_finalizer_change(&with, true), None);
        let mut retain = with.clone();
        retain
            .spec
            .as_mut()
            .unwrap()
            .persistent_volume_reclaim_policy = Some("Retain".into());
        assert_eq!(pv_finalizer_change(&retain, true), Some(false));
        // Released by its claim and not held yet (a PV created before finalizer mode): add.
        let released = pv("Released", "Delete", Some(P));
        assert_eq!(pv_finalizer_change(&released, true), Some(true));
        assert_eq!(pv_finalizer_change(&cleared(released), true), None);
        // Being deleted: held while its storage may still be ours to delete...
        let mut deleting = with.clone();
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        assert_eq!(pv_finalizer_change(&deleting, true), None, "bound");
        let mut released_deleting = deleting.clone();
        released_deleting.status.as_mut().unwrap().phase = Some("Released".into());
        assert_eq!(pv_finalizer_change(&released_deleting, true), None);
        // ...and let go, storage kept, once it is not: claimRef cleared, or made Available.
        assert_eq!(
            pv_finalizer_change(&cleared(released_deleting.clone()), true),
            Some(false)
        );
        let mut available = cleared(released_deleting);
        available.status.as_mut().unwrap().phase = Some("Available".into());
        assert_eq!(pv_finalizer_change(&available, true), Some(false));
    }

    #[test]
    fn finalizer_patches_touch_only_their_entry() {
        let uid = Some("u1".to_string());
        let add = finalizer_patch(&uid, FINALIZER_CLAIM, true);
        assert_eq!(add["metadata"]["finalizers"][0], FINALIZER_CLAIM);
        assert_eq!(add["metadata"]["uid"], "u1");
        let remove = finalizer_patch(&uid, FINALIZER_PV, false);
        assert_eq!(
            remove["metadata"]["$deleteFromPrimitiveList/finalizers"][0],
            FINALIZER_PV
        );
        assert!(remove["metadata"].get("finalizers").is_none());
    }

    #[test]
    fn a_finalizer_of_ours_names_the_provisioner_on_a_claim_not_marked() {
        let unmarked = claim("a").class("fast").0;
        let mut patch = finalizer_patch(&unmarked.metadata.uid, FINALIZER_CLAIM, true);
        name_provisioner(&mut patch, &unmarked, P);
        assert_eq!(patch["metadata"]["finalizers"][0], FINALIZER_CLAIM);
        assert_eq!(patch["metadata"]["annotations"][ANN_STORAGE_PROVISIONER], P);
        assert_eq!(
            patch["metadata"]["annotations"][ANN_BETA_STORAGE_PROVISIONER],
            P
        );
        // A marked claim keeps kube-controller-manager's mark as it is.
        let marked = claim("a").provisioner(P).class("fast").0;
        let mut patch = finalizer_patch(&marked.metadata.uid, FINALIZER_CLAIM, true);
        name_provisioner(&mut patch, &marked, P);
        assert!(patch["metadata"].get("annotations").is_none());
    }

    #[test]
    fn the_claim_finalizer_goes_on_alone_and_comes_off_with_an_old_class_record() {
        let uid = Some("u1".to_string());
        let on = claim_finalizer_patch(&uid, true);
        assert_eq!(on["metadata"]["finalizers"][0], FINALIZER_CLAIM);
        assert!(on["metadata"].get("annotations").is_none(), "{on}");
        let off = claim_finalizer_patch(&uid, false);
        assert!(off["metadata"]["annotations"][ANN_CLASS_RECORD].is_null());
        assert!(
            off["metadata"]["$deleteFromPrimitiveList/finalizers"][0] == FINALIZER_CLAIM,
            "{off}"
        );
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let s = Duration::from_secs(15);
        let m = Duration::from_secs(1000);
        assert_eq!(backoff(1, s, m), s);
        assert_eq!(backoff(2, s, m), Duration::from_secs(30));
        assert_eq!(backoff(7, s, m), Duration::from_secs(960));
        assert_eq!(backoff(8, s, m), m);
        assert_eq!(backoff(200, s, m), m);
        assert_eq!(backoff(0, s, m), s);
    }

    #[test]
    fn thresholds() {
        assert!(!exceeded_threshold(14, 15));
        assert!(exceeded_threshold(15, 15));
        assert!(!exceeded_threshold(10_000, 0));
    }

    #[test]
    fn names_and_fallbacks() {
        let c = claim("a")
            .ann(ANN_SELECTED_NODE, "")
            .ann(ANN_ALPHA_SELECTED_NODE, "n2")
            .0;
        assert_eq!(selected_node(&c), Some("n2"));
        assert_eq!(pv_name(&c).as_deref(), Some("pvc-uid-a"));
        assert!(!wants_block(&c));
    }

    /// The gate: a claim is refused, naming the first capability it needs that its guest does
    /// not declare; a guest is asked nothing about a plain claim.
    #[test]
    fn claims_needing_what_the_guest_does_not_declare_are_refused() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
        let with = |block: bool, selector: Option<LabelSelector>| {
            let mut c = claim("c").0;
            let spec = c.spec.as_mut().unwrap();
            spec.volume_mode = block.then(|| "Block".into());
            spec.selector = selector;
            c
        };
        let labels = LabelSelector {
            match_labels: Some([("tier".to_string(), "gold".to_string())].into()),
            ..Default::default()
        };
        let none = Capabilities::NONE;
        let block = none.with(Capability::Block);
        let selector = none.with(Capability::Selector);
        let both = block.with(Capability::Selector);
        let (b, s) = (Some(Capability::Block), Some(Capability::Selector));
        #[rustfmt::skip]
        let table = [
            // claim                                declared   refused for
            (with(false, None),                     none,      None),
            (with(true, None),                      none,      b),
            (with(true, None),                      block,     None),
            (with(false, Some(labels.clone())),     none,      s),
            (with(false, Some(labels.clone())),     block,     s),
            (with(false, Some(labels.clone())),     selector,  None),
            // An empty selector is still a selector (Kubernetes' own provisioners refuse it).
            (with(false, Some(Default::default())), none,      s),
            (with(true, Some(labels.clone())),      selector,  b),
            (with(true, Some(labels.clone())),      block,     s),
            (with(true, Some(labels)),              both,      None),
        ];
        for (i, (pvc, declared, refused)) in table.into_iter().enumerate() {
            assert_eq!(
                claim_needs(&pvc).first_missing(declared),
                refused,
                "row {i}"
            );
        }
        assert!(
            claim_needs(&with(false, None)).is_empty(),
            "a plain claim asks nothing"
        );
    }
}
