//! The command line: parsed once here into typed settings; nothing deeper reads the environment.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::controller::Settings;

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
        " (guest contract wasm-provisioner:provisioner@0.1.0, serves 0.1.x)"
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
    Run(RunArgs),
    /// Show which contract version and hooks a guest implements, and whether this host runs it.
    Inspect {
        /// The guest's `.wasm` file.
        file: PathBuf,
    },
    /// Run a guest's provision offline and print the PV the controller would create.
    Provision(ProvisionArgs),
    /// Run a guest's delete offline on a PV manifest.
    Delete(DeleteArgs),
}

/// `wasm-provisioner run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Directory holding `NAME.wasm` guests and their `NAME.toml` grant files.
    #[arg(long, env = "WP_PLUGINS")]
    pub plugins: PathBuf,
    /// Kubeconfig file; without it the in-cluster config or ~/.kube/config is used.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Client-side API requests per second (watches excluded).
    #[arg(long, default_value_t = 20.0)]
    pub kube_api_qps: f64,
    /// Client-side API request burst.
    #[arg(long, default_value_t = 40)]
    pub kube_api_burst: u32,
    /// Concurrent claim reconciles, and as many volume reconciles.
    #[arg(long, default_value_t = 4)]
    pub worker_threads: u16,
    /// First retry delay after a failure; doubles per failure.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub retry_interval_start: Duration,
    /// Largest retry delay.
    #[arg(long, default_value = "1000s", value_parser = parse_duration)]
    pub retry_interval_max: Duration,
    /// How often every claim and volume is reconciled again.
    #[arg(long, default_value = "15m", value_parser = parse_duration)]
    pub resync_period: Duration,
    /// Bound on one provision operation (guest call and API writes).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub provision_timeout: Duration,
    /// Bound on one delete operation.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub delete_timeout: Duration,
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
    /// Keep `external-provisioner.volume.kubernetes.io/finalizer` on bound PVs with the Delete policy.
    #[arg(long, default_value_t = false)]
    pub add_pv_finalizer: bool,
    /// How long in-flight work may take to finish after SIGTERM.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// This replica's name in events.
    #[arg(long, env = "POD_NAME")]
    pub instance_name: Option<String>,
    /// Directory for compiled guests (native code), keyed by module hash and engine; must not
    /// be, contain or lie inside the plugins directory. Without it every start compiles.
    #[arg(long, env = "WP_MODULE_CACHE")]
    pub module_cache: Option<PathBuf>,
    /// Instance allocation: `auto` uses the pooling allocator when the address space allows it.
    #[arg(long, value_enum, default_value_t = crate::wasm::Pooling::Auto)]
    pub pooling: crate::wasm::Pooling,
    /// Full rescan of the plugins directory this often, on top of file-change events.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub plugins_rescan_interval: Duration,
    /// Quiet time after a change in the plugins directory before it is loaded (partial writes).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub plugins_debounce: Duration,
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

impl RunArgs {
    /// How the wasm engine is built.
    pub fn engine_options(&self) -> crate::wasm::EngineOptions {
        crate::wasm::EngineOptions {
            pooling: self.pooling,
            module_cache: self.module_cache.clone(),
        }
    }

    /// How the plugins directory is watched.
    pub fn watch_options(&self) -> crate::wasm::reload::WatchOptions {
        crate::wasm::reload::WatchOptions {
            rescan: self.plugins_rescan_interval.max(Duration::from_secs(1)),
            debounce: self.plugins_debounce,
        }
    }

    /// The controller settings these flags describe.
    pub fn settings(&self) -> Settings {
        Settings {
            worker_threads: self.worker_threads.max(1),
            retry_interval_start: self.retry_interval_start,
            retry_interval_max: self.retry_interval_max.max(self.retry_interval_start),
            resync_period: self.resync_period.max(Duration::from_secs(1)),
            failed_provision_threshold: self.failed_provision_threshold,
            failed_delete_threshold: self.failed_delete_threshold,
            create_pv_retry_count: self.create_pv_retry_count.max(1),
            create_pv_retry_interval: self.create_pv_retry_interval,
            provision_timeout: self.provision_timeout,
            delete_timeout: self.delete_timeout,
            add_pv_finalizer: self.add_pv_finalizer,
            kube_api_qps: self.kube_api_qps,
            kube_api_burst: self.kube_api_burst,
            shutdown_grace: self.shutdown_grace,
            reporter: "wasm-provisioner".into(),
            instance: self.instance_name.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let s = args.settings();
        assert_eq!(s.worker_threads, 4);
        assert_eq!(s.retry_interval_start, Duration::from_secs(15));
        assert_eq!(s.retry_interval_max, Duration::from_secs(1000));
        assert_eq!(s.resync_period, Duration::from_secs(900));
        assert_eq!(s.failed_provision_threshold, 15);
        assert_eq!(s.create_pv_retry_count, 5);
        assert_eq!(s.create_pv_retry_interval, Duration::from_secs(10));
    }
}
