//! The sample guests (local-path, nfs-subdir) in the controller against a real control plane:
//! etcd + kube-apiserver + kube-controller-manager, the real binary, the shipped grant files.
//!
//! There is no scheduler and there are no nodes: WaitForFirstConsumer claims get their
//! `volume.kubernetes.io/selected-node` from the test (the PV controller then hands them to the
//! provisioner), and node affinity is checked on the PV object.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use wp_harness::{ControlPlane, Process, wait_for};

use common::{PluginsDir, shipped_grant};

const WAIT: Duration = Duration::from_secs(60);

/// One test's world: namespace, provisioner name, the guest's storage, and its provisioner.
struct World {
    admin: Client,
    name: String,
    ns: String,
    provisioner: String,
    storage: tempfile::TempDir,
    _plugins: PluginsDir,
    process: Process,
}

impl World {
    /// Starts `wasm-provisioner run` with guest `dir` and its shipped grant file, serving a
    /// provisioner name of its own, its granted directory `host_dir` moved to a temporary one.
    async fn new(
        cp: Arc<ControlPlane>,
        name: &str,
        dir: &str,
        host_dir: &str,
    ) -> anyhow::Result<World> {
        let admin = cp.admin_client().await?;
        let ns = format!("samples-{name}");
        Api::<Namespace>::all(admin.clone())
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
            )
            .await
            .with_context(|| format!("create namespace {ns}"))?;
        let provisioner = format!("samples.wasm-provisioner.dev/{name}");
        let storage = tempfile::tempdir()?;
        let storage_path = storage.path().display().to_string();
        let shipped_name = format!("\"wasm-provisioner.dev/{dir}\"");
        let grant = shipped_grant(
            dir,
            &[
                (host_dir, storage_path.as_str()),
                (shipped_name.as_str(), &format!("\"{provisioner}\"")),
            ],
        );
        let plugins = PluginsDir::new();
        plugins.add(dir, &dir.replace('-', "_"), &grant);
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"));
        cmd.args(["run", "--plugins"])
            .arg(plugins.path())
            .arg("--kubeconfig")
            .arg(cp.provisioner_kubeconfig())
            // One replica per test: no lease to elect.
            .arg("--leader-election=false")
            // The intent log lives where the provisioner's Role is (deploy/rbac.yaml).
            .args(["--leader-election-namespace", "wasm-provisioner"])
            .args([
                "--retry-interval-start",
                "300ms",
                "--retry-interval-max",
                "2s",
            ])
            .args(["--instance-name", name])
            .env("RUST_LOG", "info,wasm_provisioner=debug");
        let process = Process::spawn(cmd, cp.run_dir().join(format!("samples-{name}.log")))?;
        Ok(World {
            admin,
            name: name.into(),
            ns,
            provisioner,
            storage,
            _plugins: plugins,
            process,
        })
    }

    async fn create_class(
        &self,
        suffix: &str,
        params: &[(&str, &str)],
        binding: &str,
        mount_options: &[&str],
    ) -> anyhow::Result<String> {
        let name = format!("samples-{}-{suffix}", self.name);
        let params: BTreeMap<&str, &str> = params.iter().copied().collect();
        let class: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": name},
            "provisioner": self.provisioner,
            "parameters": params,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": binding,
            "mountOptions": mount_options,
        }))?;
        Api::<StorageClass>::all(self.admin.clone())
            .create(&PostParams::default(), &class)
            .await?;
        Ok(name)
    }

    /// A 1Gi ReadWriteOnce claim; `node` plays the scheduler's selected-node annotation.
    async fn create_claim(
        &self,
        name: &str,
        class: &str,
        node: Option<&str>,
    ) -> anyhow::Result<PersistentVolumeClaim> {
        let annotations: BTreeMap<&str, &str> = node
            .map(|n| ("volume.kubernetes.io/selected-node", n))
            .into_iter()
            .collect();
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": self.ns, "annotations": annotations},
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

    async fn wait_bound(&self, claim: &str) -> anyhow::Result<PersistentVolume> {
        let claims = self.claims();
        let volume = wait_for(&format!("claim {claim} Bound"), WAIT, || async {
            let c = claims.get(claim).await?;
            let bound = c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
            Ok(bound.then(|| c.spec.and_then(|s| s.volume_name)).flatten())
        })
        .await
        .with_context(|| self.process.log())?;
        Ok(self.pvs().get(&volume).await?)
    }

    /// Deletes the claim and waits until its PV is gone.
    async fn delete_claim(&self, claim: &str, pv: &str) -> anyhow::Result<()> {
        self.claims()
            .delete(claim, &DeleteParams::default())
            .await?;
        let pvs = self.pvs();
        wait_for(&format!("PV {pv} deleted"), WAIT, || async {
            Ok(pvs.get_opt(pv).await?.is_none().then_some(()))
        })
        .await
        .with_context(|| self.process.log())
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.storage.path().join(relative.trim_start_matches('/'))
    }
}

fn uid(claim: &PersistentVolumeClaim) -> String {
    claim.metadata.uid.clone().unwrap_or_default()
}

/// The PV's required node affinity as (key, values) pairs.
fn affinity(pv: &PersistentVolume) -> Vec<(String, Vec<String>)> {
    pv.spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
        .map(|r| {
            r.node_selector_terms
                .iter()
                .flat_map(|t| t.match_expressions.iter().flatten())
                .map(|e| (e.key.clone(), e.values.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

const LOCAL_NODES: &str = "/var/lib/wasm-provisioner/local-path/nodes";

async fn local_path_binds_on_the_selected_node_and_deletes_the_directory(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::new(cp, "lp-bind", "local-path", LOCAL_NODES).await?;
    let class = w
        .create_class("wffc", &[], "WaitForFirstConsumer", &[])
        .await?;
    let claim = w.create_claim("data", &class, Some("node-a")).await?;
    let pv = w.wait_bound("data").await?;
    ensure!(pv.name_any() == format!("pvc-{}", uid(&claim)));
    let path = pv
        .spec
        .as_ref()
        .and_then(|s| s.host_path.as_ref())
        .map(|h| h.path.clone())
        .context("hostPath")?;
    let expected = format!(
        "/opt/local-path-provisioner/pvc-{}_{}_data",
        uid(&claim),
        w.ns
    );
    ensure!(path == expected, "hostPath {path}, expected {expected}");
    ensure!(
        affinity(&pv)
            == vec![(
                "kubernetes.io/hostname".to_string(),
                vec!["node-a".to_string()]
            )],
        "{:?}",
        affinity(&pv)
    );
    ensure!(
        pv.annotations()
            .get("local-path.wasm-provisioner.dev/node")
            .map(String::as_str)
            == Some("node-a")
    );
    let on_node = w.path(&format!("node-a{path}"));
    ensure!(on_node.is_dir(), "{} created", on_node.display());
    w.delete_claim("data", &pv.name_any()).await?;
    ensure!(!on_node.exists(), "directory removed with the PV");
    Ok(())
}

async fn local_path_local_volumes_and_a_gone_node(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let w = World::new(cp, "lp-local", "local-path", LOCAL_NODES).await?;
    let class = w
        .create_class(
            "local",
            &[
                ("volumeType", "local"),
                ("pathPattern", "${pvc.namespace}/${pvc.name}"),
            ],
            "WaitForFirstConsumer",
            &[],
        )
        .await?;
    w.create_claim("data", &class, Some("node-b")).await?;
    let pv = w.wait_bound("data").await?;
    let local = pv
        .spec
        .as_ref()
        .and_then(|s| s.local.as_ref())
        .map(|l| l.path.clone())
        .context("local source")?;
    ensure!(
        local == format!("/opt/local-path-provisioner/{}/data", w.ns),
        "local path {local}"
    );
    ensure!(
        affinity(&pv)
            == vec![(
                "kubernetes.io/hostname".to_string(),
                vec!["node-b".to_string()]
            )]
    );
    ensure!(w.path(&format!("node-b{local}")).is_dir());
    // The node goes away, and its directory with it: the PV is deleted without cleanup.
    std::fs::remove_dir_all(w.path("node-b"))?;
    w.delete_claim("data", &pv.name_any()).await?;
    ensure!(
        w.process.log().contains("without cleanup"),
        "the guest said why"
    );
    Ok(())
}

const NFS_EXPORT: &str = "/persistentvolumes";

async fn nfs_subdir_binds_with_an_nfs_source_and_archives(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::new(cp, "nfs-archive", "nfs-subdir", NFS_EXPORT).await?;
    let class = w
        .create_class("default", &[], "Immediate", &["nfsvers=4.1"])
        .await?;
    let claim = w.create_claim("data", &class, None).await?;
    let pv = w.wait_bound("data").await?;
    let spec = pv.spec.clone().context("spec")?;
    let nfs = spec.nfs.context("nfs source")?;
    let dir = format!("{}-data-pvc-{}", w.ns, uid(&claim));
    ensure!(nfs.server == "nfs.example.com", "server {}", nfs.server);
    ensure!(
        nfs.path == format!("/srv/nfs/k8s/{dir}"),
        "path {}",
        nfs.path
    );
    ensure!(
        spec.mount_options == Some(vec!["nfsvers=4.1".to_string()]),
        "{:?}",
        spec.mount_options
    );
    ensure!(w.path(&dir).is_dir());
    w.delete_claim("data", &pv.name_any()).await?;
    ensure!(
        !w.path(&dir).exists() && w.path(&format!("archived-{dir}")).is_dir(),
        "archived"
    );
    Ok(())
}

async fn nfs_subdir_sub_folders_retain_and_delete_after_the_class_is_gone(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::new(cp, "nfs-ondelete", "nfs-subdir", NFS_EXPORT).await?;
    let pattern = ("pathPattern", "${pvc.namespace}/${pvc.name}");
    let archive = w
        .create_class("archive", &[pattern], "Immediate", &[])
        .await?;
    let delete = w
        .create_class(
            "delete",
            &[pattern, ("onDelete", "delete")],
            "Immediate",
            &[],
        )
        .await?;
    let retain = w
        .create_class(
            "retain",
            &[("onDelete", "retain"), ("archiveOnDelete", "false")],
            "Immediate",
            &[],
        )
        .await?;
    w.create_claim("archived", &archive, None).await?;
    w.create_claim("deleted", &delete, None).await?;
    let kept = w.create_claim("kept", &retain, None).await?;
    let archived_pv = w.wait_bound("archived").await?;
    let deleted_pv = w.wait_bound("deleted").await?;
    let kept_pv = w.wait_bound("kept").await?;
    std::fs::write(w.path(&format!("{}/archived/file", w.ns)), b"data")?;
    // Deleting never reads the class: remove them all first (the original fails here).
    let classes: Api<StorageClass> = Api::all(w.admin.clone());
    for class in [&archive, &delete, &retain] {
        classes.delete(class, &DeleteParams::default()).await?;
    }
    w.delete_claim("archived", &archived_pv.name_any()).await?;
    w.delete_claim("deleted", &deleted_pv.name_any()).await?;
    w.delete_claim("kept", &kept_pv.name_any()).await?;
    ensure!(
        w.path(&format!("archived-{}-archived/file", w.ns))
            .is_file(),
        "sub-folder archived with its data"
    );
    ensure!(
        !w.path(&format!("{}/deleted", w.ns)).exists(),
        "onDelete: delete removed it"
    );
    ensure!(
        !w.path(&w.ns).exists(),
        "the empty namespace folder was pruned"
    );
    let kept_dir = format!("{}-kept-pvc-{}", w.ns, uid(&kept));
    ensure!(
        w.path(&kept_dir).is_dir(),
        "onDelete: retain kept {kept_dir}"
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::suite::run(
        "sample-guest end-to-end",
        &["local_path"],
        Duration::from_secs(180),
        e2e_tests![
            local_path_binds_on_the_selected_node_and_deletes_the_directory,
            local_path_local_volumes_and_a_gone_node,
            nfs_subdir_binds_with_an_nfs_source_and_archives,
            nfs_subdir_sub_folders_retain_and_delete_after_the_class_is_gone,
        ],
    )
}
