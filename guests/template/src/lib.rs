//! {{project-name}}: a directory per claim under one granted directory, as a hostPath volume.

use wasm_provisioner_sdk::{
    DeleteRequest, DirVolume, Host, Parameters, ProvisionError, ProvisionRequest, Provisioner,
    VolumeSpec, dirs, join,
};

// What the grant file must give this guest, written into the .wasm (its
// `wasm-provisioner:needs` section): the host makes a starter grant from it.
wasm_provisioner_sdk::needs! {
    provisioner: "example.com/{{project-name}}",
    dirs: [VOLUMES = { guest: "/volumes", access: "read-write", why: "a directory per claim" }],
    kinds: ["host-path"],
    config: [NODE_DIR = { key: "node-dir", required: true, example: "/var/lib/{{project-name}}",
                          why: "the granted directory as the node sees it: what goes into the PV" }],
    owners: false,
    limits: { memory-mib: 64, call-timeout-ms: 10000 },
}

/// Prefix of the PV annotations recording the directory: delete reads it there, because the
/// StorageClass may be gone by then.
pub const RECORDED: &str = "{{project-name}}.example.com";

/// The guest.
pub struct Guest;

wasm_provisioner_sdk::export_provisioner!(Guest);

impl Provisioner for Guest {
    fn provision(
        request: &ProvisionRequest,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let node_dir: String = NEEDS.config(&request.config)?.get(NODE_DIR)?;
        Parameters::of(&request.storage_class).finish()?; // no parameters: a typo is an error
        let volume = DirVolume::new(request, None, false)?; // the PV's name, removed on delete
        let spec = volume.host_path(request, &node_dir, RECORDED);
        host.check(&spec)?; // refused by the grants: nothing created
        dirs::create_empty(&join(&host.dir(VOLUMES), &volume.dir))?;
        host.info("created", &[("dir", &volume.dir)]);
        Ok(spec)
    }

    fn delete(request: &DeleteRequest, host: &dyn Host) -> Result<(), ProvisionError> {
        let node_dir: String = NEEDS.config(&request.config)?.get(NODE_DIR)?;
        let volume = DirVolume::recorded(&request.volume, RECORDED, &node_dir)?;
        volume.delete(&host.dir(VOLUMES), &request.volume, host, "directory")
    }
}
