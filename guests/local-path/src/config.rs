//! The `[config]` of local-path's grant file: where volumes may go on each node, and where the
//! guest sees those directories.

use std::collections::BTreeMap;

use serde::Deserialize;
use wasm_provisioner_sdk::{ConfigError, parse_config, require_absolute};

/// The node entry that covers nodes not listed by name (the original's key).
pub const DEFAULT_NODE: &str = "DEFAULT_PATH_FOR_NON_LISTED_NODES";
/// The directory under `nodes-dir` where a shared filesystem path is seen. Node names are DNS
/// subdomains, which never contain `_`, so no node's directory can collide with it.
pub const SHARED_DIR: &str = "_shared";

wasm_provisioner_sdk::needs! {
    provisioner: "wasm-provisioner.dev/local-path",
    dirs: [NODES = { guest: "/nodes", access: "read-write",
                     why: "each node's volume paths, below a directory per node (nodes-dir)" }],
    kinds: ["host-path", "local"],
    config: [
        NODES_DIR = { key: "nodes-dir", required: true, example: "/nodes",
                      why: "where the granted directory is preopened inside the guest (dirs.guest)" },
        NODE_PATH_MAP = { key: "node-path-map", required: false,
                          why: "per node the paths volumes may go to; one of it, shared-filesystem-path or storage-class-configs is needed" },
        SHARED_FILESYSTEM_PATH = { key: "shared-filesystem-path", required: false,
                                   why: "one path mounted on every node instead of node-path-map" },
        STORAGE_CLASS_CONFIGS = { key: "storage-class-configs", required: false,
                                  why: "per-class placements, by StorageClass name" },
        LOCAL_NODE = { key: "local-node", required: false,
                       why: "per-node deployment: serve only this node's claims and volumes" },
        CLONE_TIMEOUT_MS = { key: "clone-timeout-ms", required: false,
                             why: "how long a clone may copy, in ms (default 8000): keep it below call-timeout-ms" },
    ],
    owners: true,
    limits: { memory-mib: 64, call-timeout-ms: 30000 },
}

/// Where volumes may go: per node, or one shared path mounted on every node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Placement {
    /// Per node: the paths volumes may go to (`DEFAULT_PATH_FOR_NON_LISTED_NODES` for others).
    #[serde(default)]
    pub node_path_map: Vec<NodePaths>,
    /// One path mounted on all nodes: any access mode, no node affinity.
    pub shared_filesystem_path: Option<String>,
}

/// One node's paths.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodePaths {
    /// Node name, or `DEFAULT_PATH_FOR_NON_LISTED_NODES`.
    pub node: String,
    /// Absolute paths; empty means volumes are refused on this node.
    pub paths: Vec<String>,
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LocalPathConfig {
    /// Where the guest sees node `N`'s path `P`: `{nodes-dir}/N/P`; a shared path `P` at
    /// `{nodes-dir}/_shared/P`.
    pub nodes_dir: String,
    /// The placement for classes without their own.
    #[serde(default)]
    pub node_path_map: Vec<NodePaths>,
    /// Shared path for classes without their own.
    pub shared_filesystem_path: Option<String>,
    /// Per-class placements, by StorageClass name; they replace the top-level one.
    #[serde(default)]
    pub storage_class_configs: BTreeMap<String, Placement>,
    /// Per-node deployment: serve only claims selected for this node, and its volumes.
    pub local_node: Option<String>,
    /// How long a clone may copy before it gives up (and removes its partial copy), in ms:
    /// keep it below the grant's `call-timeout-ms`, so the guest stops itself and cleans up
    /// before the host's deadline ends the call. Default 8000.
    #[serde(default = "default_clone_timeout_ms")]
    pub clone_timeout_ms: u64,
}

fn default_clone_timeout_ms() -> u64 {
    8000
}

impl LocalPathConfig {
    /// Parses and checks the configuration JSON.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let config: Self = parse_config(json)?;
        require_absolute("nodes-dir", &config.nodes_dir)?;
        let top = Placement {
            node_path_map: config.node_path_map.clone(),
            shared_filesystem_path: config.shared_filesystem_path.clone(),
        };
        if !top.is_empty() {
            top.check("")?;
        }
        for (class, placement) in &config.storage_class_configs {
            placement.check(&format!("storage-class-configs.{class}: "))?;
        }
        if top.is_empty() && config.storage_class_configs.is_empty() {
            return Err(ConfigError(
                "set node-path-map, shared-filesystem-path or storage-class-configs".to_owned(),
            ));
        }
        Ok(config)
    }

    /// The placement for a class: its own, else the top-level one.
    pub fn placement(&self, class: &str) -> Option<Placement> {
        if let Some(placement) = self.storage_class_configs.get(class) {
            return Some(placement.clone());
        }
        let top = Placement {
            node_path_map: self.node_path_map.clone(),
            shared_filesystem_path: self.shared_filesystem_path.clone(),
        };
        (!top.is_empty()).then_some(top)
    }

    /// Where the guest sees `path` on `node` (`None`: the shared filesystem).
    pub fn guest_path(&self, node: Option<&str>, path: &str) -> String {
        format!("{}{path}", self.node_root(node))
    }

    /// Where the guest sees a node's root (`None`: the shared filesystem).
    pub fn node_root(&self, node: Option<&str>) -> String {
        format!(
            "{}/{}",
            self.nodes_dir.trim_end_matches('/'),
            node.unwrap_or(SHARED_DIR)
        )
    }
}

impl Placement {
    fn is_empty(&self) -> bool {
        self.node_path_map.is_empty() && self.shared_filesystem_path.is_none()
    }

    /// The paths for `node`: its entry, else the default entry.
    pub fn paths_for(&self, node: &str) -> Option<&[String]> {
        let entry = |name: &str| self.node_path_map.iter().find(|entry| entry.node == name);
        entry(node)
            .or_else(|| entry(DEFAULT_NODE))
            .map(|entry| entry.paths.as_slice())
    }

    fn check(&self, at: &str) -> Result<(), ConfigError> {
        let error = |why: String| Err(ConfigError(format!("{at}{why}")));
        if !self.node_path_map.is_empty() && self.shared_filesystem_path.is_some() {
            return error(
                "node-path-map and shared-filesystem-path are mutually exclusive".to_owned(),
            );
        }
        if self.is_empty() {
            return error("set node-path-map or shared-filesystem-path".to_owned());
        }
        let mut nodes = Vec::new();
        for entry in &self.node_path_map {
            if nodes.contains(&entry.node.as_str()) {
                return error(format!("node {:?} is listed twice", entry.node));
            }
            nodes.push(&entry.node);
            let mut seen = Vec::new();
            for path in &entry.paths {
                check_path(path)
                    .or_else(|why| error(format!("node {:?}: path {path:?} {why}", entry.node)))?;
                if seen.contains(&path) {
                    return error(format!(
                        "node {:?}: path {path:?} is listed twice",
                        entry.node
                    ));
                }
                seen.push(path);
            }
        }
        if let Some(path) = &self.shared_filesystem_path {
            check_path(path)
                .or_else(|why| error(format!("shared-filesystem-path {path:?} {why}")))?;
        }
        Ok(())
    }
}

/// Absolute, not `/`, normalised.
fn check_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err("must be absolute".to_owned());
    }
    if path.trim_end_matches('/').is_empty() {
        return Err("must not be /".to_owned());
    }
    if path
        .split('/')
        .skip(1)
        .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return Err("must be normalised (no `..`, `.`, `//` or trailing `/`)".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_declared_needs_are_the_config_and_the_shipped_grant() {
        assert_eq!(
            wasm_provisioner_sdk::needs::serde_fields::<LocalPathConfig>(),
            NEEDS.config_keys()
        );
        wasm_provisioner_sdk::testing::assert_grant_matches(
            &NEEDS,
            include_str!("../local-path.toml"),
        );
    }

    #[test]
    fn parses_maps_defaults_and_class_overrides() {
        let config = LocalPathConfig::parse(
            r#"{"nodes-dir": "/nodes",
                "node-path-map": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["/opt/lp"]},
                                  {"node": "big", "paths": ["/data1", "/data2"]},
                                  {"node": "none", "paths": []}],
                "storage-class-configs": {"shared": {"shared-filesystem-path": "/mnt/shared"}}}"#,
        )
        .unwrap();
        let top = config.placement("any").unwrap();
        assert_eq!(top.paths_for("node-1").unwrap(), ["/opt/lp"]);
        assert_eq!(top.paths_for("big").unwrap(), ["/data1", "/data2"]);
        assert!(top.paths_for("none").unwrap().is_empty());
        let shared = config.placement("shared").unwrap();
        assert_eq!(
            shared.shared_filesystem_path.as_deref(),
            Some("/mnt/shared")
        );
        assert_eq!(
            config.guest_path(Some("n1"), "/opt/lp/x"),
            "/nodes/n1/opt/lp/x"
        );
        assert_eq!(
            config.guest_path(None, "/mnt/shared/x"),
            "/nodes/_shared/mnt/shared/x"
        );
        assert_eq!(config.clone_timeout_ms, 8000, "the default");
        let config = LocalPathConfig::parse(
            r#"{"nodes-dir": "/n", "shared-filesystem-path": "/s", "clone-timeout-ms": 20000}"#,
        )
        .unwrap();
        assert_eq!(config.clone_timeout_ms, 20000);
    }

    #[test]
    fn bad_configs_are_explained() {
        for (json, want) in [
            (r#"{"nodes-dir": "/n"}"#, "set node-path-map"),
            (
                r#"{"nodes-dir": "n", "shared-filesystem-path": "/s"}"#,
                "nodes-dir must be an absolute path",
            ),
            (
                r#"{"nodes-dir": "/n", "shared-filesystem-path": "/"}"#,
                "must not be /",
            ),
            (
                r#"{"nodes-dir": "/n", "shared-filesystem-path": "/s", "node-path-map": [{"node": "a", "paths": ["/p"]}]}"#,
                "mutually exclusive",
            ),
            (
                r#"{"nodes-dir": "/n", "node-path-map": [{"node": "a", "paths": ["/p", "/p"]}]}"#,
                "listed twice",
            ),
            (
                r#"{"nodes-dir": "/n", "node-path-map": [{"node": "a", "paths": ["/p/../etc"]}]}"#,
                "normalised",
            ),
            (
                r#"{"nodes-dir": "/n", "storage-class-configs": {"c": {}}}"#,
                "storage-class-configs.c: set",
            ),
            (
                r#"{"nodes-dir": "/n", "shared-filesystem-path": "/s", "typo": 1}"#,
                "unknown field `typo`",
            ),
        ] {
            let error = LocalPathConfig::parse(json).unwrap_err().to_string();
            assert!(error.contains(want), "{json}: {error}");
        }
    }
}
