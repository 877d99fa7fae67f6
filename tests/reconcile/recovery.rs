//! Recovery against the fake API server: a process "killed" mid-provision (its reconcile
//! aborted) and what the next one does with the claim's entry: deletes what the guest built only
//! when its claim is gone and no namesake uses it, and costs nothing for claims still waiting.

use super::*;

/// Log mode: claim `data` of a slow class whose guest has made the storage when the controller
/// "dies" (its reconcile is aborted), with the intent in the log.
async fn crashed_mid_provision() -> World {
    let mut world = World::new(log_settings(), "");
    world.class("slow", json!({"delayMs": "3000"}), json!({}));
    let pvc = world.claim(claim_of("data", "slow", P));
    let log = world.ctx.intents.clone().expect("log mode");
    tokio::spawn(log.clone().run());
    let crashed = tokio::spawn({
        let ctx = world.ctx.clone();
        async move { claims::reconcile(pvc, ctx).await }
    });
    let started = world.storage.path().join("pvc-u-data.started");
    while !started.exists() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    crashed.abort();
    world
}

#[tokio::test]
async fn a_claim_deleted_after_a_crash_mid_call_keeps_its_storage_and_says_so() {
    let world = crashed_mid_provision().await;
    assert!(
        world.storage.path().join("pvc-u-data").is_dir(),
        "storage made"
    );
    let stored = world.api.objects_under(LOGS);
    assert!(
        stored[0]["data"]["u-data"].is_string(),
        "intent recorded: {}",
        stored[0]
    );
    // The claim is deleted while no one works on it.
    world.api.remove(&claim_path("data"));
    let settled = wasm_provisioner::controller::recover_intents(&world.ctx)
        .await
        .expect("recovered");
    assert_eq!(
        settled, 0,
        "a process leaves its own claims in flight to itself"
    );
    // A restarted process does not know what the guest built: it never asks the guest again
    // (a namesake claim's storage could be the answer), so the storage stays and it says so.
    let restarted = restarted(&world);
    let settled = wasm_provisioner::controller::recover_intents(&restarted)
        .await
        .expect("recovered");
    assert_eq!(settled, 1, "the entry leaves the log");
    assert!(
        world.storage.path().join("pvc-u-data").is_dir(),
        "storage kept"
    );
    assert!(!world.guest_calls().contains("delete"));
    restarted.recorder.flush(Duration::from_secs(5)).await;
    assert!(
        world
            .api
            .event_reasons()
            .contains(&"StorageKept".to_string()),
        "{:?}",
        world.api.event_reasons()
    );
}

#[tokio::test]
async fn recovery_deletes_what_the_guest_built_for_a_claim_gone_before_its_pv() {
    let (world, log) = World::logged();
    record_built(&world, &log, "u-gone", "gone", "/nowhere/gone").await;
    let settled = wasm_provisioner::controller::recover_intents(&restarted(&world))
        .await
        .expect("recovered");
    assert_eq!(settled, 1);
    assert!(
        !world.storage.path().join("pvc-u-gone").exists(),
        "what the guest built for the gone claim is deleted"
    );
    assert!(
        !world.guest_calls().contains("provision"),
        "the guest is never asked again what it built: {}",
        world.guest_calls()
    );
}

#[tokio::test]
async fn a_namesake_claims_live_storage_is_never_deleted() {
    let (mut world, log) = World::logged();
    // The old claim `data` built /shared/team/data (a pattern from namespace and name) and is
    // gone; a new claim of the same name was given the same directory and is Bound.
    record_built(&world, &log, "u-old", "data", "/shared/team/data").await;
    let mut namesake = claim_of("data", "fast", P);
    namesake["metadata"]["uid"] = json!("u-new");
    namesake["spec"]["volumeName"] = json!("pvc-u-new");
    world.claim(namesake);
    world.api.put(
        &pv_path("pvc-u-new"),
        json!({"metadata": {"name": "pvc-u-new", "uid": "pv-u-new"},
               "spec": {"hostPath": {"path": "/shared/team/data"}}, "status": {"phase": "Bound"}}),
    );
    let settled = wasm_provisioner::controller::recover_intents(&restarted_with_claims(&world))
        .await
        .expect("recovered");
    assert_eq!(settled, 1, "the entry leaves the log");
    assert!(
        world.storage.path().join("pvc-u-old").is_dir(),
        "storage a live claim uses is kept"
    );
    assert!(
        !world.guest_calls().contains("delete"),
        "{}",
        world.guest_calls()
    );
}

#[tokio::test]
async fn recovery_makes_no_request_for_waiting_claims() {
    let (mut world, log) = World::logged();
    for n in 0..1000 {
        let pvc = world.claim(claim_of(&format!("w{n}"), "fast", P));
        let uid = pvc.metadata.uid.clone().unwrap();
        let intent = Intent::claim(P, &format!("pvc-{uid}"), NS, &format!("w{n}"));
        log.update(&uid, &intent).expect("fits");
    }
    let before = world.api.requests().len();
    for _ in 0..3 {
        wasm_provisioner::controller::recover_intents(&world.ctx)
            .await
            .expect("recovered");
    }
    let made: Vec<_> = world.api.requests()[before..]
        .iter()
        .filter(|r| !r.path.starts_with(LOGS))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(
        made.is_empty(),
        "1,000 waiting claims cost no request: {made:?}"
    );
    assert_eq!(log.len(), 1000, "waiting claims are the claim path's");
}
