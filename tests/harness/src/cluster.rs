//! A control plane with a node, as `tests/e2e_kubelet.rs` and the node demo use it: an admin
//! client and the steps both take (apply `deploy/` with the overlay that moves its node directory,
//! run a busybox pod on a claim, read what it printed, delete a claim and wait for its storage).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::apply::create_or_merge_yaml;
use crate::control_plane::ControlPlane;
use crate::kustomize::render_kustomization;
use crate::node::{BUSYBOX_IMAGE, Node};
use crate::wait::wait_for;
use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// Namespace deploy/ and deploy/node/ run in.
const PROVISIONER_NAMESPACE: &str = "wasm-provisioner";
/// The provisioner's leader lease (the binary's name, in its pod's namespace).
const LEASE: &str = "wasm-provisioner";
/// What one step may take (claims bind in about a second, pods start in two; slack for load).
const STEP: Duration = Duration::from_secs(120);
const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";

/// deploy/'s node directory (host-global), which [`NodeCluster::apply_kustomization`] moves into
/// the node's run dir.
pub const SHIPPED_NODE_DIR: &str = "/var/lib/wasm-provisioner/hostpath";

/// Builds the node's images with `.ci/images` from `provisioner` (a wasm-provisioner binary) and
/// the release guests in `repo`'s guests/ (built already), into a temp dir.
pub fn build_images(repo: &Path, provisioner: &Path) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new().prefix("wp-images-").tempdir()?;
    let output = Command::new("bash")
        .arg(repo.join(".ci/images"))
        .arg(dir.path())
        .env("WP_PROVISIONER_BIN", provisioner)
        .output()
        .context("running .ci/images")?;
    ensure!(
        output.status.success(),
        ".ci/images failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(dir)
}

/// The overlay on deploy/ and deploy/node/: the node directory moved to `node_dir` (hostPath,
/// mounts, the chown argument and the grant's dirs.host, path-prefixes and node-dir alike), since
/// deploy/'s is host-global and other runs share the machine. Nothing else changes.
pub fn render_with_node_dir(dir: &Path, node_dir: &Path) -> anyhow::Result<String> {
    render_kustomization(dir, &|text| {
        text.replace(SHIPPED_NODE_DIR, &node_dir.display().to_string())
    })
}

/// The shipped manifests' text with enforced sizes switched on as their comments say: every
/// line marked `# with sizes` uncommented, every line marked `# without sizes` commented out.
pub fn with_sizes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let indent = &line[..line.len() - line.trim_start().len()];
        let body = line.trim_start();
        if body.ends_with("# with sizes")
            && let Some(active) = body.strip_prefix("# ")
        {
            out.push_str(indent);
            out.push_str(active);
        } else if body.ends_with("# without sizes") {
            out.push_str(indent);
            out.push_str("# ");
            out.push_str(body);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// A local control plane and a node on it.
pub struct NodeCluster {
    pub cp: ControlPlane,
    node: Option<Node>,
    admin: kube::Client,
    storage_dir: PathBuf,
    node_name: String,
}

impl NodeCluster {
    pub async fn new(cp: ControlPlane, node: Node) -> anyhow::Result<NodeCluster> {
        let admin = cp.admin_client().await?;
        Ok(NodeCluster {
            storage_dir: node.storage_dir(),
            node_name: node.name().to_string(),
            node: Some(node),
            cp,
            admin,
        })
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    pub fn storage_dir(&self) -> PathBuf {
        self.storage_dir.clone()
    }

    pub fn node(&self) -> anyhow::Result<&Node> {
        self.node.as_ref().context("the node was stopped")
    }

    /// Stops the node (pods force-deleted, host restored); the control plane stays.
    pub async fn stop_node(&mut self) -> anyhow::Result<()> {
        match self.node.take() {
            Some(mut node) => node.stop().await,
            None => Ok(()),
        }
    }

    /// Stops the node, then the control plane.
    pub async fn stop(mut self) {
        if let Err(error) = self.stop_node().await {
            eprintln!("stopping the node: {error:#}");
        }
    }

    /// `kubectl apply -k <dir>` with the overlay that moves the node directory.
    pub async fn apply_kustomization(&self, dir: &Path) -> anyhow::Result<()> {
        let yaml = render_with_node_dir(dir, &self.storage_dir)?;
        create_or_merge_yaml(&self.admin, &yaml)
            .await
            .with_context(|| format!("applying {}", dir.display()))
    }

    /// `kubectl apply -k <dir>` with the node directory at `node_dir` and `edit` applied to
    /// every file (e.g. [`with_sizes`]).
    pub async fn apply_kustomization_at(
        &self,
        dir: &Path,
        node_dir: &Path,
        edit: &dyn Fn(&str) -> String,
    ) -> anyhow::Result<()> {
        let shipped = SHIPPED_NODE_DIR;
        let node_dir = node_dir.display().to_string();
        let yaml = render_kustomization(dir, &|text| edit(&text.replace(shipped, &node_dir)))?;
        create_or_merge_yaml(&self.admin, &yaml)
            .await
            .with_context(|| format!("applying {}", dir.display()))
    }

    /// `kubectl apply -f` of a manifest.
    pub async fn apply_yaml(&self, yaml: &str) -> anyhow::Result<()> {
        create_or_merge_yaml(&self.admin, yaml).await
    }

    pub async fn wait_deployment_ready(&self, name: &str, replicas: i32) -> anyhow::Result<()> {
        let api: Api<Deployment> = Api::namespaced(self.admin.clone(), PROVISIONER_NAMESPACE);
        wait_for(
            &format!("{replicas} Ready replicas of {name}"),
            STEP,
            || async {
                let status = api.get(name).await?.status.unwrap_or_default();
                Ok((status.ready_replicas == Some(replicas)
                    && status.replicas == Some(replicas)
                    && status.updated_replicas == Some(replicas))
                .then_some(()))
            },
        )
        .await
    }

    pub async fn wait_daemonset_ready(&self, name: &str) -> anyhow::Result<()> {
        let api: Api<DaemonSet> = Api::namespaced(self.admin.clone(), PROVISIONER_NAMESPACE);
        wait_for(&format!("DaemonSet {name} Ready"), STEP, || async {
            let status = api.get(name).await?.status.unwrap_or_default();
            Ok((status.desired_number_scheduled >= 1
                && status.number_ready == status.desired_number_scheduled)
                .then_some(()))
        })
        .await
    }

    /// Deletes a Deployment and force-deletes its pods, then waits until none is left.
    pub async fn remove_deployment(&self, name: &str) -> anyhow::Result<()> {
        let deployments: Api<Deployment> =
            Api::namespaced(self.admin.clone(), PROVISIONER_NAMESPACE);
        deployments
            .delete(name, &DeleteParams::background())
            .await?;
        self.force_delete_pods_labelled(name).await
    }

    /// Deletes a DaemonSet and force-deletes its pods, then waits until none is left.
    pub async fn remove_daemonset(&self, name: &str) -> anyhow::Result<()> {
        let daemonsets: Api<DaemonSet> = Api::namespaced(self.admin.clone(), PROVISIONER_NAMESPACE);
        daemonsets.delete(name, &DeleteParams::background()).await?;
        self.force_delete_pods_labelled(name).await
    }

    /// Force-deletes the pods labelled `app.kubernetes.io/name=<name>` until none is left.
    async fn force_delete_pods_labelled(&self, name: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), PROVISIONER_NAMESPACE);
        let selector = ListParams::default().labels(&format!("app.kubernetes.io/name={name}"));
        wait_for(&format!("the pods of {name} to be gone"), STEP, || async {
            let left = pods.list(&selector).await?;
            for pod in &left {
                if let Some(pod_name) = &pod.metadata.name {
                    let _ = pods.delete(pod_name, &force()).await;
                }
            }
            Ok(left.items.is_empty().then_some(()))
        })
        .await
    }

    /// The pod holding the leader lease (its identity is `<pod hostname>_<random>`).
    pub async fn leader(&self) -> anyhow::Result<String> {
        let leases: Api<Lease> = Api::namespaced(self.admin.clone(), PROVISIONER_NAMESPACE);
        wait_for("a leader", STEP, || async {
            Ok(leases
                .get_opt(LEASE)
                .await?
                .and_then(|lease| lease.spec?.holder_identity)
                .filter(|holder| !holder.is_empty())
                .map(|holder| {
                    holder
                        .rsplit_once('_')
                        .map_or(holder.clone(), |(pod, _)| pod.to_string())
                }))
        })
        .await
    }

    /// Names of the running provisioner pods.
    pub async fn provisioner_pods(&self) -> anyhow::Result<Vec<String>> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), PROVISIONER_NAMESPACE);
        let list = pods
            .list(&ListParams::default().labels("app.kubernetes.io/name=wasm-provisioner"))
            .await?;
        Ok(list
            .into_iter()
            .filter(|pod| pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .filter_map(|pod| pod.metadata.name)
            .collect())
    }

    pub async fn create_claim(
        &self,
        namespace: &str,
        name: &str,
        class: &str,
    ) -> anyhow::Result<()> {
        self.create_claim_from(namespace, name, class, None).await
    }

    /// [`NodeCluster::create_claim`], cloning claim `source` when one is named.
    pub async fn create_claim_from(
        &self,
        namespace: &str,
        name: &str,
        class: &str,
        source: Option<&str>,
    ) -> anyhow::Result<()> {
        self.create_claim_of(namespace, name, class, source, "1Gi")
            .await
    }

    /// [`NodeCluster::create_claim_from`] asking for `size` (a quantity).
    pub async fn create_claim_of(
        &self,
        namespace: &str,
        name: &str,
        class: &str,
        source: Option<&str>,
        size: &str,
    ) -> anyhow::Result<()> {
        let data_source =
            source.map(|source| json!({"kind": "PersistentVolumeClaim", "name": source}));
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "storageClassName": class,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": size}},
                "dataSource": data_source,
            },
        }))?;
        Api::<PersistentVolumeClaim>::namespaced(self.admin.clone(), namespace)
            .create(&PostParams::default(), &claim)
            .await
            .with_context(|| format!("creating claim {namespace}/{name}"))?;
        Ok(())
    }

    /// Asks claim `namespace/name` for `size`, as its user would (a growth).
    pub async fn resize_claim(
        &self,
        namespace: &str,
        name: &str,
        size: &str,
    ) -> anyhow::Result<()> {
        let patch = json!({"spec": {"resources": {"requests": {"storage": size}}}});
        Api::<PersistentVolumeClaim>::namespaced(self.admin.clone(), namespace)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("resizing claim {namespace}/{name} to {size}"))?;
        Ok(())
    }

    /// Waits until claim `namespace/name` has `size` in `status.capacity`.
    pub async fn wait_claim_capacity(
        &self,
        namespace: &str,
        name: &str,
        size: &str,
    ) -> anyhow::Result<()> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.admin.clone(), namespace);
        wait_for(
            &format!("claim {namespace}/{name} with capacity {size}"),
            STEP,
            || async {
                let claim = claims.get(name).await?;
                let capacity = claim.status.and_then(|s| s.capacity).unwrap_or_default();
                Ok((capacity.get("storage").map(|q| q.0.as_str()) == Some(size)).then_some(()))
            },
        )
        .await
    }

    pub async fn wait_bound(
        &self,
        namespace: &str,
        claim: &str,
    ) -> anyhow::Result<PersistentVolume> {
        self.wait_bound_within(namespace, claim, STEP).await
    }

    /// Waits for the claim to be Bound and returns its PV.
    pub async fn wait_bound_within(
        &self,
        namespace: &str,
        claim: &str,
        timeout: Duration,
    ) -> anyhow::Result<PersistentVolume> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.admin.clone(), namespace);
        let pvs: Api<PersistentVolume> = Api::all(self.admin.clone());
        let volume = wait_for(
            &format!("claim {namespace}/{claim} Bound"),
            timeout,
            || async {
                let claim = claims.get(claim).await?;
                let bound = claim.status.and_then(|s| s.phase).as_deref() == Some("Bound");
                Ok(claim.spec.and_then(|s| s.volume_name).filter(|_| bound))
            },
        )
        .await?;
        Ok(pvs.get(&volume).await?)
    }

    pub async fn selected_node(
        &self,
        namespace: &str,
        claim: &str,
    ) -> anyhow::Result<Option<String>> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.admin.clone(), namespace);
        Ok(claims
            .get(claim)
            .await?
            .metadata
            .annotations
            .and_then(|a| a.get(SELECTED_NODE).cloned()))
    }

    /// The PV's hostPath on the node, which must lie in the node's storage directory.
    pub fn host_path_of(&self, pv: &PersistentVolume) -> anyhow::Result<PathBuf> {
        let path = pv
            .spec
            .as_ref()
            .and_then(|spec| spec.host_path.as_ref())
            .map(|host_path| PathBuf::from(&host_path.path))
            .context("the PV is not a hostPath volume")?;
        ensure!(
            path.starts_with(&self.storage_dir),
            "the PV's path {} is outside the node's storage directory {}",
            path.display(),
            self.storage_dir.display()
        );
        ensure!(
            path.is_dir(),
            "{} is not a directory on the node",
            path.display()
        );
        Ok(path)
    }

    /// Runs a busybox pod (as root) in `default` with `claim` at /data and `script` as `sh -c`,
    /// and waits until it has succeeded (its output is in the error if it failed).
    pub async fn run_pod(&self, name: &str, claim: &str, script: &str) -> anyhow::Result<()> {
        self.run_pod_as(name, claim, script, 0).await
    }

    /// [`NodeCluster::run_pod`] as user and group `uid`.
    pub async fn run_pod_as(
        &self,
        name: &str,
        claim: &str,
        script: &str,
        uid: i64,
    ) -> anyhow::Result<()> {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "securityContext": {"runAsUser": uid, "runAsGroup": uid},
                "terminationGracePeriodSeconds": 0,
                "containers": [{
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "command": ["sh", "-c", script],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
            },
        }))?;
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), "default");
        pods.create(&PostParams::default(), &pod)
            .await
            .with_context(|| format!("creating pod {name}"))?;
        let phase = wait_for(&format!("pod {name} to finish"), STEP, || async {
            let phase = pods.get(name).await?.status.and_then(|s| s.phase);
            Ok(phase.filter(|p| p == "Succeeded" || p == "Failed"))
        })
        .await?;
        if phase != "Succeeded" {
            bail!(
                "pod {name} {phase}; it printed: {}",
                self.pod_output("default", name).unwrap_or_default()
            );
        }
        Ok(())
    }

    /// What a pod's containers printed, from the kubelet's log files (CRI format, prefixes cut).
    pub fn pod_output(&self, namespace: &str, pod: &str) -> anyhow::Result<String> {
        let prefix = format!("{namespace}_{pod}_");
        let logs = self.node()?.container_logs(namespace);
        let lines: Vec<String> = logs
            .iter()
            .filter(|(file, _)| file.starts_with(&prefix))
            .flat_map(|(_, text)| text.lines())
            .map(|line| line.splitn(4, ' ').nth(3).unwrap_or_default().to_string())
            .collect();
        Ok(lines.join("\n").trim_end().to_string())
    }

    /// Force-deletes a pod (grace 0) and waits until the object is gone.
    pub async fn delete_pod(&self, namespace: &str, name: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        pods.delete(name, &force()).await?;
        wait_for(&format!("pod {name} gone"), STEP, || async {
            Ok(pods.get_opt(name).await?.is_none().then_some(()))
        })
        .await
    }

    /// Deletes a claim, then waits for its PV and the PV's directory on the node to be gone.
    pub async fn delete_claim_and_wait_storage(
        &self,
        namespace: &str,
        claim: &str,
        pv: &PersistentVolume,
    ) -> anyhow::Result<()> {
        let path = self.host_path_of(pv)?;
        self.delete_claim_and_wait_gone(namespace, claim, pv, &path)
            .await
    }

    /// [`NodeCluster::delete_claim_and_wait_storage`] for a volume at `path`, wherever on the
    /// node it lies.
    pub async fn delete_claim_and_wait_gone(
        &self,
        namespace: &str,
        claim: &str,
        pv: &PersistentVolume,
        path: &Path,
    ) -> anyhow::Result<()> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.admin.clone(), namespace);
        claims.delete(claim, &DeleteParams::default()).await?;
        let pvs: Api<PersistentVolume> = Api::all(self.admin.clone());
        let name = pv.metadata.name.clone().context("PV without a name")?;
        wait_for(&format!("PV {name} gone"), STEP, || async {
            Ok(pvs.get_opt(&name).await?.is_none().then_some(()))
        })
        .await?;
        wait_for(
            &format!("{} gone from the node", path.display()),
            STEP,
            || {
                let gone = !path.exists() && !path.is_symlink();
                async move { Ok(gone.then_some(())) }
            },
        )
        .await
    }

    /// Waits for an event of `reason` on claim `namespace/claim` and returns its message.
    pub async fn wait_event(
        &self,
        namespace: &str,
        claim: &str,
        reason: &str,
    ) -> anyhow::Result<String> {
        let events: Api<Event> = Api::namespaced(self.admin.clone(), namespace);
        let fields =
            format!("involvedObject.kind=PersistentVolumeClaim,involvedObject.name={claim}");
        wait_for(
            &format!("a {reason} event on claim {namespace}/{claim}"),
            STEP,
            || async {
                let list = events.list(&ListParams::default().fields(&fields)).await?;
                Ok(list
                    .into_iter()
                    .find(|e| e.reason.as_deref() == Some(reason))
                    .map(|e| e.message.unwrap_or_default()))
            },
        )
        .await
    }

    /// The PV a claim names now, if any.
    pub async fn volume_name(
        &self,
        namespace: &str,
        claim: &str,
    ) -> anyhow::Result<Option<String>> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.admin.clone(), namespace);
        Ok(claims
            .get(claim)
            .await?
            .spec
            .and_then(|s| s.volume_name)
            .filter(|v| !v.is_empty()))
    }

    /// Deletes a claim whose class retains its volume, then its Released PV, and waits until
    /// both are gone; the PV's directory stays on the node (returned), as `Retain` promises.
    pub async fn delete_retained(
        &self,
        namespace: &str,
        claim: &str,
        pv: &PersistentVolume,
    ) -> anyhow::Result<PathBuf> {
        let path = self.host_path_of(pv)?;
        self.delete_claim(namespace, claim).await?;
        let pvs: Api<PersistentVolume> = Api::all(self.admin.clone());
        let name = pv.metadata.name.clone().context("PV without a name")?;
        wait_for(&format!("PV {name} Released"), STEP, || async {
            let phase = pvs.get(&name).await?.status.and_then(|s| s.phase);
            Ok((phase.as_deref() == Some("Released")).then_some(()))
        })
        .await?;
        pvs.delete(&name, &DeleteParams::default()).await?;
        wait_for(&format!("PV {name} gone"), STEP, || async {
            Ok(pvs.get_opt(&name).await?.is_none().then_some(()))
        })
        .await?;
        ensure!(path.is_dir(), "{} went with a retained PV", path.display());
        Ok(path)
    }

    /// Deletes a claim that has no volume, and waits until it is gone.
    pub async fn delete_claim(&self, namespace: &str, claim: &str) -> anyhow::Result<()> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.admin.clone(), namespace);
        claims.delete(claim, &DeleteParams::default()).await?;
        wait_for(&format!("claim {namespace}/{claim} gone"), STEP, || async {
            Ok(claims.get_opt(claim).await?.is_none().then_some(()))
        })
        .await
    }

    /// Fails if any provisioner container logged `forbidden`: deploy/rbac.yaml is what the pods
    /// run as, and it must allow all they do.
    pub fn assert_no_forbidden(&self) -> anyhow::Result<()> {
        let logs = self.node()?.container_logs(PROVISIONER_NAMESPACE);
        ensure!(!logs.is_empty(), "no provisioner container logs found");
        for (file, text) in logs {
            let forbidden: Vec<&str> = text.lines().filter(|l| l.contains("forbidden")).collect();
            ensure!(
                forbidden.is_empty(),
                "{file} logged forbidden:\n{}",
                forbidden.join("\n")
            );
        }
        Ok(())
    }
}

impl NodeCluster {
    /// What the pods are doing and the last errors of the node's processes, for a failed case.
    pub async fn describe(&self) -> String {
        let mut out = String::new();
        let pods: Api<Pod> = Api::all(self.admin.clone());
        match pods.list(&ListParams::default()).await {
            Ok(list) => {
                for pod in list {
                    let name = format!(
                        "{}/{}",
                        pod.metadata.namespace.unwrap_or_default(),
                        pod.metadata.name.unwrap_or_default()
                    );
                    let status = pod.status.unwrap_or_default();
                    let containers: Vec<String> = status
                        .init_container_statuses
                        .iter()
                        .flatten()
                        .chain(status.container_statuses.iter().flatten())
                        .map(|c| {
                            let state = c.state.as_ref().map(|state| {
                                if let Some(waiting) = &state.waiting {
                                    format!("waiting {:?} {:?}", waiting.reason, waiting.message)
                                } else if let Some(terminated) = &state.terminated {
                                    format!(
                                        "terminated {} {:?} {:?}",
                                        terminated.exit_code, terminated.reason, terminated.message
                                    )
                                } else {
                                    "running".to_string()
                                }
                            });
                            format!("{} ready={} {}", c.name, c.ready, state.unwrap_or_default())
                        })
                        .collect();
                    out.push_str(&format!(
                        "pod {name}: {:?} {:?}; {}\n",
                        status.phase,
                        status
                            .conditions
                            .iter()
                            .flatten()
                            .filter(|c| c.status != "True")
                            .map(|c| format!("{} {:?}", c.type_, c.message))
                            .collect::<Vec<_>>(),
                        containers.join("; ")
                    ));
                }
            }
            Err(error) => out.push_str(&format!("listing pods: {error}\n")),
        }
        if let Some(node) = &self.node {
            for (file, text) in node.container_logs(PROVISIONER_NAMESPACE) {
                let tail: Vec<&str> = text.lines().rev().take(8).collect();
                out.push_str(&format!(
                    "--- {file} (last lines, newest first)\n{}\n",
                    tail.join("\n")
                ));
            }
            for log in ["kubelet", "containerd"] {
                let text = std::fs::read_to_string(node.run_dir().join(format!("{log}.log")))
                    .unwrap_or_default();
                let errors: Vec<&str> = text
                    .lines()
                    .filter(|l| l.starts_with('E') || l.contains("level=error"))
                    .collect();
                let tail = &errors[errors.len().saturating_sub(10)..];
                out.push_str(&format!(
                    "--- last errors of {log}.log\n{}\n",
                    tail.join("\n")
                ));
            }
        }
        out
    }
}

/// The node names a PV's required node affinity allows.
pub fn pinned_to(pv: &PersistentVolume) -> Vec<String> {
    pv.spec
        .as_ref()
        .and_then(|spec| spec.node_affinity.as_ref())
        .and_then(|affinity| affinity.required.as_ref())
        .map(|selector| {
            selector
                .node_selector_terms
                .iter()
                .flat_map(|term| term.match_expressions.iter().flatten())
                .flat_map(|expression| expression.values.iter().flatten().cloned())
                .collect()
        })
        .unwrap_or_default()
}

fn force() -> DeleteParams {
    DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    }
}
