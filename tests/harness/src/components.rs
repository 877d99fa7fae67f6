//! Launching the local components (etcd, kube-apiserver, kube-controller-manager) on fresh
//! loopback ports, each awaited until it really serves, and stopping (and starting again) the API
//! server and kube-controller-manager by PID.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;
use tempfile::TempDir;

use crate::binaries::Binaries;
use crate::control_plane::{ControlPlane, PROVISIONER_SERVICE_ACCOUNT, RESTRICTED_IDENTITIES};
use crate::identity::{Identity, PROVISIONER_NAMESPACE, token_auth_csv};
use crate::ports::free_loopback_port;
use crate::process::Process;

/// How long stopped components get between SIGTERM and SIGKILL.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(5);

/// Starts retried when a port handed out as free was taken before our child bound it.
const START_ATTEMPTS: usize = 3;

const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Generous: on 2 cores next to a cargo build, the API server takes tens of seconds to be ready.
const APISERVER_READY_TIMEOUT: Duration = Duration::from_secs(120);
const CONTROLLER_MANAGER_READY_TIMEOUT: Duration = Duration::from_secs(60);

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

/// kube-controller-manager's client budget: 200/s, burst 400, or `WP_KCM_API_QPS` (burst twice
/// that). Benchmarks raise it so that its marks and releases, which it spends the same budget on
/// as on binding the PVs the provisioner makes, do not set the pace of a run.
fn controller_manager_budget() -> (String, String) {
    let qps = std::env::var("WP_KCM_API_QPS")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|&q| q > 0)
        .unwrap_or(200);
    (qps.to_string(), (2 * qps).to_string())
}

/// The processes of a local control plane and what is needed to restart the API server and
/// kube-controller-manager.
pub(crate) struct LocalComponents {
    etcd: Process,
    apiserver: Option<Process>,
    apiserver_launch: Launch,
    controller_manager: Option<Process>,
    controller_manager_launch: Launch,
    /// How many kube-controller-manager processes were started: start `n` logs to
    /// [`controller_manager_log`]`(n)`, so a restart keeps the earlier logs.
    controller_manager_starts: usize,
    /// Where the components' logs go.
    run_dir: PathBuf,
    admin_kubeconfig: PathBuf,
    /// Removes etcd's data (on tmpfs) when the control plane goes.
    _etcd_data_dir: Option<TempDir>,
}

/// The kubeconfig of every identity, pointing at the started API server.
pub(crate) struct Kubeconfigs {
    pub admin: PathBuf,
    pub provisioner: PathBuf,
    pub restricted: Vec<PathBuf>,
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
        self.spawn_logging_to(self.log_path.clone())
    }

    /// Starts the same program with the same arguments, logging to `log_path` instead (created
    /// or truncated): a restart that must not overwrite the first process's log.
    fn spawn_logging_to(&self, log_path: PathBuf) -> anyhow::Result<Process> {
        let mut command = Command::new(&self.program);
        command.args(&self.args);
        Process::spawn(command, log_path)
    }
}

/// The log of kube-controller-manager start `n` (1-based) in `run_dir`:
/// `kube-controller-manager.log` for the first, `kube-controller-manager-<n>.log` after a restart.
fn controller_manager_log(run_dir: &Path, n: usize) -> PathBuf {
    if n <= 1 {
        run_dir.join("kube-controller-manager.log")
    } else {
        run_dir.join(format!("kube-controller-manager-{n}.log"))
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

impl Identities {
    fn write_kubeconfigs(&self, run_dir: &Path, server: &str) -> anyhow::Result<Kubeconfigs> {
        Ok(Kubeconfigs {
            admin: self.admin.write_kubeconfig(run_dir, server)?,
            provisioner: self.provisioner.write_kubeconfig(run_dir, server)?,
            restricted: self
                .restricted
                .iter()
                .map(|identity| identity.write_kubeconfig(run_dir, server))
                .collect::<anyhow::Result<_>>()?,
        })
    }
}

impl LocalComponents {
    /// The PIDs of the running components, by name (the API server's and kube-controller-manager's
    /// while they run).
    pub(crate) fn pids(&self) -> Vec<(&'static str, u32)> {
        let mut pids = vec![("etcd", self.etcd.pid())];
        if let Some(apiserver) = &self.apiserver {
            pids.push(("kube-apiserver", apiserver.pid()));
        }
        if let Some(controller_manager) = &self.controller_manager {
            pids.push(("kube-controller-manager", controller_manager.pid()));
        }
        pids
    }

    /// Starts etcd, kube-apiserver and kube-controller-manager with their files in `run_dir`,
    /// retrying on fresh ports if one was taken in between.
    pub(crate) async fn start(
        binaries: &Binaries,
        run_dir: &Path,
    ) -> anyhow::Result<(LocalComponents, Kubeconfigs)> {
        let files = write_run_files(run_dir)?;
        let etcd_data_dir = tmpfs_dir_if_available();
        let etcd_data_root = etcd_data_dir
            .as_ref()
            .map_or_else(|| run_dir.join("etcd-data"), |dir| dir.path().to_owned());
        let mut attempt = 1;
        loop {
            let ports = Ports::pick()?;
            let server = format!("https://127.0.0.1:{}", ports.apiserver);
            let kubeconfigs = files.identities.write_kubeconfigs(run_dir, &server)?;
            // A fresh data dir per attempt: etcd remembers its peer URLs.
            let etcd_data = etcd_data_root.join(format!("attempt-{attempt}"));
            let started = start_processes(
                binaries,
                run_dir,
                &files,
                &ports,
                &etcd_data,
                &kubeconfigs.admin,
            )
            .await;
            match started {
                Ok(mut local) => {
                    local._etcd_data_dir = etcd_data_dir;
                    return Ok((local, kubeconfigs));
                }
                Err(error) if attempt < START_ATTEMPTS && is_port_collision(&error) => attempt += 1,
                Err(error) => return Err(error),
            }
        }
    }

    /// Stops the API server only (SIGTERM, SIGKILL after 5 s). Does nothing if it is stopped.
    pub(crate) async fn stop_apiserver(&mut self) -> anyhow::Result<()> {
        if let Some(mut apiserver) = self.apiserver.take() {
            apiserver.terminate_async(STOP_GRACE).await?;
        }
        Ok(())
    }

    /// Starts the API server again with its first arguments. Does nothing if it is running.
    pub(crate) async fn start_apiserver(&mut self) -> anyhow::Result<()> {
        if self.apiserver.as_mut().is_some_and(Process::is_running) {
            return Ok(());
        }
        let mut apiserver = self.apiserver_launch.spawn()?;
        wait_for_apiserver(&mut apiserver, &self.admin_kubeconfig).await?;
        self.apiserver = Some(apiserver);
        Ok(())
    }

    /// Stops kube-controller-manager only (SIGTERM, SIGKILL after 5 s). Does nothing if it is
    /// stopped.
    pub(crate) async fn stop_controller_manager(&mut self) -> anyhow::Result<()> {
        if let Some(mut controller_manager) = self.controller_manager.take() {
            controller_manager.terminate_async(STOP_GRACE).await?;
        }
        Ok(())
    }

    /// Starts kube-controller-manager again with its first arguments, logging to
    /// `kube-controller-manager-<n>.log` (the earlier logs stay), and waits until its PV binder
    /// runs. Does nothing if it is running.
    pub(crate) async fn start_controller_manager(&mut self) -> anyhow::Result<()> {
        if self
            .controller_manager
            .as_mut()
            .is_some_and(Process::is_running)
        {
            return Ok(());
        }
        let n = self.controller_manager_starts + 1;
        let controller_manager = spawn_controller_manager(
            &self.controller_manager_launch,
            controller_manager_log(&self.run_dir, n),
        )
        .await?;
        self.controller_manager_starts = n;
        self.controller_manager = Some(controller_manager);
        Ok(())
    }

    /// SIGTERM to every component at once, then SIGKILL to whatever still runs after 5 s.
    pub(crate) fn stop(&mut self) {
        // Controller manager first so it does not log connection errors while the rest goes.
        let mut processes: Vec<&mut Process> = [
            self.controller_manager.as_mut(),
            self.apiserver.as_mut(),
            Some(&mut self.etcd),
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
}

async fn start_processes(
    binaries: &Binaries,
    run_dir: &Path,
    files: &RunFiles,
    ports: &Ports,
    etcd_data: &Path,
    admin_kubeconfig: &Path,
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
        run_dir.join("etcd.log"),
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
            // Keeps a claim's `dataSource` of any kind (a volume populator's), as 1.24+ does by
            // default; 1.20 drops such a data source without it.
            ("--feature-gates", "AnyVolumeDataSource=true"),
        ]),
        run_dir.join("kube-apiserver.log"),
    );
    let mut apiserver = apiserver_launch.spawn()?;
    wait_for_apiserver(&mut apiserver, admin_kubeconfig).await?;

    let (kcm_qps, kcm_burst) = controller_manager_budget();
    let controller_manager_launch = Launch::new(
        &binaries.kube_controller_manager,
        flags(&[
            ("--kubeconfig", &admin_kubeconfig.display().to_string()),
            ("--controllers", CONTROLLERS),
            ("--leader-elect", "false"),
            ("--use-service-account-credentials", "false"),
            // Its default client rate (20/s) would make the PV binder, not the provisioner
            // under test, the bottleneck of any run with many claims.
            ("--kube-api-qps", &kcm_qps),
            ("--kube-api-burst", &kcm_burst),
            // No serving at all: nothing scrapes it, and it saves two ports.
            ("--port", "0"),
            ("--secure-port", "0"),
        ]),
        controller_manager_log(run_dir, 1),
    );
    let controller_manager = spawn_controller_manager(
        &controller_manager_launch,
        controller_manager_launch.log_path.clone(),
    )
    .await?;

    Ok(LocalComponents {
        etcd,
        apiserver: Some(apiserver),
        apiserver_launch,
        controller_manager: Some(controller_manager),
        controller_manager_launch,
        controller_manager_starts: 1,
        run_dir: run_dir.to_owned(),
        admin_kubeconfig: admin_kubeconfig.to_owned(),
        _etcd_data_dir: None,
    })
}

/// Starts kube-controller-manager logging to `log_path` and waits until that log says its PV
/// binder started. Each start gets a fresh log, so an earlier process's line cannot pass for it.
async fn spawn_controller_manager(launch: &Launch, log_path: PathBuf) -> anyhow::Result<Process> {
    let mut controller_manager = launch.spawn_logging_to(log_path.clone())?;
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
    Ok(controller_manager)
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
fn tmpfs_dir_if_available() -> Option<TempDir> {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        return None;
    }
    tempfile::Builder::new()
        .prefix("wp-etcd-")
        .tempdir_in(shm)
        .ok()
}

fn is_port_collision(error: &anyhow::Error) -> bool {
    format!("{error:#}").contains("address already in use")
}

pub(crate) fn restricted_account_name(n: usize) -> String {
    format!("restricted-{n}")
}

/// `--flag=value` arguments, written as pairs so each flag stays next to its value.
pub(crate) fn flags(pairs: &[(&str, &str)]) -> Vec<String> {
    pairs
        .iter()
        .map(|(flag, value)| format!("{flag}={value}"))
        .collect()
}
