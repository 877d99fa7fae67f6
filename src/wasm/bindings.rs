//! The one `bindgen!` of the host: Rust types and traits generated from `wit/`, and the host
//! type behind the contract's one resource.

use std::collections::BTreeMap;

use self::types::{AccessMode, NodeSelectorTerm, ReclaimPolicy, VolumeMode, VolumeSource};

wasmtime::component::bindgen!({
    path: "wit",
    world: "provisioner-full",
    imports: {
        // Runs on the blocking pool, where the call's deadline can end the wait.
        "wasm-provisioner:provisioner/host.copy-tree": async | trappable,
        "wasm-provisioner:provisioner/host.destroy-volume": async | trappable,
        default: trappable,
    },
    exports: { default: async },
    additional_derives: [PartialEq],
    with: {
        "wasm-provisioner:provisioner/volume-builder.volume-spec": VolumeSpecBuilder,
    },
});

pub use self::exports::wasm_provisioner::provisioner::{
    block_support, cloning, deletion_guard, expansion, lifecycle, qualifier,
};
pub use self::wasm_provisioner::provisioner::{host, types, volume_builder};

/// The WIT package this host serves, as guests name it in their imports and exports.
pub const PACKAGE: &str = "wasm-provisioner:provisioner";
/// The package version this host serves; any `0.1.x` guest links (wasmtime matches `0.y` on the minor).
pub const PACKAGE_VERSION: &str = "0.1.3";

/// A PV under construction, as a guest built it through the host API (the `volume-spec`
/// resource). Defined beside the bindings because the generated code names it and it holds
/// generated types; its setters, each checked against the grants, and `finish` are in
/// `spec.rs`, the only module that writes these fields.
#[derive(Debug, Default, Clone)]
pub struct VolumeSpecBuilder {
    pub(super) capacity: Option<u64>,
    pub(super) access_modes: Option<Vec<AccessMode>>,
    pub(super) volume_mode: Option<VolumeMode>,
    pub(super) reclaim_policy: Option<ReclaimPolicy>,
    pub(super) mount_options: Option<Vec<String>>,
    pub(super) node_affinity: Vec<NodeSelectorTerm>,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) annotations: BTreeMap<String, String>,
    pub(super) source: Option<VolumeSource>,
    pub(super) ownership: super::ownership::Ownership,
    /// Setter calls the host refused, and the first refusal: a spec returned after a refusal is
    /// not what the guest meant to build, so it is rejected as a whole.
    pub(super) refusals: usize,
    pub(super) first_refusal: Option<String>,
}
