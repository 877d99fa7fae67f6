//! `run`'s flags, in the groups `run --help` shows them in. What they mean together, and which
//! combinations are refused, is [`super::settings`]'s.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::{CompileArgs, parse_duration, parse_http_path, parse_node_name};

/// `wasm-provisioner run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub guests: GuestArgs,
    #[command(flatten)]
    pub api: ApiClientArgs,
    #[command(flatten)]
    pub controller: ControllerArgs,
    #[command(flatten)]
    pub retries: RetryArgs,
    #[command(flatten)]
    pub intent: IntentArgs,
    #[command(flatten)]
    pub election: ElectionArgs,
    #[command(flatten)]
    pub node: NodeArgs,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    #[command(flatten)]
    pub registry: super::RegistryArgs,
}

/// Where the guests come from and how they are compiled and run.
#[derive(Debug, Args)]
#[command(next_help_heading = "Guests")]
pub struct GuestArgs {
    /// Directory holding `NAME.wasm` guests and their `NAME.toml` grant files.
    #[arg(long, env = "WP_PLUGINS")]
    pub plugins: PathBuf,
    /// Full rescan of the plugins directory this often, on top of file-change events.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub plugins_rescan_interval: Duration,
    /// How often grants naming a `[module] source` are checked, and their module fetched when
    /// it is missing or not the one they vouch for (a failing one backs off on its own).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub fetch_interval: Duration,
    /// Quiet time after a change in the plugins directory before it is loaded (partial writes).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub plugins_debounce: Duration,
    /// Directory for compiled guests (native code), keyed by module hash and engine; must not
    /// be, contain or lie inside the plugins directory. Without it every start compiles.
    #[arg(long, env = "WP_MODULE_CACHE")]
    pub module_cache: Option<PathBuf>,
    /// Instance allocation: `auto` uses the pooling allocator when the address space allows it.
    #[arg(long, value_enum, default_value_t = crate::wasm::Pooling::Auto)]
    pub pooling: crate::wasm::Pooling,
    /// Worker threads of the guest executor, apart from the controller's own (default: one per
    /// CPU): they drive the guest calls' timers, while each call runs on a thread of its own.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub guest_threads: Option<u16>,
    /// How much nicer (lower CPU priority) than the controller a guest call's thread is once the
    /// call has run past its first slice (10 ms), 0..=19: a guest spinning until its deadline
    /// then never delays watches, reconciles or lease renewals.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub guest_nice: i32,
    /// The compiler child's limits.
    #[command(flatten)]
    pub compile: CompileArgs,
    /// The kubelet's directory as this process sees it: a read-write grant directory on its
    /// filesystem (or on that of `/` or the container runtime's) loads with a warning
    /// (docs/threat-model.md, "Disk"). In a container the kubelet's own mounts tell it too.
    #[arg(long, env = "KUBELET_DIR", default_value = crate::wasm::nodefs::DEFAULT_KUBELET_DIR)]
    pub kubelet_dir: PathBuf,
}

/// How the API server is reached, and how hard.
#[derive(Debug, Args)]
#[command(next_help_heading = "API client")]
pub struct ApiClientArgs {
    /// Kubeconfig file; without it the in-cluster config or ~/.kube/config is used.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Client-side API requests per second (watches excluded). Answers of 429 (API Priority and
    /// Fairness) and 503/504 are retried after their Retry-After, with exponential backoff.
    #[arg(long, default_value_t = 50.0)]
    pub kube_api_qps: f64,
    /// Client-side API request burst.
    #[arg(long, default_value_t = 100)]
    pub kube_api_burst: u32,
}

/// How much work runs at once, how long it may take, and who it is said to be done by.
#[derive(Debug, Args)]
#[command(next_help_heading = "Controller")]
pub struct ControllerArgs {
    /// Concurrent claim reconciles, and as many volume reconciles.
    ///
    /// Tasks, not threads: a reconcile spends most of its time waiting for the API server, so
    /// this many (one fewer claim attempts) keep the API budget, not the distance to the API
    /// server, the bound on throughput (docs/benchmarks.md).
    #[arg(long, default_value_t = crate::controller::DEFAULT_WORKER_THREADS)]
    pub worker_threads: u16,
    /// How often every claim and volume is reconciled again.
    #[arg(long, default_value = "15m", value_parser = parse_duration)]
    pub resync_period: Duration,
    /// Bound on one provision operation (guest call and API writes).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub provision_timeout: Duration,
    /// Bound on one delete operation.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub delete_timeout: Duration,
    /// How long in-flight work may take to finish after SIGTERM.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// This replica's name in events.
    #[arg(long, env = "POD_NAME")]
    pub instance_name: Option<String>,
    /// Keep every claim and PV whole in the caches, as an informer does (for comparisons; by
    /// default settled ones are kept as their identity only).
    #[arg(long, default_value_t = false, hide = true)]
    pub cache_whole_objects: bool,
    /// Provision a claim only once kube-controller-manager has marked it for its provisioner
    /// (the storage-provisioner annotation), as the Go library does. By default a claim of a
    /// served class that deletes its volumes, with no unbound PV in that class it could be bound
    /// to instead, is provisioned as soon as it is seen.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub wait_for_mark: bool,
}

/// What happens after a failure.
#[derive(Debug, Args)]
#[command(next_help_heading = "Retries")]
pub struct RetryArgs {
    /// First retry delay after a failure; doubles per failure.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub retry_interval_start: Duration,
    /// Largest retry delay.
    #[arg(long, default_value = "1000s", value_parser = parse_duration)]
    pub retry_interval_max: Duration,
    /// Provision failures before a claim is given up until its spec changes (0 = never).
    #[arg(long, default_value_t = 15)]
    pub failed_provision_threshold: u32,
    /// Delete failures before a volume is given up until its spec changes (0 = never).
    #[arg(long, default_value_t = 15)]
    pub failed_delete_threshold: u32,
    /// Attempts to create a provisioned PV object before deleting its storage again.
    #[arg(long, default_value_t = 5)]
    pub create_pv_retry_count: u32,
    /// Pause between those attempts.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub create_pv_retry_interval: Duration,
}

/// What records that storage is being made or deleted, so that none leaks.
#[derive(Debug, Args)]
#[command(next_help_heading = "Intent record and finalizers")]
pub struct IntentArgs {
    /// How the intent to provision is recorded before a guest is called, so a claim deleted
    /// mid-provision or a crash cannot leak storage: `log` (one batched ConfigMap per replica,
    /// about one API write per claim), `claim-finalizer` (wasm-provisioner.dev/provisioning on
    /// the claim, two more writes per claim; always used in per-claim and node modes) or `off`.
    #[arg(long, value_enum, default_value_t = IntentMode::Log)]
    pub intent_record: IntentMode,
    /// `--claim-finalizer=false` is `--intent-record=off` (kept for existing deployments).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", hide = true)]
    pub claim_finalizer: bool,
    /// Hold PVs with the Delete policy with `external-provisioner.volume.kubernetes.io/finalizer`
    /// (set when the PV is created) until their storage is deleted: the PV, marked deleted with
    /// our finalizer on it, is the record that survives a kill between its DELETE and the
    /// storage delete. `--add-pv-finalizer=false` deletes the storage first and the PV after,
    /// as the Go library does without it.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub add_pv_finalizer: bool,
}

/// `--intent-record`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IntentMode {
    /// One batched intent log (ConfigMap) per replica.
    Log,
    /// A finalizer on each claim.
    ClaimFinalizer,
    /// No intent record.
    Off,
}

/// Which replica may write, and the leases that say so.
#[derive(Debug, Args)]
#[command(next_help_heading = "Leader election")]
pub struct ElectionArgs {
    /// Elect a leader among replicas (`--leader-election=false` for a single replica).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub leader_election: bool,
    /// `leader`: one replica works, the others stand by; `per-claim`: all work, one lease per claim/volume.
    #[arg(long, value_enum, default_value_t = ElectionMode::Leader)]
    pub leader_election_mode: ElectionMode,
    /// Namespace of the leases and the intent log [default: $POD_NAMESPACE, else the service account's, else `default`].
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_election_namespace: Option<String>,
    /// Name of the leader lease (and prefix of per-claim leases) [default: the binary's name].
    #[arg(long)]
    pub leader_election_lease_name: Option<String>,
    /// How long a lease stays valid for others after its holder last renewed it.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub leader_election_lease_duration: Duration,
    /// How long the holder keeps writing without a successful renew.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub leader_election_renew_deadline: Duration,
    /// How often the holder renews and candidates retry.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub leader_election_retry_period: Duration,
}

/// `--leader-election-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ElectionMode {
    /// One lease for the whole controller.
    Leader,
    /// One short-lived lease per claim and per volume (the 2017 seed's active-active mode).
    PerClaim,
}

/// One instance per node, serving that node's claims and volumes.
#[derive(Debug, Args)]
#[command(next_help_heading = "Node deployment")]
pub struct NodeArgs {
    /// One instance per node: provision only claims whose selected node is --node-name, delete
    /// only PVs pinned to it. Turns `leader` election off (per-claim mode stays available).
    #[arg(long, default_value_t = false)]
    pub node_deployment: bool,
    /// This instance's node (--node-deployment).
    #[arg(long, env = "NODE_NAME", required_if_eq("node_deployment", "true"), value_parser = parse_node_name)]
    pub node_name: Option<String>,
    /// Shortest wait before a node instance competes for an immediate-binding claim.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub node_deployment_base_delay: Duration,
    /// Longest such wait (the actual wait is random in between).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub node_deployment_max_delay: Duration,
    /// Let node instances pick a node for immediate-binding claims (a class can still opt out).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub node_deployment_immediate_binding: bool,
    /// How long a Released PV's node must be gone before the PV is deleted without cleanup.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub node_gone_grace: Duration,
}

/// The operator's HTTP endpoint.
#[derive(Debug, Args)]
#[command(next_help_heading = "Metrics and health")]
pub struct MetricsArgs {
    /// Serve Prometheus metrics, /healthz and /readyz on this address (e.g. 0.0.0.0:8080); off when unset.
    #[arg(long)]
    pub metrics_address: Option<SocketAddr>,
    /// Path of the metrics endpoint.
    #[arg(long, default_value = "/metrics", value_parser = parse_http_path)]
    pub metrics_path: String,
}
