//! {{project-name}}: a directory per claim under one granted directory, as a hostPath volume.

use wasm_provisioner_sdk::{
    DeleteRequest, DirVolume, Host, HostPathType, Parameters, ProvisionError, ProvisionRequest,
    Provisioner, VolumeSpec, dirs, join,
};

// What the grant file must give this guest: the `wasm-provisioner:needs` section of the
// .wasm, from which the host writes a starter grant and which the shipped grant must match.
wasm_provisioner_sdk::needs! {
    provisioner: "example.com/{{project-name}}",
    dirs: [VOLUMES = { guest: "/volumes", access: "read-write", why: "a directory per claim" }],
    kinds: ["host-path"],
    config: [
        GUEST_DIR = { key: "guest-dir", required: false, default: "/volumes", example: "/volumes",
                      why: "where the granted directory is seen inside the guest (dirs.guest)" },
        NODE_DIR = { key: "node-dir", required: true, example: "/var/lib/{{project-name}}",
                     why: "the same directory as the node sees it: what goes into the PV" },
    ],
    owners: false,
    limits: { memory-mib: 64, call-timeout-ms: 10000 },
}

/// Prefix of the PV annotations recording the directory: delete reads it there, because the
/// StorageClass may be gone by then.
pub const RECORDED: &str = "{{project-name}}.example.com";

/// The guest.
pub struct Guest;

wasm_provisioner_sdk::export_provisioner!(Guest);

/// The granted directory as the guest sees it and as the node does, from the grant's config.
fn granted_dir(config: &str) -> Result<(String, String), ProvisionError> {
    let config = NEEDS.config(config)?;
    Ok((config.get(GUEST_DIR)?, config.get(NODE_DIR)?))
}

impl Provisioner for Guest {
    fn provision(
        request: &ProvisionRequest,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let (guest_dir, node_dir) = granted_dir(&request.config)?;
        Parameters::of(&request.storage_class).finish()?; // no parameters: a typo is an error
        let volume = DirVolume::new(request, None, false)?; // the PV name
        let path = join(&node_dir, &volume.dir);
        let spec = VolumeSpec::host_path(path, HostPathType::DirectoryOrCreate);
        let spec = volume.record(spec.from_request(request), RECORDED);
        host.check(&spec)?; // refused by the grants: nothing created
        dirs::create_empty(&join(&guest_dir, &volume.dir))?;
        host.info("created", &[("dir", &volume.dir)]);
        Ok(spec)
    }

    fn delete(request: &DeleteRequest, host: &dyn Host) -> Result<(), ProvisionError> {
        let (guest_dir, node_dir) = granted_dir(&request.config)?;
        let volume = DirVolume::recorded(&request.volume, RECORDED, &node_dir)?;
        volume.delete(&guest_dir, &request.volume, host, "directory")
    }
}
