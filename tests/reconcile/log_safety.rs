//! What the intent log may and may not delete when the cluster or the guest leaves it unsure:
//! a call that never answered, a namesake claim the cache has not seen, a guard asked about a
//! PV the cache shows stale, and a log too full to take one more claim.

use super::*;

/// The claim is gone from the API server and the cache.
fn claim_deleted(world: &mut World, pvc: &Arc<PersistentVolumeClaim>) {
    world
        .api
        .remove(&claim_path(&pvc.metadata.name.clone().unwrap()));
    world
        .claims
        .apply_watcher_event(&watcher::Event::Delete(pvc.as_ref().clone()));
}

#[tokio::test]
async fn a_claim_deleted_after_a_call_that_never_answered_keeps_its_storage_and_says_so() {
    let (mut world, log) = World::logged();
    world.class("slow", json!({"fail": "in-background"}), json!({}));
    let pvc = world.claim(claim_of("data", "slow", P));
    let uid = pvc.metadata.uid.clone().unwrap();
    let error = world.provision(&pvc).await.expect_err("in the background");
    assert_eq!(error.label(), "in-background");
    assert!(
        log.holds(&uid),
        "its storage may be on the way: the entry stays"
    );
    claim_deleted(&mut world, &pvc);
    let settled = wasm_provisioner::controller::recover_intents(&world.ctx)
        .await
        .expect("recovered");
    assert_eq!(settled, 1, "the entry leaves the log");
    assert!(
        world.events().await.contains(&"StorageKept".to_string()),
        "what the unanswered call built is kept, and said so"
    );
    assert!(!world.guest_calls().contains("delete"));
}

#[tokio::test]
async fn a_namesake_the_cache_has_not_seen_holds_the_delete_until_its_volume_is_known() {
    let (world, log) = World::logged();
    record_built(&world, &log, "u-old", "data", "/nowhere/team/data").await;
    // A claim of the same name, just created: the restarted process' cache has not seen it,
    // and a name-based pattern may give it the same directory any moment.
    let mut namesake = claim_of("data", "fast", P);
    namesake["metadata"]["uid"] = json!("u-new");
    world.api.put(&claim_path("data"), namesake.clone());
    let restarted = restarted(&world);
    let settled = wasm_provisioner::controller::recover_intents(&restarted)
        .await
        .expect("recovered");
    assert_eq!(settled, 0, "left for the next pass");
    assert!(
        world.storage.path().join("pvc-u-old").is_dir(),
        "kept for now"
    );
    assert!(!world.guest_calls().contains("delete"));
    // Bound now, to storage of its own: the old one is nobody's.
    namesake["spec"]["volumeName"] = json!("pvc-u-new");
    world.api.put(&claim_path("data"), namesake);
    world.api.put(
        &pv_path("pvc-u-new"),
        json!({"metadata": {"name": "pvc-u-new", "uid": "pv-u-new"},
               "spec": {"hostPath": {"path": "/shared/team/data-2"}}, "status": {"phase": "Bound"}}),
    );
    let settled = wasm_provisioner::controller::recover_intents(&restarted)
        .await
        .expect("recovered");
    assert_eq!(settled, 1);
    assert!(
        world.guest_calls().contains("delete"),
        "{}",
        world.guest_calls()
    );
}

#[tokio::test]
async fn the_deletion_guard_is_asked_about_the_live_pv_when_the_storage_goes_first() {
    // Neither the intent log nor our PV finalizer: the storage goes first, and the delete
    // carries no precondition.
    let mut world = World::new(
        Settings {
            add_pv_finalizer: false,
            ..settings()
        },
        "",
    );
    world.class("fast", json!({}), json!({}));
    std::fs::create_dir_all(world.storage.path().join("pvc-g")).unwrap();
    let stale = world.volume(json!({
        "metadata": {"name": "pvc-g", "uid": "uid-pvc-g",
                     "annotations": {"pv.kubernetes.io/provisioned-by": P}},
        "spec": {"persistentVolumeReclaimPolicy": "Delete", "storageClassName": "fast",
                 "hostPath": {"path": "/nowhere"},
                 "claimRef": {"namespace": NS, "name": "g", "uid": "u-g"}},
        "status": {"phase": "Released"}
    }));
    // An admin marked it to keep a moment ago; the cache has not caught up.
    let mut live = serde_json::to_value(&*stale).unwrap();
    live["metadata"]["annotations"]["scripted.wasm-provisioner.dev/keep"] = json!("true");
    world.api.put(&pv_path("pvc-g"), live);
    volumes::reconcile(stale, world.ctx.clone())
        .await
        .expect("kept");
    assert!(
        world.storage.path().join("pvc-g").is_dir(),
        "the guard kept it"
    );
    assert!(world.api.get(&pv_path("pvc-g")).is_some());
    assert!(!world.guest_calls().contains("delete"));
}

#[tokio::test]
async fn a_claim_that_does_not_fit_a_full_log_carries_its_intent_itself() {
    let (mut world, log) = World::logged();
    // Claims whose calls never answered, say: the log takes no more.
    let mut n = 0;
    while log
        .update(
            &format!("u-wait-{n}"),
            &Intent::claim(P, &format!("pvc-u-wait-{n}"), NS, &format!("wait-{n}")),
        )
        .is_ok()
    {
        n += 1;
    }
    let pvc = world.claim(claim_of("data", "fast", P));
    world.provision(&pvc).await.expect("provisioned");
    assert!(
        world.api.get(&pv_path("pvc-u-data")).is_some(),
        "PV created"
    );
    let finalizer_patches: Vec<_> = world
        .api
        .requests()
        .into_iter()
        .filter(|r| r.path == claim_path("data") && r.method == http::Method::PATCH)
        .map(|r| r.body.to_string())
        .collect();
    assert!(
        finalizer_patches
            .first()
            .is_some_and(|body| body.contains(FINALIZER_CLAIM)),
        "our finalizer went on before the guest call: {finalizer_patches:?}"
    );
    assert!(
        world.finalizers("data").is_empty(),
        "and came off with the PV"
    );
    assert!(!log.holds(&pvc.metadata.uid.clone().unwrap()));
}
