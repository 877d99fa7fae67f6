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

/// Events recovery wrote, as (object name, message).
fn events_about(world: &World) -> Vec<(String, String)> {
    world
        .api
        .objects_under(&format!("/api/v1/namespaces/{NS}/events"))
        .iter()
        .map(|e| {
            (
                e["involvedObject"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                e["message"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// A kill with claims recorded ahead of their turn and one call in flight: after the restart,
/// only the called one is said to have storage that may be kept. Before, every entry the log
/// held got a `StorageKept` warning (79 lines for one real leftover in a 200-claim kill loop):
/// a stored entry did not say whether its guest had been called.
#[tokio::test]
async fn after_a_kill_only_the_call_in_flight_may_have_kept_storage() {
    let (mut world, log) = World::logged();
    world.class("slow", json!({"fail": "in-background"}), json!({}));
    let queued: Vec<_> = (0..5)
        .map(|n| world.claim(claim_of(&format!("queued-{n}"), "fast", P)))
        .collect();
    let called = world.claim(claim_of("called", "slow", P));
    // Its guest never answers (as if the process were killed during the call); the claims
    // queued behind it rode on its write, recorded ahead, never called.
    world
        .provision(&called)
        .await
        .expect_err("in the background");
    let stored = &world.api.objects_under(LOGS)[0]["data"];
    for pvc in &queued {
        let uid = pvc.metadata.uid.clone().unwrap();
        assert!(stored[&uid].is_string(), "recorded ahead: {stored}");
    }
    // Every claim is deleted while the provisioner is down.
    for pvc in queued.iter().chain([&called]) {
        claim_deleted(&mut world, pvc);
    }
    let restarted = restarted(&world);
    let settled = wasm_provisioner::controller::recover_intents(&restarted)
        .await
        .expect("recovered");
    assert_eq!(settled, 6, "every entry leaves the log");
    restarted.recorder.flush(Duration::from_secs(5)).await;
    let said = events_about(&world);
    let kept: Vec<_> = said
        .iter()
        .filter(|(_, message)| message.contains("Storage"))
        .collect();
    assert_eq!(kept.len(), 1, "{said:?}");
    assert_eq!(kept[0].0, "called");
    assert!(
        kept[0].1.starts_with("Storage may be kept:") && kept[0].1.contains("may or may not"),
        "{}",
        kept[0].1
    );
    assert!(!world.guest_calls().contains("delete"));
    drop(log);
}

/// A claim whose turn comes after it was recorded ahead is marked called in a write that
/// succeeds before its guest is called: a kill during that call leaves it "may be kept", never
/// dropped as one that was never called.
#[tokio::test]
async fn a_claim_recorded_ahead_is_marked_called_before_its_guest_is() {
    let (mut world, log) = World::logged();
    world.class("slow", json!({"fail": "in-background"}), json!({}));
    let first = world.claim(claim_of("first", "fast", P));
    let second = world.claim(claim_of("second", "slow", P));
    world.provision(&first).await.expect("provisioned");
    let uid = second.metadata.uid.clone().unwrap();
    let stored = |world: &World| {
        world.api.objects_under(LOGS)[0]["data"][&uid]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        stored(&world).contains("\"ahead\":true"),
        "{}",
        stored(&world)
    );
    world
        .provision(&second)
        .await
        .expect_err("in the background");
    assert!(
        !stored(&world).is_empty() && !stored(&world).contains("ahead"),
        "its turn's write marks it called: {}",
        stored(&world)
    );
    claim_deleted(&mut world, &second);
    let restarted = restarted(&world);
    wasm_provisioner::controller::recover_intents(&restarted)
        .await
        .expect("recovered");
    restarted.recorder.flush(Duration::from_secs(5)).await;
    assert!(
        events_about(&world)
            .iter()
            .any(|(name, message)| name == "second" && message.starts_with("Storage may be kept")),
        "{:?}",
        events_about(&world)
    );
    drop(log);
}

/// A clean stop with claims recorded ahead (never called) and a claim whose PV exists leaves
/// no log behind: those entries stand for no storage.
#[tokio::test]
async fn a_clean_stop_with_entries_recorded_ahead_leaves_no_log() {
    let (mut world, log) = World::logged();
    let claims: Vec<_> = (0..4)
        .map(|n| world.claim(claim_of(&format!("q{n}"), "fast", P)))
        .collect();
    world.provision(&claims[0]).await.expect("provisioned");
    let pv = world.api.get(&pv_path("pvc-u-q0")).expect("PV created");
    world
        .volumes
        .apply_watcher_event(&watcher::Event::Apply(cached_volume(
            serde_json::from_value(pv).unwrap(),
        )));
    assert_eq!(log.ahead_len(), 3, "the three claims queued behind it");
    assert_eq!(world.api.objects_under(LOGS).len(), 1);
    let queued = |_: &PersistentVolume| false;
    let held = log.len();
    let settled =
        wasm_provisioner::controller::storage::recovery::drop_settled(&world.ctx, &queued);
    assert_eq!(settled, held, "none stands for storage");
    let closed = log.close(Duration::from_secs(5)).await;
    assert!(
        matches!(
            closed,
            wasm_provisioner::controller::storage::intent::Closed::Done { entries: 0, .. }
        ),
        "{closed:?}"
    );
    assert!(world.api.objects_under(LOGS).is_empty(), "no log left");
}

/// A clean stop keeps a call that never answered, and writes its log as held: the entries
/// recorded ahead are gone from the stored log too.
#[tokio::test]
async fn a_clean_stop_keeps_only_what_may_stand_for_storage() {
    let (mut world, log) = World::logged();
    world.class("slow", json!({"fail": "in-background"}), json!({}));
    for n in 0..3 {
        world.claim(claim_of(&format!("q{n}"), "fast", P));
    }
    let called = world.claim(claim_of("called", "slow", P));
    world
        .provision(&called)
        .await
        .expect_err("in the background");
    let queued = |_: &PersistentVolume| false;
    wasm_provisioner::controller::storage::recovery::drop_settled(&world.ctx, &queued);
    let closed = log.close(Duration::from_secs(5)).await;
    assert!(
        matches!(
            closed,
            wasm_provisioner::controller::storage::intent::Closed::Done { entries: 1, .. }
        ),
        "{closed:?}"
    );
    let stored = world.api.objects_under(LOGS);
    let data = stored[0]["data"].as_object().expect("data");
    assert_eq!(data.len(), 1, "{data:?}");
    assert!(data.contains_key("u-called"));
}

/// A logged world whose one claim was provisioned (its PV cached), with what the clean stop
/// drops already dropped: the log holds nothing, ready to be closed.
async fn provisioned_and_settled() -> (World, Arc<IntentLog>) {
    let (mut world, log) = World::logged();
    let pvc = world.claim(claim_of("data", "fast", P));
    world.provision(&pvc).await.expect("provisioned");
    let pv = world.api.get(&pv_path("pvc-u-data")).expect("PV created");
    world
        .volumes
        .apply_watcher_event(&watcher::Event::Apply(cached_volume(
            serde_json::from_value(pv).unwrap(),
        )));
    let queued = |_: &PersistentVolume| false;
    wasm_provisioner::controller::storage::recovery::drop_settled(&world.ctx, &queued);
    (world, log)
}

/// An API-server outage at shutdown: the delete of the empty log is tried again within the
/// grace, and a log that still cannot be deleted is said so. Before, one failed DELETE left
/// the log behind with a single warning.
#[tokio::test(start_paused = true)]
async fn a_clean_stop_through_an_outage_deletes_its_log_or_says_so() {
    use wasm_provisioner::controller::storage::intent::Closed;
    let (world, log) = provisioned_and_settled().await;
    world.api.outage(http::Method::DELETE, LOGS, 3);
    let closed = log.close(Duration::from_secs(10)).await;
    assert!(
        matches!(closed, Closed::Done { entries: 0, .. }),
        "{closed:?}"
    );
    assert!(
        world.api.objects_under(LOGS).is_empty(),
        "deleted after the outage"
    );

    // An outage longer than the grace: the log stays, and the answer says why.
    let (world, log) = provisioned_and_settled().await;
    world.api.outage(http::Method::DELETE, LOGS, usize::MAX);
    let closed = log.close(Duration::from_secs(3)).await;
    let Closed::Failed { error, .. } = closed else {
        panic!("{closed:?}");
    };
    assert!(error.to_string().contains("unable to handle"), "{error}");
    assert_eq!(world.api.objects_under(LOGS).len(), 1);
}
