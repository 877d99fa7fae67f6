//! Claims a guest does not declare it can serve (issue 32: a selector, as a block volume before
//! it) are refused before the guest is called: a `ProvisioningFailed` event, no PV, no storage,
//! no finalizer left on the claim, and given up until the claim changes.

use super::*;

/// A world whose one guest, serving `P`, is `crate_name` (see [`World::of`]).
fn world_of(crate_name: &str, guest_dir: &str) -> World {
    World::of(crate_name, guest_dir, settings(), "")
}

fn with_selector(name: &str) -> Value {
    let mut claim = claim_of(name, "fast", P);
    claim["spec"]["selector"] = json!({"matchLabels": {"tier": "gold"}});
    claim
}

/// The notes of the events written so far.
fn event_notes(world: &World) -> Vec<String> {
    world.api.event_notes()
}

#[tokio::test]
async fn a_claim_with_a_selector_is_refused_when_its_guest_does_not_declare_selectors() {
    let mut world = world_of("hostpath", "/volumes");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(with_selector("picky"));
    world
        .provision(&pvc)
        .await
        .expect("a refusal is an answer, not a reconcile error");
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let notes = event_notes(&world);
    assert!(
        notes.iter().any(|n| n.starts_with("ProvisioningFailed:")
            && n.contains("does not handle claims with a selector")
            && n.contains("guest hostpath declares no `selector` capability")),
        "{notes:#?}"
    );
    assert!(
        world.api.get(&pv_path("pvc-u-picky")).is_none(),
        "no PV for a claim whose selector nobody honours"
    );
    assert!(
        world.finalizers("picky").is_empty(),
        "nothing holds the claim"
    );
    assert_eq!(
        std::fs::read_dir(world.storage.path()).unwrap().count(),
        0,
        "the guest was never asked to build anything"
    );
    // Final for this spec: looked at again, it is neither retried nor reported twice.
    let pvc = world.sync_claim("picky");
    world.provision(&pvc).await.expect("given up");
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let failed = event_notes(&world)
        .iter()
        .filter(|n| n.starts_with("ProvisioningFailed"))
        .count();
    assert_eq!(failed, 1, "{:#?}", event_notes(&world));
    assert!(
        !world
            .api
            .calls()
            .iter()
            .any(|c| c.starts_with("POST /api/v1/persistentvolumes")),
        "{:#?}",
        world.api.calls()
    );
}

#[tokio::test]
async fn a_guest_that_declares_selectors_is_handed_claims_with_one() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(with_selector("picky"));
    world.provision(&pvc).await.expect("provisioned");
    assert!(world.api.get(&pv_path("pvc-u-picky")).is_some());
    assert!(
        world.guest_calls().contains("provision"),
        "{}",
        world.guest_calls()
    );
}

#[tokio::test]
async fn a_guest_built_before_the_capabilities_hook_keeps_block_and_gets_no_selector() {
    let mut world = world_of("legacy_block", "/state");
    world.class("fast", json!({}), json!({}));
    let mut raw = claim_of("raw", "fast", P);
    raw["spec"]["volumeMode"] = json!("Block");
    let pvc = world.claim(raw);
    // Its block hook says yes, so the guest is called (and answers `final`: it builds nothing).
    let error = world
        .provision(&pvc)
        .await
        .expect_err("the guest's own answer");
    assert_eq!(error.label(), "final");
    let pvc = world.claim(with_selector("picky"));
    world.provision(&pvc).await.expect("refused by the host");
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let notes = event_notes(&world);
    assert!(
        notes
            .iter()
            .any(|n| n.contains("legacy_block declares no `selector`")),
        "{notes:#?}"
    );
}
