//! The guest's configuration, the `[config]` table of its grant file, parsed from JSON.

use serde::Deserialize;
use wasm_provisioner_sdk::{ConfigError, join, parse_config, require_absolute};

/// Where the granted directory is, seen from inside the guest and from the node.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct HostpathConfig {
    /// Where the granted directory is preopened inside the guest (a WASI preopen).
    pub guest_dir: String,
    /// The same directory's path on the node: what goes into the PV's `hostPath`.
    pub node_dir: String,
    /// Node to pin volumes to when the claim has no selected node.
    #[serde(default)]
    pub node_name: Option<String>,
    /// How long a clone may copy before it gives up (and removes its partial copy), in ms:
    /// keep it below the grant's `call-timeout-ms`, so the guest stops itself and cleans up
    /// before the host's deadline ends the call. Default 8000 (the shipped timeout is 10000).
    #[serde(default = "default_clone_timeout_ms")]
    pub clone_timeout_ms: u64,
}

fn default_clone_timeout_ms() -> u64 {
    8000
}

impl HostpathConfig {
    /// Parses and checks the configuration JSON the host passes in.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let mut config: Self = parse_config(json)?;
        require_absolute("guest-dir", &config.guest_dir)?;
        require_absolute("node-dir", &config.node_dir)?;
        if config.node_name.as_deref().is_some_and(str::is_empty) {
            config.node_name = None;
        }
        Ok(config)
    }

    /// The path, inside the guest, of `dir` (relative to the granted directory).
    pub fn guest_path(&self, dir: &str) -> String {
        join(&self.guest_dir, dir)
    }

    /// The path, on the node, of `dir` (relative to the granted directory).
    pub fn node_path(&self, dir: &str) -> String {
        join(&self.node_dir, dir)
    }

    /// The part of a node path below `node-dir`, if the path lies strictly below it.
    pub fn relative_to_node_dir<'a>(&self, node_path: &'a str) -> Option<&'a str> {
        let rest = node_path.strip_prefix(self.node_dir.trim_end_matches('/'))?;
        rest.strip_prefix('/')
            .filter(|relative| !relative.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_shipped_config() {
        let config = HostpathConfig::parse(
            r#"{"guest-dir": "/volumes", "node-dir": "/var/lib/wasm-provisioner/hostpath"}"#,
        )
        .unwrap();
        assert_eq!(config.guest_path("pvc-1"), "/volumes/pvc-1");
        assert_eq!(
            config.node_path("ns/pvc-1"),
            "/var/lib/wasm-provisioner/hostpath/ns/pvc-1"
        );
        assert_eq!(config.node_name, None);
    }

    #[test]
    fn missing_keys_are_named() {
        let error = HostpathConfig::parse("{}").unwrap_err().to_string();
        assert!(error.contains("guest-dir"), "{error}");
        let error = HostpathConfig::parse(r#"{"guest-dir": "/volumes"}"#)
            .unwrap_err()
            .to_string();
        assert!(error.contains("node-dir"), "{error}");
    }

    #[test]
    fn relative_dirs_and_unknown_keys_are_refused() {
        let error = HostpathConfig::parse(r#"{"guest-dir": "volumes", "node-dir": "/n"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("guest-dir must be an absolute path"),
            "{error}"
        );
        let error =
            HostpathConfig::parse(r#"{"guest-dir": "/v", "node-dir": "/n", "nod-name": "x"}"#)
                .unwrap_err()
                .to_string();
        assert!(error.contains("nod-name"), "{error}");
    }

    #[test]
    fn empty_node_name_means_none() {
        let config =
            HostpathConfig::parse(r#"{"guest-dir": "/v", "node-dir": "/n", "node-name": ""}"#)
                .unwrap();
        assert_eq!(config.node_name, None);
    }

    #[test]
    fn relative_to_node_dir_only_accepts_paths_strictly_below_it() {
        let config =
            HostpathConfig::parse(r#"{"guest-dir": "/v", "node-dir": "/data/hp/"}"#).unwrap();
        assert_eq!(config.relative_to_node_dir("/data/hp/pvc-1"), Some("pvc-1"));
        assert_eq!(config.relative_to_node_dir("/data/hp/a/b"), Some("a/b"));
        assert_eq!(config.relative_to_node_dir("/data/hp"), None);
        assert_eq!(config.relative_to_node_dir("/data/hp/"), None);
        assert_eq!(config.relative_to_node_dir("/data/hpx/pvc-1"), None);
        assert_eq!(config.relative_to_node_dir("/etc"), None);
    }
}
