//! Native unit testing of guests: a [`FakeHost`] with grants of its own and recorded logs, and
//! records that read like the spec (`claim("ns", "data")`, `class("fast", &[...])`).
//!
//! ```
//! use wasm_provisioner_sdk::testing::{self, FakeHost};
//! use wasm_provisioner_sdk::{Host, VolumeSpec, HostPathType};
//! let host = FakeHost::new().host_paths("/data");
//! assert!(host.check(&VolumeSpec::host_path("/data/pvc-1", HostPathType::DirectoryOrCreate)).is_ok());
//! assert!(host.check(&VolumeSpec::host_path("/etc", HostPathType::Directory)).is_err());
//! let request = testing::request(testing::claim("ns", "data"), testing::class("fast", &[]), "{}");
//! assert_eq!(request.pv_name, "pvc-uid-ns-data");
//! ```

use std::cell::RefCell;

use crate::host::Host;
use crate::spec::VolumeSpec;
use crate::types::*;

/// A host for native tests: checks specs against its own small grants, records log lines.
#[derive(Debug, Default)]
pub struct FakeHost {
    host_path_prefixes: Vec<String>,
    local_prefixes: Vec<String>,
    nfs_servers: Vec<String>,
    uids: Vec<(u32, u32)>,
    gids: Vec<(u32, u32)>,
    dirs: Vec<(String, String)>,
    logs: RefCell<Vec<(LogLevel, String)>>,
}

impl FakeHost {
    /// A host that grants nothing (every spec is refused).
    pub fn new() -> Self {
        Self::default()
    }

    /// Grants `hostPath` volumes under `prefix`.
    #[must_use]
    pub fn host_paths(mut self, prefix: &str) -> Self {
        self.host_path_prefixes.push(prefix.to_owned());
        self
    }

    /// Maps the granted directory the guest sees at `guest` to `native`, a directory of the
    /// test's (what [`Host::dir`] returns): a native test cannot use the guest's preopens.
    #[must_use]
    pub fn dir(mut self, guest: &str, native: &str) -> Self {
        self.dirs.push((guest.to_owned(), native.to_owned()));
        self
    }

    /// Grants `local` volumes under `prefix`.
    #[must_use]
    pub fn local_paths(mut self, prefix: &str) -> Self {
        self.local_prefixes.push(prefix.to_owned());
        self
    }

    /// Grants NFS volumes on `server`.
    #[must_use]
    pub fn nfs_server(mut self, server: &str) -> Self {
        self.nfs_servers.push(server.to_owned());
        self
    }

    /// Grants owner uids `first..=last` (none by default, as in a grant file).
    #[must_use]
    pub fn uids(mut self, first: u32, last: u32) -> Self {
        self.uids.push((first, last));
        self
    }

    /// Grants group gids `first..=last` (none by default).
    #[must_use]
    pub fn gids(mut self, first: u32, last: u32) -> Self {
        self.gids.push((first, last));
        self
    }

    /// The messages logged so far, each as `LEVEL message key=value ...`.
    pub fn logs(&self) -> Vec<String> {
        self.logs
            .borrow()
            .iter()
            .map(|(level, line)| format!("{level:?} {line}"))
            .collect()
    }
}

fn under(path: &str, prefixes: &[String]) -> bool {
    prefixes.iter().any(|prefix| {
        let prefix = prefix.trim_end_matches('/');
        path == prefix
            || path
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

fn normalised(path: &str) -> bool {
    path.starts_with('/')
        && !path.contains("//")
        && !path.split('/').any(|part| part == "." || part == "..")
}

impl Host for FakeHost {
    fn dir(&self, guest: &str) -> String {
        self.dirs
            .iter()
            .find(|(mapped, _)| mapped == guest)
            .map_or_else(|| guest.to_owned(), |(_, native)| native.clone())
    }

    fn log(&self, level: LogLevel, message: &str, fields: &[(&str, &str)]) {
        let mut line = message.to_owned();
        for (key, value) in fields {
            line.push_str(&format!(" {key}={value}"));
        }
        self.logs.borrow_mut().push((level, line));
    }

    /// The host's main checks, in small: source present, kind granted, path normalised and
    /// under a granted prefix, server granted, `local` with node affinity, owner and group
    /// within the granted ranges, no reserved keys.
    fn check(&self, spec: &VolumeSpec) -> Result<(), SpecError> {
        let refused = |what: String| Err(SpecError::NotGranted(what));
        let (path, prefixes) = match &spec.source {
            None => return Err(SpecError::Invalid("the volume has no source".to_owned())),
            Some(VolumeSource::HostPath(source)) => (&source.path, &self.host_path_prefixes),
            Some(VolumeSource::Local(source)) => {
                if spec.node_affinity.is_empty() {
                    return Err(SpecError::Invalid(
                        "a local volume needs node affinity".to_owned(),
                    ));
                }
                (&source.path, &self.local_prefixes)
            }
            Some(VolumeSource::Nfs(source)) => {
                if !self.nfs_servers.contains(&source.server) {
                    return refused(format!("NFS server {:?} is not granted", source.server));
                }
                (&source.path, &Vec::new())
            }
            Some(VolumeSource::Csi(source)) => {
                return refused(format!("CSI driver {:?} is not granted", source.driver));
            }
        };
        if !normalised(path) {
            return Err(SpecError::Invalid(format!(
                "path {path:?} must be absolute and normalised"
            )));
        }
        if !matches!(spec.source, Some(VolumeSource::Nfs(_))) && !under(path, prefixes) {
            return refused(format!(
                "path {path:?} is outside the granted prefixes {prefixes:?}"
            ));
        }
        let granted = |id: Option<u32>, ranges: &[(u32, u32)]| {
            id.is_none_or(|id| {
                ranges
                    .iter()
                    .any(|(first, last)| (*first..=*last).contains(&id))
            })
        };
        let ownership = &spec.ownership;
        if !granted(ownership.uid, &self.uids) || !granted(ownership.gid, &self.gids) {
            return refused(format!(
                "owner {ownership:?} is outside the granted uids {:?} / gids {:?}",
                self.uids, self.gids
            ));
        }
        if ownership.mode.is_some_and(|mode| mode > 0o7777) {
            return Err(SpecError::Invalid(format!(
                "mode {:o} has bits beyond 0o7777",
                ownership.mode.unwrap_or_default()
            )));
        }
        for key in spec.annotations.keys().chain(spec.labels.keys()) {
            if key.starts_with("kubernetes.io/") || key.contains(".kubernetes.io/") {
                return refused(format!("key {key:?} is one the host owns"));
            }
        }
        Ok(())
    }
}

/// A claim `namespace/name`: uid `uid-<namespace>-<name>`, 1 GiB, ReadWriteOnce, filesystem.
pub fn claim(namespace: &str, name: &str) -> Claim {
    Claim {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        uid: format!("uid-{namespace}-{name}"),
        labels: Vec::new(),
        annotations: Vec::new(),
        requested_bytes: crate::quantity::GIB,
        limit_bytes: None,
        access_modes: vec![AccessMode::ReadWriteOnce],
        volume_mode: VolumeMode::Filesystem,
        has_selector: false,
        has_data_source: false,
    }
}

/// A class `name` with parameters; Delete, Immediate, no mount options.
pub fn class(name: &str, parameters: &[(&str, &str)]) -> StorageClass {
    StorageClass {
        name: name.to_owned(),
        provisioner: "example.com/test".to_owned(),
        parameters: parameters
            .iter()
            .map(|(key, value)| pair(key, value))
            .collect(),
        reclaim_policy: ReclaimPolicy::Delete,
        mount_options: Vec::new(),
        binding_mode: BindingMode::Immediate,
        allowed_topologies: Vec::new(),
    }
}

/// A provision request as the host makes it: PV `pvc-<claim uid>`, no selected node.
pub fn request(claim: Claim, class: StorageClass, config: &str) -> ProvisionRequest {
    ProvisionRequest {
        pv_name: format!("pvc-{}", claim.uid),
        claim,
        storage_class: class,
        selected_node: None,
        config: config.to_owned(),
    }
}

/// The volume the host would hand `delete` for the PV it built from `request` and `spec`.
pub fn volume(request: &ProvisionRequest, spec: &VolumeSpec) -> Volume {
    Volume {
        name: request.pv_name.clone(),
        capacity_bytes: spec.capacity.unwrap_or(request.claim.requested_bytes),
        source: spec.source.clone().expect("the spec has a source"),
        reclaim_policy: spec
            .reclaim_policy
            .unwrap_or(request.storage_class.reclaim_policy),
        storage_class_name: request.storage_class.name.clone(),
        labels: spec
            .labels
            .iter()
            .map(|(key, value)| pair(key, value))
            .collect(),
        annotations: spec.annotation_pairs(),
        node_affinity: spec.node_affinity.clone(),
        claim_namespace: Some(request.claim.namespace.clone()),
        claim_name: Some(request.claim.name.clone()),
    }
}

/// A grant's `[config]` as the host hands it over (JSON), from string keys and values.
pub fn config(pairs: &[(&str, &str)]) -> String {
    let object: serde_json::Map<String, serde_json::Value> = pairs
        .iter()
        .map(|(key, value)| ((*key).to_owned(), (*value).into()))
        .collect();
    serde_json::Value::Object(object).to_string()
}

/// A delete request for `volume`, with no StorageClass (it may be gone by then).
pub fn delete_request(volume: Volume, config: &str) -> DeleteRequest {
    DeleteRequest {
        volume,
        storage_class: None,
        config: config.to_owned(),
    }
}

/// An expand request for `volume` of `class`, asking for `requested_bytes`.
pub fn expand_request(
    volume: Volume,
    class: StorageClass,
    requested_bytes: u64,
    config: &str,
) -> crate::ExpandRequest {
    crate::ExpandRequest {
        volume,
        requested_bytes,
        storage_class: class,
        config: config.to_owned(),
    }
}

/// Panics, naming the difference, unless the grant file `grant` (TOML text, e.g.
/// `include_str!("../my-guest.toml")`) grants what `needs` declares: the same `provisioner`,
/// `[[dirs]]` guest paths and access, `[volumes] kinds` and `[limits]`, and a `[config]` that
/// sets every required key and no undeclared one. A line reader for the flat grant files
/// guests ship, not a TOML parser: so a guest's shipped grant cannot drift from its section.
pub fn assert_grant_matches(needs: &crate::needs::Needs, grant: &str) {
    let declared: serde_json::Value =
        serde_json::from_str(needs.json).expect("the needs section is JSON");
    let mut table = String::new();
    let mut provisioner = String::new();
    let mut dirs: Vec<(String, String)> = Vec::new();
    let mut kinds: Vec<String> = Vec::new();
    let mut config: Vec<String> = Vec::new();
    let mut limits = serde_json::Map::new();
    for line in grant.lines().map(|line| without_comment(line).trim()) {
        if line.starts_with('[') {
            table = line.to_owned();
            if table == "[[dirs]]" {
                dirs.push(Default::default());
            }
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        // Lines inside a multi-line value (`{ node = ... }`) are not keys of the table.
        if !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            continue;
        }
        let text = value.trim_matches('"').to_owned();
        match (table.as_str(), key, dirs.last_mut()) {
            ("", "provisioner", _) => provisioner = text,
            ("[[dirs]]", "guest", Some(dir)) => dir.0 = text,
            ("[[dirs]]", "access", Some(dir)) => dir.1 = text,
            ("[volumes]", "kinds", _) => kinds = quoted_strings(value),
            ("[config]", _, _) => config.push(key.to_owned()),
            ("[limits]", "memory-mib" | "call-timeout-ms", _) => {
                limits.insert(
                    key.to_owned(),
                    value.parse::<u64>().expect("a number").into(),
                );
            }
            _ => {}
        }
    }
    assert_eq!(provisioner, declared["provisioner"], "provisioner");
    let declared_dirs: Vec<(String, String)> = declared["dirs"]
        .as_array()
        .expect("dirs")
        .iter()
        .map(|dir| (text_of(&dir["guest"]), text_of(&dir["access"])))
        .collect();
    assert_eq!(dirs, declared_dirs, "[[dirs]] guest and access");
    let declared_kinds: Vec<String> = declared["kinds"]
        .as_array()
        .expect("kinds")
        .iter()
        .map(text_of)
        .collect();
    assert_eq!(kinds, declared_kinds, "[volumes] kinds");
    assert_eq!(
        serde_json::Value::Object(limits),
        declared["limits"],
        "[limits]"
    );
    for key in &config {
        assert!(
            needs.config.iter().any(|declared| declared.key == key),
            "[config] {key} is not declared"
        );
    }
    for declared in needs.config.iter().filter(|declared| declared.required) {
        assert!(
            config.iter().any(|key| key == declared.key),
            "[config] lacks the required {}",
            declared.key
        );
    }
}

fn without_comment(line: &str) -> &str {
    let mut quoted = false;
    for (at, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '#' if !quoted => return &line[..at],
            _ => {}
        }
    }
    line
}

fn quoted_strings(value: &str) -> Vec<String> {
    value
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

fn text_of(value: &serde_json::Value) -> String {
    value.as_str().unwrap_or_default().to_owned()
}
