//! [`VolumeSpec`]: the PersistentVolume a guest describes, as plain data.
//!
//! A guest fills it in natively testable code; inside WebAssembly the SDK replays it into the
//! host's grant-checked `volume-builder` resource ([`crate::Host::check`] does so early, before
//! any storage is created). Fields left unset are filled by the host from the claim and class.

use std::collections::BTreeMap;

use crate::types::{
    AccessMode, HostPathType, NodeSelectorOperator, NodeSelectorRequirement, NodeSelectorTerm,
    Pair, ProvisionRequest, ReclaimPolicy, VolumeMode, VolumeSource,
};

/// A PersistentVolume under construction. Build it with the chained setters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeSpec {
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
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Annotations: record here what `delete` needs, so deleting never depends on the class.
    pub annotations: BTreeMap<String, String>,
    /// The storage source.
    pub source: Option<VolumeSource>,
    /// Owner uid, group gid and mode the host gives the volume's directory (since contract
    /// 0.1.1; a `hostPath` or `local` directory that exists when the spec is returned).
    pub ownership: Ownership,
}

/// Owner, group and permission bits for a volume's directory; `None` parts stay as they are.
/// The host applies them (WASI has no chown or chmod) within the grant's `uids`/`gids` ranges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ownership {
    /// Owner uid.
    pub uid: Option<u32>,
    /// Group gid.
    pub gid: Option<u32>,
    /// Permission bits, at most `0o7777`.
    pub mode: Option<u32>,
}

impl Ownership {
    /// Whether nothing is asked.
    pub fn is_empty(&self) -> bool {
        *self == Ownership::default()
    }
}

impl VolumeSpec {
    /// A spec with a `hostPath` source.
    pub fn host_path(path: impl Into<String>, kind: HostPathType) -> Self {
        Self::with_source(VolumeSource::HostPath(crate::types::HostPathSource {
            path: path.into(),
            kind,
        }))
    }

    /// A spec with a `local` source (the host requires node affinity for it).
    pub fn local(path: impl Into<String>) -> Self {
        Self::with_source(VolumeSource::Local(crate::types::LocalSource {
            path: path.into(),
            fs_type: None,
        }))
    }

    /// A spec with an `nfs` source.
    pub fn nfs(server: impl Into<String>, path: impl Into<String>) -> Self {
        Self::with_source(VolumeSource::Nfs(crate::types::NfsSource {
            server: server.into(),
            path: path.into(),
            read_only: false,
        }))
    }

    /// A spec with any source.
    pub fn with_source(source: VolumeSource) -> Self {
        Self {
            source: Some(source),
            ..Self::default()
        }
    }

    /// Takes capacity, access modes, volume mode, reclaim policy and mount options from the
    /// claim and class, as most provisioners do (and as the host would for unset fields).
    #[must_use]
    pub fn from_request(mut self, request: &ProvisionRequest) -> Self {
        let claim = &request.claim;
        let class = &request.storage_class;
        if claim.requested_bytes > 0 {
            self.capacity = Some(claim.requested_bytes);
        }
        if !claim.access_modes.is_empty() {
            self.access_modes = Some(claim.access_modes.clone());
        }
        self.volume_mode = Some(claim.volume_mode);
        self.reclaim_policy = Some(class.reclaim_policy);
        if !class.mount_options.is_empty() {
            self.mount_options = Some(class.mount_options.clone());
        }
        self
    }

    /// Sets the capacity in bytes.
    #[must_use]
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// Sets the access modes.
    #[must_use]
    pub fn access_modes(mut self, modes: &[AccessMode]) -> Self {
        self.access_modes = Some(modes.to_vec());
        self
    }

    /// Sets the reclaim policy.
    #[must_use]
    pub fn reclaim_policy(mut self, policy: ReclaimPolicy) -> Self {
        self.reclaim_policy = Some(policy);
        self
    }

    /// Sets the mount options.
    #[must_use]
    pub fn mount_options(mut self, options: &[String]) -> Self {
        self.mount_options = Some(options.to_vec());
        self
    }

    /// Adds a node-affinity term requiring node label `key` to be one of `values`.
    #[must_use]
    pub fn node_affinity_in(mut self, key: &str, values: &[&str]) -> Self {
        self.node_affinity.push(NodeSelectorTerm {
            requirements: vec![NodeSelectorRequirement {
                key: key.to_owned(),
                operator: NodeSelectorOperator::In,
                values: values.iter().map(|value| (*value).to_owned()).collect(),
            }],
        });
        self
    }

    /// Asks the host to give the volume's directory `ownership` (see [`Ownership`]).
    #[must_use]
    pub fn ownership(mut self, ownership: Ownership) -> Self {
        self.ownership = ownership;
        self
    }

    /// Adds a label.
    #[must_use]
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }

    /// Adds an annotation.
    #[must_use]
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_owned(), value.to_owned());
        self
    }

    /// The annotations as contract pairs (what the host puts on the PV).
    pub fn annotation_pairs(&self) -> Vec<Pair> {
        self.annotations
            .iter()
            .map(|(key, value)| crate::types::pair(key, value))
            .collect()
    }
}

#[cfg(target_arch = "wasm32")]
impl VolumeSpec {
    /// Replays the spec into the host's grant-checked builder; the first refused setter wins.
    pub(crate) fn build(
        &self,
    ) -> Result<
        crate::bindings::wasm_provisioner::provisioner::volume_builder::VolumeSpec,
        crate::types::SpecError,
    > {
        use crate::bindings::wasm_provisioner::provisioner::volume_builder::VolumeSpec as Resource;
        let built = Resource::new();
        if let Some(bytes) = self.capacity {
            built.capacity(bytes)?;
        }
        if let Some(modes) = &self.access_modes {
            built.access_modes(modes)?;
        }
        if let Some(mode) = self.volume_mode {
            built.volume_mode(mode);
        }
        if let Some(policy) = self.reclaim_policy {
            built.reclaim_policy(policy);
        }
        if let Some(options) = &self.mount_options {
            built.mount_options(options)?;
        }
        if !self.node_affinity.is_empty() {
            built.node_affinity(&self.node_affinity)?;
        }
        for (key, value) in &self.labels {
            built.label(key, value)?;
        }
        for (key, value) in &self.annotations {
            built.annotation(key, value)?;
        }
        if !self.ownership.is_empty() {
            let Ownership { uid, gid, mode } = self.ownership;
            built.ownership(uid, gid, mode)?;
        }
        match &self.source {
            Some(VolumeSource::HostPath(source)) => built.host_path(&source.path, source.kind)?,
            Some(VolumeSource::Local(source)) => {
                built.local(&source.path, source.fs_type.as_deref())?
            }
            Some(VolumeSource::Nfs(source)) => {
                built.nfs(&source.server, &source.path, source.read_only)?
            }
            Some(VolumeSource::Csi(source)) => built.csi(
                &source.driver,
                &source.volume_handle,
                source.fs_type.as_deref(),
                source.read_only,
                &source.attributes,
            )?,
            None => {
                return Err(crate::types::SpecError::Invalid(
                    "the volume has no source: use VolumeSpec::host_path, local, nfs or with_source"
                        .to_owned(),
                ));
            }
        }
        Ok(built)
    }
}
