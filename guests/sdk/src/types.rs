//! The contract's records, re-exported from the generated bindings, with the lookups every
//! guest would otherwise write (labels, annotations, parameters, paths, affinity values).

pub use crate::bindings::wasm_provisioner::provisioner::types::{
    AccessMode, BindingMode, Claim, CsiSource, DeleteRequest, HostPathSource, HostPathType,
    LocalSource, LogLevel, NfsSource, NodeSelectorOperator, NodeSelectorRequirement,
    NodeSelectorTerm, Pair, ProvisionError, ProvisionRequest, ReclaimPolicy, SpecError,
    StorageClass, TopologyRequirement, TopologyTerm, Volume, VolumeMode, VolumeSource,
};

/// The claim a clone copies, as the host hands it to [`crate::Provisioner::provision_clone`].
pub use crate::bindings::hooks::cloning::exports::wasm_provisioner::provisioner::cloning::CloneSource;

/// What the host hands to [`crate::Provisioner::expand`]: the volume, the new request, its class.
pub use crate::bindings::hooks::expansion::exports::wasm_provisioner::provisioner::expansion::ExpandRequest;

/// The value of `key` in a list of pairs (labels, annotations, parameters).
pub fn lookup<'a>(pairs: &'a [Pair], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|pair| pair.key == key)
        .map(|pair| pair.value.as_str())
}

/// A pair from two strings.
pub fn pair(key: &str, value: &str) -> Pair {
    Pair {
        key: key.to_owned(),
        value: value.to_owned(),
    }
}

impl Claim {
    /// The value of a label of the claim.
    pub fn label(&self, key: &str) -> Option<&str> {
        lookup(&self.labels, key)
    }

    /// The value of an annotation of the claim.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        lookup(&self.annotations, key)
    }

    /// Whether every requested access mode is one of `allowed` (true for no modes).
    pub fn access_modes_within(&self, allowed: &[AccessMode]) -> bool {
        self.access_modes.iter().all(|mode| allowed.contains(mode))
    }
}

impl StorageClass {
    /// The value of a class parameter (prefer [`crate::Parameters`] to parse them all).
    pub fn parameter(&self, key: &str) -> Option<&str> {
        lookup(&self.parameters, key)
    }
}

impl ProvisionRequest {
    /// The node the scheduler selected, if any (an empty name counts as none).
    pub fn selected_node(&self) -> Option<&str> {
        self.selected_node
            .as_deref()
            .filter(|node| !node.is_empty())
    }
}

impl Volume {
    /// The value of an annotation of the volume: what provision recorded for delete.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        lookup(&self.annotations, key)
    }

    /// The values the volume's node affinity requires for `key` (`In` requirements).
    pub fn node_affinity_values(&self, key: &str) -> Vec<&str> {
        self.node_affinity
            .iter()
            .flat_map(|term| &term.requirements)
            .filter(|req| req.key == key && matches!(req.operator, NodeSelectorOperator::In))
            .flat_map(|req| req.values.iter().map(String::as_str))
            .collect()
    }
}

impl VolumeSource {
    /// The path of a `hostPath`, `local` or `nfs` source.
    pub fn path(&self) -> Option<&str> {
        match self {
            VolumeSource::HostPath(source) => Some(&source.path),
            VolumeSource::Local(source) => Some(&source.path),
            VolumeSource::Nfs(source) => Some(&source.path),
            VolumeSource::Csi(_) => None,
        }
    }
}

/// A human-readable message for a spec error.
pub fn spec_error_message(error: &SpecError) -> String {
    match error {
        SpecError::NotGranted(message) => format!("volume spec not granted: {message}"),
        SpecError::Invalid(message) => format!("volume spec invalid: {message}"),
    }
}

/// `final`: the permanent-failure case, for `map_err(final_error)` on anything displayable.
pub fn final_error(message: impl std::fmt::Display) -> ProvisionError {
    ProvisionError::Final(message.to_string())
}

impl From<SpecError> for ProvisionError {
    fn from(error: SpecError) -> Self {
        ProvisionError::Final(spec_error_message(&error))
    }
}
