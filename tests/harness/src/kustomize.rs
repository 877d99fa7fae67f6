//! The part of kustomize that `deploy/` and `deploy/node/` use, so the node tests apply them as
//! `kubectl apply -k` would without a kubectl: `resources`, `namespace`, `configMapGenerator`
//! (with a content-hash suffix, references updated) and `images` (`newTag`). Anything else in a
//! kustomization is refused rather than ignored.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use serde::Deserialize;
use serde_yaml::Value;

/// Kinds that have no namespace (kustomize's `namespace:` leaves them alone).
const CLUSTER_KINDS: &[&str] = &[
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "StorageClass",
    "PersistentVolume",
];

/// Keys of a kustomization this renderer understands.
const KNOWN_KEYS: &[&str] = &[
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "configMapGenerator",
    "images",
];

/// Renders the kustomization in `dir` to a multi-document YAML string, after `edit` has had every
/// file's text (resources and generator files alike): the test overlay, e.g. moving a path.
pub fn render_kustomization(dir: &Path, edit: &dyn Fn(&str) -> String) -> anyhow::Result<String> {
    let path = dir.join("kustomization.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let kustomization: Value = serde_yaml::from_str(&text)?;
    let Value::Mapping(map) = &kustomization else {
        bail!("{} is not a mapping", path.display());
    };
    for key in map.keys() {
        let key = key.as_str().unwrap_or_default();
        if !KNOWN_KEYS.contains(&key) {
            bail!(
                "{}: `{key}` is not supported by the harness's kustomize",
                path.display()
            );
        }
    }
    let namespace = kustomization["namespace"].as_str();
    let mut objects = Vec::new();
    for resource in kustomization["resources"]
        .as_sequence()
        .into_iter()
        .flatten()
    {
        let file = dir.join(resource.as_str().context("resource is not a string")?);
        let text = edit(
            &std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?,
        );
        for document in serde_yaml::Deserializer::from_str(&text) {
            let value = Value::deserialize(document)?;
            if !value.is_null() {
                objects.push(value);
            }
        }
    }
    let mut renamed = BTreeMap::new();
    for generator in kustomization["configMapGenerator"]
        .as_sequence()
        .into_iter()
        .flatten()
    {
        let name = generator["name"]
            .as_str()
            .context("generator without name")?;
        let mut data = serde_yaml::Mapping::new();
        for file in generator["files"].as_sequence().into_iter().flatten() {
            let file = file.as_str().context("generator file is not a string")?;
            let path = dir.join(file);
            let text = edit(
                &std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?,
            );
            let key = Path::new(file)
                .file_name()
                .context("generator file without a name")?
                .to_string_lossy()
                .into_owned();
            data.insert(Value::from(key), Value::from(text));
        }
        let hashed = format!("{name}-{}", short_hash(&serde_yaml::to_string(&data)?));
        renamed.insert(name.to_string(), hashed.clone());
        let mut config_map = serde_yaml::Mapping::new();
        config_map.insert("apiVersion".into(), "v1".into());
        config_map.insert("kind".into(), "ConfigMap".into());
        let mut metadata = serde_yaml::Mapping::new();
        metadata.insert("name".into(), hashed.into());
        config_map.insert("metadata".into(), Value::Mapping(metadata));
        config_map.insert("data".into(), Value::Mapping(data));
        objects.push(Value::Mapping(config_map));
    }
    let mut tags = BTreeMap::new();
    for image in kustomization["images"].as_sequence().into_iter().flatten() {
        let name = image["name"].as_str().context("image without name")?;
        let tag = image["newTag"].as_str().context("image without newTag")?;
        tags.insert(name.to_string(), tag.to_string());
    }
    let mut out = String::new();
    for mut object in objects {
        let kind = object["kind"].as_str().unwrap_or_default().to_string();
        if let (Some(namespace), false) = (namespace, CLUSTER_KINDS.contains(&kind.as_str())) {
            object["metadata"]["namespace"] = Value::from(namespace);
        }
        rewrite(&mut object, &renamed, &tags);
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&object)?);
    }
    Ok(out)
}

/// Points `configMap.name` references at generated names and sets image tags, anywhere in a tree.
fn rewrite(value: &mut Value, renamed: &BTreeMap<String, String>, tags: &BTreeMap<String, String>) {
    match value {
        Value::Mapping(map) => {
            if let Some(Value::Mapping(config_map)) = map.get_mut("configMap")
                && let Some(Value::String(name)) = config_map.get_mut("name")
                && let Some(new) = renamed.get(name.as_str())
            {
                *name = new.clone();
            }
            if let Some(Value::String(image)) = map.get_mut("image") {
                let base = image.split(':').next().unwrap_or_default().to_string();
                if let Some(tag) = tags.get(&base) {
                    *image = format!("{base}:{tag}");
                }
            }
            for (_, child) in map.iter_mut() {
                rewrite(child, renamed, tags);
            }
        }
        Value::Sequence(items) => {
            for item in items {
                rewrite(item, renamed, tags);
            }
        }
        _ => {}
    }
}

/// A short content hash for generated names (FNV-1a, hex; kustomize's differs, only
/// "changes when the content does" matters).
fn short_hash(text: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:010x}", hash & 0xff_ffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    #[test]
    fn deploy_renders_with_its_namespace_generated_grants_and_tags() {
        let yaml = render_kustomization(&repo().join("deploy"), &|text| text.to_string()).unwrap();
        let objects: Vec<Value> = serde_yaml::Deserializer::from_str(&yaml)
            .map(|d| Value::deserialize(d).unwrap())
            .collect();
        let config_map = objects.iter().find(|o| o["kind"] == "ConfigMap").unwrap();
        let name = config_map["metadata"]["name"].as_str().unwrap();
        assert!(name.starts_with("wasm-provisioner-grants-"), "{name}");
        assert_eq!(config_map["metadata"]["namespace"], "wasm-provisioner");
        let deployment = objects.iter().find(|o| o["kind"] == "Deployment").unwrap();
        assert!(
            serde_yaml::to_string(deployment).unwrap().contains(name),
            "the Deployment mounts the generated ConfigMap"
        );
        let class = objects
            .iter()
            .find(|o| o["kind"] == "StorageClass")
            .unwrap();
        assert!(class["metadata"].get("namespace").is_none());
    }

    /// deploy/node's marked lines switch enforced sizes on: the grant gets `sizes` and
    /// `enable-quotas`, the container SYS_ADMIN besides its three capabilities, and nothing else
    /// changes; as shipped, neither.
    #[test]
    fn sizes_are_switched_on_by_the_lines_deploy_node_marks() {
        let render = |edit: &dyn Fn(&str) -> String| {
            let yaml = render_kustomization(&repo().join("deploy/node"), edit).unwrap();
            let objects: Vec<Value> = serde_yaml::Deserializer::from_str(&yaml)
                .map(|d| Value::deserialize(d).unwrap())
                .collect();
            let grant =
                objects.iter().find(|o| o["kind"] == "ConfigMap").unwrap()["data"]["hostpath.toml"]
                    .as_str()
                    .unwrap()
                    .to_owned();
            let daemonset = objects.iter().find(|o| o["kind"] == "DaemonSet").unwrap();
            let added = daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]
                ["capabilities"]["add"]
                .clone();
            (grant, added)
        };
        let (grant, added) = render(&|text| text.to_string());
        assert!(!grant.lines().any(|l| l.starts_with("sizes")), "{grant}");
        assert_eq!(
            added,
            serde_yaml::from_str::<Value>(r#"["CHOWN", "FOWNER", "DAC_OVERRIDE"]"#).unwrap()
        );
        let (grant, added) = render(&|text| crate::cluster::with_sizes(text));
        assert!(
            grant.contains("\nsizes = \"btrfs\"") && grant.contains("\nenable-quotas = true"),
            "{grant}"
        );
        assert_eq!(
            added,
            serde_yaml::from_str::<Value>(r#"["CHOWN", "FOWNER", "DAC_OVERRIDE", "SYS_ADMIN"]"#)
                .unwrap()
        );
    }

    #[test]
    fn the_edit_reaches_resources_and_generated_files() {
        let yaml = render_kustomization(&repo().join("deploy/node"), &|text| {
            text.replace("/var/lib/wasm-provisioner/hostpath", "/elsewhere")
        })
        .unwrap();
        assert!(!yaml.contains("/var/lib/wasm-provisioner/hostpath"));
        assert!(yaml.contains("/elsewhere"));
    }

    #[test]
    fn unknown_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kustomization.yaml"), "patches: []\n").unwrap();
        let error = render_kustomization(dir.path(), &|t| t.to_string()).unwrap_err();
        assert!(error.to_string().contains("patches"), "{error}");
    }
}
