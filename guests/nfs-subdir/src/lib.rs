//! nfs-subdir: one sub-directory of a granted NFS export per claim, exposed as an `nfs`
//! PersistentVolume (kubernetes-sigs/nfs-subdir-external-provisioner as a guest).
//!
//! ```text
//! provision: config + class parameters ─▶ directory (<ns>-<claim>-<pv> or pathPattern)
//!            ─▶ nfs VolumeSpec + annotations (dir, on-delete) ─▶ checked ─▶ mkdir ─▶ host
//! clone:     as provision, then the source's directory (its PV's, in this export) copied
//!            (links as links) into .<pv>.cloning within clone-timeout-ms ─▶ renamed
//! delete:    PV annotations ─▶ retain | remove | rename to archived-<path> ─▶ prune empty parents
//!            (a cut-short clone copy is removed in every case)
//! ```
//!
//! The controller mounts the export and the grant file preopens it at `guest-dir`. Delete uses
//! only what provision recorded on the PV, so it works after the StorageClass is gone, and it
//! finds directories that a sub-folder `pathPattern` created (the original's #272/#347).

mod plan;

use std::fs;
use std::time::{Duration, Instant};

use plan::{ClassSettings, NfsConfig, OnDelete};
use wasm_provisioner_sdk::{
    CloneSource, DeleteRequest, Host, ProvisionError, ProvisionRequest, Provisioner, VolumeSpec,
    dirs, final_error,
};

pub use plan::{DIR_ANNOTATION, ON_DELETE_ANNOTATION};

/// The guest.
pub struct NfsSubdir;

wasm_provisioner_sdk::export_provisioner!(NfsSubdir, hooks: [cloning]);

/// The volume a request gets (its directory relative to the export, and the spec the host
/// checked), before anything is created: a spec the grants refuse leaves nothing.
fn describe(
    request: &ProvisionRequest,
    host: &dyn Host,
) -> Result<(NfsConfig, String, VolumeSpec), ProvisionError> {
    let config = NfsConfig::parse(&request.config)?;
    let settings = ClassSettings::parse(&request.storage_class)?;
    if request.claim.has_selector {
        return Err(final_error("claim.Spec.Selector is not supported"));
    }
    let dir = plan::directory(request, &settings)?;
    let spec = VolumeSpec::nfs(&config.server, config.server_path(&dir))
        .from_request(request)
        .annotation(DIR_ANNOTATION, &dir)
        .annotation(ON_DELETE_ANNOTATION, settings.on_delete.as_str());
    host.check(&spec)?;
    Ok((config, dir, spec))
}

impl Provisioner for NfsSubdir {
    fn provision(
        request: &ProvisionRequest,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let (config, dir, spec) = describe(request, host)?;
        dirs::create_empty(&config.guest_path(&dir))?;
        host.info(
            "provisioned NFS directory",
            &[("pv", &request.pv_name), ("dir", &dir)],
        );
        Ok(spec)
    }

    /// A copy of the source volume's directory, made in a staging directory next to the new
    /// one and renamed into place when complete: a volume directory that exists is a finished
    /// copy (a retry returns it), and a copy cut short leaves only the staging directory, which
    /// the next attempt and `delete` remove.
    fn provision_clone(
        request: &ProvisionRequest,
        source: &CloneSource,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let (config, dir, spec) = describe(request, host)?;
        let source_dir = plan::clone_source(&source.volume, &config).map_err(final_error)?;
        let (from, target) = (config.guest_path(&source_dir), config.guest_path(&dir));
        if dirs::present(&config.guest_dir, &target)? {
            return Ok(spec);
        }
        if !dirs::present(&config.guest_dir, &from)? {
            return Err(final_error(format!(
                "the source volume {}'s directory {source_dir} is not in the export",
                source.volume.name
            )));
        }
        let deadline = Instant::now() + Duration::from_millis(config.clone_timeout_ms);
        let copied = dirs::clone_into(&from, &target, &request.pv_name, deadline)
            .inspect_err(|_| prune_parents(&config, &dir))?;
        copied.log(
            host,
            "cloned NFS directory",
            &[
                ("pv", &request.pv_name),
                ("dir", &dir),
                ("source", &source.volume.name),
            ],
        );
        Ok(spec)
    }

    fn delete(request: &DeleteRequest, host: &dyn Host) -> Result<(), ProvisionError> {
        let config = NfsConfig::parse(&request.config)?;
        let volume = &request.volume;
        let (dir, action) =
            plan::deletion(volume, &config, request.storage_class.as_ref()).map_err(final_error)?;
        let guest_path = config.guest_path(&dir);
        let fields = [("pv", volume.name.as_str()), ("dir", dir.as_str())];
        // A clone's copy cut short (its call ended before the rename) goes with the volume,
        // whatever happens to the volume's directory.
        let staging = dirs::clone_staging(&guest_path, &volume.name);
        let cut_short = dirs::present(&config.guest_dir, &staging)?;
        if cut_short {
            dirs::remove_in(&config.guest_dir, &staging)?;
            host.info("deleted a cut-short clone copy", &fields);
        }
        // Looked for from the export, which must be mounted there: "gone" only when it is.
        if !dirs::present(&config.guest_dir, &guest_path)? {
            host.warn("NFS directory already gone", &fields);
            if cut_short {
                prune_parents(&config, &dir);
            }
            return Ok(());
        }
        match action {
            OnDelete::Retain => {
                host.info("retained NFS directory", &fields);
                return Ok(());
            }
            OnDelete::Delete => {
                dirs::remove_in(&config.guest_dir, &guest_path)?;
                host.info("deleted NFS directory", &fields);
            }
            OnDelete::Archive => {
                let archive = dirs::rename_to_free_name(
                    &guest_path,
                    &config.guest_dir,
                    &plan::archive_base(&dir),
                )?;
                host.info(
                    "archived NFS directory",
                    &[fields[0], fields[1], ("archive", &archive)],
                );
            }
        }
        prune_parents(&config, &dir);
        Ok(())
    }
}

/// Parents a sub-folder pattern created go too once empty; a parent still in use (another
/// claim's directory) is not empty and stays.
fn prune_parents(config: &NfsConfig, dir: &str) {
    for parent in plan::parents(dir) {
        if fs::remove_dir(config.guest_path(parent)).is_err() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use wasm_provisioner_sdk::testing::{self, FakeHost};
    use wasm_provisioner_sdk::{VolumeSource, pair};

    struct Export(PathBuf);

    impl Export {
        fn new(name: &str) -> Export {
            let path =
                std::env::temp_dir().join(format!("nfs-subdir-test-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).unwrap();
            Export(path)
        }
        fn config(&self) -> String {
            format!(
                r#"{{"server": "nfs.example.com", "export-path": "/srv/k8s", "guest-dir": "{}"}}"#,
                self.0.display()
            )
        }
        fn has(&self, dir: &str) -> bool {
            self.0.join(dir).is_dir()
        }
    }

    impl Drop for Export {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn host() -> FakeHost {
        FakeHost::new().nfs_server("nfs.example.com")
    }

    /// Provisions claim `ns/name` with `params`, then deletes it with no StorageClass.
    fn round_trip(export: &Export, params: &[(&str, &str)]) -> (ProvisionRequest, VolumeSpec) {
        let mut request = testing::request(
            testing::claim("ns", "data"),
            testing::class("nfs", params),
            &export.config(),
        );
        request.claim.labels.push(pair("app", "db"));
        request.storage_class.mount_options = vec!["nfsvers=4.1".into()];
        let spec = NfsSubdir::provision(&request, &host()).unwrap();
        (request, spec)
    }

    fn delete(export: &Export, request: &ProvisionRequest, spec: &VolumeSpec) {
        let delete = testing::delete_request(testing::volume(request, spec), &export.config());
        NfsSubdir::delete(&delete, &host()).unwrap();
    }

    #[test]
    fn default_directory_nfs_source_mount_options_and_archive() {
        let export = Export::new("default");
        let (request, spec) = round_trip(&export, &[]);
        let dir = "ns-data-pvc-uid-ns-data";
        assert!(export.has(dir));
        match &spec.source {
            Some(VolumeSource::Nfs(nfs)) => {
                assert_eq!(
                    (nfs.server.as_str(), nfs.path.as_str()),
                    ("nfs.example.com", "/srv/k8s/ns-data-pvc-uid-ns-data")
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(spec.mount_options, Some(vec!["nfsvers=4.1".to_string()]));
        assert_eq!(
            NfsSubdir::provision(&request, &host()).unwrap(),
            spec,
            "idempotent"
        );
        delete(&export, &request, &spec);
        assert!(!export.has(dir) && export.has(&format!("archived-{dir}")));
    }

    #[test]
    fn sub_folder_patterns_archive_and_prune_empty_parents() {
        let export = Export::new("subfolders");
        let (request, spec) = round_trip(
            &export,
            &[("pathPattern", "${.PVC.namespace}/${pvc.labels.app}/data")],
        );
        assert!(export.has("ns/db/data"));
        fs::write(export.0.join("ns/db/data/file"), b"keep me").unwrap();
        delete(&export, &request, &spec);
        assert!(
            Path::new(&export.0.join("archived-ns-db-data/file")).is_file(),
            "the data is archived, not left behind"
        );
        assert!(!export.has("ns"), "empty parents pruned");
    }

    #[test]
    fn on_delete_delete_and_retain() {
        let export = Export::new("ondelete");
        let (request, spec) = round_trip(
            &export,
            &[("onDelete", "retain"), ("archiveOnDelete", "false")],
        );
        delete(&export, &request, &spec);
        assert!(export.has("ns-data-pvc-uid-ns-data"), "retained");
        fs::remove_dir_all(export.0.join("ns-data-pvc-uid-ns-data")).unwrap();
        let (request, spec) = round_trip(&export, &[("onDelete", "delete")]);
        delete(&export, &request, &spec);
        assert_eq!(
            fs::read_dir(&export.0).unwrap().count(),
            0,
            "removed, nothing archived"
        );
        delete(&export, &request, &spec);
    }

    /// Claim `ns/name` of a class with `params`, cloning the volume `source` describes.
    #[cfg(unix)]
    fn clone_of(
        export: &Export,
        name: &str,
        params: &[(&str, &str)],
        source: (&ProvisionRequest, &VolumeSpec),
    ) -> (ProvisionRequest, CloneSource) {
        let mut request = testing::request(
            testing::claim("ns", name),
            testing::class("nfs", params),
            &export.config(),
        );
        request.claim.has_data_source = true;
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
    #[test]
    fn a_clone_copies_the_source_and_a_cut_short_copy_goes_with_the_volume() {
        let export = Export::new("clone");
        let (source_request, source_spec) = round_trip(&export, &[]);
        let source_dir = export.0.join("ns-data-pvc-uid-ns-data");
        fs::create_dir(source_dir.join("db")).unwrap();
        fs::write(source_dir.join("db/rows"), b"42").unwrap();
        std::os::unix::fs::symlink("db/rows", source_dir.join("latest")).unwrap();

        let (clone_request, source) =
            clone_of(&export, "copy", &[], (&source_request, &source_spec));
        let spec = NfsSubdir::provision_clone(&clone_request, &source, &host()).unwrap();
        let clone_dir = export.0.join("ns-copy-pvc-uid-ns-copy");
        assert_eq!(fs::read(clone_dir.join("db/rows")).unwrap(), b"42");
        assert_eq!(
            fs::read_link(clone_dir.join("latest")).unwrap(),
            Path::new("db/rows")
        );
        assert!(
            matches!(&spec.source, Some(VolumeSource::Nfs(nfs)) if nfs.path == "/srv/k8s/ns-copy-pvc-uid-ns-copy")
        );
        assert_eq!(
            NfsSubdir::provision_clone(&clone_request, &source, &host()).unwrap(),
            spec,
            "a retry returns the finished copy"
        );

        // A clone of a clone of a clone, into sub-folders a pattern makes.
        let mut from = (clone_request.clone(), spec.clone());
        for name in ["copy-2", "copy-3"] {
            let params = [("pathPattern", "${pvc.namespace}/${pvc.name}")];
            let (request, source) = clone_of(&export, name, &params, (&from.0, &from.1));
            let spec = NfsSubdir::provision_clone(&request, &source, &host()).unwrap();
            from = (request, spec);
        }
        assert_eq!(fs::read(export.0.join("ns/copy-3/db/rows")).unwrap(), b"42");
        assert_eq!(
            fs::read_link(export.0.join("ns/copy-3/latest")).unwrap(),
            Path::new("db/rows")
        );

        // A copy cut short (the call ended) leaves only its staging directory; delete takes it
        // (and the parent the pattern made, left empty).
        let staging = export.0.join("ns/.pvc-uid-ns-copy-3.cloning");
        fs::rename(export.0.join("ns/copy-3"), &staging).unwrap();
        fs::remove_dir_all(export.0.join("ns/copy-2")).unwrap();
        delete(&export, &from.0, &from.1);
        assert!(!staging.exists() && !export.has("ns"), "nothing left");

        // A leftover staging directory is cleared by the next attempt, which copies again.
        let staging = export.0.join(".pvc-uid-ns-copy.cloning");
        fs::remove_dir_all(&clone_dir).unwrap();
        fs::create_dir_all(staging.join("half")).unwrap();
        NfsSubdir::provision_clone(&clone_request, &source, &host()).unwrap();
        assert!(!staging.exists() && !clone_dir.join("half").exists());
        assert_eq!(fs::read(clone_dir.join("db/rows")).unwrap(), b"42");
        assert!(
            source_dir.join("db/rows").exists(),
            "the source is untouched"
        );
    }

    #[test]
    fn selectors_and_ungranted_servers_are_refused_before_anything_is_created() {
        let export = Export::new("refused");
        let mut request = testing::request(
            testing::claim("ns", "c"),
            testing::class("nfs", &[]),
            &export.config(),
        );
        let error = NfsSubdir::provision(&request, &FakeHost::new()).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("NFS server")),
            "{error:?}"
        );
        request.claim.has_selector = true;
        let error = NfsSubdir::provision(&request, &host()).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("Selector")),
            "{error:?}"
        );
        assert_eq!(fs::read_dir(&export.0).unwrap().count(), 0);
    }
}
