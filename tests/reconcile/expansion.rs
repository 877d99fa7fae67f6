//! The growth path against the fake API server: a Bound claim asking for more than it has is
//! grown through its guest, written as the CSI external-resizer writes it, finished from the PV
//! after a kill between the writes, and refused once (no guest call) for a class that does not
//! allow it.

use super::*;

/// Class `grows` (with `allowVolumeExpansion` as `allow` says) and claim `data`, Bound to its
/// PV of 1Gi, asking for `requested`; the PV says `pv_capacity`.
fn bound_claim_asking(
    world: &mut World,
    allow: bool,
    requested: &str,
    pv_capacity: &str,
) -> Arc<PersistentVolumeClaim> {
    let mut class = ClassBuilder::new("grows", P).uid("uid-class-grows");
    if allow {
        class = class.allow_expansion();
    }
    world
        .classes
        .apply_watcher_event(&watcher::Event::Apply(class.build()));
    world.volume(json!({
        "metadata": {"name": "pvc-u-data", "uid": "uid-pvc-u-data",
                     "annotations": {"pv.kubernetes.io/provisioned-by": P}},
        "spec": {"persistentVolumeReclaimPolicy": "Delete", "storageClassName": "grows",
                 "capacity": {"storage": pv_capacity}, "accessModes": ["ReadWriteOnce"],
                 "hostPath": {"path": "/nowhere"},
                 "claimRef": {"namespace": NS, "name": "data", "uid": "u-data"}},
        "status": {"phase": "Bound"}
    }));
    let mut claim = claim_of("data", "grows", P);
    claim["spec"]["volumeName"] = json!("pvc-u-data");
    claim["spec"]["resources"]["requests"]["storage"] = json!(requested);
    claim["status"] = json!({"phase": "Bound", "capacity": {"storage": "1Gi"},
                            "conditions": [{"type": "Other", "status": "True"}]});
    world.claim(claim)
}

/// The capacity stored at `path` under `field` (`spec` of a PV, `status` of a claim).
fn stored_capacity(world: &World, path: &str, field: &str) -> String {
    let object = world.api.get(path).expect("stored");
    object[field]["capacity"]["storage"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn a_claim_asking_for_more_grows_through_its_guest() {
    let mut world = World::new(settings(), "");
    let pvc = bound_claim_asking(&mut world, true, "2Gi", "1Gi");
    assert!(
        !cache::claim_settled(&pvc),
        "a claim asking to grow stays in the claim cache"
    );
    world.provision(&pvc).await.expect("grown");
    assert_eq!(world.guest_calls(), "expand pvc-u-data\n");
    // The claim as the cache still shows it (our status write not seen yet), reconciled again
    // because our first write changed it: grown already, the guest is not asked again.
    world.provision(&pvc).await.expect("grown already");
    assert_eq!(world.guest_calls(), "expand pvc-u-data\n");
    assert_eq!(
        stored_capacity(&world, &pv_path("pvc-u-data"), "spec"),
        "2Gi"
    );
    assert_eq!(
        stored_capacity(&world, &claim_path("data"), "status"),
        "2Gi"
    );
    let claim = world.api.get(&claim_path("data")).unwrap();
    assert_eq!(
        claim["status"]["conditions"],
        json!([{"type": "Other", "status": "True"}]),
        "the resize condition set and cleared, the others kept"
    );
    let events = world.events().await;
    assert!(
        events.contains(&"Resizing".to_string())
            && events.contains(&"VolumeResizeSuccessful".to_string()),
        "{events:?}"
    );
    let grown = world.sync_claim("data");
    assert!(cache::claim_settled(&grown), "grown, it settles again");
}

/// A process killed after the PV's write and before the claim's: the next reconcile asks the
/// guest again (idempotent), finds the PV grown, and writes only the claim.
#[tokio::test]
async fn a_growth_cut_short_after_the_pv_write_finishes_with_the_claim() {
    let mut world = World::new(settings(), "");
    let pvc = bound_claim_asking(&mut world, true, "2Gi", "2Gi");
    world.provision(&pvc).await.expect("finished");
    assert_eq!(
        stored_capacity(&world, &claim_path("data"), "status"),
        "2Gi"
    );
    let pv_writes = world
        .api
        .requests()
        .iter()
        .filter(|r| r.path.starts_with(&pv_path("pvc-u-data")) && r.method == http::Method::PATCH)
        .count();
    assert_eq!(pv_writes, 0, "a PV that says as much is not written again");
}

/// A class without `allowVolumeExpansion` (admission would have refused the request; the class
/// may have changed since): one warning, no guest call, no write, and given up until it changes.
#[tokio::test]
async fn a_class_that_does_not_allow_growth_is_refused_once_without_a_guest_call() {
    let mut world = World::new(settings(), "");
    let pvc = bound_claim_asking(&mut world, false, "2Gi", "1Gi");
    world.provision(&pvc).await.expect("refused, not failed");
    world.provision(&pvc).await.expect("given up");
    assert_eq!(world.guest_calls(), "", "the guest is never asked");
    assert_eq!(
        stored_capacity(&world, &pv_path("pvc-u-data"), "spec"),
        "1Gi"
    );
    assert_eq!(
        stored_capacity(&world, &claim_path("data"), "status"),
        "1Gi"
    );
    world.events().await;
    let notes = world.api.event_notes();
    let refusals = notes
        .iter()
        .filter(|n| n.contains("does not allow volume expansion"))
        .count();
    assert_eq!(refusals, 1, "{notes:?}");
}
