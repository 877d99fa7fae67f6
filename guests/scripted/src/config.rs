//! The guest's configuration, the `[config]` table of its grant file, parsed from JSON.

use serde::Deserialize;

wasm_provisioner_sdk::needs! {
    provisioner: "wasm-provisioner.dev/scripted",
    dirs: [STATE = { guest: "/state", access: "read-write",
                     why: "calls.log, the per-PV scripts and attempts, and the volumes" }],
    kinds: ["host-path"],
    config: [
        GUEST_DIR = { key: "guest-dir", required: true, example: "/state",
                      why: "where the granted directory is preopened inside the guest (dirs.guest)" },
        NODE_DIR = { key: "node-dir", required: true, example: "/tmp/wasm-provisioner/scripted",
                     why: "the same directory as the node sees it: what goes into the PV" },
        INSTANCE = { key: "instance", required: false,
                     why: "which provisioner replica this is, appended to every calls.log line" },
    ],
    owners: false,
    limits: { memory-mib: 32, call-timeout-ms: 5000 },
}

/// Where the granted directory is, seen from inside the guest and from the node.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ScriptedConfig {
    /// Where the granted directory is preopened inside the guest (read-write).
    pub guest_dir: String,
    /// The same directory's path on the node: what goes into the PV's `hostPath`.
    pub node_dir: String,
    /// Which provisioner replica this is, appended to every `calls.log` line when set (the guest
    /// sees no environment, so replicas sharing one state directory say who called here).
    #[serde(default)]
    pub instance: Option<String>,
}

impl ScriptedConfig {
    /// Parses and checks the configuration JSON the host passes in.
    pub fn parse(json: &str) -> Result<Self, String> {
        let config: Self =
            serde_json::from_str(json).map_err(|error| format!("guest config: {error}"))?;
        for (key, value) in [
            ("guest-dir", &config.guest_dir),
            ("node-dir", &config.node_dir),
        ] {
            if !value.starts_with('/') {
                return Err(format!(
                    "guest config: {key} must be an absolute path, got {value:?}"
                ));
            }
        }
        Ok(config)
    }

    /// The path, inside the guest, of a file or directory directly in the granted directory.
    pub fn guest_path(&self, name: &str) -> String {
        format!("{}/{name}", self.guest_dir.trim_end_matches('/'))
    }

    /// The path, on the node, of a directory directly in the granted directory.
    pub fn node_path(&self, name: &str) -> String {
        format!("{}/{name}", self.node_dir.trim_end_matches('/'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_declared_needs_are_the_config_and_the_shipped_grant() {
        assert_eq!(
            wasm_provisioner_sdk::needs::serde_fields::<ScriptedConfig>(),
            NEEDS.config_keys()
        );
        wasm_provisioner_sdk::testing::assert_grant_matches(
            &NEEDS,
            include_str!("../scripted.toml"),
        );
    }

    #[test]
    fn parses_and_joins() {
        let config =
            ScriptedConfig::parse(r#"{"guest-dir": "/state/", "node-dir": "/tmp/s"}"#).unwrap();
        assert_eq!(config.guest_path("calls.log"), "/state/calls.log");
        assert_eq!(config.node_path("pvc-1"), "/tmp/s/pvc-1");
        assert_eq!(config.instance, None);
        let named = ScriptedConfig::parse(
            r#"{"guest-dir": "/s", "node-dir": "/n", "instance": "replica-2"}"#,
        )
        .unwrap();
        assert_eq!(named.instance.as_deref(), Some("replica-2"));
    }

    #[test]
    fn missing_or_relative_dirs_are_refused() {
        assert!(
            ScriptedConfig::parse("{}")
                .unwrap_err()
                .contains("guest-dir")
        );
        assert!(
            ScriptedConfig::parse(r#"{"guest-dir": "/s", "node-dir": "n"}"#)
                .unwrap_err()
                .contains("node-dir")
        );
    }
}
