//! Issue 32: a delete cannot succeed for storage the guest cannot see. The grant's directory
//! moves while volumes lie in it; deleting their claims must not delete their PVs silently.

use std::sync::Arc;

use anyhow::ensure;
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::Api;
use kube::api::DeleteParams;
use wp_harness::ControlPlane;

use super::World;

/// The hostpath guest serves four volumes; the operator then points its grant at another
/// directory (the volumes stay in the old one) and the plugin reloads. Before, each delete
/// answered "already gone": 4 of 4 PVs deleted, their data left, no event. Now each gets a
/// `VolumeFailedDelete` event naming the path outside the current grants, the data stays, and
/// `release-finalizers --dry-run` lists every one.
pub async fn a_moved_grant_never_lets_a_delete_pass_for_gone(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "moved-grant").await?;
    w.install_good()?;
    w.start(&[])?;
    let class = w.create_class("good", "good", &[]).await?;
    let pvs: Api<PersistentVolume> = Api::all(w.admin.clone());
    let mut volumes = Vec::new();
    for i in 0..4 {
        let uid = w.create_claim(&format!("data-{i}"), &class).await?;
        w.wait_bound(&format!("data-{i}")).await?;
        let pv = format!("pvc-{uid}");
        let pv_uid = pvs.get(&pv).await?.metadata.uid.unwrap_or_default();
        let data = w.storage("good").join(&pv).join("data");
        std::fs::write(&data, b"keep me")?;
        volumes.push((format!("data-{i}"), pv, pv_uid, data));
    }
    let old = w.storage("good").display().to_string();
    let moved = w.root.path().join("storage").join("good-moved");
    std::fs::create_dir_all(&moved)?;
    let grant = std::fs::read_to_string(w.plugins.join("good.toml"))?;
    std::fs::write(
        w.plugins.join("good.toml"),
        grant.replace(&old, &moved.display().to_string()),
    )?;
    w.wait("the moved grant reloaded", || async {
        Ok(w.log().contains("plugin reloaded").then_some(()))
    })
    .await?;
    for (claim, _, _, _) in &volumes {
        w.claims().delete(claim, &DeleteParams::default()).await?;
    }
    for (_, pv, pv_uid, data) in &volumes {
        let path = format!("{old}/{pv}");
        let message = w
            .wait_event(
                pv_uid,
                "VolumeFailedDelete",
                &["outside the guest's current grants", &path],
            )
            .await?;
        println!("{pv}: {message}");
        ensure!(data.exists(), "the data of {pv} stays");
    }
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args(["release-finalizers", "--all", "--dry-run", "--provisioner"])
        .arg(w.provisioner_of("good"))
        .args(["-n", "wasm-provisioner"])
        .arg("--kubeconfig")
        .arg(w.cp.provisioner_kubeconfig())
        .output()?;
    let listed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(output.status.success(), "release-finalizers: {listed}");
    println!("release-finalizers --dry-run:\n{listed}");
    for (_, pv, _, data) in &volumes {
        ensure!(listed.contains(pv.as_str()), "{pv} listed: {listed}");
        ensure!(data.exists(), "the data of {pv} stays");
    }
    Ok(())
}
