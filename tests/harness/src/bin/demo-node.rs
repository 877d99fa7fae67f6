//! `bash .ci/demo node`: the provisioner as a user runs it, on a real node. A local control plane
//! and a node (containerd, kubelet, kube-scheduler), the images built and imported, `deploy/`
//! applied (its node directory moved into the node's run dir), `deploy/examples/claim.yaml`
//! bound, a pod writing into it; then the file on the node, and everything removed. Needs root.

use std::path::Path;
use std::time::Instant;

use anyhow::ensure;
use wp_harness::{ControlPlane, Node, NodeCluster, build_images, demo_inputs, repo_root, step};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let started = Instant::now();
    let repo = repo_root();
    let (binary, _guest) = demo_inputs(&repo, "bash .ci/demo node")?;

    step("building the images the Dockerfile describes (.ci/images), plus pause and busybox");
    let images = build_images(&repo, &binary)?;
    println!("    {}", images.path().display());

    step("starting etcd, kube-apiserver and kube-controller-manager on loopback");
    let cp = ControlPlane::start().await?;
    step("starting the node: containerd, kubelet, kube-scheduler, the pods' controllers");
    let node = Node::start(&cp, images.path()).await?;
    let timings = node.timings();
    println!(
        "    node {} Ready in {:.1} s (kubelet to Ready {:.1} s); logs in {}",
        node.name(),
        timings.total.as_secs_f64(),
        timings.kubelet_to_ready.as_secs_f64(),
        node.run_dir().display()
    );
    let mut cluster = NodeCluster::new(cp, node).await?;
    let outcome = demo(&cluster, &repo).await;

    step("removing everything: pods force-deleted, node stopped, host restored");
    let stopped = cluster.stop_node().await;
    drop(cluster);
    outcome?;
    stopped?;
    println!(
        "\nnode demo finished in {:.0} s: a pod wrote into a volume the hostpath guest provisioned",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn demo(cluster: &NodeCluster, repo: &Path) -> anyhow::Result<()> {
    step("kubectl apply -k deploy/ (node directory moved to the node's run dir)");
    let applied = Instant::now();
    cluster.apply_kustomization(&repo.join("deploy")).await?;
    cluster.wait_deployment_ready("wasm-provisioner", 2).await?;
    println!(
        "    2/2 replicas Ready in {:.1} s; leader {}",
        applied.elapsed().as_secs_f64(),
        cluster.leader().await?
    );

    step("kubectl apply -f deploy/examples/claim.yaml");
    cluster
        .apply_yaml(&std::fs::read_to_string(
            repo.join("deploy/examples/claim.yaml"),
        )?)
        .await?;
    let pv = cluster.wait_bound("default", "data").await?;
    let path = cluster.host_path_of(&pv)?;
    println!(
        "    claim default/data Bound to {}",
        pv.metadata.name.as_deref().unwrap_or_default()
    );

    step("a busybox pod mounts the claim at /data and writes into it");
    cluster
        .run_pod(
            "writer",
            "data",
            "echo \"hello from pod $(hostname) at $(date -u +%H:%M:%S)\" > /data/hello.txt && cat /data/hello.txt",
        )
        .await?;
    let on_node = std::fs::read_to_string(path.join("hello.txt"))?;
    println!(
        "    the pod wrote: {}",
        cluster.pod_output("default", "writer")?
    );
    println!("    on the node:   {}", path.join("hello.txt").display());
    println!("    which holds:   {}", on_node.trim_end());
    ensure!(on_node.starts_with("hello from pod writer"));
    cluster.assert_no_forbidden()?;

    step("deleting the pod and the claim");
    cluster.delete_pod("default", "writer").await?;
    cluster
        .delete_claim_and_wait_storage("default", "data", &pv)
        .await?;
    println!(
        "    PV {} deleted, {} gone",
        pv.metadata.name.as_deref().unwrap_or_default(),
        path.display()
    );
    Ok(())
}
