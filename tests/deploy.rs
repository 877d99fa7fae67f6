//! `deploy/` and the docs stay true to the binary: every manifest parses into its Kubernetes
//! type, the kustomization names files that exist, the Deployment only passes flags the binary
//! has, grant files load, and the flag table (in `docs/operating.md`, or wherever it moves among
//! the README and `docs/`) matches `wasm-provisioner run --help`.
//! (Applying the RBAC to a real API server is `tests/e2e_ops.rs`.)

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    Namespace, PersistentVolumeClaim, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::api::storage::v1::StorageClass;
use serde::Deserialize;
use wasm_provisioner::wasm::Grants;

use common::repo;

/// Flags `deploy/` passes that a change under way adds to the binary, not in it yet. Remove them
/// from here when they land (the test then checks them like the rest).
const PENDING_FLAGS: &[&str] = &[];

fn deploy() -> PathBuf {
    repo().join("deploy")
}

/// Every document of a YAML file as a (kind, value) pair.
fn documents(path: &Path) -> Vec<(String, serde_yaml::Value)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            serde_yaml::Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .map(|v| {
            let kind = v["kind"].as_str().unwrap_or_default().to_string();
            (kind, v)
        })
        .collect()
}

/// Parses a document into its typed k8s-openapi struct, so a misspelt field fails here.
fn check_typed(path: &Path, kind: &str, value: serde_yaml::Value) {
    fn strict<T: serde::de::DeserializeOwned + serde::Serialize>(
        path: &Path,
        value: serde_yaml::Value,
    ) {
        let typed: T = serde_yaml::from_value(value.clone())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // Round-trip: a field the type does not know would be dropped, so compare.
        let back = serde_json::to_value(&typed).unwrap();
        let original = serde_json::to_value(&value).unwrap();
        assert_eq!(
            strip_empty(back),
            strip_empty(original),
            "{}: fields unknown to the Kubernetes type",
            path.display()
        );
    }
    match kind {
        "Namespace" => strict::<Namespace>(path, value),
        "ServiceAccount" => strict::<ServiceAccount>(path, value),
        "ClusterRole" => strict::<ClusterRole>(path, value),
        "ClusterRoleBinding" => strict::<ClusterRoleBinding>(path, value),
        "Role" => strict::<Role>(path, value),
        "RoleBinding" => strict::<RoleBinding>(path, value),
        "Deployment" => strict::<Deployment>(path, value),
        "DaemonSet" => strict::<DaemonSet>(path, value),
        "Service" => strict::<Service>(path, value),
        "Secret" => strict::<Secret>(path, value),
        "StorageClass" => strict::<StorageClass>(path, value),
        "PersistentVolumeClaim" => strict::<PersistentVolumeClaim>(path, value),
        other => panic!("{}: unexpected kind {other:?}", path.display()),
    }
}

/// JSON with empty objects/arrays and nulls removed, for comparing round-trips.
fn strip_empty(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, strip_empty(v)))
                .filter(|(_, v)| {
                    !matches!(v, Value::Null) && v != &Value::Object(Default::default())
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(strip_empty).collect()),
        other => other,
    }
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "yaml")
            && !path.ends_with("kustomization.yaml")
        {
            out.push(path);
        }
    }
}

#[test]
fn every_manifest_parses_into_its_kubernetes_type() {
    let mut files = Vec::new();
    yaml_files(&deploy(), &mut files);
    assert!(files.len() >= 4, "{files:?}");
    for file in files {
        for (kind, value) in documents(&file) {
            check_typed(&file, &kind, value);
        }
    }
}

fn kustomization() -> serde_yaml::Value {
    kustomization_in(&deploy())
}

/// The `kustomization.yaml` of `dir`.
fn kustomization_in(dir: &Path) -> serde_yaml::Value {
    let text = std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap();
    serde_yaml::from_str(&text).unwrap()
}

/// A kustomization's `resources`.
fn resources(k: &serde_yaml::Value) -> Vec<&str> {
    k["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect()
}

#[test]
fn kustomization_names_existing_files_and_loadable_grants() {
    let k = kustomization();
    let resources = resources(&k);
    for resource in &resources {
        assert!(
            deploy().join(resource).is_file(),
            "kustomization resource {resource} missing"
        );
    }
    // Every StorageClass it applies is served by a grant file it ships.
    let mut served = Vec::new();
    for generator in k["configMapGenerator"].as_sequence().unwrap() {
        for file in generator["files"].as_sequence().unwrap() {
            let path = deploy().join(file.as_str().unwrap());
            let grants =
                Grants::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            served.push(grants.provisioner.clone());
        }
    }
    for resource in &resources {
        for (kind, value) in documents(&deploy().join(resource)) {
            if kind == "StorageClass" {
                let class: StorageClass = serde_yaml::from_value(value).unwrap();
                assert!(
                    served.contains(&class.provisioner),
                    "{} is not served by a shipped grant: {served:?}",
                    class.provisioner
                );
            }
        }
    }
    // The ConfigMap the Deployment mounts is the generated one.
    let generated = k["configMapGenerator"][0]["name"].as_str().unwrap();
    let deployment = deployment();
    let volumes = deployment.spec.template.spec.unwrap().volumes.unwrap();
    assert!(
        volumes
            .iter()
            .any(|v| v.config_map.as_ref().is_some_and(|c| c.name == generated))
    );
}

fn deployment() -> Deployment {
    let (_, value) = documents(&deploy().join("deployment.yaml"))
        .into_iter()
        .find(|(k, _)| k == "Deployment")
        .expect("a Deployment");
    serde_yaml::from_value(value).unwrap()
}

/// `--flag` → default (None when the help shows none), from `wasm-provisioner run --help`.
fn help_flags() -> BTreeMap<String, Option<String>> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    let mut flags = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in help.lines() {
        let trimmed = line.trim();
        if let Some(rest) = trimmed.strip_prefix("--") {
            let name = format!("--{}", rest.split_whitespace().next().unwrap());
            flags.insert(name.clone(), None);
            current = Some(name);
        } else if let (Some(name), Some(default)) = (&current, trimmed.strip_prefix("[default: ")) {
            flags.insert(
                name.clone(),
                Some(default.trim_end_matches(']').to_string()),
            );
        }
    }
    flags.remove("--help");
    flags
}

#[test]
fn the_deployment_passes_only_real_flags_and_is_locked_down() {
    let flags = help_flags();
    let deployment = deployment();
    let spec = deployment.spec;
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.unwrap();
    let container = &pod.containers[0];
    let args = container.args.clone().unwrap();
    assert_eq!(args[0], "run");
    for arg in &args[1..] {
        let flag = arg.split('=').next().unwrap();
        assert!(
            flags.contains_key(flag) || PENDING_FLAGS.contains(&flag),
            "deploy/deployment.yaml passes {flag}, which `wasm-provisioner run` does not have"
        );
    }
    for pending in PENDING_FLAGS {
        assert!(
            !flags.contains_key(*pending),
            "{pending} exists now: remove it from PENDING_FLAGS"
        );
    }
    // Probes hit the health endpoints on the port --metrics-address serves.
    let port = args
        .iter()
        .find_map(|a| a.strip_prefix("--metrics-address="))
        .unwrap();
    assert!(port.ends_with(":8080"));
    assert_eq!(container.ports.as_ref().unwrap()[0].container_port, 8080);
    let path = |probe: &Option<k8s_openapi::api::core::v1::Probe>| {
        probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|h| h.path.clone())
    };
    assert_eq!(path(&container.liveness_probe).as_deref(), Some("/healthz"));
    assert_eq!(path(&container.readiness_probe).as_deref(), Some("/readyz"));
    let security = container.security_context.as_ref().unwrap();
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    let pod_security = pod.security_context.as_ref().unwrap();
    assert_eq!(pod_security.run_as_non_root, Some(true));
    only_the_serving_container_holds_capabilities(&pod);
    assert!(
        container
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap()
            .contains_key("memory")
    );
    // The plugins directory is a volume, mounted read-only into the provisioner.
    let plugins = args
        .iter()
        .find_map(|a| a.strip_prefix("--plugins="))
        .unwrap();
    let mount = container
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.mount_path == plugins)
        .unwrap();
    assert_eq!(mount.read_only, Some(true));
}

/// The one flag table of the documentation: (file, rows below its header).
fn flag_table() -> (PathBuf, Vec<String>) {
    let docs = std::fs::read_dir(repo().join("docs")).expect("docs/");
    let mut files: Vec<PathBuf> = docs
        .map(|entry| entry.expect("docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    files.push(repo().join("README.md"));
    let mut tables = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let rows: Vec<String> = text
            .lines()
            .skip_while(|l| !l.starts_with("| flag | default | meaning |"))
            .take_while(|l| l.starts_with('|'))
            .skip(2)
            .map(str::to_string)
            .collect();
        if !rows.is_empty() {
            tables.push((file, rows));
        }
    }
    assert!(
        tables.len() == 1,
        "expected one `| flag | default | meaning |` table in README.md and docs/, found {:?}",
        tables.iter().map(|(file, _)| file).collect::<Vec<_>>()
    );
    tables.pop().unwrap()
}

#[test]
fn the_documented_flag_table_matches_run_help() {
    let flags = help_flags();
    let (file, table) = flag_table();
    let file = file.strip_prefix(repo()).unwrap().display().to_string();
    let mut documented = Vec::new();
    for row in &table {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let names: Vec<String> = cells[1]
            .split('`')
            .filter(|s| s.starts_with("--"))
            .map(str::to_string)
            .collect();
        let defaults: Vec<&str> = cells[2].split(" / ").map(str::trim).collect();
        for (i, name) in names.iter().enumerate() {
            assert!(
                flags.contains_key(name) || PENDING_FLAGS.contains(&name.as_str()),
                "{file} documents {name}, which `run --help` lacks"
            );
            if let Some(Some(default)) = flags.get(name) {
                let documented_default = defaults.get(i).or(defaults.first()).unwrap();
                assert_eq!(
                    documented_default.trim_matches('`'),
                    default,
                    "{file}: default of {name}"
                );
            }
            documented.push(name.clone());
        }
    }
    for flag in flags.keys() {
        assert!(
            documented.contains(flag),
            "`run --help` has {flag}, missing from the flag table in {file}"
        );
    }
}

/// `deploy/node/`: the DaemonSet passes only real flags, runs node mode without the whole-controller
/// election, takes its node name from the pod's node, mounts the node's storage where its grant
/// says; the kustomization's files exist and its class is served by its grant.
#[test]
fn the_node_daemonset_runs_node_mode_on_the_nodes_storage() {
    let dir = deploy().join("node");
    let text = std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap();
    let k: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    let mut daemonset = None;
    let mut classes = Vec::new();
    for resource in k["resources"].as_sequence().unwrap() {
        let path = dir.join(resource.as_str().unwrap());
        assert!(path.is_file(), "{} missing", path.display());
        for (kind, value) in documents(&path) {
            match kind.as_str() {
                "DaemonSet" => {
                    daemonset = Some(serde_yaml::from_value::<DaemonSet>(value).unwrap())
                }
                "StorageClass" => {
                    classes.push(serde_yaml::from_value::<StorageClass>(value).unwrap())
                }
                _ => {}
            }
        }
    }
    let grant_file = k["configMapGenerator"][0]["files"][0].as_str().unwrap();
    let grants = Grants::from_file(&dir.join(grant_file)).unwrap();
    for class in &classes {
        assert_eq!(class.provisioner, grants.provisioner);
    }
    let pod = daemonset.expect("a DaemonSet").spec.template.spec.unwrap();
    let container = &pod.containers[0];
    let args = container.args.clone().unwrap();
    let flags = help_flags();
    for arg in &args[1..] {
        let flag = arg.split('=').next().unwrap();
        assert!(
            flags.contains_key(flag),
            "deploy/node passes {flag}, which `run` lacks"
        );
    }
    assert!(args.iter().any(|a| a == "--node-deployment"));
    assert!(args.iter().any(|a| a == "--leader-election=false"));
    let node_name = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(node_name.as_deref(), Some("spec.nodeName"));
    // The granted directory is mounted from the node's disk at the same path.
    let granted = &grants.dirs[0].host;
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| std::path::Path::new(&m.mount_path) == granted.as_path())
        .expect("the granted directory is mounted");
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap();
    assert_eq!(
        volume
            .host_path
            .as_ref()
            .map(|h| std::path::PathBuf::from(&h.path))
            .as_ref(),
        Some(granted)
    );
    assert_eq!(
        container
            .security_context
            .as_ref()
            .unwrap()
            .read_only_root_filesystem,
        Some(true)
    );
    only_the_serving_container_holds_capabilities(&pod);
}

/// The serving container is root with exactly CHOWN, FOWNER and DAC_OVERRIDE (each justified in
/// docs/threat-model.md, "Owners and deletes"); every other container drops all and adds none.
fn only_the_serving_container_holds_capabilities(pod: &k8s_openapi::api::core::v1::PodSpec) {
    let capabilities = |c: &k8s_openapi::api::core::v1::Container| {
        let caps = c
            .security_context
            .as_ref()
            .and_then(|s| s.capabilities.clone())
            .unwrap_or_default();
        (caps.drop.unwrap_or_default(), caps.add.unwrap_or_default())
    };
    let serving = &pod.containers[0];
    let (drop, mut add) = capabilities(serving);
    add.sort();
    assert_eq!(drop, ["ALL"]);
    assert_eq!(add, ["CHOWN", "DAC_OVERRIDE", "FOWNER"]);
    let security = serving.security_context.as_ref().unwrap();
    assert_eq!(security.run_as_user, Some(0));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    for other in pod.init_containers.iter().flatten() {
        let (drop, add) = capabilities(other);
        assert_eq!(drop, ["ALL"], "{}", other.name);
        assert!(add.is_empty(), "{} adds {add:?}", other.name);
        assert_eq!(
            other.security_context.as_ref().and_then(|s| s.run_as_user),
            None,
            "{} runs as the pod's non-root user",
            other.name
        );
    }
}

/// The README is for a newcomer: short, and a way into every document of `docs/`.
#[test]
fn the_readme_is_short_and_links_every_doc() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 150,
        "README.md has {lines} lines; move detail to docs/"
    );
    for entry in std::fs::read_dir(repo().join("docs")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        // The threat model is linked from docs/sandbox.md, where it belongs.
        if name.ends_with(".md") && name != "threat-model.md" {
            assert!(
                readme.contains(&format!("(docs/{name})")),
                "README.md does not link docs/{name}"
            );
        }
    }
}

/// `deploy/registry/`: the init container runs `pull` with flags `pull --help` has, in the
/// provisioner's image, reading the credentials from the image-pull Secret the overlay mounts.
#[test]
fn the_registry_overlay_pulls_with_real_flags_and_mounts_its_secret() {
    let dir = deploy().join("registry");
    let k = kustomization_in(&dir);
    assert_eq!(resources(&k), ["../", "registry-credentials.yaml"]);
    let patch: serde_yaml::Value =
        serde_yaml::from_str(k["patches"][0]["patch"].as_str().unwrap()).unwrap();
    let container: k8s_openapi::api::core::v1::Container =
        serde_yaml::from_value(patch[0]["value"].clone()).unwrap();
    assert_eq!(container.image.as_deref(), Some("wasm-provisioner:0.1.0"));
    let args = container.args.unwrap();
    assert_eq!(args[0], "pull");
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args(["pull", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in args.iter().filter(|a| a.starts_with("--")) {
        let name = flag.split('=').next().unwrap();
        assert!(help.contains(name), "`pull --help` lacks {name}");
    }
    let config = args
        .iter()
        .find_map(|a| a.strip_prefix("--registry-config="))
        .expect("--registry-config");
    let mounts = container.volume_mounts.unwrap();
    let mount = mounts
        .iter()
        .find(|m| config.starts_with(&format!("{}/", m.mount_path)))
        .expect("the config file is on a mount");
    let volume: k8s_openapi::api::core::v1::Volume =
        serde_yaml::from_value(patch[1]["value"].clone()).unwrap();
    assert_eq!(volume.name, mount.name);
    let (kind, secret) = documents(&dir.join("registry-credentials.yaml")).remove(0);
    assert_eq!(kind, "Secret");
    let secret: Secret = serde_yaml::from_value(secret).unwrap();
    assert_eq!(
        volume.secret.unwrap().secret_name,
        secret.metadata.name.clone()
    );
    assert_eq!(
        secret.type_.as_deref(),
        Some("kubernetes.io/dockerconfigjson")
    );
    let key = config.rsplit('/').next().unwrap();
    let data = secret.string_data.unwrap();
    let json: serde_json::Value = serde_json::from_str(&data[key]).unwrap();
    assert!(json["auths"].is_object(), "{json}");
}

/// Rust lines that are neither blank nor comments.
fn code_lines(text: &str) -> usize {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .count()
}

/// The guide's whole guest (path pattern, delete, archive-on-delete) and the template it starts
/// from stay small: what they need belongs in the SDK.
#[test]
fn the_guides_guest_is_at_most_40_lines_on_the_sdk() {
    let guide = std::fs::read_to_string(repo().join("guests/GUIDE.md")).unwrap();
    let start = guide
        .find("cat > src/lib.rs <<'EOF'\n")
        .expect("the guide writes src/lib.rs");
    let body = &guide[start..];
    let body = &body[body.find('\n').unwrap() + 1..];
    let guest = &body[..body.find("\nEOF\n").expect("the heredoc ends")];
    let lines = code_lines(guest);
    assert!(lines <= 40, "the guide's guest is {lines} lines");
    assert!(
        guest.contains("archive") && guest.contains("pathPattern"),
        "{guest}"
    );
    let template = std::fs::read_to_string(repo().join("guests/template/src/lib.rs")).unwrap();
    assert!(code_lines(&template) <= 40, "the template's guest");
}
