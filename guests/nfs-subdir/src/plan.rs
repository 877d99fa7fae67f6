//! Pure decisions of nfs-subdir: configuration, class parameters, a volume's directory, what
//! delete does, and archive names. No filesystem, no host: unit-tested natively.

use serde::Deserialize;
use wasm_provisioner_sdk::pattern::{self, PatternError, PatternValues};
use wasm_provisioner_sdk::{
    ConfigError, ParameterError, Parameters, ProvisionRequest, StorageClass, Volume, VolumeSource,
    join, parse_config, require_absolute,
};

/// PV annotation: the volume's directory relative to the export.
pub const DIR_ANNOTATION: &str = "nfs-subdir.wasm-provisioner.dev/dir";
/// PV annotation: what delete does (`delete`, `retain` or `archive`), fixed at provision time.
pub const ON_DELETE_ANNOTATION: &str = "nfs-subdir.wasm-provisioner.dev/on-delete";

wasm_provisioner_sdk::needs! {
    provisioner: "wasm-provisioner.dev/nfs-subdir",
    dirs: [EXPORT = { guest: "/export", access: "read-write",
                      why: "the NFS export mounted in the controller: one sub-directory per volume" }],
    kinds: ["nfs"],
    config: [
        SERVER = { key: "server", required: true, example: "nfs.example.com",
                   why: "the NFS server, as the kubelet mounts it (nfs-servers)" },
        EXPORT_PATH = { key: "export-path", required: true, example: "/srv/nfs/k8s",
                        why: "the exported path on the server (nfs-exports)" },
        GUEST_DIR = { key: "guest-dir", required: true, example: "/export",
                      why: "where the export is preopened inside the guest (dirs.guest)" },
        CLONE_TIMEOUT_MS = { key: "clone-timeout-ms", required: false,
                             why: "how long a clone may copy, in ms (default 8000): keep it below call-timeout-ms" },
    ],
    owners: false,
    limits: { memory-mib: 64, call-timeout-ms: 30000 },
}

/// The `[config]` of the grant file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct NfsConfig {
    /// NFS server, as the kubelet mounts it.
    pub server: String,
    /// The exported path on the server.
    pub export_path: String,
    /// Where the export is preopened inside the guest.
    pub guest_dir: String,
    /// How long a clone may copy before it gives up (and removes its partial copy), in ms:
    /// keep it below the grant's `call-timeout-ms`, so the guest stops itself and cleans up
    /// before the host's deadline ends the call. Default 8000.
    #[serde(default = "default_clone_timeout_ms")]
    pub clone_timeout_ms: u64,
}

fn default_clone_timeout_ms() -> u64 {
    8000
}

impl NfsConfig {
    /// Parses and checks the configuration JSON.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let config: Self = parse_config(json)?;
        if config.server.is_empty() {
            return Err(ConfigError("server must not be empty".to_owned()));
        }
        require_absolute("export-path", &config.export_path)?;
        require_absolute("guest-dir", &config.guest_dir)?;
        Ok(config)
    }

    /// The path of `dir` inside the guest.
    pub fn guest_path(&self, dir: &str) -> String {
        join(&self.guest_dir, dir)
    }

    /// The path of `dir` on the NFS server.
    pub fn server_path(&self, dir: &str) -> String {
        join(&self.export_path, dir)
    }
}

/// What happens to a volume's directory when the volume is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDelete {
    /// Remove it.
    Delete,
    /// Keep it where it is.
    Retain,
    /// Rename it to `archived-...` at the export root.
    Archive,
}

impl OnDelete {
    /// The annotation value.
    pub fn as_str(self) -> &'static str {
        match self {
            OnDelete::Delete => "delete",
            OnDelete::Retain => "retain",
            OnDelete::Archive => "archive",
        }
    }

    fn from_annotation(value: &str) -> Option<Self> {
        [OnDelete::Delete, OnDelete::Retain, OnDelete::Archive]
            .into_iter()
            .find(|choice| choice.as_str() == value)
    }
}

/// The class parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassSettings {
    /// `pathPattern`.
    pub path_pattern: Option<String>,
    /// `onDelete` if set (wins), else `archiveOnDelete` (archive unless "false", as the original).
    pub on_delete: OnDelete,
}

impl ClassSettings {
    /// Parses the class parameters; unknown ones are refused.
    pub fn parse(class: &StorageClass) -> Result<Self, ParameterError> {
        let mut params = Parameters::of(class);
        let path_pattern = params.string("pathPattern").map(str::to_owned);
        let on_delete = params.one_of("onDelete", &["delete", "retain"])?;
        let archive = params.bool("archiveOnDelete")?;
        params.finish()?;
        let on_delete = match (on_delete, archive) {
            (Some("delete"), _) => OnDelete::Delete,
            (Some(_), _) => OnDelete::Retain,
            (None, Some(false)) => OnDelete::Delete,
            (None, _) => OnDelete::Archive,
        };
        Ok(Self {
            path_pattern,
            on_delete,
        })
    }
}

/// The volume's directory relative to the export: the expanded `pathPattern` (the original's
/// `${.PVC.namespace}` spelling is accepted too), or `<namespace>-<claim>-<pv>`.
pub fn directory(
    request: &ProvisionRequest,
    settings: &ClassSettings,
) -> Result<String, PatternError> {
    match &settings.path_pattern {
        Some(text) => pattern::expand(
            &text.replace("${.PVC.", "${pvc."),
            &PatternValues::of(request),
        ),
        None => {
            let claim = &request.claim;
            let dir = format!("{}-{}-{}", claim.namespace, claim.name, request.pv_name);
            pattern::check_relative_dir(&dir)
                .map_err(|why| PatternError(format!("directory {dir:?} {why}")))?;
            Ok(dir)
        }
    }
}

/// What delete does with a volume: its directory and the action, from the PV's annotations.
/// PVs without them (made by the original provisioner) fall back to the NFS path below the
/// export and to the class, if it still exists, else to archiving (the original's default).
pub fn deletion(
    volume: &Volume,
    config: &NfsConfig,
    class: Option<&StorageClass>,
) -> Result<(String, OnDelete), String> {
    let refuse = |why: String| format!("refusing to delete volume {}: {why}", volume.name);
    let dir = volume_directory(volume, config).map_err(refuse)?;
    let action = match volume.annotation(ON_DELETE_ANNOTATION) {
        Some(value) => OnDelete::from_annotation(value).ok_or_else(|| {
            refuse(format!(
                "annotation {ON_DELETE_ANNOTATION}={value:?} is not delete, retain or archive"
            ))
        })?,
        None => match class {
            Some(class) => {
                ClassSettings::parse(class)
                    .map_err(|error| refuse(error.to_string()))?
                    .on_delete
            }
            None => OnDelete::Archive,
        },
    };
    Ok((dir, action))
}

/// The directory a clone copies: the source volume's, found as delete finds it, and only if
/// the source's `nfs` server and path are that directory in this export (so the copy is the
/// data the source's pods see, not a namesake in another export).
pub fn clone_source(volume: &Volume, config: &NfsConfig) -> Result<String, String> {
    let refuse = |why: String| format!("cannot clone volume {}: {why}", volume.name);
    let dir = volume_directory(volume, config).map_err(refuse)?;
    let VolumeSource::Nfs(source) = &volume.source else {
        return Err(refuse("it has no nfs source".to_owned()));
    };
    let expected = config.server_path(&dir);
    if source.server != config.server || source.path != expected {
        return Err(refuse(format!(
            "its nfs source {}:{} is not {}:{expected}, its directory in this guest's export",
            source.server, source.path, config.server
        )));
    }
    Ok(dir)
}

/// The volume's directory relative to the export: the `dir` annotation, else its NFS path
/// below `export-path`; the reason when neither gives a safe relative directory.
fn volume_directory(volume: &Volume, config: &NfsConfig) -> Result<String, String> {
    let dir = match volume.annotation(DIR_ANNOTATION) {
        Some(dir) => dir.to_owned(),
        None => {
            let VolumeSource::Nfs(source) = &volume.source else {
                return Err(format!(
                    "it has no {DIR_ANNOTATION} annotation and no nfs source"
                ));
            };
            source
                .path
                .strip_prefix(config.export_path.trim_end_matches('/'))
                .and_then(|rest| rest.strip_prefix('/'))
                .map(str::to_owned)
                .ok_or_else(|| {
                    format!(
                        "its path {:?} is not below export-path {:?}",
                        source.path, config.export_path
                    )
                })?
        }
    };
    pattern::check_relative_dir(&dir).map_err(|why| format!("its directory {dir:?} {why}"))?;
    Ok(dir)
}

/// The archive name at the export root for `dir`: `archived-` and the whole relative path with
/// `/` as `-` (so `ns/a/data` and `ns/b/data` do not collide); numbered by the SDK if taken.
pub fn archive_base(dir: &str) -> String {
    format!("archived-{}", dir.replace('/', "-"))
}

/// The parent directories a pattern created for `dir`, deepest first (`a/b/c` → `a/b`, `a`):
/// removed after the volume's directory if they are empty.
pub fn parents(dir: &str) -> Vec<&str> {
    let mut parents = Vec::new();
    let mut rest = dir;
    while let Some((parent, _)) = rest.rsplit_once('/') {
        parents.push(parent);
        rest = parent;
    }
    parents
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_declared_needs_are_the_config_and_the_shipped_grant() {
        assert_eq!(
            wasm_provisioner_sdk::needs::serde_fields::<NfsConfig>(),
            NEEDS.config_keys()
        );
        wasm_provisioner_sdk::testing::assert_grant_matches(
            &NEEDS,
            include_str!("../nfs-subdir.toml"),
        );
    }
    use wasm_provisioner_sdk::testing::{claim, class, request};
    use wasm_provisioner_sdk::{NfsSource, ReclaimPolicy, pair};

    const CONFIG: &str =
        r#"{"server": "nfs.example.com", "export-path": "/srv/k8s", "guest-dir": "/export"}"#;

    fn settings(params: &[(&str, &str)]) -> ClassSettings {
        ClassSettings::parse(&class("nfs", params)).unwrap()
    }

    #[test]
    fn on_delete_wins_over_archive_on_delete_and_archive_is_the_default() {
        assert_eq!(settings(&[]).on_delete, OnDelete::Archive);
        assert_eq!(
            settings(&[("archiveOnDelete", "false")]).on_delete,
            OnDelete::Delete
        );
        assert_eq!(
            settings(&[("archiveOnDelete", "true")]).on_delete,
            OnDelete::Archive
        );
        assert_eq!(
            settings(&[("onDelete", "retain"), ("archiveOnDelete", "false")]).on_delete,
            OnDelete::Retain
        );
        assert_eq!(
            settings(&[("onDelete", "delete"), ("archiveOnDelete", "true")]).on_delete,
            OnDelete::Delete
        );
        let error = ClassSettings::parse(&class("nfs", &[("onDelete", "archive")])).unwrap_err();
        assert_eq!(
            error.to_string(),
            "parameter onDelete: expected one of delete, retain, got archive"
        );
    }

    #[test]
    fn directories_default_to_namespace_claim_pv_and_follow_both_pattern_spellings() {
        let mut req = request(claim("team-a", "data"), class("nfs", &[]), CONFIG);
        assert_eq!(
            directory(&req, &settings(&[])).unwrap(),
            "team-a-data-pvc-uid-team-a-data"
        );
        req.claim.labels.push(pair("app", "db"));
        let s = settings(&[("pathPattern", "${.PVC.namespace}/${pvc.labels.app}")]);
        assert_eq!(directory(&req, &s).unwrap(), "team-a/db");
        let missing = settings(&[("pathPattern", "${.PVC.annotations.owner}")]);
        assert!(
            directory(&req, &missing)
                .unwrap_err()
                .to_string()
                .contains("no annotation \"owner\"")
        );
    }

    fn volume(annotations: &[(&str, &str)], path: &str) -> Volume {
        Volume {
            name: "pvc-1".into(),
            capacity_bytes: 1,
            source: VolumeSource::Nfs(NfsSource {
                server: "nfs.example.com".into(),
                path: path.into(),
                read_only: false,
            }),
            reclaim_policy: ReclaimPolicy::Delete,
            storage_class_name: "nfs".into(),
            labels: vec![],
            annotations: annotations.iter().map(|(k, v)| pair(k, v)).collect(),
            node_affinity: vec![],
            claim_namespace: None,
            claim_name: None,
        }
    }

    #[test]
    fn deletion_reads_the_annotations_not_the_class() {
        let config = NfsConfig::parse(CONFIG).unwrap();
        let v = volume(
            &[
                (DIR_ANNOTATION, "team-a/db"),
                (ON_DELETE_ANNOTATION, "retain"),
            ],
            "/srv/k8s/team-a/db",
        );
        let deleting_class = class("nfs", &[("onDelete", "delete")]);
        assert_eq!(
            deletion(&v, &config, Some(&deleting_class)).unwrap(),
            ("team-a/db".into(), OnDelete::Retain)
        );
        assert_eq!(
            deletion(&v, &config, None).unwrap(),
            ("team-a/db".into(), OnDelete::Retain)
        );
    }

    #[test]
    fn volumes_of_the_original_provisioner_fall_back_to_path_and_class() {
        let config = NfsConfig::parse(CONFIG).unwrap();
        let v = volume(&[], "/srv/k8s/ns-c-pvc-1");
        assert_eq!(
            deletion(&v, &config, None).unwrap(),
            ("ns-c-pvc-1".into(), OnDelete::Archive)
        );
        let class = class("nfs", &[("archiveOnDelete", "false")]);
        assert_eq!(
            deletion(&v, &config, Some(&class)).unwrap().1,
            OnDelete::Delete
        );
        for path in ["/srv/other/x", "/srv/k8s", "/srv/k8s/../etc"] {
            assert!(
                deletion(&volume(&[], path), &config, None).is_err(),
                "{path}"
            );
        }
        for dir in ["..", "/etc", "a/../../b"] {
            let error =
                deletion(&volume(&[(DIR_ANNOTATION, dir)], "/x"), &config, None).unwrap_err();
            assert!(
                error.starts_with("refusing to delete volume pvc-1"),
                "{error}"
            );
        }
    }

    #[test]
    fn a_clone_copies_the_source_directory_only_from_this_export() {
        let config = NfsConfig::parse(CONFIG).unwrap();
        assert_eq!(config.clone_timeout_ms, 8000, "the default");
        let annotated = |path: &str| volume(&[(DIR_ANNOTATION, "team-a/db")], path);
        // (source PV) ─▶ the directory, or part of the refusal
        let cases: Vec<(Volume, Result<&str, &str>)> = vec![
            (annotated("/srv/k8s/team-a/db"), Ok("team-a/db")),
            (volume(&[], "/srv/k8s/ns-c-pvc-1"), Ok("ns-c-pvc-1")),
            (
                annotated("/srv/other/team-a/db"),
                Err("is not nfs.example.com:/srv/k8s/team-a/db"),
            ),
            (
                volume(&[(DIR_ANNOTATION, "../x")], "/srv/k8s/x"),
                Err("\"..\""),
            ),
            (volume(&[], "/srv/other/x"), Err("not below export-path")),
        ];
        for (source, want) in cases {
            let got = clone_source(&source, &config);
            match (want, got) {
                (Ok(want), Ok(dir)) => assert_eq!(dir, want),
                (Err(want), Err(message)) => assert!(
                    message.starts_with("cannot clone volume pvc-1: ") && message.contains(want),
                    "{message}"
                ),
                (want, got) => panic!("want {want:?}, got {got:?}"),
            }
        }
        let mut elsewhere = annotated("/srv/k8s/team-a/db");
        if let VolumeSource::Nfs(nfs) = &mut elsewhere.source {
            nfs.server = "other.example.com".into();
        }
        assert!(clone_source(&elsewhere, &config).is_err());
    }

    #[test]
    fn archive_names_keep_the_whole_path_and_parents_go_deepest_first() {
        assert_eq!(archive_base("ns-c-pvc-1"), "archived-ns-c-pvc-1");
        assert_eq!(archive_base("ns/a/data"), "archived-ns-a-data");
        assert_eq!(parents("a/b/c"), vec!["a/b", "a"]);
        assert!(parents("a").is_empty());
    }

    #[test]
    fn config_errors_name_the_key() {
        let error = NfsConfig::parse(r#"{"server": "s", "export-path": "rel", "guest-dir": "/e"}"#)
            .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("export-path must be an absolute path"),
            "{error}"
        );
        assert!(
            NfsConfig::parse(r#"{"server": "s"}"#)
                .unwrap_err()
                .to_string()
                .contains("export-path")
        );
    }
}
