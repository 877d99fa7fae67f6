//! `wasm-provisioner test`: a guest replayed against a file of recorded claims and the volumes
//! (or errors) it must return, through the same path `provision` takes.
//!
//! Runs are hermetic: every directory the grant file grants is replaced by a fresh empty one
//! (in the grant and wherever its path appears in the grant's paths and config), and the
//! volumes' paths are mapped back before they are compared, so a fixture records the paths an
//! operator would see and needs no host directory to exist. Cases share one set of directories,
//! in file order, so each case uses its own claim uid.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use serde::{Deserialize, Serialize};
use serde_yaml::Value;

use crate::offline;
use crate::wasm::compiler::CompileLimits;

/// A fixture file.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Fixtures {
    /// The cases, run in order.
    pub cases: Vec<Case>,
}

/// One claim and what the guest must make of it.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Case {
    /// Printed with the outcome.
    pub name: String,
    /// The StorageClass, short form.
    #[serde(default)]
    pub class: ClassFixture,
    /// The claim, short form.
    pub claim: ClaimFixture,
    /// The PV name the case expects (`pvc-<claim uid>`); checked when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv_name: Option<String>,
    /// The node a scheduler selected, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The outcome.
    pub expect: Expect,
}

/// A StorageClass, as much of it as a guest reads.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClassFixture {
    /// `metadata.name` (default `fixture`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `parameters`.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// `reclaimPolicy` (default Delete).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim_policy: Option<String>,
    /// `mountOptions`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mount_options: Vec<String>,
}

/// A claim, as much of it as a guest reads.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClaimFixture {
    /// `metadata.namespace` (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`: decides the PV name.
    pub uid: String,
    /// `spec.resources.requests.storage`.
    pub storage: String,
    /// `spec.accessModes` (default ReadWriteOnce).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub access_modes: Vec<String>,
    /// `spec.volumeMode`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_mode: Option<String>,
    /// `metadata.annotations`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// What a case must come to: a volume or an error (exactly one).
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Expect {
    /// A PV whose `spec` holds this (every key given, recursively; lists whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<Value>,
    /// An error whose text contains this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What `test` found.
pub struct Report {
    /// One line per case.
    pub text: String,
    /// Cases whose outcome differs.
    pub failed: usize,
}

/// Runs `fixtures_file` against `module` under `grant_file`; with `record`, rewrites the file's
/// expectations with what the guest returned instead of comparing.
pub async fn run(
    module: &Path,
    grant_file: &Path,
    fixtures_file: &Path,
    record: bool,
    compiler: Option<CompileLimits>,
) -> anyhow::Result<Report> {
    let text = std::fs::read_to_string(fixtures_file)
        .with_context(|| format!("cannot read {}", fixtures_file.display()))?;
    let mut fixtures: Fixtures = serde_yaml::from_str(&text)
        .with_context(|| format!("{} is not a fixture file", fixtures_file.display()))?;
    let scratch = tempfile_dir()?;
    let (grant, moved) = hermetic_grant(grant_file, scratch.path())?;
    let plugins_dir = scratch.path().join("plugins");
    std::fs::create_dir(&plugins_dir)?;
    std::fs::copy(module, plugins_dir.join("guest.wasm"))
        .with_context(|| format!("cannot read {}", module.display()))?;
    std::fs::write(plugins_dir.join("guest.toml"), grant)?;
    let plugins = offline::load_plugins(&plugins_dir, compiler)?;
    let Some((provisioner, _)) = plugins.iter().next() else {
        bail!("the guest did not load under {}", grant_file.display());
    };
    let provisioner = provisioner.clone();
    let mut report = Report {
        text: String::new(),
        failed: 0,
    };
    for case in &mut fixtures.cases {
        let class = class_of(&case.class, &provisioner)?;
        let claim = claim_of(&case.claim, &class)?;
        let pv_name = format!("pvc-{}", case.claim.uid);
        if let Some(expected) = &case.pv_name
            && *expected != pv_name
        {
            bail!(
                "case {:?}: pv-name {expected} is not pvc-<claim uid> ({pv_name})",
                case.name
            );
        }
        let outcome = offline::provision_pv(&plugins, &class, claim, case.node.as_deref())
            .await
            .map_err(|e| format!("{e:#}"))
            .and_then(|pv| serde_yaml::to_value(pv.spec).map_err(|e| e.to_string()));
        let outcome = match outcome {
            Ok(spec) => Ok(moved.back(spec)),
            Err(error) => Err(moved.back_in_text(&error)),
        };
        if record {
            case.expect = match outcome {
                Ok(spec) => Expect {
                    volume: Some(spec),
                    error: None,
                },
                Err(error) => Expect {
                    volume: None,
                    error: Some(error),
                },
            };
            report.text.push_str(&format!("recorded {}\n", case.name));
            continue;
        }
        match verdict(&case.expect, &outcome) {
            None => report.text.push_str(&format!("ok       {}\n", case.name)),
            Some(why) => {
                report.failed += 1;
                report
                    .text
                    .push_str(&format!("FAILED   {}: {why}\n", case.name));
            }
        }
    }
    if record {
        std::fs::write(fixtures_file, serde_yaml::to_string(&fixtures)?)?;
    } else {
        let passed = fixtures.cases.len() - report.failed;
        report
            .text
            .push_str(&format!("{passed} passed, {} failed\n", report.failed));
    }
    Ok(report)
}

/// Why an outcome is not the expected one; `None` when it is.
fn verdict(expect: &Expect, outcome: &Result<Value, String>) -> Option<String> {
    match (&expect.volume, &expect.error, outcome) {
        (Some(_), Some(_), _) | (None, None, _) => {
            Some("expect needs exactly one of `volume` and `error`".into())
        }
        (Some(want), None, Ok(got)) => {
            let mut at = Vec::new();
            (!contains(got, want, &mut at)).then(|| {
                format!(
                    "spec.{} differs: got\n{}",
                    at.join("."),
                    serde_yaml::to_string(got).unwrap_or_default()
                )
            })
        }
        (Some(_), None, Err(error)) => Some(format!("expected a volume, got: {error}")),
        (None, Some(want), Err(error)) => (!error.contains(want.as_str()))
            .then(|| format!("expected an error with {want:?}, got: {error}")),
        (None, Some(want), Ok(_)) => Some(format!("expected an error with {want:?}, got a volume")),
    }
}

/// Whether `got` holds everything in `want` (maps: every key of `want`, recursively; anything
/// else: equal); `at` is left at the first difference.
fn contains(got: &Value, want: &Value, at: &mut Vec<String>) -> bool {
    match (got, want) {
        (Value::Mapping(got), Value::Mapping(want)) => want.iter().all(|(key, want)| {
            at.push(key.as_str().unwrap_or("?").to_string());
            let ok = got.get(key).is_some_and(|got| contains(got, want, at));
            if ok {
                at.pop();
            }
            ok
        }),
        _ => got == want,
    }
}

fn class_of(fixture: &ClassFixture, provisioner: &str) -> anyhow::Result<StorageClass> {
    let manifest = serde_json::json!({
        "metadata": {"name": fixture.name.as_deref().unwrap_or("fixture")},
        "provisioner": provisioner,
        "parameters": fixture.parameters,
        "reclaimPolicy": fixture.reclaim_policy.as_deref().unwrap_or("Delete"),
        "mountOptions": fixture.mount_options,
    });
    Ok(serde_json::from_value(manifest)?)
}

fn claim_of(fixture: &ClaimFixture, class: &StorageClass) -> anyhow::Result<PersistentVolumeClaim> {
    let modes = if fixture.access_modes.is_empty() {
        vec!["ReadWriteOnce".to_string()]
    } else {
        fixture.access_modes.clone()
    };
    let mut spec = serde_json::json!({
        "storageClassName": class.metadata.name,
        "accessModes": modes,
        "resources": {"requests": {"storage": fixture.storage}},
    });
    if let Some(mode) = &fixture.volume_mode {
        spec["volumeMode"] = serde_json::json!(mode);
    }
    let manifest = serde_json::json!({
        "metadata": {
            "name": fixture.name,
            "namespace": fixture.namespace.as_deref().unwrap_or("default"),
            "uid": fixture.uid,
            "annotations": fixture.annotations,
        },
        "spec": spec,
    });
    serde_json::from_value(manifest).with_context(|| format!("claim {:?}", fixture.name))
}

/// Granted directories moved into the scratch directory, to be moved back in what is shown.
struct Moved(Vec<(String, String)>);

impl Moved {
    fn back_in_text(&self, text: &str) -> String {
        self.0
            .iter()
            .fold(text.to_string(), |text, (scratch, original)| {
                text.replace(scratch.as_str(), original)
            })
    }

    fn back(&self, value: Value) -> Value {
        match value {
            Value::String(text) => Value::String(self.back_in_text(&text)),
            Value::Sequence(items) => {
                Value::Sequence(items.into_iter().map(|v| self.back(v)).collect())
            }
            Value::Mapping(map) => {
                Value::Mapping(map.into_iter().map(|(k, v)| (k, self.back(v))).collect())
            }
            other => other,
        }
    }
}

/// The grant file's text with every `[[dirs]]` host replaced by an empty directory under
/// `scratch`, and that path replaced wherever a string of the grant starts with it.
fn hermetic_grant(grant_file: &Path, scratch: &Path) -> anyhow::Result<(String, Moved)> {
    let text = std::fs::read_to_string(grant_file)
        .with_context(|| format!("cannot read {}", grant_file.display()))?;
    let mut table: toml::Table =
        toml::from_str(&text).with_context(|| format!("{} is not TOML", grant_file.display()))?;
    let base = grant_file.parent().unwrap_or(Path::new("."));
    let mut moved = Vec::new();
    if let Some(toml::Value::Array(dirs)) = table.get("dirs") {
        for (i, dir) in dirs.iter().enumerate() {
            let Some(host) = dir.get("host").and_then(|h| h.as_str()) else {
                continue;
            };
            let host = if Path::new(host).is_absolute() {
                PathBuf::from(host)
            } else {
                base.join(host)
            };
            let fresh = scratch.join(format!("dir{i}"));
            std::fs::create_dir_all(&fresh)?;
            moved.push((host.display().to_string(), fresh.display().to_string()));
        }
    }
    // Longest first, so a directory inside another moves with its own.
    moved.sort_by_key(|(host, _)| std::cmp::Reverse(host.len()));
    replace_paths(&mut table, &moved);
    let undo = moved
        .into_iter()
        .map(|(host, fresh)| (fresh, host))
        .collect();
    Ok((toml::to_string(&table)?, Moved(undo)))
}

fn replace_paths(table: &mut toml::Table, moved: &[(String, String)]) {
    for (_, value) in table.iter_mut() {
        replace_in(value, moved);
    }
}

fn replace_in(value: &mut toml::Value, moved: &[(String, String)]) {
    match value {
        toml::Value::String(text) => {
            for (host, fresh) in moved {
                let rest = text.strip_prefix(host.as_str());
                if let Some(rest) = rest.filter(|r| r.is_empty() || r.starts_with('/')) {
                    *text = format!("{fresh}{rest}");
                    break;
                }
            }
        }
        toml::Value::Array(items) => items.iter_mut().for_each(|v| replace_in(v, moved)),
        toml::Value::Table(table) => replace_paths(table, moved),
        _ => {}
    }
}

fn tempfile_dir() -> anyhow::Result<ScratchDir> {
    let path = std::env::temp_dir().join(format!(
        "wasm-provisioner-test-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir(&path)?;
    Ok(ScratchDir(path))
}

/// A scratch directory removed when the run ends.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_volume_matches_when_it_holds_every_expected_key() {
        let got: Value = serde_yaml::from_str(
            "hostPath: {path: /v/pvc-1, type: DirectoryOrCreate}\ncapacity: {storage: 1Gi}\naccessModes: [ReadWriteOnce]",
        )
        .unwrap();
        let cases = [
            ("hostPath: {path: /v/pvc-1}", None),
            (
                "capacity: {storage: 1Gi}\naccessModes: [ReadWriteOnce]",
                None,
            ),
            ("hostPath: {path: /v/pvc-2}", Some("hostPath.path")),
            ("nfs: {server: x}", Some("nfs")),
            (
                "accessModes: [ReadWriteOnce, ReadOnlyMany]",
                Some("accessModes"),
            ),
        ];
        for (want, differs) in cases {
            let want: Value = serde_yaml::from_str(want).unwrap();
            let mut at = Vec::new();
            assert_eq!(
                contains(&got, &want, &mut at),
                differs.is_none(),
                "{want:?}"
            );
            if let Some(path) = differs {
                assert_eq!(at.join("."), path);
            }
        }
    }

    #[test]
    fn granted_paths_move_into_the_scratch_directory_and_back() {
        let dir = std::env::temp_dir().join(format!("wp-fixture-{}", rand::random::<u64>()));
        std::fs::create_dir(&dir).unwrap();
        let grant = dir.join("g.toml");
        std::fs::write(
            &grant,
            "provisioner = \"p\"\n[[dirs]]\nhost = \"/srv/v\"\nguest = \"/v\"\naccess = \"read-write\"\n\
             [volumes]\npath-prefixes = [\"/srv/v\"]\n[config]\nnode-dir = \"/srv/v\"\nother = \"/srv/vv\"\n",
        )
        .unwrap();
        let scratch = dir.join("scratch");
        let (text, moved) = hermetic_grant(&grant, &scratch).unwrap();
        let fresh = scratch.join("dir0").display().to_string();
        assert!(!text.contains("\"/srv/v\""), "{text}");
        assert!(
            text.contains("\"/srv/vv\""),
            "a sibling with a longer name stays: {text}"
        );
        assert_eq!(text.matches(&fresh).count(), 3, "{text}");
        assert_eq!(
            moved.back_in_text(&format!("{fresh}/pvc-1")),
            "/srv/v/pvc-1"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
