//! nfs-subdir: one sub-directory of a granted NFS export per claim, exposed as an `nfs`
//! PersistentVolume (kubernetes-sigs/nfs-subdir-external-provisioner as a guest).
//!
//! ```text
//! provision: config + class parameters ─▶ directory (<ns>-<claim>-<pv> or pathPattern)
//!            ─▶ nfs VolumeSpec + annotations (dir, on-delete) ─▶ checked ─▶ mkdir ─▶ host
//! delete:    PV annotations ─▶ retain | remove | rename to archived-<path> ─▶ prune empty parents
//! ```
//!
//! The controller mounts the export and the grant file preopens it at `guest-dir`. Delete uses
//! only what provision recorded on the PV, so it works after the StorageClass is gone, and it
//! finds directories that a sub-folder `pathPattern` created (the original's #272/#347).

mod plan;

use std::fs;

use plan::{ClassSettings, NfsConfig, OnDelete};
use wasm_provisioner_sdk::{
    DeleteRequest, Host, ProvisionError, ProvisionRequest, Provisioner, VolumeSpec, dirs,
    final_error,
};

pub use plan::{DIR_ANNOTATION, ON_DELETE_ANNOTATION};

/// The guest.
pub struct NfsSubdir;

wasm_provisioner_sdk::export_provisioner!(NfsSubdir);

impl Provisioner for NfsSubdir {
    fn provision(
        request: &ProvisionRequest,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
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
        dirs::create_empty(&config.guest_path(&dir))?;
        host.info(
            "provisioned NFS directory",
            &[("pv", &request.pv_name), ("dir", &dir)],
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
        // Looked for from the export, which must be mounted there: "gone" only when it is.
        if !dirs::present(&config.guest_dir, &guest_path)? {
            host.warn("NFS directory already gone", &fields);
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
        // Parents a sub-folder pattern created go too once empty; a parent still in use (another
        // claim's directory) is not empty and stays.
        for parent in plan::parents(&dir) {
            if fs::remove_dir(config.guest_path(parent)).is_err() {
                break;
            }
        }
        Ok(())
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
