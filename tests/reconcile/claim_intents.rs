//! The claim side of the intent log against the fake API server: what recording a claim's
//! intent costs in writes, how claims waiting their turn ride on one write, and why no claim,
//! however large or however many wait, fills the log or is called without its intent.

use super::*;

#[tokio::test]
async fn a_stale_cache_never_leads_to_a_guest_call_without_the_intent() {
    let mut world = World::new(settings(), "");
    world.class(
        "flaky",
        json!({"fail": "final", "failTimes": "1"}),
        json!({}),
    );
    let pvc = world.claim(claim_of("data", "flaky", P));
    world
        .provision(&pvc)
        .await
        .expect_err("first attempt fails for good");
    assert!(world.finalizers("data").is_empty());
    let calls = world.guest_calls().lines().count();
    // The cache still shows the claim as it was, with the finalizer our failed attempt added and
    // then removed: the intent goes on only on the claim as it is now.
    let mut stale = (*pvc).clone();
    stale.metadata.finalizers = Some(vec![FINALIZER_CLAIM.to_string()]);
    let action = world
        .provision(&Arc::new(stale))
        .await
        .expect("looks again");
    assert!(requeue_after(&action).is_some(), "{action:?}");
    assert_eq!(
        world.guest_calls().lines().count(),
        calls,
        "no guest call on a stale claim"
    );
    assert!(world.finalizers("data").is_empty());
    let fresh = world.sync_claim("data");
    let before = world.api.requests().len();
    world.provision(&fresh).await.expect("second attempt");
    let after: Vec<_> = world.api.requests()[before..].to_vec();
    let first_write = after
        .iter()
        .find(|r| r.method != http::Method::GET && !r.path.contains("/events"))
        .expect("writes");
    assert_eq!(first_write.path, claim_path("data"));
    assert_eq!(
        first_write.body["metadata"]["finalizers"][0], FINALIZER_CLAIM,
        "the intent goes on before the guest is called again: {:?}",
        first_write.body
    );
    assert!(world.api.get(&pv_path("pvc-u-data")).is_some());
}

#[tokio::test]
async fn the_intent_log_costs_no_claim_write_and_batches_concurrent_claims() {
    let (mut world, log) = World::logged();
    let claims: Vec<_> = (0..8)
        .map(|n| world.claim(claim_of(&format!("c{n}"), "fast", P)))
        .collect();
    let reconciles = claims.iter().map(|pvc| world.provision(pvc));
    for result in futures::future::join_all(reconciles).await {
        result.expect("provisioned");
    }
    let calls = world.api.calls();
    assert!(
        calls.iter().all(|c| !c.contains("persistentvolumeclaims")),
        "claims are not written in log mode: {calls:#?}"
    );
    let writes = intent_writes(&world);
    assert!(
        (1..8).contains(&writes),
        "eight claims at once share their intent writes: {writes}"
    );
    for n in 0..8 {
        assert!(world.api.get(&pv_path(&format!("pvc-u-c{n}"))).is_some());
    }
    // Finished claims leave the log with the next write, or on their own shortly.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stored = world.api.objects_under(LOGS);
    assert_eq!(stored.len(), 1, "one log per replica");
    assert!(
        stored[0]["data"].as_object().is_none_or(|d| d.is_empty()),
        "{}",
        stored[0]
    );
    assert_eq!(log.len(), 0);
}

#[tokio::test]
async fn claims_with_huge_annotations_do_not_fill_the_log() {
    let (mut world, log) = World::logged();
    let mut claims = Vec::new();
    for n in 0..6 {
        let mut claim = claim_of(&format!("big{n}"), "fast", P);
        claim["metadata"]["annotations"]["team.example/notes"] = json!("x".repeat(200 * 1024));
        claims.push(world.claim(claim));
    }
    let reconciles = claims.iter().map(|pvc| world.provision(pvc));
    for result in futures::future::join_all(reconciles).await {
        result.expect("provisioned");
    }
    assert!(log.bytes() < 16 * 1024, "{} bytes", log.bytes());
    for n in 0..6 {
        assert!(world.api.get(&pv_path(&format!("pvc-u-big{n}"))).is_some());
    }
    let writes: Vec<usize> = world
        .api
        .requests()
        .iter()
        .filter(|r| r.path.starts_with(LOGS) && r.method != http::Method::GET)
        .map(|r| r.body.to_string().len())
        .collect();
    assert!(
        writes.iter().all(|bytes| *bytes < 64 * 1024),
        "no write carries the annotations: {writes:?}"
    );
}

#[tokio::test]
async fn the_queue_behind_a_claim_rides_on_its_write_and_each_turn_is_marked_called() {
    let (mut world, _) = World::logged();
    let claims: Vec<_> = (0..8)
        .map(|n| world.claim(claim_of(&format!("q{n}"), "fast", P)))
        .collect();
    for pvc in &claims {
        world.provision(pvc).await.expect("provisioned");
    }
    let writes: Vec<_> = world
        .api
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with(LOGS) && r.method != http::Method::GET)
        .collect();
    let first = writes[0].body["data"].as_object().expect("data");
    assert_eq!(first.len(), 8, "the seven queued behind ride on the first");
    assert_eq!(
        first
            .values()
            .filter(|text| text.as_str().unwrap_or_default().contains("\"ahead\":true"))
            .count(),
        7,
        "marked recorded ahead: {first:?}"
    );
    // One at a time, each turn's write marks its claim called before its guest is called (a
    // stored mark "ahead" must mean "never called"); turns that come together share a write.
    assert_eq!(intent_writes(&world), 8);
    for n in 0..8 {
        assert!(world.api.get(&pv_path(&format!("pvc-u-q{n}"))).is_some());
    }
}

#[tokio::test]
async fn claims_recorded_ahead_never_fill_the_log_however_many_wait() {
    let (mut world, log) = World::logged();
    world.class("stuck", json!({"fail": "transient"}), json!({}));
    let claims: Vec<_> = (0..2_000)
        .map(|n| world.claim(claim_of(&format!("w{n}"), "stuck", P)))
        .collect();
    // Turns come to claims the log does not hold yet (recorded ahead or not, as the queue goes).
    let mut turns = 0;
    for pvc in &claims {
        if turns == 40 {
            break;
        }
        if log.holds(pvc.metadata.uid.as_deref().unwrap()) {
            continue;
        }
        turns += 1;
        let error = world.provision(pvc).await.expect_err("transient");
        assert_eq!(error.label(), "transient", "{error}");
    }
    assert!(
        log.len() <= 256 + 64,
        "{} entries held for 2,000 waiting claims",
        log.len()
    );
}

/// Claims parked behind a turn are written as called with the write the next turn makes
/// anyway, so their own turns need none: eight claims one at a time (one turn over every
/// class), two intent writes, the first claim's and the first woken one's. Before, every turn
/// wrote its own "called" mark before its guest call: eight writes for eight claims, which was
/// 0.55-0.94 writes per claim on the budget in the benchmarks.
#[tokio::test]
async fn claims_next_in_line_ride_on_a_turns_write_and_their_own_turns_write_nothing() {
    use futures::StreamExt;
    use kube::runtime::reflector::ObjectRef;
    let settings = Settings {
        worker_threads: std::num::NonZeroU16::new(2).expect("2 is not zero"),
        ..log_settings()
    };
    let mut world = World::new(settings, "");
    world.class("slow", json!({"delayMs": "500"}), json!({}));
    world.class("fast", json!({}), json!({}));
    let log = world.ctx.intents.clone().expect("log mode");
    tokio::spawn(log.clone().run());
    let first = world.claim(claim_of("first", "slow", P));
    let queued: Vec<_> = (0..7)
        .map(|n| world.claim(claim_of(&format!("l{n}"), "fast", P)))
        .collect();
    let mut wakeups = world.ctx.turns.wakeups();
    let running = tokio::spawn({
        let ctx = world.ctx.clone();
        async move { claims::reconcile(first, ctx).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    for pvc in &queued {
        world.provision(pvc).await.expect("parked");
    }
    assert_eq!(world.ctx.turns.parked(), 7, "one turn, held by the first");
    running.await.unwrap().expect("the first claim provisions");
    for _ in 0..queued.len() {
        let woken = tokio::time::timeout(Duration::from_secs(5), wakeups.next())
            .await
            .expect("woken when a turn ends")
            .expect("wakeups go on");
        let pvc = queued
            .iter()
            .find(|pvc| ObjectRef::from_obj(&***pvc) == woken)
            .expect("a queued claim");
        world.provision(pvc).await.expect("its turn");
    }
    let writes = intent_writes(&world);
    for n in 0..7 {
        assert!(world.api.get(&pv_path(&format!("pvc-u-l{n}"))).is_some());
    }
    assert_eq!(
        writes, 2,
        "the first claim's write and the first woken one's"
    );
    assert_eq!(
        log.soon_len(),
        0,
        "every claim written as called had its turn"
    );
}
