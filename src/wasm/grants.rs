//! Grant files: what the operator allows one guest to see, build and spend.
//!
//! A grant file `NAME.toml` sits next to `NAME.wasm`. Everything not granted is denied.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::pin::ModulePin;
use crate::sizes::SizeBackend;

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
/// Default cap on the linear memories one call may create: a wasip2 guest has one, a wasip1
/// guest with the adapter two. They all share `memory-mib`.
pub const DEFAULT_MEMORIES: usize = 2;
/// Default cap on the descriptors (files, directories) one call may hold open at once,
/// besides its preopened directories.
pub const DEFAULT_DESCRIPTORS: usize = 64;

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
    /// Whether the host makes every volume in this directory with an enforced size, and how
    /// (`sizes = "btrfs"`: a subvolume limited by its qgroup). Read-write directories only.
    #[serde(default)]
    pub sizes: Option<SizeBackend>,
    /// Whether the host may turn the filesystem's quotas on at load when they are off
    /// (`enable-quotas = true`; the default leaves that to the operator and refuses the grant).
    #[serde(default, rename = "enable-quotas")]
    pub enable_quotas: bool,
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
    /// Linear memories one call may create (all of them together within `memory-mib`).
    pub memories: Option<usize>,
    /// Descriptors one call may hold open at once (preopens not counted).
    pub descriptors: Option<usize>,
}

/// A Kubernetes reclaim policy a guest may put on its PVs (`Recycle` can never be granted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GrantedReclaim {
    /// `Delete`.
    Delete,
    /// `Retain`.
    Retain,
    /// `Recycle`: parsed only to be refused with a clear message.
    Recycle,
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
    /// Export paths per NFS server: a volume's path must lie under one of its server's
    /// prefixes (a server without an entry grants no path).
    #[serde(default)]
    pub nfs_exports: BTreeMap<String, Vec<PathBuf>>,
    /// Volume-handle patterns per CSI driver (`*` matches any run of characters); a driver
    /// without an entry grants no handle.
    #[serde(default)]
    pub csi_volume_handles: BTreeMap<String, Vec<String>>,
    /// Reclaim policies the guest may set (default: delete and retain; never recycle).
    #[serde(default)]
    pub reclaim_policies: Option<BTreeSet<GrantedReclaim>>,
    /// `false` lets `host-path`/`local` prefixes lie outside every read-write grant directory
    /// (paths this process cannot see, such as local-path's per-node mapping): their volumes
    /// then get the text checks only. Logged at load. Default: every such prefix must be
    /// covered, so every returned path is walked on disk.
    #[serde(default)]
    pub on_disk_check: Option<bool>,
    /// Owner uids the guest may give its volumes' directories (`"1000-1999"` or `"1000"`);
    /// none by default.
    #[serde(default)]
    pub uids: Vec<super::ownership::IdRange>,
    /// Group gids the guest may give its volumes' directories; none by default.
    #[serde(default)]
    pub gids: Vec<super::ownership::IdRange>,
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
    #[serde(default)]
    module: Option<super::pin::ModuleTable>,
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
    /// Linear memories per call.
    pub memories: usize,
    /// Open descriptors per call.
    pub descriptors: usize,
    /// Preopened directories, host paths absolute.
    pub dirs: Vec<DirGrant>,
    /// What built PVs may point at.
    pub volumes: VolumeGrants,
    /// The guest's config, as JSON text.
    pub config_json: String,
    /// The digest the module's bytes must have, if the operator pinned one.
    pub module: ModulePin,
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
            memories: None,
            descriptors: None,
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
        let memories = bounded("memories", limits.memories, DEFAULT_MEMORIES, 16)?;
        let descriptors = bounded("descriptors", limits.descriptors, DEFAULT_DESCRIPTORS, 4096)?;
        let mut dirs = Vec::with_capacity(file.dirs.len());
        for dir in file.dirs {
            if !dir.guest.starts_with('/') {
                return Err(invalid(format!(
                    "dirs: guest path {:?} must be absolute",
                    dir.guest
                )));
            }
            if dir.sizes.is_some() && dir.access != DirAccess::ReadWrite {
                return Err(invalid(format!(
                    "dirs: {} has `sizes` but is not read-write (the host makes volumes there)",
                    dir.host.display()
                )));
            }
            if dir.enable_quotas && dir.sizes.is_none() {
                return Err(invalid(format!(
                    "dirs: {} has `enable-quotas` without `sizes`",
                    dir.host.display()
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
        // Entries for servers or drivers not granted are inert (a grant can take a server
        // away without editing its exports).
        for (server, prefixes) in &file.volumes.nfs_exports {
            for prefix in prefixes {
                if !prefix.is_absolute() || has_parent_component(prefix) {
                    return Err(invalid(format!(
                        "volumes.nfs-exports.{server:?}: {} must be absolute and without `..`",
                        prefix.display()
                    )));
                }
            }
        }
        if let Some(policies) = &file.volumes.reclaim_policies
            && policies.contains(&GrantedReclaim::Recycle)
        {
            return Err(invalid(
                "volumes.reclaim-policies: recycle cannot be granted (kube-controller-manager would \
                 scrub the directory with `rm -rf` in a pod of its own)"
                    .into(),
            ));
        }
        let module = ModulePin::from_table(file.module, base).map_err(invalid)?;
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
            memories,
            descriptors,
            dirs,
            volumes: file.volumes,
            config_json,
            module,
        })
    }

    /// Whether `policy` may be set on a PV (default: delete and retain).
    pub fn reclaim_granted(&self, policy: GrantedReclaim) -> bool {
        match &self.volumes.reclaim_policies {
            Some(granted) => granted.contains(&policy),
            None => policy != GrantedReclaim::Recycle,
        }
    }

    /// Whether the NFS export `path` on `server` lies under one of the server's granted prefixes.
    pub fn nfs_export_granted(&self, server: &str, path: &Path) -> bool {
        self.volumes
            .nfs_exports
            .get(server)
            .is_some_and(|prefixes| prefixes.iter().any(|p| path.starts_with(p)))
    }

    /// Whether `handle` matches one of the patterns granted for the CSI `driver`.
    pub fn csi_handle_granted(&self, driver: &str, handle: &str) -> bool {
        self.volumes
            .csi_volume_handles
            .get(driver)
            .is_some_and(|patterns| patterns.iter().any(|p| glob_match(p, handle)))
    }

    /// Resolves the grant against this process' filesystem, at load: every `dirs.host` becomes
    /// its canonical path (it must exist); a `host-path`/`local` prefix must be canonical
    /// (no link, `.` or `..` in it) and lie in a read-write grant directory, so the on-disk
    /// check covers every path a guest returns, unless `on-disk-check = false` says otherwise;
    /// and no directory or prefix may overlap a `protected` one (the plugins directory, the
    /// module cache): a guest writing there could rewrite its own grants or plant native code.
    /// Returns what the load log should say.
    pub fn resolve(&mut self, protected: &[&Path]) -> Result<Vec<String>, String> {
        let mut notes = Vec::new();
        for dir in &mut self.dirs {
            dir.host = dir
                .host
                .canonicalize()
                .map_err(|e| format!("dirs: {} cannot be resolved: {e}", dir.host.display()))?;
        }
        for dir in &self.dirs {
            if let Some(backend) = dir.sizes {
                let probed = crate::sizes::open_dir(&dir.host)
                    .and_then(|fd| backend.check(&fd, dir.enable_quotas));
                match probed {
                    Ok(_) => notes.push(format!(
                        "dirs: {} makes every volume with an enforced size ({})",
                        dir.host.display(),
                        backend.name()
                    )),
                    Err(error) => {
                        return Err(format!(
                            "dirs: {} cannot hold volumes with enforced sizes (`sizes = \"{}\"`): {error}",
                            dir.host.display(),
                            backend.name()
                        ));
                    }
                }
            }
        }
        let protected: Vec<PathBuf> = protected.iter().map(|p| resolve_existing(p)).collect();
        let overlaps = |path: &Path| {
            protected
                .iter()
                .find(|p| path.starts_with(p) || p.starts_with(path))
        };
        for dir in &self.dirs {
            if let Some(protected) = overlaps(&dir.host) {
                return Err(format!(
                    "dirs: {} overlaps {}, which the host keeps for itself (plugins or module cache)",
                    dir.host.display(),
                    protected.display()
                ));
            }
        }
        let node_paths = [SourceKind::HostPath, SourceKind::Local]
            .iter()
            .any(|kind| self.volumes.kinds.contains(kind));
        let checked = self.volumes.on_disk_check != Some(false);
        for prefix in &mut self.volumes.path_prefixes {
            *prefix = prefix.components().collect();
            if let Some(protected) = overlaps(prefix) {
                return Err(format!(
                    "volumes.path-prefixes: {} overlaps {}, which the host keeps for itself (plugins or module cache)",
                    prefix.display(),
                    protected.display()
                ));
            }
            if !node_paths {
                continue;
            }
            let covered = self
                .dirs
                .iter()
                .any(|d| d.access == DirAccess::ReadWrite && prefix.starts_with(&d.host));
            if covered {
                let resolved = resolve_existing(prefix);
                if resolved != *prefix {
                    return Err(format!(
                        "volumes.path-prefixes: {} resolves to {}; write the resolved path (the kubelet follows the links)",
                        prefix.display(),
                        resolved.display()
                    ));
                }
            } else if checked {
                return Err(format!(
                    "volumes.path-prefixes: {} lies in no read-write grant directory, so the paths a guest returns there could not be checked on disk; grant the directory, or set `on-disk-check = false` under [volumes] to accept text checks only",
                    prefix.display()
                ));
            } else {
                notes.push(format!(
                    "volumes.path-prefixes: {} lies in no grant directory; its volumes get the text checks only (on-disk-check = false)",
                    prefix.display()
                ));
            }
        }
        Ok(notes)
    }

    /// Whether `path` (absolute, normalised) lies under one of the granted path prefixes.
    pub fn path_granted(&self, path: &Path) -> bool {
        self.volumes
            .path_prefixes
            .iter()
            .any(|prefix| path.starts_with(prefix))
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters (also empty) and
/// every other character only itself.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// `path` with its longest existing ancestor canonicalised and the rest appended as written.
pub fn resolve_existing(path: &Path) -> PathBuf {
    for ancestor in path.ancestors() {
        if let Ok(resolved) = ancestor.canonicalize() {
            let rest = path.strip_prefix(ancestor).unwrap_or(Path::new(""));
            return resolved.join(rest);
        }
    }
    path.to_owned()
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
    fn glob_patterns() {
        for (pattern, text, ok) in [
            ("tenant-a-*", "tenant-a-1", true),
            ("tenant-a-*", "tenant-b-1", false),
            ("*", "", true),
            ("exact", "exact", true),
            ("exact", "exactly", false),
            ("a*b*c", "a-x-b-y-c", true),
            ("a*b*c", "a-x-c-b", false),
            ("ab*ba", "aba", false),
            ("vol/*/data", "vol/1/data", true),
        ] {
            assert_eq!(glob_match(pattern, text), ok, "{pattern} ~ {text}");
        }
    }

    #[test]
    fn volume_grants_per_server_driver_and_policy() {
        let g = Grants::parse(
            r#"provisioner = "x"
[volumes]
kinds = ["nfs", "csi"]
nfs-servers = ["nfs.a", "nfs.b"]
csi-drivers = ["csi.a", "csi.b"]
reclaim-policies = ["retain"]
[volumes.nfs-exports]
"nfs.a" = ["/exports/tenant-a"]
[volumes.csi-volume-handles]
"csi.a" = ["tenant-a-*"]"#,
            Path::new("/"),
        )
        .unwrap();
        assert!(g.nfs_export_granted("nfs.a", Path::new("/exports/tenant-a/pvc-1")));
        assert!(!g.nfs_export_granted("nfs.a", Path::new("/exports/tenant-b/pvc-1")));
        assert!(!g.nfs_export_granted("nfs.a", Path::new("/")));
        assert!(!g.nfs_export_granted("nfs.b", Path::new("/exports/tenant-a")));
        assert!(g.csi_handle_granted("csi.a", "tenant-a-vol1"));
        assert!(!g.csi_handle_granted("csi.a", "tenant-b-vol1"));
        assert!(!g.csi_handle_granted("csi.b", "tenant-a-vol1"));
        assert!(g.reclaim_granted(GrantedReclaim::Retain));
        assert!(!g.reclaim_granted(GrantedReclaim::Delete));
        let defaults = Grants::parse("provisioner = \"x\"", Path::new("/")).unwrap();
        assert!(defaults.reclaim_granted(GrantedReclaim::Delete));
        assert!(!defaults.reclaim_granted(GrantedReclaim::Recycle));
        for (text, why) in [
            (
                "[volumes]\nreclaim-policies = [\"recycle\"]",
                "recycle cannot be granted",
            ),
            (
                "[volumes]\nnfs-servers = [\"x\"]\n[volumes.nfs-exports]\n\"x\" = [\"e\"]",
                "must be absolute",
            ),
            ("[limits]\ndescriptors = 0", "descriptors"),
            ("[limits]\nmemories = 17", "memories"),
        ] {
            let err = Grants::parse(&format!("provisioner = \"x\"\n{text}"), Path::new("/"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn grant_dirs_may_not_overlap_the_plugins_directory_or_the_cache() {
        let root = tempfile::tempdir().unwrap();
        let plugins = root.path().join("plugins");
        let cache = root.path().join("cache");
        std::fs::create_dir_all(&plugins).unwrap();
        std::fs::create_dir_all(&cache).unwrap();
        let grant = |host: &Path| {
            Grants::parse(
                &format!(
                    "provisioner = \"x\"\n[[dirs]]\nhost = \"{}\"\nguest = \"/d\"\naccess = \"read-write\"",
                    host.display()
                ),
                Path::new("/"),
            )
            .unwrap()
        };
        let protected = [plugins.as_path(), cache.as_path()];
        std::fs::create_dir_all(plugins.join("sub")).unwrap();
        for bad in [root.path().to_owned(), plugins.join("sub"), cache.clone()] {
            let err = grant(&bad).resolve(&protected).unwrap_err();
            assert!(err.contains("overlaps"), "{err}");
        }
        let data = root.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        assert_eq!(grant(&data).resolve(&protected), Ok(vec![]));
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
