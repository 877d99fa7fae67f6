//! legacy-block: a guest built against the released 0.1.0 contract (its own frozen `wit/` copy),
//! exporting `block-support` only, not the `capabilities` hook (see README).
//!
//! ```text
//! supports-block ─▶ true          provision / delete ─▶ final error (nothing is built)
//! ```

wit_bindgen::generate!({
    path: "wit",
    inline: "package test:legacy-block;
             world legacy {
                 include wasm-provisioner:provisioner/provisioner@0.1.0;
                 export wasm-provisioner:provisioner/block-support@0.1.0;
             }",
    world: "test:legacy-block/legacy",
    generate_all,
});

use exports::wasm_provisioner::provisioner::{block_support, lifecycle};
use wasm_provisioner::provisioner::types::{DeleteRequest, ProvisionError, ProvisionRequest};
use wasm_provisioner::provisioner::volume_builder::VolumeSpec;

struct Legacy;

impl lifecycle::Guest for Legacy {
    fn provision(_request: ProvisionRequest) -> Result<VolumeSpec, ProvisionError> {
        Err(ProvisionError::Final("legacy-block builds nothing".into()))
    }

    fn delete(_request: DeleteRequest) -> Result<(), ProvisionError> {
        Ok(())
    }
}

impl block_support::Guest for Legacy {
    fn supports_block() -> bool {
        true
    }
}

#[cfg(target_arch = "wasm32")]
export!(Legacy);
