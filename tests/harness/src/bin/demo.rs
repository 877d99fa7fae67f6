//! The README's demo: a local control plane, the provisioner with the hostpath guest, real claims
//! provisioned, bound, deleted, and their directories gone. Prints what happens as it goes.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use wp_harness::{ControlPlane, Process, demo_inputs, repo_root, step, wait_for};

const PROVISIONER: &str = "wasm-provisioner.dev/hostpath";
const CLAIMS: [(&str, &str); 3] = [("web-data", "1Gi"), ("db-data", "5Gi"), ("cache", "512Mi")];

fn list_dir(dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    if names.is_empty() {
        "(empty)".into()
    } else {
        names.join("  ")
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let started = Instant::now();
    let repo = repo_root();
    let (binary, guest) = demo_inputs(&repo, "bash .ci/demo")?;

    step("starting etcd, kube-apiserver and kube-controller-manager on loopback");
    let mut cp = ControlPlane::start().await?;
    println!("    admin kubeconfig: {}", cp.admin_kubeconfig().display());
    let admin = cp.admin_client().await?;

    step("laying out the plugins directory: the hostpath guest and its grant file");
    let plugins = cp.run_dir().join("plugins");
    let volumes = cp.run_dir().join("volumes");
    std::fs::create_dir_all(&plugins)?;
    std::fs::create_dir_all(&volumes)?;
    std::fs::copy(&guest, plugins.join("hostpath.wasm"))?;
    let grant = std::fs::read_to_string(repo.join("guests/hostpath/hostpath.toml"))?.replace(
        "/var/lib/wasm-provisioner/hostpath",
        &volumes.display().to_string(),
    );
    std::fs::write(plugins.join("hostpath.toml"), &grant)?;
    println!("    {}: {}", plugins.display(), list_dir(&plugins));
    println!("    the guest may only touch {}", volumes.display());

    step("inspecting the guest");
    let inspect = std::process::Command::new(&binary)
        .arg("inspect")
        .arg(plugins.join("hostpath.wasm"))
        .output()?;
    print!(
        "{}",
        String::from_utf8_lossy(&inspect.stdout)
            .lines()
            .filter(|l| !l.starts_with("  "))
            .map(|l| format!("    {l}\n"))
            .collect::<String>()
    );

    step("running the provisioner as its service account (RBAC from deploy/rbac.yaml)");
    let mut cmd = std::process::Command::new(&binary);
    cmd.args(["run", "--plugins"])
        .arg(&plugins)
        .arg("--kubeconfig")
        .arg(cp.provisioner_kubeconfig())
        .args(["--leader-election-namespace", "wasm-provisioner"]);
    let log = cp.run_dir().join("provisioner.log");
    let mut provisioner = Process::spawn(cmd, log.clone())?;
    println!("    pid {}, log {}", provisioner.pid(), log.display());

    step("creating StorageClass `hostpath` and three claims in namespace `demo`");
    let class: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "hostpath"},
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "parameters": {"pathPattern": "${pvc.namespace}_${pvc.name}"},
    }))?;
    Api::<StorageClass>::all(admin.clone())
        .create(&PostParams::default(), &class)
        .await?;
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "demo"}}))?,
        )
        .await?;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), "demo");
    for (name, size) in CLAIMS {
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"storageClassName": "hostpath", "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
        }))?;
        claims.create(&PostParams::default(), &claim).await?;
        println!("    created claim demo/{name} ({size})");
    }

    step("waiting for kube-controller-manager to bind each claim to the PV the guest provisioned");
    let pvs: Api<PersistentVolume> = Api::all(admin.clone());
    let mut bound = BTreeMap::new();
    for (name, _) in CLAIMS {
        let volume = wait_for(
            &format!("claim {name} Bound"),
            Duration::from_secs(90),
            || async {
                let c = claims.get(name).await?;
                let phase = c.status.as_ref().and_then(|s| s.phase.clone());
                Ok((phase.as_deref() == Some("Bound"))
                    .then(|| c.spec.and_then(|s| s.volume_name))
                    .flatten())
            },
        )
        .await
        .with_context(|| provisioner.log())?;
        let pv = pvs.get(&volume).await?;
        let spec = pv.spec.clone().unwrap_or_default();
        println!(
            "    demo/{name:<9} Bound  {volume}  {:<6} {:<7} hostPath {}",
            spec.capacity
                .as_ref()
                .map(|c| c["storage"].0.clone())
                .unwrap_or_default(),
            spec.persistent_volume_reclaim_policy.unwrap_or_default(),
            spec.host_path.map(|h| h.path).unwrap_or_default()
        );
        bound.insert(name, volume);
    }
    println!("    directories: {}", list_dir(&volumes));

    step(
        "deleting the claims: the PVs are Released, the guest deletes the directories, the PVs go",
    );
    for (name, _) in CLAIMS {
        claims.delete(name, &DeleteParams::default()).await?;
    }
    for (name, volume) in &bound {
        wait_for(
            &format!("PV {volume} deleted"),
            Duration::from_secs(90),
            || async { Ok(pvs.get_opt(volume).await?.is_none().then_some(())) },
        )
        .await
        .with_context(|| provisioner.log())?;
        println!("    {volume} (demo/{name}) deleted");
    }
    println!("    directories: {}", list_dir(&volumes));
    ensure!(
        std::fs::read_dir(&volumes)?.next().is_none(),
        "every directory was removed"
    );

    step("stopping the provisioner (SIGTERM) and the control plane");
    let status = provisioner.terminate()?;
    println!("    provisioner exited with {status}");
    let lines: Vec<String> = provisioner
        .log()
        .lines()
        .filter(|l| l.contains("provisioned") || l.contains("volume deleted"))
        .map(str::to_string)
        .collect();
    println!(
        "    the provisioner logged {} provision/delete lines",
        lines.len()
    );
    cp.stop();
    println!(
        "\ndemo finished in {:.0?}: 3 claims provisioned, bound, deleted; nothing left behind",
        started.elapsed()
    );
    Ok(())
}
