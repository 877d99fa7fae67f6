//! Pure decisions of local-path: class settings, where a volume goes (node, path, type), what
//! delete removes, and which claims and volumes a per-node instance serves. No filesystem.

use wasm_provisioner_sdk::pattern::{self, PatternValues};
use wasm_provisioner_sdk::{
    AccessMode, Claim, Ownership, ParameterError, Parameters, ProvisionError, ProvisionRequest,
    Volume, VolumeSource, final_error, parse_id, parse_mode,
};

use crate::config::{LocalPathConfig, Placement};

/// PV annotation: the node the volume's directory is on.
pub const NODE_ANNOTATION: &str = "local-path.wasm-provisioner.dev/node";
/// PV annotation: `"true"` when the volume is on the shared filesystem path.
pub const SHARED_ANNOTATION: &str = "local-path.wasm-provisioner.dev/shared";
/// Claim annotation the scheduler sets.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// `volumeType`: what kind of PV source to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeType {
    /// `hostPath` with `DirectoryOrCreate` (the default, as the original).
    HostPath,
    /// `local`.
    Local,
}

/// The class parameters (and the claim's `volumeType` annotation, which wins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassSettings {
    /// `nodePath`: one of the node's configured paths.
    pub node_path: Option<String>,
    /// `pathPattern`.
    pub path_pattern: Option<String>,
    /// `allowUnsafePathPattern`: the pattern may use `..` to leave the node path.
    pub allow_unsafe_path_pattern: bool,
    /// `volumeType`.
    pub volume_type: VolumeType,
    /// `nodeAffinityKey`.
    pub node_affinity_key: String,
    /// `userPattern`, `groupPattern`, `permPattern`, expanded and parsed: the owner uid, group
    /// gid and octal mode the host gives the volume's directory (none asked by default).
    pub ownership: Ownership,
}

impl ClassSettings {
    /// Parses the class parameters; unknown ones are refused.
    pub fn parse(request: &ProvisionRequest) -> Result<Self, ParameterError> {
        let mut params = Parameters::of(&request.storage_class);
        let node_path = params.string("nodePath").map(str::to_owned);
        let path_pattern = params.string("pathPattern").map(str::to_owned);
        let allow_unsafe_path_pattern = params.bool("allowUnsafePathPattern")?.unwrap_or(false);
        let class_type = params.string("volumeType");
        let node_affinity_key = params
            .string("nodeAffinityKey")
            .unwrap_or(HOSTNAME_LABEL)
            .to_owned();
        // The original renders these templates for its helper script's chown/chmod; here they
        // are expanded like pathPattern and must come out as numbers the host can apply.
        let values = PatternValues::of(request);
        let mut expanded = |name: &str, parse: fn(&str, &str) -> Result<u32, ParameterError>| {
            params
                .string(name)
                .map(|text| {
                    let value = pattern::substitute(text, &values).map_err(|e| {
                        ParameterError::Invalid {
                            name: name.to_owned(),
                            expected: "a pattern that expands".to_owned(),
                            got: e.to_string(),
                        }
                    })?;
                    parse(name, value.trim())
                })
                .transpose()
        };
        let ownership = Ownership {
            uid: expanded("userPattern", parse_id)?,
            gid: expanded("groupPattern", parse_id)?,
            mode: expanded("permPattern", parse_mode)?,
        };
        params.finish()?;
        let volume_type = match request.claim.annotation("volumeType").or(class_type) {
            None => VolumeType::HostPath,
            Some(value) if value.eq_ignore_ascii_case("hostpath") => VolumeType::HostPath,
            Some(value) if value.eq_ignore_ascii_case("local") => VolumeType::Local,
            Some(value) => {
                return Err(ParameterError::Invalid {
                    name: "volumeType".to_owned(),
                    expected: "local or hostPath".to_owned(),
                    got: value.to_owned(),
                });
            }
        };
        Ok(Self {
            node_path,
            path_pattern,
            allow_unsafe_path_pattern,
            volume_type,
            node_affinity_key,
            ownership,
        })
    }
}

/// Where a volume goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The node (`None`: the shared filesystem path).
    pub node: Option<String>,
    /// The volume's directory as the node sees it.
    pub path: String,
    /// The settings it was planned with.
    pub settings: ClassSettings,
}

/// Plans a provision. `exists` says whether a guest path exists (so a retry finds the path a
/// previous attempt chose).
pub fn plan(
    request: &ProvisionRequest,
    config: &LocalPathConfig,
    exists: impl Fn(&str) -> bool,
) -> Result<Plan, ProvisionError> {
    let start = Start::of(request, config)?;
    if let Some(shared) = start.placement.shared_filesystem_path.clone() {
        return start.on_shared(&shared);
    }
    let node = request.selected_node().ok_or_else(|| {
        final_error(
            "configuration error, no node was specified: use a WaitForFirstConsumer StorageClass",
        )
    })?;
    start.on_node(request, config, node, exists)
}

/// Where a clone goes, and where the data it copies lies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClonePlan {
    /// The clone's volume: on the source's node (or the shared path, if the source is there).
    pub plan: Plan,
    /// The source volume's directory and node, from its PV.
    pub source: Location,
}

/// Plans a clone of `source` (the source claim's PV): the clone goes where its source lies, on
/// the same node (any of the node's paths, picked as for a provision) or on the shared path, so
/// the copy never crosses nodes and the clone's pod lands where its data is. A node selected by
/// the scheduler that is not the source's is refused: nothing can be created there.
pub fn plan_clone(
    request: &ProvisionRequest,
    source: &Volume,
    config: &LocalPathConfig,
    exists: impl Fn(&str) -> bool,
) -> Result<ClonePlan, ProvisionError> {
    let location = locate(source)
        .map_err(|why| final_error(format!("cannot clone volume {}: {why}", source.name)))?;
    let class = &request.storage_class.name;
    let start = Start::of(request, config)?;
    let plan = match (
        &location.node,
        start.placement.shared_filesystem_path.clone(),
    ) {
        (None, Some(shared)) => start.on_shared(&shared)?,
        (None, None) => {
            return Err(final_error(format!(
                "the source volume {} lies on the shared filesystem path, but StorageClass {class:?} has no shared-filesystem-path in the guest config now",
                source.name
            )));
        }
        (Some(node), Some(_)) => {
            return Err(final_error(format!(
                "the source volume {} lies on node {node}, but StorageClass {class:?} places volumes on the shared filesystem path in the guest config now",
                source.name
            )));
        }
        (Some(node), None) => {
            if let Some(selected) = request.selected_node().filter(|selected| selected != node) {
                return Err(final_error(format!(
                    "the clone must be on node {node}, where its source lies, but the scheduler selected node {selected}; \
                     schedule the clone's first pod on {node} (a nodeSelector on kubernetes.io/hostname), then it can be provisioned"
                )));
            }
            start
                .on_node(request, config, node, exists)
                .map_err(|error| match error {
                    // Another node would not do: the clone can only be where its source is.
                    ProvisionError::Reschedule(why) => final_error(format!(
                        "{why}, where the source volume {} lies",
                        source.name
                    )),
                    error => error,
                })?
        }
    };
    Ok(ClonePlan {
        plan,
        source: location,
    })
}

/// What every plan starts from: the class settings, its placement and the volume's directory.
struct Start {
    settings: ClassSettings,
    placement: Placement,
    dir: String,
}

impl Start {
    fn of(request: &ProvisionRequest, config: &LocalPathConfig) -> Result<Self, ProvisionError> {
        let settings = ClassSettings::parse(request)?;
        let claim = &request.claim;
        let class = &request.storage_class.name;
        let placement = config.placement(class).ok_or_else(|| {
            final_error(format!(
                "no placement for StorageClass {class:?} in the guest config"
            ))
        })?;
        if claim.has_selector {
            return Err(final_error("claim.Spec.Selector is not supported"));
        }
        let dir = match &settings.path_pattern {
            None => format!("{}_{}_{}", request.pv_name, claim.namespace, claim.name),
            Some(text) if settings.allow_unsafe_path_pattern => {
                pattern::substitute(text, &PatternValues::of(request))?
            }
            Some(text) => pattern::expand(text, &PatternValues::of(request))?,
        };
        Ok(Self {
            settings,
            placement,
            dir,
        })
    }

    fn on_shared(self, shared: &str) -> Result<Plan, ProvisionError> {
        let path = join_normalised(shared, &self.dir).ok_or_else(|| escaping(&self.dir))?;
        Ok(Plan {
            node: None,
            path,
            settings: self.settings,
        })
    }

    fn on_node(
        self,
        request: &ProvisionRequest,
        config: &LocalPathConfig,
        node: &str,
        exists: impl Fn(&str) -> bool,
    ) -> Result<Plan, ProvisionError> {
        let claim = &request.claim;
        if !claim.access_modes_within(&[AccessMode::ReadWriteOnce, AccessMode::ReadWriteOncePod]) {
            return Err(final_error(
                "node paths only support ReadWriteOnce and ReadWriteOncePod access modes (use a shared-filesystem-path class)",
            ));
        }
        let paths = self
            .placement
            .paths_for(node)
            .filter(|paths| !paths.is_empty())
            .ok_or_else(|| {
                ProvisionError::Reschedule(format!("no local path is configured for node {node}"))
            })?;
        let candidates: Vec<&String> = match &self.settings.node_path {
            Some(wanted) => vec![paths.iter().find(|path| *path == wanted).ok_or_else(|| {
                final_error(format!(
                    "parameter nodePath: {wanted:?} is not configured for node {node} (configured: {})",
                    paths.join(", ")
                ))
            })?],
            None => paths.iter().collect(),
        };
        let mut full: Vec<String> = Vec::new();
        for base in candidates {
            full.push(join_normalised(base, &self.dir).ok_or_else(|| escaping(&self.dir))?);
        }
        let path = full
            .iter()
            .find(|path| exists(&config.guest_path(Some(node), path)))
            .unwrap_or(&full[stable_index(&request.pv_name, full.len())])
            .clone();
        Ok(Plan {
            node: Some(node.to_owned()),
            path,
            settings: self.settings,
        })
    }
}

fn escaping(dir: &str) -> ProvisionError {
    final_error(format!(
        "parameter pathPattern: {dir:?} leaves the filesystem root"
    ))
}

/// `base/relative` with `.`, empty and `..` components resolved lexically; `None` when the
/// result would be `/` or above it.
pub fn join_normalised(base: &str, relative: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for part in base.split('/').chain(relative.split('/')) {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            part => parts.push(part),
        }
    }
    (!parts.is_empty()).then(|| format!("/{}", parts.join("/")))
}

/// A stable pick among `n` paths for a PV (FNV-1a), so every retry picks the same one.
fn stable_index(pv_name: &str, n: usize) -> usize {
    let hash = pv_name
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3)
        });
    (hash % n as u64) as usize
}

/// Where a volume's directory lies: what delete removes and what a clone copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The node (`None`: the shared filesystem path).
    pub node: Option<String>,
    /// The directory, as the node sees it.
    pub path: String,
}

/// What delete removes (the name delete's callers know it by).
pub type Deletion = Location;

/// The volume's node, from provision's annotations, else its hostname node affinity.
pub fn volume_node(volume: &Volume) -> Option<String> {
    if volume.annotation(SHARED_ANNOTATION) == Some("true") {
        return None;
    }
    volume
        .annotation(NODE_ANNOTATION)
        .or_else(|| volume.node_affinity_values(HOSTNAME_LABEL).first().copied())
        .map(str::to_owned)
}

/// Plans a delete from the PV alone (no StorageClass, no config map lookups).
pub fn deletion(volume: &Volume) -> Result<Deletion, String> {
    locate(volume).map_err(|why| format!("refusing to delete volume {}: {why}", volume.name))
}

/// Where the PV says its directory is (its path and node); the reason when it does not say.
pub fn locate(volume: &Volume) -> Result<Location, String> {
    let path = match &volume.source {
        VolumeSource::HostPath(source) => &source.path,
        VolumeSource::Local(source) => &source.path,
        _ => return Err("it is neither hostPath nor local".to_owned()),
    };
    if join_normalised("/", path).as_deref() != Some(path.as_str()) {
        return Err(format!("its path {path:?} is not absolute and normalised"));
    }
    let shared = volume.annotation(SHARED_ANNOTATION) == Some("true");
    let node = volume_node(volume);
    if !shared && node.is_none() {
        return Err(format!(
            "it has no {NODE_ANNOTATION} annotation and no {HOSTNAME_LABEL} node affinity"
        ));
    }
    // The node names a directory under nodes-dir: one component, as node names are.
    if let Some(node) = &node
        && (node.is_empty() || node.contains('/') || node == "." || node == "..")
    {
        return Err(format!("its node {node:?} is not a node name"));
    }
    Ok(Location {
        node,
        path: path.clone(),
    })
}

/// Per-node deployment: whether this instance provisions the claim (selected for its node).
pub fn serves_claim(claim: &Claim, config: &str) -> bool {
    match LocalPathConfig::parse(config)
        .ok()
        .and_then(|config| config.local_node)
    {
        None => true,
        Some(local) => claim.annotation(SELECTED_NODE) == Some(local.as_str()),
    }
}

/// Per-node deployment: whether this instance deletes the volume (on its node).
pub fn serves_volume(volume: &Volume, config: &str) -> bool {
    match LocalPathConfig::parse(config)
        .ok()
        .and_then(|config| config.local_node)
    {
        None => true,
        Some(local) => volume_node(volume).as_deref() == Some(local.as_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasm_provisioner_sdk::testing::{claim, class, request, volume};
    use wasm_provisioner_sdk::{VolumeSpec, pair};

    const CONFIG: &str = r#"{"nodes-dir": "/nodes",
        "node-path-map": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["/opt/lp"]},
                          {"node": "big", "paths": ["/d1", "/d2", "/d3"]},
                          {"node": "full", "paths": []}],
        "storage-class-configs": {"shared": {"shared-filesystem-path": "/mnt/shared"}}}"#;

    fn req(params: &[(&str, &str)], node: Option<&str>) -> ProvisionRequest {
        let mut r = request(claim("ns", "data"), class("local", params), CONFIG);
        r.selected_node = node.map(str::to_owned);
        r
    }

    fn plan_of(r: &ProvisionRequest) -> Result<Plan, ProvisionError> {
        plan(r, &LocalPathConfig::parse(CONFIG).unwrap(), |_| false)
    }

    #[test]
    fn user_group_and_perm_patterns_expand_to_an_owner() {
        let mut r = req(
            &[
                ("userPattern", "${pvc.annotations.uid}"),
                ("groupPattern", "1000"),
                ("permPattern", "0770"),
            ],
            Some("node-1"),
        );
        r.claim
            .annotations
            .push(wasm_provisioner_sdk::pair("uid", "1234"));
        let p = plan_of(&r).unwrap();
        assert_eq!(
            p.settings.ownership,
            Ownership {
                uid: Some(1234),
                gid: Some(1000),
                mode: Some(0o770)
            }
        );
        let error = plan_of(&req(&[("userPattern", "${pvc.name}")], Some("node-1"))).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("userPattern") && m.contains("numeric id")),
            "{error:?}"
        );
        assert_eq!(
            plan_of(&req(&[], Some("node-1")))
                .unwrap()
                .settings
                .ownership,
            Ownership::default(),
            "nothing asked by default"
        );
    }

    #[test]
    fn default_directory_on_the_default_path_of_the_selected_node() {
        let p = plan_of(&req(&[], Some("node-1"))).unwrap();
        assert_eq!(p.node.as_deref(), Some("node-1"));
        assert_eq!(p.path, "/opt/lp/pvc-uid-ns-data_ns_data");
        assert_eq!(p.settings.volume_type, VolumeType::HostPath);
        assert_eq!(p.settings.node_affinity_key, "kubernetes.io/hostname");
    }

    #[test]
    fn node_paths_are_picked_stably_or_where_the_directory_exists() {
        let r = req(&[], Some("big"));
        let first = plan_of(&r).unwrap().path;
        assert_eq!(plan_of(&r).unwrap().path, first, "same pick on every retry");
        let config = LocalPathConfig::parse(CONFIG).unwrap();
        let existing = plan(&r, &config, |p| {
            p == "/nodes/big/d3/pvc-uid-ns-data_ns_data"
        })
        .unwrap();
        assert_eq!(existing.path, "/d3/pvc-uid-ns-data_ns_data");
        let chosen = plan_of(&req(&[("nodePath", "/d2")], Some("big"))).unwrap();
        assert_eq!(chosen.path, "/d2/pvc-uid-ns-data_ns_data");
        let error = plan_of(&req(&[("nodePath", "/d9")], Some("big"))).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("not configured for node big")),
            "{error:?}"
        );
    }

    #[test]
    fn refusals() {
        assert!(
            matches!(plan_of(&req(&[], None)), Err(ProvisionError::Final(m)) if m.contains("no node was specified"))
        );
        assert!(matches!(
            plan_of(&req(&[], Some("full"))),
            Err(ProvisionError::Reschedule(_))
        ));
        let mut rwx = req(&[], Some("n"));
        rwx.claim.access_modes = vec![AccessMode::ReadWriteMany];
        assert!(
            matches!(plan_of(&rwx), Err(ProvisionError::Final(m)) if m.contains("ReadWriteOnce"))
        );
        let mut selector = req(&[], Some("n"));
        selector.claim.has_selector = true;
        assert!(
            matches!(plan_of(&selector), Err(ProvisionError::Final(m)) if m.contains("Selector"))
        );
        assert!(
            matches!(plan_of(&req(&[("volumeType", "nfs")], Some("n"))), Err(ProvisionError::Final(m)) if m.contains("expected local or hostPath"))
        );
        let mut other = req(&[], Some("n"));
        other.storage_class.name = "unlisted".into();
        let config = LocalPathConfig::parse(r#"{"nodes-dir": "/n", "storage-class-configs": {"c": {"shared-filesystem-path": "/s"}}}"#).unwrap();
        assert!(
            matches!(plan(&other, &config, |_| false), Err(ProvisionError::Final(m)) if m.contains("no placement"))
        );
    }

    #[test]
    fn shared_paths_need_no_node_and_allow_any_access_mode() {
        let mut r = req(&[], None);
        r.storage_class.name = "shared".into();
        r.claim.access_modes = vec![AccessMode::ReadWriteMany];
        let p = plan_of(&r).unwrap();
        assert_eq!(
            (p.node, p.path.as_str()),
            (None, "/mnt/shared/pvc-uid-ns-data_ns_data")
        );
    }

    #[test]
    fn patterns_stay_inside_unless_unsafe_is_allowed() {
        let p = plan_of(&req(
            &[("pathPattern", "${pvc.namespace}/${pvc.name}")],
            Some("n"),
        ))
        .unwrap();
        assert_eq!(p.path, "/opt/lp/ns/data");
        let error = plan_of(&req(&[("pathPattern", "../${pvc.name}")], Some("n"))).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("\"..\"")),
            "{error:?}"
        );
        let unsafe_ok = plan_of(&req(
            &[
                ("pathPattern", "../other/${pvc.name}"),
                ("allowUnsafePathPattern", "true"),
            ],
            Some("n"),
        ))
        .unwrap();
        assert_eq!(unsafe_ok.path, "/opt/other/data");
        assert!(
            plan_of(&req(
                &[
                    ("pathPattern", "../../.."),
                    ("allowUnsafePathPattern", "true")
                ],
                Some("n")
            ))
            .is_err()
        );
        let mut by_annotation = req(&[("volumeType", "hostPath")], Some("n"));
        by_annotation
            .claim
            .annotations
            .push(pair("volumeType", "Local"));
        assert_eq!(
            plan_of(&by_annotation).unwrap().settings.volume_type,
            VolumeType::Local
        );
    }

    /// A clone's (node, path), or a part of its final error.
    type Want<'a> = Result<(Option<&'a str>, &'a str), &'a str>;

    /// The source's PV: on `node` (annotation, as provision writes it) or shared (`None`).
    fn source(node: Option<&str>, path: &str) -> Volume {
        let r = req(&[], node);
        let spec = match node {
            Some(node) => VolumeSpec::local(path)
                .node_affinity_in(HOSTNAME_LABEL, &[node])
                .annotation(NODE_ANNOTATION, node),
            None => VolumeSpec::local(path).annotation(SHARED_ANNOTATION, "true"),
        };
        let mut v = volume(&r, &spec);
        v.name = "pvc-source".into();
        v
    }

    #[test]
    fn clones_go_where_their_source_lies() {
        let config = LocalPathConfig::parse(CONFIG).unwrap();
        let on = |class: &str, selected: Option<&str>, source: &Volume| {
            let mut r = req(&[], selected);
            r.storage_class.name = class.into();
            plan_clone(&r, source, &config, |_| false)
        };
        let from_n1 = source(Some("n1"), "/opt/lp/src");
        // (class, selected node, source) ─▶ (clone's node, path) or a final error containing ...
        let cases: Vec<(&str, Option<&str>, Volume, Want)> = vec![
            (
                "local",
                None,
                from_n1.clone(),
                Ok((Some("n1"), "/opt/lp/pvc-uid-ns-data_ns_data")),
            ),
            (
                "local",
                Some("n1"),
                from_n1.clone(),
                Ok((Some("n1"), "/opt/lp/pvc-uid-ns-data_ns_data")),
            ),
            (
                "local",
                Some("n2"),
                from_n1.clone(),
                Err(
                    "the clone must be on node n1, where its source lies, but the scheduler selected node n2",
                ),
            ),
            (
                "shared",
                Some("n2"),
                source(None, "/mnt/shared/src"),
                Ok((None, "/mnt/shared/pvc-uid-ns-data_ns_data")),
            ),
            (
                "local",
                Some("n1"),
                source(None, "/mnt/shared/src"),
                Err("lies on the shared filesystem path"),
            ),
            ("shared", None, from_n1.clone(), Err("lies on node n1")),
            (
                "local",
                None,
                source(Some("full"), "/opt/lp/src"),
                Err(
                    "no local path is configured for node full, where the source volume pvc-source lies",
                ),
            ),
            (
                "local",
                None,
                source(Some(".."), "/opt/lp/src"),
                Err("is not a node name"),
            ),
            (
                "local",
                None,
                source(Some("n1"), "/opt/lp/../src"),
                Err("cannot clone volume pvc-source: its path"),
            ),
        ];
        for (class, selected, source, want) in cases {
            let got = on(class, selected, &source);
            match (want, got) {
                (Ok((node, path)), Ok(clone)) => {
                    assert_eq!(
                        (clone.plan.node.as_deref(), clone.plan.path.as_str()),
                        (node, path),
                        "{class} {selected:?}"
                    );
                    assert_eq!(clone.source, locate(&source).unwrap());
                }
                (Err(want), Err(ProvisionError::Final(message))) => {
                    assert!(message.contains(want), "{class} {selected:?}: {message}")
                }
                (want, got) => panic!("{class} {selected:?}: want {want:?}, got {got:?}"),
            }
        }
        // A node with several paths: the same stable pick as a provision, or the existing copy.
        let from_big = source(Some("big"), "/d1/src");
        let r = req(&[], Some("big"));
        assert_eq!(
            plan_clone(&r, &from_big, &config, |_| false).unwrap().plan,
            plan(&r, &config, |_| false).unwrap()
        );
        let found = plan_clone(&r, &from_big, &config, |p| {
            p == "/nodes/big/d2/pvc-uid-ns-data_ns_data"
        })
        .unwrap();
        assert_eq!(found.plan.path, "/d2/pvc-uid-ns-data_ns_data");
    }

    #[test]
    fn deletion_and_per_node_service_come_from_the_pv() {
        let r = req(&[], Some("n1"));
        let spec = VolumeSpec::local("/opt/lp/x").node_affinity_in(HOSTNAME_LABEL, &["n1"]);
        let v = volume(&r, &spec);
        assert_eq!(
            deletion(&v).unwrap(),
            Deletion {
                node: Some("n1".into()),
                path: "/opt/lp/x".into()
            }
        );
        let v2 = volume(
            &r,
            &VolumeSpec::local("/opt/lp/../x").annotation(NODE_ANNOTATION, "n1"),
        );
        assert!(deletion(&v2).unwrap_err().contains("normalised"));
        let shared = volume(
            &r,
            &VolumeSpec::local("/s/x").annotation(SHARED_ANNOTATION, "true"),
        );
        assert_eq!(deletion(&shared).unwrap().node, None);
        let per_node = r#"{"nodes-dir": "/n", "shared-filesystem-path": "/s", "local-node": "n1"}"#;
        assert!(serves_volume(&v, per_node) && serves_volume(&v, CONFIG));
        assert!(!serves_volume(&shared, per_node));
        let mut c = claim("ns", "c");
        assert!(!serves_claim(&c, per_node) && serves_claim(&c, CONFIG));
        c.annotations.push(pair(SELECTED_NODE, "n1"));
        assert!(serves_claim(&c, per_node));
    }
}
