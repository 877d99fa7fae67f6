//! The WebAssembly OCI artifact (the CNCF wasm working group's format, what `wkg` and `oci-wasm`
//! push): an OCI image manifest whose config is `application/vnd.wasm.config.v0+json` and whose
//! one layer is the component's bytes, `application/wasm`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::digest::{Digest, DigestError};

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST_MEDIA_TYPE: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST_MEDIA_TYPE: &str =
    "application/vnd.docker.distribution.manifest.list.v2+json";
pub const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.wasm.config.v0+json";
pub const WASM_LAYER_MEDIA_TYPE: &str = "application/wasm";

/// Why a manifest is not a wasm artifact this client installs.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("the manifest is not JSON of an OCI image manifest")]
    Json(#[source] serde_json::Error),
    #[error(
        "{media_type} is an image index, not one artifact's manifest: pull the wasm artifact's own manifest by its digest"
    )]
    Index { media_type: String },
    #[error("the manifest's schemaVersion is {0}, not 2")]
    SchemaVersion(u32),
    #[error(
        "the manifest has {found} layer(s) of media type application/wasm; a wasm artifact has exactly one (layers: {layers})"
    )]
    WasmLayers { found: usize, layers: String },
    #[error("the manifest names a bad digest")]
    Digest(#[source] DigestError),
}

/// A content descriptor.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

impl Descriptor {
    pub fn digest(&self) -> Result<Digest, ArtifactError> {
        Digest::parse(&self.digest).map_err(ArtifactError::Digest)
    }
}

/// An image manifest, with the fields of an index kept only to recognise one.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

/// The config blob's shape (`created`, `architecture`, `os`, `layerDigests`, `component`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WasmConfig {
    pub created: String,
    pub architecture: String,
    pub os: String,
    pub layer_digests: Vec<String>,
    pub component: Option<ComponentInfo>,
}

/// What the component imports and exports, by name (`wasi:cli/environment@0.2.0`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ComponentInfo {
    pub exports: Vec<String>,
    pub imports: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// The top-level imports and exports of a component; empty lists for bytes that are not one
/// (the host, not push, is the judge of what it loads).
pub fn component_info(bytes: &[u8]) -> ComponentInfo {
    let mut info = ComponentInfo::default();
    let mut depth = 0usize;
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        let Ok(payload) = payload else {
            return ComponentInfo::default();
        };
        match payload {
            wasmparser::Payload::Version { encoding, .. } => {
                depth += 1;
                if depth == 1 && encoding != wasmparser::Encoding::Component {
                    return ComponentInfo::default();
                }
            }
            wasmparser::Payload::End(_) => depth = depth.saturating_sub(1),
            // Nested components and modules have imports and exports of their own: not these.
            wasmparser::Payload::ComponentImportSection(reader) if depth == 1 => {
                info.imports.extend(
                    reader
                        .into_iter()
                        .flatten()
                        .map(|i| i.name.name.to_string()),
                );
            }
            wasmparser::Payload::ComponentExportSection(reader) if depth == 1 => {
                info.exports.extend(
                    reader
                        .into_iter()
                        .flatten()
                        .map(|e| e.name.name.to_string()),
                );
            }
            _ => {}
        }
    }
    info
}

/// Reads a manifest, refusing an index (by media type or by shape) with a clear error.
pub fn parse_manifest(bytes: &[u8], content_type: Option<&str>) -> Result<Manifest, ArtifactError> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Shape {
        media_type: Option<String>,
        manifests: Option<serde_json::Value>,
    }
    let shape: Shape = serde_json::from_slice(bytes).map_err(ArtifactError::Json)?;
    let media_type = shape
        .media_type
        .as_deref()
        .or(content_type)
        .unwrap_or_default();
    if shape.manifests.is_some() || [INDEX_MEDIA_TYPE, DOCKER_LIST_MEDIA_TYPE].contains(&media_type)
    {
        return Err(ArtifactError::Index {
            media_type: if media_type.is_empty() {
                INDEX_MEDIA_TYPE.to_string()
            } else {
                media_type.to_string()
            },
        });
    }
    let manifest: Manifest = serde_json::from_slice(bytes).map_err(ArtifactError::Json)?;
    if manifest.schema_version != 2 {
        return Err(ArtifactError::SchemaVersion(manifest.schema_version));
    }
    Ok(manifest)
}

/// The one `application/wasm` layer.
pub fn wasm_layer(manifest: &Manifest) -> Result<&Descriptor, ArtifactError> {
    let wasm: Vec<&Descriptor> = manifest
        .layers
        .iter()
        .filter(|layer| layer.media_type == WASM_LAYER_MEDIA_TYPE)
        .collect();
    match wasm.as_slice() {
        [layer] => Ok(layer),
        _ => Err(ArtifactError::WasmLayers {
            found: wasm.len(),
            layers: manifest
                .layers
                .iter()
                .map(|l| l.media_type.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// What push uploads: the config blob, the layer and the manifest naming both.
#[derive(Debug, Clone)]
pub struct Artifact {
    pub config: Vec<u8>,
    pub config_digest: Digest,
    pub layer_digest: Digest,
    pub manifest: Vec<u8>,
    pub manifest_digest: Digest,
}

/// Builds the artifact of one component; `created` is an RFC 3339 time.
pub fn build(component: &[u8], created: String) -> Artifact {
    let layer_digest = Digest::of(component);
    let config = WasmConfig {
        created,
        architecture: "wasm".into(),
        os: "wasip2".into(),
        layer_digests: vec![layer_digest.to_string()],
        component: Some(component_info(component)),
    };
    let config = serde_json::to_vec(&config).expect("a config serializes");
    let config_digest = Digest::of(&config);
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(MANIFEST_MEDIA_TYPE.into()),
        config: Descriptor {
            media_type: WASM_CONFIG_MEDIA_TYPE.into(),
            digest: config_digest.to_string(),
            size: config.len() as u64,
            annotations: None,
        },
        layers: vec![Descriptor {
            media_type: WASM_LAYER_MEDIA_TYPE.into(),
            digest: layer_digest.to_string(),
            size: component.len() as u64,
            annotations: None,
        }],
        annotations: None,
    };
    let manifest = serde_json::to_vec(&manifest).expect("a manifest serializes");
    let manifest_digest = Digest::of(&manifest);
    Artifact {
        config,
        config_digest,
        layer_digest,
        manifest,
        manifest_digest,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_artifact_reads_back_with_its_one_layer() {
        let artifact = build(b"\0asm fake", "2026-01-01T00:00:00Z".into());
        let manifest = parse_manifest(&artifact.manifest, None).unwrap();
        assert_eq!(manifest.media_type.as_deref(), Some(MANIFEST_MEDIA_TYPE));
        assert_eq!(manifest.config.media_type, WASM_CONFIG_MEDIA_TYPE);
        let layer = wasm_layer(&manifest).unwrap();
        assert_eq!(layer.digest().unwrap(), Digest::of(b"\0asm fake"));
        assert_eq!(layer.size, 9);
        let config: serde_json::Value = serde_json::from_slice(&artifact.config).unwrap();
        assert_eq!(config["architecture"], "wasm");
        assert_eq!(config["os"], "wasip2");
        assert_eq!(config["layerDigests"][0], layer.digest.as_str());
        assert_eq!(config["component"]["exports"], serde_json::json!([]));
    }

    #[test]
    fn a_component_s_top_level_imports_and_exports_are_listed() {
        let component = wat::parse_str(
            r#"(component
                (import "wasi:cli/environment@0.2.0" (instance))
                (component $inner (import "inner-only" (instance)))
                (core module $m)
                (export "m" (core module $m)))"#,
        )
        .unwrap();
        let info = component_info(&component);
        assert_eq!(info.imports, ["wasi:cli/environment@0.2.0"]);
        assert_eq!(info.exports, ["m"]);
        let module = wat::parse_str("(module)").unwrap();
        assert!(component_info(&module).imports.is_empty());
        assert!(component_info(b"not wasm").exports.is_empty());
    }

    #[test]
    fn indexes_and_other_layers_are_refused() {
        let index = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#;
        assert!(matches!(
            parse_manifest(index, None),
            Err(ArtifactError::Index { .. })
        ));
        let image = br#"{"schemaVersion":2,"config":{"mediaType":"a","digest":"sha256:x","size":1},
            "layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:y","size":2}]}"#;
        let manifest = parse_manifest(image, None).unwrap();
        let error = wasm_layer(&manifest).unwrap_err().to_string();
        assert!(error.contains("0 layer(s)"), "{error}");
    }
}
