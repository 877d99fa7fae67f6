//! Provisioning ahead of kube-controller-manager's mark, with kube-controller-manager stopped so
//! that nobody marks or binds meanwhile: an unmarked claim of a Delete class gets its pre-bound PV
//! at once, and KCM binds it when it comes back; `--wait-for-mark`, a Retain class or a PV KCM
//! could bind instead make a claim wait for the mark; a PV provisioned ahead that loses its claim
//! to another PV is Released and deleted; a claim holding our finalizer names its provisioner.
//!
//! Each test stops the kube-controller-manager every test of this binary shares: the suite runs
//! one test at a time, and [`restoring_controller_manager`] starts it again however a test ends.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow, ensure};
use futures::FutureExt as _;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use wp_harness::ControlPlane;

use super::SUITE;
use super::common::e2e::{pv_name, static_pv, uid};
use super::common::world::World;

/// The annotation kube-controller-manager 1.20 marks a claim with for its external provisioner.
const MARK: &str = "volume.beta.kubernetes.io/storage-provisioner";

/// The GA name of [`MARK`], which kube-controller-manager sets beside it from 1.23 on.
const GA_MARK: &str = "volume.kubernetes.io/storage-provisioner";

/// The finalizer `--intent-record=claim-finalizer` puts on a claim it provisions.
const CLAIM_FINALIZER: &str = "wasm-provisioner.dev/provisioning";

/// How long a test body may run before kube-controller-manager is started again: inside the
/// suite's deadline per test (480 s), so that a body that hangs still leaves the PV binder
/// running for the tests after it.
const BODY_DEADLINE: Duration = Duration::from_secs(400);

/// How long a claim that must wait is watched for a PV once its control claim has one: the
/// control proves the provisioner is serving, so a provisioner that would provision the waiting
/// claim too would mostly have done so by then.
const STILL_WAITING: Duration = Duration::from_secs(3);

/// Runs `body`, which stops kube-controller-manager (and usually starts it again itself), and
/// starts it again however `body` ends: done, failed, panicked or past [`BODY_DEADLINE`]. A drop
/// guard cannot do this, as starting it is async and waits for its PV binder.
async fn restoring_controller_manager<F, Fut>(cp: Arc<ControlPlane>, body: F) -> anyhow::Result<()>
where
    F: FnOnce(Arc<ControlPlane>) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let ended = AssertUnwindSafe(tokio::time::timeout(BODY_DEADLINE, body(cp.clone())))
        .catch_unwind()
        .await;
    let restarted = cp
        .start_controller_manager()
        .await
        .context("starting kube-controller-manager again after the test");
    if let Err(error) = &restarted {
        // Said here too: a failed body's error below would hide it, and every later test fails.
        eprintln!("{error:#}");
    }
    match ended {
        Ok(Ok(outcome)) => outcome.and(restarted),
        Ok(Err(_)) => Err(anyhow!("the test body timed out after {BODY_DEADLINE:?}")),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// An unmarked claim of a Delete class gets its PV, pre-bound to it by UID, and its storage
/// while kube-controller-manager is down; when it comes back it binds the claim to that PV, and
/// the claim's delete takes the PV and the storage.
pub async fn a_claim_is_provisioned_ahead_of_kube_controller_managers_mark(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    restoring_controller_manager(cp, |cp| async move {
        let mut w = World::new(cp, SUITE, "ahead", "scripted").await?;
        w.cp.stop_controller_manager().await?;
        w.start(&[])?;
        let class = w.class("c").create().await?;
        let claim = w.claim("data").class(&class).create().await?;
        let pv = pv_name(&claim);
        let volume = w.wait_pv(&pv).await?;
        ensure_pre_bound_to(&volume, &claim)?;
        let storage = w.storage_of(&pv);
        ensure!(storage.is_dir(), "the guest built {}", storage.display());
        let unmarked = w.claims().get("data").await?;
        ensure!(
            mark(&unmarked).is_none(),
            "nobody marked the claim: {:?}",
            unmarked.metadata.annotations
        );

        w.cp.start_controller_manager().await?;
        let bound = w.wait_bound("data").await?;
        ensure!(bound.name_any() == pv, "bound to {}", bound.name_any());
        w.claims().delete("data", &DeleteParams::default()).await?;
        w.wait_pv_gone(&pv).await?;
        w.wait_until("the storage deleted", || !storage.exists())
            .await?;
        ensure!(!w.logs_forbidden(), "{}", w.fx.logs());
        Ok(())
    })
    .await
}

/// With `--wait-for-mark` only marked claims are provisioned: a claim created marked (as
/// kube-controller-manager would have marked it) gets its PV, an unmarked one of the same class
/// none until kube-controller-manager comes back and marks it.
pub async fn with_wait_for_mark_an_unmarked_claim_waits_for_kube_controller_manager(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    restoring_controller_manager(cp, |cp| async move {
        let mut w = World::new(cp, SUITE, "wait-for-mark", "scripted").await?;
        w.cp.stop_controller_manager().await?;
        w.start(&["--wait-for-mark"])?;
        let class = w.class("c").create().await?;
        let unmarked = w.claim("unmarked").class(&class).create().await?;
        let control = w
            .claim("control")
            .class(&class)
            .annotation(MARK, &w.provisioner)
            .create()
            .await?;
        w.wait_pv(&pv_name(&control)).await?;
        tokio::time::sleep(STILL_WAITING).await;
        ensure_not_provisioned(&w, &unmarked).await?;

        w.cp.start_controller_manager().await?;
        wait_marked(&w, "unmarked").await?;
        let bound = w.wait_bound("unmarked").await?;
        ensure!(bound.name_any() == pv_name(&unmarked));
        ensure!(w.wait_bound("control").await?.name_any() == pv_name(&control));
        ensure!(!w.logs_forbidden(), "{}", w.fx.logs());
        Ok(())
    })
    .await
}

/// An Available static PV of a class (no claimRef, no provisioner's annotation) is one
/// kube-controller-manager could bind the class's claims to: an unmarked claim of that class
/// waits for the mark, and is bound to the static PV, while another class's unmarked claim is
/// provisioned ahead (and a marked one of it as usual) meanwhile.
///
/// The static PV is made Available by kube-controller-manager before it is stopped: its binder
/// matches claims to Available PVs only, so a restarted one that synced the claim before a PV
/// created (Pending) while it was down would mark the claim, and the provisioner would rightly
/// serve the mark.
pub async fn an_available_pv_of_the_class_makes_its_claims_wait_for_the_mark(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    restoring_controller_manager(cp, |cp| async move {
        let mut w = World::new(cp, SUITE, "available", "scripted").await?;
        let pooled = w.class("pooled").create().await?;
        let other = w.class("other").create().await?;
        let static_name = format!("static-{}", w.ns);
        let static_pv = static_pv(&static_name, &pooled, w.storage.path(), None);
        w.pvs().create(&PostParams::default(), &static_pv).await?;
        w.wait_pv_phase(&static_name, "Available").await?;
        w.cp.stop_controller_manager().await?;
        w.start(&[])?;
        let waiting = w.claim("data").class(&pooled).create().await?;
        let ahead = ensure_waits_while_others_are_served(&w, &waiting, &other).await?;

        w.cp.start_controller_manager().await?;
        let bound = w.wait_bound("data").await?;
        ensure!(
            bound.name_any() == static_name,
            "bound to the static PV, not {}",
            bound.name_any()
        );
        // Bound to the static PV, the claim is nobody's to provision, after the bind too.
        tokio::time::sleep(STILL_WAITING).await;
        ensure_not_provisioned(&w, &waiting).await?;
        ensure!(w.wait_bound("ahead").await?.name_any() == pv_name(&ahead));

        w.claims().delete("data", &DeleteParams::default()).await?;
        w.wait_pv_phase(&static_name, "Released").await?;
        w.pvs()
            .delete(&static_name, &DeleteParams::default())
            .await?;
        w.wait_pv_gone(&static_name).await?;
        ensure!(!w.logs_forbidden(), "{}", w.fx.logs());
        Ok(())
    })
    .await
}

/// A user binds a claim that was provisioned ahead to a static PV of their own (pre-bound by
/// name, then `spec.volumeName`) before kube-controller-manager binds it: the claim ends on the
/// static PV, and ours, dynamically provisioned with Delete and its claim bound elsewhere, is
/// Released by kube-controller-manager and deleted by us with its storage. The scripted guest's
/// delete lingers so that Released is seen before the PV goes: kube-controller-manager releases
/// it as soon as it syncs it (the claim names the static PV already), and may bind the claim
/// seconds later.
pub async fn a_pv_provisioned_ahead_that_loses_the_claim_is_released_and_deleted(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    restoring_controller_manager(cp, |cp| async move {
        let mut w = World::new(cp, SUITE, "loses", "scripted").await?;
        w.cp.stop_controller_manager().await?;
        w.start(&[])?;
        let class = w.class("c").param("deleteDelayMs", "3000").create().await?;
        let claim = w.claim("data").class(&class).create().await?;
        let ours = pv_name(&claim);
        ensure_pre_bound_to(&w.wait_pv(&ours).await?, &claim)?;
        let storage = w.storage_of(&ours);
        ensure!(storage.is_dir(), "the guest built {}", storage.display());

        let static_name = format!("static-{}", w.ns);
        let static_pv = static_pv(
            &static_name,
            &class,
            w.storage.path(),
            Some((&w.ns, "data")),
        );
        w.pvs().create(&PostParams::default(), &static_pv).await?;
        // Allowed once, while the claim names no volume.
        let to_static = json!({"spec": {"volumeName": static_name}});
        w.claims()
            .patch("data", &PatchParams::default(), &Patch::Merge(&to_static))
            .await?;

        w.cp.start_controller_manager().await?;
        w.wait_pv_phase(&ours, "Released").await?;
        let bound = w.wait_bound("data").await?;
        ensure!(
            bound.name_any() == static_name,
            "bound to the static PV, not {}",
            bound.name_any()
        );
        w.wait_pv_gone(&ours).await?;
        w.wait_until("our PV's storage deleted", || !storage.exists())
            .await?;
        ensure!(
            w.calls().contains(&format!("delete {ours}")),
            "{:?}",
            w.calls()
        );
        let kept = w.claims().get("data").await?;
        ensure!(
            kept.spec.and_then(|s| s.volume_name).as_deref() == Some(static_name.as_str()),
            "the claim lives on, bound to the static PV"
        );

        w.claims().delete("data", &DeleteParams::default()).await?;
        w.wait_claim_gone("data").await?;
        w.pvs()
            .delete(&static_name, &DeleteParams::default())
            .await?;
        w.wait_pv_gone(&static_name).await?;
        ensure!(!w.logs_forbidden(), "{}", w.fx.logs());
        Ok(())
    })
    .await
}

/// A Retain class's claims wait for the mark: a Retain volume provisioned ahead that lost its
/// claim would be kept, not deleted. A Delete class's claims, marked and unmarked, are
/// provisioned meanwhile.
pub async fn a_retain_class_waits_for_the_mark(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    restoring_controller_manager(cp, |cp| async move {
        let mut w = World::new(cp, SUITE, "retain-waits", "scripted").await?;
        w.cp.stop_controller_manager().await?;
        w.start(&[])?;
        let keep = w.class("keep").reclaim("Retain").create().await?;
        let other = w.class("other").create().await?;
        let waiting = w.claim("kept").class(&keep).create().await?;
        ensure_waits_while_others_are_served(&w, &waiting, &other).await?;

        w.cp.start_controller_manager().await?;
        wait_marked(&w, "kept").await?;
        let kept = w.wait_bound("kept").await?.name_any();
        ensure!(kept == pv_name(&waiting), "bound to {kept}");

        // Retain leaves the PV to the admin; the storage goes with the test's directory.
        w.claims().delete("kept", &DeleteParams::default()).await?;
        w.wait_pv_phase(&kept, "Released").await?;
        w.pvs().delete(&kept, &DeleteParams::default()).await?;
        w.wait_pv_gone(&kept).await?;
        ensure!(!w.logs_forbidden(), "{}", w.fx.logs());
        Ok(())
    })
    .await
}

/// With the intent on the claim (`--intent-record=claim-finalizer`), the patch that puts our
/// finalizer on an unmarked claim also marks it for us, as kube-controller-manager would: while
/// the guest works, the claim carries both, and the mark stays once the PV exists.
pub async fn in_claim_finalizer_mode_the_finalizer_names_the_provisioner(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    restoring_controller_manager(cp, |cp| async move {
        cp.stop_controller_manager().await?;
        let mode = ["--intent-record=claim-finalizer"];
        let (w, claim) = World::guest_at_work_as(cp, SUITE, "finalizer-marks", 3000, &mode).await?;
        let at_work = w.claims().get("data").await?;
        ensure!(
            at_work.finalizers().iter().any(|f| f == CLAIM_FINALIZER),
            "our finalizer while the guest works: {:?}",
            at_work.finalizers()
        );
        ensure_marked_for_us(&w, &at_work)?;
        let pv = pv_name(&claim);
        ensure_pre_bound_to(&w.wait_pv(&pv).await?, &claim)?;
        ensure_marked_for_us(&w, &w.claims().get("data").await?)?;

        w.cp.start_controller_manager().await?;
        let bound = w.wait_bound("data").await?;
        ensure!(bound.name_any() == pv, "bound to {}", bound.name_any());
        ensure_marked_for_us(&w, &w.claims().get("data").await?)?;
        ensure!(!w.logs_forbidden(), "{}", w.fx.logs());
        Ok(())
    })
    .await
}

/// The provisioner the claim is marked for, by either annotation.
fn mark(claim: &PersistentVolumeClaim) -> Option<&str> {
    let annotations = claim.metadata.annotations.as_ref()?;
    annotations
        .get(MARK)
        .or_else(|| annotations.get(GA_MARK))
        .map(String::as_str)
}

/// The claim is marked for this world's provisioner with both annotations, as
/// kube-controller-manager 1.23+ marks one (1.20 reads the beta one).
fn ensure_marked_for_us(w: &World, claim: &PersistentVolumeClaim) -> anyhow::Result<()> {
    let annotations = claim.annotations();
    for mark in [MARK, GA_MARK] {
        ensure!(
            annotations.get(mark) == Some(&w.provisioner),
            "{mark} names {}: {annotations:?}",
            w.provisioner
        );
    }
    Ok(())
}

/// Waits until kube-controller-manager marked `claim` for this world's provisioner.
async fn wait_marked(w: &World, claim: &str) -> anyhow::Result<()> {
    let claims = w.claims();
    w.wait(&format!("claim {claim} marked"), || async {
        let marked = claims.get(claim).await?;
        Ok((mark(&marked) == Some(w.provisioner.as_str())).then_some(()))
    })
    .await
}

/// The PV names the claim in its claimRef, UID included, so that kube-controller-manager can
/// bind nothing else to it.
fn ensure_pre_bound_to(pv: &PersistentVolume, claim: &PersistentVolumeClaim) -> anyhow::Result<()> {
    let claim_ref = pv
        .spec
        .as_ref()
        .and_then(|s| s.claim_ref.as_ref())
        .with_context(|| format!("PV {} has no claimRef", pv.name_any()))?;
    ensure!(
        claim_ref.uid.as_deref() == Some(uid(claim).as_str())
            && claim_ref.name == claim.metadata.name
            && claim_ref.namespace == claim.metadata.namespace,
        "PV {} is pre-bound to {claim_ref:?}, not claim {}/{} ({})",
        pv.name_any(),
        claim.namespace().unwrap_or_default(),
        claim.name_any(),
        uid(claim)
    );
    Ok(())
}

/// `waiting` gets nothing while two claims of `other`, one unmarked (`ahead`, returned) and one
/// created marked (as kube-controller-manager would have marked it), get their PVs: the
/// provisioner serves, ahead of the mark too, and still has not provisioned `waiting`
/// [`STILL_WAITING`] after.
async fn ensure_waits_while_others_are_served(
    w: &World,
    waiting: &PersistentVolumeClaim,
    other: &str,
) -> anyhow::Result<PersistentVolumeClaim> {
    let ahead = w.claim("ahead").class(other).create().await?;
    let control = w
        .claim("control")
        .class(other)
        .annotation(MARK, &w.provisioner)
        .create()
        .await?;
    w.wait_pv(&pv_name(&control)).await?;
    w.wait_pv(&pv_name(&ahead)).await?;
    tokio::time::sleep(STILL_WAITING).await;
    ensure_not_provisioned(w, waiting).await?;
    Ok(ahead)
}

/// Nothing was provisioned for `claim`: no PV named after it, no guest call, no storage.
async fn ensure_not_provisioned(w: &World, claim: &PersistentVolumeClaim) -> anyhow::Result<()> {
    let pv = pv_name(claim);
    ensure!(
        w.pvs().get_opt(&pv).await?.is_none(),
        "claim {} got PV {pv}\n{}",
        claim.name_any(),
        w.fx.logs()
    );
    let provisions = w
        .calls()
        .iter()
        .filter(|line| line.starts_with(&format!("provision {pv}")))
        .count();
    ensure!(
        provisions == 0 && !w.storage_of(&pv).exists(),
        "the guest was called for claim {} ({provisions} times)",
        claim.name_any()
    );
    Ok(())
}
