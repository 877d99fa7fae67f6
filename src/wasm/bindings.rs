//! The one `bindgen!` of the host: Rust types and traits generated from `wit/`.

wasmtime::component::bindgen!({
    path: "wit",
    world: "provisioner-full",
    imports: { default: trappable },
    exports: { default: async },
    additional_derives: [PartialEq],
    with: {
        "wasm-provisioner:provisioner/volume-builder.volume-spec": super::spec::VolumeSpecBuilder,
    },
});

pub use self::exports::wasm_provisioner::provisioner::{
    block_support, deletion_guard, lifecycle, qualifier,
};
pub use self::wasm_provisioner::provisioner::{host, types, volume_builder};

/// The WIT package this host serves, as guests name it in their imports and exports.
pub const PACKAGE: &str = "wasm-provisioner:provisioner";
/// The package version this host serves; any `0.1.x` guest links (wasmtime matches `0.y` on the minor).
pub const PACKAGE_VERSION: &str = "0.1.0";
