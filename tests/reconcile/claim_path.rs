//! The claim path against the fake API server, one test per branch: what a claim costs in
//! requests, refusals, give-ups and retries that release or keep the claim, per-class limits and
//! turns, and claims this replica must not touch.

use super::*;

#[tokio::test]
async fn a_claim_is_provisioned_with_three_writes_the_finalizer_alone_first() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(claim_of("data", "fast", P));
    world.provision(&pvc).await.expect("provisioned");
    let calls = world.api.calls();
    let writes: Vec<&String> = calls.iter().filter(|c| !c.starts_with("GET")).collect();
    assert_eq!(
        writes,
        [
            &format!("PATCH {}", claim_path("data")),
            &"POST /api/v1/persistentvolumes".to_string(),
            &format!("PATCH {}", claim_path("data")),
        ],
        "{calls:#?}"
    );
    let intent =
        &world.api.requests()[calls.iter().position(|c| c.starts_with("PATCH")).unwrap()].body;
    assert_eq!(
        intent["metadata"]["finalizers"],
        json!([FINALIZER_CLAIM]),
        "{intent}"
    );
    assert!(
        intent["metadata"].get("annotations").is_none(),
        "nothing but the finalizer is written: {intent}"
    );
    assert!(world.api.get(&pv_path("pvc-u-data")).is_some());
    assert!(world.finalizers("data").is_empty());
    let claim = world.api.get(&claim_path("data")).unwrap();
    assert!(claim["metadata"]["annotations"][ANN_CLASS_RECORD].is_null());
    let events = world.events().await;
    assert!(
        events.contains(&"ProvisioningSucceeded".to_string()),
        "{events:?}"
    );
}

#[tokio::test]
async fn a_final_refusal_releases_the_claim_so_deleting_it_never_hangs() {
    let mut world = World::new(settings(), "");
    world.class("broken", json!({"fail": "final"}), json!({}));
    let pvc = world.claim(claim_of("data", "broken", P));
    let error = world.provision(&pvc).await.expect_err("final");
    assert_eq!(error.label(), "final");
    assert!(
        world.finalizers("data").is_empty(),
        "the guest holds no storage, so no finalizer may keep the claim: {:?}",
        world.finalizers("data")
    );
    assert!(
        world
            .events()
            .await
            .contains(&"ProvisioningFailed".to_string())
    );
}

#[tokio::test]
async fn a_given_up_claim_is_released() {
    let mut world = World::new(settings(), "");
    world.class("trapping", json!({"fail": "trap"}), json!({}));
    let pvc = world.claim(claim_of("data", "trapping", P));
    for attempt in 1..=3 {
        let error = world.provision(&pvc).await.expect_err("trap");
        assert!(error.counts(), "attempt {attempt}: {error}");
        if attempt < 3 {
            assert_eq!(
                world.finalizers("data"),
                [FINALIZER_CLAIM],
                "a fault may leave storage: the finalizer stays while attempts go on"
            );
        }
    }
    assert!(world.finalizers("data").is_empty(), "given up: released");
    assert!(
        world
            .events()
            .await
            .contains(&"ProvisioningGivenUp".to_string())
    );
    let calls_before = world.guest_calls().lines().count();
    world
        .provision(&pvc)
        .await
        .expect("given up: nothing to do");
    assert_eq!(
        world.guest_calls().lines().count(),
        calls_before,
        "no more guest calls"
    );
}

#[tokio::test]
async fn a_busy_guest_is_looked_at_again_shortly_without_a_failure() {
    let mut world = World::new(settings(), "max-concurrency = 1");
    world.class("slow", json!({"delayMs": "1500"}), json!({}));
    let first = world.claim(claim_of("first", "slow", P));
    let second = world.claim(claim_of("second", "slow", P));
    let running = tokio::spawn({
        let ctx = world.ctx.clone();
        let first = first.clone();
        async move { claims::reconcile(first, ctx).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let action = world
        .provision(&second)
        .await
        .expect("busy is not an error");
    let wait = requeue_after(&action).expect("requeued");
    assert!(wait <= Duration::from_millis(250), "{action:?}");
    assert!(
        world.finalizers("second").is_empty(),
        "no intent before a guest call"
    );
    running.await.unwrap().expect("the first claim provisions");
    assert_eq!(world.ctx.metrics.waiting(Queue::Claims), 0);
}

#[tokio::test]
async fn a_class_limit_holds_its_own_claims_and_not_the_others() {
    use futures::StreamExt;
    use kube::runtime::reflector::ObjectRef;
    let mut world = World::new(settings(), "");
    world.class(
        "storm",
        json!({"delayMs": "1500"}),
        json!({ANN_MAX_IN_FLIGHT: "1"}),
    );
    world.class("quiet", json!({}), json!({}));
    let first = world.claim(claim_of("s1", "storm", P));
    let second = world.claim(claim_of("s2", "storm", P));
    let other = world.claim(claim_of("q1", "quiet", P));
    let mut wakeups = world.ctx.turns.wakeups();
    let running = tokio::spawn({
        let ctx = world.ctx.clone();
        async move { claims::reconcile(first, ctx).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let action = world.provision(&second).await.expect("busy class");
    assert_eq!(
        requeue_after(&action),
        None,
        "parked, not requeued: {action:?}"
    );
    assert_eq!(world.ctx.turns.parked(), 1);
    assert!(world.api.get(&pv_path("pvc-u-s2")).is_none());
    world
        .provision(&other)
        .await
        .expect("other class goes ahead");
    assert!(world.api.get(&pv_path("pvc-u-q1")).is_some());
    running.await.unwrap().expect("first of the storm");
    let woken = tokio::time::timeout(Duration::from_secs(5), wakeups.next())
        .await
        .expect("woken when the first one's turn ends");
    assert_eq!(woken, Some(ObjectRef::from_obj(&*second)));
    world.provision(&second).await.expect("now its turn");
    assert!(world.api.get(&pv_path("pvc-u-s2")).is_some());
}

/// With more workers than their guest has slots, the claims of every class it serves together
/// leave it a slot: a delete finds it free. Every claim has a turn (a guest's turns are a few
/// per slot: a turn is mostly API round trips), but only three call the guest at once; the
/// fourth waits for a claim slot. Before, each class counted alone: two classes took all four
/// slots, and a delete waited for one of their calls to end; with turns per slot and no claim
/// slots, the four claims took the four slots the same way.
#[tokio::test]
async fn claims_of_every_class_leave_their_guest_a_slot_for_deletes() {
    let mut world = World::new(settings(), "max-concurrency = 4");
    world.class("fast", json!({}), json!({}));
    for crowd in ["crowd-a", "crowd-b"] {
        world.class(crowd, json!({"delayMs": "1500"}), json!({}));
    }
    let claims: Vec<_> = (0..4)
        .map(|n| {
            let class = ["crowd-a", "crowd-b"][n % 2];
            world.claim(claim_of(&format!("c{n}"), class, P))
        })
        .collect();
    let running: Vec<_> = claims
        .iter()
        .map(|pvc| {
            let (ctx, pvc) = (world.ctx.clone(), pvc.clone());
            tokio::spawn(async move { claims::reconcile(pvc, ctx).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let turns = &world.ctx.turns;
    assert_eq!(
        (
            turns.running("crowd-a") + turns.running("crowd-b"),
            turns.parked()
        ),
        (4, 0),
        "a turn for each claim, over both classes"
    );
    let plugins = world.ctx.plugins();
    let guest = plugins.for_provisioner(P).expect("guest");
    assert!(!guest.at_capacity(), "a slot is left while the claims run");
    let pv = volume_path::released_with_storage(&mut world, "pvc-r", json!({}));
    volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect("deleted with the slot left");
    assert!(world.api.get(&pv_path("pvc-r")).is_none(), "PV removed");
    for reconcile in running {
        reconcile
            .await
            .unwrap()
            .expect("all four provisioned, three calls at a time");
    }
}

/// Claim-finalizer mode: the guest answered `transient` (storage may exist), then the claim was
/// deleted. Nothing records what the guest built, so nothing is deleted: the guest is not asked
/// again (before, it was asked to provision once more and what it answered was deleted), the
/// claim is released and an event says its storage is kept.
#[tokio::test]
async fn a_deleted_claim_whose_guest_may_hold_storage_keeps_it_and_says_so() {
    let mut world = World::new(settings(), "");
    world.class(
        "fast",
        json!({"fail": "transient", "failTimes": "1"}),
        json!({}),
    );
    let pvc = world.claim(claim_of("data", "fast", P));
    world
        .provision(&pvc)
        .await
        .expect_err("transient: storage may exist");
    assert_eq!(world.finalizers("data"), [FINALIZER_CLAIM]);
    let before = world.guest_calls();
    world.drop_class("fast");
    let mut deleted = world.api.get(&claim_path("data")).unwrap();
    deleted["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
    world.api.put(&claim_path("data"), deleted);
    let deleted = world.sync_claim("data");
    world.provision(&deleted).await.expect("released");
    assert!(world.finalizers("data").is_empty(), "released");
    assert_eq!(
        world.guest_calls(),
        before,
        "no guest call for a deleted claim"
    );
    assert!(world.events().await.contains(&"StorageKept".to_string()));
}

#[tokio::test]
async fn deleted_claims_of_provisioners_never_served_here_are_left_alone() {
    let mut world = World::new(settings(), "");
    let mut foreign = claim_of("theirs", "x", "example.com/elsewhere");
    foreign["metadata"]["finalizers"] = json!([FINALIZER_CLAIM]);
    foreign["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
    let pvc = world.claim(foreign);
    world.provision(&pvc).await.expect("nothing to do");
    assert!(world.api.calls().is_empty(), "{:?}", world.api.calls());
    assert!(
        world.events().await.is_empty(),
        "no WaitingForGuest for a stranger"
    );
}

#[tokio::test]
async fn an_unparsable_claim_fails_with_an_event() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let mut bad = claim_of("bad", "fast", P);
    bad["spec"]["resources"]["requests"]["storage"] = json!("lots");
    let pvc = world.claim(bad);
    let error = world.provision(&pvc).await.expect_err("invalid");
    assert_eq!(error.label(), "invalid-claim");
    assert_eq!(world.events().await, ["ProvisioningFailed"]);
    assert!(world.guest_calls().is_empty(), "the guest is not called");
}

#[tokio::test]
async fn a_claim_whose_class_is_missing_fails_counted_with_an_event() {
    let mut world = World::new(settings(), "");
    let pvc = world.claim(claim_of("data", "nowhere", P));
    let error = world.provision(&pvc).await.expect_err("class missing");
    assert_eq!(error.label(), "class-not-found");
    assert!(error.counts());
    assert_eq!(world.events().await, ["ProvisioningFailed"]);
    assert!(world.finalizers("data").is_empty());
}

#[tokio::test]
async fn a_standby_makes_no_request_at_all() {
    let mut standby = settings();
    standby.election.mode = Mode::Leader;
    let mut world = World::new(standby, "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(claim_of("data", "fast", P));
    let error = world.provision(&pvc).await.expect_err("not the leader");
    assert!(error.gate_refusal().is_some());
    assert!(world.api.requests().is_empty());
    assert!(world.guest_calls().is_empty());
}

#[tokio::test]
async fn no_guest_is_called_before_the_pvs_are_listed() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(claim_of("data", "fast", P));
    // A process just started: its PV watch has not finished the first list, so neither whether
    // this claim's PV exists nor which node paths are served is known.
    let (listing, _writer) = reflector::store();
    let started = Arc::new(Context::new(
        world.api.client(),
        world.ctx.plugins(),
        settings(),
        Caches {
            classes: world.ctx.classes.clone(),
            volumes: listing,
            claims: world.ctx.claims.clone(),
            bindable: Default::default(),
        },
        Metrics::new(),
        None,
    ));
    let action = claims::reconcile(pvc, started)
        .await
        .expect("looked at again shortly");
    assert!(requeue_after(&action).is_some(), "{action:?}");
    assert!(world.guest_calls().is_empty(), "{}", world.guest_calls());
    assert!(world.api.requests().is_empty());
}

#[tokio::test]
async fn a_claim_whose_guest_refuses_for_now_leaves_the_log() {
    let mut world = World::new(log_settings(), "");
    world.class(
        "flaky",
        json!({"fail": "transient", "failTimes": "1"}),
        json!({}),
    );
    let pvc = world.claim(claim_of("data", "flaky", P));
    let log = world.ctx.intents.clone().expect("log mode");
    tokio::spawn(log.clone().run());
    world
        .provision(&pvc)
        .await
        .expect_err("transient: try again later");
    assert_eq!(
        log.len(),
        0,
        "nothing built: a waiting claim is recorded again when its turn comes, not kept"
    );
    // The claim goes before the next attempt: nothing is left to recover.
    world.api.remove(&claim_path("data"));
    world
        .claims
        .apply_watcher_event(&watcher::Event::Delete((*pvc).clone()));
    let settled = wasm_provisioner::controller::recover_intents(&world.ctx)
        .await
        .expect("recovered");
    assert_eq!(settled, 0);
    assert!(!world.guest_calls().contains("delete"));
}

#[tokio::test]
async fn a_guest_that_keeps_answering_transient_is_retried_ever_later_without_counting() {
    let (mut world, _log) = World::logged();
    world.class("stuck", json!({"fail": "transient"}), json!({}));
    let pvc = world.claim(claim_of("data", "stuck", P));
    let mut waits = Vec::new();
    for _ in 0..4 {
        let error = world.provision(&pvc).await.expect_err("transient");
        assert!(!error.counts(), "{error}");
        let action = claims::error_policy(pvc.clone(), &error, world.ctx.clone());
        waits.push(requeue_after(&action).expect("requeued"));
    }
    let start = world.ctx.settings.retry_interval_start;
    assert_eq!(waits[0], start, "{waits:?}");
    assert!(
        waits.windows(2).all(|w| w[1] > w[0]),
        "a crowd of waiting claims must not be retried at the start interval forever: {waits:?}"
    );
    assert!(
        world.ctx.claim_book.is_empty() || !world.ctx.claim_book.is_given_up("u-data", 0),
        "never given up"
    );
}

#[tokio::test]
async fn a_claim_whose_class_has_no_turn_free_is_parked_without_a_call_and_woken_when_one_frees() {
    use futures::StreamExt;
    use kube::runtime::reflector::ObjectRef;
    let (mut world, _log) = World::logged();
    world.class(
        "stuck",
        json!({"fail": "transient"}),
        json!({ANN_MAX_IN_FLIGHT: "2"}),
    );
    let retry = world.claim(claim_of("retry", "stuck", P));
    let first = world.claim(claim_of("first", "stuck", P));
    let other = world.claim(claim_of("other", "fast", P));
    let error = world.provision(&retry).await.expect_err("transient");
    claims::error_policy(retry.clone(), &error, world.ctx.clone());
    let mut wakeups = world.ctx.turns.wakeups();
    let stuck = world.ctx.class("stuck").expect("class");
    let held: Vec<_> = (0..world.ctx.turns.limit(&stuck))
        .map(|n| world.turn("stuck", &format!("holder-{n}")).expect("turn"))
        .collect();
    let (calls, requests) = (world.guest_calls(), world.api.requests().len());
    for pvc in [&retry, &first] {
        let action = world.provision(pvc).await.expect("parked");
        assert_eq!(
            requeue_after(&action),
            None,
            "parked, not requeued: {action:?}"
        );
    }
    assert_eq!(world.guest_calls(), calls, "no guest call");
    assert_eq!(world.api.requests().len(), requests, "no request");
    assert_eq!(
        world.ctx.turns.parked(),
        2,
        "a retry and a first attempt alike"
    );
    assert_eq!(
        world.ctx.metrics.waiting(Queue::Claims),
        2,
        "parked claims are in the queue's depth, the retry and the first attempt alike"
    );
    assert_eq!(
        world.ctx.metrics.retries(Queue::Claims),
        1,
        "parking a retry does not count it again"
    );
    world
        .provision(&other)
        .await
        .expect("another class has turns of its own");
    assert!(world.api.get(&pv_path("pvc-u-other")).is_some());
    drop(held);
    let woken: Vec<_> =
        tokio::time::timeout(Duration::from_secs(5), wakeups.by_ref().take(2).collect())
            .await
            .expect("woken");
    assert_eq!(
        woken,
        [ObjectRef::from_obj(&*retry), ObjectRef::from_obj(&*first)],
        "in the order they were parked"
    );
    let calls = world.guest_calls();
    world
        .provision(&first)
        .await
        .expect_err("its turn: the guest called");
    assert_ne!(world.guest_calls(), calls);
}

#[tokio::test]
async fn node_mode_releases_a_deleted_claim_whose_node_is_gone() {
    use wasm_provisioner::controller::node::{NodeSettings, NodeState};
    let mut world = World::new(settings(), "");
    let node = NodeSettings {
        name: "n1".into(),
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(20),
        immediate_binding: true,
        gone_grace: Duration::ZERO,
    };
    let (nodes, _) = reflector::store();
    let (classes, _) = reflector::store();
    let (volumes, _) = reflector::store();
    let (claims_store, mut claims) = reflector::store();
    let mut node_settings = settings();
    node_settings.node = Some(node.clone());
    let ctx = Arc::new(Context::new(
        world.api.client(),
        world.ctx.plugins(),
        node_settings,
        Caches {
            classes,
            volumes,
            claims: claims_store,
            bindable: Default::default(),
        },
        Metrics::new(),
        Some(NodeState::new(node, nodes)),
    ));
    let mut gone = claim_of("data", "local", P);
    gone["metadata"]["finalizers"] = json!([FINALIZER_CLAIM]);
    gone["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
    gone["metadata"]["annotations"]["volume.kubernetes.io/selected-node"] = json!("n2");
    let pvc = world.claim(gone);
    claims.apply_watcher_event(&watcher::Event::Apply((*pvc).clone()));
    claims::reconcile(pvc, ctx.clone()).await.expect("released");
    assert!(
        world.finalizers("data").is_empty(),
        "node n2 is gone with its storage: someone must let the claim go"
    );
    assert!(
        world.guest_calls().is_empty(),
        "no guest call for a gone node's storage"
    );
    ctx.recorder.flush(Duration::from_secs(5)).await;
    assert!(
        world
            .api
            .event_reasons()
            .contains(&"ProvisioningAbandoned".to_string())
    );
}

/// A repeat of an event whose first one is gone (its create dropped from a full queue or
/// refused, or its TTL passed) is written again whole. Before, its count was patched onto a
/// name that did not exist: "not found", and every repeat for ten minutes was lost (seen with
/// 5,000 claims failing at once).
#[tokio::test]
async fn a_repeated_event_whose_first_is_gone_is_written_again() {
    let world = World::new(settings(), "");
    let recorder = &world.ctx.recorder;
    let claim = k8s_openapi::api::core::v1::ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        namespace: Some(NS.into()),
        name: Some("data".into()),
        uid: Some("u-data".into()),
        ..Default::default()
    };
    let events = format!("/api/v1/namespaces/{NS}/events");
    let counts = || async {
        recorder.flush(Duration::from_secs(5)).await;
        world
            .api
            .objects_under(&events)
            .iter()
            .map(|event| event["count"].as_i64().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    let publish = || {
        recorder.publish(
            &claim,
            Event::warning("ProvisioningFailed", EventAction::Provision, "x".into()),
        )
    };
    publish();
    assert_eq!(counts().await, [1]);
    publish();
    assert_eq!(counts().await, [2], "a repeat counts on the first");
    let first = &world.api.objects_under(&events)[0];
    let name = first["metadata"]["name"].as_str().expect("name");
    world.api.remove(&format!("{events}/{name}"));
    publish();
    assert_eq!(counts().await, [3], "written again, with its count");
    publish();
    assert_eq!(counts().await, [4], "and counted on from there");
}

/// A claim given up while it still had a place in its class's queue (parked under an earlier
/// spec, given up again under this one) passes the place on at its next reconcile: the claim
/// parked behind it is woken for the next turn, not the given-up one, which would never take it.
#[tokio::test]
async fn a_given_up_claim_passes_its_place_in_the_queue_on() {
    let mut world = World::new(settings(), "");
    world.class(
        "trapping",
        json!({"fail": "trap"}),
        json!({ANN_MAX_IN_FLIGHT: "1"}),
    );
    let pvc = world.claim(claim_of("data", "trapping", P));
    for _ in 1..=3 {
        world.provision(&pvc).await.expect_err("trap");
    }
    let mut wakeups = world.ctx.turns.wakeups();
    let held = world
        .turn("trapping", "holder")
        .expect("the class's one turn");
    assert!(
        world.turn("trapping", "data").is_none() && world.turn("trapping", "next").is_none(),
        "parked"
    );
    world
        .provision(&pvc)
        .await
        .expect("given up: nothing to do");
    assert_eq!(world.ctx.turns.parked(), 1, "its place is gone");
    drop(held);
    let woken = wakeups.try_recv().ok().map(|claim| claim.name);
    assert_eq!(woken.as_deref(), Some("next"));
}
