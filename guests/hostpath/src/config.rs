//! What the guest needs from its grant file (the `wasm-provisioner:needs` section) and its
//! `[config]` table, read with the keys and defaults declared there.

use wasm_provisioner_sdk::{ConfigError, join, require_absolute};

wasm_provisioner_sdk::needs! {
    provisioner: "wasm-provisioner.dev/hostpath",
    dirs: [VOLUMES = { guest: "/volumes", access: "read-write",
                       why: "one directory per volume, made, archived and removed by the guest" }],
    kinds: ["host-path"],
    config: [
        GUEST_DIR = { key: "guest-dir", required: true, example: "/volumes",
                      why: "where the granted directory is preopened inside the guest (dirs.guest)" },
        NODE_DIR = { key: "node-dir", required: true, example: "/var/lib/wasm-provisioner/hostpath",
                     why: "the same directory as the node sees it: what goes into the PV" },
        NODE_NAME = { key: "node-name", required: false,
                      why: "the node to pin volumes to when the claim has no selected node" },
        CLONE_TIMEOUT_MS = { key: "clone-timeout-ms", required: false, default: 8000,
                             why: "how long a clone may copy, in ms (default 8000): keep it below call-timeout-ms" },
    ],
    owners: true,
    limits: { memory-mib: 64, call-timeout-ms: 10000 },
}

/// Where the granted directory is, seen from inside the guest and from the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostpathConfig {
    /// Where the granted directory is preopened inside the guest (a WASI preopen).
    pub guest_dir: String,
    /// The same directory's path on the node: what goes into the PV's `hostPath`.
    pub node_dir: String,
    /// Node to pin volumes to when the claim has no selected node.
    pub node_name: Option<String>,
    /// How long a clone may copy before it gives up (and removes its partial copy), in ms:
    /// keep it below the grant's `call-timeout-ms`, so the guest stops itself and cleans up
    /// before the host's deadline ends the call.
    pub clone_timeout_ms: u64,
}

impl HostpathConfig {
    /// Parses and checks the configuration JSON the host passes in.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let config = NEEDS.config(json)?;
        let parsed = Self {
            guest_dir: config.get(GUEST_DIR)?,
            node_dir: config.get(NODE_DIR)?,
            node_name: config
                .get::<Option<String>>(NODE_NAME)?
                .filter(|name| !name.is_empty()),
            clone_timeout_ms: config.get(CLONE_TIMEOUT_MS)?,
        };
        require_absolute(GUEST_DIR.key, &parsed.guest_dir)?;
        require_absolute(NODE_DIR.key, &parsed.node_dir)?;
        Ok(parsed)
    }

    /// The path, inside the guest, of `dir` (relative to the granted directory).
    pub fn guest_path(&self, dir: &str) -> String {
        join(&self.guest_dir, dir)
    }

    /// The path, on the node, of `dir` (relative to the granted directory).
    pub fn node_path(&self, dir: &str) -> String {
        join(&self.node_dir, dir)
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
        assert_eq!(config.clone_timeout_ms, 8000);
    }

    #[test]
    fn the_shipped_grant_file_grants_what_the_guest_declares() {
        wasm_provisioner_sdk::testing::assert_grant_matches(
            &NEEDS,
            include_str!("../hostpath.toml"),
        );
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
}
