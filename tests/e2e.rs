//! The controller against a real control plane: etcd + kube-apiserver + kube-controller-manager
//! (binding, protection), the real `wasm-provisioner` binary, real guests from `guests/`.
//!
//! One control plane serves the whole suite; every test gets its own namespace, its own
//! provisioner name, its own storage directory and its own provisioner process, so tests run
//! side by side without seeing each other.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use wp_harness::{ControlPlane, Process, wait_for};

use common::PluginsDir;

const WAIT: Duration = Duration::from_secs(60);
const OUR_FINALIZER: &str = "wasm-provisioner.dev/provisioning";

/// One test's world: namespace, provisioner name, storage, plugins, and the provisioner process.
struct World {
    cp: Arc<ControlPlane>,
    admin: Client,
    name: String,
    ns: String,
    provisioner: String,
    storage: tempfile::TempDir,
    plugins: PluginsDir,
    process: Option<Process>,
    logs: PathBuf,
}

impl World {
    /// A world whose guest is `crate_name` from `guests/`.
    async fn new(cp: Arc<ControlPlane>, name: &str, crate_name: &str) -> anyhow::Result<World> {
        let admin = cp.admin_client().await?;
        let ns = format!("e2e-{name}");
        let namespaces: Api<Namespace> = Api::all(admin.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
            )
            .await
            .with_context(|| format!("create namespace {ns}"))?;
        let provisioner = format!("e2e.wasm-provisioner.dev/{name}");
        let storage = tempfile::tempdir()?;
        let plugins = PluginsDir::new();
        let (guest_dir, extra) = match crate_name {
            "hostpath" => ("/volumes", ""),
            _ => ("/state", ""),
        };
        plugins.add(
            crate_name,
            crate_name,
            &common::dir_grant(&provisioner, storage.path(), guest_dir, extra),
        );
        let logs = cp.run_dir().join(format!("provisioner-{name}"));
        Ok(World {
            cp,
            admin,
            name: name.into(),
            ns,
            provisioner,
            storage,
            plugins,
            process: None,
            logs,
        })
    }

    /// Starts `wasm-provisioner run` as the provisioner identity (or `kubeconfig`), fast retries.
    fn start_as(&mut self, kubeconfig: &Path, extra: &[&str]) -> anyhow::Result<()> {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"));
        cmd.args(["run", "--plugins"])
            .arg(self.plugins.path())
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args([
                "--retry-interval-start",
                "300ms",
                "--retry-interval-max",
                "2s",
            ])
            .args([
                "--create-pv-retry-count",
                "2",
                "--create-pv-retry-interval",
                "200ms",
            ])
            .args(["--instance-name", &self.name])
            // Election is on, as in production; each world has its own lease.
            .args(["--leader-election-namespace", "wasm-provisioner"])
            .args([
                "--leader-election-lease-name",
                &format!("e2e-{}", self.name),
            ])
            .args(extra)
            .env("RUST_LOG", "info,wasm_provisioner=debug");
        let n = std::fs::read_dir(self.cp.run_dir())
            .map(|d| d.count())
            .unwrap_or(0);
        self.process = Some(Process::spawn(
            cmd,
            self.logs.with_extension(format!("{n}.log")),
        )?);
        Ok(())
    }

    fn start(&mut self, extra: &[&str]) -> anyhow::Result<()> {
        let kubeconfig = self.cp.provisioner_kubeconfig().to_owned();
        self.start_as(&kubeconfig, extra)
    }

    fn log(&self) -> String {
        self.process.as_ref().map(|p| p.log()).unwrap_or_default()
    }

    fn class_name(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.name)
    }

    async fn create_class(
        &self,
        suffix: &str,
        params: &[(&str, &str)],
        reclaim: &str,
    ) -> anyhow::Result<String> {
        let name = self.class_name(suffix);
        let params: BTreeMap<&str, &str> = params.iter().copied().collect();
        let class: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": name},
            "provisioner": self.provisioner,
            "parameters": params,
            "reclaimPolicy": reclaim,
            "volumeBindingMode": "Immediate",
        }))?;
        Api::<StorageClass>::all(self.admin.clone())
            .create(&PostParams::default(), &class)
            .await?;
        Ok(name)
    }

    async fn create_wffc_class(
        &self,
        suffix: &str,
        params: &[(&str, &str)],
    ) -> anyhow::Result<String> {
        let name = self.class_name(suffix);
        let params: BTreeMap<&str, &str> = params.iter().copied().collect();
        let class: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": name},
            "provisioner": self.provisioner,
            "parameters": params,
            "volumeBindingMode": "WaitForFirstConsumer",
        }))?;
        Api::<StorageClass>::all(self.admin.clone())
            .create(&PostParams::default(), &class)
            .await?;
        Ok(name)
    }

    async fn create_claim_json(
        &self,
        claim: serde_json::Value,
    ) -> anyhow::Result<PersistentVolumeClaim> {
        let claim: PersistentVolumeClaim = serde_json::from_value(claim)?;
        Ok(self.claims().create(&PostParams::default(), &claim).await?)
    }

    /// Sets `volume.kubernetes.io/selected-node`, as the scheduler would.
    async fn select_node(&self, claim: &str, node: &str) -> anyhow::Result<()> {
        let patch =
            json!({"metadata": {"annotations": {"volume.kubernetes.io/selected-node": node}}});
        self.claims()
            .patch(
                claim,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }

    async fn wait_pv(&self, name: &str) -> anyhow::Result<PersistentVolume> {
        let pvs = self.pvs();
        wait_for(&format!("PV {name}"), WAIT, || async {
            Ok(pvs.get_opt(name).await?)
        })
        .await
        .with_context(|| self.log())
    }

    async fn create_claim(&self, name: &str, class: &str) -> anyhow::Result<PersistentVolumeClaim> {
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "storageClassName": class,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            }
        }))?;
        Ok(self.claims().create(&PostParams::default(), &claim).await?)
    }

    fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.admin.clone(), &self.ns)
    }

    fn pvs(&self) -> Api<PersistentVolume> {
        Api::all(self.admin.clone())
    }

    /// Waits until the claim is Bound and returns its PV.
    async fn wait_bound(&self, claim: &str) -> anyhow::Result<PersistentVolume> {
        let claims = self.claims();
        let pvs = self.pvs();
        let volume = wait_for(&format!("claim {claim} Bound"), WAIT, || async {
            let c = claims.get(claim).await?;
            let phase = c.status.as_ref().and_then(|s| s.phase.clone());
            Ok((phase.as_deref() == Some("Bound"))
                .then(|| c.spec.and_then(|s| s.volume_name))
                .flatten())
        })
        .await
        .with_context(|| self.log())?;
        Ok(pvs.get(&volume).await?)
    }

    async fn wait_pv_gone(&self, pv: &str) -> anyhow::Result<()> {
        let pvs = self.pvs();
        wait_for(&format!("PV {pv} deleted"), WAIT, || async {
            Ok(pvs.get_opt(pv).await?.is_none().then_some(()))
        })
        .await
        .with_context(|| self.log())
    }

    async fn wait_claim_gone(&self, claim: &str) -> anyhow::Result<()> {
        let claims = self.claims();
        wait_for(&format!("claim {claim} deleted"), WAIT, || async {
            Ok(claims.get_opt(claim).await?.is_none().then_some(()))
        })
        .await
        .with_context(|| self.log())
    }

    /// (reason, message) of every event about the object with this UID.
    async fn events(&self, uid: &str) -> anyhow::Result<Vec<(String, String)>> {
        let events: Api<Event> = Api::all(self.admin.clone());
        let list = events
            .list(&ListParams::default().fields(&format!("involvedObject.uid={uid}")))
            .await?;
        Ok(list
            .items
            .into_iter()
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
            .collect())
    }

    async fn wait_event(&self, uid: &str, reason: &str) -> anyhow::Result<String> {
        wait_for(&format!("event {reason}"), WAIT, || async {
            Ok(self
                .events(uid)
                .await?
                .into_iter()
                .find(|(r, _)| r == reason)
                .map(|(_, m)| m))
        })
        .await
        .with_context(|| self.log())
    }

    /// Lines of the scripted guest's call log.
    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.storage.path().join("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn storage_of(&self, pv_name: &str) -> PathBuf {
        self.storage.path().join(pv_name)
    }
}

fn uid(claim: &PersistentVolumeClaim) -> String {
    claim.metadata.uid.clone().unwrap_or_default()
}

async fn provision_binds_claim_with_the_right_fields(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "bind", "hostpath").await?;
    w.start(&[])?;
    let class = w.create_class("fast", &[], "Delete").await?;
    let claim = w.create_claim("data", &class).await?;
    let pv = w.wait_bound("data").await?;
    let spec = pv.spec.clone().unwrap();
    let expected_name = format!("pvc-{}", uid(&claim));
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
    let reasons: Vec<String> = w
        .events(&uid(&claim))
        .await?
        .into_iter()
        .map(|(r, _)| r)
        .collect();
    ensure!(
        reasons.contains(&"Provisioning".into())
            && reasons.contains(&"ProvisioningSucceeded".into()),
        "{reasons:?}"
    );
    Ok(())
}

async fn deleting_the_claim_deletes_pv_and_storage(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "delete", "hostpath").await?;
    w.start(&[])?;
    let class = w.create_class("fast", &[], "Delete").await?;
    w.create_claim("data", &class).await?;
    let pv = w.wait_bound("data").await?;
    let dir = w.storage_of(&pv.name_any());
    ensure!(dir.is_dir());
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_pv_gone(&pv.name_any()).await?;
    ensure!(!dir.exists(), "storage deleted with the PV");
    Ok(())
}

async fn retain_keeps_the_released_pv_and_storage(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "retain", "hostpath").await?;
    w.start(&[])?;
    let class = w.create_class("keep", &[], "Retain").await?;
    w.create_claim("data", &class).await?;
    let pv = w.wait_bound("data").await?;
    w.claims().delete("data", &DeleteParams::default()).await?;
    let pvs = w.pvs();
    let name = pv.name_any();
    wait_for("PV Released", WAIT, || async {
        let p = pvs.get(&name).await?;
        Ok((p.status.and_then(|s| s.phase).as_deref() == Some("Released")).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(pvs.get_opt(&name).await?.is_some(), "Retain keeps the PV");
    ensure!(w.storage_of(&name).is_dir(), "Retain keeps the storage");
    Ok(())
}

async fn a_class_created_after_its_claim_is_provisioned_once(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "late-class", "scripted").await?;
    w.start(&[])?;
    let class = w.class_name("late");
    let claim = w.create_claim("data", &class).await?;
    w.wait_event(&uid(&claim), "ProvisioningFailed")
        .await
        .context("missing class is reported")?;
    w.create_class("late", &[], "Delete").await?;
    let pv = w.wait_bound("data").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let provisions = w
        .calls()
        .iter()
        .filter(|l| l.starts_with("provision "))
        .count();
    ensure!(
        provisions == 1,
        "guest called {provisions} times: {:?}",
        w.calls()
    );
    ensure!(pv.name_any() == format!("pvc-{}", uid(&claim)));
    Ok(())
}

async fn final_failures_stop_at_the_threshold_even_across_resyncs(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "give-up", "scripted").await?;
    w.start(&["--failed-provision-threshold", "3", "--resync-period", "1s"])?;
    let class = w
        .create_class("broken", &[("fail", "final")], "Delete")
        .await?;
    let claim = w.create_claim("data", &class).await?;
    let failed = w.wait_event(&uid(&claim), "ProvisioningFailed").await?;
    ensure!(failed.contains("final error"), "{failed}");
    let given_up = w.wait_event(&uid(&claim), "ProvisioningGivenUp").await?;
    ensure!(given_up.contains("3 failed attempts"), "{given_up}");
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
    let mut w = World::new(cp, "transient", "scripted").await?;
    w.start(&["--failed-provision-threshold", "2"])?;
    let class = w
        .create_class(
            "flaky",
            &[("fail", "transient"), ("failTimes", "3")],
            "Delete",
        )
        .await?;
    let claim = w.create_claim("data", &class).await?;
    w.wait_bound("data").await?;
    let provisions = w
        .calls()
        .iter()
        .filter(|l| l.starts_with("provision "))
        .count();
    ensure!(
        provisions == 4,
        "3 transient failures then success, saw {provisions}"
    );
    let reasons: Vec<String> = w
        .events(&uid(&claim))
        .await?
        .into_iter()
        .map(|(r, _)| r)
        .collect();
    ensure!(
        !reasons.contains(&"ProvisioningGivenUp".into()),
        "transient errors do not count: {reasons:?}"
    );
    Ok(())
}

async fn a_denied_pv_create_cleans_up_the_storage(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp.clone(), "denied", "scripted").await?;
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
    let class = w.create_class("denied", &[], "Delete").await?;
    let claim = w.create_claim("data", &class).await?;
    let message = wait_for("PV-save failure event", WAIT, || async {
        Ok(w.events(&uid(&claim))
            .await?
            .into_iter()
            .find(|(r, m)| {
                r == "ProvisioningFailed" && m.contains("Error creating provisioned PV object")
            })
            .map(|(_, m)| m))
    })
    .await
    .with_context(|| w.log())?;
    ensure!(
        message.contains("forbidden") || message.contains("Forbidden"),
        "{message}"
    );
    let pv = format!("pvc-{}", uid(&claim));
    wait_for("storage cleaned up", WAIT, || async {
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
    let mut w = World::new(cp, "deleted-mid", "scripted").await?;
    w.start(&[])?;
    let class = w
        .create_class("slow", &[("delayMs", "3000")], "Delete")
        .await?;
    let claim = w.create_claim("data", &class).await?;
    let pv = format!("pvc-{}", uid(&claim));
    let marker = w.storage.path().join(format!("{pv}.started"));
    wait_for("guest started", WAIT, || async {
        Ok(marker.exists().then_some(()))
    })
    .await
    .with_context(|| w.log())?;
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_claim_gone("data").await?;
    // Usually the controller sees the deletion when the guest returns and deletes the new
    // storage at once; if its cache lags, the PV is created and reclaimed as Released instead.
    // Either way nothing may be left.
    let storage = w.storage_of(&pv);
    let pvs = w.pvs();
    wait_for("no orphaned storage and no PV", WAIT, || async {
        Ok((!storage.exists() && pvs.get_opt(&pv).await?.is_none()).then_some(()))
    })
    .await
    .with_context(|| w.log())?;
    Ok(())
}

async fn killed_between_guest_and_pv_create_ends_with_one_pv(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "killed", "scripted").await?;
    w.start(&[])?;
    // The guest creates the storage, then lingers: killing it now is the same as killing the
    // controller after the guest returned and before the PV was created.
    let class = w
        .create_class("slow", &[("delayMs", "4000")], "Delete")
        .await?;
    let claim = w.create_claim("data", &class).await?;
    let pv = format!("pvc-{}", uid(&claim));
    let marker = w.storage.path().join(format!("{pv}.started"));
    wait_for("guest started", WAIT, || async {
        Ok(marker.exists().then_some(()))
    })
    .await
    .with_context(|| w.log())?;
    ensure!(w.storage_of(&pv).is_dir(), "storage exists before the PV");
    w.process.as_mut().unwrap().kill();
    w.start(&[])?;
    let bound = w.wait_bound("data").await?;
    ensure!(bound.name_any() == pv);
    let ours: Vec<String> = w
        .pvs()
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.claim_ref.as_ref())
                .and_then(|r| r.uid.clone())
                == claim.metadata.uid
        })
        .map(|p| p.name_any())
        .collect();
    ensure!(ours == vec![pv.clone()], "exactly one PV: {ours:?}");
    Ok(())
}

async fn killed_then_claim_deleted_while_down_leaves_no_storage(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "killed-deleted", "scripted").await?;
    w.start(&[])?;
    let class = w
        .create_class("slow", &[("delayMs", "4000")], "Delete")
        .await?;
    let claim = w.create_claim("data", &class).await?;
    let pv = format!("pvc-{}", uid(&claim));
    let marker = w.storage.path().join(format!("{pv}.started"));
    wait_for("guest started", WAIT, || async {
        Ok(marker.exists().then_some(()))
    })
    .await
    .with_context(|| w.log())?;
    w.process.as_mut().unwrap().kill();
    w.claims().delete("data", &DeleteParams::default()).await?;
    // The default intent record is the log: the claim carries nothing of ours and goes at once.
    w.wait_claim_gone("data").await?;
    ensure!(
        w.storage_of(&pv).exists(),
        "storage left behind by the crash"
    );
    w.start(&[])?;
    let storage = w.storage_of(&pv);
    wait_for(
        "the restarted controller deleted the storage",
        WAIT,
        || async { Ok((!storage.exists()).then_some(())) },
    )
    .await
    .with_context(|| w.log())?;
    ensure!(w.pvs().get_opt(&pv).await?.is_none());
    Ok(())
}

/// The same crash with the intent on the claim itself (`--intent-record=claim-finalizer`, the
/// record of per-claim and node modes): the finalizer holds the claim until the cleanup is done.
async fn killed_then_claim_deleted_while_down_with_claim_finalizer(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "killed-deleted-cf", "scripted").await?;
    let mode = ["--intent-record=claim-finalizer"];
    w.start(&mode)?;
    let class = w
        .create_class("slow", &[("delayMs", "4000")], "Delete")
        .await?;
    let claim = w.create_claim("data", &class).await?;
    let pv = format!("pvc-{}", uid(&claim));
    let marker = w.storage.path().join(format!("{pv}.started"));
    wait_for("guest started", WAIT, || async {
        Ok(marker.exists().then_some(()))
    })
    .await
    .with_context(|| w.log())?;
    w.process.as_mut().unwrap().kill();
    w.claims().delete("data", &DeleteParams::default()).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(
        w.claims().get_opt("data").await?.is_some(),
        "our finalizer holds the claim while nobody cleans up"
    );
    w.start(&mode)?;
    w.wait_claim_gone("data").await?;
    ensure!(
        !w.storage_of(&pv).exists(),
        "the restarted controller deleted the storage"
    );
    ensure!(w.pvs().get_opt(&pv).await?.is_none());
    Ok(())
}

async fn claims_with_the_same_name_over_time_get_their_own_volumes(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "same-name", "scripted").await?;
    w.start(&[])?;
    let class = w.create_class("c", &[], "Delete").await?;
    let first = w.create_claim("data", &class).await?;
    let pv1 = w.wait_bound("data").await?;
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_claim_gone("data").await?;
    w.wait_pv_gone(&pv1.name_any()).await?;
    let second = w.create_claim("data", &class).await?;
    let pv2 = w.wait_bound("data").await?;
    ensure!(first.metadata.uid != second.metadata.uid);
    ensure!(
        pv2.name_any() == format!("pvc-{}", uid(&second)),
        "new PV for the new claim"
    );
    ensure!(!w.storage_of(&pv1.name_any()).exists() && w.storage_of(&pv2.name_any()).is_dir());
    Ok(())
}

async fn claims_for_other_provisioners_are_never_touched(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "other", "scripted").await?;
    w.start(&[])?;
    let class: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "e2e-other-foreign"},
        "provisioner": "example.com/someone-else",
    }))?;
    Api::<StorageClass>::all(w.admin.clone())
        .create(&PostParams::default(), &class)
        .await?;
    let claim = w.create_claim("data", "e2e-other-foreign").await?;
    // Make sure our provisioner is up and working, then look at the foreign claim.
    let ours = w.create_class("ours", &[], "Delete").await?;
    w.create_claim("mine", &ours).await?;
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
    let reasons: Vec<String> = w
        .events(&uid(&claim))
        .await?
        .into_iter()
        .map(|(r, _)| r)
        .collect();
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
    let mut w = World::new(cp, "wffc", "hostpath").await?;
    w.start(&[])?;
    let class = w.create_wffc_class("local", &[]).await?;
    let claim = w.create_claim("data", &class).await?;
    let pv = format!("pvc-{}", uid(&claim));
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        w.pvs().get_opt(&pv).await?.is_none(),
        "nothing before the scheduler picks a node"
    );
    w.select_node("data", "node-a").await?;
    let volume = w.wait_pv(&pv).await?;
    let affinity = serde_json::to_value(volume.spec.unwrap().node_affinity)?;
    ensure!(
        affinity["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"][0]
            == "node-a",
        "node affinity to the selected node: {affinity}"
    );
    Ok(())
}

async fn reschedule_drops_the_selected_node(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "reschedule", "scripted").await?;
    // The claim carries the intent in this mode: the reschedule must drop it with the node.
    w.start(&["--intent-record=claim-finalizer"])?;
    let class = w
        .create_wffc_class("local", &[("fail", "reschedule")])
        .await?;
    let claim = w.create_claim("data", &class).await?;
    w.select_node("data", "node-a").await?;
    let message = w.wait_event(&uid(&claim), "ProvisioningFailed").await?;
    ensure!(message.contains("reschedule"), "{message}");
    let claims = w.claims();
    wait_for("selected-node removed", WAIT, || async {
        let c = claims.get("data").await?;
        Ok((!c
            .annotations()
            .contains_key("volume.kubernetes.io/selected-node"))
        .then_some(()))
    })
    .await
    .with_context(|| w.log())?;
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
    let mut w = World::new(cp, "background", "scripted").await?;
    w.start(&["--failed-provision-threshold", "1"])?;
    let class = w
        .create_class(
            "bg",
            &[("fail", "in-background"), ("failTimes", "2")],
            "Delete",
        )
        .await?;
    let claim = w.create_claim("data", &class).await?;
    w.wait_bound("data").await?;
    let provisions = w
        .calls()
        .iter()
        .filter(|l| l.starts_with("provision "))
        .count();
    ensure!(
        provisions == 3,
        "two in-background answers then success, saw {provisions}"
    );
    let reasons: Vec<String> = w
        .events(&uid(&claim))
        .await?
        .into_iter()
        .map(|(r, _)| r)
        .collect();
    ensure!(
        !reasons.contains(&"ProvisioningGivenUp".into()),
        "{reasons:?}"
    );
    Ok(())
}

async fn block_claims_need_a_guest_that_supports_block(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "block", "hostpath").await?;
    w.start(&[])?;
    let class = w.create_class("fs-only", &[], "Delete").await?;
    let claim = w
        .create_claim_json(json!({
            "metadata": {"name": "raw", "namespace": w.ns},
            "spec": {"storageClassName": class, "volumeMode": "Block", "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}},
        }))
        .await?;
    let message = w.wait_event(&uid(&claim), "ProvisioningFailed").await?;
    ensure!(message.contains("does not support block"), "{message}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        w.pvs()
            .get_opt(&format!("pvc-{}", uid(&claim)))
            .await?
            .is_none()
    );
    Ok(())
}

async fn block_claims_are_provisioned_by_guests_that_support_block(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "block-ok", "scripted").await?;
    w.start(&[])?;
    let class = w.create_class("raw", &[], "Delete").await?;
    w.create_claim_json(json!({
        "metadata": {"name": "raw", "namespace": w.ns},
        "spec": {"storageClassName": class, "volumeMode": "Block", "accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .await?;
    let pv = w.wait_bound("raw").await?;
    ensure!(pv.spec.unwrap().volume_mode.as_deref() == Some("Block"));
    Ok(())
}

async fn a_failed_delete_is_reported_and_retried(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "delete-fails", "scripted").await?;
    w.start(&[])?;
    let class = w
        .create_class(
            "c",
            &[("deleteFail", "final"), ("deleteFailTimes", "1")],
            "Delete",
        )
        .await?;
    w.create_claim("data", &class).await?;
    let pv = w.wait_bound("data").await?;
    let pv_uid = pv.metadata.uid.clone().unwrap_or_default();
    w.claims().delete("data", &DeleteParams::default()).await?;
    let message = w.wait_event(&pv_uid, "VolumeFailedDelete").await?;
    ensure!(message.contains("final error"), "{message}");
    w.wait_pv_gone(&pv.name_any()).await?;
    ensure!(!w.storage_of(&pv.name_any()).exists());
    let deletes = w
        .calls()
        .iter()
        .filter(|l| l.starts_with("delete "))
        .count();
    ensure!(
        deletes == 2,
        "one failed delete, one retry: {:?}",
        w.calls()
    );
    Ok(())
}

async fn guest_hooks_decide_last(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "hooks", "scripted").await?;
    w.start(&[])?;
    let class = w
        .create_class("kept", &[("keep", "true")], "Delete")
        .await?;
    let skipped = w
        .create_claim_json(json!({
            "metadata": {"name": "skipped", "namespace": w.ns,
                         "annotations": {"scripted.wasm-provisioner.dev/skip": "true"}},
            "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}},
        }))
        .await?;
    w.create_claim("kept", &class).await?;
    let pv = w.wait_bound("kept").await?;
    w.claims().delete("kept", &DeleteParams::default()).await?;
    let pvs = w.pvs();
    let name = pv.name_any();
    wait_for("PV Released", WAIT, || async {
        let p = pvs.get(&name).await?;
        Ok((p.status.and_then(|s| s.phase).as_deref() == Some("Released")).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        pvs.get_opt(&name).await?.is_some(),
        "should-delete = false keeps the PV"
    );
    ensure!(w.storage_of(&name).is_dir(), "and its storage");
    let live = w.claims().get("skipped").await?;
    ensure!(
        live.spec.as_ref().unwrap().volume_name.is_none(),
        "should-provision = false leaves the claim"
    );
    ensure!(
        w.pvs()
            .get_opt(&format!("pvc-{}", uid(&skipped)))
            .await?
            .is_none()
    );
    Ok(())
}

async fn pv_finalizer_mode_guards_the_volume_until_storage_is_gone(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "pv-finalizer", "scripted").await?;
    w.start(&["--add-pv-finalizer"])?;
    let class = w.create_class("c", &[], "Delete").await?;
    w.create_claim("data", &class).await?;
    let pv = w.wait_bound("data").await?;
    let pvs = w.pvs();
    let name = pv.name_any();
    wait_for("PV finalizer added", WAIT, || async {
        let p = pvs.get(&name).await?;
        Ok(p.finalizers()
            .iter()
            .any(|f| f == "external-provisioner.volume.kubernetes.io/finalizer")
            .then_some(()))
    })
    .await
    .with_context(|| w.log())?;
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_pv_gone(&name).await?;
    ensure!(
        !w.storage_of(&name).exists(),
        "storage deleted before the finalizer came off"
    );
    Ok(())
}

async fn sigterm_lets_in_flight_work_finish(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "sigterm", "scripted").await?;
    w.start(&[])?;
    let class = w
        .create_class("slow", &[("delayMs", "2000")], "Delete")
        .await?;
    let claim = w.create_claim("data", &class).await?;
    let pv = format!("pvc-{}", uid(&claim));
    let marker = w.storage.path().join(format!("{pv}.started"));
    wait_for("guest started", WAIT, || async {
        Ok(marker.exists().then_some(()))
    })
    .await
    .with_context(|| w.log())?;
    let status = w.process.as_mut().unwrap().terminate()?;
    ensure!(
        status.success(),
        "exit 0 after SIGTERM, got {status}: {}",
        w.log()
    );
    ensure!(
        w.pvs().get_opt(&pv).await?.is_some(),
        "the in-flight provision finished: {}",
        w.log()
    );
    Ok(())
}

/// `kubectl delete pv` on a Bound volume in `--add-pv-finalizer` mode: pv-protection holds the PV
/// while its claim (and a pod) use it, and so does the storage; once the claim goes, both go.
async fn deleting_a_bound_pv_keeps_its_storage_until_the_claim_goes(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "bound-pv-delete", "scripted").await?;
    w.start(&["--add-pv-finalizer"])?;
    let class = w.create_class("c", &[], "Delete").await?;
    w.create_claim("data", &class).await?;
    let pv = w.wait_bound("data").await?;
    let pvs = w.pvs();
    let name = pv.name_any();
    wait_for("PV finalizer added", WAIT, || async {
        let p = pvs.get(&name).await?;
        Ok(p.finalizers()
            .iter()
            .any(|f| f == "external-provisioner.volume.kubernetes.io/finalizer")
            .then_some(()))
    })
    .await
    .with_context(|| w.log())?;
    pvs.delete(&name, &DeleteParams::default()).await?;
    // Several reconciles of the PV being deleted (each update and a resync) pass meanwhile.
    tokio::time::sleep(Duration::from_secs(4)).await;
    ensure!(
        w.storage_of(&name).exists(),
        "storage deleted while its claim is still bound: {}",
        w.log()
    );
    ensure!(
        !w.calls().iter().any(|c| c.starts_with("delete ")),
        "the guest was asked to delete bound storage: {:?}",
        w.calls()
    );
    w.claims().delete("data", &DeleteParams::default()).await?;
    w.wait_pv_gone(&name).await?;
    ensure!(
        !w.storage_of(&name).exists(),
        "storage left after the claim went"
    );
    Ok(())
}

/// A claim the guest refuses for good holds no finalizer of ours: once the provisioner is gone,
/// deleting it (and its namespace) does not hang.
async fn a_refused_claim_can_be_deleted_after_uninstall(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "refused-uninstall", "scripted").await?;
    w.start(&[
        "--failed-provision-threshold",
        "1",
        "--intent-record=claim-finalizer",
    ])?;
    let class = w
        .create_class("broken", &[("fail", "final")], "Delete")
        .await?;
    let claim = w.create_claim("data", &class).await?;
    w.wait_event(&uid(&claim), "ProvisioningGivenUp").await?;
    let claims = w.claims();
    wait_for("finalizer released", WAIT, || async {
        let c = claims.get("data").await?;
        Ok((!c.finalizers().iter().any(|f| f == OUR_FINALIZER)).then_some(()))
    })
    .await
    .with_context(|| w.log())?;
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
    let mut w = World::new(cp.clone(), "release", "scripted").await?;
    w.start(&["--intent-record=claim-finalizer"])?;
    let class = w
        .create_class("flaky", &[("fail", "transient")], "Delete")
        .await?;
    w.create_claim("data", &class).await?;
    let claims = w.claims();
    wait_for("intent recorded", WAIT, || async {
        let c = claims.get("data").await?;
        Ok(c.finalizers()
            .iter()
            .any(|f| f == OUR_FINALIZER)
            .then_some(()))
    })
    .await
    .with_context(|| w.log())?;
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
            killed_between_guest_and_pv_create_ends_with_one_pv,
            killed_then_claim_deleted_while_down_leaves_no_storage,
            killed_then_claim_deleted_while_down_with_claim_finalizer,
            claims_with_the_same_name_over_time_get_their_own_volumes,
            claims_for_other_provisioners_are_never_touched,
            wait_for_first_consumer_waits_for_the_selected_node,
            reschedule_drops_the_selected_node,
            in_background_is_called_again_without_counting,
            block_claims_need_a_guest_that_supports_block,
            block_claims_are_provisioned_by_guests_that_support_block,
            a_failed_delete_is_reported_and_retried,
            guest_hooks_decide_last,
            pv_finalizer_mode_guards_the_volume_until_storage_is_gone,
            sigterm_lets_in_flight_work_finish,
            deleting_a_bound_pv_keeps_its_storage_until_the_claim_goes,
            a_refused_claim_can_be_deleted_after_uninstall,
            release_finalizers_unblocks_claims_after_uninstall,
        ],
    )
}
