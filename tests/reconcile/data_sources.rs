//! Claims with a data source (issue 34): a populator's kind is left alone with one Normal
//! event; a copy (of a claim or a snapshot) reaches only a guest that can make it, and is
//! otherwise refused: never provisioned as an empty volume.

use super::*;

fn with_source(name: &str, source: Value) -> Value {
    let mut claim = claim_of(name, "fast", P);
    claim["spec"]["dataSourceRef"] = source.clone();
    claim["spec"]["dataSource"] = source;
    claim
}

#[tokio::test]
async fn a_populators_claim_is_left_alone_with_one_normal_event() {
    let mut world = World::of("hostpath", "/volumes", settings(), "");
    world.class("fast", json!({}), json!({}));
    let source = json!({"apiGroup": "populators.example.com", "kind": "Hello", "name": "h1"});
    let pvc = world.claim(with_source("populated", source));
    world.provision(&pvc).await.expect("left alone");
    let pvc = world.sync_claim("populated");
    world.provision(&pvc).await.expect("left alone again");
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let notes = world.api.event_notes();
    assert_eq!(
        notes
            .iter()
            .filter(|n| n.starts_with("LeftToPopulator:"))
            .count(),
        1,
        "{notes:#?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("Hello (API group populators.example.com)")),
        "{notes:#?}"
    );
    assert!(
        world.api.get(&pv_path("pvc-u-populated")).is_none(),
        "no PV"
    );
    assert!(world.finalizers("populated").is_empty(), "no finalizer");
    assert_eq!(
        std::fs::read_dir(world.storage.path()).unwrap().count(),
        0,
        "the guest was never called"
    );
}

#[tokio::test]
async fn a_copy_the_guest_cannot_make_is_refused_never_provisioned_empty() {
    let mut world = World::of("hostpath", "/volumes", settings(), "");
    world.class("fast", json!({}), json!({}));
    let clone = json!({"kind": "PersistentVolumeClaim", "name": "db"});
    let restore =
        json!({"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"});
    for (name, source) in [("clone", clone), ("restore", restore)] {
        let pvc = world.claim(with_source(name, source));
        world.provision(&pvc).await.expect("a refusal is an answer");
        assert!(
            world.api.get(&pv_path(&format!("pvc-u-{name}"))).is_none(),
            "no PV for {name}"
        );
        assert!(world.finalizers(name).is_empty(), "nothing holds {name}");
    }
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let notes = world.api.event_notes();
    for refused in [
        "this class cannot copy from a PersistentVolumeClaim",
        "this class cannot copy from a VolumeSnapshot",
    ] {
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("ProvisioningFailed:") && n.contains(refused)),
            "{refused}: {notes:#?}"
        );
    }
    assert_eq!(std::fs::read_dir(world.storage.path()).unwrap().count(), 0);
}
