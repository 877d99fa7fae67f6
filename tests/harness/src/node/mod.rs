//! A real node beside the control plane: containerd, kubelet, kube-scheduler and a second
//! kube-controller-manager (the controllers pods need), with the images `.ci/images` built
//! imported, so pods run and mount what the provisioner provisions.
//!
//! ```text
//!  Node::start(&control_plane, images)
//!    ├─ machine-wide lock (/run/wp-harness-node/lock), journal of host changes
//!    ├─ host: sysctls saved, /var/log/pods & co. claimed, cgroup /wp-harness-node, bridge wpnode0
//!    │        (route_localnet), nat rule 10.0.0.1:443 → 127.0.0.1:<apiserver> from the bridge,
//!    │        nothing forwarded from the bridge elsewhere
//!    ├─ containerd            own root, state, socket, CNI config (run dir), images imported
//!    ├─ kube-controller-manager #2   serviceaccount(-token), nodelifecycle, deployment, ...
//!    ├─ kube-scheduler
//!    └─ kubelet               run dir, cgroup root, API on 127.0.0.1:<free>; waits for Ready
//! ```
//!
//! Needs root; it changes host state and puts all of it back on [`Node::stop`] or drop, and a run
//! that died is cleaned up by the next [`Node::start`]. Not for a developer's laptop: for CI VMs.

mod config;
pub(crate) mod host;
mod snapshot;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod, Service};
use kube::api::{Api, DeleteParams, ListParams};

use crate::binaries::default_bin_dir;
use crate::control_plane::ControlPlane;
use crate::ports::free_loopback_port;
use crate::process::Process;
use crate::wait::wait_for;

pub use config::BUSYBOX_IMAGE;
use config::Layout;
use host::{HostJournal, Undo};
pub use snapshot::{HostSnapshot, processes_of_pod};

/// How long the kubelet may take to register and report Ready (8.7 s measured on an idle VM).
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long containerd may take to serve its socket.
const CONTAINERD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long force-deleted pods' containers may take to be gone at stop.
const TASKS_GONE_TIMEOUT: Duration = Duration::from_secs(30);
/// Grace between SIGTERM and SIGKILL for the node's processes.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The images a node imports, as `.ci/images` names them.
pub const IMAGE_TARBALLS: &[&str] = &[
    "pause.tar",
    "busybox.tar",
    "wasm-provisioner.tar",
    "wasm-provisioner-guests.tar",
];

/// The node binaries, found where `.ci/control-plane-binaries` caches them.
struct NodeBinaries {
    kubelet: PathBuf,
    kube_scheduler: PathBuf,
    kube_controller_manager: PathBuf,
}

impl NodeBinaries {
    fn locate() -> anyhow::Result<NodeBinaries> {
        let dir = std::env::var_os(crate::binaries::BIN_DIR_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(default_bin_dir);
        let binaries = NodeBinaries {
            kubelet: dir.join("kubelet"),
            kube_scheduler: dir.join("kube-scheduler"),
            kube_controller_manager: dir.join("kube-controller-manager"),
        };
        for path in [
            &binaries.kubelet,
            &binaries.kube_scheduler,
            &binaries.kube_controller_manager,
        ] {
            ensure!(
                path.is_file(),
                "{} is missing: run `bash .ci/control-plane-binaries` (builds kubelet and kube-scheduler with the control plane)",
                path.display()
            );
        }
        for tool in ["containerd", "ctr", "runc", "iptables", "ip"] {
            ensure!(
                host::run("sh", &["-c", &format!("command -v {tool}")]).is_ok(),
                "{tool} is missing: run `bash .ci/setup` (installs the node's Debian packages)"
            );
        }
        ensure!(
            Path::new("/usr/lib/cni/bridge").is_file(),
            "/usr/lib/cni/bridge is missing: run `bash .ci/setup` (containernetworking-plugins)"
        );
        Ok(binaries)
    }
}

/// Durations of a node start, for the figures the tests print.
#[derive(Debug, Clone, Copy, Default)]
pub struct NodeTimings {
    /// containerd started until its socket answered.
    pub containerd: Duration,
    /// All images imported.
    pub images: Duration,
    /// kubelet started until the Node was Ready and untainted.
    pub kubelet_to_ready: Duration,
    /// The whole [`Node::start`].
    pub total: Duration,
}

/// A running node; stopped (and the host restored) by [`Node::stop`] or on drop.
pub struct Node {
    layout: Layout,
    name: String,
    admin: kube::Client,
    containerd: Option<Process>,
    kubelet: Option<Process>,
    scheduler: Option<Process>,
    controller_manager: Option<Process>,
    journal: Option<HostJournal>,
    /// The `kubernetes` Service's address, which pods reach the API server through.
    service_ip: String,
    timings: NodeTimings,
    _run_dir: tempfile::TempDir,
}

impl Node {
    /// Starts a node against `control_plane` (a local one: the node needs its key and CA) and
    /// imports the image tarballs in `images` (see [`IMAGE_TARBALLS`]). Waits for another node
    /// on this machine to stop first.
    pub async fn start(control_plane: &ControlPlane, images: &Path) -> anyhow::Result<Node> {
        ensure!(
            !control_plane.is_attached(),
            "a node needs a local control plane"
        );
        let binaries = NodeBinaries::locate()?;
        let started = Instant::now();
        let journal = HostJournal::open()?;
        let run_dir = tempfile::Builder::new()
            .prefix("wp-node-")
            .tempdir_in("/tmp")
            .context("creating the node's run dir")?;
        let layout = Layout {
            run_dir: run_dir.path().to_owned(),
        };
        let admin = control_plane.admin_client().await?;
        let mut node = Node {
            layout,
            name: hostname()?,
            admin,
            containerd: None,
            kubelet: None,
            scheduler: None,
            controller_manager: None,
            journal: Some(journal),
            service_ip: String::new(),
            timings: NodeTimings::default(),
            _run_dir: run_dir,
        };
        // A Node left by an earlier run would look Ready before this kubelet has registered.
        node.delete_node_object().await?;
        node.prepare_host(control_plane).await?;
        node.start_processes(control_plane, &binaries, images)
            .await?;
        node.timings.total = started.elapsed();
        Ok(node)
    }

    /// The Node's name (the host name, as the kubelet registers it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where this run keeps its files and the node's logs (`kubelet.log`, `containerd.log`, ...).
    pub fn run_dir(&self) -> &Path {
        &self.layout.run_dir
    }

    /// The node directory deploy/'s overlay moves the provisioner's storage to (created).
    pub fn storage_dir(&self) -> PathBuf {
        self.layout.storage_dir()
    }

    /// How long the start took, step by step.
    pub fn timings(&self) -> NodeTimings {
        self.timings
    }

    /// Every container log of the pods in `namespace` the kubelet wrote (`/var/log/pods`), as
    /// `(pod_container, text)`; empty for pods already gone.
    pub fn container_logs(&self, namespace: &str) -> Vec<(String, String)> {
        let mut logs = Vec::new();
        let prefix = format!("{namespace}_");
        for pod in host::entries(Path::new("/var/log/pods")) {
            if !pod.starts_with(&prefix) {
                continue;
            }
            let pod_dir = Path::new("/var/log/pods").join(&pod);
            for container in host::entries(&pod_dir) {
                for file in host::entries(&pod_dir.join(&container)) {
                    if let Ok(text) = std::fs::read_to_string(pod_dir.join(&container).join(&file))
                    {
                        logs.push((format!("{pod}/{container}/{file}"), text));
                    }
                }
            }
        }
        logs
    }

    /// Force-deletes every pod (grace 0: the v1.20 kubelet confirms graceful deletes 10 to 50 s
    /// late), waits for their containers to go, stops every process and restores the host.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        for process in [&mut self.controller_manager, &mut self.scheduler]
            .into_iter()
            .flatten()
        {
            process.terminate_async(STOP_GRACE).await?;
        }
        let pods: Api<Pod> = Api::all(self.admin.clone());
        let mut first_error = None;
        if let Err(error) = force_delete_all(&pods).await {
            first_error = Some(error);
        }
        let socket = self.layout.containerd_socket();
        let drained = wait_for("the node's containers to stop", TASKS_GONE_TIMEOUT, || {
            let socket = socket.clone();
            async move { Ok(tasks(&socket)?.is_empty().then_some(())) }
        })
        .await;
        if let (Err(error), None) = (drained, &first_error) {
            first_error = Some(error);
        }
        self.teardown();
        if let Err(error) = self.delete_node_object().await
            && first_error.is_none()
        {
            first_error = Some(error);
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    async fn delete_node_object(&self) -> anyhow::Result<()> {
        let nodes: Api<NodeObject> = Api::all(self.admin.clone());
        if nodes.get_opt(&self.name).await?.is_some() {
            nodes.delete(&self.name, &DeleteParams::default()).await?;
        }
        Ok(())
    }

    async fn prepare_host(&mut self, control_plane: &ControlPlane) -> anyhow::Result<()> {
        let journal = self.journal.as_mut().expect("journal until teardown");
        journal.record(Undo::RemoveDir {
            path: self.layout.run_dir.clone(),
        })?;
        for key in host::SYSCTLS {
            journal.save_sysctl(key)?;
        }
        for path in host::FIXED_PATHS {
            journal.claim_dir(Path::new(path))?;
        }
        journal.record(Undo::Cgroup {
            name: config::CGROUP_ROOT.to_string(),
        })?;
        for hierarchy in host::cgroup_hierarchies() {
            let cgroup = hierarchy.join(config::CGROUP_ROOT);
            std::fs::create_dir_all(&cgroup)
                .with_context(|| format!("creating cgroup {}", cgroup.display()))?;
            for file in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(value) = std::fs::read_to_string(hierarchy.join(file)) {
                    std::fs::write(cgroup.join(file), value.trim())
                        .with_context(|| format!("writing {}", cgroup.join(file).display()))?;
                }
            }
        }
        journal.record(Undo::Link {
            name: config::BRIDGE.to_string(),
        })?;
        host::run(
            "ip",
            &["link", "add", "name", config::BRIDGE, "type", "bridge"],
        )?;
        host::run("ip", &["link", "set", config::BRIDGE, "up"])?;
        journal.record(Undo::NewVeths {
            before: host::entries(Path::new("/sys/class/net")),
        })?;
        // Lets the nat rule send pods' API traffic to 127.0.0.1; goes away with the bridge.
        host::write_sysctl(
            &format!("net/ipv4/conf/{}/route_localnet", config::BRIDGE),
            "1",
        )?;
        self.service_ip = service_ip(&self.admin).await?;
        let rules = [
            (
                "nat",
                config::api_dnat_rule(&self.service_ip, apiserver_port(control_plane)?),
            ),
            ("filter", config::keep_pods_local_rule()),
        ];
        for (table, rule) in rules {
            journal.record(Undo::Iptables {
                table: table.into(),
                rule: rule.clone(),
            })?;
            let mut append = vec!["-t", table, "-A"];
            append.extend(rule.iter().map(String::as_str));
            host::run("iptables", &append)?;
        }
        journal.record(Undo::RunDir {
            path: self.layout.run_dir.clone(),
        })?;
        Ok(())
    }

    async fn start_processes(
        &mut self,
        control_plane: &ControlPlane,
        binaries: &NodeBinaries,
        images: &Path,
    ) -> anyhow::Result<()> {
        let layout = self.layout.clone();
        std::fs::create_dir_all(layout.containerd_dir())?;
        std::fs::create_dir_all(layout.cni_conf_dir())?;
        std::fs::create_dir_all(layout.storage_dir())?;
        std::fs::write(layout.containerd_config(), config::containerd_toml(&layout))?;
        std::fs::write(
            layout.cni_conf_dir().join("10-wp-harness-node.conflist"),
            config::cni_conflist(&layout, &self.service_ip),
        )?;

        let step = Instant::now();
        let mut containerd = Command::new("containerd");
        containerd.arg("--config").arg(layout.containerd_config());
        let mut containerd = Process::spawn(containerd, layout.log("containerd"))?;
        let socket = layout.containerd_socket();
        let waited = wait_for("containerd to serve", CONTAINERD_TIMEOUT, || {
            let socket = socket.clone();
            async move { Ok(ctr(&socket, &["version"]).ok().map(|_| ())) }
        })
        .await;
        if let Err(error) = waited {
            bail!(
                "{error:#}; last lines of containerd.log:\n{}",
                containerd.log_tail(30)
            );
        }
        ensure!(containerd.is_running(), "containerd exited");
        self.containerd = Some(containerd);
        self.timings.containerd = step.elapsed();

        let step = Instant::now();
        for tarball in IMAGE_TARBALLS {
            let path = images.join(tarball);
            ensure!(
                path.is_file(),
                "{} is missing: run `bash .ci/images {}`",
                path.display(),
                images.display()
            );
            ctr(&socket, &["images", "import", &path.display().to_string()])
                .with_context(|| format!("importing {}", path.display()))?;
        }
        self.timings.images = step.elapsed();

        let admin_kubeconfig = control_plane.admin_kubeconfig();
        let mut controller_manager = Command::new(&binaries.kube_controller_manager);
        controller_manager.args(config::controller_manager_args(
            admin_kubeconfig,
            &control_plane.run_dir().join("service-account.key"),
            &control_plane
                .run_dir()
                .join("apiserver-certs/apiserver.crt"),
        ));
        self.controller_manager = Some(Process::spawn(
            controller_manager,
            layout.log("kube-controller-manager-node"),
        )?);
        let mut scheduler = Command::new(&binaries.kube_scheduler);
        scheduler.args(config::scheduler_args(admin_kubeconfig));
        self.scheduler = Some(Process::spawn(scheduler, layout.log("kube-scheduler"))?);

        let step = Instant::now();
        let mut kubelet = Command::new(&binaries.kubelet);
        kubelet.args(config::kubelet_args(
            &layout,
            admin_kubeconfig,
            &node_ip()?,
            free_loopback_port()?,
        ));
        self.kubelet = Some(Process::spawn(kubelet, layout.log("kubelet"))?);
        let nodes: Api<NodeObject> = Api::all(self.admin.clone());
        let name = self.name.clone();
        let ready = wait_for("the node to be Ready and untainted", READY_TIMEOUT, || {
            let nodes = nodes.clone();
            let name = name.clone();
            async move {
                Ok(nodes
                    .get_opt(&name)
                    .await?
                    .filter(is_schedulable)
                    .map(|_| ()))
            }
        })
        .await;
        if let Err(error) = ready {
            let mut tails = String::new();
            for process in [&self.kubelet, &self.controller_manager, &self.scheduler]
                .into_iter()
                .flatten()
            {
                tails.push_str(&format!(
                    "\n--- last lines of {}:\n{}",
                    process.log_path().display(),
                    process.log_tail(20)
                ));
            }
            bail!("{error:#}{tails}");
        }
        for process in [
            &mut self.kubelet,
            &mut self.controller_manager,
            &mut self.scheduler,
        ]
        .into_iter()
        .flatten()
        {
            ensure!(
                process.is_running(),
                "{} exited: {}",
                process.name(),
                process.log_tail(20)
            );
        }
        self.timings.kubelet_to_ready = step.elapsed();
        Ok(())
    }

    /// Stops every process by PID (the pods' containers through containerd before containerd
    /// itself), then undoes the host changes. Idempotent.
    fn teardown(&mut self) {
        for process in [
            &mut self.controller_manager,
            &mut self.scheduler,
            &mut self.kubelet,
        ] {
            if let Some(mut process) = process.take() {
                let _ = process.terminate_within(STOP_GRACE);
            }
        }
        if let Some(mut containerd) = self.containerd.take() {
            let socket = self.layout.containerd_socket();
            for task in tasks(&socket).unwrap_or_default() {
                let _ = ctr(&socket, &["tasks", "kill", "--signal", "SIGKILL", &task]);
                let _ = ctr(&socket, &["tasks", "delete", "--force", &task]);
            }
            let _ = containerd.terminate_within(STOP_GRACE);
        }
        // Drops the journal: every host change undone, in reverse, and the lock released.
        self.journal.take();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.teardown();
    }
}

async fn force_delete_all(pods: &Api<Pod>) -> anyhow::Result<()> {
    let all = pods.list(&ListParams::default()).await?;
    for pod in all {
        let (Some(name), Some(namespace)) = (pod.metadata.name, pod.metadata.namespace) else {
            continue;
        };
        let api: Api<Pod> = Api::namespaced(pods.clone().into_client(), &namespace);
        let _ = api
            .delete(
                &name,
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..DeleteParams::default()
                },
            )
            .await;
    }
    Ok(())
}

/// Whether a Node is Ready and free of the not-ready/unreachable taints (so pods schedule).
fn is_schedulable(node: &NodeObject) -> bool {
    let ready = node
        .status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        });
    let tainted = node
        .spec
        .as_ref()
        .and_then(|spec| spec.taints.as_ref())
        .is_some_and(|taints| {
            taints
                .iter()
                .any(|t| t.key.starts_with("node.kubernetes.io/"))
        });
    ready && !tainted
}

/// The IDs of containerd's running tasks in the CRI namespace.
fn tasks(socket: &Path) -> anyhow::Result<Vec<String>> {
    Ok(ctr(socket, &["tasks", "ls", "--quiet"])?
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(str::to_string)
        .collect())
}

fn ctr(socket: &Path, args: &[&str]) -> anyhow::Result<String> {
    let socket = socket.display().to_string();
    let mut all = vec!["--address", socket.as_str(), "--namespace", "k8s.io"];
    all.extend_from_slice(args);
    host::run("ctr", &all)
}

/// The host name the kubelet registers the Node as (lower-cased, as it does).
fn hostname() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the host name")?
        .trim()
        .to_lowercase())
}

/// The address of the default route's interface: the kubelet refuses a loopback node IP. Only
/// asks the routing table; nothing is sent.
fn node_ip() -> anyhow::Result<String> {
    let route = host::run("ip", &["-4", "route", "get", "1.1.1.1"])?;
    route
        .split_whitespace()
        .skip_while(|word| *word != "src")
        .nth(1)
        .map(str::to_string)
        .with_context(|| format!("no source address in `ip route get`: {route}"))
}

/// The `kubernetes` Service's cluster IP, which pods get as `KUBERNETES_SERVICE_HOST`.
async fn service_ip(admin: &kube::Client) -> anyhow::Result<String> {
    let services: Api<Service> = Api::namespaced(admin.clone(), "default");
    wait_for(
        "the kubernetes Service",
        Duration::from_secs(30),
        || async {
            Ok(services
                .get_opt("kubernetes")
                .await?
                .and_then(|service| service.spec?.cluster_ip))
        },
    )
    .await
}

fn apiserver_port(control_plane: &ControlPlane) -> anyhow::Result<u16> {
    let url = control_plane.apiserver_url()?;
    url.rsplit(':')
        .next()
        .and_then(|port| port.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no port in {url}"))
}
