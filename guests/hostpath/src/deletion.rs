//! Finds the directory behind a volume being deleted and where to archive it, from what
//! provision recorded on the PV (so deleting never depends on the StorageClass).

use crate::config::HostpathConfig;
use crate::{ARCHIVE_ANNOTATION, DIR_ANNOTATION};
use wasm_provisioner_sdk::pattern::check_relative_dir;
use wasm_provisioner_sdk::{Volume, VolumeSource};

/// The volume's directory relative to the granted directory: the `dir` annotation, or else its
/// `hostPath` with `node-dir` stripped. Anything that would leave the granted directory is refused.
pub fn directory_to_delete(volume: &Volume, config: &HostpathConfig) -> Result<String, String> {
    if let Some(dir) = volume.annotation(DIR_ANNOTATION) {
        check_relative_dir(dir).map_err(|why| {
            format!(
                "refusing to delete volume {}: annotation {DIR_ANNOTATION}={dir:?} {why}",
                volume.name
            )
        })?;
        return Ok(dir.to_owned());
    }
    let VolumeSource::HostPath(source) = &volume.source else {
        return Err(format!(
            "refusing to delete volume {}: it has no {DIR_ANNOTATION} annotation and no hostPath source",
            volume.name
        ));
    };
    let dir = config.relative_to_node_dir(&source.path).ok_or_else(|| {
        format!(
            "refusing to delete volume {}: its hostPath {:?} is not below node-dir {:?}",
            volume.name, source.path, config.node_dir
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

/// Whether provision recorded `archiveOnDelete: true` on the volume.
pub fn archive_requested(volume: &Volume) -> bool {
    volume.annotation(ARCHIVE_ANNOTATION) == Some("true")
}

/// The name, directly in the granted directory, to archive `dir` under: `archived-<last
/// component>` (the SDK's `dirs::rename_to_free_name` appends `-1`, `-2`, ... while taken).
pub fn archive_base(dir: &str) -> String {
    format!("archived-{}", dir.rsplit('/').next().unwrap_or(dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasm_provisioner_sdk::{HostPathSource, HostPathType, NfsSource, Pair, ReclaimPolicy};

    fn config() -> HostpathConfig {
        HostpathConfig::parse(r#"{"guest-dir": "/volumes", "node-dir": "/var/lib/hp"}"#).unwrap()
    }

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

    #[test]
    fn the_annotation_wins_over_the_host_path() {
        let volume = volume(
            host_path("/var/lib/hp/other"),
            &[(DIR_ANNOTATION, "team-a/data")],
        );
        assert_eq!(
            directory_to_delete(&volume, &config()).unwrap(),
            "team-a/data"
        );
    }

    #[test]
    fn escaping_annotations_are_refused() {
        for dir in ["..", "../etc", "/etc", "a/../../b", ""] {
            let volume = volume(host_path("/var/lib/hp/pvc-1"), &[(DIR_ANNOTATION, dir)]);
            let error = directory_to_delete(&volume, &config()).unwrap_err();
            assert!(
                error.starts_with("refusing to delete volume pvc-1"),
                "{dir}: {error}"
            );
        }
    }

    #[test]
    fn falls_back_to_the_host_path_below_node_dir() {
        assert_eq!(
            directory_to_delete(&volume(host_path("/var/lib/hp/pvc-1"), &[]), &config()).unwrap(),
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
            assert!(
                directory_to_delete(&volume(host_path(path), &[]), &config()).is_err(),
                "{path}"
            );
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
            directory_to_delete(&volume(nfs, &[]), &config())
                .unwrap_err()
                .contains("no hostPath source")
        );
    }

    #[test]
    fn archive_only_when_recorded_true() {
        assert!(archive_requested(&volume(
            host_path("/x"),
            &[(ARCHIVE_ANNOTATION, "true")]
        )));
        assert!(!archive_requested(&volume(
            host_path("/x"),
            &[(ARCHIVE_ANNOTATION, "false")]
        )));
        assert!(!archive_requested(&volume(host_path("/x"), &[])));
    }

    #[test]
    fn archive_names_use_the_last_component() {
        assert_eq!(archive_base("team-a/data"), "archived-data");
        assert_eq!(archive_base("pvc-1"), "archived-pvc-1");
    }
}
