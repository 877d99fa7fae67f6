//! Applying Kubernetes manifests (multi-document YAML) through discovery and server-side apply.

use anyhow::Context;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{self, Scope};
use serde::Deserialize;

/// `deploy/rbac.yaml`, the RBAC the provisioner is deployed with. Compiled in, so the harness
/// always proves the file in this checkout.
pub const RBAC_YAML: &str = include_str!("../../../deploy/rbac.yaml");

/// Field manager name for server-side apply.
const FIELD_MANAGER: &str = "wp-harness";

/// Applies every document of a multi-document YAML string with the given client.
///
/// Uses server-side apply (forced), so applying again is harmless and updates changed objects.
/// Each kind is resolved through discovery, so any built-in or CRD kind works. Empty documents are
/// skipped; namespaced objects without a namespace go to `default`.
pub async fn apply_yaml(client: &kube::Client, yaml: &str) -> anyhow::Result<()> {
    apply_documents(client, yaml, Mode::ServerSide).await
}

/// Applies every document as `kubectl apply` (client-side) does: created if new, else merged
/// over the existing object (JSON merge patch). For manifests that v1.20's server-side apply
/// refuses although they are valid: deploy/'s Service lists a port without `protocol`, which
/// server-side apply of that release cannot key (the API server defaults it on create).
pub async fn create_or_merge_yaml(client: &kube::Client, yaml: &str) -> anyhow::Result<()> {
    apply_documents(client, yaml, Mode::CreateOrMerge).await
}

#[derive(Clone, Copy)]
enum Mode {
    ServerSide,
    CreateOrMerge,
}

async fn apply_documents(client: &kube::Client, yaml: &str, mode: Mode) -> anyhow::Result<()> {
    for (index, document) in serde_yaml::Deserializer::from_str(yaml).enumerate() {
        let value = serde_yaml::Value::deserialize(document)
            .with_context(|| format!("parsing YAML document {index}"))?;
        if value.is_null() {
            continue;
        }
        let object: DynamicObject = serde_yaml::from_value(value)
            .with_context(|| format!("YAML document {index} is not a Kubernetes object"))?;
        apply_object(client, &object, mode)
            .await
            .with_context(|| format!("applying YAML document {index} ({})", describe(&object)))?;
    }
    Ok(())
}

async fn apply_object(
    client: &kube::Client,
    object: &DynamicObject,
    mode: Mode,
) -> anyhow::Result<()> {
    let types = object.types.as_ref().context("missing apiVersion/kind")?;
    let kind = GroupVersionKind::try_from(types).context("invalid apiVersion")?;
    let name = object
        .metadata
        .name
        .as_deref()
        .context("missing metadata.name")?;
    let (resource, capabilities) = discovery::pinned_kind(client, &kind)
        .await
        .with_context(|| format!("discovering {}/{} {}", kind.group, kind.version, kind.kind))?;
    let api: Api<DynamicObject> = match capabilities.scope {
        Scope::Namespaced => {
            let namespace = object.metadata.namespace.as_deref().unwrap_or("default");
            Api::namespaced_with(client.clone(), namespace, &resource)
        }
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    };
    match mode {
        Mode::ServerSide => {
            api.patch(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(object),
            )
            .await?;
        }
        Mode::CreateOrMerge => match api.create(&PostParams::default(), object).await {
            Err(kube::Error::Api(status)) if status.code == 409 => {
                api.patch(name, &PatchParams::default(), &Patch::Merge(object))
                    .await?;
            }
            created => {
                created?;
            }
        },
    }
    Ok(())
}

fn describe(object: &DynamicObject) -> String {
    let kind = object
        .types
        .as_ref()
        .map_or("<no kind>", |types| types.kind.as_str());
    let name = object.metadata.name.as_deref().unwrap_or("<no name>");
    match object.metadata.namespace.as_deref() {
        Some(namespace) => format!("{kind} {namespace}/{name}"),
        None => format!("{kind} {name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rbac_yaml_parses_into_named_objects() {
        let objects: Vec<DynamicObject> = serde_yaml::Deserializer::from_str(RBAC_YAML)
            .map(|document| DynamicObject::deserialize(document).unwrap())
            .collect();
        let kinds: Vec<String> = objects.iter().map(describe).collect();
        assert_eq!(
            kinds,
            [
                "Namespace wasm-provisioner",
                "ServiceAccount wasm-provisioner/wasm-provisioner",
                "ClusterRole wasm-provisioner",
                "ClusterRoleBinding wasm-provisioner",
                "Role wasm-provisioner/wasm-provisioner-leader-election",
                "RoleBinding wasm-provisioner/wasm-provisioner-leader-election",
            ]
        );
    }
}
