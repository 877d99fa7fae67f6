//! hostpath: a provisioner guest that gives each claim a directory under one granted directory
//! and describes it as a `hostPath` PersistentVolume. Written on the SDK: the example to copy.
//!
//! ```text
//! provision: config + class parameters ─▶ directory (PV name or pathPattern)
//!            ─▶ VolumeSpec, checked against the grants ─▶ mkdir ─▶ spec to host
//!            (which gives the directory the class's uid/gid/mode, if any)
//! clone:     as provision, then the source's directory copied (links as links) into
//!            .<pv>.cloning within clone-timeout-ms ─▶ renamed to <dir>
//! delete:    PV annotations (or hostPath) ─▶ directory ─▶ archive (rename) or remove
//! expand:    PV annotations (or hostPath) ─▶ directory still there ─▶ the request's size
//!            (the host raises the limit where the grant enforces sizes)
//! ```
//!
//! The granted directory is preopened at `guest-dir`; `node-dir` is the same directory as the
//! kubelet sees it. Everything that decides is in the plain modules below; this file only
//! calls the host and the filesystem, and its tests run natively against a temporary directory.

mod config;
mod parameters;

use config::HostpathConfig;
use parameters::ClassParameters;
use std::time::{Duration, Instant};
use wasm_provisioner_sdk::dirs;

use wasm_provisioner_sdk::{
    CloneSource, DeleteRequest, DirVolume, ExpandRequest, Host, ProvisionError, ProvisionRequest,
    Provisioner, VolumeSpec, final_error,
};

/// Prefix of the PV annotations recording the volume's directory (`<prefix>/dir`, relative to
/// the granted directory) and the class's `archiveOnDelete` (`<prefix>/archive-on-delete`).
const PREFIX: &str = "hostpath.wasm-provisioner.dev";
/// PV annotation recording the volume's directory, relative to the granted directory.
pub const DIR_ANNOTATION: &str = "hostpath.wasm-provisioner.dev/dir";

/// Node label the node affinity pins volumes with.
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// The guest.
pub struct Hostpath;

/// The volume a request gets (its directory relative to the granted directory, and the spec
/// the host checked), before anything is created: a spec the grants refuse leaves nothing.
fn describe(
    request: &ProvisionRequest,
    host: &dyn Host,
) -> Result<(HostpathConfig, String, VolumeSpec), ProvisionError> {
    let config = HostpathConfig::parse(&request.config)?;
    let parameters = ClassParameters::parse(&request.storage_class)?;
    let volume = DirVolume::new(
        request,
        parameters.path_pattern.as_deref(),
        parameters.archive_on_delete,
    )?;
    let mut spec = volume
        .host_path(request, &config.node_dir, PREFIX)
        .ownership(parameters.ownership);
    if let Some(node) = request.selected_node().or(config.node_name.as_deref()) {
        spec = spec.node_affinity_in(HOSTNAME_LABEL, &[node]);
    }
    host.check(&spec)?;
    Ok((config, volume.dir, spec))
}

/// The directory `provision` recorded on a volume, relative to the granted directory.
fn recorded_dir(
    volume: &wasm_provisioner_sdk::Volume,
    config: &HostpathConfig,
) -> Result<String, ProvisionError> {
    Ok(DirVolume::recorded(volume, PREFIX, &config.node_dir)?.dir)
}

wasm_provisioner_sdk::export_provisioner!(Hostpath, hooks: [cloning, expansion]);

impl Provisioner for Hostpath {
    fn provision(
        request: &ProvisionRequest,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let (config, dir, spec) = describe(request, host)?;
        dirs::create_empty(&config.guest_path(&dir))?;
        host.info(
            "provisioned hostPath directory",
            &[("pv", &request.pv_name), ("path", &config.node_path(&dir))],
        );
        Ok(spec)
    }

    /// A copy of the source volume's directory, made in `.<pv>.cloning` beside it and renamed
    /// into place when complete: a volume directory that exists is a finished copy (a retry
    /// returns it), and a copy cut short leaves only the staging directory, which the next
    /// attempt and `delete` remove.
    fn provision_clone(
        request: &ProvisionRequest,
        source: &CloneSource,
        host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        let (config, dir, spec) = describe(request, host)?;
        let source_dir = recorded_dir(&source.volume, &config)?;
        let (from, target) = (config.guest_path(&source_dir), config.guest_path(&dir));
        if dirs::present(&config.guest_dir, &target)? {
            return Ok(spec);
        }
        let deadline = Instant::now() + Duration::from_millis(config.clone_timeout_ms);
        let copied = dirs::clone_into(&from, &target, &request.pv_name, deadline)?;
        copied.log(
            host,
            "cloned hostPath directory",
            &[("pv", &request.pv_name), ("source", &source.volume.name)],
        );
        Ok(spec)
    }

    /// A directory holds whatever fits: there is nothing to grow but the limit, which the host
    /// raises (in a grant directory with `sizes`). The directory must still be there.
    fn expand(request: &ExpandRequest, host: &dyn Host) -> Result<u64, ProvisionError> {
        let config = HostpathConfig::parse(&request.config)?;
        let volume = &request.volume;
        let dir = recorded_dir(volume, &config)?;
        if !dirs::present(&config.guest_dir, &config.guest_path(&dir))? {
            return Err(final_error(format!(
                "the directory of {} ({dir}) is gone; there is nothing to grow",
                volume.name
            )));
        }
        let bytes = request.requested_bytes.to_string();
        host.info(
            "growing hostPath volume",
            &[("pv", &volume.name), ("dir", &dir), ("bytes", &bytes)],
        );
        Ok(request.requested_bytes)
    }

    fn delete(request: &DeleteRequest, host: &dyn Host) -> Result<(), ProvisionError> {
        let config = HostpathConfig::parse(&request.config)?;
        let volume = &request.volume;
        DirVolume::recorded(volume, PREFIX, &config.node_dir)?.delete(
            &config.guest_dir,
            volume,
            host,
            "hostPath directory",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use wasm_provisioner_sdk::testing::{self, FakeHost};
    use wasm_provisioner_sdk::{VolumeSource, pair};

    /// A granted directory: a temporary directory seen as both guest-dir and node-dir.
    struct Dir(std::path::PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let path =
                std::env::temp_dir().join(format!("hostpath-test-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).unwrap();
            Dir(path)
        }
        fn config(&self) -> String {
            let p = self.0.display();
            format!(r#"{{"guest-dir": "{p}", "node-dir": "{p}"}}"#)
        }
        fn host(&self) -> FakeHost {
            FakeHost::new().host_paths(&self.0.display().to_string())
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn request(dir: &Dir, params: &[(&str, &str)]) -> ProvisionRequest {
        testing::request(
            testing::claim("team-a", "data"),
            testing::class("hostpath", params),
            &dir.config(),
        )
    }

    #[test]
    fn provisions_the_pv_name_directory_and_deletes_it() {
        let dir = Dir::new("plain");
        let host = dir.host();
        let mut request = request(&dir, &[]);
        request.selected_node = Some("node-1".into());
        let spec = Hostpath::provision(&request, &host).unwrap();
        let path = dir.0.join("pvc-uid-team-a-data");
        assert!(path.is_dir());
        assert_eq!(
            spec.source.as_ref().and_then(VolumeSource::path),
            Some(path.to_str().unwrap())
        );
        assert_eq!(spec.capacity, Some(1 << 30));
        assert_eq!(spec.annotations[DIR_ANNOTATION], "pvc-uid-team-a-data");
        assert_eq!(
            spec.node_affinity[0].requirements[0].values,
            vec!["node-1".to_string()]
        );
        assert_eq!(
            Hostpath::provision(&request, &host).unwrap(),
            spec,
            "idempotent"
        );

        let delete = testing::delete_request(testing::volume(&request, &spec), &dir.config());
        Hostpath::delete(&delete, &host).unwrap();
        assert!(!path.exists());
        Hostpath::delete(&delete, &host).unwrap();
        assert!(
            host.logs().iter().any(|line| line.contains("already gone")),
            "{:?}",
            host.logs()
        );
    }

    #[test]
    fn a_volume_grows_to_the_request_while_its_directory_is_there() {
        let dir = Dir::new("expand");
        let host = dir.host();
        let request = request(&dir, &[]);
        let spec = Hostpath::provision(&request, &host).unwrap();
        let grow = testing::expand_request(
            testing::volume(&request, &spec),
            testing::class("hostpath", &[]),
            2 << 30,
            &dir.config(),
        );
        assert_eq!(Hostpath::expand(&grow, &host).unwrap(), 2 << 30);
        assert!(
            host.logs().iter().any(|line| line.contains("growing")),
            "{:?}",
            host.logs()
        );
        fs::remove_dir(dir.0.join("pvc-uid-team-a-data")).unwrap();
        let error = Hostpath::expand(&grow, &host).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("is gone")),
            "{error:?}"
        );
    }

    #[test]
    fn owner_group_and_mode_go_to_the_host_within_its_grant() {
        let dir = Dir::new("owner");
        let request = request(&dir, &[("uid", "1000"), ("gid", "1000"), ("mode", "0700")]);
        let error = Hostpath::provision(&request, &dir.host()).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("uids")),
            "{error:?}"
        );
        assert_eq!(fs::read_dir(&dir.0).unwrap().count(), 0, "nothing created");
        let granted = dir.host().uids(1000, 1999).gids(1000, 1000);
        let spec = Hostpath::provision(&request, &granted).unwrap();
        assert_eq!(
            spec.ownership,
            wasm_provisioner_sdk::Ownership {
                uid: Some(1000),
                gid: Some(1000),
                mode: Some(0o700)
            }
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_clone_copies_the_source_and_a_cut_short_copy_goes_with_the_volume() {
        let dir = Dir::new("clone");
        let host = dir.host();
        let source_request = request(&dir, &[]);
        let source_spec = Hostpath::provision(&source_request, &host).unwrap();
        let source_path = dir.0.join("pvc-uid-team-a-data");
        fs::create_dir(source_path.join("db")).unwrap();
        fs::write(source_path.join("db/rows"), b"42").unwrap();
        std::os::unix::fs::symlink("db/rows", source_path.join("latest")).unwrap();
        let source = wasm_provisioner_sdk::CloneSource {
            namespace: "team-a".into(),
            name: "data".into(),
            uid: "uid-team-a-data".into(),
            volume: testing::volume(&source_request, &source_spec),
        };
        let clone_request = testing::request(
            testing::claim("team-a", "copy"),
            testing::class("hostpath", &[]),
            &dir.config(),
        );
        let spec = Hostpath::provision_clone(&clone_request, &source, &host).unwrap();
        let clone_path = dir.0.join("pvc-uid-team-a-copy");
        assert_eq!(fs::read(clone_path.join("db/rows")).unwrap(), b"42");
        assert_eq!(
            fs::read_link(clone_path.join("latest")).unwrap(),
            std::path::Path::new("db/rows")
        );
        assert_eq!(
            Hostpath::provision_clone(&clone_request, &source, &host).unwrap(),
            spec,
            "a retry returns the finished copy"
        );

        // A copy cut short (the call ended) leaves only its staging directory; delete takes it.
        fs::rename(&clone_path, dir.0.join(".pvc-uid-team-a-copy.cloning")).unwrap();
        let delete = testing::delete_request(testing::volume(&clone_request, &spec), &dir.config());
        Hostpath::delete(&delete, &host).unwrap();
        assert!(!dir.0.join(".pvc-uid-team-a-copy.cloning").exists());
        assert!(
            source_path.join("db/rows").exists(),
            "the source is untouched"
        );
    }

    /// A clone into a pattern's sub-folder that does not exist yet: its parent is made first.
    #[test]
    fn a_clone_lands_in_a_pattern_sub_folder() {
        let dir = Dir::new("clone-pattern");
        let host = dir.host();
        let source_request = request(&dir, &[]);
        let source_spec = Hostpath::provision(&source_request, &host).unwrap();
        fs::write(dir.0.join("pvc-uid-team-a-data/rows"), b"42").unwrap();
        let source = wasm_provisioner_sdk::CloneSource {
            namespace: "team-a".into(),
            name: "data".into(),
            uid: "uid-team-a-data".into(),
            volume: testing::volume(&source_request, &source_spec),
        };
        let clone_request = testing::request(
            testing::claim("team-b", "copy"),
            testing::class(
                "hostpath",
                &[("pathPattern", "${pvc.namespace}/${pvc.name}")],
            ),
            &dir.config(),
        );
        Hostpath::provision_clone(&clone_request, &source, &host).unwrap();
        assert_eq!(fs::read(dir.0.join("team-b/copy/rows")).unwrap(), b"42");
    }

    #[test]
    fn archives_pattern_directories() {
        let dir = Dir::new("archive");
        let host = dir.host();
        let mut request = request(
            &dir,
            &[
                ("pathPattern", "${pvc.namespace}/${pvc.labels.app}"),
                ("archiveOnDelete", "1"),
            ],
        );
        request.claim.labels.push(pair("app", "db"));
        let spec = Hostpath::provision(&request, &host).unwrap();
        assert!(dir.0.join("team-a/db").is_dir());
        let delete = testing::delete_request(testing::volume(&request, &spec), &dir.config());
        Hostpath::delete(&delete, &host).unwrap();
        assert!(dir.0.join("archived-db").is_dir() && !dir.0.join("team-a/db").exists());
    }

    #[test]
    fn a_refused_spec_or_bad_parameter_creates_nothing() {
        let dir = Dir::new("refused");
        let request = request(&dir, &[]);
        let error =
            Hostpath::provision(&request, &FakeHost::new().host_paths("/elsewhere")).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("not granted")),
            "{error:?}"
        );
        let bad = self::request(&dir, &[("pathPattern", "../${pvc.name}")]);
        let error = Hostpath::provision(&bad, &dir.host()).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("pathPattern")),
            "{error:?}"
        );
        assert_eq!(fs::read_dir(&dir.0).unwrap().count(), 0);
    }
}
