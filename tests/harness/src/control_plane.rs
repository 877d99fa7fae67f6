//! The control plane itself: etcd, kube-apiserver and kube-controller-manager on loopback, with
//! the provisioner's RBAC applied; or an existing cluster named by `WP_KUBECONFIG`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume};
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tempfile::TempDir;

use crate::apply::{RBAC_YAML, apply_yaml};
use crate::binaries::Binaries;
use crate::identity::{Identity, PROVISIONER_NAMESPACE, service_account_user, token_auth_csv};
use crate::ports::free_loopback_port;
use crate::process::Process;
use crate::wait::wait_for;

/// Set to a kubeconfig path to use an existing cluster instead of starting one.
pub const ATTACH_KUBECONFIG_ENV: &str = "WP_KUBECONFIG";

/// Set to `1` to keep the run dir (logs, kubeconfigs) when start fails or a test panics.
pub const KEEP_RUN_DIR_ENV: &str = "WP_KEEP_RUN_DIR";

/// How many spare `restricted-N` identities exist, for tests that bind their own, narrower roles.
pub const RESTRICTED_IDENTITIES: usize = 3;

/// Name of the provisioner's ServiceAccount in `deploy/rbac.yaml`.
const PROVISIONER_SERVICE_ACCOUNT: &str = "wasm-provisioner";

/// How long stopped components get between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Starts retried when a port handed out as free was taken before our child bound it.
const START_ATTEMPTS: usize = 3;

const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Generous: on 2 cores next to a cargo build, the API server takes tens of seconds to be ready.
const APISERVER_READY_TIMEOUT: Duration = Duration::from_secs(120);
const CONTROLLER_MANAGER_READY_TIMEOUT: Duration = Duration::from_secs(60);
const RBAC_EFFECTIVE_TIMEOUT: Duration = Duration::from_secs(30);

/// How many log lines a start failure quotes.
const LOG_TAIL_LINES: usize = 40;

/// Logged by etcd (3.4, capnslog and zap loggers alike) once its client listener serves.
const ETCD_READY: &str = "ready to serve client requests";

/// Logged by kube-controller-manager once the PV binder (which annotates claims for external
/// provisioners and binds PVs) is running. Stable wording across releases (`Started %q`).
const PV_BINDER_STARTED: &str = "Started \"persistentvolume-binder\"";

/// Controllers the provisioner relies on; everything else (pods, nodes, tokens) is left out.
const CONTROLLERS: &str =
    "persistentvolume-binder,pv-protection,pvc-protection,namespace,garbagecollector";

/// A running local control plane, or an attached existing cluster.
///
/// Processes are stopped by PID in [`ControlPlane::stop`], which `Drop` also calls.
pub struct ControlPlane {
    run_dir: PathBuf,
    run_dir_guard: Option<TempDir>,
    admin_kubeconfig: PathBuf,
    provisioner_kubeconfig: PathBuf,
    restricted_kubeconfigs: Vec<PathBuf>,
    /// `None` when attached to `WP_KUBECONFIG`.
    local: Option<LocalComponents>,
    start_failed: bool,
}

/// The processes of a local control plane and what is needed to restart the API server.
struct LocalComponents {
    etcd: Process,
    apiserver: Option<Process>,
    apiserver_launch: Launch,
    controller_manager: Process,
    /// Kept alive so etcd's data outlives nothing but this control plane.
    _etcd_data_dir: Option<TempDir>,
}

/// A program, its arguments and its log file: enough to start the same component again.
#[derive(Debug, Clone)]
struct Launch {
    program: PathBuf,
    args: Vec<String>,
    log_path: PathBuf,
}

impl Launch {
    fn new(program: &Path, args: Vec<String>, log_path: PathBuf) -> Launch {
        Launch {
            program: program.to_owned(),
            args,
            log_path,
        }
    }

    fn spawn(&self) -> anyhow::Result<Process> {
        let mut command = Command::new(&self.program);
        command.args(&self.args);
        Process::spawn(command, self.log_path.clone())
    }
}

/// Loopback ports of one start attempt.
struct Ports {
    etcd_client: u16,
    etcd_peer: u16,
    apiserver: u16,
}

impl Ports {
    fn pick() -> anyhow::Result<Ports> {
        Ok(Ports {
            etcd_client: free_loopback_port()?,
            etcd_peer: free_loopback_port()?,
            apiserver: free_loopback_port()?,
        })
    }
}

/// Files written once per run and shared by every start attempt.
struct RunFiles {
    token_auth_file: PathBuf,
    service_account_key: PathBuf,
    cert_dir: PathBuf,
    identities: Identities,
}

struct Identities {
    admin: Identity,
    provisioner: Identity,
    restricted: Vec<Identity>,
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
            start_failed: false,
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
                control_plane.start_failed = true;
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
    /// `kube-apiserver.log`, `kube-controller-manager.log`). Removed on drop unless
    /// `WP_KEEP_RUN_DIR=1` and the start failed or the thread is panicking.
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
    pub async fn stop_apiserver(&mut self) -> anyhow::Result<()> {
        let local = self.local_mut("stop_apiserver")?;
        if let Some(mut apiserver) = local.apiserver.take() {
            apiserver.terminate_async(STOP_GRACE).await?;
        }
        Ok(())
    }

    /// Starts the API server again on the same port with the same arguments and waits until it
    /// is ready. Does nothing if it is running.
    pub async fn start_apiserver(&mut self) -> anyhow::Result<()> {
        let admin_kubeconfig = self.admin_kubeconfig.clone();
        let local = self.local_mut("start_apiserver")?;
        if local.apiserver.as_mut().is_some_and(Process::is_running) {
            return Ok(());
        }
        let mut apiserver = local.apiserver_launch.spawn()?;
        wait_for_apiserver(&mut apiserver, &admin_kubeconfig).await?;
        local.apiserver = Some(apiserver);
        Ok(())
    }

    /// Kills every component by PID (SIGTERM, SIGKILL after 5 s). Idempotent; also run on drop.
    /// A no-op when attached to `WP_KUBECONFIG`.
    pub fn stop(&mut self) {
        let Some(mut local) = self.local.take() else {
            return;
        };
        // Controller manager first so it does not log connection errors while the rest goes.
        let mut processes: Vec<&mut Process> = [
            Some(&mut local.controller_manager),
            local.apiserver.as_mut(),
            Some(&mut local.etcd),
        ]
        .into_iter()
        .flatten()
        .collect();
        for process in processes.iter_mut() {
            process.send_sigterm();
        }
        let deadline = Instant::now() + STOP_GRACE;
        while processes.iter_mut().any(|process| process.is_running()) && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        for process in processes {
            process.kill();
        }
    }

    fn local_mut(&mut self, operation: &str) -> anyhow::Result<&mut LocalComponents> {
        self.local.as_mut().with_context(|| {
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
        let files = write_run_files(&self.run_dir)?;
        let etcd_data_dir = tmpfs_dir_if_available()?;
        let etcd_data_root = etcd_data_dir.as_ref().map_or_else(
            || self.run_dir.join("etcd-data"),
            |dir| dir.path().to_owned(),
        );

        for attempt in 1..=START_ATTEMPTS {
            let ports = Ports::pick()?;
            let server = format!("https://127.0.0.1:{}", ports.apiserver);
            let identities = &files.identities;
            self.admin_kubeconfig = identities.admin.write_kubeconfig(&self.run_dir, &server)?;
            self.provisioner_kubeconfig = identities
                .provisioner
                .write_kubeconfig(&self.run_dir, &server)?;
            self.restricted_kubeconfigs = identities
                .restricted
                .iter()
                .map(|identity| identity.write_kubeconfig(&self.run_dir, &server))
                .collect::<anyhow::Result<_>>()?;

            // A fresh data dir per attempt: etcd remembers its peer URLs.
            let etcd_data = etcd_data_root.join(format!("attempt-{attempt}"));
            match self
                .start_processes(&binaries, &files, &ports, &etcd_data)
                .await
            {
                Ok(mut local) => {
                    local._etcd_data_dir = etcd_data_dir;
                    self.local = Some(local);
                    return Ok(());
                }
                Err(error) if attempt < START_ATTEMPTS && is_port_collision(&error) => continue,
                Err(error) => return Err(error),
            }
        }
        unreachable!("the last attempt returns its error")
    }

    async fn start_processes(
        &self,
        binaries: &Binaries,
        files: &RunFiles,
        ports: &Ports,
        etcd_data: &Path,
    ) -> anyhow::Result<LocalComponents> {
        let etcd_client_url = format!("http://127.0.0.1:{}", ports.etcd_client);
        let etcd_peer_url = format!("http://127.0.0.1:{}", ports.etcd_peer);
        let etcd_launch = Launch::new(
            &binaries.etcd,
            flags(&[
                ("--name", "wp-harness"),
                ("--data-dir", &etcd_data.display().to_string()),
                ("--listen-client-urls", &etcd_client_url),
                ("--advertise-client-urls", &etcd_client_url),
                ("--listen-peer-urls", &etcd_peer_url),
                ("--initial-advertise-peer-urls", &etcd_peer_url),
                ("--initial-cluster", &format!("wp-harness={etcd_peer_url}")),
            ]),
            self.run_dir.join("etcd.log"),
        );
        let mut etcd = etcd_launch.spawn()?;
        let etcd_port = ports.etcd_client;
        let etcd_log = etcd.log_path().to_owned();
        await_ready(&mut etcd, "serving clients", ETCD_READY_TIMEOUT, || {
            let etcd_log = etcd_log.clone();
            async move {
                // The log line proves the listener is etcd's, not a port thief's.
                let said_ready = std::fs::read_to_string(&etcd_log)
                    .unwrap_or_default()
                    .contains(ETCD_READY);
                Ok(said_ready
                    && tokio::net::TcpStream::connect(("127.0.0.1", etcd_port))
                        .await
                        .is_ok())
            }
        })
        .await?;

        let apiserver_launch = Launch::new(
            &binaries.kube_apiserver,
            flags(&[
                ("--etcd-servers", &etcd_client_url),
                ("--secure-port", &ports.apiserver.to_string()),
                ("--bind-address", "127.0.0.1"),
                ("--advertise-address", "127.0.0.1"),
                // No kubernetes Service endpoints: validation rejects the loopback advertise address.
                ("--endpoint-reconciler-type", "none"),
                ("--cert-dir", &files.cert_dir.display().to_string()),
                (
                    "--token-auth-file",
                    &files.token_auth_file.display().to_string(),
                ),
                ("--authorization-mode", "RBAC"),
                ("--service-account-issuer", "https://kubernetes.default.svc"),
                (
                    "--service-account-key-file",
                    &files.service_account_key.display().to_string(),
                ),
                (
                    "--service-account-signing-key-file",
                    &files.service_account_key.display().to_string(),
                ),
                ("--service-cluster-ip-range", "10.0.0.0/24"),
                ("--allow-privileged", "true"),
            ]),
            self.run_dir.join("kube-apiserver.log"),
        );
        let mut apiserver = apiserver_launch.spawn()?;
        wait_for_apiserver(&mut apiserver, &self.admin_kubeconfig).await?;

        let controller_manager_launch = Launch::new(
            &binaries.kube_controller_manager,
            flags(&[
                ("--kubeconfig", &self.admin_kubeconfig.display().to_string()),
                ("--controllers", CONTROLLERS),
                ("--leader-elect", "false"),
                ("--use-service-account-credentials", "false"),
                // No serving at all: nothing scrapes it, and it saves two ports.
                ("--port", "0"),
                ("--secure-port", "0"),
            ]),
            self.run_dir.join("kube-controller-manager.log"),
        );
        let mut controller_manager = controller_manager_launch.spawn()?;
        let log_path = controller_manager.log_path().to_owned();
        await_ready(
            &mut controller_manager,
            "running the PV binder",
            CONTROLLER_MANAGER_READY_TIMEOUT,
            || {
                let log_path = log_path.clone();
                async move {
                    Ok(std::fs::read_to_string(&log_path)
                        .unwrap_or_default()
                        .contains(PV_BINDER_STARTED))
                }
            },
        )
        .await?;

        Ok(LocalComponents {
            etcd,
            apiserver: Some(apiserver),
            apiserver_launch,
            controller_manager,
            _etcd_data_dir: None,
        })
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
            && (self.start_failed || std::thread::panicking())
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

/// Waits until the API server answers `/readyz` and has created the `default` namespace.
async fn wait_for_apiserver(
    apiserver: &mut Process,
    admin_kubeconfig: &Path,
) -> anyhow::Result<()> {
    let admin = ControlPlane::client_for(admin_kubeconfig).await?;
    await_ready(
        apiserver,
        "ready (/readyz and namespace default)",
        APISERVER_READY_TIMEOUT,
        || {
            let admin = admin.clone();
            async move {
                let readyz = http::Request::get("/readyz").body(Vec::new())?;
                if admin.request_text(readyz).await?.trim() != "ok" {
                    return Ok(false);
                }
                Ok(Api::<Namespace>::all(admin)
                    .get_opt("default")
                    .await?
                    .is_some())
            }
        },
    )
    .await
}

/// Polls `ready` every 100 ms until it returns `Ok(true)`; fails at once if `process` exits and
/// at `timeout` otherwise, quoting the end of the process's log either way.
async fn await_ready<F, Fut>(
    process: &mut Process,
    what: &str,
    timeout: Duration,
    mut ready: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = None;
    loop {
        if let Some(status) = process.exit_status() {
            bail!(
                "{} (pid {}) exited with {status} before {what}; last lines of {}:\n{}",
                process.name(),
                process.pid(),
                process.log_path().display(),
                process.log_tail(LOG_TAIL_LINES)
            );
        }
        match ready().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(error) => last_error = Some(error),
        }
        if tokio::time::Instant::now() >= deadline {
            let last_error = last_error
                .map(|error| format!(" (last check error: {error:#})"))
                .unwrap_or_default();
            bail!(
                "{} (pid {}) not {what} within {timeout:?}{last_error}; last lines of {}:\n{}",
                process.name(),
                process.pid(),
                process.log_path().display(),
                process.log_tail(LOG_TAIL_LINES)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Writes the token file and service-account key and chooses every identity's token.
fn write_run_files(run_dir: &Path) -> anyhow::Result<RunFiles> {
    let identities = Identities {
        admin: Identity::admin()?,
        provisioner: Identity::service_account(PROVISIONER_NAMESPACE, PROVISIONER_SERVICE_ACCOUNT)?,
        restricted: (1..=RESTRICTED_IDENTITIES)
            .map(|n| Identity::service_account(PROVISIONER_NAMESPACE, &restricted_account_name(n)))
            .collect::<anyhow::Result<_>>()?,
    };
    let mut all = vec![&identities.admin, &identities.provisioner];
    all.extend(identities.restricted.iter());
    let token_auth_file = run_dir.join("tokens.csv");
    std::fs::write(&token_auth_file, token_auth_csv(&all)).context("writing tokens.csv")?;

    let service_account_key = run_dir.join("service-account.key");
    generate_rsa_key(&service_account_key)?;

    let cert_dir = run_dir.join("apiserver-certs");
    std::fs::create_dir_all(&cert_dir).context("creating the API server cert dir")?;
    Ok(RunFiles {
        token_auth_file,
        service_account_key,
        cert_dir,
        identities,
    })
}

/// The API server signs (and verifies) service account tokens with this key; it accepts the
/// private key PEM for both flags.
fn generate_rsa_key(path: &Path) -> anyhow::Result<()> {
    let output = Command::new("openssl")
        .args(["genrsa", "-out"])
        .arg(path)
        .arg("2048")
        .output()
        .context(
            "running `openssl genrsa` for the service account key (is the openssl CLI installed?)",
        )?;
    ensure!(
        output.status.success(),
        "`openssl genrsa` failed with {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// A temp dir on /dev/shm when it exists: etcd fsyncs every write, which is slow on shared disks
/// and free on tmpfs.
fn tmpfs_dir_if_available() -> anyhow::Result<Option<TempDir>> {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        return Ok(None);
    }
    Ok(tempfile::Builder::new()
        .prefix("wp-etcd-")
        .tempdir_in(shm)
        .ok())
}

fn is_port_collision(error: &anyhow::Error) -> bool {
    format!("{error:#}").contains("address already in use")
}

fn keep_run_dir_requested() -> bool {
    std::env::var(KEEP_RUN_DIR_ENV).is_ok_and(|value| value == "1")
}

fn restricted_account_name(n: usize) -> String {
    format!("restricted-{n}")
}

fn assert_restricted_index(n: usize) {
    assert!(
        (1..=RESTRICTED_IDENTITIES).contains(&n),
        "restricted identities are numbered 1..={RESTRICTED_IDENTITIES}, got {n}"
    );
}

/// `--flag=value` arguments, written as pairs so each flag stays next to its value.
fn flags(pairs: &[(&str, &str)]) -> Vec<String> {
    pairs
        .iter()
        .map(|(flag, value)| format!("{flag}={value}"))
        .collect()
}
