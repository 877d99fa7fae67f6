//! hostpath: a provisioner guest that gives each claim a directory under one granted directory
//! and describes it as a `hostPath` PersistentVolume.
//!
//! ```text
//! provision: config + class parameters ─▶ directory (PV name or pathPattern)
//!            ─▶ PV spec via the host's volume-builder (grant-checked) ─▶ mkdir ─▶ spec to host
//! delete:    PV annotations (or hostPath) ─▶ directory ─▶ archive (rename) or remove
//! ```
//!
//! The granted directory is preopened at `guest-dir`; `node-dir` is the same directory as the
//! kubelet sees it. Everything that decides is in the plain modules below; this file only calls
//! the host and the filesystem.

mod config;
mod deletion;
mod parameters;
mod path_pattern;

use std::fs;
use std::io::ErrorKind;

wit_bindgen::generate!({
    path: "../../wit",
    world: "provisioner",
});

use config::HostpathConfig;
use exports::wasm_provisioner::provisioner::lifecycle::Guest;
use parameters::ClassParameters;
use path_pattern::PatternValues;
use wasm_provisioner::provisioner::host;
use wasm_provisioner::provisioner::types::{
    DeleteRequest, HostPathType, LogLevel, NodeSelectorOperator, NodeSelectorRequirement,
    NodeSelectorTerm, Pair, ProvisionError, ProvisionRequest, SpecError,
};
use wasm_provisioner::provisioner::volume_builder::VolumeSpec;

/// PV annotation recording the volume's directory, relative to the granted directory.
pub const DIR_ANNOTATION: &str = "hostpath.wasm-provisioner.dev/dir";
/// PV annotation recording the class's `archiveOnDelete` (`"true"` or `"false"`).
pub const ARCHIVE_ANNOTATION: &str = "hostpath.wasm-provisioner.dev/archive-on-delete";

/// Node label the node affinity pins volumes with.
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

struct Hostpath;

impl Guest for Hostpath {
    fn provision(request: ProvisionRequest) -> Result<VolumeSpec, ProvisionError> {
        provision(&request).map_err(ProvisionError::Final)
    }

    fn delete(request: DeleteRequest) -> Result<(), ProvisionError> {
        delete(&request).map_err(ProvisionError::Final)
    }
}

// Exported only from WebAssembly: the export names (`wasm-provisioner:provisioner/...`) are not
// valid symbol names for a native cdylib, which `cargo test` also links.
#[cfg(target_arch = "wasm32")]
export!(Hostpath);

fn provision(request: &ProvisionRequest) -> Result<VolumeSpec, String> {
    let config = HostpathConfig::parse(&request.config)?;
    let parameters = ClassParameters::parse(&request.storage_class.parameters)?;
    let dir = match &parameters.path_pattern {
        Some(pattern) => path_pattern::expand(pattern, &PatternValues::of(request))?,
        None => {
            path_pattern::check_relative_dir(&request.pv_name)
                .map_err(|why| format!("volume name {:?} {why}", request.pv_name))?;
            request.pv_name.clone()
        }
    };
    let node_path = config.node_path(&dir);
    // Describe first: a spec the grants refuse must not leave a directory behind.
    let spec = describe_volume(request, &config, &parameters, &dir, &node_path)
        .map_err(spec_error_message)?;
    let guest_path = config.guest_path(&dir);
    fs::create_dir_all(&guest_path)
        .map_err(|error| format!("creating directory {guest_path}: {error}"))?;
    host::log(
        LogLevel::Info,
        "provisioned hostPath directory",
        &[pair("pv", &request.pv_name), pair("path", &node_path)],
    );
    Ok(spec)
}

fn describe_volume(
    request: &ProvisionRequest,
    config: &HostpathConfig,
    parameters: &ClassParameters,
    dir: &str,
    node_path: &str,
) -> Result<VolumeSpec, SpecError> {
    let claim = &request.claim;
    let class = &request.storage_class;
    let spec = VolumeSpec::new();
    if claim.requested_bytes > 0 {
        spec.capacity(claim.requested_bytes)?;
    }
    if !claim.access_modes.is_empty() {
        spec.access_modes(&claim.access_modes)?;
    }
    spec.reclaim_policy(class.reclaim_policy);
    if !class.mount_options.is_empty() {
        spec.mount_options(&class.mount_options)?;
    }
    spec.host_path(node_path, HostPathType::DirectoryOrCreate)?;
    let selected_node = request
        .selected_node
        .as_deref()
        .filter(|node| !node.is_empty());
    if let Some(node) = selected_node.or(config.node_name.as_deref()) {
        spec.node_affinity(&[hostname_is(node)])?;
    }
    spec.annotation(DIR_ANNOTATION, dir)?;
    spec.annotation(
        ARCHIVE_ANNOTATION,
        if parameters.archive_on_delete {
            "true"
        } else {
            "false"
        },
    )?;
    Ok(spec)
}

fn hostname_is(node: &str) -> NodeSelectorTerm {
    NodeSelectorTerm {
        requirements: vec![NodeSelectorRequirement {
            key: HOSTNAME_LABEL.to_owned(),
            operator: NodeSelectorOperator::In,
            values: vec![node.to_owned()],
        }],
    }
}

fn delete(request: &DeleteRequest) -> Result<(), String> {
    let config = HostpathConfig::parse(&request.config)?;
    let volume = &request.volume;
    let dir = deletion::directory_to_delete(volume, &config)?;
    let guest_path = config.guest_path(&dir);
    match fs::symlink_metadata(&guest_path) {
        Err(error) if error.kind() == ErrorKind::NotFound => {
            host::log(
                LogLevel::Info,
                "hostPath directory already gone",
                &[pair("pv", &volume.name), pair("dir", &dir)],
            );
            return Ok(());
        }
        Err(error) => return Err(format!("inspecting {guest_path}: {error}")),
        Ok(_) => {}
    }
    if deletion::archive_requested(volume) {
        let archive = deletion::archive_name(&dir, |name| {
            fs::symlink_metadata(config.guest_path(name)).is_ok()
        });
        let archive_path = config.guest_path(&archive);
        fs::rename(&guest_path, &archive_path)
            .map_err(|error| format!("archiving {guest_path} as {archive_path}: {error}"))?;
        host::log(
            LogLevel::Info,
            "archived hostPath directory",
            &[
                pair("pv", &volume.name),
                pair("dir", &dir),
                pair("archive", &archive),
            ],
        );
    } else {
        match fs::remove_dir_all(&guest_path) {
            Err(error) if error.kind() != ErrorKind::NotFound => {
                return Err(format!("removing {guest_path}: {error}"));
            }
            _ => {}
        }
        host::log(
            LogLevel::Info,
            "deleted hostPath directory",
            &[pair("pv", &volume.name), pair("dir", &dir)],
        );
    }
    Ok(())
}

fn spec_error_message(error: SpecError) -> String {
    match error {
        SpecError::NotGranted(message) => format!("volume spec not granted: {message}"),
        SpecError::Invalid(message) => format!("volume spec invalid: {message}"),
    }
}

fn pair(key: &str, value: &str) -> Pair {
    Pair {
        key: key.to_owned(),
        value: value.to_owned(),
    }
}
