//! The controller against a real control plane: etcd + kube-apiserver + kube-controller-manager
//! (binding, protection), the real `wasm-provisioner` binary, real guests from `guests/`.
//!
//! One control plane serves the whole suite; every test gets its own namespace, its own
//! provisioner name, its own storage directory and its own provisioner process, so tests run
//! side by side without seeing each other.

mod common;
#[path = "e2e/expand.rs"]
mod expand;
#[allow(
    dead_code,
    reason = "the registry tests' helpers; this suite starts a registry only"
)]
mod oci_support;
#[path = "e2e/registry.rs"]
mod registry;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use wp_harness::ControlPlane;

use common::e2e::{SELECTED_NODE, affinity, pv_name, uid};
use common::world::World;
use expand::{
    a_bound_claim_grows_when_it_asks_for_more, a_failed_growth_is_reported_retried_and_given_up,
};
use registry::a_guest_fetched_from_its_source_provisions;

const OUR_FINALIZER: &str = "wasm-provisioner.dev/provisioning";

/// This suite's name: its namespaces' prefix.
const SUITE: &str = "e2e";

async fn provision_binds_claim_with_the_right_fields(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "bind", "hostpath").await?;
    w.start(&[])?;
    let class = w.class("fast").create().await?;
    let claim = w.claim("data").class(&class).create().await?;
    let pv = w.wait_bound("data").await?;
    let spec = pv.spec.clone().unwrap();
    let expected_name = pv_name(&claim);
    ensure!(pv.name_any() == expected_name, "PV name {}", pv.name_any());
    ensure!(pv.annotations().get("pv.kubernetes.io/provisioned-by") == Some(&w.provisioner));
    ensure!(spec.storage_class_name.as_deref() == Some(class.as_str()));
    ensure!(spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete"));
    ensure!(spec.capacity.unwrap()["storage"].0 == "1Gi");
    ensure!(spec.access_modes.unwrap() == vec!["ReadWriteOnce".to_string()]);
    let claim_ref = spec.claim_ref.unwrap();
    ensure!(
        claim_ref.uid == claim.metadata.uid
            && claim_ref.namespace.as_deref() == Some(w.ns.as_str())
    );
    let path = spec.host_path.unwrap().path;
    ensure!(
        Path::new(&path) == w.storage_of(&expected_name),
        "hostPath {path}"
    );
    ensure!(Path::new(&path).is_dir(), "directory created");
    let live = w.claims().get("data").await?;
    ensure!(
        !live
            .finalizers()
            .iter()
            .any(|f| f == "wasm-provisioner.dev/provisioning"),
        "our finalizer is removed once the PV exists: {:?}",
        live.finalizers()
    );
    let reasons = w.reasons(&uid(&claim)).await?;
    ensure!(
        reasons.contains(&"Provisioning".into())
            && reasons.contains(&"ProvisioningSucceeded".into()),
        "{reasons:?}"
    );
    Ok(())
}

async fn deleting_the_claim_deletes_pv_and_storage(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "delete", "hostpath").await?;
    w.start(&[])?;
    let class = w.class("fast").create().await?;
    w.claim("data").class(&class).create().await?;
    let pv = w.wait_bound("data").await?;
    let dir = w.storage_of(&pv.name_any());
    ensure!(dir.is_dir());
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_pv_gone(&pv.name_any()).await?;
    w.wait_until("storage deleted with the PV", || !dir.exists())
        .await?;
    Ok(())
}

async fn retain_keeps_the_released_pv_and_storage(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "retain", "hostpath").await?;
    w.start(&[])?;
    let class = w.class("keep").reclaim("Retain").create().await?;
    w.claim("data").class(&class).create().await?;
    let name = w.wait_bound("data").await?.name_any();
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_pv_phase(&name, "Released").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        w.pvs().get_opt(&name).await?.is_some(),
        "Retain keeps the PV"
    );
    ensure!(w.storage_of(&name).is_dir(), "Retain keeps the storage");
    Ok(())
}

async fn a_class_created_after_its_claim_is_provisioned_once(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "late-class", "scripted").await?;
    w.start(&[])?;
    let class = format!("{}-late", w.ns);
    let claim = w.claim("data").class(&class).create().await?;
    w.wait_event(&uid(&claim), "ProvisioningFailed", &[])
        .await
        .context("missing class is reported")?;
    w.class("late").create().await?;
    let pv = w.wait_bound("data").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let provisions = w.count_calls("provision");
    ensure!(
        provisions == 1,
        "guest called {provisions} times: {:?}",
        w.calls()
    );
    ensure!(pv.name_any() == pv_name(&claim));
    Ok(())
}

async fn final_failures_stop_at_the_threshold_even_across_resyncs(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "give-up", "scripted").await?;
    w.start(&["--failed-provision-threshold", "3", "--resync-period", "1s"])?;
    let class = w.class("broken").param("fail", "final").create().await?;
    let claim = w.claim("data").class(&class).create().await?;
    w.wait_event(&uid(&claim), "ProvisioningFailed", &["final error"])
        .await?;
    w.wait_event(&uid(&claim), "ProvisioningGivenUp", &["3 failed attempts"])
        .await?;
    let calls = w.calls().len();
    tokio::time::sleep(Duration::from_secs(5)).await;
    ensure!(calls == 3, "three attempts before giving up, saw {calls}");
    ensure!(
        w.calls().len() == calls,
        "no calls after giving up, across five resyncs: {:?}",
        w.calls()
    );
    let live = w.claims().get("data").await?;
    ensure!(live.spec.as_ref().unwrap().volume_name.is_none());
    Ok(())
}

async fn transient_failures_are_retried_until_success(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    // 3 transient failures then success, with a threshold of 2.
    retried_without_counting(cp, "transient", 2, ("transient", 3)).await
}

/// A guest answers `fail.0` `fail.1` times, then provisions: it is called `fail.1 + 1` times and
/// never given up on, though `fail.1` is above the failure `threshold`.
async fn retried_without_counting(
    cp: Arc<ControlPlane>,
    name: &str,
    threshold: usize,
    (fail, times): (&str, usize),
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, name, "scripted").await?;
    w.start(&["--failed-provision-threshold", &threshold.to_string()])?;
    let class = w
        .class(name)
        .params(&[("fail", fail), ("failTimes", &times.to_string())])
        .create()
        .await?;
    let claim = w.claim("data").class(&class).create().await?;
    w.wait_bound("data").await?;
    let provisions = w.count_calls("provision");
    ensure!(
        provisions == times + 1,
        "{times} {fail} answers then success, saw {provisions} calls"
    );
    let reasons = w.reasons(&uid(&claim)).await?;
    ensure!(
        !reasons.contains(&"ProvisioningGivenUp".into()),
        "{fail} answers do not count: {reasons:?}"
    );
    Ok(())
}

async fn a_denied_pv_create_cleans_up_the_storage(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp.clone(), SUITE, "denied", "scripted").await?;
    // The identity gets everything the provisioner needs except creating PVs.
    let roles: Api<ClusterRole> = Api::all(w.admin.clone());
    let mut role: ClusterRole = roles.get("wasm-provisioner").await?;
    role.metadata = serde_json::from_value(json!({"name": "e2e-no-pv-create"}))?;
    for rule in role.rules.iter_mut().flatten() {
        if rule
            .resources
            .iter()
            .flatten()
            .any(|r| r == "persistentvolumes")
        {
            rule.verbs.retain(|v| v != "create");
        }
    }
    roles.create(&PostParams::default(), &role).await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "e2e-no-pv-create"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "e2e-no-pv-create"},
        "subjects": [{"kind": "User", "name": cp.restricted_user(1), "apiGroup": "rbac.authorization.k8s.io"}],
    }))?;
    Api::<ClusterRoleBinding>::all(w.admin.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    // Leader election needs the lease role deploy/rbac.yaml grants in namespace wasm-provisioner.
    let lease_binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "e2e-no-pv-create-leases", "namespace": "wasm-provisioner"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "wasm-provisioner-leader-election"},
        "subjects": [{"kind": "User", "name": cp.restricted_user(1), "apiGroup": "rbac.authorization.k8s.io"}],
    }))?;
    Api::<RoleBinding>::namespaced(w.admin.clone(), "wasm-provisioner")
        .create(&PostParams::default(), &lease_binding)
        .await?;
    let kubeconfig = cp.restricted_kubeconfig(1).to_owned();
    w.start_as(&kubeconfig, &["--failed-provision-threshold", "1"])?;
    let class = w.class("denied").create().await?;
    let claim = w.claim("data").class(&class).create().await?;
    let message = w
        .wait_event(
            &uid(&claim),
            "ProvisioningFailed",
            &["Error creating provisioned PV object"],
        )
        .await?;
    ensure!(
        message.contains("forbidden") || message.contains("Forbidden"),
        "{message}"
    );
    let pv = pv_name(&claim);
    w.wait("storage cleaned up", || async {
        Ok((!w.storage_of(&pv).exists()).then_some(()))
    })
    .await?;
    ensure!(
        w.calls().iter().any(|l| l == &format!("delete {pv}")),
        "the guest was asked to delete: {:?}",
        w.calls()
    );
    ensure!(w.pvs().get_opt(&pv).await?.is_none());
    Ok(())
}

async fn a_claim_deleted_while_the_guest_works_leaves_nothing(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let (w, claim) = World::guest_at_work(cp, SUITE, "deleted-mid", 3000).await?;
    let pv = pv_name(&claim);
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_claim_gone("data").await?;
    // Usually the controller sees the deletion when the guest returns and deletes the new
    // storage at once; if its cache lags, the PV is created and reclaimed as Released instead.
    // Either way nothing may be left.
    let storage = w.storage_of(&pv);
    let pvs = w.pvs();
    w.wait("no orphaned storage and no PV", || async {
        Ok((!storage.exists() && pvs.get_opt(&pv).await?.is_none()).then_some(()))
    })
    .await?;
    Ok(())
}

async fn claims_with_the_same_name_over_time_get_their_own_volumes(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "same-name", "scripted").await?;
    w.start(&[])?;
    let class = w.class("c").create().await?;
    let first = w.claim("data").class(&class).create().await?;
    let pv1 = w.wait_bound("data").await?;
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_claim_gone("data").await?;
    w.wait_pv_gone(&pv1.name_any()).await?;
    let second = w.claim("data").class(&class).create().await?;
    let pv2 = w.wait_bound("data").await?;
    ensure!(first.metadata.uid != second.metadata.uid);
    ensure!(
        pv2.name_any() == pv_name(&second),
        "new PV for the new claim"
    );
    ensure!(!w.storage_of(&pv1.name_any()).exists() && w.storage_of(&pv2.name_any()).is_dir());
    Ok(())
}

async fn claims_for_other_provisioners_are_never_touched(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "other", "scripted").await?;
    w.start(&[])?;
    let foreign = w
        .class("foreign")
        .provisioner("example.com/someone-else")
        .create()
        .await?;
    let claim = w.claim("data").class(&foreign).create().await?;
    // Make sure our provisioner is up and working, then look at the foreign claim.
    let ours = w.class("ours").create().await?;
    w.claim("mine").class(&ours).create().await?;
    w.wait_bound("mine").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let live = w.claims().get("data").await?;
    ensure!(live.spec.as_ref().unwrap().volume_name.is_none());
    ensure!(
        live.finalizers()
            .iter()
            .all(|f| !f.starts_with("wasm-provisioner")),
        "{:?}",
        live.finalizers()
    );
    let reasons = w.reasons(&uid(&claim)).await?;
    ensure!(
        !reasons.iter().any(|r| r.starts_with("Provisioning")),
        "{reasons:?}"
    );
    ensure!(
        w.calls().iter().all(|l| !l.contains(&uid(&claim))),
        "guest never called for it"
    );
    Ok(())
}

async fn wait_for_first_consumer_waits_for_the_selected_node(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "wffc", "hostpath").await?;
    w.start(&[])?;
    let class = w.class("local").wait_for_first_consumer().create().await?;
    let claim = w.claim("data").class(&class).create().await?;
    let pv = pv_name(&claim);
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        w.pvs().get_opt(&pv).await?.is_none(),
        "nothing before the scheduler picks a node"
    );
    w.select_node("data", "node-a").await?;
    let volume = w.wait_pv(&pv).await?;
    ensure!(
        affinity(&volume)
            .first()
            .is_some_and(|(_, values)| values == &["node-a"]),
        "node affinity to the selected node: {:?}",
        affinity(&volume)
    );
    Ok(())
}

async fn reschedule_drops_the_selected_node(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "reschedule", "scripted").await?;
    // The claim carries the intent in this mode: the reschedule must drop it with the node.
    w.start(&["--intent-record=claim-finalizer"])?;
    let class = w
        .class("local")
        .param("fail", "reschedule")
        .wait_for_first_consumer()
        .create()
        .await?;
    let claim = w.claim("data").class(&class).create().await?;
    w.select_node("data", "node-a").await?;
    w.wait_event(&uid(&claim), "ProvisioningFailed", &["reschedule"])
        .await?;
    let claims = w.claims();
    w.wait("selected-node removed", || async {
        let c = claims.get("data").await?;
        Ok((!c.annotations().contains_key(SELECTED_NODE)).then_some(()))
    })
    .await?;
    let live = claims.get("data").await?;
    ensure!(
        live.finalizers()
            .iter()
            .all(|f| f != "wasm-provisioner.dev/provisioning"),
        "nothing is in flight after a reschedule: {:?}",
        live.finalizers()
    );
    Ok(())
}

async fn in_background_is_called_again_without_counting(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    // Two in-background answers then success, with a threshold of 1.
    retried_without_counting(cp, "background", 1, ("in-background", 2)).await
}

async fn block_claims_need_a_guest_that_supports_block(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "block", "hostpath").await?;
    w.start(&[])?;
    let class = w.class("fs-only").create().await?;
    let claim = w.claim("raw").class(&class).block().create().await?;
    w.wait_event(
        &uid(&claim),
        "ProvisioningFailed",
        &["does not support block"],
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(w.pvs().get_opt(&pv_name(&claim)).await?.is_none());
    Ok(())
}

/// Issue 32: hostpath declares no `selector` capability, so a claim with a selector is refused
/// with an event, gets no PV and keeps no finalizer (before: provisioned as if it had none).
async fn claims_with_a_selector_need_a_guest_that_declares_selectors(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "selector", "hostpath").await?;
    w.start(&["--intent-record=claim-finalizer"])?;
    let class = w.class("plain").create().await?;
    let claim = w
        .claim("picky")
        .class(&class)
        .selector("tier", "gold")
        .create()
        .await?;
    w.wait_event(
        &uid(&claim),
        "ProvisioningFailed",
        &[
            "claim Selector is not supported",
            "declares no `selector` capability",
        ],
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(w.pvs().get_opt(&pv_name(&claim)).await?.is_none(), "no PV");
    let live = w.claims().get("picky").await?;
    let finalizers = live.metadata.finalizers.unwrap_or_default();
    ensure!(
        !finalizers
            .iter()
            .any(|f| f.starts_with("wasm-provisioner.dev/")),
        "nothing of ours holds the claim: {finalizers:?}"
    );
    Ok(())
}

async fn block_claims_are_provisioned_by_guests_that_support_block(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "block-ok", "scripted").await?;
    w.start(&[])?;
    let class = w.class("raw").create().await?;
    w.claim("raw").class(&class).block().create().await?;
    let pv = w.wait_bound("raw").await?;
    ensure!(pv.spec.unwrap().volume_mode.as_deref() == Some("Block"));
    Ok(())
}

async fn a_failed_delete_is_reported_and_retried(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "delete-fails", "scripted").await?;
    w.start(&[])?;
    let class = w
        .class("c")
        .params(&[("deleteFail", "final"), ("deleteFailTimes", "1")])
        .create()
        .await?;
    w.claim("data").class(&class).create().await?;
    let pv = w.wait_bound("data").await?;
    let pv_uid = pv.metadata.uid.clone().unwrap_or_default();
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_event(&pv_uid, "VolumeFailedDelete", &["final error"])
        .await?;
    w.wait_pv_gone(&pv.name_any()).await?;
    let storage = w.storage_of(&pv.name_any());
    w.wait_until("storage deleted by the retry", || !storage.exists())
        .await?;
    let deletes = w.count_calls("delete");
    ensure!(
        deletes == 2,
        "one failed delete, one retry: {:?}",
        w.calls()
    );
    Ok(())
}

async fn guest_hooks_decide_last(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "hooks", "scripted").await?;
    w.start(&[])?;
    let class = w.class("kept").param("keep", "true").create().await?;
    let skipped = w
        .claim("skipped")
        .class(&class)
        .annotation("scripted.wasm-provisioner.dev/skip", "true")
        .create()
        .await?;
    w.claim("kept").class(&class).create().await?;
    let name = w.wait_bound("kept").await?.name_any();
    w.claims().delete("kept", &DeleteParams::default()).await?;
    w.wait_pv_phase(&name, "Released").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        w.pvs().get_opt(&name).await?.is_some(),
        "should-delete = false keeps the PV"
    );
    ensure!(w.storage_of(&name).is_dir(), "and its storage");
    let live = w.claims().get("skipped").await?;
    ensure!(
        live.spec.as_ref().unwrap().volume_name.is_none(),
        "should-provision = false leaves the claim"
    );
    ensure!(w.pvs().get_opt(&pv_name(&skipped)).await?.is_none());
    Ok(())
}

async fn pv_finalizer_mode_guards_the_volume_until_storage_is_gone(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "pv-finalizer", "scripted").await?;
    w.start(&[])?;
    let class = w.class("c").create().await?;
    w.claim("data").class(&class).create().await?;
    let name = w.wait_bound("data").await?.name_any();
    let pvs = w.pvs();
    w.wait(
        "PV finalizer on (from the create: on by default)",
        || async {
            let p = pvs.get(&name).await?;
            Ok(p.finalizers()
                .iter()
                .any(|f| f == "external-provisioner.volume.kubernetes.io/finalizer")
                .then_some(()))
        },
    )
    .await?;
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_pv_gone(&name).await?;
    ensure!(
        !w.storage_of(&name).exists(),
        "storage deleted before the finalizer came off"
    );
    Ok(())
}

async fn sigterm_lets_in_flight_work_finish(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let (mut w, claim) = World::guest_at_work(cp, SUITE, "sigterm", 2000).await?;
    let pv = pv_name(&claim);
    let status = w.process.as_mut().unwrap().terminate()?;
    ensure!(
        status.success(),
        "exit 0 after SIGTERM, got {status}: {}",
        w.logs()
    );
    ensure!(
        w.pvs().get_opt(&pv).await?.is_some(),
        "the in-flight provision finished: {}",
        w.logs()
    );
    Ok(())
}

/// `kubectl delete pv` on a Bound volume in `--add-pv-finalizer` mode: pv-protection holds the PV
/// while its claim (and a pod) use it, and so does the storage; once the claim goes, both go.
async fn deleting_a_bound_pv_keeps_its_storage_until_the_claim_goes(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "bound-pv-delete", "scripted").await?;
    w.start(&["--add-pv-finalizer"])?;
    let class = w.class("c").create().await?;
    w.claim("data").class(&class).create().await?;
    let pv = w.wait_bound("data").await?;
    let pvs = w.pvs();
    let name = pv.name_any();
    w.wait("PV finalizer added", || async {
        let p = pvs.get(&name).await?;
        Ok(p.finalizers()
            .iter()
            .any(|f| f == "external-provisioner.volume.kubernetes.io/finalizer")
            .then_some(()))
    })
    .await?;
    pvs.delete(&name, &DeleteParams::default()).await?;
    // Several reconciles of the PV being deleted (each update and a resync) pass meanwhile.
    tokio::time::sleep(Duration::from_secs(4)).await;
    ensure!(
        w.storage_of(&name).exists(),
        "storage deleted while its claim is still bound: {}",
        w.logs()
    );
    ensure!(
        !w.calls().iter().any(|c| c.starts_with("delete ")),
        "the guest was asked to delete bound storage: {:?}",
        w.calls()
    );
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_pv_gone(&name).await?;
    let storage = w.storage_of(&name);
    w.wait_until("storage deleted after the claim went", || !storage.exists())
        .await?;
    Ok(())
}

/// A claim the guest refuses for good holds no finalizer of ours: once the provisioner is gone,
/// deleting it (and its namespace) does not hang.
async fn a_refused_claim_can_be_deleted_after_uninstall(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "refused-uninstall", "scripted").await?;
    w.start(&[
        "--failed-provision-threshold",
        "1",
        "--intent-record=claim-finalizer",
    ])?;
    let class = w.class("broken").param("fail", "final").create().await?;
    let claim = w.claim("data").class(&class).create().await?;
    w.wait_event(&uid(&claim), "ProvisioningGivenUp", &[])
        .await?;
    let claims = w.claims();
    w.wait("finalizer released", || async {
        let c = claims.get("data").await?;
        Ok((!c.finalizers().iter().any(|f| f == OUR_FINALIZER)).then_some(()))
    })
    .await?;
    w.process.take().expect("running").kill();
    claims.delete("data", &DeleteParams::default()).await?;
    w.wait_claim_gone("data").await?;
    Ok(())
}

/// The uninstall command: a claim whose guest may hold storage keeps our finalizer, and after the
/// provisioner is gone `release-finalizers` lets its deletion finish.
async fn release_finalizers_unblocks_claims_after_uninstall(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp.clone(), SUITE, "release", "scripted").await?;
    w.start(&["--intent-record=claim-finalizer"])?;
    let class = w.class("flaky").param("fail", "transient").create().await?;
    w.claim("data").class(&class).create().await?;
    let claims = w.claims();
    w.wait("intent recorded", || async {
        let c = claims.get("data").await?;
        Ok(c.finalizers()
            .iter()
            .any(|f| f == OUR_FINALIZER)
            .then_some(()))
    })
    .await?;
    w.process.take().expect("running").kill();
    claims.delete("data", &DeleteParams::default()).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        claims.get_opt("data").await?.is_some(),
        "the finalizer holds a claim whose storage may exist"
    );
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args([
            "release-finalizers",
            "--all",
            "--provisioner",
            &w.provisioner,
        ])
        .arg("--kubeconfig")
        .arg(cp.provisioner_kubeconfig())
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "release-finalizers failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        stdout.contains(&format!("released claim {}/data", w.ns)),
        "{stdout}"
    );
    w.wait_claim_gone("data").await?;
    Ok(())
}

/// A claim cloning another gets its data (issue 34): a file written into the source's
/// directory is in the clone's; the source is let go once the copy is done.
async fn a_clone_holds_a_copy_of_its_source(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "clone", "hostpath").await?;
    w.start(&[])?;
    let class = w.class("fast").create().await?;
    w.claim("db").class(&class).create().await?;
    let source = w.wait_bound("db").await?;
    std::fs::create_dir(w.storage_of(&source.name_any()).join("tables"))?;
    std::fs::write(w.storage_of(&source.name_any()).join("tables/rows"), "42")?;
    let mut previous = "db".to_owned();
    // A clone of a clone of a clone.
    for copy in ["copy-1", "copy-2", "copy-3"] {
        w.claim(copy)
            .class(&class)
            .data_source("", "PersistentVolumeClaim", &previous)
            .create()
            .await?;
        let pv = w.wait_bound(copy).await?;
        let rows = std::fs::read_to_string(w.storage_of(&pv.name_any()).join("tables/rows"))?;
        ensure!(rows == "42", "{copy} holds {rows:?}");
        previous = copy.to_owned();
    }
    let live = w.claims().get("db").await?;
    ensure!(
        !live
            .finalizers()
            .iter()
            .any(|f| f == "wasm-provisioner.dev/clone-source"),
        "the source is let go: {:?}",
        live.finalizers()
    );
    Ok(())
}

/// A scripted world whose claim `copy` (class returned) clones the Bound claim `db` and whose
/// guest holds the copy under way while `clones.hold` (returned) exists; also the file the
/// guest recorded the source in once it started.
async fn clone_under_way(
    cp: Arc<ControlPlane>,
    name: &str,
) -> anyhow::Result<(World, String, std::path::PathBuf, std::path::PathBuf)> {
    let mut w = World::new(cp, SUITE, name, "scripted").await?;
    w.start(&[])?;
    let class = w.class("plain").create().await?;
    w.claim("db").class(&class).create().await?;
    w.wait_bound("db").await?;
    let hold = w.storage.path().join("clones.hold");
    std::fs::write(&hold, "")?;
    let copy = w
        .claim("copy")
        .class(&class)
        .data_source("", "PersistentVolumeClaim", "db")
        .create()
        .await?;
    let source_file = w.storage.path().join(format!("{}.source", pv_name(&copy)));
    w.wait_file("the clone's copy under way", &source_file)
        .await?;
    Ok((w, class, hold, source_file))
}

/// A source deleted while a guest copies it stays (Terminating, held by our finalizer) until the
/// copy returns, then goes; a snapshot restore is refused with no PV.
async fn a_source_deleted_during_its_copy_waits_for_it(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let (w, class, hold, source_file) = clone_under_way(cp, "clone-held").await?;
    w.claims().delete("db", &DeleteParams::default()).await?;
    let held = w.claims().get("db").await?;
    std::fs::remove_file(&hold)?;
    ensure!(
        held.metadata.deletion_timestamp.is_some()
            && held
                .finalizers()
                .iter()
                .any(|f| f == "wasm-provisioner.dev/clone-source"),
        "the source is held while it is copied: {:?}",
        held.metadata
    );
    w.wait_bound("copy").await?;
    w.wait_claim_gone("db").await?;
    let recorded = std::fs::read_to_string(&source_file)?;
    ensure!(recorded.starts_with(&format!("{}/db ", w.ns)), "{recorded}");

    let restore = w
        .claim("restore")
        .class(&class)
        .data_source("snapshot.storage.k8s.io", "VolumeSnapshot", "snap")
        .create()
        .await?;
    w.wait_event(
        &uid(&restore),
        "ProvisioningFailed",
        &["cannot copy from a VolumeSnapshot"],
    )
    .await?;
    ensure!(w.pvs().get_opt(&pv_name(&restore)).await?.is_none());
    Ok(())
}

/// A claim whose data source is a volume populator's kind is left to it: one Normal event, no
/// PV, no finalizer, and no second event when the claim is looked at again.
async fn a_populators_claim_is_left_to_it(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, SUITE, "populator", "hostpath").await?;
    w.start(&["--resync-period=2s"])?;
    let class = w.class("fast").create().await?;
    let claim = w
        .claim("populated")
        .class(&class)
        .data_source("hello.example.com", "Hello", "greeting")
        .create()
        .await?;
    w.wait_event(
        &uid(&claim),
        "LeftToPopulator",
        &["Hello (API group hello.example.com)"],
    )
    .await?;
    // Resyncs come and go: still one event, no PV, no finalizer.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let events = w.events(&uid(&claim)).await?;
    let left = events
        .iter()
        .filter(|(r, _)| r == "LeftToPopulator")
        .count();
    ensure!(left == 1, "{events:?}");
    ensure!(w.pvs().get_opt(&pv_name(&claim)).await?.is_none(), "a PV");
    let live = w.claims().get("populated").await?;
    ensure!(
        !live.finalizers().iter().any(|f| f == OUR_FINALIZER),
        "{:?}",
        live.finalizers()
    );
    Ok(())
}

/// A source left held by a provisioner that died during the copy is released by
/// `release-finalizers` (the uninstall path), so deleting it no longer waits.
async fn release_finalizers_lets_a_held_clone_source_go(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let (mut w, _, hold, _) = clone_under_way(cp.clone(), "release-source").await?;
    w.process.take().expect("running").kill();
    std::fs::remove_file(&hold)?;
    w.claims().delete("db", &DeleteParams::default()).await?;
    ensure!(
        w.claims().get_opt("db").await?.is_some(),
        "the clone-source finalizer holds the source"
    );
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args([
            "release-finalizers",
            "--all",
            "--provisioner",
            &w.provisioner,
        ])
        .arg("--kubeconfig")
        .arg(cp.provisioner_kubeconfig())
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success() && stdout.contains(&format!("released clone source {}/db", w.ns)),
        "release-finalizers: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    w.wait_claim_gone("db").await?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::suite::run(
        "end-to-end",
        &["hostpath"],
        Duration::from_secs(180),
        e2e_tests![
            provision_binds_claim_with_the_right_fields,
            deleting_the_claim_deletes_pv_and_storage,
            retain_keeps_the_released_pv_and_storage,
            a_class_created_after_its_claim_is_provisioned_once,
            final_failures_stop_at_the_threshold_even_across_resyncs,
            transient_failures_are_retried_until_success,
            a_denied_pv_create_cleans_up_the_storage,
            a_claim_deleted_while_the_guest_works_leaves_nothing,
            claims_with_the_same_name_over_time_get_their_own_volumes,
            claims_for_other_provisioners_are_never_touched,
            wait_for_first_consumer_waits_for_the_selected_node,
            reschedule_drops_the_selected_node,
            in_background_is_called_again_without_counting,
            block_claims_need_a_guest_that_supports_block,
            claims_with_a_selector_need_a_guest_that_declares_selectors,
            block_claims_are_provisioned_by_guests_that_support_block,
            a_failed_delete_is_reported_and_retried,
            guest_hooks_decide_last,
            pv_finalizer_mode_guards_the_volume_until_storage_is_gone,
            sigterm_lets_in_flight_work_finish,
            deleting_a_bound_pv_keeps_its_storage_until_the_claim_goes,
            a_refused_claim_can_be_deleted_after_uninstall,
            release_finalizers_unblocks_claims_after_uninstall,
            a_clone_holds_a_copy_of_its_source,
            a_source_deleted_during_its_copy_waits_for_it,
            a_populators_claim_is_left_to_it,
            release_finalizers_lets_a_held_clone_source_go,
            a_bound_claim_grows_when_it_asks_for_more,
            a_failed_growth_is_reported_retried_and_given_up,
            a_guest_fetched_from_its_source_provisions,
        ],
    )
}
