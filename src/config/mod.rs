//! The command line: parsed once here into typed settings; nothing deeper reads the environment.
//! `run`'s flags are in [`run_flags`], grouped as `run --help` shows them; [`settings`] checks
//! them and turns them into what the controller runs with.

mod registry_flags;
mod run_flags;
mod settings;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use registry_flags::{LoadArgs, PullArgs, PushArgs, RegistryArgs, SaveArgs};
pub use run_flags::{
    ApiClientArgs, ControllerArgs, ElectionArgs, ElectionMode, GuestArgs, IntentArgs, IntentMode,
    MetricsArgs, NodeArgs, RetryArgs, RunArgs,
};
pub use settings::ConfigError;

/// A Kubernetes dynamic volume provisioner whose storage logic is WebAssembly components.
#[derive(Debug, Parser)]
#[command(name = "wasm-provisioner", version = version_text(), about, long_about = None)]
pub struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "WP_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

fn version_text() -> &'static str {
    concat!(
        env!("CARGO_PKG_VERSION"),
        " (guest contract wasm-provisioner:provisioner@0.1.3, serves 0.1.x)"
    )
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for collectors.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the provisioner against a cluster.
    Run(Box<RunArgs>),
    /// Show which contract version and hooks a guest implements, and whether this host runs it.
    Inspect {
        /// The guest's `.wasm` file.
        file: PathBuf,
        /// The compiler child's limits (as `run`'s: the module is compiled in the same child).
        #[command(flatten)]
        compile: CompileArgs,
    },
    /// Run a guest's provision offline and print the PV the controller would create.
    Provision(ProvisionArgs),
    /// Run a guest's delete offline on a PV manifest.
    Delete(DeleteArgs),
    /// Uninstall: remove our finalizers from claims (all, or one) and, for the named
    /// provisioners, the PV finalizer, so nothing hangs once the provisioner is gone.
    ReleaseFinalizers(ReleaseArgs),
    /// Take one PV's storage out of the intent logs (a delete that keeps failing or was given
    /// up): no replica deletes it any more; the storage is left as it is.
    ForgetStorage(ForgetArgs),
    /// Replay a guest against a fixture file of claims and the volumes (or errors) it must
    /// return; exits non-zero when one differs.
    Test {
        /// The guest's `.wasm` file.
        module: PathBuf,
        /// Its grant file (granted directories are replaced by empty scratch ones).
        #[arg(long)]
        grant: PathBuf,
        /// The fixture file (YAML: `cases:` with `class`, `claim`, `expect`).
        fixtures: PathBuf,
        /// Rewrite the file's expectations with what the guest returns now.
        #[arg(long)]
        record: bool,
        /// The compiler child's limits.
        #[command(flatten)]
        compile: CompileArgs,
    },
    /// Write a starter: a grant file from what a module declares it needs, or a new guest crate.
    #[command(subcommand)]
    Scaffold(Scaffold),
    /// Push a guest component to an OCI registry as a wasm artifact.
    Push(PushArgs),
    /// Pull a guest from an OCI registry into a plugins directory (atomically, with its grant).
    Pull(PullArgs),
    /// Pack plugins (NAME.wasm with NAME.toml) into one tarball, for clusters without a registry.
    Save(SaveArgs),
    /// Install the plugins of a `save` tarball into a plugins directory, every digest checked.
    Load(LoadArgs),
    /// Internal: compile the component on stdin under limits, the artifact to stdout (`run`
    /// compiles every guest this way, in a child process).
    #[command(hide = true)]
    CompileGuest {
        /// Address space limit, MiB.
        #[arg(long)]
        memory_mib: u64,
        /// CPU time limit, seconds.
        #[arg(long)]
        cpu_seconds: u64,
    },
}

/// `wasm-provisioner scaffold ...`.
#[derive(Debug, Subcommand)]
pub enum Scaffold {
    /// Print a starter grant file for a module, from the needs it declares (its
    /// `wasm-provisioner:needs` section); review it, then save it as NAME.toml beside NAME.wasm.
    Grant {
        /// The guest's `.wasm` file.
        file: PathBuf,
        /// Where a directory the guest opens lies on the host, GUEST=HOST (repeatable;
        /// default: under /var/lib/wasm-provisioner/).
        #[arg(long = "host-dir", value_name = "GUEST=HOST")]
        host_dirs: Vec<String>,
        /// The StorageClass `provisioner:` name to serve (default: the one the module suggests).
        #[arg(long)]
        provisioner: Option<String>,
    },
    /// Create a new guest crate from the template: it builds, passes its tests on the SDK's
    /// fake host and loads with the grant file it ships.
    Guest {
        /// The crate's name (lowercase letters, digits, '-').
        name: String,
        /// The SDK: the guests/sdk folder of a wasm-provisioner checkout.
        #[arg(long)]
        sdk: PathBuf,
        /// Where to create it (default: ./NAME).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

/// How the operator commands reach the cluster and find the provisioner's intent logs.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Kubeconfig file; without it the in-cluster config or ~/.kube/config is used.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the intent logs (the provisioner's).
    #[arg(
        long,
        short = 'n',
        env = "POD_NAMESPACE",
        default_value = "wasm-provisioner"
    )]
    pub namespace: String,
}

/// `wasm-provisioner forget-storage`.
#[derive(Debug, Args)]
pub struct ForgetArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// The PV whose storage the logs name.
    pub pv: String,
    /// Print what would be forgotten, change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// `wasm-provisioner release-finalizers`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["all", "claim"])))]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Every claim holding wasm-provisioner.dev/provisioning.
    #[arg(long)]
    pub all: bool,
    /// One claim, NAMESPACE/NAME.
    #[arg(long)]
    pub claim: Option<String>,
    /// Only claims of these provisioners; with --all, also removes the PV finalizer
    /// (external-provisioner.volume.kubernetes.io/finalizer) from their volumes.
    #[arg(long = "provisioner")]
    pub provisioners: Vec<String>,
    /// Print what would be released, change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// A node name: a non-empty DNS subdomain (lower-case alphanumerics, `-` and `.`).
fn parse_node_name(text: &str) -> Result<String, String> {
    let ok = !text.is_empty()
        && text.len() <= 253
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && text.starts_with(|c: char| c.is_ascii_alphanumeric())
        && text.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not a node name (a DNS subdomain: a-z, 0-9, '-', '.')"
        ))
    }
}

/// An HTTP path must start with `/` and may not be a health path.
fn parse_http_path(text: &str) -> Result<String, String> {
    if !text.starts_with('/') {
        return Err(format!("{text:?} must start with /"));
    }
    if matches!(text, "/healthz" | "/readyz" | "/livez") {
        return Err(format!("{text} is taken by the health endpoints"));
    }
    Ok(text.to_string())
}

/// `wasm-provisioner provision`.
#[derive(Debug, Args)]
pub struct ProvisionArgs {
    /// Plugins directory.
    #[arg(long)]
    pub plugins: PathBuf,
    /// StorageClass manifest (YAML).
    #[arg(long)]
    pub class: PathBuf,
    /// PersistentVolumeClaim manifest (YAML); a missing uid is generated.
    #[arg(long)]
    pub claim: PathBuf,
    /// The selected node, as the scheduler would set it.
    #[arg(long)]
    pub node: Option<String>,
    /// The compiler child's limits (as `run`'s).
    #[command(flatten)]
    pub compile: CompileArgs,
}

/// The limits of the child process every guest is compiled in: by `run` and by the offline
/// commands (`inspect`, `provision`, `delete`) alike.
#[derive(Debug, Clone, Args)]
pub struct CompileArgs {
    /// Address space of the child process each guest is compiled in, MiB (it is killed past
    /// it, or past --compile-cpu-seconds, and the guest refused; docs/threat-model.md).
    #[arg(long, env = "WP_COMPILE_MEMORY_MIB", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(64..))]
    pub compile_memory_mib: u64,
    /// CPU time of that child, seconds (it is killed at twice as many seconds of wall-clock
    /// time).
    #[arg(long, env = "WP_COMPILE_CPU_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub compile_cpu_seconds: u64,
}

impl CompileArgs {
    /// The limits; none (compile in this process) only without a path to this binary, which
    /// Linux always has.
    pub fn limits(&self) -> Option<crate::wasm::compiler::CompileLimits> {
        crate::wasm::compiler::CompileLimits::for_this_binary()
            .ok()
            .map(|limits| crate::wasm::compiler::CompileLimits {
                memory_mib: self.compile_memory_mib,
                cpu_seconds: self.compile_cpu_seconds,
                timeout: Duration::from_secs(self.compile_cpu_seconds.saturating_mul(2)),
                ..limits
            })
    }
}

/// `wasm-provisioner delete`.
#[derive(Debug, Args)]
pub struct DeleteArgs {
    /// Plugins directory.
    #[arg(long)]
    pub plugins: PathBuf,
    /// PersistentVolume manifest (YAML).
    #[arg(long)]
    pub volume: PathBuf,
    /// The StorageClass manifest, if the guest needs it.
    #[arg(long)]
    pub class: Option<PathBuf>,
    /// The compiler child's limits (as `run`'s).
    #[command(flatten)]
    pub compile: CompileArgs,
}

/// Parses `500ms`, `15s`, `2m`, `1h` or plain seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (use e.g. 500ms, 15s, 2m, 1h)"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use ms, s, m or h)"
            ));
        }
    };
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::gate::Mode;
    use crate::controller::leader::Timing;

    /// Every `run` flag as users, docs and deploy/ see it: long name, short name, environment
    /// variable, default, the value a bare flag takes, arity, accepted values, hidden or not.
    fn run_flags() -> String {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        cli.build();
        let run = cli.find_subcommand("run").expect("run");
        let text = |values: &[&std::ffi::OsStr]| {
            values
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(",")
        };
        // clap has no getter for `default_missing_value`; its Debug output carries it.
        let bare_value = |arg: &clap::Arg| {
            let debug = format!("{arg:?}");
            debug
                .split_once("default_missing_vals: [")
                .and_then(|(_, rest)| rest.split_once(']'))
                .map(|(values, _)| values.replace('"', ""))
                .unwrap_or_default()
        };
        let mut rows: Vec<String> = run
            .get_arguments()
            .filter_map(|arg| {
                let long = arg.get_long()?;
                let possible: Vec<String> = arg
                    .get_possible_values()
                    .iter()
                    .map(|v| v.get_name().to_string())
                    .collect();
                Some(format!(
                    "--{long} short={:?} env={:?} default=[{}] bare=[{}] num_args={:?} action={:?} values=[{}] value_names={:?} hidden={} required={}",
                    arg.get_short(),
                    arg.get_env().map(|e| e.to_string_lossy().into_owned()),
                    text(&arg.get_default_values().iter().map(|v| v.as_os_str()).collect::<Vec<_>>()),
                    bare_value(arg),
                    arg.get_num_args(),
                    arg.get_action(),
                    possible.join(","),
                    arg.get_value_names(),
                    arg.is_hide_set(),
                    arg.is_required_set(),
                ))
            })
            .collect();
        rows.sort();
        rows.join("\n")
    }

    #[test]
    fn run_flags_keep_their_names_defaults_and_syntax() {
        let flags = run_flags();
        assert_eq!(flags, RUN_FLAGS.trim(), "\n{flags}\n");
    }

    /// `run`'s flags (grouped in issue 33; the registry flags and --fetch-interval added in
    /// issue 37): deploy/, docs and users depend on them.
    const RUN_FLAGS: &str = r#"
--add-pv-finalizer short=None env=None default=[true] bare=[true] num_args=Some(0..=1) action=Set values=[true,false] value_names=Some(["ADD_PV_FINALIZER"]) hidden=false required=false
--ca-file short=None env=None default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["PEM"]) hidden=false required=false
--cache-whole-objects short=None env=None default=[false] bare=[true] num_args=Some(0) action=SetTrue values=[] value_names=Some(["CACHE_WHOLE_OBJECTS"]) hidden=true required=false
--claim-finalizer short=None env=None default=[true] bare=[true] num_args=Some(0..=1) action=Set values=[true,false] value_names=Some(["CLAIM_FINALIZER"]) hidden=true required=false
--compile-cpu-seconds short=None env=Some("WP_COMPILE_CPU_SECONDS") default=[60] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["COMPILE_CPU_SECONDS"]) hidden=false required=false
--compile-memory-mib short=None env=Some("WP_COMPILE_MEMORY_MIB") default=[1024] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["COMPILE_MEMORY_MIB"]) hidden=false required=false
--create-pv-retry-count short=None env=None default=[5] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["CREATE_PV_RETRY_COUNT"]) hidden=false required=false
--create-pv-retry-interval short=None env=None default=[10s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["CREATE_PV_RETRY_INTERVAL"]) hidden=false required=false
--delete-timeout short=None env=None default=[5m] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["DELETE_TIMEOUT"]) hidden=false required=false
--failed-delete-threshold short=None env=None default=[15] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["FAILED_DELETE_THRESHOLD"]) hidden=false required=false
--failed-provision-threshold short=None env=None default=[15] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["FAILED_PROVISION_THRESHOLD"]) hidden=false required=false
--fetch-interval short=None env=None default=[30s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["FETCH_INTERVAL"]) hidden=false required=false
--guest-nice short=None env=None default=[10] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["GUEST_NICE"]) hidden=false required=false
--guest-threads short=None env=None default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["GUEST_THREADS"]) hidden=false required=false
--help short=Some('h') env=None default=[] bare=[] num_args=Some(0) action=Help values=[] value_names=None hidden=false required=false
--instance-name short=None env=Some("POD_NAME") default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["INSTANCE_NAME"]) hidden=false required=false
--intent-record short=None env=None default=[log] bare=[] num_args=Some(1) action=Set values=[log,claim-finalizer,off] value_names=Some(["INTENT_RECORD"]) hidden=false required=false
--kube-api-burst short=None env=None default=[100] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["KUBE_API_BURST"]) hidden=false required=false
--kube-api-qps short=None env=None default=[50] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["KUBE_API_QPS"]) hidden=false required=false
--kubeconfig short=None env=Some("KUBECONFIG") default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["KUBECONFIG"]) hidden=false required=false
--kubelet-dir short=None env=Some("KUBELET_DIR") default=[/var/lib/kubelet] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["KUBELET_DIR"]) hidden=false required=false
--leader-election short=None env=None default=[true] bare=[true] num_args=Some(0..=1) action=Set values=[true,false] value_names=Some(["LEADER_ELECTION"]) hidden=false required=false
--leader-election-lease-duration short=None env=None default=[15s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["LEADER_ELECTION_LEASE_DURATION"]) hidden=false required=false
--leader-election-lease-name short=None env=None default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["LEADER_ELECTION_LEASE_NAME"]) hidden=false required=false
--leader-election-mode short=None env=None default=[leader] bare=[] num_args=Some(1) action=Set values=[leader,per-claim] value_names=Some(["LEADER_ELECTION_MODE"]) hidden=false required=false
--leader-election-namespace short=None env=Some("POD_NAMESPACE") default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["LEADER_ELECTION_NAMESPACE"]) hidden=false required=false
--leader-election-renew-deadline short=None env=None default=[10s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["LEADER_ELECTION_RENEW_DEADLINE"]) hidden=false required=false
--leader-election-retry-period short=None env=None default=[2s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["LEADER_ELECTION_RETRY_PERIOD"]) hidden=false required=false
--log-format short=None env=Some("WP_LOG_FORMAT") default=[text] bare=[] num_args=Some(1) action=Set values=[text,json] value_names=Some(["LOG_FORMAT"]) hidden=false required=false
--max-module-mib short=None env=None default=[64] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["MAX_MODULE_MIB"]) hidden=false required=false
--metrics-address short=None env=None default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["METRICS_ADDRESS"]) hidden=false required=false
--metrics-path short=None env=None default=[/metrics] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["METRICS_PATH"]) hidden=false required=false
--module-cache short=None env=Some("WP_MODULE_CACHE") default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["MODULE_CACHE"]) hidden=false required=false
--node-deployment short=None env=None default=[false] bare=[true] num_args=Some(0) action=SetTrue values=[] value_names=Some(["NODE_DEPLOYMENT"]) hidden=false required=false
--node-deployment-base-delay short=None env=None default=[20s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["NODE_DEPLOYMENT_BASE_DELAY"]) hidden=false required=false
--node-deployment-immediate-binding short=None env=None default=[true] bare=[] num_args=Some(1) action=Set values=[true,false] value_names=Some(["NODE_DEPLOYMENT_IMMEDIATE_BINDING"]) hidden=false required=false
--node-deployment-max-delay short=None env=None default=[60s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["NODE_DEPLOYMENT_MAX_DELAY"]) hidden=false required=false
--node-gone-grace short=None env=None default=[5m] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["NODE_GONE_GRACE"]) hidden=false required=false
--node-name short=None env=Some("NODE_NAME") default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["NODE_NAME"]) hidden=false required=false
--plain-http short=None env=None default=[] bare=[] num_args=Some(1) action=Append values=[] value_names=Some(["HOST:PORT"]) hidden=false required=false
--plugins short=None env=Some("WP_PLUGINS") default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["PLUGINS"]) hidden=false required=true
--plugins-debounce short=None env=None default=[500ms] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["PLUGINS_DEBOUNCE"]) hidden=false required=false
--plugins-rescan-interval short=None env=None default=[30s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["PLUGINS_RESCAN_INTERVAL"]) hidden=false required=false
--pooling short=None env=None default=[auto] bare=[] num_args=Some(1) action=Set values=[auto,on,off] value_names=Some(["POOLING"]) hidden=false required=false
--provision-timeout short=None env=None default=[5m] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["PROVISION_TIMEOUT"]) hidden=false required=false
--registry-config short=None env=Some("WP_REGISTRY_CONFIG") default=[] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["FILE"]) hidden=false required=false
--request-timeout short=None env=None default=[60s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["REQUEST_TIMEOUT"]) hidden=false required=false
--resync-period short=None env=None default=[15m] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["RESYNC_PERIOD"]) hidden=false required=false
--retry-interval-max short=None env=None default=[1000s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["RETRY_INTERVAL_MAX"]) hidden=false required=false
--retry-interval-start short=None env=None default=[15s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["RETRY_INTERVAL_START"]) hidden=false required=false
--shutdown-grace short=None env=None default=[30s] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["SHUTDOWN_GRACE"]) hidden=false required=false
--wait-for-mark short=None env=None default=[false] bare=[true] num_args=Some(0..=1) action=Set values=[true,false] value_names=Some(["WAIT_FOR_MARK"]) hidden=false required=false
--worker-threads short=None env=None default=[32] bare=[] num_args=Some(1) action=Set values=[] value_names=Some(["WORKER_THREADS"]) hidden=false required=false
"#;

    #[test]
    fn boolean_flags_take_a_bare_form_and_a_value() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["wasm-provisioner", "run", "--plugins", "/p"];
            argv.extend_from_slice(extra);
            let Command::Run(args) = Cli::try_parse_from(argv).unwrap().command else {
                panic!("run")
            };
            (args.election.leader_election, args.intent.claim_finalizer)
        };
        assert_eq!(parse(&[]), (true, true));
        assert_eq!(
            parse(&["--leader-election", "--claim-finalizer"]),
            (true, true)
        );
        assert_eq!(
            parse(&["--leader-election=false", "--claim-finalizer=false"]),
            (false, false)
        );
        assert_eq!(parse(&["--leader-election", "false"]), (false, true));
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1000"), Ok(Duration::from_secs(1000)));
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration("5d").is_err());
    }

    #[test]
    fn defaults_match_the_go_library() {
        let cli = Cli::try_parse_from(["wasm-provisioner", "run", "--plugins", "/p"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("run")
        };
        let s = args.settings().unwrap();
        assert_eq!(s.worker_threads.get(), 32);
        assert_eq!(s.retry_interval_start, Duration::from_secs(15));
        assert_eq!(s.retry_interval_max, Duration::from_secs(1000));
        assert_eq!(s.resync_period, Duration::from_secs(900));
        assert_eq!(s.failed_provision_threshold, 15);
        assert_eq!(s.create_pv_retry_count.get(), 5);
        assert_eq!(s.create_pv_retry_interval, Duration::from_secs(10));
        assert_eq!(s.election.mode, Mode::Leader);
        assert_eq!(s.election.timing, Timing::default());
        assert!(s.election.identity.contains('_'), "{}", s.election.identity);
    }

    #[test]
    fn election_flags() {
        let cli = Cli::try_parse_from([
            "wasm-provisioner",
            "run",
            "--plugins",
            "/p",
            "--leader-election-mode",
            "per-claim",
            "--leader-election-namespace",
            "ops",
            "--leader-election-lease-name",
            "wp-a",
            "--leader-election-lease-duration",
            "4s",
            // A lease this short needs a shorter renew deadline than the default 10s.
            "--leader-election-renew-deadline",
            "3s",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("run")
        };
        let e = args.settings().unwrap().election;
        assert_eq!(e.mode, Mode::PerClaim);
        assert_eq!(
            (e.namespace.as_str(), e.lease_name.as_str()),
            ("ops", "wp-a")
        );
        assert_eq!(e.timing.lease_duration, Duration::from_secs(4));
        let off = Cli::try_parse_from([
            "wasm-provisioner",
            "run",
            "--plugins",
            "/p",
            "--leader-election=false",
        ])
        .unwrap();
        let Command::Run(args) = off.command else {
            panic!("run")
        };
        assert_eq!(args.settings().unwrap().election.mode, Mode::Off);
        // Bare, as deploy/deployment.yaml passes it, followed by another flag.
        let bare = Cli::try_parse_from([
            "wasm-provisioner",
            "run",
            "--plugins",
            "/p",
            "--leader-election",
            "--leader-election-namespace",
            "ops",
        ])
        .unwrap();
        let Command::Run(args) = bare.command else {
            panic!("run")
        };
        assert_eq!(args.settings().unwrap().election.mode, Mode::Leader);
        assert_eq!(args.settings().unwrap().election.namespace, "ops");
    }

    #[test]
    fn node_flags() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["wasm-provisioner", "run", "--plugins", "/p"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv)
        };
        let Command::Run(args) = parse(&[]).unwrap().command else {
            panic!("run")
        };
        assert_eq!(args.settings().unwrap().node, None);
        // Without NODE_NAME in the environment, --node-deployment alone is an error.
        if std::env::var_os("NODE_NAME").is_none() {
            let error = parse(&["--node-deployment"]).unwrap_err().to_string();
            assert!(error.contains("--node-name"), "{error}");
        }
        assert!(parse(&["--node-deployment", "--node-name", "Node_1"]).is_err());
        let Command::Run(args) = parse(&[
            "--node-deployment",
            "--node-name",
            "n1.example",
            "--node-deployment-base-delay",
            "2s",
            "--node-deployment-max-delay",
            "1s",
        ])
        .unwrap()
        .command
        else {
            panic!("run")
        };
        let node = args.settings().unwrap().node.unwrap();
        assert_eq!(node.name, "n1.example");
        assert_eq!(node.base_delay, Duration::from_secs(2));
        // A max below the base is raised to it.
        assert_eq!(node.max_delay, Duration::from_secs(2));
        assert!(node.immediate_binding);
        assert_eq!(node.gone_grace, Duration::from_secs(300));
    }
}
