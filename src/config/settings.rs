//! `run`'s flags checked and turned into the controller's [`Settings`]: a value out of its
//! range is refused here, at start, with the flag named, never clamped deeper down.

use std::num::{NonZeroU16, NonZeroU32};
use std::path::PathBuf;
use std::time::Duration;

use super::{ElectionMode, IntentMode, RunArgs};
use crate::controller::gate::{ElectionSettings, Mode};
use crate::controller::leader::{Timing, TimingError};
use crate::controller::node::{self, NodeSettings};
use crate::controller::{IntentRecord, Settings};

/// Why `run`'s flags describe no controller that can run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// No reconcile could ever run.
    #[error("--worker-threads must be at least 1 (1..=65535), got 0")]
    NoWorkers,
    /// A provisioned PV would never be saved, and its storage never cleaned up.
    #[error("--create-pv-retry-count must be at least 1 (1..=4294967295), got 0")]
    NoCreateAttempts,
    /// The lease timings let two replicas write at once, or the holder lose its lease.
    #[error(transparent)]
    Election(#[from] TimingError),
}

/// Where a pod's service account namespace is mounted.
const SERVICE_ACCOUNT_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// A Lease name from the binary's file name: lower-case, anything else than `[a-z0-9.-]` as `-`.
fn lease_name_from_binary() -> String {
    let name: String = std::env::args_os()
        .next()
        .and_then(|arg0| {
            PathBuf::from(arg0)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_default()
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let name = name.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if name.is_empty() {
        "wasm-provisioner".into()
    } else {
        name.chars().take(63).collect()
    }
}

/// This replica's identity in lease records: host name, `_`, a random suffix (as client-go).
fn election_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into());
    format!("{host}_{:016x}", rand::random::<u64>())
}

impl RunArgs {
    /// How the wasm engine is built.
    pub fn engine_options(&self) -> crate::wasm::EngineOptions {
        let guests = &self.guests;
        crate::wasm::EngineOptions {
            pooling: guests.pooling,
            module_cache: guests.module_cache.clone(),
            executor: Some(crate::wasm::executor::ExecutorOptions {
                threads: guests.guest_threads.map_or_else(
                    || crate::wasm::executor::ExecutorOptions::default().threads,
                    usize::from,
                ),
                nice: guests.guest_nice,
            }),
            compiler: guests.compile.limits(),
        }
    }

    /// How the plugins directory is watched.
    pub fn watch_options(&self) -> crate::wasm::reload::WatchOptions {
        crate::wasm::reload::WatchOptions {
            rescan: self
                .guests
                .plugins_rescan_interval
                .max(Duration::from_secs(1)),
            debounce: self.guests.plugins_debounce,
        }
    }

    /// The controller settings these flags describe, or why they describe none that can run.
    pub fn settings(&self) -> Result<Settings, ConfigError> {
        let (controller, retries) = (&self.controller, &self.retries);
        let worker_threads =
            NonZeroU16::new(controller.worker_threads).ok_or(ConfigError::NoWorkers)?;
        let create_pv_retry_count =
            NonZeroU32::new(retries.create_pv_retry_count).ok_or(ConfigError::NoCreateAttempts)?;
        let node = self.node_settings();
        let election = self.election();
        // Node mode turns the whole-controller election off (controller::start says so in the
        // log); timings that no election uses are not checked.
        if node::election_mode(election.mode, node.is_some()) != Mode::Off {
            election.timing.validate()?;
        }
        Ok(Settings {
            worker_threads,
            retry_interval_start: retries.retry_interval_start,
            retry_interval_max: retries.retry_interval_max.max(retries.retry_interval_start),
            resync_period: controller.resync_period.max(Duration::from_secs(1)),
            failed_provision_threshold: retries.failed_provision_threshold,
            failed_delete_threshold: retries.failed_delete_threshold,
            create_pv_retry_count,
            create_pv_retry_interval: retries.create_pv_retry_interval,
            provision_timeout: controller.provision_timeout,
            delete_timeout: controller.delete_timeout,
            add_pv_finalizer: self.intent.add_pv_finalizer,
            cache_whole_objects: controller.cache_whole_objects,
            wait_for_mark: controller.wait_for_mark,
            intent: self.intent_record(),
            kube_api_qps: self.api.kube_api_qps,
            kube_api_burst: self.api.kube_api_burst,
            shutdown_grace: controller.shutdown_grace,
            reporter: "wasm-provisioner".into(),
            instance: controller.instance_name.clone(),
            election,
            node,
        })
    }

    fn intent_record(&self) -> IntentRecord {
        let (intent, election) = (&self.intent, &self.election);
        // Where every replica works at once, one replica's log cannot tell another's claims in
        // flight from abandoned ones: the claim itself carries the intent there.
        let shared = self.node.node_deployment
            || (election.leader_election
                && election.leader_election_mode == ElectionMode::PerClaim);
        match (intent.claim_finalizer, intent.intent_record) {
            (false, _) | (_, IntentMode::Off) => IntentRecord::Off,
            (true, IntentMode::ClaimFinalizer) => IntentRecord::ClaimFinalizer,
            (true, IntentMode::Log) if shared => IntentRecord::ClaimFinalizer,
            (true, IntentMode::Log) => IntentRecord::Log,
        }
    }

    fn node_settings(&self) -> Option<NodeSettings> {
        let node = &self.node;
        if !node.node_deployment {
            return None;
        }
        Some(NodeSettings {
            // clap requires --node-name (or NODE_NAME) with --node-deployment.
            name: node.node_name.clone().unwrap_or_default(),
            base_delay: node.node_deployment_base_delay,
            max_delay: node
                .node_deployment_max_delay
                .max(node.node_deployment_base_delay),
            immediate_binding: node.node_deployment_immediate_binding,
            gone_grace: node.node_gone_grace,
        })
    }

    fn election(&self) -> ElectionSettings {
        let election = &self.election;
        let namespace = election
            .leader_election_namespace
            .clone()
            .or_else(|| {
                std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE)
                    .ok()
                    .map(|ns| ns.trim().to_string())
            })
            .filter(|ns| !ns.is_empty())
            .unwrap_or_else(|| "default".into());
        let identity = election_identity();
        ElectionSettings {
            mode: match (election.leader_election, election.leader_election_mode) {
                (false, _) => Mode::Off,
                (true, ElectionMode::Leader) => Mode::Leader,
                (true, ElectionMode::PerClaim) => Mode::PerClaim,
            },
            namespace,
            lease_name: election
                .leader_election_lease_name
                .clone()
                .unwrap_or_else(lease_name_from_binary),
            identity: identity.clone(),
            log_identity: self.controller.instance_name.clone().unwrap_or(identity),
            timing: Timing {
                lease_duration: election.leader_election_lease_duration,
                renew_deadline: election.leader_election_renew_deadline,
                retry_period: election.leader_election_retry_period,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::config::{Cli, Command};

    fn settings(extra: &[&str]) -> Result<Settings, ConfigError> {
        let mut argv = vec!["wasm-provisioner", "run", "--plugins", "/p"];
        argv.extend_from_slice(extra);
        let Command::Run(args) = Cli::try_parse_from(argv).expect("flags parse").command else {
            panic!("run")
        };
        args.settings()
    }

    #[test]
    fn out_of_range_values_are_refused_naming_the_flag_and_the_range() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["--worker-threads", "0"],
                "--worker-threads must be at least 1 (1..=65535), got 0",
            ),
            (
                &["--create-pv-retry-count", "0"],
                "--create-pv-retry-count must be at least 1 (1..=4294967295), got 0",
            ),
            (
                &["--leader-election-lease-duration", "500ms"],
                "--leader-election-lease-duration must be at least 1s, got 500ms",
            ),
            (
                &["--leader-election-lease-duration", "10s"],
                "--leader-election-lease-duration (10s) must be longer than --leader-election-renew-deadline (10s)",
            ),
            (
                &["--leader-election-retry-period", "9s"],
                "--leader-election-renew-deadline (10s) must be longer than 1.2 x --leader-election-retry-period (9s)",
            ),
            (
                &[
                    "--leader-election-mode",
                    "per-claim",
                    "--leader-election-lease-duration",
                    "5s",
                ],
                "--leader-election-lease-duration (5s) must be longer than --leader-election-renew-deadline (10s)",
            ),
        ];
        for (flags, message) in cases {
            let error = settings(flags).expect_err(&format!("{flags:?} is refused"));
            assert_eq!(error.to_string(), *message, "{flags:?}");
        }
    }

    #[test]
    fn election_timings_no_election_uses_are_not_checked() {
        let unused = ["--leader-election-lease-duration", "5s"];
        assert!(settings(&[&["--leader-election=false"], &unused[..]].concat()).is_ok());
        // Node mode turns the whole-controller election off.
        let node = ["--node-deployment", "--node-name", "n1"];
        assert!(settings(&[&node[..], &unused[..]].concat()).is_ok());
    }

    /// `Settings::default()` (what tests and library users start from) is what `run` does with
    /// no flags, so the two cannot drift apart. Exceptions, all environment-dependent: the
    /// election's namespace (`$POD_NAMESPACE` or the service account's), lease name (the
    /// binary's file name) and identities (host name and a random suffix); `--plugins` is
    /// required but not part of the settings.
    #[test]
    fn default_settings_are_runs_defaults() {
        let mut parsed = settings(&[]).expect("the defaults are valid");
        let default = Settings::default();
        parsed.election.namespace = default.election.namespace.clone();
        parsed.election.lease_name = default.election.lease_name.clone();
        parsed.election.identity = default.election.identity.clone();
        parsed.election.log_identity = default.election.log_identity.clone();
        // `--instance-name` falls back to $POD_NAME.
        parsed.instance = default.instance.clone();
        assert_eq!(parsed, default);
    }
}
