//! local-path: a directory per claim under the selected node's configured path, exposed as a
//! `hostPath` or `local` PersistentVolume pinned to that node (rancher's local-path-provisioner
//! as a guest, without helper pods).
//!
//! ```text
//! provision: config (node-path-map / shared path, per class) + parameters + selected node
//!            ─▶ plan (node, path) ─▶ VolumeSpec with node affinity ─▶ checked ─▶ mkdir ─▶ host
//! delete:    PV (path, node annotation) ─▶ node directory gone? done : remove the directory
//! hooks:     with `local-node` set (one instance per node), only that node's claims and volumes
//! ```
//!
//! The guest reaches node `N`'s path `P` through its granted directory at `{nodes-dir}/N/P`
//! (a shared filesystem path at `{nodes-dir}/_shared/P`); README.md says how to mount them.

mod config;
mod plan;

use std::fs;

use config::LocalPathConfig;
use plan::VolumeType;
use wasm_provisioner_sdk::{
    Claim, DeleteRequest, Host, HostPathType, ProvisionError, ProvisionRequest, Provisioner,
    StorageClass, Volume, VolumeSpec, dirs, final_error,
};

pub use plan::{NODE_ANNOTATION, SHARED_ANNOTATION};

/// The guest.
pub struct LocalPath;

wasm_provisioner_sdk::export_provisioner!(LocalPath, hooks: [qualifier, deletion_guard]);

impl Provisioner for LocalPath {
    fn provision(
        request: &ProvisionRequest,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let config = LocalPathConfig::parse(&request.config)?;
        let plan = plan::plan(request, &config, |path| fs::symlink_metadata(path).is_ok())?;
        let mut spec = match plan.settings.volume_type {
            VolumeType::HostPath => {
                VolumeSpec::host_path(&plan.path, HostPathType::DirectoryOrCreate)
            }
            VolumeType::Local => VolumeSpec::local(&plan.path),
        }
        .from_request(request)
        .ownership(plan.settings.ownership);
        spec = match &plan.node {
            Some(node) => spec
                .node_affinity_in(&plan.settings.node_affinity_key, &[node])
                .annotation(NODE_ANNOTATION, node),
            None => spec.annotation(SHARED_ANNOTATION, "true"),
        };
        host.check(&spec)?;
        dirs::create_empty(&config.guest_path(plan.node.as_deref(), &plan.path))?;
        let node = plan.node.as_deref().unwrap_or("(shared)");
        host.info(
            "provisioned local path",
            &[
                ("pv", &request.pv_name),
                ("node", node),
                ("path", &plan.path),
            ],
        );
        Ok(spec)
    }

    fn delete(request: &DeleteRequest, host: &dyn Host) -> Result<(), ProvisionError> {
        let config = LocalPathConfig::parse(&request.config)?;
        let volume = &request.volume;
        let target = plan::deletion(volume).map_err(final_error)?;
        let node = target.node.as_deref().unwrap_or("(shared)");
        let fields = [
            ("pv", volume.name.as_str()),
            ("node", node),
            ("path", target.path.as_str()),
        ];
        // Looked for in the directory holding it, which must be there: a node's directory that
        // is not mounted here is an error (VolumeFailedDelete, the PV kept), never "gone". A
        // node that no longer exists is the controller's to handle (`--node-deployment`
        // deletes its PVs without cleanup after `--node-gone-grace`), not a guess of ours.
        let guest_path = config.guest_path(target.node.as_deref(), &target.path);
        if dirs::remove(&guest_path)? {
            host.info("deleted local path", &fields);
        } else {
            host.info("local path already gone", &fields);
        }
        Ok(())
    }

    fn should_provision(claim: &Claim, _class: &StorageClass, config: &str) -> bool {
        plan::serves_claim(claim, config)
    }

    fn should_delete(volume: &Volume, config: &str) -> bool {
        plan::serves_volume(volume, config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use wasm_provisioner_sdk::testing::{self, FakeHost};
    use wasm_provisioner_sdk::{NodeSelectorOperator, VolumeSource};

    struct Nodes(PathBuf);

    impl Nodes {
        fn new(name: &str) -> Nodes {
            let path =
                std::env::temp_dir().join(format!("local-path-test-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).unwrap();
            Nodes(path)
        }
        fn config(&self) -> String {
            format!(
                r#"{{"nodes-dir": "{}", "node-path-map": [{{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["/opt/lp"]}}]}}"#,
                self.0.display()
            )
        }
    }

    impl Drop for Nodes {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn request(nodes: &Nodes, params: &[(&str, &str)]) -> ProvisionRequest {
        let mut request = testing::request(
            testing::claim("ns", "data"),
            testing::class("local", params),
            &nodes.config(),
        );
        request.selected_node = Some("node-a".into());
        request
    }

    #[test]
    fn local_volume_with_node_affinity_created_on_the_node_and_deleted() {
        let nodes = Nodes::new("local");
        let host = FakeHost::new().local_paths("/opt/lp");
        let request = request(
            &nodes,
            &[
                ("volumeType", "local"),
                ("nodeAffinityKey", "example.com/node"),
            ],
        );
        let spec = LocalPath::provision(&request, &host).unwrap();
        let dir = nodes.0.join("node-a/opt/lp/pvc-uid-ns-data_ns_data");
        assert!(dir.is_dir(), "created under the node's directory");
        assert!(
            matches!(&spec.source, Some(VolumeSource::Local(l)) if l.path == "/opt/lp/pvc-uid-ns-data_ns_data")
        );
        let requirement = &spec.node_affinity[0].requirements[0];
        assert_eq!(
            (requirement.key.as_str(), requirement.values.as_slice()),
            ("example.com/node", &["node-a".to_string()][..])
        );
        assert!(matches!(requirement.operator, NodeSelectorOperator::In));
        assert_eq!(
            LocalPath::provision(&request, &host).unwrap(),
            spec,
            "idempotent"
        );

        let delete = testing::delete_request(testing::volume(&request, &spec), &nodes.config());
        LocalPath::delete(&delete, &host).unwrap();
        assert!(!dir.exists());
        LocalPath::delete(&delete, &host).unwrap();
    }

    /// Issue 32: a node's directory that is not there (unmounted, moved) was "deleted without
    /// cleanup" (Ok); the storage may be on the node still, so it is an error now.
    #[test]
    fn a_volume_whose_node_directory_is_missing_is_an_error_not_gone() {
        let nodes = Nodes::new("gone");
        let host = FakeHost::new().host_paths("/opt/lp");
        let request = request(&nodes, &[]);
        let spec = LocalPath::provision(&request, &host).unwrap();
        fs::remove_dir_all(nodes.0.join("node-a")).unwrap();
        let delete = testing::delete_request(testing::volume(&request, &spec), &nodes.config());
        let error = LocalPath::delete(&delete, &host).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("not taken for gone")),
            "{error:?}"
        );
    }

    #[test]
    fn a_refused_spec_creates_nothing() {
        let nodes = Nodes::new("refused");
        let error = LocalPath::provision(&request(&nodes, &[]), &FakeHost::new()).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("not granted")),
            "{error:?}"
        );
        assert_eq!(fs::read_dir(&nodes.0).unwrap().count(), 0);
    }
}
