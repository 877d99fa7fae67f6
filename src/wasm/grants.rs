//! Grant files: what the operator allows one guest to see, build and spend.
//!
//! A grant file `NAME.toml` sits next to `NAME.wasm`. Everything not granted is denied.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Defaults applied when the grant file leaves a limit out.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Default linear-memory cap per call.
pub const DEFAULT_MEMORY_MIB: u64 = 64;
/// Default number of concurrent calls into one guest.
pub const DEFAULT_MAX_CONCURRENCY: usize = 4;
/// Default cap on the elements of any one table (function references) per instance.
pub const DEFAULT_TABLE_ELEMENTS: usize = 100_000;
/// Default cap on the core instances, tables and memories one call may create.
pub const DEFAULT_INSTANCES: usize = 32;
/// Default bytes of stdout, and of stderr, kept per call (the rest is counted and dropped).
pub const DEFAULT_OUTPUT_KIB: usize = 16;
/// Default bytes of `host.log` text one call may emit (the rest is counted and dropped).
pub const DEFAULT_LOG_KIB: usize = 64;

/// Why a grant file was refused.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// The file could not be read.
    #[error("cannot read grant file {path}: {source}")]
    Read {
        /// The grant file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML did not parse or has unknown keys.
    #[error("grant file {path} is not valid: {source}")]
    Parse {
        /// The grant file.
        path: PathBuf,
        /// The parser's message.
        #[source]
        source: Box<toml::de::Error>,
    },
    /// The TOML parsed but says something that cannot be honoured.
    #[error("grant file {path}: {reason}")]
    Invalid {
        /// The grant file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// The kinds of PV source a guest may build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SourceKind {
    /// `hostPath`.
    HostPath,
    /// `local`.
    Local,
    /// `nfs`.
    Nfs,
    /// `csi`.
    Csi,
}

impl SourceKind {
    /// The name used in grant files and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::HostPath => "host-path",
            SourceKind::Local => "local",
            SourceKind::Nfs => "nfs",
            SourceKind::Csi => "csi",
        }
    }
}

/// Read-only or read-write access to a preopened directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DirAccess {
    /// The guest may read only.
    ReadOnly,
    /// The guest may read and write.
    ReadWrite,
}

/// A directory preopened for the guest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirGrant {
    /// Path in the controller's filesystem (relative paths are resolved against the grant file's folder).
    pub host: PathBuf,
    /// Path the guest sees.
    pub guest: String,
    /// Access mode.
    pub access: DirAccess,
}

/// Limits on each call into the guest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Limits {
    /// Wall-clock bound of one call, host functions included.
    pub call_timeout_ms: Option<u64>,
    /// Linear-memory cap of one instance.
    pub memory_mib: Option<u64>,
    /// Concurrent calls into this guest.
    pub max_concurrency: Option<usize>,
    /// Elements of any one table.
    pub table_elements: Option<usize>,
    /// Core instances (and as many tables and memories) one call may create.
    pub instances: Option<usize>,
    /// KiB of stdout, and of stderr, kept per call.
    pub output_kib: Option<usize>,
    /// KiB of `host.log` text per call.
    pub log_kib: Option<usize>,
}

/// What the PVs a guest builds may point at.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct VolumeGrants {
    /// Allowed source kinds.
    #[serde(default)]
    pub kinds: BTreeSet<SourceKind>,
    /// Allowed prefixes for `hostPath` and `local` paths (on the node).
    #[serde(default)]
    pub path_prefixes: Vec<PathBuf>,
    /// Allowed NFS servers.
    #[serde(default)]
    pub nfs_servers: Vec<String>,
    /// Allowed CSI drivers.
    #[serde(default)]
    pub csi_drivers: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantFile {
    provisioner: String,
    #[serde(default)]
    limits: Option<Limits>,
    #[serde(default)]
    dirs: Vec<DirGrant>,
    #[serde(default)]
    volumes: VolumeGrants,
    #[serde(default)]
    config: Option<toml::Table>,
}

/// A validated grant: everything the host needs to run one guest.
#[derive(Debug, Clone)]
pub struct Grants {
    /// The StorageClass `provisioner` value this guest serves.
    pub provisioner: String,
    /// Wall-clock bound of one call.
    pub call_timeout: Duration,
    /// Linear-memory cap in bytes.
    pub memory_bytes: usize,
    /// Concurrent calls.
    pub max_concurrency: usize,
    /// Elements of any one table.
    pub table_elements: usize,
    /// Core instances, tables and memories per call.
    pub instances: usize,
    /// Bytes of stdout, and of stderr, kept per call.
    pub output_bytes: usize,
    /// Bytes of `host.log` text per call.
    pub log_bytes: usize,
    /// Preopened directories, host paths absolute.
    pub dirs: Vec<DirGrant>,
    /// What built PVs may point at.
    pub volumes: VolumeGrants,
    /// The guest's config, as JSON text.
    pub config_json: String,
}

impl Grants {
    /// Reads and validates a grant file.
    pub fn from_file(path: &Path) -> Result<Grants, GrantError> {
        let text = std::fs::read_to_string(path).map_err(|source| GrantError::Read {
            path: path.to_owned(),
            source,
        })?;
        Grants::from_text(path, &text)
    }

    /// Validates the text of the grant file at `path` (already read).
    pub fn from_text(path: &Path, text: &str) -> Result<Grants, GrantError> {
        let base = path.parent().unwrap_or(Path::new("."));
        Grants::parse(text, base).map_err(|e| match e {
            GrantError::Parse { source, .. } => GrantError::Parse {
                path: path.to_owned(),
                source,
            },
            GrantError::Invalid { reason, .. } => GrantError::Invalid {
                path: path.to_owned(),
                reason,
            },
            other => other,
        })
    }

    /// Parses grant TOML; relative directory paths are resolved against `base`.
    pub fn parse(text: &str, base: &Path) -> Result<Grants, GrantError> {
        let file: GrantFile = toml::from_str(text).map_err(|source| GrantError::Parse {
            path: PathBuf::new(),
            source: Box::new(source),
        })?;
        let invalid = |reason: String| GrantError::Invalid {
            path: PathBuf::new(),
            reason,
        };
        if file.provisioner.trim().is_empty() {
            return Err(invalid("`provisioner` must name a provisioner".into()));
        }
        let limits = file.limits.unwrap_or(Limits {
            call_timeout_ms: None,
            memory_mib: None,
            max_concurrency: None,
            table_elements: None,
            instances: None,
            output_kib: None,
            log_kib: None,
        });
        let call_timeout = limits
            .call_timeout_ms
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_CALL_TIMEOUT);
        if call_timeout.is_zero() {
            return Err(invalid("limits.call-timeout-ms must be > 0".into()));
        }
        let memory_mib = limits.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        if memory_mib == 0 || memory_mib > 4096 {
            return Err(invalid(format!(
                "limits.memory-mib must be between 1 and 4096, got {memory_mib}"
            )));
        }
        let max_concurrency = limits.max_concurrency.unwrap_or(DEFAULT_MAX_CONCURRENCY);
        if max_concurrency == 0 {
            return Err(invalid("limits.max-concurrency must be > 0".into()));
        }
        let bounded = |key: &str, value: Option<usize>, default: usize, max: usize| {
            let value = value.unwrap_or(default);
            if value == 0 || value > max {
                Err(invalid(format!(
                    "limits.{key} must be between 1 and {max}, got {value}"
                )))
            } else {
                Ok(value)
            }
        };
        let table_elements = bounded(
            "table-elements",
            limits.table_elements,
            DEFAULT_TABLE_ELEMENTS,
            10_000_000,
        )?;
        let instances = bounded("instances", limits.instances, DEFAULT_INSTANCES, 1000)?;
        let output_kib = bounded(
            "output-kib",
            limits.output_kib,
            DEFAULT_OUTPUT_KIB,
            16 * 1024,
        )?;
        let log_kib = bounded("log-kib", limits.log_kib, DEFAULT_LOG_KIB, 16 * 1024)?;
        let mut dirs = Vec::with_capacity(file.dirs.len());
        for dir in file.dirs {
            if !dir.guest.starts_with('/') {
                return Err(invalid(format!(
                    "dirs: guest path {:?} must be absolute",
                    dir.guest
                )));
            }
            let host = if dir.host.is_absolute() {
                dir.host
            } else {
                base.join(dir.host)
            };
            dirs.push(DirGrant { host, ..dir });
        }
        for prefix in &file.volumes.path_prefixes {
            if !prefix.is_absolute() || has_parent_component(prefix) {
                return Err(invalid(format!(
                    "volumes.path-prefixes: {} must be absolute and without `..`",
                    prefix.display()
                )));
            }
        }
        let config = file.config.unwrap_or_default();
        let config_json = serde_json::to_string(&config)
            .map_err(|e| invalid(format!("config cannot be passed as JSON: {e}")))?;
        Ok(Grants {
            provisioner: file.provisioner,
            call_timeout,
            memory_bytes: (memory_mib * 1024 * 1024) as usize,
            max_concurrency,
            table_elements,
            instances,
            output_bytes: output_kib * 1024,
            log_bytes: log_kib * 1024,
            dirs,
            volumes: file.volumes,
            config_json,
        })
    }

    /// Whether `path` (absolute, normalised) lies under one of the granted path prefixes.
    pub fn path_granted(&self, path: &Path) -> bool {
        self.volumes
            .path_prefixes
            .iter()
            .any(|prefix| path.starts_with(prefix))
    }
}

/// Whether a path has a `..` component.
pub fn has_parent_component(path: &Path) -> bool {
    path.components().any(|c| matches!(c, Component::ParentDir))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
provisioner = "example.com/hostpath"
[limits]
call-timeout-ms = 1500
memory-mib = 32
max-concurrency = 2
table-elements = 5000
instances = 8
output-kib = 4
log-kib = 8
[[dirs]]
host = "data"
guest = "/volumes"
access = "read-write"
[volumes]
kinds = ["host-path"]
path-prefixes = ["/srv/volumes"]
[config]
node-dir = "/srv/volumes"
nested = { a = 1 }
"#;

    #[test]
    fn full_grant_parses_with_relative_dir_resolved() {
        let g = Grants::parse(FULL, Path::new("/etc/plugins")).unwrap();
        assert_eq!(g.provisioner, "example.com/hostpath");
        assert_eq!(g.call_timeout, Duration::from_millis(1500));
        assert_eq!(g.memory_bytes, 32 * 1024 * 1024);
        assert_eq!(g.max_concurrency, 2);
        assert_eq!((g.table_elements, g.instances), (5000, 8));
        assert_eq!((g.output_bytes, g.log_bytes), (4096, 8192));
        assert_eq!(g.dirs[0].host, PathBuf::from("/etc/plugins/data"));
        assert_eq!(g.dirs[0].access, DirAccess::ReadWrite);
        assert!(g.volumes.kinds.contains(&SourceKind::HostPath));
        let config: serde_json::Value = serde_json::from_str(&g.config_json).unwrap();
        assert_eq!(config["nested"]["a"], 1);
    }

    #[test]
    fn minimal_grant_gets_defaults_and_denies_everything() {
        let g = Grants::parse("provisioner = \"x/y\"", Path::new("/")).unwrap();
        assert_eq!(g.call_timeout, DEFAULT_CALL_TIMEOUT);
        assert_eq!(g.table_elements, DEFAULT_TABLE_ELEMENTS);
        assert_eq!(g.instances, DEFAULT_INSTANCES);
        assert_eq!(g.output_bytes, DEFAULT_OUTPUT_KIB * 1024);
        assert_eq!(g.log_bytes, DEFAULT_LOG_KIB * 1024);
        assert!(g.dirs.is_empty());
        assert!(g.volumes.kinds.is_empty());
        assert_eq!(g.config_json, "{}");
        assert!(!g.path_granted(Path::new("/tmp")));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        let err = Grants::parse("provisioner = \"x\"\nnetwork = true", Path::new("/")).unwrap_err();
        assert!(err.to_string().contains("network"), "{err}");
        let err = Grants::parse(
            "provisioner = \"x\"\n[limits]\noutput-kib = 0",
            Path::new("/"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("output-kib"), "{err}");
        let err = Grants::parse("provisioner = \"\"", Path::new("/")).unwrap_err();
        assert!(err.to_string().contains("provisioner"), "{err}");
        let err = Grants::parse(
            "provisioner = \"x\"\n[volumes]\npath-prefixes = [\"/a/../etc\"]",
            Path::new("/"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("path-prefixes"), "{err}");
        let err = Grants::parse(
            "provisioner = \"x\"\n[volumes]\nkinds = [\"rbd\"]",
            Path::new("/"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("rbd"), "{err}");
    }

    #[test]
    fn path_prefix_match_is_by_component() {
        let g = Grants::parse(
            "provisioner = \"x\"\n[volumes]\npath-prefixes = [\"/srv/vol\"]",
            Path::new("/"),
        )
        .unwrap();
        assert!(g.path_granted(Path::new("/srv/vol/pvc-1")));
        assert!(!g.path_granted(Path::new("/srv/volumes/pvc-1")));
    }
}
