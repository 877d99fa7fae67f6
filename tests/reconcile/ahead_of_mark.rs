//! Claims kube-controller-manager has not marked for a provisioner yet: provisioned ahead of the
//! mark where nothing else could take them, their finalizer naming the provisioner; left for the
//! mark under `--wait-for-mark`, in a class that keeps its volumes, and beside an unbound PV.

use k8s_openapi::api::core::v1::PersistentVolumeStatus;

use super::*;
use common::e2e::static_pv;

/// A claim of `class` without the storage-provisioner annotation.
fn unmarked(name: &str, class: &str) -> Value {
    let claim = ClaimBuilder::new(name)
        .stored_as(NS, &format!("u-{name}"))
        .class(class)
        .build();
    serde_json::to_value(claim).expect("a claim")
}

/// An Available static PV of `class`, as kube-controller-manager could bind a claim to.
fn available(name: &str, class: &str) -> PersistentVolume {
    let mut pv = static_pv(name, class, std::path::Path::new("/srv"), None);
    pv.status = Some(PersistentVolumeStatus {
        phase: Some("Available".into()),
        ..Default::default()
    });
    pv
}

#[tokio::test]
async fn a_claim_not_marked_is_provisioned_ahead_and_its_finalizer_names_the_provisioner() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(unmarked("data", "fast"));
    world.provision(&pvc).await.expect("provisioned");
    assert!(world.api.get(&pv_path("pvc-u-data")).is_some());
    assert!(
        world.guest_calls().contains("pvc-u-data"),
        "{}",
        world.guest_calls()
    );
    let calls = world.api.calls();
    let intent = &world.api.requests()[calls
        .iter()
        .position(|c| c.starts_with("PATCH"))
        .expect("the finalizer's write")]
    .body;
    assert_eq!(intent["metadata"]["finalizers"], json!([FINALIZER_CLAIM]));
    for key in [
        "volume.kubernetes.io/storage-provisioner",
        "volume.beta.kubernetes.io/storage-provisioner",
    ] {
        assert_eq!(intent["metadata"]["annotations"][key], P, "{intent}");
    }
    let claim = world.api.get(&claim_path("data")).expect("claim");
    assert_eq!(
        claim["metadata"]["annotations"]["volume.beta.kubernetes.io/storage-provisioner"],
        P
    );
}

#[tokio::test]
async fn with_wait_for_mark_a_claim_not_marked_is_left_alone() {
    let mut settings = settings();
    settings.wait_for_mark = true;
    let mut world = World::new(settings, "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(unmarked("data", "fast"));
    world.provision(&pvc).await.expect("nothing to do");
    assert!(world.api.requests().is_empty(), "{:?}", world.api.calls());
    assert!(world.guest_calls().is_empty(), "{}", world.guest_calls());
    // Marked, it is provisioned.
    let marked = world.claim(claim_of("data", "fast", P));
    world.provision(&marked).await.expect("provisioned");
    assert!(world.api.get(&pv_path("pvc-u-data")).is_some());
}

#[tokio::test]
async fn a_class_that_keeps_its_volumes_waits_for_the_mark() {
    let mut world = World::new(settings(), "");
    let class = ClassBuilder::new("kept", P)
        .reclaim("Retain")
        .uid("uid-class-kept")
        .build();
    world
        .classes
        .apply_watcher_event(&watcher::Event::Apply(class));
    let pvc = world.claim(unmarked("data", "kept"));
    world.provision(&pvc).await.expect("nothing to do");
    assert!(world.api.requests().is_empty(), "{:?}", world.api.calls());
    assert!(world.guest_calls().is_empty(), "{}", world.guest_calls());
}

#[tokio::test]
async fn an_unbound_pv_of_the_class_makes_its_claims_wait_for_the_mark() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    world.class("other", json!({}), json!({}));
    let cached = |pv| watcher::Event::Apply(CachedVolume::from(pv));
    world
        .ctx
        .bindable
        .observe(&cached(available("static", "fast")));
    let pvc = world.claim(unmarked("data", "fast"));
    world.provision(&pvc).await.expect("nothing to do");
    assert!(world.api.requests().is_empty(), "{:?}", world.api.calls());
    assert!(world.guest_calls().is_empty(), "{}", world.guest_calls());
    // Another class's claim goes ahead meanwhile.
    let beside = world.claim(unmarked("beside", "other"));
    world.provision(&beside).await.expect("provisioned");
    assert!(world.api.get(&pv_path("pvc-u-beside")).is_some());
    // Once that PV is bound to another claim, the class's claims go ahead again.
    let mut bound = available("static", "fast");
    bound.status.as_mut().expect("status").phase = Some("Bound".into());
    world.ctx.bindable.observe(&cached(bound));
    world.provision(&pvc).await.expect("provisioned");
    assert!(world.api.get(&pv_path("pvc-u-data")).is_some());
}
