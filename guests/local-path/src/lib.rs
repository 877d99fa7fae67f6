//! local-path: a directory per claim under the selected node's configured path, exposed as a
//! `hostPath` or `local` PersistentVolume pinned to that node (rancher's local-path-provisioner
//! as a guest, without helper pods).
//!
//! ```text
//! provision: config (node-path-map / shared path, per class) + parameters + selected node
//!            ─▶ plan (node, path) ─▶ VolumeSpec with node affinity ─▶ checked ─▶ mkdir ─▶ host
//! clone:     as provision, on the source's node (or shared path) ─▶ the source's directory
//!            copied (links as links) into .<pv>.cloning within clone-timeout-ms ─▶ renamed
//! delete:    PV (path, node annotation) ─▶ node directory gone? done : remove the directory
//!            (and a cut-short clone copy)
//! expand:    PV (path, node annotation) ─▶ the directory still there ─▶ the request's size
//!            (the host raises the limit where the grant enforces sizes)
//! hooks:     with `local-node` set (one instance per node), only that node's claims and volumes
//! ```
//!
//! The guest reaches node `N`'s path `P` through its granted directory at `{nodes-dir}/N/P`
//! (a shared filesystem path at `{nodes-dir}/_shared/P`); README.md says how to mount them.

mod config;
mod plan;

use std::fs;
use std::time::{Duration, Instant};

use config::LocalPathConfig;
use plan::{ClonePlan, Plan, VolumeType};
use wasm_provisioner_sdk::{
    Claim, CloneSource, DeleteRequest, ExpandRequest, Host, HostPathType, ProvisionError,
    ProvisionRequest, Provisioner, StorageClass, Volume, VolumeSpec, dirs, final_error,
};

pub use plan::{NODE_ANNOTATION, SHARED_ANNOTATION};

/// The guest.
pub struct LocalPath;

wasm_provisioner_sdk::export_provisioner!(LocalPath, hooks: [qualifier, deletion_guard, cloning, expansion]);

/// The volume a plan describes, checked by the host before anything is created.
fn describe(
    request: &ProvisionRequest,
    plan: &Plan,
    host: &dyn Host,
) -> Result<VolumeSpec, ProvisionError> {
    let mut spec = match plan.settings.volume_type {
        VolumeType::HostPath => VolumeSpec::host_path(&plan.path, HostPathType::DirectoryOrCreate),
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
    Ok(spec)
}

fn exists(path: &str) -> bool {
    fs::symlink_metadata(path).is_ok()
}

impl Provisioner for LocalPath {
    fn provision(
        request: &ProvisionRequest,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let config = LocalPathConfig::parse(&request.config)?;
        let plan = plan::plan(request, &config, exists)?;
        let spec = describe(request, &plan, host)?;
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

    /// A copy of the source volume's directory on the source's node (or the shared path),
    /// made in a staging directory next to the clone's and renamed into place when complete:
    /// a clone directory that exists is a finished copy (a retry returns it), and a copy cut
    /// short leaves only the staging directory, which the next attempt and `delete` remove.
    fn provision_clone(
        request: &ProvisionRequest,
        source: &CloneSource,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let config = LocalPathConfig::parse(&request.config)?;
        let ClonePlan { plan, source: from } =
            plan::plan_clone(request, &source.volume, &config, exists)?;
        let spec = describe(request, &plan, host)?;
        let target = config.guest_path(plan.node.as_deref(), &plan.path);
        if dirs::exists(&target)? {
            return Ok(spec);
        }
        let from_path = config.guest_path(from.node.as_deref(), &from.path);
        if !dirs::exists(&from_path)? {
            return Err(final_error(format!(
                "the source volume {}'s directory {} is not there",
                source.volume.name, from.path
            )));
        }
        let deadline = Instant::now() + Duration::from_millis(config.clone_timeout_ms);
        let copied = dirs::clone_into(&from_path, &target, &request.pv_name, deadline)?;
        copied.log(
            host,
            "cloned local path",
            &[
                ("pv", &request.pv_name),
                ("source", &source.volume.name),
                ("node", plan.node.as_deref().unwrap_or("(shared)")),
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
        let parent = dirs::parent_of(&guest_path).unwrap_or("/");
        // A clone's copy cut short (its call ended before the rename) goes with the volume.
        let staging = dirs::clone_staging(&guest_path, &volume.name);
        if dirs::remove_volume(parent, &staging, &volume.name)? {
            host.info("deleted a cut-short clone copy", &fields);
        }
        if dirs::remove_volume(parent, &guest_path, &volume.name)? {
            host.info("deleted local path", &fields);
        } else {
            host.info("local path already gone", &fields);
        }
        Ok(())
    }

    /// Nothing to grow but the limit, which the host raises (in a grant directory with
    /// `sizes`); the directory must still be there. Another node's volume (with `local-node`
    /// set) is not this instance's to answer for.
    fn expand(request: &ExpandRequest, host: &dyn Host) -> Result<u64, ProvisionError> {
        let volume = &request.volume;
        if !plan::serves_volume(volume, &request.config) {
            return Err(ProvisionError::Ignored(format!(
                "{} is another node's volume",
                volume.name
            )));
        }
        let config = LocalPathConfig::parse(&request.config)?;
        let target = plan::deletion(volume).map_err(final_error)?;
        let guest_path = config.guest_path(target.node.as_deref(), &target.path);
        let parent = dirs::parent_of(&guest_path).unwrap_or("/");
        if !dirs::present(parent, &guest_path)? {
            return Err(final_error(format!(
                "the directory of {} ({}) is gone; there is nothing to grow",
                volume.name, target.path
            )));
        }
        let bytes = request.requested_bytes.to_string();
        host.info(
            "growing local path",
            &[
                ("pv", &volume.name),
                ("path", &target.path),
                ("bytes", &bytes),
            ],
        );
        Ok(request.requested_bytes)
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

        let grow = testing::expand_request(
            testing::volume(&request, &spec),
            testing::class("local", &[]),
            5 << 30,
            &nodes.config(),
        );
        assert_eq!(LocalPath::expand(&grow, &host).unwrap(), 5 << 30);

        let delete = testing::delete_request(testing::volume(&request, &spec), &nodes.config());
        LocalPath::delete(&delete, &host).unwrap();
        assert!(!dir.exists());
        LocalPath::delete(&delete, &host).unwrap();
        let error = LocalPath::expand(&grow, &host).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("is gone")),
            "{error:?}"
        );
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

    /// The claim `ns/name` cloning `source`, the PV the host found for it.
    fn clone_of(
        nodes: &Nodes,
        name: &str,
        selected: Option<&str>,
        source: (&ProvisionRequest, &VolumeSpec),
    ) -> (ProvisionRequest, CloneSource) {
        let mut request = testing::request(
            testing::claim("ns", name),
            testing::class("local", &[]),
            &nodes.config(),
        );
        request.claim.has_data_source = true;
        request.selected_node = selected.map(str::to_owned);
        let (source_request, source_spec) = source;
        let clone_source = CloneSource {
            namespace: "ns".into(),
            name: source_request.claim.name.clone(),
            uid: source_request.claim.uid.clone(),
            volume: testing::volume(source_request, source_spec),
        };
        (request, clone_source)
    }

    #[cfg(unix)]
    fn node_affinity(spec: &VolumeSpec) -> Vec<(String, Vec<String>)> {
        spec.node_affinity
            .iter()
            .flat_map(|term| &term.requirements)
            .map(|req| (req.key.clone(), req.values.clone()))
            .collect()
    }

    #[cfg(unix)]
    #[test]
    fn a_clone_copies_the_source_on_its_node_and_a_cut_short_copy_goes_with_the_volume() {
        let nodes = Nodes::new("clone");
        let host = FakeHost::new().host_paths("/opt/lp");
        let source_request = request(&nodes, &[]);
        let source_spec = LocalPath::provision(&source_request, &host).unwrap();
        let source_dir = nodes.0.join("node-a/opt/lp/pvc-uid-ns-data_ns_data");
        fs::create_dir(source_dir.join("db")).unwrap();
        fs::write(source_dir.join("db/rows"), b"42").unwrap();
        std::os::unix::fs::symlink("db/rows", source_dir.join("latest")).unwrap();

        // Immediate binding (no selected node): the clone goes to the source's node.
        let (clone_request, source) =
            clone_of(&nodes, "copy", None, (&source_request, &source_spec));
        let spec = LocalPath::provision_clone(&clone_request, &source, &host).unwrap();
        let clone_dir = nodes.0.join("node-a/opt/lp/pvc-uid-ns-copy_ns_copy");
        assert_eq!(fs::read(clone_dir.join("db/rows")).unwrap(), b"42");
        assert_eq!(
            fs::read_link(clone_dir.join("latest")).unwrap(),
            std::path::Path::new("db/rows")
        );
        assert_eq!(
            node_affinity(&spec),
            vec![("kubernetes.io/hostname".into(), vec!["node-a".into()])],
            "the clone's pod lands where the data is"
        );
        assert_eq!(spec.annotations[NODE_ANNOTATION], "node-a");
        assert!(
            matches!(&spec.source, Some(VolumeSource::HostPath(h)) if h.path == "/opt/lp/pvc-uid-ns-copy_ns_copy")
        );
        assert!(
            host.logs().iter().any(|l| l.contains("cloned local path")),
            "{:?}",
            host.logs()
        );
        assert_eq!(
            LocalPath::provision_clone(&clone_request, &source, &host).unwrap(),
            spec,
            "a retry returns the finished copy"
        );

        // A clone of a clone of a clone, the scheduler agreeing on the node.
        let mut from = (clone_request.clone(), spec.clone());
        for name in ["copy-2", "copy-3"] {
            let (request, source) = clone_of(&nodes, name, Some("node-a"), (&from.0, &from.1));
            let spec = LocalPath::provision_clone(&request, &source, &host).unwrap();
            from = (request, spec);
        }
        let third = nodes.0.join("node-a/opt/lp/pvc-uid-ns-copy-3_ns_copy-3");
        assert_eq!(fs::read(third.join("db/rows")).unwrap(), b"42");
        assert_eq!(
            fs::read_link(third.join("latest")).unwrap(),
            std::path::Path::new("db/rows")
        );
        assert_eq!(node_affinity(&from.1), node_affinity(&spec));

        // A copy cut short (the call ended) leaves only its staging directory; delete takes it.
        let staging = nodes.0.join("node-a/opt/lp/.pvc-uid-ns-copy.cloning");
        fs::rename(&clone_dir, &staging).unwrap();
        let delete =
            testing::delete_request(testing::volume(&clone_request, &spec), &nodes.config());
        LocalPath::delete(&delete, &host).unwrap();
        assert!(!staging.exists() && !clone_dir.exists());
        assert!(
            source_dir.join("db/rows").exists(),
            "the source is untouched"
        );

        // A leftover staging directory is cleared by the next attempt, which copies again.
        fs::create_dir_all(staging.join("half")).unwrap();
        LocalPath::provision_clone(&clone_request, &source, &host).unwrap();
        assert!(!staging.exists() && !clone_dir.join("half").exists());
        assert_eq!(fs::read(clone_dir.join("db/rows")).unwrap(), b"42");
    }

    #[test]
    fn a_clone_scheduled_to_another_node_is_refused_and_creates_nothing() {
        let nodes = Nodes::new("clone-elsewhere");
        let host = FakeHost::new().host_paths("/opt/lp");
        let source_request = request(&nodes, &[]);
        let source_spec = LocalPath::provision(&source_request, &host).unwrap();
        let (clone_request, source) = clone_of(
            &nodes,
            "copy",
            Some("node-b"),
            (&source_request, &source_spec),
        );
        let error = LocalPath::provision_clone(&clone_request, &source, &host).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains(
                "the clone must be on node node-a, where its source lies, but the scheduler selected node node-b"
            )),
            "{error:?}"
        );
        let entries = |dir: PathBuf| fs::read_dir(dir).unwrap().count();
        assert_eq!(entries(nodes.0.clone()), 1, "no node-b directory");
        assert_eq!(entries(nodes.0.join("node-a/opt/lp")), 1, "only the source");
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
