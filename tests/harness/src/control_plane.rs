//! The control plane itself: etcd, kube-apiserver and kube-controller-manager on loopback, with
//! the provisioner's RBAC applied; or an existing cluster named by `WP_KUBECONFIG`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, ensure};
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tempfile::TempDir;

use crate::apply::{RBAC_YAML, apply_yaml};
use crate::binaries::Binaries;
use crate::components::{LocalComponents, restricted_account_name};
use crate::identity::{PROVISIONER_NAMESPACE, service_account_user};
use crate::wait::wait_for;

/// Set to a kubeconfig path to use an existing cluster instead of starting one.
pub const ATTACH_KUBECONFIG_ENV: &str = "WP_KUBECONFIG";

/// Set to `1` to keep the run dir (logs, kubeconfigs) when start fails, a test panics, or
/// [`ControlPlane::mark_failed`] was called.
pub const KEEP_RUN_DIR_ENV: &str = "WP_KEEP_RUN_DIR";

/// How many spare `restricted-N` identities exist, for tests that bind their own, narrower roles.
pub const RESTRICTED_IDENTITIES: usize = 3;

/// Name of the provisioner's ServiceAccount in `deploy/rbac.yaml`.
pub(crate) const PROVISIONER_SERVICE_ACCOUNT: &str = "wasm-provisioner";

/// How long the provisioner's RBAC may take to be applied and reach the authorizer's cache.
const RBAC_EFFECTIVE_TIMEOUT: Duration = Duration::from_secs(30);

/// A running local control plane, or an attached existing cluster.
///
/// Processes are stopped by PID in [`ControlPlane::stop`], which `Drop` also calls.
pub struct ControlPlane {
    run_dir: PathBuf,
    run_dir_guard: Option<TempDir>,
    admin_kubeconfig: PathBuf,
    provisioner_kubeconfig: PathBuf,
    restricted_kubeconfigs: Vec<PathBuf>,
    /// `None` when attached to `WP_KUBECONFIG`. Behind a lock so a test sharing the control
    /// plane can stop and start the API server and kube-controller-manager.
    local: Option<tokio::sync::Mutex<LocalComponents>>,
    /// Keeps the run dir on drop when `WP_KEEP_RUN_DIR=1`.
    failed: AtomicBool,
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and kube-controller-manager (or attaches to `WP_KUBECONFIG`),
    /// then applies `deploy/rbac.yaml` as admin and waits until the provisioner identity can use it.
    pub async fn start() -> anyhow::Result<ControlPlane> {
        let run_dir = tempfile::Builder::new()
            .prefix("wp-control-plane-")
            .tempdir()
            .context("creating the run dir")?;
        let mut control_plane = ControlPlane {
            run_dir: run_dir.path().to_owned(),
            run_dir_guard: Some(run_dir),
            admin_kubeconfig: PathBuf::new(),
            provisioner_kubeconfig: PathBuf::new(),
            restricted_kubeconfigs: Vec::new(),
            local: None,
            failed: AtomicBool::new(false),
        };
        let started = match std::env::var_os(ATTACH_KUBECONFIG_ENV) {
            Some(kubeconfig) => control_plane.attach(PathBuf::from(kubeconfig)),
            None => control_plane.start_local().await,
        };
        let outcome = match started {
            Ok(()) => control_plane.apply_provisioner_rbac().await,
            Err(error) => Err(error),
        };
        match outcome {
            Ok(()) => Ok(control_plane),
            Err(error) => {
                control_plane.mark_failed();
                let hint = if keep_run_dir_requested() {
                    format!("run dir kept at {}", control_plane.run_dir.display())
                } else {
                    format!("set {KEEP_RUN_DIR_ENV}=1 to keep the run dir with all logs")
                };
                // Dropping stops whatever did start.
                Err(error.context(format!("starting the control plane failed ({hint})")))
            }
        }
    }

    /// The PIDs of the local components by name (none when attached): what a benchmark reads
    /// their CPU time from.
    pub async fn component_pids(&self) -> Vec<(&'static str, u32)> {
        match &self.local {
            Some(local) => local.lock().await.pids(),
            None => Vec::new(),
        }
    }

    /// Kubeconfig of `admin` (group `system:masters`, bypasses RBAC).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// Kubeconfig of `system:serviceaccount:wasm-provisioner:wasm-provisioner`, the identity
    /// `deploy/rbac.yaml` binds: a provisioner run with it has exactly the deployed permissions.
    ///
    /// When attached to `WP_KUBECONFIG` this is the admin kubeconfig, so RBAC is then not proven.
    pub fn provisioner_kubeconfig(&self) -> &Path {
        &self.provisioner_kubeconfig
    }

    /// Kubeconfig of spare identity `n` (1..=3), user [`ControlPlane::restricted_user`]`(n)`,
    /// which has no permissions until a test binds some.
    ///
    /// When attached to `WP_KUBECONFIG` this is the admin kubeconfig, so RBAC is then not proven.
    ///
    /// # Panics
    /// If `n` is not in `1..=3`.
    pub fn restricted_kubeconfig(&self, n: usize) -> &Path {
        assert_restricted_index(n);
        &self.restricted_kubeconfigs[n - 1]
    }

    /// `system:serviceaccount:wasm-provisioner:restricted-<n>`, the username behind
    /// [`ControlPlane::restricted_kubeconfig`]`(n)`; bind roles to it with `kind: User` (or to
    /// ServiceAccount `restricted-<n>` in namespace `wasm-provisioner`).
    ///
    /// # Panics
    /// If `n` is not in `1..=3`.
    pub fn restricted_user(&self, n: usize) -> String {
        assert_restricted_index(n);
        service_account_user(PROVISIONER_NAMESPACE, &restricted_account_name(n))
    }

    /// The provisioner's username, `system:serviceaccount:wasm-provisioner:wasm-provisioner`.
    pub fn provisioner_user(&self) -> String {
        service_account_user(PROVISIONER_NAMESPACE, PROVISIONER_SERVICE_ACCOUNT)
    }

    /// A client authenticated as admin.
    pub async fn admin_client(&self) -> anyhow::Result<kube::Client> {
        ControlPlane::client_for(&self.admin_kubeconfig).await
    }

    /// A client for the current context of `kubeconfig`.
    pub async fn client_for(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
        let kubeconfig_data = Kubeconfig::read_from(kubeconfig)
            .with_context(|| format!("reading kubeconfig {}", kubeconfig.display()))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig_data, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", kubeconfig.display()))?;
        kube::Client::try_from(config).context("building a Kubernetes client")
    }

    /// Temp dir for this run: kubeconfigs, token file, component logs (`etcd.log`,
    /// `kube-apiserver.log`, `kube-controller-manager.log`, and `kube-controller-manager-<n>.log`
    /// after [`ControlPlane::start_controller_manager`]). Removed on drop unless
    /// `WP_KEEP_RUN_DIR=1` and the start failed, the thread is panicking, or
    /// [`ControlPlane::mark_failed`] was called.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Whether this is an existing cluster from `WP_KUBECONFIG` rather than local processes.
    /// RBAC assertions and outage tests only mean something when this is `false`.
    pub fn is_attached(&self) -> bool {
        self.local.is_none()
    }

    /// The API server's URL, e.g. `https://127.0.0.1:41234` (read from the admin kubeconfig).
    pub fn apiserver_url(&self) -> anyhow::Result<String> {
        let kubeconfig = Kubeconfig::read_from(&self.admin_kubeconfig)?;
        kubeconfig
            .clusters
            .first()
            .and_then(|cluster| cluster.cluster.as_ref())
            .and_then(|cluster| cluster.server.clone())
            .context("admin kubeconfig names no server")
    }

    /// Kills the API server only (SIGTERM, SIGKILL after 5 s), for outage tests. etcd and
    /// kube-controller-manager keep running. Does nothing if it is already stopped.
    pub async fn stop_apiserver(&self) -> anyhow::Result<()> {
        let mut local = self.local("stop_apiserver")?.lock().await;
        local.stop_apiserver().await
    }

    /// Starts the API server again on the same port with the same arguments and waits until it
    /// is ready. Does nothing if it is running.
    pub async fn start_apiserver(&self) -> anyhow::Result<()> {
        let mut local = self.local("start_apiserver")?.lock().await;
        local.start_apiserver().await
    }

    /// Kills kube-controller-manager only (SIGTERM, SIGKILL after 5 s), for tests of what happens
    /// while nobody marks or binds claims. etcd and the API server keep running. Does nothing if
    /// it is already stopped.
    ///
    /// Every test sharing this control plane loses its PV binder meanwhile: call it only from
    /// tests that run one at a time, and start it again however the test ends.
    pub async fn stop_controller_manager(&self) -> anyhow::Result<()> {
        let mut local = self.local("stop_controller_manager")?.lock().await;
        local.stop_controller_manager().await
    }

    /// Starts kube-controller-manager again with the same arguments and waits until its PV binder
    /// runs. Each restart logs to a new file in the run dir (`kube-controller-manager-2.log`,
    /// `-3.log`, ...), so the earlier logs are kept. Does nothing if it is running.
    pub async fn start_controller_manager(&self) -> anyhow::Result<()> {
        let mut local = self.local("start_controller_manager")?.lock().await;
        local.start_controller_manager().await
    }

    /// Kills every component by PID (SIGTERM, SIGKILL after 5 s). Idempotent; also run on drop.
    /// A no-op when attached to `WP_KUBECONFIG`.
    pub fn stop(&mut self) {
        if let Some(local) = self.local.take() {
            local.into_inner().stop();
        }
    }

    /// Records that a test using this control plane failed, so the run dir (component logs,
    /// and whatever tests wrote there) is kept on drop when `WP_KEEP_RUN_DIR=1`. For a control
    /// plane shared across tests, where no panic unwinds through its drop.
    pub fn mark_failed(&self) {
        self.failed.store(true, Ordering::Relaxed);
    }

    fn local(&self, operation: &str) -> anyhow::Result<&tokio::sync::Mutex<LocalComponents>> {
        self.local.as_ref().with_context(|| {
            format!("{operation} needs a local control plane; it is not possible when attached via {ATTACH_KUBECONFIG_ENV}")
        })
    }

    /// Uses an existing cluster: every identity is its admin.
    fn attach(&mut self, kubeconfig: PathBuf) -> anyhow::Result<()> {
        ensure!(
            kubeconfig.is_file(),
            "{ATTACH_KUBECONFIG_ENV}={} is not a file",
            kubeconfig.display()
        );
        self.provisioner_kubeconfig = kubeconfig.clone();
        self.restricted_kubeconfigs = vec![kubeconfig.clone(); RESTRICTED_IDENTITIES];
        self.admin_kubeconfig = kubeconfig;
        Ok(())
    }

    async fn start_local(&mut self) -> anyhow::Result<()> {
        let binaries = Binaries::locate()?;
        let (local, kubeconfigs) = LocalComponents::start(&binaries, &self.run_dir).await?;
        self.admin_kubeconfig = kubeconfigs.admin;
        self.provisioner_kubeconfig = kubeconfigs.provisioner;
        self.restricted_kubeconfigs = kubeconfigs.restricted;
        self.local = Some(tokio::sync::Mutex::new(local));
        Ok(())
    }

    /// Applies `deploy/rbac.yaml` as admin, then waits until the RBAC authorizer's cache lets
    /// the provisioner list PVs, so tests never race the binding.
    async fn apply_provisioner_rbac(&self) -> anyhow::Result<()> {
        let admin = self.admin_client().await?;
        wait_for(
            "the API server to accept deploy/rbac.yaml",
            RBAC_EFFECTIVE_TIMEOUT,
            || async { apply_yaml(&admin, RBAC_YAML).await.map(Some) },
        )
        .await?;
        let provisioner = ControlPlane::client_for(&self.provisioner_kubeconfig).await?;
        let volumes: Api<PersistentVolume> = Api::all(provisioner);
        wait_for(
            "the provisioner identity to be allowed to list PersistentVolumes",
            RBAC_EFFECTIVE_TIMEOUT,
            || async {
                Ok(volumes
                    .list_metadata(&ListParams::default().limit(1))
                    .await
                    .ok()
                    .map(|_| ()))
            },
        )
        .await
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
        if keep_run_dir_requested()
            && (self.failed.load(Ordering::Relaxed) || std::thread::panicking())
            && let Some(run_dir) = self.run_dir_guard.take()
        {
            let kept = run_dir.keep();
            eprintln!(
                "wp-harness: kept the control plane run dir at {}",
                kept.display()
            );
        }
    }
}

fn keep_run_dir_requested() -> bool {
    std::env::var(KEEP_RUN_DIR_ENV).is_ok_and(|value| value == "1")
}

fn assert_restricted_index(n: usize) {
    assert!(
        (1..=RESTRICTED_IDENTITIES).contains(&n),
        "restricted identities are numbered 1..={RESTRICTED_IDENTITIES}, got {n}"
    );
}
