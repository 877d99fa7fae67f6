//! A volume that is one directory under a granted directory (hostpath-style): where it goes
//! (the class's `pathPattern`, or the PV name), what provision records on the PV so that
//! delete needs no StorageClass, and delete from that record (archive or remove).
//!
//! ```text
//! provision: DirVolume::from_class(request, &mut params) ─▶ .record(spec, PREFIX) ─▶ mkdir
//! delete:    DirVolume::recorded(&volume, PREFIX, node_dir) ─▶ .delete(root, ..) ─▶ archive | rm
//! ```

use crate::pattern::{self, PatternValues, check_relative_dir};
use crate::spec::VolumeSpec;
use crate::types::{
    HostPathType, ProvisionError, ProvisionRequest, Volume, VolumeSource, final_error,
};
use crate::{Host, Parameters, dirs, join};

/// The class parameter naming the volume's directory (a [`pattern`]); the PV name without it.
pub const PATH_PATTERN: &str = "pathPattern";
/// The class parameter asking to rename the directory aside instead of removing it.
pub const ARCHIVE_ON_DELETE: &str = "archiveOnDelete";

/// A volume's directory, relative to the directory volumes are kept in, and what to do with
/// it when the volume is deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirVolume {
    /// The directory, relative to the granted directory (checked: it stays inside).
    pub dir: String,
    /// Rename it to `archived-<last component>` on delete instead of removing it.
    pub archive_on_delete: bool,
}

impl DirVolume {
    /// The volume's directory: `path_pattern` expanded for `request`, or else the PV name.
    pub fn new(
        request: &ProvisionRequest,
        path_pattern: Option<&str>,
        archive_on_delete: bool,
    ) -> Result<Self, ProvisionError> {
        let dir = match path_pattern {
            Some(text) => pattern::expand(text, &PatternValues::of(request))?,
            None => {
                check_relative_dir(&request.pv_name).map_err(|why| {
                    final_error(format!("volume name {:?} {why}", request.pv_name))
                })?;
                request.pv_name.clone()
            }
        };
        Ok(Self {
            dir,
            archive_on_delete,
        })
    }

    /// [`DirVolume::new`] from the class parameters `pathPattern` and `archiveOnDelete`
    /// (default false), read from `params` so that its `finish` knows them.
    pub fn from_class(
        request: &ProvisionRequest,
        params: &mut Parameters,
    ) -> Result<Self, ProvisionError> {
        let path_pattern = params.string(PATH_PATTERN);
        let archive_on_delete = params.bool(ARCHIVE_ON_DELETE)?.unwrap_or(false);
        Self::new(request, path_pattern, archive_on_delete)
    }

    /// The `hostPath` volume of this directory under `node_dir` (the granted directory as the
    /// node sees it), filled in from `request` and recorded under `prefix` ([`Self::record`]).
    pub fn host_path(
        &self,
        request: &ProvisionRequest,
        node_dir: &str,
        prefix: &str,
    ) -> VolumeSpec {
        let path = join(node_dir, &self.dir);
        let spec = VolumeSpec::host_path(path, HostPathType::DirectoryOrCreate);
        self.record(spec.from_request(request), prefix)
    }

    /// `spec` with the annotations [`DirVolume::recorded`] reads back: `<prefix>/dir` and
    /// `<prefix>/archive-on-delete`.
    pub fn record(&self, spec: VolumeSpec, prefix: &str) -> VolumeSpec {
        let archive = if self.archive_on_delete {
            "true"
        } else {
            "false"
        };
        spec.annotation(&dir_key(prefix), &self.dir)
            .annotation(&archive_key(prefix), archive)
    }

    /// What provision recorded on `volume`: the `<prefix>/dir` annotation, or else its
    /// `hostPath` below `node_dir` (a volume from before the annotation). Anything that would
    /// leave the granted directory is refused, naming the volume.
    pub fn recorded(volume: &Volume, prefix: &str, node_dir: &str) -> Result<Self, ProvisionError> {
        let archive_on_delete = volume.annotation(&archive_key(prefix)) == Some("true");
        let dir = recorded_dir(volume, &dir_key(prefix), node_dir).map_err(final_error)?;
        Ok(Self {
            dir,
            archive_on_delete,
        })
    }

    /// Deletes the directory of `volume`, under `root` (where volumes are kept, inside the
    /// guest): a clone's leftover staging directory too; archived when recorded so, else
    /// removed with [`dirs::remove_volume`]. Looked for from `root`, which must be there:
    /// "already gone" only when it is. Logs what it did, calling the directory `what`.
    pub fn delete(
        &self,
        root: &str,
        volume: &Volume,
        host: &dyn Host,
        what: &str,
    ) -> Result<(), ProvisionError> {
        let path = join(root, &self.dir);
        let fields = [("pv", volume.name.as_str()), ("dir", self.dir.as_str())];
        // A clone's copy cut short (its call ended before the rename) goes with the volume.
        let staging = dirs::clone_staging(&path, &volume.name);
        if dirs::present(root, &staging)? {
            dirs::remove_volume(root, &staging, &volume.name)?;
        }
        if !dirs::present(root, &path)? {
            host.info(&format!("{what} already gone"), &fields);
        } else if self.archive_on_delete {
            let archive = dirs::rename_to_free_name(&path, root, &archive_base(&self.dir))?;
            host.info(
                &format!("archived {what}"),
                &[fields[0], fields[1], ("archive", &archive)],
            );
        } else {
            dirs::remove_volume(root, &path, &volume.name)?;
            host.info(&format!("deleted {what}"), &fields);
        }
        Ok(())
    }
}

fn dir_key(prefix: &str) -> String {
    format!("{prefix}/dir")
}

fn archive_key(prefix: &str) -> String {
    format!("{prefix}/archive-on-delete")
}

/// The name, directly in the granted directory, to archive `dir` under: `archived-<last
/// component>` ([`dirs::rename_to_free_name`] appends `-1`, `-2`, ... while taken).
pub fn archive_base(dir: &str) -> String {
    format!("archived-{}", dir.rsplit('/').next().unwrap_or(dir))
}

fn recorded_dir(volume: &Volume, key: &str, node_dir: &str) -> Result<String, String> {
    if let Some(dir) = volume.annotation(key) {
        check_relative_dir(dir).map_err(|why| {
            format!(
                "refusing to delete volume {}: annotation {key}={dir:?} {why}",
                volume.name
            )
        })?;
        return Ok(dir.to_owned());
    }
    let VolumeSource::HostPath(source) = &volume.source else {
        return Err(format!(
            "refusing to delete volume {}: it has no {key} annotation and no hostPath source",
            volume.name
        ));
    };
    let dir = relative_to(node_dir, &source.path).ok_or_else(|| {
        format!(
            "refusing to delete volume {}: its hostPath {:?} is not below node-dir {node_dir:?}",
            volume.name, source.path
        )
    })?;
    check_relative_dir(dir).map_err(|why| {
        format!(
            "refusing to delete volume {}: its hostPath {:?} {why} below node-dir",
            volume.name, source.path
        )
    })?;
    Ok(dir.to_owned())
}

/// The part of `path` below `dir`, if it lies strictly below it.
pub fn relative_to<'a>(dir: &str, path: &'a str) -> Option<&'a str> {
    let rest = path.strip_prefix(dir.trim_end_matches('/'))?;
    rest.strip_prefix('/')
        .filter(|relative| !relative.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;
    use crate::types::{HostPathSource, NfsSource, Pair, ReclaimPolicy};

    const PREFIX: &str = "hostpath.wasm-provisioner.dev";
    const DIR: &str = "hostpath.wasm-provisioner.dev/dir";
    const ARCHIVE: &str = "hostpath.wasm-provisioner.dev/archive-on-delete";

    fn volume(source: VolumeSource, annotations: &[(&str, &str)]) -> Volume {
        Volume {
            name: "pvc-1".to_owned(),
            capacity_bytes: 1 << 30,
            source,
            reclaim_policy: ReclaimPolicy::Delete,
            storage_class_name: "hostpath".to_owned(),
            labels: Vec::new(),
            annotations: annotations
                .iter()
                .map(|(key, value)| Pair {
                    key: (*key).to_owned(),
                    value: (*value).to_owned(),
                })
                .collect(),
            node_affinity: Vec::new(),
            claim_namespace: None,
            claim_name: None,
        }
    }

    fn host_path(path: &str) -> VolumeSource {
        VolumeSource::HostPath(HostPathSource {
            path: path.to_owned(),
            kind: HostPathType::DirectoryOrCreate,
        })
    }

    fn dir_of(volume: &Volume) -> Result<String, String> {
        DirVolume::recorded(volume, PREFIX, "/var/lib/hp")
            .map(|recorded| recorded.dir)
            .map_err(|error| match error {
                ProvisionError::Final(message) => message,
                other => format!("{other:?}"),
            })
    }

    #[test]
    fn the_pattern_or_the_pv_name_and_the_archive_flag_come_from_the_class() {
        let class = testing::class("c", &[("pathPattern", "${pvc.namespace}/${pvc.name}")]);
        let request = testing::request(testing::claim("ns", "data"), class, "{}");
        let mut params = Parameters::of(&request.storage_class);
        let volume = DirVolume::from_class(&request, &mut params).unwrap();
        params.finish().unwrap();
        assert_eq!(volume.dir, "ns/data");
        assert!(!volume.archive_on_delete);
        let class = testing::class("c", &[("archiveOnDelete", "1")]);
        let request = testing::request(testing::claim("ns", "data"), class, "{}");
        let volume =
            DirVolume::from_class(&request, &mut Parameters::of(&request.storage_class)).unwrap();
        assert_eq!(volume.dir, "pvc-uid-ns-data");
        assert!(volume.archive_on_delete);
        let spec = volume.host_path(&request, "/var/lib/hp", PREFIX);
        assert_eq!(
            spec.source.as_ref().and_then(VolumeSource::path),
            Some("/var/lib/hp/pvc-uid-ns-data")
        );
        assert_eq!(spec.capacity, Some(1 << 30));
        assert_eq!(spec.annotations[DIR], "pvc-uid-ns-data");
        assert_eq!(spec.annotations[ARCHIVE], "true");
        let read = DirVolume::recorded(&testing::volume(&request, &spec), PREFIX, "/").unwrap();
        assert_eq!(read, volume);
    }

    #[test]
    fn the_annotation_wins_over_the_host_path() {
        let volume = volume(host_path("/var/lib/hp/other"), &[(DIR, "team-a/data")]);
        assert_eq!(dir_of(&volume).unwrap(), "team-a/data");
    }

    #[test]
    fn escaping_annotations_are_refused() {
        for dir in ["..", "../etc", "/etc", "a/../../b", ""] {
            let volume = volume(host_path("/var/lib/hp/pvc-1"), &[(DIR, dir)]);
            let error = dir_of(&volume).unwrap_err();
            assert!(
                error.starts_with("refusing to delete volume pvc-1"),
                "{dir}: {error}"
            );
        }
    }

    #[test]
    fn falls_back_to_the_host_path_below_node_dir() {
        assert_eq!(
            dir_of(&volume(host_path("/var/lib/hp/pvc-1"), &[])).unwrap(),
            "pvc-1"
        );
        for path in [
            "/etc",
            "/var/lib/hp",
            "/var/lib/hp/",
            "/var/lib/hpx/a",
            "/var/lib/hp/../x",
            "/var/lib/hp//x",
        ] {
            assert!(dir_of(&volume(host_path(path), &[])).is_err(), "{path}");
        }
    }

    #[test]
    fn other_sources_without_annotation_are_refused() {
        let nfs = VolumeSource::Nfs(NfsSource {
            server: "s".to_owned(),
            path: "/x".to_owned(),
            read_only: false,
        });
        assert!(
            dir_of(&volume(nfs, &[]))
                .unwrap_err()
                .contains("no hostPath source")
        );
    }

    #[test]
    fn archive_only_when_recorded_true() {
        let archive = |annotations: &[(&str, &str)]| {
            DirVolume::recorded(
                &volume(host_path("/var/lib/hp/x"), annotations),
                PREFIX,
                "/var/lib/hp",
            )
            .unwrap()
            .archive_on_delete
        };
        assert!(archive(&[(ARCHIVE, "true")]));
        assert!(!archive(&[(ARCHIVE, "false")]));
        assert!(!archive(&[]));
    }

    #[test]
    fn archive_names_use_the_last_component() {
        assert_eq!(archive_base("team-a/data"), "archived-data");
        assert_eq!(archive_base("pvc-1"), "archived-pvc-1");
    }

    #[test]
    fn relative_to_only_accepts_paths_strictly_below() {
        assert_eq!(relative_to("/data/hp/", "/data/hp/pvc-1"), Some("pvc-1"));
        assert_eq!(relative_to("/data/hp", "/data/hp/a/b"), Some("a/b"));
        assert_eq!(relative_to("/data/hp", "/data/hp"), None);
        assert_eq!(relative_to("/data/hp", "/data/hp/"), None);
        assert_eq!(relative_to("/data/hp", "/data/hpx/pvc-1"), None);
        assert_eq!(relative_to("/data/hp", "/etc"), None);
    }

    #[test]
    fn deletes_or_archives_and_says_so() {
        let root = std::env::temp_dir().join(format!("sdk-dir-volume-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("ns/a")).unwrap();
        std::fs::create_dir_all(root.join("ns/b")).unwrap();
        let root_text = root.display().to_string();
        let host = testing::FakeHost::new();
        let pv = volume(host_path("/x"), &[]);
        let remove = DirVolume {
            dir: "ns/a".to_owned(),
            archive_on_delete: false,
        };
        remove.delete(&root_text, &pv, &host, "dir").unwrap();
        remove.delete(&root_text, &pv, &host, "dir").unwrap();
        let archive = DirVolume {
            dir: "ns/b".to_owned(),
            archive_on_delete: true,
        };
        archive.delete(&root_text, &pv, &host, "dir").unwrap();
        assert!(!root.join("ns/a").exists() && root.join("archived-b").is_dir());
        assert_eq!(
            host.logs(),
            [
                "LogLevel::Info deleted dir pv=pvc-1 dir=ns/a",
                "LogLevel::Info dir already gone pv=pvc-1 dir=ns/a",
                "LogLevel::Info archived dir pv=pvc-1 dir=ns/b archive=archived-b",
            ]
        );
        std::fs::remove_dir_all(&root).unwrap();
        let error = remove.delete(&root_text, &pv, &host, "dir").unwrap_err();
        assert!(matches!(error, ProvisionError::Final(_)), "{error:?}");
    }
}
