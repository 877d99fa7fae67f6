//! The volume path against the fake API server: which PVs are deleted, in how many requests, and
//! how storage whose PV went first is looked after by the intent log's recovery.

use super::*;

/// `--add-pv-finalizer`, class `fast`.
fn pv_finalizer_world() -> World {
    let mut world = World::new(
        Settings {
            add_pv_finalizer: true,
            ..settings()
        },
        "",
    );
    world.class("fast", json!({}), json!({}));
    world
}

fn our_pv(name: &str, phase: &str, deleting: bool, finalizers: &[&str]) -> Value {
    let mut pv = json!({
        "metadata": {"name": name, "uid": format!("uid-{name}"), "finalizers": finalizers,
                     "annotations": {"pv.kubernetes.io/provisioned-by": P}},
        "spec": {"persistentVolumeReclaimPolicy": "Delete", "storageClassName": "fast",
                 "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                 "hostPath": {"path": "/nowhere"}},
        "status": {"phase": phase}
    });
    if deleting {
        pv["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
    }
    pv
}

#[tokio::test]
async fn a_released_volume_is_deleted_by_its_guest_then_removed() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let pv = world.volume(our_pv("pvc-r", "Released", false, &[]));
    volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect("deleted");
    assert!(world.guest_calls().contains("delete"));
    assert!(world.api.get(&pv_path("pvc-r")).is_none(), "PV removed");
}

#[tokio::test]
async fn a_bound_volume_deleted_in_finalizer_mode_keeps_its_storage() {
    let mut world = pv_finalizer_world();
    let pv = world.volume(our_pv("pvc-b", "Bound", true, &[FINALIZER_PV]));
    volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect("nothing to do yet");
    assert!(
        world.guest_calls().is_empty(),
        "storage deleted while its claim is bound: {}",
        world.guest_calls()
    );
    assert!(world.api.calls().iter().all(|c| !c.starts_with("DELETE")));
    // Once the claim is gone the PV is Released: now the storage goes, and the PV with it.
    let pv = world.volume(our_pv("pvc-b", "Released", true, &[FINALIZER_PV]));
    volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect("deleted");
    assert!(world.guest_calls().contains("delete"));
}

#[tokio::test]
async fn finalizer_mode_puts_the_pv_finalizer_on_bound_volumes() {
    let mut world = World::new(
        Settings {
            add_pv_finalizer: true,
            ..settings()
        },
        "",
    );
    let pv = world.volume(our_pv("pvc-f", "Bound", false, &[]));
    volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect("patched");
    let stored = world.api.get(&pv_path("pvc-f")).unwrap();
    assert_eq!(stored["metadata"]["finalizers"][0], FINALIZER_PV);
}

/// A Released PV of ours, annotated as the scripted guest reads it, with storage to delete.
pub(super) fn released_with_storage(
    world: &mut World,
    name: &str,
    annotations: Value,
) -> Arc<PersistentVolume> {
    let mut pv = our_pv(name, "Released", false, &[]);
    for (key, value) in annotations.as_object().into_iter().flatten() {
        pv["metadata"]["annotations"][key] = value.clone();
    }
    std::fs::create_dir_all(world.storage.path().join(name)).expect("storage");
    world.volume(pv)
}

fn pv_requests(world: &World) -> Vec<fake_api::Seen> {
    world
        .api
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/api/v1/persistentvolumes"))
        .collect()
}

#[tokio::test]
async fn in_log_mode_a_released_volume_costs_one_request_and_one_write_covers_the_queue() {
    let (mut world, log) = World::logged();
    let volumes: Vec<_> = (0..8)
        .map(|n| released_with_storage(&mut world, &format!("pvc-d{n}"), json!({})))
        .collect();
    for pv in &volumes {
        volumes::reconcile(pv.clone(), world.ctx.clone())
            .await
            .expect("deleted");
    }
    let requests = pv_requests(&world);
    assert_eq!(
        requests.len(),
        8,
        "one request per volume, no re-read: {:#?}",
        world.api.calls()
    );
    for request in &requests {
        assert_eq!(request.method, http::Method::DELETE);
        assert!(
            request.body["preconditions"]["resourceVersion"].is_string(),
            "the delete holds the version decided on: {}",
            request.body
        );
    }
    assert_eq!(
        intent_writes(&world),
        1,
        "the first volume's write records the seven queued behind it"
    );
    for n in 0..8 {
        let name = format!("pvc-d{n}");
        assert!(world.api.get(&pv_path(&name)).is_none(), "{name} removed");
        assert!(
            !world.storage.path().join(&name).exists(),
            "{name}'s storage deleted"
        );
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(log.len(), 0, "finished volumes leave the log");
}

#[tokio::test]
async fn a_volume_rebound_since_the_cache_saw_it_keeps_its_storage() {
    let (mut world, log) = World::logged();
    let stale = released_with_storage(&mut world, "pvc-re", json!({}));
    // The API server has it Bound again (an admin cleared its claimRef); the cache is behind.
    world
        .api
        .put(&pv_path("pvc-re"), our_pv("pvc-re", "Bound", false, &[]));
    volumes::reconcile(stale, world.ctx.clone())
        .await
        .expect("nothing to do");
    assert!(world.api.get(&pv_path("pvc-re")).is_some(), "PV kept");
    assert!(
        world.storage.path().join("pvc-re").is_dir(),
        "storage of a rebound volume kept"
    );
    assert!(!world.guest_calls().contains("delete"));
    assert_eq!(log.len(), 0, "a refused delete leaves nothing in the log");
    world.volume(our_pv("pvc-re", "Bound", false, &[]));
    let settled = wasm_provisioner::controller::recover_intents(&world.ctx)
        .await
        .expect("recovered");
    assert_eq!(settled, 0);
    assert!(
        world.storage.path().join("pvc-re").is_dir(),
        "storage still kept"
    );
}

#[tokio::test]
async fn storage_whose_pv_went_first_is_deleted_by_recovery_after_a_restart() {
    let (mut world, _) = World::logged();
    let pv = released_with_storage(
        &mut world,
        "pvc-f",
        json!({
            "scripted.wasm-provisioner.dev/delete-fail": "transient",
            "scripted.wasm-provisioner.dev/delete-fail-times": "1",
        }),
    );
    let error = volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect_err("the guest's first delete fails");
    assert_eq!(error.label(), "transient");
    assert!(
        world.api.get(&pv_path("pvc-f")).is_none(),
        "the PV went first"
    );
    assert!(world.storage.path().join("pvc-f").is_dir());
    let stored = world.api.objects_under(LOGS);
    assert!(
        stored[0]["data"]["uid-pvc-f"].is_string(),
        "what deleting the storage needs is in the log: {}",
        stored[0]
    );
    // The process dies here. The next one has nothing but the log to go on.
    let settled = wasm_provisioner::controller::recover_intents(&restarted(&world))
        .await
        .expect("recovered");
    assert_eq!(settled, 1);
    assert!(
        !world.storage.path().join("pvc-f").exists(),
        "the storage of the deleted PV is gone"
    );
}

/// Two Released volumes: deleting the first records the second ahead. Returns the second.
async fn second_recorded_ahead(world: &mut World, log: &IntentLog) -> Arc<PersistentVolume> {
    let first = released_with_storage(world, "pvc-a1", json!({}));
    let second = released_with_storage(world, "pvc-a2", json!({}));
    volumes::reconcile(first, world.ctx.clone())
        .await
        .expect("deleted");
    assert!(log.holds("uid-pvc-a2"), "recorded ahead");
    second
}

#[tokio::test]
async fn a_volume_switched_to_retain_then_deleted_keeps_its_storage() {
    let (mut world, log) = World::logged();
    let second = second_recorded_ahead(&mut world, &log).await;
    // The admin keeps it: Retain, then `kubectl delete pv` (the documented way to keep data).
    let mut retained = our_pv("pvc-a2", "Released", false, &[]);
    retained["spec"]["persistentVolumeReclaimPolicy"] = json!("Retain");
    let retained = world.volume(retained);
    volumes::reconcile(retained.clone(), world.ctx.clone())
        .await
        .expect("kept");
    world.api.remove(&pv_path("pvc-a2"));
    world
        .volumes
        .apply_watcher_event(&watcher::Event::Delete(cached_volume((*second).clone())));
    for ctx in [&*world.ctx, &restarted(&world)] {
        wasm_provisioner::controller::recover_intents(ctx)
            .await
            .expect("recovered");
    }
    assert!(
        world.storage.path().join("pvc-a2").is_dir(),
        "the retained volume's storage is kept"
    );
    assert_eq!(
        world.guest_calls().matches("delete").count(),
        1,
        "{}",
        world.guest_calls()
    );
}

#[tokio::test]
async fn an_entry_recorded_ahead_never_deletes_on_its_own_even_after_a_restart() {
    let (mut world, log) = World::logged();
    let _second = second_recorded_ahead(&mut world, &log).await;
    // Someone else deletes the PV (it was Released with Delete: still not ours to act on), and
    // the process restarts with the entry in its log.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    world.api.remove(&pv_path("pvc-a2"));
    let restarted = restarted(&world);
    let settled = wasm_provisioner::controller::recover_intents(&restarted)
        .await
        .expect("recovered");
    assert_eq!(settled, 1, "the entry leaves the log");
    assert!(world.storage.path().join("pvc-a2").is_dir(), "storage kept");
    restarted.recorder.flush(Duration::from_secs(5)).await;
    assert!(
        world
            .api
            .event_reasons()
            .contains(&"StorageKept".to_string())
    );
}

#[tokio::test]
async fn a_pv_recreated_over_storage_whose_delete_failed_keeps_it() {
    let (mut world, log) = World::logged();
    let pv = released_with_storage(
        &mut world,
        "pvc-rc",
        json!({"scripted.wasm-provisioner.dev/delete-fail": "final"}),
    );
    volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect_err("the guest's delete fails");
    let Some(Intent::Volume(entry)) = log.get("uid-pvc-rc") else {
        panic!("entry kept for recovery")
    };
    assert!(
        entry.deleted.is_some() && entry.retries.attempts == 1,
        "{entry:?}"
    );
    // The admin recreates the PV over the storage, with Retain, to keep it.
    let mut recreated = our_pv("pvc-rc", "Available", false, &[]);
    recreated["metadata"]["uid"] = json!("uid-recreated");
    recreated["spec"]["persistentVolumeReclaimPolicy"] = json!("Retain");
    world.volume(recreated);
    for ctx in [&*world.ctx, &restarted(&world)] {
        wasm_provisioner::controller::recover_intents(ctx)
            .await
            .expect("recovered");
    }
    assert!(world.storage.path().join("pvc-rc").is_dir(), "storage kept");
    assert_eq!(
        world.guest_calls().matches("delete").count(),
        1,
        "{}",
        world.guest_calls()
    );
    assert_eq!(log.len(), 0);
}

/// A Released PV of ours (class `fast`, the log running) whose PV went first and whose storage
/// delete then failed (the guest's delete answers `final`): the reconcile is over, the entry
/// recording the storage still to delete is recovery's.
async fn failed_storage_delete(
    world: &mut World,
    name: &str,
) -> (
    Arc<wasm_provisioner::controller::storage::intent::IntentLog>,
    Arc<PersistentVolume>,
) {
    world.class("fast", json!({}), json!({}));
    let log = world.ctx.intents.clone().expect("log mode");
    tokio::spawn(log.clone().run());
    let pv = released_with_storage(
        world,
        name,
        json!({"scripted.wasm-provisioner.dev/delete-fail": "final"}),
    );
    volumes::reconcile(pv.clone(), world.ctx.clone())
        .await
        .expect_err("the guest's delete fails");
    log.attempt_over(&format!("uid-{name}"));
    (log, pv)
}

/// Our DELETE of a PV goes through, its storage delete fails, and the PV lingers, terminating
/// behind kube-controller-manager's pv-protection finalizer: a reconcile of it then must not
/// forget the entry that records the storage still to delete. Before, it did (the plan keeps a
/// terminating PV, and keeping one forgot its entry): the storage leaked with no retry and
/// nothing to list, whenever kube-controller-manager was slow to remove its finalizer.
#[tokio::test]
async fn a_terminating_pv_keeps_the_record_of_its_failed_storage_delete() {
    let mut world = World::new(log_settings(), "");
    let (log, pv) = failed_storage_delete(&mut world, "pvc-term").await;
    let mut terminating = (*pv).clone();
    terminating.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
    );
    terminating.metadata.finalizers = Some(vec!["kubernetes.io/pv-protection".into()]);
    world
        .volumes
        .apply_watcher_event(&watcher::Event::Apply(cached_volume(terminating.clone())));
    let _ = volumes::reconcile(Arc::new(terminating), world.ctx.clone()).await;
    assert!(
        matches!(log.get("uid-pvc-term"), Some(Intent::Volume(entry)) if entry.deleted.is_some()),
        "the record of the storage still to delete is kept: {:?}",
        log.get("uid-pvc-term")
    );
    world
        .volumes
        .apply_watcher_event(&watcher::Event::Delete(cached_volume((*pv).clone())));
    let _ = wasm_provisioner::controller::recover_intents(&world.ctx).await;
    assert_eq!(
        world.guest_calls().matches("delete").count(),
        2,
        "recovery tries the storage again: {}",
        world.guest_calls()
    );
}

/// A storage delete that keeps failing stops at the threshold, is listed, and `forget-storage`
/// removes it from the log while the process that holds it runs.
#[tokio::test]
async fn a_storage_delete_that_keeps_failing_stops_at_the_threshold_and_can_be_forgotten() {
    let mut world = World::new(
        Settings {
            failed_delete_threshold: 2,
            ..log_settings()
        },
        "",
    );
    let (log, pv) = failed_storage_delete(&mut world, "pvc-st").await;
    world
        .volumes
        .apply_watcher_event(&watcher::Event::Delete(cached_volume((*pv).clone())));
    for _ in 0..3 {
        let _ = wasm_provisioner::controller::recover_intents(&world.ctx).await;
    }
    assert_eq!(
        world.guest_calls().matches("delete").count(),
        2,
        "two attempts, then no more: {}",
        world.guest_calls()
    );
    let Some(Intent::Volume(entry)) = log.get("uid-pvc-st") else {
        panic!("the handle stays")
    };
    assert!(entry.retries.given_up, "{entry:?}");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let namespace = LOGS.split('/').nth(4).expect("namespace");
    let listed = wasm_provisioner::uninstall::report_intents(&world.api.client(), namespace)
        .await
        .expect("listed");
    assert!(
        listed.contains("pvc-st") && listed.contains("given up"),
        "{listed}"
    );
    let forgotten =
        wasm_provisioner::uninstall::forget_storage(world.api.client(), namespace, "pvc-st", false)
            .await
            .expect("forgotten");
    assert!(forgotten.contains("pvc-st"), "{forgotten}");
    let stored = world.api.objects_under(LOGS);
    assert!(
        stored[0]["data"].get("uid-pvc-st").is_none(),
        "{}",
        stored[0]
    );
    assert!(
        world.storage.path().join("pvc-st").is_dir(),
        "storage left as it is"
    );
    // The running process holds the entry too: its next write reads the log back (someone
    // else wrote it) and must forget the entry instead of bringing it back.
    let other = Intent::claim(P, "pvc-u-other", NS, "other");
    tokio::time::timeout(
        Duration::from_secs(10),
        log.record("u-other", &other, Vec::new()),
    )
    .await
    .expect("written in time")
    .expect("recorded");
    let stored = world.api.objects_under(LOGS);
    assert!(
        stored[0]["data"].get("uid-pvc-st").is_none() && stored[0]["data"].get("u-other").is_some(),
        "forgotten for good: {}",
        stored[0]
    );
    assert!(!log.holds("uid-pvc-st"));
}

#[tokio::test]
async fn in_pv_finalizer_mode_the_pv_is_marked_deleted_first_and_released_after_its_storage() {
    let mut world = pv_finalizer_world();
    std::fs::create_dir_all(world.storage.path().join("pvc-pf")).expect("storage");
    let pv = world.volume(our_pv("pvc-pf", "Released", false, &[FINALIZER_PV]));
    volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect("deleted");
    let requests = pv_requests(&world);
    let methods: Vec<_> = requests.iter().map(|r| r.method.as_str()).collect();
    assert_eq!(
        methods,
        ["DELETE", "PATCH"],
        "marked for deletion, then the finalizer off: {:#?}",
        world.api.calls()
    );
    assert!(
        requests[0].body["preconditions"]["resourceVersion"].is_string(),
        "the delete holds the version decided on: {}",
        requests[0].body
    );
    assert!(
        !world.storage.path().join("pvc-pf").exists(),
        "storage deleted"
    );
}

#[tokio::test]
async fn a_volume_released_while_the_intent_write_waits_for_the_budget_rides_on_it() {
    let mut world = World::new(
        Settings {
            kube_api_qps: 2.0,
            kube_api_burst: 1,
            ..log_settings()
        },
        "",
    );
    world.class("fast", json!({}), json!({}));
    let log = world.ctx.intents.clone().expect("log mode");
    volume_entry::install_intents_ahead(&world.ctx, volumes::queued_for_delete);
    tokio::spawn(log.clone().run());
    let first = released_with_storage(&mut world, "pvc-w1", json!({}));
    // The budget is spent: the write recording the first volume waits about a second for its turn.
    world.ctx.api_rate.acquire().await;
    world.ctx.api_rate.acquire().await;
    let deleting = tokio::spawn(volumes::reconcile(first, world.ctx.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(intent_writes(&world), 0, "the write waits for the budget");
    let second = released_with_storage(&mut world, "pvc-w2", json!({}));
    deleting.await.expect("joined").expect("deleted");
    assert_eq!(intent_writes(&world), 1);
    assert!(
        log.holds("uid-pvc-w2"),
        "the volume released while the write waited is in it"
    );
    volumes::reconcile(second, world.ctx.clone())
        .await
        .expect("deleted");
    assert_eq!(intent_writes(&world), 1, "its own delete needs no write");
    assert!(world.api.get(&pv_path("pvc-w2")).is_none());
}
