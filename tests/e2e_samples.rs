//! The sample guests (local-path, nfs-subdir) in the controller against a real control plane:
//! etcd + kube-apiserver + kube-controller-manager, the real binary, the shipped grant files.
//!
//! There is no scheduler and there are no nodes: WaitForFirstConsumer claims get their
//! `volume.kubernetes.io/selected-node` from the test (the PV controller then hands them to the
//! provisioner), and node affinity is checked on the PV object.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::DeleteParams;
use kube::{Api, ResourceExt};
use wp_harness::{ControlPlane, Process};

use common::e2e::{Fixture, affinity, pv_name, uid};
use common::{PluginsDir, shipped_grant};

/// One test's world: the fixture, the guest's storage, and its provisioner.
struct World {
    fx: Fixture,
    storage: tempfile::TempDir,
    _plugins: PluginsDir,
    process: Process,
}

fixture_world!(World);

impl World {
    /// Starts `wasm-provisioner run` with guest `dir` and its shipped grant file, serving a
    /// provisioner name of its own, its granted directory `host_dir` moved to a temporary one.
    async fn new(
        cp: Arc<ControlPlane>,
        name: &str,
        dir: &str,
        host_dir: &str,
    ) -> anyhow::Result<World> {
        let fx = Fixture::new(cp, "samples", name).await?;
        let storage = tempfile::tempdir()?;
        let storage_path = storage.path().display().to_string();
        let shipped_name = format!("\"wasm-provisioner.dev/{dir}\"");
        let grant = shipped_grant(
            dir,
            &[
                (host_dir, storage_path.as_str()),
                (shipped_name.as_str(), &format!("\"{}\"", fx.provisioner)),
            ],
        );
        let plugins = PluginsDir::new();
        plugins.add(dir, &dir.replace('-', "_"), &grant);
        let mut cmd = fx.provisioner_command(plugins.path(), fx.cp.provisioner_kubeconfig());
        // One replica per test: no lease to elect. The intent log lives where the
        // provisioner's Role is (deploy/rbac.yaml).
        cmd.arg("--leader-election=false")
            .args(["--leader-election-namespace", "wasm-provisioner"])
            .args(["--instance-name", name]);
        let process = fx.spawn("provisioner", cmd)?;
        Ok(World {
            fx,
            storage,
            _plugins: plugins,
            process,
        })
    }

    /// Deletes the claim and waits until its PV is gone.
    async fn delete_claim(&self, claim: &str, pv: &str) -> anyhow::Result<()> {
        self.claims()
            .delete(claim, &DeleteParams::default())
            .await?;
        self.wait_pv_gone(pv).await
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.storage.path().join(relative.trim_start_matches('/'))
    }
}

const LOCAL_NODES: &str = "/var/lib/wasm-provisioner/local-path/nodes";

async fn local_path_binds_on_the_selected_node_and_deletes_the_directory(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::new(cp, "lp-bind", "local-path", LOCAL_NODES).await?;
    let class = w
        .class("wffc")
        .wait_for_first_consumer()
        .allow_expansion()
        .create()
        .await?;
    let claim = w
        .claim("data")
        .class(&class)
        .selected_node(Some("node-a"))
        .create()
        .await?;
    let pv = w.wait_bound("data").await?;
    ensure!(pv.name_any() == pv_name(&claim));
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
    // The expansion hook: a claim asking for more grows (no limit to raise in a plain directory).
    w.resize("data", "3Gi").await?;
    w.wait_capacity("data", "3Gi").await?;
    w.wait_event(&uid(&claim), "VolumeResizeSuccessful", &["3Gi"])
        .await?;
    w.delete_claim("data", &pv.name_any()).await?;
    w.wait_until("directory removed with the PV", || !on_node.exists())
        .await?;
    Ok(())
}

async fn local_path_local_volumes_and_a_gone_node(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let w = World::new(cp, "lp-local", "local-path", LOCAL_NODES).await?;
    let class = w
        .class("local")
        .params(&[
            ("volumeType", "local"),
            ("pathPattern", "${pvc.namespace}/${pvc.name}"),
        ])
        .wait_for_first_consumer()
        .create()
        .await?;
    w.claim("data")
        .class(&class)
        .selected_node(Some("node-b"))
        .create()
        .await?;
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
    // The node's directory is no longer mounted here (issue 32): the guest cannot see where
    // the storage is, so the delete fails with an event and nothing is taken for gone (before:
    // "deleting the volume without cleanup", and the PV was deleted).
    let unmounted = w.path("node-b.unmounted");
    std::fs::rename(w.path("node-b"), &unmounted)?;
    let pv_uid = pv.metadata.uid.clone().unwrap_or_default();
    w.claims().delete("data", &DeleteParams::default()).await?;
    let message = w
        .wait_event(&pv_uid, "VolumeFailedDelete", &["not taken for gone"])
        .await?;
    println!("node directory missing: {message}");
    ensure!(
        unmounted.join(local.trim_start_matches('/')).is_dir(),
        "the storage stays"
    );
    ensure!(!w.process.log().contains("without cleanup"));
    Ok(())
}

const NFS_EXPORT: &str = "/persistentvolumes";

async fn nfs_subdir_binds_with_an_nfs_source_and_archives(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::new(cp, "nfs-archive", "nfs-subdir", NFS_EXPORT).await?;
    let class = w
        .class("default")
        .mount_options(&["nfsvers=4.1"])
        .allow_expansion()
        .create()
        .await?;
    let claim = w.claim("data").class(&class).create().await?;
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
    // No expansion hook: the class cannot grow, said once; the PV and claim stay as they are.
    w.resize("data", "2Gi").await?;
    w.wait_event(&uid(&claim), "VolumeResizeFailed", &["`expansion` hook"])
        .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let live = w.pvs().get(&pv.name_any()).await?;
    let capacity = &live
        .spec
        .as_ref()
        .context("spec")?
        .capacity
        .as_ref()
        .context("capacity")?;
    ensure!(capacity["storage"].0 == "1Gi", "{capacity:?}");
    let claimed = w.claims().get("data").await?.status.context("status")?;
    ensure!(
        claimed.capacity.context("capacity")?["storage"].0 == "1Gi",
        "the claim keeps its capacity"
    );
    w.delete_claim("data", &pv.name_any()).await?;
    w.wait_until("archived", || {
        !w.path(&dir).exists() && w.path(&format!("archived-{dir}")).is_dir()
    })
    .await?;
    Ok(())
}

async fn nfs_subdir_sub_folders_retain_and_delete_after_the_class_is_gone(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::new(cp, "nfs-ondelete", "nfs-subdir", NFS_EXPORT).await?;
    let pattern = ("pathPattern", "${pvc.namespace}/${pvc.name}");
    let archive = w.class("archive").params(&[pattern]).create().await?;
    let delete = w
        .class("delete")
        .params(&[pattern, ("onDelete", "delete")])
        .create()
        .await?;
    let retain = w
        .class("retain")
        .params(&[("onDelete", "retain"), ("archiveOnDelete", "false")])
        .create()
        .await?;
    w.claim("archived").class(&archive).create().await?;
    w.claim("deleted").class(&delete).create().await?;
    let kept = w.claim("kept").class(&retain).create().await?;
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
    w.wait_until("all three handled", || {
        !w.path(&w.ns).exists()
            && w.path(&format!("archived-{}-archived/file", w.ns))
                .is_file()
    })
    .await?;
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
