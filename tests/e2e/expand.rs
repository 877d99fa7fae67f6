//! Volumes that grow, against the real control plane: kube-apiserver's resize admission and
//! kube-controller-manager's expand controller (which, for a hostPath volume, only says
//! `ExternalExpanding` and waits for us).

use std::sync::Arc;
use std::time::Instant;

use anyhow::ensure;
use kube::ResourceExt;
use wp_harness::ControlPlane;

use crate::SUITE;
use crate::common::e2e::uid;
use crate::common::world::World;

/// A 1 Gi claim of a class that allows expansion, asked for 2 Gi: the guest's `expand` is
/// called, the PV's capacity and the claim's `status.capacity` say 2Gi, the resize condition is
/// gone, and the events say what happened. The time from the request to the new capacity is
/// printed (a figure, not a pass mark: the machine is shared).
pub async fn a_bound_claim_grows_when_it_asks_for_more(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "grow", "scripted").await?;
    w.start(&[])?;
    let class = w.class("grows").allow_expansion().create().await?;
    let claim = w.claim("data").class(&class).create().await?;
    let pv = w.wait_bound("data").await?;
    let asked = Instant::now();
    w.resize("data", "2Gi").await?;
    let grown = w.wait_capacity("data", "2Gi").await?;
    println!(
        "figure: 1Gi -> 2Gi in status.capacity {:?} after the request",
        asked.elapsed()
    );
    let live = w.pvs().get(&pv.name_any()).await?;
    let capacity = &live.spec.as_ref().unwrap().capacity.as_ref().unwrap()["storage"];
    ensure!(capacity.0 == "2Gi", "PV capacity {capacity:?}");
    let conditions = grown
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    ensure!(
        conditions.iter().all(|c| c.type_ != "Resizing"),
        "resize conditions cleared: {conditions:?}"
    );
    ensure!(w.count_calls("expand") == 1, "{:?}", w.calls());
    w.wait_event(&uid(&claim), "VolumeResizeSuccessful", &["2Gi"])
        .await?;
    let reasons = w.reasons(&uid(&claim)).await?;
    ensure!(reasons.contains(&"Resizing".into()), "{reasons:?}");
    // Grown, the claim is settled again: nothing more is asked of the guest.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    ensure!(w.count_calls("expand") == 1, "{:?}", w.calls());
    Ok(())
}

/// A guest that fails once is called again after its backoff and the claim grows; a guest
/// that answers less than the request is refused (the PV keeps its capacity) until the claim is
/// given up on.
pub async fn a_failed_growth_is_reported_retried_and_given_up(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "grow-fail", "scripted").await?;
    w.start(&["--failed-provision-threshold", "2"])?;
    let once = w
        .class("once")
        .allow_expansion()
        .params(&[("expandFail", "final"), ("expandFailTimes", "1")])
        .create()
        .await?;
    let short = w
        .class("short")
        .allow_expansion()
        .param("expandShort", "true")
        .create()
        .await?;
    let flaky = w.claim("flaky").class(&once).create().await?;
    let lying = w.claim("lying").class(&short).create().await?;
    w.wait_bound("flaky").await?;
    let pv = w.wait_bound("lying").await?;
    w.resize("flaky", "2Gi").await?;
    w.resize("lying", "2Gi").await?;
    w.wait_event(
        &uid(&flaky),
        "VolumeResizeFailed",
        &["scripted Final failure"],
    )
    .await?;
    w.wait_capacity("flaky", "2Gi").await?;
    w.wait_event(&uid(&lying), "VolumeResizeFailed", &["at least the"])
        .await?;
    w.wait_event(&uid(&lying), "ExpansionGivenUp", &["2 failed attempts"])
        .await?;
    let live = w.pvs().get(&pv.name_any()).await?;
    let capacity = &live.spec.as_ref().unwrap().capacity.as_ref().unwrap()["storage"];
    ensure!(
        capacity.0 == "1Gi",
        "a refused answer leaves the PV: {capacity:?}"
    );
    let claim = w.claims().get("lying").await?;
    let status = claim
        .status
        .unwrap_or_default()
        .capacity
        .unwrap_or_default();
    ensure!(status["storage"].0 == "1Gi", "and the claim: {status:?}");
    Ok(())
}
