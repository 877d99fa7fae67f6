//! contract-v2: a trivial guest built against `wasm-provisioner:provisioner@0.2.0` (its own
//! `wit/` copy, with an extra `provision-request.attempt` field), a contract version the host
//! does not serve. Loading it must fail with a message naming the version; it never runs.

wit_bindgen::generate!({
    path: "wit",
    world: "provisioner",
});

use exports::wasm_provisioner::provisioner::lifecycle::Guest;
use wasm_provisioner::provisioner::types::{
    DeleteRequest, HostPathType, ProvisionError, ProvisionRequest,
};
use wasm_provisioner::provisioner::volume_builder::VolumeSpec;

struct ContractV2;

impl Guest for ContractV2 {
    fn provision(request: ProvisionRequest) -> Result<VolumeSpec, ProvisionError> {
        let spec = VolumeSpec::new();
        let path = format!(
            "/var/lib/wasm-provisioner/contract-v2/{}-{}",
            request.pv_name, request.attempt
        );
        spec.host_path(&path, HostPathType::DirectoryOrCreate)
            .map_err(|error| ProvisionError::Final(format!("{error:?}")))?;
        Ok(spec)
    }

    fn delete(_request: DeleteRequest) -> Result<(), ProvisionError> {
        Ok(())
    }
}

// Exported only from WebAssembly: the export names (`wasm-provisioner:provisioner/...`) are not
// valid symbol names for a native cdylib, which `cargo test` also links.
#[cfg(target_arch = "wasm32")]
export!(ContractV2);
