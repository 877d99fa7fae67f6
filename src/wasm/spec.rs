//! The volume-spec builder behind the `volume-builder` import: every setter checked against grants.
//!
//! Guests never hand the host a Kubernetes object. They call these setters, each of which refuses
//! what the grant file does not allow, and `finish` checks the whole spec once more, so a value the
//! guest smuggled past one check (or a grant that changed meanwhile) still cannot reach the API.

use std::collections::BTreeMap;
use std::path::Path;

use super::bindings::VolumeSpecBuilder;
use super::bindings::types::{
    AccessMode, CsiSource, HostPathSource, HostPathType, LocalSource, NfsSource,
    NodeSelectorOperator, NodeSelectorTerm, Pair, ReclaimPolicy, SpecError, VolumeMode,
    VolumeSource,
};
use super::grants::{GrantedReclaim, Grants, SourceKind, has_parent_component};
pub use super::metadata::{MAX_ANNOTATIONS_BYTES, MAX_METADATA_ENTRIES, SHOWN_CHARS, shown};
use super::metadata::{
    annotations_size, check_annotations_size, check_entries, check_label_value,
    check_metadata_budget, check_metadata_key, check_qualified_name,
};
use super::ownership::{Ownership, OwnershipError};

/// Largest capacity we accept: what a Kubernetes quantity can hold.
pub const MAX_CAPACITY_BYTES: u64 = i64::MAX as u64;

/// A finished, validated volume description. Fields the guest left unset are `None`; the
/// controller fills them from the claim and class.
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltVolume {
    /// Capacity in bytes.
    pub capacity: Option<u64>,
    /// Access modes.
    pub access_modes: Option<Vec<AccessMode>>,
    /// Volume mode.
    pub volume_mode: Option<VolumeMode>,
    /// Reclaim policy.
    pub reclaim_policy: Option<ReclaimPolicy>,
    /// Mount options.
    pub mount_options: Option<Vec<String>>,
    /// Node affinity terms (ORed).
    pub node_affinity: Vec<NodeSelectorTerm>,
    /// Labels for the PV.
    pub labels: BTreeMap<String, String>,
    /// Annotations for the PV.
    pub annotations: BTreeMap<String, String>,
    /// The one storage source.
    pub source: VolumeSource,
    /// Owner, group and mode the host gives the source's directory (nothing asked: empty).
    pub ownership: Ownership,
}

/// One line describing a refused volume-spec value.
pub fn describe_spec_error(error: &SpecError) -> String {
    match error {
        SpecError::NotGranted(m) => format!("not granted: {m}"),
        SpecError::Invalid(m) => format!("invalid: {m}"),
    }
}

fn not_granted(msg: impl Into<String>) -> SpecError {
    SpecError::NotGranted(msg.into())
}

fn invalid(msg: impl Into<String>) -> SpecError {
    SpecError::Invalid(msg.into())
}

impl VolumeSpecBuilder {
    /// Sets the capacity.
    pub fn capacity(&mut self, bytes: u64) -> Result<(), SpecError> {
        check_capacity(bytes)?;
        self.capacity = Some(bytes);
        Ok(())
    }

    /// Sets the access modes.
    pub fn access_modes(&mut self, modes: Vec<AccessMode>) -> Result<(), SpecError> {
        if modes.is_empty() {
            return Err(invalid("access modes must not be empty"));
        }
        self.access_modes = Some(modes);
        Ok(())
    }

    /// Sets the volume mode.
    pub fn volume_mode(&mut self, mode: VolumeMode) {
        self.volume_mode = Some(mode);
    }

    /// Sets the reclaim policy.
    pub fn reclaim_policy(&mut self, policy: ReclaimPolicy) {
        self.reclaim_policy = Some(policy);
    }

    /// Sets the mount options.
    pub fn mount_options(&mut self, options: Vec<String>) -> Result<(), SpecError> {
        check_mount_options(&options)?;
        self.mount_options = Some(options);
        Ok(())
    }

    /// Sets node affinity.
    pub fn node_affinity(&mut self, terms: Vec<NodeSelectorTerm>) -> Result<(), SpecError> {
        check_node_affinity(&terms)?;
        self.node_affinity = terms;
        Ok(())
    }

    /// Adds a label. Checked before it is kept: a refused label is dropped, never stored.
    pub fn label(&mut self, key: String, value: String) -> Result<(), SpecError> {
        check_metadata_key(&key)?;
        check_label_value(&value)?;
        let added = usize::from(!self.labels.contains_key(&key));
        check_entries(self.labels.len() + self.annotations.len() + added)?;
        self.labels.insert(key, value);
        Ok(())
    }

    /// Adds an annotation. Checked before it is kept: a refused annotation is dropped, never
    /// stored, so refusals cannot pile up host memory.
    pub fn annotation(&mut self, key: String, value: String) -> Result<(), SpecError> {
        check_metadata_key(&key)?;
        let replaced = self.annotations.get(&key).map(|v| key.len() + v.len());
        let added = usize::from(replaced.is_none());
        check_entries(self.labels.len() + self.annotations.len() + added)?;
        let size =
            annotations_size(&self.annotations) - replaced.unwrap_or(0) + key.len() + value.len();
        check_annotations_size(size)?;
        self.annotations.insert(key, value);
        Ok(())
    }

    /// Sets a hostPath source.
    pub fn host_path(
        &mut self,
        grants: &Grants,
        path: String,
        kind: HostPathType,
    ) -> Result<(), SpecError> {
        let source = VolumeSource::HostPath(HostPathSource { path, kind });
        check_source(grants, &source)?;
        self.source = Some(source);
        Ok(())
    }

    /// Sets a local source.
    pub fn local(
        &mut self,
        grants: &Grants,
        path: String,
        fs_type: Option<String>,
    ) -> Result<(), SpecError> {
        let source = VolumeSource::Local(LocalSource { path, fs_type });
        check_source(grants, &source)?;
        self.source = Some(source);
        Ok(())
    }

    /// Sets an NFS source.
    pub fn nfs(
        &mut self,
        grants: &Grants,
        server: String,
        path: String,
        read_only: bool,
    ) -> Result<(), SpecError> {
        let source = VolumeSource::Nfs(NfsSource {
            server,
            path,
            read_only,
        });
        check_source(grants, &source)?;
        self.source = Some(source);
        Ok(())
    }

    /// Sets a CSI source.
    pub fn csi(&mut self, grants: &Grants, source: CsiSource) -> Result<(), SpecError> {
        let source = VolumeSource::Csi(source);
        check_source(grants, &source)?;
        self.source = Some(source);
        Ok(())
    }

    /// Sets the owner, group and mode the host gives the volume's directory, each within the
    /// grant ([`super::ownership::check`]).
    pub fn ownership(&mut self, grants: &Grants, asked: Ownership) -> Result<(), SpecError> {
        check_ownership(grants, &asked)?;
        self.ownership = asked;
        Ok(())
    }

    /// Records that a setter call was refused (the guest may ignore the refusal; the host won't).
    pub fn note_refusal(&mut self, error: &SpecError) {
        self.refusals += 1;
        if self.first_refusal.is_none() {
            // Messages are already bounded (see `shown`); cut at a character boundary and
            // shrink the allocation anyway, so a refusal never keeps more than 512 bytes.
            let message = describe_spec_error(error);
            let cut = message
                .char_indices()
                .map(|(i, _)| i)
                .take_while(|i| *i <= 512)
                .last()
                .unwrap_or(0);
            let message = if message.len() > 512 {
                message[..cut].to_owned()
            } else {
                message
            };
            self.first_refusal = Some(message);
        }
    }

    /// Validates the whole spec against `grants` (which may have changed since the setters ran).
    pub fn finish(self, grants: &Grants) -> Result<BuiltVolume, SpecError> {
        if let Some(first) = self.first_refusal {
            return Err(invalid(format!(
                "the guest returned the volume although {} of its values were refused; first: {first}",
                self.refusals
            )));
        }
        let source = self.source.ok_or_else(|| {
            invalid("the volume has no source: call host-path, local, nfs or csi")
        })?;
        check_source(grants, &source)?;
        if let Some(bytes) = self.capacity {
            check_capacity(bytes)?;
        }
        if let Some(options) = &self.mount_options {
            check_mount_options(options)?;
        }
        check_node_affinity(&self.node_affinity)?;
        if let Some(policy) = self.reclaim_policy {
            check_reclaim_policy(grants, policy)?;
        }
        if matches!(source, VolumeSource::Local(_)) && self.node_affinity.is_empty() {
            return Err(invalid("a local volume needs node affinity"));
        }
        for (key, value) in &self.labels {
            check_metadata_key(key)?;
            check_label_value(value)?;
        }
        for key in self.annotations.keys() {
            check_metadata_key(key)?;
        }
        check_metadata_budget(&self.labels, &self.annotations)?;
        if !self.ownership.is_empty() {
            check_ownership(grants, &self.ownership)?;
            if super::nodepath::node_path(&source).is_none() {
                return Err(invalid(
                    "an owner or mode applies only to a hostPath or local directory",
                ));
            }
        }
        Ok(BuiltVolume {
            capacity: self.capacity,
            access_modes: self.access_modes,
            volume_mode: self.volume_mode,
            reclaim_policy: self.reclaim_policy,
            mount_options: self.mount_options,
            node_affinity: self.node_affinity,
            labels: self.labels,
            annotations: self.annotations,
            source,
            ownership: self.ownership,
        })
    }
}

fn check_ownership(grants: &Grants, asked: &Ownership) -> Result<(), SpecError> {
    super::ownership::check(asked, &grants.volumes.uids, &grants.volumes.gids).map_err(
        |e| match e {
            OwnershipError::Mode(_) => invalid(e.to_string()),
            OwnershipError::Uid { .. } | OwnershipError::Gid { .. } => not_granted(e.to_string()),
        },
    )
}

fn check_reclaim_policy(grants: &Grants, policy: ReclaimPolicy) -> Result<(), SpecError> {
    let granted = match policy {
        ReclaimPolicy::Delete => GrantedReclaim::Delete,
        ReclaimPolicy::Retain => GrantedReclaim::Retain,
        ReclaimPolicy::Recycle => GrantedReclaim::Recycle,
    };
    if grants.reclaim_granted(granted) {
        Ok(())
    } else {
        Err(not_granted(format!(
            "reclaim policy {policy:?} is not granted (Recycle never is)"
        )))
    }
}

/// When the scheduler selected a node for the claim, a volume with node affinity must name
/// exactly that node in every term (`kubernetes.io/hostname in [node]`): a guest may not pin a
/// claim's volume to another node, nor admit others beside it.
pub fn check_selected_node(
    volume: &BuiltVolume,
    selected_node: Option<&str>,
) -> Result<(), SpecError> {
    let Some(node) = selected_node else {
        return Ok(());
    };
    if volume.node_affinity.is_empty() {
        return Ok(());
    }
    let names_node = |term: &NodeSelectorTerm| {
        term.requirements.iter().any(|r| {
            r.key == HOSTNAME_LABEL
                && r.operator == NodeSelectorOperator::In
                && r.values.len() == 1
                && r.values[0] == node
        })
    };
    if volume.node_affinity.iter().all(names_node) {
        Ok(())
    } else {
        Err(not_granted(format!(
            "node affinity does not name the claim's selected node {}: every term needs `{HOSTNAME_LABEL} in [{}]`",
            shown(node),
            shown(node)
        )))
    }
}

/// The node label the kubelet sets to the node's name.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

fn check_capacity(bytes: u64) -> Result<(), SpecError> {
    if bytes == 0 || bytes > MAX_CAPACITY_BYTES {
        return Err(invalid(format!(
            "capacity must be between 1 and {MAX_CAPACITY_BYTES} bytes, got {bytes}"
        )));
    }
    Ok(())
}

fn check_mount_options(options: &[String]) -> Result<(), SpecError> {
    if options.len() > 64 {
        return Err(invalid("at most 64 mount options"));
    }
    for option in options {
        if option.is_empty() || option.len() > 256 || option.contains(['\0', '\n']) {
            return Err(invalid(format!(
                "mount option {} is not valid",
                shown(option)
            )));
        }
    }
    Ok(())
}

fn check_node_affinity(terms: &[NodeSelectorTerm]) -> Result<(), SpecError> {
    if terms.len() > 32 {
        return Err(invalid("at most 32 node selector terms"));
    }
    for term in terms {
        if term.requirements.is_empty() {
            return Err(invalid(
                "a node selector term needs at least one requirement",
            ));
        }
        for req in &term.requirements {
            check_qualified_name(&req.key)?;
            let needs_values = matches!(
                req.operator,
                NodeSelectorOperator::In | NodeSelectorOperator::NotIn
            );
            if needs_values == req.values.is_empty() {
                return Err(invalid(format!(
                    "node selector requirement on {}: `in`/`not-in` need values, `exists`/`does-not-exist` take none",
                    shown(&req.key)
                )));
            }
            for value in &req.values {
                check_label_value(value)?;
            }
        }
    }
    Ok(())
}

/// An absolute, normalised path: no `..`, no `.`, no empty components, no NUL.
fn check_node_path(path: &str) -> Result<(), SpecError> {
    let p = Path::new(path);
    let normalised = path.starts_with('/')
        && !path.contains('\0')
        && !path.contains("//")
        && !has_parent_component(p)
        && !path.split('/').any(|c| c == ".")
        && path.len() <= 4096;
    if normalised {
        Ok(())
    } else {
        Err(invalid(format!(
            "path {} must be absolute and normalised (no `..`, `.` or `//`)",
            shown(path)
        )))
    }
}

fn source_kind(source: &VolumeSource) -> SourceKind {
    match source {
        VolumeSource::HostPath(_) => SourceKind::HostPath,
        VolumeSource::Local(_) => SourceKind::Local,
        VolumeSource::Nfs(_) => SourceKind::Nfs,
        VolumeSource::Csi(_) => SourceKind::Csi,
    }
}

/// Checks one source against the grants: its kind, then its path, server or driver.
pub fn check_source(grants: &Grants, source: &VolumeSource) -> Result<(), SpecError> {
    let kind = source_kind(source);
    if !grants.volumes.kinds.contains(&kind) {
        return Err(not_granted(format!(
            "volume source kind `{}` is not granted to this guest",
            kind.as_str()
        )));
    }
    match source {
        VolumeSource::HostPath(HostPathSource { path, .. })
        | VolumeSource::Local(LocalSource { path, .. }) => {
            check_node_path(path)?;
            if !grants.path_granted(Path::new(path)) {
                return Err(not_granted(format!(
                    "path {} is outside the granted prefixes {:?}",
                    shown(path),
                    grants.volumes.path_prefixes
                )));
            }
        }
        VolumeSource::Nfs(NfsSource { server, path, .. }) => {
            check_node_path(path)?;
            if !grants.volumes.nfs_servers.iter().any(|s| s == server) {
                return Err(not_granted(format!(
                    "NFS server {} is not granted",
                    shown(server)
                )));
            }
            if !grants.nfs_export_granted(server, Path::new(path)) {
                return Err(not_granted(format!(
                    "NFS export {} on {} is not granted (granted: {:?})",
                    shown(path),
                    shown(server),
                    grants
                        .volumes
                        .nfs_exports
                        .get(server.as_str())
                        .cloned()
                        .unwrap_or_default()
                )));
            }
        }
        VolumeSource::Csi(CsiSource {
            driver,
            volume_handle,
            attributes,
            ..
        }) => {
            if !grants.volumes.csi_drivers.iter().any(|d| d == driver) {
                return Err(not_granted(format!(
                    "CSI driver {} is not granted",
                    shown(driver)
                )));
            }
            if volume_handle.is_empty() || volume_handle.len() > 1024 {
                return Err(invalid("CSI volume handle must be 1 to 1024 bytes"));
            }
            if !grants.csi_handle_granted(driver, volume_handle) {
                return Err(not_granted(format!(
                    "CSI volume handle {} of driver {} matches none of the granted patterns {:?}",
                    shown(volume_handle),
                    shown(driver),
                    grants
                        .volumes
                        .csi_volume_handles
                        .get(driver.as_str())
                        .cloned()
                        .unwrap_or_default()
                )));
            }
            let size: usize = attributes
                .iter()
                .map(|Pair { key, value }| key.len() + value.len())
                .sum();
            if size > MAX_ANNOTATIONS_BYTES {
                return Err(invalid("CSI attributes are too large"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wasm::bindings::types::NodeSelectorRequirement;

    fn grants() -> Grants {
        Grants::parse(
            r#"provisioner = "x/y"
[volumes]
kinds = ["host-path", "nfs"]
path-prefixes = ["/srv/vol"]
nfs-servers = ["nfs.local"]
reclaim-policies = ["delete"]
[volumes.nfs-exports]
"nfs.local" = ["/export"]"#,
            Path::new("/"),
        )
        .unwrap()
    }

    fn is_not_granted(r: Result<(), SpecError>) -> bool {
        matches!(r, Err(SpecError::NotGranted(_)))
    }

    #[test]
    fn host_path_inside_prefix_is_accepted_and_finishes() {
        let g = grants();
        let mut b = VolumeSpecBuilder::default();
        b.host_path(&g, "/srv/vol/pvc-1".into(), HostPathType::DirectoryOrCreate)
            .unwrap();
        b.capacity(1 << 30).unwrap();
        let built = b.finish(&g).unwrap();
        assert_eq!(built.capacity, Some(1 << 30));
        assert!(
            matches!(built.source, VolumeSource::HostPath(ref h) if h.path == "/srv/vol/pvc-1")
        );
    }

    #[test]
    fn host_path_outside_prefix_or_escaping_is_refused() {
        let g = grants();
        let mut b = VolumeSpecBuilder::default();
        assert!(is_not_granted(b.host_path(
            &g,
            "/etc".into(),
            HostPathType::Unset
        )));
        assert!(is_not_granted(b.host_path(
            &g,
            "/srv/volumes".into(),
            HostPathType::Unset
        )));
        let dotdot = b.host_path(&g, "/srv/vol/../../etc".into(), HostPathType::Unset);
        assert!(matches!(dotdot, Err(SpecError::Invalid(_))), "{dotdot:?}");
        let relative = b.host_path(&g, "srv/vol/x".into(), HostPathType::Unset);
        assert!(matches!(relative, Err(SpecError::Invalid(_))));
        assert!(matches!(b.finish(&g), Err(SpecError::Invalid(m)) if m.contains("no source")));
    }

    #[test]
    fn ungranted_kinds_servers_and_drivers_are_refused() {
        let g = grants();
        let mut b = VolumeSpecBuilder::default();
        assert!(is_not_granted(b.nfs(
            &g,
            "evil.example".into(),
            "/x".into(),
            false
        )));
        assert!(
            b.nfs(&g, "nfs.local".into(), "/export/a".into(), false)
                .is_ok()
        );
        // Another export on a granted server (`/`, another tenant's) is not granted.
        assert!(is_not_granted(b.nfs(
            &g,
            "nfs.local".into(),
            "/".into(),
            false
        )));
        assert!(is_not_granted(b.nfs(
            &g,
            "nfs.local".into(),
            "/exports-b/x".into(),
            false
        )));
        assert!(is_not_granted(b.local(&g, "/srv/vol/a".into(), None)));
        let csi = CsiSource {
            driver: "d".into(),
            volume_handle: "h".into(),
            fs_type: None,
            read_only: false,
            attributes: vec![],
        };
        assert!(is_not_granted(b.csi(&g, csi)));
    }

    #[test]
    fn finish_rechecks_against_grants_that_changed() {
        let g = grants();
        let mut b = VolumeSpecBuilder::default();
        b.host_path(&g, "/srv/vol/a".into(), HostPathType::Unset)
            .unwrap();
        let mut narrower = g.clone();
        narrower.volumes.path_prefixes = vec!["/srv/other".into()];
        assert!(matches!(b.finish(&narrower), Err(SpecError::NotGranted(_))));
    }

    #[test]
    fn reserved_keys_and_invalid_metadata_are_refused() {
        let mut b = VolumeSpecBuilder::default();
        for key in [
            "pv.kubernetes.io/provisioned-by",
            "kubernetes.io/hostname",
            "foo.kubernetes.io/x",
            "wasm-provisioner.dev/guest",
            "volume.beta.kubernetes.io/storage-class",
        ] {
            assert!(
                is_not_granted(b.annotation(key.into(), "v".into())),
                "{key}"
            );
        }
        assert!(matches!(
            b.label("bad key".into(), "v".into()),
            Err(SpecError::Invalid(_))
        ));
        assert!(matches!(
            b.label("ok".into(), "bad value!".into()),
            Err(SpecError::Invalid(_))
        ));
        assert!(b.label("example.com/tier".into(), "gold".into()).is_ok());
        assert!(
            b.annotation("hostpath.wasm-provisioner.dev/dir".into(), "x".into())
                .is_ok()
        );
        let huge = "x".repeat(MAX_ANNOTATIONS_BYTES);
        assert!(matches!(
            b.annotation("example.com/big".into(), huge),
            Err(SpecError::Invalid(_))
        ));
    }

    #[test]
    fn a_spec_returned_after_a_refusal_is_rejected() {
        let mut b = VolumeSpecBuilder::default();
        b.host_path(&grants(), "/srv/vol/a".into(), HostPathType::Unset)
            .unwrap();
        let refused = b.capacity(u64::MAX).unwrap_err();
        b.note_refusal(&refused);
        let err = b.finish(&grants()).unwrap_err();
        let SpecError::Invalid(message) = err else {
            panic!("{err:?}")
        };
        assert!(
            message.contains("1 of its values were refused") && message.contains("capacity"),
            "{message}"
        );
    }

    #[test]
    fn refused_metadata_is_dropped_and_messages_are_bounded() {
        let mut b = VolumeSpecBuilder::default();
        let big = "\u{1}".repeat(8 << 20);
        for i in 0..4 {
            let err = b
                .annotation(format!("example.com/a{i}"), big.clone())
                .unwrap_err();
            let SpecError::Invalid(message) = &err else {
                panic!("{err:?}")
            };
            assert!(message.len() < 200, "{}", message.len());
            b.note_refusal(&err);
        }
        assert!(
            b.annotations.is_empty(),
            "refused annotations were not kept"
        );
        let err = b.label("example.com/l".into(), big.clone()).unwrap_err();
        assert!(super::describe_spec_error(&err).len() < 600);
        assert!(b.labels.is_empty());
        assert!(b.first_refusal.as_ref().unwrap().len() <= 512);
        // Many small labels: refused past the entry cap, never stored.
        let mut b = VolumeSpecBuilder::default();
        for i in 0..1000 {
            let _ = b.label(format!("example.com/l{i}"), "v".into());
        }
        assert_eq!(b.labels.len(), MAX_METADATA_ENTRIES);
        assert!(shown(&"x".repeat(1000)).len() < 100);
    }

    #[test]
    fn recycle_and_ungranted_policies_are_refused_at_finish() {
        let g = grants();
        let mut b = VolumeSpecBuilder::default();
        b.host_path(&g, "/srv/vol/a".into(), HostPathType::Unset)
            .unwrap();
        b.reclaim_policy(ReclaimPolicy::Recycle);
        assert!(
            matches!(b.clone().finish(&g), Err(SpecError::NotGranted(m)) if m.contains("Recycle"))
        );
        b.reclaim_policy(ReclaimPolicy::Retain);
        assert!(matches!(
            b.clone().finish(&g),
            Err(SpecError::NotGranted(_))
        ));
        b.reclaim_policy(ReclaimPolicy::Delete);
        assert!(b.finish(&g).is_ok());
    }

    #[test]
    fn affinity_must_name_the_selected_node() {
        let g = grants();
        let term = |node: &str| NodeSelectorTerm {
            requirements: vec![NodeSelectorRequirement {
                key: HOSTNAME_LABEL.into(),
                operator: NodeSelectorOperator::In,
                values: vec![node.into()],
            }],
        };
        let mut b = VolumeSpecBuilder::default();
        b.host_path(&g, "/srv/vol/a".into(), HostPathType::Unset)
            .unwrap();
        let none = b.clone().finish(&g).unwrap();
        assert_eq!(check_selected_node(&none, Some("n1")), Ok(()));
        b.node_affinity(vec![term("n1")]).unwrap();
        let right = b.clone().finish(&g).unwrap();
        assert_eq!(check_selected_node(&right, Some("n1")), Ok(()));
        assert_eq!(check_selected_node(&right, None), Ok(()));
        assert!(matches!(
            check_selected_node(&right, Some("n2")),
            Err(SpecError::NotGranted(_))
        ));
        b.node_affinity(vec![term("n1"), term("n2")]).unwrap();
        let both = b.clone().finish(&g).unwrap();
        assert!(check_selected_node(&both, Some("n1")).is_err());
        // One term naming the selected node and others beside it admits the others too.
        let mut wide = term("n1");
        wide.requirements[0].values.push("n2".into());
        b.node_affinity(vec![wide]).unwrap();
        let wide = b.finish(&g).unwrap();
        assert!(check_selected_node(&wide, Some("n1")).is_err());
    }

    #[test]
    fn absurd_capacity_and_affinity_are_refused() {
        let mut b = VolumeSpecBuilder::default();
        assert!(b.capacity(0).is_err());
        assert!(b.capacity(u64::MAX).is_err());
        assert!(b.access_modes(vec![]).is_err());
        let bad = NodeSelectorTerm {
            requirements: vec![NodeSelectorRequirement {
                key: "kubernetes.io/hostname".into(),
                operator: NodeSelectorOperator::In,
                values: vec![],
            }],
        };
        assert!(b.node_affinity(vec![bad]).is_err());
    }
}
